//! `trainrec launch --nproc 2` (mpirun, one process per rank, the MPI backend) trains the
//! shipped 2-rank recipe, and DIN's sharded sequence table, to the same metrics as `trainrec run`
//! with the ranks as threads.
//! Built with `--features mpi`; `scripts/test` runs it.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn last_eval(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let line = text.lines().rev().find(|l| l.contains("\"split\":\"eval\"")).expect("an eval line");
    serde_json::from_str::<serde_json::Value>(line).unwrap()["metrics"].clone()
}

#[test]
fn mpi_processes_train_like_threads() {
    // The quickstart's pooled tables, and DIN's sequence table (a sharded embedding collection).
    for (recipe, extra) in [
        ("recipes/dist/quickstart_2ranks.toml", vec![]),
        ("recipes/sequence/din_synthetic.toml", vec!["topology.world_size=2".to_string()]),
    ] {
        threads_and_mpi_agree(recipe, &extra);
    }
}

fn threads_and_mpi_agree(recipe: &str, extra: &[String]) {
    let name = Path::new(recipe).file_stem().unwrap().to_string_lossy().into_owned();
    let tmp = std::env::temp_dir().join(format!("trainrec-mpi-run-{}-{name}", std::process::id()));
    let (threads, mpi) = (tmp.join("threads"), tmp.join("mpi"));
    let args = |out: &Path| {
        let mut a = vec![
            recipe.to_string(),
            "--set".into(),
            "train.steps=200".into(),
            "--set".into(),
            "train.progress=false".into(),
            "--set".into(),
            "run.threads=1".into(),
            "--set".into(),
            format!("run.output_dir={}", out.display()),
            "--no-env".into(),
        ];
        for e in extra {
            a.extend(["--set".to_string(), e.clone()]);
        }
        a
    };
    let run = |sub: &[&str], out: &Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_trainrec"))
            .args(sub)
            .args(args(out))
            .current_dir(workspace())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{recipe} {sub:?}: {text}");
        text
    };
    run(&["run"], &threads);
    let out = run(&["launch", "--nproc", "2"], &mpi);
    // Rank 0 alone prints the summary.
    assert_eq!(out.matches("trained 200 steps (102400 samples)").count(), 1, "{recipe}: {out}");
    let (a, b) = (last_eval(&threads), last_eval(&mpi));
    for k in ["auc", "ne", "logloss"] {
        let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
        assert!((x - y).abs() < 1e-6, "{recipe}: {k}: threads {x} vs mpi {y}");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn bench_dist_runs_under_mpirun() {
    let o = Command::new("mpirun")
        .args(["--oversubscribe", "-n", "2", env!("CARGO_BIN_EXE_trainrec")])
        .args(["bench", "dist", "--tables", "4", "--rows", "300", "--dim", "8", "--batch", "32", "--steps", "3"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}{}", String::from_utf8_lossy(&o.stderr));
    // Rank 0 alone prints its line.
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(lines.len(), 1, "{text}");
    let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!((v["backend"].as_str(), v["world_size"].as_u64()), (Some("mpi"), Some(2)), "{v}");
}

/// The arguments after `trainrec run` of the 2-rank quickstart for `steps` steps into `out`,
/// evaluating and checkpointing every 20 steps.
fn fresh_args(out: &Path, steps: u64) -> Vec<String> {
    let mut a = vec!["recipes/dist/quickstart_2ranks.toml".to_string()];
    for s in [
        format!("train.steps={steps}"),
        "train.eval_every=20".into(),
        "train.log_every=10".into(),
        "train.checkpoint_every=20".into(),
        "train.progress=false".into(),
        "run.threads=1".into(),
        format!("run.output_dir={}", out.display()),
    ] {
        a.extend(["--set".to_string(), s]);
    }
    a.push("--no-env".into());
    a
}

/// A run's `metrics.jsonl` lines without their throughput (which differs run to run).
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

/// Under `mpirun` (one process per rank): a run aborted after step 50 and resumed from its
/// step-40 checkpoint writes the same metrics as an uninterrupted MPI run.
#[test]
fn an_aborted_mpi_run_resumes_bit_for_bit() {
    let tmp = std::env::temp_dir().join(format!("trainrec-mpi-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mpirun = |args: &[String], failpoint: &str| {
        let o = Command::new("mpirun")
            .args(["--oversubscribe", "-n", "2", "-x", "TRAINREC_FAILPOINT", env!("CARGO_BIN_EXE_trainrec"), "run"])
            .args(args)
            .current_dir(workspace())
            .env("TRAINREC_FAILPOINT", failpoint)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    let fresh = |out: &Path| fresh_args(out, 60);
    let (through, killed) = (tmp.join("through"), tmp.join("killed"));
    let (ok, text) = mpirun(&fresh(&through), "");
    assert!(ok, "{text}");
    let (ok, _) = mpirun(&fresh(&killed), "abort-after-step:50");
    assert!(!ok, "the run was to abort");
    let (ok, text) = mpirun(&["--resume".into(), killed.display().to_string(), "--no-env".into()], "");
    assert!(ok, "{text}");
    assert!(text.contains("step-00000040 (step 40)"), "{text}");
    assert_eq!(metrics(&killed), metrics(&through));
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The ranks' processes of a run writing into `out` (their command line starts with the
/// trainrec binary and names `out`; `mpirun`'s starts with `mpirun`).
fn rank_pids(out: &Path) -> Vec<u32> {
    let bin = env!("CARGO_BIN_EXE_trainrec");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<String> = cmd.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if args.first().is_some_and(|a| a == bin) && args.iter().any(|a| a.contains(&out.display().to_string())) {
            pids.push(pid);
        }
    }
    pids.sort_unstable();
    pids
}

/// SIGTERM to one rank process under `mpirun`: every rank finishes the same step, the
/// checkpoint of that step is saved, the ranks exit 143, and the run resumed under `mpirun`
/// writes the metrics of an uninterrupted MPI run.
#[test]
fn sigterm_on_one_mpi_rank_stops_every_rank_after_the_same_step() {
    let tmp = std::env::temp_dir().join(format!("trainrec-mpi-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mpirun = |args: &[String]| {
        let mut c = Command::new("mpirun");
        c.args(["--oversubscribe", "-n", "2", env!("CARGO_BIN_EXE_trainrec"), "run"])
            .args(args)
            .current_dir(workspace())
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env_remove("TRAINREC_FAILPOINT");
        c
    };
    let fresh = fresh_args;
    let checkpoints = |dir: &Path| -> Vec<u64> {
        let mut v: Vec<u64> = std::fs::read_dir(dir.join("checkpoints"))
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("step-").and_then(|s| s.parse().ok()))
            .collect();
        v.sort_unstable();
        v
    };
    let stopped_dir = tmp.join("stopped");
    let child = mpirun(&fresh(&stopped_dir, 1_000_000))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    while !stopped_dir.join("checkpoints").join("step-00000020").exists() {
        assert!(std::time::Instant::now() < deadline, "the MPI run never checkpointed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let ranks = rank_pids(&stopped_dir);
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    // One rank alone gets the signal (a node's preemption): the other stops with it.
    assert!(Command::new("kill").args(["-TERM", &ranks[1].to_string()]).status().unwrap().success());
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success(), "{err}");
    let stopped = *checkpoints(&stopped_dir).last().unwrap();
    assert!(stopped > 20, "{err}");
    assert!(err.contains(&format!("stopped by SIGTERM after step {stopped}; the checkpoint is saved")), "{err}");
    let steps = stopped + 30;
    let mut resume = vec!["--resume".to_string(), stopped_dir.display().to_string(), "--no-env".into()];
    resume.extend(["--set".to_string(), format!("train.steps={steps}")]);
    let o = mpirun(&resume).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let through = tmp.join("through");
    let o = mpirun(&fresh(&through, steps)).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(metrics(&stopped_dir), metrics(&through), "stopped after step {stopped}");
    let _ = std::fs::remove_dir_all(&tmp);
}
