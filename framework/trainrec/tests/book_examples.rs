//! The command output the book shows comes from today's binary: each example is run here and
//! compared with its file under `book/src/examples/` (which the book `{{#include}}`s).
//! `TRAINREC_BLESS=1` rewrites the files from the binary's output.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `trainrec args` in `dir`; returns its exit code and stdout.
fn trainrec(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_trainrec"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("trainrec runs");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Compares `got` with the book's example file `name` (or writes it under `TRAINREC_BLESS=1`).
fn check_example(name: &str, got: &str) {
    let path = workspace().join("book/src/examples").join(name);
    if std::env::var_os("TRAINREC_BLESS").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        want == got,
        "{} is stale: the binary now prints\n{got}\n(regenerate with TRAINREC_BLESS=1 cargo test -p trainrec --test book_examples)",
        path.display()
    );
}

#[test]
fn the_planner_chapter_shows_what_trainrec_plan_prints() {
    let dir = std::env::temp_dir().join(format!("trainrec-book-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let recipe = workspace().join("recipes/planner/criteo_8gpu.toml");
    let (code, stdout) = trainrec(&dir, &["plan", recipe.to_str().unwrap(), "--out", "plan.json"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(dir.join("plan.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    check_example("plan_criteo_8gpu.txt", &stdout);
}

/// Runs `recipe` into a fresh directory `name` under the temp dir; returns that directory and
/// the eval block of what it printed (between the first line, with wall time and throughput,
/// and the last, the run directory), which a seeded run reproduces exactly.
fn eval_block(name: &str, recipe: &str, trained: &str) -> (PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("trainrec-book-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let recipe = workspace().join(recipe);
    let out = format!("run.output_dir={}", dir.join("run").display());
    let (code, stdout) = trainrec(&dir, &["run", recipe.to_str().unwrap(), "--set", &out]);
    assert_eq!(code, 0, "{stdout}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with(trained), "{stdout}");
    (dir, lines[1..lines.len() - 1].iter().map(|l| format!("{l}\n")).collect())
}

#[test]
fn the_recipe_chapter_shows_what_the_production_recipe_prints() {
    let (dir, eval) =
        eval_block("production", "recipes/production/dcn_two_tasks.toml", "trained 800 steps (409600 samples)");
    std::fs::remove_dir_all(&dir).unwrap();
    check_example("production_eval.txt", &eval);
}

#[test]
fn the_quickstart_chapter_shows_what_the_quickstart_prints() {
    let (dir, eval) = eval_block("quickstart", "recipes/quickstart.toml", "trained 1500 steps (768000 samples)");
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let first_eval = metrics.lines().find(|l| l.contains(r#""split":"eval""#)).expect("an eval line");
    // The serving chapter: export the run, score its eval split with the file.
    let mut serving = String::new();
    for (shown, args) in [
        ("./trainrec export runs/quickstart --out model.pt", vec!["export", "run", "--out", "model.pt"]),
        (
            "./trainrec predict model.pt --out predictions.jsonl",
            vec!["predict", "model.pt", "--out", "predictions.jsonl"],
        ),
    ] {
        let (code, stdout) = trainrec(&dir, &args);
        assert_eq!(code, 0, "{stdout}");
        serving.push_str(&format!("$ {shown}\n{stdout}"));
    }
    let predictions = std::fs::read_to_string(dir.join("predictions.jsonl")).unwrap();
    serving.push_str("$ head -3 predictions.jsonl\n");
    for line in predictions.lines().take(3) {
        serving.push_str(&format!("{line}\n"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
    check_example("serving_quickstart.txt", &serving);
    check_example("quickstart_eval.txt", &eval);
    check_example("quickstart_first_eval.jsonl", &format!("{first_eval}\n"));
}
