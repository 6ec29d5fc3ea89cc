//! The recipe schema: every key a user can write, with its documentation and default.
//!
//! The doc comments here are the user's reference: `trainrec-recipe` renders them into the
//! book's recipe reference page, and a test fails when that page is stale.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use trainrec_planner::{ComputeDevice, Constraints, CostModel, PartitionerKind, ProposerKind};
use trainrec_types::{BoundsCheckMode, PoolingMode, SparseOptimizerConfig, WarmupStage, WeightPrecision};
pub use trainrec_types::{DenseOptimizerConfig, McEvictionPolicy, PipelineKind, Shuffle, ShuffleKind};

/// A whole training job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Run identity, seed and output directory.
    pub run: RunSection,
    /// Where batches come from.
    pub data: DataSection,
    /// Embedding tables (`[[tables]]`, one entry per table).
    pub tables: Vec<TableSection>,
    /// The dense model; `kind` picks a registered model, the other keys are its own.
    pub model: PluginSection,
    /// Sparse (fused, per table) and dense optimizers.
    pub optimizer: OptimizerSection,
    /// Embedding engine options.
    #[serde(default)]
    pub embedding: EmbeddingSection,
    /// Length of training and evaluation cadence.
    pub train: TrainSection,
    /// Metrics computed on the eval split (`[[metrics]]`).
    #[serde(default = "defaults::metrics")]
    pub metrics: Vec<MetricSection>,
    /// The tasks (`[[tasks]]`): one logit, loss term and set of metrics per task. Default: one
    /// task per label column of the sampler.
    #[serde(default)]
    pub tasks: Vec<TaskSection>,
    /// The machines the job is planned for (ranks, memory, bandwidths).
    #[serde(default)]
    pub topology: TopologySection,
    /// The sharding planner.
    #[serde(default)]
    pub planner: PlannerSection,
    /// How a training step's stages are scheduled.
    #[serde(default)]
    pub pipeline: PipelineSection,
}

/// `[pipeline]`: how the stages of a training step are scheduled (TorchRec's train
/// pipelines). Every kind trains the same model; they differ in what overlaps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineSection {
    /// `base`: load, forward, backward, update, one batch at a time. `sparse_dist`: batch
    /// i+1 is read ahead and its input dist (the ids' all-to-alls to the ranks holding their
    /// rows) runs on a second thread while batch i's dense forward and backward run.
    /// `prefetch_sparse_dist`: as `sparse_dist`, and that thread also loads batch i+1's rows
    /// into the caches of cached tables (`constraints.compute_kernels =
    /// ["fused_uvm_caching"]` or `["key_value"]`), so its lookups never read the disk.
    /// Default: `base`.
    #[serde(default)]
    pub kind: PipelineKind,
    /// What the pipelines that read ahead do when an epoch's data ends: `true` trains the
    /// batches still in flight (every batch is trained); `false` drops them and ends the
    /// epoch at once, as TorchRec's pipelines with `execute_all_batches=False` (the last
    /// batch of each epoch is not trained). No effect on `base`. Default: `true`.
    #[serde(default = "yes")]
    pub execute_all_batches: bool,
}

fn yes() -> bool {
    true
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self { kind: PipelineKind::default(), execute_all_batches: true }
    }
}

impl PipelineSection {
    /// Whether the pipeline reads batch i+1 ahead of batch i's update.
    pub fn reads_ahead(&self) -> bool {
        self.kind != PipelineKind::Base
    }
}

/// `[topology]`: the ranks the embedding tables are sharded over, as the planner sees them.
/// Unset keys take TorchRec's planner defaults. The planner's batch size is `data.batch_size`
/// (per rank).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TopologySection {
    /// Ranks in all. `trainrec run` trains on this many ranks (one thread each: tables sharded
    /// by the plan, the dense model data-parallel); `data.batch_size` is per rank.
    #[serde(default = "defaults::world_size")]
    pub world_size: usize,
    /// Ranks per host. Default: `world_size` (one host).
    #[serde(default)]
    pub local_world_size: Option<usize>,
    /// Device running the job: `cpu` (tables in DDR), or `cuda`: the dense model and the tables
    /// on the GPU (HBM), trainrec's CUDA kernels; rank `r` on GPU `r % local_world_size`, the
    /// ranks talking through NCCL. It needs an NVIDIA GPU per rank of a host, its driver, NVRTC,
    /// a CUDA build of libtorch 2.11 on the library path, and NCCL for several ranks (see the
    /// GPUs chapter).
    #[serde(default)]
    pub compute_device: ComputeDevice,
    /// Device memory per rank, GiB. Default: 32 on `cuda`, 0 on `cpu`.
    #[serde(default)]
    pub hbm_gib: Option<f64>,
    /// Host memory per rank, GiB. Default: 128.
    #[serde(default)]
    pub ddr_gib: Option<f64>,
    /// SSD per rank, GiB (for `key_value` tables). Default: 2048.
    #[serde(default)]
    pub ssd_gib: Option<f64>,
    /// Device memory bandwidth, GiB/s. Default: 897.
    #[serde(default)]
    pub hbm_bandwidth: Option<f64>,
    /// Host memory bandwidth, GiB/s. Default: 51.
    #[serde(default)]
    pub ddr_bandwidth: Option<f64>,
    /// SSD bandwidth, GiB/s. Default: 0.098 (100 MiB/s).
    #[serde(default)]
    pub ssd_bandwidth: Option<f64>,
    /// Device-to-host-memory bandwidth, GiB/s (UVM). Default: 32.
    #[serde(default)]
    pub hbm_to_ddr_bandwidth: Option<f64>,
    /// Bandwidth between ranks of one host, GiB/s. Default: 600.
    #[serde(default)]
    pub intra_host_bandwidth: Option<f64>,
    /// Bandwidth between hosts, GiB/s. Default: 12.5.
    #[serde(default)]
    pub inter_host_bandwidth: Option<f64>,
    /// Size of each bucket of the dense gradients' all-reduce across ranks, MiB (DDP's
    /// `bucket_cap_mb`). The gradients travel in buckets, last parameters first; while one
    /// bucket is reduced the next is packed and the previous unpacked. Default: 25.
    #[serde(default)]
    pub gradient_bucket_mib: Option<f64>,
}

impl Default for TopologySection {
    fn default() -> Self {
        Self {
            world_size: defaults::world_size(),
            local_world_size: None,
            compute_device: ComputeDevice::Cpu,
            hbm_gib: None,
            ddr_gib: None,
            ssd_gib: None,
            hbm_bandwidth: None,
            ddr_bandwidth: None,
            ssd_bandwidth: None,
            hbm_to_ddr_bandwidth: None,
            intra_host_bandwidth: None,
            inter_host_bandwidth: None,
            gradient_bucket_mib: None,
        }
    }
}

/// `[planner]`: how tables are assigned sharding types, kernels and ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlannerSection {
    /// Which proposers run: `default` (TorchRec's list: grid search when small, greedy by
    /// slowest shard, greedy by summed shards, uniform), `greedy`, `uniform`, `grid`, or
    /// `offload_scaleup` (greedy, then grow cached tables' load factors into free memory).
    #[serde(default)]
    pub proposer: ProposerKind,
    /// Greedy proposer: stop after this many proposals without a better plan. Default: try
    /// every option.
    #[serde(default)]
    pub early_stop_threshold: Option<u32>,
    /// `greedy_perf` (largest tables first onto the least-loaded rank) or `memory_balanced`
    /// (as fast within 2%, memory spread evenly).
    #[serde(default)]
    pub partitioner: PartitionerKind,
    /// Share of each rank's table memory kept free for everything else (TorchRec's heuristic
    /// reservation).
    #[serde(default = "defaults::reserved_percentage")]
    pub reserved_percentage: f64,
    /// Memory per rank reserved for the dense model (parameters, gradients, optimizer
    /// state), MiB. Default: the built model's parameter bytes × 6 (TorchRec's multiplier);
    /// `trainrec validate` counts 0.
    #[serde(default)]
    pub dense_estimate_mib: Option<f64>,
    /// Estimator formulas: `trainrec` (trainrec's engines) or `torchrec` (TorchRec 1.9's
    /// defaults exactly).
    #[serde(default)]
    pub cost_model: CostModel,
    /// After the proposers, improve the best plan one table at a time (each table's other
    /// options, the rest unchanged) while its slowest rank gets faster; for search spaces of
    /// up to 20,000 options.
    #[serde(default = "defaults::refine")]
    pub refine: bool,
    /// Use this saved plan (`trainrec plan` writes one) instead of planning; it must have been
    /// made for the same tables, constraints, topology and planner settings (checked by hash).
    /// Relative to the recipe file.
    #[serde(default)]
    pub plan_file: Option<String>,
}

impl Default for PlannerSection {
    fn default() -> Self {
        Self {
            proposer: ProposerKind::Default,
            early_stop_threshold: None,
            partitioner: PartitionerKind::GreedyPerf,
            reserved_percentage: defaults::reserved_percentage(),
            dense_estimate_mib: None,
            cost_model: CostModel::Trainrec,
            refine: defaults::refine(),
            plan_file: None,
        }
    }
}

/// `[[tasks]]`: one prediction task of a multi-task job (TorchRec's `RecTaskInfo`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    /// Task name; metrics are reported as `<metric>-<name>` (e.g. `auc-click`) when a job has
    /// more than one task.
    pub name: String,
    /// The sampler's label column this task predicts. Default: the task's name.
    #[serde(default)]
    pub label: Option<String>,
    /// The task's weight in the training loss, which is the sum over tasks of `loss_weight`
    /// times the task's (sample-weighted) mean binary cross-entropy. Finite and `>= 0`;
    /// default 1.
    #[serde(default = "defaults::loss_weight")]
    pub loss_weight: f64,
}

impl TaskSection {
    /// The label column: `label`, or the task's name.
    pub fn label_column(&self) -> &str {
        self.label.as_deref().unwrap_or(&self.name)
    }
}

/// The most threads `run.threads` may ask for (more than any machine has cores).
pub const MAX_THREADS: usize = 1024;

/// `[run]`: identity of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Name of the run; the default output directory is `runs/<name>`.
    pub name: String,
    /// Seed for weight initialisation, synthetic data and shuffling. Two runs with the same
    /// seed and recipe write identical metrics.
    #[serde(default)]
    pub seed: u64,
    /// Directory for `resolved.toml` and `metrics.jsonl`, relative to the working directory.
    /// Default: `runs/<name>`.
    #[serde(default)]
    pub output_dir: Option<String>,
    /// Threads for dense compute (libtorch) and embedding kernels, 1 to 1024. Default: all
    /// cores.
    #[serde(default)]
    pub threads: Option<usize>,
}

/// `[data]`: batching and the sampler that produces examples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Training examples per batch.
    pub batch_size: usize,
    /// Examples per eval batch. Default: `batch_size`.
    #[serde(default)]
    pub eval_batch_size: Option<usize>,
    /// The data source: `kind` names a registered sampler (`synthetic`, `criteo_tsv`, or a
    /// plugin's); the other keys are that sampler's own (see the sampler reference).
    pub sampler: PluginSection,
    /// Shuffling of the training rows of each epoch, any sampler's (`kind = "none"`,
    /// `"buffer"` with `rows`, or `"full"`): every row still comes exactly once per epoch, in
    /// an order given by `run.seed`, the epoch and the rank, within the rank's share of the
    /// rows. The eval split keeps its order. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle: Option<Shuffle>,
}

/// A section owned by a plugin: `kind` picks the implementation, the remaining keys are
/// checked against that implementation's own schema.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct PluginSection(pub serde_json::Map<String, serde_json::Value>);

impl PluginSection {
    /// The `kind` key, when it is a string.
    pub fn kind(&self) -> Option<&str> {
        self.0.get("kind").and_then(|v| v.as_str())
    }

    /// The section without its `kind` key: the plugin's own config.
    pub fn config(&self) -> serde_json::Value {
        let mut map = self.0.clone();
        map.remove("kind");
        serde_json::Value::Object(map)
    }
}

/// `[[tables]]`: one embedding table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TableSection {
    /// Unique table name.
    pub name: String,
    /// Sparse features looked up in this table. A feature used by two tables must be written
    /// `feature@table` in each, so every pooled output has its own name.
    pub features: Vec<String>,
    /// Number of rows (hash size); feature ids must lie in `0..rows`.
    pub rows: u64,
    /// Embedding dimension.
    pub dim: usize,
    /// How the ids of one bag are combined.
    #[serde(default = "defaults::pooling")]
    pub pooling: PoolingMode,
    /// Storage precision of the weights (`fp32`, `fp16`, `bf16`); lookups and updates compute
    /// in fp32 and the optimizer state is always fp32.
    #[serde(default)]
    pub precision: WeightPrecision,
    /// Round fp16/bf16 weight updates stochastically (unbiased; FBGEMM's default) instead of
    /// to nearest. No effect on fp32 tables.
    #[serde(default = "defaults::stochastic_rounding")]
    pub stochastic_rounding: bool,
    /// This table's own fused optimizer (same keys as `[optimizer.sparse]`); tables sharing
    /// precision, optimizer and pooling are batched into one group.
    #[serde(default)]
    pub optimizer: Option<SparseOptimizerConfig>,
    /// Clip this table's gradients as FBGEMM's `gradient_clipping` / `max_gradient` fused
    /// parameters do: every element of the gradient of the table's pooled outputs is clamped to
    /// `[-max_gradient, max_gradient]` before the fused backward and update. Positive; unset:
    /// `embedding.max_gradient` (no clipping when both are unset).
    #[serde(default)]
    pub max_gradient: Option<f64>,
    /// The planner's constraints on this table (TorchRec's `ParameterConstraints`): allowed
    /// sharding types and kernels, pooling factors, cache parameters (the one place the cache
    /// load factor is set), ...
    #[serde(default)]
    pub constraints: Constraints,
    /// Managed collisions (zero-collision hashing): the features' raw ids come from a larger
    /// id space (`input_hash_size`) and the most useful ones each get a row of their own.
    #[serde(default)]
    pub mc: Option<ManagedCollisionSection>,
    /// A dynamic table keyed by the raw 64-bit id: `rows` is its capacity; an id gets a row of
    /// its own once admitted, keeps it while it is used, and reads zeros (no update) before.
    #[serde(default)]
    pub dynamic: Option<DynamicSection>,
    /// Learned position weights (TorchRec's `PositionWeightedModule` in a
    /// `FeatureProcessedEmbeddingBagCollection`): each id of a bag is weighted by a learned
    /// weight of its position in the bag (0 for the first id) before the table sums the bag.
    /// Each feature of the table gets its own `max_length` weights, starting at 1 and trained
    /// by the dense optimizer. A `pooling = "sum"` table on CPU ranks.
    #[serde(default)]
    pub position_weighted: Option<PositionWeightedSection>,
}

/// `tables[].position_weighted`: learned per-position weights of a table's features.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PositionWeightedSection {
    /// Positions with a weight of their own (TorchRec's `max_feature_length`). A bag's ids at
    /// position `max_length - 1` and beyond share the last weight (TorchRec refuses a longer
    /// bag).
    pub max_length: usize,
}

/// `[tables.dynamic]`: a dynamic table (Monolith's collisionless tables, DeepRec's
/// EmbeddingVariable): keyed by the raw 64-bit id, `rows` ids hold a row at once, each its own
/// (no collisions). Ids are counted before admission in a bounded sketch; rows are freed when
/// unseen for `ttl_steps` and taken from the least used id when a new one needs room. A row
/// that changes hands restarts from fresh initial weights and optimizer state. The table pools
/// by sum; an id without a row adds nothing to its bag and gets no update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DynamicSection {
    /// Sightings of an id before it gets a row. Default: 1 (at once).
    #[serde(default = "defaults::admit_after")]
    pub admit_after: u32,
    /// Chance that a sighting past `admit_after` admits the id (a reproducible coin of the id,
    /// the seed and the step), in `(0, 1]`. Default: 1.
    #[serde(default = "defaults::admit_probability")]
    pub admit_probability: f64,
    /// Training steps a row may go unseen before it is freed. Default: unset (rows stay until
    /// a new id needs their room).
    #[serde(default)]
    pub ttl_steps: Option<u64>,
    /// Which row makes room when a new id is admitted into a full table: `lfu` (least
    /// frequently used) or `lru` (least recently used). Rows used in the current step are
    /// never taken.
    #[serde(default)]
    pub eviction: DynamicEvictionPolicy,
    /// Counters per row of the admission sketch (count-min; memory `4 × width × depth` bytes,
    /// whatever the id space). Default: 2^18 (4 MiB with the default depth).
    #[serde(default = "defaults::sketch_width")]
    pub sketch_width: usize,
    /// Rows of the admission sketch. Default: 4.
    #[serde(default = "defaults::sketch_depth")]
    pub sketch_depth: usize,
    /// Size of the raw id space samplers hash the table's features into (`0..id_space`).
    /// Default: 2^62.
    #[serde(default = "defaults::id_space")]
    pub id_space: u64,
    /// Independent id maps the table is split into: raw id `i` belongs to map
    /// `hash(i) % partitions`, which owns the table's row block of the same index (the
    /// row-wise blocks, `ceil(rows / partitions)` rows each) and does its own admission and
    /// eviction. When the table is sharded row-wise in those blocks (`partitions =
    /// topology.world_size` with a `row_wise` table), each rank runs the maps of its own
    /// block on the ids the input dist routes to it (owner-rank admission: no rank counts
    /// another's ids); otherwise every rank runs every map over the global batch. Default: 1.
    #[serde(default = "defaults::dynamic_partitions")]
    pub partitions: u32,
}

/// Which row of a full dynamic table makes room for a new id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DynamicEvictionPolicy {
    /// The least frequently used row.
    #[default]
    Lfu,
    /// The least recently used row.
    Lru,
}

/// `[tables.mc]`: managed collisions for one table (TorchRec's `MCHManagedCollisionModule`).
/// Training steps count the raw ids over windows of `eviction_interval` steps; at the end of
/// each window the policy picks the ids that hold the slots, and a slot that changes hands has
/// its row and optimizer state re-initialised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ManagedCollisionSection {
    /// Slots for tracked ids, at most `rows`. Default: `rows`, and untracked ids share the
    /// last row, which is kept for them (so `rows - 1` ids are tracked). Fewer than `rows`:
    /// untracked ids are hashed into the other `rows - zch_size` rows.
    #[serde(default)]
    pub zch_size: Option<u64>,
    /// Size of the raw id space: samplers hash this table's features into
    /// `0..input_hash_size` instead of `0..rows`. Default: 2^63 (raw ids as they come).
    #[serde(default = "defaults::input_hash_size")]
    pub input_hash_size: u64,
    /// Which ids keep the slots: `lfu` (most frequent, counts accumulated over windows),
    /// `lru` (most recently seen) or `distance_lfu` (counts divided by a power of the age).
    #[serde(default)]
    pub eviction_policy: McEvictionPolicy,
    /// Exponent of the age in the `lru` and `distance_lfu` scores. Default: 1.
    #[serde(default = "defaults::decay_exponent")]
    pub decay_exponent: f64,
    /// Training steps per eviction window. Default: 100.
    #[serde(default = "defaults::eviction_interval")]
    pub eviction_interval: u64,
    /// Independent modules the table's managed collisions are split into (TorchRec's one
    /// module per row-wise shard): module `i` takes the raw ids of block `i` of
    /// `ceil(input_hash_size / partitions)` ids and owns block `i` of `ceil(rows /
    /// partitions)` rows, with its share of the residual rows (or its own reserved last row).
    /// When the plan shards the table row-wise in those same blocks, each rank remaps the ids
    /// of its own block after the input dist (the owner-rank remap); otherwise every rank
    /// runs every module on the global batch. Default: the number of row blocks when the plan
    /// shards the table row-wise or table-row-wise, else 1; a resumed run keeps the
    /// checkpoint's. Set it to train the same model on any number of ranks.
    #[serde(default)]
    pub partitions: Option<u64>,
}

/// `[embedding]`: options of the embedding engine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingSection {
    /// What to do with an id outside `0..rows`: `fatal` stops with an error naming the table,
    /// feature, example and id; `warning` counts, logs and reads row 0 instead (FBGEMM's
    /// `WARNING`); `ignore` reads row 0 silently.
    #[serde(default)]
    pub bounds_check: BoundsCheckMode,
    /// Directory of the backing files of cached tables on CPU (`fused_uvm_caching`: the whole
    /// table on disk; `key_value`: only the rows written so far; either with a cache of
    /// `constraints.cache.load_factor` of its rows in memory). Put it on a local SSD. The files are unlinked as soon as they are made, so
    /// nothing stays behind. Default: `offload/` in the run directory.
    #[serde(default)]
    pub offload_dir: Option<std::path::PathBuf>,
    /// FBGEMM's gradient clipping for every table that does not set its own
    /// `tables[].max_gradient`: the pooled outputs' gradient clamped element-wise to
    /// `[-max_gradient, max_gradient]` before the fused update (TorchRec's fused parameters
    /// `gradient_clipping = True, max_gradient = ...`). Positive; unset: no clipping.
    #[serde(default)]
    pub max_gradient: Option<f64>,
}

/// `[optimizer]`: the two optimizers of a job. Neither has a silent default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// Optimizer fused into the embedding backward (applied once per unique row per step).
    pub sparse: SparseOptimizerConfig,
    /// Optimizer of the dense model's parameters.
    pub dense: DenseOptimizerConfig,
    /// The dense optimizer's learning-rate schedule (`[[optimizer.dense_schedule]]`, TorchRec's
    /// `WarmupOptimizer` stages): step `t` (from 0, over the whole run) takes the first stage
    /// whose `max_iters` is at least `t`, and trains at `dense.lr` times its multiplier; 1 after
    /// the last stage. Default: none (a constant rate).
    #[serde(default)]
    pub dense_schedule: Vec<WarmupStage>,
    /// The fused optimizers' learning-rate schedule (`[[optimizer.sparse_schedule]]`), as
    /// `dense_schedule`: every table's rate is its optimizer's `lr` times the multiplier.
    /// Default: none.
    #[serde(default)]
    pub sparse_schedule: Vec<WarmupStage>,
    /// Clipping of the dense gradients before each update (`[optimizer.dense_clipping]`:
    /// `kind = "norm"` or `"value"`, `max_gradient`, `norm_type`). Default: none.
    #[serde(default)]
    pub dense_clipping: Option<trainrec_types::DenseClipping>,
}

/// `[train]`: how long to train and how often to evaluate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Number of training steps (batches). Set exactly one of `steps` and `epochs`.
    #[serde(default)]
    pub steps: Option<u64>,
    /// Number of passes over the sampler's train split. Set exactly one of `steps` and `epochs`.
    #[serde(default)]
    pub epochs: Option<u64>,
    /// Evaluate every this many steps (and always once at the end). Default: only at the end.
    #[serde(default)]
    pub eval_every: Option<u64>,
    /// Evaluate on at most this many eval batches. Default: the whole eval split.
    #[serde(default)]
    pub eval_batches: Option<u64>,
    /// Log the running train loss every this many steps.
    #[serde(default = "defaults::log_every")]
    pub log_every: u64,
    /// Show a progress bar (on a terminal only).
    #[serde(default = "defaults::progress")]
    pub progress: bool,
    /// Also compute the `[[metrics]]` on the training batches, reporting them every this many
    /// steps (TorchRec's `compute_interval_steps`) as `lifetime_<metric>` (every batch so far)
    /// and `window_<metric>` (the latest `metrics_window` samples). Default: eval only.
    #[serde(default)]
    pub metrics_every: Option<u64>,
    /// Window of the training metrics, in samples (TorchRec's `window_size`).
    #[serde(default = "defaults::metrics_window")]
    pub metrics_window: u64,
    /// Save a checkpoint every this many steps into `<output_dir>/checkpoints/step-<N>`
    /// (every rank's shards with their optimizer state, the dense model and its optimizer,
    /// managed-collision state, the data position and the training metrics); resume with
    /// `trainrec run --resume <output_dir>`. Default: only the final checkpoint
    /// (`final_checkpoint`).
    #[serde(default)]
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept: older ones are deleted once a newer one is complete.
    #[serde(default = "defaults::keep_checkpoints")]
    pub keep_checkpoints: u64,
    /// Save a checkpoint at the last step, whether the run ends by `steps` or `epochs` (unless
    /// `checkpoint_every` just saved it), so every run leaves its trained model for `eval`,
    /// `export` and `--resume`. `false`: only `checkpoint_every`'s.
    #[serde(default = "defaults::final_checkpoint")]
    pub final_checkpoint: bool,
    /// The precision of the dense model's matrix products, in training and evaluation:
    /// `"fp32"`, or `"bf16"` (mixed precision as `torch.autocast(dtype=torch.bfloat16)`: linear
    /// layers and batched products run in bf16, while the parameters, their gradients and the
    /// dense optimizer's state stay fp32). Embedding tables keep their own `precision`.
    #[serde(default)]
    pub dense_precision: trainrec_types::DensePrecision,
}

/// `[[metrics]]`: one metric on the eval split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MetricSection {
    /// Normalized entropy: cross entropy (base 2) over the entropy of the base rate, as
    /// TorchRec defines it. Lower is better; 1.0 is no better than predicting the CTR.
    Ne {
        /// Also report log loss (TorchRec's definition: mean base-2 cross entropy).
        #[serde(default = "defaults::include_logloss")]
        include_logloss: bool,
    },
    /// Area under the ROC curve, as TorchRec computes it.
    Auc {
        /// Also report `grouped_auc`: the mean over groups of each group's AUC (TorchRec's
        /// `grouped_auc`), groups given by the sampler's grouping key (the synthetic sampler's
        /// `session_size`).
        #[serde(default)]
        grouped: bool,
    },
    /// NDCG@k over the sampler's sessions (TorchRec's `NDCGMetric`): samples ranked by
    /// prediction within each session of a batch. As TorchRec, reports `1 - ndcg` (lower is
    /// better, like NE) unless `report_as_decreasing = false`.
    Ndcg {
        /// Ranks counted per session; unset counts all (TorchRec's `k = -1`).
        #[serde(default)]
        k: Option<usize>,
        /// Gain `2^label - 1` instead of `label`.
        #[serde(default)]
        exponential_gain: bool,
        /// Report `1 - ndcg` (TorchRec's default) rather than `ndcg`.
        #[serde(default = "defaults::report_as_decreasing")]
        report_as_decreasing: bool,
        /// Ignore sessions of a single sample.
        #[serde(default)]
        remove_single_length_sessions: bool,
    },
    /// Session-level recall@k for retrieval (TorchRec's `RecallSessionMetric`): a sample is
    /// retrieved when fewer than `top_threshold` samples of its session score higher;
    /// `recall = Σ w y [retrieved] / Σ w y`.
    RecallSession {
        /// `k`: how many of each session's top predictions count as retrieved.
        top_threshold: usize,
        /// Also replace labels by "among the session's top `top_threshold` labels".
        #[serde(default)]
        run_ranking_of_labels: bool,
    },
    /// Retrieval recall@k, for models that embed queries and candidates apart (`two_tower`):
    /// for every positive eval pair, every candidate of the corpus (each row of the candidate
    /// feature's table) is scored against the query, and the pair counts as recalled when its
    /// own candidate is among the top `k`. Reported as `recall_at_<k>` for each `k`. Eval only.
    RecallAtK {
        /// The cut-offs, e.g. `[10, 50]`.
        k: Vec<usize>,
    },
    /// Next-item hit rate and NDCG under full ranking, for models that predict a user's next
    /// item (`sasrec`): each eval example's target item is ranked against every row of the
    /// item table by the user's score (ties count against the target, nothing is masked), and
    /// reported as `hr_at_<k>` (the share of targets ranked in the top `k`) and `ndcg_at_<k>`
    /// (`1 / log2(rank + 2)` for a target in the top `k`, else 0, averaged) for each `k`.
    /// Eval only.
    FullRanking {
        /// The cut-offs, e.g. `[10, 20]`.
        k: Vec<usize>,
    },
    /// Area under the precision-recall curve (TorchRec's step-wise definition), exact over
    /// the eval split.
    Auprc {},
    /// Calibration: `Σ w p / Σ w y` (1.0 is calibrated; 0 when there are no positives).
    Calibration {},
    /// Click-through rate: the weighted mean label `Σ w y / Σ w`.
    Ctr {},
    /// Mean squared error `Σ w (y - p)² / Σ w`; also reports `rmse`.
    Mse {},
    /// Mean absolute error `Σ w |y - p| / Σ w`.
    Mae {},
    /// Weighted share of examples whose decision `p >= threshold` equals the label.
    Accuracy {
        /// Decision threshold.
        #[serde(default = "defaults::threshold")]
        threshold: f64,
    },
    /// `tp / (tp + fp)` at `p >= threshold`.
    Precision {
        /// Decision threshold.
        #[serde(default = "defaults::threshold")]
        threshold: f64,
    },
    /// `tp / (tp + fn)`; as in TorchRec a prediction equal to the threshold counts as both a
    /// true positive and a false negative.
    Recall {
        /// Decision threshold.
        #[serde(default = "defaults::threshold")]
        threshold: f64,
    },
    /// Weighted mean prediction `Σ w p / Σ w`.
    WeightedAvg {},
    /// A metric a plugin registered (`Registry::metric`): `name` picks it, `options` are its
    /// own keys, checked against its schema.
    Plugin {
        /// The registered metric's name.
        name: String,
        /// The metric's options (see the plugin's reference section).
        #[serde(default)]
        options: serde_json::Map<String, serde_json::Value>,
    },
}

/// Defaults, declared once.
pub mod defaults {
    use super::*;

    /// Default `tasks[].loss_weight`.
    pub fn loss_weight() -> f64 {
        1.0
    }
    /// Default `topology.world_size`.
    pub fn world_size() -> usize {
        1
    }
    /// Default `planner.refine`.
    pub fn refine() -> bool {
        true
    }
    /// Default `planner.reserved_percentage` (TorchRec's heuristic reservation).
    pub fn reserved_percentage() -> f64 {
        trainrec_planner::defaults::RESERVED_PERCENTAGE
    }
    /// Default `[[metrics]]`: NE (with log loss) and AUC.
    pub fn metrics() -> Vec<MetricSection> {
        vec![MetricSection::Ne { include_logloss: true }, MetricSection::Auc { grouped: false }]
    }
    /// Default `report_as_decreasing` of NDCG (TorchRec: `True`).
    pub fn report_as_decreasing() -> bool {
        true
    }
    /// Default decision threshold of accuracy, precision and recall (TorchRec: 0.5).
    pub fn threshold() -> f64 {
        0.5
    }
    /// Default `tables[].pooling`.
    pub fn pooling() -> PoolingMode {
        PoolingMode::Sum
    }
    /// Default `tables[].dynamic.admit_after`.
    pub fn admit_after() -> u32 {
        1
    }
    /// Default `tables[].dynamic.admit_probability`.
    pub fn admit_probability() -> f64 {
        1.0
    }
    /// Default `tables[].dynamic.sketch_width`.
    pub fn sketch_width() -> usize {
        1 << 18
    }
    /// Default `tables[].dynamic.sketch_depth`.
    pub fn sketch_depth() -> usize {
        4
    }
    /// Default `tables[].dynamic.partitions`: 1.
    pub fn dynamic_partitions() -> u32 {
        1
    }
    /// Default `tables[].dynamic.id_space`: 2^62.
    pub fn id_space() -> u64 {
        1 << 62
    }
    /// Default `tables[].mc.input_hash_size`: 2^63.
    pub fn input_hash_size() -> u64 {
        1 << 63
    }
    /// Default `tables[].mc.decay_exponent`.
    pub fn decay_exponent() -> f64 {
        1.0
    }
    /// Default `tables[].mc.eviction_interval`.
    pub fn eviction_interval() -> u64 {
        100
    }
    /// Default `stochastic_rounding` (FBGEMM: `True`).
    pub fn stochastic_rounding() -> bool {
        true
    }
    /// Default `train.log_every`.
    pub fn log_every() -> u64 {
        100
    }
    /// Default `train.metrics_window`: 100,000 samples.
    pub fn metrics_window() -> u64 {
        100_000
    }
    /// Default `train.keep_checkpoints`.
    pub fn keep_checkpoints() -> u64 {
        3
    }
    /// Default `train.final_checkpoint`.
    pub fn final_checkpoint() -> bool {
        true
    }
    /// Default `train.progress`.
    pub fn progress() -> bool {
        true
    }
    /// Default `include_logloss`.
    pub fn include_logloss() -> bool {
        true
    }
}

impl Recipe {
    /// The JSON schema of the whole recipe (drives validation and the reference page).
    pub fn json_schema() -> serde_json::Value {
        serde_json::to_value(schemars::schema_for!(Recipe)).expect("schema serializes")
    }

    /// The output directory: `run.output_dir` or `runs/<name>`.
    pub fn output_dir(&self) -> std::path::PathBuf {
        match &self.run.output_dir {
            Some(dir) => dir.into(),
            None => std::path::Path::new("runs").join(&self.run.name),
        }
    }
}
