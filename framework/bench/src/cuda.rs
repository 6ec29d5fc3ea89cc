//! `trainrec bench ebc --device cuda`: the W1 step (pooled forward + fused backward/update)
//! with the tables in GPU memory, the workload and JSON of the CPU benchmark
//! ([`crate::embedding`]).

use std::time::Instant;

use crate::embedding::{EbcBench, collection, inputs, results};
use serde_json::{Value, json};

use trainrec_cuda::{CudaEbc, CudaError};

/// Runs the benchmark on GPU `device`. A step is timed from the host's view: the batch's ids
/// uploaded, the forward, the host's occurrence sort, the update, and a synchronize.
pub fn run(a: &EbcBench, device: usize) -> Result<Value, CudaError> {
    crate::embedding::check(a)?;
    trainrec_cuda::probe(device)?;
    let (batches, uniq, grad) = inputs(a);
    let t0 = Instant::now();
    let mut gpu = CudaEbc::from_cpu(&collection(a)?, device)?;
    let build_s = t0.elapsed().as_secs_f64();
    let dev_grad = gpu.upload(&grad)?;
    let mut it = 0usize;
    let mut step = |gpu: &mut CudaEbc| -> Result<(), CudaError> {
        let kjt = &batches[it % batches.len()];
        it += 1;
        let out = gpu.forward(kjt)?;
        gpu.backward_and_update(kjt, &dev_grad)?;
        gpu.synchronize()?;
        drop(out);
        Ok(())
    };
    for _ in 0..a.warmup {
        step(&mut gpu)?;
    }
    let mut ts = Vec::with_capacity(a.steps);
    for _ in 0..a.steps {
        let t = Instant::now();
        step(&mut gpu)?;
        ts.push(t.elapsed().as_secs_f64());
    }
    let mut fwd = Vec::with_capacity(a.fwd_steps);
    for i in 0..a.fwd_steps {
        let kjt = &batches[i % batches.len()];
        let t = Instant::now();
        let out = gpu.forward(kjt)?;
        gpu.synchronize()?;
        fwd.push(t.elapsed().as_secs_f64());
        drop(out);
    }
    let info = gpu.info().clone();
    let mut out = results(a, "trainrec-cuda", &ts, &fwd, uniq);
    out["device"] =
        json!({"name": info.name, "compute_capability": [info.compute_capability.0, info.compute_capability.1]});
    out["build_s"] = json!(build_s);
    Ok(out)
}
