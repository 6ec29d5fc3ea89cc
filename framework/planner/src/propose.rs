//! Proposers: which option of each table to try next (TorchRec's `GreedyProposer`,
//! `UniformProposer`, `GridSearchProposer`, and an embedding-offload scale-up).
use crate::types::{ComputeKernel, ShardingOption, defaults::MAX_GRID_PROPOSALS};

/// A proposal: one option index per table, into the search space.
pub type Proposal = Vec<u32>;

/// The search space: each table's options.
pub type Space = Vec<Vec<ShardingOption>>;

/// Which proposers run, in order.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ProposerKind {
    /// TorchRec's default list: grid search (when it has at most 10,000 proposals), greedy by
    /// slowest shard, greedy by summed shards, uniform.
    #[default]
    Default,
    /// Greedy: start from each table's fastest option; after each proposal move the table
    /// using the most memory to its next option. Stops after `early_stop_threshold`
    /// proposals without improvement when that is set.
    Greedy,
    /// One proposal per sharding type every table allows: all tables with that type.
    Uniform,
    /// Every combination of options (at most 10,000).
    Grid,
    /// Greedy, then grow the cached tables' load factors into the device memory the best plan
    /// leaves free (binary search on the budget, shared by expected lookups).
    OffloadScaleup,
}

impl trainrec_types::Word for ProposerKind {
    const WORDS: &'static [Self] = &[Self::Default, Self::Greedy, Self::Uniform, Self::Grid, Self::OffloadScaleup];
    fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Greedy => "greedy",
            Self::Uniform => "uniform",
            Self::Grid => "grid",
            Self::OffloadScaleup => "offload_scaleup",
        }
    }
}

fn sorted_by_score(options: &[ShardingOption], use_depth: bool) -> Vec<u32> {
    let scores: Vec<f64> =
        options.iter().map(|o| if use_depth { o.max_shard_perf() } else { o.sum_shard_perf() }).collect();
    let mut idx: Vec<u32> = (0..options.len() as u32).collect();
    idx.sort_by(|&a, &b| scores[a as usize].total_cmp(&scores[b as usize]));
    idx
}

/// An option's memory as the greedy proposer ranks it: (max shard HBM, Σ HBM, max shard DDR,
/// Σ DDR).
type StorageKey = (u64, u64, u64, u64);

/// Greedy proposer state.
pub(crate) struct Greedy {
    order: Vec<Vec<u32>>,
    cur: Vec<usize>,
    /// Per option: (max shard HBM, Σ HBM, max shard DDR, Σ DDR).
    storage_key: Vec<Vec<(u64, u64, u64, u64)>>,
    /// The tables with a next option, by their current option's storage key (largest first,
    /// then the lowest table): the table the next proposal moves is the top.
    movable: std::collections::BinaryHeap<(StorageKey, std::cmp::Reverse<usize>)>,
    threshold: Option<u32>,
    best: f64,
    inferior: u32,
    done: bool,
}

impl Greedy {
    pub(crate) fn new(space: &Space, use_depth: bool, threshold: Option<u32>) -> Self {
        let storage_key: Vec<Vec<(u64, u64, u64, u64)>> = space
            .iter()
            .map(|opts| {
                opts.iter()
                    .map(|o| {
                        let hbm = o.shards.iter().map(|s| s.storage.hbm);
                        let ddr = o.shards.iter().map(|s| s.storage.ddr);
                        (hbm.clone().max().unwrap_or(0), hbm.sum(), ddr.clone().max().unwrap_or(0), ddr.sum())
                    })
                    .collect()
            })
            .collect();
        let order: Vec<Vec<u32>> = space.iter().map(|o| sorted_by_score(o, use_depth)).collect();
        let movable = (0..space.len())
            .filter(|&t| order[t].len() > 1)
            .map(|t| (storage_key[t][order[t][0] as usize], std::cmp::Reverse(t)))
            .collect();
        Self {
            order,
            cur: vec![0; space.len()],
            storage_key,
            movable,
            threshold: threshold.filter(|&t| t > 0),
            best: f64::INFINITY,
            inferior: 0,
            done: space.is_empty(),
        }
    }

    pub(crate) fn propose(&self) -> Option<Proposal> {
        if self.done {
            return None;
        }
        Some(self.cur.iter().enumerate().map(|(t, &i)| self.order[t][i]).collect())
    }

    /// Takes the last proposal's rating and moves to the next proposal: the table whose
    /// current option uses the most memory (the lowest such table on ties) takes its next
    /// option. Returns that change, `(table, old option, new option)`, or `None` when done.
    pub(crate) fn feedback(&mut self, rating: Option<f64>) -> Option<(usize, u32, u32)> {
        if let (Some(threshold), Some(r)) = (self.threshold, rating) {
            self.inferior += 1;
            if r < self.best {
                self.best = r;
                self.inferior = 0;
            }
            if self.inferior > threshold {
                self.done = true;
                return None;
            }
        }
        // A table whose current option has an all-zero key is never moved (the scan this
        // replaces wanted a strictly larger key than zero).
        let Some((key, std::cmp::Reverse(t))) = self.movable.pop().filter(|(k, _)| *k > (0, 0, 0, 0)) else {
            self.done = true;
            return None;
        };
        debug_assert_eq!(key, self.storage_key[t][self.order[t][self.cur[t]] as usize]);
        let from = self.order[t][self.cur[t]];
        self.cur[t] += 1;
        let i = self.cur[t];
        if i + 1 < self.order[t].len() {
            self.movable.push((self.storage_key[t][self.order[t][i] as usize], std::cmp::Reverse(t)));
        }
        Some((t, from, self.order[t][i]))
    }

    /// Whether the proposals depend on the feedback (early stopping).
    pub(crate) fn adaptive(&self) -> bool {
        self.threshold.is_some()
    }
}

/// Uniform proposals: per sharding type that every table has, each table's best option of it.
pub(crate) fn uniform(space: &Space) -> Vec<Proposal> {
    let mut types = Vec::new();
    for opts in space {
        for o in opts {
            if !types.contains(&o.sharding_type) {
                types.push(o.sharding_type);
            }
        }
    }
    let mut out = Vec::new();
    for st in types {
        let mut p = Vec::with_capacity(space.len());
        for opts in space {
            let best = opts.iter().enumerate().filter(|(_, o)| o.sharding_type == st).fold(
                None::<(usize, f64)>,
                |acc, (i, o)| {
                    let s = o.max_shard_perf();
                    match acc {
                        Some((_, b)) if b <= s => acc,
                        _ => Some((i, s)),
                    }
                },
            );
            match best {
                Some((i, _)) => p.push(i as u32),
                None => break,
            }
        }
        if p.len() == space.len() {
            out.push(p);
        }
    }
    out
}

/// Every combination of options, when there are at most 10,000 (else none).
pub(crate) fn grid(space: &Space) -> Vec<Proposal> {
    let total = space.iter().try_fold(1u128, |acc, o| acc.checked_mul(o.len() as u128));
    match total {
        Some(n) if n <= MAX_GRID_PROPOSALS && !space.is_empty() => {}
        _ => return Vec::new(),
    }
    let order: Vec<Vec<u32>> = space.iter().map(|o| sorted_by_score(o, true)).collect();
    let mut idx = vec![0usize; space.len()];
    let mut out = Vec::new();
    loop {
        out.push(idx.iter().enumerate().map(|(t, &i)| order[t][i]).collect());
        // Odometer, last table fastest (itertools.product order).
        let mut t = space.len();
        loop {
            if t == 0 {
                return out;
            }
            t -= 1;
            idx[t] += 1;
            if idx[t] < order[t].len() {
                break;
            }
            idx[t] = 0;
        }
    }
}

/// The tables a scale-up can grow: those whose option in `p` is a cached kernel.
pub(crate) fn cached_tables(space: &Space, p: &Proposal) -> Vec<usize> {
    (0..space.len()).filter(|&t| space[t][p[t] as usize].compute_kernel == ComputeKernel::FusedUvmCaching).collect()
}
