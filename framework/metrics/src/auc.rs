//! Area under the ROC curve, as `torchrec/metrics/auc.py` computes it.

use crate::{Metric, MetricError, validate_batch};

/// AUC over every prediction accumulated since the last reset.
///
/// Predictions are sorted descending (a stable sort: tied predictions keep their arrival
/// order, which, as in TorchRec, makes ties count in that order rather than as one half);
/// weighted cumulative true and false positives are integrated with the trapezoid rule and
/// normalised by the totals. With no positives or no negatives the AUC is 0.5.
#[derive(Clone, Debug, Default)]
pub struct AucMetric {
    predictions: Vec<f32>,
    labels: Vec<f32>,
    weights: Vec<f32>,
}

impl AucMetric {
    /// A new, empty AUC metric.
    pub fn new() -> Self {
        Self::default()
    }

    /// The AUC of the accumulated predictions.
    pub fn auc(&self) -> f64 {
        auc(&self.predictions, &self.labels, &self.weights)
    }
}

/// TorchRec's AUC of one set of predictions (O(n log n)).
pub fn auc(predictions: &[f32], labels: &[f32], weights: &[f32]) -> f64 {
    let mut order: Vec<usize> = (0..predictions.len()).collect();
    order.sort_by(|&a, &b| predictions[b].total_cmp(&predictions[a]));
    let (mut tp, mut fp, mut area) = (0.0f64, 0.0f64, 0.0f64);
    let (mut prev_tp, mut prev_fp) = (None::<f64>, 0.0f64);
    for &i in &order {
        let (w, y) = (weights[i] as f64, labels[i] as f64);
        tp += w * y;
        fp += w * (1.0 - y);
        // trapz over the points (cum_fp, cum_tp), starting from the first sample's point.
        if let Some(ptp) = prev_tp {
            area += (fp - prev_fp) * (tp + ptp) / 2.0;
        }
        prev_tp = Some(tp);
        prev_fp = fp;
    }
    if tp > 0.0 && fp > 0.0 { area / (tp * fp) } else { 0.5 }
}

impl Metric for AucMetric {
    fn output_names(&self) -> Vec<String> {
        vec!["auc".into()]
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        validate_batch(predictions, labels, weights)?;
        self.predictions.extend_from_slice(predictions);
        self.labels.extend_from_slice(labels);
        match weights {
            Some(w) => self.weights.extend_from_slice(w),
            None => self.weights.extend(std::iter::repeat_n(1.0, predictions.len())),
        }
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        vec![("auc".into(), self.auc())]
    }

    fn reset(&mut self) {
        *self = Self::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Float64 brute force: the fraction of (positive, negative) pairs ordered correctly.
    fn pairwise(p: &[f32], y: &[f32]) -> f64 {
        let (mut good, mut pairs) = (0.0, 0.0);
        for i in 0..p.len() {
            for j in 0..p.len() {
                if y[i] == 1.0 && y[j] == 0.0 {
                    pairs += 1.0;
                    if p[i] > p[j] {
                        good += 1.0;
                    }
                }
            }
        }
        good / pairs
    }

    #[test]
    fn hand_computed_and_pairwise_reference() {
        let mut m = AucMetric::new();
        m.update(&[0.9, 0.8, 0.3, 0.1], &[1.0, 0.0, 1.0, 0.0], None).unwrap();
        assert!((m.auc() - 0.75).abs() < 1e-12);
        // Distinct predictions: trapezoid AUC == pairwise AUC.
        let p: Vec<f32> = (0..200).map(|i| ((i * 37 % 200) as f32) / 200.0).collect();
        let y: Vec<f32> = (0..200)
            .map(|i| if (i * 37 % 200) as f32 / 200.0 + (i % 7) as f32 * 0.1 > 0.6 { 1.0 } else { 0.0 })
            .collect();
        let mut m = AucMetric::new();
        m.update(&p[..120], &y[..120], None).unwrap();
        m.update(&p[120..], &y[120..], None).unwrap();
        assert!((m.auc() - pairwise(&p, &y)).abs() < 1e-12);
    }

    #[test]
    fn one_class_is_half_and_weights_repeat() {
        let mut m = AucMetric::new();
        m.update(&[0.2, 0.4], &[1.0, 1.0], None).unwrap();
        assert_eq!(m.auc(), 0.5);
        let w = auc(&[0.9, 0.5, 0.1], &[1.0, 0.0, 1.0], &[1.0, 2.0, 1.0]);
        let rep = auc(&[0.9, 0.5, 0.5, 0.1], &[1.0, 0.0, 0.0, 1.0], &[1.0; 4]);
        assert!((w - rep).abs() < 1e-12 && (w - 0.5).abs() < 1e-12);
    }
}
