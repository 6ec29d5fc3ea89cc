//! Normalized entropy and log loss, as `torchrec/metrics/ne.py` defines them.

use crate::{Metric, MetricError, validate_batch, weight_at};

/// Predictions and the base rate are clamped to `[eta, 1 - eta]` before taking logs (TorchRec's `eta`).
pub const NE_ETA: f64 = 1e-12;

/// Normalized entropy (and optionally log loss).
///
/// With `p` clamped to `[eta, 1-eta]`, `ce = -w (y log2 p + (1-y) log2(1-p))` summed over
/// samples; `pos = Σ w y`, `neg = Σ w (1-y)`, `m = clamp(pos / Σ w)`:
/// `ne = Σ ce / (-(pos log2 m + neg log2(1-m)))`. Log loss is TorchRec's
/// `Σ ce / max(pos + neg, eta)` — note the **base-2** logarithm (bits per example).
#[derive(Clone, Debug, Default)]
pub struct NeMetric {
    include_logloss: bool,
    ce_sum: f64,
    weighted_num_samples: f64,
    pos: f64,
    neg: f64,
}

impl NeMetric {
    /// A new NE metric; `include_logloss` also reports `logloss`.
    pub fn new(include_logloss: bool) -> Self {
        Self { include_logloss, ..Self::default() }
    }

    /// NE over the accumulated state (NaN before any sample).
    pub fn ne(&self) -> f64 {
        let m = (self.pos / self.weighted_num_samples).clamp(NE_ETA, 1.0 - NE_ETA);
        let norm = -self.pos * m.log2() - self.neg * (1.0 - m).log2();
        self.ce_sum / norm
    }

    /// Log loss (base 2) over the accumulated state.
    pub fn logloss(&self) -> f64 {
        self.ce_sum / (self.pos + self.neg).max(NE_ETA)
    }
}

impl Metric for NeMetric {
    fn output_names(&self) -> Vec<String> {
        let mut v = vec!["ne".to_string()];
        if self.include_logloss {
            v.push("logloss".into());
        }
        v
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        validate_batch(predictions, labels, weights)?;
        for (i, (&p, &y)) in predictions.iter().zip(labels).enumerate() {
            let w = weight_at(weights, i);
            let (p, y) = ((p as f64).clamp(NE_ETA, 1.0 - NE_ETA), y as f64);
            self.ce_sum += -w * y * p.log2() - w * (1.0 - y) * (1.0 - p).log2();
            self.weighted_num_samples += w;
            self.pos += w * y;
            self.neg += w * (1.0 - y);
        }
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        let mut v = vec![("ne".to_string(), self.ne())];
        if self.include_logloss {
            v.push(("logloss".into(), self.logloss()));
        }
        v
    }

    fn reset(&mut self) {
        *self = Self::new(self.include_logloss);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_ne_and_logloss() {
        let mut m = NeMetric::new(true);
        m.update(&[0.8, 0.4, 0.1, 0.6], &[1.0, 0.0, 0.0, 1.0], None).unwrap();
        let ce = -(0.8f64.log2() + 0.6f64.log2() + 0.9f64.log2() + 0.6f64.log2());
        let norm = -(2.0 * 0.5f64.log2() + 2.0 * 0.5f64.log2()); // base rate 0.5: 4 bits
        let r = m.compute();
        assert!((r[0].1 - ce / norm).abs() < 1e-6);
        assert!((r[1].1 - ce / 4.0).abs() < 1e-6);
    }

    #[test]
    fn predicting_the_base_rate_is_one_and_perfect_is_near_zero() {
        let labels = [1.0, 0.0, 0.0, 0.0];
        let mut base = NeMetric::new(false);
        base.update(&[0.25; 4], &labels, None).unwrap();
        assert!((base.ne() - 1.0).abs() < 1e-6);
        let mut perfect = NeMetric::new(false);
        perfect.update(&[1.0, 0.0, 0.0, 0.0], &labels, None).unwrap();
        assert!(perfect.ne() < 1e-9);
    }

    #[test]
    fn weights_count_like_repeats_and_state_survives_rejects() {
        let mut w = NeMetric::new(true);
        w.update(&[0.7, 0.2], &[1.0, 0.0], Some(&[2.0, 1.0])).unwrap();
        let mut rep = NeMetric::new(true);
        rep.update(&[0.7, 0.7, 0.2], &[1.0, 1.0, 0.0], None).unwrap();
        assert!((w.ne() - rep.ne()).abs() < 1e-12 && (w.logloss() - rep.logloss()).abs() < 1e-12);
        let before = w.ne();
        assert!(w.update(&[0.5], &[2.0], None).is_err());
        assert_eq!(w.ne(), before);
        w.reset();
        assert!(w.ne().is_nan());
    }
}
