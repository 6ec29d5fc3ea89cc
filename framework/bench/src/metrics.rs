//! The W4 metrics benchmark (`trainrec bench metrics`): NE and AUC update + compute over `n`
//! predictions in batches, shaped like the output of `bench/anchors/w4_metrics.py`.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use trainrec_metrics::{AucMetric, Metric, MetricError, SumMetric, SumMetricKind};

/// Parameters (the flags of `w4_metrics.py`).
#[derive(Clone, Debug)]
pub struct MetricsBench {
    /// Predictions in total.
    pub n: usize,
    /// Predictions per update.
    pub batch: usize,
    /// Window in samples.
    pub window: usize,
    /// Repeats (fresh metric each).
    pub repeats: usize,
    /// Seed.
    pub seed: u64,
}

/// `n` predictions sigmoid(N(0, 1)) (Box-Muller) and labels Bernoulli(prediction): a
/// calibrated model, AUC ~ 0.74.
fn generate(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pred = Vec::with_capacity(n);
    let mut label = Vec::with_capacity(n);
    for _ in 0..n {
        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let p = 1.0 / (1.0 + (-z).exp());
        pred.push(p as f32);
        label.push(if rng.random::<f64>() < p { 1.0f32 } else { 0.0 });
    }
    (pred, label)
}

fn summarize(ts: &[f64]) -> Value {
    let mut s = ts.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    json!({"median_s": median, "min_s": s[0], "max_s": s[n - 1], "n": n})
}

/// The predictions and labels of a `--data` file: raw little-endian `f32`, `n` predictions
/// then `n` labels.
pub fn read_data(path: &std::path::Path) -> Result<(Vec<f32>, Vec<f32>), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("--data {}: {e}", path.display()))?;
    if bytes.is_empty() || bytes.len() % 8 != 0 {
        return Err(format!(
            "--data {}: {} bytes is not n predictions then n labels as f32 (a positive multiple of 8 bytes)",
            path.display(),
            bytes.len()
        ));
    }
    let values: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let n = values.len() / 2;
    Ok((values[..n].to_vec(), values[n..].to_vec()))
}

/// Runs the benchmark over `data` (predictions, labels), or generated samples; returns the
/// JSON object to print.
pub fn run(a: &MetricsBench, data: Option<(Vec<f32>, Vec<f32>)>) -> Result<Value, MetricError> {
    if a.n == 0 || a.batch == 0 || a.repeats == 0 {
        return Err(MetricError::EmptyWindow);
    }
    let from_file = data.is_some();
    let (pred, label) = data.unwrap_or_else(|| generate(a.n, a.seed));
    let weight = vec![1.0f32; a.n];
    let mut out = json!({
        "workload": "w4_metrics",
        "impl": "trainrec",
        "config": {"n": a.n, "batch": a.batch, "window": a.window, "repeats": a.repeats, "seed": a.seed,
                   "data": if from_file { "file" } else { "generated" }},
        "num_updates": a.n.div_ceil(a.batch),
    });
    for name in ["ne", "auc"] {
        let (mut upd, mut comp, mut values) = (Vec::new(), Vec::new(), Value::Null);
        for _ in 0..a.repeats {
            let mut m: Box<dyn Metric> = match name {
                "ne" => Box::new(SumMetric::new(SumMetricKind::Ne { include_logloss: false }, a.window)?),
                _ => Box::new(AucMetric::with_window(a.window)?),
            };
            let t0 = Instant::now();
            for start in (0..a.n).step_by(a.batch) {
                let end = (start + a.batch).min(a.n);
                m.update(&pred[start..end], &label[start..end], Some(&weight[start..end]))?;
            }
            let t1 = Instant::now();
            let r = std::hint::black_box(m.compute());
            let t2 = Instant::now();
            upd.push((t1 - t0).as_secs_f64());
            comp.push((t2 - t1).as_secs_f64());
            values = r.into_iter().map(|(k, v)| (k, json!(v))).collect::<serde_json::Map<_, _>>().into();
        }
        let u = summarize(&upd);
        let per_call = u["median_s"].as_f64().unwrap_or(0.0) / a.n.div_ceil(a.batch) as f64 * 1e6;
        out[name] = json!({"update_total": u, "update_per_call_us_median": per_call, "compute": summarize(&comp),
                           "values": values});
    }
    Ok(out)
}
