//! A TorchScript file written by `trainrec export --format torchscript`, run through libtorch
//! alone (`tch::CModule`, no trainrec crate), gives the logits `trainrec predict` writes for the
//! same examples: within 1e-5 for fp32 tables, and with int8 tables an AUC within 0.002 of the
//! fp32 model's. Every built-in model, a managed-collision model (raw ids remapped inside the
//! file, untracked ids to their fallback rows) and a two-task model.
//!
//! The `trainrec` binary comes from the workspace's target directory (the test suite builds it
//! before running tests); `TRAINREC_BIN` names another.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{IValue, Kind, Tensor};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

fn trainrec() -> PathBuf {
    if let Ok(p) = std::env::var("TRAINREC_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| workspace().join("target"));
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let bin = target.join(profile).join("trainrec");
    assert!(bin.is_file(), "{} is missing: build it first (cargo build -p trainrec)", bin.display());
    bin
}

fn run(args: &[&str]) -> String {
    let out = Command::new(trainrec()).args(args).current_dir(workspace()).output().expect("trainrec starts");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "trainrec {} failed:\n{text}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trainrec-serving-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `trainrec predict --with-inputs` CSV: the header and each row's cells by name.
struct Predictions {
    rows: Vec<HashMap<String, String>>,
}

impl Predictions {
    fn read(path: &Path) -> Self {
        let text = std::fs::read_to_string(path).unwrap();
        let mut lines = text.lines();
        let header: Vec<String> = lines.next().expect("a header").split(',').map(str::to_string).collect();
        let rows = lines.map(|l| header.iter().cloned().zip(l.split(',').map(str::to_string)).collect()).collect();
        Self { rows }
    }
    fn floats(&self, i: usize, col: &str) -> Vec<f32> {
        self.rows[i][col].split_whitespace().map(|v| v.parse().unwrap()).collect()
    }
    fn ids(&self, i: usize, col: &str) -> Vec<i64> {
        self.rows[i][col].split_whitespace().map(|v| v.parse().unwrap()).collect()
    }
    fn value(&self, i: usize, col: &str) -> f64 {
        self.rows[i][col].parse().unwrap()
    }
    /// The feature names, from the `ids_<feature>` columns (in the file's order).
    fn features(&self, header: &[String]) -> Vec<String> {
        header.iter().filter_map(|c| c.strip_prefix("ids_").map(str::to_string)).collect()
    }
}

fn header(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap().lines().next().unwrap().split(',').map(str::to_string).collect()
}

/// The model's inputs for rows `range` of `p`.
fn inputs(p: &Predictions, features: &[String], range: std::ops::Range<usize>) -> (Tensor, Vec<Tensor>, Vec<Tensor>) {
    let n = range.len() as i64;
    let dense: Vec<f32> = range.clone().flat_map(|i| p.floats(i, "dense")).collect();
    let width = dense.len() as i64 / n.max(1);
    let dense = Tensor::from_slice(&dense).view([n, width]);
    let (mut ids, mut lengths) = (Vec::new(), Vec::new());
    for f in features {
        let col = format!("ids_{f}");
        let bags: Vec<Vec<i64>> = range.clone().map(|i| p.ids(i, &col)).collect();
        ids.push(Tensor::from_slice(&bags.concat()));
        lengths.push(Tensor::from_slice(&bags.iter().map(|b| b.len() as i64).collect::<Vec<_>>()));
    }
    (dense, ids, lengths)
}

fn call(m: &tch::CModule, method: &str, args: Vec<IValue>) -> Tensor {
    match m.method_is(method, &args).unwrap_or_else(|e| panic!("{method}: {e}")) {
        IValue::Tensor(t) => t,
        other => panic!("{method} returned {other:?}"),
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).contiguous().view([-1])).unwrap()
}

/// AUC of `scores` against `labels` (> 0.5 positive), ties as half.
fn auc(scores: &[f32], labels: &[f64]) -> f64 {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut pos) = (0.0, 0.0);
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j < idx.len() && scores[idx[j]] == scores[idx[i]] {
            j += 1;
        }
        let avg = (i + j + 1) as f64 / 2.0;
        for &k in &idx[i..j] {
            if labels[k] > 0.5 {
                rank_sum += avg;
                pos += 1.0;
            }
        }
        i = j;
    }
    let neg = scores.len() as f64 - pos;
    (rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg)
}

/// Trains `recipe` briefly, exports it, predicts with inputs; returns the run directory, the
/// fp32 file and the predictions' path.
fn trained(name: &str, recipe: &str, sets: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    let dir = scratch(name);
    let run_dir = dir.join("run");
    let mut args = vec!["run", recipe, "--set"];
    let out = format!("run.output_dir=\"{}\"", run_dir.display());
    args.push(&out);
    for s in sets {
        args.extend(["--set", s]);
    }
    run(&args);
    let model = dir.join("model.pt");
    let text = run(&["export", run_dir.to_str().unwrap(), "--out", model.to_str().unwrap()]);
    assert!(text.contains("as TorchScript"), "{text}");
    let preds = dir.join("p.csv");
    run(&["predict", run_dir.to_str().unwrap(), "--out", preds.to_str().unwrap(), "--with-inputs"]);
    (run_dir, model, preds)
}

/// The file's logits on every predicted example equal `trainrec predict`'s within 1e-5;
/// `forward` is their sigmoid and `forward_kjt` takes the same examples as one KJT.
fn check_fp32(model: &Path, preds: &Path) -> Predictions {
    let h = header(preds);
    let p = Predictions::read(preds);
    let features = p.features(&h);
    let tasks: Vec<String> = h.iter().filter_map(|c| c.strip_prefix("logit_").map(str::to_string)).collect();
    assert!(!p.rows.is_empty() && !tasks.is_empty());
    let m = tch::CModule::load(model).unwrap();
    let mut worst = 0f64;
    let mut start = 0;
    while start < p.rows.len() {
        let range = start..(start + 333).min(p.rows.len());
        let (dense, ids, lengths) = inputs(&p, &features, range.clone());
        let args = || {
            vec![
                IValue::Tensor(dense.shallow_clone()),
                IValue::TensorList(ids.iter().map(Tensor::shallow_clone).collect()),
                IValue::TensorList(lengths.iter().map(Tensor::shallow_clone).collect()),
            ]
        };
        let logits = call(&m, "logits", args());
        assert_eq!(logits.size(), [range.len() as i64, tasks.len() as i64]);
        let got = values(&logits);
        for (r, i) in range.clone().enumerate() {
            for (t, task) in tasks.iter().enumerate() {
                let want = p.value(i, &format!("logit_{task}"));
                worst = worst.max((got[r * tasks.len() + t] as f64 - want).abs());
            }
        }
        let probs = call(&m, "forward", args());
        assert!(values(&(&probs - logits.sigmoid()).abs()).iter().all(|&d| d < 1e-6));
        let kjt = call(
            &m,
            "forward_kjt",
            vec![
                IValue::Tensor(dense.shallow_clone()),
                IValue::Tensor(Tensor::cat(&ids, 0)),
                IValue::Tensor(Tensor::cat(&lengths, 0)),
            ],
        );
        assert!(values(&(&kjt - &probs).abs()).iter().all(|&d| d < 1e-6));
        start = range.end;
    }
    assert!(worst <= 1e-5, "{}: max |logit difference| {worst}", model.display());
    eprintln!("{}: {} examples, max |logit difference| {worst:e}", model.display(), p.rows.len());
    p
}

const SMALL: [&str; 2] = ["data.sampler.eval_samples=1500", "train.steps=40"];

#[test]
fn dlrm_file_gives_predict_logits_and_int8_keeps_the_auc() {
    let (run_dir, model, preds) =
        trained("dlrm", "recipes/quickstart.toml", &["data.sampler.eval_samples=4000", "train.steps=300"]);
    let p = check_fp32(&model, &preds);
    // int8 tables: the AUC within 0.002 of the fp32 model's on the same examples.
    let q = model.with_file_name("model_int8.pt");
    run(&["export", run_dir.to_str().unwrap(), "--out", q.to_str().unwrap(), "--quantize", "int8"]);
    let m = tch::CModule::load(&q).unwrap();
    let h = header(&preds);
    let features = p.features(&h);
    let (dense, ids, lengths) = inputs(&p, &features, 0..p.rows.len());
    let probs = values(&call(&m, "forward", vec![dense.into(), IValue::TensorList(ids), IValue::TensorList(lengths)]));
    let labels: Vec<f64> = (0..p.rows.len()).map(|i| p.value(i, "label_label")).collect();
    let fp32: Vec<f32> = (0..p.rows.len()).map(|i| p.value(i, "label") as f32).collect();
    let (a32, a8) = (auc(&fp32, &labels), auc(&probs, &labels));
    eprintln!("AUC fp32 {a32:.5}, int8 {a8:.5}");
    assert!(a32 > 0.6, "the model learned nothing: AUC {a32}");
    assert!((a32 - a8).abs() <= 0.002, "int8 AUC {a8} vs fp32 {a32}");
    // The file is smaller by the table bytes: int8 rows are dim + 8 bytes, not 4 dim.
    let (b32, b8) = (std::fs::metadata(&model).unwrap().len(), std::fs::metadata(&q).unwrap().len());
    assert!(b8 < b32, "{b8} vs {b32}");
    // The same checks from plain PyTorch, where a Python with torch is found.
    python_check(&run_dir, &model, &[]);
    python_check(&run_dir, &q, &["--quantized"]);
}

/// A Python that imports torch: `TRAINREC_TORCH_PYTHON`, the anchors' venv, or `python3`.
fn torch_python() -> Result<PathBuf, String> {
    let home = std::env::var("HOME").unwrap_or_default();
    let candidates: Vec<PathBuf> = std::env::var("TRAINREC_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([Path::new(&home).join(".cache/trainrec-anchors/venv/bin/python"), PathBuf::from("python3")])
        .collect();
    for py in &candidates {
        let ok = Command::new(py).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success());
        if ok {
            return Ok(py.clone());
        }
    }
    Err(format!("no Python importing torch among {candidates:?} (../shared/bench/anchors/install.sh makes one)"))
}

/// Runs `tests/python/check_torchscript.py` on `model` (it loads the file with
/// `torch.jit.load` and compares with `trainrec predict`); skipped, saying why, without a
/// PyTorch Python.
fn python_check(run_dir: &Path, model: &Path, extra: &[&str]) {
    let py = match torch_python() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipping the PyTorch check of {}: {why}", model.display());
            return;
        }
    };
    let script = workspace().join("tests/python/check_torchscript.py");
    let out = Command::new(&py)
        .arg(&script)
        .args([run_dir.as_os_str(), model.as_os_str()])
        .arg("--trainrec")
        .arg(trainrec())
        .args(extra)
        .current_dir(workspace())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().last().unwrap_or_default();
    assert!(line.contains("\"pass\": true"), "{line}");
    eprintln!("PyTorch check of {}: {line}", model.display());
}

#[test]
fn quantized_files_give_the_quantized_evaluations_logits_with_mean_pooling() {
    // Mean-pooled bags of 1..5 ids: the int8 and fp16 files against `predict --quantize`.
    let (run_dir, _, _) = trained(
        "quantized",
        "recipes/quickstart.toml",
        &[
            "data.sampler.eval_samples=1000",
            "train.steps=40",
            "data.sampler.pooling_factor=3",
            "tables[0].pooling=\"mean\"",
            "tables[3].pooling=\"mean\"",
        ],
    );
    let rd = run_dir.to_str().unwrap();
    for q in ["int8", "fp16"] {
        let model = run_dir.with_file_name(format!("model_{q}.pt"));
        let preds = run_dir.with_file_name(format!("p_{q}.csv"));
        run(&["export", rd, "--out", model.to_str().unwrap(), "--quantize", q]);
        run(&["predict", rd, "--out", preds.to_str().unwrap(), "--with-inputs", "--quantize", q]);
        check_fp32(&model, &preds);
    }
}

#[test]
fn dlrm_dcn_file_gives_predict_logits() {
    let (_, model, preds) = trained("dcn", "recipes/models/dlrm_dcn.toml", &SMALL);
    check_fp32(&model, &preds);
}

#[test]
fn deepfm_file_gives_predict_logits() {
    let (_, model, preds) = trained("deepfm", "recipes/models/deepfm.toml", &SMALL);
    check_fp32(&model, &preds);
}

#[test]
fn two_task_file_gives_predict_logits() {
    let (_, model, preds) = trained("tasks", "recipes/multitask/click_and_like.toml", &SMALL);
    let p = check_fp32(&model, &preds);
    assert!(header(&preds).iter().filter(|c| c.starts_with("logit_")).count() == 2);
    assert!(!p.rows.is_empty());
}

#[test]
fn managed_collision_file_remaps_raw_ids_as_the_evaluation() {
    // Two partitions per table on one rank: tracked ids read their slots, untracked ones the
    // fallback rows of their partition (Zipf ids over 100,000: many are never tracked).
    let (_, model, preds) = trained(
        "mc",
        "recipes/dist/mc_row_wise_2ranks.toml",
        &["topology.world_size=1", "tables[0].mc.partitions=2", "data.sampler.eval_samples=3000", "train.steps=60"],
    );
    check_fp32(&model, &preds);
}

#[test]
fn dynamic_table_file_reads_zeros_for_ids_without_a_row() {
    // Zipf raw ids from 10^12 into 20,000-row tables: the eval split holds ids with a row and
    // ids without one (which add nothing to their bags, as in training).
    let (_, model, preds) = trained(
        "dynamic",
        "recipes/dynamic/quickstart_dynamic.toml",
        &["data.sampler.eval_samples=1500", "train.steps=60", "train.eval_every=60"],
    );
    check_fp32(&model, &preds);
}

#[test]
fn two_tower_file_embeds_queries_and_candidates_apart() {
    let (_, model, preds) = trained("two_tower", "recipes/models/two_tower.toml", &SMALL);
    let p = check_fp32(&model, &preds);
    let m = tch::CModule::load(&model).unwrap();
    let h = header(&preds);
    let features = p.features(&h);
    let (dense, ids, lengths) = inputs(&p, &features, 0..64);
    let args = || {
        vec![
            IValue::Tensor(dense.shallow_clone()),
            IValue::TensorList(ids.iter().map(Tensor::shallow_clone).collect()),
            IValue::TensorList(lengths.iter().map(Tensor::shallow_clone).collect()),
        ]
    };
    let q = call(&m, "query_embeddings", args());
    let c = call(&m, "candidate_embeddings", args().into_iter().skip(1).collect());
    // The recipe's temperature is 0.1: the score is the towers' dot product over it.
    let scores = (&q * &c).sum_dim_intlist(1, false, Kind::Float) / 0.1;
    let logits = call(&m, "logits", args()).view([-1]);
    let err = values(&(scores - logits).abs()).into_iter().fold(0f32, f32::max);
    assert!(err < 1e-4, "{err}");
}
