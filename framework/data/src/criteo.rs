//! `kind = "criteo_tsv"`: the raw Criteo Kaggle / Terabyte layout, streamed line by line.
//!
//! Each line: label, 13 integer features (I1..I13), 26 hexadecimal categorical features
//! (C1..C26), tab separated; any feature may be empty. Dense features become
//! `ln(1 + max(x, 0))` (missing: 0). A categorical value is parsed as hexadecimal (missing: 0)
//! and hashed into its table by `value % rows`, as TorchRec's Criteo preprocessing does.
//!
//! The file is read by [`crate::stream`]: `num_workers` threads parse blocks of lines and the
//! batches come out in file order whatever their number. With `world_size > 1` a rank reads
//! the lines whose 0-based index is `rank` modulo `world_size` (of both splits); the eval split
//! is a hash of (seed, 1-based line number), so it does not depend on the rank count.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::stream::{self, BadRowPolicy, RowBlock, Shard, SplitRows, TextChunk};
use crate::{BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split};

/// Dense columns in the Criteo layout.
pub const NUM_DENSE: usize = 13;
/// Categorical columns in the Criteo layout.
pub const NUM_SPARSE: usize = 26;

/// The raw Criteo Kaggle / Terabyte TSV layout, streamed line by line. `[data.sampler]` with
/// `kind = "criteo_tsv"`.
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
    /// Threads parsing the file (batches are the same for any number).
    #[serde(default = "defaults::num_workers")]
    pub num_workers: usize,
}

mod defaults {
    pub fn eval_fraction() -> f64 {
        0.1
    }
    pub fn on_bad_row() -> super::BadRowPolicy {
        super::BadRowPolicy::Skip
    }
    pub fn num_workers() -> usize {
        1
    }
}

/// The Criteo TSV sampler.
#[derive(Clone, Debug)]
pub struct CriteoTsvSampler {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: CriteoTsvConfig,
    path: PathBuf,
    schema: FeatureSchema,
    rows: Vec<u64>,
    seed: u64,
    shard: Shard,
    chunk_bytes: usize,
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

/// The features of the Criteo layout: I1..I13 dense, C1..C26 sparse, one label.
pub(crate) fn criteo_features() -> FeatureSchema {
    FeatureSchema {
        num_dense: NUM_DENSE,
        sparse: (1..=NUM_SPARSE).map(|i| format!("C{i}")).collect(),
        labels: vec!["label".to_owned()],
        grouping_key: None,
    }
}

impl CriteoTsvSampler {
    /// The features (I1..I13 dense, C1..C26 sparse).
    pub fn feature_schema(_config: &CriteoTsvConfig) -> FeatureSchema {
        criteo_features()
    }

    /// Builds the sampler (checks the file can be opened).
    /// Checks the config without reading data: the fractions and workers in range, the file
    /// present (relative to `base_dir`); returns the file's path.
    pub fn check(config: &CriteoTsvConfig, base_dir: &std::path::Path) -> Result<std::path::PathBuf, DataError> {
        stream::check_fraction("eval_fraction", config.eval_fraction)?;
        stream::check_workers(config.num_workers)?;
        stream::existing_file(base_dir, &config.path, "path")
    }

    /// Builds the sampler.
    pub fn build(config: CriteoTsvConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        let path = Self::check(&config, &ctx.base_dir)?;
        let shard = Shard::of(ctx)?;
        File::open(&path).map_err(|source| DataError::Io { path: path.clone(), source })?;
        let schema = Self::feature_schema(&config);
        let rows = schema.sparse.iter().map(|f| ctx.rows(f)).collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                path,
                schema,
                rows,
                seed: ctx.seed,
                shard,
                chunk_bytes: stream::TEXT_CHUNK_BYTES,
            }),
        })
    }
}

impl Inner {
    /// Parses the lines of `chunk` that belong to this rank and `split`.
    fn parse_chunk(&self, chunk: TextChunk, split: SplitRows, stop: &AtomicBool) -> Result<RowBlock, DataError> {
        let mut block = RowBlock::new(NUM_DENSE, 1, NUM_SPARSE, false);
        for (line_no, raw) in chunk.lines() {
            if self.config.max_rows.is_some_and(|m| line_no > m) || stop.load(Ordering::Relaxed) {
                break;
            }
            if !self.shard.owns(line_no - 1) || !split.keeps(line_no) {
                continue;
            }
            let parsed =
                std::str::from_utf8(raw).map_err(|_| "line is not valid UTF-8".to_string()).and_then(parse_line);
            match parsed {
                Ok(row) => {
                    block.labels.push(row.label);
                    block.dense.extend_from_slice(&row.dense);
                    for (f, bags) in block.bags.iter_mut().enumerate() {
                        bags.push_one((row.sparse[f] % self.rows[f]) as i64);
                    }
                    block.rows += 1;
                }
                Err(message) => block.bad_row(self.config.on_bad_row, || DataError::BadRow {
                    file: self.path.clone(),
                    line: line_no,
                    message,
                })?,
            }
        }
        Ok(block)
    }
}

impl Sampler for CriteoTsvSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.inner.schema
    }

    /// Rows in file order (the file is chronological); `epoch` does not change the order.
    fn batches(&self, split: Split, _epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        let s = &self.inner;
        let split = SplitRows::new(split, Some(s.config.eval_fraction), s.seed);
        let chunks = stream::text_chunks(&s.path, s.chunk_bytes, s.config.max_rows)?;
        let inner = Arc::clone(&self.inner);
        let parse = move |_: &mut (), chunk, stop: &AtomicBool| inner.parse_chunk(chunk, split, stop);
        let source = s.path.display().to_string();
        Ok(stream::read_batches(&s.schema, source, chunks, s.config.num_workers, || (), parse, batch_size)
            .into_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Batch;
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
            ..Default::default()
        }
    }

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-criteo-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("data.tsv"), text).unwrap();
        dir
    }

    fn config(policy: BadRowPolicy) -> CriteoTsvConfig {
        CriteoTsvConfig {
            path: "data.tsv".into(),
            eval_fraction: 0.0,
            on_bad_row: policy,
            max_rows: None,
            num_workers: 1,
        }
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

    impl CriteoTsvSampler {
        fn with_chunk_bytes(mut self, n: usize) -> Self {
            Arc::get_mut(&mut self.inner).unwrap().chunk_bytes = n;
            self
        }
    }

    /// A file of `n` valid rows; row `i` (0-based) has label `i % 2`, I1 = `i` and C1 = `i`.
    fn numbered(name: &str, n: usize, bad_every: Option<usize>) -> PathBuf {
        let text: String = (0..n)
            .map(|i| {
                if bad_every.is_some_and(|k| i % k == k - 1) {
                    "bad line\n".to_string()
                } else {
                    row(&(i % 2).to_string(), &[&i.to_string()], &[&format!("{i:x}"), "7"]) + "\n"
                }
            })
            .collect();
        temp_file(name, &text)
    }

    fn c1_ids(s: &CriteoTsvSampler, split: Split, bs: usize) -> Vec<i64> {
        let mut out = Vec::new();
        for b in s.batches(split, 0, bs).unwrap() {
            let b = b.unwrap();
            assert!(b.batch_size <= bs);
            out.extend_from_slice(b.sparse.feature(0).values);
        }
        out
    }

    #[test]
    fn batches_do_not_depend_on_workers_or_chunking() {
        let dir = numbered("workers", 2000, Some(97));
        let cfg = |w| CriteoTsvConfig { eval_fraction: 0.2, num_workers: w, ..config(BadRowPolicy::Skip) };
        let want: Vec<i64> =
            (0..2000i64).filter(|i| i % 97 != 96 && !stream::is_eval_row(3, *i as u64 + 1, 0.2)).collect();
        for (w, chunk) in [(1, 1 << 20), (1, 300), (2, 300), (4, 1000), (3, 1)] {
            let s = CriteoTsvSampler::build(cfg(w), &ctx(&dir, 1 << 20)).unwrap().with_chunk_bytes(chunk);
            assert_eq!(c1_ids(&s, Split::Train, 64), want, "workers={w} chunk={chunk}");
            let eval = c1_ids(&s, Split::Eval, 1000);
            assert_eq!(eval.len() + want.len(), 2000 - 2000 / 97);
        }
        // Batches are full except the last.
        let s = CriteoTsvSampler::build(cfg(2), &ctx(&dir, 1 << 20)).unwrap().with_chunk_bytes(500);
        let sizes: Vec<usize> = s.batches(Split::Train, 0, 100).unwrap().map(|b| b.unwrap().batch_size).collect();
        assert!(sizes[..sizes.len() - 1].iter().all(|&n| n == 100));
        assert_eq!(sizes.iter().sum::<usize>(), want.len());
    }

    #[test]
    fn ranks_read_disjoint_line_shares() {
        let dir = numbered("ranks", 1000, None);
        let mut all = Vec::new();
        for rank in 0..3 {
            let c = SamplerContext { rank, world_size: 3, ..ctx(&dir, 1 << 20) };
            let s = CriteoTsvSampler::build(CriteoTsvConfig { num_workers: 2, ..config(BadRowPolicy::Fail) }, &c)
                .unwrap()
                .with_chunk_bytes(700);
            let ids = c1_ids(&s, Split::Train, 50);
            assert!(ids.iter().all(|&i| i % 3 == rank as i64), "rank {rank} reads lines with index % 3 == rank");
            assert_eq!(ids.len(), (1000 + 2 - rank) / 3);
            all.extend(ids);
        }
        all.sort();
        assert_eq!(all, (0..1000).collect::<Vec<i64>>());
        let bad = SamplerContext { rank: 3, world_size: 3, ..ctx(&dir, 10) };
        assert!(CriteoTsvSampler::build(config(BadRowPolicy::Fail), &bad).is_err());
    }

    #[test]
    fn max_rows_and_early_drop() {
        let dir = numbered("take", 5000, None);
        let cfg = CriteoTsvConfig { max_rows: Some(1234), num_workers: 3, ..config(BadRowPolicy::Fail) };
        let s = CriteoTsvSampler::build(cfg, &ctx(&dir, 1 << 20)).unwrap().with_chunk_bytes(256);
        assert_eq!(c1_ids(&s, Split::Train, 100), (0..1234).collect::<Vec<i64>>());
        let cfg = CriteoTsvConfig { num_workers: 4, ..config(BadRowPolicy::Fail) };
        let s = CriteoTsvSampler::build(cfg, &ctx(&dir, 1 << 20)).unwrap().with_chunk_bytes(128);
        for _ in 0..20 {
            let first: Vec<Batch> = s.batches(Split::Train, 0, 7).unwrap().take(2).map(Result::unwrap).collect();
            assert_eq!(first[1].sparse.feature(0).values, &[7, 8, 9, 10, 11, 12, 13]);
        }
    }

    #[test]
    fn fail_reports_the_first_bad_line_whatever_the_workers() {
        let dir = numbered("failorder", 3000, Some(1001));
        for w in [1, 2, 5] {
            let cfg = CriteoTsvConfig { num_workers: w, ..config(BadRowPolicy::Fail) };
            let s = CriteoTsvSampler::build(cfg, &ctx(&dir, 10)).unwrap().with_chunk_bytes(200);
            let results: Vec<Result<Batch, DataError>> = s.batches(Split::Train, 0, 64).unwrap().collect();
            let rows_before: usize = results.iter().filter_map(|r| r.as_ref().ok()).map(|b| b.batch_size).sum();
            let err = results.last().unwrap().as_ref().unwrap_err().to_string();
            assert!(err.contains("data.tsv:1001: expected 40"), "{err}");
            // Every row before the bad line's chunk came out first.
            assert!((1000 - 64..=1000).contains(&rows_before), "{rows_before}");
        }
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
            num_workers: 2,
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
