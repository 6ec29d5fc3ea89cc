//! Which split of the data a batch or a report belongs to.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;

/// A split of the data: the batches a job trains on, or those it evaluates on. Samplers
/// produce each; metric reports are about one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Training batches.
    Train,
    /// The eval split.
    Eval,
}

impl Split {
    /// The name written in reports (`train`, `eval`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Train => "train",
            Self::Eval => "eval",
        }
    }
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Word for Split {
    const WORDS: &'static [Self] = &[Self::Train, Self::Eval];
    fn name(self) -> &'static str {
        self.as_str()
    }
}
