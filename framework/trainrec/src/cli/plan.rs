//! `trainrec validate` and `trainrec plan`.

use std::path::{Path, PathBuf};

use trainrec_engine::{Registry, load_and_check};
use trainrec_recipe::LoadOptions;

use super::args::CliError;

/// `trainrec validate`: each recipe's problems (stderr) and `ok:` / `invalid:` (stdout).
pub(crate) fn validate(registry: &Registry, recipes: &[PathBuf], options: &LoadOptions) -> Result<(), CliError> {
    let mut bad = 0;
    for path in recipes {
        match load_and_check(path, options, registry) {
            Ok(_) => println!("ok: {}", path.display()),
            Err(diags) => {
                bad += 1;
                eprintln!("{diags}\n");
                println!("invalid: {}", path.display());
            }
        }
    }
    if bad > 0 { Err(CliError::Invalid) } else { Ok(()) }
}

/// `trainrec plan`: plans afresh (a pinned plan is what this command regenerates), prints the
/// plan and writes it.
pub(crate) fn plan(
    registry: &Registry,
    path: &Path,
    out: Option<PathBuf>,
    options: &LoadOptions,
) -> Result<(), CliError> {
    let mut loaded = trainrec_recipe::load(path, options)?;
    let pinned = loaded.recipe.planner.plan_file.take();
    let features = trainrec_engine::check_loaded(&loaded, registry)?;
    let recipe = &loaded.recipe;
    let input = trainrec_engine::inputs::recipe_plan_input(recipe, &features, registry);
    let plan = trainrec_engine::inputs::recipe_plan(&input, recipe, &loaded.base_dir, true)
        .map_err(|e| CliError::Recipe(loaded.locate(vec![trainrec_recipe::plan::plan_diagnostic(&e)])))?;
    print!("{}", trainrec_planner::render(&plan, &input));
    let out = out.or(pinned.map(|p| loaded.base_dir.join(p))).unwrap_or_else(|| recipe.output_dir().join("plan.json"));
    trainrec_planner::save_plan(&plan, &out)
        .map_err(|e| CliError::Runtime(format!("cannot write {}: {e}", out.display())))?;
    println!("\nwrote {}", out.display());
    Ok(())
}
