//! The engine conformance kit: any [`EmbeddingEngine`] trained side by side with the CPU
//! collection ([`EmbeddingBagCollection`]) on the same batches and gradients must give the
//! same pooled outputs, the same tables and optimizer state after every update, the same
//! checkpoint blocks, and the same rows after a reset. A new backend implements the trait and
//! passes [`check_engine`] on every [`cases`] case; the CPU collection, the sharded collection
//! and the CUDA collection (on its emulator) run it in their tests.
//!
//! What the cases vary: every fused optimizer, sum and mean pooling, a table read by two
//! features, per-id weights, a cached table (rows prefetched ahead of their step, or not),
//! deduplicated (variable-batch) batches, and staged batches that are discarded untrained.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_sparse::KeyedJaggedTensor;

use crate::engine::{BatchContext, DeviceSlice, EmbeddingEngine, Memory, Pooled, PooledGrad};
use crate::{
    CacheBacking, CacheConfig, CachePolicy, EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode,
    SparseOptimizerConfig, WeightDecayMode,
};

/// Steps of each case.
pub const STEPS: usize = 6;

/// Examples per batch.
pub const BATCH: usize = 9;

/// The input features, in KJT key order, and the rows of the table each reads.
pub const FEATURES: [(&str, u64); 4] = [("fa", 13), ("fb", 40), ("fc", 40), ("fd", 21)];

/// One case of the kit.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// The fused optimizer.
    pub optimizer: SparseOptimizerConfig,
    /// Mean pooling on tables a and b (c always sums).
    pub mean: bool,
    /// Per-id weights in the batches.
    pub weighted: bool,
    /// Table b is cached (a few slots in front of a file under the temp directory).
    pub cached: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} mean={} weighted={} cached={}", self.optimizer, self.mean, self.weighted, self.cached)
    }
}

/// Every fused optimizer, pooling, weighting and caching varied across them.
pub fn cases() -> Vec<Case> {
    use SparseOptimizerConfig as O;
    let optimizers = [
        O::Sgd { lr: 0.3 },
        O::Adagrad { lr: 0.2, eps: 1e-6 },
        O::RowwiseAdagrad { lr: 0.2, eps: 1e-8, weight_decay: 0.05, weight_decay_mode: WeightDecayMode::L2 },
        O::Adam { lr: 0.05, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.01 },
        O::PartialRowwiseAdam { lr: 0.05, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.01 },
        O::Lamb { lr: 0.05, eps: 1e-6, beta1: 0.9, beta2: 0.999, weight_decay: 0.01 },
    ];
    optimizers
        .into_iter()
        .enumerate()
        .map(|(i, optimizer)| Case { optimizer, mean: i % 2 == 0, weighted: i % 3 != 1, cached: i % 2 == 1 })
        .collect()
}

/// The case's tables: a (13 x 8), b (40 x 24, features fb and fc; cached with 32 slots when
/// the case says so), c (21 x 16, sum pooled).
pub fn tables(case: &Case) -> Vec<EmbeddingBagConfig> {
    let pooling = if case.mean { PoolingMode::Mean } else { PoolingMode::Sum };
    let mut b = EmbeddingBagConfig::new("b", 40, 24, pooling, &["fb", "fc"]);
    if case.cached {
        b.cache = Some(CacheConfig {
            slots: 32,
            policy: CachePolicy::Lru,
            backing: CacheBacking::Rows,
            dir: std::env::temp_dir(),
        });
    }
    vec![
        EmbeddingBagConfig::new("a", 13, 8, pooling, &["fa"]),
        b,
        EmbeddingBagConfig::new("c", 21, 16, PoolingMode::Sum, &["fd"]),
    ]
}

/// The case's CPU collection (seed 11): the reference, and what engines are built from.
pub fn collection(case: &Case) -> Result<EmbeddingBagCollection, String> {
    EmbeddingBagCollection::new(tables(case), case.optimizer.clone(), 11).map_err(|e| e.to_string())
}

/// Step `step`'s batch: 0 to 4 ids per bag, mostly among each table's first rows (duplicates
/// within and across bags, empty bags); odd steps deduplicated into a variable-batch KJT.
pub fn batch(rng: &mut StdRng, case: &Case, step: usize) -> KeyedJaggedTensor {
    let mut values = Vec::new();
    let mut lengths = Vec::new();
    for (_, rows) in FEATURES {
        for example in 0..BATCH {
            // Repeated bags, so that deduplication finds some.
            let len = if example % 3 == 2 { lengths[lengths.len() - 1] } else { rng.random_range(0..5u32) };
            lengths.push(len);
            for _ in 0..len {
                let id =
                    if rng.random_bool(0.7) { rng.random_range(0..rows.min(7)) } else { rng.random_range(0..rows) };
                values.push(id as i64);
            }
        }
    }
    let weights = case.weighted.then(|| values.iter().map(|_| rng.random_range(-1.5f32..2.0)).collect());
    let kjt =
        KeyedJaggedTensor::new(FEATURES.iter().map(|f| f.0.to_string()).collect(), values, weights, lengths, BATCH)
            .expect("the kit's batches are well formed");
    if !step.is_multiple_of(2) { kjt.dedup().expect("a well-formed batch deduplicates") } else { kjt }
}

/// What differed, located.
pub type Mismatch = String;

/// Builds an engine from a CPU collection (same tables, weights and optimizer state).
pub type MakeEngine<'a> = &'a mut dyn FnMut(&EmbeddingBagCollection) -> Result<Box<dyn EmbeddingEngine>, String>;

/// Trains `make`'s engine and the CPU collection side by side on case `case` for [`STEPS`]
/// steps and checks they agree, values within `tol` (0: bit for bit):
///
/// 1. each step's batch staged (prefetching on even steps), then pooled outputs equal;
/// 2. after each fused update, every table's weights equal, and the blocks of
///    [`EmbeddingEngine::local_shards`] equal the reference's (weights, optimizer state,
///    steps) where they cover whole tables;
/// 3. a batch staged with prefetch and then discarded changes nothing, and a learning-rate
///    multiplier (from step 3) scales the updates alike;
/// 4. an engine built from the reference's initial state and loaded with the trained blocks
///    gives the trained engine's outputs;
/// 5. rows reset on both sides with the same key are equal again.
pub fn check_engine(case: &Case, make: MakeEngine<'_>, tol: f32) -> Result<(), Mismatch> {
    let mut reference = collection(case)?;
    let initial = collection(case)?;
    let mut engine = make(&reference)?;
    let at = |what: &str, step: usize| format!("case {case}, step {step}: {what}");
    if engine.output_keys() != reference.output_keys() || engine.width() != reference.width() {
        return Err(format!(
            "case {case}: the engine's outputs {:?} (width {}) differ from the CPU collection's {:?} (width {})",
            engine.output_keys(),
            engine.width(),
            reference.output_keys(),
            reference.width()
        ));
    }
    let width = reference.width();
    let mut rng = StdRng::seed_from_u64(5);
    for step in 0..STEPS {
        let kjt = batch(&mut rng, case, step);
        let full = kjt.full_batch().map_err(|e| e.to_string())?.into_owned();
        let mut want = vec![0f32; BATCH * width];
        reference.forward_into(&full, &mut want).map_err(|e| at(&e.to_string(), step))?;

        // A batch staged with prefetch, then discarded untrained, changes nothing.
        if step == 2 {
            engine.stage(&kjt, &[], true).map_err(|e| at(&format!("stage: {e}"), step))?;
            engine.discard_prefetched();
        }
        let mut ctx = engine.stage(&kjt, &[], step.is_multiple_of(2)).map_err(|e| at(&format!("stage: {e}"), step))?;
        let got = forward(engine.as_ref(), &kjt, &mut ctx, step).map_err(|e| at(&format!("forward: {e}"), step))?;
        compare(&got, &want, tol).map_err(|e| at(&format!("pooled output {e}"), step))?;

        // A learning-rate schedule's multiplier from step 3 on.
        if step == 3 {
            reference.set_lr_multiplier(0.37);
            engine.set_lr_multiplier(0.37);
        }
        let grad: Vec<f32> = (0..BATCH * width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        reference.backward_and_update(&full, &grad).map_err(|e| at(&e.to_string(), step))?;
        engine
            .backward_and_update(&kjt, &mut ctx, grad_buffer(engine.memory(), &grad, step))
            .map_err(|e| at(&format!("backward: {e}"), step))?;
        compare_state(engine.as_ref(), &reference, tol).map_err(|e| at(&e, step))?;
    }

    // Checkpoint blocks restore into an engine built from the initial state.
    let mut restored = make(&initial)?;
    restored.load_local_shards(engine.local_shards()).map_err(|e| format!("case {case}: load_local_shards: {e}"))?;
    compare_state(restored.as_ref(), &reference, tol).map_err(|e| format!("case {case}: restored engine: {e}"))?;
    let kjt = batch(&mut rng, case, 0);
    let mut c1 = BatchContext::default();
    let mut c2 = BatchContext::default();
    let a = forward(engine.as_ref(), &kjt, &mut c1, 0)?;
    let b = forward(restored.as_ref(), &kjt, &mut c2, 1)?;
    compare(&b, &a, 0.0).map_err(|e| format!("case {case}: the restored engine's output {e}"))?;

    // Rows reset with the same key.
    for (table, rows) in [("a", vec![0u64, 5]), ("b", vec![1, 2, 39])] {
        reference.reset_rows(table, &rows, 77).map_err(|e| e.to_string())?;
        engine.reset_rows(table, &rows, 77).map_err(|e| format!("case {case}: reset_rows: {e}"))?;
    }
    compare_state(engine.as_ref(), &reference, tol).map_err(|e| format!("case {case}: after reset_rows: {e}"))
}

/// The engine's pooled output of `kjt` on the host; an emulated device gets a device buffer
/// (at a host address) on even `step`s, a host buffer on odd ones.
fn forward(
    engine: &dyn EmbeddingEngine,
    kjt: &KeyedJaggedTensor,
    ctx: &mut BatchContext,
    step: usize,
) -> Result<Vec<f32>, String> {
    let mut out = vec![0f32; kjt.full_batch().map_err(|e| e.to_string())?.stride() * engine.width()];
    let buf = match engine.memory() {
        // SAFETY: `out` is a live host buffer of `out.len()` floats that nothing else uses
        // until this call returns; the emulator's work is done when its calls return.
        Memory::Emulated if step.is_multiple_of(2) => {
            Pooled::Device(unsafe { DeviceSlice::new(out.as_mut_ptr() as u64, out.len()) })
        }
        _ => Pooled::Host(&mut out),
    };
    engine.forward_into(kjt, ctx, buf).map_err(|e| e.to_string())?;
    Ok(out)
}

/// The gradient as the engine takes it (see [`forward`]).
fn grad_buffer(memory: Memory, grad: &[f32], step: usize) -> PooledGrad<'_> {
    match memory {
        // SAFETY: `grad` is a live host buffer that outlives the backward it is handed to,
        // read only; the emulator's work is done when its calls return.
        Memory::Emulated if step.is_multiple_of(2) => {
            PooledGrad::Device(unsafe { DeviceSlice::new(grad.as_ptr() as u64, grad.len()) })
        }
        _ => PooledGrad::Host(grad),
    }
}

/// Every table's weights, and the engine's whole-table blocks' state, against the reference.
fn compare_state(engine: &dyn EmbeddingEngine, reference: &EmbeddingBagCollection, tol: f32) -> Result<(), String> {
    for t in reference.table_configs() {
        let want = reference.table_weights(&t.name).unwrap_or_default();
        let got = engine.table_weights(&t.name).map_err(|e| e.to_string())?;
        let got = got.ok_or_else(|| format!("the engine has no table \"{}\"", t.name))?;
        compare(&got, &want, tol).map_err(|e| format!("table \"{}\" weights {e}", t.name))?;
    }
    for block in engine.local_shards() {
        let Some(t) = reference.table_configs().find(|t| t.name == block.table) else {
            return Err(format!("the engine holds a block of table \"{}\", which the reference lacks", block.table));
        };
        if block.rows != (0..t.rows) || block.cols != (0..t.dim) {
            // A block of a table (a shard): its weights were compared whole above.
            continue;
        }
        let state = reference.optimizer_state(&t.name).unwrap_or_default();
        compare(&block.optimizer_state, &state, tol)
            .map_err(|e| format!("table \"{}\" optimizer state {e}", t.name))?;
        let steps = reference.step_count(&t.name).unwrap_or(0);
        if block.step_count != steps {
            return Err(format!("table \"{}\": {} optimizer steps, the reference {steps}", t.name, block.step_count));
        }
        let weights = reference.table_weights(&t.name).unwrap_or_default();
        compare(&block.weights, &weights, tol).map_err(|e| format!("table \"{}\" checkpoint block {e}", t.name))?;
    }
    Ok(())
}

/// `got` against `want`: the same length, each value within `tol` (0: the same bits).
fn compare(got: &[f32], want: &[f32], tol: f32) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("has {} values, the CPU collection {}", got.len(), want.len()));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = if tol == 0.0 { g.to_bits() == w.to_bits() } else { (g - w).abs() <= tol * w.abs().max(1.0) };
        if !same {
            return Err(format!("differs at {i}: {g} against the CPU collection's {w} (tolerance {tol})"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU collection passes against itself, and a defective engine fails.
    #[test]
    fn the_cpu_collection_conforms_and_a_broken_engine_does_not() {
        for case in cases() {
            check_engine(&case, &mut |cpu| Ok(Box::new(copy(&case, cpu)) as Box<dyn EmbeddingEngine>), 0.0)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let case = &cases()[1];
        let err = check_engine(case, &mut |cpu| Ok(Box::new(Skewed(copy(case, cpu))) as Box<dyn EmbeddingEngine>), 0.0)
            .expect_err("an engine whose outputs are off must fail");
        assert!(err.contains("pooled output differs"), "{err}");
    }

    /// A new collection of `case` holding `cpu`'s state.
    fn copy(case: &Case, cpu: &EmbeddingBagCollection) -> EmbeddingBagCollection {
        let mut e = collection(case).expect("valid tables");
        crate::engine::load_whole_tables(&mut e, crate::engine::whole_table_shards(cpu)).expect("same tables");
        e
    }

    /// The CPU collection with every output off by a little.
    struct Skewed(EmbeddingBagCollection);

    impl crate::EmbeddingLookup for Skewed {
        fn output_keys(&self) -> Vec<String> {
            self.0.output_keys()
        }
        fn width(&self) -> usize {
            self.0.width()
        }
        fn forward_into(
            &self,
            kjt: &KeyedJaggedTensor,
            ctx: &mut BatchContext,
            out: Pooled<'_>,
        ) -> Result<(), crate::EmbeddingError> {
            let Pooled::Host(out) = out else { unreachable!("host memory") };
            crate::EmbeddingLookup::forward_into(&self.0, kjt, ctx, Pooled::Host(out))?;
            out.iter_mut().for_each(|v| *v += 1e-3);
            Ok(())
        }
        fn table_weights(&self, name: &str) -> Result<Option<Vec<f32>>, crate::EmbeddingError> {
            crate::EmbeddingLookup::table_weights(&self.0, name)
        }
    }

    impl EmbeddingEngine for Skewed {
        fn cache_placements(&self) -> Vec<(String, crate::CachePlacement)> {
            EmbeddingEngine::cache_placements(&self.0)
        }
        fn stage(
            &mut self,
            kjt: &KeyedJaggedTensor,
            parts: &[&[u8]],
            prefetch: bool,
        ) -> Result<BatchContext, crate::EmbeddingError> {
            self.0.stage(kjt, parts, prefetch)
        }
        fn backward_and_update(
            &mut self,
            kjt: &KeyedJaggedTensor,
            ctx: &mut BatchContext,
            grad: PooledGrad<'_>,
        ) -> Result<(), crate::EmbeddingError> {
            EmbeddingEngine::backward_and_update(&mut self.0, kjt, ctx, grad)
        }
        fn discard_prefetched(&mut self) {
            EmbeddingEngine::discard_prefetched(&mut self.0);
        }
        fn set_lr_multiplier(&mut self, multiplier: f64) {
            EmbeddingEngine::set_lr_multiplier(&mut self.0, multiplier);
        }
        fn cache_stats(&self) -> Vec<(String, crate::CacheStats)> {
            EmbeddingEngine::cache_stats(&self.0)
        }
        fn local_shards(&self) -> Vec<crate::LocalShard> {
            self.0.local_shards()
        }
        fn load_local_shards(&mut self, shards: Vec<crate::LocalShard>) -> Result<(), crate::EmbeddingError> {
            self.0.load_local_shards(shards)
        }
        fn reset_rows(&mut self, name: &str, rows: &[u64], key: u64) -> Result<(), crate::EmbeddingError> {
            EmbeddingEngine::reset_rows(&mut self.0, name, rows, key)
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }
}
