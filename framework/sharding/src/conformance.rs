//! Equivalence checks any [`ProcessGroup`] backend runs: for every sharding type, K training
//! steps of the [`ShardedEbc`] (and of the [`ShardedEc`]), each rank with its own (uneven)
//! part of the batch, must equal the unsharded collection trained on the global batch: the
//! same pooled (per-id) outputs every step and the same weights after (fp32, within 1e-5). The thread backend runs them in `cargo
//! test`; the MPI backend runs them under `mpirun` (`trainrec-sharding-mpi-check`).
//!
//! Every rank computes the unsharded reference itself (the inputs are deterministic), so a
//! check needs no communication besides the sharded collection's own.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, PoolingMode, SparseOptimizerConfig,
};
use trainrec_planner::ShardingType;
use trainrec_sparse::KeyedJaggedTensor;

use crate::{ShardSpec, ShardedEbc, ShardedEc, TableSharding};
use trainrec_comm::{DistError, ProcessGroup};

/// Training steps per case.
pub const STEPS: usize = 3;
const KEYS: [&str; 4] = ["a", "b", "c", "d"];

/// The tables of every case: a sum table, a mean-pooled table shared by two features, and a
/// small sum table.
pub fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("t0", 50, 8, PoolingMode::Sum, &["a"]),
        EmbeddingBagConfig::new("t1", 37, 6, PoolingMode::Mean, &["b", "c"]),
        EmbeddingBagConfig::new("t2", 20, 4, PoolingMode::Sum, &["d"]),
    ]
}

/// One batch as per-key, per-example id lists (and weights).
struct Batch {
    ids: Vec<Vec<Vec<i64>>>,
    weights: Option<Vec<Vec<Vec<f32>>>>,
}

fn batch(rng: &mut StdRng, examples: usize, weighted: bool) -> Batch {
    let rows = [50i64, 37, 37, 20];
    let ids: Vec<Vec<Vec<i64>>> = rows
        .iter()
        .map(|&r| {
            (0..examples)
                .map(|_| {
                    let n = rng.random_range(0..4usize);
                    // Small id ranges: duplicates within and across ranks.
                    (0..n).map(|_| rng.random_range(0..r.min(12)) * (r / 12).max(1) % r).collect()
                })
                .collect()
        })
        .collect();
    let weights = weighted.then(|| {
        ids.iter()
            .map(|k| k.iter().map(|bag| bag.iter().map(|_| rng.random_range(0.5f32..1.5)).collect()).collect())
            .collect()
    });
    Batch { ids, weights }
}

/// The KJT of examples `range` of `b`.
fn kjt(b: &Batch, range: std::ops::Range<usize>) -> KeyedJaggedTensor {
    let (mut values, mut weights, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    for (k, key) in b.ids.iter().enumerate() {
        for e in range.clone() {
            values.extend_from_slice(&key[e]);
            lengths.push(key[e].len() as u32);
            if let Some(w) = &b.weights {
                weights.extend_from_slice(&w[k][e]);
            }
        }
    }
    let keys = KEYS.iter().map(|s| s.to_string()).collect();
    KeyedJaggedTensor::new(keys, values, b.weights.as_ref().map(|_| weights), lengths, range.len()).unwrap()
}

/// The output gradient of step `step`: a fixed random part plus the output itself, so a wrong
/// forward also shows in the weights.
fn grad(step: usize, out: &[f32], examples: std::ops::Range<usize>, width: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(1000 + step as u64);
    let g: Vec<f32> = (0..examples.end * width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    g[examples.start * width..].iter().zip(out).map(|(a, b)| a + 0.5 * b).collect()
}

fn close(what: &str, a: &[f32], b: &[f32]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{what}: {} values, the unsharded collection has {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if (x - y).abs() > 1e-5 * (1.0 + y.abs()) {
            return Err(format!("{what}[{i}]: sharded {x} vs unsharded {y}"));
        }
    }
    Ok(())
}

/// One equivalence case.
#[derive(Clone, Debug)]
pub struct Case {
    /// What it checks.
    pub name: String,
    /// The sharding of each of [`tables`].
    pub shardings: Vec<TableSharding>,
    /// The fused optimizer.
    pub optimizer: SparseOptimizerConfig,
    /// Examples per rank.
    pub sizes: Vec<usize>,
    /// Whether the ids carry weights.
    pub weighted: bool,
    /// Whether each rank sends its batch deduplicated (VBE: distinct bags per key and
    /// `inverse_indices`); the result must equal the full batch's.
    pub vbe: bool,
    /// Whether it checks the unpooled [`ShardedEc`] instead of the [`ShardedEbc`].
    pub sequence: bool,
    /// Ranks per host (the bag collection sums table-row-wise blocks on their host first).
    pub local_world_size: usize,
}

/// A case's global batches (their total size) and this rank's examples of each.
fn case_batches(pg: &dyn ProcessGroup, case: &Case) -> Result<(usize, Vec<Batch>, std::ops::Range<usize>), String> {
    let sizes = &case.sizes;
    if sizes.len() != pg.world_size() {
        return Err(format!("{}: {} batch sizes for world size {}", case.name, sizes.len(), pg.world_size()));
    }
    let total: usize = sizes.iter().sum();
    let mut rng = StdRng::seed_from_u64(7);
    let batches: Vec<Batch> = (0..STEPS).map(|_| batch(&mut rng, total, case.weighted)).collect();
    let start: usize = sizes[..pg.rank()].iter().sum();
    Ok((total, batches, start..start + sizes[pg.rank()]))
}

/// Builds the engine a rank's shards move into ([`ShardedEbc::move_shards`]).
pub type MakeEngine<'a> =
    &'a mut dyn FnMut(&EmbeddingBagCollection) -> Result<Box<dyn trainrec_embedding::TableEngine>, DistError>;

/// Runs `case` on this rank of `pg` (every rank must run the same cases in the same order).
pub fn run_case(pg: Arc<dyn ProcessGroup>, case: &Case) -> Result<(), String> {
    run_case_on(pg, case, None)
}

/// [`run_case`] with the pooled collection's shards moved into the engine `engine` builds
/// (e.g. the CUDA one), when given: the engine must train them as the CPU collection does.
/// Sequence cases run on the CPU collection only (an error with an engine).
pub fn run_case_on(pg: Arc<dyn ProcessGroup>, case: &Case, engine: Option<MakeEngine<'_>>) -> Result<(), String> {
    if case.sequence {
        if engine.is_some() {
            return Err(format!("{}: sequence cases run on the CPU collection only", case.name));
        }
        return run_sequence_case(pg, case);
    }
    let name = &case.name;
    let (total, batches, mine) = case_batches(pg.as_ref(), case)?;
    let e = |e: trainrec_embedding::EmbeddingError| format!("{name}: unsharded: {e}");
    let mut reference = EmbeddingBagCollection::new(tables(), case.optimizer.clone(), 3).map_err(e)?;
    let initial: Vec<Vec<f32>> =
        tables().iter().map(|t| reference.table_weights(&t.name).unwrap_or_default()).collect();
    let width = reference.width();
    let mut outs = Vec::new();
    for (step, b) in batches.iter().enumerate() {
        let k = kjt(b, 0..total);
        let out = reference.forward(&k).map_err(e)?.values().to_vec();
        reference.backward_and_update(&k, &grad(step, &out, 0..total, width)).map_err(e)?;
        outs.push(out);
    }

    let r = pg.rank();
    let d = |e: trainrec_comm::DistError| format!("{name}: rank {r}: {e}");
    let mut ebc = ShardedEbc::new_on_hosts(
        tables(),
        case.shardings.clone(),
        case.optimizer.clone(),
        99,
        pg,
        case.local_world_size,
    )
    .map_err(d)?;
    if ebc.width() != width {
        return Err(format!("{name}: width {} vs {width}", ebc.width()));
    }
    for (t, w) in tables().iter().zip(&initial) {
        ebc.set_table_weights(&t.name, w).map_err(d)?;
    }
    if let Some(make) = engine {
        ebc.move_shards(make).map_err(d)?;
    }
    for (step, b) in batches.iter().enumerate() {
        let local = kjt(b, mine.clone());
        let local = if case.vbe { local.dedup().map_err(|e| format!("{name}: dedup: {e}"))? } else { local };
        let (out, ctx) = ebc.forward(&local).map_err(d)?;
        close(
            &format!("{name}: rank {r} step {step} output"),
            &out,
            &outs[step][mine.start * width..mine.end * width],
        )?;
        ebc.backward_and_update(ctx, &grad(step, &out, mine.clone(), width)).map_err(d)?;
    }
    for t in tables() {
        let got = ebc.table_weights(&t.name).map_err(d)?;
        let want = reference.table_weights(&t.name).unwrap_or_default();
        close(&format!("{name}: rank {r} table {} after {STEPS} steps", t.name), &got, &want)?;
    }
    Ok(())
}

/// Ids of key `k` in examples `range`: (first id, count).
fn id_range(b: &Batch, k: usize, range: std::ops::Range<usize>) -> (usize, usize) {
    let len = |e: &Vec<i64>| e.len();
    (b.ids[k][..range.start].iter().map(len).sum(), b.ids[k][range].iter().map(len).sum())
}

/// The gradient of sequence output `o` at step `step` for ids `ids` (first, count) of the
/// global batch: a fixed random part plus half the output.
fn sequence_grad(step: usize, o: usize, ids: (usize, usize), dim: usize, total_ids: usize, out: &[f32]) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(2000 + 10 * step as u64 + o as u64);
    let g: Vec<f32> = (0..total_ids * dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    g[ids.0 * dim..(ids.0 + ids.1) * dim].iter().zip(out).map(|(a, b)| a + 0.5 * b).collect()
}

/// [`run_case`] for the [`ShardedEc`]: per-id outputs, output `o` reading key `o`.
fn run_sequence_case(pg: Arc<dyn ProcessGroup>, case: &Case) -> Result<(), String> {
    let name = &case.name;
    let (total, batches, mine) = case_batches(pg.as_ref(), case)?;
    let e = |e: trainrec_embedding::EmbeddingError| format!("{name}: unsharded: {e}");
    let mut reference = EmbeddingCollection::new(tables(), case.optimizer.clone(), 3).map_err(e)?;
    let initial: Vec<Vec<f32>> =
        tables().iter().map(|t| reference.table_weights(&t.name).unwrap_or_default()).collect();
    let dims: Vec<usize> = tables().iter().flat_map(|t| t.features.iter().map(move |_| t.dim)).collect();
    let mut outs = Vec::new();
    for (step, b) in batches.iter().enumerate() {
        let k = kjt(b, 0..total);
        let out = reference.forward(&k).map_err(e)?.values;
        let grads: Vec<Vec<f32>> = (0..out.len())
            .map(|o| {
                let all = id_range(b, o, 0..total);
                sequence_grad(step, o, all, dims[o], all.1, &out[o])
            })
            .collect();
        reference.backward_and_update(&k, &grads).map_err(e)?;
        outs.push(out);
    }

    let r = pg.rank();
    let d = |e: trainrec_comm::DistError| format!("{name}: rank {r}: {e}");
    let mut ec = ShardedEc::new(tables(), case.shardings.clone(), case.optimizer.clone(), 99, pg).map_err(d)?;
    if ec.output_keys() != KEYS {
        return Err(format!("{name}: outputs {:?}", ec.output_keys()));
    }
    for (t, w) in tables().iter().zip(&initial) {
        ec.set_table_weights(&t.name, w).map_err(d)?;
    }
    for (step, b) in batches.iter().enumerate() {
        let local = kjt(b, mine.clone());
        let local = if case.vbe { local.dedup().map_err(|e| format!("{name}: dedup: {e}"))? } else { local };
        let (out, ctx) = ec.forward(&local).map_err(d)?;
        let mut grads = Vec::new();
        for (o, got) in out.values.iter().enumerate() {
            let (first, n) = id_range(b, o, mine.clone());
            let want = &outs[step][o][first * dims[o]..(first + n) * dims[o]];
            close(&format!("{name}: rank {r} step {step} output {}", KEYS[o]), got, want)?;
            let total_ids = id_range(b, o, 0..total).1;
            grads.push(sequence_grad(step, o, (first, n), dims[o], total_ids, got));
        }
        ec.backward_and_update(ctx, &grads).map_err(d)?;
    }
    for t in tables() {
        let got = ec.table_weights(&t.name).map_err(d)?;
        let want = reference.table_weights(&t.name).unwrap_or_default();
        close(&format!("{name}: rank {r} table {} after {STEPS} steps", t.name), &got, &want)?;
    }
    Ok(())
}

fn rowwise() -> SparseOptimizerConfig {
    SparseOptimizerConfig::RowwiseAdagrad {
        lr: 0.1,
        eps: 1e-8,
        weight_decay: 0.0,
        weight_decay_mode: trainrec_embedding::WeightDecayMode::None,
    }
}

fn adagrad() -> SparseOptimizerConfig {
    SparseOptimizerConfig::Adagrad { lr: 0.1, eps: 1e-8 }
}

/// Grid: two column blocks, each cut into row blocks over `ranks`.
fn grid(rows: u64, dim: usize, ranks: &[usize]) -> TableSharding {
    let mut shards = Vec::new();
    let half = dim / 2;
    for (c, cols) in [0..half, half..dim].into_iter().enumerate() {
        let rw = TableSharding::row_wise(rows, dim, ranks);
        for (i, s) in rw.shards.into_iter().enumerate() {
            shards.push(ShardSpec { rank: ranks[(i + c) % ranks.len()], rows: s.rows, cols: cols.clone() });
        }
    }
    TableSharding { sharding_type: ShardingType::Grid, shards }
}

/// Every sharding type (and a mix) on `sizes.len()` ranks (at least 2), each with its usual
/// optimizer, with SGD ((row-wise) Adagrad is blind to a gradient's scale; SGD is not), and
/// with SGD on deduplicated (VBE) batches; each for the pooled [`ShardedEbc`] and the
/// unpooled [`ShardedEc`] (48 cases).
pub fn cases(sizes: &[usize], weighted: bool) -> Vec<Case> {
    let w = sizes.len();
    let all: Vec<usize> = (0..w).collect();
    let rev: Vec<usize> = (0..w).rev().collect();
    let host: Vec<usize> = (w.saturating_sub(2)..w).collect();
    let t = tables();
    let each = |f: &dyn Fn(&EmbeddingBagConfig, usize) -> TableSharding| -> Vec<TableSharding> {
        t.iter().enumerate().map(|(i, c)| f(c, i)).collect()
    };
    let types: Vec<(&str, Vec<TableSharding>, SparseOptimizerConfig)> = vec![
        ("table_wise", each(&|c, i| TableSharding::table_wise(c.rows, c.dim, (i + 1) % w)), rowwise()),
        ("row_wise", each(&|c, _| TableSharding::row_wise(c.rows, c.dim, &all)), rowwise()),
        (
            "table_row_wise",
            each(&|c, _| TableSharding::row_wise(c.rows, c.dim, &host).named(ShardingType::TableRowWise)),
            rowwise(),
        ),
        ("column_wise", each(&|c, _| TableSharding::column_wise(c.rows, c.dim, c.dim.div_ceil(2), &rev)), adagrad()),
        (
            "table_column_wise",
            each(&|c, _| {
                TableSharding::column_wise(c.rows, c.dim, c.dim.div_ceil(2), &host).named(ShardingType::TableColumnWise)
            }),
            adagrad(),
        ),
        ("grid", each(&|c, _| grid(c.rows, c.dim, &all)), adagrad()),
        ("data_parallel", each(&|_, _| TableSharding::data_parallel()), rowwise()),
        (
            "mixed",
            vec![
                TableSharding::table_wise(t[0].rows, t[0].dim, w - 1),
                TableSharding::row_wise(t[1].rows, t[1].dim, &all),
                TableSharding::data_parallel(),
            ],
            rowwise(),
        ),
    ];
    let mut out = Vec::new();
    for (name, shardings, opt) in types {
        let sgd = SparseOptimizerConfig::Sgd { lr: 0.05 };
        for sequence in [false, true] {
            let module = if sequence { "ec " } else { "" };
            for (variant, optimizer, vbe) in
                [("", opt.clone(), false), (", sgd", sgd.clone(), false), (", sgd, vbe", sgd.clone(), true)]
            {
                out.push(Case {
                    name: format!("{module}{name} (world {w}, weighted {weighted}{variant})"),
                    shardings: shardings.clone(),
                    optimizer,
                    sizes: sizes.to_vec(),
                    weighted,
                    vbe,
                    sequence,
                    local_world_size: w,
                });
            }
        }
    }
    out
}

/// The sharding types whose output dist depends on hosts, on `sizes.len()` ranks in hosts of
/// `local_world_size`: table-row-wise tables each on its own host (the blocks' partial sums
/// added on that host, then sent across), grid tables with column blocks on different hosts,
/// and a mix with row-wise and table-wise tables; each with row-wise Adagrad (Adagrad for
/// grid), SGD and SGD on VBE batches.
pub fn host_cases(sizes: &[usize], weighted: bool, local_world_size: usize) -> Vec<Case> {
    let w = sizes.len();
    let l = local_world_size;
    let hosts = w / l;
    let host = |h: usize| -> Vec<usize> { (h * l..(h + 1) * l).collect() };
    let all: Vec<usize> = (0..w).collect();
    let t = tables();
    let twrw = |c: &EmbeddingBagConfig, h: usize| {
        TableSharding::row_wise(c.rows, c.dim, &host(h % hosts)).named(ShardingType::TableRowWise)
    };
    // Column block c on host c: each block's row blocks on that host's ranks.
    let grid_on_hosts = |c: &EmbeddingBagConfig| {
        let half = c.dim / 2;
        let mut shards = Vec::new();
        for (b, cols) in [0..half, half..c.dim].into_iter().enumerate() {
            for s in TableSharding::row_wise(c.rows, c.dim, &host(b % hosts)).shards {
                shards.push(ShardSpec { rank: s.rank, rows: s.rows, cols: cols.clone() });
            }
        }
        TableSharding { sharding_type: ShardingType::Grid, shards }
    };
    let types: Vec<(&str, Vec<TableSharding>, SparseOptimizerConfig)> = vec![
        ("table_row_wise", t.iter().enumerate().map(|(i, c)| twrw(c, i + 1)).collect(), rowwise()),
        ("grid", t.iter().map(grid_on_hosts).collect(), adagrad()),
        (
            "mixed",
            vec![
                twrw(&t[0], hosts - 1),
                TableSharding::row_wise(t[1].rows, t[1].dim, &all),
                TableSharding::table_wise(t[2].rows, t[2].dim, l.min(w - 1)),
            ],
            rowwise(),
        ),
    ];
    let sgd = SparseOptimizerConfig::Sgd { lr: 0.05 };
    let mut out = Vec::new();
    for (name, shardings, opt) in types {
        for (variant, optimizer, vbe) in
            [("", opt.clone(), false), (", sgd", sgd.clone(), false), (", sgd, vbe", sgd.clone(), true)]
        {
            out.push(Case {
                name: format!("{name} (world {w}, {l} per host, weighted {weighted}{variant})"),
                shardings: shardings.clone(),
                optimizer,
                sizes: sizes.to_vec(),
                weighted,
                vbe,
                sequence: false,
                local_world_size: l,
            });
        }
    }
    out
}

/// The standard batch sizes per rank for a world (uneven, some ranks larger).
pub fn standard_sizes(world: usize, variant: usize) -> Vec<usize> {
    (0..world).map(|r| 1 + (r * 5 + variant * 3 + 4) % 7).collect()
}
