//! Why each table's option won: its runner-up, the best alternative with the rest of the plan
//! unchanged.
use rayon::prelude::*;

use crate::PlanError;
use crate::enumerate::enumerate;
use crate::partition::{GreedyTrace, PartitionerKind, beyond, partition, rate, rating_lower_bound};
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
    // The greedy partitioner's run over the plan's own options, kept step by step: each
    // alternative is placed again only from where its placement order departs.
    let trace = match c.partitioner {
        PartitionerKind::GreedyPerf => {
            let refs: Vec<&ShardingOption> = base.iter().collect();
            GreedyTrace::new(&refs, &caps, &input.topology).ok()
        }
        PartitionerKind::MemoryBalanced => None,
    };
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
                let bound = best.map(|b| b.0);
                let placed = match trace.as_ref().and_then(|tr| tr.replaced(&opts, t, &input.topology, bound)) {
                    Some(placed) => placed,
                    None => partition(c.partitioner, &opts, &caps, &input.topology, bound),
                };
                if let Ok(a) = placed {
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

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use crate::enumerate::enumerate;
    use crate::partition::{GreedyTrace, PartitionerKind, partition};
    use crate::planner::reserve;
    use crate::types::*;
    use crate::*;

    /// Every alternative of every table placed from the trace equals the full greedy run, with
    /// and without a bound (random tables, topologies and base options, seeded).
    #[test]
    fn a_traced_replacement_places_as_the_full_partitioner() {
        let mut rng = StdRng::seed_from_u64(5);
        let (mut compared, mut resumed_late) = (0, 0);
        for _ in 0..40 {
            let device = if rng.random_bool(0.6) { ComputeDevice::Cuda } else { ComputeDevice::Cpu };
            let per_host = [1usize, 2, 4][rng.random_range(0..3)];
            let mut topology = Topology::new(rng.random_range(1..=3usize) * per_host, device);
            topology.local_world_size = per_host;
            topology.hbm_cap = rng.random_range(1u64..=8) << 30;
            topology.ddr_cap = rng.random_range(8u64..=64) << 30;
            let tables: Vec<TableSpec> = (0..rng.random_range(2..=14usize))
                .map(|i| {
                    let rows = 10f64.powf(rng.random_range(2.0..7.3)) as u64;
                    let dim = [8u64, 16, 64, 128][rng.random_range(0..4)];
                    TableSpec::new(format!("t{i}"), rows, dim, vec![format!("f{i}")])
                })
                .collect();
            let config = PlannerConfig { partitioner: PartitionerKind::GreedyPerf, ..Default::default() };
            let input = PlanInput { tables, topology, config };
            let (Ok(caps), Ok(space)) =
                (reserve(&input), enumerate(&input.tables, &input.topology, 512, input.config.cost_model))
            else {
                continue;
            };
            if space.iter().any(Vec::is_empty) {
                continue;
            }
            let base: Vec<&ShardingOption> = space.iter().map(|s| &s[rng.random_range(0..s.len())]).collect();
            let Ok(trace) = GreedyTrace::new(&base, &caps, &input.topology) else { continue };
            for t in 0..space.len() {
                for alt in &space[t] {
                    let mut opts = base.clone();
                    opts[t] = alt;
                    let full = partition(PartitionerKind::GreedyPerf, &opts, &caps, &input.topology, None);
                    let bound =
                        full.as_ref().ok().map(|a| crate::partition::rate(&opts, a, input.topology.world_size) * 0.9);
                    for bound in [None, bound] {
                        let Some(traced) = trace.replaced(&opts, t, &input.topology, bound) else { continue };
                        let full = partition(PartitionerKind::GreedyPerf, &opts, &caps, &input.topology, bound);
                        match (&traced, &full) {
                            (Ok(a), Ok(b)) => assert_eq!(a, b, "table {t}"),
                            (Err(a), Err(b)) => assert_eq!(a.pruned, b.pruned, "table {t}"),
                            _ => panic!("table {t}: traced {traced:?} vs full {full:?}"),
                        }
                        compared += 1;
                    }
                }
            }
            resumed_late += 1;
        }
        assert!(compared > 500 && resumed_late > 10, "{compared} comparisons over {resumed_late} inputs");
    }
}
