//! A training job built from a validated recipe: sampler, embedding tables, dense model,
//! optimizers, metrics and train pipeline; the training loop over epochs and steps, with
//! evaluations and checkpoints on the recipe's cadence.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use tch::{Device, nn};
use trainrec_comm::ProcessGroup;
use trainrec_data::{Batch, FeatureSchema, Sampler, SamplerContext};
use trainrec_embedding::EmbeddingBagCollection;
use trainrec_models::{DenseModel, DenseOptimizer};
use trainrec_recipe::{FeatureRef, LoadedRecipe, MetricSection, Recipe};

use crate::data_parallel::{DEFAULT_BUCKET_MIB, DataParallel};
use crate::error::EngineError;
use crate::inputs::{
    BatchLayout, NextItemSpec, RetrievalSpec, job_tasks, next_item_spec, planned_tables, retrieval_spec,
};
use crate::managed_collisions::McTables;
use crate::pipeline::{Pipeline, StepParts};
use crate::registry::Registry;
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
    /// What `full_ranking` ranks, when the recipe asks for it.
    pub(crate) next_item: Option<NextItemSpec>,
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
        let inputs = crate::inputs::model_inputs(&recipe, features, tasks.len());
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
                let sequences = crate::sequence_tables::SequenceTables::of(&recipe, &plan, Some(pg.clone()))?;
                (
                    SparseArch::train(Box::new(sharded), sequences),
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
                        (SparseArch::train(Box::new(on_gpu), None), None)
                    }
                    None => (
                        SparseArch::train(
                            Box::new(ebc),
                            crate::sequence_tables::SequenceTables::of(&recipe, &plan, None)?,
                        ),
                        None,
                    ),
                }
            }
        };
        // Position weights are dense parameters: in the model's store, before its optimizer.
        sparse.attach_position_weights(&recipe, &vs.root());
        let retrieval =
            retrieval_spec(&recipe, model.as_ref()).map_err(|d| EngineError::Recipe(loaded.locate(vec![d])))?;
        let next_item =
            next_item_spec(&recipe, model.as_ref()).map_err(|d| EngineError::Recipe(loaded.locate(vec![d])))?;
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
            next_item,
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
    pub(crate) fn all_ranks_have(&self, has: bool) -> Result<bool, EngineError> {
        match &self.sync {
            Some(sync) => sync.all_have(has),
            None => Ok(has),
        }
    }

    /// Whether any rank has `has` (collective across ranks; this rank's alone otherwise).
    pub(crate) fn any_rank_has(&self, has: bool) -> Result<bool, EngineError> {
        match &self.sync {
            Some(sync) => sync.any_has(has),
            None => Ok(has),
        }
    }

    /// The cache counters of every rank's cached tables (collective across ranks): a shard's
    /// name is unique to its rank, so rank 0 writes every cached shard's counters.
    pub(crate) fn cache_values_of_all_ranks(&self) -> Result<BTreeMap<String, f64>, EngineError> {
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
    pub(crate) fn train_step_with(
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
            self.sparse.set_lr_multiplier(m)?;
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
}
