//! Builds a training job from a recipe and runs it: the only part that knows all the others.

pub mod bench;
pub mod bench_pipeline;
pub mod check;
pub mod checkpoint;
mod cuda;
pub mod dist;
pub mod dmp;
pub mod error;
pub mod export;
pub mod job;
mod mc;
pub mod plan;
pub mod reference;
pub mod tensors;
/// The registry lives in the plugin crate (plugin authors depend on that crate alone).
pub use trainrec_plugin::registry;

pub use check::{check_loaded, load_and_check};
pub use cuda::preload_torch_cuda;
pub use dist::DataParallel;
pub use dmp::{DistributedModelParallel, StateEntry};
pub use error::EngineError;
pub use job::{Job, RunSummary, configure_threads, with_torch_seed};
pub use trainrec_plugin::{
    MetricFactory, Registry, RegistryError, SamplerFactory, TypedMetric, TypedModel, TypedSampler,
};
