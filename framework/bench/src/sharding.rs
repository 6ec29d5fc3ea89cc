//! `trainrec bench dist`: where a sharded embedding step's time goes on each rank (input dist,
//! lookup, output dist, gradient dist, fused update) for W2's embedding shape (26 tables of
//! 100,000 x 64, batch 2048 per rank, one id per feature), next to the raw all-to-all of the
//! same bytes on the same process group. One JSON line (rank 0).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use trainrec_embedding::{EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, WeightDecayMode};
use trainrec_planner::ShardingType;
use trainrec_sparse::KeyedJaggedTensor;

use crate::stats::median;
use trainrec_comm::{DistError, ProcessGroup, ReduceOp, ThreadGroup};
use trainrec_sharding::{ShardedEbc, StepTimes, TableSharding};

/// The benchmark's shape.
#[derive(Clone, Debug)]
pub struct DistBench {
    /// Tables (one feature each).
    pub tables: usize,
    /// Rows per table.
    pub rows: u64,
    /// Embedding dim.
    pub dim: usize,
    /// Examples per rank.
    pub batch: usize,
    /// Ids per feature per example.
    pub ids_per_feature: usize,
    /// How every table is sharded: `table_wise` (round robin), `row_wise` or `column_wise`
    /// (over every rank).
    pub sharding: ShardingType,
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Batches generated before timing and cycled.
    pub num_batches: usize,
    /// Seed of ids and gradients.
    pub seed: u64,
    /// Send every batch deduplicated (VBE: distinct bags per feature and inverse indices).
    pub dedup: bool,
}

impl Default for DistBench {
    fn default() -> Self {
        Self {
            tables: 26,
            rows: 100_000,
            dim: 64,
            batch: 2048,
            ids_per_feature: 1,
            sharding: ShardingType::TableWise,
            steps: 20,
            warmup: 3,
            num_batches: 4,
            seed: 0,
            dedup: false,
        }
    }
}

fn ms(x: f64) -> f64 {
    (x * 1e5).round() / 100.0
}

/// Runs the benchmark on this rank of `pg` (every rank calls it); rank 0 gets the JSON line.
pub fn run_rank(b: &DistBench, pg: Arc<dyn ProcessGroup>) -> Result<Option<String>, DistError> {
    let (world, me) = (pg.world_size(), pg.rank());
    if !matches!(b.sharding, ShardingType::TableWise | ShardingType::RowWise | ShardingType::ColumnWise) {
        return Err(DistError::Module(format!(
            "bench dist shards by table_wise, row_wise or column_wise, not {:?}",
            b.sharding
        )));
    }
    let keys: Vec<String> = (0..b.tables).map(|i| format!("cat_{i}")).collect();
    let tables: Vec<EmbeddingBagConfig> = keys
        .iter()
        .map(|k| EmbeddingBagConfig::new(format!("t_{k}"), b.rows, b.dim, PoolingMode::Sum, &[k.as_str()]))
        .collect();
    let all: Vec<usize> = (0..world).collect();
    let shardings = (0..b.tables)
        .map(|i| match b.sharding {
            ShardingType::RowWise => TableSharding::row_wise(b.rows, b.dim, &all),
            ShardingType::ColumnWise => TableSharding::column_wise(b.rows, b.dim, b.dim.div_ceil(world), &all),
            _ => TableSharding::table_wise(b.rows, b.dim, i % world),
        })
        .collect();
    let opt = SparseOptimizerConfig::RowwiseAdagrad {
        lr: 0.01,
        eps: 1e-8,
        weight_decay: 0.0,
        weight_decay_mode: WeightDecayMode::None,
    };
    let mut ebc = ShardedEbc::new(tables, shardings, opt, b.seed, pg.clone())?;
    let mut rng = StdRng::seed_from_u64(b.seed ^ (me as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let n = b.batch * b.tables * b.ids_per_feature;
    let batches: Vec<KeyedJaggedTensor> = (0..b.num_batches.max(1))
        .map(|_| {
            let values: Vec<i64> = (0..n).map(|_| rng.random_range(0..b.rows as i64)).collect();
            let lengths = vec![b.ids_per_feature as u32; b.batch * b.tables];
            let k = KeyedJaggedTensor::new(keys.clone(), values, None, lengths, b.batch);
            let k = if b.dedup { k.and_then(|k| k.dedup()) } else { k };
            k.map_err(|e| DistError::Module(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    // Distinct bags sent per example (1 without dedup).
    let bag_fraction = batches
        .iter()
        .map(|k| k.stride_per_key().iter().sum::<usize>() as f64 / (b.tables * b.batch).max(1) as f64)
        .sum::<f64>()
        / batches.len() as f64;
    let grad: Vec<f32> = (0..b.batch * ebc.width()).map(|_| rng.random_range(-0.01f32..0.01)).collect();
    let mut steps: Vec<(StepTimes, f64)> = Vec::with_capacity(b.steps);
    for i in 0..b.warmup + b.steps {
        let start = Instant::now();
        let (_, ctx) = ebc.forward(&batches[i % batches.len()])?;
        let t = ebc.backward_and_update(ctx, &grad)?;
        if i >= b.warmup {
            steps.push((t, start.elapsed().as_secs_f64()));
        }
    }
    let last = steps.last().map(|s| s.0).unwrap_or_default();

    // The raw all-to-all of the same bytes per step (spread evenly over the destinations).
    let raw = |bytes: usize| -> Result<f64, DistError> {
        let per = bytes / world;
        let send = vec![1u8; per * world];
        let counts = vec![per; world];
        let mut t = Vec::with_capacity(b.steps);
        for i in 0..b.warmup + b.steps {
            let start = Instant::now();
            pg.all_to_all_v_bytes(&send, &counts, &counts)?;
            if i >= b.warmup {
                t.push(start.elapsed().as_secs_f64());
            }
        }
        Ok(median(&t))
    };
    // Every rank must send the same counts: the largest rank's bytes.
    let mut bytes = vec![last.input_bytes as f64, last.output_bytes as f64];
    pg.all_reduce_f64(&mut bytes, ReduceOp::Max)?;
    let raw_input = raw(bytes[0] as usize)?;
    let raw_output = raw(bytes[1] as usize)?;

    // The slowest rank's median of each phase.
    let pick = |f: fn(&StepTimes) -> f64| median(&steps.iter().map(|s| f(&s.0)).collect::<Vec<_>>());
    let mut v = vec![
        pick(|t| t.input_dist),
        pick(|t| t.lookup),
        pick(|t| t.output_dist),
        pick(|t| t.grad_dist),
        pick(|t| t.update),
        median(&steps.iter().map(|s| s.1).collect::<Vec<_>>()),
        raw_input,
        raw_output,
        last.input_bytes as f64,
        last.output_bytes as f64,
        bag_fraction,
    ];
    pg.all_reduce_f64(&mut v, ReduceOp::Max)?;
    if me != 0 {
        return Ok(None);
    }
    Ok(Some(
        json!({
            "bench": "dist",
            "backend": pg.backend(),
            "world_size": world,
            "sharding": b.sharding.name(),
            "tables": b.tables, "rows": b.rows, "dim": b.dim, "batch_per_rank": b.batch,
            "ids_per_feature": b.ids_per_feature, "steps": b.steps, "dedup": b.dedup,
            "distinct_bags_per_example": (v[10] * 1000.0).round() / 1000.0,
            "ms_per_step": {
                "input_dist": ms(v[0]), "lookup": ms(v[1]), "output_dist": ms(v[2]),
                "grad_dist": ms(v[3]), "update": ms(v[4]), "total": ms(v[5]),
            },
            "bytes_sent_per_rank": { "input_dist": v[8] as u64, "output_dist": v[9] as u64 },
            "raw_all_to_all_ms": { "input_bytes": ms(v[6]), "output_bytes": ms(v[7]) },
            "dist_over_raw": {
                "input": (v[0] / v[6].max(1e-9) * 100.0).round() / 100.0,
                "output": (v[2] / v[7].max(1e-9) * 100.0).round() / 100.0,
            },
            "note": "ms are the slowest rank's medians; raw_all_to_all is one all-to-all of the largest rank's bytes, spread evenly over the ranks",
        })
        .to_string(),
    ))
}

/// [`run_rank`] on `world` ranks of the thread backend.
pub fn run_threads(b: &DistBench, world: usize) -> Result<String, DistError> {
    let out = ThreadGroup::run(world, Duration::from_secs(300), |pg| run_rank(b, Arc::new(pg)));
    let mut line = None;
    for (r, res) in out.into_iter().enumerate() {
        match res {
            Ok(Ok(Some(l))) => line = Some(l),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Err(e),
            Err(p) => return Err(DistError::Module(format!("rank {r} panicked: {p}"))),
        }
    }
    line.ok_or_else(|| DistError::Module("rank 0 reported nothing".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_bench_reports_every_phase() {
        for (sharding, dedup) in [
            (ShardingType::TableWise, false),
            (ShardingType::RowWise, false),
            (ShardingType::ColumnWise, false),
            (ShardingType::RowWise, true),
        ] {
            let b = DistBench {
                tables: 3,
                rows: 50,
                dim: 8,
                batch: 16,
                steps: 2,
                warmup: 1,
                sharding,
                dedup,
                ..Default::default()
            };
            let v: serde_json::Value = serde_json::from_str(&run_threads(&b, 2).unwrap()).unwrap();
            assert_eq!(v["world_size"], 2);
            assert_eq!(v["backend"], "threads");
            for k in ["input_dist", "lookup", "output_dist", "grad_dist", "update", "total"] {
                assert!(v["ms_per_step"][k].as_f64().unwrap() >= 0.0, "{k}: {v}");
            }
            // Output dist bytes: every local pooled float, 16 examples x 2 ranks x the rank's width.
            assert!(v["bytes_sent_per_rank"]["output_dist"].as_u64().unwrap() > 0, "{v}");
            // 16 ids from 50 rows: deduplicated, fewer distinct bags than examples.
            let fraction = v["distinct_bags_per_example"].as_f64().unwrap();
            assert!(if dedup { fraction < 1.0 } else { fraction == 1.0 }, "{v}");
        }
    }
}
