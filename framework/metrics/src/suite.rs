//! Several metrics fed the same batches, and their reports (console table, JSONL line).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Metric, MetricError, MetricState, validate_batch};

pub use trainrec_types::Split;

/// Metric values at one step of one split: one line of `metrics.jsonl`.
///
/// Serialises as `{"step":100,"split":"eval","metrics":{"auc":0.74,"ne":0.91}}` (metrics
/// sorted by name). A non-finite value (NE before any sample, for instance) is written as
/// `null`, since JSON has no NaN, and read back as NaN.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricReport {
    /// Training step.
    pub step: u64,
    /// The split.
    pub split: Split,
    /// Values by name.
    #[serde(serialize_with = "metrics_as_map", deserialize_with = "metrics_from_map")]
    pub metrics: BTreeMap<String, f64>,
}

impl MetricReport {
    /// The value reported under `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.metrics.get(name).copied()
    }

    /// One JSON line (no trailing newline) for `metrics.jsonl`.
    pub fn to_jsonl(&self) -> Result<String, MetricError> {
        Ok(serde_json::to_string(self)?)
    }

    /// An aligned console table titled `<split> @ step <step>` (see [`render_table`]).
    pub fn to_table(&self) -> String {
        render_table(&format!("{} @ step {}", self.split, self.step), &self.metrics)
    }
}

impl fmt::Display for MetricReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_table())
    }
}

/// An aligned two-column table of metric values: the title, a `metric  value` header, a
/// rule, then one row per metric with names left-aligned and values right-aligned to six
/// decimals (`nan` for a NaN). Every line ends with a newline.
pub fn render_table(title: &str, metrics: &BTreeMap<String, f64>) -> String {
    let values: Vec<String> = metrics.values().map(|&v| format_value(v)).collect();
    let name_width = metrics.keys().map(String::len).chain(["metric".len()]).max().unwrap_or(0);
    let value_width = values.iter().map(String::len).chain(["value".len()]).max().unwrap_or(0);
    let mut out = format!("{title}\n");
    out.push_str(&format!("  {:<name_width$}  {:>value_width$}\n", "metric", "value"));
    out.push_str(&format!("  {}  {}\n", "-".repeat(name_width), "-".repeat(value_width)));
    for (name, value) in metrics.keys().zip(&values) {
        out.push_str(&format!("  {name:<name_width$}  {value:>value_width$}\n"));
    }
    out
}

fn format_value(v: f64) -> String {
    if v.is_nan() { "nan".to_owned() } else { format!("{v:.6}") }
}

fn metrics_as_map<S: Serializer>(metrics: &BTreeMap<String, f64>, s: S) -> Result<S::Ok, S::Error> {
    let mut map = s.serialize_map(Some(metrics.len()))?;
    for (name, value) in metrics {
        map.serialize_entry(name, &value.is_finite().then_some(*value))?;
    }
    map.end()
}

fn metrics_from_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
    struct NullableValues;
    impl<'de> Visitor<'de> for NullableValues {
        type Value = BTreeMap<String, f64>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map from metric name to a number or null")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((name, value)) = access.next_entry::<String, Option<f64>>()? {
                out.insert(name, value.unwrap_or(f64::NAN));
            }
            Ok(out)
        }
    }
    d.deserialize_map(NullableValues)
}

/// Metrics fed the same batches.
#[derive(Default)]
pub struct MetricSuite {
    metrics: Vec<Box<dyn Metric>>,
}

impl fmt::Debug for MetricSuite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricSuite").field("output_names", &self.output_names()).finish()
    }
}

impl MetricSuite {
    /// A suite of `metrics`; every reported name must be unique across them.
    pub fn new(metrics: Vec<Box<dyn Metric>>) -> Result<Self, MetricError> {
        let mut suite = Self::default();
        for m in metrics {
            suite.push(m)?;
        }
        Ok(suite)
    }

    /// Adds a metric; fails (leaving the suite unchanged) when one of its names is taken.
    pub fn push(&mut self, metric: Box<dyn Metric>) -> Result<(), MetricError> {
        let taken = self.output_names();
        let names = metric.output_names();
        for (i, name) in names.iter().enumerate() {
            if taken.contains(name) || names[..i].contains(name) {
                return Err(MetricError::DuplicateName { name: name.clone() });
            }
        }
        self.metrics.push(metric);
        Ok(())
    }

    /// The number of metrics.
    pub fn len(&self) -> usize {
        self.metrics.len()
    }

    /// Whether the suite holds no metric.
    pub fn is_empty(&self) -> bool {
        self.metrics.is_empty()
    }

    /// Every name the suite reports, in the order the metrics were added.
    pub fn output_names(&self) -> Vec<String> {
        self.metrics.iter().flat_map(|m| m.output_names()).collect()
    }

    /// Feeds one batch to every metric (all or none: the batch is checked first).
    pub fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        self.update_batch(&crate::TaskBatch::new(predictions, labels, weights))
    }

    /// Feeds one batch with its grouping keys to every metric (all or none: the batch and,
    /// when a metric needs them, its grouping keys are checked first). Labels must lie in
    /// `[0, 1]`, as for [`MetricSuite::update`], even for NDCG.
    pub fn update_batch(&mut self, batch: &crate::TaskBatch<'_>) -> Result<(), MetricError> {
        validate_batch(batch.predictions, batch.labels, batch.weights)?;
        if self.metrics.iter().any(|m| m.needs_groups()) {
            crate::check_groups("grouped metrics", batch)?;
        }
        for m in &mut self.metrics {
            m.update_batch(batch)?;
        }
        Ok(())
    }

    /// Every metric's values, in the order the metrics were added.
    pub fn compute(&self) -> Vec<(String, f64)> {
        self.metrics.iter().flat_map(|m| m.compute()).collect()
    }

    /// Every metric's values as a report for `step` on `split`.
    pub fn report(&self, step: u64, split: Split) -> MetricReport {
        MetricReport { step, split, metrics: self.compute().into_iter().collect() }
    }

    /// Resets every metric.
    pub fn reset(&mut self) {
        self.metrics.iter_mut().for_each(|m| m.reset());
    }

    /// Every metric's state ([`Metric::state`]), in the order the metrics were added; `None`
    /// when a metric cannot save its state.
    pub fn state(&self) -> Option<Vec<MetricState>> {
        self.metrics.iter().map(|m| m.state()).collect()
    }

    /// Loads `states[i]` into metric `i` ([`Metric::load_state`]), all or nothing: when one
    /// does not fit, the metrics loaded before it get their previous state back and the error
    /// is returned.
    pub fn load_state(&mut self, states: &[MetricState]) -> Result<(), MetricError> {
        if states.len() != self.metrics.len() {
            return Err(MetricError::StateCount { expected: self.metrics.len(), got: states.len() });
        }
        // Keep the current states to roll back to (and fail early on a metric without one).
        let mut previous = Vec::with_capacity(self.metrics.len());
        for m in &self.metrics {
            match m.state() {
                Some(current) => previous.push(current),
                None => return Err(MetricError::StateUnsupported { metric: m.output_names().join(",") }),
            }
        }
        for (i, state) in states.iter().enumerate() {
            if let Err(e) = self.metrics[i].load_state(state) {
                let e = e.in_metric(&self.metrics[i].output_names().join(","));
                for (m, p) in self.metrics[..i].iter_mut().zip(&previous) {
                    if let Err(rollback) = m.load_state(p) {
                        // Only a metric that rejects the state it saved itself gets here.
                        return Err(MetricError::BadState {
                            metric: m.output_names().join(","),
                            message: format!(
                                "undoing a failed load ({e}), the metric rejected its own saved state \
                                 ({rollback}); the suite is partly restored and should be reset"
                            ),
                        });
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AucMetric, NeMetric};

    fn suite() -> MetricSuite {
        MetricSuite::new(vec![Box::new(NeMetric::new(true)), Box::new(AucMetric::new())]).unwrap()
    }

    #[test]
    fn suite_feeds_every_metric() {
        let mut s = suite();
        assert_eq!(s.len(), 2);
        assert!(!s.is_empty());
        assert_eq!(s.output_names(), ["ne", "logloss", "auc"]);
        let (p, y) = ([0.9, 0.8, 0.7, 0.6], [1.0, 0.0, 1.0, 0.0]);
        s.update(&p, &y, None).unwrap();
        let mut ne = NeMetric::new(true);
        ne.update(&p, &y, None).unwrap();
        let r = s.report(100, Split::Eval);
        assert_eq!(r.get("ne"), Some(ne.ne()));
        assert_eq!(r.get("logloss"), Some(ne.logloss()));
        assert_eq!(r.get("auc"), Some(0.75));
        assert_eq!(r.get("missing"), None);
        assert_eq!(s.compute().iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["ne", "logloss", "auc"]);
        s.reset();
        assert!(s.report(0, Split::Eval).metrics["ne"].is_nan());
        assert_eq!(s.report(0, Split::Eval).metrics["auc"], 0.5);
    }

    #[test]
    fn bad_batch_changes_nothing() {
        let mut s = suite();
        s.update(&[0.9, 0.1], &[1.0, 0.0], None).unwrap();
        let before = s.compute();
        assert!(s.update(&[0.5, 0.5], &[1.0], None).is_err());
        assert!(s.update(&[0.5, 0.5], &[1.0, 0.0], Some(&[1.0, -1.0])).is_err());
        assert_eq!(s.compute(), before);
    }

    #[test]
    fn duplicate_names_are_rejected() {
        assert!(matches!(
            MetricSuite::new(vec![Box::new(AucMetric::new()), Box::new(AucMetric::new())]),
            Err(MetricError::DuplicateName { ref name }) if name == "auc"
        ));
        let mut s = suite();
        let err = s.push(Box::new(NeMetric::new(false))).unwrap_err();
        assert!(matches!(err, MetricError::DuplicateName { ref name } if name == "ne"));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn jsonl_shape_and_round_trip() {
        let report = MetricReport {
            step: 7,
            split: Split::Eval,
            metrics: [("ne".to_owned(), 0.5), ("auc".to_owned(), 0.75), ("logloss".to_owned(), f64::NAN)]
                .into_iter()
                .collect(),
        };
        let line = report.to_jsonl().unwrap();
        assert_eq!(line, r#"{"step":7,"split":"eval","metrics":{"auc":0.75,"logloss":null,"ne":0.5}}"#);
        let back: MetricReport = serde_json::from_str(&line).unwrap();
        assert_eq!((back.step, back.split), (7, Split::Eval));
        assert_eq!((back.get("ne"), back.get("auc")), (Some(0.5), Some(0.75)));
        assert!(back.get("logloss").unwrap().is_nan());
        assert!(serde_json::from_str::<MetricReport>(r#"{"step":1,"split":"dev","metrics":{}}"#).is_err());
        assert!(serde_json::from_str::<MetricReport>(r#"{"step":1,"split":"eval","metrics":{},"x":1}"#).is_err());
    }

    #[test]
    fn table_is_aligned() {
        let report = MetricReport {
            step: 12,
            split: Split::Train,
            metrics: [("ne".to_owned(), 0.912345678), ("logloss".to_owned(), 12.5), ("auc".to_owned(), f64::NAN)]
                .into_iter()
                .collect(),
        };
        let expected = "\
train @ step 12
  metric       value
  -------  ---------
  auc            nan
  logloss  12.500000
  ne        0.912346
";
        assert_eq!(report.to_table(), expected);
        assert_eq!(report.to_string(), expected);
        assert_eq!(render_table("eval", &BTreeMap::new()), "eval\n  metric  value\n  ------  -----\n");
    }

    /// A plugin metric that does not implement `state`.
    struct Stateless;

    impl Metric for Stateless {
        fn output_names(&self) -> Vec<String> {
            vec!["plain".into()]
        }
        fn update(&mut self, _: &[f32], _: &[f32], _: Option<&[f32]>) -> Result<(), MetricError> {
            Ok(())
        }
        fn compute(&self) -> Vec<(String, f64)> {
            vec![("plain".into(), 1.0)]
        }
        fn reset(&mut self) {}
    }

    fn resumable() -> MetricSuite {
        use crate::{SessionMetric, SessionMetricKind, SumMetric, SumMetricKind};
        let recall = SessionMetricKind::RecallSession { top_threshold: 2, run_ranking_of_labels: false };
        MetricSuite::new(vec![
            Box::new(NeMetric::new(true)),
            Box::new(AucMetric::with_window(29).unwrap().grouped()),
            Box::new(SumMetric::new(SumMetricKind::Ctr, 33).unwrap()),
            Box::new(SessionMetric::new(recall, 50).unwrap()),
        ])
        .unwrap()
    }

    #[test]
    fn suite_resumes_exactly() {
        let data = crate::resume::batches(31, 30, false);
        let mut a = resumable();
        for b in &data[..6] {
            a.update_batch(&b.batch()).unwrap();
        }
        let states = a.state().unwrap();
        assert_eq!(states.len(), 4);
        let mut b = resumable();
        b.load_state(&states).unwrap();
        for batch in &data[6..] {
            a.update_batch(&batch.batch()).unwrap();
            b.update_batch(&batch.batch()).unwrap();
            let bits = |s: &MetricSuite| s.compute().into_iter().map(|(n, v)| (n, v.to_bits())).collect::<Vec<_>>();
            assert_eq!(bits(&b), bits(&a));
        }
        assert_eq!(b.state(), a.state());
    }

    #[test]
    fn suite_load_is_all_or_nothing() {
        let data = crate::resume::batches(8, 10, false);
        let mut a = resumable();
        for b in &data[..5] {
            a.update_batch(&b.batch()).unwrap();
        }
        let mut b = resumable();
        for batch in &data[5..] {
            b.update_batch(&batch.batch()).unwrap();
        }
        let before = b.state().unwrap();
        let mut states = a.state().unwrap();
        let e = b.load_state(&states[..3]).unwrap_err();
        assert!(matches!(e, MetricError::StateCount { expected: 4, got: 3 }), "{e}");
        assert_eq!(e.to_string(), "the checkpoint holds 3 metric states but the suite has 4 metrics");
        // The third state is damaged: the first two, already loaded, are rolled back.
        states[2].arrays[0].1.clear();
        let e = b.load_state(&states).unwrap_err().to_string();
        assert!(e.starts_with(r#"cannot restore the state of metric "lifetime_ctr,window_ctr": "#), "{e}");
        assert_eq!(b.state().unwrap(), before);
        // Swapped states are another metric's.
        let mut swapped = a.state().unwrap();
        swapped.swap(0, 2);
        assert!(b.load_state(&swapped).is_err());
        assert_eq!(b.state().unwrap(), before);
    }

    #[test]
    fn metric_without_state_makes_the_suite_unresumable() {
        let mut s = MetricSuite::new(vec![Box::new(NeMetric::new(false)), Box::new(Stateless)]).unwrap();
        assert!(Stateless.state().is_none());
        let e = Stateless.load_state(&MetricState::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "metric \"plain\" cannot save or restore its state (it does not implement Metric::state and \
             Metric::load_state), so a checkpoint cannot resume it exactly"
        );
        assert!(s.state().is_none());
        let states = vec![NeMetric::new(false).state().unwrap(), MetricState::default()];
        assert!(
            matches!(s.load_state(&states), Err(MetricError::StateUnsupported { ref metric }) if metric == "plain")
        );
    }
}
