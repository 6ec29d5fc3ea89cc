//! SASRec, self-attentive sequential recommendation (Kang & McAuley, ICDM 2018), in the form
//! RecBole 1.2 trains it: a user is the causal self-attention encoding of their history, and
//! the next item is predicted among every item of the catalogue (the item table's rows, the
//! same embeddings the history is read with).
//!
//! The history (a sequence feature, most recent id last) keeps its latest `max_length` ids,
//! laid out from position 0 (the oldest kept) on. Each position's input is the item's
//! embedding plus a learned position embedding, then LayerNorm and dropout. Each of `blocks`
//! blocks is multi-head self-attention where a position sees itself and the positions before
//! it (scores of the others get -10000 added, as RecBole), its output projection, dropout, a
//! residual connection and LayerNorm; then a feed-forward layer (`inner_size`, exact GELU),
//! dropout, residual and LayerNorm. The user's embedding is the output at the latest history
//! position (zeros for an empty history). Linear layers and position embeddings start
//! `N(0, 0.02)` with zero biases, LayerNorms at one and zero.
//!
//! Training (an objective of its own, [`DenseModel::loss`]): cross-entropy of the example's
//! target item (`target`, one id) against the catalogue, `loss = "softmax"` over every row of
//! the item table (the engine looks them all up each step, [`CatalogueRows::All`]) or
//! `loss = "sampled_softmax"` over the target and `negatives` rows drawn uniformly for the
//! batch (a drawn row equal to an example's target is left out of its softmax). Examples with
//! an empty history or without exactly one target id do not count; the loss is their mean
//! (weighted by sample weights when the data has them). Labels are not read: every example is
//! an observed next item.
//!
//! The logit an evaluation or `predict` gets for an example is the score of its target item,
//! `user · item`; the `full_ranking` metric ranks that item among every row
//! ([`crate::NextItem`]).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor, nn, nn::Module};
use trainrec_types::{Diagnostic, KeyPath};

use crate::din::sequence_dim;
use crate::mlp;
use crate::sequence::{CatalogueRequest, CatalogueRows, JaggedEmbeddings, ModelInput};
use crate::{DenseModel, LossInput, ModelError, ModelInputs, NextItem};

/// SASRec: causal self-attention over the user's history, scored against the item table
/// (Kang & McAuley 2018, RecBole's form). Reads sequence features.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SasRecConfig {
    /// The sequence feature holding the user's history, most recent id last (for example the
    /// MovieLens sampler's `history`). Its table is the catalogue: every row is an item.
    #[serde(default = "default_history")]
    pub history: String,
    /// The sequence feature holding the example's next item (one id), read by the history's
    /// table.
    #[serde(default = "default_target")]
    pub target: String,
    /// The latest history ids kept (RecBole's `MAX_ITEM_LIST_LENGTH`); also the number of
    /// position embeddings.
    #[serde(default = "default_max_length")]
    pub max_length: usize,
    /// Transformer blocks (RecBole's `n_layers`).
    #[serde(default = "default_blocks")]
    pub blocks: usize,
    /// Attention heads; they must divide the item table's dim.
    #[serde(default = "default_heads")]
    pub heads: usize,
    /// Width of each block's feed-forward layer.
    #[serde(default = "default_inner_size")]
    pub inner_size: usize,
    /// Dropout after the input embedding, the attention output and the feed-forward layer
    /// (RecBole's `hidden_dropout_prob`), in training only.
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    /// Dropout on the attention weights (RecBole's `attn_dropout_prob`), in training only.
    #[serde(default = "default_dropout")]
    pub attention_dropout: f64,
    /// The LayerNorms' epsilon.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// The training objective: `"softmax"` (cross-entropy over every item of the table) or
    /// `"sampled_softmax"` (over the target and `negatives` uniformly drawn items).
    #[serde(default)]
    pub loss: SasRecLoss,
    /// Items drawn per batch as shared negatives with `loss = "sampled_softmax"`.
    #[serde(default = "default_negatives")]
    pub negatives: usize,
}

/// SASRec's training objective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SasRecLoss {
    /// Cross-entropy over every row of the item table.
    #[default]
    Softmax,
    /// Cross-entropy over the target and `negatives` rows drawn uniformly for the batch.
    SampledSoftmax,
}

fn default_history() -> String {
    "history".into()
}
fn default_target() -> String {
    "item_id".into()
}
fn default_max_length() -> usize {
    50
}
fn default_blocks() -> usize {
    2
}
fn default_heads() -> usize {
    2
}
fn default_inner_size() -> usize {
    256
}
fn default_dropout() -> f64 {
    0.5
}
fn default_layer_norm_eps() -> f64 {
    1e-12
}
fn default_negatives() -> usize {
    100
}

/// One transformer block.
struct Block {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    output: nn::Linear,
    attention_norm: nn::LayerNorm,
    inner: nn::Linear,
    outer: nn::Linear,
    ffn_norm: nn::LayerNorm,
}

/// The SASRec model.
pub struct SasRec {
    history: String,
    target: String,
    max_length: usize,
    heads: i64,
    dim: i64,
    dropout: f64,
    attention_dropout: f64,
    loss: SasRecLoss,
    negatives: usize,
    positions: Tensor,
    input_norm: nn::LayerNorm,
    blocks: Vec<Block>,
}

/// Inverted dropout in training: each value zeroed with probability `p`, the others scaled by
/// `1 / (1 - p)`. The mask comes from one uniform draw compared with `p` (libtorch's `dropout`
/// draws Bernoulli variates, several times slower on a CPU).
fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if !train || p == 0.0 {
        return x.shallow_clone();
    }
    let keep = x.rand_like().ge(p).to_kind(x.kind());
    x * keep / (1.0 - p)
}

/// `N(0, 0.02)` weights and zero biases (RecBole's `initializer_range`).
fn linear(vs: &nn::Path, input: i64, output: i64) -> nn::Linear {
    let config = nn::LinearConfig {
        ws_init: nn::Init::Randn { mean: 0.0, stdev: 0.02 },
        bs_init: Some(nn::Init::Const(0.0)),
        bias: true,
    };
    nn::linear(vs, input, output, config)
}

fn layer_norm(vs: &nn::Path, dim: i64, eps: f64) -> nn::LayerNorm {
    nn::layer_norm(vs, vec![dim], nn::LayerNormConfig { eps, ..Default::default() })
}

impl SasRec {
    /// Each example's latest `max_length` history rows laid out from position 0,
    /// `[batch, length, dim]` (zeros after the last), with the number kept per example.
    fn padded_history(&self, history: &JaggedEmbeddings) -> (Tensor, Vec<usize>) {
        let l = history.max_length().min(self.max_length).max(1);
        let pad_row = history.values.size()[0];
        let mut index = vec![pad_row; history.batch_size() * l];
        let mut kept = Vec::with_capacity(history.batch_size());
        for (e, (&start, &n)) in history.offsets().iter().zip(&history.lengths).enumerate() {
            let m = n.min(l);
            for j in 0..m {
                index[e * l + j] = (start + n - m + j) as i64;
            }
            kept.push(m);
        }
        let device = history.values.device();
        let pad = Tensor::zeros([1, self.dim], (history.values.kind(), device));
        let rows = Tensor::cat(&[&history.values, &pad], 0);
        let index = Tensor::from_slice(&index).to_device(device);
        (rows.index_select(0, &index).view([history.batch_size() as i64, l as i64, self.dim]), kept)
    }

    /// The users' embeddings `[batch, dim]` from their histories (zeros for an empty one).
    fn users(&self, history: &JaggedEmbeddings, train: bool) -> Tensor {
        let (x, kept) = self.padded_history(history);
        let (b, l) = (x.size()[0], x.size()[1]);
        let device = x.device();
        let x = &x + self.positions.narrow(0, 0, l).unsqueeze(0);
        let mut x = dropout(&self.input_norm.forward(&x), self.dropout, train);
        // Position i attends to positions j <= i that hold an id.
        let mut allowed = vec![0f32; kept.len() * (l * l) as usize];
        for (e, &m) in kept.iter().enumerate() {
            for i in 0..l as usize {
                for j in 0..m.min(i + 1) {
                    allowed[(e * l as usize + i) * l as usize + j] = 1.0;
                }
            }
        }
        let allowed = Tensor::from_slice(&allowed).to_device(device).view([b, 1, l, l]);
        let bias = (1.0 - allowed) * -10000.0;
        let last: Vec<i64> = kept.iter().enumerate().map(|(e, &m)| e as i64 * l + m.max(1) as i64 - 1).collect();
        let last = Tensor::from_slice(&last).to_device(device);
        let (lower, top) = self.blocks.split_at(self.blocks.len() - 1);
        for block in lower {
            x = self.block(block, &x, &x, &bias, train);
        }
        // Only the latest position's output is read: the last block computes its queries alone
        // (the keys and values still cover every position).
        let query = x.reshape([b * l, self.dim]).index_select(0, &last).view([b, 1, self.dim]);
        let bias = bias.view([b * l, 1, l]).index_select(0, &last).view([b, 1, 1, l]);
        let users = self.block(&top[0], &query, &x, &bias, train).view([b, self.dim]);
        let nonempty: Vec<f32> = kept.iter().map(|&m| (m > 0) as u8 as f32).collect();
        let kind = users.kind();
        users * Tensor::from_slice(&nonempty).to_device(device).to_kind(kind).unsqueeze(1)
    }

    /// One block for queries `x` `[batch, q, dim]` over keys and values from `context`
    /// `[batch, l, dim]` (the same positions, or the latest of them), with the attention
    /// score bias `bias` `[batch, 1, q, l]`.
    fn block(&self, block: &Block, x: &Tensor, context: &Tensor, bias: &Tensor, train: bool) -> Tensor {
        let (b, q_len, l) = (x.size()[0], x.size()[1], context.size()[1]);
        let dh = self.dim / self.heads;
        let split = |t: Tensor, n: i64| t.view([b, n, self.heads, dh]).permute([0, 2, 1, 3]);
        let q = split(block.query.forward(x), q_len);
        let k = split(block.key.forward(context), l);
        let v = split(block.value.forward(context), l);
        let scores = q.matmul(&k.transpose(-1, -2)) / (dh as f64).sqrt() + bias;
        let probs = dropout(&scores.softmax(-1, scores.kind()), self.attention_dropout, train);
        let attended = probs.matmul(&v).permute([0, 2, 1, 3]).contiguous().view([b, q_len, self.dim]);
        let attended = dropout(&block.output.forward(&attended), self.dropout, train);
        let x = block.attention_norm.forward(&(attended + x));
        let ffn = dropout(&block.outer.forward(&block.inner.forward(&x).gelu("none")), self.dropout, train);
        block.ffn_norm.forward(&(ffn + x))
    }

    /// Which examples count in the loss (a history and one target id), as a float mask
    /// `[batch]`, and their target rows' positions in the target feature's values.
    fn counted(history: &JaggedEmbeddings, target: &JaggedEmbeddings) -> (Vec<f32>, Vec<i64>) {
        let offsets = target.offsets();
        let mut mask = Vec::with_capacity(target.batch_size());
        let mut rows = Vec::with_capacity(target.batch_size());
        for (e, (&h, &t)) in history.lengths.iter().zip(&target.lengths).enumerate() {
            let counts = h > 0 && t == 1;
            mask.push(counts as u8 as f32);
            rows.push(if t > 0 { offsets[e] as i64 } else { 0 });
        }
        (mask, rows)
    }

    /// Each example's target item row `[batch, dim]` (the rows at `rows` of the target feature,
    /// [`SasRec::counted`]'s), zeros for an example without a target.
    fn target_items(&self, target: &JaggedEmbeddings, rows: &[i64]) -> Tensor {
        let device = target.values.device();
        if target.values.size()[0] == 0 {
            return Tensor::zeros([target.batch_size() as i64, self.dim], (target.values.kind(), device));
        }
        let items = target.values.index_select(0, &Tensor::from_slice(rows).to_device(device));
        let present: Vec<f32> = target.lengths.iter().map(|&n| (n > 0) as u8 as f32).collect();
        items * Tensor::from_slice(&present).to_device(device).to_kind(target.values.kind()).unsqueeze(1)
    }
}

impl DenseModel for SasRec {
    /// Without sequence features every score is 0.
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor {
        self.forward_input(&ModelInput::pooled(dense, sparse), train)
    }

    fn forward_input(&self, input: &ModelInput<'_>, train: bool) -> Tensor {
        let b = input.dense.size()[0];
        let (Some(history), Some(target)) = (input.sequence(&self.history), input.sequence(&self.target)) else {
            return Tensor::zeros([b, 1], (Kind::Float, input.dense.device()));
        };
        let users = self.users(history, train);
        let (_, rows) = Self::counted(history, target);
        (users * self.target_items(target, &rows)).sum_dim_intlist(1, true, None::<Kind>)
    }

    fn loss(&mut self, input: &LossInput<'_>) -> Option<Tensor> {
        let find = |name: &str| input.sequences.iter().find(|(n, _)| n == name).map(|(_, j)| j);
        let (history, target) = (find(&self.history)?, find(&self.target)?);
        let catalogue = input.catalogue?;
        let users = self.users(history, true);
        let device = users.device();
        let (mask, rows) = Self::counted(history, target);
        let mut mask = Tensor::from_slice(&mask).to_device(device);
        if let Some(w) = input.weights {
            mask *= w.to_kind(Kind::Float);
        }
        let b = users.size()[0];
        let target_ids: Tensor = {
            let ids = input.ids.key_index(&self.target).map(|k| input.ids.feature(k));
            let v: Vec<i64> = match ids {
                Some(f) => (0..b as usize).map(|e| f.bag(e).first().copied().unwrap_or(0)).collect(),
                None => vec![0; b as usize],
            };
            Tensor::from_slice(&v).to_device(device)
        };
        let per_example = match self.loss {
            SasRecLoss::Softmax => {
                // Row r of the catalogue is item r: the target's column is its id.
                let logits = users.matmul(&catalogue.rows.transpose(0, 1));
                let rows = catalogue.rows.size()[0];
                let target_ids = target_ids.clamp(0, rows - 1);
                logits.log_softmax(1, Kind::Float).gather(1, &target_ids.unsqueeze(1), false).squeeze_dim(1).neg()
            }
            SasRecLoss::SampledSoftmax => {
                let positive = (&users * self.target_items(target, &rows)).sum_dim_intlist(1, true, None::<Kind>);
                let negative = users.matmul(&catalogue.rows.transpose(0, 1));
                let hits = target_ids.unsqueeze(1).eq_tensor(&catalogue.ids.unsqueeze(0));
                let negative = negative.masked_fill(&hits, f64::NEG_INFINITY);
                let logits = Tensor::cat(&[positive, negative], 1);
                logits.log_softmax(1, Kind::Float).select(1, 0).neg()
            }
        };
        let total = mask.sum(Kind::Float);
        let loss = (per_example.to_kind(Kind::Float) * &mask).sum(Kind::Float);
        Some(loss / total.clamp_min(f64::MIN_POSITIVE))
    }

    fn next_item(&self) -> Option<&dyn NextItem> {
        Some(self)
    }

    fn catalogue(&self) -> Option<CatalogueRequest> {
        let rows = match self.loss {
            SasRecLoss::Softmax => CatalogueRows::All,
            SasRecLoss::SampledSoftmax => CatalogueRows::Uniform(self.negatives),
        };
        Some(CatalogueRequest { feature: self.history.clone(), rows })
    }
}

impl NextItem for SasRec {
    fn item_feature(&self) -> &str {
        &self.history
    }

    fn target_feature(&self) -> &str {
        &self.target
    }

    fn user_embeddings(&self, input: &ModelInput<'_>) -> Tensor {
        match input.sequence(&self.history) {
            Some(h) => self.users(h, false),
            None => Tensor::zeros([input.dense.size()[0], self.dim], (Kind::Float, input.dense.device())),
        }
    }
}

impl crate::TypedModel for SasRec {
    type Config = SasRecConfig;
    const KIND: &'static str = "sasrec";
    const READS_SEQUENCES: bool = true;

    fn check(cfg: &SasRecConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        let model = KeyPath::root().key("model");
        let h = sequence_dim("history", &cfg.history, inputs, &mut out);
        let t = sequence_dim("target", &cfg.target, inputs, &mut out);
        if let (Some(h), Some(t)) = (h, t)
            && h != t
        {
            out.push(
                Diagnostic::new(
                    model.key("target"),
                    format!("the target's dim ({t}) differs from the history's ({h})"),
                )
                .with_help("read both from one table (the item table): SASRec scores the target among its rows"),
            );
        }
        mlp::check_positive("max_length", cfg.max_length, "history positions", &mut out);
        mlp::check_positive("blocks", cfg.blocks, "transformer blocks", &mut out);
        mlp::check_positive("heads", cfg.heads, "attention heads", &mut out);
        mlp::check_positive("inner_size", cfg.inner_size, "feed-forward width", &mut out);
        if let Some(h) = h
            && cfg.heads > 0
            && h % cfg.heads != 0
        {
            out.push(
                Diagnostic::new(model.key("heads"), format!("{} heads do not divide the item dim {h}", cfg.heads))
                    .with_help("pick a number of heads that divides the item table's dim"),
            );
        }
        for (key, p) in [("dropout", cfg.dropout), ("attention_dropout", cfg.attention_dropout)] {
            if !(0.0..1.0).contains(&p) {
                out.push(Diagnostic::new(model.key(key), format!("{key} must be in [0, 1), found {p}")));
            }
        }
        if !(cfg.layer_norm_eps.is_finite() && cfg.layer_norm_eps > 0.0) {
            out.push(Diagnostic::new(
                model.key("layer_norm_eps"),
                format!("layer_norm_eps must be a positive number, found {}", cfg.layer_norm_eps),
            ));
        }
        if cfg.loss == SasRecLoss::SampledSoftmax {
            mlp::check_positive("negatives", cfg.negatives, "sampled items per batch", &mut out);
        }
        if inputs.num_tasks != 1 {
            out.push(
                Diagnostic::new(
                    model.key("kind"),
                    format!("sasrec predicts one thing, the next item; the job has {} tasks", inputs.num_tasks),
                )
                .with_help("declare at most one [[tasks]] entry"),
            );
        }
        out
    }

    fn build(vs: &nn::Path, cfg: &SasRecConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        let dim = inputs.sequences.iter().find(|(n, _)| *n == cfg.history).map_or(1, |s| s.1) as i64;
        let eps = cfg.layer_norm_eps;
        let positions = vs.var("positions", &[cfg.max_length as i64, dim], nn::Init::Randn { mean: 0.0, stdev: 0.02 });
        let blocks = (0..cfg.blocks)
            .map(|i| {
                let p = vs / "blocks" / i;
                Block {
                    query: linear(&(&p / "query"), dim, dim),
                    key: linear(&(&p / "key"), dim, dim),
                    value: linear(&(&p / "value"), dim, dim),
                    output: linear(&(&p / "output"), dim, dim),
                    attention_norm: layer_norm(&(&p / "attention_norm"), dim, eps),
                    inner: linear(&(&p / "inner"), dim, cfg.inner_size as i64),
                    outer: linear(&(&p / "outer"), cfg.inner_size as i64, dim),
                    ffn_norm: layer_norm(&(&p / "ffn_norm"), dim, eps),
                }
            })
            .collect();
        Ok(Self {
            history: cfg.history.clone(),
            target: cfg.target.clone(),
            max_length: cfg.max_length,
            heads: cfg.heads as i64,
            dim,
            dropout: cfg.dropout,
            attention_dropout: cfg.attention_dropout,
            loss: cfg.loss,
            negatives: cfg.negatives,
            positions,
            input_norm: layer_norm(&(vs / "input_norm"), dim, eps),
            blocks,
        })
    }

    fn parameters(cfg: &SasRecConfig, inputs: &ModelInputs) -> Option<u128> {
        let d = inputs.sequences.iter().find(|(n, _)| *n == cfg.history)?.1 as u128;
        let inner = cfg.inner_size as u128;
        let block = 4 * (d * d + d) + 2 * 2 * d + (d * inner + inner) + (inner * d + d);
        Some(cfg.max_length as u128 * d + 2 * d + cfg.blocks as u128 * block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TypedModel;
    use crate::sequence::Catalogue;
    use tch::Device;
    use trainrec_sparse::KeyedJaggedTensor;

    const DIM: i64 = 4;

    fn inputs() -> ModelInputs {
        ModelInputs {
            num_dense: 0,
            sparse: vec![],
            sparse_dim_keys: vec![],
            num_tasks: 1,
            sequences: vec![("item_id".into(), DIM as usize), ("history".into(), DIM as usize)],
        }
    }

    fn model(loss: SasRecLoss) -> (nn::VarStore, SasRec) {
        let _g = crate::seeded(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut cfg: SasRecConfig = serde_json::from_str("{}").unwrap();
        (cfg.max_length, cfg.heads, cfg.inner_size, cfg.loss, cfg.negatives) = (5, 2, 8, loss, 4);
        // Deterministic training forwards: the loss is recomputed from the users outside it.
        (cfg.dropout, cfg.attention_dropout) = (0.0, 0.0);
        let m = SasRec::build(&vs.root(), &cfg, &inputs()).unwrap();
        // Non-trivial LayerNorms and biases.
        tch::no_grad(|| {
            for (name, mut v) in vs.variables() {
                if !name.ends_with("positions") && !name.contains("query.weight") {
                    let noise = Tensor::randn(v.size(), (Kind::Float, Device::Cpu)) * 0.3;
                    let _ = v.g_add_(&noise);
                }
            }
        });
        (vs, m)
    }

    fn rows(n: i64) -> Tensor {
        Tensor::randn([n, DIM], (Kind::Float, Device::Cpu))
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn a_user_is_their_latest_ids_whatever_the_batch() {
        let (_vs, m) = model(SasRecLoss::Softmax);
        let _g = crate::seeded(1);
        let all = rows(7);
        // Example 0: 7 ids (5 kept), example 1: none, example 2: 2 ids.
        let batch = JaggedEmbeddings::new(Tensor::cat(&[&all, &all.narrow(0, 0, 2)], 0), vec![7, 0, 2]).unwrap();
        let users = m.users(&batch, false);
        let latest = JaggedEmbeddings::new(all.narrow(0, 2, 5), vec![5]).unwrap();
        assert!(max_diff(&users.narrow(0, 0, 1), &m.users(&latest, false)) < 1e-6);
        assert_eq!(users.get(1).abs().sum(Kind::Float).double_value(&[]), 0.0, "an empty history is a zero user");
        let two = JaggedEmbeddings::new(all.narrow(0, 0, 2), vec![2]).unwrap();
        assert!(max_diff(&users.narrow(0, 2, 1), &m.users(&two, false)) < 1e-6);
    }

    #[test]
    fn the_last_block_on_the_latest_query_alone_equals_the_whole_block() {
        let (_vs, m) = model(SasRecLoss::Softmax);
        let _g = crate::seeded(2);
        let history = JaggedEmbeddings::new(rows(9), vec![4, 5]).unwrap();
        let got = m.users(&history, false);
        // Every block on every position, then the latest position's output.
        let (x, kept) = m.padded_history(&history);
        let l = x.size()[1];
        let mut x = m.input_norm.forward(&(&x + m.positions.narrow(0, 0, l).unsqueeze(0)));
        let mut allowed = vec![0f32; 2 * (l * l) as usize];
        for (e, &k) in kept.iter().enumerate() {
            for i in 0..l as usize {
                for j in 0..k.min(i + 1) {
                    allowed[(e * l as usize + i) * l as usize + j] = 1.0;
                }
            }
        }
        let bias = (1.0 - Tensor::from_slice(&allowed).view([2, 1, l, l])) * -10000.0;
        for block in &m.blocks {
            x = m.block(block, &x, &x, &bias, false);
        }
        let want = Tensor::stack(&[x.get(0).get(3), x.get(1).get(4)], 0);
        assert!(max_diff(&got, &want) < 1e-5, "{got} vs {want}");
    }

    /// The loss for targets `targets` (one each, rows of `table`) over random histories of
    /// `lengths`, and the users it scored.
    fn loss_of(
        m: &mut SasRec,
        lengths: Vec<usize>,
        targets: &[i64],
        table: &Tensor,
        catalogue: &Catalogue,
    ) -> (Tensor, Tensor) {
        let n: usize = lengths.iter().sum();
        let history = JaggedEmbeddings::new(rows(n as i64), lengths).unwrap();
        let target_rows = table.index_select(0, &Tensor::from_slice(targets));
        let target = JaggedEmbeddings::new(target_rows, vec![1; targets.len()]).unwrap();
        let b = targets.len();
        let ids = KeyedJaggedTensor::new(vec!["item_id".into()], targets.to_vec(), None, vec![1; b], b).unwrap();
        let users = m.users(&history, true);
        let seqs = vec![("item_id".to_string(), target), ("history".to_string(), history)];
        let (dense, pooled, labels) = (
            Tensor::zeros([b as i64, 0], (Kind::Float, Device::Cpu)),
            Tensor::zeros([b as i64, 0], (Kind::Float, Device::Cpu)),
            Tensor::ones([b as i64, 1], (Kind::Float, Device::Cpu)),
        );
        let input = LossInput {
            dense: &dense,
            sparse: &pooled,
            labels: &labels,
            ids: &ids,
            weights: None,
            sequences: &seqs,
            catalogue: Some(catalogue),
        };
        (m.loss(&input).unwrap(), users)
    }

    #[test]
    fn the_full_softmax_is_the_mean_cross_entropy_of_examples_with_a_history() {
        let (_vs, mut m) = model(SasRecLoss::Softmax);
        let _g = crate::seeded(4);
        let table = rows(10);
        let catalogue = Catalogue { ids: Tensor::arange(10, (Kind::Int64, Device::Cpu)), rows: table.shallow_clone() };
        let targets = [3i64, 7, 1];
        let (loss, users) = loss_of(&mut m, vec![2, 0, 3], &targets, &table, &catalogue);
        let logits = users.to_kind(Kind::Double).matmul(&table.to_kind(Kind::Double).transpose(0, 1));
        let logp = logits.log_softmax(1, Kind::Double);
        // Example 1 has no history: it does not count.
        let want = -(logp.double_value(&[0, 3]) + logp.double_value(&[2, 1])) / 2.0;
        assert!((loss.double_value(&[]) - want).abs() < 1e-5, "{} vs {want}", loss.double_value(&[]));
    }

    #[test]
    fn a_sampled_softmax_leaves_a_drawn_target_out_of_the_negatives() {
        let (_vs, mut m) = model(SasRecLoss::SampledSoftmax);
        let _g = crate::seeded(4);
        let table = rows(10);
        // Drawn rows 3, 5, 3, 8: the target 3 of example 0 is drawn twice.
        let drawn = Tensor::from_slice(&[3i64, 5, 3, 8]);
        let catalogue = Catalogue { ids: drawn.shallow_clone(), rows: table.index_select(0, &drawn) };
        let targets = [3i64, 6];
        let (loss, users) = loss_of(&mut m, vec![2, 3], &targets, &table, &catalogue);
        let u = users.to_kind(Kind::Double);
        let t = table.to_kind(Kind::Double);
        let score = |e: i64, r: i64| (u.get(e) * t.get(r)).sum(Kind::Double).double_value(&[]);
        let ce = |e: i64, target: i64, negatives: &[i64]| {
            let pos = score(e, target);
            let z: f64 = negatives.iter().map(|&r| score(e, r).exp()).sum::<f64>() + pos.exp();
            -(pos - z.ln())
        };
        let want = (ce(0, 3, &[5, 8]) + ce(1, 6, &[3, 5, 3, 8])) / 2.0;
        assert!((loss.double_value(&[]) - want).abs() < 1e-5, "{} vs {want}", loss.double_value(&[]));
    }
}
