//! Quantized inference tables: a trained [`EmbeddingBagCollection`]'s tables stored in int8
//! with a scale and bias per row (FBGEMM's fused 8-bit row-wise layout) or in fp16, with a
//! pooled forward kernel that reads them directly (no dequantized copy of a table).
//!
//! Int8 row layout, as FBGEMM's `FloatToFused8BitRowwiseQuantized`: `dim` bytes of codes, then
//! the row's scale and bias as little-endian fp32 (`dim + 8` bytes per row). A value is
//! `scale * code + bias`, with `bias = min(row)` and `scale = (max(row) - min(row)) / 255`.

use rayon::prelude::*;
use trainrec_sparse::{KeyedJaggedTensor, KeyedTensor};

use crate::{EmbeddingBagCollection, EmbeddingError, PoolingMode};

/// How a quantized table stores its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantPrecision {
    /// Half precision: 2 bytes per value.
    Fp16,
    /// 8-bit codes with an fp32 scale and bias per row: `dim + 8` bytes per row.
    Int8,
}

impl trainrec_types::Word for QuantPrecision {
    const WORDS: &'static [Self] = &[Self::Int8, Self::Fp16];
    fn name(self) -> &'static str {
        match self {
            Self::Int8 => "int8",
            Self::Fp16 => "fp16",
        }
    }
}

impl QuantPrecision {
    /// Bytes of one `dim`-wide row.
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            Self::Fp16 => 2 * dim,
            Self::Int8 => dim + 8,
        }
    }
}

struct QTable {
    name: String,
    rows: u64,
    dim: usize,
    mean: bool,
    data: Vec<u8>,
}

struct QOutput {
    input: String,
    table: usize,
    column: usize,
}

/// How the tables are held.
enum Storage {
    /// fp16 rows in an [`EmbeddingBagCollection`] of fp16 tables (its pooled kernel reads
    /// them; no optimizer state).
    Fp16(EmbeddingBagCollection),
    /// Fused 8-bit row-wise rows.
    Int8 { tables: Vec<QTable>, outputs: Vec<QOutput> },
}

/// An embedding-bag collection for inference with quantized tables.
pub struct QuantizedEbc {
    storage: Storage,
    keys: Vec<String>,
    dims: Vec<usize>,
    width: usize,
}

/// Quantizes one row to FBGEMM's fused 8-bit row-wise layout (appended to `out`).
pub fn quantize_row_int8(row: &[f32], out: &mut Vec<u8>) {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &x in row {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if row.is_empty() {
        (lo, hi) = (0.0, 0.0);
    }
    let scale = (hi - lo) / 255.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    out.extend(row.iter().map(|&x| ((x - lo) * inv).round().clamp(0.0, 255.0) as u8));
    out.extend_from_slice(&scale.to_le_bytes());
    out.extend_from_slice(&lo.to_le_bytes());
}

/// The values of a row [`quantize_row_int8`] wrote.
pub fn dequantize_row_int8(bytes: &[u8], dim: usize) -> Vec<f32> {
    let (scale, bias) = scale_bias(&bytes[dim..dim + 8]);
    bytes[..dim].iter().map(|&q| scale * q as f32 + bias).collect()
}

#[inline]
fn scale_bias(b: &[u8]) -> (f32, f32) {
    let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let bias = f32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    (scale, bias)
}

impl QuantizedEbc {
    /// The tables of `ebc` (its current weights) quantized to `precision`; the outputs are
    /// `ebc`'s, in its order.
    pub fn from_ebc(ebc: &EmbeddingBagCollection, precision: QuantPrecision) -> Result<Self, EmbeddingError> {
        let core = ebc.core();
        let storage = match precision {
            QuantPrecision::Fp16 => {
                let configs = core
                    .tables
                    .iter()
                    .map(|t| {
                        let mut c = t.config.clone().with_precision(crate::WeightPrecision::Fp16);
                        c.optimizer = None;
                        c
                    })
                    .collect();
                let mut half = EmbeddingBagCollection::new(configs, crate::SparseOptimizerConfig::Sgd { lr: 0.0 }, 0)?;
                half.set_bounds_check(crate::BoundsCheckMode::Fatal);
                for t in &core.tables {
                    // Rounded to the nearest fp16.
                    half.set_table_weights(&t.config.name, ebc.table_weights(&t.config.name).unwrap_or_default())?;
                }
                Storage::Fp16(half)
            }
            QuantPrecision::Int8 => {
                let tables = core
                    .tables
                    .iter()
                    .map(|t| {
                        let c = &t.config;
                        let w = ebc.table_weights(&c.name).unwrap_or_default();
                        let mut data = Vec::with_capacity(c.rows as usize * precision.row_bytes(c.dim));
                        w.chunks(c.dim.max(1)).for_each(|r| quantize_row_int8(r, &mut data));
                        QTable {
                            name: c.name.clone(),
                            rows: c.rows,
                            dim: c.dim,
                            mean: c.pooling == PoolingMode::Mean,
                            data,
                        }
                    })
                    .collect();
                let outputs = core
                    .outputs
                    .iter()
                    .map(|o| QOutput { input: o.input.clone(), table: o.table, column: o.column })
                    .collect();
                Storage::Int8 { tables, outputs }
            }
        };
        Ok(Self { storage, keys: ebc.output_keys(), dims: ebc.output_dims(), width: ebc.width() })
    }

    /// The storage precision.
    pub fn precision(&self) -> QuantPrecision {
        match self.storage {
            Storage::Fp16(_) => QuantPrecision::Fp16,
            Storage::Int8 { .. } => QuantPrecision::Int8,
        }
    }

    /// Bytes the tables take.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::Fp16(e) => e.table_configs().map(|c| c.rows as usize * c.dim * 2).sum(),
            Storage::Int8 { tables, .. } => tables.iter().map(|t| t.data.len()).sum(),
        }
    }

    /// Output keys in order (the collection's it was quantized from).
    pub fn output_keys(&self) -> Vec<String> {
        self.keys.clone()
    }

    /// Output floats per example.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Table `name`'s values as the kernel reads them, `[rows, dim]` (for checks).
    pub fn dequantized(&self, name: &str) -> Option<Vec<f32>> {
        match &self.storage {
            Storage::Fp16(e) => e.table_weights(name),
            Storage::Int8 { tables, .. } => {
                let t = tables.iter().find(|t| t.name == name)?;
                Some(t.data.chunks((t.dim + 8).max(1)).flat_map(|r| dequantize_row_int8(r, t.dim)).collect())
            }
        }
    }

    /// Pooled lookups `[batch, width]`, as [`EmbeddingBagCollection::forward`].
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor, EmbeddingError> {
        let mut out = vec![0f32; kjt.stride() * self.width];
        self.forward_into(kjt, &mut out)?;
        KeyedTensor::new(self.keys.clone(), self.dims.clone(), out, kjt.stride())
            .map_err(|e| EmbeddingError::Shape(e.to_string()))
    }

    /// [`Self::forward`] into a caller's `[batch, width]` buffer. Ids outside a table are an
    /// error naming the feature and table (nothing is read).
    pub fn forward_into(&self, kjt: &KeyedJaggedTensor, out: &mut [f32]) -> Result<(), EmbeddingError> {
        let (tables, outputs) = match &self.storage {
            Storage::Fp16(e) => return e.forward_into(kjt, out),
            Storage::Int8 { tables, outputs } => (tables, outputs),
        };
        if kjt.variable_stride_per_key() {
            return Err(EmbeddingError::Shape("quantized tables take one bag per example (no VBE)".into()));
        }
        let batch = kjt.stride();
        if out.len() != batch * self.width {
            return Err(EmbeddingError::Shape(format!(
                "output buffer has {} floats, expected batch {batch} x width {}",
                out.len(),
                self.width
            )));
        }
        let mut keys = Vec::with_capacity(outputs.len());
        for o in outputs {
            let t = &tables[o.table];
            let k = kjt.key_index(&o.input).ok_or_else(|| EmbeddingError::MissingFeature {
                feature: o.input.clone(),
                table: t.name.clone(),
                available: kjt.keys().join(", "),
            })?;
            let f = kjt.feature(k);
            if let Some(i) = f.values.iter().position(|&id| id < 0 || id as u64 >= t.rows) {
                let sample = (0..batch).find(|&b| f.bag_start(b + 1) > i).unwrap_or(0);
                return Err(EmbeddingError::IdOutOfRange {
                    table: t.name.clone(),
                    feature: o.input.clone(),
                    sample,
                    id: f.values[i],
                    rows: t.rows,
                });
            }
            keys.push(k);
        }
        let width = self.width;
        let chunk = (batch / (rayon::current_num_threads() * 8)).clamp(16, 512);
        let job = |c: usize, rows: &mut [f32]| {
            let n = rows.len() / width.max(1);
            for (o, &k) in outputs.iter().zip(&keys) {
                let t = &tables[o.table];
                let f = kjt.feature(k);
                let p = Int8Pool { f: &f, b0: c * chunk, n, width, col: o.column };
                pool_int8(t, &p, rows);
            }
        };
        let step = (chunk * width).max(1);
        if rayon::current_num_threads() == 1 {
            out.chunks_mut(step).enumerate().for_each(|(c, rows)| job(c, rows));
        } else {
            out.par_chunks_mut(step).enumerate().for_each(|(c, rows)| job(c, rows));
        }
        Ok(())
    }
}

/// One output's bags `b0..b0 + n` of a batch, pooled into columns `col..` of `width`-wide rows.
struct Int8Pool<'a, 'b> {
    f: &'a trainrec_sparse::FeatureView<'b>,
    b0: usize,
    n: usize,
    width: usize,
    col: usize,
}

/// Pools int8 rows (ids already checked), the AVX2 + FMA copy where the CPU has it.
fn pool_int8(t: &QTable, p: &Int8Pool<'_, '_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::tbe::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
        return unsafe { pool_int8_avx2(t, p, out) };
    }
    pool_int8_dims(t, p, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn pool_int8_avx2(t: &QTable, p: &Int8Pool<'_, '_>, out: &mut [f32]) {
    pool_int8_dims(t, p, out)
}

#[inline(always)]
fn pool_int8_dims(t: &QTable, p: &Int8Pool<'_, '_>, out: &mut [f32]) {
    match t.dim {
        8 => pool_int8_fixed::<8>(t, p, out),
        16 => pool_int8_fixed::<16>(t, p, out),
        32 => pool_int8_fixed::<32>(t, p, out),
        64 => pool_int8_fixed::<64>(t, p, out),
        128 => pool_int8_fixed::<128>(t, p, out),
        _ => pool_int8_any(t, p, out),
    }
}

/// `D`-wide rows: the bag's sum stays in registers; rows `PREFETCH` ids ahead are prefetched.
#[inline(always)]
fn pool_int8_fixed<const D: usize>(t: &QTable, p: &Int8Pool<'_, '_>, out: &mut [f32]) {
    let rb = D + 8;
    let f = p.f;
    let end = f.bag_start(p.b0 + p.n);
    let mut pos = f.bag_start(p.b0);
    for local in 0..p.n {
        let stop = f.bag_start(p.b0 + local + 1);
        let len = stop - pos;
        let mut acc = [0f32; D];
        while pos < stop {
            if pos + crate::tbe::PREFETCH < end {
                let r = f.values[pos + crate::tbe::PREFETCH] as usize;
                crate::tbe::prefetch(t.data.as_ptr().wrapping_add(r * rb), rb);
            }
            let row: &[u8; D] = t.data[f.values[pos] as usize * rb..][..D].try_into().expect("a row has D codes");
            let (scale, bias) = scale_bias(&t.data[f.values[pos] as usize * rb + D..][..8]);
            let w = f.weights.map_or(1.0, |ws| ws[pos]);
            let (a, c) = (w * scale, w * bias);
            (0..D).for_each(|d| acc[d] += a * row[d] as f32 + c);
            pos += 1;
        }
        if t.mean && len > 0 {
            let inv = 1.0 / len as f32;
            acc.iter_mut().for_each(|x| *x *= inv);
        }
        out[local * p.width + p.col..][..D].copy_from_slice(&acc);
    }
}

#[inline(always)]
fn pool_int8_any(t: &QTable, p: &Int8Pool<'_, '_>, out: &mut [f32]) {
    let (dim, rb) = (t.dim, t.dim + 8);
    let f = p.f;
    let mut pos = f.bag_start(p.b0);
    for local in 0..p.n {
        let stop = f.bag_start(p.b0 + local + 1);
        let len = stop - pos;
        let acc = &mut out[local * p.width + p.col..][..dim];
        acc.fill(0.0);
        while pos < stop {
            let r = &t.data[f.values[pos] as usize * rb..][..rb];
            let (scale, bias) = scale_bias(&r[dim..]);
            let w = f.weights.map_or(1.0, |ws| ws[pos]);
            let (a, c) = (w * scale, w * bias);
            acc.iter_mut().zip(&r[..dim]).for_each(|(x, &q)| *x += a * q as f32 + c);
            pos += 1;
        }
        if t.mean && len > 0 {
            let inv = 1.0 / len as f32;
            acc.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EmbeddingBagConfig, SparseOptimizerConfig};

    fn ebc() -> EmbeddingBagCollection {
        let tables = vec![
            EmbeddingBagConfig::new("a", 50, 8, PoolingMode::Sum, &["x"]),
            EmbeddingBagConfig::new("b", 30, 5, PoolingMode::Mean, &["y", "x@b"]),
        ];
        let mut e = EmbeddingBagCollection::new(tables, SparseOptimizerConfig::Sgd { lr: 0.1 }, 3).unwrap();
        // Rows with a wide spread, one constant row.
        let w: Vec<f32> = (0..50 * 8).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        e.set_table_weights("a", w).unwrap();
        let mut wb: Vec<f32> = (0..30 * 5).map(|i| ((i * 11 % 23) as f32) * -0.07).collect();
        wb[..5].fill(0.25);
        e.set_table_weights("b", wb).unwrap();
        e
    }

    fn kjt(weighted: bool) -> KeyedJaggedTensor {
        let lengths = vec![2, 0, 3, 1, 1, 2, 0, 2, 3, 1, 1, 1];
        let values = vec![1, 29, 0, 7, 7, 3, 0, 29, 4, 0, 1, 2, 3, 4, 5, 6, 7];
        let weights = weighted.then(|| (0..values.len()).map(|i| 0.5 + i as f32 * 0.1).collect());
        KeyedJaggedTensor::new(vec!["x".into(), "y".into(), "z".into()], values, weights, lengths, 4).unwrap()
    }

    #[test]
    fn int8_rows_follow_fbgemms_layout() {
        let row = [-1.0f32, 0.0, 0.5, 3.0];
        let mut q = Vec::new();
        quantize_row_int8(&row, &mut q);
        assert_eq!(q.len(), 4 + 8);
        // scale = 4 / 255, bias = -1: codes round((x + 1) * 255 / 4).
        assert_eq!(&q[..4], &[0, 64, 96, 255]);
        assert_eq!(scale_bias(&q[4..]), (4.0 / 255.0, -1.0));
        let back = dequantize_row_int8(&q, 4);
        for (x, y) in row.iter().zip(&back) {
            assert!((x - y).abs() <= 2.0 / 255.0 + 1e-6, "{row:?} vs {back:?}");
        }
        // A constant row comes back exactly.
        let mut q = Vec::new();
        quantize_row_int8(&[0.25; 3], &mut q);
        assert_eq!(dequantize_row_int8(&q, 3), [0.25; 3]);
    }

    #[test]
    fn the_quantized_forward_pools_the_dequantized_rows() {
        let e = ebc();
        for precision in [QuantPrecision::Int8, QuantPrecision::Fp16] {
            let q = QuantizedEbc::from_ebc(&e, precision).unwrap();
            assert_eq!(q.bytes(), 50 * precision.row_bytes(8) + 30 * precision.row_bytes(5));
            for weighted in [false, true] {
                let batch = kjt(weighted);
                let got = q.forward(&batch).unwrap();
                // Float64 reference over the dequantized rows, bag by bag.
                let tables = [q.dequantized("a").unwrap(), q.dequantized("b").unwrap()];
                let outs = [("x", 0usize, 8usize, 0usize, false), ("y", 1, 5, 8, true), ("x", 1, 5, 13, true)];
                for (key, t, dim, col, mean) in outs {
                    let f = batch.feature(batch.key_index(key).unwrap());
                    for b in 0..4 {
                        let (s, end) = (f.bag_start(b), f.bag_start(b + 1));
                        for d in 0..dim {
                            let mut want = 0f64;
                            for j in s..end {
                                let w = f.weights.map_or(1.0, |ws| ws[j]) as f64;
                                want += w * tables[t][f.values[j] as usize * dim + d] as f64;
                            }
                            if mean && end > s {
                                want /= (end - s) as f64;
                            }
                            let g = got.values()[b * 18 + col + d] as f64;
                            assert!((g - want).abs() < 1e-5, "{precision:?} {key} bag {b} col {d}: {g} vs {want}");
                        }
                    }
                }
                // And close to the fp32 tables' forward.
                let exact = e.forward(&batch).unwrap();
                let tol = if precision == QuantPrecision::Int8 { 0.05 } else { 0.01 };
                for (g, x) in got.values().iter().zip(exact.values()) {
                    assert!((g - x).abs() < tol, "{precision:?}: {g} vs fp32 {x}");
                }
            }
        }
    }

    #[test]
    fn out_of_range_ids_are_named() {
        let q = QuantizedEbc::from_ebc(&ebc(), QuantPrecision::Int8).unwrap();
        let bad = KeyedJaggedTensor::new(vec!["x".into(), "y".into()], vec![50, 1], None, vec![1, 0, 1, 0], 2).unwrap();
        let err = q.forward(&bad).unwrap_err().to_string();
        assert!(err.contains("id 50") && err.contains("\"a\"") && err.contains("\"x\""), "{err}");
    }
}
