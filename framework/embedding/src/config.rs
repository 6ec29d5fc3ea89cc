use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How the ids of one bag are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PoolingMode {
    /// Sum of the rows (times the per-id weights of a weighted input).
    Sum,
    /// Mean of the rows (an empty bag pools to zeros).
    Mean,
}

/// How weight decay enters a row-wise Adagrad update (FBGEMM's `WeightDecayMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightDecayMode {
    /// No weight decay.
    None,
    /// `weight_decay * w` is added to the gradient before the update.
    L2,
    /// The row is scaled by `1 - multiplier * weight_decay` (multiplier = the row's adaptive lr).
    Decoupled,
}

/// The optimizer fused into the embedding backward: applied once per unique row per step,
/// after the gradients of duplicate ids are summed; rows not in the batch are untouched.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SparseOptimizerConfig {
    /// Plain SGD: `w -= lr * g`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// FBGEMM's exact row-wise Adagrad: one accumulator per row, `s += mean(g^2)`,
    /// `w -= lr / (sqrt(s) + eps) * g`.
    RowwiseAdagrad {
        /// Learning rate.
        lr: f32,
        /// Added to the square root of the accumulator.
        #[serde(default = "default_eps")]
        eps: f32,
        /// Weight decay factor.
        #[serde(default)]
        weight_decay: f32,
        /// How weight decay is applied.
        #[serde(default = "default_weight_decay_mode")]
        weight_decay_mode: WeightDecayMode,
    },
}

fn default_eps() -> f32 {
    1e-8
}

fn default_weight_decay_mode() -> WeightDecayMode {
    WeightDecayMode::None
}

impl SparseOptimizerConfig {
    /// The learning rate.
    pub fn lr(&self) -> f32 {
        match self {
            Self::Sgd { lr } | Self::RowwiseAdagrad { lr, .. } => *lr,
        }
    }

    /// Optimizer state floats per row.
    pub fn state_per_row(&self) -> usize {
        match self {
            Self::Sgd { .. } => 0,
            Self::RowwiseAdagrad { .. } => 1,
        }
    }
}

/// One table at run time (built from the recipe's `[[tables]]`).
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingBagConfig {
    /// Unique table name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Embedding dimension.
    pub dim: usize,
    /// Pooling of each bag.
    pub pooling: PoolingMode,
    /// Output feature names; `x@table` reads input feature `x`.
    pub features: Vec<String>,
}
