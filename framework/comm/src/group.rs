//! The collective operations a training job needs, over any communication engine.

use std::time::Duration;

use bytemuck::Pod;

/// What went wrong in a collective. Every variant names the operation and the rank it was
/// waiting on, so a dead or diverging peer is an error message, not a hang.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DistError {
    /// A peer did not take part in a collective within the group's timeout.
    #[error("rank {rank}: timed out after {timeout:?} waiting for rank {peer} in {op} (collective #{seq})")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The rank that did not answer.
        peer: usize,
        /// The collective.
        op: &'static str,
        /// The collective's sequence number in this group (0 is the first).
        seq: u64,
        /// The group's timeout.
        timeout: Duration,
    },
    /// A peer left the group (its process or thread ended) before this collective completed.
    #[error("rank {rank}: rank {peer} left the group during {op} (collective #{seq}); it exited or failed")]
    PeerGone {
        /// This rank.
        rank: usize,
        /// The rank that left.
        peer: usize,
        /// The collective.
        op: &'static str,
        /// The collective's sequence number.
        seq: u64,
    },
    /// Ranks called different collectives at the same point of the program.
    #[error("rank {rank}: collective #{seq} is {op} here but {peer_op} (collective #{peer_seq}) on rank {peer}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The collective called here.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The peer.
        peer: usize,
        /// What the peer called.
        peer_op: &'static str,
        /// The peer's sequence number.
        peer_seq: u64,
    },
    /// Arguments that do not fit the group (counts per rank, sizes, a root out of range).
    #[error("{op}: {message}")]
    Invalid {
        /// The collective.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// An error of the sharded module around the collective (its lookups, its plan).
    #[error("{0}")]
    Module(String),
}

/// A reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    fn apply<T: PartialOrd + std::ops::AddAssign + Copy>(self, acc: &mut T, x: T) {
        match self {
            Self::Sum => *acc += x,
            Self::Max => {
                if x > *acc {
                    *acc = x
                }
            }
            Self::Min => {
                if x < *acc {
                    *acc = x
                }
            }
        }
    }

    /// Folds `parts` (one slice per rank, in rank order) into `out` element-wise: the same
    /// order on every rank, so every rank gets bit-identical results.
    pub fn fold<T: PartialOrd + std::ops::AddAssign + Copy>(self, parts: &[&[T]], out: &mut [T]) {
        for (i, o) in out.iter_mut().enumerate() {
            let mut acc = parts[0][i];
            for p in &parts[1..] {
                self.apply(&mut acc, p[i]);
            }
            *o = acc;
        }
    }
}

/// A group of ranks that run collectives together: TorchRec's `ProcessGroup`. Every rank of
/// the group must call the same collectives in the same order. Each call waits at most the
/// group's timeout for its peers and then fails with [`DistError::Timeout`]; a peer that has
/// left gives [`DistError::PeerGone`].
///
/// The byte-level operations are the engine's primitives; [`ProcessGroupExt`] gives their
/// typed forms (`all_to_all_v::<f32>`, ...).
pub trait ProcessGroup: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// The engine's name (`threads`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;
    /// How long a collective waits for its peers.
    fn timeout(&self) -> Duration;

    /// Variable all-to-all: `send` is the concatenation of the parts for ranks `0..world`
    /// (`send_counts[d]` bytes for rank `d`); returns the concatenation of what every rank
    /// sent here, in rank order (`recv_counts[s]` bytes from rank `s`). The counts must agree
    /// across ranks (exchange them first, as the input dist does: splits first).
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Vec<u8>, DistError> {
        let mut out = vec![0u8; recv_counts.iter().sum()];
        self.all_to_all_v_into(send, send_counts, recv_counts, &mut out)?;
        Ok(out)
    }

    /// [`Self::all_to_all_v_bytes`] into the caller's buffer of `sum(recv_counts)` bytes (the
    /// engine's primitive: a typed caller receives straight into its own vector).
    fn all_to_all_v_into(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv_counts: &[usize],
        out: &mut [u8],
    ) -> Result<(), DistError>;

    /// Every rank's `local` bytes (`counts[s]` from rank `s`), concatenated in rank order.
    fn all_gather_v_bytes(&self, local: &[u8], counts: &[usize]) -> Result<Vec<u8>, DistError> {
        let mut out = vec![0u8; counts.iter().sum()];
        self.all_gather_v_into(local, counts, &mut out)?;
        Ok(out)
    }

    /// [`Self::all_gather_v_bytes`] into the caller's buffer of `sum(counts)` bytes.
    fn all_gather_v_into(&self, local: &[u8], counts: &[usize], out: &mut [u8]) -> Result<(), DistError>;

    /// Element-wise reduction of `data` across ranks, in place on every rank.
    fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<(), DistError>;

    /// [`Self::all_reduce_f32`] in float64 (metric states).
    fn all_reduce_f64(&self, data: &mut [f64], op: ReduceOp) -> Result<(), DistError>;

    /// Sum-reduces `input` (the concatenation of one block per rank, `counts[d]` floats for
    /// rank `d`) across ranks and returns this rank's block.
    fn reduce_scatter_f32(&self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, DistError>;

    /// `root`'s `data` on every rank (same length everywhere).
    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<(), DistError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistError>;
}

/// Typed forms of the byte-level collectives, for any plain-old-data element type.
pub trait ProcessGroupExt: ProcessGroup {
    /// [`ProcessGroup::all_to_all_v_bytes`] with counts in elements.
    fn all_to_all_v<T: Pod>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Vec<T>, DistError> {
        let size = std::mem::size_of::<T>();
        let bytes = |c: &[usize]| c.iter().map(|n| n * size).collect::<Vec<_>>();
        let mut out = vec![T::zeroed(); recv_counts.iter().sum()];
        self.all_to_all_v_into(
            bytemuck::cast_slice(send),
            &bytes(send_counts),
            &bytes(recv_counts),
            bytemuck::cast_slice_mut(&mut out),
        )?;
        Ok(out)
    }

    /// One value to each rank, one value from each: the splits exchange before a variable
    /// all-to-all.
    fn all_to_all_counts(&self, send: &[u64]) -> Result<Vec<u64>, DistError> {
        let w = self.world_size();
        if !send.len().is_multiple_of(w) {
            return Err(DistError::Invalid {
                op: "all_to_all_counts",
                message: format!("{} counts is not a multiple of world size {w}", send.len()),
            });
        }
        let per = send.len() / w;
        self.all_to_all_v(send, &vec![per; w], &vec![per; w])
    }

    /// [`ProcessGroup::all_gather_v_bytes`] with counts in elements.
    fn all_gather_v<T: Pod>(&self, local: &[T], counts: &[usize]) -> Result<Vec<T>, DistError> {
        let size = std::mem::size_of::<T>();
        let bytes: Vec<usize> = counts.iter().map(|n| n * size).collect();
        let mut out = vec![T::zeroed(); counts.iter().sum()];
        self.all_gather_v_into(bytemuck::cast_slice(local), &bytes, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Every rank's `value`, in rank order.
    fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>, DistError> {
        self.all_gather_v(&[value], &vec![1; self.world_size()])
    }

    /// [`Self::all_gather_v`] when the ranks do not know each other's counts: one all-gather of
    /// the counts first.
    fn all_gather_sized<T: Pod>(&self, local: &[T]) -> Result<Vec<T>, DistError> {
        let counts: Vec<usize> = self.all_gather_u64(local.len() as u64)?.iter().map(|&n| n as usize).collect();
        self.all_gather_v(local, &counts)
    }
}

impl<P: ProcessGroup + ?Sized> ProcessGroupExt for P {}

/// Checks that `counts` has one entry per rank and (when given) sums to `len`.
pub(crate) fn check_counts(
    op: &'static str,
    counts: &[usize],
    world: usize,
    len: Option<usize>,
) -> Result<(), DistError> {
    if counts.len() != world {
        return Err(DistError::Invalid { op, message: format!("{} counts for world size {world}", counts.len()) });
    }
    if let Some(len) = len {
        let total: usize = counts.iter().sum();
        if total != len {
            return Err(DistError::Invalid { op, message: format!("counts sum to {total} but the buffer has {len}") });
        }
    }
    Ok(())
}

/// Checks an all-gather's counts (one per rank) and that this rank's count is its data's size.
pub(crate) fn check_gather(
    op: &'static str,
    counts: &[usize],
    world: usize,
    rank: usize,
    len: usize,
) -> Result<(), DistError> {
    check_counts(op, counts, world, None)?;
    if counts[rank] != len {
        return Err(DistError::Invalid {
            op,
            message: format!("rank {rank} gives {len} bytes, its count says {}", counts[rank]),
        });
    }
    Ok(())
}

/// Where each of `counts` consecutive parts starts (exclusive prefix sums).
pub fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let o = *at;
            *at += c;
            Some(o)
        })
        .collect()
}

/// Checks that a root rank is in the group.
pub(crate) fn check_root(op: &'static str, root: usize, world: usize) -> Result<(), DistError> {
    if root >= world {
        return Err(DistError::Invalid { op, message: format!("root {root} outside world size {world}") });
    }
    Ok(())
}
