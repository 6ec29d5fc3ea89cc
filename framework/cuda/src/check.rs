//! The kernels' correctness cases, shared by the emulator's tests and the GPU check
//! (`trainrec device-check`): every fused optimizer over every weight precision, on three
//! small tables (dims 8, 40 and 70; one table read by two features) with duplicate ids, empty
//! bags and out-of-range ids, for [`STEPS`] steps against the CPU collection.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use trainrec_embedding::{
    BoundsCheckMode, EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, WeightDecayMode,
    WeightPrecision,
};
use trainrec_sparse::KeyedJaggedTensor;

use crate::CudaError;

/// Steps of each case.
pub const STEPS: usize = 3;

/// Examples per batch.
pub const BATCH: usize = 13;

/// The input features, in KJT key order, and their tables' rows.
pub const FEATURES: [(&str, u64); 4] = [("fa", 11), ("fb", 30), ("fc", 30), ("fd", 17)];

/// One correctness case.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// The fused optimizer.
    pub optimizer: SparseOptimizerConfig,
    /// Stored precision of the weights.
    pub precision: WeightPrecision,
    /// Mean pooling (tables a and b; c sums).
    pub mean: bool,
    /// Per-id weights in the input.
    pub weighted: bool,
    /// Stochastic rounding of 16-bit weights.
    pub stochastic: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} {:?} mean={} weighted={} stochastic={}",
            self.optimizer, self.precision, self.mean, self.weighted, self.stochastic
        )
    }
}

/// Every fused optimizer (row-wise Adagrad in its three weight-decay modes).
pub fn optimizers() -> Vec<SparseOptimizerConfig> {
    use SparseOptimizerConfig as O;
    vec![
        O::Sgd { lr: 0.3 },
        O::Adagrad { lr: 0.2, eps: 1e-6 },
        O::RowwiseAdagrad { lr: 0.2, eps: 1e-8, weight_decay: 0.0, weight_decay_mode: WeightDecayMode::None },
        O::RowwiseAdagrad { lr: 0.2, eps: 1e-8, weight_decay: 0.05, weight_decay_mode: WeightDecayMode::L2 },
        O::RowwiseAdagrad { lr: 0.2, eps: 1e-8, weight_decay: 0.05, weight_decay_mode: WeightDecayMode::Decoupled },
        O::Adam { lr: 0.05, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.01 },
        O::PartialRowwiseAdam { lr: 0.05, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.01 },
        O::Lamb { lr: 0.05, eps: 1e-6, beta1: 0.9, beta2: 0.999, weight_decay: 0.01 },
    ]
}

/// Every optimizer x precision, pooling, weighting and rounding varied across them.
pub fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (oi, optimizer) in optimizers().into_iter().enumerate() {
        for (pi, precision) in
            [WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16].into_iter().enumerate()
        {
            out.push(Case {
                optimizer: optimizer.clone(),
                precision,
                mean: (oi + pi) % 2 == 0,
                weighted: (oi + pi) % 3 != 0,
                stochastic: precision != WeightPrecision::Fp32 && oi % 2 == 0,
            });
        }
    }
    out
}

/// The case's CPU collection: tables a (11 x 8), b (30 x 40, features fb and fc), c (17 x 70,
/// sum pooled); bounds check `ignore` (out-of-range ids read row 0).
pub fn collection(case: &Case) -> EmbeddingBagCollection {
    let pooling = if case.mean { PoolingMode::Mean } else { PoolingMode::Sum };
    let mut tables = vec![
        EmbeddingBagConfig::new("a", 11, 8, pooling, &["fa"]),
        EmbeddingBagConfig::new("b", 30, 40, pooling, &["fb", "fc"]),
        EmbeddingBagConfig::new("c", 17, 70, PoolingMode::Sum, &["fd"]),
    ];
    for t in &mut tables {
        t.precision = case.precision;
        t.stochastic_rounding = case.stochastic;
    }
    let mut ebc = EmbeddingBagCollection::new(tables, case.optimizer.clone(), 7).expect("the check's tables are valid");
    ebc.set_bounds_check(BoundsCheckMode::Ignore);
    ebc
}

/// Step `step`'s batch: 0 to 5 ids per bag, mostly among each table's first 9 rows
/// (duplicates within and across bags); at the last step two ids out of range.
pub fn batch(rng: &mut StdRng, weighted: bool, step: usize) -> KeyedJaggedTensor {
    let mut values = Vec::new();
    let mut lengths = Vec::new();
    for (_, rows) in FEATURES {
        let hot = rows.min(9);
        for _ in 0..BATCH {
            let len = rng.random_range(0..6u32);
            lengths.push(len);
            for _ in 0..len {
                values.push(
                    if rng.random_bool(0.7) { rng.random_range(0..hot) } else { rng.random_range(0..rows) } as i64
                );
            }
        }
    }
    if step + 1 == STEPS {
        values.iter_mut().take(2).for_each(|v| *v = 99);
    }
    let weights = weighted.then(|| values.iter().map(|_| rng.random_range(-1.5f32..2.0)).collect());
    KeyedJaggedTensor::new(FEATURES.iter().map(|f| f.0.to_string()).collect(), values, weights, lengths, BATCH)
        .expect("the check's batches are well formed")
}

/// A step's upstream gradient for `kjt`'s output (`width` floats per example).
pub fn gradient(rng: &mut StdRng, kjt: &KeyedJaggedTensor, width: usize) -> Vec<f32> {
    (0..kjt.stride() * width).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Largest `|a - b|` and whether all are bit-identical.
fn compare(a: &[f32], b: &[f32]) -> (f64, bool) {
    let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let max = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max);
    (max, same)
}

/// Runs every case on GPU `device` and on the CPU collection: per case the largest
/// difference of the pooled forward outputs (and sequence lookups of table c after each
/// update), weights and optimizer states over the steps, and whether they were bit-identical.
pub fn run_on_gpu(device: usize) -> Result<Value, CudaError> {
    run_with(|cpu| crate::CudaEbc::from_cpu(cpu, device))
}

/// [`run_on_gpu`] with the collections `make` builds from each case's CPU collection (e.g.
/// [`crate::CudaEbc::emulated`]).
pub fn run_with(
    make: impl Fn(&EmbeddingBagCollection) -> Result<crate::CudaEbc, CudaError>,
) -> Result<Value, CudaError> {
    let mut rows = Vec::new();
    let mut identical = 0;
    let all = cases();
    for (i, case) in all.iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(11 + i as u64);
        let mut cpu = collection(case);
        let mut gpu = make(&cpu)?;
        gpu.set_bounds_check(BoundsCheckMode::Ignore);
        let (mut fwd, mut w, mut st, mut same) = (0f64, 0f64, 0f64, true);
        for step in 0..STEPS {
            let kjt = batch(&mut rng, case.weighted, step);
            let want = cpu.forward(&kjt)?;
            let out = gpu.forward(&kjt)?;
            let got = gpu.download(&out)?;
            let (d, s) = compare(&got[..want.values().len()], want.values());
            fwd = fwd.max(d);
            same &= s;
            let grad = gradient(&mut rng, &kjt, cpu.width());
            let dev_grad = gpu.upload(&grad)?;
            cpu.backward_and_update(&kjt, &grad)?;
            gpu.backward_and_update(&kjt, &dev_grad)?;
            // Sequence lookups of the updated tables: each row as the CPU collection holds it.
            let ids: Vec<i64> = kjt.values().iter().map(|&v| if (0..17).contains(&v) { v } else { 0 }).collect();
            let rows = gpu.download(&gpu.lookup_rows("c", &ids)?)?;
            let c = cpu.table_weights("c").unwrap_or_default();
            let want: Vec<f32> = ids.iter().flat_map(|&i| c[i as usize * 70..][..70].iter().copied()).collect();
            let (d, s) = compare(&rows, &want);
            fwd = fwd.max(d);
            same &= s;
            for t in ["a", "b", "c"] {
                let (d, s) = compare(&gpu.table_weights(t)?, &cpu.table_weights(t).unwrap_or_default());
                w = w.max(d);
                same &= s;
                let (d, s) = compare(&gpu.optimizer_state(t)?, &cpu.optimizer_state(t).unwrap_or_default());
                st = st.max(d);
                same &= s && cpu.step_count(t) == Some(gpu.step_count(t)?);
            }
        }
        identical += usize::from(same);
        rows.push(json!({
            "case": case.to_string(),
            "forward_max_abs_diff": fwd,
            "weights_max_abs_diff": w,
            "state_max_abs_diff": st,
            "bit_identical": same,
        }));
    }
    Ok(json!({"cases": rows, "bit_identical": identical, "total": all.len(), "steps": STEPS}))
}
