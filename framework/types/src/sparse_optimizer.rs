//! The sparse (fused) optimizers' configuration: FBGEMM's optimizers with their
//! hyperparameters and defaults, and the layout of a row's optimizer state.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;

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
/// The formulas are FBGEMM's (`fbgemm_gpu/codegen/genscript/optimizers.py`), computed in
/// fp32 with fp32 optimizer state whatever the weight precision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SparseOptimizerConfig {
    /// Plain SGD (FBGEMM `EXACT_SGD`): `w -= lr * g`. No state.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Exact element-wise Adagrad (FBGEMM `EXACT_ADAGRAD`): `s += g^2`,
    /// `w -= lr * g / (sqrt(s) + eps)`; one accumulator per weight.
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to the square root of the accumulator.
        #[serde(default = "defaults::eps")]
        eps: f32,
    },
    /// FBGEMM's exact row-wise Adagrad (`EXACT_ROWWISE_ADAGRAD`): one accumulator per row,
    /// `s += mean(g^2)`, `w -= lr / (sqrt(s) + eps) * g`.
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
    /// Adam with FBGEMM's decoupled weight decay (`ADAM`): per weight `m = b1 m + (1-b1) g`,
    /// `v = b2 v + (1-b2) g^2`, `w -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd * w)`,
    /// `t` the step count. Two state values per weight.
    Adam {
        /// Learning rate.
        lr: f32,
        /// Added to the square root of the second moment.
        #[serde(default = "defaults::eps")]
        eps: f32,
        /// Decay of the first moment.
        #[serde(default = "defaults::beta1")]
        beta1: f32,
        /// Decay of the second moment.
        #[serde(default = "defaults::beta2")]
        beta2: f32,
        /// Decoupled weight decay factor.
        #[serde(default = "defaults::weight_decay")]
        weight_decay: f32,
    },
    /// Adam with a per-row second moment (FBGEMM `PARTIAL_ROWWISE_ADAM`):
    /// `v = b2 v + (1-b2) mean(g^2)` per row, the first moment per weight. `dim + 1` state
    /// values per row.
    PartialRowwiseAdam {
        /// Learning rate.
        lr: f32,
        /// Added to the square root of the second moment.
        #[serde(default = "defaults::eps")]
        eps: f32,
        /// Decay of the first moment.
        #[serde(default = "defaults::beta1")]
        beta1: f32,
        /// Decay of the second moment.
        #[serde(default = "defaults::beta2")]
        beta2: f32,
        /// Decoupled weight decay factor.
        #[serde(default = "defaults::weight_decay")]
        weight_decay: f32,
    },
    /// LAMB (FBGEMM `LAMB`): the Adam direction `r = m_hat / (sqrt(v_hat) + eps) + wd * w`
    /// scaled per row by the trust ratio `|w| / |r|`: `w -= lr * |w|/|r| * r`. A row whose
    /// `|w|` or `|r|` is 0 uses ratio 1 (FBGEMM would write NaN there).
    Lamb {
        /// Learning rate.
        lr: f32,
        /// Added to the square root of the second moment.
        #[serde(default = "defaults::eps")]
        eps: f32,
        /// Decay of the first moment.
        #[serde(default = "defaults::beta1")]
        beta1: f32,
        /// Decay of the second moment.
        #[serde(default = "defaults::beta2")]
        beta2: f32,
        /// Weight decay factor (inside the trust-ratio direction).
        #[serde(default = "defaults::weight_decay")]
        weight_decay: f32,
    },
}

/// Defaults of the sparse optimizer keys, declared once (FBGEMM's
/// `SplitTableBatchedEmbeddingBagsCodegen` defaults).
pub mod defaults {
    use super::WeightDecayMode;

    /// Default `eps` (FBGEMM: `1.0e-8`).
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

    /// Default `beta1` (FBGEMM: `0.9`).
    pub fn beta1() -> f32 {
        0.9
    }

    /// Default `beta2` (FBGEMM: `0.999`).
    pub fn beta2() -> f32 {
        0.999
    }
}

impl SparseOptimizerConfig {
    /// The learning rate.
    pub fn lr(&self) -> f32 {
        match self {
            Self::Sgd { lr }
            | Self::Adagrad { lr, .. }
            | Self::RowwiseAdagrad { lr, .. }
            | Self::Adam { lr, .. }
            | Self::PartialRowwiseAdam { lr, .. }
            | Self::Lamb { lr, .. } => *lr,
        }
    }

    /// The recipe name of the optimizer (`kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Sgd { .. } => "sgd",
            Self::Adagrad { .. } => "adagrad",
            Self::RowwiseAdagrad { .. } => "rowwise_adagrad",
            Self::Adam { .. } => "adam",
            Self::PartialRowwiseAdam { .. } => "partial_rowwise_adam",
            Self::Lamb { .. } => "lamb",
        }
    }

    /// The layout of one row's optimizer state: its parts in order, each either one float per
    /// column or one float for the whole row. A column block of a table keeps each per-column
    /// part's columns and a copy of each per-row part.
    pub fn state_layout(&self) -> &'static [StatePart] {
        use StatePart::{PerColumn, PerRow};
        match self {
            Self::Sgd { .. } => &[],
            Self::Adagrad { .. } => &[PerColumn],
            Self::RowwiseAdagrad { .. } => &[PerRow],
            Self::Adam { .. } | Self::Lamb { .. } => &[PerColumn, PerColumn],
            Self::PartialRowwiseAdam { .. } => &[PerRow, PerColumn],
        }
    }

    /// Optimizer state floats per row of a `dim`-wide table.
    pub fn state_per_row(&self, dim: usize) -> usize {
        match self {
            Self::Sgd { .. } => 0,
            Self::Adagrad { .. } => dim,
            Self::RowwiseAdagrad { .. } => 1,
            Self::Adam { .. } | Self::Lamb { .. } => 2 * dim,
            Self::PartialRowwiseAdam { .. } => dim + 1,
        }
    }

    /// Checks the hyperparameters: every value finite, `lr >= 0`, `eps > 0` (a zero `eps`
    /// divides by zero on a row whose accumulator is still 0), `weight_decay >= 0` and
    /// betas in `[0, 1)`.
    pub fn validate(&self) -> Result<(), String> {
        fn check(name: &str, value: f32, ok: bool, rule: &str) -> Result<(), String> {
            if value.is_finite() && ok { Ok(()) } else { Err(format!("sparse optimizer {name} = {value}: {rule}")) }
        }
        let lr = self.lr();
        check("lr", lr, lr >= 0.0, "must be finite and >= 0")?;
        let eps_rule = "must be finite and > 0";
        let wd_rule = "must be finite and >= 0";
        match *self {
            Self::Sgd { .. } => {}
            Self::Adagrad { eps, .. } => check("eps", eps, eps > 0.0, eps_rule)?,
            Self::RowwiseAdagrad { eps, weight_decay, .. } => {
                check("eps", eps, eps > 0.0, eps_rule)?;
                check("weight_decay", weight_decay, weight_decay >= 0.0, wd_rule)?;
            }
            Self::Adam { eps, beta1, beta2, weight_decay, .. }
            | Self::PartialRowwiseAdam { eps, beta1, beta2, weight_decay, .. }
            | Self::Lamb { eps, beta1, beta2, weight_decay, .. } => {
                check("eps", eps, eps > 0.0, eps_rule)?;
                check("weight_decay", weight_decay, weight_decay >= 0.0, wd_rule)?;
                let beta_rule = "must be in [0, 1)";
                check("beta1", beta1, (0.0..1.0).contains(&beta1), beta_rule)?;
                check("beta2", beta2, (0.0..1.0).contains(&beta2), beta_rule)?;
            }
        }
        Ok(())
    }
}

/// One part of a row's optimizer state ([`SparseOptimizerConfig::state_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatePart {
    /// One float per column (Adagrad's accumulator, Adam's moments).
    PerColumn,
    /// One float for the row (row-wise Adagrad's accumulator).
    PerRow,
}

impl StatePart {
    /// Floats of this part in one row of a `dim`-wide table.
    pub fn len(self, dim: usize) -> usize {
        match self {
            Self::PerColumn => dim,
            Self::PerRow => 1,
        }
    }
}

impl Word for WeightDecayMode {
    const WORDS: &'static [Self] = &[Self::None, Self::L2, Self::Decoupled];
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::L2 => "l2",
            Self::Decoupled => "decoupled",
        }
    }
}

impl SparseOptimizerConfig {
    /// The recipe spelling of every optimizer (`kind`), in order.
    pub const KINDS: [&'static str; 6] = ["sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb"];

    /// The optimizer `kind` (a recipe spelling, or the same with `-` for `_`) at learning rate
    /// `lr` with every other hyperparameter at its default; `None`: no such optimizer.
    pub fn with_defaults(kind: &str, lr: f32) -> Option<Self> {
        let kind = kind.replace('-', "_");
        let (eps, weight_decay, weight_decay_mode) =
            (defaults::eps(), defaults::weight_decay(), defaults::weight_decay_mode());
        let (beta1, beta2) = (defaults::beta1(), defaults::beta2());
        Some(match kind.as_str() {
            "sgd" => Self::Sgd { lr },
            "adagrad" => Self::Adagrad { lr, eps },
            "rowwise_adagrad" => Self::RowwiseAdagrad { lr, eps, weight_decay, weight_decay_mode },
            "adam" => Self::Adam { lr, eps, beta1, beta2, weight_decay },
            "partial_rowwise_adam" => Self::PartialRowwiseAdam { lr, eps, beta1, beta2, weight_decay },
            "lamb" => Self::Lamb { lr, eps, beta1, beta2, weight_decay },
            _ => return None,
        })
    }
}
