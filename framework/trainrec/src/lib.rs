//! trainrec: train large recommendation models from a TOML recipe.
//!
//! This facade re-exports the framework's parts. A user's own binary with extra plugins is one
//! line: `trainrec::cli::main_with(trainrec::Registry::builtin().sampler::<MySampler>())`.

pub mod cli;
pub mod report;

pub use trainrec_comm as comm;
pub use trainrec_data as data;
pub use trainrec_embedding as embedding;
pub use trainrec_engine as engine;
pub use trainrec_engine::{EngineError, Job, RunSummary};
pub use trainrec_metrics as metrics;
pub use trainrec_models as models;
pub use trainrec_planner as planner;
pub use trainrec_plugin as plugin;
pub use trainrec_plugin::{
    MetricFactory, PluginKind, Registry, RegistryError, SamplerFactory, TypedMetric, TypedModel, TypedSampler,
    conformance,
};
pub use trainrec_recipe as recipe;
pub use trainrec_sharding as sharding;
pub use trainrec_sparse as sparse;

/// The names most programs need.
pub mod prelude {
    pub use trainrec_data::{Batch, DataError, FeatureSchema, Sampler, SamplerContext, Split};
    pub use trainrec_engine::Job;
    pub use trainrec_metrics::{Metric, MetricError, TaskBatch};
    pub use trainrec_models::{
        Catalogue, CatalogueRequest, CatalogueRows, DenseModel, JaggedEmbeddings, ModelFactory, ModelInput,
        ModelInputs, NextItem,
    };
    pub use trainrec_plugin::{Registry, TypedMetric, TypedModel, TypedSampler};
    pub use trainrec_recipe::{LoadOptions, Recipe};
    pub use trainrec_sparse::{JaggedTensor, KeyedJaggedTensor, KeyedTensor};
}
