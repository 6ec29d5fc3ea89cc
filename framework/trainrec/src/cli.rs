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
        Command::Bench { which } => trainrec_bench::run(which),
        Command::DeviceCheck { device, steps } => trainrec_bench::device_check_command(device, steps),
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
