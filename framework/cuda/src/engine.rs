//! [`CudaEbc`] as an embedding engine ([`trainrec_embedding::EmbeddingEngine`]): a one-GPU
//! job's tables, and the engine of a rank's shards in a sharded collection (whose collectives
//! stay those of the CPU engines: it hands this engine host buffers, each lookup's output
//! coming back to the host and each gradient going up to the GPU).
//!
//! The buffers of a one-GPU job are libtorch tensors in the GPU's memory
//! ([`Pooled::Device`]); on the emulator, device memory is host memory.

use std::any::Any;

use trainrec_embedding::engine::{load_whole_tables, whole_table_shards};
use trainrec_embedding::{
    BatchContext, CacheStats, EmbeddingEngine, EmbeddingError, EmbeddingLookup, LocalShard, Memory, Pooled, PooledGrad,
    RowBlock, TableEngine,
};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{CudaEbc, CudaError, StagedBatch};

/// A CUDA error as an engine error (an embedding error it carried comes back as itself).
fn engine_error(e: CudaError) -> EmbeddingError {
    match e {
        CudaError::Embedding(inner) => inner,
        other => EmbeddingError::Backend(trainrec_embedding::BackendError::new(other)),
    }
}

impl CudaEbc {
    fn check_len(&self, batch: usize, len: usize, what: &str) -> Result<(), EmbeddingError> {
        if len == batch * self.width() {
            return Ok(());
        }
        Err(EmbeddingError::Shape(format!("{what} has {len} floats, expected batch {batch} x width {}", self.width())))
    }

    fn table_state(&self, name: &str) -> Result<(Vec<f32>, Vec<f32>, u64), EmbeddingError> {
        let w = CudaEbc::table_weights(self, name).map_err(engine_error)?;
        let s = CudaEbc::optimizer_state(self, name).map_err(engine_error)?;
        let n = CudaEbc::step_count(self, name).map_err(engine_error)?;
        Ok((w, s, n))
    }
}

impl EmbeddingLookup for CudaEbc {
    fn output_keys(&self) -> Vec<String> {
        self.layout().outputs.iter().map(|o| o.name.clone()).collect()
    }

    fn width(&self) -> usize {
        CudaEbc::width(self)
    }

    fn memory(&self) -> Memory {
        if self.on_gpu() { Memory::Cuda(self.info().device) } else { Memory::Emulated }
    }

    fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        ctx: &mut BatchContext,
        out: Pooled<'_>,
    ) -> Result<(), EmbeddingError> {
        let kjt = kjt.full_batch()?;
        self.check_len(kjt.stride(), out.len(), "the output buffer")?;
        // The batch's ids copied ahead by its stage are read there (and their slot freed
        // after the lookup); else they are copied now.
        let staged = ctx.take_state::<StagedBatch>();
        let addr = match out {
            Pooled::Device(d) => d.addr(),
            // Host memory: on the emulator, the kernels write it directly.
            Pooled::Host(out) if !self.on_gpu() => out.as_mut_ptr() as u64,
            Pooled::Host(out) => {
                let pooled = self.forward(&kjt).map_err(engine_error)?;
                out.copy_from_slice(&self.download(&pooled).map_err(engine_error)?);
                return Ok(());
            }
        };
        if kjt.stride() * self.width() == 0 {
            return Ok(());
        }
        // SAFETY: `addr` holds batch * width floats of this collection's memory (a checked
        // device buffer under `DeviceSlice`'s contract, or the caller's host buffer on the
        // emulator, whose kernels are done when the call returns).
        unsafe {
            match &staged {
                Some(s) => self.forward_staged_into_raw(&kjt, s, addr),
                None => self.forward_into_raw(&kjt, addr),
            }
        }
        .map_err(engine_error)
    }

    fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EmbeddingError> {
        if !self.layout().tables.iter().any(|t| t.name == name) {
            return Ok(None);
        }
        CudaEbc::table_weights(self, name).map(Some).map_err(engine_error)
    }
}

impl EmbeddingEngine for CudaEbc {
    fn stage(
        &mut self,
        kjt: &KeyedJaggedTensor,
        parts: &[&[u8]],
        prefetch: bool,
    ) -> Result<BatchContext, EmbeddingError> {
        let kjt = kjt.full_batch()?;
        let staged = {
            let _span = tracing::debug_span!("copy").entered();
            CudaEbc::stage(self, &kjt, parts).map_err(engine_error)?
        };
        if prefetch {
            let _span = tracing::debug_span!("prefetch").entered();
            CudaEbc::prefetch(self, &kjt).map_err(engine_error)?;
        }
        Ok(BatchContext::with_state(staged))
    }

    fn stages_ahead(&self) -> bool {
        true
    }

    fn backward_and_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        _ctx: &mut BatchContext,
        grad: PooledGrad<'_>,
    ) -> Result<(), EmbeddingError> {
        let kjt = kjt.full_batch()?;
        self.check_len(kjt.stride(), grad.len(), "the gradient")?;
        if grad.is_empty() {
            return Ok(());
        }
        let addr = match grad {
            PooledGrad::Device(d) => d.addr(),
            PooledGrad::Host(g) if !self.on_gpu() => g.as_ptr() as u64,
            PooledGrad::Host(g) => {
                let g = self.upload(g).map_err(engine_error)?;
                return CudaEbc::backward_and_update(self, &kjt, &g).map_err(engine_error);
            }
        };
        // SAFETY: `addr` holds batch * width floats of this collection's memory (a checked
        // device buffer under `DeviceSlice`'s contract, or the caller's host buffer on the
        // emulator), read in stream order before any later reuse.
        unsafe { self.backward_and_update_raw(&kjt, addr) }.map_err(engine_error)
    }

    fn discard_prefetched(&mut self) {
        CudaEbc::discard_prefetched(self);
    }

    fn set_lr_multiplier(&mut self, multiplier: f64) {
        CudaEbc::set_lr_multiplier(self, multiplier);
    }

    fn cache_placements(&self) -> Vec<(String, trainrec_embedding::CachePlacement)> {
        self.layout()
            .tables
            .iter()
            .filter_map(|t| Some((t.name.clone(), CudaEbc::cache_placement(self, &t.name)?)))
            .collect()
    }

    fn cache_stats(&self) -> Vec<(String, CacheStats)> {
        self.layout()
            .tables
            .iter()
            .filter_map(|t| Some((t.name.clone(), CudaEbc::cache_stats(self, &t.name)?)))
            .collect()
    }

    fn local_shards(&self) -> Vec<LocalShard> {
        whole_table_shards(self)
    }

    fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EmbeddingError> {
        load_whole_tables(self, shards)
    }

    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EmbeddingError> {
        CudaEbc::reset_rows(self, name, rows, key, None).map_err(engine_error)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl TableEngine for CudaEbc {
    fn table_names(&self) -> Vec<String> {
        self.layout().tables.iter().map(|t| t.name.clone()).collect()
    }

    fn table_shape(&self, name: &str) -> Option<[usize; 2]> {
        self.layout().tables.iter().find(|t| t.name == name).map(|t| [t.rows as usize, t.dim])
    }

    fn optimizer_state(&self, name: &str) -> Option<Vec<f32>> {
        CudaEbc::optimizer_state(self, name).ok()
    }

    fn step_count(&self, name: &str) -> Option<u64> {
        CudaEbc::step_count(self, name).ok()
    }

    fn set_table_weights(&mut self, name: &str, weights: Vec<f32>) -> Result<(), EmbeddingError> {
        let (_, state, steps) = self.table_state(name)?;
        self.load_table(name, &weights, &state, steps).map_err(engine_error)
    }

    fn set_optimizer_state(&mut self, name: &str, state: Vec<f32>) -> Result<(), EmbeddingError> {
        let (weights, _, steps) = self.table_state(name)?;
        self.load_table(name, &weights, &state, steps).map_err(engine_error)
    }

    fn set_step_count(&mut self, name: &str, steps: u64) -> Result<(), EmbeddingError> {
        let (weights, state, _) = self.table_state(name)?;
        self.load_table(name, &weights, &state, steps).map_err(engine_error)
    }

    fn reset_block_rows(
        &mut self,
        name: &str,
        rows: &[u64],
        key: u64,
        block: &RowBlock,
        table_rows: u64,
    ) -> Result<(), EmbeddingError> {
        CudaEbc::reset_rows(self, name, rows, key, Some((block, table_rows))).map_err(engine_error)
    }
}
