//! Every sharding type on 2 and 3 ranks of the thread backend: K training steps of the sharded
//! collection, each rank with its own (uneven) part of the batch, equal the unsharded collection
//! trained on the global batch: the same pooled outputs every step and the same weights after.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_dist::{ProcessGroup, ShardSpec, ShardedEbc, TableSharding, ThreadGroup};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig};
use trainrec_planner::ShardingType;
use trainrec_sparse::KeyedJaggedTensor;

const STEPS: usize = 3;
const KEYS: [&str; 4] = ["a", "b", "c", "d"];

fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("t0", 50, 8, PoolingMode::Sum, &["a"]),
        // Two features sharing one table, mean-pooled.
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

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: sharded {x} vs unsharded {y}");
    }
}

/// Trains the unsharded reference and the sharded collection and compares them.
fn check(name: &str, shardings: &[TableSharding], opt: SparseOptimizerConfig, sizes: &[usize], weighted: bool) {
    let world = sizes.len();
    let total: usize = sizes.iter().sum();
    let mut rng = StdRng::seed_from_u64(7);
    let batches: Vec<Batch> = (0..STEPS).map(|_| batch(&mut rng, total, weighted)).collect();
    let mut reference = EmbeddingBagCollection::new(tables(), opt.clone(), 3).unwrap();
    let initial: Vec<Vec<f32>> = tables().iter().map(|t| reference.table_weights(&t.name).unwrap()).collect();
    let width = reference.width();
    let mut outs = Vec::new();
    for (step, b) in batches.iter().enumerate() {
        let k = kjt(b, 0..total);
        let out = reference.forward(&k).unwrap().values().to_vec();
        reference.backward_and_update(&k, &grad(step, &out, 0..total, width)).unwrap();
        outs.push(out);
    }
    let finals: Vec<Vec<f32>> = tables().iter().map(|t| reference.table_weights(&t.name).unwrap()).collect();

    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |a, &s| {
            let x = *a;
            *a += s;
            Some(x)
        })
        .collect();
    let results = ThreadGroup::run(world, Duration::from_secs(30), |pg| {
        let r = pg.rank();
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut ebc = ShardedEbc::new(tables(), shardings.to_vec(), opt.clone(), 99, pg).unwrap();
        assert_eq!(ebc.width(), width);
        for (t, w) in tables().iter().zip(&initial) {
            ebc.set_table_weights(&t.name, w).unwrap();
        }
        let mine = starts[r]..starts[r] + sizes[r];
        for (step, b) in batches.iter().enumerate() {
            let (out, ctx) = ebc.forward(&kjt(b, mine.clone())).unwrap();
            close(
                &format!("{name}: rank {r} step {step} output"),
                &out,
                &outs[step][mine.start * width..mine.end * width],
            );
            ebc.backward_and_update(ctx, &grad(step, &out, mine.clone(), width)).unwrap();
        }
        tables().iter().map(|t| ebc.table_weights(&t.name).unwrap()).collect::<Vec<_>>()
    });
    for (r, res) in results.into_iter().enumerate() {
        let got = res.unwrap_or_else(|e| panic!("{name}: rank {r} failed: {e}"));
        for ((t, g), w) in tables().iter().zip(&got).zip(&finals) {
            close(&format!("{name}: rank {r} table {} after {STEPS} steps", t.name), g, w);
        }
    }
}

fn rowwise() -> SparseOptimizerConfig {
    serde_json::from_str(r#"{"kind": "rowwise_adagrad", "lr": 0.1}"#).unwrap()
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

fn every_sharding_type(sizes: &[usize], weighted: bool) {
    let w = sizes.len();
    let all: Vec<usize> = (0..w).collect();
    let rev: Vec<usize> = (0..w).rev().collect();
    let host: Vec<usize> = (w - 2..w).collect();
    let t = tables();
    let each = |f: &dyn Fn(&EmbeddingBagConfig, usize) -> TableSharding| -> Vec<TableSharding> {
        t.iter().enumerate().map(|(i, c)| f(c, i)).collect()
    };
    let cases: Vec<(&str, Vec<TableSharding>, SparseOptimizerConfig)> = vec![
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
    for (name, shardings, opt) in cases {
        check(&format!("{name} (world {w}, weighted {weighted})"), &shardings, opt, sizes, weighted);
        // (Row-wise) Adagrad is blind to a gradient's scale: SGD is not.
        let sgd = SparseOptimizerConfig::Sgd { lr: 0.05 };
        check(&format!("{name} (world {w}, weighted {weighted}, sgd)"), &shardings, sgd, sizes, weighted);
    }
}

#[test]
fn every_sharding_type_on_two_ranks_equals_unsharded() {
    every_sharding_type(&[5, 3], false);
    every_sharding_type(&[4, 4], true);
}

#[test]
fn every_sharding_type_on_three_ranks_equals_unsharded() {
    every_sharding_type(&[5, 3, 4], false);
    every_sharding_type(&[2, 6, 1], true);
}

#[test]
fn a_rank_with_an_empty_batch_still_takes_part() {
    let t = tables();
    let s: Vec<TableSharding> = t.iter().map(|c| TableSharding::row_wise(c.rows, c.dim, &[0, 1])).collect();
    check("row_wise with an empty rank", &s, rowwise(), &[6, 0], false);
}

#[test]
fn bad_shardings_and_bad_ids_are_named() {
    let t = tables();
    let results = ThreadGroup::run(2, Duration::from_secs(10), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut s: Vec<TableSharding> = t.iter().map(|c| TableSharding::table_wise(c.rows, c.dim, 0)).collect();
        s[1].shards[0].rows = 0..30;
        let err = ShardedEbc::new(tables(), s, rowwise(), 1, pg.clone()).err().unwrap().to_string();
        assert!(err.contains("table 't1': the shards cover 180 of the table's 222 cells"), "{err}");
        let mut s: Vec<TableSharding> = t.iter().map(|c| TableSharding::table_wise(c.rows, c.dim, 0)).collect();
        s[2].shards[0].rank = 5;
        let err = ShardedEbc::new(tables(), s, rowwise(), 1, pg.clone()).err().unwrap().to_string();
        assert!(err.contains("table 't2': shard 0 is on rank 5 but the world has 2 ranks"), "{err}");
        let s: Vec<TableSharding> = t.iter().map(|c| TableSharding::row_wise(c.rows, c.dim, &[0, 1])).collect();
        let ebc = ShardedEbc::new(tables(), s, rowwise(), 1, pg).unwrap();
        let keys = KEYS.iter().map(|s| s.to_string()).collect();
        let k = KeyedJaggedTensor::new(keys, vec![3, 50], None, vec![1, 0, 0, 1], 1).unwrap();
        ebc.forward(&k).err().unwrap().to_string()
    });
    for r in results {
        let err = r.unwrap();
        assert!(err.contains("feature 'd': id 50 is outside table 't2' (20 rows)"), "{err}");
    }
}
