//! What can go wrong when feeding, reporting or restoring a metric.

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
    /// implement `Metric::state` and `Metric::load_state`).
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
