use crate::{SparseError, inconsistent, lengths_from_offsets, offsets_from_lengths};

/// Rows of variable length: `values` with `lengths[i]` values in row `i`.
#[derive(Clone, Debug, PartialEq)]
pub struct JaggedTensor<T> {
    values: Vec<T>,
    weights: Option<Vec<f32>>,
    lengths: Vec<u32>,
    offsets: Vec<usize>,
}

impl<T> JaggedTensor<T> {
    /// Builds from values and per-row lengths.
    pub fn new(values: Vec<T>, weights: Option<Vec<f32>>, lengths: Vec<u32>) -> Result<Self, SparseError> {
        let offsets = offsets_from_lengths(&lengths);
        Self::check(values, weights, lengths, offsets)
    }

    /// Builds from values and row offsets (`rows + 1` entries starting at 0).
    pub fn from_offsets(values: Vec<T>, weights: Option<Vec<f32>>, offsets: Vec<usize>) -> Result<Self, SparseError> {
        let lengths = lengths_from_offsets("JaggedTensor", &offsets)?;
        Self::check(values, weights, lengths, offsets)
    }

    fn check(
        values: Vec<T>,
        weights: Option<Vec<f32>>,
        lengths: Vec<u32>,
        offsets: Vec<usize>,
    ) -> Result<Self, SparseError> {
        let total = *offsets.last().unwrap_or(&0);
        if total != values.len() {
            return Err(inconsistent(
                "JaggedTensor",
                format!("lengths sum to {total} but there are {} values", values.len()),
            ));
        }
        if let Some(w) = &weights {
            if w.len() != values.len() {
                return Err(inconsistent("JaggedTensor", format!("{} weights for {} values", w.len(), values.len())));
            }
        }
        Ok(Self { values, weights, lengths, offsets })
    }

    /// All values, row after row.
    pub fn values(&self) -> &[T] {
        &self.values
    }
    /// Per-value weights, if any.
    pub fn weights(&self) -> Option<&[f32]> {
        self.weights.as_deref()
    }
    /// Per-row lengths.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }
    /// Row offsets (`len() + 1` entries).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.lengths.len()
    }
    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }
    /// The values of row `i` (empty when out of range).
    pub fn row(&self, i: usize) -> &[T] {
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.values[a..b],
            _ => &[],
        }
    }
}

impl<T: Clone> JaggedTensor<T> {
    /// One `Vec` per row.
    pub fn to_dense(&self) -> Vec<Vec<T>> {
        (0..self.len()).map(|i| self.row(i).to_vec()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_and_reads_rows() {
        let jt = JaggedTensor::new(vec![1, 2, 3], None, vec![2, 0, 1]).unwrap();
        assert_eq!(jt.offsets(), &[0, 2, 2, 3]);
        assert_eq!(jt.to_dense(), vec![vec![1, 2], vec![], vec![3]]);
        let jt2 = JaggedTensor::from_offsets(vec![1, 2, 3], Some(vec![0.5, 1.0, 2.0]), vec![0, 2, 2, 3]).unwrap();
        assert_eq!(jt2.lengths(), &[2, 0, 1]);
        assert_eq!(jt2.weights(), Some(&[0.5f32, 1.0, 2.0][..]));
    }

    #[test]
    fn rejects_inconsistent_inputs() {
        assert!(JaggedTensor::new(vec![1, 2], None, vec![3]).unwrap_err().to_string().contains("sum to 3"));
        assert!(JaggedTensor::new(vec![1, 2], Some(vec![1.0]), vec![2]).is_err());
        assert!(JaggedTensor::<i64>::from_offsets(vec![], None, vec![1, 0]).is_err());
        assert!(
            JaggedTensor::from_offsets(vec![1, 2], None, vec![0, 2, 1]).unwrap_err().to_string().contains("decrease")
        );
    }
}
