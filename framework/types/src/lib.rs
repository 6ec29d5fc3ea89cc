//! trainrec's shared vocabulary: the words that recipes, plans, checkpoints, the engines and
//! the command line all use, one type per concept, at the bottom of the crate graph so that
//! each stage names them without depending on the stage that interprets them.
//!
//! - [`diagnostic`]: located recipe problems (`Diagnostic`, `KeyPath`, `suggest`).
//! - [`feature`]: how a table names its input features (`FeatureRef`).
//! - [`table`], [`sparse_optimizer`], [`cache`]: a table's pooling, weight precision, bounds
//!   check, fused optimizer and cache words.
//! - [`dense_optimizer`], [`dense_precision`]: the dense model's optimizer and the precision it
//!   computes in.
//! - [`sharding`]: sharding types, compute kernels, compute devices.
//! - [`mc`]: managed collisions' eviction policy and settings.
//! - [`schedule`]: learning-rate schedules (TorchRec's warm-up stages).
//! - [`pipeline`], [`split`], [`shuffle`]: the train pipeline's kinds; the data's splits and
//!   the shuffling of training data.
//! - [`block`]: row blocks (TorchRec's even split).
//!
//! Every unit word implements [`Word`]: its spelling is the one recipes and `plan.json` use, and
//! [`Word::parse`] reads it (command lines also accept `-` for `_`).

pub mod block;
pub mod cache;
#[cfg(feature = "clap")]
pub mod cli;
pub mod dense_optimizer;
pub mod dense_precision;
pub mod diagnostic;
pub mod feature;
pub mod mc;
pub mod pipeline;
pub mod schedule;
pub mod sharding;
pub mod shuffle;
pub mod sparse_optimizer;
pub mod split;
pub mod table;

pub use block::even_block;
pub use cache::{CacheBacking, CachePolicy};
pub use dense_optimizer::{ClippingKind, DenseClipping, DenseOptimizerConfig};
pub use dense_precision::DensePrecision;
pub use diagnostic::{Diagnostic, Diagnostics, KeyPath, Origin, Segment, did_you_mean, suggest};
pub use feature::FeatureRef;
pub use mc::{McConfig, McEvictionPolicy, McPartition};
pub use pipeline::PipelineKind;
pub use schedule::{WarmupPolicy, WarmupStage, check_schedule, lr_multiplier};
pub use sharding::{ComputeDevice, ComputeKernel, ShardingType};
pub use shuffle::{Shuffle, ShuffleKind};
pub use sparse_optimizer::{SparseOptimizerConfig, StatePart, WeightDecayMode};
pub use split::Split;
pub use table::{BoundsCheckMode, PoolingMode, WeightPrecision};

/// A word with a fixed set of values, each with one spelling (the recipe's).
pub trait Word: Copy + 'static {
    /// Every value, in order.
    const WORDS: &'static [Self];

    /// The spelling (as recipes, `plan.json` and reports write it).
    fn name(self) -> &'static str;

    /// The value spelled `text`: its name, or the name with `-` for `_` (command-line style).
    fn parse(text: &str) -> Option<Self> {
        Self::WORDS.iter().copied().find(|w| w.name() == text || w.name().replace('_', "-") == text)
    }

    /// Every spelling, comma-separated (for messages).
    fn names() -> String {
        Self::WORDS.iter().map(|w| w.name()).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every word's name is its serde spelling, and parses back (also with `-` for `_`).
    #[test]
    fn names_are_the_serde_spellings_and_parse_back() {
        fn check<W: Word + serde::Serialize + PartialEq + std::fmt::Debug>() {
            for &w in W::WORDS {
                assert_eq!(serde_json::to_string(&w).unwrap(), format!("\"{}\"", w.name()));
                assert_eq!(W::parse(w.name()), Some(w));
                assert_eq!(W::parse(&w.name().replace('_', "-")), Some(w));
            }
            assert_eq!(W::parse("no such word"), None);
        }
        check::<PoolingMode>();
        check::<WeightPrecision>();
        check::<BoundsCheckMode>();
        check::<WeightDecayMode>();
        check::<CachePolicy>();
        check::<ShardingType>();
        check::<ComputeKernel>();
        check::<ComputeDevice>();
        check::<McEvictionPolicy>();
        check::<PipelineKind>();
        check::<Split>();
        check::<WarmupPolicy>();
        check::<ClippingKind>();
        check::<ShuffleKind>();
        check::<DensePrecision>();
    }

    #[test]
    fn sparse_optimizers_with_defaults_are_the_recipes() {
        for kind in SparseOptimizerConfig::KINDS {
            let made = SparseOptimizerConfig::with_defaults(kind, 0.5).unwrap();
            let read: SparseOptimizerConfig =
                serde_json::from_str(&format!(r#"{{"kind":"{kind}","lr":0.5}}"#)).unwrap();
            assert_eq!(made, read);
            assert_eq!(made.kind(), kind);
        }
        assert_eq!(SparseOptimizerConfig::with_defaults("rowwise-adagrad", 1.0).unwrap().kind(), "rowwise_adagrad");
        assert!(SparseOptimizerConfig::with_defaults("adadelta", 1.0).is_none());
    }
}
