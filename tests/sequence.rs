//! Sequence tables (`pooling = "none"`, TorchRec's `EmbeddingCollection`) end to end on one
//! rank: the ids of a `a|b|c` CSV column reach a plugin model as jagged embeddings, their
//! gradient comes back to the fused update, and checkpoints carry the tables.
//!
//! The reference is the pooled path itself: a model that averages each sequence feature's
//! rows (through `to_padded` and its mask) must train as the same model over a
//! `pooling = "mean"` table does, step for step, from the same initial weights and batches.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use schemars::JsonSchema;
use serde::Deserialize;
use trainrec::comm::{ProcessGroup, ThreadGroup};
use trainrec::engine::load_and_check;
use trainrec::plugin::tch::{Kind, Tensor, nn, nn::Module};
use trainrec::plugin::{Diagnostic, ModelError};
use trainrec::prelude::*;
use trainrec::recipe::LoadOptions;
use trainrec_tests::slice_batch as slice;

/// No options.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct MeanConfig {}

/// A linear layer over the dense features, the pooled embeddings and the mean of each sequence
/// feature's rows.
struct MeanOfSequences {
    linear: nn::Linear,
    dims: Vec<(String, usize)>,
}

impl MeanOfSequences {
    fn means(&self, input: &ModelInput<'_>) -> Vec<Tensor> {
        let b = input.dense.size()[0];
        self.dims
            .iter()
            .map(|(name, dim)| match input.sequence(name) {
                Some(j) => {
                    let (padded, mask) = j.to_padded(None, 0.0);
                    let mask = mask.to_kind(Kind::Float);
                    let sum = (padded * mask.unsqueeze(-1)).sum_dim_intlist(1, false, Kind::Float);
                    let n = mask.sum_dim_intlist(1, true, Kind::Float).clamp_min(1.0);
                    sum / n
                }
                None => Tensor::zeros([b, *dim as i64], (Kind::Float, input.dense.device())),
            })
            .collect()
    }
}

impl DenseModel for MeanOfSequences {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor {
        self.forward_input(&ModelInput::pooled(dense, sparse), train)
    }

    fn forward_input(&self, input: &ModelInput<'_>, _train: bool) -> Tensor {
        let mut parts = vec![input.dense.shallow_clone(), input.pooled.shallow_clone()];
        parts.extend(self.means(input));
        self.linear.forward(&Tensor::cat(&parts, 1))
    }
}

impl TypedModel for MeanOfSequences {
    type Config = MeanConfig;
    const KIND: &'static str = "mean_of_sequences";
    const READS_SEQUENCES: bool = true;

    fn check(_config: &MeanConfig, _inputs: &ModelInputs) -> Vec<Diagnostic> {
        Vec::new()
    }

    fn build(vs: &nn::Path, _config: &MeanConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        let width = inputs.num_dense
            + inputs.sparse.iter().map(|s| s.1).sum::<usize>()
            + inputs.sequences.iter().map(|s| s.1).sum::<usize>();
        let linear = nn::linear(vs / "linear", width as i64, inputs.num_tasks as i64, Default::default());
        Ok(Self { linear, dims: inputs.sequences.clone() })
    }
}

fn registry() -> Registry {
    Registry::builtin().model::<MeanOfSequences>()
}

/// A CSV of `label,user,items` rows: `items` a `|`-separated history of 0 to 9 ids whose mean
/// planted signal decides the label.
fn write_data(dir: &Path) -> PathBuf {
    let mut rng = StdRng::seed_from_u64(3);
    let mut text = String::from("label,user,items\n");
    for _ in 0..640 {
        let n = rng.random_range(0..10);
        let items: Vec<u32> = (0..n).map(|_| rng.random_range(0..50)).collect();
        let signal = items.iter().filter(|&&i| i < 20).count() as f64 - n as f64 * 0.4;
        let label = u8::from(signal + rng.random_range(-1.0..1.0) > 0.0);
        let items: Vec<String> = items.iter().map(u32::to_string).collect();
        text.push_str(&format!("{label},{},{}\n", rng.random_range(0..30), items.join("|")));
    }
    let path = dir.join("data.csv");
    std::fs::write(&path, text).unwrap();
    path
}

/// The recipe with the items table pooled as `pooling` ("mean" or "none") and `optimizer`.
fn recipe(dir: &Path, pooling: &str, optimizer: &str, extra: &str) -> PathBuf {
    write_data(dir);
    let text = format!(
        r#"[run]
name = "sequence-{pooling}"
output_dir = "{out}"
seed = 5

[data]
batch_size = 32

[data.sampler]
kind = "csv"
path = "data.csv"
eval_fraction = 0.2
label = "label"
integer_ids = ["user", "items"]
multi_value = {{ items = "|" }}

[data.sampler.sparse]
user = "user"
items = "items"

[[tables]]
name = "users"
features = ["user"]
rows = 30
dim = 4

[[tables]]
name = "items"
features = ["items"]
rows = 50
dim = 8
pooling = "{pooling}"

[model]
kind = "mean_of_sequences"

[optimizer]
sparse = {optimizer}
dense = {{ kind = "adam", lr = 0.01 }}

[train]
steps = 15
log_every = 5

[[metrics]]
kind = "auc"
{extra}"#,
        out = dir.join(format!("run-{pooling}")).display(),
    );
    let path = dir.join(format!("{pooling}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-sequence-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn build(path: &Path) -> Job {
    build_rank(path, &[], None)
}

/// Rank `pg`'s job of the recipe at `path` with `overrides` (one rank without a group).
fn build_rank(path: &Path, overrides: &[String], pg: Option<Arc<dyn ProcessGroup>>) -> Job {
    let options = LoadOptions { overrides: overrides.to_vec(), env: false };
    let (loaded, features) = load_and_check(path, &options, &registry()).unwrap_or_else(|d| panic!("{d}"));
    Job::build_rank(&loaded, &features, &registry(), pg).unwrap_or_else(|e| panic!("{e}"))
}

fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn a_sequence_table_trains_as_the_pooled_mean_it_averages_to() {
    for optimizer in [
        r#"{ kind = "sgd", lr = 0.5 }"#,
        r#"{ kind = "adagrad", lr = 0.1 }"#,
        r#"{ kind = "rowwise_adagrad", lr = 0.1 }"#,
        r#"{ kind = "adam", lr = 0.01 }"#,
    ] {
        let dir = tmp("parity");
        let mut pooled = build(&recipe(&dir, "mean", optimizer, ""));
        let mut seq = build(&recipe(&dir, "none", optimizer, ""));
        // The same initial weights (a sequence collection draws its own).
        let items = pooled.table_weights("items").unwrap().unwrap();
        seq.set_table_weights("items", &items).unwrap();
        let (users, dense) = (pooled.table_weights("users").unwrap().unwrap(), pooled.dense_parameters());
        assert_eq!(seq.table_weights("users").unwrap().unwrap(), users);
        assert_eq!(seq.dense_parameters(), dense);
        let batches: Vec<Batch> = pooled.batches(Split::Train, 32).unwrap().map(Result::unwrap).collect();
        let k = batches[0].sparse.key_index("items").unwrap();
        assert!(batches.iter().any(|b| b.sparse.feature(k).lengths.contains(&0)), "empty histories");
        assert!(batches.iter().any(|b| b.sparse.feature(k).lengths.iter().any(|&n| n > 5)), "long histories");
        for (i, b) in batches.iter().enumerate() {
            let (lp, ls) = (pooled.train_step(b).unwrap(), seq.train_step(b).unwrap());
            assert!((lp - ls).abs() < 1e-5, "{optimizer}: step {i}: loss {lp} pooled vs {ls} sequence");
        }
        let what = format!("{optimizer}: items after {} steps", batches.len());
        close(
            &what,
            &seq.table_weights("items").unwrap().unwrap(),
            &pooled.table_weights("items").unwrap().unwrap(),
            1e-5,
        );
        let (ep, es) = (pooled.evaluate().unwrap(), seq.evaluate().unwrap());
        assert!((ep["auc"] - es["auc"]).abs() < 1e-4, "{optimizer}: eval {ep:?} vs {es:?}");
    }
}

/// TorchRec's sharded EC: the sequence table sharded over 2 and 3 thread ranks (each rank
/// training its slice of the global batch) trains as one rank on the global batch.
#[test]
fn sharded_sequence_tables_train_as_one_rank() {
    let optimizer = r#"{ kind = "rowwise_adagrad", lr = 0.1 }"#;
    for sharding in ["table_wise", "row_wise", "column_wise", "data_parallel"] {
        let dir = tmp(&format!("dist-{sharding}"));
        let path = recipe(&dir, "none", optimizer, "");
        let constraint = format!("tables[1].constraints.sharding_types=[\"{sharding}\"]");
        let mut one = build_rank(&path, std::slice::from_ref(&constraint), None);
        let global: Vec<Batch> =
            one.batches(Split::Train, 24).unwrap().map(Result::unwrap).filter(|b| b.batch_size == 24).collect();
        assert!(global.len() >= 15, "{} global batches", global.len());
        let want: Vec<f64> = global.iter().map(|b| one.train_step(b).unwrap()).collect();
        let want_items = one.table_weights("items").unwrap().unwrap();
        // Three ranks, and two with the sparse-dist pipeline (batch i+1's pooled input dist on
        // the stage thread while batch i trains).
        for (world, pipeline) in [(2, "base"), (3, "base"), (2, "sparse_dist")] {
            let overrides =
                [constraint.clone(), format!("topology.world_size={world}"), format!("pipeline.kind=\"{pipeline}\"")];
            let per = 24 / world;
            let out = ThreadGroup::run(world, Duration::from_secs(120), |pg| {
                let rank = pg.rank();
                let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
                let mut job = build_rank(&path, &overrides, Some(pg));
                let placed =
                    job.plan().tables.iter().find(|t| t.name == "items").map(|t| format!("{:?}", t.sharding_type));
                let mine: Vec<Batch> = global.iter().map(|b| slice(b, rank * per, (rank + 1) * per)).collect();
                let losses: Vec<f64> =
                    (0..mine.len()).map(|i| job.train_step_ahead(&mine[i], mine.get(i + 1)).unwrap()).collect();
                (losses, job.table_weights("items").unwrap().unwrap(), placed)
            });
            let (losses, items, placed) = out.into_iter().next().unwrap().unwrap_or_else(|e| panic!("rank 0: {e}"));
            let what = format!("{sharding} on {world} ranks, {pipeline} pipeline (planned {placed:?})");
            assert!(placed.is_some_and(|p| p.to_lowercase().replace('_', "") == sharding.replace('_', "")), "{what}");
            for (i, (got, want)) in losses.iter().zip(&want).enumerate() {
                assert!((got - want).abs() <= 1e-5 * want.abs(), "{what}: step {i}: loss {got} vs one rank's {want}");
            }
            close(&format!("{what}: items"), &items, &want_items, 1e-5);
            eprintln!("{what}: {} steps as one rank's (last loss {})", losses.len(), losses[losses.len() - 1]);
        }
    }
}

/// A checkpoint of sequence tables sharded row-wise over 2 ranks loads on 1 and on 3 ranks, and
/// a run resumes from it on 3 ranks with the table column-wise.
#[test]
fn a_sharded_sequence_checkpoint_loads_on_other_world_sizes() {
    let dir = tmp("reshard");
    let path = recipe(&dir, "none", r#"{ kind = "adagrad", lr = 0.1 }"#, "");
    let sharded = |world: usize| {
        vec!["tables[1].constraints.sharding_types=[\"row_wise\"]".to_string(), format!("topology.world_size={world}")]
    };
    let overrides = sharded(2);
    let trained = ThreadGroup::run(2, Duration::from_secs(120), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut job = build_rank(&path, &overrides, Some(pg));
        let summary = job.run().unwrap_or_else(|e| panic!("{e}"));
        (summary, job.table_weights("items").unwrap().unwrap())
    });
    let (summary, items) = trained.into_iter().next().unwrap().unwrap_or_else(|e| panic!("rank 0: {e}"));
    let ck_dir = summary.output_dir.join(format!("checkpoints/step-{:08}", summary.steps));
    let open = || trainrec::engine::checkpoint::Checkpoint::open(&ck_dir).unwrap_or_else(|e| panic!("{e}"));
    let mut one = build(&path);
    one.load_checkpoint(&open()).unwrap();
    assert_eq!(one.table_weights("items").unwrap().unwrap(), items, "2 ranks -> 1");
    assert_eq!(one.evaluate().unwrap(), summary.eval, "2 ranks -> 1: eval");
    let overrides = sharded(3);
    let three = ThreadGroup::run(3, Duration::from_secs(120), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut job = build_rank(&path, &overrides, Some(pg));
        job.load_checkpoint(&open()).unwrap();
        (job.table_weights("items").unwrap().unwrap(), job.evaluate().unwrap())
    });
    let mut three_eval = None;
    for (r, got) in three.into_iter().enumerate() {
        let (got, eval) = got.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(got, items, "2 ranks -> 3, rank {r}");
        three_eval.get_or_insert(eval);
    }
    let three_eval = three_eval.unwrap();
    // `--resume` on 3 ranks with the table column-wise: the run goes on from the checkpoint's
    // step (here its last, so nothing trains) with the same table and evaluation.
    let overrides =
        vec!["tables[1].constraints.sharding_types=[\"column_wise\"]".to_string(), "topology.world_size=3".to_string()];
    let resumed = ThreadGroup::run(3, Duration::from_secs(120), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut job = build_rank(&path, &overrides, Some(pg));
        job.resume_from(open());
        let s = job.run().unwrap_or_else(|e| panic!("{e}"));
        (s, job.table_weights("items").unwrap().unwrap())
    });
    let (s, got) = resumed.into_iter().next().unwrap().unwrap_or_else(|e| panic!("rank 0: {e}"));
    assert_eq!(s.steps, summary.steps, "resumed at the checkpoint's step");
    assert_eq!(got, items, "2 ranks -> 3 column-wise, resumed");
    // The eval of 3 ranks gathers the predictions in another order than 2 ranks do, and
    // TorchRec's AUC breaks ties by order: compare with the 3-rank evaluation of the loaded
    // checkpoint.
    for (k, v) in &three_eval {
        assert!((s.eval[k] - v).abs() < 1e-9, "eval {k}: {} resumed vs {v} loaded", s.eval[k]);
    }
}

#[test]
fn a_sequence_table_is_checkpointed_and_restored() {
    let dir = tmp("checkpoint");
    let path = recipe(&dir, "none", r#"{ kind = "rowwise_adagrad", lr = 0.1 }"#, "");
    let mut job = build(&path);
    let summary = job.run().unwrap();
    assert_eq!(summary.steps, 15);
    let trained = job.table_weights("items").unwrap().unwrap();
    let ck = trainrec::engine::checkpoint::Checkpoint::open(&summary.output_dir.join("checkpoints/step-00000015"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut fresh = build(&path);
    assert_ne!(fresh.table_weights("items").unwrap().unwrap(), trained);
    fresh.load_checkpoint(&ck).unwrap();
    assert_eq!(fresh.table_weights("items").unwrap().unwrap(), trained);
    assert_eq!(fresh.evaluate().unwrap(), job.evaluate().unwrap());
    // The optimizer state came back too: one more step moves both alike.
    let b = job.batches(Split::Train, 32).unwrap().next().unwrap().unwrap();
    let (a, c) = (job.train_step(&b).unwrap(), fresh.train_step(&b).unwrap());
    assert_eq!(a.to_bits(), c.to_bits());
    assert_eq!(fresh.table_weights("items").unwrap(), job.table_weights("items").unwrap());
}

/// Position weights (on the pooled users table, beside the sequence table) train, are saved
/// with the dense parameters and come back from a checkpoint with the table.
#[test]
fn position_weights_are_checkpointed_and_restored() {
    let dir = tmp("checkpoint-pw");
    let path = recipe(&dir, "none", r#"{ kind = "adagrad", lr = 0.1 }"#, "");
    let overrides = ["tables[0].position_weighted.max_length=3".to_string()];
    let mut job = build_rank(&path, &overrides, None);
    let summary = job.run().unwrap();
    let trained = job.dense_parameters();
    let key = trained.keys().find(|k| k.ends_with("position_weights.user")).expect("position weights").clone();
    assert_eq!(trained[&key].len(), 3);
    assert!(trained[&key].iter().any(|&w| (w - 1.0).abs() > 1e-4), "trained: {:?}", trained[&key]);
    let ck = trainrec::engine::checkpoint::Checkpoint::open(&summary.output_dir.join("checkpoints/step-00000015"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut fresh = build_rank(&path, &overrides, None);
    assert!(fresh.dense_parameters()[&key].iter().all(|&w| w == 1.0), "position weights start at 1");
    fresh.load_checkpoint(&ck).unwrap();
    assert_eq!(fresh.dense_parameters()[&key], trained[&key]);
    assert_eq!(fresh.table_weights("users").unwrap(), job.table_weights("users").unwrap());
    assert_eq!(fresh.evaluate().unwrap(), job.evaluate().unwrap());
}

#[test]
fn validation_refuses_what_the_sequence_path_cannot_run() {
    let dir = tmp("refusals");
    let path = recipe(&dir, "none", r#"{ kind = "sgd", lr = 0.1 }"#, "");
    let check = |overrides: &[&str], registry: &Registry| -> String {
        let options = LoadOptions { overrides: overrides.iter().map(|s| s.to_string()).collect(), env: false };
        match load_and_check(&path, &options, registry) {
            Ok(_) => panic!("{overrides:?} validates"),
            Err(d) => d.to_string(),
        }
    };
    // A model that reads no sequences, named at the table's pooling with its line.
    let e = check(&[], &Registry::builtin().model::<NoSequences>());
    assert!(e.contains("tables[1].pooling") && e.contains("reads no sequence features"), "{e}");
    assert!(e.contains("none.toml:32"), "{e}");
    // CUDA, a cache, clipping.
    let e = check(&["topology.compute_device=\"cuda\""], &registry());
    assert!(e.contains("a sequence table has no CUDA path yet"), "{e}");
    let e = check(&["tables[1].max_gradient=1.0"], &registry());
    assert!(e.contains("tables[1].max_gradient"), "{e}");
    // Position weights on the pooled users table: sum pooling, a sane length, CPU, no cache.
    let pw = "tables[0].position_weighted.max_length";
    let e = check(&[&format!("{pw}=0")], &registry());
    assert!(e.contains(pw) && e.contains("must be in 1..="), "{e}");
    let e = check(&[&format!("{pw}=4"), "tables[0].pooling=\"mean\""], &registry());
    assert!(e.contains("tables[0].position_weighted") && e.contains("need sum pooling"), "{e}");
    let e = check(&[&format!("{pw}=4"), "tables[0].max_gradient=1.0"], &registry());
    assert!(e.contains("tables[0].max_gradient"), "{e}");
    let e = check(&[&format!("{pw}=4"), "topology.compute_device=\"cuda\""], &registry());
    assert!(e.contains("position weights have no CUDA path yet"), "{e}");
}

/// The same model under a kind that does not declare `READS_SEQUENCES`.
struct NoSequences(MeanOfSequences);

impl DenseModel for NoSequences {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor {
        self.0.forward(dense, sparse, train)
    }
}

impl TypedModel for NoSequences {
    type Config = MeanConfig;
    const KIND: &'static str = "mean_of_sequences";

    fn build(vs: &nn::Path, config: &MeanConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        Ok(Self(MeanOfSequences::build(vs, config, inputs)?))
    }
}
