//! The W1 embedding benchmark (`trainrec bench ebc`): the same workload, flags and JSON
//! fields as `bench/anchors/w1_ebc_train.py`, so both can run side by side.
//!
//! One step = pooled forward of `tables` sum-pooled tables (one feature each, exactly
//! `pooling` ids per bag) + fused backward/update with a fixed random gradient. `trainrec bench
//! ec` ([`run_ec`]) times the same tables and ids unpooled (one row per id, TorchRec's
//! `EmbeddingCollection`), against `scripts/anchors/w1_ec_train.py`.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;
use serde_json::{Value, json};
use trainrec_sparse::KeyedJaggedTensor;

use crate::stats::median;
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingError, PoolingMode, SparseOptimizerConfig,
};

/// How ids are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum IdDist {
    /// Uniform over the rows.
    Uniform,
    /// Bounded Zipf over ranks `1..=rows` with exponent `alpha`, ranks mapped to rows by a
    /// fixed random permutation per table.
    Zipf(f64),
}

/// The benchmark's parameters (flags of `w1_ebc_train.py`).
#[derive(Clone, Debug)]
pub struct EbcBench {
    /// Tables (one feature each).
    pub tables: usize,
    /// Rows per table.
    pub rows: u64,
    /// Embedding dim.
    pub dim: usize,
    /// Ids per bag.
    pub pooling: usize,
    /// Bags per feature.
    pub batch: usize,
    /// Id distribution.
    pub dist: IdDist,
    /// Timed steps.
    pub steps: usize,
    /// Untimed warm-up steps.
    pub warmup: usize,
    /// Timed forward-only calls (0 skips them).
    pub fwd_steps: usize,
    /// Distinct pre-generated batches, cycled through.
    pub num_batches: usize,
    /// The fused optimizer.
    pub optimizer: SparseOptimizerConfig,
    /// Worker threads (0 = all cores).
    pub threads: usize,
    /// Seed of ids, gradient and weights.
    pub seed: u64,
    /// Also time the step with managed collisions on every table (LFU, every `rows` slots,
    /// this eviction interval), raw ids a fixed 40-bit hash of the rows: the remap's cost
    /// against the plain step of the same run.
    pub mc_interval: Option<u64>,
    /// Also time the forward pass over the tables quantized to int8 row-wise and to fp16
    /// ([`trainrec_embedding::quant::QuantizedEbc`]) on the forward-only batches, against the fp32 forward.
    pub quant: bool,
}

/// Busy core-seconds of the whole machine and of this process (Linux `/proc`), to report
/// how many cores other processes kept busy during the timed window. Shared by every
/// benchmark that reports it.
pub fn cpu_snapshot() -> Option<(Instant, f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let busy = v.iter().sum::<f64>() - v.get(3)? - v.get(4)?;
    let me = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = me.rsplit_once(')')?.1.split_whitespace().collect();
    let own = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux configuration in practice.
    Some((Instant::now(), busy / 100.0, own / 100.0))
}

/// Cores other processes kept busy between two [`cpu_snapshot`]s.
pub fn others_busy(a: Option<(Instant, f64, f64)>, b: Option<(Instant, f64, f64)>) -> Value {
    match (a, b) {
        (Some((t0, b0, s0)), Some((t1, b1, s1))) => {
            let wall = (t1 - t0).as_secs_f64().max(1e-9);
            json!((((b1 - b0) - (s1 - s0)).max(0.0) / wall * 1000.0).round() / 1000.0)
        }
        _ => Value::Null,
    }
}

/// Median, min and max of step times (seconds), and their count: the benchmarks' `step` object.
pub fn summarize(ts: &[f64]) -> Value {
    let mut s = ts.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    json!({"median_s": median, "min_s": s[0], "max_s": s[n - 1], "n": n})
}

/// `per_step` per second at the median, best and worst step time.
pub fn rate(ts: &[f64], per_step: f64) -> Value {
    let s = summarize(ts);
    json!({
        "median": per_step / s["median_s"].as_f64().unwrap_or(f64::NAN),
        "best": per_step / s["min_s"].as_f64().unwrap_or(f64::NAN),
        "worst": per_step / s["max_s"].as_f64().unwrap_or(f64::NAN),
    })
}

/// Generates the id batches: `[tables][batch * pooling]` each, and the mean unique rows
/// per table.
pub fn make_batches(a: &EbcBench, rng: &mut StdRng) -> (Vec<KeyedJaggedTensor>, f64) {
    let n = a.batch * a.pooling;
    let rows = a.rows;
    let zipf = match a.dist {
        IdDist::Uniform => None,
        IdDist::Zipf(alpha) => {
            let mut cdf: Vec<f64> = (1..=rows).map(|k| (k as f64).powf(-alpha)).collect();
            let mut acc = 0.0;
            for c in cdf.iter_mut() {
                acc += *c;
                *c = acc;
            }
            cdf.iter_mut().for_each(|c| *c /= acc);
            let perms: Vec<Vec<u32>> = (0..a.tables)
                .map(|_| {
                    let mut p: Vec<u32> = (0..rows as u32).collect();
                    for i in (1..p.len()).rev() {
                        p.swap(i, rng.random_range(0..=i));
                    }
                    p
                })
                .collect();
            Some((cdf, perms))
        }
    };
    let keys: Vec<String> = (0..a.tables).map(|t| format!("f{t}")).collect();
    let lengths = vec![a.pooling as u32; a.tables * a.batch];
    let mut uniq = 0.0;
    let mut seen = vec![false; rows as usize];
    let batches = (0..a.num_batches)
        .map(|_| {
            let mut values = Vec::with_capacity(a.tables * n);
            for t in 0..a.tables {
                let start = values.len();
                for _ in 0..n {
                    let id = match &zipf {
                        None => rng.random_range(0..rows),
                        Some((cdf, perms)) => {
                            let u: f64 = rng.random();
                            let r = cdf.partition_point(|&c| c <= u).min(rows as usize - 1);
                            u64::from(perms[t][r])
                        }
                    };
                    values.push(id as i64);
                }
                let mut count = 0usize;
                for &v in &values[start..] {
                    if !seen[v as usize] {
                        seen[v as usize] = true;
                        count += 1;
                    }
                }
                values[start..].iter().for_each(|&v| seen[v as usize] = false);
                uniq += count as f64;
            }
            KeyedJaggedTensor::new(keys.clone(), values, None, lengths.clone(), a.batch)
                .expect("bench batches are well formed")
        })
        .collect();
    (batches, uniq / (a.num_batches * a.tables) as f64)
}

/// The parameters' sizes and counts are all positive.
pub fn check(a: &EbcBench) -> Result<(), EmbeddingError> {
    if a.tables == 0 || a.rows == 0 || a.dim == 0 || a.batch == 0 || a.steps == 0 || a.num_batches == 0 {
        return Err(EmbeddingError::Config("tables, rows, dim, batch, steps and num-batches must be > 0".into()));
    }
    Ok(())
}

/// The benchmark's batches (seeded), their mean unique rows per table, and the fixed
/// upstream gradient of every step.
pub fn inputs(a: &EbcBench) -> (Vec<KeyedJaggedTensor>, f64, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(a.seed);
    tracing::info!("generating {} batches", a.num_batches);
    let (batches, uniq) = make_batches(a, &mut rng);
    let grad: Vec<f32> = (0..a.batch * a.tables * a.dim).map(|_| StandardNormal.sample(&mut rng)).collect();
    (batches, uniq, grad)
}

/// The benchmark's tables: `t0..` of `rows x dim`, each reading feature `f<t>` with `pooling`.
fn table_configs(a: &EbcBench, pooling: PoolingMode) -> Vec<EmbeddingBagConfig> {
    tracing::info!("building {} tables of {} x {}", a.tables, a.rows, a.dim);
    (0..a.tables)
        .map(|t| EmbeddingBagConfig::new(format!("t{t}"), a.rows, a.dim, pooling, &[&format!("f{t}")]))
        .collect()
}

/// The benchmark's tables as a collection, each sum-pooling its feature.
pub fn collection(a: &EbcBench) -> Result<EmbeddingBagCollection, EmbeddingError> {
    EmbeddingBagCollection::new(table_configs(a, PoolingMode::Sum), a.optimizer.clone(), a.seed)
}

/// A pool of `threads` workers (0: one per core), and its size.
fn thread_pool(threads: usize) -> Result<(rayon::ThreadPool, usize), EmbeddingError> {
    let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| EmbeddingError::Config(format!("cannot start {threads} threads: {e}")))?;
    Ok((pool, threads))
}

/// Calls `f` `n` times, timing each call: the times, and how many cores other processes kept
/// busy meanwhile (null when `n` is 0).
fn timed(n: usize, mut f: impl FnMut() -> Result<(), EmbeddingError>) -> Result<(Vec<f64>, Value), EmbeddingError> {
    let c0 = cpu_snapshot();
    let mut ts = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed().as_secs_f64());
    }
    Ok((ts, if n > 0 { others_busy(c0, cpu_snapshot()) } else { Value::Null }))
}

/// A step's lookups, unique rows, and the least bytes its forward and its backward + update
/// move (fp32 weights; `uniq`: mean unique rows per table): the forward reads each looked-up
/// row, its id, and writes the output; the update reads the gradient and each id again, and
/// reads and writes each unique row and its optimizer state.
pub fn min_bytes(a: &EbcBench, uniq: f64) -> (f64, f64, f64, f64) {
    let (t, b, l, d) = (a.tables as f64, a.batch as f64, a.pooling as f64, a.dim as f64);
    let lookups = t * b * l;
    let uniq_rows = uniq * t;
    let spr = a.optimizer.state_per_row(a.dim) as f64;
    let bytes_fwd = lookups * d * 4.0 + b * t * d * 4.0 + lookups * 8.0;
    let bytes_bwd = uniq_rows * (2.0 * d * 4.0 + 2.0 * 4.0 * spr) + b * t * d * 4.0 + lookups * 8.0;
    (lookups, uniq_rows, bytes_fwd, bytes_bwd)
}

/// Runs the benchmark; the result is the JSON object `trainrec bench ebc` prints.
pub fn run(a: &EbcBench) -> Result<Value, EmbeddingError> {
    check(a)?;
    let (pool, threads) = thread_pool(a.threads)?;
    pool.install(|| {
        let (batches, uniq, grad) = inputs(a);
        let t0 = Instant::now();
        let mut ebc = collection(a)?;
        let build_s = t0.elapsed().as_secs_f64();
        let mut it = 0usize;
        let mut step = |ebc: &mut EmbeddingBagCollection| -> Result<(), EmbeddingError> {
            let kjt = &batches[it % batches.len()];
            it += 1;
            let out = ebc.forward(kjt)?;
            std::hint::black_box(out.values());
            ebc.backward_and_update(kjt, &grad)
        };
        tracing::info!("timing");
        for _ in 0..a.warmup {
            step(&mut ebc)?;
        }
        let (ts, busy_step) = timed(a.steps, || step(&mut ebc))?;
        let (fwd, busy_fwd) = timed(a.fwd_steps, || {
            let kjt = &batches[it % batches.len()];
            it += 1;
            std::hint::black_box(ebc.forward(kjt)?.values());
            Ok(())
        })?;
        let quant = if a.quant && a.fwd_steps > 0 { Some(time_quant(a, &batches, &ebc)?) } else { None };
        let mc = match a.mc_interval {
            Some(interval) => Some(time_mc(a, interval, &batches, &grad, &mut ebc, &ts)?),
            None => None,
        };
        let mut out = results(a, "trainrec", &ts, &fwd, uniq);
        out["config"]["threads"] = json!(threads);
        out["build_s"] = json!(build_s);
        out["mc"] = json!(mc);
        out["quant"] = json!(quant);
        out["env"] = json!({"threads": threads, "others_busy_cores_timed": [busy_step, busy_fwd]});
        Ok(out)
    })
}

/// The unpooled step's (`trainrec bench ec`) least bytes: the forward reads each looked-up row
/// and its id and writes the row out; the update reads the per-id gradient and each id again,
/// and reads and writes each unique row and its optimizer state.
pub fn min_bytes_unpooled(a: &EbcBench, uniq: f64) -> (f64, f64, f64, f64) {
    let (t, b, l, d) = (a.tables as f64, a.batch as f64, a.pooling as f64, a.dim as f64);
    let lookups = t * b * l;
    let uniq_rows = uniq * t;
    let spr = a.optimizer.state_per_row(a.dim) as f64;
    let bytes_fwd = 2.0 * lookups * d * 4.0 + lookups * 8.0;
    let bytes_bwd = uniq_rows * (2.0 * d * 4.0 + 2.0 * 4.0 * spr) + lookups * d * 4.0 + lookups * 8.0;
    (lookups, uniq_rows, bytes_fwd, bytes_bwd)
}

/// Runs the unpooled benchmark (`trainrec bench ec`, the workload of
/// `scripts/anchors/w1_ec_train.py`): one step = the [`EmbeddingCollection`]'s per-id forward of
/// the same tables and ids as W1 + its fused backward/update with a fixed random gradient of
/// every looked-up row.
///
/// [`EmbeddingCollection`]: trainrec_embedding::EmbeddingCollection
pub fn run_ec(a: &EbcBench) -> Result<Value, EmbeddingError> {
    check(a)?;
    if a.mc_interval.is_some() || a.quant {
        return Err(EmbeddingError::Config("bench ec times the plain step: no --mc-interval or --quant".into()));
    }
    let (pool, threads) = thread_pool(a.threads)?;
    pool.install(|| {
        let mut rng = StdRng::seed_from_u64(a.seed);
        tracing::info!("generating {} batches", a.num_batches);
        let (batches, uniq) = make_batches(a, &mut rng);
        let per_table = a.batch * a.pooling * a.dim;
        let grads: Vec<Vec<f32>> =
            (0..a.tables).map(|_| (0..per_table).map(|_| StandardNormal.sample(&mut rng)).collect()).collect();
        let t0 = Instant::now();
        let configs = table_configs(a, PoolingMode::None);
        let mut ec = trainrec_embedding::EmbeddingCollection::new(configs, a.optimizer.clone(), a.seed)?;
        let build_s = t0.elapsed().as_secs_f64();
        let mut it = 0usize;
        // One output kept across steps, as a caller looking up batch after batch keeps it.
        let mut out = ec.forward(&batches[0])?;
        let mut step = |ec: &mut trainrec_embedding::EmbeddingCollection,
                        out: &mut trainrec_embedding::SequenceEmbeddings|
         -> Result<(), EmbeddingError> {
            let kjt = &batches[it % batches.len()];
            it += 1;
            ec.forward_into(kjt, out)?;
            std::hint::black_box(&out.values);
            ec.backward_and_update(kjt, &grads)
        };
        for _ in 0..a.warmup {
            step(&mut ec, &mut out)?;
        }
        let (ts, busy_step) = timed(a.steps, || step(&mut ec, &mut out))?;
        let (fwd, busy_fwd) = timed(a.fwd_steps, || {
            let kjt = &batches[it % batches.len()];
            it += 1;
            ec.forward_into(kjt, &mut out)?;
            std::hint::black_box(&out.values);
            Ok(())
        })?;
        let mut out = results(a, "trainrec", &ts, &fwd, uniq);
        // The unpooled step's bytes, in place of the pooled ones.
        let (_, _, bytes_fwd, bytes_bwd) = min_bytes_unpooled(a, uniq);
        let median = |s: &Value| s["median_s"].as_f64().unwrap_or(f64::NAN);
        out["workload"] = json!("w1_ec_fused_train");
        out["min_bytes_per_step"] = json!(bytes_fwd + bytes_bwd);
        out["implied_GBps_at_median"] = json!((bytes_fwd + bytes_bwd) / median(&out["step"]) / 1e9);
        out["fwd_implied_GBps_at_median"] =
            if fwd.is_empty() { Value::Null } else { json!(bytes_fwd / median(&out["fwd_only"]) / 1e9) };
        out["config"]["threads"] = json!(threads);
        out["build_s"] = json!(build_s);
        out["env"] = json!({"threads": threads, "others_busy_cores_timed": [busy_step, busy_fwd]});
        Ok(out)
    })
}

/// The JSON fields every implementation of the benchmark reports (`impl` names it): its
/// configuration, step and forward-only times, rates, unique rows, and the bandwidth the
/// least bytes per step imply (see [`min_bytes`]).
pub fn results(a: &EbcBench, implementation: &str, ts: &[f64], fwd: &[f64], uniq: f64) -> Value {
    let (lookups, uniq_rows, bytes_fwd, bytes_bwd) = min_bytes(a, uniq);
    let step_s = summarize(ts);
    let median = step_s["median_s"].as_f64().unwrap_or(f64::NAN);
    let fwd_s = (!fwd.is_empty()).then(|| summarize(fwd));
    let fwd_gbps = fwd_s.as_ref().and_then(|f| f["median_s"].as_f64()).map(|m| bytes_fwd / m / 1e9);
    json!({
        "workload": "w1_ebc_fused_train",
        "impl": implementation,
        "config": {
            "tables": a.tables, "rows": a.rows, "dim": a.dim, "pooling": a.pooling, "batch": a.batch,
            "dist": match a.dist { IdDist::Uniform => "uniform", IdDist::Zipf(_) => "zipf" },
            "alpha": match a.dist { IdDist::Zipf(x) => x, IdDist::Uniform => 1.05 },
            "steps": a.steps, "warmup": a.warmup, "fwd_steps": a.fwd_steps, "num_batches": a.num_batches,
            "optimizer": a.optimizer, "seed": a.seed,
        },
        "step": step_s,
        "fwd_only": fwd_s,
        "steps_per_s": rate(ts, 1.0),
        "samples_per_s": rate(ts, a.batch as f64),
        "unique_rows_per_step": uniq_rows,
        "unique_frac": uniq_rows / lookups,
        "min_bytes_per_step": bytes_fwd + bytes_bwd,
        "implied_GBps_at_median": (bytes_fwd + bytes_bwd) / median / 1e9,
        "fwd_implied_GBps_at_median": fwd_gbps,
    })
}

/// The forward pass over the trained tables quantized to int8 row-wise and fp16: per
/// precision the median time of `fwd_steps` calls (interleaved with fp32 calls, so the
/// machine's noise hits all alike), the tables' bytes, and both as ratios to fp32.
fn time_quant(
    a: &EbcBench,
    batches: &[KeyedJaggedTensor],
    ebc: &EmbeddingBagCollection,
) -> Result<Value, EmbeddingError> {
    use trainrec_embedding::quant::{QuantPrecision, QuantizedEbc};
    let fp32_bytes = a.tables as f64 * a.rows as f64 * a.dim as f64 * 4.0;
    let mut out = serde_json::Map::new();
    for (name, precision) in [("int8", QuantPrecision::Int8), ("fp16", QuantPrecision::Fp16)] {
        let q = QuantizedEbc::from_ebc(ebc, precision)?;
        let (mut ts, mut base) = (Vec::with_capacity(a.fwd_steps), Vec::with_capacity(a.fwd_steps));
        for i in 0..a.fwd_steps {
            let kjt = &batches[i % batches.len()];
            let t = Instant::now();
            std::hint::black_box(q.forward(kjt)?.values());
            ts.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            std::hint::black_box(ebc.forward(kjt)?.values());
            base.push(t.elapsed().as_secs_f64());
        }
        let (m, mb) = (median(&ts), median(&base));
        out.insert(
            name.into(),
            json!({
                "fwd": summarize(&ts),
                "fp32_fwd_interleaved": summarize(&base),
                "time_vs_fp32": m / mb,
                "bytes": q.bytes(),
                "bytes_vs_fp32": q.bytes() as f64 / fp32_bytes,
            }),
        );
    }
    Ok(Value::Object(out))
}

/// The managed-collision variant of the step (see [`EbcBench::mc_interval`]): each step copies
/// the batch's raw ids, remaps them table by table (profiling, evicting every `interval`
/// steps and re-initialising the rows that changed hands), then runs the same forward and
/// fused backward. Warms up for two windows first.
fn time_mc(
    a: &EbcBench,
    interval: u64,
    batches: &[KeyedJaggedTensor],
    grad: &[f32],
    ebc: &mut EmbeddingBagCollection,
    plain: &[f64],
) -> Result<Value, EmbeddingError> {
    use trainrec_embedding::mc::{ManagedCollision, McConfig, McEvictionPolicy};
    let config = McConfig {
        rows: a.rows,
        zch_size: a.rows,
        input_hash_size: 1 << 40,
        policy: McEvictionPolicy::Lfu,
        decay_exponent: 1.0,
        eviction_interval: interval,
    };
    let mut modules: Vec<ManagedCollision> = (0..a.tables)
        .map(|_| ManagedCollision::new(config.clone()))
        .collect::<Result<_, _>>()
        .map_err(EmbeddingError::Config)?;
    // Raw ids: a fixed 40-bit hash of (table, row), distinct per row.
    let raw: Vec<KeyedJaggedTensor> = batches
        .iter()
        .map(|k| {
            let mut k = k.clone();
            for (t, ids) in k.values_per_key_mut().into_iter().enumerate() {
                for id in ids {
                    *id = ((*id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((t as u64) << 56)) as i64
                        & ((1 << 40) - 1);
                }
            }
            k
        })
        .collect();
    let mut it = 0usize;
    let mut step = |ebc: &mut EmbeddingBagCollection| -> Result<(f64, f64), EmbeddingError> {
        let t0 = Instant::now();
        let mut kjt = raw[it % raw.len()].clone();
        it += 1;
        // Tables in parallel (each table's module is independent).
        let resets: Vec<(usize, Vec<u64>, u64)> = modules
            .par_iter_mut()
            .zip(kjt.values_per_key_mut())
            .enumerate()
            .map(|(t, (m, ids))| (t, m.train_step(&mut [ids]), m.stats().evictions))
            .filter(|(_, rows, _)| !rows.is_empty())
            .collect();
        for (t, rows, round) in resets {
            ebc.reset_rows(&format!("t{t}"), &rows, a.seed ^ round)?;
        }
        let remap = t0.elapsed().as_secs_f64();
        std::hint::black_box(ebc.forward(&kjt)?.values());
        ebc.backward_and_update(&kjt, grad)?;
        Ok((t0.elapsed().as_secs_f64(), remap))
    };
    for _ in 0..(a.warmup as u64).max(2 * interval) {
        step(ebc)?;
    }
    let (mut ts, mut remaps) = (Vec::with_capacity(a.steps), Vec::with_capacity(a.steps));
    for _ in 0..a.steps {
        let (t, r) = step(ebc)?;
        ts.push(t);
        remaps.push(r);
    }
    let median = |v: &[f64]| summarize(v)["median_s"].as_f64().unwrap_or(f64::NAN);
    let stats: Vec<Value> = modules
        .iter()
        .map(|m| {
            let s = m.stats();
            json!({"collision_rate": s.collision_rate(), "tracked_fraction": s.tracked_fraction(), "evictions": s.evictions})
        })
        .collect();
    Ok(json!({
        "eviction_interval": interval,
        "step": summarize(&ts),
        "remap": summarize(&remaps),
        "samples_per_s": rate(&ts, a.batch as f64),
        "overhead_vs_plain": median(&ts) / median(plain) - 1.0,
        "remap_fraction_of_plain": median(&remaps) / median(plain),
        "tables": stats,
    }))
}
