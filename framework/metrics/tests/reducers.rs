//! Cross-rank reduction: ranks on threads each update their own metric states on their share
//! of the batches, then the states are merged (TorchRec's `dist_reduce_fx = "sum"`). Lifetime
//! values must equal one process computing over all the batches; window values must equal one
//! process computing over the union of the ranks' windows.

use std::sync::mpsc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_metrics::{Metric, MultiTaskMetrics, SumMetric, SumMetricKind, TaskBatch};

const KINDS: [SumMetricKind; 9] = [
    SumMetricKind::Ne { include_logloss: true },
    SumMetricKind::Calibration,
    SumMetricKind::Ctr,
    SumMetricKind::Mse,
    SumMetricKind::Mae,
    SumMetricKind::Accuracy { threshold: 0.5 },
    SumMetricKind::Precision { threshold: 0.5 },
    SumMetricKind::Recall { threshold: 0.5 },
    SumMetricKind::WeightedAvg,
];

type Batch = (Vec<f32>, Vec<f32>, Vec<f32>);

fn batches(n: usize, seed: u64) -> Vec<Batch> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(20..80);
            let p: Vec<f32> = (0..len).map(|_| rng.random_range(0.01..0.99)).collect();
            let y = p.iter().map(|&p| if rng.random::<f32>() < p { 1.0 } else { 0.0 }).collect();
            let w = (0..len).map(|_| rng.random_range(0.0..3.0)).collect();
            (p, y, w)
        })
        .collect()
}

fn close(a: &[(String, f64)], b: &[(String, f64)], what: &str) {
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert!((va - vb).abs() <= 1e-9 * vb.abs().max(1.0), "{what} {na}: {va} vs {vb}");
    }
}

#[test]
fn merged_ranks_equal_one_process() {
    let data = batches(23, 1);
    let window = 150;
    for world in [2usize, 3] {
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            for rank in 0..world {
                let tx = tx.clone();
                let data = &data;
                s.spawn(move || {
                    // Rank r takes batches r, r + world, ... (as a distributed sampler would).
                    let mut ms: Vec<SumMetric> =
                        KINDS.iter().map(|&k| SumMetric::for_rank(k, window, world).unwrap()).collect();
                    let mut window_batches = Vec::new();
                    for b in data.iter().skip(rank).step_by(world) {
                        for m in &mut ms {
                            m.update(&b.0, &b.1, Some(&b.2)).unwrap();
                        }
                        window_batches.push(b.clone());
                    }
                    // The batches this rank's window still holds: the newest ones within its
                    // local window of ceil(window / world) samples (never fewer than one).
                    let local = window.div_ceil(world);
                    let mut held = Vec::new();
                    let mut size = 0;
                    for b in window_batches.iter().rev() {
                        if !held.is_empty() && size + b.0.len() > local {
                            break;
                        }
                        size += b.0.len();
                        held.push(b.clone());
                    }
                    tx.send((rank, ms, held)).unwrap();
                });
            }
        });
        drop(tx);
        let mut parts: Vec<_> = rx.iter().collect();
        parts.sort_by_key(|p| p.0);
        let (_, mut merged, mut held) = parts.remove(0);
        for (_, ms, h) in parts {
            for (a, b) in merged.iter_mut().zip(&ms) {
                a.merge(b).unwrap();
            }
            held.extend(h);
        }
        for (k, m) in KINDS.iter().zip(&merged) {
            let mut single = SumMetric::new(*k, usize::MAX).unwrap();
            for b in &data {
                single.update(&b.0, &b.1, Some(&b.2)).unwrap();
            }
            let mut over_windows = SumMetric::new(*k, usize::MAX).unwrap();
            for b in &held {
                over_windows.update(&b.0, &b.1, Some(&b.2)).unwrap();
            }
            let values = m.compute();
            let n = values.len() / 2;
            close(&values[..n], &single.compute()[..n], &format!("world {world} lifetime"));
            let window_names: Vec<(String, f64)> = values[n..].to_vec();
            let expected: Vec<(String, f64)> = over_windows.compute()[..n]
                .iter()
                .map(|(name, v)| (name.replace("lifetime_", "window_"), *v))
                .collect();
            close(&window_names, &expected, &format!("world {world} window"));
        }
    }
}

#[test]
fn merge_refuses_different_metrics_and_tasks() {
    let mut a = SumMetric::new(SumMetricKind::Ctr, 10).unwrap();
    let b = SumMetric::new(SumMetricKind::Mae, 10).unwrap();
    assert!(a.merge(&b).unwrap_err().to_string().contains("cannot merge mae into ctr"));
    let mut x = MultiTaskMetrics::new(&["a"], &[SumMetricKind::Ctr], 10).unwrap();
    let y = MultiTaskMetrics::new(&["b"], &[SumMetricKind::Ctr], 10).unwrap();
    assert!(x.merge(&y).is_err());
    let err = x.update(&[]).unwrap_err().to_string();
    assert_eq!(err, "expected a batch for each of 1 tasks, got 0");
    let p = [0.5f32];
    let bad = TaskBatch::new(&p, &[2.0], None);
    assert!(x.update(&[bad]).is_err());
    assert_eq!(x.compute()[0].0, "ctr-a|lifetime_ctr");
    assert_eq!(x.compute()[0].1, 0.0, "a rejected batch changes nothing");
}

/// Ranking and session metrics: AUC and grouped AUC (gather), AUPRC (gather + binned sum),
/// NDCG and session recall (sums) merged over 2 and 3 ranks equal one process.
#[test]
fn ranking_and_session_metrics_merge_like_one_process() {
    use trainrec_metrics::{AucMetric, AuprcMetric, SessionMetric, SessionMetricKind};
    let data = batches(17, 5);
    // Session ids per batch; distinct predictions overall so no tie depends on rank order.
    let groups: Vec<Vec<i64>> =
        data.iter().enumerate().map(|(b, d)| (0..d.0.len()).map(|i| (b * 10 + i % 6) as i64).collect()).collect();
    let data: Vec<Batch> = data
        .iter()
        .enumerate()
        .map(|(b, (p, y, w))| {
            (p.iter().enumerate().map(|(i, &x)| x + (b * 100 + i) as f32 * 1e-7).collect(), y.clone(), w.clone())
        })
        .collect();
    let sessions = [
        SessionMetricKind::Ndcg {
            k: Some(3),
            exponential_gain: false,
            report_as_decreasing: true,
            remove_single_length_sessions: false,
        },
        SessionMetricKind::RecallSession { top_threshold: 2, run_ranking_of_labels: false },
    ];
    let feed = |m: &mut dyn Metric, b: usize| {
        let (p, y, w) = &data[b];
        m.update_batch(&TaskBatch::new(p, y, Some(w)).with_groups(&groups[b])).unwrap();
    };
    let mut single_auc = AucMetric::new().grouped();
    let mut single_auprc = AuprcMetric::new(usize::MAX).unwrap();
    let mut single_sessions: Vec<SessionMetric> =
        sessions.iter().map(|&k| SessionMetric::new(k, 1 << 30).unwrap()).collect();
    for b in 0..data.len() {
        feed(&mut single_auc, b);
        feed(&mut single_auprc, b);
        for m in &mut single_sessions {
            feed(m, b);
        }
    }
    for world in [2usize, 3] {
        let mut auc: Vec<AucMetric> = (0..world).map(|_| AucMetric::new().grouped()).collect();
        let mut auprc: Vec<AuprcMetric> = (0..world).map(|_| AuprcMetric::new(usize::MAX).unwrap()).collect();
        let mut sess: Vec<Vec<SessionMetric>> =
            (0..world).map(|_| sessions.iter().map(|&k| SessionMetric::new(k, 1 << 30).unwrap()).collect()).collect();
        for b in 0..data.len() {
            let r = b % world;
            feed(&mut auc[r], b);
            feed(&mut auprc[r], b);
            for m in &mut sess[r] {
                feed(m, b);
            }
        }
        let (mut a, mut p, mut s) = (auc.remove(0), auprc.remove(0), sess.remove(0));
        for r in 0..world - 1 {
            a.merge(&auc[r]).unwrap();
            p.merge(&auprc[r]).unwrap();
            for (x, y) in s.iter_mut().zip(&sess[r]) {
                x.merge(y).unwrap();
            }
        }
        close(&a.compute(), &single_auc.compute(), &format!("auc, {world} ranks"));
        close(&p.compute(), &single_auprc.compute(), &format!("auprc, {world} ranks"));
        for (x, y) in s.iter().zip(&single_sessions) {
            close(&x.compute(), &y.compute(), &format!("session metric, {world} ranks"));
        }
    }
    // Grouped and ungrouped AUC states do not merge.
    assert!(AucMetric::new().merge(&AucMetric::new().grouped()).is_err());
    assert_eq!(AucMetric::for_rank(1000, 3).unwrap().window(), Some(334));
}
