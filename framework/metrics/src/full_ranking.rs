//! Next-item metrics under full ranking: HR@K and NDCG@K of each user's target item ranked
//! against every item of the catalogue, the protocol of the sequential-recommendation
//! literature since Krichene & Rendle (2020) showed that ranking against a sample of
//! negatives misleads.
//!
//! A target's rank is the number of other items scoring at least as high as it
//! (score = dot product of the user's query embedding and the item's embedding), leaving out
//! the items a caller excludes for that user (those of the user's history, as RecBole's
//! full-sort evaluation masks them). Ties count against the target, so a model that scores
//! every item alike ranks every target last rather than first. With one relevant item,
//! HR@K = 1 when rank < K, and NDCG@K = 1 / log2(rank + 2) when rank < K (0 otherwise).
//!
//! Ranks are counted query by query over the items in place: memory stays at the inputs, never
//! a users × items score matrix.

use rayon::prelude::*;

use crate::{MetricError, MetricState};

const NAME: &str = "full_ranking";

/// The rank of each query's target among all items: for query `q` (row `q` of `queries`,
/// `[n, dim]`), the number of items `i != targets[q]` (rows of `items`, `[items, dim]`) not in
/// `exclude[q]` whose score `queries[q] · items[i]` is at least the target's.
pub fn target_ranks(
    queries: &[f32],
    items: &[f32],
    dim: usize,
    targets: &[i64],
    exclude: Option<&[Vec<i64>]>,
) -> Result<Vec<u64>, MetricError> {
    let bad = |message: String| MetricError::Option { metric: NAME, message };
    if dim == 0 || !queries.len().is_multiple_of(dim) || !items.len().is_multiple_of(dim) {
        return Err(bad(format!(
            "queries ({}) and items ({}) must be whole rows of dim {dim}",
            queries.len(),
            items.len()
        )));
    }
    let (n, n_items) = (queries.len() / dim, items.len() / dim);
    if targets.len() != n {
        return Err(bad(format!("{} targets for {n} queries", targets.len())));
    }
    if let Some(ex) = exclude
        && ex.len() != n
    {
        return Err(bad(format!("{} exclusion lists for {n} queries", ex.len())));
    }
    if let Some((q, &t)) = targets.iter().enumerate().find(|&(_, &t)| t < 0 || t as usize >= n_items) {
        return Err(bad(format!("target {t} of query {q} is outside the catalogue's {n_items} items")));
    }
    for (what, v) in [("queries", queries), ("items", items)] {
        if let Some(index) = v.iter().position(|x| !x.is_finite()) {
            return Err(MetricError::NonFinite { what, index, value: v[index] });
        }
    }
    let ranks = (0..n)
        .into_par_iter()
        .map(|q| {
            let query = &queries[q * dim..(q + 1) * dim];
            let target = targets[q] as usize;
            let threshold = dot(query, &items[target * dim..(target + 1) * dim]);
            let mut excluded: Vec<i64> = exclude.map(|e| e[q].clone()).unwrap_or_default();
            excluded.sort_unstable();
            let mut rank = 0u64;
            for (i, row) in items.chunks_exact(dim).enumerate() {
                if i != target && dot(query, row) >= threshold && excluded.binary_search(&(i as i64)).is_err() {
                    rank += 1;
                }
            }
            rank
        })
        .collect();
    Ok(ranks)
}

/// The dot product, summed in four lanes (the same order for every item, so a target's score
/// and an equal item's score compare equal).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, x), y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// HR@K and NDCG@K over every user fed so far (`hr@10`, `ndcg@10`, one pair per cut-off).
#[derive(Clone, Debug)]
pub struct FullRankingMetric {
    ks: Vec<usize>,
    hits: Vec<f64>,
    gains: Vec<f64>,
    users: u64,
}

impl FullRankingMetric {
    /// The metric at cut-offs `ks` (each at least 1).
    pub fn new(ks: &[usize]) -> Result<Self, MetricError> {
        if ks.is_empty() || ks.contains(&0) {
            return Err(MetricError::Option {
                metric: NAME,
                message: format!("cut-offs must be at least 1, and one at least (got {ks:?})"),
            });
        }
        Ok(Self { ks: ks.to_vec(), hits: vec![0.0; ks.len()], gains: vec![0.0; ks.len()], users: 0 })
    }

    /// Adds users whose targets ranked `ranks` (as [`target_ranks`] counts them).
    pub fn update_ranks(&mut self, ranks: &[u64]) {
        for &r in ranks {
            for (j, &k) in self.ks.iter().enumerate() {
                if (r as usize) < k {
                    self.hits[j] += 1.0;
                    self.gains[j] += 1.0 / ((r + 2) as f64).log2();
                }
            }
        }
        self.users += ranks.len() as u64;
    }

    /// Ranks a batch of users' targets over all items ([`target_ranks`]) and adds them.
    pub fn update(
        &mut self,
        queries: &[f32],
        items: &[f32],
        dim: usize,
        targets: &[i64],
        exclude: Option<&[Vec<i64>]>,
    ) -> Result<(), MetricError> {
        let ranks = target_ranks(queries, items, dim, targets, exclude)?;
        self.update_ranks(&ranks);
        Ok(())
    }

    /// `hr@K` and `ndcg@K` per cut-off, means over users (NaN before any user).
    pub fn compute(&self) -> Vec<(String, f64)> {
        let n = self.users as f64;
        let mut out = Vec::new();
        for (j, k) in self.ks.iter().enumerate() {
            out.push((format!("hr@{k}"), self.hits[j] / n));
            out.push((format!("ndcg@{k}"), self.gains[j] / n));
        }
        out
    }

    /// Users fed so far.
    pub fn users(&self) -> u64 {
        self.users
    }

    /// The accumulated sums, to restore into a metric with the same cut-offs.
    pub fn state(&self) -> MetricState {
        let mut s = MetricState::default();
        s.arrays.push(("hits".into(), self.hits.clone()));
        s.arrays.push(("gains".into(), self.gains.clone()));
        s.arrays.push(("users".into(), vec![self.users as f64]));
        s
    }

    /// Restores [`Self::state`].
    pub fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        let get = |name: &str, len: usize| -> Result<Vec<f64>, MetricError> {
            let v = state.arrays.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
            v.filter(|v| v.len() == len)
                .ok_or_else(|| MetricError::bad_state(format!("no {name} array of {len} values")).in_metric(NAME))
        };
        let (hits, gains, users) = (get("hits", self.ks.len())?, get("gains", self.ks.len())?, get("users", 1)?);
        (self.hits, self.gains, self.users) = (hits, gains, users[0] as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The float64 reference: every item's score, the target's rank by the definition.
    fn reference(queries: &[f32], items: &[f32], dim: usize, targets: &[i64], exclude: &[Vec<i64>]) -> Vec<u64> {
        let score = |q: usize, i: usize| -> f64 {
            (0..dim).map(|d| f64::from(queries[q * dim + d]) * f64::from(items[i * dim + d])).sum()
        };
        (0..targets.len())
            .map(|q| {
                let t = targets[q] as usize;
                (0..items.len() / dim)
                    .filter(|&i| i != t && !exclude[q].contains(&(i as i64)) && score(q, i) >= score(q, t))
                    .count() as u64
            })
            .collect()
    }

    #[test]
    fn ranks_match_the_float64_definition() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (n, n_items, dim) in [(1, 1, 1), (17, 300, 8), (40, 1000, 13)] {
            let queries: Vec<f32> = (0..n * dim).map(|_| rng.random_range(-1.0..1.0)).collect();
            let items: Vec<f32> = (0..n_items * dim).map(|_| rng.random_range(-1.0..1.0)).collect();
            let targets: Vec<i64> = (0..n).map(|_| rng.random_range(0..n_items as i64)).collect();
            let exclude: Vec<Vec<i64>> = (0..n)
                .map(|_| (0..rng.random_range(0..5)).map(|_| rng.random_range(0..n_items as i64)).collect())
                .collect();
            let got = target_ranks(&queries, &items, dim, &targets, Some(&exclude)).unwrap();
            // Scores of distinct random rows are far apart next to f32 rounding.
            assert_eq!(got, reference(&queries, &items, dim, &targets, &exclude), "{n} x {n_items} x {dim}");
        }
    }

    #[test]
    fn hit_rate_and_ndcg_by_hand() {
        // Items on a line: scores of query [1] are the items' values.
        let items = [0.5f32, 3.0, 2.0, 1.0];
        // Target 2 (score 2): only item 1 (3.0) is higher, rank 1. Target 1: rank 0.
        // Target 0 (0.5) with item 1 excluded: items 2 and 3 are higher, rank 2.
        let ranks = target_ranks(&[1.0, 1.0, 1.0], &items, 1, &[2, 1, 0], Some(&[vec![], vec![], vec![1]])).unwrap();
        assert_eq!(ranks, [1, 0, 2]);
        let mut m = FullRankingMetric::new(&[1, 2]).unwrap();
        m.update_ranks(&ranks);
        let v: std::collections::BTreeMap<_, _> = m.compute().into_iter().collect();
        assert_eq!(v["hr@1"], 1.0 / 3.0);
        assert_eq!(v["hr@2"], 2.0 / 3.0);
        assert!((v["ndcg@1"] - 1.0 / 3.0).abs() < 1e-15);
        assert!((v["ndcg@2"] - (1.0 + 1.0 / 3f64.log2()) / 3.0).abs() < 1e-15);
    }

    #[test]
    fn ties_count_against_the_target() {
        // A model that scores every item alike ranks each target last.
        let ranks = target_ranks(&[0.0, 0.0], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, &[0], None).unwrap();
        assert_eq!(ranks, [2]);
    }

    #[test]
    fn state_round_trips_and_bad_inputs_are_named() {
        let mut m = FullRankingMetric::new(&[10]).unwrap();
        m.update_ranks(&[0, 3, 50]);
        let mut r = FullRankingMetric::new(&[10]).unwrap();
        r.load_state(&m.state()).unwrap();
        assert_eq!(r.compute(), m.compute());
        assert!(FullRankingMetric::new(&[]).is_err() && FullRankingMetric::new(&[5, 0]).is_err());
        let e = target_ranks(&[1.0], &[1.0, 2.0], 1, &[2], None).unwrap_err().to_string();
        assert!(e.contains("target 2 of query 0") && e.contains("2 items"), "{e}");
        let e = target_ranks(&[f32::NAN], &[1.0], 1, &[0], None).unwrap_err();
        assert!(matches!(e, MetricError::NonFinite { what: "queries", index: 0, .. }), "{e}");
        assert!(target_ranks(&[1.0, 2.0], &[1.0, 2.0, 3.0], 2, &[0], None).is_err());
    }
}
