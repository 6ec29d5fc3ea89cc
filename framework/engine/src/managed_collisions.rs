//! A job's managed-collision tables (`[tables.mc]`): raw ids remapped to rows before the
//! embedding lookup, profiled on training batches, and the rows of slots that change hands
//! re-initialised (see [`trainrec_embedding::mc`]).
//!
//! A table's managed collisions are split into `partitions` independent modules
//! ([`McConfig::partitions`]), each owning a block of the raw id space and a block of rows.
//! Two ways to run them, chosen per table from the plan:
//! - **Owner-rank remap**: when the table is sharded in the partitions' row blocks (row-wise
//!   or table-row-wise, one block per partition), the input dist routes each raw id to the
//!   rank of its block ([`ShardedEbc::route_raw_ids`]) and that rank's module counts and
//!   remaps it into its shard's rows. No rank sees another's ids or holds another's module
//!   state, as TorchRec's sharded managed-collision modules.
//! - **Replicated**: otherwise (one rank, column-wise, data-parallel, or shards that are not
//!   the partitions' blocks) every rank counts the ids of the global batch in every module,
//!   so the modules stay the same on every rank, and remaps its own ids before the input dist.
//!
//! Both train the same model: a run resumed on another number of ranks keeps its partitions.

use std::collections::BTreeMap;
use std::ops::Range;

use trainrec_comm::{ProcessGroup, ProcessGroupExt};
use trainrec_embedding::BatchContext;
use trainrec_embedding::mc::{ManagedCollision, McConfig, McState, McStats};
use trainrec_planner::{Plan, ShardingType};
use trainrec_recipe::{FeatureRef, Recipe};
use trainrec_sharding::{InputDist, ShardedEbc, TableSharding};
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;
use crate::sparse_arch::SparseArch;

/// One module of a table.
/// Its raw ids are block `i` of [`McTable::raw_block`] ids, `i` its index.
struct Part {
    /// Its rows of the table.
    rows: Range<u64>,
    module: ManagedCollision,
    /// Whether this rank runs it (every part when replicated; the parts of the shards held
    /// here under the owner-rank remap).
    here: bool,
}

struct McTable {
    name: String,
    /// The input features it reads.
    keys: Vec<String>,
    config: McConfig,
    parts: Vec<Part>,
    /// Raw ids per part (the parts' raw block).
    raw_block: u64,
    /// Remapped on the owning ranks after the input dist.
    owner: bool,
}

/// Rows of one table to re-initialise, with the key of their new values.
pub(crate) type Resets = Vec<(String, Vec<u64>, u64)>;

/// Every managed-collision table of a job.
pub(crate) struct McTables {
    tables: Vec<McTable>,
    seed: u64,
    /// The dynamic tables (`tables[].dynamic`), remapped at the same points.
    pub(crate) dynamic: crate::dynamic_tables::DynamicTables,
    /// The metric values of the steps trained so far, kept while the maps already count the
    /// batch staged ahead (a pipeline remaps it while the step before it trains).
    pub(crate) reported: Option<BTreeMap<String, f64>>,
}

fn bad(table: &str, m: impl std::fmt::Display) -> EngineError {
    EngineError::Embedding(trainrec_embedding::EmbeddingError::Config(format!(
        "table \"{table}\": managed collisions: {m}"
    )))
}

/// A table's sharding in the plan when its shards hold whole rows (not data-parallel).
fn blocks_of(plan: &trainrec_planner::TablePlan, dim: usize) -> Option<TableSharding> {
    let s = TableSharding::from_plan(plan);
    let whole_rows = s.shards.iter().all(|sh| sh.cols == (0..dim));
    (s.sharding_type != ShardingType::DataParallel && !s.shards.is_empty() && whole_rows).then_some(s)
}

impl McTable {
    fn split(&mut self, n: u64) -> Result<(), EngineError> {
        let parts = self.config.partitions(n).map_err(|m| bad(&self.name, format!("mc.partitions = {n}: {m}")))?;
        self.raw_block = parts[0].raw.end - parts[0].raw.start;
        self.parts = parts
            .into_iter()
            .map(|p| {
                let module = ManagedCollision::new(p.config).map_err(|m| bad(&self.name, m))?;
                Ok(Part { rows: p.rows, module, here: true })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(())
    }

    /// The part of raw id `id` (checked to be in the raw id space).
    fn part_of(&self, id: i64) -> usize {
        ((id as u64) / self.raw_block) as usize
    }

    /// The row of raw id `id` without counting it.
    fn row_of(&self, id: i64) -> i64 {
        let p = &self.parts[self.part_of(id)];
        (p.rows.start + p.module.row_of(id)) as i64
    }

    /// The key of the new values of rows reset by part `pi` at its eviction round.
    fn reset_key(seed: u64, ti: usize, pi: usize, round: u64) -> u64 {
        seed ^ (ti as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407)
            ^ round.wrapping_mul(0x9FB2_1C65_1E98_DF25)
            ^ (pi as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
    }

    /// One training step of every part on the ids `features` (raw, one slice per feature, the
    /// global batch's or this rank's): each part counts the ids of its raw block. Returns the
    /// resets. With one part the slices are remapped in place.
    fn train(&mut self, seed: u64, ti: usize, features: &mut [&mut [i64]], out: &mut Resets) {
        if self.parts.len() == 1 {
            let rows = self.parts[0].module.train_step(features);
            self.push_resets(seed, ti, 0, rows, out);
            return;
        }
        // One pass buckets the ids by part (in order), one buffer per (part, feature).
        let mut mine: Vec<Vec<Vec<i64>>> = vec![vec![Vec::new(); features.len()]; self.parts.len()];
        for (fi, f) in features.iter().enumerate() {
            for &id in f.iter() {
                mine[self.part_of(id)][fi].push(id);
            }
        }
        for (pi, bufs) in mine.iter_mut().enumerate() {
            let mut slices: Vec<&mut [i64]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            let rows = self.parts[pi].module.train_step(&mut slices);
            self.push_resets(seed, ti, pi, rows, out);
        }
        for f in features.iter_mut() {
            for id in f.iter_mut() {
                *id = self.row_of(*id);
            }
        }
    }

    fn push_resets(&self, seed: u64, ti: usize, pi: usize, rows: Vec<u64>, out: &mut Resets) {
        if rows.is_empty() {
            return;
        }
        let p = &self.parts[pi];
        let key = Self::reset_key(seed, ti, pi, p.module.stats().evictions);
        tracing::debug!(table = %self.name, part = pi, rows = rows.len(), "managed collisions: rows re-initialised");
        out.push((self.name.clone(), rows.into_iter().map(|r| p.rows.start + r).collect(), key));
    }

    /// Remaps raw ids in place without counting them.
    fn remap(&self, ids: &mut [i64]) {
        if self.parts.len() == 1 {
            self.parts[0].module.remap(ids);
        } else {
            for id in ids {
                *id = self.row_of(*id);
            }
        }
    }

    /// The statistics of the parts run here.
    fn stats(&self) -> McStats {
        let mut s = McStats::default();
        for p in self.parts.iter().filter(|p| p.here) {
            let m = p.module.stats();
            s.lookups += m.lookups;
            s.fallbacks += m.fallbacks;
            s.tracked += m.tracked;
            s.capacity += m.capacity;
            s.last_evictions += m.last_evictions;
            s.last_admissions += m.last_admissions;
            s.evictions = s.evictions.max(m.evictions);
        }
        s
    }
}

/// One part's checkpointable state: its index, the state, and its first row.
pub(crate) struct PartState {
    pub(crate) part: usize,
    pub(crate) state: McState,
    pub(crate) first_row: u64,
}

/// What serving needs to remap one managed-collision table's raw ids as an evaluation does:
/// the tracked ids with their rows (sorted by id), and per part its first raw id, first row,
/// rows and zero-collision slots (an untracked id's fallback row).
pub(crate) struct McServing {
    pub(crate) table: String,
    pub(crate) ids: Vec<i64>,
    pub(crate) rows: Vec<i64>,
    pub(crate) part_start: Vec<i64>,
    pub(crate) first_row: Vec<i64>,
    pub(crate) part_rows: Vec<i64>,
    pub(crate) zch: Vec<i64>,
}

impl McTables {
    /// Every table's [`McServing`]; every part must be held here (a one-rank job).
    pub(crate) fn serving(&self) -> Result<Vec<McServing>, EngineError> {
        let mut out = Vec::new();
        for t in &self.tables {
            if t.parts.iter().any(|p| !p.here) {
                return Err(bad(&t.name, "a serving export needs every partition on one rank"));
            }
            let mut pairs: Vec<(i64, i64)> = Vec::new();
            let mut s = McServing {
                table: t.name.clone(),
                ids: Vec::new(),
                rows: Vec::new(),
                part_start: Vec::new(),
                first_row: Vec::new(),
                part_rows: Vec::new(),
                zch: Vec::new(),
            };
            for (i, p) in t.parts.iter().enumerate() {
                for (slot, id) in p.module.tracked().into_iter().enumerate() {
                    if let Some(id) = id {
                        pairs.push((id, (p.rows.start + slot as u64) as i64));
                    }
                }
                let c = p.module.config();
                s.part_start.push((i as u64 * t.raw_block) as i64);
                s.first_row.push(p.rows.start as i64);
                s.part_rows.push(c.rows as i64);
                s.zch.push(c.zch_size as i64);
            }
            pairs.sort_unstable();
            (s.ids, s.rows) = pairs.into_iter().unzip();
            out.push(s);
        }
        Ok(out)
    }

    /// The recipe's managed-collision tables (settings already validated), split as
    /// `mc.partitions` says or, by default, in the plan's row blocks of a row-wise table.
    pub(crate) fn new(recipe: &Recipe, plan: &Plan) -> Result<Self, EngineError> {
        let mut tables = Vec::new();
        for t in &recipe.tables {
            let Some(mc) = &t.mc else { continue };
            let config = McConfig {
                rows: t.rows,
                zch_size: mc.zch_size.unwrap_or(t.rows),
                input_hash_size: mc.input_hash_size,
                policy: mc.eviction_policy,
                decay_exponent: mc.decay_exponent,
                eviction_interval: mc.eviction_interval,
            };
            let tp = plan.tables.iter().find(|p| p.name == t.name);
            let row_blocks = tp
                .filter(|p| matches!(p.sharding_type, ShardingType::RowWise | ShardingType::TableRowWise))
                .and_then(|p| blocks_of(p, t.dim))
                .map_or(1, |s| s.shards.len() as u64);
            let keys = t.features.iter().map(|f| FeatureRef::parse(f).input.to_string()).collect();
            let mut table =
                McTable { name: t.name.clone(), keys, config, parts: Vec::new(), raw_block: 1, owner: false };
            match mc.partitions {
                Some(n) => table.split(n)?,
                // The plan's blocks by default, when each can hold a module; else one module.
                None => {
                    if table.split(row_blocks).is_err() {
                        tracing::warn!(table = %t.name, row_blocks, "managed collisions: the row-wise blocks are too small for a module each; one module runs replicated on every rank");
                        table.split(1)?;
                    }
                }
            }
            tables.push(table);
        }
        Ok(Self {
            tables,
            seed: recipe.run.seed,
            dynamic: crate::dynamic_tables::DynamicTables::new(recipe)?,
            reported: None,
        })
    }

    /// Chooses each table's way to run (see the module docs) for the job's sparse part and
    /// plan, and routes the owner-remapped tables' ids by raw id. Called after building the
    /// job and after restoring a checkpoint's partitions.
    pub(crate) fn attach(&mut self, sparse: &mut SparseArch, recipe: &Recipe, plan: &Plan) -> Result<(), EngineError> {
        let Some(s) = sparse.sharded_mut() else {
            for t in &mut self.tables {
                t.owner = false;
                t.parts.iter_mut().for_each(|p| p.here = true);
            }
            return self.dynamic.attach(None, plan);
        };
        let me = s.group().rank();
        for t in &mut self.tables {
            let dim = recipe.tables.iter().find(|r| r.name == t.name).map_or(0, |r| r.dim);
            let sharding = plan.tables.iter().find(|p| p.name == t.name).and_then(|p| blocks_of(p, dim));
            let aligned = sharding.as_ref().filter(|s| {
                s.shards.len() == t.parts.len() && s.shards.iter().zip(&t.parts).all(|(sh, p)| sh.rows == p.rows)
            });
            t.owner = aligned.is_some();
            for (pi, p) in t.parts.iter_mut().enumerate() {
                p.here = aligned.is_none_or(|s| s.shards[pi].rank == me);
            }
            s.route_raw_ids(&t.name, t.owner.then_some(t.raw_block))?;
            tracing::debug!(table = %t.name, partitions = t.parts.len(), owner_remap = t.owner, "managed collisions");
        }
        self.dynamic.attach(Some(s), plan)
    }

    /// Whether the job has none.
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty() && self.dynamic.is_empty()
    }

    /// Whether some table is remapped on its owning ranks (after the input dist).
    pub(crate) fn has_owner_remap(&self) -> bool {
        self.tables.iter().any(|t| t.owner) || self.dynamic.has_owner()
    }

    /// The positions in `kjt` of each table's features, after checking their raw ids.
    fn resolve(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<Vec<usize>>, EngineError> {
        self.tables
            .iter()
            .map(|t| {
                t.keys
                    .iter()
                    .map(|k| {
                        let i =
                            kjt.key_index(k).ok_or_else(|| bad(&t.name, format!("the batch has no feature '{k}'")))?;
                        t.parts[0].module.check_ids(kjt.feature(i).values).map_err(|id| {
                            EngineError::Embedding(trainrec_embedding::EmbeddingError::RawIdOutOfRange {
                                table: t.name.clone(),
                                feature: k.clone(),
                                id,
                                input_hash_size: t.config.input_hash_size,
                            })
                        })?;
                        Ok(i)
                    })
                    .collect()
            })
            .collect()
    }

    /// A training batch (not variable-batch): checks the raw ids of every table, then counts
    /// and remaps in place the ids of the replicated tables; returns the rows to
    /// re-initialise. Across ranks (`pg`) every rank counts the ids of the global batch, so
    /// the modules stay the same on every rank, and remaps its own. The owner-remapped
    /// tables' ids stay raw for [`Self::train_owned`].
    pub(crate) fn train(
        &mut self,
        kjt: &mut KeyedJaggedTensor,
        pg: Option<&dyn ProcessGroup>,
    ) -> Result<Resets, EngineError> {
        let at = self.resolve(kjt)?;
        let mut out = Vec::new();
        let mut per_key = kjt.values_per_key_mut();
        for (ti, (t, keys)) in self.tables.iter_mut().zip(&at).enumerate() {
            if t.owner {
                continue;
            }
            match pg {
                Some(pg) => {
                    let mut global: Vec<Vec<i64>> =
                        keys.iter().map(|&i| pg.all_gather_sized(per_key[i])).collect::<Result<_, _>>()?;
                    let mut all: Vec<&mut [i64]> = global.iter_mut().map(Vec::as_mut_slice).collect();
                    t.train(self.seed, ti, &mut all, &mut out);
                    for &i in keys {
                        t.remap(per_key[i]);
                    }
                }
                None => {
                    // Each feature of a managed-collision table is its own (checked in the recipe).
                    let mut mine: Vec<&mut [i64]> = Vec::with_capacity(keys.len());
                    for (i, slice) in per_key.iter_mut().enumerate() {
                        if keys.contains(&i) {
                            mine.push(std::mem::take(slice));
                        }
                    }
                    t.train(self.seed, ti, &mut mine, &mut out);
                }
            }
        }
        drop(per_key);
        out.extend(self.dynamic.train(kjt, pg)?);
        Ok(out)
    }

    /// The input dist of training batch `kjt` (raw ids checked and the replicated tables
    /// remapped by [`Self::train`]) when some table is remapped on its owning ranks, with that
    /// remap done: each rank's modules count and remap the raw ids the input dist brought
    /// them, and the rows of slots that changed hands start afresh. `None` without such
    /// tables. Collective.
    pub(crate) fn stage_train(
        &mut self,
        sparse: &mut SparseArch,
        kjt: &KeyedJaggedTensor,
    ) -> Result<Option<BatchContext>, EngineError> {
        let Some(s) = sparse.sharded_mut() else { return Ok(None) };
        if !self.has_owner_remap() {
            return Ok(None);
        }
        let mut staged = s.input_dist(kjt)?;
        let mut resets = self.train_owned(s, &mut staged);
        resets.extend(self.dynamic.train_owned(s, &mut staged)?);
        for (table, rows, key) in resets {
            s.reset_rows(&table, &rows, key)?;
        }
        Ok(Some(BatchContext::with_state(staged)))
    }

    /// [`Self::stage_train`] for an evaluation batch (after [`Self::eval`]): remapped without
    /// counting. Collective.
    pub(crate) fn stage_eval(
        &self,
        sparse: &SparseArch,
        kjt: &KeyedJaggedTensor,
    ) -> Result<Option<BatchContext>, EngineError> {
        let Some(s) = sparse.sharded() else { return Ok(None) };
        if !self.has_owner_remap() {
            return Ok(None);
        }
        let mut staged = s.input_dist(kjt)?;
        self.eval_owned(s, &mut staged);
        self.dynamic.eval_owned(s, &mut staged)?;
        Ok(Some(BatchContext::with_state(staged)))
    }

    /// The owner-rank remap of a training batch after its input dist (`staged`): each part
    /// held here counts and remaps the raw ids routed to it into its shard's rows; returns
    /// the rows to re-initialise (this rank's).
    fn train_owned(&mut self, s: &ShardedEbc, staged: &mut InputDist) -> Resets {
        let mut routed: BTreeMap<(String, usize), Vec<&mut [i64]>> = BTreeMap::new();
        for (table, shard, ids) in s.raw_ids_mut(staged) {
            routed.entry((table, shard)).or_default().push(ids);
        }
        let mut out = Vec::new();
        for (ti, t) in self.tables.iter_mut().enumerate().filter(|(_, t)| t.owner) {
            for pi in 0..t.parts.len() {
                if !t.parts[pi].here {
                    continue;
                }
                let mut ids = routed.remove(&(t.name.clone(), pi)).unwrap_or_default();
                let rows = t.parts[pi].module.train_step(&mut ids);
                t.push_resets(self.seed, ti, pi, rows, &mut out);
            }
        }
        out
    }

    /// An evaluation batch: remaps the replicated tables' raw ids in place (no counting).
    pub(crate) fn eval(&self, kjt: &mut KeyedJaggedTensor) -> Result<(), EngineError> {
        let at = self.resolve(kjt)?;
        let mut per_key = kjt.values_per_key_mut();
        for (t, keys) in self.tables.iter().zip(&at).filter(|(t, _)| !t.owner) {
            for &i in keys {
                t.remap(per_key[i]);
            }
        }
        drop(per_key);
        self.dynamic.eval(kjt)
    }

    /// The owner-rank remap of an evaluation batch after its input dist (no counting).
    fn eval_owned(&self, s: &ShardedEbc, staged: &mut InputDist) {
        for (table, shard, ids) in s.raw_ids_mut(staged) {
            if let Some(t) = self.tables.iter().find(|t| t.owner && t.name == table) {
                t.parts[shard].module.remap(ids);
            }
        }
    }

    /// Per table: its name, partitions, and the states of the parts this rank saves (under
    /// the owner-rank remap the parts held here; else every part on the `lead` rank).
    pub(crate) fn states(&self, lead: bool) -> Vec<(String, usize, Vec<PartState>)> {
        self.tables
            .iter()
            .map(|t| {
                let parts = t
                    .parts
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| if t.owner { p.here } else { lead })
                    .map(|(part, p)| PartState { part, state: p.module.state(), first_row: p.rows.start })
                    .collect();
                (t.name.clone(), t.parts.len(), parts)
            })
            .collect()
    }

    /// Splits table `name` into `n` partitions (empty modules) unless it has that many.
    pub(crate) fn set_partitions(&mut self, name: &str, n: usize) -> Result<(), EngineError> {
        let t = self.table_mut(name)?;
        if t.parts.len() != n {
            t.split(n as u64)?;
        }
        Ok(())
    }

    /// Restores part `part` of table `name`.
    pub(crate) fn set_state(&mut self, name: &str, part: usize, state: &McState) -> Result<(), EngineError> {
        let t = self.table_mut(name)?;
        let n = t.parts.len();
        let p = t.parts.get_mut(part).ok_or_else(|| bad(name, format!("no partition {part} of {n}")))?;
        p.module.set_state(state).map_err(|m| bad(name, format!("checkpointed state of partition {part}: {m}")))
    }

    fn table_mut(&mut self, name: &str) -> Result<&mut McTable, EngineError> {
        self.tables
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| bad(name, "the job has no managed-collision table of this name"))
    }

    /// The names of the tables.
    pub(crate) fn names(&self) -> Vec<String> {
        self.tables.iter().map(|t| t.name.clone()).collect()
    }

    /// The `mc/*` and `dynamic/*` metric values of the steps trained so far (see
    /// [`Self::metric_values`]): as they were before the batch staged ahead was counted, if
    /// one was. Collective when some table is remapped on its owners.
    pub(crate) fn report(&self, pg: Option<&dyn ProcessGroup>) -> Result<BTreeMap<String, f64>, EngineError> {
        if let Some(v) = &self.reported {
            return Ok(v.clone());
        }
        let mut out = self.metric_values(pg)?;
        out.extend(self.dynamic.metric_values(pg)?);
        Ok(out)
    }

    /// Each table's statistics over the parts this rank runs.
    pub(crate) fn stats(&self) -> BTreeMap<String, McStats> {
        self.tables.iter().map(|t| (t.name.clone(), t.stats())).collect()
    }

    /// The statistics as metric values: `mc/<table>/collision_rate` (fraction of the ids so far
    /// that went to the fallback), `tracked_fraction` and `evictions` (at the last eviction),
    /// over every rank's parts. Collective when some table is remapped on its owners.
    pub(crate) fn metric_values(&self, pg: Option<&dyn ProcessGroup>) -> Result<BTreeMap<String, f64>, EngineError> {
        let mut stats = self.stats();
        if let (Some(pg), true) = (pg, self.tables.iter().any(|t| t.owner)) {
            let owned: Vec<&McTable> = self.tables.iter().filter(|t| t.owner).collect();
            let mut counts: Vec<u64> = owned
                .iter()
                .flat_map(|t| {
                    let s = stats[&t.name];
                    [s.lookups, s.fallbacks, s.tracked, s.capacity, s.last_evictions]
                })
                .collect();
            crate::data_parallel::sum_counts(pg, &mut counts)?;
            for (t, c) in owned.iter().zip(counts.chunks(5)) {
                let s = stats.get_mut(&t.name).expect("every table has statistics");
                (s.lookups, s.fallbacks, s.tracked, s.capacity, s.last_evictions) = (c[0], c[1], c[2], c[3], c[4]);
            }
        }
        let mut out = BTreeMap::new();
        for (name, s) in stats {
            out.insert(format!("mc/{name}/collision_rate"), s.collision_rate());
            out.insert(format!("mc/{name}/tracked_fraction"), s.tracked_fraction());
            out.insert(format!("mc/{name}/evictions"), s.last_evictions as f64);
        }
        Ok(out)
    }
}
