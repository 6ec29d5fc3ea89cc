//! DIN, the Deep Interest Network (Zhou et al., KDD 2018): a CTR model that weighs each item of
//! the user's history by its relevance to the candidate item before summing them.
//!
//! Inputs: the candidate and the history are sequence features (tables with
//! `pooling = "none"`, usually one item table read by both, so they share embeddings); the
//! dense features and pooled embeddings (the user, context) join the final MLP.
//!
//! For each history item `h` and the candidate `c` (both `[dim]`), the activation unit (an MLP
//! over `[h, c, h - c, h * c]`, sigmoid between its layers as DeepCTR's `LocalActivationUnit`,
//! one output) gives a weight; the user's interest is `Σ weight · h` over the history, without
//! softmax normalisation (the paper keeps the weights' scale as a measure of interest
//! intensity). The logits are an MLP (ReLU between layers) over
//! `[dense, pooled, c, interest]`. A candidate bag of several ids is averaged; an empty history
//! gives a zero interest.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor, nn, nn::Module};
use trainrec_types::{Diagnostic, KeyPath, suggest};

use crate::mlp::{self, mlp, mlp_parameters, torch_linear};
use crate::sequence::{JaggedEmbeddings, ModelInput};
use crate::{DenseModel, ModelError, ModelInputs};

/// DIN: target attention of the candidate over the user's history, then an MLP (Zhou et al.
/// 2018). Reads sequence features.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DinConfig {
    /// The sequence feature holding the candidate item (one id per example; a longer bag is
    /// averaged). A feature of a `pooling = "none"` table.
    pub candidate: String,
    /// The sequence feature holding the user's history (for example the MovieLens sampler's
    /// `history`), of the same dim as the candidate.
    pub history: String,
    /// Hidden layer sizes of the activation unit (its output layer of size 1 follows).
    #[serde(default = "default_attention_mlp")]
    pub attention_mlp: Vec<usize>,
    /// Layer sizes of the MLP over `[dense, pooled, candidate, interest]`, ReLU between layers;
    /// the last is the number of tasks.
    pub mlp: Vec<usize>,
}

fn default_attention_mlp() -> Vec<usize> {
    vec![36]
}

/// The DIN model.
pub struct Din {
    candidate: String,
    history: String,
    dim: i64,
    attention: Vec<nn::Linear>,
    mlp: nn::Sequential,
}

/// The mean of each example's rows `[batch, dim]` (zeros for an empty bag).
fn bag_mean(j: &JaggedEmbeddings) -> Tensor {
    if j.lengths.iter().all(|&n| n == 1) {
        return j.values.shallow_clone();
    }
    let (padded, mask) = j.to_padded(None, 0.0);
    let mask = mask.to_kind(padded.kind());
    let sum = (padded * mask.unsqueeze(-1)).sum_dim_intlist(1, false, None::<Kind>);
    sum / mask.sum_dim_intlist(1, true, None::<Kind>).clamp_min(1.0)
}

impl Din {
    /// The interest `[batch, dim]`: the history's rows weighted by the activation unit.
    fn interest(&self, candidate: &Tensor, history: &JaggedEmbeddings) -> Tensor {
        let (h, mask) = history.to_padded(None, 0.0);
        let (b, l) = (h.size()[0], h.size()[1]);
        let c = candidate.unsqueeze(1).expand([b, l, self.dim], false);
        let mut a = Tensor::cat(&[&h, &c, &(&h - &c), &(&h * &c)], 2);
        for (i, layer) in self.attention.iter().enumerate() {
            a = layer.forward(&a);
            if i + 1 < self.attention.len() {
                a = a.sigmoid();
            }
        }
        let w = a.squeeze_dim(-1) * mask.to_kind(h.kind());
        (w.unsqueeze(-1) * h).sum_dim_intlist(1, false, None::<Kind>)
    }
}

impl DenseModel for Din {
    /// Without sequence features the candidate and the interest are zeros.
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor {
        self.forward_input(&ModelInput::pooled(dense, sparse), train)
    }

    fn forward_input(&self, input: &ModelInput<'_>, _train: bool) -> Tensor {
        let b = input.dense.size()[0];
        let zeros = || Tensor::zeros([b, self.dim], (Kind::Float, input.dense.device()));
        let candidate = input.sequence(&self.candidate).map_or_else(zeros, bag_mean);
        let interest = match input.sequence(&self.history) {
            Some(h) => self.interest(&candidate, h),
            None => zeros(),
        };
        let x = Tensor::cat(&[input.dense, input.pooled, &candidate, &interest], 1);
        self.mlp.forward(&x)
    }
}

/// The dim of sequence feature `name`, or a diagnostic at `model.<key>` listing the job's.
pub(crate) fn sequence_dim(key: &str, name: &str, inputs: &ModelInputs, out: &mut Vec<Diagnostic>) -> Option<usize> {
    match inputs.sequences.iter().find(|(n, _)| n == name) {
        Some((_, d)) => Some(*d),
        None => {
            let names: Vec<&str> = inputs.sequences.iter().map(|(n, _)| n.as_str()).collect();
            let help = if names.is_empty() {
                "the job has no sequence features: read the feature from a table with pooling = \"none\"".to_string()
            } else {
                suggest(name, "sequence features", &names)
            };
            out.push(
                Diagnostic::new(
                    KeyPath::root().key("model").key(key),
                    format!("\"{name}\" is not a sequence feature of this job"),
                )
                .with_help(help),
            );
            None
        }
    }
}

impl crate::TypedModel for Din {
    type Config = DinConfig;
    const KIND: &'static str = "din";
    const READS_SEQUENCES: bool = true;

    fn check(cfg: &DinConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        let c = sequence_dim("candidate", &cfg.candidate, inputs, &mut out);
        let h = sequence_dim("history", &cfg.history, inputs, &mut out);
        if let (Some(c), Some(h)) = (c, h)
            && c != h
        {
            out.push(
                Diagnostic::new(
                    KeyPath::root().key("model").key("history"),
                    format!("the history's dim ({h}) differs from the candidate's ({c})"),
                )
                .with_help("read both from one table (the item table), as DIN shares the item embeddings"),
            );
        }
        mlp::check_layer_sizes("attention_mlp", &cfg.attention_mlp, 0, None, &mut out);
        mlp::check_layer_sizes("mlp", &cfg.mlp, 1, None, &mut out);
        mlp::check_last_is_num_tasks("mlp", &cfg.mlp, inputs.num_tasks, &mut out);
        out
    }

    fn build(vs: &nn::Path, cfg: &DinConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        let dim = inputs.sequences.iter().find(|(n, _)| *n == cfg.candidate).map_or(0, |s| s.1) as i64;
        let mut attention = Vec::new();
        let mut prev = 4 * dim;
        for (i, &size) in cfg.attention_mlp.iter().chain(&[1]).enumerate() {
            let a = vs / "attention";
            attention.push(nn::linear(&a / format!("layer{i}"), prev, size as i64, torch_linear(prev)));
            prev = size as i64;
        }
        let width = mlp_input(inputs, dim as usize);
        Ok(Self {
            candidate: cfg.candidate.clone(),
            history: cfg.history.clone(),
            dim,
            attention,
            mlp: mlp(&(vs / "mlp"), width, &cfg.mlp, false),
        })
    }

    fn parameters(cfg: &DinConfig, inputs: &ModelInputs) -> Option<u128> {
        let dim = inputs.sequences.iter().find(|(n, _)| *n == cfg.candidate)?.1;
        let attention: Vec<usize> = cfg.attention_mlp.iter().copied().chain([1]).collect();
        Some(mlp_parameters(4 * dim, &attention) + mlp_parameters(mlp_input(inputs, dim), &cfg.mlp))
    }
}

/// The final MLP's input width: dense features, pooled embeddings, candidate and interest.
fn mlp_input(inputs: &ModelInputs, dim: usize) -> usize {
    inputs.num_dense + inputs.sparse.iter().map(|s| s.1).sum::<usize>() + 2 * dim
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TypedModel;
    use tch::Device;

    fn inputs() -> ModelInputs {
        ModelInputs {
            num_dense: 1,
            sparse: vec![("user".into(), 2)],
            sparse_dim_keys: vec![KeyPath::root().key("tables").index(0).key("dim")],
            num_tasks: 1,
            sequences: vec![("item".into(), 3), ("history".into(), 3)],
        }
    }

    fn config() -> DinConfig {
        DinConfig { candidate: "item".into(), history: "history".into(), attention_mlp: vec![4], mlp: vec![5, 1] }
    }

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap()
    }

    /// `x @ w.T + b` in float64 for a `[n_in]` vector.
    fn linear(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
        b.iter()
            .enumerate()
            .map(|(o, bo)| bo + x.iter().enumerate().map(|(i, xi)| xi * w[o * x.len() + i]).sum::<f64>())
            .collect()
    }

    #[test]
    fn forward_matches_a_float64_recomputation() {
        let _g = crate::seeded(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = Din::build(&vs.root(), &config(), &inputs()).unwrap();
        let vars = vs.variables();
        let var = |n: &str| values(&vars[n]);
        // Two examples: histories of 2 and 0 items.
        let dense = Tensor::from_slice(&[0.5f32, -1.0]).view([2, 1]);
        let pooled = Tensor::from_slice(&[0.1f32, 0.2, -0.3, 0.4]).view([2, 2]);
        let item =
            JaggedEmbeddings::new(Tensor::from_slice(&[0.3f32, -0.2, 0.1, 0.0, 0.5, -0.5]).view([2, 3]), vec![1, 1])
                .unwrap();
        let hist_rows = [0.2f32, 0.4, -0.1, -0.3, 0.1, 0.6];
        let history = JaggedEmbeddings::new(Tensor::from_slice(&hist_rows).view([2, 3]), vec![2, 0]).unwrap();
        let seqs = vec![("item".to_string(), item), ("history".to_string(), history)];
        let got =
            values(&model.forward_input(
                &ModelInput { dense: &dense, pooled: &pooled, sequences: &seqs, catalogue: None },
                false,
            ));
        let f = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let (cands, hist) = (f(&[0.3, -0.2, 0.1, 0.0, 0.5, -0.5]), f(&hist_rows));
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        for (e, (hs, d, p)) in
            [(vec![&hist[0..3], &hist[3..6]], 0.5, [0.1, 0.2]), (vec![], -1.0, [-0.3, 0.4])].into_iter().enumerate()
        {
            let c = &cands[e * 3..e * 3 + 3];
            let mut interest = [0.0f64; 3];
            for h in hs {
                let mut x: Vec<f64> = h.to_vec();
                x.extend_from_slice(c);
                x.extend(h.iter().zip(c).map(|(a, b)| a - b));
                x.extend(h.iter().zip(c).map(|(a, b)| a * b));
                let a1: Vec<f64> = linear(&x, &var("attention.layer0.weight"), &var("attention.layer0.bias"))
                    .into_iter()
                    .map(sig)
                    .collect();
                let w = linear(&a1, &var("attention.layer1.weight"), &var("attention.layer1.bias"))[0];
                for k in 0..3 {
                    interest[k] += w * h[k];
                }
            }
            let mut x = vec![d, p[0], p[1]];
            x.extend_from_slice(c);
            x.extend_from_slice(&interest);
            let h1: Vec<f64> = linear(&x, &var("mlp.layer0.weight"), &var("mlp.layer0.bias"))
                .into_iter()
                .map(|v| v.max(0.0))
                .collect();
            let logit = linear(&h1, &var("mlp.layer1.weight"), &var("mlp.layer1.bias"))[0];
            assert!((got[e] - logit).abs() < 1e-6, "example {e}: {} vs {logit}", got[e]);
        }
        assert_eq!(
            Din::parameters(&config(), &inputs()),
            Some(vs.variables().values().map(|t| t.numel() as u128).sum())
        );
    }

    #[test]
    fn the_gradient_reaches_every_history_row_and_the_candidate() {
        let _g = crate::seeded(4);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = Din::build(&vs.root(), &config(), &inputs()).unwrap();
        let item = Tensor::from_slice(&[0.3f32, -0.2, 0.1]).view([1, 3]).set_requires_grad(true);
        let hist = Tensor::from_slice(&[0.2f32, 0.4, -0.1, -0.3, 0.1, 0.6]).view([2, 3]).set_requires_grad(true);
        let seqs = vec![
            ("item".to_string(), JaggedEmbeddings::new(item.shallow_clone(), vec![1]).unwrap()),
            ("history".to_string(), JaggedEmbeddings::new(hist.shallow_clone(), vec![2]).unwrap()),
        ];
        let (dense, pooled) =
            (Tensor::zeros([1, 1], (Kind::Float, Device::Cpu)), Tensor::zeros([1, 2], (Kind::Float, Device::Cpu)));
        model
            .forward_input(&ModelInput { dense: &dense, pooled: &pooled, sequences: &seqs, catalogue: None }, true)
            .sum(Kind::Float)
            .backward();
        for (name, g) in [("item", item.grad()), ("history", hist.grad())] {
            let g = values(&g);
            assert!(g.iter().all(|x| x.is_finite()) && g.iter().any(|&x| x != 0.0), "{name}: {g:?}");
        }
        assert!(
            values(&hist.grad())[..3].iter().any(|&x| x != 0.0) && values(&hist.grad())[3..].iter().any(|&x| x != 0.0)
        );
    }

    #[test]
    fn check_names_missing_or_mismatched_sequence_features() {
        let mut bad = inputs();
        bad.sequences[1].1 = 4;
        let text =
            |d: Vec<Diagnostic>| d.iter().map(|d| format!("{}: {}", d.key, d.message)).collect::<Vec<_>>().join("\n");
        let e = text(Din::check(&config(), &bad));
        assert!(e.contains("model.history: the history's dim (4) differs from the candidate's (3)"), "{e}");
        let e = text(Din::check(&DinConfig { history: "histroy".into(), mlp: vec![5, 2], ..config() }, &inputs()));
        assert!(e.contains("model.history: \"histroy\" is not a sequence feature"), "{e}");
        assert!(e.contains("model.mlp[1]"), "{e}");
        assert!(Din::check(&config(), &inputs()).is_empty());
    }
}
