//! Dynamic embedding tables keyed by the raw 64-bit id (Monolith's collisionless tables,
//! DeepRec's EmbeddingVariable, TorchRec's ZCH): a table of `capacity` rows in which an id gets
//! a row of its own once admitted, loses it when it expires or when a better id needs the room,
//! and never shares it with another id while it holds it.
//!
//! - **Admission.** An id without a row is counted in a count-min sketch (`depth` rows of
//!   `width` counters: memory bounded whatever the id space; every `width` sightings counted,
//!   all counters are halved, TinyLFU's reset, so the counts follow recent traffic and the
//!   sketch's over-count stays below one sighting per counter); once its count reaches
//!   `admit_after` it is admitted, each sighting from then on with probability
//!   `admit_probability` (a deterministic coin of the id, the seed and the step, so every rank
//!   draws the same). Until admitted an id reads [`NOT_ADMITTED`]: the caller drops it from its
//!   bag, so it pools as a zero embedding and receives no update.
//! - **Eviction.** Before each step, rows unseen for more than `ttl_steps` steps are freed. An
//!   id admitted while every row is taken evicts the least frequently (`lfu`: lowest count, then
//!   least recent) or least recently (`lru`) used row among those not used in the current
//!   step (lowest row on ties); when every row was used in the step, the id is not admitted. A freed row's next id starts from fresh initial weights: the
//!   rows that change hands are returned for re-initialisation.
//! - Free rows are taken lowest first.

use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasherDefault;

use crate::mc::{IdHasher, mix};

/// What a raw id reads while it has no row: the caller drops it from its bag.
pub const NOT_ADMITTED: i64 = -1;

/// Which row makes room at capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DynamicEviction {
    /// The least frequently used (lowest count; then least recent).
    #[default]
    Lfu,
    /// The least recently used.
    Lru,
}

/// A dynamic table's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicConfig {
    /// Rows (ids that can hold a row at once).
    pub capacity: u32,
    /// Sightings before an id is admitted (1: at once).
    pub admit_after: u32,
    /// Chance that a sighting of an id past `admit_after` admits it.
    pub admit_probability: f64,
    /// Steps a row may go unseen before it is freed (`None`: never).
    pub ttl_steps: Option<u64>,
    /// Which row makes room at capacity.
    pub eviction: DynamicEviction,
    /// Counters per row of the admission sketch.
    pub sketch_width: usize,
    /// Rows of the admission sketch.
    pub sketch_depth: usize,
    /// Seed of the sketch's hashes and of the admission coin.
    pub seed: u64,
}

/// Counters of a dynamic table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DynamicStats {
    /// Rows holding an id.
    pub live: u64,
    /// Ids admitted so far.
    pub admitted: u64,
    /// Lookups of ids without a row (they read zeros), so far.
    pub rejected: u64,
    /// Rows freed because their id expired.
    pub expired: u64,
    /// Rows taken from an id to admit another.
    pub evicted: u64,
    /// Lookups counted, so far.
    pub lookups: u64,
}

type IdMap = HashMap<i64, u32, BuildHasherDefault<IdHasher>>;

/// A dynamic table's id map (the rows' embeddings live in the embedding engine).
#[derive(Clone, Debug)]
pub struct DynamicTable {
    config: DynamicConfig,
    step: u64,
    row_of: IdMap,
    /// Per row below the high-water mark (rows are taken lowest first, so memory follows the
    /// rows ever used, not the capacity): its id ([`NOT_ADMITTED`]: free), count and last
    /// step seen.
    ids: Vec<i64>,
    counts: Vec<u64>,
    last: Vec<u64>,
    /// Live rows by (last step seen, row): expiry and `lru` order.
    by_last: BTreeSet<(u64, u32)>,
    /// Live rows by (count, last step seen, row): `lfu` order (kept under `lfu` only).
    by_count: BTreeSet<(u64, u64, u32)>,
    /// Free rows below the high-water mark `ids.len()`, lowest first (every row from the mark
    /// up is free too).
    free: BTreeSet<u32>,
    sketch: Vec<u32>,
    /// Sightings counted since the sketch was last halved.
    sketch_added: u64,
    stats: DynamicStats,
}

/// Everything a checkpoint needs to rebuild a [`DynamicTable`] exactly: the live rows alone
/// (a free row holds nothing).
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicState {
    /// Steps taken.
    pub step: u64,
    /// The rows holding an id, ascending.
    pub rows: Vec<u32>,
    /// Per live row: its id.
    pub ids: Vec<i64>,
    /// Per live row: its count.
    pub counts: Vec<u64>,
    /// Per live row: the last step it was seen.
    pub last: Vec<u64>,
    /// The admission sketch's counters.
    pub sketch: Vec<u32>,
    /// Sightings counted since the sketch was last halved.
    pub sketch_added: u64,
    /// Counters.
    pub stats: DynamicStats,
}

impl DynamicTable {
    /// An empty table.
    pub fn new(config: DynamicConfig) -> Result<Self, String> {
        if config.capacity == 0 {
            return Err("capacity must be at least 1".into());
        }
        if config.admit_after == 0 {
            return Err("admit_after must be at least 1".into());
        }
        if !(config.admit_probability > 0.0 && config.admit_probability <= 1.0) {
            return Err(format!("admit_probability {} is not in (0, 1]", config.admit_probability));
        }
        if config.ttl_steps == Some(0) {
            return Err("ttl_steps must be at least 1 (leave it unset to keep rows until evicted)".into());
        }
        if config.sketch_width == 0 || config.sketch_depth == 0 {
            return Err("the sketch needs a width and a depth of at least 1".into());
        }
        let sketch = vec![0; config.sketch_width * config.sketch_depth];
        Ok(Self {
            step: 0,
            row_of: IdMap::default(),
            ids: Vec::new(),
            counts: Vec::new(),
            last: Vec::new(),
            by_last: BTreeSet::new(),
            by_count: BTreeSet::new(),
            free: BTreeSet::new(),
            sketch,
            sketch_added: 0,
            stats: DynamicStats::default(),
            config,
        })
    }

    /// The settings.
    pub fn config(&self) -> &DynamicConfig {
        &self.config
    }

    /// The counters (`live` current).
    pub fn stats(&self) -> DynamicStats {
        DynamicStats { live: self.row_of.len() as u64, ..self.stats }
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Bytes of the id map and the sketch (the rows' embeddings are the engine's): per row
    /// ever used its id, count and last step, per live row a map entry and two index entries.
    pub fn bytes(&self) -> u64 {
        (self.ids.len() * 24 + self.row_of.len() * (16 + 24 + 24) + self.free.len() * 4 + self.sketch.len() * 4) as u64
    }

    /// The row of `id`, if it has one.
    pub fn row_of(&self, id: i64) -> Option<u32> {
        self.row_of.get(&id).copied()
    }

    /// The id each row holds ([`NOT_ADMITTED`]: free), up to the highest row ever used (the
    /// rows after it are free).
    pub fn ids(&self) -> &[i64] {
        &self.ids
    }

    /// Replaces raw ids by their rows, [`NOT_ADMITTED`] for ids without one (evaluation: nothing
    /// counted or changed).
    pub fn remap(&self, ids: &mut [i64]) {
        for id in ids {
            *id = self.row_of.get(id).map_or(NOT_ADMITTED, |&r| i64::from(r));
        }
    }

    fn sketch_slots(&self, id: i64) -> impl Iterator<Item = usize> + use<> {
        let (w, seed) = (self.config.sketch_width as u64, self.config.seed);
        let h = mix(id as u64 ^ seed);
        (0..self.config.sketch_depth as u64)
            .map(move |d| (d * w + mix(h ^ d.wrapping_mul(0xD6E8_FEB8_6659_FD93)) % w) as usize)
    }

    /// Counts a sighting of `id` in the sketch; returns its estimated count (conservative
    /// update: only the smallest counters grow).
    fn sketch_add(&mut self, id: i64) -> u32 {
        self.sketch_added += 1;
        if self.sketch_added > self.config.sketch_width as u64 {
            for c in &mut self.sketch {
                *c >>= 1;
            }
            self.sketch_added = 1;
        }
        let slots: Vec<usize> = self.sketch_slots(id).collect();
        let est = slots.iter().map(|&s| self.sketch[s]).min().unwrap_or(0).saturating_add(1);
        for s in slots {
            if self.sketch[s] < est {
                self.sketch[s] = est;
            }
        }
        est
    }

    fn coin(&self, id: i64) -> bool {
        let p = self.config.admit_probability;
        if p >= 1.0 {
            return true;
        }
        let h = mix(id as u64 ^ mix(self.config.seed ^ self.step.wrapping_mul(0xA24B_AED4_963E_E407)));
        ((h >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn unindex(&mut self, r: u32) {
        let i = r as usize;
        self.by_last.remove(&(self.last[i], r));
        if self.config.eviction == DynamicEviction::Lfu {
            self.by_count.remove(&(self.counts[i], self.last[i], r));
        }
    }

    fn index(&mut self, r: u32) {
        let i = r as usize;
        self.by_last.insert((self.last[i], r));
        if self.config.eviction == DynamicEviction::Lfu {
            self.by_count.insert((self.counts[i], self.last[i], r));
        }
    }

    fn free_row(&mut self, r: u32) {
        self.unindex(r);
        let i = r as usize;
        self.row_of.remove(&self.ids[i]);
        self.ids[i] = NOT_ADMITTED;
        self.counts[i] = 0;
        self.last[i] = 0;
        self.free.insert(r);
    }

    /// A row for a new id: the lowest free one, else the policy's victim among the rows not
    /// used in this step.
    fn take_row(&mut self) -> Option<u32> {
        if let Some(r) = self.free.pop_first() {
            return Some(r);
        }
        if (self.ids.len() as u64) < u64::from(self.config.capacity) {
            // The lowest row never used.
            self.ids.push(NOT_ADMITTED);
            self.counts.push(0);
            self.last.push(0);
            return Some(self.ids.len() as u32 - 1);
        }
        let step = self.step;
        let victim = match self.config.eviction {
            DynamicEviction::Lru => self.by_last.first().filter(|&&(l, _)| l < step).map(|&(_, r)| r),
            DynamicEviction::Lfu => self.by_count.iter().find(|&&(_, l, _)| l < step).map(|&(_, _, r)| r),
        }?;
        self.free_row(victim);
        self.stats.evicted += 1;
        self.free.remove(&victim);
        Some(victim)
    }

    /// One training step over the raw ids of every feature of the table: frees expired rows,
    /// counts and admits, and replaces each id by its row ([`NOT_ADMITTED`] without one).
    /// Returns the rows that changed hands in this step (to re-initialise before use), sorted.
    pub fn train_step(&mut self, features: &mut [&mut [i64]]) -> Vec<u32> {
        self.step += 1;
        let step = self.step;
        if let Some(ttl) = self.config.ttl_steps {
            while let Some(&(l, r)) = self.by_last.first() {
                if l + ttl >= step {
                    break;
                }
                self.free_row(r);
                self.stats.expired += 1;
            }
        }
        let mut fresh = BTreeSet::new();
        for ids in features.iter_mut() {
            self.stats.lookups += ids.len() as u64;
            for id in ids.iter_mut() {
                let raw = *id;
                if let Some(&r) = self.row_of.get(&raw) {
                    self.unindex(r);
                    self.counts[r as usize] += 1;
                    self.last[r as usize] = step;
                    self.index(r);
                    *id = i64::from(r);
                    continue;
                }
                let count = if self.config.admit_after <= 1 { 1 } else { self.sketch_add(raw) };
                let row = if count >= self.config.admit_after && self.coin(raw) { self.take_row() } else { None };
                match row {
                    Some(r) => {
                        let i = r as usize;
                        self.ids[i] = raw;
                        self.counts[i] = 1;
                        self.last[i] = step;
                        self.row_of.insert(raw, r);
                        self.index(r);
                        self.stats.admitted += 1;
                        fresh.insert(r);
                        *id = i64::from(r);
                    }
                    None => {
                        self.stats.rejected += 1;
                        *id = NOT_ADMITTED;
                    }
                }
            }
        }
        fresh.into_iter().collect()
    }

    /// The state to checkpoint: the live rows.
    pub fn state(&self) -> DynamicState {
        let rows: Vec<u32> = (0..self.ids.len() as u32).filter(|&r| self.ids[r as usize] != NOT_ADMITTED).collect();
        let pick = |v: &[u64]| rows.iter().map(|&r| v[r as usize]).collect();
        DynamicState {
            step: self.step,
            ids: rows.iter().map(|&r| self.ids[r as usize]).collect(),
            counts: pick(&self.counts),
            last: pick(&self.last),
            rows,
            sketch: self.sketch.clone(),
            sketch_added: self.sketch_added,
            stats: self.stats,
        }
    }

    /// Restores [`Self::state`] (same capacity and sketch size).
    pub fn load(&mut self, s: DynamicState) -> Result<(), String> {
        let n = s.rows.len();
        if s.ids.len() != n || s.counts.len() != n || s.last.len() != n || s.sketch.len() != self.sketch.len() {
            return Err(format!(
                "a dynamic table state of {n} rows with {} ids, {} counts and {} steps, and {} sketch counters, does \
                 not fit a sketch of {}",
                s.ids.len(),
                s.counts.len(),
                s.last.len(),
                s.sketch.len(),
                self.sketch.len()
            ));
        }
        if s.rows.windows(2).any(|w| w[0] >= w[1]) || s.rows.last().is_some_and(|&r| r >= self.config.capacity) {
            return Err(format!(
                "a dynamic table state's rows are not ascending rows of its {} (the capacity)",
                self.config.capacity
            ));
        }
        let mut fresh = Self::new(self.config.clone())?;
        fresh.step = s.step;
        fresh.sketch = s.sketch;
        fresh.sketch_added = s.sketch_added;
        fresh.stats = s.stats;
        let mark = s.rows.last().map_or(0, |&r| r as usize + 1);
        fresh.ids = vec![NOT_ADMITTED; mark];
        fresh.counts = vec![0; mark];
        fresh.last = vec![0; mark];
        for (i, &r) in s.rows.iter().enumerate() {
            let (id, j) = (s.ids[i], r as usize);
            if id < 0 || fresh.row_of.insert(id, r).is_some() {
                return Err(format!("a dynamic table state holds id {id} twice or a negative id"));
            }
            fresh.ids[j] = id;
            fresh.counts[j] = s.counts[i];
            fresh.last[j] = s.last[i];
            fresh.index(r);
        }
        fresh.free = (0..mark as u32).filter(|&r| fresh.ids[r as usize] == NOT_ADMITTED).collect();
        *self = fresh;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(capacity: u32, admit_after: u32, ttl: Option<u64>, eviction: DynamicEviction) -> DynamicTable {
        DynamicTable::new(DynamicConfig {
            capacity,
            admit_after,
            admit_probability: 1.0,
            ttl_steps: ttl,
            eviction,
            sketch_width: 1024,
            sketch_depth: 4,
            seed: 7,
        })
        .unwrap()
    }

    /// One step over one feature's ids; the remapped ids and the fresh rows.
    fn step(t: &mut DynamicTable, ids: &[i64]) -> (Vec<i64>, Vec<u32>) {
        let mut v = ids.to_vec();
        let fresh = t.train_step(&mut [v.as_mut_slice()]);
        (v, fresh)
    }

    const X: i64 = NOT_ADMITTED;

    #[test]
    fn ids_are_admitted_after_their_count_and_read_nothing_before() {
        let mut t = table(4, 3, None, DynamicEviction::Lfu);
        let big = 987_654_321_012; // raw 64-bit ids, no range
        assert_eq!(step(&mut t, &[big, 5]), (vec![X, X], vec![]));
        assert_eq!(step(&mut t, &[big]), (vec![X], vec![]));
        // Third sighting: admitted into the lowest free row, a fresh row.
        assert_eq!(step(&mut t, &[big, 5, big]), (vec![0, X, 0], vec![0]));
        assert_eq!(step(&mut t, &[5, big]), (vec![1, 0], vec![1]));
        let s = t.stats();
        assert_eq!((s.live, s.admitted, s.rejected, s.lookups), (2, 2, 4, 8));
        let mut ids = vec![big, 5, 6];
        t.remap(&mut ids);
        assert_eq!(ids, [0, 1, X]);
    }

    #[test]
    fn rows_unseen_for_longer_than_the_ttl_are_freed_and_restart_fresh() {
        let mut t = table(3, 1, Some(2), DynamicEviction::Lru);
        assert_eq!(step(&mut t, &[10, 11]), (vec![0, 1], vec![0, 1])); // step 1
        assert_eq!(step(&mut t, &[11]), (vec![1], vec![])); // step 2
        assert_eq!(step(&mut t, &[11]), (vec![1], vec![])); // step 3: 10 last seen at 1, 1 + 2 >= 3
        // Step 4: 10 unseen for 3 steps (> ttl 2) is freed before the step; 10 comes back into
        // the lowest free row, which starts afresh.
        assert_eq!(step(&mut t, &[10]), (vec![0], vec![0]));
        assert_eq!(t.stats().expired, 1);
        // Step 7: 11 (last seen at 3) and 10 (4) both expired.
        step(&mut t, &[]);
        step(&mut t, &[]);
        assert_eq!(step(&mut t, &[]).0, Vec::<i64>::new());
        assert_eq!((t.stats().live, t.stats().expired), (0, 3));
    }

    #[test]
    fn at_capacity_the_least_frequently_used_row_makes_room() {
        let mut t = table(2, 1, None, DynamicEviction::Lfu);
        step(&mut t, &[1, 1, 1, 2]); // 1: count 3 in row 0; 2: count 1 in row 1
        step(&mut t, &[2]); // 2: count 2
        // 3 needs a row: 2 (count 2) goes, not 1 (count 3).
        assert_eq!(step(&mut t, &[3]), (vec![1], vec![1]));
        assert_eq!(t.ids(), [1, 3]);
        assert_eq!(t.stats().evicted, 1);
        // Rows used in this step are never taken: with both in use, 4 is not admitted.
        assert_eq!(step(&mut t, &[1, 3, 4]), (vec![0, 1, X], vec![]));
    }

    #[test]
    fn at_capacity_the_least_recently_used_row_makes_room() {
        let mut t = table(2, 1, None, DynamicEviction::Lru);
        step(&mut t, &[1, 1, 1, 2]); // step 1
        step(&mut t, &[2]); // step 2: 1 is now the least recent despite its count
        assert_eq!(step(&mut t, &[3]), (vec![0], vec![0]));
        assert_eq!(t.ids(), [3, 2]);
    }

    #[test]
    fn no_collisions_while_capacity_allows() {
        // 5,000 distinct ids from a 2^62 space into 5,000 rows: every id its own row.
        let mut t = table(5000, 1, None, DynamicEviction::Lfu);
        let ids: Vec<i64> = (0..5000u64).map(|i| (mix(i) >> 2) as i64).collect();
        for chunk in ids.chunks(250) {
            step(&mut t, chunk);
        }
        let mut rows: Vec<u32> = ids.iter().map(|&i| t.row_of(i).unwrap()).collect();
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(rows.len(), 5000);
        assert_eq!(t.stats().evicted, 0);
    }

    #[test]
    fn admission_with_a_probability_is_a_reproducible_coin() {
        let config = DynamicConfig {
            capacity: 100_000,
            admit_after: 1,
            admit_probability: 0.25,
            ttl_steps: None,
            eviction: DynamicEviction::Lfu,
            sketch_width: 16,
            sketch_depth: 2,
            seed: 3,
        };
        let (mut a, mut b) = (DynamicTable::new(config.clone()).unwrap(), DynamicTable::new(config).unwrap());
        let ids: Vec<i64> = (0..20_000).collect();
        step(&mut a, &ids);
        step(&mut b, &ids);
        assert_eq!(a.ids(), b.ids());
        let admitted = a.stats().admitted as f64 / 20_000.0;
        assert!((admitted - 0.25).abs() < 0.02, "{admitted}");
    }

    #[test]
    fn the_sketch_bounds_memory_and_counts_no_less_than_the_truth() {
        let mut t = table(10, 1_000_000, None, DynamicEviction::Lfu);
        // 100,000 distinct ids over a 64-counter-wide sketch: counts collide upward only.
        let mut t2 = DynamicTable::new(DynamicConfig { sketch_width: 64, ..t.config().clone() }).unwrap();
        for _ in 0..3 {
            let ids: Vec<i64> = (0..100_000).map(|i| i * 1_000_003).collect();
            step(&mut t2, &ids);
            step(&mut t, &ids[..10]);
        }
        for i in 0..10 {
            assert!(t.sketch_slots(i * 1_000_003).all(|s| t.sketch[s] >= 3));
        }
        assert_eq!(t2.sketch.len(), 64 * 4);
        assert_eq!(t2.stats().live, 0);
    }

    #[test]
    fn the_sketch_halves_every_width_sightings_so_old_counts_fade() {
        // Width 16: an id seen once, then 16 other sightings, has its count halved to 0; seen
        // twice within the period it is admitted at the second sighting.
        let mut t = DynamicTable::new(DynamicConfig {
            sketch_width: 16,
            ..table(4, 2, None, DynamicEviction::Lfu).config().clone()
        })
        .unwrap();
        assert_eq!(step(&mut t, &[1]).0, [X]);
        let others: Vec<i64> = (100..116).collect();
        step(&mut t, &others);
        assert_eq!(step(&mut t, &[1]).0, [X], "the first sighting faded");
        assert_eq!(step(&mut t, &[1]).0, [0], "two sightings within a period admit");
    }

    #[test]
    fn memory_follows_the_rows_used_not_the_capacity() {
        // A billion rows of capacity (a key-value store behind them): the map holds the three
        // rows used, and its state (a checkpoint's) the two live ones.
        let mut t = table(1_000_000_000, 1, Some(1), DynamicEviction::Lru);
        step(&mut t, &[5, 6, 7]);
        step(&mut t, &[6]);
        step(&mut t, &[8]); // 5 and 7 expired (rows 0 and 2); 8 takes row 0, the lowest free.
        assert_eq!(t.ids(), [8, 6, X]);
        assert!(t.bytes() < 64 * 1024 + 1024 * 4 * 4, "{} bytes", t.bytes());
        let s = t.state();
        assert_eq!((s.rows, s.ids, s.counts, s.last), (vec![0, 1], vec![8, 6], vec![1, 2], vec![3, 2]));
    }

    #[test]
    fn a_restored_state_continues_exactly() {
        let mut a = table(8, 2, Some(5), DynamicEviction::Lfu);
        let stream: Vec<Vec<i64>> =
            (0..40u64).map(|s| (0..12u64).map(|k| ((mix(s * 31 + k) % 20) as i64) * 7).collect()).collect();
        for ids in &stream[..20] {
            step(&mut a, ids);
        }
        let mut b = table(8, 2, Some(5), DynamicEviction::Lfu);
        b.load(a.state()).unwrap();
        for ids in &stream[20..] {
            assert_eq!(step(&mut a, ids), step(&mut b, ids));
        }
        assert_eq!(a.state(), b.state());
        let mut wrong = table(4, 2, Some(5), DynamicEviction::Lfu);
        assert!(wrong.load(a.state()).is_err());
    }
}
