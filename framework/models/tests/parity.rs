//! Parity with TorchRec: DLRM-DCN against `torchrec.models.dlrm.DLRM_DCN` and DeepFM against
//! `torchrec.models.deepfm.SimpleDeepFMNN`, on fixtures TorchRec computed (logits and the
//! gradients of their sum with respect to the dense features and the pooled embeddings).
//!
//! Regenerate the fixtures (from the repository root, with the TorchRec anchor venv):
//!
//! ```text
//! ~/.cache/trainrec-anchors/venv/bin/python framework/models/tests/fixtures/gen_models.py
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;
use tch::{Device, Tensor, nn};
use trainrec_models::{DeepFmFactory, DlrmDcnFactory, ModelFactory, ModelInputs};
use trainrec_types::KeyPath;

const TOLERANCE: f64 = 1e-5;

#[derive(Deserialize)]
struct Array {
    shape: Vec<i64>,
    values: Vec<f32>,
}

impl Array {
    fn tensor(&self) -> Tensor {
        Tensor::from_slice(&self.values).view(self.shape.as_slice())
    }
}

#[derive(Deserialize)]
struct Fixture {
    config: serde_json::Value,
    num_dense: usize,
    dims: Vec<usize>,
    num_tasks: usize,
    params: BTreeMap<String, Array>,
    dense: Array,
    sparse: Array,
    logits: Array,
    grad_dense: Array,
    grad_sparse: Array,
    probabilities: Option<Array>,
}

fn load(text: &str) -> Fixture {
    serde_json::from_str(text).expect("fixture parses")
}

fn assert_close(what: &str, got: &Tensor, want: &Array) {
    assert_eq!(got.size(), want.shape, "{what}: shape");
    let got: Vec<f32> = Vec::try_from(got.reshape([-1])).expect("f32 values");
    for (i, (g, w)) in got.iter().zip(&want.values).enumerate() {
        assert!((f64::from(*g) - f64::from(*w)).abs() <= TOLERANCE, "{what}[{i}]: got {g}, TorchRec {w}");
    }
}

/// Builds the model from the fixture's config, copies TorchRec's parameters into it (ours ←
/// TorchRec's, by `names`), and checks logits and input gradients.
fn check_parity(factory: &dyn ModelFactory, fx: &Fixture, names: &[(&str, &str)]) -> Tensor {
    let inputs = ModelInputs {
        num_dense: fx.num_dense,
        sparse: fx.dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
        sparse_dim_keys: (0..fx.dims.len()).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
        num_tasks: fx.num_tasks,
        sequences: Vec::new(),
    };
    assert!(factory.check(&fx.config, &inputs).is_empty(), "fixture config passes check");
    let vs = nn::VarStore::new(Device::Cpu);
    let model = factory.build(&vs.root(), &fx.config, &inputs).map_err(|e| format!("{e:?}")).unwrap();

    let vars = vs.variables();
    let mut ours: Vec<&str> = vars.keys().map(String::as_str).collect();
    ours.sort_unstable();
    let mut mapped: Vec<&str> = names.iter().map(|(o, _)| *o).collect();
    mapped.sort_unstable();
    assert_eq!(ours, mapped, "every variable of ours is mapped");
    let mut theirs: Vec<&str> = names.iter().map(|(_, t)| *t).collect();
    theirs.sort_unstable();
    assert_eq!(theirs, fx.params.keys().map(String::as_str).collect::<Vec<_>>(), "every TorchRec parameter is used");
    for (our, their) in names {
        let src = fx.params[*their].tensor();
        let var = &vars[*our];
        assert_eq!(var.size(), src.size(), "{our} vs {their}: shape");
        tch::no_grad(|| var.shallow_clone().copy_(&src));
    }

    let dense = fx.dense.tensor().set_requires_grad(true);
    let sparse = fx.sparse.tensor().set_requires_grad(true);
    let logits = model.forward(&dense, &sparse, true);
    assert_close("logits", &logits, &fx.logits);
    logits.sum(tch::Kind::Float).backward();
    assert_close("grad_sparse", &sparse.grad(), &fx.grad_sparse);
    assert_close("grad_dense", &dense.grad(), &fx.grad_dense);
    // The fixture must exercise the gradient, not a dead ReLU.
    assert!(sparse.grad().abs().sum(tch::Kind::Float).double_value(&[]) > 0.1);
    logits.detach()
}

#[test]
fn dlrm_dcn_matches_torchrec() {
    let fx = load(include_str!("fixtures/dlrm_dcn.json"));
    let names = [
        ("dense_arch.layer0.weight", "dense_arch.model._mlp.0._linear.weight"),
        ("dense_arch.layer0.bias", "dense_arch.model._mlp.0._linear.bias"),
        ("dense_arch.layer1.weight", "dense_arch.model._mlp.1._linear.weight"),
        ("dense_arch.layer1.bias", "dense_arch.model._mlp.1._linear.bias"),
        ("crossnet.w0", "inter_arch.crossnet.W_kernels.0"),
        ("crossnet.v0", "inter_arch.crossnet.V_kernels.0"),
        ("crossnet.b0", "inter_arch.crossnet.bias.0"),
        ("crossnet.w1", "inter_arch.crossnet.W_kernels.1"),
        ("crossnet.v1", "inter_arch.crossnet.V_kernels.1"),
        ("crossnet.b1", "inter_arch.crossnet.bias.1"),
        ("over_arch.layer0.weight", "over_arch.model.0._mlp.0._linear.weight"),
        ("over_arch.layer0.bias", "over_arch.model.0._mlp.0._linear.bias"),
        ("over_arch.layer1.weight", "over_arch.model.1.weight"),
        ("over_arch.layer1.bias", "over_arch.model.1.bias"),
    ];
    let _ = check_parity(&DlrmDcnFactory::default(), &fx, &names);
}

#[test]
fn deepfm_matches_torchrec() {
    let fx = load(include_str!("fixtures/deepfm.json"));
    let names = [
        ("dense_arch.layer0.weight", "dense_arch.model.0.weight"),
        ("dense_arch.layer0.bias", "dense_arch.model.0.bias"),
        ("dense_arch.layer1.weight", "dense_arch.model.2.weight"),
        ("dense_arch.layer1.bias", "dense_arch.model.2.bias"),
        ("deep_fm.layer0.weight", "inter_arch.deep_fm.dense_module.0.weight"),
        ("deep_fm.layer0.bias", "inter_arch.deep_fm.dense_module.0.bias"),
        ("over_arch.layer0.weight", "over_arch.model.0.weight"),
        ("over_arch.layer0.bias", "over_arch.model.0.bias"),
    ];
    let logits = check_parity(&DeepFmFactory::default(), &fx, &names);
    // TorchRec's SimpleDeepFMNN returns sigmoid(logits); ours returns the logits.
    let probabilities = fx.probabilities.as_ref().expect("deepfm fixture has probabilities");
    assert_close("sigmoid(logits)", &logits.sigmoid(), probabilities);
}
