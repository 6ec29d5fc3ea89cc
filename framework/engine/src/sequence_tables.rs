//! The job's sequence tables (`pooling = "none"`, TorchRec's `EmbeddingCollection`): whole
//! tables on one rank or sharded over the job's ranks, whose per-id lookups reach the dense
//! model as jagged embeddings ([`trainrec_models::JaggedEmbeddings`], leaves that receive their
//! gradient), and whose gradients come back to their fused optimizer update after the dense
//! backward.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use trainrec_comm::ProcessGroup;
use trainrec_embedding::{EmbeddingBagConfig, EmbeddingCollection, LocalShard, SequenceEmbeddings};
use trainrec_models::JaggedEmbeddings;
use trainrec_recipe::Recipe;
use trainrec_sharding::{EcContext, ShardedEc, ShardingPlan};
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;

/// A batch's sequence features as the model receives them: (output name, jagged embeddings).
pub(crate) type Sequences = Vec<(String, JaggedEmbeddings)>;

/// Initial weights of sequence tables come from the run's seed through this offset, so they
/// are not the pooled collection's first tables' values.
const SEED_OFFSET: u64 = 0x5E0_7AB1E5;

/// The collection: whole tables on one rank, or sharded over the job's ranks as the plan says
/// (TorchRec's `ShardedEmbeddingCollection`: ids to their shards, rows back per id).
enum Collection {
    Local(Box<EmbeddingCollection>),
    Sharded(Box<ShardedEc>),
}

/// The recipe's sequence tables.
pub(crate) struct SequenceTables {
    collection: Collection,
    names: Vec<String>,
}

/// What a sharded forward leaves for its backward.
pub(crate) struct SequenceContext(Option<EcContext>);

impl SequenceTables {
    /// The recipe's sequence tables (sharded over `pg` as `plan` places them), or `None` when
    /// it has none.
    pub(crate) fn of(
        recipe: &Recipe,
        plan: &trainrec_planner::Plan,
        pg: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<Option<Self>, EngineError> {
        let tables = sequence_tables(recipe);
        if tables.is_empty() {
            return Ok(None);
        }
        let names = tables.iter().map(|t| t.name.clone()).collect();
        let (seed, optimizer) = (recipe.run.seed ^ SEED_OFFSET, recipe.optimizer.sparse.clone());
        let collection = match pg {
            Some(pg) => {
                let shardings = ShardingPlan::from_plan(plan).shardings_for(&tables)?;
                Collection::Sharded(Box::new(ShardedEc::new(tables, shardings, optimizer, seed, pg)?))
            }
            None => {
                let mut ec = EmbeddingCollection::new(tables, optimizer, seed)?;
                ec.set_bounds_check(recipe.embedding.bounds_check);
                Collection::Local(Box::new(ec))
            }
        };
        Ok(Some(Self { collection, names }))
    }

    /// The batch's sequence features on `device`, with gradients wanted when `train`, and what
    /// the backward needs. Collective when sharded.
    pub(crate) fn forward(
        &self,
        kjt: &KeyedJaggedTensor,
        device: Device,
        train: bool,
    ) -> Result<(Sequences, SequenceContext), EngineError> {
        let (out, ctx) = match &self.collection {
            Collection::Local(ec) => (ec.forward(kjt)?, SequenceContext(None)),
            Collection::Sharded(ec) => {
                let (out, ctx) = ec.forward(kjt)?;
                (out, SequenceContext(Some(ctx)))
            }
        };
        Ok((jagged(out, device, train)?, ctx))
    }

    /// The fused backward and update from the gradients the dense backward left on `seqs`
    /// (a feature the model did not read gets none: zeros). Collective when sharded.
    pub(crate) fn backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        seqs: &Sequences,
        ctx: SequenceContext,
    ) -> Result<(), EngineError> {
        let grads = gradients(seqs)?;
        match (&mut self.collection, ctx.0) {
            (Collection::Local(ec), _) => Ok(ec.backward_and_update(kjt, &grads)?),
            (Collection::Sharded(ec), Some(ctx)) => ec.backward_and_update(ctx, &grads).map(drop).map_err(Into::into),
            (Collection::Sharded(_), None) => {
                Err(EngineError::Internal("a sharded sequence backward without its forward's context".into()))
            }
        }
    }

    /// Whether `table` is one of these tables.
    pub(crate) fn has_table(&self, table: &str) -> bool {
        self.names.iter().any(|n| n == table)
    }

    /// This rank's blocks of every table (whole tables on one rank), as checkpoint blocks.
    pub(crate) fn local_shards(&self) -> Vec<LocalShard> {
        match &self.collection {
            Collection::Local(ec) => ec.local_shards(),
            Collection::Sharded(ec) => ec.local_shards(),
        }
    }

    /// Restores blocks [`Self::local_shards`] gave.
    pub(crate) fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EngineError> {
        match &mut self.collection {
            Collection::Local(ec) => Ok(ec.load_local_shards(shards)?),
            Collection::Sharded(ec) => Ok(ec.load_local_shards(shards)?),
        }
    }

    /// The weights of table `name`, `[rows, dim]` row-major (collective when sharded).
    pub(crate) fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        match &self.collection {
            Collection::Local(ec) => Ok(ec.table_weights(name)),
            Collection::Sharded(ec) => Ok(Some(ec.table_weights(name)?)),
        }
    }

    /// Scales the tables' learning rates (a schedule's multiplier).
    pub(crate) fn set_lr_multiplier(&mut self, multiplier: f64) {
        match &mut self.collection {
            Collection::Local(ec) => ec.set_lr_multiplier(multiplier),
            Collection::Sharded(ec) => ec.set_lr_multiplier(multiplier),
        }
    }
}

/// A collection's output as jagged leaves on `device` (gradients wanted when `train`).
fn jagged(out: SequenceEmbeddings, device: Device, train: bool) -> Result<Sequences, EngineError> {
    let mut seqs = Vec::with_capacity(out.keys.len());
    for (((name, dim), values), lengths) in out.keys.into_iter().zip(out.dims).zip(out.values).zip(out.lengths) {
        let ids = values.len() / dim.max(1);
        let t = Tensor::from_slice(&values).view([ids as i64, dim as i64]).to_device(device);
        let t = if train { t.set_requires_grad(true) } else { t };
        let lengths = lengths.into_iter().map(|n| n as usize).collect();
        seqs.push((name, JaggedEmbeddings::new(t, lengths).map_err(trainrec_models::ModelError::from)?));
    }
    Ok(seqs)
}

/// The gradients the dense backward left on `seqs`, per feature (zeros where it left none).
fn gradients(seqs: &Sequences) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut grads = Vec::with_capacity(seqs.len());
    for (name, j) in seqs {
        let g = j.values.grad();
        grads.push(if g.defined() {
            let g = g.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]);
            Vec::<f32>::try_from(&g).map_err(|e| EngineError::Internal(format!("gradient of {name}: {e}")))?
        } else {
            vec![0.0; j.values.numel()]
        });
    }
    Ok(grads)
}

/// The recipe's sequence tables as embedding table configurations.
fn sequence_tables(recipe: &Recipe) -> Vec<EmbeddingBagConfig> {
    crate::inputs::table_configs(recipe.tables.iter().filter(|t| crate::inputs::is_sequence(t)))
}
