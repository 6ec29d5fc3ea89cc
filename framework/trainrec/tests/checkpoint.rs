//! Checkpoints through the `trainrec` binary: a run killed mid-training (the process aborts,
//! as under `kill -9`) and resumed with `trainrec run --resume` writes the same
//! `metrics.jsonl` as an uninterrupted run, bit for bit; a crash during a save leaves the
//! previous checkpoint as the one resumed; a changed model is refused.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The quickstart, short, with training metrics, an eval and a checkpoint every 20 steps, and
/// managed collisions on one table.
fn settings(world: usize, out: &Path) -> Vec<String> {
    [
        "train.steps=60",
        "train.eval_every=20",
        "train.log_every=10",
        "train.metrics_every=10",
        "train.metrics_window=3000",
        "train.checkpoint_every=20",
        "data.sampler.eval_samples=2048",
        "data.batch_size=128",
        "data.eval_batch_size=1024",
        "run.threads=1",
        "train.progress=false",
        "tables[0].mc={zch_size=900,input_hash_size=100000,eviction_interval=7}",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("topology.world_size={world}"), format!("run.output_dir=\"{}\"", out.display())])
    .collect()
}

/// Runs the binary; returns its exit status (None: killed by a signal) and stderr.
fn trainrec(args: &[String], failpoint: Option<&str>) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainrec"));
    cmd.args(args).current_dir(workspace()).env_remove("RUST_LOG").env("OMP_NUM_THREADS", "1");
    match failpoint {
        Some(f) => cmd.env("TRAINREC_FAILPOINT", f),
        None => cmd.env_remove("TRAINREC_FAILPOINT"),
    };
    let out = cmd.output().expect("the binary runs");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into())
}

fn run(world: usize, out: &Path, failpoint: Option<&str>) -> (Option<i32>, String) {
    run_with(world, out, failpoint, &[])
}

/// [`run`] with more `--set` overrides.
fn run_with(world: usize, out: &Path, failpoint: Option<&str>, extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec!["run".to_string(), "recipes/quickstart.toml".into()];
    for s in settings(world, out).into_iter().chain(extra.iter().map(|s| s.to_string())) {
        args.extend(["--set".to_string(), s]);
    }
    trainrec(&args, failpoint)
}

fn resume(out: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec!["run".to_string(), "--resume".into(), out.display().to_string()];
    for s in extra {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    trainrec(&args, None)
}

/// `metrics.jsonl` without the wall-clock throughput values (which no two runs share).
fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["metrics"].as_object_mut().unwrap().retain(|k, _| !k.contains("throughput"));
            v
        })
        .collect()
}

fn checkpoints(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_killed_run_resumes_bit_for_bit_on_one_and_two_ranks() {
    for world in [1, 2] {
        let through = out_dir(&format!("through-{world}"));
        let (code, err) = run(world, &through, None);
        assert_eq!(code, Some(0), "{err}");
        let want = metrics(&through);
        assert!(want.len() == 9 && want.iter().any(|l| l["metrics"].get("window_auc").is_some()));
        assert!(want.iter().any(|l| l["metrics"].get("mc/t_C1/collision_rate").is_some()));

        // Killed after step 50 (checkpoints at 20 and 40), then resumed from step 40.
        let killed = out_dir(&format!("killed-{world}"));
        let (code, _) = run(world, &killed, Some("abort-after-step:50"));
        assert_ne!(code, Some(0), "the run was to abort");
        assert_eq!(checkpoints(&killed), ["step-00000020", "step-00000040"]);
        assert!(metrics(&killed).iter().any(|l| l["step"] == 50), "lines past the checkpoint were written");
        let (code, err) = resume(&killed, &[]);
        assert_eq!(code, Some(0), "{err}");
        assert!(err.contains("step-00000040 (step 40)"), "{err}");
        assert_eq!(metrics(&killed), want, "{world} ranks: the resumed run's metrics differ");
        // The third checkpoint (step 60) was saved; all three are kept (keep_checkpoints = 3).
        assert_eq!(checkpoints(&killed), ["step-00000020", "step-00000040", "step-00000060"]);
    }
}

/// A job with managed collisions on the prefetch pipeline (batch i+1's ids remapped while
/// step i trains): the same metrics as `base`, and a run killed with a batch staged ahead
/// resumes to them bit for bit (nothing is staged before a checkpoint or an evaluation).
#[test]
fn a_pipelined_run_with_managed_collisions_resumes_bit_for_bit() {
    let piped = ["pipeline.kind=\"prefetch_sparse_dist\""];
    for world in [1, 2] {
        let base = out_dir(&format!("mc-base-{world}"));
        assert_eq!(run_with(world, &base, None, &[]).0, Some(0));
        let through = out_dir(&format!("mc-piped-{world}"));
        let (code, err) = run_with(world, &through, None, &piped);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(metrics(&through), metrics(&base), "{world} ranks: the pipelined run trains as base");
        let killed = out_dir(&format!("mc-piped-killed-{world}"));
        assert_ne!(run_with(world, &killed, Some("abort-after-step:50"), &piped).0, Some(0));
        let (code, err) = resume(&killed, &[]);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(metrics(&killed), metrics(&through), "{world} ranks: the resumed pipelined run differs");
        for d in [base, through, killed] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Learning-rate schedules are a function of the run's step: a run resumed from step 40
/// trains at the uninterrupted run's rates (and so writes its metrics), and the rates the
/// `train` lines report are the schedules' (`lr × multiplier` of the line's last update).
/// Dense gradient clipping (norm) is on too, and changes the training.
#[test]
fn a_scheduled_run_resumes_at_its_rates() {
    let schedules = [
        "optimizer.dense_schedule=[{policy=\"linear\",max_iters=30,value=0.1},{policy=\"step\",max_iters=200,value=0.5,decay_iters=20}]",
        "optimizer.sparse_schedule=[{policy=\"constant\",max_iters=25,value=0.5},{policy=\"cosine_annealing_warm_restarts\",max_iters=55,value=0.1,sgdr_period=12}]",
        "optimizer.dense_clipping={kind=\"norm\",max_gradient=0.05}",
    ];
    let through = out_dir("sched-through");
    let (code, err) = run_with(1, &through, None, &schedules);
    assert_eq!(code, Some(0), "{err}");
    let want = metrics(&through);
    // The line of step 30 reports update 29's rates: dense 0.002 (the quickstart's Adam lr) x
    // (0.1 + 0.9 x 29 / 30); sparse 0.05 x (0.1 + 0.9 x (1 + cos(pi x (29 mod 12) / 12)) / 2).
    let line = want.iter().find(|l| l["step"] == 30 && l["split"] == "train").expect("a train line at step 30");
    let dense = 0.002 * (0.1 + 0.9 * 29.0 / 30.0);
    let sparse = (0.05f32 as f64 * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * 5.0 / 12.0).cos()))) as f32;
    assert_eq!(line["metrics"]["lr_dense"].as_f64(), Some(dense), "{line}");
    assert_eq!(line["metrics"]["lr_sparse"].as_f64(), Some(sparse as f64), "{line}");

    // Clipping changes what is learnt: without it the losses differ.
    let unclipped = out_dir("sched-unclipped");
    let (code, err) = run_with(1, &unclipped, None, &schedules[..2]);
    assert_eq!(code, Some(0), "{err}");
    assert_ne!(metrics(&unclipped), want, "clipping at norm 0.05 left the training as it was");

    let killed = out_dir("sched-killed");
    let (code, _) = run_with(1, &killed, Some("abort-after-step:50"), &schedules);
    assert_ne!(code, Some(0), "the run was to abort");
    let (code, err) = resume(&killed, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(metrics(&killed), want, "the resumed run's metrics (and rates) differ");
}

#[test]
fn a_crash_during_a_save_resumes_from_the_previous_checkpoint() {
    let through = out_dir("save-through");
    assert_eq!(run(1, &through, None).0, Some(0));
    let crashed = out_dir("save-crashed");
    let (code, _) = run(1, &crashed, Some("checkpoint-before-manifest:40"));
    assert_ne!(code, Some(0));
    // The interrupted save left its files in a hidden directory without a manifest.
    assert_eq!(checkpoints(&crashed), [".step-00000040.partial", "step-00000020"]);
    let (code, err) = resume(&crashed, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("ignoring an incomplete checkpoint") && err.contains(".step-00000040.partial"), "{err}");
    assert!(err.contains("step-00000020 (step 20)"), "{err}");
    assert_eq!(metrics(&crashed), metrics(&through));
    // The next save cleaned the partial directory away.
    assert!(!checkpoints(&crashed).iter().any(|n| n.ends_with(".partial")));
}

#[test]
fn resuming_refuses_another_model_and_a_corrupted_checkpoint() {
    let out = out_dir("refuse");
    assert_eq!(run(1, &out, None).0, Some(0));
    let (code, err) = resume(&out, &["tables[1].rows=500"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("tables[1].rows: 1000 -> 500") && err.contains("only these keys may change"), "{err}");
    // Training longer is allowed.
    let (code, err) = resume(&out, &["train.steps=70"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(metrics(&out).iter().rfind(|l| l["split"] == "eval").unwrap()["step"], 70);
    // Export: one unsharded file with TorchRec's EBC names, written whole.
    let model = out.join("model.safetensors");
    let (code, err) =
        trainrec(&["export".into(), out.display().to_string(), "--out".into(), model.display().to_string()], None);
    assert_eq!(code, Some(0), "{err}");
    let bytes = std::fs::read(&model).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header["embedding_bags.t_C2.weight"]["shape"], serde_json::json!([1000, 16]));
    // One raw id per row (-1 in the 100 residual rows past zch_size = 900, and in empty slots).
    assert_eq!(header["managed_collisions.t_C1.ids"]["shape"], serde_json::json!([1000]));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<i64> = st
        .tensor("managed_collisions.t_C1.ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(ids[900..].iter().all(|&id| id == -1) && ids[..900].iter().any(|&id| id >= 0));
    // The newest checkpoint: the resumed run's final one, at step 70.
    assert_eq!(header["__metadata__"]["step"], "70");
    assert!(!out.join("model.tmp").exists());
    let (code, err) = trainrec(
        &[
            "export".into(),
            out.display().to_string(),
            "--out".into(),
            model.display().to_string(),
            "--step".into(),
            "7".into(),
        ],
        None,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no complete checkpoint of step 7"), "{err}");
    // A flipped byte in a rank file is caught by its checksum, naming the file.
    let newest = out.join("checkpoints").join(checkpoints(&out).last().unwrap());
    let file = newest.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let (code, err) = resume(&out, &["train.steps=80"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("rank-00000.safetensors") && err.contains("checksum"), "{err}");
    // A run directory without checkpoints is a usage error.
    let empty = out_dir("refuse-empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (code, err) = resume(&empty, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no complete checkpoint"), "{err}");
}

/// The export loads into TorchRec's `EmbeddingBagCollection` (strict state dict) and its forward
/// pass pools the exported rows: `tests/python/load_export.py`, run by the TorchRec anchors'
/// Python (`../shared/bench/anchors/install.sh` plus `pip install safetensors`) when it is
/// installed.
#[test]
fn the_export_loads_into_a_torchrec_ebc() {
    let python = std::env::var("TRAINREC_TORCHREC_PYTHON").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/trainrec-anchors/venv/bin/python")
    });
    if !python.exists() {
        eprintln!("skipping: no TorchRec Python at {} (set TRAINREC_TORCHREC_PYTHON)", python.display());
        return;
    }
    // The anchors' install.sh does not install safetensors: a venv made by it alone is not
    // the checker's Python.
    let probe = Command::new(&python).args(["-c", "import torchrec, safetensors"]).output().expect("python runs");
    if !probe.status.success() {
        eprintln!(
            "skipping: {} cannot import torchrec and safetensors (pip install safetensors there): {}",
            python.display(),
            String::from_utf8_lossy(&probe.stderr).lines().last().unwrap_or("")
        );
        return;
    }
    let out = out_dir("export-torchrec");
    assert_eq!(run(1, &out, None).0, Some(0));
    let model = out.join("model.safetensors");
    let (code, err) =
        trainrec(&["export".into(), out.display().to_string(), "--out".into(), model.display().to_string()], None);
    assert_eq!(code, Some(0), "{err}");
    let check = Command::new(&python)
        .arg(workspace().join("tests/python/load_export.py"))
        .arg(&model)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&check.stderr));
    assert!(stdout.contains("8 tables loaded into torchrec.EmbeddingBagCollection"), "{stdout}");
}

#[test]
fn eval_scores_a_checkpoint_in_fp32_and_quantized() {
    let out = out_dir("eval");
    assert_eq!(run(2, &out, None).0, Some(0));
    let last_eval = metrics(&out).into_iter().rfind(|l| l["split"] == "eval").unwrap();
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval".to_string(), out.display().to_string(), "--json".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let (code, err) = trainrec(&args, None);
        (code, err, args)
    };
    // The run trained on 2 ranks; eval loads its step-60 checkpoint on one process.
    let mut args = vec!["eval".to_string(), out.display().to_string(), "--json".into()];
    let got = Command::new(env!("CARGO_BIN_EXE_trainrec")).args(&args).current_dir(workspace()).output().unwrap();
    assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
    let line: serde_json::Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(line["step"], 60);
    for (k, v) in last_eval["metrics"].as_object().unwrap() {
        let (a, b) = (line["metrics"][k].as_f64().unwrap(), v.as_f64().unwrap());
        // Pooled on one rank instead of two: equal up to fp32 rounding.
        assert!((a - b).abs() < 1e-6, "{k}: {a} vs {b}");
    }
    args.extend(["--quantize".into(), "int8".into()]);
    let got = Command::new(env!("CARGO_BIN_EXE_trainrec")).args(&args).current_dir(workspace()).output().unwrap();
    let q: serde_json::Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(q["quantize"], "int8");
    let (a, b) = (q["metrics"]["auc"].as_f64().unwrap(), line["metrics"]["auc"].as_f64().unwrap());
    assert!((a - b).abs() < 0.01, "int8 auc {a} vs fp32 {b}");
    // The int8 tables score differently (the ranking, and so the AUC, may survive unchanged).
    let differs = line["metrics"].as_object().unwrap().iter().any(|(k, v)| q["metrics"][k] != *v);
    assert!(differs, "int8 metrics {} equal fp32 {}", q["metrics"], line["metrics"]);
    // The model cannot change; a missing step is named.
    let (code, err, _) = eval(&["--set", "model.over_arch=[32,1]"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("model.over_arch"), "{err}");
    let (code, err, _) = eval(&["--step", "5"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no complete checkpoint of step 5"), "{err}");
}

/// A Criteo TSV file of 3000 rows (label, 13 counts, 26 hex categories) in a fresh directory;
/// the label follows the first count and category, so training has something to learn.
fn criteo_tsv(name: &str) -> PathBuf {
    let dir = out_dir(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut state = 0x5EED_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = state;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    };
    let mut text = String::new();
    for _ in 0..3000 {
        let counts: Vec<u64> = (0..13).map(|_| next() % 50).collect();
        let cats: Vec<u64> = (0..26).map(|j| next() % (10 + 40 * j)).collect();
        let label = u64::from((counts[0] + cats[0] * 7 + next() % 30) > 60);
        let counts = counts.iter().map(u64::to_string);
        let cats = cats.iter().map(|c| format!("{c:08x}"));
        let fields: Vec<String> = std::iter::once(label.to_string()).chain(counts).chain(cats).collect();
        text.push_str(&fields.join("\t"));
        text.push('\n');
    }
    let path = dir.join("train.txt");
    std::fs::write(&path, text).unwrap();
    path
}

/// A shuffled file-sampler run (`criteo_tsv`, two epochs) killed mid-epoch and resumed writes
/// the uninterrupted run's metrics: on one rank with a shuffle buffer (about 43 batches an
/// epoch: resumed at step 30, in epoch 0), on two with a full shuffle (about 22 batches a rank
/// and epoch: resumed at step 30, in epoch 1). The shuffle changes the training.
#[test]
fn a_shuffled_file_run_resumes_mid_epoch_bit_for_bit() {
    let tsv = criteo_tsv("shuffle-data");
    let run_tsv = |world: usize, out: &Path, failpoint: Option<&str>, shuffle: &str| {
        let mut args = vec!["run".to_string(), "recipes/criteo/kaggle_sample.toml".into()];
        let sets = [
            format!("data.sampler.path=\"{}\"", tsv.display()),
            format!("data.shuffle={shuffle}"),
            format!("topology.world_size={world}"),
            format!("run.output_dir=\"{}\"", out.display()),
            "train.epochs=2".into(),
            "train.checkpoint_every=15".into(),
            "train.eval_every=15".into(),
            "train.log_every=5".into(),
            "data.batch_size=64".into(),
            "run.threads=1".into(),
            "train.progress=false".into(),
        ];
        for s in sets {
            args.extend(["--set".to_string(), s]);
        }
        trainrec(&args, failpoint)
    };
    for (world, shuffle, abort, resumed) in [
        (1, "{kind=\"buffer\",rows=500}", "abort-after-step:40", "step-00000030 (step 30)"),
        (2, "{kind=\"full\"}", "abort-after-step:35", "step-00000030 (step 30)"),
    ] {
        let through = out_dir(&format!("shuffle-through-{world}"));
        let (code, err) = run_tsv(world, &through, None, shuffle);
        assert_eq!(code, Some(0), "{err}");
        let want = metrics(&through);
        assert!(want.iter().any(|l| l["split"] == "eval"), "{want:?}");

        if world == 1 {
            let plain = out_dir("shuffle-plain");
            let (code, err) = run_tsv(world, &plain, None, "{kind=\"none\"}");
            assert_eq!(code, Some(0), "{err}");
            assert_ne!(metrics(&plain), want, "the shuffle left the training as it was");
        }

        let killed = out_dir(&format!("shuffle-killed-{world}"));
        let (code, _) = run_tsv(world, &killed, Some(abort), shuffle);
        assert_ne!(code, Some(0), "the run was to abort");
        let (code, err) = resume(&killed, &[]);
        assert_eq!(code, Some(0), "{err}");
        assert!(err.contains(resumed), "{err}");
        assert_eq!(metrics(&killed), want, "{world} ranks, shuffle {shuffle}: the resumed run's metrics differ");
    }
}

/// Every run leaves its trained model: a checkpoint at its last step (by steps or by epochs),
/// besides `checkpoint_every`'s, unless `train.final_checkpoint = false`; `eval` scores it.
#[test]
fn every_run_ends_with_a_checkpoint_of_its_last_step() {
    let out = out_dir("final");
    // 50 steps, checkpoints every 20: steps 20, 40, and the final 50.
    assert_eq!(run_with(1, &out, None, &["train.steps=50"]).0, Some(0));
    assert_eq!(checkpoints(&out), ["step-00000020", "step-00000040", "step-00000050"]);
    let last_eval = metrics(&out).into_iter().rfind(|l| l["split"] == "eval").unwrap();
    let got = Command::new(env!("CARGO_BIN_EXE_trainrec"))
        .args(["eval", &out.display().to_string(), "--json"])
        .current_dir(workspace())
        .output()
        .unwrap();
    assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
    let line: serde_json::Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(line["step"], 50);
    assert_eq!(line["metrics"]["auc"], last_eval["metrics"]["auc"], "the final checkpoint is the trained model");
    // Turned off: only checkpoint_every's.
    let off = out_dir("final-off");
    assert_eq!(run_with(1, &off, None, &["train.steps=50", "train.final_checkpoint=false"]).0, Some(0));
    assert_eq!(checkpoints(&off), ["step-00000020", "step-00000040"]);
    // The quickstart by epochs, without checkpoint_every: one checkpoint, at the last step.
    let epochs = out_dir("final-epochs");
    std::fs::create_dir_all(&epochs).unwrap();
    let quickstart = std::fs::read_to_string(workspace().join("recipes/quickstart.toml")).unwrap();
    assert!(quickstart.contains("\nsteps = 1500\n"));
    let recipe = epochs.join("by_epochs.toml");
    std::fs::write(&recipe, quickstart.replace("\nsteps = 1500\n", "\nepochs = 1\n")).unwrap();
    let mut args = vec!["run".to_string(), recipe.display().to_string()];
    for s in [
        "data.sampler.train_samples=1000".to_string(),
        "data.batch_size=128".into(),
        "data.sampler.eval_samples=1024".into(),
        "train.progress=false".into(),
        format!("run.output_dir=\"{}\"", epochs.join("run").display()),
    ] {
        args.extend(["--set".to_string(), s]);
    }
    let (code, err) = trainrec(&args, None);
    assert_eq!(code, Some(0), "{err}");
    let epochs = epochs.join("run");
    assert_eq!(checkpoints(&epochs), ["step-00000008"], "1000 samples in batches of 128: 8 steps");
    for d in [out, off, epochs.parent().unwrap().to_path_buf()] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A checkpoint write that fails (a full disk) stops the run with the cause and leaves no
/// partial directory behind; the checkpoints before it stay, and the run resumes from them.
#[test]
fn a_failed_checkpoint_write_leaves_nothing_behind() {
    for world in [1, 2] {
        let out = out_dir(&format!("write-fails-{world}"));
        let (code, err) = run(world, &out, Some("checkpoint-write-fails:40"));
        assert_ne!(code, Some(0), "the run reports the failed save");
        assert!(err.contains("no space left on device"), "{err}");
        assert_eq!(checkpoints(&out), ["step-00000020"], "world {world}");
        let (code, err) = resume(&out, &[]);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(checkpoints(&out), ["step-00000020", "step-00000040", "step-00000060"], "world {world}");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// One writer per run directory: a second run into a directory a run is writing is refused
/// with exit 2, naming the holder; once the holder is killed (`kill -9`), its lock is gone and
/// the directory can be resumed.
/// `trainrec run` of the quickstart on `world` ranks into `out` for a million steps (it runs
/// until stopped), started in the background with `failpoint` set and stderr going to
/// `stderr`; returned with its arguments once it has written its step-20 checkpoint (it holds
/// the run directory's lock by then).
fn endless_run(
    world: usize,
    out: &Path,
    failpoint: Option<&str>,
    stderr: std::process::Stdio,
) -> (Vec<String>, std::process::Child) {
    endless_run_with(world, out, failpoint, stderr, &[])
}

/// [`endless_run`] with more `--set` overrides.
fn endless_run_with(
    world: usize,
    out: &Path,
    failpoint: Option<&str>,
    stderr: std::process::Stdio,
    extra: &[&str],
) -> (Vec<String>, std::process::Child) {
    let mut args = vec!["run".to_string(), "recipes/quickstart.toml".into()];
    let more = extra.iter().map(|s| s.to_string());
    for s in settings(world, out).into_iter().chain(["train.steps=1000000".to_string()]).chain(more) {
        args.extend(["--set".to_string(), s]);
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainrec"));
    cmd.args(&args)
        .current_dir(workspace())
        .env("OMP_NUM_THREADS", "1")
        .stdout(std::process::Stdio::null())
        .stderr(stderr);
    if let Some(f) = failpoint {
        cmd.env("TRAINREC_FAILPOINT", f);
    }
    let child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !out.join("checkpoints").join("step-00000020").exists() {
        assert!(std::time::Instant::now() < deadline, "the run never checkpointed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    (args, child)
}

#[test]
fn a_second_writer_is_refused_and_a_killed_holder_never_blocks() {
    let out = out_dir("lock");
    // The holder has the lock once it writes its first checkpoint (step 20).
    let (args, mut first) = endless_run(1, &out, None, std::process::Stdio::null());
    let (code, err) = trainrec(&args, None);
    assert_eq!(code, Some(2), "{err}");
    let pid = first.id();
    assert!(
        err.contains("is in use by") && err.contains(&format!("pid {pid} on ")) && err.contains("(trainrec run)"),
        "{err}"
    );
    let (code, err) = resume(&out, &[]);
    assert_eq!(code, Some(2), "--resume is refused too: {err}");
    // Readers (eval, export, predict) wait for the writer too: their shared lock is refused.
    let dir = out.to_str().unwrap().to_string();
    let model = out.with_extension("pt");
    for reader in [
        vec!["eval".to_string(), dir.clone()],
        vec!["export".into(), dir.clone(), "--out".into(), model.to_str().unwrap().into()],
        vec!["predict".into(), dir.clone(), "--out".into(), out.with_extension("csv").to_str().unwrap().into()],
    ] {
        let (code, err) = trainrec(&reader, None);
        assert_eq!(code, Some(2), "{reader:?}: {err}");
        assert!(err.contains(&format!("pid {pid} on ")), "{reader:?}: {err}");
    }
    assert!(!model.exists());
    first.kill().unwrap();
    first.wait().unwrap();
    let last: u64 =
        checkpoints(&out).iter().filter_map(|n| n.strip_prefix("step-").and_then(|s| s.parse().ok())).max().unwrap();
    let (code, err) = resume(&out, &[&format!("train.steps={}", last + 10)]);
    assert_eq!(code, Some(0), "a killed holder's lock is gone: {err}");
    std::fs::remove_dir_all(&out).unwrap();
}

/// SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) end a run gracefully: it finishes
/// the step, saves a checkpoint of it and exits 143 / 130 saying how to resume; the resumed run
/// writes the uninterrupted run's metrics, on one rank and on two.
#[test]
fn a_signal_stops_after_the_step_with_a_checkpoint_and_resumes_exactly() {
    // The third: a pipelined run, whose managed collisions may have counted the batch staged
    // ahead when the signal comes; it then stops after that batch's step.
    for (world, signal, code, piped) in [(1, "-TERM", 143, false), (2, "-INT", 130, false), (1, "-TERM", 143, true)] {
        let extra: &[&str] = if piped { &["pipeline.kind=\"prefetch_sparse_dist\""] } else { &[] };
        let out = out_dir(&format!("signal-{world}-{piped}"));
        let (_, child) = endless_run_with(world, &out, None, std::process::Stdio::piped(), extra);
        let killed = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        let done = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&done.stderr);
        assert_eq!(done.status.code(), Some(code), "{err}");
        assert!(err.contains("the checkpoint is saved: resume with `trainrec run --resume"), "{err}");
        let stopped: u64 = checkpoints(&out)
            .iter()
            .filter_map(|n| n.strip_prefix("step-").and_then(|s| s.parse().ok()))
            .max()
            .unwrap();
        assert!(err.contains(&format!("after step {stopped};")), "the checkpoint is the last step: {err}");
        assert!(!checkpoints(&out).iter().any(|n| n.ends_with(".partial")));
        // Resumed to 30 steps past the stop, it writes what a run of that length writes.
        let steps = format!("train.steps={}", stopped + 30);
        let (code, err) = resume(&out, &[&steps]);
        assert_eq!(code, Some(0), "{err}");
        let through = out_dir(&format!("signal-through-{world}-{piped}"));
        let mut over = vec![steps.as_str()];
        over.extend(extra);
        assert_eq!(run_with(world, &through, None, &over).0, Some(0));
        assert_eq!(metrics(&out), metrics(&through), "world {world}, stopped after step {stopped}");
        for d in [out, through] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}

/// A second signal while the first one's stop is under way (held by a failpoint as a slow save
/// would hold it) exits at once: 143, no stop checkpoint, no "saved" message.
#[test]
fn a_second_signal_exits_at_once() {
    let out = out_dir("second-signal");
    let (_, child) = endless_run(1, &out, Some("stop-hold-ms:60000"), std::process::Stdio::piped());
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    // The first signal's stop is now held for a minute before its save.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(143), "{err}");
    assert!(!err.contains("the checkpoint is saved"), "{err}");
    // Only the periodic checkpoints (every 20 steps): the stop's own was never written.
    for name in checkpoints(&out) {
        let step: u64 = name.strip_prefix("step-").and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(step % 20, 0, "{name}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// The tensors of an exported file, by name, as bytes (metadata aside).
fn export_tensors(path: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect()
}

/// A key-value table's checkpoint holds only the rows written (a sparse block: a table of a
/// million rows saves the few thousand a short run touches), resumes bit for bit, and exports
/// to the same file as the same run with the table in memory.
#[test]
fn a_key_value_table_checkpoints_only_its_written_rows() {
    let big = ["tables[1].rows=1000000"];
    let kv = [big[0], "tables[1].constraints={compute_kernels=[\"key_value\"],cache={load_factor=0.002}}"];
    let in_memory = out_dir("kv-in-memory");
    assert_eq!(run_with(1, &in_memory, None, &big).0, Some(0));
    let through = out_dir("kv-through");
    let (code, err) = run_with(1, &through, None, &kv);
    assert_eq!(code, Some(0), "{err}");
    let model_metrics = |dir: &Path| {
        let mut m = metrics(dir);
        for l in &mut m {
            l["metrics"].as_object_mut().unwrap().retain(|k, _| !k.starts_with("cache/"));
        }
        m
    };
    assert_eq!(
        model_metrics(&through),
        model_metrics(&in_memory),
        "the key-value table trains like the table in memory"
    );

    // The checkpoint: a sparse block of the rows written, in a file a fraction of the dense one.
    let manifest = |dir: &Path| -> serde_json::Value {
        let text = std::fs::read(dir.join("checkpoints/step-00000060/manifest.json")).unwrap();
        serde_json::from_slice(&text).unwrap()
    };
    let shard = |m: &serde_json::Value| m["shards"].as_array().unwrap().iter().find(|s| s["table"] == "t_C2").cloned();
    let sparse = shard(&manifest(&through)).unwrap();
    let rows_tensor = sparse["stored_rows"].as_str().expect("a sparse block").to_string();
    let stored = manifest(&through)["tensors"][&rows_tensor]["shape"][0].as_u64().unwrap();
    assert!(stored > 100 && stored <= 60 * 128, "{stored} rows stored");
    assert!(shard(&manifest(&in_memory)).unwrap().get("stored_rows").is_none());
    let size =
        |dir: &Path| std::fs::metadata(dir.join("checkpoints/step-00000060/rank-00000.safetensors")).unwrap().len();
    assert!(size(&through) * 10 < size(&in_memory), "{} vs {} bytes", size(&through), size(&in_memory));

    // Killed after step 50, resumed from the sparse checkpoint of step 40.
    let killed = out_dir("kv-killed");
    assert_ne!(run_with(1, &killed, Some("abort-after-step:50"), &kv).0, Some(0));
    let (code, err) = resume(&killed, &[]);
    assert_eq!(code, Some(0), "{err}");
    // (The cache starts cold on resume: its counters are its own.)
    assert_eq!(model_metrics(&killed), model_metrics(&through), "the resumed key-value run's metrics differ");

    // Exported, the sparse block reads as the whole table: rows never written hold their
    // initial weights, exactly as the in-memory run's file has them.
    let export = |dir: &Path| {
        let model = dir.join("model.safetensors");
        let (code, err) =
            trainrec(&["export".into(), dir.display().to_string(), "--out".into(), model.display().to_string()], None);
        assert_eq!(code, Some(0), "{err}");
        export_tensors(&model)
    };
    let (a, b) = (export(&through), export(&in_memory));
    assert_eq!(a.len(), b.len());
    for (name, t) in &b {
        assert!(a.get(name) == Some(t), "exported tensor {name} differs");
    }
    assert_eq!(a["embedding_bags.t_C2.weight"].0, [1_000_000, 16]);
    for d in [in_memory, through, killed] {
        let _ = std::fs::remove_dir_all(d);
    }
}
