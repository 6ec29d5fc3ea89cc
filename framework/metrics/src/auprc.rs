//! Area under the precision-recall curve (TorchRec `torchrec/metrics/auprc.py`).

use crate::state::{limit_array, of_kind, with_kind};
use crate::window::SampleWindow;
use crate::{Metric, MetricError, MetricState, validate_batch, weight_at};

/// TorchRec's default number of lifetime histogram bins over `[0, 1]`.
pub const AUPRC_BINS: usize = 1000;

/// AUPRC as TorchRec computes it, windowed and lifetime.
///
/// **Window** (exact, over the latest `window` samples): predictions sorted descending; at the
/// last sample of every distinct prediction, `precision = tp / (tp + fp)` and
/// `recall = tp / tp_total` (weighted cumulative counts); with the point (recall 0,
/// precision 1) appended, the area is the left Riemann sum `Σ (r[k] - r[k+1]) p[k]` from the
/// highest threshold down (NaN precision → 1, NaN recall → 0).
///
/// **Lifetime** (binned, TorchRec's histogram state): each sample's weight goes into one of
/// 1,000 equal bins of `[0, 1]` (index `floor(p * 1000)` in fp32, clamped), positives and
/// negatives apart; the same Riemann sum over the bin thresholds, and 0.5 when either class
/// is absent. A prediction outside `[0, 1]` makes the lifetime value NaN, as in TorchRec.
#[derive(Clone, Debug, PartialEq)]
pub struct AuprcMetric {
    window: usize,
    samples: SampleWindow,
    positive: Vec<f64>,
    negative: Vec<f64>,
    invalid: bool,
}

impl AuprcMetric {
    /// An AUPRC metric whose window holds `window` samples.
    pub fn new(window: usize) -> Result<Self, MetricError> {
        if window == 0 {
            return Err(MetricError::EmptyWindow);
        }
        Ok(Self {
            window,
            samples: SampleWindow::new(false),
            positive: vec![0.0; AUPRC_BINS],
            negative: vec![0.0; AUPRC_BINS],
            invalid: false,
        })
    }

    /// Adds another rank's state: its window samples after this rank's (gather) and its
    /// lifetime bins (sum), as TorchRec reduces AUPRC.
    pub fn merge(&mut self, other: &AuprcMetric) -> Result<(), MetricError> {
        self.samples.append(&other.samples);
        self.positive.iter_mut().zip(&other.positive).for_each(|(a, b)| *a += b);
        self.negative.iter_mut().zip(&other.negative).for_each(|(a, b)| *a += b);
        self.invalid |= other.invalid;
        Ok(())
    }

    /// The state: the window size `auprc.window` (empty when unbounded), the window's samples,
    /// the lifetime bins `auprc.positive` and `auprc.negative` and the flag `auprc.invalid`.
    fn save(&self) -> MetricState {
        let mut state = MetricState::default();
        state.push("window", limit_array(self.window));
        self.samples.save(&mut state);
        state.push("positive", self.positive.iter().copied());
        state.push("negative", self.negative.iter().copied());
        state.push("invalid", [if self.invalid { 1.0 } else { 0.0 }]);
        with_kind("auprc", state)
    }

    /// Restores what [`AuprcMetric::save`] wrote, after checking all of it.
    fn load(&mut self, state: &MetricState) -> Result<(), MetricError> {
        let names = [&["window"][..], SampleWindow::state_names(false), &["positive", "negative", "invalid"]].concat();
        let state = of_kind("auprc", state, &names)?;
        state.expect_array("window", &limit_array(self.window))?;
        let samples = SampleWindow::load(&state, false, Some(self.window))?;
        let bins = |name: &str| -> Result<Vec<f64>, MetricError> {
            state.get_len(name, AUPRC_BINS)?;
            let values = state.finite(name)?;
            if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| **v < 0.0) {
                return Err(MetricError::bad_state(format!("{name}[{i}] = {v} is a negative weight sum")));
            }
            Ok(values.to_vec())
        };
        let (positive, negative) = (bins("positive")?, bins("negative")?);
        let invalid = state.flag("invalid")?;
        *self = Self { window: self.window, samples, positive, negative, invalid };
        Ok(())
    }

    /// Exact AUPRC of the samples in the window.
    pub fn window_auprc(&self) -> f64 {
        let (mut tp, mut fp) = (0.0f64, 0.0f64);
        let mut points = Vec::new();
        let mut last_key = None;
        self.samples.sweep(false, |v| {
            // A point at the last sample of each distinct prediction: close the previous one.
            if last_key.is_some_and(|k| k != v.key) {
                points.push((tp, fp));
            }
            last_key = Some(v.key);
            let (w, y) = (f64::from(v.weight), f64::from(v.label));
            tp += w * y;
            fp += w * (1.0 - y);
        });
        if last_key.is_some() {
            points.push((tp, fp));
        }
        riemann(&points, tp)
    }

    /// Binned lifetime AUPRC.
    pub fn lifetime_auprc(&self) -> f64 {
        if self.invalid {
            return f64::NAN;
        }
        let (total_pos, total_neg): (f64, f64) = (self.positive.iter().sum(), self.negative.iter().sum());
        if total_pos == 0.0 || total_neg == 0.0 {
            return 0.5;
        }
        // Thresholds from the highest bin down, as the cumulative counts are taken.
        let (mut tp, mut fp) = (0.0, 0.0);
        let points: Vec<(f64, f64)> = (0..AUPRC_BINS)
            .rev()
            .map(|b| {
                tp += self.positive[b];
                fp += self.negative[b];
                (tp, fp)
            })
            .collect();
        riemann(&points, tp)
    }
}

/// `Σ (r[k] - r[k+1]) p[k]` over points ordered from the highest threshold down, ending with
/// (recall 0, precision 1) below the highest threshold.
fn riemann(points: &[(f64, f64)], tp_total: f64) -> f64 {
    let pr = |&(tp, fp): &(f64, f64)| {
        let p = tp / (tp + fp);
        let r = tp / tp_total;
        (if p.is_nan() { 1.0 } else { p }, if r.is_nan() { 0.0 } else { r })
    };
    let mut area = 0.0;
    let mut prev_recall = 0.0; // the appended point
    for pt in points {
        let (p, r) = pr(pt);
        area += (r - prev_recall) * p;
        prev_recall = r;
    }
    area
}

impl Metric for AuprcMetric {
    fn output_names(&self) -> Vec<String> {
        vec!["lifetime_auprc".into(), "window_auprc".into()]
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        validate_batch(predictions, labels, weights)?;
        if predictions.iter().any(|p| !(0.0..=1.0).contains(p)) {
            self.invalid = true;
        }
        for (i, (&p, &y)) in predictions.iter().zip(labels).enumerate() {
            let w = weight_at(weights, i);
            // fp32 as TorchRec: ((p - 0) / (1 - 0) * bins).long(), clamped.
            let bin = ((p * AUPRC_BINS as f32) as i64).clamp(0, AUPRC_BINS as i64 - 1) as usize;
            self.positive[bin] += w * f64::from(y);
            self.negative[bin] += w * (1.0 - f64::from(y));
        }
        self.samples.push(Some(self.window), predictions, labels, weights, None);
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        vec![("lifetime_auprc".into(), self.lifetime_auprc()), ("window_auprc".into(), self.window_auprc())]
    }

    fn reset(&mut self) {
        self.samples.clear();
        self.positive.iter_mut().for_each(|x| *x = 0.0);
        self.negative.iter_mut().for_each(|x| *x = 0.0);
        self.invalid = false;
    }

    /// The window size `auprc.window`, the window's samples (see [`MetricState`]), the lifetime
    /// bins `auprc.positive` and `auprc.negative` ([`AUPRC_BINS`] each) and the flag
    /// `auprc.invalid`.
    fn state(&self) -> Option<MetricState> {
        Some(self.save())
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        self.load(state).map_err(|e| e.in_metric(&self.output_names().join(",")))
    }
}

/// Exact AUPRC over every sample (no window, no bins), reported as `auprc`: for evaluations,
/// which cover a whole split.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitAuprc(AuprcMetric);

impl Default for SplitAuprc {
    fn default() -> Self {
        Self::new()
    }
}

impl SplitAuprc {
    /// A fresh metric.
    pub fn new() -> Self {
        Self(AuprcMetric {
            window: usize::MAX,
            samples: SampleWindow::new(false),
            positive: vec![0.0; AUPRC_BINS],
            negative: vec![0.0; AUPRC_BINS],
            invalid: false,
        })
    }
}

impl Metric for SplitAuprc {
    fn output_names(&self) -> Vec<String> {
        vec!["auprc".into()]
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        self.0.update(predictions, labels, weights)
    }

    fn compute(&self) -> Vec<(String, f64)> {
        vec![("auprc".into(), self.0.window_auprc())]
    }

    fn reset(&mut self) {
        self.0.reset();
    }

    /// Every sample since the last reset (see [`MetricState`]), and the unused bins: the arrays
    /// of [`AuprcMetric`], with an empty (unbounded) `auprc.window`.
    fn state(&self) -> Option<MetricState> {
        Some(self.0.save())
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        self.0.load(state).map_err(|e| e.in_metric(&self.output_names().join(",")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_auprc() {
        // Descending: 0.9 (pos), 0.8 (neg), 0.7 (pos). Points: (tp 1, fp 0) p=1 r=.5;
        // (1, 1) p=.5 r=.5; (2, 1) p=2/3 r=1. Area = .5*1 + 0*.5 + .5*(2/3).
        let mut m = SplitAuprc::new();
        m.update(&[0.7, 0.9, 0.8], &[1.0, 1.0, 0.0], None).unwrap();
        let want = 0.5 + 0.5 * 2.0 / 3.0;
        assert!((m.compute()[0].1 - want).abs() < 1e-12);
        // Perfect ranking: 1.
        let mut m = SplitAuprc::new();
        m.update(&[0.9, 0.1], &[1.0, 0.0], None).unwrap();
        assert_eq!(m.compute()[0].1, 1.0);
        // Out-of-range predictions poison the binned lifetime value only.
        let mut m = AuprcMetric::new(10).unwrap();
        m.update(&[1.5, 0.1], &[1.0, 0.0], None).unwrap();
        assert!(m.lifetime_auprc().is_nan());
        assert_eq!(m.window_auprc(), 1.0);
        m.reset();
        assert_eq!(m.lifetime_auprc(), 0.5, "no signal after a reset");
        assert!(AuprcMetric::new(0).is_err());
    }

    #[test]
    fn resumes_exactly_from_a_saved_state() {
        use crate::resume::{assert_rejects_damaged, assert_resumes_exactly, batches};
        let mut data = batches(5, 30, true);
        // An out-of-range prediction before the save: the lifetime value is NaN on both sides.
        let mut poisoned = data.clone();
        poisoned[3].p[0] = 1.5;
        type Build<'a> = &'a dyn Fn() -> Box<dyn Metric>;
        let configs: [(Build<'_>, &[crate::resume::Owned]); 3] = [
            (&|| Box::new(AuprcMetric::new(41).unwrap()), &data),
            (&|| Box::new(AuprcMetric::new(41).unwrap()), &poisoned),
            (&|| Box::new(SplitAuprc::new()), &data),
        ];
        for (make, data) in configs {
            assert_resumes_exactly(make, &data[..9], &data[9..]);
            let mut m = make();
            for b in &data[..9] {
                m.update(&b.p, &b.y, b.w.as_deref()).unwrap();
            }
            assert_rejects_damaged(make, &m.state().unwrap());
        }
        // The window size must match; a split metric's unbounded window is not a 41-sample one.
        data.truncate(3);
        let mut m = AuprcMetric::new(41).unwrap();
        m.update(&data[0].p, &data[0].y, None).unwrap();
        let e = AuprcMetric::new(40).unwrap().load_state(&m.state().unwrap()).unwrap_err().to_string();
        assert!(e.contains("auprc.window") || e.contains("window = [41.0]"), "{e}");
        assert!(SplitAuprc::new().load_state(&m.state().unwrap()).is_err());
        // Negative bins cannot come from weights >= 0.
        let mut state = m.state().unwrap();
        state.arrays.iter_mut().find(|(n, _)| n == "auprc.negative").unwrap().1[7] = -1.0;
        let e = AuprcMetric::new(41).unwrap().load_state(&state).unwrap_err().to_string();
        assert!(e.contains("negative[7] = -1 is a negative weight sum"), "{e}");
    }
}
