//! Property tests over random tables, constraints and topologies (seeded, so failures
//! reproduce): every plan respects memory and constraints, places every row of every table
//! exactly once, and is deterministic.
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_planner::*;

fn random_input(rng: &mut StdRng) -> PlanInput {
    let device = if rng.random_bool(0.6) { ComputeDevice::Cuda } else { ComputeDevice::Cpu };
    let hosts = rng.random_range(1..=3usize);
    let per_host = [1usize, 2, 4][rng.random_range(0..3)];
    let mut topology = Topology::new(hosts * per_host, device);
    topology.local_world_size = per_host;
    topology.hbm_cap = rng.random_range(1u64..=8) << 30;
    topology.ddr_cap = rng.random_range(8u64..=64) << 30;
    let n = rng.random_range(1..=12usize);
    let all_types = ShardingType::ALL;
    let tables = (0..n)
        .map(|i| {
            let rows = 10f64.powf(rng.random_range(2.0..7.3)) as u64;
            let dim = [8u64, 16, 32, 64, 96, 128, 256][rng.random_range(0..7)];
            let mut t = TableSpec::new(format!("t{i}"), rows, dim, vec![format!("f{i}")]);
            t.optimizer =
                [OptimizerState::None, OptimizerState::RowWise, OptimizerState::TwoPerWeight][rng.random_range(0..3)];
            let c = &mut t.constraints;
            if rng.random_bool(0.3) {
                let k = rng.random_range(1..=3);
                c.sharding_types = Some((0..k).map(|_| all_types[rng.random_range(0..all_types.len())]).collect());
            }
            if rng.random_bool(0.2) && device == ComputeDevice::Cuda {
                c.compute_kernels = Some(if rng.random_bool(0.5) {
                    vec![ComputeKernel::Fused, ComputeKernel::FusedUvmCaching]
                } else {
                    vec![ComputeKernel::FusedUvmCaching]
                });
                c.cache = Some(CacheParams { load_factor: Some(rng.random_range(0.05..0.5)), ..Default::default() });
            }
            if rng.random_bool(0.3) {
                c.pooling_factors = Some(vec![rng.random_range(0.5..20.0)]);
            }
            if rng.random_bool(0.2) {
                c.min_partition = Some([4u64, 16, 32][rng.random_range(0..3)]);
            }
            c.is_weighted = rng.random_bool(0.2);
            t
        })
        .collect();
    let proposer = [ProposerKind::Default, ProposerKind::Greedy, ProposerKind::Uniform, ProposerKind::OffloadScaleup]
        [rng.random_range(0..4)];
    let config = PlannerConfig {
        proposer,
        early_stop_threshold: if rng.random_bool(0.3) { Some(rng.random_range(1..20)) } else { None },
        partitioner: if rng.random_bool(0.3) { PartitionerKind::MemoryBalanced } else { PartitionerKind::GreedyPerf },
        cost_model: if rng.random_bool(0.5) { CostModel::Torchrec } else { CostModel::Trainrec },
        batch_size: [64u64, 512, 2048][rng.random_range(0..3)],
        ..Default::default()
    };
    PlanInput { tables, topology, config }
}

fn check_plan(input: &PlanInput, plan: &Plan, case: usize) {
    let w = input.topology.world_size;
    let caps = reserve(input).unwrap();
    let mut used = vec![Storage::default(); w];
    assert_eq!(plan.tables.len(), input.tables.len());
    for (tp, spec) in plan.tables.iter().zip(&input.tables) {
        let what = format!("case {case}: table {} ({}/{})", spec.name, tp.sharding_type, tp.compute_kernel);
        if let Some(allowed) = &spec.constraints.sharding_types {
            assert!(allowed.contains(&tp.sharding_type), "{what}: sharding type outside the constraint");
        }
        if let Some(allowed) = &spec.constraints.compute_kernels {
            assert!(allowed.contains(&tp.compute_kernel), "{what}: kernel outside the constraint");
        }
        assert!(
            supported_kernels(tp.sharding_type, input.topology.compute_device, input.config.cost_model)
                .contains(&tp.compute_kernel),
            "{what}"
        );
        for s in &tp.shards {
            assert!(s.rank < w, "{what}: rank {} of {w}", s.rank);
            used[s.rank] = used[s.rank].plus(&s.storage);
        }
        // Every weight covered exactly once (data parallel: once per rank, on every rank).
        let copies = if tp.sharding_type == ShardingType::DataParallel { w as u64 } else { 1 };
        let mut cover = vec![0u8; 0];
        let cells = (spec.rows * spec.dim) as usize;
        if cells <= 4_000_000 {
            cover = vec![0u8; cells];
        }
        let mut area = 0u64;
        for s in &tp.shards {
            assert!(
                s.offset[0] + s.size[0] <= spec.rows && s.offset[1] + s.size[1] <= spec.dim,
                "{what}: shard outside"
            );
            area += s.size[0] * s.size[1];
            if !cover.is_empty() {
                for r in s.offset[0]..s.offset[0] + s.size[0] {
                    for c in s.offset[1]..s.offset[1] + s.size[1] {
                        cover[(r * spec.dim + c) as usize] += 1;
                    }
                }
            }
        }
        assert_eq!(area, spec.rows * spec.dim * copies, "{what}: area");
        assert!(cover.iter().all(|&k| k as u64 == copies), "{what}: a weight is not placed exactly {copies} time(s)");
        let ranks: Vec<usize> = tp.shards.iter().filter(|s| s.size[0] > 0).map(|s| s.rank).collect();
        match tp.sharding_type {
            ShardingType::DataParallel | ShardingType::RowWise => {
                let mut r = ranks.clone();
                r.sort();
                r.dedup();
                assert_eq!(r.len(), ranks.len(), "{what}: two shards on one rank");
            }
            ShardingType::TableRowWise | ShardingType::TableColumnWise => {
                let host = ranks[0] / input.topology.local_world_size;
                assert!(
                    ranks.iter().all(|r| r / input.topology.local_world_size == host),
                    "{what}: shards on two hosts"
                );
            }
            _ => {}
        }
    }
    for r in 0..w {
        assert!(used[r].fits_in(&caps[r]), "case {case}: rank {r} uses {:?} of {:?}", used[r], caps[r]);
        assert_eq!(used[r], plan.ranks[r].used, "case {case}: rank {r} totals");
    }
    let worst = plan.ranks.iter().map(|r| r.perf).fold(0.0, f64::max);
    assert!((worst - plan.max_rank_perf).abs() <= 1e-9 * worst.max(1e-12), "case {case}: max rank perf");
}

#[test]
fn random_plans_respect_memory_constraints_and_place_every_row_once() {
    let mut rng = StdRng::seed_from_u64(7);
    let (mut planned, mut refused) = (0, 0);
    for case in 0..300 {
        let input = random_input(&mut rng);
        match plan(&input) {
            Ok(p) => {
                check_plan(&input, &p, case);
                // Deterministic: the same inputs give the same plan.
                assert_eq!(plan(&input).unwrap(), p, "case {case}: not deterministic");
                planned += 1;
            }
            Err(PlanError::NoFit { message }) => {
                assert!(message.contains("GiB") && message.contains("to fit:"), "case {case}: {message}");
                refused += 1;
            }
            Err(e @ (PlanError::NoOptions { .. } | PlanError::Constraint { .. })) => {
                assert!(e.to_string().contains("tables["), "case {case}: {e}");
                refused += 1;
            }
            Err(e) => panic!("case {case}: unexpected {e}"),
        }
    }
    assert!(planned > 150, "too few random cases planned ({planned}; {refused} refused)");
}

#[test]
fn runner_ups_are_real_alternatives_with_their_rating() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut explained = 0;
    for case in 0..60 {
        let mut input = random_input(&mut rng);
        input.config.proposer = ProposerKind::Default;
        input.config.partitioner = PartitionerKind::GreedyPerf;
        let Ok(mut p) = plan(&input) else { continue };
        explain(&input, &mut p).unwrap();
        for t in &p.tables {
            let Some(r) = &t.runner_up else { continue };
            explained += 1;
            assert!(
                (r.sharding_type, r.compute_kernel, r.cache_load_factor)
                    != (t.sharding_type, t.compute_kernel, t.cache_load_factor)
                    || r.sharding_type == ShardingType::ColumnWise
                    || r.sharding_type == ShardingType::TableColumnWise,
                "case {case}: {} runner-up is the chosen option",
                t.name
            );
            if let Some(rating) = r.max_rank_perf {
                assert!(rating.is_finite() && rating > 0.0, "case {case}: {}", t.name);
                let worse = rating > p.max_rank_perf;
                assert_eq!(r.reason.contains('%'), worse, "case {case}: {}: {}", t.name, r.reason);
            }
        }
    }
    assert!(explained > 50, "only {explained} runner-ups");
}

#[test]
fn saved_plans_load_only_for_their_inputs() {
    let mut rng = StdRng::seed_from_u64(3);
    let input = loop {
        let i = random_input(&mut rng);
        if plan(&i).is_ok() {
            break i;
        }
    };
    let p = plan(&input).unwrap();
    let dir = std::env::temp_dir().join(format!("trainrec-plan-{}", std::process::id()));
    let path = dir.join("plan.json");
    save_plan(&p, &path).unwrap();
    assert_eq!(load_plan(&path, &input).unwrap(), p);
    let mut other = input.clone();
    other.tables[0].rows += 1;
    let err = load_plan(&path, &other).unwrap_err().to_string();
    assert!(err.contains("other planner inputs") && err.contains("trainrec plan"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
