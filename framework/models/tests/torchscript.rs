//! Every built-in model written as TorchScript computes the logits of its tch forward:
//! the written file is loaded back through libtorch (`CModule`) and run on random inputs.

use tch::{Device, Kind, Tensor, nn};
use trainrec_models::script::ScriptModule;
use trainrec_models::*;
use trainrec_types::KeyPath;

fn inputs(num_dense: usize, dims: &[usize], num_tasks: usize) -> ModelInputs {
    ModelInputs {
        num_dense,
        sparse: dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
        sparse_dim_keys: (0..dims.len()).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
        num_tasks,
        sequences: Vec::new(),
    }
}

/// Writes `model` as TorchScript, loads it, and checks its logits (and a retrieval model's
/// towers) against the tch forward on batches of 1 and 37 examples.
fn check(name: &str, model: &dyn DenseModel, vs: &nn::VarStore, inputs: &ModelInputs) {
    let vars = vs.variables();
    let mut m = ScriptModule::new("Check");
    model.torchscript(&vars, &mut m).unwrap();
    m.method(
        "def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:\n    return self.dense_forward(dense, sparse)\n",
    );
    let dir = std::env::temp_dir().join(format!("trainrec-models-ts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.pt"));
    std::fs::write(&path, m.archive("check", &[]).unwrap()).unwrap();
    let module = tch::CModule::load(&path).unwrap();
    let width: usize = inputs.sparse.iter().map(|(_, d)| d).sum();
    for batch in [1i64, 37] {
        let dense = Tensor::rand([batch, inputs.num_dense as i64], (Kind::Float, Device::Cpu));
        let sparse = Tensor::randn([batch, width as i64], (Kind::Float, Device::Cpu));
        let want = tch::no_grad(|| model.forward(&dense, &sparse, false));
        let got = module.forward_ts(&[&dense, &sparse]).unwrap();
        assert_eq!(got.size(), want.size());
        let err = (&got - &want).abs().max().double_value(&[]);
        assert!(err < 1e-5, "max |diff| {err}");
        if let Some(r) = model.retrieval() {
            let q = module.method_ts("query_tower", &[&dense, &sparse]).unwrap();
            let c = module.method_ts("candidate_tower", &[&sparse]).unwrap();
            let (wq, wc) = tch::no_grad(|| (r.query_embeddings(&dense, &sparse), r.candidate_embeddings(&sparse)));
            assert!((&q - &wq).abs().max().double_value(&[]) < 1e-5);
            assert!((&c - &wc).abs().max().double_value(&[]) < 1e-5);
        }
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn dlrm_as_torchscript_computes_its_logits() {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = DlrmConfig { dense_arch: vec![8, 4], over_arch: vec![6, 2] };
    let ins = inputs(3, &[4, 4, 4], 2);
    let m = Dlrm::new(&vs.root(), &cfg, 3, 3);
    check("dlrm", &m, &vs, &ins);
}

#[test]
fn dlrm_dcn_as_torchscript_computes_its_logits() {
    tch::manual_seed(4);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = DlrmDcnConfig { dense_arch: vec![8, 4], over_arch: vec![6, 1], dcn_num_layers: 2, dcn_low_rank_dim: 3 };
    let ins = inputs(3, &[4, 4], 1);
    let m = DlrmDcn::new(&vs.root(), &cfg, 3, 2);
    // Cross biases start at zero: give them values so the check reads them.
    tch::no_grad(|| {
        for (name, mut v) in vs.variables() {
            if name.starts_with("crossnet.b") {
                let _ = v.uniform_(-0.5, 0.5);
            }
        }
    });
    check("dlrm_dcn", &m, &vs, &ins);
}

#[test]
fn deepfm_as_torchscript_computes_its_logits() {
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = DeepFmConfig { hidden_layer_size: 5, deep_fm_dimension: 3 };
    let ins = inputs(2, &[4, 4, 4], 1);
    let m = DeepFm::new(&vs.root(), &cfg, 2, 3, 4, 1);
    check("deepfm", &m, &vs, &ins);
}

#[test]
fn two_tower_as_torchscript_computes_its_scores_and_towers() {
    tch::manual_seed(6);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg: TwoTowerConfig = serde_json::from_value(serde_json::json!({
        "query_features": ["f0", "f2"], "candidate_features": ["f1"],
        "query_tower": [6, 4], "candidate_tower": [4], "temperature": 0.5
    }))
    .unwrap();
    let ins = inputs(0, &[3, 2, 3], 1);
    let m = TwoTower::new(&vs.root(), &cfg, &ins);
    check("two_tower", &m, &vs, &ins);
}
