//! The registry: samplers, models and plugin metrics by name. Built-in samplers and models
//! register exactly as plugins do; built-in metrics are the recipe's typed `[[metrics]]` kinds.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;
use trainrec_data::{DataError, FeatureSchema, Sampler, SamplerContext};
use trainrec_metrics::{Metric, MetricError};
use trainrec_models::ModelFactory;

/// Builds a sampler from its recipe section (`[data.sampler]`, `kind` removed).
pub trait SamplerFactory: Send + Sync {
    /// The `kind` this factory registers under.
    fn kind(&self) -> &'static str;
    /// JSON schema of the config (drives validation and the reference page).
    fn config_schema(&self) -> Value;
    /// The features the sampler will produce, known before any file is opened.
    fn feature_schema(&self, config: &Value) -> Result<FeatureSchema, DataError>;
    /// Builds the sampler.
    fn build(&self, config: &Value, ctx: &SamplerContext) -> Result<Box<dyn Sampler>, DataError>;
}

/// A sampler with a typed config: implement this and register it with
/// [`Registry::sampler`]; the registry derives the schema and parsing.
pub trait TypedSampler: Sampler + Sized + 'static {
    /// The sampler's typed config (`deny_unknown_fields`, a doc comment on every field).
    type Config: DeserializeOwned + schemars::JsonSchema;
    /// The `kind` it registers under.
    const KIND: &'static str;
    /// The features a config produces.
    fn features(config: &Self::Config) -> FeatureSchema;
    /// Builds the sampler.
    fn build(config: Self::Config, ctx: &SamplerContext) -> Result<Self, DataError>;
}

struct Typed<S>(std::marker::PhantomData<fn() -> S>);

fn parse<C: DeserializeOwned>(config: &Value) -> Result<C, DataError> {
    serde_path_to_error::deserialize(config)
        .map_err(|e| DataError::Config { key: e.path().to_string(), message: e.inner().to_string() })
}

impl<S: TypedSampler> SamplerFactory for Typed<S> {
    fn kind(&self) -> &'static str {
        S::KIND
    }
    fn config_schema(&self) -> Value {
        serde_json::to_value(schemars::schema_for!(S::Config)).expect("schema serializes")
    }
    fn feature_schema(&self, config: &Value) -> Result<FeatureSchema, DataError> {
        Ok(S::features(&parse::<S::Config>(config)?))
    }
    fn build(&self, config: &Value, ctx: &SamplerContext) -> Result<Box<dyn Sampler>, DataError> {
        Ok(Box::new(S::build(parse(config)?, ctx)?))
    }
}

/// Builds a plugin metric from its recipe entry
/// (`[[metrics]] kind = "plugin", name = "...", options = {...}`).
pub trait MetricFactory: Send + Sync {
    /// The name it registers under (the entry's `name`).
    fn name(&self) -> &'static str;
    /// JSON schema of its `options` (drives validation and the reference page).
    fn config_schema(&self) -> Value;
    /// A fresh metric over a whole eval split.
    fn build(&self, options: &Value) -> Result<Box<dyn Metric>, MetricError>;
}

/// A metric with typed options: implement this and register it with [`Registry::metric`].
/// The metric is fed every eval batch ([`Metric::update_batch`], with the sampler's grouping
/// keys) and reported under the names of [`Metric::output_names`] (with `-<task>` appended
/// in a multi-task job).
pub trait TypedMetric: Metric + Sized + 'static {
    /// The typed options (`deny_unknown_fields`, a doc comment on every field).
    type Config: DeserializeOwned + schemars::JsonSchema;
    /// The name it registers under.
    const NAME: &'static str;
    /// A fresh metric.
    fn build(config: &Self::Config) -> Result<Self, MetricError>;
}

struct TypedMetricFactory<M>(std::marker::PhantomData<fn() -> M>);

impl<M: TypedMetric> MetricFactory for TypedMetricFactory<M> {
    fn name(&self) -> &'static str {
        M::NAME
    }
    fn config_schema(&self) -> Value {
        serde_json::to_value(schemars::schema_for!(M::Config)).expect("schema serializes")
    }
    fn build(&self, options: &Value) -> Result<Box<dyn Metric>, MetricError> {
        let config: M::Config = serde_path_to_error::deserialize(options).map_err(|e| MetricError::Option {
            metric: M::NAME,
            message: format!("options.{}: {}", e.path(), e.inner()),
        })?;
        Ok(Box::new(M::build(&config)?))
    }
}

/// Samplers and models by `kind`, plugin metrics by name.
#[derive(Default)]
pub struct Registry {
    samplers: BTreeMap<&'static str, Box<dyn SamplerFactory>>,
    models: BTreeMap<&'static str, Box<dyn ModelFactory>>,
    metrics: BTreeMap<&'static str, Arc<dyn MetricFactory>>,
}

impl Registry {
    /// An empty registry.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The built-in samplers (`synthetic`, `criteo_tsv`) and models (`dlrm`).
    pub fn builtin() -> Self {
        Self::empty()
            .sampler::<trainrec_data::SyntheticSampler>()
            .sampler::<trainrec_data::CriteoTsvSampler>()
            .model(trainrec_models::DlrmFactory)
    }

    /// Registers a typed sampler.
    pub fn sampler<S: TypedSampler>(self) -> Self {
        self.sampler_factory(Typed::<S>(std::marker::PhantomData))
    }

    /// Registers a sampler factory (replacing one of the same kind).
    pub fn sampler_factory(mut self, factory: impl SamplerFactory + 'static) -> Self {
        self.samplers.insert(factory.kind(), Box::new(factory));
        self
    }

    /// Registers a model factory (replacing one of the same kind).
    pub fn model(mut self, factory: impl ModelFactory + 'static) -> Self {
        self.models.insert(factory.kind(), Box::new(factory));
        self
    }

    /// Registers a typed plugin metric.
    pub fn metric<M: TypedMetric>(self) -> Self {
        self.metric_factory(TypedMetricFactory::<M>(std::marker::PhantomData))
    }

    /// Registers a plugin metric factory (replacing one of the same name).
    pub fn metric_factory(mut self, factory: impl MetricFactory + 'static) -> Self {
        self.metrics.insert(factory.name(), Arc::new(factory));
        self
    }

    /// The plugin metric registered as `name`.
    pub fn metric_for(&self, name: &str) -> Option<Arc<dyn MetricFactory>> {
        self.metrics.get(name).cloned()
    }

    /// Registered plugin metric names, sorted.
    pub fn metric_names(&self) -> Vec<&'static str> {
        self.metrics.keys().copied().collect()
    }

    /// The sampler factory registered as `kind`.
    pub fn sampler_for(&self, kind: &str) -> Option<&dyn SamplerFactory> {
        self.samplers.get(kind).map(|b| b.as_ref())
    }

    /// The model factory registered as `kind`.
    pub fn model_for(&self, kind: &str) -> Option<&dyn ModelFactory> {
        self.models.get(kind).map(|b| b.as_ref())
    }

    /// Registered sampler kinds, sorted.
    pub fn sampler_kinds(&self) -> Vec<&'static str> {
        self.samplers.keys().copied().collect()
    }

    /// Registered model kinds, sorted.
    pub fn model_kinds(&self) -> Vec<&'static str> {
        self.models.keys().copied().collect()
    }
}

impl TypedSampler for trainrec_data::SyntheticSampler {
    type Config = trainrec_data::SyntheticConfig;
    const KIND: &'static str = "synthetic";
    fn features(config: &Self::Config) -> FeatureSchema {
        Self::feature_schema(config)
    }
    fn build(config: Self::Config, ctx: &SamplerContext) -> Result<Self, DataError> {
        trainrec_data::SyntheticSampler::build(config, ctx)
    }
}

impl TypedSampler for trainrec_data::CriteoTsvSampler {
    type Config = trainrec_data::CriteoTsvConfig;
    const KIND: &'static str = "criteo_tsv";
    fn features(config: &Self::Config) -> FeatureSchema {
        Self::feature_schema(config)
    }
    fn build(config: Self::Config, ctx: &SamplerContext) -> Result<Self, DataError> {
        trainrec_data::CriteoTsvSampler::build(config, ctx)
    }
}
