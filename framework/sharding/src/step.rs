//! A sharded collection's step: the input dist (every id to the rank holding its row), the
//! lookups, the output dist and the backward with its fused updates (see the crate docs for
//! the phases), and the times and bytes of each phase.

use std::ops::Range;

use trainrec_comm::{DistError, ProcessGroupExt, offsets};
use trainrec_planner::ShardingType;
use trainrec_sparse::KeyedJaggedTensor;

use crate::ebc::ShardedEbc;
use crate::layout::{RawRoute, Route, resolve_inputs};
use crate::module;
use crate::state::parts;
use crate::two_stage::{TwoStage, merge_by_source, width_of};

pub use trainrec_embedding::StepTimes;

/// What a forward leaves for its backward (one per batch in flight).
pub struct DistContext {
    /// The batch's input dist, its times now the whole forward's.
    pub(crate) input: InputDist,
    /// `1 / ids` per (mean output, example); empty for sum outputs.
    pub(crate) mean_scale: Vec<Vec<f32>>,
    /// The data-parallel features of the local batch (expanded to the full batch).
    pub(crate) dp_kjt: Option<KeyedJaggedTensor>,
}

impl DistContext {
    /// Examples per rank in this step, rank order (the global batch is their sum).
    pub fn batch_sizes(&self) -> &[usize] {
        &self.input.batch_sizes
    }

    /// The forward's phase times and bytes.
    pub fn times(&self) -> StepTimes {
        self.input.times
    }
}

/// A batch after its input dist ([`ShardedEbc::input_dist`]): the lookups this rank's
/// shards serve, waiting for [`ShardedEbc::forward_dist`].
pub struct InputDist {
    /// Keys, ids and examples of the batch it was staged from (checked by `forward_dist`).
    pub(crate) shape: (Vec<String>, usize, usize),
    /// The batch's key of each output.
    pub(crate) keys: Vec<usize>,
    /// Examples of the batch.
    pub(crate) b: usize,
    /// The times (and bytes) of the stages run so far.
    pub(crate) times: StepTimes,
    /// The rank's local lookups over the global batch (absent without local shards).
    pub(crate) local_kjt: Option<KeyedJaggedTensor>,
    /// Examples per rank, rank order.
    pub(crate) batch_sizes: Vec<usize>,
    /// Per output: its bags on this rank (the batch, or a VBE key's distinct bags).
    pub(crate) nbags: Vec<usize>,
    /// Per output of a VBE batch: each sample's bag (`inverse_indices`).
    pub(crate) sample_bag: Vec<Option<Vec<usize>>>,
    /// `src_bags[s][o]`: bags of output `o` on rank `s`.
    pub(crate) src_bags: Vec<Vec<usize>>,
    /// `bags[j][s]`: bags of local route `j` from rank `s`.
    pub(crate) bags: Vec<Vec<usize>>,
    /// `off[j][s]`: where those bags start in the local batch.
    pub(crate) off: Vec<Vec<usize>>,
    /// Bags per key of the local batch (padded).
    pub(crate) stride: usize,
}

impl InputDist {
    /// The input dist's time and bytes.
    pub fn times(&self) -> StepTimes {
        self.times
    }
}

impl ShardedEbc {
    /// Pooled lookups of this rank's batch `kjt` (every input feature): `[B, width]`
    /// row-major, the unsharded collection's layout, and the context its backward needs.
    /// Collective: every rank calls it with its own batch. The same as
    /// [`Self::input_dist`] then [`Self::forward_dist`].
    ///
    /// A variable-batch (VBE) `kjt` (per key its distinct bags and `inverse_indices`, e.g. from
    /// [`KeyedJaggedTensor::dedup`]) moves and pools only the distinct bags; the output is
    /// expanded to the full batch of `B = inverse_indices` samples at the end, and equals the
    /// forward of the expanded batch.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<(Vec<f32>, DistContext), DistError> {
        let staged = self.input_dist(kjt)?;
        self.forward_dist(kjt, staged)
    }

    /// The first stage of [`Self::forward`]: the input dist of this rank's batch `kjt`
    /// (bucketizing its ids by shard, the splits all-to-all and the lengths / ids / weights
    /// all-to-alls) into the batch of lookups this rank's shards serve. It reads no weights,
    /// so a pipeline runs it for batch i+1 before batch i's update (TorchRec's
    /// `TrainPipelineSparseDist`). Collective: every rank stages its batches in the same
    /// order, on one thread at a time.
    pub fn input_dist(&self, kjt: &KeyedJaggedTensor) -> Result<InputDist, DistError> {
        let (world, me) = (self.pg.world_size(), self.pg.rank());
        let inverse = match (kjt.variable_stride_per_key(), kjt.inverse_indices()) {
            (false, _) => None,
            (true, Some(inv)) => Some(inv),
            (true, None) => {
                return Err(DistError::Module(
                    "a variable-batch (VBE) batch needs inverse_indices to expand its pooled output".into(),
                ));
            }
        };
        let b = inverse.map_or(kjt.stride(), |inv| inv.indices.first().map_or(0, Vec::len));
        let keys = resolve_inputs(kjt, &self.outputs, &self.tables, |t| {
            self.raw_blocks[t].map(|r| match r {
                RawRoute::Block(b) => b.saturating_mul(self.shardings[t].shards.len() as u64),
                RawRoute::Hash => 1 << 63,
            })
        })?;
        let weighted = kjt.weights().is_some();
        // Per output: its bags here (B, or the distinct bags of a VBE key) and each sample's bag.
        let nbags: Vec<usize> = keys.iter().map(|&k| kjt.feature(k).num_bags()).collect();
        let sample_bag: Vec<Option<Vec<usize>>> =
            keys.iter().map(|&k| inverse.map(|inv| inv.indices[k].clone())).collect();
        let start = std::time::Instant::now();
        let mut times = StepTimes::default();

        // Input dist payloads, one per destination, route-major.
        let mut lengths: Vec<u32> = Vec::new();
        let mut values: Vec<i64> = Vec::new();
        let mut weights: Vec<f32> = Vec::new();
        let (mut len_counts, mut val_counts) = (vec![0usize; world], vec![0usize; world]);
        for d in 0..world {
            let (l0, v0) = (lengths.len(), values.len());
            for r in &self.routes[d] {
                let f = kjt.feature(keys[r.output]);
                let shard = &self.shardings[r.table].shards[r.shard];
                let raw = self.raw_blocks[r.table];
                let whole = match raw {
                    Some(_) => self.shardings[r.table].shards.len() == 1,
                    None => shard.rows.start == 0 && shard.rows.end == self.tables[r.table].rows,
                };
                if whole {
                    // Every id goes to this shard unchanged.
                    lengths.extend_from_slice(f.lengths);
                    values.extend_from_slice(f.values);
                    if let Some(w) = f.weights {
                        weights.extend_from_slice(w);
                    }
                    continue;
                }
                for bag in 0..f.num_bags() {
                    let (s, e) = (f.bag_start(bag), f.bag_start(bag + 1));
                    let mut n = 0u32;
                    for pos in s..e {
                        let id = f.values[pos] as u64;
                        let (mine, local) = match raw {
                            Some(route) => (route.part(id, self.shardings[r.table].shards.len()) == r.shard, id),
                            None => (shard.rows.contains(&id), id.wrapping_sub(shard.rows.start)),
                        };
                        if mine {
                            values.push(local as i64);
                            if let Some(w) = f.weights {
                                weights.push(w[pos]);
                            }
                            n += 1;
                        }
                    }
                    lengths.push(n);
                }
            }
            len_counts[d] = lengths.len() - l0;
            val_counts[d] = values.len() - v0;
        }
        // Splits first: batch size, id count, weightedness and each output's bag count, per
        // destination.
        let n_out = self.outputs.len();
        let mut splits = Vec::new();
        for &count in &val_counts {
            splits.extend([b as u64, count as u64, weighted as u64]);
            splits.extend(nbags.iter().map(|&n| n as u64));
        }
        let mine = &self.routes[me];
        let got = self.pg.all_to_all_v(&splits, &vec![3 + n_out; world], &vec![3 + n_out; world])?;
        let at = |s: usize, i: usize| got[s * (3 + n_out) + i] as usize;
        let batch_sizes: Vec<usize> = (0..world).map(|s| at(s, 0)).collect();
        let recv_vals: Vec<usize> = (0..world).map(|s| at(s, 1)).collect();
        if let Some(s) = (0..world).find(|&s| (at(s, 2) != 0) != weighted) {
            return Err(DistError::Module(format!(
                "rank {s}'s batch is {}weighted but rank {me}'s is {}weighted: every rank must send the same features",
                if at(s, 2) != 0 { "" } else { "not " },
                if weighted { "" } else { "not " }
            )));
        }
        // src_bags[s][o]: the bags of output o on rank s; bags[j][s]: the bags of route j from
        // rank s; off[j][s]: where they start locally.
        let src_bags: Vec<Vec<usize>> = (0..world).map(|s| (0..n_out).map(|o| at(s, 3 + o)).collect()).collect();
        let bags: Vec<Vec<usize>> =
            (0..mine.len()).map(|j| (0..world).map(|s| src_bags[s][mine[j].output]).collect()).collect();
        let off: Vec<Vec<usize>> = bags.iter().map(|bs| offsets(bs)).collect();
        let recv_lens: Vec<usize> = (0..world).map(|s| bags.iter().map(|bs| bs[s]).sum()).collect();
        let lengths = self.pg.all_to_all_v(&lengths, &len_counts, &recv_lens)?;
        let values = self.pg.all_to_all_v(&values, &val_counts, &recv_vals)?;
        let weights = if weighted { Some(self.pg.all_to_all_v(&weights, &val_counts, &recv_vals)?) } else { None };

        // The local KJT: per route, the sources' bags in rank order, padded with empty bags to
        // one stride (routes of VBE keys have fewer).
        let stride = bags.iter().map(|bs| bs.iter().sum::<usize>()).max().unwrap_or(0);
        let local_kjt = match &self.local {
            Some(local) => {
                Some(merge_by_source(local.output_keys(), &bags, &lengths, &values, weights.as_deref(), stride)?)
            }
            None => None,
        };
        times.input_dist = start.elapsed().as_secs_f64();
        times.input_bytes = 8 * splits.len()
            + 4 * len_counts.iter().sum::<usize>()
            + (8 + if weighted { 4 } else { 0 }) * val_counts.iter().sum::<usize>();
        Ok(InputDist {
            shape: (kjt.keys().to_vec(), kjt.values().len(), b),
            keys,
            b,
            times,
            local_kjt,
            batch_sizes,
            nbags,
            sample_bag,
            src_bags,
            bags,
            off,
            stride,
        })
    }

    /// Loads the rows `staged`'s lookups need into the caches of this rank's cached shards
    /// and pins them until that batch's update (the `prefetch_sparse_dist` pipeline's stage;
    /// nothing to do without cached shards).
    pub fn prefetch(&mut self, staged: &InputDist) -> Result<(), DistError> {
        if let (Some(local), Some(k)) = (&mut self.local, &staged.local_kjt) {
            crate::local::prefetch(local.as_mut(), k)?;
        }
        Ok(())
    }

    /// Routes table `name`'s ids by raw id instead of by row (`Some(block)`; `None` routes by
    /// row again): raw id `i` goes, unchanged, to the rank of shard `i / block`, and the rank
    /// must replace the ids [`Self::raw_ids_mut`] shows it by rows of that shard (local
    /// numbering) before [`Self::forward_dist`]. This is the owner-rank remap of managed
    /// collisions: each shard's module owns a block of the raw id space and of the rows, so
    /// one input dist carries each id to the module that remaps it and the shard that looks
    /// it up. Every shard must hold whole rows (all columns); the input dist refuses
    /// ids at or past `block * shards`. Every rank must route the same tables alike.
    pub fn route_raw_ids(&mut self, name: &str, block: Option<u64>) -> Result<(), DistError> {
        self.route_by(name, block.map(RawRoute::Block))
    }

    /// Routes table `name`'s ids by a hash of the raw id (`true`; `false` by row again): raw
    /// id `i` goes, unchanged, to the rank of shard [`hashed_part`]`(i, shards)`, to be
    /// replaced there by rows of that shard as [`Self::route_raw_ids`] says. This is the
    /// owner-rank admission of dynamic tables: each shard's id map owns the raw ids hashed to
    /// it, so ids of any range spread evenly over the shards.
    pub fn route_hashed_ids(&mut self, name: &str, hashed: bool) -> Result<(), DistError> {
        self.route_by(name, hashed.then_some(RawRoute::Hash))
    }

    fn route_by(&mut self, name: &str, route: Option<RawRoute>) -> Result<(), DistError> {
        let block = match route {
            Some(RawRoute::Block(b)) => Some(b),
            Some(RawRoute::Hash) => Some(1),
            None => None,
        };
        let ti = parts!(self).index(name)?;
        let (t, s) = (&self.tables[ti], &self.shardings[ti]);
        if block.is_some() {
            if s.sharding_type == ShardingType::DataParallel || s.shards.is_empty() {
                return Err(DistError::Module(format!("table {name}: a data-parallel table has no shard to remap on")));
            }
            if let Some(sh) = s.shards.iter().find(|sh| sh.cols != (0..t.dim)) {
                return Err(DistError::Module(format!(
                    "table {name}: its shard on rank {} holds columns {:?} of {}: routing by raw id needs whole rows",
                    sh.rank, sh.cols, t.dim
                )));
            }
        }
        if block == Some(0) {
            return Err(DistError::Module(format!("table {name}: a raw id block of 0 ids")));
        }
        self.raw_blocks[ti] = route;
        Ok(())
    }

    /// Drops from the local lookups of `staged` the ids equal to `id` of the tables routed by
    /// raw id (after [`Self::raw_ids_mut`] replaced the others by rows): a dynamic table's ids
    /// without a row, which read zeros and get no update.
    pub fn drop_local_ids(&self, staged: &mut InputDist, id: i64) -> Result<(), DistError> {
        let Some(local) = staged.local_kjt.as_mut() else { return Ok(()) };
        let mine = &self.routes[self.pg.rank()];
        let routed = |k: usize| mine.get(k).is_some_and(|r| self.raw_blocks[r.table].is_some());
        if let Some(kept) = local
            .without_value(routed, id)
            .map_err(|e| DistError::Module(format!("dropping ids without a row: {e}")))?
        {
            *local = kept;
        }
        Ok(())
    }

    /// The ids `staged` brought to this rank for the tables routed by raw id
    /// ([`Self::route_raw_ids`]), still raw: `(table, shard, ids)` per feature of each such
    /// shard held here (an empty slice when no id came). Replace them by the shard's local
    /// rows before [`Self::forward_dist`].
    pub fn raw_ids_mut<'a>(&self, staged: &'a mut InputDist) -> Vec<(String, usize, &'a mut [i64])> {
        let Some(local) = staged.local_kjt.as_mut() else { return Vec::new() };
        let mine = &self.routes[self.pg.rank()];
        local
            .values_per_key_mut()
            .into_iter()
            .zip(mine)
            .filter(|(_, r)| self.raw_blocks[r.table].is_some())
            .map(|(ids, r)| (self.tables[r.table].name.clone(), r.shard, ids))
            .collect()
    }

    /// Unpins rows prefetched for batches that will not be trained.
    pub fn discard_prefetched(&mut self) {
        if let Some(local) = &mut self.local {
            local.discard_prefetched();
        }
    }

    /// The rest of [`Self::forward`] after [`Self::input_dist`] of the same `kjt`: the local
    /// lookups, the output dist and the data-parallel tables. Collective.
    pub fn forward_dist(
        &self,
        kjt: &KeyedJaggedTensor,
        staged: InputDist,
    ) -> Result<(Vec<f32>, DistContext), DistError> {
        if staged.shape != (kjt.keys().to_vec(), kjt.values().len(), staged.b) {
            return Err(DistError::Module(
                "forward_dist: the staged input dist is of another batch (stage batches in the order they train)"
                    .into(),
            ));
        }
        let me = self.pg.rank();
        let world = self.pg.world_size();
        let mine = &self.routes[me];
        let (keys, b, mut times, stride) = (&staged.keys, staged.b, staged.times, staged.stride);
        let (local_kjt, nbags, sample_bag) = (&staged.local_kjt, &staged.nbags, &staged.sample_bag);
        let (src_bags, bags, off) = (&staged.src_bags, &staged.bags, &staged.off);

        // Lookup.
        let clock = std::time::Instant::now();
        let lw = self.local_width[me];
        let mut pooled = vec![0f32; stride * lw];
        if let (Some(local), Some(k)) = (&self.local, &local_kjt) {
            crate::local::lookup(local.as_ref(), k, &mut pooled)?;
        }
        times.lookup = clock.elapsed().as_secs_f64();

        // Output dist, route-major payloads: to each source, its bags of every local output
        // (all-to-all); the row-wise partial sums of every source's bags (reduce-scatter).
        let clock = std::time::Instant::now();
        let block_of = |j: usize, s: usize, into: &mut Vec<f32>| {
            let (c, n) = (self.route_cols[me][j], width_of(self, &mine[j]));
            for row in off[j][s]..off[j][s] + bags[j][s] {
                into.extend_from_slice(&pooled[row * lw + c..][..n]);
            }
        };
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; world];
        let mut rs_in = Vec::new();
        let mut rs_counts = vec![0usize; world];
        for s in 0..world {
            let (a0, r0) = (send.len(), rs_in.len());
            for &j in &self.a2a[me] {
                block_of(j, s, &mut send);
            }
            for &j in &self.rs {
                block_of(j, s, &mut rs_in);
            }
            send_counts[s] = send.len() - a0;
            rs_counts[s] = rs_in.len() - r0;
        }
        let recv_counts: Vec<usize> = (0..world)
            .map(|d| {
                self.a2a[d].iter().map(|&j| nbags[self.routes[d][j].output] * width_of(self, &self.routes[d][j])).sum()
            })
            .collect();
        let recv = self.pg.all_to_all_v(&send, &send_counts, &recv_counts)?;
        let summed = if self.rs_width > 0 { self.pg.reduce_scatter_f32(&rs_in, &rs_counts)? } else { Vec::new() };
        // Two stages for the partial sums of row blocks on one host: within the host, to the
        // rank of each source's local rank, which adds them up; then to the source.
        let stage = TwoStage { ebc: self, src_bags };
        let mut s1 = Vec::new();
        let mut s1_counts = vec![0usize; world];
        for (a, count) in s1_counts.iter_mut().enumerate() {
            let start = s1.len();
            stage.for_each_held(me, a, |s, pi, js| {
                let (n, at0) = (self.partials[pi].cols.len(), s1.len());
                s1.resize(at0 + src_bags[s][self.partials[pi].output] * n, 0.0);
                for &j in js {
                    let c = self.route_cols[me][j];
                    for (i, row) in (off[j][s]..off[j][s] + bags[j][s]).enumerate() {
                        for (x, y) in s1[at0 + i * n..][..n].iter_mut().zip(&pooled[row * lw + c..][..n]) {
                            *x += y;
                        }
                    }
                }
            });
            *count = s1.len() - start;
        }
        let partial_sums = if self.partials.is_empty() {
            Vec::new()
        } else {
            let r1 = self.pg.all_to_all_v(&s1, &s1_counts, &stage.held_counts(me))?;
            let agg = stage.sum_by_source(&r1);
            let (s2, s2_counts) = stage.to_sources(&agg);
            let s2_recv: Vec<usize> = (0..world).map(|a| stage.floats_via(a, me, nbags)).collect();
            let got = self.pg.all_to_all_v(&s2, &s2_counts, &s2_recv)?;
            times.output_bytes += 4 * (s1.len() + s2.len());
            got
        };
        // Expand to the full batch: sample e reads its bag's row.
        let w = self.width;
        let mut out = vec![0f32; b * w];
        let mut place_cols = |output: usize, cols: Range<usize>, block: &[f32]| {
            let (dst, n) = (self.outputs[output].col + cols.start, cols.len());
            for e in 0..b {
                let bag = sample_bag[output].as_ref().map_or(e, |m| m[e]);
                for (x, y) in out[e * w + dst..][..n].iter_mut().zip(&block[bag * n..][..n]) {
                    *x += y;
                }
            }
        };
        let mut at = 0;
        for a in 0..world {
            for p in stage.parts_via(a, me) {
                let len = nbags[p.output] * p.cols.len();
                place_cols(p.output, p.cols.clone(), &partial_sums[at..at + len]);
                at += len;
            }
        }
        let mut place = |r: &Route, block: &[f32]| {
            let shard = &self.shardings[r.table].shards[r.shard];
            place_cols(r.output, shard.cols.clone(), block);
        };
        let mut at = 0;
        for d in 0..world {
            for &j in &self.a2a[d] {
                let r = &self.routes[d][j];
                let len = nbags[r.output] * width_of(self, r);
                place(r, &recv[at..at + len]);
                at += len;
            }
        }
        let mut at = 0;
        for &j in &self.rs {
            let r = &mine[j];
            let len = nbags[r.output] * width_of(self, r);
            place(r, &summed[at..at + len]);
            at += len;
        }
        times.output_dist = clock.elapsed().as_secs_f64();
        times.output_bytes += 4 * (send.len() + rs_in.len());

        // Data-parallel tables: local lookups on the local (full) batch.
        let clock = std::time::Instant::now();
        let dp_kjt = if let Some(dp) = &self.dp {
            let mut unique: Vec<&str> = Vec::new();
            for &o in &self.dp_outputs {
                if !unique.contains(&self.outputs[o].input.as_str()) {
                    unique.push(self.outputs[o].input.as_str());
                }
            }
            let k = kjt.select_keys(&unique).and_then(|k| k.expand_vbe()).map_err(module)?;
            let pw = dp.width();
            let mut vals = vec![0f32; k.stride() * pw];
            crate::local::lookup(dp.as_ref(), &k, &mut vals)?;
            let mut c = 0;
            for &o in &self.dp_outputs {
                let dim = self.tables[self.outputs[o].table].dim;
                for e in 0..b {
                    out[e * w + self.outputs[o].col..][..dim].copy_from_slice(&vals[e * pw + c..][..dim]);
                }
                c += dim;
            }
            Some(k)
        } else {
            None
        };
        times.lookup += clock.elapsed().as_secs_f64();

        // Mean pooling of sharded tables: the sum over the bag's ids, divided by their count.
        let mut mean_scale = vec![Vec::new(); self.outputs.len()];
        for (oi, o) in self.outputs.iter().enumerate() {
            if !o.mean || self.shardings[o.table].sharding_type == ShardingType::DataParallel {
                continue;
            }
            let f = kjt.feature(keys[oi]);
            let dim = self.tables[o.table].dim;
            let scale: Vec<f32> = (0..b)
                .map(|e| {
                    let l = f.lengths[sample_bag[oi].as_ref().map_or(e, |m| m[e])];
                    if l > 0 { 1.0 / l as f32 } else { 1.0 }
                })
                .collect();
            for (e, s) in scale.iter().enumerate() {
                for x in &mut out[e * w + o.col..][..dim] {
                    *x *= s;
                }
            }
            mean_scale[oi] = scale;
        }
        let mut input = staged;
        input.times = times;
        Ok((out, DistContext { input, mean_scale, dp_kjt }))
    }

    /// Backward fused with the optimizer, from the gradient of this rank's `[B, width]` output
    /// (the reverse of the output dist, then each shard's fused update over the global batch).
    /// Collective. Returns the whole step's phase times (the forward's and the backward's).
    pub fn backward_and_update(&mut self, ctx: DistContext, grad: &[f32]) -> Result<StepTimes, DistError> {
        let (world, me) = (self.pg.world_size(), self.pg.rank());
        let b = ctx.input.batch_sizes[me];
        let w = self.width;
        if grad.len() != b * w {
            return Err(DistError::Module(format!(
                "gradient has {} floats, expected batch {b} x width {w}",
                grad.len()
            )));
        }
        let mut times = ctx.input.times;
        let clock = std::time::Instant::now();
        // A route's gradient per bag here: the sum over the samples reading that bag (times
        // 1/ids for mean pooling), `[bags, shard width]`.
        let grad_cols = |output: usize, cols: Range<usize>, into: &mut Vec<f32>| {
            let (c, n) = (self.outputs[output].col + cols.start, cols.len());
            let start = into.len();
            into.resize(start + ctx.input.nbags[output] * n, 0.0);
            let dst = &mut into[start..];
            for e in 0..b {
                let bag = ctx.input.sample_bag[output].as_ref().map_or(e, |m| m[e]);
                let scale = ctx.mean_scale[output].get(e).copied().unwrap_or(1.0);
                for (x, g) in dst[bag * n..][..n].iter_mut().zip(&grad[e * w + c..][..n]) {
                    *x += g * scale;
                }
            }
        };
        let grad_of = |r: &Route, into: &mut Vec<f32>| {
            grad_cols(r.output, self.shardings[r.table].shards[r.shard].cols.clone(), into);
        };
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; world];
        for (d, count) in send_counts.iter_mut().enumerate() {
            let start = send.len();
            for &j in &self.a2a[d] {
                grad_of(&self.routes[d][j], &mut send);
            }
            *count = send.len() - start;
        }
        let mine = &self.routes[me];
        let lw = self.local_width[me];
        let recv_counts: Vec<usize> = (0..world)
            .map(|s| self.a2a[me].iter().map(|&j| ctx.input.bags[j][s] * width_of(self, &mine[j])).sum())
            .collect();
        let recv = self.pg.all_to_all_v(&send, &send_counts, &recv_counts)?;
        let gathered = if self.rs_width > 0 {
            let mut local = Vec::new();
            for &j in &self.rs {
                grad_of(&mine[j], &mut local);
            }
            let counts: Vec<usize> = (0..world)
                .map(|s| self.rs.iter().map(|&j| ctx.input.bags[j][s] * width_of(self, &mine[j])).sum())
                .collect();
            self.pg.all_gather_v(&local, &counts)?
        } else {
            Vec::new()
        };
        // The local gradient `[stride, local width]`, in the local KJT's bag order.
        let mut local_grad = vec![0f32; ctx.input.stride * lw];
        let mut put = |j: usize, s: usize, block: &[f32]| {
            let (c, n) = (self.route_cols[me][j], width_of(self, &mine[j]));
            for (i, row) in (ctx.input.off[j][s]..ctx.input.off[j][s] + ctx.input.bags[j][s]).enumerate() {
                local_grad[row * lw + c..][..n].copy_from_slice(&block[i * n..][..n]);
            }
        };
        let mut at = 0;
        for s in 0..world {
            for &j in &self.a2a[me] {
                let len = ctx.input.bags[j][s] * width_of(self, &mine[j]);
                put(j, s, &recv[at..at + len]);
                at += len;
            }
        }
        let mut at = 0;
        for s in 0..world {
            for &j in &self.rs {
                let len = ctx.input.bags[j][s] * width_of(self, &mine[j]);
                put(j, s, &gathered[at..at + len]);
                at += len;
            }
        }
        if !self.partials.is_empty() {
            // The partial sums' two stages backwards: each source's gradient to the rank of
            // its local rank on the partial's host, which hands it to every rank holding a
            // block of the partial.
            let stage = TwoStage { ebc: self, src_bags: &ctx.input.src_bags };
            let mut s2 = Vec::new();
            let mut s2_counts = vec![0usize; world];
            for (a, count) in s2_counts.iter_mut().enumerate() {
                let start = s2.len();
                for p in stage.parts_via(a, me) {
                    grad_cols(p.output, p.cols.clone(), &mut s2);
                }
                *count = s2.len() - start;
            }
            let r2_counts = stage.to_sources_counts();
            let r2 = self.pg.all_to_all_v(&s2, &s2_counts, &r2_counts)?;
            let gsum = stage.by_source(&r2);
            let mut s1 = Vec::new();
            let mut s1_counts = vec![0usize; world];
            for (d, count) in s1_counts.iter_mut().enumerate() {
                let start = s1.len();
                stage.for_each_held(d, me, |s, pi, _| s1.extend_from_slice(&gsum[&(s, pi)]));
                *count = s1.len() - start;
            }
            let r1 = self.pg.all_to_all_v(&s1, &s1_counts, &stage.held_counts_back(me))?;
            let mut at = 0;
            for a in 0..world {
                stage.for_each_held(me, a, |s, pi, js| {
                    let len = ctx.input.src_bags[s][self.partials[pi].output] * self.partials[pi].cols.len();
                    for &j in js {
                        put(j, s, &r1[at..at + len]);
                    }
                    at += len;
                });
            }
        }
        times.grad_dist = clock.elapsed().as_secs_f64();
        let clock = std::time::Instant::now();
        if let (Some(local), Some(k)) = (&mut self.local, &ctx.input.local_kjt) {
            crate::local::update(local.as_mut(), k, &local_grad)?;
        }
        times.update = clock.elapsed().as_secs_f64();

        if let (Some(dp), Some(k)) = (&mut self.dp, &ctx.dp_kjt) {
            let clock = std::time::Instant::now();
            // Every replica applies the global batch's update: gather ids and gradients.
            let dw: usize = self.dp_outputs.iter().map(|&o| self.tables[self.outputs[o].table].dim).sum();
            let mut g = Vec::with_capacity(b * dw);
            for e in 0..b {
                for &o in &self.dp_outputs {
                    let dim = self.tables[self.outputs[o].table].dim;
                    g.extend_from_slice(&grad[e * w + self.outputs[o].col..][..dim]);
                }
            }
            let sizes = self.pg.all_gather_u64(k.values().len() as u64)?;
            let vcounts: Vec<usize> = sizes.iter().map(|&n| n as usize).collect();
            let nkeys = k.keys().len();
            let lcounts: Vec<usize> = ctx.input.batch_sizes.iter().map(|&bs| bs * nkeys).collect();
            let gcounts: Vec<usize> = ctx.input.batch_sizes.iter().map(|&bs| bs * dw).collect();
            let lengths = self.pg.all_gather_v(k.lengths(), &lcounts)?;
            let values = self.pg.all_gather_v(k.values(), &vcounts)?;
            let weights = match k.weights() {
                Some(wts) => Some(self.pg.all_gather_v(wts, &vcounts)?),
                None => None,
            };
            let grads = self.pg.all_gather_v(&g, &gcounts)?;
            let total: usize = ctx.input.batch_sizes.iter().sum();
            let per_key = vec![ctx.input.batch_sizes.clone(); k.keys().len()];
            let global = merge_by_source(k.keys().to_vec(), &per_key, &lengths, &values, weights.as_deref(), total)?;
            times.grad_dist += clock.elapsed().as_secs_f64();
            let clock = std::time::Instant::now();
            crate::local::update(dp.as_mut(), &global, &grads)?;
            times.update += clock.elapsed().as_secs_f64();
        }
        Ok(times)
    }
}
