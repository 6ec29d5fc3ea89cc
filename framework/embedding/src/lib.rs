// Written by the lead engineer for the walking skeleton; helpers: extend, do not rewrite.
//! Embedding tables: configuration vocabulary, table-batched storage (fp32 / fp16 / bf16
//! weights in huge-page backed buffers, fp32 optimizer state), the unsharded
//! [`EmbeddingBagCollection`] (pooled lookups) and [`EmbeddingCollection`] (sequence
//! lookups), position weighting, and the backward fused with the sparse optimizer (SGD,
//! Adagrad, row-wise Adagrad, Adam, partial row-wise Adam, LAMB) with FBGEMM's formulas.
//!
//! Embedding weights are not autograd parameters: the dense model receives the pooled output
//! as a leaf tensor and [`EmbeddingBagCollection::backward_and_update`] consumes its gradient.

mod backing;
mod cache;
mod collection;
mod config;
pub mod conformance;
pub mod dynamic;
mod ebc;
mod ec;
pub mod engine;
pub mod mc;
mod optim;
mod position;
mod precision;
pub mod quant;
mod storage;
mod tbe;
#[cfg(test)]
mod tests;

pub use cache::{CacheStats, RowCache, SlotStore};
pub use collection::{id_out_of_range, initial_weights, resolve_inputs};
pub use config::{
    BoundsCheckMode, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, StatePart, WeightDecayMode,
    WeightPrecision, defaults,
};
pub use config::{CacheBacking, CacheConfig, CachePolicy, InitBlock};
pub use ebc::EmbeddingBagCollection;
pub use ec::{EmbeddingCollection, SequenceEmbeddings};
pub use engine::{
    BatchContext, CachePlacement, DeviceSlice, EmbeddingEngine, EmbeddingLookup, LocalShard, Memory, Pooled,
    PooledGrad, StepTimes, TableEngine,
};
pub use optim::{OptimizerKind, StepConstants, scaled_lr};
pub use position::PositionWeightedModule;
pub use precision::{Weight, rounding_key};
pub use tbe::{RowBlock, clamp_row, reset_values};

/// Why an embedding operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EmbeddingError {
    /// The table configuration is invalid.
    #[error("invalid embedding config: {0}")]
    Config(String),
    /// The input lacks a feature a table reads.
    #[error("the input has no feature \"{feature}\" (table \"{table}\" reads it); input features: {available}")]
    MissingFeature {
        /// The feature.
        feature: String,
        /// The table.
        table: String,
        /// The input's keys.
        available: String,
    },
    /// An id outside `0..rows`.
    #[error(
        "id {id} out of range for table \"{table}\" ({rows} rows): feature \"{feature}\", bag {sample} (example {sample} of the batch)"
    )]
    IdOutOfRange {
        /// The table.
        table: String,
        /// The feature.
        feature: String,
        /// The example (bag) index in the batch.
        sample: usize,
        /// The offending id.
        id: i64,
        /// Rows of the table.
        rows: u64,
    },
    /// A raw id outside a managed-collision table's id space.
    #[error(
        "raw id {id} of feature \"{feature}\" is outside table \"{table}\"'s id space 0..{input_hash_size} \
         (tables.mc.input_hash_size)"
    )]
    RawIdOutOfRange {
        /// The table.
        table: String,
        /// The feature.
        feature: String,
        /// The offending id.
        id: i64,
        /// The table's `input_hash_size`.
        input_hash_size: u64,
    },
    /// Inputs whose shapes disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A cache's slot storage failed (a GPU's memory copies).
    #[error("embedding storage: {0}")]
    Storage(String),
    /// The batch's sparse features cannot be laid out (e.g. a variable-batch KJT whose
    /// inverse indices do not fit).
    #[error("{0}")]
    Input(#[from] trainrec_sparse::SparseError),
    /// The engine's backend failed (a collective of a sharded collection, a GPU): its error,
    /// as that backend's crate reports it.
    #[error("{0}")]
    Backend(BackendError),
}

/// An engine backend's own error ([`EmbeddingError::Backend`]), kept whole so that callers can
/// tell its kind (e.g. a peer rank that left) by downcasting.
#[derive(Clone, Debug)]
pub struct BackendError(pub std::sync::Arc<dyn std::error::Error + Send + Sync>);

impl BackendError {
    /// Wraps a backend's error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(e))
    }

    /// The backend's error, when it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Backends' errors compare by message (their types need not be comparable).
impl PartialEq for BackendError {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}
