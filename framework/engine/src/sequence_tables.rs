//! The job's sequence tables (`pooling = "none"`, TorchRec's `EmbeddingCollection`): one
//! collection on this rank whose per-id lookups reach the dense model as jagged embeddings
//! ([`trainrec_models::JaggedEmbeddings`], leaves that receive their gradient), and whose
//! gradients come back to its fused optimizer update after the dense backward.

use tch::{Device, Kind, Tensor};
use trainrec_embedding::{EmbeddingBagConfig, EmbeddingCollection, LocalShard};
use trainrec_models::JaggedEmbeddings;
use trainrec_recipe::Recipe;
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;

/// A batch's sequence features as the model receives them: (output name, jagged embeddings).
pub(crate) type Sequences = Vec<(String, JaggedEmbeddings)>;

/// Initial weights of sequence tables come from the run's seed through this offset, so they
/// are not the pooled collection's first tables' values.
const SEED_OFFSET: u64 = 0x5E0_7AB1E5;

/// The recipe's sequence tables.
pub(crate) struct SequenceTables {
    ec: EmbeddingCollection,
}

impl SequenceTables {
    /// The recipe's sequence tables, or `None` when it has none.
    pub(crate) fn of(recipe: &Recipe) -> Result<Option<Self>, EngineError> {
        let tables = sequence_tables(recipe);
        if tables.is_empty() {
            return Ok(None);
        }
        let seed = recipe.run.seed ^ SEED_OFFSET;
        let mut ec = EmbeddingCollection::new(tables, recipe.optimizer.sparse.clone(), seed)?;
        ec.set_bounds_check(recipe.embedding.bounds_check);
        Ok(Some(Self { ec }))
    }

    /// The batch's sequence features on `device`, with gradients wanted when `train`.
    pub(crate) fn forward(
        &self,
        kjt: &KeyedJaggedTensor,
        device: Device,
        train: bool,
    ) -> Result<Sequences, EngineError> {
        let out = self.ec.forward(kjt)?;
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

    /// The fused backward and update from the gradients the dense backward left on `seqs`
    /// (a feature the model did not read gets none: zeros).
    pub(crate) fn backward(&mut self, kjt: &KeyedJaggedTensor, seqs: &Sequences) -> Result<(), EngineError> {
        let mut grads = Vec::with_capacity(seqs.len());
        for (name, j) in seqs {
            let g = j.values.grad();
            let n = j.values.numel();
            grads.push(if g.defined() {
                let g = g.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]);
                Vec::<f32>::try_from(&g).map_err(|e| EngineError::Internal(format!("gradient of {name}: {e}")))?
            } else {
                vec![0.0; n]
            });
        }
        Ok(self.ec.backward_and_update(kjt, &grads)?)
    }

    /// Whether `table` is one of these tables.
    pub(crate) fn has_table(&self, table: &str) -> bool {
        self.ec.table_configs().any(|c| c.name == table)
    }

    /// Every table whole, as checkpoint blocks.
    pub(crate) fn local_shards(&self) -> Vec<LocalShard> {
        self.ec.local_shards()
    }

    /// Restores whole tables.
    pub(crate) fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EngineError> {
        Ok(self.ec.load_local_shards(shards)?)
    }

    /// The weights of table `name`, `[rows, dim]` row-major.
    pub(crate) fn table_weights(&self, name: &str) -> Option<Vec<f32>> {
        self.ec.table_weights(name)
    }

    /// Scales the tables' learning rates (a schedule's multiplier).
    pub(crate) fn set_lr_multiplier(&mut self, multiplier: f64) {
        self.ec.set_lr_multiplier(multiplier);
    }
}

/// The recipe's sequence tables as embedding table configurations.
fn sequence_tables(recipe: &Recipe) -> Vec<EmbeddingBagConfig> {
    crate::inputs::table_configs(recipe.tables.iter().filter(|t| crate::inputs::is_sequence(t)))
}
