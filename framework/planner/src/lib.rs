//! trainrec's sharding planner.
//!
//! Turns tables, their per-table [`Constraints`] and a [`Topology`] into a [`Plan`]: which
//! [`ShardingType`] and [`ComputeKernel`] each table uses and which rank holds each shard,
//! chosen to make the slowest rank fastest within every rank's memory. The pieces are
//! TorchRec's: an enumerator of legal options, storage and perf estimators, proposers
//! (greedy with early stop, uniform, grid search, embedding-offload scale-up), partitioners
//! (greedy-perf, memory-balanced) and a heuristic storage reservation. Everything is a pure
//! function of its inputs: the same inputs give the same plan.
//!
//! ```
//! use trainrec_planner::{ComputeDevice, PlanInput, PlannerConfig, TableSpec, Topology, plan};
//! let tables = vec![TableSpec::new("t0", 1_000_000, 64, vec!["f0".into()])];
//! let input = PlanInput { tables, topology: Topology::new(2, ComputeDevice::Cuda), config: PlannerConfig::default() };
//! let p = plan(&input).unwrap();
//! assert_eq!(p.tables[0].shards.iter().map(|s| s.size[0] * s.size[1]).sum::<u64>() % 64_000_000, 0);
//! ```
mod enumerate;
mod estimate;
mod explain;
mod partition;
mod planner;
mod propose;
mod report;
mod types;

pub use enumerate::{check_tables, enumerate, supported_kernels, supported_sharding_types};
pub use explain::explain;
pub use partition::PartitionerKind;
pub use planner::{
    PlacedShard, Plan, PlanInput, PlannerConfig, RankStats, RunnerUp, TablePlan, check_topology, plan, reserve,
};
pub use propose::ProposerKind;
pub use report::{load_plan, render, save_plan};
pub use types::*;

/// Why no plan was made; each names the recipe key at fault.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A constraint's value is invalid on its own.
    #[error("tables[{index}] ({table}): `{key}` {message}")]
    Constraint {
        /// Table name.
        table: String,
        /// Table index in the recipe.
        index: usize,
        /// The constraint key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The constraints leave a table no option.
    #[error("tables[{index}] ({table}): `{key}` leaves no way to shard the table: it {message}")]
    NoOptions {
        /// Table name.
        table: String,
        /// Table index in the recipe.
        index: usize,
        /// The constraint key that removed the options.
        key: String,
        /// What is left.
        message: String,
    },
    /// A topology or planner setting is invalid.
    #[error("topology.{key} {message}")]
    Topology {
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The reservation leaves no memory for tables.
    #[error("{message}")]
    Reservation {
        /// With numbers.
        message: String,
    },
    /// The plan puts a table on a kernel trainrec's engines do not build
    /// ([`ComputeKernel::is_built`]).
    #[error(
        "tables[{index}] ({table}): the plan puts it on the `{kernel}` kernel, which trainrec's engines do not build ({why})"
    )]
    Unbuilt {
        /// Table name.
        table: String,
        /// Table index in the recipe.
        index: usize,
        /// The kernel.
        kernel: String,
        /// Where the plan came from.
        why: String,
    },
    /// No proposal fits in memory.
    #[error("{message}")]
    NoFit {
        /// With numbers and what to change.
        message: String,
    },
    /// A saved plan cannot be used.
    #[error("planner.plan_file {path}: {message}")]
    PlanFile {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}
