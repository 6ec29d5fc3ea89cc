//! The CUDA embedding kernels (`framework/cuda/kernels/embedding.cu`) compiled as host C++:
//! each launch runs its blocks one after another, each block as one OS thread per CUDA
//! thread meeting at `__syncwarp` barriers. Slow, exact (no FMA contraction, like NVRTC's
//! `-fmad=false`), and only for tests: they check the kernels' logic against the CPU engine
//! on machines without a GPU.

use std::ffi::c_void;

/// A table's stored precision, selecting the kernel instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// `float` weights.
    F32,
    /// IEEE half weights (bit patterns).
    F16,
    /// bfloat16 weights (bit patterns).
    Bf16,
}

/// The entry points of csrc/emu.cpp for one precision, every pointer as a 64-bit address (passed
/// like a pointer on the 64-bit targets trainrec builds for).
macro_rules! entry_points {
    ($($pool:ident, $gather:ident, $update:ident;)*) => {
        unsafe extern "C" {
            $(
                fn $pool(g: u32, t: u64, r: i64, d: i32, v: u64, o: u64, w: u64, n: i64, m: i32, out: u64, width: i64, col: i64);
                fn $gather(g: u32, t: u64, r: i64, d: i32, ids: u64, n: i64, out: u64);
                fn $update(g: u32, t: u64, s: u64, d: i32, spr: i32, rows: u64, seg: u64, src: u64, scale: u64, u: i64, grad: u64, args: *const c_void);
            )*
        }
    };
}

unsafe extern "C" {
    fn emu_copy_rows(g: u32, src: u64, ss: i64, src_rows: u64, dst: u64, ds: i64, dst_rows: u64, n: i64, bytes: i64);
}

/// `trainrec_copy_rows` with addresses (a null row list: records in order).
///
/// # Safety
/// Every record read and written must lie in live host buffers.
#[allow(clippy::too_many_arguments)]
pub unsafe fn raw_copy_rows(
    grid: u32,
    src: u64,
    src_stride: i64,
    src_rows: u64,
    dst: u64,
    dst_stride: i64,
    dst_rows: u64,
    n: i64,
    bytes: i64,
) {
    // SAFETY: the caller's contract.
    unsafe { emu_copy_rows(grid, src, src_stride, src_rows, dst, dst_stride, dst_rows, n, bytes) }
}

entry_points! {
    emu_pool_f32, emu_gather_f32, emu_update_f32;
    emu_pool_f16, emu_gather_f16, emu_update_f16;
    emu_pool_bf16, emu_gather_bf16, emu_update_bf16;
}

/// `trainrec_pool_*` over `grid` blocks: pools the bags of `offsets` (absolute into
/// `values`) of a `rows x dim` table into columns `col..col + dim` of `width`-wide rows of
/// `out`.
///
/// # Safety
/// `table` must hold `rows * dim` weights of `precision`; `offsets` must index `values`
/// (and `weights`, when given); `out` must hold `(offsets.len() - 1) * width` floats with
/// `col + dim <= width`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn pool(
    grid: u32,
    precision: Precision,
    table: *const c_void,
    rows: i64,
    dim: i32,
    values: &[i64],
    offsets: &[i64],
    weights: Option<&[f32]>,
    mean: bool,
    out: &mut [f32],
    width: i64,
    col: i64,
) {
    let n = offsets.len() as i64 - 1;
    let w = weights.map_or(0, |w| w.as_ptr() as u64);
    let (v, o, out) = (values.as_ptr() as u64, offsets.as_ptr() as u64, out.as_mut_ptr() as u64);
    // SAFETY: the caller's contract.
    unsafe { raw_pool(grid, precision, table as u64, rows, dim, v, o, w, n, i32::from(mean), out, width, col) }
}

/// `trainrec_gather_*`: the rows of `ids` into `out` (`ids.len() * dim` floats).
///
/// # Safety
/// `table` must hold `rows * dim` weights of `precision`; `out` `ids.len() * dim` floats.
pub unsafe fn gather(
    grid: u32,
    precision: Precision,
    table: *const c_void,
    rows: i64,
    dim: i32,
    ids: &[i64],
    out: &mut [f32],
) {
    let (i, n, o) = (ids.as_ptr() as u64, ids.len() as i64, out.as_mut_ptr() as u64);
    // SAFETY: the caller's contract.
    unsafe { raw_gather(grid, precision, table as u64, rows, dim, i, n, o) }
}

/// `trainrec_update_*`: the fused backward + optimizer over the unique rows `rows` with
/// segments `seg` of occurrences `src` / `scale` into `grad`.
///
/// # Safety
/// `table` must hold the table's weights of `precision` and `state` its optimizer state
/// (`spr` floats per row) for every row in `rows`; every `src + dim` must lie in `grad`;
/// `args` must point to the kernels' `StepArgs`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn update(
    grid: u32,
    precision: Precision,
    table: *mut c_void,
    state: *mut f32,
    dim: i32,
    spr: i32,
    rows: &[i64],
    seg: &[u32],
    src: &[u32],
    scale: &[f32],
    grad: &[f32],
    args: *const c_void,
) {
    let a = |p: *const u8| p as u64;
    // SAFETY: the caller's contract.
    unsafe {
        raw_update(
            grid,
            precision,
            table as u64,
            state as u64,
            dim,
            spr,
            a(rows.as_ptr().cast()),
            a(seg.as_ptr().cast()),
            a(src.as_ptr().cast()),
            a(scale.as_ptr().cast()),
            rows.len() as i64,
            a(grad.as_ptr().cast()),
            args,
        )
    }
}

/// `trainrec_pool_*` with every pointer as an address (as a GPU launch passes them).
///
/// # Safety
/// As [`pool`]: the addresses are of live host buffers of the sizes the kernel indexes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn raw_pool(
    grid: u32,
    precision: Precision,
    table: u64,
    rows: i64,
    dim: i32,
    values: u64,
    offsets: u64,
    weights: u64,
    n: i64,
    mean: i32,
    out: u64,
    width: i64,
    col: i64,
) {
    let f = match precision {
        Precision::F32 => emu_pool_f32,
        Precision::F16 => emu_pool_f16,
        Precision::Bf16 => emu_pool_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe { f(grid, table, rows, dim, values, offsets, weights, n, mean, out, width, col) }
}

/// `trainrec_gather_*` with addresses.
///
/// # Safety
/// As [`gather`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn raw_gather(grid: u32, precision: Precision, table: u64, rows: i64, dim: i32, ids: u64, n: i64, out: u64) {
    let f = match precision {
        Precision::F32 => emu_gather_f32,
        Precision::F16 => emu_gather_f16,
        Precision::Bf16 => emu_gather_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe { f(grid, table, rows, dim, ids, n, out) }
}

/// `trainrec_update_*` with addresses.
///
/// # Safety
/// As [`update`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn raw_update(
    grid: u32,
    precision: Precision,
    table: u64,
    state: u64,
    dim: i32,
    spr: i32,
    rows: u64,
    seg: u64,
    src: u64,
    scale: u64,
    uniques: i64,
    grad: u64,
    args: *const c_void,
) {
    let f = match precision {
        Precision::F32 => emu_update_f32,
        Precision::F16 => emu_update_f16,
        Precision::Bf16 => emu_update_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe { f(grid, table, state, dim, spr, rows, seg, src, scale, uniques, grad, args) }
}
