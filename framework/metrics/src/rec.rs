//! State-based metrics with TorchRec's definitions, lifetime and windowed values, mergeable
//! across ranks: the sum-state family of `torchrec.metrics` (NE / log loss, calibration, CTR,
//! MSE / RMSE, MAE, accuracy, precision, recall, weighted average).
//!
//! Each metric keeps a few `f64` sums. The lifetime sums add every batch; the window sums
//! follow TorchRec's `WindowBuffer`: each update's sums are queued with its sample count, and
//! the oldest whole updates are dropped while the window holds more than `window` samples
//! (never the newest one), or when 1,000 updates are queued. Reducing across ranks is a sum of
//! both (`merge`), as TorchRec's `dist_reduce_fx = "sum"`; TorchRec gives each of `world`
//! ranks a window of `ceil(window / world)` samples ([`SumMetric::for_rank`]).

use std::collections::VecDeque;

use crate::ne::{logloss_from_sums, ne_from_sums};
use crate::state::{limit_array, of_kind, with_kind};
use crate::{Metric, MetricError, MetricState, TaskBatch, kernels, validate_batch, weight_at};

/// TorchRec's `MAX_BUFFER_COUNT`: updates a window remembers at most.
pub const MAX_WINDOW_UPDATES: usize = 1000;

/// A sum-state metric and its options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SumMetricKind {
    /// Normalized entropy (and log loss, base 2): see [`crate::NeMetric`] for the formula.
    Ne {
        /// Also report `logloss`.
        include_logloss: bool,
    },
    /// `Σ w p / Σ w y` (0 when `Σ w y <= 0`).
    Calibration,
    /// `Σ w y / Σ w` (0 when `Σ w = 0`).
    Ctr,
    /// `mse = Σ w (y - p)² / Σ w`, `rmse = sqrt(mse)` (0 when `Σ w = 0`).
    Mse,
    /// `Σ w |y - p| / Σ w` (0 when `Σ w = 0`).
    Mae,
    /// `Σ w [(p >= t) == y] / Σ w` (a soft label never equals the 0/1 decision).
    Accuracy {
        /// Decision threshold `t` (TorchRec: 0.5).
        threshold: f64,
    },
    /// `tp / (tp + fp)` with `tp = Σ w [p >= t] y`, `fp = Σ w [p >= t] (1 - y)` (0 when both are 0).
    Precision {
        /// Decision threshold `t`.
        threshold: f64,
    },
    /// `tp / (tp + fn)` with `tp = Σ w [p >= t] y`, `fn = Σ w [p <= t] y` — TorchRec counts a
    /// prediction equal to `t` as both a true positive and a false negative (0 when both are 0).
    Recall {
        /// Decision threshold `t`.
        threshold: f64,
    },
    /// `Σ w p / Σ w` (NaN before any weight, as in TorchRec).
    WeightedAvg,
}

impl SumMetricKind {
    /// TorchRec's metric name (the `ne` of `ne-click|window_ne`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Ne { .. } => "ne",
            Self::Calibration => "calibration",
            Self::Ctr => "ctr",
            Self::Mse => "mse",
            Self::Mae => "mae",
            Self::Accuracy { .. } => "accuracy",
            Self::Precision { .. } => "precision",
            Self::Recall { .. } => "recall",
            Self::WeightedAvg => "weighted_avg",
        }
    }

    /// The values it reports (e.g. `["mse", "rmse"]`).
    pub fn values(&self) -> Vec<&'static str> {
        match self {
            Self::Ne { include_logloss: true } => vec!["ne", "logloss"],
            Self::Mse => vec!["mse", "rmse"],
            other => vec![other.name()],
        }
    }

    fn num_sums(&self) -> usize {
        match self {
            Self::Ne { .. } => 4,
            _ => 2,
        }
    }

    /// The sums of one validated batch. NE's come from the vectorised [`kernels::ne_sums`];
    /// the others add each sample's contributions to two sums.
    fn batch_sums(&self, b: &TaskBatch<'_>) -> Vec<f64> {
        fn two(b: &TaskBatch<'_>, add: impl Fn(&mut [f64; 2], f64, f64, f64)) -> Vec<f64> {
            let mut s = [0.0; 2];
            for (i, (&p, &y)) in b.predictions.iter().zip(b.labels).enumerate() {
                add(&mut s, f64::from(p), f64::from(y), weight_at(b.weights, i));
            }
            s.to_vec()
        }
        match *self {
            Self::Ne { .. } => {
                kernels::ne_sums(b.predictions, b.labels, b.weights, kernels::all_hard(b.labels)).to_vec()
            }
            Self::Calibration => two(b, |s, p, y, w| {
                s[0] += w * p;
                s[1] += w * y;
            }),
            Self::Ctr => two(b, |s, _, y, w| {
                s[0] += w * y;
                s[1] += w;
            }),
            Self::Mse => two(b, |s, p, y, w| {
                s[0] += w * (y - p) * (y - p);
                s[1] += w;
            }),
            Self::Mae => two(b, |s, p, y, w| {
                s[0] += w * (y - p).abs();
                s[1] += w;
            }),
            Self::Accuracy { threshold } => two(b, |s, p, y, w| {
                let decision = if p >= threshold { 1.0 } else { 0.0 };
                s[0] += if decision == y { w } else { 0.0 };
                s[1] += w;
            }),
            Self::Precision { threshold } => two(b, |s, p, y, w| {
                if p >= threshold {
                    s[0] += w * y;
                    s[1] += w * (1.0 - y);
                }
            }),
            Self::Recall { threshold } => two(b, |s, p, y, w| {
                if p >= threshold {
                    s[0] += w * y;
                }
                if p <= threshold {
                    s[1] += w * y;
                }
            }),
            Self::WeightedAvg => two(b, |s, p, _, w| {
                s[0] += w * p;
                s[1] += w;
            }),
        }
    }

    /// The reported values from the sums.
    fn finish(&self, s: &[f64]) -> Vec<f64> {
        let ratio_or_zero = |num: f64, den: f64| if den == 0.0 { 0.0 } else { num / den };
        match *self {
            Self::Ne { include_logloss } => {
                let (ce, n, pos, neg) = (s[0], s[1], s[2], s[3]);
                let mut v = vec![ne_from_sums(ce, n, pos, neg)];
                if include_logloss {
                    v.push(logloss_from_sums(ce, pos, neg));
                }
                v
            }
            Self::Calibration => vec![if s[1] <= 0.0 { 0.0 } else { s[0] / s[1] }],
            Self::Ctr | Self::Mae | Self::Accuracy { .. } => vec![ratio_or_zero(s[0], s[1])],
            Self::Mse => {
                let mse = ratio_or_zero(s[0], s[1]);
                vec![mse, mse.sqrt()]
            }
            Self::Precision { .. } | Self::Recall { .. } => vec![ratio_or_zero(s[0], s[0] + s[1])],
            Self::WeightedAvg => vec![s[0] / s[1]],
        }
    }
}

/// TorchRec's window of per-update sums.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Window {
    max_samples: usize,
    sums: Vec<f64>,
    updates: VecDeque<(Vec<f64>, usize)>,
    samples: usize,
}

impl Window {
    /// An empty window of `max_samples` samples over `num_sums` sums.
    pub(crate) fn new(max_samples: usize, num_sums: usize) -> Self {
        Self { max_samples, sums: vec![0.0; num_sums], updates: VecDeque::new(), samples: 0 }
    }

    /// The window's sums.
    pub(crate) fn sums(&self) -> &[f64] {
        &self.sums
    }

    /// Adds another rank's window sums.
    pub(crate) fn merge(&mut self, other: &Window) {
        self.sums.iter_mut().zip(&other.sums).for_each(|(a, b)| *a += b);
    }

    /// Forgets everything.
    pub(crate) fn clear(&mut self) {
        self.sums.iter_mut().for_each(|s| *s = 0.0);
        self.updates.clear();
        self.samples = 0;
    }

    /// Adds one update's sums over `size` samples.
    pub(crate) fn push(&mut self, sums: Vec<f64>, size: usize) {
        if self.updates.len() == MAX_WINDOW_UPDATES {
            self.pop();
        }
        self.sums.iter_mut().zip(&sums).for_each(|(a, b)| *a += b);
        self.updates.push_back((sums, size));
        self.samples += size;
        while self.samples > self.max_samples && self.updates.len() > 1 {
            self.pop();
        }
    }

    /// Saves the window into `state`: `window_max` (the window size in samples, empty when
    /// unbounded), `window_sums` (the running sums, kept as they are: recomputing them from the
    /// queued updates would round differently), `window_update_sums` (each queued update's sums,
    /// oldest first, concatenated) and `window_update_sizes` (their sample counts).
    pub(crate) fn save(&self, state: &mut MetricState) {
        state.push("window_max", limit_array(self.max_samples));
        state.push("window_sums", self.sums.iter().copied());
        state.push("window_update_sums", self.updates.iter().flat_map(|(sums, _)| sums.iter().copied()));
        state.push_counts("window_update_sizes", self.updates.iter().map(|&(_, size)| size as u64));
    }

    /// The names of the arrays [`Window::save`] writes.
    pub(crate) const STATE_NAMES: [&'static str; 4] =
        ["window_max", "window_sums", "window_update_sums", "window_update_sizes"];

    /// The window [`Window::save`] wrote into `state`, checked against this window's size and
    /// number of sums and against the invariants of [`Window::push`].
    pub(crate) fn load(&self, state: &MetricState) -> Result<Self, MetricError> {
        state.expect_array("window_max", &limit_array(self.max_samples))?;
        let n = self.sums.len();
        state.finite("window_sums")?;
        let sums = state.get_len("window_sums", n)?.to_vec();
        let sizes = state.counts("window_update_sizes")?;
        if sizes.len() > MAX_WINDOW_UPDATES {
            return Err(MetricError::bad_state(format!(
                "the window queues {} updates, more than the {MAX_WINDOW_UPDATES} a window keeps",
                sizes.len()
            )));
        }
        state.finite("window_update_sums")?;
        let flat = state.get_len("window_update_sums", sizes.len() * n)?;
        let samples = sizes.iter().try_fold(0usize, |total, &s| usize::try_from(s).ok()?.checked_add(total));
        let samples =
            samples.ok_or_else(|| MetricError::bad_state("the window's update sizes overflow a sample count"))?;
        if sizes.len() > 1 && samples > self.max_samples {
            return Err(MetricError::bad_state(format!(
                "the window's {} updates hold {samples} samples, more than its {} (only a single update may exceed it)",
                sizes.len(),
                self.max_samples
            )));
        }
        let updates = flat.chunks(n.max(1)).zip(&sizes).map(|(s, &size)| (s.to_vec(), size as usize)).collect();
        Ok(Self { max_samples: self.max_samples, sums, updates, samples })
    }

    fn pop(&mut self) {
        if let Some((old, size)) = self.updates.pop_front() {
            self.sums.iter_mut().zip(&old).for_each(|(a, b)| *a -= b);
            self.samples -= size;
        }
    }
}

/// One sum-state metric of one task: lifetime and windowed values.
#[derive(Clone, Debug, PartialEq)]
pub struct SumMetric {
    kind: SumMetricKind,
    lifetime: Vec<f64>,
    window: Window,
}

impl SumMetric {
    /// A fresh metric whose window holds `window` samples.
    pub fn new(kind: SumMetricKind, window: usize) -> Result<Self, MetricError> {
        if window == 0 {
            return Err(MetricError::EmptyWindow);
        }
        let n = kind.num_sums();
        Ok(Self { kind, lifetime: vec![0.0; n], window: Window::new(window, n) })
    }

    /// The metric of one of `world` ranks sharing a global window of `window` samples:
    /// each rank keeps `ceil(window / world)` (TorchRec's local window).
    pub fn for_rank(kind: SumMetricKind, window: usize, world: usize) -> Result<Self, MetricError> {
        Self::new(kind, window.div_ceil(world.max(1)))
    }

    /// Which metric.
    pub fn kind(&self) -> SumMetricKind {
        self.kind
    }

    /// The lifetime sums (the mergeable state).
    pub fn lifetime_state(&self) -> &[f64] {
        &self.lifetime
    }

    /// The current window's sums.
    pub fn window_state(&self) -> &[f64] {
        self.window.sums()
    }

    /// Adds another rank's state (lifetime and window sums), as TorchRec's sum reduction:
    /// computing afterwards gives the values over both ranks' data.
    pub fn merge(&mut self, other: &SumMetric) -> Result<(), MetricError> {
        if other.kind != self.kind {
            return Err(MetricError::Incompatible { ours: self.kind.name(), theirs: other.kind.name() });
        }
        self.lifetime.iter_mut().zip(&other.lifetime).for_each(|(a, b)| *a += b);
        self.window.merge(&other.window);
        Ok(())
    }

    /// The state, arrays prefixed by the kind's name: `<name>.lifetime` (the lifetime sums) and
    /// the window's arrays (see [`Window::save`]).
    fn save(&self) -> MetricState {
        let mut state = MetricState::default();
        state.push("lifetime", self.lifetime.iter().copied());
        self.window.save(&mut state);
        with_kind(self.kind.name(), state)
    }

    /// Restores what [`SumMetric::save`] wrote, after checking all of it; errors name `metric`.
    fn load(&mut self, metric: &str, state: &MetricState) -> Result<(), MetricError> {
        let load = || {
            let names = [&["lifetime"][..], &Window::STATE_NAMES].concat();
            let state = of_kind(self.kind.name(), state, &names)?;
            state.finite("lifetime")?;
            let lifetime = state.get_len("lifetime", self.kind.num_sums())?.to_vec();
            Ok((lifetime, self.window.load(&state)?))
        };
        (self.lifetime, self.window) = load().map_err(|e: MetricError| e.in_metric(metric))?;
        Ok(())
    }

    /// Adds a batch [`validate_batch`] has accepted.
    fn add_valid(&mut self, b: TaskBatch<'_>) {
        let sums = self.kind.batch_sums(&b);
        self.lifetime.iter_mut().zip(&sums).for_each(|(a, b)| *a += b);
        self.window.push(sums, b.predictions.len());
    }

    /// Lifetime values, named `lifetime_<value>`, then window values, `window_<value>`.
    pub fn values(&self) -> Vec<(String, f64)> {
        let names = self.kind.values();
        let life = self.kind.finish(&self.lifetime);
        let win = self.kind.finish(self.window.sums());
        let mut out: Vec<(String, f64)> = names.iter().zip(life).map(|(n, v)| (format!("lifetime_{n}"), v)).collect();
        out.extend(names.iter().zip(win).map(|(n, v)| (format!("window_{n}"), v)));
        out
    }
}

impl Metric for SumMetric {
    fn output_names(&self) -> Vec<String> {
        self.values().into_iter().map(|(n, _)| n).collect()
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        validate_batch(predictions, labels, weights)?;
        self.add_valid(TaskBatch::new(predictions, labels, weights));
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        self.values()
    }

    fn reset(&mut self) {
        self.lifetime.iter_mut().for_each(|s| *s = 0.0);
        self.window.clear();
    }

    /// The lifetime sums `<kind>.lifetime` (`ctr.lifetime`) and the window: its size
    /// `<kind>.window_max`, running sums `<kind>.window_sums` and queued updates
    /// `<kind>.window_update_sums` / `<kind>.window_update_sizes`.
    fn state(&self) -> Option<MetricState> {
        Some(self.save())
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        self.load(&self.output_names().join(","), state)
    }
}

/// Several metrics over several tasks (TorchRec's `RecMetricModule` for the sum-state
/// metrics): each metric is computed per task, reported as `<metric>-<task>|<value>`.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiTaskMetrics {
    tasks: Vec<String>,
    /// `metrics[m][t]`: metric `m` of task `t`.
    metrics: Vec<Vec<SumMetric>>,
}

impl MultiTaskMetrics {
    /// `kinds` for each of `tasks`, with a window of `window` samples per task.
    pub fn new(tasks: &[&str], kinds: &[SumMetricKind], window: usize) -> Result<Self, MetricError> {
        let metrics = kinds
            .iter()
            .map(|&k| tasks.iter().map(|_| SumMetric::new(k, window)).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { tasks: tasks.iter().map(|t| t.to_string()).collect(), metrics })
    }

    /// The task names.
    pub fn tasks(&self) -> &[String] {
        &self.tasks
    }

    /// Adds one batch: `batch[t]` for task `t`. A rejected batch changes nothing.
    pub fn update(&mut self, batch: &[TaskBatch<'_>]) -> Result<(), MetricError> {
        if batch.len() != self.tasks.len() {
            return Err(MetricError::TaskCount { expected: self.tasks.len(), got: batch.len() });
        }
        for b in batch {
            validate_batch(b.predictions, b.labels, b.weights)?;
        }
        // Validated once per task above, so every metric takes the batch or none does.
        for per_task in &mut self.metrics {
            for (m, b) in per_task.iter_mut().zip(batch) {
                m.add_valid(*b);
            }
        }
        Ok(())
    }

    /// Adds another rank's state.
    pub fn merge(&mut self, other: &MultiTaskMetrics) -> Result<(), MetricError> {
        if other.tasks != self.tasks || other.metrics.len() != self.metrics.len() {
            return Err(MetricError::Incompatible { ours: "multi-task metrics", theirs: "other tasks or metrics" });
        }
        for (a, b) in self.metrics.iter_mut().zip(&other.metrics) {
            for (x, y) in a.iter_mut().zip(b) {
                x.merge(y)?;
            }
        }
        Ok(())
    }

    /// Every value, `<metric>-<task>|<lifetime|window>_<value>`.
    pub fn compute(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for per_task in &self.metrics {
            for (m, task) in per_task.iter().zip(&self.tasks) {
                for (name, v) in m.values() {
                    out.push((format!("{}-{task}|{name}", m.kind().name()), v));
                }
            }
        }
        out
    }
}

/// A [`SumMetric`] that reports only its lifetime values, under plain names (`ctr`, `mse`,
/// `rmse`): for evaluations, which cover a whole split.
#[derive(Clone, Debug, PartialEq)]
pub struct LifetimeMetric(SumMetric);

impl LifetimeMetric {
    /// A fresh lifetime-only metric.
    pub fn new(kind: SumMetricKind) -> Self {
        let n = kind.num_sums();
        Self(SumMetric { kind, lifetime: vec![0.0; n], window: Window::new(usize::MAX, n) })
    }
}

impl Metric for LifetimeMetric {
    fn output_names(&self) -> Vec<String> {
        self.0.kind.values().into_iter().map(String::from).collect()
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        self.0.update(predictions, labels, weights)
    }

    fn compute(&self) -> Vec<(String, f64)> {
        let k = self.0.kind;
        k.values().into_iter().map(String::from).zip(k.finish(&self.0.lifetime)).collect()
    }

    fn reset(&mut self) {
        self.0.reset();
    }

    /// The arrays of [`SumMetric`]'s state (the unreported window included).
    fn state(&self) -> Option<MetricState> {
        Some(self.0.save())
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        self.0.load(&self.output_names().join(","), state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resume::{assert_rejects_damaged, assert_resumes_exactly, batches};

    const KINDS: [SumMetricKind; 10] = [
        SumMetricKind::Ne { include_logloss: true },
        SumMetricKind::Ne { include_logloss: false },
        SumMetricKind::Calibration,
        SumMetricKind::Ctr,
        SumMetricKind::Mse,
        SumMetricKind::Mae,
        SumMetricKind::Accuracy { threshold: 0.5 },
        SumMetricKind::Precision { threshold: 0.5 },
        SumMetricKind::Recall { threshold: 0.5 },
        SumMetricKind::WeightedAvg,
    ];

    fn fed(kind: SumMetricKind, window: usize, data: &[crate::resume::Owned]) -> SumMetric {
        let mut m = SumMetric::new(kind, window).unwrap();
        for b in data {
            m.update(&b.p, &b.y, b.w.as_deref()).unwrap();
        }
        m
    }

    #[test]
    fn resumes_exactly_from_a_saved_state() {
        let data = batches(17, 40, true);
        for kind in KINDS {
            // ~10 samples a batch: a window of 40 drops updates at nearly every step.
            let make = || -> Box<dyn Metric> { Box::new(SumMetric::new(kind, 40).unwrap()) };
            assert_resumes_exactly(&make, &data[..10], &data[10..]);
            assert_rejects_damaged(&make, &fed(kind, 40, &data[..10]).state().unwrap());
            let lifetime = || -> Box<dyn Metric> { Box::new(LifetimeMetric::new(kind)) };
            assert_resumes_exactly(&lifetime, &data[..10], &data[10..]);
            let mut m = LifetimeMetric::new(kind);
            m.update(&data[0].p, &data[0].y, None).unwrap();
            assert_rejects_damaged(&lifetime, &m.state().unwrap());
        }
    }

    #[test]
    fn resumes_exactly_with_a_full_update_queue() {
        // More updates than the window queues (1,000): the oldest are dropped by count.
        let data = batches(3, MAX_WINDOW_UPDATES + 40, false);
        let make = || -> Box<dyn Metric> { Box::new(SumMetric::new(SumMetricKind::Mse, 1 << 40).unwrap()) };
        assert_resumes_exactly(&make, &data[..MAX_WINDOW_UPDATES + 5], &data[MAX_WINDOW_UPDATES + 5..]);
        let state = fed(SumMetricKind::Mse, 1 << 40, &data).state().unwrap();
        assert_eq!(state.get("mse.window_update_sizes").unwrap().len(), MAX_WINDOW_UPDATES);
        assert_rejects_damaged(&make, &state);
    }

    #[test]
    fn state_of_another_metric_or_an_inconsistent_window_is_rejected() {
        let data = batches(4, 12, false);
        let state = fed(SumMetricKind::Ctr, 40, &data).state().unwrap();
        let e = SumMetric::new(SumMetricKind::Mae, 40).unwrap().load_state(&state).unwrap_err().to_string();
        assert!(e.contains(r#"metric "lifetime_mae,window_mae": unexpected array "ctr.lifetime""#), "{e}");
        let e = SumMetric::new(SumMetricKind::Ctr, 30).unwrap().load_state(&state).unwrap_err().to_string();
        assert!(e.contains("saved with window_max = [40.0], but this metric has window_max = [30.0]"), "{e}");
        assert!(LifetimeMetric::new(SumMetricKind::Ctr).load_state(&state).is_err());
        // Two queued updates over more samples than the window: push would have dropped one.
        let mut big = state.clone();
        let sizes = &mut big.arrays.iter_mut().find(|(n, _)| n == "ctr.window_update_sizes").unwrap().1;
        assert!(sizes.len() > 1);
        sizes[0] = 1000.0;
        let mut m = SumMetric::new(SumMetricKind::Ctr, 40).unwrap();
        let e = m.load_state(&big).unwrap_err().to_string();
        assert!(e.contains("more than its 40 (only a single update may exceed it)"), "{e}");
        assert_eq!(m, SumMetric::new(SumMetricKind::Ctr, 40).unwrap(), "a failed load changes nothing");
        m.load_state(&state).unwrap();
        assert_eq!(m, fed(SumMetricKind::Ctr, 40, &data));
    }
}
