//! Samplers: the [`Sampler`] trait and the built-in data sources:
//!
//! - [`SyntheticSampler`]: Criteo-like data with a planted signal, generated on the fly;
//! - [`CriteoTsvSampler`]: the raw Criteo Kaggle / 1TB layout;
//! - [`CriteoBinarySampler`]: TorchRec's preprocessed binary (`.npy`) Criteo layout, with
//!   [`criteo_binary::convert_tsv`] to produce it;
//! - [`MovieLensSampler`]: MovieLens ratings (`u.data`, `ratings.csv`, `ratings.dat`);
//! - [`ParquetSampler`]: columns of Parquet files mapped to dense, sparse and label inputs;
//! - [`CsvSampler`]: columns of delimited text files (CSV, TSV) with a header, mapped the same
//!   way.
//!
//! The file samplers read through [`stream`]: worker threads parse fixed chunks (blocks of
//! lines, row ranges, row groups) into a bounded queue and the batch iterator reassembles them
//! in chunk order, so batches do not depend on `num_workers`. `trainrec bench data` measures
//! their throughput (the `trainrec-bench` crate).
//!
//! [`shuffle`] reorders the rows of any sampler's training epoch (`data.shuffle`).

mod columns;
pub mod criteo;
pub mod criteo_binary;
pub mod csv;
pub mod movielens;
pub mod npy;
pub mod parquet;
pub mod shuffle;
pub mod stream;
pub mod synthetic;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use crate::parquet::{ParquetConfig, ParquetSampler};
pub use columns::LabelColumns;
pub use criteo::{CriteoTsvConfig, CriteoTsvSampler};
pub use criteo_binary::{CriteoBinaryConfig, CriteoBinarySampler};
pub use csv::{CsvConfig, CsvSampler};
pub use movielens::{MovieLensConfig, MovieLensFormat, MovieLensLabel, MovieLensSampler, MovieLensSplit};
pub use shuffle::{Shuffle, ShuffleKind, shuffle_seed, shuffled};
pub use stream::BadRowPolicy;
pub use synthetic::{IdDistribution, SyntheticConfig, SyntheticSampler};
use trainrec_sparse::KeyedJaggedTensor;

/// One batch of examples.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Dense features, `[batch_size, num_dense]` row-major.
    pub dense: Vec<f32>,
    /// Dense features per example.
    pub num_dense: usize,
    /// Sparse features, keys in the sampler's [`FeatureSchema::sparse`] order.
    pub sparse: KeyedJaggedTensor,
    /// Labels, `[batch_size, labels]` row-major: one per example and label column of
    /// [`FeatureSchema::labels`] (so one per example for a single-label sampler). 0 or 1 for a
    /// click label; a regression target (MovieLens' `label = "scaled"`, a Parquet column) may be
    /// any finite value.
    pub labels: Vec<f32>,
    /// Examples in this batch (the last batch of a split may be smaller).
    pub batch_size: usize,
    /// A grouping key per example (user, query or session id) when the sampler provides one
    /// ([`FeatureSchema::grouping_key`]): grouped AUC, NDCG and session recall rank within
    /// these groups.
    pub groups: Option<Vec<i64>>,
    /// A weight per example (finite, `>= 0`) when the sampler reads one
    /// ([`Sampler::weighted`]): the loss is the weighted mean of the per-example losses and every
    /// metric weighs the example by it. `None`: every example weighs 1.
    pub weights: Option<Vec<f32>>,
}

pub use trainrec_types::Split;

/// The features a sampler produces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeatureSchema {
    /// Dense features per example.
    pub num_dense: usize,
    /// Sparse feature names, in KJT key order.
    pub sparse: Vec<String>,
    /// The label columns, in [`Batch::labels`] order (`["label"]` for a single-label
    /// sampler); a multi-task job trains one task per column it names.
    pub labels: Vec<String>,
    /// What the sampler's per-example grouping key is (for example `"session"`), or `None`
    /// when its batches carry no [`Batch::groups`].
    pub grouping_key: Option<String>,
}

/// What the engine gives a sampler when it builds one.
#[derive(Clone, Debug, Default)]
pub struct SamplerContext {
    /// Rows of the table each sparse feature is looked up in: ids must be `< rows`.
    pub feature_rows: BTreeMap<String, u64>,
    /// Directory relative paths in the config resolve against (the recipe file's directory).
    pub base_dir: PathBuf,
    /// The run's seed.
    pub seed: u64,
    /// This process's rank: a streaming sampler reads only its share of the data (the rows or
    /// row groups whose index is `rank` modulo `world_size`).
    pub rank: usize,
    /// Ranks reading the data together (1 for a single-process job; 0 is read as 1).
    pub world_size: usize,
}

impl SamplerContext {
    /// Rows for `feature`, or a config error naming it.
    pub fn rows(&self, feature: &str) -> Result<u64, DataError> {
        match self.feature_rows.get(feature) {
            Some(&r) if r > 0 => Ok(r),
            _ => Err(DataError::Config {
                key: "".into(),
                message: format!(
                    "sparse feature \"{feature}\" is not looked up in any table (no row count to hash its ids into)"
                ),
            }),
        }
    }
}

/// A stream of batches.
pub type BatchStream = Box<dyn Iterator<Item = Result<Batch, DataError>> + Send>;

/// A data source.
pub trait Sampler: Send + Sync {
    /// The features this sampler produces.
    fn schema(&self) -> &FeatureSchema;
    /// The batches of one pass over `split`. `epoch` changes the order or content of
    /// training data; the eval split is the same on every call.
    fn batches(&self, split: Split, epoch: u64, batch_size: usize) -> Result<BatchStream, DataError>;

    /// Where each of `new_world` ranks resumes an epoch of training batches after a checkpoint
    /// taken when each of `old_world` ranks had read `read` of them: the batches to skip.
    /// The default suits samplers that deal an epoch's batches to the ranks in turn (the
    /// built-in ones): the epoch goes on after the `read * old_world` batches read, rounded
    /// down to whole rounds of the new ranks. A sampler whose every rank reads a share of
    /// every batch returns `read`. The same world size always resumes exactly.
    fn resume_offset(&self, read: u64, old_world: usize, new_world: usize) -> u64 {
        read * old_world as u64 / new_world.max(1) as u64
    }

    /// Whether every batch carries [`Batch::weights`] (a recipe's weight column or option):
    /// the job then sums the weights across ranks for the loss's denominator. A sampler that
    /// says `false` must produce no weights.
    fn weighted(&self) -> bool {
        false
    }
}

/// Why data could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A sampler config value is invalid; `key` is the path inside the sampler section.
    #[error("{message}")]
    Config {
        /// Dotted key inside the sampler's section (empty for the section itself).
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A malformed input row.
    #[error("{}:{line}: {message}", file.display())]
    BadRow {
        /// The file.
        file: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong with the row.
        message: String,
    },
    /// A malformed record of a binary or columnar file (a `.npy` row, a Parquet row).
    #[error("{}: {location}: {message}", file.display())]
    BadRecord {
        /// The file.
        file: PathBuf,
        /// Where in the file, for example `row 17` or `row group 2, row 5`.
        location: String,
        /// What is wrong with the record.
        message: String,
    },
    /// A file is not in the expected format (bad `.npy` header, unreadable Parquet footer,
    /// a column of the wrong type).
    #[error("{}: {message}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A reader thread stopped without a result (it panicked).
    #[error("data reader thread failed: {0}")]
    Reader(String),
    /// A batch could not be assembled.
    #[error("{0}")]
    Sparse(#[from] trainrec_sparse::SparseError),
}

impl DataError {
    /// A [`DataError::Config`] for `key`.
    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        DataError::Config { key: key.into(), message: message.into() }
    }

    /// A [`DataError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io { path: path.into(), source }
    }
}

/// SplitMix64: a fast, well-mixed 64-bit hash used for deterministic per-batch seeds and
/// hash-based splits.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `"did you mean \"x\"? "` for the candidate closest to `name` by edit distance, when one is
/// close enough (at most a third of the longer name, or 2); otherwise empty.
pub(crate) fn did_you_mean<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    candidates
        .into_iter()
        .map(|c| (strsim::levenshtein(c, name), c))
        .filter(|(d, c)| *d <= (c.len().max(name.len()) / 3).max(2))
        .min()
        .map(|(_, c)| format!("did you mean {c:?}? "))
        .unwrap_or_default()
}

/// A hash of several words.
pub fn hash_words(words: &[u64]) -> u64 {
    words.iter().fold(0x1234_5678_9ABC_DEF0, |h, &w| splitmix64(h ^ splitmix64(w)))
}
