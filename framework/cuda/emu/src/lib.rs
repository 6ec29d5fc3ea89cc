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
pub unsafe fn copy_rows(
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

/// `trainrec_pool_*` with every pointer as an address (as a GPU launch passes them).
///
/// # Safety
/// The addresses are of live host buffers: `table` of `rows * dim` weights of `precision`,
/// `offsets` (n + 1) indexing `values` (and `weights` unless 0), `out` of n rows of `width`
/// floats with `col + dim <= width`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn pool(
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
/// `table` must hold `rows * dim` weights of `precision`, `ids` n ids, `out` n rows of `dim`
/// floats.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gather(grid: u32, precision: Precision, table: u64, rows: i64, dim: i32, ids: u64, n: i64, out: u64) {
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
/// `table` and `state` must hold the weights of `precision` and the state (`spr` floats per
/// row) of every row in `rows` (`uniques` of them, `seg` their `uniques + 1` segment starts
/// into `src` / `scale`), every `src + dim` must lie in `grad`, and `args` must point to the
/// kernels' `StepArgs`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn update(
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
