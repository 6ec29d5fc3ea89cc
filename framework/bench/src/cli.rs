//! The benchmarks' command line: `trainrec bench <which>` (and `trainrec device-check`) parse
//! into these flags and run here; each prints one JSON line on stdout (logs on stderr).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trainrec_embedding::SparseOptimizerConfig;
use trainrec_planner::{ComputeDevice, CostModel, ProposerKind, ShardingType};
use trainrec_recipe::PipelineKind;
use trainrec_types::cli::word;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// DLRM train step or inference through the engine (the flags and defaults of the
    /// TorchRec script it is compared with).
    Dlrm(DlrmArgs),
    /// Reader throughput: rows/s of the `criteo_tsv`, `criteo_binary` and `parquet` samplers
    /// at each worker count, on generated data.
    Data(DataArgs),
    /// Pooled embedding bag train step (forward + fused backward/update), the flags of the
    /// FBGEMM script it is compared with.
    Ebc(EbcArgs),
    /// Unpooled (sequence) embedding train step: the `ebc` benchmark's tables and ids looked
    /// up one row per id (TorchRec's `EmbeddingCollection`), forward + fused backward/update
    /// (the workload of `scripts/anchors/w1_ec_train.py`). CPU only; no `--mc-interval` or
    /// `--quant`.
    Ec(EbcArgs),
    /// NE and AUC update + compute over `--n` predictions.
    Metrics(MetricsArgs),
    /// Sharding planner wall time and plan quality on a table set (the flags and JSON keys of
    /// the TorchRec planner script it is compared with).
    Plan(PlanArgs),
    /// Sharded embeddings across ranks: input dist, lookup, output dist, gradient dist and
    /// update time per step for the DLRM benchmark's tables, next to the raw all-to-all of the same bytes. Ranks
    /// are threads of this process, or MPI processes under `mpirun` (built with `--features mpi`).
    Dist(DistArgs),
    /// The DLRM benchmark's model trained across ranks under each train pipeline (`base`, `sparse_dist`,
    /// `prefetch_sparse_dist`): per-step time, and the input dist time `sparse_dist` hides
    /// behind the dense part. Ranks are threads of this process, or MPI processes under
    /// `mpirun` (built with `--features mpi`).
    Pipeline(PipelineArgs),
}

/// Flags of `trainrec bench pipeline`.
#[derive(Debug, clap::Args)]
pub struct PipelineArgs {
    /// Ranks (threads of this process; under `mpirun`, its `-n` instead).
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// The pipelines timed, in order, each on a freshly built job.
    #[arg(long, value_parser = word::<PipelineKind>(), value_delimiter = ',', default_value = "base,sparse_dist")]
    pub kinds: Vec<PipelineKind>,
    /// How every table is sharded (its `sharding_types`).
    #[arg(long, value_parser = word::<ShardingType>(), default_value = "row_wise")]
    pub sharding: ShardingType,
    /// The model, tables and batch (`--batch`: examples per rank).
    #[command(flatten)]
    pub shape: DlrmShape,
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

/// Flags of `trainrec bench dist`.
#[derive(Debug, clap::Args)]
pub struct DistArgs {
    /// Ranks (threads of this process; under `mpirun`, its `-n` instead).
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// How every table is sharded: `table_wise` (round robin over the ranks), `row_wise` or
    /// `column_wise` (blocks over every rank).
    #[arg(long, value_parser = word::<ShardingType>(), default_value = "table_wise")]
    pub sharding: ShardingType,
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

/// Flags of `trainrec bench plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Table set: a JSON list of tables (name, rows, dim, pooling factor).
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
    #[arg(long, value_parser = word::<ComputeDevice>(), default_value = "cuda")]
    pub compute_device: ComputeDevice,
    /// Estimator formulas: trainrec's engines, or TorchRec's default estimators and search
    /// space.
    #[arg(long, value_parser = word::<CostModel>(), default_value = "trainrec")]
    pub cost_model: CostModel,
    /// Proposers (`planner.proposer`).
    #[arg(long, value_parser = word::<ProposerKind>(), default_value = "default")]
    pub proposer: ProposerKind,
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

/// The DLRM benchmark's model, tables and batch: the flags `bench dlrm` and `bench pipeline`
/// share (those of the TorchRec script, same defaults).
#[derive(Debug, clap::Args)]
pub struct DlrmShape {
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

impl DlrmShape {
    /// These flags' fields of the benchmark; the rest are `DlrmBench`'s defaults.
    fn bench(self) -> crate::dlrm::DlrmBench {
        crate::dlrm::DlrmBench {
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

/// Flags of `trainrec bench dlrm` (those of the TorchRec script, same defaults).
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
    pub shape: DlrmShape,
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
    /// Inference mode: look up quantized tables (int8 row-wise, FBGEMM's layout, or fp16), as
    /// `trainrec eval --quantize` does.
    #[arg(long, value_parser = trainrec_types::cli::word::<trainrec_embedding::quant::QuantPrecision>())]
    pub quantize: Option<trainrec_embedding::quant::QuantPrecision>,
    /// The precision of the dense model's matrix products (the recipe's
    /// `train.dense_precision`): `fp32`, or `bf16` (mixed precision as `torch.autocast` runs
    /// it, fp32 master weights).
    #[arg(long, default_value = "fp32", value_parser = trainrec_types::cli::word::<trainrec_types::DensePrecision>())]
    pub dense_precision: trainrec_types::DensePrecision,
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
    /// Shuffles each pass goes through, as `data.shuffle` (comma separated): `none`, `full`,
    /// `buffer:<rows>`.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    pub shuffle: Vec<trainrec_data::Shuffle>,
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
    /// Predictions and labels to time instead of generated ones: raw little-endian `f32`, the
    /// `n` predictions then the `n` labels (`scripts/anchors/w4_metrics.py --dump` writes
    /// TorchRec's inputs so); `--n` is then the file's.
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
}

/// Id distribution of `bench ebc`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DistArg {
    /// Uniform over the rows.
    Uniform,
    /// Bounded Zipf(`--alpha`) over ranks, mapped to rows by a random permutation per table.
    Zipf,
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
    /// (`optimizer.sparse.kind`: `sgd`, `adagrad`, `rowwise_adagrad`, `adam`,
    /// `partial_rowwise_adam`, `lamb`; other hyperparameters at their defaults.)
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(SparseOptimizerConfig::KINDS), default_value = "rowwise_adagrad")]
    pub optimizer: String,
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
    #[arg(long, value_parser = word::<ComputeDevice>(), default_value = "cpu")]
    pub device: ComputeDevice,
    /// GPU ordinal with `--device cuda`.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
}

impl EbcArgs {
    fn bench(&self) -> crate::embedding::EbcBench {
        let mut optimizer = SparseOptimizerConfig::with_defaults(&self.optimizer, self.lr)
            .expect("clap accepts only the optimizers' kinds");
        // `--eps` for the optimizers that have one.
        match &mut optimizer {
            SparseOptimizerConfig::Sgd { .. } => {}
            SparseOptimizerConfig::Adagrad { eps, .. }
            | SparseOptimizerConfig::RowwiseAdagrad { eps, .. }
            | SparseOptimizerConfig::Adam { eps, .. }
            | SparseOptimizerConfig::PartialRowwiseAdam { eps, .. }
            | SparseOptimizerConfig::Lamb { eps, .. } => *eps = self.eps,
        }
        crate::embedding::EbcBench {
            tables: self.tables,
            rows: self.rows,
            dim: self.dim,
            pooling: self.pooling,
            batch: self.batch,
            dist: match self.dist {
                DistArg::Uniform => crate::embedding::IdDist::Uniform,
                DistArg::Zipf => crate::embedding::IdDist::Zipf(self.alpha),
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

/// `bench dist` on threads, or as this process's rank under `mpirun` (rank 0 prints).
fn bench_dist(b: &crate::sharding::DistBench, world: usize) -> ExitCode {
    // As `trainrec run` does: the step's large buffers reuse mapped pages.
    trainrec_engine::tensors::tune_allocator();
    on_ranks(b, world, crate::sharding::run_rank, crate::sharding::run_threads)
}

/// `bench pipeline` on threads, or as this process's rank under `mpirun` (rank 0 prints).
fn bench_pipeline(b: &crate::pipeline::PipelineBench, world: usize) -> ExitCode {
    on_ranks(b, world, crate::pipeline::run_rank, crate::pipeline::run_threads)
}

/// One rank's part of a benchmark across ranks: the JSON line on rank 0, nothing elsewhere.
type RankRun<B, E> = fn(&B, std::sync::Arc<dyn trainrec_comm::ProcessGroup>) -> Result<Option<String>, E>;

/// A benchmark across ranks: as this process's rank under `mpirun` (`rank`, rank 0 prints),
/// else on `world` thread ranks (`threads`).
fn on_ranks<B, E: std::fmt::Display>(
    b: &B,
    world: usize,
    rank: RankRun<B, E>,
    threads: fn(&B, usize) -> Result<String, E>,
) -> ExitCode {
    if trainrec_engine::launch::mpirun_world_size().is_none() {
        return print_bench(threads(b, world));
    }
    #[cfg(feature = "mpi")]
    {
        let pg = match trainrec_comm::MpiGroup::init(std::time::Duration::from_secs(300)) {
            Ok(pg) => pg,
            Err(e) => return print_bench(Err::<String, _>(e)),
        };
        match rank(b, std::sync::Arc::new(pg)) {
            Ok(Some(line)) => print_bench(Ok::<_, String>(line)),
            Ok(None) => ExitCode::SUCCESS,
            Err(e) => print_bench(Err::<String, _>(e)),
        }
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = rank;
        print_bench(Err::<String, _>(
            "started by mpirun, but this trainrec binary has no MPI support: build it with --features mpi",
        ))
    }
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
        let r = crate::cuda::run(&w1.args.bench(), device)?;
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

/// Prints a benchmark's JSON line, or its error (exit 2: bad flags or inputs).
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

/// Runs benchmark `which`: its JSON line on stdout, exit 2 (bad flags or inputs) on error.
pub fn run(which: BenchCommand) -> ExitCode {
    match which {
        BenchCommand::Metrics(a) => {
            let data = match a.data.as_deref().map(crate::metrics::read_data).transpose() {
                Ok(data) => data,
                Err(e) => return print_bench::<String, String>(Err(e)),
            };
            let bench = crate::metrics::MetricsBench {
                n: data.as_ref().map_or(a.n, |(p, _)| p.len()),
                batch: a.batch,
                window: a.window,
                repeats: a.repeats,
                seed: a.seed,
            };
            print_bench(
                crate::metrics::run(&bench, data)
                    .map_err(|e| format!("{e} (--n, --batch, --window and --repeats must be > 0)")),
            )
        }
        BenchCommand::Plan(a) => {
            let bench = crate::planner::PlanBench {
                tables_json: a.tables_json,
                world_size: a.world_size,
                local_world_size: a.local_world_size,
                batch: a.batch,
                compute_device: a.compute_device,
                cost_model: a.cost_model,
                proposer: a.proposer,
                threshold: a.threshold,
                repeats: a.repeats,
                explain: !a.no_explain,
                refine: !a.no_refine,
            };
            print_bench(crate::planner::run(&bench))
        }
        BenchCommand::Dlrm(a) => {
            let bench = crate::dlrm::DlrmBench {
                mode: match a.mode {
                    DlrmModeArg::Train => crate::dlrm::DlrmMode::Train,
                    DlrmModeArg::Infer => crate::dlrm::DlrmMode::Infer,
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
                quantize: a.quantize,
                dense_precision: a.dense_precision,
                ..a.shape.bench()
            };
            print_bench(crate::dlrm::run(&bench))
        }
        BenchCommand::Data(a) => {
            let options = crate::data::BenchOptions {
                rows: a.rows,
                workers: a.workers,
                batch_size: a.batch,
                row_group_rows: a.row_group_rows,
                shuffles: a.shuffle,
                dir: None,
            };
            print_bench(crate::data::bench_readers(&options).map(|r| r.to_json()))
        }
        BenchCommand::Ec(args) => match args.device {
            ComputeDevice::Cpu => print_bench(crate::embedding::run_ec(&args.bench())),
            ComputeDevice::Cuda => print_bench::<String, String>(Err(
                "bench ec: the embedding collection has no CUDA path yet (sequence tables train on CPU ranks)".into(),
            )),
        },
        BenchCommand::Ebc(args) => match args.device {
            ComputeDevice::Cpu => print_bench(crate::embedding::run(&args.bench())),
            ComputeDevice::Cuda => print_bench(crate::cuda::run(&args.bench(), args.gpu)),
        },
        BenchCommand::Dist(a) => {
            let b = crate::sharding::DistBench {
                tables: a.tables,
                rows: a.rows,
                dim: a.dim,
                batch: a.batch,
                ids_per_feature: a.ids_per_feature,
                sharding: a.sharding,
                steps: a.steps,
                warmup: a.warmup,
                dedup: a.dedup,
                ..Default::default()
            };
            bench_dist(&b, a.world_size)
        }
        BenchCommand::Pipeline(a) => {
            let b = crate::pipeline::PipelineBench {
                dlrm: crate::dlrm::DlrmBench {
                    steps: a.steps,
                    warmup: a.warmup,
                    threads: a.threads,
                    cache_load_factor: a.cache_load_factor,
                    ..a.shape.bench()
                },
                sharding: a.sharding.name().into(),
                kinds: a.kinds,
            };
            bench_pipeline(&b, a.world_size)
        }
    }
}

/// `trainrec device-check`: the CUDA kernels against the CPU engine on a GPU, then the
/// embedding step timed there.
pub fn device_check_command(device: usize, steps: usize) -> ExitCode {
    print_bench(device_check(device, steps))
}
