//! Why each table's option won: its runner-up, the best alternative with the rest of the plan
//! unchanged.
use rayon::prelude::*;

use crate::PlanError;
use crate::enumerate::enumerate;
use crate::partition::{beyond, partition, rate, rating_lower_bound};
use crate::planner::{Plan, PlanInput, RunnerUp, human, reserve};
use crate::types::{ShardingOption, Storage};

/// Fills each table's runner-up: the alternative option whose plan (same other tables,
/// re-partitioned) has the fastest slowest rank, and why the chosen one won.
pub fn explain(input: &PlanInput, plan: &mut Plan) -> Result<(), PlanError> {
    let c = &input.config;
    let caps = reserve(input)?;
    let space = enumerate(&input.tables, &input.topology, c.batch_size, c.cost_model)?;
    // The plan's own options (shards in plan order; placement is redone by the partitioner).
    let base: Vec<ShardingOption> = plan
        .tables
        .iter()
        .enumerate()
        .map(|(t, tp)| ShardingOption {
            table: t,
            sharding_type: tp.sharding_type,
            compute_kernel: tp.compute_kernel,
            cache_load_factor: tp.cache_load_factor,
            shards: tp
                .shards
                .iter()
                .map(|s| crate::types::Shard { size: s.size, offset: s.offset, perf: s.perf, storage: s.storage })
                .collect(),
        })
        .collect();
    // What decides most alternatives without placing them: the plan's memory and time summed
    // over its tables, and its two slowest shards' times (the slowest apart from any one table).
    let capacity: Storage = caps.iter().sum();
    let base_total: Storage = base.iter().map(ShardingOption::total_storage).sum();
    let base_sum: f64 = base.iter().map(ShardingOption::sum_shard_perf).sum();
    let (mut top, mut second) = ((f64::NEG_INFINITY, usize::MAX), f64::NEG_INFINITY);
    for (t, o) in base.iter().enumerate() {
        let m = o.max_shard_perf();
        if m > top.0 {
            second = top.0;
            top = (m, t);
        } else if m > second {
            second = m;
        }
    }
    let runner_ups: Vec<Option<RunnerUp>> = (0..space.len())
        .into_par_iter()
        .map(|t| {
            let others_total = base_total.minus(&base[t].total_storage());
            let others_sum = base_sum - base[t].sum_shard_perf();
            let others_max = if top.1 == t { second } else { top.0 };
            let mut best: Option<(f64, usize)> = None;
            let mut any = None;
            let same = |a: &ShardingOption, b: &ShardingOption| {
                a.compute_kernel == b.compute_kernel
                    && a.shards.len() == b.shards.len()
                    && a.shards.iter().zip(&b.shards).all(|(x, y)| x == y)
            };
            // Skip the chosen option and its twins (e.g. column-wise in one block is
            // table-wise). The rest are tried by a lower bound of their plan's slowest rank
            // (perfect spread, or the slowest shard), most promising first, so the others are
            // mostly turned down by that bound without a placement; on equal times the option
            // first in the search space wins, as when they were tried in its order.
            let mut alts: Vec<(f64, usize)> = Vec::with_capacity(space[t].len());
            for (i, alt) in space[t].iter().enumerate() {
                if same(alt, &base[t]) {
                    continue;
                }
                any.get_or_insert(i);
                // More memory than the ranks have in all: the partitioner would fail.
                if !others_total.plus(&alt.total_storage()).fits_in(&capacity) {
                    continue;
                }
                let lower = rating_lower_bound(
                    others_sum + alt.sum_shard_perf(),
                    others_max.max(alt.max_shard_perf()),
                    input.topology.world_size,
                );
                alts.push((lower, i));
            }
            alts.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for (lower, i) in alts {
                // Slower than the best so far however placed: neither the runner-up nor
                // needed (the partitioner would stop early).
                if best.is_some_and(|b| beyond(lower, b.0)) {
                    break;
                }
                let alt = &space[t][i];
                let opts: Vec<&ShardingOption> =
                    (0..space.len()).map(|u| if u == t { alt } else { &base[u] }).collect();
                if let Ok(a) = partition(c.partitioner, &opts, &caps, &input.topology, best.map(|b| b.0)) {
                    let r = rate(&opts, &a, input.topology.world_size);
                    if best.is_none_or(|b| r < b.0 || (r == b.0 && i < b.1)) {
                        best = Some((r, i));
                    }
                }
            }
            let best = best.map(|(r, i)| (r, &space[t][i]));
            let any = any.map(|i| &space[t][i]);
            let chosen_o = &base[t];
            match (best, any) {
                (Some((r, alt)), _) => {
                    let pct = if plan.max_rank_perf > 0.0 { (r / plan.max_rank_perf - 1.0) * 100.0 } else { 0.0 };
                    let (m0, m1) = (chosen_o.total_storage(), alt.total_storage());
                    let own = format!(
                        "its shards {:.4} vs {:.4} ms, {} vs {}",
                        chosen_o.max_shard_perf(),
                        alt.max_shard_perf(),
                        human(m0.hbm + m0.ddr),
                        human(m1.hbm + m1.ddr)
                    );
                    let reason = if r > plan.max_rank_perf {
                        format!("slowest rank {:.4} vs {r:.4} ms (+{pct:.1}%); {own}", plan.max_rank_perf)
                    } else {
                        format!("same slowest rank ({r:.4} ms), found first; {own}")
                    };
                    Some(RunnerUp {
                        sharding_type: alt.sharding_type,
                        compute_kernel: alt.compute_kernel,
                        cache_load_factor: alt.cache_load_factor,
                        max_rank_perf: Some(r),
                        reason,
                    })
                }
                (None, Some(alt)) => Some(RunnerUp {
                    sharding_type: alt.sharding_type,
                    compute_kernel: alt.compute_kernel,
                    cache_load_factor: alt.cache_load_factor,
                    max_rank_perf: None,
                    reason: "the only option that fits beside the other tables".into(),
                }),
                (None, None) => None,
            }
        })
        .collect();
    for (tp, ru) in plan.tables.iter_mut().zip(runner_ups) {
        tp.runner_up = ru;
    }
    Ok(())
}
