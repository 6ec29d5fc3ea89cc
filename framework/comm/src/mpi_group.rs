//! The MPI backend (Open MPI on Debian through the `mpi` crate): the engine for CPU jobs of
//! several processes, on one host or many (`mpirun -n N ...`).
//!
//! Every collective is started non-blocking and polled until it completes or the group's
//! timeout passes. MPI cannot cancel a started collective, so on a timeout the rank logs the
//! error (naming the collective) and aborts the MPI job, which stops every rank; a rank that
//! dies makes `mpirun` stop the others.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use mpi::{Count, Threading};

use crate::group::{DistError, ProcessGroup, ReduceOp, check_counts, check_gather, check_root};

struct State {
    world: SimpleCommunicator,
    seq: u64,
    /// Finalizes MPI when the group is dropped.
    _universe: mpi::environment::Universe,
}

/// This process's rank of `MPI_COMM_WORLD`.
pub struct MpiGroup {
    rank: usize,
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
}

// SAFETY: MPI is initialised with `MPI_THREAD_SERIALIZED` (checked in `init`) and every call
// goes through the `state` mutex, so no two threads call MPI at once.
unsafe impl Send for MpiGroup {}
// SAFETY: as above: shared references only reach MPI through the mutex.
unsafe impl Sync for MpiGroup {}

fn count(n: usize, op: &'static str) -> Result<Count, DistError> {
    Count::try_from(n).map_err(|_| DistError::Invalid { op, message: format!("{n} elements exceed MPI's count limit") })
}

/// `s`, or an empty slice of a real allocation when `s` is empty: MPI rejects a send and a
/// receive buffer at the same address, and two empty vectors share one dangling pointer.
fn nonaliased<'a>(s: &'a [u8], spare: &'a [u8; 1]) -> &'a [u8] {
    if s.is_empty() { &spare[..0] } else { s }
}

fn displs(counts: &[Count]) -> Vec<Count> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect()
}

impl MpiGroup {
    /// Initialises MPI (once per process) and joins `MPI_COMM_WORLD`. A process started
    /// without `mpirun` is a world of one.
    pub fn init(timeout: Duration) -> Result<Self, DistError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized).ok_or_else(|| {
            DistError::Module("MPI is already initialised in this process (one MpiGroup per process)".into())
        })?;
        if threading < Threading::Serialized {
            return Err(DistError::Module(format!(
                "the MPI library offers thread level {threading:?}; trainrec needs Serialized"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self { rank, size, timeout, state: Mutex::new(State { world, seq: 0, _universe: universe }) })
    }

    /// Starts a collective: the state (communicator) and the collective's sequence number
    /// and deadline.
    fn begin(&self) -> (std::sync::MutexGuard<'_, State>, u64, Instant) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let seq = st.seq;
        st.seq += 1;
        (st, seq, Instant::now() + self.timeout)
    }

    /// Polls `req` to completion before `deadline`; past it, logs the timeout and aborts the
    /// MPI job (a started collective cannot be cancelled).
    fn finish<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        mut req: Request<'a, D, S>,
        world: &SimpleCommunicator,
        op: &'static str,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), DistError> {
        loop {
            match req.test() {
                Ok(_) => return Ok(()),
                Err(pending) => req = pending,
            }
            if Instant::now() >= deadline {
                let message = format!(
                    "rank {}: {op} (collective #{seq}) did not complete within {:?}: some rank did not join; aborting the MPI job",
                    self.rank, self.timeout
                );
                tracing::error!("{message}");
                eprintln!("error: {message}");
                world.abort(3);
            }
            std::thread::yield_now();
        }
    }
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_to_all_v_into(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv_counts: &[usize],
        out: &mut [u8],
    ) -> Result<(), DistError> {
        const OP: &str = "all_to_all";
        check_counts(OP, send_counts, self.size, Some(send.len()))?;
        check_counts(OP, recv_counts, self.size, Some(out.len()))?;
        let sc: Vec<Count> = send_counts.iter().map(|&n| count(n, OP)).collect::<Result<_, _>>()?;
        let rc: Vec<Count> = recv_counts.iter().map(|&n| count(n, OP)).collect::<Result<_, _>>()?;
        let (sd, rd) = (displs(&sc), displs(&rc));
        let (spare, mut spare_out) = ([0u8; 1], [0u8; 1]);
        let send = nonaliased(send, &spare);
        let out: &mut [u8] = if out.is_empty() { &mut spare_out[..0] } else { out };
        let s = Partition::new(send, &sc[..], &sd[..]);
        let mut r = PartitionMut::new(out, &rc[..], &rd[..]);
        let (st, seq, deadline) = self.begin();
        mpi::request::scope(|scope| {
            let req = st.world.immediate_all_to_all_varcount_into(scope, &s, &mut r);
            self.finish(req, &st.world, OP, seq, deadline)
        })
    }

    fn all_gather_v_into(&self, local: &[u8], counts: &[usize], out: &mut [u8]) -> Result<(), DistError> {
        const OP: &str = "all_gather";
        check_gather(OP, counts, self.size, self.rank, local.len())?;
        check_counts(OP, counts, self.size, Some(out.len()))?;
        let c: Vec<Count> = counts.iter().map(|&n| count(n, OP)).collect::<Result<_, _>>()?;
        let d = displs(&c);
        let (spare, mut spare_out) = ([0u8; 1], [0u8; 1]);
        let local = nonaliased(local, &spare);
        let out: &mut [u8] = if out.is_empty() { &mut spare_out[..0] } else { out };
        let mut r = PartitionMut::new(out, &c[..], &d[..]);
        let (st, seq, deadline) = self.begin();
        mpi::request::scope(|scope| {
            let req = st.world.immediate_all_gather_varcount_into(scope, local, &mut r);
            self.finish(req, &st.world, OP, seq, deadline)
        })
    }

    fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<(), DistError> {
        let send = data.to_vec();
        let (st, seq, deadline) = self.begin();
        mpi::request::scope(|scope| {
            let req = st.world.immediate_all_reduce_into(scope, &send[..], data, system(op));
            self.finish(req, &st.world, "all_reduce", seq, deadline)
        })
    }

    fn all_reduce_f64(&self, data: &mut [f64], op: ReduceOp) -> Result<(), DistError> {
        let send = data.to_vec();
        let (st, seq, deadline) = self.begin();
        mpi::request::scope(|scope| {
            let req = st.world.immediate_all_reduce_into(scope, &send[..], data, system(op));
            self.finish(req, &st.world, "all_reduce", seq, deadline)
        })
    }

    fn reduce_scatter_f32(&self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, DistError> {
        const OP: &str = "reduce_scatter";
        check_counts(OP, counts, self.size, Some(input.len()))?;
        // MPI's block form: every block padded to the largest.
        let block = counts.iter().copied().max().unwrap_or(0);
        let mut padded = vec![0f32; block * self.size];
        let mut at = 0;
        for (d, &n) in counts.iter().enumerate() {
            padded[d * block..d * block + n].copy_from_slice(&input[at..at + n]);
            at += n;
        }
        let mut out = vec![0f32; block];
        {
            let (st, seq, deadline) = self.begin();
            mpi::request::scope(|scope| {
                let req = st.world.immediate_reduce_scatter_block_into(
                    scope,
                    &padded[..],
                    &mut out[..],
                    SystemOperation::sum(),
                );
                self.finish(req, &st.world, OP, seq, deadline)
            })?;
        }
        out.truncate(counts[self.rank]);
        Ok(out)
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<(), DistError> {
        const OP: &str = "broadcast";
        check_root(OP, root, self.size)?;
        let (st, seq, deadline) = self.begin();
        mpi::request::scope(|scope| {
            let req = st.world.process_at_rank(root as i32).immediate_broadcast_into(scope, data);
            self.finish(req, &st.world, OP, seq, deadline)
        })
    }

    fn barrier(&self) -> Result<(), DistError> {
        let (st, seq, deadline) = self.begin();
        let req = st.world.immediate_barrier();
        self.finish(req, &st.world, "barrier", seq, deadline)
    }
}

fn system(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}
