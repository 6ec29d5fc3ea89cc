//! Whole-recipe validation: structure (done by loading), plugin sections against their own
//! schemas, then cross-section rules with the sampler's features and the model's inputs.

use std::path::Path;

use trainrec_recipe::plan::plan_diagnostic;

use trainrec_data::{DataError, FeatureSchema};
use trainrec_recipe::{
    Diagnostic, Diagnostics, KeyPath, LoadOptions, LoadedRecipe, Recipe, check_plugin_section, check_semantics,
};

use crate::inputs::{model_inputs, recipe_plan, recipe_plan_input};
use crate::registry::Registry;

/// Converts a sampler config error into a diagnostic under `data.sampler`.
pub fn data_config_diagnostic(e: &DataError) -> Option<Diagnostic> {
    let sampler = KeyPath::root().key("data").key("sampler");
    match e {
        DataError::Config { key, message } => {
            let path = KeyPath::parse(key).map(|k| KeyPath([sampler.0.clone(), k.0].concat())).unwrap_or(sampler);
            Some(Diagnostic::new(path, message.clone()))
        }
        _ => None,
    }
}

/// Checks everything the registry knows about; returns the sampler's features when sound.
pub fn check_loaded(loaded: &LoadedRecipe, registry: &Registry) -> Result<FeatureSchema, Diagnostics> {
    let recipe = &loaded.recipe;
    let mut problems = loaded.problems.clone();
    let sampler_path = KeyPath::root().key("data").key("sampler");
    let sampler_problems = check_plugin_section(&sampler_path, &recipe.data.sampler, &registry.sampler_kinds(), |k| {
        registry.sampler_for(k).map(|f| f.config_schema())
    });
    let features = match (sampler_problems.is_empty(), recipe.data.sampler.kind().and_then(|k| registry.sampler_for(k)))
    {
        (true, Some(factory)) => match factory
            .check(&recipe.data.sampler.config(), &loaded.base_dir)
            .and_then(|()| factory.feature_schema(&recipe.data.sampler.config()))
        {
            Ok(f) => Some(f),
            Err(e) => {
                problems.extend(
                    data_config_diagnostic(&e).or_else(|| Some(Diagnostic::new(sampler_path.clone(), e.to_string()))),
                );
                None
            }
        },
        _ => None,
    };
    problems.extend(sampler_problems);
    problems.extend(plugin_metric_problems(recipe, registry));
    if let Some(f) = &features {
        problems.extend(task_problems(recipe, f));
        problems.extend(unread_features(recipe, f));
        if f.grouping_key.is_none() {
            problems.extend(grouping_problems(recipe, recipe.data.sampler.kind().unwrap_or_default()));
        }
    }
    problems.extend(check_semantics(recipe, features.as_ref().map(|f| f.sparse.as_slice())));

    let model_path = KeyPath::root().key("model");
    let model_problems = check_plugin_section(&model_path, &recipe.model, &registry.model_kinds(), |k| {
        registry.model_for(k).map(|f| f.config_schema())
    });
    if model_problems.is_empty() {
        if let (Some(factory), Some(features)) = (recipe.model.kind().and_then(|k| registry.model_for(k)), &features) {
            // Every declared task needs a logit, even one whose label column is unknown.
            let num_tasks = if recipe.tasks.is_empty() { features.labels.len() } else { recipe.tasks.len() };
            let inputs = model_inputs(recipe, features, num_tasks);
            problems.extend(sequence_problems(recipe, factory));
            let model_checks = factory.check(&recipe.model.config(), &inputs);
            let ranks = recipe.metrics.iter().any(|m| {
                matches!(
                    m,
                    trainrec_recipe::MetricSection::RecallAtK { .. }
                        | trainrec_recipe::MetricSection::FullRanking { .. }
                )
            });
            if model_checks.is_empty() && (ranks || factory.reads_sequences()) {
                // Ranking metrics need a model that embeds candidates apart or predicts next
                // items, and a catalogue must be a sequence table's: ask a scratch copy.
                let vs = tch::nn::VarStore::new(tch::Device::Cpu);
                let built = crate::runtime::with_torch_seed(0, || {
                    tch::no_grad(|| factory.build(&vs.root(), &recipe.model.config(), &inputs))
                });
                if let Ok(model) = built {
                    problems.extend(crate::inputs::retrieval_spec(recipe, model.as_ref()).err());
                    problems.extend(crate::inputs::next_item_spec(recipe, model.as_ref()).err());
                    problems.extend(crate::inputs::catalogue_problem(recipe, model.as_ref()));
                }
            }
            problems.extend(model_checks);
        }
    }
    problems.extend(model_problems);
    if problems.is_empty() {
        // The planner runs last: it needs sound tables, features and model.
        let features = features.expect("a sound sampler section yields features");
        problems.extend(plan_problems(recipe, &loaded.base_dir, &features, registry));
        if problems.is_empty() {
            return Ok(features);
        }
    }
    Err(loaded.locate(problems))
}

/// Sequence tables feeding a model that reads no sequences: named at each table's `pooling`.
fn sequence_problems(recipe: &Recipe, factory: &dyn trainrec_models::ModelFactory) -> Vec<Diagnostic> {
    if factory.reads_sequences() {
        return Vec::new();
    }
    let tables = recipe.tables.iter().enumerate().filter(|(_, t)| crate::inputs::is_sequence(t));
    tables
        .map(|(t, table)| {
            Diagnostic::new(
                KeyPath::root().key("tables").index(t).key("pooling"),
                format!(
                    "table \"{}\" is a sequence table (pooling = \"none\"), but model kind \"{}\" reads no sequence \
                     features",
                    table.name,
                    factory.kind()
                ),
            )
            .with_help(
                "pool the table (pooling = \"sum\" or \"mean\"), or use a model that reads sequences (a plugin whose \
                 TypedModel sets READS_SEQUENCES)",
            )
        })
        .collect()
}

/// The sparse features a built-in sampler produces that no table reads. A built-in sampler
/// hashes each feature's ids into the rows of the table that reads it, so it refuses to start
/// without one; this names the feature before any data is read. (A plugin sampler decides for
/// itself what it needs.)
fn unread_features(recipe: &Recipe, features: &FeatureSchema) -> Vec<Diagnostic> {
    let kind = recipe.data.sampler.kind().unwrap_or_default();
    if Registry::builtin().sampler_for(kind).is_none() {
        return Vec::new();
    }
    let read: std::collections::BTreeSet<&str> = recipe
        .tables
        .iter()
        .flat_map(|t| t.features.iter().map(|f| trainrec_recipe::FeatureRef::parse(f).input))
        .collect();
    // MovieLens users may go unread: a sequence model (SASRec) knows a user by their history.
    let optional = |f: &str| kind == "movielens" && f == "user_id";
    let unread: Vec<&str> =
        features.sparse.iter().map(String::as_str).filter(|f| !read.contains(f) && !optional(f)).collect();
    let history = trainrec_data::movielens::HISTORY;
    let (at, help) = match unread.as_slice() {
        [] => return Vec::new(),
        [f] if kind == "movielens" && *f == history => (
            KeyPath::root().key("data").key("sampler").key("history_length"),
            format!("add \"{history}\" to a table's features (the item table's, to share the items' embeddings)"),
        ),
        _ => (KeyPath::root().key("tables"), "add each to a table's features".to_string()),
    };
    let names: Vec<String> = unread.iter().map(|f| format!("\"{f}\"")).collect();
    let what = if unread.len() == 1 { "feature" } else { "features" };
    vec![
        Diagnostic::new(
            at,
            format!("the {kind} sampler produces sparse {what} {}, which no table reads", names.join(", ")),
        )
        .with_help(help),
    ]
}

/// `[[tasks]]` naming label columns the sampler does not have.
fn task_problems(recipe: &trainrec_recipe::Recipe, features: &FeatureSchema) -> Vec<Diagnostic> {
    let sampler = recipe.data.sampler.kind().unwrap_or_default();
    let mut out = Vec::new();
    for (i, t) in recipe.tasks.iter().enumerate() {
        let column = t.label_column();
        if !features.labels.iter().any(|l| l == column) {
            let key = if t.label.is_some() { "label" } else { "name" };
            let names: Vec<&str> = features.labels.iter().map(String::as_str).collect();
            let mut help = trainrec_recipe::suggest(column, &format!("label columns of sampler {sampler}"), &names);
            if sampler == "synthetic" {
                help.push_str(" (set data.sampler.labels to add columns)");
            }
            out.push(
                Diagnostic::new(
                    KeyPath::root().key("tasks").index(i).key(key),
                    format!(
                        "task {:?} predicts label column {column:?}, which sampler {sampler} does not have",
                        t.name
                    ),
                )
                .with_help(help),
            );
        }
    }
    out
}

/// `[[metrics]] kind = "plugin"` entries: a registered name, options valid for its schema.
fn plugin_metric_problems(recipe: &trainrec_recipe::Recipe, registry: &Registry) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for (i, m) in recipe.metrics.iter().enumerate() {
        let trainrec_recipe::MetricSection::Plugin { name, options } = m else { continue };
        let at = KeyPath::root().key("metrics").index(i);
        match registry.metric_for(name) {
            None => {
                let names = registry.metric_names();
                let help = if names.is_empty() {
                    "no plugin metric is registered in this binary (plugins add theirs with Registry::metric)"
                        .to_owned()
                } else {
                    trainrec_recipe::suggest(name, "plugin metrics", &names)
                };
                out.push(Diagnostic::new(at.key("name"), format!("unknown plugin metric \"{name}\"")).with_help(help));
            }
            Some(factory) => {
                let mut value = serde_json::Value::Object(options.clone());
                trainrec_recipe::walk::check(&factory.config_schema(), &mut value, &at.key("options"), &mut out);
            }
        }
    }
    out
}

/// Metrics that rank within groups, when the sampler gives no grouping key.
fn grouping_problems(recipe: &trainrec_recipe::Recipe, sampler: &str) -> Vec<Diagnostic> {
    use trainrec_recipe::MetricSection;
    let help = if sampler == "synthetic" {
        "set data.sampler.session_size (examples per session) so the synthetic sampler emits session ids".to_owned()
    } else {
        format!(
            "the {sampler} sampler provides no grouping key; use a sampler that does (e.g. synthetic with data.sampler.session_size)"
        )
    };
    let metrics = KeyPath::root().key("metrics");
    recipe
        .metrics
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            let (key, what) = match m {
                MetricSection::Auc { grouped: true } => ("grouped", "grouped AUC"),
                MetricSection::Ndcg { .. } => ("kind", "NDCG"),
                MetricSection::RecallSession { .. } => ("kind", "session recall"),
                _ => return None,
            };
            Some(
                Diagnostic::new(
                    metrics.index(i).key(key),
                    format!(
                        "{what} needs a grouping key (session or user id) per example, but sampler {sampler} gives none"
                    ),
                )
                .with_help(help.clone()),
            )
        })
        .collect()
}

/// Loads and fully validates a recipe file.
pub fn load_and_check(
    path: &Path,
    options: &LoadOptions,
    registry: &Registry,
) -> Result<(LoadedRecipe, FeatureSchema), Diagnostics> {
    let loaded = trainrec_recipe::load(path, options)?;
    // The thread pools are sized once per process, before any parallel work: checking runs
    // the planner (rayon), so `run.threads` must take effect here, not at `Job::build`.
    crate::runtime::configure_threads(loaded.recipe.run.threads);
    let features = check_loaded(&loaded, registry)?;
    Ok((loaded, features))
}

/// Planner problems of a recipe that passed every other check, as diagnostics.
fn plan_problems(recipe: &Recipe, base_dir: &Path, features: &FeatureSchema, registry: &Registry) -> Vec<Diagnostic> {
    let input = recipe_plan_input(recipe, features, registry);
    if let Err(e) = trainrec_planner::check_topology(&input.topology, &input.config) {
        return vec![plan_diagnostic(&e)];
    }
    let table_errors = trainrec_planner::check_tables(&input.tables, &input.topology, input.config.cost_model);
    if !table_errors.is_empty() {
        return table_errors.iter().map(plan_diagnostic).collect();
    }
    match recipe_plan(&input, recipe, base_dir, false) {
        Ok(_) => Vec::new(),
        Err(e) => vec![plan_diagnostic(&e)],
    }
}
