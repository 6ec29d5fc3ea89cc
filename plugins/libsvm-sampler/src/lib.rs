//! An example sampler plugin, written as a user would write one: LIBSVM / SVMlight text files
//! (`<label> <index>:<value> <index>:<value> ...`, one example per line, `#` starts a comment)
//! read as one weighted sparse feature. Each `index:value` pair is an id (`index` modulo the
//! feature's table rows) weighted by `value`, so a table with `pooling = "sum"` computes the
//! weighted sum of its rows, the LIBSVM linear model's features as embeddings.
//!
//! Register it with `Registry::builtin().sampler::<LibSvmSampler>()` and select it in a recipe
//! with `[data.sampler] kind = "libsvm"`.

use std::path::PathBuf;
use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use trainrec_plugin::{
    Batch, BatchStream, DataError, FeatureSchema, KeyedJaggedTensor, Sampler, SamplerContext, Split, TypedSampler,
};

/// LIBSVM / SVMlight text files, each `index:value` pair a weighted id of one sparse feature.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LibSvmConfig {
    /// The file, relative to the recipe's directory.
    pub path: String,
    /// Name of the sparse feature the pairs form (a table must look it up).
    #[serde(default = "default_feature")]
    pub feature: String,
    /// A label above this is a positive (LIBSVM files use `+1/-1` or `1/0`).
    #[serde(default)]
    pub positive_above: f64,
    /// Share of lines held out for evaluation, picked by a hash of the line number and seed.
    #[serde(default = "default_eval_fraction")]
    pub eval_fraction: f64,
    /// Skip malformed lines (counted and logged) instead of failing on the first.
    #[serde(default)]
    pub skip_bad_lines: bool,
}

fn default_feature() -> String {
    "features".into()
}

fn default_eval_fraction() -> f64 {
    0.1
}

/// One parsed line: label and `(index, value)` pairs.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    /// 0 or 1.
    pub label: f32,
    /// The line's pairs, in file order.
    pub pairs: Vec<(u64, f32)>,
}

/// Parses one line; `Ok(None)` for a blank or comment-only line.
pub fn parse_line(line: &str, positive_above: f64) -> Result<Option<Example>, String> {
    let line = line.split('#').next().unwrap_or_default().trim();
    if line.is_empty() {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let label_text = parts.next().unwrap_or_default();
    let label: f64 = label_text.parse().map_err(|_| format!("label must be a number, found {label_text:?}"))?;
    let mut pairs = Vec::new();
    for p in parts {
        let (i, v) = p.split_once(':').ok_or_else(|| format!("expected index:value, found {p:?}"))?;
        let index: u64 = i.parse().map_err(|_| format!("index must be a non-negative integer, found {i:?}"))?;
        let value: f32 = v.parse().map_err(|_| format!("value must be a number, found {v:?}"))?;
        if !value.is_finite() {
            return Err(format!("value of index {index} is not finite"));
        }
        pairs.push((index, value));
    }
    Ok(Some(Example { label: if label > positive_above { 1.0 } else { 0.0 }, pairs }))
}

/// The LIBSVM sampler: the file is read once at build time.
pub struct LibSvmSampler {
    schema: FeatureSchema,
    train: Arc<Vec<Example>>,
    eval: Arc<Vec<Example>>,
    rows: u64,
    seed: u64,
}

/// SplitMix64, for the eval split and the per-epoch shuffle.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn config_error(key: &str, message: String) -> DataError {
    DataError::Config { key: key.into(), message }
}

impl TypedSampler for LibSvmSampler {
    type Config = LibSvmConfig;
    const KIND: &'static str = "libsvm";

    fn features(config: &LibSvmConfig) -> FeatureSchema {
        FeatureSchema {
            num_dense: 0,
            sparse: vec![config.feature.clone()],
            labels: vec!["label".into()],
            grouping_key: None,
        }
    }

    fn check(config: &LibSvmConfig, base_dir: &std::path::Path) -> Result<(), DataError> {
        if !(0.0..1.0).contains(&config.eval_fraction) || config.eval_fraction == 0.0 {
            return Err(config_error("eval_fraction", format!("must be in (0, 1), found {}", config.eval_fraction)));
        }
        let path = base_dir.join(&config.path);
        if !path.is_file() {
            return Err(config_error("path", format!("{} does not exist", path.display())));
        }
        Ok(())
    }

    fn build(config: LibSvmConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        Self::check(&config, &ctx.base_dir)?;
        let rows = ctx.rows(&config.feature)?;
        let path: PathBuf = ctx.base_dir.join(&config.path);
        let text = std::fs::read_to_string(&path).map_err(|source| DataError::Io { path: path.clone(), source })?;
        let (mut train, mut eval, mut bad) = (Vec::new(), Vec::new(), 0u64);
        let cut = (config.eval_fraction * u64::MAX as f64) as u64;
        for (n, line) in text.lines().enumerate() {
            match parse_line(line, config.positive_above) {
                Ok(Some(example)) => {
                    let rank = ctx.rank as u64;
                    if ctx.world_size > 1 && n as u64 % ctx.world_size as u64 != rank {
                        continue; // another rank's line
                    }
                    if mix(ctx.seed ^ mix(n as u64)) < cut { eval.push(example) } else { train.push(example) }
                }
                Ok(None) => {}
                Err(message) if config.skip_bad_lines => {
                    bad += 1;
                    if bad <= 3 {
                        eprintln!("warning: skipping {}:{}: {message}", path.display(), n + 1);
                    }
                }
                Err(message) => return Err(DataError::BadRow { file: path, line: n as u64 + 1, message }),
            }
        }
        if train.is_empty() || eval.is_empty() {
            return Err(config_error(
                "path",
                format!(
                    "{} holds {} training and {} eval examples; both splits need at least one",
                    path.display(),
                    train.len(),
                    eval.len()
                ),
            ));
        }
        Ok(Self { schema: Self::features(&config), train: Arc::new(train), eval: Arc::new(eval), rows, seed: ctx.seed })
    }
}

impl Sampler for LibSvmSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    fn batches(&self, split: Split, epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        if batch_size == 0 {
            return Err(config_error("", "batch size must be positive".into()));
        }
        let examples = match split {
            Split::Train => Arc::clone(&self.train),
            Split::Eval => Arc::clone(&self.eval),
        };
        // Training order: a Fisher-Yates shuffle seeded by (seed, epoch); eval keeps file order.
        let mut order: Vec<usize> = (0..examples.len()).collect();
        if split == Split::Train {
            let mut state = mix(self.seed ^ mix(epoch.wrapping_add(1)));
            for i in (1..order.len()).rev() {
                state = mix(state);
                order.swap(i, (state % (i as u64 + 1)) as usize);
            }
        }
        let (rows, key) = (self.rows, self.schema.sparse[0].clone());
        let chunks: Vec<Vec<usize>> = order.chunks(batch_size).map(<[usize]>::to_vec).collect();
        Ok(Box::new(chunks.into_iter().map(move |idx| {
            let (mut values, mut weights, mut lengths, mut labels) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for &i in &idx {
                let e = &examples[i];
                values.extend(e.pairs.iter().map(|&(index, _)| (index % rows) as i64));
                weights.extend(e.pairs.iter().map(|&(_, v)| v));
                lengths.push(e.pairs.len() as u32);
                labels.push(e.label);
            }
            let n = idx.len();
            Ok(Batch {
                dense: Vec::new(),
                num_dense: 0,
                sparse: KeyedJaggedTensor::new(vec![key.clone()], values, Some(weights), lengths, n)?,
                labels,
                batch_size: n,
                groups: None,
                weights: None,
            })
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainrec_plugin::conformance::SamplerCase;

    #[test]
    fn lines_parse_by_hand() {
        assert_eq!(
            parse_line("+1 3:0.5 17:2 # a comment", 0.0).unwrap(),
            Some(Example { label: 1.0, pairs: vec![(3, 0.5), (17, 2.0)] })
        );
        assert_eq!(parse_line("-1", 0.0).unwrap(), Some(Example { label: 0.0, pairs: vec![] }));
        assert_eq!(parse_line("   # only a comment", 0.0).unwrap(), None);
        assert!(parse_line("1 3-0.5", 0.0).unwrap_err().contains("expected index:value"));
        assert!(parse_line("yes 3:1", 0.0).unwrap_err().contains("label must be a number"));
    }

    #[test]
    fn conforms() {
        SamplerCase::new(r#"path = "data/sample.svm""#)
            .base_dir(env!("CARGO_MANIFEST_DIR"))
            .check::<LibSvmSampler>()
            .assert_ok();
    }

    #[test]
    fn a_bad_line_is_named_by_file_and_line() {
        let dir = std::env::temp_dir().join(format!("trainrec-libsvm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("bad.svm"), "1 1:1\n0 2:x\n").unwrap();
        let ctx = SamplerContext {
            feature_rows: [("features".to_string(), 10)].into(),
            base_dir: dir.clone(),
            ..Default::default()
        };
        let config = LibSvmConfig {
            path: "bad.svm".into(),
            feature: "features".into(),
            positive_above: 0.0,
            eval_fraction: 0.5,
            skip_bad_lines: false,
        };
        let err = LibSvmSampler::build(config, &ctx).err().unwrap().to_string();
        assert!(err.ends_with("bad.svm:2: value must be a number, found \"x\""), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
