use std::collections::HashSet;

use crate::{JaggedTensor, SparseError, inconsistent, lengths_from_offsets, offsets_from_lengths, unknown_key};

/// For variable batch per feature (VBE): the keys, and for each key the index of every sample
/// of the full batch into that key's bags (TorchRec's `inverse_indices`).
#[derive(Clone, Debug, PartialEq)]
pub struct InverseIndices {
    /// Keys, in the same order as the KJT's keys.
    pub keys: Vec<String>,
    /// Per key: one bag index per sample of the full batch.
    pub indices: Vec<Vec<usize>>,
}

/// A batch of sparse features: for each key, one bag of ids per sample, stored key-major
/// (all bags of key 0, then all bags of key 1, ...).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyedJaggedTensor {
    keys: Vec<String>,
    values: Vec<i64>,
    weights: Option<Vec<f32>>,
    lengths: Vec<u32>,
    offsets: Vec<usize>,
    stride: usize,
    stride_per_key_per_rank: Option<Vec<Vec<usize>>>,
    inverse_indices: Option<InverseIndices>,
    /// Index into `lengths` of each key's first bag (`keys + 1` entries).
    key_bags: Vec<usize>,
}

/// One key's bags, borrowed from a [`KeyedJaggedTensor`].
#[derive(Clone, Copy, Debug)]
pub struct FeatureView<'a> {
    /// The ids of all bags of this key.
    pub values: &'a [i64],
    /// Their weights, if the KJT is weighted.
    pub weights: Option<&'a [f32]>,
    /// Bag lengths.
    pub lengths: &'a [u32],
    /// Bag offsets into the KJT's values (`lengths.len() + 1` entries, absolute).
    offsets: &'a [usize],
    base: usize,
}

impl<'a> FeatureView<'a> {
    /// Number of bags.
    pub fn num_bags(&self) -> usize {
        self.lengths.len()
    }
    /// The ids of bag `b` (empty when out of range).
    pub fn bag(&self, b: usize) -> &'a [i64] {
        match (self.offsets.get(b), self.offsets.get(b + 1)) {
            (Some(&s), Some(&e)) => &self.values[s - self.base..e - self.base],
            _ => &[],
        }
    }
    /// Where bag `b` starts in [`Self::values`] (`values.len()` for `b == num_bags()`).
    pub fn bag_start(&self, b: usize) -> usize {
        self.offsets.get(b).map_or(self.values.len(), |&s| s - self.base)
    }
    /// The weights of bag `b`, if weighted.
    pub fn bag_weights(&self, b: usize) -> Option<&'a [f32]> {
        let w = self.weights?;
        match (self.offsets.get(b), self.offsets.get(b + 1)) {
            (Some(&s), Some(&e)) => Some(&w[s - self.base..e - self.base]),
            _ => Some(&[]),
        }
    }
}

const KJT: &str = "KeyedJaggedTensor";

impl KeyedJaggedTensor {
    /// Builds a KJT with `stride` bags per key from lengths.
    pub fn new(
        keys: Vec<String>,
        values: Vec<i64>,
        weights: Option<Vec<f32>>,
        lengths: Vec<u32>,
        stride: usize,
    ) -> Result<Self, SparseError> {
        let offsets = offsets_from_lengths(&lengths);
        Self::build(keys, values, weights, lengths, offsets, stride, None, None)
    }

    /// Builds a KJT with `stride` bags per key from offsets (`bags + 1` entries).
    pub fn from_offsets(
        keys: Vec<String>,
        values: Vec<i64>,
        weights: Option<Vec<f32>>,
        offsets: Vec<usize>,
        stride: usize,
    ) -> Result<Self, SparseError> {
        let lengths = lengths_from_offsets(KJT, &offsets)?;
        Self::build(keys, values, weights, lengths, offsets, stride, None, None)
    }

    /// Builds a variable-batch KJT: key `k` has `sum(stride_per_key_per_rank[k])` bags.
    pub fn new_vbe(
        keys: Vec<String>,
        values: Vec<i64>,
        weights: Option<Vec<f32>>,
        lengths: Vec<u32>,
        stride_per_key_per_rank: Vec<Vec<usize>>,
        inverse_indices: Option<InverseIndices>,
    ) -> Result<Self, SparseError> {
        let stride = stride_per_key_per_rank.iter().map(|r| r.iter().sum::<usize>()).max().unwrap_or(0);
        let offsets = offsets_from_lengths(&lengths);
        Self::build(keys, values, weights, lengths, offsets, stride, Some(stride_per_key_per_rank), inverse_indices)
    }

    /// A KJT with the given keys and no ids.
    pub fn empty(keys: Vec<String>, stride: usize) -> Result<Self, SparseError> {
        let n = keys.len() * stride;
        Self::new(keys, Vec::new(), None, vec![0; n], stride)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        keys: Vec<String>,
        values: Vec<i64>,
        weights: Option<Vec<f32>>,
        lengths: Vec<u32>,
        offsets: Vec<usize>,
        stride: usize,
        stride_per_key_per_rank: Option<Vec<Vec<usize>>>,
        inverse_indices: Option<InverseIndices>,
    ) -> Result<Self, SparseError> {
        let mut seen = HashSet::new();
        for k in &keys {
            if !seen.insert(k.as_str()) {
                return Err(inconsistent(KJT, format!("key \"{k}\" appears twice")));
            }
        }
        let strides: Vec<usize> = match &stride_per_key_per_rank {
            Some(spkr) => {
                if spkr.len() != keys.len() {
                    return Err(inconsistent(
                        KJT,
                        format!("stride_per_key_per_rank has {} entries for {} keys", spkr.len(), keys.len()),
                    ));
                }
                if spkr.iter().any(|r| r.len() != spkr.first().map_or(0, Vec::len)) {
                    return Err(inconsistent(
                        KJT,
                        "stride_per_key_per_rank must list the same number of ranks for every key",
                    ));
                }
                spkr.iter().map(|r| r.iter().sum()).collect()
            }
            None => vec![stride; keys.len()],
        };
        let mut key_bags = Vec::with_capacity(keys.len() + 1);
        key_bags.push(0);
        for s in &strides {
            key_bags.push(key_bags.last().copied().unwrap_or(0) + s);
        }
        let bags = *key_bags.last().unwrap_or(&0);
        if lengths.len() != bags {
            return Err(inconsistent(
                KJT,
                format!("{} lengths for {} keys with {} bags in all", lengths.len(), keys.len(), bags),
            ));
        }
        let total = *offsets.last().unwrap_or(&0);
        if total != values.len() {
            return Err(inconsistent(KJT, format!("lengths sum to {total} but there are {} values", values.len())));
        }
        if let Some(w) = &weights {
            if w.len() != values.len() {
                return Err(inconsistent(KJT, format!("{} weights for {} values", w.len(), values.len())));
            }
        }
        if let Some(inv) = &inverse_indices {
            if inv.keys != keys {
                return Err(inconsistent(KJT, "inverse_indices keys differ from the KJT's keys"));
            }
            if inv.indices.len() != keys.len() {
                return Err(inconsistent(KJT, "inverse_indices needs one index list per key"));
            }
            let batch = inv.indices.first().map_or(0, Vec::len);
            for (k, idx) in inv.indices.iter().enumerate() {
                if idx.len() != batch {
                    return Err(inconsistent(
                        KJT,
                        format!("inverse_indices of \"{}\" has {} entries, expected {batch}", keys[k], idx.len()),
                    ));
                }
                if let Some(&bad) = idx.iter().find(|&&i| i >= strides[k]) {
                    return Err(inconsistent(
                        KJT,
                        format!(
                            "inverse index {bad} of \"{}\" is out of range (the key has {} bags)",
                            keys[k], strides[k]
                        ),
                    ));
                }
            }
        }
        Ok(Self { keys, values, weights, lengths, offsets, stride, stride_per_key_per_rank, inverse_indices, key_bags })
    }

    /// Keys, in storage order.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }
    /// All ids.
    pub fn values(&self) -> &[i64] {
        &self.values
    }
    /// Per-id weights, if weighted.
    pub fn weights(&self) -> Option<&[f32]> {
        self.weights.as_deref()
    }
    /// Bag lengths, key-major.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }
    /// Bag offsets into `values` (`lengths().len() + 1` entries).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }
    /// Batch size (for VBE, the largest per-key stride).
    pub fn stride(&self) -> usize {
        self.stride
    }
    /// Per-key, per-rank batch sizes of a variable-batch KJT.
    pub fn stride_per_key_per_rank(&self) -> Option<&[Vec<usize>]> {
        self.stride_per_key_per_rank.as_deref()
    }
    /// Inverse indices of a variable-batch KJT.
    pub fn inverse_indices(&self) -> Option<&InverseIndices> {
        self.inverse_indices.as_ref()
    }
    /// Number of bags of each key.
    pub fn stride_per_key(&self) -> Vec<usize> {
        self.key_bags.windows(2).map(|w| w[1] - w[0]).collect()
    }
    /// True for a variable-batch (VBE) KJT.
    pub fn variable_stride_per_key(&self) -> bool {
        self.stride_per_key_per_rank.is_some()
    }
    /// Examples in the batch: a variable-batch KJT's `inverse_indices` length, otherwise the
    /// stride.
    pub fn examples(&self) -> usize {
        match self.inverse_indices() {
            Some(inv) if self.variable_stride_per_key() => inv.indices.first().map_or(0, Vec::len),
            _ => self.stride(),
        }
    }
    /// This KJT (one stride of bags per key) without the values equal to `value` in the keys
    /// `drop_in` selects (their weights too, their bags shorter); `None` when there are none
    /// to drop (nothing copied). Dynamic tables drop the ids without a row this way.
    pub fn without_value(&self, drop_in: impl Fn(usize) -> bool, value: i64) -> Result<Option<Self>, SparseError> {
        let keys = self.keys().len();
        if !(0..keys).any(|k| drop_in(k) && self.feature(k).values.contains(&value)) {
            return Ok(None);
        }
        let mut values = Vec::with_capacity(self.values().len());
        let mut weights = self.weights().map(|w| Vec::with_capacity(w.len()));
        let mut lengths = Vec::with_capacity(self.lengths().len());
        for k in 0..keys {
            let (f, filter) = (self.feature(k), drop_in(k));
            for b in 0..f.num_bags() {
                let (bag, w) = (f.bag(b), f.bag_weights(b));
                let mut n = 0u32;
                for (j, &v) in bag.iter().enumerate() {
                    if filter && v == value {
                        continue;
                    }
                    values.push(v);
                    if let (Some(out), Some(w)) = (weights.as_mut(), w) {
                        out.push(w[j]);
                    }
                    n += 1;
                }
                lengths.push(n);
            }
        }
        Self::new(self.keys().to_vec(), values, weights, lengths, self.stride()).map(Some)
    }
    /// This KJT with one bag per example: a variable-batch KJT expanded by its
    /// `inverse_indices` ([`Self::expand_vbe`]), any other borrowed as it is (no copy).
    pub fn full_batch(&self) -> Result<std::borrow::Cow<'_, Self>, SparseError> {
        if self.variable_stride_per_key() {
            Ok(std::borrow::Cow::Owned(self.expand_vbe()?))
        } else {
            Ok(std::borrow::Cow::Borrowed(self))
        }
    }
    /// Position of `key`.
    pub fn key_index(&self, key: &str) -> Option<usize> {
        self.keys.iter().position(|k| k == key)
    }
    /// Number of ids of each key.
    pub fn length_per_key(&self) -> Vec<usize> {
        self.offset_per_key().windows(2).map(|w| w[1] - w[0]).collect()
    }
    /// Cumulative ids per key (`keys + 1` entries).
    pub fn offset_per_key(&self) -> Vec<usize> {
        self.key_bags.iter().map(|&b| self.offsets[b]).collect()
    }
    /// Every key's ids, mutable, one slice per key (key order), e.g. to remap ids in place.
    pub fn values_per_key_mut(&mut self) -> Vec<&mut [i64]> {
        let mut out = Vec::with_capacity(self.keys.len());
        let mut rest: &mut [i64] = &mut self.values;
        let mut at = 0;
        for w in self.key_bags.windows(2) {
            let (start, end) = (self.offsets[w[0]], self.offsets[w[1]]);
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
            let (mine, tail) = tail.split_at_mut(end - start);
            out.push(mine);
            rest = tail;
            at = end;
        }
        out
    }

    /// The bags of key `k` (an empty view when out of range).
    pub fn feature(&self, k: usize) -> FeatureView<'_> {
        let (b0, b1) = match (self.key_bags.get(k), self.key_bags.get(k + 1)) {
            (Some(&a), Some(&b)) => (a, b),
            _ => (0, 0),
        };
        let (v0, v1) = (self.offsets[b0], self.offsets[b1]);
        FeatureView {
            values: &self.values[v0..v1],
            weights: self.weights.as_deref().map(|w| &w[v0..v1]),
            lengths: &self.lengths[b0..b1],
            offsets: &self.offsets[b0..=b1],
            base: v0,
        }
    }

    /// The KJT with keys in the order `indices` gives (distinct indices; a subset is allowed).
    pub fn permute(&self, indices: &[usize]) -> Result<Self, SparseError> {
        let mut seen = HashSet::new();
        for &i in indices {
            if i >= self.keys.len() {
                return Err(SparseError::BadArgument {
                    op: "permute",
                    message: format!("index {i} out of range for {} keys", self.keys.len()),
                });
            }
            if !seen.insert(i) {
                return Err(SparseError::BadArgument { op: "permute", message: format!("index {i} repeats") });
            }
        }
        let mut values = Vec::new();
        let mut weights = self.weights.as_ref().map(|_| Vec::new());
        let mut lengths = Vec::new();
        for &i in indices {
            let f = self.feature(i);
            values.extend_from_slice(f.values);
            if let (Some(out), Some(w)) = (weights.as_mut(), f.weights) {
                out.extend_from_slice(w);
            }
            lengths.extend_from_slice(f.lengths);
        }
        let keys: Vec<String> = indices.iter().map(|&i| self.keys[i].clone()).collect();
        self.rebuild(keys, values, weights, lengths, indices)
    }

    fn rebuild(
        &self,
        keys: Vec<String>,
        values: Vec<i64>,
        weights: Option<Vec<f32>>,
        lengths: Vec<u32>,
        picked: &[usize],
    ) -> Result<Self, SparseError> {
        match &self.stride_per_key_per_rank {
            Some(spkr) => {
                let inv = self.inverse_indices.as_ref().map(|inv| InverseIndices {
                    keys: keys.clone(),
                    indices: picked.iter().map(|&i| inv.indices[i].clone()).collect(),
                });
                Self::new_vbe(keys, values, weights, lengths, picked.iter().map(|&i| spkr[i].clone()).collect(), inv)
            }
            None => Self::new(keys, values, weights, lengths, self.stride),
        }
    }

    /// Splits into consecutive groups of keys of the given sizes (which must sum to the key count).
    pub fn split(&self, sizes: &[usize]) -> Result<Vec<Self>, SparseError> {
        if sizes.iter().sum::<usize>() != self.keys.len() {
            return Err(SparseError::BadArgument {
                op: "split",
                message: format!(
                    "sizes {sizes:?} sum to {} but there are {} keys",
                    sizes.iter().sum::<usize>(),
                    self.keys.len()
                ),
            });
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&n| {
                let picked: Vec<usize> = (start..start + n).collect();
                start += n;
                self.permute(&picked)
            })
            .collect()
    }

    /// Concatenates KJTs along the key dimension (same stride, distinct keys, all weighted or none).
    pub fn concat(parts: &[Self]) -> Result<Self, SparseError> {
        let Some(first) = parts.first() else {
            return Err(SparseError::BadArgument { op: "concat", message: "nothing to concatenate".into() });
        };
        let weighted = first.weights.is_some();
        let vbe = first.variable_stride_per_key();
        let mut keys = Vec::new();
        let mut values = Vec::new();
        let mut weights = weighted.then(Vec::new);
        let mut lengths = Vec::new();
        let mut spkr = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if p.weights.is_some() != weighted {
                return Err(SparseError::BadArgument {
                    op: "concat",
                    message: format!("part {i} is {}weighted, part 0 is not", if weighted { "not " } else { "" }),
                });
            }
            if p.variable_stride_per_key() != vbe || (!vbe && p.stride != first.stride) {
                return Err(SparseError::BadArgument {
                    op: "concat",
                    message: format!("part {i} has stride {}, part 0 has {}", p.stride, first.stride),
                });
            }
            keys.extend(p.keys.iter().cloned());
            values.extend_from_slice(&p.values);
            if let (Some(out), Some(w)) = (weights.as_mut(), &p.weights) {
                out.extend_from_slice(w);
            }
            lengths.extend_from_slice(&p.lengths);
            if let Some(s) = &p.stride_per_key_per_rank {
                spkr.extend(s.iter().cloned());
            }
        }
        if vbe {
            let inv = parts.iter().map(|p| p.inverse_indices.as_ref()).collect::<Option<Vec<_>>>().map(|invs| {
                InverseIndices {
                    keys: keys.clone(),
                    indices: invs.iter().flat_map(|i| i.indices.iter().cloned()).collect(),
                }
            });
            Self::new_vbe(keys, values, weights, lengths, spkr, inv)
        } else {
            Self::new(keys, values, weights, lengths, first.stride)
        }
    }

    /// One [`JaggedTensor`] per key, in key order.
    pub fn to_dict(&self) -> Vec<(String, JaggedTensor<i64>)> {
        (0..self.keys.len())
            .map(|k| {
                let f = self.feature(k);
                let jt = JaggedTensor::new(f.values.to_vec(), f.weights.map(<[f32]>::to_vec), f.lengths.to_vec())
                    .expect("a valid KJT's slices are consistent");
                (self.keys[k].clone(), jt)
            })
            .collect()
    }

    /// The KJT restricted to `names`, in that order.
    pub fn select_keys(&self, names: &[&str]) -> Result<Self, SparseError> {
        let picked = names
            .iter()
            .map(|n| self.key_index(n).ok_or_else(|| unknown_key(n, &self.keys)))
            .collect::<Result<Vec<_>, _>>()?;
        self.permute(&picked)
    }

    /// The variable-batch form of this KJT (TorchRec's dedup before the input dist): per key,
    /// its distinct bags (same ids and weights) in order of first appearance, and
    /// `inverse_indices` mapping every sample to its bag. `expand_vbe` gives the KJT back.
    pub fn dedup(&self) -> Result<Self, SparseError> {
        if self.variable_stride_per_key() {
            return Err(inconsistent(KJT, "dedup of a KJT that is already variable-batch"));
        }
        let (mut values, mut weights, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
        let (mut strides, mut indices) = (Vec::with_capacity(self.keys.len()), Vec::with_capacity(self.keys.len()));
        for k in 0..self.keys.len() {
            let f = self.feature(k);
            let mut seen: std::collections::HashMap<(&[i64], Vec<u32>), usize> = std::collections::HashMap::new();
            let mut idx = Vec::with_capacity(self.stride);
            for b in 0..f.num_bags() {
                let w: Vec<u32> = f.bag_weights(b).map(|w| w.iter().map(|x| x.to_bits()).collect()).unwrap_or_default();
                let next = seen.len();
                let bag = *seen.entry((f.bag(b), w)).or_insert(next);
                if bag == next {
                    values.extend_from_slice(f.bag(b));
                    if let Some(w) = f.bag_weights(b) {
                        weights.extend_from_slice(w);
                    }
                    lengths.push(f.bag(b).len() as u32);
                }
                idx.push(bag);
            }
            strides.push(vec![seen.len()]);
            indices.push(idx);
        }
        let inverse = InverseIndices { keys: self.keys.clone(), indices };
        Self::new_vbe(
            self.keys.clone(),
            values,
            self.weights.as_ref().map(|_| weights),
            lengths,
            strides,
            Some(inverse),
        )
    }

    /// The full-batch form of a variable-batch KJT with `inverse_indices`: sample `i` of key
    /// `k` gets a copy of bag `inverse_indices[k][i]`. A KJT that is not variable-batch is
    /// returned as is.
    pub fn expand_vbe(&self) -> Result<Self, SparseError> {
        if !self.variable_stride_per_key() {
            return Ok(self.clone());
        }
        let inv = self
            .inverse_indices
            .as_ref()
            .ok_or_else(|| inconsistent(KJT, "a variable-batch KJT needs inverse_indices to expand"))?;
        let batch = inv.indices.first().map_or(0, Vec::len);
        let (mut values, mut weights, mut lengths) =
            (Vec::new(), Vec::new(), Vec::with_capacity(batch * self.keys.len()));
        for (k, idx) in inv.indices.iter().enumerate() {
            let f = self.feature(k);
            for &bag in idx {
                values.extend_from_slice(f.bag(bag));
                if let Some(w) = f.bag_weights(bag) {
                    weights.extend_from_slice(w);
                }
                lengths.push(f.bag(bag).len() as u32);
            }
        }
        Self::new(self.keys.clone(), values, self.weights.as_ref().map(|_| weights), lengths, batch)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn without_value_drops_the_value_and_its_weight_in_the_chosen_keys() {
        // a: bags [5, -1], [-1]; b: [-1, 7], [] (b not chosen: kept).
        let kjt = KeyedJaggedTensor::new(
            vec!["a".into(), "b".into()],
            vec![5, -1, -1, -1, 7],
            Some(vec![0.5, 1.0, 2.0, 3.0, 4.0]),
            vec![2, 1, 2, 0],
            2,
        )
        .unwrap();
        let kept = kjt.without_value(|k| k == 0, -1).unwrap().expect("ids dropped");
        assert_eq!(kept.values(), [5, -1, 7]);
        assert_eq!(kept.weights().unwrap(), [0.5, 3.0, 4.0]);
        assert_eq!(kept.lengths(), [1, 0, 2, 0]);
        assert!(kjt.without_value(|k| k == 0, 9).unwrap().is_none());
    }
    use super::*;

    #[test]
    fn dedup_keeps_distinct_bags_and_expands_back() {
        let k = KeyedJaggedTensor::new(
            keys(&["a", "b"]),
            vec![1, 2, 1, 2, 3, 7, 7, 7],
            Some(vec![1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 2.0]),
            // a: [1 2] [1 2] [3] [];  b: [7] [7] [] [7] (the last with another weight)
            vec![2, 2, 1, 0, 1, 1, 0, 1],
            4,
        )
        .unwrap();
        let d = k.dedup().unwrap();
        assert!(d.variable_stride_per_key());
        assert_eq!(d.stride_per_key(), vec![3, 3]);
        assert_eq!(d.inverse_indices().unwrap().indices, vec![vec![0, 0, 1, 2], vec![0, 0, 1, 2]]);
        assert_eq!(d.values(), &[1, 2, 3, 7, 7]);
        assert_eq!(d.expand_vbe().unwrap(), k);
        assert!(d.dedup().is_err());
        let plain = KeyedJaggedTensor::new(keys(&["a"]), vec![4], None, vec![1], 1).unwrap();
        assert_eq!(plain.expand_vbe().unwrap(), plain);
    }

    fn keys(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn values_per_key_mut_gives_each_keys_ids() {
        let mut k =
            KeyedJaggedTensor::new(keys(&["a", "b", "c"]), vec![1, 2, 3, 4, 5], None, vec![2, 0, 0, 0, 1, 2], 2)
                .unwrap();
        let mut per = k.values_per_key_mut();
        assert_eq!(per.len(), 3);
        assert_eq!((&*per[0], &*per[1], &*per[2]), (&[1, 2][..], &[][..], &[3, 4, 5][..]));
        per[2][0] = 30;
        per[0][1] = 20;
        assert_eq!(k.values(), &[1, 20, 30, 4, 5]);
        assert_eq!(k.feature(2).bag(1), &[4, 5]);
    }

    /// keys a, b; stride 2: a = [[1,2],[3]], b = [[],[4,5,6]]
    fn sample(weighted: bool) -> KeyedJaggedTensor {
        let w = weighted.then(|| vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
        KeyedJaggedTensor::new(keys(&["a", "b"]), vec![1, 2, 3, 4, 5, 6], w, vec![2, 1, 0, 3], 2).unwrap()
    }

    #[test]
    fn accessors() {
        let kjt = sample(true);
        assert_eq!(kjt.offsets(), &[0, 2, 3, 3, 6]);
        assert_eq!(kjt.length_per_key(), vec![3, 3]);
        assert_eq!(kjt.offset_per_key(), vec![0, 3, 6]);
        let b = kjt.feature(1);
        assert_eq!(b.bag(0), &[] as &[i64]);
        assert_eq!(b.bag(1), &[4, 5, 6]);
        assert_eq!(b.bag_weights(1), Some(&[0.4f32, 0.5, 0.6][..]));
        assert_eq!(kjt.feature(0).bag(0), &[1, 2]);
        assert_eq!(kjt.key_index("b"), Some(1));
    }

    #[test]
    fn rejects_inconsistent_inputs() {
        let err = |r: Result<KeyedJaggedTensor, SparseError>| r.unwrap_err().to_string();
        assert!(err(KeyedJaggedTensor::new(keys(&["a", "b"]), vec![1], None, vec![1, 0, 0], 2)).contains("3 lengths"));
        assert!(err(KeyedJaggedTensor::new(keys(&["a"]), vec![1], None, vec![1, 1], 2)).contains("sum to 2"));
        assert!(err(KeyedJaggedTensor::new(keys(&["a", "a"]), vec![], None, vec![0, 0], 1)).contains("twice"));
        assert!(err(KeyedJaggedTensor::new(keys(&["a"]), vec![1], Some(vec![]), vec![1], 1)).contains("weights"));
        let inv = InverseIndices { keys: keys(&["a"]), indices: vec![vec![0, 2]] };
        assert!(
            err(KeyedJaggedTensor::new_vbe(keys(&["a"]), vec![1, 2], None, vec![1, 1], vec![vec![1, 1]], Some(inv)))
                .contains("out of range")
        );
    }

    #[test]
    fn full_batch_expands_only_variable_batches() {
        let plain = sample(false);
        assert_eq!(plain.examples(), 2);
        assert!(matches!(plain.full_batch().unwrap(), std::borrow::Cow::Borrowed(_)));
        // Key a: bags [1] and [2] for 3 examples (example 1 repeats bag 0, example 2 reads bag 1).
        let inv = InverseIndices { keys: keys(&["a"]), indices: vec![vec![0, 0, 1]] };
        let vbe =
            KeyedJaggedTensor::new_vbe(keys(&["a"]), vec![1, 2], None, vec![1, 1], vec![vec![2]], Some(inv)).unwrap();
        assert_eq!(vbe.examples(), 3);
        let full = vbe.full_batch().unwrap();
        assert!(matches!(full, std::borrow::Cow::Owned(_)));
        assert_eq!((full.values(), full.lengths(), full.examples()), (&[1, 1, 2][..], &[1, 1, 1][..], 3));
    }

    #[test]
    fn permute_split_concat_to_dict() {
        let kjt = sample(true);
        let p = kjt.permute(&[1, 0]).unwrap();
        assert_eq!(p.keys(), &keys(&["b", "a"])[..]);
        assert_eq!(p.values(), &[4, 5, 6, 1, 2, 3]);
        assert_eq!(p.lengths(), &[0, 3, 2, 1]);
        assert_eq!(p.weights().unwrap(), &[0.4, 0.5, 0.6, 0.1, 0.2, 0.3]);
        let parts = kjt.split(&[1, 1]).unwrap();
        assert_eq!(parts[1].values(), &[4, 5, 6]);
        assert_eq!(KeyedJaggedTensor::concat(&parts).unwrap(), kjt);
        assert!(kjt.split(&[1]).is_err());
        assert!(kjt.permute(&[0, 0]).is_err());
        let d = kjt.to_dict();
        assert_eq!(d[0].0, "a");
        assert_eq!(d[0].1.to_dense(), vec![vec![1, 2], vec![3]]);
        assert_eq!(d[1].1.to_dense(), vec![vec![], vec![4, 5, 6]]);
        let e = kjt.select_keys(&["bb"]).unwrap_err().to_string();
        assert!(e.contains("did you mean \"b\""), "{e}");
        assert!(KeyedJaggedTensor::concat(&[sample(true), sample(false)]).is_err());
    }

    #[test]
    fn vbe_permute_keeps_strides_and_inverse_indices() {
        // a has 1 bag (rank strides [1, 0]), b has 3 bags ([2, 1]); full batch of 3 samples.
        let inv = InverseIndices { keys: keys(&["a", "b"]), indices: vec![vec![0, 0, 0], vec![0, 1, 2]] };
        let kjt = KeyedJaggedTensor::new_vbe(
            keys(&["a", "b"]),
            vec![7, 8, 9],
            None,
            vec![1, 1, 0, 1],
            vec![vec![1, 0], vec![2, 1]],
            Some(inv),
        )
        .unwrap();
        assert!(kjt.variable_stride_per_key());
        assert_eq!(kjt.stride_per_key(), vec![1, 3]);
        assert_eq!(kjt.feature(1).bag(2), &[9]);
        let p = kjt.permute(&[1, 0]).unwrap();
        assert_eq!(p.stride_per_key_per_rank().unwrap(), &[vec![2, 1], vec![1, 0]]);
        assert_eq!(p.inverse_indices().unwrap().indices, vec![vec![0, 1, 2], vec![0, 0, 0]]);
        assert_eq!(p.values(), &[8, 9, 7]);
        assert_eq!(KeyedJaggedTensor::concat(&p.split(&[1, 1]).unwrap()).unwrap(), p);
    }
}
