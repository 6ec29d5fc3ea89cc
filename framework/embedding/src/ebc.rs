use std::sync::atomic::Ordering;

use rayon::prelude::*;
use trainrec_sparse::{KeyedJaggedTensor, KeyedTensor};

use crate::collection::{Core, Lookup, dispatch};
use crate::tbe::PoolArgs;
use crate::tbe::RowBlock;
use crate::{BoundsCheckMode, EmbeddingBagConfig, EmbeddingError, PoolingMode, SparseOptimizerConfig};

/// Unsharded pooled embedding lookups over several tables, with the sparse optimizer fused
/// into the backward (TorchRec's `EmbeddingBagCollection` over FBGEMM's table-batched
/// embedding with a fused optimizer). Tables sharing precision, optimizer and pooling live in
/// one table-batched group.
pub struct EmbeddingBagCollection {
    core: Core,
    width: usize,
}

impl EmbeddingBagCollection {
    /// Builds the tables, initialised uniform in `±sqrt(1/rows)` (TorchRec's default),
    /// deterministically from `seed`. `optimizer` is used by every table without its own.
    pub fn new(
        tables: Vec<EmbeddingBagConfig>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
    ) -> Result<Self, EmbeddingError> {
        let core = Core::new(tables, optimizer, seed, true)?;
        let width = core.outputs.iter().map(|o| o.dim).sum();
        Ok(Self { core, width })
    }

    /// Sets what lookups do with ids outside their table (default `fatal`).
    pub fn set_bounds_check(&mut self, mode: BoundsCheckMode) {
        self.core.bounds = mode;
    }

    /// Out-of-range ids seen so far under the `warning` bounds-check mode.
    pub fn bounds_violations(&self) -> u64 {
        self.core.bad_ids.load(Ordering::Relaxed)
    }

    /// Output names (one per feature, table order then feature order).
    pub fn output_keys(&self) -> Vec<String> {
        self.core.outputs.iter().map(|o| o.name.clone()).collect()
    }

    /// Output widths, in [`Self::output_keys`] order.
    pub fn output_dims(&self) -> Vec<usize> {
        self.core.outputs.iter().map(|o| o.dim).collect()
    }

    /// The weights of table `name` as fp32, `[rows, dim]` row-major.
    pub fn table_weights(&self, name: &str) -> Option<Vec<f32>> {
        self.core.weights(name)
    }

    /// The optimizer state of table `name` (`rows * state_per_row(dim)` floats: for Adam
    /// family and LAMB the first moments of a row, then its second moment(s); for partial
    /// row-wise Adam the row's second moment first). Empty for SGD.
    pub fn optimizer_state(&self, name: &str) -> Option<Vec<f32>> {
        self.core.state(name)
    }

    /// Replaces the weights of table `name` (rounded to nearest for fp16/bf16 tables).
    pub fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), EmbeddingError> {
        self.core.set_weights(name, &weights)
    }

    /// Replaces the optimizer state of table `name`, e.g. when restoring a checkpoint.
    pub fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), EmbeddingError> {
        self.core.set_state(name, &state)
    }

    /// The rows of table `name` that hold anything but their initial weights and zero
    /// optimizer state, ascending, when the table keeps only those (the `key_value` kernel's
    /// store): what a checkpoint saves of it. `None`: every row is held.
    pub fn sparse_rows(&self, name: &str) -> Option<Vec<u64>> {
        self.core.sparse_rows(name)
    }

    /// The fp32 weights (`[rows, dim]`) and optimizer state of `rows` of table `name`.
    pub fn rows_state(&self, name: &str, rows: &[u64]) -> Result<(Vec<f32>, Vec<f32>), EmbeddingError> {
        self.core.rows_state(name, rows)
    }

    /// Sets table `name` from a sparse block ([`Self::sparse_rows`]): `rows` (ascending) get
    /// `weights` and `state`, every other row its initial weights and zero state.
    pub fn load_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        weights: &[f32],
        state: &[f32],
    ) -> Result<(), EmbeddingError> {
        self.core.load_rows(name, rows, weights, state)
    }

    /// Optimizer steps applied so far to table `name` (the `t` of Adam's bias correction).
    pub fn step_count(&self, name: &str) -> Option<u64> {
        self.core.step_count(name)
    }

    /// Where table `name`'s fp16/bf16 updates draw their stochastic-rounding bits: `(seed,
    /// table)` such that row `r`'s stream at update `t` is keyed
    /// `rounding_key(seed, t) ^ (table << 40) ^ r` (see [`crate::rounding_key`]). `None` when
    /// the table rounds to nearest (fp32, or `stochastic_rounding = false`). Other kernels (the
    /// CUDA engine) use it to round exactly like this collection.
    pub fn rounding_stream(&self, name: &str) -> Option<(u64, u64)> {
        self.core.rounding_stream(name)
    }

    /// Re-initialises rows `rows` of table `name`: weights uniform in the table's init bound
    /// (`±1/sqrt(rows)`) drawn from `key` and each row, optimizer state zero. Managed
    /// collisions reset the rows whose slot changed hands this way.
    pub fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EmbeddingError> {
        self.core.reset_rows(name, rows, key, None)
    }

    /// [`Self::reset_rows`] for a table that is a shard `block` of a larger table of
    /// `table_rows` rows: each row gets its columns of the larger table's row, so a sharded
    /// table resets to the values the unsharded one would.
    pub fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), EmbeddingError> {
        self.core.reset_rows(name, rows, key, Some((block, table_rows)))
    }

    /// Sets the optimizer steps of table `name` (and of the tables packed with it), e.g. when
    /// moving a trained table into another collection: Adam's bias correction reads it.
    pub fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), EmbeddingError> {
        self.core.set_step_count(name, steps)
    }

    /// Sets the factor on every table's optimizer `lr` for the next updates (a learning-rate
    /// schedule's multiplier; 1 trains at the configured rates).
    pub fn set_lr_multiplier(&mut self, multiplier: f64) {
        self.core.set_lr_multiplier(multiplier);
    }

    /// The table configurations, in construction order.
    pub fn table_configs(&self) -> impl ExactSizeIterator<Item = &EmbeddingBagConfig> {
        self.core.tables.iter().map(|t| &t.config)
    }

    /// The optimizer of table `name` (its own or the collection's).
    pub fn table_optimizer(&self, name: &str) -> Option<&SparseOptimizerConfig> {
        self.core.table_index(name).map(|t| &self.core.tables[t].optimizer)
    }

    /// Number of table-batched groups the tables were packed into.
    pub fn num_groups(&self) -> usize {
        self.core.groups.len()
    }

    /// The collection's default fused sparse optimizer.
    pub fn optimizer(&self) -> &SparseOptimizerConfig {
        &self.core.optimizer
    }

    /// Pooled lookups: `[batch, sum(dims)]`, one block of columns per output.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor, EmbeddingError> {
        let mut out = vec![0f32; kjt.stride() * self.width];
        self.forward_into(kjt, &mut out)?;
        KeyedTensor::new(self.output_keys(), self.output_dims(), out, kjt.stride())
            .map_err(|e| EmbeddingError::Shape(e.to_string()))
    }

    /// Loads the rows `kjt` reads into the caches of cached tables (see
    /// [`crate::CacheConfig`]) and pins them until this batch's
    /// [`Self::backward_and_update`], so its forward and update never read the backing file.
    /// A pipeline prefetches batch i+1 before batch i's update. A batch updated without a
    /// prefetch pins its rows for the update alone. No-op without cached tables.
    pub fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.core.check_ids(kjt, &keys)?;
        self.core.prefetch(kjt, &keys)
    }

    /// Unpins the prefetched batches that will not be trained (the data ended, or an
    /// evaluation prefetched them).
    pub fn discard_prefetched(&mut self) {
        self.core.discard_prefetched()
    }

    /// Batches prefetched and not updated yet.
    pub fn prefetched(&self) -> usize {
        self.core.prefetched()
    }

    /// Cache counters of table `name`; `None` unless it is cached.
    pub fn cache_stats(&self, name: &str) -> Option<crate::CacheStats> {
        self.core.caches[self.core.table_index(name)?].as_ref().map(|c| c.stats)
    }

    /// Rows of cached table `name` with a record in its backing store (every row for a
    /// [`crate::CacheBacking::Rows`] store, the rows written so far for a
    /// [`crate::CacheBacking::KeyValue`] one); `None` unless it is cached.
    pub fn stored_rows(&self, name: &str) -> Option<u64> {
        self.core.caches[self.core.table_index(name)?].as_ref().map(|c| c.stored_rows())
    }

    /// Table `name`'s initial weights as a function of a row range (fp32, all columns): the
    /// values its rows start from, and a cached table's never-written rows read as.
    pub fn initial_rows(
        &self,
        name: &str,
    ) -> Option<impl Fn(std::ops::Range<u64>) -> Vec<f32> + Send + Sync + 'static + use<>> {
        Some(self.core.initial_fn(self.core.table_index(name)?))
    }

    /// The collection's tables and outputs.
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// Output floats per example (`sum(dims)`).
    pub fn width(&self) -> usize {
        self.width
    }

    /// [`Self::forward`] into a caller's buffer of `batch * width` floats (row-major
    /// `[batch, sum(dims)]`), e.g. the memory of a tensor the dense model reads, saving the
    /// output's allocation and a copy. Every element is written; the buffer's contents do
    /// not matter.
    pub fn forward_into(&self, kjt: &KeyedJaggedTensor, out: &mut [f32]) -> Result<(), EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.core.check_ids(kjt, &keys)?;
        let batch = kjt.stride();
        let width = self.width;
        if out.len() != batch * width {
            return Err(EmbeddingError::Shape(format!(
                "output buffer has {} floats, expected batch {batch} x width {width}",
                out.len()
            )));
        }
        let chunk = (batch / (rayon::current_num_threads() * 8)).clamp(16, 512);
        let core = &self.core;
        let lookups = if core.has_cache() { core.lookups(kjt, &keys) } else { Vec::new() };
        let job = |c: usize, rows: &mut [f32]| {
            let b0 = c * chunk;
            for (oi, (o, &k)) in core.outputs.iter().zip(&keys).enumerate() {
                let t = &core.tables[o.table];
                let f = kjt.feature(k);
                let lookup = lookups.get(oi).and_then(Option::as_ref);
                let values = match lookup {
                    Some(Lookup::Slots(v) | Lookup::Staged { values: v, .. }) => v.as_slice(),
                    None => f.values,
                };
                let p = PoolArgs {
                    values,
                    weights: f.weights,
                    b0,
                    n: rows.len() / width.max(1),
                    width,
                    col: o.column,
                    mean: t.config.pooling == PoolingMode::Mean,
                };
                match lookup {
                    Some(Lookup::Staged { rows: staged, n, .. }) => {
                        crate::tbe::pool_over(staged, *n, o.dim, |b| f.bag_start(b), &p, rows)
                    }
                    _ => dispatch!(&core.groups[t.group], g => g.pool(t.local, |b| f.bag_start(b), &p, rows)),
                }
            }
        };
        let step = (chunk * width).max(1);
        if rayon::current_num_threads() == 1 {
            out.chunks_mut(step).enumerate().for_each(|(c, rows)| job(c, rows));
        } else {
            out.par_chunks_mut(step).enumerate().for_each(|(c, rows)| job(c, rows));
        }
        Ok(())
    }

    fn check_grad(&self, kjt: &KeyedJaggedTensor, grad_output: &[f32]) -> Result<(), EmbeddingError> {
        let batch = kjt.stride();
        if grad_output.len() != batch * self.width {
            return Err(EmbeddingError::Shape(format!(
                "gradient has {} floats, expected batch {batch} x width {}",
                grad_output.len(),
                self.width
            )));
        }
        Ok(())
    }

    /// Backward fused with the optimizer: per-id gradients from `grad_output`
    /// (`[batch, sum(dims)]`), summed over duplicate ids of a table (across bags and features),
    /// then one optimizer update per unique row.
    pub fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad_output: &[f32]) -> Result<(), EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.core.check_ids(kjt, &keys)?;
        self.check_grad(kjt, grad_output)?;
        let width = self.width;
        let columns: Vec<usize> = self.core.outputs.iter().map(|o| o.column).collect();
        let means: Vec<bool> =
            self.core.outputs.iter().map(|o| self.core.tables[o.table].config.pooling == PoolingMode::Mean).collect();
        self.core.backward(kjt, &keys, true, grad_output, |o, b, _| b * width + columns[o], |o| means[o])
    }

    /// Gradient of the loss with respect to each per-id weight of `kjt` (the input of a
    /// weighted feature, e.g. a position-weighted one): `<grad_output[bag], row(id)>`, times
    /// 1/L for mean pooling. One vector per output, aligned with that feature's values.
    /// Call it before [`Self::backward_and_update`], which changes the rows.
    pub fn per_id_weight_grads(
        &self,
        kjt: &KeyedJaggedTensor,
        grad_output: &[f32],
    ) -> Result<Vec<Vec<f32>>, EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.check_grad(kjt, grad_output)?;
        let width = self.width;
        let core = &self.core;
        let lookups = if core.has_cache() { core.lookups(kjt, &keys) } else { Vec::new() };
        Ok(core
            .outputs
            .par_iter()
            .zip(&keys)
            .enumerate()
            .map(|(oi, (o, &k))| {
                let t = &core.tables[o.table];
                let f = kjt.feature(k);
                let mut ids_rows = vec![0f32; f.values.len() * o.dim];
                match lookups.get(oi).and_then(Option::as_ref) {
                    None => dispatch!(&core.groups[t.group], g => g.gather(t.local, f.values, &mut ids_rows)),
                    Some(Lookup::Slots(slots)) => {
                        dispatch!(&core.groups[t.group], g => g.gather(t.local, slots, &mut ids_rows))
                    }
                    Some(Lookup::Staged { values, rows, .. }) => {
                        for (dst, &i) in ids_rows.chunks_exact_mut(o.dim).zip(values) {
                            dst.copy_from_slice(&rows[i as usize * o.dim..][..o.dim]);
                        }
                    }
                }
                let mut out = vec![0f32; f.values.len()];
                for b in 0..f.num_bags() {
                    let (s, e) = (f.bag_start(b), f.bag_start(b + 1));
                    let pool = if t.config.pooling == PoolingMode::Mean && e > s { 1.0 / (e - s) as f32 } else { 1.0 };
                    let g = &grad_output[b * width + o.column..][..o.dim];
                    for pos in s..e {
                        let row = &ids_rows[pos * o.dim..][..o.dim];
                        out[pos] = pool * row.iter().zip(g).map(|(a, b)| a * b).sum::<f32>();
                    }
                }
                out
            })
            .collect())
    }
}
