//! The CUDA kernels and `CudaEbc` itself (uploads, launches, occurrence lists, step counts,
//! table I/O) on the emulator backend, where the kernels run compiled as host C++: the device
//! check's cases, checkpoints' table round trip, sequence lookups and bounds errors, cached
//! tables, and the engine conformance kit, against the CPU collection. Needs feature `emulator`, which
//! `cargo test --workspace` turns on through the engine's tests.
#![cfg(feature = "emulator")]

use trainrec_cuda::{CudaEbc, check};
use trainrec_embedding::{BoundsCheckMode, SparseOptimizerConfig, WeightPrecision};

#[test]
fn the_device_checks_cases_are_bit_identical_on_the_emulator() {
    let r = check::run_with(CudaEbc::emulated).unwrap();
    assert_eq!(r["total"], 24, "{r}");
    // Forward outputs, sequence lookups, weights, optimizer states and step counts after each
    // of the 3 steps, bit for bit; the rows of the differing cases show their largest errors.
    let differing: Vec<&serde_json::Value> =
        r["cases"].as_array().unwrap().iter().filter(|c| c["bit_identical"] != true).collect();
    assert!(differing.is_empty(), "cases that differ from the CPU engine: {differing:#?}");
    assert_eq!(r["bit_identical"], 24);
}

/// The engine conformance kit: the CUDA collection as an engine (its stage, device and host
/// buffers, checkpoint blocks, resets) trains bit for bit like the CPU collection.
#[test]
fn the_cuda_engine_passes_the_engine_conformance_kit() {
    use trainrec_embedding::{EmbeddingEngine, conformance};
    for case in conformance::cases() {
        let mut make = |cpu: &trainrec_embedding::EmbeddingBagCollection| {
            CudaEbc::emulated(cpu).map(|g| Box::new(g) as Box<dyn EmbeddingEngine>).map_err(|e| e.to_string())
        };
        conformance::check_engine(&case, &mut make, 0.0).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn gathers_copy_rows_and_read_row_zero_for_bad_ids() {
    for precision in [WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16] {
        let c = check::Case {
            optimizer: SparseOptimizerConfig::Sgd { lr: 0.1 },
            precision,
            mean: false,
            weighted: false,
            stochastic: false,
        };
        let cpu = check::collection(&c);
        let mut gpu = CudaEbc::emulated(&cpu).unwrap();
        gpu.set_bounds_check(BoundsCheckMode::Ignore);
        let w = cpu.table_weights("c").unwrap();
        let ids = [3i64, 16, 3, -1, 17, 0, 5];
        let out = gpu.download(&gpu.lookup_rows("c", &ids).unwrap()).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let r = if (0..17).contains(&id) { id as usize } else { 0 };
            assert_eq!(out[i * 70..][..70], w[r * 70..][..70], "{precision:?}: id {id}");
        }
    }
}

fn case(precision: WeightPrecision) -> check::Case {
    check::Case {
        optimizer: SparseOptimizerConfig::Adam { lr: 0.05, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.0 },
        precision,
        mean: true,
        weighted: true,
        stochastic: true,
    }
}

#[test]
fn tables_round_trip_through_load_table_and_write_back() {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut cpu = check::collection(&case(WeightPrecision::Bf16));
    let mut gpu = CudaEbc::emulated(&cpu).unwrap();
    gpu.set_bounds_check(BoundsCheckMode::Ignore);
    // Two steps on the emulator, then its tables into a fresh CPU collection: the same as
    // two steps on the CPU.
    for step in 0..2 {
        let kjt = check::batch(&mut rng, true, step);
        let grad = check::gradient(&mut rng, &kjt, cpu.width());
        cpu.backward_and_update(&kjt, &grad).unwrap();
        gpu.backward_and_update(&kjt, &gpu.upload(&grad).unwrap()).unwrap();
    }
    let mut back = check::collection(&case(WeightPrecision::Bf16));
    gpu.write_back(&mut back).unwrap();
    for t in ["a", "b", "c"] {
        assert_eq!(back.table_weights(t), cpu.table_weights(t), "{t}");
        assert_eq!(back.optimizer_state(t), cpu.optimizer_state(t), "{t}");
        assert_eq!(back.step_count(t), Some(2));
    }
    // And back: a fresh emulated collection loaded from the CPU one's tables.
    let mut fresh = CudaEbc::emulated(&check::collection(&case(WeightPrecision::Bf16))).unwrap();
    for t in ["a", "b", "c"] {
        let (w, s) = (cpu.table_weights(t).unwrap(), cpu.optimizer_state(t).unwrap());
        fresh.load_table(t, &w, &s, 2).unwrap();
        assert_eq!(fresh.table_weights(t).unwrap(), w);
        assert_eq!(fresh.optimizer_state(t).unwrap(), s);
        assert_eq!(fresh.step_count(t).unwrap(), 2);
    }
    let e = fresh.load_table("a", &[0.0; 3], &[], 0).unwrap_err().to_string();
    assert!(e.contains("\"a\"") && e.contains("3 weights") && e.contains("expected 88"), "{e}");
}

#[test]
fn sequence_lookups_and_bounds_errors_match_the_cpu_collection() {
    let cpu = check::collection(&case(WeightPrecision::Fp16));
    let mut gpu = CudaEbc::emulated(&cpu).unwrap();
    let w = cpu.table_weights("c").unwrap();
    let ids = [4i64, 0, 16, 4];
    let rows = gpu.download(&gpu.lookup_rows("c", &ids).unwrap()).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(rows[i * 70..][..70], w[id as usize * 70..][..70], "id {id}");
    }
    let e = gpu.lookup_rows("c", &[3, 17]).err().unwrap().to_string();
    assert!(e.contains("id 17") && e.contains("\"c\""), "{e}");
    // The forward's bounds error is the CPU collection's.
    let mut kjt = check::batch(&mut rand::SeedableRng::seed_from_u64(1), false, 0);
    kjt.values_per_key_mut()[1][0] = 30;
    let mut strict = check::collection(&case(WeightPrecision::Fp16));
    strict.set_bounds_check(BoundsCheckMode::Fatal);
    let want = strict.forward(&kjt).unwrap_err().to_string();
    gpu.set_bounds_check(BoundsCheckMode::Fatal);
    let got = gpu.forward(&kjt).err().unwrap().to_string();
    assert_eq!(got, want);
}

/// The check's tables with every table cached in `slots` slots (`policy`), on the CPU
/// collection's cached kernel (so both draw initial weights the same way).
fn cached_collection(
    case: &check::Case,
    slots: u64,
    policy: trainrec_embedding::CachePolicy,
    backing: trainrec_embedding::CacheBacking,
    dir: &std::path::Path,
) -> trainrec_embedding::EmbeddingBagCollection {
    use trainrec_embedding::{CacheConfig, EmbeddingBagCollection};
    let plain = check::collection(case);
    let tables = plain
        .table_configs()
        .map(|c| {
            let slots = slots.min(c.rows);
            c.clone().with_cache(CacheConfig { slots, policy, backing, dir: dir.to_path_buf() })
        })
        .collect();
    let mut ebc = EmbeddingBagCollection::new(tables, case.optimizer.clone(), 7).unwrap();
    ebc.set_bounds_check(BoundsCheckMode::Ignore);
    ebc
}

#[test]
fn cached_tables_in_gpu_memory_train_like_tables_in_memory() {
    use rand::SeedableRng;
    use trainrec_embedding::{CacheBacking, CachePolicy};
    let dir = std::env::temp_dir().join(format!("trainrec-cuda-cache-{}", std::process::id()));
    let rowwise = SparseOptimizerConfig::RowwiseAdagrad {
        lr: 0.2,
        eps: 1e-8,
        weight_decay: 0.0,
        weight_decay_mode: trainrec_embedding::WeightDecayMode::None,
    };
    for (precision, policy, optimizer, backing) in [
        (WeightPrecision::Fp32, CachePolicy::Lru, rowwise.clone(), CacheBacking::Rows),
        (WeightPrecision::Fp32, CachePolicy::Lfu, case(WeightPrecision::Fp32).optimizer, CacheBacking::Rows),
        (WeightPrecision::Fp16, CachePolicy::Lru, rowwise.clone(), CacheBacking::Rows),
        (WeightPrecision::Bf16, CachePolicy::Lru, rowwise, CacheBacking::KeyValue),
    ] {
        // Round to nearest: stochastic rounding draws per slot, so only that differs.
        let case = check::Case { optimizer, precision, mean: true, weighted: true, stochastic: false };
        let what = format!("{precision:?} {policy:?} {backing:?} {:?}", case.optimizer);
        let mut plain = check::collection(&case);
        // 26 slots: table b (30 rows, two features) evicts and writes back rows as batches
        // move over it; a and c fit whole.
        let mut gpu = CudaEbc::emulated(&cached_collection(&case, 26, policy, backing, &dir)).unwrap();
        gpu.set_bounds_check(BoundsCheckMode::Ignore);
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for step in 0..6 {
            let kjt = check::batch(&mut rng, true, step % check::STEPS);
            let want = plain.forward(&kjt).unwrap();
            let got = gpu.download(&gpu.forward(&kjt).unwrap()).unwrap();
            assert_eq!(&got[..want.values().len()], want.values(), "{what}: forward of step {step}");
            let grad = check::gradient(&mut rng, &kjt, plain.width());
            plain.backward_and_update(&kjt, &grad).unwrap();
            gpu.backward_and_update(&kjt, &gpu.upload(&grad).unwrap()).unwrap();
            for t in ["a", "b", "c"] {
                assert_eq!(
                    gpu.table_weights(t).unwrap(),
                    plain.table_weights(t).unwrap(),
                    "{what}: {t} after step {step}"
                );
                assert_eq!(gpu.optimizer_state(t).unwrap(), plain.optimizer_state(t).unwrap(), "{what}: {t}");
            }
        }
        let s = gpu.cache_stats("b").unwrap();
        assert!(s.evictions > 0 && s.writebacks > 0 && s.misses > 0 && s.hits > 0, "{what}: {s:?}");
        // A whole table written into the cached collection (checkpoint restore) reads back.
        let w: Vec<f32> = (0..30 * 40).map(|i| (i % 7) as f32 * 0.25).collect();
        let st = plain.optimizer_state("b").unwrap();
        gpu.load_table("b", &w, &st, 9).unwrap();
        assert_eq!(gpu.table_weights("b").unwrap(), w, "{what}");
        assert_eq!(gpu.optimizer_state("b").unwrap(), st, "{what}");
        let rows = gpu.download(&gpu.lookup_rows("b", &[29, 0, 29]).unwrap()).unwrap();
        assert_eq!(rows[..40], w[29 * 40..30 * 40], "{what}");
    }
    // The prefetch pipeline's stage: batch i+1's rows pinned ahead, its update uses those pins.
    let case2 = check::Case { stochastic: false, ..case(WeightPrecision::Fp32) };
    let mut plain = check::collection(&case2);
    let mut gpu =
        CudaEbc::emulated(&cached_collection(&case2, 26, CachePolicy::Lfu, CacheBacking::KeyValue, &dir)).unwrap();
    gpu.set_bounds_check(BoundsCheckMode::Ignore);
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let batches: Vec<_> = (0..3).map(|s| check::batch(&mut rng, true, s)).collect();
    gpu.prefetch(&batches[0]).unwrap();
    for (i, kjt) in batches.iter().enumerate() {
        assert_eq!(gpu.prefetched(), 1);
        let grad = check::gradient(&mut rng, kjt, plain.width());
        let got = gpu.download(&gpu.forward(kjt).unwrap()).unwrap();
        assert_eq!(&got[..], plain.forward(kjt).unwrap().values(), "batch {i}");
        if let Some(next) = batches.get(i + 1) {
            gpu.prefetch(next).unwrap();
        }
        plain.backward_and_update(kjt, &grad).unwrap();
        gpu.backward_and_update(kjt, &gpu.upload(&grad).unwrap()).unwrap();
        assert_eq!(gpu.table_weights("b").unwrap(), plain.table_weights("b").unwrap(), "batch {i}");
    }
    assert_eq!(gpu.prefetched(), 0);
    gpu.prefetch(&batches[0]).unwrap();
    gpu.discard_prefetched();
    assert_eq!(gpu.prefetched(), 0);

    // A batch with more distinct rows than the cache has slots: its lookup reads them without
    // caching them (an eval batch); its update is an error naming the table.
    let case = check::Case { stochastic: false, ..case(WeightPrecision::Fp32) };
    let mut gpu =
        CudaEbc::emulated(&cached_collection(&case, 2, CachePolicy::Lru, trainrec_embedding::CacheBacking::Rows, &dir))
            .unwrap();
    gpu.set_bounds_check(BoundsCheckMode::Ignore);
    let kjt = check::batch(&mut rand::rngs::StdRng::seed_from_u64(2), false, 0);
    let want = check::collection(&case).forward(&kjt).unwrap();
    let got = gpu.download(&gpu.forward(&kjt).unwrap()).unwrap();
    assert_eq!(&got[..want.values().len()], want.values());
    let grad = gpu.upload(&vec![0.5; kjt.stride() * gpu.width()]).unwrap();
    let e = gpu.backward_and_update(&kjt, &grad).unwrap_err().to_string();
    assert!(e.contains("table \"") && e.contains("cache of 2 rows") && e.contains("load_factor"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A key-value table of a billion rows (64 GB of fp32 weights) moves onto the GPU engine
/// without being materialised: only the rows the CPU collection wrote are copied, the rest
/// read as the same initial weights.
#[test]
fn a_key_value_table_larger_than_memory_builds_without_materialising() {
    use trainrec_embedding::{
        CacheBacking, CacheConfig, CachePolicy, EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode,
    };
    use trainrec_sparse::KeyedJaggedTensor;
    let dir = std::env::temp_dir().join(format!("trainrec-cuda-kv-huge-{}", std::process::id()));
    let rows = 1_000_000_000;
    let table = EmbeddingBagConfig::new("big", rows, 16, PoolingMode::Sum, &["f"]).with_cache(CacheConfig {
        slots: 64,
        policy: CachePolicy::Lru,
        backing: CacheBacking::KeyValue,
        dir: dir.clone(),
    });
    let sgd = SparseOptimizerConfig::Sgd { lr: 0.5 };
    let mut cpu = EmbeddingBagCollection::new(vec![table], sgd, 3).unwrap();
    // Two rows written on the CPU side before the move.
    let kjt = KeyedJaggedTensor::new(vec!["f".into()], vec![7, 999_999_999], None, vec![1, 1], 2).unwrap();
    cpu.forward(&kjt).unwrap();
    cpu.backward_and_update(&kjt, &[0.25; 2 * 16]).unwrap();
    assert_eq!(cpu.sparse_rows("big"), Some(vec![7, 999_999_999]));
    let gpu = CudaEbc::emulated(&cpu).unwrap();
    // Rows written, and rows never written (their initial weights), read as on the CPU.
    let probe =
        KeyedJaggedTensor::new(vec!["f".into()], vec![7, 999_999_999, 123_456_789], None, vec![1, 1, 1], 3).unwrap();
    let want = cpu.forward(&probe).unwrap();
    assert_eq!(gpu.download(&gpu.forward(&probe).unwrap()).unwrap(), want.values());
    assert_eq!(gpu.cache_placement("big").unwrap().stored, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reset_rows_give_the_cpu_collections_values_in_memory_and_in_the_cache() {
    // Managed collisions' resets after two steps: plain tables (fp32, bf16) and cached ones
    // (fp32 LRU, fp16 LFU; table b's 30 rows behind 26 slots, so some reset rows are resident
    // and some only in host memory), whole tables and a block of a larger one; then a step
    // more, which reads the reset rows (and writes back the dirty resident ones).
    use rand::SeedableRng;
    use trainrec_embedding::{CachePolicy, RowBlock};
    let dir = std::env::temp_dir().join(format!("trainrec-cuda-reset-{}", std::process::id()));
    let rowwise = SparseOptimizerConfig::RowwiseAdagrad {
        lr: 0.2,
        eps: 1e-8,
        weight_decay: 0.0,
        weight_decay_mode: trainrec_embedding::WeightDecayMode::None,
    };
    for (precision, cache) in [
        (WeightPrecision::Fp32, None),
        (WeightPrecision::Bf16, None),
        (WeightPrecision::Fp32, Some(CachePolicy::Lru)),
        (WeightPrecision::Fp16, Some(CachePolicy::Lfu)),
    ] {
        let case =
            check::Case { optimizer: rowwise.clone(), precision, mean: false, weighted: true, stochastic: false };
        let what = format!("{precision:?} {cache:?}");
        let mut cpu = match cache {
            None => check::collection(&case),
            Some(policy) => cached_collection(&case, 26, policy, trainrec_embedding::CacheBacking::Rows, &dir),
        };
        let mut gpu = CudaEbc::emulated(&cpu).unwrap();
        gpu.set_bounds_check(BoundsCheckMode::Ignore);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut step = |cpu: &mut trainrec_embedding::EmbeddingBagCollection, gpu: &mut CudaEbc, s: usize| {
            let kjt = check::batch(&mut rng, true, s);
            let grad = check::gradient(&mut rng, &kjt, cpu.width());
            let want = cpu.forward(&kjt).unwrap();
            let got = gpu.download(&gpu.forward(&kjt).unwrap()).unwrap();
            assert_eq!(&got[..want.values().len()], want.values(), "{what}: forward of step {s}");
            cpu.backward_and_update(&kjt, &grad).unwrap();
            gpu.backward_and_update(&kjt, &gpu.upload(&grad).unwrap()).unwrap();
        };
        step(&mut cpu, &mut gpu, 0);
        step(&mut cpu, &mut gpu, 1);
        let before = gpu.table_weights("b").unwrap();
        // Rows listed twice and out of order, as a remap may give them.
        let rows = [3u64, 29, 0, 29, 17, 8];
        cpu.reset_rows("b", &rows, 41).unwrap();
        gpu.reset_rows("b", &rows, 41, None).unwrap();
        let block = RowBlock { row_offset: 5, cols: 10..80, full_dim: 100 };
        cpu.reset_block_rows("c", &[16, 2], 42, &block, 50).unwrap();
        gpu.reset_rows("c", &[16, 2], 42, Some((&block, 50))).unwrap();
        let after = gpu.table_weights("b").unwrap();
        assert_ne!(before[29 * 40..30 * 40], after[29 * 40..30 * 40], "{what}: row 29 is redrawn");
        assert_eq!(before[40..80], after[40..80], "{what}: row 1 untouched");
        for t in ["a", "b", "c"] {
            assert_eq!(gpu.table_weights(t).unwrap(), cpu.table_weights(t).unwrap(), "{what}: {t} after the reset");
            assert_eq!(gpu.optimizer_state(t).unwrap(), cpu.optimizer_state(t).unwrap(), "{what}: {t}'s state");
        }
        // Steps that read the reset rows, evict them (written back) and load them again.
        for s in 2..8 {
            step(&mut cpu, &mut gpu, s % check::STEPS);
            for t in ["a", "b", "c"] {
                assert_eq!(gpu.table_weights(t).unwrap(), cpu.table_weights(t).unwrap(), "{what}: {t} at step {s}");
                assert_eq!(gpu.optimizer_state(t).unwrap(), cpu.optimizer_state(t).unwrap(), "{what}: {t}'s state");
            }
        }
        if cache.is_some() {
            assert!(gpu.cache_stats("b").unwrap().writebacks > 0, "{what}");
        }
        // Bad rows and blocks are errors naming the table; nothing changes.
        let e = gpu.reset_rows("b", &[2, 30], 1, None).unwrap_err().to_string();
        assert!(e.contains("table \"b\" has 30 rows, cannot reset row 30"), "{e}");
        let narrow = RowBlock { row_offset: 0, cols: 0..8, full_dim: 8 };
        let e = gpu.reset_rows("c", &[1], 1, Some((&narrow, 17))).unwrap_err().to_string();
        assert!(e.contains("table \"c\" is 70 wide"), "{e}");
        assert_eq!(gpu.table_weights("b").unwrap(), cpu.table_weights("b").unwrap(), "{what}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs every pooled case of the sharding conformance kit on `world` thread ranks with each
/// rank's shards and replicas in an emulated `CudaEbc`; returns how many ran.
fn sharded_cases_on_the_emulator(world: usize, weighted: bool) -> usize {
    use std::sync::Arc;
    use trainrec_comm::{ProcessGroup, ThreadGroup};
    use trainrec_sharding::conformance;
    let cases: Vec<conformance::Case> = conformance::cases(&conformance::standard_sizes(world, 0), weighted)
        .into_iter()
        .filter(|c| !c.sequence)
        .collect();
    let n = cases.len();
    let results = ThreadGroup::run(world, std::time::Duration::from_secs(120), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut make = |cpu: &trainrec_embedding::EmbeddingBagCollection| {
            CudaEbc::emulated(cpu)
                .map(|g| Box::new(g) as Box<dyn trainrec_embedding::TableEngine>)
                .map_err(|e| trainrec_comm::DistError::Module(e.to_string()))
        };
        for case in &cases {
            conformance::run_case_on(pg.clone(), case, Some(&mut make))?;
        }
        Ok::<(), String>(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        if let Err(e) = r.unwrap_or_else(|e| Err(format!("rank {rank}: {e}"))) {
            panic!("{e}");
        }
    }
    n
}

#[test]
fn sharded_collections_train_their_shards_in_the_cuda_engine() {
    // Every sharding type and a mix (table-, row-, column-, table-row-, table-column-wise,
    // grid, data-parallel), each with its optimizer, SGD and deduplicated (VBE) batches: the
    // sharded collection's shards in the CUDA engine (the same input and output dists) train
    // like the unsharded CPU collection on the global batch.
    assert!(sharded_cases_on_the_emulator(2, false) >= 20);
    assert!(sharded_cases_on_the_emulator(3, true) >= 20);
}

#[test]
fn staged_batches_are_looked_up_like_uploaded_ones_and_free_their_slots() {
    use rand::SeedableRng;
    let c = check::Case {
        optimizer: SparseOptimizerConfig::Sgd { lr: 0.1 },
        precision: WeightPrecision::Fp16,
        mean: true,
        weighted: true,
        stochastic: false,
    };
    let gpu = CudaEbc::emulated(&check::collection(&c)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (k1, k2) = (check::batch(&mut rng, true, 0), check::batch(&mut rng, true, 1));
    let dense: Vec<f32> = (0..k1.stride() * 3).map(|i| i as f32 * 0.25 - 7.0).collect();
    let labels: Vec<f32> = (0..k1.stride()).map(|i| (i % 2) as f32).collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    let (db, lb) = (bytes(&dense), bytes(&labels));
    // Two batches staged at once (batch i+1 while batch i is in use) hold two slots.
    let s1 = gpu.stage(&k1, &[&db, &lb]).unwrap();
    let s2 = gpu.stage(&k2, &[&db[..8], &[]]).unwrap();
    assert_eq!(gpu.copy_stream().slots(), 2);
    assert_eq!(gpu.copy_stream().priority(), None, "the emulator has no stream priorities");
    for (kjt, staged) in [(&k1, &s1), (&k2, &s2)] {
        let want = gpu.download(&gpu.forward(kjt).unwrap()).unwrap();
        let mut got = vec![f32::NAN; kjt.stride() * gpu.width()];
        // SAFETY: emulator memory is host memory; `got` holds batch x width floats.
        unsafe { gpu.forward_staged_into_raw(kjt, staged, got.as_mut_ptr() as u64).unwrap() };
        assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "staged lookups differ");
    }
    // The caller's parts arrive as given (host addresses on the emulator).
    let parts = s1.parts().unwrap();
    // SAFETY: the staged copies of `dense` and `labels`, alive while `s1` is.
    let (d, l) = unsafe {
        (
            std::slice::from_raw_parts(parts[0] as *const f32, dense.len()),
            std::slice::from_raw_parts(parts[1] as *const f32, labels.len()),
        )
    };
    assert_eq!((d, l), (&dense[..], &labels[..]));
    // A staged batch read with another batch's ids is refused.
    let mut out = vec![0f32; k2.stride() * gpu.width()];
    // SAFETY: as above.
    let err = unsafe { gpu.forward_staged_into_raw(&k2, &s1, out.as_mut_ptr() as u64) }.unwrap_err();
    assert!(err.to_string().contains("another batch"), "{err}");
    // Dropped batches free their slots: the next two reuse them.
    drop((s1, s2));
    let s3 = gpu.stage(&k1, &[&db]).unwrap();
    let s4 = gpu.stage(&k1, &[&lb, &db]).unwrap();
    assert_eq!(gpu.copy_stream().slots(), 2);
    // SAFETY: as above; the slot of s3 was s1's or s2's, rewritten with this batch.
    let d = unsafe { std::slice::from_raw_parts(s3.parts().unwrap()[0] as *const f32, dense.len()) };
    assert_eq!(d, &dense[..]);
    drop((s3, s4));
}
