//! A training job built from a validated recipe: sampler, embedding collection, dense model,
//! optimizers and metrics; the train/eval loop; the run directory.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tch::{Device, Kind, Tensor, nn};
use trainrec_data::{Batch, FeatureSchema, Sampler, SamplerContext, Split};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig};
use trainrec_metrics::sinks::{CsvSink, TensorBoardSink};
use trainrec_metrics::{
    AucMetric, AuprcMetric, LifetimeMetric, Metric, MetricSuite, NeMetric, SessionMetric, SessionMetricKind,
    SplitAuprc, SumMetric, SumMetricKind, TaskBatch, ThroughputMetric,
};
use trainrec_models::{DenseModel, DenseOptimizer, LossInput, ModelInputs};
use trainrec_recipe::{FeatureRef, LoadedRecipe, MetricSection, Recipe};

use std::sync::Arc;

use trainrec_dist::{DistContext, ProcessGroup};

use crate::check::sparse_outputs;
use checkpointing::Progress;

#[path = "job_checkpoint.rs"]
mod checkpointing;
use crate::dist::{DEFAULT_BUCKET_MIB, DataParallel, SparseArch};
use crate::error::EngineError;
use crate::registry::Registry;

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Training steps taken.
    pub steps: u64,
    /// Training examples seen.
    pub samples: u64,
    /// Wall time of the training loop (evaluation included), seconds.
    pub train_seconds: f64,
    /// The last evaluation's metrics, by name.
    pub eval: BTreeMap<String, f64>,
    /// Mean train loss over the first `log_every` steps and over the last `log_every` steps.
    pub train_loss: (f64, f64),
    /// The run directory.
    pub output_dir: PathBuf,
}

/// The runtime objects of a job.
pub struct Job {
    recipe: Recipe,
    resolved_toml: String,
    sampler: Box<dyn Sampler>,
    sparse: SparseArch,
    vs: nn::VarStore,
    /// Across ranks: the group and the data-parallel dense parameters.
    sync: Option<DataParallel>,
    model: Box<dyn DenseModel>,
    dense_opt: DenseOptimizer,
    num_dense: usize,
    /// (name, label column) per task.
    tasks: Vec<(String, usize)>,
    /// Label columns the sampler writes per example.
    num_labels: usize,
    /// The plugin metrics the recipe names, by name.
    plugin_metrics: BTreeMap<String, std::sync::Arc<dyn crate::registry::MetricFactory>>,
    /// The sharding plan (written to the run directory as `plan.json`).
    plan: trainrec_planner::Plan,
    /// What `recall_at_k` ranks, when the recipe asks for it.
    retrieval: Option<RetrievalSpec>,
    /// The managed-collision tables (raw ids remapped before the lookup).
    mc: crate::mc::McTables,
    /// The directory the recipe's relative paths resolve against.
    base_dir: PathBuf,
    /// The checkpoint [`Job::run`] resumes from.
    resume: Option<crate::checkpoint::Checkpoint>,
    /// A pipeline that reads ahead: the next batch after its input dist (sharded jobs), or
    /// copied to the GPU (one-GPU jobs).
    staged: Option<Ahead>,
    /// The last sharded step's phase times (its input dist's wherever it ran).
    last_times: Option<trainrec_dist::StepTimes>,
}

/// The corpus and cut-offs of a `recall_at_k` metric.
pub(crate) struct RetrievalSpec {
    /// The candidate's input feature (KJT key) and its table's rows: the corpus is ids
    /// `0..rows`.
    input: String,
    rows: u64,
    /// Cut-offs.
    ks: Vec<usize>,
}

/// Recall@k over the eval split: per positive pair, is its candidate among the top k of the
/// corpus for its query.
struct RecallAtK {
    corpus: Tensor,
    input: String,
    ks: Vec<usize>,
    hits: Vec<u64>,
    pairs: u64,
}

impl RecallAtK {
    fn new(spec: &RetrievalSpec, corpus: Tensor) -> Self {
        Self { corpus, input: spec.input.clone(), ks: spec.ks.clone(), hits: vec![0; spec.ks.len()], pairs: 0 }
    }

    fn update(
        &mut self,
        retrieval: &dyn trainrec_models::Retrieval,
        dense: &Tensor,
        sparse: &Tensor,
        labels: &Tensor,
        batch: &Batch,
    ) -> Result<(), EngineError> {
        let sparse_ids = crate::dist::full_batch(&batch.sparse)?;
        let Some(k) = sparse_ids.key_index(&self.input) else {
            return Err(EngineError::Internal(format!("eval batch lacks feature {}", self.input)));
        };
        let f = sparse_ids.feature(k);
        let y: Vec<f32> = Vec::try_from(labels.select(1, 0).to_device(tch::Device::Cpu).contiguous())
            .map_err(|e| EngineError::Internal(format!("labels: {e}")))?;
        // Positive pairs whose candidate is one id.
        let (rows, truth): (Vec<i64>, Vec<i64>) = (0..batch.batch_size)
            .filter(|&i| y[i] > 0.5 && f.bag(i).len() == 1)
            .map(|i| (i as i64, f.bag(i)[0]))
            .unzip();
        if rows.is_empty() {
            return Ok(());
        }
        let rows_t = Tensor::from_slice(&rows).to_device(dense.device());
        let kmax = (*self.ks.iter().max().unwrap_or(&1) as i64).min(self.corpus.size()[0]);
        let top = tch::no_grad(|| {
            let q = retrieval.query_embeddings(&dense.index_select(0, &rows_t), &sparse.index_select(0, &rows_t));
            q.matmul(&self.corpus.transpose(0, 1)).topk(kmax, 1, true, true).1
        });
        let top: Vec<i64> = Vec::try_from(top.to_device(tch::Device::Cpu).contiguous().view([-1]))
            .map_err(|e| EngineError::Internal(format!("top-k: {e}")))?;
        for (i, &t) in truth.iter().enumerate() {
            let ranked = &top[i * kmax as usize..(i + 1) * kmax as usize];
            if let Some(rank) = ranked.iter().position(|&c| c == t) {
                for (h, &k) in self.hits.iter_mut().zip(&self.ks) {
                    if rank < k {
                        *h += 1;
                    }
                }
            }
        }
        self.pairs += truth.len() as u64;
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        self.ks
            .iter()
            .zip(&self.hits)
            .map(|(k, &h)| (format!("recall_at_{k}"), if self.pairs == 0 { 0.0 } else { h as f64 / self.pairs as f64 }))
            .collect()
    }
}

/// The recipe's embedding tables as one collection with their fused optimizers and bounds
/// check (shared by [`Job::build`] and the W2 benchmark).
pub(crate) fn recipe_ebc(recipe: &Recipe) -> Result<EmbeddingBagCollection, trainrec_embedding::EmbeddingError> {
    let mut ebc = EmbeddingBagCollection::new(recipe_tables(recipe), recipe.optimizer.sparse.clone(), recipe.run.seed)?;
    ebc.set_bounds_check(recipe.embedding.bounds_check);
    Ok(ebc)
}

/// The recipe's tables with the plan's kernels: a table planned `fused_uvm_caching` keeps a
/// cache of `load factor x rows` rows (weights and optimizer state) in memory and the whole
/// table in a file under `embedding.offload_dir`; one planned `key_value` keeps the same cache
/// in front of a key-value store there of the rows written so far.
pub(crate) fn planned_tables(recipe: &Recipe, plan: &trainrec_planner::Plan) -> Vec<EmbeddingBagConfig> {
    use trainrec_planner::{CacheAlgorithm, ComputeKernel};
    let dir = recipe.embedding.offload_dir.clone().unwrap_or_else(|| recipe.output_dir().join("offload"));
    let mut tables = recipe_tables(recipe);
    for (c, t) in tables.iter_mut().zip(&recipe.tables) {
        let Some(tp) = plan.tables.iter().find(|p| p.name == c.name) else { continue };
        let backing = match tp.compute_kernel {
            ComputeKernel::FusedUvmCaching => trainrec_embedding::CacheBacking::Rows,
            ComputeKernel::KeyValue => trainrec_embedding::CacheBacking::KeyValue,
            _ => continue,
        };
        let load_factor = tp.cache_load_factor.unwrap_or(trainrec_planner::defaults::UVM_CACHING_RATIO);
        let slots = ((load_factor * c.rows as f64).ceil() as u64).clamp(1, c.rows);
        let policy = match t.constraints.cache.as_ref().and_then(|k| k.algorithm) {
            Some(CacheAlgorithm::Lfu) => trainrec_embedding::CachePolicy::Lfu,
            _ => trainrec_embedding::CachePolicy::Lru,
        };
        tracing::info!(table = %c.name, slots, rows = c.rows, ?policy, ?backing, dir = %dir.display(), "cached table");
        c.cache = Some(trainrec_embedding::CacheConfig { slots, policy, backing, dir: dir.clone() });
    }
    tables
}

/// The recipe's `[[tables]]` as embedding table configurations.
pub(crate) fn recipe_tables(recipe: &Recipe) -> Vec<EmbeddingBagConfig> {
    recipe
        .tables
        .iter()
        .map(|t| {
            let features: Vec<&str> = t.features.iter().map(String::as_str).collect();
            let mut c = EmbeddingBagConfig::new(t.name.clone(), t.rows, t.dim, t.pooling, &features)
                .with_precision(t.precision);
            c.stochastic_rounding = t.stochastic_rounding;
            c.optimizer = t.optimizer.clone();
            c
        })
        .collect()
}

/// Sets libtorch's and the embedding kernels' thread counts.
pub fn configure_threads(threads: Option<usize>) -> usize {
    let n = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    tch::set_num_threads(n as i32);
    // libtorch accepts the inter-op pool size once per process, before any parallel work.
    static INTEROP: std::sync::Once = std::sync::Once::new();
    INTEROP.call_once(|| tch::set_num_interop_threads(1));
    // The global pool can be set once per process; later jobs in the same process reuse it.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    n
}

impl Job {
    /// Builds every part of a one-rank job. The recipe must have passed
    /// [`crate::check_loaded`]; a recipe with `topology.world_size > 1` is built per rank by
    /// [`Job::build_rank`] (or trained by [`crate::dist::run_threads`]).
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
            trainrec_planner::ComputeDevice::Cuda => Some(crate::cuda::prepare(&recipe, loaded, rank)?),
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

        let mut feature_rows = BTreeMap::new();
        for table in &recipe.tables {
            // A managed-collision table's features carry raw ids of its larger id space.
            let space = table.mc.as_ref().map_or(table.rows, |mc| mc.input_hash_size);
            for f in &table.features {
                feature_rows.insert(FeatureRef::parse(f).input.to_string(), space);
            }
        }
        let kind = recipe.data.sampler.kind().unwrap_or_default();
        let factory =
            registry.sampler_for(kind).ok_or_else(|| EngineError::Internal(format!("sampler {kind} vanished")))?;
        let ctx =
            SamplerContext { feature_rows, base_dir: loaded.base_dir.clone(), seed: recipe.run.seed, rank, world_size };
        let sampler = factory.build(&recipe.data.sampler.config(), &ctx)?;

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
        let tasks = crate::check::job_tasks(&recipe, features);
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
        let plan_input = trainrec_recipe::plan::plan_input(&recipe, crate::plan::dense_bytes_of(&vs));
        let plan = crate::plan::recipe_plan(&plan_input, &recipe, &loaded.base_dir, false)
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
                    Some(gpu) => crate::cuda::nccl_group(pg.as_ref(), gpu, loaded)?,
                    None => pg,
                };
                let mut sharded = crate::dist::sharded_ebc(&recipe, &plan, pg.clone())?;
                if let Some(target) = cuda {
                    // Each rank's shards and replicas start from the CPU collection's values,
                    // then live on its GPU.
                    let bounds = recipe.embedding.bounds_check;
                    sharded.move_shards(|cpu| {
                        let mut gpu =
                            target.collection(cpu).map_err(|e| trainrec_dist::DistError::Module(e.to_string()))?;
                        gpu.set_bounds_check(bounds);
                        Ok(Box::new(gpu) as Box<dyn trainrec_dist::ShardEngine>)
                    })?;
                    tracing::info!(rank = pg.rank(), gpu = ?target.gpu(), "this rank's shards in the CUDA engine");
                }
                (
                    SparseArch::Sharded(Box::new(sharded)),
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
                        (SparseArch::Cuda(Box::new(on_gpu)), None)
                    }
                    None => (SparseArch::Local(Box::new(ebc)), None),
                }
            }
        };
        let retrieval =
            retrieval_spec(&recipe, model.as_ref()).map_err(|d| EngineError::Recipe(loaded.locate(vec![d])))?;
        let dense_opt = DenseOptimizer::new(&vs, &recipe.optimizer.dense)?;
        let mut mc = crate::mc::McTables::new(&recipe, &plan)?;
        mc.attach(&mut sparse, &recipe, &plan)?;
        Ok(Self {
            recipe,
            resolved_toml,
            sampler,
            sparse,
            vs,
            sync,
            model,
            dense_opt,
            num_dense: features.num_dense,
            tasks,
            num_labels: features.labels.len(),
            plugin_metrics,
            plan,
            retrieval,
            mc,
            base_dir: loaded.base_dir.clone(),
            resume: None,
            staged: None,
            last_times: None,
        })
    }

    /// The batch's dense features, pooled embeddings and labels as tensors, and the sharded
    /// forward's context (collective across ranks); `staged`: the batch's input dist, when a
    /// pipeline ran it ahead.
    fn tensors(
        &self,
        batch: &Batch,
        staged: Option<Ahead>,
    ) -> Result<(Tensor, Tensor, Tensor, Option<DistContext>), EngineError> {
        let b = batch.batch_size as i64;
        if batch.dense.len() != batch.batch_size * self.num_dense
            || batch.labels.len() != batch.batch_size * self.num_labels
            || crate::dist::examples(&batch.sparse) != batch.batch_size
        {
            return Err(EngineError::Data(trainrec_data::DataError::Config {
                key: String::new(),
                message: format!(
                    "the sampler produced an inconsistent batch: batch_size {}, {} dense values ({} per example expected), {} labels ({} per example expected), sparse stride {}",
                    batch.batch_size,
                    batch.dense.len(),
                    self.num_dense,
                    batch.labels.len(),
                    self.num_labels,
                    crate::dist::examples(&batch.sparse)
                ),
            }));
        }
        let device = self.vs.device();
        let (dense, sparse, labels, ctx) = match (&self.sparse, staged) {
            (SparseArch::Cuda(gpu), staged) => {
                let staged = match staged {
                    Some(Ahead::Gpu(s)) => Some(s),
                    Some(Ahead::Dist(_)) => {
                        return Err(EngineError::Internal(
                            "a one-GPU job was given a sharded batch's input dist".into(),
                        ));
                    }
                    None => None,
                };
                let (dense, sparse, labels) = self.cuda_tensors(gpu, batch, staged)?;
                (dense, sparse, labels, None)
            }
            (_, staged) => {
                let staged = match staged {
                    Some(Ahead::Dist(d)) => Some(*d),
                    Some(Ahead::Gpu(_)) => {
                        return Err(EngineError::Internal("a batch staged on a GPU reached a CPU lookup".into()));
                    }
                    None => None,
                };
                let dense = Tensor::from_slice(&batch.dense).f_view([b, self.num_dense as i64])?.to_device(device);
                let (sparse, ctx) = self.sparse.forward(&batch.sparse, staged)?;
                // A sharded lookup's output comes to the host (the output dist's); the dense
                // model's device, when that is a GPU.
                let sparse = sparse.to_device(device);
                let labels = Tensor::from_slice(&batch.labels).f_view([b, self.num_labels as i64])?.to_device(device);
                (dense, sparse, labels, ctx)
            }
        };
        // [batch, tasks]: each task's label column (all columns, in order, need no selection).
        let identity = self.tasks.len() == self.num_labels && self.tasks.iter().enumerate().all(|(t, &(_, c))| t == c);
        let labels = if identity {
            labels
        } else {
            let columns: Vec<i64> = self.tasks.iter().map(|&(_, c)| c as i64).collect();
            labels.f_index_select(1, &Tensor::from_slice(&columns).to_device(device))?
        };
        Ok((dense, sparse, labels, ctx))
    }

    /// A one-GPU job's dense features, pooled embeddings and labels on the GPU: the batch's
    /// ids, dense features and labels copied on the high-priority copy stream (`staged`: by
    /// the pipeline's stage while the previous batch trained; else now, the `base` pipeline's
    /// copy stage), the lookups reading the ids there.
    fn cuda_tensors(
        &self,
        gpu: &trainrec_cuda::CudaEbc,
        batch: &Batch,
        staged: Option<trainrec_cuda::StagedBatch>,
    ) -> Result<(Tensor, Tensor, Tensor), EngineError> {
        let kjt = crate::dist::full_batch(&batch.sparse)?;
        let staged = match staged {
            Some(s) => s,
            None => stage_on_gpu(gpu, batch, &kjt)?,
        };
        let dev = crate::dist::cuda_tensor_device(gpu);
        let (b, nd, nl, w) =
            (batch.batch_size as i64, self.num_dense as i64, self.num_labels as i64, gpu.width() as i64);
        let parts = staged.parts()?;
        // SAFETY: `parts` are the staged copies of `batch.dense` ([b, nd] floats) and
        // `batch.labels` ([b, nl] floats) in the GPU's memory (host memory on the emulator),
        // valid while `staged` lives; the default stream waits for their copy (`parts`), and
        // each view is copied into a tensor of libtorch's own on that stream before `staged`
        // is dropped (which frees the slot only once the stream is past these copies).
        let (dense, labels) = unsafe {
            (
                Tensor::from_blob(parts[0] as *const u8, &[b, nd], &[], Kind::Float, dev).copy(),
                Tensor::from_blob(parts[1] as *const u8, &[b, nl], &[], Kind::Float, dev).copy(),
            )
        };
        let sparse = Tensor::empty([b, w], (Kind::Float, dev));
        if b * w > 0 {
            // SAFETY: `sparse` is a new contiguous float tensor of b * w elements on the
            // collection's GPU; the kernels run on the default stream, before libtorch's later
            // work on it.
            unsafe { gpu.forward_staged_into_raw(&kjt, &staged, sparse.data_ptr() as u64)? };
        }
        drop(staged);
        Ok((dense, sparse, labels))
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
    pub fn last_step_times(&self) -> Option<trainrec_dist::StepTimes> {
        self.last_times
    }

    /// The process group of a job trained across ranks.
    pub fn group(&self) -> Option<&std::sync::Arc<dyn trainrec_dist::ProcessGroup>> {
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
        use trainrec_dist::ProcessGroupExt;
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
    /// global batch (every rank's).
    ///
    /// `ahead`, the next batch, is staged on a second thread while this batch's dense forward
    /// and backward run (see [`Job::train_step_ahead`]); that thread is the only one to run
    /// collectives meanwhile (the dense gradients' all-reduce waits for it), so every backend
    /// sees one collective at a time. A sharded job's staged batch waits in `self.staged`.
    fn train_step_with(
        &mut self,
        batch: &Batch,
        want_predictions: bool,
        ahead: Option<&Batch>,
    ) -> Result<(f64, Option<Vec<f32>>, usize), EngineError> {
        let remapped;
        let batch = if self.mc.is_empty() {
            batch
        } else {
            // Managed collisions: raw ids counted and remapped to rows; the rows of slots that
            // changed hands start afresh before the lookup.
            let mut b = batch.clone();
            expand_vbe(&mut b.sparse)?;
            let pg = self.sync.as_ref().map(|s| s.pg.as_ref());
            for (table, rows, key) in self.mc.train(&mut b.sparse, pg)? {
                self.sparse.reset_rows(&table, &rows, key)?;
            }
            remapped = b;
            &remapped
        };
        // Managed-collision jobs run the base pipeline: nothing is staged ahead for them.
        let staged = match self.staged.take() {
            Some(st) => Some(st),
            None => self.mc.stage_train(&mut self.sparse, &batch.sparse)?.map(|d| Ahead::Dist(Box::new(d))),
        };
        let (dense, sparse, labels, ctx) = self.tensors(batch, staged)?;
        let sparse = sparse.set_requires_grad(true);
        let ids = crate::dist::full_batch(&batch.sparse)?;
        let mut dense_parts = DenseParts {
            model: self.model.as_mut(),
            opt: &mut self.dense_opt,
            sync: self.sync.as_ref(),
            tasks: self.tasks.len(),
        };
        let prefetch = self.recipe.pipeline.kind == trainrec_recipe::PipelineKind::PrefetchSparseDist;
        let stage = match (ahead, &mut self.sparse) {
            (Some(next), SparseArch::Local(ebc)) if prefetch => Some(Stage::Prefetch(next, ebc.as_mut())),
            (Some(next), SparseArch::Cuda(gpu)) => Some(Stage::Cuda(next, gpu.as_mut(), prefetch)),
            (Some(next), SparseArch::Sharded(s)) => Some(Stage::InputDist(next, s.as_mut(), prefetch)),
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
                dense_parts.forward_backward(&dense, &sparse, &labels, &ids, ctx.as_ref(), batch, want_predictions)
            };
            let staged = job.map(|j| {
                j?.join().unwrap_or_else(|_| Err(EngineError::Internal("the pipeline's stage thread panicked".into())))
            });
            (dense_part, staged)
        });
        // A stage's failure is reported before this batch's update is applied: no rank has
        // applied it (each rank's stage fails in the same collective, or its peers see it leave).
        let (scaled_loss, logits, examples) = dense_part?;
        self.staged = staged.transpose()?.flatten();
        let loss_value = dense_parts.finish(scaled_loss, ctx.is_some())?;
        // The EBC reads the gradient tensor's memory in place.
        {
            let _span = tracing::debug_span!("sparse_update").entered();
            self.last_times = self.sparse.backward(&batch.sparse, ctx, &sparse.grad())?;
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

/// A batch a pipeline staged ahead of its step.
pub(crate) enum Ahead {
    /// A sharded job's: its input dist.
    Dist(Box<trainrec_dist::InputDist>),
    /// A one-GPU job's: its ids, dense features and labels copied to the GPU.
    Gpu(trainrec_cuda::StagedBatch),
}

/// Copies a batch's ids (`kjt`, the batch's full sparse features), dense features and labels
/// to the GPU on its copy stream.
fn stage_on_gpu(
    gpu: &trainrec_cuda::CudaEbc,
    batch: &Batch,
    kjt: &trainrec_sparse::KeyedJaggedTensor,
) -> Result<trainrec_cuda::StagedBatch, EngineError> {
    Ok(gpu.stage(kjt, &[bytemuck::cast_slice(&batch.dense), bytemuck::cast_slice(&batch.labels)])?)
}

/// What the pipeline's second thread does for the next batch while this one's dense part
/// runs.
enum Stage<'a> {
    /// One rank: load the batch's rows into the caches of cached tables.
    Prefetch(&'a Batch, &'a mut EmbeddingBagCollection),
    /// One GPU: the batch copied to the GPU on the copy stream, then (with `true`) its rows
    /// into the GPU caches of cached tables.
    Cuda(&'a Batch, &'a mut trainrec_cuda::CudaEbc, bool),
    /// Sharded: the batch's input dist, then (with `true`) its rows into the shards' caches.
    InputDist(&'a Batch, &'a mut trainrec_dist::ShardedEbc, bool),
}

impl Stage<'_> {
    fn run(self) -> Result<Option<Ahead>, EngineError> {
        match self {
            Self::Cuda(next, gpu, prefetch) => {
                let kjt = crate::dist::full_batch(&next.sparse)?;
                let staged = {
                    let _span = tracing::debug_span!("copy").entered();
                    stage_on_gpu(gpu, next, &kjt)?
                };
                if prefetch {
                    let _span = tracing::debug_span!("prefetch").entered();
                    gpu.prefetch(&kjt)?;
                }
                Ok(Some(Ahead::Gpu(staged)))
            }
            Self::Prefetch(next, ebc) => {
                let _span = tracing::debug_span!("prefetch").entered();
                let kjt = crate::dist::full_batch(&next.sparse)?;
                ebc.prefetch(&kjt)?;
                Ok(None)
            }
            Self::InputDist(next, s, prefetch) => {
                let staged = {
                    let _span = tracing::debug_span!("input_dist").entered();
                    s.input_dist(&next.sparse)?
                };
                if prefetch {
                    let _span = tracing::debug_span!("prefetch").entered();
                    s.prefetch(&staged)?;
                }
                Ok(Some(Ahead::Dist(Box::new(staged))))
            }
        }
    }
}

/// What a step's dense part uses of a job (apart from the sparse arch, which may be
/// prefetching meanwhile).
struct DenseParts<'a> {
    model: &'a mut dyn DenseModel,
    opt: &'a mut DenseOptimizer,
    sync: Option<&'a DataParallel>,
    tasks: usize,
}

impl DenseParts<'_> {
    /// The dense model's forward and backward on one batch (the pooled embeddings `sparse` a
    /// leaf that receives its gradient), with no collective: the loss (this rank's share of
    /// the global batch's across ranks), the logits when they are wanted, and the examples of
    /// the global batch. [`DenseParts::finish`] sums the gradients and updates.
    #[allow(clippy::too_many_arguments)]
    fn forward_backward(
        &mut self,
        dense: &Tensor,
        sparse: &Tensor,
        labels: &Tensor,
        ids: &trainrec_sparse::KeyedJaggedTensor,
        ctx: Option<&DistContext>,
        batch: &Batch,
        want_predictions: bool,
    ) -> Result<(f64, Option<Tensor>, usize), EngineError> {
        let input = LossInput { dense, sparse, labels, ids };
        let (loss, logits) = match self.model.loss(&input) {
            // The model's own objective; predictions (for training metrics) are its scores.
            Some(loss) => {
                let logits = want_predictions.then(|| tch::no_grad(|| self.model.forward(dense, sparse, true)));
                (loss, logits)
            }
            None => {
                let logits = self.model.forward(dense, sparse, true);
                // The sum over tasks of each task's mean binary cross entropy (one task: the mean).
                let loss = logits.binary_cross_entropy_with_logits::<Tensor>(labels, None, None, tch::Reduction::Mean)
                    * self.tasks as f64;
                (loss, Some(logits))
            }
        };
        self.opt.zero_grad();
        let examples = ctx.map_or(batch.batch_size, |c| c.batch_sizes().iter().sum());
        let loss_value = match (self.sync, ctx) {
            (Some(_), Some(ctx)) => {
                // This rank's share of the global batch's loss: after the sum across ranks the
                // gradients are the global batch's (see the `dist` module).
                let global: usize = ctx.batch_sizes().iter().sum();
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

    /// Across ranks, sums the gradients and the loss shares (collective); then the dense
    /// optimizer's update. Returns the (global) loss.
    fn finish(self, loss: f64, sharded: bool) -> Result<f64, EngineError> {
        let loss = match self.sync {
            Some(sync) if sharded => sync.all_reduce(loss)?,
            _ => loss,
        };
        self.opt.step();
        Ok(loss)
    }
}

impl Job {
    /// Evaluates on the eval split; returns the metrics by name (`<metric>-<task>` when the
    /// job has several tasks).
    pub fn evaluate(&self) -> Result<BTreeMap<String, f64>, EngineError> {
        let mut suites = (0..self.tasks.len()).map(|_| self.metric_suite(None)).collect::<Result<Vec<_>, _>>()?;
        let bs = self.recipe.data.eval_batch_size.unwrap_or(self.recipe.data.batch_size);
        let limit = self.recipe.train.eval_batches.unwrap_or(u64::MAX);
        let mut seen = 0u64;
        let mut recall = match &self.retrieval {
            Some(r) => Some(RecallAtK::new(r, self.corpus_embeddings(r)?)),
            None => None,
        };
        let mut batches = self.sampler.batches(Split::Eval, 0, bs)?.take(limit as usize);
        loop {
            let next = batches.next().transpose()?;
            // Across ranks every rank takes part until all are done: one whose split has ended
            // looks up an empty batch.
            let batch = match (&self.sync, next) {
                (None, None) => break,
                (None, Some(b)) => b,
                (Some(sync), next) => {
                    if !sync.any_has(next.is_some())? {
                        break;
                    }
                    match next {
                        Some(b) => b,
                        None => self.empty_batch()?,
                    }
                }
            };
            let batch = if self.mc.is_empty() {
                batch
            } else {
                let mut b = batch;
                expand_vbe(&mut b.sparse)?;
                self.mc.eval(&mut b.sparse)?;
                b
            };
            let staged = self.mc.stage_eval(&self.sparse, &batch.sparse)?.map(|d| Ahead::Dist(Box::new(d)));
            let (dense, sparse, labels, _) = self.tensors(&batch, staged)?;
            let probs = tch::no_grad(|| {
                self.model.forward(&dense, &sparse, false).sigmoid().to_kind(Kind::Float).to_device(Device::Cpu)
            });
            let probs: Vec<f32> = Vec::try_from(&probs.contiguous().view([-1]))
                .map_err(|e| EngineError::Internal(format!("predictions: {e}")))?;
            seen += self.feed_all_ranks(&mut suites, &probs, &batch)? as u64;
            if let Some(recall) = &mut recall {
                let retrieval =
                    self.model.retrieval().ok_or_else(|| EngineError::Internal("retrieval vanished".into()))?;
                recall.update(retrieval, &dense, &sparse, &labels, &batch)?;
            }
        }
        if seen == 0 {
            return Err(EngineError::EmptySplit("eval"));
        }
        let mut values = self.values(&suites);
        if let Some(mut recall) = recall {
            if let Some(sync) = &self.sync {
                let mut counts = recall.hits.clone();
                counts.push(recall.pairs);
                crate::dist::sum_counts(sync.pg.as_ref(), &mut counts)?;
                recall.pairs = counts.pop().unwrap_or(0);
                recall.hits = counts;
            }
            values.extend(recall.compute());
        }
        Ok(values)
    }

    /// A batch of no examples, for a rank whose eval split has ended while others go on.
    fn empty_batch(&self) -> Result<Batch, EngineError> {
        let keys = self.sampler.schema().sparse.clone();
        let sparse = trainrec_sparse::KeyedJaggedTensor::empty(keys, 0).map_err(|e| EngineError::Data(e.into()))?;
        Ok(Batch {
            dense: Vec::new(),
            num_dense: self.num_dense,
            sparse,
            labels: Vec::new(),
            batch_size: 0,
            groups: None,
        })
    }

    /// The weights of table `name`, `[rows, dim]` row-major (across ranks: assembled from
    /// every rank's shards; every rank must call it).
    pub fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        self.sparse.table_weights(name)
    }

    /// This rank's named state: the dense variables (`dense.<name>`) and its shards of every
    /// table's weights (`sparse.<table>.weight`, with their place in the table). Not
    /// collective.
    pub fn named_state(&self) -> Vec<crate::dmp::StateEntry> {
        let mut out = crate::dmp::dense_entries(&self.vs);
        out.extend(crate::dmp::shard_entries("sparse", &self.sparse.local_shards()));
        out
    }

    /// Each managed-collision table's statistics over the partitions this rank runs (every
    /// partition, the same on every rank, unless the table is remapped on its owning ranks;
    /// the metrics' `mc/*` values sum every rank's).
    pub fn mc_stats(&self) -> BTreeMap<String, trainrec_embedding::mc::McStats> {
        self.mc.stats()
    }

    /// This rank's shards of every table with their fused optimizer's state.
    pub fn local_shards(&self) -> Vec<trainrec_dist::LocalShard> {
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

    /// Every candidate of the corpus embedded by the candidate tower: `[rows, d]`, row `r` the
    /// candidate whose id is `r`.
    fn corpus_embeddings(&self, spec: &RetrievalSpec) -> Result<Tensor, EngineError> {
        let retrieval = self.model.retrieval().ok_or_else(|| EngineError::Internal("retrieval vanished".into()))?;
        let keys = self.sampler.schema().sparse.clone();
        let k = keys.iter().position(|f| *f == spec.input).ok_or_else(|| {
            EngineError::Internal(format!("candidate feature {} is not a sampler feature", spec.input))
        })?;
        const CHUNK: u64 = 16_384;
        let mut parts = Vec::new();
        let mut start = 0u64;
        while start < spec.rows {
            let n = CHUNK.min(spec.rows - start) as usize;
            let mut lengths = vec![0u32; keys.len() * n];
            lengths[k * n..(k + 1) * n].fill(1);
            let values: Vec<i64> = (start as i64..(start as usize + n) as i64).collect();
            let kjt = trainrec_sparse::KeyedJaggedTensor::new(keys.clone(), values, None, lengths, n)
                .map_err(|e| EngineError::Data(e.into()))?;
            let (sparse, _) = self.sparse.forward(&kjt, None)?;
            let sparse = sparse.to_device(self.vs.device());
            parts.push(tch::no_grad(|| retrieval.candidate_embeddings(&sparse)));
            start += n as u64;
        }
        Ok(Tensor::cat(&parts, 0))
    }

    /// A fresh suite of the recipe's metrics. With `window: None`, for an evaluation: lifetime
    /// values under plain names (`auc`, `ne`). With `Some(w)`, for training batches: lifetime
    /// and windowed values over the latest `w` samples (`lifetime_ne`, `window_ne`,
    /// `window_auc`), TorchRec's `RecMetricModule` on the train loop.
    fn metric_suite(&self, window: Option<usize>) -> Result<MetricSuite, EngineError> {
        let metrics: Vec<Box<dyn Metric>> = self
            .recipe
            .metrics
            .iter()
            // Retrieval recall ranks the corpus at evaluation; it is not a per-prediction metric.
            .filter(|m| !matches!(m, MetricSection::RecallAtK { .. }))
            .map(|m| -> Result<Box<dyn Metric>, EngineError> {
                Ok(match (m, window) {
                    (MetricSection::Ne { include_logloss }, None) => Box::new(NeMetric::new(*include_logloss)),
                    (MetricSection::Auc { grouped }, _) => {
                        let auc = match window {
                            None => AucMetric::new(),
                            Some(w) => AucMetric::with_window(w)?,
                        };
                        let auc = if *grouped { auc.grouped() } else { auc };
                        match window {
                            None => Box::new(auc),
                            Some(_) => Box::new(WindowNamed(Box::new(auc))),
                        }
                    }
                    (MetricSection::Auprc {}, None) => Box::new(SplitAuprc::new()),
                    (MetricSection::Auprc {}, Some(w)) => Box::new(AuprcMetric::new(w)?),
                    (MetricSection::Ndcg { .. } | MetricSection::RecallSession { .. }, _) => {
                        let kind = session_kind(m).expect("a session metric");
                        Box::new(match window {
                            None => SessionMetric::for_split(kind)?,
                            Some(w) => SessionMetric::new(kind, w)?,
                        })
                    }
                    (MetricSection::Plugin { name, options }, _) => self
                        .plugin_metrics
                        .get(name)
                        .ok_or_else(|| EngineError::Internal(format!("plugin metric {name} vanished")))?
                        .build(&serde_json::Value::Object(options.clone()))?,
                    (other, None) => Box::new(LifetimeMetric::new(sum_kind(other).expect("a sum-state metric"))),
                    (other, Some(w)) => Box::new(SumMetric::new(sum_kind(other).expect("a sum-state metric"), w)?),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(MetricSuite::new(metrics)?)
    }

    /// [`Self::feed`] across ranks: every rank's predictions, labels and groups of this step
    /// (gathered), so every rank's suites hold the global metrics. Returns the examples fed.
    fn feed_all_ranks(&self, suites: &mut [MetricSuite], probs: &[f32], batch: &Batch) -> Result<usize, EngineError> {
        let Some(sync) = &self.sync else {
            self.feed(suites, probs, batch)?;
            return Ok(batch.batch_size);
        };
        let probs = sync.gather(probs)?;
        let labels = sync.gather(&batch.labels)?;
        // Every rank gathers (a rank past its split's end has no groups).
        let groups = sync.gather(batch.groups.as_deref().unwrap_or_default())?;
        let n = labels.len() / self.num_labels.max(1);
        let groups = (n > 0 && groups.len() == n).then_some(groups);
        self.feed_parts(suites, &probs, &labels, groups.as_deref(), n)?;
        Ok(n)
    }

    /// Feeds one batch's predictions `[batch, tasks]` to each task's suite.
    fn feed(&self, suites: &mut [MetricSuite], probs: &[f32], batch: &Batch) -> Result<(), EngineError> {
        self.feed_parts(suites, probs, &batch.labels, batch.groups.as_deref(), batch.batch_size)
    }

    /// [`Self::feed`] from the parts: `n` examples' predictions `[n, tasks]`, label columns
    /// `[n, num_labels]` and grouping keys.
    fn feed_parts<'a>(
        &self,
        suites: &mut [MetricSuite],
        probs: &'a [f32],
        all_labels: &'a [f32],
        groups: Option<&'a [i64]>,
        n: usize,
    ) -> Result<(), EngineError> {
        let t_count = self.tasks.len();
        // A column of a row-major `[n, width]` matrix; a single column is the data itself.
        let column = |data: &'a [f32], width: usize, c: usize| -> Cow<'a, [f32]> {
            if width == 1 { Cow::Borrowed(data) } else { Cow::Owned((0..n).map(|i| data[i * width + c]).collect()) }
        };
        for (t, (suite, &(_, col))) in suites.iter_mut().zip(&self.tasks).enumerate() {
            let predictions = column(probs, t_count, t);
            let labels = column(all_labels, self.num_labels, col);
            let input = TaskBatch { predictions: &predictions, labels: &labels, weights: None, groups };
            suite.update_batch(&input)?;
        }
        Ok(())
    }

    /// Every task's values: plain names (`auc`) for one task, `<metric>-<task>` (`auc-click`)
    /// for several.
    fn values(&self, suites: &[MetricSuite]) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (suite, (task, _)) in suites.iter().zip(&self.tasks) {
            for (name, v) in suite.compute() {
                let key = if self.tasks.len() == 1 { name } else { format!("{name}-{task}") };
                out.insert(key, v);
            }
        }
        out
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
        let resume = self.resume.take();

        let train = self.recipe.train.clone();
        // The metrics on training batches (one suite per task), when asked for.
        let mut train_suites = match train.metrics_every {
            Some(_) => {
                let w = Some(train.metrics_window as usize);
                Some((0..self.tasks.len()).map(|_| self.metric_suite(w)).collect::<Result<Vec<_>, _>>()?)
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
                checkpointing::truncate_metrics(&out_dir, p.step)?;
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
        let pipeline = self.recipe.pipeline.clone();
        // The pipelines that read ahead; managed collisions remap a batch's ids just before
        // its lookup (the remap of batch i+1 resets rows batch i's update writes), so those
        // jobs train as `base`.
        let pipelined =
            pipeline.reads_ahead() && self.mc.is_empty() && !matches!(self.sparse, SparseArch::Quantized(_));
        if pipeline.reads_ahead() && !pipelined {
            tracing::warn!(
                "pipeline.kind = {:?}: a job with managed collisions trains as `base` (each batch's ids are \
                 remapped just before its lookup)",
                pipeline.kind
            );
        }
        let first_epoch = p.epoch;
        'outer: for epoch in first_epoch..epochs {
            if done(p.step) {
                break;
            }
            if epoch != p.epoch {
                (p.epoch, p.in_epoch) = (epoch, 0);
            }
            let _span = tracing::info_span!("epoch", epoch).entered();
            let mut batches = self.sampler.batches(Split::Train, epoch, bs)?;
            // Resuming mid-epoch: the batches the checkpointed run had read.
            for _ in 0..p.in_epoch {
                if batches.next().transpose()?.is_none() {
                    break;
                }
            }
            // The pipelines read batch i+1 ahead (every rank agrees it exists before its input
            // dist starts) and stage it while batch i trains.
            let mut ahead: Option<Batch> = None;
            let mut first = true;
            let mut dropped = false;
            loop {
                let batch = match ahead.take() {
                    Some(b) => b,
                    // A pipeline that read ahead and found nothing: the epoch's data ended.
                    None if pipelined && !first => break,
                    None => {
                        let next = batches.next().transpose()?;
                        // Across ranks the epoch ends for all when one rank's data ends (no
                        // rank waits in a collective the others never join).
                        let go = self.all_ranks_have(next.is_some())?;
                        match next.filter(|_| go) {
                            Some(b) => b,
                            None => break,
                        }
                    }
                };
                first = false;
                // The libtorch generator (dropout) restarts from the seed and step, so a
                // resumed run draws what an uninterrupted one does.
                with_torch_seed((self.recipe.run.seed ^ p.step.wrapping_mul(0x9E37_79B9_7F4A_7C15)) as i64, || ());
                // A failed read of the next batch is reported after this one is trained, as
                // `base` would.
                let mut read_error = None;
                if pipelined && !done(p.step + 1) {
                    let next = batches.next().transpose().unwrap_or_else(|e| {
                        read_error = Some(e);
                        None
                    });
                    let go = self.all_ranks_have(next.is_some())?;
                    ahead = next.filter(|_| go);
                    if ahead.is_none() && read_error.is_none() && !pipeline.execute_all_batches {
                        // TorchRec's `execute_all_batches=False`: the batch in flight when the
                        // data ends is dropped.
                        dropped = true;
                        break;
                    }
                }
                let _step_span = tracing::debug_span!("step", step = p.step + 1).entered();
                let (loss, predictions, examples) =
                    self.train_step_with(&batch, train_suites.is_some(), ahead.as_ref())?;
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
                    values.extend(self.mc.metric_values(self.sync.as_ref().map(|s| s.pg.as_ref()))?);
                    values.extend(self.cache_values_of_all_ranks()?);
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
                if train.eval_every.is_some_and(|n| step % n == 0) && train.steps != Some(step) {
                    let m = self.evaluate()?;
                    if lead {
                        tracing::info!(step, metrics = ?m, "eval");
                    }
                    log_write(&mut log, step, "eval", &m)?;
                    p.set_last_eval(&m);
                }
                if train.checkpoint_every.is_some_and(|n| step % n == 0) {
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
                if done(step) {
                    break 'outer;
                }
            }
            // Nothing staged outlives its epoch (a dropped batch's input dist and prefetch).
            self.staged = None;
            self.sparse.discard_prefetched();
            if p.in_epoch == 0 && dropped {
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
        self.sparse.discard_prefetched();
        self.staged = None;
        let (step, samples) = (p.step, p.samples);
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
                m
            }
        };
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

/// Expands a variable-batch (VBE) KJT in place to one bag per example (managed collisions
/// count every example's ids); any other KJT is left as it is, without a copy.
fn expand_vbe(kjt: &mut trainrec_sparse::KeyedJaggedTensor) -> Result<(), EngineError> {
    if let std::borrow::Cow::Owned(full) = crate::dist::full_batch(kjt)? {
        *kjt = full;
    }
    Ok(())
}

/// The corpus of a recipe's `recall_at_k`, or why the model cannot be ranked that way.
pub(crate) fn retrieval_spec(
    recipe: &Recipe,
    model: &dyn DenseModel,
) -> Result<Option<RetrievalSpec>, trainrec_recipe::Diagnostic> {
    let Some((i, ks)) = recipe.metrics.iter().enumerate().find_map(|(i, m)| match m {
        MetricSection::RecallAtK { k } => Some((i, k.clone())),
        _ => None,
    }) else {
        return Ok(None);
    };
    let at = trainrec_recipe::KeyPath::root().key("metrics").index(i).key("kind");
    let kind = recipe.model.kind().unwrap_or_default();
    let Some(retrieval) = model.retrieval() else {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!("recall_at_k ranks candidates for queries; model {kind} does not embed them apart"),
        )
        .with_help("use a retrieval model such as kind = \"two_tower\", or drop this metric"));
    };
    let [feature] = retrieval.candidate_features() else {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!(
                "recall_at_k ranks every row of one candidate table; the model has {} candidate features",
                retrieval.candidate_features().len()
            ),
        )
        .with_help("list exactly one feature in model.candidate_features"));
    };
    let rows = recipe
        .tables
        .iter()
        .find(|t| t.features.iter().any(|f| f == feature))
        .map(|t| t.rows)
        .ok_or_else(|| trainrec_recipe::Diagnostic::new(at.clone(), format!("no table looks up {feature}")))?;
    Ok(Some(RetrievalSpec { input: FeatureRef::parse(feature).input.to_owned(), rows, ks }))
}

fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn progress_bar(steps: Option<u64>, enabled: bool) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match steps {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps · {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{elapsed_precise} {spinner} {pos} steps · {msg}").expect("valid template"),
        ),
    };
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
    bar
}

/// The sum-state kind of a `[[metrics]]` entry, if it is one.
fn sum_kind(m: &MetricSection) -> Option<SumMetricKind> {
    Some(match *m {
        MetricSection::Ne { include_logloss } => SumMetricKind::Ne { include_logloss },
        MetricSection::Calibration {} => SumMetricKind::Calibration,
        MetricSection::Ctr {} => SumMetricKind::Ctr,
        MetricSection::Mse {} => SumMetricKind::Mse,
        MetricSection::Mae {} => SumMetricKind::Mae,
        MetricSection::Accuracy { threshold } => SumMetricKind::Accuracy { threshold },
        MetricSection::Precision { threshold } => SumMetricKind::Precision { threshold },
        MetricSection::Recall { threshold } => SumMetricKind::Recall { threshold },
        MetricSection::WeightedAvg {} => SumMetricKind::WeightedAvg,
        _ => return None,
    })
}

/// The session kind of a `[[metrics]]` entry, if it is one.
fn session_kind(m: &MetricSection) -> Option<SessionMetricKind> {
    Some(match *m {
        MetricSection::Ndcg { k, exponential_gain, report_as_decreasing, remove_single_length_sessions } => {
            SessionMetricKind::Ndcg { k, exponential_gain, report_as_decreasing, remove_single_length_sessions }
        }
        MetricSection::RecallSession { top_threshold, run_ranking_of_labels } => {
            SessionMetricKind::RecallSession { top_threshold, run_ranking_of_labels }
        }
        _ => return None,
    })
}

/// A windowed metric that reports plain names (AUC's `auc`) under `window_<name>`, as TorchRec
/// names its window values.
struct WindowNamed(Box<dyn Metric>);

impl Metric for WindowNamed {
    fn output_names(&self) -> Vec<String> {
        self.0.output_names().into_iter().map(|n| format!("window_{n}")).collect()
    }
    fn update(&mut self, p: &[f32], l: &[f32], w: Option<&[f32]>) -> Result<(), trainrec_metrics::MetricError> {
        self.0.update(p, l, w)
    }
    fn update_batch(&mut self, b: &TaskBatch<'_>) -> Result<(), trainrec_metrics::MetricError> {
        self.0.update_batch(b)
    }
    fn needs_groups(&self) -> bool {
        self.0.needs_groups()
    }
    fn compute(&self) -> Vec<(String, f64)> {
        self.0.compute().into_iter().map(|(n, v)| (format!("window_{n}"), v)).collect()
    }
    fn reset(&mut self) {
        self.0.reset();
    }
    fn state(&self) -> Option<trainrec_metrics::MetricState> {
        self.0.state()
    }
    fn load_state(&mut self, state: &trainrec_metrics::MetricState) -> Result<(), trainrec_metrics::MetricError> {
        self.0.load_state(state)
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a reader never sees a
/// partial file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), EngineError> {
    let tmp = path.with_extension("tmp");
    let io = |e| EngineError::Io { path: path.to_path_buf(), source: e };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        EngineError::Io { path: path.to_path_buf(), source: e }
    })
}

/// Writes a line to the run's metric files (rank 0 only: other ranks have none).
fn log_write(
    log: &mut Option<MetricsLog>,
    step: u64,
    split: &str,
    metrics: &BTreeMap<String, f64>,
) -> Result<(), EngineError> {
    match log {
        Some(l) => l.write(step, split, metrics),
        None => Ok(()),
    }
}

/// `metrics.jsonl`: one JSON object per line, each line written whole and flushed, so the file
/// is valid JSONL at every moment (also when a run stops on an error).
/// The run directory's metric files: `metrics.jsonl`, `metrics.csv` and a TensorBoard event
/// file (`tensorboard --logdir runs/`).
struct MetricsLog {
    path: PathBuf,
    out: BufWriter<File>,
    csv: CsvSink,
    tb: TensorBoardSink,
    dir: PathBuf,
}

impl MetricsLog {
    /// Creates the files, or with `append` (a resumed run) appends to them.
    fn open(path: &Path, append: bool) -> Result<Self, EngineError> {
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |e| EngineError::Io { path: p, source: e }
        };
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let file =
            if append { std::fs::OpenOptions::new().create(true).append(true).open(path) } else { File::create(path) }
                .map_err(io(path))?;
        let csv_path = dir.join("metrics.csv");
        let csv =
            if append { CsvSink::append(&csv_path) } else { CsvSink::create(&csv_path) }.map_err(io(&csv_path))?;
        let tb = TensorBoardSink::create(&dir).map_err(io(&dir))?;
        Ok(Self { path: path.to_path_buf(), out: BufWriter::new(file), csv, tb, dir })
    }

    fn write(&mut self, step: u64, split: &str, metrics: &BTreeMap<String, f64>) -> Result<(), EngineError> {
        let mut line = serde_json::json!({ "step": step, "split": split, "metrics": metrics }).to_string();
        line.push('\n');
        self.out
            .write_all(line.as_bytes())
            .and_then(|_| self.out.flush())
            .map_err(|e| EngineError::Io { path: self.path.clone(), source: e })?;
        let pairs = || metrics.iter().map(|(k, v)| (k.as_str(), *v));
        self.csv
            .write(step, split, pairs())
            .map_err(|e| EngineError::Io { path: self.dir.join("metrics.csv"), source: e })?;
        self.tb.write(step, split, pairs()).map_err(|e| EngineError::Io { path: self.dir.clone(), source: e })
    }

    fn finish(mut self) -> Result<(), EngineError> {
        self.out.flush().map_err(|e| EngineError::Io { path: self.path.clone(), source: e })
    }
}

/// The console table printed at the end of a run.
pub fn summary_table(s: &RunSummary) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "trained {} steps ({} samples) in {:.1} s · {:.0} samples/s · train loss {:.4} -> {:.4}\n",
        s.steps,
        s.samples,
        s.train_seconds,
        s.samples as f64 / s.train_seconds.max(1e-9),
        s.train_loss.0,
        s.train_loss.1
    ));
    out.push_str(&trainrec_metrics::render_table("eval", &s.eval));
    out.push_str(&format!("\nrun directory: {}", s.output_dir.display()));
    out
}

/// Seeds libtorch's process-wide generator and runs `f` with no other job of this process
/// reseeding it meanwhile: a model built in one thread draws its initial weights from its own
/// seed even while jobs in other threads (ranks of a thread group, tests run in parallel)
/// reseed per step. Draws made later, during a step (dropout), are exact only when one job
/// runs in the process: the generator is shared.
pub fn with_torch_seed<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    static TORCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = TORCH_RNG.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(seed);
    f()
}
