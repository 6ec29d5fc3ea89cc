//! The host side of the CUDA engine, plain Rust: a collection's layout as the kernels see it,
//! each table's id occurrences of a batch sorted into unique-row segments, and the
//! optimizer's per-step arguments.

use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingError, OptimizerKind, PoolingMode, SparseOptimizerConfig, WeightDecayMode,
    WeightPrecision, clamp_row,
};
use trainrec_sparse::KeyedJaggedTensor;

use crate::{CudaError, MAX_DIM};

/// One table as the kernels address it.
#[derive(Clone, Debug)]
pub struct KernelTable {
    /// Table name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Embedding dimension.
    pub dim: usize,
    /// Stored precision of its weights.
    pub precision: WeightPrecision,
    /// Pooling of its bags.
    pub pooling: PoolingMode,
    /// Its fused optimizer.
    pub optimizer: SparseOptimizerConfig,
    /// Optimizer state floats per row.
    pub state_per_row: usize,
    /// `(seed, table)` of its stochastic rounding, when it rounds stochastically (see
    /// [`EmbeddingBagCollection::rounding_stream`]).
    pub rounding: Option<(u64, u64)>,
    /// Its cache (`fused_uvm_caching`): that many rows in GPU memory in front of the whole
    /// table in host memory.
    pub cache: Option<trainrec_embedding::CacheConfig>,
    /// The factor on the optimizer's `lr` of the next updates (a learning-rate schedule's).
    pub lr_multiplier: f64,
}

/// One pooled output: the input feature it reads, its table and its first output column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputSpec {
    /// Output name (the feature, or `feature@table`).
    pub name: String,
    /// The input KJT key it reads.
    pub input: String,
    /// Index of its table in [`Layout::tables`].
    pub table: usize,
    /// Its first column in the `[batch, width]` output.
    pub column: usize,
}

/// A pooled collection's tables and outputs, in the CPU collection's order (outputs by
/// table, then by the table's features; columns in that order).
#[derive(Clone, Debug)]
pub struct Layout {
    /// The tables.
    pub tables: Vec<KernelTable>,
    /// The outputs.
    pub outputs: Vec<OutputSpec>,
    /// Output floats per example.
    pub width: usize,
}

impl Layout {
    /// The layout of a CPU collection. Dimensions over [`MAX_DIM`] are an error naming the
    /// table.
    pub fn of(ebc: &EmbeddingBagCollection) -> Result<Self, CudaError> {
        let mut tables = Vec::new();
        let mut outputs = Vec::new();
        let mut column = 0;
        for (t, c) in ebc.table_configs().enumerate() {
            if c.dim > MAX_DIM {
                return Err(CudaError::Unsupported(format!(
                    "table \"{}\" has dim {}: the CUDA kernels take at most {MAX_DIM} (shard it column-wise)",
                    c.name, c.dim
                )));
            }
            let optimizer = ebc.table_optimizer(&c.name).expect("a table of this collection").clone();
            for f in &c.features {
                let input = f.split_once('@').map_or(f.as_str(), |(i, _)| i).to_string();
                outputs.push(OutputSpec { name: f.clone(), input, table: t, column });
                column += c.dim;
            }
            tables.push(KernelTable {
                name: c.name.clone(),
                rows: c.rows,
                dim: c.dim,
                precision: c.precision,
                pooling: c.pooling,
                state_per_row: optimizer.state_per_row(c.dim),
                optimizer,
                rounding: ebc.rounding_stream(&c.name),
                cache: c.cache.clone(),
                lr_multiplier: 1.0,
            });
        }
        debug_assert_eq!(column, ebc.width());
        Ok(Self { tables, outputs, width: column })
    }

    /// The KJT key each output reads (an error naming the first missing feature).
    pub fn resolve(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, EmbeddingError> {
        let inputs = self.outputs.iter().map(|o| (o.input.as_str(), self.tables[o.table].name.as_str()));
        trainrec_embedding::resolve_inputs(kjt, inputs)
    }

    /// The first id outside its table (bounds-check `fatal`): an error naming the table,
    /// feature and bag.
    pub fn check_ids(&self, kjt: &KeyedJaggedTensor, keys: &[usize]) -> Result<(), EmbeddingError> {
        for (o, &k) in self.outputs.iter().zip(keys) {
            let rows = self.tables[o.table].rows;
            let f = kjt.feature(k);
            if let Some(pos) = f.values.iter().position(|&id| id < 0 || id as u64 >= rows) {
                return Err(trainrec_embedding::id_out_of_range(&f, pos, &self.tables[o.table].name, &o.input, rows));
            }
        }
        Ok(())
    }

    /// Table `t`'s id occurrences in `kjt` (resolved to `keys`), sorted into unique rows, as
    /// the CPU engine lists them: its outputs in order, bags in order, ids in order; each
    /// occurrence's gradient starts at `bag * width + column` and is scaled by its per-id
    /// weight (when the KJT is weighted) times `1 / L` for mean pooling. The sort is stable,
    /// so each row sums its gradients in the CPU engine's order.
    pub fn occurrences(&self, kjt: &KeyedJaggedTensor, keys: &[usize], t: usize) -> Occurrences {
        self.occurrences_in(kjt, keys, t, |r| r)
    }

    /// [`Self::occurrences`] with each (clamped) row translated by `slot_of` (a cached table's
    /// rows to their cache slots, as the CPU engine's cached tables list them).
    pub fn occurrences_in(
        &self,
        kjt: &KeyedJaggedTensor,
        keys: &[usize],
        t: usize,
        slot_of: impl Fn(u32) -> u32,
    ) -> Occurrences {
        let table = &self.tables[t];
        let mean = table.pooling == PoolingMode::Mean;
        let mut list: Vec<(u32, u32, f32)> = Vec::new();
        for (o, &k) in self.outputs.iter().zip(keys) {
            if o.table != t {
                continue;
            }
            let f = kjt.feature(k);
            for b in 0..kjt.stride() {
                let (s, e) = (f.bag_start(b), f.bag_start(b + 1));
                let pool = if mean && e > s { 1.0 / (e - s) as f32 } else { 1.0 };
                let src = (b * self.width + o.column) as u32;
                for pos in s..e {
                    let w = f.weights.map_or(1.0, |w| w[pos]);
                    let id = f.values[pos];
                    let row = slot_of(clamp_row(id, table.rows) as u32);
                    list.push((row, src, pool * w));
                }
            }
        }
        radix_sort_by_row(&mut list, table.rows);
        let mut out = Occurrences::default();
        out.src.reserve(list.len());
        out.scale.reserve(list.len());
        for (i, &(row, src, scale)) in list.iter().enumerate() {
            if i == 0 || list[i - 1].0 != row {
                out.rows.push(i64::from(row));
                out.seg.push(i as u32);
            }
            out.src.push(src);
            out.scale.push(scale);
        }
        out.seg.push(list.len() as u32);
        out
    }
}

/// Stable LSD radix sort of occurrences by row (11-bit digits over the bits `rows` needs).
fn radix_sort_by_row(v: &mut Vec<(u32, u32, f32)>, rows: u64) {
    if v.len() < 256 {
        v.sort_by_key(|o| o.0);
        return;
    }
    const BITS: u32 = 11;
    let key_bits = 64 - rows.saturating_sub(1).leading_zeros();
    let mut tmp = vec![(0u32, 0u32, 0f32); v.len()];
    let mut counts = vec![0usize; 1 << BITS];
    for pass in 0..key_bits.div_ceil(BITS).max(1) {
        let shift = pass * BITS;
        let digit = |o: &(u32, u32, f32)| ((o.0 >> shift) as usize) & ((1 << BITS) - 1);
        counts.iter_mut().for_each(|c| *c = 0);
        v.iter().for_each(|o| counts[digit(o)] += 1);
        let mut sum = 0;
        for c in counts.iter_mut() {
            (*c, sum) = (sum, sum + *c);
        }
        for o in v.iter() {
            let d = digit(o);
            tmp[counts[d]] = *o;
            counts[d] += 1;
        }
        std::mem::swap(v, &mut tmp);
    }
}

/// One table's occurrences in a batch, by unique row: row `rows[u]` sums the occurrences
/// `seg[u]..seg[u + 1]`, each `scale * grad[src + d]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Occurrences {
    /// The unique rows, ascending.
    pub rows: Vec<i64>,
    /// Segment starts (`rows.len() + 1`, the last is the occurrence count).
    pub seg: Vec<u32>,
    /// Where each occurrence's upstream gradient starts.
    pub src: Vec<u32>,
    /// The factor on each occurrence's gradient.
    pub scale: Vec<f32>,
}

/// The optimizer codes of kernels/embedding.cu.
fn opt_code(kind: OptimizerKind) -> (i32, i32) {
    let wd = |m: WeightDecayMode| match m {
        WeightDecayMode::None => 0,
        WeightDecayMode::L2 => 1,
        WeightDecayMode::Decoupled => 2,
    };
    match kind {
        OptimizerKind::Sgd => (0, 0),
        OptimizerKind::Adagrad => (1, 0),
        OptimizerKind::RowwiseAdagrad(m) => (2, wd(m)),
        OptimizerKind::Adam => (3, 0),
        OptimizerKind::PartialRowwiseAdam => (4, 0),
        OptimizerKind::Lamb => (5, 0),
    }
}

/// The update kernel's step argument (`StepArgs` in kernels/embedding.cu, same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepArgs {
    /// Optimizer code.
    pub opt: i32,
    /// Row-wise Adagrad's weight decay mode code.
    pub wd_mode: i32,
    /// Learning rate.
    pub lr: f32,
    /// Epsilon.
    pub eps: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 - beta1^t`.
    pub c1: f32,
    /// `1 - beta2^t`.
    pub c2: f32,
    /// 1 when 16-bit weights round stochastically.
    pub stochastic: i32,
    /// The step's rounding key.
    pub rng_key: u64,
    /// The table's index in its rounding group.
    pub table: u64,
}

impl StepArgs {
    /// The arguments of table `spec`'s update number `iter` (1 for the first).
    pub fn new(spec: &KernelTable, iter: u64) -> Self {
        let c = trainrec_embedding::StepConstants::of(&spec.optimizer, iter)
            .with_lr_multiplier(spec.optimizer.lr(), spec.lr_multiplier);
        let (opt, wd_mode) = opt_code(c.kind);
        let (stochastic, rng_key, table) = match spec.rounding {
            Some((seed, table)) => (1, trainrec_embedding::rounding_key(seed, iter), table),
            None => (0, 0, 0),
        };
        Self {
            opt,
            wd_mode,
            lr: c.lr,
            eps: c.eps,
            weight_decay: c.weight_decay,
            beta1: c.beta1,
            beta2: c.beta2,
            c1: c.c1,
            c2: c.c2,
            stochastic,
            rng_key,
            table,
        }
    }
}

/// Blocks of a launch over `n` warps' worth of work (the kernels loop over the rest).
pub fn grid(n: usize) -> u32 {
    (n.div_ceil(crate::WARPS as usize)).clamp(1, 1 << 16) as u32
}

/// Table `t`'s weights as stored: fp32 values, or the 16-bit patterns of fp16 / bf16 ones
/// (`weights` are fp32 values the precision represents exactly, as the CPU collection's
/// [`EmbeddingBagCollection::table_weights`] returns them).
pub fn to_stored(precision: WeightPrecision, weights: &[f32]) -> StoredWeights {
    match precision {
        WeightPrecision::Fp32 => StoredWeights::F32(weights.to_vec()),
        WeightPrecision::Fp16 => {
            StoredWeights::Bits(weights.iter().map(|&w| half::f16::from_f32(w).to_bits()).collect())
        }
        WeightPrecision::Bf16 => {
            StoredWeights::Bits(weights.iter().map(|&w| half::bf16::from_f32(w).to_bits()).collect())
        }
    }
}

/// Stored weights back to fp32 values.
pub fn from_stored(precision: WeightPrecision, stored: &StoredWeights) -> Vec<f32> {
    match (precision, stored) {
        (_, StoredWeights::F32(w)) => w.clone(),
        (WeightPrecision::Bf16, StoredWeights::Bits(b)) => {
            b.iter().map(|&x| half::bf16::from_bits(x).to_f32()).collect()
        }
        (_, StoredWeights::Bits(b)) => b.iter().map(|&x| half::f16::from_bits(x).to_f32()).collect(),
    }
}

/// Stored weights as the bytes a cache's backing file holds (little-endian values).
pub fn stored_bytes(stored: &StoredWeights) -> Vec<u8> {
    match stored {
        StoredWeights::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        StoredWeights::Bits(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// [`stored_bytes`] back to stored weights of `precision`.
pub fn stored_from_bytes(precision: WeightPrecision, bytes: &[u8]) -> StoredWeights {
    match precision {
        WeightPrecision::Fp32 => {
            StoredWeights::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        _ => StoredWeights::Bits(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
    }
}

/// A table's weights in their stored form.
#[derive(Clone, Debug, PartialEq)]
pub enum StoredWeights {
    /// fp32.
    F32(Vec<f32>),
    /// fp16 or bf16 bit patterns.
    Bits(Vec<u16>),
}

/// The kernel-name suffix of a precision.
pub fn suffix(precision: WeightPrecision) -> &'static str {
    match precision {
        WeightPrecision::Fp32 => "f32",
        WeightPrecision::Fp16 => "f16",
        WeightPrecision::Bf16 => "bf16",
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn radix_sort_is_a_stable_sort_by_row() {
        let mut rng = StdRng::seed_from_u64(3);
        for rows in [1u64, 300, 5000, 3_000_000] {
            let mut v: Vec<(u32, u32, f32)> =
                (0..4000u32).map(|i| (rng.random_range(0..rows) as u32, i, i as f32)).collect();
            let mut want = v.clone();
            want.sort_by_key(|o| o.0);
            super::radix_sort_by_row(&mut v, rows);
            assert_eq!(v, want, "rows {rows}");
        }
    }
}
