//! Weight storage types: fp32, fp16 and bf16, with round-to-nearest-even and unbiased
//! stochastic rounding from fp32.

use half::{bf16, f16};

/// A stored weight: plain old data that converts to and from `f32`.
pub trait Weight: Copy + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    /// The stored value as `f32` (exact).
    fn to_f32(self) -> f32;
    /// `x` rounded to nearest, ties to even.
    fn from_f32(x: f32) -> Self;
    /// `x` rounded stochastically: to the representable neighbour above `|x|` with
    /// probability proportional to its closeness, so the expected stored value is `x`.
    /// `u` is a uniform 16-bit random number.
    fn from_f32_stochastic(x: f32, u: u16) -> Self;
    /// The slice itself when the storage is already fp32 (updates then run in place).
    #[inline(always)]
    fn as_f32_mut(_s: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

impl Weight for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn from_f32_stochastic(x: f32, _u: u16) -> Self {
        x
    }
    #[inline(always)]
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
}

/// A 16-bit float whose positive values are ordered like their bit patterns (true of both
/// IEEE half and bfloat16), so the neighbours of a value are one bit pattern apart.
trait Bits16: Weight {
    fn bits(self) -> u16;
    fn from_bits(bits: u16) -> Self;
}

impl Bits16 for f16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

impl Bits16 for bf16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
}

/// Stochastic rounding through the two neighbours of `x`.
#[inline]
fn stochastic<H: Bits16>(x: f32, u: u16) -> H {
    let nearest = H::from_f32(x);
    let n = nearest.to_f32();
    if n == x || !x.is_finite() {
        return nearest;
    }
    // Magnitudes grow with the bit pattern (sign bit aside): step the pattern by one to get
    // the other neighbour of |x|.
    let (lo, hi) = if n.abs() < x.abs() {
        (nearest, H::from_bits(nearest.bits() + 1))
    } else if nearest.bits() & 0x7fff == 0 {
        // |x| rounded to zero: the neighbour below is zero itself.
        (nearest, nearest)
    } else {
        (H::from_bits(nearest.bits() - 1), nearest)
    };
    let (l, h) = (lo.to_f32().abs(), hi.to_f32().abs());
    if !h.is_finite() || h == l {
        return lo;
    }
    let p = (x.abs() - l) / (h - l);
    let r = (f32::from(u) + 0.5) / 65536.0;
    if r < p { hi } else { lo }
}

/// IEEE half to single, exact for every bit pattern, branch free so that row loops vectorise
/// (the `half` crate's portable path does not, and its F16C path needs a compile-time
/// target feature). Normal and subnormal halves scale exactly by 2^112 after the bit shift;
/// infinities and NaNs get the all-ones exponent.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let magnitude = (h & 0x7fff) << 13;
    let scaled = f32::from_bits(magnitude) * f32::from_bits(0x7780_0000); // 2^112
    let special = if h & 0x7c00 == 0x7c00 { f32::from_bits(magnitude | 0x7f80_0000) } else { scaled };
    f32::from_bits(special.to_bits() | ((h & 0x8000) << 16))
}

impl Weight for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn from_f32_stochastic(x: f32, u: u16) -> Self {
        stochastic(x, u)
    }
}

impl Weight for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn from_f32_stochastic(x: f32, u: u16) -> Self {
        stochastic(x, u)
    }
}

/// The stochastic-rounding key of update `iter` (1 for the first) of a group seeded `seed`:
/// row `r` of the group's table `t` draws from the stream keyed `key ^ (t << 40) ^ r`.
pub fn rounding_key(seed: u64, iter: u64) -> u64 {
    seed ^ iter.wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// A cheap per-row stream of 16-bit uniforms (xorshift64*, seeded by splitmix64 of the row's
/// key), so stochastic rounding is deterministic whatever the thread schedule.
pub(crate) struct RowRng(u64);

impl RowRng {
    pub(crate) fn new(key: u64) -> Self {
        let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = Self::step(self.0);
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The state transition alone (linear over GF(2) in the state's bits).
    #[inline]
    fn step(mut x: u64) -> u64 {
        x ^= x >> 12;
        x ^= x << 25;
        x ^ (x >> 27)
    }

    /// Advances the stream by `n` draws at once, in O(log n) (a cached table's row read on
    /// demand starts mid-block in a seeded stream). The transition is a 64 x 64 bit matrix;
    /// its powers of two are built once.
    pub(crate) fn skip(&mut self, n: u64) {
        type Matrix = [u64; 64];
        // Column j of a matrix: the image of bit j.
        fn apply(m: &Matrix, x: u64) -> u64 {
            let mut y = 0;
            let mut bits = x;
            while bits != 0 {
                let j = bits.trailing_zeros() as usize;
                y ^= m[j];
                bits &= bits - 1;
            }
            y
        }
        static POWERS: std::sync::OnceLock<Vec<Matrix>> = std::sync::OnceLock::new();
        let powers = POWERS.get_or_init(|| {
            let mut m: Matrix = std::array::from_fn(|j| RowRng::step(1 << j));
            let mut out = Vec::with_capacity(64);
            for _ in 0..64 {
                out.push(m);
                m = std::array::from_fn(|j| apply(&m, m[j]));
            }
            out
        });
        let mut k = n;
        while k != 0 {
            let b = k.trailing_zeros() as usize;
            self.0 = apply(&powers[b], self.0);
            k &= k - 1;
        }
    }
}

/// Writes `src` into `dst`, rounding to nearest or stochastically.
#[inline]
pub(crate) fn store_row<T: Weight>(dst: &mut [T], src: &[f32], rng: Option<&mut RowRng>) {
    match rng {
        None => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = T::from_f32(s)),
        Some(rng) => {
            for (d4, s4) in dst.chunks_mut(4).zip(src.chunks(4)) {
                let bits = rng.next_u64();
                for (i, (d, &s)) in d4.iter_mut().zip(s4).enumerate() {
                    *d = T::from_f32_stochastic(s, (bits >> (16 * i)) as u16);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipping_n_draws_lands_where_n_draws_do() {
        for key in [0u64, 7, u64::MAX] {
            let mut walked = RowRng::new(key);
            let mut done = 0u64;
            for n in [0u64, 1, 2, 63, 64, 65, 1000, 123_457, 16383 * 64] {
                while done < n {
                    walked.next_u64();
                    done += 1;
                }
                let mut jumped = RowRng::new(key);
                jumped.skip(n);
                assert_eq!(jumped.0, walked.0, "key {key}, {n} draws");
                assert_eq!(jumped.next_u64(), RowRng(walked.0).next_u64());
            }
        }
    }

    #[test]
    fn fast_f16_widening_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let (ours, theirs) = (f16_bits_to_f32(bits), f16::from_bits(bits).to_f32());
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{bits:#06x}");
        }
    }

    #[test]
    fn nearest_matches_half_crate_and_is_exact_for_fp32() {
        for x in [0.0f32, 1.0, -1.5, 2.71, 1e-7, 65504.0, 1e30] {
            assert_eq!(<f32 as Weight>::from_f32(x), x);
            assert_eq!(<f16 as Weight>::from_f32(x), f16::from_f32(x));
            assert_eq!(<bf16 as Weight>::from_f32(x), bf16::from_f32(x));
        }
    }

    fn neighbours<T: Weight>(x: f32) -> (f32, f32) {
        let mut lo = f32::INFINITY;
        let mut hi = f32::NEG_INFINITY;
        for u in (0..=u16::MAX).step_by(97) {
            let v = T::from_f32_stochastic(x, u).to_f32();
            lo = lo.min(v);
            hi = hi.max(v);
        }
        (lo, hi)
    }

    #[test]
    fn stochastic_rounding_is_unbiased_and_stays_on_the_two_neighbours() {
        // 1 + 1/3 of an fp16 ulp (2^-10) above 1: P(up) = 1/3. Exact mean over every u.
        let cases: [(f32, bool); 6] = [
            (1.0 + 2f32.powi(-10) / 3.0, true),
            (-(1.0 + 2f32.powi(-10) * 0.75), true),
            (3.0e-6, true), // fp16 subnormal range
            (1.0 + 2f32.powi(-7) * 0.2, false),
            (-0.3, false),
            (1.0e-40, false), // f32 subnormal, far below bf16's ulp there
        ];
        for (x, is_f16) in cases {
            let mean: f64 = (0..=u16::MAX)
                .map(|u| {
                    if is_f16 {
                        f64::from(<f16 as Weight>::from_f32_stochastic(x, u).to_f32())
                    } else {
                        f64::from(<bf16 as Weight>::from_f32_stochastic(x, u).to_f32())
                    }
                })
                .sum::<f64>()
                / 65536.0;
            let (lo, hi) = if is_f16 { neighbours::<f16>(x) } else { neighbours::<bf16>(x) };
            assert!(lo <= x && x <= hi, "{x}: neighbours {lo} {hi}");
            let ulp = f64::from(hi - lo);
            assert!((mean - f64::from(x)).abs() <= ulp / 65536.0 * 2.0 + 1e-45, "{x}: mean {mean}, ulp {ulp}");
        }
    }

    #[test]
    fn stochastic_rounding_of_representable_values_is_exact() {
        for u in [0, 1, 40000, u16::MAX] {
            assert_eq!(<f16 as Weight>::from_f32_stochastic(0.5, u).to_f32(), 0.5);
            assert_eq!(<bf16 as Weight>::from_f32_stochastic(-2.0, u).to_f32(), -2.0);
            assert_eq!(<f16 as Weight>::from_f32_stochastic(0.0, u).to_f32(), 0.0);
        }
    }
}
