//! A sharded embedding bag collection: TorchRec's `ShardedEmbeddingBagCollection`.
//!
//! Each table is cut into shards, blocks of rows x columns, each held by one rank; together
//! they tile the table. The sharding types are shapes of that tiling: table-wise (one shard),
//! column-wise and table-column-wise (column blocks), row-wise and table-row-wise (row blocks),
//! grid (column blocks cut into row blocks); data-parallel tables are whole on every rank.
//!
//! A step on rank `r` with a local batch of `B_r` examples:
//!
//! 1. **Input dist.** Every id goes to the rank holding its row (row-sharded tables bucketize
//!    ids by row range and shift them to the shard's first row). Splits first: one all-to-all
//!    of batch size, id count and each output's bag count per destination, then one
//!    all-to-all each of bag lengths, ids and weights, for all tables at once. A rank then holds, for each of its shards, the bags
//!    of the whole global batch (sources in rank order).
//! 2. **Lookup.** One local collection over the rank's shards pools (sum) every bag.
//! 3. **Output dist.** Row-wise tables (one full-width block on every rank of the world) hold
//!    partial sums of the global batch: one reduce-scatter sums them and gives each source its
//!    examples, as TorchRec's row-wise output dist. Every other shard's rows go back through
//!    one all-to-all and the source adds them into their columns of its `[B_r, width]` output
//!    (column blocks land side by side). The row blocks of table-row-wise and grid tables on
//!    one host are partial sums: they go in two stages, as TorchRec's table-row-wise output
//!    dist, first to the host's rank of each source's local rank, which adds them up, then to
//!    the source, so one block per source crosses between hosts. Mean pooling is computed as the sum divided by the bag's id
//!    count afterwards, as TorchRec does under row-wise sharding.
//! 4. **Backward.** The reverse collectives (an all-gather of the row-wise outputs' gradients,
//!    an all-to-all of the others) bring each shard the output gradient of every global
//!    example it pooled; the local collection's fused optimizer updates its rows once
//!    per unique row with the gradient summed over the global batch, exactly as the unsharded
//!    collection would on the global batch. Data-parallel tables all-gather ids and gradients
//!    and apply the same global update on every replica.
//!
//! Every shard starts from the weights its cells have in the unsharded collection built with
//! the same seed ([`trainrec_embedding::initial_weights`]), so a job's start does not depend on
//! how its tables are sharded.
//!
//! Optimizer state is per shard: under column-wise sharding a row-wise optimizer (row-wise
//! Adagrad) keeps one state per row per column block, as FBGEMM does with one table per shard;
//! element-wise optimizers are unaffected.

use std::sync::Arc;

use trainrec_comm::{DistError, ProcessGroup};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig, SparseOptimizerConfig, TableEngine};
use trainrec_planner::ShardingType;

use crate::layout::{Layout, Output, Partial, Route, initial_replica_weights, initial_shard_weights, two_stage};
use crate::module;
use crate::state::{LocalShard, parts};
use crate::tiling::{TableSharding, check_shardings};

/// An embedding bag collection sharded over a process group (see the module docs).
pub struct ShardedEbc {
    pub(crate) pg: Arc<dyn ProcessGroup>,
    pub(crate) tables: Vec<EmbeddingBagConfig>,
    pub(crate) shardings: Vec<TableSharding>,
    pub(crate) outputs: Vec<Output>,
    pub(crate) width: usize,
    /// `routes[d]`: what rank `d` looks up, in its local collection's output order.
    pub(crate) routes: Vec<Vec<Route>>,
    /// Local output columns of each rank's routes (prefix sums of shard widths).
    pub(crate) route_cols: Vec<Vec<usize>>,
    /// Width of each rank's local output.
    pub(crate) local_width: Vec<usize>,
    /// Per rank: its routes that go through the all-to-all (not the reduce-scatter).
    pub(crate) a2a: Vec<Vec<usize>>,
    /// This rank's routes of row-wise tables (one block per rank of the world), whose partial
    /// sums are combined by one reduce-scatter; the same tables and outputs in the same order
    /// on every rank.
    pub(crate) rs: Vec<usize>,
    /// Floats per example of the reduce-scatter.
    pub(crate) rs_width: usize,
    /// This rank's shards (one local table each), in the engine computing them.
    pub(crate) local: Option<Box<dyn TableEngine>>,
    /// Local table name of each (table, shard) held here.
    pub(crate) local_names: Vec<Vec<Option<String>>>,
    /// The data-parallel tables' replicas, in the engine computing them.
    pub(crate) dp: Option<Box<dyn TableEngine>>,
    pub(crate) dp_outputs: Vec<usize>,
    pub(crate) optimizer: SparseOptimizerConfig,
    /// Ranks per host.
    pub(crate) local_world: usize,
    /// The row-block partial sums summed on their host first (two-stage output dist).
    pub(crate) partials: Vec<Partial>,
    /// `held[d]`: the partials rank `d` holds shards of, with its routes of each.
    pub(crate) held: Vec<Vec<(usize, Vec<usize>)>>,
    /// Per table: how its ids are routed by raw id for the shards to remap them, when they
    /// are ([`Self::route_raw_ids`], [`Self::route_hashed_ids`]).
    pub(crate) raw_blocks: Vec<Option<crate::layout::RawRoute>>,
}

impl ShardedEbc {
    /// Builds this rank's part of the collection: its shards of every table and the replicas
    /// of data-parallel tables, with the initial weights of the unsharded collection built
    /// with `seed`. Every rank must pass the same tables and shardings. All ranks are taken
    /// to be on one host (see [`Self::new_on_hosts`]).
    pub fn new(
        tables: Vec<EmbeddingBagConfig>,
        shardings: Vec<TableSharding>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
        pg: Arc<dyn ProcessGroup>,
    ) -> Result<Self, DistError> {
        let world = pg.world_size();
        Self::new_on_hosts(tables, shardings, optimizer, seed, pg, world)
    }

    /// [`Self::new`] on hosts of `local_world_size` ranks each (rank `r` on host
    /// `r / local_world_size`): the row blocks of table-row-wise and grid tables held on one
    /// host are summed on that host before they cross to another (the two-stage output dist).
    pub fn new_on_hosts(
        tables: Vec<EmbeddingBagConfig>,
        shardings: Vec<TableSharding>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
        pg: Arc<dyn ProcessGroup>,
        local_world_size: usize,
    ) -> Result<Self, DistError> {
        let (world, me) = (pg.world_size(), pg.rank());
        if local_world_size == 0 || world % local_world_size != 0 {
            return Err(DistError::Module(format!(
                "{local_world_size} ranks per host do not divide the world of {world} ranks"
            )));
        }
        check_shardings(&tables, &shardings, world)?;
        let n_tables = tables.len();
        let layout = Layout::new(&tables, &shardings, world, me);
        let expected = layout.expected_local_keys(&tables, me);
        let Layout { outputs, width: col, routes, local_tables, local_names, init, dp_tables, dp_outputs } = layout;
        let width_of = |r: &Route| shardings[r.table].shards[r.shard].cols.len();
        let route_cols: Vec<Vec<usize>> = routes
            .iter()
            .map(|rs| {
                let mut at = 0;
                rs.iter()
                    .map(|r| {
                        let c = at;
                        at += width_of(r);
                        c
                    })
                    .collect()
            })
            .collect();
        let local_width: Vec<usize> = routes.iter().map(|rs| rs.iter().map(width_of).sum()).collect();
        // Row-wise over the whole world, one full-width block per rank: its partial sums are
        // reduce-scattered (TorchRec's row-wise output dist); everything else is all-to-all.
        let by_reduce_scatter: Vec<bool> = shardings
            .iter()
            .zip(&tables)
            .map(|(s, t)| {
                let mut ranks: Vec<usize> = s.shards.iter().map(|sh| sh.rank).collect();
                ranks.sort_unstable();
                s.sharding_type == ShardingType::RowWise
                    && ranks == (0..world).collect::<Vec<_>>()
                    && s.shards.iter().all(|sh| sh.cols.start == 0 && sh.cols.end == t.dim)
            })
            .collect();
        let partials = two_stage(&tables, &shardings, &outputs, local_world_size, &by_reduce_scatter);
        // held[d]: the partial sums rank d holds shards of, each with its routes there.
        let held: Vec<Vec<(usize, Vec<usize>)>> = routes
            .iter()
            .map(|rs| {
                let mut h: Vec<(usize, Vec<usize>)> = Vec::new();
                for (pi, p) in partials.iter().enumerate() {
                    let js: Vec<usize> = (0..rs.len()).filter(|&j| p.covers(&rs[j], &shardings)).collect();
                    if !js.is_empty() {
                        h.push((pi, js));
                    }
                }
                h
            })
            .collect();
        let in_partial = |r: &Route| partials.iter().any(|p| p.covers(r, &shardings));
        let a2a: Vec<Vec<usize>> = routes
            .iter()
            .map(|rs| (0..rs.len()).filter(|&j| !by_reduce_scatter[rs[j].table] && !in_partial(&rs[j])).collect())
            .collect();
        let rs: Vec<usize> = (0..routes[me].len()).filter(|&j| by_reduce_scatter[routes[me][j].table]).collect();
        let rs_width = rs.iter().map(|&j| width_of(&routes[me][j])).sum();

        let local = if local_tables.is_empty() {
            None
        } else {
            // Each shard starts from its block of the unsharded table's initial weights: a
            // cached shard's store computes them (a key-value store then holds no row yet), the
            // others are written.
            let mut local_tables = local_tables;
            for (name, ti, si) in &init {
                if let Some(c) = local_tables.iter_mut().find(|c| &c.name == name) {
                    let (t, sh) = (&tables[*ti], &shardings[*ti].shards[*si]);
                    c.init_block = Some(trainrec_embedding::InitBlock {
                        seed,
                        table: *ti,
                        table_rows: t.rows,
                        table_dim: t.dim,
                        first_row: sh.rows.start,
                        cols: sh.cols.clone(),
                    });
                }
            }
            let written: Vec<(String, usize, usize)> = init
                .iter()
                .filter(|(name, ..)| local_tables.iter().any(|c| &c.name == name && c.cache.is_none()))
                .cloned()
                .collect();
            let mut ebc = EmbeddingBagCollection::new(local_tables, optimizer.clone(), seed).map_err(module)?;
            for (name, w) in initial_shard_weights(&tables, &shardings, &written, seed) {
                ebc.set_table_weights(&name, w).map_err(module)?;
            }
            Some(Box::new(ebc) as Box<dyn TableEngine>)
        };
        if let Some(l) = &local {
            if l.output_keys() != expected {
                return Err(DistError::Module(format!(
                    "internal: local outputs {:?} differ from routes {expected:?}",
                    l.output_keys()
                )));
            }
        }

        let dp = if dp_tables.is_empty() {
            None
        } else {
            let mut ebc = EmbeddingBagCollection::new(dp_tables, optimizer.clone(), seed).map_err(module)?;
            for (name, w) in initial_replica_weights(&tables, &shardings, seed) {
                ebc.set_table_weights(&name, w).map_err(module)?;
            }
            Some(Box::new(ebc) as Box<dyn TableEngine>)
        };
        Ok(Self {
            pg,
            tables,
            shardings,
            outputs,
            width: col,
            routes,
            route_cols,
            local_width,
            a2a,
            rs,
            rs_width,
            local,
            local_names,
            dp,
            dp_outputs,
            optimizer,
            local_world: local_world_size,
            partials,
            held,
            raw_blocks: vec![None; n_tables],
        })
    }

    /// Floats per example of the output (the unsharded collection's width).
    pub fn width(&self) -> usize {
        self.width
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// The engine of this rank's shards (with their caches), when it holds any.
    pub fn local(&self) -> Option<&dyn TableEngine> {
        self.local.as_deref()
    }

    /// The engine of this rank's data-parallel replicas, when there are any.
    pub fn replicas(&self) -> Option<&dyn TableEngine> {
        self.dp.as_deref()
    }

    /// Moves this rank's shards and replicas into engines `make` builds from their CPU
    /// collections (e.g. trainrec's CUDA collection: the same tables, initial values and
    /// optimizer state on a GPU); the sharding and its collectives stay as they are. Not
    /// collective. Fails if an engine was moved before, or if `make` builds one with other
    /// outputs.
    pub fn move_shards(
        &mut self,
        mut make: impl FnMut(&EmbeddingBagCollection) -> Result<Box<dyn TableEngine>, DistError>,
    ) -> Result<(), DistError> {
        for engine in [&mut self.local, &mut self.dp].into_iter().flatten() {
            let cpu = engine
                .as_cpu()
                .ok_or_else(|| DistError::Module("move_shards: the shards are already in another engine".into()))?;
            let moved = make(cpu)?;
            if moved.output_keys() != cpu.output_keys() || moved.width() != cpu.width() {
                return Err(DistError::Module(format!(
                    "move_shards: the new engine's outputs {:?} (width {}) differ from the shards' {:?} (width {})",
                    moved.output_keys(),
                    moved.width(),
                    cpu.output_keys(),
                    cpu.width()
                )));
            }
            *engine = moved;
        }
        Ok(())
    }

    /// The whole table `name` as fp32 `[rows, dim]`, assembled from every rank's shards.
    /// Collective (every rank gets it).
    pub fn table_weights(&self, name: &str) -> Result<Vec<f32>, DistError> {
        parts!(self).table_weights(self.pg.as_ref(), self.local.as_ref(), self.dp.as_ref(), name)
    }

    /// Replaces table `name` from its whole `[rows, dim]` fp32 weights: each rank keeps its
    /// shards' blocks (e.g. to start from an unsharded collection's weights). Not collective.
    pub fn set_table_weights(&mut self, name: &str, weights: &[f32]) -> Result<(), DistError> {
        self.load_table(name, weights, None, None)
    }

    /// Replaces table `name`'s weights, and its fused optimizer's state and step count when
    /// given, from the whole table's (the unsharded collection's layout): each rank keeps its
    /// shards' blocks. Under column-wise sharding each column block keeps a copy of a row-wise
    /// optimizer's per-row state. Not collective.
    pub fn load_table(
        &mut self,
        name: &str,
        weights: &[f32],
        optimizer_state: Option<&[f32]>,
        step_count: Option<u64>,
    ) -> Result<(), DistError> {
        parts!(self).load(self.local.as_mut(), self.dp.as_mut(), name, Some(weights), optimizer_state, step_count)
    }

    /// Re-initialises rows `rows` of table `name` (its global row numbers) with `key`, as
    /// [`EmbeddingBagCollection::reset_rows`] does on the unsharded table: each rank resets
    /// its shards' blocks of those rows (replicas reset whole rows). Not collective; every
    /// rank must do it with the same rows.
    pub fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), DistError> {
        let ti = parts!(self).index(name)?;
        let t = &self.tables[ti];
        if self.shardings[ti].sharding_type == ShardingType::DataParallel {
            let dp = self.dp.as_mut().expect("data-parallel tables have replicas");
            return dp.reset_rows(name, rows, key).map_err(module);
        }
        let me = self.pg.rank();
        for (si, sh) in self.shardings[ti].shards.iter().enumerate().filter(|(_, sh)| sh.rank == me) {
            let local: Vec<u64> = rows.iter().filter(|r| sh.rows.contains(r)).map(|r| r - sh.rows.start).collect();
            if local.is_empty() {
                continue;
            }
            let block =
                trainrec_embedding::RowBlock { row_offset: sh.rows.start, cols: sh.cols.clone(), full_dim: t.dim };
            let lname = self.local_names[ti][si].as_deref().expect("a local shard has a local table");
            let l = self.local.as_mut().expect("local shards");
            l.reset_block_rows(lname, &local, key, &block, t.rows).map_err(module)?;
        }
        Ok(())
    }

    /// This rank's shards of every table with their place in the table, weights and optimizer
    /// state (the fused parameters of the state dict). Not collective.
    pub fn local_shards(&self) -> Vec<LocalShard> {
        parts!(self).local_shards(self.local.as_ref(), self.dp.as_ref())
    }

    /// Restores shards [`ShardedEbc::local_shards`] gave (e.g. read back from a checkpoint):
    /// each must be one of this rank's shards, with its place, or a replica of a data-parallel
    /// table. Not collective.
    pub fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), DistError> {
        for shard in shards {
            parts!(self).load_shard(self.local.as_mut(), self.dp.as_mut(), shard)?;
        }
        Ok(())
    }
}
