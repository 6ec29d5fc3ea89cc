//! An example model plugin, written as a user would write one: Wide & Deep (Cheng et al.
//! 2016). The wide part is a linear layer over the dense features and every pooled embedding;
//! the deep part an MLP over the same inputs; the logit is their sum.
//!
//! Register it with `Registry::builtin().model::<WideDeep>()` and select it in a recipe with
//! `[model] kind = "wide_deep"`.

use schemars::JsonSchema;
use serde::Deserialize;
use trainrec_plugin::tch::{Tensor, nn, nn::Module};
use trainrec_plugin::{DenseModel, Diagnostic, KeyPath, ModelError, ModelInputs, TypedModel};

/// Wide & Deep: a linear (wide) part plus an MLP (deep) part over the dense features and every
/// pooled embedding.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WideDeepConfig {
    /// Layer sizes of the deep MLP (ReLU after each but the last); the last size is the
    /// number of tasks.
    pub deep: Vec<usize>,
    /// Dropout probability after each hidden layer of the deep part, in training only.
    #[serde(default)]
    pub dropout: f64,
}

/// The Wide & Deep model.
pub struct WideDeep {
    wide: nn::Linear,
    deep: Vec<nn::Linear>,
    dropout: f64,
}

impl WideDeep {
    fn inputs(dense: &Tensor, sparse: &Tensor) -> Tensor {
        Tensor::cat(&[dense, sparse], 1)
    }

    /// The wide part's logits alone.
    pub fn wide_logits(&self, dense: &Tensor, sparse: &Tensor) -> Tensor {
        self.wide.forward(&Self::inputs(dense, sparse))
    }
}

impl DenseModel for WideDeep {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor {
        let x = Self::inputs(dense, sparse);
        let mut h = x.shallow_clone();
        for (i, layer) in self.deep.iter().enumerate() {
            h = layer.forward(&h);
            if i + 1 < self.deep.len() {
                h = h.relu().dropout(self.dropout, train);
            }
        }
        self.wide.forward(&x) + h
    }
}

impl TypedModel for WideDeep {
    type Config = WideDeepConfig;
    const KIND: &'static str = "wide_deep";

    fn check(config: &WideDeepConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let model = KeyPath::root().key("model");
        let mut out = Vec::new();
        match config.deep.last() {
            None => out.push(Diagnostic::new(model.key("deep"), "deep needs at least one layer")),
            Some(&last) if last != inputs.num_tasks => out.push(
                Diagnostic::new(
                    model.key("deep").index(config.deep.len() - 1),
                    format!(
                        "the last deep layer gives the logits: size {} (one per task), found {last}",
                        inputs.num_tasks
                    ),
                )
                .with_help(format!("end deep with {}", inputs.num_tasks)),
            ),
            Some(_) => {}
        }
        for (i, &s) in config.deep.iter().enumerate() {
            if s == 0 {
                out.push(Diagnostic::new(model.key("deep").index(i), "layer sizes must be positive"));
            }
        }
        if !(0.0..1.0).contains(&config.dropout) {
            out.push(Diagnostic::new(
                model.key("dropout"),
                format!("dropout must be in [0, 1), found {}", config.dropout),
            ));
        }
        out
    }

    fn build(vs: &nn::Path, config: &WideDeepConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        let width = (inputs.num_dense + inputs.sparse.iter().map(|(_, d)| d).sum::<usize>()) as i64;
        let tasks = inputs.num_tasks as i64;
        let mut prev = width;
        let mut deep = Vec::new();
        for (i, &size) in config.deep.iter().enumerate() {
            deep.push(nn::linear(vs / "deep" / format!("layer{i}"), prev, size as i64, Default::default()));
            prev = size as i64;
        }
        Ok(Self { wide: nn::linear(vs / "wide", width, tasks, Default::default()), deep, dropout: config.dropout })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainrec_plugin::conformance::ModelCase;
    use trainrec_plugin::tch::{Device, Kind};

    #[test]
    fn conforms() {
        ModelCase::new("deep = [16, 1]", 3, &[4, 4]).check::<WideDeep>().assert_ok();
        ModelCase::new("deep = [8, 2]\ndropout = 0.25", 2, &[4]).tasks(2).check::<WideDeep>().assert_ok();
    }

    #[test]
    fn the_logit_is_wide_plus_deep_by_hand() {
        let vs = nn::VarStore::new(Device::Cpu);
        let inputs = ModelCase::new("", 1, &[1]).inputs;
        let m = WideDeep::build(&vs.root(), &WideDeepConfig { deep: vec![1, 1], dropout: 0.0 }, &inputs).unwrap();
        // wide: w = (1, 2), b = 0.5; deep: relu(3 * x0 - x1 + 0) then * 2 + 1.
        let set = |t: &Tensor, v: &[f32]| {
            trainrec_plugin::tch::no_grad(|| t.shallow_clone().copy_(&Tensor::from_slice(v).view(t.size().as_slice())))
        };
        set(&m.wide.ws, &[1.0, 2.0]);
        set(m.wide.bs.as_ref().unwrap(), &[0.5]);
        set(&m.deep[0].ws, &[3.0, -1.0]);
        set(m.deep[0].bs.as_ref().unwrap(), &[0.0]);
        set(&m.deep[1].ws, &[2.0]);
        set(m.deep[1].bs.as_ref().unwrap(), &[1.0]);
        let dense = Tensor::from_slice(&[1.0f32, 1.0]).view([2, 1]);
        let sparse = Tensor::from_slice(&[0.5f32, 4.0]).view([2, 1]);
        let got: Vec<f32> = Vec::try_from(m.forward(&dense, &sparse, false).view([-1]).to_kind(Kind::Float)).unwrap();
        // Example 0: wide 1 + 1 + 0.5 = 2.5; deep relu(3 - 0.5) = 2.5 -> 6. Total 8.5.
        // Example 1: wide 1 + 8 + 0.5 = 9.5; deep relu(3 - 4) = 0 -> 1. Total 10.5.
        assert_eq!(got, vec![8.5, 10.5]);
    }

    #[test]
    fn check_names_the_keys() {
        let inputs = ModelCase::new("", 1, &[1]).inputs;
        let p = WideDeep::check(&WideDeepConfig { deep: vec![4, 2], dropout: 1.5 }, &inputs);
        let keys: Vec<String> = p.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["model.deep[1]", "model.dropout"]);
    }
}
