//! Table-batched embedding storage and kernels: the tables of one group (same precision,
//! optimizer and pooling) share one weight buffer and one optimizer-state buffer.
//!
//! Forward gathers rows with software prefetch a few ids ahead. Backward lists each id
//! occurrence as (row, gradient source, scale), radix-sorts the list by row (stable, so the
//! summation order, hence the result, does not depend on threads), and hands contiguous row
//! ranges to threads: each unique row's gradient is summed once and the optimizer runs once
//! per unique row, writing only rows present in the batch.

use rayon::prelude::*;

use crate::optim::Step;
use crate::precision::{RowRng, Weight, store_row};
use crate::storage::{HugeBuf, Pod};
use crate::{EmbeddingError, SparseOptimizerConfig};

/// One id occurrence in the backward: the (table-local) row it reads, where its upstream
/// gradient starts in the gradient buffer, and the factor on that gradient (per-id weight
/// times 1/L for mean pooling).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Occ {
    pub row: u32,
    pub src: u32,
    pub scale: f32,
}

/// Placement of one table in its group's buffers.
#[derive(Clone, Debug)]
pub(crate) struct Slot {
    pub rows: u64,
    pub dim: usize,
    /// First weight of the table in the group buffer.
    pub w_off: usize,
    /// First state value of the table in the group state buffer.
    pub s_off: usize,
    /// State values per row.
    pub spr: usize,
}

/// The bags one pooling call covers: `n` bags from `b0` of one feature (its `values` and
/// per-id `weights`), written to columns `col..` of `width`-wide output rows, mean-pooled or not.
pub(crate) struct PoolArgs<'a> {
    pub values: &'a [i64],
    pub weights: Option<&'a [f32]>,
    pub b0: usize,
    pub n: usize,
    pub width: usize,
    pub col: usize,
    pub mean: bool,
}

/// Where a table sits in a larger one (a shard): its first row there, its columns and the
/// larger table's width.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowBlock {
    /// The block's first row in the larger table.
    pub row_offset: u64,
    /// The block's columns of the larger table.
    pub cols: std::ops::Range<usize>,
    /// Columns of the larger table.
    pub full_dim: usize,
}

/// The tables of one group.
pub(crate) struct Tbe<T: Weight + Pod> {
    pub slots: Vec<Slot>,
    weights: HugeBuf<T>,
    state: HugeBuf<f32>,
    pub optimizer: SparseOptimizerConfig,
    stochastic: bool,
    seed: u64,
    /// Updates applied so far (FBGEMM's `iter`).
    pub iter: u64,
    /// The factor on the optimizer's `lr` of the next updates (a learning-rate schedule's).
    pub lr_multiplier: f64,
}

/// Issues a prefetch of the cache lines of `bytes` bytes at `p` (no-op off x86-64).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p = p.cast::<i8>();
        let mut off = 0;
        while off < bytes {
            // SAFETY: SSE is part of the x86-64 baseline, and a prefetch never faults or
            // reads memory architecturally, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (p, bytes);
    }
}

/// Whether the AVX2 + FMA copies of the kernels can run (detected once). They compute the
/// same values as the baseline copies: Rust never contracts `a * b + c` into an FMA, so the
/// feature only widens the vectors.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    static HAS: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    *HAS
}

/// Ids ahead of the current one whose rows are prefetched.
/// (Measured on the W1 workload: 4 to 16 perform alike, 32 is slower.)
pub(crate) const PREFETCH: usize = 12;

/// The row an id reads: ids outside `0..rows` read row 0 (FBGEMM's bounds-check `WARNING` /
/// `IGNORE` rewrite; in `fatal` mode such a batch never reaches the kernels). Every kernel,
/// CPU or CUDA, reads rows this way.
#[inline(always)]
pub fn clamp_row(id: i64, rows: u64) -> usize {
    if (id as u64) < rows { id as usize } else { 0 }
}

impl<T: Weight + Pod> Tbe<T> {
    /// Allocates the group: `tables` as (rows, dim), weights zeroed (see [`Self::init_uniform`]).
    pub(crate) fn new(
        tables: &[(u64, usize, String)],
        optimizer: SparseOptimizerConfig,
        stochastic: bool,
        seed: u64,
    ) -> Result<Self, EmbeddingError> {
        let mut slots = Vec::with_capacity(tables.len());
        let (mut w_off, mut s_off) = (0usize, 0usize);
        for (rows, dim, name) in tables {
            let too_big =
                || EmbeddingError::Config(format!("table \"{name}\" ({rows} x {dim}) does not fit in memory"));
            if *rows > u64::from(u32::MAX) {
                return Err(EmbeddingError::Config(format!(
                    "table \"{name}\" has {rows} rows; the CPU kernels address at most {} rows per table: shard it \
                     or lower rows",
                    u32::MAX
                )));
            }
            let spr = optimizer.state_per_row(*dim);
            let n = (*rows as usize).checked_mul(*dim).ok_or_else(too_big)?;
            let ns = (*rows as usize).checked_mul(spr).ok_or_else(too_big)?;
            slots.push(Slot { rows: *rows, dim: *dim, w_off, s_off, spr });
            w_off = w_off.checked_add(n).ok_or_else(too_big)?;
            s_off = s_off.checked_add(ns).ok_or_else(too_big)?;
        }
        let weights = HugeBuf::zeroed(w_off, "embedding weights")?;
        let state = HugeBuf::zeroed(s_off, "optimizer state")?;
        Ok(Self {
            slots,
            weights,
            state,
            optimizer,
            stochastic: stochastic && size_of::<T>() < 4,
            seed,
            iter: 0,
            lr_multiplier: 1.0,
        })
    }

    /// The group's stochastic-rounding seed, when it rounds stochastically.
    pub(crate) fn rounding_seed(&self) -> Option<u64> {
        self.stochastic.then_some(self.seed)
    }

    /// Fills table `t` uniform in `±bound`, deterministically from `key` (in parallel over
    /// blocks of rows, each with its own seeded generator).
    pub(crate) fn init_uniform(&mut self, t: usize, bound: f32, key: u64) {
        let Slot { rows, dim, w_off, .. } = self.slots[t];
        let w = &mut self.weights.as_mut_slice()[w_off..w_off + rows as usize * dim];
        w.par_chunks_mut(INIT_BLOCK_ROWS * dim).enumerate().for_each(|(block, chunk)| {
            let mut rng = init_rng(key, block);
            for x in chunk.iter_mut() {
                *x = T::from_f32(init_value(&mut rng, bound));
            }
        });
    }

    /// Replaces rows `rows` of table `t` with `values` (fp32, `[rows.len(), dim]`, rounded to
    /// nearest), their optimizer state zero (a managed-collision slot that changed hands: see
    /// [`reset_values`]).
    pub(crate) fn reset_rows(&mut self, t: usize, rows: &[u64], values: &[f32]) {
        let Slot { dim, w_off, s_off, spr, .. } = self.slots[t];
        for (&r, v) in rows.iter().zip(values.chunks_exact(dim)) {
            let w = &mut self.weights.as_mut_slice()[w_off + r as usize * dim..][..dim];
            w.iter_mut().zip(v).for_each(|(x, &v)| *x = T::from_f32(v));
            self.state.as_mut_slice()[s_off + r as usize * spr..][..spr].fill(0.0);
        }
    }

    /// Table `t`'s weights as fp32, `[rows, dim]` row-major.
    pub(crate) fn weights_f32(&self, t: usize) -> Vec<f32> {
        let s = &self.slots[t];
        self.weights.as_slice()[s.w_off..s.w_off + s.rows as usize * s.dim].iter().map(|w| w.to_f32()).collect()
    }

    /// Table `t`'s optimizer state.
    pub(crate) fn state(&self, t: usize) -> &[f32] {
        let s = &self.slots[t];
        &self.state.as_slice()[s.s_off..s.s_off + s.rows as usize * s.spr]
    }

    /// Replaces table `t`'s weights (rounded to nearest in the storage precision).
    pub(crate) fn set_weights(&mut self, t: usize, w: &[f32]) {
        let s = self.slots[t].clone();
        let dst = &mut self.weights.as_mut_slice()[s.w_off..s.w_off + s.rows as usize * s.dim];
        dst.iter_mut().zip(w).for_each(|(d, &x)| *d = T::from_f32(x));
    }

    /// Replaces table `t`'s optimizer state.
    pub(crate) fn set_state(&mut self, t: usize, state: &[f32]) {
        let s = self.slots[t].clone();
        self.state.as_mut_slice()[s.s_off..s.s_off + s.rows as usize * s.spr].copy_from_slice(state);
    }

    /// Table `t`'s weights, stored precision.
    #[inline]
    pub(crate) fn table(&self, t: usize) -> &[T] {
        let s = &self.slots[t];
        &self.weights.as_slice()[s.w_off..s.w_off + s.rows as usize * s.dim]
    }

    /// Row `r` of table `t`: its weights and optimizer state.
    pub(crate) fn row(&self, t: usize, r: usize) -> (&[T], &[f32]) {
        let s = &self.slots[t];
        (
            &self.weights.as_slice()[s.w_off + r * s.dim..][..s.dim],
            &self.state.as_slice()[s.s_off + r * s.spr..][..s.spr],
        )
    }

    /// Row `r` of table `t`, writable.
    pub(crate) fn row_mut(&mut self, t: usize, r: usize) -> (&mut [T], &mut [f32]) {
        let s = &self.slots[t];
        let (w_off, s_off, dim, spr) = (s.w_off + r * s.dim, s.s_off + r * s.spr, s.dim, s.spr);
        (&mut self.weights.as_mut_slice()[w_off..][..dim], &mut self.state.as_mut_slice()[s_off..][..spr])
    }

    /// Pools the bags `p` describes of one feature of table `t` into `out` (rows of
    /// `p.width` floats starting at bag `p.b0`), columns `p.col..p.col + dim` (overwritten).
    pub(crate) fn pool(&self, t: usize, starts: impl Fn(usize) -> usize, p: &PoolArgs, out: &mut [f32]) {
        let s = &self.slots[t];
        pool_over(self.table(t), s.rows, s.dim, starts, p, out)
    }
    /// Copies the rows of `ids` of table `t` into `out` (`ids.len() * dim` floats).
    pub(crate) fn gather(&self, t: usize, ids: &[i64], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
            return unsafe { self.gather_avx2(t, ids, out) };
        }
        self.gather_impl(t, ids, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn gather_avx2(&self, t: usize, ids: &[i64], out: &mut [f32]) {
        self.gather_impl(t, ids, out)
    }

    #[inline(always)]
    fn gather_impl(&self, t: usize, ids: &[i64], out: &mut [f32]) {
        let Slot { rows, dim, .. } = self.slots[t];
        let table = self.table(t);
        for (i, (dst, &id)) in out.chunks_exact_mut(dim).zip(ids).enumerate() {
            if let Some(&ahead) = ids.get(i + PREFETCH) {
                prefetch(table.as_ptr().wrapping_add(clamp_row(ahead, rows) * dim), dim * size_of::<T>());
            }
            let r = clamp_row(id, rows);
            dst.iter_mut().zip(&table[r * dim..][..dim]).for_each(|(d, s)| *d = s.to_f32());
        }
    }

    /// One optimizer step: `occ[t]` lists table `t`'s id occurrences (sorted here, `tmp[t]`
    /// is scratch), `grad` the buffer their `src` offsets index.
    pub(crate) fn update(&mut self, occ: &mut [Vec<Occ>], tmp: &mut [Vec<Occ>], grad: &[f32], threads: usize) {
        self.iter += 1;
        let step = Step::new(&self.optimizer, self.iter).with_lr_multiplier(self.optimizer.lr(), self.lr_multiplier);
        let slots = &self.slots;
        if threads <= 1 {
            occ.iter_mut()
                .zip(tmp.iter_mut())
                .zip(slots.iter())
                .for_each(|((o, t), s)| radix_sort_by_row(o, t, s.rows));
        } else {
            occ.par_iter_mut().zip(tmp.par_iter_mut()).zip(slots.par_iter()).for_each(|((o, t), s)| {
                radix_sort_by_row(o, t, s.rows);
            });
        }

        // Split both buffers into per-table parts, then each table into jobs over
        // contiguous row ranges, cut only where the row changes.
        let mut jobs = Vec::new();
        let mut w_rest = self.weights.as_mut_slice();
        let mut s_rest = self.state.as_mut_slice();
        let mut w_pos = 0;
        let mut s_pos = 0;
        for (t, (slot, list)) in slots.iter().zip(occ.iter()).enumerate() {
            let (_, w) = std::mem::take(&mut w_rest).split_at_mut(slot.w_off - w_pos);
            let (mut w_table, rest) = w.split_at_mut(slot.rows as usize * slot.dim);
            w_rest = rest;
            w_pos = slot.w_off + slot.rows as usize * slot.dim;
            let (_, s) = std::mem::take(&mut s_rest).split_at_mut(slot.s_off - s_pos);
            let (mut s_table, rest) = s.split_at_mut(slot.rows as usize * slot.spr);
            s_rest = rest;
            s_pos = slot.s_off + slot.rows as usize * slot.spr;

            let target = (list.len() / (threads.max(1) * 4)).max(2048);
            let mut start = 0;
            let mut row_base = 0usize;
            while start < list.len() {
                let mut end = (start + target).min(list.len());
                while end < list.len() && list[end].row == list[end - 1].row {
                    end += 1;
                }
                let first = list[start].row as usize;
                let last = list[end - 1].row as usize;
                let (_, w) = std::mem::take(&mut w_table).split_at_mut((first - row_base) * slot.dim);
                let (w_job, w_after) = w.split_at_mut((last + 1 - first) * slot.dim);
                w_table = w_after;
                let (_, s) = std::mem::take(&mut s_table).split_at_mut((first - row_base) * slot.spr);
                let (s_job, s_after) = s.split_at_mut((last + 1 - first) * slot.spr);
                s_table = s_after;
                row_base = last + 1;
                jobs.push(Job {
                    table: t,
                    occ: &list[start..end],
                    w: w_job,
                    s: s_job,
                    first,
                    dim: slot.dim,
                    spr: slot.spr,
                });
                start = end;
            }
        }
        let rng_key = self.stochastic.then(|| crate::precision::rounding_key(self.seed, self.iter));
        if threads <= 1 {
            jobs.into_iter().for_each(|job| job.run(&step, grad, rng_key));
        } else {
            jobs.into_par_iter().for_each(|job| job.run(&step, grad, rng_key));
        }
    }
}

/// Pools bags over `table` (`rows x dim`, stored precision): [`Tbe::pool`] over any row
/// buffer, e.g. the rows a cached table staged for a batch.
pub(crate) fn pool_over<T: Weight>(
    table: &[T],
    rows: u64,
    dim: usize,
    starts: impl Fn(usize) -> usize,
    p: &PoolArgs,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
        return unsafe { pool_avx2(table, rows, dim, &starts, p, out) };
    }
    pool_impl(table, rows, dim, &starts, p, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn pool_avx2<T: Weight>(
    table: &[T],
    rows: u64,
    dim: usize,
    starts: &impl Fn(usize) -> usize,
    p: &PoolArgs,
    out: &mut [f32],
) {
    pool_impl(table, rows, dim, starts, p, out)
}

#[inline(always)]
fn pool_impl<T: Weight>(
    table: &[T],
    rows: u64,
    dim: usize,
    starts: &impl Fn(usize) -> usize,
    p: &PoolArgs,
    out: &mut [f32],
) {
    // Common dims get a copy whose accumulator lives in registers for the whole bag.
    match dim {
        4 => pool_fixed::<T, 4>(table, rows, starts, p, out),
        8 => pool_fixed::<T, 8>(table, rows, starts, p, out),
        16 => pool_fixed::<T, 16>(table, rows, starts, p, out),
        32 => pool_fixed::<T, 32>(table, rows, starts, p, out),
        64 => pool_fixed::<T, 64>(table, rows, starts, p, out),
        128 => pool_fixed::<T, 128>(table, rows, starts, p, out),
        _ => pool_any(table, rows, dim, starts, p, out),
    }
}

#[inline(always)]
fn pool_fixed<T: Weight, const D: usize>(
    table: &[T],
    rows: u64,
    starts: &impl Fn(usize) -> usize,
    p: &PoolArgs,
    out: &mut [f32],
) {
    let end = starts(p.b0 + p.n);
    let mut pos = starts(p.b0);
    for local in 0..p.n {
        let stop = starts(p.b0 + local + 1);
        let len = stop - pos;
        let mut acc = [0f32; D];
        while pos < stop {
            if pos + PREFETCH < end {
                let r = clamp_row(p.values[pos + PREFETCH], rows);
                prefetch(table.as_ptr().wrapping_add(r * D), D * size_of::<T>());
            }
            let r = clamp_row(p.values[pos], rows);
            let src: &[T; D] = table[r * D..][..D].try_into().expect("a row has D weights");
            match p.weights {
                None => (0..D).for_each(|d| acc[d] += src[d].to_f32()),
                Some(wt) => {
                    let a = wt[pos];
                    (0..D).for_each(|d| acc[d] += a * src[d].to_f32());
                }
            }
            pos += 1;
        }
        if p.mean && len > 0 {
            let inv = 1.0 / len as f32;
            acc.iter_mut().for_each(|x| *x *= inv);
        }
        out[local * p.width + p.col..][..D].copy_from_slice(&acc);
    }
}

#[inline(always)]
fn pool_any<T: Weight>(
    table: &[T],
    rows: u64,
    dim: usize,
    starts: &impl Fn(usize) -> usize,
    p: &PoolArgs,
    out: &mut [f32],
) {
    let row_bytes = dim * size_of::<T>();
    let end = starts(p.b0 + p.n);
    let mut pos = starts(p.b0);
    for local in 0..p.n {
        let stop = starts(p.b0 + local + 1);
        let dst = &mut out[local * p.width + p.col..][..dim];
        dst.fill(0.0);
        let len = stop - pos;
        while pos < stop {
            if pos + PREFETCH < end {
                let r = clamp_row(p.values[pos + PREFETCH], rows);
                prefetch(table.as_ptr().wrapping_add(r * dim), row_bytes);
            }
            let r = clamp_row(p.values[pos], rows);
            let src = &table[r * dim..][..dim];
            match p.weights {
                None => dst.iter_mut().zip(src).for_each(|(d, s)| *d += s.to_f32()),
                Some(wt) => {
                    let a = wt[pos];
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d += a * s.to_f32());
                }
            }
            pos += 1;
        }
        if p.mean && len > 0 {
            let inv = 1.0 / len as f32;
            dst.iter_mut().for_each(|d| *d *= inv);
        }
    }
}

/// A contiguous row range of one table and the (sorted) occurrences that touch it.
struct Job<'a, T> {
    table: usize,
    occ: &'a [Occ],
    w: &'a mut [T],
    s: &'a mut [f32],
    first: usize,
    dim: usize,
    spr: usize,
}

impl<T: Weight + Pod> Job<'_, T> {
    fn run(self, step: &Step, grad: &[f32], rng_key: Option<u64>) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
            return unsafe { self.run_avx2(step, grad, rng_key) };
        }
        self.run_impl(step, grad, rng_key)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_avx2(self, step: &Step, grad: &[f32], rng_key: Option<u64>) {
        self.run_impl(step, grad, rng_key)
    }

    #[inline(always)]
    fn run_impl(self, step: &Step, grad: &[f32], rng_key: Option<u64>) {
        let Job { table, occ, w, s, first, dim, spr } = self;
        let mut g = vec![0f32; dim];
        let mut wf = vec![0f32; dim];
        let row_bytes = dim * size_of::<T>();
        let mut i = 0;
        while i < occ.len() {
            let row = occ[i].row;
            let local = row as usize - first;
            g.iter_mut().for_each(|x| *x = 0.0);
            while i < occ.len() && occ[i].row == row {
                if let Some(ahead) = occ.get(i + PREFETCH) {
                    let l = ahead.row as usize - first;
                    prefetch(w.as_ptr().wrapping_add(l * dim), row_bytes);
                    prefetch(grad.as_ptr().wrapping_add(ahead.src as usize), dim * 4);
                    if spr > 0 {
                        prefetch(s.as_ptr().wrapping_add(l * spr), spr * 4);
                    }
                }
                let o = occ[i];
                let src = &grad[o.src as usize..][..dim];
                if o.scale == 1.0 {
                    g.iter_mut().zip(src).for_each(|(g, &x)| *g += x);
                } else {
                    g.iter_mut().zip(src).for_each(|(g, &x)| *g += o.scale * x);
                }
                i += 1;
            }
            let w_row = &mut w[local * dim..][..dim];
            let s_row = &mut s[local * spr..][..spr];
            match T::as_f32_mut(w_row) {
                Some(w32) => step.apply(w32, s_row, &mut g),
                None => {
                    wf.iter_mut().zip(w_row.iter()).for_each(|(f, w)| *f = w.to_f32());
                    step.apply(&mut wf, s_row, &mut g);
                    let mut rng = rng_key.map(|k| RowRng::new(k ^ ((table as u64) << 40) ^ row as u64));
                    store_row(w_row, &wf, rng.as_mut());
                }
            }
        }
    }
}

/// Stable LSD radix sort of `v` by row (11-bit digits; `rows` bounds the keys).
pub(crate) fn radix_sort_by_row(v: &mut Vec<Occ>, tmp: &mut Vec<Occ>, rows: u64) {
    if v.len() < 256 {
        v.sort_by_key(|o| o.row);
        return;
    }
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    let key_bits = 64 - rows.saturating_sub(1).leading_zeros();
    let passes = key_bits.div_ceil(BITS).max(1);
    tmp.clear();
    tmp.resize(v.len(), Occ::default());
    let mut counts = vec![0usize; BUCKETS];
    for pass in 0..passes {
        let shift = pass * BITS;
        counts.iter_mut().for_each(|c| *c = 0);
        for o in v.iter() {
            counts[((o.row >> shift) as usize) & (BUCKETS - 1)] += 1;
        }
        let mut sum = 0;
        for c in counts.iter_mut() {
            let n = *c;
            *c = sum;
            sum += n;
        }
        for o in v.iter() {
            let b = ((o.row >> shift) as usize) & (BUCKETS - 1);
            tmp[counts[b]] = *o;
            counts[b] += 1;
        }
        std::mem::swap(v, tmp);
    }
}

/// Rows per independently seeded block of a table's initial weights.
const INIT_BLOCK_ROWS: usize = 1 << 14;

fn init_rng(key: u64, block: usize) -> RowRng {
    RowRng::new(key ^ (block as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The values managed collisions give rows `rows` of a block `block` of a table of
/// `table_rows` rows when their slots change hands (what
/// [`EmbeddingBagCollection::reset_block_rows`](crate::EmbeddingBagCollection::reset_block_rows)
/// writes): each row of the larger table drawn uniform in `±1/sqrt(table_rows)` from `key` and
/// its index there, the block's columns kept. fp32, `[rows.len(), block.cols.len()]`
/// row-major; other engines (the CUDA one) reset their rows to these.
pub fn reset_values(key: u64, table_rows: u64, block: &RowBlock, rows: &[u64]) -> Vec<f32> {
    let bound = (1.0 / table_rows as f64).sqrt() as f32;
    let mut full = vec![0f32; block.full_dim];
    let mut out = Vec::with_capacity(rows.len() * block.cols.len());
    for &r in rows {
        let mut rng = init_rng(key, (r + block.row_offset) as usize);
        full.iter_mut().for_each(|x| *x = init_value(&mut rng, bound));
        out.extend_from_slice(&full[block.cols.clone()]);
    }
    out
}

/// 24 random bits: uniform on a grid of 2^24 points in `[-bound, bound]`.
#[inline]
fn init_value(rng: &mut RowRng, bound: f32) -> f32 {
    let u = (rng.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32);
    bound * (2.0 * u - 1.0)
}

/// The initial fp32 values of the cells `rows x cols` of a table filled by
/// [`Tbe::init_uniform`] with `bound` and `key`, computed without the rest of the table
/// (only the seeded blocks the rows fall in are drawn): row-major `[rows, cols]`.
pub(crate) fn init_uniform_block(
    key: u64,
    bound: f32,
    dim: usize,
    rows: std::ops::Range<u64>,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let mut out = Vec::with_capacity((rows.end - rows.start) as usize * cols.len());
    let mut r = rows.start as usize;
    while r < rows.end as usize {
        let block = r / INIT_BLOCK_ROWS;
        let mut rng = init_rng(key, block);
        rng.skip(((r - block * INIT_BLOCK_ROWS) * dim) as u64);
        let end = ((block + 1) * INIT_BLOCK_ROWS).min(rows.end as usize);
        for _ in r..end {
            for c in 0..dim {
                let v = init_value(&mut rng, bound);
                if cols.contains(&c) {
                    out.push(v);
                }
            }
        }
        r = end;
    }
    out
}
