//! Cached tables (a cache of rows in memory, the table in a file or a key-value store of the
//! rows written) against the same tables held in memory: identical lookups, updates,
//! optimizer state, for LRU and LFU, with and without prefetching the next batch before an
//! update; eviction order on hand-built streams; a cache too small for a batch fails
//! cleanly and stays usable; a key-value table far larger than the disk trains.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainrec_embedding::{
    CacheBacking, CacheConfig, CachePolicy, EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode,
    SparseOptimizerConfig, WeightDecayMode,
};
use trainrec_sparse::KeyedJaggedTensor;

fn dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("trainrec-cache-test-{}", std::process::id()))
}

fn tables(cache: Option<(u64, CachePolicy, CacheBacking)>) -> Vec<EmbeddingBagConfig> {
    let cached = |c: EmbeddingBagConfig, share: u64| match cache {
        Some((slots, policy, backing)) => {
            c.with_cache(CacheConfig { slots: slots / share, policy, backing, dir: dir() })
        }
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
        for (policy, backing, prefetch) in [CachePolicy::Lru, CachePolicy::Lfu]
            .into_iter()
            .flat_map(|p| [CacheBacking::Rows, CacheBacking::KeyValue].map(|b| (p, b)))
            .flat_map(|(p, b)| [false, true].map(|f| (p, b, f)))
        {
            // 80 slots for `big` (40 for `mean`): two batches' rows always fit (at most
            // 2 x 2 x 6 x 3 = 72 ids), well under the tables' rows, so rows are evicted and
            // reloaded.
            let config = tables(Some((80, policy, backing)));
            let mut cached = EmbeddingBagCollection::new(config, opt.clone(), 3).unwrap();
            let what = format!("{opt:?} {policy:?} {backing:?} prefetch {prefetch}");
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
            // A key-value store holds the rows written back, a row file every row.
            let stored = cached.stored_rows("big").unwrap();
            match backing {
                CacheBacking::Rows => assert_eq!(stored, 200, "{what}"),
                CacheBacking::KeyValue => assert!(stored > 0 && stored < 200, "{what}: {stored} rows stored"),
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
    for backing in [CacheBacking::Rows, CacheBacking::KeyValue] {
        let mut plain = EmbeddingBagCollection::new(tables(None), opt.clone(), 5).unwrap();
        let config = tables(Some((80, CachePolicy::Lru, backing)));
        let mut cached = EmbeddingBagCollection::new(config, opt.clone(), 5).unwrap();
        setters_and_resets(&mut plain, &mut cached);
    }
}

fn setters_and_resets(plain: &mut EmbeddingBagCollection, cached: &mut EmbeddingBagCollection) {
    train(plain, 5, false);
    train(cached, 5, false);
    // Resets of rows resident and not, then new weights and state for the whole table.
    let rows: Vec<u64> = (0..200).step_by(7).collect();
    plain.reset_rows("big", &rows, 99).unwrap();
    cached.reset_rows("big", &rows, 99).unwrap();
    assert_eq!(cached.table_weights("big"), plain.table_weights("big"));
    assert_eq!(cached.optimizer_state("big"), plain.optimizer_state("big"));
    let w: Vec<f32> = (0..200 * 8).map(|i| (i % 13) as f32 * 0.25).collect();
    let s: Vec<f32> = (0..200).map(|i| i as f32).collect();
    for ebc in [&mut *plain, &mut *cached] {
        ebc.set_table_weights("big", w.clone()).unwrap();
        ebc.set_optimizer_state("big", s.clone()).unwrap();
    }
    assert_eq!(cached.table_weights("big").unwrap(), w);
    assert_eq!(cached.optimizer_state("big").unwrap(), s);
    assert_eq!(train(cached, 8, true), train(plain, 8, false));
    assert_eq!(cached.table_weights("big"), plain.table_weights("big"));
}

/// One cached table of 10 rows x 1 with 3 slots, SGD lr 1, weight of row r = r.
fn tiny(policy: CachePolicy) -> EmbeddingBagCollection {
    let t = EmbeddingBagConfig::new("t", 10, 1, PoolingMode::Sum, &["f"]).with_cache(CacheConfig {
        slots: 3,
        policy,
        backing: CacheBacking::Rows,
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
            backing: CacheBacking::Rows,
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
        backing: CacheBacking::Rows,
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

/// A key-value table's initial rows, read without a record, as an in-memory table's.
#[test]
fn a_key_value_table_starts_with_the_in_memory_weights_and_stores_only_what_changes() {
    let opt = SparseOptimizerConfig::Sgd { lr: 0.5 };
    // 40 000 rows: rows past the first seeded init block (16 384 rows) start mid-stream.
    let table = |cache: Option<CacheConfig>| {
        let t = EmbeddingBagConfig::new("t", 40_000, 6, PoolingMode::Sum, &["f"]);
        vec![match cache {
            Some(c) => t.with_cache(c),
            None => t,
        }]
    };
    let own = dir().join("key-value");
    let config = CacheConfig { slots: 4, policy: CachePolicy::Lru, backing: CacheBacking::KeyValue, dir: own.clone() };
    let mut plain = EmbeddingBagCollection::new(table(None), opt.clone(), 9).unwrap();
    let mut kv = EmbeddingBagCollection::new(table(Some(config)), opt, 9).unwrap();
    assert_eq!(kv.stored_rows("t"), Some(0), "nothing is written when the table is built");
    let ids = [39_999i64, 16_384, 16_383, 20_001, 7];
    for ebc in [&mut plain, &mut kv] {
        ebc.forward(&bag(&ids)).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            // One row a step: 5 rows through 4 slots evict one, which is written back.
            ebc.backward_and_update(&bag(&[id]), &[1.0 + i as f32; 6]).unwrap();
        }
    }
    assert_eq!(kv.forward(&bag(&ids)).unwrap().values(), plain.forward(&bag(&ids)).unwrap().values());
    assert_eq!(kv.stored_rows("t"), Some(1), "the one evicted row");
    assert_eq!(kv.table_weights("t"), plain.table_weights("t"));
    // Whole-table weights as they are (a checkpoint restored) store only the changed rows.
    let w = plain.table_weights("t").unwrap();
    let mut fresh = EmbeddingBagCollection::new(
        table(Some(CacheConfig {
            slots: 4,
            policy: CachePolicy::Lru,
            backing: CacheBacking::KeyValue,
            dir: own.clone(),
        })),
        SparseOptimizerConfig::Sgd { lr: 0.5 },
        9,
    )
    .unwrap();
    fresh.set_table_weights("t", w.clone()).unwrap();
    assert_eq!(fresh.stored_rows("t"), Some(ids.len() as u64));
    assert_eq!(fresh.table_weights("t").unwrap(), w);
    drop((kv, fresh));
    let left: Vec<_> =
        std::fs::read_dir(&own).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}

/// A key-value table of 10^9 rows x 64 (256 GB, more than this disk) is built at once and
/// trains: its rows are made as they are written.
#[test]
fn a_key_value_table_larger_than_the_disk_trains() {
    let own = dir().join("key-value-huge");
    let t = EmbeddingBagConfig::new("huge", 1_000_000_000, 64, PoolingMode::Sum, &["f"]).with_cache(CacheConfig {
        slots: 2,
        policy: CachePolicy::Lru,
        backing: CacheBacking::KeyValue,
        dir: own.clone(),
    });
    let mut ebc = EmbeddingBagCollection::new(vec![t], SparseOptimizerConfig::Sgd { lr: 1.0 }, 0).unwrap();
    let ids = [999_999_999i64, 3, 500_000_000];
    let before: Vec<Vec<f32>> = ids.iter().map(|&id| ebc.forward(&bag(&[id])).unwrap().values().to_vec()).collect();
    for &id in &ids {
        ebc.backward_and_update(&bag(&[id]), &[0.25; 64]).unwrap();
    }
    // SGD, lr 1: each row lowered by its gradient, the evicted one read back from the store.
    for (&id, b) in ids.iter().zip(&before) {
        let after = ebc.forward(&bag(&[id])).unwrap().values().to_vec();
        let want: Vec<f32> = b.iter().map(|x| x - 0.25).collect();
        assert_eq!(after, want, "row {id}");
    }
    assert!(before[0] != before[1] && before[0].iter().all(|x| x.abs() <= 1e-4 && *x != 0.0), "{before:?}");
    assert!(ebc.stored_rows("huge").unwrap() <= 3);
    let files = std::fs::read_dir(&own).map(|d| d.count()).unwrap_or(0);
    assert_eq!(files, 0, "the store's files are unlinked");
}
