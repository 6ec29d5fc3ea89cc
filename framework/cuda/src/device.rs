//! The GPU side: probing for CUDA, and [`CudaEbc`], a pooled collection whose tables live in
//! device memory and whose lookups and updates run the NVRTC-compiled kernels.

use std::path::PathBuf;

use cudarc::driver::CudaContext;
use trainrec_embedding::{BoundsCheckMode, EmbeddingBagCollection, PoolingMode};
use trainrec_sparse::KeyedJaggedTensor;

use crate::CudaError;
use crate::backend::{Arg, Backend, Buf, Kernel, driver};
use crate::host::{self, Layout, StepArgs, StoredWeights, TableSpec};

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
    F32(Buf<f32>),
    Bits(Buf<u16>),
}

struct DeviceTable {
    spec: TableSpec,
    weights: Weights,
    state: Buf<f32>,
    /// Updates applied so far.
    iter: u64,
}

impl DeviceTable {
    /// Where its weights start (the kernels' `table` argument).
    fn weights_addr(&self, be: &Backend) -> u64 {
        match &self.weights {
            Weights::F32(w) => be.addr(w, 0),
            Weights::Bits(w) => be.addr(w, 0),
        }
    }
}

/// A batch's ids in the backend's memory: the KJT's values, its bag offsets and per-id weights.
struct DeviceBatch {
    values: Buf<i64>,
    offsets: Buf<i64>,
    weights: Option<Buf<f32>>,
}

/// Floats in the collection's memory: a forward's output or a gradient
/// ([`CudaEbc::upload`], [`CudaEbc::download`]).
pub struct DeviceBuffer(Buf<f32>);

impl DeviceBuffer {
    /// Floats held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds no floats.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Pooled lookups over tables in GPU memory, the backward fused with the sparse optimizer:
/// the CUDA counterpart of [`EmbeddingBagCollection`], with its layout, initial values and
/// results (bit for bit: see the crate docs). Kernels run on the context's default stream,
/// which orders them with libtorch's default stream. With feature `emulator`,
/// [`CudaEbc::emulated`] runs the same code on host memory.
pub struct CudaEbc {
    layout: Layout,
    info: GpuInfo,
    backend: Backend,
    tables: Vec<DeviceTable>,
    bounds: BoundsCheckMode,
}

impl CudaEbc {
    /// Copies a CPU collection (tables, optimizer state, step counts) onto GPU `device` and
    /// compiles the kernels for it.
    pub fn from_cpu(ebc: &EmbeddingBagCollection, device: usize) -> Result<Self, CudaError> {
        let layout = Layout::of(ebc)?;
        let info = probe(device)?;
        let backend = Backend::cuda(device, info.compute_capability)?;
        let me = Self::with_backend(ebc, layout, info, backend)?;
        tracing::info!(gpu = %me.info.name, tables = me.tables.len(), "embedding tables on the GPU");
        Ok(me)
    }

    /// [`Self::from_cpu`] on the emulator: host memory, the kernels compiled as host C++ (one
    /// OS thread per CUDA thread: slow, for tests). Its [`GpuInfo::name`] is `"emulator"`.
    #[cfg(feature = "emulator")]
    pub fn emulated(ebc: &EmbeddingBagCollection) -> Result<Self, CudaError> {
        let layout = Layout::of(ebc)?;
        let info = GpuInfo { device: 0, name: "emulator".into(), compute_capability: (0, 0), devices: 0, nvrtc: None };
        Self::with_backend(ebc, layout, info, Backend::Emulator)
    }

    fn with_backend(
        ebc: &EmbeddingBagCollection,
        layout: Layout,
        info: GpuInfo,
        backend: Backend,
    ) -> Result<Self, CudaError> {
        let mut tables = Vec::with_capacity(layout.tables.len());
        for spec in &layout.tables {
            let w = ebc.table_weights(&spec.name).expect("a table of this collection");
            let weights = match host::to_stored(spec.precision, &w) {
                StoredWeights::F32(v) => Weights::F32(backend.upload(&v)?),
                StoredWeights::Bits(v) => Weights::Bits(backend.upload(&v)?),
            };
            let s = ebc.optimizer_state(&spec.name).unwrap_or_default();
            let state = if s.is_empty() { backend.zeros::<f32>(1)? } else { backend.upload(&s)? };
            let iter = ebc.step_count(&spec.name).unwrap_or(0);
            tables.push(DeviceTable { spec: spec.clone(), weights, state, iter });
        }
        Ok(Self { layout, info, backend, tables, bounds: BoundsCheckMode::Fatal })
    }

    /// The GPU.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Whether the tables live in GPU memory (false on the emulator, whose buffers and raw
    /// addresses are host memory).
    pub fn on_gpu(&self) -> bool {
        matches!(self.backend, Backend::Cuda { .. })
    }

    /// The tables and outputs.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Output floats per example.
    pub fn width(&self) -> usize {
        self.layout.width
    }

    /// What lookups do with ids outside their table (`fatal` checks on the host first; the
    /// other modes let the kernels read row 0, as the CPU kernels).
    pub fn set_bounds_check(&mut self, mode: BoundsCheckMode) {
        self.bounds = mode;
    }

    /// A copy of `v` in the collection's memory (e.g. a gradient).
    pub fn upload(&self, v: &[f32]) -> Result<DeviceBuffer, CudaError> {
        Ok(DeviceBuffer(self.backend.upload(v)?))
    }

    /// A buffer's floats on the host.
    pub fn download(&self, b: &DeviceBuffer) -> Result<Vec<f32>, CudaError> {
        self.backend.download(&b.0)
    }

    fn upload_batch(&self, kjt: &KeyedJaggedTensor) -> Result<(Vec<usize>, DeviceBatch), CudaError> {
        let keys = self.layout.resolve(kjt)?;
        if self.bounds == BoundsCheckMode::Fatal {
            self.layout.check_ids(kjt, &keys)?;
        }
        let offsets: Vec<i64> = kjt.offsets().iter().map(|&o| o as i64).collect();
        let weights = match kjt.weights() {
            Some(w) if !w.is_empty() => Some(self.backend.upload(w)?),
            _ => None,
        };
        Ok((
            keys,
            DeviceBatch {
                values: self.backend.upload(kjt.values())?,
                offsets: self.backend.upload(&offsets)?,
                weights,
            },
        ))
    }

    /// Pooled lookups of `kjt`: `[batch, width]` in the collection's memory, row-major.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<DeviceBuffer, CudaError> {
        let out = self.backend.zeros::<f32>(kjt.stride() * self.width())?;
        let addr = self.backend.addr(&out, 0);
        // SAFETY: `out` holds batch * width floats and outlives the launches (same stream).
        unsafe { self.forward_into_raw(kjt, addr)? };
        Ok(DeviceBuffer(out))
    }

    /// [`Self::forward`] into memory the caller owns (e.g. a libtorch CUDA tensor's
    /// `data_ptr`; on the emulator, a host address).
    ///
    /// # Safety
    /// `out` must point to `kjt.stride() * self.width()` writable floats of the collection's
    /// memory that stay valid until the stream passes the launches.
    pub unsafe fn forward_into_raw(&self, kjt: &KeyedJaggedTensor, out: u64) -> Result<(), CudaError> {
        let (keys, batch) = self.upload_batch(kjt)?;
        let b = kjt.stride();
        if b == 0 {
            return Ok(());
        }
        let be = &self.backend;
        let weights = batch.weights.as_ref().map_or(0, |w| be.addr(w, 0));
        for (o, &k) in self.layout.outputs.iter().zip(&keys) {
            let t = &self.tables[o.table];
            let args = [
                Arg::Ptr(t.weights_addr(be)),
                Arg::I64(t.spec.rows as i64),
                Arg::I32(t.spec.dim as i32),
                Arg::Ptr(be.addr(&batch.values, 0)),
                Arg::Ptr(be.addr(&batch.offsets, k * b)),
                Arg::Ptr(weights),
                Arg::I64(b as i64),
                Arg::I32(i32::from(t.spec.pooling == PoolingMode::Mean)),
                Arg::Ptr(out),
                Arg::I64(self.width() as i64),
                Arg::I64(o.column as i64),
            ];
            // SAFETY: the arguments match trainrec_pool_*'s parameters in order and type; every
            // index the kernel reads is inside its buffer (bags from the KJT's offsets, rows
            // clamped to the table), and it writes b rows of `width` at `out`.
            unsafe { be.launch(Kernel::Pool, t.spec.precision, b, &args)? };
        }
        // The batch's buffers are freed in stream order after the launches.
        drop(batch);
        Ok(())
    }

    /// Backward fused with the optimizer: `grad` is the `[batch, width]` gradient of
    /// [`Self::forward`]'s output.
    pub fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad: &DeviceBuffer) -> Result<(), CudaError> {
        if grad.len() < kjt.stride() * self.width() {
            return Err(CudaError::Unsupported(format!(
                "gradient has {} floats, expected batch {} x width {}",
                grad.len(),
                kjt.stride(),
                self.width()
            )));
        }
        let addr = self.backend.addr(&grad.0, 0);
        // SAFETY: checked above; the gradient outlives the launches (same stream).
        unsafe { self.backward_and_update_raw(kjt, addr) }
    }

    /// [`Self::backward_and_update`] from memory the caller owns.
    ///
    /// # Safety
    /// `grad` must point to `kjt.stride() * self.width()` floats of the collection's memory,
    /// valid until the stream passes the launches.
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
        let be = &self.backend;
        // The host's part: every table's occurrences sorted into unique rows, in parallel.
        let layout = &self.layout;
        let lists: Vec<host::Occurrences> = {
            use rayon::prelude::*;
            (0..self.tables.len()).into_par_iter().map(|t| layout.occurrences(kjt, &keys, t)).collect()
        };
        for (t, occ) in lists.into_iter().enumerate() {
            let table = &mut self.tables[t];
            table.iter += 1;
            if occ.rows.is_empty() {
                continue;
            }
            let step = StepArgs::new(&table.spec, table.iter);
            let (rows, seg) = (be.upload(&occ.rows)?, be.upload(&occ.seg)?);
            let (src, scale) = (be.upload(&occ.src)?, be.upload(&occ.scale)?);
            let args = [
                Arg::Ptr(table.weights_addr(be)),
                Arg::Ptr(be.addr(&table.state, 0)),
                Arg::I32(table.spec.dim as i32),
                Arg::I32(table.spec.state_per_row as i32),
                Arg::Ptr(be.addr(&rows, 0)),
                Arg::Ptr(be.addr(&seg, 0)),
                Arg::Ptr(be.addr(&src, 0)),
                Arg::Ptr(be.addr(&scale, 0)),
                Arg::I64(occ.rows.len() as i64),
                Arg::Ptr(grad),
                Arg::Step(step),
            ];
            // SAFETY: the arguments match trainrec_update_*'s parameters in order and type; the
            // rows are unique (one warp each, no two writing one row), inside the table, and
            // every occurrence's gradient lies in the `grad_len` floats at `grad`.
            unsafe { be.launch(Kernel::Update, table.spec.precision, occ.rows.len(), &args)? };
        }
        Ok(())
    }

    /// Sequence lookups of one table: row `ids[i]` at `[i * dim ..]` of the result (ids
    /// outside the table read row 0 unless the bounds check is `fatal`).
    pub fn lookup_rows(&self, name: &str, ids: &[i64]) -> Result<DeviceBuffer, CudaError> {
        let t = self.table(name)?;
        if self.bounds == BoundsCheckMode::Fatal {
            if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= t.spec.rows) {
                return Err(CudaError::Embedding(trainrec_embedding::EmbeddingError::IdOutOfRange {
                    table: name.to_string(),
                    feature: String::new(),
                    sample: ids.iter().position(|&x| x == id).unwrap_or(0),
                    id,
                    rows: t.spec.rows,
                }));
            }
        }
        let be = &self.backend;
        let out = be.zeros::<f32>(ids.len() * t.spec.dim)?;
        if ids.is_empty() {
            return Ok(DeviceBuffer(out));
        }
        let dev_ids = be.upload(ids)?;
        let args = [
            Arg::Ptr(t.weights_addr(be)),
            Arg::I64(t.spec.rows as i64),
            Arg::I32(t.spec.dim as i32),
            Arg::Ptr(be.addr(&dev_ids, 0)),
            Arg::I64(ids.len() as i64),
            Arg::Ptr(be.addr(&out, 0)),
        ];
        // SAFETY: the arguments match trainrec_gather_*'s; rows are clamped to the table and
        // `out` holds ids.len() rows of dim.
        unsafe { be.launch(Kernel::Gather, t.spec.precision, ids.len(), &args)? };
        Ok(DeviceBuffer(out))
    }

    fn table(&self, name: &str) -> Result<&DeviceTable, CudaError> {
        self.tables
            .iter()
            .find(|t| t.spec.name == name)
            .ok_or_else(|| CudaError::Unsupported(format!("no table \"{name}\" in this collection")))
    }

    /// Table `name`'s weights as fp32, `[rows, dim]` row-major (copied to the host).
    pub fn table_weights(&self, name: &str) -> Result<Vec<f32>, CudaError> {
        let t = self.table(name)?;
        let stored = match &t.weights {
            Weights::F32(w) => StoredWeights::F32(self.backend.download(w)?),
            Weights::Bits(w) => StoredWeights::Bits(self.backend.download(w)?),
        };
        Ok(host::from_stored(t.spec.precision, &stored))
    }

    /// Table `name`'s optimizer state (copied to the host).
    pub fn optimizer_state(&self, name: &str) -> Result<Vec<f32>, CudaError> {
        let t = self.table(name)?;
        if t.spec.state_per_row == 0 {
            return Ok(Vec::new());
        }
        self.backend.download(&t.state)
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
        let t = &mut self.tables[i];
        match (&mut t.weights, host::to_stored(spec.precision, weights)) {
            (Weights::F32(w), StoredWeights::F32(v)) => self.backend.write(&v, w)?,
            (Weights::Bits(w), StoredWeights::Bits(v)) => self.backend.write(&v, w)?,
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
            self.backend.write(state, &mut t.state)?;
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
        self.backend.synchronize()
    }
}
