//! Golden plans (trainrec's cost model) for fixed tables and topologies: the stats table of
//! each, runner-ups included. `TRAINREC_BLESS=1` rewrites them after a reviewed change.
use serde_json::Value;
use trainrec_planner::*;

fn tables(limit: usize) -> Vec<TableSpec> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/planner/torchrec_plans.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    fx["cases"][0]["tables"]
        .as_array()
        .unwrap()
        .iter()
        .take(limit)
        .map(|t| {
            let features = t["features"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
            let mut s = TableSpec::new(
                t["name"].as_str().unwrap(),
                t["rows"].as_u64().unwrap(),
                t["dim"].as_u64().unwrap(),
                features,
            );
            s.optimizer = OptimizerState::RowWise;
            s
        })
        .collect()
}

fn check(name: &str, input: PlanInput) {
    let mut p = plan(&input).unwrap_or_else(|e| panic!("{name}: {e}"));
    explain(&input, &mut p).unwrap();
    let text = render(&p, &input);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(format!("{name}.txt"));
    if std::env::var("TRAINREC_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; bless with TRAINREC_BLESS=1", path.display()));
    assert!(
        want == text,
        "{} is stale (TRAINREC_BLESS=1 after review)\n--- expected\n{want}\n--- actual\n{text}",
        path.display()
    );
}

#[test]
fn twenty_six_tables_on_two_hosts_of_four_gpus() {
    let mut topology = Topology::new(8, ComputeDevice::Cuda);
    topology.local_world_size = 4;
    topology.hbm_cap = 16 << 30;
    check("t26_2x4_cuda", PlanInput { tables: tables(26), topology, config: PlannerConfig::default() });
}

#[test]
fn twelve_tables_on_four_cpu_ranks_memory_balanced() {
    let mut topology = Topology::new(4, ComputeDevice::Cpu);
    topology.ddr_cap = 8 << 30;
    let config = PlannerConfig { partitioner: PartitionerKind::MemoryBalanced, batch_size: 1024, ..Default::default() };
    check("t12_4_cpu_balanced", PlanInput { tables: tables(12), topology, config });
}

#[test]
fn cached_tables_scaled_up_into_free_hbm() {
    let mut t = tables(6);
    for s in &mut t {
        s.constraints.compute_kernels = Some(vec![ComputeKernel::FusedUvmCaching]);
        s.constraints.cache = Some(CacheParams { load_factor: Some(0.1), ..Default::default() });
    }
    let mut topology = Topology::new(2, ComputeDevice::Cuda);
    topology.hbm_cap = 1 << 30;
    let config = PlannerConfig { proposer: ProposerKind::OffloadScaleup, ..Default::default() };
    check("t6_2_cuda_scaleup", PlanInput { tables: t, topology, config });
}

/// Offloaded tables on CPU (cache in DDR, table on disk): the scale-up grows their caches
/// into the DDR the plan leaves free, by expected lookups, and never past what fits.
#[test]
fn cached_tables_on_cpu_scaled_up_into_free_ddr() {
    let mut t = tables(6);
    for s in &mut t {
        s.constraints.compute_kernels = Some(vec![ComputeKernel::FusedUvmCaching]);
        s.constraints.cache = Some(CacheParams { load_factor: Some(0.1), ..Default::default() });
    }
    let full: u64 = t.iter().map(|s| s.rows * s.dim * 4).sum();
    for (ddr, grows_to_whole) in [(full / 4, false), (8 * full, true)] {
        let mut topology = Topology::new(2, ComputeDevice::Cpu);
        topology.ddr_cap = ddr;
        let input = PlanInput {
            tables: t.clone(),
            topology,
            config: PlannerConfig { proposer: ProposerKind::OffloadScaleup, ..Default::default() },
        };
        let p = plan(&input).unwrap_or_else(|e| panic!("{e}"));
        let lfs: Vec<f64> = p.tables.iter().map(|tp| tp.cache_load_factor.unwrap_or(1.0)).collect();
        assert!(lfs.iter().all(|&f| f > 0.1), "DDR {ddr}: every cache grew from 0.1: {lfs:?}");
        assert_eq!(lfs.iter().all(|&f| f > 0.999), grows_to_whole, "DDR {ddr}: {lfs:?}");
        for r in &p.ranks {
            assert!(r.used.ddr <= r.available.ddr, "rank {}: {:?} over {:?}", r.rank, r.used, r.available);
        }
        // The base plan (no scale-up) keeps the asked-for 0.1.
        let base = plan(&PlanInput { config: PlannerConfig::default(), ..input.clone() }).unwrap();
        assert!(
            base.tables.iter().all(|tp| tp.cache_load_factor == Some(0.1)),
            "{:?}",
            base.tables[0].cache_load_factor
        );
    }
}

/// `key_value` on CPU (a cache in DDR before a store of the rows written, on disk): only
/// where a table asks for it, priced and sized as the row file of `fused_uvm_caching` is
/// (the same cache, the same misses; the disk holds at most the whole table).
#[test]
fn key_value_tables_on_cpu_keep_their_cache_in_ddr_and_their_rows_on_disk() {
    let planned = |kernel: Option<ComputeKernel>| {
        let mut t = tables(4);
        for s in &mut t {
            s.constraints.compute_kernels = kernel.map(|k| vec![k]);
            s.constraints.cache = Some(CacheParams { load_factor: Some(0.2), ..Default::default() });
        }
        let input = PlanInput { tables: t, topology: Topology::new(2, ComputeDevice::Cpu), config: Default::default() };
        plan(&input).unwrap_or_else(|e| panic!("{e}"))
    };
    let kv = planned(Some(ComputeKernel::KeyValue));
    let uvm = planned(Some(ComputeKernel::FusedUvmCaching));
    assert!(planned(None).tables.iter().all(|t| t.compute_kernel == ComputeKernel::Fused), "asked for only");
    for (a, b) in kv.tables.iter().zip(&uvm.tables) {
        assert_eq!(a.compute_kernel, ComputeKernel::KeyValue);
        assert_eq!(a.cache_load_factor, Some(0.2));
        for (x, y) in a.shards.iter().zip(&b.shards) {
            assert_eq!(x.storage, y.storage, "table {}", a.name);
            assert_eq!(x.perf, y.perf, "table {}", a.name);
            assert!(x.storage.ssd > 0 && x.storage.ddr < x.storage.ssd && x.storage.hbm == 0, "{:?}", x.storage);
        }
    }
    // No disk, no `key_value`: the error names the constraint.
    let mut t = tables(1);
    t[0].constraints.compute_kernels = Some(vec![ComputeKernel::KeyValue]);
    let mut topology = Topology::new(1, ComputeDevice::Cpu);
    topology.ssd_cap = 0;
    let err = plan(&PlanInput { tables: t, topology, config: Default::default() }).unwrap_err().to_string();
    assert!(err.contains("compute_kernels") && err.contains("key_value"), "{err}");
}

/// A cached table without `cache.load_factor` gets the default once, in enumeration, and the
/// plan (so `plan.json`) records the value used.
#[test]
fn the_plan_records_the_default_load_factor_it_used() {
    let mut t = tables(3);
    for s in &mut t {
        s.constraints.compute_kernels = Some(vec![ComputeKernel::FusedUvmCaching]);
    }
    let input = PlanInput { tables: t, topology: Topology::new(2, ComputeDevice::Cpu), config: Default::default() };
    let p = plan(&input).unwrap_or_else(|e| panic!("{e}"));
    for tp in &p.tables {
        assert_eq!(tp.compute_kernel, ComputeKernel::FusedUvmCaching);
        assert_eq!(tp.cache_load_factor, Some(defaults::UVM_CACHING_RATIO), "table {}", tp.name);
    }
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["tables"][0]["cache_load_factor"], serde_json::json!(defaults::UVM_CACHING_RATIO), "{json}");
}
