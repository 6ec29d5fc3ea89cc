//! `kind = "synthetic"`: Criteo-like batches generated on the fly with a planted signal, so a
//! model has something real to learn and a test knows the best achievable AUC.
//!
//! The truth (dense weights, per-id latent values) is fixed by the run seed; every batch is
//! generated from its own RNG seeded by (seed, split, epoch, batch index), so batches are
//! reproducible and independent of how many were generated before. With `world_size > 1`
//! rank `r` takes batch indices `r, r + world_size, r + 2 world_size, ..` of that stream: the
//! ranks together see each batch of the one-rank stream once.
//!
//! Bag lengths follow `pooling_factor` (the same for every feature), or per feature TorchRec's
//! `RandomRecDataset` parameters: `ids_per_features` alone fixes each feature's length,
//! `min_ids_per_features` with it draws lengths uniformly from `min..=max`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, StandardNormal, Zipf};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{Batch, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split, hash_words};

/// How synthetic ids are drawn from a table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum IdDistribution {
    /// Every row equally likely.
    Uniform,
    /// Zipf over rows (row 0 most frequent), exponent `zipf_alpha`.
    Zipf,
}

/// Criteo-like batches generated on the fly with a planted, learnable signal. `[data.sampler]`
/// with `kind = "synthetic"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyntheticConfig {
    /// Number of dense features (named I1, I2, ...).
    #[serde(default = "defaults::dense_features")]
    pub dense_features: usize,
    /// Names of the sparse features; each must be looked up in a table, whose `rows` bound its ids.
    #[serde(default = "defaults::sparse_features")]
    pub sparse_features: Vec<String>,
    /// Mean number of ids per bag, the same for every feature. 1 gives one id per bag; above 1,
    /// bag lengths are uniform in `1..=2*pooling_factor-1`. Used when `ids_per_features` is not
    /// set; setting both (with `pooling_factor` other than 1) is an error.
    #[serde(default = "defaults::pooling_factor")]
    pub pooling_factor: u32,
    /// Per-feature bag lengths, one entry per sparse feature in `sparse_features` order, as
    /// TorchRec's `RandomRecDataset(ids_per_features=...)`. Without `min_ids_per_features`,
    /// every bag of feature `i` holds exactly `ids_per_features[i]` ids (0: always empty); with
    /// it, this is the largest length. Takes the place of `pooling_factor`, which must then be
    /// left at 1.
    #[serde(default)]
    pub ids_per_features: Option<Vec<u32>>,
    /// Per-feature smallest bag lengths, one entry per sparse feature (needs
    /// `ids_per_features`): each bag of feature `i` gets a length drawn uniformly from
    /// `min_ids_per_features[i]..=ids_per_features[i]`, as TorchRec's `RandomRecDataset` draws
    /// it (`torch.randint(min, max + 1)`); a minimum of 0 allows empty bags. Unlike TorchRec,
    /// leaving it unset makes lengths fixed (TorchRec then draws from `0..=max`; write zeros to
    /// get that).
    #[serde(default)]
    pub min_ids_per_features: Option<Vec<u32>>,
    /// How ids are drawn.
    #[serde(default = "defaults::ids")]
    pub ids: IdDistribution,
    /// Zipf exponent when `ids = "zipf"`.
    #[serde(default = "defaults::zipf_alpha")]
    pub zipf_alpha: f64,
    /// Training examples per epoch.
    #[serde(default = "defaults::train_samples")]
    pub train_samples: u64,
    /// Examples in the eval split (the same examples at every evaluation).
    #[serde(default = "defaults::eval_samples")]
    pub eval_samples: u64,
    /// Scale of the planted logit: 0 makes labels pure noise, larger values make them easier
    /// to predict.
    #[serde(default = "defaults::signal")]
    pub signal: f64,
    /// Examples per session: consecutive examples of a split share a session id, the grouping
    /// key of grouped AUC, NDCG and session recall. Unset: batches carry no grouping key.
    #[serde(default)]
    pub session_size: Option<u64>,
    /// Send each batch deduplicated (TorchRec's VBE): per feature only its distinct bags, with
    /// `inverse_indices` mapping every example to its bag, so sharded embeddings move and pool
    /// each distinct bag once. The model sees the full batch either way.
    #[serde(default)]
    pub dedup: bool,
    /// Names of the label columns, one per task of a multi-task job. The first follows the
    /// planted logit; each further label mixes it with its own planted per-id effects (so tasks
    /// are related but not equal) and is rarer.
    #[serde(default = "defaults::labels")]
    pub labels: Vec<String>,
    /// Sample weights: `[low, high]` gives every example a weight drawn uniformly from that
    /// range (`0 <= low <= high`, finite), which the loss and the metrics weigh it by. Unset:
    /// batches carry no weights (every example weighs 1).
    #[serde(default)]
    pub weight_range: Option<[f64; 2]>,
}

mod defaults {
    pub fn dense_features() -> usize {
        13
    }
    pub fn sparse_features() -> Vec<String> {
        (1..=8).map(|i| format!("C{i}")).collect()
    }
    pub fn pooling_factor() -> u32 {
        1
    }
    pub fn ids() -> super::IdDistribution {
        super::IdDistribution::Uniform
    }
    pub fn zipf_alpha() -> f64 {
        1.05
    }
    pub fn labels() -> Vec<String> {
        vec!["label".to_owned()]
    }
    pub fn train_samples() -> u64 {
        1_000_000
    }
    pub fn eval_samples() -> u64 {
        50_000
    }
    pub fn signal() -> f64 {
        1.0
    }
}

/// Bias of the planted logit: a base CTR of about 25%.
const BIAS: f64 = -1.4;
/// Standard deviation of each sparse feature's per-id latent value.
const LATENT_STD: f64 = 0.6;

/// How bag lengths are drawn (from `pooling_factor` or `ids_per_features`).
#[derive(Clone, Debug, PartialEq)]
enum BagLengths {
    /// `pooling_factor`: 1, or uniform in `1..=2p-1`, for every feature.
    Pooling(u32),
    /// `ids_per_features` alone: exactly this many ids per bag, per feature.
    Fixed(Vec<u32>),
    /// `ids_per_features` with `min_ids_per_features`: uniform in `min..=max`, per feature.
    Range(Vec<(u32, u32)>),
}

impl BagLengths {
    /// The lengths `config` asks for, checking its length keys against its sparse features.
    fn of(config: &SyntheticConfig) -> Result<Self, DataError> {
        let nf = config.sparse_features.len();
        let per_feature = |key: &str, v: &[u32]| {
            if v.len() == nf {
                Ok(())
            } else {
                Err(DataError::config(
                    key,
                    format!(
                        "{key} has {} entries but there are {nf} sparse features ({}): give one per feature",
                        v.len(),
                        config.sparse_features.join(", ")
                    ),
                ))
            }
        };
        match (&config.ids_per_features, &config.min_ids_per_features) {
            (None, None) => Ok(BagLengths::Pooling(config.pooling_factor)),
            (None, Some(_)) => Err(DataError::config(
                "min_ids_per_features",
                "min_ids_per_features needs ids_per_features (the largest bag length per feature)",
            )),
            (Some(_), _) if config.pooling_factor != defaults::pooling_factor() => Err(DataError::config(
                "ids_per_features",
                format!(
                    "set either pooling_factor (found {}) or ids_per_features / min_ids_per_features, not both",
                    config.pooling_factor
                ),
            )),
            (Some(max), None) => {
                per_feature("ids_per_features", max)?;
                Ok(BagLengths::Fixed(max.clone()))
            }
            (Some(max), Some(min)) => {
                per_feature("ids_per_features", max)?;
                per_feature("min_ids_per_features", min)?;
                if let Some(i) = (0..nf).find(|&i| min[i] > max[i]) {
                    return Err(DataError::config(
                        "min_ids_per_features",
                        format!(
                            "min_ids_per_features[{i}] = {} is above ids_per_features[{i}] = {} (feature {:?})",
                            min[i], max[i], config.sparse_features[i]
                        ),
                    ));
                }
                Ok(BagLengths::Range(min.iter().copied().zip(max.iter().copied()).collect()))
            }
        }
    }

    /// The largest length of feature `f`'s bags.
    fn max(&self, f: usize) -> u32 {
        match self {
            BagLengths::Pooling(p) => p.saturating_mul(2) - 1,
            BagLengths::Fixed(l) => l[f],
            BagLengths::Range(r) => r[f].1,
        }
    }

    /// A bag length of feature `f`, drawn from `rng` when it is not fixed.
    fn draw(&self, f: usize, rng: &mut StdRng) -> u32 {
        match self {
            BagLengths::Pooling(1) => 1,
            BagLengths::Pooling(p) => rng.random_range(1..=p.saturating_mul(2) - 1),
            BagLengths::Fixed(l) => l[f],
            BagLengths::Range(r) => {
                let (lo, hi) = r[f];
                if lo == hi { lo } else { rng.random_range(lo..=hi) }
            }
        }
    }
}

/// The synthetic sampler.
#[derive(Clone)]
pub struct SyntheticSampler {
    config: SyntheticConfig,
    schema: FeatureSchema,
    lengths: BagLengths,
    rows: Vec<u64>,
    dense_weights: Vec<f64>,
    dense_means: Vec<f64>,
    seed: u64,
    /// This rank and the number of ranks (batch `index` goes to rank `index % world`).
    rank: u64,
    world: u64,
    zipf: Vec<Option<Zipf<f64>>>,
}

impl SyntheticSampler {
    /// The features a config produces.
    pub fn feature_schema(config: &SyntheticConfig) -> FeatureSchema {
        FeatureSchema {
            num_dense: config.dense_features,
            sparse: config.sparse_features.clone(),
            labels: config.labels.clone(),
            grouping_key: config.session_size.map(|_| "session".to_owned()),
        }
    }

    /// Checks the config: every value in range (the sampler reads no files).
    pub fn check(config: &SyntheticConfig, _base_dir: &std::path::Path) -> Result<(), DataError> {
        let bad = |key: &str, message: String| DataError::Config { key: key.into(), message };
        if config.pooling_factor == 0 {
            return Err(bad("pooling_factor", "pooling_factor must be at least 1".into()));
        }
        if config.ids == IdDistribution::Zipf && !(config.zipf_alpha.is_finite() && config.zipf_alpha > 0.0) {
            return Err(bad("zipf_alpha", format!("zipf_alpha must be positive, found {}", config.zipf_alpha)));
        }
        if let Some([low, high]) = config.weight_range
            && !(low.is_finite() && high.is_finite() && 0.0 <= low && low <= high)
        {
            return Err(bad(
                "weight_range",
                format!("weight_range must be [low, high] with 0 <= low <= high, found [{low}, {high}]"),
            ));
        }
        if !config.signal.is_finite() || config.signal < 0.0 {
            return Err(bad("signal", format!("signal must be >= 0, found {}", config.signal)));
        }
        if config.labels.is_empty() {
            return Err(bad("labels", "at least one label column is needed".into()));
        }
        if let Some(dup) =
            config.labels.iter().enumerate().find_map(|(i, l)| config.labels[..i].contains(l).then_some(l))
        {
            return Err(bad("labels", format!("label column {dup:?} is listed twice")));
        }
        if config.session_size == Some(0) {
            return Err(bad("session_size", "session_size must be at least 1 example".into()));
        }
        if config.train_samples == 0 || config.eval_samples == 0 {
            return Err(bad("train_samples", "train_samples and eval_samples must be positive".into()));
        }
        BagLengths::of(config).map(drop)
    }

    /// Builds the sampler; every sparse feature needs a row count in `ctx`.
    pub fn build(config: SyntheticConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        Self::check(&config, &ctx.base_dir)?;
        let lengths = BagLengths::of(&config)?;
        let rows = config.sparse_features.iter().map(|f| ctx.rows(f)).collect::<Result<Vec<_>, _>>()?;
        let mut world = StdRng::seed_from_u64(hash_words(&[ctx.seed, 0x5EED]));
        let nd = config.dense_features.max(1) as f64;
        let dense_weights =
            (0..config.dense_features).map(|_| world.sample::<f64, _>(StandardNormal) / nd.sqrt()).collect();
        let dense_means = (0..config.dense_features).map(|_| world.random_range(1.0..60.0)).collect();
        let zipf = rows
            .iter()
            .map(|&r| match config.ids {
                IdDistribution::Zipf => Zipf::new(r as f64, config.zipf_alpha).ok(),
                IdDistribution::Uniform => None,
            })
            .collect();
        Ok(Self {
            schema: Self::feature_schema(&config),
            config,
            lengths,
            rows,
            dense_weights,
            dense_means,
            seed: ctx.seed,
            rank: ctx.rank as u64,
            world: ctx.world_size.max(1) as u64,
            zipf,
        })
    }

    /// The planted per-id latent value of feature `f` (index) and id.
    fn latent(&self, f: usize, id: i64) -> f64 {
        self.latent_of(self.seed, f, id)
    }

    /// [`Self::latent`] under another seed.
    fn latent_of(&self, seed: u64, f: usize, id: i64) -> f64 {
        let h = hash_words(&[seed, f as u64, id as u64]);
        // Box-Muller from two hash-derived uniforms.
        let u1 = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = ((hash_words(&[h]) >> 11) as f64) / (1u64 << 53) as f64;
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * LATENT_STD
    }

    /// The planted logit of one example (dense features after the log transform, one bag of
    /// ids per sparse feature). Its sigmoid is the true click probability.
    pub fn true_logit(&self, dense: &[f32], bags: &[&[i64]]) -> f64 {
        BIAS + self.config.signal * self.planted(dense, bags)
    }

    /// The planted logit of label column `task` (0 is [`SyntheticSampler::true_logit`]).
    pub fn task_logit(&self, task: usize, dense: &[f32], bags: &[&[i64]]) -> f64 {
        self.task_logit_from(task, self.planted(dense, bags), bags)
    }

    /// [`Self::task_logit`] from the example's planted signal `z` (shared by its tasks).
    fn task_logit_from(&self, task: usize, z: f64, bags: &[&[i64]]) -> f64 {
        if task == 0 {
            return BIAS + self.config.signal * z;
        }
        // The task's own per-id effects: the latent values of a task-salted seed.
        let seed = self.seed ^ (task as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut own = 0.0;
        for (f, bag) in bags.iter().enumerate() {
            if !bag.is_empty() {
                own += bag.iter().map(|&id| self.latent_of(seed, f, id)).sum::<f64>() / bag.len() as f64;
            }
        }
        BIAS - 0.5 + self.config.signal * (0.6 * z + 0.8 * own)
    }

    /// The planted signal `z` of an example (its logit is `BIAS + signal * z`).
    fn planted(&self, dense: &[f32], bags: &[&[i64]]) -> f64 {
        let c = |j: usize| (1.0 + self.dense_means[j]).ln();
        let mut z: f64 = dense.iter().enumerate().map(|(j, &x)| self.dense_weights[j] * (x as f64 - c(j))).sum();
        if dense.len() >= 2 {
            z += 0.5 * (dense[0] as f64 - c(0)).tanh() * (dense[1] as f64 - c(1));
        }
        for (f, bag) in bags.iter().enumerate() {
            if !bag.is_empty() {
                z += bag.iter().map(|&id| self.latent(f, id)).sum::<f64>() / bag.len() as f64;
            }
        }
        z
    }

    fn samples(&self, split: Split) -> u64 {
        match split {
            Split::Train => self.config.train_samples,
            Split::Eval => self.config.eval_samples,
        }
    }

    /// Batch `index` of `split` / `epoch` (the last may be partial); `None` past the end.
    pub fn batch(&self, split: Split, epoch: u64, index: u64, batch_size: usize) -> Option<Result<Batch, DataError>> {
        let total = self.samples(split);
        let start = index.checked_mul(batch_size as u64)?;
        if start >= total || batch_size == 0 {
            return None;
        }
        let n = (total - start).min(batch_size as u64) as usize;
        let split_word = match split {
            Split::Train => 1,
            Split::Eval => 2,
        };
        let epoch = if split == Split::Eval { 0 } else { epoch };
        let mut rng = StdRng::seed_from_u64(hash_words(&[self.seed, split_word, epoch, index]));
        let nd = self.config.dense_features;
        let nf = self.config.sparse_features.len();
        let mut dense = Vec::with_capacity(n * nd);
        for _ in 0..n {
            for j in 0..nd {
                let e = Exp::new(1.0 / self.dense_means[j]).expect("positive rate").sample(&mut rng);
                dense.push((1.0 + e.floor()).ln() as f32);
            }
        }
        // Key-major bags: draw per feature, then per example.
        let mut lengths = Vec::with_capacity(n * nf);
        let mean_max: usize = (0..nf).map(|f| (self.lengths.max(f) as usize).div_ceil(2)).sum();
        let mut values = Vec::with_capacity(n * mean_max.max(nf));
        for f in 0..nf {
            for _ in 0..n {
                let len = self.lengths.draw(f, &mut rng);
                lengths.push(len);
                for _ in 0..len {
                    let id = match &self.zipf[f] {
                        Some(z) => (z.sample(&mut rng) as u64).saturating_sub(1).min(self.rows[f] - 1),
                        None => rng.random_range(0..self.rows[f]),
                    };
                    values.push(id as i64);
                }
            }
        }
        let sparse = match KeyedJaggedTensor::new(self.config.sparse_features.clone(), values, None, lengths, n) {
            Ok(k) => k,
            Err(e) => return Some(Err(e.into())),
        };
        let num_labels = self.config.labels.len();
        let mut labels = Vec::with_capacity(n * num_labels);
        let mut bags: Vec<&[i64]> = Vec::with_capacity(nf);
        for i in 0..n {
            bags.clear();
            bags.extend((0..nf).map(|f| sparse.feature(f).bag(i)));
            let z = self.planted(&dense[i * nd..(i + 1) * nd], &bags);
            for t in 0..num_labels {
                let logit = self.task_logit_from(t, z, &bags);
                let prob = 1.0 / (1.0 + (-logit).exp());
                labels.push(if rng.random::<f64>() < prob { 1.0 } else { 0.0 });
            }
        }
        // Drawn after the labels, so a weighted stream has the unweighted one's examples.
        let weights = self.config.weight_range.map(|[low, high]| {
            (0..n).map(|_| if low < high { rng.random_range(low..=high) as f32 } else { low as f32 }).collect()
        });
        let groups = self.config.session_size.map(|s| (start..start + n as u64).map(|i| (i / s) as i64).collect());
        let sparse = if self.config.dedup {
            match sparse.dedup() {
                Ok(d) => d,
                Err(e) => return Some(Err(e.into())),
            }
        } else {
            sparse
        };
        Some(Ok(Batch { dense, num_dense: nd, sparse, labels, batch_size: n, groups, weights }))
    }
}

impl Sampler for SyntheticSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    fn weighted(&self) -> bool {
        self.config.weight_range.is_some()
    }

    fn batches(&self, split: Split, epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        if batch_size == 0 {
            return Err(DataError::Config { key: "".into(), message: "batch size must be positive".into() });
        }
        let me = self.clone();
        let mut index = self.rank;
        Ok(Box::new(std::iter::from_fn(move || {
            let b = me.batch(split, epoch, index, batch_size);
            index += me.world;
            b
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(ids: IdDistribution, rows: u64, pooling: u32) -> SyntheticSampler {
        let config = SyntheticConfig {
            ids,
            pooling_factor: pooling,
            train_samples: 3000,
            eval_samples: 20_000,
            ..serde_json_default()
        };
        let feature_rows = config.sparse_features.iter().map(|f| (f.clone(), rows)).collect();
        SyntheticSampler::build(config, &SamplerContext { feature_rows, seed: 7, ..Default::default() }).unwrap()
    }

    #[test]
    fn label_columns_and_sessions() {
        let config = SyntheticConfig {
            labels: vec!["click".into(), "like".into()],
            session_size: Some(7),
            eval_samples: 20_000,
            ..serde_json_default()
        };
        let feature_rows = config.sparse_features.iter().map(|f| (f.clone(), 100)).collect();
        let s =
            SyntheticSampler::build(config, &SamplerContext { feature_rows, seed: 7, ..Default::default() }).unwrap();
        assert_eq!(s.schema().labels, ["click", "like"]);
        assert_eq!(s.schema().grouping_key.as_deref(), Some("session"));
        let b = s.batch(Split::Eval, 0, 1, 1000).unwrap().unwrap();
        assert_eq!(b.labels.len(), 2000);
        assert!(b.labels.iter().all(|&y| y == 0.0 || y == 1.0));
        // Sessions of 7 consecutive examples of the split: the batch starts at example 1000.
        let g = b.groups.as_ref().unwrap();
        // 1000 / 7 = 142 (remainder 6), so example 1001 opens session 143 and 1008 session 144.
        assert_eq!((g[0], g[1], g[7], g[8], g[999]), (142, 143, 143, 144, 1999 / 7));
        // The second task is rarer and a different function of the example.
        let (mut rate, mut differ) = ([0.0f64; 2], 0);
        let mut n = 0;
        for b in s.batches(Split::Eval, 0, 4096).unwrap() {
            let b = b.unwrap();
            for i in 0..b.batch_size {
                rate[0] += f64::from(b.labels[2 * i]);
                rate[1] += f64::from(b.labels[2 * i + 1]);
                differ += usize::from(b.labels[2 * i] != b.labels[2 * i + 1]);
                n += 1;
            }
        }
        assert!(rate[1] < rate[0], "{rate:?}");
        assert!(differ > n / 10, "{differ} of {n} differ");
    }

    /// `weight_range` adds a weight per example in the range, drawn after everything else:
    /// the examples are the unweighted sampler's.
    #[test]
    fn weights_are_drawn_in_their_range_after_the_examples() {
        let build = |weight_range| {
            let config = SyntheticConfig { weight_range, train_samples: 3000, ..serde_json_default() };
            let feature_rows = config.sparse_features.iter().map(|f| (f.clone(), 100)).collect();
            SyntheticSampler::build(config, &SamplerContext { feature_rows, seed: 7, ..Default::default() }).unwrap()
        };
        let (plain, weighted, constant) = (build(None), build(Some([0.5, 2.0])), build(Some([3.0, 3.0])));
        assert!(!plain.weighted() && weighted.weighted());
        let (mut low, mut high) = (f32::MAX, f32::MIN);
        for ((a, b), c) in plain
            .batches(Split::Train, 1, 512)
            .unwrap()
            .zip(weighted.batches(Split::Train, 1, 512).unwrap())
            .zip(constant.batches(Split::Train, 1, 512).unwrap())
        {
            let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
            assert!(a.weights.is_none());
            assert_eq!((&a.dense, &a.labels, a.sparse.values()), (&b.dense, &b.labels, b.sparse.values()));
            let w = b.weights.unwrap();
            assert_eq!(w.len(), b.batch_size);
            low = w.iter().copied().fold(low, f32::min);
            high = w.iter().copied().fold(high, f32::max);
            assert!(c.weights.unwrap().iter().all(|&w| w == 3.0));
        }
        assert!((0.5..0.52).contains(&low) && (1.98..=2.0).contains(&high), "{low}..{high}");
    }

    #[test]
    fn bad_label_and_session_options() {
        let rows = |c: &SyntheticConfig| c.sparse_features.iter().map(|f| (f.clone(), 100)).collect();
        for (config, key) in [
            (SyntheticConfig { labels: vec![], ..serde_json_default() }, "labels"),
            (SyntheticConfig { labels: vec!["a".into(), "a".into()], ..serde_json_default() }, "labels"),
            (SyntheticConfig { session_size: Some(0), ..serde_json_default() }, "session_size"),
            (SyntheticConfig { weight_range: Some([-1.0, 1.0]), ..serde_json_default() }, "weight_range"),
            (SyntheticConfig { weight_range: Some([2.0, 1.0]), ..serde_json_default() }, "weight_range"),
            (SyntheticConfig { weight_range: Some([0.0, f64::INFINITY]), ..serde_json_default() }, "weight_range"),
        ] {
            let ctx = SamplerContext { feature_rows: rows(&config), ..Default::default() };
            match SyntheticSampler::build(config, &ctx) {
                Err(DataError::Config { key: k, .. }) => assert_eq!(k, key),
                Err(other) => panic!("{other}"),
                Ok(_) => panic!("{key} accepted"),
            }
        }
    }

    fn serde_json_default() -> SyntheticConfig {
        // All defaults, as an empty recipe section would give.
        serde_json::from_value(serde_json::json!({})).unwrap()
    }

    /// Exact AUC by pairwise counting (ties count one half).
    fn pairwise_auc(scores: &[f64], labels: &[f32]) -> f64 {
        let pos: Vec<f64> = scores.iter().zip(labels).filter(|&(_, &l)| l > 0.5).map(|(s, _)| *s).collect();
        let mut neg: Vec<f64> = scores.iter().zip(labels).filter(|&(_, &l)| l < 0.5).map(|(s, _)| *s).collect();
        neg.sort_by(f64::total_cmp);
        let mut wins = 0.0;
        for p in &pos {
            let below = neg.partition_point(|n| n < p);
            let ties = neg[below..].partition_point(|n| n <= p);
            wins += below as f64 + 0.5 * ties as f64;
        }
        wins / (pos.len() as f64 * neg.len() as f64)
    }

    #[test]
    fn planted_signal_is_learnable_and_ctr_is_realistic() {
        let s = sampler(IdDistribution::Uniform, 1000, 1);
        let mut scores = Vec::new();
        let mut labels = Vec::new();
        for b in s.batches(Split::Eval, 0, 1000).unwrap() {
            let b = b.unwrap();
            for i in 0..b.batch_size {
                let bags: Vec<&[i64]> = (0..b.sparse.keys().len()).map(|f| b.sparse.feature(f).bag(i)).collect();
                scores.push(s.true_logit(&b.dense[i * b.num_dense..(i + 1) * b.num_dense], &bags));
                labels.push(b.labels[i]);
            }
        }
        assert_eq!(labels.len(), 20_000);
        let ctr = labels.iter().sum::<f32>() / labels.len() as f32;
        assert!((0.15..0.35).contains(&ctr), "ctr {ctr}");
        let auc = pairwise_auc(&scores, &labels);
        assert!(auc > 0.8, "Bayes-optimal AUC {auc}");
        // A signal of 0 leaves nothing to learn.
        let mut noise = sampler(IdDistribution::Uniform, 1000, 1);
        noise.config.signal = 0.0;
        let b = noise.batch(Split::Eval, 0, 0, 5000).unwrap().unwrap();
        let bags = |i: usize| (0..8).map(|f| b.sparse.feature(f).bag(i)).collect::<Vec<_>>();
        let flat: Vec<f64> = (0..5000).map(|i| noise.true_logit(&b.dense[i * 13..(i + 1) * 13], &bags(i))).collect();
        assert!(flat.iter().all(|&z| (z - BIAS).abs() < 1e-12));
    }

    #[test]
    fn ids_in_range_lengths_and_partial_last_batch() {
        let s = sampler(IdDistribution::Uniform, 50, 3);
        let batches: Vec<Batch> = s.batches(Split::Train, 0, 1024).unwrap().map(Result::unwrap).collect();
        assert_eq!(batches.iter().map(|b| b.batch_size).collect::<Vec<_>>(), vec![1024, 1024, 952]);
        for b in &batches {
            assert!(b.sparse.values().iter().all(|&id| (0..50).contains(&id)));
            assert!(b.sparse.lengths().iter().all(|&l| (1..=5).contains(&l)));
            assert_eq!(b.dense.len(), b.batch_size * 13);
            assert!(b.dense.iter().all(|x| (0.0..12.0).contains(x)));
        }
        let mean_len =
            batches[0].sparse.lengths().iter().sum::<u32>() as f64 / batches[0].sparse.lengths().len() as f64;
        assert!((mean_len - 3.0).abs() < 0.1, "{mean_len}");
    }

    #[test]
    fn zipf_is_skewed() {
        let s = sampler(IdDistribution::Zipf, 10_000, 1);
        let b = s.batch(Split::Train, 0, 0, 20_000).unwrap().unwrap();
        let ids = b.sparse.feature(0).values;
        let zeros = ids.iter().filter(|&&i| i == 0).count() as f64 / ids.len() as f64;
        assert!(zeros > 100.0 / 10_000.0, "row 0 share {zeros}");
        assert!(ids.iter().all(|&i| (0..10_000).contains(&i)));
    }

    #[test]
    fn deterministic_per_seed_split_and_epoch() {
        let a = sampler(IdDistribution::Zipf, 100, 2);
        let b = sampler(IdDistribution::Zipf, 100, 2);
        let first = |s: &SyntheticSampler, split, epoch| s.batches(split, epoch, 64).unwrap().next().unwrap().unwrap();
        assert_eq!(first(&a, Split::Train, 0), first(&b, Split::Train, 0));
        assert_ne!(first(&a, Split::Train, 0), first(&a, Split::Train, 1));
        assert_eq!(first(&a, Split::Eval, 0), first(&a, Split::Eval, 5));
        assert_ne!(first(&a, Split::Eval, 0), first(&a, Split::Train, 0));
    }

    #[test]
    fn dedup_sends_distinct_bags_that_expand_to_the_same_batch() {
        let plain = SyntheticConfig { train_samples: 2000, ..serde_json_default() };
        let dedup = SyntheticConfig { dedup: true, ..plain.clone() };
        let feature_rows: std::collections::BTreeMap<String, u64> =
            plain.sparse_features.iter().map(|f| (f.clone(), 30)).collect();
        let ctx = SamplerContext { feature_rows, seed: 4, ..Default::default() };
        let a = SyntheticSampler::build(plain, &ctx).unwrap();
        let b = SyntheticSampler::build(dedup, &ctx).unwrap();
        let (x, y) =
            (a.batch(Split::Train, 0, 0, 512).unwrap().unwrap(), b.batch(Split::Train, 0, 0, 512).unwrap().unwrap());
        assert!(y.sparse.variable_stride_per_key() && !x.sparse.variable_stride_per_key());
        // 30 rows, one id per bag: at most 30 distinct bags per feature of 512.
        assert!(y.sparse.stride_per_key().iter().all(|&n| n <= 30), "{:?}", y.sparse.stride_per_key());
        assert_eq!(y.sparse.expand_vbe().unwrap(), x.sparse);
        assert_eq!((y.dense, y.labels, y.batch_size), (x.dense, x.labels, x.batch_size));
    }

    #[test]
    fn ranks_share_the_one_rank_stream_batch_by_batch() {
        let config = SyntheticConfig { train_samples: 1000, eval_samples: 300, ..serde_json_default() };
        let feature_rows: std::collections::BTreeMap<String, u64> =
            config.sparse_features.iter().map(|f| (f.clone(), 50)).collect();
        let build = |rank, world_size| {
            let ctx =
                SamplerContext { feature_rows: feature_rows.clone(), seed: 9, rank, world_size, ..Default::default() };
            SyntheticSampler::build(config.clone(), &ctx).unwrap()
        };
        for split in [Split::Train, Split::Eval] {
            let all: Vec<Batch> = build(0, 1).batches(split, 2, 64).unwrap().map(|b| b.unwrap()).collect();
            let ranks: Vec<Vec<Batch>> =
                (0..3).map(|r| build(r, 3).batches(split, 2, 64).unwrap().map(|b| b.unwrap()).collect()).collect();
            assert_eq!(ranks.iter().map(Vec::len).sum::<usize>(), all.len());
            for (i, b) in all.iter().enumerate() {
                assert_eq!(&ranks[i % 3][i / 3], b, "{split:?} batch {i}");
            }
        }
    }

    /// A sampler over features `a`, `b`, `c` (100 rows each) with the given length keys.
    fn with_lengths(pooling: u32, max: Option<Vec<u32>>, min: Option<Vec<u32>>) -> Result<SyntheticSampler, DataError> {
        let config = SyntheticConfig {
            sparse_features: vec!["a".into(), "b".into(), "c".into()],
            pooling_factor: pooling,
            ids_per_features: max,
            min_ids_per_features: min,
            train_samples: 20_000,
            ..serde_json_default()
        };
        let feature_rows = config.sparse_features.iter().map(|f| (f.clone(), 100)).collect();
        SyntheticSampler::build(config, &SamplerContext { feature_rows, seed: 5, ..Default::default() })
    }

    /// Bag lengths of feature `f` over a whole training pass.
    fn lengths_of(s: &SyntheticSampler, f: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for b in s.batches(Split::Train, 0, 4096).unwrap() {
            let b = b.unwrap();
            let k = b.sparse.feature(f);
            out.extend((0..b.batch_size).map(|i| k.bag(i).len() as u32));
            assert!(k.values.iter().all(|&id| (0..100).contains(&id)));
        }
        out
    }

    #[test]
    fn ids_per_features_fixes_each_features_bag_length() {
        let s = with_lengths(1, Some(vec![1, 3, 0]), None).unwrap();
        for (f, want) in [(0, 1), (1, 3), (2, 0)] {
            let lens = lengths_of(&s, f);
            assert_eq!(lens.len(), 20_000);
            assert!(lens.iter().all(|&l| l == want), "feature {f}: every bag has {want} ids");
        }
        // 20000 examples * (1 + 3 + 0) ids.
        let ids: usize = s.batches(Split::Train, 0, 4096).unwrap().map(|b| b.unwrap().sparse.values().len()).sum();
        assert_eq!(ids, 80_000);
    }

    #[test]
    fn min_ids_per_features_draws_lengths_uniformly_in_the_range() {
        // Feature a: uniform on 0..=4 (mean 2, each length 1/5); b: 2..=2 (always 2);
        // c: 1..=6 (mean 3.5, each length 1/6).
        let s = with_lengths(1, Some(vec![4, 2, 6]), Some(vec![0, 2, 1])).unwrap();
        for (f, lo, hi) in [(0u32, 0u32, 4u32), (1, 2, 2), (2, 1, 6)] {
            let lens = lengths_of(&s, f as usize);
            let n = lens.len() as f64;
            assert!(lens.iter().all(|&l| (lo..=hi).contains(&l)), "feature {f}: lengths in [{lo}, {hi}]");
            let mean = lens.iter().map(|&l| l as f64).sum::<f64>() / n;
            // The standard error of the mean is at most sqrt(35/12 / 20000) ~ 0.012.
            let want = (lo + hi) as f64 / 2.0;
            assert!((mean - want).abs() < 0.05, "feature {f}: mean {mean}, want {want}");
            let width = (hi - lo + 1) as f64;
            for l in lo..=hi {
                // Each length's share is 1/width, standard error below 0.003.
                let share = lens.iter().filter(|&&x| x == l).count() as f64 / n;
                assert!((share - 1.0 / width).abs() < 0.015, "feature {f}: length {l} share {share}");
            }
        }
        // The draws are reproducible.
        let again = with_lengths(1, Some(vec![4, 2, 6]), Some(vec![0, 2, 1])).unwrap();
        assert_eq!(lengths_of(&s, 2), lengths_of(&again, 2));
    }

    #[test]
    fn bag_length_keys_are_checked() {
        let key_of = |r: Result<SyntheticSampler, DataError>| match r {
            Err(DataError::Config { key, message }) => (key, message),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        };
        let (key, msg) = key_of(with_lengths(1, Some(vec![1, 2]), None));
        assert_eq!(key, "ids_per_features");
        assert!(msg.contains("has 2 entries but there are 3 sparse features (a, b, c)"), "{msg}");
        let (key, _) = key_of(with_lengths(1, Some(vec![1, 2, 3]), Some(vec![0, 0, 0, 0])));
        assert_eq!(key, "min_ids_per_features");
        let (key, msg) = key_of(with_lengths(1, Some(vec![1, 2, 3]), Some(vec![0, 3, 0])));
        assert_eq!(key, "min_ids_per_features");
        assert!(msg.contains("min_ids_per_features[1] = 3 is above ids_per_features[1] = 2"), "{msg}");
        let (key, _) = key_of(with_lengths(1, None, Some(vec![0, 0, 0])));
        assert_eq!(key, "min_ids_per_features");
        let (key, msg) = key_of(with_lengths(3, Some(vec![1, 2, 3]), None));
        assert_eq!(key, "ids_per_features");
        assert!(msg.contains("pooling_factor") && msg.contains("not both"), "{msg}");
        // pooling_factor left at its default is fine, and so are the keys from a recipe section.
        let c: SyntheticConfig = serde_json::from_value(serde_json::json!({
            "sparse_features": ["a"], "ids_per_features": [5], "min_ids_per_features": [2]
        }))
        .unwrap();
        assert_eq!(c.min_ids_per_features, Some(vec![2]));
    }

    #[test]
    fn a_feature_without_a_table_is_a_config_error() {
        let err = SyntheticSampler::build(serde_json_default(), &SamplerContext::default()).err().unwrap();
        assert!(err.to_string().contains("\"C1\" is not looked up in any table"), "{err}");
    }
}
