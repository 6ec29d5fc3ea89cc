//! The plugin API of trainrec: everything a plugin crate needs, in one dependency.
//!
//! - Data sources implement [`Sampler`] and [`TypedSampler`] (a typed config the recipe's
//!   `[data.sampler]` table is parsed into).
//! - Models implement [`DenseModel`] and [`TypedModel`] (the `[model]` table).
//! - Metrics implement [`Metric`] and [`TypedMetric`] (`[[metrics]] kind = "plugin"`).
//! - [`Registry`] collects them: `Registry::builtin().sampler::<MySampler>().model::<MyModel>()`,
//!   handed to `trainrec::cli::main_with` to build one's own `trainrec` binary.
//! - [`conformance`] checks a plugin with one call per plugin, from the plugin's own tests.
//!
//! Built-in samplers and models register through exactly these calls.

pub mod conformance;
pub mod registry;

pub use registry::{
    MetricFactory, PluginEntry, PluginKind, Registry, RegistryError, SamplerFactory, TypedMetric, TypedModel,
    TypedSampler, schema_summary,
};
pub use tch;
pub use trainrec_data::{Batch, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split};
pub use trainrec_metrics::{Metric, MetricError, MetricState, TaskBatch};
pub use trainrec_models::{
    Catalogue, CatalogueRequest, CatalogueRows, DenseModel, JaggedEmbeddings, ModelError, ModelFactory, ModelInput,
    ModelInputs, NextItem,
};
pub use trainrec_sparse::{JaggedTensor, KeyedJaggedTensor, KeyedTensor};
pub use trainrec_types::{Diagnostic, KeyPath};
