//! Reader throughput: rows per second of `criteo_tsv`, `criteo_binary`, `parquet` and `csv` over
//! the same synthetic Criteo-like rows, with each requested worker count.
//!
//! [`bench_readers`] writes the rows to a fresh temporary directory as a Criteo TSV, converts it
//! to TorchRec's binary layout ([`trainrec_data::criteo_binary::convert_tsv`]) and writes a Parquet file
//! (Snappy, `row_group_rows` rows per group; label `INT32`, I1..I13 and C1..C26 optional
//! `INT64`), reads each back through its sampler (one training pass, no eval hold-out; `csv`
//! reads the TSV file, naming its columns with `columns`, categorical values hashed as string
//! ids), and deletes the directory. Each pass goes through each requested shuffle
//! ([`trainrec_data::shuffle`]), so the report shows what `data.shuffle` costs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parquet::basic::Compression;
use parquet::data_type::{Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use trainrec_data::LabelColumns;
use trainrec_data::criteo::{NUM_DENSE, NUM_SPARSE};
use trainrec_data::{
    BadRowPolicy, CriteoBinaryConfig, CriteoBinarySampler, CriteoTsvConfig, CriteoTsvSampler, CsvConfig, CsvSampler,
    DataError, ParquetConfig, ParquetSampler, Sampler, SamplerContext, Shuffle, Split,
};

/// What [`bench_readers`] measures.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchOptions {
    /// Rows of synthetic data.
    pub rows: usize,
    /// Worker counts to measure each reader with.
    pub workers: Vec<usize>,
    /// Batch size of the passes.
    pub batch_size: usize,
    /// Rows per Parquet row group.
    pub row_group_rows: usize,
    /// The shuffles each pass goes through (`data.shuffle`).
    pub shuffles: Vec<Shuffle>,
    /// Where to make the temporary directory (default: the system's temporary directory).
    pub dir: Option<PathBuf>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            rows: 200_000,
            workers: vec![1, 2],
            batch_size: 4096,
            row_group_rows: 16_384,
            shuffles: vec![Shuffle::NONE],
            dir: None,
        }
    }
}

/// One measured pass.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchResult {
    /// The sampler kind (`criteo_tsv`, `criteo_binary`, `parquet`, `csv`).
    pub reader: String,
    /// Worker threads.
    pub num_workers: usize,
    /// The shuffle (`none`, `full`, `buffer:<rows>`).
    pub shuffle: String,
    /// Rows read.
    pub rows: u64,
    /// Wall-clock seconds of the pass.
    pub seconds: f64,
    /// `rows / seconds`.
    pub rows_per_sec: f64,
}

/// All measurements of one [`bench_readers`] call.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchReport {
    /// Rows of synthetic data.
    pub rows: usize,
    /// Size of the TSV file.
    pub tsv_bytes: u64,
    /// Size of the three `.npy` files together.
    pub npy_bytes: u64,
    /// Size of the Parquet file.
    pub parquet_bytes: u64,
    /// Seconds [`trainrec_data::criteo_binary::convert_tsv`] took (one worker).
    pub convert_seconds: f64,
    /// One entry per reader and worker count.
    pub results: Vec<BenchResult>,
}

impl BenchReport {
    /// The report as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a bench report serializes")
    }
}

/// Removes its directory on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One synthetic Criteo-like row: `None` is a missing value.
struct SynthRow {
    label: i32,
    dense: [Option<i64>; NUM_DENSE],
    sparse: [Option<i64>; NUM_SPARSE],
}

fn synth_rows(n: usize, seed: u64) -> Vec<SynthRow> {
    let mut rng = StdRng::seed_from_u64(seed);
    // Per-column cardinalities from tens to millions, like Criteo's.
    let card: Vec<u64> = (0..NUM_SPARSE).map(|j| 10u64.pow(1 + (j as u32 % 6))).collect();
    (0..n)
        .map(|_| {
            let label = rng.random_bool(0.25) as i32;
            let dense = std::array::from_fn(|j| {
                (!rng.random_bool(0.1)).then(|| {
                    let x: f64 = rng.random();
                    (-(1.0 - x).ln() * (1 + j * 20) as f64) as i64 - (j == 1) as i64 * 2
                })
            });
            let sparse = std::array::from_fn(|j| {
                (!rng.random_bool(0.05)).then(|| {
                    // Skewed: the square of a uniform draw favours small ids.
                    let u: f64 = rng.random();
                    (u * u * card[j] as f64) as i64 ^ (0x5A5A_0000 * (j as i64 + 1))
                })
            });
            SynthRow { label, dense, sparse }
        })
        .collect()
}

fn write_tsv(path: &Path, rows: &[SynthRow]) -> Result<(), DataError> {
    let io = |e| DataError::io(path, e);
    let mut w = BufWriter::new(File::create(path).map_err(io)?);
    let mut line = String::new();
    for r in rows {
        use std::fmt::Write as _;
        line.clear();
        let _ = write!(line, "{}", r.label);
        for d in &r.dense {
            line.push('\t');
            if let Some(d) = d {
                let _ = write!(line, "{d}");
            }
        }
        for s in &r.sparse {
            line.push('\t');
            if let Some(s) = s {
                let _ = write!(line, "{s:08x}");
            }
        }
        line.push('\n');
        w.write_all(line.as_bytes()).map_err(io)?;
    }
    w.flush().map_err(io)
}

fn write_parquet(path: &Path, rows: &[SynthRow], row_group_rows: usize) -> Result<(), DataError> {
    let err =
        |e: ::parquet::errors::ParquetError| DataError::Format { path: path.to_path_buf(), message: e.to_string() };
    let mut fields = vec!["required int32 label;".to_string()];
    fields.extend((1..=NUM_DENSE).map(|i| format!("optional int64 I{i};")));
    fields.extend((1..=NUM_SPARSE).map(|i| format!("optional int64 C{i};")));
    let schema = Arc::new(parse_message_type(&format!("message criteo {{ {} }}", fields.join(" "))).map_err(err)?);
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let file = File::create(path).map_err(|e| DataError::io(path, e))?;
    let mut w = SerializedFileWriter::new(file, schema, props).map_err(err)?;
    for group in rows.chunks(row_group_rows.max(1)) {
        let mut rg = w.next_row_group().map_err(err)?;
        let mut c = 0;
        while let Some(mut col) = rg.next_column().map_err(err)? {
            if c == 0 {
                let v: Vec<i32> = group.iter().map(|r| r.label).collect();
                col.typed::<Int32Type>().write_batch(&v, None, None).map_err(err)?;
            } else {
                let get = |r: &SynthRow| if c <= NUM_DENSE { r.dense[c - 1] } else { r.sparse[c - 1 - NUM_DENSE] };
                let v: Vec<i64> = group.iter().filter_map(get).collect();
                let def: Vec<i16> = group.iter().map(|r| get(r).is_some() as i16).collect();
                col.typed::<Int64Type>().write_batch(&v, Some(&def), None).map_err(err)?;
            }
            col.close().map_err(err)?;
            c += 1;
        }
        rg.close().map_err(err)?;
    }
    w.close().map_err(err)?;
    Ok(())
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// One training pass of `sampler` through each of `shuffles`.
fn time_passes(
    reader: &str,
    workers: usize,
    sampler: &dyn Sampler,
    batch_size: usize,
    shuffles: &[Shuffle],
) -> Result<Vec<BenchResult>, DataError> {
    let mut out = Vec::new();
    for shuffle in shuffles {
        let start = Instant::now();
        let mut rows = 0u64;
        let batches = sampler.batches(Split::Train, 0, batch_size)?;
        for b in trainrec_data::shuffled(batches, shuffle, batch_size, trainrec_data::shuffle_seed(0, 0, 0)) {
            rows += b?.batch_size as u64;
        }
        let seconds = start.elapsed().as_secs_f64();
        out.push(BenchResult {
            reader: reader.into(),
            num_workers: workers,
            shuffle: shuffle.to_string(),
            rows,
            seconds,
            rows_per_sec: rows as f64 / seconds.max(1e-9),
        });
    }
    Ok(out)
}

/// Measures the file readers' throughput (see the [module docs](self)); the temporary files
/// are deleted before it returns.
pub fn bench_readers(options: &BenchOptions) -> Result<BenchReport, DataError> {
    let base = options.dir.clone().unwrap_or_else(std::env::temp_dir);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = TempDir(base.join(format!("trainrec-bench-data-{}-{nanos}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| DataError::io(&dir.0, e))?;
    let rows = synth_rows(options.rows, 0xBE4C);
    let (tsv, pq) = (dir.0.join("bench.tsv"), dir.0.join("bench.parquet"));
    write_tsv(&tsv, &rows)?;
    write_parquet(&pq, &rows, options.row_group_rows)?;
    drop(rows);
    let start = Instant::now();
    let conv = trainrec_data::criteo_binary::convert_tsv(&tsv, &dir.0, "bench")?;
    let convert_seconds = start.elapsed().as_secs_f64();
    let ctx = SamplerContext {
        feature_rows: (1..=NUM_SPARSE).map(|i| (format!("C{i}"), 1 << 20)).collect(),
        base_dir: dir.0.clone(),
        seed: 0,
        rank: 0,
        world_size: 1,
    };
    let mut results = Vec::new();
    for &w in &options.workers {
        let tsv_cfg = CriteoTsvConfig {
            path: "bench.tsv".into(),
            eval_fraction: 0.0,
            on_bad_row: BadRowPolicy::Fail,
            max_rows: None,
            num_workers: w,
        };
        results.extend(time_passes(
            "criteo_tsv",
            w,
            &CriteoTsvSampler::build(tsv_cfg, &ctx)?,
            options.batch_size,
            &options.shuffles,
        )?);
        let bin_cfg = CriteoBinaryConfig {
            dir: ".".into(),
            train: vec!["bench".into()],
            eval: vec![],
            eval_fraction: Some(0.0),
            frequency_threshold: 0,
            on_bad_row: BadRowPolicy::Fail,
            num_workers: w,
        };
        results.extend(time_passes(
            "criteo_binary",
            w,
            &CriteoBinarySampler::build(bin_cfg, &ctx)?,
            options.batch_size,
            &options.shuffles,
        )?);
        let pq_cfg = ParquetConfig {
            paths: vec!["bench.parquet".into()],
            eval_paths: vec![],
            eval_fraction: Some(0.0),
            dense: (1..=NUM_DENSE).map(|i| format!("I{i}")).collect(),
            dense_default: 0.0,
            dense_transform: trainrec_data::parquet::DenseTransform::Log1p,
            sparse: (1..=NUM_SPARSE).map(|i| (format!("C{i}"), format!("C{i}"))).collect(),
            label: LabelColumns::One("label".into()),
            group: None,
            weight: None,
            on_bad_row: BadRowPolicy::Fail,
            num_workers: w,
        };
        results.extend(time_passes(
            "parquet",
            w,
            &ParquetSampler::build(pq_cfg, &ctx)?,
            options.batch_size,
            &options.shuffles,
        )?);
        let names = std::iter::once("label".to_string())
            .chain((1..=NUM_DENSE).map(|i| format!("I{i}")))
            .chain((1..=NUM_SPARSE).map(|i| format!("C{i}")));
        let csv_cfg = CsvConfig {
            path: Some("bench.tsv".into()),
            paths: vec![],
            eval_paths: vec![],
            eval_fraction: Some(0.0),
            delimiter: "\t".into(),
            columns: Some(names.collect()),
            dense: (1..=NUM_DENSE).map(|i| format!("I{i}")).collect(),
            dense_default: 0.0,
            dense_transform: trainrec_data::parquet::DenseTransform::Log1p,
            sparse: (1..=NUM_SPARSE).map(|i| (format!("C{i}"), format!("C{i}"))).collect(),
            integer_ids: vec![],
            multi_value: Default::default(),
            label: LabelColumns::One("label".into()),
            group: None,
            weight: None,
            on_bad_row: BadRowPolicy::Fail,
            num_workers: w,
        };
        results.extend(time_passes(
            "csv",
            w,
            &CsvSampler::build(csv_cfg, &ctx)?,
            options.batch_size,
            &options.shuffles,
        )?);
    }
    Ok(BenchReport {
        rows: options.rows,
        tsv_bytes: size(&tsv),
        npy_bytes: size(&conv.dense) + size(&conv.sparse) + size(&conv.labels),
        parquet_bytes: size(&pq),
        convert_seconds,
        results,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_runs_on_a_tiny_size_and_cleans_up() {
        let base = std::env::temp_dir().join(format!("trainrec-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let opts = BenchOptions {
            rows: 3000,
            workers: vec![1, 2],
            batch_size: 256,
            row_group_rows: 500,
            shuffles: vec![Shuffle::NONE, Shuffle::buffer(100)],
            dir: Some(base.clone()),
        };
        let report = bench_readers(&opts).unwrap();
        assert_eq!(report.results.len(), 16);
        for r in &report.results {
            assert_eq!(r.rows, 3000, "{} with {} workers", r.reader, r.num_workers);
            assert!(r.rows_per_sec > 0.0);
        }
        assert!(report.tsv_bytes > 0 && report.npy_bytes > 0 && report.parquet_bytes > 0);
        let json = report.to_json();
        assert_eq!(json["results"][4]["reader"], "parquet");
        assert_eq!(json["results"][6]["reader"], "csv");
        assert_eq!(json["results"][6]["shuffle"], "none");
        assert_eq!(json["results"][7]["shuffle"], "buffer:100");
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 0, "the temporary directory was removed");
        std::fs::remove_dir_all(&base).ok();
    }
}
