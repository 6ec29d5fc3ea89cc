//! The state of a sharded collection's tables: each rank's shards with their optimizer state
//! ([`LocalShard`], what checkpoints hold), whole tables gathered from every rank, and
//! blocks of a whole table loaded into the shards that hold them.

use std::ops::Range;

use trainrec_comm::{DistError, ProcessGroup, ProcessGroupExt, offsets};
use trainrec_embedding::{EmbeddingBagConfig, SparseOptimizerConfig, StatePart};
use trainrec_planner::ShardingType;

use crate::local::LocalTables;
use crate::tiling::TableSharding;

/// The whole table `ti` as fp32 `[rows, dim]` from every rank's shards; `local(name)` reads a
/// local shard's block. Collective.
pub(crate) fn gather_table(
    pg: &dyn ProcessGroup,
    table: &EmbeddingBagConfig,
    sharding: &TableSharding,
    local_names: &[Option<String>],
    local: impl Fn(&str) -> Option<Vec<f32>>,
) -> Result<Vec<f32>, DistError> {
    let me = pg.rank();
    let mut mine = Vec::new();
    for (si, _) in sharding.shards.iter().enumerate().filter(|(_, sh)| sh.rank == me) {
        let lname = local_names[si].as_ref().expect("a local shard has a local table");
        mine.extend(local(lname).unwrap_or_default());
    }
    let mut counts = vec![0usize; pg.world_size()];
    for sh in &sharding.shards {
        counts[sh.rank] += (sh.rows.end - sh.rows.start) as usize * sh.cols.len();
    }
    let all = pg.all_gather_v(&mine, &counts)?;
    // Rank-order blocks, each rank's shards in shard order.
    let mut full = vec![0f32; table.rows as usize * table.dim];
    let mut at = offsets(&counts);
    for sh in &sharding.shards {
        let n = sh.cols.len();
        for r in sh.rows.clone() {
            full[r as usize * table.dim + sh.cols.start..][..n].copy_from_slice(&all[at[sh.rank]..at[sh.rank] + n]);
            at[sh.rank] += n;
        }
    }
    Ok(full)
}

/// Each of rank `me`'s shards' blocks of a whole per-row matrix of a table (`parts` per row,
/// e.g. its `[rows, dim]` weights as one per-column part, or its optimizer state), by local
/// table name: each per-column part's columns of the shard and a copy of each per-row part.
pub(crate) fn shard_blocks(
    table: &EmbeddingBagConfig,
    sharding: &TableSharding,
    local_names: &[Option<String>],
    me: usize,
    parts: &[StatePart],
    data: &[f32],
) -> Result<Vec<(String, Vec<f32>)>, DistError> {
    let (rows, dim) = (table.rows as usize, table.dim);
    let width: usize = parts.iter().map(|p| p.len(dim)).sum();
    if data.len() != rows * width {
        return Err(DistError::Module(format!(
            "table '{}': {} floats for {rows} rows x {width}",
            table.name,
            data.len()
        )));
    }
    Ok(sharding
        .shards
        .iter()
        .enumerate()
        .filter(|(_, sh)| sh.rank == me)
        .map(|(si, sh)| {
            let mut block = Vec::new();
            for r in sh.rows.clone() {
                let mut at = r as usize * width;
                for p in parts {
                    match p {
                        StatePart::PerColumn => block.extend_from_slice(&data[at + sh.cols.start..at + sh.cols.end]),
                        StatePart::PerRow => block.push(data[at]),
                    }
                    at += p.len(dim);
                }
            }
            (local_names[si].clone().expect("a local shard has a local table"), block)
        })
        .collect())
}

pub use trainrec_embedding::LocalShard;

/// The tables of a sharded collection on one rank (either kind of collection): their configs,
/// shardings and local table names.
pub(crate) struct Parts<'a> {
    pub(crate) tables: &'a [EmbeddingBagConfig],
    pub(crate) shardings: &'a [TableSharding],
    pub(crate) local_names: &'a [Vec<Option<String>>],
    pub(crate) me: usize,
    pub(crate) optimizer: &'a SparseOptimizerConfig,
}

/// The [`Parts`] of a sharded collection `$c` (its `tables`, `shardings`, `local_names`,
/// `optimizer` and group), borrowed field by field so that its local collections can be
/// changed meanwhile.
macro_rules! parts {
    ($c:expr) => {
        $crate::state::Parts {
            tables: &$c.tables,
            shardings: &$c.shardings,
            local_names: &$c.local_names,
            me: $c.pg.rank(),
            optimizer: &$c.optimizer,
        }
    };
}

pub(crate) use parts;

impl Parts<'_> {
    pub(crate) fn index(&self, name: &str) -> Result<usize, DistError> {
        self.tables.iter().position(|t| t.name == name).ok_or_else(|| DistError::Module(format!("no table '{name}'")))
    }

    fn optimizer_of(&self, ti: usize) -> &SparseOptimizerConfig {
        self.tables[ti].optimizer.as_ref().unwrap_or(self.optimizer)
    }

    /// The whole table `name` as fp32 `[rows, dim]`: a replica's own copy, or every rank's
    /// shards assembled (collective).
    pub(crate) fn table_weights<L: LocalTables>(
        &self,
        pg: &dyn ProcessGroup,
        local: Option<&L>,
        dp: Option<&L>,
        name: &str,
    ) -> Result<Vec<f32>, DistError> {
        let ti = self.index(name)?;
        if self.shardings[ti].sharding_type == ShardingType::DataParallel {
            let dp = dp.expect("data-parallel tables have replicas");
            return dp.weights(name).ok_or_else(|| DistError::Module(format!("no table '{name}'")));
        }
        let weights = |lname: &str| local.and_then(|l| l.weights(lname));
        gather_table(pg, &self.tables[ti], &self.shardings[ti], &self.local_names[ti], weights)
    }

    /// This rank's shards and replicas.
    pub(crate) fn local_shards<L: LocalTables>(&self, local: Option<&L>, dp: Option<&L>) -> Vec<LocalShard> {
        let mut out = Vec::new();
        for (ti, (t, s)) in self.tables.iter().zip(self.shardings).enumerate() {
            let shape = [t.rows as usize, t.dim];
            let entry = |c: &L, name: &str, rows: Range<u64>, cols: Range<usize>, replicated: bool| {
                // A key-value shard: only its written rows (as table rows).
                let sparse = c.sparse(name).and_then(|local| {
                    let (w, s) = c.rows(name, &local).ok()?;
                    Some((w, s, local.into_iter().map(|r| r + rows.start).collect::<Vec<u64>>()))
                });
                let (weights, optimizer_state, stored) = match sparse {
                    Some((w, s, stored)) => (w, s, Some(stored)),
                    None => (c.weights(name).unwrap_or_default(), c.state(name).unwrap_or_default(), None),
                };
                LocalShard {
                    table: t.name.clone(),
                    table_shape: shape,
                    rows,
                    cols,
                    replicated,
                    weights,
                    optimizer_state,
                    stored,
                    step_count: c.steps(name).unwrap_or(0),
                }
            };
            if s.sharding_type == ShardingType::DataParallel {
                if let Some(dp) = dp {
                    out.push(entry(dp, &t.name, 0..t.rows, 0..t.dim, true));
                }
                continue;
            }
            for (si, sh) in s.shards.iter().enumerate().filter(|(_, sh)| sh.rank == self.me) {
                let lname = self.local_names[ti][si].as_deref().expect("a local shard has a local table");
                if let Some(l) = local {
                    out.push(entry(l, lname, sh.rows.clone(), sh.cols.clone(), false));
                }
            }
        }
        out
    }

    /// Sets this rank's shard `shard.rows` x `shard.cols` of table `shard.table` (a replica:
    /// the whole table) from `shard`'s weights, optimizer state and step count, in the layout
    /// [`Parts::local_shards`] gives them. Not collective.
    pub(crate) fn load_shard<L: LocalTables>(
        &self,
        local: Option<&mut L>,
        dp: Option<&mut L>,
        shard: LocalShard,
    ) -> Result<(), DistError> {
        let ti = self.index(&shard.table)?;
        let t = &self.tables[ti];
        let s = &self.shardings[ti];
        let width = self.optimizer_of(ti).state_per_row(shard.cols.len());
        let n_rows = shard.stored.as_ref().map_or((shard.rows.end - shard.rows.start) as usize, Vec::len);
        if shard.weights.len() != n_rows * shard.cols.len() || shard.optimizer_state.len() != n_rows * width {
            return Err(DistError::Module(format!(
                "table '{}' shard rows {:?} cols {:?}: {} weights and {} optimizer floats, expected {} and {}",
                t.name,
                shard.rows,
                shard.cols,
                shard.weights.len(),
                shard.optimizer_state.len(),
                n_rows * shard.cols.len(),
                n_rows * width
            )));
        }
        let (target, lname): (Option<&mut L>, &str) = if s.sharding_type == ShardingType::DataParallel {
            if shard.rows != (0..t.rows) || shard.cols != (0..t.dim) {
                return Err(DistError::Module(format!("table '{}' is replicated: a shard must cover it", t.name)));
            }
            (dp, t.name.as_str())
        } else {
            let Some(si) =
                s.shards.iter().position(|sh| sh.rank == self.me && sh.rows == shard.rows && sh.cols == shard.cols)
            else {
                return Err(DistError::Module(format!(
                    "table '{}': this rank has no shard rows {:?} cols {:?}",
                    t.name, shard.rows, shard.cols
                )));
            };
            (local, self.local_names[ti][si].as_deref().expect("a local shard has a local table"))
        };
        let target = target.ok_or_else(|| DistError::Module(format!("table '{}': no local collection", t.name)))?;
        match &shard.stored {
            Some(rows) => {
                if let Some(r) = rows.iter().find(|r| !shard.rows.contains(r)) {
                    return Err(DistError::Module(format!(
                        "table '{}': a block of rows {:?} lists row {r}",
                        t.name, shard.rows
                    )));
                }
                let local: Vec<u64> = rows.iter().map(|r| r - shard.rows.start).collect();
                target.load_rows(lname, &local, &shard.weights, &shard.optimizer_state)?;
            }
            None => {
                target.set_weights(lname, shard.weights)?;
                if width > 0 {
                    target.set_state(lname, shard.optimizer_state)?;
                }
            }
        }
        target.set_steps(lname, shard.step_count)
    }

    /// Sets table `name`'s weights, optimizer state (either may be absent) and step count
    /// from the whole table's (the unsharded collection's layout). Not collective.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load<L: LocalTables>(
        &self,
        local: Option<&mut L>,
        dp: Option<&mut L>,
        name: &str,
        weights: Option<&[f32]>,
        state: Option<&[f32]>,
        steps: Option<u64>,
    ) -> Result<(), DistError> {
        let ti = self.index(name)?;
        let t = &self.tables[ti];
        let layout = self.optimizer_of(ti).state_layout();
        if self.shardings[ti].sharding_type == ShardingType::DataParallel {
            let dp = dp.expect("data-parallel tables have replicas");
            if let Some(w) = weights {
                dp.set_weights(name, w.to_vec())?;
            }
            if let Some(st) = state {
                dp.set_state(name, st.to_vec())?;
            }
            if let Some(n) = steps {
                dp.set_steps(name, n)?;
            }
            return Ok(());
        }
        let (s, names) = (&self.shardings[ti], &self.local_names[ti][..]);
        let w_blocks = weights.map(|w| shard_blocks(t, s, names, self.me, &[StatePart::PerColumn], w)).transpose()?;
        let s_blocks = state.map(|st| shard_blocks(t, s, names, self.me, layout, st)).transpose()?;
        let Some(local) = local else { return Ok(()) };
        for (lname, block) in w_blocks.into_iter().flatten() {
            local.set_weights(&lname, block)?;
        }
        for (lname, block) in s_blocks.into_iter().flatten() {
            local.set_state(&lname, block)?;
        }
        if let Some(n) = steps {
            for lname in names.iter().flatten() {
                local.set_steps(lname, n)?;
            }
        }
        Ok(())
    }
}
