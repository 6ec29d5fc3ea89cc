//! DeepFM (Guo et al. 2017) as TorchRec's `SimpleDeepFMNN` builds it.
//!
//! - Dense arch: `relu(L2(relu(L1(dense))))`, `L1: num_dense -> hidden_layer_size`,
//!   `L2: hidden_layer_size -> D` (the embedding dim), so the dense features become one more
//!   `D`-wide embedding `d`.
//! - Interaction over the flattened `x = [d, emb_0, …, emb_{F-1}]` (`(F + 1) * D` values):
//!   the deep part `relu(L3(x))`, `L3: (F + 1) * D -> deep_fm_dimension`, and the
//!   factorization-machine term `0.5 * ((Σ x)² - Σ x²)`, one value per example. As in TorchRec,
//!   the sums run over all `(F + 1) * D` scalars together (every pair of scalars, across
//!   features and across embedding coordinates), not per embedding coordinate as in the paper.
//! - Over arch: one linear layer over `[d, deep, fm]` (`D + deep_fm_dimension + 1` values) with
//!   one output per task. TorchRec ends it with a sigmoid; this model returns the logits (the
//!   engine's loss applies the sigmoid).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tch::{Tensor, nn, nn::Module};
use trainrec_types::Diagnostic;

use crate::mlp::{self, mlp, mlp_parameters};
use crate::script::{ScriptModule, Vars};
use crate::{DenseModel, ModelError, ModelInputs};

/// DeepFM as TorchRec's `SimpleDeepFMNN`: a factorization machine and a deep MLP over the
/// dense-arch output and every pooled embedding. `[model]` with `kind = "deepfm"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeepFmConfig {
    /// Size of the dense arch's hidden layer. The dense arch maps the dense features through
    /// this layer (ReLU) to a vector of the embedding dim (ReLU), which joins the pooled
    /// embeddings in the interaction.
    pub hidden_layer_size: usize,
    /// Output size of the deep part of the interaction: one linear layer (ReLU) over the
    /// flattened dense-arch output and pooled embeddings.
    pub deep_fm_dimension: usize,
}

/// The DeepFM dense part.
///
/// Parameters (under the model's path): `dense_arch.layer{0,1}.{weight,bias}` (TorchRec's
/// `dense_arch.model.{0,2}`), `deep_fm.layer0.{weight,bias}` (TorchRec's
/// `inter_arch.deep_fm.dense_module.0`), `over_arch.layer0.{weight,bias}` (TorchRec's
/// `over_arch.model.0`).
pub struct DeepFm {
    dense: nn::Sequential,
    deep: nn::Sequential,
    over: nn::Sequential,
}

/// The factorization-machine term of each row of `x` `[B, N]`: `0.5 * ((Σ x)² - Σ x²)`, the sum
/// of the products of all pairs of distinct entries, as `[B, 1]`.
fn fm_cross_term(x: &Tensor) -> Tensor {
    let sum = x.sum_dim_intlist(1, true, None);
    let sum_of_squares = (x * x).sum_dim_intlist(1, true, None);
    (&sum * &sum - sum_of_squares) * 0.5
}

impl DeepFm {
    /// Builds the parameters under `vs` for `num_sparse` pooled embeddings of dim `dim` and
    /// `num_tasks` logits; `config` must have passed [`crate::TypedModel::check`].
    pub fn new(
        vs: &nn::Path,
        config: &DeepFmConfig,
        num_dense: usize,
        num_sparse: usize,
        dim: usize,
        num_tasks: usize,
    ) -> Self {
        let deep_in = (num_sparse + 1) * dim;
        let over_in = dim + config.deep_fm_dimension + 1;
        Self {
            dense: mlp(&(vs / "dense_arch"), num_dense, &[config.hidden_layer_size, dim], true),
            deep: mlp(&(vs / "deep_fm"), deep_in, &[config.deep_fm_dimension], true),
            over: mlp(&(vs / "over_arch"), over_in, &[num_tasks], false),
        }
    }
}

impl DenseModel for DeepFm {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, _train: bool) -> Tensor {
        let d = self.dense.forward(dense);
        let x = Tensor::cat(&[&d, sparse], 1);
        let deep = self.deep.forward(&x);
        let fm = fm_cross_term(&x);
        self.over.forward(&Tensor::cat(&[d, deep, fm], 1))
    }

    fn torchscript(&self, vars: &Vars, m: &mut ScriptModule) -> Result<(), ModelError> {
        let mut body = Vec::new();
        let d = m.mlp(&mut body, vars, "dense_arch", "dense", true)?;
        body.push(format!("    x = torch.cat([{d}, sparse], 1)"));
        let deep = m.mlp(&mut body, vars, "deep_fm", "x", true)?;
        body.push("    s = torch.sum(x, [1], True)".into());
        body.push("    fm = (s * s - torch.sum(x * x, [1], True)) * 0.5".into());
        body.push(format!("    y = torch.cat([{d}, {deep}, fm], 1)"));
        let out = m.mlp(&mut body, vars, "over_arch", "y", false)?;
        m.method(format!(
            "def dense_forward(self, dense: Tensor, sparse: Tensor) -> Tensor:\n{}\n    return {out}\n",
            body.join("\n")
        ));
        Ok(())
    }
}

/// Registers DeepFM as `kind = "deepfm"`, through the same typed API a plugin uses.
pub type DeepFmFactory = crate::TypedModelFactory<DeepFm>;

impl crate::TypedModel for DeepFm {
    type Config = DeepFmConfig;
    const KIND: &'static str = "deepfm";

    fn check(cfg: &DeepFmConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        mlp::check_positive("hidden_layer_size", cfg.hidden_layer_size, "the dense arch's hidden layer", &mut out);
        mlp::check_positive("deep_fm_dimension", cfg.deep_fm_dimension, "the deep part's output size", &mut out);
        mlp::check_has_sparse("DeepFM", inputs, &mut out);
        // TorchRec's SimpleDeepFMNN requires one embedding dim for all tables; the dense arch
        // produces a vector of that dim.
        if let Some((first, dim)) = inputs.sparse.first() {
            for ((name, d), key) in inputs.sparse.iter().zip(&inputs.sparse_dim_keys).skip(1) {
                if d != dim {
                    out.push(
                        Diagnostic::new(
                            key.clone(),
                            format!(
                                "DeepFM needs every embedding dim to be the same; feature \"{first}\" has dim {dim}, feature \"{name}\" has dim {d}"
                            ),
                        )
                        .with_help(format!("set this table's dim to {dim}")),
                    );
                }
            }
        }
        mlp::check_has_dense("DeepFM", inputs, &mut out);
        out
    }

    fn build(vs: &nn::Path, cfg: &DeepFmConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        let dim = inputs.sparse.first().map_or(0, |(_, d)| *d);
        Ok(DeepFm::new(vs, cfg, inputs.num_dense, inputs.sparse.len(), dim, inputs.num_tasks))
    }
    fn parameters(cfg: &DeepFmConfig, inputs: &ModelInputs) -> Option<u128> {
        let dim = inputs.sparse.first().map_or(0, |(_, d)| *d);
        let deep_in = (inputs.sparse.len() + 1) * dim;
        let over_in = dim + cfg.deep_fm_dimension + 1;
        Some(
            mlp_parameters(inputs.num_dense, &[cfg.hidden_layer_size, dim])
                + mlp_parameters(deep_in, &[cfg.deep_fm_dimension])
                + mlp_parameters(over_in, &[inputs.num_tasks]),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelFactory;
    use trainrec_types::KeyPath;

    fn inputs(dims: &[usize]) -> ModelInputs {
        ModelInputs {
            num_dense: 3,
            sparse: dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
            sparse_dim_keys: (0..dims.len()).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
            num_tasks: 1,
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
    fn fm_term_sums_over_all_pairs_of_scalars() {
        // [1, 2, 3, 4]: pairs 2 + 3 + 4 + 6 + 8 + 12 = 35 = 0.5 * (10² - 30).
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 5.0]).view([2, 4]);
        let fm = fm_cross_term(&x);
        assert_eq!(fm.size(), [2, 1]);
        assert_eq!(fm.double_value(&[0, 0]), 35.0);
        assert_eq!(fm.double_value(&[1, 0]), 0.0);
    }

    #[test]
    fn forward_matches_a_hand_computation() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DeepFmConfig { hidden_layer_size: 1, deep_fm_dimension: 1 };
        let m = DeepFm::new(&vs.root(), &cfg, 1, 2, 1, 1);
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "deep_fm.layer0.bias",
                "deep_fm.layer0.weight",
                "dense_arch.layer0.bias",
                "dense_arch.layer0.weight",
                "dense_arch.layer1.bias",
                "dense_arch.layer1.weight",
                "over_arch.layer0.bias",
                "over_arch.layer0.weight"
            ]
        );
        set(&vs, "dense_arch.layer0.weight", &[1.0]);
        set(&vs, "dense_arch.layer0.bias", &[0.0]);
        set(&vs, "dense_arch.layer1.weight", &[2.0]);
        set(&vs, "dense_arch.layer1.bias", &[0.0]);
        set(&vs, "deep_fm.layer0.weight", &[1.0, 1.0, 1.0]);
        set(&vs, "deep_fm.layer0.bias", &[0.0]);
        set(&vs, "over_arch.layer0.weight", &[1.0, 2.0, 3.0]);
        set(&vs, "over_arch.layer0.bias", &[0.5]);
        // d = relu(2 * relu(1)) = 2; x = [2, 0.5, -1]; deep = relu(1.5) = 1.5;
        // fm = 2 * 0.5 + 2 * -1 + 0.5 * -1 = -1.5; logit = 2 + 2 * 1.5 + 3 * -1.5 + 0.5 = 1.
        let dense = Tensor::from_slice(&[1.0f32]).view([1, 1]);
        let sparse = Tensor::from_slice(&[0.5f32, -1.0]).view([1, 2]);
        let got = m.forward(&dense, &sparse, false);
        assert_eq!(got.size(), [1, 1]);
        let got = got.double_value(&[0, 0]);
        assert!((got - 1.0).abs() < 1e-6, "{got}");
    }

    #[test]
    fn one_logit_per_task() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let two = ModelInputs { num_tasks: 2, ..inputs(&[4, 4, 4]) };
        let cfg = serde_json::json!({"hidden_layer_size": 5, "deep_fm_dimension": 6});
        let m = DeepFmFactory::default().build(&vs.root(), &cfg, &two).map_err(|e| e.to_string()).unwrap();
        let vars = vs.variables();
        assert_eq!(vars["deep_fm.layer0.weight"].size(), [6, 16]);
        assert_eq!(vars["over_arch.layer0.weight"].size(), [2, 4 + 6 + 1]);
        let out =
            m.forward(&Tensor::ones([7, 3], tch::kind::FLOAT_CPU), &Tensor::ones([7, 12], tch::kind::FLOAT_CPU), true);
        assert_eq!(out.size(), [7, 2]);
    }

    #[test]
    fn check_names_the_keys() {
        let _rng = crate::seeded(0);
        let ok = serde_json::json!({"hidden_layer_size": 8, "deep_fm_dimension": 4});
        assert!(DeepFmFactory::default().check(&ok, &inputs(&[4, 4])).is_empty());
        let bad = serde_json::json!({"hidden_layer_size": 0, "deep_fm_dimension": 0});
        let problems = DeepFmFactory::default().check(&bad, &inputs(&[4, 5, 4, 3]));
        let keys: Vec<String> = problems.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["model.hidden_layer_size", "model.deep_fm_dimension", "tables[1].dim", "tables[3].dim"]);
        assert!(problems.iter().all(|d| d.help.is_some()), "{problems:?}");
        assert!(problems[2].message.contains("\"f0\" has dim 4"), "{}", problems[2].message);
        let none = ModelInputs { num_dense: 0, ..inputs(&[]) };
        let keys: Vec<String> = DeepFmFactory::default().check(&ok, &none).iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["tables", "model"]);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        assert!(matches!(DeepFmFactory::default().build(&vs.root(), &bad, &inputs(&[4])), Err(ModelError::Config(_))));
        let unknown = serde_json::json!({"hidden_layer_size": 8, "deep_fm_dim": 4});
        assert!(matches!(
            DeepFmFactory::default().build(&vs.root(), &unknown, &inputs(&[4])),
            Err(ModelError::Config(_))
        ));
    }
}
