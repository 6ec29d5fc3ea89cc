//! A job's metrics: the recipe's `[[metrics]]` as metric suites (one per task; lifetime values
//! for an evaluation, lifetime and windowed ones on training batches), fed with every rank's
//! predictions; the evaluation loop; retrieval recall over the candidate corpus.

use std::borrow::Cow;
use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};
use trainrec_data::{Batch, Split};
use trainrec_metrics::{
    AucMetric, AuprcMetric, LifetimeMetric, Metric, MetricSuite, NeMetric, SessionMetric, SessionMetricKind,
    SplitAuprc, SumMetric, SumMetricKind, TaskBatch, ThroughputMetric,
};
use trainrec_models::Autocast;
use trainrec_recipe::MetricSection;

use crate::error::EngineError;
use crate::inputs::{NextItemSpec, RetrievalSpec, expand_vbe};
use crate::job::Job;
use crate::pipeline::tensors;
use crate::sequence_tables::Sequences;

/// The metrics on training batches: one suite per task when `train.metrics_every` asks for
/// them, and TorchRec's throughput metric (examples per second after 100 warm-up steps).
pub(crate) struct TrainMetrics {
    /// Per task, the recipe's metrics over training batches (lifetime and windowed).
    pub suites: Option<Vec<MetricSuite>>,
    /// Examples per second.
    pub throughput: ThroughputMetric,
}

impl TrainMetrics {
    /// The training metrics `job`'s recipe asks for.
    pub(crate) fn new(job: &Job) -> Result<Self, EngineError> {
        let train = &job.recipe.train;
        let suites = match train.metrics_every {
            Some(_) => {
                let w = Some(train.metrics_window as usize);
                Some((0..job.layout.tasks.len()).map(|_| job.metric_suite(w)).collect::<Result<Vec<_>, _>>()?)
            }
            None => None,
        };
        Ok(Self { suites, throughput: Self::throughput()? })
    }

    /// No training metrics, a fresh throughput (a job loaded for evaluation or inference).
    pub(crate) fn none() -> Result<Self, EngineError> {
        Ok(Self { suites: None, throughput: Self::throughput()? })
    }

    fn throughput() -> Result<ThroughputMetric, EngineError> {
        Ok(ThroughputMetric::new(
            trainrec_metrics::THROUGHPUT_WARMUP_STEPS,
            trainrec_metrics::THROUGHPUT_WINDOW_SECONDS,
        )?)
    }

    /// Whether the step must return its predictions (to feed the suites).
    pub(crate) fn wants_predictions(&self) -> bool {
        self.suites.is_some()
    }

    /// Feeds a step's predictions (every rank's, gathered) to the suites.
    pub(crate) fn feed(&mut self, job: &Job, predictions: Option<&[f32]>, batch: &Batch) -> Result<(), EngineError> {
        if let (Some(suites), Some(p)) = (&mut self.suites, predictions) {
            job.feed_all_ranks(suites, p, batch)?;
        }
        Ok(())
    }

    /// The suites' values, named as [`Job::values`] names them (none without suites).
    pub(crate) fn values(&self, job: &Job) -> BTreeMap<String, f64> {
        self.suites.as_deref().map(|s| job.values(s)).unwrap_or_default()
    }
}

/// Recall@k over the eval split: per positive pair, is its candidate among the top k of the
/// corpus for its query.
struct RecallAtK {
    corpus: Tensor,
    input: String,
    ks: Vec<usize>,
    hits: Vec<u64>,
    pairs: u64,
    /// The precision the query tower computes in.
    precision: trainrec_types::DensePrecision,
}

impl RecallAtK {
    fn new(spec: &RetrievalSpec, corpus: Tensor, precision: trainrec_types::DensePrecision) -> Self {
        let (input, ks, hits) = (spec.input.clone(), spec.ks.clone(), vec![0; spec.ks.len()]);
        Self { corpus, input, ks, hits, pairs: 0, precision }
    }

    fn update(
        &mut self,
        retrieval: &dyn trainrec_models::Retrieval,
        dense: &Tensor,
        sparse: &Tensor,
        labels: &Tensor,
        batch: &Batch,
    ) -> Result<(), EngineError> {
        let sparse_ids = batch.sparse.full_batch()?;
        let Some(k) = sparse_ids.key_index(&self.input) else {
            return Err(EngineError::Internal(format!("eval batch lacks feature {}", self.input)));
        };
        let f = sparse_ids.feature(k);
        let y: Vec<f32> = Vec::try_from(labels.select(1, 0).to_device(tch::Device::Cpu).contiguous())
            .map_err(|e| EngineError::Internal(format!("labels: {e}")))?;
        // Positive pairs whose candidate is one id.
        let (rows, truth): (Vec<i64>, Vec<i64>) = (0..batch.batch_size)
            .filter(|&i| y[i] > 0.5 && f.bag(i).len() == 1)
            .map(|i| (i as i64, f.bag(i)[0]))
            .unzip();
        if rows.is_empty() {
            return Ok(());
        }
        let rows_t = Tensor::from_slice(&rows).to_device(dense.device());
        let kmax = (*self.ks.iter().max().unwrap_or(&1) as i64).min(self.corpus.size()[0]);
        let top = tch::no_grad(|| {
            let q = Autocast::run(self.precision, dense.device(), || {
                retrieval.query_embeddings(&dense.index_select(0, &rows_t), &sparse.index_select(0, &rows_t))
            })
            .to_kind(tch::Kind::Float);
            q.matmul(&self.corpus.transpose(0, 1)).topk(kmax, 1, true, true).1
        });
        let top: Vec<i64> = Vec::try_from(top.to_device(tch::Device::Cpu).contiguous().view([-1]))
            .map_err(|e| EngineError::Internal(format!("top-k: {e}")))?;
        for (i, &t) in truth.iter().enumerate() {
            let ranked = &top[i * kmax as usize..(i + 1) * kmax as usize];
            if let Some(rank) = ranked.iter().position(|&c| c == t) {
                for (h, &k) in self.hits.iter_mut().zip(&self.ks) {
                    if rank < k {
                        *h += 1;
                    }
                }
            }
        }
        self.pairs += truth.len() as u64;
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        self.ks
            .iter()
            .zip(&self.hits)
            .map(|(k, &h)| (format!("recall_at_{k}"), if self.pairs == 0 { 0.0 } else { h as f64 / self.pairs as f64 }))
            .collect()
    }
}

/// HR@k and NDCG@k of next-item targets ranked among every row of the item table
/// (`full_ranking`).
struct FullRanking {
    /// Item embeddings `[rows, d]` row-major, and `d`.
    items: Vec<f32>,
    dim: usize,
    target: String,
    ks: Vec<usize>,
    /// Per cut-off: hits, then NDCG sums; then the targets ranked.
    sums: Vec<f64>,
}

impl FullRanking {
    fn new(spec: &NextItemSpec, items: Tensor) -> Result<Self, EngineError> {
        let dim = items.size()[1] as usize;
        let items = Vec::<f32>::try_from(items.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]))
            .map_err(|e| EngineError::Internal(format!("item embeddings: {e}")))?;
        let sums = vec![0.0; 2 * spec.ks.len() + 1];
        Ok(Self { items, dim, target: spec.target.clone(), ks: spec.ks.clone(), sums })
    }

    /// Ranks the batch's targets (examples with one target id) for the users `users` `[batch, d]`.
    fn update(&mut self, users: &Tensor, batch: &Batch) -> Result<(), EngineError> {
        let ids = batch.sparse.full_batch()?;
        let Some(k) = ids.key_index(&self.target) else {
            return Err(EngineError::Internal(format!("eval batch lacks feature {}", self.target)));
        };
        let f = ids.feature(k);
        let (rows, targets): (Vec<i64>, Vec<i64>) =
            (0..batch.batch_size).filter(|&i| f.bag(i).len() == 1).map(|i| (i as i64, f.bag(i)[0])).unzip();
        if rows.is_empty() {
            return Ok(());
        }
        let users = users.index_select(0, &Tensor::from_slice(&rows).to_device(users.device()));
        let users = Vec::<f32>::try_from(users.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]))
            .map_err(|e| EngineError::Internal(format!("user embeddings: {e}")))?;
        let ranks = trainrec_metrics::target_ranks(&users, &self.items, self.dim, &targets, None)?;
        let n = self.ks.len();
        for rank in ranks {
            for (j, &k) in self.ks.iter().enumerate() {
                if (rank as usize) < k {
                    self.sums[j] += 1.0;
                    self.sums[n + j] += 1.0 / (rank as f64 + 2.0).log2();
                }
            }
            self.sums[2 * n] += 1.0;
        }
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        let (n, total) = (self.ks.len(), self.sums[2 * self.ks.len()]);
        let mean = |v: f64| if total == 0.0 { 0.0 } else { v / total };
        let hr = self.ks.iter().enumerate().map(|(j, k)| (format!("hr_at_{k}"), mean(self.sums[j])));
        let ndcg = self.ks.iter().enumerate().map(|(j, k)| (format!("ndcg_at_{k}"), mean(self.sums[n + j])));
        hr.chain(ndcg).collect()
    }
}

impl Job {
    /// The sampler's batches of `split` (one pass; the train split in epoch 0's order).
    pub fn batches(&self, split: Split, batch_size: usize) -> Result<trainrec_data::BatchStream, EngineError> {
        Ok(self.sampler.batches(split, 0, batch_size)?)
    }

    /// The tasks: (name, label column), in the order of the model's logits.
    pub fn tasks(&self) -> &[(String, usize)] {
        &self.layout.tasks
    }

    /// What the sampler produces.
    pub fn sampler_schema(&self) -> &trainrec_data::FeatureSchema {
        self.sampler.schema()
    }

    /// The batch size of an evaluation (`data.eval_batch_size`, else `data.batch_size`).
    pub fn eval_batch_size(&self) -> usize {
        self.recipe.data.eval_batch_size.unwrap_or(self.recipe.data.batch_size)
    }

    /// What the model sees of an eval batch besides its dense features: the pooled embeddings
    /// `sparse` with the position-weighted features joined, and the sequence features (a
    /// lookup, collective when the tables are sharded).
    fn eval_view(&self, sparse: &Tensor, batch: &Batch) -> Result<(Tensor, Sequences), EngineError> {
        let (sequences, _, _) = self.sparse.sequence_forward(&batch.sparse, self.layout.device, false, None)?;
        self.sparse.model_view(sparse, &sequences)
    }

    /// The model's eval-mode logits `[batch, tasks]` in fp32 (on the model's device), the
    /// matrix products in `train.dense_precision`, from a batch's dense features and
    /// [`Job::eval_view`].
    fn eval_logits(&self, dense: &Tensor, (pooled, sequences): &(Tensor, Sequences)) -> Tensor {
        let input = trainrec_models::ModelInput { dense, pooled, sequences, catalogue: None };
        Autocast::run(self.layout.precision, self.layout.device, || self.model.forward_input(&input, false))
            .to_kind(Kind::Float)
    }

    /// The model's logits `[batch, tasks]` (fp32, on the CPU) for one batch of one rank's job,
    /// as an evaluation computes them (managed-collision ids remapped without counting).
    pub fn predict_logits(&self, mut batch: Batch) -> Result<Tensor, EngineError> {
        if !self.mc.is_empty() {
            expand_vbe(&mut batch.sparse)?;
            self.mc.eval(&mut batch.sparse)?;
        }
        let staged = self.mc.stage_eval(&self.sparse, &batch.sparse)?;
        let (dense, sparse, _, _) = tensors(&self.layout, &self.sparse, &batch, staged)?;
        let view = self.eval_view(&sparse, &batch)?;
        Ok(tch::no_grad(|| self.eval_logits(&dense, &view)).to_device(Device::Cpu))
    }

    /// Evaluates on the eval split; returns the metrics by name (`<metric>-<task>` when the
    /// job has several tasks).
    pub fn evaluate(&self) -> Result<BTreeMap<String, f64>, EngineError> {
        let mut suites =
            (0..self.layout.tasks.len()).map(|_| self.metric_suite(None)).collect::<Result<Vec<_>, _>>()?;
        let bs = self.recipe.data.eval_batch_size.unwrap_or(self.recipe.data.batch_size);
        let limit = self.recipe.train.eval_batches.unwrap_or(u64::MAX);
        let mut seen = 0u64;
        let mut recall = match &self.retrieval {
            Some(r) => Some(RecallAtK::new(r, self.corpus_embeddings(r)?, self.layout.precision)),
            None => None,
        };
        let mut ranking = match &self.next_item {
            Some(spec) => Some(FullRanking::new(spec, self.item_embeddings(spec)?)?),
            None => None,
        };
        let mut batches = self.sampler.batches(Split::Eval, 0, bs)?.take(limit as usize);
        loop {
            let next = batches.next().transpose()?;
            // Across ranks every rank takes part until all are done: one whose split has ended
            // looks up an empty batch.
            let batch = match (&self.sync, next) {
                (None, None) => break,
                (None, Some(b)) => b,
                (Some(sync), next) => {
                    if !sync.any_has(next.is_some())? {
                        break;
                    }
                    match next {
                        Some(b) => b,
                        None => self.empty_batch()?,
                    }
                }
            };
            let batch = if self.mc.is_empty() {
                batch
            } else {
                let mut b = batch;
                expand_vbe(&mut b.sparse)?;
                self.mc.eval(&mut b.sparse)?;
                b
            };
            let staged = self.mc.stage_eval(&self.sparse, &batch.sparse)?;
            let (dense, sparse, labels, _) = tensors(&self.layout, &self.sparse, &batch, staged)?;
            let view = self.eval_view(&sparse, &batch)?;
            let probs = tch::no_grad(|| self.eval_logits(&dense, &view)).sigmoid().to_device(Device::Cpu);
            let probs: Vec<f32> = Vec::try_from(&probs.contiguous().view([-1]))
                .map_err(|e| EngineError::Internal(format!("predictions: {e}")))?;
            seen += self.feed_all_ranks(&mut suites, &probs, &batch)? as u64;
            if let Some(recall) = &mut recall {
                let retrieval =
                    self.model.retrieval().ok_or_else(|| EngineError::Internal("retrieval vanished".into()))?;
                recall.update(retrieval, &dense, &sparse, &labels, &batch)?;
            }
            if let Some(ranking) = &mut ranking {
                let users = self.user_embeddings(&dense, &view)?;
                ranking.update(&users, &batch)?;
            }
        }
        if seen == 0 {
            return Err(EngineError::EmptySplit("eval"));
        }
        let mut values = self.values(&suites);
        if let Some(mut recall) = recall {
            if let Some(sync) = &self.sync {
                let mut counts = recall.hits.clone();
                counts.push(recall.pairs);
                crate::data_parallel::sum_counts(sync.pg.as_ref(), &mut counts)?;
                recall.pairs = counts.pop().unwrap_or(0);
                recall.hits = counts;
            }
            values.extend(recall.compute());
        }
        if let Some(mut ranking) = ranking {
            if let Some(sync) = &self.sync {
                sync.pg.all_reduce_f64(&mut ranking.sums, trainrec_comm::ReduceOp::Sum)?;
            }
            values.extend(ranking.compute());
        }
        Ok(values)
    }

    /// Every row of the next-item model's item table as item embeddings `[rows, d]`, fp32
    /// (collective when the table is sharded).
    fn item_embeddings(&self, spec: &NextItemSpec) -> Result<Tensor, EngineError> {
        let next = self.model.next_item().ok_or_else(|| EngineError::Internal("next-item model vanished".into()))?;
        let weights = self
            .sparse
            .table_weights(&spec.table)?
            .ok_or_else(|| EngineError::Internal(format!("table {} has no weights to rank against", spec.table)))?;
        let dim = self.recipe.tables.iter().find(|t| t.name == spec.table).map_or(1, |t| t.dim) as i64;
        let rows = Tensor::from_slice(&weights).view([-1, dim]).to_device(self.layout.device);
        Ok(tch::no_grad(|| {
            Autocast::run(self.layout.precision, self.layout.device, || next.item_embeddings(&rows))
                .to_kind(Kind::Float)
        }))
    }

    /// The next-item model's user embeddings `[batch, d]` for an eval batch (fp32), from its
    /// dense features and [`Job::eval_view`].
    fn user_embeddings(
        &self,
        dense: &Tensor,
        (pooled, sequences): &(Tensor, Sequences),
    ) -> Result<Tensor, EngineError> {
        let next = self.model.next_item().ok_or_else(|| EngineError::Internal("next-item model vanished".into()))?;
        let input = trainrec_models::ModelInput { dense, pooled, sequences, catalogue: None };
        Ok(tch::no_grad(|| {
            Autocast::run(self.layout.precision, self.layout.device, || next.user_embeddings(&input))
                .to_kind(Kind::Float)
        }))
    }

    /// A batch of no examples, for a rank whose eval split has ended while others go on.
    fn empty_batch(&self) -> Result<Batch, EngineError> {
        let keys = self.sampler.schema().sparse.clone();
        let sparse = trainrec_sparse::KeyedJaggedTensor::empty(keys, 0).map_err(|e| EngineError::Data(e.into()))?;
        Ok(Batch {
            dense: Vec::new(),
            num_dense: self.layout.num_dense,
            sparse,
            labels: Vec::new(),
            batch_size: 0,
            groups: None,
            weights: self.sampler.weighted().then(Vec::new),
        })
    }

    /// Every candidate of the corpus embedded by the candidate tower: `[rows, d]`, row `r` the
    /// candidate whose id is `r`.
    pub(crate) fn corpus_embeddings(&self, spec: &RetrievalSpec) -> Result<Tensor, EngineError> {
        let retrieval = self.model.retrieval().ok_or_else(|| EngineError::Internal("retrieval vanished".into()))?;
        let keys = self.sampler.schema().sparse.clone();
        let k = keys.iter().position(|f| *f == spec.input).ok_or_else(|| {
            EngineError::Internal(format!("candidate feature {} is not a sampler feature", spec.input))
        })?;
        const CHUNK: u64 = 16_384;
        let mut parts = Vec::new();
        let mut start = 0u64;
        while start < spec.rows {
            let n = CHUNK.min(spec.rows - start) as usize;
            let mut lengths = vec![0u32; keys.len() * n];
            lengths[k * n..(k + 1) * n].fill(1);
            let values: Vec<i64> = (start as i64..(start as usize + n) as i64).collect();
            let kjt = trainrec_sparse::KeyedJaggedTensor::new(keys.clone(), values, None, lengths, n)
                .map_err(|e| EngineError::Data(e.into()))?;
            let sparse = self.sparse.forward(&kjt, &mut trainrec_embedding::BatchContext::default())?;
            let sparse = sparse.to_device(self.vs.device());
            parts.push(tch::no_grad(|| {
                Autocast::run(self.layout.precision, sparse.device(), || retrieval.candidate_embeddings(&sparse))
                    .to_kind(Kind::Float)
            }));
            start += n as u64;
        }
        Ok(Tensor::cat(&parts, 0))
    }

    /// A fresh suite of the recipe's metrics. With `window: None`, for an evaluation: lifetime
    /// values under plain names (`auc`, `ne`). With `Some(w)`, for training batches: lifetime
    /// and windowed values over the latest `w` samples (`lifetime_ne`, `window_ne`,
    /// `window_auc`), TorchRec's `RecMetricModule` on the train loop.
    pub(crate) fn metric_suite(&self, window: Option<usize>) -> Result<MetricSuite, EngineError> {
        let metrics: Vec<Box<dyn Metric>> = self
            .recipe
            .metrics
            .iter()
            // Retrieval recall ranks the corpus at evaluation; it is not a per-prediction metric.
            .filter(|m| !matches!(m, MetricSection::RecallAtK { .. } | MetricSection::FullRanking { .. }))
            .map(|m| -> Result<Box<dyn Metric>, EngineError> {
                Ok(match (m, window) {
                    (MetricSection::Ne { include_logloss }, None) => Box::new(NeMetric::new(*include_logloss)),
                    (MetricSection::Auc { grouped }, _) => {
                        let auc = match window {
                            None => AucMetric::new(),
                            Some(w) => AucMetric::with_window(w)?,
                        };
                        let auc = if *grouped { auc.grouped() } else { auc };
                        match window {
                            None => Box::new(auc),
                            Some(_) => Box::new(WindowNamed(Box::new(auc))),
                        }
                    }
                    (MetricSection::Auprc {}, None) => Box::new(SplitAuprc::new()),
                    (MetricSection::Auprc {}, Some(w)) => Box::new(AuprcMetric::new(w)?),
                    (MetricSection::Ndcg { .. } | MetricSection::RecallSession { .. }, _) => {
                        let kind = session_kind(m).expect("a session metric");
                        Box::new(match window {
                            None => SessionMetric::for_split(kind)?,
                            Some(w) => SessionMetric::new(kind, w)?,
                        })
                    }
                    (MetricSection::Plugin { name, options }, _) => self
                        .plugin_metrics
                        .get(name)
                        .ok_or_else(|| EngineError::Internal(format!("plugin metric {name} vanished")))?
                        .build(&serde_json::Value::Object(options.clone()))?,
                    (other, None) => Box::new(LifetimeMetric::new(sum_kind(other).expect("a sum-state metric"))),
                    (other, Some(w)) => Box::new(SumMetric::new(sum_kind(other).expect("a sum-state metric"), w)?),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(MetricSuite::new(metrics)?)
    }

    /// [`Self::feed`] across ranks: every rank's predictions, labels and groups of this step
    /// (gathered), so every rank's suites hold the global metrics. Returns the examples fed.
    pub(crate) fn feed_all_ranks(
        &self,
        suites: &mut [MetricSuite],
        probs: &[f32],
        batch: &Batch,
    ) -> Result<usize, EngineError> {
        let Some(sync) = &self.sync else {
            self.feed(suites, probs, batch)?;
            return Ok(batch.batch_size);
        };
        let probs = sync.gather(probs)?;
        let labels = sync.gather(&batch.labels)?;
        // Every rank gathers (a rank past its split's end has no groups).
        let groups = sync.gather(batch.groups.as_deref().unwrap_or_default())?;
        let n = labels.len() / self.layout.num_labels.max(1);
        let groups = (n > 0 && groups.len() == n).then_some(groups);
        // Every rank gathers (a weighted sampler's batches all carry weights).
        let weights = match self.layout.weighted {
            true => Some(sync.gather(batch.weights.as_deref().unwrap_or_default())?),
            false => None,
        };
        let weights = weights.filter(|w| w.len() == n);
        self.feed_parts(suites, &probs, &labels, groups.as_deref(), weights.as_deref(), n)?;
        Ok(n)
    }

    /// Feeds one batch's predictions `[batch, tasks]` to each task's suite.
    fn feed(&self, suites: &mut [MetricSuite], probs: &[f32], batch: &Batch) -> Result<(), EngineError> {
        self.feed_parts(
            suites,
            probs,
            &batch.labels,
            batch.groups.as_deref(),
            batch.weights.as_deref(),
            batch.batch_size,
        )
    }

    /// [`Self::feed`] from the parts: `n` examples' predictions `[n, tasks]`, label columns
    /// `[n, num_labels]`, grouping keys and sample weights.
    fn feed_parts<'a>(
        &self,
        suites: &mut [MetricSuite],
        probs: &'a [f32],
        all_labels: &'a [f32],
        groups: Option<&'a [i64]>,
        weights: Option<&'a [f32]>,
        n: usize,
    ) -> Result<(), EngineError> {
        let t_count = self.layout.tasks.len();
        // A column of a row-major `[n, width]` matrix; a single column is the data itself.
        let column = |data: &'a [f32], width: usize, c: usize| -> Cow<'a, [f32]> {
            if width == 1 { Cow::Borrowed(data) } else { Cow::Owned((0..n).map(|i| data[i * width + c]).collect()) }
        };
        for (t, (suite, &(_, col))) in suites.iter_mut().zip(&self.layout.tasks).enumerate() {
            let predictions = column(probs, t_count, t);
            let labels = column(all_labels, self.layout.num_labels, col);
            let input = TaskBatch { predictions: &predictions, labels: &labels, weights, groups };
            suite.update_batch(&input)?;
        }
        Ok(())
    }

    /// Every task's values: plain names (`auc`) for one task, `<metric>-<task>` (`auc-click`)
    /// for several.
    pub(crate) fn values(&self, suites: &[MetricSuite]) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (suite, (task, _)) in suites.iter().zip(&self.layout.tasks) {
            for (name, v) in suite.compute() {
                let key = if self.layout.tasks.len() == 1 { name } else { format!("{name}-{task}") };
                out.insert(key, v);
            }
        }
        out
    }
}

/// The sum-state kind of a `[[metrics]]` entry, if it is one.
fn sum_kind(m: &MetricSection) -> Option<SumMetricKind> {
    Some(match *m {
        MetricSection::Ne { include_logloss } => SumMetricKind::Ne { include_logloss },
        MetricSection::Calibration {} => SumMetricKind::Calibration,
        MetricSection::Ctr {} => SumMetricKind::Ctr,
        MetricSection::Mse {} => SumMetricKind::Mse,
        MetricSection::Mae {} => SumMetricKind::Mae,
        MetricSection::Accuracy { threshold } => SumMetricKind::Accuracy { threshold },
        MetricSection::Precision { threshold } => SumMetricKind::Precision { threshold },
        MetricSection::Recall { threshold } => SumMetricKind::Recall { threshold },
        MetricSection::WeightedAvg {} => SumMetricKind::WeightedAvg,
        _ => return None,
    })
}

/// The session kind of a `[[metrics]]` entry, if it is one.
fn session_kind(m: &MetricSection) -> Option<SessionMetricKind> {
    Some(match *m {
        MetricSection::Ndcg { k, exponential_gain, report_as_decreasing, remove_single_length_sessions } => {
            SessionMetricKind::Ndcg { k, exponential_gain, report_as_decreasing, remove_single_length_sessions }
        }
        MetricSection::RecallSession { top_threshold, run_ranking_of_labels } => {
            SessionMetricKind::RecallSession { top_threshold, run_ranking_of_labels }
        }
        _ => return None,
    })
}

/// A windowed metric that reports plain names (AUC's `auc`) under `window_<name>`, as TorchRec
/// names its window values.
struct WindowNamed(Box<dyn Metric>);

impl Metric for WindowNamed {
    fn output_names(&self) -> Vec<String> {
        self.0.output_names().into_iter().map(|n| format!("window_{n}")).collect()
    }
    fn update(&mut self, p: &[f32], l: &[f32], w: Option<&[f32]>) -> Result<(), trainrec_metrics::MetricError> {
        self.0.update(p, l, w)
    }
    fn update_batch(&mut self, b: &TaskBatch<'_>) -> Result<(), trainrec_metrics::MetricError> {
        self.0.update_batch(b)
    }
    fn needs_groups(&self) -> bool {
        self.0.needs_groups()
    }
    fn compute(&self) -> Vec<(String, f64)> {
        self.0.compute().into_iter().map(|(n, v)| (format!("window_{n}"), v)).collect()
    }
    fn reset(&mut self) {
        self.0.reset();
    }
    fn state(&self) -> Option<trainrec_metrics::MetricState> {
        self.0.state()
    }
    fn load_state(&mut self, state: &trainrec_metrics::MetricState) -> Result<(), trainrec_metrics::MetricError> {
        self.0.load_state(state)
    }
}
