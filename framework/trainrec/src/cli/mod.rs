//! Command-line interface: thin argument parsing over the engine, one file per command.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 invalid recipe or usage (decided by
//! [`CliError`]'s kind).

mod args;
mod convert;
mod eval;
mod launch;
mod list;
mod plan;
mod predict;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trainrec_engine::Registry;

pub use args::{CliError, Overrides};
pub use list::list;

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
    /// `mpirun -n N trainrec run <recipe> --set topology.world_size=N`. Needs the MPI backend
    /// (`./trainrec` builds it whenever Open MPI is installed).
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
        #[arg(long, value_parser = trainrec_types::cli::word::<trainrec_embedding::quant::QuantPrecision>())]
        quantize: Option<trainrec_embedding::quant::QuantPrecision>,
        /// Print the metrics as one JSON line instead of a table.
        #[arg(long)]
        json: bool,
        /// Overrides (`data.*`, `metrics`, `train.eval_batches`, ...; not the model).
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Write a run's newest checkpoint (or `--step N`'s) for serving or for PyTorch:
    /// `--format safetensors` (the default; `embedding_bags.<table>.weight` as TorchRec's EBC
    /// state dict names them, `dense.<variable>`, `managed_collisions.<table>.ids`), or
    /// `--format torchscript` (the default for an `--out` ending in `.pt`): one TorchScript
    /// file of the whole model (lookups over fp32 or `--quantize`d tables, the managed-collision
    /// remap, the dense model, the task heads) that `torch.jit.load` and libtorch run.
    Export {
        /// A run directory with checkpoints.
        run_dir: PathBuf,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
        /// Export the checkpoint of this step instead of the newest.
        #[arg(long)]
        step: Option<u64>,
        /// The file format (default: by `--out`'s extension; `.pt` is TorchScript).
        #[arg(long, value_parser = trainrec_types::cli::word::<eval::ExportFormat>())]
        format: Option<eval::ExportFormat>,
        /// Quantize the tables of a TorchScript export (int8 row-wise as FBGEMM's layout, or
        /// fp16).
        #[arg(long, value_parser = trainrec_types::cli::word::<trainrec_embedding::quant::QuantPrecision>())]
        quantize: Option<trainrec_embedding::quant::QuantPrecision>,
    },
    /// Score a data source with a run's checkpoint (`RUN_DIR`) or a TorchScript export
    /// (`model.pt`, scored through libtorch): one row per example of the split (`row`, the
    /// labels `label_<task>` when the data has them, the probability `<task>` and the logit
    /// `logit_<task>` per task), written to a Parquet, CSV or JSON-lines file (by `--out`'s
    /// extension). `--set data.sampler.<key>=...` points it at other data.
    Predict {
        /// A run directory with checkpoints, or a `.pt` file written by `trainrec export`.
        source: PathBuf,
        /// The file to write: `.parquet`, `.csv` or `.jsonl`.
        #[arg(long)]
        out: PathBuf,
        /// Which split of the data to score.
        #[arg(long, default_value = "eval", value_parser = trainrec_types::cli::word::<trainrec_types::Split>())]
        split: trainrec_types::Split,
        /// Score the checkpoint of this step instead of the newest (a run directory).
        #[arg(long)]
        step: Option<u64>,
        /// Quantize the tables first (a run directory), as `trainrec eval --quantize`.
        #[arg(long, value_parser = trainrec_types::cli::word::<trainrec_embedding::quant::QuantPrecision>())]
        quantize: Option<trainrec_embedding::quant::QuantPrecision>,
        /// Also write each example's model inputs: `dense` and `ids_<feature>` (lists).
        #[arg(long)]
        with_inputs: bool,
        /// Overrides (`data.*`: the data to score, `data.eval_batch_size`).
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Render PNG plots of every metric of a run over its steps into `RUN_DIR/plots/`.
    Report {
        /// A run directory written by `trainrec run` (holding `metrics.jsonl`).
        run_dir: PathBuf,
    },
    /// Checks the CUDA embedding kernels on a GPU: every fused optimizer over fp32, fp16 and
    /// bf16 weights against the CPU engine (bit for bit), then the embedding benchmark
    /// (`bench ebc`) on the GPU.
    /// Prints a table on stderr and one JSON line on stdout; without a GPU, an error naming
    /// what is missing.
    DeviceCheck {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Timed steps of the embedding benchmark (0 skips it).
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
    /// Benchmarks (the `trainrec-bench` crate); each prints one JSON line on stdout (logs on
    /// stderr).
    Bench {
        /// Which benchmark.
        #[command(subcommand)]
        which: trainrec_bench::BenchCommand,
    },
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
    if matches!(
        cli.command,
        Command::Run { .. } | Command::Eval { .. } | Command::Launch { .. } | Command::Predict { .. }
    ) {
        trainrec_engine::preload_torch_cuda();
    }
    if let Err(e) = registry.validate() {
        return CliError::exit(Err(CliError::Usage(e.to_string())));
    }
    let result = match cli.command {
        Command::Convert {
            which: ConvertCommand::CriteoBinary { tsv, out_dir, prefix, unlabeled, skip_bad_rows, workers },
        } => convert::criteo_binary(&tsv, &out_dir, &prefix, unlabeled, skip_bad_rows, workers),
        Command::List => {
            print!("{}", list(&registry));
            Ok(())
        }
        Command::Run { recipe, resume, overrides } => {
            run::run(&registry, recipe.as_deref(), resume.as_deref(), &overrides.options())
        }
        Command::Launch { nproc, recipe, overrides } => launch::launch(nproc, &recipe, &overrides),
        Command::Validate { recipes, overrides } => plan::validate(&registry, &recipes, &overrides.options()),
        Command::Plan { recipe, world_size, out, overrides } => {
            let mut options = overrides.options();
            if let Some(n) = world_size {
                options.overrides.push(format!("topology.world_size={n}"));
            }
            plan::plan(&registry, &recipe, out, &options)
        }
        Command::Export { run_dir, out, step, format, quantize } => {
            eval::export(&registry, &run_dir, &out, step, format, quantize, &trainrec_recipe::LoadOptions::default())
        }
        Command::Predict { source, out, split, step, quantize, with_inputs, overrides } => predict::predict(
            &registry,
            &predict::PredictArgs { source, out, split, step, quantize, with_inputs },
            &overrides.options(),
        ),
        Command::Eval { run_dir, step, quantize, json, overrides } => {
            eval::eval(&registry, &run_dir, step, quantize, json, &overrides.options())
        }
        Command::Report { run_dir } => match crate::report::render(&run_dir) {
            Ok(files) => {
                println!("wrote {} plots to {}", files.len(), run_dir.join("plots").display());
                Ok(())
            }
            Err(e) => Err(CliError::Usage(e.to_string())),
        },
        Command::Reference => {
            print!("{}", trainrec_engine::reference::recipe_reference(&registry));
            Ok(())
        }
        Command::Bench { which } => return trainrec_bench::run(which),
        Command::DeviceCheck { device, steps } => return trainrec_bench::device_check_command(device, steps),
    };
    CliError::exit(result)
}
