//! Builds a training job from a recipe and runs it: the only part that knows all the others.
//!
//! The modules, in the order of a job:
//! - runtime: [`runtime`] (thread pools, libtorch's seeded generator);
//! - inputs: [`inputs`] (the recipe as each part sees it, the plan), [`check`] (validation);
//! - parts: `sparse_arch` (the tables on any backend), [`data_parallel`] (the dense model
//!   across ranks), `gpu` (one GPU per rank), `managed_collisions` (raw ids to rows);
//! - pipeline: `pipeline` (the step and what runs ahead of it);
//! - job: [`job`] (build, the step), `trainer` (the train loop's cadence, stops, checkpoints
//!   and run directory), `job_metrics` (metric suites, evaluation),
//!   [`run_dir`] (the run directory), [`checkpoint`] (save and resume), [`export`];
//! - launch: [`launch`] (one rank, thread ranks, MPI ranks);
//! - for programs that drive their own steps: [`dmp`].

pub mod check;
pub mod checkpoint;
pub mod data_parallel;
pub mod dmp;
mod dynamic_tables;
pub mod error;
pub mod export;
mod gpu;
pub mod inputs;
pub mod job;
mod job_metrics;
pub mod launch;
mod managed_collisions;
mod pipeline;
pub mod reference;
pub mod run_dir;
pub mod runtime;
mod sequence_tables;
mod sparse_arch;
pub mod tensors;
pub mod torchscript;
mod trainer;
/// The registry lives in the plugin crate (plugin authors depend on that crate alone).
pub use trainrec_plugin::registry;

pub use check::{check_loaded, load_and_check};
pub use data_parallel::DataParallel;
pub use dmp::{DistributedModelParallel, StateEntry};
pub use error::EngineError;
pub use gpu::preload_torch_cuda;
pub use job::{Job, build_sampler};
pub use run_dir::RunSummary;
pub use runtime::{configure_threads, with_torch_seed};
pub use trainrec_plugin::{
    MetricFactory, Registry, RegistryError, SamplerFactory, TypedMetric, TypedModel, TypedSampler,
};
