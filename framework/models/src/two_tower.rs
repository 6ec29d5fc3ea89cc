//! The two-tower retrieval model, as TorchRec's retrieval example builds it: a query tower and
//! a candidate tower (MLPs, ReLU after every layer, as TorchRec's `MLP`) over their own pooled
//! embeddings, scored by a dot product.
//!
//! Training is an in-batch softmax over the batch's positive pairs: query `i`'s positive is
//! candidate `i`, the other positives' candidates are its negatives (a repeat of the same
//! candidate is masked out, not counted as a negative). With `logq_correction`, each
//! candidate's logit is lowered by the log of its estimated sampling probability (Yi et al.
//! 2019, "Sampling-bias-corrected neural modeling"), estimated online from the gaps between
//! the steps a candidate appears in. [`crate::DenseModel::forward`] is the pointwise score
//! `<q, c> / temperature` of the example's own pair (so AUC and NE apply to rated pairs), and
//! `recall_at_k` ranks every candidate of the corpus for each positive eval pair.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor, nn, nn::Module};
use trainrec_types::{Diagnostic, FeatureRef};

use crate::mlp::{check_layer_sizes, mlp, mlp_parameters, model_key};
use crate::script::{ScriptModule, Vars};
use crate::{DenseModel, LossInput, ModelError, ModelInputs, Retrieval};

/// Two-tower retrieval: query and candidate towers over their own features, dot-product
/// scores, in-batch softmax training. `[model]` with `kind = "two_tower"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TwoTowerConfig {
    /// Pooled features of the query (user) side, by the names in `tables[].features`.
    pub query_features: Vec<String>,
    /// Pooled features of the candidate (item) side. `recall_at_k` needs exactly one, looked
    /// up one id per example: its table's rows are the corpus ranked.
    pub candidate_features: Vec<String>,
    /// Layer sizes of the query tower (ReLU after each). Its last size must equal the
    /// candidate tower's.
    pub query_tower: Vec<usize>,
    /// Layer sizes of the candidate tower (ReLU after each).
    pub candidate_tower: Vec<usize>,
    /// Logits are dot products divided by this.
    #[serde(default = "defaults::temperature")]
    pub temperature: f64,
    /// Subtract each in-batch candidate's log sampling probability from its logit.
    #[serde(default)]
    pub logq_correction: bool,
    /// Hash buckets of the streaming frequency estimate behind `logq_correction`.
    #[serde(default = "defaults::logq_buckets")]
    pub logq_buckets: usize,
    /// Learning rate of the streaming frequency estimate (the paper's alpha).
    #[serde(default = "defaults::logq_alpha")]
    pub logq_alpha: f64,
}

mod defaults {
    pub fn temperature() -> f64 {
        1.0
    }
    pub fn logq_buckets() -> usize {
        1 << 20
    }
    pub fn logq_alpha() -> f64 {
        0.01
    }
}

/// Online estimate of how often each candidate appears (Yi et al. 2019, algorithm 2): per hash
/// bucket, the step it was last seen and a moving average of the gap between sightings; the
/// probability is one over the gap.
#[derive(Debug)]
pub struct FrequencyEstimate {
    last: Vec<f64>,
    gap: Vec<f64>,
    alpha: f64,
    step: f64,
}

impl FrequencyEstimate {
    /// An estimate over `buckets` buckets with learning rate `alpha`.
    pub fn new(buckets: usize, alpha: f64) -> Self {
        Self { last: vec![f64::NAN; buckets.max(1)], gap: vec![0.0; buckets.max(1)], alpha, step: 0.0 }
    }

    /// Records one step's candidates (hashes) and returns each one's estimated probability.
    pub fn update(&mut self, hashes: &[u64]) -> Vec<f64> {
        self.step += 1.0;
        let n = self.last.len() as u64;
        let buckets: Vec<usize> = hashes.iter().map(|&h| (h % n) as usize).collect();
        let mut seen = std::collections::HashSet::new();
        for &b in &buckets {
            if !seen.insert(b) {
                continue; // once per step, however often it repeats within the batch
            }
            if self.last[b].is_nan() {
                // First sighting: as if last seen before step 1.
                self.gap[b] = self.step;
            } else {
                self.gap[b] = (1.0 - self.alpha) * self.gap[b] + self.alpha * (self.step - self.last[b]);
            }
            self.last[b] = self.step;
        }
        buckets.iter().map(|&b| 1.0 / self.gap[b].max(1.0)).collect()
    }
}

/// The two-tower model.
pub struct TwoTower {
    query: nn::Sequential,
    candidate: nn::Sequential,
    /// Column indices of the query / candidate features in the pooled tensor.
    query_cols: Tensor,
    candidate_cols: Tensor,
    /// The candidate side's input features (KJT keys), for the logQ hashes and the mask.
    candidate_inputs: Vec<String>,
    candidate_features: Vec<String>,
    temperature: f64,
    logq: Option<FrequencyEstimate>,
}

fn columns(inputs: &ModelInputs, names: &[String]) -> Vec<i64> {
    let mut offsets = BTreeMap::new();
    let mut at = 0;
    for (name, d) in &inputs.sparse {
        offsets.insert(name.as_str(), (at, *d));
        at += d;
    }
    names
        .iter()
        .flat_map(|n| {
            let (o, d) = offsets[n.as_str()];
            (o..o + d).map(|c| c as i64)
        })
        .collect()
}

impl TwoTower {
    /// Builds the parameters under `vs`; `config` must have passed [`crate::TypedModel::check`].
    pub fn new(vs: &nn::Path, config: &TwoTowerConfig, inputs: &ModelInputs) -> Self {
        let q = columns(inputs, &config.query_features);
        let c = columns(inputs, &config.candidate_features);
        Self {
            query: mlp(&(vs / "query_tower"), q.len(), &config.query_tower, true),
            candidate: mlp(&(vs / "candidate_tower"), c.len(), &config.candidate_tower, true),
            query_cols: Tensor::from_slice(&q).to_device(vs.device()),
            candidate_cols: Tensor::from_slice(&c).to_device(vs.device()),
            candidate_inputs: config.candidate_features.iter().map(|f| FeatureRef::parse(f).input.to_owned()).collect(),
            candidate_features: config.candidate_features.clone(),
            temperature: config.temperature,
            logq: config.logq_correction.then(|| FrequencyEstimate::new(config.logq_buckets, config.logq_alpha)),
        }
    }

    /// One hash per example of its candidate's ids (equal candidates, equal hashes).
    fn candidate_hashes(&self, ids: &trainrec_sparse::KeyedJaggedTensor) -> Vec<u64> {
        let n = ids.stride();
        let mut h = vec![0x9E37_79B9_7F4A_7C15u64; n];
        for name in &self.candidate_inputs {
            let Some(k) = ids.key_index(name) else { continue };
            let f = ids.feature(k);
            for (b, hash) in h.iter_mut().enumerate().take(f.num_bags()) {
                for &id in f.bag(b) {
                    *hash = (*hash ^ id as u64).wrapping_mul(0x0100_0000_01B3).rotate_left(17);
                }
                *hash = (*hash ^ 0xFF).wrapping_mul(0x0100_0000_01B3);
            }
        }
        h
    }
}

impl Retrieval for TwoTower {
    fn candidate_features(&self) -> &[String] {
        &self.candidate_features
    }
    fn query_embeddings(&self, _dense: &Tensor, sparse: &Tensor) -> Tensor {
        self.query.forward(&sparse.index_select(1, &self.query_cols))
    }
    fn candidate_embeddings(&self, sparse: &Tensor) -> Tensor {
        self.candidate.forward(&sparse.index_select(1, &self.candidate_cols))
    }
}

impl DenseModel for TwoTower {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, _train: bool) -> Tensor {
        let q = self.query_embeddings(dense, sparse);
        let c = self.candidate_embeddings(sparse);
        (q * c).sum_dim_intlist(1, true, Kind::Float) / self.temperature
    }

    fn torchscript(&self, vars: &Vars, m: &mut ScriptModule) -> Result<(), ModelError> {
        let qcols = m.tensor("query_cols", &self.query_cols)?;
        let ccols = m.tensor("candidate_cols", &self.candidate_cols)?;
        let mut body = Vec::new();
        let q = m.mlp(&mut body, vars, "query_tower", &format!("torch.index_select(sparse, 1, {qcols})"), true)?;
        m.method(format!(
            "def query_tower(self, dense: Tensor, sparse: Tensor) -> Tensor:\n{}\n    return {q}\n",
            body.join("\n")
        ));
        let mut body = Vec::new();
        let c = m.mlp(&mut body, vars, "candidate_tower", &format!("torch.index_select(sparse, 1, {ccols})"), true)?;
        m.method(format!(
            "def candidate_tower(self, sparse: Tensor) -> Tensor:\n{}\n    return {c}\n",
            body.join("\n")
        ));
        m.method(format!(
            "def dense_forward(self, dense: Tensor, sparse: Tensor) -> Tensor:\n    q = self.query_tower(dense, sparse)\n    c = self.candidate_tower(sparse)\n    return torch.sum(q * c, [1], True) / {:?}\n",
            self.temperature
        ));
        Ok(())
    }

    fn loss(&mut self, input: &LossInput<'_>) -> Option<Tensor> {
        // The positives: label (first task) above one half.
        let positive: Vec<i64> = {
            let l: Vec<f32> =
                Vec::try_from(input.labels.select(1, 0).to_device(tch::Device::Cpu).contiguous()).unwrap_or_default();
            l.iter().enumerate().filter(|(_, y)| **y > 0.5).map(|(i, _)| i as i64).collect()
        };
        let hashes_all = self.candidate_hashes(input.ids);
        // Index tensors live where the batch does (a GPU job's tensors are on the GPU).
        let device = input.sparse.device();
        let rows = Tensor::from_slice(&positive).to_device(device);
        let sparse = input.sparse.index_select(0, &rows);
        let q = self.query_embeddings(input.dense, &sparse);
        let c = self.candidate_embeddings(&sparse);
        let p = positive.len() as i64;
        if p == 0 {
            // No positive pair: nothing to learn from this batch (a zero that keeps the graph).
            return Some(input.sparse.sum(Kind::Float) * 0.0);
        }
        let scores = q.matmul(&c.transpose(0, 1)) / self.temperature;
        let hashes: Vec<u64> = positive.iter().map(|&i| hashes_all[i as usize]).collect();
        let mut logits = match &mut self.logq {
            Some(est) => {
                let log_p: Vec<f32> = est.update(&hashes).iter().map(|&x| x.ln() as f32).collect();
                scores - Tensor::from_slice(&log_p).view([1, p]).to_device(device)
            }
            None => scores,
        };
        // A candidate repeated in the batch is the same item, not a negative: mask it out of
        // the other rows that have it as their positive.
        let mut mask = vec![false; (p * p) as usize];
        let mut any = false;
        for i in 0..p as usize {
            for j in 0..p as usize {
                if i != j && hashes[i] == hashes[j] {
                    mask[i * p as usize + j] = true;
                    any = true;
                }
            }
        }
        if any {
            let mask = Tensor::from_slice(&mask).view([p, p]).to_device(device);
            logits = logits.masked_fill(&mask, f64::NEG_INFINITY);
        }
        let target = Tensor::arange(p, (Kind::Int64, device));
        match input.weights {
            // Sample weights: the positives' losses weighed by their examples' weights.
            Some(w) => {
                let w = w.index_select(0, &rows);
                let per = logits.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::None, -100, 0.0);
                let total = w.sum(Kind::Float);
                Some((per * &w).sum(Kind::Float) / total.clamp_min(f64::MIN_POSITIVE))
            }
            None => Some(logits.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Mean, -100, 0.0)),
        }
    }

    fn retrieval(&self) -> Option<&dyn Retrieval> {
        Some(self)
    }
}

/// Registers the two-tower model as `kind = "two_tower"`, through the same typed API a plugin
/// uses.
pub type TwoTowerFactory = crate::TypedModelFactory<TwoTower>;

impl TwoTowerFactory {
    fn problems(cfg: &TwoTowerConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let model = model_key();
        let mut out = Vec::new();
        let names: Vec<&str> = inputs.sparse.iter().map(|(n, _)| n.as_str()).collect();
        let mut side_of = BTreeMap::new();
        for (key, list) in [("query_features", &cfg.query_features), ("candidate_features", &cfg.candidate_features)] {
            if list.is_empty() {
                out.push(
                    Diagnostic::new(model.key(key), format!("{key} needs at least one feature"))
                        .with_help(format!("pooled features of this job: {}", names.join(", "))),
                );
            }
            for (i, f) in list.iter().enumerate() {
                if !names.contains(&f.as_str()) {
                    out.push(
                        Diagnostic::new(model.key(key).index(i), format!("no table looks up feature {f:?}"))
                            .with_help(trainrec_types::suggest(f, "features", &names)),
                    );
                } else if let Some(other) = side_of.insert(f.as_str(), key) {
                    out.push(Diagnostic::new(
                        model.key(key).index(i),
                        format!("feature {f:?} is already in {other}: each feature feeds one tower"),
                    ));
                }
            }
        }
        check_layer_sizes("query_tower", &cfg.query_tower, 1, None, &mut out);
        check_layer_sizes("candidate_tower", &cfg.candidate_tower, 1, None, &mut out);
        if let (Some(&q), Some(&c)) = (cfg.query_tower.last(), cfg.candidate_tower.last()) {
            if q != c {
                out.push(
                    Diagnostic::new(
                        model.key("candidate_tower").index(cfg.candidate_tower.len() - 1),
                        format!("the towers must end in one size (their outputs are dotted): query {q}, candidate {c}"),
                    )
                    .with_help(format!("end candidate_tower with {q}")),
                );
            }
        }
        if !(cfg.temperature.is_finite() && cfg.temperature > 0.0) {
            out.push(Diagnostic::new(model.key("temperature"), "temperature must be a positive number"));
        }
        if cfg.logq_buckets == 0 {
            out.push(Diagnostic::new(model.key("logq_buckets"), "logq_buckets must be positive"));
        }
        if !(cfg.logq_alpha > 0.0 && cfg.logq_alpha <= 1.0) {
            out.push(Diagnostic::new(model.key("logq_alpha"), "logq_alpha must be in (0, 1]"));
        }
        if inputs.num_tasks != 1 {
            out.push(Diagnostic::new(
                trainrec_types::KeyPath::root().key("tasks"),
                format!("the two-tower model trains one task (its positive pairs); this job has {}", inputs.num_tasks),
            ));
        }
        out
    }
}

impl crate::TypedModel for TwoTower {
    type Config = TwoTowerConfig;
    const KIND: &'static str = "two_tower";

    fn check(cfg: &TwoTowerConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        TwoTowerFactory::problems(cfg, inputs)
    }

    fn build(vs: &nn::Path, cfg: &TwoTowerConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        Ok(TwoTower::new(vs, cfg, inputs))
    }
    fn parameters(cfg: &TwoTowerConfig, inputs: &ModelInputs) -> Option<u128> {
        let width = |names: &[String]| -> usize {
            names.iter().filter_map(|n| inputs.sparse.iter().find(|(s, _)| s == n)).map(|(_, d)| d).sum()
        };
        Some(
            mlp_parameters(width(&cfg.query_features), &cfg.query_tower)
                + mlp_parameters(width(&cfg.candidate_features), &cfg.candidate_tower),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainrec_sparse::KeyedJaggedTensor;
    use trainrec_types::KeyPath;

    fn inputs() -> ModelInputs {
        ModelInputs {
            num_dense: 0,
            sparse: vec![("user_id".into(), 2), ("item_id".into(), 2)],
            sparse_dim_keys: (0..2).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
            num_tasks: 1,
            sequences: Vec::new(),
        }
    }

    fn config(logq: bool) -> TwoTowerConfig {
        TwoTowerConfig {
            query_features: vec!["user_id".into()],
            candidate_features: vec!["item_id".into()],
            query_tower: vec![2],
            candidate_tower: vec![2],
            temperature: 0.5,
            logq_correction: logq,
            logq_buckets: 64,
            logq_alpha: 0.5,
        }
    }

    /// Sets a one-layer tower to the identity (ReLU after it, as TorchRec's MLP).
    fn identity(vs: &nn::VarStore) {
        tch::no_grad(|| {
            for (name, mut v) in vs.variables() {
                if name.ends_with("weight") {
                    v.copy_(&Tensor::eye(2, (Kind::Float, tch::Device::Cpu)));
                } else {
                    let _ = v.zero_();
                }
            }
        });
    }

    fn kjt(items: &[i64]) -> KeyedJaggedTensor {
        let n = items.len();
        let mut values: Vec<i64> = (0..n as i64).collect();
        values.extend_from_slice(items);
        KeyedJaggedTensor::new(vec!["user_id".into(), "item_id".into()], values, None, vec![1; 2 * n], n).unwrap()
    }

    #[test]
    fn in_batch_softmax_matches_a_hand_computation() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let mut m = TwoTower::new(&vs.root(), &config(false), &inputs());
        identity(&vs);
        // Three examples; the second is a negative (left out of the softmax).
        let sparse = Tensor::from_slice(&[1.0f32, 0.0, 1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 0.0, 2.0, 0.5, 0.0]).view([3, 4]);
        let labels = Tensor::from_slice(&[1.0f32, 0.0, 1.0]).view([3, 1]);
        let dense = Tensor::zeros([3, 0], (Kind::Float, tch::Device::Cpu));
        let ids = kjt(&[10, 11, 12]);
        let loss = m.loss(&LossInput::pooled(&dense, &sparse, &labels, &ids, None)).unwrap();
        // Positives: q0 = (1,0), c0 = (1,1); q2 = (0,2), c2 = (0.5,0). Logits / 0.5:
        // row 0: [1, 0.5] / 0.5 = [2, 1]; row 1: [2, 0] / 0.5 = [4, 0].
        let ce = |row: [f64; 2], t: usize| -(row[t] - (row[0].exp() + row[1].exp()).ln());
        let want = (ce([2.0, 1.0], 0) + ce([4.0, 0.0], 1)) / 2.0;
        assert!((loss.double_value(&[]) - want).abs() < 1e-6, "{} vs {want}", loss.double_value(&[]));
        // Sample weights 3, 7 (a negative: unused), 1: the positives' weighted mean.
        let w = Tensor::from_slice(&[3.0f32, 7.0, 1.0]);
        let input = LossInput::pooled(&dense, &sparse, &labels, &ids, Some(&w));
        let weighted = m.loss(&input).unwrap().double_value(&[]);
        let want = (3.0 * ce([2.0, 1.0], 0) + ce([4.0, 0.0], 1)) / 4.0;
        assert!((weighted - want).abs() < 1e-6, "{weighted} vs {want}");
        // The pointwise score of example 0: <(1,0), (1,1)> / 0.5 = 2.
        let s = m.forward(&dense, &sparse, false);
        assert!((s.double_value(&[0, 0]) - 2.0).abs() < 1e-6);
    }

    #[test]
    fn repeated_candidates_are_masked_and_logq_lowers_frequent_ones() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let mut m = TwoTower::new(&vs.root(), &config(false), &inputs());
        identity(&vs);
        let sparse = Tensor::from_slice(&[1.0f32, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]).view([2, 4]);
        let labels = Tensor::from_slice(&[1.0f32, 1.0]).view([2, 1]);
        let dense = Tensor::zeros([2, 0], (Kind::Float, tch::Device::Cpu));
        // The same item twice: each row's only unmasked logit is its own, so the loss is 0.
        let ids = kjt(&[7, 7]);
        let loss = m.loss(&LossInput::pooled(&dense, &sparse, &labels, &ids, None)).unwrap();
        assert!(loss.double_value(&[]).abs() < 1e-6);

        // Frequency estimate by hand (alpha 0.5): item a at steps 1, 2, 3; item b at step 3.
        let mut est = FrequencyEstimate::new(64, 0.5);
        assert_eq!(est.update(&[1]), vec![1.0]); // first sighting at step 1: gap 1
        assert_eq!(est.update(&[1]), vec![1.0]); // gap 0.5 * 1 + 0.5 * 1
        let p = est.update(&[1, 2]);
        assert_eq!(p, vec![1.0, 1.0 / 3.0]); // b first seen at step 3: gap 3
        assert_eq!(est.update(&[2]), vec![1.0 / 2.0]); // 0.5 * 3 + 0.5 * 1 = 2
    }

    #[test]
    fn check_names_unknown_and_mismatched_keys() {
        let mut cfg = config(false);
        cfg.query_features = vec!["usr_id".into()];
        cfg.candidate_tower = vec![4, 3];
        let problems = TwoTowerFactory::problems(&cfg, &inputs());
        let keys: Vec<String> = problems.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["model.query_features[0]", "model.candidate_tower[1]"]);
        assert!(problems[0].help.as_deref().unwrap_or_default().contains("did you mean `user_id`?"));
        let mut cfg = config(false);
        cfg.candidate_features = vec!["user_id".into()];
        let problems = TwoTowerFactory::problems(&cfg, &inputs());
        assert!(problems[0].message.contains("already in query_features"), "{:?}", problems);
    }
}
