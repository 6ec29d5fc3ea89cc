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

use std::collections::BTreeMap;
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
    /// context (collective when sharded); `staged`: a sharded batch's input dist, when a
    /// pipeline ran it ahead.
    pub(crate) fn forward(
        &self,
        kjt: &KeyedJaggedTensor,
        staged: Option<trainrec_dist::InputDist>,
    ) -> Result<(Tensor, Option<DistContext>), EngineError> {
        match self {
            // One rank: a deduplicated batch is looked up expanded.
            Self::Local(ebc) => {
                let kjt = full_batch(kjt)?;
                Ok((crate::tensors::pooled_tensor(ebc, &kjt)?, None))
            }
            Self::Sharded(s) => {
                let (out, ctx) = match staged {
                    Some(staged) => s.forward_dist(kjt, staged)?,
                    None => s.forward(kjt)?,
                };
                let t = Tensor::from_slice(&out).f_view([examples(kjt) as i64, s.width() as i64])?;
                Ok((t, Some(ctx)))
            }
            Self::Quantized(q) => {
                let kjt = full_batch(kjt)?;
                let (b, w) = (kjt.stride(), q.width());
                let t = Tensor::empty([b as i64, w as i64], (tch::Kind::Float, tch::Device::Cpu));
                // SAFETY: `t` is a new contiguous CPU float tensor of `b * w` elements that
                // nothing else references while the slice lives.
                let out = unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<f32>(), b * w) };
                q.forward_into(&kjt, out)?;
                Ok((t, None))
            }
            Self::Cuda(gpu) => {
                let kjt = full_batch(kjt)?;
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
        let engines: Vec<&dyn trainrec_dist::ShardEngine> = match self {
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
    ) -> Result<Option<trainrec_dist::StepTimes>, EngineError> {
        match (self, ctx) {
            (Self::Local(ebc), _) => {
                let kjt = full_batch(kjt)?;
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
                let kjt = full_batch(kjt)?;
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
    pub(crate) fn local_shards(&self) -> Vec<trainrec_dist::LocalShard> {
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
    pub(crate) fn load_local_shards(&mut self, shards: Vec<trainrec_dist::LocalShard>) -> Result<(), EngineError> {
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
) -> trainrec_dist::LocalShard {
    trainrec_dist::LocalShard {
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
    let tables = crate::job::planned_tables(recipe, plan);
    let shardings = ShardingPlan::from_plan(plan).shardings_for(&tables)?;
    let per_host = recipe.topology.local_world_size.unwrap_or(recipe.topology.world_size);
    Ok(ShardedEbc::new_on_hosts(tables, shardings, recipe.optimizer.sparse.clone(), recipe.run.seed, pg, per_host)?)
}

/// Default `topology.gradient_bucket_mib` (DDP's `bucket_cap_mb`).
pub const DEFAULT_BUCKET_MIB: f64 = 25.0;

/// The data-parallel half of a model across ranks (DDP): its group and the dense parameters
/// in one order on every rank, cut into gradient buckets. Rank 0's parameter values are
/// copied to every rank when it is made; [`Self::all_reduce`] sums the gradients each step.
pub struct DataParallel {
    pub(crate) pg: Arc<dyn ProcessGroup>,
    params: Vec<Tensor>,
    /// Consecutive ranges of `params`, last parameters first: one all-reduce each.
    buckets: Vec<std::ops::Range<usize>>,
}

impl DataParallel {
    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// Gradient buckets (one all-reduce each per step).
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }
}

/// Cuts parameters of `sizes` floats into buckets of at most `cap` floats (a larger parameter
/// is a bucket of its own), starting from the last parameter as DDP does (backward produces
/// the last layers' gradients first).
fn buckets(sizes: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut end = sizes.len();
    while end > 0 {
        let mut start = end - 1;
        let mut floats = sizes[start];
        while start > 0 && floats + sizes[start - 1] <= cap {
            start -= 1;
            floats += sizes[start];
        }
        out.push(start..end);
        end = start;
    }
    out
}

impl DataParallel {
    /// The trainable variables of `vs` by name, and rank 0's values copied to every rank;
    /// gradients are summed in buckets of `bucket_mib` MiB.
    pub fn new(pg: Arc<dyn ProcessGroup>, vs: &nn::VarStore, bucket_mib: f64) -> Result<Self, EngineError> {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let params: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
        let sizes: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let cap = ((bucket_mib * (1 << 20) as f64) / 4.0).max(1.0) as usize;
        let sync = Self { pg, buckets: buckets(&sizes, cap), params };
        tracing::debug!(buckets = sync.buckets.len(), bucket_mib, "dense gradient buckets");
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
        self.write_back(&self.params, &flat, |p, t| {
            p.shallow_clone().copy_(t);
        })
    }

    /// Sums every parameter's gradient and `loss` across ranks, bucket by bucket (`loss`
    /// rides in the last bucket); the gradients are replaced by the sums and the summed loss
    /// is returned. A second thread runs the all-reduces, so bucket `i`'s travels while
    /// bucket `i + 1` is packed and bucket `i - 1` unpacked.
    pub fn all_reduce(&self, loss: f64) -> Result<f64, EngineError> {
        let pack = |range: &std::ops::Range<usize>, last: bool| {
            let mut flat: Vec<f32> = Vec::new();
            for p in &self.params[range.clone()] {
                let g = p.grad();
                if g.defined() {
                    crate::tensors::with_f32_slice(&g, |s| flat.extend_from_slice(s));
                } else {
                    flat.extend(std::iter::repeat_n(0.0, p.numel()));
                }
            }
            if last {
                flat.push(loss as f32);
            }
            flat
        };
        // A gradient undefined here is undefined on every rank (one model, one graph shape:
        // the parameter is not used), so its sum is zero and it stays undefined.
        let unpack = |range: &std::ops::Range<usize>, flat: &[f32]| {
            self.write_back(&self.params[range.clone()], flat, |p, t| {
                let mut g = p.grad();
                if g.defined() {
                    g.copy_(t);
                }
            })
        };
        let n = self.buckets.len();
        if n == 0 {
            let mut l = [loss as f32];
            self.pg.all_reduce_f32(&mut l, ReduceOp::Sum)?;
            return Ok(l[0] as f64);
        }
        let pg = &self.pg;
        std::thread::scope(|s| -> Result<f64, EngineError> {
            let (to_comm, comm_in) = std::sync::mpsc::sync_channel::<Vec<f32>>(1);
            let (comm_out, from_comm) = std::sync::mpsc::sync_channel::<Vec<f32>>(1);
            let comm = s.spawn(move || -> Result<(), trainrec_dist::DistError> {
                for mut flat in comm_in {
                    pg.all_reduce_f32(&mut flat, ReduceOp::Sum)?;
                    if comm_out.send(flat).is_err() {
                        break;
                    }
                }
                Ok(())
            });
            let mut total = 0.0;
            let mut run = || -> Result<(), EngineError> {
                for i in 0..=n {
                    if i < n && to_comm.send(pack(&self.buckets[i], i + 1 == n)).is_err() {
                        return Ok(()); // the reducer failed: its error is joined below
                    }
                    if i > 0 {
                        let Ok(mut flat) = from_comm.recv() else { return Ok(()) };
                        if i == n {
                            total = flat.pop().unwrap_or(0.0) as f64;
                        }
                        unpack(&self.buckets[i - 1], &flat)?;
                    }
                }
                Ok(())
            };
            let packed = run();
            drop(to_comm);
            drop(from_comm);
            comm.join().map_err(|_| EngineError::Internal("the gradient all-reduce thread panicked".into()))??;
            packed?;
            Ok(total)
        })
    }

    fn write_back(
        &self,
        params: &[Tensor],
        flat: &[f32],
        mut put: impl FnMut(&Tensor, &Tensor),
    ) -> Result<(), EngineError> {
        let mut at = 0;
        tch::no_grad(|| -> Result<(), EngineError> {
            for p in params {
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
    run_threads_from(loaded, features, registry, None)
}

/// Builds rank `pg`'s job and runs it, from checkpoint directory `resume` when given.
fn build_and_run(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    pg: Option<Arc<dyn ProcessGroup>>,
    resume: Option<&std::path::Path>,
) -> Result<RunSummary, EngineError> {
    let mut job = Job::build_rank(loaded, features, registry, pg)?;
    if let Some(dir) = resume {
        job.resume_from(crate::checkpoint::Checkpoint::open(dir)?);
    }
    job.run()
}

/// Trains one rank of the job (no process group), from checkpoint directory `resume` when
/// given.
pub fn run_local(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    resume: Option<&std::path::Path>,
) -> Result<RunSummary, EngineError> {
    build_and_run(loaded, features, registry, None, resume)
}

/// [`run_threads`], every rank resuming from checkpoint directory `resume` when given.
pub fn run_threads_from(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    resume: Option<&std::path::Path>,
) -> Result<RunSummary, EngineError> {
    let world = loaded.recipe.topology.world_size;
    let threads = crate::configure_threads(loaded.recipe.run.threads);
    let per_rank = (threads / world).max(1) as i32;
    let results = ThreadGroup::run(world, COLLECTIVE_TIMEOUT, |pg| {
        tch::set_num_threads(per_rank);
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        build_and_run(loaded, features, registry, Some(pg), resume)
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
    resume: Option<&std::path::Path>,
) -> Result<Option<RunSummary>, EngineError> {
    let pg = trainrec_dist::MpiGroup::init(COLLECTIVE_TIMEOUT)?;
    crate::configure_threads(loaded.recipe.run.threads);
    let rank = pg.rank();
    let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
    let summary = build_and_run(loaded, features, registry, Some(pg), resume)?;
    Ok((rank == 0).then_some(summary))
}

fn is_peer_gone(e: &EngineError) -> bool {
    matches!(e, EngineError::Dist(trainrec_dist::DistError::PeerGone { .. }))
}

#[cfg(test)]
mod tests {
    use super::buckets;

    #[test]
    fn buckets_fill_from_the_last_parameter_and_hold_big_ones_alone() {
        // From the end: 1 + 1 (+10 > 6), then 10 alone, then 2 + 4 (+3 > 6), then 3.
        assert_eq!(buckets(&[3, 4, 2, 10, 1, 1], 6), vec![4..6, 3..4, 1..3, 0..1]);
        assert_eq!(buckets(&[5, 5], 100), vec![0..2]);
        assert!(buckets(&[], 10).is_empty());
    }
}
