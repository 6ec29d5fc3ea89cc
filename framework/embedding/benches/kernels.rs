//! Criterion microbenchmarks of the embedding kernels: pooled forward, fused backward + update
//! per optimizer, sequence gather, and fp16/bf16 storage. `cargo bench -p trainrec-embedding`.
//! (The W1 end-to-end figure and its FBGEMM comparison are `trainrec bench ebc` and
//! `scripts/bench-w1`.)

// criterion_group!/criterion_main! generate undocumented functions.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, PoolingMode, SparseOptimizerConfig,
    WeightDecayMode, WeightPrecision,
};
use trainrec_sparse::KeyedJaggedTensor;

const TABLES: usize = 4;
const ROWS: u64 = 200_000;
const DIM: usize = 64;
const BATCH: usize = 1024;
const POOL: usize = 20;

fn configs(precision: WeightPrecision) -> Vec<EmbeddingBagConfig> {
    (0..TABLES)
        .map(|t| {
            EmbeddingBagConfig::new(format!("t{t}"), ROWS, DIM, PoolingMode::Sum, &[&format!("f{t}")])
                .with_precision(precision)
        })
        .collect()
}

fn batch(seed: u64) -> KeyedJaggedTensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let values = (0..TABLES * BATCH * POOL).map(|_| rng.random_range(0..ROWS as i64)).collect();
    let keys = (0..TABLES).map(|t| format!("f{t}")).collect();
    KeyedJaggedTensor::new(keys, values, None, vec![POOL as u32; TABLES * BATCH], BATCH).unwrap()
}

fn rowwise() -> SparseOptimizerConfig {
    SparseOptimizerConfig::RowwiseAdagrad {
        lr: 0.01,
        eps: 1e-8,
        weight_decay: 0.0,
        weight_decay_mode: WeightDecayMode::None,
    }
}

fn forward(c: &mut Criterion) {
    let mut g = c.benchmark_group("pooled_forward");
    g.throughput(Throughput::Elements((TABLES * BATCH * POOL) as u64));
    let input = batch(1);
    for precision in [WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16] {
        let ebc = EmbeddingBagCollection::new(configs(precision), rowwise(), 0).unwrap();
        g.bench_function(BenchmarkId::from_parameter(format!("{precision:?}")), |b| {
            b.iter(|| ebc.forward(&input).unwrap())
        });
    }
    g.finish();
}

fn backward(c: &mut Criterion) {
    let mut g = c.benchmark_group("fused_backward_update");
    g.throughput(Throughput::Elements((TABLES * BATCH * POOL) as u64));
    let input = batch(2);
    let mut rng = StdRng::seed_from_u64(3);
    let grad: Vec<f32> = (0..BATCH * TABLES * DIM).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (lr, eps, beta1, beta2, weight_decay) = (0.01, 1e-8, 0.9, 0.999, 0.0);
    let optimizers = [
        SparseOptimizerConfig::Sgd { lr },
        SparseOptimizerConfig::Adagrad { lr, eps },
        rowwise(),
        SparseOptimizerConfig::Adam { lr, eps, beta1, beta2, weight_decay },
        SparseOptimizerConfig::PartialRowwiseAdam { lr, eps, beta1, beta2, weight_decay },
        SparseOptimizerConfig::Lamb { lr, eps, beta1, beta2, weight_decay },
    ];
    for opt in optimizers {
        let mut ebc = EmbeddingBagCollection::new(configs(WeightPrecision::Fp32), opt.clone(), 0).unwrap();
        g.bench_function(BenchmarkId::from_parameter(opt.kind()), |b| {
            b.iter(|| ebc.backward_and_update(&input, &grad).unwrap())
        });
    }
    let mut ebc = EmbeddingBagCollection::new(configs(WeightPrecision::Bf16), rowwise(), 0).unwrap();
    g.bench_function(BenchmarkId::from_parameter("rowwise_adagrad_bf16_stochastic"), |b| {
        b.iter(|| ebc.backward_and_update(&input, &grad).unwrap())
    });
    g.finish();
}

fn sequence(c: &mut Criterion) {
    let mut g = c.benchmark_group("sequence_gather");
    g.throughput(Throughput::Elements((TABLES * BATCH * POOL) as u64));
    let input = batch(4);
    let ec = EmbeddingCollection::new(configs(WeightPrecision::Fp32), rowwise(), 0).unwrap();
    g.bench_function("fp32", |b| b.iter(|| ec.forward(&input).unwrap()));
    g.finish();
}

criterion_group! {
    name = kernels;
    config = Criterion::default().sample_size(20);
    targets = forward, backward, sequence
}
criterion_main!(kernels);
