//! The planner's vocabulary: sharding types, compute kernels, topology, tables, constraints.
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use trainrec_types::{CachePolicy, WeightPrecision};

pub use trainrec_types::{ComputeDevice, ComputeKernel, ShardingType};

/// Which estimator formulas and search space the planner uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CostModel {
    /// trainrec's engines: TorchRec's formulas, plus row-wise and table-row-wise on CPU (the
    /// MPI backend has reduce-scatter), one pooling factor per feature of a table, and a
    /// prefetch cost for cached tables that assumes uniform access (miss rate
    /// `1 - load_factor`) where TorchRec counts none without cache statistics.
    #[default]
    Trainrec,
    /// TorchRec 1.9's default estimators and enumerator exactly (for side-by-side plan
    /// quality).
    Torchrec,
}

impl trainrec_types::Word for CostModel {
    const WORDS: &'static [Self] = &[Self::Trainrec, Self::Torchrec];
    fn name(self) -> &'static str {
        match self {
            Self::Trainrec => "trainrec",
            Self::Torchrec => "torchrec",
        }
    }
}

/// Cache parameters of a table planned with a cached kernel (TorchRec's `CacheParams`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CacheParams {
    /// Cache rows as a share of the table's rows, in `(0, 1]`. Default: 0.2 (TorchRec's
    /// `UVM_CACHING_RATIO`). This is the one place the load factor is set.
    #[serde(default)]
    pub load_factor: Option<f64>,
    /// Eviction policy.
    #[serde(default)]
    pub algorithm: Option<CachePolicy>,
    /// The prefetch pipeline loads batch i+1's rows while batch i computes, so lookups run at
    /// device-memory speed.
    #[serde(default)]
    pub prefetch_pipeline: Option<bool>,
}

/// Per-table planner constraints (TorchRec's `ParameterConstraints`), the recipe's
/// `[tables.constraints]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Constraints {
    /// Allowed sharding types. Default: all the device supports except `grid`.
    #[serde(default)]
    pub sharding_types: Option<Vec<ShardingType>>,
    /// Allowed compute kernels. Default: all the device supports except `key_value` (and,
    /// on CPU, `fused_uvm_caching`: a table goes to disk behind a cache only when asked):
    /// `fused`, `fused_uvm_caching`, `key_value` on CPU and CUDA. (`fused_uvm`, FBGEMM's table
    /// read in place from host memory, is in TorchRec's search space only — the `torchrec`
    /// cost model — and trainrec's engines do not build it.)
    #[serde(default)]
    pub compute_kernels: Option<Vec<ComputeKernel>>,
    /// Smallest column block for column-wise sharding (TorchRec's `min_partition`). Default:
    /// 128.
    #[serde(default)]
    pub min_partition: Option<u64>,
    /// Mean ids per bag of each feature of the table. Default: 1.0 each.
    #[serde(default)]
    pub pooling_factors: Option<Vec<f64>>,
    /// Poolings per example of each feature. Default: 1.0 each.
    #[serde(default)]
    pub num_poolings: Option<Vec<f64>>,
    /// Batch size of each feature. Default: the planner batch size.
    #[serde(default)]
    pub batch_sizes: Option<Vec<u64>>,
    /// The features carry per-id weights.
    #[serde(default)]
    pub is_weighted: bool,
    /// Cache parameters, for the cached kernels.
    #[serde(default)]
    pub cache: Option<CacheParams>,
}

/// The optimizer state a table carries per weight (TorchRec's optimizer multiplier).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerState {
    /// No optimizer state (SGD, or unknown).
    #[default]
    None,
    /// One value per row (row-wise Adagrad).
    RowWise,
    /// One value per weight (Adagrad).
    PerWeight,
    /// Two values per weight (Adam, LAMB).
    TwoPerWeight,
    /// One value per weight and one per row (partial row-wise Adam).
    PerWeightPlusRow,
}

impl OptimizerState {
    /// Optimizer bytes per weight byte for a table of `dim` columns.
    pub fn multiplier(self, dim: u64) -> f64 {
        match self {
            Self::None => 0.0,
            Self::RowWise => 1.0 / dim as f64,
            Self::PerWeight => 1.0,
            Self::TwoPerWeight => 2.0,
            Self::PerWeightPlusRow => 1.0 + 1.0 / dim as f64,
        }
    }
}

/// One embedding table as the planner sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    /// Table name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Embedding dimension.
    pub dim: u64,
    /// Features looked up in the table.
    pub features: Vec<String>,
    /// Storage precision of the weights.
    pub precision: WeightPrecision,
    /// Pooled (EBC) or sequence (EC) output.
    pub pooled: bool,
    /// Optimizer state per weight.
    pub optimizer: OptimizerState,
    /// The table's constraints.
    pub constraints: Constraints,
}

impl TableSpec {
    /// A pooled fp32 table with one feature per name and no constraints.
    pub fn new(name: impl Into<String>, rows: u64, dim: u64, features: Vec<String>) -> Self {
        Self {
            name: name.into(),
            rows,
            dim,
            features,
            precision: WeightPrecision::Fp32,
            pooled: true,
            optimizer: OptimizerState::None,
            constraints: Constraints::default(),
        }
    }

    /// Bytes per stored weight.
    pub fn element_size(&self) -> f64 {
        self.precision.bytes() as f64
    }
}

/// TorchRec's planner constants (`torchrec/distributed/planner/constants.py`), in bytes and
/// bytes per millisecond.
pub mod defaults {
    /// GiB.
    pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    /// HBM per rank: 32 GiB.
    pub const HBM_CAP: u64 = 32 << 30;
    /// DDR per rank: 128 GiB.
    pub const DDR_CAP: u64 = 128 << 30;
    /// SSD per rank: 2 TiB.
    pub const SSD_CAP: u64 = 2 << 40;
    /// HBM bandwidth: 897 GiB/s.
    pub const HBM_MEM_BW_GIBPS: f64 = 897.0;
    /// DDR bandwidth: 51 GiB/s.
    pub const DDR_MEM_BW_GIBPS: f64 = 51.0;
    /// SSD bandwidth: 100 MiB/s.
    pub const SSD_MEM_BW_GIBPS: f64 = 100.0 / 1024.0;
    /// HBM to DDR bandwidth: 32 GiB/s.
    pub const HBM_TO_DDR_MEM_BW_GIBPS: f64 = 32.0;
    /// Intra-host bandwidth: 600 GiB/s.
    pub const INTRA_HOST_BW_GIBPS: f64 = 600.0;
    /// Inter-host bandwidth: 12.5 GiB/s.
    pub const INTER_HOST_BW_GIBPS: f64 = 12.5;
    /// Planner batch size.
    pub const BATCH_SIZE: u64 = 512;
    /// Default cache load factor.
    pub const UVM_CACHING_RATIO: f64 = 0.2;
    /// Smallest column-wise block.
    pub const MIN_CW_DIM: u64 = 128;
    /// Bytes of one id.
    pub const BIGINT_DTYPE: f64 = 8.0;
    /// Empirical factor of a batched copy.
    pub const BATCHED_COPY_PERF_FACTOR: f64 = 2.455;
    /// Embedding dim a kernel block uses fully.
    pub const FULL_BLOCK_EMB_DIM: u64 = 128;
    /// Penalty for dims in `[64, 128)`.
    pub const HALF_BLOCK_PENALTY: f64 = 1.15;
    /// Penalty for dims below 64.
    pub const QUARTER_BLOCK_PENALTY: f64 = 1.75;
    /// Backward compute over forward compute.
    pub const BWD_COMPUTE_MULTIPLIER: f64 = 2.0;
    /// Extra backward factor of weighted features.
    pub const WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER: f64 = 1.0;
    /// Cost of the per-id-weight gradient kernel, over forward compute.
    pub const WEIGHTED_KERNEL_MULTIPLIER: f64 = 1.1;
    /// Data-parallel optimizer kernels' factor.
    pub const DP_ELEMENTWISE_KERNELS_PERF_FACTOR: f64 = 9.22;
    /// Share of HBM the heuristic reservation keeps free.
    pub const RESERVED_PERCENTAGE: f64 = 0.15;
    /// Dense parameters' bytes multiplier of the heuristic reservation.
    pub const DENSE_PARAMETER_MULTIPLIER: f64 = 6.0;
    /// KJT bytes multiplier of the heuristic reservation.
    pub const KJT_MULTIPLIER: u64 = 20;
    /// Proposal limit of the grid search.
    pub const MAX_GRID_PROPOSALS: u128 = 10_000;
}

/// The machines a plan is for (TorchRec's `Topology`); bandwidths in GiB/s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Ranks in all.
    pub world_size: usize,
    /// Ranks per host.
    pub local_world_size: usize,
    /// The compute device.
    pub compute_device: ComputeDevice,
    /// HBM per rank, bytes (0 on CPU).
    pub hbm_cap: u64,
    /// DDR per rank, bytes.
    pub ddr_cap: u64,
    /// SSD per rank, bytes.
    pub ssd_cap: u64,
    /// HBM bandwidth.
    pub hbm_mem_bw: f64,
    /// DDR bandwidth.
    pub ddr_mem_bw: f64,
    /// SSD bandwidth.
    pub ssd_mem_bw: f64,
    /// Device-to-host-memory bandwidth.
    pub hbm_to_ddr_mem_bw: f64,
    /// Bandwidth between ranks of one host.
    pub intra_host_bw: f64,
    /// Bandwidth between hosts.
    pub inter_host_bw: f64,
}

impl Topology {
    /// TorchRec's defaults for `world_size` ranks on one host.
    pub fn new(world_size: usize, compute_device: ComputeDevice) -> Self {
        use defaults::*;
        Self {
            world_size,
            local_world_size: world_size,
            compute_device,
            hbm_cap: if compute_device == ComputeDevice::Cuda { HBM_CAP } else { 0 },
            ddr_cap: DDR_CAP,
            ssd_cap: SSD_CAP,
            hbm_mem_bw: HBM_MEM_BW_GIBPS,
            ddr_mem_bw: DDR_MEM_BW_GIBPS,
            ssd_mem_bw: SSD_MEM_BW_GIBPS,
            hbm_to_ddr_mem_bw: HBM_TO_DDR_MEM_BW_GIBPS,
            intra_host_bw: INTRA_HOST_BW_GIBPS,
            inter_host_bw: INTER_HOST_BW_GIBPS,
        }
    }

    /// Number of hosts.
    pub fn num_hosts(&self) -> usize {
        (self.world_size / self.local_world_size).max(1)
    }
}

/// GiB/s to bytes per millisecond (TorchRec's unit).
pub(crate) fn bytes_per_ms(gibps: f64) -> f64 {
    gibps * defaults::GIB / 1000.0
}

/// Bytes on each memory tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Storage {
    /// Device memory.
    pub hbm: u64,
    /// Host memory.
    pub ddr: u64,
    /// SSD.
    pub ssd: u64,
}

impl Storage {
    /// Whether `self` fits in `cap`.
    pub fn fits_in(&self, cap: &Storage) -> bool {
        self.hbm <= cap.hbm && self.ddr <= cap.ddr && self.ssd <= cap.ssd
    }

    /// `self - other` (caller checked `other.fits_in(self)`).
    pub fn minus(&self, other: &Storage) -> Storage {
        Storage { hbm: self.hbm - other.hbm, ddr: self.ddr - other.ddr, ssd: self.ssd - other.ssd }
    }

    /// `self + other`.
    pub fn plus(&self, other: &Storage) -> Storage {
        Storage { hbm: self.hbm + other.hbm, ddr: self.ddr + other.ddr, ssd: self.ssd + other.ssd }
    }
}

impl<'a> std::iter::Sum<&'a Storage> for Storage {
    fn sum<I: Iterator<Item = &'a Storage>>(iter: I) -> Storage {
        iter.fold(Storage::default(), |a, s| a.plus(s))
    }
}

impl std::iter::Sum for Storage {
    fn sum<I: Iterator<Item = Storage>>(iter: I) -> Storage {
        iter.fold(Storage::default(), |a, s| a.plus(&s))
    }
}

/// Estimated time of one shard per training step, in milliseconds (TorchRec's `Perf`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Perf {
    /// Forward lookup.
    pub fwd_compute: f64,
    /// Forward output distribution.
    pub fwd_comms: f64,
    /// Backward and fused optimizer.
    pub bwd_compute: f64,
    /// Backward gradient distribution.
    pub bwd_comms: f64,
    /// Loading missed rows into the cache.
    pub prefetch_compute: f64,
    /// Input (KJT) distribution; reported, not counted in `total` (as TorchRec).
    pub input_dist_comms: f64,
}

impl Perf {
    /// The shard's time: everything except the input distribution.
    pub fn total(&self) -> f64 {
        self.fwd_compute + self.bwd_compute + self.fwd_comms + self.bwd_comms + self.prefetch_compute
    }
}

/// One shard of a sharding option: a block of rows × columns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shard {
    /// `[rows, columns]`.
    pub size: [u64; 2],
    /// `[first row, first column]`.
    pub offset: [u64; 2],
    /// Estimated time.
    pub perf: Perf,
    /// Estimated memory.
    pub storage: Storage,
}

/// One way to shard one table: a sharding type, a kernel and the shards it makes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardingOption {
    /// Index of the table in the planner's input.
    pub table: usize,
    /// Sharding type.
    pub sharding_type: ShardingType,
    /// Compute kernel.
    pub compute_kernel: ComputeKernel,
    /// Cache load factor (cached kernels).
    pub cache_load_factor: Option<f64>,
    /// The shards.
    pub shards: Vec<Shard>,
}

impl ShardingOption {
    /// The largest shard time (the greedy proposer's score with `use_depth`).
    pub fn max_shard_perf(&self) -> f64 {
        self.shards.iter().map(|s| s.perf.total()).fold(0.0, f64::max)
    }

    /// The sum of shard times.
    pub fn sum_shard_perf(&self) -> f64 {
        self.shards.iter().map(|s| s.perf.total()).sum()
    }

    /// Storage of all shards together.
    pub fn total_storage(&self) -> Storage {
        self.shards.iter().map(|s| &s.storage).sum()
    }
}
