//! The sample window of the ranking metrics (AUC, grouped AUC, AUPRC) and the sort that
//! visits it by descending prediction.
//!
//! Samples are kept column-wise: the prediction as a 32-bit key whose integer order is the
//! descending prediction order, the label, the weight and (for grouped metrics) the grouping
//! key. Visiting in order sorts one `u64` per sample by its high half (the key) with a stable
//! radix sort, so tied predictions keep their arrival order. When every label is 0 or 1 the
//! low half carries the weight and the label (the sign bit of a non-negative weight is free)
//! and the sweep reads nothing else; otherwise it carries the sample's index.

use std::collections::VecDeque;

use rayon::prelude::*;

use crate::{MetricError, MetricState, kernels};

/// Kept samples, oldest first.
#[derive(Clone, Debug, Default)]
pub(crate) struct SampleWindow {
    /// Per sample: the prediction's [`descending_key`] in the high half; the weight's bits in
    /// the low 31 bits and, when the label is 1, bit 31 (the sign of a weight `>= 0` is free).
    packed: VecDeque<u64>,
    /// The labels, kept only once a label other than 0 or 1 has been seen.
    soft_labels: Option<VecDeque<f32>>,
    /// Grouping keys, kept when the window was created grouped.
    groups: Option<VecDeque<i64>>,
    /// Covers the keys of every sample pushed since the window was last empty.
    span: KeySpan,
}

/// Equal samples (the spans, which only steer the sort, may differ).
impl PartialEq for SampleWindow {
    fn eq(&self, other: &Self) -> bool {
        (&self.packed, &self.soft_labels, &self.groups) == (&other.packed, &other.soft_labels, &other.groups)
    }
}

/// `f32` → `u32` whose integer order is the *descending* float order (finite values).
#[inline]
pub(crate) fn descending_key(x: f32) -> u32 {
    // -0.0 and 0.0 are equal predictions (a tie), as `partial_cmp` has them.
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    !(if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 })
}

/// The prediction whose [`descending_key`] is `key` (`0.0` for the key of both zeros).
#[inline]
fn from_descending_key(key: u32) -> f32 {
    let b = !key;
    f32::from_bits(if b & 0x8000_0000 != 0 { b & 0x7fff_ffff } else { !b })
}

#[inline]
fn pack(p: f32, y: f32, w: f32) -> u64 {
    (u64::from(descending_key(p)) << 32) | u64::from(w.to_bits() & 0x7fff_ffff) | (u64::from(y == 1.0) << 31)
}

/// Packs a batch into `out` (as long as `p`); the span of its keys.
fn pack_batch(p: &[f32], y: &[f32], w: Option<&[f32]>, out: &mut [u64]) -> KeySpan {
    #[cfg(target_arch = "x86_64")]
    if *kernels::AVX2 {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { pack_batch_avx2(p, y, w, out) };
    }
    pack_batch_body(p, y, w, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn pack_batch_avx2(p: &[f32], y: &[f32], w: Option<&[f32]>, out: &mut [u64]) -> KeySpan {
    pack_batch_body(p, y, w, out)
}

#[inline(always)]
fn pack_batch_body(p: &[f32], y: &[f32], w: Option<&[f32]>, out: &mut [u64]) -> KeySpan {
    let mut span = KeySpan::default();
    match w {
        Some(w) => {
            for (((o, &p), &y), &w) in out.iter_mut().zip(p).zip(y).zip(w) {
                *o = pack(p, y, w);
                span.add((*o >> 32) as u32);
            }
        }
        None => {
            for ((o, &p), &y) in out.iter_mut().zip(p).zip(y) {
                *o = pack(p, y, 1.0);
                span.add((*o >> 32) as u32);
            }
        }
    }
    span
}

#[inline]
pub(crate) fn unpack_weight(r: u64) -> f32 {
    f32::from_bits(r as u32 & 0x7fff_ffff)
}

#[inline]
pub(crate) fn unpack_hard_label(r: u64) -> f32 {
    if (r >> 31) & 1 == 1 { 1.0 } else { 0.0 }
}

/// One sample met in order by [`SampleWindow::sweep`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Visit {
    /// The prediction's [`descending_key`]: equal keys are tied predictions.
    pub(crate) key: u32,
    pub(crate) label: f32,
    pub(crate) weight: f32,
    /// Position in the window (arrival order), only when the sweep was asked for indices.
    pub(crate) index: usize,
}

impl SampleWindow {
    /// An empty window; `grouped` keeps a grouping key per sample.
    pub(crate) fn new(grouped: bool) -> Self {
        Self { groups: grouped.then(VecDeque::new), ..Self::default() }
    }

    pub(crate) fn len(&self) -> usize {
        self.packed.len()
    }

    pub(crate) fn clear(&mut self) {
        self.packed.clear();
        self.span = KeySpan::default();
        self.soft_labels = None;
        if let Some(g) = &mut self.groups {
            g.clear();
        }
    }

    /// The grouping key of the sample at `index` (grouped windows only).
    pub(crate) fn group(&self, index: usize) -> i64 {
        self.groups.as_ref().map_or(0, |g| g[index])
    }

    /// Appends a validated batch and keeps only the latest `window` samples (all for `None`):
    /// TorchRec's sample window of AUC and AUPRC. `groups` is required by grouped windows and
    /// ignored otherwise.
    pub(crate) fn push(
        &mut self,
        window: Option<usize>,
        predictions: &[f32],
        labels: &[f32],
        weights: Option<&[f32]>,
        groups: Option<&[i64]>,
    ) {
        // Only the tail of a batch larger than the window can survive.
        let skip = window.map_or(0, |w| predictions.len().saturating_sub(w));
        let (p, y) = (&predictions[skip..], &labels[skip..]);
        if self.soft_labels.is_none() && !crate::kernels::all_hard(y) {
            // From now on keep the labels; the earlier ones were 0 or 1, as their bit says.
            self.soft_labels = Some(self.packed.iter().map(|&r| unpack_hard_label(r)).collect());
        }
        // Packed in a cache-resident scratch (one vectorised loop), then appended.
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            scratch.resize(p.len(), 0);
            self.span = self.span.union(pack_batch(p, y, weights.map(|w| &w[skip..]), &mut scratch));
            self.packed.extend(scratch.iter().copied());
        });
        if let Some(l) = &mut self.soft_labels {
            l.extend(y);
        }
        if let (Some(g), Some(new)) = (&mut self.groups, groups) {
            g.extend(&new[skip..]);
        }
        if let Some(window) = window {
            let excess = self.packed.len().saturating_sub(window);
            self.packed.drain(..excess);
            if let Some(l) = &mut self.soft_labels {
                l.drain(..excess);
            }
            if let Some(g) = &mut self.groups {
                g.drain(..excess);
            }
        }
    }

    /// Appends another window's samples after this one's (TorchRec's gather reduction: the
    /// ranks' samples concatenated in rank order). Both must be grouped or both not.
    pub(crate) fn append(&mut self, other: &SampleWindow) {
        match (&mut self.soft_labels, &other.soft_labels) {
            (Some(mine), Some(theirs)) => mine.extend(theirs),
            (Some(mine), None) => mine.extend(other.packed.iter().map(|&r| unpack_hard_label(r))),
            (None, Some(theirs)) => {
                let mut labels: VecDeque<f32> = self.packed.iter().map(|&r| unpack_hard_label(r)).collect();
                labels.extend(theirs);
                self.soft_labels = Some(labels);
            }
            (None, None) => {}
        }
        self.packed.extend(&other.packed);
        self.span = self.span.union(other.span);
        if let (Some(g), Some(theirs)) = (&mut self.groups, &other.groups) {
            g.extend(theirs);
        }
    }

    /// Whether a grouping key is kept per sample.
    pub(crate) fn is_grouped(&self) -> bool {
        self.groups.is_some()
    }

    /// Saves the samples into `state` as the arrays `predictions`, `labels`, `weights` (one
    /// value per sample, oldest first), `soft_labels` (whether labels other than 0 and 1 are
    /// kept) and, for a grouped window, `groups_hi` / `groups_lo` (the high, signed, and low
    /// 32 bits of each grouping key). A `-0.0` prediction or weight is saved as `0.0`, which the
    /// window does not tell apart.
    pub(crate) fn save(&self, state: &mut MetricState) {
        state.push("predictions", self.packed.iter().map(|&r| f64::from(from_descending_key((r >> 32) as u32))));
        match &self.soft_labels {
            Some(labels) => state.push("labels", labels.iter().map(|&y| f64::from(y))),
            None => state.push("labels", self.packed.iter().map(|&r| f64::from(unpack_hard_label(r)))),
        }
        state.push("weights", self.packed.iter().map(|&r| f64::from(unpack_weight(r))));
        state.push("soft_labels", [if self.soft_labels.is_some() { 1.0 } else { 0.0 }]);
        if let Some(groups) = &self.groups {
            state.push("groups_hi", groups.iter().map(|&g| f64::from((g >> 32) as i32)));
            state.push("groups_lo", groups.iter().map(|&g| f64::from(g as u32)));
        }
    }

    /// The names of the arrays [`SampleWindow::save`] writes.
    pub(crate) fn state_names(grouped: bool) -> &'static [&'static str] {
        const NAMES: [&str; 6] = ["predictions", "labels", "weights", "soft_labels", "groups_hi", "groups_lo"];
        if grouped { &NAMES[..6] } else { &NAMES[..4] }
    }

    /// The window [`SampleWindow::save`] wrote into `state`, checked: as many labels, weights
    /// (and, when `grouped`, grouping keys) as predictions, at most `max_len` samples, and
    /// samples a batch could have brought.
    pub(crate) fn load(state: &MetricState, grouped: bool, max_len: Option<usize>) -> Result<Self, MetricError> {
        let predictions = state.f32s("predictions")?;
        let n = predictions.len();
        if let Some(max) = max_len
            && n > max
        {
            return Err(MetricError::bad_state(format!(
                "the state holds {n} samples but the window keeps at most {max}"
            )));
        }
        let labels = state.f32s("labels")?;
        let weights = state.f32s("weights")?;
        for (name, len) in [("labels", labels.len()), ("weights", weights.len())] {
            if len != n {
                return Err(MetricError::bad_state(format!("{name} has {len} values for {n} predictions")));
            }
        }
        crate::validate_batch(&predictions, &labels, Some(&weights))
            .map_err(|e| MetricError::bad_state(format!("a saved sample is invalid: {e}")))?;
        let soft = state.flag("soft_labels")?;
        if !soft && !kernels::all_hard(&labels) {
            return Err(MetricError::bad_state("soft_labels is 0 but a label is neither 0 nor 1"));
        }
        let groups = if grouped {
            let (hi, lo) = (state.get_len("groups_hi", n)?, state.get_len("groups_lo", n)?);
            let half = |name: &str, i: usize, v: f64, range: std::ops::Range<f64>| {
                if v.fract() == 0.0 && range.contains(&v) {
                    Ok(v as i64)
                } else {
                    Err(MetricError::bad_state(format!("{name}[{i}] = {v} is not a 32-bit half of a grouping key")))
                }
            };
            let keys = (0..n)
                .map(|i| {
                    let h = half("groups_hi", i, hi[i], -2_147_483_648.0..2_147_483_648.0)?;
                    let l = half("groups_lo", i, lo[i], 0.0..4_294_967_296.0)?;
                    Ok((h << 32) | l)
                })
                .collect::<Result<VecDeque<i64>, MetricError>>()?;
            Some(keys)
        } else {
            None
        };
        let mut packed = vec![0u64; n];
        let span = pack_batch(&predictions, &labels, Some(&weights), &mut packed);
        Ok(Self { packed: packed.into(), soft_labels: soft.then(|| labels.into()), groups, span })
    }

    /// Hard labels only (`None` with soft labels): `fold` of the samples by descending
    /// prediction (tied predictions in arrival order), in consecutive runs folded in parallel
    /// as they are sorted; the runs' results in order.
    pub(crate) fn fold_sorted<A: Send>(&self, fold: impl Fn(&[u64]) -> A + Sync + Send) -> Option<Vec<A>> {
        if self.soft_labels.is_some() {
            return None;
        }
        // The sorted records' memory is kept per thread between computes: a window's worth,
        // reused instead of page-faulted in afresh each time.
        thread_local! {
            static SORTED: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        Some(SORTED.with(|out| sort_and_fold(self.packed.as_slices(), self.span, &mut out.borrow_mut(), fold)))
    }

    /// Calls `f` on every sample by descending prediction, tied predictions in arrival order.
    /// With `indices`, each [`Visit`] carries the sample's position (for the grouping key).
    pub(crate) fn sweep(&self, indices: bool, mut f: impl FnMut(Visit)) {
        if !indices && self.soft_labels.is_none() {
            // Everything the sweep needs is in the sorted records themselves.
            for r in sort_by_high_half(self.packed.as_slices(), self.span) {
                f(Visit { key: (r >> 32) as u32, label: unpack_hard_label(r), weight: unpack_weight(r), index: 0 });
            }
            return;
        }
        let records: Vec<u64> = self.packed.iter().enumerate().map(|(i, &r)| (r & !0xffff_ffff) | i as u64).collect();
        for r in sort_by_high_half((&records, &[]), self.span) {
            let i = (r & 0xffff_ffff) as usize;
            let packed = self.packed[i];
            let label = self.soft_labels.as_ref().map_or_else(|| unpack_hard_label(packed), |l| l[i]);
            f(Visit { key: (r >> 32) as u32, label, weight: unpack_weight(packed), index: i });
        }
    }
}

/// Below this many records one thread sorts them with LSD passes alone.
const SMALL: usize = 1 << 16;

/// The widest digit of a counting pass (2,048 counters: they and a bucket stay in cache).
const MAX_DIGIT: u32 = 11;

/// Which bits of the sort keys may differ: the keys seen are folded in, and bits where all of
/// them agree need no counting pass. A superset is harmless (a key that has left the window
/// may still widen it); it only costs passes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeySpan {
    and: u32,
    or: u32,
}

impl Default for KeySpan {
    fn default() -> Self {
        Self { and: u32::MAX, or: 0 }
    }
}

impl KeySpan {
    /// Every key may differ in every bit.
    #[cfg(test)]
    pub(crate) const ALL: KeySpan = KeySpan { and: 0, or: u32::MAX };

    #[inline]
    pub(crate) fn add(&mut self, key: u32) {
        self.and &= key;
        self.or |= key;
    }

    /// Both spans' keys.
    pub(crate) fn union(self, other: KeySpan) -> KeySpan {
        KeySpan { and: self.and & other.and, or: self.or | other.or }
    }

    /// The record bits `lo..hi` (keys are the high half) outside which all keys agree; an
    /// empty range when every key is equal (or none was seen).
    fn record_bits(self) -> (u32, u32) {
        let varying = self.and ^ self.or;
        if self.and > self.or || varying == 0 {
            return (32, 32);
        }
        (32 + varying.trailing_zeros(), 64 - varying.leading_zeros())
    }
}

/// The counting passes, least significant first, covering record bits `lo..hi` with digits of
/// at most [`MAX_DIGIT`] bits, as even as possible (fewer counters per pass).
fn lsd_digits(lo: u32, hi: u32) -> Vec<(u32, u32)> {
    let bits = hi.saturating_sub(lo);
    let passes = bits.div_ceil(MAX_DIGIT);
    let mut digits = Vec::with_capacity(passes as usize);
    let mut shift = lo;
    for i in 0..passes {
        let width = (bits - (shift - lo)).div_ceil(passes - i);
        digits.push((shift, width));
        shift += width;
    }
    digits
}

/// Sorts the records of `parts` (read in order, as one sequence) by their high 32 bits,
/// stably; `span` covers every key.
///
/// Only the key bits that vary within `span` are sorted on. A most-significant-digit pass on
/// the top [`MAX_DIGIT`] of them scatters the records into up to 2,048 buckets; each bucket
/// (small enough to stay in cache) is then sorted by the bits below with least-significant-digit
/// passes, buckets in parallel. Every pass is a stable counting sort, and a pass whose digit is
/// equal for all its records is skipped.
pub(crate) fn sort_by_high_half(parts: (&[u64], &[u64]), span: KeySpan) -> Vec<u64> {
    let mut out = Vec::new();
    sort_and_fold(parts, span, &mut out, |_| ());
    out
}

/// [`sort_by_high_half`] into `out` (its memory reused), and `fold` of each of its buckets
/// once sorted, while the bucket is in cache (buckets in parallel): the folds in order (the
/// buckets' concatenation is the sorted sequence).
pub(crate) fn sort_and_fold<A: Send>(
    parts: (&[u64], &[u64]),
    span: KeySpan,
    out: &mut Vec<u64>,
    fold: impl Fn(&[u64]) -> A + Sync + Send,
) -> Vec<A> {
    let n = parts.0.len() + parts.1.len();
    let (lo, hi) = span.record_bits();
    out.clear();
    if n < SMALL || hi - lo <= MAX_DIGIT {
        out.extend_from_slice(parts.0);
        out.extend_from_slice(parts.1);
        let mut scratch = vec![0u64; n];
        lsd(out, &mut scratch, &lsd_digits(lo, hi));
        return vec![fold(out)];
    }
    let msd = hi - MAX_DIGIT;
    let bucket = |r: u64| ((r >> msd) & 0x7ff) as usize;
    // One chunk of the records per thread, in order: each counts its records per bucket, then
    // scatters them into its own part of every bucket (the chunks' parts in chunk order, so
    // the scatter stays stable).
    let threads = rayon::current_num_threads().clamp(1, 64);
    let chunks: Vec<(&[u64], &[u64])> =
        (0..threads).map(|t| records_between(parts, n * t / threads, n * (t + 1) / threads)).collect();
    let chunk_counts: Vec<Vec<usize>> = chunks
        .par_iter()
        .map(|&(a, b)| {
            let mut c = vec![0usize; 2048];
            for &r in a.iter().chain(b) {
                c[bucket(r)] += 1;
            }
            c
        })
        .collect();
    out.resize(n, 0);
    let mut counts = vec![0usize; 2048];
    {
        let mut dests: Vec<Vec<&mut [u64]>> = (0..threads).map(|_| Vec::with_capacity(2048)).collect();
        let mut rest = &mut out[..];
        for (d, total) in counts.iter_mut().enumerate() {
            for (dest, c) in dests.iter_mut().zip(&chunk_counts) {
                let (part, r) = std::mem::take(&mut rest).split_at_mut(c[d]);
                dest.push(part);
                rest = r;
                *total += c[d];
            }
        }
        chunks.par_iter().zip(dests.par_iter_mut()).for_each(|(&(a, b), dest)| {
            for &r in a.iter().chain(b) {
                let slot = &mut dest[bucket(r)];
                // Always `Some`: the chunk counted this record into this bucket.
                if let Some((first, tail)) = std::mem::take(slot).split_first_mut() {
                    *first = r;
                    *slot = tail;
                }
            }
        });
    }
    // Disjoint bucket slices of `out`, each sorted with a reused per-task buffer, then folded.
    let mut buckets = Vec::new();
    let mut rest = &mut out[..];
    for &c in &counts {
        let (b, r) = rest.split_at_mut(c);
        if c > 0 {
            buckets.push(b);
        }
        rest = r;
    }
    let digits = lsd_digits(lo, msd);
    buckets
        .into_par_iter()
        .map_init(Vec::new, |buf: &mut Vec<u64>, b| {
            if b.len() > 1 {
                buf.resize(b.len(), 0);
                lsd(b, &mut buf[..b.len()], &digits);
            }
            fold(b)
        })
        .collect()
}

/// The records `a..b` of the sequence `parts.0` then `parts.1`, as the two parts they fall in.
fn records_between<'a>(parts: (&'a [u64], &'a [u64]), a: usize, b: usize) -> (&'a [u64], &'a [u64]) {
    let k = parts.0.len();
    (&parts.0[a.min(k)..b.min(k)], &parts.1[a.saturating_sub(k)..b.saturating_sub(k)])
}

/// Stable LSD radix sort of `v` by the given (shift, width) digits, in that order (widths at
/// most [`MAX_DIGIT`]); `buf` is scratch of the same length. The result is left in `v`.
fn lsd(v: &mut [u64], buf: &mut [u64], digits: &[(u32, u32)]) {
    let mut in_v = true;
    let mut storage = [0usize; 1 << MAX_DIGIT];
    for &(shift, width) in digits {
        let mask = (1u64 << width) - 1;
        let (src, dst): (&mut [u64], &mut [u64]) = if in_v { (&mut *v, &mut *buf) } else { (&mut *buf, &mut *v) };
        let counts = &mut storage[..1 << width];
        counts.fill(0);
        for &r in src.iter() {
            counts[((r >> shift) & mask) as usize] += 1;
        }
        if counts.contains(&src.len()) {
            continue; // one bucket holds everything: already sorted by this digit
        }
        let mut next = 0;
        for c in counts.iter_mut() {
            let count = *c;
            *c = next;
            next += count;
        }
        for &r in src.iter() {
            let d = ((r >> shift) & mask) as usize;
            dst[counts[d]] = r;
            counts[d] += 1;
        }
        in_v = !in_v;
    }
    if !in_v {
        v.copy_from_slice(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn radix_sort_is_a_stable_sort_by_the_high_half() {
        let mut rng = StdRng::seed_from_u64(11);
        // Both paths (small, and MSD + parallel LSD), with many ties spread over every digit;
        // keys over all 32 bits, keys sharing their top and bottom bits (the passes then skip
        // them), keys varying in 11 bits or fewer (no MSD pass) and equal keys.
        let kinds: [fn(&mut StdRng) -> u32; 4] = [
            |rng| {
                [0u32, 7, 0x0040_0000, 0x8000_0001, u32::MAX, 0x3f00_0000][rng.random_range(0..6)]
                    ^ (rng.random_range(0..8u32) << rng.random_range(0..29))
            },
            |rng| 0x2a00_0003 | (rng.random_range(0..1u32 << 19) << 5),
            |rng| 0x8000_0000 | (rng.random_range(0..2048u32) << 9),
            |_| 0x1234_5678,
        ];
        for (kind, make) in kinds.iter().enumerate() {
            for n in [0usize, 1, 2, 17, 5000, 200_000] {
                let keys: Vec<u64> =
                    (0..n).map(|_| (u64::from(make(&mut rng)) << 32) | u64::from(rng.random::<u32>())).collect();
                let mut span = KeySpan::default();
                keys.iter().for_each(|&k| span.add((k >> 32) as u32));
                let mut expected = keys.clone();
                expected.sort_by_key(|k| k >> 32); // std's sort is stable
                let (a, b) = keys.split_at(n / 3);
                for span in [span, KeySpan::ALL] {
                    assert!(sort_by_high_half((a, b), span) == expected, "kind {kind}, n = {n}, two parts");
                    assert!(sort_by_high_half((&keys, &[]), span) == expected, "kind {kind}, n = {n}");
                }
            }
        }
        assert_eq!(lsd_digits(32, 64), [(32, 11), (43, 11), (54, 10)]);
        assert_eq!(lsd_digits(37, 53), [(37, 8), (45, 8)]);
        assert!(lsd_digits(40, 40).is_empty());
    }

    #[test]
    fn sweep_orders_signs_zeros_and_ties() {
        let p = [0.5f32, -1.0, 0.0, 2.0, -0.0, 0.5, f32::MIN_POSITIVE, -3.5];
        let idx: Vec<f32> = (0..p.len()).map(|i| i as f32).collect();
        let mut w = SampleWindow::new(false);
        // Labels 0.5 (soft) force the indexed path; the weights carry the arrival index.
        w.push(None, &p, &[0.5; 8], Some(&idx), None);
        let mut order = Vec::new();
        w.sweep(false, |v| order.push(v.weight));
        // 2.0, 0.5 (#0), 0.5 (#5), MIN_POSITIVE, 0.0 (#2), -0.0 (#4, tied with 0.0), -1.0, -3.5.
        assert_eq!(order, vec![3.0, 0.0, 5.0, 6.0, 2.0, 4.0, 1.0, 7.0]);
        // The packed path (hard labels) visits the same order with the same labels and weights.
        let labels = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0];
        let mut hard = SampleWindow::new(false);
        hard.push(None, &p, &labels, Some(&idx), None);
        let mut visits = Vec::new();
        hard.sweep(false, |v| visits.push((v.weight, v.label)));
        let want: Vec<(f32, f32)> = order.iter().map(|&i| (i, labels[i as usize])).collect();
        assert_eq!(visits, want);
    }

    #[test]
    fn soft_labels_arriving_late_keep_the_earlier_hard_ones() {
        let mut w = SampleWindow::new(false);
        w.push(None, &[0.9, 0.1], &[1.0, 0.0], Some(&[2.0, 3.0]), None);
        w.push(None, &[0.5], &[0.25], None, None);
        let mut seen = Vec::new();
        w.sweep(false, |v| seen.push((v.label, v.weight)));
        assert_eq!(seen, [(1.0, 2.0), (0.25, 1.0), (0.0, 3.0)]);
    }

    #[test]
    fn descending_key_inverts() {
        for x in [0.0f32, 1.0, -1.0, 0.5, f32::MIN_POSITIVE, -f32::MAX, f32::MAX, 1e-42, -3.25] {
            assert_eq!(from_descending_key(descending_key(x)).to_bits(), x.to_bits(), "{x}");
        }
        assert_eq!(from_descending_key(descending_key(-0.0)).to_bits(), 0.0f32.to_bits());
    }

    #[test]
    fn save_and_load_restore_the_window_exactly() {
        let mut w = SampleWindow::new(true);
        w.push(Some(5), &[0.1, -0.0, 0.7], &[0.0, 1.0, 1.0], Some(&[2.0, 0.5, 1.0]), Some(&[i64::MIN, -1, 7]));
        let mut state = MetricState::default();
        w.save(&mut state);
        assert_eq!(SampleWindow::load(&state, true, Some(5)).unwrap(), w);
        w.push(Some(5), &[0.3, 0.9], &[0.25, 1.0], None, Some(&[i64::MAX, 1 << 40]));
        let mut state = MetricState::default();
        w.save(&mut state);
        assert_eq!(SampleWindow::load(&state, true, Some(5)).unwrap(), w);
        let e = SampleWindow::load(&state, true, Some(4)).unwrap_err().to_string();
        assert!(e.contains("holds 5 samples but the window keeps at most 4"), "{e}");
        let mut short = state.clone();
        short.arrays[1].1.pop();
        assert!(SampleWindow::load(&short, true, None).unwrap_err().to_string().contains("labels has 4 values"));
        let mut bad_group = state.clone();
        bad_group.arrays.iter_mut().find(|(n, _)| n == "groups_lo").unwrap().1[0] = -1.0;
        assert!(SampleWindow::load(&bad_group, true, None).is_err());
        let mut bad_label = state;
        bad_label.arrays[1].1[0] = 2.0;
        assert!(SampleWindow::load(&bad_label, true, None).unwrap_err().to_string().contains("out of range"));
    }

    #[test]
    fn window_keeps_the_latest_samples_and_groups() {
        let mut w = SampleWindow::new(true);
        w.push(Some(3), &[0.1, 0.2], &[0.0, 1.0], None, Some(&[7, 8]));
        w.push(Some(3), &[0.3, 0.4], &[1.0, 0.0], Some(&[2.0, 3.0]), Some(&[9, 10]));
        assert_eq!(w.len(), 3);
        assert_eq!((0..3).map(|i| w.group(i)).collect::<Vec<_>>(), [8, 9, 10]);
        let mut seen = Vec::new();
        w.sweep(true, |v| seen.push((v.index, v.label, v.weight)));
        assert_eq!(seen, [(2, 0.0, 3.0), (1, 1.0, 2.0), (0, 1.0, 1.0)]);
        w.push(Some(2), &[0.9, 0.8, 0.7], &[1.0; 3], None, Some(&[1, 2, 3]));
        assert_eq!((w.len(), w.group(0), w.group(1)), (2, 2, 3));
        w.clear();
        assert_eq!(w.len(), 0);
    }
}
