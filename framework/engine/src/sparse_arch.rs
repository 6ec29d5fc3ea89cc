//! The job's embedding tables as one value whatever computes them: the pooled tables, an
//! engine that trains ([`EmbeddingEngine`]: the CPU collection, the sharded collection, the
//! CUDA collection) or lookups only ([`EmbeddingLookup`]: the quantized tables of an
//! evaluation); and the sequence tables, when the recipe has any ([`SequenceTables`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::Tensor;
use trainrec_comm::ProcessGroup;
use trainrec_embedding::{BatchContext, EmbeddingEngine, EmbeddingLookup, LocalShard};
use trainrec_sharding::{ShardedEbc, ShardingPlan};
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;
use crate::sequence_tables::{SequenceContext, SequenceTables, Sequences};

/// The job's pooled tables.
pub(crate) enum Pooled {
    /// Tables that train.
    Train(Box<dyn EmbeddingEngine>),
    /// Tables for lookups only (quantized for inference).
    Lookup(Box<dyn EmbeddingLookup>),
}

/// The job's embedding tables: pooled, and sequence tables when the recipe has any.
pub(crate) struct SparseArch {
    pub(crate) pooled: Pooled,
    sequences: Option<SequenceTables>,
    /// The model's pooled columns from the engine's and the position-weighted ones
    /// ([`crate::inputs::pooled_column_order`]).
    column_order: Option<Vec<i64>>,
}

impl SparseArch {
    /// Pooled tables that train, and the recipe's sequence tables.
    pub(crate) fn train(engine: Box<dyn EmbeddingEngine>, sequences: Option<SequenceTables>) -> Self {
        Self { pooled: Pooled::Train(engine), sequences, column_order: None }
    }

    /// The pooled tables' lookups.
    pub(crate) fn lookup(&self) -> &dyn EmbeddingLookup {
        match &self.pooled {
            Pooled::Train(e) => e.as_ref(),
            Pooled::Lookup(l) => l.as_ref(),
        }
    }

    /// Whether the pooled tables are for lookups only.
    pub(crate) fn lookup_only(&self) -> bool {
        matches!(self.pooled, Pooled::Lookup(_))
    }

    /// The engine, when the tables train.
    pub(crate) fn engine(&self) -> Option<&dyn EmbeddingEngine> {
        match &self.pooled {
            Pooled::Train(e) => Some(e.as_ref()),
            Pooled::Lookup(_) => None,
        }
    }

    /// The engine, for what only tables that train do.
    pub(crate) fn engine_mut(&mut self) -> Result<&mut dyn EmbeddingEngine, EngineError> {
        match &mut self.pooled {
            Pooled::Train(e) => Ok(e.as_mut()),
            Pooled::Lookup(_) => {
                Err(EngineError::Internal("quantized tables are for inference: they do not train or change".into()))
            }
        }
    }

    /// The sharded collection, when the tables are sharded.
    pub(crate) fn sharded(&self) -> Option<&ShardedEbc> {
        self.engine()?.as_any().downcast_ref()
    }

    /// The sharded collection, mutably, when the tables are sharded.
    pub(crate) fn sharded_mut(&mut self) -> Option<&mut ShardedEbc> {
        match &mut self.pooled {
            Pooled::Train(e) => e.as_any_mut().downcast_mut(),
            Pooled::Lookup(_) => None,
        }
    }

    /// The CUDA collection, when the tables are on this rank's GPU.
    pub(crate) fn gpu(&self) -> Option<&trainrec_cuda::CudaEbc> {
        self.engine()?.as_any().downcast_ref()
    }

    /// Pooled embeddings `[batch, width]` of `kjt` as a tensor in the engine's memory; `ctx`:
    /// the batch's context (staged ahead, or new), which the forward completes for the
    /// backward.
    pub(crate) fn forward(&self, kjt: &KeyedJaggedTensor, ctx: &mut BatchContext) -> Result<Tensor, EngineError> {
        Ok(crate::tensors::pooled_tensor(self.lookup(), kjt, ctx)?)
    }

    /// The fused backward and update from the pooled output's gradient.
    pub(crate) fn backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        ctx: &mut BatchContext,
        grad: &Tensor,
    ) -> Result<(), EngineError> {
        let engine = self.engine_mut()?;
        let memory = engine.memory();
        Ok(crate::tensors::with_grad_buffer(grad, memory, |g| engine.backward_and_update(kjt, ctx, g))?)
    }

    /// The batch's sequence features on `device` (gradients wanted when `train`), the catalogue
    /// rows a model asks for (in training), and what their backward needs; none without
    /// sequence tables. Collective when they are sharded.
    pub(crate) fn sequence_forward(
        &self,
        kjt: &KeyedJaggedTensor,
        device: tch::Device,
        train: bool,
        catalogue: Option<&trainrec_models::CatalogueRequest>,
    ) -> Result<(Sequences, Option<trainrec_models::Catalogue>, Option<SequenceContext>), EngineError> {
        match &self.sequences {
            Some(s) => {
                let (seqs, catalogue, ctx) = s.forward(&*kjt.full_batch()?, device, train, catalogue)?;
                Ok((seqs, catalogue, Some(ctx)))
            }
            None => Ok((Vec::new(), None, None)),
        }
    }

    /// What the model receives of a lookup: the pooled embeddings `pooled` joined with the
    /// position-weighted features pooled from `seqs`, and the model's sequence features (the
    /// lookup's, less the position-weighted ones).
    pub(crate) fn model_view(&self, pooled: &Tensor, seqs: &Sequences) -> Result<(Tensor, Sequences), EngineError> {
        let Some(s) = &self.sequences else { return Ok((pooled.shallow_clone(), Vec::new())) };
        let (model, weighted) = s.split_weighted(seqs)?;
        let pooled = match (weighted, &self.column_order) {
            (Some(w), Some(order)) => {
                let order = Tensor::from_slice(order).to_device(pooled.device());
                Tensor::cat(&[pooled, &w.to_kind(pooled.kind())], 1).index_select(1, &order)
            }
            _ => pooled.shallow_clone(),
        };
        Ok((pooled, model))
    }

    /// Creates the position weights of the recipe's position-weighted features in `vs`.
    pub(crate) fn attach_position_weights(&mut self, recipe: &trainrec_recipe::Recipe, vs: &tch::nn::Path) {
        if let Some(s) = &mut self.sequences {
            s.attach_position_weights(recipe, vs);
        }
        self.column_order = crate::inputs::pooled_column_order(recipe);
    }

    /// The sequence tables' fused backward and update from the gradients left on `seqs` (what
    /// [`SparseArch::sequence_forward`] gave for `kjt`).
    pub(crate) fn sequence_backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        seqs: &Sequences,
        ctx: Option<SequenceContext>,
    ) -> Result<(), EngineError> {
        match (&mut self.sequences, ctx) {
            (Some(s), Some(ctx)) => s.backward(&*kjt.full_batch()?, seqs, ctx),
            _ => Ok(()),
        }
    }

    /// Unpins batches prefetched into table caches that will not be trained.
    pub(crate) fn discard_prefetched(&mut self) {
        if let Pooled::Train(e) = &mut self.pooled {
            e.discard_prefetched();
        }
    }

    /// Cache counters of the cached tables this rank holds, by table (shard) name:
    /// `cache/<table>/{hit_rate,misses,evictions,loaded_mib}`, cumulative.
    pub(crate) fn cache_metric_values(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (table, s) in self.engine().map(|e| e.cache_stats()).unwrap_or_default() {
            out.insert(format!("cache/{table}/hit_rate"), s.hit_rate());
            out.insert(format!("cache/{table}/misses"), s.misses as f64);
            out.insert(format!("cache/{table}/evictions"), s.evictions as f64);
            out.insert(format!("cache/{table}/loaded_mib"), s.loaded_bytes as f64 / (1 << 20) as f64);
        }
        out
    }

    /// This rank's shards of every table (each whole table on one rank), the sequence tables'
    /// after the pooled ones'; none for lookup-only tables.
    pub(crate) fn local_shards(&self) -> Vec<LocalShard> {
        let mut out = self.engine().map(|e| e.local_shards()).unwrap_or_default();
        if let Some(s) = &self.sequences {
            out.extend(s.local_shards());
        }
        out
    }

    /// Restores shards in the layout [`SparseArch::local_shards`] gives.
    pub(crate) fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EngineError> {
        let (seq, pooled): (Vec<_>, Vec<_>) =
            shards.into_iter().partition(|s| self.sequences.as_ref().is_some_and(|q| q.has_table(&s.table)));
        if let Some(s) = &mut self.sequences {
            s.load_local_shards(seq)?;
        }
        Ok(self.engine_mut()?.load_local_shards(pooled)?)
    }

    /// Sets the learning-rate multiplier of every table (a schedule's).
    pub(crate) fn set_lr_multiplier(&mut self, multiplier: f64) -> Result<(), EngineError> {
        if let Some(s) = &mut self.sequences {
            s.set_lr_multiplier(multiplier);
        }
        self.engine_mut()?.set_lr_multiplier(multiplier);
        Ok(())
    }

    /// Re-initialises rows of table `name` (a managed-collision slot changed hands).
    pub(crate) fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EngineError> {
        Ok(self.engine_mut()?.reset_rows(name, rows, key)?)
    }

    /// The weights of table `name`, `[rows, dim]` row-major (collective when sharded).
    pub(crate) fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        if let Some(s) = self.sequences.as_ref().filter(|s| s.has_table(name)) {
            return s.table_weights(name);
        }
        Ok(self.lookup().table_weights(name)?)
    }
}

/// The sharded collection of a recipe's tables, placed as `plan` says.
pub(crate) fn sharded_ebc(
    recipe: &trainrec_recipe::Recipe,
    plan: &trainrec_planner::Plan,
    pg: Arc<dyn ProcessGroup>,
) -> Result<ShardedEbc, EngineError> {
    let tables = crate::inputs::planned_tables(recipe, plan);
    let shardings = ShardingPlan::from_plan(plan).shardings_for(&tables)?;
    let per_host = recipe.topology.local_world_size.unwrap_or(recipe.topology.world_size);
    Ok(ShardedEbc::new_on_hosts(tables, shardings, recipe.optimizer.sparse.clone(), recipe.run.seed, pg, per_host)?)
}
