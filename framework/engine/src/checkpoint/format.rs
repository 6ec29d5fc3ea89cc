//! The checkpoint format: directories, files, manifest, and loading any block of a table.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, View};
use serde::{Deserialize, Serialize};
use trainrec_comm::{ProcessGroup, ProcessGroupExt};
use trainrec_embedding::StatePart;
use trainrec_sharding::LocalShard;

/// The manifest's `format`.
pub const FORMAT: &str = "trainrec-checkpoint";
/// The manifest's `version`.
pub const VERSION: u32 = 1;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not what the manifest says (size, checksum, layout).
    #[error("{path}: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint does not fit the job loading it.
    #[error("checkpoint {dir}: {message}")]
    Incompatible {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What does not fit.
        message: String,
    },
    /// Another rank failed to save.
    #[error("checkpoint at step {step}: {message}")]
    Peer {
        /// The step being saved.
        step: u64,
        /// Which rank failed.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// One tensor to save: its element type, shape and little-endian bytes.
#[derive(Clone, Debug)]
pub struct TensorData {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl TensorData {
    /// A float tensor.
    pub fn f32(shape: Vec<usize>, data: &[f32]) -> Self {
        Self { dtype: Dtype::F32, shape, bytes: bytemuck::cast_slice(data).to_vec() }
    }

    /// A double tensor.
    pub fn f64(shape: Vec<usize>, data: &[f64]) -> Self {
        Self { dtype: Dtype::F64, shape, bytes: bytemuck::cast_slice(data).to_vec() }
    }

    /// A 64-bit integer tensor.
    pub fn i64(shape: Vec<usize>, data: &[i64]) -> Self {
        Self { dtype: Dtype::I64, shape, bytes: bytemuck::cast_slice(data).to_vec() }
    }

    /// The element type's safetensors name (`F32`, `F64`, `I64`).
    pub fn dtype_name(&self) -> &'static str {
        match self.dtype {
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            _ => "F32",
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The little-endian bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// A 1-D tensor of unsigned counters (stored as I64: every count here is below 2^63).
    pub fn u64s(data: &[u64]) -> Self {
        let v: Vec<i64> = data.iter().map(|&x| x as i64).collect();
        Self::i64(vec![v.len()], &v)
    }
}

impl View for &TensorData {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// A file of the checkpoint, with its size and checksum.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileRecord {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32C of the whole file.
    pub crc32c: u32,
}

/// Where a tensor is stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// The file holding it.
    pub file: String,
    /// Element type: `F32`, `F64` or `I64`.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
}

/// One saved block of an embedding table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The table.
    pub table: String,
    /// The table's global shape, `[rows, dim]`.
    pub table_shape: [usize; 2],
    /// The block's rows of the table.
    pub rows: Range<u64>,
    /// The block's columns of the table.
    pub cols: Range<usize>,
    /// A data-parallel replica (saved once, by rank 0).
    pub replicated: bool,
    /// Optimizer steps applied to it.
    pub step_count: u64,
    /// The tensor of its weights, `[rows, cols]`.
    pub weights: String,
    /// The tensor of its optimizer state, `[rows, width]` (absent for a stateless optimizer).
    pub optimizer_state: Option<String>,
    /// The optimizer state's parts per row: `per_column` (one float per column of the block)
    /// or `per_row` (one float for the row).
    pub state_layout: Vec<String>,
    /// A sparse block (a key-value table's written rows): the tensor of the table rows it
    /// holds, `[n]` ascending; `weights` and `optimizer_state` then have `n` rows, and every
    /// other row of `rows` holds its initial weights and zero state. Absent: every row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_rows: Option<String>,
}

/// What one rank saved, sent to rank 0 for the manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RankIndex {
    file: FileRecord,
    tensors: BTreeMap<String, TensorRecord>,
    shards: Vec<ShardRecord>,
}

/// `manifest.json`: the checkpoint's table of contents.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The layout version, [`VERSION`].
    pub version: u32,
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// Ranks of the job that saved it.
    pub world_size: usize,
    /// The resolved recipe (TOML).
    pub recipe: String,
    /// The directory the recipe's relative paths resolve against.
    pub base_dir: PathBuf,
    /// The sharding plan the shards were placed by.
    pub plan: serde_json::Value,
    /// The job's other state (train-loop position, statistics), as the engine writes it.
    pub state: serde_json::Value,
    /// Every file with its size and checksum.
    pub files: Vec<FileRecord>,
    /// Every tensor by name.
    pub tensors: BTreeMap<String, TensorRecord>,
    /// Every saved block of every embedding table.
    pub shards: Vec<ShardRecord>,
}

/// What a rank saves: its tensors and shard records (rank 0 also the manifest's header).
pub struct Contents {
    /// Tensors by name (names unique across ranks).
    pub tensors: Vec<(String, TensorData)>,
    /// Its blocks of embedding tables (their tensors among `tensors`).
    pub shards: Vec<ShardRecord>,
}

impl Contents {
    /// Adds this rank's shards: each block's weights and optimizer state as tensors named
    /// `sparse.<table>.rows<a>-<b>.cols<c>-<d>.weight` / `.optimizer_state`. Replicas are kept
    /// only when `keep_replicas` (rank 0).
    pub fn add_shards(
        &mut self,
        shards: Vec<LocalShard>,
        layout_of: impl Fn(&str) -> Vec<StatePart>,
        keep_replicas: bool,
    ) {
        for s in shards {
            if s.replicated && !keep_replicas {
                continue;
            }
            let base =
                format!("sparse.{}.rows{}-{}.cols{}-{}", s.table, s.rows.start, s.rows.end, s.cols.start, s.cols.end);
            let n_rows = s.stored.as_ref().map_or((s.rows.end - s.rows.start) as usize, Vec::len);
            let stored_rows = s.stored.as_ref().map(|rows| {
                let name = format!("{base}.stored_rows");
                let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
                self.tensors.push((name.clone(), TensorData::i64(vec![rows.len()], &rows)));
                name
            });
            let weights = format!("{base}.weight");
            self.tensors.push((weights.clone(), TensorData::f32(vec![n_rows, s.cols.len()], &s.weights)));
            let layout = layout_of(&s.table);
            let width: usize = layout.iter().map(|p| p.len(s.cols.len())).sum();
            // A block with state per row has its state tensor, also with no row (a sparse
            // block of a table nothing was written to yet).
            let optimizer_state = (!s.optimizer_state.is_empty() || (width > 0 && n_rows == 0)).then(|| {
                let name = format!("{base}.optimizer_state");
                self.tensors.push((name.clone(), TensorData::f32(vec![n_rows, width], &s.optimizer_state)));
                name
            });
            self.shards.push(ShardRecord {
                table: s.table,
                table_shape: s.table_shape,
                rows: s.rows,
                cols: s.cols,
                replicated: s.replicated,
                step_count: s.step_count,
                weights,
                optimizer_state,
                state_layout: layout.iter().map(|p| part_name(*p).to_string()).collect(),
                stored_rows,
            });
        }
    }
}

pub(super) fn part_name(p: StatePart) -> &'static str {
    match p {
        StatePart::PerColumn => "per_column",
        StatePart::PerRow => "per_row",
    }
}

/// The header of a manifest (rank 0's): everything but the files, tensors and shards.
pub struct Header {
    /// The step.
    pub step: u64,
    /// The resolved recipe.
    pub recipe: String,
    /// Where its relative paths resolve.
    pub base_dir: PathBuf,
    /// The plan.
    pub plan: serde_json::Value,
    /// The engine's other state.
    pub state: serde_json::Value,
}

/// The directory name of the checkpoint of `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn parse_step_dir(name: &str) -> Option<u64> {
    name.strip_prefix("step-").and_then(|s| s.parse().ok())
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Writes `bytes` to `path` and flushes them to the disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(io(path))
}

/// Flushes a directory's entries (a rename inside it) to the disk; best effort.
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Whether the test hook `TRAINREC_FAILPOINT` (comma-separated `name:step`) asks for `name`
/// at `step`: `abort-after-step:25` stops the process the way `kill -9` does after step 25;
/// `checkpoint-before-manifest:40` does during the save of step 40, after the rank files and
/// before the manifest.
pub(crate) fn failpoint(name: &str, step: u64) -> bool {
    failpoint_values(name).contains(&step)
}

/// The value of failpoint `name:N` in `TRAINREC_FAILPOINT`, when set (e.g. `stop-hold-ms:3000`).
pub(crate) fn failpoint_value(name: &str) -> Option<u64> {
    failpoint_values(name).first().copied()
}

/// Every `N` of the entries `name:N` of `TRAINREC_FAILPOINT`, in order.
fn failpoint_values(name: &str) -> Vec<u64> {
    let Ok(v) = std::env::var("TRAINREC_FAILPOINT") else { return Vec::new() };
    v.split(',')
        .filter_map(|f| f.strip_prefix(name).and_then(|r| r.strip_prefix(':')).and_then(|n| n.parse().ok()))
        .collect()
}

/// Saves a checkpoint of `step` under `root` (every rank calls it; `pg` across ranks) and
/// keeps the newest `keep` complete ones. Returns the checkpoint's directory. A save that
/// fails (a full disk on any rank) leaves nothing behind: rank 0 removes the partial
/// directory once every rank has stopped writing into it.
pub fn save(
    root: &Path,
    header: Option<Header>,
    contents: Contents,
    pg: Option<&dyn ProcessGroup>,
    step: u64,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let partial = root.join(format!(".{}.partial", step_dir_name(step)));
    let saved = save_through(root, &partial, header, contents, pg, step, keep);
    if saved.is_err() && pg.is_none_or(|g| g.rank() == 0) && partial.exists() {
        if let Err(e) = std::fs::remove_dir_all(&partial) {
            tracing::warn!(dir = %partial.display(), "cannot remove the failed checkpoint's partial directory: {e}");
        }
    }
    saved
}

/// [`save`] through the partial directory `partial`.
fn save_through(
    root: &Path,
    partial: &Path,
    header: Option<Header>,
    contents: Contents,
    pg: Option<&dyn ProcessGroup>,
    step: u64,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let (rank, world) = pg.map_or((0, 1), |g| (g.rank(), g.world_size()));
    let partial = partial.to_path_buf();
    let done = root.join(step_dir_name(step));
    // Rank 0 makes a clean partial directory; the others wait for it.
    let made = if rank == 0 {
        std::fs::create_dir_all(root).map_err(io(root)).and_then(|_| {
            if partial.exists() {
                std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
            }
            std::fs::create_dir(&partial).map_err(io(&partial))
        })
    } else {
        Ok(())
    };
    agree(pg, step, made.as_ref().err().map(|e| e.to_string()))?;
    made?;

    // Every rank writes its file.
    let written = (|| -> Result<RankIndex, CheckpointError> {
        let name = rank_file(rank);
        let path = partial.join(&name);
        if failpoint("checkpoint-write-fails", step) {
            // A test's stand-in for a full disk.
            return Err(CheckpointError::Io {
                path,
                source: std::io::Error::other("no space left on device (failpoint)"),
            });
        }
        let bytes = safetensors::tensor::serialize(contents.tensors.iter().map(|(n, t)| (n.clone(), t)), &None)
            .map_err(|e| CheckpointError::Corrupt { path: path.clone(), message: format!("cannot serialize: {e}") })?;
        write_synced(&path, &bytes)?;
        let file = FileRecord { name: name.clone(), bytes: bytes.len() as u64, crc32c: crc32c::crc32c(&bytes) };
        let tensors = contents
            .tensors
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    TensorRecord { file: name.clone(), dtype: format!("{:?}", t.dtype), shape: t.shape.clone() },
                )
            })
            .collect();
        Ok(RankIndex { file, tensors, shards: contents.shards })
    })();
    let index_json = match &written {
        Ok(ix) => serde_json::to_vec(ix).expect("an index serializes"),
        Err(_) => Vec::new(),
    };
    agree(pg, step, written.as_ref().err().map(|e| e.to_string()))?;
    let mine = written?;
    let indices: Vec<RankIndex> = match pg {
        Some(pg) => {
            let counts = gather_counts(pg, index_json.len())?;
            let all = pg
                .all_gather_v_bytes(&index_json, &counts)
                .map_err(|e| CheckpointError::Peer { step, message: format!("gathering the shard index: {e}") })?;
            split_indices(&all, &counts)?
        }
        None => vec![mine],
    };
    if failpoint("checkpoint-before-manifest", step) {
        std::process::abort();
    }

    // Rank 0 writes the manifest, renames the directory and prunes old checkpoints.
    let finished = match (rank, header) {
        (0, Some(h)) => (|| -> Result<(), CheckpointError> {
            let mut manifest = Manifest {
                format: FORMAT.into(),
                version: VERSION,
                step,
                world_size: world,
                recipe: h.recipe,
                base_dir: h.base_dir,
                plan: h.plan,
                state: h.state,
                files: Vec::new(),
                tensors: BTreeMap::new(),
                shards: Vec::new(),
            };
            for ix in indices {
                manifest.files.push(ix.file);
                for (n, t) in ix.tensors {
                    if manifest.tensors.insert(n.clone(), t).is_some() {
                        return Err(CheckpointError::Corrupt {
                            path: partial.clone(),
                            message: format!("tensor {n} saved by two ranks"),
                        });
                    }
                }
                manifest.shards.extend(ix.shards);
            }
            let path = partial.join(MANIFEST);
            write_synced(&path, &serde_json::to_vec_pretty(&manifest).expect("a manifest serializes"))?;
            sync_dir(&partial);
            if done.exists() {
                std::fs::remove_dir_all(&done).map_err(io(&done))?;
            }
            std::fs::rename(&partial, &done).map_err(io(&done))?;
            sync_dir(root);
            prune(root, keep, step);
            Ok(())
        })(),
        (0, None) => Err(CheckpointError::Peer { step, message: "rank 0 has no manifest header".into() }),
        _ => Ok(()),
    };
    agree(pg, step, finished.as_ref().err().map(|e| e.to_string()))?;
    finished?;
    tracing::info!(step, dir = %done.display(), "checkpoint saved");
    Ok(done)
}

/// Every rank's byte count of a variable all-gather.
fn gather_counts(pg: &dyn ProcessGroup, n: usize) -> Result<Vec<usize>, CheckpointError> {
    pg.all_gather_u64(n as u64)
        .map(|v| v.into_iter().map(|x| x as usize).collect())
        .map_err(|e| CheckpointError::Peer { step: 0, message: format!("gathering index sizes: {e}") })
}

fn split_indices(all: &[u8], counts: &[usize]) -> Result<Vec<RankIndex>, CheckpointError> {
    let mut out = Vec::new();
    let mut at = 0;
    for &n in counts {
        let ix = serde_json::from_slice(&all[at..at + n]).map_err(|e| CheckpointError::Corrupt {
            path: PathBuf::from("<shard index>"),
            message: format!("a rank's shard index does not parse: {e}"),
        })?;
        out.push(ix);
        at += n;
    }
    Ok(out)
}

/// Across ranks: fails on every rank when any rank has `failure` (naming the first), so no
/// rank goes on while another has given up.
fn agree(pg: Option<&dyn ProcessGroup>, step: u64, failure: Option<String>) -> Result<(), CheckpointError> {
    let Some(pg) = pg else { return Ok(()) };
    let msg = failure.unwrap_or_default();
    let counts = gather_counts(pg, msg.len())?;
    let all = pg
        .all_gather_v_bytes(msg.as_bytes(), &counts)
        .map_err(|e| CheckpointError::Peer { step, message: format!("ranks could not agree: {e}") })?;
    let mut at = 0;
    for (r, &n) in counts.iter().enumerate() {
        if n > 0 && r != pg.rank() {
            let text = String::from_utf8_lossy(&all[at..at + n]).into_owned();
            return Err(CheckpointError::Peer { step, message: format!("rank {r} failed: {text}") });
        }
        at += n;
    }
    Ok(())
}

/// Deletes all but the newest `keep` complete checkpoints under `root`, and partial ones of
/// other steps than `current` (best effort: a file that cannot be removed is logged).
fn prune(root: &Path, keep: usize, current: u64) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    let mut complete = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = parse_step_dir(&name).filter(|_| e.path().join(MANIFEST).is_file()) {
            complete.push((step, e.path()));
        } else if name.starts_with(".step-") && name.ends_with(".partial") && !name.contains(&step_dir_name(current)) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    complete.sort();
    let drop = complete.len().saturating_sub(keep.max(1));
    for (_, path) in &complete[..drop] {
        if let Err(e) = std::fs::remove_dir_all(path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot delete an old checkpoint");
        }
    }
}

/// The newest complete checkpoint under `root` (`<run dir>/checkpoints`): the highest step
/// whose directory holds a manifest. Directories of interrupted saves are skipped with a
/// warning naming them.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CheckpointError::Io { path: root.to_path_buf(), source: e }),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for e in entries {
        let e = e.map_err(io(root))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".partial") {
            tracing::warn!(dir = %e.path().display(), "ignoring an incomplete checkpoint (its save was interrupted)");
            continue;
        }
        let Some(step) = parse_step_dir(&name) else { continue };
        if !e.path().join(MANIFEST).is_file() {
            tracing::warn!(dir = %e.path().display(), "ignoring a checkpoint directory without {MANIFEST}");
            continue;
        }
        if best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, e.path()));
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// An opened checkpoint: its manifest and (verified on first use) its files.
pub struct Checkpoint {
    dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    files: std::sync::Mutex<BTreeMap<String, std::sync::Arc<memmap2::Mmap>>>,
    /// The stored-rows tensors of sparse blocks read so far.
    pub(super) stored: std::sync::Mutex<BTreeMap<String, std::sync::Arc<Vec<u64>>>>,
    /// The seed and table order of the saved recipe (initial weights), once read.
    pub(super) init: std::sync::OnceLock<Result<(u64, Vec<String>), String>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("dir", &self.dir).field("step", &self.manifest.step).finish()
    }
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` (a `step-<N>` directory), reading its manifest.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read(&path).map_err(io(&path))?;
        let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| CheckpointError::Corrupt {
            path: path.clone(),
            message: format!("not a trainrec checkpoint manifest: {e}"),
        })?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!(
                    "format {} version {}; this trainrec reads {FORMAT} version {VERSION}",
                    manifest.format, manifest.version
                ),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            files: Default::default(),
            stored: Default::default(),
            init: Default::default(),
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The mapped file `name`, its size and checksum checked against the manifest.
    fn file(&self, name: &str) -> Result<std::sync::Arc<memmap2::Mmap>, CheckpointError> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = files.get(name) {
            return Ok(m.clone());
        }
        let path = self.dir.join(name);
        let record = self.manifest.files.iter().find(|f| f.name == name).ok_or_else(|| CheckpointError::Corrupt {
            path: path.clone(),
            message: "the manifest does not list this file".into(),
        })?;
        let f = File::open(&path).map_err(io(&path))?;
        // SAFETY: checkpoint files are written once and never modified in place (a new save
        // writes a new directory); the map is read-only.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io(&path))?;
        if map.len() as u64 != record.bytes {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!(
                    "{} bytes, the manifest says {}: the file is truncated or replaced",
                    map.len(),
                    record.bytes
                ),
            });
        }
        let crc = crc32c::crc32c(&map);
        if crc != record.crc32c {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!(
                    "checksum {crc:08x} differs from the manifest's {:08x}: the file is corrupted",
                    record.crc32c
                ),
            });
        }
        let map = std::sync::Arc::new(map);
        files.insert(name.to_string(), map.clone());
        Ok(map)
    }

    /// Whether the checkpoint has tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.manifest.tensors.contains_key(name)
    }

    /// Tensor `name`'s shape and little-endian bytes, checked for its type.
    fn raw(&self, name: &str, dtype: Dtype) -> Result<(Vec<usize>, Vec<u8>), CheckpointError> {
        self.raw_rows(name, dtype, None)
    }

    /// [`Self::raw`], only rows `rows` (of the first dimension) when given.
    fn raw_rows(
        &self,
        name: &str,
        dtype: Dtype,
        rows: Option<Range<usize>>,
    ) -> Result<(Vec<usize>, Vec<u8>), CheckpointError> {
        let record = self.manifest.tensors.get(name).ok_or_else(|| CheckpointError::Incompatible {
            dir: self.dir.clone(),
            message: format!("it has no tensor {name}"),
        })?;
        let map = self.file(&record.file)?;
        let path = self.dir.join(&record.file);
        let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| CheckpointError::Corrupt {
            path: path.clone(),
            message: format!("not a safetensors file: {e}"),
        })?;
        let view = st
            .tensor(name)
            .map_err(|e| CheckpointError::Corrupt { path: path.clone(), message: format!("tensor {name}: {e}") })?;
        if view.dtype() != dtype {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!("tensor {name} is {:?}, expected {dtype:?}", view.dtype()),
            });
        }
        let shape = view.shape().to_vec();
        let data = view.data();
        let Some(rows) = rows else { return Ok((shape, data.to_vec())) };
        let row_bytes = if shape.is_empty() { 0 } else { data.len() / shape[0].max(1) };
        if shape.is_empty() || rows.end > shape[0] {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!("tensor {name} of shape {shape:?} has no rows {rows:?}"),
            });
        }
        Ok((shape, data[rows.start * row_bytes..rows.end * row_bytes].to_vec()))
    }

    /// Rows `rows` of 2-D float tensor `name`, with the tensor's shape.
    pub(super) fn f32_rows(&self, name: &str, rows: Range<usize>) -> Result<(Vec<usize>, Vec<f32>), CheckpointError> {
        self.floats(name, Some(rows))
    }

    /// A float tensor (rows `rows` of it, when given) with its shape.
    fn floats(&self, name: &str, rows: Option<Range<usize>>) -> Result<(Vec<usize>, Vec<f32>), CheckpointError> {
        let (shape, bytes) = self.raw_rows(name, Dtype::F32, rows)?;
        Ok((shape, bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()))
    }

    /// A float tensor with its shape.
    pub fn f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), CheckpointError> {
        self.floats(name, None)
    }

    /// A double tensor with its shape.
    pub fn f64(&self, name: &str) -> Result<(Vec<usize>, Vec<f64>), CheckpointError> {
        let (shape, bytes) = self.raw(name, Dtype::F64)?;
        Ok((shape, bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()))
    }

    /// A 64-bit integer tensor with its shape.
    pub fn i64(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>), CheckpointError> {
        let (shape, bytes) = self.raw(name, Dtype::I64)?;
        Ok((shape, bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()))
    }

    /// A 1-D tensor of counters.
    pub fn u64s(&self, name: &str) -> Result<Vec<u64>, CheckpointError> {
        Ok(self.i64(name)?.1.into_iter().map(|x| x as u64).collect())
    }

    pub(super) fn incompatible(&self, message: String) -> CheckpointError {
        CheckpointError::Incompatible { dir: self.dir.clone(), message }
    }
}

/// Recipe keys a resumed run may change: where and how long to train, how often to report,
/// and how many ranks (the checkpoint reshards). Everything else defines the model, its data
/// or its optimizers, which a checkpoint continues.
pub const RESUMABLE_KEYS: &[&str] = &[
    "run.output_dir",
    "pipeline",
    "embedding.offload_dir",
    "run.threads",
    "train",
    "topology.world_size",
    "topology.local_world_size",
    "topology.gradient_bucket_mib",
    "planner",
];

/// Recipe keys `trainrec eval` may change besides [`RESUMABLE_KEYS`]: the data evaluated on
/// and the metrics computed.
pub const EVAL_KEYS: &[&str] = &["data", "metrics", "run", "embedding"];

/// The keys whose values differ between the checkpoint's recipe `saved` and the resumed
/// run's `now` (both resolved TOML), outside [`RESUMABLE_KEYS`], as `key: saved -> now`.
pub fn changed_keys(saved: &str, now: &str) -> Result<Vec<String>, String> {
    changed_keys_outside(saved, now, RESUMABLE_KEYS)
}

/// [`changed_keys`] outside the keys `allowed` (and their sub-keys).
pub fn changed_keys_outside(saved: &str, now: &str, allowed: &[&str]) -> Result<Vec<String>, String> {
    let a: toml::Value = toml::from_str(saved).map_err(|e| format!("the checkpoint's recipe does not parse: {e}"))?;
    let b: toml::Value = toml::from_str(now).map_err(|e| format!("the recipe does not parse: {e}"))?;
    let mut out = Vec::new();
    diff("", Some(&a), Some(&b), allowed, &mut out);
    Ok(out)
}

fn diff(path: &str, a: Option<&toml::Value>, b: Option<&toml::Value>, allowed: &[&str], out: &mut Vec<String>) {
    if allowed.iter().any(|k| path == *k || path.starts_with(&format!("{k}."))) {
        return;
    }
    let show = |v: Option<&toml::Value>| v.map_or("(unset)".to_string(), |v| v.to_string());
    match (a, b) {
        (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                diff(&p, x.get(k), y.get(k), allowed, out);
            }
        }
        (Some(toml::Value::Array(x)), Some(toml::Value::Array(y))) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                diff(&format!("{path}[{i}]"), Some(u), Some(v), allowed, out);
            }
        }
        (x, y) if x != y => out.push(format!("{path}: {} -> {}", show(x), show(y))),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Block;

    fn shard(rows: Range<u64>, cols: Range<usize>, dim: usize, f: impl Fn(u64, usize) -> f32) -> LocalShard {
        let mut weights = Vec::new();
        let mut state = Vec::new();
        for r in rows.clone() {
            for c in cols.clone() {
                weights.push(f(r, c));
            }
            // Layout [PerRow, PerColumn]: partial row-wise Adam.
            state.push(r as f32 * 10.0 + cols.start as f32);
            for c in cols.clone() {
                state.push(-f(r, c));
            }
        }
        let _ = dim;
        LocalShard {
            table: "t".into(),
            table_shape: [6, 4],
            rows,
            cols,
            replicated: false,
            weights,
            optimizer_state: state,
            step_count: 7,
            stored: None,
        }
    }

    fn want(rows: Range<u64>, cols: Range<usize>) -> Block {
        Block { table: "t".into(), table_shape: [6, 4], rows, cols, replicated: false, sparse: false }
    }

    fn layout() -> Vec<StatePart> {
        vec![StatePart::PerRow, StatePart::PerColumn]
    }

    fn value(r: u64, c: usize) -> f32 {
        r as f32 * 100.0 + c as f32
    }

    fn save_blocks(root: &Path, blocks: Vec<LocalShard>) -> PathBuf {
        save_blocks_of(root, blocks, "x = 1")
    }

    fn save_blocks_of(root: &Path, blocks: Vec<LocalShard>, recipe: &str) -> PathBuf {
        let mut contents = Contents { tensors: Vec::new(), shards: Vec::new() };
        contents.add_shards(blocks, |_| layout(), true);
        contents.tensors.push(("extra.counts".into(), TensorData::u64s(&[1, 2, 3])));
        let header = Header {
            step: 5,
            recipe: recipe.into(),
            base_dir: ".".into(),
            plan: serde_json::Value::Null,
            state: serde_json::json!({"a": 1}),
        };
        save(root, Some(header), contents, None, 5, 2).unwrap()
    }

    #[test]
    fn blocks_round_trip_and_reassemble_across_layouts() {
        let dir = tempdir();
        // Saved as 2 row blocks x 2 column blocks.
        let saved = vec![
            shard(0..3, 0..2, 4, value),
            shard(0..3, 2..4, 4, value),
            shard(3..6, 0..2, 4, value),
            shard(3..6, 2..4, 4, value),
        ];
        let path = save_blocks(&dir, saved.clone());
        assert_eq!(latest(&dir).unwrap(), Some(path.clone()));
        let ck = Checkpoint::open(&path).unwrap();
        assert_eq!(ck.u64s("extra.counts").unwrap(), [1, 2, 3]);
        // The same block comes back exactly.
        for s in &saved {
            let got = ck.assemble_shard(&want(s.rows.clone(), s.cols.clone()), &layout()).unwrap();
            assert_eq!(&got, s);
        }
        // A block across all four: weights and per-column state copied; the per-row part is
        // the column-weighted mean of the two column blocks' (rows r: 10r + 0 and 10r + 2).
        let got = ck.assemble_shard(&want(1..5, 1..4), &layout()).unwrap();
        let (n_cols, width) = (3, 4);
        for (i, r) in (1..5u64).enumerate() {
            for (j, c) in (1..4usize).enumerate() {
                assert_eq!(got.weights[i * n_cols + j], value(r, c));
                assert_eq!(got.optimizer_state[i * width + 1 + j], -value(r, c));
            }
            let want = ((10.0 * r as f64) * 1.0 + (10.0 * r as f64 + 2.0) * 2.0) / 3.0;
            assert!((got.optimizer_state[i * width] as f64 - want).abs() < 1e-5, "row {r}");
        }
        assert_eq!(got.step_count, 7);
        // A block outside the table is refused, naming the table.
        let err = ck.assemble_shard(&want(5..7, 0..4), &layout()).unwrap_err().to_string();
        assert!(err.contains("do not cover rows 5..7"), "{err}");
        // Another optimizer's layout is refused.
        let err = ck.assemble_shard(&want(0..3, 0..2), &[StatePart::PerRow]).unwrap_err().to_string();
        assert!(err.contains("sparse optimizer changed"), "{err}");
    }

    /// Keeps only rows `keep` of a dense block (a key-value table's sparse block).
    fn sparse(s: LocalShard, keep: &[u64]) -> LocalShard {
        let n = (s.rows.end - s.rows.start) as usize;
        let (w, st) = (s.weights.len() / n, s.optimizer_state.len() / n);
        let pick = |v: &[f32], width: usize| -> Vec<f32> {
            keep.iter().flat_map(|&r| v[(r - s.rows.start) as usize * width..][..width].to_vec()).collect()
        };
        LocalShard {
            weights: pick(&s.weights, w),
            optimizer_state: pick(&s.optimizer_state, st),
            stored: Some(keep.to_vec()),
            ..s
        }
    }

    #[test]
    fn sparse_blocks_reassemble_with_initial_weights_for_rows_not_written() {
        let dir = tempdir();
        // Two column blocks of a key-value table that hold different rows.
        let saved = vec![sparse(shard(0..6, 0..2, 4, value), &[1, 4]), sparse(shard(0..6, 2..4, 4, value), &[4, 5])];
        let path = save_blocks_of(
            &dir,
            saved.clone(),
            "[run]\nseed = 3\n[[tables]]\nname = \"u\"\n[[tables]]\nname = \"t\"\n",
        );
        let ck = Checkpoint::open(&path).unwrap();
        let init = |r: u64, c: usize| trainrec_embedding::initial_weights(3, 1, 6, 4, r..r + 1, c..c + 1)[0];
        // Each saved block comes back as it was.
        for s in &saved {
            let got = ck.assemble_shard(&Block { sparse: true, ..want(s.rows.clone(), s.cols.clone()) }, &layout());
            assert_eq!(&got.unwrap(), s);
        }
        // Dense: a cell a block holds has its value; any other its initial weight and zero
        // state; the per-row part is the column-weighted mean (a block without the row: 0).
        let dense = ck.assemble_shard(&want(0..6, 0..4), &layout()).unwrap();
        let held = |r: u64, c: usize| (c < 2 && [1, 4].contains(&r)) || (c >= 2 && [4, 5].contains(&r));
        for r in 0..6u64 {
            for c in 0..4 {
                let (w, st) = (dense.weights[r as usize * 4 + c], dense.optimizer_state[r as usize * 5 + 1 + c]);
                if held(r, c) {
                    assert_eq!((w, st), (value(r, c), -value(r, c)), "row {r} col {c}");
                } else {
                    assert_eq!((w, st), (init(r, c), 0.0), "row {r} col {c}");
                }
            }
            let want_row = [0usize, 2].iter().filter(|&&c0| held(r, c0)).map(|&c0| (10 * r + c0 as u64) as f64 * 2.0);
            let want_row = want_row.sum::<f64>() / 4.0;
            assert!((dense.optimizer_state[r as usize * 5] as f64 - want_row).abs() < 1e-5, "row {r}");
        }
        assert_eq!(dense.stored, None);
        // Sparse: the rows any block holds, with the dense block's values.
        let got = ck.assemble_shard(&Block { sparse: true, ..want(0..6, 0..4) }, &layout()).unwrap();
        assert_eq!(got.stored.as_deref(), Some(&[1u64, 4, 5][..]));
        for (i, r) in [1usize, 4, 5].into_iter().enumerate() {
            assert_eq!(got.weights[i * 4..][..4], dense.weights[r * 4..][..4]);
            assert_eq!(got.optimizer_state[i * 5..][..5], dense.optimizer_state[r * 5..][..5]);
        }
        // A part of the rows, split across the blocks differently.
        let part = ck.assemble_shard(&Block { sparse: true, ..want(2..5, 1..3) }, &layout()).unwrap();
        assert_eq!(part.stored.as_deref(), Some(&[4u64][..]));
        assert_eq!(part.weights, [value(4, 1), value(4, 2)]);
    }

    #[test]
    fn a_resumed_recipe_may_change_only_resumable_keys() {
        let saved =
            "[run]\nseed = 1\n[train]\nsteps = 10\n[topology]\nworld_size = 2\n[[tables]]\nname = \"a\"\ndim = 8\n";
        let now =
            "[run]\nseed = 1\n[train]\nsteps = 20\n[topology]\nworld_size = 3\n[[tables]]\nname = \"a\"\ndim = 16\n";
        assert_eq!(changed_keys(saved, now).unwrap(), ["tables[0].dim: 8 -> 16"]);
        assert!(changed_keys(saved, saved).unwrap().is_empty());
    }

    #[test]
    fn a_corrupted_file_is_refused_by_its_checksum() {
        let dir = tempdir();
        let path = save_blocks(&dir, vec![shard(0..6, 0..4, 4, value)]);
        let file = path.join(rank_file(0));
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x40;
        std::fs::write(&file, &bytes).unwrap();
        let ck = Checkpoint::open(&path).unwrap();
        let err = ck.assemble_shard(&want(0..6, 0..4), &layout()).unwrap_err().to_string();
        assert!(err.contains("rank-00000.safetensors") && err.contains("corrupted"), "{err}");
        // Truncation too.
        std::fs::write(&file, &bytes[..bytes.len() - 8]).unwrap();
        let ck = Checkpoint::open(&path).unwrap();
        let err = ck.f32(&ck.manifest.shards[0].weights).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }

    #[test]
    fn partial_saves_are_ignored_and_old_checkpoints_pruned() {
        let dir = tempdir();
        let first = save_blocks(&dir, vec![shard(0..6, 0..4, 4, value)]);
        // A save that stopped before its manifest.
        std::fs::create_dir_all(dir.join(".step-00000009.partial")).unwrap();
        std::fs::write(dir.join(".step-00000009.partial").join(rank_file(0)), b"half").unwrap();
        // A step directory without a manifest (copied by hand, say).
        std::fs::create_dir_all(dir.join("step-00000010")).unwrap();
        assert_eq!(latest(&dir).unwrap(), Some(first.clone()));
        // Keep 2: saving steps 6 and 7 drops step 5 and the stale partial directory.
        for step in [6, 7] {
            let mut c = Contents { tensors: Vec::new(), shards: Vec::new() };
            c.tensors.push(("x".into(), TensorData::f64(vec![1], &[step as f64])));
            let h = Header {
                step,
                recipe: String::new(),
                base_dir: ".".into(),
                plan: serde_json::Value::Null,
                state: serde_json::Value::Null,
            };
            save(&dir, Some(h), c, None, step, 2).unwrap();
        }
        assert!(!first.exists());
        assert!(!dir.join(".step-00000009.partial").exists());
        let newest = latest(&dir).unwrap().unwrap();
        assert!(newest.ends_with("step-00000007"), "{}", newest.display());
        assert_eq!(Checkpoint::open(&dir.join("step-00000007")).unwrap().f64("x").unwrap().1, [7.0]);
        assert!(dir.join("step-00000006").exists());
    }

    fn tempdir() -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("trainrec-ckpt-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
