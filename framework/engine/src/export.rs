//! `trainrec export`: a checkpoint as one unsharded safetensors file for serving or for
//! PyTorch.
//!
//! Tensor names (documented in the book's checkpoint chapter):
//! - `embedding_bags.<table>.weight`: each whole table `[rows, dim]` (fp32), as TorchRec's
//!   `EmbeddingBagCollection.state_dict()` names it;
//! - `dense.<variable>`: the dense model's variables, by their VarStore names;
//! - `managed_collisions.<table>.ids`: for a managed-collision table, the raw id each row
//!   holds (`-1`: none; `[rows]`, every partition's slots in place), to remap raw ids at
//!   serving;
//! - `dynamic_tables.<table>.ids`: for a dynamic table, the raw id each row holds (`-1`:
//!   free); an id held by no row reads zeros.
//!
//! The file's metadata holds the resolved recipe (`recipe`) and the step (`step`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::checkpoint::{Checkpoint, CheckpointError, TensorData};
use crate::error::EngineError;

/// What [`export`] wrote.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    /// The checkpoint exported.
    pub checkpoint: PathBuf,
    /// Its step.
    pub step: u64,
    /// Tables exported, with their shapes.
    pub tables: Vec<(String, [usize; 2])>,
    /// Dense tensors exported.
    pub dense: usize,
    /// Bytes written.
    pub bytes: u64,
}

/// Exports checkpoint `dir` (a `step-<N>` directory) to `out`, written through a temporary
/// file and a rename.
pub fn export(dir: &Path, out: &Path) -> Result<ExportSummary, EngineError> {
    let ck = Checkpoint::open(dir)?;
    let mut tables: BTreeMap<String, [usize; 2]> = BTreeMap::new();
    for s in &ck.manifest.shards {
        tables.insert(s.table.clone(), s.table_shape);
    }
    let mut tensors: Vec<(String, TensorData)> = Vec::new();
    for (name, shape) in &tables {
        let whole = ck.assemble_shard(name, *shape, 0..shape[0] as u64, 0..shape[1], &[], false)?;
        tensors.push((format!("embedding_bags.{name}.weight"), TensorData::f32(shape.to_vec(), &whole.weights)));
    }
    let mut dense = 0;
    let mut mc_ids: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (name, t) in &ck.manifest.tensors {
        let shape = t.shape.clone();
        if name.starts_with("dense.") {
            let data = match t.dtype.as_str() {
                "F64" => TensorData::f64(shape, &ck.f64(name)?.1),
                _ => TensorData::f32(shape, &ck.f32(name)?.1),
            };
            tensors.push((name.clone(), data));
            dense += 1;
        } else if let Some(table) = name.strip_prefix("dynamic.").and_then(|n| n.strip_suffix(".ids")) {
            // A dynamic table's map: the raw id each row holds (-1: free).
            let ids = ck.i64(name)?.1;
            tensors.push((format!("dynamic_tables.{table}.ids"), TensorData::i64(vec![ids.len()], &ids)));
        } else if let Some(prefix) = name.strip_suffix(".ids").filter(|n| n.starts_with("mc.")) {
            // One partition's slots: slot `s` is row `first_row + s` of the table.
            let table = prefix["mc.".len()..].rsplit_once(".part").map_or(&prefix["mc.".len()..], |(t, _)| t);
            let first_row = ck.u64s(&format!("{prefix}.meta"))?.get(6).copied().unwrap_or(0) as usize;
            let rows = tables.get(table).map_or(0, |s| s[0]);
            let ids = mc_ids.entry(table.to_string()).or_insert_with(|| vec![-1; rows]);
            for (s, &id) in ck.i64(name)?.1.iter().enumerate() {
                if let Some(slot) = ids.get_mut(first_row + s) {
                    *slot = id;
                }
            }
        }
    }
    for (table, ids) in mc_ids {
        tensors.push((format!("managed_collisions.{table}.ids"), TensorData::i64(vec![ids.len()], &ids)));
    }
    let metadata = std::collections::HashMap::from([
        ("recipe".to_string(), ck.manifest.recipe.clone()),
        ("step".to_string(), ck.manifest.step.to_string()),
        ("format".to_string(), "trainrec-export-1".to_string()),
    ]);
    let bytes = safetensors::tensor::serialize(tensors.iter().map(|(n, t)| (n.clone(), t)), &Some(metadata))
        .map_err(|e| CheckpointError::Corrupt { path: out.to_path_buf(), message: format!("cannot serialize: {e}") })?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| EngineError::Io { path: parent.to_path_buf(), source: e })?;
    }
    crate::run_dir::write_atomic(out, &bytes)?;
    Ok(ExportSummary {
        checkpoint: dir.to_path_buf(),
        step: ck.manifest.step,
        tables: tables.into_iter().collect(),
        dense,
        bytes: bytes.len() as u64,
    })
}
