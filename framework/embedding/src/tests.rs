//! Tests of the embedding bag collection against hand-computed values and an independent
//! float64 reference (naive loops over the raw key-major KJT arrays).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingError, PoolingMode, SparseOptimizerConfig, WeightDecayMode,
};

fn table(name: &str, rows: u64, dim: usize, pooling: PoolingMode, features: &[&str]) -> EmbeddingBagConfig {
    EmbeddingBagConfig {
        name: name.into(),
        rows,
        dim,
        pooling,
        features: features.iter().map(|f| f.to_string()).collect(),
    }
}

fn kjt(
    keys: &[&str],
    values: Vec<i64>,
    weights: Option<Vec<f32>>,
    lengths: Vec<u32>,
    stride: usize,
) -> KeyedJaggedTensor {
    KeyedJaggedTensor::new(keys.iter().map(|k| k.to_string()).collect(), values, weights, lengths, stride).unwrap()
}

const SGD: SparseOptimizerConfig = SparseOptimizerConfig::Sgd { lr: 0.125 };

fn adagrad(lr: f32, weight_decay: f32, weight_decay_mode: WeightDecayMode) -> SparseOptimizerConfig {
    SparseOptimizerConfig::RowwiseAdagrad { lr, eps: 1e-8, weight_decay, weight_decay_mode }
}

/// A 4 x 2 table with rows [1, 2], [3, 4], [5, 6], [7, 8].
fn small(pooling: PoolingMode) -> EmbeddingBagCollection {
    let mut ebc = EmbeddingBagCollection::new(vec![table("t", 4, 2, pooling, &["f"])], SGD, 0).unwrap();
    ebc.set_table_weights("t", vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).unwrap();
    ebc
}

// ---------------------------------------------------------------- forward

#[test]
fn forward_sum_mean_weighted_hand_computed() {
    // Three bags: [0, 2], [], [3, 3, 1].
    let input = kjt(&["f"], vec![0, 2, 3, 3, 1], None, vec![2, 0, 3], 3);
    let out = small(PoolingMode::Sum).forward(&input).unwrap();
    assert_eq!(out.keys(), ["f"]);
    assert_eq!(out.batch(), 3);
    assert_eq!(out.values(), [6.0, 8.0, 0.0, 0.0, 17.0, 20.0]);

    let out = small(PoolingMode::Mean).forward(&input).unwrap();
    // Like FBGEMM, the mean multiplies the sum by the reciprocal of the bag length.
    let third = 1.0f32 / 3.0;
    assert_eq!(out.values(), [3.0, 4.0, 0.0, 0.0, 17.0 * third, 20.0 * third]);

    // Weighted: 0.5 * row0 + 2 * row2 = [10.5, 13]; 1 * row3 + 0 * row3 + 0.25 * row1.
    let weighted = kjt(&["f"], vec![0, 2, 3, 3, 1], Some(vec![0.5, 2.0, 1.0, 0.0, 0.25]), vec![2, 0, 3], 3);
    let out = small(PoolingMode::Sum).forward(&weighted).unwrap();
    assert_eq!(out.values(), [10.5, 13.0, 0.0, 0.0, 7.75, 9.0]);
    let out = small(PoolingMode::Mean).forward(&weighted).unwrap();
    assert_eq!(out.values(), [5.25, 6.5, 0.0, 0.0, 7.75 * third, 9.0 * third]);
}

#[test]
fn empty_batch_and_empty_bags() {
    for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
        let ebc = small(pooling);
        let out = ebc.forward(&kjt(&["f"], vec![], None, vec![0, 0], 2)).unwrap();
        assert_eq!(out.values(), [0.0; 4]);
        let out = ebc.forward(&kjt(&["f"], vec![], None, vec![], 0)).unwrap();
        assert!(out.values().is_empty());
    }
    // A backward over empty bags changes nothing.
    let mut ebc = small(PoolingMode::Mean);
    let before = ebc.table_weights("t").unwrap().to_vec();
    ebc.backward_and_update(&kjt(&["f"], vec![], None, vec![0, 0], 2), &[1.0; 4]).unwrap();
    assert_eq!(ebc.table_weights("t").unwrap(), before);
}

#[test]
fn outputs_in_table_then_feature_order() {
    let ebc = EmbeddingBagCollection::new(
        vec![table("a", 10, 3, PoolingMode::Sum, &["x", "y"]), table("b", 5, 2, PoolingMode::Mean, &["z", "x@b"])],
        SGD,
        1,
    )
    .unwrap();
    assert_eq!(ebc.output_keys(), ["x", "y", "z", "x@b"]);
    assert_eq!(ebc.output_dims(), [3, 3, 2, 2]);
    assert_eq!(ebc.table_configs().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    // Input keys in another order than the outputs; "x@b" reads input feature "x".
    let input = kjt(&["z", "y", "x"], vec![4, 9, 1, 3], None, vec![1, 0, 1, 1, 0, 1], 2);
    let out = ebc.forward(&input).unwrap();
    assert_eq!(out.keys(), ["x", "y", "z", "x@b"]);
    let (a, b) = (ebc.table_weights("a").unwrap(), ebc.table_weights("b").unwrap());
    let row = |w: &[f32], dim: usize, id: usize| w[id * dim..(id + 1) * dim].to_vec();
    // Example 1: x = [3] in a and b, y = [1], z = [].
    let v = &out.values()[10..20];
    assert_eq!(v[..3], row(a, 3, 3)[..]);
    assert_eq!(v[3..6], row(a, 3, 1)[..]);
    assert_eq!(v[6..8], [0.0, 0.0]);
    assert_eq!(v[8..10], row(b, 2, 3)[..]);
}

#[test]
fn ids_out_of_range_are_errors() {
    let mut ebc = small(PoolingMode::Sum);
    let before = ebc.table_weights("t").unwrap().to_vec();
    for bad in [-1i64, 4] {
        // Bags: [0], [], [1, bad]: the bad id is in bag 2.
        let input = kjt(&["f"], vec![0, 1, bad], None, vec![1, 0, 2], 3);
        let expected =
            EmbeddingError::IdOutOfRange { table: "t".into(), feature: "f".into(), sample: 2, id: bad, rows: 4 };
        assert_eq!(ebc.forward(&input).unwrap_err(), expected);
        assert_eq!(ebc.backward_and_update(&input, &[1.0; 6]).unwrap_err(), expected);
        assert_eq!(ebc.table_weights("t").unwrap(), before, "a rejected batch changes nothing");
    }
    let msg = ebc.forward(&kjt(&["f"], vec![7], None, vec![1], 1)).unwrap_err().to_string();
    for part in ["id 7", "table \"t\"", "4 rows", "feature \"f\"", "bag 0"] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
}

#[test]
fn missing_feature_is_an_error() {
    let mut ebc = small(PoolingMode::Sum);
    let input = kjt(&["g", "h"], vec![0], None, vec![1, 0], 1);
    let err = ebc.forward(&input).unwrap_err();
    assert_eq!(
        err,
        EmbeddingError::MissingFeature { feature: "f".into(), table: "t".into(), available: "g, h".into() }
    );
    assert!(err.to_string().contains("no feature \"f\""));
    assert!(ebc.backward_and_update(&input, &[0.0; 2]).is_err());
}

#[test]
fn gradient_shape_is_checked() {
    let mut ebc = small(PoolingMode::Sum);
    let input = kjt(&["f"], vec![0, 1], None, vec![1, 1], 2);
    let err = ebc.backward_and_update(&input, &[1.0; 3]).unwrap_err();
    assert!(matches!(err, EmbeddingError::Shape(ref m) if m.contains("expected batch 2 x width 2")), "{err}");
}

#[test]
fn invalid_configs_are_errors() {
    let cases: Vec<(Vec<EmbeddingBagConfig>, SparseOptimizerConfig, &str)> = vec![
        (vec![table("t", 0, 4, PoolingMode::Sum, &["f"])], SGD, "rows > 0"),
        (vec![table("t", 4, 0, PoolingMode::Sum, &["f"])], SGD, "dim > 0"),
        (vec![table("t", 4, 2, PoolingMode::Sum, &[])], SGD, "no features"),
        (
            vec![table("t", 4, 2, PoolingMode::Sum, &["f"]), table("t", 4, 2, PoolingMode::Sum, &["g"])],
            SGD,
            "duplicate table name \"t\"",
        ),
        (
            vec![table("t", 4, 2, PoolingMode::Sum, &["f"]), table("u", 4, 2, PoolingMode::Sum, &["f"])],
            SGD,
            "feature \"f\" is in two tables",
        ),
        (vec![table("t", 4, 2, PoolingMode::Sum, &["f", "f"])], SGD, "feature \"f\" is in two tables"),
        (vec![table("t", u64::MAX, 2, PoolingMode::Sum, &["f"])], SGD, "does not fit"),
        (vec![table("t", 4, 2, PoolingMode::Sum, &["f"])], SparseOptimizerConfig::Sgd { lr: f32::NAN }, "lr"),
        (vec![table("t", 4, 2, PoolingMode::Sum, &["f"])], SparseOptimizerConfig::Sgd { lr: -1.0 }, "lr"),
        (
            vec![table("t", 4, 2, PoolingMode::Sum, &["f"])],
            SparseOptimizerConfig::RowwiseAdagrad {
                lr: 0.1,
                eps: 0.0,
                weight_decay: 0.0,
                weight_decay_mode: WeightDecayMode::None,
            },
            "eps",
        ),
        (vec![table("t", 4, 2, PoolingMode::Sum, &["f"])], adagrad(0.1, -0.5, WeightDecayMode::L2), "weight_decay"),
    ];
    for (tables, opt, needle) in cases {
        match EmbeddingBagCollection::new(tables, opt, 0) {
            Err(EmbeddingError::Config(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("accepted a config that should fail with {needle:?}"),
        }
    }
}

#[test]
fn init_is_uniform_in_torchrec_bounds_and_seeded() {
    let configs = || vec![table("a", 400, 16, PoolingMode::Sum, &["x"]), table("b", 25, 8, PoolingMode::Sum, &["y"])];
    let e1 = EmbeddingBagCollection::new(configs(), SGD, 42).unwrap();
    let e2 = EmbeddingBagCollection::new(configs(), SGD, 42).unwrap();
    let e3 = EmbeddingBagCollection::new(configs(), SGD, 43).unwrap();
    for (name, rows) in [("a", 400.0f64), ("b", 25.0)] {
        let w = e1.table_weights(name).unwrap();
        let bound = (1.0 / rows).sqrt() as f32;
        assert!(w.iter().all(|v| v.abs() <= bound));
        // Uniform on [-b, b]: mean ~ 0, max |w| close to b.
        let mean = w.iter().map(|&v| f64::from(v)).sum::<f64>() / w.len() as f64;
        assert!(mean.abs() < 0.1 * f64::from(bound), "mean {mean}");
        assert!(w.iter().fold(0.0f32, |m, v| m.max(v.abs())) > 0.9 * bound);
        assert_eq!(w, e2.table_weights(name).unwrap());
        assert_ne!(w, e3.table_weights(name).unwrap());
    }
    assert_ne!(e1.table_weights("a").unwrap()[..8], e1.table_weights("b").unwrap()[..8]);
    assert!(e1.optimizer_state("a").unwrap().is_empty(), "SGD keeps no state");
    let ada = EmbeddingBagCollection::new(configs(), adagrad(0.1, 0.0, WeightDecayMode::None), 42).unwrap();
    assert_eq!(ada.optimizer_state("a").unwrap(), [0.0; 400]);
    assert_eq!(ada.table_weights("a"), e1.table_weights("a"), "the optimizer does not change the init");
    assert!(ada.table_weights("nope").is_none() && ada.optimizer_state("nope").is_none());
}

#[test]
fn setters_check_table_and_size() {
    let mut ebc = EmbeddingBagCollection::new(
        vec![table("t", 3, 2, PoolingMode::Sum, &["f"])],
        adagrad(0.1, 0.0, WeightDecayMode::None),
        0,
    )
    .unwrap();
    assert!(matches!(ebc.set_table_weights("u", vec![0.0; 6]), Err(EmbeddingError::Config(_))));
    assert!(matches!(ebc.set_table_weights("t", vec![0.0; 5]), Err(EmbeddingError::Shape(_))));
    assert!(matches!(ebc.set_optimizer_state("t", vec![0.0; 6]), Err(EmbeddingError::Shape(_))));
    ebc.set_optimizer_state("t", vec![1.0, 2.0, 3.0]).unwrap();
    assert_eq!(ebc.optimizer_state("t").unwrap(), [1.0, 2.0, 3.0]);
    assert_eq!(ebc.optimizer(), &adagrad(0.1, 0.0, WeightDecayMode::None));
}

// ---------------------------------------------------------------- backward, hand-computed

#[test]
fn sgd_sums_duplicates_hand_computed() {
    // dim 1, rows [1, 1, 1]; bags [1, 1] and [1, 2] with bag gradients 0.5 and 2:
    // row 1 gets 0.5 + 0.5 + 2 = 3, row 2 gets 2, row 0 is untouched.
    let mut ebc = EmbeddingBagCollection::new(vec![table("t", 3, 1, PoolingMode::Sum, &["f"])], SGD, 0).unwrap();
    ebc.set_table_weights("t", vec![1.0; 3]).unwrap();
    ebc.backward_and_update(&kjt(&["f"], vec![1, 1, 1, 2], None, vec![2, 2], 2), &[0.5, 2.0]).unwrap();
    assert_eq!(ebc.table_weights("t").unwrap(), [1.0, 1.0 - 0.125 * 3.0, 1.0 - 0.125 * 2.0]);

    // Mean pooling divides by the bag length; per-id weights scale.
    let mut ebc = EmbeddingBagCollection::new(vec![table("t", 3, 1, PoolingMode::Mean, &["f"])], SGD, 0).unwrap();
    ebc.set_table_weights("t", vec![1.0; 3]).unwrap();
    let weighted = kjt(&["f"], vec![1, 1, 1, 2], Some(vec![1.0, 3.0, 2.0, 0.5]), vec![2, 2], 2);
    ebc.backward_and_update(&weighted, &[0.5, 2.0]).unwrap();
    // row 1: 0.5/2*1 + 0.5/2*3 + 2/2*2 = 3; row 2: 2/2*0.5 = 0.5.
    assert_eq!(ebc.table_weights("t").unwrap(), [1.0, 1.0 - 0.125 * 3.0, 1.0 - 0.125 * 0.5]);
}

#[test]
fn adagrad_updates_each_unique_row_once() {
    // Row 0 twice in one bag with bag gradient [1, 3]: g = [2, 6], mean(g^2) = 20.
    // Applied per occurrence instead, the accumulator would hold 5 + 5 = 10 (or 5 + 25).
    let mut ebc = EmbeddingBagCollection::new(
        vec![table("t", 2, 2, PoolingMode::Sum, &["f"])],
        adagrad(0.5, 0.0, WeightDecayMode::None),
        0,
    )
    .unwrap();
    ebc.set_table_weights("t", vec![1.0, 1.0, 1.0, 1.0]).unwrap();
    ebc.backward_and_update(&kjt(&["f"], vec![0, 0], None, vec![2], 1), &[1.0, 3.0]).unwrap();
    assert_eq!(ebc.optimizer_state("t").unwrap(), [20.0, 0.0]);
    let m = 0.5 / (20f64.sqrt() + 1e-8);
    let w = ebc.table_weights("t").unwrap();
    assert!((f64::from(w[0]) - (1.0 - m * 2.0)).abs() < 1e-6);
    assert!((f64::from(w[1]) - (1.0 - m * 6.0)).abs() < 1e-6);
    assert_eq!(w[2..], [1.0, 1.0], "row 1 untouched");
}

#[test]
fn weight_decay_modes_hand_computed() {
    // One row, dim 1: w = 1, g = 2, lr = 0.1, wd = 0.5.
    let run = |mode| {
        let mut ebc =
            EmbeddingBagCollection::new(vec![table("t", 1, 1, PoolingMode::Sum, &["f"])], adagrad(0.1, 0.5, mode), 0)
                .unwrap();
        ebc.set_table_weights("t", vec![1.0]).unwrap();
        ebc.backward_and_update(&kjt(&["f"], vec![0], None, vec![1], 1), &[2.0]).unwrap();
        (f64::from(ebc.table_weights("t").unwrap()[0]), f64::from(ebc.optimizer_state("t").unwrap()[0]))
    };
    // none: s = 4, m = 0.05, w = 1 - 0.1 = 0.9.
    let (w, s) = run(WeightDecayMode::None);
    assert!((s - 4.0).abs() < 1e-6 && (w - 0.9).abs() < 1e-6, "{w} {s}");
    // l2: g' = 2 + 0.5 * 1 = 2.5, s = 6.25, m = 0.04, w = 1 - 0.04 * 2.5 = 0.9.
    let (w, s) = run(WeightDecayMode::L2);
    assert!((s - 6.25).abs() < 1e-6 && (w - 0.9).abs() < 1e-6, "{w} {s}");
    // decoupled: s = 4, m = 0.05, w = (1 - 0.1 * 0.5) * 1 - 0.05 * 2 = 0.85.
    let (w, s) = run(WeightDecayMode::Decoupled);
    assert!((s - 4.0).abs() < 1e-6 && (w - 0.85).abs() < 1e-6, "{w} {s}");
}

#[test]
fn a_row_in_the_batch_with_zero_gradient_is_still_updated() {
    // FBGEMM visits every row present in the batch: with decoupled decay a zero-weight id
    // still decays (its accumulator gains 0); a row absent from the batch does not.
    let mut ebc = EmbeddingBagCollection::new(
        vec![table("t", 2, 1, PoolingMode::Sum, &["f"])],
        adagrad(0.1, 0.5, WeightDecayMode::Decoupled),
        0,
    )
    .unwrap();
    ebc.set_table_weights("t", vec![1.0, 1.0]).unwrap();
    ebc.backward_and_update(&kjt(&["f"], vec![0], Some(vec![0.0]), vec![1], 1), &[2.0]).unwrap();
    assert_eq!(ebc.optimizer_state("t").unwrap(), [0.0, 0.0]);
    assert_eq!(ebc.table_weights("t").unwrap(), [0.95, 1.0]);
}

// ---------------------------------------------------------------- float64 reference

/// An independent float64 model of the collection: raw arrays and naive loops.
struct Reference {
    tables: Vec<RefTable>,
    width: usize,
}

struct RefTable {
    dim: usize,
    mean: bool,
    /// (input feature, first output column)
    features: Vec<(String, usize)>,
    w: Vec<f64>,
    state: Vec<f64>,
}

impl Reference {
    fn new(configs: &[EmbeddingBagConfig], ebc: &EmbeddingBagCollection) -> Self {
        let mut col = 0;
        let tables = configs
            .iter()
            .map(|c| {
                let features = c
                    .features
                    .iter()
                    .map(|f| {
                        let input = f.split('@').next().unwrap().to_string();
                        col += c.dim;
                        (input, col - c.dim)
                    })
                    .collect();
                RefTable {
                    dim: c.dim,
                    mean: c.pooling == PoolingMode::Mean,
                    features,
                    w: ebc.table_weights(&c.name).unwrap().iter().map(|&v| f64::from(v)).collect(),
                    state: vec![0.0; c.rows as usize],
                }
            })
            .collect();
        Self { tables, width: col }
    }

    /// `(ids, per-id weights)` of bag `b` of `feature`, from the raw key-major arrays.
    fn bag(kjt: &KeyedJaggedTensor, feature: &str, b: usize) -> (Vec<i64>, Vec<f64>) {
        let k = kjt.keys().iter().position(|key| key == feature).unwrap();
        let bag = k * kjt.stride() + b;
        let start: usize = kjt.lengths()[..bag].iter().map(|&l| l as usize).sum();
        let end = start + kjt.lengths()[bag] as usize;
        let ids = kjt.values()[start..end].to_vec();
        let weights = match kjt.weights() {
            Some(w) => w[start..end].iter().map(|&v| f64::from(v)).collect(),
            None => vec![1.0; end - start],
        };
        (ids, weights)
    }

    fn forward(&self, kjt: &KeyedJaggedTensor) -> Vec<f64> {
        let mut out = vec![0.0; kjt.stride() * self.width];
        for t in &self.tables {
            for (feature, col) in &t.features {
                for b in 0..kjt.stride() {
                    let (ids, weights) = Self::bag(kjt, feature, b);
                    let scale = if t.mean && !ids.is_empty() { 1.0 / ids.len() as f64 } else { 1.0 };
                    for (id, w) in ids.iter().zip(&weights) {
                        for d in 0..t.dim {
                            out[b * self.width + col + d] += scale * w * t.w[*id as usize * t.dim + d];
                        }
                    }
                }
            }
        }
        out
    }

    fn step(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32], opt: &SparseOptimizerConfig) {
        for t in &mut self.tables {
            let rows = t.state.len();
            let mut g = vec![0.0f64; rows * t.dim];
            let mut touched = vec![false; rows];
            for (feature, col) in &t.features {
                for b in 0..kjt.stride() {
                    let (ids, weights) = Self::bag(kjt, feature, b);
                    let scale = if t.mean && !ids.is_empty() { 1.0 / ids.len() as f64 } else { 1.0 };
                    for (id, w) in ids.iter().zip(&weights) {
                        let id = *id as usize;
                        touched[id] = true;
                        for d in 0..t.dim {
                            g[id * t.dim + d] += scale * w * f64::from(grad[b * self.width + col + d]);
                        }
                    }
                }
            }
            for r in (0..rows).filter(|&r| touched[r]) {
                let w = &mut t.w[r * t.dim..(r + 1) * t.dim];
                let g = &g[r * t.dim..(r + 1) * t.dim];
                match *opt {
                    SparseOptimizerConfig::Sgd { lr } => {
                        for d in 0..t.dim {
                            w[d] -= f64::from(lr) * g[d];
                        }
                    }
                    SparseOptimizerConfig::RowwiseAdagrad { lr, eps, weight_decay, weight_decay_mode } => {
                        let (lr, eps, wd) = (f64::from(lr), f64::from(eps), f64::from(weight_decay));
                        let eff: Vec<f64> = match weight_decay_mode {
                            WeightDecayMode::L2 => (0..t.dim).map(|d| g[d] + wd * w[d]).collect(),
                            _ => g.to_vec(),
                        };
                        t.state[r] += eff.iter().map(|x| x * x).sum::<f64>() / t.dim as f64;
                        let m = lr / (t.state[r].sqrt() + eps);
                        let decay = if weight_decay_mode == WeightDecayMode::Decoupled { 1.0 - lr * wd } else { 1.0 };
                        for d in 0..t.dim {
                            w[d] = decay * w[d] - m * eff[d];
                        }
                    }
                }
            }
        }
    }
}

fn assert_close(actual: &[f32], expected: &[f64], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        assert!((f64::from(a) - e).abs() <= 2e-5 * e.abs().max(1.0), "{what}[{i}]: {a} vs {e}");
    }
}

/// A random batch over `keys` with ids in `0..rows` (small, so duplicates abound).
fn random_kjt(rng: &mut StdRng, keys: &[&str], rows: &[u64], batch: usize, weighted: bool) -> KeyedJaggedTensor {
    let (mut values, mut weights, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    for &r in rows {
        for _ in 0..batch {
            let len = rng.random_range(0..=5u32);
            lengths.push(len);
            for _ in 0..len {
                values.push(rng.random_range(0..r as i64));
                weights.push(rng.random_range(0.0..2.0f32));
            }
        }
    }
    kjt(keys, values, weighted.then_some(weights), lengths, batch)
}

fn check_against_reference(opt: SparseOptimizerConfig, pooling: PoolingMode, weighted: bool, seed: u64) {
    // "a" is shared by features x and y (duplicates across features); "b" reads x again.
    let configs = vec![
        table("a", 7, 4, pooling, &["x", "y"]),
        table("b", 5, 3, pooling, &["z", "x@b"]),
        table("big", 1000, 2, pooling, &["w"]),
    ];
    let mut ebc = EmbeddingBagCollection::new(configs.clone(), opt.clone(), seed).unwrap();
    let mut reference = Reference::new(&configs, &ebc);
    let initial: Vec<Vec<f32>> = configs.iter().map(|c| ebc.table_weights(&c.name).unwrap().to_vec()).collect();
    let mut touched_big = vec![false; 1000];
    let mut rng = StdRng::seed_from_u64(seed);
    let keys = ["x", "y", "z", "w"];
    for step in 0..4 {
        let batch = 6;
        let input = random_kjt(&mut rng, &keys, &[5, 7, 5, 1000], batch, weighted);
        for b in 0..batch {
            for id in Reference::bag(&input, "w", b).0 {
                touched_big[id as usize] = true;
            }
        }
        let out = ebc.forward(&input).unwrap();
        assert_close(out.values(), &reference.forward(&input), &format!("forward step {step}"));
        let grad: Vec<f32> = (0..batch * reference.width).map(|_| rng.random_range(-1.0..1.0)).collect();
        ebc.backward_and_update(&input, &grad).unwrap();
        reference.step(&input, &grad, &opt);
        for (c, t) in configs.iter().zip(&reference.tables) {
            assert_close(ebc.table_weights(&c.name).unwrap(), &t.w, &format!("{} weights, step {step}", c.name));
            if opt.state_per_row() == 1 {
                assert_close(ebc.optimizer_state(&c.name).unwrap(), &t.state, &format!("{} state", c.name));
            }
        }
    }
    // Rows never in a batch are bit-identical to their init, and their state is still 0.
    let w = ebc.table_weights("big").unwrap();
    assert!(touched_big.iter().filter(|&&t| !t).count() > 900);
    for r in (0..1000).filter(|&r| !touched_big[r]) {
        assert_eq!(w[r * 2..r * 2 + 2], initial[2][r * 2..r * 2 + 2], "row {r} of big changed");
        if opt.state_per_row() == 1 {
            assert_eq!(ebc.optimizer_state("big").unwrap()[r], 0.0);
        }
    }
}

#[test]
fn sgd_matches_f64_reference() {
    for (i, pooling) in [PoolingMode::Sum, PoolingMode::Mean].into_iter().enumerate() {
        for weighted in [false, true] {
            check_against_reference(SparseOptimizerConfig::Sgd { lr: 0.3 }, pooling, weighted, 10 + i as u64);
        }
    }
}

#[test]
fn rowwise_adagrad_matches_f64_reference() {
    let modes = [(0.0, WeightDecayMode::None), (0.01, WeightDecayMode::L2), (0.01, WeightDecayMode::Decoupled)];
    for (i, (wd, mode)) in modes.into_iter().enumerate() {
        for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
            for weighted in [false, true] {
                check_against_reference(adagrad(0.05, wd, mode), pooling, weighted, 20 + i as u64);
            }
        }
    }
}

#[test]
fn updates_are_deterministic() {
    let configs = vec![table("a", 50, 8, PoolingMode::Sum, &["x", "y"]), table("b", 30, 4, PoolingMode::Mean, &["z"])];
    let opt = adagrad(0.1, 0.01, WeightDecayMode::L2);
    let run = || {
        let mut ebc = EmbeddingBagCollection::new(configs.clone(), opt.clone(), 5).unwrap();
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..3 {
            let input = random_kjt(&mut rng, &["x", "y", "z"], &[50, 50, 30], 64, true);
            let grad: Vec<f32> = (0..64 * 20).map(|_| rng.random_range(-1.0..1.0)).collect();
            ebc.backward_and_update(&input, &grad).unwrap();
        }
        (ebc.table_weights("a").unwrap().to_vec(), ebc.optimizer_state("b").unwrap().to_vec())
    };
    assert_eq!(run(), run());
}

// ---------------------------------------------------------------- config vocabulary

#[test]
fn optimizer_config_serde_defaults_and_errors() {
    let opt: SparseOptimizerConfig = serde_json::from_str(r#"{"kind": "rowwise_adagrad", "lr": 0.01}"#).unwrap();
    assert_eq!(opt, adagrad(0.01, 0.0, WeightDecayMode::None));
    assert_eq!(opt.lr(), 0.01);
    let opt: SparseOptimizerConfig = serde_json::from_str(
        r#"{"kind": "rowwise_adagrad", "lr": 0.01, "eps": 0.001, "weight_decay": 0.1, "weight_decay_mode": "decoupled"}"#,
    )
    .unwrap();
    assert_eq!(
        opt,
        SparseOptimizerConfig::RowwiseAdagrad {
            lr: 0.01,
            eps: 0.001,
            weight_decay: 0.1,
            weight_decay_mode: WeightDecayMode::Decoupled
        }
    );
    let sgd: SparseOptimizerConfig = serde_json::from_str(r#"{"kind": "sgd", "lr": 0.5}"#).unwrap();
    assert_eq!(sgd, SparseOptimizerConfig::Sgd { lr: 0.5 });
    assert_eq!(serde_json::to_string(&sgd).unwrap(), r#"{"kind":"sgd","lr":0.5}"#);
    for bad in [
        r#"{"kind": "sgd", "lr": 0.5, "eps": 1.0}"#,
        r#"{"kind": "adamw", "lr": 0.5}"#,
        r#"{"kind": "rowwise_adagrad"}"#,
        r#"{"kind": "rowwise_adagrad", "lr": 0.1, "weight_decay_mode": "l1"}"#,
    ] {
        assert!(serde_json::from_str::<SparseOptimizerConfig>(bad).is_err(), "accepted {bad}");
    }
    let pooling: PoolingMode = serde_json::from_str(r#""mean""#).unwrap();
    assert_eq!(pooling, PoolingMode::Mean);
    let schema = serde_json::to_string(&schemars::schema_for!(SparseOptimizerConfig)).unwrap();
    // The defaults reach the schema (and so the recipe reference) from `defaults`.
    for needle in [
        "rowwise_adagrad",
        "weight_decay_mode",
        "decoupled",
        "Learning rate.",
        r#""default":0.0"#,
        r#""default":"none""#,
    ] {
        assert!(schema.contains(needle), "schema lacks {needle}");
    }
}
