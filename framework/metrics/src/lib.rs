//! Recommendation metrics with TorchRec's definitions (NE, log loss, AUC, grouped AUC, AUPRC,
//! NDCG, session recall and the sum-state family).
//!
//! Every metric accumulates its state over batches (`update`) and reports on demand
//! (`compute`); `reset` starts over. State is kept in `f64`. The definitions follow
//! `torchrec/metrics/ne.py` and `torchrec/metrics/auc.py`; the doc comment of each metric
//! states its formula, including where TorchRec's choices are surprising (base-2 log loss,
//! tie handling in AUC).
//!
//! [`MetricSuite`] holds several metrics, feeds them the same batches and renders a
//! [`MetricReport`] as an aligned console table or one JSONL line.
//!
//! Every built-in metric saves its accumulated state as a [`MetricState`]
//! ([`Metric::state`]) and restores it into a metric of the same configuration
//! ([`Metric::load_state`]), so that a resumed run reports exactly the values the
//! uninterrupted run would have.

mod auc;
mod auprc;
pub mod bench;
mod kernels;
mod ne;
mod rec;
mod session;
pub mod sinks;
mod state;
mod suite;
mod throughput;
mod window;

pub use auc::AucMetric;
pub use auprc::{AUPRC_BINS, AuprcMetric, SplitAuprc};
pub use ne::{NE_ETA, NeMetric};
pub use rec::{LifetimeMetric, MAX_WINDOW_UPDATES, MultiTaskMetrics, SumMetric, SumMetricKind, TaskBatch};
pub use session::{SessionMetric, SessionMetricKind};
pub use state::MetricState;
pub use suite::{MetricReport, MetricSuite, Split, render_table};
pub use throughput::{THROUGHPUT_WARMUP_STEPS, THROUGHPUT_WINDOW_SECONDS, ThroughputMetric};

/// What went wrong when feeding or reporting a metric.
#[derive(Debug, thiserror::Error)]
pub enum MetricError {
    /// `labels` or `weights` does not have one entry per prediction.
    #[error(
        "{what} has {len} entries but there are {predictions} predictions (expected one {what} entry per prediction)"
    )]
    LengthMismatch {
        /// Which input is wrong (`labels` or `weights`).
        what: &'static str,
        /// Its length.
        len: usize,
        /// The number of predictions.
        predictions: usize,
    },
    /// An input value is NaN or infinite.
    #[error("{what}[{index}] = {value} is not finite")]
    NonFinite {
        /// Which input holds the value (`predictions`, `labels` or `weights`).
        what: &'static str,
        /// Position in the batch.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// A label is outside `[0, 1]` (soft labels inside the interval are allowed).
    #[error("labels[{index}] = {value} is out of range (labels lie in [0, 1]; NDCG relevance grades are >= 0)")]
    LabelOutOfRange {
        /// Position in the batch.
        index: usize,
        /// The offending label.
        value: f32,
    },
    /// A sample weight is negative.
    #[error("weights[{index}] = {value} is negative (sample weights must be >= 0)")]
    NegativeWeight {
        /// Position in the batch.
        index: usize,
        /// The offending weight.
        value: f32,
    },
    /// A window size of zero samples was requested.
    #[error("a metric window must hold at least one sample (got a window of 0)")]
    EmptyWindow,
    /// Two metrics of one suite report a value under the same name.
    #[error("two metrics in the suite both report {name:?}; each reported name must be unique")]
    DuplicateName {
        /// The name reported twice.
        name: String,
    },
    /// Two metric states that cannot be merged (different metrics or tasks).
    #[error("cannot merge {theirs} into {ours}")]
    Incompatible {
        /// This side.
        ours: &'static str,
        /// The other side.
        theirs: &'static str,
    },
    /// A multi-task update with the wrong number of tasks.
    #[error("expected a batch for each of {expected} tasks, got {got}")]
    TaskCount {
        /// Tasks configured.
        expected: usize,
        /// Batches given.
        got: usize,
    },
    /// A metric that ranks within groups (grouped AUC, NDCG, session recall) got a batch
    /// without grouping keys.
    #[error("{metric} needs a grouping key per sample (a user or session id from the sampler), but the batch has none")]
    MissingGroups {
        /// The metric.
        metric: &'static str,
    },
    /// The grouping keys do not match the predictions.
    #[error("{metric}: the batch has {len} grouping keys for {predictions} predictions")]
    GroupLength {
        /// The metric.
        metric: &'static str,
        /// Keys given.
        len: usize,
        /// Predictions.
        predictions: usize,
    },
    /// A metric option out of its range.
    #[error("{metric}: {message}")]
    Option {
        /// The metric.
        metric: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The metric cannot save or restore its accumulated state (a plugin metric that does not
    /// implement [`Metric::state`] and [`Metric::load_state`]).
    #[error(
        "metric {metric:?} cannot save or restore its state (it does not implement Metric::state and \
         Metric::load_state), so a checkpoint cannot resume it exactly"
    )]
    StateUnsupported {
        /// The metric: its output names joined by `,`.
        metric: String,
    },
    /// A saved metric state does not fit the metric it is loaded into (another metric or
    /// configuration, or a damaged checkpoint).
    #[error("cannot restore {}: {message}", state_owner(metric))]
    BadState {
        /// The metric: its output names joined by `,` (empty until [`MetricError::in_metric`]
        /// names it).
        metric: String,
        /// What does not fit.
        message: String,
    },
    /// A list of metric states whose length differs from the number of metrics.
    #[error("the checkpoint holds {got} metric states but the suite has {expected} metrics")]
    StateCount {
        /// Metrics in the suite.
        expected: usize,
        /// States given.
        got: usize,
    },
    /// Serialising a report failed.
    #[error("could not serialise the metric report: {0}")]
    Json(#[from] serde_json::Error),
}

/// "the state of metric \"auc\"", or "a metric state" before the metric is named.
fn state_owner(metric: &str) -> String {
    if metric.is_empty() { "a metric state".to_owned() } else { format!("the state of metric {metric:?}") }
}

/// A metric accumulated over batches of binary (or soft-label) predictions.
///
/// Implementations validate their inputs with [`validate_batch`] and leave their state
/// unchanged when a batch is rejected.
pub trait Metric: Send {
    /// The names [`Metric::compute`] reports, in the same order (e.g. `["ne", "logloss"]`).
    fn output_names(&self) -> Vec<String>;

    /// Adds one batch. `weights` of `None` means every sample has weight 1.
    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError>;

    /// Adds one batch with its grouping keys (see [`TaskBatch::groups`]). Metrics that rank
    /// within groups override it (and report [`Metric::needs_groups`]); the others ignore the
    /// keys.
    fn update_batch(&mut self, batch: &TaskBatch<'_>) -> Result<(), MetricError> {
        self.update(batch.predictions, batch.labels, batch.weights)
    }

    /// Whether every batch must carry grouping keys (then [`Metric::update`] fails with
    /// [`MetricError::MissingGroups`]).
    fn needs_groups(&self) -> bool {
        false
    }

    /// The metric values over everything accumulated since construction or the last reset.
    fn compute(&self) -> Vec<(String, f64)>;

    /// Forgets all accumulated state.
    fn reset(&mut self);

    /// The accumulated state, for a checkpoint: loading it with [`Metric::load_state`] into a
    /// metric of the same configuration makes every later `update` and `compute` give exactly
    /// (bit for bit) what this metric would. `None` when the metric cannot save its state (the
    /// default, for plugin metrics that do not implement it).
    ///
    fn state(&self) -> Option<MetricState> {
        None
    }

    /// Replaces the accumulated state by `state`, as saved by [`Metric::state`] of a metric with
    /// the same configuration. A state that does not fit (another metric or configuration,
    /// missing arrays, wrong lengths, out-of-range values) is a [`MetricError::BadState`] and
    /// leaves the metric unchanged. The default fails with [`MetricError::StateUnsupported`].
    ///
    /// A state holds no configuration beyond what the arrays say (window sizes, and the kind
    /// in array names where two kinds would otherwise look alike): the metric it is loaded into
    /// must be built from the same configuration.
    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        let _ = state;
        Err(MetricError::StateUnsupported { metric: self.output_names().join(",") })
    }
}

/// Checks one batch: `labels` (and `weights`, when given) have one entry per prediction,
/// every value is finite, labels lie in `[0, 1]` and weights are `>= 0`.
pub fn validate_batch(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
    validate_inputs(predictions, labels, weights, false)
}

/// [`validate_batch`]; with `graded`, labels may be any finite value `>= 0` (relevance grades
/// of NDCG).
pub(crate) fn validate_inputs(
    predictions: &[f32],
    labels: &[f32],
    weights: Option<&[f32]>,
    graded: bool,
) -> Result<(), MetricError> {
    let n = predictions.len();
    if labels.len() != n {
        return Err(MetricError::LengthMismatch { what: "labels", len: labels.len(), predictions: n });
    }
    if let Some(w) = weights
        && w.len() != n
    {
        return Err(MetricError::LengthMismatch { what: "weights", len: w.len(), predictions: n });
    }
    if !graded && kernels::batch_is_clean(predictions, labels, weights) {
        return Ok(());
    }
    // Something is wrong: find the first bad value to name it.
    for (index, &value) in predictions.iter().enumerate() {
        if !value.is_finite() {
            return Err(MetricError::NonFinite { what: "predictions", index, value });
        }
    }
    for (index, &value) in labels.iter().enumerate() {
        if !value.is_finite() {
            return Err(MetricError::NonFinite { what: "labels", index, value });
        }
        if value < 0.0 || (!graded && value > 1.0) {
            return Err(MetricError::LabelOutOfRange { index, value });
        }
    }
    if let Some(w) = weights {
        for (index, &value) in w.iter().enumerate() {
            if !value.is_finite() {
                return Err(MetricError::NonFinite { what: "weights", index, value });
            }
            if value < 0.0 {
                return Err(MetricError::NegativeWeight { index, value });
            }
        }
    }
    Ok(())
}

/// Checks that `batch` has one grouping key per prediction, for `metric`.
pub(crate) fn check_groups(metric: &'static str, batch: &TaskBatch<'_>) -> Result<(), MetricError> {
    match batch.groups {
        None => Err(MetricError::MissingGroups { metric }),
        Some(g) if g.len() != batch.predictions.len() => {
            Err(MetricError::GroupLength { metric, len: g.len(), predictions: batch.predictions.len() })
        }
        Some(_) => Ok(()),
    }
}

/// The weight of sample `i`: 1 when the batch has no weights.
#[inline]
fn weight_at(weights: Option<&[f32]>, i: usize) -> f64 {
    weights.map_or(1.0, |w| f64::from(w[i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_rejects_bad_batches() {
        let p = [0.5, 0.5];
        assert!(matches!(
            validate_batch(&p, &[1.0], None),
            Err(MetricError::LengthMismatch { what: "labels", len: 1, predictions: 2 })
        ));
        assert!(matches!(
            validate_batch(&p, &[1.0, 0.0], Some(&[1.0])),
            Err(MetricError::LengthMismatch { what: "weights", .. })
        ));
        assert!(matches!(
            validate_batch(&[0.5, f32::NAN], &[1.0, 0.0], None),
            Err(MetricError::NonFinite { what: "predictions", index: 1, .. })
        ));
        assert!(matches!(
            validate_batch(&p, &[f32::INFINITY, 0.0], None),
            Err(MetricError::NonFinite { what: "labels", index: 0, .. })
        ));
        assert!(matches!(validate_batch(&p, &[1.5, 0.0], None), Err(MetricError::LabelOutOfRange { index: 0, .. })));
        assert!(matches!(
            validate_batch(&p, &[1.0, 0.0], Some(&[1.0, -2.0])),
            Err(MetricError::NegativeWeight { index: 1, .. })
        ));
        assert!(matches!(
            validate_batch(&p, &[1.0, 0.0], Some(&[1.0, f32::NAN])),
            Err(MetricError::NonFinite { what: "weights", index: 1, .. })
        ));
        assert!(validate_batch(&p, &[1.0, 0.25], Some(&[0.0, 3.0])).is_ok());
        assert!(validate_batch(&[], &[], None).is_ok());
    }

    #[test]
    fn error_messages_name_the_problem() {
        let e = validate_batch(&[0.5], &[1.0, 0.0], None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "labels has 2 entries but there are 1 predictions (expected one labels entry per prediction)"
        );
    }
}

/// Checks shared by the modules' tests: a metric restored from a saved state continues exactly
/// like the original.
#[cfg(test)]
pub(crate) mod resume {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use crate::{Metric, MetricError, MetricState, TaskBatch};

    /// One owned batch.
    #[derive(Clone, Debug)]
    pub(crate) struct Owned {
        pub(crate) p: Vec<f32>,
        pub(crate) y: Vec<f32>,
        pub(crate) w: Option<Vec<f32>>,
        pub(crate) g: Vec<i64>,
    }

    impl Owned {
        pub(crate) fn batch(&self) -> TaskBatch<'_> {
            TaskBatch::new(&self.p, &self.y, self.w.as_deref()).with_groups(&self.g)
        }
    }

    /// `count` random batches of 1 to 20 samples: predictions on a coarse grid (so with ties),
    /// mostly hard labels (soft ones when `soft`), weights in half the batches, and grouping
    /// keys spread over the whole `i64` range.
    pub(crate) fn batches(seed: u64, count: usize, soft: bool) -> Vec<Owned> {
        let mut rng = StdRng::seed_from_u64(seed);
        let keys = [i64::MIN, -3, 0, 5, 1 << 40, i64::MAX];
        (0..count)
            .map(|_| {
                let n = rng.random_range(1..=20);
                let p = (0..n).map(|_| rng.random_range(0..=16) as f32 / 16.0).collect();
                let y = (0..n)
                    .map(|_| {
                        if soft && rng.random_bool(0.2) {
                            rng.random_range(0.0..1.0)
                        } else {
                            rng.random_range(0..2) as f32
                        }
                    })
                    .collect();
                let w = rng.random_bool(0.5).then(|| (0..n).map(|_| rng.random_range(0.0..3.0)).collect());
                let g = (0..n).map(|_| keys[rng.random_range(0..keys.len())]).collect();
                Owned { p, y, w, g }
            })
            .collect()
    }

    fn bits(values: &[(String, f64)]) -> Vec<(String, u64)> {
        values.iter().map(|(n, v)| (n.clone(), v.to_bits())).collect()
    }

    /// Feeds `before` to a metric from `make`, saves its state (through JSON, as a checkpoint
    /// would), loads it into a fresh metric, then feeds `after` to both and asserts that every
    /// compute is bit-identical. The fresh metric must differ before the load, so the
    /// comparison can fail.
    pub(crate) fn assert_resumes_exactly(make: &dyn Fn() -> Box<dyn Metric>, before: &[Owned], after: &[Owned]) {
        let mut a = make();
        for b in before {
            a.update_batch(&b.batch()).unwrap();
        }
        let mut resumed = make();
        assert_ne!(bits(&resumed.compute()), bits(&a.compute()), "the test needs a state that shows");
        let state = a.state().expect("built-in metrics save their state");
        let json = serde_json::to_string(&state).unwrap();
        let state: MetricState = serde_json::from_str(&json).unwrap();
        resumed.load_state(&state).unwrap();
        assert_eq!(resumed.state(), a.state());
        assert_eq!(bits(&resumed.compute()), bits(&a.compute()));
        for (step, b) in after.iter().enumerate() {
            a.update_batch(&b.batch()).unwrap();
            resumed.update_batch(&b.batch()).unwrap();
            assert_eq!(bits(&resumed.compute()), bits(&a.compute()), "step {step} after the load");
        }
        assert_eq!(resumed.state(), a.state());
    }

    /// Every damaged variant of `state` (each array removed, lengthened, shortened or with a
    /// NaN) is rejected with [`MetricError::BadState`] by a metric from
    /// `make` loaded with `state`, which then still holds `state`.
    pub(crate) fn assert_rejects_damaged(make: &dyn Fn() -> Box<dyn Metric>, state: &MetricState) {
        let mut m = make();
        m.load_state(state).unwrap();
        let mut damaged = Vec::new();
        for i in 0..state.arrays.len() {
            let name = &state.arrays[i].0;
            let mut s = state.clone();
            s.arrays.remove(i);
            damaged.push((format!("{name} removed"), s));
            let mut s = state.clone();
            s.arrays[i].1.push(0.0);
            damaged.push((format!("{name} lengthened"), s));
            if !state.arrays[i].1.is_empty() {
                let mut s = state.clone();
                s.arrays[i].1.pop();
                damaged.push((format!("{name} shortened"), s));
                let mut s = state.clone();
                s.arrays[i].1[0] = f64::NAN;
                damaged.push((format!("{name} with NaN"), s));
            }
        }
        for (what, s) in damaged {
            match m.load_state(&s) {
                Err(MetricError::BadState { metric, .. }) => assert_eq!(metric, m.output_names().join(","), "{what}"),
                other => panic!("{what}: expected a BadState error, got {other:?}"),
            }
            assert_eq!(m.state().as_ref(), Some(state), "{what}: a failed load changed the metric");
        }
    }
}
