//! The registry: samplers and models by name. Built-ins register exactly as plugins do.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde_json::Value;
use trainrec_data::{DataError, FeatureSchema, Sampler, SamplerContext};
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

/// Samplers and models by `kind`.
#[derive(Default)]
pub struct Registry {
    samplers: BTreeMap<&'static str, Box<dyn SamplerFactory>>,
    models: BTreeMap<&'static str, Box<dyn ModelFactory>>,
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
