//! Partitioners: place every shard of a proposal on a rank (TorchRec's `GreedyPerfPartitioner`
//! and `MemoryBalancedPartitioner`).
use crate::types::{ComputeKernel, Perf, ShardingOption, ShardingType, Storage, Topology};

/// Placement class of a sharding type (TorchRec's `PartitionByType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PartitionBy {
    /// Shards go to single devices (TW, CW).
    Device,
    /// All shards on the ranks of one host (TWRW, TWCW).
    Host,
    /// Shard `i` on rank `i` (RW, DP).
    Uniform,
    /// Row blocks over several hosts (grid).
    MultiHost,
}

/// How the partitioner places a sharding type's shards.
fn partition_by(t: ShardingType) -> PartitionBy {
    match t {
        ShardingType::TableWise | ShardingType::ColumnWise => PartitionBy::Device,
        ShardingType::TableRowWise | ShardingType::TableColumnWise => PartitionBy::Host,
        ShardingType::RowWise | ShardingType::DataParallel => PartitionBy::Uniform,
        ShardingType::Grid => PartitionBy::MultiHost,
    }
}

/// Which partitioner places the shards.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum PartitionerKind {
    /// Largest tables first, each shard on the least-loaded rank it fits on.
    #[default]
    GreedyPerf,
    /// Greedy-perf, then the lowest per-rank table-memory cap (HBM on CUDA, DDR on CPU) whose
    /// plan is within 2% of the unconstrained plan's time (binary search, 10 steps): same
    /// speed, memory spread evenly.
    MemoryBalanced,
}

/// One rank while shards are being placed.
#[derive(Clone, Debug)]
pub(crate) struct Device {
    pub rank: usize,
    pub free: Storage,
    pub perf: Perf,
    /// `perf.total()`, kept with `perf` (the placement order reads it for every shard).
    pub total: f64,
    /// Σ shard totals, as [`rate`] counts them.
    pub rating: f64,
}

impl Device {
    fn take(&mut self, storage: &Storage, perf: &Perf) {
        self.free = self.free.minus(storage);
        self.rating += perf.total();
        self.perf.fwd_compute += perf.fwd_compute;
        self.perf.fwd_comms += perf.fwd_comms;
        self.perf.bwd_compute += perf.bwd_compute;
        self.perf.bwd_comms += perf.bwd_comms;
        self.perf.prefetch_compute += perf.prefetch_compute;
        self.perf.input_dist_comms += perf.input_dist_comms;
        self.total = self.perf.total();
    }
}

/// Why a proposal could not be placed.
#[derive(Clone, Debug, PartialEq)]
pub struct PartitionFailure {
    /// Table index.
    pub table: usize,
    /// Stopped early: a rank's time already exceeded the bound, so the plan cannot win.
    pub pruned: bool,
    /// What did not fit where.
    pub message: String,
}

/// Rank of every shard of a proposal, flat: option 0's shards, then option 1's, ...
pub type Assignment = Vec<usize>;

/// Start of each option's shards in an [`Assignment`].
pub(crate) fn offsets(proposal: &[&ShardingOption]) -> Vec<usize> {
    let mut out = Vec::with_capacity(proposal.len() + 1);
    let mut at = 0;
    out.push(0);
    for o in proposal {
        at += o.shards.len();
        out.push(at);
    }
    out
}

/// A lower bound of the slowest rank's time however shards whose times sum to `sum` are placed
/// on `world` ranks, the slowest of them taking `max`: the mean rank's time, or that shard's.
pub(crate) fn rating_lower_bound(sum: f64, max: f64, world: usize) -> f64 {
    (sum / world as f64).max(max)
}

/// Whether a rank time `rating` is above `bound` beyond rounding: a plan that slow cannot beat
/// the plan rated `bound` (the test every early stop uses).
pub(crate) fn beyond(rating: f64, bound: f64) -> bool {
    rating > bound * (1.0 + 1e-9)
}

/// Ordering of devices for the next shard: least loaded, then spread over hosts, then rank.
fn device_key(d: &Device, local: usize) -> (f64, usize, usize) {
    (d.total, d.rank % local, d.rank)
}

fn less(a: (f64, usize, usize), b: (f64, usize, usize)) -> bool {
    a.0 < b.0 || (a.0 == b.0 && (a.1, a.2) < (b.1, b.2))
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn storage_str(s: &Storage) -> String {
    format!("HBM {:.3} GiB, DDR {:.3} GiB", gib(s.hbm), gib(s.ddr))
}

/// Places shards on `devices[i]` for shard `i`.
fn uniform(o: &ShardingOption, devices: &mut [&mut Device], out: &mut [usize]) -> Result<(), PartitionFailure> {
    if o.shards.len() != devices.len() {
        return Err(PartitionFailure {
            table: o.table,
            pruned: false,
            message: format!("{} shards for {} ranks", o.shards.len(), devices.len()),
        });
    }
    for (k, (shard, d)) in o.shards.iter().zip(devices.iter_mut()).enumerate() {
        if !shard.storage.fits_in(&d.free) {
            return Err(PartitionFailure {
                table: o.table,
                pruned: false,
                message: format!(
                    "a {} shard needs {} but rank {} has {} free",
                    o.sharding_type,
                    storage_str(&shard.storage),
                    d.rank,
                    storage_str(&d.free)
                ),
            });
        }
        d.take(&shard.storage, &shard.perf);
        out[k] = d.rank;
    }
    Ok(())
}

/// Places each shard on the least-loaded device it fits on; with `distinct`, no two shards of
/// the option share a device.
fn device_partition(
    o: &ShardingOption,
    devices: &mut [&mut Device],
    local: usize,
    distinct: bool,
    out: &mut [usize],
) -> Result<(), PartitionFailure> {
    for (k, shard) in o.shards.iter().enumerate() {
        let mut best: Option<usize> = None;
        for (i, d) in devices.iter().enumerate() {
            if distinct && out[..k].contains(&d.rank) {
                continue;
            }
            if !shard.storage.fits_in(&d.free) {
                continue;
            }
            if best.is_none_or(|b| less(device_key(d, local), device_key(devices[b], local))) {
                best = Some(i);
            }
        }
        let Some(b) = best else {
            let largest = devices.iter().map(|d| d.free).max().unwrap_or_default();
            return Err(PartitionFailure {
                table: o.table,
                pruned: false,
                message: format!(
                    "a {} shard needs {} but the emptiest rank has {} free",
                    o.sharding_type,
                    storage_str(&shard.storage),
                    storage_str(&largest)
                ),
            });
        };
        devices[b].take(&shard.storage, &shard.perf);
        out[k] = devices[b].rank;
    }
    Ok(())
}

/// Hosts ordered by their devices' summed time (stable).
fn hosts_by_perf(devices: &[Device], group: usize) -> Vec<usize> {
    let hosts = devices.len() / group;
    let mut order: Vec<(f64, usize)> =
        (0..hosts).map(|h| (devices[h * group..(h + 1) * group].iter().map(|d| d.total).sum::<f64>(), h)).collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    order.into_iter().map(|(_, h)| h).collect()
}

/// Table-row-wise / table-column-wise: all shards on the ranks of one host, the least loaded
/// host first.
fn cohost(o: &ShardingOption, devices: &mut [Device], group: usize, out: &mut [usize]) -> Result<(), PartitionFailure> {
    let need = o.total_storage();
    for h in hosts_by_perf(devices, group) {
        let host = &devices[h * group..(h + 1) * group];
        let free: Storage = host.iter().map(|d| &d.free).sum();
        if !need.fits_in(&free) {
            continue;
        }
        let mut copy: Vec<Device> = host.to_vec();
        let mut refs: Vec<&mut Device> = copy.iter_mut().collect();
        let mut ranks = vec![0; o.shards.len()];
        let ok = match o.sharding_type {
            ShardingType::TableRowWise => uniform(o, &mut refs, &mut ranks),
            _ => device_partition(o, &mut refs, group, false, &mut ranks),
        };
        if ok.is_ok() {
            devices[h * group..(h + 1) * group].clone_from_slice(&copy);
            out.copy_from_slice(&ranks);
            return Ok(());
        }
    }
    Err(PartitionFailure {
        table: o.table,
        pruned: false,
        message: format!(
            "no host has {} free for all {} {} shards",
            storage_str(&need),
            o.shards.len(),
            o.sharding_type
        ),
    })
}

/// Grid: row blocks over consecutive hosts (in load order), column blocks over hosts.
fn multi_host(
    o: &ShardingOption,
    devices: &mut [Device],
    group: usize,
    out: &mut [usize],
) -> Result<(), PartitionFailure> {
    let fail = |m: String| PartitionFailure { table: o.table, pruned: false, message: m };
    let (hosts_needed, rem) = (o.shards.len() / group, o.shards.len() % group);
    if rem != 0 {
        return Err(fail(format!("{} grid shards do not fill hosts of {group} ranks", o.shards.len())));
    }
    let order = hosts_by_perf(devices, group);
    let mut start = 0;
    loop {
        let all = hosts_needed >= order.len();
        let chosen: Vec<usize> = if all {
            (0..hosts_needed).map(|i| order[i % order.len()]).collect()
        } else {
            order[start..start + hosts_needed].to_vec()
        };
        start += 1;
        let mut copy = devices.to_vec();
        let ok = {
            // A host may repeat when the grid needs more hosts than exist: its ranks then take
            // several column blocks.
            let mut ranks = vec![0; o.shards.len()];
            let mut res = Ok(());
            for (block, &h) in chosen.iter().enumerate() {
                let mut refs: Vec<&mut Device> = copy[h * group..(h + 1) * group].iter_mut().collect();
                let sub = ShardingOption { shards: o.shards[block * group..(block + 1) * group].to_vec(), ..o.clone() };
                if let Err(e) = uniform(&sub, &mut refs, &mut ranks[block * group..(block + 1) * group]) {
                    res = Err(e);
                    break;
                }
            }
            res.map(|_| ranks)
        };
        if let Ok(ranks) = ok {
            devices.clone_from_slice(&copy);
            out.copy_from_slice(&ranks);
            return Ok(());
        }
        if start + hosts_needed > order.len() || all {
            return Err(fail(format!("no {hosts_needed} host(s) have room for the grid shards")));
        }
    }
}

/// What to sort the non-uniform options by, largest first.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum SortBy {
    Storage,
    Perf,
}

/// The greedy-perf partitioner. `caps` are the per-rank capacities after reservation;
/// `tier_cap` overrides every rank's table memory (HBM on CUDA, DDR on CPU). With a `bound`, placement stops (a pruned
/// failure) once some rank's time exceeds it: the finished plan could only be slower.
pub(crate) fn greedy(
    proposal: &[&ShardingOption],
    caps: &[Storage],
    topo: &Topology,
    tier_cap: Option<u64>,
    sort_by: SortBy,
    bound: Option<f64>,
) -> Result<(Assignment, Vec<Device>), PartitionFailure> {
    greedy_traced(proposal, caps, topo, tier_cap, sort_by, bound, |_| {}).map(|(a, d, _)| (a, d))
}

/// Fails (pruned) once a rank's time is beyond `bound`.
fn check_bound(devices: &[Device], bound: Option<f64>, table: usize) -> Result<(), PartitionFailure> {
    if bound.is_some_and(|b| devices.iter().any(|d| beyond(d.rating, b))) {
        return Err(PartitionFailure { table, pruned: true, message: "slower than the best plan so far".into() });
    }
    Ok(())
}

/// Places one option that is not placed uniformly.
fn place(
    o: &ShardingOption,
    devices: &mut [Device],
    topo: &Topology,
    out: &mut [usize],
) -> Result<(), PartitionFailure> {
    let group = topo.local_world_size;
    match partition_by(o.sharding_type) {
        PartitionBy::MultiHost => multi_host(o, devices, group, out),
        PartitionBy::Host => cohost(o, devices, group, out),
        PartitionBy::Device => {
            let distinct = o.sharding_type == ShardingType::ColumnWise && o.compute_kernel == ComputeKernel::KeyValue;
            let mut refs: Vec<&mut Device> = devices.iter_mut().collect();
            device_partition(o, &mut refs, group, distinct, out)
        }
        PartitionBy::Uniform => Ok(()),
    }
}

/// [`greedy`], calling `step` with the devices after the uniform options are placed and after
/// each further placement; also returns the placement order of the other options.
fn greedy_traced(
    proposal: &[&ShardingOption],
    caps: &[Storage],
    topo: &Topology,
    tier_cap: Option<u64>,
    sort_by: SortBy,
    bound: Option<f64>,
    mut step: impl FnMut(&[Device]),
) -> Result<(Assignment, Vec<Device>, Vec<usize>), PartitionFailure> {
    let mut devices: Vec<Device> = caps
        .iter()
        .enumerate()
        .map(|(rank, c)| Device {
            rank,
            free: match (tier_cap, topo.compute_device) {
                (Some(cap), crate::types::ComputeDevice::Cuda) => Storage { hbm: cap, ..*c },
                (Some(cap), crate::types::ComputeDevice::Cpu) => Storage { ddr: cap, ..*c },
                (None, _) => *c,
            },
            perf: Perf::default(),
            total: 0.0,
            rating: 0.0,
        })
        .collect();
    let at = offsets(proposal);
    let mut assignment: Assignment = vec![0; at[proposal.len()]];
    for (i, o) in proposal.iter().enumerate() {
        if partition_by(o.sharding_type) == PartitionBy::Uniform {
            let mut refs: Vec<&mut Device> = devices.iter_mut().collect();
            uniform(o, &mut refs, &mut assignment[at[i]..at[i + 1]])?;
            check_bound(&devices, bound, o.table)?;
        }
    }
    let mut order: Vec<usize> =
        (0..proposal.len()).filter(|&i| partition_by(proposal[i].sharding_type) != PartitionBy::Uniform).collect();
    match sort_by {
        SortBy::Storage => {
            let keys: Vec<Storage> = proposal.iter().map(|o| o.total_storage()).collect();
            order.sort_by(|&a, &b| keys[b].cmp(&keys[a]));
        }
        SortBy::Perf => {
            let keys: Vec<f64> = proposal.iter().map(|o| o.sum_shard_perf()).collect();
            order.sort_by(|&a, &b| keys[b].total_cmp(&keys[a]));
        }
    }
    step(&devices);
    for &i in &order {
        let o = proposal[i];
        place(o, &mut devices, topo, &mut assignment[at[i]..at[i + 1]])?;
        check_bound(&devices, bound, o.table)?;
        step(&devices);
    }
    Ok((assignment, devices, order))
}

/// The greedy-perf partitioner's run ([`partition`] with [`PartitionerKind::GreedyPerf`]) over
/// one proposal, step by step, so that a proposal differing from it in one option is placed
/// again only from where its placement order departs ([`GreedyTrace::replaced`]): what the
/// runner-up explanations do for every alternative of every table.
pub(crate) struct GreedyTrace {
    /// Each option's sort key (its total memory, the largest placed first).
    keys: Vec<Storage>,
    /// The options not placed uniformly, in placement order.
    order: Vec<usize>,
    /// Each option's position in `order` (`usize::MAX` when placed uniformly).
    position: Vec<usize>,
    /// `states[k]`: the devices after the uniform options and the first `k` of `order`.
    states: Vec<Vec<Device>>,
    assignment: Assignment,
    at: Vec<usize>,
}

impl GreedyTrace {
    /// Places `proposal` as [`partition`] with the greedy-perf partitioner does.
    pub(crate) fn new(
        proposal: &[&ShardingOption],
        caps: &[Storage],
        topo: &Topology,
    ) -> Result<Self, PartitionFailure> {
        let mut states = Vec::with_capacity(proposal.len() + 1);
        let (assignment, _, order) =
            greedy_traced(proposal, caps, topo, None, SortBy::Storage, None, |d| states.push(d.to_vec()))?;
        let mut position = vec![usize::MAX; proposal.len()];
        for (k, &i) in order.iter().enumerate() {
            position[i] = k;
        }
        let keys = proposal.iter().map(|o| o.total_storage()).collect();
        Ok(Self { keys, order, position, states, assignment, at: offsets(proposal) })
    }

    /// What [`partition`] with the greedy-perf partitioner and `bound` gives for `proposal`,
    /// the traced proposal with option `t` replaced; `None` when either option of `t` is
    /// placed uniformly (every placement after the uniform phase could differ: place it all).
    ///
    /// The greedy order is a stable sort by memory, so the two orders agree up to the first
    /// position of the old or the new option `t`: placement resumes from the traced devices
    /// there, the earlier options keep their traced ranks.
    pub(crate) fn replaced(
        &self,
        proposal: &[&ShardingOption],
        t: usize,
        topo: &Topology,
        bound: Option<f64>,
    ) -> Option<Result<Assignment, PartitionFailure>> {
        let alt = proposal[t];
        if self.position[t] == usize::MAX || partition_by(alt.sharding_type) == PartitionBy::Uniform {
            return None;
        }
        let key = alt.total_storage();
        let mut order: Vec<usize> = self.order.iter().copied().filter(|&i| i != t).collect();
        // Ahead of `t` in the stable sort: more memory, or as much and earlier in the proposal.
        let ahead = order.partition_point(|&i| self.keys[i] > key || (self.keys[i] == key && i < t));
        order.insert(ahead, t);
        Some(self.resume(proposal, t, &order, ahead.min(self.position[t]), topo, bound))
    }

    /// Places `proposal` (`order` its placement order) from the traced devices after `start`
    /// placements, the options placed before them and the uniform ones keeping their traced
    /// ranks.
    fn resume(
        &self,
        proposal: &[&ShardingOption],
        t: usize,
        order: &[usize],
        start: usize,
        topo: &Topology,
        bound: Option<f64>,
    ) -> Result<Assignment, PartitionFailure> {
        let mut devices = self.states[start].clone();
        check_bound(&devices, bound, proposal[t].table)?;
        let at = offsets(proposal);
        let mut assignment: Assignment = vec![0; at[proposal.len()]];
        let kept = |i: usize| i != t && (self.position[i] == usize::MAX || self.position[i] < start);
        for i in (0..proposal.len()).filter(|&i| kept(i)) {
            assignment[at[i]..at[i + 1]].copy_from_slice(&self.assignment[self.at[i]..self.at[i + 1]]);
        }
        for &i in &order[start..] {
            let o = proposal[i];
            place(o, &mut devices, topo, &mut assignment[at[i]..at[i + 1]])?;
            check_bound(&devices, bound, o.table)?;
        }
        Ok(assignment)
    }
}

/// The slowest rank's time: max over ranks of the summed shard times (TorchRec's
/// `NoopPerfModel`).
pub(crate) fn rate(proposal: &[&ShardingOption], assignment: &Assignment, world: usize) -> f64 {
    let mut perf = vec![0.0; world];
    let mut k = 0;
    for o in proposal {
        for s in &o.shards {
            perf[assignment[k]] += s.perf.total();
            k += 1;
        }
    }
    perf.into_iter().fold(0.0, f64::max)
}

/// Runs the chosen partitioner (`bound`: see [`greedy`]; the memory-balanced search ignores it).
pub(crate) fn partition(
    kind: PartitionerKind,
    proposal: &[&ShardingOption],
    caps: &[Storage],
    topo: &Topology,
    bound: Option<f64>,
) -> Result<Assignment, PartitionFailure> {
    match kind {
        PartitionerKind::GreedyPerf => greedy(proposal, caps, topo, None, SortBy::Storage, bound).map(|x| x.0),
        PartitionerKind::MemoryBalanced => memory_balanced(proposal, caps, topo),
    }
}

fn memory_balanced(
    proposal: &[&ShardingOption],
    caps: &[Storage],
    topo: &Topology,
) -> Result<Assignment, PartitionFailure> {
    const MAX_SEARCH: usize = 10;
    const TOLERANCE: f64 = 0.02;
    let (default, _) = greedy(proposal, caps, topo, None, SortBy::Perf, None)?;
    let original = rate(proposal, &default, topo.world_size);
    // The memory the tables live in: HBM on CUDA (TorchRec's), DDR on CPU (where TorchRec's
    // HBM-only search has nothing to balance).
    let tier = |st: &Storage| if topo.compute_device == crate::types::ComputeDevice::Cuda { st.hbm } else { st.ddr };
    let mut tier_by_rank = vec![0u64; topo.world_size];
    let (mut total, mut max_shard) = (0u64, 0u64);
    let mut k = 0;
    for o in proposal {
        for s in &o.shards {
            let r = default[k];
            k += 1;
            let bytes = tier(&s.storage);
            tier_by_rank[r] += bytes;
            total += bytes;
            max_shard = max_shard.max(bytes);
        }
    }
    let mut hi = tier_by_rank.iter().copied().max().unwrap_or(0);
    let mut lo = (total / topo.world_size as u64).max(max_shard);
    let mut best = default;
    let diff = 10 << 20;
    let mut count = 0;
    while count < MAX_SEARCH && lo + diff < hi {
        count += 1;
        let mid = (hi + lo) / 2;
        match greedy(proposal, caps, topo, Some(mid), SortBy::Perf, None) {
            Ok((a, _)) if rate(proposal, &a, topo.world_size) <= original * (1.0 + TOLERANCE) => {
                best = a;
                hi = mid;
            }
            _ => lo = mid,
        }
    }
    Ok(best)
}
