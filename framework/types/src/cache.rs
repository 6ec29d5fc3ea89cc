//! The words of a cached table: which row a full cache evicts, and what holds the rows the
//! cache does not.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;

/// Which unpinned resident row a full cache evicts (a table's
/// `constraints.cache.algorithm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CachePolicy {
    /// The row whose last use is oldest.
    #[default]
    Lru,
    /// The row used by the fewest batches so far (counted over the whole run, resident or
    /// not: FBGEMM's LFU), the oldest last use among equals.
    Lfu,
}

/// What holds the rows a cache's slots do not: both are memory-mapped files on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheBacking {
    /// One record per table row, in a file made and filled with the initial weights when the
    /// table is built (TorchRec's `fused_uvm_caching`, its UVM host memory here a file).
    #[default]
    Rows,
    /// A key-value store of the rows written so far (evicted dirty, or set), in files that
    /// grow as rows come; a row not stored reads as its initial weights and zero state
    /// (TorchRec's `key_value`, an SSD store). Nothing is written when the table is built.
    KeyValue,
}

impl Word for CachePolicy {
    const WORDS: &'static [Self] = &[Self::Lru, Self::Lfu];
    fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Lfu => "lfu",
        }
    }
}
