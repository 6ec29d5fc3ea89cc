//! DLRM-DCN (DLRM with a DCN-v2 interaction) as TorchRec's `DLRM_DCN` builds it: a dense-arch
//! MLP, a low-rank cross net over the concatenation `[dense-arch output, pooled embedding 0, …,
//! pooled embedding F-1]`, and an over-arch MLP over the cross net's output.
//!
//! One cross layer `l` maps `x_l` to `x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`, with
//! `x_0` the concatenation, `W_l: [N, r]`, `V_l: [r, N]`, `b_l: [N]`, `N = (F + 1) * D` and
//! `r = dcn_low_rank_dim` (TorchRec's `LowRankCrossNet`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tch::{Tensor, nn, nn::Module};
use trainrec_types::Diagnostic;

use crate::mlp::{self, mlp, mlp_parameters};
use crate::script::{ScriptModule, Vars};
use crate::{DenseModel, ModelError, ModelInputs};

/// DLRM with a DCN-v2 low-rank cross network (TorchRec's `DLRM_DCN`) in place of the dot
/// interactions. `[model]` with `kind = "dlrm_dcn"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DlrmDcnConfig {
    /// Layer sizes of the dense-arch MLP over the dense features (ReLU after each). The last
    /// size must equal the embedding dim of every table.
    pub dense_arch: Vec<usize>,
    /// Layer sizes of the over-arch MLP over the cross net's output (ReLU after each but the
    /// last). At least two layers, as in TorchRec; the last size must equal the number of tasks
    /// (1 for a single task): one logit per task.
    pub over_arch: Vec<usize>,
    /// Number of low-rank cross layers in the interaction (0 passes the concatenated dense-arch
    /// output and pooled embeddings straight to the over arch).
    pub dcn_num_layers: usize,
    /// Rank `r` of each cross layer's factored weight `W_l V_l` (at least 1). TorchRec suggests
    /// about a quarter of the cross net's width `(number of features + 1) * dim`.
    pub dcn_low_rank_dim: usize,
}

/// One low-rank cross layer's parameters.
struct CrossLayer {
    /// `W_l`: `[N, r]`.
    w: Tensor,
    /// `V_l`: `[r, N]`.
    v: Tensor,
    /// `b_l`: `[N]`.
    b: Tensor,
}

/// The DLRM-DCN dense part.
///
/// Parameters (under the model's path): `dense_arch.layer{i}.{weight,bias}`,
/// `crossnet.{w,v,b}{l}` (TorchRec's `inter_arch.crossnet.{W_kernels,V_kernels,bias}.{l}`,
/// same shapes), `over_arch.layer{i}.{weight,bias}`.
pub struct DlrmDcn {
    dense: nn::Sequential,
    cross: Vec<CrossLayer>,
    over: nn::Sequential,
}

impl DlrmDcn {
    /// Builds the parameters under `vs`; `config` must have passed [`crate::TypedModel::check`].
    /// Initialization follows TorchRec: PyTorch's default for the linear layers, Xavier-normal
    /// cross kernels and zero cross biases.
    pub fn new(vs: &nn::Path, config: &DlrmDcnConfig, num_dense: usize, num_sparse: usize) -> Self {
        let dim = config.dense_arch.last().copied().unwrap_or(0);
        let width = (num_sparse + 1) * dim;
        let (n, r) = (width as i64, config.dcn_low_rank_dim as i64);
        let cross_vs = vs / "crossnet";
        // xavier_normal_ on [N, r] and on [r, N]: std = sqrt(2 / (fan_in + fan_out)).
        let stdev = (2.0 / (n + r).max(1) as f64).sqrt();
        let kernel = nn::Init::Randn { mean: 0.0, stdev };
        let cross = (0..config.dcn_num_layers)
            .map(|l| CrossLayer {
                w: cross_vs.var(&format!("w{l}"), &[n, r], kernel),
                v: cross_vs.var(&format!("v{l}"), &[r, n], kernel),
                b: cross_vs.var(&format!("b{l}"), &[n], nn::Init::Const(0.0)),
            })
            .collect();
        Self {
            dense: mlp(&(vs / "dense_arch"), num_dense, &config.dense_arch, true),
            cross,
            over: mlp(&(vs / "over_arch"), width, &config.over_arch, false),
        }
    }

    /// The cross net: `x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l` over rows of `x0` `[B, N]`.
    fn crossnet(&self, x0: &Tensor) -> Tensor {
        let mut x = x0.shallow_clone();
        for layer in &self.cross {
            let low = x.matmul(&layer.v.tr()); // [B, r]
            let full = low.matmul(&layer.w.tr()); // [B, N]
            x = x0 * (full + &layer.b) + x;
        }
        x
    }
}

impl DenseModel for DlrmDcn {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, _train: bool) -> Tensor {
        let d = self.dense.forward(dense);
        // TorchRec stacks [dense, emb_0, …] to [B, F + 1, D] and flattens it: the same as
        // concatenating the dense-arch output before the pooled embeddings' columns.
        let x0 = Tensor::cat(&[&d, sparse], 1);
        self.over.forward(&self.crossnet(&x0))
    }

    fn torchscript(&self, vars: &Vars, m: &mut ScriptModule) -> Result<(), ModelError> {
        let mut body = Vec::new();
        let d = m.mlp(&mut body, vars, "dense_arch", "dense", true)?;
        body.push(format!("    x0 = torch.cat([{d}, sparse], 1)"));
        body.push("    x = x0".into());
        for l in 0..self.cross.len() {
            let w = m.var(vars, &format!("crossnet.w{l}"))?;
            let v = m.var(vars, &format!("crossnet.v{l}"))?;
            let b = m.var(vars, &format!("crossnet.b{l}"))?;
            body.push(format!("    x = x0 * (torch.matmul(torch.matmul(x, torch.t({v})), torch.t({w})) + {b}) + x"));
        }
        let out = m.mlp(&mut body, vars, "over_arch", "x", false)?;
        m.method(format!(
            "def dense_forward(self, dense: Tensor, sparse: Tensor) -> Tensor:\n{}\n    return {out}\n",
            body.join("\n")
        ));
        Ok(())
    }
}

/// Registers DLRM-DCN as `kind = "dlrm_dcn"`, through the same typed API a plugin uses.
pub type DlrmDcnFactory = crate::TypedModelFactory<DlrmDcn>;

impl crate::TypedModel for DlrmDcn {
    type Config = DlrmDcnConfig;
    const KIND: &'static str = "dlrm_dcn";

    fn check(cfg: &DlrmDcnConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        mlp::check_layer_sizes("dense_arch", &cfg.dense_arch, 1, None, &mut out);
        // TorchRec's OverArch is an MLP of all sizes but the last plus a final linear layer,
        // and rejects a single layer.
        let help = format!("add a hidden layer before the output layer, e.g. over_arch = [64, {}]", inputs.num_tasks);
        mlp::check_layer_sizes("over_arch", &cfg.over_arch, 2, Some(help), &mut out);
        mlp::check_last_is_num_tasks("over_arch", &cfg.over_arch, inputs.num_tasks, &mut out);
        mlp::check_positive("dcn_low_rank_dim", cfg.dcn_low_rank_dim, "the rank of each cross layer", &mut out);
        mlp::check_has_sparse("DLRM-DCN", inputs, &mut out);
        if let Some(&dim) = cfg.dense_arch.last() {
            mlp::check_dims_match_dense_arch("DLRM-DCN", dim, inputs, &mut out);
        }
        mlp::check_has_dense("DLRM-DCN", inputs, &mut out);
        out
    }

    fn build(vs: &nn::Path, cfg: &DlrmDcnConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        Ok(DlrmDcn::new(vs, cfg, inputs.num_dense, inputs.sparse.len()))
    }
    fn parameters(cfg: &DlrmDcnConfig, inputs: &ModelInputs) -> Option<u128> {
        let dim = cfg.dense_arch.last().copied().unwrap_or(0);
        let width = ((inputs.sparse.len() + 1) * dim) as u128;
        // Per cross layer: W [N, r], V [r, N], b [N].
        let cross = cfg.dcn_num_layers as u128 * (2 * width * cfg.dcn_low_rank_dim as u128 + width);
        Some(mlp_parameters(inputs.num_dense, &cfg.dense_arch) + cross + mlp_parameters(width as usize, &cfg.over_arch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelFactory;
    use trainrec_types::KeyPath;

    fn inputs(dims: &[usize], num_tasks: usize) -> ModelInputs {
        ModelInputs {
            num_dense: 3,
            sparse: dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
            sparse_dim_keys: (0..dims.len()).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
            num_tasks,
            sequences: Vec::new(),
        }
    }

    fn set(vs: &nn::VarStore, name: &str, values: &[f32]) {
        let vars = vs.variables();
        let var = vars.get(name).unwrap_or_else(|| panic!("no variable {name}"));
        let src = Tensor::from_slice(values).view(var.size().as_slice());
        tch::no_grad(|| var.shallow_clone().copy_(&src));
    }

    #[test]
    fn one_cross_layer_matches_a_hand_computation() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmDcnConfig { dense_arch: vec![1], over_arch: vec![1, 1], dcn_num_layers: 1, dcn_low_rank_dim: 1 };
        let m = DlrmDcn::new(&vs.root(), &cfg, 1, 1);
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "crossnet.b0",
                "crossnet.v0",
                "crossnet.w0",
                "dense_arch.layer0.bias",
                "dense_arch.layer0.weight",
                "over_arch.layer0.bias",
                "over_arch.layer0.weight",
                "over_arch.layer1.bias",
                "over_arch.layer1.weight"
            ]
        );
        set(&vs, "dense_arch.layer0.weight", &[2.0]);
        set(&vs, "dense_arch.layer0.bias", &[0.0]);
        set(&vs, "crossnet.v0", &[1.0, 2.0]);
        set(&vs, "crossnet.w0", &[0.5, -1.0]);
        set(&vs, "crossnet.b0", &[0.1, 0.2]);
        set(&vs, "over_arch.layer0.weight", &[1.0, 1.0]);
        set(&vs, "over_arch.layer0.bias", &[0.0]);
        set(&vs, "over_arch.layer1.weight", &[2.0]);
        set(&vs, "over_arch.layer1.bias", &[1.0]);
        // d = relu(2 * 1.5) = 3; x0 = [d, e] = [3, 0.5]; V x0 = 3 + 1 = 4; W (V x0) + b =
        // [2 + 0.1, -4 + 0.2] = [2.1, -3.8]; x1 = x0 * that + x0 = [9.3, -1.4];
        // over: relu(9.3 - 1.4) = 7.9, then 2 * 7.9 + 1 = 16.8.
        let dense = Tensor::from_slice(&[1.5f32]).view([1, 1]);
        let sparse = Tensor::from_slice(&[0.5f32]).view([1, 1]);
        let got = m.forward(&dense, &sparse, false);
        assert_eq!(got.size(), [1, 1]);
        let got = got.double_value(&[0, 0]);
        assert!((got - 16.8).abs() < 1e-5, "{got}");
    }

    #[test]
    fn zero_cross_layers_feed_the_concatenation_to_the_over_arch() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmDcnConfig { dense_arch: vec![2], over_arch: vec![3, 2], dcn_num_layers: 0, dcn_low_rank_dim: 1 };
        let m = DlrmDcn::new(&vs.root(), &cfg, 3, 2);
        let dense = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 0.0, 1.0, 2.0]).view([2, 3]);
        let sparse = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).view([2, 4]);
        let x0 = Tensor::cat(&[m.dense.forward(&dense), sparse.shallow_clone()], 1);
        let want = m.over.forward(&x0);
        let got = m.forward(&dense, &sparse, true);
        assert_eq!(got.size(), [2, 2]);
        assert!(got.allclose(&want, 1e-6, 1e-6, false));
    }

    #[test]
    fn init_follows_torchrec() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmDcnConfig { dense_arch: vec![8], over_arch: vec![4, 1], dcn_num_layers: 2, dcn_low_rank_dim: 4 };
        let _m = DlrmDcn::new(&vs.root(), &cfg, 3, 63);
        let vars = vs.variables();
        assert_eq!(vars["crossnet.w1"].size(), [512, 4]);
        assert_eq!(vars["crossnet.v1"].size(), [4, 512]);
        assert_eq!(vars["crossnet.b1"].size(), [512]);
        assert_eq!(vars["over_arch.layer0.weight"].size(), [4, 512]);
        assert_eq!(vars["crossnet.b0"].abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
        let std = vars["crossnet.w0"].std(true).double_value(&[]);
        let want = (2.0f64 / 516.0).sqrt();
        assert!((std - want).abs() < 0.1 * want, "{std} vs {want}");
    }

    #[test]
    fn check_names_the_keys() {
        let ok =
            serde_json::json!({"dense_arch": [8, 4], "over_arch": [8, 1], "dcn_num_layers": 2, "dcn_low_rank_dim": 2});
        assert!(DlrmDcnFactory::default().check(&ok, &inputs(&[4, 4], 1)).is_empty());
        let bad =
            serde_json::json!({"dense_arch": [8, 0, 4], "over_arch": [2], "dcn_num_layers": 2, "dcn_low_rank_dim": 0});
        let problems = DlrmDcnFactory::default().check(&bad, &inputs(&[4, 5], 1));
        let keys: Vec<String> = problems.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(
            keys,
            vec![
                "model.dense_arch[1]",
                "model.over_arch",
                "model.over_arch[0]",
                "model.dcn_low_rank_dim",
                "tables[1].dim"
            ]
        );
        assert!(
            problems.iter().all(|d| d.help.is_some() || d.key.to_string() == "model.dense_arch[1]"),
            "{problems:?}"
        );
        assert!(problems[1].message.contains("at least 2 layers"), "{}", problems[1].message);
        assert!(problems[4].message.contains("DLRM-DCN"), "{}", problems[4].message);
        // Two tasks need two logits; no tables or dense features at all is an error too.
        let none = ModelInputs { num_dense: 0, ..inputs(&[], 2) };
        let problems = DlrmDcnFactory::default().check(&ok, &none);
        let keys: Vec<String> = problems.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["model.over_arch[1]", "tables", "model"]);
        assert!(problems[0].message.contains("size 2 (one logit per task)"), "{}", problems[0].message);
    }

    #[test]
    fn build_reports_diagnostics_instead_of_panicking() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let bad = serde_json::json!({"dense_arch": [], "over_arch": [1], "dcn_num_layers": 1, "dcn_low_rank_dim": 0});
        match DlrmDcnFactory::default().build(&vs.root(), &bad, &inputs(&[4], 1)) {
            Err(ModelError::Config(d)) => assert!(!d.is_empty()),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("built an invalid model"),
        }
        let unknown = serde_json::json!({"dense_arch": [4], "over_arch": [4, 1], "dcn_layers": 1});
        assert!(matches!(
            DlrmDcnFactory::default().build(&vs.root(), &unknown, &inputs(&[4], 1)),
            Err(ModelError::Config(_))
        ));
        let schema = DlrmDcnFactory::default().config_schema();
        assert!(schema["properties"]["dcn_low_rank_dim"]["description"].is_string(), "{schema}");
    }
}
