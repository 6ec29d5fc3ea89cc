//! The streaming, parallel reading layer of the file samplers.
//!
//! A source is cut into fixed *chunks* (a block of whole lines of a text file, a range of rows
//! of a `.npy` file, one Parquet row group). [`ordered_map`] hands chunk `c` to worker
//! `c % num_workers`; each worker parses its chunks in order into a bounded queue of its own,
//! and the consumer takes chunk `c` from worker `c % num_workers`'s queue. Output order is
//! therefore chunk order, whatever the number of workers, and at most
//! `num_workers * (QUEUE_DEPTH + 1)` parsed chunks are in memory at once.
//!
//! Dropping the consumer ([`Ordered`], or a [`Batcher`] over it) raises a stop flag, closes the
//! queues (a worker blocked on a full queue wakes up with an error and exits) and joins every
//! thread, so `.take(n)` on a batch stream neither hangs nor leaks a blocked thread.
//!
//! Parsed rows travel as [`RowBlock`]s; [`Batcher`] cuts a stream of blocks into batches of
//! exactly `batch_size` examples (the last may be smaller), counts the rows the parsers skipped
//! and logs the first few with their location.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{Batch, BatchStream, DataError, FeatureSchema, SamplerContext, Split};

/// What to do with a malformed row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BadRowPolicy {
    /// Skip it, count it, and log the first few with file:line.
    Skip,
    /// Stop with an error naming file:line and what is wrong.
    Fail,
}

/// Parsed chunks each worker may queue ahead of the consumer.
pub const QUEUE_DEPTH: usize = 2;
/// Bad rows logged (with their location) per pass before only counting.
pub const BAD_ROWS_LOGGED: u64 = 5;
/// Bytes of text per chunk (a chunk always ends at a line end).
pub const TEXT_CHUNK_BYTES: usize = 1 << 20;

/// The share of the data this process reads: items whose index is `rank` modulo `world_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This process's rank.
    pub rank: u64,
    /// Ranks reading together (at least 1).
    pub world_size: u64,
}

impl Shard {
    /// The shard of `ctx` (`world_size = 0` is read as 1); an error when `rank >= world_size`.
    pub fn of(ctx: &SamplerContext) -> Result<Self, DataError> {
        let world_size = ctx.world_size.max(1) as u64;
        let rank = ctx.rank as u64;
        if rank >= world_size {
            return Err(DataError::config("", format!("rank {rank} is not below world_size {world_size}")));
        }
        Ok(Self { rank, world_size })
    }

    /// Whether item `index` (0-based) belongs to this shard.
    pub fn owns(&self, index: u64) -> bool {
        index % self.world_size == self.rank
    }
}

/// Checks a `num_workers` config value.
pub fn check_workers(num_workers: usize) -> Result<usize, DataError> {
    if num_workers == 0 || num_workers > 256 {
        return Err(DataError::config("num_workers", format!("num_workers must be in 1..=256, found {num_workers}")));
    }
    Ok(num_workers)
}

/// The chunks of [`ordered_map`] in chunk order; dropping it stops and joins the workers.
pub struct Ordered<O> {
    outputs: Vec<Receiver<Result<O, DataError>>>,
    handles: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    next: usize,
    finished: bool,
}

/// Runs `work` over `units` on `num_workers` threads, yielding results in unit order.
///
/// `units` runs on a thread of its own (it may read a file); an `Err` unit is passed through in
/// its place and ends the stream. Each worker gets its own state from `init` (for example open
/// file handles). Unit `c` goes to worker `c % num_workers`.
pub fn ordered_map<U, O, S, I, F>(
    units: I,
    num_workers: usize,
    init: impl Fn() -> S + Send + Sync + 'static,
    work: F,
) -> Ordered<O>
where
    U: Send + 'static,
    O: Send + 'static,
    S: 'static,
    I: Iterator<Item = Result<U, DataError>> + Send + 'static,
    F: Fn(&mut S, U, &AtomicBool) -> Result<O, DataError> + Send + Sync + 'static,
{
    let num_workers = num_workers.max(1);
    let stop = Arc::new(AtomicBool::new(false));
    let work = Arc::new(work);
    let init = Arc::new(init);
    let mut inputs: Vec<SyncSender<Result<U, DataError>>> = Vec::with_capacity(num_workers);
    let mut outputs = Vec::with_capacity(num_workers);
    let mut handles = Vec::with_capacity(num_workers + 1);
    for w in 0..num_workers {
        let (in_tx, in_rx) = sync_channel::<Result<U, DataError>>(QUEUE_DEPTH);
        let (out_tx, out_rx) = sync_channel::<Result<O, DataError>>(QUEUE_DEPTH);
        inputs.push(in_tx);
        outputs.push(out_rx);
        let (work, init, stop) = (Arc::clone(&work), Arc::clone(&init), Arc::clone(&stop));
        let handle = std::thread::Builder::new()
            .name(format!("trainrec-data-{w}"))
            .spawn(move || {
                let mut state = init();
                while let Ok(unit) = in_rx.recv() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let out = unit.and_then(|u| work(&mut state, u, &stop));
                    let failed = out.is_err();
                    if out_tx.send(out).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawning a data reader thread");
        handles.push(handle);
    }
    let dist_stop = Arc::clone(&stop);
    let distributor = std::thread::Builder::new()
        .name("trainrec-data-split".into())
        .spawn(move || {
            for (c, unit) in units.enumerate() {
                if dist_stop.load(Ordering::Relaxed) {
                    return;
                }
                let failed = unit.is_err();
                if inputs[c % num_workers].send(unit).is_err() || failed {
                    return;
                }
            }
        })
        .expect("spawning a data reader thread");
    handles.push(distributor);
    Ordered { outputs, handles, stop, next: 0, finished: false }
}

impl<O> Ordered<O> {
    fn shut_down(&mut self) -> Option<String> {
        self.stop.store(true, Ordering::Relaxed);
        self.outputs.clear();
        let mut panicked = None;
        for h in self.handles.drain(..) {
            if let Err(p) = h.join() {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                panicked.get_or_insert(msg);
            }
        }
        panicked
    }
}

impl<O> Iterator for Ordered<O> {
    type Item = Result<O, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        let w = self.next % self.outputs.len();
        match self.outputs[w].recv() {
            Ok(item) => {
                self.next += 1;
                if item.is_err() {
                    self.finished = true;
                    self.shut_down();
                }
                Some(item)
            }
            Err(_) => {
                // The worker that owns the next chunk is gone: either the units ran out (every
                // worker drained its queue and exited) or it panicked.
                self.finished = true;
                self.shut_down().map(|p| Err(DataError::Reader(p)))
            }
        }
    }
}

impl<O> Drop for Ordered<O> {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A block of whole lines of a text file.
#[derive(Clone, Debug)]
pub struct TextChunk {
    /// 1-based number of the chunk's first line.
    pub first_line: u64,
    /// The lines, `\n`-separated (the last may lack its `\n` at the end of the file).
    pub data: Vec<u8>,
}

impl TextChunk {
    /// The chunk's lines with their 1-based numbers, without `\n` or a trailing `\r`.
    pub fn lines(&self) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        let data = self.data.strip_suffix(b"\n").unwrap_or(&self.data);
        let empty = data.is_empty() && self.data.is_empty();
        data.split(|&b| b == b'\n')
            .filter(move |_| !empty)
            .enumerate()
            .map(|(i, l)| (self.first_line + i as u64, l.strip_suffix(b"\r").unwrap_or(l)))
    }
}

/// Reads a text file as [`TextChunk`]s of about `chunk_bytes` (at least one whole line each),
/// stopping after `max_lines` lines when given.
pub fn text_chunks(
    path: &Path,
    chunk_bytes: usize,
    max_lines: Option<u64>,
) -> Result<impl Iterator<Item = Result<TextChunk, DataError>> + Send + 'static, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    Ok(TextChunks {
        file,
        path: path.to_path_buf(),
        carry: Vec::new(),
        next_line: 1,
        chunk_bytes: chunk_bytes.max(1),
        max_lines,
        eof: false,
    })
}

struct TextChunks {
    file: File,
    path: PathBuf,
    carry: Vec<u8>,
    next_line: u64,
    chunk_bytes: usize,
    max_lines: Option<u64>,
    eof: bool,
}

impl Iterator for TextChunks {
    type Item = Result<TextChunk, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.max_lines.is_some_and(|m| self.next_line > m) {
            return None;
        }
        let mut data = std::mem::take(&mut self.carry);
        let cut = loop {
            // The carried-over bytes hold no line end, so the last one is in what was read last.
            if let Some(p) = data.iter().rposition(|&b| b == b'\n') {
                if data.len() >= self.chunk_bytes || self.eof {
                    break p + 1;
                }
            }
            if self.eof {
                break data.len();
            }
            let want = self.chunk_bytes.max(data.len() / 2);
            let start = data.len();
            data.resize(start + want, 0);
            match read_full(&mut self.file, &mut data[start..]) {
                Ok(n) => {
                    data.truncate(start + n);
                    if n < want {
                        self.eof = true;
                    }
                }
                Err(e) => {
                    self.eof = true;
                    self.max_lines = Some(0);
                    return Some(Err(DataError::io(&self.path, e)));
                }
            }
        };
        self.carry = data.split_off(cut);
        if data.is_empty() {
            return None;
        }
        let mut lines = data.iter().filter(|&&b| b == b'\n').count() as u64;
        if !data.ends_with(b"\n") {
            lines += 1;
        }
        let chunk = TextChunk { first_line: self.next_line, data };
        self.next_line += lines;
        Some(Ok(chunk))
    }
}

fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The bags of one sparse feature over a block of rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bags {
    /// All ids, bag after bag.
    pub values: Vec<i64>,
    /// Ids per row.
    pub lengths: Vec<u32>,
}

impl Bags {
    /// Appends a bag of one id.
    pub fn push_one(&mut self, id: i64) {
        self.values.push(id);
        self.lengths.push(1);
    }
}

/// Parsed rows of one chunk, plus the bad rows its parser skipped.
#[derive(Clone, Debug, Default)]
pub struct RowBlock {
    /// Dense features per row.
    pub num_dense: usize,
    /// Label columns per row.
    pub num_labels: usize,
    /// `[rows, num_dense]` row-major.
    pub dense: Vec<f32>,
    /// `[rows, num_labels]` row-major.
    pub labels: Vec<f32>,
    /// One entry per sparse feature.
    pub bags: Vec<Bags>,
    /// A grouping key per row, when the source has one.
    pub groups: Option<Vec<i64>>,
    /// A weight per row, when the source has a weight column ([`RowBlock::weighted`]).
    pub weights: Option<Vec<f32>>,
    /// Rows in the block.
    pub rows: usize,
    /// Bad rows skipped while parsing the chunk.
    pub skipped: u64,
    /// Where and why, for the first [`BAD_ROWS_LOGGED`] of them.
    pub bad: Vec<String>,
}

impl RowBlock {
    /// An empty block.
    pub fn new(num_dense: usize, num_labels: usize, num_sparse: usize, grouped: bool) -> Self {
        Self {
            num_dense,
            num_labels,
            bags: vec![Bags::default(); num_sparse],
            groups: grouped.then(Vec::new),
            ..Default::default()
        }
    }

    /// This block with a weight per row (`weighted`), or without.
    pub fn weighted(mut self, weighted: bool) -> Self {
        self.weights = weighted.then(Vec::new);
        self
    }

    /// Records a skipped bad row (`what` names its location and the problem).
    pub fn skip(&mut self, what: impl FnOnce() -> String) {
        self.skipped += 1;
        if (self.bad.len() as u64) < BAD_ROWS_LOGGED {
            self.bad.push(what());
        }
    }

    /// A bad row under `policy`: `Fail` returns `error()`, `Skip` skips the row, logged as the
    /// error reads.
    pub fn bad_row(&mut self, policy: BadRowPolicy, error: impl FnOnce() -> DataError) -> Result<(), DataError> {
        if policy == BadRowPolicy::Fail {
            return Err(error());
        }
        self.skip(|| error().to_string());
        Ok(())
    }
}

/// Where to log skipped rows.
#[derive(Debug)]
struct BadRowLog {
    source: String,
    skipped: u64,
    logged: u64,
}

/// Cuts a stream of [`RowBlock`]s into [`Batch`]es of `batch_size` examples.
pub struct Batcher<I> {
    blocks: I,
    keys: Vec<String>,
    num_dense: usize,
    num_labels: usize,
    grouped: bool,
    weighted: bool,
    batch_size: usize,
    current: Option<(RowBlock, usize, Vec<usize>)>,
    log: BadRowLog,
    done: bool,
}

impl<I: Iterator<Item = Result<RowBlock, DataError>> + Send + 'static> Batcher<I> {
    /// Batches of the blocks of `source` (named in the skipped-rows log) with sparse `keys`.
    pub fn new(
        blocks: I,
        source: impl Into<String>,
        keys: Vec<String>,
        num_dense: usize,
        num_labels: usize,
        grouped: bool,
        batch_size: usize,
    ) -> Self {
        Self {
            blocks,
            keys,
            num_dense,
            num_labels,
            grouped,
            weighted: false,
            batch_size: batch_size.max(1),
            current: None,
            log: BadRowLog { source: source.into(), skipped: 0, logged: 0 },
            done: false,
        }
    }

    /// This batcher expecting a weight per row in every block (`weighted`), as the batches'
    /// [`Batch::weights`].
    pub fn weighted(mut self, weighted: bool) -> Self {
        self.weighted = weighted;
        self
    }

    /// This batcher as a [`BatchStream`].
    pub fn into_stream(self) -> BatchStream {
        Box::new(self)
    }

    fn finish(&mut self) {
        self.done = true;
        if self.log.skipped > 0 {
            tracing::warn!(
                skipped = self.log.skipped,
                "skipped {} malformed rows in {}",
                self.log.skipped,
                self.log.source
            );
        }
    }

    fn next_batch(&mut self) -> Option<Result<Batch, DataError>> {
        if self.done {
            return None;
        }
        let nk = self.keys.len();
        let mut dense = Vec::with_capacity(self.batch_size * self.num_dense);
        let mut labels = Vec::with_capacity(self.batch_size * self.num_labels);
        let mut groups = self.grouped.then(|| Vec::with_capacity(self.batch_size));
        let mut weights = self.weighted.then(|| Vec::with_capacity(self.batch_size));
        let mut values: Vec<Vec<i64>> = vec![Vec::new(); nk];
        let mut lengths: Vec<Vec<u32>> = vec![Vec::with_capacity(self.batch_size); nk];
        let mut n = 0;
        while n < self.batch_size {
            if self.current.as_ref().is_none_or(|(b, row, _)| *row >= b.rows) {
                match self.blocks.next() {
                    None => {
                        self.finish();
                        break;
                    }
                    Some(Err(e)) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                    Some(Ok(block)) => {
                        for msg in &block.bad {
                            if self.log.logged < BAD_ROWS_LOGGED {
                                tracing::warn!("skipping bad row {msg}");
                                self.log.logged += 1;
                            }
                        }
                        self.log.skipped += block.skipped;
                        if block.num_dense != self.num_dense
                            || block.num_labels != self.num_labels
                            || block.bags.len() != nk
                            || block.groups.is_some() != self.grouped
                            || block.weights.is_some() != self.weighted
                        {
                            self.done = true;
                            return Some(Err(DataError::Reader("a parsed block does not match the schema".into())));
                        }
                        self.current = Some((block, 0, vec![0; nk]));
                        continue;
                    }
                }
            }
            let Some((block, row, cursors)) = self.current.as_mut() else { break };
            let take = (self.batch_size - n).min(block.rows - *row);
            let (a, b) = (*row, *row + take);
            dense.extend_from_slice(&block.dense[a * self.num_dense..b * self.num_dense]);
            labels.extend_from_slice(&block.labels[a * self.num_labels..b * self.num_labels]);
            if let (Some(g), Some(bg)) = (groups.as_mut(), block.groups.as_ref()) {
                g.extend_from_slice(&bg[a..b]);
            }
            if let (Some(w), Some(bw)) = (weights.as_mut(), block.weights.as_ref()) {
                w.extend_from_slice(&bw[a..b]);
            }
            for (k, bags) in block.bags.iter().enumerate() {
                let lens = &bags.lengths[a..b];
                let count: usize = lens.iter().map(|&l| l as usize).sum();
                values[k].extend_from_slice(&bags.values[cursors[k]..cursors[k] + count]);
                lengths[k].extend_from_slice(lens);
                cursors[k] += count;
            }
            *row = b;
            n += take;
        }
        if n == 0 {
            return None;
        }
        let sparse = KeyedJaggedTensor::new(self.keys.clone(), values.concat(), None, lengths.concat(), n);
        Some(sparse.map_err(DataError::from).map(|sparse| Batch {
            dense,
            num_dense: self.num_dense,
            sparse,
            labels,
            batch_size: n,
            groups,
            weights,
        }))
    }
}

impl<I: Iterator<Item = Result<RowBlock, DataError>> + Send + 'static> Iterator for Batcher<I> {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch()
    }
}

/// Whether a 1-based line (or row) number falls in the hash-chosen eval fraction: a hash of
/// (seed, number), the same rule for every sampler that holds out rows by `eval_fraction`.
pub fn is_eval_row(seed: u64, number: u64, eval_fraction: f64) -> bool {
    let h = crate::hash_words(&[seed, 0xC417E0, number]);
    ((h >> 11) as f64 / (1u64 << 53) as f64) < eval_fraction
}

/// Checks an `eval_fraction` config value (`key` names it).
/// `path` (relative to `base`) as a file that exists, or a config error naming `key`.
pub fn existing_file(base: &Path, path: &str, key: &str) -> Result<PathBuf, DataError> {
    let full = base.join(path);
    if full.is_file() {
        return Ok(full);
    }
    let what = if full.is_dir() { "is a directory, not a file" } else { "does not exist" };
    Err(DataError::config(key, format!("{} {what}", full.display())))
}

/// `path` (relative to `base`) as a path that exists (a file or a directory), or a config
/// error naming `key`.
pub fn existing_path(base: &Path, path: &str, key: &str) -> Result<PathBuf, DataError> {
    let full = base.join(path);
    if full.exists() {
        return Ok(full);
    }
    Err(DataError::config(key, format!("{} does not exist", full.display())))
}

/// `value` as a fraction in `[0, 1)`, or a config error naming `key`.
pub fn check_fraction(key: &str, value: f64) -> Result<f64, DataError> {
    if !(0.0..1.0).contains(&value) {
        return Err(DataError::config(key, format!("{key} must be in [0, 1), found {value}")));
    }
    Ok(value)
}

/// The hash-split fraction of a sampler whose eval split is either files of its own
/// (`has_eval_files`; `eval_key` names them in the error for setting both) or the
/// `eval_fraction` of its training rows (checked; 0.1 when unset): `None` with eval files.
pub fn eval_fraction(
    eval_fraction: Option<f64>,
    has_eval_files: bool,
    eval_key: &str,
) -> Result<Option<f64>, DataError> {
    match (eval_fraction, has_eval_files) {
        (Some(_), true) => {
            Err(DataError::config("eval_fraction", format!("set either {eval_key} or eval_fraction, not both")))
        }
        (Some(f), false) => Ok(Some(check_fraction("eval_fraction", f)?)),
        (None, false) => Ok(Some(0.1)),
        (None, true) => Ok(None),
    }
}

/// What one split reads, for a sampler whose eval split is either files of its own or, with an
/// eval fraction, the rows of its training files that [`is_eval_row`] holds out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitRows {
    /// Whether the split reads the training files (the eval split does when it is hashed out of
    /// them).
    train_files: bool,
    /// With a hash split: the eval fraction, and whether this is its eval side.
    hashed: Option<(f64, bool)>,
    seed: u64,
}

impl SplitRows {
    /// `split` of a sampler that hashes its rows with `seed` (`eval_fraction = None`: the eval
    /// split is files of its own).
    pub fn new(split: Split, eval_fraction: Option<f64>, seed: u64) -> Self {
        Self {
            train_files: split == Split::Train || eval_fraction.is_some(),
            hashed: eval_fraction.map(|f| (f, split == Split::Eval)),
            seed,
        }
    }

    /// `train` or `eval`, whichever files the split reads.
    pub fn files<'a, P>(&self, train: &'a [P], eval: &'a [P]) -> &'a [P] {
        if self.train_files { train } else { eval }
    }

    /// Whether the row with 1-based `number` (counted across the files) is in the split: every
    /// row of eval files of its own, else the rows whose eval hash falls on the split's side.
    pub fn keeps(&self, number: u64) -> bool {
        self.hashed.is_none_or(|(f, eval)| is_eval_row(self.seed, number, f) == eval)
    }
}

/// The batches of one pass, read in parallel: [`ordered_map`] runs `parse` over `units` on
/// `num_workers` threads (each with its own state from `init`) and a [`Batcher`] cuts the
/// blocks, in unit order, into batches of `batch_size` with `schema`'s features (`source` names
/// the data in the skipped-rows log); [`Batcher::into_stream`] makes it a [`BatchStream`].
pub fn read_batches<U, S, I, F>(
    schema: &FeatureSchema,
    source: String,
    units: I,
    num_workers: usize,
    init: impl Fn() -> S + Send + Sync + 'static,
    parse: F,
    batch_size: usize,
) -> Batcher<Ordered<RowBlock>>
where
    U: Send + 'static,
    S: 'static,
    I: Iterator<Item = Result<U, DataError>> + Send + 'static,
    F: Fn(&mut S, U, &AtomicBool) -> Result<RowBlock, DataError> + Send + Sync + 'static,
{
    let blocks = ordered_map(units, num_workers, init, parse);
    let (num_dense, num_labels, grouped) = (schema.num_dense, schema.labels.len(), schema.grouping_key.is_some());
    Batcher::new(blocks, source, schema.sparse.clone(), num_dense, num_labels, grouped, batch_size)
}

/// A stable 64-bit hash of bytes (FNV-1a, then a SplitMix64 finalizer): string ids hash to the
/// same value on every platform and run.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    crate::splitmix64(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-stream-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn text_chunks_cover_every_line_once_with_numbers() {
        let dir = temp_dir("chunks");
        let text: String = (1..=1000).map(|i| format!("line {i}{}\n", "x".repeat(i % 37))).collect();
        for (name, body) in [("a.txt", text.clone()), ("b.txt", text.trim_end().to_string()), ("c.txt", String::new())]
        {
            let path = dir.join(name);
            std::fs::write(&path, &body).unwrap();
            for chunk_bytes in [1, 7, 100, 4096, 1 << 20] {
                let mut seen = Vec::new();
                let mut chunks = 0;
                for c in text_chunks(&path, chunk_bytes, None).unwrap() {
                    chunks += 1;
                    for (no, line) in c.unwrap().lines() {
                        seen.push((no, String::from_utf8(line.to_vec()).unwrap()));
                    }
                }
                let want: Vec<(u64, String)> =
                    body.lines().enumerate().map(|(i, l)| (i as u64 + 1, l.to_string())).collect();
                assert_eq!(seen, want, "{name} chunk_bytes={chunk_bytes}");
                if chunk_bytes == 1 && !body.is_empty() {
                    assert!(chunks > 500, "small chunks: {chunks}");
                }
            }
            let capped: usize =
                text_chunks(&path, 64, Some(10)).unwrap().map(|c| c.unwrap().lines().count()).sum::<usize>();
            assert!(body.is_empty() || capped >= 10, "max_lines stops after the chunk holding line 10");
        }
    }

    #[test]
    fn ordered_map_keeps_order_for_any_worker_count() {
        for workers in [1, 2, 3, 8] {
            let units = (0..200u64).map(Ok);
            let out: Vec<u64> = ordered_map(
                units,
                workers,
                || (),
                |_, u: u64, _: &AtomicBool| {
                    // Uneven work so workers finish out of order.
                    std::thread::sleep(Duration::from_micros((u * 7919) % 300));
                    Ok(u * u)
                },
            )
            .map(Result::unwrap)
            .collect();
            assert_eq!(out, (0..200u64).map(|u| u * u).collect::<Vec<_>>(), "workers={workers}");
        }
    }

    #[test]
    fn errors_come_in_order_and_end_the_stream() {
        let units = (0..50u64).map(|u| if u == 30 { Err(DataError::Reader("unit 30".into())) } else { Ok(u) });
        let out: Vec<Result<u64, DataError>> = ordered_map(
            units,
            3,
            || (),
            |_, u, _: &AtomicBool| {
                if u == 20 { Err(DataError::Reader("work 20".into())) } else { Ok(u) }
            },
        )
        .collect();
        assert_eq!(out.len(), 21);
        assert!(out[..20].iter().enumerate().all(|(i, r)| matches!(r, Ok(v) if *v == i as u64)));
        assert_eq!(out[20].as_ref().unwrap_err().to_string(), "data reader thread failed: work 20");
    }

    #[test]
    fn a_panicking_worker_is_an_error_not_a_short_stream() {
        let out: Vec<Result<u64, DataError>> = ordered_map(
            (0..10u64).map(Ok),
            2,
            || (),
            |_, u, _: &AtomicBool| if u == 5 { panic!("boom") } else { Ok(u) },
        )
        .collect();
        assert_eq!(out.len(), 6);
        assert!(out[5].as_ref().unwrap_err().to_string().contains("boom"));
    }

    #[test]
    fn dropping_early_stops_and_joins_the_workers() {
        let live = Arc::new(AtomicUsize::new(0));
        struct Alive(Arc<AtomicUsize>);
        impl Drop for Alive {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let start = Instant::now();
        {
            let l = Arc::clone(&live);
            let mut it = ordered_map(
                (0..u64::MAX).map(Ok),
                4,
                move || {
                    l.fetch_add(1, Ordering::SeqCst);
                    Alive(Arc::clone(&l))
                },
                |_, u, _: &AtomicBool| Ok(vec![u; 1000]),
            );
            assert_eq!(it.next().unwrap().unwrap()[0], 0);
            assert_eq!(it.nth(10).unwrap().unwrap()[0], 11);
        }
        assert_eq!(live.load(Ordering::SeqCst), 0, "every worker's state was dropped: its thread ended");
        assert!(start.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn batcher_cuts_blocks_across_boundaries() {
        let block = |start: i64, rows: usize| {
            let mut b = RowBlock::new(1, 1, 2, true);
            for r in 0..rows as i64 {
                let v = start + r;
                b.dense.push(v as f32);
                b.labels.push((v % 2) as f32);
                b.bags[0].push_one(v);
                // Feature 1: bag of `v % 3` ids.
                for j in 0..(v % 3) {
                    b.bags[1].values.push(100 * v + j);
                }
                b.bags[1].lengths.push((v % 3) as u32);
                b.groups.as_mut().unwrap().push(v / 4);
                b.rows += 1;
            }
            b
        };
        let blocks = vec![Ok(block(0, 3)), Ok(RowBlock::new(1, 1, 2, true)), Ok(block(3, 5)), Ok(block(8, 2))];
        let keys = vec!["a".to_string(), "b".to_string()];
        let batches: Vec<Batch> =
            Batcher::new(blocks.into_iter(), "test", keys, 1, 1, true, 4).map(Result::unwrap).collect();
        assert_eq!(batches.iter().map(|b| b.batch_size).collect::<Vec<_>>(), vec![4, 4, 2]);
        let mut all_a = Vec::new();
        let mut all_b = Vec::new();
        for b in &batches {
            all_a.extend_from_slice(b.sparse.feature(0).values);
            for i in 0..b.batch_size {
                all_b.push(b.sparse.feature(1).bag(i).to_vec());
            }
            assert_eq!(b.dense.iter().map(|&d| d as i64).collect::<Vec<_>>(), b.sparse.feature(0).values);
            assert_eq!(
                b.groups.as_ref().unwrap(),
                &b.sparse.feature(0).values.iter().map(|v| v / 4).collect::<Vec<_>>()
            );
        }
        assert_eq!(all_a, (0..10).collect::<Vec<i64>>());
        let want_b: Vec<Vec<i64>> = (0..10).map(|v| (0..v % 3).map(|j| 100 * v + j).collect()).collect();
        assert_eq!(all_b, want_b);
    }

    #[test]
    fn split_rows_pick_files_and_partition_hashed_rows() {
        let (train, eval) = (SplitRows::new(Split::Train, Some(0.3), 7), SplitRows::new(Split::Eval, Some(0.3), 7));
        assert_eq!((train.files(&[1], &[2]), eval.files(&[1], &[2])), (&[1][..], &[1][..]));
        for n in 1..500 {
            assert_eq!(eval.keeps(n), is_eval_row(7, n, 0.3));
            assert_ne!(train.keeps(n), eval.keeps(n));
        }
        let own = SplitRows::new(Split::Eval, None, 7);
        assert_eq!(own.files(&[1], &[2]), &[2][..]);
        assert!((1..500).all(|n| own.keeps(n) && SplitRows::new(Split::Train, None, 7).keeps(n)));
        assert_eq!(eval_fraction(None, false, "eval").unwrap(), Some(0.1));
        assert_eq!(eval_fraction(None, true, "eval").unwrap(), None);
        assert_eq!(eval_fraction(Some(0.5), false, "eval").unwrap(), Some(0.5));
        let err = eval_fraction(Some(0.5), true, "eval_paths").unwrap_err();
        assert_eq!(err.to_string(), "set either eval_paths or eval_fraction, not both");
        assert!(eval_fraction(Some(1.0), false, "eval").is_err());
    }

    #[test]
    fn bad_rows_fail_or_skip_as_the_error_reads() {
        let err = || DataError::BadRow { file: "f.csv".into(), line: 3, message: "bad".into() };
        let mut block = RowBlock::default();
        assert_eq!(block.bad_row(BadRowPolicy::Fail, err).unwrap_err().to_string(), "f.csv:3: bad");
        assert_eq!(block.skipped, 0);
        for _ in 0..BAD_ROWS_LOGGED + 2 {
            block.bad_row(BadRowPolicy::Skip, err).unwrap();
        }
        assert_eq!(block.skipped, BAD_ROWS_LOGGED + 2);
        assert_eq!(block.bad, vec!["f.csv:3: bad".to_string(); BAD_ROWS_LOGGED as usize]);
    }

    #[test]
    fn stable_hash_is_fixed() {
        // FNV-1a of "" is the offset basis; the finalizer is splitmix64.
        assert_eq!(stable_hash(b""), crate::splitmix64(0xCBF2_9CE4_8422_2325));
        assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
        assert_eq!(stable_hash(b"user_42"), stable_hash(b"user_42"));
    }
}
