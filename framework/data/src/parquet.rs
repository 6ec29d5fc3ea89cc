//! `kind = "parquet"`: columns of Parquet files mapped to dense features, sparse features and
//! labels.
//!
//! Files are read with the `parquet` crate's column readers (no Arrow): each row group is one
//! chunk of [`crate::stream`], read by one of `num_workers` threads, and batches come out in
//! file and row-group order whatever their number. With `world_size > 1` a rank reads the row
//! groups whose 0-based index (counted across the split's files in order) is `rank` modulo
//! `world_size`, so ranks share the data by whole row groups.
//!
//! Column types:
//!
//! - `dense` and `label` columns: `BOOLEAN`, `INT32`, `INT64`, `FLOAT` or `DOUBLE`, not
//!   repeated. A null dense value is `dense_default`; a null or non-finite label, or a
//!   non-finite dense value, makes the row bad.
//! - `sparse` columns: `INT32` / `INT64` ids (one id per row; null: an empty bag) or a list of
//!   them (a bag of ids; null lists and null elements contribute no id), or `BYTE_ARRAY` /
//!   `FIXED_LEN_BYTE_ARRAY` (string) ids, each replaced by [`string_id`] (the top 63 bits of
//!   [`crate::stream::stable_hash`]). An id `v` is looked up at row `v mod rows` (Euclidean,
//!   so a negative id maps to a valid row too).
//! - the `group` column: an integer or string id per row (strings hashed as above).
//!
//! Logical types are not interpreted: a `DECIMAL` or `TIMESTAMP` stored as an integer is read as
//! that integer. A column is named by its top-level field name (a list column's single leaf is found under
//! it) or by its dotted leaf path (`a.b`).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ::parquet::basic::Type as PhysicalType;
use ::parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use ::parquet::data_type::DataType;
use ::parquet::file::reader::{FileReader, RowGroupReader, SerializedFileReader};
use ::parquet::schema::types::SchemaDescriptor;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{ColumnIndexes, LabelColumns, Role, column_keys};
use crate::stream::{self, RowBlock, Shard, SplitRows};
use crate::{BadRowPolicy, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split};

/// A transform of the dense values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DenseTransform {
    /// The values as they are.
    #[default]
    None,
    /// `ln(1 + max(x, 0))`, as `criteo_tsv` does to Criteo's integer features.
    Log1p,
}

impl DenseTransform {
    /// The transformed value `x`, as an `f32`.
    pub fn apply(self, x: f64) -> f32 {
        match self {
            DenseTransform::None => x as f32,
            DenseTransform::Log1p => x.max(0.0).ln_1p() as f32,
        }
    }
}

/// Parquet files, columns mapped to dense features, sparse id bags and labels.
/// `[data.sampler]` with `kind = "parquet"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ParquetConfig {
    /// The training files, relative to the recipe file's directory: file paths, glob patterns
    /// (`data/part-*.parquet`) or directories (every `*.parquet` file inside). Read in the order
    /// given; a pattern's or directory's files in name order.
    pub paths: Vec<String>,
    /// Eval files, in the same forms. When given, the eval split is these files and
    /// `eval_fraction` must not be set.
    #[serde(default)]
    pub eval_paths: Vec<String>,
    /// Without `eval_paths`: the fraction of training rows held out for evaluation, by a hash
    /// of (seed, row number across the files) (default 0.1).
    #[serde(default)]
    pub eval_fraction: Option<f64>,
    /// Numeric columns that become the dense features, in this order.
    #[serde(default)]
    pub dense: Vec<String>,
    /// The value of a null dense value (before `dense_transform`).
    #[serde(default)]
    pub dense_default: f32,
    /// A transform applied to every dense value.
    #[serde(default)]
    pub dense_transform: DenseTransform,
    /// Sparse features: `feature_name = "column"`. The column holds one integer id, a list of
    /// integer ids (a bag), or string ids (hashed). Features are in feature-name order.
    #[serde(default)]
    pub sparse: BTreeMap<String, String>,
    /// The label column, or a list of label columns (one per task).
    pub label: LabelColumns,
    /// A column with a per-row grouping key (user, query or session id) for grouped AUC and
    /// NDCG; its name becomes the schema's grouping key.
    #[serde(default)]
    pub group: Option<String>,
    /// A numeric column with each row's sample weight (finite, `>= 0`): the loss is the
    /// weighted mean of the per-example losses and every metric weighs the row by it. Unset:
    /// every row weighs 1.
    #[serde(default)]
    pub weight: Option<String>,
    /// What to do with a bad row (null or non-finite label, non-finite dense value, null group,
    /// null, negative or non-finite weight).
    #[serde(default = "defaults::on_bad_row")]
    pub on_bad_row: BadRowPolicy,
    /// Threads reading row groups (batches are the same for any number).
    #[serde(default = "defaults::num_workers")]
    pub num_workers: usize,
}

mod defaults {
    pub fn on_bad_row() -> crate::BadRowPolicy {
        crate::BadRowPolicy::Skip
    }
    pub fn num_workers() -> usize {
        1
    }
}

/// The leaf columns of one file the config's columns resolve to.
#[derive(Clone, Debug)]
struct FilePlan {
    path: PathBuf,
    dense: Vec<usize>,
    sparse: Vec<usize>,
    labels: Vec<usize>,
    group: Option<usize>,
    weight: Option<usize>,
    row_groups: Vec<u64>,
}

/// One row group to read.
#[derive(Clone, Copy, Debug)]
struct Unit {
    file: usize,
    row_group: usize,
    /// 0-based index of the group's first row among the split's rows.
    first_row: u64,
}

/// The Parquet sampler.
#[derive(Clone, Debug)]
pub struct ParquetSampler {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: ParquetConfig,
    schema: FeatureSchema,
    label_names: Vec<String>,
    train: Vec<FilePlan>,
    eval: Vec<FilePlan>,
    eval_fraction: Option<f64>,
    rows: Vec<u64>,
    seed: u64,
    shard: Shard,
}

fn format_err(path: &Path, message: impl Into<String>) -> DataError {
    DataError::Format { path: path.to_path_buf(), message: message.into() }
}

/// Expands `paths` (files, globs, directories) under `base`; a directory stands for its files
/// whose extension is one of `exts` (case-insensitive), in name order.
pub(crate) fn expand(base: &Path, paths: &[String], key: &str, exts: &[&str]) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        let k = format!("{key}[{i}]");
        let full = base.join(p);
        if full.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&full)
                .map_err(|e| DataError::io(&full, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.is_file() && f.extension().is_some_and(|x| exts.iter().any(|e| x.eq_ignore_ascii_case(e)))
                })
                .collect();
            files.sort();
            if files.is_empty() {
                let kinds: Vec<String> = exts.iter().map(|e| format!("*.{e}")).collect();
                return Err(DataError::config(
                    k,
                    format!("directory {} holds no {} file", full.display(), kinds.join(" or ")),
                ));
            }
            out.extend(files);
        } else if p.contains(['*', '?', '[']) {
            let pattern = full.to_string_lossy().into_owned();
            let entries =
                glob::glob(&pattern).map_err(|e| DataError::config(&k, format!("bad glob pattern {p:?}: {e}")))?;
            let mut files = Vec::new();
            for e in entries {
                let f = e.map_err(|e| DataError::config(&k, format!("cannot read a match of {p:?}: {e}")))?;
                if f.is_file() {
                    files.push(f);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(DataError::config(k, format!("no file matches {pattern}")));
            }
            out.extend(files);
        } else if full.is_file() {
            out.push(full);
        } else {
            return Err(DataError::config(k, format!("{} does not exist", full.display())));
        }
    }
    Ok(out)
}

fn open_file(path: &Path) -> Result<SerializedFileReader<File>, DataError> {
    let f = File::open(path).map_err(|e| DataError::io(path, e))?;
    SerializedFileReader::new(f).map_err(|e| format_err(path, format!("not a readable Parquet file: {e}")))
}

/// The file's top-level column names.
fn top_level_names(schema: &SchemaDescriptor) -> Vec<String> {
    schema.root_schema().get_fields().iter().map(|f| f.name().to_string()).collect()
}

/// Resolves `name` to a leaf column of `schema`.
fn resolve(schema: &SchemaDescriptor, name: &str, role: Role, key: &str, path: &Path) -> Result<usize, DataError> {
    let leaves: Vec<usize> = (0..schema.num_columns())
        .filter(|&i| {
            let p = schema.column(i).path().clone();
            p.string() == name || p.parts().first().is_some_and(|f| f == name)
        })
        .collect();
    let exact: Vec<usize> = leaves.iter().copied().filter(|&i| schema.column(i).path().string() == name).collect();
    let leaf = match (exact.as_slice(), leaves.as_slice()) {
        ([one], _) | ([], [one]) => *one,
        ([], []) => {
            let names = top_level_names(schema);
            let mut candidates = names.clone();
            candidates.extend((0..schema.num_columns()).map(|i| schema.column(i).path().string()));
            let hint = crate::did_you_mean(name, candidates.iter().map(String::as_str));
            return Err(DataError::config(
                key,
                format!("{} has no column {name:?}; {hint}its columns: {}", path.display(), names.join(", ")),
            ));
        }
        _ => {
            let paths: Vec<String> = leaves.iter().map(|&i| schema.column(i).path().string()).collect();
            return Err(DataError::config(
                key,
                format!(
                    "column {name:?} of {} has several leaves ({}): name one of them",
                    path.display(),
                    paths.join(", ")
                ),
            ));
        }
    };
    let c = schema.column(leaf);
    let t = c.physical_type();
    let ok = match role {
        Role::Numeric => {
            c.max_rep_level() == 0
                && matches!(
                    t,
                    PhysicalType::BOOLEAN
                        | PhysicalType::INT32
                        | PhysicalType::INT64
                        | PhysicalType::FLOAT
                        | PhysicalType::DOUBLE
                )
        }
        Role::Ids => {
            c.max_rep_level() <= 1
                && matches!(
                    t,
                    PhysicalType::INT32
                        | PhysicalType::INT64
                        | PhysicalType::BYTE_ARRAY
                        | PhysicalType::FIXED_LEN_BYTE_ARRAY
                )
        }
    };
    if !ok {
        let want = match role {
            Role::Numeric => "a single (not repeated) BOOLEAN, INT32, INT64, FLOAT or DOUBLE value",
            Role::Ids => "integer or string ids, one per row or a list of them",
        };
        let repeated =
            if c.max_rep_level() > 0 { format!(", repeated {} deep", c.max_rep_level()) } else { String::new() };
        return Err(DataError::config(
            key,
            format!("column {name:?} of {} is {t}{repeated}; this key needs {want}", path.display()),
        ));
    }
    Ok(leaf)
}

fn plan(files: &[PathBuf], config: &ParquetConfig) -> Result<Vec<FilePlan>, DataError> {
    let mut out = Vec::new();
    for path in files {
        let reader = open_file(path)?;
        let meta = reader.metadata();
        let schema = meta.file_metadata().schema_descr();
        let ColumnIndexes { dense, sparse, labels, group, weight } =
            column_keys!(config).resolve(|name, role, key| resolve(schema, name, role, &key, path))?;
        if let (Some(leaf), Some(g)) = (group, &config.group) {
            if schema.column(leaf).max_rep_level() > 0 {
                return Err(DataError::config(
                    "group",
                    format!("group column {g:?} must hold one id per row, not a list"),
                ));
            }
        }
        let row_groups = meta.row_groups().iter().map(|rg| rg.num_rows().max(0) as u64).collect();
        out.push(FilePlan { path: path.clone(), dense, sparse, labels, group, weight, row_groups });
    }
    Ok(out)
}

fn units(plans: &[FilePlan], shard: Shard) -> Vec<Unit> {
    let (mut out, mut first_row, mut g) = (Vec::new(), 0u64, 0u64);
    for (file, p) in plans.iter().enumerate() {
        for (row_group, &rows) in p.row_groups.iter().enumerate() {
            if shard.owns(g) && rows > 0 {
                out.push(Unit { file, row_group, first_row });
            }
            g += 1;
            first_row += rows;
        }
    }
    out
}

impl ParquetSampler {
    /// The features a config produces (no file is read).
    pub fn feature_schema(config: &ParquetConfig) -> FeatureSchema {
        column_keys!(config).feature_schema()
    }

    /// Builds the sampler: expands the paths and checks every configured column against every
    /// file's schema.
    /// Checks the config without reading data: values in range, the files present (relative
    /// to `base_dir`, patterns and directories expanded). Returns the label columns, the
    /// eval fraction, and the train and eval files.
    #[allow(clippy::type_complexity)]
    pub fn check(
        config: &ParquetConfig,
        base_dir: &std::path::Path,
    ) -> Result<(Vec<String>, Option<f64>, Vec<std::path::PathBuf>, Vec<std::path::PathBuf>), DataError> {
        stream::check_workers(config.num_workers)?;
        if config.paths.is_empty() {
            return Err(DataError::config("paths", "name at least one Parquet file, pattern or directory"));
        }
        let (label_names, eval_fraction) = column_keys!(config).check()?;
        let train = expand(base_dir, &config.paths, "paths", &["parquet"])?;
        let eval = expand(base_dir, &config.eval_paths, "eval_paths", &["parquet"])?;
        Ok((label_names, eval_fraction, train, eval))
    }

    /// Builds the sampler: reads the files' footers.
    pub fn build(config: ParquetConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        let (label_names, eval_fraction, train, eval) = Self::check(&config, &ctx.base_dir)?;
        let shard = Shard::of(ctx)?;
        let schema = Self::feature_schema(&config);
        let rows = schema.sparse.iter().map(|f| ctx.rows(f)).collect::<Result<Vec<_>, _>>()?;
        let train = plan(&train, &config)?;
        let eval = plan(&eval, &config)?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                schema,
                label_names,
                train,
                eval,
                eval_fraction,
                rows,
                seed: ctx.seed,
                shard,
            }),
        })
    }
}

/// The decoded values of one column chunk.
struct Column {
    /// Non-null values: integers (booleans as 0/1, strings hashed) or floats.
    ints: Vec<i64>,
    floats: Vec<f64>,
    is_float: bool,
    def: Vec<i16>,
    rep: Vec<i16>,
    max_def: i16,
    max_rep: i16,
}

fn read_all<T: DataType>(
    r: &mut ColumnReaderImpl<T>,
    rows: usize,
    def: &mut Vec<i16>,
    rep: &mut Vec<i16>,
    values: &mut Vec<T::T>,
) -> ::parquet::errors::Result<usize> {
    let mut got = 0;
    while got < rows {
        let (records, _values, levels) = r.read_records(rows - got, Some(def), Some(rep), values)?;
        if records == 0 && levels == 0 {
            break;
        }
        got += records;
    }
    Ok(got)
}

/// [`read_all`], each value converted by `f` into `out`.
fn read_into<T: DataType, V>(
    r: &mut ColumnReaderImpl<T>,
    rows: usize,
    def: &mut Vec<i16>,
    rep: &mut Vec<i16>,
    out: &mut Vec<V>,
    f: impl Fn(&T::T) -> V,
) -> ::parquet::errors::Result<usize> {
    let mut values = Vec::with_capacity(rows);
    let n = read_all(r, rows, def, rep, &mut values)?;
    out.extend(values.iter().map(f));
    Ok(n)
}

fn read_column(rg: &dyn RowGroupReader, leaf: usize, rows: usize) -> ::parquet::errors::Result<Column> {
    let descr = rg.metadata().schema_descr().column(leaf);
    let (max_def, max_rep) = (descr.max_def_level(), descr.max_rep_level());
    let (mut def, mut rep) = (Vec::with_capacity(rows), Vec::new());
    let (mut ints, mut floats, mut is_float) = (Vec::new(), Vec::new(), false);
    let got = match rg.get_column_reader(leaf)? {
        ColumnReader::BoolColumnReader(mut r) => read_into(&mut r, rows, &mut def, &mut rep, &mut ints, |&b| b as i64)?,
        ColumnReader::Int32ColumnReader(mut r) => {
            read_into(&mut r, rows, &mut def, &mut rep, &mut ints, |&v| v as i64)?
        }
        ColumnReader::Int64ColumnReader(mut r) => read_all(&mut r, rows, &mut def, &mut rep, &mut ints)?,
        ColumnReader::FloatColumnReader(mut r) => {
            is_float = true;
            read_into(&mut r, rows, &mut def, &mut rep, &mut floats, |&v| v as f64)?
        }
        ColumnReader::DoubleColumnReader(mut r) => {
            is_float = true;
            read_all(&mut r, rows, &mut def, &mut rep, &mut floats)?
        }
        ColumnReader::ByteArrayColumnReader(mut r) => {
            read_into(&mut r, rows, &mut def, &mut rep, &mut ints, |b| string_id(b.data()))?
        }
        ColumnReader::FixedLenByteArrayColumnReader(mut r) => {
            read_into(&mut r, rows, &mut def, &mut rep, &mut ints, |b| string_id(b.data()))?
        }
        ColumnReader::Int96ColumnReader(_) => {
            return Err(::parquet::errors::ParquetError::General("INT96 columns are not supported".into()));
        }
    };
    if got != rows {
        return Err(::parquet::errors::ParquetError::General(format!(
            "column {} has {got} records, the row group {rows}",
            descr.path()
        )));
    }
    Ok(Column { ints, floats, is_float, def, rep, max_def, max_rep })
}

impl Column {
    fn value(&self, k: usize) -> f64 {
        if self.is_float { self.floats[k] } else { self.ints[k] as f64 }
    }

    /// One optional value per row (for a non-repeated column): `value(k)` of its `k`-th
    /// non-null value.
    fn per_row<T>(&self, rows: usize, value: impl Fn(usize) -> T) -> Vec<Option<T>> {
        if self.max_def == 0 {
            return (0..rows).map(|k| Some(value(k))).collect();
        }
        let mut k = 0;
        self.def
            .iter()
            .map(|&d| {
                (d == self.max_def).then(|| {
                    k += 1;
                    value(k - 1)
                })
            })
            .collect()
    }

    /// One optional number per row (for a non-repeated column).
    fn scalars(&self, rows: usize) -> Vec<Option<f64>> {
        self.per_row(rows, |k| self.value(k))
    }

    /// One optional integer per row (for a non-repeated id column).
    fn scalar_ids(&self, rows: usize) -> Vec<Option<i64>> {
        self.per_row(rows, |k| self.ints[k])
    }

    /// The ids of each row: (all ids, start offset of each row, `rows + 1` entries).
    fn bags(&self, rows: usize) -> (Vec<i64>, Vec<usize>) {
        if self.max_rep == 0 {
            let ids = self.scalar_ids(rows);
            let mut offsets = Vec::with_capacity(rows + 1);
            offsets.push(0);
            let mut values = Vec::with_capacity(rows);
            for v in ids {
                values.extend(v);
                offsets.push(values.len());
            }
            return (values, offsets);
        }
        let mut offsets = Vec::with_capacity(rows + 1);
        let mut values = Vec::with_capacity(self.ints.len());
        let mut k = 0;
        for (&d, &r) in self.def.iter().zip(&self.rep) {
            if r == 0 {
                offsets.push(values.len());
            }
            if d == self.max_def {
                values.push(self.ints[k]);
                k += 1;
            }
        }
        offsets.push(values.len());
        (values, offsets)
    }
}

type OpenFile = Option<(usize, SerializedFileReader<File>)>;

impl Inner {
    /// Reads the rows of `u` (a row group of `split`'s files) that belong to `split`.
    fn read_unit(
        &self,
        open: &mut OpenFile,
        u: Unit,
        split: SplitRows,
        stop: &AtomicBool,
    ) -> Result<RowBlock, DataError> {
        let plan = &split.files(&self.train, &self.eval)[u.file];
        if open.as_ref().is_none_or(|(f, _)| *f != u.file) {
            *open = Some((u.file, open_file(&plan.path)?));
        }
        let (_, reader) = open.as_ref().expect("opened above");
        let err =
            |e: ::parquet::errors::ParquetError| format_err(&plan.path, format!("row group {}: {e}", u.row_group));
        let rg = reader.get_row_group(u.row_group).map_err(err)?;
        let rows = plan.row_groups[u.row_group] as usize;
        let read = |leaf: usize| read_column(rg.as_ref(), leaf, rows).map_err(err);
        let mut dense_cols = Vec::with_capacity(plan.dense.len());
        for &leaf in &plan.dense {
            dense_cols.push(read(leaf)?.scalars(rows));
        }
        let mut label_cols = Vec::with_capacity(plan.labels.len());
        for &leaf in &plan.labels {
            label_cols.push(read(leaf)?.scalars(rows));
        }
        let mut sparse_cols = Vec::with_capacity(plan.sparse.len());
        for &leaf in &plan.sparse {
            if stop.load(Ordering::Relaxed) {
                return Ok(RowBlock::new(plan.dense.len(), plan.labels.len(), plan.sparse.len(), plan.group.is_some())
                    .weighted(plan.weight.is_some()));
            }
            sparse_cols.push(read(leaf)?.bags(rows));
        }
        let group_col = match plan.group {
            Some(leaf) => Some(read(leaf)?.scalar_ids(rows)),
            None => None,
        };
        let weight_col = match plan.weight {
            Some(leaf) => Some(read(leaf)?.scalars(rows)),
            None => None,
        };
        let c = &self.config;
        let mut block = RowBlock::new(plan.dense.len(), plan.labels.len(), plan.sparse.len(), plan.group.is_some())
            .weighted(plan.weight.is_some());
        'rows: for r in 0..rows {
            if !split.keeps(u.first_row + r as u64 + 1) {
                continue;
            }
            let mut problem = None;
            for (j, col) in label_cols.iter().enumerate() {
                match col[r] {
                    Some(v) if v.is_finite() => {}
                    v => {
                        problem = Some(format!(
                            "label column {:?} is {}",
                            self.label_names[j],
                            v.map_or("null".into(), |v| v.to_string())
                        ));
                        break;
                    }
                }
            }
            if problem.is_none() {
                if let Some(j) = dense_cols.iter().position(|col| col[r].is_some_and(|v| !v.is_finite())) {
                    problem =
                        Some(format!("dense column {:?} is {}", c.dense[j], dense_cols[j][r].unwrap_or_default()));
                }
            }
            if problem.is_none() && group_col.as_ref().is_some_and(|g| g[r].is_none()) {
                problem = Some(format!("group column {:?} is null", c.group.as_deref().unwrap_or_default()));
            }
            if problem.is_none()
                && let Some(w) = weight_col.as_ref().map(|w| w[r])
                && !w.is_some_and(|v| v.is_finite() && v >= 0.0)
            {
                let name = c.weight.as_deref().unwrap_or_default();
                let value = w.map_or("null".into(), |v| v.to_string());
                problem = Some(format!("weight column {name:?} is {value} (weights are finite and >= 0)"));
            }
            if let Some(message) = problem {
                let location = format!("row group {}, row {r}", u.row_group);
                block.bad_row(c.on_bad_row, || DataError::BadRecord { file: plan.path.clone(), location, message })?;
                continue 'rows;
            }
            for col in &label_cols {
                block.labels.push(col[r].unwrap_or_default() as f32);
            }
            for col in &dense_cols {
                block.dense.push(c.dense_transform.apply(col[r].unwrap_or(c.dense_default as f64)));
            }
            for ((bags, (values, offsets)), &rows_f) in block.bags.iter_mut().zip(&sparse_cols).zip(&self.rows) {
                let ids = &values[offsets[r]..offsets[r + 1]];
                bags.values.extend(ids.iter().map(|&v| (v as i128).rem_euclid(rows_f as i128) as i64));
                bags.lengths.push(ids.len() as u32);
            }
            if let (Some(g), Some(col)) = (block.groups.as_mut(), group_col.as_ref()) {
                g.push(col[r].unwrap_or_default());
            }
            if let (Some(w), Some(col)) = (block.weights.as_mut(), weight_col.as_ref()) {
                w.push(col[r].unwrap_or_default() as f32);
            }
            block.rows += 1;
        }
        Ok(block)
    }
}

/// The id of a string: the top 63 bits of its [`stream::stable_hash`] (never negative).
pub fn string_id(bytes: &[u8]) -> i64 {
    (stream::stable_hash(bytes) >> 1) as i64
}

impl Sampler for ParquetSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.inner.schema
    }

    fn weighted(&self) -> bool {
        self.inner.config.weight.is_some()
    }

    /// Rows in file and row-group order; `epoch` does not change the order.
    fn batches(&self, split: Split, _epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        let s = &self.inner;
        let split = SplitRows::new(split, s.eval_fraction, s.seed);
        let plans = split.files(&s.train, &s.eval);
        let source = plans.first().map_or_else(String::new, |p| p.path.display().to_string());
        let work = units(plans, s.shard).into_iter().map(Ok);
        let inner = Arc::clone(&self.inner);
        let read = move |open: &mut OpenFile, u, stop: &AtomicBool| inner.read_unit(open, u, split, stop);
        Ok(stream::read_batches(&s.schema, source, work, s.config.num_workers, || None, read, batch_size)
            .weighted(s.config.weight.is_some())
            .into_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::parquet::data_type::{BoolType, ByteArray, ByteArrayType, DoubleType, FloatType, Int32Type, Int64Type};
    use ::parquet::file::properties::WriterProperties;
    use ::parquet::file::writer::SerializedFileWriter;
    use ::parquet::schema::parser::parse_message_type;

    const SCHEMA: &str = "message m {
        required int64 user;
        optional int32 item;
        optional group tags (LIST) { repeated group list { optional int64 element; } }
        optional binary city (UTF8);
        optional double price;
        required float age;
        required boolean flag;
        optional int32 click;
        required int64 session;
    }";

    /// The test data: row `i` of the generator.
    struct Row {
        user: i64,
        item: Option<i32>,
        tags: Option<Vec<Option<i64>>>,
        city: Option<String>,
        price: Option<f64>,
        age: f32,
        flag: bool,
        click: Option<i32>,
        session: i64,
    }

    fn row(i: i64) -> Row {
        Row {
            user: i,
            item: (i % 7 != 0).then_some(i as i32 * 10),
            tags: match i % 4 {
                0 => None,
                1 => Some(vec![]),
                2 => Some(vec![Some(i), Some(i + 1)]),
                _ => Some(vec![Some(i), None, Some(i + 2)]),
            },
            city: (i % 11 != 0).then(|| format!("c{}", i % 3)),
            price: (i % 5 != 0).then_some(i as f64 * 0.5),
            age: i as f32,
            flag: i % 2 == 0,
            click: (i != 13).then_some((i % 3 == 0) as i32),
            session: i / 4,
        }
    }

    fn opt_levels<T: Clone>(v: &[Option<T>]) -> (Vec<T>, Vec<i16>) {
        (v.iter().flatten().cloned().collect(), v.iter().map(|x| x.is_some() as i16).collect())
    }

    /// Writes rows `range` to `path`, `group` rows per row group.
    fn write(path: &Path, range: std::ops::Range<i64>, group: usize) {
        let schema = Arc::new(parse_message_type(SCHEMA).unwrap());
        let props = Arc::new(WriterProperties::builder().build());
        let mut w = SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
        let rows: Vec<Row> = range.map(row).collect();
        for rg_rows in rows.chunks(group) {
            let mut rg = w.next_row_group().unwrap();
            let mut c = 0;
            while let Some(mut col) = rg.next_column().unwrap() {
                match c {
                    0 => {
                        let v: Vec<i64> = rg_rows.iter().map(|r| r.user).collect();
                        col.typed::<Int64Type>().write_batch(&v, None, None).unwrap();
                    }
                    1 => {
                        let (v, d) = opt_levels(&rg_rows.iter().map(|r| r.item).collect::<Vec<_>>());
                        col.typed::<Int32Type>().write_batch(&v, Some(&d), None).unwrap();
                    }
                    2 => {
                        let (mut v, mut d, mut rep) = (Vec::new(), Vec::new(), Vec::new());
                        for r in rg_rows {
                            match &r.tags {
                                None => {
                                    d.push(0);
                                    rep.push(0);
                                }
                                Some(t) if t.is_empty() => {
                                    d.push(1);
                                    rep.push(0);
                                }
                                Some(t) => {
                                    for (k, e) in t.iter().enumerate() {
                                        rep.push((k > 0) as i16);
                                        d.push(if e.is_some() { 3 } else { 2 });
                                        v.extend(*e);
                                    }
                                }
                            }
                        }
                        col.typed::<Int64Type>().write_batch(&v, Some(&d), Some(&rep)).unwrap();
                    }
                    3 => {
                        let cities: Vec<Option<ByteArray>> =
                            rg_rows.iter().map(|r| r.city.as_ref().map(|c| ByteArray::from(c.as_str()))).collect();
                        let (v, d) = opt_levels(&cities);
                        col.typed::<ByteArrayType>().write_batch(&v, Some(&d), None).unwrap();
                    }
                    4 => {
                        let (v, d) = opt_levels(&rg_rows.iter().map(|r| r.price).collect::<Vec<_>>());
                        col.typed::<DoubleType>().write_batch(&v, Some(&d), None).unwrap();
                    }
                    5 => {
                        let v: Vec<f32> = rg_rows.iter().map(|r| r.age).collect();
                        col.typed::<FloatType>().write_batch(&v, None, None).unwrap();
                    }
                    6 => {
                        let v: Vec<bool> = rg_rows.iter().map(|r| r.flag).collect();
                        col.typed::<BoolType>().write_batch(&v, None, None).unwrap();
                    }
                    7 => {
                        let (v, d) = opt_levels(&rg_rows.iter().map(|r| r.click).collect::<Vec<_>>());
                        col.typed::<Int32Type>().write_batch(&v, Some(&d), None).unwrap();
                    }
                    _ => {
                        let v: Vec<i64> = rg_rows.iter().map(|r| r.session).collect();
                        col.typed::<Int64Type>().write_batch(&v, None, None).unwrap();
                    }
                }
                col.close().unwrap();
                c += 1;
            }
            rg.close().unwrap();
        }
        w.close().unwrap();
    }

    /// Two files in `dir/data`: rows 0..35 (row groups of 10) and 35..60 (row groups of 8).
    fn data_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-parquet-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        write(&dir.join("data/a.parquet"), 0..35, 10);
        write(&dir.join("data/b.parquet"), 35..60, 8);
        dir
    }

    const ROWS: u64 = 1000;

    fn ctx(dir: &Path) -> SamplerContext {
        SamplerContext {
            feature_rows: ["user", "item", "tags", "city"].iter().map(|f| (f.to_string(), ROWS)).collect(),
            base_dir: dir.to_path_buf(),
            seed: 9,
            rank: 0,
            world_size: 1,
        }
    }

    fn config() -> ParquetConfig {
        ParquetConfig {
            paths: vec!["data/*.parquet".into()],
            eval_paths: vec![],
            eval_fraction: Some(0.0),
            dense: vec!["price".into(), "age".into(), "flag".into()],
            dense_default: -1.0,
            dense_transform: DenseTransform::None,
            sparse: [("user", "user"), ("item", "item"), ("tags", "tags"), ("city", "city")]
                .iter()
                .map(|(f, c)| (f.to_string(), c.to_string()))
                .collect(),
            label: LabelColumns::One("click".into()),
            group: Some("session".into()),
            weight: None,
            on_bad_row: BadRowPolicy::Skip,
            num_workers: 1,
        }
    }

    /// One example as the sampler should give it (features in name order: city, item, tags, user).
    #[derive(Debug, PartialEq)]
    struct Example {
        dense: Vec<f32>,
        bags: Vec<Vec<i64>>,
        label: f32,
        group: i64,
    }

    fn expected(i: i64) -> Example {
        let r = row(i);
        let city = r.city.map(|c| string_id(c.as_bytes()) % ROWS as i64).into_iter().collect();
        let item = r.item.map(|v| v as i64 % ROWS as i64).into_iter().collect();
        let tags = r.tags.unwrap_or_default().into_iter().flatten().map(|v| v % ROWS as i64).collect();
        Example {
            dense: vec![r.price.map_or(-1.0, |p| p as f32), r.age, r.flag as u8 as f32],
            bags: vec![city, item, tags, vec![r.user % ROWS as i64]],
            label: r.click.unwrap_or_default() as f32,
            group: r.session,
        }
    }

    fn examples(s: &ParquetSampler, split: Split, bs: usize) -> Vec<Example> {
        let mut out = Vec::new();
        for b in s.batches(split, 0, bs).unwrap() {
            let b = b.unwrap();
            for r in 0..b.batch_size {
                out.push(Example {
                    dense: b.dense[r * 3..r * 3 + 3].to_vec(),
                    bags: (0..4).map(|k| b.sparse.feature(k).bag(r).to_vec()).collect(),
                    label: b.labels[r],
                    group: b.groups.as_ref().unwrap()[r],
                });
            }
        }
        out
    }

    #[test]
    fn columns_map_to_features_with_nulls_lists_and_strings() {
        let dir = data_dir("map");
        let s = ParquetSampler::build(config(), &ctx(&dir)).unwrap();
        assert_eq!(s.schema().sparse, vec!["city", "item", "tags", "user"]);
        assert_eq!(s.schema().grouping_key.as_deref(), Some("session"));
        let got = examples(&s, Split::Train, 7);
        // Row 13 has a null label: skipped.
        let want: Vec<Example> = (0..60).filter(|&i| i != 13).map(expected).collect();
        assert_eq!(got, want);
        assert_ne!(string_id(b"c0"), string_id(b"c1"));
        // Workers and batch sizes do not change the rows.
        for w in [2, 3, 8] {
            let s = ParquetSampler::build(ParquetConfig { num_workers: w, ..config() }, &ctx(&dir)).unwrap();
            assert_eq!(examples(&s, Split::Train, 4), want, "workers={w}");
        }
        // Fail: the bad row's file, row group and row.
        let s =
            ParquetSampler::build(ParquetConfig { on_bad_row: BadRowPolicy::Fail, ..config() }, &ctx(&dir)).unwrap();
        let err = s.batches(Split::Train, 0, 64).unwrap().find_map(Result::err).unwrap().to_string();
        assert!(err.ends_with("a.parquet: row group 1, row 3: label column \"click\" is null"), "{err}");
        // Several label columns and a log transform.
        let cfg = ParquetConfig {
            label: LabelColumns::Many(vec!["flag".into(), "age".into()]),
            dense: vec!["age".into()],
            dense_transform: DenseTransform::Log1p,
            ..config()
        };
        let s = ParquetSampler::build(cfg, &ctx(&dir)).unwrap();
        let b = s.batches(Split::Train, 0, 100).unwrap().next().unwrap().unwrap();
        assert_eq!(b.batch_size, 60);
        assert_eq!(&b.labels[6..8], &[0.0, 3.0]);
        assert_eq!(b.dense[3], (4f64).ln() as f32);
    }

    /// A weight column reaches the batches row for row; a null weight is a bad row.
    #[test]
    fn a_weight_column_weighs_each_row() {
        let dir = data_dir("weights");
        // `price` is `0.5 i`, null when i % 5 == 0; `age` (a dense feature) is `i`.
        let s = ParquetSampler::build(ParquetConfig { weight: Some("price".into()), ..config() }, &ctx(&dir)).unwrap();
        assert!(s.weighted());
        let mut seen = Vec::new();
        for b in s.batches(Split::Train, 0, 7).unwrap() {
            let b = b.unwrap();
            let w = b.weights.as_ref().expect("weights");
            assert_eq!(w.len(), b.batch_size);
            for (r, &w) in w.iter().enumerate() {
                let i = b.dense[r * b.num_dense + 1];
                assert_eq!(w, 0.5 * i, "row {i}");
                seen.push(i as i64);
            }
        }
        let want: Vec<i64> = (0..60).filter(|&i| i != 13 && i % 5 != 0).collect();
        assert_eq!(seen, want);
        let failing = ParquetConfig { weight: Some("price".into()), on_bad_row: BadRowPolicy::Fail, ..config() };
        let s = ParquetSampler::build(failing, &ctx(&dir)).unwrap();
        let err = s.batches(Split::Train, 0, 7).unwrap().find_map(Result::err).unwrap().to_string();
        assert!(
            err.ends_with("row group 0, row 0: weight column \"price\" is null (weights are finite and >= 0)"),
            "{err}"
        );
        let unknown = ParquetSampler::build(ParquetConfig { weight: Some("prize".into()), ..config() }, &ctx(&dir));
        assert!(matches!(unknown, Err(DataError::Config { ref key, .. }) if key == "weight"), "{unknown:?}");
    }

    #[test]
    fn row_groups_are_the_rank_shard() {
        let dir = data_dir("ranks");
        // Row groups in order: a.parquet 0..10, 10..20, 20..30, 30..35; b.parquet 35..43, 43..51,
        // 51..59, 59..60. Rank r of 3 reads groups g with g % 3 == r.
        let groups: Vec<std::ops::Range<i64>> = vec![0..10, 10..20, 20..30, 30..35, 35..43, 43..51, 51..59, 59..60];
        for rank in 0..3 {
            let c = SamplerContext { rank, world_size: 3, ..ctx(&dir) };
            let s = ParquetSampler::build(ParquetConfig { num_workers: 2, ..config() }, &c).unwrap();
            let got: Vec<i64> = examples(&s, Split::Train, 5).iter().map(|e| e.bags[3][0]).collect();
            let want: Vec<i64> = groups
                .iter()
                .enumerate()
                .filter(|(g, _)| g % 3 == rank)
                .flat_map(|(_, r)| r.clone())
                .filter(|&i| i != 13)
                .collect();
            assert_eq!(got, want, "rank {rank}");
        }
    }

    #[test]
    fn splits_paths_and_errors() {
        let dir = data_dir("splits");
        // Hash split: disjoint, together all rows.
        let s = ParquetSampler::build(ParquetConfig { eval_fraction: Some(0.3), ..config() }, &ctx(&dir)).unwrap();
        let ids = |split| examples(&s, split, 9).iter().map(|e| e.bags[3][0]).collect::<Vec<_>>();
        let (train, eval) = (ids(Split::Train), ids(Split::Eval));
        let want_eval: Vec<i64> = (0..60).filter(|&i| i != 13 && stream::is_eval_row(9, i as u64 + 1, 0.3)).collect();
        assert_eq!(eval, want_eval);
        assert_eq!(train.len() + eval.len(), 59);
        // Separate eval files; a directory path.
        let cfg = ParquetConfig {
            paths: vec!["data/a.parquet".into()],
            eval_paths: vec!["data".into()],
            eval_fraction: None,
            ..config()
        };
        let s = ParquetSampler::build(cfg, &ctx(&dir)).unwrap();
        assert_eq!(examples(&s, Split::Train, 100).len(), 34);
        assert_eq!(examples(&s, Split::Eval, 100).len(), 59);
        // Errors name the key (and for columns, the file's columns and a suggestion).
        let mut with_p = ctx(&dir);
        with_p.feature_rows.insert("p".into(), 10);
        let key_of = |cfg: ParquetConfig| match ParquetSampler::build(cfg, &with_p).unwrap_err() {
            DataError::Config { key, message } => (key, message),
            e => panic!("{e}"),
        };
        let (key, msg) = key_of(ParquetConfig { dense: vec!["age".into(), "prise".into()], ..config() });
        assert_eq!(key, "dense[1]");
        assert!(msg.contains("has no column \"prise\"; did you mean \"price\"?"), "{msg}");
        assert!(msg.contains("its columns: user, item, tags, city, price, age, flag, click, session"), "{msg}");
        let mut sparse = config().sparse;
        sparse.insert("p".into(), "price".into());
        let (key, msg) = key_of(ParquetConfig { sparse, ..config() });
        assert_eq!(key, "sparse.p");
        assert!(msg.contains("is DOUBLE; this key needs integer or string ids"), "{msg}");
        let (key, msg) = key_of(ParquetConfig { dense: vec!["tags".into()], ..config() });
        assert_eq!(key, "dense[0]");
        assert!(msg.contains("repeated"), "{msg}");
        let (key, _) = key_of(ParquetConfig { label: LabelColumns::One("clik".into()), ..config() });
        assert_eq!(key, "label");
        let (key, msg) = key_of(ParquetConfig { paths: vec!["nothing/*.parquet".into()], ..config() });
        assert_eq!(key, "paths[0]");
        assert!(msg.contains("no file matches"), "{msg}");
        let (key, _) = key_of(ParquetConfig { eval_paths: vec!["data".into()], eval_fraction: Some(0.1), ..config() });
        assert_eq!(key, "eval_fraction");
        std::fs::write(dir.join("data/c.parquet"), b"not parquet").unwrap();
        let e = ParquetSampler::build(config(), &ctx(&dir)).unwrap_err().to_string();
        assert!(e.contains("c.parquet: not a readable Parquet file"), "{e}");
    }

    #[test]
    fn early_drop_with_many_row_groups() {
        let dir = std::env::temp_dir().join(format!("trainrec-parquet-{}-drop", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        write(&dir.join("data/a.parquet"), 0..3000, 16);
        let s = ParquetSampler::build(ParquetConfig { num_workers: 4, ..config() }, &ctx(&dir)).unwrap();
        for _ in 0..10 {
            let first: Vec<_> = s.batches(Split::Train, 0, 5).unwrap().take(3).map(Result::unwrap).collect();
            assert_eq!(first[2].sparse.feature(3).values, &[10, 11, 12, 14, 15]);
        }
    }
}
