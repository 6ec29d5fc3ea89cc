//! Area under the ROC curve (TorchRec `torchrec/metrics/auc.py`).

use std::collections::HashMap;

use crate::state::{limit_array, of_kind, with_kind};
use crate::window::SampleWindow;
use crate::{Metric, MetricError, MetricState, TaskBatch, validate_batch};

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
///
/// **Grouped AUC** ([`AucMetric::grouped`], TorchRec's `grouped_auc = True`): each batch also
/// carries a grouping key per sample (a user or session, from the sampler); `grouped_auc` is
/// the unweighted mean over the groups in the window of each group's AUC (0.5 for a group with
/// one class), reported next to `auc`.
#[derive(Clone, Debug, PartialEq)]
pub struct AucMetric {
    window: Option<usize>,
    samples: SampleWindow,
    grouped: bool,
}

impl Default for AucMetric {
    fn default() -> Self {
        Self::new()
    }
}

impl AucMetric {
    /// An AUC over every sample since construction or the last reset.
    pub fn new() -> Self {
        Self { window: None, samples: SampleWindow::new(false), grouped: false }
    }

    /// Also reports `grouped_auc`; every batch must then carry grouping keys
    /// ([`Metric::update_batch`]).
    pub fn grouped(self) -> Self {
        Self { samples: SampleWindow::new(true), grouped: true, ..self }
    }

    /// An AUC over the most recent `window` samples (older samples are dropped).
    pub fn with_window(window: usize) -> Result<Self, MetricError> {
        if window == 0 {
            return Err(MetricError::EmptyWindow);
        }
        Ok(Self { window: Some(window), samples: SampleWindow::new(false), grouped: false })
    }

    /// The metric of one of `world` ranks sharing a global window of `window` samples: each
    /// rank keeps `ceil(window / world)` (TorchRec's local window).
    pub fn for_rank(window: usize, world: usize) -> Result<Self, MetricError> {
        Self::with_window(window.div_ceil(world.max(1)))
    }

    /// Adds another rank's samples after this rank's (TorchRec's gather reduction for AUC):
    /// computing afterwards gives the AUC over the union of the ranks' windows.
    pub fn merge(&mut self, other: &AucMetric) -> Result<(), MetricError> {
        if other.grouped != self.grouped || other.samples.is_grouped() != self.samples.is_grouped() {
            return Err(MetricError::Incompatible { ours: "auc", theirs: "auc with other grouping" });
        }
        self.samples.append(&other.samples);
        Ok(())
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
        // Hard labels: each run of the sorted samples integrated where it was sorted, the runs
        // joined in order (the same sums, grouped by run).
        if let Some(runs) = self.samples.fold_sorted(Curve::of_hard_records) {
            return runs.into_iter().fold(Curve::default(), Curve::then).auc();
        }
        let mut curve = Curve::default();
        self.samples.sweep(false, |v| curve.add(v.label, v.weight));
        curve.auc()
    }

    /// The mean of the per-group AUCs of the samples currently kept (0.5 without samples).
    pub fn grouped_auc(&self) -> f64 {
        let mut curves: HashMap<i64, Curve> = HashMap::new();
        self.samples.sweep(true, |v| curves.entry(self.samples.group(v.index)).or_default().add(v.label, v.weight));
        if curves.is_empty() {
            return 0.5;
        }
        // Sum in key order: the value does not depend on the hash map's iteration order.
        let mut per_group: Vec<(i64, f64)> = curves.iter().map(|(&g, c)| (g, c.auc())).collect();
        per_group.sort_unstable_by_key(|&(g, _)| g);
        per_group.iter().map(|&(_, a)| a).sum::<f64>() / per_group.len() as f64
    }
}

/// The trapezoid integration of the ROC curve, one sample at a time in descending order.
#[derive(Clone, Copy, Debug, Default)]
struct Curve {
    tp: f64,
    fp: f64,
    area: f64,
}

impl Curve {
    #[inline]
    fn add(&mut self, label: f32, weight: f32) {
        let (w, y) = (f64::from(weight), f64::from(label));
        let tp_prev = self.tp;
        self.tp += w * y;
        let dfp = w * (1.0 - y);
        self.fp += dfp;
        self.area += dfp * (self.tp + tp_prev) * 0.5;
    }

    fn auc(&self) -> f64 {
        if self.fp * self.tp == 0.0 { 0.5 } else { self.area / self.fp / self.tp }
    }

    /// The curve of a run of sorted hard-label records ([`crate::window`]'s packing), from
    /// zero: per sample what [`Self::add`] computes for a label of 1 (`tp += w`) or 0 (`fp +=
    /// w`, `area += w * tp`), the same values (its other terms add exactly 0).
    fn of_hard_records(records: &[u64]) -> Self {
        // Four consecutive quarters integrated side by side (four independent chains of
        // additions instead of one), then joined in order; the rest after them.
        const PARTS: usize = 4;
        let len = records.len() / PARTS;
        let (q0, rest) = records.split_at(len);
        let (q1, rest) = rest.split_at(len);
        let (q2, q3) = rest.split_at(len);
        let mut quarters = [Self::default(); PARTS];
        // (`q3` may be longer: the zip stops at the shortest, the rest is added below.)
        for (((&ra, &rb), &rc), &rd) in q0.iter().zip(q1).zip(q2).zip(q3) {
            quarters[0].add_hard(ra);
            quarters[1].add_hard(rb);
            quarters[2].add_hard(rc);
            quarters[3].add_hard(rd);
        }
        let mut c = quarters.into_iter().fold(Self::default(), Self::then);
        for &r in &records[PARTS * len..] {
            c.add_hard(r);
        }
        c
    }

    /// One hard-label record: what [`Self::add`] computes for its label and weight.
    #[inline(always)]
    fn add_hard(&mut self, r: u64) {
        let w = f64::from(crate::window::unpack_weight(r));
        // Without a branch (labels are random: a branch would be mispredicted half the
        // time): the weight as a positive's or a negative's, the other term exactly 0.
        let wp = w * f64::from(crate::window::unpack_hard_label(r));
        let wn = w - wp;
        self.area += wn * self.tp;
        self.tp += wp;
        self.fp += wn;
    }

    /// This curve followed by `next` (a curve of the samples after this one's): `next`'s
    /// negatives also rank below all of this curve's positives.
    fn then(self, next: Self) -> Self {
        Self { tp: self.tp + next.tp, fp: self.fp + next.fp, area: self.area + next.area + next.fp * self.tp }
    }
}

impl Metric for AucMetric {
    fn output_names(&self) -> Vec<String> {
        let mut names = vec!["auc".to_owned()];
        if self.grouped {
            names.push("grouped_auc".to_owned());
        }
        names
    }

    fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        self.update_batch(&TaskBatch { predictions, labels, weights, groups: None })
    }

    fn update_batch(&mut self, b: &TaskBatch<'_>) -> Result<(), MetricError> {
        validate_batch(b.predictions, b.labels, b.weights)?;
        if self.grouped {
            crate::check_groups("grouped_auc", b)?;
        }
        self.samples.push(self.window, b.predictions, b.labels, b.weights, b.groups);
        Ok(())
    }

    fn needs_groups(&self) -> bool {
        self.grouped
    }

    fn compute(&self) -> Vec<(String, f64)> {
        let mut out = vec![("auc".to_owned(), self.auc())];
        if self.grouped {
            out.push(("grouped_auc".to_owned(), self.grouped_auc()));
        }
        out
    }

    fn reset(&mut self) {
        self.samples.clear();
    }

    /// The kept samples (see [`MetricState`]) and the window size, `auc.window` (empty when
    /// every sample is kept).
    fn state(&self) -> Option<MetricState> {
        let mut state = MetricState::default();
        state.push("window", limit_array(self.window.unwrap_or(usize::MAX)));
        self.samples.save(&mut state);
        Some(with_kind("auc", state))
    }

    fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        let load = || {
            let names = [&["window"][..], SampleWindow::state_names(self.grouped)].concat();
            let state = of_kind("auc", state, &names)?;
            state.expect_array("window", &limit_array(self.window.unwrap_or(usize::MAX)))?;
            SampleWindow::load(&state, self.grouped, self.window)
        };
        self.samples = load().map_err(|e| e.in_metric(&self.output_names().join(",")))?;
        Ok(())
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

    /// The sequential sweep of every sample, the reference of the runs joined in order.
    fn sequential(m: &AucMetric) -> f64 {
        let mut curve = Curve::default();
        m.samples.sweep(false, |v| curve.add(v.label, v.weight));
        curve.auc()
    }

    #[test]
    fn runs_integrated_in_parallel_equal_the_sequential_sweep() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // Both sorts (one run below 65,536 samples, 2,048 MSD runs above), with ties.
        for n in [10usize, 5_000, 300_000] {
            let p: Vec<f32> = (0..n).map(|_| (rng.random_range(0..2000) as f32 / 2000.0).powi(2)).collect();
            let y: Vec<f32> = p.iter().map(|&x| f32::from(rng.random::<f32>() < x)).collect();
            let w: Vec<f32> = (0..n).map(|_| rng.random_range(0.5..3.0)).collect();
            // Unit weights: every sum is an integer, so the join is exact.
            let mut unit = AucMetric::new();
            unit.update(&p, &y, None).unwrap();
            assert_eq!(unit.auc(), sequential(&unit), "n = {n}");
            let mut weighted = AucMetric::new();
            weighted.update(&p, &y, Some(&w)).unwrap();
            let (a, b) = (weighted.auc(), sequential(&weighted));
            assert!((a - b).abs() < 1e-12, "n = {n}: {a} vs {b}");
        }
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

    #[test]
    fn resumes_exactly_from_a_saved_state() {
        use crate::resume::{assert_rejects_damaged, assert_resumes_exactly, batches};
        type Config = (&'static str, fn() -> AucMetric);
        let configs: [Config; 4] = [
            ("lifetime", AucMetric::new),
            ("windowed", || AucMetric::with_window(37).unwrap()),
            ("grouped", || AucMetric::new().grouped()),
            ("windowed grouped", || AucMetric::with_window(37).unwrap().grouped()),
        ];
        for (name, make) in configs {
            for soft in [false, true] {
                let data = batches(21 + u64::from(soft), 30, soft);
                // 30 batches of ~10 samples wrap a window of 37 many times after the load.
                assert_resumes_exactly(&|| Box::new(make()), &data[..8], &data[8..]);
                let mut m = make();
                for b in &data[..8] {
                    m.update_batch(&b.batch()).unwrap();
                }
                assert_rejects_damaged(&|| Box::new(make()), &m.state().unwrap());
                eprintln!("{name}, soft labels {soft}: ok");
            }
        }
    }

    #[test]
    fn state_of_another_configuration_is_rejected() {
        let mut full = AucMetric::with_window(10).unwrap();
        full.update(&[0.1, 0.9, 0.4], &[0.0, 1.0, 1.0], None).unwrap();
        let state = full.state().unwrap();
        let e = AucMetric::with_window(20).unwrap().load_state(&state).unwrap_err().to_string();
        assert!(e.contains("saved with window = [10.0], but this metric has window = [20.0]"), "{e}");
        assert!(AucMetric::new().load_state(&state).is_err());
        let e = AucMetric::with_window(10).unwrap().grouped().load_state(&state).unwrap_err().to_string();
        assert!(
            e.starts_with(
                r#"cannot restore the state of metric "auc,grouped_auc": the state has no array "auc.groups_hi""#
            ),
            "{e}"
        );
        let e = crate::NeMetric::new(false).load_state(&state).unwrap_err().to_string();
        assert!(e.contains(r#"unexpected array "auc.window" (the state of another metric?)"#), "{e}");
        let mut other = AucMetric::with_window(10).unwrap();
        other.load_state(&state).unwrap();
        assert_eq!(other, full);
    }
}
