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

type Pool = unsafe extern "C" fn(
    u32,
    *const c_void,
    i64,
    i32,
    *const i64,
    *const i64,
    *const f32,
    i64,
    i32,
    *mut f32,
    i64,
    i64,
);
type Gather = unsafe extern "C" fn(u32, *const c_void, i64, i32, *const i64, i64, *mut f32);
type Update = unsafe extern "C" fn(
    u32,
    *mut c_void,
    *mut f32,
    i32,
    i32,
    *const i64,
    *const u32,
    *const u32,
    *const f32,
    i64,
    *const f32,
    *const c_void,
);

unsafe extern "C" {
    fn emu_pool_f32(
        g: u32,
        t: *const c_void,
        r: i64,
        d: i32,
        v: *const i64,
        o: *const i64,
        w: *const f32,
        n: i64,
        m: i32,
        out: *mut f32,
        width: i64,
        col: i64,
    );
    fn emu_pool_f16(
        g: u32,
        t: *const c_void,
        r: i64,
        d: i32,
        v: *const i64,
        o: *const i64,
        w: *const f32,
        n: i64,
        m: i32,
        out: *mut f32,
        width: i64,
        col: i64,
    );
    fn emu_pool_bf16(
        g: u32,
        t: *const c_void,
        r: i64,
        d: i32,
        v: *const i64,
        o: *const i64,
        w: *const f32,
        n: i64,
        m: i32,
        out: *mut f32,
        width: i64,
        col: i64,
    );
    fn emu_gather_f32(g: u32, t: *const c_void, r: i64, d: i32, ids: *const i64, n: i64, out: *mut f32);
    fn emu_gather_f16(g: u32, t: *const c_void, r: i64, d: i32, ids: *const i64, n: i64, out: *mut f32);
    fn emu_gather_bf16(g: u32, t: *const c_void, r: i64, d: i32, ids: *const i64, n: i64, out: *mut f32);
    fn emu_update_f32(
        g: u32,
        t: *mut c_void,
        s: *mut f32,
        d: i32,
        spr: i32,
        rows: *const i64,
        seg: *const u32,
        src: *const u32,
        scale: *const f32,
        u: i64,
        grad: *const f32,
        args: *const c_void,
    );
    fn emu_update_f16(
        g: u32,
        t: *mut c_void,
        s: *mut f32,
        d: i32,
        spr: i32,
        rows: *const i64,
        seg: *const u32,
        src: *const u32,
        scale: *const f32,
        u: i64,
        grad: *const f32,
        args: *const c_void,
    );
    fn emu_update_bf16(
        g: u32,
        t: *mut c_void,
        s: *mut f32,
        d: i32,
        spr: i32,
        rows: *const i64,
        seg: *const u32,
        src: *const u32,
        scale: *const f32,
        u: i64,
        grad: *const f32,
        args: *const c_void,
    );
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
    let f: Pool = match precision {
        Precision::F32 => emu_pool_f32,
        Precision::F16 => emu_pool_f16,
        Precision::Bf16 => emu_pool_bf16,
    };
    let n = offsets.len() as i64 - 1;
    let w = weights.map_or(std::ptr::null(), <[f32]>::as_ptr);
    // SAFETY: the caller's contract.
    unsafe {
        f(
            grid,
            table,
            rows,
            dim,
            values.as_ptr(),
            offsets.as_ptr(),
            w,
            n,
            i32::from(mean),
            out.as_mut_ptr(),
            width,
            col,
        )
    }
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
    let f: Gather = match precision {
        Precision::F32 => emu_gather_f32,
        Precision::F16 => emu_gather_f16,
        Precision::Bf16 => emu_gather_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe { f(grid, table, rows, dim, ids.as_ptr(), ids.len() as i64, out.as_mut_ptr()) }
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
    let f: Update = match precision {
        Precision::F32 => emu_update_f32,
        Precision::F16 => emu_update_f16,
        Precision::Bf16 => emu_update_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe {
        f(
            grid,
            table,
            state,
            dim,
            spr,
            rows.as_ptr(),
            seg.as_ptr(),
            src.as_ptr(),
            scale.as_ptr(),
            rows.len() as i64,
            grad.as_ptr(),
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
    let f: Pool = match precision {
        Precision::F32 => emu_pool_f32,
        Precision::F16 => emu_pool_f16,
        Precision::Bf16 => emu_pool_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe {
        f(
            grid,
            table as *const c_void,
            rows,
            dim,
            values as *const i64,
            offsets as *const i64,
            weights as *const f32,
            n,
            mean,
            out as *mut f32,
            width,
            col,
        )
    }
}

/// `trainrec_gather_*` with addresses.
///
/// # Safety
/// As [`gather`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn raw_gather(grid: u32, precision: Precision, table: u64, rows: i64, dim: i32, ids: u64, n: i64, out: u64) {
    let f: Gather = match precision {
        Precision::F32 => emu_gather_f32,
        Precision::F16 => emu_gather_f16,
        Precision::Bf16 => emu_gather_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe { f(grid, table as *const c_void, rows, dim, ids as *const i64, n, out as *mut f32) }
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
    let f: Update = match precision {
        Precision::F32 => emu_update_f32,
        Precision::F16 => emu_update_f16,
        Precision::Bf16 => emu_update_bf16,
    };
    // SAFETY: the caller's contract.
    unsafe {
        f(
            grid,
            table as *mut c_void,
            state as *mut f32,
            dim,
            spr,
            rows as *const i64,
            seg as *const u32,
            src as *const u32,
            scale as *const f32,
            uniques,
            grad as *const f32,
            args,
        )
    }
}
