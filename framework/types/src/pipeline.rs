//! The train pipeline's kinds.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;

/// A train pipeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PipelineKind {
    /// One batch at a time.
    #[default]
    Base,
    /// Batch i+1's input dist runs while batch i trains.
    SparseDist,
    /// Batch i+1's input dist runs and its rows are prefetched into the table caches while
    /// batch i trains.
    PrefetchSparseDist,
}

impl Word for PipelineKind {
    const WORDS: &'static [Self] = &[Self::Base, Self::SparseDist, Self::PrefetchSparseDist];
    fn name(self) -> &'static str {
        match self {
            Self::Base => "base",
            Self::SparseDist => "sparse_dist",
            Self::PrefetchSparseDist => "prefetch_sparse_dist",
        }
    }
}
