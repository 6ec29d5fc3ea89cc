//! Shared helpers for the workspace integration tests.

use std::path::{Path, PathBuf};

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Every `*.toml` under `dir`, recursively, sorted.
pub fn toml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("cannot list {}: {e}", d.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "toml") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// True when `TRAINREC_BLESS=1`: golden files are rewritten instead of compared.
pub fn blessing() -> bool {
    std::env::var("TRAINREC_BLESS").as_deref() == Ok("1")
}

/// Compares `actual` with the golden file (or rewrites it when blessing).
pub fn check_golden(path: &Path, actual: &str) {
    if blessing() {
        std::fs::write(path, actual).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!("cannot read golden file {} ({e}); run with TRAINREC_BLESS=1 to create it", path.display())
    });
    assert!(
        expected == actual,
        "{} is stale; rerun with TRAINREC_BLESS=1 to update it after checking the diff.\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}

/// The shared datasets folder beside the workspace, or `None` (with the reason printed) when a
/// clone has none. Under `CI=true` a missing folder is a failure, never a skip.
pub fn shared_data(relative: &str) -> Option<PathBuf> {
    let path = workspace().join("../shared/data").join(relative);
    if path.exists() {
        return Some(path);
    }
    assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {} is missing", path.display());
    eprintln!("skipping: {} not found (the shared datasets are not part of a clone)", path.display());
    None
}
