//! Every shipped recipe, found recursively under `recipes/`, validates against the built-in
//! registry plus the example plugins (structure, plugin sections, cross-section rules).

use trainrec::engine::load_and_check;
use trainrec::recipe::LoadOptions;
use trainrec_tests::{toml_files, workspace};

#[test]
fn every_recipe_validates() {
    let files = toml_files(&workspace().join("recipes"));
    assert!(files.len() >= 2, "expected the shipped recipes, found {files:?}");
    assert!(files.iter().any(|f| f.parent() != Some(&workspace().join("recipes"))), "the sweep must reach subfolders");
    let registry = custom_trainrec::registry();
    let options = LoadOptions { overrides: vec![], env: false };
    let mut failures = Vec::new();
    // Recipes that read the shared datasets validate only where those exist (validation checks
    // that data files exist): a clone without `../shared` skips them, CI never does.
    let have_shared = trainrec_tests::shared_data("").is_some();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        if !have_shared && text.contains("shared/data/") {
            eprintln!("skipping {}: it reads ../shared/data", f.display());
            continue;
        }
        // A recipe whose Run line converts its data first is checked on that conversion.
        let mut options = options.clone();
        if text.contains("trainrec convert criteo-binary") {
            let Some(tsv) = trainrec_tests::shared_data("criteo-kaggle-sample/train_examples.txt") else { continue };
            let dir = std::env::temp_dir().join(format!("trainrec-sweep-npy-{}", std::process::id()));
            trainrec::data::criteo_binary::convert_tsv(&tsv, &dir, "train").expect("the sample converts");
            options.overrides.push(format!("data.sampler.dir=\"{}\"", dir.display()));
        }
        if let Err(d) = load_and_check(f, &options, &registry) {
            failures.push(format!("{}:\n{d}", f.display()));
        }
    }
    assert!(failures.is_empty(), "invalid recipes:\n{}", failures.join("\n\n"));
}

#[test]
fn every_recipe_starts_with_its_three_comment_lines() {
    for f in toml_files(&workspace().join("recipes")) {
        let text = std::fs::read_to_string(&f).unwrap();
        let head: Vec<&str> = text.lines().take(3).collect();
        assert!(
            head.len() == 3
                && head.iter().all(|l| l.starts_with("# "))
                && head[1].contains("Run:")
                && head[2].contains("Override:"),
            "{} must start with three comment lines: what it trains, `Run:` command, `Override:` example",
            f.display()
        );
    }
}
