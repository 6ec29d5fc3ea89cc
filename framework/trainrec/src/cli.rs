//! Command-line interface: thin argument parsing over the engine.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 invalid recipe or usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trainrec_engine::{EngineError, Registry, load_and_check};
use trainrec_recipe::LoadOptions;

/// Train large recommendation models from a TOML recipe.
#[derive(Debug, Parser)]
#[command(name = "trainrec", version, about)]
pub struct Cli {
    /// Log level (error, warn, info, debug, trace) or a full filter such as
    /// `trainrec_engine=debug`. `RUST_LOG` is used when this is not given.
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Recipe overrides shared by the commands that read recipes.
#[derive(Debug, clap::Args)]
pub struct Overrides {
    /// Override a recipe key: `--set train.steps=100`, `--set tables[0].rows=5000`. The value is
    /// TOML (`1e-3`, `"x"`, `[1, 2]`); a bare word is taken as a string. Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Ignore `TRAINREC_<SECTION>__<KEY>` environment overrides.
    #[arg(long)]
    pub no_env: bool,
}

impl Overrides {
    fn options(&self) -> LoadOptions {
        LoadOptions { overrides: self.set.clone(), env: !self.no_env }
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train (and evaluate) the job a recipe describes; or, with `--resume RUN_DIR`, go on
    /// from the run's newest checkpoint.
    Run {
        /// The recipe file (with `--resume`: default `RUN_DIR/resolved.toml`).
        #[arg(required_unless_present = "resume")]
        recipe: Option<PathBuf>,
        /// Resume the run in this directory from its newest complete checkpoint
        /// (`train.checkpoint_every`). `--set train.steps=N` trains longer;
        /// `--set topology.world_size=N` reshards onto N ranks.
        #[arg(long, value_name = "RUN_DIR")]
        resume: Option<PathBuf>,
        /// Overrides.
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Train a recipe on `--nproc` processes of this host through `mpirun` (the MPI backend):
    /// `mpirun -n N trainrec run <recipe> --set topology.world_size=N`. Needs a binary built
    /// with `--features mpi`.
    Launch {
        /// Processes (ranks) to start.
        #[arg(long)]
        nproc: usize,
        /// The recipe file.
        recipe: PathBuf,
        /// Overrides, passed to every rank.
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Plan the sharding of a recipe's tables: prints the per-rank and per-table stats (with
    /// each table's runner-up) and writes `plan.json`. Plans afresh even when
    /// `planner.plan_file` is set, and then rewrites that file.
    Plan {
        /// The recipe file.
        recipe: PathBuf,
        /// Plan for this many ranks (`--set topology.world_size=N`).
        #[arg(long)]
        world_size: Option<usize>,
        /// Where to write the plan. Default: `planner.plan_file` when set, else
        /// `<run output dir>/plan.json`.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Overrides (`--set topology.compute_device=cuda`, `--set planner.cost_model=torchrec`).
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Check recipes and print every problem found, with key path, file and line.
    Validate {
        /// Recipe files.
        #[arg(required = true)]
        recipes: Vec<PathBuf>,
        /// Overrides, applied to each recipe.
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Print the recipe reference (Markdown) generated from the schema.
    Reference,
    /// List the registered samplers, models and plugin metrics with one-line docs.
    List,
    /// Convert data between layouts.
    Convert {
        /// Which conversion.
        #[command(subcommand)]
        which: ConvertCommand,
    },
    /// Evaluate a run's newest checkpoint (or `--step N`'s) on its recipe's eval split, or on
    /// other data (`--set data.sampler.<key>=...`), on one process; `--quantize` evaluates
    /// inference tables (int8 row-wise as FBGEMM's layout, or fp16) instead of the fp32 ones.
    Eval {
        /// A run directory with checkpoints.
        run_dir: PathBuf,
        /// Evaluate the checkpoint of this step instead of the newest.
        #[arg(long)]
        step: Option<u64>,
        /// Quantize the tables for inference first.
        #[arg(long, value_enum)]
        quantize: Option<QuantizeArg>,
        /// Print the metrics as one JSON line instead of a table.
        #[arg(long)]
        json: bool,
        /// Overrides (`data.*`, `metrics`, `train.eval_batches`, ...; not the model).
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Write a run's newest checkpoint (or `--step N`'s) as one unsharded safetensors file:
    /// `embedding_bags.<table>.weight` (TorchRec's EBC state-dict names), `dense.<variable>`,
    /// and `managed_collisions.<table>.ids`; loadable with `safetensors.torch.load_file`.
    Export {
        /// A run directory with checkpoints (`train.checkpoint_every`).
        run_dir: PathBuf,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
        /// Export the checkpoint of this step instead of the newest.
        #[arg(long)]
        step: Option<u64>,
    },
    /// Render PNG plots of every metric of a run over its steps into `RUN_DIR/plots/`.
    Report {
        /// A run directory written by `trainrec run` (holding `metrics.jsonl`).
        run_dir: PathBuf,
    },
    /// Checks the CUDA embedding kernels on a GPU: every fused optimizer over fp32, fp16 and
    /// bf16 weights against the CPU engine (bit for bit), then W1 (`bench ebc`) on the GPU.
    /// Prints a table on stderr and one JSON line on stdout; without a GPU, an error naming
    /// what is missing.
    DeviceCheck {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Timed W1 steps (0 skips the benchmark).
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
    /// Benchmarks; each prints one JSON line on stdout (logs on stderr).
    Bench {
        /// Which benchmark.
        #[command(subcommand)]
        which: BenchCommand,
    },
}

/// Inference table precisions of `trainrec eval --quantize`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum QuantizeArg {
    /// 8-bit codes with an fp32 scale and bias per row.
    Int8,
    /// Half precision.
    Fp16,
}

/// The conversions.
#[derive(Debug, Subcommand)]
pub enum ConvertCommand {
    /// A Criteo TSV file to TorchRec's binary layout (`<prefix>_dense.npy`, `_sparse.npy`,
    /// `_labels.npy`), as TorchRec's `BinaryCriteoUtils.tsv_to_npys` writes it; read it with
    /// `kind = "criteo_binary"`.
    CriteoBinary {
        /// The TSV file.
        tsv: PathBuf,
        /// The output directory (created when missing).
        out_dir: PathBuf,
        /// File name prefix of the three files.
        #[arg(long, default_value = "train")]
        prefix: String,
        /// The file has no label column (Kaggle's test set): labels are written as -1.
        #[arg(long)]
        unlabeled: bool,
        /// Skip malformed lines (counted) instead of stopping at the first.
        #[arg(long)]
        skip_bad_rows: bool,
        /// Parser threads.
        #[arg(long, default_value_t = 2)]
        workers: usize,
    },
}

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// W2: DLRM train step or inference through the engine, the flags of
    /// `bench/anchors/w2_dlrm.py`.
    Dlrm(DlrmArgs),
    /// Reader throughput: rows/s of the `criteo_tsv`, `criteo_binary` and `parquet` samplers
    /// at each worker count, on generated data.
    Data(DataArgs),
    /// W1: pooled EBC train step (forward + fused backward/update), the flags of
    /// `bench/anchors/w1_ebc_train.py`.
    Ebc(EbcArgs),
    /// W4: NE and AUC update + compute over `--n` predictions, the flags of
    /// `bench/anchors/w4_metrics.py`.
    Metrics(MetricsArgs),
    /// W3: sharding planner wall time and plan quality on a table set, the flags and JSON keys
    /// of `bench/anchors/w3_planner.py`.
    Plan(PlanArgs),
    /// Sharded embeddings across ranks: input dist, lookup, output dist, gradient dist and
    /// update time per step for W2's shape, next to the raw all-to-all of the same bytes. Ranks
    /// are threads of this process, or MPI processes under `mpirun` (built with `--features mpi`).
    Dist(DistArgs),
    /// W2's DLRM trained across ranks under each train pipeline (`base`, `sparse_dist`,
    /// `prefetch_sparse_dist`): per-step time, and the input dist time `sparse_dist` hides
    /// behind the dense part. Ranks are threads of this process, or MPI processes under
    /// `mpirun` (built with `--features mpi`).
    Pipeline(PipelineArgs),
}

/// A train pipeline of `bench pipeline`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum PipelineArg {
    /// One batch at a time.
    Base,
    /// Batch i+1's input dist while batch i computes.
    SparseDist,
    /// `sparse_dist`, and batch i+1's rows prefetched into the table caches.
    PrefetchSparseDist,
}

/// Flags of `trainrec bench pipeline`.
#[derive(Debug, clap::Args)]
pub struct PipelineArgs {
    /// Ranks (threads of this process; under `mpirun`, its `-n` instead).
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// The pipelines timed, in order, each on a freshly built job.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "base,sparse-dist")]
    pub kinds: Vec<PipelineArg>,
    /// How every table is sharded.
    #[arg(long, value_enum, default_value = "row-wise")]
    pub sharding: DistShardingArg,
    /// The model, tables and batch (`--batch`: examples per rank).
    #[command(flatten)]
    pub shape: W2Shape,
    /// Timed steps per pipeline.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Compute threads per rank (0 = all cores).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Offload every table behind a cache of this share of its rows.
    #[arg(long)]
    pub cache_load_factor: Option<f64>,
}

/// Sharding of `bench dist`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DistShardingArg {
    /// Whole tables, round robin over the ranks.
    TableWise,
    /// Row blocks over every rank.
    RowWise,
    /// Column blocks over every rank.
    ColumnWise,
}

/// Flags of `trainrec bench dist`.
#[derive(Debug, clap::Args)]
pub struct DistArgs {
    /// Ranks (threads of this process; under `mpirun`, its `-n` instead).
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// How every table is sharded.
    #[arg(long, value_enum, default_value = "table-wise")]
    pub sharding: DistShardingArg,
    /// Tables (one feature each).
    #[arg(long, default_value_t = 26)]
    pub tables: usize,
    /// Rows per table.
    #[arg(long, default_value_t = 100_000)]
    pub rows: u64,
    /// Embedding dim.
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    /// Examples per rank.
    #[arg(long, default_value_t = 2048)]
    pub batch: usize,
    /// Ids per feature per example.
    #[arg(long, default_value_t = 1)]
    pub ids_per_feature: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Send every batch deduplicated (VBE): distinct bags per feature and inverse indices.
    #[arg(long)]
    pub dedup: bool,
}

/// Device of `bench plan`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DeviceArg {
    /// CPU ranks.
    Cpu,
    /// CUDA ranks.
    Cuda,
}

/// Cost model of `bench plan` and `plan`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum CostModelArg {
    /// trainrec's engines.
    Trainrec,
    /// TorchRec's default estimators and search space.
    Torchrec,
}

impl CostModelArg {
    fn model(self) -> trainrec_planner::CostModel {
        match self {
            Self::Trainrec => trainrec_planner::CostModel::Trainrec,
            Self::Torchrec => trainrec_planner::CostModel::Torchrec,
        }
    }
}

/// Proposers of `bench plan`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ProposerArg {
    /// TorchRec's default list (grid, greedy, greedy by sum, uniform).
    Default,
    /// Greedy only (`--threshold` early stop).
    Greedy,
}

/// Flags of `trainrec bench plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Table set (`../shared/bench/planner/tables-200.json`).
    #[arg(long)]
    pub tables_json: PathBuf,
    /// Ranks.
    #[arg(long, default_value_t = 8)]
    pub world_size: usize,
    /// Ranks per host (default: world size).
    #[arg(long)]
    pub local_world_size: Option<usize>,
    /// Planner batch size.
    #[arg(long, default_value_t = 512)]
    pub batch: u64,
    /// Compute device.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cuda)]
    pub compute_device: DeviceArg,
    /// Estimator formulas.
    #[arg(long, value_enum, default_value_t = CostModelArg::Trainrec)]
    pub cost_model: CostModelArg,
    /// Proposers.
    #[arg(long, value_enum, default_value_t = ProposerArg::Default)]
    pub proposer: ProposerArg,
    /// Greedy early-stop threshold (with `--proposer greedy`).
    #[arg(long)]
    pub threshold: Option<u32>,
    /// Timed plans.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Leave out the runner-up explanations (included by default, as TorchRec's timing
    /// includes its stats table).
    #[arg(long)]
    pub no_explain: bool,
    /// Skip the refinement pass (TorchRec's search exactly).
    #[arg(long)]
    pub no_refine: bool,
}

/// `--mode` of `bench dlrm`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DlrmModeArg {
    /// Forward, BCE loss, backward, dense Adagrad and fused row-wise Adagrad steps.
    Train,
    /// Eval-mode logits under no_grad.
    Infer,
}

/// W2's model, tables and batch: the flags `bench dlrm` and `bench pipeline` share (those of
/// `w2_dlrm.py`, same defaults).
#[derive(Debug, clap::Args)]
pub struct W2Shape {
    /// Sparse features (one table each).
    #[arg(long, default_value_t = 26)]
    pub num_sparse: usize,
    /// Rows per table.
    #[arg(long, default_value_t = 100_000)]
    pub rows: u64,
    /// Embedding dim (the last dense-arch size).
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    /// Ids per feature per sample.
    #[arg(long, default_value_t = 1)]
    pub ids_per_feature: usize,
    /// Dense-arch layer sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "512,256,64")]
    pub dense_arch: Vec<usize>,
    /// Over-arch layer sizes, comma separated (the last is 1).
    #[arg(long, value_delimiter = ',', default_value = "512,512,256,1")]
    pub over_arch: Vec<usize>,
    /// Samples per batch (per rank, for `bench pipeline`).
    #[arg(long, default_value_t = 2048)]
    pub batch: usize,
}

impl W2Shape {
    /// These flags' fields of the benchmark; the rest are `DlrmBench`'s defaults.
    fn bench(self) -> trainrec_engine::bench::DlrmBench {
        trainrec_engine::bench::DlrmBench {
            num_sparse: self.num_sparse,
            rows: self.rows,
            dim: self.dim,
            ids_per_feature: self.ids_per_feature,
            dense_arch: self.dense_arch,
            over_arch: self.over_arch,
            batch: self.batch,
            ..Default::default()
        }
    }
}

/// Flags of `trainrec bench dlrm` (those of `w2_dlrm.py`, same defaults).
#[derive(Debug, clap::Args)]
pub struct DlrmArgs {
    /// Train or infer.
    #[arg(long, value_enum, default_value_t = DlrmModeArg::Train)]
    pub mode: DlrmModeArg,
    /// Dense features per sample.
    #[arg(long, default_value_t = 13)]
    pub num_dense: usize,
    /// The model, tables and batch.
    #[command(flatten)]
    pub shape: W2Shape,
    /// Timed steps.
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Distinct pre-generated batches, cycled.
    #[arg(long, default_value_t = 8)]
    pub num_batches: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,
    /// Eps of the fused row-wise Adagrad.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Threads (0 = every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Also time the parts of the train step (`sections_ms`) and the step's matrix products
    /// alone at its shapes (`gemm_floor_ms`: the floor no fp32 implementation goes below).
    #[arg(long)]
    pub profile: bool,
    /// Leave glibc's allocator at its defaults (no mmap threshold / trim tuning).
    #[arg(long)]
    pub no_malloc_tuning: bool,
    /// Offload every table: a cache of this share of its rows in memory, the table in a file
    /// (`fused_uvm_caching`, LRU). Training mode only.
    #[arg(long)]
    pub cache_load_factor: Option<f64>,
    /// Offload with the `key_value` kernel instead of `fused_uvm_caching`: the cache in front
    /// of a store of only the rows written so far.
    #[arg(long, requires = "cache_load_factor")]
    pub key_value: bool,
    /// Directory of the offloaded tables' backing files (default: the bench's temp dir).
    #[arg(long)]
    pub offload_dir: Option<PathBuf>,
    /// Prefetch batch i+1's rows into the caches while batch i's dense part runs (the
    /// `prefetch_sparse_dist` pipeline).
    #[arg(long)]
    pub prefetch: bool,
    /// Draw ids from a power law of this exponent (row ranks scattered over the table)
    /// instead of uniformly: the skewed accesses that make a cache pay.
    #[arg(long)]
    pub zipf_alpha: Option<f64>,
}

/// Flags of `trainrec bench data`.
#[derive(Debug, clap::Args)]
pub struct DataArgs {
    /// Rows of synthetic Criteo-like data written to a temporary directory (then deleted).
    #[arg(long, default_value_t = 200_000)]
    pub rows: usize,
    /// Worker counts to measure each reader with (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub workers: Vec<usize>,
    /// Batch size of the passes.
    #[arg(long, default_value_t = 4096)]
    pub batch: usize,
    /// Rows per Parquet row group.
    #[arg(long, default_value_t = 16_384)]
    pub row_group_rows: usize,
}

/// Flags of `trainrec bench metrics`.
#[derive(Debug, clap::Args)]
pub struct MetricsArgs {
    /// Predictions in total.
    #[arg(long, default_value_t = 1_000_000)]
    pub n: usize,
    /// Predictions per update.
    #[arg(long, default_value_t = 8192)]
    pub batch: usize,
    /// Metric window in samples.
    #[arg(long, default_value_t = 1 << 20)]
    pub window: usize,
    /// Repeats, each with fresh metrics.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Id distribution of `bench ebc`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DistArg {
    /// Uniform over the rows.
    Uniform,
    /// Bounded Zipf(`--alpha`) over ranks, mapped to rows by a random permutation per table.
    Zipf,
}

/// Fused optimizer of `bench ebc`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum OptimizerArg {
    /// SGD.
    Sgd,
    /// Exact element-wise Adagrad.
    Adagrad,
    /// Exact row-wise Adagrad (the anchor's optimizer).
    RowwiseAdagrad,
    /// Adam.
    Adam,
    /// Partial row-wise Adam.
    PartialRowwiseAdam,
    /// LAMB.
    Lamb,
}

/// Flags of `trainrec bench ebc`.
#[derive(Debug, clap::Args)]
pub struct EbcArgs {
    /// Tables, one sum-pooled feature each.
    #[arg(long, default_value_t = 8)]
    pub tables: usize,
    /// Rows per table.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Embedding dim.
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    /// Ids per sample per feature.
    #[arg(long, default_value_t = 20)]
    pub pooling: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 4096)]
    pub batch: usize,
    /// Id distribution.
    #[arg(long, value_enum, default_value_t = DistArg::Uniform)]
    pub dist: DistArg,
    /// Zipf exponent.
    #[arg(long, default_value_t = 1.05)]
    pub alpha: f64,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Extra timed forward-only calls (0 = skip).
    #[arg(long, default_value_t = 10)]
    pub fwd_steps: usize,
    /// Distinct pre-generated batches, cycled through.
    #[arg(long, default_value_t = 4)]
    pub num_batches: usize,
    /// Fused optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerArg::RowwiseAdagrad)]
    pub optimizer: OptimizerArg,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f32,
    /// Optimizer eps.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f32,
    /// Threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also time the step with managed collisions on every table (LFU, eviction every N
    /// steps) and report its cost against the plain step (`mc` in the JSON).
    #[arg(long)]
    pub mc_interval: Option<u64>,
    /// Also time the forward pass over the trained tables quantized to int8 row-wise and to
    /// fp16 (inference tables), with their bytes, against the fp32 forward (`quant` in the
    /// JSON). Needs `--fwd-steps`.
    #[arg(long)]
    pub quant: bool,
    /// Where the tables live: `cpu` (the CPU engine) or `cuda` (GPU memory, the CUDA kernels;
    /// `--mc-interval` and `--quant` are CPU-only).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// GPU ordinal with `--device cuda`.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
}

impl EbcArgs {
    fn bench(&self) -> trainrec_embedding::bench::EbcBench {
        use trainrec_embedding::{SparseOptimizerConfig as O, WeightDecayMode, defaults};
        let (lr, eps) = (self.lr, self.eps);
        let (beta1, beta2, weight_decay) = (defaults::beta1(), defaults::beta2(), 0.0);
        let optimizer = match self.optimizer {
            OptimizerArg::Sgd => O::Sgd { lr },
            OptimizerArg::Adagrad => O::Adagrad { lr, eps },
            OptimizerArg::RowwiseAdagrad => {
                O::RowwiseAdagrad { lr, eps, weight_decay, weight_decay_mode: WeightDecayMode::None }
            }
            OptimizerArg::Adam => O::Adam { lr, eps, beta1, beta2, weight_decay },
            OptimizerArg::PartialRowwiseAdam => O::PartialRowwiseAdam { lr, eps, beta1, beta2, weight_decay },
            OptimizerArg::Lamb => O::Lamb { lr, eps, beta1, beta2, weight_decay },
        };
        trainrec_embedding::bench::EbcBench {
            tables: self.tables,
            rows: self.rows,
            dim: self.dim,
            pooling: self.pooling,
            batch: self.batch,
            dist: match self.dist {
                DistArg::Uniform => trainrec_embedding::bench::IdDist::Uniform,
                DistArg::Zipf => trainrec_embedding::bench::IdDist::Zipf(self.alpha),
            },
            steps: self.steps,
            warmup: self.warmup,
            fwd_steps: self.fwd_steps,
            num_batches: self.num_batches,
            optimizer,
            threads: self.threads,
            seed: self.seed,
            mc_interval: self.mc_interval,
            quant: self.quant,
        }
    }
}

fn init_tracing(level: Option<&str>) {
    let filter = match level {
        Some(l) => tracing_subscriber::EnvFilter::new(l),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Runs the CLI with the given registry (built-ins plus a user's plugins).
pub fn main_with(registry: Registry) -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_level.as_deref());
    // libtorch's CUDA half (absent from the CPU install; a CUDA torch's torch/lib on the
    // library path has it) loads before anything asks libtorch about CUDA.
    if matches!(cli.command, Command::Run { .. } | Command::Eval { .. } | Command::Launch { .. }) {
        trainrec_engine::preload_torch_cuda();
    }
    if let Err(e) = registry.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Convert {
            which: ConvertCommand::CriteoBinary { tsv, out_dir, prefix, unlabeled, skip_bad_rows, workers },
        } => {
            let options = trainrec_data::criteo_binary::ConvertOptions {
                labeled: !unlabeled,
                on_bad_row: if skip_bad_rows {
                    trainrec_data::BadRowPolicy::Skip
                } else {
                    trainrec_data::BadRowPolicy::Fail
                },
                num_workers: workers,
            };
            match trainrec_data::criteo_binary::convert_tsv_with(&tsv, &out_dir, &prefix, &options) {
                Ok(s) => {
                    println!(
                        "wrote {} rows ({} skipped) to {}, {}, {}",
                        s.rows,
                        s.skipped,
                        s.dense.display(),
                        s.sparse.display(),
                        s.labels.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::List => {
            print!("{}", list(&registry));
            ExitCode::SUCCESS
        }
        Command::Run { recipe, resume, overrides } => {
            run(&registry, recipe.as_deref(), resume.as_deref(), &overrides.options())
        }
        Command::Launch { nproc, recipe, overrides } => launch(nproc, &recipe, &overrides),
        Command::Validate { recipes, overrides } => validate(&registry, &recipes, &overrides.options()),
        Command::Plan { recipe, world_size, out, overrides } => {
            let mut options = overrides.options();
            if let Some(n) = world_size {
                options.overrides.push(format!("topology.world_size={n}"));
            }
            plan(&registry, &recipe, out, &options)
        }
        Command::Export { run_dir, out, step } => export(&run_dir, &out, step),
        Command::Eval { run_dir, step, quantize, json, overrides } => {
            eval(&registry, &run_dir, step, quantize, json, &overrides.options())
        }
        Command::Report { run_dir } => match crate::report::render(&run_dir) {
            Ok(files) => {
                println!("wrote {} plots to {}", files.len(), run_dir.join("plots").display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::Reference => {
            print!("{}", trainrec_engine::reference::recipe_reference(&registry));
            ExitCode::SUCCESS
        }
        Command::Bench { which: BenchCommand::Metrics(a) } => {
            let bench = trainrec_metrics::bench::MetricsBench {
                n: a.n,
                batch: a.batch,
                window: a.window,
                repeats: a.repeats,
                seed: a.seed,
            };
            print_bench(
                trainrec_metrics::bench::run(&bench)
                    .map_err(|e| format!("{e} (--n, --batch, --window and --repeats must be > 0)")),
            )
        }
        Command::Bench { which: BenchCommand::Plan(a) } => {
            let bench = trainrec_planner::bench::PlanBench {
                tables_json: a.tables_json,
                world_size: a.world_size,
                local_world_size: a.local_world_size,
                batch: a.batch,
                compute_device: match a.compute_device {
                    DeviceArg::Cpu => trainrec_planner::ComputeDevice::Cpu,
                    DeviceArg::Cuda => trainrec_planner::ComputeDevice::Cuda,
                },
                cost_model: a.cost_model.model(),
                proposer: match a.proposer {
                    ProposerArg::Default => trainrec_planner::ProposerKind::Default,
                    ProposerArg::Greedy => trainrec_planner::ProposerKind::Greedy,
                },
                threshold: a.threshold,
                repeats: a.repeats,
                explain: !a.no_explain,
                refine: !a.no_refine,
            };
            print_bench(trainrec_planner::bench::run(&bench))
        }
        Command::Bench { which: BenchCommand::Dlrm(a) } => {
            let bench = trainrec_engine::bench::DlrmBench {
                mode: match a.mode {
                    DlrmModeArg::Train => trainrec_engine::bench::DlrmMode::Train,
                    DlrmModeArg::Infer => trainrec_engine::bench::DlrmMode::Infer,
                },
                num_dense: a.num_dense,
                steps: a.steps,
                warmup: a.warmup,
                num_batches: a.num_batches,
                lr: a.lr,
                eps: a.eps,
                seed: a.seed,
                threads: a.threads,
                profile: a.profile,
                malloc_tuning: !a.no_malloc_tuning,
                cache_load_factor: a.cache_load_factor,
                key_value: a.key_value,
                offload_dir: a.offload_dir,
                prefetch: a.prefetch,
                zipf_alpha: a.zipf_alpha,
                ..a.shape.bench()
            };
            print_bench(trainrec_engine::bench::run(&bench))
        }
        Command::Bench { which: BenchCommand::Data(a) } => {
            let options = trainrec_data::BenchOptions {
                rows: a.rows,
                workers: a.workers,
                batch_size: a.batch,
                row_group_rows: a.row_group_rows,
                dir: None,
            };
            print_bench(trainrec_data::bench_readers(&options).map(|r| r.to_json()))
        }
        Command::Bench { which: BenchCommand::Ebc(args) } => match args.device {
            DeviceArg::Cpu => print_bench(trainrec_embedding::bench::run(&args.bench())),
            DeviceArg::Cuda => print_bench(trainrec_cuda::bench::run(&args.bench(), args.gpu)),
        },
        Command::DeviceCheck { device, steps } => print_bench(device_check(device, steps)),
        Command::Bench { which: BenchCommand::Dist(a) } => {
            let b = trainrec_sharding::bench::DistBench {
                tables: a.tables,
                rows: a.rows,
                dim: a.dim,
                batch: a.batch,
                ids_per_feature: a.ids_per_feature,
                sharding: match a.sharding {
                    DistShardingArg::TableWise => trainrec_planner::ShardingType::TableWise,
                    DistShardingArg::RowWise => trainrec_planner::ShardingType::RowWise,
                    DistShardingArg::ColumnWise => trainrec_planner::ShardingType::ColumnWise,
                },
                steps: a.steps,
                warmup: a.warmup,
                dedup: a.dedup,
                ..Default::default()
            };
            bench_dist(&b, a.world_size)
        }
        Command::Bench { which: BenchCommand::Pipeline(a) } => {
            let b = trainrec_engine::bench_pipeline::PipelineBench {
                dlrm: trainrec_engine::bench::DlrmBench {
                    steps: a.steps,
                    warmup: a.warmup,
                    threads: a.threads,
                    cache_load_factor: a.cache_load_factor,
                    ..a.shape.bench()
                },
                sharding: match a.sharding {
                    DistShardingArg::TableWise => "table_wise",
                    DistShardingArg::RowWise => "row_wise",
                    DistShardingArg::ColumnWise => "column_wise",
                }
                .into(),
                kinds: a
                    .kinds
                    .iter()
                    .map(|k| match k {
                        PipelineArg::Base => trainrec_recipe::PipelineKind::Base,
                        PipelineArg::SparseDist => trainrec_recipe::PipelineKind::SparseDist,
                        PipelineArg::PrefetchSparseDist => trainrec_recipe::PipelineKind::PrefetchSparseDist,
                    })
                    .collect(),
            };
            bench_pipeline(&b, a.world_size)
        }
    }
}

/// `trainrec list`: the registered plugins by kind, each with its config's first doc sentence.
pub fn list(registry: &Registry) -> String {
    let entries = registry.entries();
    let width = entries.iter().map(|e| e.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (kind, title, how) in [
        (trainrec_plugin::PluginKind::Sampler, "samplers", "[data.sampler] kind"),
        (trainrec_plugin::PluginKind::Model, "models", "[model] kind"),
        (trainrec_plugin::PluginKind::Metric, "plugin metrics", "[[metrics]] kind = \"plugin\", name"),
    ] {
        let of_kind: Vec<_> = entries.iter().filter(|e| e.kind == kind).collect();
        out.push_str(&format!("{title} ({how}):\n"));
        if of_kind.is_empty() {
            out.push_str("  (none registered)\n");
        }
        for e in of_kind {
            out.push_str(&format!("  {:width$}  {}\n", e.name, e.summary));
        }
    }
    out.push_str("\nbuilt-in metrics ([[metrics]] kind):\n");
    let metrics = builtin_metrics();
    let width = metrics.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (kind, summary) in metrics {
        out.push_str(&format!("  {kind:width$}  {summary}\n"));
    }
    out
}

/// The built-in `[[metrics]]` kinds with the first sentence of each one's doc, read from the
/// recipe schema (so the list cannot drift from what recipes accept).
fn builtin_metrics() -> Vec<(String, String)> {
    let schema = trainrec_recipe::Recipe::json_schema();
    let variants = schema.pointer("/$defs/MetricSection/oneOf").and_then(|v| v.as_array()).cloned().unwrap_or_default();
    variants
        .iter()
        .filter_map(|v| {
            let kind = v.pointer("/properties/kind/const").and_then(|k| k.as_str())?;
            (kind != "plugin").then(|| (kind.to_owned(), trainrec_plugin::schema_summary(v)))
        })
        .collect()
}

fn validate(registry: &Registry, recipes: &[PathBuf], options: &LoadOptions) -> ExitCode {
    let mut bad = 0;
    for path in recipes {
        match load_and_check(path, options, registry) {
            Ok(_) => println!("ok: {}", path.display()),
            Err(diags) => {
                bad += 1;
                eprintln!("{diags}\n");
                println!("invalid: {}", path.display());
            }
        }
    }
    if bad > 0 { ExitCode::from(2) } else { ExitCode::SUCCESS }
}

/// Prints a benchmark's JSON line, or its error (exit 2: bad flags or inputs).
/// `bench dist` on threads, or as this process's rank under `mpirun` (rank 0 prints).
fn bench_dist(b: &trainrec_sharding::bench::DistBench, world: usize) -> ExitCode {
    // As `trainrec run` does: the step's large buffers reuse mapped pages.
    trainrec_engine::tensors::tune_allocator();
    if trainrec_engine::launch::mpirun_world_size().is_some() {
        #[cfg(feature = "mpi")]
        {
            let run = || -> Result<Option<String>, trainrec_comm::DistError> {
                let pg = trainrec_comm::MpiGroup::init(std::time::Duration::from_secs(300))?;
                trainrec_sharding::bench::run_rank(b, std::sync::Arc::new(pg))
            };
            return match run() {
                Ok(Some(line)) => print_bench(Ok::<_, String>(line)),
                Ok(None) => ExitCode::SUCCESS,
                Err(e) => print_bench(Err::<String, _>(e)),
            };
        }
        #[cfg(not(feature = "mpi"))]
        return print_bench(Err::<String, _>(
            "started by mpirun, but this trainrec binary has no MPI support: build it with --features mpi",
        ));
    }
    print_bench(trainrec_sharding::bench::run_threads(b, world))
}

/// `bench pipeline` on threads, or as this process's rank under `mpirun` (rank 0 prints).
fn bench_pipeline(b: &trainrec_engine::bench_pipeline::PipelineBench, world: usize) -> ExitCode {
    if trainrec_engine::launch::mpirun_world_size().is_some() {
        #[cfg(feature = "mpi")]
        {
            let run = || -> Result<Option<String>, String> {
                let pg =
                    trainrec_comm::MpiGroup::init(std::time::Duration::from_secs(300)).map_err(|e| e.to_string())?;
                trainrec_engine::bench_pipeline::run_rank(b, std::sync::Arc::new(pg))
            };
            return match run() {
                Ok(Some(line)) => print_bench(Ok::<_, String>(line)),
                Ok(None) => ExitCode::SUCCESS,
                Err(e) => print_bench(Err::<String, _>(e)),
            };
        }
        #[cfg(not(feature = "mpi"))]
        return print_bench(Err::<String, _>(
            "started by mpirun, but this trainrec binary has no MPI support: build it with --features mpi",
        ));
    }
    print_bench(trainrec_engine::bench_pipeline::run_threads(b, world))
}

/// `trainrec device-check`: the kernels against the CPU engine on GPU `device`, then W1 there.
fn device_check(device: usize, steps: usize) -> Result<serde_json::Value, trainrec_cuda::CudaError> {
    let info = trainrec_cuda::probe(device)?;
    eprintln!(
        "GPU {device}: {} (compute capability {}.{}), NVRTC from {}",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.nvrtc.as_ref().map_or("the library path".into(), |p| p.display().to_string())
    );
    let check = trainrec_cuda::check::run_on_gpu(device)?;
    eprintln!("{:<100} {:>10} {:>10} {:>10}  bits", "case", "fwd diff", "w diff", "state diff");
    for c in check["cases"].as_array().into_iter().flatten() {
        eprintln!(
            "{:<100} {:>10.2e} {:>10.2e} {:>10.2e}  {}",
            c["case"].as_str().unwrap_or(""),
            c["forward_max_abs_diff"].as_f64().unwrap_or(f64::NAN),
            c["weights_max_abs_diff"].as_f64().unwrap_or(f64::NAN),
            c["state_max_abs_diff"].as_f64().unwrap_or(f64::NAN),
            if c["bit_identical"].as_bool() == Some(true) { "identical" } else { "DIFFER" }
        );
    }
    eprintln!("{} of {} cases bit-identical to the CPU engine", check["bit_identical"], check["total"]);
    let w1 = if steps > 0 {
        /// W1's default flags.
        #[derive(Parser)]
        struct W1 {
            #[command(flatten)]
            args: EbcArgs,
        }
        let w1 = W1::parse_from(["ebc", "--steps", &steps.to_string()]);
        let r = trainrec_cuda::bench::run(&w1.args.bench(), device)?;
        eprintln!(
            "W1 on the GPU: {:.0} samples/s (median of {steps} steps), {:.0} GB/s implied",
            r["samples_per_s"]["median"].as_f64().unwrap_or(f64::NAN),
            r["implied_GBps_at_median"].as_f64().unwrap_or(f64::NAN)
        );
        Some(r)
    } else {
        None
    };
    Ok(serde_json::json!({"device_check": check, "w1": w1}))
}

fn print_bench<T: std::fmt::Display, E: std::fmt::Display>(result: Result<T, E>) -> ExitCode {
    match result {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn plan(registry: &Registry, path: &std::path::Path, out: Option<PathBuf>, options: &LoadOptions) -> ExitCode {
    let mut loaded = match trainrec_recipe::load(path, options) {
        Ok(l) => l,
        Err(diags) => {
            eprintln!("{diags}");
            return ExitCode::from(2);
        }
    };
    // Plan afresh: a pinned plan is what this command regenerates.
    let pinned = loaded.recipe.planner.plan_file.take();
    let features = match trainrec_engine::check_loaded(&loaded, registry) {
        Ok(f) => f,
        Err(diags) => {
            eprintln!("{diags}");
            return ExitCode::from(2);
        }
    };
    let recipe = &loaded.recipe;
    let input = trainrec_engine::inputs::recipe_plan_input(recipe, &features, registry);
    let plan = match trainrec_engine::inputs::recipe_plan(&input, recipe, &loaded.base_dir, true) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{}", loaded.locate(vec![trainrec_recipe::plan::plan_diagnostic(&e)]));
            return ExitCode::from(2);
        }
    };
    print!("{}", trainrec_planner::render(&plan, &input));
    let out = out.or(pinned.map(|p| loaded.base_dir.join(p))).unwrap_or_else(|| recipe.output_dir().join("plan.json"));
    match trainrec_planner::save_plan(&plan, &out) {
        Ok(()) => {
            println!("\nwrote {}", out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot write {}: {e}", out.display());
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(
    loaded: &trainrec_recipe::LoadedRecipe,
    features: &trainrec_data::FeatureSchema,
    registry: &Registry,
    resume: Option<&std::path::Path>,
) -> Result<Option<trainrec_engine::RunSummary>, EngineError> {
    trainrec_engine::launch::run_mpi(loaded, features, registry, resume)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(
    _: &trainrec_recipe::LoadedRecipe,
    _: &trainrec_data::FeatureSchema,
    _: &Registry,
    _: Option<&std::path::Path>,
) -> Result<Option<trainrec_engine::RunSummary>, EngineError> {
    Err(EngineError::Internal(
        "started by mpirun, but this trainrec binary has no MPI support: build it with `cargo build --release -p trainrec --features mpi` (Open MPI: scripts/ensure-mpi.sh), or run without mpirun to train the ranks as threads of one process".into(),
    ))
}

/// `trainrec launch --nproc N`: `mpirun -n N <this binary> run <recipe>` with
/// `topology.world_size=N`.
fn launch(nproc: usize, recipe: &std::path::Path, overrides: &Overrides) -> ExitCode {
    if !cfg!(feature = "mpi") {
        eprintln!(
            "error: `trainrec launch` starts one process per rank through mpirun, and this binary has no MPI support: build it with `cargo build --release -p trainrec --features mpi` (Open MPI: scripts/ensure-mpi.sh); `trainrec run` trains a multi-rank recipe as threads of one process"
        );
        return ExitCode::from(2);
    }
    if nproc == 0 {
        eprintln!("error: --nproc must be at least 1");
        return ExitCode::from(2);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["--oversubscribe", "-n", &nproc.to_string()]).arg(exe).arg("run").arg(recipe);
    for s in &overrides.set {
        cmd.arg("--set").arg(s);
    }
    if overrides.no_env {
        cmd.arg("--no-env");
    }
    cmd.arg("--set").arg(format!("topology.world_size={nproc}"));
    // Open MPI refuses root without these; a container's root user is the common case.
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    match cmd.status() {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => ExitCode::from(s.code().map_or(1, |c| c.clamp(1, 255) as u8)),
        Err(e) => {
            eprintln!("error: cannot start mpirun ({e}); scripts/ensure-mpi.sh installs Open MPI");
            ExitCode::FAILURE
        }
    }
}

/// Loads and checks recipe `path`, its relative paths resolving against `base_dir` when given
/// (a run's `resolved.toml`); `None` once the problems are printed.
fn load_checked(
    path: &std::path::Path,
    options: &LoadOptions,
    base_dir: Option<PathBuf>,
    registry: &Registry,
) -> Option<(trainrec_recipe::LoadedRecipe, trainrec_data::FeatureSchema)> {
    let loaded = trainrec_recipe::load(path, options).and_then(|mut loaded| {
        if let Some(dir) = base_dir {
            loaded.base_dir = dir;
        }
        trainrec_engine::configure_threads(loaded.recipe.run.threads);
        let features = trainrec_engine::check_loaded(&loaded, registry)?;
        Ok((loaded, features))
    });
    match loaded {
        Ok(x) => Some(x),
        Err(diags) => {
            eprintln!("{diags}");
            None
        }
    }
}

/// The checkpoint of `step` (default: the newest complete one) of run `run_dir`.
fn checkpoint_dir(run_dir: &std::path::Path, step: Option<u64>) -> Result<PathBuf, String> {
    use trainrec_engine::checkpoint::{MANIFEST, latest, step_dir_name};
    let root = run_dir.join("checkpoints");
    let found = match step {
        Some(n) => Some(root.join(step_dir_name(n))).filter(|d| d.join(MANIFEST).is_file()),
        None => latest(&root).map_err(|e| e.to_string())?,
    };
    found.ok_or_else(|| {
        let which =
            step.map_or("no complete checkpoint".to_string(), |n| format!("no complete checkpoint of step {n}"));
        format!("{which} under {} (set train.checkpoint_every to save them)", root.display())
    })
}

/// `trainrec eval`.
fn eval(
    registry: &Registry,
    run_dir: &std::path::Path,
    step: Option<u64>,
    quantize: Option<QuantizeArg>,
    json: bool,
    options: &LoadOptions,
) -> ExitCode {
    use trainrec_engine::checkpoint::{Checkpoint, EVAL_KEYS, RESUMABLE_KEYS, changed_keys_outside};
    let dir = match checkpoint_dir(run_dir, step) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let ck = match Checkpoint::open(&dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut options = options.clone();
    let out = toml::Value::String(run_dir.display().to_string());
    options.overrides.insert(0, format!("run.output_dir={out}"));
    // One process evaluates, whatever the run trained on.
    options.overrides.push("topology.world_size=1".into());
    let base_dir = Some(ck.manifest.base_dir.clone());
    let Some((loaded, features)) = load_checked(&run_dir.join("resolved.toml"), &options, base_dir, registry) else {
        return ExitCode::from(2);
    };
    let allowed: Vec<&str> = RESUMABLE_KEYS.iter().chain(EVAL_KEYS).copied().collect();
    let changed = loaded
        .resolved_toml()
        .map_err(|e| e.to_string())
        .and_then(|now| changed_keys_outside(&ck.manifest.recipe, &now, &allowed));
    match changed {
        Ok(changed) if changed.is_empty() => {}
        Ok(changed) => {
            eprintln!(
                "error: eval: the recipe differs from the one checkpoint {} was trained with:\n  {}\nhelp: only the data, the metrics and the run settings may change: {}",
                dir.display(),
                changed.join("\n  "),
                allowed.join(", ")
            );
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("error: eval: {e}");
            return ExitCode::from(2);
        }
    }
    let result = (|| -> Result<std::collections::BTreeMap<String, f64>, EngineError> {
        let mut job = trainrec_engine::Job::build(&loaded, &features, registry)?;
        job.load_checkpoint(&ck)?;
        if let Some(q) = quantize {
            job.quantize(match q {
                QuantizeArg::Int8 => trainrec_embedding::quant::QuantPrecision::Int8,
                QuantizeArg::Fp16 => trainrec_embedding::quant::QuantPrecision::Fp16,
            })?;
        }
        job.evaluate()
    })();
    match result {
        Ok(m) if json => {
            let q = quantize.map(|q| format!("{q:?}").to_lowercase());
            println!("{}", serde_json::json!({ "step": ck.manifest.step, "quantize": q, "metrics": m }));
            ExitCode::SUCCESS
        }
        Ok(m) => {
            println!("{}", trainrec_metrics::render_table(&format!("eval of step {}", ck.manifest.step), &m));
            ExitCode::SUCCESS
        }
        Err(EngineError::Recipe(diags)) => {
            eprintln!("{diags}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `trainrec export`.
fn export(run_dir: &std::path::Path, out: &std::path::Path, step: Option<u64>) -> ExitCode {
    let dir = match checkpoint_dir(run_dir, step) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match trainrec_engine::export::export(&dir, out) {
        Ok(s) => {
            println!(
                "exported step {} ({} tables, {} dense tensors, {:.1} MB) to {}",
                s.step,
                s.tables.len(),
                s.dense,
                s.bytes as f64 / 1e6,
                out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The checkpoint a `--resume RUN_DIR` continues from, and the recipe to load: the given one
/// or the run's `resolved.toml` (its relative paths resolving where the original recipe's
/// did), writing into `RUN_DIR`.
fn resume_point(
    run_dir: &std::path::Path,
    recipe: Option<&std::path::Path>,
    options: &mut LoadOptions,
) -> Result<(PathBuf, trainrec_engine::checkpoint::Checkpoint, PathBuf), String> {
    use trainrec_engine::checkpoint::Checkpoint;
    let dir = checkpoint_dir(run_dir, None).map_err(|e| format!("--resume {}: {e}", run_dir.display()))?;
    let ck = Checkpoint::open(&dir).map_err(|e| e.to_string())?;
    let path = recipe.map_or_else(|| run_dir.join("resolved.toml"), std::path::Path::to_path_buf);
    let out = toml::Value::String(run_dir.display().to_string());
    options.overrides.insert(0, format!("run.output_dir={out}"));
    Ok((path, ck, dir))
}

fn run(
    registry: &Registry,
    recipe: Option<&std::path::Path>,
    resume: Option<&std::path::Path>,
    options: &LoadOptions,
) -> ExitCode {
    let mut options = options.clone();
    let (path, checkpoint) = match resume {
        Some(run_dir) => match resume_point(run_dir, recipe, &mut options) {
            Ok((path, ck, dir)) => (path, Some((ck, dir))),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
        None => (recipe.expect("clap requires a recipe without --resume").to_path_buf(), None),
    };
    // The run's resolved.toml: its relative paths are the original recipe's.
    let base_dir = match (&checkpoint, recipe) {
        (Some((ck, _)), None) => Some(ck.manifest.base_dir.clone()),
        _ => None,
    };
    let Some((loaded, features)) = load_checked(&path, &options, base_dir, registry) else {
        return ExitCode::from(2);
    };
    let resume_dir = match &checkpoint {
        Some((ck, dir)) => {
            let now = match loaded.resolved_toml() {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: cannot serialize the recipe: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match trainrec_engine::checkpoint::changed_keys(&ck.manifest.recipe, &now) {
                Ok(changed) if changed.is_empty() => {}
                Ok(changed) => {
                    eprintln!(
                        "error: --resume: the recipe differs from the one checkpoint {} was trained with:\n  {}\nhelp: a checkpoint continues the same model and data; only these keys may change: {}",
                        dir.display(),
                        changed.join("\n  "),
                        trainrec_engine::checkpoint::RESUMABLE_KEYS.join(", ")
                    );
                    return ExitCode::from(2);
                }
                Err(e) => {
                    eprintln!("error: --resume: {e}");
                    return ExitCode::from(2);
                }
            }
            eprintln!("resuming from {} (step {})", dir.display(), ck.manifest.step);
            Some(dir.clone())
        }
        None => None,
    };
    drop(checkpoint);
    let resume = resume_dir.as_deref();
    // Training allocates the same large tensors every step: keep their pages mapped.
    let tuned = trainrec_engine::tensors::tune_allocator();
    tracing::debug!(tuned, "allocator tuning");
    let result = match (loaded.recipe.topology.world_size, trainrec_engine::launch::mpirun_world_size()) {
        // Started by `mpirun`: this process is one rank (the MPI backend).
        (_, Some(_)) => run_mpi(&loaded, &features, registry, resume),
        // One rank per thread of this process (the in-process backend).
        (w, None) if w > 1 => trainrec_engine::launch::run_threads_from(&loaded, &features, registry, resume).map(Some),
        _ => trainrec_engine::launch::run_local(&loaded, &features, registry, resume).map(Some),
    };
    match result {
        // Ranks other than 0 of an MPI job report nothing.
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(summary)) => {
            println!("{}", trainrec_engine::run_dir::summary_table(&summary));
            ExitCode::SUCCESS
        }
        Err(EngineError::Recipe(diags)) => {
            eprintln!("{diags}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
