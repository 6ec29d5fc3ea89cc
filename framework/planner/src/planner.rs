//! The planner: reservation, enumeration, proposals, partitioning, the best plan, and why.
use std::collections::HashMap;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::PlanError;
use crate::enumerate::enumerate;
use crate::estimate::{Estimator, TableInputs, shard_layout};
use crate::partition::{
    Assignment, PartitionFailure, PartitionerKind, beyond, offsets, partition, rate, rating_lower_bound,
};
use crate::propose::{Greedy, Proposal, ProposerKind, Space, cached_tables, grid, uniform};
use crate::types::defaults::*;
use crate::types::{
    ComputeDevice, ComputeKernel, CostModel, Perf, ShardingOption, ShardingType, Storage, TableSpec, Topology,
};

/// Planner settings (the recipe's `[planner]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Which proposers run.
    pub proposer: ProposerKind,
    /// Greedy early stop: proposals without improvement before stopping.
    pub early_stop_threshold: Option<u32>,
    /// How shards are placed.
    pub partitioner: PartitionerKind,
    /// Share of each rank's table memory kept free (TorchRec's heuristic reservation: 0.15).
    pub reserved_percentage: f64,
    /// Bytes per rank the dense model needs (parameters × 6 for gradients and optimizer).
    pub dense_bytes: u64,
    /// Estimator formulas.
    pub cost_model: CostModel,
    /// Examples per rank per step.
    pub batch_size: u64,
    /// After the proposers, improve the best plan one table at a time (every other option
    /// of each table, kept when the slowest rank gets faster) until no change helps, when the
    /// search space has at most [`REFINE_MAX_OPTIONS`] options.
    pub refine: bool,
}

/// Largest search space (options over all tables) that [`PlannerConfig::refine`] walks.
pub const REFINE_MAX_OPTIONS: usize = 20_000;

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            proposer: ProposerKind::Default,
            early_stop_threshold: None,
            partitioner: PartitionerKind::GreedyPerf,
            reserved_percentage: RESERVED_PERCENTAGE,
            dense_bytes: 0,
            cost_model: CostModel::Trainrec,
            batch_size: BATCH_SIZE,
            refine: true,
        }
    }
}

/// Everything a plan depends on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanInput {
    /// The tables, with their constraints.
    pub tables: Vec<TableSpec>,
    /// The machines.
    pub topology: Topology,
    /// Planner settings.
    pub config: PlannerConfig,
}

impl PlanInput {
    /// SHA-256 (hex, 16 digits) of the inputs; a saved plan records it.
    pub fn hash(&self) -> String {
        let json = serde_json::to_vec(self).expect("plan inputs serialize");
        let digest = Sha256::digest(&json);
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }
}

/// One shard's place in a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacedShard {
    /// Rank holding the shard.
    pub rank: usize,
    /// `[rows, columns]`.
    pub size: [u64; 2],
    /// `[first row, first column]`.
    pub offset: [u64; 2],
    /// Estimated time per step.
    pub perf: Perf,
    /// Estimated memory.
    pub storage: Storage,
}

/// The best alternative to a table's chosen option.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunnerUp {
    /// Its sharding type.
    pub sharding_type: ShardingType,
    /// Its kernel.
    pub compute_kernel: ComputeKernel,
    /// Its cache load factor.
    #[serde(default)]
    pub cache_load_factor: Option<f64>,
    /// The plan's slowest rank with it instead (ms); `None` when no alternative fits.
    pub max_rank_perf: Option<f64>,
    /// Why the chosen option won, in words.
    pub reason: String,
}

/// One table's part of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TablePlan {
    /// Table name.
    pub name: String,
    /// Sharding type.
    pub sharding_type: ShardingType,
    /// Kernel.
    pub compute_kernel: ComputeKernel,
    /// Cache load factor of a cached kernel.
    pub cache_load_factor: Option<f64>,
    /// The shards.
    pub shards: Vec<PlacedShard>,
    /// The best alternative (filled by `explain`).
    #[serde(default)]
    pub runner_up: Option<RunnerUp>,
}

/// One rank's totals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStats {
    /// Rank.
    pub rank: usize,
    /// Memory used by shards.
    pub used: Storage,
    /// Memory available to shards after reservation.
    pub available: Storage,
    /// Estimated time per step (ms).
    pub perf: f64,
    /// Shards on the rank.
    pub shards: usize,
}

/// A sharding plan (saved as `plan.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// File format version.
    pub version: u32,
    /// [`PlanInput::hash`] of the inputs it was made for.
    pub inputs_hash: String,
    /// Ranks.
    pub world_size: usize,
    /// Cost model of the estimates.
    pub cost_model: CostModel,
    /// The slowest rank's estimated time per step (ms): what the planner minimises.
    pub max_rank_perf: f64,
    /// Per-rank totals.
    pub ranks: Vec<RankStats>,
    /// Per-table placement.
    pub tables: Vec<TablePlan>,
    /// Proposals evaluated.
    pub num_proposals: usize,
    /// Proposals that fit.
    pub num_plans: usize,
    /// Proposals whose placement stopped early, slower than the best so far.
    #[serde(default)]
    pub num_pruned: usize,
}

/// Per-rank capacity after the heuristic reservation (percentage, dense model, KJT buffers).
pub fn reserve(input: &PlanInput) -> Result<Vec<Storage>, PlanError> {
    let t = &input.topology;
    let c = &input.config;
    let pct = c.reserved_percentage;
    let cuda = t.compute_device == ComputeDevice::Cuda;
    let mut ids = 0.0;
    for table in &input.tables {
        let inputs = TableInputs::of(table, c.batch_size, c.cost_model);
        for i in 0..inputs.input_lengths.len() {
            ids += inputs.input_lengths[i] * inputs.batch_sizes[i];
        }
    }
    let kjt = (ids * BIGINT_DTYPE).ceil() as u64 * KJT_MULTIPLIER;
    let hbm = ((1.0 - pct) * t.hbm_cap as f64) as u64;
    // TorchRec keeps the percentage of HBM only; on CPU trainrec keeps it of DDR, where the
    // tables (and everything else) live.
    let ddr =
        if !cuda && c.cost_model == CostModel::Trainrec { ((1.0 - pct) * t.ddr_cap as f64) as u64 } else { t.ddr_cap };
    let reserved = c.dense_bytes + kjt;
    let (have, what) = if cuda { (hbm, "HBM") } else { (ddr, "DDR") };
    if reserved > have {
        return Err(PlanError::Reservation {
            message: format!(
                "each rank has {:.3} GiB of {what} after keeping {:.0}% free, but the dense model needs {:.3} GiB and the \
                 KJT buffers {:.3} GiB; lower `planner.reserved_percentage`, `data.batch_size` or the dense model size, or \
                 raise `topology.{}`",
                gib(have),
                pct * 100.0,
                gib(c.dense_bytes),
                gib(kjt),
                if cuda { "hbm_gib" } else { "ddr_gib" }
            ),
        });
    }
    let cap = if cuda {
        Storage { hbm: hbm - reserved, ddr, ssd: t.ssd_cap }
    } else {
        Storage { hbm: 0, ddr: ddr - reserved, ssd: t.ssd_cap }
    };
    Ok(vec![cap; t.world_size])
}

/// Bytes as B / KiB / MiB / GiB.
pub(crate) fn human(b: u64) -> String {
    let b = b as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / 1024.0 / 1024.0)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

pub(crate) fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// Checks the topology and planner settings on their own.
pub fn check_topology(t: &Topology, c: &PlannerConfig) -> Result<(), PlanError> {
    let bad = |key: &str, message: String| Err(PlanError::Topology { key: key.into(), message });
    if t.world_size == 0 {
        return bad("world_size", "must be at least 1".into());
    }
    if t.local_world_size == 0 || !t.world_size.is_multiple_of(t.local_world_size) {
        return bad(
            "local_world_size",
            format!("is {} but must divide world_size = {} (ranks per host)", t.local_world_size, t.world_size),
        );
    }
    for (key, v) in [
        ("hbm_bandwidth", t.hbm_mem_bw),
        ("ddr_bandwidth", t.ddr_mem_bw),
        ("ssd_bandwidth", t.ssd_mem_bw),
        ("hbm_to_ddr_bandwidth", t.hbm_to_ddr_mem_bw),
        ("intra_host_bandwidth", t.intra_host_bw),
        ("inter_host_bandwidth", t.inter_host_bw),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return bad(key, format!("is {v}; a bandwidth (GiB/s) must be positive"));
        }
    }
    if !(0.0..1.0).contains(&c.reserved_percentage) {
        return Err(PlanError::Topology {
            key: "planner.reserved_percentage".into(),
            message: format!("is {}; it must lie in [0, 1)", c.reserved_percentage),
        });
    }
    if c.batch_size == 0 {
        return bad("batch_size", "must be at least 1".into());
    }
    Ok(())
}

/// What became of an evaluated proposal.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Outcome {
    /// Placed; its slowest rank's time.
    Fit(f64),
    /// Some shard fits nowhere.
    NoFit,
    /// Stopped once a rank was slower than the best plan found before it.
    Pruned,
}

/// A 128-bit fingerprint of table `t`'s option `i`: two splitmix64 finalisers of different
/// seeds. A proposal's fingerprint ([`Search::key`]) is the wrapping sum of its options', so one
/// table's change updates it in O(1) (the greedy proposer's proposals differ by one table); the
/// cache keeps these, not the proposals (60,000 proposals of 2,000 tables would be half a
/// gigabyte).
fn option_key(t: usize, i: usize) -> u128 {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let x = ((t as u64) << 32) | i as u64;
    let a = mix(x.wrapping_add(0x243f_6a88_85a3_08d3).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let b = mix(x.wrapping_add(0x1319_8a2e_0370_7344).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ a);
    ((a as u128) << 64) | b as u128
}

/// A proposal's fingerprint: the wrapping sum of its options' `keys` ([`option_key`]).
fn fingerprint(keys: &[Vec<u128>], p: &Proposal) -> u128 {
    p.iter().enumerate().fold(0u128, |k, (t, &i)| k.wrapping_add(keys[t][i as usize]))
}

/// A proposal's shards' memory, summed from its options' `totals`.
fn memory(totals: &[Vec<Storage>], p: &Proposal) -> Storage {
    p.iter().enumerate().map(|(t, &i)| &totals[t][i as usize]).sum()
}

/// A proposal with its fingerprint and its shards' memory, summed.
struct Candidate {
    proposal: Proposal,
    key: u128,
    total: Storage,
}

/// The evaluation state shared by the proposers.
struct Search<'a> {
    input: &'a PlanInput,
    caps: Vec<Storage>,
    space: Space,
    /// Per option: (Σ shard times, slowest shard time).
    scores: Vec<Vec<(f64, f64)>>,
    /// Per option: its shards' memory, summed.
    totals: Vec<Vec<Storage>>,
    /// Per option: [`option_key`].
    option_keys: Vec<Vec<u128>>,
    /// Every rank's capacity, summed: a proposal needing more cannot be placed.
    capacity: Storage,
    /// Outcomes by [`fingerprint`] of the proposal.
    cache: HashMap<u128, Outcome>,
    best: Option<(Proposal, Assignment, f64)>,
    num_proposals: usize,
    num_plans: usize,
    num_pruned: usize,
    /// The last proposal that could not be placed (its failure is recomputed for the error
    /// when no plan fits: most proposals are turned down by their total memory alone).
    last_no_fit: Option<Proposal>,
    lowest_storage: Option<Storage>,
}

impl Search<'_> {
    fn options<'s>(&'s self, p: &Proposal) -> Vec<&'s ShardingOption> {
        p.iter().enumerate().map(|(t, &i)| &self.space[t][i as usize]).collect()
    }

    fn candidate(&self, proposal: Proposal) -> Candidate {
        Candidate { key: fingerprint(&self.option_keys, &proposal), total: memory(&self.totals, &proposal), proposal }
    }

    fn try_partition(&self, c: &Candidate, bound: Option<f64>) -> Result<(Assignment, f64), PartitionFailure> {
        // More memory than all ranks together have: no placement fits (the partitioner would
        // find that out shard by shard, at length). The error when nothing fits re-partitions
        // the last such proposal for its message.
        if !c.total.fits_in(&self.capacity) {
            return Err(PartitionFailure { table: 0, pruned: false, message: "exceeds the ranks' memory".into() });
        }
        self.partition_bounded(&c.proposal, bound)
    }

    fn partition_bounded(&self, p: &Proposal, bound: Option<f64>) -> Result<(Assignment, f64), PartitionFailure> {
        if let Some(b) = bound {
            let (mut sum, mut max) = (0.0, 0.0f64);
            for (t, &i) in p.iter().enumerate() {
                let (s, m) = self.scores[t][i as usize];
                sum += s;
                max = max.max(m);
            }
            if beyond(rating_lower_bound(sum, max, self.input.topology.world_size), b) {
                return Err(PartitionFailure {
                    table: 0,
                    pruned: true,
                    message: "slower than the best plan so far".into(),
                });
            }
        }
        let opts = self.options(p);
        let a = partition(self.input.config.partitioner, &opts, &self.caps, &self.input.topology, bound)?;
        let r = rate(&opts, &a, self.input.topology.world_size);
        Ok((a, r))
    }

    fn record(&mut self, c: Candidate, result: Result<(Assignment, f64), PartitionFailure>) -> Option<f64> {
        self.num_proposals += 1;
        let Candidate { proposal: p, key, total } = c;
        match result {
            Ok((a, r)) => {
                self.num_plans += 1;
                self.cache.insert(key, Outcome::Fit(r));
                if self.best.as_ref().is_none_or(|b| r < b.2) {
                    self.best = Some((p, a, r));
                }
                Some(r)
            }
            Err(e) if e.pruned => {
                self.num_pruned += 1;
                self.cache.insert(key, Outcome::Pruned);
                None
            }
            Err(_) => {
                if self.lowest_storage.is_none_or(|l| total < l) {
                    self.lowest_storage = Some(total);
                }
                self.cache.insert(key, Outcome::NoFit);
                self.last_no_fit = Some(p);
                None
            }
        }
    }

    /// Evaluates one proposal fully (cached), returning its rating when it fits: for proposers
    /// whose next proposal depends on the rating.
    fn evaluate(&mut self, p: Proposal) -> Option<f64> {
        let c = self.candidate(p);
        match self.cache.get(&c.key) {
            Some(Outcome::Fit(r)) => return Some(*r),
            Some(Outcome::NoFit) => return None,
            Some(Outcome::Pruned) => {
                self.num_pruned -= 1;
                self.num_proposals -= 1;
            }
            None => {}
        }
        let result = self.try_partition(&c, None);
        self.record(c, result)
    }

    /// Evaluates a fixed list of proposals in order, partitioning chunks of new ones in
    /// parallel; each chunk is pruned against the best plan found before it. The best plan
    /// is the same as evaluating one by one: a pruned proposal is slower than one seen earlier.
    fn evaluate_all(&mut self, ps: impl IntoIterator<Item = Proposal>) {
        let candidates: Vec<Candidate> = ps.into_iter().map(|p| self.candidate(p)).collect();
        self.evaluate_candidates(candidates);
    }

    /// [`Search::evaluate_all`] of proposals whose fingerprints and memory are known.
    fn evaluate_candidates(&mut self, cs: impl IntoIterator<Item = Candidate>) {
        let chunk = 16 * rayon::current_num_threads().max(1);
        let mut cs = cs.into_iter().peekable();
        while cs.peek().is_some() {
            let mut batch: Vec<Candidate> = Vec::with_capacity(chunk);
            let mut keys = std::collections::HashSet::new();
            for c in cs.by_ref() {
                if !self.cache.contains_key(&c.key) && keys.insert(c.key) {
                    batch.push(c);
                    if batch.len() == chunk {
                        break;
                    }
                }
            }
            let bound = self.best.as_ref().map(|b| b.2);
            let results: Vec<_> = batch.par_iter().map(|c| self.try_partition(c, bound)).collect();
            for (c, r) in batch.into_iter().zip(results) {
                self.record(c, r);
            }
        }
    }

    fn greedy(&mut self, use_depth: bool) {
        let mut g = Greedy::new(&self.space, use_depth, self.input.config.early_stop_threshold);
        if g.adaptive() {
            while let Some(p) = g.propose() {
                let r = self.evaluate(p);
                g.feedback(r);
            }
        } else {
            // Consecutive proposals differ in one table: their fingerprints and memory follow
            // in O(1) from the previous one's.
            let mut running: Option<(u128, Storage)> = None;
            // Copies (a few MB at most): the stream is consumed while the search records.
            let (option_keys, totals) = (self.option_keys.clone(), self.totals.clone());
            let candidates = std::iter::from_fn(|| {
                let proposal = g.propose()?;
                let (key, total) =
                    running.unwrap_or_else(|| (fingerprint(&option_keys, &proposal), memory(&totals, &proposal)));
                if let Some((t, from, to)) = g.feedback(None) {
                    let (from, to) = (from as usize, to as usize);
                    let next_key = key.wrapping_sub(option_keys[t][from]).wrapping_add(option_keys[t][to]);
                    let next_total = total.minus(&totals[t][from]).plus(&totals[t][to]);
                    running = Some((next_key, next_total));
                }
                Some(Candidate { proposal, key, total })
            });
            self.evaluate_candidates(candidates);
        }
    }

    /// Local search from the best plan: for each table in turn, every other option of it
    /// with the rest unchanged; a better plan becomes the base. Stops after a pass without
    /// improvement (at most 4 passes).
    fn refine(&mut self) {
        for _ in 0..4 {
            let Some(start) = self.best.as_ref().map(|b| b.2) else { return };
            for t in 0..self.space.len() {
                let Some(base) = self.best.as_ref().map(|b| b.0.clone()) else { return };
                let alternatives: Vec<Proposal> = (0..self.space[t].len() as u32)
                    .filter(|&i| i != base[t])
                    .map(|i| {
                        let mut p = base.clone();
                        p[t] = i;
                        p
                    })
                    .collect();
                self.evaluate_all(alternatives);
            }
            if self.best.as_ref().map(|b| b.2) >= Some(start) {
                return;
            }
        }
    }

    /// Grows the cached tables' load factors into free memory: the largest budget (by
    /// bisection) whose plan still fits, shared by expected lookups. The cache's memory is HBM
    /// on GPUs and DDR on CPU (where the table behind it is on disk).
    fn offload_scaleup(&mut self) {
        let t = &self.input.topology;
        let cpu = t.compute_device == ComputeDevice::Cpu;
        let fast = move |s: &Storage| if cpu { s.ddr } else { s.hbm };
        // Start from the best plan so far (the greedy's); without one, from each table's
        // fastest cached option where it has one, else its fastest (TorchRec's start).
        let start: Proposal = match &self.best {
            Some((p, _, _)) => p.clone(),
            None => self
                .space
                .iter()
                .map(|opts| {
                    let best_of = |f: &dyn Fn(&ShardingOption) -> bool| {
                        opts.iter()
                            .enumerate()
                            .filter(|(_, o)| f(o))
                            .min_by(|a, b| a.1.max_shard_perf().total_cmp(&b.1.max_shard_perf()))
                            .map(|(i, _)| i as u32)
                    };
                    best_of(&|o| o.compute_kernel == ComputeKernel::FusedUvmCaching).or(best_of(&|_| true)).unwrap_or(0)
                })
                .collect(),
        };
        let cached = cached_tables(&self.space, &start);
        if cached.is_empty() || self.evaluate(start.clone()).is_none() {
            return;
        }
        let used: u64 = self.options(&start).iter().map(|o| fast(&o.total_storage())).sum();
        let avail: u64 = self.caps.iter().map(fast).sum::<u64>().saturating_sub(used);
        let est = Estimator { topo: t, cost_model: self.input.config.cost_model };
        // Affine memory model of each cached table in its load factor, and its fused size.
        let mut model = Vec::new();
        for &ti in &cached {
            let o = &self.space[ti][start[ti] as usize];
            let table = &self.input.tables[ti];
            let inputs = TableInputs::of(table, self.input.config.batch_size, self.input.config.cost_model);
            let layout = shard_layout(table, o.sharding_type, t);
            let hbm_at = |k: ComputeKernel, clf: Option<f64>| -> f64 {
                est.shards(table, &inputs, o.sharding_type, k, clf, &layout)
                    .map(|s| s.iter().map(|s| fast(&s.storage) as f64).sum())
                    .unwrap_or(f64::INFINITY)
            };
            let (lo, hi) =
                (hbm_at(ComputeKernel::FusedUvmCaching, Some(0.1)), hbm_at(ComputeKernel::FusedUvmCaching, Some(0.9)));
            let a = (hi - lo) / 0.8;
            let b = lo - a * 0.1;
            let fused_ok = table.constraints.compute_kernels.as_ref().is_none_or(|k| k.contains(&ComputeKernel::Fused));
            model.push((
                a,
                b,
                if fused_ok { hbm_at(ComputeKernel::Fused, None) } else { f64::INFINITY },
                crate::estimate::cache_ratio(o.cache_load_factor),
                inputs.batch_inputs(),
            ));
        }
        let need: f64 = model.iter().map(|m| (m.2 - (m.0 * m.3 + m.1)).max(0.0)).sum();
        let mut lo_budget = 0.0;
        let mut hi_budget = (avail as f64).min(need);
        for round in 0..16 {
            if hi_budget - lo_budget < (1 << 20) as f64 {
                break;
            }
            // Try the whole budget first, then bisect.
            let budget = if round == 0 { hi_budget } else { (lo_budget + hi_budget) / 2.0 };
            let clfs = allocate(&model, budget);
            let p = self.scaled_proposal(&start, &cached, &clfs);
            if self.evaluate(p).is_some() {
                lo_budget = budget;
                if budget == hi_budget {
                    break;
                }
            } else {
                hi_budget = budget;
            }
        }
    }

    /// `start` with the cached tables' load factors set to `clfs` (a factor near 1 becomes
    /// the fused kernel), appending the re-estimated options to the search space.
    fn scaled_proposal(&mut self, start: &Proposal, cached: &[usize], clfs: &[f64]) -> Proposal {
        let mut p = start.clone();
        let t = &self.input.topology;
        let est = Estimator { topo: t, cost_model: self.input.config.cost_model };
        for (&ti, &clf) in cached.iter().zip(clfs) {
            let base = self.space[ti][start[ti] as usize].clone();
            // A cache as large as the table becomes the fused kernel, where the table's
            // constraints allow it (else the cache grows to the whole table).
            let fused_ok = self.input.tables[ti]
                .constraints
                .compute_kernels
                .as_ref()
                .is_none_or(|k| k.contains(&ComputeKernel::Fused));
            let (kernel, clf) = if clf > 0.9999 && fused_ok {
                (ComputeKernel::Fused, None)
            } else {
                (ComputeKernel::FusedUvmCaching, Some(clf.min(1.0)))
            };
            if let Some(i) = self.space[ti].iter().position(|o| {
                o.sharding_type == base.sharding_type && o.compute_kernel == kernel && o.cache_load_factor == clf
            }) {
                p[ti] = i as u32;
                continue;
            }
            let table = &self.input.tables[ti];
            let inputs = TableInputs::of(table, self.input.config.batch_size, self.input.config.cost_model);
            let layout = shard_layout(table, base.sharding_type, t);
            if let Some(shards) = est.shards(table, &inputs, base.sharding_type, kernel, clf, &layout) {
                let o = ShardingOption { compute_kernel: kernel, cache_load_factor: clf, shards, ..base };
                self.scores[ti].push((o.sum_shard_perf(), o.max_shard_perf()));
                self.totals[ti].push(o.total_storage());
                self.option_keys[ti].push(option_key(ti, self.space[ti].len()));
                self.space[ti].push(o);
                p[ti] = (self.space[ti].len() - 1) as u32;
            }
        }
        p
    }
}

/// Shares `budget` bytes among cached tables by expected lookups, each up to its whole table
/// (TorchRec's `allocate_budget`). `model[i] = (bytes per unit load factor, fixed bytes, fused
/// bytes, starting load factor, expected lookups)`.
fn allocate(model: &[(f64, f64, f64, f64, f64)], mut budget: f64) -> Vec<f64> {
    let min: Vec<f64> = model.iter().map(|m| m.1).collect();
    let max: Vec<f64> = model.iter().map(|m| m.0 + m.1).collect();
    let mut cache: Vec<f64> = model.iter().map(|m| m.0 * m.3).collect();
    let max_cache: Vec<f64> = (0..model.len()).map(|i| max[i] - min[i]).collect();
    let mut passes = 0;
    while budget > 1.0 && passes < 128 {
        passes += 1;
        let open: Vec<bool> = (0..model.len()).map(|i| min[i] + cache[i] < max[i]).collect();
        let weight: f64 = (0..model.len()).filter(|&i| open[i]).map(|i| model[i].4).sum();
        if weight <= 0.0 {
            break;
        }
        // This pass's shares all come from the budget at its start.
        let pass_budget = budget;
        for i in 0..model.len() {
            if !open[i] {
                continue;
            }
            let new = (cache[i] + pass_budget * model[i].4 / weight).min(max_cache[i]);
            budget -= new - cache[i];
            cache[i] = new;
            if min[i] + cache[i] > model[i].2 {
                // Cheaper as a fused table: promote and give back the difference.
                budget += min[i] + cache[i] - model[i].2;
                cache[i] = max_cache[i];
            }
        }
    }
    (0..model.len()).map(|i| if max_cache[i] > 0.0 { cache[i] / max_cache[i] } else { 1.0 }).collect()
}

/// Plans the tables: the proposal whose slowest rank is fastest among those that fit.
pub fn plan(input: &PlanInput) -> Result<Plan, PlanError> {
    check_topology(&input.topology, &input.config)?;
    let caps = reserve(input)?;
    let c = &input.config;
    let space = enumerate(&input.tables, &input.topology, c.batch_size, c.cost_model)?;
    let scores = space.iter().map(|o| o.iter().map(|o| (o.sum_shard_perf(), o.max_shard_perf())).collect()).collect();
    let totals = space.iter().map(|o| o.iter().map(ShardingOption::total_storage).collect()).collect();
    let option_keys = space.iter().enumerate().map(|(t, o)| (0..o.len()).map(|i| option_key(t, i)).collect()).collect();
    let capacity = caps.iter().sum();
    let mut s = Search {
        input,
        caps,
        space,
        scores,
        totals,
        option_keys,
        capacity,
        cache: HashMap::new(),
        best: None,
        num_proposals: 0,
        num_plans: 0,
        num_pruned: 0,
        last_no_fit: None,
        lowest_storage: None,
    };
    if !input.tables.is_empty() {
        match c.proposer {
            ProposerKind::Default => {
                let g = grid(&s.space);
                s.evaluate_all(g);
                s.greedy(true);
                s.greedy(false);
                let u = uniform(&s.space);
                s.evaluate_all(u);
            }
            ProposerKind::Greedy => s.greedy(true),
            ProposerKind::Uniform => {
                let u = uniform(&s.space);
                s.evaluate_all(u);
            }
            ProposerKind::Grid => {
                let g = grid(&s.space);
                if g.is_empty() {
                    return Err(PlanError::Topology {
                        key: "planner.proposer".into(),
                        message: format!(
                            "grid search has more than {MAX_GRID_PROPOSALS} proposals for {} tables; use \"greedy\" or \"default\"",
                            input.tables.len()
                        ),
                    });
                }
                s.evaluate_all(g);
            }
            ProposerKind::OffloadScaleup => {
                s.greedy(true);
                s.offload_scaleup();
            }
        }
        if c.refine && s.space.iter().map(Vec::len).sum::<usize>() <= REFINE_MAX_OPTIONS {
            s.refine();
        }
    }
    let Some((p, a, r)) = s.best.clone() else {
        return Err(no_fit(&s));
    };
    let mut plan = build_plan(input, &s.space, &s.caps, &p, &a, r, s.num_proposals, s.num_plans);
    plan.num_pruned = s.num_pruned;
    Ok(plan)
}

#[allow(clippy::too_many_arguments)]
fn build_plan(
    input: &PlanInput,
    space: &Space,
    caps: &[Storage],
    p: &Proposal,
    a: &Assignment,
    max_rank_perf: f64,
    num_proposals: usize,
    num_plans: usize,
) -> Plan {
    let w = input.topology.world_size;
    let mut ranks: Vec<RankStats> = (0..w)
        .map(|rank| RankStats { rank, used: Storage::default(), available: caps[rank], perf: 0.0, shards: 0 })
        .collect();
    let mut tables = Vec::with_capacity(p.len());
    let opts: Vec<&ShardingOption> = p.iter().enumerate().map(|(t, &i)| &space[t][i as usize]).collect();
    let at = offsets(&opts);
    for (t, o) in opts.iter().enumerate() {
        let ranks_of = &a[at[t]..at[t + 1]];
        let shards = o
            .shards
            .iter()
            .zip(ranks_of)
            .map(|(s, &r)| {
                let rs = &mut ranks[r];
                rs.used = rs.used.plus(&s.storage);
                rs.perf += s.perf.total();
                rs.shards += 1;
                PlacedShard { rank: r, size: s.size, offset: s.offset, perf: s.perf, storage: s.storage }
            })
            .collect();
        tables.push(TablePlan {
            name: input.tables[t].name.clone(),
            sharding_type: o.sharding_type,
            compute_kernel: o.compute_kernel,
            cache_load_factor: o.cache_load_factor,
            shards,
            runner_up: None,
        });
    }
    Plan {
        version: 1,
        inputs_hash: input.hash(),
        world_size: w,
        cost_model: input.config.cost_model,
        max_rank_perf,
        ranks,
        tables,
        num_proposals,
        num_plans,
        num_pruned: 0,
    }
}

/// The error when nothing fits: memory needed vs available, the largest tables, the
/// constraints that narrowed their options.
fn no_fit(s: &Search) -> PlanError {
    let input = s.input;
    let cap = s.caps.first().copied().unwrap_or_default();
    let cuda = input.topology.compute_device == ComputeDevice::Cuda;
    let mem = |st: &Storage| if cuda { st.hbm } else { st.ddr };
    let tier = if cuda { "HBM" } else { "DDR" };
    let total_cap = mem(&cap) * input.topology.world_size as u64;
    let mut msg = format!(
        "no plan fits: {} proposals tried, none could be placed.\n  available for tables: {:.3} GiB {tier} per rank \
         ({:.3} GiB on {} ranks) after keeping {:.0}% free and reserving {} for the dense model and KJT buffers",
        s.num_proposals,
        gib(mem(&cap)),
        gib(total_cap),
        input.topology.world_size,
        input.config.reserved_percentage * 100.0,
        human(
            if cuda {
                ((1.0 - input.config.reserved_percentage) * input.topology.hbm_cap as f64) as u64 - cap.hbm
            } else {
                0
            }
            .max(input.config.dense_bytes)
        ),
    );
    if let Some(l) = s.lowest_storage {
        msg += &format!("\n  the smallest proposal needs {:.3} GiB {tier} in all", gib(mem(&l)));
    }
    // Per table, its smallest option's largest shard against one rank.
    let mut tables: Vec<(u64, u64, usize, &ShardingOption)> = s
        .space
        .iter()
        .enumerate()
        .filter_map(|(t, opts)| {
            opts.iter()
                .map(|o| (mem(&o.total_storage()), o.shards.iter().map(|sh| mem(&sh.storage)).max().unwrap_or(0), t, o))
                .min_by_key(|x| (x.1, x.0))
        })
        .collect();
    tables.sort_by_key(|t| std::cmp::Reverse(t.0));
    msg += "\n  largest tables (their smallest option):";
    for (total, shard, t, o) in tables.iter().take(5) {
        let spec = &input.tables[*t];
        let narrowed = match (&spec.constraints.sharding_types, &spec.constraints.compute_kernels) {
            (None, None) => String::new(),
            (st, k) => format!(
                " — restricted by tables[{t}].constraints.{}",
                match (st, k) {
                    (Some(_), Some(_)) => "sharding_types and compute_kernels",
                    (Some(_), None) => "sharding_types",
                    _ => "compute_kernels",
                }
            ),
        };
        msg += &format!(
            "\n    {} ({} × {}): {}/{} needs {}, {} in its largest shard{}{}",
            spec.name,
            spec.rows,
            spec.dim,
            o.sharding_type,
            o.compute_kernel,
            human(*total),
            human(*shard),
            if *shard > mem(&cap) { " — more than a rank has" } else { "" },
            narrowed
        );
    }
    if let Some(Err(f)) = s.last_no_fit.as_ref().map(|p| s.partition_bounded(p, None)) {
        msg += &format!("\n  last failure: table {}: {}", input.tables[f.table].name, f.message);
    }
    msg += "\n  to fit: add ranks (`topology.world_size`), raise per-rank memory (`topology.hbm_gib` / `topology.ddr_gib`), \
            allow row_wise or a cached kernel for the largest tables, lower `planner.reserved_percentage`, or shrink the tables";
    PlanError::NoFit { message: msg }
}
