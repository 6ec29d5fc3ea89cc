//! Training across ranks: the job's embeddings sharded by the plan over a process group, the
//! dense model data-parallel (parameters broadcast from rank 0 at start, gradients summed
//! across ranks every step), and the collectives that keep the ranks in step (stopping
//! together when one rank's data ends, evaluating over every rank's predictions).
//!
//! Gradients are those of the loss over the **global** batch (every rank's examples): each
//! rank scales its loss by its share of the global batch before the backward, so after the
//! sum across ranks the dense gradients and the embeddings' fused updates equal what one rank
//! would compute on the concatenated batch, and a recipe's learning rates mean the same at
//! any `world_size`. (TorchRec averages dense gradients but sums the embedding gradients of
//! each rank's local mean loss, which scales the embeddings' gradient by the world size.)

use std::sync::Arc;
use std::time::Duration;

use tch::{Tensor, nn};
use trainrec_data::FeatureSchema;
use trainrec_dist::{DistContext, ProcessGroup, ProcessGroupExt, ReduceOp, ShardedEbc, ShardingPlan, ThreadGroup};
use trainrec_embedding::EmbeddingBagCollection;
use trainrec_recipe::LoadedRecipe;
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;
use crate::job::{Job, RunSummary};
use crate::registry::Registry;

/// How long a rank waits for the others in one collective before failing (thread backend).
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// The job's embedding bag collection: whole on one rank, or sharded over a group.
pub(crate) enum SparseArch {
    /// Every table on this (only) rank.
    Local(EmbeddingBagCollection),
    /// Tables sharded over the ranks by the plan.
    Sharded(Box<ShardedEbc>),
}

/// `kjt` with one bag per example: a variable-batch (VBE) KJT expanded by its
/// `inverse_indices`, any other borrowed as is.
pub(crate) fn full_batch(kjt: &KeyedJaggedTensor) -> Result<std::borrow::Cow<'_, KeyedJaggedTensor>, EngineError> {
    if kjt.variable_stride_per_key() {
        Ok(std::borrow::Cow::Owned(kjt.expand_vbe().map_err(|e| EngineError::Data(e.into()))?))
    } else {
        Ok(std::borrow::Cow::Borrowed(kjt))
    }
}

/// Examples in `kjt`'s batch (a VBE KJT's `inverse_indices` length).
pub(crate) fn examples(kjt: &KeyedJaggedTensor) -> usize {
    match kjt.inverse_indices() {
        Some(inv) if kjt.variable_stride_per_key() => inv.indices.first().map_or(0, Vec::len),
        _ => kjt.stride(),
    }
}

impl SparseArch {
    /// Pooled embeddings `[batch, width]` of `kjt` as a tensor, and the sharded forward's
    /// context (collective when sharded).
    pub(crate) fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<(Tensor, Option<DistContext>), EngineError> {
        match self {
            // One rank: a deduplicated batch is looked up expanded.
            Self::Local(ebc) => {
                let kjt = full_batch(kjt)?;
                Ok((crate::tensors::pooled_tensor(ebc, &kjt)?, None))
            }
            Self::Sharded(s) => {
                let (out, ctx) = s.forward(kjt)?;
                let t = Tensor::from_slice(&out).f_view([examples(kjt) as i64, s.width() as i64])?;
                Ok((t, Some(ctx)))
            }
        }
    }

    /// The fused backward and update from the pooled output's gradient.
    pub(crate) fn backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        ctx: Option<DistContext>,
        grad: &Tensor,
    ) -> Result<(), EngineError> {
        match (self, ctx) {
            (Self::Local(ebc), _) => {
                let kjt = full_batch(kjt)?;
                crate::tensors::with_f32_slice(grad, |g| ebc.backward_and_update(&kjt, g))?;
            }
            (Self::Sharded(s), Some(ctx)) => {
                let times = crate::tensors::with_f32_slice(grad, |g| s.backward_and_update(ctx, g))?;
                tracing::trace!(?times, "sharded embedding step");
            }
            (Self::Sharded(_), None) => {
                return Err(EngineError::Internal("sharded backward without its forward's context".into()));
            }
        }
        Ok(())
    }

    /// The weights of table `name`, `[rows, dim]` row-major (collective when sharded).
    pub(crate) fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        match self {
            Self::Local(ebc) => Ok(ebc.table_weights(name)),
            Self::Sharded(s) => Ok(Some(s.table_weights(name)?)),
        }
    }
}

/// The sharded collection of a recipe's tables, placed as `plan` says.
pub(crate) fn sharded_ebc(
    recipe: &trainrec_recipe::Recipe,
    plan: &trainrec_planner::Plan,
    pg: Arc<dyn ProcessGroup>,
) -> Result<ShardedEbc, EngineError> {
    let tables = crate::job::recipe_tables(recipe);
    let shardings = ShardingPlan::from_plan(plan).shardings_for(&tables)?;
    Ok(ShardedEbc::new(tables, shardings, recipe.optimizer.sparse.clone(), recipe.run.seed, pg)?)
}

/// The data-parallel half of a job across ranks: its group and the dense parameters in one
/// order on every rank.
pub(crate) struct DenseSync {
    pub(crate) pg: Arc<dyn ProcessGroup>,
    params: Vec<Tensor>,
}

impl DenseSync {
    /// The trainable variables of `vs` by name, and rank 0's values copied to every rank.
    pub(crate) fn new(pg: Arc<dyn ProcessGroup>, vs: &nn::VarStore) -> Result<Self, EngineError> {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let params: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
        let sync = Self { pg, params };
        sync.broadcast()?;
        Ok(sync)
    }

    /// Rank 0's parameter values on every rank (DDP's start).
    fn broadcast(&self) -> Result<(), EngineError> {
        let mut flat: Vec<f32> = Vec::new();
        for p in &self.params {
            crate::tensors::with_f32_slice(p, |s| flat.extend_from_slice(s));
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut flat);
        self.pg.broadcast_bytes(bytes, 0)?;
        self.write_back(&flat, |p, t| {
            p.shallow_clone().copy_(t);
        })
    }

    /// Sums every parameter's gradient and `loss` across ranks (one all-reduce); the
    /// gradients are replaced by the sums and the summed loss is returned.
    pub(crate) fn all_reduce(&self, loss: f64) -> Result<f64, EngineError> {
        let mut flat: Vec<f32> = Vec::new();
        for p in &self.params {
            let g = p.grad();
            if g.defined() {
                crate::tensors::with_f32_slice(&g, |s| flat.extend_from_slice(s));
            } else {
                flat.extend(std::iter::repeat_n(0.0, p.numel()));
            }
        }
        flat.push(loss as f32);
        self.pg.all_reduce_f32(&mut flat, ReduceOp::Sum)?;
        let total = flat.pop().unwrap_or(0.0) as f64;
        // A gradient undefined here is undefined on every rank (one model, one graph shape:
        // the parameter is not used), so its sum is zero and it stays undefined.
        self.write_back(&flat, |p, t| {
            let mut g = p.grad();
            if g.defined() {
                g.copy_(t);
            }
        })?;
        Ok(total)
    }

    fn write_back(&self, flat: &[f32], mut put: impl FnMut(&Tensor, &Tensor)) -> Result<(), EngineError> {
        let mut at = 0;
        tch::no_grad(|| -> Result<(), EngineError> {
            for p in &self.params {
                let n = p.numel();
                let t = Tensor::from_slice(&flat[at..at + n]).f_view(p.size().as_slice())?.to_kind(p.kind());
                put(p, &t);
                at += n;
            }
            Ok(())
        })
    }

    /// Whether every rank has a next batch (the ranks stop together when one runs out).
    pub(crate) fn all_have(&self, have: bool) -> Result<bool, EngineError> {
        Ok(self.pg.all_gather_u64(have as u64)?.iter().all(|&h| h == 1))
    }

    /// Whether some rank has a next batch (evaluation goes on until every rank is done).
    pub(crate) fn any_has(&self, has: bool) -> Result<bool, EngineError> {
        Ok(self.pg.all_gather_u64(has as u64)?.contains(&1))
    }

    /// Every rank's `values` concatenated in rank order.
    pub(crate) fn gather<T: bytemuck::Pod>(&self, values: &[T]) -> Result<Vec<T>, EngineError> {
        Ok(self.pg.all_gather_sized(values)?)
    }
}

/// Sums `counts` across ranks (recall hits).
pub(crate) fn sum_counts(pg: &dyn ProcessGroup, counts: &mut [u64]) -> Result<(), EngineError> {
    let mut f: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
    pg.all_reduce_f64(&mut f, ReduceOp::Sum)?;
    for (c, v) in counts.iter_mut().zip(f) {
        *c = v.round() as u64;
    }
    Ok(())
}

/// Trains the recipe on `topology.world_size` ranks of the in-process thread backend (one
/// thread per rank, each with its share of the data); returns rank 0's summary. The first
/// rank error that is not a consequence of another rank's failure is returned.
pub fn run_threads(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
) -> Result<RunSummary, EngineError> {
    let world = loaded.recipe.topology.world_size;
    let threads = crate::configure_threads(loaded.recipe.run.threads);
    let per_rank = (threads / world).max(1) as i32;
    let results = ThreadGroup::run(world, COLLECTIVE_TIMEOUT, |pg| {
        tch::set_num_threads(per_rank);
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        Job::build_rank(loaded, features, registry, Some(pg)).and_then(|mut job| job.run())
    });
    // The first rank's own error: a peer's "left the group" is only a consequence of it.
    let mut first_err: Option<EngineError> = None;
    let mut summary = None;
    for (rank, r) in results.into_iter().enumerate() {
        let e = match r {
            Ok(Ok(s)) => {
                if rank == 0 {
                    summary = Some(s);
                }
                continue;
            }
            Ok(Err(e)) => e,
            Err(panic) => EngineError::Internal(format!("rank {rank} panicked: {panic}")),
        };
        if first_err.as_ref().is_none_or(|f| is_peer_gone(f) && !is_peer_gone(&e)) {
            first_err = Some(e);
        }
    }
    match (first_err, summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(EngineError::Internal("rank 0 returned no summary".into())),
    }
}

/// The world size `mpirun` started this process in (Open MPI's `OMPI_COMM_WORLD_SIZE`, or the
/// PMI `PMI_SIZE` of other MPI launchers); `None` outside `mpirun`.
pub fn mpirun_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"].iter().find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// Trains this process's rank of a job started by `mpirun -n N` (the MPI backend): returns
/// the summary on rank 0 and `None` on the others. A recipe whose `topology.world_size` is not
/// `N` is refused with that key named.
#[cfg(feature = "mpi")]
pub fn run_mpi(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
) -> Result<Option<RunSummary>, EngineError> {
    let pg = trainrec_dist::MpiGroup::init(COLLECTIVE_TIMEOUT)?;
    crate::configure_threads(loaded.recipe.run.threads);
    let rank = pg.rank();
    let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
    let summary = Job::build_rank(loaded, features, registry, Some(pg)).and_then(|mut job| job.run())?;
    Ok((rank == 0).then_some(summary))
}

fn is_peer_gone(e: &EngineError) -> bool {
    matches!(e, EngineError::Dist(trainrec_dist::DistError::PeerGone { .. }))
}
