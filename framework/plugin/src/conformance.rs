//! The conformance kit: one call checks a sampler or model plugin against what the engine
//! relies on. Run it from the plugin's own tests:
//!
//! ```ignore
//! #[test]
//! fn conforms() {
//!     trainrec_plugin::conformance::SamplerCase::new(r#"path = "tests/data.txt""#)
//!         .check::<MySampler>()
//!         .assert_ok();
//! }
//! ```
//!
//! Samplers: the config parses; the built sampler's schema equals the declared one; two builds
//! with one seed give the same batches; every batch matches the declared features (dense
//! width, sparse keys in order, label columns, grouping keys exactly when declared, ids inside
//! their table's rows, finite values); every batch but the last of a split has the asked batch
//! size; an epoch ends, and a second pass works; the eval split is the same on every call.
//!
//! Models: the config passes the model's own check; logits are `[batch, tasks]` and finite in
//! train and eval mode; two builds under one seed agree; an example's eval logits do not depend
//! on the rest of its batch; gradients reach the pooled-embedding input (the embedding tables)
//! and every parameter.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;
use tch::{Device, Kind, Tensor, nn};

use crate::registry::{SamplerFactory, TypedModel, TypedSampler};
use crate::{Batch, FeatureSchema, ModelFactory, ModelInputs, SamplerContext, Split};

/// The outcome of a conformance run: every check by name, passed or with what failed.
#[derive(Debug, Default)]
pub struct Report {
    /// (check, `Ok` or what went wrong), in the order run.
    pub checks: Vec<(&'static str, Result<(), String>)>,
}

impl Report {
    fn check(&mut self, name: &'static str, result: Result<(), String>) -> bool {
        let ok = result.is_ok();
        self.checks.push((name, result));
        ok
    }

    /// The failed checks.
    pub fn failures(&self) -> Vec<(&'static str, &str)> {
        self.checks.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| (*n, e.as_str()))).collect()
    }

    /// True when every check passed.
    pub fn is_ok(&self) -> bool {
        self.failures().is_empty()
    }

    /// Panics (for use in tests) listing every failed check.
    #[track_caller]
    pub fn assert_ok(&self) {
        assert!(self.is_ok(), "conformance failed:\n{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, r) in &self.checks {
            match r {
                Ok(()) => writeln!(f, "  ok    {name}")?,
                Err(e) => writeln!(f, "  FAIL  {name}: {e}")?,
            }
        }
        Ok(())
    }
}

fn toml_to_json(text: &str) -> Result<Value, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| format!("the case's config is not TOML: {e}"))?;
    serde_json::to_value(table).map_err(|e| e.to_string())
}

/// A sampler conformance case: a config (the `[data.sampler]` table's TOML without `kind`)
/// and the sizes to check it at.
#[derive(Clone, Debug)]
pub struct SamplerCase {
    /// The sampler's config, as TOML.
    pub config: String,
    /// Rows of every sparse feature's table (ids must be below it).
    pub rows: u64,
    /// Batch size asked for.
    pub batch_size: usize,
    /// Batches an epoch may take before the check calls it endless.
    pub max_batches: usize,
    /// The seed of both builds.
    pub seed: u64,
    /// Directory relative paths in the config resolve against.
    pub base_dir: std::path::PathBuf,
}

impl SamplerCase {
    /// A case for `config` at 1,000 rows per table, batch size 16, at most 10,000 batches an
    /// epoch, relative paths from the current directory (a test's crate root).
    pub fn new(config: &str) -> Self {
        Self {
            config: config.to_owned(),
            rows: 1000,
            batch_size: 16,
            max_batches: 10_000,
            seed: 7,
            base_dir: std::path::PathBuf::from("."),
        }
    }

    /// Sets the batch size.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets the rows of every table.
    pub fn rows(mut self, n: u64) -> Self {
        self.rows = n;
        self
    }

    /// Sets the directory relative paths resolve against.
    pub fn base_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.base_dir = dir.into();
        self
    }

    /// Checks a typed sampler.
    pub fn check<S: TypedSampler>(&self) -> Report {
        self.check_factory(&crate::registry::typed_sampler_factory::<S>())
    }

    /// Checks a sampler factory (any registered sampler).
    pub fn check_factory(&self, factory: &dyn SamplerFactory) -> Report {
        let mut report = Report::default();
        let config = match toml_to_json(&self.config) {
            Ok(c) => c,
            Err(e) => {
                report.check("config parses", Err(e));
                return report;
            }
        };
        let declared = match factory.feature_schema(&config) {
            Ok(s) => s,
            Err(e) => {
                report.check("config parses", Err(e.to_string()));
                return report;
            }
        };
        report.check("config parses", Ok(()));
        let ctx = SamplerContext {
            feature_rows: declared.sparse.iter().map(|f| (f.clone(), self.rows)).collect(),
            base_dir: self.base_dir.clone(),
            seed: self.seed,
            rank: 0,
            world_size: 1,
        };
        let build = || factory.build(&config, &ctx).map_err(|e| e.to_string());
        let (a, b) = match (build(), build()) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                report.check("builds", Err(e));
                return report;
            }
        };
        report.check("builds", Ok(()));
        report.check(
            "schema equals the declared features",
            if *a.schema() == declared {
                Ok(())
            } else {
                Err(format!("declared {declared:?}, built {:?}", a.schema()))
            },
        );
        let bs = self.batch_size;
        let collect = |s: &dyn crate::Sampler, split, epoch| -> Result<Vec<Batch>, String> {
            let mut out = Vec::new();
            for batch in s.batches(split, epoch, bs).map_err(|e| e.to_string())? {
                out.push(batch.map_err(|e| e.to_string())?);
                if out.len() > self.max_batches {
                    return Err(format!("the {split:?} split did not end within {} batches", self.max_batches));
                }
            }
            Ok(out)
        };
        let passes = [
            ("train epoch 0", collect(a.as_ref(), Split::Train, 0)),
            ("train epoch 0 (second build)", collect(b.as_ref(), Split::Train, 0)),
            ("train epoch 1", collect(a.as_ref(), Split::Train, 1)),
            ("eval", collect(a.as_ref(), Split::Eval, 0)),
            ("eval (second call)", collect(a.as_ref(), Split::Eval, 5)),
        ];
        let mut splits = BTreeMap::new();
        let mut ended = Ok(());
        for (name, pass) in passes {
            match pass {
                Ok(batches) => {
                    splits.insert(name, batches);
                }
                Err(e) => {
                    if ended.is_ok() {
                        ended = Err(format!("{name}: {e}"));
                    }
                }
            }
        }
        if !report.check("every pass ends cleanly", ended) {
            return report;
        }
        let train = &splits["train epoch 0"];
        report.check(
            "same seed, same batches",
            if train == &splits["train epoch 0 (second build)"] {
                Ok(())
            } else {
                Err("two builds with one seed gave different training batches".into())
            },
        );
        report.check(
            "eval split is the same on every call",
            if splits["eval"] == splits["eval (second call)"] {
                Ok(())
            } else {
                Err("two passes over the eval split differ".into())
            },
        );
        let empty: Vec<&str> = splits.iter().filter(|(_, b)| b.is_empty()).map(|(n, _)| *n).collect();
        report.check(
            "splits are not empty",
            if empty.is_empty() { Ok(()) } else { Err(format!("no batch in: {}", empty.join(", "))) },
        );
        let mut shape = Ok(());
        let mut sizes = Ok(());
        for (name, batches) in &splits {
            for (i, batch) in batches.iter().enumerate() {
                if shape.is_ok() {
                    shape = batch_matches(batch, &declared, self.rows)
                        .and_then(|()| weights_match(batch, a.weighted()))
                        .map_err(|e| format!("{name}, batch {i}: {e}"));
                }
                let last = i + 1 == batches.len();
                let ok = if last { (1..=bs).contains(&batch.batch_size) } else { batch.batch_size == bs };
                if !ok && sizes.is_ok() {
                    sizes = Err(format!(
                        "{name}, batch {i} of {}: {} examples, asked for {bs}{}",
                        batches.len(),
                        batch.batch_size,
                        if last { " (a last batch may be smaller, not empty or larger)" } else { "" }
                    ));
                }
            }
        }
        report.check("batches match the declared features", shape);
        report.check("batch size honoured", sizes);
        report
    }
}

/// Why `batch` does not match `schema` (ids must be below `rows`).
pub fn batch_matches(batch: &Batch, schema: &FeatureSchema, rows: u64) -> Result<(), String> {
    let n = batch.batch_size;
    if batch.num_dense != schema.num_dense || batch.dense.len() != n * schema.num_dense {
        return Err(format!(
            "{} dense values with num_dense {} for {n} examples; the schema declares {} per example",
            batch.dense.len(),
            batch.num_dense,
            schema.num_dense
        ));
    }
    if batch.labels.len() != n * schema.labels.len() {
        return Err(format!(
            "{} labels for {n} examples; the schema declares {} column(s) {:?}",
            batch.labels.len(),
            schema.labels.len(),
            schema.labels
        ));
    }
    if batch.sparse.keys() != schema.sparse.as_slice() {
        return Err(format!("sparse keys {:?}; the schema declares {:?}", batch.sparse.keys(), schema.sparse));
    }
    if batch.sparse.stride() != n {
        return Err(format!("sparse stride {} for {n} examples", batch.sparse.stride()));
    }
    match (&batch.groups, &schema.grouping_key) {
        (Some(g), Some(_)) if g.len() != n => return Err(format!("{} grouping keys for {n} examples", g.len())),
        (Some(_), None) => return Err("the batch carries grouping keys the schema does not declare".into()),
        (None, Some(k)) => return Err(format!("the schema declares grouping key {k:?}, the batch has none")),
        _ => {}
    }
    if let Some(&id) = batch.sparse.values().iter().find(|&&v| v < 0 || v as u64 >= rows) {
        return Err(format!("id {id} outside its table's rows 0..{rows}"));
    }
    if batch.dense.iter().chain(&batch.labels).any(|v| !v.is_finite()) {
        return Err("a dense value or label is not finite".into());
    }
    Ok(())
}

/// Why `batch`'s sample weights do not match a sampler that says it is `weighted` (one finite
/// weight `>= 0` per example when it is, none when not).
pub fn weights_match(batch: &Batch, weighted: bool) -> Result<(), String> {
    match (&batch.weights, weighted) {
        (Some(w), true) if w.len() != batch.batch_size => {
            Err(format!("{} sample weights for {} examples", w.len(), batch.batch_size))
        }
        (Some(w), true) => match w.iter().find(|x| !(x.is_finite() && **x >= 0.0)) {
            Some(x) => Err(format!("sample weight {x}: weights must be finite and >= 0")),
            None => Ok(()),
        },
        (Some(_), false) => Err("the batch carries sample weights but the sampler's weighted() is false".into()),
        (None, true) => Err("the sampler's weighted() is true but the batch has no sample weights".into()),
        (None, false) => Ok(()),
    }
}

/// A model conformance case: a config (the `[model]` table's TOML without `kind`) and the
/// inputs to build it for.
#[derive(Clone, Debug)]
pub struct ModelCase {
    /// The model's config, as TOML.
    pub config: String,
    /// The job's inputs.
    pub inputs: ModelInputs,
    /// Examples per checked batch.
    pub batch_size: i64,
}

impl ModelCase {
    /// A case with `num_dense` dense features, one pooled feature per dim in `dims`
    /// (named `f0`, `f1`, ...), one task, batch size 8.
    pub fn new(config: &str, num_dense: usize, dims: &[usize]) -> Self {
        let key = |i| crate::KeyPath::root().key("tables").index(i).key("dim");
        Self {
            config: config.to_owned(),
            inputs: ModelInputs {
                num_dense,
                sparse: dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
                sparse_dim_keys: (0..dims.len()).map(key).collect(),
                num_tasks: 1,
                sequences: Vec::new(),
            },
            batch_size: 8,
        }
    }

    /// Sets the number of tasks.
    pub fn tasks(mut self, n: usize) -> Self {
        self.inputs.num_tasks = n;
        self
    }

    /// Adds sequence features (name, dim), for a model that reads sequences: each example of a
    /// checked batch gets 0 to 4 ids of each (the first example at least one).
    pub fn sequences(mut self, sequences: &[(&str, usize)]) -> Self {
        self.inputs.sequences = sequences.iter().map(|&(n, d)| (n.to_owned(), d)).collect();
        self
    }

    /// The checked batch's sequence features: leaves that receive their gradient.
    fn jagged(&self) -> Vec<(String, crate::JaggedEmbeddings)> {
        let b = self.batch_size as usize;
        self.inputs
            .sequences
            .iter()
            .enumerate()
            .map(|(k, (name, dim))| {
                let lengths: Vec<usize> = (0..b).map(|e| if e == 0 { 1 + k % 4 } else { (e * 3 + k) % 5 }).collect();
                let n = lengths.iter().sum::<usize>() as i64;
                let values =
                    (Tensor::randn([n, *dim as i64], (Kind::Float, Device::Cpu)) * 0.5).set_requires_grad(true);
                let j = crate::JaggedEmbeddings::new(values, lengths).expect("lengths sum to the rows");
                (name.clone(), j)
            })
            .collect()
    }

    /// Checks a typed model.
    pub fn check<M: TypedModel>(&self) -> Report {
        self.check_factory(&crate::registry::typed_model_factory::<M>())
    }

    /// Checks a model factory (any registered model).
    pub fn check_factory(&self, factory: &dyn ModelFactory) -> Report {
        let mut report = Report::default();
        let config = match toml_to_json(&self.config) {
            Ok(c) => c,
            Err(e) => {
                report.check("config passes the model's check", Err(e));
                return report;
            }
        };
        let problems = factory.check(&config, &self.inputs);
        let listed = problems.iter().map(|d| format!("{}: {}", d.key, d.message)).collect::<Vec<_>>().join("; ");
        if !report.check("config passes the model's check", if problems.is_empty() { Ok(()) } else { Err(listed) }) {
            return report;
        }
        let build = |seed| {
            tch::manual_seed(seed);
            let vs = nn::VarStore::new(Device::Cpu);
            factory.build(&vs.root(), &config, &self.inputs).map(|m| (vs, m)).map_err(|e| format!("{e:?}"))
        };
        // libtorch's generator is global to the process: a test running in another thread can
        // draw from it between `manual_seed` and the build. Such a race changes the twin's
        // parameters; it does not repeat three times in a row, while a model that ignores the
        // seed differs every time.
        let same_parameters = |a: &nn::VarStore, b: &nn::VarStore| {
            let (a, b) = (a.variables(), b.variables());
            a.len() == b.len() && a.iter().all(|(k, v)| b.get(k).is_some_and(|w| v.size() == w.size() && v.equal(w)))
        };
        let mut attempt = 0;
        let ((vs, model), (_, twin)) = loop {
            match (build(11), build(11)) {
                (Ok(a), Ok(b)) => {
                    attempt += 1;
                    if attempt == 3 || same_parameters(&a.0, &b.0) {
                        break (a, b);
                    }
                }
                (Err(e), _) | (_, Err(e)) => {
                    report.check("builds", Err(e));
                    return report;
                }
            }
        };
        report.check("builds", Ok(()));
        let (b, tasks) = (self.batch_size, self.inputs.num_tasks as i64);
        let width: usize = self.inputs.sparse.iter().map(|(_, d)| d).sum();
        tch::manual_seed(3);
        let dense = Tensor::rand([b, self.inputs.num_dense as i64], (Kind::Float, Device::Cpu));
        let sparse = (Tensor::randn([b, width as i64], (Kind::Float, Device::Cpu)) * 0.5).set_requires_grad(true);
        let sequences = self.jagged();
        let detached: Vec<(String, crate::JaggedEmbeddings)> = sequences
            .iter()
            .map(|(n, j)| {
                (n.clone(), crate::JaggedEmbeddings { values: j.values.detach(), lengths: j.lengths.clone() })
            })
            .collect();
        // Example 0 alone: its rows of each sequence.
        let first_only: Vec<(String, crate::JaggedEmbeddings)> = detached
            .iter()
            .map(|(n, j)| {
                let rows = j.values.narrow(0, 0, j.lengths[0] as i64);
                (n.clone(), crate::JaggedEmbeddings { values: rows, lengths: vec![j.lengths[0]] })
            })
            .collect();
        let shape_of = |t: &Tensor| -> Result<(), String> {
            if t.size() != [b, tasks] {
                return Err(format!("logits {:?}, expected [{b}, {tasks}] (batch, tasks)", t.size()));
            }
            if t.isfinite().all().int64_value(&[]) == 0 {
                return Err("logits are not all finite".into());
            }
            Ok(())
        };
        let sparse_detached = sparse.detach();
        let train_input = crate::ModelInput { dense: &dense, pooled: &sparse, sequences: &sequences, catalogue: None };
        let eval_input =
            crate::ModelInput { dense: &dense, pooled: &sparse_detached, sequences: &detached, catalogue: None };
        let train_logits = model.forward_input(&train_input, true);
        let eval_logits = tch::no_grad(|| model.forward_input(&eval_input, false));
        if !report
            .check("logits are [batch, tasks] and finite", shape_of(&train_logits).and_then(|_| shape_of(&eval_logits)))
        {
            return report;
        }
        let again = tch::no_grad(|| twin.forward_input(&eval_input, false));
        report.check(
            "same seed, same model",
            close(&eval_logits, &again).map_err(|e| format!("two builds under one seed: {e}")),
        );
        let (dense0, sparse0) = (dense.narrow(0, 0, 1), sparse_detached.narrow(0, 0, 1));
        let first_input =
            crate::ModelInput { dense: &dense0, pooled: &sparse0, sequences: &first_only, catalogue: None };
        let first = tch::no_grad(|| model.forward_input(&first_input, false));
        report.check(
            "an example's eval logits do not depend on its batch",
            close(&eval_logits.narrow(0, 0, 1), &first)
                .map_err(|e| format!("example 0 alone vs in a batch of {b}: {e}")),
        );
        train_logits.sum(Kind::Float).backward();
        let mut grads = Ok(());
        let sparse_grad = sparse.grad();
        if width > 0 && (!sparse_grad.defined() || sparse_grad.abs().sum(Kind::Float).double_value(&[]) == 0.0) {
            grads = Err("no gradient reaches the pooled embeddings (the tables would never train)".to_owned());
        }
        for (name, j) in &sequences {
            let g = j.values.grad();
            if grads.is_ok() && (!g.defined() || g.abs().sum(Kind::Float).double_value(&[]) == 0.0) {
                grads = Err(format!("no gradient reaches sequence feature {name} (its table would never train)"));
            }
        }
        if grads.is_ok() {
            for (name, var) in vs.variables() {
                let g = var.grad();
                if !g.defined() || g.abs().sum(Kind::Float).double_value(&[]) == 0.0 {
                    grads = Err(format!("parameter {name} gets no gradient"));
                    break;
                }
                if g.isfinite().all().int64_value(&[]) == 0 {
                    grads = Err(format!("parameter {name} has a non-finite gradient"));
                    break;
                }
            }
        }
        report.check("gradients reach the embeddings and every parameter", grads);
        report
    }
}

fn close(a: &Tensor, b: &Tensor) -> Result<(), String> {
    let diff = (a - b).abs().max().double_value(&[]);
    if diff <= 1e-5 { Ok(()) } else { Err(format!("logits differ by up to {diff:.3e}")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_synthetic_sampler_conforms() {
        let report = SamplerCase::new("train_samples = 100\neval_samples = 30\nsession_size = 4")
            .check::<trainrec_data::SyntheticSampler>();
        report.assert_ok();
        assert_eq!(report.checks.len(), 9);
    }

    #[test]
    fn dlrm_conforms_and_a_bad_config_fails_by_key() {
        ModelCase::new("dense_arch = [8, 4]\nover_arch = [8, 1]", 3, &[4, 4])
            .check::<trainrec_models::Dlrm>()
            .assert_ok();
        let report =
            ModelCase::new("dense_arch = [8, 4]\nover_arch = [8, 1]", 3, &[4, 5]).check::<trainrec_models::Dlrm>();
        let failures = report.failures();
        assert_eq!(failures.len(), 1, "{report}");
        assert!(failures[0].1.contains("tables[1].dim"), "{report}");
    }

    #[test]
    fn din_conforms_with_sequences_and_a_model_ignoring_its_history_fails() {
        let config = "candidate = \"item\"\nhistory = \"history\"\nmlp = [8, 1]";
        let case = ModelCase::new(config, 2, &[4]).sequences(&[("item", 3), ("history", 3)]);
        case.check::<trainrec_models::Din>().assert_ok();
        // A batch with a sequence feature the model never reads ("history", while it reads
        // "other"): that feature's rows get no gradient, which the kit reports by name.
        let case = ModelCase::new("candidate = \"item\"\nhistory = \"other\"\nmlp = [8, 1]", 2, &[4]).sequences(&[
            ("item", 3),
            ("other", 3),
            ("history", 3),
        ]);
        let report = case.check::<trainrec_models::Din>();
        let failures = report.failures();
        assert!(failures.iter().any(|f| f.1.contains("sequence feature history")), "{report}");
    }

    /// A sampler that breaks the contract in two ways the kit must catch.
    struct Broken;
    impl crate::Sampler for Broken {
        fn schema(&self) -> &FeatureSchema {
            static S: std::sync::OnceLock<FeatureSchema> = std::sync::OnceLock::new();
            S.get_or_init(|| FeatureSchema {
                num_dense: 1,
                sparse: vec!["a".into()],
                labels: vec!["label".into()],
                grouping_key: None,
            })
        }
        fn batches(&self, _: Split, _: u64, bs: usize) -> Result<crate::BatchStream, crate::DataError> {
            // Batches of bs + 1 with an id past the table, from a fresh random seed each call.
            let n = bs + 1;
            let id = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 7)
                as i64
                + 1000;
            let batch = Batch {
                dense: vec![0.5; n],
                num_dense: 1,
                sparse: trainrec_sparse::KeyedJaggedTensor::new(vec!["a".into()], vec![id; n], None, vec![1; n], n)
                    .unwrap(),
                labels: vec![1.0; n],
                batch_size: n,
                groups: None,
                weights: None,
            };
            Ok(Box::new(vec![Ok(batch.clone()), Ok(batch)].into_iter()))
        }
    }
    impl crate::TypedSampler for Broken {
        type Config = serde_json::Map<String, Value>;
        const KIND: &'static str = "broken";
        fn features(_: &Self::Config) -> FeatureSchema {
            crate::Sampler::schema(&Broken).clone()
        }
        fn build(_: Self::Config, _: &SamplerContext) -> Result<Self, crate::DataError> {
            Ok(Broken)
        }
    }

    #[test]
    fn a_broken_sampler_fails_by_name() {
        let report = SamplerCase::new("").check::<Broken>();
        // (Its ids also change between builds; whether two draws collide is left to chance,
        // so the determinism check is not asserted here.)
        let failed: Vec<&str> = report.failures().iter().map(|f| f.0).collect();
        assert!(failed.contains(&"batch size honoured"), "{report}");
        assert!(failed.contains(&"batches match the declared features"), "{report}");
        assert!(report.to_string().contains("id 100"), "{report}");
    }

    #[test]
    fn sample_weights_must_match_the_samplers_word() {
        let batch = |weights: Option<Vec<f32>>| Batch {
            dense: vec![],
            num_dense: 0,
            sparse: trainrec_sparse::KeyedJaggedTensor::new(vec![], vec![], None, vec![], 2).unwrap(),
            labels: vec![0.0, 1.0],
            batch_size: 2,
            groups: None,
            weights,
        };
        assert_eq!(weights_match(&batch(Some(vec![0.0, 2.5])), true), Ok(()));
        assert_eq!(weights_match(&batch(None), false), Ok(()));
        assert!(weights_match(&batch(Some(vec![1.0])), true).unwrap_err().contains("1 sample weights for 2"));
        assert!(weights_match(&batch(Some(vec![1.0, -1.0])), true).unwrap_err().contains("-1"));
        assert!(weights_match(&batch(Some(vec![1.0, f32::NAN])), true).unwrap_err().contains("NaN"));
        assert!(weights_match(&batch(Some(vec![1.0, 1.0])), false).unwrap_err().contains("weighted() is false"));
        assert!(weights_match(&batch(None), true).unwrap_err().contains("no sample weights"));
    }
}
