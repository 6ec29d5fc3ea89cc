//! Metrics that rank within sessions of one batch (TorchRec `ndcg.py`, `recall_session.py`):
//! NDCG@k and session-level recall@k for ranking and retrieval.
//!
//! Each batch carries a session (query, user request) id per sample in
//! [`TaskBatch::groups`]; samples of a session are ranked among themselves. As in TorchRec,
//! sessions are formed per batch (a session split over two batches counts as two) and the
//! state is two sums with lifetime and TorchRec-window values, mergeable across ranks.

use std::cmp::Ordering;

use crate::rec::Window;
use crate::state::{of_kind, with_kind};
use crate::{Metric, MetricError, MetricState, TaskBatch, check_groups, validate_inputs};

/// Which session metric, with TorchRec's options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SessionMetricKind {
    /// NDCG@k (TorchRec `NDCGMetric`). Per session, with samples ranked by prediction
    /// (descending; ties in arrival order) and, for the ideal order, by label:
    ///
    /// ```text
    /// dcg   = Σ_{rank r <= k} gain(label at r) / log2(r + 1)     gain(y) = y, or 2^y - 1
    /// ndcg  = dcg / ideal_dcg            (ideal_dcg = 0 is replaced by 1e-6)
    /// value = Σ_sessions max_weight(s) * (1 - ndcg(s)) / number of sessions
    /// ```
    ///
    /// TorchRec reports `1 - ndcg` (a decreasing curve, like NE) by default; with
    /// `report_as_decreasing = false` it is `ndcg`. `max_weight` is the largest sample weight
    /// of the session (at least 0).
    Ndcg {
        /// Ranks counted (`None`: all, TorchRec's `k = -1`).
        k: Option<usize>,
        /// Gain `2^y - 1` instead of `y`.
        exponential_gain: bool,
        /// Report `1 - ndcg` (TorchRec's default) instead of `ndcg`.
        report_as_decreasing: bool,
        /// Drop sessions of a single sample before computing.
        remove_single_length_sessions: bool,
    },
    /// Session-level recall@k (TorchRec `RecallSessionMetric`): a sample is predicted
    /// positive when fewer than `top_threshold` samples of its session have a strictly higher
    /// prediction; `recall = Σ w y [positive] / Σ w y` (NaN without positives).
    RecallSession {
        /// `k`: the top of each session counted as retrieved.
        top_threshold: usize,
        /// Also turn labels into "in the top `top_threshold` labels of the session".
        run_ranking_of_labels: bool,
    },
}

impl SessionMetricKind {
    /// TorchRec's metric name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Ndcg { .. } => "ndcg",
            Self::RecallSession { .. } => "recall_session_level",
        }
    }

    /// The two sums of one batch, or `None` when the batch adds nothing (no session left).
    fn batch_sums(&self, b: &TaskBatch<'_>, groups: &[i64]) -> Option<[f64; 2]> {
        let n = b.predictions.len();
        let w = |i: usize| b.weights.map_or(1.0, |w| f64::from(w[i]));
        // Samples by session (sessions in id order), arrival order inside each.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| groups[i]);
        let sessions: Vec<&[usize]> = order.chunk_by(|&a, &b| groups[a] == groups[b]).collect();
        match *self {
            Self::Ndcg { k, exponential_gain, report_as_decreasing, remove_single_length_sessions } => {
                let gain = |y: f64| if exponential_gain { y.exp2() - 1.0 } else { y };
                let (mut sum, mut count) = (0.0f64, 0usize);
                for s in sessions.iter().filter(|s| !remove_single_length_sessions || s.len() > 1) {
                    let dcg = |key: &dyn Fn(usize) -> f32| {
                        let mut ranked = s.to_vec();
                        ranked.sort_by(|&a, &b| key(b).partial_cmp(&key(a)).unwrap_or(Ordering::Equal));
                        ranked
                            .iter()
                            .take(k.unwrap_or(usize::MAX))
                            .enumerate()
                            .map(|(r, &i)| gain(f64::from(b.labels[i])) / ((r + 2) as f64).log2())
                            .sum::<f64>()
                    };
                    let observed = dcg(&|i| b.predictions[i]);
                    let ideal = match dcg(&|i| b.labels[i]) {
                        0.0 => 1e-6,
                        v => v,
                    };
                    let ndcg = observed / ideal;
                    let max_weight = s.iter().map(|&i| w(i)).fold(0.0f64, f64::max);
                    sum += max_weight * if report_as_decreasing { 1.0 - ndcg } else { ndcg };
                    count += 1;
                }
                (count > 0).then_some([sum, count as f64])
            }
            Self::RecallSession { top_threshold, run_ranking_of_labels } => {
                let (mut tp, mut fneg) = (0.0f64, 0.0f64);
                for s in &sessions {
                    // Rank = samples of the session strictly above (ties share the best rank).
                    let rank = |i: usize, v: &[f32]| s.iter().filter(|&&j| v[j] > v[i]).count();
                    for &i in s.iter() {
                        let retrieved = rank(i, b.predictions) < top_threshold;
                        let y = if run_ranking_of_labels {
                            if rank(i, b.labels) < top_threshold { 1.0 } else { 0.0 }
                        } else {
                            f64::from(b.labels[i])
                        };
                        if retrieved {
                            tp += w(i) * y;
                        } else {
                            fneg += w(i) * y;
                        }
                    }
                }
                Some([tp, fneg])
            }
        }
    }

    fn finish(&self, s: &[f64]) -> f64 {
        match self {
            Self::Ndcg { .. } => s[0] / s[1],
            Self::RecallSession { .. } => {
                if s[0] + s[1] == 0.0 {
                    f64::NAN
                } else {
                    s[0] / (s[0] + s[1])
                }
            }
        }
    }
}

/// One session metric of one task: lifetime and windowed values, named
/// `lifetime_<name>` / `window_<name>`.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionMetric {
    kind: SessionMetricKind,
    lifetime: [f64; 2],
    window: Window,
    /// Report only the lifetime value, under the plain name.
    plain: bool,
}

impl SessionMetric {
    /// A fresh metric whose window holds `window` samples.
    pub fn new(kind: SessionMetricKind, window: usize) -> Result<Self, MetricError> {
        if window == 0 {
            return Err(MetricError::EmptyWindow);
        }
        if let SessionMetricKind::RecallSession { top_threshold: 0, .. } = kind {
            return Err(MetricError::Option {
                metric: kind.name(),
                message: "top_threshold must be at least 1".into(),
            });
        }
        if let SessionMetricKind::Ndcg { k: Some(0), .. } = kind {
            return Err(MetricError::Option { metric: kind.name(), message: "k must be at least 1".into() });
        }
        Ok(Self { kind, lifetime: [0.0; 2], window: Window::new(window, 2), plain: false })
    }

    /// A metric over a whole split that reports only its lifetime value, under the plain name
    /// (`ndcg`, `recall_session_level`): for evaluations.
    pub fn for_split(kind: SessionMetricKind) -> Result<Self, MetricError> {
        Ok(Self { plain: true, ..Self::new(kind, usize::MAX)? })
    }

    /// Which metric.
    pub fn kind(&self) -> SessionMetricKind {
        self.kind
    }

    /// Adds another rank's state (lifetime and window sums).
    pub fn merge(&mut self, other: &SessionMetric) -> Result<(), MetricError> {
        if other.kind != self.kind {
            return Err(MetricError::Incompatible { ours: self.kind.name(), theirs: other.kind.name() });
        }
        self.lifetime[0] += other.lifetime[0];
        self.lifetime[1] += other.lifetime[1];
        self.window.merge(&other.window);
        Ok(())
    }
}

impl Metric for SessionMetric {
    fn output_names(&self) -> Vec<String> {
        self.compute().into_iter().map(|(n, _)| n).collect()
    }

    fn update(&mut self, _: &[f32], _: &[f32], _: Option<&[f32]>) -> Result<(), MetricError> {
        Err(MetricError::MissingGroups { metric: self.kind.name() })
    }

    fn update_batch(&mut self, b: &TaskBatch<'_>) -> Result<(), MetricError> {
        // NDCG takes relevance grades (any label >= 0); recall needs labels in [0, 1].
        let graded = matches!(self.kind, SessionMetricKind::Ndcg { .. });
        validate_inputs(b.predictions, b.labels, b.weights, graded)?;
        check_groups(self.kind.name(), b)?;
        let groups = b.groups.unwrap_or_default();
        if let Some(sums) = self.kind.batch_sums(b, groups) {
            self.lifetime[0] += sums[0];
            self.lifetime[1] += sums[1];
            self.window.push(sums.to_vec(), b.predictions.len());
        }
        Ok(())
    }

    fn needs_groups(&self) -> bool {
        true
    }

    fn compute(&self) -> Vec<(String, f64)> {
        let n = self.kind.name();
        if self.plain {
            return vec![(n.to_owned(), self.kind.finish(&self.lifetime))];
        }
        vec![
            (format!("lifetime_{n}"), self.kind.finish(&self.lifetime)),
            (format!("window_{n}"), self.kind.finish(self.window.sums())),
        ]
    }

    fn reset(&mut self) {
        self.lifetime = [0.0; 2];
        self.window.clear();
    }

    /// The two lifetime sums `<kind>.lifetime` (`ndcg.lifetime`) and the window: its size
    /// `<kind>.window_max`, running sums `<kind>.window_sums` and queued updates
    /// `<kind>.window_update_sums` / `<kind>.window_update_sizes`.
    fn state(&self) -> Option<MetricState> {
        let mut state = MetricState::default();
        state.push("lifetime", self.lifetime);
        self.window.save(&mut state);
        Some(with_kind(self.kind.name(), state))
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        let load = || {
            let names = [&["lifetime"][..], &Window::STATE_NAMES].concat();
            let state = of_kind(self.kind.name(), state, &names)?;
            state.finite("lifetime")?;
            let lifetime = state.get_len("lifetime", 2)?;
            Ok(([lifetime[0], lifetime[1]], self.window.load(&state)?))
        };
        (self.lifetime, self.window) = load().map_err(|e: MetricError| e.in_metric(&self.output_names().join(",")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ndcg(k: Option<usize>, exponential_gain: bool) -> SessionMetricKind {
        SessionMetricKind::Ndcg {
            k,
            exponential_gain,
            report_as_decreasing: false,
            remove_single_length_sessions: false,
        }
    }

    fn run(kind: SessionMetricKind, p: &[f32], y: &[f32], w: Option<&[f32]>, g: &[i64]) -> f64 {
        let mut m = SessionMetric::new(kind, 1000).unwrap();
        m.update_batch(&TaskBatch { predictions: p, labels: y, weights: w, groups: Some(g) }).unwrap();
        m.compute()[0].1
    }

    #[test]
    fn ndcg_hand_computed() {
        // One session; predicted order: y = 0, 1, 1 (p 0.9, 0.8, 0.7). Ideal order: 1, 1, 0.
        // dcg = 1/log2(3) + 1/log2(4); ideal = 1 + 1/log2(3).
        let (p, y) = ([0.9, 0.8, 0.7], [0.0, 1.0, 1.0]);
        let want = (1.0 / 3f64.log2() + 0.5) / (1.0 + 1.0 / 3f64.log2());
        assert!((run(ndcg(None, false), &p, &y, None, &[4, 4, 4]) - want).abs() < 1e-12);
        // @1: the top prediction is a negative.
        assert_eq!(run(ndcg(Some(1), false), &p, &y, None, &[4, 4, 4]), 0.0);
        // Two sessions: the second ranks perfectly (ndcg 1); mean of the two. Max weights 2, 1.
        let g = [1, 1, 1, 2, 2];
        let (p2, y2, w2) = ([0.9, 0.8, 0.7, 0.2, 0.1], [0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 2.0, 0.5, 1.0, 1.0]);
        let got = run(ndcg(None, false), &p2, &y2, Some(&w2), &g);
        assert!((got - (2.0 * want + 1.0) / 2.0).abs() < 1e-12, "{got}");
        // TorchRec's default reports 1 - ndcg.
        let dec = SessionMetricKind::Ndcg {
            k: None,
            exponential_gain: false,
            report_as_decreasing: true,
            remove_single_length_sessions: false,
        };
        assert!((run(dec, &p, &y, None, &[4, 4, 4]) - (1.0 - want)).abs() < 1e-12);
        // Exponential gain with a graded label 2: gains 3 and 1.
        let (p3, y3) = ([0.9, 0.8], [1.0, 2.0]);
        let want3 = (1.0 + 3.0 / 3f64.log2()) / (3.0 + 1.0 / 3f64.log2());
        assert!((run(ndcg(None, true), &p3, &y3, None, &[0, 0]) - want3).abs() < 1e-12);
    }

    #[test]
    fn recall_session_hand_computed() {
        let kind = SessionMetricKind::RecallSession { top_threshold: 1, run_ranking_of_labels: false };
        // Session 1: top is a positive (retrieved), another positive below (missed).
        // Session 2: top is negative, its positive is missed. Recall = 1 / 3.
        let (p, y, g) = ([0.9, 0.5, 0.1, 0.8, 0.3], [1.0, 0.0, 1.0, 0.0, 1.0], [1, 1, 1, 2, 2]);
        assert!((run(kind, &p, &y, None, &g) - 1.0 / 3.0).abs() < 1e-15);
        // Ties share the best rank: both tied positives count as retrieved at k = 1.
        assert_eq!(run(kind, &[0.5, 0.5], &[1.0, 1.0], None, &[0, 0]), 1.0);
        // No positives: NaN, as in TorchRec.
        assert!(run(kind, &[0.5], &[0.0], None, &[0]).is_nan());
    }

    #[test]
    fn missing_groups_and_bad_options_are_errors() {
        let kind = SessionMetricKind::RecallSession { top_threshold: 2, run_ranking_of_labels: false };
        let mut m = SessionMetric::new(kind, 10).unwrap();
        assert!(matches!(m.update(&[0.5], &[1.0], None), Err(MetricError::MissingGroups { .. })));
        let b = TaskBatch { predictions: &[0.5, 0.2], labels: &[1.0, 0.0], weights: None, groups: Some(&[1]) };
        assert!(matches!(m.update_batch(&b), Err(MetricError::GroupLength { len: 1, predictions: 2, .. })));
        let bad = SessionMetricKind::RecallSession { top_threshold: 0, run_ranking_of_labels: false };
        assert!(SessionMetric::new(bad, 10).unwrap_err().to_string().contains("top_threshold"));
    }

    #[test]
    fn resumes_exactly_from_a_saved_state() {
        use crate::resume::{assert_rejects_damaged, assert_resumes_exactly, batches};
        let data = batches(13, 30, true);
        let kinds = [
            SessionMetricKind::Ndcg {
                k: Some(3),
                exponential_gain: true,
                report_as_decreasing: true,
                remove_single_length_sessions: true,
            },
            ndcg(None, false),
            SessionMetricKind::RecallSession { top_threshold: 2, run_ranking_of_labels: false },
            SessionMetricKind::RecallSession { top_threshold: 1, run_ranking_of_labels: true },
        ];
        for kind in kinds {
            let makers: [&dyn Fn() -> Box<dyn Metric>; 2] =
                [&|| Box::new(SessionMetric::new(kind, 45).unwrap()), &|| {
                    Box::new(SessionMetric::for_split(kind).unwrap())
                }];
            for make in makers {
                assert_resumes_exactly(make, &data[..7], &data[7..]);
                let mut m = make();
                for b in &data[..7] {
                    m.update_batch(&b.batch()).unwrap();
                }
                assert_rejects_damaged(make, &m.state().unwrap());
            }
        }
        let mut windowed = SessionMetric::new(kinds[0], 45).unwrap();
        windowed.update_batch(&data[0].batch()).unwrap();
        assert!(SessionMetric::for_split(kinds[0]).unwrap().load_state(&windowed.state().unwrap()).is_err());
        let e = SessionMetric::new(kinds[2], 45).unwrap().load_state(&windowed.state().unwrap()).unwrap_err();
        assert!(e.to_string().contains(r#"unexpected array "ndcg.lifetime""#), "{e}");
    }
}
