//! Command-line interface: thin argument parsing over the engine.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 invalid recipe or usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trainrec_engine::{EngineError, Job, Registry, load_and_check};
use trainrec_recipe::LoadOptions;

/// Train large recommendation models from a TOML recipe.
#[derive(Debug, Parser)]
#[command(name = "trainrec", version, about)]
pub struct Cli {
    /// Log level (error, warn, info, debug, trace) or a full filter such as
    /// `trainrec_engine=debug`. `RUST_LOG` is used when this is not given.
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Recipe overrides shared by the commands that read recipes.
#[derive(Debug, clap::Args)]
pub struct Overrides {
    /// Override a recipe key: `--set train.steps=100`, `--set tables[0].rows=5000`. The value is
    /// TOML (`1e-3`, `"x"`, `[1, 2]`); a bare word is taken as a string. Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Ignore `TRAINREC_<SECTION>__<KEY>` environment overrides.
    #[arg(long)]
    pub no_env: bool,
}

impl Overrides {
    fn options(&self) -> LoadOptions {
        LoadOptions { overrides: self.set.clone(), env: !self.no_env }
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train (and evaluate) the job a recipe describes.
    Run {
        /// The recipe file.
        recipe: PathBuf,
        /// Overrides.
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Check recipes and print every problem found, with key path, file and line.
    Validate {
        /// Recipe files.
        #[arg(required = true)]
        recipes: Vec<PathBuf>,
        /// Overrides, applied to each recipe.
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Print the recipe reference (Markdown) generated from the schema.
    Reference,
}

fn init_tracing(level: Option<&str>) {
    let filter = match level {
        Some(l) => tracing_subscriber::EnvFilter::new(l),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Runs the CLI with the given registry (built-ins plus a user's plugins).
pub fn main_with(registry: Registry) -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_level.as_deref());
    match cli.command {
        Command::Run { recipe, overrides } => run(&registry, &recipe, &overrides.options()),
        Command::Validate { recipes, overrides } => validate(&registry, &recipes, &overrides.options()),
        Command::Reference => {
            print!("{}", trainrec_engine::reference::recipe_reference(&registry));
            ExitCode::SUCCESS
        }
    }
}

fn validate(registry: &Registry, recipes: &[PathBuf], options: &LoadOptions) -> ExitCode {
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
    if bad > 0 { ExitCode::from(2) } else { ExitCode::SUCCESS }
}

fn run(registry: &Registry, path: &std::path::Path, options: &LoadOptions) -> ExitCode {
    let (loaded, features) = match load_and_check(path, options, registry) {
        Ok(x) => x,
        Err(diags) => {
            eprintln!("{diags}");
            return ExitCode::from(2);
        }
    };
    let result = Job::build(&loaded, &features, registry).and_then(|mut job| job.run());
    match result {
        Ok(summary) => {
            println!("{}", trainrec_engine::job::summary_table(&summary));
            ExitCode::SUCCESS
        }
        Err(EngineError::Recipe(diags)) => {
            eprintln!("{diags}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
