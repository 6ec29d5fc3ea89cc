//! Distributed training: the [`ProcessGroup`] trait every communication engine implements, the
//! in-process [`ThreadGroup`] backend, and the [`ShardedEbc`]: an embedding bag collection whose
//! tables are split over the ranks of a group by a sharding plan, with its input dist (ids to
//! the ranks holding their rows) and output dist (pooled embeddings back to the ranks that own
//! the examples), and its unpooled counterpart the [`ShardedEc`] (one embedding per id, for
//! sequence models).

pub mod bench;
pub mod conformance;
pub mod group;
#[cfg(feature = "mpi")]
pub mod mpi_group;
pub mod nccl_group;
pub mod shard;
pub mod shard_engine;
pub mod sharded;
pub mod sharded_ec;
pub mod thread;

pub use group::{DistError, ProcessGroup, ProcessGroupExt, ReduceOp};
#[cfg(feature = "mpi")]
pub use mpi_group::MpiGroup;
pub use nccl_group::NcclGroup;
pub use shard::{Module, ShardedModule, ShardingPlan, shard_ebc, shard_ec, shard_modules};
pub use shard_engine::ShardEngine;
pub use sharded::{DistContext, InputDist, LocalShard, ShardSpec, ShardedEbc, StepTimes, TableSharding};
pub use sharded_ec::{EcContext, ShardedEc};
pub use thread::ThreadGroup;
