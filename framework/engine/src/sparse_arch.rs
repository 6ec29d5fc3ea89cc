//! The job's embedding tables as one value whatever their backend: whole on this rank (CPU),
//! sharded over a process group, quantized for inference, or on a GPU.

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::Tensor;
use trainrec_comm::ProcessGroup;
use trainrec_embedding::EmbeddingBagCollection;
use trainrec_sharding::{DistContext, ShardedEbc, ShardingPlan};
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;

/// The job's embedding bag collection: whole on one rank, or sharded over a group.
pub(crate) enum SparseArch {
    /// Every table on this (only) rank.
    Local(Box<EmbeddingBagCollection>),
    /// Tables sharded over the ranks by the plan.
    Sharded(Box<ShardedEbc>),
    /// Inference tables quantized from a one-rank collection (no training).
    Quantized(Box<trainrec_embedding::quant::QuantizedEbc>),
    /// Every table in the memory of this (only) rank's GPU.
    Cuda(Box<trainrec_cuda::CudaEbc>),
}

/// Where the tensors a CUDA collection reads and writes live: its GPU, or host memory on the
/// emulator.
pub(crate) fn cuda_tensor_device(gpu: &trainrec_cuda::CudaEbc) -> tch::Device {
    if gpu.on_gpu() { tch::Device::Cuda(gpu.info().device) } else { tch::Device::Cpu }
}

impl SparseArch {
    /// Pooled embeddings `[batch, width]` of `kjt` as a tensor, and the sharded forward's
    /// context (collective when sharded); `staged`: a sharded batch's input dist, when a
    /// pipeline ran it ahead.
    pub(crate) fn forward(
        &self,
        kjt: &KeyedJaggedTensor,
        staged: Option<trainrec_sharding::InputDist>,
    ) -> Result<(Tensor, Option<DistContext>), EngineError> {
        match self {
            // One rank: a deduplicated batch is looked up expanded.
            Self::Local(ebc) => {
                let kjt = kjt.full_batch()?;
                Ok((crate::tensors::pooled_tensor(ebc, &kjt)?, None))
            }
            Self::Sharded(s) => {
                let (out, ctx) = match staged {
                    Some(staged) => s.forward_dist(kjt, staged)?,
                    None => s.forward(kjt)?,
                };
                let t = Tensor::from_slice(&out).f_view([kjt.examples() as i64, s.width() as i64])?;
                Ok((t, Some(ctx)))
            }
            Self::Quantized(q) => {
                let kjt = kjt.full_batch()?;
                let (b, w) = (kjt.stride(), q.width());
                let t = Tensor::empty([b as i64, w as i64], (tch::Kind::Float, tch::Device::Cpu));
                // SAFETY: `t` is a new contiguous CPU float tensor of `b * w` elements that
                // nothing else references while the slice lives.
                let out = unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<f32>(), b * w) };
                q.forward_into(&kjt, out)?;
                Ok((t, None))
            }
            Self::Cuda(gpu) => {
                let kjt = kjt.full_batch()?;
                let (b, w) = (kjt.stride(), gpu.width());
                let t = Tensor::empty([b as i64, w as i64], (tch::Kind::Float, cuda_tensor_device(gpu)));
                if b * w > 0 {
                    // SAFETY: `t` is a new contiguous float tensor of `b * w` elements on the
                    // collection's GPU; the kernels run on the default stream, before any later
                    // libtorch work on it (libtorch's default stream is the same stream).
                    unsafe { gpu.forward_into_raw(&kjt, t.data_ptr() as u64)? };
                }
                Ok((t, None))
            }
        }
    }

    /// Unpins batches prefetched into table caches that will not be trained.
    pub(crate) fn discard_prefetched(&mut self) {
        match self {
            Self::Local(ebc) => ebc.discard_prefetched(),
            Self::Sharded(s) => s.discard_prefetched(),
            Self::Cuda(gpu) => gpu.discard_prefetched(),
            Self::Quantized(_) => {}
        }
    }

    /// Cache counters of the cached tables this rank holds, by table (shard) name:
    /// `cache/<table>/{hit_rate,misses,evictions,loaded_mib}`, cumulative.
    pub(crate) fn cache_metric_values(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        let engines: Vec<&dyn trainrec_sharding::ShardEngine> = match self {
            Self::Local(ebc) => vec![ebc.as_ref()],
            Self::Sharded(s) => s.local().into_iter().chain(s.replicas()).collect(),
            Self::Quantized(_) => return out,
            Self::Cuda(gpu) => {
                for t in &gpu.layout().tables {
                    if let Some(s) = gpu.cache_stats(&t.name) {
                        cache_values(&mut out, &t.name, &s);
                    }
                }
                return out;
            }
        };
        for engine in engines {
            for name in engine.table_names() {
                if let Some(s) = engine.cache_stats(&name) {
                    cache_values(&mut out, &name, &s);
                }
            }
        }
        out
    }

    fn inference_only() -> EngineError {
        EngineError::Internal("quantized tables are for inference: they do not train or change".into())
    }

    /// The fused backward and update from the pooled output's gradient; a sharded step's
    /// phase times.
    pub(crate) fn backward(
        &mut self,
        kjt: &KeyedJaggedTensor,
        ctx: Option<DistContext>,
        grad: &Tensor,
    ) -> Result<Option<trainrec_sharding::StepTimes>, EngineError> {
        match (self, ctx) {
            (Self::Local(ebc), _) => {
                let kjt = kjt.full_batch()?;
                crate::tensors::with_f32_slice(grad, |g| ebc.backward_and_update(&kjt, g))?;
            }
            (Self::Sharded(s), Some(ctx)) => {
                let times = crate::tensors::with_f32_slice(grad, |g| s.backward_and_update(ctx, g))?;
                tracing::trace!(?times, "sharded embedding step");
                return Ok(Some(times));
            }
            (Self::Sharded(_), None) => {
                return Err(EngineError::Internal("sharded backward without its forward's context".into()));
            }
            (Self::Quantized(_), _) => return Err(Self::inference_only()),
            (Self::Cuda(gpu), _) => {
                let kjt = kjt.full_batch()?;
                let g = grad.to_device(cuda_tensor_device(gpu)).to_kind(tch::Kind::Float).contiguous();
                if g.numel() != kjt.stride() * gpu.width() {
                    return Err(EngineError::Internal(format!(
                        "pooled gradient has {} values, expected {}",
                        g.numel(),
                        kjt.stride() * gpu.width()
                    )));
                }
                if g.numel() > 0 {
                    // SAFETY: `g` is a contiguous float tensor of batch * width values on the
                    // collection's GPU, alive until this call returns; the kernels read it on
                    // the default stream, in order with libtorch's work that produced it and
                    // before any later reuse of its memory.
                    unsafe { gpu.backward_and_update_raw(&kjt, g.data_ptr() as u64)? };
                }
            }
        }
        Ok(None)
    }

    /// This rank's shards of every table (each whole table on one rank).
    pub(crate) fn local_shards(&self) -> Vec<trainrec_sharding::LocalShard> {
        match self {
            Self::Local(ebc) => ebc
                .table_configs()
                .map(|t| {
                    let n = &t.name;
                    whole_table(n, t.rows, t.dim, ebc.table_weights(n), ebc.optimizer_state(n), ebc.step_count(n))
                })
                .collect(),
            Self::Sharded(s) => s.local_shards(),
            Self::Quantized(_) => Vec::new(),
            Self::Cuda(gpu) => gpu
                .layout()
                .tables
                .iter()
                .map(|t| {
                    let n = &t.name;
                    whole_table(
                        n,
                        t.rows,
                        t.dim,
                        gpu.table_weights(n).ok(),
                        gpu.optimizer_state(n).ok(),
                        gpu.step_count(n).ok(),
                    )
                })
                .collect(),
        }
    }

    /// Restores shards in the layout [`SparseArch::local_shards`] gives (each whole table on
    /// one rank; across ranks, this rank's shards).
    pub(crate) fn load_local_shards(&mut self, shards: Vec<trainrec_sharding::LocalShard>) -> Result<(), EngineError> {
        match self {
            Self::Local(ebc) => {
                for s in shards {
                    ebc.set_table_weights(&s.table, s.weights)?;
                    if !s.optimizer_state.is_empty() {
                        ebc.set_optimizer_state(&s.table, s.optimizer_state)?;
                    }
                    ebc.set_step_count(&s.table, s.step_count)?;
                }
            }
            Self::Sharded(sh) => sh.load_local_shards(shards)?,
            Self::Quantized(_) => return Err(Self::inference_only()),
            Self::Cuda(gpu) => {
                for s in shards {
                    gpu.load_table(&s.table, &s.weights, &s.optimizer_state, s.step_count)?;
                }
            }
        }
        Ok(())
    }

    /// Re-initialises rows of table `name` (a managed-collision slot changed hands).
    pub(crate) fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), EngineError> {
        match self {
            Self::Local(ebc) => ebc.reset_rows(name, rows, key)?,
            Self::Sharded(s) => s.reset_rows(name, rows, key)?,
            Self::Quantized(_) => return Err(Self::inference_only()),
            Self::Cuda(gpu) => gpu.reset_rows(name, rows, key, None)?,
        }
        Ok(())
    }

    /// The weights of table `name`, `[rows, dim]` row-major (collective when sharded).
    pub(crate) fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        match self {
            Self::Local(ebc) => Ok(ebc.table_weights(name)),
            Self::Sharded(s) => Ok(Some(s.table_weights(name)?)),
            Self::Quantized(q) => Ok(q.dequantized(name)),
            Self::Cuda(gpu) => Ok(gpu.table_weights(name).ok()),
        }
    }
}

/// A cached table's counters as metric values.
fn cache_values(out: &mut BTreeMap<String, f64>, table: &str, s: &trainrec_embedding::CacheStats) {
    out.insert(format!("cache/{table}/hit_rate"), s.hit_rate());
    out.insert(format!("cache/{table}/misses"), s.misses as f64);
    out.insert(format!("cache/{table}/evictions"), s.evictions as f64);
    out.insert(format!("cache/{table}/loaded_mib"), s.loaded_bytes as f64 / (1 << 20) as f64);
}

/// A whole table as one rank's only shard of it.
fn whole_table(
    name: &str,
    rows: u64,
    dim: usize,
    weights: Option<Vec<f32>>,
    state: Option<Vec<f32>>,
    steps: Option<u64>,
) -> trainrec_sharding::LocalShard {
    trainrec_sharding::LocalShard {
        table: name.to_string(),
        table_shape: [rows as usize, dim],
        rows: 0..rows,
        cols: 0..dim,
        replicated: false,
        weights: weights.unwrap_or_default(),
        optimizer_state: state.unwrap_or_default(),
        step_count: steps.unwrap_or(0),
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
