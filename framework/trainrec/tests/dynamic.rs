//! Dynamic tables from the command line: a run stopped and resumed writes the uninterrupted
//! run's metrics (the id maps, sketches and counters are in the checkpoint), the statistics
//! reach the metric files with rows bounded by the capacity over a 10^12-id space, and the
//! safetensors export carries each table's id map.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trainrec-dynamic-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn trainrec(args: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_trainrec"))
        .args(args)
        .current_dir(workspace())
        .env("OMP_NUM_THREADS", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run(out: &Path, steps: u64, resume: bool) -> String {
    run_with(out, steps, resume, &[])
}

/// [`run`] with more `--set` overrides.
fn run_with(out: &Path, steps: u64, resume: bool, extra: &[&str]) -> String {
    let mut args: Vec<String> = if resume {
        vec!["run".into(), "--resume".into(), out.display().to_string()]
    } else {
        vec!["run".into(), "recipes/dynamic/quickstart_dynamic.toml".into()]
    };
    for s in [
        format!("train.steps={steps}"),
        "train.eval_every=40".into(),
        "train.log_every=20".into(),
        "train.checkpoint_every=40".into(),
        "train.progress=false".into(),
        "data.batch_size=128".into(),
        "data.sampler.eval_samples=2048".into(),
        "run.threads=1".into(),
        format!("run.output_dir=\"{}\"", out.display()),
    ]
    .into_iter()
    .chain(extra.iter().map(|s| s.to_string()))
    {
        args.extend(["--set".into(), s]);
    }
    trainrec(&args)
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["metrics"].as_object_mut().unwrap().retain(|k, _| !k.contains("throughput"));
            v
        })
        .collect()
}

#[test]
fn a_resumed_dynamic_run_writes_the_uninterrupted_runs_metrics() {
    let (through, resumed) = (scratch("through"), scratch("resumed"));
    run(&through, 120, false);
    run(&resumed, 80, false);
    run(&resumed, 120, true);
    let (a, b) = (metrics(&through), metrics(&resumed));
    assert_eq!(a, b);
    // The statistics: rows bounded by the capacity, ids admitted and turned away, rows expired
    // (ttl 300 steps is longer than the run: none yet) — over raw ids from 10^12.
    let last = a.iter().rev().find(|l| l["split"] == "train" && l["metrics"].get("dynamic/t_C1/live_rows").is_some());
    let m = &last.expect("a train line with the dynamic statistics")["metrics"];
    for t in ["t_C1", "t_C2", "t_C3", "t_C4"] {
        let v = |k: &str| m[format!("dynamic/{t}/{k}")].as_f64().unwrap();
        assert!(v("live_rows") > 0.0 && v("live_rows") <= 20_000.0, "{t}: {m}");
        assert!(v("admitted") >= v("live_rows") && v("rejected") > 0.0, "{t}: {m}");
        assert_eq!(v("expired"), 0.0, "{t}");
    }
    // The export carries the maps: each row's raw id, -1 when free.
    let file = resumed.join("model.safetensors");
    trainrec(&["export".into(), resumed.display().to_string(), "--out".into(), file.display().to_string()]);
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("dynamic_tables.t_C1.ids").unwrap();
    assert_eq!(ids.shape(), [20_000]);
    let ids: Vec<i64> = ids.data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    let live = ids.iter().filter(|&&i| i >= 0).count() as f64;
    assert_eq!(live, m["dynamic/t_C1/live_rows"].as_f64().unwrap());
    // Raw ids beyond the rows (Zipf ranks over 10^12: the admitted ones are the frequent
    // ranks), each in one row.
    assert!(ids.iter().any(|&i| i >= 20_000), "{:?}", ids.iter().max());
    let mut held: Vec<i64> = ids.iter().copied().filter(|&i| i >= 0).collect();
    held.sort_unstable();
    held.dedup();
    assert_eq!(held.len() as f64, live);
    for d in [through, resumed] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Metric lines without the cache's counters (a cache starts cold when a run resumes).
fn model_metrics(dir: &Path) -> Vec<serde_json::Value> {
    let mut m = metrics(dir);
    for l in &mut m {
        l["metrics"].as_object_mut().unwrap().retain(|k, _| !k.starts_with("cache/"));
    }
    m
}

/// A dynamic table's rows on the `key_value` kernel: a cache in memory in front of a store on
/// disk of the rows written. It trains like the same capacity in memory, its checkpoint holds
/// the live rows alone (weights, state and map), and a resumed run goes on exactly.
#[test]
fn a_dynamic_table_on_a_key_value_store_checkpoints_its_live_rows() {
    let capacity = "tables[0].rows=400000";
    let kv = [capacity, "tables[0].constraints={compute_kernels=[\"key_value\"],cache={load_factor=0.01}}"];
    let (in_memory, through, resumed) = (scratch("kv-in-memory"), scratch("kv-through"), scratch("kv-resumed"));
    run_with(&in_memory, 80, false, &[capacity]);
    run_with(&through, 80, false, &kv);
    assert_eq!(model_metrics(&through), model_metrics(&in_memory));
    run_with(&resumed, 40, false, &kv);
    run_with(&resumed, 80, true, &[]);
    assert_eq!(model_metrics(&resumed), model_metrics(&through));

    let live = metrics(&through)
        .iter()
        .rev()
        .find_map(|l| l["metrics"].get("dynamic/t_C1/live_rows").and_then(|v| v.as_f64()))
        .expect("the live rows") as u64;
    for dir in [&through, &in_memory] {
        let ck = dir.join("checkpoints/step-00000080");
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(ck.join("manifest.json")).unwrap()).unwrap();
        let shard = m["shards"].as_array().unwrap().iter().find(|s| s["table"] == "t_C1").unwrap().clone();
        let rows = shard["stored_rows"].as_str().expect("a sparse block");
        let len = |name: &str| m["tensors"][name]["shape"][0].as_u64().unwrap();
        assert_eq!(len(rows), live, "{}: the weights saved", dir.display());
        assert_eq!(len(shard["weights"].as_str().unwrap()), live);
        assert_eq!(len("dynamic.t_C1.rows"), live, "the map saved");
        assert!(live > 100 && live < 400_000 / 4, "{live}");
    }
    for d in [in_memory, through, resumed] {
        let _ = std::fs::remove_dir_all(d);
    }
}
