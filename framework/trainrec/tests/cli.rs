//! The `trainrec` binary: exit codes and what it prints.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn trainrec(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_trainrec"))
        .args(args)
        .current_dir(workspace())
        .env_remove("RUST_LOG")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn validate_reports_every_problem_and_exits_2() {
    let (code, stdout, stderr) =
        trainrec(&["validate", "recipes/quickstart.toml", "tests/golden/diagnostics/unknown_keys.toml"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stdout.contains("ok: recipes/quickstart.toml")
            && stdout.contains("invalid: tests/golden/diagnostics/unknown_keys.toml")
    );
    assert!(
        stderr.contains("--> tests/golden/diagnostics/unknown_keys.toml:8:1") && stderr.contains("key: train.stepz"),
        "{stderr}"
    );
    assert!(stderr.contains("3 problems found"), "{stderr}");
    let (code, _, _) = trainrec(&["validate", "recipes/quickstart.toml"]);
    assert_eq!(code, 0);
}

#[test]
fn run_refuses_an_invalid_recipe_before_writing_anything() {
    let dir = std::env::temp_dir().join(format!("trainrec-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out_dir = format!("run.output_dir=\"{}\"", dir.display());
    let (code, _, stderr) =
        trainrec(&["run", "recipes/quickstart.toml", "--set", "tables[0].dim=0", "--set", &out_dir]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("key: tables[0].dim") && stderr.contains("--set tables[0].dim=0"), "{stderr}");
    assert!(!dir.exists(), "an invalid run must not create its run directory");
}

#[test]
fn environment_overrides_are_applied_and_located() {
    let out = Command::new(env!("CARGO_BIN_EXE_trainrec"))
        .args(["validate", "recipes/quickstart.toml"])
        .current_dir(workspace())
        .env("TRAINREC_TRAIN__STEPS", "-4")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("environment variable TRAINREC_TRAIN__STEPS") && stderr.contains("key: train.steps"),
        "{stderr}"
    );
}

#[test]
fn reference_prints_the_generated_page() {
    let (code, stdout, _) = trainrec(&["reference"]);
    assert_eq!(code, 0);
    let page = std::fs::read_to_string(workspace().join("book/src/reference/recipe.md")).unwrap();
    assert_eq!(stdout, page);
}

#[test]
fn bench_ebc_prints_one_json_line_with_the_anchor_fields() {
    let (code, stdout, stderr) = trainrec(&[
        "bench",
        "ebc",
        "--tables",
        "2",
        "--rows",
        "5000",
        "--dim",
        "12",
        "--pooling",
        "3",
        "--batch",
        "64",
        "--dist",
        "zipf",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--fwd-steps",
        "2",
        "--optimizer",
        "lamb",
        "--threads",
        "2",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "exactly one line on stdout: {stdout}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert!(v["samples_per_s"]["median"].as_f64().unwrap() > 0.0);
    assert!(v["step"]["median_s"].as_f64().unwrap() > 0.0);
    assert!(v["fwd_only"]["median_s"].as_f64().unwrap() > 0.0);
    assert!(v["implied_GBps_at_median"].as_f64().unwrap() > 0.0);
    let unique = v["unique_rows_per_step"].as_f64().unwrap();
    assert!(unique > 0.0 && unique <= 2.0 * 64.0 * 3.0, "{unique}");
    assert_eq!(v["config"]["optimizer"]["kind"], "lamb");
    assert_eq!(v["config"]["dist"], "zipf");
    let (code, _, stderr) = trainrec(&["bench", "ebc", "--rows", "0"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("must be > 0"), "{stderr}");
}

#[test]
fn bench_ec_prints_the_unpooled_step_as_one_json_line() {
    let args = ["--tables", "2", "--rows", "5000", "--dim", "12", "--pooling", "3", "--batch", "64", "--steps", "3"];
    let (code, stdout, stderr) =
        trainrec(&[&["bench", "ec"][..], &args, &["--warmup", "1", "--fwd-steps", "2"]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "exactly one line on stdout: {stdout}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(v["workload"], "w1_ec_fused_train");
    assert!(v["step"]["median_s"].as_f64().unwrap() > 0.0);
    assert!(v["fwd_only"]["median_s"].as_f64().unwrap() > 0.0);
    // Unpooled: the forward writes a row per id (2 x 64 x 3 lookups of 12 floats), more than
    // the pooled W1's output of a row per bag.
    let (lookups, d) = (2.0 * 64.0 * 3.0, 12.0);
    assert!(v["min_bytes_per_step"].as_f64().unwrap() > 3.0 * lookups * d * 4.0, "{v}");
    let (code, _, stderr) = trainrec(&[&["bench", "ec"][..], &args, &["--device", "cuda"]].concat());
    assert_eq!(code, 2);
    assert!(stderr.contains("no CUDA path"), "{stderr}");
    let (code, _, stderr) = trainrec(&[&["bench", "ec"][..], &args, &["--quant"]].concat());
    assert_eq!(code, 2);
    assert!(stderr.contains("no --mc-interval or --quant"), "{stderr}");
}

#[test]
fn bench_metrics_prints_the_w4_shape() {
    let (code, stdout, stderr) = trainrec(&["bench", "metrics", "--n", "20000", "--batch", "512", "--repeats", "2"]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    for m in ["ne", "auc"] {
        assert!(v[m]["update_total"]["median_s"].as_f64().unwrap() > 0.0, "{m}");
        assert!(v[m]["compute"]["median_s"].as_f64().is_some(), "{m}");
    }
    let auc = v["auc"]["values"]["auc"].as_f64().unwrap();
    assert!((0.65..0.8).contains(&auc), "calibrated sigmoid(N(0,1)) predictions give AUC ~ 0.74, got {auc}");
    let ne = v["ne"]["values"]["lifetime_ne"].as_f64().unwrap();
    assert!((0.8..0.92).contains(&ne), "NE ~ 0.865, got {ne}");
}

#[test]
fn bench_metrics_reads_samples_from_a_data_file() {
    let dir = std::env::temp_dir().join(format!("trainrec-metrics-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Positives at 0.9 and 0.7, negatives at 0.8 and 0.6: 3 of 4 pairs ordered, AUC 0.75.
    let values = [0.9f32, 0.8, 0.7, 0.6, 1.0, 0.0, 1.0, 0.0];
    let path = dir.join("samples.f32");
    std::fs::write(&path, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let file = path.display().to_string();
    let (code, stdout, stderr) = trainrec(&["bench", "metrics", "--data", &file, "--batch", "3", "--repeats", "1"]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!((v["config"]["n"].as_u64(), v["config"]["data"].as_str()), (Some(4), Some("file")));
    assert_eq!(v["num_updates"].as_u64(), Some(2));
    assert!((v["auc"]["values"]["auc"].as_f64().unwrap() - 0.75).abs() < 1e-12, "{stdout}");
    // ce = -log2(.9) - log2(.2) - log2(.7) - log2(.4) bits over 4 samples with base rate 1/2.
    let ce =
        -(0.9f32 as f64).log2() - (1.0 - 0.8f32 as f64).log2() - (0.7f32 as f64).log2() - (1.0 - 0.6f32 as f64).log2();
    let ne = v["ne"]["values"]["lifetime_ne"].as_f64().unwrap();
    assert!((ne - ce / 4.0).abs() < 1e-12, "NE {ne} vs {}", ce / 4.0);
    // A file that is not n predictions then n labels is named, with exit 2.
    std::fs::write(&path, [0u8; 12]).unwrap();
    let (code, _, stderr) = trainrec(&["bench", "metrics", "--data", &file]);
    assert_eq!(code, 2);
    assert!(stderr.contains(&file) && stderr.contains("12 bytes"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_prints_the_stats_writes_the_plan_and_a_pinned_plan_is_checked() {
    let dir = std::env::temp_dir().join(format!("trainrec-plan-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let plan_path = dir.join("plan.json");
    let out = plan_path.display().to_string();
    let (code, stdout, stderr) = trainrec(&["plan", "recipes/planner/criteo_8gpu.toml", "--out", &out]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("plan for 12 tables on 8 rank(s)") && stdout.contains("slowest rank:"), "{stdout}");
    // One line per rank and per table, each table with its runner-up.
    for rank in 0..8 {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(&format!("{rank} "))), "rank {rank}: {stdout}");
    }
    let t10 = stdout.lines().find(|l| l.trim_start().starts_with("t_C10 ")).expect("t_C10 line");
    assert!(t10.contains("row_wise") && t10.contains("0-7") && t10.contains("slowest rank"), "{t10}");
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan_path).unwrap()).unwrap();
    assert_eq!(plan["world_size"], 8);
    assert_eq!(plan["tables"].as_array().unwrap().len(), 12);

    // Pin it: the recipe validates with it, and refuses it once an input changes.
    let recipe = dir.join("pinned.toml");
    let base = workspace().join("recipes/planner/criteo_8gpu.toml").canonicalize().unwrap();
    std::fs::write(
        &recipe,
        format!("extends = {:?}\n\n[planner]\nplan_file = \"plan.json\"\n", base.display().to_string()),
    )
    .unwrap();
    let r = recipe.display().to_string();
    let (code, _, stderr) = trainrec(&["validate", &r]);
    assert_eq!(code, 0, "{stderr}");
    let (code, _, stderr) = trainrec(&["validate", &r, "--set", "tables[3].rows=7425"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("key: planner.plan_file") && stderr.contains("other planner inputs"), "{stderr}");
    // What-if planning for 16 ranks on two hosts from the command line.
    let (code, stdout, stderr) = trainrec(&[
        "plan",
        "recipes/planner/criteo_8gpu.toml",
        "--world-size",
        "16",
        "--set",
        "topology.local_world_size=8",
        "--out",
        &out,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("on 16 rank(s) (8 per host"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eight_gpu_ranks_without_a_gpu_stop_with_one_clear_error() {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("skipping: this machine has a CUDA driver");
        return;
    }
    // Every rank finds the same: one error, before any rank waits for another.
    let (code, stdout, stderr) = trainrec(&["run", "recipes/planner/criteo_8gpu.toml"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("key: topology.compute_device") && stderr.contains("libcuda.so"), "{stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("timed out"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
}

#[test]
fn a_cuda_recipe_without_a_gpu_says_what_is_missing() {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("skipping: this machine has a CUDA driver");
        return;
    }
    let (code, stdout, stderr) = trainrec(&["run", "recipes/gpu/dlrm_cuda.toml"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("key: topology.compute_device")
            && stderr.contains("libcuda.so")
            && stderr.contains("compute_device = \"cpu\""),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
}

#[test]
fn launch_without_mpi_support_says_how_to_get_it() {
    if cfg!(feature = "mpi") {
        return; // this binary has MPI: tests/mpi_run.rs launches it
    }
    let (code, _, stderr) = trainrec(&["launch", "--nproc", "2", "recipes/dist/quickstart_2ranks.toml"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--features mpi") && stderr.contains("threads of one process"), "{stderr}");
}

#[test]
fn bench_plan_prints_the_w3_keys() {
    let tables = std::env::temp_dir().join(format!("trainrec-bench-plan-{}.json", std::process::id()));
    let set: Vec<serde_json::Value> = (0..12)
        .map(|i| {
            let dim = [32, 64, 128][i % 3];
            serde_json::json!({"name": format!("t{i}"), "rows": 1000 * (i + 1) * (i + 1), "dim": dim, "features": [format!("f{i}")], "pooling_factor": 1.0})
        })
        .collect();
    std::fs::write(&tables, serde_json::json!({"tables": set}).to_string()).unwrap();
    let t = tables.display().to_string();
    let (code, stdout, stderr) = trainrec(&[
        "bench",
        "plan",
        "--tables-json",
        &t,
        "--world-size",
        "4",
        "--cost-model",
        "torchrec",
        "--repeats",
        "2",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    for key in [
        "plan_wall",
        "num_proposals",
        "num_plans",
        "max_rank_perf_estimate",
        "per_rank_perf",
        "per_rank_hbm_GiB",
        "per_rank_ddr_GiB",
        "sharding_kinds",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {stdout}");
    }
    assert_eq!(v["plan_wall"]["n"], 2);
    assert_eq!(v["per_rank_perf"].as_array().unwrap().len(), 4);
    let worst = v["per_rank_perf"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).fold(0.0, f64::max);
    assert!((worst - v["max_rank_perf_estimate"].as_f64().unwrap()).abs() < 1e-12);
    std::fs::remove_file(&tables).unwrap();
}

#[test]
fn bench_dist_prints_every_phase_and_the_raw_all_to_all() {
    let (code, stdout, stderr) = trainrec(&[
        "bench",
        "dist",
        "--world-size",
        "3",
        "--sharding",
        "row-wise",
        "--tables",
        "4",
        "--rows",
        "300",
        "--dim",
        "8",
        "--batch",
        "32",
        "--steps",
        "3",
        "--warmup",
        "1",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        (v["bench"].as_str(), v["world_size"].as_u64(), v["sharding"].as_str()),
        (Some("dist"), Some(3), Some("row_wise"))
    );
    for k in ["input_dist", "lookup", "output_dist", "grad_dist", "update", "total"] {
        assert!(v["ms_per_step"][k].as_f64().is_some(), "{k}: {v}");
    }
    // Row-wise: every rank sends its partial sums of every example of every rank.
    assert_eq!(v["bytes_sent_per_rank"]["output_dist"].as_u64(), Some(4 * 96 * 4 * 8), "{v}");
    assert!(v["raw_all_to_all_ms"]["output_bytes"].as_f64().is_some(), "{v}");
}

#[test]
fn a_two_rank_run_logs_each_line_once() {
    let out = std::env::temp_dir().join(format!("trainrec-cli-2ranks-log-{}", std::process::id()));
    let dir = format!("run.output_dir={:?}", out.display().to_string());
    let (code, _, err) = trainrec(&[
        "run",
        "recipes/dist/quickstart_2ranks.toml",
        "--set",
        "train.steps=20",
        "--set",
        "train.eval_every=10",
        "--set",
        "train.log_every=10",
        "--set",
        "data.sampler.eval_samples=512",
        "--set",
        &dir,
    ]);
    assert_eq!(code, 0, "{err}");
    // Only the lead rank logs: one eval line at step 10 and one train line per log step.
    assert_eq!(err.matches("eval step=10").count(), 1, "{err}");
    assert_eq!(err.matches("train step=10 ").count(), 1, "{err}");
    let _ = std::fs::remove_dir_all(&out);
}
