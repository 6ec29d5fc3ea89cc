//! Plan and engine agree: every compute kernel the planner can choose (its `trainrec` cost
//! model, on CPU and on CUDA through the emulator) is built as planned — a whole table in the
//! engine's memory for `dense` / `fused`, a cache of the planned load factor in front of the
//! planned store for `fused_uvm_caching` (rows) and `key_value` — and a plan choosing a kernel
//! no engine builds (`fused_uvm`, in TorchRec's search space) is refused before anything is
//! built, naming the table.

use std::path::{Path, PathBuf};

use trainrec::embedding::CacheBacking;
use trainrec::engine::load_and_check;
use trainrec::planner::{ComputeKernel, CostModel, ShardingType, supported_kernels};
use trainrec::recipe::LoadOptions;
use trainrec::{Job, Registry};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trainrec-kernels-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn recipe(dir: &Path, device: &str, sharding: &str, kernel: &str, cost_model: &str) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "kernels"
output_dir = "{out}"
threads = 1
[data]
batch_size = 32
[data.sampler]
kind = "synthetic"
dense_features = 4
sparse_features = ["C1"]
train_samples = 1000
eval_samples = 100
[embedding]
offload_dir = "{out}/offload"
[topology]
compute_device = "{device}"
ssd_gib = 10
[planner]
cost_model = "{cost_model}"
[[tables]]
name = "t"
features = ["C1"]
rows = 1000
dim = 8
constraints = {{ sharding_types = ["{sharding}"], compute_kernels = ["{kernel}"], cache = {{ load_factor = 0.25 }} }}
[model]
kind = "dlrm"
dense_arch = [8]
over_arch = [1]
[optimizer]
sparse = {{ kind = "rowwise_adagrad", lr = 0.05 }}
dense = {{ kind = "adagrad", lr = 0.01 }}
[train]
steps = 2
"#,
        out = dir.display()
    );
    let path = dir.join(format!("{device}-{sharding}-{kernel}-{cost_model}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn every_kernel_the_planner_can_choose_is_built_as_planned() {
    // SAFETY: the only test of this binary; nothing else reads the environment meanwhile.
    unsafe { std::env::set_var("TRAINREC_CUDA_EMULATOR", "1") };
    let registry = Registry::builtin();
    let dir = scratch("built");
    let mut checked = Vec::new();
    for device in [trainrec::planner::ComputeDevice::Cpu, trainrec::planner::ComputeDevice::Cuda] {
        for st in [ShardingType::DataParallel, ShardingType::TableWise] {
            for kernel in supported_kernels(st, device, CostModel::Trainrec) {
                assert!(kernel.is_built(), "the trainrec cost model offers {kernel}");
                let path = recipe(&dir, device.name(), st.name(), kernel.name(), "trainrec");
                let (loaded, features) = load_and_check(&path, &LoadOptions::default(), &registry)
                    .unwrap_or_else(|d| panic!("{device:?} {st:?} {kernel}: {d}"));
                let job = Job::build(&loaded, &features, &registry)
                    .unwrap_or_else(|e| panic!("{device:?} {st:?} {kernel}: {e}"));
                let tp = &job.plan().tables[0];
                assert_eq!((tp.sharding_type, tp.compute_kernel), (st, kernel));
                let placements = job.cache_placements();
                match kernel.cache_backing() {
                    None => assert!(placements.is_empty(), "{device:?} {kernel}: {placements:?}"),
                    Some(backing) => {
                        assert_eq!(placements.len(), 1, "{device:?} {kernel}: {placements:?}");
                        let (name, p) = &placements[0];
                        assert!(name.starts_with('t'), "{name}");
                        assert_eq!(p.backing, backing, "{device:?} {kernel}");
                        assert_eq!(p.slots, 250, "{device:?} {kernel}: the planned load factor 0.25 of 1000 rows");
                        // A fresh key-value store holds no row (each still reads as its initial
                        // weights); a rows store holds every row.
                        let stored = if backing == CacheBacking::KeyValue { 0 } else { 1000 };
                        assert_eq!(p.stored, stored, "{device:?} {kernel}");
                    }
                }
                checked.push(format!("{}/{}/{}", device.name(), st.name(), kernel.name()));
            }
        }
    }
    assert_eq!(
        checked,
        [
            "cpu/data_parallel/dense",
            "cpu/table_wise/fused",
            "cpu/table_wise/fused_uvm_caching",
            "cpu/table_wise/key_value",
            "cuda/data_parallel/dense",
            "cuda/table_wise/fused",
            "cuda/table_wise/fused_uvm_caching",
            "cuda/table_wise/key_value",
        ]
    );
    assert!(matches!(ComputeKernel::FusedUvmCaching.cache_backing(), Some(CacheBacking::Rows)));

    // fused_uvm: asked for under the trainrec model, or chosen by TorchRec's model.
    for (cost_model, message) in [
        ("trainrec", "fused_uvm, FBGEMM's rows read in place from host memory, is not built by trainrec's engines"),
        ("torchrec", "the plan puts it on the `fused_uvm` kernel, which trainrec's engines do not build"),
    ] {
        let path = recipe(&dir, "cuda", "table_wise", "fused_uvm", cost_model);
        let Err(e) = load_and_check(&path, &LoadOptions::default(), &registry) else { panic!("{cost_model}: planned") };
        let e = e.to_string();
        assert!(e.contains(message) && e.contains("tables[0].constraints.compute_kernels"), "{cost_model}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
