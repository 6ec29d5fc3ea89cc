//! `trainrec predict` and `trainrec export --format torchscript` from the command line: the
//! three output formats hold the same rows, a TorchScript file scores the data as its run
//! directory does, and bad requests are refused (exit 2) without leaving a file behind.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn trainrec(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_trainrec"))
        .args(args)
        .current_dir(workspace())
        .env("OMP_NUM_THREADS", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("trainrec runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(args: &[&str]) -> String {
    let (code, out, err) = trainrec(args);
    assert_eq!(code, 0, "trainrec {}: {out}\n{err}", args.join(" "));
    out
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trainrec-predict-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Rows of a CSV written by predict: header and cells.
fn csv(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap().split(',').map(String::from).collect();
    (header, lines.map(|l| l.split(',').map(String::from).collect()).collect())
}

/// The `logit_label` column of a Parquet file written by predict.
fn parquet_logits(path: &Path) -> (Vec<String>, Vec<f32>) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let r = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let schema = r.metadata().file_metadata().schema_descr();
    let names: Vec<String> = schema.root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
    let mut logits = Vec::new();
    for row in r.get_row_iter(None).unwrap() {
        let row = row.unwrap();
        for (name, field) in row.get_column_iter() {
            if name == "logit_label" {
                if let parquet::record::Field::Float(v) = field {
                    logits.push(*v);
                }
            }
        }
    }
    (names, logits)
}

#[test]
fn predictions_in_every_format_and_from_the_torchscript_file_agree() {
    let dir = scratch("formats");
    let run_dir = dir.join("run");
    let rd = run_dir.to_str().unwrap();
    ok(&[
        "run",
        "recipes/quickstart.toml",
        "--set",
        &format!("run.output_dir=\"{rd}\""),
        "--set",
        "train.steps=30",
        "--set",
        "data.sampler.eval_samples=700",
    ]);
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let out = ok(&["predict", rd, "--out", &p("p.csv")]);
    assert_eq!(out.trim(), format!("scored 700 examples of the eval split (1 task) into {}", p("p.csv")));
    ok(&["predict", rd, "--out", &p("p.jsonl")]);
    ok(&["predict", rd, "--out", &p("p.parquet"), "--with-inputs"]);
    let (header, rows) = csv(Path::new(&p("p.csv")));
    assert_eq!(header, ["row", "label_label", "label", "logit_label"]);
    assert_eq!(rows.len(), 700);
    assert!(rows.iter().enumerate().all(|(i, r)| r[0] == i.to_string()));
    let csv_logits: Vec<f32> = rows.iter().map(|r| r[3].parse().unwrap()).collect();
    // Probabilities are the logits' sigmoid.
    for r in &rows {
        let (prob, logit): (f64, f64) = (r[2].parse().unwrap(), r[3].parse().unwrap());
        assert!((prob - 1.0 / (1.0 + (-logit).exp())).abs() < 1e-6);
    }
    let jsonl: Vec<f32> = std::fs::read_to_string(p("p.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v = l.split("\"logit_label\":").nth(1).unwrap();
            v.split([',', '}']).next().unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(jsonl, csv_logits);
    let (names, parquet) = parquet_logits(Path::new(&p("p.parquet")));
    assert_eq!(parquet, csv_logits);
    assert!(names.contains(&"dense".to_string()) && names.contains(&"ids_C8".to_string()), "{names:?}");
    // The exported file scores the same examples alike, through libtorch.
    let text = ok(&["export", rd, "--out", &p("model.pt")]);
    assert!(text.starts_with("exported step 30 as TorchScript (8 tables, 8 features, tasks label"), "{text}");
    ok(&["predict", &p("model.pt"), "--out", &p("m.csv")]);
    let (_, m) = csv(Path::new(&p("m.csv")));
    let worst = m.iter().zip(&csv_logits).map(|(r, &l)| (r[3].parse::<f32>().unwrap() - l).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-5, "{worst}");
    // Another data source through --set: a larger eval split.
    let out = ok(&["predict", &p("model.pt"), "--out", &p("m2.csv"), "--set", "data.sampler.eval_samples=900"]);
    assert!(out.contains("scored 900 examples"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_requests_are_refused_and_leave_no_file() {
    let dir = scratch("refused");
    let run_dir = dir.join("run");
    let rd = run_dir.to_str().unwrap();
    ok(&["run", "recipes/quickstart.toml", "--set", &format!("run.output_dir=\"{rd}\""), "--set", "train.steps=5"]);
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["predict".into(), rd.into(), "--out".into(), p("p.txt")], "name a .parquet, .csv or .jsonl file"),
        (
            vec!["predict".into(), p("missing"), "--out".into(), p("p.csv")],
            "neither a run directory nor a TorchScript file",
        ),
        (
            vec!["predict".into(), "recipes/quickstart.toml".into(), "--out".into(), p("p.csv")],
            "is not a TorchScript file written by trainrec export",
        ),
        (
            vec![
                "predict".into(),
                rd.into(),
                "--out".into(),
                p("p.csv"),
                "--set".into(),
                "model.dense_arch=[8, 16]".into(),
            ],
            "the recipe differs from the one checkpoint",
        ),
        (
            vec!["export".into(), rd.into(), "--out".into(), p("m.safetensors"), "--quantize".into(), "int8".into()],
            "--quantize int8 applies to --format torchscript",
        ),
        (vec!["export".into(), rd.into(), "--out".into(), p("m.pt"), "--quantize".into(), "int4".into()], "int4"),
    ];
    for (args, message) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = trainrec(&args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
    // Nothing written besides the run directory.
    let left: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(left, ["run"]);
    let _ = std::fs::remove_dir_all(&dir);
}
