//! Recommendation metrics with TorchRec's definitions (NE, log loss, AUC, grouped AUC, AUPRC,
//! NDCG, session recall and the sum-state family), and next-item HR@K / NDCG@K under full
//! ranking.
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
mod error;
mod full_ranking;
mod kernels;
mod metric;
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
pub use error::MetricError;
pub use full_ranking::{FullRankingMetric, target_ranks};
pub use kernels::NE_ETA;
pub use metric::{Metric, TaskBatch, validate_batch};
pub(crate) use metric::{check_groups, validate_inputs, weight_at};
pub use ne::NeMetric;
pub use rec::{LifetimeMetric, MAX_WINDOW_UPDATES, MultiTaskMetrics, SumMetric, SumMetricKind};
pub use session::{SessionMetric, SessionMetricKind};
pub use state::MetricState;
pub use suite::{MetricReport, MetricSuite, Split, render_table};
pub use throughput::{THROUGHPUT_WARMUP_STEPS, THROUGHPUT_WINDOW_SECONDS, ThroughputMetric};

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
