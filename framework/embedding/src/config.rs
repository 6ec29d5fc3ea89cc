//! A table at run time and its cache; the words they use come from `trainrec-types`.

use std::path::PathBuf;

pub use trainrec_types::sparse_optimizer::defaults;
pub use trainrec_types::{
    BoundsCheckMode, CacheBacking, CachePolicy, PoolingMode, SparseOptimizerConfig, StatePart, WeightDecayMode,
    WeightPrecision,
};

/// One table at run time (built from the recipe's `[[tables]]`).
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingBagConfig {
    /// Unique table name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Embedding dimension (any value >= 1).
    pub dim: usize,
    /// Pooling of each bag (ignored by the sequence `EmbeddingCollection`).
    pub pooling: PoolingMode,
    /// Output feature names; `x@table` reads input feature `x`.
    pub features: Vec<String>,
    /// Weight storage precision.
    pub precision: WeightPrecision,
    /// Round fp16/bf16 weight updates stochastically (unbiased) instead of to nearest.
    pub stochastic_rounding: bool,
    /// This table's own fused optimizer; `None` uses the collection's.
    pub optimizer: Option<SparseOptimizerConfig>,
    /// Keep only a cache of the rows in memory, the table in a file (the CPU
    /// `fused_uvm_caching` kernel); `None` holds the whole table in memory.
    pub cache: Option<crate::CacheConfig>,
    /// The table is a block of a larger table (a shard): its initial weights are that table's
    /// (so a cached shard's store starts from them without writing a row). `None`: its own.
    pub init_block: Option<InitBlock>,
}

/// Where a shard's initial weights come from: table `table` (`table_rows × table_dim`) of a
/// collection built with `seed`, rows from `first_row`, columns `cols`
/// (the collection's `initial_weights`; `InitBlock::rows` computes them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitBlock {
    /// The collection's seed.
    pub seed: u64,
    /// The table's index in that collection.
    pub table: usize,
    /// Its rows.
    pub table_rows: u64,
    /// Its dim.
    pub table_dim: usize,
    /// The block's first row.
    pub first_row: u64,
    /// The block's columns.
    pub cols: std::ops::Range<usize>,
}

impl EmbeddingBagConfig {
    /// An fp32 table using the collection's optimizer.
    pub fn new(name: impl Into<String>, rows: u64, dim: usize, pooling: PoolingMode, features: &[&str]) -> Self {
        Self {
            name: name.into(),
            rows,
            dim,
            pooling,
            features: features.iter().map(|f| f.to_string()).collect(),
            precision: WeightPrecision::Fp32,
            stochastic_rounding: true,
            optimizer: None,
            cache: None,
            init_block: None,
        }
    }

    /// The same table behind a cache of `cache.slots` rows (the table itself in a file).
    pub fn with_cache(mut self, cache: crate::CacheConfig) -> Self {
        self.cache = Some(cache);
        self
    }

    /// The same table stored in `precision`.
    pub fn with_precision(mut self, precision: WeightPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// The same table with its own optimizer.
    pub fn with_optimizer(mut self, optimizer: SparseOptimizerConfig) -> Self {
        self.optimizer = Some(optimizer);
        self
    }
}

/// A table's cache: `slots` rows in memory in front of the whole table in a file under `dir`.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Rows the cache holds, in `1..=rows` (TorchRec: load factor × rows).
    pub slots: u64,
    /// Eviction policy.
    pub policy: CachePolicy,
    /// The backing store.
    pub backing: CacheBacking,
    /// Directory of the backing file. The file is unlinked as soon as it is mapped: nothing
    /// stays behind, even after a crash.
    pub dir: PathBuf,
}
