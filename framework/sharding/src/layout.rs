//! One rank's layout of a sharded collection, computed once when it is built: the pooled
//! outputs, which rank looks up which output's ids (routes), its local tables and their
//! initial weights, and the row-block partial sums added on their host first (two-stage
//! output dist).

use std::ops::Range;

use trainrec_comm::DistError;
use trainrec_embedding::{EmbeddingBagConfig, PoolingMode, initial_weights};
use trainrec_planner::ShardingType;
use trainrec_sparse::KeyedJaggedTensor;

use crate::tiling::TableSharding;

/// One pooled output of the collection (one per feature of each table, table order then
/// feature order, as the unsharded collection).
#[derive(Clone, Debug)]
pub(crate) struct Output {
    pub(crate) table: usize,
    /// The input feature it reads (`x` for an output named `x@table`).
    pub(crate) input: String,
    /// First column in the `[batch, width]` output.
    pub(crate) col: usize,
    pub(crate) mean: bool,
}

/// One output's ids sent to one shard.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Route {
    pub(crate) output: usize,
    pub(crate) table: usize,
    pub(crate) shard: usize,
}

/// What every sharded collection derives from its tables and shardings on one rank.
pub(crate) struct Layout {
    /// One per feature of each table, table order then feature order.
    pub(crate) outputs: Vec<Output>,
    /// Columns of the pooled `[batch, width]` output.
    pub(crate) width: usize,
    /// `routes[d]`: what rank `d` looks up, in its local collection's output order.
    pub(crate) routes: Vec<Vec<Route>>,
    /// This rank's shards, one local table each, its features named `<feature>/shard<i>`.
    pub(crate) local_tables: Vec<EmbeddingBagConfig>,
    /// Local table name of each (table, shard) held here.
    pub(crate) local_names: Vec<Vec<Option<String>>>,
    /// (local table, table, shard) of each local table.
    pub(crate) init: Vec<(String, usize, usize)>,
    /// The data-parallel tables (replicated on every rank).
    pub(crate) dp_tables: Vec<EmbeddingBagConfig>,
    /// The outputs of data-parallel tables.
    pub(crate) dp_outputs: Vec<usize>,
}

impl Layout {
    /// The layout on rank `me` (the shardings already checked).
    pub(crate) fn new(tables: &[EmbeddingBagConfig], shardings: &[TableSharding], world: usize, me: usize) -> Self {
        let mut outputs = Vec::new();
        let mut col = 0;
        for (ti, t) in tables.iter().enumerate() {
            for f in &t.features {
                let input = f.split('@').next().unwrap_or(f).to_string();
                outputs.push(Output { table: ti, input, col, mean: t.pooling == PoolingMode::Mean });
                col += t.dim;
            }
        }
        let mut routes = vec![Vec::new(); world];
        for (ti, s) in shardings.iter().enumerate() {
            if s.sharding_type == ShardingType::DataParallel {
                continue;
            }
            for (si, shard) in s.shards.iter().enumerate() {
                for (oi, _) in outputs.iter().enumerate().filter(|(_, o)| o.table == ti) {
                    routes[shard.rank].push(Route { output: oi, table: ti, shard: si });
                }
            }
        }
        let mut local_tables = Vec::new();
        let mut local_names = vec![Vec::new(); tables.len()];
        let mut init = Vec::new();
        for (ti, (t, s)) in tables.iter().zip(shardings).enumerate() {
            local_names[ti] = vec![None; s.shards.len()];
            if s.sharding_type == ShardingType::DataParallel {
                continue;
            }
            for (si, shard) in s.shards.iter().enumerate().filter(|(_, sh)| sh.rank == me) {
                let name = format!("{}/shard{si}", t.name);
                let mut c = t.clone();
                c.name = name.clone();
                c.rows = shard.rows.end - shard.rows.start;
                c.dim = shard.cols.len();
                // A cached table's shard caches its share of the table's cache rows.
                if let Some(cache) = &mut c.cache {
                    let share = (u128::from(cache.slots) * u128::from(c.rows)).div_ceil(u128::from(t.rows.max(1)));
                    cache.slots = (share as u64).clamp(1, c.rows.max(1));
                }
                c.pooling = PoolingMode::Sum;
                c.features = t.features.iter().map(|f| format!("{f}/shard{si}")).collect();
                local_tables.push(c);
                init.push((name.clone(), ti, si));
                local_names[ti][si] = Some(name);
            }
        }
        let dp_tables = tables
            .iter()
            .zip(shardings)
            .filter(|(_, s)| s.sharding_type == ShardingType::DataParallel)
            .map(|(t, _)| t.clone())
            .collect();
        let dp_outputs = (0..outputs.len())
            .filter(|&o| shardings[outputs[o].table].sharding_type == ShardingType::DataParallel)
            .collect();
        Self { outputs, width: col, routes, local_tables, local_names, init, dp_tables, dp_outputs }
    }

    /// The local collection's output keys the routes of rank `me` expect.
    pub(crate) fn expected_local_keys(&self, tables: &[EmbeddingBagConfig], me: usize) -> Vec<String> {
        self.routes[me]
            .iter()
            .map(|r| {
                format!(
                    "{}/shard{}",
                    tables[r.table].features[r.output - first_output(&self.outputs, r.table)],
                    r.shard
                )
            })
            .collect()
    }
}

/// The unsharded collection's initial weights of each local shard (`init` of a [`Layout`]).
pub(crate) fn initial_shard_weights(
    tables: &[EmbeddingBagConfig],
    shardings: &[TableSharding],
    init: &[(String, usize, usize)],
    seed: u64,
) -> Vec<(String, Vec<f32>)> {
    init.iter()
        .map(|(name, ti, si)| {
            let (t, sh) = (&tables[*ti], &shardings[*ti].shards[*si]);
            (name.clone(), initial_weights(seed, *ti, t.rows, t.dim, sh.rows.clone(), sh.cols.clone()))
        })
        .collect()
}

/// The unsharded collection's initial weights of each data-parallel table.
pub(crate) fn initial_replica_weights(
    tables: &[EmbeddingBagConfig],
    shardings: &[TableSharding],
    seed: u64,
) -> Vec<(String, Vec<f32>)> {
    tables
        .iter()
        .enumerate()
        .filter(|(ti, _)| shardings[*ti].sharding_type == ShardingType::DataParallel)
        .map(|(ti, t)| (t.name.clone(), initial_weights(seed, ti, t.rows, t.dim, 0..t.rows, 0..t.dim)))
        .collect()
}

/// The index in `kjt` of each output's input feature, after checking every id is inside its
/// table (or, for a table routed by raw id, `raw_limit(table)`: inside the raw id space).
pub(crate) fn resolve_inputs(
    kjt: &KeyedJaggedTensor,
    outputs: &[Output],
    tables: &[EmbeddingBagConfig],
    raw_limit: impl Fn(usize) -> Option<u64>,
) -> Result<Vec<usize>, DistError> {
    let keys: Vec<usize> = outputs
        .iter()
        .map(|o| {
            kjt.key_index(&o.input).ok_or_else(|| {
                DistError::Module(format!("the batch has no feature '{}' (table '{}')", o.input, tables[o.table].name))
            })
        })
        .collect::<Result<_, _>>()?;
    for (o, &k) in outputs.iter().zip(&keys) {
        let (limit, what) = match raw_limit(o.table) {
            Some(n) => (n, "raw ids"),
            None => (tables[o.table].rows, "rows"),
        };
        if let Some(&id) = kjt.feature(k).values.iter().find(|&&id| id < 0 || id as u64 >= limit) {
            return Err(DistError::Module(format!(
                "feature '{}': id {id} is outside table '{}' ({limit} {what})",
                o.input, tables[o.table].name
            )));
        }
    }
    Ok(keys)
}

pub(crate) fn first_output(outputs: &[Output], table: usize) -> usize {
    outputs.iter().position(|o| o.table == table).unwrap_or(0)
}

/// One output's columns of a table whose row blocks all sit on one host: the blocks' partial
/// sums are added on that host (by the rank of each source's local rank there) before they go
/// to the source, as TorchRec's table-row-wise output dist (an intra-host reduce-scatter, then
/// a cross-host all-to-all).
#[derive(Clone, Debug)]
pub(crate) struct Partial {
    pub(crate) output: usize,
    pub(crate) table: usize,
    pub(crate) cols: Range<usize>,
    pub(crate) host: usize,
}

impl Partial {
    pub(crate) fn covers(&self, r: &Route, shardings: &[TableSharding]) -> bool {
        r.output == self.output && r.table == self.table && shardings[r.table].shards[r.shard].cols == self.cols
    }
}

/// The partials of table-row-wise and grid tables whose every column block's row blocks are
/// on one host (others, and the tables reduce-scattered over the world, keep the plain
/// all-to-all).
pub(crate) fn two_stage(
    tables: &[EmbeddingBagConfig],
    shardings: &[TableSharding],
    outputs: &[Output],
    local_world: usize,
    by_reduce_scatter: &[bool],
) -> Vec<Partial> {
    let mut out = Vec::new();
    for (ti, (_, s)) in tables.iter().zip(shardings).enumerate() {
        if by_reduce_scatter[ti] || !matches!(s.sharding_type, ShardingType::TableRowWise | ShardingType::Grid) {
            continue;
        }
        let mut blocks: Vec<Range<usize>> = s.shards.iter().map(|sh| sh.cols.clone()).collect();
        blocks.sort_by_key(|c| c.start);
        blocks.dedup();
        let mut parts = Vec::new();
        for cols in blocks {
            let mut hosts = s.shards.iter().filter(|sh| sh.cols == cols).map(|sh| sh.rank / local_world);
            let host = hosts.next().unwrap_or(0);
            if !hosts.all(|h| h == host) {
                parts.clear();
                break;
            }
            parts.push((cols, host));
        }
        for (oi, _) in outputs.iter().enumerate().filter(|(_, o)| o.table == ti) {
            for (cols, host) in &parts {
                out.push(Partial { output: oi, table: ti, cols: cols.clone(), host: *host });
            }
        }
    }
    out
}

/// How a table's ids are routed by raw id (`ShardedEbc::route_raw_ids`,
/// `ShardedEbc::route_hashed_ids`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawRoute {
    /// Raw id `i` to shard `i / block`.
    Block(u64),
    /// Raw id `i` to shard [`hashed_part`]`(i, shards)`.
    Hash,
}

impl RawRoute {
    /// The shard (of `shards`) of raw id `id`.
    #[inline]
    pub(crate) fn part(self, id: u64, shards: usize) -> usize {
        match self {
            Self::Block(b) => (id / b) as usize,
            Self::Hash => hashed_part(id as i64, shards),
        }
    }
}

/// The part (of `parts`) that owns raw id `id` when ids are spread by hash: a 64-bit mix of
/// the id (splitmix64's finaliser) modulo `parts`. Ids of any range, Zipf ranks included,
/// spread evenly.
#[inline]
pub fn hashed_part(id: i64, parts: usize) -> usize {
    let mut z = (id as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % parts.max(1) as u64) as usize
}
