//! `topology.compute_device = "cuda"` end to end on the CUDA engine's emulator
//! (`TRAINREC_CUDA_EMULATOR=1`; this package's tests build the binary with feature
//! `cuda-emulator`): the job's CUDA path (the tables in a `CudaEbc`, its forward and fused
//! backward, checkpoints and resume through it, export) trains bit for bit like the CPU path.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(args: &[String], emulated: bool) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainrec"));
    cmd.args(args).current_dir(workspace()).env_remove("RUST_LOG").env("OMP_NUM_THREADS", "1");
    if emulated {
        cmd.env("TRAINREC_CUDA_EMULATOR", "1");
    } else {
        cmd.env_remove("TRAINREC_CUDA_EMULATOR");
    }
    let out = cmd.output().expect("the binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(0), "{args:?}:\n{stderr}");
    stderr
}

fn settings(out: &Path, device: &str, steps: u64) -> Vec<String> {
    let mut args = Vec::new();
    for s in [
        format!("train.steps={steps}"),
        "train.eval_every=10".into(),
        "train.log_every=5".into(),
        "train.checkpoint_every=10".into(),
        "train.progress=false".into(),
        "data.batch_size=64".into(),
        "data.eval_batch_size=256".into(),
        "data.sampler.eval_samples=512".into(),
        "run.threads=1".into(),
        format!("topology.compute_device={device}"),
        format!("run.output_dir=\"{}\"", out.display()),
    ] {
        args.extend(["--set".to_string(), s]);
    }
    args
}

fn metrics(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(String::from).collect()
}

/// The metrics without the cache counters (they count differently on the GPU, whose lookups
/// load their rows).
fn without_cache(out: &Path) -> Vec<serde_json::Value> {
    metrics(out)
        .iter()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["metrics"].as_object_mut().unwrap().retain(|k, _| !k.starts_with("cache/"));
            v
        })
        .collect()
}

fn exported(out: &Path, emulated: bool) -> Vec<(String, Vec<u8>)> {
    let file = out.join("model.safetensors");
    run(&["export".into(), out.display().to_string(), "--out".into(), file.display().to_string()], emulated);
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
    v.sort();
    v
}

#[test]
fn a_cuda_recipe_on_the_emulator_trains_checkpoints_and_resumes_like_cpu() {
    let base = std::env::temp_dir().join(format!("trainrec-cuda-emu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (gpu, cpu) = (base.join("cuda"), base.join("cpu"));
    let recipe = || vec!["run".to_string(), "recipes/gpu/dlrm_cuda.toml".into()];
    let log = run(&[recipe(), settings(&gpu, "cuda", 20)].concat(), true);
    assert!(log.contains("runs emulated"), "{log}");
    run(&[recipe(), settings(&cpu, "cpu", 20)].concat(), false);
    let m = metrics(&gpu);
    assert!(m.iter().filter(|l| l.contains("\"eval\"")).count() == 2, "{m:?}");
    assert_eq!(m, metrics(&cpu), "the CUDA path's losses and eval metrics are the CPU path's");
    // The checkpointed tables (read back from the CUDA collection) are the CPU run's, bit for bit.
    let (a, b) = (exported(&gpu, true), exported(&cpu, false));
    assert!(
        a.iter().any(|(n, _)| n == "embedding_bags.t_C1.weight"),
        "{:?}",
        a.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    assert!(a == b, "exported tensors differ");
    // Resumed (tables loaded into the CUDA collection from the checkpoint) and trained on.
    let resume = |out: &Path, emulated: bool| {
        run(
            &["run".into(), "--resume".into(), out.display().to_string(), "--set".into(), "train.steps=30".into()],
            emulated,
        );
    };
    resume(&gpu, true);
    resume(&cpu, false);
    let m = metrics(&gpu);
    assert!(m.last().unwrap().contains("\"step\":30"), "{m:?}");
    assert_eq!(m, metrics(&cpu));
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn cached_tables_on_the_emulated_gpu_train_like_the_cpu_cache() {
    // Four tables behind caches of 30% of their rows (LRU and LFU): in GPU memory in front of
    // host memory on CUDA, in memory in front of a file on CPU; eval batches of 4096 read more
    // rows than a cache holds.
    let base = std::env::temp_dir().join(format!("trainrec-cuda-emu-cached-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (gpu, cpu) = (base.join("cuda"), base.join("cpu"));
    let recipe = || vec!["run".to_string(), "recipes/offload/quickstart_cached.toml".into()];
    let mut a = settings(&gpu, "cuda", 20);
    a.extend(["--set".into(), "data.eval_batch_size=4096".into()]);
    run(&[recipe(), a].concat(), true);
    let mut b = settings(&cpu, "cpu", 20);
    b.extend(["--set".into(), "data.eval_batch_size=4096".into()]);
    run(&[recipe(), b].concat(), false);
    // Losses and eval metrics alike; the caches' counters differ (the GPU's lookups load their
    // rows, the CPU's prefetch pipeline loads them ahead).
    let m = metrics(&gpu);
    assert!(m.iter().filter(|l| l.contains("\"eval\"")).count() == 2, "{m:?}");
    let last_train: serde_json::Value = serde_json::from_str(m.iter().rfind(|l| l.contains("train")).unwrap()).unwrap();
    assert!(last_train["metrics"]["cache/t_C1/evictions"].as_f64().unwrap() > 0.0, "{last_train}");
    assert_eq!(without_cache(&gpu), without_cache(&cpu));
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn two_cuda_ranks_on_the_emulator_train_checkpoint_and_resume_like_two_cpu_ranks() {
    // Two ranks, the tables sharded every way (table-, row-, column-, table-row-wise,
    // data-parallel, one cached) under the prefetch pipeline: each rank's shards and replicas
    // in an emulated CUDA collection, the sharding code and its collectives those of CPU.
    let base = std::env::temp_dir().join(format!("trainrec-cuda-emu-2ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (gpu, cpu) = (base.join("cuda"), base.join("cpu"));
    let recipe = || vec!["run".to_string(), "recipes/gpu/dlrm_cuda_2gpu.toml".into()];
    let log = run(&[recipe(), settings(&gpu, "cuda", 20)].concat(), true);
    assert_eq!(log.matches("this rank's shards in the CUDA engine").count(), 2, "{log}");
    run(&[recipe(), settings(&cpu, "cpu", 20)].concat(), false);
    let m = metrics(&gpu);
    assert!(m.iter().filter(|l| l.contains("\"eval\"")).count() == 2, "{m:?}");
    // t_C8's one shard is on rank 1: rank 0 writes its counters too.
    assert!(m.iter().any(|l| l.contains("cache/t_C8/shard0/misses")), "{m:?}");
    assert_eq!(without_cache(&gpu), without_cache(&cpu), "two CUDA ranks' losses and eval metrics are two CPU ranks'");
    let (a, b) = (exported(&gpu, true), exported(&cpu, false));
    assert!(a.len() >= 8, "{:?}", a.iter().map(|t| &t.0).collect::<Vec<_>>());
    assert!(a == b, "exported tensors differ");
    // Resumed: each rank's shards loaded into its CUDA collection from the checkpoint.
    for (out, emulated) in [(&gpu, true), (&cpu, false)] {
        run(
            &["run".into(), "--resume".into(), out.display().to_string(), "--set".into(), "train.steps=30".into()],
            emulated,
        );
    }
    let m = metrics(&gpu);
    assert!(m.last().unwrap().contains("\"step\":30"), "{m:?}");
    assert_eq!(without_cache(&gpu), without_cache(&cpu));
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn managed_collision_tables_on_the_emulated_gpu_train_like_on_cpu() {
    // One GPU (a plain fp16 table and a cached one, each remapped, their changed slots reset
    // in GPU memory or host memory), and two ranks whose row-wise shards reset their blocks'
    // rows (the owner-rank remap) in each rank's CUDA collection.
    let base = std::env::temp_dir().join(format!("trainrec-cuda-emu-mc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    for recipe in ["recipes/gpu/dlrm_cuda_mc.toml", "recipes/dist/mc_row_wise_2ranks.toml"] {
        let (gpu, cpu) = (base.join("cuda"), base.join("cpu"));
        let run_on = |out: &Path, device: &str, emulated: bool| {
            let mut a = vec!["run".to_string(), recipe.into()];
            a.extend(settings(out, device, 40));
            run(&a, emulated);
        };
        run_on(&gpu, "cuda", true);
        run_on(&cpu, "cpu", false);
        let m = metrics(&gpu);
        assert!(m.iter().filter(|l| l.contains("\"eval\"")).count() == 4, "{recipe}: {m:?}");
        // 40 steps, eviction every 20: slots changed hands and were reset.
        assert!(m.iter().any(|l| l.contains("mc/t_C1/")), "{recipe}: {m:?}");
        assert_eq!(without_cache(&gpu), without_cache(&cpu), "{recipe}: losses and eval metrics");
        assert!(exported(&gpu, true) == exported(&cpu, false), "{recipe}: exported tensors differ");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
