//! What the pooled and the sequence collections share: tables grouped into table-batched
//! groups, outputs (one per feature), bounds checks, and the fused backward.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use rayon::prelude::*;
use trainrec_sparse::KeyedJaggedTensor;

use crate::cache::{RowCache, TbeSlots};
use crate::tbe::{Occ, Tbe, clamp_row};
use crate::{BoundsCheckMode, EmbeddingBagConfig, EmbeddingError, PoolingMode, SparseOptimizerConfig, WeightPrecision};

/// A group of tables in one precision.
pub(crate) enum Group {
    F32(Tbe<f32>),
    F16(Tbe<f16>),
    Bf16(Tbe<bf16>),
}

/// Runs `$e` with `$t` bound to the group's typed [`Tbe`].
macro_rules! dispatch {
    ($g:expr, $t:ident => $e:expr) => {
        match $g {
            $crate::collection::Group::F32($t) => $e,
            $crate::collection::Group::F16($t) => $e,
            $crate::collection::Group::Bf16($t) => $e,
        }
    };
}
pub(crate) use dispatch;

/// A table and where it lives.
pub(crate) struct TableInfo {
    pub config: EmbeddingBagConfig,
    pub optimizer: SparseOptimizerConfig,
    pub group: usize,
    pub local: usize,
}

/// One output: a feature looked up in a table.
#[derive(Clone, Debug)]
pub(crate) struct Output {
    pub name: String,
    pub input: String,
    pub table: usize,
    pub dim: usize,
    /// First column in the pooled output (pooled collections).
    pub column: usize,
}

pub(crate) struct Core {
    pub tables: Vec<TableInfo>,
    pub outputs: Vec<Output>,
    pub groups: Vec<Group>,
    pub optimizer: SparseOptimizerConfig,
    pub bounds: BoundsCheckMode,
    /// Ids outside their table seen so far (`warning` mode).
    pub bad_ids: AtomicU64,
    occ: Vec<Vec<Vec<Occ>>>,
    tmp: Vec<Vec<Vec<Occ>>>,
    /// Per table: its cache, when only a cache of its rows is in memory.
    pub caches: Vec<Option<RowCache>>,
    /// The seed the initial weights come from ([`initial_weights`]).
    pub seed: u64,
    /// Prefetched batches not yet trained, oldest first.
    pending: VecDeque<Pending>,
}

/// A prefetched batch: what identifies it and the cache slots it pinned per cached table.
struct Pending {
    fingerprint: u64,
    pins: Vec<(usize, Vec<u32>)>,
}

/// How the kernels read one output's ids from a cached table.
pub(crate) enum Lookup {
    /// Every row is resident: the ids translated to cache slots.
    Slots(Vec<i64>),
    /// Some rows are not: the batch's distinct rows copied out (fp32, `n` rows), the ids
    /// translated to positions there.
    Staged { values: Vec<i64>, rows: Vec<f32>, n: u64 },
}

#[derive(PartialEq)]
struct GroupKey {
    precision: WeightPrecision,
    stochastic: bool,
    optimizer: SparseOptimizerConfig,
    pooling: Option<PoolingMode>,
}

impl Core {
    /// Validates and builds the tables, initialised uniform in `±sqrt(1/rows)` (TorchRec's
    /// default) deterministically from `seed`.
    pub(crate) fn new(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
        pooled: bool,
    ) -> Result<Self, EmbeddingError> {
        optimizer.validate().map_err(EmbeddingError::Config)?;
        let mut names = HashSet::new();
        let mut feature_names = HashSet::new();
        let mut outputs = Vec::new();
        let mut column = 0;
        let mut keys: Vec<GroupKey> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut tables = Vec::with_capacity(configs.len());
        for (t, config) in configs.into_iter().enumerate() {
            if !names.insert(config.name.clone()) {
                return Err(EmbeddingError::Config(format!("duplicate table name \"{}\"", config.name)));
            }
            if config.rows == 0 || config.dim == 0 {
                return Err(EmbeddingError::Config(format!("table \"{}\" needs rows > 0 and dim > 0", config.name)));
            }
            if config.features.is_empty() {
                return Err(EmbeddingError::Config(format!("table \"{}\" has no features", config.name)));
            }
            let opt = config.optimizer.clone().unwrap_or_else(|| optimizer.clone());
            opt.validate().map_err(|e| EmbeddingError::Config(format!("table \"{}\": {e}", config.name)))?;
            for f in &config.features {
                if !feature_names.insert(f.clone()) {
                    return Err(EmbeddingError::Config(format!(
                        "feature \"{f}\" is in two tables; name it feature@table"
                    )));
                }
                let input = f.split_once('@').map_or(f.as_str(), |(i, _)| i).to_string();
                outputs.push(Output { name: f.clone(), input, table: t, dim: config.dim, column });
                column += config.dim;
            }
            let key = GroupKey {
                precision: config.precision,
                stochastic: config.stochastic_rounding && config.precision != WeightPrecision::Fp32,
                optimizer: opt.clone(),
                pooling: pooled.then_some(config.pooling),
            };
            let group = match keys.iter().position(|k| *k == key) {
                Some(g) => g,
                None => {
                    keys.push(key);
                    members.push(Vec::new());
                    keys.len() - 1
                }
            };
            let local = members[group].len();
            members[group].push(t);
            tables.push(TableInfo { config, optimizer: opt, group, local });
        }
        let mut groups = Vec::with_capacity(keys.len());
        if !pooled {
            if let Some(t) = tables.iter().find(|t| t.config.cache.is_some()) {
                return Err(EmbeddingError::Config(format!(
                    "table \"{}\": cached tables serve pooled lookups only (an embedding bag collection)",
                    t.config.name
                )));
            }
        }
        let mut caches: Vec<Option<RowCache>> = (0..tables.len()).map(|_| None).collect();
        for (g, key) in keys.iter().enumerate() {
            // A cached table's group holds only its cache slots.
            let specs: Vec<(u64, usize, String)> = members[g]
                .iter()
                .map(|&t| {
                    let c = &tables[t].config;
                    (c.cache.as_ref().map_or(c.rows, |k| k.slots.min(c.rows)), c.dim, c.name.clone())
                })
                .collect();
            let gseed = seed ^ 0x5851_F42D_4C95_7F2D_u64.wrapping_mul(g as u64 + 1);
            let (opt, sr) = (key.optimizer.clone(), key.stochastic);
            let mut group = match key.precision {
                WeightPrecision::Fp32 => Group::F32(Tbe::new(&specs, opt, sr, gseed)?),
                WeightPrecision::Fp16 => Group::F16(Tbe::new(&specs, opt, sr, gseed)?),
                WeightPrecision::Bf16 => Group::Bf16(Tbe::new(&specs, opt, sr, gseed)?),
            };
            for (local, &t) in members[g].iter().enumerate() {
                let c = &tables[t].config;
                let (bound, key) = init_params(seed, t, c.rows);
                match &c.cache {
                    None => dispatch!(&mut group, tbe => tbe.init_uniform(local, bound, key)),
                    Some(cache) => {
                        let spr = tables[t].optimizer.state_per_row(c.dim);
                        let init = table_initial(seed, t, c);
                        caches[t] = Some(RowCache::with_precision(
                            keys[g].precision,
                            &c.name,
                            cache,
                            c.rows,
                            c.dim,
                            spr,
                            init,
                        )?);
                    }
                }
            }
            groups.push(group);
        }
        let occ = members.iter().map(|m| vec![Vec::new(); m.len()]).collect::<Vec<_>>();
        let tmp = occ.clone();
        Ok(Self {
            tables,
            outputs,
            groups,
            optimizer,
            bounds: BoundsCheckMode::Fatal,
            bad_ids: AtomicU64::new(0),
            occ,
            tmp,
            caches,
            seed,
            pending: VecDeque::new(),
        })
    }

    pub(crate) fn table_index(&self, name: &str) -> Option<usize> {
        self.tables.iter().position(|t| t.config.name == name)
    }

    fn table_or_err(&self, name: &str) -> Result<usize, EmbeddingError> {
        self.table_index(name).ok_or_else(|| EmbeddingError::Config(format!("no table \"{name}\"")))
    }

    pub(crate) fn weights(&self, name: &str) -> Option<Vec<f32>> {
        let i = self.table_index(name)?;
        let t = &self.tables[i];
        Some(match &self.caches[i] {
            Some(c) => dispatch!(&self.groups[t.group], g => c.table_f32(g, t.local).0),
            None => dispatch!(&self.groups[t.group], g => g.weights_f32(t.local)),
        })
    }

    pub(crate) fn state(&self, name: &str) -> Option<Vec<f32>> {
        let i = self.table_index(name)?;
        let t = &self.tables[i];
        Some(match &self.caches[i] {
            Some(c) => dispatch!(&self.groups[t.group], g => c.table_f32(g, t.local).1),
            None => dispatch!(&self.groups[t.group], g => g.state(t.local).to_vec()),
        })
    }

    pub(crate) fn set_weights(&mut self, name: &str, w: &[f32]) -> Result<(), EmbeddingError> {
        let i = self.table_or_err(name)?;
        let t = &self.tables[i];
        let n = t.config.rows as usize * t.config.dim;
        if w.len() != n {
            return Err(EmbeddingError::Shape(format!("table \"{name}\" holds {n} floats, got {}", w.len())));
        }
        match &mut self.caches[i] {
            Some(c) => dispatch!(&mut self.groups[t.group], g => c.set_table(g, t.local, Some(w), None))?,
            None => dispatch!(&mut self.groups[t.group], g => g.set_weights(t.local, w)),
        }
        Ok(())
    }

    pub(crate) fn set_state(&mut self, name: &str, s: &[f32]) -> Result<(), EmbeddingError> {
        let i = self.table_or_err(name)?;
        let t = &self.tables[i];
        let spr = t.optimizer.state_per_row(t.config.dim);
        let n = t.config.rows as usize * spr;
        if s.len() != n {
            return Err(EmbeddingError::Shape(format!(
                "optimizer state of table \"{name}\" holds {n} floats, got {}",
                s.len()
            )));
        }
        match &mut self.caches[i] {
            Some(c) if spr > 0 => dispatch!(&mut self.groups[t.group], g => c.set_table(g, t.local, None, Some(s)))?,
            Some(_) => {}
            None => dispatch!(&mut self.groups[t.group], g => g.set_state(t.local, s)),
        }
        Ok(())
    }

    /// Table number `i`'s initial fp32 weights as a function of a row range (all columns):
    /// the values its rows start from, and a cached table's never-written rows read as.
    pub(crate) fn initial_fn(
        &self,
        i: usize,
    ) -> impl Fn(std::ops::Range<u64>) -> Vec<f32> + Send + Sync + 'static + use<> {
        table_initial(self.seed, i, &self.tables[i].config)
    }

    /// The rows of table `name` that hold anything but their initial weights and zero state,
    /// ascending, when the table keeps only those (a `KeyValue` store); `None` otherwise.
    pub(crate) fn sparse_rows(&self, name: &str) -> Option<Vec<u64>> {
        let i = self.table_index(name)?;
        let rows = self.caches[i].as_ref()?.written_rows()?;
        Some(rows.into_iter().map(u64::from).collect())
    }

    /// The fp32 weights (`[rows, dim]`) and optimizer state (`[rows, spr]`) of `rows` of
    /// table `name`.
    pub(crate) fn rows_state(&self, name: &str, rows: &[u64]) -> Result<(Vec<f32>, Vec<f32>), EmbeddingError> {
        let i = self.table_or_err(name)?;
        let t = &self.tables[i];
        let (dim, spr) = (t.config.dim, t.optimizer.state_per_row(t.config.dim));
        if let Some(r) = rows.iter().find(|&&r| r >= t.config.rows) {
            return Err(EmbeddingError::Shape(format!("table \"{name}\" has {} rows, not row {r}", t.config.rows)));
        }
        Ok(match &self.caches[i] {
            Some(c) => {
                let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                dispatch!(&self.groups[t.group], g => c.rows_f32(g, t.local, &rows))
            }
            None => {
                let (mut w, mut st) = (Vec::with_capacity(rows.len() * dim), Vec::with_capacity(rows.len() * spr));
                dispatch!(&self.groups[t.group], g => {
                    for &r in rows {
                        let (rw, rs) = g.row(t.local, r as usize);
                        w.extend(rw.iter().map(|x| crate::precision::Weight::to_f32(*x)));
                        st.extend_from_slice(rs);
                    }
                });
                (w, st)
            }
        })
    }

    /// Sets table `name` to a sparse block: `rows` (ascending) get `weights` (`[rows, dim]`)
    /// and `state` (`[rows, spr]`; empty for a stateless optimizer), every other row its
    /// initial weights and zero state.
    pub(crate) fn load_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        weights: &[f32],
        state: &[f32],
    ) -> Result<(), EmbeddingError> {
        let i = self.table_or_err(name)?;
        let (dim, spr, n) = {
            let t = &self.tables[i];
            (t.config.dim, t.optimizer.state_per_row(t.config.dim), t.config.rows)
        };
        if weights.len() != rows.len() * dim || state.len() != rows.len() * spr {
            return Err(EmbeddingError::Shape(format!(
                "table \"{name}\": {} rows need {} weights and {} state values, got {} and {}",
                rows.len(),
                rows.len() * dim,
                rows.len() * spr,
                weights.len(),
                state.len()
            )));
        }
        if let Some(r) = rows.iter().find(|&&r| r >= n) {
            return Err(EmbeddingError::Shape(format!("table \"{name}\" has {n} rows, not row {r}")));
        }
        if self.caches[i].is_none() {
            let mut w = self.initial_fn(i)(0..n);
            let mut st = vec![0f32; n as usize * spr];
            for (j, &r) in rows.iter().enumerate() {
                w[r as usize * dim..][..dim].copy_from_slice(&weights[j * dim..][..dim]);
                st[r as usize * spr..][..spr].copy_from_slice(&state[j * spr..][..spr]);
            }
            self.set_weights(name, &w)?;
            return if spr > 0 { self.set_state(name, &st) } else { Ok(()) };
        }
        // Rows written now but not in the block go back to their initial values.
        let stale: Vec<u64> = self.sparse_rows(name).unwrap_or_default();
        let zeros = vec![0f32; spr];
        let initial = self.initial_fn(i);
        let t = &self.tables[i];
        let c = self.caches[i].as_mut().expect("a cached table");
        dispatch!(&mut self.groups[t.group], g => {
            for r in stale.into_iter().filter(|r| rows.binary_search(r).is_err()) {
                c.write_row(g, t.local, r as u32, &initial(r..r + 1), Some(&zeros))?;
            }
            for (j, &r) in rows.iter().enumerate() {
                c.write_row(g, t.local, r as u32, &weights[j * dim..][..dim], Some(&state[j * spr..][..spr]))?;
            }
        });
        Ok(())
    }

    /// Optimizer steps applied to table `name`'s group.
    pub(crate) fn step_count(&self, name: &str) -> Option<u64> {
        let t = &self.tables[self.table_index(name)?];
        Some(dispatch!(&self.groups[t.group], g => g.iter))
    }

    /// Table `name`'s stochastic-rounding stream: its group's seed and its index in the group
    /// (`None` for tables that round to nearest).
    pub(crate) fn rounding_stream(&self, name: &str) -> Option<(u64, u64)> {
        let t = &self.tables[self.table_index(name)?];
        dispatch!(&self.groups[t.group], g => g.rounding_seed()).map(|seed| (seed, t.local as u64))
    }

    /// Re-initialises rows of table `name` (uniform in the table's init bound, from `key`),
    /// optimizer state zero. Rows outside the table are an error (nothing changed).
    pub(crate) fn reset_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: Option<(&crate::tbe::RowBlock, u64)>,
    ) -> Result<(), EmbeddingError> {
        let i = self.table_or_err(name)?;
        let t = &self.tables[i];
        let n = t.config.rows;
        if let Some(r) = rows.iter().find(|&&r| r >= n) {
            return Err(EmbeddingError::Shape(format!("table \"{name}\" has {n} rows, cannot reset row {r}")));
        }
        let whole = crate::tbe::RowBlock { row_offset: 0, cols: 0..t.config.dim, full_dim: t.config.dim };
        // A block draws from the whole table's init bound (its rows).
        let (block, table_rows) = block.unwrap_or((&whole, n));
        if block.cols.len() != t.config.dim || block.cols.end > block.full_dim {
            return Err(EmbeddingError::Shape(format!(
                "table \"{name}\" is {} wide but its block says columns {:?} of {}",
                t.config.dim, block.cols, block.full_dim
            )));
        }
        let values = crate::tbe::reset_values(key, table_rows, block, rows);
        match &mut self.caches[i] {
            Some(c) => {
                let zeros = vec![0f32; t.optimizer.state_per_row(t.config.dim)];
                dispatch!(&mut self.groups[t.group], g => {
                    for (&r, row) in rows.iter().zip(values.chunks_exact(t.config.dim)) {
                        c.write_row(g, t.local, r as u32, row, Some(&zeros))?;
                    }
                })
            }
            None => dispatch!(&mut self.groups[t.group], g => g.reset_rows(t.local, rows, &values)),
        }
        Ok(())
    }

    /// Sets the factor on every table's optimizer `lr` for the next updates.
    pub(crate) fn set_lr_multiplier(&mut self, multiplier: f64) {
        for g in &mut self.groups {
            dispatch!(g, g => g.lr_multiplier = multiplier);
        }
    }

    /// Sets the optimizer steps of table `name`'s group (every table of the group).
    pub(crate) fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), EmbeddingError> {
        let t = &self.tables[self.table_or_err(name)?];
        dispatch!(&mut self.groups[t.group], g => g.iter = steps);
        Ok(())
    }

    /// Whether any table is cached.
    pub(crate) fn has_cache(&self) -> bool {
        self.caches.iter().any(Option::is_some)
    }

    /// Per cached table, the rows its outputs read in `kjt` (ids clamped as the kernels do).
    fn cached_rows(&self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Vec<(usize, Vec<u32>)> {
        let mut out: Vec<(usize, Vec<u32>)> = Vec::new();
        for (o, &k) in self.outputs.iter().zip(keys) {
            if self.caches[o.table].is_none() {
                continue;
            }
            let rows = self.tables[o.table].config.rows;
            let ids = kjt.feature(k).values.iter().map(|&id| clamp_row(id, rows) as u32);
            match out.iter_mut().find(|(t, _)| *t == o.table) {
                Some((_, v)) => v.extend(ids),
                None => out.push((o.table, ids.collect())),
            }
        }
        out
    }

    /// Pins `rows` (from [`Self::cached_rows`]) in their caches; on failure nothing stays pinned.
    fn pin_rows(&mut self, rows: Vec<(usize, Vec<u32>)>) -> Result<Pending, EmbeddingError> {
        let fingerprint = fingerprint(&rows);
        let mut pins: Vec<(usize, Vec<u32>)> = Vec::new();
        for (t, r) in rows {
            let info = &self.tables[t];
            let cache = self.caches[t].as_mut().expect("a cached table");
            let got = dispatch!(&mut self.groups[info.group], g => {
                cache.pin(&info.config.name, &mut TbeSlots { tbe: g, t: info.local }, r.into_iter())
            });
            match got {
                Ok(slots) => pins.push((t, slots)),
                Err(e) => {
                    for (t, slots) in &pins {
                        self.caches[*t].as_mut().expect("a cached table").unpin(slots, false);
                    }
                    return Err(e);
                }
            }
        }
        Ok(Pending { fingerprint, pins })
    }

    /// Loads the rows `kjt` reads into the caches of cached tables and pins them until the
    /// batch's update (the next backward of this batch) or [`Self::discard_prefetched`].
    pub(crate) fn prefetch(&mut self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Result<(), EmbeddingError> {
        if !self.has_cache() {
            return Ok(());
        }
        let rows = self.cached_rows(kjt, keys);
        let pending = self.pin_rows(rows)?;
        self.pending.push_back(pending);
        Ok(())
    }

    /// Unpins every prefetched batch not trained yet.
    pub(crate) fn discard_prefetched(&mut self) {
        while let Some(p) = self.pending.pop_front() {
            for (t, slots) in &p.pins {
                self.caches[*t].as_mut().expect("a cached table").unpin(slots, false);
            }
        }
    }

    /// Prefetched batches waiting for their update.
    pub(crate) fn prefetched(&self) -> usize {
        self.pending.len()
    }

    /// How the kernels read each output's ids: `None` for tables in memory.
    pub(crate) fn lookups(&self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Vec<Option<Lookup>> {
        self.outputs
            .iter()
            .zip(keys)
            .map(|(o, &k)| {
                let cache = self.caches[o.table].as_ref()?;
                let info = &self.tables[o.table];
                let rows = info.config.rows;
                let values = kjt.feature(k).values;
                let slots: Option<Vec<i64>> =
                    values.iter().map(|&id| cache.slot(clamp_row(id, rows) as u32).map(i64::from)).collect();
                if let Some(slots) = slots {
                    return Some(Lookup::Slots(slots));
                }
                // Not prefetched: read the batch's distinct rows from slots or file, the file's
                // pages requested all at once first.
                let wanted: Vec<u32> = values.iter().map(|&id| clamp_row(id, rows) as u32).collect();
                cache.read_ahead(&wanted);
                let mut index: HashMap<u32, i64> = HashMap::new();
                let mut staged = Vec::new();
                let mut row = vec![0f32; o.dim];
                let values = values
                    .iter()
                    .map(|&id| {
                        let r = clamp_row(id, rows) as u32;
                        *index.entry(r).or_insert_with(|| {
                            dispatch!(&self.groups[info.group], g => cache.read_row(g, info.local, r, &mut row));
                            staged.extend_from_slice(&row);
                            (staged.len() / o.dim - 1) as i64
                        })
                    })
                    .collect();
                let n = index.len() as u64;
                Some(Lookup::Staged { values, rows: staged, n })
            })
            .collect()
    }

    /// Positions of the outputs' input features in `kjt`.
    pub(crate) fn resolve(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, EmbeddingError> {
        resolve_inputs(kjt, self.outputs.iter().map(|o| (o.input.as_str(), self.tables[o.table].config.name.as_str())))
    }

    /// Applies the bounds-check mode: `fatal` fails on the first bad id (nothing changed),
    /// `warning` counts and logs, `ignore` does nothing (kernels read row 0 for bad ids).
    pub(crate) fn check_ids(&self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Result<(), EmbeddingError> {
        if self.bounds == BoundsCheckMode::Ignore {
            return Ok(());
        }
        let found: Vec<Option<(usize, i64)>> = self
            .outputs
            .par_iter()
            .zip(keys)
            .map(|(o, &k)| {
                let rows = self.tables[o.table].config.rows;
                let f = kjt.feature(k);
                match self.bounds {
                    BoundsCheckMode::Fatal => {
                        f.values.iter().position(|&id| id < 0 || id as u64 >= rows).map(|p| (p, f.values[p]))
                    }
                    _ => {
                        let n = f.values.iter().filter(|&&id| id < 0 || id as u64 >= rows).count();
                        (n > 0).then_some((n, 0))
                    }
                }
            })
            .collect();
        if self.bounds == BoundsCheckMode::Fatal {
            if let Some((o, (pos, id))) = found.iter().enumerate().find_map(|(o, f)| f.map(|f| (o, f))) {
                let f = kjt.feature(keys[o]);
                let o = &self.outputs[o];
                let t = &self.tables[o.table].config;
                debug_assert_eq!(f.values[pos], id);
                return Err(id_out_of_range(&f, pos, &t.name, &o.input, t.rows));
            }
        } else {
            let bad: usize = found.iter().flatten().map(|&(n, _)| n).sum();
            if bad > 0 {
                let total = self.bad_ids.fetch_add(bad as u64, Ordering::Relaxed) + bad as u64;
                let worst = found.iter().position(|f| f.is_some()).map(|o| &self.outputs[o]);
                if let Some(o) = worst {
                    tracing::warn!(
                        bad_ids = bad,
                        total,
                        "{bad} ids out of range in this batch (first in feature \"{}\", table \"{}\", {} rows); \
                         they read and update row 0",
                        o.input,
                        self.tables[o.table].config.name,
                        self.tables[o.table].config.rows
                    );
                }
            }
        }
        Ok(())
    }

    /// Fused backward + optimizer: lists every id occurrence with `src(output, bag, position
    /// in the feature's values)` into `grad`, scaled by its per-id weight when `weighted` (and
    /// 1/L when `mean_of(output)`), then runs each group's update.
    pub(crate) fn backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        keys: &[usize],
        weighted: bool,
        grad: &[f32],
        src: impl Fn(usize, usize, usize) -> usize + Sync,
        mean_of: impl Fn(usize) -> bool + Sync,
    ) -> Result<(), EmbeddingError> {
        if grad.len() > u32::MAX as usize {
            return Err(EmbeddingError::Shape(format!(
                "a gradient of {} floats is over the kernel's {} limit: use smaller batches",
                grad.len(),
                u32::MAX
            )));
        }
        // Cached tables: the batch's rows resident and pinned (by its prefetch, or now).
        let pins = if self.has_cache() {
            let rows = self.cached_rows(kjt, keys);
            let f = fingerprint(&rows);
            match self.pending.iter().position(|p| p.fingerprint == f) {
                Some(i) => self.pending.remove(i).expect("a prefetched batch").pins,
                None => self.pin_rows(rows)?.pins,
            }
        } else {
            Vec::new()
        };
        let slot_ids: Vec<Option<Vec<u32>>> = self
            .outputs
            .iter()
            .zip(keys)
            .map(|(o, &k)| {
                let cache = self.caches[o.table].as_ref()?;
                let rows = self.tables[o.table].config.rows;
                Some(
                    kjt.feature(k)
                        .values
                        .iter()
                        .map(|&id| cache.slot(clamp_row(id, rows) as u32).expect("pinned rows are resident"))
                        .collect(),
                )
            })
            .collect();
        let batch = kjt.stride();
        let outputs = &self.outputs;
        let tables = &self.tables;
        let slot_ids = &slot_ids;
        let mut lists: Vec<(usize, usize, &mut Vec<Occ>)> = Vec::new();
        for (g, group) in self.occ.iter_mut().enumerate() {
            for (local, list) in group.iter_mut().enumerate() {
                lists.push((g, local, list));
            }
        }
        let fill = |(g, local, list): (usize, usize, &mut Vec<Occ>)| {
            list.clear();
            for (oi, o) in outputs.iter().enumerate() {
                let t = &tables[o.table];
                if t.group != g || t.local != local {
                    continue;
                }
                let rows = t.config.rows;
                let f = kjt.feature(keys[oi]);
                let mean = mean_of(oi);
                for b in 0..batch {
                    let (s, e) = (f.bag_start(b), f.bag_start(b + 1));
                    let pool = if mean && e > s { 1.0 / (e - s) as f32 } else { 1.0 };
                    for pos in s..e {
                        let w = if weighted { f.weights.map_or(1.0, |w| w[pos]) } else { 1.0 };
                        let row = match &slot_ids[oi] {
                            Some(slots) => slots[pos],
                            None => clamp_row(f.values[pos], rows) as u32,
                        };
                        list.push(Occ { row, src: src(oi, b, pos) as u32, scale: pool * w });
                    }
                }
            }
        };
        // One thread: run here, not on the pool's worker (no hand-off, this core's caches).
        if rayon::current_num_threads() == 1 {
            lists.into_iter().for_each(fill);
        } else {
            lists.into_par_iter().for_each(fill);
        }
        let threads = rayon::current_num_threads();
        for ((group, occ), tmp) in self.groups.iter_mut().zip(&mut self.occ).zip(&mut self.tmp) {
            dispatch!(group, g => g.update(occ, tmp, grad, threads));
        }
        for (t, slots) in &pins {
            self.caches[*t].as_mut().expect("a cached table").unpin(slots, true);
        }
        Ok(())
    }
}

/// The KJT key each of `inputs` reads (each an input feature and the table reading it): an
/// error naming the first feature missing from `kjt`, or a variable-batch KJT, which only
/// the sharded path takes. Every collection, CPU or CUDA, resolves its outputs this way.
pub fn resolve_inputs<'a>(
    kjt: &KeyedJaggedTensor,
    inputs: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<Vec<usize>, EmbeddingError> {
    if kjt.variable_stride_per_key() {
        return Err(EmbeddingError::Shape("variable-batch (VBE) input needs the sharded embedding path".into()));
    }
    inputs
        .map(|(input, table)| {
            kjt.key_index(input).ok_or_else(|| EmbeddingError::MissingFeature {
                feature: input.to_string(),
                table: table.to_string(),
                available: kjt.keys().join(", "),
            })
        })
        .collect()
}

/// The bounds-check `fatal` error for the id at position `pos` of feature `f` (read by
/// `feature` of `table`, `rows` rows): it names the example (bag) holding it.
pub fn id_out_of_range(
    f: &trainrec_sparse::FeatureView<'_>,
    pos: usize,
    table: &str,
    feature: &str,
    rows: u64,
) -> EmbeddingError {
    let sample = (0..f.num_bags()).take_while(|&b| f.bag_start(b + 1) <= pos).count();
    EmbeddingError::IdOutOfRange {
        table: table.to_string(),
        feature: feature.to_string(),
        sample,
        id: f.values[pos],
        rows,
    }
}

/// Identifies a batch by the rows it reads from cached tables.
fn fingerprint(rows: &[(usize, Vec<u32>)]) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for (t, r) in rows {
        h = (h ^ *t as u64).wrapping_mul(0x100_0000_01B3);
        h = (h ^ r.len() as u64).wrapping_mul(0x100_0000_01B3);
        for &x in r {
            h = (h ^ u64::from(x)).wrapping_mul(0x100_0000_01B3);
        }
    }
    h
}

/// The bound (TorchRec's `sqrt(1 / rows)`) and generator key of table number `t`'s initial
/// weights in a collection built with `seed`.
fn init_params(seed: u64, t: usize, rows: u64) -> (f32, u64) {
    ((1.0 / rows as f64).sqrt() as f32, seed ^ 0xE3B0_C442_98FC_1C14u64.wrapping_mul(t as u64 + 1))
}

/// The initial fp32 weights that `EmbeddingBagCollection::new` (and the sequence
/// collection) give the cells `rows x cols` of table number `table` (its position in the
/// collection's table list), a `table_rows x dim` table, for `seed`: row-major
/// `[rows, cols]`. A shard of the table computes its block alone, so a table sharded any way
/// starts from the same weights as the unsharded table.
pub fn initial_weights(
    seed: u64,
    table: usize,
    table_rows: u64,
    dim: usize,
    rows: std::ops::Range<u64>,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let (bound, key) = init_params(seed, table, table_rows);
    crate::tbe::init_uniform_block(key, bound, dim, rows, cols)
}

/// The initial fp32 weights of table number `t` (`config`) of a collection built with `seed`,
/// as a function of a row range (all columns): its own ([`initial_weights`]), or its block's
/// of the larger table it is a shard of.
fn table_initial(
    seed: u64,
    t: usize,
    config: &EmbeddingBagConfig,
) -> impl Fn(std::ops::Range<u64>) -> Vec<f32> + Send + Sync + 'static + use<> {
    let (rows, dim, block) = (config.rows, config.dim, config.init_block.clone());
    move |r: std::ops::Range<u64>| match &block {
        Some(b) => b.rows(r),
        None => initial_weights(seed, t, rows, dim, r, 0..dim),
    }
}

impl crate::InitBlock {
    /// The initial weights of the block's rows `rows` (block-local).
    pub fn rows(&self, rows: std::ops::Range<u64>) -> Vec<f32> {
        initial_weights(
            self.seed,
            self.table,
            self.table_rows,
            self.table_dim,
            rows.start + self.first_row..rows.end + self.first_row,
            self.cols.clone(),
        )
    }
}
