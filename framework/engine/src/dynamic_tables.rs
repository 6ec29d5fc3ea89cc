//! A job's dynamic tables (`tables[].dynamic`): each keeps [`DynamicTable`] id maps in front of
//! its rows, one per partition (`dynamic.partitions`): raw id `i` belongs to map
//! [`hashed_part`]`(i, partitions)`, which owns that row block of the table (the row-wise
//! blocks) and admits, counts and evicts on its own. Training batches are counted, admitted
//! and remapped before the lookup, evaluation batches remapped; ids without a row are dropped
//! from their bags (a zero embedding, no update). Rows that change hands are re-initialised.
//! Two ways to run a table's maps, chosen from the plan:
//! - **Owner-rank admission**: when the table is sharded row-wise in the partitions' blocks,
//!   the input dist routes each raw id to the rank of its map's block
//!   ([`ShardedEbc::route_hashed_ids`]), and that rank's map counts and remaps it into its
//!   shard's rows. No rank sees another's ids or holds another's map state.
//! - **Replicated**: otherwise every rank runs every map over the global batch's ids (ranks in
//!   order), so the maps stay the same on every rank and the table can be sharded any way.
//!
//! Both train the same model.

use std::collections::BTreeMap;
use std::ops::Range;

use trainrec_comm::{ProcessGroup, ProcessGroupExt};
use trainrec_embedding::dynamic::{
    DynamicConfig, DynamicEviction, DynamicState, DynamicStats, DynamicTable, NOT_ADMITTED,
};
use trainrec_planner::Plan;
use trainrec_recipe::{DynamicEvictionPolicy, Recipe};
use trainrec_sharding::{InputDist, ShardedEbc, TableSharding, hashed_part};
use trainrec_sparse::KeyedJaggedTensor;
use trainrec_types::FeatureRef;

use crate::error::EngineError;

/// One id map of a table: its row block and whether this rank runs it.
pub(crate) struct DynPart {
    rows: Range<u64>,
    pub(crate) table: DynamicTable,
    here: bool,
}

/// One dynamic table: its name, the input features it reads, its id maps.
pub(crate) struct DynTable {
    pub(crate) name: String,
    keys: Vec<String>,
    pub(crate) parts: Vec<DynPart>,
    index: usize,
    /// Remapped on the owning ranks after the input dist.
    owner: bool,
}

impl DynTable {
    /// The part of raw id `id`.
    fn part_of(&self, id: i64) -> usize {
        if self.parts.len() == 1 { 0 } else { hashed_part(id, self.parts.len()) }
    }

    /// The part whose rows hold table row `row`.
    fn part_of_row(&self, row: u64) -> Option<usize> {
        self.parts.iter().position(|p| p.rows.contains(&row))
    }

    /// The key of the initial values of rows part `pi` hands to new ids at its step.
    fn reset_key(&self, seed: u64, pi: usize) -> u64 {
        seed ^ (self.index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407)
            ^ self.parts[pi].table.step().wrapping_mul(0xD6E8_FEB8_6659_FD93)
            ^ (pi as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ 0xD7
    }

    /// One training step of every part over `features` (the table's ids, raw, in order):
    /// ids replaced by table rows ([`NOT_ADMITTED`] without one); the rows handed to new ids
    /// pushed to `out`.
    fn train(&mut self, seed: u64, features: &mut [&mut [i64]], out: &mut Vec<(String, Vec<u64>, u64)>) {
        if self.parts.len() == 1 {
            let fresh = self.parts[0].table.train_step(features);
            self.push_resets(seed, 0, fresh, out);
            return;
        }
        // Each part's ids in order (a part's step over one slice equals its step over the
        // features one after another), then the rows back in place.
        let n = self.parts.len();
        let mut ids: Vec<Vec<i64>> = vec![Vec::new(); n];
        // Each id's part, in order (hashed once).
        let mut part: Vec<usize> = Vec::with_capacity(features.iter().map(|f| f.len()).sum());
        for f in features.iter() {
            for &id in f.iter() {
                let pi = self.part_of(id);
                ids[pi].push(id);
                part.push(pi);
            }
        }
        for (pi, part_ids) in ids.iter_mut().enumerate() {
            let fresh = self.parts[pi].table.train_step(&mut [part_ids.as_mut_slice()]);
            self.push_resets(seed, pi, fresh, out);
        }
        let mut at = vec![0usize; n];
        let mut part = part.into_iter();
        for f in features.iter_mut() {
            for id in f.iter_mut() {
                let pi = part.next().expect("a part for every id");
                let row = ids[pi][at[pi]];
                at[pi] += 1;
                *id = if row == NOT_ADMITTED { NOT_ADMITTED } else { row + self.parts[pi].rows.start as i64 };
            }
        }
    }

    fn push_resets(&self, seed: u64, pi: usize, fresh: Vec<u32>, out: &mut Vec<(String, Vec<u64>, u64)>) {
        if fresh.is_empty() {
            return;
        }
        let start = self.parts[pi].rows.start;
        out.push((
            self.name.clone(),
            fresh.into_iter().map(|r| start + u64::from(r)).collect(),
            self.reset_key(seed, pi),
        ));
    }

    /// Raw ids replaced by table rows ([`NOT_ADMITTED`] without one), nothing counted.
    fn remap(&self, ids: &mut [i64]) {
        for id in ids {
            let p = &self.parts[self.part_of(*id)];
            *id = p.table.row_of(*id).map_or(NOT_ADMITTED, |r| (p.rows.start + u64::from(r)) as i64);
        }
    }

    /// Counters summed over the parts this rank runs.
    fn stats(&self) -> DynamicStats {
        let mut s = DynamicStats::default();
        for p in self.parts.iter().filter(|p| p.here) {
            let x = p.table.stats();
            s.live += x.live;
            s.admitted += x.admitted;
            s.rejected += x.rejected;
            s.expired += x.expired;
            s.evicted += x.evicted;
            s.lookups += x.lookups;
        }
        s
    }

    /// Bytes of the maps this rank runs.
    fn bytes(&self) -> u64 {
        self.parts.iter().filter(|p| p.here).map(|p| p.table.bytes()).sum()
    }
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

/// The seed of table `index`'s sketch and coin (part `pi`'s).
fn table_seed(seed: u64, index: usize, pi: usize) -> u64 {
    seed ^ (index as u64 + 1).wrapping_mul(0x9FB2_1C65_1E98_DF25)
        ^ 0xD1_7A_B1_E5
        ^ (pi as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
}

impl DynamicTables {
    /// The recipe's dynamic tables (settings already validated).
    pub(crate) fn new(recipe: &Recipe) -> Result<Self, EngineError> {
        let seed = recipe.run.seed;
        let mut tables = Vec::new();
        for (i, t) in recipe.tables.iter().enumerate() {
            let Some(d) = &t.dynamic else { continue };
            let n = u64::from(d.partitions.max(1));
            let block = t.rows.div_ceil(n);
            let mut parts = Vec::new();
            for pi in 0..n {
                let rows = (pi * block).min(t.rows)..((pi + 1) * block).min(t.rows);
                let config = DynamicConfig {
                    capacity: u32::try_from(rows.end - rows.start)
                        .map_err(|_| bad(&t.name, "more rows than a dynamic table holds"))?,
                    admit_after: d.admit_after,
                    admit_probability: d.admit_probability,
                    ttl_steps: d.ttl_steps,
                    eviction: match d.eviction {
                        DynamicEvictionPolicy::Lfu => DynamicEviction::Lfu,
                        DynamicEvictionPolicy::Lru => DynamicEviction::Lru,
                    },
                    sketch_width: d.sketch_width,
                    sketch_depth: d.sketch_depth,
                    seed: table_seed(seed, i, pi as usize),
                };
                let table =
                    DynamicTable::new(config).map_err(|m| bad(&t.name, format!("partition {pi} of {n}: {m}")))?;
                parts.push(DynPart { rows, table, here: true });
            }
            tables.push(DynTable {
                name: t.name.clone(),
                keys: t.features.iter().map(|f| FeatureRef::parse(f).input.to_string()).collect(),
                parts,
                index: i,
                owner: false,
            });
        }
        Ok(Self { tables, seed })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// Chooses each table's way to run (see the module docs) for a sharded job's plan and
    /// routes the owner-admitted tables' ids by hashed raw id. Called after building the job
    /// and after restoring a checkpoint; `None`: the job is not sharded (every map runs here).
    pub(crate) fn attach(&mut self, sharded: Option<&mut ShardedEbc>, plan: &Plan) -> Result<(), EngineError> {
        let Some(s) = sharded else {
            for t in &mut self.tables {
                t.owner = false;
                t.parts.iter_mut().for_each(|p| p.here = true);
            }
            return Ok(());
        };
        let me = s.group().rank();
        for t in &mut self.tables {
            let sharding = plan.tables.iter().find(|p| p.name == t.name).map(TableSharding::from_plan);
            let aligned = sharding.filter(|sh| {
                t.parts.len() > 1
                    && sh.shards.len() == t.parts.len()
                    && sh.shards.iter().zip(&t.parts).all(|(x, p)| x.rows == p.rows && x.cols.start == 0)
                    && sh.shards.iter().all(|x| x.cols.end == sh.shards[0].cols.end)
            });
            t.owner = aligned.is_some();
            for (pi, p) in t.parts.iter_mut().enumerate() {
                p.here = aligned.as_ref().is_none_or(|sh| sh.shards[pi].rank == me);
            }
            s.route_hashed_ids(&t.name, t.owner)?;
            tracing::debug!(table = %t.name, partitions = t.parts.len(), owner_admission = t.owner, "dynamic table");
        }
        Ok(())
    }

    /// Whether some table is admitted on its owning ranks (after the input dist).
    pub(crate) fn has_owner(&self) -> bool {
        self.tables.iter().any(|t| t.owner)
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

    /// Counts, admits and remaps a training batch's raw ids (one bag per example) of the
    /// replicated tables, then drops the ids without a row (the owner-admitted tables' ids
    /// stay raw for [`Self::train_owned`]). Returns, per table, the rows that changed hands
    /// and the key of their new initial values.
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
            if t.owner {
                continue;
            }
            let mut per_key = kjt.values_per_key_mut();
            match pg {
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
                    t.train(seed, &mut all, &mut resets);
                    for ((&i, g), start) in keys.iter().zip(&global).zip(mine) {
                        let n = per_key[i].len();
                        per_key[i].copy_from_slice(&g[start..start + n]);
                    }
                }
                None => {
                    let mut mine: Vec<&mut [i64]> = Vec::with_capacity(keys.len());
                    for (i, slice) in per_key.iter_mut().enumerate() {
                        if keys.contains(&i) {
                            mine.push(std::mem::take(slice));
                        }
                    }
                    t.train(seed, &mut mine, &mut resets);
                }
            }
            dropped.extend(keys);
        }
        drop_not_admitted(kjt, &dropped)?;
        Ok(resets)
    }

    /// The owner-rank admission of a training batch after its input dist (`staged`): each
    /// map run here counts, admits and remaps the raw ids routed to it into its shard's rows
    /// (local numbering), and the ids without a row leave their bags. Returns the rows to
    /// re-initialise (this rank's, as table rows).
    pub(crate) fn train_owned(
        &mut self,
        s: &ShardedEbc,
        staged: &mut InputDist,
    ) -> Result<Vec<(String, Vec<u64>, u64)>, EngineError> {
        let mut routed: BTreeMap<(String, usize), Vec<&mut [i64]>> = BTreeMap::new();
        for (table, shard, ids) in s.raw_ids_mut(staged) {
            routed.entry((table, shard)).or_default().push(ids);
        }
        let (seed, mut out) = (self.seed, Vec::new());
        for t in self.tables.iter_mut().filter(|t| t.owner) {
            for pi in 0..t.parts.len() {
                if !t.parts[pi].here {
                    continue;
                }
                let mut ids = routed.remove(&(t.name.clone(), pi)).unwrap_or_default();
                let fresh = t.parts[pi].table.train_step(&mut ids);
                t.push_resets(seed, pi, fresh, &mut out);
            }
        }
        drop(routed);
        s.drop_local_ids(staged, NOT_ADMITTED)?;
        Ok(out)
    }

    /// Remaps an evaluation batch's raw ids (one bag per example) of the replicated tables
    /// and drops those without a row; nothing is counted.
    pub(crate) fn eval(&self, kjt: &mut KeyedJaggedTensor) -> Result<(), EngineError> {
        let mut dropped = Vec::new();
        for t in &self.tables {
            let keys = Self::keys_of(t, kjt)?;
            if t.owner {
                continue;
            }
            let mut per_key = kjt.values_per_key_mut();
            for &i in &keys {
                t.remap(per_key[i]);
            }
            dropped.extend(keys);
        }
        drop_not_admitted(kjt, &dropped)
    }

    /// The owner-rank remap of an evaluation batch after its input dist (no counting).
    pub(crate) fn eval_owned(&self, s: &ShardedEbc, staged: &mut InputDist) -> Result<(), EngineError> {
        for (table, shard, ids) in s.raw_ids_mut(staged) {
            if let Some(t) = self.tables.iter().find(|t| t.owner && t.name == table) {
                t.parts[shard].table.remap(ids);
            }
        }
        s.drop_local_ids(staged, NOT_ADMITTED)?;
        Ok(())
    }

    /// Each table's counters over the maps this rank runs.
    pub(crate) fn stats(&self) -> BTreeMap<String, DynamicStats> {
        self.tables.iter().map(|t| (t.name.clone(), t.stats())).collect()
    }

    /// Metric values: `dynamic/<table>/live_rows`, `admitted`, `rejected`, `expired`,
    /// `evicted`, `map_mib` (the id maps and sketches; the rows are the table's), over every
    /// rank's maps. Collective when some table is admitted on its owners.
    pub(crate) fn metric_values(&self, pg: Option<&dyn ProcessGroup>) -> Result<BTreeMap<String, f64>, EngineError> {
        let mut rows: Vec<(String, [u64; 6])> = self
            .tables
            .iter()
            .map(|t| {
                let s = t.stats();
                (t.name.clone(), [s.live, s.admitted, s.rejected, s.expired, s.evicted, t.bytes()])
            })
            .collect();
        if let (Some(pg), true) = (pg, self.has_owner()) {
            let owned: Vec<usize> = (0..self.tables.len()).filter(|&i| self.tables[i].owner).collect();
            let mut counts: Vec<u64> = owned.iter().flat_map(|&i| rows[i].1).collect();
            crate::data_parallel::sum_counts(pg, &mut counts)?;
            for (&i, c) in owned.iter().zip(counts.chunks(6)) {
                rows[i].1.copy_from_slice(c);
            }
        }
        let mut out = BTreeMap::new();
        for (n, [live, admitted, rejected, expired, evicted, bytes]) in rows {
            out.insert(format!("dynamic/{n}/live_rows"), live as f64);
            out.insert(format!("dynamic/{n}/admitted"), admitted as f64);
            out.insert(format!("dynamic/{n}/rejected"), rejected as f64);
            out.insert(format!("dynamic/{n}/expired"), expired as f64);
            out.insert(format!("dynamic/{n}/evicted"), evicted as f64);
            out.insert(format!("dynamic/{n}/map_mib"), bytes as f64 / (1 << 20) as f64);
        }
        Ok(out)
    }

    /// Each table's maps to save: `(table, part, partitions, state)` of the maps this rank
    /// saves (its own under owner-rank admission, else every map on the `lead` rank).
    pub(crate) fn states(&self, lead: bool) -> Vec<(String, usize, usize, DynamicState)> {
        let mut out = Vec::new();
        for t in &self.tables {
            for (pi, p) in t.parts.iter().enumerate() {
                if if t.owner { p.here } else { lead } {
                    out.push((t.name.clone(), pi, t.parts.len(), p.table.state()));
                }
            }
        }
        out
    }

    /// Restores part `part` of table `name`.
    pub(crate) fn load(&mut self, name: &str, part: usize, state: DynamicState) -> Result<(), EngineError> {
        let t = self.tables.iter_mut().find(|t| t.name == name).ok_or_else(|| bad(name, "no such dynamic table"))?;
        let p = t.parts.get_mut(part).ok_or_else(|| bad(name, format!("no partition {part}")))?;
        p.table.load(state).map_err(|m| bad(name, m))
    }

    /// Keeps of each dynamic table's blocks only the rows an id holds (what a checkpoint
    /// saves: in proportion to the live rows; a free row is re-initialised when an id takes
    /// it, so its values are never read). The maps of a block's rows must be here.
    pub(crate) fn live_rows_only(&self, shards: &mut [trainrec_embedding::LocalShard]) {
        for s in shards.iter_mut() {
            let Some(t) = self.tables.iter().find(|t| t.name == s.table) else { continue };
            let held: Vec<u64> = match &s.stored {
                Some(rows) => rows.clone(),
                None => s.rows.clone().collect(),
            };
            let live = |r: u64| {
                t.part_of_row(r).is_some_and(|pi| {
                    let p = &t.parts[pi];
                    p.table.ids().get((r - p.rows.start) as usize).is_some_and(|&id| id != NOT_ADMITTED)
                })
            };
            let n = held.len().max(1);
            let (w, st) = (s.weights.len() / n, s.optimizer_state.len() / n);
            let (mut weights, mut state, mut kept) = (Vec::new(), Vec::new(), Vec::new());
            for (i, &r) in held.iter().enumerate() {
                if live(r) {
                    kept.push(r);
                    weights.extend_from_slice(&s.weights[i * w..][..w]);
                    state.extend_from_slice(&s.optimizer_state[i * st..][..st]);
                }
            }
            s.weights = weights;
            s.optimizer_state = state;
            s.stored = Some(kept);
        }
    }

    /// Table `name`'s map for serving: the live ids sorted, with their table rows (every map
    /// of the table must be here: a job restored on one rank).
    pub(crate) fn serving(&self, name: &str) -> Option<(Vec<i64>, Vec<i64>)> {
        let t = self.tables.iter().find(|t| t.name == name)?;
        let mut pairs: Vec<(i64, i64)> = Vec::new();
        for p in &t.parts {
            pairs.extend(
                p.table
                    .ids()
                    .iter()
                    .enumerate()
                    .filter(|(_, id)| **id != NOT_ADMITTED)
                    .map(|(r, &id)| (id, p.rows.start as i64 + r as i64)),
            );
        }
        pairs.sort_unstable();
        Some(pairs.into_iter().unzip())
    }
}

/// Rebuilds `kjt` (one bag per example) without the [`NOT_ADMITTED`] ids of features `keys`;
/// nothing is copied when there are none.
fn drop_not_admitted(kjt: &mut KeyedJaggedTensor, keys: &[usize]) -> Result<(), EngineError> {
    if let Some(kept) = kjt
        .without_value(|k| keys.contains(&k), NOT_ADMITTED)
        .map_err(|e| EngineError::Internal(format!("dynamic tables: {e}")))?
    {
        *kjt = kept;
    }
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
