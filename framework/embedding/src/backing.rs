//! What holds a cached table's rows outside its cache slots: one record per table row in a
//! file made when the table is built (`fused_uvm_caching`), or a key-value store of only the
//! rows written so far (`key_value`), in memory-mapped files unlinked once mapped.

use crate::EmbeddingError;
use crate::config::CacheBacking;
use crate::storage::Pod;
use memmap2::MmapMut;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The initial weights of a range of rows, as stored (bytes of the table's precision).
pub(crate) type InitRows = Box<dyn Fn(Range<u64>) -> Vec<u8> + Send + Sync>;

/// Records of rows (weights as stored, then optimizer state) in memory-mapped files.
pub(crate) struct Backing {
    pub(crate) kind: CacheBacking,
    /// Bytes of one record, and of its weights.
    pub(crate) rec: usize,
    pub(crate) wbytes: usize,
    pub(crate) rows: u64,
    /// `Rows`: one segment, record `r` for row `r`. `KeyValue`: segments appended as records
    /// are, each twice the last (from 4096 records up to 64 MiB).
    pub(crate) segments: Vec<Segment>,
    /// `KeyValue`: the record of each row stored.
    pub(crate) index: rustc_hash::FxHashMap<u32, u32>,
    /// `KeyValue`: records in use, and room in the segments.
    pub(crate) records: u32,
    pub(crate) capacity: u32,
    pub(crate) init: InitRows,
    pub(crate) name: String,
    pub(crate) dir: PathBuf,
}

pub(crate) struct Segment {
    pub(crate) map: MmapMut,
    pub(crate) first: u32,
    pub(crate) len: u32,
}

impl Backing {
    /// Where row `row`'s record lies (segment, byte offset), if stored.
    #[inline]
    pub(crate) fn locate(&self, row: u32) -> Option<(usize, usize)> {
        match self.kind {
            CacheBacking::Rows => Some((0, row as usize * self.rec)),
            CacheBacking::KeyValue => {
                let &i = self.index.get(&row)?;
                let s = self.segments.partition_point(|g| g.first <= i) - 1;
                Some((s, (i - self.segments[s].first) as usize * self.rec))
            }
        }
    }

    pub(crate) fn record(&self, row: u32) -> Option<&[u8]> {
        let (s, o) = self.locate(row)?;
        Some(&self.segments[s].map[o..o + self.rec])
    }

    /// Row `row`'s record to write, given one (initial weights, zero state) when not stored
    /// yet; a full disk is the error.
    pub(crate) fn record_mut(&mut self, row: u32) -> Result<&mut [u8], EmbeddingError> {
        let (s, o) = match self.locate(row) {
            Some(at) => at,
            None => {
                if self.records == self.capacity {
                    let last = self.segments.last().map_or(0, |g| g.len as u64);
                    let most = ((64u64 << 20) / self.rec as u64).max(1);
                    let len = (last * 2).max(4096).min(most).min(self.rows - u64::from(self.capacity));
                    let map = backing_file(&self.name, &self.dir, len as usize * self.rec)?;
                    self.segments.push(Segment { map, first: self.capacity, len: len as u32 });
                    self.capacity += len as u32;
                }
                let i = self.records;
                self.records += 1;
                self.index.insert(row, i);
                let g = self.segments.last_mut().expect("a segment with room");
                let o = (i - g.first) as usize * self.rec;
                // The file is zero: the state is.
                g.map[o..o + self.wbytes].copy_from_slice(&(self.init)(u64::from(row)..u64::from(row) + 1));
                (self.segments.len() - 1, o)
            }
        };
        Ok(&mut self.segments[s].map[o..o + self.rec])
    }

    /// Row `row`'s weights as stored into `w`.
    pub(crate) fn read_w(&self, row: u32, w: &mut [u8]) {
        match self.record(row) {
            Some(r) => w.copy_from_slice(&r[..self.wbytes]),
            None => w.copy_from_slice(&(self.init)(u64::from(row)..u64::from(row) + 1)),
        }
    }

    /// Row `row`'s optimizer state into `s`.
    pub(crate) fn read_s(&self, row: u32, s: &mut [f32]) {
        match self.record(row) {
            Some(r) => bytes_of_mut(s).copy_from_slice(&r[self.wbytes..]),
            None => s.fill(0.0),
        }
    }

    /// Rows `range` as stored: weights (bytes) and state (`spr` a row).
    pub(crate) fn read_range(&self, range: Range<u64>, spr: usize) -> (Vec<u8>, Vec<f32>) {
        let n = (range.end - range.start) as usize;
        let (mut w, mut st) = match self.kind {
            CacheBacking::Rows => (vec![0u8; n * self.wbytes], vec![0f32; n * spr]),
            CacheBacking::KeyValue => ((self.init)(range.clone()), vec![0f32; n * spr]),
        };
        for (i, row) in range.enumerate() {
            if let Some(r) = self.record(row as u32) {
                w[i * self.wbytes..][..self.wbytes].copy_from_slice(&r[..self.wbytes]);
                bytes_of_mut(&mut st[i * spr..][..spr]).copy_from_slice(&r[self.wbytes..]);
            }
        }
        (w, st)
    }

    /// Writes row `row`'s weights and/or state (the other part kept). A `KeyValue` row not
    /// stored yet stays so when what is written is what it reads as: its initial weights
    /// (`initial`, when the caller has them) and zero state.
    pub(crate) fn write(
        &mut self,
        row: u32,
        w: Option<&[u8]>,
        s: Option<&[f32]>,
        initial: Option<&[u8]>,
    ) -> Result<(), EmbeddingError> {
        if self.kind == CacheBacking::KeyValue && !self.index.contains_key(&row) {
            let zero_state = s.is_none_or(|s| s.iter().all(|&x| x.to_bits() == 0));
            let init_weights = match (w, initial) {
                (None, _) => true,
                (Some(w), Some(i)) => w == i,
                (Some(w), None) => w == (self.init)(u64::from(row)..u64::from(row) + 1),
            };
            if zero_state && init_weights {
                return Ok(());
            }
        }
        let wb = self.wbytes;
        let r = self.record_mut(row)?;
        if let Some(w) = w {
            r[..wb].copy_from_slice(w);
        }
        if let Some(s) = s {
            r[wb..].copy_from_slice(bytes_of(s));
        }
        Ok(())
    }

    /// Rows stored (all of them for `Rows`).
    pub(crate) fn stored(&self) -> u64 {
        match self.kind {
            CacheBacking::Rows => self.rows,
            CacheBacking::KeyValue => self.index.len() as u64,
        }
    }

    /// Asks the kernel to start reading the file pages of the stored records of `rows`, all
    /// at once (`MADV_WILLNEED`, coalesced into runs of pages), so that the disk serves them
    /// in parallel instead of one page fault at a time.
    pub(crate) fn read_ahead(&self, rows: impl Iterator<Item = u32>) {
        const PAGE: usize = 4096;
        let rec = self.rec;
        let mut pages: Vec<(usize, usize)> = Vec::new();
        for row in rows {
            if let Some((s, o)) = self.locate(row) {
                pages.extend((o / PAGE..=(o + rec - 1) / PAGE).map(|p| (s, p)));
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
            while j < pages.len() && pages[j] == (pages[j - 1].0, pages[j - 1].1 + 1) {
                j += 1;
            }
            let map = &self.segments[pages[i].0].map;
            let (start, end) = (pages[i].1 * PAGE, ((pages[j - 1].1 + 1) * PAGE).min(map.len()));
            let _ = map.advise_range(memmap2::Advice::WillNeed, start, end - start);
            i = j;
        }
    }
}

/// A file of `bytes` zero bytes under `dir`, its blocks reserved on the disk (so that a full
/// disk is this error now, not a fault when a page is written later), mapped and already
/// unlinked.
pub(crate) fn backing_file(name: &str, dir: &std::path::Path, bytes: usize) -> Result<MmapMut, EmbeddingError> {
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

// SAFETY: a primitive integer, valid for any bits.
unsafe impl Pod for u32 {}

pub(crate) fn bytes_of<T: Pod>(s: &[T]) -> &[u8] {
    // SAFETY: T is plain old data (no padding, any bits valid), so its memory is bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

pub(crate) fn bytes_of_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; any byte pattern written is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}
