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

/// `trainrec eval`: the recipe's metrics for a run's checkpoint, on one process.
pub(crate) fn eval(
    registry: &Registry,
    run_dir: &Path,
    step: Option<u64>,
    quantize: Option<QuantPrecision>,
    json: bool,
    options: &LoadOptions,
) -> Result<(), CliError> {
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
        .map_err(|e| CliError::Usage(format!("eval: {e}")))?;
    if !changed.is_empty() {
        return Err(CliError::Usage(format!(
            "eval: the recipe differs from the one checkpoint {} was trained with:\n  {}\nhelp: only the data, the metrics and the run settings may change: {}",
            dir.display(),
            changed.join("\n  "),
            allowed.join(", ")
        )));
    }
    let metrics = (|| -> Result<BTreeMap<String, f64>, EngineError> {
        let mut job = trainrec_engine::Job::build(&loaded, &features, registry)?;
        job.load_checkpoint(&ck)?;
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

/// `trainrec export`: a run's checkpoint as one unsharded safetensors file.
pub(crate) fn export(run_dir: &Path, out: &Path, step: Option<u64>) -> Result<(), CliError> {
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
    Ok(())
}
