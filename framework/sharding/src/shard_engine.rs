//! The engine that computes one rank's shards: [`ShardEngine`].
//!
//! A `ShardedEbc` does the sharding (input dist, output dist, the collectives) and
//! hands each rank's lookups and fused updates to a [`ShardEngine`] holding that rank's shards,
//! with host buffers in and out. The CPU collection ([`EmbeddingBagCollection`]) is the one
//! every sharded collection starts with; `ShardedEbc::move_shards` moves them into
//! another engine built from it (trainrec's CUDA collection, `trainrec_cuda::CudaEbc`), so the
//! same sharding code serves every device.

use trainrec_embedding::{CacheStats, EmbeddingBagCollection, RowBlock};
use trainrec_sparse::KeyedJaggedTensor;

use crate::module;
use trainrec_comm::DistError;

/// One rank's tables (its shards, or its data-parallel replicas) and the kernels over them.
/// Every method takes and returns host memory; names are the local tables' (shards are named
/// by the sharded collection).
pub trait ShardEngine: Send + Sync {
    /// Output keys in order (one per feature of each table).
    fn output_keys(&self) -> Vec<String>;
    /// Floats per example of the pooled output.
    fn width(&self) -> usize;
    /// Pooled lookups of `kjt` into `out`, `[batch, width]` row-major.
    fn forward_into(&self, kjt: &KeyedJaggedTensor, out: &mut [f32]) -> Result<(), DistError>;
    /// The backward fused with the optimizer, from the `[batch, width]` gradient of
    /// [`Self::forward_into`]'s output.
    fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32]) -> Result<(), DistError>;
    /// Loads the rows `kjt` reads into cached tables' caches and pins them until its update.
    fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), DistError>;
    /// Unpins every prefetched batch that was not trained.
    fn discard_prefetched(&mut self);
    /// Cache counters of a cached table (`None`: not cached, or no such table).
    fn cache_stats(&self, name: &str) -> Option<CacheStats>;
    /// The tables' names, in order.
    fn table_names(&self) -> Vec<String>;
    /// Table `name`'s weights, `[rows, dim]` fp32.
    fn table_weights(&self, name: &str) -> Option<Vec<f32>>;
    /// Table `name`'s optimizer state.
    fn optimizer_state(&self, name: &str) -> Option<Vec<f32>>;
    /// Optimizer steps applied to table `name`.
    fn step_count(&self, name: &str) -> Option<u64>;
    /// Replaces table `name`'s weights.
    fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), DistError>;
    /// Replaces table `name`'s optimizer state.
    fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), DistError>;
    /// Sets table `name`'s optimizer steps.
    fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), DistError>;
    /// Re-initialises rows of table `name` ([`EmbeddingBagCollection::reset_rows`]).
    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), DistError>;
    /// Re-initialises rows of a shard `block` of a table of `table_rows` rows
    /// ([`EmbeddingBagCollection::reset_block_rows`]).
    fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), DistError>;
    /// The CPU collection, when this engine is one.
    fn as_cpu(&self) -> Option<&EmbeddingBagCollection> {
        None
    }
}

impl ShardEngine for EmbeddingBagCollection {
    fn output_keys(&self) -> Vec<String> {
        EmbeddingBagCollection::output_keys(self)
    }
    fn width(&self) -> usize {
        EmbeddingBagCollection::width(self)
    }
    fn forward_into(&self, kjt: &KeyedJaggedTensor, out: &mut [f32]) -> Result<(), DistError> {
        EmbeddingBagCollection::forward_into(self, kjt, out).map_err(module)
    }
    fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32]) -> Result<(), DistError> {
        EmbeddingBagCollection::backward_and_update(self, kjt, grad).map_err(module)
    }
    fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), DistError> {
        EmbeddingBagCollection::prefetch(self, kjt).map_err(module)
    }
    fn discard_prefetched(&mut self) {
        EmbeddingBagCollection::discard_prefetched(self);
    }
    fn cache_stats(&self, name: &str) -> Option<CacheStats> {
        EmbeddingBagCollection::cache_stats(self, name)
    }
    fn table_names(&self) -> Vec<String> {
        self.table_configs().map(|t| t.name.clone()).collect()
    }
    fn table_weights(&self, name: &str) -> Option<Vec<f32>> {
        EmbeddingBagCollection::table_weights(self, name)
    }
    fn optimizer_state(&self, name: &str) -> Option<Vec<f32>> {
        EmbeddingBagCollection::optimizer_state(self, name)
    }
    fn step_count(&self, name: &str) -> Option<u64> {
        EmbeddingBagCollection::step_count(self, name)
    }
    fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), DistError> {
        EmbeddingBagCollection::set_table_weights(self, name, weights).map_err(module)
    }
    fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), DistError> {
        EmbeddingBagCollection::set_optimizer_state(self, name, state).map_err(module)
    }
    fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), DistError> {
        EmbeddingBagCollection::set_step_count(self, name, steps).map_err(module)
    }
    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), DistError> {
        EmbeddingBagCollection::reset_rows(self, name, rows, key).map_err(module)
    }
    fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), DistError> {
        EmbeddingBagCollection::reset_block_rows(self, name, rows, key, block, table_rows).map_err(module)
    }
    fn as_cpu(&self) -> Option<&EmbeddingBagCollection> {
        Some(self)
    }
}

impl LocalTables for Box<dyn ShardEngine> {
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
        self.set_table_weights(name, w)
    }
    fn set_state(&mut self, name: &str, s: Vec<f32>) -> Result<(), DistError> {
        self.set_optimizer_state(name, s)
    }
    fn set_steps(&mut self, name: &str, n: u64) -> Result<(), DistError> {
        self.set_step_count(name, n)
    }
}

/// The state of a local collection's tables, by local table name.
pub(crate) trait LocalTables {
    fn weights(&self, name: &str) -> Option<Vec<f32>>;
    fn state(&self, name: &str) -> Option<Vec<f32>>;
    fn steps(&self, name: &str) -> Option<u64>;
    fn set_weights(&mut self, name: &str, w: Vec<f32>) -> Result<(), DistError>;
    fn set_state(&mut self, name: &str, s: Vec<f32>) -> Result<(), DistError>;
    fn set_steps(&mut self, name: &str, n: u64) -> Result<(), DistError>;
}

macro_rules! local_tables {
    ($t:ty) => {
        impl LocalTables for $t {
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
    };
}
local_tables!(EmbeddingBagCollection);
local_tables!(trainrec_embedding::EmbeddingCollection);
