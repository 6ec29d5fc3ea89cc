//! `trainrec run` (with `--resume`), and what `run`, `eval` and `export` share: loading and
//! checking a recipe, and finding a run's checkpoint.

use std::path::{Path, PathBuf};

use trainrec_data::FeatureSchema;
use trainrec_engine::checkpoint::Checkpoint;
use trainrec_engine::{EngineError, Registry, RunSummary};
use trainrec_recipe::{LoadOptions, LoadedRecipe};

use super::args::CliError;

/// Loads and checks recipe `path`, its relative paths resolving against `base_dir` when given
/// (a run's `resolved.toml`).
pub(crate) fn load_checked(
    path: &Path,
    options: &LoadOptions,
    base_dir: Option<PathBuf>,
    registry: &Registry,
) -> Result<(LoadedRecipe, FeatureSchema), CliError> {
    let mut loaded = trainrec_recipe::load(path, options)?;
    if let Some(dir) = base_dir {
        loaded.base_dir = dir;
    }
    trainrec_engine::configure_threads(loaded.recipe.run.threads);
    let features = trainrec_engine::check_loaded(&loaded, registry)?;
    Ok((loaded, features))
}

/// The checkpoint of `step` (default: the newest complete one) of run `run_dir`.
pub(crate) fn checkpoint_dir(run_dir: &Path, step: Option<u64>) -> Result<PathBuf, String> {
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

/// The checkpoint a `--resume RUN_DIR` continues from, and the recipe to load: the given one
/// or the run's `resolved.toml` (its relative paths resolving where the original recipe's
/// did), writing into `RUN_DIR`.
fn resume_point(
    run_dir: &Path,
    recipe: Option<&Path>,
    options: &mut LoadOptions,
) -> Result<(PathBuf, Checkpoint, PathBuf), CliError> {
    let dir =
        checkpoint_dir(run_dir, None).map_err(|e| CliError::Usage(format!("--resume {}: {e}", run_dir.display())))?;
    let ck = Checkpoint::open(&dir).map_err(|e| CliError::Usage(e.to_string()))?;
    let path = recipe.map_or_else(|| run_dir.join("resolved.toml"), Path::to_path_buf);
    let out = toml::Value::String(run_dir.display().to_string());
    options.overrides.insert(0, format!("run.output_dir={out}"));
    Ok((path, ck, dir))
}

#[cfg(feature = "mpi")]
fn run_mpi(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    resume: Option<&Path>,
) -> Result<Option<RunSummary>, EngineError> {
    trainrec_engine::launch::run_mpi(loaded, features, registry, resume)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(
    _: &LoadedRecipe,
    _: &FeatureSchema,
    _: &Registry,
    _: Option<&Path>,
) -> Result<Option<RunSummary>, EngineError> {
    Err(EngineError::Internal(
        "started by mpirun, but this trainrec binary has no MPI support: build it with `cargo build --release -p trainrec --features mpi` (Open MPI: scripts/ensure-mpi.sh), or run without mpirun to train the ranks as threads of one process".into(),
    ))
}

/// `trainrec run`: trains the recipe (from a run's newest checkpoint with `--resume`) on one
/// rank, on thread ranks, or as this process's rank under `mpirun`.
pub(crate) fn run(
    registry: &Registry,
    recipe: Option<&Path>,
    resume: Option<&Path>,
    options: &LoadOptions,
) -> Result<(), CliError> {
    let mut options = options.clone();
    let (path, checkpoint) = match resume {
        Some(run_dir) => {
            let (path, ck, dir) = resume_point(run_dir, recipe, &mut options)?;
            (path, Some((ck, dir)))
        }
        None => (recipe.expect("clap requires a recipe without --resume").to_path_buf(), None),
    };
    // The run's resolved.toml: its relative paths are the original recipe's.
    let base_dir = match (&checkpoint, recipe) {
        (Some((ck, _)), None) => Some(ck.manifest.base_dir.clone()),
        _ => None,
    };
    let (loaded, features) = load_checked(&path, &options, base_dir, registry)?;
    let resume_dir = match &checkpoint {
        Some((ck, dir)) => {
            let now =
                loaded.resolved_toml().map_err(|e| CliError::Runtime(format!("cannot serialize the recipe: {e}")))?;
            let changed = trainrec_engine::checkpoint::changed_keys(&ck.manifest.recipe, &now)
                .map_err(|e| CliError::Usage(format!("--resume: {e}")))?;
            if !changed.is_empty() {
                return Err(CliError::Usage(format!(
                    "--resume: the recipe differs from the one checkpoint {} was trained with:\n  {}\nhelp: a checkpoint continues the same model and data; only these keys may change: {}",
                    dir.display(),
                    changed.join("\n  "),
                    trainrec_engine::checkpoint::RESUMABLE_KEYS.join(", ")
                )));
            }
            eprintln!("resuming from {} (step {})", dir.display(), ck.manifest.step);
            Some(dir.clone())
        }
        None => None,
    };
    drop(checkpoint);
    let resume = resume_dir.as_deref();
    // SIGINT / SIGTERM: finish the step, save a checkpoint and exit 130 / 143 (a second: at once).
    trainrec_engine::runtime::install_stop_handlers();
    // Training allocates the same large tensors every step: keep their pages mapped.
    let tuned = trainrec_engine::tensors::tune_allocator();
    tracing::debug!(tuned, "allocator tuning");
    let summary = match (loaded.recipe.topology.world_size, trainrec_engine::launch::mpirun_world_size()) {
        // Started by `mpirun`: this process is one rank (the MPI backend).
        (_, Some(_)) => run_mpi(&loaded, &features, registry, resume)?,
        // One rank per thread of this process (the in-process backend).
        (w, None) if w > 1 => Some(trainrec_engine::launch::run_threads_from(&loaded, &features, registry, resume)?),
        _ => Some(trainrec_engine::launch::run_local(&loaded, &features, registry, resume)?),
    };
    // Ranks other than 0 of an MPI job report nothing.
    if let Some(summary) = summary {
        println!("{}", trainrec_engine::run_dir::summary_table(&summary));
    }
    Ok(())
}
