//! Dense gradient clipping against TorchRec's `GradientClippingOptimizer` (norm with p = 2, 1
//! and inf, and value clipping): the gradients of `fixtures/grad_clipping.json` (written by
//! `scripts/anchors/grad_clipping_fixture.py` with TorchRec 1.9.2) clip to TorchRec's, bit for
//! bit, and the total norm is TorchRec's.

use tch::{Kind, Tensor, nn};
use trainrec_models::DenseOptimizer;
use trainrec_types::{DenseClipping, DenseOptimizerConfig};

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn clipped_gradients_equal_torchrecs() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/grad_clipping.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let norm_type = match &case["norm_type"] {
            serde_json::Value::String(s) if s == "inf" => f64::INFINITY,
            v => v.as_f64().unwrap(),
        };
        let clipping: DenseClipping = serde_json::from_value(serde_json::json!({
            "kind": case["kind"], "max_gradient": case["max_gradient"], "norm_type": norm_type.min(f64::MAX),
        }))
        .unwrap();
        let clipping = DenseClipping { norm_type, ..clipping };
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let shapes: Vec<Vec<i64>> = case["shapes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect())
            .collect();
        let params: Vec<Tensor> =
            shapes.iter().enumerate().map(|(i, s)| vs.root().zeros(&format!("p{i}"), s)).collect();
        // Gradients exactly the fixture's: d/dp sum(p * g) = g.
        let grads: Vec<Tensor> = case["grads"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&shapes)
            .map(|(g, s)| Tensor::from_slice(&floats(g)).view(s.as_slice()))
            .collect();
        let loss =
            params.iter().zip(&grads).map(|(p, g)| (p * g).sum(Kind::Float)).fold(Tensor::from(0f32), |a, b| a + b);
        loss.backward();
        let mut opt =
            DenseOptimizer::new(&vs, &DenseOptimizerConfig::Sgd { lr: 0.0, momentum: 0.0, weight_decay: 0.0 }).unwrap();
        let total = opt.clip_gradients(&clipping);
        match case["total_norm"].as_f64() {
            Some(want) => assert_eq!(total.map(|t| t as f32), Some(want as f32), "{name}: total norm"),
            None => assert_eq!(total, None, "{name}"),
        }
        for (i, (p, want)) in params.iter().zip(case["clipped"].as_array().unwrap()).enumerate() {
            let got: Vec<f32> = Vec::try_from(p.grad().flatten(0, -1)).unwrap();
            let want = floats(want);
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same && got.len() == want.len(), "{name}, gradient {i}: {got:?} against TorchRec's {want:?}");
        }
    }
}
