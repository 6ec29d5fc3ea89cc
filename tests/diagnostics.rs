//! Golden diagnostics: each broken recipe under `golden/diagnostics/` renders exactly its
//! `.expected` file (every problem with key path, file:line and help). `TRAINREC_BLESS=1`
//! rewrites the expectations.

use trainrec::Registry;
use trainrec::engine::load_and_check;
use trainrec::recipe::LoadOptions;
use trainrec_tests::{check_golden, toml_files, workspace};

fn render(path: &std::path::Path, overrides: &[&str]) -> String {
    let options = LoadOptions { overrides: overrides.iter().map(|s| s.to_string()).collect(), env: false };
    match load_and_check(path, &options, &Registry::builtin()) {
        Ok(_) => panic!("{} unexpectedly validates", path.display()),
        Err(d) => format!("{d}\n").replace(&format!("{}/", workspace().display()), ""),
    }
}

#[test]
fn golden_diagnostics() {
    let dir = workspace().join("tests/golden/diagnostics");
    let files = toml_files(&dir);
    assert!(files.len() >= 6);
    for f in files {
        check_golden(&f.with_extension("expected"), &render(&f, &[]));
    }
}

#[test]
fn overrides_are_located_and_checked() {
    let quickstart = workspace().join("recipes/quickstart.toml");
    let out = render(&quickstart, &["train.steps=oops", "tables[20].rows=5", "data.batch_size"]);
    check_golden(&workspace().join("tests/golden/overrides.expected"), &out);
}

#[test]
fn every_problem_names_key_and_line() {
    let out = render(&workspace().join("tests/golden/diagnostics/unknown_keys.toml"), &[]);
    for (key, line) in [("run.nmae", ":5:"), ("train.stepz", ":8:"), ("data.sampler.pooling_factr", ":12:")] {
        assert!(out.contains(&format!("key: {key}")), "{out}");
        assert!(out.contains(&format!("unknown_keys.toml{line}")), "{out}");
    }
    assert!(out.contains("3 problems found"), "{out}");
}

#[test]
fn the_books_duplicate_key_example_is_the_golden_output() {
    let golden = std::fs::read_to_string(workspace().join("tests/golden/diagnostics/duplicate_key.expected")).unwrap();
    let example: String = golden.lines().take(4).map(|l| format!("{l}\n")).collect();
    let book = std::fs::read_to_string(workspace().join("book/src/recipe.md")).unwrap();
    assert!(book.contains(&example), "book/src/recipe.md must show the current output:\n{example}");
}
