//! Batches copied to the GPU ahead of their use, on a copy stream of the highest priority (as
//! TorchRec's memcpy stream): [`CopyStream`].
//!
//! A batch's host buffers (its ids, bag offsets and per-id weights, its dense features and
//! labels) are packed into one staging slot: page-locked (pinned) host memory, copied with
//! one asynchronous DMA into the slot's device buffer on the copy stream. The slot then
//! belongs to the [`Staged`] batch: [`Staged::wait`] makes the default stream (the kernels'
//! and libtorch's) wait for the copy, and dropping it marks the slot free again once the
//! default stream has passed its reads. A later copy into the slot waits for that on the GPU
//! (the copy stream waits on the default stream's event; the host does not block), and
//! rewrites the pinned memory only after the slot's previous copy is done. Slots grow when a
//! batch is larger (that waits for the slot's earlier use); there are as many as batches
//! staged at once (two in a pipeline that stages batch i+1 while batch i trains).
//!
//! On the emulator the slots are host memory and the copy is a `memcpy`.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use crate::CudaError;
use crate::driver;

/// Where each part of a staged batch starts in its slot: 256-byte aligned.
const ALIGN: usize = 256;

struct GpuSlot {
    host: PinnedHostSlice<u8>,
    dev: CudaSlice<u8>,
    /// The slot's last copy, on the copy stream.
    copied: Option<CudaEvent>,
    /// The default stream after the last reads of the slot.
    used: Option<CudaEvent>,
}

enum SlotMemory {
    Gpu(Option<GpuSlot>),
    #[cfg(feature = "emulator")]
    Host(Vec<u8>),
}

struct Slot {
    memory: SlotMemory,
    /// A [`Staged`] batch holds it.
    busy: bool,
}

enum Engine {
    Gpu {
        ctx: Arc<CudaContext>,
        copy: Arc<CudaStream>,
        default: Arc<CudaStream>,
        priority: i32,
    },
    #[cfg(feature = "emulator")]
    Emulator,
}

/// A copy stream of the highest priority and its staging slots (see the module docs).
pub struct CopyStream {
    engine: Arc<Engine>,
    slots: Mutex<Vec<Arc<Mutex<Slot>>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Each part's offset in a slot, and the slot bytes they need.
fn layout(parts: &[&[u8]]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let offsets = parts
        .iter()
        .map(|p| {
            let o = at;
            at = (at + p.len()).div_ceil(ALIGN) * ALIGN;
            o
        })
        .collect();
    (offsets, at.max(ALIGN))
}

impl CopyStream {
    /// A copy stream on `ctx`'s GPU at the highest priority it offers, ordered against
    /// `default` (the stream the kernels and libtorch run on).
    pub(crate) fn new(ctx: &Arc<CudaContext>, default: Arc<CudaStream>) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        // (least, greatest): numerically lower is higher priority.
        let (_, greatest) =
            cudarc::driver::result::stream::get_priority_range().map_err(driver("cuCtxGetStreamPriorityRange"))?;
        let copy = ctx.new_stream_with_priority(greatest).map_err(driver("cuStreamCreateWithPriority"))?;
        Ok(Self {
            engine: Arc::new(Engine::Gpu { ctx: ctx.clone(), copy, default, priority: greatest }),
            slots: Mutex::new(Vec::new()),
        })
    }

    /// The emulator's: host slots, copies by `memcpy`.
    #[cfg(feature = "emulator")]
    pub(crate) fn emulated() -> Self {
        Self { engine: Arc::new(Engine::Emulator), slots: Mutex::new(Vec::new()) }
    }

    /// The copy stream's priority (`None` on the emulator); lower is higher.
    pub fn priority(&self) -> Option<i32> {
        match &*self.engine {
            Engine::Gpu { priority, .. } => Some(*priority),
            #[cfg(feature = "emulator")]
            Engine::Emulator => None,
        }
    }

    /// Staging slots made so far.
    pub fn slots(&self) -> usize {
        lock(&self.slots).len()
    }

    /// A free slot (a new one when all are held).
    fn free_slot(&self) -> Arc<Mutex<Slot>> {
        let mut slots = lock(&self.slots);
        for s in slots.iter() {
            let mut g = lock(s);
            if !g.busy {
                g.busy = true;
                return s.clone();
            }
        }
        let memory = match &*self.engine {
            Engine::Gpu { .. } => SlotMemory::Gpu(None),
            #[cfg(feature = "emulator")]
            Engine::Emulator => SlotMemory::Host(Vec::new()),
        };
        let s = Arc::new(Mutex::new(Slot { memory, busy: true }));
        slots.push(s.clone());
        s
    }

    /// Copies `parts` to the GPU in one slot on the copy stream; the copy is under way when
    /// this returns (the host buffers may be reused at once).
    pub fn stage(&self, parts: &[&[u8]]) -> Result<Staged, CudaError> {
        let slot = self.free_slot();
        // Holds the slot from here: an error below frees it again.
        let mut staged = Staged { engine: self.engine.clone(), slot, addrs: Vec::new() };
        let (offsets, bytes) = layout(parts);
        let base = {
            let mut g = lock(&staged.slot);
            match (&mut g.memory, &*self.engine) {
                (SlotMemory::Gpu(mem), Engine::Gpu { ctx, copy, .. }) => {
                    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
                    if mem.as_ref().is_some_and(|m| m.host.len() < bytes) {
                        // Too small: its earlier copy and reads finish before it goes.
                        let old = mem.take().expect("checked");
                        for e in [&old.copied, &old.used].into_iter().flatten() {
                            e.synchronize().map_err(driver("cuEventSynchronize"))?;
                        }
                    }
                    if mem.is_none() {
                        let cap = bytes.next_power_of_two();
                        // SAFETY: plain bytes, written below before any copy reads them.
                        let host = unsafe { ctx.alloc_pinned::<u8>(cap) }.map_err(driver("cuMemAllocHost"))?;
                        // SAFETY: as above: written by the copy before the kernels read it.
                        let dev = unsafe { copy.alloc::<u8>(cap) }.map_err(driver("cuMemAlloc"))?;
                        *mem = Some(GpuSlot { host, dev, copied: None, used: None });
                    }
                    let m = mem.as_mut().expect("made above");
                    // The pinned memory is rewritten once its last copy is done (long ago in
                    // a pipeline), the device buffer once the default stream is past its reads.
                    if let Some(e) = &m.copied {
                        e.synchronize().map_err(driver("cuEventSynchronize"))?;
                    }
                    if let Some(e) = m.used.take() {
                        copy.wait(&e).map_err(driver("cuStreamWaitEvent"))?;
                    }
                    let host = m.host.as_mut_slice().map_err(driver("cuEventSynchronize"))?;
                    for (p, &o) in parts.iter().zip(&offsets) {
                        host[o..o + p.len()].copy_from_slice(p);
                    }
                    let (dst, _guard) = m.dev.device_ptr(copy);
                    // SAFETY: `dst` holds `cap >= bytes` bytes, written only by this copy until
                    // the slot's reads are done (the waits above); the pinned source stays
                    // unchanged until `copied` completes (checked before the next rewrite).
                    unsafe { cudarc::driver::result::memcpy_htod_async(dst, &host[..bytes], copy.cu_stream()) }
                        .map_err(driver("cuMemcpyHtoDAsync"))?;
                    m.copied = Some(copy.record_event(None).map_err(driver("cuEventRecord"))?);
                    dst
                }
                #[cfg(feature = "emulator")]
                (SlotMemory::Host(v), Engine::Emulator) => {
                    if v.len() < bytes {
                        *v = vec![0u8; bytes.next_power_of_two()];
                    }
                    for (p, &o) in parts.iter().zip(&offsets) {
                        v[o..o + p.len()].copy_from_slice(p);
                    }
                    v.as_ptr() as u64
                }
                #[cfg(feature = "emulator")]
                _ => unreachable!("a slot's memory follows its engine"),
            }
        };
        staged.addrs = offsets.iter().map(|&o| base + o as u64).collect();
        Ok(staged)
    }
}

/// A batch's parts staged by [`CopyStream::stage`], holding their slot until dropped.
pub struct Staged {
    engine: Arc<Engine>,
    slot: Arc<Mutex<Slot>>,
    addrs: Vec<u64>,
}

impl Staged {
    /// Makes the default stream wait for the copy (work it gets after this sees the parts);
    /// returns each part's address in the collection's memory.
    pub fn wait(&self) -> Result<&[u64], CudaError> {
        match &*self.engine {
            Engine::Gpu { default, .. } => {
                let g = lock(&self.slot);
                if let SlotMemory::Gpu(Some(m)) = &g.memory {
                    if let Some(e) = &m.copied {
                        default.wait(e).map_err(driver("cuStreamWaitEvent"))?;
                    }
                }
            }
            // The emulator copies at once: nothing to wait for.
            #[cfg(feature = "emulator")]
            Engine::Emulator => {}
        }
        Ok(&self.addrs)
    }
}

impl Drop for Staged {
    /// The slot is free again once the default stream has passed what was enqueued so far
    /// (the parts' readers).
    fn drop(&mut self) {
        let mut g = lock(&self.slot);
        if let (Engine::Gpu { default, .. }, SlotMemory::Gpu(Some(m))) = (&*self.engine, &mut g.memory) {
            match default.record_event(None) {
                Ok(e) => m.used = Some(e),
                Err(e) => {
                    // Without the event, wait for the reads now (the slot is reused after).
                    tracing::warn!(error = ?e, "copy stream: cannot record the slot's release; synchronizing");
                    let _ = default.synchronize();
                }
            }
        }
        g.busy = false;
    }
}
