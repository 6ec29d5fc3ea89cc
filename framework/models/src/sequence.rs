//! What a model receives of a batch ([`ModelInput`]): dense features, pooled embeddings and,
//! per sequence feature, its unpooled embeddings as a jagged tensor ([`JaggedEmbeddings`]:
//! one row per id, each example's ids in order, as TorchRec's `EmbeddingCollection` hands a
//! `JaggedTensor` to a model).
//!
//! Attention layers want a rectangle: [`JaggedEmbeddings::to_padded`] lays the rows out as
//! `[batch, length, dim]` with a mask (TorchRec's `JaggedTensor.to_padded_dense`, FBGEMM's
//! `jagged_to_padded_dense`), and [`JaggedEmbeddings::from_padded`] takes the rows back
//! (FBGEMM's `dense_to_jagged`). Both are one `index_select` over the rows (plus a padding
//! row), so the gradient of the padded tensor flows back to the jagged rows, and from them to
//! the fused embedding update.

use tch::{Kind, Tensor};

/// A jagged tensor whose parts do not fit together.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct JaggedError(String);

/// One sequence feature of a batch: `values` `[ids, dim]` holds example 0's rows, then example
/// 1's, and so on; `lengths[b]` is example `b`'s number of ids.
#[derive(Debug)]
pub struct JaggedEmbeddings {
    /// One row per id, `[ids, dim]`, examples one after another.
    pub values: Tensor,
    /// Ids per example; they sum to the rows of `values`.
    pub lengths: Vec<usize>,
}

impl JaggedEmbeddings {
    /// Rows `values` `[ids, dim]` with their examples' `lengths`; the lengths must add up to
    /// the rows.
    pub fn new(values: Tensor, lengths: Vec<usize>) -> Result<Self, JaggedError> {
        let rows: usize = lengths.iter().sum();
        let size = values.size();
        if size.len() != 2 || size[0] as usize != rows {
            return Err(JaggedError(format!(
                "jagged embeddings of {} examples hold {rows} ids, but their values are {size:?} (want [{rows}, dim])",
                lengths.len()
            )));
        }
        Ok(Self { values, lengths })
    }

    /// Examples in the batch.
    pub fn batch_size(&self) -> usize {
        self.lengths.len()
    }

    /// Embedding width.
    pub fn dim(&self) -> i64 {
        self.values.size()[1]
    }

    /// The longest example's number of ids (0 for an empty batch).
    pub fn max_length(&self) -> usize {
        self.lengths.iter().copied().max().unwrap_or(0)
    }

    /// Where each example's rows start, and the total: `batch + 1` entries.
    pub fn offsets(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.lengths.len() + 1);
        let mut at = 0;
        out.push(0);
        for &n in &self.lengths {
            at += n;
            out.push(at);
        }
        out
    }

    /// The rows as `[batch, length, dim]`, each example's ids first and `padding` after them,
    /// with the mask `[batch, length]` (`true` where an id is). `length` is `max_length` when
    /// given (an example with more ids keeps its first `length`, as TorchRec's
    /// `to_padded_dense`), else the longest example's.
    pub fn to_padded(&self, max_length: Option<usize>, padding: f64) -> (Tensor, Tensor) {
        let (b, l) = (self.batch_size(), max_length.unwrap_or_else(|| self.max_length()));
        let pad_row = self.values.size()[0];
        let mut index = vec![pad_row; b * l];
        let mut mask = vec![false; b * l];
        for (e, (&start, &n)) in self.offsets().iter().zip(&self.lengths).enumerate() {
            for j in 0..n.min(l) {
                index[e * l + j] = (start + j) as i64;
                mask[e * l + j] = true;
            }
        }
        let device = self.values.device();
        let pad = Tensor::full([1, self.dim()], padding, (self.values.kind(), device));
        let rows = Tensor::cat(&[&self.values, &pad], 0);
        let index = Tensor::from_slice(&index).to_device(device);
        let padded = rows.index_select(0, &index).view([b as i64, l as i64, self.dim()]);
        let mask = Tensor::from_slice(&mask).to_device(device).view([b as i64, l as i64]);
        (padded, mask)
    }

    /// The jagged rows of `padded` `[batch, length, dim]`: example `b`'s first `lengths[b]`
    /// positions (each at most `length`).
    pub fn from_padded(padded: &Tensor, lengths: Vec<usize>) -> Result<Self, JaggedError> {
        let size = padded.size();
        if size.len() != 3 || size[0] as usize != lengths.len() {
            return Err(JaggedError(format!(
                "a padded tensor {size:?} for {} examples (want [{}, length, dim])",
                lengths.len(),
                lengths.len()
            )));
        }
        let l = size[1] as usize;
        if let Some((e, &n)) = lengths.iter().enumerate().find(|(_, n)| **n > l) {
            return Err(JaggedError(format!("example {e} has {n} ids, more than the padded length {l}")));
        }
        let index: Vec<i64> =
            lengths.iter().enumerate().flat_map(|(e, &n)| (0..n).map(move |j| (e * l + j) as i64)).collect();
        let flat = padded.reshape([-1, size[2]]);
        let values = flat.index_select(0, &Tensor::from_slice(&index).to_device(padded.device()));
        Self::new(values, lengths)
    }

    /// The lengths as an int64 tensor `[batch]` on the values' device.
    pub fn lengths_tensor(&self) -> Tensor {
        let l: Vec<i64> = self.lengths.iter().map(|&n| n as i64).collect();
        Tensor::from_slice(&l).to_kind(Kind::Int64).to_device(self.values.device())
    }
}

/// What a model receives of a batch: dense features, pooled embeddings, the batch's
/// sequence features by output name and, in training, the catalogue rows it asked for
/// (`DenseModel::catalogue`).
pub struct ModelInput<'a> {
    /// Dense features `[batch, num_dense]`.
    pub dense: &'a Tensor,
    /// Pooled embeddings `[batch, sum(dims)]`, in the order of the model's pooled outputs.
    pub pooled: &'a Tensor,
    /// Per sequence feature: its name and jagged embeddings.
    pub sequences: &'a [(String, JaggedEmbeddings)],
    /// The catalogue rows the model asked for, in a training step (`None` in evaluation and
    /// for a model that asks for none).
    pub catalogue: Option<&'a Catalogue>,
}

impl<'a> ModelInput<'a> {
    /// A batch without sequence features.
    pub fn pooled(dense: &'a Tensor, pooled: &'a Tensor) -> Self {
        Self { dense, pooled, sequences: &[], catalogue: None }
    }

    /// Sequence feature `name`, if the batch has it.
    pub fn sequence(&self, name: &str) -> Option<&'a JaggedEmbeddings> {
        self.sequences.iter().find(|(n, _)| n == name).map(|(_, j)| j)
    }
}

/// Which rows of an item table a model reads in each training step besides the batch's own
/// ids (`DenseModel::catalogue`): a next-item model scores its users against them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CatalogueRows {
    /// Every row of the table: a full softmax over the catalogue.
    All,
    /// This many rows drawn uniformly (with replacement) for the whole batch, the same for
    /// every example of a rank's batch: shared sampled negatives.
    Uniform(usize),
}

/// A model's request for catalogue rows: the rows of the table that reads sequence feature
/// `feature`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogueRequest {
    /// A sequence feature (a feature of a `pooling = "none"` table); the rows are its table's.
    pub feature: String,
    /// Which rows.
    pub rows: CatalogueRows,
}

/// Catalogue rows looked up for a training step: `rows[i]` is the embedding of row `ids[i]`.
/// `rows` is a leaf that receives its gradient; the engine adds it to the table's fused update
/// with the batch's other lookups of that table (one optimizer step per training step).
#[derive(Debug)]
pub struct Catalogue {
    /// The table rows, `[n]` (int64, on the rows' device): `0..rows` for
    /// [`CatalogueRows::All`].
    pub ids: Tensor,
    /// Their embeddings `[n, dim]`.
    pub rows: Tensor,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, dim: usize) -> Tensor {
        let v: Vec<f32> = (0..n * dim).map(|i| i as f32 + 1.0).collect();
        Tensor::from_slice(&v).view([n as i64, dim as i64])
    }

    fn vec2(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.reshape([-1])).unwrap()
    }

    #[test]
    fn padding_lays_out_each_examples_rows_then_the_padding() {
        // Lengths [2, 0, 3], dim 2: rows (1,2) (3,4) | - | (5,6) (7,8) (9,10).
        let j = JaggedEmbeddings::new(rows(5, 2), vec![2, 0, 3]).unwrap();
        assert_eq!(j.offsets(), vec![0, 2, 2, 5]);
        let (p, mask) = j.to_padded(None, -1.0);
        assert_eq!(p.size(), vec![3, 3, 2]);
        #[rustfmt::skip]
        let want = [1., 2., 3., 4., -1., -1.,  -1., -1., -1., -1., -1., -1.,  5., 6., 7., 8., 9., 10.];
        assert_eq!(vec2(&p), want);
        let m = Vec::<bool>::try_from(&mask.reshape([-1])).unwrap();
        assert_eq!(m, [true, true, false, false, false, false, true, true, true]);
    }

    #[test]
    fn a_shorter_length_keeps_each_examples_first_ids() {
        let j = JaggedEmbeddings::new(rows(5, 1), vec![2, 0, 3]).unwrap();
        let (p, mask) = j.to_padded(Some(2), 0.0);
        assert_eq!(vec2(&p), [1., 2., 0., 0., 3., 4.]);
        assert_eq!(Vec::<bool>::try_from(&mask.reshape([-1])).unwrap(), [true, true, false, false, true, true]);
    }

    #[test]
    fn the_padded_gradient_reaches_the_rows_and_back_is_the_identity() {
        let values = rows(5, 2).set_requires_grad(true);
        let j = JaggedEmbeddings::new(values.shallow_clone(), vec![2, 0, 3]).unwrap();
        let (p, _) = j.to_padded(Some(4), 0.0);
        // Weight each slot by its flat position: row r's gradient is the weight of its slot.
        let w = Tensor::arange(3 * 4 * 2, (Kind::Float, tch::Device::Cpu)).view([3, 4, 2]);
        (&p * &w).sum(Kind::Float).backward();
        // Example 0 at slots 0, 1; example 2 at slots 8, 9, 10 (of 4 per example).
        let slot = |e: usize, k: usize, d: usize| ((e * 4 + k) * 2 + d) as f32;
        let want: Vec<f32> = [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]
            .iter()
            .flat_map(|&(e, k)| [slot(e, k, 0), slot(e, k, 1)])
            .collect();
        assert_eq!(vec2(&values.grad()), want);
        let back = JaggedEmbeddings::from_padded(&p, vec![2, 0, 3]).unwrap();
        assert_eq!(vec2(&back.values), vec2(&values.detach()));
    }

    #[test]
    fn inconsistent_shapes_are_errors_that_say_why() {
        let e = JaggedEmbeddings::new(rows(4, 2), vec![2, 3]).unwrap_err().to_string();
        assert!(e.contains("hold 5 ids") && e.contains("[4, 2]"), "{e}");
        let p = Tensor::zeros([2, 3, 2], (Kind::Float, tch::Device::Cpu));
        let e = JaggedEmbeddings::from_padded(&p, vec![1, 4]).unwrap_err().to_string();
        assert!(e.contains("example 1 has 4 ids"), "{e}");
    }
}
