//! A user's own `trainrec` binary: every built-in plus two plugins, in one line of `main`.
//!
//! `cargo run --release -p custom-trainrec -- run recipes/plugins/libsvm_wide_deep.toml`
//! (`custom-trainrec list` shows the plugins next to the built-ins).

use std::process::ExitCode;

fn main() -> ExitCode {
    trainrec::cli::main_with(custom_trainrec::registry())
}
