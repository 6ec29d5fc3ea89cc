//! The NCCL backend (NVIDIA's collectives through cudarc): the engine for GPU jobs.
//!
//! It is compiled into every build: cudarc loads `libcuda` and `libnccl` when a group is
//! created, so a machine without them builds and tests everything else, and creating a group
//! there is a clear error ([`NcclGroup::probe`]), never a panic.
//!
//! [`NcclGroup::new`] bootstraps from another process group (MPI between processes, threads
//! within one): rank 0 makes the NCCL unique id and broadcasts it over that group, and every
//! rank first learns whether all the others can use NCCL, so a rank without a GPU stops the
//! whole group with its own reason instead of leaving the others waiting.
//!
//! This [`ProcessGroup`] takes host buffers like the CPU engines: each collective copies its
//! input to the device, runs on the group's stream and copies the result back. Variable
//! all-to-all is a group of point-to-point sends and receives; variable all-gather a group of
//! broadcasts, one per root; variable reduce-scatter a group of reduces. A collective waits at
//! most the group's timeout (polling an event recorded after it); then the group is marked
//! broken, later collectives fail at once, and dropping it aborts the communicator.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp, group_end, group_start};

use crate::group::{
    DistError, ProcessGroup, ProcessGroupExt, ReduceOp, check_counts, check_gather, check_root, offsets,
};

struct State {
    comm: Comm,
    stream: Arc<CudaStream>,
    seq: u64,
    /// A collective timed out: the communicator may be stuck.
    broken: bool,
}

/// One rank of an NCCL communicator on one GPU.
pub struct NcclGroup {
    rank: usize,
    size: usize,
    timeout: Duration,
    device: usize,
    state: Mutex<State>,
}

// SAFETY: the communicator and its stream are only used through the `state` mutex, one thread
// at a time; NCCL communicators may be used from any thread when calls are serialized.
unsafe impl Send for NcclGroup {}
// SAFETY: as above: shared references reach NCCL only through the mutex.
unsafe impl Sync for NcclGroup {}

fn unavailable(m: impl std::fmt::Display) -> DistError {
    DistError::Module(format!("NCCL backend: {m}"))
}

impl NcclGroup {
    /// Whether this machine can run NCCL: the CUDA driver library, at least one GPU, and
    /// `libnccl.so`. The error says what is missing.
    pub fn probe() -> Result<usize, DistError> {
        // SAFETY: only tries to open the libraries (dlopen); no symbol is called.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable(
                "the CUDA driver library (libcuda.so) is not on this machine: NCCL needs an NVIDIA GPU and its driver",
            ));
        }
        let gpus = CudaContext::device_count().map_err(|e| unavailable(format!("the CUDA driver failed: {e:?}")))?;
        if gpus < 1 {
            return Err(unavailable("the CUDA driver sees no GPU"));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(unavailable(
                "libnccl.so is not on the library path (PyPI's nvidia-nccl wheel ships only libnccl.so.2: \
                 link libnccl.so to it and add its folder to LD_LIBRARY_PATH)",
            ));
        }
        Ok(gpus as usize)
    }

    /// Joins an NCCL communicator of `bootstrap`'s ranks, this rank on GPU `device`.
    /// Collective over `bootstrap` (which carries the unique id and the probe results).
    pub fn new(bootstrap: &dyn ProcessGroup, device: usize, timeout: Duration) -> Result<Self, DistError> {
        let (rank, size) = (bootstrap.rank(), bootstrap.world_size());
        let local = Self::probe().and_then(|gpus| {
            if device < gpus {
                Ok(())
            } else {
                Err(unavailable(format!("GPU {device} asked for, but this machine has {gpus}")))
            }
        });
        let ok = bootstrap.all_gather_u64(local.is_ok() as u64)?;
        if let Err(e) = local {
            return Err(DistError::Module(format!("rank {rank}: {e}")));
        }
        if let Some(bad) = ok.iter().position(|&x| x == 0) {
            return Err(unavailable(format!("rank {bad} cannot use NCCL (see its error); rank {rank} stops too")));
        }
        let ctx = CudaContext::new(device).map_err(|e| unavailable(format!("GPU {device}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| unavailable(format!("GPU {device}: new stream: {e:?}")))?;
        let mut id = [0u8; 128];
        if rank == 0 {
            let made = Id::new().map_err(|e| unavailable(format!("ncclGetUniqueId: {e:?}")))?;
            for (b, c) in id.iter_mut().zip(made.internal()) {
                *b = *c as u8;
            }
        }
        bootstrap.broadcast_bytes(&mut id, 0)?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), rank, size, id)
            .map_err(|e| unavailable(format!("rank {rank}: ncclCommInitRank: {e:?}")))?;
        Ok(Self { rank, size, timeout, device, state: Mutex::new(State { comm, stream, seq: 0, broken: false }) })
    }

    /// The GPU this rank runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Runs one collective: `enqueue` puts it on the stream; then waits (until the timeout)
    /// for it to finish.
    fn run<R>(
        &self,
        op: &'static str,
        enqueue: impl FnOnce(&Comm, &Arc<CudaStream>) -> Result<R, String>,
    ) -> Result<R, DistError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let seq = st.seq;
        st.seq += 1;
        if st.broken {
            return Err(DistError::Module(format!(
                "rank {}: {op} (collective #{seq}): the NCCL group is broken by an earlier timeout",
                self.rank
            )));
        }
        let deadline = Instant::now() + self.timeout;
        let fail = |m: String| DistError::Module(format!("rank {}: NCCL {op} (collective #{seq}): {m}", self.rank));
        let out = enqueue(&st.comm, &st.stream).map_err(fail)?;
        let done = st.stream.record_event(None).map_err(|e| fail(format!("{e:?}")))?;
        while !done.is_complete() {
            if Instant::now() >= deadline {
                st.broken = true;
                return Err(fail(format!("did not complete within {:?}: some rank did not join", self.timeout)));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(out)
    }
}

/// A device copy of `data` (at least one element: CUDA allocates no empty buffers).
fn upload<T: DeviceRepr + ValidAsZeroBits + Copy>(
    stream: &Arc<CudaStream>,
    data: &[T],
) -> Result<CudaSlice<T>, String> {
    if data.is_empty() {
        return stream.alloc_zeros::<T>(1).map_err(|e| format!("{e:?}"));
    }
    stream.clone_htod(data).map_err(|e| format!("{e:?}"))
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>, String> {
    stream.alloc_zeros::<T>(n.max(1)).map_err(|e| format!("{e:?}"))
}

/// Copies `src[..out.len()]` back to the host, after the collective finished.
fn download<T: DeviceRepr>(stream: &Arc<CudaStream>, src: &CudaSlice<T>, out: &mut [T]) -> Result<(), DistError> {
    if out.is_empty() {
        return Ok(());
    }
    stream
        .memcpy_dtoh(&src.slice(..out.len()), out)
        .and_then(|()| stream.synchronize())
        .map_err(|e| DistError::Module(format!("NCCL backend: device to host copy: {e:?}")))
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

fn grouped(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
    let r = f();
    group_end().map_err(|e| format!("ncclGroupEnd: {e:?}"))?;
    r
}

impl NcclGroup {
    fn all_reduce<T: NcclType + DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), DistError> {
        let buf = self.run("all_reduce", |comm, stream| {
            let mut d = upload(stream, data)?;
            if !data.is_empty() {
                comm.all_reduce_in_place(&mut d, &nccl_op(op)).map_err(|e| format!("{e:?}"))?;
            }
            Ok((d, stream.clone()))
        })?;
        download(&buf.1, &buf.0, data)
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
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
        check_counts("all_to_all", send_counts, self.size, Some(send.len()))?;
        check_counts("all_to_all", recv_counts, self.size, Some(out.len()))?;
        let (so, ro) = (offsets(send_counts), offsets(recv_counts));
        let me = self.rank;
        let (recv, stream) = self.run("all_to_all", |comm, stream| {
            let d_send = upload(stream, send)?;
            let mut d_recv = zeros::<u8>(stream, out.len())?;
            if send_counts[me] > 0 {
                let src = d_send.slice(so[me]..so[me] + send_counts[me]);
                let mut dst = d_recv.slice_mut(ro[me]..ro[me] + recv_counts[me]);
                stream.memcpy_dtod(&src, &mut dst).map_err(|e| format!("{e:?}"))?;
            }
            grouped(|| {
                for p in (0..self.size).filter(|&p| p != me) {
                    if send_counts[p] > 0 {
                        comm.send(&d_send.slice(so[p]..so[p] + send_counts[p]), p as i32)
                            .map_err(|e| format!("send to {p}: {e:?}"))?;
                    }
                    if recv_counts[p] > 0 {
                        comm.recv(&mut d_recv.slice_mut(ro[p]..ro[p] + recv_counts[p]), p as i32)
                            .map_err(|e| format!("receive from {p}: {e:?}"))?;
                    }
                }
                Ok(())
            })?;
            Ok((d_recv, stream.clone()))
        })?;
        download(&stream, &recv, out)
    }

    fn all_gather_v_into(&self, local: &[u8], counts: &[usize], out: &mut [u8]) -> Result<(), DistError> {
        check_gather("all_gather", counts, self.size, self.rank, local.len())?;
        check_counts("all_gather", counts, self.size, Some(out.len()))?;
        let at = offsets(counts);
        let me = self.rank;
        let (recv, stream) = self.run("all_gather", |comm, stream| {
            let d_local = upload(stream, local)?;
            let mut d_out = zeros::<u8>(stream, out.len())?;
            grouped(|| {
                for (root, (&o, &n)) in at.iter().zip(counts).enumerate().filter(|(_, (_, n))| **n > 0) {
                    let src = (root == me).then(|| d_local.slice(..n));
                    comm.broadcast(src.as_ref(), &mut d_out.slice_mut(o..o + n), root as i32)
                        .map_err(|e| format!("broadcast from {root}: {e:?}"))?;
                }
                Ok(())
            })?;
            Ok((d_out, stream.clone()))
        })?;
        download(&stream, &recv, out)
    }

    fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce(data, op)
    }

    fn all_reduce_f64(&self, data: &mut [f64], op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce(data, op)
    }

    fn reduce_scatter_f32(&self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, DistError> {
        check_counts("reduce_scatter", counts, self.size, Some(input.len()))?;
        let at = offsets(counts);
        let me = self.rank;
        let (recv, stream) = self.run("reduce_scatter", |comm, stream| {
            let d_in = upload(stream, input)?;
            let mut d_out = zeros::<f32>(stream, counts[me])?;
            grouped(|| {
                for (root, (&o, &n)) in at.iter().zip(counts).enumerate().filter(|(_, (_, n))| **n > 0) {
                    let mut dst = (root == me).then(|| d_out.slice_mut(..n));
                    comm.reduce(&d_in.slice(o..o + n), dst.as_mut(), &NcclOp::Sum, root as i32)
                        .map_err(|e| format!("reduce to {root}: {e:?}"))?;
                }
                Ok(())
            })?;
            Ok((d_out, stream.clone()))
        })?;
        let mut out = vec![0f32; counts[me]];
        download(&stream, &recv, &mut out)?;
        Ok(out)
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<(), DistError> {
        check_root("broadcast", root, self.size)?;
        let (buf, stream) = self.run("broadcast", |comm, stream| {
            let mut d = upload(stream, data)?;
            if !data.is_empty() {
                comm.broadcast_in_place(&mut d, root as i32).map_err(|e| format!("{e:?}"))?;
            }
            Ok((d, stream.clone()))
        })?;
        download(&stream, &buf, data)
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.all_reduce_f32(&mut [0.0], ReduceOp::Sum)
    }
}
