//! The in-process backend: one thread per rank, collectives over channels. For fast tests of
//! every sharding type and for simulating a multi-rank job on one host; MPI and NCCL are the
//! engines for real multi-process jobs.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use crate::group::{DistError, ProcessGroup, ReduceOp, check_counts, check_gather, check_root};

/// One message of one collective.
struct Packet {
    seq: u64,
    op: &'static str,
    data: Vec<u8>,
}

struct Mailboxes {
    /// `to[d]`: the channel to rank `d`.
    to: Vec<Sender<Packet>>,
    /// `from[s]`: the channel from rank `s`.
    from: Vec<Receiver<Packet>>,
    /// Collectives started so far.
    seq: u64,
}

/// One rank of an in-process group. Build a group with [`ThreadGroup::group`] (one handle per
/// rank, to move into its thread) or run a closure on every rank with [`ThreadGroup::run`].
/// Dropping a rank's handle (its thread ended or panicked) makes its peers' next collective
/// fail with [`DistError::PeerGone`] instead of waiting.
pub struct ThreadGroup {
    rank: usize,
    world: usize,
    timeout: Duration,
    boxes: Mutex<Mailboxes>,
}

impl ThreadGroup {
    /// The handles of a new group of `world` ranks, rank order.
    pub fn group(world: usize, timeout: Duration) -> Vec<ThreadGroup> {
        let world = world.max(1);
        // channels[s][d]: from rank s to rank d.
        let mut senders: Vec<Vec<Option<Sender<Packet>>>> = (0..world).map(|_| Vec::new()).collect();
        let mut receivers: Vec<Vec<Option<Receiver<Packet>>>> =
            (0..world).map(|_| (0..world).map(|_| None).collect()).collect();
        for (s, row) in senders.iter_mut().enumerate() {
            for recv_row in receivers.iter_mut() {
                let (tx, rx) = channel();
                row.push(Some(tx));
                recv_row[s] = Some(rx);
            }
        }
        senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (to, from))| ThreadGroup {
                rank,
                world,
                timeout,
                boxes: Mutex::new(Mailboxes {
                    to: to.into_iter().map(|t| t.expect("every pair has a channel")).collect(),
                    from: from.into_iter().map(|r| r.expect("every pair has a channel")).collect(),
                    seq: 0,
                }),
            })
            .collect()
    }

    /// Runs `f` on `world` ranks, one named thread each (`rank-N`), and returns each rank's
    /// result in rank order; a rank that panicked gives `Err` with its panic message (and its
    /// peers see it leave).
    pub fn run<R: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(ThreadGroup) -> R + Sync,
    ) -> Vec<Result<R, String>> {
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = Self::group(world, timeout)
                .into_iter()
                .map(|pg| {
                    std::thread::Builder::new()
                        .name(format!("rank-{}", pg.rank))
                        .spawn_scoped(scope, move || f(pg))
                        .expect("spawn a rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().map_err(|e| {
                        e.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "panicked".into())
                    })
                })
                .collect()
        })
    }

    /// One round: `parts[d]` goes to rank `d`; returns what each rank sent here, rank order.
    fn exchange(&self, op: &'static str, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, DistError> {
        let mut boxes = self.boxes.lock().unwrap_or_else(|p| p.into_inner());
        let seq = boxes.seq;
        boxes.seq += 1;
        for (d, data) in parts.into_iter().enumerate() {
            if boxes.to[d].send(Packet { seq, op, data }).is_err() {
                return Err(DistError::PeerGone { rank: self.rank, peer: d, op, seq });
            }
        }
        let deadline = Instant::now() + self.timeout;
        let mut out = Vec::with_capacity(self.world);
        for s in 0..self.world {
            let wait = deadline.saturating_duration_since(Instant::now());
            let p = match boxes.from[s].recv_timeout(wait) {
                Ok(p) => p,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(DistError::Timeout { rank: self.rank, peer: s, op, seq, timeout: self.timeout });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(DistError::PeerGone { rank: self.rank, peer: s, op, seq });
                }
            };
            if p.seq != seq || p.op != op {
                return Err(DistError::Mismatch { rank: self.rank, op, seq, peer: s, peer_op: p.op, peer_seq: p.seq });
            }
            out.push(p.data);
        }
        Ok(out)
    }

    fn reduce<T: bytemuck::Pod + PartialOrd + std::ops::AddAssign>(
        &self,
        op_name: &'static str,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), DistError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let got = self.exchange(op_name, vec![bytes.to_vec(); self.world])?;
        let parts: Vec<Vec<T>> = got.iter().map(|b| bytemuck::pod_collect_to_vec(b)).collect();
        if let Some((s, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != data.len()) {
            return Err(DistError::Invalid {
                op: op_name,
                message: format!("rank {s} reduces {} values, rank {} {}", p.len(), self.rank, data.len()),
            });
        }
        let views: Vec<&[T]> = parts.iter().map(|p| p.as_slice()).collect();
        op.fold(&views, data);
        Ok(())
    }
}

fn split(buf: &[u8], counts: &[usize]) -> Vec<Vec<u8>> {
    let mut at = 0;
    counts
        .iter()
        .map(|&n| {
            let part = buf[at..at + n].to_vec();
            at += n;
            part
        })
        .collect()
}

/// Copies each rank's part (rank order) into `out`, checking it has the expected size.
fn place(op: &'static str, rank: usize, parts: &[Vec<u8>], counts: &[usize], out: &mut [u8]) -> Result<(), DistError> {
    let mut at = 0;
    for (s, (part, &want)) in parts.iter().zip(counts).enumerate() {
        if part.len() != want {
            return Err(DistError::Invalid {
                op,
                message: format!("rank {rank} expected {want} bytes from rank {s}, which sent {}", part.len()),
            });
        }
        out[at..at + want].copy_from_slice(part);
        at += want;
    }
    Ok(())
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        "threads"
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
        check_counts(OP, send_counts, self.world, Some(send.len()))?;
        check_counts(OP, recv_counts, self.world, Some(out.len()))?;
        let got = self.exchange(OP, split(send, send_counts))?;
        place(OP, self.rank, &got, recv_counts, out)
    }

    fn all_gather_v_into(&self, local: &[u8], counts: &[usize], out: &mut [u8]) -> Result<(), DistError> {
        const OP: &str = "all_gather";
        check_gather(OP, counts, self.world, self.rank, local.len())?;
        check_counts(OP, counts, self.world, Some(out.len()))?;
        let got = self.exchange(OP, vec![local.to_vec(); self.world])?;
        place(OP, self.rank, &got, counts, out)
    }

    fn all_reduce_f32(&self, data: &mut [f32], op: ReduceOp) -> Result<(), DistError> {
        self.reduce("all_reduce", data, op)
    }

    fn all_reduce_f64(&self, data: &mut [f64], op: ReduceOp) -> Result<(), DistError> {
        self.reduce("all_reduce", data, op)
    }

    fn reduce_scatter_f32(&self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, DistError> {
        const OP: &str = "reduce_scatter";
        check_counts(OP, counts, self.world, Some(input.len()))?;
        let bytes: Vec<usize> = counts.iter().map(|n| n * 4).collect();
        let got = self.exchange(OP, split(bytemuck::cast_slice(input), &bytes))?;
        let parts: Vec<Vec<f32>> = got.iter().map(|b| bytemuck::pod_collect_to_vec(b)).collect();
        let mine = counts[self.rank];
        if let Some((s, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != mine) {
            return Err(DistError::Invalid {
                op: OP,
                message: format!("rank {s} sent {} floats for rank {}, which expects {mine}", p.len(), self.rank),
            });
        }
        let views: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
        let mut out = vec![0f32; mine];
        ReduceOp::Sum.fold(&views, &mut out);
        Ok(out)
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<(), DistError> {
        const OP: &str = "broadcast";
        check_root(OP, root, self.world)?;
        let parts = if self.rank == root { vec![data.to_vec(); self.world] } else { vec![Vec::new(); self.world] };
        let got = self.exchange(OP, parts)?;
        if got[root].len() != data.len() {
            return Err(DistError::Invalid {
                op: OP,
                message: format!("root {root} sent {} bytes, rank {} holds {}", got[root].len(), self.rank, data.len()),
            });
        }
        data.copy_from_slice(&got[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.exchange("barrier", vec![Vec::new(); self.world]).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ProcessGroupExt;

    const T: Duration = Duration::from_secs(20);

    #[test]
    fn collectives_give_the_textbook_results() {
        for world in [1usize, 2, 3] {
            let out = ThreadGroup::run(world, T, |pg| {
                let r = pg.rank();
                // all_to_all: rank r sends (r + 1) copies of 10 r + d to rank d.
                let mut send = Vec::new();
                for d in 0..world {
                    send.extend(std::iter::repeat_n((10 * r + d) as u64, r + 1));
                }
                let recv_counts: Vec<usize> = (0..world).map(|s| s + 1).collect();
                let got = pg.all_to_all_v(&send, &vec![r + 1; world], &recv_counts).unwrap();
                let want: Vec<u64> = (0..world).flat_map(|s| std::iter::repeat_n((10 * s + r) as u64, s + 1)).collect();
                assert_eq!(got, want);
                // all_reduce sum / max.
                let mut x = vec![r as f32, 1.0];
                pg.all_reduce_f32(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, vec![(world * (world - 1) / 2) as f32, world as f32]);
                let mut m = vec![r as f64];
                pg.all_reduce_f64(&mut m, ReduceOp::Max).unwrap();
                assert_eq!(m, vec![(world - 1) as f64]);
                // reduce_scatter: rank d's block has d + 1 floats, all equal to r + 1 from rank r.
                let counts: Vec<usize> = (0..world).map(|d| d + 1).collect();
                let input = vec![(r + 1) as f32; counts.iter().sum()];
                let got = pg.reduce_scatter_f32(&input, &counts).unwrap();
                assert_eq!(got, vec![(world * (world + 1) / 2) as f32; r + 1]);
                // all_gather: r + 1 copies of r.
                let got = pg.all_gather_v(&vec![r as u32; r + 1], &counts).unwrap();
                let want: Vec<u32> = (0..world).flat_map(|s| std::iter::repeat_n(s as u32, s + 1)).collect();
                assert_eq!(got, want);
                // broadcast from the last rank.
                let mut b = if r == world - 1 { vec![7u8, 8, 9] } else { vec![0u8; 3] };
                pg.broadcast_bytes(&mut b, world - 1).unwrap();
                assert_eq!(b, vec![7, 8, 9]);
                pg.barrier().unwrap();
                r
            });
            let ranks: Vec<usize> = out.into_iter().map(|r| r.unwrap()).collect();
            assert_eq!(ranks, (0..world).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_dead_peer_and_a_silent_peer_are_clear_errors() {
        // Rank 1 panics before the barrier: rank 0 learns it left instead of hanging.
        let out = ThreadGroup::run(2, T, |pg| {
            if pg.rank() == 1 {
                panic!("rank 1 failed on purpose");
            }
            pg.barrier()
        });
        let err = out[0].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(err, DistError::PeerGone { peer: 1, op: "barrier", .. }), "{err}");
        assert!(err.to_string().contains("rank 1 left the group during barrier"), "{err}");
        assert_eq!(out[1].as_ref().unwrap_err(), "rank 1 failed on purpose");

        // Rank 1 is alive but never joins: rank 0 times out, naming the peer and the op.
        let out = ThreadGroup::run(2, Duration::from_millis(200), |pg| {
            if pg.rank() == 1 {
                std::thread::sleep(Duration::from_millis(600));
                return Ok(());
            }
            pg.all_reduce_f32(&mut [1.0], ReduceOp::Sum)
        });
        let err = out[0].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(err, DistError::Timeout { peer: 1, op: "all_reduce", seq: 0, .. }), "{err}");
    }

    #[test]
    fn diverging_collectives_are_named() {
        let out = ThreadGroup::run(2, T, |pg| {
            if pg.rank() == 0 { pg.barrier() } else { pg.all_reduce_f32(&mut [1.0], ReduceOp::Sum) }
        });
        let err = out[0].as_ref().unwrap().as_ref().unwrap_err().to_string();
        assert!(err.contains("collective #0 is barrier here but all_reduce"), "{err}");
    }

    #[test]
    fn bad_counts_are_refused_before_sending() {
        let pg = ThreadGroup::group(2, T).remove(0);
        let err = pg.all_to_all_v_bytes(&[1, 2, 3], &[1, 1], &[1, 1]).unwrap_err();
        assert!(err.to_string().contains("counts sum to 2 but the buffer has 3"), "{err}");
        assert!(pg.broadcast_bytes(&mut [0], 5).unwrap_err().to_string().contains("root 5 outside world size 2"));
    }
}
