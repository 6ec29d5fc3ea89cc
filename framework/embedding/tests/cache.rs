//! Cached tables (a cache of rows in memory, the table in a file) against the same tables
//! held in memory: identical lookups, updates, optimizer state, for LRU and LFU, with and
//! without prefetching the next batch before an update; eviction order on hand-built
//! streams; a cache too small for a batch fails cleanly and stays usable.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_embedding::{
    CacheConfig, CachePolicy, EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig,
    WeightDecayMode,
};
use trainrec_sparse::KeyedJaggedTensor;

fn dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("trainrec-cache-test-{}", std::process::id()))
}

fn tables(cache: Option<(u64, CachePolicy)>) -> Vec<EmbeddingBagConfig> {
    let cached = |c: EmbeddingBagConfig, share: u64| match cache {
        Some((slots, policy)) => c.with_cache(CacheConfig { slots: slots / share, policy, dir: dir() }),
        None => c,
    };
    vec![
        // Two features share the cached table; a third table stays in memory.
        cached(EmbeddingBagConfig::new("big", 200, 8, PoolingMode::Sum, &["a", "b@big"]), 1),
        EmbeddingBagConfig::new("small", 10, 4, PoolingMode::Mean, &["c"]),
        cached(EmbeddingBagConfig::new("mean", 50, 5, PoolingMode::Mean, &["d"]), 2),
    ]
}

/// A batch of `batch` bags per feature; ids skewed towards low rows so some rows recur.
fn batch(rng: &mut StdRng, batch: usize) -> KeyedJaggedTensor {
    let mut values = Vec::new();
    let mut lengths = Vec::new();
    for rows in [200u64, 200, 10, 50] {
        for _ in 0..batch {
            let n = rng.random_range(0..4u32);
            lengths.push(n);
            for _ in 0..n {
                let u: f64 = rng.random();
                values.push((u * u * rows as f64) as i64);
            }
        }
    }
    let keys = ["a", "b", "c", "d"].iter().map(|k| k.to_string()).collect();
    KeyedJaggedTensor::new(keys, values, None, lengths, batch).unwrap()
}

fn optimizers() -> Vec<SparseOptimizerConfig> {
    vec![
        SparseOptimizerConfig::Sgd { lr: 0.1 },
        SparseOptimizerConfig::RowwiseAdagrad {
            lr: 0.1,
            eps: 1e-8,
            weight_decay: 0.01,
            weight_decay_mode: WeightDecayMode::L2,
        },
        SparseOptimizerConfig::Adam { lr: 0.01, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.0 },
    ]
}

/// Trains `steps` batches; `prefetch` prefetches batch i+1 before batch i's update.
fn train(ebc: &mut EmbeddingBagCollection, steps: usize, prefetch: bool) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(11);
    let batches: Vec<KeyedJaggedTensor> = (0..=steps).map(|_| batch(&mut rng, 6)).collect();
    let mut outs = Vec::new();
    if prefetch {
        ebc.prefetch(&batches[0]).unwrap();
    }
    for i in 0..steps {
        let out = ebc.forward(&batches[i]).unwrap();
        let grad: Vec<f32> = out.values().iter().enumerate().map(|(j, v)| v * 0.5 + (j % 7) as f32 * 0.01).collect();
        if prefetch {
            ebc.prefetch(&batches[i + 1]).unwrap();
        }
        ebc.backward_and_update(&batches[i], &grad).unwrap();
        outs.push(out.values().to_vec());
    }
    if prefetch {
        assert_eq!(ebc.prefetched(), 1);
        ebc.discard_prefetched();
    }
    assert_eq!(ebc.prefetched(), 0);
    outs
}

#[test]
fn cached_tables_train_exactly_like_tables_in_memory() {
    for opt in optimizers() {
        let mut plain = EmbeddingBagCollection::new(tables(None), opt.clone(), 3).unwrap();
        let want = train(&mut plain, 30, false);
        for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
            for prefetch in [false, true] {
                // 80 slots for `big` (40 for `mean`): two batches' rows always fit (at most
                // 2 x 2 x 6 x 3 = 72 ids), well under the tables' rows, so rows are evicted and
                // reloaded.
                let mut cached = EmbeddingBagCollection::new(tables(Some((80, policy))), opt.clone(), 3).unwrap();
                let what = format!("{opt:?} {policy:?} prefetch {prefetch}");
                assert_eq!(cached.table_weights("big"), plain_initial(&opt, "big"), "{what}: initial weights");
                let got = train(&mut cached, 30, prefetch);
                assert_eq!(got, want, "{what}: pooled outputs");
                for t in ["big", "small", "mean"] {
                    assert_eq!(cached.table_weights(t), plain.table_weights(t), "{what}: weights of {t}");
                    assert_eq!(cached.optimizer_state(t), plain.optimizer_state(t), "{what}: state of {t}");
                }
                let s = cached.cache_stats("big").expect("cached");
                assert!(s.evictions > 0 && s.writebacks > 0, "{what}: the cache did evict: {s:?}");
                assert!(s.hits > 0 && s.misses > 0, "{what}: {s:?}");
                assert_eq!(s.requests, s.hits + s.misses);
                assert!(cached.cache_stats("small").is_none());
            }
        }
    }
}

fn plain_initial(opt: &SparseOptimizerConfig, table: &str) -> Option<Vec<f32>> {
    EmbeddingBagCollection::new(tables(None), opt.clone(), 3).unwrap().table_weights(table)
}

#[test]
fn setters_and_row_resets_reach_resident_and_evicted_rows() {
    let opt = SparseOptimizerConfig::RowwiseAdagrad {
        lr: 0.1,
        eps: 1e-8,
        weight_decay: 0.0,
        weight_decay_mode: WeightDecayMode::None,
    };
    let mut plain = EmbeddingBagCollection::new(tables(None), opt.clone(), 5).unwrap();
    let mut cached = EmbeddingBagCollection::new(tables(Some((80, CachePolicy::Lru))), opt, 5).unwrap();
    train(&mut plain, 5, false);
    train(&mut cached, 5, false);
    // Resets of rows resident and not, then new weights and state for the whole table.
    let rows: Vec<u64> = (0..200).step_by(7).collect();
    plain.reset_rows("big", &rows, 99).unwrap();
    cached.reset_rows("big", &rows, 99).unwrap();
    assert_eq!(cached.table_weights("big"), plain.table_weights("big"));
    assert_eq!(cached.optimizer_state("big"), plain.optimizer_state("big"));
    let w: Vec<f32> = (0..200 * 8).map(|i| (i % 13) as f32 * 0.25).collect();
    let s: Vec<f32> = (0..200).map(|i| i as f32).collect();
    for ebc in [&mut plain, &mut cached] {
        ebc.set_table_weights("big", w.clone()).unwrap();
        ebc.set_optimizer_state("big", s.clone()).unwrap();
    }
    assert_eq!(cached.table_weights("big").unwrap(), w);
    assert_eq!(cached.optimizer_state("big").unwrap(), s);
    assert_eq!(train(&mut cached, 8, true), train(&mut plain, 8, false));
    assert_eq!(cached.table_weights("big"), plain.table_weights("big"));
}

/// One cached table of 10 rows x 1 with 3 slots, SGD lr 1, weight of row r = r.
fn tiny(policy: CachePolicy) -> EmbeddingBagCollection {
    let t = EmbeddingBagConfig::new("t", 10, 1, PoolingMode::Sum, &["f"]).with_cache(CacheConfig {
        slots: 3,
        policy,
        dir: dir(),
    });
    let mut ebc = EmbeddingBagCollection::new(vec![t], SparseOptimizerConfig::Sgd { lr: 1.0 }, 0).unwrap();
    ebc.set_table_weights("t", (0..10).map(|r| r as f32).collect()).unwrap();
    ebc
}

/// One bag holding `ids`.
fn bag(ids: &[i64]) -> KeyedJaggedTensor {
    KeyedJaggedTensor::new(vec!["f".into()], ids.to_vec(), None, vec![ids.len() as u32], 1).unwrap()
}

/// Trains one bag with gradient 0 (weights unchanged) and returns the misses it caused.
fn step(ebc: &mut EmbeddingBagCollection, ids: &[i64]) -> u64 {
    let before = ebc.cache_stats("t").unwrap().misses;
    ebc.backward_and_update(&bag(ids), &[0.0]).unwrap();
    ebc.cache_stats("t").unwrap().misses - before
}

#[test]
fn lru_evicts_the_row_used_longest_ago() {
    let mut ebc = tiny(CachePolicy::Lru);
    let misses: Vec<u64> = [1, 2, 3, 1, 4, 2, 1, 3, 4].iter().map(|&r| step(&mut ebc, &[r])).collect();
    // 4 evicts 2 (1 was used since), 2 evicts 3, 3 evicts 4, 4 evicts 2.
    assert_eq!(misses, [1, 1, 1, 0, 1, 1, 0, 1, 1]);
    assert_eq!(step(&mut ebc, &[1, 3]), 0);
    assert_eq!(ebc.cache_stats("t").unwrap().evictions, 4);
}

#[test]
fn lfu_evicts_the_row_used_by_the_fewest_batches() {
    let mut ebc = tiny(CachePolicy::Lfu);
    let misses: Vec<u64> = [1, 1, 1, 2, 3, 4, 1, 2, 3, 4].iter().map(|&r| step(&mut ebc, &[r])).collect();
    // 4 evicts 2 (used once; LRU would evict 1, used 3 times but longest ago), so 1 hits; 2
    // evicts 3 (count 1, older than 4's); 3 evicts 4 (count 1; 2 and 3 count 2 now: counts
    // survive eviction); 4 evicts 2 (count 2, older than 3).
    assert_eq!(misses, [1, 0, 0, 1, 1, 1, 0, 1, 1, 1]);
    assert_eq!(step(&mut ebc, &[1, 3, 4]), 0);
    assert_eq!(ebc.cache_stats("t").unwrap().evictions, 4);
}

#[test]
fn a_cache_too_small_for_its_batches_fails_cleanly_and_stays_usable() {
    let mut ebc = tiny(CachePolicy::Lru);
    // SGD lr 1, gradient 1 per id: each update lowers its rows by 1.
    ebc.prefetch(&bag(&[0, 1])).unwrap();
    let err = ebc.prefetch(&bag(&[2, 3])).unwrap_err().to_string();
    assert!(err.contains("table \"t\"") && err.contains("load_factor"), "{err}");
    assert_eq!(ebc.prefetched(), 1, "the failed prefetch pinned nothing");
    // A batch that was not prefetched trains beside the prefetched one (its rows pinned for
    // its update alone), then the prefetched one.
    ebc.backward_and_update(&bag(&[5]), &[1.0]).unwrap();
    assert_eq!(ebc.prefetched(), 1);
    ebc.backward_and_update(&bag(&[0, 1]), &[1.0]).unwrap();
    assert_eq!(ebc.prefetched(), 0);
    ebc.backward_and_update(&bag(&[2, 3, 4]), &[1.0]).unwrap();
    let err = ebc.backward_and_update(&bag(&[5, 6, 7, 8]), &[1.0]).unwrap_err().to_string();
    assert!(err.contains("cannot hold"), "{err}");
    // Forward without a prefetch reads rows not resident from the file.
    assert_eq!(ebc.forward(&bag(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9])).unwrap().values(), [39.0]);
    assert_eq!(ebc.table_weights("t").unwrap(), vec![-1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0]);
}

#[test]
fn bad_cache_sizes_are_config_errors_naming_the_table() {
    // A directory of its own: the other tests of this binary run in parallel threads, and
    // their backing files show in `dir()` between being created and being unlinked.
    let own = dir().join("bad-sizes");
    std::fs::create_dir_all(&own).unwrap();
    for slots in [0, 11] {
        let t = EmbeddingBagConfig::new("t", 10, 1, PoolingMode::Sum, &["f"]).with_cache(CacheConfig {
            slots,
            policy: CachePolicy::Lru,
            dir: own.clone(),
        });
        let err = EmbeddingBagCollection::new(vec![t], SparseOptimizerConfig::Sgd { lr: 1.0 }, 0).err().unwrap();
        assert!(err.to_string().contains("table \"t\"") && err.to_string().contains("1..=10"), "{err}");
    }
    // A table the disk cannot hold (65 TB) is refused when its file is made, not by a fault
    // when a page is written later.
    let huge = EmbeddingBagConfig::new("huge", 4_000_000_000, 4096, PoolingMode::Sum, &["f"]).with_cache(CacheConfig {
        slots: 10,
        policy: CachePolicy::Lru,
        dir: own.clone(),
    });
    let err = EmbeddingBagCollection::new(vec![huge], SparseOptimizerConfig::Sgd { lr: 1.0 }, 0).err().unwrap();
    let err = err.to_string();
    assert!(err.contains("table \"huge\"") && err.contains("embedding.offload_dir"), "{err}");
    // Nothing of the backing files stays behind.
    let left: Vec<_> =
        std::fs::read_dir(&own).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}
