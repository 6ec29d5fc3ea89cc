//! `trainrec launch --nproc N`: `mpirun -n N <this binary> run <recipe>` with
//! `topology.world_size=N`.

use std::path::Path;

use super::args::{CliError, Overrides};

/// Starts the ranks through `mpirun` and waits for them; their exit code is this command's.
pub(crate) fn launch(nproc: usize, recipe: &Path, overrides: &Overrides) -> Result<(), CliError> {
    if !cfg!(feature = "mpi") {
        return Err(CliError::Usage(
            "`trainrec launch` starts one process per rank through mpirun, and this binary has no MPI support: install Open MPI (scripts/ensure-mpi.sh) and run ./trainrec again (it builds the MPI backend whenever Open MPI is installed), or build it with `cargo build --release -p trainrec --features mpi`; `trainrec run` trains a multi-rank recipe as threads of one process".into(),
        ));
    }
    if nproc == 0 {
        return Err(CliError::Usage("--nproc must be at least 1".into()));
    }
    let exe = std::env::current_exe().map_err(|e| CliError::Runtime(format!("cannot find this executable: {e}")))?;
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["--oversubscribe", "-n", &nproc.to_string()]).arg(exe).arg("run").arg(recipe);
    for s in &overrides.set {
        cmd.arg("--set").arg(s);
    }
    if overrides.no_env {
        cmd.arg("--no-env");
    }
    cmd.arg("--set").arg(format!("topology.world_size={nproc}"));
    // Open MPI refuses root without these; a container's root user is the common case.
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(CliError::Child(s.code().map_or(1, |c| c.clamp(1, 255) as u8))),
        Err(e) => Err(CliError::Runtime(format!("cannot start mpirun ({e}); scripts/ensure-mpi.sh installs Open MPI"))),
    }
}
