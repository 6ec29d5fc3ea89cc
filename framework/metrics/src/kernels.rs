//! Vectorisable inner loops of the metrics: batch validation and the NE sums.
//!
//! Written as branch-free loops over fixed-width lanes so the compiler vectorises them; on
//! x86-64 the same code is also compiled for AVX2 + FMA and picked at run time.

use std::sync::LazyLock;

/// The clamp TorchRec applies to predictions, the mean label and denominators (`eta`).
pub const NE_ETA: f64 = 1e-12;

const LANES: usize = 8;

#[cfg(target_arch = "x86_64")]
pub(crate) static AVX2: LazyLock<bool> =
    LazyLock::new(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));

/// `log2(x)` for a positive normal `x`, branch-free, within a few ulps of `f64::log2`.
///
/// `x = 2^e * m` with `m` in `[sqrt(1/2), sqrt(2))`; `ln m = 2 atanh(s)`, `s = (m - 1) / (m + 1)`,
/// `|s| <= 0.1716`, by its odd series to `s^21` (truncation below `1e-17` relative).
#[inline(always)]
pub(crate) fn log2(x: f64) -> f64 {
    const MANTISSA: u64 = 0x000f_ffff_ffff_ffff;
    let bits = x.to_bits();
    let m = f64::from_bits((bits & MANTISSA) | 0x3ff0_0000_0000_0000); // [1, 2)
    // The biased exponent as a float without an int -> float conversion (2^52 + e - 2^52).
    let biased = f64::from_bits(0x4330_0000_0000_0000 | (bits >> 52)) - 4_503_599_627_370_496.0;
    let big = m > std::f64::consts::SQRT_2;
    let m = if big { m * 0.5 } else { m };
    let e = biased - 1023.0 + if big { 1.0 } else { 0.0 };
    let s = (m - 1.0) / (m + 1.0);
    let z = s * s;
    // Σ z^k / (2k + 1), k = 0..=10, by Horner.
    let mut poly = 1.0 / 21.0;
    for k in (0..10).rev() {
        poly = poly * z + 1.0 / (2 * k + 1) as f64;
    }
    e + 2.0 * std::f64::consts::LOG2_E * s * poly
}

/// Whether every value of a batch is acceptable (finite predictions; finite labels in `[0, 1]`;
/// finite, non-negative weights). The slow path that
/// names the first bad value is `validate_batch`'s.
pub(crate) fn batch_is_clean(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> bool {
    #[cfg(target_arch = "x86_64")]
    if *AVX2 {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { batch_is_clean_avx2(predictions, labels, weights) };
    }
    batch_is_clean_body(predictions, labels, weights)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn batch_is_clean_avx2(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> bool {
    batch_is_clean_body(predictions, labels, weights)
}

#[inline(always)]
fn batch_is_clean_body(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> bool {
    // Comparisons with NaN are false, so NaN labels and weights fail the range checks too.
    let mut ok = true;
    for &p in predictions {
        ok &= p.is_finite();
    }
    for &y in labels {
        ok &= (0.0..=1.0).contains(&y);
    }
    if let Some(w) = weights {
        for &x in w {
            ok &= x.is_finite() && x >= 0.0;
        }
    }
    ok
}

/// Whether every label is exactly 0 or 1.
pub(crate) fn all_hard(labels: &[f32]) -> bool {
    labels.iter().fold(true, |hard, &y| hard & (y == 0.0 || y == 1.0))
}

/// The NE sums of a validated batch: `[Σ ce, Σ w, Σ w y, Σ w (1 - y)]`, with `ce` the
/// clamped base-2 cross entropy of the NE metric. `hard` (every label 0 or 1) takes one
/// logarithm per sample instead of two.
pub(crate) fn ne_sums(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>, hard: bool) -> [f64; 4] {
    #[cfg(target_arch = "x86_64")]
    if *AVX2 {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { ne_sums_avx2(predictions, labels, weights, hard) };
    }
    ne_sums_body(predictions, labels, weights, hard)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn ne_sums_avx2(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>, hard: bool) -> [f64; 4] {
    ne_sums_body(predictions, labels, weights, hard)
}

#[inline(always)]
fn ne_sums_body(predictions: &[f32], labels: &[f32], weights: Option<&[f32]>, hard: bool) -> [f64; 4] {
    // Weights that are all exactly 1 change nothing in the sums: the batch counts as unweighted.
    let weights = weights.filter(|w| !w.iter().fold(true, |one, &x| one & (x == 1.0)));
    match (weights, hard) {
        (None, true) => ne_sums_unweighted_hard(predictions, labels),
        (None, false) => ne_sums_lanes::<false, false>(predictions, labels, &[]),
        (Some(w), true) => ne_sums_lanes::<true, true>(predictions, labels, w),
        (Some(w), false) => ne_sums_lanes::<false, true>(predictions, labels, w),
    }
}

/// The prediction clamped to `[eta, 1 - eta]`, in `f64` (TorchRec's `clamp_` of the doubles).
#[inline(always)]
fn clamped(p: f32) -> f64 {
    f64::from(p).clamp(NE_ETA, 1.0 - NE_ETA)
}

/// The clamped probability a hard label `y` (0 or 1) was given: `q` or `1 - q`, exactly
/// (`y q + (1 - y)(1 - q)` without a branch). Its `-log2` is the sample's cross entropy.
#[inline(always)]
fn hard_likelihood(q: f64, y: f64) -> f64 {
    y * q + (1.0 - y) * (1.0 - q)
}

/// One sample's terms `[ce, w, w y, w (1 - y)]`.
#[inline(always)]
fn ne_terms<const HARD: bool>(p: f32, y: f32, w: f32) -> [f64; 4] {
    let (q, y, w) = (clamped(p), f64::from(y), f64::from(w));
    let ce = if HARD { -w * log2(hard_likelihood(q, y)) } else { -w * y * log2(q) - w * (1.0 - y) * log2(1.0 - q) };
    [ce, w, w * y, w * (1.0 - y)]
}

/// Samples whose cross entropies one logarithm takes, per lane, in
/// [`ne_sums_unweighted_hard`]: a product of up to `PRODUCT + LANES - 1` clamped predictions
/// stays above `1e-12^23 = 1e-276`, a normal `f64`.
const PRODUCT: usize = 16;

/// [`ne_sums`] of unweighted hard labels. Each sample's cross entropy is `-log2(x)` with `x`
/// the clamped prediction or its complement, so a lane multiplies [`PRODUCT`] of them and takes
/// one logarithm of the product: `log2(x_1 ... x_k) = log2(x_1) + ... + log2(x_k)`. The product's
/// rounding (at most `k` half-ulps, relative) moves the sum by under `k * 1.6e-16` bits, what
/// adding `k` rounded logarithms costs.
#[inline(always)]
fn ne_sums_unweighted_hard(p: &[f32], y: &[f32]) -> [f64; 4] {
    let (mut ce, mut pos, mut prod) = ([0.0f64; LANES], [0.0f64; LANES], [1.0f64; LANES]);
    let (pc, yc) = (p.chunks_exact(LANES), y.chunks_exact(LANES));
    let (p_tail, y_tail) = (pc.remainder(), yc.remainder());
    for (c, (pc, yc)) in pc.zip(yc).enumerate() {
        let pc: &[f32; LANES] = pc.try_into().expect("chunks_exact");
        let yc: &[f32; LANES] = yc.try_into().expect("chunks_exact");
        for l in 0..LANES {
            let y = f64::from(yc[l]);
            prod[l] *= hard_likelihood(clamped(pc[l]), y);
            pos[l] += y;
        }
        if c % PRODUCT == PRODUCT - 1 {
            for l in 0..LANES {
                ce[l] -= log2(prod[l]);
                prod[l] = 1.0;
            }
        }
    }
    for (&p, &y) in p_tail.iter().zip(y_tail) {
        let y = f64::from(y);
        prod[0] *= hard_likelihood(clamped(p), y);
        pos[0] += y;
    }
    for l in 0..LANES {
        ce[l] -= log2(prod[l]);
    }
    let (n, pos) = (p.len() as f64, pos.iter().sum::<f64>());
    [ce.iter().sum(), n, pos, n - pos]
}

#[inline(always)]
fn ne_sums_lanes<const HARD: bool, const WEIGHTED: bool>(p: &[f32], y: &[f32], w: &[f32]) -> [f64; 4] {
    let mut acc = [[0.0f64; LANES]; 4];
    let (pc, yc) = (p.chunks_exact(LANES), y.chunks_exact(LANES));
    let (p_tail, y_tail) = (pc.remainder(), yc.remainder());
    let full = p.len() - p_tail.len();
    for (c, (pc, yc)) in pc.zip(yc).enumerate() {
        let pc: &[f32; LANES] = pc.try_into().expect("chunks_exact");
        let yc: &[f32; LANES] = yc.try_into().expect("chunks_exact");
        let wc: [f32; LANES] =
            if WEIGHTED { w[c * LANES..(c + 1) * LANES].try_into().expect("chunk") } else { [1.0; LANES] };
        for l in 0..LANES {
            let t = ne_terms::<HARD>(pc[l], yc[l], wc[l]);
            for k in 0..4 {
                acc[k][l] += t[k];
            }
        }
    }
    for i in 0..p_tail.len() {
        let t = ne_terms::<HARD>(p_tail[i], y_tail[i], if WEIGHTED { w[full + i] } else { 1.0 });
        for k in 0..4 {
            acc[k][0] += t[k];
        }
    }
    acc.map(|a| a.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sample's weighted cross entropy in bits, `-w y log2(q) - w (1 - y) log2(1 - q)` with
    /// `q` the prediction clamped to `[eta, 1 - eta]`. A hard label zeroes one term, whose
    /// logarithm is then skipped (same value, half the work).
    ///
    /// The scalar reference the vectorised loop is checked against.
    fn cross_entropy(p: f64, y: f64, w: f64) -> f64 {
        let q = p.clamp(NE_ETA, 1.0 - NE_ETA);
        if y == 1.0 {
            -w * q.log2()
        } else if y == 0.0 {
            -w * (1.0 - q).log2()
        } else {
            -w * y * q.log2() - w * (1.0 - y) * (1.0 - q).log2()
        }
    }

    #[test]
    fn log2_matches_std_within_a_few_ulps() {
        let mut x = 1e-12f64;
        while x <= 1.0 {
            for v in [x, x * 1.000_000_1, 1.0 - x] {
                let (got, want) = (log2(v), v.log2());
                assert!(
                    (got - want).abs() <= 4.0 * f64::EPSILON * want.abs().max(1.0),
                    "log2({v}) = {got}, want {want}"
                );
            }
            x *= 1.37;
        }
        assert_eq!(log2(1.0), 0.0);
        assert_eq!(log2(0.5), -1.0);
        assert_eq!(log2(0.25), -2.0);
    }

    #[test]
    fn ne_sums_match_the_scalar_definition() {
        let n = 10_003; // not a multiple of the lanes
        // Predictions over [0, 1] (0 and 1 clamped), and a long run at 0 (every product of
        // the unweighted path at its smallest).
        let p: Vec<f32> =
            (0..n).map(|i| if (5000..5400).contains(&i) { 0.0 } else { ((i * 7919) % 1000) as f32 / 999.0 }).collect();
        let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 5) as f32).collect();
        let ones = vec![1.0f32; n];
        for hard in [true, false] {
            let y: Vec<f32> =
                (0..n)
                    .map(|i| {
                        if hard {
                            ((i % 3 == 0) != (5000..5400).contains(&i)) as u8 as f32
                        } else {
                            (i % 4) as f32 / 3.0
                        }
                    })
                    .collect();
            for weights in [None, Some(&w[..]), Some(&ones[..])] {
                let got = ne_sums(&p, &y, weights, hard);
                let mut want = [0.0f64; 4];
                for i in 0..n {
                    let wi = weights.map_or(1.0, |w| f64::from(w[i]));
                    let (pi, yi) = (f64::from(p[i]), f64::from(y[i]));
                    want[0] += cross_entropy(pi, yi, wi);
                    want[1] += wi;
                    want[2] += wi * yi;
                    want[3] += wi * (1.0 - yi);
                }
                for k in 0..4 {
                    assert!(
                        (got[k] - want[k]).abs() <= 1e-12 * want[k].abs().max(1.0),
                        "sum {k}: {} vs {}",
                        got[k],
                        want[k]
                    );
                }
            }
        }
    }

    #[test]
    fn cleanliness_flags() {
        assert!(batch_is_clean(&[0.5, 2.0], &[1.0, 0.0], None));
        assert!(batch_is_clean(&[0.5, 2.0], &[1.0, 0.5], Some(&[0.0, 3.0])));
        assert!(all_hard(&[1.0, 0.0]) && !all_hard(&[1.0, 0.5]));
        assert!(!batch_is_clean(&[f32::NAN], &[1.0], None));
        assert!(!batch_is_clean(&[f32::INFINITY], &[1.0], None));
        assert!(!batch_is_clean(&[0.5], &[1.5], None));
        assert!(!batch_is_clean(&[0.5], &[f32::NAN], None));
        assert!(!batch_is_clean(&[0.5], &[1.0], Some(&[-1.0])));
        assert!(!batch_is_clean(&[0.5], &[1.0], Some(&[f32::INFINITY])));
    }
}
