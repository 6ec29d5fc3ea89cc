//! `kind = "criteo_tsv"`: the raw Criteo Kaggle / Terabyte layout, streamed line by line.
//!
//! Each line: label, 13 integer features (I1..I13), 26 hexadecimal categorical features
//! (C1..C26), tab separated; any feature may be empty. Dense features become
//! `ln(1 + max(x, 0))` (missing: 0). A categorical value is parsed as hexadecimal (missing: 0)
//! and hashed into its table by `value % rows`, as TorchRec's Criteo preprocessing does.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{Batch, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split, hash_words};

/// Dense columns in the Criteo layout.
pub const NUM_DENSE: usize = 13;
/// Categorical columns in the Criteo layout.
pub const NUM_SPARSE: usize = 26;

/// What to do with a malformed row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BadRowPolicy {
    /// Skip it, count it, and log the first few with file:line.
    Skip,
    /// Stop with an error naming file:line and what is wrong.
    Fail,
}

/// `[data.sampler]` with `kind = "criteo_tsv"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CriteoTsvConfig {
    /// The TSV file, relative to the recipe file's directory.
    pub path: String,
    /// Fraction of rows held out for evaluation, chosen by a hash of (seed, line number):
    /// deterministic, streaming, and the same rows at every evaluation.
    #[serde(default = "defaults::eval_fraction")]
    pub eval_fraction: f64,
    /// What to do with a malformed row (wrong column count, bad label, non-integer dense value,
    /// non-hexadecimal categorical value).
    #[serde(default = "defaults::on_bad_row")]
    pub on_bad_row: BadRowPolicy,
    /// Read at most this many lines of the file.
    #[serde(default)]
    pub max_rows: Option<u64>,
}

mod defaults {
    pub fn eval_fraction() -> f64 {
        0.1
    }
    pub fn on_bad_row() -> super::BadRowPolicy {
        super::BadRowPolicy::Skip
    }
}

/// The Criteo TSV sampler.
#[derive(Clone, Debug)]
pub struct CriteoTsvSampler {
    config: CriteoTsvConfig,
    path: PathBuf,
    schema: FeatureSchema,
    rows: Vec<u64>,
    seed: u64,
}

/// One parsed example.
#[derive(Clone, Debug, PartialEq)]
pub struct CriteoRow {
    /// 0 or 1.
    pub label: f32,
    /// `ln(1 + max(x, 0))` per dense column.
    pub dense: [f32; NUM_DENSE],
    /// Raw categorical values (before hashing).
    pub sparse: [u64; NUM_SPARSE],
}

/// Parses one line of the Criteo layout.
pub fn parse_line(line: &str) -> Result<CriteoRow, String> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let fields: Vec<&str> = line.split('\t').collect();
    if fields.len() != 1 + NUM_DENSE + NUM_SPARSE {
        return Err(format!("expected {} tab-separated columns, found {}", 1 + NUM_DENSE + NUM_SPARSE, fields.len()));
    }
    let label = match fields[0] {
        "0" => 0.0,
        "1" => 1.0,
        other => return Err(format!("label must be 0 or 1, found \"{other}\"")),
    };
    let mut dense = [0f32; NUM_DENSE];
    for (j, f) in fields[1..=NUM_DENSE].iter().enumerate() {
        if !f.is_empty() {
            let x: i64 = f.parse().map_err(|_| format!("I{} must be an integer, found \"{f}\"", j + 1))?;
            dense[j] = (x.max(0) as f64).ln_1p() as f32;
        }
    }
    let mut sparse = [0u64; NUM_SPARSE];
    for (j, f) in fields[1 + NUM_DENSE..].iter().enumerate() {
        if !f.is_empty() {
            sparse[j] =
                u64::from_str_radix(f, 16).map_err(|_| format!("C{} must be hexadecimal, found \"{f}\"", j + 1))?;
        }
    }
    Ok(CriteoRow { label, dense, sparse })
}

impl CriteoTsvSampler {
    /// The features (I1..I13 dense, C1..C26 sparse).
    pub fn feature_schema(_config: &CriteoTsvConfig) -> FeatureSchema {
        FeatureSchema {
            num_dense: NUM_DENSE,
            sparse: (1..=NUM_SPARSE).map(|i| format!("C{i}")).collect(),
            labels: vec!["label".to_owned()],
            grouping_key: None,
        }
    }

    /// Builds the sampler (checks the file can be opened).
    pub fn build(config: CriteoTsvConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        if !(0.0..1.0).contains(&config.eval_fraction) {
            return Err(DataError::Config {
                key: "eval_fraction".into(),
                message: format!("eval_fraction must be in [0, 1), found {}", config.eval_fraction),
            });
        }
        let path = ctx.base_dir.join(&config.path);
        File::open(&path).map_err(|source| DataError::Io { path: path.clone(), source })?;
        let schema = Self::feature_schema(&config);
        let rows = schema.sparse.iter().map(|f| ctx.rows(f)).collect::<Result<Vec<_>, _>>()?;
        Ok(Self { config, path, schema, rows, seed: ctx.seed })
    }

    fn is_eval(&self, line: u64) -> bool {
        let h = hash_words(&[self.seed, 0xC417E0, line]);
        ((h >> 11) as f64 / (1u64 << 53) as f64) < self.config.eval_fraction
    }
}

struct Reader {
    sampler: CriteoTsvSampler,
    lines: std::io::Lines<BufReader<File>>,
    line_no: u64,
    split: Split,
    batch_size: usize,
    skipped: u64,
    done: bool,
}

impl Reader {
    fn next_batch(&mut self) -> Option<Result<Batch, DataError>> {
        if self.done {
            return None;
        }
        let s = &self.sampler;
        let mut labels = Vec::with_capacity(self.batch_size);
        let mut dense = Vec::with_capacity(self.batch_size * NUM_DENSE);
        let mut cats: Vec<[u64; NUM_SPARSE]> = Vec::with_capacity(self.batch_size);
        while labels.len() < self.batch_size {
            if s.config.max_rows.is_some_and(|m| self.line_no >= m) {
                self.done = true;
                break;
            }
            let Some(line) = self.lines.next() else {
                self.done = true;
                break;
            };
            self.line_no += 1;
            let line = match line {
                Ok(l) => l,
                Err(source) => return Some(Err(DataError::Io { path: s.path.clone(), source })),
            };
            if s.is_eval(self.line_no) != (self.split == Split::Eval) {
                continue;
            }
            match parse_line(&line) {
                Ok(row) => {
                    labels.push(row.label);
                    dense.extend_from_slice(&row.dense);
                    cats.push(row.sparse);
                }
                Err(message) if s.config.on_bad_row == BadRowPolicy::Fail => {
                    self.done = true;
                    return Some(Err(DataError::BadRow { file: s.path.clone(), line: self.line_no, message }));
                }
                Err(message) => {
                    self.skipped += 1;
                    if self.skipped <= 5 {
                        tracing::warn!("skipping bad row {}:{}: {message}", s.path.display(), self.line_no);
                    }
                }
            }
        }
        if self.done && self.skipped > 0 {
            tracing::warn!(skipped = self.skipped, "skipped malformed rows in {}", s.path.display());
        }
        let n = labels.len();
        if n == 0 {
            return None;
        }
        let mut values = Vec::with_capacity(n * NUM_SPARSE);
        for f in 0..NUM_SPARSE {
            values.extend(cats.iter().map(|c| (c[f] % s.rows[f]) as i64));
        }
        let sparse = KeyedJaggedTensor::new(s.schema.sparse.clone(), values, None, vec![1; n * NUM_SPARSE], n);
        Some(sparse.map_err(DataError::from).map(|sparse| Batch {
            dense,
            num_dense: NUM_DENSE,
            sparse,
            labels,
            batch_size: n,
            groups: None,
        }))
    }
}

impl Sampler for CriteoTsvSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    /// Rows in file order (the file is chronological); `epoch` does not change the order.
    fn batches(&self, split: Split, _epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        let file = File::open(&self.path).map_err(|source| DataError::Io { path: self.path.clone(), source })?;
        let mut reader = Reader {
            sampler: self.clone(),
            lines: BufReader::new(file).lines(),
            line_no: 0,
            split,
            batch_size: batch_size.max(1),
            skipped: 0,
            done: false,
        };
        Ok(Box::new(std::iter::from_fn(move || reader.next_batch())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn row(label: &str, dense: &[&str], cats: &[&str]) -> String {
        let mut f = vec![label.to_string()];
        f.extend((0..NUM_DENSE).map(|j| dense.get(j).unwrap_or(&"").to_string()));
        f.extend((0..NUM_SPARSE).map(|j| cats.get(j).unwrap_or(&"").to_string()));
        f.join("\t")
    }

    fn ctx(dir: &Path, rows: u64) -> SamplerContext {
        SamplerContext {
            feature_rows: (1..=26).map(|i| (format!("C{i}"), rows)).collect(),
            base_dir: dir.to_path_buf(),
            seed: 3,
        }
    }

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-criteo-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("data.tsv"), text).unwrap();
        dir
    }

    fn config(policy: BadRowPolicy) -> CriteoTsvConfig {
        CriteoTsvConfig { path: "data.tsv".into(), eval_fraction: 0.0, on_bad_row: policy, max_rows: None }
    }

    #[test]
    fn parses_transforms_and_hashes() {
        let r = parse_line(&row("1", &["0", "-3", "", "7"], &["1f", "", "FFFFFFFF"])).unwrap();
        assert_eq!(r.label, 1.0);
        assert_eq!(r.dense[0], 0.0);
        assert_eq!(r.dense[1], 0.0); // negative clipped to 0
        assert_eq!(r.dense[2], 0.0); // missing
        assert!((r.dense[3] - (8f64).ln() as f32).abs() < 1e-7);
        assert_eq!(&r.sparse[..3], &[31, 0, 0xFFFF_FFFF]);
        assert!(parse_line("1\t2").unwrap_err().contains("found 2"));
        assert!(parse_line(&row("2", &[], &[])).unwrap_err().contains("label"));
        assert!(parse_line(&row("0", &["x"], &[])).unwrap_err().contains("I1 must be an integer"));
        assert!(parse_line(&row("0", &[], &["zz"])).unwrap_err().contains("C1 must be hexadecimal"));
    }

    #[test]
    fn batches_skip_or_fail_on_bad_rows() {
        let text = [row("1", &["3"], &["1f", "a"]), "garbage".into(), row("0", &[], &["20"])].join("\n") + "\n";
        let dir = temp_file("skip", &text);
        let s = CriteoTsvSampler::build(config(BadRowPolicy::Skip), &ctx(&dir, 10)).unwrap();
        let batches: Vec<Batch> = s.batches(Split::Train, 0, 8).unwrap().map(Result::unwrap).collect();
        assert_eq!(batches.len(), 1);
        let b = &batches[0];
        assert_eq!(b.labels, vec![1.0, 0.0]);
        assert_eq!(b.sparse.feature(0).values, &[31 % 10, 32 % 10]);
        assert_eq!(b.sparse.feature(1).values, &[0xa % 10, 0]);
        assert!((b.dense[0] - (4f64).ln() as f32).abs() < 1e-7);
        let s = CriteoTsvSampler::build(config(BadRowPolicy::Fail), &ctx(&dir, 10)).unwrap();
        let err = s.batches(Split::Train, 0, 8).unwrap().find_map(Result::err).unwrap();
        let want = format!("{}:2: expected 40 tab-separated columns, found 1", dir.join("data.tsv").display());
        assert_eq!(err.to_string(), want);
        assert!(
            CriteoTsvSampler::build(
                CriteoTsvConfig { path: "missing.tsv".into(), ..config(BadRowPolicy::Skip) },
                &ctx(&dir, 10)
            )
            .is_err()
        );
    }

    #[test]
    fn real_criteo_sample() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/criteo-kaggle-sample");
        if !dir.join("train_examples.txt").exists() {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {} is missing", dir.display());
            eprintln!("skipping: {} not found (the shared datasets are not part of a clone)", dir.display());
            return;
        }
        let cfg = CriteoTsvConfig {
            path: "train_examples.txt".into(),
            eval_fraction: 0.1,
            on_bad_row: BadRowPolicy::Fail,
            max_rows: None,
        };
        let s = CriteoTsvSampler::build(cfg, &ctx(&dir, 1000)).unwrap();
        let count = |split| {
            let (mut n, mut pos) = (0usize, 0.0f32);
            for b in s.batches(split, 0, 999).unwrap() {
                let b = b.unwrap();
                n += b.batch_size;
                pos += b.labels.iter().sum::<f32>();
                assert!(b.sparse.values().iter().all(|&v| (0..1000).contains(&v)));
            }
            (n, pos)
        };
        let (train, train_pos) = count(Split::Train);
        let (eval, eval_pos) = count(Split::Eval);
        assert_eq!(train + eval, 10_000);
        assert_eq!(train_pos + eval_pos, 2182.0);
        assert!((800..1200).contains(&eval), "eval rows {eval}");
    }
}
