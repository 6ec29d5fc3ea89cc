//! Sharding: embedding tables split over the ranks of a process group by a sharding plan.
//! The [`ShardedEbc`] is an embedding bag collection whose tables are tiled into blocks held by
//! the ranks ([`TableSharding`]), with its input dist (ids to the ranks holding their rows)
//! and output dist (pooled embeddings back to the ranks that own the examples); the
//! [`ShardedEc`] is its unpooled counterpart (one embedding per id, for sequence models). Each
//! rank's shards are computed by a [`TableEngine`](trainrec_embedding::TableEngine) (the CPU
//! collection, or the CUDA one), and the sharded collection is itself an
//! [`EmbeddingEngine`](trainrec_embedding::EmbeddingEngine).
//! Communication is `trainrec-comm`'s [`ProcessGroup`](trainrec_comm::ProcessGroup).
//!
//! The files, in the order of a step: [`tiling`] (the vocabulary), `layout` (who looks up
//! what, built once), `local` (the calls into the engines of this rank's shards), `state`
//! (shards, gathering and loading tables), `ebc` (the collection), `step` (input dist,
//! lookup, output dist, backward), `two_stage` (row blocks summed on their host first),
//! `engine` (the collection as an embedding engine), [`ec`] (the unpooled collection),
//! [`modules`] (sharding a model's modules by a plan).

pub mod conformance;
mod ebc;
pub mod ec;
mod engine;
mod layout;
mod local;
pub mod modules;
mod state;
mod step;
pub mod tiling;
mod two_stage;

pub use ebc::ShardedEbc;
pub use ec::{EcContext, ShardedEc};
pub use layout::hashed_part;
pub use modules::{Module, ShardedModule, ShardingPlan, shard_ebc, shard_ec, shard_modules};
pub use state::LocalShard;
pub use step::{DistContext, InputDist, StepTimes};
pub use tiling::{ShardSpec, TableSharding};

/// An error of a local collection (a module of the sharded collection) as a [`DistError`].
/// An error of a local collection (a module of the sharded collection) as a [`DistError`].
pub(crate) fn module<E: std::fmt::Display>(e: E) -> trainrec_comm::DistError {
    trainrec_comm::DistError::Module(e.to_string())
}
