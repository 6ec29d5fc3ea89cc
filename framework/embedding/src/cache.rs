//! Cached tables (the `fused_uvm_caching` kernel on CPU): a fixed number of cache slots in
//! memory in front of the whole table, weights and optimizer state, in a memory-mapped file
//! on disk, so a table larger than RAM trains.
//!
//! The cache is fully associative. A row is resident in at most one slot; `slot_of` maps a
//! table row to its slot in O(1) (4 bytes per table row, in lazily zeroed memory). Resident
//! rows that no batch has pinned wait in an ordered set by eviction score (LRU: the batch
//! that last used them; LFU: how many batches used the row so far, then recency), so a miss
//! evicts the lowest score in O(log slots). Dirty rows (updated since loaded) are written back
//! to the file when evicted. Pinned rows are never evicted: a prefetched batch's rows stay
//! resident until its update is done, so a pipeline can load batch i+1 while batch i trains.
//!
//! The kernels run unchanged on the slots: ids are translated to slots first. A row moves
//! between file and slot bit for bit, and the backward sums each row's gradients in the same
//! (stable) order whichever slot it has, so a cached table trains exactly like one in memory
//! (fp32, and fp16/bf16 with round-to-nearest; stochastic rounding draws per slot).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use memmap2::MmapMut;

use crate::EmbeddingError;
use crate::precision::Weight;
use crate::storage::{HugeBuf, Pod};
use crate::tbe::Tbe;

/// Which unpinned resident row a full cache evicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CachePolicy {
    /// The row whose last use is oldest.
    #[default]
    Lru,
    /// The row used by the fewest batches so far (counted over the whole run, resident or
    /// not: FBGEMM's LFU), the oldest last use among equals.
    Lfu,
}

/// A table's cache: `slots` rows in memory in front of the whole table in a file under `dir`.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Rows the cache holds, in `1..=rows` (TorchRec: load factor × rows).
    pub slots: u64,
    /// Eviction policy.
    pub policy: CachePolicy,
    /// Directory of the backing file. The file is unlinked as soon as it is mapped: nothing
    /// stays behind, even after a crash.
    pub dir: PathBuf,
}

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

// SAFETY: a primitive integer, valid for any bits.
unsafe impl Pod for u32 {}

fn bytes_of<T: Pod>(s: &[T]) -> &[u8] {
    // SAFETY: T is plain old data (no padding, any bits valid), so its memory is bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

fn bytes_of_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; any byte pattern written is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
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
/// and the backing file (the slots' weights and state live in a [`SlotStore`]).
pub struct RowCache {
    pub(crate) slots: u32,
    rows: u64,
    dim: usize,
    spr: usize,
    /// Bytes of one row's weights in the file.
    wbytes: usize,
    policy: CachePolicy,
    file: MmapMut,
    slot_of: HugeBuf<u32>,
    row_of: Vec<u32>,
    pins: Vec<u32>,
    dirty: Vec<bool>,
    score: Vec<u64>,
    mark: Vec<u64>,
    freq: HugeBuf<u32>,
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

impl RowCache {
    /// A cache of `config.slots` rows over a `rows x dim` table of weight type `T` with `spr`
    /// optimizer state values per row; the file's weights are `init(rows)` (fp32, row-major),
    /// its state zero. `name` names the table in errors.
    pub(crate) fn new<T: Weight + Pod>(
        name: &str,
        config: &CacheConfig,
        rows: u64,
        dim: usize,
        spr: usize,
        init: impl Fn(std::ops::Range<u64>) -> Vec<f32>,
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
        // One record per row: weights, then optimizer state.
        let total = (rows as usize).checked_mul(wbytes + spr * 4).ok_or_else(|| {
            EmbeddingError::Config(format!("table \"{name}\" ({rows} x {dim}) is too large to address"))
        })?;
        let file = backing_file(name, &config.dir, total)?;
        let slots = config.slots as u32;
        let lfu = config.policy == CachePolicy::Lfu;
        let mut cache = Self {
            slots,
            rows,
            dim,
            spr,
            wbytes,
            policy: config.policy,
            file,
            slot_of: HugeBuf::zeroed(rows as usize, "cache index")?,
            row_of: vec![FREE; slots as usize],
            pins: vec![0; slots as usize],
            dirty: vec![false; slots as usize],
            score: vec![0; slots as usize],
            mark: vec![0; slots as usize],
            freq: HugeBuf::zeroed(if lfu { rows as usize } else { 0 }, "cache frequencies")?,
            queue: BTreeSet::new(),
            free: (0..slots).rev().collect(),
            call: 0,
            writebacks: Vec::new(),
            loads: Vec::new(),
            stats: CacheStats::default(),
        };
        const CHUNK: u64 = 1 << 16;
        let mut r = 0;
        let mut buf: Vec<T> = Vec::new();
        while r < rows {
            let end = (r + CHUNK).min(rows);
            buf.clear();
            buf.extend(init(r..end).into_iter().map(T::from_f32));
            for (i, w) in buf.chunks_exact(dim.max(1)).enumerate() {
                let wr = cache.w_range((r as usize + i) as u32);
                cache.file[wr].copy_from_slice(bytes_of(w));
            }
            r = end;
        }
        // Misses read single rows: no read-ahead around them.
        let _ = cache.file.advise(memmap2::Advice::Random);
        Ok(cache)
    }

    /// A cache of `config.slots` rows of a `rows x dim` table of `precision` weights with
    /// `spr` optimizer state values per row, its backing file holding `init(rows)` (fp32,
    /// row-major) and zero state: the cache of another engine's slots (the CUDA engine's).
    pub fn with_precision(
        precision: crate::WeightPrecision,
        name: &str,
        config: &CacheConfig,
        rows: u64,
        dim: usize,
        spr: usize,
        init: impl Fn(std::ops::Range<u64>) -> Vec<f32>,
    ) -> Result<Self, EmbeddingError> {
        match precision {
            crate::WeightPrecision::Fp32 => Self::new::<f32>(name, config, rows, dim, spr, init),
            crate::WeightPrecision::Fp16 => Self::new::<half::f16>(name, config, rows, dim, spr, init),
            crate::WeightPrecision::Bf16 => Self::new::<half::bf16>(name, config, rows, dim, spr, init),
        }
    }

    /// Slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The slot holding `row`, if resident.
    #[inline]
    pub fn slot(&self, row: u32) -> Option<u32> {
        match self.slot_of.as_slice()[row as usize] {
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
                    let f = &mut self.freq.as_mut_slice()[row as usize];
                    *f = f.saturating_add(1);
                    (u64::from(*f) << 32) | (call & 0xFFFF_FFFF)
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
        self.slot_of.as_mut_slice()[old as usize] = 0;
        self.row_of[s as usize] = FREE;
        self.stats.evictions += 1;
        Some(s)
    }

    /// Bytes of one row's record in the file: its weights, then its optimizer state (one
    /// record per row, so a miss reads one place of the disk).
    fn record(&self) -> usize {
        self.wbytes + self.spr * 4
    }

    fn w_range(&self, row: u32) -> std::ops::Range<usize> {
        let o = row as usize * self.record();
        o..o + self.wbytes
    }

    fn s_range(&self, row: u32) -> std::ops::Range<usize> {
        let o = row as usize * self.record() + self.wbytes;
        o..o + self.spr * 4
    }

    /// Asks the kernel to start reading the file pages of `rows` that are not resident, all
    /// at once (`MADV_WILLNEED`, coalesced into runs of pages), so that the disk serves them
    /// in parallel instead of one page fault at a time.
    pub(crate) fn read_ahead(&self, rows: &[u32]) {
        const PAGE: usize = 4096;
        let rec = self.record();
        let mut pages: Vec<usize> = Vec::new();
        for &row in rows {
            if self.slot(row).is_none() {
                let o = row as usize * rec;
                pages.extend(o / PAGE..=(o + rec - 1) / PAGE);
            }
        }
        if pages.len() < 2 {
            return;
        }
        pages.sort_unstable();
        pages.dedup();
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 {
                j += 1;
            }
            let (start, end) = (pages[i] * PAGE, ((pages[j - 1] + 1) * PAGE).min(self.file.len()));
            let _ = self.file.advise_range(memmap2::Advice::WillNeed, start, end - start);
            i = j;
        }
    }

    /// Queues `row`'s copy from the file into `slot` (clean).
    fn load(&mut self, slot: u32, row: u32) {
        self.loads.push((slot, row));
        self.slot_of.as_mut_slice()[row as usize] = slot + 1;
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
                let (wr, sr) = (self.w_range(row), self.s_range(row));
                self.file[wr].copy_from_slice(&w[i * wb..][..wb]);
                self.file[sr].copy_from_slice(bytes_of(&st[i * spr..][..spr]));
            }
        }
        let loads = std::mem::take(&mut self.loads);
        if !loads.is_empty() {
            let slots: Vec<u32> = loads.iter().map(|&(s, _)| s).collect();
            let (mut w, mut st) = (vec![0u8; slots.len() * wb], vec![0f32; slots.len() * spr]);
            for (i, &(_, row)) in loads.iter().enumerate() {
                w[i * wb..][..wb].copy_from_slice(&self.file[self.w_range(row)]);
                bytes_of_mut(&mut st[i * spr..][..spr]).copy_from_slice(&self.file[self.s_range(row)]);
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
        let (wb, spr, rows) = (self.wbytes, self.spr, self.rows as usize);
        let (mut w, mut st) = (vec![0u8; rows * wb], vec![0f32; rows * spr]);
        for r in 0..rows {
            w[r * wb..][..wb].copy_from_slice(&self.file[self.w_range(r as u32)]);
            bytes_of_mut(&mut st[r * spr..][..spr]).copy_from_slice(&self.file[self.s_range(r as u32)]);
        }
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
                None => out[i * wb..][..wb].copy_from_slice(&self.file[self.w_range(r)]),
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

    /// Replaces the whole table (as [`Self::read_table`] gives it): the file, and the
    /// resident rows' slots (which stay clean).
    pub fn write_table(
        &mut self,
        store: &mut dyn SlotStore,
        weights: &[u8],
        state: &[f32],
    ) -> Result<(), EmbeddingError> {
        let (wb, spr) = (self.wbytes, self.spr);
        for r in 0..self.rows as usize {
            let (wr, sr) = (self.w_range(r as u32), self.s_range(r as u32));
            self.file[wr].copy_from_slice(&weights[r * wb..][..wb]);
            self.file[sr].copy_from_slice(bytes_of(&state[r * spr..][..spr]));
        }
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
                None => {
                    let (wr, sr) = (self.w_range(r), self.s_range(r));
                    self.file[wr].copy_from_slice(w);
                    self.file[sr].copy_from_slice(bytes_of(st));
                }
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
                let bytes = &self.file[self.w_range(row)];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(size_of::<T>())) {
                    let mut w = [T::from_f32(0.0)];
                    bytes_of_mut(&mut w).copy_from_slice(c);
                    *o = w[0].to_f32();
                }
            }
        }
    }

    /// The whole table's weights as fp32, `[rows, dim]`.
    pub(crate) fn weights_f32<T: Weight + Pod>(&self, tbe: &Tbe<T>, t: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.rows as usize * self.dim];
        for (r, o) in out.chunks_exact_mut(self.dim).enumerate() {
            self.read_row(tbe, t, r as u32, o);
        }
        out
    }

    /// The whole table's optimizer state, `[rows, spr]`.
    pub(crate) fn state<T: Weight + Pod>(&self, tbe: &Tbe<T>, t: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.rows as usize * self.spr];
        if self.spr == 0 {
            return out;
        }
        for (r, o) in out.chunks_exact_mut(self.spr).enumerate() {
            match self.slot(r as u32) {
                Some(s) => o.copy_from_slice(tbe.row(t, s as usize).1),
                None => bytes_of_mut(o).copy_from_slice(&self.file[self.s_range(r as u32)]),
            }
        }
        out
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
    ) {
        match self.slot(row) {
            Some(s) => {
                let (dw, ds) = tbe.row_mut(t, s as usize);
                dw.iter_mut().zip(w).for_each(|(d, &x)| *d = T::from_f32(x));
                if let Some(st) = state {
                    ds.copy_from_slice(st);
                }
                self.dirty[s as usize] = true;
            }
            None => {
                let row_w: Vec<T> = w.iter().map(|&x| T::from_f32(x)).collect();
                let wr = self.w_range(row);
                self.file[wr].copy_from_slice(bytes_of(&row_w));
                if let Some(st) = state {
                    let sr = self.s_range(row);
                    self.file[sr].copy_from_slice(bytes_of(st));
                }
            }
        }
    }

    /// Replaces row `row`'s optimizer state.
    pub(crate) fn write_state<T: Weight + Pod>(&mut self, tbe: &mut Tbe<T>, t: usize, row: u32, state: &[f32]) {
        match self.slot(row) {
            Some(s) => {
                tbe.row_mut(t, s as usize).1.copy_from_slice(state);
                self.dirty[s as usize] = true;
            }
            None => {
                let sr = self.s_range(row);
                self.file[sr].copy_from_slice(bytes_of(state));
            }
        }
    }
}

/// A file of `bytes` zero bytes under `dir`, its blocks reserved on the disk (so that a full
/// disk is this error now, not a fault when a page is written later), mapped and already
/// unlinked.
fn backing_file(name: &str, dir: &std::path::Path, bytes: usize) -> Result<MmapMut, EmbeddingError> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let at = |e: std::io::Error| {
        EmbeddingError::Config(format!(
            "table \"{name}\": cannot make its {bytes}-byte backing file in {} (embedding.offload_dir): {e}",
            dir.display()
        ))
    };
    std::fs::create_dir_all(dir).map_err(at)?;
    let path = dir.join(format!(
        ".trainrec-cache-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        name.chars().filter(char::is_ascii_alphanumeric).collect::<String>()
    ));
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(at)?;
    let reserved = {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on the file descriptor we own; it reads no memory of ours.
        match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes.max(1) as libc::off_t) } {
            0 => Ok(()),
            e => Err(std::io::Error::from_raw_os_error(e)),
        }
    };
    let mapped = reserved.and_then(|()| {
        // SAFETY: the file is ours alone (created just now, unlinked below before anyone else
        // can open it), so no other mapping or writer changes it under us.
        unsafe { MmapMut::map_mut(&file) }
    });
    let _ = std::fs::remove_file(&path);
    mapped.map_err(at)
}
