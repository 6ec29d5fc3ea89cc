//! [`CudaEbc`] as the engine of a rank's shards in a sharded collection
//! ([`trainrec_sharding::ShardEngine`]): [`trainrec_sharding::ShardedEbc::move_shards`] puts a rank's
//! shards and replicas on its GPU, and the sharding code and its collectives (NCCL on GPUs)
//! stay those of the CPU engines. The sharded collection hands over host buffers: each lookup's
//! output comes back to the host, each gradient goes up to the GPU.

use trainrec_comm::DistError;
use trainrec_embedding::{CacheStats, RowBlock};
use trainrec_sharding::ShardEngine;
use trainrec_sparse::KeyedJaggedTensor;

use crate::{CudaEbc, CudaError};

fn dist(e: CudaError) -> DistError {
    DistError::Module(e.to_string())
}

impl CudaEbc {
    fn out_len(&self, kjt: &KeyedJaggedTensor, len: usize, what: &str) -> Result<(), DistError> {
        let want = kjt.stride() * self.width();
        if len == want {
            return Ok(());
        }
        Err(DistError::Module(format!(
            "{what} has {len} floats, expected batch {} x width {}",
            kjt.stride(),
            self.width()
        )))
    }

    fn table_state(&self, name: &str) -> Result<(Vec<f32>, Vec<f32>, u64), DistError> {
        let w = CudaEbc::table_weights(self, name).map_err(dist)?;
        let s = CudaEbc::optimizer_state(self, name).map_err(dist)?;
        let n = CudaEbc::step_count(self, name).map_err(dist)?;
        Ok((w, s, n))
    }
}

impl ShardEngine for CudaEbc {
    fn output_keys(&self) -> Vec<String> {
        self.layout().outputs.iter().map(|o| o.name.clone()).collect()
    }

    fn width(&self) -> usize {
        CudaEbc::width(self)
    }

    fn forward_into(&self, kjt: &KeyedJaggedTensor, out: &mut [f32]) -> Result<(), DistError> {
        self.out_len(kjt, out.len(), "the output buffer")?;
        let pooled = self.forward(kjt).map_err(dist)?;
        out.copy_from_slice(&self.download(&pooled).map_err(dist)?);
        Ok(())
    }

    fn backward_and_update(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32]) -> Result<(), DistError> {
        self.out_len(kjt, grad.len(), "the gradient")?;
        if grad.is_empty() {
            return Ok(());
        }
        let g = self.upload(grad).map_err(dist)?;
        CudaEbc::backward_and_update(self, kjt, &g).map_err(dist)
    }

    fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), DistError> {
        CudaEbc::prefetch(self, kjt).map_err(dist)
    }

    fn discard_prefetched(&mut self) {
        CudaEbc::discard_prefetched(self);
    }

    fn cache_stats(&self, name: &str) -> Option<CacheStats> {
        CudaEbc::cache_stats(self, name)
    }

    fn table_names(&self) -> Vec<String> {
        self.layout().tables.iter().map(|t| t.name.clone()).collect()
    }

    fn table_weights(&self, name: &str) -> Option<Vec<f32>> {
        CudaEbc::table_weights(self, name).ok()
    }

    fn optimizer_state(&self, name: &str) -> Option<Vec<f32>> {
        CudaEbc::optimizer_state(self, name).ok()
    }

    fn step_count(&self, name: &str) -> Option<u64> {
        CudaEbc::step_count(self, name).ok()
    }

    fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), DistError> {
        let (_, state, steps) = self.table_state(name)?;
        self.load_table(name, &weights, &state, steps).map_err(dist)
    }

    fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), DistError> {
        let (weights, _, steps) = self.table_state(name)?;
        self.load_table(name, &weights, &state, steps).map_err(dist)
    }

    fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), DistError> {
        let (weights, state, _) = self.table_state(name)?;
        self.load_table(name, &weights, &state, steps).map_err(dist)
    }

    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), DistError> {
        CudaEbc::reset_rows(self, name, rows, key, None).map_err(dist)
    }

    fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), DistError> {
        CudaEbc::reset_rows(self, name, rows, key, Some((block, table_rows))).map_err(dist)
    }
}
