//! A sharded embedding collection (unpooled, one embedding per id): TorchRec's
//! `ShardedEmbeddingCollection`, for sequence models.
//!
//! The tables are split into the same row x column shards as the [`crate::ShardedEbc`]'s
//! (every sharding type; see [`crate::TableSharding`]). A step on rank `r`:
//!
//! 1. **Input dist.** Each id goes to every shard holding its row (one per column block),
//!    shifted to the shard's first row. Splits first: one all-to-all of the id count of every
//!    (output, shard) route, then one all-to-all of the ids of all tables.
//! 2. **Lookup.** One local collection over the rank's shards gathers a row per id.
//! 3. **Output dist.** One all-to-all sends each source the rows of its ids; the source writes
//!    each row into its id's place and columns. Nothing is summed: every cell of an output
//!    comes from exactly one shard, so the output is bit-identical to the unsharded one.
//! 4. **Backward.** The reverse all-to-all brings each shard the gradient rows of its ids from
//!    the whole global batch; the local fused optimizer sums duplicates and updates each row
//!    once, as the unsharded collection on the global batch. Data-parallel tables all-gather
//!    ids and gradients and apply the same global update on every replica.
//!
//! Weights of weighted features are ignored, as by the unsharded collection. A variable-batch
//! (VBE) input is expanded to its full batch first (sequence outputs are per id, so there are no
//! pooled bags to share).

use std::sync::Arc;

use trainrec_embedding::{EmbeddingBagConfig, EmbeddingCollection, SequenceEmbeddings, SparseOptimizerConfig};
use trainrec_sparse::KeyedJaggedTensor;

use trainrec_comm::{DistError, ProcessGroup, ProcessGroupExt};

use crate::layout::{Layout, Output, Route, initial_replica_weights, initial_shard_weights, resolve_inputs};
use crate::module;
use crate::state::{LocalShard, parts};
use crate::tiling::check_shardings;
use crate::two_stage::merge_by_source;
use crate::{StepTimes, TableSharding};

/// What a [`ShardedEc::forward`] leaves for its backward.
pub struct EcContext {
    times: StepTimes,
    /// The rank's local lookups: per local route, one bag per source (its ids).
    local_kjt: Option<KeyedJaggedTensor>,
    /// `counts[j][s]`: ids of local route `j` from rank `s`.
    counts: Vec<Vec<usize>>,
    /// `sent[d][i]`: the positions (in its feature's values) of the ids this rank sent for
    /// route `i` of rank `d`; `None`: every id, in order.
    sent: Vec<Vec<Option<Vec<u32>>>>,
    /// Ids per output in this rank's batch.
    ids: Vec<usize>,
    /// The data-parallel features of the batch and the examples per rank.
    dp: Option<(KeyedJaggedTensor, Vec<usize>)>,
}

impl EcContext {
    /// The forward's phase times and bytes.
    pub fn times(&self) -> StepTimes {
        self.times
    }
}

/// An embedding collection sharded over a process group (see the module docs).
pub struct ShardedEc {
    pg: Arc<dyn ProcessGroup>,
    tables: Vec<EmbeddingBagConfig>,
    shardings: Vec<TableSharding>,
    outputs: Vec<Output>,
    routes: Vec<Vec<Route>>,
    local: Option<EmbeddingCollection>,
    local_names: Vec<Vec<Option<String>>>,
    dp: Option<EmbeddingCollection>,
    dp_outputs: Vec<usize>,
    optimizer: SparseOptimizerConfig,
}

impl ShardedEc {
    /// Builds this rank's part of the collection: its shards and the replicas of data-parallel
    /// tables, with the initial weights of the unsharded collection built with `seed`. Every
    /// rank must pass the same tables and shardings; the tables' pooling is ignored.
    pub fn new(
        tables: Vec<EmbeddingBagConfig>,
        shardings: Vec<TableSharding>,
        optimizer: SparseOptimizerConfig,
        seed: u64,
        pg: Arc<dyn ProcessGroup>,
    ) -> Result<Self, DistError> {
        let (world, me) = (pg.world_size(), pg.rank());
        check_shardings(&tables, &shardings, world)?;
        let layout = Layout::new(&tables, &shardings, world, me);
        let expected = layout.expected_local_keys(&tables, me);
        let Layout { outputs, routes, local_tables, local_names, init, dp_tables, dp_outputs, .. } = layout;
        let local = if local_tables.is_empty() {
            None
        } else {
            let mut ec = EmbeddingCollection::new(local_tables, optimizer.clone(), seed).map_err(module)?;
            for (name, w) in initial_shard_weights(&tables, &shardings, &init, seed) {
                ec.set_table_weights(&name, w).map_err(module)?;
            }
            if ec.output_keys() != expected {
                return Err(DistError::Module(format!(
                    "internal: local outputs {:?} differ from routes {expected:?}",
                    ec.output_keys()
                )));
            }
            Some(ec)
        };
        let dp = if dp_tables.is_empty() {
            None
        } else {
            let mut ec = EmbeddingCollection::new(dp_tables, optimizer.clone(), seed).map_err(module)?;
            for (name, w) in initial_replica_weights(&tables, &shardings, seed) {
                ec.set_table_weights(&name, w).map_err(module)?;
            }
            Some(ec)
        };
        Ok(Self { pg, tables, shardings, outputs, routes, local, local_names, dp, dp_outputs, optimizer })
    }

    /// Output names (each table's features, table order), as the unsharded collection's.
    pub fn output_keys(&self) -> Vec<String> {
        self.tables.iter().flat_map(|t| t.features.iter().cloned()).collect()
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    fn width_of(&self, r: &Route) -> usize {
        self.shardings[r.table].shards[r.shard].cols.len()
    }

    /// One embedding per id of this rank's batch `kjt`, per output (the unsharded
    /// collection's layout), and the context its backward needs. Collective: every rank calls
    /// it with its own batch.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<(SequenceEmbeddings, EcContext), DistError> {
        let (world, me) = (self.pg.world_size(), self.pg.rank());
        let expanded;
        let kjt = if kjt.variable_stride_per_key() {
            expanded = kjt.expand_vbe().map_err(module)?;
            &expanded
        } else {
            kjt
        };
        let keys = resolve_inputs(kjt, &self.outputs, &self.tables, |_| None)?;
        let ids: Vec<usize> = keys.iter().map(|&k| kjt.feature(k).values.len()).collect();
        let mut times = StepTimes::default();
        let clock = std::time::Instant::now();

        // Input dist: per destination, per route, the ids of its shard's rows.
        let (mut values, mut splits) = (Vec::new(), Vec::new());
        let mut val_counts = vec![0usize; world];
        let mut sent: Vec<Vec<Option<Vec<u32>>>> = vec![Vec::new(); world];
        for d in 0..world {
            let v0 = values.len();
            for r in &self.routes[d] {
                let f = kjt.feature(keys[r.output]);
                let shard = &self.shardings[r.table].shards[r.shard];
                let n0 = values.len();
                if shard.rows.start == 0 && shard.rows.end == self.tables[r.table].rows {
                    values.extend_from_slice(f.values);
                    sent[d].push(None);
                } else {
                    let mut pos = Vec::new();
                    for (p, &id) in f.values.iter().enumerate() {
                        if shard.rows.contains(&(id as u64)) {
                            values.push(id - shard.rows.start as i64);
                            pos.push(p as u32);
                        }
                    }
                    sent[d].push(Some(pos));
                }
                splits.push((values.len() - n0) as u64);
            }
            val_counts[d] = values.len() - v0;
        }
        let mine = &self.routes[me];
        let split_counts: Vec<usize> = self.routes.iter().map(Vec::len).collect();
        let got = self.pg.all_to_all_v(&splits, &split_counts, &vec![mine.len(); world])?;
        let counts: Vec<Vec<usize>> =
            (0..mine.len()).map(|j| (0..world).map(|s| got[s * mine.len() + j] as usize).collect()).collect();
        let recv_vals: Vec<usize> = (0..world).map(|s| counts.iter().map(|c| c[s]).sum()).collect();
        let recv = self.pg.all_to_all_v(&values, &val_counts, &recv_vals)?;
        // The local KJT: per route, one bag per source.
        let local_kjt = match &self.local {
            Some(local) => {
                let lengths: Vec<u32> = (0..world).flat_map(|s| counts.iter().map(move |c| c[s] as u32)).collect();
                let bags = vec![vec![1; world]; mine.len()];
                Some(merge_by_source(local.output_keys(), &bags, &lengths, &recv, None, world)?)
            }
            None => None,
        };
        times.input_dist = clock.elapsed().as_secs_f64();
        times.input_bytes = 8 * (splits.len() + values.len());

        let clock = std::time::Instant::now();
        let rows = match (&self.local, &local_kjt) {
            (Some(local), Some(k)) => local.forward(k).map_err(module)?.values,
            _ => Vec::new(),
        };
        times.lookup = clock.elapsed().as_secs_f64();

        // Output dist: to each source, the rows of its ids, route by route.
        let clock = std::time::Instant::now();
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; world];
        for (s, count) in send_counts.iter_mut().enumerate() {
            let start = send.len();
            for (j, r) in mine.iter().enumerate() {
                let (n, off) = (self.width_of(r), counts[j][..s].iter().sum::<usize>());
                send.extend_from_slice(&rows[j][off * n..(off + counts[j][s]) * n]);
            }
            *count = send.len() - start;
        }
        let recv_counts: Vec<usize> = (0..world)
            .map(|d| {
                self.routes[d]
                    .iter()
                    .zip(&splits_of(&splits, &split_counts, d))
                    .map(|(r, &c)| c * self.width_of(r))
                    .sum()
            })
            .collect();
        let back = self.pg.all_to_all_v(&send, &send_counts, &recv_counts)?;
        let mut out: Vec<Vec<f32>> =
            self.outputs.iter().zip(&ids).map(|(o, &n)| vec![0f32; n * self.tables[o.table].dim]).collect();
        let mut at = 0;
        for (routes, sent) in self.routes.iter().zip(&sent) {
            for (r, pos) in routes.iter().zip(sent) {
                let cols = self.shardings[r.table].shards[r.shard].cols.clone();
                let (n, dim) = (cols.len(), self.tables[r.table].dim);
                let dst = &mut out[r.output];
                let mut put = |i: usize, p: usize| {
                    dst[p * dim + cols.start..][..n].copy_from_slice(&back[at + i * n..][..n]);
                };
                let count = match pos {
                    None => {
                        (0..ids[r.output]).for_each(|p| put(p, p));
                        ids[r.output]
                    }
                    Some(pos) => {
                        pos.iter().enumerate().for_each(|(i, &p)| put(i, p as usize));
                        pos.len()
                    }
                };
                at += count * n;
            }
        }
        times.output_dist = clock.elapsed().as_secs_f64();
        times.output_bytes = 4 * send.len();

        // Data-parallel tables: local lookups.
        let clock = std::time::Instant::now();
        let dp = match &self.dp {
            Some(dp) => {
                let mut unique: Vec<&str> = Vec::new();
                for &o in &self.dp_outputs {
                    if !unique.contains(&self.outputs[o].input.as_str()) {
                        unique.push(self.outputs[o].input.as_str());
                    }
                }
                let k = kjt.select_keys(&unique).map_err(module)?;
                let got = dp.forward(&k).map_err(module)?;
                for (&o, v) in self.dp_outputs.iter().zip(got.values) {
                    out[o] = v;
                }
                let sizes = self.pg.all_gather_u64(kjt.stride() as u64)?;
                Some((k, sizes.into_iter().map(|n| n as usize).collect()))
            }
            None => None,
        };
        times.lookup += clock.elapsed().as_secs_f64();
        let seq = SequenceEmbeddings {
            keys: self.output_keys(),
            dims: self.outputs.iter().map(|o| self.tables[o.table].dim).collect(),
            values: out,
            lengths: keys.iter().map(|&k| kjt.feature(k).lengths.to_vec()).collect(),
        };
        Ok((seq, EcContext { times, local_kjt, counts, sent, ids, dp }))
    }

    /// Backward fused with the optimizer: `grads[o]` is the gradient of output `o` of this
    /// rank's forward, shaped like its values. Collective. Returns the step's phase times.
    pub fn backward_and_update(&mut self, ctx: EcContext, grads: &[Vec<f32>]) -> Result<StepTimes, DistError> {
        let (world, me) = (self.pg.world_size(), self.pg.rank());
        if grads.len() != self.outputs.len() {
            return Err(DistError::Module(format!("{} gradients for {} outputs", grads.len(), self.outputs.len())));
        }
        for ((o, name), (g, &n)) in self.outputs.iter().zip(self.output_keys()).zip(grads.iter().zip(&ctx.ids)) {
            let dim = self.tables[o.table].dim;
            if g.len() != n * dim {
                return Err(DistError::Module(format!(
                    "gradient of output '{}' has {} floats, expected {n} ids x {dim}",
                    name,
                    g.len()
                )));
            }
        }
        let mut times = ctx.times;
        let clock = std::time::Instant::now();
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; world];
        for (d, count) in send_counts.iter_mut().enumerate() {
            let start = send.len();
            for (r, pos) in self.routes[d].iter().zip(&ctx.sent[d]) {
                let cols = self.shardings[r.table].shards[r.shard].cols.clone();
                let (g, dim) = (&grads[r.output], self.tables[r.table].dim);
                let mut take = |p: usize| send.extend_from_slice(&g[p * dim + cols.start..p * dim + cols.end]);
                match pos {
                    None => (0..ctx.ids[r.output]).for_each(&mut take),
                    Some(pos) => pos.iter().for_each(|&p| take(p as usize)),
                }
            }
            *count = send.len() - start;
        }
        let mine = &self.routes[me];
        let widths: Vec<usize> = mine.iter().map(|r| self.width_of(r)).collect();
        let recv_counts: Vec<usize> =
            (0..world).map(|s| ctx.counts.iter().zip(&widths).map(|(c, w)| c[s] * w).sum()).collect();
        let recv = self.pg.all_to_all_v(&send, &send_counts, &recv_counts)?;
        // Per local route, the sources' gradient rows in rank order (the local KJT's order).
        let mut local_grads: Vec<Vec<f32>> =
            ctx.counts.iter().zip(&widths).map(|(c, w)| Vec::with_capacity(c.iter().sum::<usize>() * w)).collect();
        let mut at = 0;
        for s in 0..world {
            for (j, g) in local_grads.iter_mut().enumerate() {
                let len = ctx.counts[j][s] * widths[j];
                g.extend_from_slice(&recv[at..at + len]);
                at += len;
            }
        }
        times.grad_dist = clock.elapsed().as_secs_f64();
        let clock = std::time::Instant::now();
        if let (Some(local), Some(k)) = (&mut self.local, &ctx.local_kjt) {
            local.backward_and_update(k, &local_grads).map_err(module)?;
        }
        times.update = clock.elapsed().as_secs_f64();

        if let (Some(dp), Some((k, batch_sizes))) = (&mut self.dp, &ctx.dp) {
            let clock = std::time::Instant::now();
            // Every replica applies the global batch's update: gather ids and gradients.
            let nkeys = k.keys().len();
            let lcounts: Vec<usize> = batch_sizes.iter().map(|&b| b * nkeys).collect();
            let lengths = self.pg.all_gather_v(k.lengths(), &lcounts)?;
            let vcounts: Vec<usize> =
                self.pg.all_gather_u64(k.values().len() as u64)?.into_iter().map(|n| n as usize).collect();
            let values = self.pg.all_gather_v(k.values(), &vcounts)?;
            let total: usize = batch_sizes.iter().sum();
            let per_key = vec![batch_sizes.clone(); nkeys];
            let global = merge_by_source(k.keys().to_vec(), &per_key, &lengths, &values, None, total)?;
            // Ids of each data-parallel output from each rank, from the global lengths.
            let key_of = |o: usize| k.key_index(&self.outputs[o].input).expect("selected keys");
            let ids_of = |o: usize, s: usize| -> usize {
                let f = global.feature(key_of(o));
                let first: usize = batch_sizes[..s].iter().sum();
                f.lengths[first..first + batch_sizes[s]].iter().map(|&l| l as usize).sum()
            };
            let mine: Vec<f32> = self.dp_outputs.iter().flat_map(|&o| grads[o].iter().copied()).collect();
            let dim_of = |o: usize| self.tables[self.outputs[o].table].dim;
            let gcounts: Vec<usize> =
                (0..world).map(|s| self.dp_outputs.iter().map(|&o| ids_of(o, s) * dim_of(o)).sum()).collect();
            let all = self.pg.all_gather_v(&mine, &gcounts)?;
            let mut per_output: Vec<Vec<f32>> = vec![Vec::new(); self.dp_outputs.len()];
            let mut at = 0;
            for s in 0..world {
                for (i, &o) in self.dp_outputs.iter().enumerate() {
                    let len = ids_of(o, s) * dim_of(o);
                    per_output[i].extend_from_slice(&all[at..at + len]);
                    at += len;
                }
            }
            times.grad_dist += clock.elapsed().as_secs_f64();
            let clock = std::time::Instant::now();
            dp.backward_and_update(&global, &per_output).map_err(module)?;
            times.update += clock.elapsed().as_secs_f64();
        }
        Ok(times)
    }

    /// The whole table `name` as fp32 `[rows, dim]`, assembled from every rank's shards.
    /// Collective (every rank gets it).
    pub fn table_weights(&self, name: &str) -> Result<Vec<f32>, DistError> {
        parts!(self).table_weights(self.pg.as_ref(), self.local.as_ref(), self.dp.as_ref(), name)
    }

    /// Replaces table `name` from its whole `[rows, dim]` fp32 weights (each rank keeps its
    /// shards' blocks). Not collective.
    pub fn set_table_weights(&mut self, name: &str, weights: &[f32]) -> Result<(), DistError> {
        self.load_table(name, weights, None, None)
    }

    /// As [`crate::ShardedEbc::load_table`]: weights, and optimizer state and step count when
    /// given, from the whole table's. Not collective.
    pub fn load_table(
        &mut self,
        name: &str,
        weights: &[f32],
        optimizer_state: Option<&[f32]>,
        step_count: Option<u64>,
    ) -> Result<(), DistError> {
        parts!(self).load(self.local.as_mut(), self.dp.as_mut(), name, Some(weights), optimizer_state, step_count)
    }

    /// Scales every table's learning rate by `multiplier` (a schedule's), on this rank's
    /// shards and replicas. Not collective.
    pub fn set_lr_multiplier(&mut self, multiplier: f64) {
        for ec in [self.local.as_mut(), self.dp.as_mut()].into_iter().flatten() {
            ec.set_lr_multiplier(multiplier);
        }
    }

    /// This rank's shards of every table (see [`crate::ShardedEbc::local_shards`]).
    pub fn local_shards(&self) -> Vec<LocalShard> {
        parts!(self).local_shards(self.local.as_ref(), self.dp.as_ref())
    }

    /// Restores shards [`ShardedEc::local_shards`] gave (see
    /// [`crate::ShardedEbc::load_local_shards`]). Not collective.
    pub fn load_local_shards(&mut self, shards: Vec<LocalShard>) -> Result<(), DistError> {
        for shard in shards {
            parts!(self).load_shard(self.local.as_mut(), self.dp.as_mut(), shard)?;
        }
        Ok(())
    }
}

/// The id counts this rank sent to rank `d`, one per route of `d`.
fn splits_of(splits: &[u64], counts: &[usize], d: usize) -> Vec<usize> {
    let start: usize = counts[..d].iter().sum();
    splits[start..start + counts[d]].iter().map(|&c| c as usize).collect()
}
