use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
