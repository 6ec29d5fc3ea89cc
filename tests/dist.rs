//! Training across ranks through the engine: a recipe trained on 2 and 3 ranks of the thread
//! backend (tables sharded by the plan, dense model data-parallel) gives the same dense
//! parameters, table weights, losses and eval metrics as one rank trained on the same global
//! batches; and `trainrec run` trains the shipped 2-rank recipe.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use schemars::JsonSchema;
use serde::Deserialize;
use trainrec::comm::{ProcessGroup, ThreadGroup};
use trainrec::data::{Batch, BatchStream, DataError, FeatureSchema, Sampler, SamplerContext, Split};
use trainrec::engine::load_and_check;
use trainrec::recipe::LoadOptions;
use trainrec::sparse::KeyedJaggedTensor;
use trainrec::{Job, Registry, TypedSampler};

/// Global batches cut into one slice per rank: rank `r` of `W` gets the `r`-th of `W`
/// near-equal slices (uneven when `global_batch` is not a multiple of `W`), so any world size
/// sees the same global batches.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SlicesConfig {
    /// Examples per global batch.
    global_batch: usize,
    /// Training batches per epoch.
    batches: u64,
    /// Send each rank's slice deduplicated (VBE).
    #[serde(default)]
    dedup: bool,
    /// `[rank, batch]`: that rank's sampler fails on that training batch (a rank that dies).
    #[serde(default)]
    fail_at: Option<[u64; 2]>,
    /// Give every example a sample weight in [0, 3).
    #[serde(default)]
    weighted: bool,
}

/// One example of [`Slices`]: dense features, the ids of features a and b, label, weight.
type Example = (Vec<f32>, [Vec<i64>; 2], f32, f32);

struct Slices {
    schema: FeatureSchema,
    config: SlicesConfig,
    rows: [u64; 2],
    rank: usize,
    world: usize,
}

impl Slices {
    /// The global batch's examples: (dense, ids of features a and b, label, weight).
    fn global(&self, split: Split, index: u64) -> Vec<Example> {
        let salt = if split == Split::Eval { 1 << 40 } else { 0 };
        let mut rng = StdRng::seed_from_u64(salt + index);
        (0..self.config.global_batch)
            .map(|_| {
                let dense: Vec<f32> = (0..3).map(|_| rng.random_range(0.0..1.0)).collect();
                let ids = [0, 1].map(|f| {
                    let n = rng.random_range(0..3usize);
                    (0..n).map(|_| rng.random_range(0..self.rows[f] as i64)).collect::<Vec<_>>()
                });
                let label = if dense[0] + 0.1 * ids[0].len() as f32 > 0.7 { 1.0 } else { 0.0 };
                let weight = if self.config.weighted { rng.random_range(0.0..3.0) } else { 1.0 };
                (dense, ids, label, weight)
            })
            .collect()
    }

    fn slice(&self, split: Split, index: u64) -> Result<Batch, DataError> {
        if split == Split::Train && self.config.fail_at == Some([self.rank as u64, index]) {
            return Err(DataError::Config {
                key: "fail_at".into(),
                message: format!("rank {} fails on purpose", self.rank),
            });
        }
        let all = self.global(split, index);
        let (g, w) = (all.len(), self.world);
        let start = self.rank * (g / w) + self.rank.min(g % w);
        let len = g / w + usize::from(self.rank < g % w);
        let mine = &all[start..start + len];
        let dense = mine.iter().flat_map(|e| e.0.clone()).collect();
        let (mut values, mut lengths) = (Vec::new(), Vec::new());
        for f in 0..2 {
            for e in mine {
                values.extend_from_slice(&e.1[f]);
                lengths.push(e.1[f].len() as u32);
            }
        }
        let sparse = KeyedJaggedTensor::new(vec!["a".into(), "b".into()], values, None, lengths, len)?;
        let sparse = if self.config.dedup { sparse.dedup()? } else { sparse };
        let labels = mine.iter().map(|e| e.2).collect();
        let weights = self.config.weighted.then(|| mine.iter().map(|e| e.3).collect());
        Ok(Batch { dense, num_dense: 3, sparse, labels, batch_size: len, groups: None, weights })
    }
}

impl TypedSampler for Slices {
    type Config = SlicesConfig;
    const KIND: &'static str = "global_slices";

    fn features(_: &SlicesConfig) -> FeatureSchema {
        FeatureSchema {
            num_dense: 3,
            sparse: vec!["a".into(), "b".into()],
            labels: vec!["label".into()],
            grouping_key: None,
        }
    }

    fn build(config: SlicesConfig, ctx: &SamplerContext) -> Result<Self, DataError> {
        let rows = [ctx.rows("a")?, ctx.rows("b")?];
        Ok(Self { schema: Self::features(&config), config, rows, rank: ctx.rank, world: ctx.world_size.max(1) })
    }
}

impl Sampler for Slices {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    fn batches(&self, split: Split, _epoch: u64, _batch_size: usize) -> Result<BatchStream, DataError> {
        let n = if split == Split::Eval { 2 } else { self.config.batches };
        let me = Slices {
            schema: self.schema.clone(),
            config: self.config.clone(),
            rows: self.rows,
            rank: self.rank,
            world: self.world,
        };
        Ok(Box::new((0..n).map(move |i| me.slice(split, i))))
    }

    fn weighted(&self) -> bool {
        self.config.weighted
    }

    /// Every rank reads its share of every batch.
    fn resume_offset(&self, read: u64, _old_world: usize, _new_world: usize) -> u64 {
        read
    }
}

/// Recipes written so far by this test process (each gets its own run directory).
static RUNS: AtomicUsize = AtomicUsize::new(0);

fn recipe(dir: &Path, world: usize, sharding: &str, dedup: bool, mc: bool) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("w{world}-{sharding}-{dedup}-{mc}.toml"));
    // Managed collisions on `ta`: raw ids of 0..200 for its 40 rows, an eviction every 2 steps.
    let has_mc = mc;
    let mc = if mc {
        r#"mc = { input_hash_size = 200, eviction_policy = "distance_lfu", eviction_interval = 2 }"#
    } else {
        ""
    };
    let text = format!(
        r#"
[run]
name = "dist-{world}-{sharding}-{dedup}-{has_mc}"
seed = 5
threads = 1
output_dir = "{out}"

[data]
batch_size = 8

[data.sampler]
kind = "global_slices"
global_batch = 13
batches = 5
dedup = {dedup}

[[tables]]
name = "ta"
features = ["a"]
rows = 40
dim = 4
constraints = {{ sharding_types = ["{sharding}"] }}
{mc}

[[tables]]
name = "tb"
features = ["b"]
rows = 30
dim = 4
pooling = "mean"
constraints = {{ sharding_types = ["table_wise"] }}

[model]
kind = "dlrm"
dense_arch = [8, 4]
over_arch = [8, 1]

[optimizer]
sparse = {{ kind = "sgd", lr = 0.5 }}
dense = {{ kind = "sgd", lr = 0.5 }}

[topology]
world_size = {world}

[train]
epochs = 2
log_every = 1
progress = false

[[metrics]]
kind = "auc"

[[metrics]]
kind = "ne"
"#,
        // One directory per recipe written: tests running side by side (the weighted and the
        // unweighted row-wise runs) would otherwise share one, and the second is refused its lock.
        out = dir
            .join(format!("run-{world}-{sharding}-{dedup}-{has_mc}-{}", RUNS.fetch_add(1, Ordering::Relaxed)))
            .display()
    );
    write_atomic(&path, &text);
    path
}

/// Tests running in parallel write the same recipes: each sees a whole file, never a
/// half-written one.
fn write_atomic(path: &Path, text: &str) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{n}"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

struct Trained {
    dense: std::collections::BTreeMap<String, Vec<f32>>,
    tables: Vec<Vec<f32>>,
    loss: (f64, f64),
    eval: std::collections::BTreeMap<String, f64>,
    steps: u64,
    /// Rank 0's managed-collision statistics (of the partitions it runs).
    mc: std::collections::BTreeMap<String, trainrec::embedding::mc::McStats>,
}

fn train(world: usize, sharding: &str, dedup: bool) -> Trained {
    train_with(world, sharding, dedup, &[])
}

fn train_with(world: usize, sharding: &str, dedup: bool, overrides: &[&str]) -> Trained {
    train_full(world, sharding, dedup, false, overrides)
}

fn train_full(world: usize, sharding: &str, dedup: bool, mc: bool, overrides: &[&str]) -> Trained {
    let dir = std::env::temp_dir().join(format!("trainrec-dist-{}", std::process::id()));
    let path = recipe(&dir, world, sharding, dedup, mc);
    train_path(world, &path, overrides, None)
}

/// Trains recipe `path` on `world` ranks, from checkpoint directory `resume` when given.
fn train_path(world: usize, path: &Path, overrides: &[&str], resume: Option<&Path>) -> Trained {
    let registry = Registry::builtin().sampler::<Slices>();
    let options = LoadOptions { overrides: overrides.iter().map(|o| o.to_string()).collect(), env: false };
    let (loaded, features) = load_and_check(path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
    let finish = |mut job: Job| {
        if let Some(dir) = resume {
            job.resume_from(trainrec::engine::checkpoint::Checkpoint::open(dir).unwrap_or_else(|e| panic!("{e}")));
        }
        let s = job.run().unwrap_or_else(|e| panic!("{e}"));
        let tables: Vec<Vec<f32>> = ["ta", "tb"].iter().map(|t| job.table_weights(t).unwrap().unwrap()).collect();
        // The named state holds this rank's blocks of the tables (the whole tables on one rank).
        let mut cells = 0;
        for e in job.named_state().iter().filter(|e| e.name.starts_with("sparse.")) {
            let t = ["sparse.ta.weight", "sparse.tb.weight"].iter().position(|n| *n == e.name).expect("a table");
            let dim = e.shape[1];
            let block: Vec<f32> = (e.offset[0]..e.offset[0] + e.local_shape[0])
                .flat_map(|r| tables[t][r * dim + e.offset[1]..][..e.local_shape[1]].to_vec())
                .collect();
            assert_eq!(e.data, block, "{}", e.name);
            cells += if e.replicated { 0 } else { e.data.len() };
        }
        assert!(cells > 0 || world > 1, "one rank holds every cell");
        Trained {
            dense: job.dense_parameters(),
            tables,
            loss: s.train_loss,
            eval: s.eval,
            steps: s.steps,
            mc: job.mc_stats(),
        }
    };
    if world == 1 {
        return finish(Job::build(&loaded, &features, &registry).unwrap_or_else(|e| panic!("{e}")));
    }
    let mut out = ThreadGroup::run(world, Duration::from_secs(60), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        finish(Job::build_rank(&loaded, &features, &registry, Some(pg)).unwrap_or_else(|e| panic!("{e}")))
    });
    out.remove(0).unwrap_or_else(|e| panic!("rank 0: {e}"))
}

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{what}[{i}]: {x} vs one rank's {y}");
    }
}

/// `many` (a run on several ranks, described by `what`) took the steps of `one` (the run on one
/// rank) and ended with its losses, dense parameters, tables and eval metrics, up to rounding.
fn assert_trains_alike(what: &str, many: &Trained, one: &Trained) {
    assert_eq!(many.steps, one.steps, "{what}");
    assert!(
        (many.loss.0 - one.loss.0).abs() < 1e-4 && (many.loss.1 - one.loss.1).abs() < 1e-4,
        "{what}: {:?} vs {:?}",
        many.loss,
        one.loss
    );
    assert_eq!(many.dense.keys().collect::<Vec<_>>(), one.dense.keys().collect::<Vec<_>>(), "{what}");
    for (name, v) in &one.dense {
        close(&format!("{what}: dense {name}"), &many.dense[name], v);
    }
    for (t, (a, b)) in many.tables.iter().zip(&one.tables).enumerate() {
        close(&format!("{what}: table {t}"), a, b);
    }
    for (k, v) in &one.eval {
        assert!((many.eval[k] - v).abs() < 1e-4, "{what}: eval {k} {} vs {v}", many.eval[k]);
    }
}

#[test]
fn two_and_three_ranks_train_like_one_rank_on_the_global_batch() {
    // 0.0001 MiB: 26-float gradient buckets, so the dense model's gradients travel in many.
    let tiny = ["topology.gradient_bucket_mib=0.0001"];
    for sharding in ["data_parallel", "row_wise", "table_wise", "column_wise"] {
        let one = train(1, sharding, false);
        assert_eq!(one.steps, 10);
        // Deduplicated (VBE) batches train like the full ones, on one rank too.
        for (world, dedup, buckets) in
            [(2, false, &[][..]), (3, false, &[]), (1, true, &[]), (2, true, &[]), (3, true, &[]), (2, false, &tiny)]
        {
            let many = train_with(world, sharding, dedup, buckets);
            assert_trains_alike(&format!("{sharding} on {world} ranks (dedup {dedup}, {buckets:?})"), &many, &one);
        }
    }
}

/// With sample weights, the loss of a global batch is its weighted mean whatever the ranks'
/// slices weigh (uneven slices on three ranks): every world size trains alike.
#[test]
fn weighted_batches_train_alike_on_any_number_of_ranks() {
    let weighted = ["data.sampler.weighted=true"];
    for sharding in ["data_parallel", "row_wise"] {
        let one = train_with(1, sharding, false, &weighted);
        let plain = train(1, sharding, false);
        assert!((one.loss.1 - plain.loss.1).abs() > 1e-4, "the weights change the loss: {:?}", one.loss);
        for world in [2, 3] {
            let many = train_with(world, sharding, false, &weighted);
            assert_trains_alike(&format!("weighted {sharding} on {world} ranks"), &many, &one);
        }
    }
}

#[test]
fn dynamic_tables_across_ranks_train_like_one_rank() {
    // Table ta (40 rows) keyed by raw ids from 0..200: admission after 2 sightings, rows
    // freed after 3 unseen steps, LRU at capacity. Every rank counts the global batch, so the
    // ranks' maps agree and the table shards any way.
    let dynamic = "tables[0].dynamic={admit_after=2,ttl_steps=3,eviction=\"lru\",id_space=200}";
    // Run directories of their own: other tests train the same recipes at the same time.
    let out = |what: &str| {
        let d = std::env::temp_dir().join(format!("trainrec-dist-{}-dynamic-{what}", std::process::id()));
        format!("run.output_dir=\"{}\"", d.display())
    };
    for sharding in ["row_wise", "column_wise", "data_parallel"] {
        let plain = train_with(1, sharding, false, &[&out(&format!("plain-{sharding}"))]);
        let one = train_with(1, sharding, false, &[dynamic, &out(&format!("1-{sharding}"))]);
        assert_ne!(one.tables[0], plain.tables[0], "a dynamic ta learns something else");
        for world in [2, 3] {
            let many = train_with(world, sharding, false, &[dynamic, &out(&format!("{world}-{sharding}"))]);
            assert_trains_alike(&format!("{sharding} with a dynamic table on {world} ranks"), &many, &one);
        }
    }
}

#[test]
fn dynamic_tables_admitted_on_their_owner_ranks_train_like_one_rank() {
    // `partitions = world` id maps over row-wise shards in the same blocks: each rank admits,
    // counts and evicts the ids hashed to its block (owner-rank admission); one rank runs
    // every map. Saved on the owners, the maps resume on another world size (every rank then
    // runs every map).
    let out = |what: &str| {
        let d = std::env::temp_dir().join(format!("trainrec-dist-{}-dynowner-{what}", std::process::id()));
        format!("run.output_dir=\"{}\"", d.display())
    };
    for world in [2, 3] {
        let dynamic =
            format!("tables[0].dynamic={{admit_after=2,ttl_steps=3,eviction=\"lfu\",id_space=200,partitions={world}}}");
        let one = train_with(1, "row_wise", false, &[&dynamic, &out(&format!("1-{world}"))]);
        let single = train_with(
            1,
            "row_wise",
            false,
            &[
                "tables[0].dynamic={admit_after=2,ttl_steps=3,eviction=\"lfu\",id_space=200}",
                &out(&format!("s-{world}")),
            ],
        );
        assert_ne!(one.tables[0], single.tables[0], "{world} maps admit other ids than one");
        let many = train_with(world, "row_wise", false, &[&dynamic, &out(&format!("{world}"))]);
        assert_trains_alike(&format!("{world} owner-admitted maps on {world} ranks"), &many, &one);
        let replicated = train_with(world, "column_wise", false, &[&dynamic, &out(&format!("cw-{world}"))]);
        assert_trains_alike(&format!("{world} maps run on every rank"), &replicated, &one);
    }
    let dynamic = "tables[0].dynamic={admit_after=2,ttl_steps=3,eviction=\"lfu\",id_space=200,partitions=2}";
    let dir = std::env::temp_dir().join(format!("trainrec-dist-ck-dynowner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    train_path(2, &checkpoint_recipe(2, "row_wise", 6, Some(6), &dir), &[dynamic], None);
    let ck = trainrec::engine::checkpoint::latest(&dir.join("checkpoints")).unwrap().expect("a checkpoint");
    let through = train_path(2, &checkpoint_recipe(2, "row_wise", 10, None, &dir.join("through")), &[dynamic], None);
    for to in [1, 2, 3] {
        let resumed = train_path(to, &checkpoint_recipe(to, "row_wise", 10, None, &dir), &[dynamic], Some(&ck));
        assert_trains_alike(&format!("owner-admitted maps saved on 2 ranks resumed on {to}"), &resumed, &through);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn managed_collisions_across_ranks_train_like_one_rank() {
    for sharding in ["row_wise", "column_wise", "data_parallel"] {
        let plain = train(1, sharding, false);
        for world in [2, 3] {
            // Row-wise, each rank remaps the ids of its own block: `world` partitions, which
            // one rank runs too when told to. The others run one module on every rank.
            let split = format!("tables[0].mc.partitions={world}");
            let overrides: &[&str] = if sharding == "row_wise" { &[&split] } else { &[] };
            let one = train_full(1, sharding, false, true, overrides);
            assert_ne!(one.tables[0], plain.tables[0], "managed collisions change what table ta learns");
            let many = train_full(world, sharding, false, true, &[]);
            let what = format!("{sharding} with managed collisions on {world} ranks");
            // 40 rows: one module tracks 39 ids; under the owner-rank remap rank 0 runs only
            // its block's module (rows 0..20 or 0..14, its last row reserved).
            let capacity = if sharding == "row_wise" { 40u64.div_ceil(world as u64) - 1 } else { 39 };
            assert_eq!(many.mc["ta"].capacity, capacity, "{what}: rank 0's slots");
            assert_eq!(one.mc["ta"].capacity, 40 - if sharding == "row_wise" { world as u64 } else { 1 }, "{what}");
            assert!((many.loss.0 - one.loss.0).abs() < 1e-4, "{what}: {:?} vs {:?}", many.loss, one.loss);
            for (t, (a, b)) in many.tables.iter().zip(&one.tables).enumerate() {
                close(&format!("{what}: table {t}"), a, b);
            }
            for (k, v) in &one.eval {
                assert!((many.eval[k] - v).abs() < 1e-4, "{what}: eval {k} {} vs {v}", many.eval[k]);
            }
        }
    }
}

/// The test recipe on `world` ranks with table `ta` sharded `sharding`, trained for `steps`
/// (checkpointing every `every`) with row-wise Adagrad, into run directory `out`.
fn checkpoint_recipe(world: usize, sharding: &str, steps: u64, every: Option<u64>, out: &Path) -> PathBuf {
    checkpoint_recipe_mc(world, sharding, steps, every, out, false)
}

/// [`checkpoint_recipe`], with managed collisions on `ta` when `mc`.
fn checkpoint_recipe_mc(world: usize, sharding: &str, steps: u64, every: Option<u64>, out: &Path, mc: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-dist-{}", std::process::id()));
    let path = recipe(&dir, world, sharding, false, mc);
    let every = every.map_or(String::new(), |n| format!("checkpoint_every = {n}\n"));
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("epochs = 2\n", &format!("steps = {steps}\n{every}"))
        .replace(r#"sparse = { kind = "sgd", lr = 0.5 }"#, r#"sparse = { kind = "rowwise_adagrad", lr = 0.5 }"#);
    let text = text
        .lines()
        .map(
            |l| if l.starts_with("output_dir") { format!("output_dir = \"{}\"", out.display()) } else { l.to_string() },
        )
        .collect::<Vec<_>>()
        .join("\n");
    let path = dir.join(format!("ck-{world}-{sharding}-{steps}-{mc}.toml"));
    write_atomic(&path, &text);
    path
}

#[test]
fn checkpoints_reshard_between_world_sizes_and_sharding_types() {
    let latest =
        |out: &Path| trainrec::engine::checkpoint::latest(&out.join("checkpoints")).unwrap().expect("a checkpoint");
    // (saved on, sharded as) -> (loaded on, sharded as); table `tb` stays table-wise.
    for ((from, s_from), (to, s_to)) in [
        ((2, "row_wise"), (3, "column_wise")),
        ((3, "column_wise"), (1, "row_wise")),
        ((3, "row_wise"), (2, "data_parallel")),
        ((2, "table_wise"), (3, "row_wise")),
        ((1, "row_wise"), (2, "table_row_wise")),
    ] {
        let what = format!("{s_from} on {from} ranks -> {s_to} on {to}");
        let out = std::env::temp_dir().join(format!("trainrec-dist-ck-{}-{from}-{s_from}-{to}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        // 6 steps (into the second epoch), checkpointed at the end.
        let saved = train_path(from, &checkpoint_recipe(from, s_from, 6, Some(6), &out), &[], None);
        let ck = latest(&out);
        // The export holds the whole tables as trained.
        let file = out.join("model.safetensors");
        trainrec::engine::export::export(&ck, &file).unwrap_or_else(|e| panic!("{e}"));
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (t, name) in ["ta", "tb"].iter().enumerate() {
            let v = st.tensor(&format!("embedding_bags.{name}.weight")).unwrap();
            let w: Vec<f32> = v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(w, saved.tables[t], "{what}: exported table {name}");
        }
        // Loaded on the other layout without training on: the same tables, the same forward.
        let loaded = train_path(to, &checkpoint_recipe(to, s_to, 6, None, &out), &[], Some(&ck));
        assert_eq!(loaded.steps, 6, "{what}");
        assert_eq!(loaded.tables, saved.tables, "{what}: tables");
        for (name, v) in &saved.dense {
            assert_eq!(&loaded.dense[name], v, "{what}: dense {name}");
        }
        for (k, v) in &saved.eval {
            // Pooled in another order across ranks: the same up to fp32 rounding.
            assert!((loaded.eval[k] - v).abs() < 1e-6, "{what}: eval {k} {} vs {v}", loaded.eval[k]);
        }
        // Training on from the checkpoint matches training through without one. Row-wise
        // Adagrad's per-row state carries over exactly when the new blocks span whole rows.
        if s_to != "column_wise" {
            let through_dir = out.join("through");
            let through = train_path(from, &checkpoint_recipe(from, s_from, 10, None, &through_dir), &[], None);
            let resumed = train_path(to, &checkpoint_recipe(to, s_to, 10, None, &out), &[], Some(&ck));
            assert_eq!(resumed.steps, 10, "{what}");
            for (t, (a, b)) in resumed.tables.iter().zip(&through.tables).enumerate() {
                close(&format!("{what}: resumed table {t}"), a, b);
            }
            for (name, v) in &through.dense {
                close(&format!("{what}: resumed dense {name}"), &resumed.dense[name], v);
            }
        }
    }
}

#[test]
fn dynamic_tables_resume_on_other_world_sizes() {
    // Saved on 2 row-wise ranks after 6 steps; resumed on 1 and 3 ranks (the map is the same on
    // every rank, in the checkpoint once), training goes on as on 2 ranks without a stop.
    let dynamic = "tables[0].dynamic={admit_after=2,ttl_steps=3,eviction=\"lfu\",id_space=200}";
    let out = std::env::temp_dir().join(format!("trainrec-dist-ck-dynamic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    train_path(2, &checkpoint_recipe(2, "row_wise", 6, Some(6), &out), &[dynamic], None);
    let ck = trainrec::engine::checkpoint::latest(&out.join("checkpoints")).unwrap().expect("a checkpoint");
    let through = train_path(2, &checkpoint_recipe(2, "row_wise", 10, None, &out.join("through")), &[dynamic], None);
    for to in [1, 3] {
        let resumed = train_path(to, &checkpoint_recipe(to, "row_wise", 10, None, &out), &[dynamic], Some(&ck));
        assert_trains_alike(&format!("a dynamic table saved on 2 ranks resumed on {to}"), &resumed, &through);
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A dynamic table under every fused optimizer (and fp16 / bf16 weights): 30 rows for ids
/// from 200 (admitted at once, the least recently used row taken), so rows change hands and
/// restart with fresh weights and zero optimizer state while others keep theirs; a run
/// resumed from the live-rows checkpoint goes on bit for bit (a checkpoint without the live
/// rows' optimizer state fails this).
#[test]
fn dynamic_tables_resume_bit_for_bit_under_every_optimizer_and_precision() {
    let dynamic = "tables[0].dynamic={admit_after=1,eviction=\"lru\",id_space=200}";
    let dir = std::env::temp_dir().join(format!("trainrec-dist-ck-dynopt-{}", std::process::id()));
    for (opt, precision) in [
        ("{kind=\"sgd\",lr=0.5}", "fp32"),
        ("{kind=\"adagrad\",lr=0.5}", "fp32"),
        ("{kind=\"rowwise_adagrad\",lr=0.5}", "fp32"),
        ("{kind=\"adam\",lr=0.05}", "fp32"),
        ("{kind=\"partial_rowwise_adam\",lr=0.05}", "fp32"),
        ("{kind=\"lamb\",lr=0.05}", "fp32"),
        ("{kind=\"rowwise_adagrad\",lr=0.5}", "fp16"),
        ("{kind=\"adam\",lr=0.05}", "bf16"),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
        let over = [
            dynamic.to_string(),
            "tables[0].rows=30".into(),
            format!("optimizer.sparse={opt}"),
            format!("tables[0].precision=\"{precision}\""),
        ];
        let over: Vec<&str> = over.iter().map(String::as_str).collect();
        let what = format!("{opt} {precision}");
        train_path(1, &checkpoint_recipe(1, "table_wise", 6, Some(6), &dir), &over, None);
        let ck = trainrec::engine::checkpoint::latest(&dir.join("checkpoints")).unwrap().expect("a checkpoint");
        let through = train_path(1, &checkpoint_recipe(1, "table_wise", 10, None, &dir.join("through")), &over, None);
        let resumed = train_path(1, &checkpoint_recipe(1, "table_wise", 10, None, &dir), &over, Some(&ck));
        same(&what, &resumed, &through);
        let plain = train_path(1, &checkpoint_recipe(1, "table_wise", 10, None, &dir.join("plain")), &over[1..], None);
        assert_ne!(through.tables[0], plain.tables[0], "{what}: the dynamic table learns something else");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn owner_remapped_managed_collisions_resume_on_other_world_sizes() {
    let out = std::env::temp_dir().join(format!("trainrec-dist-ck-mc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    // Two row-wise ranks: each remaps its own block (2 partitions), and saves its module.
    let saved = train_path(2, &checkpoint_recipe_mc(2, "row_wise", 6, Some(6), &out, true), &[], None);
    assert_eq!(saved.mc["ta"].capacity, 19, "rank 0 runs partition 0 only");
    let ck = trainrec::engine::checkpoint::latest(&out.join("checkpoints")).unwrap().expect("a checkpoint");
    // The export places each partition's ids in its rows: raw ids 0..100 in rows 0..20 (row
    // 19 reserved), 100..200 in rows 20..40 (row 39 reserved).
    let file = out.join("model.safetensors");
    trainrec::engine::export::export(&ck, &file).unwrap_or_else(|e| panic!("{e}"));
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor("managed_collisions.ta.ids").unwrap();
    let ids: Vec<i64> = v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ids.len(), 40);
    assert_eq!((ids[19], ids[39]), (-1, -1), "reserved rows");
    let tracked: Vec<(usize, i64)> = ids.iter().copied().enumerate().filter(|&(_, id)| id >= 0).collect();
    assert!(tracked.iter().any(|&(r, _)| r < 20) && tracked.iter().any(|&(r, _)| r >= 20), "{ids:?}");
    for (r, id) in tracked {
        assert_eq!(r < 20, id < 100, "row {r} holds raw id {id}");
    }
    // Resumed on one rank and on three (blocks of 14 rows: not the partitions', so every rank
    // runs both modules), training goes on as on two.
    let through = train_path(2, &checkpoint_recipe_mc(2, "row_wise", 10, None, &out.join("through"), true), &[], None);
    for to in [1, 3] {
        let resumed = train_path(to, &checkpoint_recipe_mc(to, "row_wise", 10, None, &out, true), &[], Some(&ck));
        let what = format!("2 row-wise ranks with managed collisions resumed on {to}");
        assert_eq!(resumed.steps, 10, "{what}");
        assert_eq!(resumed.mc["ta"].capacity, 38, "{what}: both partitions run on rank 0");
        for (t, (a, b)) in resumed.tables.iter().zip(&through.tables).enumerate() {
            close(&format!("{what}: table {t}"), a, b);
        }
        for (name, v) in &through.dense {
            close(&format!("{what}: dense {name}"), &resumed.dense[name], v);
        }
        for (k, v) in &through.eval {
            assert!((resumed.eval[k] - v).abs() < 1e-4, "{what}: eval {k} {} vs {v}", resumed.eval[k]);
        }
    }
}

#[test]
fn table_row_wise_over_two_hosts_trains_like_one_rank() {
    let one = train(1, "table_row_wise", false);
    for (world, per_host) in [(4, "2"), (2, "1")] {
        let o = format!("topology.local_world_size={per_host}");
        let many = train_with(world, "table_row_wise", false, &[&o]);
        let what = format!("table_row_wise on {world} ranks, {per_host} per host");
        assert!((many.loss.0 - one.loss.0).abs() < 1e-4, "{what}: {:?} vs {:?}", many.loss, one.loss);
        for (t, (a, b)) in many.tables.iter().zip(&one.tables).enumerate() {
            close(&format!("{what}: table {t}"), a, b);
        }
        for (name, v) in &one.dense {
            close(&format!("{what}: dense {name}"), &many.dense[name], v);
        }
    }
}

#[test]
fn the_shipped_two_rank_recipe_learns_the_planted_signal() {
    let registry = custom_trainrec::registry();
    let out = std::env::temp_dir().join(format!("trainrec-dist-quickstart-{}", std::process::id()));
    let overrides = vec![
        "train.steps=300".to_string(),
        "train.eval_every=1000".to_string(),
        "train.progress=false".to_string(),
        "run.threads=1".to_string(),
        format!("run.output_dir={}", out.display()),
    ];
    let options = LoadOptions { overrides, env: false };
    let path = trainrec_tests::workspace().join("recipes/dist/quickstart_2ranks.toml");
    let (loaded, features) = load_and_check(&path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(loaded.recipe.topology.world_size, 2);
    let s = trainrec::engine::launch::run_threads(&loaded, &features, &registry).unwrap_or_else(|e| panic!("{e}"));
    // Both ranks' examples: 300 steps of 2 x 256.
    assert_eq!((s.steps, s.samples), (300, 300 * 512));
    assert!(s.eval["auc"] > 0.8, "{:?}", s.eval);
    assert!(s.train_loss.1 < s.train_loss.0, "{:?}", s.train_loss);
    // Rank 0 alone writes the run directory.
    for f in ["resolved.toml", "plan.json", "metrics.jsonl"] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let plan = std::fs::read_to_string(out.join("plan.json")).unwrap();
    assert!(plan.contains("\"world_size\": 2"), "{plan}");
}

#[test]
fn a_failing_rank_stops_the_others_with_its_own_error() {
    let registry = Registry::builtin().sampler::<Slices>();
    let dir = std::env::temp_dir().join(format!("trainrec-dist-fail-{}", std::process::id()));
    let path = recipe(&dir, 3, "row_wise", false, false);
    let options = LoadOptions { overrides: vec!["data.sampler.fail_at=[1, 2]".into()], env: false };
    let (loaded, features) = load_and_check(&path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
    let start = std::time::Instant::now();
    let Err(err) = trainrec::engine::launch::run_threads(&loaded, &features, &registry) else {
        panic!("the job should fail");
    };
    // The failing rank's own error, not its peers' "rank 1 left the group", and no hang.
    assert!(err.to_string().contains("rank 1 fails on purpose"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
}

/// `run.output_dir` of its own for a test's run `name`.
fn own_out(name: &str) -> String {
    let dir = std::env::temp_dir().join(format!("trainrec-dist-pipe-{}", std::process::id())).join(name);
    OWN_OUTS.with(|o| o.borrow_mut().push(dir.clone()));
    format!("run.output_dir=\"{}\"", dir.display())
}

thread_local! {
    /// The run directories [`own_out`] gave this test (each test runs on a thread of its own).
    static OWN_OUTS: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Removes the run directories [`own_out`] gave this test (a failed test keeps them).
fn remove_own_outs() {
    OWN_OUTS.with(|o| {
        for d in o.borrow_mut().drain(..) {
            let _ = std::fs::remove_dir_all(d);
        }
    });
}

fn same(what: &str, a: &Trained, b: &Trained) {
    assert_eq!(a.steps, b.steps, "{what}: steps");
    assert_eq!(a.loss, b.loss, "{what}: loss");
    assert_eq!(a.dense, b.dense, "{what}: dense parameters");
    assert_eq!(a.tables, b.tables, "{what}: tables");
    assert_eq!(a.eval, b.eval, "{what}: eval");
}

#[test]
fn pipelines_train_the_same_model_as_base_bit_for_bit() {
    for sharding in ["row_wise", "table_wise", "column_wise", "data_parallel"] {
        for (world, dedup) in [(1, false), (2, false), (3, true)] {
            let name = format!("{sharding}-{world}-{dedup}");
            let base = train_with(world, sharding, dedup, &[&own_out(&format!("{name}-base"))]);
            assert_eq!(base.steps, 10);
            for kind in ["sparse_dist", "prefetch_sparse_dist"] {
                let out = own_out(&format!("{name}-{kind}"));
                let piped = train_with(world, sharding, dedup, &[&format!("pipeline.kind=\"{kind}\""), &out]);
                same(&format!("{kind}: {sharding} on {world} ranks (dedup {dedup})"), &piped, &base);
            }
        }
    }
    remove_own_outs();
}

/// Jobs with managed collisions or dynamic tables (remapped on every rank): the pipelines
/// remap batch i+1 while step i trains and reset the rows it hands over after step i's
/// update, so they train the base pipeline's model bit for bit.
#[test]
fn pipelines_with_id_maps_train_the_same_model_as_base_bit_for_bit() {
    // Every id admitted at once into 4 rows, fewer than a batch's ids: batch i+1's new ids
    // take rows batch i trained, so a reset before batch i's update would show.
    let dynamic = "tables[0].dynamic={admit_after=1,eviction=\"lru\",id_space=200}";
    for sharding in ["table_wise", "column_wise", "data_parallel"] {
        for world in [1, 2] {
            for (what, mc, extra) in
                [("managed collisions", true, vec![]), ("a dynamic table", false, vec![dynamic, "tables[0].rows=4"])]
            {
                let name = format!("maps-{sharding}-{world}-{mc}");
                let base_out = own_out(&format!("{name}-base"));
                let mut over = vec![base_out.as_str()];
                over.extend(&extra);
                let base = train_full(world, sharding, false, mc, &over);
                for kind in ["sparse_dist", "prefetch_sparse_dist"] {
                    let (out, k) = (own_out(&format!("{name}-{kind}")), format!("pipeline.kind=\"{kind}\""));
                    let mut over = vec![out.as_str(), k.as_str()];
                    over.extend(&extra);
                    let piped = train_full(world, sharding, false, mc, &over);
                    same(&format!("{kind} with {what}: {sharding} on {world} ranks"), &piped, &base);
                }
            }
        }
    }
    remove_own_outs();
}

#[test]
fn prefetching_into_cached_shards_trains_like_tables_in_memory() {
    // Table ta of 400 rows cached at load factor 0.1, LFU: rows are evicted over the run, and
    // the cache holds the rows of the batch in training and of the one prefetched.
    let cached = r#"tables[0].constraints={sharding_types=["row_wise"], compute_kernels=["fused_uvm_caching"], cache={load_factor=0.1, algorithm="lfu"}}"#;
    let root = std::env::temp_dir().join(format!("trainrec-dist-pipe-{}", std::process::id()));
    for world in [1, 2] {
        let in_memory =
            train_with(world, "row_wise", false, &["tables[0].rows=400", &own_out(&format!("mem-{world}"))]);
        for kind in ["base", "prefetch_sparse_dist"] {
            let name = format!("cached-{world}-{kind}");
            let offload = format!("embedding.offload_dir=\"{}\"", root.display());
            let piped = train_with(
                world,
                "row_wise",
                false,
                &["tables[0].rows=400", cached, &format!("pipeline.kind=\"{kind}\""), &own_out(&name), &offload],
            );
            let what = format!("cached ta, {kind} on {world} ranks");
            same(&what, &piped, &in_memory);
            // Rank 0's cache evicted rows (its counters are on the train lines).
            let log = std::fs::read_to_string(root.join(&name).join("metrics.jsonl")).unwrap();
            let last: serde_json::Value =
                serde_json::from_str(log.lines().rfind(|l| l.contains("evictions")).expect("cache stats")).unwrap();
            let evictions: f64 = last["metrics"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.starts_with("cache/ta") && k.ends_with("/evictions"))
                .map(|(_, v)| v.as_f64().unwrap())
                .sum();
            assert!(evictions > 0.0, "{what}: {last}");
        }
    }
    remove_own_outs();
}

#[test]
fn managed_collisions_on_cached_tables_train_like_tables_in_memory() {
    // Managed collisions remap before the lookup, so the kernel behind them does not matter:
    // ta cached at load factor 0.75 (LRU) trains bit for bit like ta in memory, on one rank
    // (one module) and on two (the owner-rank remap into each rank's cached shard).
    let cached = r#"tables[0].constraints={sharding_types=["row_wise"], compute_kernels=["fused_uvm_caching"], cache={load_factor=0.75}}"#;
    let root = std::env::temp_dir().join(format!("trainrec-dist-pipe-{}", std::process::id()));
    let offload = format!("embedding.offload_dir=\"{}\"", root.display());
    for world in [1, 2] {
        let in_memory = train_full(world, "row_wise", false, true, &[&own_out(&format!("mc-mem-{world}"))]);
        let on_disk =
            train_full(world, "row_wise", false, true, &[cached, &offload, &own_out(&format!("mc-cached-{world}"))]);
        same(&format!("managed collisions on a cached ta, {world} ranks"), &on_disk, &in_memory);
        assert!(on_disk.mc["ta"].tracked > 0, "ids were tracked");
        let log = std::fs::read_to_string(root.join(format!("mc-cached-{world}")).join("metrics.jsonl")).unwrap();
        assert!(log.contains("cache/ta") && !log.contains("\"cache/tb"), "only ta is cached: {log}");
    }
    remove_own_outs();
}

#[test]
fn execute_all_batches_false_drops_the_batch_in_flight_at_each_epochs_end() {
    for world in [1, 2] {
        // Five batches an epoch, the fifth dropped: as if each epoch had four.
        let four =
            train_with(world, "row_wise", false, &["data.sampler.batches=4", &own_out(&format!("four-{world}"))]);
        assert_eq!(four.steps, 8);
        for kind in ["sparse_dist", "prefetch_sparse_dist"] {
            let piped = train_with(
                world,
                "row_wise",
                false,
                &[
                    &format!("pipeline.kind=\"{kind}\""),
                    "pipeline.execute_all_batches=false",
                    &own_out(&format!("drop-{world}-{kind}")),
                ],
            );
            same(&format!("{kind}, execute_all_batches = false, on {world} ranks"), &piped, &four);
        }
        // `base` has nothing in flight: the key changes nothing.
        let base = train_with(
            world,
            "row_wise",
            false,
            &["pipeline.execute_all_batches=false", &own_out(&format!("drop-{world}-base"))],
        );
        assert_eq!(base.steps, 10);
    }
    remove_own_outs();
}

#[test]
fn a_stage_failure_stops_the_pipeline_after_the_updates_before_it() {
    let registry = Registry::builtin().sampler::<Slices>();
    let dir = std::env::temp_dir().join(format!("trainrec-dist-stagefail-{}", std::process::id()));
    for (world, kind) in [(1, "base"), (1, "sparse_dist"), (3, "sparse_dist"), (3, "prefetch_sparse_dist")] {
        let path = recipe(&dir, world, "row_wise", false, false);
        let out = dir.join(format!("run-{world}-{kind}"));
        let _ = std::fs::remove_dir_all(&out);
        // Rank 0's third batch of the first epoch cannot be read; a checkpoint after every step.
        let overrides = vec![
            "data.sampler.fail_at=[0, 2]".to_string(),
            format!("pipeline.kind=\"{kind}\""),
            "train.checkpoint_every=1".into(),
            format!("run.output_dir=\"{}\"", out.display()),
        ];
        let options = LoadOptions { overrides, env: false };
        let (loaded, features) = load_and_check(&path, &options, &registry).unwrap_or_else(|d| panic!("{d}"));
        let start = std::time::Instant::now();
        let Err(err) = trainrec::engine::launch::run_threads(&loaded, &features, &registry) else {
            panic!("{kind} on {world} ranks: the job should fail");
        };
        assert!(err.to_string().contains("rank 0 fails on purpose"), "{kind} on {world} ranks: {err}");
        assert!(start.elapsed() < Duration::from_secs(60), "{kind} on {world} ranks: took {:?}", start.elapsed());
        // The two batches before it were trained and saved, as `base` does; nothing after.
        let latest = trainrec::engine::checkpoint::latest(&out.join("checkpoints")).unwrap().expect("a checkpoint");
        assert!(latest.ends_with("step-00000002"), "{kind} on {world} ranks: {}", latest.display());
    }
}
