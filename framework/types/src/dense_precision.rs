//! The precision the dense model computes in.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;

/// The precision of the dense model's matrix products (`train.dense_precision`, `trainrec bench
/// dlrm --dense-precision`). The parameters and the dense optimizer's state stay fp32 either
/// way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DensePrecision {
    /// Everything in fp32.
    #[default]
    Fp32,
    /// Mixed precision as `torch.autocast(dtype=torch.bfloat16)` runs it: matrix products
    /// (linear layers, `mm`, `bmm`) take bf16 copies of their inputs and weights and give bf16
    /// outputs, element-wise work follows its inputs, and the few ops that need range
    /// (reductions, losses) run in fp32. Gradients reach the fp32 master weights in fp32.
    Bf16,
}

impl Word for DensePrecision {
    const WORDS: &'static [Self] = &[Self::Fp32, Self::Bf16];
    fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
        }
    }
}
