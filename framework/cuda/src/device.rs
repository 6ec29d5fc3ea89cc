//! The GPU side: probing for CUDA, and [`CudaEbc`], a pooled collection whose tables live in
//! device memory and whose lookups and updates run the NVRTC-compiled kernels.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::CudaContext;
use trainrec_embedding::{
    BoundsCheckMode, EmbeddingBagCollection, EmbeddingError, PoolingMode, RowBlock, RowCache, SlotStore,
    WeightPrecision,
};
use trainrec_sparse::KeyedJaggedTensor;

use crate::CudaError;
use crate::backend::{Arg, Backend, Buf, Kernel};
use crate::copy::{CopyStream, Staged};
use crate::driver;
use crate::host::{self, Layout, StepArgs};
use crate::table::{DeviceSlots, DeviceTable, Weights, bytemuck_bytes, write_table};

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
///
/// A cached table (`fused_uvm_caching`) keeps its cache's slots in GPU memory and the whole
/// table in host memory (the CPU engine's [`RowCache`]: LRU or LFU, dirty rows written back
/// on eviction). A batch's rows are made resident (missing ones copied in, in one batch)
/// before its kernels run, and the update pins them until it is done.
pub struct CudaEbc {
    layout: Layout,
    info: GpuInfo,
    backend: Backend,
    /// Batches copied ahead at high priority ([`Self::stage`]).
    copy: CopyStream,
    /// Locked one at a time (lookups move a cached table's rows).
    tables: Vec<Mutex<DeviceTable>>,
    bounds: BoundsCheckMode,
    /// Prefetched batches not trained yet, oldest first: what identifies each, and the slots
    /// it pinned per cached table.
    pending: Vec<(u64, Vec<Option<Vec<u32>>>)>,
}

/// A batch's ids, bag offsets, per-id weights and the caller's parts (e.g. its dense features
/// and labels) copied to the GPU ahead of its lookup on the copy stream ([`CudaEbc::stage`]);
/// [`CudaEbc::forward_staged_into_raw`] reads the ids there. Its staging slot is free again
/// once it is dropped and the default stream has passed its readers.
pub struct StagedBatch {
    staged: Staged,
    /// [`batch_key`] of the KJT.
    key: u64,
    weighted: bool,
}

impl StagedBatch {
    /// Makes the default stream wait for the copy and returns the addresses of the caller's
    /// parts (in the order given to [`CudaEbc::stage`]): enqueue their readers after this.
    pub fn parts(&self) -> Result<Vec<u64>, CudaError> {
        Ok(self.staged.wait()?[3..].to_vec())
    }
}

/// Identifies a KJT by its contents.
fn batch_key(kjt: &KeyedJaggedTensor) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (kjt.keys(), kjt.stride(), kjt.values(), kjt.lengths()).hash(&mut h);
    kjt.weights().map(|w| w.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()).hash(&mut h);
    h.finish()
}

/// Where a lookup reads a batch's ids: addresses in the collection's memory.
#[derive(Clone, Copy)]
struct Ids {
    values: u64,
    offsets: u64,
    /// 0: no per-id weights.
    weights: u64,
}

/// Identifies a batch by the rows it reads from cached tables.
fn fingerprint(rows: &[Option<Vec<u32>>]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rows.hash(&mut h);
    h.finish()
}

fn lock(t: &Mutex<DeviceTable>) -> MutexGuard<'_, DeviceTable> {
    t.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Row of `id` in a table of `rows` (ids outside read row 0, as every kernel).
fn clamp(id: i64, rows: u64) -> u32 {
    trainrec_embedding::clamp_row(id, rows) as u32
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
            let iter = ebc.step_count(&spec.name).unwrap_or(0);
            let half = spec.precision != WeightPrecision::Fp32;
            // A key-value table's rows written so far (none in a fresh collection): the rest
            // read as the initial weights, which the store computes, so a table larger than
            // memory is never materialised.
            let sparse = spec.cache.as_ref().and_then(|_| ebc.sparse_rows(&spec.name));
            let (w, s) = match &sparse {
                Some(rows) => ebc.rows_state(&spec.name, rows)?,
                None => (
                    ebc.table_weights(&spec.name).expect("a table of this collection"),
                    ebc.optimizer_state(&spec.name).unwrap_or_default(),
                ),
            };
            let table = match &spec.cache {
                None => {
                    let weights = Weights::upload(&backend, host::to_stored(spec.precision, &w))?;
                    let state = if s.is_empty() { backend.zeros::<f32>(1)? } else { backend.upload(&s)? };
                    DeviceTable { spec: spec.clone(), weights, state, iter, cache: None }
                }
                Some(config) => {
                    let slots = config.slots.min(spec.rows) as usize;
                    let weights = if half {
                        Weights::Bits(backend.zeros::<u16>(slots * spec.dim)?)
                    } else {
                        Weights::F32(backend.zeros::<f32>(slots * spec.dim)?)
                    };
                    let state = backend.zeros::<f32>(slots * spec.state_per_row)?;
                    // The table's own initial weights: a `key_value` store then keeps only the
                    // rows that no longer read as them (the CPU table's untouched rows do).
                    let init = ebc.initial_rows(&spec.name).ok_or_else(|| {
                        CudaError::Unsupported(format!("table {} is not in the collection", spec.name))
                    })?;
                    let cache = RowCache::with_precision(
                        spec.precision,
                        &spec.name,
                        config,
                        spec.rows,
                        spec.dim,
                        spec.state_per_row,
                        init,
                    )?;
                    let mut t = DeviceTable { spec: spec.clone(), weights, state, iter, cache: Some(cache) };
                    if let Some(rows) = &sparse {
                        let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                        let zeros = vec![0f32; rows.len() * spec.state_per_row];
                        let s = if s.is_empty() { &zeros } else { &s };
                        crate::table::write_rows(&mut t, &backend, &rows, &w, s)?;
                        tables.push(Mutex::new(t));
                        continue;
                    }
                    // Nothing is resident yet: this fills the backing file.
                    let zeros;
                    let s = if s.is_empty() {
                        zeros = vec![0f32; spec.rows as usize * spec.state_per_row];
                        &zeros
                    } else {
                        &s
                    };
                    write_table(&mut t, &backend, &w, s)?;
                    t
                }
            };
            tables.push(Mutex::new(table));
        }
        let copy = backend.copy_stream()?;
        Ok(Self { layout, info, backend, copy, tables, bounds: BoundsCheckMode::Fatal, pending: Vec::new() })
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

    /// A cached table's cache: its slots in GPU memory and the store behind them (`None` for
    /// a table whole in GPU memory).
    pub fn cache_placement(&self, name: &str) -> Option<trainrec_embedding::CachePlacement> {
        let i = self.index(name).ok()?;
        lock(&self.tables[i]).cache.as_ref().map(|c| trainrec_embedding::CachePlacement {
            slots: c.slots(),
            backing: c.backing(),
            stored: c.stored_rows(),
        })
    }

    /// Cache counters of table `name`; `None` unless it is cached.
    pub fn cache_stats(&self, name: &str) -> Option<trainrec_embedding::CacheStats> {
        let i = self.index(name).ok()?;
        lock(&self.tables[i]).cache.as_ref().map(|c| c.stats)
    }

    /// The batch's output keys, its ids checked as the bounds check says.
    fn checked_keys(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, CudaError> {
        let keys = self.layout.resolve(kjt)?;
        if self.bounds == BoundsCheckMode::Fatal {
            self.layout.check_ids(kjt, &keys)?;
        }
        Ok(keys)
    }

    /// The copy stream batches are staged on.
    pub fn copy_stream(&self) -> &CopyStream {
        &self.copy
    }

    /// Copies `kjt`'s ids, bag offsets and per-id weights, and `parts` (host buffers of the
    /// caller's, e.g. the batch's dense features and labels), to the GPU on the copy stream
    /// (the highest priority), through pinned memory, while the default stream goes on: the
    /// `base` pipeline's copy stage, or the next batch's copy while this one trains. The ids
    /// are checked as the bounds check says. Callable from another thread than the
    /// training's (the pipeline's stage).
    pub fn stage(&self, kjt: &KeyedJaggedTensor, parts: &[&[u8]]) -> Result<StagedBatch, CudaError> {
        self.checked_keys(kjt)?;
        let offsets: Vec<i64> = kjt.offsets().iter().map(|&o| o as i64).collect();
        let weights: &[f32] = kjt.weights().unwrap_or(&[]);
        let mut all: Vec<&[u8]> = vec![bytemuck_bytes(kjt.values()), bytemuck_bytes(&offsets), bytemuck_bytes(weights)];
        all.extend_from_slice(parts);
        let staged = self.copy.stage(&all)?;
        Ok(StagedBatch { staged, key: batch_key(kjt), weighted: !weights.is_empty() })
    }

    fn upload_batch(&self, kjt: &KeyedJaggedTensor) -> Result<(Vec<usize>, DeviceBatch), CudaError> {
        let keys = self.checked_keys(kjt)?;
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
        let mut out = self.backend.zeros::<f32>(kjt.stride() * self.width())?;
        let addr = self.backend.addr_mut(&mut out, 0);
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
        let be = &self.backend;
        let ids = Ids {
            values: be.addr(&batch.values, 0),
            offsets: be.addr(&batch.offsets, 0),
            weights: batch.weights.as_ref().map_or(0, |w| be.addr(w, 0)),
        };
        // SAFETY: the caller's contract; `ids` point into `batch`, alive until the launches
        // are enqueued (and freed in stream order after them).
        unsafe { self.pool(kjt, &keys, ids, out) }
    }

    /// [`Self::forward_into_raw`] reading the ids `staged` copied ahead (the batch
    /// [`Self::stage`] was given: another batch is an error).
    ///
    /// # Safety
    /// As [`Self::forward_into_raw`].
    pub unsafe fn forward_staged_into_raw(
        &self,
        kjt: &KeyedJaggedTensor,
        staged: &StagedBatch,
        out: u64,
    ) -> Result<(), CudaError> {
        if staged.key != batch_key(kjt) {
            return Err(CudaError::Unsupported(
                "a staged batch was looked up with another batch's ids (stage batches in the order they train)".into(),
            ));
        }
        let keys = self.layout.resolve(kjt)?;
        let a = staged.staged.wait()?;
        let ids = Ids { values: a[0], offsets: a[1], weights: if staged.weighted { a[2] } else { 0 } };
        // SAFETY: the caller's contract; the staged parts stay in their slot while `staged`
        // lives, and its drop frees the slot only after the default stream passes the launches.
        unsafe { self.pool(kjt, &keys, ids, out) }
    }

    /// The pooling launches of a batch whose ids are at `ids`.
    ///
    /// # Safety
    /// As [`Self::forward_into_raw`]; `ids` must hold `kjt`'s values, offsets (as `i64`) and
    /// weights (when it has them) until the launches are done.
    unsafe fn pool(&self, kjt: &KeyedJaggedTensor, keys: &[usize], ids: Ids, out: u64) -> Result<(), CudaError> {
        let b = kjt.stride();
        if b == 0 {
            return Ok(());
        }
        let be = &self.backend;
        let weights = ids.weights;
        for (o, &k) in self.layout.outputs.iter().zip(keys) {
            let mut t = lock(&self.tables[o.table]);
            // A cached table's ids become slots (its rows made resident first), or, when the
            // batch has more distinct rows than the cache has slots, positions in a table of
            // just those rows; with their own buffers.
            let mut own = None;
            let mut staged = None;
            if t.cache.is_some() {
                let f = kjt.feature(k);
                let rows: Vec<u32> = f.values.iter().map(|&id| clamp(id, t.spec.rows)).collect();
                let ids: Vec<i64> = match t.pin(be, &rows) {
                    Ok(pinned) => {
                        let cache = t.cache.as_mut().expect("a cached table");
                        cache.unpin(&pinned, false);
                        rows.iter().map(|&r| i64::from(cache.slot(r).expect("rows pinned by this call"))).collect()
                    }
                    Err(CudaError::Embedding(EmbeddingError::Config(_))) => {
                        let (ids, table) = t.staged(be, &rows)?;
                        staged = Some(table);
                        ids
                    }
                    Err(e) => return Err(e),
                };
                let base = kjt.offsets()[k * b];
                let offsets: Vec<i64> = kjt.offsets()[k * b..=k * b + b].iter().map(|&x| (x - base) as i64).collect();
                // The feature's per-id weights are the batch's, from its first id on.
                let w = if weights == 0 { 0 } else { weights + 4 * base as u64 };
                own = Some((be.upload(&ids)?, be.upload(&offsets)?, w));
            }
            let (values, offsets, weights) = match &own {
                Some((v, o, w)) => (be.addr(v, 0), be.addr(o, 0), *w),
                None => (ids.values, ids.offsets + 8 * (k * b) as u64, weights),
            };
            let (table, rows) = match &staged {
                Some((w, n)) => (w.addr(be), *n),
                None => (t.weights_addr(be), t.kernel_rows()),
            };
            let args = [
                Arg::Ptr(table),
                Arg::I64(rows),
                Arg::I32(t.spec.dim as i32),
                Arg::Ptr(values),
                Arg::Ptr(offsets),
                Arg::Ptr(weights),
                Arg::I64(b as i64),
                Arg::I32(i32::from(t.spec.pooling == PoolingMode::Mean)),
                Arg::Ptr(out),
                Arg::I64(self.width() as i64),
                Arg::I64(o.column as i64),
            ];
            // SAFETY: the arguments match trainrec_pool_*'s parameters in order and type; every
            // index the kernel reads is inside its buffer (bags from the KJT's offsets, rows
            // clamped to the table or its slots), and it writes b rows of `width` at `out`.
            unsafe { be.launch(Kernel::Pool, t.spec.precision, b, &args)? };
        }
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
        // Cached tables: the batch's rows resident and pinned until their update is done (by
        // its prefetch, or now).
        let rows = self.cached_rows(kjt, &keys);
        let f = fingerprint(&rows);
        let pins = match self.pending.iter().position(|p| p.0 == f) {
            Some(i) => self.pending.remove(i).1,
            None => self.pin_rows(rows)?,
        };
        let be = &self.backend;
        let layout = &self.layout;
        // The host's part: every table's occurrences sorted into unique rows (cached tables'
        // by slot), in parallel.
        let lists: Vec<host::Occurrences> = {
            use rayon::prelude::*;
            let tables = &self.tables;
            (0..tables.len())
                .into_par_iter()
                .map(|t| {
                    let table = lock(&tables[t]);
                    match &table.cache {
                        None => layout.occurrences(kjt, &keys, t),
                        Some(c) => {
                            layout.occurrences_in(kjt, &keys, t, |r| c.slot(r).expect("pinned rows are resident"))
                        }
                    }
                })
                .collect()
        };
        for ((table, occ), pinned) in self.tables.iter_mut().zip(lists).zip(pins) {
            let table = table.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            table.iter += 1;
            if !occ.rows.is_empty() {
                let step = StepArgs::new(&table.spec, table.iter);
                let (rows, seg) = (be.upload(&occ.rows)?, be.upload(&occ.seg)?);
                let (src, scale) = (be.upload(&occ.src)?, be.upload(&occ.scale)?);
                let args = [
                    Arg::Ptr(table.weights_addr_mut(be)),
                    Arg::Ptr(be.addr_mut(&mut table.state, 0)),
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
                // SAFETY: the arguments match trainrec_update_*'s parameters in order and type;
                // the rows are unique (one warp each, no two writing one row), inside the table
                // (or its slots), and every occurrence's gradient lies in the `grad_len` floats
                // at `grad`.
                unsafe { be.launch(Kernel::Update, table.spec.precision, occ.rows.len(), &args)? };
            }
            if let (Some(cache), Some(pinned)) = (table.cache.as_mut(), pinned) {
                cache.unpin(&pinned, true);
            }
        }
        Ok(())
    }

    /// Per table, the rows a cached table's outputs read in `kjt` (`None` for tables in GPU
    /// memory whole).
    fn cached_rows(&self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Vec<Option<Vec<u32>>> {
        self.tables
            .iter()
            .enumerate()
            .map(|(t, table)| {
                let table = lock(table);
                table.cache.as_ref()?;
                let rows = table.spec.rows;
                Some(
                    self.layout
                        .outputs
                        .iter()
                        .zip(keys)
                        .filter(|(o, _)| o.table == t)
                        .flat_map(|(_, &k)| kjt.feature(k).values.iter().map(move |&id| clamp(id, rows)))
                        .collect(),
                )
            })
            .collect()
    }

    /// Pins each cached table's `rows`; on failure nothing stays pinned.
    fn pin_rows(&mut self, rows: Vec<Option<Vec<u32>>>) -> Result<Vec<Option<Vec<u32>>>, CudaError> {
        let mut pins: Vec<Option<Vec<u32>>> = Vec::with_capacity(rows.len());
        for (t, r) in rows.into_iter().enumerate() {
            let table = self.tables[t].get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            let got = match r {
                None => Ok(None),
                Some(r) => table.pin(&self.backend, &r).map(Some),
            };
            match got {
                Ok(p) => pins.push(p),
                Err(e) => {
                    self.unpin_all(&pins, false);
                    return Err(e);
                }
            }
        }
        Ok(pins)
    }

    fn unpin_all(&mut self, pins: &[Option<Vec<u32>>], updated: bool) {
        for (t, slots) in pins.iter().enumerate() {
            if let Some(slots) = slots {
                let table = self.tables[t].get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
                table.cache.as_mut().expect("a cached table").unpin(slots, updated);
            }
        }
    }

    /// Loads the rows `kjt` reads into the caches of cached tables and pins them until the
    /// batch's update (its next [`Self::backward_and_update`]) or
    /// [`Self::discard_prefetched`]: the prefetch pipeline's stage.
    pub fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), CudaError> {
        let keys = self.layout.resolve(kjt)?;
        let rows = self.cached_rows(kjt, &keys);
        if rows.iter().all(Option::is_none) {
            return Ok(());
        }
        let f = fingerprint(&rows);
        let pins = self.pin_rows(rows)?;
        self.pending.push((f, pins));
        Ok(())
    }

    /// Sets the factor on every table's optimizer `lr` for the next updates (a learning-rate
    /// schedule's multiplier).
    pub fn set_lr_multiplier(&mut self, multiplier: f64) {
        for t in &mut self.tables {
            t.get_mut().unwrap_or_else(|p| p.into_inner()).spec.lr_multiplier = multiplier;
        }
    }

    /// Unpins every prefetched batch not trained yet.
    pub fn discard_prefetched(&mut self) {
        for (_, pins) in std::mem::take(&mut self.pending) {
            self.unpin_all(&pins, false);
        }
    }

    /// Prefetched batches waiting for their update.
    pub fn prefetched(&self) -> usize {
        self.pending.len()
    }

    /// Sequence lookups of one table: row `ids[i]` at `[i * dim ..]` of the result (ids
    /// outside the table read row 0 unless the bounds check is `fatal`).
    pub fn lookup_rows(&self, name: &str, ids: &[i64]) -> Result<DeviceBuffer, CudaError> {
        let mut t = lock(&self.tables[self.index(name)?]);
        if self.bounds == BoundsCheckMode::Fatal {
            if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= t.spec.rows) {
                return Err(CudaError::Embedding(EmbeddingError::IdOutOfRange {
                    table: name.to_string(),
                    feature: String::new(),
                    sample: ids.iter().position(|&x| x == id).unwrap_or(0),
                    id,
                    rows: t.spec.rows,
                }));
            }
        }
        let be = &self.backend;
        let mut out = be.zeros::<f32>(ids.len() * t.spec.dim)?;
        if ids.is_empty() {
            return Ok(DeviceBuffer(out));
        }
        let ids: Vec<i64> = match t.cache.is_some() {
            false => ids.to_vec(),
            true => {
                let rows: Vec<u32> = ids.iter().map(|&id| clamp(id, t.spec.rows)).collect();
                let pinned = t.pin(be, &rows)?;
                let cache = t.cache.as_mut().expect("a cached table");
                cache.unpin(&pinned, false);
                rows.iter().map(|&r| i64::from(cache.slot(r).expect("rows pinned by this call"))).collect()
            }
        };
        let dev_ids = be.upload(&ids)?;
        let args = [
            Arg::Ptr(t.weights_addr(be)),
            Arg::I64(t.kernel_rows()),
            Arg::I32(t.spec.dim as i32),
            Arg::Ptr(be.addr(&dev_ids, 0)),
            Arg::I64(ids.len() as i64),
            Arg::Ptr(be.addr_mut(&mut out, 0)),
        ];
        // SAFETY: the arguments match trainrec_gather_*'s; rows are clamped to the table (or
        // its slots) and `out` holds ids.len() rows of dim.
        unsafe { be.launch(Kernel::Gather, t.spec.precision, ids.len(), &args)? };
        Ok(DeviceBuffer(out))
    }

    fn index(&self, name: &str) -> Result<usize, CudaError> {
        self.layout
            .tables
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| CudaError::Unsupported(format!("no table \"{name}\" in this collection")))
    }

    /// Table `name`'s weights as fp32, `[rows, dim]` row-major (copied to the host).
    pub fn table_weights(&self, name: &str) -> Result<Vec<f32>, CudaError> {
        let t = lock(&self.tables[self.index(name)?]);
        let (w, _) = t.read_table(&self.backend)?;
        Ok(host::from_stored(t.spec.precision, &w))
    }

    /// Table `name`'s optimizer state (copied to the host).
    pub fn optimizer_state(&self, name: &str) -> Result<Vec<f32>, CudaError> {
        let t = lock(&self.tables[self.index(name)?]);
        if t.spec.state_per_row == 0 {
            return Ok(Vec::new());
        }
        Ok(t.read_table(&self.backend)?.1)
    }

    /// Updates applied so far to table `name`.
    pub fn step_count(&self, name: &str) -> Result<u64, CudaError> {
        Ok(lock(&self.tables[self.index(name)?]).iter)
    }

    /// Replaces table `name`'s weights (fp32 values, rounded to nearest in its precision),
    /// optimizer state (empty: zero) and step count, e.g. from a checkpoint.
    pub fn load_table(&mut self, name: &str, weights: &[f32], state: &[f32], steps: u64) -> Result<(), CudaError> {
        let i = self.index(name)?;
        let t = self.tables[i].get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (n, ns) = (t.spec.rows as usize * t.spec.dim, t.spec.rows as usize * t.spec.state_per_row);
        if weights.len() != n || !(state.is_empty() || state.len() == ns) {
            return Err(CudaError::Unsupported(format!(
                "table \"{name}\": {} weights and {} state values given, expected {n} and {ns}",
                weights.len(),
                state.len()
            )));
        }
        let zeros;
        let state = if state.is_empty() {
            zeros = vec![0f32; ns];
            &zeros[..]
        } else {
            state
        };
        write_table(t, &self.backend, weights, state)?;
        t.iter = steps;
        Ok(())
    }

    /// Re-initialises rows `rows` of table `name` as the CPU collection's
    /// [`EmbeddingBagCollection::reset_rows`] does (`block`: `None`), or as its
    /// [`EmbeddingBagCollection::reset_block_rows`] for a table that is a shard `block` of a
    /// larger table of that many rows: the same values (rounded to nearest in the table's
    /// precision), optimizer state zero. Managed collisions reset the rows whose slot changed
    /// hands this way. A cached table's resident rows change in their slots (dirty), the
    /// others in host memory.
    pub fn reset_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: Option<(&RowBlock, u64)>,
    ) -> Result<(), CudaError> {
        let i = self.index(name)?;
        let t = self.tables[i].get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (n, dim) = (t.spec.rows, t.spec.dim);
        let whole = RowBlock { row_offset: 0, cols: 0..dim, full_dim: dim };
        let (block, table_rows) = block.unwrap_or((&whole, n));
        if let Some(r) = rows.iter().find(|&&r| r >= n) {
            return Err(CudaError::Unsupported(format!("table \"{name}\" has {n} rows, cannot reset row {r}")));
        }
        if block.cols.len() != dim || block.cols.end > block.full_dim {
            return Err(CudaError::Unsupported(format!(
                "table \"{name}\" is {dim} wide but its block says columns {:?} of {}",
                block.cols, block.full_dim
            )));
        }
        // Each row once (the last write of a repeated row would win anyway: the same values).
        let mut rows = rows.to_vec();
        rows.sort_unstable();
        rows.dedup();
        if rows.is_empty() {
            return Ok(());
        }
        let values = trainrec_embedding::reset_values(key, table_rows, block, &rows);
        let weights = host::stored_bytes(&host::to_stored(t.spec.precision, &values));
        let state = vec![0f32; rows.len() * t.spec.state_per_row];
        let slots = |rows: &[u64]| -> Result<Vec<u32>, CudaError> {
            rows.iter()
                .map(|&r| {
                    u32::try_from(r)
                        .map_err(|_| CudaError::Unsupported(format!("table \"{name}\": row {r} is past 2^32")))
                })
                .collect()
        };
        let be = &self.backend;
        if t.cache.is_some() {
            let (mut store, cache) = t.slot_writer(be);
            cache.write_rows(&mut store, &slots(&rows)?, &weights, &state)?;
        } else {
            // An uncached table's rows are the slots.
            let (w, s) = (t.weights_addr_mut(be), be.addr_mut(&mut t.state, 0));
            let mut store = DeviceSlots { be, weights: w, state: s, wbytes: t.wbytes(), spr: t.spec.state_per_row };
            store.write_slots(&slots(&rows)?, &weights, &state)?;
        }
        Ok(())
    }

    /// Copies every table, its optimizer state and step count back into `ebc` (the
    /// collection this one was made from, e.g. to checkpoint it).
    pub fn write_back(&self, ebc: &mut EmbeddingBagCollection) -> Result<(), CudaError> {
        for spec in &self.layout.tables {
            let name = &spec.name;
            ebc.set_table_weights(name, self.table_weights(name)?)?;
            if spec.state_per_row > 0 {
                ebc.set_optimizer_state(name, self.optimizer_state(name)?)?;
            }
            ebc.set_step_count(name, self.step_count(name)?)?;
        }
        Ok(())
    }

    /// Waits for every launch so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.backend.synchronize()
    }
}
