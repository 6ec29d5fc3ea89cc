//! `kind = "criteo_binary"`: TorchRec's preprocessed binary Criteo layout, and
//! [`convert_tsv`], which produces it from a Criteo TSV file as TorchRec's
//! `BinaryCriteoUtils.tsv_to_npys` does.
//!
//! # On-disk layout
//!
//! A file *prefix* `P` (for example `day_0` or `train`) names three NumPy `.npy` files (format
//! 1.0, C order, little-endian, see [`crate::npy`]) with one row per TSV line, in line order:
//!
//! | file | dtype | shape | content |
//! | --- | --- | --- | --- |
//! | `P_dense.npy` | `<f4` | `[N, 13]` | `ln(x - m + 2)` of the integer features I1..I13, where a missing value is `x = 0` and `m` is the smallest `x` of the whole file (all 13 columns) |
//! | `P_sparse.npy` | `<i8` | `[N, 26]` | the categorical features C1..C26 parsed as hexadecimal (missing: 0) |
//! | `P_labels.npy` | `<i4` | `[N, 1]` | the label (missing: 0; `-1` for an unlabelled file converted with `labeled = false`, as TorchRec does for the Kaggle test set) |
//!
//! The integers are parsed as Python's `int()` does (surrounding whitespace, a sign, `_`
//! between digits; hexadecimal may start with `0x`); a dense value or label must fit in
//! `int32` and a categorical value in `int64` (NumPy refuses the others). The logarithm is of
//! the value cast to `f32`, as `np.log(..., dtype=np.float32)`, correctly rounded to `f32`.
//! NumPy's own single-precision `log` is vectorized where the CPU has AVX2 / AVX-512 and is
//! then not always correctly rounded, so TorchRec's dense file depends on the machine that
//! wrote it: against one written on an AVX-512 machine, about 3% of values differ by one unit
//! in the last place (the sparse and label files, and every header, are byte-identical).
//! Note that `m` makes the dense transform depend on the file: it is `ln(x + 4)` when the
//! smallest value is `-2`, and differs from `criteo_tsv`'s `ln(1 + max(x, 0))`.
//!
//! # Reading
//!
//! The sampler reads fixed ranges of rows on `num_workers` threads and yields them in file
//! order. Any numeric dtype is accepted for the dense and label files and any integer dtype for
//! the sparse file; labels may be `[N, 1]` or `[N]`. A row whose label is not 0 or 1, or whose
//! dense values are not finite, is a bad row (reported as file and 0-based row). Sparse feature
//! names are C1..C26, as for `criteo_tsv`, so one recipe's tables fit both; an id `v` is looked
//! up at row `v mod rows` (Euclidean, so never negative), like TorchRec's `hashes`.
//!
//! With `world_size > 1` a rank reads the rows whose 0-based index within the split's files
//! (counted across them in order) is `rank` modulo `world_size`. With `eval_fraction`, the
//! eval rows are chosen by a hash of (seed, 1-based row number across the training files): the
//! same rule and hash as `criteo_tsv`, so the two samplers split the same lines alike.
//!
//! # Frequency threshold
//!
//! `frequency_threshold = T` (T > 1) counts, per categorical column, how often each raw value
//! occurs in the *training* rows (all ranks' rows, so every rank maps alike; the eval rows are
//! not counted). A value seen fewer than `T` times, or only in eval rows, becomes 0 (the value
//! of a missing feature) before hashing; the others are kept as they are. TorchRec's
//! `sparse_to_contiguous` (`scripts/contiguous_preproc_criteo.py`) also drops values seen
//! fewer than `T` times, but it counts over every file it is given (eval days included),
//! renumbers the kept values contiguously from 2 in order of first appearance, and maps the
//! rare ones to 1; run on such contiguous files, this sampler keeps their values as they are.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::criteo::{NUM_DENSE, NUM_SPARSE};
use crate::npy::{self, DType, NpyReader};
use crate::stream::{self, RowBlock, Shard, SplitRows, TextChunk};
use crate::{BadRowPolicy, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split};

/// Rows per chunk of parallel reading.
pub const CHUNK_ROWS: u64 = 16_384;

// ---------------------------------------------------------------------------------------------
// Conversion.

/// Options of [`convert_tsv_with`].
#[derive(Clone, Debug, PartialEq)]
pub struct ConvertOptions {
    /// Whether lines start with a label (40 columns). `false`: 39 columns and every label is
    /// written as -1, as TorchRec does for the Kaggle test set.
    pub labeled: bool,
    /// What to do with a malformed line (`Fail` stops with its file:line and writes nothing).
    pub on_bad_row: BadRowPolicy,
    /// Threads parsing the TSV.
    pub num_workers: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self { labeled: true, on_bad_row: BadRowPolicy::Fail, num_workers: 1 }
    }
}

/// What [`convert_tsv`] wrote.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConvertSummary {
    /// Rows written.
    pub rows: u64,
    /// Lines skipped as malformed (only with `on_bad_row = Skip`).
    pub skipped: u64,
    /// The smallest integer dense value `m` of the file (the transform is `ln(x - m + 2)`).
    pub dense_min: i64,
    /// The `*_dense.npy` file.
    pub dense: PathBuf,
    /// The `*_sparse.npy` file.
    pub sparse: PathBuf,
    /// The `*_labels.npy` file.
    pub labels: PathBuf,
}

/// Converts a labelled Criteo TSV into `{out_dir}/{prefix}_dense.npy`, `_sparse.npy` and
/// `_labels.npy` (see the [module docs](self) for the layout); a malformed line is an error
/// naming its file:line. Each file is written under a temporary name and renamed into place
/// only when all three are complete: nothing partial is left behind on error.
pub fn convert_tsv(tsv: &Path, out_dir: &Path, prefix: &str) -> Result<ConvertSummary, DataError> {
    convert_tsv_with(tsv, out_dir, prefix, &ConvertOptions::default())
}

/// Python's `int(text, radix)` for radix 10 or 16, or `None` where it raises.
fn py_int(text: &str, radix: u32) -> Option<i128> {
    let t = text.trim_matches(|c: char| c.is_ascii_whitespace());
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let t = if radix == 16 {
        t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).map_or(t, |r| r.strip_prefix('_').unwrap_or(r))
    } else {
        t
    };
    if t.is_empty() || t.starts_with('_') || t.ends_with('_') || t.contains("__") {
        return None;
    }
    let mut v: i128 = 0;
    for c in t.chars().filter(|&c| c != '_') {
        v = v.checked_mul(radix as i128)?.checked_add(c.to_digit(radix)? as i128)?;
    }
    Some(if neg { -v } else { v })
}

/// One parsed TSV line in TorchRec's integer form.
#[derive(Clone, Debug, PartialEq)]
struct RawRow {
    label: i32,
    dense: [i32; NUM_DENSE],
    sparse: [i64; NUM_SPARSE],
}

fn parse_raw(line: &str, labeled: bool) -> Result<RawRow, String> {
    let fields: Vec<&str> = line.split('\t').collect();
    let want = labeled as usize + NUM_DENSE + NUM_SPARSE;
    if fields.len() != want {
        return Err(format!("expected {want} tab-separated columns, found {}", fields.len()));
    }
    let or0 = |f: &str| if f.is_empty() { "0".to_string() } else { f.to_string() };
    let label = if labeled {
        let f = or0(fields[0]);
        let v = py_int(&f, 10).ok_or_else(|| format!("label must be an integer, found {:?}", fields[0]))?;
        i32::try_from(v).map_err(|_| format!("label {v} does not fit in int32"))?
    } else {
        -1
    };
    let base = labeled as usize;
    let mut dense = [0i32; NUM_DENSE];
    for (j, d) in dense.iter_mut().enumerate() {
        let f = fields[base + j];
        let v = py_int(&or0(f), 10).ok_or_else(|| format!("I{} must be an integer, found {f:?}", j + 1))?;
        *d = i32::try_from(v).map_err(|_| format!("I{} = {v} does not fit in int32", j + 1))?;
    }
    let mut sparse = [0i64; NUM_SPARSE];
    for (j, s) in sparse.iter_mut().enumerate() {
        let f = fields[base + NUM_DENSE + j];
        let v = py_int(&or0(f), 16).ok_or_else(|| format!("C{} must be hexadecimal, found {f:?}", j + 1))?;
        *s = i64::try_from(v).map_err(|_| format!("C{} = {f} does not fit in int64", j + 1))?;
    }
    Ok(RawRow { label, dense, sparse })
}

#[derive(Default)]
struct RawChunk {
    labels: Vec<i32>,
    dense: Vec<i32>,
    sparse: Vec<i64>,
    min: Option<i32>,
    skipped: u64,
    bad: Vec<String>,
}

/// Temporary files removed on drop unless [`TempFiles::commit`] renamed them into place.
struct TempFiles {
    files: Vec<(PathBuf, Option<PathBuf>)>,
}

impl TempFiles {
    fn create(&mut self, tmp: PathBuf, target: Option<PathBuf>) -> Result<BufWriter<File>, DataError> {
        let f = File::create(&tmp).map_err(|e| DataError::io(&tmp, e))?;
        self.files.push((tmp, target));
        Ok(BufWriter::with_capacity(1 << 20, f))
    }

    fn commit(mut self) -> Result<(), DataError> {
        for (tmp, target) in &self.files {
            if let Some(target) = target {
                std::fs::rename(tmp, target).map_err(|e| DataError::io(target, e))?;
            }
        }
        for (tmp, target) in std::mem::take(&mut self.files) {
            if target.is_none() {
                let _ = std::fs::remove_file(tmp);
            }
        }
        Ok(())
    }
}

impl Drop for TempFiles {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

fn finish(w: BufWriter<File>, path: &Path) -> Result<File, DataError> {
    let f = w.into_inner().map_err(|e| DataError::io(path, e.into_error()))?;
    f.sync_all().map_err(|e| DataError::io(path, e))?;
    Ok(f)
}

fn write_header_at_start(f: &mut File, path: &Path, header: &[u8]) -> Result<(), DataError> {
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(0)).map_err(|e| DataError::io(path, e))?;
    f.write_all(header).map_err(|e| DataError::io(path, e))?;
    f.sync_all().map_err(|e| DataError::io(path, e))
}

/// The header written at the end must fill the space reserved at the start (numpy's header
/// leaves room for a 21-digit row count, so it always does).
fn check_header_len(header: &[u8], reserved: usize, path: &Path) -> Result<(), DataError> {
    if header.len() != reserved {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            message: format!("the .npy header needs {} bytes, {reserved} were reserved", header.len()),
        });
    }
    Ok(())
}

/// [`convert_tsv`] with options (unlabelled input, skipping bad lines, parallel parsing).
pub fn convert_tsv_with(
    tsv: &Path,
    out_dir: &Path,
    prefix: &str,
    options: &ConvertOptions,
) -> Result<ConvertSummary, DataError> {
    stream::check_workers(options.num_workers)?;
    if prefix.is_empty() || prefix.contains(['/', '\\']) {
        return Err(DataError::config(
            "prefix",
            format!("prefix must be a non-empty file name prefix, found {prefix:?}"),
        ));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| DataError::io(out_dir, e))?;
    let target = |kind: &str| out_dir.join(format!("{prefix}_{kind}.npy"));
    let tmp = |kind: &str| out_dir.join(format!(".{prefix}_{kind}.npy.tmp-{}", std::process::id()));
    let (dense_path, sparse_path, labels_path) = (target("dense"), target("sparse"), target("labels"));
    let mut temps = TempFiles { files: Vec::new() };
    let raw_path = tmp("dense-int32");
    let mut raw = temps.create(raw_path.clone(), None)?;
    let mut sparse_w = temps.create(tmp("sparse"), Some(sparse_path.clone()))?;
    let mut labels_w = temps.create(tmp("labels"), Some(labels_path.clone()))?;
    // The header's length does not depend on the row count (numpy leaves room for 21 digits).
    let sparse_hdr_len = npy::header_bytes(DType::I64, &[0, NUM_SPARSE as u64]).len();
    let labels_hdr_len = npy::header_bytes(DType::I32, &[0, 1]).len();
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e| DataError::io(&p, e)
    };
    sparse_w.write_all(&vec![0; sparse_hdr_len]).map_err(io(&tmp("sparse")))?;
    labels_w.write_all(&vec![0; labels_hdr_len]).map_err(io(&tmp("labels")))?;

    let chunks = stream::text_chunks(tsv, stream::TEXT_CHUNK_BYTES, None)?;
    let (file, labeled, policy) = (tsv.to_path_buf(), options.labeled, options.on_bad_row);
    let parsed = stream::ordered_map(
        chunks,
        options.num_workers,
        || (),
        move |_, chunk: TextChunk, _: &AtomicBool| {
            let mut out = RawChunk::default();
            for (line_no, bytes) in chunk.lines() {
                let row = std::str::from_utf8(bytes)
                    .map_err(|_| "line is not valid UTF-8".to_string())
                    .and_then(|l| parse_raw(l, labeled));
                match row {
                    Ok(r) => {
                        out.labels.push(r.label);
                        out.dense.extend_from_slice(&r.dense);
                        out.sparse.extend_from_slice(&r.sparse);
                        let m = r.dense.iter().copied().min().unwrap_or(0);
                        out.min = Some(out.min.map_or(m, |o| o.min(m)));
                    }
                    Err(message) if policy == BadRowPolicy::Fail => {
                        return Err(DataError::BadRow { file: file.clone(), line: line_no, message });
                    }
                    Err(message) => {
                        out.skipped += 1;
                        if (out.bad.len() as u64) < stream::BAD_ROWS_LOGGED {
                            out.bad.push(format!("{}:{line_no}: {message}", file.display()));
                        }
                    }
                }
            }
            Ok(out)
        },
    );
    let (mut rows, mut skipped, mut logged, mut min) = (0u64, 0u64, 0u64, None::<i32>);
    for chunk in parsed {
        let chunk = chunk?;
        for msg in &chunk.bad {
            if logged < stream::BAD_ROWS_LOGGED {
                tracing::warn!("skipping bad row {msg}");
                logged += 1;
            }
        }
        skipped += chunk.skipped;
        rows += chunk.labels.len() as u64;
        min = match (min, chunk.min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let bytes: Vec<u8> = chunk.dense.iter().flat_map(|v| v.to_le_bytes()).collect();
        raw.write_all(&bytes).map_err(io(&raw_path))?;
        let bytes: Vec<u8> = chunk.sparse.iter().flat_map(|v| v.to_le_bytes()).collect();
        sparse_w.write_all(&bytes).map_err(io(&tmp("sparse")))?;
        let bytes: Vec<u8> = chunk.labels.iter().flat_map(|v| v.to_le_bytes()).collect();
        labels_w.write_all(&bytes).map_err(io(&tmp("labels")))?;
    }
    if skipped > 0 {
        tracing::warn!(skipped, "skipped {skipped} malformed lines of {}", tsv.display());
    }
    let Some(min) = min else {
        return Err(DataError::Format { path: tsv.to_path_buf(), message: "no rows to convert".into() });
    };
    let shape = |k: usize| [rows, k as u64];
    let mut f = finish(sparse_w, &tmp("sparse"))?;
    let header = npy::header_bytes(DType::I64, &shape(NUM_SPARSE));
    check_header_len(&header, sparse_hdr_len, &sparse_path)?;
    write_header_at_start(&mut f, &tmp("sparse"), &header)?;
    let mut f = finish(labels_w, &tmp("labels"))?;
    let header = npy::header_bytes(DType::I32, &shape(1));
    check_header_len(&header, labels_hdr_len, &labels_path)?;
    write_header_at_start(&mut f, &tmp("labels"), &header)?;
    drop(finish(raw, &raw_path)?);

    // Second pass: the dense transform needs the file's minimum.
    let mut dense_w = temps.create(tmp("dense"), Some(dense_path.clone()))?;
    dense_w.write_all(&npy::header_bytes(DType::F32, &shape(NUM_DENSE))).map_err(io(&tmp("dense")))?;
    let mut raw = File::open(&raw_path).map_err(io(&raw_path))?;
    let mut buf = vec![0u8; 4 * NUM_DENSE * 65_536];
    let mut left = rows as usize * NUM_DENSE * 4;
    while left > 0 {
        let n = left.min(buf.len());
        raw.read_exact(&mut buf[..n]).map_err(io(&raw_path))?;
        let out: Vec<u8> = buf[..n]
            .chunks_exact(4)
            .flat_map(|c| dense_transform(i32::from_le_bytes(c.try_into().expect("4 bytes")), min).to_le_bytes())
            .collect();
        dense_w.write_all(&out).map_err(io(&tmp("dense")))?;
        left -= n;
    }
    drop(finish(dense_w, &tmp("dense"))?);
    temps.commit()?;
    Ok(ConvertSummary {
        rows,
        skipped,
        dense_min: min as i64,
        dense: dense_path,
        sparse: sparse_path,
        labels: labels_path,
    })
}

/// TorchRec's dense transform of one integer value given the file's minimum:
/// `ln(f32(x - min + 2))`, correctly rounded to `f32`.
pub fn dense_transform(x: i32, min: i32) -> f32 {
    (((x as i64 - min as i64 + 2) as f32) as f64).ln() as f32
}

// ---------------------------------------------------------------------------------------------
// The sampler.

/// TorchRec's preprocessed binary Criteo layout (`*_dense.npy`, `*_sparse.npy`,
/// `*_labels.npy`). `[data.sampler]` with `kind = "criteo_binary"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CriteoBinaryConfig {
    /// Directory of the `.npy` files, relative to the recipe file's directory.
    #[serde(default = "defaults::dir")]
    pub dir: String,
    /// Prefixes of the training files, read in this order: prefix `day_0` reads
    /// `day_0_dense.npy`, `day_0_sparse.npy` and `day_0_labels.npy` in `dir`.
    #[serde(default = "defaults::train")]
    pub train: Vec<String>,
    /// Prefixes of the eval files. When given, the eval split is these files (all their rows)
    /// and `eval_fraction` must not be set.
    #[serde(default)]
    pub eval: Vec<String>,
    /// Without `eval` files: the fraction of training rows held out for evaluation, chosen by a
    /// hash of (seed, row number), the same rows as `criteo_tsv` holds out of the same lines
    /// (default 0.1).
    #[serde(default)]
    pub eval_fraction: Option<f64>,
    /// Raw categorical values seen fewer than this many times in the training rows become 0
    /// before hashing (0 or 1: off). Counted per column over all ranks' training rows.
    #[serde(default)]
    pub frequency_threshold: u64,
    /// What to do with a bad row (a label other than 0 or 1, a non-finite dense value).
    #[serde(default = "defaults::on_bad_row")]
    pub on_bad_row: BadRowPolicy,
    /// Threads reading the files (batches are the same for any number).
    #[serde(default = "defaults::num_workers")]
    pub num_workers: usize,
}

mod defaults {
    pub fn dir() -> String {
        ".".into()
    }
    pub fn train() -> Vec<String> {
        vec!["train".into()]
    }
    pub fn on_bad_row() -> crate::BadRowPolicy {
        crate::BadRowPolicy::Skip
    }
    pub fn num_workers() -> usize {
        1
    }
}

/// The three files of one prefix.
#[derive(Clone, Debug)]
struct Part {
    dense: PathBuf,
    sparse: PathBuf,
    labels: PathBuf,
    rows: u64,
    /// Index of the part's first row among its split's rows.
    first: u64,
}

/// The TorchRec binary Criteo sampler.
#[derive(Clone, Debug)]
pub struct CriteoBinarySampler {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    schema: FeatureSchema,
    train: Vec<Part>,
    eval: Vec<Part>,
    /// `Some` when the eval split is hashed out of the training files.
    eval_fraction: Option<f64>,
    /// Per column, the raw values seen at least `frequency_threshold` times in training rows.
    frequent: Option<Vec<HashSet<i64>>>,
    rows: Vec<u64>,
    seed: u64,
    shard: Shard,
    on_bad_row: BadRowPolicy,
    num_workers: usize,
    chunk_rows: u64,
}

/// A range of rows of one part.
#[derive(Clone, Copy, Debug)]
struct RowChunk {
    part: usize,
    start: u64,
    rows: u64,
}

/// Per-worker open files: (part index, readers for dense, sparse, labels).
type Open = Option<(usize, [NpyReader; 3])>;

fn row_chunks(parts: &[Part], chunk_rows: u64) -> Vec<RowChunk> {
    let mut out = Vec::new();
    for (p, part) in parts.iter().enumerate() {
        let mut start = 0;
        while start < part.rows {
            let rows = chunk_rows.max(1).min(part.rows - start);
            out.push(RowChunk { part: p, start, rows });
            start += rows;
        }
    }
    out
}

impl CriteoBinarySampler {
    /// The features (I1..I13 dense, C1..C26 sparse, as `criteo_tsv`).
    pub fn feature_schema(_config: &CriteoBinaryConfig) -> FeatureSchema {
        crate::criteo::criteo_features()
    }

    /// Builds the sampler: checks every file's header and shape, and counts categorical values
    /// for `frequency_threshold`.
    /// Checks the config without reading rows: values in range, every prefix's three files
    /// present (relative to `base_dir`) with the shapes of their headers. Returns the workers,
    /// the eval fraction, and the train and eval parts.
    #[allow(clippy::type_complexity)]
    fn checked(
        config: &CriteoBinaryConfig,
        base_dir: &Path,
    ) -> Result<(usize, Option<f64>, Vec<Part>, Vec<Part>), DataError> {
        let num_workers = stream::check_workers(config.num_workers)?;
        let eval_fraction = stream::eval_fraction(config.eval_fraction, !config.eval.is_empty(), "eval (eval files)")?;
        if config.train.is_empty() {
            return Err(DataError::config("train", "name at least one training file prefix"));
        }
        let dir = base_dir.join(&config.dir);
        let train = parts(&dir, &config.train, "train")?;
        let eval = parts(&dir, &config.eval, "eval")?;
        Ok((num_workers, eval_fraction, train, eval))
    }

    /// Checks the config without reading rows (see `checked`): values in range, the files
    /// present with the right header shapes.
    pub fn check(config: &CriteoBinaryConfig, base_dir: &Path) -> Result<(), DataError> {
        Self::checked(config, base_dir).map(drop)
    }

    /// Builds the sampler (counting frequencies first with `frequency_threshold`).
    pub fn build(config: CriteoBinaryConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        let (num_workers, eval_fraction, train, eval) = Self::checked(&config, &ctx.base_dir)?;
        let shard = Shard::of(ctx)?;
        let schema = Self::feature_schema(&config);
        let rows = schema.sparse.iter().map(|f| ctx.rows(f)).collect::<Result<Vec<_>, _>>()?;
        let mut inner = Inner {
            schema,
            train,
            eval,
            eval_fraction,
            frequent: None,
            rows,
            seed: ctx.seed,
            shard,
            on_bad_row: config.on_bad_row,
            num_workers,
            chunk_rows: CHUNK_ROWS,
        };
        if config.frequency_threshold > 1 {
            inner.frequent = Some(count_frequent(&inner, config.frequency_threshold)?);
        }
        Ok(Self { inner: Arc::new(inner) })
    }
}

fn parts(dir: &Path, prefixes: &[String], key: &str) -> Result<Vec<Part>, DataError> {
    let mut out: Vec<Part> = Vec::new();
    for (i, p) in prefixes.iter().enumerate() {
        if p.is_empty() {
            return Err(DataError::config(format!("{key}[{i}]"), "a file prefix must not be empty"));
        }
        let path = |kind: &str| dir.join(format!("{p}_{kind}.npy"));
        let (dense, sparse, labels) = (path("dense"), path("sparse"), path("labels"));
        let header = |path: &Path| {
            npy::read_header(path).map_err(|e| match e {
                DataError::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => {
                    DataError::config(format!("{key}[{i}]"), format!("prefix {p:?}: {} does not exist", path.display()))
                }
                e => e,
            })
        };
        let (hd, hs, hl) = (header(&dense)?, header(&sparse)?, header(&labels)?);
        let shape_err = |path: &Path, want: &str, h: &npy::NpyHeader| DataError::Format {
            path: path.to_path_buf(),
            message: format!("expected shape {want}, found {:?} ({})", h.shape, h.dtype.descr()),
        };
        if hd.shape.len() != 2 || hd.row_len() != NUM_DENSE as u64 {
            return Err(shape_err(&dense, "[N, 13]", &hd));
        }
        if hs.shape.len() != 2 || hs.row_len() != NUM_SPARSE as u64 || hs.dtype.is_float() {
            return Err(shape_err(&sparse, "[N, 26] of integers", &hs));
        }
        if !(hl.shape.len() == 1 || (hl.shape.len() == 2 && hl.row_len() == 1)) {
            return Err(shape_err(&labels, "[N, 1] or [N]", &hl));
        }
        if hd.rows() != hs.rows() || hd.rows() != hl.rows() {
            return Err(DataError::Format {
                path: dense.clone(),
                message: format!(
                    "prefix {p:?}: dense, sparse and labels files have {}, {} and {} rows",
                    hd.rows(),
                    hs.rows(),
                    hl.rows()
                ),
            });
        }
        let first = out.last().map_or(0, |l| l.first + l.rows);
        out.push(Part { dense, sparse, labels, rows: hd.rows(), first });
    }
    Ok(out)
}

/// The raw values of each column seen at least `threshold` times in training rows.
fn count_frequent(inner: &Inner, threshold: u64) -> Result<Vec<HashSet<i64>>, DataError> {
    let parts = Arc::new(inner.train.clone());
    let train = SplitRows::new(Split::Train, inner.eval_fraction, inner.seed);
    let units = row_chunks(&parts, inner.chunk_rows).into_iter().map(Ok);
    let p2 = Arc::clone(&parts);
    let counted = stream::ordered_map(
        units,
        inner.num_workers,
        || None::<(usize, NpyReader)>,
        move |open, c: RowChunk, _: &AtomicBool| {
            let part = &p2[c.part];
            if open.as_ref().is_none_or(|(p, _)| *p != c.part) {
                *open = Some((c.part, NpyReader::open(&part.sparse)?));
            }
            let (_, reader) = open.as_mut().expect("opened above");
            let mut ids = Vec::new();
            reader.read_i64(c.start, c.rows, &mut ids)?;
            let mut counts: Vec<HashMap<i64, u64>> = vec![HashMap::new(); NUM_SPARSE];
            for (r, row) in ids.chunks_exact(NUM_SPARSE).enumerate() {
                let number = part.first + c.start + r as u64 + 1;
                if !train.keeps(number) {
                    continue;
                }
                for (f, &v) in row.iter().enumerate() {
                    *counts[f].entry(v).or_default() += 1;
                }
            }
            Ok(counts)
        },
    );
    let mut total: Vec<HashMap<i64, u64>> = vec![HashMap::new(); NUM_SPARSE];
    for counts in counted {
        for (t, c) in total.iter_mut().zip(counts?) {
            for (v, n) in c {
                *t.entry(v).or_default() += n;
            }
        }
    }
    Ok(total.into_iter().map(|t| t.into_iter().filter(|&(_, n)| n >= threshold).map(|(v, _)| v).collect()).collect())
}

impl Inner {
    /// Parses the rows of `c` (a chunk of `split`'s files) that belong to this rank and `split`.
    fn parse_chunk(
        &self,
        open: &mut Open,
        c: RowChunk,
        split: SplitRows,
        stop: &AtomicBool,
    ) -> Result<RowBlock, DataError> {
        let part = &split.files(&self.train, &self.eval)[c.part];
        if open.as_ref().is_none_or(|(p, _)| *p != c.part) {
            *open = Some((
                c.part,
                [NpyReader::open(&part.dense)?, NpyReader::open(&part.sparse)?, NpyReader::open(&part.labels)?],
            ));
        }
        let (_, [dense_r, sparse_r, labels_r]) = open.as_mut().expect("opened above");
        let mut block = RowBlock::new(NUM_DENSE, 1, NUM_SPARSE, false);
        let (mut dense, mut ids, mut labels) = (Vec::new(), Vec::new(), Vec::new());
        dense_r.read_f32(c.start, c.rows, &mut dense)?;
        sparse_r.read_i64(c.start, c.rows, &mut ids)?;
        labels_r.read_f32(c.start, c.rows, &mut labels)?;
        for r in 0..c.rows as usize {
            if r % 4096 == 0 && stop.load(Ordering::Relaxed) {
                break;
            }
            let index = part.first + c.start + r as u64;
            if !self.shard.owns(index) || !split.keeps(index + 1) {
                continue;
            }
            let d = &dense[r * NUM_DENSE..(r + 1) * NUM_DENSE];
            let label = labels[r];
            let problem = if label != 0.0 && label != 1.0 {
                Some(format!("label must be 0 or 1, found {label}"))
            } else {
                d.iter().position(|v| !v.is_finite()).map(|j| format!("dense value I{} is {}", j + 1, d[j]))
            };
            if let Some(message) = problem {
                let location = format!("row {}", c.start + r as u64);
                block.bad_row(self.on_bad_row, || DataError::BadRecord {
                    file: part.labels.clone(),
                    location,
                    message,
                })?;
                continue;
            }
            block.labels.push(label);
            block.dense.extend_from_slice(d);
            for (f, bags) in block.bags.iter_mut().enumerate() {
                let mut v = ids[r * NUM_SPARSE + f];
                if let Some(freq) = &self.frequent {
                    if !freq[f].contains(&v) {
                        v = 0;
                    }
                }
                bags.push_one(v.rem_euclid(self.rows[f] as i64));
            }
            block.rows += 1;
        }
        Ok(block)
    }
}

impl Sampler for CriteoBinarySampler {
    fn schema(&self) -> &FeatureSchema {
        &self.inner.schema
    }

    /// Rows in file order; `epoch` does not change the order.
    fn batches(&self, split: Split, _epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        let s = &self.inner;
        let split = SplitRows::new(split, s.eval_fraction, s.seed);
        let parts = split.files(&s.train, &s.eval);
        let source = parts.first().map_or_else(String::new, |p| p.dense.display().to_string());
        let units = row_chunks(parts, s.chunk_rows).into_iter().map(Ok);
        let inner = Arc::clone(&self.inner);
        let parse = move |open: &mut Open, c, stop: &AtomicBool| inner.parse_chunk(open, c, split, stop);
        Ok(stream::read_batches(&s.schema, source, units, s.num_workers, || None, parse, batch_size).into_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Batch;

    /// A Criteo TSV of `n` rows whose row `i` has label `i % 2`, I1 = `i`, C1 = `i` and
    /// C2 = `i % 5`, converted into `dir` as prefix `p`.
    fn converted(dir: &Path, p: &str, n: usize) {
        let text: String = (0..n)
            .map(|i| {
                let mut f = vec![(i % 2).to_string(), i.to_string()];
                f.extend((1..13).map(|_| String::new()));
                f.push(format!("{i:x}"));
                f.push(format!("{:x}", i % 5));
                f.extend((2..26).map(|_| String::new()));
                f.join("\t") + "\n"
            })
            .collect();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(format!("{p}.tsv")), text).unwrap();
        convert_tsv_with(
            &dir.join(format!("{p}.tsv")),
            dir,
            p,
            &ConvertOptions { num_workers: 2, ..Default::default() },
        )
        .unwrap();
    }

    fn ctx(dir: &Path) -> SamplerContext {
        SamplerContext {
            feature_rows: (1..=26).map(|i| (format!("C{i}"), 1 << 30)).collect(),
            base_dir: dir.to_path_buf(),
            seed: 5,
            rank: 0,
            world_size: 1,
        }
    }

    fn config(train: &[&str]) -> CriteoBinaryConfig {
        CriteoBinaryConfig {
            dir: ".".into(),
            train: train.iter().map(|s| s.to_string()).collect(),
            eval: vec![],
            eval_fraction: Some(0.3),
            frequency_threshold: 0,
            on_bad_row: BadRowPolicy::Fail,
            num_workers: 1,
        }
    }

    fn c1(s: &CriteoBinarySampler, split: Split, bs: usize) -> Vec<i64> {
        let batches: Vec<Batch> = s.batches(split, 0, bs).unwrap().map(Result::unwrap).collect();
        batches.iter().flat_map(|b| b.sparse.feature(0).values.to_vec()).collect()
    }

    #[test]
    fn files_in_order_any_workers_and_chunks() {
        let dir = std::env::temp_dir().join(format!("trainrec-binary-{}-order", std::process::id()));
        converted(&dir, "day_0", 1500);
        converted(&dir, "day_1", 700);
        // Row numbers run on across files: day_1's row i is row 1500 + i.
        let ids: Vec<(u64, i64)> = (0..1500).chain(0..700).enumerate().map(|(g, i)| (g as u64, i as i64)).collect();
        let want = |eval: bool| -> Vec<i64> {
            ids.iter().filter(|(g, _)| stream::is_eval_row(5, g + 1, 0.3) == eval).map(|&(_, i)| i).collect()
        };
        for (w, chunk) in [(1, CHUNK_ROWS), (1, 100), (2, 100), (3, 7), (4, 1)] {
            let mut s = CriteoBinarySampler::build(
                CriteoBinaryConfig { num_workers: w, ..config(&["day_0", "day_1"]) },
                &ctx(&dir),
            )
            .unwrap();
            Arc::get_mut(&mut s.inner).unwrap().chunk_rows = chunk;
            assert_eq!(c1(&s, Split::Train, 64), want(false), "workers={w} chunk={chunk}");
            assert_eq!(c1(&s, Split::Eval, 1000), want(true), "workers={w} chunk={chunk}");
            let mut it = s.batches(Split::Train, 0, 3).unwrap();
            assert_eq!(it.next().unwrap().unwrap().batch_size, 3);
            drop(it);
        }
        // Frequency threshold over training rows only: C2 = i % 5 is frequent, C1 = i unique.
        let cfg = CriteoBinaryConfig { frequency_threshold: 2, num_workers: 2, ..config(&["day_0", "day_1"]) };
        let s = CriteoBinarySampler::build(cfg, &ctx(&dir)).unwrap();
        let b: Vec<Batch> = s.batches(Split::Train, 0, 5000).unwrap().map(Result::unwrap).collect();
        // C1 values 0..700 occur twice (once per file) unless one occurrence is an eval row.
        let train_rows: Vec<(u64, i64)> =
            ids.iter().copied().filter(|(g, _)| !stream::is_eval_row(5, g + 1, 0.3)).collect();
        let mut count: HashMap<i64, u64> = HashMap::new();
        for &(_, i) in &train_rows {
            *count.entry(i).or_default() += 1;
        }
        let want_c1: Vec<i64> = train_rows.iter().map(|&(_, i)| if count[&i] >= 2 { i } else { 0 }).collect();
        assert_eq!(b[0].sparse.feature(0).values, &want_c1[..]);
        assert_eq!(b[0].sparse.feature(1).values, &train_rows.iter().map(|&(_, i)| i % 5).collect::<Vec<_>>()[..]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn python_int_rules() {
        assert_eq!(py_int("12", 10), Some(12));
        assert_eq!(py_int(" -3 ", 10), Some(-3));
        assert_eq!(py_int("+1_000", 10), Some(1000));
        assert_eq!(py_int("1__0", 10), None);
        assert_eq!(py_int("", 10), None);
        assert_eq!(py_int("0x1F", 16), Some(31));
        assert_eq!(py_int("fF", 16), Some(255));
        assert_eq!(py_int("g", 16), None);
        assert_eq!(py_int("1.5", 10), None);
    }

    #[test]
    fn raw_rows_follow_torchrec_row_mapper() {
        let mut f = vec!["1".to_string(), "".into(), "-2".into()];
        f.extend((3..=13).map(|i| i.to_string()));
        f.extend(["a".into(), "".into()]);
        f.extend((3..=26).map(|i| format!("{i:x}")));
        let r = parse_raw(&f.join("\t"), true).unwrap();
        assert_eq!(r.label, 1);
        assert_eq!(&r.dense[..3], &[0, -2, 3]);
        assert_eq!(&r.sparse[..3], &[10, 0, 3]);
        let unl = parse_raw(&f[1..].join("\t"), false).unwrap();
        assert_eq!(unl.label, -1);
        assert_eq!(unl.dense, r.dense);
        assert!(parse_raw(&f[1..].join("\t"), true).unwrap_err().contains("expected 40"));
        f[1] = "99999999999".into();
        assert!(parse_raw(&f.join("\t"), true).unwrap_err().contains("I1 = 99999999999 does not fit in int32"));
        // The transform: missing (0) with a minimum of -2 is ln(4).
        assert_eq!(dense_transform(0, -2), 4f32.ln());
        assert_eq!(dense_transform(-2, -2), 2f32.ln());
    }
}
