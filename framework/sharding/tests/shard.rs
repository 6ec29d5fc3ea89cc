//! `shard_ebc` / `shard_modules`: a collection trained unsharded, then sharded, trains on like
//! the unsharded one (weights, optimizer state and step counts carried over), and
//! `shard_modules` shards the embedding modules and leaves the rest.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_comm::{ProcessGroup, ThreadGroup};
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, PoolingMode, SparseOptimizerConfig,
};
use trainrec_sharding::{LocalShard, Module, ShardedModule, ShardingPlan, TableSharding, shard_ebc, shard_modules};
use trainrec_sparse::KeyedJaggedTensor;

fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("t0", 30, 8, PoolingMode::Sum, &["a"]),
        EmbeddingBagConfig::new("t1", 21, 6, PoolingMode::Mean, &["b"]),
        EmbeddingBagConfig::new("t2", 12, 4, PoolingMode::Sum, &["c"]),
    ]
}

/// Examples `range` of global batch `step` (every rank makes the same global batch).
fn batch(step: usize, range: std::ops::Range<usize>) -> KeyedJaggedTensor {
    let mut rng = StdRng::seed_from_u64(50 + step as u64);
    let rows = [30i64, 21, 12];
    let bags: Vec<Vec<Vec<i64>>> = rows
        .iter()
        .map(|&r| (0..8).map(|_| (0..rng.random_range(0..4usize)).map(|_| rng.random_range(0..r)).collect()).collect())
        .collect();
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for key in &bags {
        for bag in &key[range.clone()] {
            values.extend_from_slice(bag);
            lengths.push(bag.len() as u32);
        }
    }
    let keys = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    KeyedJaggedTensor::new(keys, values, None, lengths, range.len()).unwrap()
}

fn grad(step: usize, out: &[f32], range: std::ops::Range<usize>, width: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(900 + step as u64);
    let g: Vec<f32> = (0..8 * width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    g[range.start * width..range.end * width].iter().zip(out).map(|(a, b)| a + 0.3 * b).collect()
}

/// An unsharded collection trained `steps` steps on the global batches (the same on every rank).
fn trained(optimizer: &SparseOptimizerConfig, steps: std::ops::Range<usize>) -> EmbeddingBagCollection {
    let mut ebc = EmbeddingBagCollection::new(tables(), optimizer.clone(), 5).unwrap();
    for step in steps {
        let k = batch(step, 0..8);
        let out = ebc.forward(&k).unwrap().values().to_vec();
        ebc.backward_and_update(&k, &grad(step, &out, 0..8, ebc.width())).unwrap();
    }
    ebc
}

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: sharded {x} vs unsharded {y}");
    }
}

#[test]
fn a_trained_collection_sharded_trains_on_like_the_unsharded_one() {
    let adam = SparseOptimizerConfig::Adam { lr: 0.05, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    let partial =
        SparseOptimizerConfig::PartialRowwiseAdam { lr: 0.05, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    let t = tables();
    // Element-wise Adam under column-wise sharding; a row-wise part under row-wise.
    let plans = [
        (
            adam,
            ShardingPlan::new()
                .with("t0", TableSharding::table_wise(30, 8, 1))
                .with("t1", TableSharding::row_wise(21, 6, &[0, 1]))
                .with("t2", TableSharding::column_wise(12, 4, 2, &[1, 0])),
        ),
        (
            partial,
            ShardingPlan::new()
                .with("t0", TableSharding::row_wise(30, 8, &[1, 0]))
                .with("t1", TableSharding::table_wise(21, 6, 0))
                .with("t2", TableSharding::data_parallel()),
        ),
    ];
    for (optimizer, plan) in plans {
        let results = ThreadGroup::run(2, Duration::from_secs(30), |pg| {
            let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
            let r = pg.rank();
            let mine = if r == 0 { 0..5 } else { 5..8 };
            let mut reference = trained(&optimizer, 0..2);
            let mut sharded = shard_ebc(&trained(&optimizer, 0..2), &plan, pg.clone()).unwrap();
            for step in 2..4 {
                let k = batch(step, 0..8);
                let want = reference.forward(&k).unwrap().values().to_vec();
                reference.backward_and_update(&k, &grad(step, &want, 0..8, reference.width())).unwrap();
                let (out, ctx) = sharded.forward(&batch(step, mine.clone())).unwrap();
                let w = sharded.width();
                close(&format!("rank {r} step {step}"), &out, &want[mine.start * w..mine.end * w]);
                sharded.backward_and_update(ctx, &grad(step, &out, mine.clone(), w)).unwrap();
            }
            for tab in &t {
                let got = sharded.table_weights(&tab.name).unwrap();
                close(&format!("rank {r} {}", tab.name), &got, &reference.table_weights(&tab.name).unwrap());
            }
            sharded.local_shards()
        });
        let shards: Vec<Vec<LocalShard>> = results.into_iter().map(|r| r.unwrap()).collect();
        assert!(shards.iter().flatten().all(|s| s.step_count == 4), "every shard took 4 steps");
    }
}

#[test]
fn local_shards_say_where_each_block_sits() {
    let sgd = SparseOptimizerConfig::Adagrad { lr: 0.1, eps: 1e-8 };
    let plan = ShardingPlan::new()
        .with("t0", TableSharding::column_wise(30, 8, 3, &[0, 1, 0]))
        .with("t1", TableSharding::row_wise(21, 6, &[0, 1]))
        .with("t2", TableSharding::data_parallel());
    let results = ThreadGroup::run(2, Duration::from_secs(30), |pg| {
        let ebc = EmbeddingBagCollection::new(tables(), sgd.clone(), 5).unwrap();
        let full: Vec<Vec<f32>> = tables().iter().map(|t| ebc.table_weights(&t.name).unwrap()).collect();
        let sharded = shard_ebc(&ebc, &plan, Arc::new(pg)).unwrap();
        (sharded.local_shards(), full)
    });
    let (r0, full) = results[0].as_ref().unwrap();
    let (r1, _) = results[1].as_ref().unwrap();
    let place = |s: &LocalShard| (s.table.clone(), s.rows.clone(), s.cols.clone(), s.replicated);
    assert_eq!(
        r0.iter().map(place).collect::<Vec<_>>(),
        [
            ("t0".into(), 0..30, 0..3, false),
            ("t0".into(), 0..30, 6..8, false),
            ("t1".into(), 0..11, 0..6, false),
            ("t2".into(), 0..12, 0..4, true)
        ]
    );
    assert_eq!(
        r1.iter().map(place).collect::<Vec<_>>(),
        [("t0".into(), 0..30, 3..6, false), ("t1".into(), 11..21, 0..6, false), ("t2".into(), 0..12, 0..4, true)]
    );
    for s in r0.iter().chain(r1) {
        let ti = ["t0", "t1", "t2"].iter().position(|&n| n == s.table).unwrap();
        let dim = s.table_shape[1];
        let want: Vec<f32> = s
            .rows
            .clone()
            .flat_map(|r| full[ti][r as usize * dim + s.cols.start..r as usize * dim + s.cols.end].to_vec())
            .collect();
        assert_eq!(s.weights, want, "{} {:?} {:?}", s.table, s.rows, s.cols);
        // Adagrad: one accumulator per weight, all zero before training.
        assert_eq!(s.optimizer_state, vec![0.0; want.len()]);
    }
}

#[test]
fn shard_modules_shards_the_embedding_modules_and_keeps_the_rest() {
    let sgd = SparseOptimizerConfig::Sgd { lr: 0.1 };
    let seq = || vec![EmbeddingBagConfig::new("s0", 10, 4, PoolingMode::Sum, &["h"])];
    let plan = ShardingPlan::new()
        .with("t0", TableSharding::table_wise(30, 8, 0))
        .with("t1", TableSharding::table_wise(21, 6, 1))
        .with("t2", TableSharding::row_wise(12, 4, &[0, 1]))
        .with("s0", TableSharding::row_wise(10, 4, &[1, 0]));
    let modules = |with_seq: Vec<EmbeddingBagConfig>| {
        vec![
            ("sparse".to_string(), Module::Bag(EmbeddingBagCollection::new(tables(), sgd.clone(), 1).unwrap())),
            ("history".to_string(), Module::Sequence(EmbeddingCollection::new(with_seq, sgd.clone(), 1).unwrap())),
            ("over".to_string(), Module::Other(vec![1.5f32, 2.5])),
        ]
    };
    let results = ThreadGroup::run(2, Duration::from_secs(30), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let out = shard_modules(modules(seq()), &plan, pg.clone()).unwrap();
        let kinds: Vec<String> = out
            .iter()
            .map(|(n, m)| match m {
                ShardedModule::Bag(e) => format!("{n}: bag, {} shards here", e.local_shards().len()),
                ShardedModule::Sequence(e) => format!("{n}: sequence {:?}", e.output_keys()),
                ShardedModule::Other(v) => format!("{n}: other {v:?}"),
            })
            .collect();
        let dup = vec![EmbeddingBagConfig::new("t1", 10, 4, PoolingMode::Sum, &["h"])];
        let dup = shard_modules(modules(dup), &plan, pg.clone()).err().unwrap().to_string();
        let other = vec![EmbeddingBagConfig::new("s9", 10, 4, PoolingMode::Sum, &["h"])];
        let missing = shard_modules(modules(other), &plan, pg).err().unwrap().to_string();
        (kinds, dup, missing)
    });
    let (k0, dup, missing) = results[0].as_ref().unwrap();
    assert_eq!(k0, &["sparse: bag, 2 shards here", "history: sequence [\"h\"]", "over: other [1.5, 2.5]"]);
    assert_eq!(results[1].as_ref().unwrap().0[0], "sparse: bag, 2 shards here");
    assert_eq!(dup, "modules 'sparse' and 'history' both have a table 't1': the plan places tables by name");
    assert!(
        missing.starts_with("module 'history': the sharding plan does not place table 's9' (it places: s0, t0"),
        "{missing}"
    );
}

/// A key-value table sharded row- or column-wise: each shard's store starts from its block of
/// the unsharded table's initial weights without holding a row (it held every row when the
/// shard was written at build), and reads those weights.
#[test]
fn key_value_shards_start_from_the_unsharded_weights_holding_no_row() {
    use trainrec_embedding::{CacheBacking, CacheConfig, CachePolicy, EmbeddingEngine};
    let dir = std::env::temp_dir().join(format!("trainrec-kv-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cached = |t: EmbeddingBagConfig| {
        let slots = 4;
        t.with_cache(CacheConfig { slots, policy: CachePolicy::Lru, backing: CacheBacking::KeyValue, dir: dir.clone() })
    };
    let opt = SparseOptimizerConfig::Adagrad { lr: 0.1, eps: 1e-8 };
    let full = EmbeddingBagCollection::new(tables(), opt.clone(), 9).unwrap();
    let want = full.table_weights("t0").unwrap();
    for plan in [
        ShardingPlan::new().with("t0", TableSharding::row_wise(30, 8, &[0, 1])),
        ShardingPlan::new().with("t0", TableSharding::column_wise(30, 8, 4, &[1, 0])),
    ] {
        let plan = plan.with("t1", TableSharding::table_wise(21, 6, 0)).with("t2", TableSharding::table_wise(12, 4, 1));
        let results = ThreadGroup::run(2, Duration::from_secs(30), |pg| {
            let mut configs = tables();
            configs[0] = cached(configs[0].clone());
            let shardings = configs.iter().map(|t| plan.get(&t.name).cloned().unwrap()).collect();
            let sharded = trainrec_sharding::ShardedEbc::new(configs, shardings, opt.clone(), 9, Arc::new(pg)).unwrap();
            let whole = sharded.table_weights("t0").unwrap();
            (sharded.cache_placements(), sharded.local_shards(), whole)
        });
        for r in &results {
            let (placements, shards, whole) = r.as_ref().unwrap();
            assert!(!placements.is_empty());
            for (name, p) in placements {
                assert_eq!((p.backing, p.stored), (CacheBacking::KeyValue, 0), "{name}");
            }
            // The shards read as the unsharded table's initial weights...
            assert_eq!(whole, &want);
            // ...and a checkpoint of them holds no row (a sparse block of the rows written).
            for s in shards.iter().filter(|s| s.table == "t0") {
                assert_eq!(s.stored.as_deref(), Some(&[][..]), "{:?} {:?}", s.rows, s.cols);
                assert!(s.weights.is_empty() && s.optimizer_state.is_empty());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
