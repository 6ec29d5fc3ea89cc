//! `trainrec eval` and `trainrec export`: a run's checkpoint scored or written out.

use std::collections::BTreeMap;
use std::path::Path;

use trainrec_engine::checkpoint::{Checkpoint, EVAL_KEYS, RESUMABLE_KEYS, changed_keys_outside};
use trainrec_engine::{EngineError, Registry};
use trainrec_recipe::LoadOptions;

use trainrec_embedding::quant::QuantPrecision;
use trainrec_types::Word;

use super::args::CliError;
use super::run::{checkpoint_dir, load_checked};

/// The one-process job of a run's checkpoint (`step`, default the newest), its recipe loaded
/// with `options` (only the keys an evaluation may change may differ), its trained state
/// loaded; and the run directory's shared lock, held while the caller reads. `what` names the
/// command in errors.
pub(crate) fn checkpoint_job(
    registry: &Registry,
    run_dir: &Path,
    step: Option<u64>,
    options: &LoadOptions,
    what: &str,
) -> Result<(trainrec_engine::Job, Checkpoint, trainrec_engine::run_dir::RunDirLock), CliError> {
    let lock = trainrec_engine::run_dir::lock_run_dir_shared(run_dir)?;
    let dir = checkpoint_dir(run_dir, step).map_err(CliError::Usage)?;
    let ck = Checkpoint::open(&dir).map_err(|e| CliError::Runtime(e.to_string()))?;
    let mut options = options.clone();
    let out = toml::Value::String(run_dir.display().to_string());
    options.overrides.insert(0, format!("run.output_dir={out}"));
    // One process evaluates, whatever the run trained on.
    options.overrides.push("topology.world_size=1".into());
    let base_dir = Some(ck.manifest.base_dir.clone());
    let (loaded, features) = load_checked(&run_dir.join("resolved.toml"), &options, base_dir, registry)?;
    let allowed: Vec<&str> = RESUMABLE_KEYS.iter().chain(EVAL_KEYS).copied().collect();
    let changed = loaded
        .resolved_toml()
        .map_err(|e| e.to_string())
        .and_then(|now| changed_keys_outside(&ck.manifest.recipe, &now, &allowed))
        .map_err(|e| CliError::Usage(format!("{what}: {e}")))?;
    if !changed.is_empty() {
        return Err(CliError::Usage(format!(
            "{what}: the recipe differs from the one checkpoint {} was trained with:\n  {}\nhelp: only the data, the metrics and the run settings may change: {}",
            dir.display(),
            changed.join("\n  "),
            allowed.join(", ")
        )));
    }
    let mut job = trainrec_engine::Job::build(&loaded, &features, registry)?;
    job.load_checkpoint(&ck)?;
    Ok((job, ck, lock))
}

/// `trainrec eval`: the recipe's metrics for a run's checkpoint, on one process.
pub(crate) fn eval(
    registry: &Registry,
    run_dir: &Path,
    step: Option<u64>,
    quantize: Option<QuantPrecision>,
    json: bool,
    options: &LoadOptions,
) -> Result<(), CliError> {
    let (mut job, ck, _lock) = checkpoint_job(registry, run_dir, step, options, "eval")?;
    let metrics = (|| -> Result<BTreeMap<String, f64>, EngineError> {
        if let Some(q) = quantize {
            job.quantize(q)?;
        }
        job.evaluate()
    })()?;
    if json {
        let q = quantize.map(Word::name);
        println!("{}", serde_json::json!({ "step": ck.manifest.step, "quantize": q, "metrics": metrics }));
    } else {
        println!("{}", trainrec_metrics::render_table(&format!("eval of step {}", ck.manifest.step), &metrics));
    }
    Ok(())
}

/// What `trainrec export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// One unsharded safetensors file of every table and dense tensor.
    Safetensors,
    /// One TorchScript file holding the whole model, run by PyTorch or libtorch.
    TorchScript,
}

impl Word for ExportFormat {
    const WORDS: &'static [Self] = &[Self::Safetensors, Self::TorchScript];
    fn name(self) -> &'static str {
        match self {
            Self::Safetensors => "safetensors",
            Self::TorchScript => "torchscript",
        }
    }
}

/// `trainrec export`: a run's checkpoint as one unsharded safetensors file, or as a TorchScript
/// serving file (`--format torchscript`, or an `--out` ending in `.pt`).
pub(crate) fn export(
    registry: &Registry,
    run_dir: &Path,
    out: &Path,
    step: Option<u64>,
    format: Option<ExportFormat>,
    quantize: Option<QuantPrecision>,
    options: &LoadOptions,
) -> Result<(), CliError> {
    let by_name = match out.extension().and_then(|e| e.to_str()) {
        Some("pt" | "pth" | "ts" | "torchscript") => ExportFormat::TorchScript,
        _ => ExportFormat::Safetensors,
    };
    match format.unwrap_or(by_name) {
        ExportFormat::Safetensors => {
            if let Some(q) = quantize {
                return Err(CliError::Usage(format!(
                    "export: --quantize {} applies to --format torchscript; a safetensors export holds the fp32 tables",
                    q.name()
                )));
            }
            let _lock = trainrec_engine::run_dir::lock_run_dir_shared(run_dir)?;
            let dir = checkpoint_dir(run_dir, step).map_err(CliError::Usage)?;
            let s = trainrec_engine::export::export(&dir, out).map_err(|e| CliError::Runtime(e.to_string()))?;
            println!(
                "exported step {} ({} tables, {} dense tensors, {:.1} MB) to {}",
                s.step,
                s.tables.len(),
                s.dense,
                s.bytes as f64 / 1e6,
                out.display()
            );
        }
        ExportFormat::TorchScript => {
            let (job, ck, _lock) = checkpoint_job(registry, run_dir, step, options, "export")?;
            let s = trainrec_engine::torchscript::export_torchscript(&job, quantize, ck.manifest.step, out)?;
            println!(
                "exported step {} as TorchScript ({} tables{}, {} features, tasks {}{}, {:.1} MB) to {}",
                ck.manifest.step,
                s.tables,
                quantize.map_or(String::new(), |q| format!(" in {}", q.name())),
                s.features.len(),
                s.tasks.join(", "),
                if s.corpus { ", with the candidate corpus" } else { "" },
                s.bytes as f64 / 1e6,
                out.display()
            );
        }
    }
    Ok(())
}
