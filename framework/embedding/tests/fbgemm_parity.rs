//! Parity with FBGEMM's CPU table-batched embedding (the kernel behind TorchRec's fused EBC):
//! replays the fixtures `fixtures/gen_fbgemm.py` generated with fbgemm_gpu (see its docstring
//! for the command) and compares pooled outputs, updated weights and optimizer state after
//! every step. fp32 must agree within 1e-6 relative. fp16 must agree within fp16 rounding of
//! the operands: FBGEMM's CPU SGD and Adagrad write `w -= delta` on `at::Half`, which rounds
//! `delta` to fp16 before the subtraction, while trainrec rounds `w - delta` once; under
//! cancellation the two differ by an ulp of `delta` or of the old weight, not of the result.
//! Such one-ulp-of-an-operand differences can add up over steps, so fp16 weights after step
//! `s` (0-based) are compared within `s + 1` ulps of the largest operand the weight has seen
//! (its values and its steps `new - old` so far); pooled outputs within `s + 1` ulps of the bag's magnitude (at
//! most 4 ids of |w| <= 1 here, so of 4.0).

use serde_json::Value;
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, WeightPrecision,
};
use trainrec_sparse::KeyedJaggedTensor;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

/// One fp16 ulp at magnitude `x` (normal range).
fn f16_ulp(x: f32) -> f32 {
    let e = x.abs().max(2f32.powi(-14)).log2().floor();
    2f32.powf(e - 10.0)
}

struct Errors {
    worst_rel: f64,
    worst_ulps: f64,
}

/// `magnitude[i]`: the size of the operands behind element `i`, for fp16 ulps.
fn check(
    what: &str,
    actual: &[f32],
    expected: &[f32],
    (fp16, step): (bool, usize),
    magnitude: &dyn Fn(usize) -> f32,
    errors: &mut Errors,
) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let diff = (f64::from(a) - f64::from(e)).abs();
        if fp16 {
            let ulps = diff / f64::from(f16_ulp(e.abs().max(magnitude(i))));
            errors.worst_ulps = errors.worst_ulps.max(ulps);
            assert!(ulps <= (step + 1) as f64, "{what}[{i}]: {a} vs FBGEMM {e} ({ulps:.2} fp16 ulps)");
        } else {
            let tolerance = 1e-6 * f64::from(e.abs()) + 1e-7;
            errors.worst_rel = errors.worst_rel.max(diff / tolerance);
            assert!(diff <= tolerance, "{what}[{i}]: {a} vs FBGEMM {e} (diff {diff:e})");
        }
    }
}

#[test]
fn matches_fbgemm_cpu_tbe_fixtures() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/fbgemm_tbe.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture file")).expect("json");
    let cases = doc["cases"].as_object().expect("cases");
    // 5 optimizer settings x (sum: fp32, fp16, each plain and weighted; mean: fp32, fp16), and
    // 3 cases of FBGEMM's gradient clipping.
    assert_eq!(cases.len(), 33, "every optimizer x pooling x precision case is present");
    let mut errors = Errors { worst_rel: 0.0, worst_ulps: 0.0 };
    for (name, case) in cases {
        if !case["max_gradient"].is_null() {
            // Gradient clipping is the train step's (before any engine's backward): trainrec-engine's
            // `inputs::tests::clipping_before_the_fused_update_matches_fbgemm` replays these.
            continue;
        }
        let optimizer: SparseOptimizerConfig = serde_json::from_value(case["optimizer"].clone()).expect(name);
        let decays =
            matches!(optimizer, SparseOptimizerConfig::RowwiseAdagrad { weight_decay, .. } if weight_decay > 0.0);
        let pooling = if case["pooling"] == "mean" { PoolingMode::Mean } else { PoolingMode::Sum };
        let fp16 = case["precision"] == "fp16";
        let precision = if fp16 { WeightPrecision::Fp16 } else { WeightPrecision::Fp32 };
        let features: Vec<(String, String)> = case["features"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f[0].as_str().unwrap().to_string(), f[1].as_str().unwrap().to_string()))
            .collect();
        let tables: Vec<EmbeddingBagConfig> = case["tables"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let tname = t["name"].as_str().unwrap();
                let feats: Vec<&str> = features.iter().filter(|(_, tb)| tb == tname).map(|(f, _)| f.as_str()).collect();
                let mut c = EmbeddingBagConfig::new(
                    tname,
                    t["rows"].as_u64().unwrap(),
                    t["dim"].as_u64().unwrap() as usize,
                    pooling,
                    &feats,
                )
                .with_precision(precision);
                c.stochastic_rounding = false;
                c
            })
            .collect();
        let names: Vec<String> = tables.iter().map(|t| t.name.clone()).collect();
        let mut ebc = EmbeddingBagCollection::new(tables, optimizer, 0).expect(name);
        // Per weight: the largest operand seen so far (for fp16 ulps).
        let mut scales = std::collections::HashMap::new();
        for (t, init) in names.iter().zip(case["init"].as_array().unwrap()) {
            ebc.set_table_weights(t, floats(init)).unwrap();
            scales.insert(t.as_str(), floats(init).iter().map(|x| x.abs()).collect::<Vec<f32>>());
        }
        let keys: Vec<String> = features.iter().map(|(f, _)| f.clone()).collect();
        let batch = case["batch"].as_u64().unwrap() as usize;
        for (s, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let values: Vec<i64> = step["values"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
            let lengths: Vec<u32> =
                step["lengths"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let weights = (!step["weights"].is_null()).then(|| floats(&step["weights"]));
            let kjt = KeyedJaggedTensor::new(keys.clone(), values, weights, lengths, batch).unwrap();
            let out = ebc.forward(&kjt).unwrap();
            let bag = |_: usize| 4.0f32;
            check(
                &format!("{name} step {s} output"),
                out.values(),
                &floats(&step["output"]),
                (fp16, s),
                &bag,
                &mut errors,
            );
            let before: Vec<Vec<f32>> = names.iter().map(|t| ebc.table_weights(t).unwrap()).collect();
            ebc.backward_and_update(&kjt, &floats(&step["grad"])).unwrap();
            let after = step["tables_after"].as_array().unwrap().iter().zip(step["states_after"].as_array().unwrap());
            for ((t, (w, st)), old) in names.iter().zip(after).zip(&before) {
                if decays && features.iter().filter(|(_, tb)| tb == t).count() < 2 {
                    // FBGEMM's CPU kernel skips weight decay on single-feature tables (see the
                    // generator): take its values and leave this table to the f64 oracle.
                    ebc.set_table_weights(t, floats(w)).unwrap();
                    ebc.set_optimizer_state(t, floats(st)).unwrap();
                    continue;
                }
                let what = format!("{name} step {s} table {t}");
                let w = floats(w);
                let seen = scales.get_mut(&**t).unwrap();
                for (i, m) in seen.iter_mut().enumerate() {
                    *m = m.max(old[i].abs()).max((w[i] - old[i]).abs());
                }
                let seen = &*seen;
                let largest = |i: usize| seen[i];
                check(&format!("{what} weights"), &ebc.table_weights(t).unwrap(), &w, (fp16, s), &largest, &mut errors);
                // Optimizer state is fp32 in both, whatever the weight precision.
                let none = |_: usize| 0.0f32;
                check(
                    &format!("{what} state"),
                    &ebc.optimizer_state(t).unwrap(),
                    &floats(st),
                    (false, s),
                    &none,
                    &mut errors,
                );
            }
        }
    }
    println!(
        "worst fp32 error: {:.3} of the tolerance (1e-6 relative + 1e-7); worst fp16 error {:.2} ulps",
        errors.worst_rel, errors.worst_ulps
    );
}
