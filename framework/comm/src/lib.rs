//! Communication between the ranks of a job: the [`ProcessGroup`] contract (collectives over
//! host buffers) and its backends: [`ThreadGroup`] (ranks as threads of one process), the MPI
//! group (`--features mpi`, ranks as processes under `mpirun`) and [`NcclGroup`] (one GPU per
//! rank). Sharding (which rank holds which rows) is `trainrec-sharding`'s, above this crate.

pub mod group;
#[cfg(feature = "mpi")]
pub mod mpi_group;
pub mod nccl_group;
pub mod thread;

pub use group::{DistError, ProcessGroup, ProcessGroupExt, ReduceOp, offsets};
#[cfg(feature = "mpi")]
pub use mpi_group::MpiGroup;
pub use nccl_group::NcclGroup;
pub use thread::ThreadGroup;
