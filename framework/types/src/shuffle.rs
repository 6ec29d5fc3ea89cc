//! The shuffling of training data (`data.shuffle`).

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{Diagnostic, KeyPath, Word};

/// The largest shuffle buffer, in rows: beyond it a `full` shuffle says what is meant.
pub const MAX_BUFFER_ROWS: u64 = 1 << 30;

/// How the rows of each training epoch are reordered before they are batched (the eval split is
/// never shuffled). The permutation is within this rank's share of the rows: ranks stay
/// disjoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Shuffle {
    /// `none`: the sampler's order; `buffer`: a bounded shuffle buffer of `rows` rows (each row
    /// out is drawn uniformly from the buffer, whose slot takes the next row read); `full`: a
    /// uniform random permutation of the rank's whole epoch (held in memory).
    #[serde(default)]
    pub kind: ShuffleKind,
    /// `buffer`: the rows the buffer holds (1 keeps the sampler's order; at most 2^30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u64>,
}

/// What a [`Shuffle`] does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShuffleKind {
    /// The sampler's order.
    #[default]
    None,
    /// A bounded shuffle buffer.
    Buffer,
    /// A uniform random permutation of the epoch.
    Full,
}

impl Word for ShuffleKind {
    const WORDS: &'static [Self] = &[Self::None, Self::Buffer, Self::Full];
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Buffer => "buffer",
            Self::Full => "full",
        }
    }
}

impl Shuffle {
    /// No shuffle.
    pub const NONE: Self = Self { kind: ShuffleKind::None, rows: None };
    /// A full permutation of each epoch.
    pub const FULL: Self = Self { kind: ShuffleKind::Full, rows: None };

    /// A shuffle buffer of `rows` rows.
    pub fn buffer(rows: u64) -> Self {
        Self { kind: ShuffleKind::Buffer, rows: Some(rows) }
    }

    /// The problems of the shuffle at `key`.
    pub fn check(&self, key: &KeyPath) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        match (self.kind, self.rows) {
            (ShuffleKind::Buffer, None) => out.push(
                Diagnostic::new(key.key("rows"), "a shuffle buffer needs its size in rows")
                    .with_help("write for example `shuffle = { kind = \"buffer\", rows = 100000 }`"),
            ),
            (ShuffleKind::Buffer, Some(0)) => out.push(
                Diagnostic::new(key.key("rows"), "rows = 0: a shuffle buffer holds at least 1 row")
                    .with_help("1 row keeps the sampler's order; use kind = \"none\" for that"),
            ),
            (ShuffleKind::Buffer, Some(n)) if n > MAX_BUFFER_ROWS => out.push(
                Diagnostic::new(
                    key.key("rows"),
                    format!("rows = {n}: a shuffle buffer holds at most {MAX_BUFFER_ROWS} rows"),
                )
                .with_help("use kind = \"full\" to permute the whole epoch"),
            ),
            (ShuffleKind::None | ShuffleKind::Full, Some(_)) => out.push(
                Diagnostic::new(
                    key.key("rows"),
                    format!("rows applies to kind = \"buffer\" only, not \"{}\"", self.kind.name()),
                )
                .with_help("remove rows, or set kind = \"buffer\""),
            ),
            _ => {}
        }
        out
    }

    /// The buffer's rows for `buffer` (checked by [`Self::check`]).
    pub fn buffer_rows(&self) -> Option<u64> {
        (self.kind == ShuffleKind::Buffer).then_some(self.rows).flatten()
    }
}

/// The command-line spelling: `none`, `full`, `buffer:<rows>`.
impl fmt::Display for Shuffle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, self.rows) {
            (ShuffleKind::Buffer, Some(n)) => write!(f, "buffer:{n}"),
            (kind, _) => f.write_str(kind.name()),
        }
    }
}

/// Reads the command-line spelling (`none`, `full`, `buffer:<rows>`), checked as a recipe's.
impl FromStr for Shuffle {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let shuffle = match text.split_once(':') {
            Some(("buffer", rows)) => {
                Self::buffer(rows.parse().map_err(|_| format!("buffer:{rows}: the rows must be a whole number"))?)
            }
            None if text == "none" => Self::NONE,
            None if text == "full" => Self::FULL,
            _ => return Err(format!("{text:?} is not a shuffle: write none, full or buffer:<rows>")),
        };
        match shuffle.check(&KeyPath::root()).first() {
            Some(d) => Err(d.message.clone()),
            None => Ok(shuffle),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_rows_key() {
        let key = KeyPath::root().key("data").key("shuffle");
        let problems =
            |s: Shuffle| s.check(&key).into_iter().map(|d| (d.key.to_string(), d.message)).collect::<Vec<_>>();
        assert!(problems(Shuffle::NONE).is_empty());
        assert!(problems(Shuffle::FULL).is_empty());
        assert!(problems(Shuffle::buffer(1)).is_empty());
        assert!(problems(Shuffle::buffer(MAX_BUFFER_ROWS)).is_empty());
        for bad in [
            Shuffle::buffer(0),
            Shuffle::buffer(MAX_BUFFER_ROWS + 1),
            Shuffle { kind: ShuffleKind::Buffer, rows: None },
            Shuffle { kind: ShuffleKind::Full, rows: Some(5) },
            Shuffle { kind: ShuffleKind::None, rows: Some(5) },
        ] {
            let p = problems(bad);
            assert_eq!(p.len(), 1, "{bad:?}");
            assert_eq!(p[0].0, "data.shuffle.rows", "{bad:?}");
        }
    }

    #[test]
    fn the_flag_spelling_round_trips_and_refuses_bad_values() {
        for s in [Shuffle::NONE, Shuffle::FULL, Shuffle::buffer(4096)] {
            assert_eq!(s.to_string().parse::<Shuffle>(), Ok(s));
        }
        for bad in ["", "buffer", "buffer:", "buffer:0", "buffer:x", "ful", "full:3", "buffer:-1"] {
            assert!(bad.parse::<Shuffle>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_recipe_spelling_reads_tables() {
        let s: Shuffle = serde_json::from_str(r#"{"kind": "buffer", "rows": 10}"#).unwrap();
        assert_eq!(s, Shuffle::buffer(10));
        let s: Shuffle = serde_json::from_str(r#"{"kind": "full"}"#).unwrap();
        assert_eq!(s, Shuffle::FULL);
        assert_eq!(serde_json::to_string(&Shuffle::FULL).unwrap(), r#"{"kind":"full"}"#);
        assert!(serde_json::from_str::<Shuffle>(r#"{"kind": "full", "size": 3}"#).is_err());
    }
}
