//! The sharded collection as an embedding engine ([`EmbeddingEngine`]), a composite over the
//! engines of this rank's shards ([`TableEngine`]s: the CPU collection every sharded
//! collection starts with, or another built from it by [`ShardedEbc::move_shards`], e.g.
//! trainrec's CUDA collection).
//!
//! A batch's context carries its input dist from [`EmbeddingEngine::stage`] (collective) to
//! its forward, and the forward's [`DistContext`] to its backward.

use std::any::Any;

use trainrec_comm::DistError;
use trainrec_embedding::{
    BackendError, BatchContext, CacheStats, EmbeddingEngine, EmbeddingError, EmbeddingLookup, LocalShard, Pooled,
    PooledGrad,
};
use trainrec_sparse::KeyedJaggedTensor;

use crate::ShardedEbc;
use crate::step::{DistContext, InputDist};

/// A collective's failure as an engine error (kept whole: the engine above tells a peer that
/// left from other failures).
fn engine_error(e: DistError) -> EmbeddingError {
    EmbeddingError::Backend(BackendError::new(e))
}

impl EmbeddingLookup for ShardedEbc {
    fn output_keys(&self) -> Vec<String> {
        // The unsharded collection's: each table's features, in order.
        self.tables.iter().flat_map(|t| t.features.iter().cloned()).collect()
    }

    fn width(&self) -> usize {
        ShardedEbc::width(self)
    }

    fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        ctx: &mut BatchContext,
        out: Pooled<'_>,
    ) -> Result<(), EmbeddingError> {
        let out = trainrec_embedding::engine::host_out(out, "the sharded collection")?;
        let (pooled, dist) = match ctx.take_state::<InputDist>() {
            Some(staged) => self.forward_dist(kjt, staged),
            None => self.forward(kjt),
        }
        .map_err(engine_error)?;
        if out.len() != pooled.len() {
            return Err(EmbeddingError::Shape(format!(
                "the output buffer has {} floats, expected batch {} x width {}",
                out.len(),
                kjt.examples(),
                self.width
            )));
        }
        out.copy_from_slice(&pooled);
        ctx.batch_sizes = Some(dist.batch_sizes().to_vec());
        ctx.set_state(dist);
        Ok(())
    }

    fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EmbeddingError> {
        if !self.tables.iter().any(|t| t.name == name) {
            return Ok(None);
        }
        ShardedEbc::table_weights(self, name).map(Some).map_err(engine_error)
    }
}

impl EmbeddingEngine for ShardedEbc {
    fn stage(
        &mut self,
        kjt: &KeyedJaggedTensor,
        _parts: &[&[u8]],
        prefetch: bool,
    ) -> Result<BatchContext, EmbeddingError> {
        let staged = {
            let _span = tracing::debug_span!("input_dist").entered();
            self.input_dist(kjt).map_err(engine_error)?
        };
        if prefetch {
            let _span = tracing::debug_span!("prefetch").entered();
            ShardedEbc::prefetch(self, &staged).map_err(engine_error)?;
        }
        Ok(BatchContext::with_state(staged))
    }

    fn stages_ahead(&self) -> bool {
        true
    }

    fn backward_and_update(
        &mut self,
        _kjt: &KeyedJaggedTensor,
        ctx: &mut BatchContext,
        grad: PooledGrad<'_>,
    ) -> Result<(), EmbeddingError> {
        let grad = trainrec_embedding::engine::host_grad(grad, "the sharded collection")?;
        let dist = ctx.take_state::<DistContext>().ok_or_else(|| {
            EmbeddingError::Shape("a sharded backward needs its batch's forward context (forward first)".into())
        })?;
        let times = ShardedEbc::backward_and_update(self, dist, grad).map_err(engine_error)?;
        tracing::trace!(?times, "sharded embedding step");
        ctx.times = Some(times);
        Ok(())
    }

    fn discard_prefetched(&mut self) {
        ShardedEbc::discard_prefetched(self);
    }

    fn set_lr_multiplier(&mut self, multiplier: f64) {
        for e in [&mut self.local, &mut self.dp].into_iter().flatten() {
            e.set_lr_multiplier(multiplier);
        }
    }

    fn cache_stats(&self) -> Vec<(String, CacheStats)> {
        [&self.local, &self.dp].into_iter().flatten().flat_map(|e| e.cache_stats()).collect()
    }

    fn cache_placements(&self) -> Vec<(String, trainrec_embedding::CachePlacement)> {
        [&self.local, &self.dp].into_iter().flatten().flat_map(|e| e.cache_placements()).collect()
    }

    fn local_shards(&self) -> Vec<LocalShard> {
        ShardedEbc::local_shards(self)
    }

    fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EmbeddingError> {
        ShardedEbc::load_local_shards(self, shards).map_err(engine_error)
    }

    fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EmbeddingError> {
        ShardedEbc::reset_rows(self, name, rows, key).map_err(engine_error)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
