//! Several metrics fed the same batches, and their reports.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{Metric, MetricError};

/// Which split a report is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Training batches.
    Train,
    /// The eval split.
    Eval,
}

/// Metric values at one step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MetricReport {
    /// Training step.
    pub step: u64,
    /// The split.
    pub split: Split,
    /// Values by name.
    pub metrics: BTreeMap<String, f64>,
}

impl MetricReport {
    /// One JSON line (no trailing newline).
    pub fn to_jsonl(&self) -> Result<String, MetricError> {
        Ok(serde_json::to_string(self)?)
    }

    /// An aligned console table.
    pub fn to_table(&self) -> String {
        let title = match self.split {
            Split::Train => "train",
            Split::Eval => "eval",
        };
        render_table(&format!("{title} @ step {}", self.step), &self.metrics)
    }
}

/// An aligned two-column table of metric values.
pub fn render_table(title: &str, metrics: &BTreeMap<String, f64>) -> String {
    let width = metrics.keys().map(String::len).max().unwrap_or(0).max(6);
    let mut out = format!("{title}\n{}\n", "-".repeat(width + 12));
    for (k, v) in metrics {
        out.push_str(&format!("{k:<width$}  {v:>10.6}\n"));
    }
    out
}

/// Metrics fed the same batches.
#[derive(Default)]
pub struct MetricSuite {
    metrics: Vec<Box<dyn Metric>>,
}

impl MetricSuite {
    /// A suite of `metrics`; reported names must be unique.
    pub fn new(metrics: Vec<Box<dyn Metric>>) -> Result<Self, MetricError> {
        let mut seen = std::collections::HashSet::new();
        for name in metrics.iter().flat_map(|m| m.output_names()) {
            if !seen.insert(name.clone()) {
                return Err(MetricError::DuplicateName { name });
            }
        }
        Ok(Self { metrics })
    }

    /// Feeds one batch to every metric (all or none: inputs are checked first).
    pub fn update(&mut self, predictions: &[f32], labels: &[f32], weights: Option<&[f32]>) -> Result<(), MetricError> {
        crate::validate_batch(predictions, labels, weights)?;
        for m in &mut self.metrics {
            m.update(predictions, labels, weights)?;
        }
        Ok(())
    }

    /// Every metric's values.
    pub fn report(&self, step: u64, split: Split) -> MetricReport {
        MetricReport { step, split, metrics: self.metrics.iter().flat_map(|m| m.compute()).collect() }
    }

    /// Resets every metric.
    pub fn reset(&mut self) {
        self.metrics.iter_mut().for_each(|m| m.reset());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AucMetric, NeMetric};

    #[test]
    fn suite_reports_table_and_jsonl() {
        let mut s = MetricSuite::new(vec![Box::new(NeMetric::new(true)), Box::new(AucMetric::new())]).unwrap();
        s.update(&[0.9, 0.8, 0.3, 0.1], &[1.0, 0.0, 1.0, 0.0], None).unwrap();
        let r = s.report(10, Split::Eval);
        assert_eq!(r.metrics.keys().collect::<Vec<_>>(), vec!["auc", "logloss", "ne"]);
        assert!(r.to_jsonl().unwrap().starts_with("{\"step\":10,\"split\":\"eval\",\"metrics\":{\"auc\":0.75"));
        assert!(r.to_table().lines().any(|l| l.starts_with("auc ") && l.ends_with(" 0.750000")));
        assert!(MetricSuite::new(vec![Box::new(AucMetric::new()), Box::new(AucMetric::new())]).is_err());
    }
}
