//! A job's dynamic tables (`tables[].dynamic`): each keeps a [`DynamicTable`] id map in front
//! of its rows. Training batches are counted, admitted and remapped before the lookup — on
//! every rank over the global batch's ids, so every rank's map stays the same and the table
//! can be sharded any way — and evaluation batches remapped; ids without a row are dropped
//! from their bags (a zero embedding, no update). Rows that change hands are re-initialised.

use std::collections::BTreeMap;

use trainrec_comm::{ProcessGroup, ProcessGroupExt};
use trainrec_embedding::dynamic::{
    DynamicConfig, DynamicEviction, DynamicState, DynamicStats, DynamicTable, NOT_ADMITTED,
};
use trainrec_recipe::{DynamicEvictionPolicy, Recipe};
use trainrec_sparse::KeyedJaggedTensor;
use trainrec_types::FeatureRef;

use crate::error::EngineError;

/// One dynamic table: its name, the input features it reads, its id map.
pub(crate) struct DynTable {
    pub(crate) name: String,
    keys: Vec<String>,
    pub(crate) table: DynamicTable,
    index: usize,
}

/// Every dynamic table of a job.
#[derive(Default)]
pub(crate) struct DynamicTables {
    pub(crate) tables: Vec<DynTable>,
    seed: u64,
}

fn bad(table: &str, m: impl std::fmt::Display) -> EngineError {
    EngineError::Embedding(trainrec_embedding::EmbeddingError::Config(format!("table \"{table}\": dynamic: {m}")))
}

/// The seed of table `index`'s sketch and coin.
fn table_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64 + 1).wrapping_mul(0x9FB2_1C65_1E98_DF25) ^ 0xD1_7A_B1_E5
}

impl DynamicTables {
    /// The recipe's dynamic tables (settings already validated).
    pub(crate) fn new(recipe: &Recipe) -> Result<Self, EngineError> {
        let seed = recipe.run.seed;
        let mut tables = Vec::new();
        for (i, t) in recipe.tables.iter().enumerate() {
            let Some(d) = &t.dynamic else { continue };
            let config = DynamicConfig {
                capacity: u32::try_from(t.rows).map_err(|_| bad(&t.name, "more rows than a dynamic table holds"))?,
                admit_after: d.admit_after,
                admit_probability: d.admit_probability,
                ttl_steps: d.ttl_steps,
                eviction: match d.eviction {
                    DynamicEvictionPolicy::Lfu => DynamicEviction::Lfu,
                    DynamicEvictionPolicy::Lru => DynamicEviction::Lru,
                },
                sketch_width: d.sketch_width,
                sketch_depth: d.sketch_depth,
                seed: table_seed(seed, i),
            };
            tables.push(DynTable {
                name: t.name.clone(),
                keys: t.features.iter().map(|f| FeatureRef::parse(f).input.to_string()).collect(),
                table: DynamicTable::new(config).map_err(|m| bad(&t.name, m))?,
                index: i,
            });
        }
        Ok(Self { tables, seed })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    fn keys_of(t: &DynTable, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, EngineError> {
        t.keys
            .iter()
            .map(|k| {
                let i = kjt.key_index(k).ok_or_else(|| bad(&t.name, format!("the batch has no feature '{k}'")))?;
                if let Some(&id) = kjt.feature(i).values.iter().find(|&&id| id < 0) {
                    return Err(bad(
                        &t.name,
                        format!("feature '{k}' has the negative id {id}; raw ids are non-negative"),
                    ));
                }
                Ok(i)
            })
            .collect()
    }

    /// Counts, admits and remaps a training batch's raw ids (one bag per example), then drops
    /// the ids without a row. Returns, per table, the rows that changed hands and the key of
    /// their new initial values.
    pub(crate) fn train(
        &mut self,
        kjt: &mut KeyedJaggedTensor,
        pg: Option<&dyn ProcessGroup>,
    ) -> Result<Vec<(String, Vec<u64>, u64)>, EngineError> {
        if self.tables.is_empty() {
            return Ok(Vec::new());
        }
        let mut resets = Vec::new();
        let mut dropped = Vec::new();
        let seed = self.seed;
        for t in &mut self.tables {
            let keys = Self::keys_of(t, kjt)?;
            let mut per_key = kjt.values_per_key_mut();
            let fresh = match pg {
                // Every rank counts the global batch (ranks in order), so the maps agree; each
                // keeps its own ids' rows, as a one-rank run of that global batch would.
                Some(pg) => {
                    let mut global = Vec::with_capacity(keys.len());
                    let mut mine = Vec::with_capacity(keys.len());
                    for &i in &keys {
                        let counts: Vec<usize> =
                            pg.all_gather_u64(per_key[i].len() as u64)?.into_iter().map(|n| n as usize).collect();
                        let start: usize = counts[..pg.rank()].iter().sum();
                        global.push(pg.all_gather_v(per_key[i], &counts)?);
                        mine.push(start);
                    }
                    let mut all: Vec<&mut [i64]> = global.iter_mut().map(Vec::as_mut_slice).collect();
                    let fresh = t.table.train_step(&mut all);
                    for ((&i, g), start) in keys.iter().zip(&global).zip(mine) {
                        let n = per_key[i].len();
                        per_key[i].copy_from_slice(&g[start..start + n]);
                    }
                    fresh
                }
                None => {
                    let mut mine: Vec<&mut [i64]> = Vec::with_capacity(keys.len());
                    for (i, slice) in per_key.iter_mut().enumerate() {
                        if keys.contains(&i) {
                            mine.push(std::mem::take(slice));
                        }
                    }
                    t.table.train_step(&mut mine)
                }
            };
            if !fresh.is_empty() {
                let key = seed
                    ^ (t.index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407)
                    ^ t.table.step().wrapping_mul(0xD6E8_FEB8_6659_FD93)
                    ^ 0xD7;
                resets.push((t.name.clone(), fresh.into_iter().map(u64::from).collect(), key));
            }
            dropped.extend(keys);
        }
        drop_not_admitted(kjt, &dropped)?;
        Ok(resets)
    }

    /// Remaps an evaluation batch's raw ids (one bag per example) and drops those without a
    /// row; nothing is counted.
    pub(crate) fn eval(&self, kjt: &mut KeyedJaggedTensor) -> Result<(), EngineError> {
        let mut dropped = Vec::new();
        for t in &self.tables {
            let keys = Self::keys_of(t, kjt)?;
            let mut per_key = kjt.values_per_key_mut();
            for &i in &keys {
                t.table.remap(per_key[i]);
            }
            dropped.extend(keys);
        }
        drop_not_admitted(kjt, &dropped)
    }

    /// Each table's counters.
    pub(crate) fn stats(&self) -> BTreeMap<String, DynamicStats> {
        self.tables.iter().map(|t| (t.name.clone(), t.table.stats())).collect()
    }

    /// Metric values: `dynamic/<table>/live_rows`, `admitted`, `rejected`, `expired`,
    /// `evicted`, `map_mib` (the id map and sketch; the rows are the table's).
    pub(crate) fn metric_values(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for t in &self.tables {
            let s = t.table.stats();
            let n = &t.name;
            out.insert(format!("dynamic/{n}/live_rows"), s.live as f64);
            out.insert(format!("dynamic/{n}/admitted"), s.admitted as f64);
            out.insert(format!("dynamic/{n}/rejected"), s.rejected as f64);
            out.insert(format!("dynamic/{n}/expired"), s.expired as f64);
            out.insert(format!("dynamic/{n}/evicted"), s.evicted as f64);
            out.insert(format!("dynamic/{n}/map_mib"), t.table.bytes() as f64 / (1 << 20) as f64);
        }
        out
    }

    /// Each table's state, by name.
    pub(crate) fn states(&self) -> Vec<(String, DynamicState)> {
        self.tables.iter().map(|t| (t.name.clone(), t.table.state())).collect()
    }

    /// Restores table `name`'s state.
    pub(crate) fn load(&mut self, name: &str, state: DynamicState) -> Result<(), EngineError> {
        let t = self.tables.iter_mut().find(|t| t.name == name).ok_or_else(|| bad(name, "no such dynamic table"))?;
        t.table.load(state).map_err(|m| bad(name, m))
    }

    /// Keeps of each dynamic table's blocks only the rows an id holds (what a checkpoint
    /// saves: in proportion to the live rows; a free row is re-initialised when an id takes
    /// it, so its values are never read).
    pub(crate) fn live_rows_only(&self, shards: &mut [trainrec_embedding::LocalShard]) {
        for s in shards.iter_mut() {
            let Some(t) = self.tables.iter().find(|t| t.name == s.table) else { continue };
            let ids = t.table.ids();
            let held: Vec<u64> = match &s.stored {
                Some(rows) => rows.clone(),
                None => s.rows.clone().collect(),
            };
            let n = held.len().max(1);
            let (w, st) = (s.weights.len() / n, s.optimizer_state.len() / n);
            let (mut weights, mut state, mut live) = (Vec::new(), Vec::new(), Vec::new());
            for (i, &r) in held.iter().enumerate() {
                if ids.get(r as usize).is_some_and(|&id| id != NOT_ADMITTED) {
                    live.push(r);
                    weights.extend_from_slice(&s.weights[i * w..][..w]);
                    state.extend_from_slice(&s.optimizer_state[i * st..][..st]);
                }
            }
            s.weights = weights;
            s.optimizer_state = state;
            s.stored = Some(live);
        }
    }

    /// Table `name`'s map for serving: the live ids sorted, with their rows.
    pub(crate) fn serving(&self, name: &str) -> Option<(Vec<i64>, Vec<i64>)> {
        let t = self.tables.iter().find(|t| t.name == name)?;
        let mut pairs: Vec<(i64, i64)> = t
            .table
            .ids()
            .iter()
            .enumerate()
            .filter(|(_, id)| **id != NOT_ADMITTED)
            .map(|(r, &id)| (id, r as i64))
            .collect();
        pairs.sort_unstable();
        Some(pairs.into_iter().unzip())
    }
}

/// Rebuilds `kjt` (one bag per example) without the [`NOT_ADMITTED`] ids of features `keys`;
/// nothing is copied when there are none.
fn drop_not_admitted(kjt: &mut KeyedJaggedTensor, keys: &[usize]) -> Result<(), EngineError> {
    let any = keys.iter().any(|&k| kjt.feature(k).values.contains(&NOT_ADMITTED));
    if !any {
        return Ok(());
    }
    let stride = kjt.stride();
    let nkeys = kjt.keys().len();
    let mut values = Vec::with_capacity(kjt.values().len());
    let mut weights = kjt.weights().map(|w| Vec::with_capacity(w.len()));
    let mut lengths = Vec::with_capacity(nkeys * stride);
    for k in 0..nkeys {
        let f = kjt.feature(k);
        let filter = keys.contains(&k);
        for b in 0..f.num_bags() {
            let bag = f.bag(b);
            let w = f.bag_weights(b);
            let mut n = 0u32;
            for (j, &id) in bag.iter().enumerate() {
                if filter && id == NOT_ADMITTED {
                    continue;
                }
                values.push(id);
                if let (Some(out), Some(w)) = (weights.as_mut(), w) {
                    out.push(w[j]);
                }
                n += 1;
            }
            lengths.push(n);
        }
    }
    *kjt = KeyedJaggedTensor::new(kjt.keys().to_vec(), values, weights, lengths, stride)
        .map_err(|e| EngineError::Internal(format!("dynamic tables: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_without_a_row_leave_their_bags() {
        let keys = vec!["a".to_string(), "b".to_string()];
        // a: bags [5, -1], [-1]; b: [-1, 7], [] (b is not a dynamic feature: kept as is).
        let mut kjt = KeyedJaggedTensor::new(
            keys.clone(),
            vec![5, NOT_ADMITTED, NOT_ADMITTED, NOT_ADMITTED, 7],
            None,
            vec![2, 1, 2, 0],
            2,
        )
        .unwrap();
        drop_not_admitted(&mut kjt, &[0]).unwrap();
        assert_eq!(kjt.values(), [5, NOT_ADMITTED, 7]);
        assert_eq!(kjt.lengths(), [1, 0, 2, 0]);
    }
}
