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

use std::ops::Range;
use std::sync::Arc;

use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, StatePart, initial_weights,
};
use trainrec_planner::{ShardingType, TablePlan};
use trainrec_sparse::KeyedJaggedTensor;

use crate::group::module;
use crate::group::{DistError, ProcessGroup, ProcessGroupExt, offsets};
use crate::shard_engine::{LocalTables, ShardEngine};

/// One block of a table on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// The rank holding it.
    pub rank: usize,
    /// Its rows of the table.
    pub rows: Range<u64>,
    /// Its columns of the table.
    pub cols: Range<usize>,
}

/// How one table is split over the ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct TableSharding {
    /// The sharding type (data-parallel tables ignore `shards`: they live whole on every rank).
    pub sharding_type: ShardingType,
    /// The blocks, tiling `rows x dim`.
    pub shards: Vec<ShardSpec>,
}

impl TableSharding {
    /// The whole table on `rank`.
    pub fn table_wise(rows: u64, dim: usize, rank: usize) -> Self {
        Self { sharding_type: ShardingType::TableWise, shards: vec![ShardSpec { rank, rows: 0..rows, cols: 0..dim }] }
    }

    /// Even row blocks over `ranks` (the last ones smaller), TorchRec's row-wise block size
    /// `ceil(rows / n)`; table-row-wise when `ranks` is one host's ranks.
    pub fn row_wise(rows: u64, dim: usize, ranks: &[usize]) -> Self {
        let block = rows.div_ceil(ranks.len().max(1) as u64).max(1);
        let shards = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, &rank)| {
                let start = (i as u64 * block).min(rows);
                let end = ((i as u64 + 1) * block).min(rows);
                (end > start).then_some(ShardSpec { rank, rows: start..end, cols: 0..dim })
            })
            .collect();
        Self { sharding_type: ShardingType::RowWise, shards }
    }

    /// Column blocks of `block` columns (the last one smaller), one per entry of `ranks`.
    pub fn column_wise(rows: u64, dim: usize, block: usize, ranks: &[usize]) -> Self {
        let shards = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, &rank)| {
                let start = (i * block).min(dim);
                let end = ((i + 1) * block).min(dim);
                (end > start).then_some(ShardSpec { rank, rows: 0..rows, cols: start..end })
            })
            .collect();
        Self { sharding_type: ShardingType::ColumnWise, shards }
    }

    /// A replica on every rank.
    pub fn data_parallel() -> Self {
        Self { sharding_type: ShardingType::DataParallel, shards: Vec::new() }
    }

    /// The same blocks under another sharding type's name (e.g. `TableRowWise` for
    /// [`Self::row_wise`] over one host's ranks).
    pub fn named(mut self, sharding_type: ShardingType) -> Self {
        self.sharding_type = sharding_type;
        self
    }

    /// A table's placement from the planner's plan.
    pub fn from_plan(plan: &TablePlan) -> Self {
        Self {
            sharding_type: plan.sharding_type,
            shards: plan
                .shards
                .iter()
                .map(|s| ShardSpec {
                    rank: s.rank,
                    rows: s.offset[0]..s.offset[0] + s.size[0],
                    cols: s.offset[1] as usize..(s.offset[1] + s.size[1]) as usize,
                })
                .collect(),
        }
    }

    /// Checks that the shards tile `rows x dim` on ranks below `world`.
    fn check(&self, table: &str, rows: u64, dim: usize, world: usize) -> Result<(), DistError> {
        let bad = |m: String| Err(DistError::Module(format!("table '{table}': {m}")));
        if self.sharding_type == ShardingType::DataParallel {
            return Ok(());
        }
        if self.shards.is_empty() {
            return bad("its sharding has no shards".into());
        }
        let mut area = 0u128;
        for (i, s) in self.shards.iter().enumerate() {
            if s.rank >= world {
                return bad(format!("shard {i} is on rank {} but the world has {world} ranks", s.rank));
            }
            if s.rows.is_empty() || s.cols.is_empty() || s.rows.end > rows || s.cols.end > dim {
                return bad(format!(
                    "shard {i} (rows {:?}, columns {:?}) is empty or outside the table's {rows} x {dim}",
                    s.rows, s.cols
                ));
            }
            for (j, o) in self.shards[..i].iter().enumerate() {
                let rows_meet = s.rows.start < o.rows.end && o.rows.start < s.rows.end;
                let cols_meet = s.cols.start < o.cols.end && o.cols.start < s.cols.end;
                if rows_meet && cols_meet {
                    return bad(format!("shards {j} and {i} overlap"));
                }
            }
            area += (s.rows.end - s.rows.start) as u128 * s.cols.len() as u128;
        }
        if area != rows as u128 * dim as u128 {
            return bad(format!("the shards cover {area} of the table's {} cells", rows as u128 * dim as u128));
        }
        Ok(())
    }
}

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

/// Where a step's time went on this rank (seconds) and the bytes this rank sent, per phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// Input dist: bucketizing, the splits and the lengths / ids / weights all-to-alls, and
    /// assembling the local batch.
    pub input_dist: f64,
    /// Local pooled lookups (shards and data-parallel replicas).
    pub lookup: f64,
    /// Output dist: the pooled rows' all-to-all and placing them in the output.
    pub output_dist: f64,
    /// Backward dist: the output gradient's all-to-all to the shards (and the data-parallel
    /// all-gathers).
    pub grad_dist: f64,
    /// The fused optimizer updates.
    pub update: f64,
    /// Bytes sent by the input dist's all-to-alls (splits, lengths, ids, weights).
    pub input_bytes: usize,
    /// Bytes sent by the output dist's all-to-all.
    pub output_bytes: usize,
}

/// What a forward leaves for its backward (one per batch in flight).
pub struct DistContext {
    /// The batch's input dist, its times now the whole forward's.
    input: InputDist,
    /// `1 / ids` per (mean output, example); empty for sum outputs.
    mean_scale: Vec<Vec<f32>>,
    /// The data-parallel features of the local batch (expanded to the full batch).
    dp_kjt: Option<KeyedJaggedTensor>,
}

impl DistContext {
    /// Examples per rank in this step, rank order (the global batch is their sum).
    pub fn batch_sizes(&self) -> &[usize] {
        &self.input.batch_sizes
    }

    /// The forward's phase times and bytes.
    pub fn times(&self) -> StepTimes {
        self.input.times
    }
}

/// A batch after its input dist ([`ShardedEbc::input_dist`]): the lookups this rank's
/// shards serve, waiting for [`ShardedEbc::forward_dist`].
pub struct InputDist {
    /// Keys, ids and examples of the batch it was staged from (checked by `forward_dist`).
    shape: (Vec<String>, usize, usize),
    /// The batch's key of each output.
    keys: Vec<usize>,
    /// Examples of the batch.
    b: usize,
    /// The times (and bytes) of the stages run so far.
    times: StepTimes,
    /// The rank's local lookups over the global batch (absent without local shards).
    local_kjt: Option<KeyedJaggedTensor>,
    /// Examples per rank, rank order.
    batch_sizes: Vec<usize>,
    /// Per output: its bags on this rank (the batch, or a VBE key's distinct bags).
    nbags: Vec<usize>,
    /// Per output of a VBE batch: each sample's bag (`inverse_indices`).
    sample_bag: Vec<Option<Vec<usize>>>,
    /// `src_bags[s][o]`: bags of output `o` on rank `s`.
    src_bags: Vec<Vec<usize>>,
    /// `bags[j][s]`: bags of local route `j` from rank `s`.
    bags: Vec<Vec<usize>>,
    /// `off[j][s]`: where those bags start in the local batch.
    off: Vec<Vec<usize>>,
    /// Bags per key of the local batch (padded).
    stride: usize,
}

impl InputDist {
    /// The input dist's time and bytes.
    pub fn times(&self) -> StepTimes {
        self.times
    }
}

/// An embedding bag collection sharded over a process group (see the module docs).
pub struct ShardedEbc {
    pg: Arc<dyn ProcessGroup>,
    tables: Vec<EmbeddingBagConfig>,
    shardings: Vec<TableSharding>,
    outputs: Vec<Output>,
    width: usize,
    /// `routes[d]`: what rank `d` looks up, in its local collection's output order.
    routes: Vec<Vec<Route>>,
    /// Local output columns of each rank's routes (prefix sums of shard widths).
    route_cols: Vec<Vec<usize>>,
    /// Width of each rank's local output.
    local_width: Vec<usize>,
    /// Per rank: its routes that go through the all-to-all (not the reduce-scatter).
    a2a: Vec<Vec<usize>>,
    /// This rank's routes of row-wise tables (one block per rank of the world), whose partial
    /// sums are combined by one reduce-scatter; the same tables and outputs in the same order
    /// on every rank.
    rs: Vec<usize>,
    /// Floats per example of the reduce-scatter.
    rs_width: usize,
    /// This rank's shards (one local table each), in the engine computing them.
    local: Option<Box<dyn ShardEngine>>,
    /// Local table name of each (table, shard) held here.
    local_names: Vec<Vec<Option<String>>>,
    /// The data-parallel tables' replicas, in the engine computing them.
    dp: Option<Box<dyn ShardEngine>>,
    dp_outputs: Vec<usize>,
    optimizer: SparseOptimizerConfig,
    /// Ranks per host.
    local_world: usize,
    /// The row-block partial sums summed on their host first (two-stage output dist).
    partials: Vec<Partial>,
    /// `held[d]`: the partials rank `d` holds shards of, with its routes of each.
    held: Vec<Vec<(usize, Vec<usize>)>>,
    /// Per table: `Some(block)` when its ids are routed by raw id (raw id `i` to shard
    /// `i / block`, unchanged) for the shards to remap them ([`Self::route_raw_ids`]).
    raw_blocks: Vec<Option<u64>>,
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

/// Checks the tables against their shardings and the world.
pub(crate) fn check_shardings(
    tables: &[EmbeddingBagConfig],
    shardings: &[TableSharding],
    world: usize,
) -> Result<(), DistError> {
    if tables.len() != shardings.len() {
        return Err(DistError::Module(format!("{} tables but {} shardings", tables.len(), shardings.len())));
    }
    for (t, s) in tables.iter().zip(shardings) {
        s.check(&t.name, t.rows, t.dim, world)?;
    }
    Ok(())
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

/// One shard of a table held by this rank and where it sits in the table: TorchRec's local
/// shard of a `ShardedTensor` in the state dict (a data-parallel replica is one shard covering
/// the table).
#[derive(Clone, Debug, PartialEq)]
pub struct LocalShard {
    /// The table.
    pub table: String,
    /// The table's rows and columns.
    pub table_shape: [usize; 2],
    /// The shard's rows of the table.
    pub rows: Range<u64>,
    /// The shard's columns of the table.
    pub cols: Range<usize>,
    /// Whether every rank holds it (a data-parallel replica).
    pub replicated: bool,
    /// Its weights, `[rows, cols]` row-major, fp32.
    pub weights: Vec<f32>,
    /// Its fused optimizer's state, per row the parts of
    /// [`SparseOptimizerConfig::state_layout`] over the shard's columns.
    pub optimizer_state: Vec<f32>,
    /// Optimizer steps applied to it.
    pub step_count: u64,
}

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
        $crate::sharded::Parts {
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
            let entry = |c: &L, name: &str, rows: Range<u64>, cols: Range<usize>, replicated: bool| LocalShard {
                table: t.name.clone(),
                table_shape: shape,
                rows,
                cols,
                replicated,
                weights: c.weights(name).unwrap_or_default(),
                optimizer_state: c.state(name).unwrap_or_default(),
                step_count: c.steps(name).unwrap_or(0),
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
        let n_rows = (shard.rows.end - shard.rows.start) as usize;
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
        target.set_weights(lname, shard.weights)?;
        if width > 0 {
            target.set_state(lname, shard.optimizer_state)?;
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
            let mut ebc = EmbeddingBagCollection::new(local_tables, optimizer.clone(), seed).map_err(module)?;
            for (name, w) in initial_shard_weights(&tables, &shardings, &init, seed) {
                ebc.set_table_weights(&name, w).map_err(module)?;
            }
            Some(Box::new(ebc) as Box<dyn ShardEngine>)
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
            Some(Box::new(ebc) as Box<dyn ShardEngine>)
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

    /// Pooled lookups of this rank's batch `kjt` (every input feature): `[B, width]`
    /// row-major, the unsharded collection's layout, and the context its backward needs.
    /// Collective: every rank calls it with its own batch. The same as
    /// [`Self::input_dist`] then [`Self::forward_dist`].
    ///
    /// A variable-batch (VBE) `kjt` (per key its distinct bags and `inverse_indices`, e.g. from
    /// [`KeyedJaggedTensor::dedup`]) moves and pools only the distinct bags; the output is
    /// expanded to the full batch of `B = inverse_indices` samples at the end, and equals the
    /// forward of the expanded batch.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<(Vec<f32>, DistContext), DistError> {
        let staged = self.input_dist(kjt)?;
        self.forward_dist(kjt, staged)
    }

    /// The first stage of [`Self::forward`]: the input dist of this rank's batch `kjt`
    /// (bucketizing its ids by shard, the splits all-to-all and the lengths / ids / weights
    /// all-to-alls) into the batch of lookups this rank's shards serve. It reads no weights,
    /// so a pipeline runs it for batch i+1 before batch i's update (TorchRec's
    /// `TrainPipelineSparseDist`). Collective: every rank stages its batches in the same
    /// order, on one thread at a time.
    pub fn input_dist(&self, kjt: &KeyedJaggedTensor) -> Result<InputDist, DistError> {
        let (world, me) = (self.pg.world_size(), self.pg.rank());
        let inverse = match (kjt.variable_stride_per_key(), kjt.inverse_indices()) {
            (false, _) => None,
            (true, Some(inv)) => Some(inv),
            (true, None) => {
                return Err(DistError::Module(
                    "a variable-batch (VBE) batch needs inverse_indices to expand its pooled output".into(),
                ));
            }
        };
        let b = inverse.map_or(kjt.stride(), |inv| inv.indices.first().map_or(0, Vec::len));
        let keys = resolve_inputs(kjt, &self.outputs, &self.tables, |t| {
            self.raw_blocks[t].map(|b| b.saturating_mul(self.shardings[t].shards.len() as u64))
        })?;
        let weighted = kjt.weights().is_some();
        // Per output: its bags here (B, or the distinct bags of a VBE key) and each sample's bag.
        let nbags: Vec<usize> = keys.iter().map(|&k| kjt.feature(k).num_bags()).collect();
        let sample_bag: Vec<Option<Vec<usize>>> =
            keys.iter().map(|&k| inverse.map(|inv| inv.indices[k].clone())).collect();
        let start = std::time::Instant::now();
        let mut times = StepTimes::default();

        // Input dist payloads, one per destination, route-major.
        let mut lengths: Vec<u32> = Vec::new();
        let mut values: Vec<i64> = Vec::new();
        let mut weights: Vec<f32> = Vec::new();
        let (mut len_counts, mut val_counts) = (vec![0usize; world], vec![0usize; world]);
        for d in 0..world {
            let (l0, v0) = (lengths.len(), values.len());
            for r in &self.routes[d] {
                let f = kjt.feature(keys[r.output]);
                let shard = &self.shardings[r.table].shards[r.shard];
                let raw = self.raw_blocks[r.table];
                let whole = match raw {
                    Some(_) => self.shardings[r.table].shards.len() == 1,
                    None => shard.rows.start == 0 && shard.rows.end == self.tables[r.table].rows,
                };
                if whole {
                    // Every id goes to this shard unchanged.
                    lengths.extend_from_slice(f.lengths);
                    values.extend_from_slice(f.values);
                    if let Some(w) = f.weights {
                        weights.extend_from_slice(w);
                    }
                    continue;
                }
                for bag in 0..f.num_bags() {
                    let (s, e) = (f.bag_start(bag), f.bag_start(bag + 1));
                    let mut n = 0u32;
                    for pos in s..e {
                        let id = f.values[pos] as u64;
                        let (mine, local) = match raw {
                            Some(block) => (id / block == r.shard as u64, id),
                            None => (shard.rows.contains(&id), id.wrapping_sub(shard.rows.start)),
                        };
                        if mine {
                            values.push(local as i64);
                            if let Some(w) = f.weights {
                                weights.push(w[pos]);
                            }
                            n += 1;
                        }
                    }
                    lengths.push(n);
                }
            }
            len_counts[d] = lengths.len() - l0;
            val_counts[d] = values.len() - v0;
        }
        // Splits first: batch size, id count, weightedness and each output's bag count, per
        // destination.
        let n_out = self.outputs.len();
        let mut splits = Vec::new();
        for &count in &val_counts {
            splits.extend([b as u64, count as u64, weighted as u64]);
            splits.extend(nbags.iter().map(|&n| n as u64));
        }
        let mine = &self.routes[me];
        let got = self.pg.all_to_all_v(&splits, &vec![3 + n_out; world], &vec![3 + n_out; world])?;
        let at = |s: usize, i: usize| got[s * (3 + n_out) + i] as usize;
        let batch_sizes: Vec<usize> = (0..world).map(|s| at(s, 0)).collect();
        let recv_vals: Vec<usize> = (0..world).map(|s| at(s, 1)).collect();
        if let Some(s) = (0..world).find(|&s| (at(s, 2) != 0) != weighted) {
            return Err(DistError::Module(format!(
                "rank {s}'s batch is {}weighted but rank {me}'s is {}weighted: every rank must send the same features",
                if at(s, 2) != 0 { "" } else { "not " },
                if weighted { "" } else { "not " }
            )));
        }
        // src_bags[s][o]: the bags of output o on rank s; bags[j][s]: the bags of route j from
        // rank s; off[j][s]: where they start locally.
        let src_bags: Vec<Vec<usize>> = (0..world).map(|s| (0..n_out).map(|o| at(s, 3 + o)).collect()).collect();
        let bags: Vec<Vec<usize>> =
            (0..mine.len()).map(|j| (0..world).map(|s| src_bags[s][mine[j].output]).collect()).collect();
        let off: Vec<Vec<usize>> = bags.iter().map(|bs| offsets(bs)).collect();
        let recv_lens: Vec<usize> = (0..world).map(|s| bags.iter().map(|bs| bs[s]).sum()).collect();
        let lengths = self.pg.all_to_all_v(&lengths, &len_counts, &recv_lens)?;
        let values = self.pg.all_to_all_v(&values, &val_counts, &recv_vals)?;
        let weights = if weighted { Some(self.pg.all_to_all_v(&weights, &val_counts, &recv_vals)?) } else { None };

        // The local KJT: per route, the sources' bags in rank order, padded with empty bags to
        // one stride (routes of VBE keys have fewer).
        let stride = bags.iter().map(|bs| bs.iter().sum::<usize>()).max().unwrap_or(0);
        let local_kjt = match &self.local {
            Some(local) => {
                Some(merge_by_source(local.output_keys(), &bags, &lengths, &values, weights.as_deref(), stride)?)
            }
            None => None,
        };
        times.input_dist = start.elapsed().as_secs_f64();
        times.input_bytes = 8 * splits.len()
            + 4 * len_counts.iter().sum::<usize>()
            + (8 + if weighted { 4 } else { 0 }) * val_counts.iter().sum::<usize>();
        Ok(InputDist {
            shape: (kjt.keys().to_vec(), kjt.values().len(), b),
            keys,
            b,
            times,
            local_kjt,
            batch_sizes,
            nbags,
            sample_bag,
            src_bags,
            bags,
            off,
            stride,
        })
    }

    /// Loads the rows `staged`'s lookups need into the caches of this rank's cached shards
    /// and pins them until that batch's update (the `prefetch_sparse_dist` pipeline's stage;
    /// nothing to do without cached shards).
    pub fn prefetch(&mut self, staged: &InputDist) -> Result<(), DistError> {
        if let (Some(local), Some(k)) = (&mut self.local, &staged.local_kjt) {
            local.prefetch(k)?;
        }
        Ok(())
    }

    /// Routes table `name`'s ids by raw id instead of by row (`Some(block)`; `None` routes by
    /// row again): raw id `i` goes, unchanged, to the rank of shard `i / block`, and the rank
    /// must replace the ids [`Self::raw_ids_mut`] shows it by rows of that shard (local
    /// numbering) before [`Self::forward_dist`]. This is the owner-rank remap of managed
    /// collisions: each shard's module owns a block of the raw id space and of the rows, so
    /// one input dist carries each id to the module that remaps it and the shard that looks
    /// it up. Every shard must hold whole rows (all columns); the input dist refuses
    /// ids at or past `block * shards`. Every rank must route the same tables alike.
    pub fn route_raw_ids(&mut self, name: &str, block: Option<u64>) -> Result<(), DistError> {
        let ti = parts!(self).index(name)?;
        let (t, s) = (&self.tables[ti], &self.shardings[ti]);
        if block.is_some() {
            if s.sharding_type == ShardingType::DataParallel || s.shards.is_empty() {
                return Err(DistError::Module(format!("table {name}: a data-parallel table has no shard to remap on")));
            }
            if let Some(sh) = s.shards.iter().find(|sh| sh.cols != (0..t.dim)) {
                return Err(DistError::Module(format!(
                    "table {name}: its shard on rank {} holds columns {:?} of {}: routing by raw id needs whole rows",
                    sh.rank, sh.cols, t.dim
                )));
            }
        }
        if block == Some(0) {
            return Err(DistError::Module(format!("table {name}: a raw id block of 0 ids")));
        }
        self.raw_blocks[ti] = block;
        Ok(())
    }

    /// The ids `staged` brought to this rank for the tables routed by raw id
    /// ([`Self::route_raw_ids`]), still raw: `(table, shard, ids)` per feature of each such
    /// shard held here (an empty slice when no id came). Replace them by the shard's local
    /// rows before [`Self::forward_dist`].
    pub fn raw_ids_mut<'a>(&self, staged: &'a mut InputDist) -> Vec<(String, usize, &'a mut [i64])> {
        let Some(local) = staged.local_kjt.as_mut() else { return Vec::new() };
        let mine = &self.routes[self.pg.rank()];
        local
            .values_per_key_mut()
            .into_iter()
            .zip(mine)
            .filter(|(_, r)| self.raw_blocks[r.table].is_some())
            .map(|(ids, r)| (self.tables[r.table].name.clone(), r.shard, ids))
            .collect()
    }

    /// Unpins rows prefetched for batches that will not be trained.
    pub fn discard_prefetched(&mut self) {
        if let Some(local) = &mut self.local {
            local.discard_prefetched();
        }
    }

    /// The engine of this rank's shards (with their caches), when it holds any.
    pub fn local(&self) -> Option<&dyn ShardEngine> {
        self.local.as_deref()
    }

    /// The engine of this rank's data-parallel replicas, when there are any.
    pub fn replicas(&self) -> Option<&dyn ShardEngine> {
        self.dp.as_deref()
    }

    /// Moves this rank's shards and replicas into engines `make` builds from their CPU
    /// collections (e.g. trainrec's CUDA collection: the same tables, initial values and
    /// optimizer state on a GPU); the sharding and its collectives stay as they are. Not
    /// collective. Fails if an engine was moved before, or if `make` builds one with other
    /// outputs.
    pub fn move_shards(
        &mut self,
        mut make: impl FnMut(&EmbeddingBagCollection) -> Result<Box<dyn ShardEngine>, DistError>,
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

    /// The rest of [`Self::forward`] after [`Self::input_dist`] of the same `kjt`: the local
    /// lookups, the output dist and the data-parallel tables. Collective.
    pub fn forward_dist(
        &self,
        kjt: &KeyedJaggedTensor,
        staged: InputDist,
    ) -> Result<(Vec<f32>, DistContext), DistError> {
        if staged.shape != (kjt.keys().to_vec(), kjt.values().len(), staged.b) {
            return Err(DistError::Module(
                "forward_dist: the staged input dist is of another batch (stage batches in the order they train)"
                    .into(),
            ));
        }
        let me = self.pg.rank();
        let world = self.pg.world_size();
        let mine = &self.routes[me];
        let (keys, b, mut times, stride) = (&staged.keys, staged.b, staged.times, staged.stride);
        let (local_kjt, nbags, sample_bag) = (&staged.local_kjt, &staged.nbags, &staged.sample_bag);
        let (src_bags, bags, off) = (&staged.src_bags, &staged.bags, &staged.off);

        // Lookup.
        let clock = std::time::Instant::now();
        let lw = self.local_width[me];
        let mut pooled = vec![0f32; stride * lw];
        if let (Some(local), Some(k)) = (&self.local, &local_kjt) {
            local.forward_into(k, &mut pooled)?;
        }
        times.lookup = clock.elapsed().as_secs_f64();

        // Output dist, route-major payloads: to each source, its bags of every local output
        // (all-to-all); the row-wise partial sums of every source's bags (reduce-scatter).
        let clock = std::time::Instant::now();
        let block_of = |j: usize, s: usize, into: &mut Vec<f32>| {
            let (c, n) = (self.route_cols[me][j], width_of(self, &mine[j]));
            for row in off[j][s]..off[j][s] + bags[j][s] {
                into.extend_from_slice(&pooled[row * lw + c..][..n]);
            }
        };
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; world];
        let mut rs_in = Vec::new();
        let mut rs_counts = vec![0usize; world];
        for s in 0..world {
            let (a0, r0) = (send.len(), rs_in.len());
            for &j in &self.a2a[me] {
                block_of(j, s, &mut send);
            }
            for &j in &self.rs {
                block_of(j, s, &mut rs_in);
            }
            send_counts[s] = send.len() - a0;
            rs_counts[s] = rs_in.len() - r0;
        }
        let recv_counts: Vec<usize> = (0..world)
            .map(|d| {
                self.a2a[d].iter().map(|&j| nbags[self.routes[d][j].output] * width_of(self, &self.routes[d][j])).sum()
            })
            .collect();
        let recv = self.pg.all_to_all_v(&send, &send_counts, &recv_counts)?;
        let summed = if self.rs_width > 0 { self.pg.reduce_scatter_f32(&rs_in, &rs_counts)? } else { Vec::new() };
        // Two stages for the partial sums of row blocks on one host: within the host, to the
        // rank of each source's local rank, which adds them up; then to the source.
        let stage = TwoStage { ebc: self, src_bags };
        let mut s1 = Vec::new();
        let mut s1_counts = vec![0usize; world];
        for (a, count) in s1_counts.iter_mut().enumerate() {
            let start = s1.len();
            stage.for_each_held(me, a, |s, pi, js| {
                let (n, at0) = (self.partials[pi].cols.len(), s1.len());
                s1.resize(at0 + src_bags[s][self.partials[pi].output] * n, 0.0);
                for &j in js {
                    let c = self.route_cols[me][j];
                    for (i, row) in (off[j][s]..off[j][s] + bags[j][s]).enumerate() {
                        for (x, y) in s1[at0 + i * n..][..n].iter_mut().zip(&pooled[row * lw + c..][..n]) {
                            *x += y;
                        }
                    }
                }
            });
            *count = s1.len() - start;
        }
        let partial_sums = if self.partials.is_empty() {
            Vec::new()
        } else {
            let r1 = self.pg.all_to_all_v(&s1, &s1_counts, &stage.held_counts(me))?;
            let agg = stage.sum_by_source(&r1);
            let (s2, s2_counts) = stage.to_sources(&agg);
            let s2_recv: Vec<usize> = (0..world).map(|a| stage.floats_via(a, me, nbags)).collect();
            let got = self.pg.all_to_all_v(&s2, &s2_counts, &s2_recv)?;
            times.output_bytes += 4 * (s1.len() + s2.len());
            got
        };
        // Expand to the full batch: sample e reads its bag's row.
        let w = self.width;
        let mut out = vec![0f32; b * w];
        let mut place_cols = |output: usize, cols: Range<usize>, block: &[f32]| {
            let (dst, n) = (self.outputs[output].col + cols.start, cols.len());
            for e in 0..b {
                let bag = sample_bag[output].as_ref().map_or(e, |m| m[e]);
                for (x, y) in out[e * w + dst..][..n].iter_mut().zip(&block[bag * n..][..n]) {
                    *x += y;
                }
            }
        };
        let mut at = 0;
        for a in 0..world {
            for p in stage.parts_via(a, me) {
                let len = nbags[p.output] * p.cols.len();
                place_cols(p.output, p.cols.clone(), &partial_sums[at..at + len]);
                at += len;
            }
        }
        let mut place = |r: &Route, block: &[f32]| {
            let shard = &self.shardings[r.table].shards[r.shard];
            place_cols(r.output, shard.cols.clone(), block);
        };
        let mut at = 0;
        for d in 0..world {
            for &j in &self.a2a[d] {
                let r = &self.routes[d][j];
                let len = nbags[r.output] * width_of(self, r);
                place(r, &recv[at..at + len]);
                at += len;
            }
        }
        let mut at = 0;
        for &j in &self.rs {
            let r = &mine[j];
            let len = nbags[r.output] * width_of(self, r);
            place(r, &summed[at..at + len]);
            at += len;
        }
        times.output_dist = clock.elapsed().as_secs_f64();
        times.output_bytes += 4 * (send.len() + rs_in.len());

        // Data-parallel tables: local lookups on the local (full) batch.
        let clock = std::time::Instant::now();
        let dp_kjt = if let Some(dp) = &self.dp {
            let mut unique: Vec<&str> = Vec::new();
            for &o in &self.dp_outputs {
                if !unique.contains(&self.outputs[o].input.as_str()) {
                    unique.push(self.outputs[o].input.as_str());
                }
            }
            let k = kjt.select_keys(&unique).and_then(|k| k.expand_vbe()).map_err(module)?;
            let pw = dp.width();
            let mut vals = vec![0f32; k.stride() * pw];
            dp.forward_into(&k, &mut vals)?;
            let mut c = 0;
            for &o in &self.dp_outputs {
                let dim = self.tables[self.outputs[o].table].dim;
                for e in 0..b {
                    out[e * w + self.outputs[o].col..][..dim].copy_from_slice(&vals[e * pw + c..][..dim]);
                }
                c += dim;
            }
            Some(k)
        } else {
            None
        };
        times.lookup += clock.elapsed().as_secs_f64();

        // Mean pooling of sharded tables: the sum over the bag's ids, divided by their count.
        let mut mean_scale = vec![Vec::new(); self.outputs.len()];
        for (oi, o) in self.outputs.iter().enumerate() {
            if !o.mean || self.shardings[o.table].sharding_type == ShardingType::DataParallel {
                continue;
            }
            let f = kjt.feature(keys[oi]);
            let dim = self.tables[o.table].dim;
            let scale: Vec<f32> = (0..b)
                .map(|e| {
                    let l = f.lengths[sample_bag[oi].as_ref().map_or(e, |m| m[e])];
                    if l > 0 { 1.0 / l as f32 } else { 1.0 }
                })
                .collect();
            for (e, s) in scale.iter().enumerate() {
                for x in &mut out[e * w + o.col..][..dim] {
                    *x *= s;
                }
            }
            mean_scale[oi] = scale;
        }
        let mut input = staged;
        input.times = times;
        Ok((out, DistContext { input, mean_scale, dp_kjt }))
    }

    /// Backward fused with the optimizer, from the gradient of this rank's `[B, width]` output
    /// (the reverse of the output dist, then each shard's fused update over the global batch).
    /// Collective. Returns the whole step's phase times (the forward's and the backward's).
    pub fn backward_and_update(&mut self, ctx: DistContext, grad: &[f32]) -> Result<StepTimes, DistError> {
        let (world, me) = (self.pg.world_size(), self.pg.rank());
        let b = ctx.input.batch_sizes[me];
        let w = self.width;
        if grad.len() != b * w {
            return Err(DistError::Module(format!(
                "gradient has {} floats, expected batch {b} x width {w}",
                grad.len()
            )));
        }
        let mut times = ctx.input.times;
        let clock = std::time::Instant::now();
        // A route's gradient per bag here: the sum over the samples reading that bag (times
        // 1/ids for mean pooling), `[bags, shard width]`.
        let grad_cols = |output: usize, cols: Range<usize>, into: &mut Vec<f32>| {
            let (c, n) = (self.outputs[output].col + cols.start, cols.len());
            let start = into.len();
            into.resize(start + ctx.input.nbags[output] * n, 0.0);
            let dst = &mut into[start..];
            for e in 0..b {
                let bag = ctx.input.sample_bag[output].as_ref().map_or(e, |m| m[e]);
                let scale = ctx.mean_scale[output].get(e).copied().unwrap_or(1.0);
                for (x, g) in dst[bag * n..][..n].iter_mut().zip(&grad[e * w + c..][..n]) {
                    *x += g * scale;
                }
            }
        };
        let grad_of = |r: &Route, into: &mut Vec<f32>| {
            grad_cols(r.output, self.shardings[r.table].shards[r.shard].cols.clone(), into);
        };
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; world];
        for (d, count) in send_counts.iter_mut().enumerate() {
            let start = send.len();
            for &j in &self.a2a[d] {
                grad_of(&self.routes[d][j], &mut send);
            }
            *count = send.len() - start;
        }
        let mine = &self.routes[me];
        let lw = self.local_width[me];
        let recv_counts: Vec<usize> = (0..world)
            .map(|s| self.a2a[me].iter().map(|&j| ctx.input.bags[j][s] * width_of(self, &mine[j])).sum())
            .collect();
        let recv = self.pg.all_to_all_v(&send, &send_counts, &recv_counts)?;
        let gathered = if self.rs_width > 0 {
            let mut local = Vec::new();
            for &j in &self.rs {
                grad_of(&mine[j], &mut local);
            }
            let counts: Vec<usize> = (0..world)
                .map(|s| self.rs.iter().map(|&j| ctx.input.bags[j][s] * width_of(self, &mine[j])).sum())
                .collect();
            self.pg.all_gather_v(&local, &counts)?
        } else {
            Vec::new()
        };
        // The local gradient `[stride, local width]`, in the local KJT's bag order.
        let mut local_grad = vec![0f32; ctx.input.stride * lw];
        let mut put = |j: usize, s: usize, block: &[f32]| {
            let (c, n) = (self.route_cols[me][j], width_of(self, &mine[j]));
            for (i, row) in (ctx.input.off[j][s]..ctx.input.off[j][s] + ctx.input.bags[j][s]).enumerate() {
                local_grad[row * lw + c..][..n].copy_from_slice(&block[i * n..][..n]);
            }
        };
        let mut at = 0;
        for s in 0..world {
            for &j in &self.a2a[me] {
                let len = ctx.input.bags[j][s] * width_of(self, &mine[j]);
                put(j, s, &recv[at..at + len]);
                at += len;
            }
        }
        let mut at = 0;
        for s in 0..world {
            for &j in &self.rs {
                let len = ctx.input.bags[j][s] * width_of(self, &mine[j]);
                put(j, s, &gathered[at..at + len]);
                at += len;
            }
        }
        if !self.partials.is_empty() {
            // The partial sums' two stages backwards: each source's gradient to the rank of
            // its local rank on the partial's host, which hands it to every rank holding a
            // block of the partial.
            let stage = TwoStage { ebc: self, src_bags: &ctx.input.src_bags };
            let mut s2 = Vec::new();
            let mut s2_counts = vec![0usize; world];
            for (a, count) in s2_counts.iter_mut().enumerate() {
                let start = s2.len();
                for p in stage.parts_via(a, me) {
                    grad_cols(p.output, p.cols.clone(), &mut s2);
                }
                *count = s2.len() - start;
            }
            let r2_counts = stage.to_sources_counts();
            let r2 = self.pg.all_to_all_v(&s2, &s2_counts, &r2_counts)?;
            let gsum = stage.by_source(&r2);
            let mut s1 = Vec::new();
            let mut s1_counts = vec![0usize; world];
            for (d, count) in s1_counts.iter_mut().enumerate() {
                let start = s1.len();
                stage.for_each_held(d, me, |s, pi, _| s1.extend_from_slice(&gsum[&(s, pi)]));
                *count = s1.len() - start;
            }
            let r1 = self.pg.all_to_all_v(&s1, &s1_counts, &stage.held_counts_back(me))?;
            let mut at = 0;
            for a in 0..world {
                stage.for_each_held(me, a, |s, pi, js| {
                    let len = ctx.input.src_bags[s][self.partials[pi].output] * self.partials[pi].cols.len();
                    for &j in js {
                        put(j, s, &r1[at..at + len]);
                    }
                    at += len;
                });
            }
        }
        times.grad_dist = clock.elapsed().as_secs_f64();
        let clock = std::time::Instant::now();
        if let (Some(local), Some(k)) = (&mut self.local, &ctx.input.local_kjt) {
            local.backward_and_update(k, &local_grad)?;
        }
        times.update = clock.elapsed().as_secs_f64();

        if let (Some(dp), Some(k)) = (&mut self.dp, &ctx.dp_kjt) {
            let clock = std::time::Instant::now();
            // Every replica applies the global batch's update: gather ids and gradients.
            let dw: usize = self.dp_outputs.iter().map(|&o| self.tables[self.outputs[o].table].dim).sum();
            let mut g = Vec::with_capacity(b * dw);
            for e in 0..b {
                for &o in &self.dp_outputs {
                    let dim = self.tables[self.outputs[o].table].dim;
                    g.extend_from_slice(&grad[e * w + self.outputs[o].col..][..dim]);
                }
            }
            let sizes = self.pg.all_gather_u64(k.values().len() as u64)?;
            let vcounts: Vec<usize> = sizes.iter().map(|&n| n as usize).collect();
            let nkeys = k.keys().len();
            let lcounts: Vec<usize> = ctx.input.batch_sizes.iter().map(|&bs| bs * nkeys).collect();
            let gcounts: Vec<usize> = ctx.input.batch_sizes.iter().map(|&bs| bs * dw).collect();
            let lengths = self.pg.all_gather_v(k.lengths(), &lcounts)?;
            let values = self.pg.all_gather_v(k.values(), &vcounts)?;
            let weights = match k.weights() {
                Some(wts) => Some(self.pg.all_gather_v(wts, &vcounts)?),
                None => None,
            };
            let grads = self.pg.all_gather_v(&g, &gcounts)?;
            let total: usize = ctx.input.batch_sizes.iter().sum();
            let per_key = vec![ctx.input.batch_sizes.clone(); k.keys().len()];
            let global = merge_by_source(k.keys().to_vec(), &per_key, &lengths, &values, weights.as_deref(), total)?;
            times.grad_dist += clock.elapsed().as_secs_f64();
            let clock = std::time::Instant::now();
            dp.backward_and_update(&global, &grads)?;
            times.update += clock.elapsed().as_secs_f64();
        }
        Ok(times)
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
            return dp.reset_rows(name, rows, key);
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
            l.reset_block_rows(lname, &local, key, &block, t.rows)?;
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

/// One output's columns of a table whose row blocks all sit on one host: the blocks' partial
/// sums are added on that host (by the rank of each source's local rank there) before they go
/// to the source, as TorchRec's table-row-wise output dist (an intra-host reduce-scatter, then
/// a cross-host all-to-all).
#[derive(Clone, Debug)]
struct Partial {
    output: usize,
    table: usize,
    cols: Range<usize>,
    host: usize,
}

impl Partial {
    fn covers(&self, r: &Route, shardings: &[TableSharding]) -> bool {
        r.output == self.output && r.table == self.table && shardings[r.table].shards[r.shard].cols == self.cols
    }
}

/// The partials of table-row-wise and grid tables whose every column block's row blocks are
/// on one host (others, and the tables reduce-scattered over the world, keep the plain
/// all-to-all).
fn two_stage(
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

/// The bookkeeping of the two-stage output dist on one rank of one step: who sends which
/// partial sums of which sources to whom, in one order every rank agrees on.
struct TwoStage<'a> {
    ebc: &'a ShardedEbc,
    /// `src_bags[s][o]`: bags of output `o` on rank `s`.
    src_bags: &'a [Vec<usize>],
}

impl TwoStage<'_> {
    fn host(&self, r: usize) -> usize {
        r / self.ebc.local_world
    }

    /// The sources whose partial sums rank `a` adds up on its host: those of its local rank.
    fn sources_of(&self, a: usize) -> impl Iterator<Item = usize> + use<> {
        let (l, world) = (self.ebc.local_world, self.ebc.pg.world_size());
        (0..world).filter(move |s| s % l == a % l)
    }

    /// Stage one from shard holder `d` to aggregator `a` (same host): for each source of
    /// `a`, for each partial `d` holds, `f(source, partial, d's routes of it)`.
    fn for_each_held(&self, d: usize, a: usize, mut f: impl FnMut(usize, usize, &[usize])) {
        if self.host(d) != self.host(a) {
            return;
        }
        for s in self.sources_of(a) {
            for (pi, js) in &self.ebc.held[d] {
                f(s, *pi, js);
            }
        }
    }

    fn rows(&self, s: usize, pi: usize) -> usize {
        let p = &self.ebc.partials[pi];
        self.src_bags[s][p.output] * p.cols.len()
    }

    /// Floats aggregator `me` gets in stage one from each rank.
    fn held_counts(&self, me: usize) -> Vec<usize> {
        (0..self.ebc.pg.world_size())
            .map(|d| {
                let mut n = 0;
                self.for_each_held(d, me, |s, pi, _| n += self.rows(s, pi));
                n
            })
            .collect()
    }

    /// Backwards, floats shard holder `me` gets in stage one from each aggregator.
    fn held_counts_back(&self, me: usize) -> Vec<usize> {
        (0..self.ebc.pg.world_size())
            .map(|a| {
                let mut n = 0;
                self.for_each_held(me, a, |s, pi, _| n += self.rows(s, pi));
                n
            })
            .collect()
    }

    /// The partials rank `a` sums on its host, in order.
    fn parts_here(&self, a: usize) -> impl Iterator<Item = (usize, &Partial)> {
        let h = self.host(a);
        self.ebc.partials.iter().enumerate().filter(move |(_, p)| p.host == h)
    }

    /// What source `s` gets from (or, backwards, sends to) aggregator `a`: the partials of
    /// `a`'s host when `a` has `s`'s local rank.
    fn parts_via(&self, a: usize, s: usize) -> Vec<&Partial> {
        let l = self.ebc.local_world;
        if a % l != s % l {
            return Vec::new();
        }
        self.parts_here(a).map(|(_, p)| p).collect()
    }

    /// Stage one's received blocks (from every rank of this host) summed per (source, partial).
    fn sum_by_source(&self, r1: &[f32]) -> std::collections::BTreeMap<(usize, usize), Vec<f32>> {
        let me = self.ebc.pg.rank();
        let mut agg: std::collections::BTreeMap<(usize, usize), Vec<f32>> = std::collections::BTreeMap::new();
        let mut at = 0;
        for d in 0..self.ebc.pg.world_size() {
            self.for_each_held(d, me, |s, pi, _| {
                let len = self.rows(s, pi);
                let acc = agg.entry((s, pi)).or_insert_with(|| vec![0.0; len]);
                acc.iter_mut().zip(&r1[at..at + len]).for_each(|(x, y)| *x += y);
                at += len;
            });
        }
        agg
    }

    /// Stage two: to each source of this rank, the sums of this host's partials.
    fn to_sources(&self, agg: &std::collections::BTreeMap<(usize, usize), Vec<f32>>) -> (Vec<f32>, Vec<usize>) {
        let me = self.ebc.pg.rank();
        let mut send = Vec::new();
        let mut counts = vec![0usize; self.ebc.pg.world_size()];
        for s in self.sources_of(me) {
            let start = send.len();
            for (pi, _) in self.parts_here(me) {
                match agg.get(&(s, pi)) {
                    Some(v) => send.extend_from_slice(v),
                    None => send.extend(std::iter::repeat_n(0.0, self.rows(s, pi))),
                }
            }
            counts[s] = send.len() - start;
        }
        (send, counts)
    }

    /// Floats source `s` gets from aggregator `a` in stage two (`nbags`: `s`'s bags per output).
    fn floats_via(&self, a: usize, s: usize, nbags: &[usize]) -> usize {
        self.parts_via(a, s).iter().map(|p| nbags[p.output] * p.cols.len()).sum()
    }

    /// Backwards, floats this aggregator gets from each of its sources.
    fn to_sources_counts(&self) -> Vec<usize> {
        let me = self.ebc.pg.rank();
        let mut counts = vec![0usize; self.ebc.pg.world_size()];
        for s in self.sources_of(me) {
            counts[s] = self.parts_here(me).map(|(pi, _)| self.rows(s, pi)).sum();
        }
        counts
    }

    /// Backwards, the sources' gradient blocks by (source, partial).
    fn by_source(&self, r2: &[f32]) -> std::collections::BTreeMap<(usize, usize), Vec<f32>> {
        let me = self.ebc.pg.rank();
        let mut out = std::collections::BTreeMap::new();
        let mut at = 0;
        for s in self.sources_of(me) {
            for (pi, _) in self.parts_here(me) {
                let len = self.rows(s, pi);
                out.insert((s, pi), r2[at..at + len].to_vec());
                at += len;
            }
        }
        out
    }
}

/// Columns of a route: its shard's width.
fn width_of(ebc: &ShardedEbc, r: &Route) -> usize {
    ebc.shardings[r.table].shards[r.shard].cols.len()
}

fn first_output(outputs: &[Output], table: usize) -> usize {
    outputs.iter().position(|o| o.table == table).unwrap_or(0)
}

/// One KJT from every source's part, sources in rank order. Source `s`'s part is its bag
/// lengths (key-major: `bags[k][s]` bags of key `k`) and the ids (and weights) those lengths
/// cover, the parts concatenated. Key `k` gets every source's bags in rank order, padded with
/// empty bags to `stride`.
pub(crate) fn merge_by_source(
    keys: Vec<String>,
    bags: &[Vec<usize>],
    lengths: &[u32],
    values: &[i64],
    weights: Option<&[f32]>,
    stride: usize,
) -> Result<KeyedJaggedTensor, DistError> {
    let world = bags.first().map_or(0, Vec::len);
    // Where each source's lengths and ids start.
    let (mut len_at, mut val_at) = (vec![0usize; world], vec![0usize; world]);
    let (mut la, mut va) = (0, 0);
    for s in 0..world {
        len_at[s] = la;
        val_at[s] = va;
        let n: usize = bags.iter().map(|bs| bs[s]).sum();
        va += lengths[la..la + n].iter().map(|&x| x as usize).sum::<usize>();
        la += n;
    }
    let (mut lens, mut vals, mut ws) = (Vec::new(), Vec::new(), Vec::new());
    for bs in bags {
        for s in 0..world {
            let l = &lengths[len_at[s]..len_at[s] + bs[s]];
            let n: usize = l.iter().map(|&x| x as usize).sum();
            lens.extend_from_slice(l);
            vals.extend_from_slice(&values[val_at[s]..val_at[s] + n]);
            if let Some(w) = weights {
                ws.extend_from_slice(&w[val_at[s]..val_at[s] + n]);
            }
            len_at[s] += bs[s];
            val_at[s] += n;
        }
        lens.extend(std::iter::repeat_n(0, stride - bs.iter().sum::<usize>()));
    }
    KeyedJaggedTensor::new(keys, vals, weights.map(|_| ws), lens, stride).map_err(module)
}
