//! Managed collisions (zero-collision hashing, TorchRec's `MCHManagedCollisionModule`): the
//! most useful raw ids of a large id space each get a row of their own.
//!
//! A table of `rows` rows tracks up to `zch_size` raw ids in slots; slot `s` is row `s`.
//! - **Remap.** A tracked id reads its slot's row. Every other id goes to the fallback: with
//!   `zch_size == rows` that is the reserved last row (`rows - 1`, so `rows - 1` ids are
//!   tracked), as TorchRec does; with `zch_size < rows` it is plain hashing into the residual
//!   rows `zch_size..rows` (TorchRec's `mch_size`), so untracked ids still collide only among
//!   themselves.
//! - **Profile.** Training batches count every raw id (count and last step seen): a tracked
//!   id into its slot, another into the window of `eviction_interval` steps.
//! - **Evict.** At the end of each window the tracked set is rebuilt: every slot and every
//!   new id of the window get a score from the policy, and the best ones keep (or take) the
//!   slots. Slots that change hands are returned so that their embedding row and optimizer
//!   state are re-initialised before the new id uses them.
//!
//! Scores (higher stays), with `t` the current step and `a` the last step an id was seen:
//! - `lfu`: the id's count (slots accumulate counts over windows; a new id brings its count
//!   in the window);
//! - `lru`: `-(t - a + 1)^decay`;
//! - `distance_lfu`: `count / (t - a + 1)^decay`.
//!
//! Empty slots score below everything, so they fill first, lowest slot first. On a tie a slot
//! keeps its id; new ids rank by score, then count, then id. The best new id takes the worst
//! slot, the second best the second worst, and so on while the new id scores higher: the
//! tracked ids are the best `slots` of the slots' ids and the window's new ids.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub use trainrec_types::mc::{McConfig, McEvictionPolicy, McPartition};

/// What the module did so far and in the last window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct McStats {
    /// Ids remapped in training steps so far.
    pub lookups: u64,
    /// Of them, ids that were not tracked (they went to the fallback and share its rows).
    pub fallbacks: u64,
    /// Slots holding an id.
    pub tracked: u64,
    /// Slots that can hold an id.
    pub capacity: u64,
    /// Ids that lost their slot at the last eviction.
    pub last_evictions: u64,
    /// Slots filled (by evicting or into empty slots) at the last eviction.
    pub last_admissions: u64,
    /// Evictions run.
    pub evictions: u64,
}

impl McStats {
    /// Fraction of the remapped ids that went to the fallback (and collide there).
    pub fn collision_rate(&self) -> f64 {
        if self.lookups == 0 { 0.0 } else { self.fallbacks as f64 / self.lookups as f64 }
    }

    /// Fraction of the slots holding an id.
    pub fn tracked_fraction(&self) -> f64 {
        if self.capacity == 0 { 0.0 } else { self.tracked as f64 / self.capacity as f64 }
    }
}

/// splitmix64's finaliser: the hash of the id map and of the residual rows (and of the
/// dynamic tables' sketch and admission coin).
#[inline]
pub(crate) fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A hasher for `i64` keys (one multiply-xorshift round; ids need no DoS resistance).
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ u64::from(b));
        }
    }
    fn write_i64(&mut self, i: i64) {
        self.0 = mix(i as u64);
    }
}

type IdMap<V> = HashMap<i64, V, BuildHasherDefault<IdHasher>>;

/// An empty slot's id (raw ids are never negative).
const EMPTY: i64 = -1;

/// Ids ahead of the current one whose buckets are prefetched.
const PREFETCH: usize = 48;

/// One bucket: a tracked raw id plus one (0: vacant, so a zeroed table is empty), its slot
/// and its count (16 bytes: a lookup that counts touches one cache line).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct Entry {
    key: u64,
    slot: u32,
    count: u32,
}

// SAFETY: two u32 after a u64, `repr(C)`: no padding, every bit pattern valid, no drop glue.
unsafe impl crate::storage::Pod for Entry {}

const VACANT: Entry = Entry { key: 0, slot: 0, count: 0 };

#[inline(always)]
fn stored(id: i64) -> u64 {
    (id as u64).wrapping_add(1)
}

/// Raw id -> (slot, count): open addressing with linear probing, at most half full,
/// backward-shift deletion (no tombstones). The buckets live in transparent huge pages: a
/// table of a million slots spans 32 MiB, and random lookups into it are TLB-bound with 4 KiB
/// pages.
struct IdTable {
    entries: crate::storage::HugeBuf<Entry>,
    mask: usize,
    len: usize,
}

impl std::fmt::Debug for IdTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdTable").field("buckets", &(self.mask + 1)).field("len", &self.len).finish()
    }
}

impl IdTable {
    fn new(slots: usize) -> Result<Self, String> {
        let buckets = (2 * slots).max(16).next_power_of_two();
        let entries =
            crate::storage::HugeBuf::zeroed(buckets, "managed-collision id table").map_err(|e| e.to_string())?;
        Ok(Self { entries, mask: buckets - 1, len: 0 })
    }

    #[inline(always)]
    fn home_of(&self, key: u64) -> usize {
        mix(key) as usize & self.mask
    }

    #[inline(always)]
    fn prefetch(&self, id: i64) {
        crate::tbe::prefetch(self.entries.as_slice().as_ptr().wrapping_add(self.home_of(stored(id))), 16);
    }

    #[inline(always)]
    fn find(&self, id: i64) -> Option<usize> {
        let key = stored(id);
        let e = self.entries.as_slice();
        let mut i = self.home_of(key);
        loop {
            let k = e[i].key;
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    #[inline(always)]
    fn get(&self, id: i64) -> Option<u32> {
        self.find(id).map(|i| self.entries.as_slice()[i].slot)
    }

    /// The slot of `id`, its count raised by one.
    #[inline(always)]
    fn hit(&mut self, id: i64) -> Option<u32> {
        let i = self.find(id)?;
        let e = &mut self.entries.as_mut_slice()[i];
        e.count = e.count.saturating_add(1);
        Some(e.slot)
    }

    /// Adds `id` (not present) at `slot` with `count`.
    fn insert(&mut self, id: i64, slot: u32, count: u64) {
        let key = stored(id);
        let mask = self.mask;
        let mut i = self.home_of(key);
        let e = self.entries.as_mut_slice();
        while e[i].key != 0 {
            i = (i + 1) & mask;
        }
        e[i] = Entry { key, slot, count: count.min(u64::from(u32::MAX)) as u32 };
        self.len += 1;
    }

    fn remove(&mut self, id: i64) {
        let Some(mut i) = self.find(id) else { return };
        let mask = self.mask;
        let home = |k: u64| mix(k) as usize & mask;
        let e = self.entries.as_mut_slice();
        // Shift back the entries after the hole that may move into it.
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let k = e[j].key;
            if k == 0 {
                break;
            }
            let h = home(k);
            // `k` may fill the hole at `i` unless its home lies cyclically in `(i, j]`.
            let stays = if i <= j { i < h && h <= j } else { i < h || h <= j };
            if !stays {
                e[i] = e[j];
                i = j;
            }
        }
        e[i] = VACANT;
        self.len -= 1;
    }

    /// Each slot's count (slots without an id: 0).
    fn counts(&self, slots: usize) -> Vec<u64> {
        let mut out = vec![0u64; slots];
        for e in self.entries.as_slice().iter().filter(|e| e.key != 0) {
            out[e.slot as usize] = u64::from(e.count);
        }
        out
    }
}

/// One table's managed-collision module (see the module docs).
#[derive(Debug)]
pub struct ManagedCollision {
    config: McConfig,
    /// Tracked id -> slot.
    slot_of: IdTable,
    /// Per slot: its id ([`EMPTY`] if none) and last step seen (the count is in `slot_of`;
    /// the last step is kept only by the policies that read it).
    ids: Vec<i64>,
    last_access: Vec<u64>,
    /// This window's untracked ids: count and last step seen (tracked ids count into their
    /// slot as they come).
    window: IdMap<(u64, u64)>,
    /// Training steps so far.
    step: u64,
    stats: McStats,
}

/// The checkpointable state of a [`ManagedCollision`]: per slot its id (`-1`: empty), count
/// and last step seen, the step, and the current window's ids.
#[derive(Clone, Debug, PartialEq)]
pub struct McState {
    /// Per slot: the tracked id or -1.
    pub ids: Vec<i64>,
    /// Per slot: its count.
    pub counts: Vec<u64>,
    /// Per slot: the last step it was seen.
    pub last_access: Vec<u64>,
    /// Training steps so far.
    pub step: u64,
    /// The current window: (id, count, last step), sorted by id.
    pub window: Vec<(i64, u64, u64)>,
    /// The statistics so far.
    pub stats: McStats,
}

impl ManagedCollision {
    /// An empty module; `Err` names the setting that is out of range.
    pub fn new(config: McConfig) -> Result<Self, String> {
        config.check()?;
        let slots = Self::capacity_of(&config) as usize;
        let stats = McStats { capacity: slots as u64, ..McStats::default() };
        Ok(Self {
            config,
            slot_of: IdTable::new(slots)?,
            ids: vec![EMPTY; slots],
            last_access: vec![0; slots],
            window: IdMap::default(),
            step: 0,
            stats,
        })
    }

    fn capacity_of(c: &McConfig) -> u64 {
        if c.zch_size == c.rows { c.rows - 1 } else { c.zch_size }
    }

    /// The settings.
    pub fn config(&self) -> &McConfig {
        &self.config
    }

    /// The statistics so far.
    pub fn stats(&self) -> McStats {
        self.stats
    }

    /// The row of raw id `id` (tracked: its slot; else the fallback).
    #[inline]
    pub fn row_of(&self, id: i64) -> u64 {
        match self.slot_of.get(id) {
            Some(s) => u64::from(s),
            None => self.fallback(id),
        }
    }

    #[inline]
    fn fallback(&self, id: i64) -> u64 {
        let c = &self.config;
        if c.zch_size == c.rows { c.rows - 1 } else { c.zch_size + mix(id as u64) % (c.rows - c.zch_size) }
    }

    /// The id tracked in each slot (`None`: empty), slot order.
    pub fn tracked(&self) -> Vec<Option<i64>> {
        self.ids.iter().map(|&i| (i != EMPTY).then_some(i)).collect()
    }

    /// Checks that every raw id is in `0..input_hash_size`; `Err` gives the first one that
    /// is not.
    pub fn check_ids(&self, ids: &[i64]) -> Result<(), i64> {
        let n = self.config.input_hash_size;
        match ids.iter().find(|&&id| id < 0 || id as u64 >= n) {
            Some(&id) => Err(id),
            None => Ok(()),
        }
    }

    /// Replaces raw ids by rows (evaluation: no profiling); returns how many were not
    /// tracked.
    pub fn remap(&self, ids: &mut [i64]) -> u64 {
        let mut fallbacks = 0;
        for i in 0..ids.len() {
            if let Some(&ahead) = ids.get(i + PREFETCH) {
                self.slot_of.prefetch(ahead);
            }
            ids[i] = match self.slot_of.get(ids[i]) {
                Some(s) => i64::from(s),
                None => {
                    fallbacks += 1;
                    self.fallback(ids[i]) as i64
                }
            };
        }
        fallbacks
    }

    /// One training step over the raw ids of every feature of the table (`features`):
    /// counts them (a tracked id into its slot, another into the window), and at the end of a
    /// window rebuilds the tracked set. Returns the rows whose slot changed hands (to
    /// re-initialise) and remaps the ids in place (after the eviction, so a newly admitted id
    /// already reads its own row). One table lookup per id, two at an eviction step.
    pub fn train_step(&mut self, features: &mut [&mut [i64]]) -> Vec<u64> {
        self.step += 1;
        let step = self.step;
        let evict_now = step.is_multiple_of(self.config.eviction_interval);
        let recency = self.config.policy != McEvictionPolicy::Lfu;
        let mut fallbacks = 0u64;
        let mut lookups = 0u64;
        for ids in features.iter_mut() {
            lookups += ids.len() as u64;
            for i in 0..ids.len() {
                if let Some(&ahead) = ids.get(i + PREFETCH) {
                    self.slot_of.prefetch(ahead);
                }
                let id = ids[i];
                match self.slot_of.hit(id) {
                    Some(s) => {
                        if recency {
                            self.last_access[s as usize] = step;
                        }
                        if !evict_now {
                            ids[i] = i64::from(s);
                        }
                    }
                    None => {
                        let e = self.window.entry(id).or_insert((0, 0));
                        e.0 += 1;
                        e.1 = step;
                        if !evict_now {
                            fallbacks += 1;
                            ids[i] = self.fallback(id) as i64;
                        }
                    }
                }
            }
        }
        let reset = if evict_now {
            let reset = self.evict();
            for ids in features.iter_mut() {
                fallbacks += self.remap(ids);
            }
            reset
        } else {
            Vec::new()
        };
        self.stats.lookups += lookups;
        self.stats.fallbacks += fallbacks;
        reset
    }

    fn score(&self, count: u64, last: u64) -> f64 {
        let age = (self.step - last.min(self.step) + 1) as f64;
        match self.config.policy {
            McEvictionPolicy::Lfu => count as f64,
            McEvictionPolicy::Lru => -age.powf(self.config.decay_exponent),
            McEvictionPolicy::DistanceLfu => count as f64 / age.powf(self.config.decay_exponent),
        }
    }

    /// Rebuilds the tracked set from the window (see the module docs); returns the rows of
    /// the slots that took a new id.
    fn evict(&mut self) -> Vec<u64> {
        let window = std::mem::take(&mut self.window);
        // New ids, best first: by score, then count (high first), then id.
        let mut new: Vec<(f64, i64, u64, u64)> =
            window.into_iter().map(|(id, (count, last))| (self.score(count, last), id, count, last)).collect();
        new.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.2.cmp(&a.2)).then(a.1.cmp(&b.1)));
        let slots = self.ids.len();
        let n = new.len().min(slots);
        let mut reset = Vec::new();
        let mut evicted = 0;
        if n > 0 {
            let counts = self.slot_of.counts(slots);
            // The n worst slots, worst first: empty slots (lowest first), then by score (low
            // first), ties losing the higher slot.
            let key = |s: usize| -> (f64, i64) {
                if self.ids[s] == EMPTY {
                    (f64::NEG_INFINITY, s as i64)
                } else {
                    (self.score(counts[s], self.last_access[s]), -(s as i64))
                }
            };
            let worse = |a: &usize, b: &usize| {
                let (ka, kb) = (key(*a), key(*b));
                ka.0.total_cmp(&kb.0).then(ka.1.cmp(&kb.1))
            };
            let mut worst: Vec<usize> = (0..slots).collect();
            if n < slots {
                worst.select_nth_unstable_by(n - 1, worse);
                worst.truncate(n);
            }
            worst.sort_unstable_by(worse);
            let worst: Vec<(usize, f64)> = worst.into_iter().map(|s| (s, key(s).0)).collect();
            // The k-th best new id takes the k-th worst slot while it scores higher (a slot
            // keeps its id on a tie): the kept ids are the best `slots` of slots and new ids.
            for (&(score, id, count, last), &(s, slot_score)) in new.iter().zip(&worst) {
                if score <= slot_score {
                    break;
                }
                if self.ids[s] != EMPTY {
                    self.slot_of.remove(self.ids[s]);
                    evicted += 1;
                }
                self.ids[s] = id;
                self.last_access[s] = last;
                self.slot_of.insert(id, s as u32, count);
                reset.push(s as u64);
            }
        }
        self.stats.evictions += 1;
        self.stats.last_evictions = evicted;
        self.stats.last_admissions = reset.len() as u64;
        self.stats.tracked = self.slot_of.len as u64;
        reset.sort_unstable();
        reset
    }

    /// The state to checkpoint.
    pub fn state(&self) -> McState {
        let mut window: Vec<(i64, u64, u64)> = self.window.iter().map(|(&id, &(c, l))| (id, c, l)).collect();
        window.sort_unstable();
        McState {
            ids: self.ids.clone(),
            counts: self.slot_of.counts(self.ids.len()),
            last_access: self.last_access.clone(),
            step: self.step,
            window,
            stats: self.stats,
        }
    }

    /// Restores a checkpointed state (of a module with the same settings).
    pub fn set_state(&mut self, state: &McState) -> Result<(), String> {
        let slots = self.ids.len();
        if state.ids.len() != slots || state.counts.len() != slots || state.last_access.len() != slots {
            return Err(format!("the state has {} slots, this module {slots}", state.ids.len()));
        }
        let mut slot_of = IdTable::new(slots)?;
        for (s, &id) in state.ids.iter().enumerate().filter(|(_, id)| **id != EMPTY) {
            if id < 0 || slot_of.get(id).is_some() {
                return Err(format!("id {id} is tracked in two slots (or is negative)"));
            }
            slot_of.insert(id, s as u32, state.counts[s]);
        }
        self.slot_of = slot_of;
        self.ids = state.ids.clone();
        self.last_access = state.last_access.clone();
        self.step = state.step;
        self.window = state.window.iter().map(|&(id, c, l)| (id, (c, l))).collect();
        self.stats = McStats { tracked: self.slot_of.len as u64, capacity: self.stats.capacity, ..state.stats };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mc(rows: u64, zch: u64, policy: McEvictionPolicy, interval: u64) -> ManagedCollision {
        ManagedCollision::new(McConfig {
            rows,
            zch_size: zch,
            input_hash_size: 1000,
            policy,
            decay_exponent: 1.0,
            eviction_interval: interval,
        })
        .unwrap()
    }

    /// One training step over one feature; returns (rows, reset rows).
    fn step(m: &mut ManagedCollision, ids: &[i64]) -> (Vec<i64>, Vec<u64>) {
        let mut v = ids.to_vec();
        let reset = m.train_step(&mut [&mut v[..]]);
        (v, reset)
    }

    #[test]
    fn partitions_split_raw_ids_rows_and_residual_rows_in_blocks() {
        let c = |rows, zch, ihs| McConfig {
            rows,
            zch_size: zch,
            input_hash_size: ihs,
            policy: McEvictionPolicy::Lfu,
            decay_exponent: 1.0,
            eviction_interval: 3,
        };
        let whole = c(40, 40, 200);
        let one = whole.partitions(1).unwrap();
        assert_eq!(one, [McPartition { raw: 0..200, rows: 0..40, config: whole.clone() }]);
        // 40 rows in blocks of 14 (ShardedEbc's row-wise blocks), raw ids in blocks of 67; no
        // residual rows, so each keeps its last row for its untracked ids.
        let three = whole.partitions(3).unwrap();
        let got: Vec<_> =
            three.iter().map(|p| (p.raw.clone(), p.rows.clone(), p.config.rows, p.config.zch_size)).collect();
        assert_eq!(got, [(0..67, 0..14, 14, 14), (67..134, 14..28, 14, 14), (134..200, 28..40, 12, 12)]);
        assert!(three.iter().all(|p| p.config.input_hash_size == 200 && p.config.eviction_interval == 3));
        // 3 residual rows: blocks of 2, so 2 + 1 of them.
        let res: Vec<_> =
            c(10, 7, 50).partitions(2).unwrap().iter().map(|p| (p.rows.clone(), p.config.zch_size)).collect();
        assert_eq!(res, [(0..5, 3), (5..10, 4)]);
        // Partitions that do not fit are named.
        let e = c(4, 4, 100).partitions(3).unwrap_err();
        assert!(e.contains("partition 2") && e.contains("without rows"), "{e}");
        let e = c(40, 40, 2).partitions(3).unwrap_err();
        assert!(e.contains("without raw ids"), "{e}");
        let e = c(3, 3, 100).partitions(3).unwrap_err();
        assert!(e.contains("partition 0 of 3") && e.contains("one row"), "{e}");
        assert!(whole.partitions(0).is_err());
    }

    #[test]
    fn lfu_tracks_the_most_frequent_ids_and_sends_the_rest_to_the_reserved_row() {
        // 4 rows: 3 slots, row 3 reserved.
        let mut m = mc(4, 4, McEvictionPolicy::Lfu, 2);
        // Window 1 (steps 1, 2): counts 7:3, 5:2, 9:2, 4:1.
        let (rows, reset) = step(&mut m, &[7, 5, 7, 9]);
        assert_eq!(rows, [3, 3, 3, 3], "nothing tracked before the first eviction");
        assert!(reset.is_empty());
        let (rows, reset) = step(&mut m, &[7, 9, 5, 4]);
        // Evicted into empty slots in score order: 7 (3), then 5 and 9 (2 each, by id).
        assert_eq!(reset, [0, 1, 2]);
        assert_eq!(m.tracked(), [Some(7), Some(5), Some(9)]);
        assert_eq!(rows, [0, 2, 1, 3], "remapped after the eviction");
        let s = m.stats();
        assert_eq!((s.tracked, s.capacity, s.last_evictions, s.last_admissions), (3, 3, 0, 3));
        // Window 2: 4 (5 times) beats 7 (3 + 0), 5 (2 + 1) and 9 (2 + 1); of the three tied
        // slots the last one (9's) goes.
        step(&mut m, &[4, 4, 4, 5]);
        let (rows, reset) = step(&mut m, &[4, 4, 9]);
        assert_eq!(reset, [2], "9's slot goes to 4");
        assert_eq!(m.tracked(), [Some(7), Some(5), Some(4)]);
        assert_eq!(rows, [2, 2, 3]);
        assert_eq!(m.stats().last_evictions, 1);
        // Counts accumulate: 7 = 3, 5 = 3, 4 = 5.
        assert_eq!(m.state().counts, [3, 3, 5]);
        // Evaluation remaps without counting.
        let mut ids = vec![7, 4, 9, 123];
        m.remap(&mut ids);
        assert_eq!(ids, [0, 2, 3, 3]);
        assert_eq!(m.stats().lookups, 15);
        assert_eq!(m.stats().fallbacks, 4 + 1 + 3 + 1);
    }

    #[test]
    fn lru_keeps_the_most_recent_ids() {
        let mut m = mc(3, 3, McEvictionPolicy::Lru, 3);
        // Steps 1..3: 1 at step 1, 2 at step 2, 3 at step 3 (twice), 1 again at step 2.
        step(&mut m, &[1]);
        step(&mut m, &[2, 1]);
        let (_, reset) = step(&mut m, &[3, 3]);
        // 2 slots: last seen 3 (age 1), then 1 and 2 (age 2; count 2 beats 1: 1 first).
        assert_eq!(reset, [0, 1]);
        assert_eq!(m.tracked(), [Some(3), Some(1)]);
        // Steps 4..6: 2 at step 5; at the eviction (step 6) 3 and 1 are 4 and 5 steps old.
        step(&mut m, &[]);
        step(&mut m, &[2]);
        let (rows, reset) = step(&mut m, &[]);
        assert!(rows.is_empty());
        // Scores: 2: -(6 - 5 + 1) = -2, 3: -(6 - 3 + 1) = -4, 1: -(6 - 2 + 1) = -5: 1 goes.
        assert_eq!(reset, [1]);
        assert_eq!(m.tracked(), [Some(3), Some(2)]);
    }

    #[test]
    fn distance_lfu_divides_counts_by_age() {
        let mut m = mc(3, 3, McEvictionPolicy::DistanceLfu, 2);
        // Window 1: 8 x4 at step 1, 6 x1 at step 2.
        step(&mut m, &[8, 8, 8, 8]);
        step(&mut m, &[6]);
        assert_eq!(m.tracked(), [Some(8), Some(6)]);
        // Window 2 (eviction at step 4): 5 x3 and 8 x1 at step 4. Scores: 8: (4 + 1) / 1 = 5,
        // 6: 1 / (4 - 2 + 1) = 1/3, 5: 3 / 1 = 3: 6 goes.
        step(&mut m, &[]);
        let (rows, reset) = step(&mut m, &[5, 5, 5, 8]);
        assert_eq!(reset, [1]);
        assert_eq!(m.tracked(), [Some(8), Some(5)]);
        assert_eq!(rows, [1, 1, 1, 0]);
        // 8 was seen again: its count is 5 and its last step 4.
        assert_eq!((m.state().counts[0], m.state().last_access[0]), (5, 4));
    }

    #[test]
    fn a_residual_part_hashes_untracked_ids_into_its_own_rows() {
        // 10 rows: 4 slots (rows 0..4), untracked ids hash into rows 4..10.
        let mut m = mc(10, 4, McEvictionPolicy::Lfu, 1);
        let (rows, reset) = step(&mut m, &[11, 12, 13, 14, 15, 11]);
        assert_eq!(reset, [0, 1, 2, 3]);
        assert_eq!(m.stats().capacity, 4);
        assert_eq!(&rows[..5], &[0, 1, 2, 3, rows[4]]);
        assert!((4..10).contains(&rows[4]), "15 is untracked: {rows:?}");
        assert_eq!(rows[5], 0);
        // The same untracked id always lands on the same residual row.
        let mut again = vec![15];
        m.remap(&mut again);
        assert_eq!(again[0], rows[4]);
    }

    #[test]
    fn the_id_table_agrees_with_a_hash_map_under_inserts_and_removals() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // 40 slots in 128 buckets, ids from a small range: long probe chains and wrap-around.
        let mut t = IdTable::new(40).unwrap();
        let mut reference: HashMap<i64, u32> = HashMap::new();
        for step in 0..20_000u32 {
            let id = rng.random_range(0..200i64);
            if reference.contains_key(&id) {
                if rng.random_bool(0.5) {
                    t.remove(id);
                    reference.remove(&id);
                }
            } else if reference.len() < 40 {
                t.insert(id, step, 0);
                reference.insert(id, step);
            }
            let probe = rng.random_range(0..200i64);
            assert_eq!(t.get(probe), reference.get(&probe).copied(), "step {step}: id {probe}");
            assert_eq!(t.len, reference.len());
        }
    }

    #[test]
    fn bad_settings_and_ids_are_named_and_state_round_trips() {
        let cfg = |rows, zch, interval| McConfig {
            rows,
            zch_size: zch,
            input_hash_size: 100,
            policy: McEvictionPolicy::Lfu,
            decay_exponent: 1.0,
            eviction_interval: interval,
        };
        assert!(ManagedCollision::new(cfg(10, 11, 1)).unwrap_err().contains("zch_size = 11 must be in 1..=10"));
        assert!(ManagedCollision::new(cfg(10, 5, 0)).unwrap_err().contains("eviction_interval"));
        let lru = McConfig { policy: McEvictionPolicy::Lru, decay_exponent: 0.0, ..cfg(10, 5, 1) };
        assert!(ManagedCollision::new(lru).unwrap_err().contains("decay_exponent = 0"));
        let mut m = ManagedCollision::new(cfg(10, 10, 2)).unwrap();
        assert_eq!(m.check_ids(&[3, 99, 100, 7]), Err(100));
        assert_eq!(m.check_ids(&[0, 99]), Ok(()));
        step(&mut m, &[1, 2, 2]);
        step(&mut m, &[3]);
        step(&mut m, &[4, 4]);
        let state = m.state();
        let mut copy = ManagedCollision::new(cfg(10, 10, 2)).unwrap();
        copy.set_state(&state).unwrap();
        // Both continue alike.
        assert_eq!(step(&mut m, &[5, 1]), step(&mut copy, &[5, 1]));
        assert_eq!(m.state(), copy.state());
        let mut bad = state.clone();
        bad.ids[1] = bad.ids[0];
        assert!(copy.set_state(&bad).unwrap_err().contains("two slots"));
    }
}
