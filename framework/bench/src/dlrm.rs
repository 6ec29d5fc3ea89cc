//! The W2 DLRM benchmark (`trainrec bench dlrm`): the workload, flags and JSON fields of
//! `bench/anchors/w2_dlrm.py`, so both can run side by side.
//!
//! The job is built the way `trainrec run` builds one: a recipe (written to a temporary
//! file) with one `rows x dim` table per sparse feature, row-wise Adagrad fused into the
//! embedding backward, dense Adagrad and `kind = "dlrm"`, loaded and checked by
//! [`trainrec_engine::load_and_check`] and built by [`trainrec_engine::Job::build`]. `num_batches` batches shaped like
//! TorchRec's `RandomRecDataset` (uniform ids, exactly `ids_per_feature` per bag, dense
//! features uniform in `[0, 1)`, 0/1 labels) are generated before timing and cycled.
//!
//! * `train`: [`Job::train_step`] per step (EBC forward, DLRM forward, BCE loss, backward,
//!   dense Adagrad, fused row-wise Adagrad on the embedding rows).
//! * `infer`: the same parts in eval mode under `no_grad`: EBC forward (written straight into
//!   the model's input tensor), then the DLRM's logits. The job has no public per-batch
//!   forward yet, so the parts are built here from the same recipe, as [`Job::build`] builds
//!   them.
//!
//! With `profile`, one more timed pass runs a copy of the train step that times its parts
//! (`sections_ms`), and the step's matrix products are timed alone at its shapes
//! (`gemm_floor_ms`, see [`gemm_floor`]). The headline numbers always come from
//! [`Job::train_step`].
//! `malloc_tuning` (default on) applies [`tune_allocator`] first.
//!
//! `cargo test --release -p trainrec-engine --lib bench::tests::w2 -- --ignored --nocapture`
//! runs it with `W2_ARGS="mode=infer threads=1 ..."` (field names) until the CLI has it.

use std::path::PathBuf;
use std::time::Instant;

use crate::embedding::cpu_snapshot;
use serde_json::{Value, json};
use tch::{Device, Tensor, nn};
use trainrec_data::{Batch, FeatureSchema};
use trainrec_embedding::EmbeddingBagCollection;
use trainrec_models::{Autocast, DenseModel, DenseOptimizer, ModelInputs};
use trainrec_recipe::{LoadOptions, LoadedRecipe};
use trainrec_sparse::KeyedJaggedTensor;

use crate::stats::median;
use trainrec_engine::{Job, Registry};

/// What a step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DlrmMode {
    /// Forward, loss, backward, dense and fused sparse optimizer steps.
    Train,
    /// Eval-mode logits under `no_grad`.
    Infer,
}

impl DlrmMode {
    /// The flag value (`train`, `infer`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Train => "train",
            Self::Infer => "infer",
        }
    }
}

/// The benchmark's parameters: the flags of `w2_dlrm.py` (same defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct DlrmBench {
    /// `--mode`.
    pub mode: DlrmMode,
    /// Dense features per sample.
    pub num_dense: usize,
    /// Sparse features, one table each.
    pub num_sparse: usize,
    /// Rows per table.
    pub rows: u64,
    /// Embedding dim (must equal the last dense-arch size).
    pub dim: usize,
    /// Ids per feature per sample (every bag has exactly this many).
    pub ids_per_feature: usize,
    /// Dense-arch layer sizes.
    pub dense_arch: Vec<usize>,
    /// Over-arch layer sizes (the last is 1).
    pub over_arch: Vec<usize>,
    /// Samples per batch.
    pub batch: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed warm-up steps.
    pub warmup: usize,
    /// Distinct pre-generated batches, cycled through.
    pub num_batches: usize,
    /// Learning rate of both optimizers.
    pub lr: f64,
    /// Eps of the fused row-wise Adagrad (the recipe's dense Adagrad has PyTorch's fixed 1e-10).
    pub eps: f64,
    /// Seed of data and weights.
    pub seed: u64,
    /// Threads for libtorch and the embedding kernels (0 = all cores).
    pub threads: usize,
    /// Also time the parts of a copy of the train step (`sections_ms` in the output).
    pub profile: bool,
    /// Keep freed memory in the process (glibc `mallopt`: mmap threshold 32 MiB, no trimming),
    /// so the step's large tensors reuse warm pages instead of fresh zeroed ones (page faults);
    /// see [`tune_allocator`].
    pub malloc_tuning: bool,
    /// Offload every table behind a cache of this share of its rows (`fused_uvm_caching`,
    /// LRU); `None` keeps them in memory.
    pub cache_load_factor: Option<f64>,
    /// Offload with the `key_value` kernel instead: the cache in front of a store of the rows
    /// written so far (a row never written reads as its initial weights, without a disk read).
    pub key_value: bool,
    /// Directory of the offloaded tables' files (default: under the bench's temp dir).
    pub offload_dir: Option<std::path::PathBuf>,
    /// Prefetch batch i+1's cached rows while batch i's dense part runs.
    pub prefetch: bool,
    /// Draw ids from a power law of this exponent over each table's rows instead of
    /// uniformly: rank `k` (0 the most frequent) with probability about `(k + 1)^-alpha`, the
    /// ranks scattered over the rows so hot rows do not sit together in memory or on disk.
    pub zipf_alpha: Option<f64>,
    /// Inference with quantized tables (`trainrec eval --quantize`); `None`: fp32.
    pub quantize: Option<trainrec_embedding::quant::QuantPrecision>,
    /// The precision of the dense model's matrix products (`train.dense_precision`).
    pub dense_precision: trainrec_types::DensePrecision,
}

impl Default for DlrmBench {
    fn default() -> Self {
        Self {
            mode: DlrmMode::Train,
            num_dense: 13,
            num_sparse: 26,
            rows: 100_000,
            dim: 64,
            ids_per_feature: 1,
            dense_arch: vec![512, 256, 64],
            over_arch: vec![512, 512, 256, 1],
            batch: 2048,
            steps: 30,
            warmup: 5,
            num_batches: 8,
            lr: 0.01,
            eps: 1e-8,
            seed: 0,
            threads: 0,
            profile: false,
            malloc_tuning: true,
            cache_load_factor: None,
            key_value: false,
            quantize: None,
            dense_precision: trainrec_types::DensePrecision::Fp32,
            offload_dir: None,
            prefetch: false,
            zipf_alpha: None,
        }
    }
}

pub use trainrec_engine::tensors::tune_allocator;

fn list(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// The recipe of the benchmark's job.
pub(crate) fn recipe_toml(b: &DlrmBench, out_dir: &std::path::Path) -> String {
    let keys: Vec<String> = (0..b.num_sparse).map(|i| format!("\"cat_{i}\"")).collect();
    let threads = if b.threads == 0 { String::new() } else { format!("threads = {}\n", b.threads) };
    let mut s = format!(
        "[run]\nname = \"bench-dlrm\"\nseed = {seed}\noutput_dir = {out:?}\n{threads}\n\
         [data]\nbatch_size = {batch}\n\n\
         [data.sampler]\nkind = \"synthetic\"\ndense_features = {nd}\nsparse_features = [{keys}]\n\
         pooling_factor = {pf}\ntrain_samples = {train}\neval_samples = {batch}\n\n",
        seed = b.seed,
        out = out_dir.display().to_string(),
        batch = b.batch,
        nd = b.num_dense,
        keys = keys.join(", "),
        pf = b.ids_per_feature,
        train = (b.batch * b.num_batches) as u64,
    );
    let kernel = if b.key_value { "key_value" } else { "fused_uvm_caching" };
    let cache = b.cache_load_factor.map_or(String::new(), |f| {
        format!("constraints = {{ compute_kernels = [{kernel:?}], cache = {{ load_factor = {f:?} }} }}\n")
    });
    for i in 0..b.num_sparse {
        s.push_str(&format!(
            "[[tables]]\nname = \"t_cat_{i}\"\nfeatures = [\"cat_{i}\"]\nrows = {}\ndim = {}\n{cache}\n",
            b.rows, b.dim
        ));
    }
    if let Some(dir) = &b.offload_dir {
        s.push_str(&format!("[embedding]\noffload_dir = {:?}\n\n", dir.display().to_string()));
    }
    if b.prefetch {
        s.push_str("[pipeline]\nkind = \"prefetch_sparse_dist\"\n\n");
    }
    s.push_str(&format!(
        "[model]\nkind = \"dlrm\"\ndense_arch = [{}]\nover_arch = [{}]\n\n\
         [optimizer]\nsparse = {{ kind = \"rowwise_adagrad\", lr = {lr:e}, eps = {eps:e} }}\n\
         dense = {{ kind = \"adagrad\", lr = {lr:e} }}\n\n\
         [train]\nsteps = {steps}\nprogress = false\ndense_precision = \"{precision}\"\n",
        list(&b.dense_arch),
        list(&b.over_arch),
        lr = b.lr,
        eps = b.eps,
        steps = (b.warmup + b.steps).max(1),
        precision = trainrec_types::Word::name(b.dense_precision),
    ));
    s
}

/// SplitMix64: the batches' generator (the engine crate has no `rand` dependency).
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)` (24 random bits).
    fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }
    /// Uniform in `0..n` (multiply-shift; the bias is below 2^-32 for any table size).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Power-law ranks over `n` rows, drawn by inverting the continuous CDF of `x^-alpha` on
/// `[1, n + 1)`, then scattered over the rows by a fixed bijection: rank `k` is row
/// `k * mult mod n`, `mult` coprime to `n`.
struct PowerLaw {
    n: u64,
    alpha: f64,
    /// `(n + 1)^(1 - alpha) - 1` (or `ln(n + 1)` for `alpha = 1`).
    span: f64,
    mult: u64,
}

impl PowerLaw {
    fn new(n: u64, alpha: f64) -> Self {
        let span =
            if (alpha - 1.0).abs() < 1e-9 { ((n + 1) as f64).ln() } else { ((n + 1) as f64).powf(1.0 - alpha) - 1.0 };
        // The largest multiplier below the golden ratio times n coprime to n.
        let gcd = |mut a: u64, mut b: u64| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let mut mult = ((n as f64 * 0.618_033_988_75) as u64).max(1);
        while gcd(mult, n) != 1 {
            mult -= 1;
        }
        Self { n, alpha, span, mult }
    }

    /// A row: rank `k` drawn from the law, then mapped to row `k * mult mod n`.
    fn draw(&self, rng: &mut SplitMix) -> u64 {
        let u = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let x = if (self.alpha - 1.0).abs() < 1e-9 {
            (u * self.span).exp()
        } else {
            (u * self.span + 1.0).powf(1.0 / (1.0 - self.alpha))
        };
        let k = ((x as u64).max(1) - 1).min(self.n - 1);
        ((u128::from(k) * u128::from(self.mult)) % u128::from(self.n)) as u64
    }
}

/// Batches shaped like TorchRec's `RandomRecDataset`: ids uniform in `0..rows` (or drawn
/// from [`DlrmBench::zipf_alpha`]'s power law), exactly `ids_per_feature` per bag, dense
/// features uniform in `[0, 1)`, labels 0 or 1.
pub(crate) fn make_batches(b: &DlrmBench, features: &FeatureSchema) -> Result<Vec<Batch>, String> {
    let mut rng = SplitMix(b.seed ^ 0x243F_6A88_85A3_08D3);
    let law = b.zipf_alpha.map(|a| PowerLaw::new(b.rows, a));
    let n = b.batch * b.ids_per_feature;
    let keys = features.sparse.clone();
    (0..b.num_batches)
        .map(|_| {
            let dense: Vec<f32> = (0..b.batch * b.num_dense).map(|_| rng.unit_f32()).collect();
            let values: Vec<i64> = (0..keys.len() * n)
                .map(|_| match &law {
                    Some(law) => law.draw(&mut rng) as i64,
                    None => rng.below(b.rows) as i64,
                })
                .collect();
            let lengths = vec![b.ids_per_feature as u32; keys.len() * b.batch];
            let labels: Vec<f32> = (0..b.batch).map(|_| (rng.next_u64() >> 63) as f32).collect();
            let sparse = KeyedJaggedTensor::new(keys.clone(), values, None, lengths, b.batch)
                .map_err(|e| format!("bench batch: {e}"))?;
            Ok(Batch {
                dense,
                num_dense: b.num_dense,
                sparse,
                labels,
                batch_size: b.batch,
                groups: None,
                weights: None,
            })
        })
        .collect()
}

/// The job's parts, built from the recipe as [`Job::build`] builds them (for inference and
/// the profiled copy of the train step).
struct Parts {
    ebc: EmbeddingBagCollection,
    /// The tables quantized for inference, when asked.
    quant: Option<trainrec_embedding::quant::QuantizedEbc>,
    _vs: nn::VarStore,
    model: Box<dyn DenseModel>,
    dense_opt: DenseOptimizer,
    num_dense: usize,
    /// `train.dense_precision`.
    precision: trainrec_types::DensePrecision,
}

impl Parts {
    fn build(loaded: &LoadedRecipe, features: &FeatureSchema, registry: &Registry) -> Result<Self, String> {
        let recipe = &loaded.recipe;
        trainrec_engine::configure_threads(recipe.run.threads);
        tch::manual_seed(recipe.run.seed as i64);
        let ebc = trainrec_engine::inputs::recipe_ebc(recipe).map_err(|e| e.to_string())?;
        let vs = nn::VarStore::new(Device::Cpu);
        let (sparse, sparse_dim_keys) = trainrec_engine::inputs::sparse_outputs(recipe);
        let num_tasks = trainrec_engine::inputs::job_tasks(recipe, features).len();
        let inputs =
            ModelInputs { num_dense: features.num_dense, sparse, sparse_dim_keys, num_tasks, sequences: Vec::new() };
        let kind = recipe.model.kind().unwrap_or_default();
        let factory = registry.model_for(kind).ok_or_else(|| format!("no model {kind}"))?;
        let model = factory.build(&vs.root(), &recipe.model.config(), &inputs).map_err(|e| e.to_string())?;
        let dense_opt = DenseOptimizer::new(&vs, &recipe.optimizer.dense).map_err(|e| e.to_string())?;
        let (num_dense, precision) = (features.num_dense, recipe.train.dense_precision);
        Ok(Self { ebc, quant: None, _vs: vs, model, dense_opt, num_dense, precision })
    }

    /// Eval-mode logits `[batch, 1]` under `no_grad`; the EBC writes its output straight into
    /// the tensor the model reads.
    fn infer(&self, batch: &Batch) -> Result<Tensor, String> {
        let b = batch.batch_size as i64;
        let sparse = self.pooled_tensor(batch)?;
        Ok(tch::no_grad(|| {
            let dense = Tensor::from_slice(&batch.dense).view([b, self.num_dense as i64]);
            Autocast::run(self.precision, Device::Cpu, || self.model.forward(&dense, &sparse, false))
                .to_kind(tch::Kind::Float)
        }))
    }

    fn pooled_tensor(&self, batch: &Batch) -> Result<Tensor, String> {
        if let Some(q) = &self.quant {
            let mut out = vec![0f32; batch.batch_size * q.width()];
            q.forward_into(&batch.sparse, &mut out).map_err(|e| e.to_string())?;
            return Ok(Tensor::from_slice(&out).view([batch.batch_size as i64, q.width() as i64]));
        }
        trainrec_engine::tensors::pooled_tensor(
            &self.ebc,
            &batch.sparse,
            &mut trainrec_embedding::BatchContext::default(),
        )
        .map_err(|e| e.to_string())
    }

    /// A copy of the engine's train step (`Job::train_step_with`) that adds each part's time
    /// (seconds) to `t` (see [`SECTION_NAMES`]).
    fn train_step_timed(&mut self, batch: &Batch, t: &mut [f64; SECTIONS]) -> Result<f64, String> {
        let b = batch.batch_size as i64;
        let mut clock = Instant::now();
        let mut lap = |i: usize, t: &mut [f64; SECTIONS]| {
            let now = Instant::now();
            t[i] += (now - clock).as_secs_f64();
            clock = now;
        };
        let sparse = self.pooled_tensor(batch)?;
        lap(0, t);
        let dense = Tensor::from_slice(&batch.dense).view([b, self.num_dense as i64]);
        let labels = Tensor::from_slice(&batch.labels).view([b, 1]);
        let sparse = trainrec_engine::tensors::pooled_leaf(sparse, self.precision, self.model.as_ref());
        lap(1, t);
        let logits = Autocast::run(self.precision, Device::Cpu, || self.model.forward(&dense, &sparse, true))
            .to_kind(tch::Kind::Float);
        let loss = logits.binary_cross_entropy_with_logits::<Tensor>(&labels, None, None, tch::Reduction::Mean);
        lap(2, t);
        self.dense_opt.zero_grad();
        lap(3, t);
        loss.backward();
        lap(4, t);
        self.dense_opt.step();
        lap(5, t);
        let grad = sparse.grad();
        lap(6, t);
        trainrec_engine::tensors::with_f32_slice(&grad, |g| self.ebc.backward_and_update(&batch.sparse, g))
            .map_err(|e| e.to_string())?;
        lap(7, t);
        let v = loss.double_value(&[]);
        lap(8, t);
        Ok(v)
    }
}

const SECTIONS: usize = 9;
const SECTION_NAMES: [&str; SECTIONS] = [
    "ebc_forward",
    "to_tensors",
    "dense_forward_loss",
    "zero_grad",
    "backward",
    "dense_optimizer",
    "grad",
    "ebc_backward_update",
    "loss_value",
];

fn busy_cores(a: Option<(Instant, f64, f64)>, b: Option<(Instant, f64, f64)>) -> (Value, Value) {
    match (a, b) {
        (Some((t0, b0, s0)), Some((t1, b1, s1))) => {
            let wall = (t1 - t0).as_secs_f64().max(1e-9);
            let r = |x: f64| json!((x / wall * 1000.0).round() / 1000.0);
            (r(((b1 - b0) - (s1 - s0)).max(0.0)), r(s1 - s0))
        }
        _ => (Value::Null, Value::Null),
    }
}

fn loadavg() -> Value {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).filter_map(|x| x.parse::<f64>().ok()).collect::<Vec<_>>())
        .map_or(Value::Null, |v| json!(v))
}

fn summaries(ts: &[f64], batch: usize) -> (Value, Value, Value) {
    let (med, lo, hi) =
        (median(ts), ts.iter().copied().fold(f64::INFINITY, f64::min), ts.iter().copied().fold(0.0, f64::max));
    let n = ts.len();
    let b = batch as f64;
    (
        json!({"median_s": med, "min_s": lo, "max_s": hi, "n": n}),
        json!({"median": med * 1e3, "min": lo * 1e3, "max": hi * 1e3, "n": n}),
        json!({"median": b / med, "min": b / hi, "max": b / lo, "best": b / lo, "worst": b / hi, "n": n}),
    )
}

/// The matrix products alone of the benchmark's step, at its shapes and threads: each linear
/// layer's forward (with its bias), and in training its input gradient (not the first layer's:
/// the dense features need none) and weight gradient, plus the interaction's batched Gram
/// product and, in training, its gradient (one batched product, as the DLRM computes it).
/// Medians over `steps` calls after `warmup`, in milliseconds. No fp32 implementation of the
/// step (trainrec's or TorchRec's, both on MKL) runs faster than their sum; the rest of the
/// step is embeddings and element-wise work. With `--dense-precision bf16` the products run on
/// bf16 operands, as autocast runs them: the floor of a bf16 step.
fn gemm_floor(b: &DlrmBench) -> Value {
    let train = b.mode == DlrmMode::Train;
    let (batch, n, dim) = (b.batch as i64, b.num_sparse as i64 + 1, b.dim as i64);
    // bf16: the products autocast runs, on bf16 operands.
    let kind = match b.dense_precision {
        trainrec_types::DensePrecision::Fp32 => tch::Kind::Float,
        trainrec_types::DensePrecision::Bf16 => tch::Kind::BFloat16,
    };
    let opts = (kind, Device::Cpu);
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..b.warmup {
            f();
        }
        let ts: Vec<f64> = (0..b.steps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect();
        median(&ts) * 1e3
    };
    // Each MLP's layers read the previous layer's output; the over arch reads the interaction.
    let mut shapes = Vec::new();
    for (mut input, arch) in
        [(b.num_dense, &b.dense_arch), (b.dim + b.num_sparse * (b.num_sparse + 1) / 2, &b.over_arch)]
    {
        for &output in arch {
            shapes.push((input as i64, output as i64));
            input = output;
        }
    }
    let (mut forward, mut backward) = (0.0, 0.0);
    let mut layers = Vec::new();
    for (i, (input, output)) in shapes.into_iter().enumerate() {
        let x = Tensor::randn([batch, input], opts);
        let (w, bias) = (Tensor::randn([output, input], opts), Tensor::randn([output], opts));
        let g = Tensor::randn([batch, output], opts);
        let fwd = time(&mut || drop(x.linear(&w, Some(&bias))));
        let grad_input = if train && i > 0 { time(&mut || drop(g.mm(&w))) } else { 0.0 };
        let grad_weight = if train { time(&mut || drop(g.tr().mm(&x))) } else { 0.0 };
        forward += fwd;
        backward += grad_input + grad_weight;
        layers.push(json!({
            "in": input, "out": output, "forward": fwd, "grad_input": grad_input, "grad_weight": grad_weight,
        }));
    }
    let all = Tensor::randn([batch, n, dim], opts);
    let gram = time(&mut || drop(all.bmm(&all.transpose(1, 2))));
    let grad_gram = Tensor::randn([batch, n, n], opts);
    let gram_grad = if train { time(&mut || drop(grad_gram.bmm(&all))) } else { 0.0 };
    forward += gram;
    backward += gram_grad;
    json!({
        "layers": layers,
        "interaction": {"gram": gram, "grad": gram_grad},
        "forward": forward,
        "backward": backward,
        "total": forward + backward,
    })
}

/// Times `steps` calls of `step` after `warmup` untimed ones; per-step seconds.
fn time_steps(
    steps: usize,
    warmup: usize,
    mut step: impl FnMut() -> Result<(), String>,
) -> Result<(Vec<f64>, (Value, Value)), String> {
    for _ in 0..warmup {
        step()?;
    }
    let c0 = cpu_snapshot();
    let mut ts = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        step()?;
        ts.push(t.elapsed().as_secs_f64());
    }
    Ok((ts, busy_cores(c0, cpu_snapshot())))
}

/// A temporary directory for the recipe, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the benchmark; returns the one JSON line `trainrec bench dlrm` prints.
pub fn run(b: &DlrmBench) -> Result<String, String> {
    if b.num_dense == 0 || b.num_sparse == 0 || b.rows == 0 || b.dim == 0 || b.ids_per_feature == 0 {
        return Err("num-dense, num-sparse, rows, dim and ids-per-feature must be > 0".into());
    }
    if b.batch == 0 || b.steps == 0 || b.num_batches == 0 {
        return Err("batch, steps and num-batches must be > 0".into());
    }
    if b.quantize.is_some() && b.mode != DlrmMode::Infer {
        return Err("--quantize applies to --mode infer (training updates fp32 tables)".into());
    }
    if let Some(a) = b.zipf_alpha.filter(|a| !(a.is_finite() && *a > 0.0)) {
        return Err(format!("--zipf-alpha {a}: the exponent must be a positive number"));
    }
    let malloc_tuned = b.malloc_tuning && tune_allocator();
    // Before anything starts rayon's global pool (recipe checks may), so it gets `threads`.
    trainrec_engine::configure_threads((b.threads > 0).then_some(b.threads));
    let load_start = loadavg();
    let c_start = cpu_snapshot();
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = TempDir(std::env::temp_dir().join(format!("trainrec-bench-dlrm-{}-{stamp}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| format!("cannot create {}: {e}", dir.0.display()))?;
    let path = dir.0.join("recipe.toml");
    std::fs::write(&path, recipe_toml(b, &dir.0.join("run"))).map_err(|e| format!("{}: {e}", path.display()))?;
    let registry = Registry::builtin();
    let (loaded, features) = trainrec_engine::load_and_check(&path, &LoadOptions::default(), &registry)
        .map_err(|d| format!("bench recipe: {d}"))?;
    tracing::info!("generating {} batches", b.num_batches);
    let batches = make_batches(b, &features)?;
    tracing::info!("building the job");
    let t0 = Instant::now();
    let mut it = 0usize;
    let mut next = || {
        let batch = &batches[it % batches.len()];
        it += 1;
        batch
    };
    let mut meta = serde_json::Map::new();
    let (ts, (others, own)) = match b.mode {
        DlrmMode::Train => {
            let mut job = Job::build(&loaded, &features, &registry).map_err(|e| e.to_string())?;
            meta.insert("build_s".into(), json!(t0.elapsed().as_secs_f64()));
            tracing::info!("timing");
            let mut last_loss = f64::NAN;
            let prefetch = b.prefetch;
            let mut k = 0usize;
            let r = time_steps(b.steps, b.warmup, || {
                let batch = &batches[k % batches.len()];
                k += 1;
                // The batch after it, prefetched while it trains (its next call finds it ready).
                let ahead = prefetch.then(|| &batches[k % batches.len()]);
                last_loss = job.train_step_ahead(batch, ahead).map_err(|e| e.to_string())?;
                Ok(())
            })?;
            meta.insert("cache".into(), json!(job.cache_stats_json()));
            meta.insert("last_loss".into(), json!(last_loss));
            drop(job);
            if b.profile {
                let mut parts = Parts::build(&loaded, &features, &registry)?;
                {
                    let mut t = [0f64; SECTIONS];
                    for _ in 0..b.warmup {
                        parts.train_step_timed(next(), &mut t)?;
                    }
                    t = [0f64; SECTIONS];
                    let mut steps = Vec::with_capacity(b.steps);
                    for _ in 0..b.steps {
                        let start = Instant::now();
                        parts.train_step_timed(next(), &mut t)?;
                        steps.push(start.elapsed().as_secs_f64());
                    }
                    let mut s: serde_json::Map<String, Value> = SECTION_NAMES
                        .iter()
                        .zip(t)
                        .map(|(n, x)| (n.to_string(), json!((x / b.steps as f64 * 1e4).round() / 10.0)))
                        .collect();
                    s.insert("mean".into(), json!((steps.iter().sum::<f64>() / b.steps as f64 * 1e4).round() / 10.0));
                    s.insert("median".into(), json!((median(&steps) * 1e4).round() / 10.0));
                    meta.insert("sections_ms".into(), Value::Object(s));
                }
            }
            r
        }
        DlrmMode::Infer => {
            let mut parts = Parts::build(&loaded, &features, &registry)?;
            if let Some(q) = b.quantize {
                parts.quant =
                    Some(trainrec_embedding::quant::QuantizedEbc::from_ebc(&parts.ebc, q).map_err(|e| e.to_string())?);
            }
            meta.insert("build_s".into(), json!(t0.elapsed().as_secs_f64()));
            tracing::info!("timing");
            time_steps(b.steps, b.warmup, || {
                let logits = parts.infer(next())?;
                std::hint::black_box(logits.size());
                Ok(())
            })?
        }
    };
    let dense_params: i64 = {
        let vs = nn::VarStore::new(Device::Cpu);
        let (sparse, sparse_dim_keys) = trainrec_engine::inputs::sparse_outputs(&loaded.recipe);
        let inputs =
            ModelInputs { num_dense: b.num_dense, sparse, sparse_dim_keys, num_tasks: 1, sequences: Vec::new() };
        if let Some(f) = registry.model_for("dlrm") {
            let _ = f.build(&vs.root(), &loaded.recipe.model.config(), &inputs);
        }
        vs.trainable_variables().iter().map(Tensor::numel).map(|n| n as i64).sum()
    };
    meta.insert("dense_params".into(), json!(dense_params));
    if b.profile {
        meta.insert("gemm_floor_ms".into(), gemm_floor(b));
    }
    let (step, ms, rate) = summaries(&ts, b.batch);
    let threads = tch::get_num_threads();
    let (others_all, self_all) = busy_cores(c_start, cpu_snapshot());
    let res = json!({
        "workload": "w2_dlrm",
        "impl": "trainrec",
        "mode": b.mode.name(),
        "sparse": "fused",
        "config": {
            "mode": b.mode.name(), "num_dense": b.num_dense, "num_sparse": b.num_sparse, "rows": b.rows,
            "dim": b.dim, "ids_per_feature": b.ids_per_feature, "dense_arch": b.dense_arch,
            "over_arch": b.over_arch, "batch": b.batch, "steps": b.steps, "warmup": b.warmup,
            "num_batches": b.num_batches, "lr": b.lr, "eps": b.eps, "seed": b.seed, "threads": b.threads,
            "malloc_tuning": b.malloc_tuning, "dense_opt": "adagrad", "sparse_opt": "rowwise_adagrad",
            "zipf_alpha": b.zipf_alpha, "cache_load_factor": b.cache_load_factor,
            "quantize": b.quantize.map(trainrec_types::Word::name),
            "offload_kernel": b.cache_load_factor.map(|_| if b.key_value { "key_value" } else { "fused_uvm_caching" }),
            "prefetch": b.prefetch,
            "dense_precision": trainrec_types::Word::name(b.dense_precision),
        },
        "step": step,
        "ms_per_step": ms,
        "samples_per_s": rate,
        "meta": meta,
        "env": {
            "threads": threads,
            "rayon_threads": rayon::current_num_threads(),
            "loadavg_start": load_start,
            "loadavg_end": loadavg(),
            "others_busy_cores": others_all,
            "others_busy_cores_timed": [others],
            "self_busy_cores_timed": own,
            "self_busy_cores": self_all,
            "malloc_tuned": malloc_tuned,
        },
    });
    Ok(res.to_string())
}

#[cfg(test)]
impl DlrmBench {
    /// A benchmark small enough for a unit test: 3 tables of 100 x 8, batch 32, 3 timed steps.
    pub(crate) fn tiny() -> Self {
        Self {
            num_sparse: 3,
            rows: 100,
            dim: 8,
            dense_arch: vec![16, 8],
            over_arch: vec![16, 1],
            batch: 32,
            steps: 3,
            warmup: 1,
            num_batches: 2,
            threads: 1,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_law_ids_follow_the_law_over_scattered_rows() {
        let (n, alpha) = (1000u64, 1.1);
        let law = PowerLaw::new(n, alpha);
        // Ranks map to distinct rows, and neighbouring ranks to distant rows.
        let rows: std::collections::BTreeSet<u64> = (0..n).map(|k| (k * law.mult) % n).collect();
        assert_eq!(rows.len(), n as usize);
        assert!(law.mult.abs_diff(1) > 100);
        let mut rng = SplitMix(7);
        let draws = 400_000;
        let mut count = vec![0u64; n as usize];
        for _ in 0..draws {
            count[law.draw(&mut rng) as usize] += 1;
        }
        let freq = |k: u64| count[((k * law.mult) % n) as usize] as f64 / draws as f64;
        // P(rank k) = ((k + 2)^(1 - a) - (k + 1)^(1 - a)) / ((n + 1)^(1 - a) - 1), in float64.
        let p = |k: u64| {
            let e = 1.0 - alpha;
            (((k + 2) as f64).powf(e) - ((k + 1) as f64).powf(e)) / (((n + 1) as f64).powf(e) - 1.0)
        };
        for k in [0, 1, 5, 50] {
            let (got, want) = (freq(k), p(k));
            assert!((got - want).abs() < 0.05 * want, "rank {k}: {got} vs {want}");
        }
        assert!(freq(0) > freq(1) && freq(1) > freq(10) && freq(10) > freq(500));
    }

    #[test]
    fn a_tiny_bench_runs_both_modes() {
        for mode in [DlrmMode::Train, DlrmMode::Infer] {
            let b = DlrmBench { mode, profile: mode == DlrmMode::Train, ..DlrmBench::tiny() };
            let line = run(&b).unwrap();
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["samples_per_s"]["n"], 3, "{line}");
            assert!(v["samples_per_s"]["median"].as_f64().unwrap() > 0.0);
            if mode == DlrmMode::Train {
                assert!(v["meta"]["last_loss"].as_f64().unwrap().is_finite());
            }
        }
    }

    #[test]
    fn the_gemm_floor_times_the_steps_own_layer_shapes() {
        for mode in [DlrmMode::Train, DlrmMode::Infer] {
            let b = DlrmBench { mode, profile: true, ..DlrmBench::tiny() };
            let floor = gemm_floor(&b);
            // num_dense 13 -> 16 -> 8; the over arch reads d (8) and the 3 * 4 / 2 = 6 pairs
            // of [d, e_0, e_1, e_2].
            let shapes: Vec<(u64, u64)> = floor["layers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| (l["in"].as_u64().unwrap(), l["out"].as_u64().unwrap()))
                .collect();
            assert_eq!(shapes, vec![(13, 16), (16, 8), (14, 16), (16, 1)], "{floor}");
            let (fwd, bwd) = (floor["forward"].as_f64().unwrap(), floor["backward"].as_f64().unwrap());
            assert!(fwd > 0.0, "{floor}");
            assert_eq!(floor["total"].as_f64().unwrap(), fwd + bwd);
            // Inference has no gradients; training's first layer has no input gradient.
            assert_eq!(bwd > 0.0, mode == DlrmMode::Train, "{floor}");
            assert_eq!(floor["layers"][0]["grad_input"].as_f64().unwrap(), 0.0);
        }
    }

    /// Runs the full benchmark from `W2_ARGS` (`key=value` pairs, e.g. `mode=infer threads=1
    /// profile=1`) and prints its JSON line: `cargo test --release -p trainrec-engine --lib
    /// bench::tests::w2 -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn w2() {
        let mut b = DlrmBench::default();
        let args = std::env::var("W2_ARGS").unwrap_or_default();
        let sizes = |v: &str| v.split(',').map(|x| x.parse().unwrap()).collect::<Vec<usize>>();
        for kv in args.split_whitespace() {
            let (k, v) = kv.split_once('=').expect("key=value");
            match k {
                "mode" => b.mode = if v == "infer" { DlrmMode::Infer } else { DlrmMode::Train },
                "num_dense" => b.num_dense = v.parse().unwrap(),
                "num_sparse" => b.num_sparse = v.parse().unwrap(),
                "rows" => b.rows = v.parse().unwrap(),
                "dim" => b.dim = v.parse().unwrap(),
                "ids_per_feature" => b.ids_per_feature = v.parse().unwrap(),
                "dense_arch" => b.dense_arch = sizes(v),
                "over_arch" => b.over_arch = sizes(v),
                "batch" => b.batch = v.parse().unwrap(),
                "steps" => b.steps = v.parse().unwrap(),
                "warmup" => b.warmup = v.parse().unwrap(),
                "num_batches" => b.num_batches = v.parse().unwrap(),
                "lr" => b.lr = v.parse().unwrap(),
                "eps" => b.eps = v.parse().unwrap(),
                "seed" => b.seed = v.parse().unwrap(),
                "threads" => b.threads = v.parse().unwrap(),
                "profile" => b.profile = v == "1" || v == "true",
                "malloc_tuning" => b.malloc_tuning = v == "1" || v == "true",
                _ => panic!("unknown key {k}"),
            }
        }
        println!("W2 {}", run(&b).unwrap());
    }
}
