//! Tests of the embedding bag collection against hand-computed values and an independent
//! float64 reference (naive loops over the raw key-major KJT arrays).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{
    BoundsCheckMode, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingError, PoolingMode,
    PositionWeightedModule, SparseOptimizerConfig, WeightDecayMode, WeightPrecision,
};

fn table(name: &str, rows: u64, dim: usize, pooling: PoolingMode, features: &[&str]) -> EmbeddingBagConfig {
    EmbeddingBagConfig::new(name, rows, dim, pooling, features)
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
    assert_eq!(v[..3], row(&a, 3, 3)[..]);
    assert_eq!(v[3..6], row(&a, 3, 1)[..]);
    assert_eq!(v[6..8], [0.0, 0.0]);
    assert_eq!(v[8..10], row(&b, 2, 3)[..]);
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
        (vec![table("t", u64::MAX, 2, PoolingMode::Sum, &["f"])], SGD, "at most 4294967295 rows per table"),
        (vec![table("t", 1 << 31, 1 << 40, PoolingMode::Sum, &["f"])], SGD, "does not fit"),
        (
            vec![
                table("t", 4, 2, PoolingMode::Sum, &["f"])
                    .with_optimizer(SparseOptimizerConfig::Adagrad { lr: 0.1, eps: -1.0 }),
            ],
            SGD,
            "table \"t\": sparse optimizer eps",
        ),
        (
            vec![table("t", 4, 2, PoolingMode::Sum, &["f"])],
            SparseOptimizerConfig::Adam { lr: 0.1, eps: 1e-8, beta1: 1.0, beta2: 0.9, weight_decay: 0.0 },
            "beta1",
        ),
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
fn any_block_of_a_table_has_its_initial_weights_alone() {
    // Two tables in one group; the second crosses a seeded block boundary (16384 rows).
    let configs = vec![table("a", 30, 4, PoolingMode::Sum, &["x"]), table("b", 40_000, 3, PoolingMode::Sum, &["y"])];
    let ebc = EmbeddingBagCollection::new(configs, SGD, 9).unwrap();
    let full = ebc.table_weights("b").unwrap();
    for (rows, cols) in
        [(0..40_000u64, 0..3usize), (16_000..17_000, 0..3), (16_384..16_390, 1..3), (39_999..40_000, 2..3)]
    {
        let got = crate::initial_weights(9, 1, 40_000, 3, rows.clone(), cols.clone());
        let want: Vec<f32> = rows
            .clone()
            .flat_map(|r| cols.clone().map(move |c| (r as usize, c)))
            .map(|(r, c)| full[r * 3 + c])
            .collect();
        assert_eq!(got, want, "rows {rows:?} cols {cols:?}");
    }
    assert_eq!(crate::initial_weights(9, 0, 30, 4, 0..30, 0..4), ebc.table_weights("a").unwrap());
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
    spr: usize,
}

impl Reference {
    fn new(configs: &[EmbeddingBagConfig], ebc: &EmbeddingBagCollection) -> Self {
        let mut col = 0;
        let opt = ebc.optimizer();
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
                    state: vec![0.0; c.rows as usize * opt.state_per_row(c.dim)],
                    spr: opt.state_per_row(c.dim),
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

    fn step(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32], opt: &SparseOptimizerConfig, t_step: u64) {
        for t in &mut self.tables {
            let rows = t.w.len() / t.dim;
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
                let st = &mut t.state[r * t.spr..(r + 1) * t.spr];
                f64_update(opt, t_step, w, st, g);
            }
        }
    }
}

/// FBGEMM's update formulas, in float64, for one row at step `t`.
pub(crate) fn f64_update(opt: &SparseOptimizerConfig, t: u64, w: &mut [f64], st: &mut [f64], g: &[f64]) {
    let dim = w.len();
    let f = f64::from;
    match *opt {
        SparseOptimizerConfig::Sgd { lr } => {
            for d in 0..dim {
                w[d] -= f(lr) * g[d];
            }
        }
        SparseOptimizerConfig::Adagrad { lr, eps } => {
            for d in 0..dim {
                st[d] += g[d] * g[d];
                w[d] -= f(lr) * g[d] / (st[d].sqrt() + f(eps));
            }
        }
        SparseOptimizerConfig::RowwiseAdagrad { lr, eps, weight_decay, weight_decay_mode } => {
            let (lr, eps, wd) = (f(lr), f(eps), f(weight_decay));
            let eff: Vec<f64> = match weight_decay_mode {
                WeightDecayMode::L2 => (0..dim).map(|d| g[d] + wd * w[d]).collect(),
                _ => g.to_vec(),
            };
            st[0] += eff.iter().map(|x| x * x).sum::<f64>() / dim as f64;
            let m = lr / (st[0].sqrt() + eps);
            let decay = match weight_decay_mode {
                WeightDecayMode::Decoupled => 1.0 - lr * wd,
                WeightDecayMode::L2 => 1.0 - m * wd,
                WeightDecayMode::None => 1.0,
            };
            for d in 0..dim {
                // L2 enters the accumulator and `decay`; the step uses the plain gradient.
                w[d] = decay * w[d] - m * g[d];
            }
        }
        SparseOptimizerConfig::Adam { lr, eps, beta1, beta2, weight_decay } => {
            let (lr, eps, b1, b2, wd) = (f(lr), f(eps), f(beta1), f(beta2), f(weight_decay));
            let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
            for d in 0..dim {
                st[d] = b1 * st[d] + (1.0 - b1) * g[d];
                st[dim + d] = b2 * st[dim + d] + (1.0 - b2) * g[d] * g[d];
                w[d] -= lr * (st[d] / c1 / ((st[dim + d] / c2).sqrt() + eps) + wd * w[d]);
            }
        }
        SparseOptimizerConfig::PartialRowwiseAdam { lr, eps, beta1, beta2, weight_decay } => {
            let (lr, eps, b1, b2, wd) = (f(lr), f(eps), f(beta1), f(beta2), f(weight_decay));
            let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
            st[0] = b2 * st[0] + (1.0 - b2) * g.iter().map(|x| x * x).sum::<f64>() / dim as f64;
            let denom = (st[0] / c2).sqrt() + eps;
            for d in 0..dim {
                st[1 + d] = b1 * st[1 + d] + (1.0 - b1) * g[d];
                w[d] -= lr * (st[1 + d] / c1 / denom + wd * w[d]);
            }
        }
        SparseOptimizerConfig::Lamb { lr, eps, beta1, beta2, weight_decay } => {
            let (lr, eps, b1, b2, wd) = (f(lr), f(eps), f(beta1), f(beta2), f(weight_decay));
            let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
            let mut r = vec![0.0; dim];
            for d in 0..dim {
                st[d] = b1 * st[d] + (1.0 - b1) * g[d];
                st[dim + d] = b2 * st[dim + d] + (1.0 - b2) * g[d] * g[d];
                r[d] = st[d] / c1 / ((st[dim + d] / c2).sqrt() + eps) + wd * w[d];
            }
            let wn = w.iter().map(|x| x * x).sum::<f64>().sqrt();
            let rn = r.iter().map(|x| x * x).sum::<f64>().sqrt();
            let ratio = if wn > 0.0 && rn > 0.0 { wn / rn } else { 1.0 };
            for d in 0..dim {
                w[d] -= lr * ratio * r[d];
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
        reference.step(&input, &grad, &opt, step + 1);
        for (c, t) in configs.iter().zip(&reference.tables) {
            assert_close(&ebc.table_weights(&c.name).unwrap(), &t.w, &format!("{} weights, step {step}", c.name));
            assert_close(&ebc.optimizer_state(&c.name).unwrap(), &t.state, &format!("{} state", c.name));
        }
    }
    // Rows never in a batch are bit-identical to their init, and their state is still 0.
    let w = ebc.table_weights("big").unwrap();
    assert!(touched_big.iter().filter(|&&t| !t).count() > 900);
    for r in (0..1000).filter(|&r| !touched_big[r]) {
        assert_eq!(w[r * 2..r * 2 + 2], initial[2][r * 2..r * 2 + 2], "row {r} of big changed");
        let spr = opt.state_per_row(2);
        assert!(ebc.optimizer_state("big").unwrap()[r * spr..(r + 1) * spr].iter().all(|&s| s == 0.0));
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

fn adam_family() -> Vec<SparseOptimizerConfig> {
    let (lr, eps, beta1, beta2) = (0.02, 1e-8, 0.9, 0.999);
    let mut v = Vec::new();
    for weight_decay in [0.0, 0.05] {
        v.push(SparseOptimizerConfig::Adam { lr, eps, beta1, beta2, weight_decay });
        v.push(SparseOptimizerConfig::PartialRowwiseAdam { lr, eps, beta1, beta2, weight_decay });
        v.push(SparseOptimizerConfig::Lamb { lr, eps, beta1, beta2, weight_decay });
    }
    v
}

#[test]
fn adagrad_matches_f64_reference() {
    for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
        for weighted in [false, true] {
            check_against_reference(SparseOptimizerConfig::Adagrad { lr: 0.1, eps: 1e-8 }, pooling, weighted, 30);
        }
    }
}

#[test]
fn adam_partial_rowwise_adam_and_lamb_match_f64_reference() {
    for (i, opt) in adam_family().into_iter().enumerate() {
        for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
            check_against_reference(opt.clone(), pooling, i % 2 == 0, 40 + i as u64);
        }
    }
}

/// A batch big enough for the radix sort (3 passes over 2^22 rows would need more; this has
/// 2) and for several update jobs per table.
fn big_batch(seed: u64) -> (KeyedJaggedTensor, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let input = random_kjt(&mut rng, &["x", "y", "z"], &[3000, 3000, 70_000], 4096, true);
    let grad: Vec<f32> = (0..4096 * 24).map(|_| rng.random_range(-1.0..1.0)).collect();
    (input, grad)
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let configs = vec![
        table("a", 3000, 8, PoolingMode::Sum, &["x", "y"]),
        table("b", 70_000, 8, PoolingMode::Mean, &["z"]).with_precision(WeightPrecision::Bf16),
    ];
    let run = |threads: usize, opt: SparseOptimizerConfig| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut ebc = EmbeddingBagCollection::new(configs.clone(), opt, 5).unwrap();
            let mut outs = Vec::new();
            for step in 0..2 {
                let (input, grad) = big_batch(step);
                outs.push(ebc.forward(&input).unwrap().values().to_vec());
                ebc.backward_and_update(&input, &grad).unwrap();
            }
            (outs, ebc.table_weights("a").unwrap(), ebc.table_weights("b").unwrap(), ebc.optimizer_state("b"))
        })
    };
    for opt in [adagrad(0.1, 0.01, WeightDecayMode::L2), adam_family()[4].clone()] {
        assert_eq!(run(1, opt.clone()), run(4, opt), "1 vs 4 threads");
    }
}

#[test]
fn large_batch_matches_f64_reference() {
    // Many duplicates per row across 4096 bags: exercises the sort and the job split.
    let opt = adagrad(0.05, 0.0, WeightDecayMode::None);
    let configs =
        vec![table("a", 3000, 8, PoolingMode::Sum, &["x", "y"]), table("b", 70_000, 8, PoolingMode::Mean, &["z"])];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    pool.install(|| {
        let mut ebc = EmbeddingBagCollection::new(configs.clone(), opt.clone(), 1).unwrap();
        let mut reference = Reference::new(&configs, &ebc);
        let (input, grad) = big_batch(7);
        assert_close(ebc.forward(&input).unwrap().values(), &reference.forward(&input), "forward");
        ebc.backward_and_update(&input, &grad).unwrap();
        reference.step(&input, &grad, &opt, 1);
        for (c, t) in configs.iter().zip(&reference.tables) {
            assert_close(&ebc.table_weights(&c.name).unwrap(), &t.w, &c.name);
            assert_close(&ebc.optimizer_state(&c.name).unwrap(), &t.state, &c.name);
        }
    });
}

#[test]
fn radix_sort_is_stable_and_sorted() {
    use crate::tbe::{Occ, radix_sort_by_row};
    let mut rng = StdRng::seed_from_u64(3);
    for rows in [3u64, 2048, 1 << 22, u64::from(u32::MAX)] {
        let mut v: Vec<Occ> =
            (0..5000).map(|i| Occ { row: rng.random_range(0..rows) as u32, src: i, scale: 1.0 }).collect();
        let mut expected = v.clone();
        expected.sort_by_key(|o| o.row); // std's sort_by_key is stable
        radix_sort_by_row(&mut v, &mut Vec::new(), rows);
        assert_eq!(v, expected, "rows {rows}");
    }
}

// ---------------------------------------------------------------- precisions

#[test]
fn half_precision_tables_round_their_weights_and_track_fp32() {
    let opt = adagrad(0.05, 0.0, WeightDecayMode::None);
    for precision in [WeightPrecision::Fp16, WeightPrecision::Bf16] {
        for stochastic in [false, true] {
            let mut cfg = table("t", 200, 8, PoolingMode::Sum, &["x"]).with_precision(precision);
            cfg.stochastic_rounding = stochastic;
            let mut low = EmbeddingBagCollection::new(vec![cfg], opt.clone(), 3).unwrap();
            let mut full =
                EmbeddingBagCollection::new(vec![table("t", 200, 8, PoolingMode::Sum, &["x"])], opt.clone(), 3)
                    .unwrap();
            // Same start: the fp32 table takes the rounded init.
            let w0 = low.table_weights("t").unwrap();
            for &w in &w0 {
                let back = match precision {
                    WeightPrecision::Fp16 => half::f16::from_f32(w).to_f32(),
                    _ => half::bf16::from_f32(w).to_f32(),
                };
                assert_eq!(back, w, "stored weights are representable");
            }
            full.set_table_weights("t", w0.clone()).unwrap();
            let mut rng = StdRng::seed_from_u64(4);
            for _ in 0..5 {
                let input = random_kjt(&mut rng, &["x"], &[200], 32, false);
                let grad: Vec<f32> = (0..32 * 8).map(|_| rng.random_range(-1.0..1.0)).collect();
                let (a, b) = (low.forward(&input).unwrap(), full.forward(&input).unwrap());
                let ulp = if precision == WeightPrecision::Fp16 { 2f32.powi(-10) } else { 2f32.powi(-7) };
                for (x, y) in a.values().iter().zip(b.values()) {
                    assert!((x - y).abs() <= 5.0 * 6.0 * ulp * y.abs().max(0.1), "{precision:?}: {x} vs {y}");
                }
                low.backward_and_update(&input, &grad).unwrap();
                full.backward_and_update(&input, &grad).unwrap();
            }
            // State is fp32 and follows the fp32 run closely (it sees the same gradients).
            let (sa, sb) = (low.optimizer_state("t").unwrap(), full.optimizer_state("t").unwrap());
            assert_eq!(sa, sb, "row-wise Adagrad state depends only on gradients");
        }
    }
}

#[test]
fn stochastic_rounding_keeps_small_updates_that_nearest_rounding_loses() {
    // bf16 has 8 significant bits: an SGD step of 1e-4 on weights near 1 is below half an ulp
    // (2^-8), so round-to-nearest never moves the weight while stochastic rounding moves it by
    // the right amount on average.
    let steps = 200;
    let mut finals = Vec::new();
    for stochastic in [false, true] {
        let mut cfg = table("t", 64, 4, PoolingMode::Sum, &["x"]).with_precision(WeightPrecision::Bf16);
        cfg.stochastic_rounding = stochastic;
        let mut ebc = EmbeddingBagCollection::new(vec![cfg], SparseOptimizerConfig::Sgd { lr: 1e-4 }, 0).unwrap();
        ebc.set_table_weights("t", vec![1.0; 256]).unwrap();
        let input = kjt(&["x"], (0..64).collect(), None, vec![1; 64], 64);
        for _ in 0..steps {
            ebc.backward_and_update(&input, &[-1.0; 256]).unwrap();
        }
        let w = ebc.table_weights("t").unwrap();
        finals.push(w.iter().map(|&x| f64::from(x)).sum::<f64>() / 256.0);
    }
    assert_eq!(finals[0], 1.0, "nearest rounding loses every step");
    let expected = 1.0 + 1e-4 * steps as f64;
    assert!((finals[1] - expected).abs() < 0.002, "stochastic mean {} vs {expected}", finals[1]);
}

// ---------------------------------------------------------------- bounds checks

#[test]
fn bounds_check_warning_and_ignore_read_row_zero_and_count() {
    for mode in [BoundsCheckMode::Warning, BoundsCheckMode::Ignore] {
        let mut ebc = small(PoolingMode::Sum);
        ebc.set_bounds_check(mode);
        let input = kjt(&["f"], vec![1, 9, -3], None, vec![3], 1);
        let out = ebc.forward(&input).unwrap();
        // Rows 1 + 0 + 0 = [3, 4] + 2 * [1, 2].
        assert_eq!(out.values(), [5.0, 8.0]);
        ebc.backward_and_update(&input, &[1.0, 1.0]).unwrap();
        let w = ebc.table_weights("t").unwrap();
        assert_eq!(w[..4], [1.0 - 0.25, 2.0 - 0.25, 3.0 - 0.125, 4.0 - 0.125], "row 0 took both bad ids");
        let expected = if mode == BoundsCheckMode::Warning { 4 } else { 0 };
        assert_eq!(ebc.bounds_violations(), expected, "{mode:?} counted forward and backward");
    }
}

// ---------------------------------------------------------------- sequence and position weights

#[test]
fn sequence_collection_gathers_and_updates_per_id() {
    let configs = vec![table("a", 4, 2, PoolingMode::Sum, &["x"]), table("b", 3, 3, PoolingMode::Sum, &["y"])];
    let mut ec = EmbeddingCollection::new(configs, SGD, 0).unwrap();
    ec.set_table_weights("a", vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).unwrap();
    ec.set_table_weights("b", (0..9).map(|v| v as f32).collect()).unwrap();
    // x: [2, 0] [2]; y: [] [1]
    let input = kjt(&["x", "y"], vec![2, 0, 2, 1], None, vec![2, 1, 0, 1], 2);
    let out = ec.forward(&input).unwrap();
    assert_eq!(out.keys, ["x", "y"]);
    assert_eq!(out.dims, [2, 3]);
    assert_eq!(out.values[0], [5.0, 6.0, 1.0, 2.0, 5.0, 6.0]);
    assert_eq!(out.values[1], [3.0, 4.0, 5.0]);
    assert_eq!(out.lengths, [vec![2, 1], vec![0, 1]]);
    let grads = vec![vec![1.0, 0.0, 0.5, 0.5, 1.0, 2.0], vec![8.0, 8.0, 8.0]];
    ec.backward_and_update(&input, &grads).unwrap();
    // Row 2 of a got [1, 0] + [1, 2]; SGD lr 1/8.
    assert_eq!(ec.table_weights("a").unwrap(), [1.0 - 0.0625, 2.0 - 0.0625, 3.0, 4.0, 4.75, 5.75, 7.0, 8.0]);
    assert_eq!(ec.table_weights("b").unwrap(), [0.0, 1.0, 2.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0]);
    assert!(matches!(ec.backward_and_update(&input, &grads[..1]), Err(EmbeddingError::Shape(_))));
}

#[test]
fn a_reused_lookup_buffer_holds_the_new_batch_whatever_it_held() {
    let configs = vec![table("a", 4, 2, PoolingMode::Sum, &["x"]), table("b", 3, 3, PoolingMode::Sum, &["y"])];
    let ec = EmbeddingCollection::new(configs, SGD, 0).unwrap();
    let long = kjt(&["x", "y"], vec![3, 2, 1, 0, 2, 1, 0, 2], None, vec![3, 1, 2, 2], 2);
    let short = kjt(&["x", "y"], vec![1, 2], None, vec![1, 0, 0, 1], 2);
    let mut out = ec.forward(&long).unwrap();
    // Shorter, then longer again: the buffers shrink and grow with the batch.
    for input in [&short, &long, &short] {
        ec.forward_into(input, &mut out).unwrap();
        assert_eq!(out, ec.forward(input).unwrap());
    }
    assert_eq!(out.values[0].len(), 2);
}

#[test]
fn sequence_collection_ignores_id_weights_forward_and_backward() {
    let configs = || vec![table("a", 4, 2, PoolingMode::Sum, &["x"])];
    let plain = kjt(&["x"], vec![2, 0, 2], None, vec![2, 1], 2);
    let weighted = kjt(&["x"], vec![2, 0, 2], Some(vec![0.5, 3.0, 2.0]), vec![2, 1], 2);
    let grads = vec![vec![1.0, 0.0, 0.5, 0.5, 1.0, 2.0]];
    let mut runs = Vec::new();
    for input in [&plain, &weighted] {
        let mut ec = EmbeddingCollection::new(configs(), SGD, 0).unwrap();
        let out = ec.forward(input).unwrap();
        ec.backward_and_update(input, &grads).unwrap();
        runs.push((out, ec.table_weights("a").unwrap()));
    }
    assert_eq!(runs[0], runs[1]);
}

#[test]
fn position_weights_feed_a_weighted_ebc_and_get_gradients() {
    let mut pw = PositionWeightedModule::new(&[("f", 3)]).unwrap();
    pw.weights_mut("f").unwrap().copy_from_slice(&[1.0, 0.5, 0.25]);
    let input = kjt(&["f"], vec![0, 1, 2, 3], None, vec![3, 1], 2);
    let weighted = pw.apply(&input).unwrap();
    assert_eq!(weighted.weights().unwrap(), [1.0, 0.5, 0.25, 1.0]);
    let ebc = small(PoolingMode::Sum);
    let out = ebc.forward(&weighted).unwrap();
    // Bag 0: [1,2] + 0.5 [3,4] + 0.25 [5,6]; bag 1: [7, 8].
    assert_eq!(out.values(), [3.75, 5.5, 7.0, 8.0]);
    let grad = [1.0, 2.0, 0.5, 0.0];
    let per_id = ebc.per_id_weight_grads(&weighted, &grad).unwrap();
    // <grad of the bag, row of the id>: [1*1+2*2, 3+8, 5+12] and [0.5*7].
    assert_eq!(per_id[0], [5.0, 11.0, 17.0, 3.5]);
    let by_feature = [("f".to_string(), per_id[0].clone())].into_iter().collect();
    let g = pw.grads(&input, &by_feature).unwrap();
    assert_eq!(g["f"], [5.0 + 3.5, 11.0, 17.0]);
    let long = kjt(&["f"], vec![0, 1, 2, 3], None, vec![4, 0], 2);
    let err = pw.apply(&long).unwrap_err().to_string();
    assert!(err.contains("feature \"f\", bag 0 has 4 ids"), "{err}");
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

#[test]
fn reset_rows_reinitialises_weights_and_state_of_those_rows_only() {
    let configs = vec![table("a", 6, 3, PoolingMode::Sum, &["x"])];
    let mut ebc =
        EmbeddingBagCollection::new(configs, SparseOptimizerConfig::Adagrad { lr: 0.5, eps: 1e-8 }, 2).unwrap();
    let input = kjt(&["x"], vec![1, 4, 5], None, vec![3], 1);
    ebc.backward_and_update(&input, &[1.0, -1.0, 0.5]).unwrap();
    let (w, s) = (ebc.table_weights("a").unwrap(), ebc.optimizer_state("a").unwrap());
    ebc.reset_rows("a", &[4, 1], 77).unwrap();
    let (w2, s2) = (ebc.table_weights("a").unwrap(), ebc.optimizer_state("a").unwrap());
    let bound = 1.0 / 6f32.sqrt();
    for r in 0..6 {
        let (a, b) = (&w[r * 3..r * 3 + 3], &w2[r * 3..r * 3 + 3]);
        if r == 1 || r == 4 {
            assert_ne!(a, b, "row {r} is redrawn");
            assert!(b.iter().all(|x| x.abs() <= bound), "row {r}: {b:?} within the init bound");
            assert_eq!(&s2[r * 3..r * 3 + 3], &[0.0; 3], "row {r}'s accumulators are cleared");
        } else {
            assert_eq!(a, b, "row {r} untouched");
            assert_eq!(&s[r * 3..r * 3 + 3], &s2[r * 3..r * 3 + 3]);
        }
    }
    assert_ne!(&s[15..18], &[0.0; 3], "row 5 was trained and keeps its state");
    // The same key redraws the same values; other keys others.
    let mut again = ebc.table_weights("a").unwrap();
    ebc.reset_rows("a", &[4], 77).unwrap();
    assert_eq!(ebc.table_weights("a").unwrap(), again);
    ebc.reset_rows("a", &[4], 78).unwrap();
    again = ebc.table_weights("a").unwrap();
    assert_ne!(&again[12..15], &w2[12..15]);
    assert!(ebc.reset_rows("a", &[6], 1).unwrap_err().to_string().contains("has 6 rows, cannot reset row 6"));
}

#[test]
fn a_block_resets_to_its_part_of_the_whole_tables_row() {
    let sgd = SparseOptimizerConfig::Sgd { lr: 0.1 };
    let mut whole =
        EmbeddingBagCollection::new(vec![table("w", 6, 4, PoolingMode::Sum, &["x"])], sgd.clone(), 1).unwrap();
    whole.reset_rows("w", &[4], 9).unwrap();
    let mut part = EmbeddingBagCollection::new(vec![table("p", 3, 2, PoolingMode::Sum, &["x"])], sgd, 1).unwrap();
    let block = crate::RowBlock { row_offset: 3, cols: 2..4, full_dim: 4 };
    part.reset_block_rows("p", &[1], 9, &block, 6).unwrap();
    assert_eq!(&part.table_weights("p").unwrap()[2..4], &whole.table_weights("w").unwrap()[4 * 4 + 2..4 * 4 + 4]);
    let bad = crate::RowBlock { row_offset: 3, cols: 1..4, full_dim: 4 };
    assert!(part.reset_block_rows("p", &[1], 9, &bad, 6).is_err());
}
