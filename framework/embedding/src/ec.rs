use std::sync::atomic::Ordering;

use rayon::prelude::*;
use trainrec_sparse::KeyedJaggedTensor;

use crate::collection::{Core, dispatch};
use crate::{BoundsCheckMode, EmbeddingBagConfig, EmbeddingError, SparseOptimizerConfig};

/// Unpooled lookups: one embedding per id (TorchRec's `EmbeddingCollection`), for sequence
/// models. Tables may have different dims; the fused optimizer works as in
/// [`crate::EmbeddingBagCollection`]. The tables' `pooling` is ignored.
pub struct EmbeddingCollection {
    core: Core,
}

/// The output of [`EmbeddingCollection::forward`]: per feature, one `dim`-wide row per id,
/// in the order of the input's values, with the input's bag lengths.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceEmbeddings {
    /// Output names (one per feature).
    pub keys: Vec<String>,
    /// Embedding width of each output.
    pub dims: Vec<usize>,
    /// Per output: `ids * dim` floats, row-major.
    pub values: Vec<Vec<f32>>,
    /// Per output: bag lengths (the batch's jagged structure).
    pub lengths: Vec<Vec<u32>>,
}

impl EmbeddingCollection {
    /// Builds the tables (see [`crate::EmbeddingBagCollection::new`]).
    pub fn new(
        tables: Vec<EmbeddingBagConfig>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
    ) -> Result<Self, EmbeddingError> {
        Ok(Self { core: Core::new(tables, optimizer, seed, false)? })
    }

    /// Output names (one per feature of each table, table order), the order of
    /// [`SequenceEmbeddings::keys`].
    pub fn output_keys(&self) -> Vec<String> {
        self.core.outputs.iter().map(|o| o.name.clone()).collect()
    }

    /// The table configurations, in construction order.
    pub fn table_configs(&self) -> impl ExactSizeIterator<Item = &EmbeddingBagConfig> {
        self.core.tables.iter().map(|t| &t.config)
    }

    /// The collection's default fused sparse optimizer.
    pub fn optimizer(&self) -> &SparseOptimizerConfig {
        &self.core.optimizer
    }

    /// Optimizer steps applied so far to table `name`.
    pub fn step_count(&self, name: &str) -> Option<u64> {
        self.core.step_count(name)
    }

    /// Sets the optimizer steps of table `name` (and of the tables packed with it), e.g. when
    /// moving a trained table into another collection: Adam's bias correction reads it.
    pub fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), EmbeddingError> {
        self.core.set_step_count(name, steps)
    }

    /// Sets what lookups do with ids outside their table (default `fatal`).
    pub fn set_bounds_check(&mut self, mode: BoundsCheckMode) {
        self.core.bounds = mode;
    }

    /// Out-of-range ids seen so far under the `warning` bounds-check mode.
    pub fn bounds_violations(&self) -> u64 {
        self.core.bad_ids.load(Ordering::Relaxed)
    }

    /// The weights of table `name` as fp32, `[rows, dim]` row-major.
    pub fn table_weights(&self, name: &str) -> Option<Vec<f32>> {
        self.core.weights(name)
    }

    /// The optimizer state of table `name`.
    pub fn optimizer_state(&self, name: &str) -> Option<Vec<f32>> {
        self.core.state(name)
    }

    /// Replaces the weights of table `name`.
    pub fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), EmbeddingError> {
        self.core.set_weights(name, &weights)
    }

    /// Replaces the optimizer state of table `name`.
    pub fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), EmbeddingError> {
        self.core.set_state(name, &state)
    }

    /// Scales every table's learning rate by `multiplier` (a schedule's), as
    /// [`crate::EmbeddingBagCollection::set_lr_multiplier`] does.
    pub fn set_lr_multiplier(&mut self, multiplier: f64) {
        self.core.set_lr_multiplier(multiplier);
    }

    /// Every table whole with its optimizer state and optimizer steps, as checkpoint blocks.
    pub fn local_shards(&self) -> Vec<crate::LocalShard> {
        self.core
            .tables
            .iter()
            .map(|t| {
                let (name, rows, dim) = (&t.config.name, t.config.rows, t.config.dim);
                crate::LocalShard {
                    table: name.clone(),
                    table_shape: [rows as usize, dim],
                    rows: 0..rows,
                    cols: 0..dim,
                    replicated: false,
                    weights: self.core.weights(name).unwrap_or_default(),
                    optimizer_state: self.core.state(name).unwrap_or_default(),
                    step_count: self.core.step_count(name).unwrap_or(0),
                    stored: None,
                }
            })
            .collect()
    }

    /// Restores whole tables from blocks [`Self::local_shards`] gave.
    pub fn load_local_shards(&mut self, shards: Vec<crate::LocalShard>) -> Result<(), EmbeddingError> {
        for s in shards {
            let t = self.core.table_index(&s.table).map(|t| &self.core.tables[t].config);
            let shape = t.map(|c| [c.rows as usize, c.dim]);
            if shape != Some(s.table_shape) || s.rows != (0..s.table_shape[0] as u64) || s.cols != (0..s.table_shape[1])
            {
                return Err(EmbeddingError::Shape(format!(
                    "table \"{}\": a block of rows {:?} x columns {:?} of a {:?} table is not a whole table of this \
                     collection",
                    s.table, s.rows, s.cols, s.table_shape
                )));
            }
            self.core.set_weights(&s.table, &s.weights)?;
            if !s.optimizer_state.is_empty() {
                self.core.set_state(&s.table, &s.optimizer_state)?;
            }
            self.core.set_step_count(&s.table, s.step_count)?;
        }
        Ok(())
    }

    /// Per-id lookups.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<SequenceEmbeddings, EmbeddingError> {
        let mut out =
            SequenceEmbeddings { keys: Vec::new(), dims: Vec::new(), values: Vec::new(), lengths: Vec::new() };
        self.forward_into(kjt, &mut out)?;
        Ok(out)
    }

    /// Per-id lookups into `out`, reusing its buffers: a caller that looks up batch after batch
    /// (a benchmark, a serving loop) keeps one `out` and so writes into memory it already
    /// holds, instead of a fresh allocation whose pages the kernel must fault in on first
    /// write (at 10 MB per feature, that costs more than the gather itself).
    pub fn forward_into(&self, kjt: &KeyedJaggedTensor, out: &mut SequenceEmbeddings) -> Result<(), EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.core.check_ids(kjt, &keys)?;
        let core = &self.core;
        out.values.resize_with(core.outputs.len(), Vec::new);
        core.outputs.par_iter().zip(&keys).zip(out.values.par_iter_mut()).for_each(|((o, &k), v)| {
            let t = &core.tables[o.table];
            let f = kjt.feature(k);
            // Every value is overwritten by the gather: only a change of length writes zeros.
            v.resize(f.values.len() * o.dim, 0.0);
            dispatch!(&core.groups[t.group], g => g.gather(t.local, f.values, v));
        });
        out.keys = core.outputs.iter().map(|o| o.name.clone()).collect();
        out.dims = core.outputs.iter().map(|o| o.dim).collect();
        out.lengths = keys.iter().map(|&k| kjt.feature(k).lengths.to_vec()).collect();
        Ok(())
    }

    /// Backward fused with the optimizer: `grads[o]` is the gradient of output `o`, shaped
    /// like its forward values. Duplicate ids are summed, then one update per unique row.
    /// Per-id weights are ignored, as by the forward.
    pub fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grads: &[Vec<f32>]) -> Result<(), EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.core.check_ids(kjt, &keys)?;
        if grads.len() != self.core.outputs.len() {
            return Err(EmbeddingError::Shape(format!(
                "{} gradients for {} outputs",
                grads.len(),
                self.core.outputs.len()
            )));
        }
        let mut base = Vec::with_capacity(grads.len());
        let mut total = 0;
        for ((o, &k), g) in self.core.outputs.iter().zip(&keys).zip(grads) {
            let want = kjt.feature(k).values.len() * o.dim;
            if g.len() != want {
                return Err(EmbeddingError::Shape(format!(
                    "gradient of output \"{}\" has {} floats, expected {want}",
                    o.name,
                    g.len()
                )));
            }
            base.push(total);
            total += want;
        }
        let flat: Vec<f32> = grads.concat();
        let dims: Vec<usize> = self.core.outputs.iter().map(|o| o.dim).collect();
        self.core.backward(kjt, &keys, false, &flat, |o, _, pos| base[o] + pos * dims[o], |_| false)
    }
}
