//! Normalized entropy and log loss (TorchRec `torchrec/metrics/ne.py`).

use crate::kernels::NE_ETA;
use crate::state::{of_kind, with_kind};
use crate::{Metric, MetricError, MetricState, validate_batch};

/// NE from the four sums (cross entropy, weight, positive and negative weight).
pub(crate) fn ne_from_sums(ce: f64, weighted: f64, pos: f64, neg: f64) -> f64 {
    let mean_label = (pos / weighted.max(NE_ETA)).clamp(NE_ETA, 1.0 - NE_ETA);
    ce / (-pos * mean_label.log2() - neg * (1.0 - mean_label).log2())
}

/// TorchRec's log loss from the cross-entropy and label sums.
pub(crate) fn logloss_from_sums(ce: f64, pos: f64, neg: f64) -> f64 {
    ce / (pos + neg).max(NE_ETA)
}

/// Normalized entropy, optionally with log loss, exactly as TorchRec defines them.
///
/// Per sample, with the prediction clamped to `p = clamp(prediction, eta, 1 - eta)`,
/// `eta = 1e-12` (the clamp happens in `f64`), label `y` and weight `w`:
///
/// ```text
/// ce = -w * y * log2(p) - w * (1 - y) * log2(1 - p)
/// ```
///
/// The state is four running `f64` sums over every batch since the last reset:
/// `ce_sum`, `weighted_num_samples = Σ w`, `pos = Σ w * y` and `neg = Σ w * (1 - y)`.
/// From them:
///
/// ```text
/// mean_label = clamp(pos / max(weighted_num_samples, eta), eta, 1 - eta)
/// ne         = ce_sum / (-pos * log2(mean_label) - neg * log2(1 - mean_label))
/// logloss    = ce_sum / max(pos + neg, eta)
/// ```
///
/// Both use **base-2** logarithms, as TorchRec does: TorchRec's `logloss` is the mean cross
/// entropy in bits, i.e. the natural-log log loss (scikit-learn's) divided by `ln 2`.
/// NE is unit-free, so the base does not matter for it. NE is 1.0 for a model that always
/// predicts the (weighted) base rate and approaches 0 for perfect predictions.
///
/// Before any sample has been seen both values are NaN (0 / 0), as in TorchRec. When every
/// label is of one class the denominator is tiny and NE huge, also as in TorchRec.
///
/// Only the lifetime value (since the last reset) is reported; TorchRec's additional
/// windowed NE is not implemented.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NeMetric {
    include_logloss: bool,
    ce_sum: f64,
    weighted_num_samples: f64,
    pos: f64,
    neg: f64,
}

impl NeMetric {
    /// A fresh NE metric; with `include_logloss` it also reports `logloss`.
    pub fn new(include_logloss: bool) -> Self {
        Self { include_logloss, ..Self::default() }
    }

    /// Whether `logloss` is reported next to `ne`.
    pub fn include_logloss(&self) -> bool {
        self.include_logloss
    }

    /// The normalized entropy of everything accumulated so far.
    pub fn ne(&self) -> f64 {
        ne_from_sums(self.ce_sum, self.weighted_num_samples, self.pos, self.neg)
    }

    /// TorchRec's log loss (mean base-2 cross entropy) of everything accumulated so far.
    pub fn logloss(&self) -> f64 {
        logloss_from_sums(self.ce_sum, self.pos, self.neg)
    }

    /// The weighted cross-entropy sum (bits) accumulated so far.
    pub fn cross_entropy_sum(&self) -> f64 {
        self.ce_sum
    }

    /// The sum of sample weights accumulated so far.
    pub fn weighted_num_samples(&self) -> f64 {
        self.weighted_num_samples
    }
}

impl Metric for NeMetric {
    fn output_names(&self) -> Vec<String> {
        let mut names = vec!["ne".to_owned()];
        if self.include_logloss {
            names.push("logloss".to_owned());
        }
        names
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        validate_batch(predictions, labels, weights)?;
        let [ce, wsum, pos, neg] =
            crate::kernels::ne_sums(predictions, labels, weights, crate::kernels::all_hard(labels));
        self.ce_sum += ce;
        self.weighted_num_samples += wsum;
        self.pos += pos;
        self.neg += neg;
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        let mut out = vec![("ne".to_owned(), self.ne())];
        if self.include_logloss {
            out.push(("logloss".to_owned(), self.logloss()));
        }
        out
    }

    fn reset(&mut self) {
        *self = Self::new(self.include_logloss);
    }

    /// The four sums as the array `ne.sums`: cross entropy, weight, positive and negative
    /// weight.
    fn state(&self) -> Option<MetricState> {
        let mut state = MetricState::default();
        state.push("sums", [self.ce_sum, self.weighted_num_samples, self.pos, self.neg]);
        Some(with_kind("ne", state))
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        let load = || {
            let state = of_kind("ne", state, &["sums"])?;
            state.finite("sums")?;
            Ok(state.get_len("sums", 4)?.to_vec())
        };
        let s = load().map_err(|e: MetricError| e.in_metric(&self.output_names().join(",")))?;
        (self.ce_sum, self.weighted_num_samples, self.pos, self.neg) = (s[0], s[1], s[2], s[3]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1.0)
    }

    // Dyadic predictions are exact in f32, so the hand values below are exact references.
    const P: [f32; 4] = [0.875, 0.25, 0.625, 0.375];
    const Y: [f32; 4] = [1.0, 0.0, 0.0, 1.0];

    #[test]
    fn hand_computed_unweighted() {
        // ce = -log2(.875) - log2(.75) - log2(.375) - log2(.375) = 3.4377575757789276 bits;
        // pos = neg = 2, mean label 0.5, so the denominator is 4 bits.
        let mut m = NeMetric::new(true);
        m.update(&P, &Y, None).unwrap();
        let out = m.compute();
        assert_eq!(out[0].0, "ne");
        assert_eq!(out[1].0, "logloss");
        assert!(close(m.cross_entropy_sum(), 3.4377575757789276, 1e-14));
        assert!(close(out[0].1, 0.8594393939447319, 1e-14));
        assert!(close(out[1].1, 0.8594393939447319, 1e-14));
    }

    #[test]
    fn hand_computed_weighted() {
        // w = [1, 2, 0.5, 3]: ce = 5.975351323976037, pos = 4, neg = 2.5,
        // mean label 4/6.5, denominator 6.248037930698693.
        let w = [1.0, 2.0, 0.5, 3.0];
        let mut m = NeMetric::new(true);
        m.update(&P, &Y, Some(&w)).unwrap();
        assert!(close(m.ne(), 0.9563564418546731, 1e-14));
        assert!(close(m.logloss(), 0.9192848190732364, 1e-14));
        assert_eq!(m.weighted_num_samples(), 6.5);
    }

    #[test]
    fn logloss_is_base_two() {
        // A single positive predicted at 0.5 costs exactly one bit.
        let mut m = NeMetric::new(true);
        m.update(&[0.5], &[1.0], None).unwrap();
        assert_eq!(m.logloss(), 1.0);
    }

    #[test]
    fn integer_weight_equals_repeated_samples() {
        let mut weighted = NeMetric::new(true);
        weighted.update(&[0.3, 0.8], &[0.0, 1.0], Some(&[3.0, 2.0])).unwrap();
        let mut repeated = NeMetric::new(true);
        repeated.update(&[0.3, 0.3, 0.3, 0.8, 0.8], &[0.0, 0.0, 0.0, 1.0, 1.0], None).unwrap();
        assert!(close(weighted.ne(), repeated.ne(), 1e-13));
        assert!(close(weighted.logloss(), repeated.logloss(), 1e-13));
    }

    #[test]
    fn predicting_the_base_rate_gives_one() {
        // 3 positives out of 8; 0.375 is exact in f32.
        let labels = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0];
        let preds = [0.375f32; 8];
        let mut m = NeMetric::new(false);
        m.update(&preds, &labels, None).unwrap();
        assert!(close(m.ne(), 1.0, 1e-14), "ne = {}", m.ne());
        assert_eq!(m.compute().len(), 1);

        // Weighted base rate: pos = 1 * 1 + 3 * 1 = 4 of 8, so predict 0.5.
        let mut m = NeMetric::new(false);
        m.update(&[0.5; 3], &[1.0, 0.0, 1.0], Some(&[1.0, 4.0, 3.0])).unwrap();
        assert!(close(m.ne(), 1.0, 1e-14));
    }

    #[test]
    fn perfect_predictions_give_near_zero() {
        let labels = [1.0, 0.0, 0.0, 1.0];
        let mut m = NeMetric::new(true);
        m.update(&labels, &labels, None).unwrap();
        // Each sample costs -log2(1 - 1e-12) ~ 1.44e-12 bits after the clamp.
        assert!(m.ne() > 0.0 && m.ne() < 1e-11, "ne = {}", m.ne());
        assert!(close(m.logloss(), -(1.0 - NE_ETA).log2(), 1e-6));
    }

    #[test]
    fn batches_accumulate_like_one_batch() {
        let w = [1.0, 2.0, 0.5, 3.0];
        let mut whole = NeMetric::new(true);
        whole.update(&P, &Y, Some(&w)).unwrap();
        let mut split = NeMetric::new(true);
        split.update(&P[..1], &Y[..1], Some(&w[..1])).unwrap();
        split.update(&P[1..], &Y[1..], Some(&w[1..])).unwrap();
        assert!(close(whole.ne(), split.ne(), 1e-14));
        assert!(close(whole.logloss(), split.logloss(), 1e-14));
    }

    #[test]
    fn reset_and_empty_state() {
        let mut m = NeMetric::new(true);
        assert!(m.ne().is_nan());
        m.update(&P, &Y, None).unwrap();
        m.reset();
        assert!(m.include_logloss());
        assert!(m.ne().is_nan());
        assert_eq!(m.logloss(), 0.0);
        assert_eq!(m, NeMetric::new(true));
    }

    #[test]
    fn rejected_batch_leaves_state_unchanged() {
        let mut m = NeMetric::new(true);
        m.update(&P, &Y, None).unwrap();
        let before = m.clone();
        assert!(m.update(&[0.5, f32::NAN], &[1.0, 0.0], None).is_err());
        assert!(m.update(&[0.5], &[1.0, 0.0], None).is_err());
        assert_eq!(m, before);
    }

    #[test]
    fn out_of_range_predictions_are_clamped() {
        let mut clamped = NeMetric::new(true);
        clamped.update(&[1.5, -0.5], &[1.0, 0.0], None).unwrap();
        let mut exact = NeMetric::new(true);
        exact.update(&[1.0, 0.0], &[1.0, 0.0], None).unwrap();
        assert_eq!(clamped.ne(), exact.ne());
    }

    #[test]
    fn resumes_exactly_from_a_saved_state() {
        use crate::resume::{assert_rejects_damaged, assert_resumes_exactly, batches};
        let data = batches(9, 20, true);
        for logloss in [false, true] {
            let make = || -> Box<dyn Metric> { Box::new(NeMetric::new(logloss)) };
            assert_resumes_exactly(&make, &data[..5], &data[5..]);
            let mut m = NeMetric::new(logloss);
            m.update(&P, &Y, None).unwrap();
            assert_rejects_damaged(&make, &m.state().unwrap());
            let mut back = NeMetric::new(logloss);
            back.load_state(&m.state().unwrap()).unwrap();
            assert_eq!(back, m);
        }
    }
}
