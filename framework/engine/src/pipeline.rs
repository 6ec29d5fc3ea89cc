//! The train pipeline (recipe `[pipeline]`): a step's parts in order, and what runs ahead of
//! it on a second thread while the dense part of the step runs.
//!
//! | `pipeline.kind` | one rank (CPU) | one GPU | sharded |
//! | --- | --- | --- | --- |
//! | `base` | nothing ahead | the batch copied at its step | the input dist at its step |
//! | `sparse_dist` | nothing ahead | batch i+1 copied on the copy stream | batch i+1's input dist |
//! | `prefetch_sparse_dist` | batch i+1's rows into the caches | copied, then its rows into the GPU caches | input dist, then its rows into the shards' caches |
//!
//! [`ReadAhead`] reads the train split so that batch i+1 is known (on every rank) before
//! batch i trains; [`Pipeline::step`] runs one step over a job's [`StepParts`] and keeps the
//! staged batch for the next step.

use tch::{Device, Kind, Tensor};
use trainrec_comm::ProcessGroup;
use trainrec_data::{Batch, BatchStream, DataError};
use trainrec_embedding::{BatchContext, EmbeddingEngine};
use trainrec_models::{Autocast, DenseModel, DenseOptimizer, LossInput, ModelInput};
use trainrec_recipe::PipelineKind;

use crate::data_parallel::DataParallel;
use crate::error::EngineError;
use crate::inputs::{BatchLayout, expand_vbe};
use crate::managed_collisions::{McTables, Resets};
use crate::sparse_arch::{Pooled, SparseArch};

/// The train split's batches as the pipeline reads them: with a pipeline that reads ahead,
/// batch i+1 is read (and every rank agrees it exists) before batch i trains.
pub(crate) struct ReadAhead {
    batches: BatchStream,
    reads_ahead: bool,
    execute_all_batches: bool,
    ahead: Option<Batch>,
    first: bool,
    /// Set when the batch in flight was dropped because the epoch's data ended
    /// (`pipeline.execute_all_batches = false`).
    pub dropped: bool,
}

impl ReadAhead {
    /// Reads `batches`, one ahead when `reads_ahead`.
    pub fn new(batches: BatchStream, reads_ahead: bool, execute_all_batches: bool) -> Self {
        Self { batches, reads_ahead, execute_all_batches, ahead: None, first: true, dropped: false }
    }

    /// Skips `n` batches (those a checkpointed run had read of this epoch).
    pub fn skip(&mut self, n: u64) -> Result<(), EngineError> {
        for _ in 0..n {
            if self.batches.next().transpose()?.is_none() {
                break;
            }
        }
        Ok(())
    }

    /// The batch to train now, or `None` when the epoch's data has ended. Across ranks the
    /// epoch ends for all when one rank's data ends (`all_ranks_have`, a collective: no rank
    /// waits in a collective the others never join).
    pub fn next_batch(
        &mut self,
        all_ranks_have: impl Fn(bool) -> Result<bool, EngineError>,
    ) -> Result<Option<Batch>, EngineError> {
        match self.ahead.take() {
            Some(b) => Ok(Some(b)),
            // A pipeline that read ahead and found nothing: the epoch's data ended.
            None if self.reads_ahead && !self.first => Ok(None),
            None => {
                self.first = false;
                let next = self.batches.next().transpose()?;
                let go = all_ranks_have(next.is_some())?;
                Ok(next.filter(|_| go))
            }
        }
    }

    /// With a pipeline that reads ahead and `more` steps to come, reads the batch after the one
    /// about to train (see [`Self::ahead`]). A failed read is returned, to be reported after
    /// this step trains (as `base` would); when the data ended and
    /// `execute_all_batches = false`, [`Self::dropped`] is set and the batch in flight must
    /// not train (TorchRec's `execute_all_batches=False`).
    pub fn read_ahead(
        &mut self,
        more: bool,
        all_ranks_have: impl Fn(bool) -> Result<bool, EngineError>,
    ) -> Result<Option<DataError>, EngineError> {
        let mut read_error = None;
        if self.reads_ahead && more {
            let next = self.batches.next().transpose().unwrap_or_else(|e| {
                read_error = Some(e);
                None
            });
            let go = all_ranks_have(next.is_some())?;
            self.ahead = next.filter(|_| go);
            if self.ahead.is_none() && read_error.is_none() && !self.execute_all_batches {
                self.dropped = true;
            }
        }
        Ok(read_error)
    }

    /// The batch read ahead, which trains next.
    pub fn ahead(&self) -> Option<&Batch> {
        self.ahead.as_ref()
    }
}

/// What a step uses of a job.
pub(crate) struct StepParts<'a> {
    pub sparse: &'a mut SparseArch,
    pub model: &'a mut dyn DenseModel,
    pub opt: &'a mut DenseOptimizer,
    pub sync: Option<&'a DataParallel>,
    pub mc: &'a mut McTables,
    pub layout: &'a BatchLayout,
    /// The dense gradients' clipping (`optimizer.dense_clipping`).
    pub clipping: Option<&'a trainrec_types::DenseClipping>,
}

/// A job's train pipeline: its kind, and the batch it staged ahead of the next step.
pub(crate) struct Pipeline {
    kind: PipelineKind,
    /// A pipeline that reads ahead: the next batch's context from its stage (its input dist
    /// on sharded jobs, its copy on one-GPU jobs).
    staged: Option<BatchContext>,
    /// The last sharded step's phase times (its input dist's wherever it ran).
    last_times: Option<trainrec_sharding::StepTimes>,
    /// A job with managed collisions or dynamic tables: the batch staged ahead with its ids
    /// already remapped (the id maps counted it when it was staged) and the rows its remap
    /// handed to new ids, re-initialised when it trains, after the previous batch's update.
    remapped: Option<(Batch, Resets)>,
}

impl Pipeline {
    /// A pipeline of `kind` with nothing staged.
    pub fn new(kind: PipelineKind) -> Self {
        Self { kind, staged: None, last_times: None, remapped: None }
    }

    /// Whether a batch waits staged with its ids already remapped (the id maps are a batch
    /// ahead of the steps trained).
    pub fn has_remapped(&self) -> bool {
        self.remapped.is_some()
    }

    /// The last training step's phase times on this rank, for sharded jobs.
    pub fn last_times(&self) -> Option<trainrec_sharding::StepTimes> {
        self.last_times
    }

    /// Drops what was staged ahead (a batch that will not train: the epoch or the run ended):
    /// its input dist or GPU copy, and its rows pinned in the caches.
    pub fn discard(&mut self, sparse: &mut SparseArch) {
        self.staged = None;
        self.remapped = None;
        sparse.discard_prefetched();
    }

    /// One training step (`Job::train_step`); with `want_predictions`, also the batch's predicted probabilities
    /// `[batch, tasks]` row-major (before this step's update); and the examples of the step's
    /// global batch (every rank's).
    ///
    /// `ahead`, the next batch, is staged on a second thread while this batch's dense forward
    /// and backward run (see `Job::train_step_ahead`); that thread is the only one to run
    /// collectives meanwhile (the dense gradients' all-reduce waits for it), so every backend
    /// sees one collective at a time. The staged batch waits in the pipeline for the next step.
    pub fn step(
        &mut self,
        parts: StepParts<'_>,
        batch: &Batch,
        want_predictions: bool,
        ahead: Option<&Batch>,
    ) -> Result<(f64, Option<Vec<f32>>, usize), EngineError> {
        let StepParts { sparse: arch, model, opt, sync, mc, layout, clipping } = parts;
        let pg = sync.map(|s| s.pg.as_ref());
        let remapped;
        // The id maps now hold every batch remapped so far: statistics are read live again.
        mc.reported = None;
        let batch = if mc.is_empty() {
            batch
        } else {
            // Managed collisions, dynamic tables: raw ids counted and remapped to rows (when the
            // batch was staged, or now); the rows that changed hands start afresh before the
            // lookup, after the previous batch's update.
            let (b, resets) = match self.remapped.take() {
                Some(staged) => staged,
                None => remap(mc, batch, pg)?,
            };
            for (table, rows, key) in resets {
                arch.reset_rows(&table, &rows, key)?;
            }
            remapped = b;
            &remapped
        };
        // Jobs remapped on the owning ranks run the base pipeline: their input dist and remap
        // happen here.
        let staged = match self.staged.take() {
            Some(st) => Some(st),
            None => mc.stage_train(arch, &batch.sparse)?,
        };
        let (dense, sparse, labels, mut ctx) = tensors(layout, arch, batch, staged)?;
        let sparse = crate::tensors::pooled_leaf(sparse, layout.precision, &*model);
        let ids = batch.sparse.full_batch()?;
        // Sequence features: per-id rows (and the catalogue rows the model asks for) as leaves
        // that receive their gradient.
        let request = model.catalogue();
        let (sequences, catalogue, sequence_ctx) =
            arch.sequence_forward(&ids, layout.device, true, request.as_ref())?;
        // The model's pooled embeddings (the position-weighted features joined, pooled in the
        // graph) and sequence features.
        let (model_pooled, model_sequences) = arch.model_view(&sparse, &sequences)?;
        // Sample weights, and the sum of the global batch's (the loss's denominator): summed
        // across ranks here, before the stage thread may run collectives of its own.
        let weights = match &batch.weights {
            Some(w) => {
                let local: f64 = w.iter().map(|&x| f64::from(x)).sum();
                let total = match sync {
                    Some(sync) if ctx.batch_sizes.is_some() => sync.gather(&[local])?.iter().sum(),
                    _ => local,
                };
                Some((Tensor::from_slice(w).to_device(layout.device), total))
            }
            None => None,
        };
        let mut dense_parts = DenseParts {
            model,
            opt,
            sync,
            tasks: layout.tasks.len(),
            task_loss_weights: layout.task_loss_weights.as_deref(),
            clipping,
            precision: (layout.precision, layout.device),
        };
        let prefetch = self.kind == PipelineKind::PrefetchSparseDist;
        let remaps = !mc.is_empty();
        let stage = match (ahead, &mut arch.pooled) {
            (Some(next), Pooled::Train(engine)) if prefetch || engine.stages_ahead() => {
                Some(Stage { next, engine: engine.as_mut(), prefetch, mc: remaps.then_some((&mut *mc, pg)) })
            }
            _ => None,
        };
        let (dense_part, staged) = std::thread::scope(|scope| {
            let job = stage.map(|stage| {
                std::thread::Builder::new()
                    .name("stage-ahead".into())
                    .spawn_scoped(scope, move || stage.run())
                    .map_err(|e| EngineError::Internal(format!("cannot start the pipeline's stage thread: {e}")))
            });
            let dense_part = {
                let _span = tracing::debug_span!("dense").entered();
                dense_parts.forward_backward(
                    StepTensors {
                        dense: &dense,
                        sparse: &model_pooled,
                        sequences: &model_sequences,
                        catalogue: catalogue.as_ref(),
                        labels: &labels,
                        weights: weights.as_ref(),
                    },
                    &ids,
                    ctx.batch_sizes.as_deref(),
                    batch,
                    want_predictions,
                )
            };
            let staged = job.map(|j| {
                j?.join().unwrap_or_else(|_| Err(EngineError::Internal("the pipeline's stage thread panicked".into())))
            });
            (dense_part, staged)
        });
        // A stage's failure is reported before this batch's update is applied: no rank has
        // applied it (each rank's stage fails in the same collective, or its peers see it leave).
        let (scaled_loss, logits, examples) = dense_part?;
        if let Some((ctx, remapped)) = staged.transpose()? {
            self.staged = Some(ctx);
            self.remapped = remapped;
        }
        let loss_value = dense_parts.finish(scaled_loss, ctx.batch_sizes.is_some())?;
        // The engine reads the gradient tensor's memory in place.
        {
            let _span = tracing::debug_span!("sparse_update").entered();
            // A model that reads no pooled embeddings leaves them no gradient: zeros.
            let grad = match sparse.grad() {
                g if g.defined() => g,
                _ => sparse.zeros_like(),
            };
            crate::inputs::clip_pooled_gradient(&grad, &layout.gradient_clip);
            arch.backward(&batch.sparse, &mut ctx, &grad)?;
            arch.sequence_backward(&ids, &sequences, sequence_ctx)?;
            self.last_times = ctx.times;
        }
        let predictions = match logits {
            Some(logits) if want_predictions => {
                let p = logits.detach().sigmoid().to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]);
                Some(Vec::try_from(&p).map_err(|e| EngineError::Internal(format!("predictions: {e}")))?)
            }
            _ => None,
        };
        Ok((loss_value, predictions, examples))
    }
}

/// The batch's dense features, pooled embeddings and labels as tensors, and the batch's
/// context for its backward (the lookup is collective across ranks when sharded); `staged`:
/// the batch's context from a stage that ran ahead.
pub(crate) fn tensors(
    layout: &BatchLayout,
    arch: &SparseArch,
    batch: &Batch,
    staged: Option<BatchContext>,
) -> Result<(Tensor, Tensor, Tensor, BatchContext), EngineError> {
    let b = batch.batch_size as i64;
    if batch.dense.len() != batch.batch_size * layout.num_dense
        || batch.labels.len() != batch.batch_size * layout.num_labels
        || batch.sparse.examples() != batch.batch_size
    {
        return Err(inconsistent(format!(
            "the sampler produced an inconsistent batch: batch_size {}, {} dense values ({} per example expected), {} labels ({} per example expected), sparse stride {}",
            batch.batch_size,
            batch.dense.len(),
            layout.num_dense,
            batch.labels.len(),
            layout.num_labels,
            batch.sparse.examples()
        )));
    }
    match &batch.weights {
        Some(w) if !layout.weighted || w.len() != batch.batch_size => {
            return Err(inconsistent(format!(
                "the sampler produced {} sample weights for a batch of {} (it says it is {}weighted)",
                w.len(),
                batch.batch_size,
                if layout.weighted { "" } else { "not " }
            )));
        }
        None if layout.weighted => {
            return Err(inconsistent("the sampler says it is weighted but produced a batch without weights".into()));
        }
        _ => {}
    }
    let device = layout.device;
    let mut ctx = staged.unwrap_or_default();
    let (dense, sparse, labels) = match arch.gpu() {
        Some(gpu) => gpu_tensors(layout, arch, gpu, batch, &mut ctx)?,
        None => {
            let dense = Tensor::from_slice(&batch.dense).f_view([b, layout.num_dense as i64])?.to_device(device);
            // A host engine's output (a sharded lookup's comes from its output dist) goes to the
            // dense model's device, when that is a GPU.
            let sparse = arch.forward(&batch.sparse, &mut ctx)?.to_device(device);
            let labels = Tensor::from_slice(&batch.labels).f_view([b, layout.num_labels as i64])?.to_device(device);
            (dense, sparse, labels)
        }
    };
    // [batch, tasks]: each task's label column (all columns, in order, need no selection).
    let identity =
        layout.tasks.len() == layout.num_labels && layout.tasks.iter().enumerate().all(|(t, &(_, c))| t == c);
    let labels = if identity {
        labels
    } else {
        let columns: Vec<i64> = layout.tasks.iter().map(|&(_, c)| c as i64).collect();
        labels.f_index_select(1, &Tensor::from_slice(&columns).to_device(device))?
    };
    Ok((dense, sparse, labels, ctx))
}

/// A data error for a batch that does not match what its sampler declared.
fn inconsistent(message: String) -> EngineError {
    EngineError::Data(trainrec_data::DataError::Config { key: String::new(), message })
}

/// A one-GPU job's dense features, pooled embeddings and labels on the GPU: the batch's
/// ids, dense features and labels copied on the high-priority copy stream (by the pipeline's
/// stage while the previous batch trained, in `ctx`; else now, the `base` pipeline's copy
/// stage), the lookups reading the ids there.
fn gpu_tensors(
    layout: &BatchLayout,
    arch: &SparseArch,
    gpu: &trainrec_cuda::CudaEbc,
    batch: &Batch,
    ctx: &mut BatchContext,
) -> Result<(Tensor, Tensor, Tensor), EngineError> {
    if ctx.state::<trainrec_cuda::StagedBatch>().is_none() {
        let kjt = batch.sparse.full_batch()?;
        ctx.set_state(gpu.stage(&kjt, &batch_parts(batch))?);
    }
    let staged = ctx.state::<trainrec_cuda::StagedBatch>().expect("staged above");
    let dev = crate::tensors::device_of(trainrec_embedding::EmbeddingLookup::memory(gpu));
    let (b, nd, nl) = (batch.batch_size as i64, layout.num_dense as i64, layout.num_labels as i64);
    let parts = staged.parts()?;
    // SAFETY: `parts` are the staged copies of `batch.dense` ([b, nd] floats) and
    // `batch.labels` ([b, nl] floats) in the GPU's memory (host memory on the emulator),
    // valid while the staged batch lives in `ctx`; the default stream waits for their copy
    // (`parts`), and each view is copied into a tensor of libtorch's own on that stream before
    // the lookup below takes the staged batch out of `ctx` and drops it (which frees the slot
    // only once the stream is past these copies).
    let (dense, labels) = unsafe {
        (
            Tensor::from_blob(parts[0] as *const u8, &[b, nd], &[], Kind::Float, dev).copy(),
            Tensor::from_blob(parts[1] as *const u8, &[b, nl], &[], Kind::Float, dev).copy(),
        )
    };
    let sparse = arch.forward(&batch.sparse, ctx)?;
    Ok((dense, sparse, labels))
}

/// A batch's dense features and labels as the host buffers a GPU's stage copies with its ids.
fn batch_parts(batch: &Batch) -> [&[u8]; 2] {
    [bytemuck::cast_slice(&batch.dense), bytemuck::cast_slice(&batch.labels)]
}

/// What the pipeline's second thread does for the next batch while this one's dense part
/// runs: the engine's stage of it (a sharded job's input dist, a one-GPU job's copy) and with
/// `prefetch` its rows into the caches.
struct Stage<'a> {
    next: &'a Batch,
    engine: &'a mut dyn EmbeddingEngine,
    prefetch: bool,
    /// A job with managed collisions or dynamic tables (remapped on every rank): the next
    /// batch's ids are counted and remapped first, here, and `pg` is its ranks'.
    mc: Option<(&'a mut McTables, Option<&'a dyn ProcessGroup>)>,
}

impl Stage<'_> {
    /// The next batch's stage, and with id maps the batch remapped with the rows to reset.
    fn run(self) -> Result<(BatchContext, Option<(Batch, Resets)>), EngineError> {
        let _span = tracing::debug_span!("stage").entered();
        let Some((mc, pg)) = self.mc else {
            return Ok((self.engine.stage(&self.next.sparse, &batch_parts(self.next), self.prefetch)?, None));
        };
        // The statistics the steps up to now report (the maps are about to count the next
        // batch); replicated maps: no collective.
        mc.reported = Some(mc.report(pg)?);
        let (b, resets) = remap(mc, self.next, pg)?;
        let ctx = self.engine.stage(&b.sparse, &batch_parts(&b), self.prefetch)?;
        Ok((ctx, Some((b, resets))))
    }
}

/// A training batch with its raw ids counted and remapped by the job's id maps (one bag per
/// example), and the rows the remap handed to new ids.
fn remap(mc: &mut McTables, batch: &Batch, pg: Option<&dyn ProcessGroup>) -> Result<(Batch, Resets), EngineError> {
    let mut b = batch.clone();
    expand_vbe(&mut b.sparse)?;
    let resets = mc.train(&mut b.sparse, pg)?;
    Ok((b, resets))
}

/// What a training forward gives: the model's own objective (and its scores when predictions
/// are wanted), or logits for the built-in loss.
enum Forward {
    Objective(Tensor, Option<Tensor>),
    Logits(Tensor),
}

/// What a step's dense part uses of a job (apart from the sparse arch, which may be
/// prefetching meanwhile).
struct DenseParts<'a> {
    model: &'a mut dyn DenseModel,
    opt: &'a mut DenseOptimizer,
    sync: Option<&'a DataParallel>,
    tasks: usize,
    /// Each task's weight in the loss (`None`: all 1).
    task_loss_weights: Option<&'a [f64]>,
    clipping: Option<&'a trainrec_types::DenseClipping>,
    /// The precision of the model's matrix products, and the model's device.
    precision: (trainrec_types::DensePrecision, Device),
}

/// One batch's tensors for the dense part of a step: dense features, pooled embeddings (a leaf
/// that receives its gradient), the tasks' labels and, with sample weights, the weights and the
/// global batch's weight sum.
struct StepTensors<'a> {
    dense: &'a Tensor,
    sparse: &'a Tensor,
    /// The sequence features' jagged embeddings (leaves that receive their gradient).
    sequences: &'a [(String, trainrec_models::JaggedEmbeddings)],
    /// The catalogue rows the model asked for (a leaf that receives its gradient).
    catalogue: Option<&'a trainrec_models::Catalogue>,
    labels: &'a Tensor,
    weights: Option<&'a (Tensor, f64)>,
}

impl DenseParts<'_> {
    /// The dense model's forward and backward on one batch (the pooled embeddings `sparse` a
    /// leaf that receives its gradient), with no collective: the loss (this rank's share of
    /// the global batch's across ranks), the logits when they are wanted, and the examples of
    /// the global batch. [`DenseParts::finish`] sums the gradients and updates.
    ///
    /// The loss of the built-in objective is the sum over tasks of `loss_weight` times the
    /// task's mean binary cross-entropy; with sample weights that mean is weighted,
    /// `Σ w_i l_i / Σ w_i` over the global batch (0 when every weight is 0).
    fn forward_backward(
        &mut self,
        t: StepTensors<'_>,
        ids: &trainrec_sparse::KeyedJaggedTensor,
        batch_sizes: Option<&[usize]>,
        batch: &Batch,
        want_predictions: bool,
    ) -> Result<(f64, Option<Tensor>, usize), EngineError> {
        let StepTensors { dense, sparse, sequences, catalogue, labels, weights } = t;
        let model_input = ModelInput { dense, pooled: sparse, sequences, catalogue };
        let input = LossInput { dense, sparse, labels, ids, weights: weights.map(|(w, _)| w), sequences, catalogue };
        // With sample weights the built-in loss is already this rank's share of the global
        // batch's (its denominator is the global weight sum).
        let mut global_share = false;
        // The forward in `train.dense_precision` (an autocast region), the loss and backward
        // in fp32 from its fp32 outputs, as under `torch.autocast`.
        let (precision, device) = self.precision;
        let model = &mut *self.model;
        let forward = Autocast::run(precision, device, || match model.loss(&input) {
            Some(loss) => {
                let scores = want_predictions.then(|| tch::no_grad(|| model.forward_input(&model_input, true)));
                Forward::Objective(loss, scores)
            }
            None => Forward::Logits(model.forward_input(&model_input, true)),
        });
        let (loss, logits) = match forward {
            // The model's own objective; predictions (for training metrics) are its scores.
            Forward::Objective(loss, scores) => (loss.to_kind(Kind::Float), scores.map(|s| s.to_kind(Kind::Float))),
            Forward::Logits(logits) => {
                let logits = logits.to_kind(Kind::Float);
                let loss = match (weights, self.task_loss_weights) {
                    // The sum over tasks of each task's mean binary cross entropy (one task: the mean).
                    (None, None) => {
                        logits.binary_cross_entropy_with_logits::<Tensor>(labels, None, None, tch::Reduction::Mean)
                            * self.tasks as f64
                    }
                    _ => {
                        let per =
                            logits.binary_cross_entropy_with_logits::<Tensor>(labels, None, None, tch::Reduction::None);
                        let per = match self.task_loss_weights {
                            Some(tw) => {
                                per * Tensor::from_slice(tw)
                                    .to_kind(Kind::Float)
                                    .to_device(logits.device())
                                    .view([1, -1])
                            }
                            None => per,
                        };
                        // [batch]: each example's loss summed over tasks.
                        let per_example = per.sum_dim_intlist(1, false, Kind::Float);
                        match weights {
                            Some((w, total)) => {
                                global_share = true;
                                let sum = (per_example * w).sum(Kind::Float);
                                if *total > 0.0 { sum / *total } else { sum * 0.0 }
                            }
                            None => per_example.mean(Kind::Float),
                        }
                    }
                };
                (loss, Some(logits))
            }
        };
        self.opt.zero_grad();
        let examples = batch_sizes.map_or(batch.batch_size, |s| s.iter().sum());
        let loss_value = match (self.sync, batch_sizes) {
            (Some(_), Some(_)) if global_share => {
                loss.backward();
                loss.double_value(&[])
            }
            (Some(_), Some(sizes)) => {
                // This rank's share of the global batch's loss: after the sum across ranks the
                // gradients are the global batch's (see the `sharding` crate).
                let global: usize = sizes.iter().sum();
                let share = batch.batch_size as f64 / global.max(1) as f64;
                let scaled = &loss * share;
                scaled.backward();
                scaled.double_value(&[])
            }
            _ => {
                loss.backward();
                loss.double_value(&[])
            }
        };
        Ok((loss_value, logits, examples))
    }

    /// Across ranks, sums the gradients and the loss shares (collective); then clips the
    /// summed gradients when the recipe says so, and the dense optimizer's update. Returns the
    /// (global) loss.
    fn finish(self, loss: f64, sharded: bool) -> Result<f64, EngineError> {
        let loss = match self.sync {
            Some(sync) if sharded => sync.all_reduce(loss)?,
            _ => loss,
        };
        if let Some(clipping) = self.clipping {
            self.opt.clip_gradients(clipping);
        }
        self.opt.step();
        Ok(loss)
    }
}
