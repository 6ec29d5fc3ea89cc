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

/// How weight decay enters a row-wise Adagrad update (FBGEMM's `WeightDecayMode`: `NONE`,
/// `L2`, `DECOUPLE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightDecayMode {
    /// No weight decay.
    None,
    /// L2 regularisation: `weight_decay * w` is added to the row's gradient, so it also feeds
    /// the Adagrad accumulator.
    L2,
    /// Decoupled weight decay: the row is scaled by `1 - lr * weight_decay` before the Adagrad
    /// step, and the accumulator sees the plain gradient.
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
        #[serde(default = "defaults::eps")]
        eps: f32,
        /// Weight decay factor.
        #[serde(default = "defaults::weight_decay")]
        weight_decay: f32,
        /// How weight decay is applied.
        #[serde(default = "defaults::weight_decay_mode")]
        weight_decay_mode: WeightDecayMode,
    },
}

/// Defaults of the sparse optimizer keys, declared once (FBGEMM's
/// `SplitTableBatchedEmbeddingBagsCodegen` defaults).
pub mod defaults {
    use super::WeightDecayMode;

    /// Default row-wise Adagrad `eps` (FBGEMM: `1.0e-8`).
    pub fn eps() -> f32 {
        1e-8
    }

    /// Default `weight_decay` (FBGEMM: `0.0`).
    pub fn weight_decay() -> f32 {
        0.0
    }

    /// Default `weight_decay_mode` (FBGEMM: `WeightDecayMode.NONE`).
    pub fn weight_decay_mode() -> WeightDecayMode {
        WeightDecayMode::None
    }
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

    /// Checks the hyperparameters: every value finite, `lr >= 0`, `eps > 0` (a zero `eps`
    /// divides by zero on a row whose accumulator is still 0) and `weight_decay >= 0`.
    pub fn validate(&self) -> Result<(), String> {
        fn check(name: &str, value: f32, ok: bool, rule: &str) -> Result<(), String> {
            if value.is_finite() && ok { Ok(()) } else { Err(format!("sparse optimizer {name} = {value}: {rule}")) }
        }
        let lr = self.lr();
        check("lr", lr, lr >= 0.0, "must be finite and >= 0")?;
        if let Self::RowwiseAdagrad { eps, weight_decay, .. } = *self {
            check("eps", eps, eps > 0.0, "must be finite and > 0")?;
            check("weight_decay", weight_decay, weight_decay >= 0.0, "must be finite and >= 0")?;
        }
        Ok(())
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
