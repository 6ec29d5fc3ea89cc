//! Jagged and keyed sparse containers with TorchRec's semantics: [`JaggedTensor`],
//! [`KeyedJaggedTensor`] (with variable-batch-per-feature fields) and [`KeyedTensor`].
//!
//! Every constructor validates its inputs and says what is inconsistent; no operation panics on
//! user input.

mod jagged;
mod keyed;
mod kjt;

pub use jagged::JaggedTensor;
pub use keyed::KeyedTensor;
pub use kjt::{FeatureView, InverseIndices, KeyedJaggedTensor};

/// An inconsistent sparse container or operation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SparseError {
    /// The parts of a container do not agree (lengths vs values, offsets, weights, ...).
    #[error("inconsistent {container}: {message}")]
    Inconsistent {
        /// The container being built.
        container: &'static str,
        /// What disagrees.
        message: String,
    },
    /// A key was asked for that the container does not hold.
    #[error("unknown key \"{key}\"{}; keys: {}", .suggestion.as_ref().map(|s| format!(" (did you mean \"{s}\"?)")).unwrap_or_default(), .keys.join(", "))]
    UnknownKey {
        /// The key asked for.
        key: String,
        /// The closest existing key.
        suggestion: Option<String>,
        /// The keys held.
        keys: Vec<String>,
    },
    /// An operation's arguments do not fit the container.
    #[error("{op}: {message}")]
    BadArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
}

pub(crate) fn inconsistent(container: &'static str, message: impl Into<String>) -> SparseError {
    SparseError::Inconsistent { container, message: message.into() }
}

pub(crate) fn unknown_key(key: &str, keys: &[String]) -> SparseError {
    let suggestion = keys
        .iter()
        .map(|k| (strsim::levenshtein(k, key), k))
        .filter(|(d, k)| *d <= (k.len().max(key.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone());
    SparseError::UnknownKey { key: key.to_string(), suggestion, keys: keys.to_vec() }
}

/// Offsets (len + 1, starting at 0) from lengths.
pub(crate) fn offsets_from_lengths(lengths: &[u32]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(lengths.len() + 1);
    let mut acc = 0usize;
    offsets.push(0);
    for &l in lengths {
        acc += l as usize;
        offsets.push(acc);
    }
    offsets
}

/// Lengths from offsets, checking that offsets start at 0 and never decrease.
pub(crate) fn lengths_from_offsets(container: &'static str, offsets: &[usize]) -> Result<Vec<u32>, SparseError> {
    if offsets.first() != Some(&0) {
        return Err(inconsistent(container, "offsets must start at 0"));
    }
    offsets
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            if w[1] < w[0] {
                Err(inconsistent(container, format!("offsets decrease at position {}: {} then {}", i + 1, w[0], w[1])))
            } else {
                u32::try_from(w[1] - w[0])
                    .map_err(|_| inconsistent(container, format!("bag {i} is longer than u32::MAX")))
            }
        })
        .collect()
}
