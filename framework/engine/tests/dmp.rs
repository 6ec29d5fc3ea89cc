//! A training loop of one's own over `DistributedModelParallel`: 2 ranks (sharded embeddings,
//! data-parallel dense layer, bucketed gradient sums) train like one process on the global
//! batch, and the named state shows every rank's shards of the fused tables.

use std::sync::Arc;
use std::time::Duration;

use tch::nn::Module as _;
use tch::{Kind, Tensor, nn};
use trainrec_comm::{ProcessGroup, ThreadGroup};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig};
use trainrec_engine::{DistributedModelParallel, StateEntry};
use trainrec_sharding::{Module, ShardedModule, ShardingPlan, TableSharding};
use trainrec_sparse::KeyedJaggedTensor;

const TOTAL: usize = 8;
const STEPS: usize = 3;
const LR: f64 = 0.1;

fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("t0", 20, 4, PoolingMode::Sum, &["a"]),
        EmbeddingBagConfig::new("t1", 10, 4, PoolingMode::Mean, &["b"]),
    ]
}

/// Examples `range` of step `step`'s global batch, and their labels.
fn batch(step: usize, range: std::ops::Range<usize>) -> (KeyedJaggedTensor, Vec<f32>) {
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for (k, rows) in [20i64, 10].into_iter().enumerate() {
        for e in range.clone() {
            let n = (e + step + k) % 3;
            for i in 0..n {
                values.push((e as i64 * 7 + i as i64 * 3 + step as i64 + k as i64) % rows);
            }
            lengths.push(n as u32);
        }
    }
    let labels = range.clone().map(|e| ((e + step) % 2) as f32).collect();
    let keys = vec!["a".to_string(), "b".to_string()];
    (KeyedJaggedTensor::new(keys, values, None, lengths, range.len()).unwrap(), labels)
}

/// The dense layer with weights that differ per `rank` (the DMP copies rank 0's).
fn dense(vs: &nn::VarStore, rank: usize) -> nn::Linear {
    let lin = nn::linear(vs.root() / "over", 8, 1, Default::default());
    tch::no_grad(|| {
        let w: Vec<f32> = (0..8).map(|i| 0.1 * (i as f32 - 3.0) * (rank + 1) as f32).collect();
        lin.ws.shallow_clone().copy_(&Tensor::from_slice(&w).view([1, 8]));
        lin.bs.as_ref().unwrap().shallow_clone().copy_(&Tensor::from_slice(&[0.05 * (rank + 1) as f32]));
    });
    lin
}

/// One step's loss over `pooled` examples (`[b, 8]`): the sum of squared errors over the
/// global batch size, so the sum over ranks is the global batch's loss. Returns the loss and
/// the pooled embeddings' gradient; the dense gradients are left in `vs`.
fn step(lin: &nn::Linear, pooled: &[f32], labels: &[f32]) -> (f64, Vec<f32>) {
    let b = labels.len() as i64;
    let x = Tensor::from_slice(pooled).view([b, 8]).set_requires_grad(true);
    let y = Tensor::from_slice(labels).view([b, 1]);
    let loss = (lin.forward(&x) - y).square().sum(Kind::Float) / TOTAL as f64;
    loss.backward();
    let g = Vec::<f32>::try_from(x.grad().contiguous().view([-1])).unwrap();
    (loss.double_value(&[]), g)
}

fn sgd(vs: &nn::VarStore) {
    tch::no_grad(|| {
        for mut p in vs.trainable_variables() {
            let g = p.grad();
            p -= g * LR;
            let _ = p.grad().zero_();
        }
    });
}

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn two_ranks_under_dmp_train_like_one_process() {
    let opt = SparseOptimizerConfig::Adagrad { lr: 0.2, eps: 1e-8 };
    // The reference: one process, the global batch.
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let lin = dense(&vs, 0);
    let mut ebc = EmbeddingBagCollection::new(tables(), opt.clone(), 4).unwrap();
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let (k, y) = batch(s, 0..TOTAL);
        let pooled = ebc.forward(&k).unwrap().values().to_vec();
        let (loss, g) = step(&lin, &pooled, &y);
        ebc.backward_and_update(&k, &g).unwrap();
        sgd(&vs);
        losses.push(loss);
    }
    let want_w = Vec::<f32>::try_from(lin.ws.contiguous().view([-1])).unwrap();
    let want_tables: Vec<Vec<f32>> = tables().iter().map(|t| ebc.table_weights(&t.name).unwrap()).collect();

    let plan = ShardingPlan::new()
        .with("t0", TableSharding::row_wise(20, 4, &[0, 1]))
        .with("t1", TableSharding::column_wise(10, 4, 2, &[1, 0]));
    let results = ThreadGroup::run(2, Duration::from_secs(60), |pg| {
        tch::set_num_threads(1);
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let r = pg.rank();
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let lin = dense(&vs, r);
        let ebc = EmbeddingBagCollection::new(tables(), opt.clone(), 4).unwrap();
        let modules = vec![("sparse".to_string(), Module::Bag(ebc)), ("over".to_string(), Module::Other(()))];
        // Tiny buckets: the weight and the bias travel separately.
        let mut dmp = DistributedModelParallel::new(modules, &plan, &vs, pg.clone(), Some(1e-5)).unwrap();
        assert_eq!(dmp.dense().num_buckets(), 2);
        let mine = if r == 0 { 0..5 } else { 5..TOTAL };
        let mut got_losses = Vec::new();
        for s in 0..STEPS {
            let (k, y) = batch(s, mine.clone());
            let Some(ShardedModule::Bag(sharded)) = dmp.module_mut("sparse") else { panic!("sparse is a bag module") };
            let (pooled, ctx) = sharded.forward(&k).unwrap();
            let (loss, g) = step(&lin, &pooled, &y);
            sharded.backward_and_update(ctx, &g).unwrap();
            got_losses.push(dmp.sync_gradients(loss).unwrap());
            sgd(&vs);
        }
        let Some(ShardedModule::Bag(sharded)) = dmp.module("sparse") else { panic!("sparse is a bag module") };
        let full: Vec<Vec<f32>> = tables().iter().map(|t| sharded.table_weights(&t.name).unwrap()).collect();
        let w = Vec::<f32>::try_from(lin.ws.contiguous().view([-1])).unwrap();
        (got_losses, w, full, dmp.named_state(&vs))
    });
    let mut states: Vec<Vec<StateEntry>> = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        let (got_losses, w, full, state) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (s, (a, b)) in got_losses.iter().zip(&losses).enumerate() {
            assert!((a - b).abs() < 1e-5, "rank {r} step {s}: loss {a} vs {b}");
        }
        close(&format!("rank {r}: dense weight"), &w, &want_w);
        for (t, (a, b)) in full.iter().zip(&want_tables).enumerate() {
            close(&format!("rank {r}: table {t}"), a, b);
        }
        states.push(state);
    }
    // Named state: the dense layer on both ranks, each rank's blocks of the tables.
    let names =
        |s: &[StateEntry]| s.iter().map(|e| (e.name.clone(), e.offset.clone(), e.local_shape.clone())).collect();
    let r0: Vec<(String, Vec<usize>, Vec<usize>)> = names(&states[0]);
    let r1: Vec<(String, Vec<usize>, Vec<usize>)> = names(&states[1]);
    let e = |n: &str, o: [usize; 2], l: [usize; 2]| (n.to_string(), o.to_vec(), l.to_vec());
    assert_eq!(
        r0,
        [
            ("dense.over.bias".to_string(), vec![0], vec![1]),
            e("dense.over.weight", [0, 0], [1, 8]),
            e("sparse.t0.weight", [0, 0], [10, 4]),
            e("sparse.t1.weight", [0, 2], [10, 2]),
        ]
    );
    assert_eq!(r1[2..], [e("sparse.t0.weight", [10, 0], [10, 4]), e("sparse.t1.weight", [0, 0], [10, 2])]);
    // Each shard's data is its block of the whole table.
    for st in &states {
        for entry in st.iter().filter(|e| e.name.starts_with("sparse.")) {
            let t = if entry.name == "sparse.t0.weight" { 0 } else { 1 };
            let block: Vec<f32> = (entry.offset[0]..entry.offset[0] + entry.local_shape[0])
                .flat_map(|row| want_tables[t][row * 4 + entry.offset[1]..][..entry.local_shape[1]].to_vec())
                .collect();
            close(&entry.name, &entry.data, &block);
        }
    }
}
