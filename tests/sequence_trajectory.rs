//! Sequence models against PyTorch over TorchRec's EmbeddingCollection (issue 44): from the
//! same initial weights, on the same batches, trainrec's job trains DIN and SASRec step for
//! step as the reference does (100 per-step losses within 1e-5 relative), with SGD everywhere
//! and with Adagrad, row-wise Adagrad and Adam on the tables (Adam on the dense part). The
//! fixtures come from `scripts/anchors/sequence_trajectory_fixture.py`; each says in its
//! `reference` field how the reference applied the tables' fused optimizer.
//!
//! Position-weighted features (`tables[].position_weighted`) train DLRM as TorchRec's
//! `FeatureProcessedEmbeddingBagCollection` does (`scripts/anchors/position_weighted_fixture.py`).
//!
//! SASRec's full softmax reads every row of the item table in each step (the catalogue): the
//! sharded test checks that this lookup, sharded over 2 and 3 thread ranks table-, row- and
//! column-wise or data-parallel, trains as one rank does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use trainrec::comm::{ProcessGroup, ThreadGroup};
use trainrec::data::Batch;
use trainrec::engine::load_and_check;
use trainrec::recipe::LoadOptions;
use trainrec::sparse::KeyedJaggedTensor;
use trainrec::{Job, Registry};
use trainrec_tests::slice_batch as slice;
use trainrec_tests::{DLRM_PARAMETERS, FixtureBatch, FixtureParam};

#[derive(Deserialize)]
struct Table {
    name: String,
    features: Vec<String>,
    rows: u64,
    dim: usize,
    pooling: String,
}

#[derive(Deserialize)]
struct Fixture {
    reference: String,
    model: serde_json::Map<String, serde_json::Value>,
    optimizer: BTreeMap<String, serde_json::Map<String, serde_json::Value>>,
    tables: Vec<Table>,
    keys: Vec<String>,
    num_dense: usize,
    batch: usize,
    table_weights: BTreeMap<String, Vec<f32>>,
    params: BTreeMap<String, FixtureParam>,
    batches: Vec<FixtureBatch>,
    losses: Vec<f64>,
}

fn load(file: &str) -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/trajectory").join(file);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// A JSON object as a TOML inline table.
fn inline(map: &serde_json::Map<String, serde_json::Value>) -> String {
    let fields: Vec<String> = map.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    format!("{{ {} }}", fields.join(", "))
}

/// The job's recipe for a fixture (its tables, model and optimizers) with `extra` lines.
fn recipe(fx: &Fixture, dir: &Path, extra: &str) -> PathBuf {
    let mut text = format!(
        "[run]\nname = \"trajectory\"\nseed = 1\nthreads = 1\noutput_dir = \"{}\"\n[data]\nbatch_size = {}\n\
         [data.sampler]\nkind = \"synthetic\"\ndense_features = {}\nsparse_features = {:?}\n",
        dir.join("run").display(),
        fx.batch,
        fx.num_dense,
        fx.keys
    );
    for t in &fx.tables {
        text += &format!(
            "[[tables]]\nname = \"{}\"\nfeatures = {:?}\nrows = {}\ndim = {}\npooling = \"{}\"\n",
            t.name, t.features, t.rows, t.dim, t.pooling
        );
    }
    text += "[model]\n";
    for (k, v) in &fx.model {
        text += &format!("{k} = {v}\n");
    }
    text += &format!(
        "[optimizer]\nsparse = {}\ndense = {}\n[train]\nsteps = {}\nprogress = false\n{extra}",
        inline(&fx.optimizer["sparse"]),
        inline(&fx.optimizer["dense"]),
        fx.batches.len()
    );
    let path = dir.join("recipe.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-seqtraj-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Rank `pg`'s job of the recipe at `path` with `overrides`, starting from the fixture's
/// weights.
fn job(fx: &Fixture, path: &Path, overrides: &[String], pg: Option<Arc<dyn ProcessGroup>>) -> Job {
    let registry = Registry::builtin();
    let options = LoadOptions { overrides: overrides.to_vec(), env: false };
    let (loaded, features) = load_and_check(path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
    let mut job = Job::build_rank(&loaded, &features, &registry, pg).unwrap_or_else(|e| panic!("{e}"));
    for (table, weights) in &fx.table_weights {
        job.set_table_weights(table, weights).unwrap();
    }
    let dense = job.dense_parameters();
    assert_eq!(dense.len(), fx.params.len(), "every dense parameter is set: ours {:?}", dense.keys());
    for (name, p) in &fx.params {
        let full = dense.keys().find(|k| k.ends_with(name.as_str())).unwrap_or_else(|| panic!("no parameter {name}"));
        job.set_dense_parameter(full, &p.values).unwrap();
    }
    job
}

fn batch(fx: &Fixture, b: &FixtureBatch) -> Batch {
    Batch {
        dense: b.dense.clone(),
        num_dense: fx.num_dense,
        sparse: KeyedJaggedTensor::new(fx.keys.clone(), b.values.clone(), None, b.lengths.clone(), fx.batch).unwrap(),
        labels: b.labels.clone(),
        batch_size: fx.batch,
        groups: None,
        weights: None,
    }
}

fn worst_relative(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(g, w)| (g - w).abs() / w.abs()).fold(0.0, f64::max)
}

fn check_trajectory(file: &str) {
    let fx = load(file);
    assert_eq!(fx.losses.len(), 100, "{file}");
    let dir = tmp(file);
    let path = recipe(&fx, &dir, "");
    let mut job = job(&fx, &path, &[], None);
    let losses: Vec<f64> = fx.batches.iter().map(|b| job.train_step(&batch(&fx, b)).unwrap()).collect();
    let worst = worst_relative(&losses, &fx.losses);
    eprintln!("{file} ({}): 100 steps, worst relative loss difference {worst:e}", fx.reference);
    assert!(worst <= 1e-5, "{file}: losses {losses:?}\nvs the reference's {:?} (worst relative {worst:e})", fx.losses);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sasrec_trains_as_the_reference_with_sgd() {
    check_trajectory("sasrec_sgd.json");
}

#[test]
fn sasrec_trains_as_the_reference_with_adagrad() {
    check_trajectory("sasrec_adagrad.json");
}

#[test]
fn sasrec_trains_as_the_reference_with_rowwise_adagrad() {
    check_trajectory("sasrec_rowwise_adagrad.json");
}

#[test]
fn sasrec_trains_as_the_reference_with_adam() {
    check_trajectory("sasrec_adam.json");
}

#[test]
fn din_trains_as_the_reference_with_sgd() {
    check_trajectory("din_sgd.json");
}

#[test]
fn din_trains_as_the_reference_with_adagrad() {
    check_trajectory("din_adagrad.json");
}

#[test]
fn din_trains_as_the_reference_with_rowwise_adagrad() {
    check_trajectory("din_rowwise_adagrad.json");
}

#[test]
fn din_trains_as_the_reference_with_adam() {
    check_trajectory("din_adam.json");
}

/// Joins batches `a` and `b` (the same keys) into one.
fn concat(parts: &[Batch]) -> Batch {
    let keys = parts[0].sparse.keys().to_vec();
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for k in 0..keys.len() {
        for p in parts {
            let f = p.sparse.feature(k);
            for i in 0..p.batch_size {
                values.extend_from_slice(f.bag(i));
                lengths.push(f.bag(i).len() as u32);
            }
        }
    }
    let n = parts.iter().map(|p| p.batch_size).sum();
    Batch {
        dense: parts.iter().flat_map(|p| p.dense.clone()).collect(),
        num_dense: parts[0].num_dense,
        sparse: KeyedJaggedTensor::new(keys, values, None, lengths, n).unwrap(),
        labels: parts.iter().flat_map(|p| p.labels.clone()).collect(),
        batch_size: n,
        groups: None,
        weights: None,
    }
}

/// SASRec's catalogue lookup (every row of the item table, each step) sharded over thread
/// ranks trains as one rank on the global batch. Every example has a history here: with empty
/// ones, each rank's loss is the mean over its own counted examples and the ranks' shares
/// follow their batch sizes, not their counted examples.
#[test]
fn sasrec_sharded_over_ranks_trains_as_one_rank() {
    let fx = load("sasrec_adam.json");
    let h = fx.keys.iter().position(|k| k == "history").unwrap();
    // Global batches of 24 from the fixture's examples that have a history.
    let kept: Vec<Batch> = fx
        .batches
        .iter()
        .map(|b| {
            let full = batch(&fx, b);
            let f = full.sparse.feature(h);
            let rows: Vec<usize> = (0..full.batch_size).filter(|&i| !f.bag(i).is_empty()).collect();
            let parts: Vec<Batch> = rows.iter().map(|&i| slice(&full, i, i + 1)).collect();
            concat(&parts)
        })
        .collect();
    let examples: Vec<Batch> = kept.iter().flat_map(|b| (0..b.batch_size).map(|i| slice(b, i, i + 1))).collect();
    let global: Vec<Batch> = examples.chunks(24).filter(|c| c.len() == 24).take(12).map(concat).collect();
    assert_eq!(global.len(), 12);
    for sharding in ["table_wise", "row_wise", "column_wise", "data_parallel"] {
        let dir = tmp(&format!("sasrec-{sharding}"));
        let path = recipe(&fx, &dir, "");
        let constraint = format!("tables[0].constraints.sharding_types=[\"{sharding}\"]");
        let mut one = job(&fx, &path, &[constraint.clone(), "data.batch_size=24".into()], None);
        let want: Vec<f64> = global.iter().map(|b| one.train_step(b).unwrap()).collect();
        let want_items = one.table_weights("items").unwrap().unwrap();
        for world in [2usize, 3] {
            let overrides = [constraint.clone(), format!("topology.world_size={world}"), "data.batch_size=24".into()];
            let per = 24 / world;
            let out = ThreadGroup::run(world, Duration::from_secs(120), |pg| {
                let rank = pg.rank();
                let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
                let mut job = job(&fx, &path, &overrides, Some(pg));
                let losses: Vec<f64> =
                    global.iter().map(|b| job.train_step(&slice(b, rank * per, (rank + 1) * per)).unwrap()).collect();
                (losses, job.table_weights("items").unwrap().unwrap())
            });
            let (losses, items) = out.into_iter().next().unwrap().unwrap_or_else(|e| panic!("rank 0: {e}"));
            for (i, (got, want)) in losses.iter().zip(&want).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs(),
                    "{sharding}, {world} ranks: step {i}: {got} vs {want}"
                );
            }
            for (i, (x, y)) in items.iter().zip(&want_items).enumerate() {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{sharding}, {world} ranks: items[{i}]: {x} vs {y}");
            }
            eprintln!("sasrec {sharding} on {world} ranks: {} steps as one rank's", losses.len());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The position-weighted fixture (`scripts/anchors/position_weighted_fixture.py`).
#[derive(Deserialize)]
struct PositionWeightedFixture {
    model: serde_json::Map<String, serde_json::Value>,
    rows: u64,
    dim: usize,
    num_dense: usize,
    batch: usize,
    lr: f64,
    keys: Vec<String>,
    position_weighted: BTreeMap<String, usize>,
    params: BTreeMap<String, FixtureParam>,
    batches: Vec<FixtureBatch>,
    losses: Vec<f64>,
    final_params: BTreeMap<String, FixtureParam>,
}

/// TorchRec's position-weighted features (a `FeatureProcessedEmbeddingBagCollection` with a
/// `PositionWeightedModuleCollection` on two of DLRM's three features): trainrec's
/// `tables[].position_weighted` trains DLRM step for step as TorchRec does, and the position
/// weights end where TorchRec's do.
#[test]
fn position_weighted_features_train_as_torchrecs_feature_processed_bags() {
    let fx: PositionWeightedFixture = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/trajectory/dlrm_position_weighted.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let dir = tmp("position-weighted");
    let mut text = format!(
        "[run]\nname = \"position-weighted\"\nseed = 1\nthreads = 1\noutput_dir = \"{}\"\n[data]\nbatch_size = {}\n\
         [data.sampler]\nkind = \"synthetic\"\ndense_features = {}\nsparse_features = {:?}\n",
        dir.join("run").display(),
        fx.batch,
        fx.num_dense,
        fx.keys
    );
    for (i, k) in fx.keys.iter().enumerate() {
        text += &format!("[[tables]]\nname = \"t{i}\"\nfeatures = [\"{k}\"]\nrows = {}\ndim = {}\n", fx.rows, fx.dim);
        if let Some(n) = fx.position_weighted.get(k) {
            text += &format!("position_weighted = {{ max_length = {n} }}\n");
        }
    }
    text += "[model]\n";
    for (k, v) in &fx.model {
        text += &format!("{k} = {v}\n");
    }
    text += &format!(
        "[optimizer]\nsparse = {{ kind = \"sgd\", lr = {lr} }}\ndense = {{ kind = \"sgd\", lr = {lr} }}\n\
         [train]\nsteps = {}\nprogress = false\n",
        fx.batches.len(),
        lr = fx.lr
    );
    let path = dir.join("recipe.toml");
    std::fs::write(&path, text).unwrap();
    let registry = Registry::builtin();
    let options = LoadOptions { overrides: vec![], env: false };
    let (loaded, features) = load_and_check(&path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
    let mut job = Job::build(&loaded, &features, &registry).unwrap_or_else(|e| panic!("{e}"));
    let table =
        |i: usize| format!("sparse_arch.embedding_bag_collection._embedding_bag_collection.embedding_bags.t{i}.weight");
    for i in 0..fx.keys.len() {
        job.set_table_weights(&format!("t{i}"), &fx.params[&table(i)].values).unwrap();
    }
    let mut names: Vec<(String, String)> =
        DLRM_PARAMETERS.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    for f in fx.position_weighted.keys() {
        names.push((
            format!("position_weights.{f}"),
            format!("sparse_arch.embedding_bag_collection._feature_processors.position_weights.{f}"),
        ));
    }
    let dense = job.dense_parameters();
    assert_eq!(dense.len(), names.len(), "every dense parameter is mapped: {:?}", dense.keys());
    assert_eq!(fx.params.len(), names.len() + fx.keys.len(), "every TorchRec parameter is used");
    let full = |ours: &str| dense.keys().find(|k| k.ends_with(ours)).unwrap_or_else(|| panic!("no {ours}")).clone();
    for (ours, theirs) in &names {
        job.set_dense_parameter(&full(ours), &fx.params[theirs].values).unwrap();
    }
    let losses: Vec<f64> = fx
        .batches
        .iter()
        .map(|b| {
            let sparse = KeyedJaggedTensor::new(fx.keys.clone(), b.values.clone(), None, b.lengths.clone(), fx.batch);
            let batch = Batch {
                dense: b.dense.clone(),
                num_dense: fx.num_dense,
                sparse: sparse.unwrap(),
                labels: b.labels.clone(),
                batch_size: fx.batch,
                groups: None,
                weights: None,
            };
            job.train_step(&batch).unwrap()
        })
        .collect();
    let worst = worst_relative(&losses, &fx.losses);
    eprintln!("position-weighted DLRM: 100 steps, worst relative loss difference {worst:e}");
    assert!(worst <= 1e-5, "losses {losses:?}\nvs TorchRec's {:?} (worst relative {worst:e})", fx.losses);
    // The position weights move little in 100 steps; compare them with TorchRec's final values.
    let trained = job.dense_parameters();
    for (ours, theirs) in names.iter().filter(|(o, _)| o.starts_with("position_weights")) {
        let (got, want) = (&trained[&full(ours)], &fx.final_params[theirs].values);
        let start = &fx.params[theirs].values;
        let moved = start.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-6 + moved * 1e-3, "{ours}[{i}]: {g} vs TorchRec's {w} (they moved {moved:e})");
        }
        eprintln!("{ours}: moved up to {moved:e}, as TorchRec's");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SASRec's sampled negatives come from the run's seed, the rank and the steps trained, so a
/// job loaded from a checkpoint draws what the uninterrupted run drew after it: both end with
/// the same item table.
#[test]
fn sampled_negatives_go_on_after_a_checkpoint_as_without_one() {
    let fx = load("sasrec_adam.json");
    let dir = tmp("sampled-resume");
    let path = recipe(&fx, &dir, "checkpoint_every = 10\n");
    let overrides: Vec<String> =
        ["model.loss=\"sampled_softmax\"", "model.negatives=7", "train.steps=20"].map(String::from).to_vec();
    let mut whole = job(&fx, &path, &overrides, None);
    let summary = whole.run().unwrap();
    assert_eq!(summary.steps, 20);
    let want = whole.table_weights("items").unwrap().unwrap();
    let ck = trainrec::engine::checkpoint::Checkpoint::open(&summary.output_dir.join("checkpoints/step-00000010"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut resumed = job(&fx, &path, &overrides, None);
    resumed.load_checkpoint(&ck).unwrap();
    let batches: Vec<Batch> = resumed
        .batches(trainrec::data::Split::Train, fx.batch)
        .unwrap()
        .skip(10)
        .take(10)
        .map(Result::unwrap)
        .collect();
    for b in &batches {
        resumed.train_step(b).unwrap();
    }
    assert_eq!(resumed.table_weights("items").unwrap().unwrap(), want, "the resumed job drew other negatives");
    std::fs::remove_dir_all(&dir).unwrap();
}
