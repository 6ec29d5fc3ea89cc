//! What every command shares: recipe overrides, the inference precisions of `eval`, and
//! [`CliError`], the one error type whose kind decides the exit code.

use std::process::ExitCode;

use trainrec_engine::EngineError;
use trainrec_recipe::{Diagnostics, LoadOptions};

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
    pub(crate) fn options(&self) -> LoadOptions {
        LoadOptions { overrides: self.set.clone(), env: !self.no_env }
    }
}

/// Why a command failed; its kind decides the exit code: 2 for what the user must fix before
/// anything runs (the command line, a recipe, an input file), 1 for a failure while running.
#[derive(Debug)]
pub enum CliError {
    /// A bad command line or input, said in one message: exit 2.
    Usage(String),
    /// An invalid recipe, every problem located: exit 2.
    Recipe(Diagnostics),
    /// Invalid inputs already reported one by one (`validate`): exit 2.
    Invalid,
    /// A failure while running (data, I/O, a rank): exit 1.
    Runtime(String),
    /// A process this command started (`mpirun`) exited with this code.
    Child(u8),
    /// A run stopped by a signal, its checkpoint saved (the message says how to resume): exit
    /// `128 + signal`.
    Stopped(String, u8),
}

impl CliError {
    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Usage(_) | Self::Recipe(_) | Self::Invalid => 2,
            Self::Runtime(_) => 1,
            Self::Child(code) | Self::Stopped(_, code) => *code,
        }
    }

    /// Prints the error on stderr (nothing for errors already reported).
    pub fn report(&self) {
        match self {
            Self::Usage(m) | Self::Runtime(m) => eprintln!("error: {m}"),
            Self::Stopped(m, _) => eprintln!("{m}"),
            Self::Recipe(diags) => eprintln!("{diags}"),
            Self::Invalid | Self::Child(_) => {}
        }
    }

    /// Reports the outcome of a command and turns it into the process exit code.
    pub fn exit(result: Result<(), CliError>) -> ExitCode {
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                e.report();
                ExitCode::from(e.exit_code())
            }
        }
    }
}

/// An engine error is the recipe's fault when it is a recipe diagnostic, a runtime failure
/// otherwise.
impl From<EngineError> for CliError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Recipe(diags) => Self::Recipe(diags),
            e @ (EngineError::Locked { .. } | EngineError::Unsupported(_)) => Self::Usage(e.to_string()),
            EngineError::Stopped { signal, .. } => Self::Stopped(e.to_string(), (128 + signal) as u8),
            e => Self::Runtime(e.to_string()),
        }
    }
}

impl From<Diagnostics> for CliError {
    fn from(d: Diagnostics) -> Self {
        Self::Recipe(d)
    }
}
