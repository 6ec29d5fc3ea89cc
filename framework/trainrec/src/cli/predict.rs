//! `trainrec predict`: a data source scored by a run's checkpoint or by a TorchScript export,
//! one output row per example, written to Parquet, CSV or JSON lines.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::{Device, IValue, Kind, Tensor};
use trainrec_data::{Batch, Sampler, Split};
use trainrec_embedding::quant::QuantPrecision;
use trainrec_engine::{EngineError, Registry};
use trainrec_recipe::LoadOptions;
use trainrec_types::Word;

use super::args::CliError;
use super::eval::checkpoint_job;
use super::run::load_checked;

/// What `trainrec predict` was asked.
pub(crate) struct PredictArgs {
    pub(crate) source: PathBuf,
    pub(crate) out: PathBuf,
    pub(crate) split: Split,
    pub(crate) step: Option<u64>,
    pub(crate) quantize: Option<QuantPrecision>,
    pub(crate) with_inputs: bool,
}

/// What scores the batches.
enum Scorer {
    /// A run's checkpoint in a one-rank job.
    Job(Box<trainrec_engine::Job>),
    /// A TorchScript export run by libtorch, and the sampler of its recipe.
    Module { module: tch::CModule, sampler: Box<dyn Sampler>, tasks: Vec<(String, usize)>, batch_size: usize },
}

/// The output file's layout.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Parquet,
    Csv,
    Jsonl,
}

fn runtime(e: impl std::fmt::Display) -> CliError {
    CliError::Runtime(e.to_string())
}

/// A TorchScript file's extra file `name` (`<archive>/extra/<name>`).
fn extra_file(path: &Path, name: &str) -> Result<String, CliError> {
    use std::io::Read;
    let file =
        File::open(path).map_err(|e| CliError::Usage(format!("predict: cannot read {}: {e}", path.display())))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| {
        CliError::Usage(format!(
            "predict: {} is not a TorchScript file written by trainrec export: {e}",
            path.display()
        ))
    })?;
    let entry = (0..zip.len())
        .find(|&i| {
            zip.by_index(i).is_ok_and(|f| f.name().split_once('/').is_some_and(|(_, n)| n == format!("extra/{name}")))
        })
        .ok_or_else(|| {
            CliError::Usage(format!(
                "predict: {} has no extra/{name}: it was not written by `trainrec export --format torchscript`",
                path.display()
            ))
        })?;
    let mut text = String::new();
    zip.by_index(entry).map_err(runtime)?.read_to_string(&mut text).map_err(runtime)?;
    Ok(text)
}

/// The scorer of a TorchScript export: the module, and the sampler its embedded recipe
/// describes (with `options`' overrides).
fn module_scorer(registry: &Registry, path: &Path, options: &LoadOptions) -> Result<Scorer, CliError> {
    let meta: serde_json::Value = serde_json::from_str(&extra_file(path, "trainrec.json")?)
        .map_err(|e| CliError::Usage(format!("predict: {}: extra/trainrec.json: {e}", path.display())))?;
    if meta["format"] != trainrec_engine::torchscript::FORMAT {
        return Err(CliError::Usage(format!(
            "predict: {} is of format {} (this trainrec reads {})",
            path.display(),
            meta["format"],
            trainrec_engine::torchscript::FORMAT
        )));
    }
    let recipe = extra_file(path, "recipe.toml")?;
    // The recipe loader reads files: the embedded recipe goes to a private temporary one.
    let dir = std::env::temp_dir().join(format!("trainrec-predict-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(runtime)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let recipe_path = dir.join(format!("{stem}.recipe.toml"));
    std::fs::write(&recipe_path, recipe).map_err(runtime)?;
    let base_dir = meta["base_dir"].as_str().map(PathBuf::from);
    let mut options = options.clone();
    options.overrides.push("topology.world_size=1".into());
    let loaded = load_checked(&recipe_path, &options, base_dir, registry);
    let _ = std::fs::remove_dir_all(&dir);
    let (loaded, _) = loaded?;
    let sampler = trainrec_engine::build_sampler(&loaded, registry, 0, 1)?;
    // Each task reads the label column of the name the file records (when the data has it).
    let labels = &sampler.schema().labels;
    let tasks = meta["tasks"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|t| {
                    let name = t["name"].as_str().unwrap_or_default().to_string();
                    let col = t["label"].as_str().and_then(|l| labels.iter().position(|x| x == l));
                    (name, col.unwrap_or(usize::MAX))
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    if tasks.is_empty() {
        return Err(CliError::Usage(format!("predict: {}: extra/trainrec.json names no tasks", path.display())));
    }
    let module = tch::CModule::load(path)
        .map_err(|e| CliError::Usage(format!("predict: libtorch cannot load {}: {e}", path.display())))?;
    // The recipe's eval batch size: a sampler's examples may depend on how it batches them.
    let batch_size = loaded.recipe.data.eval_batch_size.unwrap_or(loaded.recipe.data.batch_size);
    Ok(Scorer::Module { module, sampler, tasks, batch_size })
}

/// The model inputs of a batch in the TorchScript file's convention: dense `[B, D]`, and per
/// feature its ids and lengths.
fn module_inputs(batch: &Batch) -> Result<(Tensor, Vec<Tensor>, Vec<Tensor>), CliError> {
    let b = batch.batch_size as i64;
    let dense = Tensor::from_slice(&batch.dense).f_view([b, batch.num_dense as i64]).map_err(runtime)?;
    let kjt = batch.sparse.full_batch().map_err(runtime)?;
    let (mut ids, mut lengths) = (Vec::new(), Vec::new());
    for k in 0..kjt.keys().len() {
        let f = kjt.feature(k);
        ids.push(Tensor::from_slice(f.values));
        let l: Vec<i64> = (0..f.num_bags()).map(|i| f.bag(i).len() as i64).collect();
        lengths.push(Tensor::from_slice(&l));
    }
    Ok((dense, ids, lengths))
}

/// One chunk of output rows, column by column.
#[derive(Default)]
struct Rows {
    row: Vec<i64>,
    labels: Vec<Vec<f32>>,
    probs: Vec<Vec<f32>>,
    logits: Vec<Vec<f32>>,
    dense: Vec<Vec<f32>>,
    ids: Vec<Vec<Vec<i64>>>,
}

impl Rows {
    fn len(&self) -> usize {
        self.row.len()
    }
}

/// Writes the rows as they come, into a temporary file renamed into place at the end.
struct Writer {
    format: Format,
    tmp: PathBuf,
    out: PathBuf,
    tasks: Vec<String>,
    features: Vec<String>,
    labels: bool,
    inputs: bool,
    text: Option<BufWriter<File>>,
    parquet: Option<parquet::file::writer::SerializedFileWriter<File>>,
}

fn parquet_err(e: parquet::errors::ParquetError) -> CliError {
    CliError::Runtime(format!("predict: writing parquet: {e}"))
}

impl Writer {
    fn new(
        out: &Path,
        tasks: Vec<String>,
        features: Vec<String>,
        labels: bool,
        inputs: bool,
    ) -> Result<Self, CliError> {
        let format = match out.extension().and_then(|e| e.to_str()) {
            Some("parquet") => Format::Parquet,
            Some("csv") => Format::Csv,
            Some("jsonl" | "json") => Format::Jsonl,
            _ => {
                return Err(CliError::Usage(format!(
                    "predict: --out {}: name a .parquet, .csv or .jsonl file",
                    out.display()
                )));
            }
        };
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(runtime)?;
        }
        let mut name = out.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".{}.partial", std::process::id()));
        let tmp = out.with_file_name(name);
        let file = File::create(&tmp).map_err(|e| CliError::Runtime(format!("cannot write {}: {e}", tmp.display())))?;
        let mut w =
            Writer { format, tmp, out: out.to_path_buf(), tasks, features, labels, inputs, text: None, parquet: None };
        match format {
            Format::Parquet => {
                let schema =
                    Arc::new(parquet::schema::parser::parse_message_type(&w.parquet_schema()).map_err(parquet_err)?);
                let props = Arc::new(
                    parquet::file::properties::WriterProperties::builder()
                        .set_compression(parquet::basic::Compression::SNAPPY)
                        .build(),
                );
                w.parquet =
                    Some(parquet::file::writer::SerializedFileWriter::new(file, schema, props).map_err(parquet_err)?);
            }
            Format::Csv => {
                let mut t = BufWriter::new(file);
                writeln!(t, "{}", w.columns().join(",")).map_err(runtime)?;
                w.text = Some(t);
            }
            Format::Jsonl => w.text = Some(BufWriter::new(file)),
        }
        Ok(w)
    }

    /// Column names, in order.
    fn columns(&self) -> Vec<String> {
        let mut c = vec!["row".to_string()];
        if self.labels {
            c.extend(self.tasks.iter().map(|t| format!("label_{t}")));
        }
        c.extend(self.tasks.iter().cloned());
        c.extend(self.tasks.iter().map(|t| format!("logit_{t}")));
        if self.inputs {
            c.push("dense".into());
            c.extend(self.features.iter().map(|f| format!("ids_{f}")));
        }
        c
    }

    fn parquet_schema(&self) -> String {
        // The schema parser takes plain names: a quote in a task or feature name becomes `_`.
        let name = |n: &str| n.replace('"', "_");
        let mut fields = vec!["required int64 row;".to_string()];
        let float_cols = self.columns().into_iter().skip(1).take(self.tasks.len() * (2 + usize::from(self.labels)));
        fields.extend(float_cols.map(|c| format!("required float {};", name(&c))));
        if self.inputs {
            fields.push("required group dense (LIST) { repeated group list { required float element; } }".into());
            for f in &self.features {
                fields.push(format!(
                    "required group {} (LIST) {{ repeated group list {{ required int64 element; }} }}",
                    name(&format!("ids_{f}"))
                ));
            }
        }
        format!("message predictions {{ {} }}", fields.join(" "))
    }

    fn write(&mut self, rows: &Rows) -> Result<(), CliError> {
        match self.format {
            Format::Parquet => self.write_parquet(rows),
            Format::Csv | Format::Jsonl => self.write_text(rows),
        }
    }

    fn write_text(&mut self, rows: &Rows) -> Result<(), CliError> {
        let csv = self.format == Format::Csv;
        let names = self.columns();
        let t = self.text.as_mut().ok_or_else(|| runtime("predict: the output is closed"))?;
        let list = |v: &[String]| if csv { v.join(" ") } else { format!("[{}]", v.join(",")) };
        for i in 0..rows.len() {
            let mut values = vec![rows.row[i].to_string()];
            if self.labels {
                values.extend(rows.labels[i].iter().map(|v| format!("{v:?}")));
            }
            values.extend(rows.probs[i].iter().map(|v| format!("{v:?}")));
            values.extend(rows.logits[i].iter().map(|v| format!("{v:?}")));
            if self.inputs {
                values.push(list(&rows.dense[i].iter().map(|v| format!("{v:?}")).collect::<Vec<_>>()));
                for f in &rows.ids[i] {
                    values.push(list(&f.iter().map(i64::to_string).collect::<Vec<_>>()));
                }
            }
            let line = if csv {
                values.join(",")
            } else {
                let fields: Vec<String> = names
                    .iter()
                    .zip(&values)
                    .map(|(n, v)| format!("{}:{}", serde_json::Value::String(n.clone()), v))
                    .collect();
                format!("{{{}}}", fields.join(","))
            };
            writeln!(t, "{line}").map_err(runtime)?;
        }
        Ok(())
    }

    fn write_parquet(&mut self, rows: &Rows) -> Result<(), CliError> {
        use parquet::data_type::{FloatType, Int64Type};
        let n_tasks = self.tasks.len();
        let (labels, inputs) = (self.labels, self.inputs);
        let w = self.parquet.as_mut().ok_or_else(|| runtime("predict: the output is closed"))?;
        let mut rg = w.next_row_group().map_err(parquet_err)?;
        let mut c = 0usize;
        let float_cols = n_tasks * (2 + usize::from(labels));
        while let Some(mut col) = rg.next_column().map_err(parquet_err)? {
            if c == 0 {
                col.typed::<Int64Type>().write_batch(&rows.row, None, None).map_err(parquet_err)?;
            } else if c <= float_cols {
                let k = c - 1;
                let (src, t) = if labels && k < n_tasks {
                    (&rows.labels, k)
                } else {
                    let k = k - if labels { n_tasks } else { 0 };
                    if k < n_tasks { (&rows.probs, k) } else { (&rows.logits, k - n_tasks) }
                };
                let v: Vec<f32> = src.iter().map(|r| r[t]).collect();
                col.typed::<FloatType>().write_batch(&v, None, None).map_err(parquet_err)?;
            } else if inputs && c == float_cols + 1 {
                let (v, def, rep) = list_levels(&rows.dense);
                col.typed::<FloatType>().write_batch(&v, Some(&def), Some(&rep)).map_err(parquet_err)?;
            } else {
                let f = c - float_cols - 2;
                let lists: Vec<&Vec<i64>> = rows.ids.iter().map(|r| &r[f]).collect();
                let (v, def, rep) = list_levels(&lists);
                col.typed::<Int64Type>().write_batch(&v, Some(&def), Some(&rep)).map_err(parquet_err)?;
            }
            col.close().map_err(parquet_err)?;
            c += 1;
        }
        rg.close().map_err(parquet_err)?;
        Ok(())
    }

    /// Closes the file and moves it into place.
    fn finish(mut self) -> Result<(), CliError> {
        if let Some(mut t) = self.text.take() {
            t.flush().map_err(runtime)?;
        }
        if let Some(p) = self.parquet.take() {
            p.close().map_err(parquet_err)?;
        }
        std::fs::rename(&self.tmp, &self.out)
            .map_err(|e| CliError::Runtime(format!("cannot write {}: {e}", self.out.display())))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Never a partial file: an unfinished output is removed.
        if self.tmp.exists() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Values, definition and repetition levels of a required list of required values per row.
fn list_levels<T: Copy, L: AsRef<[T]>>(lists: &[L]) -> (Vec<T>, Vec<i16>, Vec<i16>) {
    let (mut v, mut def, mut rep) = (Vec::new(), Vec::new(), Vec::new());
    for l in lists {
        let l = l.as_ref();
        if l.is_empty() {
            def.push(0);
            rep.push(0);
        }
        for (i, &x) in l.iter().enumerate() {
            v.push(x);
            def.push(1);
            rep.push(i16::from(i > 0));
        }
    }
    (v, def, rep)
}

fn floats(t: &Tensor) -> Result<Vec<f32>, CliError> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1])).map_err(runtime)
}

/// `trainrec predict`.
pub(crate) fn predict(registry: &Registry, args: &PredictArgs, options: &LoadOptions) -> Result<(), CliError> {
    let is_module = args.source.is_file();
    if !is_module && !args.source.is_dir() {
        return Err(CliError::Usage(format!(
            "predict: {} is neither a run directory nor a TorchScript file",
            args.source.display()
        )));
    }
    if is_module && (args.quantize.is_some() || args.step.is_some()) {
        return Err(CliError::Usage(
            "predict: --quantize and --step apply to a run directory; a TorchScript file's tables are as exported"
                .into(),
        ));
    }
    let mut _lock = None;
    let scorer = if is_module {
        module_scorer(registry, &args.source, options)?
    } else {
        let (mut job, _, lock) = checkpoint_job(registry, &args.source, args.step, options, "predict")?;
        _lock = Some(lock);
        if let Some(q) = args.quantize {
            job.quantize(q)?;
        }
        Scorer::Job(Box::new(job))
    };
    let (sampler_schema, tasks): (trainrec_data::FeatureSchema, Vec<(String, usize)>) = match &scorer {
        Scorer::Job(job) => (job.sampler_schema().clone(), job.tasks().to_vec()),
        Scorer::Module { sampler, tasks, .. } => (sampler.schema().clone(), tasks.clone()),
    };
    let features = sampler_schema.sparse.clone();
    let task_names: Vec<String> = tasks.iter().map(|(n, _)| n.clone()).collect();
    let num_labels = sampler_schema.labels.len();
    // Label columns when the data has every task's label.
    let labels = num_labels > 0 && tasks.iter().all(|&(_, c)| c < num_labels);
    let mut writer = Writer::new(&args.out, task_names.clone(), features.clone(), labels, args.with_inputs)?;
    let bar = trainrec_engine::run_dir::spinner(&format!("predict {}", args.split.name()));
    let batch_size = match &scorer {
        Scorer::Job(job) => job.eval_batch_size(),
        Scorer::Module { batch_size, .. } => *batch_size,
    };
    let batches = match &scorer {
        Scorer::Job(job) => job.batches(args.split, batch_size)?,
        Scorer::Module { sampler, .. } => sampler.batches(args.split, 0, batch_size).map_err(EngineError::from)?,
    };
    let mut next_row = 0i64;
    let mut rows = Rows::default();
    for batch in batches {
        let mut batch = batch.map_err(EngineError::from)?;
        trainrec_engine::inputs::expand_vbe(&mut batch.sparse)?;
        let n = batch.batch_size;
        if args.with_inputs {
            let kjt = batch.sparse.full_batch().map_err(runtime)?;
            for i in 0..n {
                rows.dense.push(batch.dense[i * batch.num_dense..(i + 1) * batch.num_dense].to_vec());
                rows.ids.push((0..features.len()).map(|k| kjt.feature(k).bag(i).to_vec()).collect());
            }
        }
        for i in 0..n {
            rows.row.push(next_row + i as i64);
            if labels {
                rows.labels.push(tasks.iter().map(|&(_, c)| batch.labels[i * num_labels + c]).collect());
            }
        }
        let logits = match &scorer {
            Scorer::Job(job) => job.predict_logits(batch)?,
            Scorer::Module { module, .. } => {
                let (dense, ids, lengths) = module_inputs(&batch)?;
                let out = module
                    .method_is("logits", &[IValue::Tensor(dense), IValue::TensorList(ids), IValue::TensorList(lengths)])
                    .map_err(|e| CliError::Runtime(format!("predict: {}: {e}", args.source.display())))?;
                match out {
                    IValue::Tensor(t) => t,
                    other => return Err(runtime(format!("predict: logits returned {other:?}, not a tensor"))),
                }
            }
        };
        let probs = floats(&logits.sigmoid())?;
        let logits = floats(&logits)?;
        let t = tasks.len();
        for i in 0..n {
            rows.probs.push(probs[i * t..(i + 1) * t].to_vec());
            rows.logits.push(logits[i * t..(i + 1) * t].to_vec());
        }
        next_row += n as i64;
        bar.set_position(next_row as u64);
        if rows.len() >= 65_536 {
            writer.write(&rows)?;
            rows = Rows::default();
        }
    }
    if rows.len() > 0 || next_row == 0 {
        writer.write(&rows)?;
    }
    writer.finish()?;
    bar.finish_and_clear();
    println!(
        "scored {next_row} examples of the {} split ({} task{}) into {}",
        args.split.name(),
        tasks.len(),
        if tasks.len() == 1 { "" } else { "s" },
        args.out.display()
    );
    Ok(())
}
