//! Cached tables (the `fused_uvm_caching` and `key_value` kernels on CPU): a fixed number of
//! cache slots in memory in front of the whole table, weights and optimizer state, in
//! memory-mapped files on disk, so a table larger than RAM trains.
//!
//! The cache is fully associative. A row is resident in at most one slot; `slot_of` maps a
//! table row to its slot in O(1) (4 bytes per table row in lazily zeroed memory, or for a
//! `key_value` table a hash map of the resident rows). Resident
//! rows that no batch has pinned wait in an ordered set by eviction score (LRU: the batch
//! that last used them; LFU: how many batches used the row so far, then recency), so a miss
//! evicts the lowest score in O(log slots). Dirty rows (updated since loaded) are written back
//! to the file when evicted. Pinned rows are never evicted: a prefetched batch's rows stay
//! resident until its update is done, so a pipeline can load batch i+1 while batch i trains.
//!
//! Two backing stores sit behind the slots ([`CacheBacking`]): `Rows` (the
//! `fused_uvm_caching` kernel) keeps one record per table row in a file filled with the
//! initial weights when the table is built; `KeyValue` (the `key_value` kernel) keeps records
//! of the rows written so far only, found through a hash index, in files that grow as rows
//! come: an untouched row reads as its initial weights (computed on demand, the values a table
//! in memory starts with) and zero state, so the table is built at once and takes disk and
//! memory in proportion to the rows a run touches, not to its size.
//!
//! The kernels run unchanged on the slots: ids are translated to slots first. A row moves
//! between file and slot bit for bit, and the backward sums each row's gradients in the same
//! (stable) order whichever slot it has, so a cached table trains exactly like one in memory
//! (fp32, and fp16/bf16 with round-to-nearest; stochastic rounding draws per slot).

use std::collections::BTreeSet;
use std::ops::Range;

use crate::EmbeddingError;
use crate::backing::{Backing, InitRows, Segment, backing_file, bytes_of, bytes_of_mut};
use crate::config::{CacheBacking, CacheConfig, CachePolicy};
use crate::precision::Weight;
use crate::storage::{HugeBuf, Pod};
use crate::tbe::Tbe;

/// Counters of one table's cache since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Distinct rows requested, summed over batches.
    pub requests: u64,
    /// Requests whose row was resident.
    pub hits: u64,
    /// Requests that loaded their row from the backing file.
    pub misses: u64,
    /// Resident rows dropped to make room.
    pub evictions: u64,
    /// Evicted rows written back because they had been updated.
    pub writebacks: u64,
    /// Bytes read from the backing file into the cache.
    pub loaded_bytes: u64,
    /// Bytes written back to the backing file.
    pub written_bytes: u64,
}

impl CacheStats {
    /// Hits over requests (1 when nothing was requested).
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 { 1.0 } else { self.hits as f64 / self.requests as f64 }
    }
}

const FREE: u32 = u32::MAX;

/// Where a cache's slots live: the CPU engine's table-batched buffers, or a GPU's memory (the
/// CUDA engine). A slot's record is its row's weights in the stored precision (`dim` values,
/// as bytes) and its optimizer state (`state_per_row` floats), as the backing file holds them.
/// The cache hands over every copy of a call at once (a GPU batches them).
pub trait SlotStore {
    /// Copies the records of `slots` out: slot `slots[i]`'s weights into `weights[i * wbytes..]`
    /// and its state into `state[i * spr..]`.
    fn read_slots(&mut self, slots: &[u32], weights: &mut [u8], state: &mut [f32]) -> Result<(), EmbeddingError>;
    /// Writes records into `slots`, laid out as [`SlotStore::read_slots`] gives them.
    fn write_slots(&mut self, slots: &[u32], weights: &[u8], state: &[f32]) -> Result<(), EmbeddingError>;
}

/// The slots of table `t` of a CPU group.
pub(crate) struct TbeSlots<'a, T: Weight + Pod> {
    pub tbe: &'a mut Tbe<T>,
    pub t: usize,
}

impl<T: Weight + Pod> SlotStore for TbeSlots<'_, T> {
    fn read_slots(&mut self, slots: &[u32], weights: &mut [u8], state: &mut [f32]) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.tbe.slots[self.t].dim * size_of::<T>(), self.tbe.slots[self.t].spr);
        for (i, &slot) in slots.iter().enumerate() {
            let (w, s) = self.tbe.row(self.t, slot as usize);
            weights[i * wb..][..wb].copy_from_slice(bytes_of(w));
            state[i * spr..][..spr].copy_from_slice(s);
        }
        Ok(())
    }

    fn write_slots(&mut self, slots: &[u32], weights: &[u8], state: &[f32]) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.tbe.slots[self.t].dim * size_of::<T>(), self.tbe.slots[self.t].spr);
        for (i, &slot) in slots.iter().enumerate() {
            let (w, s) = self.tbe.row_mut(self.t, slot as usize);
            bytes_of_mut(w).copy_from_slice(&weights[i * wb..][..wb]);
            s.copy_from_slice(&state[i * spr..][..spr]);
        }
        Ok(())
    }
}

/// One table's cache state: which rows are in which slots, their pins and eviction order,
/// and the backing store (the slots' weights and state live in a [`SlotStore`]).
pub struct RowCache {
    pub(crate) slots: u32,
    rows: u64,
    dim: usize,
    spr: usize,
    /// Bytes of one row's weights in the file.
    wbytes: usize,
    policy: CachePolicy,
    backing: Backing,
    slot_of: RowMap,
    row_of: Vec<u32>,
    pins: Vec<u32>,
    dirty: Vec<bool>,
    score: Vec<u64>,
    mark: Vec<u64>,
    freq: RowMap,
    queue: BTreeSet<(u64, u32)>,
    free: Vec<u32>,
    call: u64,
    /// Evicted dirty slots of the current call and the rows they held: written back first.
    writebacks: Vec<(u32, u32)>,
    /// Slots the current call fills and the rows they get.
    loads: Vec<(u32, u32)>,
    /// Counters since the cache was built.
    pub stats: CacheStats,
}

/// A `u32` per table row, zero until set: an array over every row (4 bytes a row, in lazily
/// zeroed memory) for a table whose every row has a record anyway, a hash map of the rows set
/// for a `KeyValue` table (memory in proportion to the rows a run touches).
enum RowMap {
    Dense(HugeBuf<u32>),
    Hashed(rustc_hash::FxHashMap<u32, u32>),
}

impl RowMap {
    fn new(backing: CacheBacking, rows: u64, what: &str) -> Result<Self, EmbeddingError> {
        Ok(match backing {
            CacheBacking::Rows => Self::Dense(HugeBuf::zeroed(rows as usize, what)?),
            CacheBacking::KeyValue => Self::Hashed(Default::default()),
        })
    }

    #[inline]
    fn get(&self, row: u32) -> u32 {
        match self {
            Self::Dense(b) => b.as_slice()[row as usize],
            Self::Hashed(m) => m.get(&row).copied().unwrap_or(0),
        }
    }

    #[inline]
    fn set(&mut self, row: u32, v: u32) {
        match self {
            Self::Dense(b) => b.as_mut_slice()[row as usize] = v,
            Self::Hashed(m) if v == 0 => {
                m.remove(&row);
            }
            Self::Hashed(m) => {
                m.insert(row, v);
            }
        }
    }
}

/// Rows a whole-table pass handles at once.
const CHUNK: u64 = 1 << 16;

impl RowCache {
    /// A cache of `config.slots` rows over a `rows x dim` table of weight type `T` with `spr`
    /// optimizer state values per row; the table's initial weights are `init(rows)` (fp32,
    /// row-major, the same values whichever rows are asked together), its state zero. `name`
    /// names the table in errors.
    pub(crate) fn new<T: Weight + Pod + 'static>(
        name: &str,
        config: &CacheConfig,
        rows: u64,
        dim: usize,
        spr: usize,
        init: impl Fn(Range<u64>) -> Vec<f32> + Send + Sync + 'static,
    ) -> Result<Self, EmbeddingError> {
        if config.slots == 0 || config.slots > rows {
            return Err(EmbeddingError::Config(format!(
                "table \"{name}\": a cache of {} rows for a table of {rows} rows (needs 1..={rows})",
                config.slots
            )));
        }
        if rows >= u64::from(FREE) {
            return Err(EmbeddingError::Config(format!("table \"{name}\": cached tables hold under 2^32 - 1 rows")));
        }
        let wbytes = dim * size_of::<T>();
        let rec = wbytes + spr * 4;
        let init: InitRows = Box::new(move |r| {
            let w: Vec<T> = init(r).into_iter().map(T::from_f32).collect();
            bytes_of(&w).to_vec()
        });
        let mut backing = Backing {
            kind: config.backing,
            rec,
            wbytes,
            rows,
            segments: Vec::new(),
            index: Default::default(),
            records: 0,
            capacity: 0,
            init,
            name: name.to_string(),
            dir: config.dir.clone(),
        };
        if config.backing == CacheBacking::Rows {
            // One record per row: weights, then optimizer state.
            let total = (rows as usize).checked_mul(rec).ok_or_else(|| {
                EmbeddingError::Config(format!("table \"{name}\" ({rows} x {dim}) is too large to address"))
            })?;
            let mut map = backing_file(name, &config.dir, total)?;
            let mut r = 0;
            while r < rows {
                let end = (r + CHUNK).min(rows);
                let w = (backing.init)(r..end);
                for (i, w) in w.chunks_exact(wbytes.max(1)).enumerate() {
                    let o = (r as usize + i) * rec;
                    map[o..o + wbytes].copy_from_slice(w);
                }
                r = end;
            }
            // Misses read single rows: no read-ahead around them.
            let _ = map.advise(memmap2::Advice::Random);
            backing.segments.push(Segment { map, first: 0, len: rows as u32 });
        }
        let slots = config.slots as u32;
        let lfu = config.policy == CachePolicy::Lfu;
        Ok(Self {
            slots,
            rows,
            dim,
            spr,
            wbytes,
            policy: config.policy,
            backing,
            slot_of: RowMap::new(config.backing, rows, "cache index")?,
            row_of: vec![FREE; slots as usize],
            pins: vec![0; slots as usize],
            dirty: vec![false; slots as usize],
            score: vec![0; slots as usize],
            mark: vec![0; slots as usize],
            freq: RowMap::new(config.backing, if lfu { rows } else { 0 }, "cache frequencies")?,
            queue: BTreeSet::new(),
            free: (0..slots).rev().collect(),
            call: 0,
            writebacks: Vec::new(),
            loads: Vec::new(),
            stats: CacheStats::default(),
        })
    }

    /// A cache of `config.slots` rows of a `rows x dim` table of `precision` weights with
    /// `spr` optimizer state values per row, its backing store holding `init(rows)` (fp32,
    /// row-major) and zero state: the cache of another engine's slots (the CUDA engine's).
    pub fn with_precision(
        precision: crate::WeightPrecision,
        name: &str,
        config: &CacheConfig,
        rows: u64,
        dim: usize,
        spr: usize,
        init: impl Fn(Range<u64>) -> Vec<f32> + Send + Sync + 'static,
    ) -> Result<Self, EmbeddingError> {
        match precision {
            crate::WeightPrecision::Fp32 => Self::new::<f32>(name, config, rows, dim, spr, init),
            crate::WeightPrecision::Fp16 => Self::new::<half::f16>(name, config, rows, dim, spr, init),
            crate::WeightPrecision::Bf16 => Self::new::<half::bf16>(name, config, rows, dim, spr, init),
        }
    }

    /// What holds the rows the cache does not.
    pub fn backing(&self) -> crate::CacheBacking {
        self.backing.kind
    }

    /// Cache slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Rows with a record in the backing store: every row for [`CacheBacking::Rows`], the rows
    /// written so far for [`CacheBacking::KeyValue`].
    pub fn stored_rows(&self) -> u64 {
        self.backing.stored()
    }

    /// The slot holding `row`, if resident.
    #[inline]
    pub fn slot(&self, row: u32) -> Option<u32> {
        match self.slot_of.get(row) {
            0 => None,
            s => Some(s - 1),
        }
    }

    /// Makes each row of `rows` resident and pins it once (a row listed twice counts once).
    /// Returns the slots pinned. When the cache cannot hold them all (every slot pinned),
    /// nothing stays pinned by this call and the error says how many rows were asked for.
    pub fn pin(
        &mut self,
        name: &str,
        store: &mut dyn SlotStore,
        rows: impl Iterator<Item = u32>,
    ) -> Result<Vec<u32>, EmbeddingError> {
        let r = self.assign(name, rows);
        // Queued copies run even when the call failed: the bookkeeping already moved.
        self.flush(store)?;
        r
    }

    /// The bookkeeping of [`Self::pin`]: slots chosen, evictions and loads queued.
    fn assign(&mut self, name: &str, rows: impl Iterator<Item = u32>) -> Result<Vec<u32>, EmbeddingError> {
        self.call += 1;
        let call = self.call;
        let rows: Vec<u32> = rows.collect();
        self.read_ahead(&rows);
        let mut pinned = Vec::new();
        for row in rows {
            let slot = match self.slot(row) {
                Some(s) if self.mark[s as usize] == call => continue,
                Some(s) => {
                    self.stats.hits += 1;
                    if self.pins[s as usize] == 0 {
                        self.queue.remove(&(self.score[s as usize], s));
                    }
                    s
                }
                None => {
                    let Some(s) = self.take_slot() else {
                        let asked = pinned.len() + 1;
                        self.unpin(&pinned, false);
                        return Err(EmbeddingError::Config(format!(
                            "table \"{name}\": its cache of {} rows cannot hold the {asked}+ distinct rows pinned \
                             now (this batch's, and a prefetched one's): raise the table's \
                             constraints.cache.load_factor or lower the batch size",
                            self.slots
                        )));
                    };
                    self.load(s, row);
                    self.stats.misses += 1;
                    s
                }
            };
            self.stats.requests += 1;
            let si = slot as usize;
            self.mark[si] = call;
            self.pins[si] += 1;
            self.score[si] = match self.policy {
                CachePolicy::Lru => call,
                CachePolicy::Lfu => {
                    let f = self.freq.get(row).saturating_add(1);
                    self.freq.set(row, f);
                    (u64::from(f) << 32) | (call & 0xFFFF_FFFF)
                }
            };
            pinned.push(slot);
        }
        Ok(pinned)
    }

    /// Releases one pin of each slot; `updated` marks them dirty (written back on eviction).
    pub fn unpin(&mut self, slots: &[u32], updated: bool) {
        for &s in slots {
            let si = s as usize;
            debug_assert!(self.pins[si] > 0, "slot {s} unpinned more often than pinned");
            self.pins[si] -= 1;
            self.dirty[si] |= updated;
            if self.pins[si] == 0 {
                self.queue.insert((self.score[si], s));
            }
        }
    }

    /// A free slot, or the lowest-scored unpinned one evicted (written back when dirty).
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (_, s) = self.queue.pop_first()?;
        let old = self.row_of[s as usize];
        if self.dirty[s as usize] {
            self.writebacks.push((s, old));
            self.stats.writebacks += 1;
            self.stats.written_bytes += self.record() as u64;
        }
        self.slot_of.set(old, 0);
        self.row_of[s as usize] = FREE;
        self.stats.evictions += 1;
        Some(s)
    }

    /// Bytes of one row's record: its weights, then its optimizer state (one record per row,
    /// so a miss reads one place of the disk).
    fn record(&self) -> usize {
        self.backing.rec
    }

    /// Asks the kernel to start reading the backing store's pages of the rows of `rows` that
    /// are not resident, all at once.
    pub(crate) fn read_ahead(&self, rows: &[u32]) {
        self.backing.read_ahead(rows.iter().copied().filter(|&r| self.slot(r).is_none()));
    }

    /// Queues `row`'s copy from the file into `slot` (clean).
    fn load(&mut self, slot: u32, row: u32) {
        self.loads.push((slot, row));
        self.slot_of.set(row, slot + 1);
        self.row_of[slot as usize] = row;
        self.dirty[slot as usize] = false;
        self.stats.loaded_bytes += self.record() as u64;
    }

    /// Runs the queued copies: evicted dirty slots into the file first (a row evicted and
    /// reloaded by the same call reads what was written back), then the loads into their
    /// slots.
    fn flush(&mut self, store: &mut dyn SlotStore) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.wbytes, self.spr);
        let writebacks = std::mem::take(&mut self.writebacks);
        if !writebacks.is_empty() {
            let slots: Vec<u32> = writebacks.iter().map(|&(s, _)| s).collect();
            let (mut w, mut st) = (vec![0u8; slots.len() * wb], vec![0f32; slots.len() * spr]);
            store.read_slots(&slots, &mut w, &mut st)?;
            for (i, &(_, row)) in writebacks.iter().enumerate() {
                let r = self.backing.record_mut(row)?;
                r[..wb].copy_from_slice(&w[i * wb..][..wb]);
                r[wb..].copy_from_slice(bytes_of(&st[i * spr..][..spr]));
            }
        }
        let loads = std::mem::take(&mut self.loads);
        if !loads.is_empty() {
            let slots: Vec<u32> = loads.iter().map(|&(s, _)| s).collect();
            let (mut w, mut st) = (vec![0u8; slots.len() * wb], vec![0f32; slots.len() * spr]);
            for (i, &(_, row)) in loads.iter().enumerate() {
                self.backing.read_w(row, &mut w[i * wb..][..wb]);
                self.backing.read_s(row, &mut st[i * spr..][..spr]);
            }
            store.write_slots(&slots, &w, &st)?;
        }
        Ok(())
    }

    /// The resident (slot, row) pairs.
    fn resident(&self) -> Vec<(u32, u32)> {
        self.row_of.iter().enumerate().filter(|(_, r)| **r != FREE).map(|(s, r)| (s as u32, *r)).collect()
    }

    /// The whole table as stored: every row's weights (bytes of the stored precision,
    /// `[rows, dim]`) and optimizer state (`[rows, spr]`), resident rows read from `store`.
    pub fn read_table(&self, store: &mut dyn SlotStore) -> Result<(Vec<u8>, Vec<f32>), EmbeddingError> {
        let (wb, spr) = (self.wbytes, self.spr);
        let (mut w, mut st) = self.stored_table();
        let resident = self.resident();
        if !resident.is_empty() {
            let slots: Vec<u32> = resident.iter().map(|&(s, _)| s).collect();
            let (mut sw, mut ss) = (vec![0u8; slots.len() * wb], vec![0f32; slots.len() * spr]);
            store.read_slots(&slots, &mut sw, &mut ss)?;
            for (i, &(_, r)) in resident.iter().enumerate() {
                w[r as usize * wb..][..wb].copy_from_slice(&sw[i * wb..][..wb]);
                st[r as usize * spr..][..spr].copy_from_slice(&ss[i * spr..][..spr]);
            }
        }
        Ok((w, st))
    }

    /// The weights of `rows` as stored (bytes, one row after another): resident rows read
    /// from `store` in one call, the others from the file. Changes nothing (a lookup of a
    /// batch with more distinct rows than the cache has slots).
    pub fn read_rows(&self, store: &mut dyn SlotStore, rows: &[u32]) -> Result<Vec<u8>, EmbeddingError> {
        let wb = self.wbytes;
        self.read_ahead(rows);
        let mut out = vec![0u8; rows.len() * wb];
        let mut resident: Vec<(usize, u32)> = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            match self.slot(r) {
                Some(s) => resident.push((i, s)),
                None => self.backing.read_w(r, &mut out[i * wb..][..wb]),
            }
        }
        if !resident.is_empty() {
            let slots: Vec<u32> = resident.iter().map(|&(_, s)| s).collect();
            let (mut w, mut st) = (vec![0u8; slots.len() * wb], vec![0f32; slots.len() * self.spr]);
            store.read_slots(&slots, &mut w, &mut st)?;
            for (j, &(i, _)) in resident.iter().enumerate() {
                out[i * wb..][..wb].copy_from_slice(&w[j * wb..][..wb]);
            }
        }
        Ok(out)
    }

    /// The backing store's records of every row (resident rows as last written back):
    /// weights as stored, `[rows, dim]`, and state, `[rows, spr]`.
    fn stored_table(&self) -> (Vec<u8>, Vec<f32>) {
        let (mut w, mut st) = (Vec::new(), Vec::new());
        let mut r = 0;
        while r < self.rows {
            let end = (r + CHUNK).min(self.rows);
            let (cw, cs) = self.backing.read_range(r..end, self.spr);
            w.extend_from_slice(&cw);
            st.extend_from_slice(&cs);
            r = end;
        }
        (w, st)
    }

    /// Writes whole-table weights (as stored) and state into the backing store (a
    /// `KeyValue` store keeps rows that still read as initial unstored).
    fn store_table(&mut self, weights: Option<&[u8]>, state: Option<&[f32]>) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.wbytes, self.spr);
        let mut r = 0;
        while r < self.rows {
            let end = (r + CHUNK).min(self.rows);
            let initial = match (self.backing.kind, weights) {
                (CacheBacking::KeyValue, Some(_)) => Some((self.backing.init)(r..end)),
                _ => None,
            };
            for row in r..end {
                let (i, ri) = (row as usize, (row - r) as usize);
                self.backing.write(
                    row as u32,
                    weights.map(|w| &w[i * wb..][..wb]),
                    state.map(|s| &s[i * spr..][..spr]),
                    initial.as_ref().map(|w| &w[ri * wb..][..wb]),
                )?;
            }
            r = end;
        }
        Ok(())
    }

    /// Replaces the whole table (as [`Self::read_table`] gives it): the backing store, and
    /// the resident rows' slots (which stay clean).
    pub fn write_table(
        &mut self,
        store: &mut dyn SlotStore,
        weights: &[u8],
        state: &[f32],
    ) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.wbytes, self.spr);
        if weights.len() != self.rows as usize * wb || state.len() != self.rows as usize * spr {
            return Err(EmbeddingError::Shape(format!(
                "a table of {} rows needs {} weight bytes and {} state values, got {} and {}",
                self.rows,
                self.rows as usize * wb,
                self.rows as usize * spr,
                weights.len(),
                state.len()
            )));
        }
        self.store_table(Some(weights), Some(state))?;
        let resident = self.resident();
        if !resident.is_empty() {
            let slots: Vec<u32> = resident.iter().map(|&(s, _)| s).collect();
            let (mut sw, mut ss) = (vec![0u8; slots.len() * wb], vec![0f32; slots.len() * spr]);
            for (i, &(_, r)) in resident.iter().enumerate() {
                sw[i * wb..][..wb].copy_from_slice(&weights[r as usize * wb..][..wb]);
                ss[i * spr..][..spr].copy_from_slice(&state[r as usize * spr..][..spr]);
            }
            store.write_slots(&slots, &sw, &ss)?;
            for &(s, _) in &resident {
                self.dirty[s as usize] = false;
            }
        }
        Ok(())
    }

    /// Replaces the records of `rows` (each listed once): weights as stored (bytes, one row
    /// after another, as [`Self::read_rows`] gives them) and optimizer state (`spr` floats a
    /// row). Resident rows go to their slots through `store` in one call (then dirty), the
    /// others to the file.
    pub fn write_rows(
        &mut self,
        store: &mut dyn SlotStore,
        rows: &[u32],
        weights: &[u8],
        state: &[f32],
    ) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.wbytes, self.spr);
        if weights.len() != rows.len() * wb || state.len() != rows.len() * spr {
            return Err(EmbeddingError::Shape(format!(
                "{} rows need {} weight bytes and {} state values, got {} and {}",
                rows.len(),
                rows.len() * wb,
                rows.len() * spr,
                weights.len(),
                state.len()
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| u64::from(r) >= self.rows) {
            return Err(EmbeddingError::Shape(format!("the table has {} rows, cannot write row {r}", self.rows)));
        }
        let (mut slots, mut sw, mut ss) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &r) in rows.iter().enumerate() {
            let (w, st) = (&weights[i * wb..][..wb], &state[i * spr..][..spr]);
            match self.slot(r) {
                Some(s) => {
                    slots.push(s);
                    sw.extend_from_slice(w);
                    ss.extend_from_slice(st);
                }
                None => self.backing.write(r, Some(w), Some(st), None)?,
            }
        }
        if !slots.is_empty() {
            store.write_slots(&slots, &sw, &ss)?;
            for &s in &slots {
                self.dirty[s as usize] = true;
            }
        }
        Ok(())
    }

    /// Row `row`'s weights as fp32 into `out` (`dim` floats), from its slot or the file.
    pub(crate) fn read_row<T: Weight + Pod>(&self, tbe: &Tbe<T>, t: usize, row: u32, out: &mut [f32]) {
        match self.slot(row) {
            Some(s) => out.iter_mut().zip(tbe.row(t, s as usize).0).for_each(|(o, w)| *o = w.to_f32()),
            None => {
                let mut w = vec![T::from_f32(0.0); self.dim];
                self.backing.read_w(row, bytes_of_mut(&mut w));
                out.iter_mut().zip(w).for_each(|(o, w)| *o = w.to_f32());
            }
        }
    }

    /// The whole table's weights as fp32, `[rows, dim]`, and its optimizer state,
    /// `[rows, spr]`.
    pub(crate) fn table_f32<T: Weight + Pod>(&self, tbe: &Tbe<T>, t: usize) -> (Vec<f32>, Vec<f32>) {
        let (bytes, mut state) = self.stored_table();
        let mut w = vec![T::from_f32(0.0); self.rows as usize * self.dim];
        bytes_of_mut(&mut w).copy_from_slice(&bytes);
        drop(bytes);
        let mut out: Vec<f32> = w.into_iter().map(|x| x.to_f32()).collect();
        for (s, r) in self.resident() {
            let (rw, rs) = tbe.row(t, s as usize);
            let r = r as usize;
            out[r * self.dim..][..self.dim].iter_mut().zip(rw).for_each(|(o, x)| *o = x.to_f32());
            state[r * self.spr..][..self.spr].copy_from_slice(rs);
        }
        (out, state)
    }

    /// Rows of a `KeyValue` table that hold anything but their initial weights and zero
    /// state: those with a record in the store or in a slot, ascending. `None` for a `Rows`
    /// store (every row has a record).
    pub(crate) fn written_rows(&self) -> Option<Vec<u32>> {
        if self.backing.kind != CacheBacking::KeyValue {
            return None;
        }
        let mut rows: Vec<u32> =
            self.backing.index.keys().copied().chain(self.row_of.iter().copied().filter(|&r| r != FREE)).collect();
        rows.sort_unstable();
        rows.dedup();
        Some(rows)
    }

    /// The weights as fp32 (`[rows, dim]`) and optimizer state (`[rows, spr]`) of `rows`,
    /// from their slots or the store.
    pub(crate) fn rows_f32<T: Weight + Pod>(&self, tbe: &Tbe<T>, t: usize, rows: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let (dim, spr) = (self.dim, self.spr);
        let (mut w, mut st) = (vec![0f32; rows.len() * dim], vec![0f32; rows.len() * spr]);
        let mut stored = vec![T::from_f32(0.0); dim];
        for (i, &r) in rows.iter().enumerate() {
            let (ow, os) = (&mut w[i * dim..][..dim], &mut st[i * spr..][..spr]);
            match self.slot(r) {
                Some(s) => {
                    let (rw, rs) = tbe.row(t, s as usize);
                    ow.iter_mut().zip(rw).for_each(|(o, x)| *o = x.to_f32());
                    os.copy_from_slice(rs);
                }
                None => {
                    self.backing.read_w(r, bytes_of_mut(&mut stored));
                    ow.iter_mut().zip(&stored).for_each(|(o, x)| *o = x.to_f32());
                    self.backing.read_s(r, os);
                }
            }
        }
        (w, st)
    }

    /// Replaces the whole table's weights (fp32, rounded to nearest) or optimizer state, in
    /// the resident rows' slots (then dirty) and the backing store.
    pub(crate) fn set_table<T: Weight + Pod>(
        &mut self,
        tbe: &mut Tbe<T>,
        t: usize,
        weights: Option<&[f32]>,
        state: Option<&[f32]>,
    ) -> Result<(), EmbeddingError> {
        let stored: Option<Vec<T>> = weights.map(|w| w.iter().map(|&x| T::from_f32(x)).collect());
        self.store_table(stored.as_deref().map(bytes_of), state)?;
        for (s, r) in self.resident() {
            let (dw, ds) = tbe.row_mut(t, s as usize);
            let r = r as usize;
            if let Some(w) = &stored {
                dw.copy_from_slice(&w[r * self.dim..][..self.dim]);
            }
            if let Some(st) = state {
                ds.copy_from_slice(&st[r * self.spr..][..self.spr]);
            }
            self.dirty[s as usize] = true;
        }
        Ok(())
    }

    /// Replaces row `row`'s weights (rounded to nearest) and, when given, its state, in its
    /// slot (then dirty) or in the file.
    pub(crate) fn write_row<T: Weight + Pod>(
        &mut self,
        tbe: &mut Tbe<T>,
        t: usize,
        row: u32,
        w: &[f32],
        state: Option<&[f32]>,
    ) -> Result<(), EmbeddingError> {
        match self.slot(row) {
            Some(s) => {
                let (dw, ds) = tbe.row_mut(t, s as usize);
                dw.iter_mut().zip(w).for_each(|(d, &x)| *d = T::from_f32(x));
                if let Some(st) = state {
                    ds.copy_from_slice(st);
                }
                self.dirty[s as usize] = true;
                Ok(())
            }
            None => {
                let row_w: Vec<T> = w.iter().map(|&x| T::from_f32(x)).collect();
                self.backing.write(row, Some(bytes_of(&row_w)), state, None)
            }
        }
    }
}
