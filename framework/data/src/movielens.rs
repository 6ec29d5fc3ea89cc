//! `kind = "movielens"`: MovieLens ratings as (user, item) examples.
//!
//! Reads the ml-100k `u.data` layout (tab-separated `user item rating timestamp`, no header;
//! also `u1.base` and the like), the ml-latest / ml-20m / ml-25m `ratings.csv` layout (a header
//! naming `userId`, `movieId`, `rating` and `timestamp`, in any order, comma-separated) and the
//! ml-1m / ml-10m `ratings.dat` layout (`UserID::MovieID::Rating::Timestamp`). The whole file is
//! parsed at build time (on `num_workers` threads) and kept in memory.
//!
//! Each example has two sparse features, `user_id` and `item_id` (one id each, looked up at row
//! `id mod rows`), no dense features, one label column `label`, and the raw user id as its
//! grouping key ([`crate::Batch::groups`], `grouping_key = "user"`) for grouped AUC and NDCG.
//! No table needs to read `user_id` (a model such as SASRec knows a user by their history):
//! unread, it carries the raw user ids.
//!
//! With `history_length = N`, a third sparse feature, `history`, holds the user's history
//! before the example's rating: the items of the user's training ratings that come earlier in
//! time (by timestamp, ties by line), oldest first and most recent last, the latest `N` of them
//! (ids mod the rows of the table that reads `history`). An example never sees its own item or
//! anything after it, and no eval rating is ever in a history: its item is what the model is
//! asked about. With `split = "leave_one_out"` (each user's latest rating held out) the eval
//! example's history is the user's whole training sequence: the next-item protocol of the
//! sequential-recommendation literature (SASRec, BERT4Rec).
//!
//! Sharding with `world_size > 1`: the training rows of an epoch are shuffled (the same
//! permutation on every rank) and a rank takes the shuffled positions that are `rank` modulo
//! `world_size`; the eval rows are sharded by user (`user_id mod world_size`), so each user's
//! eval ratings, one group of the ranking metrics, stay on one rank.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use trainrec_sparse::KeyedJaggedTensor;

use crate::stream::{self, Shard, TextChunk};
use crate::{BadRowPolicy, Batch, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split, hash_words};

/// Which MovieLens file layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MovieLensFormat {
    /// `ratings_csv` when the file name ends in `.csv` or the first line starts with `userId`,
    /// `ratings_dat` when it ends in `.dat`, otherwise `u_data`.
    #[default]
    Auto,
    /// ml-100k `u.data`: `user<TAB>item<TAB>rating<TAB>timestamp`, no header.
    UData,
    /// ml-latest `ratings.csv`: header `userId,movieId,rating,timestamp`, comma-separated.
    RatingsCsv,
    /// ml-1m `ratings.dat`: `UserID::MovieID::Rating::Timestamp`, no header.
    RatingsDat,
}

/// How a rating becomes a label.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MovieLensLabel {
    /// 1 when `rating >= threshold`, else 0 (for AUC and log loss).
    #[default]
    Threshold,
    /// `rating / max_rating`, in [0, 1] (for regression with MSE-style metrics).
    Scaled,
}

/// How the eval split is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MovieLensSplit {
    /// Each rating is eval with probability `eval_fraction`, by a hash of (seed, line number).
    #[default]
    Random,
    /// Per user, the latest `min(ceil(eval_fraction * n), n - 1)` of the user's `n` ratings by
    /// timestamp (ties: later line) are eval: a small fraction is leave-last-out, and every
    /// user keeps at least one training rating.
    Temporal,
    /// Per user, the latest rating by timestamp (ties: later line) is eval, the others train;
    /// a user with one rating keeps it for training. `eval_fraction` is not read. The
    /// leave-one-out protocol of next-item recommendation (one held-out item per user).
    LeaveOneOut,
}

/// MovieLens ratings (`u.data`, `ratings.csv`, `ratings.dat`) as user and item ids with a
/// rating label. `[data.sampler]` with `kind = "movielens"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MovieLensConfig {
    /// The ratings file (`u.data`, `ratings.csv`, `ratings.dat`), relative to the recipe file's
    /// directory.
    pub path: String,
    /// The file layout.
    #[serde(default)]
    pub format: MovieLensFormat,
    /// How a rating becomes the label.
    #[serde(default)]
    pub label: MovieLensLabel,
    /// With `label = "threshold"`: ratings at or above this are positive.
    #[serde(default = "defaults::threshold")]
    pub threshold: f64,
    /// The highest rating: `label = "scaled"` divides by it, and a rating above it (or below 0)
    /// is a bad row.
    #[serde(default = "defaults::max_rating")]
    pub max_rating: f64,
    /// How the eval split is chosen.
    #[serde(default)]
    pub split: MovieLensSplit,
    /// Fraction of ratings held out for evaluation (see `split`).
    #[serde(default = "defaults::eval_fraction")]
    pub eval_fraction: f64,
    /// What to do with a malformed line (wrong field count, non-integer id or timestamp,
    /// rating outside `[0, max_rating]`).
    #[serde(default = "defaults::on_bad_row")]
    pub on_bad_row: BadRowPolicy,
    /// Threads parsing the file at build time.
    #[serde(default = "defaults::num_workers")]
    pub num_workers: usize,
    /// Gives each example the sparse feature `history`: the items of the user's earlier
    /// training ratings, most recent last, at most this many (1..=10000). A table must read
    /// `history` (the item table, to share the items' embeddings, as DIN and SASRec do).
    /// Unset: no history.
    #[serde(default)]
    pub history_length: Option<usize>,
}

/// The longest history `history_length` may ask for.
pub const MAX_HISTORY_LENGTH: usize = 10_000;

mod defaults {
    pub fn threshold() -> f64 {
        4.0
    }
    pub fn max_rating() -> f64 {
        5.0
    }
    pub fn eval_fraction() -> f64 {
        0.1
    }
    pub fn on_bad_row() -> crate::BadRowPolicy {
        crate::BadRowPolicy::Skip
    }
    pub fn num_workers() -> usize {
        1
    }
}

/// One rating.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rating {
    /// User id as in the file.
    pub user: i64,
    /// Item (movie) id as in the file.
    pub item: i64,
    /// The rating.
    pub rating: f32,
    /// Unix timestamp.
    pub timestamp: i64,
    /// 1-based line of the file.
    pub line: u64,
}

/// Where each field is, for a resolved layout.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Layout {
    Tab,
    Csv { user: usize, item: usize, rating: usize, timestamp: usize, fields: usize },
    Dat,
}

/// The MovieLens sampler.
#[derive(Clone, Debug)]
pub struct MovieLensSampler {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: MovieLensConfig,
    schema: FeatureSchema,
    train: Vec<Rating>,
    eval: Vec<Rating>,
    rows: [u64; 2],
    seed: u64,
    shard: Shard,
    history: Option<History>,
}

/// The sparse feature holding each example's user history.
pub const HISTORY: &str = "history";

/// The rows of the table that reads `history`, or an error naming the key that asked for it.
fn history_rows(ctx: &SamplerContext) -> Result<u64, DataError> {
    ctx.rows(HISTORY).map_err(|_| {
        DataError::config(
            "history_length",
            "history_length gives examples the sparse feature \"history\", which no table reads: add it to a \
             table's features (the item table's, to share the items' embeddings)",
        )
    })
}

/// Users' histories: per user, the items of their training ratings in time order, and per
/// train and eval rating, where its history ends in its user's sequence.
#[derive(Debug)]
struct History {
    /// The most ids a history holds.
    length: usize,
    /// Per user (its index in [`timelines`]): training items (ids mod the history table's
    /// rows), oldest first.
    sequences: Vec<Vec<i64>>,
    /// For the train and the eval ratings, in their order: (user index, training ratings
    /// before it).
    split_at: [Vec<(u32, u32)>; 2],
}

impl History {
    /// The users' training sequences from their `timelines` (see [`timelines`]), and for each
    /// rating of `ratings` its (user index, training ratings before it); `split_at` is left to
    /// the caller, who splits the ratings.
    fn new(
        ratings: &[Rating],
        timelines: &[Vec<usize>],
        eval: &[bool],
        length: usize,
        rows: u64,
    ) -> (Self, Vec<(u32, u32)>) {
        let mut at = vec![(0, 0); ratings.len()];
        let mut sequences = Vec::with_capacity(timelines.len());
        for (u, idx) in timelines.iter().enumerate() {
            let mut seq = Vec::new();
            for &i in idx {
                at[i] = (u as u32, seq.len() as u32);
                if !eval[i] {
                    seq.push(ratings[i].item.rem_euclid(rows as i64));
                }
            }
            sequences.push(seq);
        }
        (Self { length, sequences, split_at: [Vec::new(), Vec::new()] }, at)
    }

    /// The history of a rating at `(user, before)`: the latest `length` items before it.
    fn of(&self, (user, before): (u32, u32)) -> &[i64] {
        let seq = &self.sequences[user as usize][..before as usize];
        &seq[seq.len().saturating_sub(self.length)..]
    }
}

fn parse_id(field: &str, what: &str) -> Result<i64, String> {
    field
        .trim()
        .parse::<i64>()
        .ok()
        .filter(|v| *v >= 0)
        .ok_or_else(|| format!("{what} must be a non-negative integer, found {field:?}"))
}

fn parse_rating_line(line: &str, layout: &Layout, max_rating: f64) -> Result<(i64, i64, f32, i64), String> {
    let fields: Vec<&str> = match layout {
        Layout::Tab => line.split('\t').collect(),
        Layout::Csv { .. } => line.split(',').collect(),
        Layout::Dat => line.split("::").collect(),
    };
    let (u, i, r, t, want, sep) = match layout {
        Layout::Tab => (0, 1, 2, 3, 4, "tab-separated"),
        Layout::Dat => (0, 1, 2, 3, 4, "'::'-separated"),
        Layout::Csv { user, item, rating, timestamp, fields } => {
            (*user, *item, *rating, *timestamp, *fields, "comma-separated")
        }
    };
    if fields.len() != want {
        return Err(format!("expected {want} {sep} fields, found {}", fields.len()));
    }
    let user = parse_id(fields[u], "user id")?;
    let item = parse_id(fields[i], "item id")?;
    let rating: f64 =
        fields[r].trim().parse().map_err(|_| format!("rating must be a number, found {:?}", fields[r]))?;
    if !(0.0..=max_rating).contains(&rating) {
        return Err(format!("rating {rating} is outside [0, max_rating = {max_rating}]"));
    }
    let timestamp: i64 =
        fields[t].trim().parse().map_err(|_| format!("timestamp must be an integer, found {:?}", fields[t]))?;
    Ok((user, item, rating as f32, timestamp))
}

fn first_line(path: &Path) -> Result<String, DataError> {
    use std::io::BufRead;
    let f = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let mut line = String::new();
    std::io::BufReader::new(f).take(1 << 16).read_line(&mut line).map_err(|e| DataError::io(path, e))?;
    Ok(line.trim_end_matches(['\n', '\r']).to_string())
}

fn resolve_layout(path: &Path, format: MovieLensFormat) -> Result<Layout, DataError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let first = first_line(path)?;
    let format = match format {
        MovieLensFormat::Auto if name.ends_with(".csv") || first.starts_with("userId") => MovieLensFormat::RatingsCsv,
        MovieLensFormat::Auto if name.ends_with(".dat") => MovieLensFormat::RatingsDat,
        MovieLensFormat::Auto => MovieLensFormat::UData,
        f => f,
    };
    Ok(match format {
        MovieLensFormat::UData => Layout::Tab,
        MovieLensFormat::RatingsDat => Layout::Dat,
        _ => {
            let cols: Vec<&str> = first.split(',').map(str::trim).collect();
            let find = |name: &str| cols.iter().position(|c| *c == name);
            match (find("userId"), find("movieId"), find("rating"), find("timestamp")) {
                (Some(user), Some(item), Some(rating), Some(timestamp)) => {
                    Layout::Csv { user, item, rating, timestamp, fields: cols.len() }
                }
                _ => {
                    return Err(DataError::BadRow {
                        file: path.to_path_buf(),
                        line: 1,
                        message: format!(
                            "format ratings_csv needs a header naming userId, movieId, rating and timestamp, found {first:?}"
                        ),
                    });
                }
            }
        }
    })
}

impl MovieLensSampler {
    /// The features: sparse `user_id` and `item_id`, no dense features, label `label`,
    /// grouped by user.
    pub fn feature_schema(config: &MovieLensConfig) -> FeatureSchema {
        let mut sparse = vec!["user_id".to_owned(), "item_id".to_owned()];
        if config.history_length.is_some() {
            sparse.push(HISTORY.to_owned());
        }
        FeatureSchema { num_dense: 0, sparse, labels: vec!["label".to_owned()], grouping_key: Some("user".to_owned()) }
    }

    /// Builds the sampler: reads and splits the whole file.
    /// Checks the config without reading data: values in range, the ratings file or
    /// directory present (relative to `base_dir`).
    pub fn check(config: &MovieLensConfig, base_dir: &std::path::Path) -> Result<(), DataError> {
        stream::check_fraction("eval_fraction", config.eval_fraction)?;
        stream::check_workers(config.num_workers)?;
        if !(config.max_rating.is_finite() && config.max_rating > 0.0) {
            return Err(DataError::config(
                "max_rating",
                format!("max_rating must be positive, found {}", config.max_rating),
            ));
        }
        if config.label == MovieLensLabel::Threshold && !config.threshold.is_finite() {
            return Err(DataError::config(
                "threshold",
                format!("threshold must be a number, found {}", config.threshold),
            ));
        }
        if let Some(n) = config.history_length
            && !(1..=MAX_HISTORY_LENGTH).contains(&n)
        {
            return Err(DataError::config(
                "history_length",
                format!("history_length = {n} must be in 1..={MAX_HISTORY_LENGTH}"),
            ));
        }
        stream::existing_path(base_dir, &config.path, "path").map(drop)
    }

    /// Builds the sampler: reads the ratings.
    pub fn build(config: MovieLensConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        Self::check(&config, &ctx.base_dir)?;
        let workers = stream::check_workers(config.num_workers)?;
        let shard = Shard::of(ctx)?;
        let schema = Self::feature_schema(&config);
        // A model that knows a user only by their history (SASRec) needs no user table: the
        // raw user ids then travel unread.
        let users = match ctx.rows("user_id") {
            Ok(rows) => rows,
            Err(_) => {
                tracing::info!("no table reads user_id: the model sees users only through their features");
                i64::MAX as u64
            }
        };
        let rows = [users, ctx.rows("item_id")?];
        let path = ctx.base_dir.join(&config.path);
        let layout = Arc::new(resolve_layout(&path, config.format)?);
        let ratings = read_ratings(&path, Arc::clone(&layout), &config, workers)?;
        // Each user's ratings in time order, for a split by time and for histories.
        let timelines = match (config.split, config.history_length) {
            (MovieLensSplit::Random, None) => Vec::new(),
            _ => timelines(&ratings),
        };
        let eval_flags = split_flags(&ratings, &timelines, &config, ctx.seed);
        let (history, history_at) = match config.history_length {
            Some(length) => {
                let (h, at) = History::new(&ratings, &timelines, &eval_flags, length, history_rows(ctx)?);
                (Some(h), at)
            }
            None => (None, Vec::new()),
        };
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        let mut at = [Vec::new(), Vec::new()];
        for (i, (r, is_eval)) in ratings.into_iter().zip(eval_flags).enumerate() {
            let split = if !is_eval {
                train.push(r);
                0
            } else if shard.owns(r.user as u64) {
                eval.push(r);
                1
            } else {
                continue;
            };
            if history.is_some() {
                at[split].push(history_at[i]);
            }
        }
        let history = history.map(|h| History { split_at: at, ..h });
        Ok(Self { inner: Arc::new(Inner { config, schema, train, eval, rows, seed: ctx.seed, shard, history }) })
    }

    /// The training ratings (all ranks'), in file order.
    pub fn train_ratings(&self) -> &[Rating] {
        &self.inner.train
    }

    /// This rank's eval ratings, in file order.
    pub fn eval_ratings(&self) -> &[Rating] {
        &self.inner.eval
    }
}

fn read_ratings(
    path: &Path,
    layout: Arc<Layout>,
    config: &MovieLensConfig,
    workers: usize,
) -> Result<Vec<Rating>, DataError> {
    let chunks = stream::text_chunks(path, stream::TEXT_CHUNK_BYTES, None)?;
    let (file, policy, max_rating) = (PathBuf::from(path), config.on_bad_row, config.max_rating);
    let header = matches!(*layout, Layout::Csv { .. });
    let parsed = stream::ordered_map(
        chunks,
        workers,
        || (),
        move |_, chunk: TextChunk, _: &AtomicBool| {
            let mut out = (Vec::new(), Vec::new(), 0u64);
            for (line, bytes) in chunk.lines() {
                if header && line == 1 {
                    continue;
                }
                let parsed = std::str::from_utf8(bytes)
                    .map_err(|_| "line is not valid UTF-8".to_string())
                    .and_then(|l| parse_rating_line(l, &layout, max_rating));
                match parsed {
                    Ok((user, item, rating, timestamp)) => out.0.push(Rating { user, item, rating, timestamp, line }),
                    Err(message) if policy == BadRowPolicy::Fail => {
                        return Err(DataError::BadRow { file: file.clone(), line, message });
                    }
                    Err(message) => {
                        out.2 += 1;
                        if (out.1.len() as u64) < stream::BAD_ROWS_LOGGED {
                            out.1.push(format!("{}:{line}: {message}", file.display()));
                        }
                    }
                }
            }
            Ok(out)
        },
    );
    let (mut ratings, mut skipped, mut logged) = (Vec::new(), 0u64, 0u64);
    for chunk in parsed {
        let (rows, bad, count) = chunk?;
        for msg in bad {
            if logged < stream::BAD_ROWS_LOGGED {
                tracing::warn!("skipping bad row {msg}");
                logged += 1;
            }
        }
        skipped += count;
        ratings.extend(rows);
    }
    if skipped > 0 {
        tracing::warn!(skipped, "skipped malformed lines in {}", path.display());
    }
    if ratings.is_empty() {
        return Err(DataError::Format { path: path.to_path_buf(), message: "no ratings".into() });
    }
    Ok(ratings)
}

/// Each user's ratings (indices into `ratings`) in time order: by timestamp, ties by line.
fn timelines(ratings: &[Rating]) -> Vec<Vec<usize>> {
    let mut users: HashMap<i64, usize> = HashMap::new();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, r) in ratings.iter().enumerate() {
        let u = *users.entry(r.user).or_insert_with(|| {
            out.push(Vec::new());
            out.len() - 1
        });
        out[u].push(i);
    }
    for idx in &mut out {
        idx.sort_by_key(|&i| (ratings[i].timestamp, ratings[i].line));
    }
    out
}

/// Whether each rating is in the eval split; `timelines` (see [`timelines`]) for the splits
/// by time.
fn split_flags(ratings: &[Rating], timelines: &[Vec<usize>], config: &MovieLensConfig, seed: u64) -> Vec<bool> {
    if config.split == MovieLensSplit::Random {
        return ratings.iter().map(|r| stream::is_eval_row(seed, r.line, config.eval_fraction)).collect();
    }
    let mut flags = vec![false; ratings.len()];
    for idx in timelines {
        let n = idx.len();
        // The user's latest k ratings; every user keeps at least one for training.
        let k = match config.split {
            MovieLensSplit::LeaveOneOut => 1,
            _ => (config.eval_fraction * n as f64).ceil() as usize,
        };
        for &i in &idx[n - k.min(n.saturating_sub(1))..] {
            flags[i] = true;
        }
    }
    flags
}

impl Inner {
    fn label(&self, rating: f32) -> f32 {
        match self.config.label {
            MovieLensLabel::Threshold => (rating as f64 >= self.config.threshold) as u8 as f32,
            MovieLensLabel::Scaled => (rating as f64 / self.config.max_rating) as f32,
        }
    }

    fn batch(&self, split: Split, order: &[u32]) -> Result<Batch, DataError> {
        let rows = if split == Split::Train { &self.train } else { &self.eval };
        let n = order.len();
        let mut values = Vec::with_capacity(2 * n);
        values.extend(order.iter().map(|&i| rows[i as usize].user.rem_euclid(self.rows[0] as i64)));
        values.extend(order.iter().map(|&i| rows[i as usize].item.rem_euclid(self.rows[1] as i64)));
        let mut lengths = vec![1; 2 * n];
        if let Some(h) = &self.history {
            let at = &h.split_at[usize::from(split == Split::Eval)];
            for &i in order {
                let items = h.of(at[i as usize]);
                values.extend_from_slice(items);
                lengths.push(items.len() as u32);
            }
        }
        let labels = order.iter().map(|&i| self.label(rows[i as usize].rating)).collect();
        let groups = order.iter().map(|&i| rows[i as usize].user).collect();
        let sparse = KeyedJaggedTensor::new(self.schema.sparse.clone(), values, None, lengths, n)?;
        Ok(Batch {
            dense: Vec::new(),
            num_dense: 0,
            sparse,
            labels,
            batch_size: n,
            groups: Some(groups),
            weights: None,
        })
    }
}

impl Sampler for MovieLensSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.inner.schema
    }

    /// Training rows are shuffled by (seed, epoch); eval rows come in file order, the same on
    /// every call.
    fn batches(&self, split: Split, epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        let inner = Arc::clone(&self.inner);
        let order: Vec<u32> = match split {
            Split::Train => {
                let mut all: Vec<u32> = (0..inner.train.len() as u32).collect();
                all.shuffle(&mut StdRng::seed_from_u64(hash_words(&[inner.seed, 0x004D_4F56_4945, epoch])));
                all.into_iter().enumerate().filter(|(p, _)| inner.shard.owns(*p as u64)).map(|(_, i)| i).collect()
            }
            Split::Eval => (0..inner.eval.len() as u32).collect(),
        };
        let bs = batch_size.max(1);
        let mut start = 0;
        Ok(Box::new(std::iter::from_fn(move || {
            if start >= order.len() {
                return None;
            }
            let end = (start + bs).min(order.len());
            let b = inner.batch(split, &order[start..end]);
            start = end;
            Some(b)
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn temp_file(name: &str, file: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-ml-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(file), text).unwrap();
        dir
    }

    fn ctx(dir: &Path, rows: u64) -> SamplerContext {
        SamplerContext {
            feature_rows: [("user_id".to_string(), rows), ("item_id".to_string(), rows)].into(),
            base_dir: dir.to_path_buf(),
            seed: 7,
            rank: 0,
            world_size: 1,
        }
    }

    fn config(path: &str) -> MovieLensConfig {
        MovieLensConfig {
            path: path.into(),
            format: MovieLensFormat::Auto,
            label: MovieLensLabel::Threshold,
            threshold: 4.0,
            max_rating: 5.0,
            split: MovieLensSplit::Random,
            eval_fraction: 0.0,
            on_bad_row: BadRowPolicy::Fail,
            num_workers: 1,
            history_length: None,
        }
    }

    /// (user, item, label, group) of every example of a pass.
    fn examples(s: &MovieLensSampler, split: Split, epoch: u64, bs: usize) -> Vec<(i64, i64, f32, i64)> {
        let mut out = Vec::new();
        for b in s.batches(split, epoch, bs).unwrap() {
            let b = b.unwrap();
            assert_eq!((b.num_dense, b.dense.len()), (0, 0));
            let g = b.groups.clone().unwrap();
            assert_eq!(g.len(), b.batch_size);
            for (r, &group) in g.iter().enumerate() {
                out.push((b.sparse.feature(0).values[r], b.sparse.feature(1).values[r], b.labels[r], group));
            }
        }
        out
    }

    const U_DATA: &str = "1\t10\t5\t100\n1\t11\t3\t300\n1\t12\t4\t200\n2\t10\t1\t50\n2\t13\t4\t60\n3\t11\t2\t10\n";

    #[test]
    fn u_data_labels_ids_and_groups() {
        let dir = temp_file("udata", "u.data", U_DATA);
        let s = MovieLensSampler::build(config("u.data"), &ctx(&dir, 12)).unwrap();
        assert_eq!(s.schema().grouping_key.as_deref(), Some("user"));
        let mut got = examples(&s, Split::Train, 0, 4);
        got.sort_by_key(|e| (e.3, e.1));
        // Items are hashed by `id % 12`; groups keep the raw user id; label: rating >= 4.
        let want =
            vec![(1, 10, 1.0, 1), (1, 11, 0.0, 1), (1, 0, 1.0, 1), (2, 10, 0.0, 2), (2, 1, 1.0, 2), (3, 11, 0.0, 3)];
        let mut want_sorted = want.clone();
        want_sorted.sort_by_key(|e| (e.3, e.1));
        assert_eq!(got, want_sorted);
        let scaled = MovieLensSampler::build(
            MovieLensConfig { label: MovieLensLabel::Scaled, ..config("u.data") },
            &ctx(&dir, 100),
        )
        .unwrap();
        let mut labels: Vec<f32> = examples(&scaled, Split::Train, 0, 10).iter().map(|e| e.2).collect();
        labels.sort_by(f32::total_cmp);
        assert_eq!(labels, vec![0.2, 0.4, 0.6, 0.8, 0.8, 1.0]);
        let th =
            MovieLensSampler::build(MovieLensConfig { threshold: 3.0, ..config("u.data") }, &ctx(&dir, 100)).unwrap();
        assert_eq!(examples(&th, Split::Train, 0, 10).iter().map(|e| e.2).sum::<f32>(), 4.0);
    }

    /// (user, item, history) of every example of a pass, sorted.
    fn histories(s: &MovieLensSampler, split: Split, bs: usize) -> Vec<(i64, i64, Vec<i64>)> {
        let mut out = Vec::new();
        for b in s.batches(split, 0, bs).unwrap() {
            let b = b.unwrap();
            let h = b.sparse.feature(2);
            for r in 0..b.batch_size {
                out.push((b.sparse.feature(0).values[r], b.sparse.feature(1).values[r], h.bag(r).to_vec()));
            }
        }
        out.sort();
        out
    }

    fn history_ctx(dir: &Path, rows: u64) -> SamplerContext {
        let mut c = ctx(dir, rows);
        c.feature_rows.insert("history".into(), rows);
        c
    }

    #[test]
    fn leave_one_out_holds_out_each_users_latest_and_histories_hold_only_the_past() {
        let dir = temp_file("history", "u.data", U_DATA);
        let cfg = MovieLensConfig {
            split: MovieLensSplit::LeaveOneOut,
            history_length: Some(5),
            eval_fraction: 0.9,
            ..config("u.data")
        };
        let s = MovieLensSampler::build(cfg.clone(), &history_ctx(&dir, 100)).unwrap();
        assert_eq!(s.schema().sparse, ["user_id", "item_id", "history"]);
        // User 1 rated 10 (t=100), 12 (t=200), 11 (t=300); user 2: 10 (t=50), 13 (t=60); user 3
        // one rating, kept for training. The latest of each user is eval; a history is the
        // user's earlier training items, oldest first.
        let want_eval = vec![(1, 11, vec![10, 12]), (2, 13, vec![10])];
        assert_eq!(histories(&s, Split::Eval, 1), want_eval);
        let want_train = vec![(1, 10, vec![]), (1, 12, vec![10]), (2, 10, vec![]), (3, 11, vec![])];
        assert_eq!(histories(&s, Split::Train, 3), want_train);
        // At most `history_length` ids, the most recent kept; ids modulo the history table.
        let short = MovieLensSampler::build(MovieLensConfig { history_length: Some(1), ..cfg.clone() }, &{
            let mut c = history_ctx(&dir, 100);
            c.feature_rows.insert("history".into(), 11);
            c
        })
        .unwrap();
        assert_eq!(histories(&short, Split::Eval, 2), vec![(1, 11, vec![1]), (2, 13, vec![10])]);
        // A random split: eval ratings are in no history (user 1's t=200 rating is eval here,
        // so user 1's t=300 example sees item 10 alone).
        let random = MovieLensConfig { split: MovieLensSplit::Random, eval_fraction: 0.0, ..cfg };
        let all = MovieLensSampler::build(random, &history_ctx(&dir, 100)).unwrap();
        assert!(histories(&all, Split::Train, 4).contains(&(1, 11, vec![10, 12])));
        let ratings = all.train_ratings().to_vec();
        let flags: Vec<bool> = ratings.iter().map(|r| r.item == 12).collect();
        let (h, at) = History::new(&ratings, &timelines(&ratings), &flags, 5, 100);
        let user1_latest = ratings.iter().position(|r| r.item == 11).unwrap();
        assert_eq!(h.of(at[user1_latest]), [10]);
    }

    #[test]
    fn a_history_no_table_reads_or_out_of_range_is_an_error_naming_the_key() {
        let dir = temp_file("history-err", "u.data", U_DATA);
        let cfg = MovieLensConfig { history_length: Some(3), ..config("u.data") };
        let e = MovieLensSampler::build(cfg, &ctx(&dir, 100)).unwrap_err();
        assert!(matches!(&e, DataError::Config { key, .. } if key == "history_length"), "{e}");
        assert!(e.to_string().contains("no table reads"), "{e}");
        for n in [0, MAX_HISTORY_LENGTH + 1] {
            let cfg = MovieLensConfig { history_length: Some(n), ..config("u.data") };
            let e = MovieLensSampler::check(&cfg, &dir).unwrap_err();
            assert!(e.to_string().contains("history_length"), "{e}");
        }
    }

    #[test]
    fn temporal_split_holds_out_each_users_latest() {
        let dir = temp_file("temporal", "u.data", U_DATA);
        let cfg = MovieLensConfig { split: MovieLensSplit::Temporal, eval_fraction: 0.34, ..config("u.data") };
        let s = MovieLensSampler::build(cfg, &ctx(&dir, 100)).unwrap();
        // User 1 (3 ratings): ceil(1.02) = 2 latest (t=300, 200); user 2: min(ceil(0.68), 1) = 1
        // (t=60); user 3 (1 rating): keeps it for training.
        let mut eval: Vec<(i64, i64)> = examples(&s, Split::Eval, 0, 2).iter().map(|e| (e.0, e.1)).collect();
        eval.sort();
        assert_eq!(eval, vec![(1, 11), (1, 12), (2, 13)]);
        assert_eq!(examples(&s, Split::Eval, 0, 2), examples(&s, Split::Eval, 5, 3), "eval is fixed");
        let mut train: Vec<(i64, i64)> = examples(&s, Split::Train, 0, 2).iter().map(|e| (e.0, e.1)).collect();
        train.sort();
        assert_eq!(train, vec![(1, 10), (2, 10), (3, 11)]);
    }

    #[test]
    fn ratings_csv_by_header_and_errors_by_line() {
        let dir = temp_file("csv", "ratings.csv", "movieId,userId,timestamp,rating\n10,1,5,4.5\n11,1,6,0.5\n");
        let s = MovieLensSampler::build(config("ratings.csv"), &ctx(&dir, 100)).unwrap();
        let mut got = examples(&s, Split::Train, 0, 8);
        got.sort_by_key(|e| e.1);
        assert_eq!(got, vec![(1, 10, 1.0, 1), (1, 11, 0.0, 1)]);
        // An explicit format on a file without the header.
        std::fs::write(dir.join("plain.txt"), "1,2,3,4\n").unwrap();
        let e = MovieLensSampler::build(
            MovieLensConfig { format: MovieLensFormat::RatingsCsv, ..config("plain.txt") },
            &ctx(&dir, 9),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("plain.txt:1: format ratings_csv needs a header"), "{e}");
        // Bad rows: fail names file:line; skip drops them.
        std::fs::write(dir.join("bad.csv"), "userId,movieId,rating,timestamp\n1,2,3,4\n1,2,9,4\n1,x,3,4\n2,2,3,4\n")
            .unwrap();
        let e = MovieLensSampler::build(config("bad.csv"), &ctx(&dir, 9)).unwrap_err().to_string();
        assert!(e.ends_with("bad.csv:3: rating 9 is outside [0, max_rating = 5]"), "{e}");
        let s = MovieLensSampler::build(
            MovieLensConfig { on_bad_row: BadRowPolicy::Skip, num_workers: 2, ..config("bad.csv") },
            &ctx(&dir, 9),
        )
        .unwrap();
        assert_eq!(s.train_ratings().iter().map(|r| r.line).collect::<Vec<_>>(), vec![2, 5]);
        // ml-1m layout.
        std::fs::write(dir.join("ratings.dat"), "1::1193::5::978300760\n2::661::3::978302109\n").unwrap();
        let s = MovieLensSampler::build(config("ratings.dat"), &ctx(&dir, 10_000)).unwrap();
        assert_eq!(s.train_ratings().len(), 2);
        // Config errors name the key.
        for (cfg, key) in [
            (MovieLensConfig { eval_fraction: 1.0, ..config("ratings.dat") }, "eval_fraction"),
            (MovieLensConfig { max_rating: 0.0, ..config("ratings.dat") }, "max_rating"),
            (MovieLensConfig { num_workers: 0, ..config("ratings.dat") }, "num_workers"),
        ] {
            let e = MovieLensSampler::build(cfg, &ctx(&dir, 10)).unwrap_err();
            assert!(matches!(&e, DataError::Config { key: k, .. } if k == key), "{e}");
        }
    }

    #[test]
    fn shuffles_per_epoch_and_shards_by_position_and_user() {
        let text: String = (0..500).map(|i| format!("{}\t{}\t{}\t{}\n", i % 37, i, 1 + i % 5, i)).collect();
        let dir = temp_file("shuffle", "u.data", &text);
        let cfg = MovieLensConfig { eval_fraction: 0.2, ..config("u.data") };
        let s = MovieLensSampler::build(cfg.clone(), &ctx(&dir, 1000)).unwrap();
        let items = |epoch, rank: Option<(usize, usize)>| -> Vec<i64> {
            let c = match rank {
                Some((rank, world_size)) => SamplerContext { rank, world_size, ..ctx(&dir, 1000) },
                None => ctx(&dir, 1000),
            };
            let s = MovieLensSampler::build(cfg.clone(), &c).unwrap();
            examples(&s, Split::Train, epoch, 64).iter().map(|e| e.1).collect()
        };
        let (e0, e0b, e1) = (items(0, None), items(0, None), items(1, None));
        assert_eq!(e0, e0b, "the same epoch is the same order");
        assert_ne!(e0, e1, "another epoch is another order");
        assert_eq!(e0.iter().collect::<BTreeSet<_>>(), e1.iter().collect::<BTreeSet<_>>());
        let want: BTreeSet<i64> = (0..500).filter(|&i| !stream::is_eval_row(7, i as u64 + 1, 0.2)).collect();
        assert_eq!(e0.iter().copied().collect::<BTreeSet<_>>(), want);
        // Ranks: training positions modulo 3 of the same shuffled order.
        let parts: Vec<Vec<i64>> = (0..3).map(|r| items(4, Some((r, 3)))).collect();
        let all = items(4, None);
        for (r, p) in parts.iter().enumerate() {
            let expect: Vec<i64> = all.iter().enumerate().filter(|(i, _)| i % 3 == r).map(|(_, &v)| v).collect();
            assert_eq!(p, &expect);
        }
        // Eval: by user, so a user's eval ratings are on one rank.
        let mut users = BTreeSet::new();
        for r in 0..3 {
            let s = MovieLensSampler::build(cfg.clone(), &SamplerContext { rank: r, world_size: 3, ..ctx(&dir, 1000) })
                .unwrap();
            for e in examples(&s, Split::Eval, 0, 50) {
                assert_eq!(e.3 % 3, r as i64);
                users.insert(e.3);
            }
        }
        assert_eq!(users.len(), s.eval_ratings().iter().map(|r| r.user).collect::<BTreeSet<_>>().len());
    }

    fn shared_data(sub: &str) -> Option<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data").join(sub);
        if dir.exists() {
            return Some(dir);
        }
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {} is missing", dir.display());
        eprintln!("skipping: {} not found (the shared datasets are not part of a clone)", dir.display());
        None
    }

    /// Counts over the whole pass: (examples, positives, distinct users, label sum).
    fn totals(s: &MovieLensSampler, split: Split) -> (usize, f32, usize, f64) {
        let ex = examples(s, split, 0, 4096);
        let users: BTreeSet<i64> = ex.iter().map(|e| e.3).collect();
        (ex.len(), ex.iter().map(|e| e.2).sum(), users.len(), ex.iter().map(|e| e.2 as f64).sum())
    }

    #[test]
    fn real_movielens_100k() {
        let Some(dir) = shared_data("movielens-100k") else { return };
        // Expected values computed independently with Python over u.data:
        // rows 100000, users 943, ratings >= 4: 55375; temporal eval rows at 0.1:
        // sum over users of min(ceil(0.1 n), n - 1) = 10439; sum of rating / 5 = 70597.2.
        let cfg =
            MovieLensConfig { split: MovieLensSplit::Temporal, eval_fraction: 0.1, num_workers: 2, ..config("u.data") };
        let s = MovieLensSampler::build(cfg.clone(), &ctx(&dir, 2000)).unwrap();
        let (train, tpos, tusers, _) = totals(&s, Split::Train);
        let (eval, epos, eusers, _) = totals(&s, Split::Eval);
        assert_eq!(train + eval, 100_000);
        assert_eq!(eval, 10_439);
        assert_eq!(tpos + epos, 55_375.0);
        assert_eq!((tusers, eusers), (943, 943));
        // Every eval rating of a user is at least as late as each of the user's training ratings.
        let mut last_train: HashMap<i64, i64> = HashMap::new();
        for r in s.train_ratings() {
            let t = last_train.entry(r.user).or_insert(i64::MIN);
            *t = (*t).max(r.timestamp);
        }
        assert!(s.eval_ratings().iter().all(|r| r.timestamp >= last_train[&r.user]));
        let scaled =
            MovieLensSampler::build(MovieLensConfig { label: MovieLensLabel::Scaled, ..cfg }, &ctx(&dir, 2000))
                .unwrap();
        let sum = totals(&scaled, Split::Train).3 + totals(&scaled, Split::Eval).3;
        assert!((sum - 70_597.2).abs() < 0.5, "{sum}");
    }

    #[test]
    fn real_movielens_latest_small() {
        let Some(dir) = shared_data("movielens-latest-small") else { return };
        // Expected values computed independently with Python over ratings.csv (header skipped):
        // rows 100836, users 610, ratings >= 4.0: 48580, temporal eval rows at 0.2: 20417.
        let cfg = MovieLensConfig { split: MovieLensSplit::Temporal, eval_fraction: 0.2, ..config("ratings.csv") };
        let s = MovieLensSampler::build(cfg, &ctx(&dir, 200_000)).unwrap();
        let (train, tpos, users, _) = totals(&s, Split::Train);
        let (eval, epos, _, _) = totals(&s, Split::Eval);
        assert_eq!((train + eval, eval, tpos + epos, users), (100_836, 20_417, 48_580.0, 610));
        // Random split: the hash holds out about a tenth.
        let s =
            MovieLensSampler::build(MovieLensConfig { eval_fraction: 0.1, ..config("ratings.csv") }, &ctx(&dir, 1000))
                .unwrap();
        let eval = totals(&s, Split::Eval).0;
        assert!((9_000..11_200).contains(&eval), "{eval}");
        assert_eq!(totals(&s, Split::Train).0 + eval, 100_836);
    }

    #[test]
    fn parses_each_layout() {
        let csv = Layout::Csv { user: 0, item: 1, rating: 2, timestamp: 3, fields: 4 };
        assert_eq!(parse_rating_line("196\t242\t3\t881250949", &Layout::Tab, 5.0).unwrap(), (196, 242, 3.0, 881250949));
        assert_eq!(parse_rating_line("1,31,2.5,1260759144", &csv, 5.0).unwrap(), (1, 31, 2.5, 1260759144));
        assert_eq!(parse_rating_line("1::1193::5::978300760", &Layout::Dat, 5.0).unwrap(), (1, 1193, 5.0, 978300760));
        assert!(
            parse_rating_line("1\t2\t3", &Layout::Tab, 5.0)
                .unwrap_err()
                .contains("expected 4 tab-separated fields, found 3")
        );
        assert!(parse_rating_line("1,x,3,4", &csv, 5.0).unwrap_err().contains("item id"));
        assert!(parse_rating_line("-1,2,3,4", &csv, 5.0).unwrap_err().contains("user id"));
        assert!(parse_rating_line("1,2,6,4", &csv, 5.0).unwrap_err().contains("outside [0, max_rating = 5]"));
        assert!(parse_rating_line("1,2,NaN,4", &csv, 5.0).is_err());
        assert!(parse_rating_line("1,2,3,t", &csv, 5.0).unwrap_err().contains("timestamp"));
    }
}
