//! `trainrec export --format torchscript`: a job's whole model as one TorchScript file that
//! plain PyTorch (`torch.jit.load`) and libtorch run: the embedding lookups over the tables
//! (fp32, or quantized to int8 / fp16), the managed-collision remap of raw ids, the dense model
//! and the task heads.
//!
//! The file's interface (documented in the book's serving chapter):
//! - `forward(dense: Tensor, ids: List[Tensor], lengths: List[Tensor]) -> Tensor`: `dense`
//!   float32 `[B, num_dense]`; `ids[f]` int64, feature `f`'s ids for the batch (bag of example
//!   0 first), features in the order of attribute `feature_names`; `lengths[f]` int64 `[B]`.
//!   Returns probabilities `[B, num_tasks]` (tasks in the order of `task_names`).
//! - `logits(dense, ids, lengths)`: the same before the sigmoid.
//! - `forward_kjt(dense, values, lengths)`: one KJT-like pair, `values` every feature's ids
//!   concatenated in key order, `lengths` int64 `[F * B]` feature-major.
//! - a retrieval (two-tower) model also: `query_embeddings(dense, ids, lengths)`,
//!   `candidate_embeddings(ids, lengths)`, and the attribute `corpus` `[rows, d]` (row `r`:
//!   candidate id `r`) when the candidate side is one single-id feature.
//! - attributes `feature_names`, `task_names`, `num_dense`; extra files `extra/recipe.toml`
//!   (the resolved recipe) and `extra/trainrec.json`.

use std::path::Path;

use tch::{Kind, Tensor};
use trainrec_embedding::quant::{QuantPrecision, quantize_row_int8};
use trainrec_models::ModelError;
use trainrec_models::script::{Attr, Dtype, ScriptModule, TensorBytes};
use trainrec_types::{FeatureRef, PoolingMode, Word};

use crate::error::EngineError;
use crate::job::Job;

/// What [`export_torchscript`] wrote.
#[derive(Clone, Debug)]
pub struct TorchScriptSummary {
    /// Bytes written.
    pub bytes: u64,
    /// Tables in the file.
    pub tables: usize,
    /// The input features, in the order the file takes them.
    pub features: Vec<String>,
    /// The tasks, in the order of the output's columns.
    pub tasks: Vec<String>,
    /// Whether the retrieval corpus embeddings are in the file.
    pub corpus: bool,
}

/// The format tag written in `extra/trainrec.json`.
pub const FORMAT: &str = "trainrec-torchscript-1";

fn script_error(kind: &str, e: ModelError) -> EngineError {
    match e {
        ModelError::NotScriptable => EngineError::Unsupported(format!(
            "model kind \"{kind}\" cannot be exported to TorchScript: its DenseModel does not implement `torchscript` (help: export it as safetensors with --format safetensors, or implement DenseModel::torchscript in the plugin)"
        )),
        e => EngineError::Internal(format!("TorchScript export of model \"{kind}\": {e}")),
    }
}

/// The quantized (or fp32) values of one table as a tensor attribute.
fn table_tensor(weights: &[f32], rows: u64, dim: usize, quantize: Option<QuantPrecision>) -> TensorBytes {
    let shape = vec![rows as i64, dim as i64];
    match quantize {
        None => TensorBytes::f32(shape, weights),
        Some(QuantPrecision::Fp16) => {
            // Rounded to the nearest fp16 (ties to even), as `trainrec eval --quantize fp16`
            // rounds: one conversion of the whole table.
            let half = Tensor::from_slice(weights).to_kind(Kind::Half);
            let mut bytes = vec![0u8; weights.len() * 2];
            half.copy_data_u8(&mut bytes, weights.len());
            TensorBytes { dtype: Dtype::F16, shape, bytes }
        }
        Some(QuantPrecision::Int8) => {
            let mut bytes = Vec::with_capacity(rows as usize * (dim + 8));
            weights.chunks(dim.max(1)).for_each(|r| quantize_row_int8(r, &mut bytes));
            TensorBytes { dtype: Dtype::U8, shape: vec![rows as i64, dim as i64 + 8], bytes }
        }
    }
}

/// The retrieval corpus a two-tower file carries: every row of the table of the model's one
/// candidate feature (none when the candidate side has several features).
fn corpus_spec(job: &Job) -> Option<crate::inputs::RetrievalSpec> {
    let [feature] = job.model.retrieval()?.candidate_features() else { return None };
    let rows = job.recipe.tables.iter().find(|t| t.features.iter().any(|f| f == feature))?.rows;
    Some(crate::inputs::RetrievalSpec { input: FeatureRef::parse(feature).input.to_owned(), rows, ks: Vec::new() })
}

/// The TorchScript export has no sequence or position-weight path yet: a job with sequence or
/// position-weighted tables is refused, naming the table.
fn refuse_sequences(job: &Job) -> Result<(), EngineError> {
    match job.recipe.tables.iter().find(|t| crate::inputs::in_collection(t)) {
        Some(t) => {
            let what = if crate::inputs::is_sequence(t) {
                "a sequence table (pooling = \"none\")"
            } else {
                "position-weighted (tables[].position_weighted)"
            };
            Err(EngineError::Unsupported(format!(
                "the TorchScript export has no sequence or position-weight path yet: table \"{}\" is {what}; \
                 export the checkpoint's tensors with `--format safetensors`, or score with `trainrec predict`",
                t.name
            )))
        }
        None => Ok(()),
    }
}

/// The serving model of a one-rank `job` (its trained state loaded), tables quantized as
/// `quantize` says.
pub fn script_module(job: &Job, quantize: Option<QuantPrecision>, step: u64) -> Result<ScriptModule, EngineError> {
    let kind = job.recipe.model.kind().unwrap_or_default().to_string();
    refuse_sequences(job)?;
    let mut m = ScriptModule::new("TrainrecModel");
    let vars = job.vs.variables();
    job.model.torchscript(&vars, &mut m).map_err(|e| script_error(&kind, e))?;
    let features: Vec<String> = job.sampler.schema().sparse.clone();
    let tasks: Vec<String> = job.layout.tasks.iter().map(|(n, _)| n.clone()).collect();
    m.attr("feature_names", Attr::Strings(features.clone()));
    m.attr("task_names", Attr::Strings(tasks));
    m.attr("num_dense", Attr::Int(job.layout.num_dense as i64));
    m.attr("step", Attr::Int(step as i64));

    // Managed collisions: a remap method per table.
    let mut remap_of = std::collections::BTreeMap::new();
    for s in job.mc.serving()? {
        let t = |m: &mut ScriptModule, what: &str, v: &[i64]| {
            m.attr(&format!("mc_{}_{what}", s.table), Attr::Tensor(TensorBytes::i64(vec![v.len() as i64], v)))
        };
        let ids = t(&mut m, "ids", &s.ids);
        let rows = t(&mut m, "rows", &s.rows);
        let start = t(&mut m, "part_start", &s.part_start);
        let first = t(&mut m, "first_row", &s.first_row);
        let part_rows = t(&mut m, "part_rows", &s.part_rows);
        let zch = t(&mut m, "zch", &s.zch);
        let method = format!("remap_{}", remap_of.len());
        let hit = if s.ids.is_empty() {
            "    return fb".to_string()
        } else {
            format!(
                "    pos = torch.clamp(torch.searchsorted({ids}, ids), 0, {last})\n    hit = torch.eq(torch.index_select({ids}, 0, pos), ids)\n    return torch.where(hit, torch.index_select({rows}, 0, pos), fb)",
                last = s.ids.len() - 1
            )
        };
        // The fallback row of an untracked id: in its part, `zch + mix(id) % (rows - zch)`
        // (the last row when every row is a slot), mix being SplitMix64's finalizer in
        // wrapping int64 arithmetic, shifts made logical by masks.
        m.method(format!(
            "def {method}(self, ids: Tensor) -> Tensor:
    part = torch.sub(torch.searchsorted({start}, ids, right=True), 1)
    first = torch.index_select({first}, 0, part)
    prows = torch.index_select({part_rows}, 0, part)
    zch = torch.index_select({zch}, 0, part)
    z = torch.add(ids, {c1})
    z = torch.mul(torch.bitwise_xor(z, torch.bitwise_and(torch.bitwise_right_shift(z, 30), {m34})), {c2})
    z = torch.mul(torch.bitwise_xor(z, torch.bitwise_and(torch.bitwise_right_shift(z, 27), {m37})), {c3})
    z = torch.bitwise_xor(z, torch.bitwise_and(torch.bitwise_right_shift(z, 31), {m33}))
    span = torch.clamp(torch.sub(prows, zch), 1)
    half = torch.bitwise_and(torch.bitwise_right_shift(z, 1), {m63})
    r = torch.remainder(torch.add(torch.mul(torch.remainder(half, span), 2), torch.bitwise_and(z, 1)), span)
    fb = torch.add(first, torch.where(torch.eq(zch, prows), torch.sub(prows, 1), torch.add(zch, r)))
{hit}
",
            c1 = 0x9E37_79B9_7F4A_7C15u64 as i64,
            c2 = 0xBF58_476D_1CE4_E5B9u64 as i64,
            c3 = 0x94D0_49BB_1331_11EBu64 as i64,
            m34 = (1i64 << 34) - 1,
            m37 = (1i64 << 37) - 1,
            m33 = (1i64 << 33) - 1,
            m63 = i64::MAX,
        ));
        remap_of.insert(s.table.clone(), method);
    }

    // Dynamic tables: a lookup method per table giving each raw id its row and a weight (1 with
    // a row, 0 without).
    let mut dynamic_of = std::collections::BTreeMap::new();
    for table in &job.recipe.tables {
        let Some((ids, rows)) = job.mc.dynamic.serving(&table.name) else { continue };
        let method = format!("dynamic_{}", dynamic_of.len());
        let source = if ids.is_empty() {
            format!(
                "def {method}(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
    return torch.zeros_like(ids), torch.zeros(ids.size(0))
"
            )
        } else {
            let t = |m: &mut ScriptModule, what: &str, v: &[i64]| {
                m.attr(
                    &format!("dynamic_{}_{what}", table.name),
                    Attr::Tensor(TensorBytes::i64(vec![v.len() as i64], v)),
                )
            };
            let (sorted, at) = (t(&mut m, "ids", &ids), t(&mut m, "rows", &rows));
            format!(
                "def {method}(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
    pos = torch.clamp(torch.searchsorted({sorted}, ids), 0, {last})
    hit = torch.eq(torch.index_select({sorted}, 0, pos), ids)
    rows = torch.where(hit, torch.index_select({at}, 0, pos), torch.zeros_like(ids))
    return rows, hit.float()
",
                last = ids.len() - 1
            )
        };
        m.method(source);
        dynamic_of.insert(table.name.clone(), method);
    }

    // The pooled lookups, in the dense model's column order.
    let mut body = vec!["    offsets = [torch.sub(torch.cumsum(l, 0), l) for l in lengths]".to_string()];
    let mut pooled = Vec::new();
    for table in &job.recipe.tables {
        let weights = job.table_weights(&table.name)?.ok_or_else(|| {
            EngineError::Internal(format!("table {} is not held by this job (export runs one rank)", table.name))
        })?;
        let w = m.attr(
            &format!("table_{}", table.name),
            Attr::Tensor(table_tensor(&weights, table.rows, table.dim, quantize)),
        );
        let mean = table.pooling == PoolingMode::Mean;
        for f in &table.features {
            let input = FeatureRef::parse(f).input;
            let k = features.iter().position(|x| x == input).ok_or_else(|| {
                EngineError::Internal(format!("feature {input} of table {} is not a sampler feature", table.name))
            })?;
            let n = pooled.len();
            // A dynamic table: ids without a row read row 0 with weight 0 (they add nothing, as
            // in training, where they leave their bag).
            let weights = match dynamic_of.get(&table.name) {
                Some(method) => {
                    body.push(format!("    d{n}, w{n} = self.{method}(ids[{k}])"));
                    Some(format!("w{n}"))
                }
                None => None,
            };
            let ids = match (remap_of.get(&table.name), &weights) {
                (_, Some(_)) => format!("d{n}"),
                (Some(method), None) => format!("self.{method}(ids[{k}])"),
                (None, None) => format!("ids[{k}]"),
            };
            let psw = weights.clone().unwrap_or_else(|| "None".into());
            let v = format!("e{n}");
            let sum = match quantize {
                None => format!(
                    "torch.embedding_bag({w}, {ids}, offsets[{k}], False, {}, False, {psw}, False)[0]",
                    u8::from(mean)
                ),
                Some(QuantPrecision::Int8) => format!(
                    "ops.quantized.embedding_bag_byte_rowwise_offsets({w}, {ids}, offsets[{k}], False, 0, False, {psw}, None, False)"
                ),
                Some(QuantPrecision::Fp16) => {
                    body.push(format!("    r{n} = torch.index_select({w}, 0, {ids}).float()"));
                    format!(
                        "torch.embedding_bag(r{n}, torch.arange(r{n}.size(0)), offsets[{k}], False, 0, False, {psw}, False)[0]"
                    )
                }
            };
            body.push(format!("    {v} = {sum}"));
            if mean && quantize.is_some() {
                body.push(format!("    {v} = {v} / torch.clamp(torch.unsqueeze(lengths[{k}], 1), 1).float()"));
            }
            pooled.push(v);
        }
    }
    m.method(format!(
        "def embed(self, ids: List[Tensor], lengths: List[Tensor]) -> Tensor:\n{}\n    return torch.cat([{}], 1)\n",
        body.join("\n"),
        pooled.join(", ")
    ));
    m.method(
        "def logits(self, dense: Tensor, ids: List[Tensor], lengths: List[Tensor]) -> Tensor:
    return self.dense_forward(dense, self.embed(ids, lengths))
",
    );
    m.method(
        "def forward(self, dense: Tensor, ids: List[Tensor], lengths: List[Tensor]) -> Tensor:
    return torch.sigmoid(self.logits(dense, ids, lengths))
",
    );
    m.method(format!(
        "def forward_kjt(self, dense: Tensor, values: Tensor, lengths: Tensor) -> Tensor:
    per = torch.reshape(lengths, [{f}, dense.size(0)])
    counts: List[int] = torch.sum(per, 1).tolist()
    ids = torch.split(values, counts)
    return self.forward(dense, ids, torch.unbind(per, 0))
",
        f = features.len()
    ));
    if job.model.retrieval().is_some() {
        m.method(
            "def query_embeddings(self, dense: Tensor, ids: List[Tensor], lengths: List[Tensor]) -> Tensor:
    return self.query_tower(dense, self.embed(ids, lengths))
",
        );
        m.method(
            "def candidate_embeddings(self, ids: List[Tensor], lengths: List[Tensor]) -> Tensor:
    return self.candidate_tower(self.embed(ids, lengths))
",
        );
        if let Some(spec) = corpus_spec(job) {
            let corpus = job.corpus_embeddings(&spec)?;
            m.tensor("corpus", &corpus).map_err(|e| script_error(&kind, e.into()))?;
            m.attr("corpus_feature", Attr::Strings(vec![spec.input.clone()]));
        }
    }
    Ok(m)
}

/// Writes a one-rank `job`'s model (its trained state loaded: [`Job::load_checkpoint`]) as a
/// TorchScript file at `out` (through a temporary file and a rename).
pub fn export_torchscript(
    job: &Job,
    quantize: Option<QuantPrecision>,
    step: u64,
    out: &Path,
) -> Result<TorchScriptSummary, EngineError> {
    let m = script_module(job, quantize, step)?;
    let meta = serde_json::json!({
        "format": FORMAT,
        "step": step,
        "quantize": quantize.map(Word::name),
        "model": job.recipe.model.kind(),
        "features": job.sampler.schema().sparse,
        "tasks": job.layout.tasks.iter().map(|(n, c)| serde_json::json!({
            "name": n,
            "label": job.sampler.schema().labels.get(*c),
        })).collect::<Vec<_>>(),
        "base_dir": job.base_dir,
        "num_dense": job.layout.num_dense,
    });
    let meta = serde_json::to_vec_pretty(&meta).map_err(|e| EngineError::Internal(e.to_string()))?;
    let archive = out.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let bytes = m
        .archive(archive, &[("recipe.toml", job.resolved_toml.as_bytes()), ("trainrec.json", &meta)])
        .map_err(|e| script_error(job.recipe.model.kind().unwrap_or_default(), e.into()))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| EngineError::Io { path: parent.to_path_buf(), source: e })?;
    }
    crate::run_dir::write_atomic(out, &bytes)?;
    let corpus = corpus_spec(job).is_some();
    Ok(TorchScriptSummary {
        bytes: bytes.len() as u64,
        tables: job.recipe.tables.len(),
        features: job.sampler.schema().sparse.clone(),
        tasks: job.layout.tasks.iter().map(|(n, _)| n.clone()).collect(),
        corpus,
    })
}
