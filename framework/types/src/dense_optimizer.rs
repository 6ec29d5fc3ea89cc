//! The dense model's optimizer configuration.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The dense model's optimizer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DenseOptimizerConfig {
    /// Stochastic gradient descent.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor.
        #[serde(default)]
        momentum: f64,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f64,
    },
    /// Adagrad.
    Adagrad {
        /// Learning rate.
        lr: f64,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f64,
    },
    /// Adam.
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay of the first-moment estimate.
        #[serde(default = "defaults::beta1")]
        beta1: f64,
        /// Decay of the second-moment estimate.
        #[serde(default = "defaults::beta2")]
        beta2: f64,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f64,
    },
}

impl DenseOptimizerConfig {
    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Self::Sgd { lr, .. } | Self::Adagrad { lr, .. } | Self::Adam { lr, .. } => *lr,
        }
    }
}

/// Defaults of the dense optimizer keys.
pub mod defaults {
    /// Default Adam beta1.
    pub fn beta1() -> f64 {
        0.9
    }
    /// Default Adam beta2.
    pub fn beta2() -> f64 {
        0.999
    }
}
