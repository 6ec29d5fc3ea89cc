use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use trainrec_sparse::{KeyedJaggedTensor, KeyedTensor};

use crate::{EmbeddingBagConfig, EmbeddingError, PoolingMode, SparseOptimizerConfig, WeightDecayMode};

/// One table's weights and optimizer state.
struct Table {
    config: EmbeddingBagConfig,
    weights: Vec<f32>,
    /// Row-wise optimizer state (`rows * state_per_row` floats).
    state: Vec<f32>,
    /// Reused backward scratch: one entry per (id occurrence): (row, sample, output column, scale).
    scratch: Vec<(u64, u32, u32, f32)>,
    grad: Vec<f32>,
}

/// One pooled output: a feature looked up in a table.
#[derive(Clone, Debug)]
struct Output {
    name: String,
    input: String,
    table: usize,
    dim: usize,
    column: usize,
}

/// Unsharded pooled embedding lookups over several tables, with the sparse optimizer fused
/// into the backward (TorchRec's `EmbeddingBagCollection` with a fused optimizer).
pub struct EmbeddingBagCollection {
    tables: Vec<Table>,
    outputs: Vec<Output>,
    optimizer: SparseOptimizerConfig,
    width: usize,
}

/// Resolved positions of the outputs' features in one input.
fn resolve(outputs: &[Output], tables: &[Table], kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, EmbeddingError> {
    if kjt.variable_stride_per_key() {
        return Err(EmbeddingError::Shape("variable-batch (VBE) input needs the sharded embedding path".into()));
    }
    outputs
        .iter()
        .map(|o| {
            kjt.key_index(&o.input).ok_or_else(|| EmbeddingError::MissingFeature {
                feature: o.input.clone(),
                table: tables[o.table].config.name.clone(),
                available: kjt.keys().join(", "),
            })
        })
        .collect()
}

impl EmbeddingBagCollection {
    /// Builds the tables, initialised uniform in `±sqrt(1/rows)` (TorchRec's default),
    /// deterministically from `seed`.
    pub fn new(
        tables: Vec<EmbeddingBagConfig>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
    ) -> Result<Self, EmbeddingError> {
        optimizer.validate().map_err(EmbeddingError::Config)?;
        let mut names = HashSet::new();
        let mut feature_names = HashSet::new();
        let mut outputs = Vec::new();
        let mut column = 0;
        let mut built = Vec::with_capacity(tables.len());
        for (t, config) in tables.into_iter().enumerate() {
            if !names.insert(config.name.clone()) {
                return Err(EmbeddingError::Config(format!("duplicate table name \"{}\"", config.name)));
            }
            if config.rows == 0 || config.dim == 0 {
                return Err(EmbeddingError::Config(format!("table \"{}\" needs rows > 0 and dim > 0", config.name)));
            }
            if config.features.is_empty() {
                return Err(EmbeddingError::Config(format!("table \"{}\" has no features", config.name)));
            }
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
            let n = usize::try_from(config.rows).ok().and_then(|r| r.checked_mul(config.dim)).ok_or_else(|| {
                EmbeddingError::Config(format!(
                    "table \"{}\" ({} x {}) does not fit in memory",
                    config.name, config.rows, config.dim
                ))
            })?;
            let bound = (1.0 / config.rows as f64).sqrt() as f32;
            let mut rng = StdRng::seed_from_u64(seed ^ (0xE3B0_C442_98FC_1C14u64.wrapping_mul(t as u64 + 1)));
            let weights = (0..n).map(|_| rng.random_range(-bound..=bound)).collect();
            let state = vec![0.0; config.rows as usize * optimizer.state_per_row()];
            let grad = vec![0.0; config.dim];
            built.push(Table { config, weights, state, scratch: Vec::new(), grad });
        }
        Ok(Self { tables: built, outputs, optimizer, width: column })
    }

    /// Output names (one per feature, table order then feature order).
    pub fn output_keys(&self) -> Vec<String> {
        self.outputs.iter().map(|o| o.name.clone()).collect()
    }

    /// Output widths, in [`Self::output_keys`] order.
    pub fn output_dims(&self) -> Vec<usize> {
        self.outputs.iter().map(|o| o.dim).collect()
    }

    /// The weights of table `name`, `[rows, dim]` row-major.
    pub fn table_weights(&self, name: &str) -> Option<&[f32]> {
        self.tables.iter().find(|t| t.config.name == name).map(|t| t.weights.as_slice())
    }

    /// The row-wise optimizer state of table `name` (empty for SGD).
    pub fn optimizer_state(&self, name: &str) -> Option<&[f32]> {
        self.tables.iter().find(|t| t.config.name == name).map(|t| t.state.as_slice())
    }

    /// Replaces the weights of table `name`.
    pub fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), EmbeddingError> {
        let t = self
            .tables
            .iter_mut()
            .find(|t| t.config.name == name)
            .ok_or_else(|| EmbeddingError::Config(format!("no table \"{name}\"")))?;
        if weights.len() != t.weights.len() {
            return Err(EmbeddingError::Shape(format!(
                "table \"{name}\" holds {} floats, got {}",
                t.weights.len(),
                weights.len()
            )));
        }
        t.weights = weights;
        Ok(())
    }

    /// Replaces the row-wise optimizer state of table `name` (`rows * state_per_row` floats),
    /// e.g. when restoring a checkpoint.
    pub fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), EmbeddingError> {
        let t = self
            .tables
            .iter_mut()
            .find(|t| t.config.name == name)
            .ok_or_else(|| EmbeddingError::Config(format!("no table \"{name}\"")))?;
        if state.len() != t.state.len() {
            return Err(EmbeddingError::Shape(format!(
                "optimizer state of table \"{name}\" holds {} floats, got {}",
                t.state.len(),
                state.len()
            )));
        }
        t.state = state;
        Ok(())
    }

    /// The table configurations, in construction order.
    pub fn table_configs(&self) -> impl ExactSizeIterator<Item = &EmbeddingBagConfig> {
        self.tables.iter().map(|t| &t.config)
    }

    /// The fused sparse optimizer.
    pub fn optimizer(&self) -> &SparseOptimizerConfig {
        &self.optimizer
    }

    fn check_ids(&self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Result<(), EmbeddingError> {
        for (o, &k) in self.outputs.iter().zip(keys) {
            let rows = self.tables[o.table].config.rows;
            let f = kjt.feature(k);
            if let Some(pos) = f.values.iter().position(|&id| id < 0 || id as u64 >= rows) {
                let sample = f.lengths.iter().scan(0usize, |acc, &l| {
                    *acc += l as usize;
                    Some(*acc)
                });
                let sample = sample.take_while(|&end| end <= pos).count();
                return Err(EmbeddingError::IdOutOfRange {
                    table: self.tables[o.table].config.name.clone(),
                    feature: o.input.clone(),
                    sample,
                    id: f.values[pos],
                    rows,
                });
            }
        }
        Ok(())
    }

    /// Pooled lookups: `[batch, sum(dims)]`, one block of columns per output.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor, EmbeddingError> {
        let keys = resolve(&self.outputs, &self.tables, kjt)?;
        self.check_ids(kjt, &keys)?;
        let batch = kjt.stride();
        let width = self.width;
        let mut out = vec![0f32; batch * width];
        out.par_chunks_mut(width.max(1)).enumerate().for_each(|(b, row)| {
            for (o, &k) in self.outputs.iter().zip(&keys) {
                let table = &self.tables[o.table];
                let f = kjt.feature(k);
                let ids = f.bag(b);
                let weights = f.bag_weights(b);
                let dst = &mut row[o.column..o.column + o.dim];
                for (i, &id) in ids.iter().enumerate() {
                    let src = &table.weights[id as usize * o.dim..(id as usize + 1) * o.dim];
                    let w = weights.map_or(1.0, |w| w[i]);
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d += w * s;
                    }
                }
                if table.config.pooling == PoolingMode::Mean && !ids.is_empty() {
                    let inv = 1.0 / ids.len() as f32;
                    dst.iter_mut().for_each(|d| *d *= inv);
                }
            }
        });
        KeyedTensor::new(self.output_keys(), self.output_dims(), out, batch)
            .map_err(|e| EmbeddingError::Shape(e.to_string()))
    }

    /// Backward fused with the optimizer: per-id gradients from `grad_output`
    /// (`[batch, sum(dims)]`), summed over duplicate ids of a table (across bags and features),
    /// then one optimizer update per unique row.
    pub fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad_output: &[f32]) -> Result<(), EmbeddingError> {
        let keys = resolve(&self.outputs, &self.tables, kjt)?;
        self.check_ids(kjt, &keys)?;
        let batch = kjt.stride();
        if grad_output.len() != batch * self.width {
            return Err(EmbeddingError::Shape(format!(
                "gradient has {} floats, expected batch {batch} x width {}",
                grad_output.len(),
                self.width
            )));
        }
        for t in &mut self.tables {
            t.scratch.clear();
        }
        for (o, &k) in self.outputs.iter().zip(&keys) {
            let f = kjt.feature(k);
            let mean = self.tables[o.table].config.pooling == PoolingMode::Mean;
            let scratch = &mut self.tables[o.table].scratch;
            for b in 0..batch {
                let ids = f.bag(b);
                let weights = f.bag_weights(b);
                let pool = if mean && !ids.is_empty() { 1.0 / ids.len() as f32 } else { 1.0 };
                for (i, &id) in ids.iter().enumerate() {
                    scratch.push((id as u64, b as u32, o.column as u32, pool * weights.map_or(1.0, |w| w[i])));
                }
            }
        }
        let width = self.width;
        let optimizer = self.optimizer.clone();
        self.tables.par_iter_mut().for_each(|t| t.update(grad_output, width, &optimizer));
        Ok(())
    }
}

impl Table {
    /// Applies the optimizer once per unique row of the scratch list.
    fn update(&mut self, grad_output: &[f32], width: usize, optimizer: &SparseOptimizerConfig) {
        let dim = self.config.dim;
        // Sorting by (row, sample, column) makes the summation order, hence the result,
        // independent of thread scheduling.
        self.scratch.sort_unstable_by_key(|&(row, b, col, _)| (row, b, col));
        let mut i = 0;
        while i < self.scratch.len() {
            let row = self.scratch[i].0;
            self.grad.iter_mut().for_each(|g| *g = 0.0);
            while i < self.scratch.len() && self.scratch[i].0 == row {
                let (_, b, col, scale) = self.scratch[i];
                let src = &grad_output[b as usize * width + col as usize..][..dim];
                for (g, s) in self.grad.iter_mut().zip(src) {
                    *g += scale * s;
                }
                i += 1;
            }
            let w = &mut self.weights[row as usize * dim..(row as usize + 1) * dim];
            match *optimizer {
                SparseOptimizerConfig::Sgd { lr } => {
                    for (w, g) in w.iter_mut().zip(&self.grad) {
                        *w -= lr * g;
                    }
                }
                SparseOptimizerConfig::RowwiseAdagrad { lr, eps, weight_decay, weight_decay_mode } => {
                    // FBGEMM's exact_rowwise_adagrad (codegen/genscript/optimizers.py,
                    // `rowwise_adagrad`): the L2 term enters the accumulator through the
                    // gradient and the update through `correction`; decoupled decay only
                    // through `correction`. The weight step always uses the plain gradient.
                    let l2 = weight_decay_mode == WeightDecayMode::L2;
                    let mut sum_sq = 0.0f32;
                    for (&g, &w) in self.grad.iter().zip(w.iter()) {
                        let g = if l2 { g + weight_decay * w } else { g };
                        sum_sq += g * g;
                    }
                    let s = &mut self.state[row as usize];
                    *s += sum_sq / dim as f32;
                    let multiplier = lr / (s.sqrt() + eps);
                    let correction = match weight_decay_mode {
                        WeightDecayMode::None => 1.0,
                        WeightDecayMode::L2 => 1.0 - multiplier * weight_decay,
                        WeightDecayMode::Decoupled => 1.0 - lr * weight_decay,
                    };
                    for (w, g) in w.iter_mut().zip(&self.grad) {
                        *w = correction * *w - multiplier * g;
                    }
                }
            }
        }
    }
}
