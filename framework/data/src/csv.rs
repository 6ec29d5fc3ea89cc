//! `kind = "csv"`: delimited text files with a header line, columns mapped to dense features,
//! sparse ids and labels by name, as the Parquet sampler maps its columns.
//!
//! Each file's first line names its columns (a UTF-8 byte order mark before it is ignored); with
//! `columns` set, the files have no header line and those are the names (a file whose first
//! line is exactly those names has it skipped as a header, so headed and headless files mix).
//! Lines end with `\n` or `\r\n`; empty lines are ignored. Fields are separated by `delimiter`
//! and may be quoted as RFC 4180 says (`"a, b"`, `"say ""hi"""`), except that a quoted field
//! cannot span lines: a line that leaves a quote open is a bad row.
//!
//! Values:
//!
//! - `dense` and `label` columns: decimal numbers (surrounding spaces allowed). An empty dense
//!   value is `dense_default`; an empty or non-numeric label, a non-numeric dense value, or a
//!   non-finite one (`inf`, `NaN`) makes the row bad.
//! - `sparse` columns: the value is a string id, replaced by [`string_id`] (the id a Parquet
//!   string column gives the same value, so a categorical column maps alike in both). A feature
//!   listed in `integer_ids` holds integer ids instead, used as numbers (as a Parquet integer
//!   column is; a non-integer value makes the row bad). A feature in `multi_value` holds a bag:
//!   the value is split at its separator (empty pieces are skipped). An empty value is an empty
//!   bag. An id `v` is looked up at row `v mod rows` (Euclidean).
//! - the `group` column: a string id per row, hashed with [`string_id`] (empty: a bad row).
//!
//! The files are read by [`crate::stream`]: `num_workers` threads parse blocks of lines and the
//! batches come out in file order whatever their number. Data lines are numbered across the
//! split's files in order (0-based index `i`, header lines not counted): with `world_size > 1` a
//! rank reads the lines with `i` equal to `rank` modulo `world_size`, and without `eval_paths`
//! the eval split is the lines chosen by a hash of (seed, `i + 1`), the rule of `criteo_tsv`
//! (for one headerless file, `i + 1` is its line number).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::LabelColumns;
use crate::columns::{ColumnIndexes, column_keys};
use crate::parquet::{DenseTransform, expand, string_id};
use crate::stream::{self, RowBlock, Shard, SplitRows, TextChunk};
use crate::{BadRowPolicy, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split};

/// File extensions a directory in `paths` is read for.
const EXTENSIONS: &[&str] = &["csv", "tsv"];
/// The longest header line read.
const MAX_HEADER_BYTES: u64 = 16 << 20;
/// A UTF-8 byte order mark.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Delimited text files with a header, columns mapped to dense features, sparse ids and
/// labels. `[data.sampler]` with `kind = "csv"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CsvConfig {
    /// One training file, relative to the recipe file's directory (the same as `paths` with one
    /// entry; set one of the two).
    #[serde(default)]
    pub path: Option<String>,
    /// The training files, relative to the recipe file's directory: file paths, glob patterns
    /// (`data/part-*.csv`) or directories (every `*.csv` and `*.tsv` file inside). Read in the
    /// order given; a pattern's or directory's files in name order.
    #[serde(default)]
    pub paths: Vec<String>,
    /// Eval files, in the same forms. When given, the eval split is these files and
    /// `eval_fraction` must not be set.
    #[serde(default)]
    pub eval_paths: Vec<String>,
    /// Without `eval_paths`: the fraction of training lines held out for evaluation, by a hash
    /// of (seed, data line number across the files), as `criteo_tsv` does (default 0.1).
    #[serde(default)]
    pub eval_fraction: Option<f64>,
    /// The field separator: one ASCII character other than `"` (default `","`; `"\t"` for
    /// tab-separated files).
    #[serde(default = "defaults::delimiter")]
    pub delimiter: String,
    /// Column names for files without a header line. Unset: each file's first line is its
    /// header. Set: every line is data, except a first line that is exactly these names.
    #[serde(default)]
    pub columns: Option<Vec<String>>,
    /// Numeric columns that become the dense features, in this order.
    #[serde(default)]
    pub dense: Vec<String>,
    /// The value of an empty dense field (before `dense_transform`).
    #[serde(default)]
    pub dense_default: f32,
    /// A transform applied to every dense value.
    #[serde(default)]
    pub dense_transform: DenseTransform,
    /// Sparse features: `feature_name = "column"`. Values are string ids (hashed), integer ids
    /// for the features in `integer_ids`, bags for those in `multi_value`. Features are in
    /// feature-name order.
    #[serde(default)]
    pub sparse: BTreeMap<String, String>,
    /// Sparse features (keys of `sparse`) whose values are integer ids, used as numbers rather
    /// than hashed as strings.
    #[serde(default)]
    pub integer_ids: Vec<String>,
    /// Sparse features whose values are bags of ids: `feature_name = "separator"`, for example
    /// `genres = "|"` for `Comedy|Drama`.
    #[serde(default)]
    pub multi_value: BTreeMap<String, String>,
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
    /// What to do with a bad row (wrong field count, open quote, bad or empty label, bad dense
    /// value, bad integer id, empty group, bad, empty or negative weight).
    #[serde(default = "defaults::on_bad_row")]
    pub on_bad_row: BadRowPolicy,
    /// Threads parsing the files (batches are the same for any number).
    #[serde(default = "defaults::num_workers")]
    pub num_workers: usize,
}

mod defaults {
    pub fn delimiter() -> String {
        ",".into()
    }
    pub fn on_bad_row() -> crate::BadRowPolicy {
        crate::BadRowPolicy::Skip
    }
    pub fn num_workers() -> usize {
        1
    }
}

/// The field indexes one file's columns resolve to.
#[derive(Clone, Debug)]
struct FilePlan {
    path: PathBuf,
    /// Whether line 1 is a header (not data).
    header: bool,
    /// Fields per line.
    fields: usize,
    dense: Vec<usize>,
    sparse: Vec<usize>,
    labels: Vec<usize>,
    group: Option<usize>,
    weight: Option<usize>,
}

/// One block of lines to parse.
#[derive(Debug)]
struct Unit {
    /// Index of the file in the split's plans.
    file: usize,
    /// 0-based index, among the split's data lines, of the file's first data line.
    row_base: u64,
    chunk: TextChunk,
}

/// The CSV sampler.
#[derive(Clone, Debug)]
pub struct CsvSampler {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: CsvConfig,
    schema: FeatureSchema,
    label_names: Vec<String>,
    /// (feature, column) in feature order.
    sparse: Vec<(String, String)>,
    /// Per sparse feature: integer ids rather than string ids.
    integer: Vec<bool>,
    /// Per sparse feature: the bag separator.
    separators: Vec<Option<Vec<u8>>>,
    delimiter: u8,
    train: Vec<FilePlan>,
    eval: Vec<FilePlan>,
    eval_fraction: Option<f64>,
    rows: Vec<u64>,
    seed: u64,
    shard: Shard,
    chunk_bytes: usize,
}

/// Splits one line into its fields at `delim`, undoing RFC 4180 quoting (a field that starts
/// with `"` runs to the next lone `"`, and `""` inside it is one `"`). A `"` inside an unquoted
/// field is kept as it is.
fn split_fields<'a>(line: &'a [u8], delim: u8, out: &mut Vec<Cow<'a, [u8]>>) -> Result<(), String> {
    out.clear();
    let n = line.len();
    let mut i = 0;
    loop {
        if i < n && line[i] == b'"' {
            let start = i + 1;
            let (mut j, mut seg) = (start, start);
            let mut owned: Option<Vec<u8>> = None;
            loop {
                let Some(k) = line[j..].iter().position(|&b| b == b'"') else {
                    return Err(format!(
                        "field {} opens a quote that does not close on this line (a quoted field cannot span lines)",
                        out.len() + 1
                    ));
                };
                let q = j + k;
                if line.get(q + 1) == Some(&b'"') {
                    owned.get_or_insert_with(Vec::new).extend_from_slice(&line[seg..=q]);
                    j = q + 2;
                    seg = j;
                } else {
                    out.push(match owned.take() {
                        Some(mut v) => {
                            v.extend_from_slice(&line[seg..q]);
                            Cow::Owned(v)
                        }
                        None => Cow::Borrowed(&line[start..q]),
                    });
                    i = q + 1;
                    break;
                }
            }
            if i == n {
                return Ok(());
            }
            if line[i] != delim {
                return Err(format!("field {} has characters after its closing quote", out.len()));
            }
            i += 1;
        } else {
            match line[i..].iter().position(|&b| b == delim) {
                Some(k) => {
                    out.push(Cow::Borrowed(&line[i..i + k]));
                    i += k + 1;
                }
                None => {
                    out.push(Cow::Borrowed(&line[i..]));
                    return Ok(());
                }
            }
        }
    }
}

/// A field for a message: lossy UTF-8, at most 40 characters.
fn show(field: &[u8]) -> String {
    let s = String::from_utf8_lossy(field);
    if s.chars().count() > 40 { format!("{}...", s.chars().take(40).collect::<String>()) } else { s.into_owned() }
}

/// A decimal number, `None` for an empty field, `Err` when it is not a number.
fn number(field: &[u8]) -> Result<Option<f64>, ()> {
    let t = field.trim_ascii();
    if t.is_empty() {
        return Ok(None);
    }
    std::str::from_utf8(t).ok().and_then(|s| s.parse::<f64>().ok()).map(Some).ok_or(())
}

/// The first line of `path` (without its line end or a byte order mark), `None` when the file
/// is empty.
fn first_line(path: &Path) -> Result<Option<Vec<u8>>, DataError> {
    let f = File::open(path).map_err(|e| DataError::io(path, e))?;
    let mut r = BufReader::new(f).take(MAX_HEADER_BYTES);
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line).map_err(|e| DataError::io(path, e))?;
    if line.is_empty() {
        return Ok(None);
    }
    if !line.ends_with(b"\n") && line.len() as u64 == MAX_HEADER_BYTES {
        return Err(DataError::BadRow {
            file: path.to_path_buf(),
            line: 1,
            message: format!("the first line is longer than {MAX_HEADER_BYTES} bytes; is this a delimited text file?"),
        });
    }
    let line = line.strip_suffix(b"\n").unwrap_or(&line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    Ok(Some(line.strip_prefix(BOM).unwrap_or(line).to_vec()))
}

/// Where the column names of a file come from (for messages).
enum NamesFrom<'a> {
    Header(&'a Path),
    Columns,
}

/// The index of column `name` among `names`.
fn resolve(names: &[String], name: &str, key: &str, from: &NamesFrom) -> Result<usize, DataError> {
    let found: Vec<usize> = names.iter().enumerate().filter(|(_, n)| *n == name).map(|(i, _)| i).collect();
    let whose = match from {
        NamesFrom::Header(p) => format!("the header of {}", p.display()),
        NamesFrom::Columns => "`columns`".to_string(),
    };
    match found.as_slice() {
        [one] => Ok(*one),
        [] => {
            let hint = crate::did_you_mean(name, names.iter().map(String::as_str));
            Err(DataError::config(
                key,
                format!("{whose} has no column {name:?}; {hint}its columns: {}", names.join(", ")),
            ))
        }
        many => Err(DataError::config(
            key,
            format!(
                "column {name:?} appears {} times in {whose} (fields {}): the name must be unique",
                many.len(),
                many.iter().map(|i| (i + 1).to_string()).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

impl CsvSampler {
    /// The features a config produces (no file is read).
    pub fn feature_schema(config: &CsvConfig) -> FeatureSchema {
        column_keys!(config).feature_schema()
    }

    /// Checks the config without reading data: values in range, the files present (relative
    /// to `base_dir`, patterns and directories expanded).
    pub fn check(config: &CsvConfig, base_dir: &std::path::Path) -> Result<(), DataError> {
        Self::checked(config, base_dir).map(drop)
    }

    /// [`Self::check`], returning the delimiter, the label columns, the eval fraction, and
    /// the train and eval files.
    #[allow(clippy::type_complexity)]
    fn checked(
        config: &CsvConfig,
        base_dir: &std::path::Path,
    ) -> Result<(u8, Vec<String>, Option<f64>, Vec<PathBuf>, Vec<PathBuf>), DataError> {
        stream::check_workers(config.num_workers)?;
        let delimiter = match config.delimiter.as_bytes() {
            [b] if b.is_ascii() && !matches!(b, b'"' | b'\n' | b'\r') => *b,
            _ => {
                return Err(DataError::config(
                    "delimiter",
                    format!(
                        "delimiter must be one ASCII character other than '\"' or a line end, found {:?}",
                        config.delimiter
                    ),
                ));
            }
        };
        let paths = match (&config.path, config.paths.is_empty()) {
            (Some(_), false) => return Err(DataError::config("path", "set either path or paths, not both")),
            (Some(p), true) => vec![p.clone()],
            (None, false) => config.paths.clone(),
            (None, true) => {
                return Err(DataError::config("paths", "name at least one file, pattern or directory (path or paths)"));
            }
        };
        let path_key = if config.path.is_some() { "path" } else { "paths" };
        let (label_names, eval_fraction) = column_keys!(config).check()?;
        let features: Vec<&str> = config.sparse.keys().map(String::as_str).collect();
        let unknown_feature = |key: String, f: &str| {
            let hint = crate::did_you_mean(f, features.iter().copied());
            DataError::config(
                key,
                format!("{f:?} is not a sparse feature; {hint}the sparse features: {}", features.join(", ")),
            )
        };
        for (i, f) in config.integer_ids.iter().enumerate() {
            if !config.sparse.contains_key(f) {
                return Err(unknown_feature(format!("integer_ids[{i}]"), f));
            }
        }
        for (f, sep) in &config.multi_value {
            let key = format!("multi_value.{f}");
            if !config.sparse.contains_key(f) {
                return Err(unknown_feature(key, f));
            }
            if sep.is_empty() || sep.as_bytes().contains(&delimiter) || sep.contains(['\n', '\r']) {
                return Err(DataError::config(
                    key,
                    format!(
                        "the separator of {f:?} must be non-empty and hold neither the delimiter nor a line end, found {sep:?}"
                    ),
                ));
            }
        }
        if let Some(cols) = &config.columns {
            if cols.is_empty() {
                return Err(DataError::config("columns", "name at least one column (or leave columns unset)"));
            }
            if let Some(dup) = cols.iter().enumerate().find_map(|(i, c)| cols[..i].contains(c).then_some(c)) {
                return Err(DataError::config("columns", format!("column {dup:?} is listed twice")));
            }
        }
        let train_files = expand(base_dir, &paths, path_key, EXTENSIONS)?;
        let eval_files = expand(base_dir, &config.eval_paths, "eval_paths", EXTENSIONS)?;
        Ok((delimiter, label_names, eval_fraction, train_files, eval_files))
    }

    /// Builds the sampler: expands the paths, reads each file's header and checks every
    /// configured column against it.
    pub fn build(config: CsvConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        let (delimiter, label_names, eval_fraction, train_files, eval_files) = Self::checked(&config, &ctx.base_dir)?;
        let shard = Shard::of(ctx)?;
        let schema = Self::feature_schema(&config);
        let rows = schema.sparse.iter().map(|f| ctx.rows(f)).collect::<Result<Vec<_>, _>>()?;
        let train = plan(&train_files, &config, delimiter)?;
        let eval = plan(&eval_files, &config, delimiter)?;
        let sparse: Vec<(String, String)> = config.sparse.iter().map(|(f, c)| (f.clone(), c.clone())).collect();
        let integer = sparse.iter().map(|(f, _)| config.integer_ids.contains(f)).collect();
        let separators = sparse.iter().map(|(f, _)| config.multi_value.get(f).map(|s| s.as_bytes().to_vec())).collect();
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                schema,
                label_names,
                sparse,
                integer,
                separators,
                delimiter,
                train,
                eval,
                eval_fraction,
                rows,
                seed: ctx.seed,
                shard,
                chunk_bytes: stream::TEXT_CHUNK_BYTES,
            }),
        })
    }
}

/// Reads each file's header (or checks it against `columns`) and resolves the config's columns.
fn plan(files: &[PathBuf], config: &CsvConfig, delim: u8) -> Result<Vec<FilePlan>, DataError> {
    let mut out = Vec::with_capacity(files.len());
    for path in files {
        let first = first_line(path)?;
        let parsed = |line: &[u8]| -> Result<Vec<String>, String> {
            let mut fields = Vec::new();
            split_fields(line, delim, &mut fields)?;
            Ok(fields.iter().map(|f| String::from_utf8_lossy(f).into_owned()).collect())
        };
        let (names, header, from) = match &config.columns {
            None => {
                let Some(line) = first else {
                    return Err(DataError::Format {
                        path: path.clone(),
                        message: "the file is empty: expected a header line naming the columns (or set columns)".into(),
                    });
                };
                let names = parsed(&line).map_err(|message| DataError::BadRow {
                    file: path.clone(),
                    line: 1,
                    message: format!("header: {message}"),
                })?;
                (names, true, NamesFrom::Header(path))
            }
            Some(cols) => {
                let header = first.as_deref().and_then(|l| parsed(l).ok()).is_some_and(|names| &names == cols);
                (cols.clone(), header, NamesFrom::Columns)
            }
        };
        let ColumnIndexes { dense, sparse, labels, group, weight } =
            column_keys!(config).resolve(|name, _, key| resolve(&names, name, &key, &from))?;
        out.push(FilePlan { path: path.clone(), header, fields: names.len(), dense, sparse, labels, group, weight });
    }
    Ok(out)
}

/// The chunks of a split's files in order, each with its file's first data line index.
struct Units {
    files: Vec<(PathBuf, bool)>,
    chunk_bytes: usize,
    file: usize,
    current: Option<Box<dyn Iterator<Item = Result<TextChunk, DataError>> + Send>>,
    /// Lines of the current file seen so far.
    lines: u64,
    row_base: u64,
    failed: bool,
}

impl Iterator for Units {
    type Item = Result<Unit, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.failed || self.file >= self.files.len() {
                return None;
            }
            let (path, header) = &self.files[self.file];
            if self.current.is_none() {
                match stream::text_chunks(path, self.chunk_bytes, None) {
                    Ok(c) => self.current = Some(Box::new(c)),
                    Err(e) => {
                        self.failed = true;
                        return Some(Err(e));
                    }
                }
                self.lines = 0;
            }
            match self.current.as_mut().and_then(Iterator::next) {
                Some(Ok(chunk)) => {
                    let mut lines = chunk.data.iter().filter(|&&b| b == b'\n').count() as u64;
                    if !chunk.data.ends_with(b"\n") {
                        lines += 1;
                    }
                    self.lines = chunk.first_line - 1 + lines;
                    return Some(Ok(Unit { file: self.file, row_base: self.row_base, chunk }));
                }
                Some(Err(e)) => {
                    self.failed = true;
                    return Some(Err(e));
                }
                None => {
                    self.row_base += self.lines.saturating_sub(*header as u64);
                    self.current = None;
                    self.file += 1;
                }
            }
        }
    }
}

/// One parsed row before it joins the block.
#[derive(Default)]
struct Scratch {
    labels: Vec<f32>,
    dense: Vec<f32>,
    bags: Vec<Vec<i64>>,
    group: i64,
    weight: f32,
}

impl Inner {
    /// Parses one data line into `row`, or says what is wrong with it.
    fn parse_row<'a>(
        &self,
        plan: &FilePlan,
        line: &'a [u8],
        fields: &mut Vec<Cow<'a, [u8]>>,
        row: &mut Scratch,
    ) -> Result<(), String> {
        split_fields(line, self.delimiter, fields)?;
        if fields.len() != plan.fields {
            return Err(format!(
                "expected {} fields separated by {:?} (as the column names), found {}",
                plan.fields,
                self.delimiter as char,
                fields.len()
            ));
        }
        row.labels.clear();
        for (j, &c) in plan.labels.iter().enumerate() {
            let name = &self.label_names[j];
            match number(&fields[c]) {
                Ok(Some(v)) if v.is_finite() => row.labels.push(v as f32),
                Ok(Some(v)) => return Err(format!("label column {name:?} is {v}")),
                Ok(None) => return Err(format!("label column {name:?} is empty")),
                Err(()) => return Err(format!("label column {name:?} is {:?}, not a number", show(&fields[c]))),
            }
        }
        row.dense.clear();
        let c = &self.config;
        for (j, &f) in plan.dense.iter().enumerate() {
            let v = match number(&fields[f]) {
                Ok(Some(v)) if v.is_finite() => v,
                Ok(Some(v)) => return Err(format!("dense column {:?} is {v}", c.dense[j])),
                Ok(None) => c.dense_default as f64,
                Err(()) => {
                    return Err(format!("dense column {:?} is {:?}, not a number", c.dense[j], show(&fields[f])));
                }
            };
            row.dense.push(c.dense_transform.apply(v));
        }
        if let Some(w) = plan.weight {
            let name = c.weight.as_deref().unwrap_or_default();
            row.weight = match number(&fields[w]) {
                Ok(Some(v)) if v.is_finite() && v >= 0.0 => v as f32,
                Ok(Some(v)) => return Err(format!("weight column {name:?} is {v} (weights are finite and >= 0)")),
                Ok(None) => return Err(format!("weight column {name:?} is empty")),
                Err(()) => return Err(format!("weight column {name:?} is {:?}, not a number", show(&fields[w]))),
            };
        }
        if let Some(g) = plan.group {
            if fields[g].is_empty() {
                return Err(format!("group column {:?} is empty", c.group.as_deref().unwrap_or_default()));
            }
            row.group = string_id(&fields[g]);
        }
        row.bags.resize_with(plan.sparse.len(), Vec::new);
        for (k, &f) in plan.sparse.iter().enumerate() {
            let bag = &mut row.bags[k];
            bag.clear();
            let value: &[u8] = &fields[f];
            let rows = self.rows[k] as i128;
            let mut push = |piece: &[u8]| -> Result<(), String> {
                let id = if self.integer[k] {
                    let t = piece.trim_ascii();
                    std::str::from_utf8(t).ok().and_then(|s| s.parse::<i64>().ok()).ok_or_else(|| {
                        let (feature, column) = &self.sparse[k];
                        format!(
                            "sparse column {column:?} (feature {feature:?}, in integer_ids) has {:?}, not an integer",
                            show(piece)
                        )
                    })?
                } else {
                    string_id(piece)
                };
                bag.push((id as i128).rem_euclid(rows) as i64);
                Ok(())
            };
            match &self.separators[k] {
                None if value.is_empty() => {}
                None => push(value)?,
                Some(sep) => {
                    for piece in split_at(value, sep) {
                        if !piece.is_empty() {
                            push(piece)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Parses the lines of `u` (a block of `split`'s files) that belong to this rank and `split`.
    fn parse_chunk(&self, u: Unit, split: SplitRows, stop: &AtomicBool) -> Result<RowBlock, DataError> {
        let plan = &split.files(&self.train, &self.eval)[u.file];
        let mut block = RowBlock::new(plan.dense.len(), plan.labels.len(), plan.sparse.len(), plan.group.is_some())
            .weighted(plan.weight.is_some());
        let header = plan.header as u64;
        let mut fields = Vec::with_capacity(plan.fields);
        let mut row = Scratch::default();
        for (line_no, raw) in u.chunk.lines() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            if line_no <= header {
                continue;
            }
            let index = u.row_base + line_no - 1 - header;
            if !self.shard.owns(index) || !split.keeps(index + 1) {
                continue;
            }
            let raw = if line_no == 1 { raw.strip_prefix(BOM).unwrap_or(raw) } else { raw };
            if raw.is_empty() {
                continue;
            }
            match self.parse_row(plan, raw, &mut fields, &mut row) {
                Ok(()) => {
                    block.labels.extend_from_slice(&row.labels);
                    block.dense.extend_from_slice(&row.dense);
                    for (bags, ids) in block.bags.iter_mut().zip(&row.bags) {
                        bags.values.extend_from_slice(ids);
                        bags.lengths.push(ids.len() as u32);
                    }
                    if let Some(g) = block.groups.as_mut() {
                        g.push(row.group);
                    }
                    if let Some(w) = block.weights.as_mut() {
                        w.push(row.weight);
                    }
                    block.rows += 1;
                }
                Err(message) => block.bad_row(self.config.on_bad_row, || DataError::BadRow {
                    file: plan.path.clone(),
                    line: line_no,
                    message,
                })?,
            }
        }
        Ok(block)
    }
}

/// The pieces of `value` between occurrences of `sep` (non-empty).
fn split_at<'a>(value: &'a [u8], sep: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut rest = Some(value);
    std::iter::from_fn(move || {
        let r = rest?;
        match r.windows(sep.len()).position(|w| w == sep) {
            Some(p) => {
                rest = Some(&r[p + sep.len()..]);
                Some(&r[..p])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

impl Sampler for CsvSampler {
    fn schema(&self) -> &FeatureSchema {
        &self.inner.schema
    }

    fn weighted(&self) -> bool {
        self.inner.config.weight.is_some()
    }

    /// Rows in file and line order; `epoch` does not change the order.
    fn batches(&self, split: Split, _epoch: u64, batch_size: usize) -> Result<BatchStream, DataError> {
        let s = &self.inner;
        let split = SplitRows::new(split, s.eval_fraction, s.seed);
        let plans = split.files(&s.train, &s.eval);
        let source = match plans {
            [] => String::new(),
            [one] => one.path.display().to_string(),
            [first, rest @ ..] => format!("{} and {} more files", first.path.display(), rest.len()),
        };
        let units = Units {
            files: plans.iter().map(|p| (p.path.clone(), p.header)).collect(),
            chunk_bytes: s.chunk_bytes,
            file: 0,
            current: None,
            lines: 0,
            row_base: 0,
            failed: false,
        };
        let inner = Arc::clone(&self.inner);
        let parse = move |_: &mut (), u, stop: &AtomicBool| inner.parse_chunk(u, split, stop);
        Ok(stream::read_batches(&s.schema, source, units, s.config.num_workers, || (), parse, batch_size)
            .weighted(s.config.weight.is_some())
            .into_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Batch;
    use std::collections::BTreeSet;

    const ROWS: u64 = 1000;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-csv-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        dir
    }

    fn ctx(dir: &Path, features: &[&str], rows: u64) -> SamplerContext {
        SamplerContext {
            feature_rows: features.iter().map(|f| (f.to_string(), rows)).collect(),
            base_dir: dir.to_path_buf(),
            seed: 9,
            rank: 0,
            world_size: 1,
        }
    }

    /// A config with every optional key at its default.
    fn base(paths: &[&str], label: &str) -> CsvConfig {
        let mut c: CsvConfig = serde_json::from_value(serde_json::json!({ "label": label })).unwrap();
        c.paths = paths.iter().map(|p| p.to_string()).collect();
        c.eval_fraction = Some(0.0);
        c
    }

    impl CsvSampler {
        fn with_chunk_bytes(mut self, n: usize) -> Self {
            Arc::get_mut(&mut self.inner).unwrap().chunk_bytes = n;
            self
        }
    }

    fn fields(line: &str, delim: u8) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        split_fields(line.as_bytes(), delim, &mut out)?;
        Ok(out.iter().map(|f| String::from_utf8(f.to_vec()).unwrap()).collect())
    }

    #[test]
    fn fields_split_with_rfc4180_quotes() {
        let ok = |line: &str, want: &[&str]| assert_eq!(fields(line, b',').unwrap(), want, "{line:?}");
        ok("a,b,c", &["a", "b", "c"]);
        ok("", &[""]);
        ok("a,", &["a", ""]);
        ok(",a", &["", "a"]);
        ok(",,", &["", "", ""]);
        ok("\"x,y\",z", &["x,y", "z"]);
        ok("\"say \"\"hi\"\"\",2", &["say \"hi\"", "2"]);
        ok("\"\"", &[""]);
        ok("\"\",\"\"", &["", ""]);
        ok("\"a\"\"\"", &["a\""]);
        ok("1,\"\"\"\"", &["1", "\""]);
        ok("\"a\",", &["a", ""]);
        // A quote inside an unquoted field is an ordinary character.
        ok("a\"b,c", &["a\"b", "c"]);
        assert_eq!(fields("a\t\"b\tc\"\t", b'\t').unwrap(), ["a", "b\tc", ""]);
        let err = fields("1,\"abc", b',').unwrap_err();
        assert!(err.contains("field 2 opens a quote that does not close on this line"), "{err}");
        let err = fields("\"a\"b,c", b',').unwrap_err();
        assert_eq!(err, "field 1 has characters after its closing quote");
        assert_eq!(split_at(b"a||bc|", b"|").collect::<Vec<_>>(), [&b"a"[..], b"", b"bc", b""]);
        assert_eq!(split_at(b"a::b", b"::").collect::<Vec<_>>(), [&b"a"[..], b"b"]);
    }

    /// Data row `i` of the mapping test, as CSV fields
    /// `id,click,price,tags,city,user,session,note`.
    fn line(i: i64) -> String {
        let price = if i % 5 == 0 { String::new() } else { format!("{}", i as f64 * 0.5) };
        let tags = match i % 4 {
            0 => String::new(),
            1 => format!("{i}"),
            2 => format!("{i}|{}", i + 1),
            _ => format!("{i}||{}", i + 2),
        };
        // Quoted and unquoted forms of the same string id.
        let city = if i % 2 == 0 { format!("\"c{}\"", i % 3) } else { format!("c{}", i % 3) };
        let note = format!("\"row {i}, \"\"quoted\"\"\"");
        format!("{i},{},{price},{tags},{city},{},s{},{note}", (i % 3 == 0) as u8, i - 20, i / 4)
    }

    /// One example as the sampler gives it (features in name order: city, tags, user).
    #[derive(Debug, PartialEq)]
    struct Example {
        dense: Vec<f32>,
        bags: Vec<Vec<i64>>,
        label: f32,
        group: i64,
    }

    fn expected(i: i64) -> Example {
        let m = |v: i64| v.rem_euclid(ROWS as i64);
        let tags = match i % 4 {
            0 => vec![],
            1 => vec![i],
            2 => vec![i, i + 1],
            _ => vec![i, i + 2],
        };
        Example {
            dense: vec![if i % 5 == 0 { -1.0 } else { i as f32 * 0.5 }, i as f32],
            bags: vec![
                vec![m(string_id(format!("c{}", i % 3).as_bytes()))],
                tags.into_iter().map(m).collect(),
                vec![m(i - 20)],
            ],
            label: (i % 3 == 0) as u8 as f32,
            group: string_id(format!("s{}", i / 4).as_bytes()),
        }
    }

    fn examples(s: &CsvSampler, split: Split, bs: usize) -> Vec<Example> {
        let mut out = Vec::new();
        for b in s.batches(split, 0, bs).unwrap() {
            let b = b.unwrap();
            assert!(b.batch_size <= bs);
            let (nd, nk) = (b.num_dense, b.sparse.keys().len());
            for r in 0..b.batch_size {
                out.push(Example {
                    dense: b.dense[r * nd..(r + 1) * nd].to_vec(),
                    bags: (0..nk).map(|k| b.sparse.feature(k).bag(r).to_vec()).collect(),
                    label: b.labels[r],
                    group: b.groups.as_ref().map_or(0, |g| g[r]),
                });
            }
        }
        out
    }

    const HEADER: &str = "id,click,price,tags,city,user,session,note";

    /// `data/a.csv`: rows 0..40; `data/b.csv`: rows 40..60 with its columns in another order,
    /// a byte order mark, CRLF line ends and an empty line.
    fn mapping_dir(name: &str) -> PathBuf {
        let dir = temp_dir(name);
        let a: String = std::iter::once(HEADER.to_string()).chain((0..40).map(line)).map(|l| l + "\n").collect();
        std::fs::write(dir.join("data/a.csv"), a).unwrap();
        // b.csv: the columns reversed.
        let reverse = |l: String| {
            let mut f = Vec::new();
            split_fields(l.as_bytes(), b',', &mut f).unwrap();
            let quote = |x: &[u8]| {
                let s = String::from_utf8(x.to_vec()).unwrap();
                if s.contains([',', '"']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s }
            };
            f.iter().rev().map(|x| quote(x)).collect::<Vec<_>>().join(",")
        };
        let mut b = String::from("\u{FEFF}");
        b += &(reverse(HEADER.to_string()) + "\r\n");
        for i in 40..60 {
            b += &(reverse(line(i)) + "\r\n");
            if i == 50 {
                b += "\r\n";
            }
        }
        std::fs::write(dir.join("data/b.csv"), b).unwrap();
        dir
    }

    fn mapping_config() -> CsvConfig {
        let mut c = base(&["data"], "click");
        c.dense = vec!["price".into(), "id".into()];
        c.dense_default = -1.0;
        c.sparse = [("city", "city"), ("tags", "tags"), ("user", "user")]
            .iter()
            .map(|(f, c)| (f.to_string(), c.to_string()))
            .collect();
        c.integer_ids = vec!["tags".into(), "user".into()];
        c.multi_value = [("tags".to_string(), "|".to_string())].into();
        c.group = Some("session".into());
        c
    }

    #[test]
    fn columns_map_to_features_with_quotes_bags_and_ids() {
        let dir = mapping_dir("map");
        let c = ctx(&dir, &["city", "tags", "user"], ROWS);
        let s = CsvSampler::build(mapping_config(), &c).unwrap();
        assert_eq!(s.schema().sparse, ["city", "tags", "user"]);
        assert_eq!(s.schema().grouping_key.as_deref(), Some("session"));
        let want: Vec<Example> = (0..60).map(expected).collect();
        assert_eq!(examples(&s, Split::Train, 7), want);
        // Workers and chunk sizes do not change the rows.
        for (w, chunk) in [(2, 1 << 20), (3, 100), (4, 1)] {
            let cfg = CsvConfig { num_workers: w, ..mapping_config() };
            let s = CsvSampler::build(cfg, &c).unwrap().with_chunk_bytes(chunk);
            assert_eq!(examples(&s, Split::Train, 5), want, "workers={w} chunk={chunk}");
        }
        // Without integer_ids the same values are string ids; a log transform; several labels.
        let cfg = CsvConfig {
            integer_ids: vec![],
            dense_transform: DenseTransform::Log1p,
            label: LabelColumns::Many(vec!["click".into(), "id".into()]),
            ..mapping_config()
        };
        let s = CsvSampler::build(cfg, &c).unwrap();
        let b = s.batches(Split::Train, 0, 100).unwrap().next().unwrap().unwrap();
        assert_eq!(b.batch_size, 60);
        assert_eq!(b.sparse.feature(2).bag(3), &[string_id(b"-17") % ROWS as i64]);
        assert_eq!(b.sparse.feature(1).bag(2), &[string_id(b"2") % 1000, string_id(b"3") % 1000]);
        assert_eq!(&b.labels[2..4], &[0.0, 1.0]);
        assert_eq!(b.dense[3 * 2 + 1], (4f64).ln() as f32);
        // A row with an empty price has dense_default -1, log1p(max(-1, 0)) = 0.
        assert_eq!(b.dense[0], 0.0);
    }

    #[test]
    fn bad_rows_are_skipped_or_reported_with_file_and_line() {
        let dir = temp_dir("bad");
        let lines = [
            "a,b,y",        // 1: header
            "1,x,1",        // 2
            "1,2",          // 3: two fields
            "z,x,1",        // 4: dense not a number
            "1,x,",         // 5: empty label
            "1,x,2.5",      // 6
            "\"1,x,1",      // 7: open quote
            "1,x,inf",      // 8: infinite label
            "1,\"x\"y,0",   // 9: text after a closing quote
            " 2 ,\"x\",0 ", // 10: spaces around numbers are fine
        ];
        std::fs::write(dir.join("data/t.csv"), lines.join("\n")).unwrap();
        let cfg = |policy| CsvConfig {
            dense: vec!["a".into()],
            sparse: [("b".to_string(), "b".to_string())].into(),
            on_bad_row: policy,
            ..base(&["data/t.csv"], "y")
        };
        let c = ctx(&dir, &["b"], 10);
        let s = CsvSampler::build(cfg(BadRowPolicy::Skip), &c).unwrap();
        let b: Vec<Batch> = s.batches(Split::Train, 0, 100).unwrap().map(Result::unwrap).collect();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].labels, [1.0, 2.5, 0.0]);
        assert_eq!(b[0].dense, [1.0, 1.0, 2.0]);
        assert_eq!(b[0].sparse.feature(0).values, &[string_id(b"x") % 10; 3]);
        let file = dir.join("data/t.csv").display().to_string();
        let first_error = |text: &str| {
            std::fs::write(dir.join("data/t.csv"), text).unwrap();
            let s = CsvSampler::build(cfg(BadRowPolicy::Fail), &c).unwrap();
            s.batches(Split::Train, 0, 100).unwrap().find_map(Result::err).unwrap().to_string()
        };
        for (n, want) in [
            (3, "expected 3 fields separated by ',' (as the column names), found 2"),
            (4, "dense column \"a\" is \"z\", not a number"),
            (5, "label column \"y\" is empty"),
            (7, "field 1 opens a quote that does not close on this line (a quoted field cannot span lines)"),
            (8, "label column \"y\" is inf"),
            (9, "field 2 has characters after its closing quote"),
        ] {
            let text: Vec<&str> =
                lines.iter().enumerate().filter(|(i, _)| *i < 2 || *i == n - 1).map(|(_, l)| *l).collect();
            assert_eq!(first_error(&text.join("\n")), format!("{file}:3: {want}"), "line {n}");
        }
        // A bad integer id.
        std::fs::write(dir.join("data/t.csv"), "a,b,y\n1,7,1\n1,7.5,0\n").unwrap();
        let cfg = CsvConfig { integer_ids: vec!["b".into()], ..cfg(BadRowPolicy::Fail) };
        let err = CsvSampler::build(cfg, &c).unwrap().batches(Split::Train, 0, 8).unwrap().find_map(Result::err);
        let want = format!("{file}:3: sparse column \"b\" (feature \"b\", in integer_ids) has \"7.5\", not an integer");
        assert_eq!(err.unwrap().to_string(), want);
    }

    #[test]
    fn config_errors_name_the_key() {
        let dir = mapping_dir("errors");
        let mut c = ctx(&dir, &["city", "tags", "user", "p"], ROWS);
        let key_of = |cfg: CsvConfig, c: &SamplerContext| match CsvSampler::build(cfg, c).unwrap_err() {
            DataError::Config { key, message } => (key, message),
            e => panic!("{e}"),
        };
        let a = dir.join("data/a.csv").display().to_string();
        let (key, msg) = key_of(CsvConfig { dense: vec!["id".into(), "prise".into()], ..mapping_config() }, &c);
        assert_eq!(key, "dense[1]");
        assert_eq!(
            msg,
            format!(
                "the header of {a} has no column \"prise\"; did you mean \"price\"? its columns: {}",
                HEADER.replace(',', ", ")
            )
        );
        let mut sparse = mapping_config().sparse;
        sparse.insert("p".into(), "nothing_like_it".into());
        let (key, msg) = key_of(CsvConfig { sparse, ..mapping_config() }, &c);
        assert_eq!(key, "sparse.p");
        assert!(!msg.contains("did you mean") && msg.contains("its columns: id, click"), "{msg}");
        let (key, _) = key_of(CsvConfig { label: LabelColumns::One("clik".into()), ..mapping_config() }, &c);
        assert_eq!(key, "label");
        let labels = LabelColumns::Many(vec!["click".into(), "klick".into()]);
        let (key, _) = key_of(CsvConfig { label: labels, ..mapping_config() }, &c);
        assert_eq!(key, "label[1]");
        let (key, _) = key_of(CsvConfig { group: Some("sesion".into()), ..mapping_config() }, &c);
        assert_eq!(key, "group");
        let (key, _) = key_of(CsvConfig { weight: Some("wieght".into()), ..mapping_config() }, &c);
        assert_eq!(key, "weight");
        let (key, msg) = key_of(CsvConfig { integer_ids: vec!["usr".into()], ..mapping_config() }, &c);
        assert_eq!(key, "integer_ids[0]");
        assert_eq!(
            msg,
            "\"usr\" is not a sparse feature; did you mean \"user\"? the sparse features: city, tags, user"
        );
        let (key, _) = key_of(CsvConfig { multi_value: [("tag".into(), "|".into())].into(), ..mapping_config() }, &c);
        assert_eq!(key, "multi_value.tag");
        let (key, _) = key_of(CsvConfig { multi_value: [("tags".into(), ",".into())].into(), ..mapping_config() }, &c);
        assert_eq!(key, "multi_value.tags");
        for d in ["", "ab", "\"", "\n", "é"] {
            let (key, _) = key_of(CsvConfig { delimiter: d.into(), ..mapping_config() }, &c);
            assert_eq!(key, "delimiter", "{d:?}");
        }
        let (key, _) = key_of(CsvConfig { path: Some("data/a.csv".into()), ..mapping_config() }, &c);
        assert_eq!(key, "path");
        let (key, _) = key_of(CsvConfig { paths: vec![], ..mapping_config() }, &c);
        assert_eq!(key, "paths");
        let (key, msg) = key_of(CsvConfig { paths: vec![], path: Some("data/c.csv".into()), ..mapping_config() }, &c);
        assert_eq!(key, "path[0]");
        assert!(msg.ends_with("c.csv does not exist"), "{msg}");
        let (key, msg) = key_of(CsvConfig { paths: vec!["data/*.txt".into()], ..mapping_config() }, &c);
        assert_eq!(key, "paths[0]");
        assert!(msg.contains("no file matches"), "{msg}");
        let cfg = CsvConfig { eval_paths: vec!["data/a.csv".into()], eval_fraction: Some(0.1), ..mapping_config() };
        assert_eq!(key_of(cfg, &c).0, "eval_fraction");
        let (key, _) = key_of(CsvConfig { eval_fraction: Some(1.0), ..mapping_config() }, &c);
        assert_eq!(key, "eval_fraction");
        let (key, _) = key_of(CsvConfig { columns: Some(vec![]), ..mapping_config() }, &c);
        assert_eq!(key, "columns");
        let (key, _) = key_of(CsvConfig { columns: Some(vec!["a".into(), "a".into()]), ..mapping_config() }, &c);
        assert_eq!(key, "columns");
        let cols = Some(vec!["id".into(), "click".into()]);
        let (key, msg) = key_of(CsvConfig { columns: cols, ..mapping_config() }, &c);
        assert_eq!(key, "dense[0]");
        assert_eq!(msg, "`columns` has no column \"price\"; its columns: id, click");
        let (key, _) = key_of(CsvConfig { num_workers: 0, ..mapping_config() }, &c);
        assert_eq!(key, "num_workers");
        // A referenced name the header has twice; an empty file; a header with an open quote.
        std::fs::write(dir.join("data/d.csv"), "id,click,id\n1,0,2\n").unwrap();
        let cfg = CsvConfig { paths: vec!["data/d.csv".into()], dense: vec!["id".into()], ..base(&[], "click") };
        let (key, msg) = key_of(cfg.clone(), &c);
        assert_eq!(key, "dense[0]");
        assert!(
            msg.contains("column \"id\" appears 2 times in the header of") && msg.contains("(fields 1, 3)"),
            "{msg}"
        );
        std::fs::write(dir.join("data/d.csv"), "").unwrap();
        let e = CsvSampler::build(cfg.clone(), &c).unwrap_err().to_string();
        assert!(
            e.ends_with("d.csv: the file is empty: expected a header line naming the columns (or set columns)"),
            "{e}"
        );
        std::fs::write(dir.join("data/d.csv"), "\"id,click\n").unwrap();
        let e = CsvSampler::build(cfg, &c).unwrap_err().to_string();
        assert!(e.ends_with("d.csv:1: header: field 1 opens a quote that does not close on this line (a quoted field cannot span lines)"), "{e}");
        // A sparse feature without a table.
        c.feature_rows.remove("city");
        let e = CsvSampler::build(mapping_config(), &c).unwrap_err().to_string();
        assert!(e.contains("\"city\" is not looked up in any table"), "{e}");
    }

    /// `data/a.csv` with a header and rows 0..30, `data/b.csv` with a header and rows 30..55:
    /// column `v` is the row's index among the data lines of both.
    fn numbered_dir(name: &str) -> PathBuf {
        let dir = temp_dir(name);
        for (file, rows) in [("a.csv", 0..30), ("b.csv", 30..55)] {
            let text: String = std::iter::once("v,y".to_string())
                .chain(rows.map(|i| format!("{i},{}", i % 2)))
                .map(|l| l + "\n")
                .collect();
            std::fs::write(dir.join("data").join(file), text).unwrap();
        }
        dir
    }

    fn v_ids(s: &CsvSampler, split: Split) -> Vec<i64> {
        examples(s, split, 8).iter().map(|e| e.bags[0][0]).collect()
    }

    fn numbered_config() -> CsvConfig {
        CsvConfig {
            sparse: [("v".to_string(), "v".to_string())].into(),
            integer_ids: vec!["v".into()],
            ..base(&["data/a.csv", "data/b.csv"], "y")
        }
    }

    #[test]
    fn lines_across_files_are_the_rank_shard_and_the_eval_hash() {
        let dir = numbered_dir("ranks");
        let mut all = Vec::new();
        for rank in 0..3 {
            let c = SamplerContext { rank, world_size: 3, ..ctx(&dir, &["v"], ROWS) };
            let s =
                CsvSampler::build(CsvConfig { num_workers: 2, ..numbered_config() }, &c).unwrap().with_chunk_bytes(16);
            let ids = v_ids(&s, Split::Train);
            assert_eq!(ids, (0..55).filter(|i| i % 3 == rank as i64).collect::<Vec<_>>(), "rank {rank}");
            all.extend(ids);
        }
        assert_eq!(all.len(), 55);
        let bad = SamplerContext { rank: 3, world_size: 3, ..ctx(&dir, &["v"], ROWS) };
        assert!(CsvSampler::build(numbered_config(), &bad).is_err());
        // The eval split: the data lines whose 1-based number across the files hashes into it.
        let c = ctx(&dir, &["v"], ROWS);
        let s = CsvSampler::build(CsvConfig { eval_fraction: Some(0.3), ..numbered_config() }, &c).unwrap();
        let want_eval: Vec<i64> = (0..55).filter(|&i| stream::is_eval_row(9, i as u64 + 1, 0.3)).collect();
        assert!((5..30).contains(&want_eval.len()));
        assert_eq!(v_ids(&s, Split::Eval), want_eval);
        assert_eq!(v_ids(&s, Split::Train), (0..55).filter(|i| !want_eval.contains(i)).collect::<Vec<_>>());
        // The default eval_fraction is 0.1; eval files replace the hash split.
        let s = CsvSampler::build(CsvConfig { eval_fraction: None, ..numbered_config() }, &c).unwrap();
        let default_eval: Vec<i64> = (0..55).filter(|&i| stream::is_eval_row(9, i as u64 + 1, 0.1)).collect();
        assert_eq!(v_ids(&s, Split::Eval), default_eval);
        let cfg = CsvConfig {
            path: Some("data/a.csv".into()),
            paths: vec![],
            eval_paths: vec!["data/b.csv".into()],
            eval_fraction: None,
            ..numbered_config()
        };
        let s = CsvSampler::build(cfg, &c).unwrap();
        assert_eq!(v_ids(&s, Split::Train), (0..30).collect::<Vec<_>>());
        assert_eq!(v_ids(&s, Split::Eval), (30..55).collect::<Vec<_>>());
    }

    #[test]
    fn columns_name_headerless_files_and_skip_a_matching_header() {
        let dir = temp_dir("columns");
        std::fs::write(dir.join("data/a.tsv"), "v\ty\n0\t1\n1\t0\n").unwrap();
        std::fs::write(dir.join("data/b.tsv"), "2\t1\n3\t0\n4\t1").unwrap();
        std::fs::write(dir.join("data/README.md"), "not data").unwrap();
        let cfg = CsvConfig {
            paths: vec!["data".into()],
            delimiter: "\t".into(),
            columns: Some(vec!["v".into(), "y".into()]),
            ..numbered_config()
        };
        let c = ctx(&dir, &["v"], ROWS);
        let s = CsvSampler::build(cfg.clone(), &c).unwrap();
        assert_eq!(v_ids(&s, Split::Train), [0, 1, 2, 3, 4]);
        let labels: Vec<f32> = examples(&s, Split::Train, 8).iter().map(|e| e.label).collect();
        assert_eq!(labels, [1.0, 0.0, 1.0, 0.0, 1.0]);
        // Without columns, b.tsv's first line is its header: "2" and "1" are not v and y.
        let (key, msg) = match CsvSampler::build(CsvConfig { columns: None, ..cfg }, &c).unwrap_err() {
            DataError::Config { key, message } => (key, message),
            e => panic!("{e}"),
        };
        assert_eq!(key, "sparse.v");
        assert!(msg.contains("b.tsv has no column \"v\"; did you mean \"1\"? its columns: 2, 1"), "{msg}");
        // A header-only file and an empty headerless file give no rows.
        std::fs::write(dir.join("data/a.tsv"), "v\ty\n").unwrap();
        std::fs::write(dir.join("data/b.tsv"), "").unwrap();
        let cfg = CsvConfig { paths: vec!["data/a.tsv".into(), "data/b.tsv".into()], ..numbered_config() };
        let cfg = CsvConfig { delimiter: "\t".into(), columns: Some(vec!["v".into(), "y".into()]), ..cfg };
        assert_eq!(CsvSampler::build(cfg, &c).unwrap().batches(Split::Train, 0, 8).unwrap().count(), 0);
    }

    #[test]
    fn early_drop_with_many_chunks() {
        let dir = temp_dir("drop");
        let text: String =
            std::iter::once("v,y".to_string()).chain((0..5000).map(|i| format!("{i},1"))).map(|l| l + "\n").collect();
        std::fs::write(dir.join("data/a.csv"), text).unwrap();
        let cfg = CsvConfig { num_workers: 4, ..numbered_config() };
        let cfg = CsvConfig { paths: vec!["data/a.csv".into()], ..cfg };
        let s = CsvSampler::build(cfg, &ctx(&dir, &["v"], 1 << 20)).unwrap().with_chunk_bytes(64);
        for _ in 0..10 {
            let first: Vec<Batch> = s.batches(Split::Train, 0, 7).unwrap().take(2).map(Result::unwrap).collect();
            assert_eq!(first[1].sparse.feature(0).values, &[7, 8, 9, 10, 11, 12, 13]);
        }
    }

    fn avazu_dir() -> Option<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/avazu-sample");
        if dir.join("train.csv").exists() {
            return Some(dir);
        }
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {} is missing", dir.display());
        eprintln!("skipping: {} not found (the shared datasets are not part of a clone)", dir.display());
        None
    }

    /// Per split: rows, clicks, distinct ids per feature, the dense sums, and how often each
    /// feature's first id of a row is `rows - 1`.
    fn avazu_totals(s: &CsvSampler, split: Split, rows: u64) -> (usize, f64, Vec<usize>, Vec<f64>, Vec<usize>) {
        let nk = s.schema().sparse.len();
        let nd = s.schema().num_dense;
        let (mut n, mut clicks, mut sums) = (0, 0.0, vec![0.0; nd]);
        let mut distinct = vec![BTreeSet::new(); nk];
        let mut last = vec![0; nk];
        for b in s.batches(split, 0, 1000).unwrap() {
            let b = b.unwrap();
            n += b.batch_size;
            clicks += b.labels.iter().map(|&y| y as f64).sum::<f64>();
            for (j, &x) in b.dense.iter().enumerate() {
                sums[j % nd] += x as f64;
            }
            for k in 0..nk {
                let f = b.sparse.feature(k);
                assert!(f.lengths.iter().all(|&l| l == 1), "one id per row");
                distinct[k].extend(f.values.iter().copied());
                last[k] += f.values.iter().filter(|&&v| v == rows as i64 - 1).count();
            }
        }
        (n, clicks, distinct.iter().map(BTreeSet::len).collect(), sums, last)
    }

    #[test]
    fn real_avazu_sample() {
        let Some(dir) = avazu_dir() else { return };
        // Expected values computed independently with awk over the files (train.csv has a
        // header line, dev.csv and test.csv none), for example
        //   awk -F, 'NR>1 {n++; c+=$2; s+=$18; if ($23==-1) m++} END {print n, c, s, m}' train.csv
        //   awk -F, 'NR>1 {s[$6]=1} END {n=0; for (k in s) n++; print n}' train.csv
        // train.csv: 8087 rows, 1397 clicks; distinct id ($1) 8087, site_id ($6) 339,
        // device_ip ($13) 6116, C14 ($17) 251, C20 ($23) 102; C20 = -1 in 5020 rows;
        // the sum of C15 ($18) is 2575684. dev.csv: 480 rows, 86 clicks, 87 distinct site_id;
        // test.csv: 432 rows, 80 clicks.
        let rows = 1u64 << 62; // large enough that distinct values keep distinct ids
        let features = ["ad", "site_id", "device_ip", "C14", "C20"];
        let c = ctx(&dir, &features, rows);
        let sparse: BTreeMap<String, String> =
            [("ad", "id"), ("site_id", "site_id"), ("device_ip", "device_ip"), ("C14", "C14"), ("C20", "C20")]
                .iter()
                .map(|(f, c)| (f.to_string(), c.to_string()))
                .collect();
        let cfg = CsvConfig {
            dense: vec!["C15".into(), "banner_pos".into()],
            sparse,
            integer_ids: vec!["C14".into(), "C20".into()],
            on_bad_row: BadRowPolicy::Fail,
            num_workers: 2,
            ..base(&["train.csv"], "click")
        };
        let s = CsvSampler::build(cfg.clone(), &c).unwrap().with_chunk_bytes(64 << 10);
        // Features in name order: C14, C20, ad, device_ip, site_id.
        let (n, clicks, distinct, sums, last) = avazu_totals(&s, Split::Train, rows);
        assert_eq!((n, clicks), (8087, 1397.0));
        assert_eq!(distinct, [251, 102, 8087, 6116, 339]);
        assert_eq!(sums[0], 2_575_684.0);
        // C20's -1 (missing) is looked up at row rows - 1, as a Parquet integer -1 is.
        assert_eq!(last[1], 5020);
        // The first data row's ids: C14 = 15704 as a number; site_id hashed as a string (the id
        // a Parquet string column gives); id 10000169349117863715 (above i64) as a string.
        let b = s.batches(Split::Train, 0, 1).unwrap().next().unwrap().unwrap();
        let m = |v: i64| v.rem_euclid(rows as i64);
        assert_eq!(b.sparse.feature(0).values, &[15704]);
        assert_eq!(b.sparse.feature(4).values, &[m(string_id(b"1fbe01fe"))]);
        assert_eq!(b.sparse.feature(2).values, &[m(string_id(b"10000169349117863715"))]);
        assert_eq!(b.labels, [0.0]);
        assert_eq!(b.dense, [320.0, 0.0]);
        // The hash split holds out about a tenth; together the rows again.
        let s = CsvSampler::build(CsvConfig { eval_fraction: Some(0.1), ..cfg.clone() }, &c).unwrap();
        let (train, train_clicks, ..) = avazu_totals(&s, Split::Train, rows);
        let (eval, eval_clicks, ..) = avazu_totals(&s, Split::Eval, rows);
        assert_eq!((train + eval, train_clicks + eval_clicks), (8087, 1397.0));
        assert!((650..970).contains(&eval), "eval rows {eval}");
        // Three ranks read disjoint thirds.
        let mut total = 0;
        for rank in 0..3 {
            let c = SamplerContext { rank, world_size: 3, ..c.clone() };
            let (n, ..) = avazu_totals(&CsvSampler::build(cfg.clone(), &c).unwrap(), Split::Train, rows);
            assert_eq!(n, (8087 + 2 - rank) / 3);
            total += n;
        }
        assert_eq!(total, 8087);
        // dev.csv and test.csv have no header: `columns` names them (and train.csv's header,
        // being those names, is skipped).
        let names = "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,\
                     app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,\
                     C17,C18,C19,C20,C21";
        let cfg = CsvConfig {
            paths: vec!["train.csv".into(), "test.csv".into()],
            eval_paths: vec!["dev.csv".into()],
            eval_fraction: None,
            columns: Some(names.split(',').map(String::from).collect()),
            ..cfg
        };
        let s = CsvSampler::build(cfg, &c).unwrap();
        let (n, clicks, ..) = avazu_totals(&s, Split::Train, rows);
        assert_eq!((n, clicks), (8087 + 432, 1397.0 + 80.0));
        let (n, clicks, distinct, ..) = avazu_totals(&s, Split::Eval, rows);
        assert_eq!((n, clicks, distinct[4]), (480, 86.0, 87));
    }

    /// A weight column reaches the batches row for row; a negative, empty or non-numeric
    /// weight is a bad row (skipped, or an error naming file:line).
    #[test]
    fn a_weight_column_weighs_each_row() {
        let dir = temp_dir("weights");
        let text = "click,w,user\n1,0.5,a\n0,2,b\n1,-1,c\n0,,d\n1,x,e\n0,0,f\n1,3.25,g\n";
        std::fs::write(dir.join("data/w.csv"), text).unwrap();
        let mut config = base(&["data/w.csv"], "click");
        config.sparse = [("user".to_string(), "user".to_string())].into();
        config.weight = Some("w".into());
        let s = CsvSampler::build(config.clone(), &ctx(&dir, &["user"], ROWS)).unwrap();
        assert!(s.weighted());
        let batches: Vec<Batch> = s.batches(Split::Train, 0, 3).unwrap().map(Result::unwrap).collect();
        let weights: Vec<f32> = batches.iter().flat_map(|b| b.weights.clone().unwrap()).collect();
        let labels: Vec<f32> = batches.iter().flat_map(|b| b.labels.clone()).collect();
        assert_eq!(weights, [0.5, 2.0, 0.0, 3.25]);
        assert_eq!(labels, [1.0, 0.0, 0.0, 1.0]);
        assert!(batches.iter().all(|b| b.weights.as_ref().unwrap().len() == b.batch_size));
        config.on_bad_row = BadRowPolicy::Fail;
        let s = CsvSampler::build(config, &ctx(&dir, &["user"], ROWS)).unwrap();
        let err = s.batches(Split::Train, 0, 3).unwrap().find_map(Result::err).unwrap().to_string();
        assert!(err.ends_with("w.csv:4: weight column \"w\" is -1 (weights are finite and >= 0)"), "{err}");
        let unweighted = CsvSampler::build(base(&["data/w.csv"], "click"), &ctx(&dir, &[], ROWS)).unwrap();
        assert!(!unweighted.weighted());
        assert!(unweighted.batches(Split::Train, 0, 3).unwrap().all(|b| b.unwrap().weights.is_none()));
    }
}
