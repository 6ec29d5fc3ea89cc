//! The words of a placement: how a table is split over the ranks, where its rows live and how
//! lookups reach them, and the device that runs the kernels.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;
use crate::cache::CacheBacking;

/// How one table is split over the ranks (TorchRec's `ShardingType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShardingType {
    /// Every rank holds the whole table; gradients are all-reduced.
    DataParallel,
    /// The whole table lives on one rank.
    TableWise,
    /// Column blocks of the table, each on one rank.
    ColumnWise,
    /// Column blocks of the table, all on the ranks of one host.
    TableColumnWise,
    /// Row blocks of the table, one per rank of the world.
    RowWise,
    /// Row blocks of the table, one per rank of one host.
    TableRowWise,
    /// Column blocks, each split in row blocks over the ranks of a host (TorchRec's
    /// `grid_shard`). Only considered when a table's `sharding_types` names it.
    Grid,
}

impl ShardingType {
    /// Every sharding type, in the order the enumerator tries them.
    pub const ALL: [ShardingType; 7] = [
        Self::DataParallel,
        Self::TableWise,
        Self::ColumnWise,
        Self::TableColumnWise,
        Self::RowWise,
        Self::TableRowWise,
        Self::Grid,
    ];

    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::DataParallel => "data_parallel",
            Self::TableWise => "table_wise",
            Self::ColumnWise => "column_wise",
            Self::TableColumnWise => "table_column_wise",
            Self::RowWise => "row_wise",
            Self::TableRowWise => "table_row_wise",
            Self::Grid => "grid",
        }
    }
}

impl std::fmt::Display for ShardingType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a table's rows live and how lookups reach them (TorchRec's `EmbeddingComputeKernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ComputeKernel {
    /// Unfused lookup with a separate optimizer step (data parallel tables only).
    Dense,
    /// Table-batched lookup with the optimizer fused into the backward; rows in device memory.
    Fused,
    /// Rows in host memory reached directly from the device (no cache). Planned only by the
    /// `torchrec` cost model (TorchRec's search space); trainrec's engines do not build it.
    FusedUvm,
    /// A cache of `cache.load_factor` × rows in device memory in front of the rows in host
    /// memory (FBGEMM's UVM caching).
    FusedUvmCaching,
    /// A cache of `cache.load_factor` x rows in device memory (on CPU: in memory) in front of
    /// a key-value store on disk that holds only the rows written so far; a row never written
    /// reads as its initial weights. Only considered when a table's `compute_kernels` names it.
    KeyValue,
}

impl ComputeKernel {
    /// Every kernel, in the order the enumerator tries them.
    pub const ALL: [ComputeKernel; 5] =
        [Self::Dense, Self::Fused, Self::FusedUvm, Self::FusedUvmCaching, Self::KeyValue];

    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Fused => "fused",
            Self::FusedUvm => "fused_uvm",
            Self::FusedUvmCaching => "fused_uvm_caching",
            Self::KeyValue => "key_value",
        }
    }

    /// Whether trainrec's engines build this kernel. `fused_uvm` (FBGEMM's table in host
    /// memory read in place by the GPU over unified memory) is not built: the planner's
    /// `trainrec` cost model never chooses it, and a plan that does (TorchRec's cost model, a
    /// pinned plan file) is refused before anything is built.
    pub fn is_built(self) -> bool {
        self != Self::FusedUvm
    }

    /// Kernels whose device memory holds a cache of the table rather than the table.
    pub fn is_cached(self) -> bool {
        matches!(self, Self::FusedUvmCaching | Self::KeyValue)
    }

    /// What holds the rows a cached kernel's cache does not (`None`: not a cached kernel).
    pub fn cache_backing(self) -> Option<CacheBacking> {
        match self {
            Self::FusedUvmCaching => Some(CacheBacking::Rows),
            Self::KeyValue => Some(CacheBacking::KeyValue),
            Self::Dense | Self::Fused | Self::FusedUvm => None,
        }
    }
}

impl std::fmt::Display for ComputeKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The device that runs the embedding kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ComputeDevice {
    /// CPU: tables live in DDR.
    #[default]
    Cpu,
    /// CUDA GPU: tables live in HBM (or are cached there).
    Cuda,
}

impl ComputeDevice {
    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

impl Word for ShardingType {
    const WORDS: &'static [Self] = &Self::ALL;
    fn name(self) -> &'static str {
        ShardingType::name(self)
    }
}

impl Word for ComputeKernel {
    const WORDS: &'static [Self] = &Self::ALL;
    fn name(self) -> &'static str {
        ComputeKernel::name(self)
    }
}

impl Word for ComputeDevice {
    const WORDS: &'static [Self] = &[Self::Cpu, Self::Cuda];
    fn name(self) -> &'static str {
        ComputeDevice::name(self)
    }
}
