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

/// Examples `lo..hi` of a one-label batch without weights or groups (a rank's slice of a
/// global batch).
pub fn slice_batch(b: &trainrec::data::Batch, lo: usize, hi: usize) -> trainrec::data::Batch {
    let keys = b.sparse.keys().to_vec();
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for k in 0..keys.len() {
        let f = b.sparse.feature(k);
        for i in lo..hi {
            values.extend_from_slice(f.bag(i));
            lengths.push(f.bag(i).len() as u32);
        }
    }
    let n = hi - lo;
    trainrec::data::Batch {
        dense: b.dense[lo * b.num_dense..hi * b.num_dense].to_vec(),
        num_dense: b.num_dense,
        sparse: trainrec::sparse::KeyedJaggedTensor::new(keys, values, None, lengths, n).unwrap(),
        labels: b.labels[lo..hi].to_vec(),
        batch_size: n,
        groups: None,
        weights: None,
    }
}

/// A parameter of a fixture made by an anchor script (`scripts/anchors/`): its values,
/// row-major.
#[derive(serde::Deserialize)]
pub struct FixtureParam {
    /// The values, row-major.
    pub values: Vec<f32>,
}

/// A batch of a trajectory fixture: dense features, key-major bag lengths and ids, labels.
#[derive(Clone, serde::Deserialize)]
pub struct FixtureBatch {
    /// `[batch * num_dense]` dense features.
    pub dense: Vec<f32>,
    /// Bag lengths, key-major (`keys * batch`).
    pub lengths: Vec<u32>,
    /// The ids, key by key.
    pub values: Vec<i64>,
    /// One label per example.
    pub labels: Vec<f32>,
}

/// DLRM's dense parameters: trainrec's name (a suffix of the job's) and TorchRec's, for
/// trajectories against TorchRec's `DLRM` with `dense_arch = [_, _]`, `over_arch = [_, _]`.
pub const DLRM_PARAMETERS: [(&str, &str); 8] = [
    ("dense_arch.layer0.weight", "dense_arch.model._mlp.0._linear.weight"),
    ("dense_arch.layer0.bias", "dense_arch.model._mlp.0._linear.bias"),
    ("dense_arch.layer1.weight", "dense_arch.model._mlp.1._linear.weight"),
    ("dense_arch.layer1.bias", "dense_arch.model._mlp.1._linear.bias"),
    ("over_arch.layer0.weight", "over_arch.model.0._mlp.0._linear.weight"),
    ("over_arch.layer0.bias", "over_arch.model.0._mlp.0._linear.bias"),
    ("over_arch.layer1.weight", "over_arch.model.1.weight"),
    ("over_arch.layer1.bias", "over_arch.model.1.bias"),
];
