//! `trainrec-sharding-mpi-check`: the sharded collection's equivalence checks on the MPI backend,
//! one process per rank: `mpirun -n 2 trainrec-sharding-mpi-check`. Prints one line per rank and
//! exits non-zero when a check fails.
//!
//! `--leave R` makes rank `R` exit (code 9) before the first collective and `--stall R` makes it
//! sleep past the timeout (`--timeout-ms`, default 60000): the other ranks must then stop
//! with a clear error instead of hanging.
//!
//! `--nccl` runs the checks on the NCCL backend instead, bootstrapped over MPI, rank `r` on GPU
//! `r mod GPUs` (one GPU per rank: NCCL refuses two ranks on one GPU).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use trainrec_comm::{MpiGroup, NcclGroup, ProcessGroup};
use trainrec_sharding::conformance::{cases, host_cases, run_case, standard_sizes};

fn flag(args: &[String], name: &str) -> Option<u64> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let timeout = Duration::from_millis(flag(&args, "--timeout-ms").unwrap_or(60_000));
    let pg = match MpiGroup::init(timeout) {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let (rank, world) = (pg.rank(), pg.world_size());
    if flag(&args, "--leave") == Some(rank as u64) {
        eprintln!("rank {rank}: leaving on purpose");
        std::process::exit(9);
    }
    if flag(&args, "--stall") == Some(rank as u64) {
        std::thread::sleep(timeout * 3);
    }
    if world < 2 {
        eprintln!("error: run under mpirun with at least 2 ranks (world size {world})");
        return ExitCode::from(2);
    }
    let pg: Arc<dyn ProcessGroup> = if args.iter().any(|a| a == "--nccl") {
        let gpus = NcclGroup::probe().unwrap_or(1);
        match NcclGroup::new(&pg, rank % gpus, timeout) {
            Ok(nccl) => Arc::new(nccl),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        Arc::new(pg)
    };
    let backend = pg.backend();
    // Every sharding type, and the host-dependent ones with each process its own host.
    let all = [
        cases(&standard_sizes(world, 0), false),
        cases(&standard_sizes(world, 1), true),
        host_cases(&standard_sizes(world, 2), false, 1),
    ]
    .concat();
    for c in &all {
        if let Err(e) = run_case(pg.clone(), c) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    println!("rank {rank}/{world}: {} equivalence cases ok on {backend}", all.len());
    ExitCode::SUCCESS
}
