//! The NCCL backend builds everywhere. Without a GPU, making a group is a clear error on every
//! rank (no panic, no rank left waiting); with one, its collectives give the thread backend's
//! results on a one-rank group (one GPU holds one NCCL rank).

use std::sync::Arc;
use std::time::Duration;

use trainrec_comm::{NcclGroup, ProcessGroup, ProcessGroupExt, ReduceOp, ThreadGroup};

#[test]
fn without_a_gpu_every_rank_gets_the_reason() {
    if let Ok(gpus) = NcclGroup::probe() {
        eprintln!("skipping: this machine has {gpus} GPU(s) and NCCL; see the one-rank test");
        return;
    }
    let results = ThreadGroup::run(2, Duration::from_secs(10), |pg| {
        NcclGroup::new(&pg, 0, Duration::from_secs(5)).err().map(|e| e.to_string())
    });
    for (r, res) in results.into_iter().enumerate() {
        let err = res.expect("no panic").expect("no NCCL group without a GPU");
        assert!(err.starts_with(&format!("rank {r}: NCCL backend: ")), "{err}");
        assert!(err.contains("libcuda.so") || err.contains("GPU") || err.contains("libnccl.so"), "{err}");
    }
}

#[test]
fn one_rank_collectives_on_a_gpu() {
    if let Err(e) = NcclGroup::probe() {
        eprintln!("skipping: {e}");
        return;
    }
    let boot = ThreadGroup::group(1, Duration::from_secs(10)).pop().unwrap();
    let g: Arc<dyn ProcessGroup> = Arc::new(NcclGroup::new(&boot, 0, Duration::from_secs(30)).unwrap());
    assert_eq!(g.backend(), "nccl");
    let got = g.all_to_all_v(&[1u64, 2, 3], &[3], &[3]).unwrap();
    assert_eq!(got, vec![1, 2, 3]);
    assert_eq!(g.all_gather_v(&[4i64, 5], &[2]).unwrap(), vec![4, 5]);
    let mut x = vec![1.5f32, -2.0];
    g.all_reduce_f32(&mut x, ReduceOp::Max).unwrap();
    assert_eq!(x, vec![1.5, -2.0]);
    assert_eq!(g.reduce_scatter_f32(&[0.25, 0.5], &[2]).unwrap(), vec![0.25, 0.5]);
    let mut b = vec![7u8; 5];
    g.broadcast_bytes(&mut b, 0).unwrap();
    assert_eq!(b, vec![7; 5]);
    g.barrier().unwrap();
    assert!(g.all_to_all_v::<u8>(&[], &[0], &[0]).unwrap().is_empty());
}
