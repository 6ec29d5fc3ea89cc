//! The recipe as each part of a job sees it: the embedding tables (as planned), the pooled
//! outputs the dense model reads, the tasks and their label columns, the batch layout, the
//! retrieval corpus, and the planner's inputs (with the dense model's memory) and plan.

use std::path::Path;

use tch::{Device, nn};
use trainrec_data::FeatureSchema;
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig};
use trainrec_models::{DenseModel, ModelInputs};
use trainrec_planner::{Plan, PlanError, PlanInput, explain, load_plan};
use trainrec_recipe::plan::plan_input;
use trainrec_recipe::{FeatureRef, KeyPath, MetricSection, Recipe, TableSection};

use crate::error::EngineError;
use crate::registry::Registry;
use crate::runtime::with_torch_seed;

/// Whether a recipe table is a sequence table (`pooling = "none"`: an `EmbeddingCollection`,
/// whose features reach the model as jagged embeddings instead of pooled columns).
pub fn is_sequence(table: &TableSection) -> bool {
    table.pooling == trainrec_types::PoolingMode::None
}

/// Whether a recipe table is looked up id by id by the job's embedding collection: a sequence
/// table, or a table with position-weighted features (TorchRec's feature-processed bags: the
/// rows are weighted by position and summed in the dense graph, so the weights learn).
pub fn in_collection(table: &TableSection) -> bool {
    is_sequence(table) || table.position_weighted.is_some()
}

/// The sequence features of the recipe's sequence tables: (name, dim), in table order.
pub fn sequence_outputs(recipe: &Recipe) -> Vec<(String, usize)> {
    let tables = recipe.tables.iter().filter(|t| is_sequence(t));
    tables.flat_map(|t| t.features.iter().map(|f| (f.clone(), t.dim))).collect()
}

/// What the dense model sees of the job: its dense features, pooled outputs, sequence
/// features and tasks.
pub fn model_inputs(recipe: &Recipe, features: &FeatureSchema, num_tasks: usize) -> ModelInputs {
    let (sparse, sparse_dim_keys) = sparse_outputs(recipe);
    ModelInputs {
        num_dense: features.num_dense,
        sparse,
        sparse_dim_keys,
        num_tasks,
        sequences: sequence_outputs(recipe),
    }
}

/// The pooled outputs of the embedding tables: (name, dim) and the key of each one's dim.
pub fn sparse_outputs(recipe: &Recipe) -> (Vec<(String, usize)>, Vec<KeyPath>) {
    let mut outputs = Vec::new();
    let mut keys = Vec::new();
    // In table order, position-weighted tables (pooled in the dense graph) among the others.
    for (t, table) in recipe.tables.iter().enumerate().filter(|(_, t)| !is_sequence(t)) {
        for f in &table.features {
            outputs.push((f.clone(), table.dim));
            keys.push(KeyPath::root().key("tables").index(t).key("dim"));
        }
    }
    (outputs, keys)
}

/// Where the pooled outputs' columns come from when the recipe has position-weighted tables:
/// the model's column `c` is column `order[c]` of the pooled engine's outputs followed by the
/// position-weighted ones (`None` when there are none: the engine's outputs are the model's).
pub(crate) fn pooled_column_order(recipe: &Recipe) -> Option<Vec<i64>> {
    let pooled = recipe.tables.iter().filter(|t| !is_sequence(t));
    if !pooled.clone().any(|t| t.position_weighted.is_some()) {
        return None;
    }
    let width = |t: &&TableSection| (t.features.len() * t.dim) as i64;
    let engine_width: i64 = pooled.clone().filter(|t| t.position_weighted.is_none()).map(|t| width(&t)).sum();
    let (mut engine_at, mut weighted_at, mut order) = (0i64, engine_width, Vec::new());
    for t in pooled {
        let at = if t.position_weighted.is_some() { &mut weighted_at } else { &mut engine_at };
        order.extend(*at..*at + width(&t));
        *at += width(&t);
    }
    Some(order)
}

/// Columns of the pooled engine's outputs whose gradient is clipped (FBGEMM's
/// `gradient_clipping`): `(first column, columns, max_gradient)` for each feature of a table
/// with a `tables[].max_gradient` (or, unset, `embedding.max_gradient`), in the engine's order.
pub fn gradient_clip_columns(recipe: &Recipe) -> Vec<(i64, i64, f64)> {
    let mut out = Vec::new();
    let mut column = 0;
    for table in recipe.tables.iter().filter(|t| !in_collection(t)) {
        let max = table.max_gradient.or(recipe.embedding.max_gradient);
        for _ in &table.features {
            if let Some(m) = max {
                out.push((column, table.dim as i64, m));
            }
            column += table.dim as i64;
        }
    }
    out
}

/// Clamps the gradient of the pooled outputs `[batch, width]` in place, element-wise to
/// `[-m, m]` in each `(first column, columns, m)` of `columns` (FBGEMM's `gradient_clipping`,
/// applied before any engine's fused backward, on the tensor's device).
pub(crate) fn clip_pooled_gradient(grad: &tch::Tensor, columns: &[(i64, i64, f64)]) {
    for &(start, len, m) in columns {
        let _ = grad.narrow(1, start, len).clamp_(-m, m);
    }
}

/// Each of the job's tasks' `loss_weight` (as [`job_tasks`] lists them), or `None` when
/// every one is 1 (the plain sum of the tasks' losses).
pub fn task_loss_weights(recipe: &trainrec_recipe::Recipe, features: &FeatureSchema) -> Option<Vec<f64>> {
    let weights: Vec<f64> = recipe
        .tasks
        .iter()
        .filter(|t| features.labels.iter().any(|l| l == t.label_column()))
        .map(|t| t.loss_weight)
        .collect();
    weights.iter().any(|&w| w != 1.0).then_some(weights)
}

/// The job's tasks: (name, index of its label column in the sampler's labels). Without
/// `[[tasks]]`, one task per label column. A task whose column is unknown is left out (and
/// reported by `check_loaded`).
pub fn job_tasks(recipe: &trainrec_recipe::Recipe, features: &FeatureSchema) -> Vec<(String, usize)> {
    if recipe.tasks.is_empty() {
        return features.labels.iter().enumerate().map(|(i, l)| (l.clone(), i)).collect();
    }
    recipe
        .tasks
        .iter()
        .filter_map(|t| {
            let col = features.labels.iter().position(|l| l == t.label_column())?;
            Some((t.name.clone(), col))
        })
        .collect()
}

/// What a batch holds for the dense model: its dense features, its label columns and the
/// tasks that read them, and the device the dense model lives on.
pub(crate) struct BatchLayout {
    /// Dense features per example.
    pub num_dense: usize,
    /// Label columns the sampler writes per example.
    pub num_labels: usize,
    /// (name, label column) per task.
    pub tasks: Vec<(String, usize)>,
    /// Each task's `loss_weight`, when one is not 1 (`None`: every task weighs 1).
    pub task_loss_weights: Option<Vec<f64>>,
    /// The pooled-output columns whose gradient is clipped ([`gradient_clip_columns`]).
    pub gradient_clip: Vec<(i64, i64, f64)>,
    /// Whether the sampler gives every batch its sample weights ([`trainrec_data::Sampler::weighted`]).
    pub weighted: bool,
    /// The dense model's device.
    pub device: Device,
    /// The precision of the dense model's matrix products (`train.dense_precision`).
    pub precision: trainrec_types::DensePrecision,
}

/// The recipe's embedding tables as one collection with their fused optimizers and bounds
/// check (shared by `Job::build` and the DLRM benchmark).
pub fn recipe_ebc(recipe: &Recipe) -> Result<EmbeddingBagCollection, trainrec_embedding::EmbeddingError> {
    let mut ebc = EmbeddingBagCollection::new(recipe_tables(recipe), recipe.optimizer.sparse.clone(), recipe.run.seed)?;
    ebc.set_bounds_check(recipe.embedding.bounds_check);
    Ok(ebc)
}

/// The recipe's tables with the plan's kernels: a table planned `fused_uvm_caching` keeps a
/// cache of `load factor x rows` rows (weights and optimizer state) in memory and the whole
/// table in a file under `embedding.offload_dir`; one planned `key_value` keeps the same cache
/// in front of a key-value store there of the rows written so far.
pub(crate) fn planned_tables(recipe: &Recipe, plan: &trainrec_planner::Plan) -> Vec<EmbeddingBagConfig> {
    let dir = recipe.embedding.offload_dir.clone().unwrap_or_else(|| recipe.output_dir().join("offload"));
    let mut tables = recipe_tables(recipe);
    for (c, t) in tables.iter_mut().zip(recipe.tables.iter().filter(|t| !in_collection(t))) {
        let Some(tp) = plan.tables.iter().find(|p| p.name == c.name) else { continue };
        let Some(backing) = tp.compute_kernel.cache_backing() else { continue };
        // The plan records the load factor used; a pinned `plan.json` written before it did
        // has none and gets the same default the planner applies.
        let load_factor = tp.cache_load_factor.unwrap_or(trainrec_planner::defaults::UVM_CACHING_RATIO);
        let slots = ((load_factor * c.rows as f64).ceil() as u64).clamp(1, c.rows);
        let policy = t.constraints.cache.as_ref().and_then(|k| k.algorithm).unwrap_or_default();
        tracing::info!(table = %c.name, slots, rows = c.rows, ?policy, ?backing, dir = %dir.display(), "cached table");
        c.cache = Some(trainrec_embedding::CacheConfig { slots, policy, backing, dir: dir.clone() });
    }
    tables
}

/// The recipe's pooled `[[tables]]` as embedding table configurations (its sequence and
/// position-weighted tables are the job's embedding collection's).
pub(crate) fn recipe_tables(recipe: &Recipe) -> Vec<EmbeddingBagConfig> {
    table_configs(recipe.tables.iter().filter(|t| !in_collection(t)))
}

/// Recipe tables as embedding table configurations.
pub(crate) fn table_configs<'a>(tables: impl Iterator<Item = &'a TableSection>) -> Vec<EmbeddingBagConfig> {
    tables
        .map(|t| {
            let features: Vec<&str> = t.features.iter().map(String::as_str).collect();
            let mut c = EmbeddingBagConfig::new(t.name.clone(), t.rows, t.dim, t.pooling, &features)
                .with_precision(t.precision);
            c.stochastic_rounding = t.stochastic_rounding;
            c.optimizer = t.optimizer.clone();
            c
        })
        .collect()
}

/// The corpus and cut-offs of a `recall_at_k` metric.
pub(crate) struct RetrievalSpec {
    /// The candidate's input feature (KJT key) and its table's rows: the corpus is ids
    /// `0..rows`.
    pub(crate) input: String,
    pub(crate) rows: u64,
    /// Cut-offs.
    pub(crate) ks: Vec<usize>,
}

/// The corpus of a recipe's `recall_at_k`, or why the model cannot be ranked that way.
pub(crate) fn retrieval_spec(
    recipe: &Recipe,
    model: &dyn DenseModel,
) -> Result<Option<RetrievalSpec>, trainrec_recipe::Diagnostic> {
    let Some((i, ks)) = recipe.metrics.iter().enumerate().find_map(|(i, m)| match m {
        MetricSection::RecallAtK { k } => Some((i, k.clone())),
        _ => None,
    }) else {
        return Ok(None);
    };
    let at = trainrec_recipe::KeyPath::root().key("metrics").index(i).key("kind");
    let kind = recipe.model.kind().unwrap_or_default();
    if let Some(t) = recipe.tables.iter().find(|t| t.position_weighted.is_some()) {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!("recall_at_k embeds candidates through the pooled tables; table {} is position-weighted", t.name),
        )
        .with_help("drop tables[].position_weighted or this metric: the two do not go together yet"));
    }
    let Some(retrieval) = model.retrieval() else {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!("recall_at_k ranks candidates for queries; model {kind} does not embed them apart"),
        )
        .with_help("use a retrieval model such as kind = \"two_tower\", or drop this metric"));
    };
    let [feature] = retrieval.candidate_features() else {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!(
                "recall_at_k ranks every row of one candidate table; the model has {} candidate features",
                retrieval.candidate_features().len()
            ),
        )
        .with_help("list exactly one feature in model.candidate_features"));
    };
    let rows = recipe
        .tables
        .iter()
        .find(|t| t.features.iter().any(|f| f == feature))
        .map(|t| t.rows)
        .ok_or_else(|| trainrec_recipe::Diagnostic::new(at.clone(), format!("no table looks up {feature}")))?;
    Ok(Some(RetrievalSpec { input: FeatureRef::parse(feature).input.to_owned(), rows, ks }))
}

/// What a `full_ranking` metric ranks: each eval example's target among every row of the item
/// table.
pub(crate) struct NextItemSpec {
    /// The item table (a sequence table) whose rows are the catalogue.
    pub(crate) table: String,
    /// The target feature's input (KJT key): examples with one id there are ranked.
    pub(crate) target: String,
    /// Cut-offs.
    pub(crate) ks: Vec<usize>,
}

/// The catalogue and cut-offs of a recipe's `full_ranking`, or why the model cannot be ranked
/// that way.
pub(crate) fn next_item_spec(
    recipe: &Recipe,
    model: &dyn DenseModel,
) -> Result<Option<NextItemSpec>, trainrec_recipe::Diagnostic> {
    let Some((i, ks)) = recipe.metrics.iter().enumerate().find_map(|(i, m)| match m {
        MetricSection::FullRanking { k } => Some((i, k.clone())),
        _ => None,
    }) else {
        return Ok(None);
    };
    let at = KeyPath::root().key("metrics").index(i).key("kind");
    let kind = recipe.model.kind().unwrap_or_default();
    let Some(next) = model.next_item() else {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!("full_ranking ranks each user's next item among every item; model {kind} does not predict one"),
        )
        .with_help("use a next-item model such as kind = \"sasrec\", or drop this metric"));
    };
    let table = sequence_table_of(recipe, next.item_feature()).ok_or_else(|| {
        trainrec_recipe::Diagnostic::new(
            at.clone(),
            format!("the model's item feature {} is not read by a pooling = \"none\" table", next.item_feature()),
        )
    })?;
    if sequence_table_of(recipe, next.target_feature()) != Some(table) {
        return Err(trainrec_recipe::Diagnostic::new(
            at,
            format!(
                "full_ranking ranks the target {} among the rows of table {}, which does not read it",
                next.target_feature(),
                table.name
            ),
        )
        .with_help(format!("add \"{}\" to tables.{}.features", next.target_feature(), table.name)));
    }
    let target = FeatureRef::parse(next.target_feature()).input.to_owned();
    Ok(Some(NextItemSpec { table: table.name.clone(), target, ks }))
}

/// The sequence table that reads `feature`.
fn sequence_table_of<'a>(recipe: &'a Recipe, feature: &str) -> Option<&'a TableSection> {
    recipe.tables.iter().find(|t| is_sequence(t) && t.features.iter().any(|f| f == feature))
}

/// Why a model's catalogue request cannot be served: its feature must be read by a sequence
/// table, and by no other sequence table's feature of the same input (the catalogue's rows
/// join that input's lookups).
pub(crate) fn catalogue_problem(recipe: &Recipe, model: &dyn DenseModel) -> Option<trainrec_recipe::Diagnostic> {
    let request = model.catalogue()?;
    let at = KeyPath::root().key("model").key("kind");
    let Some(table) = sequence_table_of(recipe, &request.feature) else {
        return Some(
            trainrec_recipe::Diagnostic::new(
                at,
                format!(
                    "the model scores against the rows of the table of {}, which no pooling = \"none\" table reads",
                    request.feature
                ),
            )
            .with_help("read that feature from the item table, with pooling = \"none\""),
        );
    };
    let input = FeatureRef::parse(&request.feature).input;
    let others: Vec<&str> = recipe
        .tables
        .iter()
        .filter(|t| is_sequence(t))
        .flat_map(|t| t.features.iter().map(move |f| (t, f)))
        .filter(|(t, f)| FeatureRef::parse(f).input == input && !(t.name == table.name && *f == &request.feature))
        .map(|(t, _)| t.name.as_str())
        .collect();
    if let Some(other) = others.first() {
        return Some(
            trainrec_recipe::Diagnostic::new(
                at,
                format!(
                    "the model looks up every row of table {} through input {input}, which table {other} also reads",
                    table.name
                ),
            )
            .with_help("read that input from one sequence table only"),
        );
    }
    None
}

/// Expands a variable-batch (VBE) KJT in place to one bag per example (managed collisions
/// count every example's ids); any other KJT is left as it is, without a copy.
pub fn expand_vbe(kjt: &mut trainrec_sparse::KeyedJaggedTensor) -> Result<(), EngineError> {
    if let std::borrow::Cow::Owned(full) = kjt.full_batch()? {
        *kjt = full;
    }
    Ok(())
}

/// TorchRec's multiplier of dense parameter bytes (weights, gradients, optimizer state,
/// activations' share).
const DENSE_PARAMETER_MULTIPLIER: u64 = 6;

/// Bytes the dense model needs per rank: its fp32 parameter bytes × 6, counted without
/// building it (`ModelFactory::parameters`), or for a model that cannot count them, by
/// building it on a scratch variable store. 0 when the model cannot be built (validation
/// reports why).
pub fn dense_bytes(recipe: &Recipe, features: &FeatureSchema, registry: &Registry) -> u64 {
    let Some(factory) = recipe.model.kind().and_then(|k| registry.model_for(k)) else { return 0 };
    let num_tasks = if recipe.tasks.is_empty() { features.labels.len() } else { recipe.tasks.len() };
    let inputs = model_inputs(recipe, features, num_tasks);
    if let Some(n) = factory.parameters(&recipe.model.config(), &inputs) {
        let bytes = n.saturating_mul(4 * u128::from(DENSE_PARAMETER_MULTIPLIER));
        return u64::try_from(bytes).unwrap_or(u64::MAX);
    }
    let vs = nn::VarStore::new(Device::Cpu);
    // Under the generator's lock: the scratch init's draws must not land inside another
    // thread's seeded model build. libtorch's failures (an allocation no machine can make)
    // surface as panics of its bindings: they mean "cannot be built" here too.
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        with_torch_seed(0, || tch::no_grad(|| factory.build(&vs.root(), &recipe.model.config(), &inputs)))
    }));
    if !matches!(built, Ok(Ok(_))) {
        return 0;
    }
    dense_bytes_of(&vs)
}

/// Parameter bytes × 6 of a model already built under `vs` (before its optimizer).
pub fn dense_bytes_of(vs: &nn::VarStore) -> u64 {
    let bytes: u64 =
        vs.trainable_variables().iter().map(|t| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64).sum();
    bytes * DENSE_PARAMETER_MULTIPLIER
}

/// The recipe's planner inputs.
pub fn recipe_plan_input(recipe: &Recipe, features: &FeatureSchema, registry: &Registry) -> PlanInput {
    plan_input(recipe, dense_bytes(recipe, features, registry))
}

/// The recipe's plan: `planner.plan_file` when set (checked against the inputs' hash), else
/// planned; with `explain`, each table's runner-up is filled in.
/// Plans from TorchRec's cost model or a pinned plan file may choose a kernel trainrec's
/// engines do not build (`fused_uvm`): refused here, before anything is built.
pub fn recipe_plan(input: &PlanInput, recipe: &Recipe, base_dir: &Path, explain_it: bool) -> Result<Plan, PlanError> {
    let (plan, source) = match &recipe.planner.plan_file {
        Some(path) => (load_plan(&base_dir.join(path), input)?, format!("planner.plan_file {path}")),
        None => {
            let mut plan = trainrec_planner::plan(input)?;
            if explain_it {
                explain(input, &mut plan)?;
            }
            (
                plan,
                format!("chosen by planner.cost_model = \"{}\"", trainrec_types::Word::name(input.config.cost_model)),
            )
        }
    };
    if let Some(tp) = plan.tables.iter().find(|t| !t.compute_kernel.is_built()) {
        let index = recipe.tables.iter().position(|t| t.name == tp.name).unwrap_or(0);
        return Err(PlanError::Unbuilt {
            table: tp.name.clone(),
            index,
            kernel: tp.compute_kernel.name().into(),
            why: format!("{source}; FBGEMM's UVM rows read in place from host memory"),
        });
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use trainrec_embedding::{PoolingMode, SparseOptimizerConfig};
    use trainrec_sparse::KeyedJaggedTensor;

    /// A recipe with the FBGEMM fixture's tables: `a` (dim 8) read by features x and y, `b`
    /// (dim 4) by z; `b` clips at 0.25 of its own, `a` at `embedding.max_gradient`.
    fn recipe(default_max: &str) -> Recipe {
        let text = format!(
            r#"
            [run]
            name = "clip"
            [data]
            batch_size = 5
            [data.sampler]
            kind = "synthetic"
            [embedding]
            {default_max}
            [[tables]]
            name = "a"
            features = ["x", "y"]
            rows = 11
            dim = 8
            [[tables]]
            name = "b"
            features = ["z"]
            rows = 7
            dim = 4
            max_gradient = 0.25
            [model]
            kind = "dlrm"
            [optimizer]
            sparse = {{ kind = "sgd", lr = 0.1 }}
            dense = {{ kind = "sgd", lr = 0.1 }}
            [train]
            steps = 1
            "#
        );
        toml::from_str(&text).expect("a recipe")
    }

    #[test]
    fn clip_columns_follow_the_pooled_outputs() {
        assert_eq!(gradient_clip_columns(&recipe("")), [(16, 4, 0.25)]);
        assert_eq!(gradient_clip_columns(&recipe("max_gradient = 0.5")), [(0, 8, 0.5), (8, 8, 0.5), (16, 4, 0.25)]);
    }

    /// The clipped gradient, then the CPU engine's fused update, gives FBGEMM's tables after
    /// `gradient_clipping = True, max_gradient = 0.5` (fixture cases `*-clipped` of
    /// `framework/embedding/tests/fixtures/gen_fbgemm.py`), for SGD, Adagrad and row-wise Adagrad.
    #[test]
    fn clipping_before_the_fused_update_matches_fbgemm() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../embedding/tests/fixtures/fbgemm_tbe.json");
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
        let floats =
            |v: &Value| -> Vec<f32> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect() };
        let mut clipped_cases = 0;
        for (name, case) in doc["cases"].as_object().unwrap() {
            let Some(max) = case["max_gradient"].as_f64() else { continue };
            clipped_cases += 1;
            let optimizer: SparseOptimizerConfig = serde_json::from_value(case["optimizer"].clone()).unwrap();
            let mut columns = gradient_clip_columns(&recipe(&format!("max_gradient = {max}")));
            columns[2].2 = max;
            let tables = vec![
                EmbeddingBagConfig::new("a", 11, 8, PoolingMode::Sum, &["x", "y"]),
                EmbeddingBagConfig::new("b", 7, 4, PoolingMode::Sum, &["z"]),
            ];
            let mut ebc = EmbeddingBagCollection::new(tables, optimizer, 0).unwrap();
            for (t, init) in ["a", "b"].iter().zip(case["init"].as_array().unwrap()) {
                ebc.set_table_weights(t, floats(init)).unwrap();
            }
            let mut any_clipped = false;
            for (s, step) in case["steps"].as_array().unwrap().iter().enumerate() {
                let values: Vec<i64> = step["values"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
                let lengths: Vec<u32> =
                    step["lengths"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
                let kjt =
                    KeyedJaggedTensor::new(vec!["x".into(), "y".into(), "z".into()], values, None, lengths, 5).unwrap();
                ebc.forward(&kjt).unwrap();
                let raw = floats(&step["grad"]);
                let grad = tch::Tensor::from_slice(&raw).view([5, 20]);
                clip_pooled_gradient(&grad, &columns);
                let clipped: Vec<f32> = Vec::try_from(grad.flatten(0, -1)).unwrap();
                any_clipped |= clipped.iter().zip(&raw).any(|(c, r)| c != r);
                assert!(clipped.iter().all(|g| g.abs() <= max as f32), "{name}");
                ebc.backward_and_update(&kjt, &clipped).unwrap();
                for (t, want) in ["a", "b"].iter().zip(step["tables_after"].as_array().unwrap()) {
                    let got = ebc.table_weights(t).unwrap();
                    for (i, (g, w)) in got.iter().zip(floats(want)).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{name} step {s} table {t}[{i}]: {g} vs FBGEMM's {w}"
                        );
                    }
                }
            }
            assert!(any_clipped, "{name}: the fixture's gradients reach the bound");
        }
        assert_eq!(clipped_cases, 3);
    }
}
