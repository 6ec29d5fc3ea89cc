//! A metric from a plugin: registered with `Registry::metric`, named by a recipe's
//! `[[metrics]] kind = "plugin"` entry, its options checked against its own schema (with key
//! and line), and fed every eval batch like the built-ins.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::Deserialize;
use trainrec::engine::load_and_check;
use trainrec::prelude::*;
use trainrec::recipe::LoadOptions;
use trainrec_tests::workspace;

/// The share of positive labels, times `scale` (so its value is checkable against `ctr`).
struct LabelRate {
    scale: f64,
    positives: f64,
    count: f64,
}

/// Options of `label_rate`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct LabelRateConfig {
    /// Multiplies the reported rate.
    #[serde(default = "one")]
    scale: f64,
}

fn one() -> f64 {
    1.0
}

impl Metric for LabelRate {
    fn output_names(&self) -> Vec<String> {
        vec!["label_rate".into()]
    }
    fn update(&mut self, _: &[f32], labels: &[f32], _: Option<&[f32]>) -> Result<(), MetricError> {
        self.positives += labels.iter().map(|&y| f64::from(y)).sum::<f64>();
        self.count += labels.len() as f64;
        Ok(())
    }
    fn compute(&self) -> Vec<(String, f64)> {
        vec![("label_rate".into(), self.scale * self.positives / self.count)]
    }
    fn reset(&mut self) {
        (self.positives, self.count) = (0.0, 0.0);
    }
}

impl TypedMetric for LabelRate {
    type Config = LabelRateConfig;
    const NAME: &'static str = "label_rate";
    fn build(config: &LabelRateConfig) -> Result<Self, MetricError> {
        Ok(Self { scale: config.scale, positives: 0.0, count: 0.0 })
    }
}

fn registry() -> Registry {
    Registry::builtin().metric::<LabelRate>()
}

/// A recipe extending the quickstart with `metrics` (TOML), in a fresh directory.
fn recipe(name: &str, metrics: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-plugin-metrics-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = workspace().join("recipes/quickstart.toml");
    let text = format!(
        "extends = \"{}\"\n\n[run]\nname = \"{name}\"\noutput_dir = \"{}\"\n\n{metrics}",
        base.display(),
        dir.join("run").display()
    );
    let path = dir.join("recipe.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_plugin_metric_is_built_fed_and_reported() {
    let path = recipe(
        "run",
        "[[metrics]]\nkind = \"ctr\"\n\n[[metrics]]\nkind = \"plugin\"\nname = \"label_rate\"\noptions = { scale = 2.0 }\n",
    );
    let options = LoadOptions {
        overrides: ["train.steps=20", "run.threads=1", "train.progress=false", "data.sampler.eval_samples=4096"]
            .map(String::from)
            .to_vec(),
        env: false,
    };
    let registry = registry();
    let (loaded, features) = load_and_check(&path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
    let mut job = Job::build(&loaded, &features, &registry).unwrap();
    let m = job.run().unwrap().eval;
    // Unit weights: the label rate is the CTR, and the option scaled it.
    assert!((m["label_rate"] - 2.0 * m["ctr"]).abs() < 1e-12, "{m:?}");
    assert!(m["ctr"] > 0.05, "{m:?}");
}

#[test]
fn unknown_plugin_metrics_and_bad_options_are_located() {
    let path = recipe(
        "bad",
        "[[metrics]]\nkind = \"plugin\"\nname = \"label_rat\"\n\n[[metrics]]\nkind = \"plugin\"\nname = \"label_rate\"\noptions = { scale = \"big\", bias = 1 }\n",
    );
    let options = LoadOptions { overrides: vec![], env: false };
    let err = load_and_check(&path, &options, &registry()).err().expect("the recipe is rejected").to_string();
    for want in [
        "unknown plugin metric \"label_rat\"",
        "key: metrics[0].name",
        "did you mean `label_rate`?",
        "key: metrics[1].options.scale",
        "key: metrics[1].options.bias",
        "recipe.toml:",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    // Without the plugin linked in, the entry says so.
    let err = load_and_check(&path, &options, &Registry::builtin()).err().unwrap().to_string();
    assert!(err.contains("no plugin metric is registered"), "{err}");
}
