//! trainrec's CUDA embedding engine: kernels written for trainrec (`kernels/embedding.cu`),
//! compiled at run time with NVRTC and launched through cudarc.
//!
//! - Pooled lookups (sum / mean, per-id weights), sequence lookups (row gathers), and the
//!   backward fused with every sparse optimizer of the CPU engine (SGD, Adagrad, row-wise
//!   Adagrad with its weight-decay modes, Adam, partial row-wise Adam, LAMB), over fp32, fp16
//!   and bf16 weights (round to nearest or stochastic).
//! - Each kernel computes the CPU engine's operations in its order (NVRTC with `-fmad=false`),
//!   so a collection trains bit for bit like [`trainrec_embedding::EmbeddingBagCollection`]:
//!   the tests run the same source compiled as host C++ (crate `trainrec-cuda-emu`) against
//!   the CPU collection; the GPU machine's check (`scripts/device-check`) compares the GPU.
//! - The host lists each batch's id occurrences per table and sorts them into unique-row
//!   segments ([`host::Layout::occurrences`]); the update kernel runs one warp per unique row.
//! - Nothing here needs CUDA to build. At run time [`probe`] says what is missing (driver,
//!   GPU, NVRTC) as an error instead of cudarc's panic on a failed library load.

mod backend;
pub mod check;
mod copy;
mod device;
mod engine;
pub mod host;
mod nvrtc;
mod table;

pub use copy::{CopyStream, Staged};
pub use device::{CudaEbc, DeviceBuffer, GpuInfo, StagedBatch, probe};
pub use nvrtc::{compile_ptx, nvrtc_location};

/// The kernels' source (CUDA C++).
pub const KERNEL_SOURCE: &str = include_str!("../kernels/embedding.cu");

/// Warps per block of every kernel (`WARPS` in the source).
pub const WARPS: u32 = 4;

/// The largest embedding dimension the kernels take (`MAX_DIM` in the source).
pub const MAX_DIM: usize = 1024;

/// The kernels' entry points, each for `f32`, `f16` and `bf16` weights
/// (`trainrec_<kernel>_<precision>`).
pub const KERNELS: [&str; 3] = ["pool", "gather", "update"];

/// Why the CUDA engine cannot run or failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CudaError {
    /// A library or device the engine needs is not there.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// NVRTC rejected the kernels (the log says why).
    #[error("NVRTC could not compile the embedding kernels: {0}")]
    Compile(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// What the kernels do not cover.
    #[error("{0}")]
    Unsupported(String),
    /// A lookup's input is invalid (as the CPU collection reports it).
    #[error(transparent)]
    Embedding(#[from] trainrec_embedding::EmbeddingError),
}

/// Turns a CUDA driver error of call `what` into a [`CudaError::Driver`] naming the call.
pub(crate) fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e:?}"))
}
