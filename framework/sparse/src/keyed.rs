use crate::{SparseError, inconsistent, unknown_key};

/// Dense per-key outputs side by side: `values` is `[batch, sum(length_per_key)]` row-major,
/// key `k` occupying columns `offset_per_key[k]..offset_per_key[k+1]` (TorchRec's `KeyedTensor`
/// with `key_dim = 1`).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyedTensor {
    keys: Vec<String>,
    length_per_key: Vec<usize>,
    offset_per_key: Vec<usize>,
    values: Vec<f32>,
    batch: usize,
}

impl KeyedTensor {
    /// Builds from keys, per-key widths and row-major values.
    pub fn new(
        keys: Vec<String>,
        length_per_key: Vec<usize>,
        values: Vec<f32>,
        batch: usize,
    ) -> Result<Self, SparseError> {
        if keys.len() != length_per_key.len() {
            return Err(inconsistent(
                "KeyedTensor",
                format!("{} keys but {} lengths", keys.len(), length_per_key.len()),
            ));
        }
        let mut offset_per_key = vec![0];
        for l in &length_per_key {
            offset_per_key.push(offset_per_key.last().copied().unwrap_or(0) + l);
        }
        let width = *offset_per_key.last().unwrap_or(&0);
        if values.len() != batch * width {
            return Err(inconsistent(
                "KeyedTensor",
                format!("{} values for batch {batch} x width {width}", values.len()),
            ));
        }
        Ok(Self { keys, length_per_key, offset_per_key, values, batch })
    }

    /// Keys.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }
    /// Width of each key.
    pub fn length_per_key(&self) -> &[usize] {
        &self.length_per_key
    }
    /// Column offsets (`keys + 1` entries).
    pub fn offset_per_key(&self) -> &[usize] {
        &self.offset_per_key
    }
    /// Row-major values `[batch, width]`.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    /// Consumes the tensor, returning its values.
    pub fn into_values(self) -> Vec<f32> {
        self.values
    }
    /// Batch size.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Total width.
    pub fn width(&self) -> usize {
        *self.offset_per_key.last().unwrap_or(&0)
    }
    /// Width of `key`.
    pub fn key_dim(&self, key: &str) -> Result<usize, SparseError> {
        let k = self.keys.iter().position(|x| x == key).ok_or_else(|| unknown_key(key, &self.keys))?;
        Ok(self.length_per_key[k])
    }

    /// Each key's `[batch, dim]` block, row-major.
    pub fn to_dict(&self) -> Vec<(String, Vec<f32>)> {
        let w = self.width();
        (0..self.keys.len())
            .map(|k| {
                let (a, b) = (self.offset_per_key[k], self.offset_per_key[k + 1]);
                let mut block = Vec::with_capacity(self.batch * (b - a));
                for r in 0..self.batch {
                    block.extend_from_slice(&self.values[r * w + a..r * w + b]);
                }
                (self.keys[k].clone(), block)
            })
            .collect()
    }

    /// The named keys, side by side in that order.
    pub fn select(&self, names: &[&str]) -> Result<Self, SparseError> {
        let dict = self.to_dict();
        let mut parts = Vec::new();
        for n in names {
            let k = self.keys.iter().position(|x| x == n).ok_or_else(|| unknown_key(n, &self.keys))?;
            parts.push(Self::new(
                vec![self.keys[k].clone()],
                vec![self.length_per_key[k]],
                dict[k].1.clone(),
                self.batch,
            )?);
        }
        Self::concat(&parts)
    }

    /// Concatenates along the key dimension (equal batch sizes).
    pub fn concat(parts: &[Self]) -> Result<Self, SparseError> {
        let Some(first) = parts.first() else {
            return Err(SparseError::BadArgument { op: "concat", message: "nothing to concatenate".into() });
        };
        let batch = first.batch;
        if let Some((i, p)) = parts.iter().enumerate().find(|(_, p)| p.batch != batch) {
            return Err(SparseError::BadArgument {
                op: "concat",
                message: format!("part {i} has batch {}, part 0 has {batch}", p.batch),
            });
        }
        let keys: Vec<String> = parts.iter().flat_map(|p| p.keys.iter().cloned()).collect();
        let lengths: Vec<usize> = parts.iter().flat_map(|p| p.length_per_key.iter().copied()).collect();
        let mut values = Vec::with_capacity(parts.iter().map(|p| p.values.len()).sum());
        for r in 0..batch {
            for p in parts {
                let w = p.width();
                values.extend_from_slice(&p.values[r * w..(r + 1) * w]);
            }
        }
        Self::new(keys, lengths, values, batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dict_select_concat() {
        // batch 2, a dim 1, b dim 2: rows [a0 b0 b0'], [a1 b1 b1']
        let kt = KeyedTensor::new(vec!["a".into(), "b".into()], vec![1, 2], vec![1., 2., 3., 4., 5., 6.], 2).unwrap();
        assert_eq!(kt.to_dict()[1].1, vec![2., 3., 5., 6.]);
        assert_eq!(kt.key_dim("b").unwrap(), 2);
        let s = kt.select(&["b", "a"]).unwrap();
        assert_eq!(s.values(), &[2., 3., 1., 5., 6., 4.]);
        assert!(KeyedTensor::new(vec!["a".into()], vec![2], vec![1.0; 3], 2).is_err());
        assert!(kt.select(&["c"]).is_err());
    }
}
