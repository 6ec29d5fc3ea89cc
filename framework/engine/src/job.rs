//! A training job built from a validated recipe: sampler, embedding tables, dense model,
//! optimizers, metrics and train pipeline; the training loop over epochs and steps, with
//! evaluations and checkpoints on the recipe's cadence.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use indicatif::ProgressBar;
use tch::{Device, nn};
use trainrec_comm::ProcessGroup;
use trainrec_data::{Batch, FeatureSchema, Sampler, SamplerContext, Split};
use trainrec_embedding::EmbeddingBagCollection;
use trainrec_metrics::ThroughputMetric;
use trainrec_models::{DenseModel, DenseOptimizer, ModelInputs};
use trainrec_recipe::{FeatureRef, LoadedRecipe, MetricSection, Recipe};

use crate::data_parallel::{DEFAULT_BUCKET_MIB, DataParallel};
use crate::error::EngineError;
use crate::inputs::{BatchLayout, RetrievalSpec, job_tasks, planned_tables, retrieval_spec, sparse_outputs};
use crate::managed_collisions::McTables;
use crate::pipeline::{Pipeline, ReadAhead, StepParts};
use crate::registry::Registry;
use crate::run_dir::{
    MetricsLog, Progress, RunSummary, human, log_write, progress_bar, truncate_metrics, write_atomic,
};
use crate::runtime::{configure_threads, with_torch_seed};
use crate::sparse_arch::SparseArch;

/// The runtime objects of a job.
pub struct Job {
    pub(crate) recipe: Recipe,
    pub(crate) resolved_toml: String,
    pub(crate) sampler: Box<dyn Sampler>,
    pub(crate) sparse: SparseArch,
    pub(crate) vs: nn::VarStore,
    /// Across ranks: the group and the data-parallel dense parameters.
    pub(crate) sync: Option<DataParallel>,
    pub(crate) model: Box<dyn DenseModel>,
    pub(crate) dense_opt: DenseOptimizer,
    /// Dense features, label columns and tasks of a batch; the dense model's device.
    pub(crate) layout: BatchLayout,
    /// The plugin metrics the recipe names, by name.
    pub(crate) plugin_metrics: BTreeMap<String, Arc<dyn crate::registry::MetricFactory>>,
    /// The sharding plan (written to the run directory as `plan.json`).
    pub(crate) plan: trainrec_planner::Plan,
    /// What `recall_at_k` ranks, when the recipe asks for it.
    pub(crate) retrieval: Option<RetrievalSpec>,
    /// The managed-collision tables (raw ids remapped before the lookup).
    pub(crate) mc: McTables,
    /// The directory the recipe's relative paths resolve against.
    pub(crate) base_dir: PathBuf,
    /// The checkpoint [`Job::run`] resumes from.
    pub(crate) resume: Option<crate::checkpoint::Checkpoint>,
    /// The train pipeline and what it staged ahead of the next step.
    pub(crate) pipeline: Pipeline,
    /// Updates applied so far (the step a learning-rate schedule is at: [`Job::run`] sets it
    /// from its progress, so a resumed run goes on from its checkpoint's step).
    pub(crate) updates: u64,
}

/// The recipe's sampler as rank `rank` of `world_size` reads it (the recipe must have passed
/// [`crate::check_loaded`]).
pub fn build_sampler(
    loaded: &LoadedRecipe,
    registry: &Registry,
    rank: usize,
    world_size: usize,
) -> Result<Box<dyn trainrec_data::Sampler>, EngineError> {
    let recipe = &loaded.recipe;
    let mut feature_rows = BTreeMap::new();
    for table in &recipe.tables {
        // A managed-collision table's features carry raw ids of its larger id space.
        let space = match (&table.mc, &table.dynamic) {
            (Some(mc), _) => mc.input_hash_size,
            (None, Some(d)) => d.id_space,
            (None, None) => table.rows,
        };
        for f in &table.features {
            feature_rows.insert(FeatureRef::parse(f).input.to_string(), space);
        }
    }
    let kind = recipe.data.sampler.kind().unwrap_or_default();
    let factory =
        registry.sampler_for(kind).ok_or_else(|| EngineError::Internal(format!("sampler {kind} vanished")))?;
    let ctx =
        SamplerContext { feature_rows, base_dir: loaded.base_dir.clone(), seed: recipe.run.seed, rank, world_size };
    Ok(factory.build(&recipe.data.sampler.config(), &ctx)?)
}

impl Job {
    /// Builds every part of a one-rank job. The recipe must have passed
    /// [`crate::check_loaded`]; a recipe with `topology.world_size > 1` is built per rank by
    /// [`Job::build_rank`] (or trained by the launcher, one rank per thread).
    pub fn build(loaded: &LoadedRecipe, features: &FeatureSchema, registry: &Registry) -> Result<Self, EngineError> {
        Self::build_rank(loaded, features, registry, None)
    }

    /// Builds this rank's part of the job: with a process group, the tables sharded by the
    /// plan over its ranks, the sampler reading this rank's share, and the dense model
    /// data-parallel (rank 0's initial parameters); without, one rank.
    pub fn build_rank(
        loaded: &LoadedRecipe,
        features: &FeatureSchema,
        registry: &Registry,
        pg: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<Self, EngineError> {
        let recipe = loaded.recipe.clone();
        let resolved_toml = loaded
            .resolved_toml()
            .map_err(|e| EngineError::Internal(format!("cannot serialize the resolved recipe: {e}")))?;
        if pg.is_none() {
            configure_threads(recipe.run.threads);
        }
        let topo = &recipe.topology;
        let ranks = pg.as_ref().map_or(1, |g| g.world_size());
        let rank = pg.as_ref().map_or(0, |g| g.rank());
        let cuda = match topo.compute_device {
            trainrec_planner::ComputeDevice::Cuda => Some(crate::gpu::prepare(&recipe, loaded, rank)?),
            trainrec_planner::ComputeDevice::Cpu => None,
        };
        let device = cuda.map_or(Device::Cpu, |c| c.dense_device());
        if topo.world_size != ranks {
            let d = trainrec_recipe::Diagnostic::new(
                trainrec_recipe::KeyPath::root().key("topology").key("world_size"),
                format!("the recipe asks for {} ranks but this job has {ranks}", topo.world_size),
            )
            .with_help("`trainrec run` starts one rank per `topology.world_size`");
            return Err(EngineError::Recipe(loaded.locate(vec![d])));
        }
        let (rank, world_size) = pg.as_ref().map_or((0, 1), |g| (g.rank(), g.world_size()));

        let sampler = build_sampler(loaded, registry, rank, world_size)?;

        let vs = nn::VarStore::new(device);
        let (sparse, sparse_dim_keys) = sparse_outputs(&recipe);
        let mut plugin_metrics = BTreeMap::new();
        for m in &recipe.metrics {
            if let MetricSection::Plugin { name, .. } = m {
                let factory = registry
                    .metric_for(name)
                    .ok_or_else(|| EngineError::Internal(format!("plugin metric {name} vanished")))?;
                plugin_metrics.insert(name.clone(), factory);
            }
        }
        let tasks = job_tasks(&recipe, features);
        if tasks.is_empty() {
            return Err(EngineError::Internal("the job has no task (check_loaded reports why)".into()));
        }
        let inputs = ModelInputs { num_dense: features.num_dense, sparse, sparse_dim_keys, num_tasks: tasks.len() };
        let kind = recipe.model.kind().unwrap_or_default();
        let model_factory =
            registry.model_for(kind).ok_or_else(|| EngineError::Internal(format!("model {kind} vanished")))?;
        // Ranks running as threads of one process build one at a time, each from the seed
        // (rank 0's copy is broadcast anyway).
        let model = with_torch_seed(recipe.run.seed as i64, || {
            model_factory.build(&vs.root(), &recipe.model.config(), &inputs)
        })?;
        // The planner's dense reservation counts this model's parameters (the same number
        // validation got from a scratch copy, so a pinned plan's hash still matches).
        let plan_input = trainrec_recipe::plan::plan_input(&recipe, crate::inputs::dense_bytes_of(&vs));
        let plan = crate::inputs::recipe_plan(&plan_input, &recipe, &loaded.base_dir, false)
            .map_err(|e| EngineError::Recipe(loaded.locate(vec![trainrec_recipe::plan::plan_diagnostic(&e)])))?;
        tracing::info!(
            tables = plan.tables.len(),
            world_size,
            max_rank_perf_ms = plan.max_rank_perf,
            inputs_hash = %plan.inputs_hash,
            "sharding plan"
        );
        let (mut sparse, sync) = match pg {
            Some(pg) => {
                // On GPUs the ranks talk through NCCL, bootstrapped over the group they start with.
                let pg = match cuda.and_then(|c| c.gpu()) {
                    Some(gpu) => crate::gpu::nccl_group(pg.as_ref(), gpu, loaded)?,
                    None => pg,
                };
                let mut sharded = crate::sparse_arch::sharded_ebc(&recipe, &plan, pg.clone())?;
                if let Some(target) = cuda {
                    // Each rank's shards and replicas start from the CPU collection's values,
                    // then live on its GPU.
                    let bounds = recipe.embedding.bounds_check;
                    sharded.move_shards(|cpu| {
                        let mut gpu =
                            target.collection(cpu).map_err(|e| trainrec_comm::DistError::Module(e.to_string()))?;
                        gpu.set_bounds_check(bounds);
                        Ok(Box::new(gpu) as Box<dyn trainrec_embedding::TableEngine>)
                    })?;
                    tracing::info!(rank = pg.rank(), gpu = ?target.gpu(), "this rank's shards in the CUDA engine");
                }
                (
                    SparseArch::Train(Box::new(sharded)),
                    Some(DataParallel::new(
                        pg,
                        &vs,
                        recipe.topology.gradient_bucket_mib.unwrap_or(DEFAULT_BUCKET_MIB),
                    )?),
                )
            }
            None => {
                let mut ebc = EmbeddingBagCollection::new(
                    planned_tables(&recipe, &plan),
                    recipe.optimizer.sparse.clone(),
                    recipe.run.seed,
                )?;
                ebc.set_bounds_check(recipe.embedding.bounds_check);
                match cuda {
                    // The tables start from the CPU collection's values, then live on the GPU.
                    Some(target) => {
                        let mut on_gpu = target.collection(&ebc)?;
                        on_gpu.set_bounds_check(recipe.embedding.bounds_check);
                        (SparseArch::Train(Box::new(on_gpu)), None)
                    }
                    None => (SparseArch::Train(Box::new(ebc)), None),
                }
            }
        };
        let retrieval =
            retrieval_spec(&recipe, model.as_ref()).map_err(|d| EngineError::Recipe(loaded.locate(vec![d])))?;
        let dense_opt = DenseOptimizer::new(&vs, &recipe.optimizer.dense)?;
        let mut mc = McTables::new(&recipe, &plan)?;
        mc.attach(&mut sparse, &recipe, &plan)?;
        let recipe_pipeline_kind = recipe.pipeline.kind;
        let (task_loss_weights, weighted) = (crate::inputs::task_loss_weights(&recipe, features), sampler.weighted());
        let gradient_clip = crate::inputs::gradient_clip_columns(&recipe);
        let precision = recipe.train.dense_precision;
        Ok(Self {
            recipe,
            resolved_toml,
            sampler,
            sparse,
            vs,
            sync,
            model,
            dense_opt,
            layout: BatchLayout {
                num_dense: features.num_dense,
                num_labels: features.labels.len(),
                tasks,
                task_loss_weights,
                gradient_clip,
                weighted,
                device,
                precision,
            },
            plugin_metrics,
            plan,
            retrieval,
            mc,
            base_dir: loaded.base_dir.clone(),
            resume: None,
            pipeline: Pipeline::new(recipe_pipeline_kind),
            updates: 0,
        })
    }

    /// One training step; returns the batch's loss: the sum over tasks of the mean binary
    /// cross entropy (the mean for one task).
    pub fn train_step(&mut self, batch: &Batch) -> Result<f64, EngineError> {
        Ok(self.train_step_with(batch, false, None)?.0)
    }

    /// [`Job::train_step`] that also stages `ahead`, the batch to train next, while this
    /// batch's dense forward and backward run, as the recipe's `[pipeline] kind` says: its
    /// input dist across ranks (`sparse_dist`), and its rows loaded into the caches of cached
    /// tables (`prefetch_sparse_dist`). The next call must train `ahead`.
    pub fn train_step_ahead(&mut self, batch: &Batch, ahead: Option<&Batch>) -> Result<f64, EngineError> {
        Ok(self.train_step_with(batch, false, ahead)?.0)
    }

    /// The last training step's phase times on this rank, for sharded jobs: input dist,
    /// lookup, output dist, gradient dist, update (a pipeline's input dist ran on its stage
    /// thread, hidden behind the previous step's dense part).
    pub fn last_step_times(&self) -> Option<trainrec_sharding::StepTimes> {
        self.pipeline.last_times()
    }

    /// The process group of a job trained across ranks.
    pub fn group(&self) -> Option<&std::sync::Arc<dyn trainrec_comm::ProcessGroup>> {
        self.sync.as_ref().map(|s| &s.pg)
    }

    /// Whether every rank has `has` (collective across ranks; this rank's alone otherwise).
    fn all_ranks_have(&self, has: bool) -> Result<bool, EngineError> {
        match &self.sync {
            Some(sync) => sync.all_have(has),
            None => Ok(has),
        }
    }

    /// The cache counters of every rank's cached tables (collective across ranks): a shard's
    /// name is unique to its rank, so rank 0 writes every cached shard's counters.
    fn cache_values_of_all_ranks(&self) -> Result<BTreeMap<String, f64>, EngineError> {
        let mine = self.sparse.cache_metric_values();
        let Some(sync) = &self.sync else { return Ok(mine) };
        use trainrec_comm::ProcessGroupExt;
        let bytes = serde_json::to_vec(&mine).map_err(|e| EngineError::Internal(format!("cache counters: {e}")))?;
        let counts: Vec<usize> = sync.pg.all_gather_u64(bytes.len() as u64)?.into_iter().map(|n| n as usize).collect();
        let all = sync.pg.all_gather_v(&bytes, &counts)?;
        let mut out = BTreeMap::new();
        let mut at = 0;
        for n in counts {
            let part: BTreeMap<String, f64> = serde_json::from_slice(&all[at..at + n])
                .map_err(|e| EngineError::Internal(format!("cache counters from another rank: {e}")))?;
            out.extend(part);
            at += n;
        }
        Ok(out)
    }

    /// The cumulative cache counters of the cached tables, by table.
    pub fn cache_stats_json(&self) -> serde_json::Value {
        serde_json::json!(self.sparse.cache_metric_values())
    }

    /// [`Job::train_step`]; with `want_predictions`, also the batch's predicted probabilities
    /// `[batch, tasks]` row-major (before this step's update); and the examples of the step's
    /// global batch (every rank's). `ahead`, the next batch, is staged as the pipeline says
    /// ([`Pipeline::step`]).
    fn train_step_with(
        &mut self,
        batch: &Batch,
        want_predictions: bool,
        ahead: Option<&Batch>,
    ) -> Result<(f64, Option<Vec<f32>>, usize), EngineError> {
        self.apply_lr_schedules()?;
        let parts = StepParts {
            sparse: &mut self.sparse,
            model: self.model.as_mut(),
            opt: &mut self.dense_opt,
            sync: self.sync.as_ref(),
            mc: &mut self.mc,
            layout: &self.layout,
            clipping: self.recipe.optimizer.dense_clipping.as_ref(),
        };
        let out = self.pipeline.step(parts, batch, want_predictions, ahead)?;
        self.updates += 1;
        Ok(out)
    }

    /// Sets the learning rates of the next update (`self.updates`) as the recipe's
    /// `optimizer.dense_schedule` and `optimizer.sparse_schedule` say.
    fn apply_lr_schedules(&mut self) -> Result<(), EngineError> {
        let o = &self.recipe.optimizer;
        if !o.dense_schedule.is_empty() {
            self.dense_opt.set_lr(o.dense.lr() * trainrec_types::lr_multiplier(&o.dense_schedule, self.updates));
        }
        if !o.sparse_schedule.is_empty() {
            let m = trainrec_types::lr_multiplier(&o.sparse_schedule, self.updates);
            self.sparse.engine_mut()?.set_lr_multiplier(m);
        }
        Ok(())
    }

    /// The learning rates the last update used, when a schedule sets them: `lr_dense`, and
    /// `lr_sparse` (the sparse optimizer's `lr` times the schedule's multiplier).
    pub(crate) fn lr_values(&self) -> BTreeMap<String, f64> {
        let o = &self.recipe.optimizer;
        let last = self.updates.saturating_sub(1);
        let mut out = BTreeMap::new();
        if !o.dense_schedule.is_empty() {
            out.insert("lr_dense".to_string(), self.dense_opt.lr());
        }
        if !o.sparse_schedule.is_empty() {
            let m = trainrec_types::lr_multiplier(&o.sparse_schedule, last);
            out.insert("lr_sparse".to_string(), f64::from(trainrec_embedding::scaled_lr(o.sparse.lr(), m)));
        }
        out
    }

    /// The weights of table `name`, `[rows, dim]` row-major (across ranks: assembled from
    /// every rank's shards; every rank must call it).
    pub fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        self.sparse.table_weights(name)
    }

    /// Replaces table `name`'s weights with `weights`, `[rows, dim]` row-major (each rank
    /// keeps its shards' blocks of it; the optimizer state is kept). For starting a job from
    /// weights trained elsewhere, before [`Job::train_step`] or [`Job::run`].
    pub fn set_table_weights(&mut self, name: &str, weights: &[f32]) -> Result<(), EngineError> {
        // The recipe's shape (a rank may hold no shard of the table).
        let table = self
            .recipe
            .tables
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| EngineError::Internal(format!("no table {name}")))?;
        let (rows, dim) = (table.rows as usize, table.dim);
        if weights.len() != rows * dim {
            return Err(EngineError::Internal(format!(
                "table {name} holds {rows} x {dim} weights, {} given",
                weights.len()
            )));
        }
        let mut shards = self.sparse.local_shards();
        for s in shards.iter_mut().filter(|s| s.table == name) {
            s.weights.clear();
            for r in s.rows.clone() {
                s.weights.extend_from_slice(&weights[r as usize * dim..][s.cols.clone()]);
            }
        }
        self.sparse.load_local_shards(shards)
    }

    /// Replaces the dense model's parameter `name` (as [`Job::dense_parameters`] names it)
    /// with `values`, flattened.
    pub fn set_dense_parameter(&mut self, name: &str, values: &[f32]) -> Result<(), EngineError> {
        let vars = self.vs.variables();
        let var = vars.get(name).ok_or_else(|| EngineError::Internal(format!("no dense parameter {name}")))?;
        if var.numel() != values.len() {
            return Err(EngineError::Internal(format!(
                "dense parameter {name} holds {} values, {} given",
                var.numel(),
                values.len()
            )));
        }
        let src = tch::Tensor::from_slice(values).view(var.size().as_slice()).to_device(var.device());
        tch::no_grad(|| var.shallow_clone().copy_(&src));
        Ok(())
    }

    /// This rank's named state: the dense variables (`dense.<name>`) and its shards of every
    /// table's weights (`sparse.<table>.weight`, with their place in the table). Not
    /// collective.
    pub fn named_state(&self) -> Vec<crate::dmp::StateEntry> {
        let mut out = crate::dmp::dense_entries(&self.vs);
        out.extend(crate::dmp::shard_entries("sparse", &self.sparse.local_shards()));
        out
    }

    /// Where this rank's cached tables (or shards) keep their rows; a table not listed has
    /// every row in the engine's memory.
    pub fn cache_placements(&self) -> Vec<(String, trainrec_embedding::CachePlacement)> {
        self.sparse.engine().map(|e| e.cache_placements()).unwrap_or_default()
    }

    /// The sharding plan the job was built with.
    pub fn plan(&self) -> &trainrec_planner::Plan {
        &self.plan
    }

    /// Each managed-collision table's statistics over the partitions this rank runs (every
    /// partition, the same on every rank, unless the table is remapped on its owning ranks;
    /// the metrics' `mc/*` values sum every rank's).
    pub fn mc_stats(&self) -> BTreeMap<String, trainrec_embedding::mc::McStats> {
        self.mc.stats()
    }

    /// Each dynamic table's counters over the id maps this rank runs (every map, the same on
    /// every rank, unless the table is admitted on its owning ranks; the metrics' `dynamic/*`
    /// values sum every rank's).
    pub fn dynamic_stats(&self) -> BTreeMap<String, trainrec_embedding::dynamic::DynamicStats> {
        self.mc.dynamic.stats()
    }

    /// This rank's shards of every table with their fused optimizer's state.
    pub fn local_shards(&self) -> Vec<trainrec_sharding::LocalShard> {
        self.sparse.local_shards()
    }

    /// The dense model's trainable parameters by name, flattened.
    pub fn dense_parameters(&self) -> BTreeMap<String, Vec<f32>> {
        self.vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(name, t)| (name, crate::tensors::with_f32_slice(&t, |s| s.to_vec())))
            .collect()
    }

    /// Makes [`Job::run`] continue from checkpoint `ck` (taken by a job of the same model,
    /// with any world size and plan) instead of starting afresh.
    pub fn resume_from(&mut self, ck: crate::checkpoint::Checkpoint) {
        self.resume = Some(ck);
    }

    /// Trains for the recipe's steps or epochs, evaluating on its cadence, and writes the run
    /// directory (`resolved.toml`, `metrics.jsonl`, checkpoints every `train.checkpoint_every`
    /// steps). After [`Job::resume_from`] it goes on from the checkpoint, keeping the lines of
    /// the metric files up to its step.
    ///
    /// Across ranks every rank calls it: rank 0 writes the run directory and shows progress;
    /// the losses and metrics it reports are the global batch's.
    pub fn run(&mut self) -> Result<RunSummary, EngineError> {
        let out_dir = self.recipe.output_dir();
        let lead = self.sync.as_ref().is_none_or(|s| s.pg.rank() == 0);
        // One writer per run directory: rank 0 holds its lock until the run ends (every rank
        // learns of a refusal: the others would wait in the first collective otherwise).
        let lock = if lead { Some(crate::run_dir::lock_run_dir(&out_dir, "trainrec run")) } else { None };
        let refused = lock.as_ref().and_then(|l| l.as_ref().err().map(|e| e.to_string()));
        if let Some(sync) = &self.sync
            && !sync.all_have(refused.is_none())?
            && refused.is_none()
        {
            return Err(EngineError::Internal("rank 0 could not lock the run directory".into()));
        }
        let _lock = lock.transpose()?;
        let resume = self.resume.take();

        let train = self.recipe.train.clone();
        // The metrics on training batches (one suite per task), when asked for.
        let mut train_suites = match train.metrics_every {
            Some(_) => {
                let w = Some(train.metrics_window as usize);
                Some((0..self.layout.tasks.len()).map(|_| self.metric_suite(w)).collect::<Result<Vec<_>, _>>()?)
            }
            None => None,
        };
        // TorchRec's throughput metric: examples per second after 100 warm-up steps.
        let mut throughput = ThroughputMetric::new(
            trainrec_metrics::THROUGHPUT_WARMUP_STEPS,
            trainrec_metrics::THROUGHPUT_WINDOW_SECONDS,
        )?;
        let mut p = match &resume {
            Some(ck) => self.restore(ck, train_suites.as_deref_mut(), &mut throughput)?,
            None => Progress { world_size: self.sync.as_ref().map_or(1, |s| s.pg.world_size()), ..Default::default() },
        };
        let mut log = if lead {
            std::fs::create_dir_all(&out_dir).map_err(|e| EngineError::Io { path: out_dir.clone(), source: e })?;
            write_atomic(&out_dir.join("resolved.toml"), self.resolved_toml.as_bytes())?;
            let plan_path = out_dir.join("plan.json");
            trainrec_planner::save_plan(&self.plan, &plan_path)
                .map_err(|e| EngineError::Io { path: plan_path, source: e })?;
            if resume.is_some() {
                truncate_metrics(&out_dir, p.step)?;
            }
            Some(MetricsLog::open(&out_dir.join("metrics.jsonl"), resume.is_some())?)
        } else {
            None
        };
        drop(resume);

        let bs = self.recipe.data.batch_size;
        let bar = if lead { progress_bar(train.steps, train.progress) } else { ProgressBar::hidden() };
        if p.step > 0 {
            bar.set_position(p.step);
        }
        let start = Instant::now();
        let start_samples = p.samples;
        let epochs = train.epochs.unwrap_or(u64::MAX);
        let done = |step: u64| train.steps.is_some_and(|n| step >= n);
        // Whether `checkpoint_every` saves after `step`.
        let periodic_save = |step: u64| train.checkpoint_every.is_some_and(|n| step.is_multiple_of(n));
        let pipeline = self.recipe.pipeline.clone();
        // The pipelines that read ahead. A job with managed collisions or dynamic tables has
        // batch i+1's ids remapped when it is staged, during step i (the rows it hands to new
        // ids are reset after step i's update), so it trains as `base` does. Tables remapped on
        // their owning ranks remap after the input dist, in the step: those jobs train as
        // `base`.
        let pipelined =
            pipeline.reads_ahead() && !self.mc.has_owner_remap() && !matches!(self.sparse, SparseArch::Lookup(_));
        if pipeline.reads_ahead() && self.mc.has_owner_remap() {
            tracing::warn!(
                "pipeline.kind = {:?}: a job whose managed-collision or dynamic tables are remapped on their \
                 owning ranks trains as `base` (the remap follows each batch's input dist)",
                pipeline.kind
            );
        }
        // With id maps, a batch is staged (its ids counted) only during a step after which
        // nothing reads the maps: not before an evaluation, a checkpoint or a stop.
        let remaps = !self.mc.is_empty();
        let eval_step =
            |step: u64| train.eval_every.is_some_and(|n| step.is_multiple_of(n)) && train.steps != Some(step);
        let mut stop_after_next: Option<i32> = None;
        let (first_epoch, first_step) = (p.epoch, p.step);
        let mut stopped: Option<i32> = None;
        'outer: for epoch in first_epoch..epochs {
            if done(p.step) {
                break;
            }
            if epoch != p.epoch {
                (p.epoch, p.in_epoch) = (epoch, 0);
            }
            let _span = tracing::info_span!("epoch", epoch).entered();
            let batches = self.sampler.batches(Split::Train, epoch, bs)?;
            // Shuffled within this rank's share, from (seed, epoch, rank): a resumed run that
            // skips the batches it had read reads the uninterrupted run's next ones.
            let batches = match &self.recipe.data.shuffle {
                Some(s) => {
                    let rank = self.sync.as_ref().map_or(0, |s| s.pg.rank());
                    let seed = trainrec_data::shuffle_seed(self.recipe.run.seed, epoch, rank);
                    trainrec_data::shuffled(batches, s, bs, seed)
                }
                None => batches,
            };
            // The pipelines read batch i+1 ahead (every rank agrees it exists before its input
            // dist starts) and stage it while batch i trains.
            let mut feed = ReadAhead::new(batches, pipelined, pipeline.execute_all_batches);
            // Resuming mid-epoch: the batches the checkpointed run had read.
            feed.skip(p.in_epoch)?;
            while let Some(batch) = feed.next_batch(|has| self.all_ranks_have(has))? {
                // The libtorch generator (dropout) restarts from the seed and step, so a
                // resumed run draws what an uninterrupted one does.
                with_torch_seed((self.recipe.run.seed ^ p.step.wrapping_mul(0x9E37_79B9_7F4A_7C15)) as i64, || ());
                // A failed read of the next batch is reported after this one is trained, as
                // `base` would.
                let read_error = feed.read_ahead(!done(p.step + 1), |has| self.all_ranks_have(has))?;
                if feed.dropped {
                    break;
                }
                let _step_span = tracing::debug_span!("step", step = p.step + 1).entered();
                // A learning-rate schedule is at the run's step (a resumed run's included).
                self.updates = p.step;
                let step_now = p.step + 1;
                let ahead = feed.ahead().filter(|_| {
                    !remaps || !(eval_step(step_now) || periodic_save(step_now) || stop_after_next.is_some())
                });
                let (loss, predictions, examples) = self.train_step_with(&batch, train_suites.is_some(), ahead)?;
                if let (Some(suites), Some(pr)) = (&mut train_suites, &predictions) {
                    self.feed_all_ranks(suites, pr, &batch)?;
                }
                p.step += 1;
                p.in_epoch += 1;
                p.samples += examples as u64;
                let step = p.step;
                throughput.update(examples as u64);
                let mut window = p.window();
                window.0 += loss;
                window.1 += 1;
                bar.inc(1);
                // One `train` line per step that reports anything.
                let mut train_values = BTreeMap::new();
                if step % train.log_every == 0 {
                    let mean = window.0 / window.1 as f64;
                    p.first_loss.get_or_insert(mean.to_bits());
                    p.last_loss = mean.to_bits();
                    window = (0.0, 0);
                    let rate = (p.samples - start_samples) as f64 / start.elapsed().as_secs_f64();
                    bar.set_message(format!("loss {mean:.4} · {} samples/s", human(rate)));
                    if bar.is_hidden() && lead {
                        tracing::info!(step, loss = mean, samples_per_s = rate as u64, "train");
                    }
                    let mut values = BTreeMap::from([("loss".to_string(), mean)]);
                    values.extend(throughput.compute());
                    values.extend(self.mc.report(self.sync.as_ref().map(|s| s.pg.as_ref()))?);
                    values.extend(self.cache_values_of_all_ranks()?);
                    values.extend(self.lr_values());
                    train_values.extend(values);
                }
                p.set_window(window);
                if let (Some(every), Some(suites)) = (train.metrics_every, &train_suites)
                    && step % every == 0
                {
                    train_values.extend(self.values(suites));
                }
                if !train_values.is_empty() {
                    log_write(&mut log, step, "train", &std::mem::take(&mut train_values))?;
                }
                if eval_step(step) {
                    let m = self.evaluate()?;
                    if lead {
                        tracing::info!(step, metrics = ?m, "eval");
                    }
                    log_write(&mut log, step, "eval", &m)?;
                    p.set_last_eval(&m);
                }
                if periodic_save(step) {
                    self.save_checkpoint(&p, train_suites.as_deref(), &throughput)?;
                }
                if lead && crate::checkpoint::failpoint("abort-after-step", step) {
                    // A test's stand-in for `kill -9` (on rank 0, once its lines are written): no
                    // unwinding, nothing flushed.
                    std::process::abort();
                }
                if let Some(e) = read_error {
                    return Err(e.into());
                }
                // A stop signal on any rank: every rank ends after this step, or, when the id
                // maps already counted the batch staged ahead, after that batch's step.
                if let Some(signal) = stop_after_next.take() {
                    stopped = Some(signal);
                    break 'outer;
                }
                if crate::runtime::stop_handlers_installed() {
                    let mine = crate::runtime::stop_signal().unwrap_or(0);
                    let any = match &self.sync {
                        Some(s) => s.any_has(mine != 0)?,
                        None => mine != 0,
                    };
                    if any {
                        let signal = if mine != 0 { mine } else { libc::SIGTERM };
                        if self.pipeline.has_remapped() {
                            stop_after_next = Some(signal);
                        } else {
                            stopped = Some(signal);
                            break 'outer;
                        }
                    }
                }
                if done(step) {
                    break 'outer;
                }
            }
            // Nothing staged outlives its epoch (a dropped batch's input dist and prefetch).
            self.pipeline.discard(&mut self.sparse);
            if p.in_epoch == 0 && feed.dropped {
                return Err(EngineError::Pipeline(
                    "pipeline.execute_all_batches = false drops the batch in flight when an epoch's data ends, \
                     and this epoch has only one batch: set it to true or give the epoch more data"
                        .into(),
                ));
            }
            if p.in_epoch == 0 {
                return Err(EngineError::EmptySplit("train"));
            }
        }
        self.pipeline.discard(&mut self.sparse);
        let (step, samples) = (p.step, p.samples);
        if let Some(signal) = stopped {
            // Tests hold the stop here (a slow save) to send a second signal meanwhile.
            if let Some(ms) = crate::checkpoint::failpoint_value("stop-hold-ms") {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            // Stopped: the step's checkpoint (the loss window and the data position in it) and
            // the metric files as they are, so the resumed run writes the uninterrupted one's.
            if !periodic_save(step) {
                self.save_checkpoint(&p, train_suites.as_deref(), &throughput)?;
            }
            bar.finish_and_clear();
            if let Some(log) = log {
                log.finish()?;
            }
            return Err(EngineError::Stopped { signal, step, run_dir: out_dir });
        }
        let (sum, n) = p.window();
        if n > 0 {
            let mean = sum / n as f64;
            p.first_loss.get_or_insert(mean.to_bits());
            p.last_loss = mean.to_bits();
            log_write(&mut log, step, "train", &BTreeMap::from([("loss".to_string(), mean)]))?;
        }
        let final_eval = match p.last_eval() {
            Some(m) if train.eval_every.is_some_and(|n| step % n == 0) && train.steps != Some(step) => m,
            _ => {
                let m = self.evaluate()?;
                log_write(&mut log, step, "eval", &m)?;
                p.set_last_eval(&m);
                m
            }
        };
        // The trained model, unless `checkpoint_every` saved this step already (or nothing
        // trained: a run resumed from its last step).
        if train.final_checkpoint && !periodic_save(step) && step > first_step {
            self.save_checkpoint(&p, train_suites.as_deref(), &throughput)?;
        }
        bar.finish_and_clear();
        if let Some(log) = log {
            log.finish()?;
        }
        let last_loss = f64::from_bits(p.last_loss);
        Ok(RunSummary {
            steps: step,
            samples,
            train_seconds: start.elapsed().as_secs_f64(),
            eval: final_eval,
            train_loss: (p.first_loss.map_or(last_loss, f64::from_bits), last_loss),
            output_dir: out_dir,
        })
    }
}
