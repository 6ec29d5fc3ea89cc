//! The MPI backend under `mpirun` (built with `--features mpi`; `scripts/test` runs it):
//! every sharding type on 2 and 3 processes equals the unsharded collection, and a rank that
//! leaves or stalls stops the job with a clear error instead of a hang; the NCCL backend,
//! bootstrapped over MPI, runs the same checks where there are GPUs and says why not elsewhere.
#![cfg(feature = "mpi")]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn mpirun(ranks: usize, extra: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new("mpirun")
        .args(["--oversubscribe", "-n", &ranks.to_string(), env!("CARGO_BIN_EXE_trainrec-sharding-mpi-check")])
        .args(extra)
        // Open MPI refuses to run as root without these (CI containers run as root).
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun runs (scripts/ensure-mpi.sh installs Open MPI)");
    (out, start.elapsed())
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn every_sharding_type_equals_unsharded_on_two_and_three_processes() {
    for ranks in [2, 3] {
        let (out, _) = mpirun(ranks, &[]);
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        use trainrec_sharding::conformance::{cases, host_cases, standard_sizes};
        let n =
            2 * cases(&standard_sizes(ranks, 0), false).len() + host_cases(&standard_sizes(ranks, 2), false, 1).len();
        for r in 0..ranks {
            assert!(t.contains(&format!("rank {r}/{ranks}: {n} equivalence cases ok on mpi")), "{t}");
        }
    }
}

#[test]
fn a_rank_that_leaves_stops_the_job() {
    let (out, took) = mpirun(2, &["--leave", "1"]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("rank 1: leaving on purpose"), "{t}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
fn a_stalled_rank_times_out_with_the_collective_named() {
    let (out, took) = mpirun(2, &["--stall", "1", "--timeout-ms", "1000"]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("rank 0: all_to_all (collective #0) did not complete within 1s"), "{t}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
fn nccl_over_mpi_runs_the_checks_or_says_why_not() {
    let (out, took) = mpirun(2, &["--nccl", "--timeout-ms", "20000"]);
    let t = text(&out);
    match trainrec_comm::NcclGroup::probe() {
        // One GPU per rank: two ranks need two GPUs.
        Ok(gpus) if gpus >= 2 => {
            assert!(out.status.success(), "{t}");
            assert!(t.contains("equivalence cases ok on nccl"), "{t}");
        }
        Ok(_) => assert!(!out.status.success(), "{t}"),
        Err(_) => {
            assert!(!out.status.success(), "{t}");
            for r in 0..2 {
                assert!(t.contains(&format!("rank {r}: NCCL backend: ")), "{t}");
            }
        }
    }
    assert!(took < Duration::from_secs(60), "took {took:?}");
}
