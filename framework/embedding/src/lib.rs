// Written by the lead engineer for the walking skeleton; helpers: extend, do not rewrite.
//! Embedding tables: configuration vocabulary, the unsharded [`EmbeddingBagCollection`]
//! (pooled lookups) and its backward fused with the sparse optimizer, with FBGEMM's update
//! formulas.
//!
//! Embedding weights are not autograd parameters: the dense model receives the pooled output
//! as a leaf tensor and [`EmbeddingBagCollection::backward_and_update`] consumes its gradient.

mod config;
mod ebc;
#[cfg(test)]
mod tests;

pub use config::{EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, WeightDecayMode, defaults};
pub use ebc::EmbeddingBagCollection;

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
    /// Inputs whose shapes disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
}
