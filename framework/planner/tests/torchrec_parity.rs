//! `--cost-model torchrec` against TorchRec 1.9.2's own planner on fixed cases.
//!
//! The fixture holds TorchRec's whole search space (every option's shards, perf components and
//! storage) and its chosen plan; regenerate it with the command in
//! `tests/fixtures/planner/gen_torchrec_plans.py`.
use serde_json::Value;
use trainrec_planner::*;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/planner/torchrec_plans.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("fixture json")
}

fn sharding_type(s: &str) -> ShardingType {
    match s {
        "grid_shard" => ShardingType::Grid,
        other => serde_json::from_value(Value::String(other.into())).expect("sharding type"),
    }
}

fn kernel(s: &str) -> ComputeKernel {
    serde_json::from_value(Value::String(s.into())).expect("kernel")
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The planner input of a fixture case.
fn input_of(case: &Value) -> PlanInput {
    let inp = &case["input"];
    let topo = &inp["topology"];
    let device = if topo["compute_device"] == "cuda" { ComputeDevice::Cuda } else { ComputeDevice::Cpu };
    let mut topology = Topology::new(topo["world_size"].as_u64().unwrap() as usize, device);
    if let Some(l) = topo.get("local_world_size") {
        topology.local_world_size = l.as_u64().unwrap() as usize;
    }
    let tables = case["tables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let name = t["name"].as_str().unwrap();
            let features = t["features"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
            let mut spec = TableSpec::new(name, t["rows"].as_u64().unwrap(), t["dim"].as_u64().unwrap(), features);
            spec.optimizer = match inp["optimizers"].get(name).and_then(|o| o.as_str()) {
                Some("rowwise_adagrad") => OptimizerState::RowWise,
                Some("adam") => OptimizerState::TwoPerWeight,
                Some("adagrad") => OptimizerState::PerWeight,
                _ => OptimizerState::None,
            };
            spec.constraints.is_weighted = inp["weighted_module"].as_bool().unwrap_or(false);
            if let Some(c) = inp["constraints"].get(name) {
                let k = &mut spec.constraints;
                k.sharding_types = c
                    .get("sharding_types")
                    .map(|v| v.as_array().unwrap().iter().map(|s| sharding_type(s.as_str().unwrap())).collect());
                k.compute_kernels = c
                    .get("compute_kernels")
                    .map(|v| v.as_array().unwrap().iter().map(|s| kernel(s.as_str().unwrap())).collect());
                k.min_partition = c.get("min_partition").and_then(|v| v.as_u64());
                k.pooling_factors = c.get("pooling_factors").map(f64s);
                k.num_poolings = c.get("num_poolings").map(f64s);
                k.batch_sizes =
                    c.get("batch_sizes").map(|v| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect());
                k.cache = c.get("cache").map(|c| CacheParams {
                    load_factor: c.get("load_factor").and_then(|v| v.as_f64()),
                    prefetch_pipeline: c.get("prefetch_pipeline").and_then(|v| v.as_bool()),
                    ..Default::default()
                });
            }
            spec
        })
        .collect();
    // TorchRec's search exactly: no refinement pass.
    let config = PlannerConfig {
        cost_model: CostModel::Torchrec,
        batch_size: inp["batch"].as_u64().unwrap(),
        refine: false,
        ..Default::default()
    };
    PlanInput { tables, topology, config }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
}

#[test]
fn search_space_matches_torchrec_option_by_option() {
    let fx = fixture();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = input_of(case);
        let space = enumerate(&input.tables, &input.topology, input.config.batch_size, CostModel::Torchrec).unwrap();
        let ours: Vec<&ShardingOption> = space.iter().flatten().collect();
        let theirs = case["search_space"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}: option count");
        for (o, t) in ours.iter().zip(theirs) {
            let table = &input.tables[o.table].name;
            let what = format!("{name}: {table} {}/{}", o.sharding_type, o.compute_kernel);
            assert_eq!(table, t["table"].as_str().unwrap(), "{what}: enumeration order");
            assert_eq!(o.sharding_type, sharding_type(t["sharding_type"].as_str().unwrap()), "{what}");
            assert_eq!(o.compute_kernel, kernel(t["compute_kernel"].as_str().unwrap()), "{what}");
            let shards = t["shards"].as_array().unwrap();
            assert_eq!(o.shards.len(), shards.len(), "{what}: shard count");
            for (i, (s, ts)) in o.shards.iter().zip(shards).enumerate() {
                let u = |v: &Value| [v[0].as_u64().unwrap(), v[1].as_u64().unwrap()];
                assert_eq!(s.size, u(&ts["size"]), "{what} shard {i} size");
                assert_eq!(s.offset, u(&ts["offset"]), "{what} shard {i} offset");
                assert_eq!(s.storage.hbm, ts["storage"]["hbm"].as_u64().unwrap(), "{what} shard {i} hbm");
                assert_eq!(s.storage.ddr, ts["storage"]["ddr"].as_u64().unwrap(), "{what} shard {i} ddr");
                let p = &ts["perf"];
                for (field, ours) in [
                    ("fwd_compute", s.perf.fwd_compute),
                    ("fwd_comms", s.perf.fwd_comms),
                    ("bwd_compute", s.perf.bwd_compute),
                    ("bwd_comms", s.perf.bwd_comms),
                    ("prefetch_compute", s.perf.prefetch_compute),
                    ("input_dist_comms", s.perf.input_dist_comms),
                ] {
                    let want = p[field].as_f64().unwrap();
                    assert!(close(ours, want), "{what} shard {i} {field}: ours {ours} torchrec {want}");
                }
            }
        }
    }
}

#[test]
fn refinement_never_loses_to_torchrec() {
    for case in fixture()["cases"].as_array().unwrap() {
        let mut input = input_of(case);
        input.config.refine = true;
        let plan = plan(&input).unwrap();
        let theirs = case["max_rank_perf"].as_f64().unwrap();
        assert!(
            plan.max_rank_perf <= theirs * (1.0 + 1e-12),
            "{}: ours {} torchrec {theirs}",
            case["name"],
            plan.max_rank_perf
        );
        eprintln!("{}: refined {} vs torchrec {theirs}", case["name"], plan.max_rank_perf);
    }
}

#[test]
fn reservation_matches_torchrec() {
    for case in fixture()["cases"].as_array().unwrap() {
        let input = input_of(case);
        let caps = reserve(&input).unwrap();
        for (c, t) in caps.iter().zip(case["reserved"].as_array().unwrap()) {
            assert_eq!(c.hbm, t["hbm"].as_u64().unwrap(), "{}", case["name"]);
            assert_eq!(c.ddr, t["ddr"].as_u64().unwrap(), "{}", case["name"]);
        }
    }
}

#[test]
fn plan_is_torchrecs_under_its_cost_model() {
    for case in fixture()["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = input_of(case);
        let plan = plan(&input).unwrap();
        let theirs = case["max_rank_perf"].as_f64().unwrap();
        assert!(plan.max_rank_perf <= theirs * (1.0 + 1e-12), "{name}: ours {} torchrec {theirs}", plan.max_rank_perf);
        assert!(
            close(plan.max_rank_perf, theirs),
            "{name}: same search, same best: ours {} torchrec {theirs}",
            plan.max_rank_perf
        );
        assert_eq!(plan.num_proposals as u64, case["num_proposals"].as_u64().unwrap(), "{name}: proposals");
        for (tp, t) in plan.tables.iter().zip(case["plan"].as_array().unwrap()) {
            assert_eq!(tp.sharding_type, sharding_type(t["sharding_type"].as_str().unwrap()), "{name} {}", tp.name);
            assert_eq!(tp.compute_kernel, kernel(t["compute_kernel"].as_str().unwrap()), "{name} {}", tp.name);
            let ranks: Vec<u64> = tp.shards.iter().map(|s| s.rank as u64).collect();
            let want: Vec<u64> = t["ranks"].as_array().unwrap().iter().map(|r| r.as_u64().unwrap()).collect();
            assert_eq!(ranks, want, "{name} {} ranks", tp.name);
        }
    }
}
