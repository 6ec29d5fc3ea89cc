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

    /// Per-id lookups.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<SequenceEmbeddings, EmbeddingError> {
        let keys = self.core.resolve(kjt)?;
        self.core.check_ids(kjt, &keys)?;
        let core = &self.core;
        let values = core
            .outputs
            .par_iter()
            .zip(&keys)
            .map(|(o, &k)| {
                let t = &core.tables[o.table];
                let f = kjt.feature(k);
                let mut out = vec![0f32; f.values.len() * o.dim];
                dispatch!(&core.groups[t.group], g => g.gather(t.local, f.values, &mut out));
                out
            })
            .collect();
        Ok(SequenceEmbeddings {
            keys: core.outputs.iter().map(|o| o.name.clone()).collect(),
            dims: core.outputs.iter().map(|o| o.dim).collect(),
            values,
            lengths: keys.iter().map(|&k| kjt.feature(k).lengths.to_vec()).collect(),
        })
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
