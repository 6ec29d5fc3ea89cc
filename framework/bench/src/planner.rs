//! `trainrec bench plan`: the planner's wall time on a table set, with the keys of
//! `bench/anchors/w3_planner.py` so the two print side by side.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::stats::median;
use trainrec_planner::{
    ComputeDevice, CostModel, PlanError, PlanInput, PlannerConfig, ProposerKind, TableSpec, Topology, explain, plan,
};

/// Settings of one benchmark run.
#[derive(Clone, Debug)]
pub struct PlanBench {
    /// A `{"tables": [{name, rows, dim, features, pooling_factor}]}` file.
    pub tables_json: PathBuf,
    /// Ranks.
    pub world_size: usize,
    /// Ranks per host (default: all on one host).
    pub local_world_size: Option<usize>,
    /// Planner batch size.
    pub batch: u64,
    /// Device.
    pub compute_device: ComputeDevice,
    /// Cost model.
    pub cost_model: CostModel,
    /// Proposers.
    pub proposer: ProposerKind,
    /// Greedy early stop.
    pub threshold: Option<u32>,
    /// Timed plan() calls.
    pub repeats: usize,
    /// Also fill the runner-up explanations (as `trainrec plan` does) inside the timing.
    pub explain: bool,
    /// Run the refinement pass.
    pub refine: bool,
}

#[derive(Deserialize)]
struct TablesFile {
    tables: Vec<TableEntry>,
}

#[derive(Deserialize)]
struct TableEntry {
    name: String,
    rows: u64,
    dim: u64,
    features: Vec<String>,
    #[serde(default)]
    pooling_factor: Option<f64>,
}

/// Loads a table set.
pub fn load_tables(path: &std::path::Path) -> Result<Vec<TableSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file: TablesFile = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(file
        .tables
        .into_iter()
        .map(|t| {
            let mut spec = TableSpec::new(t.name, t.rows, t.dim, t.features);
            // The anchor's meta-device EBC has no optimizer attached (TorchRec then counts no
            // optimizer state), and pooling factor 1 is TorchRec's default: set only if other.
            if let Some(p) = t.pooling_factor.filter(|&p| p != 1.0) {
                spec.constraints.pooling_factors = Some(vec![p; spec.features.len().max(1)]);
            }
            spec
        })
        .collect())
}

/// Runs the benchmark; returns the JSON line.
pub fn run(b: &PlanBench) -> Result<String, String> {
    let tables = load_tables(&b.tables_json)?;
    let mut topology = Topology::new(b.world_size, b.compute_device);
    if let Some(l) = b.local_world_size {
        topology.local_world_size = l;
    }
    let config = PlannerConfig {
        proposer: b.proposer,
        early_stop_threshold: b.threshold,
        cost_model: b.cost_model,
        batch_size: b.batch,
        refine: b.refine,
        ..Default::default()
    };
    let input = PlanInput { tables, topology, config };
    let mut times = Vec::with_capacity(b.repeats.max(1));
    // The search alone (what TorchRec's `plan()` does), and the runner-up explanations.
    let (mut search_times, mut explain_times) = (Vec::new(), Vec::new());
    let mut last = None;
    for _ in 0..b.repeats.max(1) {
        let t0 = Instant::now();
        let mut p = plan(&input).map_err(|e: PlanError| e.to_string())?;
        search_times.push(t0.elapsed().as_secs_f64());
        if b.explain {
            let t1 = Instant::now();
            explain(&input, &mut p).map_err(|e| e.to_string())?;
            explain_times.push(t1.elapsed().as_secs_f64());
        }
        times.push(t0.elapsed().as_secs_f64());
        last = Some(p);
    }
    let p = last.expect("at least one repeat");
    let gib = |x: u64| (x as f64 / (1u64 << 30) as f64 * 1000.0).round() / 1000.0;
    let mut kinds = BTreeMap::new();
    for t in &p.tables {
        *kinds.entry(format!("{}/{}", t.sharding_type, t.compute_kernel)).or_insert(0) += 1;
    }
    let total_bytes: u64 = input.tables.iter().map(|t| t.rows * t.dim * 4).sum();
    let (min, max) = times.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &t| (a.min(t), b.max(t)));
    let n = times.len();
    let result = json!({
        "workload": "w3_planner",
        "impl": "trainrec",
        "config": {
            "tables_json": b.tables_json.display().to_string(),
            "tables": input.tables.len(),
            "world_size": b.world_size,
            "local_world_size": input.topology.local_world_size,
            "device": b.compute_device.name(),
            "batch": b.batch,
            "cost_model": b.cost_model,
            "proposer": b.proposer,
            "threshold": b.threshold,
            "repeats": n,
            "explain": b.explain,
            "refine": b.refine,
            "threads": rayon::current_num_threads(),
        },
        "plan_wall": {"median_s": median(&times), "min_s": min, "max_s": max, "n": n},
        // plan_wall's two parts: the search (TorchRec's plan()) and the explanations.
        "search_wall": {"median_s": median(&search_times), "n": search_times.len()},
        "explain_wall": if explain_times.is_empty() { Value::Null } else { json!({"median_s": median(&explain_times), "n": explain_times.len()}) },
        "num_proposals": p.num_proposals,
        "num_plans": p.num_plans,
        "max_rank_perf_estimate": p.max_rank_perf,
        "per_rank_perf": p.ranks.iter().map(|r| r.perf).collect::<Vec<_>>(),
        "per_rank_hbm_GiB": p.ranks.iter().map(|r| gib(r.used.hbm)).collect::<Vec<_>>(),
        "per_rank_ddr_GiB": p.ranks.iter().map(|r| gib(r.used.ddr)).collect::<Vec<_>>(),
        "table_fp32_GiB_total": gib(total_bytes),
        "sharding_kinds": kinds,
        "plan_modules": 1,
    });
    Ok(result.to_string())
}
