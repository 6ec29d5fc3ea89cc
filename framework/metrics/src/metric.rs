//! The metric contract: a [`Metric`] accumulates [`TaskBatch`]es and reports on demand;
//! the input checks every metric runs.

use crate::MetricError;
use crate::MetricState;

/// One batch of one task.
#[derive(Clone, Copy, Debug)]
pub struct TaskBatch<'a> {
    /// Predicted probabilities (or regression outputs).
    pub predictions: &'a [f32],
    /// Labels.
    pub labels: &'a [f32],
    /// Sample weights (`None`: all 1).
    pub weights: Option<&'a [f32]>,
    /// A grouping key per sample (user, query or session id), for the metrics that rank
    /// within groups; `None` for the others.
    pub groups: Option<&'a [i64]>,
}

impl<'a> TaskBatch<'a> {
    /// A batch without grouping keys.
    pub fn new(predictions: &'a [f32], labels: &'a [f32], weights: Option<&'a [f32]>) -> Self {
        Self { predictions, labels, weights, groups: None }
    }

    /// The same batch with grouping keys.
    pub fn with_groups(self, groups: &'a [i64]) -> Self {
        Self { groups: Some(groups), ..self }
    }
}

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
    if !graded && crate::kernels::batch_is_clean(predictions, labels, weights) {
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
pub(crate) fn weight_at(weights: Option<&[f32]>, i: usize) -> f64 {
    weights.map_or(1.0, |w| f64::from(w[i]))
}
