//! Managed collisions' settings: the eviction policy a recipe names, one table's settings, and
//! the table split into independent modules (one per row-wise shard).

use std::ops::Range;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;
use crate::block::even_block;

/// How the tracked ids are chosen at each eviction (a table's `mc.eviction_policy`; the
/// age's exponent is `mc.decay_exponent`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum McEvictionPolicy {
    /// Least frequently used ids are evicted.
    #[default]
    Lfu,
    /// Least recently used ids are evicted.
    Lru,
    /// Ids with the lowest count / age^decay_exponent are evicted.
    DistanceLfu,
}

impl Word for McEvictionPolicy {
    const WORDS: &'static [Self] = &[Self::Lfu, Self::Lru, Self::DistanceLfu];
    fn name(self) -> &'static str {
        match self {
            Self::Lfu => "lfu",
            Self::Lru => "lru",
            Self::DistanceLfu => "distance_lfu",
        }
    }
}

/// One table's managed-collision settings.
#[derive(Clone, Debug, PartialEq)]
pub struct McConfig {
    /// Rows of the table.
    pub rows: u64,
    /// Slots for tracked ids (`<= rows`); see the module docs for the fallback.
    pub zch_size: u64,
    /// Size of the raw id space: raw ids are in `0..input_hash_size`.
    pub input_hash_size: u64,
    /// The policy.
    pub policy: McEvictionPolicy,
    /// Exponent of the age in the scores of `lru` and `distance_lfu` (unused by `lfu`).
    pub decay_exponent: f64,
    /// Training steps per eviction window.
    pub eviction_interval: u64,
}

/// One of the independent modules a table's managed collisions are split into
/// ([`McConfig::partitions`]): the ids of its block of the raw id space, remapped into its
/// block of rows.
#[derive(Clone, Debug, PartialEq)]
pub struct McPartition {
    /// Its raw ids.
    pub raw: Range<u64>,
    /// Its rows of the table (the module's row `r` is the table's row `rows.start + r`).
    pub rows: Range<u64>,
    /// The module's settings: its rows, slots and raw id space.
    pub config: McConfig,
}

impl McConfig {
    /// `Err` names the setting that is out of range.
    pub fn check(&self) -> Result<(), String> {
        if self.zch_size == 0 || self.zch_size > self.rows {
            return Err(format!("zch_size = {} must be in 1..={} (the table's rows)", self.zch_size, self.rows));
        }
        if self.zch_size == self.rows && self.rows < 2 {
            return Err("a table of one row has no room for a tracked id next to the reserved row".into());
        }
        if self.input_hash_size == 0 {
            return Err("input_hash_size must be at least 1".into());
        }
        if self.eviction_interval == 0 {
            return Err("eviction_interval must be at least 1".into());
        }
        if self.rows > u64::from(u32::MAX) {
            return Err(format!("{} rows: at most {} slots", self.rows, u32::MAX));
        }
        if self.policy != McEvictionPolicy::Lfu && !(self.decay_exponent.is_finite() && self.decay_exponent > 0.0) {
            return Err(format!("decay_exponent = {} must be a positive number", self.decay_exponent));
        }
        Ok(())
    }

    /// The table's managed collisions split into `n` independent modules (TorchRec's one
    /// module per row-wise shard): module `i` takes the raw ids of block `i` of
    /// `ceil(input_hash_size / n)` ids and owns block `i` of `ceil(rows / n)` rows (the
    /// row-wise shards' blocks), of which the last `ceil((rows - zch_size) / n)` (fewer in
    /// the last blocks) are its residual rows; without residual rows it keeps its last row
    /// for its untracked ids. `n = 1` is the table itself. `Err` says which module does not
    /// fit.
    pub fn partitions(&self, n: u64) -> Result<Vec<McPartition>, String> {
        if n == 0 {
            return Err("partitions must be at least 1".into());
        }
        let residual = self.rows.saturating_sub(self.zch_size);
        (0..n)
            .map(|i| {
                let (raw, rows, res) =
                    (even_block(self.input_hash_size, n, i), even_block(self.rows, n, i), even_block(residual, n, i));
                if raw.is_empty() || rows.is_empty() {
                    return Err(format!(
                        "{n} partitions leave partition {i} without {} (input_hash_size {}, rows {})",
                        if raw.is_empty() { "raw ids" } else { "rows" },
                        self.input_hash_size,
                        self.rows
                    ));
                }
                let own = rows.end - rows.start;
                let zch_size = own.saturating_sub(res.end - res.start);
                let config = McConfig { rows: own, zch_size, ..self.clone() };
                config.check().map_err(|m| format!("partition {i} of {n} (rows {rows:?}): {m}"))?;
                Ok(McPartition { raw, rows, config })
            })
            .collect()
    }
}
