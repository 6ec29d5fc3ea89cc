//! `trainrec bench pipeline`: W2's DLRM trained across ranks under each train pipeline, so
//! the step time of `sparse_dist` (batch i+1's input dist on a second thread while batch i's
//! dense part runs) can be read against `base` and the input dist time it hides.
//!
//! Every rank runs the same steps on its own batches; each figure is the slowest rank's
//! median (a step ends for all when its collectives do).

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use trainrec_comm::{ProcessGroup, ReduceOp};
use trainrec_recipe::{LoadOptions, PipelineKind};
use trainrec_sharding::StepTimes;

use crate::dlrm::{DlrmBench, TempDir, make_batches, recipe_toml};
use crate::stats::median;
use trainrec_engine::{Job, Registry};

/// The pipeline benchmark's settings.
#[derive(Clone, Debug)]
pub struct PipelineBench {
    /// The model, tables and batches (per rank) of W2; its `prefetch` is ignored (the kinds
    /// say what runs ahead) and `cache_load_factor` offloads every table.
    pub dlrm: DlrmBench,
    /// `sharding_types` of every table (`table_wise`, `row_wise`, `column_wise`).
    pub sharding: String,
    /// The pipelines timed, in this order, each on a freshly built job.
    pub kinds: Vec<PipelineKind>,
}

impl Default for PipelineBench {
    fn default() -> Self {
        Self {
            dlrm: DlrmBench { steps: 20, warmup: 3, threads: 1, ..DlrmBench::default() },
            sharding: "row_wise".into(),
            kinds: vec![PipelineKind::Base, PipelineKind::SparseDist],
        }
    }
}

fn kind_name(k: PipelineKind) -> &'static str {
    trainrec_types::Word::name(k)
}

/// The slowest rank's value of `x`.
fn slowest(pg: &dyn ProcessGroup, x: f64) -> Result<f64, String> {
    let mut v = [x];
    pg.all_reduce_f64(&mut v, ReduceOp::Max).map_err(|e| e.to_string())?;
    Ok(v[0])
}

/// Runs the benchmark as rank `pg` of its group (every rank calls it); rank 0 gets the JSON
/// line, the others `None`.
pub fn run_rank(b: &PipelineBench, pg: Arc<dyn ProcessGroup>) -> Result<Option<String>, String> {
    let d = &b.dlrm;
    if d.num_sparse == 0 || d.rows == 0 || d.dim == 0 || d.batch == 0 || d.steps == 0 || d.num_batches < 2 {
        return Err("num-sparse, rows, dim, batch and steps must be > 0, num-batches >= 2".into());
    }
    if b.kinds.is_empty() {
        return Err("give at least one pipeline kind".into());
    }
    trainrec_engine::tensors::tune_allocator();
    trainrec_engine::configure_threads((d.threads > 0).then_some(d.threads));
    let (world, me) = (pg.world_size(), pg.rank());
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos());
    let dir =
        TempDir(std::env::temp_dir().join(format!("trainrec-bench-pipeline-{}-{me}-{stamp}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| format!("cannot create {}: {e}", dir.0.display()))?;
    let path = dir.0.join("recipe.toml");
    let plain = DlrmBench { prefetch: false, ..d.clone() };
    std::fs::write(&path, recipe_toml(&plain, &dir.0.join("run"))).map_err(|e| format!("{}: {e}", path.display()))?;
    let registry = Registry::builtin();
    // Each rank's own batches.
    let mine = DlrmBench { seed: d.seed.wrapping_add(me as u64 * 7919), ..plain.clone() };
    let mut results = serde_json::Map::new();
    let mut step_ms = Vec::new();
    for &kind in &b.kinds {
        let cache = d.cache_load_factor.map_or(String::new(), |f| {
            format!(", compute_kernels = [\"fused_uvm_caching\"], cache = {{ load_factor = {f:?} }}")
        });
        let mut overrides = vec![
            format!("topology.world_size={world}"),
            format!("pipeline.kind=\"{}\"", kind_name(kind)),
            format!("run.output_dir=\"{}\"", dir.0.join(format!("run-{}", kind_name(kind))).display()),
        ];
        for i in 0..d.num_sparse {
            overrides.push(format!("tables[{i}].constraints={{ sharding_types = [\"{}\"]{cache} }}", b.sharding));
        }
        let options = LoadOptions { overrides, env: false };
        let (loaded, features) =
            trainrec_engine::load_and_check(&path, &options, &registry).map_err(|e| format!("bench recipe: {e}"))?;
        let batches = make_batches(&mine, &features)?;
        let mut job = Job::build_rank(&loaded, &features, &registry, Some(pg.clone())).map_err(|e| e.to_string())?;
        let ahead = kind != PipelineKind::Base;
        let mut k = 0usize;
        let mut step = |job: &mut Job| -> Result<(f64, StepTimes), String> {
            let batch = &batches[k % batches.len()];
            k += 1;
            let next = ahead.then(|| &batches[k % batches.len()]);
            let t = Instant::now();
            job.train_step_ahead(batch, next).map_err(|e| e.to_string())?;
            Ok((t.elapsed().as_secs_f64(), job.last_step_times().unwrap_or_default()))
        };
        for _ in 0..d.warmup {
            step(&mut job)?;
        }
        pg.barrier().map_err(|e| e.to_string())?;
        let (mut wall, mut input, mut output, mut grad) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..d.steps {
            let (s, t) = step(&mut job)?;
            wall.push(s);
            input.push(t.input_dist);
            output.push(t.output_dist);
            grad.push(t.grad_dist);
        }
        // Milliseconds to the microsecond.
        let ms = |v: &[f64]| -> Result<f64, String> { Ok((slowest(pg.as_ref(), median(v))? * 1e6).round() / 1e3) };
        let step_median = ms(&wall)?;
        step_ms.push(step_median);
        let global_batch = (d.batch * world) as f64;
        results.insert(
            kind_name(kind).into(),
            json!({
                "step_ms": {"median": step_median, "min": (wall.iter().copied().fold(f64::INFINITY, f64::min) * 1e6).round() / 1e3},
                "samples_per_s": {"median": (global_batch / (step_median / 1e3)).round()},
                "input_dist_ms": ms(&input)?,
                "output_dist_ms": ms(&output)?,
                "grad_dist_ms": ms(&grad)?,
            }),
        );
        drop(job);
    }
    if me != 0 {
        return Ok(None);
    }
    let mut out = json!({
        "bench": "pipeline",
        "backend": pg.backend(),
        "world_size": world,
        "config": {
            "sharding": b.sharding, "num_sparse": d.num_sparse, "rows": d.rows, "dim": d.dim,
            "batch_per_rank": d.batch, "ids_per_feature": d.ids_per_feature, "dense_arch": d.dense_arch,
            "over_arch": d.over_arch, "steps": d.steps, "warmup": d.warmup, "threads": d.threads,
            "cache_load_factor": d.cache_load_factor,
        },
        "kinds": Value::Object(results.clone()),
    });
    // What the overlap bought against `base`, and the input dist it could hide.
    if let (Some(base), Some(sd)) = (results.get("base"), results.get("sparse_dist")) {
        let f = |v: &Value, k: &str| v[k]["median"].as_f64().or_else(|| v[k].as_f64()).unwrap_or(f64::NAN);
        out["sparse_dist_vs_base"] = json!({
            "step_ms_saved": ((f(base, "step_ms") - f(sd, "step_ms")) * 1e3).round() / 1e3,
            "base_input_dist_ms": f(base, "input_dist_ms"),
            "step_ratio": (f(sd, "step_ms") / f(base, "step_ms") * 1e3).round() / 1e3,
        });
    }
    Ok(Some(out.to_string()))
}

/// [`run_rank`] on `world` ranks of the thread backend (one process).
pub fn run_threads(b: &PipelineBench, world: usize) -> Result<String, String> {
    let out = trainrec_comm::ThreadGroup::run(world.max(1), trainrec_engine::runtime::COLLECTIVE_TIMEOUT, |pg| {
        run_rank(b, Arc::new(pg))
    });
    let mut line = None;
    for (rank, r) in out.into_iter().enumerate() {
        match r {
            Ok(Ok(Some(l))) => line = Some(l),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Err(format!("rank {rank}: {e}")),
            Err(panic) => return Err(format!("rank {rank} panicked: {panic}")),
        }
    }
    line.ok_or_else(|| "rank 0 printed nothing".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_pipeline_bench_times_every_kind_on_two_ranks() {
        let b = PipelineBench {
            dlrm: DlrmBench { cache_load_factor: Some(0.9), ..DlrmBench::tiny() },
            kinds: vec![PipelineKind::Base, PipelineKind::SparseDist, PipelineKind::PrefetchSparseDist],
            ..PipelineBench::default()
        };
        let line = run_threads(&b, 2).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["world_size"], 2, "{line}");
        for k in ["base", "sparse_dist", "prefetch_sparse_dist"] {
            assert!(v["kinds"][k]["step_ms"]["median"].as_f64().unwrap() > 0.0, "{line}");
            assert!(v["kinds"][k]["input_dist_ms"].as_f64().unwrap() > 0.0, "{line}");
        }
        assert!(v["sparse_dist_vs_base"]["step_ratio"].as_f64().unwrap() > 0.0, "{line}");
    }
}
