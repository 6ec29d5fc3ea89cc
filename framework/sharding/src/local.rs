//! The calls a sharded collection makes into the engines of this rank's shards
//! ([`TableEngine`]s), with host buffers, and the state of a rank's local tables by name
//! ([`LocalTables`], for either kind of sharded collection).

use trainrec_comm::DistError;
use trainrec_embedding::{BatchContext, Pooled, PooledGrad, TableEngine};
use trainrec_sparse::KeyedJaggedTensor;

use crate::module;

/// Pooled lookups of a rank's local engine into a host buffer.
pub(crate) fn lookup(engine: &dyn TableEngine, kjt: &KeyedJaggedTensor, out: &mut [f32]) -> Result<(), DistError> {
    engine.forward_into(kjt, &mut BatchContext::default(), Pooled::Host(out)).map_err(module)
}

/// The fused backward of a rank's local engine from a host gradient.
pub(crate) fn update(engine: &mut dyn TableEngine, kjt: &KeyedJaggedTensor, grad: &[f32]) -> Result<(), DistError> {
    engine.backward_and_update(kjt, &mut BatchContext::default(), PooledGrad::Host(grad)).map_err(module)
}

/// Loads the rows `kjt` reads into a local engine's caches, pinned until its update.
pub(crate) fn prefetch(engine: &mut dyn TableEngine, kjt: &KeyedJaggedTensor) -> Result<(), DistError> {
    engine.stage(kjt, &[], true).map(drop).map_err(module)
}

/// The state of a local collection's tables, by local table name (either kind of collection).
pub(crate) trait LocalTables {
    fn weights(&self, name: &str) -> Option<Vec<f32>>;
    fn state(&self, name: &str) -> Option<Vec<f32>>;
    fn steps(&self, name: &str) -> Option<u64>;
    fn set_weights(&mut self, name: &str, w: Vec<f32>) -> Result<(), DistError>;
    fn set_state(&mut self, name: &str, s: Vec<f32>) -> Result<(), DistError>;
    fn set_steps(&mut self, name: &str, n: u64) -> Result<(), DistError>;
    /// The rows (table-local) a key-value table holds besides its initial ones, when it
    /// keeps only those.
    fn sparse(&self, _name: &str) -> Option<Vec<u64>> {
        None
    }
    /// Weights and optimizer state of rows (table-local).
    fn rows(&self, name: &str, _rows: &[u64]) -> Result<(Vec<f32>, Vec<f32>), DistError> {
        Err(DistError::Module(format!("table '{name}': this collection reads whole tables only")))
    }
    /// Sets a table from a sparse block (rows table-local), every other row initial.
    fn load_rows(&mut self, name: &str, _rows: &[u64], _w: &[f32], _s: &[f32]) -> Result<(), DistError> {
        Err(DistError::Module(format!("table '{name}': this collection loads whole tables only")))
    }
}

impl LocalTables for Box<dyn TableEngine> {
    fn weights(&self, name: &str) -> Option<Vec<f32>> {
        self.table_weights(name).ok().flatten()
    }
    fn state(&self, name: &str) -> Option<Vec<f32>> {
        self.optimizer_state(name)
    }
    fn steps(&self, name: &str) -> Option<u64> {
        self.step_count(name)
    }
    fn set_weights(&mut self, name: &str, w: Vec<f32>) -> Result<(), DistError> {
        self.set_table_weights(name, w).map_err(module)
    }
    fn set_state(&mut self, name: &str, s: Vec<f32>) -> Result<(), DistError> {
        self.set_optimizer_state(name, s).map_err(module)
    }
    fn set_steps(&mut self, name: &str, n: u64) -> Result<(), DistError> {
        self.set_step_count(name, n).map_err(module)
    }
    fn sparse(&self, name: &str) -> Option<Vec<u64>> {
        self.sparse_rows(name)
    }
    fn rows(&self, name: &str, rows: &[u64]) -> Result<(Vec<f32>, Vec<f32>), DistError> {
        self.rows_state(name, rows).map_err(module)
    }
    fn load_rows(&mut self, name: &str, rows: &[u64], w: &[f32], s: &[f32]) -> Result<(), DistError> {
        TableEngine::load_rows(self.as_mut(), name, rows, w, s).map_err(module)
    }
}

impl LocalTables for trainrec_embedding::EmbeddingCollection {
    fn weights(&self, name: &str) -> Option<Vec<f32>> {
        self.table_weights(name)
    }
    fn state(&self, name: &str) -> Option<Vec<f32>> {
        self.optimizer_state(name)
    }
    fn steps(&self, name: &str) -> Option<u64> {
        self.step_count(name)
    }
    fn set_weights(&mut self, name: &str, w: Vec<f32>) -> Result<(), DistError> {
        self.set_table_weights(name, w).map_err(module)
    }
    fn set_state(&mut self, name: &str, s: Vec<f32>) -> Result<(), DistError> {
        self.set_optimizer_state(name, s).map_err(module)
    }
    fn set_steps(&mut self, name: &str, n: u64) -> Result<(), DistError> {
        self.set_step_count(name, n).map_err(module)
    }
}
