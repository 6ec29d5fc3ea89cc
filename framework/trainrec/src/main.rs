//! The `trainrec` command.

fn main() -> std::process::ExitCode {
    trainrec::cli::main_with(trainrec::Registry::builtin())
}
