//! The saved state of one metric, for checkpoints.

use serde::{Deserialize, Serialize};

use crate::MetricError;

/// Counts up to this value (2^53) are exact as `f64`.
const MAX_EXACT_COUNT: f64 = 9_007_199_254_740_992.0;

/// The accumulated state of one metric, as named arrays of `f64`: what a checkpoint holds to
/// resume the metric exactly (`Metric::state`, `Metric::load_state`).
///
/// Everything a metric keeps fits an `f64` without loss: its `f64` sums as they are, `f32`
/// samples (predictions, labels, weights) widened, and counters below 2^53 as integers. A
/// 64-bit key (a grouping id) is stored as two arrays of its 32-bit halves. The arrays are
/// finite for every built-in metric, so a JSON checkpoint (which has no NaN) can hold them.
///
/// The helpers ([`MetricState::get`], [`MetricState::counts`], [`MetricState::f32s`], ...)
/// check each array as it is read and name the array in their [`MetricError::BadState`]
/// errors; [`MetricError::in_metric`] then names the metric.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricState {
    /// The arrays, by name, in the order they were pushed.
    pub arrays: Vec<(String, Vec<f64>)>,
}

impl MetricError {
    /// A [`MetricError::BadState`] saying `message`, for the metric named later by
    /// [`MetricError::in_metric`].
    pub fn bad_state(message: impl Into<String>) -> Self {
        Self::BadState { metric: String::new(), message: message.into() }
    }

    /// Names `metric` in a [`MetricError::BadState`] that names none yet; other errors are
    /// returned as they are.
    pub fn in_metric(self, metric: &str) -> Self {
        match self {
            Self::BadState { metric: m, message } if m.is_empty() => {
                Self::BadState { metric: metric.to_owned(), message }
            }
            other => other,
        }
    }
}

impl MetricState {
    /// Appends the array `name`.
    pub fn push(&mut self, name: impl Into<String>, values: impl IntoIterator<Item = f64>) {
        self.arrays.push((name.into(), values.into_iter().collect()));
    }

    /// [`MetricState::push`] of counters (exact below 2^53).
    pub fn push_counts(&mut self, name: impl Into<String>, values: impl IntoIterator<Item = u64>) {
        self.push(name, values.into_iter().map(|v| v as f64));
    }

    /// The array `name` (the first one, should two have the name).
    pub fn get(&self, name: &str) -> Result<&[f64], MetricError> {
        match self.arrays.iter().find(|(n, _)| n == name) {
            Some((_, values)) => Ok(values),
            None => {
                let present: Vec<&str> = self.arrays.iter().map(|(n, _)| n.as_str()).collect();
                Err(MetricError::bad_state(format!("the state has no array {name:?} (it has {present:?})")))
            }
        }
    }

    /// The array `name`, which must hold `len` values.
    pub fn get_len(&self, name: &str, len: usize) -> Result<&[f64], MetricError> {
        let values = self.get(name)?;
        if values.len() != len {
            return Err(MetricError::bad_state(format!("array {name:?} has {} values, expected {len}", values.len())));
        }
        Ok(values)
    }

    /// The single value of the array `name`.
    pub fn scalar(&self, name: &str) -> Result<f64, MetricError> {
        Ok(self.get_len(name, 1)?[0])
    }

    /// Fails unless the array `name` equals `expected`: a configuration value saved with the
    /// state (a window size) that the loading metric must share.
    pub fn expect_array(&self, name: &str, expected: &[f64]) -> Result<(), MetricError> {
        let found = self.get(name)?;
        if found != expected {
            return Err(MetricError::bad_state(format!(
                "the state was saved with {name} = {found:?}, but this metric has {name} = {expected:?} \
                 (a state loads only into a metric of the same configuration)"
            )));
        }
        Ok(())
    }

    /// The array `name` as counters: each value must be an integer in `[0, 2^53]`.
    pub fn counts(&self, name: &str) -> Result<Vec<u64>, MetricError> {
        self.get(name)?
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                if v.fract() == 0.0 && (0.0..=MAX_EXACT_COUNT).contains(&v) {
                    Ok(v as u64)
                } else {
                    Err(MetricError::bad_state(format!("{name}[{i}] = {v} is not a count (an integer in [0, 2^53])")))
                }
            })
            .collect()
    }

    /// The single value of the array `name` as a boolean (0 or 1).
    pub fn flag(&self, name: &str) -> Result<bool, MetricError> {
        match self.scalar(name)? {
            0.0 => Ok(false),
            1.0 => Ok(true),
            v => Err(MetricError::bad_state(format!("{name} = {v} is not a flag (0 or 1)"))),
        }
    }

    /// The array `name` as `f32`: each value must be a finite `f32`, exactly.
    pub fn f32s(&self, name: &str) -> Result<Vec<f32>, MetricError> {
        self.get(name)?
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let x = v as f32;
                if x.is_finite() && f64::from(x) == v {
                    Ok(x)
                } else {
                    Err(MetricError::bad_state(format!("{name}[{i}] = {v} is not a finite f32")))
                }
            })
            .collect()
    }

    /// The array `name`, whose values must all be finite.
    pub fn finite(&self, name: &str) -> Result<&[f64], MetricError> {
        let values = self.get(name)?;
        if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(MetricError::bad_state(format!("{name}[{i}] = {v} is not finite")));
        }
        Ok(values)
    }
}

/// `state` with every array name prefixed by `kind.` (`ctr.lifetime`): a state then loads only
/// into a metric of its kind (see [`of_kind`]).
pub(crate) fn with_kind(kind: &str, mut state: MetricState) -> MetricState {
    for (name, _) in &mut state.arrays {
        *name = format!("{kind}.{name}");
    }
    state
}

/// The arrays of a state saved by [`with_kind`], without their prefix, after checking that they
/// are exactly `kind.<name>` for each of `names`.
pub(crate) fn of_kind(kind: &str, state: &MetricState, names: &[&str]) -> Result<MetricState, MetricError> {
    let expected = || names.iter().map(|n| format!("{kind}.{n}")).collect::<Vec<_>>();
    let mut out = MetricState::default();
    for (name, values) in &state.arrays {
        match name.strip_prefix(kind).and_then(|n| n.strip_prefix('.')) {
            Some(short) if names.contains(&short) => {
                if out.arrays.iter().any(|(n, _)| n == short) {
                    return Err(MetricError::bad_state(format!("the state has two arrays {name:?}")));
                }
                out.arrays.push((short.to_owned(), values.clone()));
            }
            _ => {
                return Err(MetricError::bad_state(format!(
                    "unexpected array {name:?} (the state of another metric?): this metric's state has the arrays {:?}",
                    expected()
                )));
            }
        }
    }
    if let Some(missing) = names.iter().find(|&&n| out.get(n).is_err()) {
        let present: Vec<&str> = state.arrays.iter().map(|(n, _)| n.as_str()).collect();
        return Err(MetricError::bad_state(format!(
            "the state has no array \"{kind}.{missing}\" (it has {present:?}; this metric's state has {:?})",
            expected()
        )));
    }
    Ok(out)
}

/// A size limit as saved in a state: no value for "unbounded" (`usize::MAX`).
pub(crate) fn limit_array(limit: usize) -> Vec<f64> {
    if limit == usize::MAX { Vec::new() } else { vec![limit as f64] }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_check_and_name_the_problem() {
        let mut s = MetricState::default();
        s.push("sums", [1.5, 2.0]);
        s.push_counts("n", [3, 0]);
        s.push("flag", [1.0]);
        s.push("bad", [0.5, f64::NAN, 1e300]);
        assert_eq!(s.get("sums").unwrap(), [1.5, 2.0]);
        assert_eq!(s.counts("n").unwrap(), [3, 0]);
        assert!(s.flag("flag").unwrap());
        assert_eq!(s.f32s("sums").unwrap(), [1.5f32, 2.0]);
        let e = s.get("missing").unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"cannot restore a metric state: the state has no array "missing" (it has ["sums", "n", "flag", "bad"])"#
        );
        assert_eq!(
            e.in_metric("ne,logloss").to_string(),
            r#"cannot restore the state of metric "ne,logloss": the state has no array "missing" (it has ["sums", "n", "flag", "bad"])"#
        );
        // A name is set once: the innermost metric is the one named.
        let named = MetricError::bad_state("x").in_metric("inner").in_metric("outer");
        assert!(matches!(named, MetricError::BadState { ref metric, .. } if metric == "inner"));
        assert!(matches!(MetricError::EmptyWindow.in_metric("m"), MetricError::EmptyWindow));
        assert!(s.get_len("sums", 3).unwrap_err().to_string().contains(r#"array "sums" has 2 values, expected 3"#));
        assert!(s.counts("sums").unwrap_err().to_string().contains("sums[0] = 1.5 is not a count"));
        assert!(s.flag("sums").is_err());
        assert!(s.f32s("bad").unwrap_err().to_string().contains("bad[1] = NaN"));
        assert!(s.finite("bad").unwrap_err().to_string().contains("bad[1] = NaN is not finite"));
        assert!(s.expect_array("sums", &[1.5, 2.0]).is_ok());
        assert!(s.expect_array("sums", &[1.5]).unwrap_err().to_string().contains("same configuration"));
        // 0.1 is not an f32 exactly.
        s.push("tenth", [0.1]);
        assert!(s.f32s("tenth").is_err());
    }

    #[test]
    fn kinds_tell_states_apart() {
        let mut s = MetricState::default();
        s.push("a", [1.0]);
        s.push("b", []);
        let saved = with_kind("ctr", s.clone());
        assert_eq!(saved.arrays[0].0, "ctr.a");
        assert_eq!(of_kind("ctr", &saved, &["b", "a"]).unwrap(), s);
        let e = of_kind("mae", &saved, &["a", "b"]).unwrap_err().to_string();
        assert!(e.contains(r#"unexpected array "ctr.a" (the state of another metric?)"#), "{e}");
        assert!(of_kind("ctr", &saved, &["a"]).unwrap_err().to_string().contains(r#"unexpected array "ctr.b""#));
        let e = of_kind("ctr", &saved, &["a", "b", "c"]).unwrap_err().to_string();
        assert!(e.contains(r#"no array "ctr.c""#), "{e}");
        let mut twice = saved.clone();
        twice.arrays.push(("ctr.a".into(), vec![]));
        assert!(of_kind("ctr", &twice, &["a", "b"]).unwrap_err().to_string().contains("two arrays"));
    }

    #[test]
    fn serde_round_trip() {
        let mut s = MetricState::default();
        s.push("x", [0.25, -3.0]);
        // The shortest decimal that reads back as the same f64 (serde_json's `float_roundtrip`).
        s.push("y", [f64::from(0.1f32), 1.0 / 3.0, 5e-324]);
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.starts_with(r#"{"arrays":[["x",[0.25,-3.0]],["y",["#), "{json}");
        assert_eq!(serde_json::from_str::<MetricState>(&json).unwrap(), s);
    }
}
