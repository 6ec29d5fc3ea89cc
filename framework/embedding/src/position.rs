//! Position-weighted features (TorchRec's `PositionWeightedModule`): each id gets the
//! learnable weight of its position in its bag, and the weighted bag is pooled by a
//! weighted EBC.

use std::collections::BTreeMap;

use trainrec_sparse::KeyedJaggedTensor;

use crate::EmbeddingError;

/// Learnable per-position weights for some features of a KJT, initialised to 1 (TorchRec's
/// `torch.ones(max_feature_length)`).
#[derive(Clone, Debug, PartialEq)]
pub struct PositionWeightedModule {
    weights: BTreeMap<String, Vec<f32>>,
}

impl PositionWeightedModule {
    /// One weight vector of `max_length` entries per feature.
    pub fn new(max_lengths: &[(&str, usize)]) -> Result<Self, EmbeddingError> {
        let mut weights = BTreeMap::new();
        for &(f, n) in max_lengths {
            if n == 0 {
                return Err(EmbeddingError::Config(format!("position weights of feature \"{f}\" need max_length > 0")));
            }
            if weights.insert(f.to_string(), vec![1.0; n]).is_some() {
                return Err(EmbeddingError::Config(format!("feature \"{f}\" has two position-weight entries")));
            }
        }
        Ok(Self { weights })
    }

    /// The position weights of `feature`.
    pub fn weights(&self, feature: &str) -> Option<&[f32]> {
        self.weights.get(feature).map(Vec::as_slice)
    }

    /// The position weights of `feature`, for the caller's optimizer.
    pub fn weights_mut(&mut self, feature: &str) -> Option<&mut [f32]> {
        self.weights.get_mut(feature).map(Vec::as_mut_slice)
    }

    /// `kjt` with per-id weights: `w[position in bag]` for configured features (times any
    /// weight the id already had), the existing weight (or 1) elsewhere. A bag longer than
    /// its feature's `max_length` is an error naming the feature and bag.
    pub fn apply(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedJaggedTensor, EmbeddingError> {
        let mut out = kjt.weights().map_or_else(|| vec![1.0; kjt.values().len()], <[f32]>::to_vec);
        let mut start = 0;
        for (k, key) in kjt.keys().iter().enumerate() {
            let f = kjt.feature(k);
            if let Some(pw) = self.weights.get(key) {
                for b in 0..f.num_bags() {
                    let (s, e) = (f.bag_start(b), f.bag_start(b + 1));
                    if e - s > pw.len() {
                        return Err(EmbeddingError::Shape(format!(
                            "feature \"{key}\", bag {b} has {} ids; its position weights cover {}",
                            e - s,
                            pw.len()
                        )));
                    }
                    for (p, w) in out[start + s..start + e].iter_mut().enumerate() {
                        *w *= pw[p];
                    }
                }
            }
            start += f.values.len();
        }
        KeyedJaggedTensor::new(
            kjt.keys().to_vec(),
            kjt.values().to_vec(),
            Some(out),
            kjt.lengths().to_vec(),
            kjt.stride(),
        )
        .map_err(|e| EmbeddingError::Shape(e.to_string()))
    }

    /// Gradients of the position weights from the gradients of the per-id weights
    /// (`per_id[feature]`, aligned with the feature's values, e.g. from
    /// [`crate::EmbeddingBagCollection::per_id_weight_grads`]): position `p` collects
    /// `grad(id) * original weight(id)` over ids at position `p`.
    pub fn grads(
        &self,
        kjt: &KeyedJaggedTensor,
        per_id: &BTreeMap<String, Vec<f32>>,
    ) -> Result<BTreeMap<String, Vec<f32>>, EmbeddingError> {
        let mut out = BTreeMap::new();
        for (key, pw) in &self.weights {
            let Some(k) = kjt.key_index(key) else { continue };
            let f = kjt.feature(k);
            let g = per_id.get(key).ok_or_else(|| EmbeddingError::Shape(format!("no id gradients for \"{key}\"")))?;
            if g.len() != f.values.len() {
                return Err(EmbeddingError::Shape(format!(
                    "feature \"{key}\": {} id gradients for {} ids",
                    g.len(),
                    f.values.len()
                )));
            }
            let mut acc = vec![0f32; pw.len()];
            for b in 0..f.num_bags() {
                let (s, e) = (f.bag_start(b), f.bag_start(b + 1));
                for (p, pos) in (s..e).enumerate() {
                    let orig = f.weights.map_or(1.0, |w| w[pos]);
                    acc[p.min(pw.len() - 1)] += g[pos] * orig;
                }
            }
            out.insert(key.clone(), acc);
        }
        Ok(out)
    }
}
