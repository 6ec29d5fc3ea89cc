//! The contract every embedding engine keeps, whatever computes it: the CPU collection
//! ([`EmbeddingBagCollection`]), trainrec's CUDA collection (`trainrec_cuda::CudaEbc`), the
//! sharded collection (`trainrec_sharding::ShardedEbc`, itself a composite over one engine per
//! rank), and, for inference, the quantized tables ([`crate::quant::QuantizedEbc`]).
//!
//! - [`EmbeddingLookup`]: pooled lookups and the tables' values. What inference needs; the
//!   quantized tables implement only this, so "quantized tables do not train" is a type.
//! - [`EmbeddingEngine`]: a lookup that trains: a batch staged ahead of its step (the input
//!   dist of a sharded collection, the copy to a GPU, the rows into the caches), the backward
//!   fused with the optimizer, and its state as shards for checkpoints.
//! - [`TableEngine`]: an engine holding whole tables on this rank, by name, with their
//!   optimizer state: what a sharded collection needs of the engine computing a rank's shards.
//!
//! A batch's [`BatchContext`] carries what the engine keeps between the batch's stage, its
//! forward and its backward (TorchRec's sharded modules keep a context per batch the same
//! way). The conformance kit (module `conformance`) checks any engine against the CPU
//! collection.

use std::any::Any;
use std::ops::Range;

use trainrec_sparse::KeyedJaggedTensor;

use crate::{CacheBacking, CacheStats, EmbeddingBagCollection, EmbeddingError, RowBlock};

/// A cached table's layout: how many rows its cache holds, and what holds the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachePlacement {
    /// Cache slots (rows held in the engine's memory).
    pub slots: u32,
    /// The store behind the cache.
    pub backing: CacheBacking,
    /// Rows with a record in that store (every row for `Rows`; for `KeyValue` the rows written
    /// so far: a row that still reads as its initial weights has none).
    pub stored: u64,
}

/// Where an engine's lookups write their output and read their gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory: [`Pooled::Host`] and [`PooledGrad::Host`].
    Host,
    /// The memory of CUDA device `n`: [`Pooled::Device`] and [`PooledGrad::Device`].
    Cuda(usize),
    /// A device emulated in host memory (the CUDA emulator): device buffers at host addresses.
    Emulated,
}

/// Floats in an engine's device memory (see [`Memory`]), handed to it by address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSlice {
    addr: u64,
    len: usize,
}

impl DeviceSlice {
    /// `len` floats at `addr`.
    ///
    /// # Safety
    /// `addr` must point to `len` floats of the engine's memory (its device's, or host memory
    /// for [`Memory::Emulated`]) that nothing else reads or writes while the engine uses them,
    /// and that stay valid until the engine's stream has passed the work it enqueued on them
    /// (libtorch's default stream is the engine's).
    pub unsafe fn new(addr: u64, len: usize) -> Self {
        Self { addr, len }
    }

    /// The address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Floats at the address.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No floats.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The `[batch, width]` buffer a lookup writes, row-major.
#[derive(Debug)]
pub enum Pooled<'a> {
    /// Host memory.
    Host(&'a mut [f32]),
    /// The engine's device memory.
    Device(DeviceSlice),
}

impl Pooled<'_> {
    /// Floats in the buffer.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(s) => s.len(),
            Self::Device(d) => d.len(),
        }
    }

    /// No floats.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The `[batch, width]` gradient of a lookup's output, row-major.
#[derive(Debug)]
pub enum PooledGrad<'a> {
    /// Host memory.
    Host(&'a [f32]),
    /// The engine's device memory.
    Device(DeviceSlice),
}

impl PooledGrad<'_> {
    /// Floats in the buffer.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(s) => s.len(),
            Self::Device(d) => d.len(),
        }
    }

    /// No floats.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a step's time went on this rank (seconds) and the bytes this rank sent, per phase
/// (a sharded collection's; a one-rank engine has no dist phases).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// Input dist: bucketizing, the splits and the lengths / ids / weights all-to-alls, and
    /// assembling the local batch.
    pub input_dist: f64,
    /// Local pooled lookups (shards and data-parallel replicas).
    pub lookup: f64,
    /// Output dist: the pooled rows' all-to-all and placing them in the output.
    pub output_dist: f64,
    /// Backward dist: the output gradient's all-to-all to the shards (and the data-parallel
    /// all-gathers).
    pub grad_dist: f64,
    /// The fused optimizer updates.
    pub update: f64,
    /// Bytes sent by the input dist's all-to-alls (splits, lengths, ids, weights).
    pub input_bytes: usize,
    /// Bytes sent by the output dist's all-to-all.
    pub output_bytes: usize,
}

/// What one batch carries from its stage through its forward to its backward.
#[derive(Default)]
pub struct BatchContext {
    /// Every rank's examples in this batch, rank order, when the engine's forward gathered
    /// them (a sharded collection): the global batch is their sum.
    pub batch_sizes: Option<Vec<usize>>,
    /// The step's phase times, once its backward ran (a sharded collection's).
    pub times: Option<StepTimes>,
    /// The engine's own state of the batch (its input dist, its ids on a GPU, its forward's
    /// context for the backward); only that engine reads it.
    state: Option<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for BatchContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchContext")
            .field("batch_sizes", &self.batch_sizes)
            .field("times", &self.times)
            .field("state", &self.state.is_some())
            .finish()
    }
}

impl BatchContext {
    /// A context holding the engine's `state` of the batch.
    pub fn with_state<T: Any + Send>(state: T) -> Self {
        Self { state: Some(Box::new(state)), ..Self::default() }
    }

    /// Replaces the engine's state of the batch.
    pub fn set_state<T: Any + Send>(&mut self, state: T) {
        self.state = Some(Box::new(state));
    }

    /// The engine's state of the batch, when it is a `T`.
    pub fn state<T: Any>(&self) -> Option<&T> {
        self.state.as_ref()?.downcast_ref()
    }

    /// The engine's state of the batch, mutably, when it is a `T`.
    pub fn state_mut<T: Any>(&mut self) -> Option<&mut T> {
        self.state.as_mut()?.downcast_mut()
    }

    /// Takes the engine's state of the batch out when it is a `T` (else leaves it).
    pub fn take_state<T: Any>(&mut self) -> Option<T> {
        match self.state.take()?.downcast::<T>() {
            Ok(t) => Some(*t),
            Err(other) => {
                self.state = Some(other);
                None
            }
        }
    }

    /// Whether the engine keeps a state of the batch.
    pub fn has_state(&self) -> bool {
        self.state.is_some()
    }
}

/// A block of a table with its state: what a checkpoint holds of one rank's tables (as
/// TorchRec's state dict holds a `ShardedTensor`'s local shards). A whole table on one rank is
/// one block covering it; a data-parallel replica is one block covering the table on every
/// rank.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalShard {
    /// The table.
    pub table: String,
    /// The table's rows and columns.
    pub table_shape: [usize; 2],
    /// The shard's rows of the table.
    pub rows: Range<u64>,
    /// The shard's columns of the table.
    pub cols: Range<usize>,
    /// Whether every rank holds it (a data-parallel replica).
    pub replicated: bool,
    /// Its weights, `[rows, cols]` row-major, fp32.
    pub weights: Vec<f32>,
    /// Its fused optimizer's state, per row the parts of
    /// [`crate::SparseOptimizerConfig::state_layout`] over the shard's columns.
    pub optimizer_state: Vec<f32>,
    /// Optimizer steps applied to it.
    pub step_count: u64,
    /// `Some`: the block holds only these rows of `rows` (table rows, ascending; `weights`
    /// and `optimizer_state` have one row per entry), every other row its initial weights and
    /// zero optimizer state: a key-value table's rows written so far. `None`: every row.
    pub stored: Option<Vec<u64>>,
}

/// Pooled lookups over embedding tables: what inference needs of an engine.
pub trait EmbeddingLookup: Send + Sync {
    /// Output keys in order (one per feature of each table).
    fn output_keys(&self) -> Vec<String>;
    /// Floats per example of the pooled output.
    fn width(&self) -> usize;
    /// Where the lookups write and read their buffers.
    fn memory(&self) -> Memory {
        Memory::Host
    }
    /// Pooled lookups of `kjt` into `out`, `[batch, width]` row-major. A variable-batch
    /// (deduplicated) `kjt` is looked up as its full batch. `ctx`: the batch's context, from
    /// [`EmbeddingEngine::stage`] when the batch was staged ahead, else a new one; the forward
    /// leaves in it what the batch's backward needs. Collective for a sharded collection.
    fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        ctx: &mut BatchContext,
        out: Pooled<'_>,
    ) -> Result<(), EmbeddingError>;
    /// The values of table `name`, `[rows, dim]` fp32 row-major (as the lookups read them);
    /// `None`: no such table. Collective for a sharded collection.
    fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EmbeddingError>;
}

/// An embedding engine that trains: a lookup, its backward fused with the sparse optimizer,
/// and its state.
pub trait EmbeddingEngine: EmbeddingLookup {
    /// Stages `kjt` ahead of its step (the train pipeline runs this for the next batch on
    /// a second thread while the current batch's dense part runs): a sharded collection's input
    /// dist (collective), a GPU's copy of the ids and of `parts` (host buffers of the caller's,
    /// e.g. the batch's dense features and labels), and with `prefetch` the batch's rows into
    /// the caches of cached tables (pinned until its update). The context goes to the batch's
    /// [`EmbeddingLookup::forward_into`].
    fn stage(
        &mut self,
        kjt: &KeyedJaggedTensor,
        parts: &[&[u8]],
        prefetch: bool,
    ) -> Result<BatchContext, EmbeddingError>;
    /// Whether [`Self::stage`] does any work for a pipeline that does not `prefetch`.
    fn stages_ahead(&self) -> bool {
        false
    }
    /// The backward fused with the optimizer, from the gradient of the output of the batch's
    /// [`EmbeddingLookup::forward_into`] (`ctx`: that forward's context).
    fn backward_and_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        ctx: &mut BatchContext,
        grad: PooledGrad<'_>,
    ) -> Result<(), EmbeddingError>;
    /// Unpins every batch staged with `prefetch` that was not trained.
    fn discard_prefetched(&mut self);
    /// Sets the factor on every table's optimizer `lr` for the next updates (a learning-rate
    /// schedule's multiplier: the rate is `lr × multiplier` computed in f64, [`crate::scaled_lr`]).
    fn set_lr_multiplier(&mut self, multiplier: f64);
    /// Cache counters of every cached table this engine (this rank) holds, by table or shard
    /// name, cumulative.
    fn cache_stats(&self) -> Vec<(String, CacheStats)>;
    /// Where the cached tables this engine (this rank) holds keep their rows, by table or
    /// shard name: the cache's slots in front of a backing store. A table not listed has every
    /// row in the engine's memory (device memory for a GPU engine). What the plan's kernel
    /// asked for is checked against this.
    fn cache_placements(&self) -> Vec<(String, CachePlacement)>;
    /// This rank's blocks of every table with their state (each whole table one block).
    fn local_shards(&self) -> Vec<LocalShard>;
    /// Restores blocks in the layout [`Self::local_shards`] gives (e.g. from a checkpoint).
    fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EmbeddingError>;
    /// Re-initialises rows `rows` of table `name` with `key`, as
    /// [`EmbeddingBagCollection::reset_rows`] does (a managed-collision slot changed hands).
    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EmbeddingError>;
    /// The engine as [`Any`], for the owners of a backend's own operations (a sharded
    /// collection's owner-rank id remap).
    fn as_any(&self) -> &dyn Any;
    /// [`Self::as_any`], mutably.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// An engine holding whole tables on this rank, by name: the engine that computes a rank's
/// shards (each shard a table of its own) for a sharded collection.
pub trait TableEngine: EmbeddingEngine {
    /// The tables' names, in order.
    fn table_names(&self) -> Vec<String>;
    /// Table `name`'s rows and columns.
    fn table_shape(&self, name: &str) -> Option<[usize; 2]>;
    /// Table `name`'s optimizer state.
    fn optimizer_state(&self, name: &str) -> Option<Vec<f32>>;
    /// Optimizer steps applied to table `name`.
    fn step_count(&self, name: &str) -> Option<u64>;
    /// Replaces table `name`'s weights.
    fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), EmbeddingError>;
    /// Replaces table `name`'s optimizer state.
    fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), EmbeddingError>;
    /// Sets table `name`'s optimizer steps.
    fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), EmbeddingError>;
    /// The rows of table `name` that hold anything but their initial weights and zero
    /// optimizer state, ascending, when the table keeps only those (a key-value store);
    /// `None`: every row is held.
    fn sparse_rows(&self, _name: &str) -> Option<Vec<u64>> {
        None
    }
    /// The fp32 weights (`[rows, dim]`) and optimizer state of `rows` of table `name` (a
    /// table [`Self::sparse_rows`] lists rows of).
    fn rows_state(&self, name: &str, _rows: &[u64]) -> Result<(Vec<f32>, Vec<f32>), EmbeddingError> {
        Err(EmbeddingError::Config(format!("table \"{name}\": this engine reads whole tables only")))
    }
    /// Sets table `name` from a sparse block: `rows` get `weights` and `state`, every other
    /// row its initial weights and zero state.
    fn load_rows(&mut self, name: &str, _rows: &[u64], _weights: &[f32], _state: &[f32]) -> Result<(), EmbeddingError> {
        Err(EmbeddingError::Config(format!("table \"{name}\": this engine loads whole tables only")))
    }
    /// Re-initialises rows of a shard `block` of a table of `table_rows` rows
    /// ([`EmbeddingBagCollection::reset_block_rows`]).
    fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), EmbeddingError>;
    /// The CPU collection, when this engine is one (other engines are built from it).
    fn as_cpu(&self) -> Option<&EmbeddingBagCollection> {
        None
    }
}

/// Every table of `engine` as one whole-table block ([`EmbeddingEngine::local_shards`] of an
/// engine holding whole tables).
pub fn whole_table_shards(engine: &dyn TableEngine) -> Vec<LocalShard> {
    engine
        .table_names()
        .into_iter()
        .filter_map(|name| {
            let [rows, dim] = engine.table_shape(&name)?;
            let (weights, optimizer_state, stored) = match engine.sparse_rows(&name) {
                Some(stored) => {
                    let (w, s) = engine.rows_state(&name, &stored).ok()?;
                    (w, s, Some(stored))
                }
                None => (
                    engine.table_weights(&name).ok().flatten().unwrap_or_default(),
                    engine.optimizer_state(&name).unwrap_or_default(),
                    None,
                ),
            };
            Some(LocalShard {
                weights,
                optimizer_state,
                stored,
                step_count: engine.step_count(&name).unwrap_or(0),
                table_shape: [rows, dim],
                rows: 0..rows as u64,
                cols: 0..dim,
                replicated: false,
                table: name,
            })
        })
        .collect()
}

/// Restores whole-table blocks into `engine` ([`EmbeddingEngine::load_local_shards`] of an
/// engine holding whole tables): weights, the optimizer state when the block has one, steps.
pub fn load_whole_tables(engine: &mut dyn TableEngine, shards: Vec<LocalShard>) -> Result<(), EmbeddingError> {
    for s in shards {
        let shape = engine.table_shape(&s.table);
        if shape != Some(s.table_shape) || s.rows != (0..s.table_shape[0] as u64) || s.cols != (0..s.table_shape[1]) {
            return Err(EmbeddingError::Shape(format!(
                "table \"{}\": a block of rows {:?} x columns {:?} of a {:?} table does not fit this engine's table ({})",
                s.table,
                s.rows,
                s.cols,
                s.table_shape,
                shape.map_or_else(|| "none of that name".to_string(), |[r, d]| format!("{r} x {d}"))
            )));
        }
        match &s.stored {
            Some(rows) => engine.load_rows(&s.table, rows, &s.weights, &s.optimizer_state)?,
            None => {
                engine.set_table_weights(&s.table, s.weights)?;
                if !s.optimizer_state.is_empty() {
                    engine.set_optimizer_state(&s.table, s.optimizer_state)?;
                }
            }
        }
        engine.set_step_count(&s.table, s.step_count)?;
    }
    Ok(())
}

/// The host buffer of a host engine's lookup (a device buffer is the caller's error).
pub fn host_out<'a>(out: Pooled<'a>, engine: &str) -> Result<&'a mut [f32], EmbeddingError> {
    match out {
        Pooled::Host(s) => Ok(s),
        Pooled::Device(_) => {
            Err(EmbeddingError::Shape(format!("{engine} computes in host memory: it was handed a device buffer")))
        }
    }
}

/// The host gradient of a host engine's backward (a device buffer is the caller's error).
pub fn host_grad<'a>(grad: PooledGrad<'a>, engine: &str) -> Result<&'a [f32], EmbeddingError> {
    match grad {
        PooledGrad::Host(s) => Ok(s),
        PooledGrad::Device(_) => {
            Err(EmbeddingError::Shape(format!("{engine} computes in host memory: it was handed a device gradient")))
        }
    }
}

impl EmbeddingLookup for EmbeddingBagCollection {
    fn output_keys(&self) -> Vec<String> {
        EmbeddingBagCollection::output_keys(self)
    }
    fn width(&self) -> usize {
        EmbeddingBagCollection::width(self)
    }
    fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        _ctx: &mut BatchContext,
        out: Pooled<'_>,
    ) -> Result<(), EmbeddingError> {
        let kjt = full_batch(kjt)?;
        EmbeddingBagCollection::forward_into(self, &kjt, host_out(out, "the CPU collection")?)
    }
    fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EmbeddingError> {
        Ok(EmbeddingBagCollection::table_weights(self, name))
    }
}

impl EmbeddingEngine for EmbeddingBagCollection {
    fn stage(
        &mut self,
        kjt: &KeyedJaggedTensor,
        _parts: &[&[u8]],
        prefetch: bool,
    ) -> Result<BatchContext, EmbeddingError> {
        if prefetch {
            EmbeddingBagCollection::prefetch(self, &*full_batch(kjt)?)?;
        }
        Ok(BatchContext::default())
    }
    fn backward_and_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        _ctx: &mut BatchContext,
        grad: PooledGrad<'_>,
    ) -> Result<(), EmbeddingError> {
        let kjt = full_batch(kjt)?;
        EmbeddingBagCollection::backward_and_update(self, &kjt, host_grad(grad, "the CPU collection")?)
    }
    fn discard_prefetched(&mut self) {
        EmbeddingBagCollection::discard_prefetched(self);
    }
    fn set_lr_multiplier(&mut self, multiplier: f64) {
        EmbeddingBagCollection::set_lr_multiplier(self, multiplier);
    }
    fn cache_stats(&self) -> Vec<(String, CacheStats)> {
        self.table_configs()
            .filter_map(|t| Some((t.name.clone(), EmbeddingBagCollection::cache_stats(self, &t.name)?)))
            .collect()
    }
    fn cache_placements(&self) -> Vec<(String, CachePlacement)> {
        let core = self.core();
        core.tables
            .iter()
            .zip(&core.caches)
            .filter_map(|(t, c)| {
                let c = c.as_ref()?;
                Some((
                    t.config.name.clone(),
                    CachePlacement { slots: c.slots(), backing: c.backing(), stored: c.stored_rows() },
                ))
            })
            .collect()
    }
    fn local_shards(&self) -> Vec<LocalShard> {
        whole_table_shards(self)
    }
    fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EmbeddingError> {
        load_whole_tables(self, shards)
    }
    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EmbeddingError> {
        EmbeddingBagCollection::reset_rows(self, name, rows, key)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl TableEngine for EmbeddingBagCollection {
    fn table_names(&self) -> Vec<String> {
        self.table_configs().map(|t| t.name.clone()).collect()
    }
    fn table_shape(&self, name: &str) -> Option<[usize; 2]> {
        self.table_configs().find(|t| t.name == name).map(|t| [t.rows as usize, t.dim])
    }
    fn optimizer_state(&self, name: &str) -> Option<Vec<f32>> {
        EmbeddingBagCollection::optimizer_state(self, name)
    }
    fn step_count(&self, name: &str) -> Option<u64> {
        EmbeddingBagCollection::step_count(self, name)
    }
    fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), EmbeddingError> {
        EmbeddingBagCollection::set_table_weights(self, name, weights)
    }
    fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), EmbeddingError> {
        EmbeddingBagCollection::set_optimizer_state(self, name, state)
    }
    fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), EmbeddingError> {
        EmbeddingBagCollection::set_step_count(self, name, steps)
    }
    fn sparse_rows(&self, name: &str) -> Option<Vec<u64>> {
        EmbeddingBagCollection::sparse_rows(self, name)
    }
    fn rows_state(&self, name: &str, rows: &[u64]) -> Result<(Vec<f32>, Vec<f32>), EmbeddingError> {
        EmbeddingBagCollection::rows_state(self, name, rows)
    }
    fn load_rows(&mut self, name: &str, rows: &[u64], weights: &[f32], state: &[f32]) -> Result<(), EmbeddingError> {
        EmbeddingBagCollection::load_rows(self, name, rows, weights, state)
    }
    fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), EmbeddingError> {
        EmbeddingBagCollection::reset_block_rows(self, name, rows, key, block, table_rows)
    }
    fn as_cpu(&self) -> Option<&EmbeddingBagCollection> {
        Some(self)
    }
}

impl EmbeddingLookup for crate::quant::QuantizedEbc {
    fn output_keys(&self) -> Vec<String> {
        crate::quant::QuantizedEbc::output_keys(self)
    }
    fn width(&self) -> usize {
        crate::quant::QuantizedEbc::width(self)
    }
    fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        _ctx: &mut BatchContext,
        out: Pooled<'_>,
    ) -> Result<(), EmbeddingError> {
        let kjt = full_batch(kjt)?;
        crate::quant::QuantizedEbc::forward_into(self, &kjt, host_out(out, "the quantized tables")?)
    }
    fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EmbeddingError> {
        Ok(self.dequantized(name))
    }
}

/// A variable-batch KJT expanded to its full batch (others as they are).
pub fn full_batch(kjt: &KeyedJaggedTensor) -> Result<std::borrow::Cow<'_, KeyedJaggedTensor>, EmbeddingError> {
    Ok(kjt.full_batch()?)
}
