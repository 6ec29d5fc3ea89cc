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

use tch::{Tensor, nn};
use trainrec_comm::{ProcessGroup, ProcessGroupExt, ReduceOp};

use crate::error::EngineError;

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
            let comm = s.spawn(move || -> Result<(), trainrec_comm::DistError> {
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
