//! The plan's stats table and its JSON file.
use std::fmt::Write as _;
use std::path::Path;

use crate::PlanError;
use crate::planner::{Plan, PlanInput, gib};

/// The stats table: one line per rank, one per table with its runner-up.
pub fn render(plan: &Plan, input: &PlanInput) -> String {
    let t = &input.topology;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "plan for {} tables on {} rank(s) ({} per host, {}), batch {} per rank, cost model {:?}, inputs {}",
        plan.tables.len(),
        plan.world_size,
        t.local_world_size,
        t.compute_device.name(),
        input.config.batch_size,
        plan.cost_model,
        plan.inputs_hash
    );
    let _ = writeln!(
        s,
        "slowest rank: {:.4} ms per step (estimate); {} proposals, {} fit",
        plan.max_rank_perf, plan.num_proposals, plan.num_plans
    );
    let _ = writeln!(s, "\n rank   HBM used / avail (GiB)   DDR used / avail (GiB)   est. ms   shards");
    for r in &plan.ranks {
        let _ = writeln!(
            s,
            " {:>4}   {:>9.3} / {:<10.3}   {:>9.3} / {:<10.3}   {:>7.4}   {:>6}",
            r.rank,
            gib(r.used.hbm),
            gib(r.available.hbm),
            gib(r.used.ddr),
            gib(r.available.ddr),
            r.perf,
            r.shards
        );
    }
    let _ = writeln!(
        s,
        "\n table                sharding            kernel              ranks          why (vs runner-up)"
    );
    for tp in &plan.tables {
        let mut ranks: Vec<usize> = tp.shards.iter().map(|s| s.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let ranks = compact(&ranks);
        let kernel = match tp.cache_load_factor {
            Some(clf) => format!("{} ({clf:.2})", tp.compute_kernel),
            None => tp.compute_kernel.to_string(),
        };
        let why = match &tp.runner_up {
            Some(r) => match r.cache_load_factor {
                Some(clf) => format!("{}/{} ({clf:.2}): {}", r.sharding_type, r.compute_kernel, r.reason),
                None => format!("{}/{}: {}", r.sharding_type, r.compute_kernel, r.reason),
            },
            None => "-".into(),
        };
        let _ =
            writeln!(s, " {:<20} {:<19} {:<19} {:<14} {}", tp.name, tp.sharding_type.to_string(), kernel, ranks, why);
    }
    s
}

/// `0-3,5` for ranks 0, 1, 2, 3, 5.
fn compact(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j > i { format!("{}-{}", ranks[i], ranks[j]) } else { ranks[i].to_string() });
        i = j + 1;
    }
    parts.join(",")
}

/// Writes `plan.json` atomically (temporary file, then rename).
pub fn save_plan(plan: &Plan, path: &Path) -> std::io::Result<()> {
    let json = serde_json::to_string_pretty(plan).map_err(std::io::Error::other)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, json + "\n")?;
    std::fs::rename(&tmp, path)
}

/// Loads a saved plan and checks it was made for `input` (same inputs hash, same tables, every
/// row of every table placed once on an existing rank).
pub fn load_plan(path: &Path, input: &PlanInput) -> Result<Plan, PlanError> {
    let err = |message: String| PlanError::PlanFile { path: path.display().to_string(), message };
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot be read: {e}")))?;
    let plan: Plan = serde_json::from_str(&text).map_err(|e| err(format!("is not a trainrec plan: {e}")))?;
    if plan.version != 1 {
        return Err(err(format!("has plan format version {}; this trainrec reads version 1", plan.version)));
    }
    let want = input.hash();
    if plan.inputs_hash != want {
        return Err(err(format!(
            "was made for other planner inputs (hash {} here, {} in the file): the tables, their constraints, the \
             topology or the planner settings changed since. Re-plan with `trainrec plan` or drop `planner.plan_file`",
            want, plan.inputs_hash
        )));
    }
    let names: Vec<&str> = plan.tables.iter().map(|t| t.name.as_str()).collect();
    let expected: Vec<&str> = input.tables.iter().map(|t| t.name.as_str()).collect();
    if names != expected {
        return Err(err(format!("plans tables {names:?} but the recipe has {expected:?}")));
    }
    for (tp, spec) in plan.tables.iter().zip(&input.tables) {
        if let Some(s) = tp.shards.iter().find(|s| s.rank >= plan.world_size.max(input.topology.world_size)) {
            return Err(err(format!(
                "table {} has a shard on rank {} of {}",
                tp.name, s.rank, input.topology.world_size
            )));
        }
        let covered: u64 = if tp.sharding_type == crate::ShardingType::DataParallel {
            tp.shards.first().map(|s| s.size[0] * s.size[1]).unwrap_or(0)
        } else {
            tp.shards.iter().map(|s| s.size[0] * s.size[1]).sum()
        };
        if covered != spec.rows * spec.dim {
            return Err(err(format!("table {} covers {covered} of its {} weights", tp.name, spec.rows * spec.dim)));
        }
    }
    Ok(plan)
}
