//! The job's sequence tables (`pooling = "none"`, TorchRec's `EmbeddingCollection`): whole
//! tables on one rank or sharded over the job's ranks, whose per-id lookups reach the dense
//! model as jagged embeddings ([`trainrec_models::JaggedEmbeddings`], leaves that receive their
//! gradient), and whose gradients come back to their fused optimizer update after the dense
//! backward.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use trainrec_comm::ProcessGroup;
use trainrec_embedding::{EmbeddingBagConfig, EmbeddingCollection, LocalShard, SequenceEmbeddings};
use trainrec_models::{Catalogue, CatalogueRequest, CatalogueRows, JaggedEmbeddings};
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
    /// (table, rows, features) of each table.
    tables: Vec<(String, u64, Vec<String>)>,
    /// Sampled catalogue rows come from this seed, the rank and the steps trained so far.
    seed: u64,
    rank: u64,
    /// Training steps so far (restored from the tables' optimizer steps on a load).
    steps: u64,
    /// The position-weighted outputs in the pooled outputs' order: (name, weights `[max_length]`,
    /// dense parameters of the job's model store), pooled here rather than handed to the model.
    weighted: Vec<(String, Tensor)>,
}

/// What a forward leaves for its backward: the sharded lookup's context, and the lookup with
/// the catalogue rows when a model asked for them.
pub(crate) struct SequenceContext {
    sharded: Option<EcContext>,
    catalogue: Option<CatalogueLookup>,
}

/// A training lookup that also read catalogue rows: the batch's ids with one more bag (the
/// catalogue's rows, on the catalogue feature; empty on the others), which output holds it,
/// and the leaf the model got for it.
struct CatalogueLookup {
    kjt: KeyedJaggedTensor,
    output: usize,
    rows: Tensor,
}

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
        let catalogue = tables.iter().map(|t| (t.name.clone(), t.rows, t.features.clone())).collect();
        let (seed, optimizer) = (recipe.run.seed ^ SEED_OFFSET, recipe.optimizer.sparse.clone());
        let rank = pg.as_ref().map_or(0, |pg| pg.rank() as u64);
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
        Ok(Some(Self { collection, tables: catalogue, seed, rank, steps: 0, weighted: Vec::new() }))
    }

    /// Creates the position weights of the recipe's position-weighted features in `vs` (at
    /// `position_weights.<feature>`, ones, trained by the dense optimizer).
    pub(crate) fn attach_position_weights(&mut self, recipe: &Recipe, vs: &tch::nn::Path) {
        let store = vs / "position_weights";
        for t in recipe.tables.iter() {
            let Some(pw) = &t.position_weighted else { continue };
            for f in &t.features {
                let w = store.var(f, &[pw.max_length as i64], tch::nn::Init::Const(1.0));
                self.weighted.push((f.clone(), w));
            }
        }
    }

    /// Splits a lookup's features: the model's sequence features (sharing the lookup's
    /// leaves), and the position-weighted features pooled, `[batch, sum(dims)]` in the pooled
    /// outputs' order (`None` without any): each id's row times its position's weight, summed
    /// per bag.
    pub(crate) fn split_weighted(&self, seqs: &Sequences) -> Result<(Sequences, Option<Tensor>), EngineError> {
        let model = seqs
            .iter()
            .filter(|(n, _)| !self.weighted.iter().any(|(w, _)| w == n))
            .map(|(n, j)| {
                let j = JaggedEmbeddings::new(j.values.shallow_clone(), j.lengths.clone())
                    .map_err(trainrec_models::ModelError::from)?;
                Ok((n.clone(), j))
            })
            .collect::<Result<Sequences, EngineError>>()?;
        if self.weighted.is_empty() {
            return Ok((model, None));
        }
        let mut pooled = Vec::with_capacity(self.weighted.len());
        for (name, w) in &self.weighted {
            let (_, j) = seqs
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| EngineError::Internal(format!("the lookup has no position-weighted feature {name}")))?;
            pooled.push(position_pooled(j, w));
        }
        Ok((model, Some(Tensor::cat(&pooled, 1))))
    }

    /// The batch's sequence features on `device`, with gradients wanted when `train`, the
    /// catalogue rows `catalogue` asks for (in training), and what the backward needs.
    /// Collective when sharded.
    pub(crate) fn forward(
        &self,
        kjt: &KeyedJaggedTensor,
        device: Device,
        train: bool,
        catalogue: Option<&CatalogueRequest>,
    ) -> Result<(Sequences, Option<Catalogue>, SequenceContext), EngineError> {
        let extended = match catalogue.filter(|_| train) {
            Some(request) => Some(self.with_catalogue(kjt, request)?),
            None => None,
        };
        let lookup = extended.as_ref().map_or(kjt, |(k, _, _)| k);
        let (mut out, sharded) = match &self.collection {
            Collection::Local(ec) => (ec.forward(lookup)?, None),
            Collection::Sharded(ec) => {
                let (out, ctx) = ec.forward(lookup)?;
                (out, Some(ctx))
            }
        };
        let Some((kjt, feature, ids)) = extended else {
            return Ok((jagged(out, device, train)?, None, SequenceContext { sharded, catalogue: None }));
        };
        // Every output's last bag is the extra one: the catalogue's rows on its feature.
        let output = out.keys.iter().position(|k| *k == feature).ok_or_else(|| {
            EngineError::Internal(format!("the sequence lookup has no output {feature} for the catalogue"))
        })?;
        let mut rows = Vec::new();
        for (i, (lengths, (values, dim))) in
            out.lengths.iter_mut().zip(out.values.iter_mut().zip(&out.dims)).enumerate()
        {
            let extra = lengths.pop().unwrap_or(0) as usize;
            let tail = values.split_off(values.len() - extra * dim);
            if i == output {
                rows = tail;
            }
        }
        let dim = out.dims[output] as i64;
        let leaf = Tensor::from_slice(&rows).view([ids.len() as i64, dim]).to_device(device).set_requires_grad(true);
        let ids = Tensor::from_slice(&ids).to_device(device);
        let seqs = jagged(out, device, train)?;
        let lookup = CatalogueLookup { kjt, output, rows: leaf.shallow_clone() };
        Ok((seqs, Some(Catalogue { ids, rows: leaf }), SequenceContext { sharded, catalogue: Some(lookup) }))
    }

    /// `kjt` with one more bag per feature: the rows `request` asks for on its feature's input,
    /// empty elsewhere; and the feature and the rows.
    fn with_catalogue(
        &self,
        kjt: &KeyedJaggedTensor,
        request: &CatalogueRequest,
    ) -> Result<(KeyedJaggedTensor, String, Vec<i64>), EngineError> {
        let Some((table, rows, _)) = self.tables.iter().find(|(_, _, f)| f.contains(&request.feature)) else {
            return Err(EngineError::Internal(format!(
                "the model asks for the catalogue of {}, which no sequence table reads",
                request.feature
            )));
        };
        let ids: Vec<i64> = match request.rows {
            CatalogueRows::All => (0..*rows as i64).collect(),
            CatalogueRows::Uniform(n) => {
                let key = self.seed ^ self.steps.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (self.rank << 48);
                (0..n as u64).map(|i| (splitmix(key ^ splitmix(i)) % rows) as i64).collect()
            }
        };
        tracing::trace!(table, rows = ids.len(), "catalogue lookup");
        let input = trainrec_types::FeatureRef::parse(&request.feature).input;
        let b = kjt.stride();
        let (keys, values, lengths) = (kjt.keys(), kjt.values(), kjt.lengths());
        let mut new_values = Vec::with_capacity(values.len() + ids.len());
        let mut new_lengths = Vec::with_capacity(lengths.len() + keys.len());
        let mut weights = kjt.weights().map(|w| (w, Vec::with_capacity(values.len() + ids.len())));
        let mut at = 0usize;
        for (k, key) in keys.iter().enumerate() {
            let bags = &lengths[k * b..(k + 1) * b];
            let n: usize = bags.iter().map(|&l| l as usize).sum();
            let extra = if key == input { ids.as_slice() } else { &[] };
            new_values.extend_from_slice(&values[at..at + n]);
            new_values.extend_from_slice(extra);
            new_lengths.extend_from_slice(bags);
            new_lengths.push(extra.len() as u32);
            if let Some((w, out)) = &mut weights {
                out.extend_from_slice(&w[at..at + n]);
                out.extend(std::iter::repeat_n(1.0, extra.len()));
            }
            at += n;
        }
        let weights = weights.map(|(_, out)| out);
        let extended = KeyedJaggedTensor::new(keys.to_vec(), new_values, weights, new_lengths, b + 1)
            .map_err(|e| EngineError::Data(e.into()))?;
        Ok((extended, request.feature.clone(), ids))
    }

    /// The fused backward and update from the gradients the dense backward left on `seqs`
    /// and on the catalogue rows (a feature the model did not read gets none: zeros).
    /// Collective when sharded.
    pub(crate) fn backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        seqs: &Sequences,
        ctx: SequenceContext,
    ) -> Result<(), EngineError> {
        let mut grads = seqs.iter().map(|(name, j)| gradient(&j.values, name)).collect::<Result<Vec<_>, _>>()?;
        let kjt = match &ctx.catalogue {
            Some(c) => {
                grads[c.output].extend(gradient(&c.rows, "the catalogue")?);
                &c.kjt
            }
            None => kjt,
        };
        self.steps += 1;
        match (&mut self.collection, ctx.sharded) {
            (Collection::Local(ec), _) => Ok(ec.backward_and_update(kjt, &grads)?),
            (Collection::Sharded(ec), Some(ctx)) => ec.backward_and_update(ctx, &grads).map(drop).map_err(Into::into),
            (Collection::Sharded(_), None) => {
                Err(EngineError::Internal("a sharded sequence backward without its forward's context".into()))
            }
        }
    }

    /// Whether `table` is one of these tables.
    pub(crate) fn has_table(&self, table: &str) -> bool {
        self.tables.iter().any(|(n, _, _)| n == table)
    }

    /// This rank's blocks of every table (whole tables on one rank), as checkpoint blocks.
    pub(crate) fn local_shards(&self) -> Vec<LocalShard> {
        match &self.collection {
            Collection::Local(ec) => ec.local_shards(),
            Collection::Sharded(ec) => ec.local_shards(),
        }
    }

    /// Restores blocks [`Self::local_shards`] gave (and the steps trained, from the tables'
    /// optimizer steps).
    pub(crate) fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), EngineError> {
        self.steps = shards.iter().map(|s| s.step_count).max().unwrap_or(0);
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

/// The gradient the dense backward left on leaf `t` (of `what`), row-major fp32; zeros where
/// it left none (the model did not read it).
fn gradient(t: &Tensor, what: &str) -> Result<Vec<f32>, EngineError> {
    let g = t.grad();
    if !g.defined() {
        return Ok(vec![0.0; t.numel()]);
    }
    let g = g.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]);
    Vec::<f32>::try_from(&g).map_err(|e| EngineError::Internal(format!("gradient of {what}: {e}")))
}

/// The recipe's sequence tables as embedding table configurations.
fn sequence_tables(recipe: &Recipe) -> Vec<EmbeddingBagConfig> {
    crate::inputs::table_configs(recipe.tables.iter().filter(|t| crate::inputs::in_collection(t)))
}

/// Each bag of `j` summed with its ids' rows weighted by their positions' weights `w`
/// (positions past the last weight use the last): `[batch, dim]`.
fn position_pooled(j: &JaggedEmbeddings, w: &Tensor) -> Tensor {
    let device = j.values.device();
    let last = w.size()[0].max(1) - 1;
    let (mut positions, mut bags) = (Vec::with_capacity(j.values.size()[0] as usize), Vec::new());
    for (b, &n) in j.lengths.iter().enumerate() {
        positions.extend((0..n as i64).map(|p| p.min(last)));
        bags.extend(std::iter::repeat_n(b as i64, n));
    }
    let weights = w.to_device(device).index_select(0, &Tensor::from_slice(&positions).to_device(device));
    let rows = &j.values * weights.unsqueeze(1).to_kind(j.values.kind());
    Tensor::zeros([j.batch_size() as i64, j.dim()], (rows.kind(), device)).index_add(
        0,
        &Tensor::from_slice(&bags).to_device(device),
        &rows,
    )
}

/// SplitMix64's finaliser: a well-mixed 64-bit value of `x`.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
