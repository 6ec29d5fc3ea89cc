//! Routing by raw id (`ShardedEbc::route_raw_ids`, the owner-rank remap of managed
//! collisions): each id reaches the rank owning its block of the raw id space, unchanged, and
//! after that rank replaces it by a row of its shard the forward and the update equal the
//! unsharded collection's on the same rows.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_comm::{ProcessGroup, ThreadGroup};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig};
use trainrec_sharding::{ShardedEbc, TableSharding};
use trainrec_sparse::KeyedJaggedTensor;

/// Raw ids of `a` in `0..RAW`, blocks of `BLOCK` per shard; `b` is plain.
const RAW: i64 = 90;
const BLOCK: u64 = 30;

fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("ta", 12, 4, PoolingMode::Sum, &["a"]),
        EmbeddingBagConfig::new("tb", 10, 4, PoolingMode::Mean, &["b"]),
    ]
}

/// Examples `range` of global batch `step`, raw ids for `a`.
fn batch(step: usize, range: std::ops::Range<usize>) -> KeyedJaggedTensor {
    let mut rng = StdRng::seed_from_u64(70 + step as u64);
    let limits = [RAW, 10];
    let bags: Vec<Vec<Vec<i64>>> = limits
        .iter()
        .map(|&r| (0..6).map(|_| (0..rng.random_range(0..5usize)).map(|_| rng.random_range(0..r)).collect()).collect())
        .collect();
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for key in &bags {
        for bag in &key[range.clone()] {
            values.extend_from_slice(bag);
            lengths.push(bag.len() as u32);
        }
    }
    KeyedJaggedTensor::new(vec!["a".into(), "b".into()], values, None, lengths, range.len()).unwrap()
}

/// The hand-made remap: raw id `i` of block `s` (of 3) to row `i % 4` of shard `s` (rows
/// `4s..4s + 4` of the table).
fn local_row(id: i64) -> i64 {
    id % 4
}

fn global_row(id: i64) -> i64 {
    (id / BLOCK as i64) * 4 + local_row(id)
}

fn grad(step: usize, n: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(300 + step as u64);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

#[test]
fn raw_ids_reach_their_owner_unchanged_and_train_like_the_unsharded_collection() {
    let opt = SparseOptimizerConfig::Adagrad { lr: 0.3, eps: 1e-8 };
    let (world, per_rank) = (3usize, 2usize);
    let results = ThreadGroup::run(world, Duration::from_secs(30), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let me = pg.rank();
        let shardings = vec![TableSharding::row_wise(12, 4, &[0, 1, 2]), TableSharding::table_wise(10, 4, 1)];
        let mut s = ShardedEbc::new(tables(), shardings, opt.clone(), 9, pg).unwrap();
        s.route_raw_ids("ta", Some(BLOCK)).unwrap();
        let mut outs = Vec::new();
        for step in 0..3 {
            let kjt = batch(step, me * per_rank..(me + 1) * per_rank);
            let mut staged = s.input_dist(&kjt).unwrap();
            let mut seen = Vec::new();
            for (table, shard, ids) in s.raw_ids_mut(&mut staged) {
                assert_eq!((table.as_str(), shard), ("ta", me), "rank {me} holds ta's shard {me} only");
                seen.extend_from_slice(ids);
                for id in ids.iter_mut() {
                    *id = local_row(*id);
                }
            }
            let (out, ctx) = s.forward_dist(&kjt, staged).unwrap();
            s.backward_and_update(ctx, &grad(step, 6 * 8)[me * per_rank * 8..(me + 1) * per_rank * 8]).unwrap();
            outs.push((seen, out));
        }
        (outs, s.table_weights("ta").unwrap(), s.table_weights("tb").unwrap())
    });
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();

    // The unsharded reference reads the remapped rows of the whole batch.
    let mut ebc = EmbeddingBagCollection::new(tables(), opt, 9).unwrap();
    for step in 0..3 {
        let full = batch(step, 0..6);
        let a = full.feature(0);
        // Ids of the global batch in rank order of their examples: what each owner must see.
        for (r, res) in results.iter().enumerate() {
            let want: Vec<i64> = a.values.iter().copied().filter(|&id| id as u64 / BLOCK == r as u64).collect();
            assert_eq!(res.0[step].0, want, "step {step}: raw ids at rank {r}");
        }
        let mut values = full.values().to_vec();
        for v in &mut values[..a.values.len()] {
            *v = global_row(*v);
        }
        let k = KeyedJaggedTensor::new(full.keys().to_vec(), values, None, full.lengths().to_vec(), 6).unwrap();
        let out = ebc.forward(&k).unwrap().values().to_vec();
        for (r, res) in results.iter().enumerate() {
            let mine = &out[r * per_rank * 8..(r + 1) * per_rank * 8];
            for (i, (x, y)) in res.0[step].1.iter().zip(mine).enumerate() {
                assert!((x - y).abs() < 1e-5, "step {step} rank {r} [{i}]: {x} vs {y}");
            }
        }
        ebc.backward_and_update(&k, &grad(step, 6 * 8)).unwrap();
    }
    for res in &results {
        for (name, w) in [("ta", &res.1), ("tb", &res.2)] {
            let want = ebc.table_weights(name).unwrap();
            assert!(w.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-5), "table {name}");
        }
    }
}

#[test]
fn raw_routing_needs_whole_rows() {
    let results = ThreadGroup::run(2, Duration::from_secs(30), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let shardings = vec![TableSharding::column_wise(12, 4, 2, &[0, 1]), TableSharding::data_parallel()];
        let mut s = ShardedEbc::new(tables(), shardings, SparseOptimizerConfig::Sgd { lr: 0.1 }, 9, pg).unwrap();
        let cw = s.route_raw_ids("ta", Some(BLOCK)).unwrap_err().to_string();
        let dp = s.route_raw_ids("tb", Some(BLOCK)).unwrap_err().to_string();
        let none = s.route_raw_ids("nope", Some(BLOCK)).unwrap_err().to_string();
        (cw, dp, none)
    });
    let (cw, dp, none) = results.into_iter().next().unwrap().unwrap();
    assert!(cw.contains("ta") && cw.contains("whole rows"), "{cw}");
    assert!(dp.contains("tb") && dp.contains("data-parallel"), "{dp}");
    assert!(none.contains("nope"), "{none}");
}
