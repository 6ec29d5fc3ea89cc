//! The dense model's optimizer configuration.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;
use crate::diagnostic::{Diagnostic, KeyPath};

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

/// How the dense gradients are clipped before each update, after they are summed across ranks
/// (TorchRec's `GradientClippingOptimizer` on the dense parameters).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DenseClipping {
    /// `norm`: every gradient times `min(1, max_gradient / (total_norm + 1e-6))`, the total norm
    /// being the `norm_type`-norm of all dense gradients together
    /// (`torch.nn.utils.clip_grad_norm_`); `value`: every value clamped into
    /// `[-max_gradient, max_gradient]` (`clip_grad_value_`).
    pub kind: ClippingKind,
    /// The bound: of the total norm (`norm`) or of each value (`value`).
    pub max_gradient: f64,
    /// `norm`: the p of the p-norm (`inf`: the largest absolute value).
    #[serde(default = "defaults::norm_type")]
    pub norm_type: f64,
}

/// What [`DenseClipping`] bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClippingKind {
    /// The total norm of the gradients.
    Norm,
    /// Each gradient value.
    Value,
}

impl Word for ClippingKind {
    const WORDS: &'static [Self] = &[Self::Norm, Self::Value];
    fn name(self) -> &'static str {
        match self {
            Self::Norm => "norm",
            Self::Value => "value",
        }
    }
}

impl DenseClipping {
    /// The problems of the clipping at `key`.
    pub fn check(&self, key: &KeyPath) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        if !(self.max_gradient.is_finite() && self.max_gradient > 0.0) {
            out.push(Diagnostic::new(
                key.key("max_gradient"),
                format!("max_gradient = {} must be a positive number", self.max_gradient),
            ));
        }
        if self.norm_type.is_nan() || self.norm_type <= 0.0 {
            out.push(Diagnostic::new(
                key.key("norm_type"),
                format!("norm_type = {} must be positive (or inf)", self.norm_type),
            ));
        }
        out
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
    /// Default `norm_type` of norm clipping (the Euclidean norm).
    pub fn norm_type() -> f64 {
        2.0
    }
}
