//! The registry: samplers, models and plugin metrics by name. Built-in samplers and models
//! register exactly as plugins do; built-in metrics are the recipe's typed `[[metrics]]` kinds.
//!
//! The registry is a builder: `Registry::builtin().sampler::<MySampler>().model::<MyModel>()`.
//! Registering a name twice, or a name that is not snake_case, is recorded and reported by
//! [`Registry::validate`] (which `trainrec::cli::main_with` calls before anything else), so a
//! plugin cannot silently shadow a built-in; [`Registry::without`] removes one on purpose.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;
use trainrec_data::{DataError, FeatureSchema, Sampler, SamplerContext};
use trainrec_metrics::{Metric, MetricError};
use trainrec_models::ModelFactory;
pub use trainrec_models::{TypedModel, TypedModelFactory};

/// Builds a sampler from its recipe section (`[data.sampler]`, `kind` removed).
pub trait SamplerFactory: Send + Sync {
    /// The `kind` this factory registers under.
    fn kind(&self) -> &'static str;
    /// JSON schema of the config (drives validation and the reference page).
    fn config_schema(&self) -> Value;
    /// The features the sampler will produce, known before any file is opened.
    fn feature_schema(&self, config: &Value) -> Result<FeatureSchema, DataError>;
    /// Checks the config without reading data (`trainrec validate` runs it): values in
    /// range, the files it names present (relative paths resolve against `base_dir`).
    fn check(&self, _config: &Value, _base_dir: &std::path::Path) -> Result<(), DataError> {
        Ok(())
    }
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
    /// The config's problems that need no data (`trainrec validate` reports them before any
    /// data is read): values out of range, files that do not exist (relative paths resolve
    /// against `base_dir`). `build` must reject at least these. The default finds none.
    fn check(_config: &Self::Config, _base_dir: &std::path::Path) -> Result<(), DataError> {
        Ok(())
    }
    /// Builds the sampler.
    fn build(config: Self::Config, ctx: &SamplerContext) -> Result<Self, DataError>;
}

struct Typed<S>(std::marker::PhantomData<fn() -> S>);

/// The factory [`Registry::sampler`] registers for a typed sampler.
pub fn typed_sampler_factory<S: TypedSampler>() -> impl SamplerFactory {
    Typed::<S>(std::marker::PhantomData)
}

/// The factory [`Registry::model`] registers for a typed model.
pub fn typed_model_factory<M: TypedModel>() -> impl ModelFactory {
    TypedModelFactory::<M>::default()
}

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
    fn check(&self, config: &Value, base_dir: &std::path::Path) -> Result<(), DataError> {
        S::check(&parse::<S::Config>(config)?, base_dir)
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

/// What kind of plugin a registry entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PluginKind {
    /// A data source (`[data.sampler] kind = ...`).
    Sampler,
    /// A dense model (`[model] kind = ...`).
    Model,
    /// A plugin metric (`[[metrics]] kind = "plugin", name = ...`).
    Metric,
}

impl PluginKind {
    /// `sampler`, `model` or `metric`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sampler => "sampler",
            Self::Model => "model",
            Self::Metric => "metric",
        }
    }
}

/// A registry that cannot be used as built.
#[derive(Debug, thiserror::Error)]
#[error("the plugin registry is inconsistent:\n{}", .problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
pub struct RegistryError {
    /// One line per problem (a duplicate or malformed name).
    pub problems: Vec<String>,
}

/// One registered plugin, as `trainrec list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginEntry {
    /// Sampler, model or metric.
    pub kind: PluginKind,
    /// The name a recipe selects it by.
    pub name: &'static str,
    /// The first sentence of its config's doc comment (empty when it has none).
    pub summary: String,
}

/// The first sentence of a JSON schema's `description` (the config struct's doc comment).
pub fn schema_summary(schema: &Value) -> String {
    let text = schema.get("description").and_then(Value::as_str).unwrap_or_default();
    let first = text.split("\n\n").next().unwrap_or_default().replace('\n', " ");
    match first.find(". ") {
        Some(i) => first[..=i].trim().to_owned(),
        None => first.trim().to_owned(),
    }
}

/// Samplers and models by `kind`, plugin metrics by name.
#[derive(Default)]
pub struct Registry {
    samplers: BTreeMap<&'static str, Box<dyn SamplerFactory>>,
    models: BTreeMap<&'static str, Box<dyn ModelFactory>>,
    metrics: BTreeMap<&'static str, Arc<dyn MetricFactory>>,
    /// Duplicate or malformed registrations, reported by [`Registry::validate`].
    problems: Vec<String>,
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

impl Registry {
    /// An empty registry.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The built-in samplers and models, registered through the same calls a plugin uses.
    pub fn builtin() -> Self {
        Self::empty()
            .sampler::<trainrec_data::SyntheticSampler>()
            .sampler::<trainrec_data::CriteoTsvSampler>()
            .sampler::<trainrec_data::CriteoBinarySampler>()
            .sampler::<trainrec_data::MovieLensSampler>()
            .sampler::<trainrec_data::ParquetSampler>()
            .sampler::<trainrec_data::CsvSampler>()
            .model::<trainrec_models::Dlrm>()
            .model::<trainrec_models::DlrmDcn>()
            .model::<trainrec_models::DeepFm>()
            .model::<trainrec_models::TwoTower>()
            .model::<trainrec_models::Din>()
            .model::<trainrec_models::SasRec>()
    }

    fn note(&mut self, kind: PluginKind, name: &'static str, taken: bool) {
        if taken {
            self.problems.push(format!(
                "{} \"{name}\" is registered twice (remove the first with Registry::without({:?}, \"{name}\") to replace it)",
                kind.name(),
                kind
            ));
        }
        if !valid_name(name) {
            self.problems.push(format!(
                "{} name \"{name}\" must be snake_case: a lowercase letter, then lowercase letters, digits or _",
                kind.name()
            ));
        }
    }

    /// Registers a typed sampler.
    pub fn sampler<S: TypedSampler>(self) -> Self {
        self.sampler_factory(typed_sampler_factory::<S>())
    }

    /// Registers a sampler factory.
    pub fn sampler_factory(mut self, factory: impl SamplerFactory + 'static) -> Self {
        let kind = factory.kind();
        let taken = self.samplers.insert(kind, Box::new(factory)).is_some();
        self.note(PluginKind::Sampler, kind, taken);
        self
    }

    /// Registers a typed model.
    pub fn model<M: TypedModel>(self) -> Self {
        self.model_factory(typed_model_factory::<M>())
    }

    /// Registers a model factory.
    pub fn model_factory(mut self, factory: impl ModelFactory + 'static) -> Self {
        let kind = factory.kind();
        let taken = self.models.insert(kind, Box::new(factory)).is_some();
        self.note(PluginKind::Model, kind, taken);
        self
    }

    /// Registers a typed plugin metric.
    pub fn metric<M: TypedMetric>(self) -> Self {
        self.metric_factory(TypedMetricFactory::<M>(std::marker::PhantomData))
    }

    /// Registers a plugin metric factory.
    pub fn metric_factory(mut self, factory: impl MetricFactory + 'static) -> Self {
        let name = factory.name();
        let taken = self.metrics.insert(name, Arc::new(factory)).is_some();
        self.note(PluginKind::Metric, name, taken);
        self
    }

    /// Removes a registered plugin (to replace a built-in with one's own of the same name).
    /// Removing a name that is not registered is an error [`Registry::validate`] reports.
    pub fn without(mut self, kind: PluginKind, name: &str) -> Self {
        let removed = match kind {
            PluginKind::Sampler => self.samplers.remove(name).is_some(),
            PluginKind::Model => self.models.remove(name).is_some(),
            PluginKind::Metric => self.metrics.remove(name).is_some(),
        };
        if !removed {
            let names = self.names(kind);
            self.problems.push(format!(
                "Registry::without: no {} \"{name}\" is registered; {}",
                kind.name(),
                trainrec_types::suggest(name, &format!("{}s", kind.name()), &names)
            ));
        }
        self
    }

    /// Every duplicate or malformed registration, at once.
    pub fn validate(&self) -> Result<(), RegistryError> {
        if self.problems.is_empty() { Ok(()) } else { Err(RegistryError { problems: self.problems.clone() }) }
    }

    /// The registered names of one kind, sorted.
    pub fn names(&self, kind: PluginKind) -> Vec<&'static str> {
        match kind {
            PluginKind::Sampler => self.samplers.keys().copied().collect(),
            PluginKind::Model => self.models.keys().copied().collect(),
            PluginKind::Metric => self.metrics.keys().copied().collect(),
        }
    }

    /// Every registered plugin with its one-line description: samplers, then models, then
    /// metrics, each sorted by name.
    pub fn entries(&self) -> Vec<PluginEntry> {
        let mut out = Vec::new();
        for (&name, f) in &self.samplers {
            out.push(PluginEntry { kind: PluginKind::Sampler, name, summary: schema_summary(&f.config_schema()) });
        }
        for (&name, f) in &self.models {
            out.push(PluginEntry { kind: PluginKind::Model, name, summary: schema_summary(&f.config_schema()) });
        }
        for (&name, f) in &self.metrics {
            out.push(PluginEntry { kind: PluginKind::Metric, name, summary: schema_summary(&f.config_schema()) });
        }
        out
    }

    /// The plugin metric registered as `name`.
    pub fn metric_for(&self, name: &str) -> Option<Arc<dyn MetricFactory>> {
        self.metrics.get(name).cloned()
    }

    /// Registered plugin metric names, sorted.
    pub fn metric_names(&self) -> Vec<&'static str> {
        self.names(PluginKind::Metric)
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
        self.names(PluginKind::Sampler)
    }

    /// Registered model kinds, sorted.
    pub fn model_kinds(&self) -> Vec<&'static str> {
        self.names(PluginKind::Model)
    }
}

/// The built-in samplers register as any typed sampler does: each has a typed config and the
/// `feature_schema(&config)` / `build(config, &ctx)` pair.
macro_rules! builtin_samplers {
    ($($sampler:ident($config:ident) = $kind:literal;)*) => {$(
        impl TypedSampler for trainrec_data::$sampler {
            type Config = trainrec_data::$config;
            const KIND: &'static str = $kind;
            fn features(config: &Self::Config) -> FeatureSchema {
                Self::feature_schema(config)
            }
            fn check(config: &Self::Config, base_dir: &std::path::Path) -> Result<(), DataError> {
                trainrec_data::$sampler::check(config, base_dir).map(drop)
            }
            fn build(config: Self::Config, ctx: &SamplerContext) -> Result<Self, DataError> {
                trainrec_data::$sampler::build(config, ctx)
            }
        }
    )*};
}

builtin_samplers! {
    SyntheticSampler(SyntheticConfig) = "synthetic";
    CriteoTsvSampler(CriteoTsvConfig) = "criteo_tsv";
    CriteoBinarySampler(CriteoBinaryConfig) = "criteo_binary";
    MovieLensSampler(MovieLensConfig) = "movielens";
    ParquetSampler(ParquetConfig) = "parquet";
    CsvSampler(CsvConfig) = "csv";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_and_bad_names_are_reported_together() {
        let r = Registry::builtin().sampler::<trainrec_data::SyntheticSampler>().model::<trainrec_models::Dlrm>();
        let err = r.validate().unwrap_err();
        assert_eq!(err.problems.len(), 2, "{err}");
        assert!(err.problems[0].contains("sampler \"synthetic\" is registered twice"), "{err}");
        assert!(err.problems[1].contains("model \"dlrm\" is registered twice"), "{err}");
        // Removing the built-in first is the way to replace it.
        let r =
            Registry::builtin().without(PluginKind::Sampler, "synthetic").sampler::<trainrec_data::SyntheticSampler>();
        r.validate().unwrap();
        let err = Registry::builtin().without(PluginKind::Model, "dlmr").validate().unwrap_err();
        assert!(err.problems[0].contains("did you mean `dlrm`?"), "{err}");
    }

    #[test]
    fn names_must_be_snake_case() {
        struct Named(&'static str);
        impl SamplerFactory for Named {
            fn kind(&self) -> &'static str {
                self.0
            }
            fn config_schema(&self) -> Value {
                serde_json::json!({})
            }
            fn feature_schema(&self, _: &Value) -> Result<FeatureSchema, DataError> {
                unreachable!("never built")
            }
            fn build(&self, _: &Value, _: &SamplerContext) -> Result<Box<dyn Sampler>, DataError> {
                unreachable!("never built")
            }
        }
        assert!(Registry::empty().sampler_factory(Named("my_data2")).validate().is_ok());
        for bad in ["", "MyData", "2data", "my-data"] {
            let err = Registry::empty().sampler_factory(Named(bad)).validate().unwrap_err();
            assert!(err.problems[0].contains("must be snake_case"), "{bad}: {err}");
        }
    }

    #[test]
    fn summaries_are_the_first_sentence_of_the_config_doc() {
        assert_eq!(schema_summary(&serde_json::json!({"description": "Reads X. Then more.\n\nDetails."})), "Reads X.");
        assert_eq!(schema_summary(&serde_json::json!({"description": "One line\nwrapped"})), "One line wrapped");
        assert_eq!(schema_summary(&serde_json::json!({})), "");
        let entries = Registry::builtin().entries();
        assert!(entries.iter().all(|e| !e.summary.is_empty()), "{entries:?}");
    }
}
