//! The training loop of [`Job::run`], in parts (the roles of burn's learner):
//!
//! - [`Cadence`]: the recipe's `[train]` schedule as one value — when to stop, log, report
//!   training metrics, evaluate and checkpoint — instead of closures over the recipe;
//! - [`RunDir`]: the run directory the loop writes (lock, `resolved.toml`, `plan.json`, the
//!   metric files, the progress bar);
//! - [`TrainMetrics`]: the metrics on training batches and the throughput;
//! - [`Stops`]: stop signals, agreed across ranks;
//! - [`Checkpointer`]: what is saved when (periodic, at a stop, the final model) and the fail
//!   points tests use to interrupt a run;
//! - [`Trainer`]: drives them over epochs and steps around [`Job`]'s step.
//!
//! The step itself (sparse and dense parts, the pipeline's staging) is [`Job`]'s; this file
//! decides only what happens around it.

use std::collections::BTreeMap;
use std::time::Instant;

use trainrec_data::Split;
use trainrec_recipe::TrainSection;

use crate::error::EngineError;
use crate::job::Job;
use crate::job_metrics::TrainMetrics;
use crate::pipeline::ReadAhead;
use crate::run_dir::{Progress, RunDir, RunSummary, human};
use crate::runtime::with_torch_seed;

/// The recipe's `[train]` schedule: what happens after which step.
#[derive(Debug)]
pub(crate) struct Cadence {
    steps: Option<u64>,
    epochs: u64,
    log_every: u64,
    metrics_every: Option<u64>,
    eval_every: Option<u64>,
    checkpoint_every: Option<u64>,
    final_checkpoint: bool,
}

impl Cadence {
    pub(crate) fn new(train: &TrainSection) -> Self {
        Self {
            steps: train.steps,
            epochs: train.epochs.unwrap_or(u64::MAX),
            log_every: train.log_every,
            metrics_every: train.metrics_every,
            eval_every: train.eval_every,
            checkpoint_every: train.checkpoint_every,
            final_checkpoint: train.final_checkpoint,
        }
    }

    /// Whether the run has taken all its steps after `step`.
    pub(crate) fn done(&self, step: u64) -> bool {
        self.steps.is_some_and(|n| step >= n)
    }

    /// Whether step `step` reports the mean loss of its window (`train.log_every`).
    pub(crate) fn logs(&self, step: u64) -> bool {
        step.is_multiple_of(self.log_every)
    }

    /// Whether step `step` reports the training metrics (`train.metrics_every`).
    pub(crate) fn reports_metrics(&self, step: u64) -> bool {
        self.metrics_every.is_some_and(|n| step.is_multiple_of(n))
    }

    /// Whether the loop evaluates after step `step` (`train.eval_every`; the last step's
    /// evaluation is the final one, taken once after the loop).
    pub(crate) fn evaluates(&self, step: u64) -> bool {
        self.eval_every.is_some_and(|n| step.is_multiple_of(n)) && self.steps != Some(step)
    }

    /// Whether `train.checkpoint_every` saves after step `step`.
    pub(crate) fn saves(&self, step: u64) -> bool {
        self.checkpoint_every.is_some_and(|n| step.is_multiple_of(n))
    }

    /// Whether something after step `step` reads the id maps (an evaluation or a checkpoint),
    /// so that no batch may be staged (its ids counted) during that step.
    fn reads_state_after(&self, step: u64) -> bool {
        self.evaluates(step) || self.saves(step)
    }
}

/// Stop signals (SIGINT, SIGTERM): a signal on any rank stops every rank after the same step.
#[derive(Default)]
pub(crate) struct Stops {
    /// A stop that waits for the step of the batch staged ahead (whose ids the maps counted).
    after_next: Option<i32>,
}

impl Stops {
    /// Whether a stop waits for the next step.
    fn pending(&self) -> bool {
        self.after_next.is_some()
    }

    /// After a step: the signal that ends the loop now, if any. Collective across ranks.
    fn poll(&mut self, job: &Job) -> Result<Option<i32>, EngineError> {
        if let Some(signal) = self.after_next.take() {
            return Ok(Some(signal));
        }
        if !crate::runtime::stop_handlers_installed() {
            return Ok(None);
        }
        let mine = crate::runtime::stop_signal().unwrap_or(0);
        if !job.any_rank_has(mine != 0)? {
            return Ok(None);
        }
        let signal = if mine != 0 { mine } else { libc::SIGTERM };
        // The id maps already counted the batch staged ahead: train it first.
        if job.pipeline.has_remapped() {
            self.after_next = Some(signal);
            return Ok(None);
        }
        Ok(Some(signal))
    }
}

/// What is saved when (on the run's [`Cadence`]), and the fail points that interrupt a run in
/// tests.
pub(crate) struct Checkpointer {
    /// The step the run started from (nothing to save at the end when it trained nothing).
    first_step: u64,
}

impl Checkpointer {
    /// After step `p.step`: the periodic checkpoint; then, in tests, a `kill -9` stand-in.
    fn after_step(
        &self,
        cadence: &Cadence,
        job: &Job,
        p: &Progress,
        metrics: &TrainMetrics,
        lead: bool,
    ) -> Result<(), EngineError> {
        if cadence.saves(p.step) {
            job.save_checkpoint(p, metrics)?;
        }
        if lead && crate::checkpoint::failpoint("abort-after-step", p.step) {
            // Once rank 0's lines are written: no unwinding, nothing flushed.
            std::process::abort();
        }
        Ok(())
    }

    /// Stopped after step `p.step`: its checkpoint (the loss window and the data position in
    /// it), so the resumed run writes the uninterrupted one's metric lines.
    fn at_stop(&self, cadence: &Cadence, job: &Job, p: &Progress, metrics: &TrainMetrics) -> Result<(), EngineError> {
        // Tests hold the stop here (a slow save) to send a second signal meanwhile.
        if let Some(ms) = crate::checkpoint::failpoint_value("stop-hold-ms") {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        if !cadence.saves(p.step) {
            job.save_checkpoint(p, metrics)?;
        }
        Ok(())
    }

    /// The trained model, unless `checkpoint_every` saved this step already (or nothing
    /// trained: a run resumed from its last step).
    fn at_end(&self, cadence: &Cadence, job: &Job, p: &Progress, metrics: &TrainMetrics) -> Result<(), EngineError> {
        if cadence.final_checkpoint && !cadence.saves(p.step) && p.step > self.first_step {
            job.save_checkpoint(p, metrics)?;
        }
        Ok(())
    }
}

/// How the loop ended.
enum End {
    /// The steps or epochs ran out.
    Done,
    /// A stop signal.
    Stopped(i32),
}

/// The training loop's state around [`Job`]'s step.
pub(crate) struct Trainer {
    cadence: Cadence,
    run_dir: RunDir,
    metrics: TrainMetrics,
    progress: Progress,
    stops: Stops,
    checkpointer: Checkpointer,
    start: Instant,
    start_samples: u64,
    /// Whether the train pipeline reads a batch ahead.
    pipelined: bool,
    /// Whether the job has id maps (managed collisions, dynamic tables).
    remaps: bool,
}

impl Trainer {
    /// Locks the run directory, restores the checkpoint [`Job::resume_from`] named (if any),
    /// and writes the directory's fixed files.
    pub(crate) fn start(job: &mut Job) -> Result<Self, EngineError> {
        let lead = job.sync.as_ref().is_none_or(|s| s.pg.rank() == 0);
        let mut run_dir = RunDir::lock(job.recipe.output_dir(), lead, job.sync.as_ref())?;
        let resume = job.resume.take();
        let cadence = Cadence::new(&job.recipe.train);
        let mut metrics = TrainMetrics::new(job)?;
        let progress = match &resume {
            Some(ck) => job.restore(ck, &mut metrics)?,
            None => Progress { world_size: job.sync.as_ref().map_or(1, |s| s.pg.world_size()), ..Default::default() },
        };
        let resumed_at = resume.as_ref().map(|_| progress.step);
        drop(resume);
        run_dir.open(&job.resolved_toml, &job.plan, resumed_at, cadence.steps, job.recipe.train.progress)?;
        let pipeline = &job.recipe.pipeline;
        // A job with managed collisions or dynamic tables has batch i+1's ids remapped when it
        // is staged, during step i (the rows it hands to new ids are reset after step i's
        // update), so it trains as `base` does. Tables remapped on their owning ranks remap
        // after the input dist, in the step: those jobs train as `base`.
        let pipelined = pipeline.reads_ahead() && !job.mc.has_owner_remap() && !job.sparse.lookup_only();
        if pipeline.reads_ahead() && job.mc.has_owner_remap() {
            tracing::warn!(
                "pipeline.kind = {:?}: a job whose managed-collision or dynamic tables are remapped on their \
                 owning ranks trains as `base` (the remap follows each batch's input dist)",
                pipeline.kind
            );
        }
        Ok(Self {
            checkpointer: Checkpointer { first_step: progress.step },
            cadence,
            run_dir,
            metrics,
            start_samples: progress.samples,
            progress,
            stops: Stops::default(),
            start: Instant::now(),
            pipelined,
            remaps: !job.mc.is_empty(),
        })
    }

    /// Trains epoch after epoch until the steps or epochs run out or a stop signal comes.
    fn train(&mut self, job: &mut Job) -> Result<End, EngineError> {
        for epoch in self.progress.epoch..self.cadence.epochs {
            if self.cadence.done(self.progress.step) {
                break;
            }
            if epoch != self.progress.epoch {
                (self.progress.epoch, self.progress.in_epoch) = (epoch, 0);
            }
            let _span = tracing::info_span!("epoch", epoch).entered();
            let mut feed = self.feed(job, epoch)?;
            if let Some(end) = self.epoch(job, &mut feed)? {
                job.pipeline.discard(&mut job.sparse);
                return Ok(end);
            }
            // Nothing staged outlives its epoch (a dropped batch's input dist and prefetch).
            job.pipeline.discard(&mut job.sparse);
            if self.progress.in_epoch == 0 && feed.dropped {
                return Err(EngineError::Pipeline(
                    "pipeline.execute_all_batches = false drops the batch in flight when an epoch's data ends, \
                     and this epoch has only one batch: set it to true or give the epoch more data"
                        .into(),
                ));
            }
            if self.progress.in_epoch == 0 {
                return Err(EngineError::EmptySplit("train"));
            }
        }
        job.pipeline.discard(&mut job.sparse);
        Ok(End::Done)
    }

    /// Epoch `epoch`'s batches on this rank, as the pipeline reads them, past those a resumed
    /// run had read.
    fn feed(&self, job: &Job, epoch: u64) -> Result<ReadAhead, EngineError> {
        let bs = job.recipe.data.batch_size;
        let batches = job.sampler.batches(Split::Train, epoch, bs)?;
        // Shuffled within this rank's share, from (seed, epoch, rank): a resumed run that
        // skips the batches it had read reads the uninterrupted run's next ones.
        let batches = match &job.recipe.data.shuffle {
            Some(s) => {
                let rank = job.sync.as_ref().map_or(0, |s| s.pg.rank());
                trainrec_data::shuffled(batches, s, bs, trainrec_data::shuffle_seed(job.recipe.run.seed, epoch, rank))
            }
            None => batches,
        };
        let mut feed = ReadAhead::new(batches, self.pipelined, job.recipe.pipeline.execute_all_batches);
        feed.skip(self.progress.in_epoch)?;
        Ok(feed)
    }

    /// The steps of one epoch; `None` when its data ended, otherwise how the run ended.
    fn epoch(&mut self, job: &mut Job, feed: &mut ReadAhead) -> Result<Option<End>, EngineError> {
        while let Some(batch) = feed.next_batch(|has| job.all_ranks_have(has))? {
            let step = self.progress.step + 1;
            // The libtorch generator (dropout) restarts from the seed and step, so a resumed
            // run draws what an uninterrupted one does.
            with_torch_seed((job.recipe.run.seed ^ (step - 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) as i64, || ());
            // A failed read of the next batch is reported after this one is trained, as
            // `base` would.
            let read_error = feed.read_ahead(!self.cadence.done(step), |has| job.all_ranks_have(has))?;
            if feed.dropped {
                break;
            }
            let _step_span = tracing::debug_span!("step", step).entered();
            // A learning-rate schedule is at the run's step (a resumed run's included).
            job.updates = step - 1;
            // With id maps, a batch is staged (its ids counted) only during a step after which
            // nothing reads the maps: not before an evaluation, a checkpoint or a stop.
            let stage = !self.remaps || !(self.cadence.reads_state_after(step) || self.stops.pending());
            let ahead = feed.ahead().filter(|_| stage);
            let (loss, predictions, examples) = job.train_step_with(&batch, self.metrics.wants_predictions(), ahead)?;
            self.metrics.feed(job, predictions.as_deref(), &batch)?;
            self.progress.advance(examples, loss);
            self.metrics.throughput.update(examples as u64);
            self.after_step(job)?;
            if let Some(e) = read_error {
                return Err(e.into());
            }
            if let Some(signal) = self.stops.poll(job)? {
                return Ok(Some(End::Stopped(signal)));
            }
            if self.cadence.done(step) {
                return Ok(Some(End::Done));
            }
        }
        Ok(None)
    }

    /// After a step: its `train` line, the evaluation and the checkpoint the cadence asks for.
    fn after_step(&mut self, job: &mut Job) -> Result<(), EngineError> {
        let step = self.progress.step;
        self.run_dir.bar().inc(1);
        // One `train` line per step that reports anything.
        let mut values = BTreeMap::new();
        if self.cadence.logs(step) {
            values = self.loss_values(job)?;
        }
        if self.cadence.reports_metrics(step) {
            values.extend(self.metrics.values(job));
        }
        if !values.is_empty() {
            self.run_dir.write(step, "train", &values)?;
        }
        if self.cadence.evaluates(step) {
            let m = job.evaluate()?;
            if self.run_dir.lead() {
                tracing::info!(step, metrics = ?m, "eval");
            }
            self.run_dir.write(step, "eval", &m)?;
            self.progress.set_last_eval(&m);
        }
        self.checkpointer.after_step(&self.cadence, job, &self.progress, &self.metrics, self.run_dir.lead())
    }

    /// The loss window's mean (which closes) with the values reported beside it: throughput,
    /// id-map and cache counters, learning rates.
    fn loss_values(&mut self, job: &Job) -> Result<BTreeMap<String, f64>, EngineError> {
        let step = self.progress.step;
        let mean = self.progress.close_window().unwrap_or(f64::NAN);
        let rate = (self.progress.samples - self.start_samples) as f64 / self.start.elapsed().as_secs_f64();
        let bar = self.run_dir.bar();
        bar.set_message(format!("loss {mean:.4} · {} samples/s", human(rate)));
        if bar.is_hidden() && self.run_dir.lead() {
            tracing::info!(step, loss = mean, samples_per_s = rate as u64, "train");
        }
        let mut values = BTreeMap::from([("loss".to_string(), mean)]);
        values.extend(self.metrics.throughput.compute());
        values.extend(job.mc.report(job.sync.as_ref().map(|s| s.pg.as_ref()))?);
        values.extend(job.cache_values_of_all_ranks()?);
        values.extend(job.lr_values());
        Ok(values)
    }

    /// After the loop: at a stop, its checkpoint and [`EngineError::Stopped`]; otherwise the
    /// last loss window, the final evaluation (the last step's, when the cadence took it) and
    /// the final model.
    fn finish(mut self, job: &mut Job, end: End) -> Result<RunSummary, EngineError> {
        let p = &mut self.progress;
        if let End::Stopped(signal) = end {
            self.checkpointer.at_stop(&self.cadence, job, p, &self.metrics)?;
            let run_dir = self.run_dir.path().to_path_buf();
            self.run_dir.finish()?;
            return Err(EngineError::Stopped { signal, step: p.step, run_dir });
        }
        if let Some(mean) = p.close_window() {
            self.run_dir.write(p.step, "train", &BTreeMap::from([("loss".to_string(), mean)]))?;
        }
        let final_eval = match p.last_eval() {
            Some(m) if self.cadence.evaluates(p.step) => m,
            _ => {
                let m = job.evaluate()?;
                self.run_dir.write(p.step, "eval", &m)?;
                p.set_last_eval(&m);
                m
            }
        };
        self.checkpointer.at_end(&self.cadence, job, p, &self.metrics)?;
        let output_dir = self.run_dir.path().to_path_buf();
        self.run_dir.finish()?;
        let last_loss = f64::from_bits(p.last_loss);
        Ok(RunSummary {
            steps: p.step,
            samples: p.samples,
            train_seconds: self.start.elapsed().as_secs_f64(),
            eval: final_eval,
            train_loss: (p.first_loss.map_or(last_loss, f64::from_bits), last_loss),
            output_dir,
        })
    }

    /// Runs the loop to its end.
    pub(crate) fn run(mut self, job: &mut Job) -> Result<RunSummary, EngineError> {
        let end = self.train(job)?;
        self.finish(job, end)
    }
}

impl Job {
    /// Trains for the recipe's steps or epochs, evaluating on its cadence, and writes the run
    /// directory (`resolved.toml`, `metrics.jsonl`, checkpoints every `train.checkpoint_every`
    /// steps). After [`Job::resume_from`] it goes on from the checkpoint, keeping the lines of
    /// the metric files up to its step.
    ///
    /// Across ranks every rank calls it: rank 0 writes the run directory and shows progress;
    /// the losses and metrics it reports are the global batch's.
    pub fn run(&mut self) -> Result<RunSummary, EngineError> {
        Trainer::start(self)?.run(self)
    }
}
