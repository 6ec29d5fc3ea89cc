//! Area under the ROC curve (TorchRec `torchrec/metrics/auc.py`).

use std::collections::VecDeque;

use crate::{Metric, MetricError, validate_batch, weight_at};

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Sample {
    pub(crate) prediction: f32,
    pub(crate) label: f32,
    pub(crate) weight: f32,
}

/// AUC exactly as TorchRec computes it, in `O(n log n)` over the samples it keeps.
///
/// The metric keeps every sample (prediction, label, weight) of its window: all samples
/// since the last reset ([`AucMetric::new`]) or the most recent `window` samples
/// ([`AucMetric::with_window`], like TorchRec's `window_size`, which counts samples).
///
/// `compute` sorts the kept samples by prediction, descending, accumulates the weighted
/// true and false positives in that order,
///
/// ```text
/// tp_i = Σ_{j <= i} w_j * y_j        fp_i = Σ_{j <= i} w_j * (1 - y_j)
/// ```
///
/// and integrates the curve `(fp_i, tp_i)` with the trapezoid rule:
///
/// ```text
/// auc = Σ_i (fp_i - fp_{i-1}) * (tp_i + tp_{i-1}) / 2 / (fp_n * tp_n)
/// ```
///
/// It is 0.5 when the window is empty or either class has zero total weight. Soft labels
/// count fractionally in both sums, as in TorchRec. Sums are `f64` (TorchRec sums in `f32`).
///
/// **Ties.** Every sample is its own point on the curve; tied predictions are not merged.
/// The sort is stable, so tied samples keep their arrival order: a positive that arrived
/// before a tied negative counts as ranked above it (a full correctly ordered pair), one that
/// arrived after counts as ranked below. TorchRec's `argsort` is not stable, so its result
/// on ties is unspecified; scikit-learn instead merges ties and credits half a pair. Without
/// ties the value equals the weighted fraction of (positive, negative) pairs ordered
/// correctly.
#[derive(Clone, Debug, PartialEq)]
pub struct AucMetric {
    window: Option<usize>,
    samples: VecDeque<Sample>,
}

impl Default for AucMetric {
    fn default() -> Self {
        Self::new()
    }
}

impl AucMetric {
    /// An AUC over every sample since construction or the last reset.
    pub fn new() -> Self {
        Self { window: None, samples: VecDeque::new() }
    }

    /// An AUC over the most recent `window` samples (older samples are dropped).
    pub fn with_window(window: usize) -> Result<Self, MetricError> {
        if window == 0 {
            return Err(MetricError::EmptyWindow);
        }
        Ok(Self { window: Some(window), samples: VecDeque::new() })
    }

    /// The window size in samples, or `None` when every sample is kept.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The number of samples currently kept.
    pub fn num_samples(&self) -> usize {
        self.samples.len()
    }

    /// The AUC of the samples currently kept.
    pub fn auc(&self) -> f64 {
        if self.samples.is_empty() {
            return 0.5;
        }
        // Descending by prediction, ties in arrival order.
        let sorted = sort_descending(&self.samples);
        let (mut tp, mut fp, mut area) = (0.0f64, 0.0f64, 0.0f64);
        for s in &sorted {
            let w = f64::from(s.weight);
            let y = f64::from(s.label);
            let (tp_prev, fp_prev) = (tp, fp);
            tp += w * y;
            fp += w * (1.0 - y);
            area += (fp - fp_prev) * (tp + tp_prev) * 0.5;
        }
        if fp * tp == 0.0 {
            return 0.5;
        }
        area / fp / tp
    }
}

/// Appends a validated batch to `samples` and keeps only the latest `window` of them (all for
/// `None`): TorchRec's sample window of AUC and AUPRC.
pub(crate) fn push_window(
    samples: &mut VecDeque<Sample>,
    window: Option<usize>,
    predictions: &[f32],
    labels: &[f32],
    weights: Option<&[f32]>,
) {
    // Only the tail of a batch larger than the window can survive.
    let skip = window.map_or(0, |w| predictions.len().saturating_sub(w));
    samples.reserve(predictions.len() - skip);
    for i in skip..predictions.len() {
        samples.push_back(Sample {
            prediction: predictions[i],
            label: labels[i],
            // Weights were checked finite; an absent weight is 1.
            weight: weight_at(weights, i) as f32,
        });
    }
    if let Some(window) = window {
        let excess = samples.len().saturating_sub(window);
        samples.drain(..excess);
    }
}

/// `f32` → `u32` such that the integer order is the float order (finite values).
#[inline]
fn ordered_bits(x: f32) -> u32 {
    // -0.0 and 0.0 are equal predictions (a tie), as `partial_cmp` has them.
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 }
}

/// The samples by descending prediction, ties in input order: sorts one `u64` per sample,
/// the inverted order-preserving image of the prediction above the sample's index (so the
/// index breaks ties and an unstable sort is stable), then gathers.
pub(crate) fn sort_descending(samples: &VecDeque<Sample>) -> Vec<Sample> {
    let mut keys: Vec<u64> =
        samples.iter().enumerate().map(|(i, s)| (u64::from(!ordered_bits(s.prediction)) << 32) | i as u64).collect();
    keys.sort_unstable();
    keys.into_iter().map(|k| samples[(k & 0xffff_ffff) as usize]).collect()
}

impl Metric for AucMetric {
    fn output_names(&self) -> Vec<String> {
        vec!["auc".to_owned()]
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        validate_batch(predictions, labels, weights)?;
        push_window(&mut self.samples, self.window, predictions, labels, weights);
        Ok(())
    }

    fn compute(&self) -> Vec<(String, f64)> {
        vec![("auc".to_owned(), self.auc())]
    }

    fn reset(&mut self) {
        self.samples.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;

    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Weighted fraction of correctly ordered (positive, negative) pairs, ties counting
    /// half; binary labels only. Independent `O(n^2)` reference.
    fn pairwise_auc(p: &[f32], y: &[f32], w: &[f32]) -> f64 {
        let (mut num, mut pos, mut neg) = (0.0f64, 0.0f64, 0.0f64);
        for i in 0..p.len() {
            if y[i] == 1.0 {
                pos += f64::from(w[i]);
            } else {
                neg += f64::from(w[i]);
            }
        }
        for i in 0..p.len() {
            for j in 0..p.len() {
                if y[i] == 1.0 && y[j] == 0.0 {
                    let credit = match p[i].partial_cmp(&p[j]).unwrap() {
                        Ordering::Greater => 1.0,
                        Ordering::Equal => 0.5,
                        Ordering::Less => 0.0,
                    };
                    num += credit * f64::from(w[i]) * f64::from(w[j]);
                }
            }
        }
        num / (pos * neg)
    }

    #[test]
    fn hand_computed() {
        // Positives 0.9, 0.7; negatives 0.8, 0.6: 3 of 4 pairs are ordered correctly.
        let mut m = AucMetric::new();
        m.update(&[0.9, 0.8, 0.7, 0.6], &[1.0, 0.0, 1.0, 0.0], None).unwrap();
        assert!((m.auc() - 0.75).abs() < 1e-15);
        assert_eq!(m.compute(), vec![("auc".to_owned(), m.auc())]);
    }

    #[test]
    fn hand_computed_weighted() {
        // Same ranking; weights pos(0.9)=2, neg(0.8)=1, pos(0.7)=1, neg(0.6)=3.
        // Correct pairs: 2*1 + 2*3 + 1*3 = 11 out of (2+1)*(1+3) = 12.
        let mut m = AucMetric::new();
        m.update(&[0.9, 0.8, 0.7, 0.6], &[1.0, 0.0, 1.0, 0.0], Some(&[2.0, 1.0, 1.0, 3.0])).unwrap();
        assert!((m.auc() - 11.0 / 12.0).abs() < 1e-15);
    }

    #[test]
    fn matches_pairwise_reference_without_ties() {
        let mut rng = StdRng::seed_from_u64(7);
        for trial in 0..20 {
            let n = 1 + trial * 13;
            // Distinct predictions: a shuffled grid, so no ties.
            let mut p: Vec<f32> = (0..n).map(|i| (i as f32 + 0.5) / n as f32).collect();
            for i in (1..n).rev() {
                p.swap(i, rng.random_range(0..=i));
            }
            let y: Vec<f32> = (0..n).map(|_| if rng.random_bool(0.3) { 1.0 } else { 0.0 }).collect();
            let w: Vec<f32> = (0..n).map(|_| rng.random_range(0.1..4.0)).collect();
            let mut m = AucMetric::new();
            // Feed in three batches to exercise accumulation.
            let (a, b) = (n / 3, 2 * n / 3);
            m.update(&p[..a], &y[..a], Some(&w[..a])).unwrap();
            m.update(&p[a..b], &y[a..b], Some(&w[a..b])).unwrap();
            m.update(&p[b..], &y[b..], Some(&w[b..])).unwrap();
            let has_both = y.contains(&1.0) && y.contains(&0.0);
            let expected = if has_both { pairwise_auc(&p, &y, &w) } else { 0.5 };
            assert!((m.auc() - expected).abs() < 1e-9, "trial {trial}: {} vs {expected}", m.auc());
        }
    }

    #[test]
    fn one_class_or_empty_is_half() {
        let mut m = AucMetric::new();
        assert_eq!(m.auc(), 0.5);
        m.update(&[0.1, 0.9], &[1.0, 1.0], None).unwrap();
        assert_eq!(m.auc(), 0.5);
        m.reset();
        m.update(&[0.1, 0.9], &[0.0, 0.0], None).unwrap();
        assert_eq!(m.auc(), 0.5);
        // A negative with zero weight leaves only one class.
        m.reset();
        m.update(&[0.1, 0.9], &[0.0, 1.0], Some(&[0.0, 1.0])).unwrap();
        assert_eq!(m.auc(), 0.5);
    }

    #[test]
    fn integer_weight_equals_repeated_samples() {
        let mut weighted = AucMetric::new();
        weighted.update(&[0.9, 0.5, 0.1], &[1.0, 0.0, 1.0], Some(&[1.0, 2.0, 1.0])).unwrap();
        let mut repeated = AucMetric::new();
        repeated.update(&[0.9, 0.5, 0.5, 0.1], &[1.0, 0.0, 0.0, 1.0], None).unwrap();
        assert!((weighted.auc() - repeated.auc()).abs() < 1e-15);
        assert!((weighted.auc() - 0.5).abs() < 1e-15);
    }

    #[test]
    fn ties_follow_arrival_order() {
        let mut pos_first = AucMetric::new();
        pos_first.update(&[0.5, 0.5], &[1.0, 0.0], None).unwrap();
        assert_eq!(pos_first.auc(), 1.0);
        let mut neg_first = AucMetric::new();
        neg_first.update(&[0.5, 0.5], &[0.0, 1.0], None).unwrap();
        assert_eq!(neg_first.auc(), 0.0);
    }

    #[test]
    fn window_keeps_most_recent_samples() {
        let p = [0.1, 0.9, 0.8, 0.3, 0.6, 0.2];
        let y = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        let mut windowed = AucMetric::with_window(4).unwrap();
        windowed.update(&p[..3], &y[..3], None).unwrap();
        windowed.update(&p[3..], &y[3..], None).unwrap();
        assert_eq!(windowed.num_samples(), 4);
        let mut tail = AucMetric::new();
        tail.update(&p[2..], &y[2..], None).unwrap();
        assert_eq!(windowed.auc(), tail.auc());

        // A single batch larger than the window keeps its tail only.
        let mut big = AucMetric::with_window(2).unwrap();
        big.update(&p, &y, None).unwrap();
        assert_eq!(big.num_samples(), 2);
        let mut last_two = AucMetric::new();
        last_two.update(&p[4..], &y[4..], None).unwrap();
        assert_eq!(big.auc(), last_two.auc());
        assert!(matches!(AucMetric::with_window(0), Err(MetricError::EmptyWindow)));
    }

    #[test]
    fn rejected_batch_leaves_state_unchanged() {
        let mut m = AucMetric::new();
        m.update(&[0.2, 0.7], &[0.0, 1.0], None).unwrap();
        let before = m.clone();
        assert!(m.update(&[0.2], &[2.0], None).is_err());
        assert_eq!(m, before);
    }

    #[test]
    fn large_window_is_fast_enough() {
        // 200k samples: an O(n^2) implementation would take minutes.
        let mut rng = StdRng::seed_from_u64(3);
        let n = 200_000;
        let p: Vec<f32> = (0..n).map(|_| rng.random()).collect();
        let y: Vec<f32> = p.iter().map(|&x| if rng.random::<f32>() < x { 1.0 } else { 0.0 }).collect();
        let mut m = AucMetric::new();
        m.update(&p, &y, None).unwrap();
        // Labels drawn with P(y=1) = p: the expected AUC is 5/6 ~ 0.833.
        assert!((m.auc() - 5.0 / 6.0).abs() < 0.01, "auc = {}", m.auc());
    }
}
