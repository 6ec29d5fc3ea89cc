//! The fused lookup and update against an independent float64 reference: naive per-sample
//! loops building a dense gradient per table, then the optimizer formulas in f64.

use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingError, PoolingMode, SparseOptimizerConfig, WeightDecayMode,
};
use trainrec_sparse::KeyedJaggedTensor;

fn table(name: &str, rows: u64, dim: usize, pooling: PoolingMode, features: &[&str]) -> EmbeddingBagConfig {
    EmbeddingBagConfig::new(name, rows, dim, pooling, features)
}

/// Batch of 3: `a` and `b` both read table t0 (as a@t0, b); `c` reads t1 (mean pooling).
/// Duplicates within a bag, across bags, and across the two features sharing t0.
fn input(weighted: bool) -> KeyedJaggedTensor {
    let keys = vec!["a".to_string(), "b".into(), "c".into()];
    // a: [0,0,2] [1] []      b: [2] [0,3] [2]      c: [1,1] [] [0,2,1]
    let values = vec![0, 0, 2, 1, 2, 0, 3, 2, 1, 1, 0, 2, 1];
    let lengths = vec![3, 1, 0, 1, 2, 1, 2, 0, 3];
    let weights = weighted.then(|| (0..13).map(|i| 0.5 + 0.1 * i as f32).collect());
    KeyedJaggedTensor::new(keys, values, weights, lengths, 3).unwrap()
}

fn configs() -> Vec<EmbeddingBagConfig> {
    vec![table("t0", 5, 3, PoolingMode::Sum, &["a@t0", "b"]), table("t1", 4, 2, PoolingMode::Mean, &["c"])]
}

/// f64 forward: (outputs [batch][width]).
fn ref_forward(ebc: &EmbeddingBagCollection, kjt: &KeyedJaggedTensor) -> Vec<Vec<f64>> {
    let cfgs = configs();
    let mut out = vec![Vec::new(); kjt.stride()];
    for (b, row) in out.iter_mut().enumerate() {
        for t in &cfgs {
            let w = ebc.table_weights(&t.name).unwrap();
            for f in &t.features {
                let input = f.split('@').next().unwrap();
                let view = kjt.feature(kjt.key_index(input).unwrap());
                let ids = view.bag(b);
                let mut acc = vec![0f64; t.dim];
                for (i, &id) in ids.iter().enumerate() {
                    let wt = view.bag_weights(b).map_or(1.0, |w| w[i] as f64);
                    for d in 0..t.dim {
                        acc[d] += wt * w[id as usize * t.dim + d] as f64;
                    }
                }
                if t.pooling == PoolingMode::Mean && !ids.is_empty() {
                    acc.iter_mut().for_each(|x| *x /= ids.len() as f64);
                }
                row.extend(acc);
            }
        }
    }
    out
}

/// f64 dense gradient per table and the set of touched rows.
fn ref_grads(kjt: &KeyedJaggedTensor, grad: &[f32]) -> Vec<(Vec<f64>, Vec<bool>)> {
    let cfgs = configs();
    let width: usize = cfgs.iter().map(|t| t.dim * t.features.len()).sum();
    let mut col = 0;
    let mut res = Vec::new();
    for t in &cfgs {
        let mut g = vec![0f64; t.rows as usize * t.dim];
        let mut touched = vec![false; t.rows as usize];
        for f in &t.features {
            let view = kjt.feature(kjt.key_index(f.split('@').next().unwrap()).unwrap());
            for b in 0..kjt.stride() {
                let ids = view.bag(b);
                for (i, &id) in ids.iter().enumerate() {
                    let mut s = view.bag_weights(b).map_or(1.0, |w| w[i] as f64);
                    if t.pooling == PoolingMode::Mean {
                        s /= ids.len() as f64;
                    }
                    touched[id as usize] = true;
                    for d in 0..t.dim {
                        g[id as usize * t.dim + d] += s * grad[b * width + col + d] as f64;
                    }
                }
            }
            col += t.dim;
        }
        res.push((g, touched));
    }
    res
}

fn grad_output(batch: usize, width: usize, step: usize) -> Vec<f32> {
    (0..batch * width).map(|i| ((i * 7 + step * 3) % 11) as f32 / 10.0 - 0.5).collect()
}

fn close(a: f64, b: f32, what: &str) {
    assert!((a - b as f64).abs() <= 1e-5 * (1.0 + a.abs()), "{what}: reference {a} vs {b}");
}

#[test]
fn forward_matches_reference_sum_mean_weighted() {
    for weighted in [false, true] {
        let ebc = EmbeddingBagCollection::new(configs(), SparseOptimizerConfig::Sgd { lr: 0.1 }, 1).unwrap();
        let kjt = input(weighted);
        let out = ebc.forward(&kjt).unwrap();
        assert_eq!(out.keys(), &["a@t0".to_string(), "b".into(), "c".into()]);
        assert_eq!(out.length_per_key(), &[3, 3, 2]);
        let want = ref_forward(&ebc, &kjt);
        for (b, row) in want.iter().enumerate() {
            for (j, &x) in row.iter().enumerate() {
                close(x, out.values()[b * 8 + j], "forward");
            }
        }
        // a's third bag and c's second bag are empty: zeros.
        assert!(out.values()[2 * 8..2 * 8 + 3].iter().all(|&x| x == 0.0));
        assert!(out.values()[8 + 6..8 + 8].iter().all(|&x| x == 0.0));
    }
}

fn run_steps(optimizer: SparseOptimizerConfig, weighted: bool, steps: usize) {
    let mut ebc = EmbeddingBagCollection::new(configs(), optimizer.clone(), 9).unwrap();
    let kjt = input(weighted);
    let cfgs = configs();
    let mut w64: Vec<Vec<f64>> =
        cfgs.iter().map(|t| ebc.table_weights(&t.name).unwrap().iter().map(|&x| x as f64).collect()).collect();
    let mut s64: Vec<Vec<f64>> = cfgs.iter().map(|t| vec![0.0; t.rows as usize]).collect();
    let before: Vec<Vec<f32>> = cfgs.iter().map(|t| ebc.table_weights(&t.name).unwrap().to_vec()).collect();
    for step in 0..steps {
        let grad = grad_output(3, 8, step);
        ebc.backward_and_update(&kjt, &grad).unwrap();
        for (t, (g, touched)) in ref_grads(&kjt, &grad).into_iter().enumerate() {
            let dim = cfgs[t].dim;
            for r in 0..cfgs[t].rows as usize {
                if !touched[r] {
                    continue;
                }
                let row = &mut w64[t][r * dim..(r + 1) * dim];
                let mut gr: Vec<f64> = g[r * dim..(r + 1) * dim].to_vec();
                match optimizer {
                    SparseOptimizerConfig::Sgd { lr } => row.iter_mut().zip(&gr).for_each(|(w, g)| *w -= lr as f64 * g),
                    SparseOptimizerConfig::RowwiseAdagrad { lr, eps, weight_decay, weight_decay_mode } => {
                        let (lr, eps, wd) = (lr as f64, eps as f64, weight_decay as f64);
                        if weight_decay_mode == WeightDecayMode::L2 {
                            gr.iter_mut().zip(row.iter()).for_each(|(g, w)| *g += wd * w);
                        }
                        s64[t][r] += gr.iter().map(|g| g * g).sum::<f64>() / dim as f64;
                        let m = lr / (s64[t][r].sqrt() + eps);
                        // Decoupled decay scales by the base learning rate, not the adaptive one (FBGEMM).
                        let c = if weight_decay_mode == WeightDecayMode::Decoupled { 1.0 - lr * wd } else { 1.0 };
                        row.iter_mut().zip(&gr).for_each(|(w, g)| *w = c * *w - m * g);
                    }
                    other => panic!("this oracle covers sgd and rowwise_adagrad (src/tests.rs covers {other:?})"),
                }
            }
        }
    }
    for (t, cfg) in cfgs.iter().enumerate() {
        let got = ebc.table_weights(&cfg.name).unwrap();
        for (i, (&want, g)) in w64[t].iter().zip(got).enumerate() {
            close(want, g, &format!("{optimizer:?} table {} weight {i}", cfg.name));
        }
        if let SparseOptimizerConfig::RowwiseAdagrad { .. } = optimizer {
            for (r, (&want, g)) in s64[t].iter().zip(ebc.optimizer_state(&cfg.name).unwrap()).enumerate() {
                close(want, g, &format!("state row {r}"));
            }
        }
    }
    // Row 4 of t0 and row 3 of t1 are never looked up: bit-identical.
    assert_eq!(&ebc.table_weights("t0").unwrap()[12..15], &before[0][12..15]);
    assert_eq!(&ebc.table_weights("t1").unwrap()[6..8], &before[1][6..8]);
}

#[test]
fn sgd_matches_reference() {
    run_steps(SparseOptimizerConfig::Sgd { lr: 0.3 }, false, 3);
    run_steps(SparseOptimizerConfig::Sgd { lr: 0.3 }, true, 2);
}

#[test]
fn rowwise_adagrad_matches_reference_in_every_weight_decay_mode() {
    for mode in [WeightDecayMode::None, WeightDecayMode::L2, WeightDecayMode::Decoupled] {
        let opt =
            SparseOptimizerConfig::RowwiseAdagrad { lr: 0.2, eps: 1e-8, weight_decay: 0.05, weight_decay_mode: mode };
        run_steps(opt.clone(), false, 4);
        run_steps(opt, true, 2);
    }
}

#[test]
fn a_hand_computed_rowwise_adagrad_step() {
    // One table, one row used twice in one bag: g = 2 * grad_out.
    let mut ebc = EmbeddingBagCollection::new(
        vec![table("t", 2, 2, PoolingMode::Sum, &["f"])],
        SparseOptimizerConfig::RowwiseAdagrad {
            lr: 1.0,
            // eps must be > 0 (a row with a zero accumulator would divide by zero).
            eps: 1e-8,
            weight_decay: 0.0,
            weight_decay_mode: WeightDecayMode::None,
        },
        0,
    )
    .unwrap();
    ebc.set_table_weights("t", vec![1.0, 2.0, 5.0, 5.0]).unwrap();
    let kjt = KeyedJaggedTensor::new(vec!["f".into()], vec![0, 0], None, vec![2], 1).unwrap();
    let out = ebc.forward(&kjt).unwrap();
    assert_eq!(out.values(), &[2.0, 4.0]);
    ebc.backward_and_update(&kjt, &[0.5, 1.5]).unwrap();
    // g = [1, 3]; state = (1 + 9) / 2 = 5; w -= g / sqrt(5).
    let s5 = 5f32.sqrt();
    assert_eq!(ebc.optimizer_state("t").unwrap(), &[5.0, 0.0]);
    let w = ebc.table_weights("t").unwrap();
    assert!((w[0] - (1.0 - 1.0 / s5)).abs() < 1e-6 && (w[1] - (2.0 - 3.0 / s5)).abs() < 1e-6);
    assert_eq!(&w[2..], &[5.0, 5.0]);
}

#[test]
fn errors_name_table_feature_and_id() {
    let mut ebc = EmbeddingBagCollection::new(configs(), SparseOptimizerConfig::Sgd { lr: 0.1 }, 0).unwrap();
    let bad = KeyedJaggedTensor::new(
        vec!["a".into(), "b".into(), "c".into()],
        vec![0, 9, 1],
        None,
        vec![1, 0, 1, 0, 1, 0],
        2,
    )
    .unwrap();
    let err = ebc.forward(&bad).unwrap_err();
    assert_eq!(
        err,
        EmbeddingError::IdOutOfRange { table: "t0".into(), feature: "b".into(), sample: 0, id: 9, rows: 5 }
    );
    assert!(err.to_string().contains("id 9 out of range for table \"t0\""));
    let missing = KeyedJaggedTensor::new(vec!["a".into()], vec![], None, vec![0], 1).unwrap();
    assert!(matches!(ebc.forward(&missing), Err(EmbeddingError::MissingFeature { .. })));
    assert!(matches!(ebc.backward_and_update(&input(false), &[0.0; 3]), Err(EmbeddingError::Shape(_))));
    let dup = vec![table("x", 2, 2, PoolingMode::Sum, &["f"]), table("y", 2, 2, PoolingMode::Sum, &["f"])];
    assert!(EmbeddingBagCollection::new(dup, SparseOptimizerConfig::Sgd { lr: 0.1 }, 0).is_err());
}
