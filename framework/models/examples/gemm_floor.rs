//! The matrix-product floor of a DLRM train step: times, with tch on one thread, only the
//! matrix products a DLRM train step cannot avoid (each linear layer's forward, its input and
//! weight gradients, and the interaction's batched Gram product and its gradient), at the
//! shapes of `../shared/bench/anchors/w2_dlrm.py`'s defaults. Any implementation of that
//! step in fp32 (trainrec's or TorchRec's) spends at least this long; the rest of its step is
//! embeddings, element-wise work and overhead.
//!
//! ```text
//! cargo run --release -p trainrec-models --example gemm_floor -- [threads] [batch]
//! ```
//!
//! Prints one JSON line: per-layer medians and the totals in milliseconds.

use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Median wall time in milliseconds of `reps` calls of `f` after 3 warm-up calls.
fn median_ms(reps: usize, f: &mut dyn FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: i32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let batch: i64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2048);
    tch::set_num_threads(threads);
    let (num_dense, num_sparse, dim) = (13i64, 26i64, 64i64);
    let (dense_arch, over_arch) = ([512i64, 256, 64], [512i64, 512, 256, 1]);
    let n = num_sparse + 1;
    let mut shapes = Vec::new();
    let mut prev = num_dense;
    for &size in &dense_arch {
        shapes.push((prev, size));
        prev = size;
    }
    prev = dim + n * (n - 1) / 2;
    for &size in &over_arch {
        shapes.push((prev, size));
        prev = size;
    }
    let opts = (Kind::Float, Device::Cpu);
    let (mut forward, mut backward) = (0.0, 0.0);
    let mut layers = Vec::new();
    for (i, &(input, output)) in shapes.iter().enumerate() {
        let x = Tensor::randn([batch, input], opts);
        let w = Tensor::randn([output, input], opts);
        let bias = Tensor::randn([output], opts);
        let g = Tensor::randn([batch, output], opts);
        let fwd = median_ms(15, &mut || drop(x.linear(&w, Some(&bias))));
        // The first layer's input (the dense features) needs no gradient.
        let grad_input = if i == 0 { 0.0 } else { median_ms(15, &mut || drop(g.mm(&w))) };
        let grad_weight = median_ms(15, &mut || drop(g.tr().mm(&x)));
        forward += fwd;
        backward += grad_input + grad_weight;
        layers.push(serde_json::json!({
            "in": input, "out": output, "forward_ms": fwd, "grad_input_ms": grad_input,
            "grad_weight_ms": grad_weight,
        }));
    }
    let all = Tensor::randn([batch, n, dim], opts);
    let grad_gram = Tensor::randn([batch, n, n], opts);
    let gram = median_ms(15, &mut || drop(all.bmm(&all.transpose(1, 2))));
    let grad_all = median_ms(15, &mut || drop(grad_gram.bmm(&all)));
    forward += gram;
    backward += grad_all;
    let line = serde_json::json!({
        "workload": "w2_dlrm_gemm_floor",
        "threads": threads,
        "batch": batch,
        "layers": layers,
        "interaction": {"gram_ms": gram, "grad_ms": grad_all},
        "forward_ms": forward,
        "backward_ms": backward,
        "total_ms": forward + backward,
    });
    println!("{line}");
}
