//! One table of a `CudaEbc` on its device: its weights (in GPU memory, or behind a
//! cache of slots there in front of host memory) and the cache's slot store.

use crate::CudaError;
use crate::backend::{Arg, Backend, Buf, Kernel};
use crate::host::{self, KernelTable, StoredWeights};
use trainrec_embedding::{EmbeddingError, RowCache, SlotStore, WeightPrecision};

pub(crate) enum Weights {
    F32(Buf<f32>),
    Bits(Buf<u16>),
}

pub(crate) struct DeviceTable {
    pub(crate) spec: KernelTable,
    /// The table's rows, or a cached table's slots.
    pub(crate) weights: Weights,
    pub(crate) state: Buf<f32>,
    /// Updates applied so far.
    pub(crate) iter: u64,
    /// A cached table's cache: which rows are in which slots, and the whole table in host
    /// memory (its backing file).
    pub(crate) cache: Option<RowCache>,
}

impl Weights {
    /// Stored weights in the backend's memory.
    pub(crate) fn upload(be: &Backend, stored: StoredWeights) -> Result<Self, CudaError> {
        Ok(match stored {
            StoredWeights::F32(v) => Self::F32(be.upload(&v)?),
            StoredWeights::Bits(v) => Self::Bits(be.upload(&v)?),
        })
    }

    pub(crate) fn addr(&self, be: &Backend) -> u64 {
        match self {
            Self::F32(w) => be.addr(w, 0),
            Self::Bits(w) => be.addr(w, 0),
        }
    }
}

impl DeviceTable {
    /// Where its weights start (the kernels' `table` argument).
    pub(crate) fn weights_addr(&self, be: &Backend) -> u64 {
        self.weights.addr(be)
    }

    /// [`Self::weights_addr`] for kernels that write the weights.
    pub(crate) fn weights_addr_mut(&mut self, be: &Backend) -> u64 {
        match &mut self.weights {
            Weights::F32(w) => be.addr_mut(w, 0),
            Weights::Bits(w) => be.addr_mut(w, 0),
        }
    }

    /// Rows the kernels address: the table's, or its cache's slots.
    pub(crate) fn kernel_rows(&self) -> i64 {
        self.cache.as_ref().map_or(self.spec.rows, |c| u64::from(c.slots())) as i64
    }

    pub(crate) fn wbytes(&self) -> usize {
        self.spec.dim * if self.spec.precision == WeightPrecision::Fp32 { 4 } else { 2 }
    }

    /// Its slots as a cache's store that only reads them.
    pub(crate) fn slot_reader<'a>(&self, be: &'a Backend) -> DeviceSlots<'a> {
        let (weights, state) = (self.weights_addr(be), be.addr(&self.state, 0));
        DeviceSlots { be, weights, state, wbytes: self.wbytes(), spr: self.spec.state_per_row }
    }

    /// Its slots as a cache's store, and the cache.
    pub(crate) fn slot_writer<'a>(&mut self, be: &'a Backend) -> (DeviceSlots<'a>, &mut RowCache) {
        let (weights, state) = (self.weights_addr_mut(be), be.addr_mut(&mut self.state, 0));
        let store = DeviceSlots { be, weights, state, wbytes: self.wbytes(), spr: self.spec.state_per_row };
        (store, self.cache.as_mut().expect("a cached table"))
    }

    /// Makes `rows` resident in the cache and pins them (see [`RowCache::pin`]): the slots.
    pub(crate) fn pin(&mut self, be: &Backend, rows: &[u32]) -> Result<Vec<u32>, CudaError> {
        let name = self.spec.name.clone();
        let (mut store, cache) = self.slot_writer(be);
        Ok(cache.pin(&name, &mut store, rows.iter().copied())?)
    }

    /// A cached table's rows `rows` read without changing the cache: each id's position in a
    /// new table of the distinct rows (in first-seen order), that table and its rows.
    pub(crate) fn staged(&self, be: &Backend, rows: &[u32]) -> Result<(Vec<i64>, (Weights, i64)), CudaError> {
        let mut index = std::collections::HashMap::new();
        let mut distinct = Vec::new();
        let ids = rows
            .iter()
            .map(|&r| {
                *index.entry(r).or_insert_with(|| {
                    distinct.push(r);
                    distinct.len() as i64 - 1
                })
            })
            .collect();
        let cache = self.cache.as_ref().expect("a cached table");
        let bytes = cache.read_rows(&mut self.slot_reader(be), &distinct)?;
        let table = Weights::upload(be, host::stored_from_bytes(self.spec.precision, &bytes))?;
        Ok((ids, (table, distinct.len() as i64)))
    }

    /// The whole table as stored (weights' bytes, state), read through the cache if cached.
    pub(crate) fn read_table(&self, be: &Backend) -> Result<(StoredWeights, Vec<f32>), CudaError> {
        match &self.cache {
            None => {
                let w = match &self.weights {
                    Weights::F32(w) => StoredWeights::F32(be.download(w)?),
                    Weights::Bits(w) => StoredWeights::Bits(be.download(w)?),
                };
                let s = if self.spec.state_per_row == 0 { Vec::new() } else { be.download(&self.state)? };
                Ok((w, s))
            }
            Some(cache) => {
                let (w, s) = cache.read_table(&mut self.slot_reader(be))?;
                Ok((host::stored_from_bytes(self.spec.precision, &w), s))
            }
        }
    }
}

/// A cached table's slots in the backend's memory, for its [`RowCache`]: records move
/// between host staging buffers and the slots with `trainrec_copy_rows`.
pub(crate) struct DeviceSlots<'a> {
    pub(crate) be: &'a Backend,
    pub(crate) weights: u64,
    pub(crate) state: u64,
    pub(crate) wbytes: usize,
    pub(crate) spr: usize,
}

impl DeviceSlots<'_> {
    /// Copies `n` records of `bytes` between `src` and `dst` (one side indexed by `rows`).
    pub(crate) fn copy(
        &self,
        src: u64,
        src_rows: u64,
        dst: u64,
        dst_rows: u64,
        stride: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let args = [
            Arg::Ptr(src),
            Arg::I64(stride as i64),
            Arg::Ptr(src_rows),
            Arg::Ptr(dst),
            Arg::I64(stride as i64),
            Arg::Ptr(dst_rows),
            Arg::I64(n as i64),
            Arg::I64(stride as i64),
        ];
        // SAFETY: trainrec_copy_rows's parameters; every record lies in its buffer (slots of
        // the cache, staging buffers of n records).
        unsafe { self.be.launch(Kernel::CopyRows, WeightPrecision::Fp32, n, &args) }
    }

    pub(crate) fn storage(e: CudaError) -> EmbeddingError {
        EmbeddingError::Storage(e.to_string())
    }
}

impl SlotStore for DeviceSlots<'_> {
    fn read_slots(&mut self, slots: &[u32], weights: &mut [u8], state: &mut [f32]) -> Result<(), EmbeddingError> {
        let be = self.be;
        let mut run = || -> Result<(), CudaError> {
            let idx: Vec<i64> = slots.iter().map(|&s| i64::from(s)).collect();
            let idx = be.upload(&idx)?;
            let mut w = be.zeros::<u8>(weights.len())?;
            self.copy(self.weights, be.addr(&idx, 0), be.addr_mut(&mut w, 0), 0, self.wbytes, slots.len())?;
            weights.copy_from_slice(&be.download(&w)?[..weights.len()]);
            if self.spr > 0 {
                let mut s = be.zeros::<f32>(state.len())?;
                self.copy(self.state, be.addr(&idx, 0), be.addr_mut(&mut s, 0), 0, self.spr * 4, slots.len())?;
                state.copy_from_slice(&be.download(&s)?[..state.len()]);
            }
            Ok(())
        };
        run().map_err(Self::storage)
    }

    fn write_slots(&mut self, slots: &[u32], weights: &[u8], state: &[f32]) -> Result<(), EmbeddingError> {
        let be = self.be;
        let run = || -> Result<(), CudaError> {
            let idx: Vec<i64> = slots.iter().map(|&s| i64::from(s)).collect();
            let idx = be.upload(&idx)?;
            let w = be.upload(weights)?;
            self.copy(be.addr(&w, 0), 0, self.weights, be.addr(&idx, 0), self.wbytes, slots.len())?;
            if self.spr > 0 {
                let s = be.upload(state)?;
                self.copy(be.addr(&s, 0), 0, self.state, be.addr(&idx, 0), self.spr * 4, slots.len())?;
            }
            Ok(())
        };
        run().map_err(Self::storage)
    }
}

/// Writes a whole table (fp32 weights rounded to its precision, its state): into its buffers,
/// or a cached table's backing file and resident slots.
pub(crate) fn write_table(t: &mut DeviceTable, be: &Backend, weights: &[f32], state: &[f32]) -> Result<(), CudaError> {
    let stored = host::to_stored(t.spec.precision, weights);
    if t.cache.is_none() {
        match (&mut t.weights, stored) {
            (Weights::F32(w), StoredWeights::F32(v)) => be.write(&v, w)?,
            (Weights::Bits(w), StoredWeights::Bits(v)) => be.write(&v, w)?,
            _ => unreachable!("a table's stored form follows its precision"),
        }
        if t.spec.state_per_row > 0 {
            be.write(state, &mut t.state)?;
        }
        return Ok(());
    }
    let (mut store, cache) = t.slot_writer(be);
    cache.write_table(&mut store, &host::stored_bytes(&stored), state)?;
    Ok(())
}

/// Writes rows `rows` (each once) of a cached table: weights fp32 (`[rows, dim]`) and
/// optimizer state (`[rows, spr]`), to their slots or the backing store.
pub(crate) fn write_rows(
    t: &mut DeviceTable,
    be: &Backend,
    rows: &[u32],
    weights: &[f32],
    state: &[f32],
) -> Result<(), CudaError> {
    let stored = host::to_stored(t.spec.precision, weights);
    let (mut store, cache) = t.slot_writer(be);
    cache.write_rows(&mut store, rows, &host::stored_bytes(&stored), state)?;
    Ok(())
}

/// A slice's bytes.
pub(crate) fn bytemuck_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain integers and floats (i64, f32) have no padding; the bytes are only read.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
