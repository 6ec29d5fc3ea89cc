//! The words of a table: how a bag pools, how weights are stored, what a bad id does.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;

/// How the ids of one bag are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PoolingMode {
    /// Sum of the rows (times the per-id weights of a weighted input).
    Sum,
    /// Mean of the rows (an empty bag pools to zeros).
    Mean,
    /// No pooling: one embedding per id, each example's ids kept in order (TorchRec's
    /// `EmbeddingCollection`). The table's features are sequence features, which the model
    /// receives as jagged embeddings.
    None,
}

/// Storage precision of a table's weights. Lookups and updates compute in fp32; the
/// optimizer state is always fp32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightPrecision {
    /// 32-bit float.
    #[default]
    Fp32,
    /// IEEE half precision (`SparseType.FP16`).
    Fp16,
    /// bfloat16 (`SparseType.BF16`).
    Bf16,
}

impl WeightPrecision {
    /// Bytes per stored weight.
    pub fn bytes(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Fp16 | Self::Bf16 => 2,
        }
    }
}

/// What a lookup does with an id outside `0..rows` (FBGEMM's `BoundsCheckMode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BoundsCheckMode {
    /// Reject the batch with an error naming the table, feature, example and id; nothing is
    /// changed.
    #[default]
    Fatal,
    /// Count the bad ids, log a warning per batch, and read/update row 0 in their place (as
    /// FBGEMM's `WARNING` mode rewrites them to 0).
    Warning,
    /// Like `warning` without counting or logging.
    Ignore,
}

impl Word for PoolingMode {
    const WORDS: &'static [Self] = &[Self::Sum, Self::Mean, Self::None];
    fn name(self) -> &'static str {
        match self {
            Self::Sum => "sum",
            Self::Mean => "mean",
            Self::None => "none",
        }
    }
}

impl Word for WeightPrecision {
    const WORDS: &'static [Self] = &[Self::Fp32, Self::Fp16, Self::Bf16];
    fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
        }
    }
}

impl Word for BoundsCheckMode {
    const WORDS: &'static [Self] = &[Self::Fatal, Self::Warning, Self::Ignore];
    fn name(self) -> &'static str {
        match self {
            Self::Fatal => "fatal",
            Self::Warning => "warning",
            Self::Ignore => "ignore",
        }
    }
}
