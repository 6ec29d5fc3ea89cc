//! The GPU side: probing for CUDA, and [`CudaEbc`], a pooled collection whose tables live in
//! device memory and whose lookups and updates run the NVRTC-compiled kernels.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use trainrec_embedding::{BoundsCheckMode, EmbeddingBagCollection, PoolingMode, WeightPrecision};
use trainrec_sparse::KeyedJaggedTensor;

use crate::host::{self, Layout, StepArgs, StoredWeights, TableSpec};
use crate::{CudaError, KERNELS, WARPS};

// SAFETY: `StepArgs` is `repr(C)` plain old data with the layout of the kernels' `StepArgs`.
unsafe impl DeviceRepr for StepArgs {}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e:?}"))
}

/// The GPU a CUDA collection runs on.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuInfo {
    /// Its ordinal.
    pub device: usize,
    /// Its name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// GPUs the driver sees.
    pub devices: usize,
    /// Where NVRTC was loaded from (`None`: the system's search path).
    pub nvrtc: Option<PathBuf>,
}

/// Whether GPU `device` can run the CUDA engine: the driver library, the GPU itself and
/// NVRTC. The error names what is missing; nothing panics on a machine without CUDA.
pub fn probe(device: usize) -> Result<GpuInfo, CudaError> {
    // SAFETY: only tries to open the library (dlopen); no symbol is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "the CUDA driver library (libcuda.so) is not on this machine: the CUDA engine needs an NVIDIA GPU and its \
             driver"
                .into(),
        ));
    }
    let devices = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?.max(0) as usize;
    if device >= devices {
        return Err(CudaError::Unavailable(format!("GPU {device} asked for, but the CUDA driver sees {devices}")));
    }
    let nvrtc = crate::nvrtc_location()?;
    let ctx = CudaContext::new(device).map_err(driver("cuCtxCreate"))?;
    Ok(GpuInfo {
        device,
        name: ctx.name().map_err(driver("cuDeviceGetName"))?,
        compute_capability: ctx.compute_capability().map_err(driver("cuDeviceGetAttribute"))?,
        devices,
        nvrtc,
    })
}

enum Weights {
    F32(CudaSlice<f32>),
    Bits(CudaSlice<u16>),
}

struct DeviceTable {
    spec: TableSpec,
    weights: Weights,
    state: CudaSlice<f32>,
    /// Updates applied so far.
    iter: u64,
}

/// A batch's ids on the device: the KJT's values, its bag offsets and per-id weights.
struct DeviceBatch {
    values: CudaSlice<i64>,
    offsets: CudaSlice<i64>,
    weights: Option<CudaSlice<f32>>,
}

/// Pooled lookups over tables in GPU memory, the backward fused with the sparse optimizer:
/// the CUDA counterpart of [`EmbeddingBagCollection`], with its layout, initial values and
/// results (bit for bit: see the crate docs). Kernels run on the context's default stream,
/// which orders them with libtorch's default stream.
pub struct CudaEbc {
    layout: Layout,
    info: GpuInfo,
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    tables: Vec<DeviceTable>,
    bounds: BoundsCheckMode,
}

impl CudaEbc {
    /// Copies a CPU collection (tables, optimizer state, step counts) onto GPU `device` and
    /// compiles the kernels for it.
    pub fn from_cpu(ebc: &EmbeddingBagCollection, device: usize) -> Result<Self, CudaError> {
        let layout = Layout::of(ebc)?;
        let info = probe(device)?;
        let ctx = CudaContext::new(device).map_err(driver("cuCtxCreate"))?;
        let stream = ctx.default_stream();
        let (major, minor) = info.compute_capability;
        let ptx = crate::compile_ptx(&format!("compute_{major}{minor}"))?;
        let module = ctx.load_module(ptx).map_err(driver("cuModuleLoadData"))?;
        let mut functions = HashMap::new();
        for kernel in KERNELS {
            for p in [WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16] {
                let name = format!("trainrec_{kernel}_{}", host::suffix(p));
                let f = module.load_function(&name).map_err(driver("cuModuleGetFunction"))?;
                functions.insert(name, f);
            }
        }
        let mut tables = Vec::with_capacity(layout.tables.len());
        for spec in &layout.tables {
            let w = ebc.table_weights(&spec.name).expect("a table of this collection");
            let weights = match host::to_stored(spec.precision, &w) {
                StoredWeights::F32(v) => Weights::F32(stream.clone_htod(&v).map_err(driver("cuMemcpyHtoD"))?),
                StoredWeights::Bits(v) => Weights::Bits(stream.clone_htod(&v).map_err(driver("cuMemcpyHtoD"))?),
            };
            let s = ebc.optimizer_state(&spec.name).unwrap_or_default();
            let state = if s.is_empty() {
                stream.alloc_zeros::<f32>(1).map_err(driver("cuMemAlloc"))?
            } else {
                stream.clone_htod(&s).map_err(driver("cuMemcpyHtoD"))?
            };
            let iter = ebc.step_count(&spec.name).unwrap_or(0);
            tables.push(DeviceTable { spec: spec.clone(), weights, state, iter });
        }
        tracing::info!(gpu = %info.name, tables = tables.len(), "embedding tables on the GPU");
        Ok(Self { layout, info, stream, functions, tables, bounds: BoundsCheckMode::Fatal })
    }

    /// The GPU.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// The tables and outputs.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Output floats per example.
    pub fn width(&self) -> usize {
        self.layout.width
    }

    /// The stream the kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// What lookups do with ids outside their table (`fatal` checks on the host first; the
    /// other modes let the kernels read row 0, as the CPU kernels).
    pub fn set_bounds_check(&mut self, mode: BoundsCheckMode) {
        self.bounds = mode;
    }

    fn function(&self, kernel: &str, p: WeightPrecision) -> &CudaFunction {
        &self.functions[&format!("trainrec_{kernel}_{}", host::suffix(p))]
    }

    fn upload(&self, kjt: &KeyedJaggedTensor) -> Result<(Vec<usize>, DeviceBatch), CudaError> {
        let keys = self.layout.resolve(kjt)?;
        if self.bounds == BoundsCheckMode::Fatal {
            self.layout.check_ids(kjt, &keys)?;
        }
        let up = driver("cuMemcpyHtoD");
        let values = if kjt.values().is_empty() {
            self.stream.alloc_zeros::<i64>(1).map_err(&up)?
        } else {
            self.stream.clone_htod(kjt.values()).map_err(&up)?
        };
        let offsets: Vec<i64> = kjt.offsets().iter().map(|&o| o as i64).collect();
        let offsets = self.stream.clone_htod(&offsets).map_err(&up)?;
        let weights = match kjt.weights() {
            Some(w) if !w.is_empty() => Some(self.stream.clone_htod(w).map_err(&up)?),
            _ => None,
        };
        Ok((keys, DeviceBatch { values, offsets, weights }))
    }

    /// Pooled lookups of `kjt`: `[batch, width]` on the device, row-major.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<CudaSlice<f32>, CudaError> {
        let n = (kjt.stride() * self.width()).max(1);
        let mut out = self.stream.alloc_zeros::<f32>(n).map_err(driver("cuMemAlloc"))?;
        let (ptr, sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out, &self.stream);
        // SAFETY: `out` holds batch * width floats and outlives the launches (same stream).
        let r = unsafe { self.forward_into_raw(kjt, ptr) };
        drop(sync);
        r.map(|()| out)
    }

    /// [`Self::forward`] into device memory the caller owns (e.g. a libtorch CUDA tensor's
    /// `data_ptr`).
    ///
    /// # Safety
    /// `out` must point to `kjt.stride() * self.width()` writable floats on this GPU that stay
    /// valid until the stream passes the launches.
    pub unsafe fn forward_into_raw(&self, kjt: &KeyedJaggedTensor, out: u64) -> Result<(), CudaError> {
        let (keys, batch) = self.upload(kjt)?;
        let b = kjt.stride();
        if b == 0 {
            return Ok(());
        }
        let width = self.width() as i64;
        for (o, &k) in self.layout.outputs.iter().zip(&keys) {
            let t = &self.tables[o.table];
            let (rows, dim) = (t.spec.rows as i64, t.spec.dim as i32);
            let offsets = batch.offsets.slice(k * b..k * b + b + 1);
            let null = 0u64;
            let n = b as i64;
            let mean = i32::from(t.spec.pooling == PoolingMode::Mean);
            let col = o.column as i64;
            let f = self.function("pool", t.spec.precision);
            let mut l = self.stream.launch_builder(f);
            match &t.weights {
                Weights::F32(w) => l.arg(w),
                Weights::Bits(w) => l.arg(w),
            };
            l.arg(&rows).arg(&dim).arg(&batch.values).arg(&offsets);
            match &batch.weights {
                Some(w) => l.arg(w),
                None => l.arg(&null),
            };
            l.arg(&n).arg(&mean).arg(&out).arg(&width).arg(&col);
            // SAFETY: the arguments match trainrec_pool_*'s parameters in order and type; every
            // index the kernel reads is inside its buffer (bags from the KJT's offsets, rows
            // clamped to the table), and it writes b rows of `width` at `out`.
            unsafe { l.launch(launch_config(b)) }.map_err(driver("cuLaunchKernel (pool)"))?;
        }
        Ok(())
    }

    /// Backward fused with the optimizer: `grad` is the `[batch, width]` gradient of
    /// [`Self::forward`]'s output, on the device.
    pub fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad: &CudaSlice<f32>) -> Result<(), CudaError> {
        if grad.len() < kjt.stride() * self.width() {
            return Err(CudaError::Unsupported(format!(
                "gradient has {} floats, expected batch {} x width {}",
                grad.len(),
                kjt.stride(),
                self.width()
            )));
        }
        let stream = self.stream.clone();
        let (ptr, sync) = cudarc::driver::DevicePtr::device_ptr(grad, &stream);
        // SAFETY: checked above; the gradient outlives the launches (same stream).
        let r = unsafe { self.backward_and_update_raw(kjt, ptr) };
        drop(sync);
        r
    }

    /// [`Self::backward_and_update`] from device memory the caller owns.
    ///
    /// # Safety
    /// `grad` must point to `kjt.stride() * self.width()` floats on this GPU, valid until the
    /// stream passes the launches.
    pub unsafe fn backward_and_update_raw(&mut self, kjt: &KeyedJaggedTensor, grad: u64) -> Result<(), CudaError> {
        let keys = self.layout.resolve(kjt)?;
        if self.bounds == BoundsCheckMode::Fatal {
            self.layout.check_ids(kjt, &keys)?;
        }
        let grad_len = (kjt.stride() * self.width()) as u64;
        if grad_len > u64::from(u32::MAX) {
            return Err(CudaError::Unsupported(format!(
                "a gradient of {grad_len} floats is over the kernel's {} limit: use smaller batches",
                u32::MAX
            )));
        }
        let up = driver("cuMemcpyHtoD");
        for t in 0..self.tables.len() {
            let occ = self.layout.occurrences(kjt, &keys, t);
            let table = &mut self.tables[t];
            table.iter += 1;
            if occ.rows.is_empty() {
                continue;
            }
            let args = StepArgs::new(&table.spec, table.iter);
            let rows = self.stream.clone_htod(&occ.rows).map_err(&up)?;
            let seg = self.stream.clone_htod(&occ.seg).map_err(&up)?;
            let src = self.stream.clone_htod(&occ.src).map_err(&up)?;
            let scale = self.stream.clone_htod(&occ.scale).map_err(&up)?;
            let (dim, spr) = (table.spec.dim as i32, table.spec.state_per_row as i32);
            let uniques = occ.rows.len() as i64;
            let f = &self.functions[&format!("trainrec_update_{}", host::suffix(table.spec.precision))];
            let mut l = self.stream.launch_builder(f);
            match &mut table.weights {
                Weights::F32(w) => l.arg(w),
                Weights::Bits(w) => l.arg(w),
            };
            l.arg(&mut table.state).arg(&dim).arg(&spr).arg(&rows).arg(&seg).arg(&src).arg(&scale);
            l.arg(&uniques).arg(&grad).arg(&args);
            // SAFETY: the arguments match trainrec_update_*'s parameters in order and type; the
            // rows are unique (one warp each, no two writing one row), inside the table, and
            // every occurrence's gradient lies in the `grad_len` floats at `grad`.
            unsafe { l.launch(launch_config(occ.rows.len())) }.map_err(driver("cuLaunchKernel (update)"))?;
        }
        Ok(())
    }

    fn table(&self, name: &str) -> Result<&DeviceTable, CudaError> {
        self.tables
            .iter()
            .find(|t| t.spec.name == name)
            .ok_or_else(|| CudaError::Unsupported(format!("no table \"{name}\" in this collection")))
    }

    /// Table `name`'s weights as fp32, `[rows, dim]` row-major (copied from the device).
    pub fn table_weights(&self, name: &str) -> Result<Vec<f32>, CudaError> {
        let t = self.table(name)?;
        let down = driver("cuMemcpyDtoH");
        let stored = match &t.weights {
            Weights::F32(w) => StoredWeights::F32(self.stream.clone_dtoh(w).map_err(&down)?),
            Weights::Bits(w) => StoredWeights::Bits(self.stream.clone_dtoh(w).map_err(&down)?),
        };
        Ok(host::from_stored(t.spec.precision, &stored))
    }

    /// Table `name`'s optimizer state (copied from the device).
    pub fn optimizer_state(&self, name: &str) -> Result<Vec<f32>, CudaError> {
        let t = self.table(name)?;
        if t.spec.state_per_row == 0 {
            return Ok(Vec::new());
        }
        self.stream.clone_dtoh(&t.state).map_err(driver("cuMemcpyDtoH"))
    }

    /// Updates applied so far to table `name`.
    pub fn step_count(&self, name: &str) -> Result<u64, CudaError> {
        Ok(self.table(name)?.iter)
    }

    /// Replaces table `name`'s weights (fp32 values, rounded to nearest in its precision),
    /// optimizer state (empty: zero) and step count, e.g. from a checkpoint.
    pub fn load_table(&mut self, name: &str, weights: &[f32], state: &[f32], steps: u64) -> Result<(), CudaError> {
        let i = self
            .tables
            .iter()
            .position(|t| t.spec.name == name)
            .ok_or_else(|| CudaError::Unsupported(format!("no table \"{name}\" in this collection")))?;
        let spec = self.tables[i].spec.clone();
        let (n, ns) = (spec.rows as usize * spec.dim, spec.rows as usize * spec.state_per_row);
        if weights.len() != n || !(state.is_empty() || state.len() == ns) {
            return Err(CudaError::Unsupported(format!(
                "table \"{name}\": {} weights and {} state values given, expected {n} and {ns}",
                weights.len(),
                state.len()
            )));
        }
        let up = driver("cuMemcpyHtoD");
        let t = &mut self.tables[i];
        match (&mut t.weights, host::to_stored(spec.precision, weights)) {
            (Weights::F32(w), StoredWeights::F32(v)) => self.stream.memcpy_htod(&v, w).map_err(&up)?,
            (Weights::Bits(w), StoredWeights::Bits(v)) => self.stream.memcpy_htod(&v, w).map_err(&up)?,
            _ => unreachable!("a table's stored form follows its precision"),
        }
        if ns > 0 {
            let zeros;
            let state = if state.is_empty() {
                zeros = vec![0f32; ns];
                &zeros[..]
            } else {
                state
            };
            self.stream.memcpy_htod(state, &mut t.state).map_err(&up)?;
        }
        t.iter = steps;
        Ok(())
    }

    /// Copies every table, its optimizer state and step count back into `ebc` (the
    /// collection this one was made from, e.g. to checkpoint it).
    pub fn write_back(&self, ebc: &mut EmbeddingBagCollection) -> Result<(), CudaError> {
        for t in &self.tables {
            let name = &t.spec.name;
            ebc.set_table_weights(name, self.table_weights(name)?)?;
            if t.spec.state_per_row > 0 {
                ebc.set_optimizer_state(name, self.optimizer_state(name)?)?;
            }
            ebc.set_step_count(name, t.iter)?;
        }
        Ok(())
    }

    /// Waits for every launch so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }
}

fn launch_config(warps_of_work: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (host::grid(warps_of_work), 1, 1), block_dim: (32, WARPS, 1), shared_mem_bytes: 0 }
}
