//! Sharding plans of a recipe: the planner's inputs (tables, constraints, topology, the dense
//! model's memory), a fresh or pinned plan, and planner errors as recipe diagnostics.
use std::path::Path;

use tch::{Device, nn};
use trainrec_data::FeatureSchema;
use trainrec_models::ModelInputs;
use trainrec_planner::{Plan, PlanError, PlanInput, explain, load_plan};
use trainrec_recipe::plan::{plan_diagnostic, plan_input};
use trainrec_recipe::{Diagnostic, Recipe};

use crate::check::sparse_outputs;
use crate::registry::Registry;

/// TorchRec's multiplier of dense parameter bytes (weights, gradients, optimizer state,
/// activations' share).
const DENSE_PARAMETER_MULTIPLIER: u64 = 6;

/// Bytes the dense model needs per rank: its parameter bytes × 6, counted by building it on
/// a scratch variable store. 0 when the model cannot be built (validation reports why).
pub fn dense_bytes(recipe: &Recipe, features: &FeatureSchema, registry: &Registry) -> u64 {
    let Some(factory) = recipe.model.kind().and_then(|k| registry.model_for(k)) else { return 0 };
    let (sparse, sparse_dim_keys) = sparse_outputs(recipe);
    let num_tasks = if recipe.tasks.is_empty() { features.labels.len() } else { recipe.tasks.len() };
    let inputs = ModelInputs { num_dense: features.num_dense, sparse, sparse_dim_keys, num_tasks };
    let vs = nn::VarStore::new(Device::Cpu);
    // Under the generator's lock: the scratch init's draws must not land inside another
    // thread's seeded model build.
    let built =
        crate::job::with_torch_seed(0, || tch::no_grad(|| factory.build(&vs.root(), &recipe.model.config(), &inputs)));
    if built.is_err() {
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
pub fn recipe_plan(input: &PlanInput, recipe: &Recipe, base_dir: &Path, explain_it: bool) -> Result<Plan, PlanError> {
    if let Some(path) = &recipe.planner.plan_file {
        return load_plan(&base_dir.join(path), input);
    }
    let mut plan = trainrec_planner::plan(input)?;
    if explain_it {
        explain(input, &mut plan)?;
    }
    Ok(plan)
}

/// Planner problems of a recipe that passed every other check, as diagnostics.
pub fn plan_problems(
    recipe: &Recipe,
    base_dir: &Path,
    features: &FeatureSchema,
    registry: &Registry,
) -> Vec<Diagnostic> {
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
