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

use crate::checkpoint::{Block, Checkpoint, TensorData};
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

/// Floats of a table read and written at once (64 MiB).
const CHUNK_FLOATS: usize = 16 << 20;

/// What writes a tensor's bytes.
type WriteBytes<'a> = Box<dyn FnOnce(&mut dyn std::io::Write) -> Result<(), EngineError> + 'a>;

/// One tensor of the export: its element type, shape, and what writes its bytes.
struct Out<'a> {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: u64,
    write: WriteBytes<'a>,
}

impl<'a> Out<'a> {
    /// A tensor held in memory, written to file `out`.
    fn data(name: String, t: TensorData, out: &'a Path) -> Self {
        let (dtype, shape, bytes) = (t.dtype_name(), t.shape().to_vec(), t.into_bytes());
        Self {
            name,
            dtype,
            shape,
            bytes: bytes.len() as u64,
            write: Box::new(move |w| w.write_all(&bytes).map_err(write_error(out))),
        }
    }
}

/// A failed write of the export file `out` (a full disk), naming the file.
fn write_error(out: &Path) -> impl Fn(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io { path: out.to_path_buf(), source }
}

/// Exports checkpoint `dir` (a `step-<N>` directory) to `out`, written through a temporary
/// file and a rename. Tables are written a chunk of rows at a time, so a table larger than
/// memory (a key-value table of 10^8 rows) exports with memory for one chunk.
pub fn export(dir: &Path, out: &Path) -> Result<ExportSummary, EngineError> {
    let ck = Checkpoint::open(dir)?;
    let mut tables: BTreeMap<String, [usize; 2]> = BTreeMap::new();
    for s in &ck.manifest.shards {
        tables.insert(s.table.clone(), s.table_shape);
    }
    let mut tensors: Vec<Out<'_>> = Vec::new();
    for (name, shape) in &tables {
        let (name, shape, ck) = (name.clone(), *shape, &ck);
        tensors.push(Out {
            name: format!("embedding_bags.{name}.weight"),
            dtype: "F32",
            shape: shape.to_vec(),
            bytes: (shape[0] * shape[1] * 4) as u64,
            write: Box::new(move |w| {
                let step = (CHUNK_FLOATS / shape[1].max(1)).max(1) as u64;
                let mut r = 0u64;
                while r < shape[0] as u64 {
                    let end = (r + step).min(shape[0] as u64);
                    let mut block = Block::whole(&name, shape);
                    block.rows = r..end;
                    let chunk = ck.assemble_shard(&block, &[])?;
                    w.write_all(bytemuck::cast_slice(&chunk.weights)).map_err(write_error(out))?;
                    r = end;
                }
                Ok(())
            }),
        });
    }
    let mut dense = 0;
    let mut mc_ids: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    // Per dynamic table: each partition's (index, live rows, ids).
    type Maps = Vec<(usize, Vec<u64>, Vec<i64>)>;
    let mut dynamic_ids: BTreeMap<String, Maps> = BTreeMap::new();
    for (name, t) in &ck.manifest.tensors {
        let shape = t.shape.clone();
        if name.starts_with("dense.") {
            let data = match t.dtype.as_str() {
                "F64" => TensorData::f64(shape, &ck.f64(name)?.1),
                _ => TensorData::f32(shape, &ck.f32(name)?.1),
            };
            tensors.push(Out::data(name.clone(), data, out));
            dense += 1;
        } else if let Some(prefix) = name.strip_suffix(".ids").filter(|n| n.starts_with("dynamic.")) {
            // A dynamic table's map (or one partition's): the raw id each live row holds, rows
            // numbered within the partition's block (an older checkpoint: every row, -1 free).
            let rest = &prefix["dynamic.".len()..];
            let (table, part) = match rest.rsplit_once(".part").filter(|(_, n)| n.parse::<usize>().is_ok()) {
                Some((t, n)) => (t, n.parse::<usize>().unwrap_or(0)),
                None => (rest, 0),
            };
            let ids = ck.i64(name)?.1;
            let rows_of = format!("{prefix}.rows");
            let rows: Vec<u64> = if ck.has(&rows_of) { ck.u64s(&rows_of)? } else { (0..ids.len() as u64).collect() };
            dynamic_ids.entry(table.to_string()).or_default().push((part, rows, ids));
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
    for (table, parts) in dynamic_ids {
        // Partition `p`'s rows are the table's row-wise block `p` (`ceil(rows / partitions)`).
        let n = tables.get(&table).map_or(0, |s| s[0]);
        let block = (n as u64).div_ceil(parts.len().max(1) as u64);
        let mut all = vec![-1i64; n];
        for (part, rows, ids) in parts {
            for (&r, &id) in rows.iter().zip(&ids) {
                if let Some(slot) = all.get_mut((part as u64 * block + r) as usize) {
                    *slot = id;
                }
            }
        }
        let ids = TensorData::i64(vec![all.len()], &all);
        tensors.push(Out::data(format!("dynamic_tables.{table}.ids"), ids, out));
    }
    for (table, ids) in mc_ids {
        let ids = TensorData::i64(vec![ids.len()], &ids);
        tensors.push(Out::data(format!("managed_collisions.{table}.ids"), ids, out));
    }
    // The safetensors header: metadata, then each tensor's type, shape and byte range in the
    // order written.
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "recipe": ck.manifest.recipe,
            "step": ck.manifest.step.to_string(),
            "format": "trainrec-export-1",
        }),
    );
    let mut at = 0u64;
    for t in &tensors {
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [at, at + t.bytes] }),
        );
        at += t.bytes;
    }
    let mut head = serde_json::to_vec(&header).expect("a header serializes");
    head.resize(head.len().div_ceil(8) * 8, b' ');
    let bytes = 8 + head.len() as u64 + at;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| EngineError::Io { path: parent.to_path_buf(), source: e })?;
    }
    crate::run_dir::write_atomic_with(out, |w| {
        w.write_all(&(head.len() as u64).to_le_bytes()).map_err(write_error(out))?;
        w.write_all(&head).map_err(write_error(out))?;
        for t in tensors {
            (t.write)(w)?;
        }
        Ok(())
    })?;
    Ok(ExportSummary {
        checkpoint: dir.to_path_buf(),
        step: ck.manifest.step,
        tables: tables.into_iter().collect(),
        dense,
        bytes,
    })
}
