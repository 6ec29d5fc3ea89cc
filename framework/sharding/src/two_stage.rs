//! The two-stage output dist of row blocks that sit on one host (TorchRec's table-row-wise
//! output dist): partial sums added by the host's rank of each source's local rank, then sent
//! to the source; and the reassembly of rows received from every source.

use trainrec_comm::DistError;
use trainrec_sparse::KeyedJaggedTensor;

use crate::ebc::ShardedEbc;
use crate::layout::{Partial, Route};
use crate::module;

/// The bookkeeping of the two-stage output dist on one rank of one step: who sends which
/// partial sums of which sources to whom, in one order every rank agrees on.
pub(crate) struct TwoStage<'a> {
    pub(crate) ebc: &'a ShardedEbc,
    /// `src_bags[s][o]`: bags of output `o` on rank `s`.
    pub(crate) src_bags: &'a [Vec<usize>],
}

impl TwoStage<'_> {
    pub(crate) fn host(&self, r: usize) -> usize {
        r / self.ebc.local_world
    }

    /// The sources whose partial sums rank `a` adds up on its host: those of its local rank.
    pub(crate) fn sources_of(&self, a: usize) -> impl Iterator<Item = usize> + use<> {
        let (l, world) = (self.ebc.local_world, self.ebc.pg.world_size());
        (0..world).filter(move |s| s % l == a % l)
    }

    /// Stage one from shard holder `d` to aggregator `a` (same host): for each source of
    /// `a`, for each partial `d` holds, `f(source, partial, d's routes of it)`.
    pub(crate) fn for_each_held(&self, d: usize, a: usize, mut f: impl FnMut(usize, usize, &[usize])) {
        if self.host(d) != self.host(a) {
            return;
        }
        for s in self.sources_of(a) {
            for (pi, js) in &self.ebc.held[d] {
                f(s, *pi, js);
            }
        }
    }

    pub(crate) fn rows(&self, s: usize, pi: usize) -> usize {
        let p = &self.ebc.partials[pi];
        self.src_bags[s][p.output] * p.cols.len()
    }

    /// Floats aggregator `me` gets in stage one from each rank.
    pub(crate) fn held_counts(&self, me: usize) -> Vec<usize> {
        (0..self.ebc.pg.world_size())
            .map(|d| {
                let mut n = 0;
                self.for_each_held(d, me, |s, pi, _| n += self.rows(s, pi));
                n
            })
            .collect()
    }

    /// Backwards, floats shard holder `me` gets in stage one from each aggregator.
    pub(crate) fn held_counts_back(&self, me: usize) -> Vec<usize> {
        (0..self.ebc.pg.world_size())
            .map(|a| {
                let mut n = 0;
                self.for_each_held(me, a, |s, pi, _| n += self.rows(s, pi));
                n
            })
            .collect()
    }

    /// The partials rank `a` sums on its host, in order.
    pub(crate) fn parts_here(&self, a: usize) -> impl Iterator<Item = (usize, &Partial)> {
        let h = self.host(a);
        self.ebc.partials.iter().enumerate().filter(move |(_, p)| p.host == h)
    }

    /// What source `s` gets from (or, backwards, sends to) aggregator `a`: the partials of
    /// `a`'s host when `a` has `s`'s local rank.
    pub(crate) fn parts_via(&self, a: usize, s: usize) -> Vec<&Partial> {
        let l = self.ebc.local_world;
        if a % l != s % l {
            return Vec::new();
        }
        self.parts_here(a).map(|(_, p)| p).collect()
    }

    /// Stage one's received blocks (from every rank of this host) summed per (source, partial).
    pub(crate) fn sum_by_source(&self, r1: &[f32]) -> std::collections::BTreeMap<(usize, usize), Vec<f32>> {
        let me = self.ebc.pg.rank();
        let mut agg: std::collections::BTreeMap<(usize, usize), Vec<f32>> = std::collections::BTreeMap::new();
        let mut at = 0;
        for d in 0..self.ebc.pg.world_size() {
            self.for_each_held(d, me, |s, pi, _| {
                let len = self.rows(s, pi);
                let acc = agg.entry((s, pi)).or_insert_with(|| vec![0.0; len]);
                acc.iter_mut().zip(&r1[at..at + len]).for_each(|(x, y)| *x += y);
                at += len;
            });
        }
        agg
    }

    /// Stage two: to each source of this rank, the sums of this host's partials.
    pub(crate) fn to_sources(
        &self,
        agg: &std::collections::BTreeMap<(usize, usize), Vec<f32>>,
    ) -> (Vec<f32>, Vec<usize>) {
        let me = self.ebc.pg.rank();
        let mut send = Vec::new();
        let mut counts = vec![0usize; self.ebc.pg.world_size()];
        for s in self.sources_of(me) {
            let start = send.len();
            for (pi, _) in self.parts_here(me) {
                match agg.get(&(s, pi)) {
                    Some(v) => send.extend_from_slice(v),
                    None => send.extend(std::iter::repeat_n(0.0, self.rows(s, pi))),
                }
            }
            counts[s] = send.len() - start;
        }
        (send, counts)
    }

    /// Floats source `s` gets from aggregator `a` in stage two (`nbags`: `s`'s bags per output).
    pub(crate) fn floats_via(&self, a: usize, s: usize, nbags: &[usize]) -> usize {
        self.parts_via(a, s).iter().map(|p| nbags[p.output] * p.cols.len()).sum()
    }

    /// Backwards, floats this aggregator gets from each of its sources.
    pub(crate) fn to_sources_counts(&self) -> Vec<usize> {
        let me = self.ebc.pg.rank();
        let mut counts = vec![0usize; self.ebc.pg.world_size()];
        for s in self.sources_of(me) {
            counts[s] = self.parts_here(me).map(|(pi, _)| self.rows(s, pi)).sum();
        }
        counts
    }

    /// Backwards, the sources' gradient blocks by (source, partial).
    pub(crate) fn by_source(&self, r2: &[f32]) -> std::collections::BTreeMap<(usize, usize), Vec<f32>> {
        let me = self.ebc.pg.rank();
        let mut out = std::collections::BTreeMap::new();
        let mut at = 0;
        for s in self.sources_of(me) {
            for (pi, _) in self.parts_here(me) {
                let len = self.rows(s, pi);
                out.insert((s, pi), r2[at..at + len].to_vec());
                at += len;
            }
        }
        out
    }
}

/// Columns of a route: its shard's width.
pub(crate) fn width_of(ebc: &ShardedEbc, r: &Route) -> usize {
    ebc.shardings[r.table].shards[r.shard].cols.len()
}

/// One KJT from every source's part, sources in rank order. Source `s`'s part is its bag
/// lengths (key-major: `bags[k][s]` bags of key `k`) and the ids (and weights) those lengths
/// cover, the parts concatenated. Key `k` gets every source's bags in rank order, padded with
/// empty bags to `stride`.
pub(crate) fn merge_by_source(
    keys: Vec<String>,
    bags: &[Vec<usize>],
    lengths: &[u32],
    values: &[i64],
    weights: Option<&[f32]>,
    stride: usize,
) -> Result<KeyedJaggedTensor, DistError> {
    let world = bags.first().map_or(0, Vec::len);
    // Where each source's lengths and ids start.
    let (mut len_at, mut val_at) = (vec![0usize; world], vec![0usize; world]);
    let (mut la, mut va) = (0, 0);
    for s in 0..world {
        len_at[s] = la;
        val_at[s] = va;
        let n: usize = bags.iter().map(|bs| bs[s]).sum();
        va += lengths[la..la + n].iter().map(|&x| x as usize).sum::<usize>();
        la += n;
    }
    let (mut lens, mut vals, mut ws) = (Vec::new(), Vec::new(), Vec::new());
    for bs in bags {
        for s in 0..world {
            let l = &lengths[len_at[s]..len_at[s] + bs[s]];
            let n: usize = l.iter().map(|&x| x as usize).sum();
            lens.extend_from_slice(l);
            vals.extend_from_slice(&values[val_at[s]..val_at[s] + n]);
            if let Some(w) = weights {
                ws.extend_from_slice(&w[val_at[s]..val_at[s] + n]);
            }
            len_at[s] += bs[s];
            val_at[s] += n;
        }
        lens.extend(std::iter::repeat_n(0, stride - bs.iter().sum::<usize>()));
    }
    KeyedJaggedTensor::new(keys, vals, weights.map(|_| ws), lens, stride).map_err(module)
}
