//! Training throughput in examples per second (TorchRec `throughput.py`).

use std::collections::VecDeque;
use std::time::Instant;

use crate::MetricError;

/// TorchRec's default warm-up: steps not timed.
pub const THROUGHPUT_WARMUP_STEPS: u64 = 100;
/// TorchRec's default window, in seconds.
pub const THROUGHPUT_WINDOW_SECONDS: f64 = 100.0;

/// Examples per second, lifetime and over a time window, as TorchRec's `ThroughputMetric`.
///
/// Every step adds its examples (the global batch: `batch_size * world_size`). The first
/// `warmup_steps` steps are counted but not timed; from then on each step's time lapse since
/// the previous one is recorded, and
///
/// ```text
/// lifetime_throughput = (total_examples - warmup_examples) / time since the end of warm-up
/// window_throughput   = examples of the steps in the window / their time lapses
/// ```
///
/// where the window keeps the latest lapses summing to at most `window_seconds`. Both are
/// reported only after warm-up (as TorchRec; `total_examples` always is). TorchRec multiplies
/// the window's step count by the configured batch size; this counts each step's own examples,
/// which is the same for fixed batches and right for a short last batch.
#[derive(Clone, Debug)]
pub struct ThroughputMetric {
    warmup_steps: u64,
    window_seconds: f64,
    steps: u64,
    total_examples: u64,
    warmup_examples: u64,
    after_warmup_s: f64,
    previous: Option<f64>,
    /// (lapse in seconds, examples) of the steps in the window.
    window: VecDeque<(f64, u64)>,
    window_s: f64,
    window_examples: u64,
    origin: Instant,
}

impl ThroughputMetric {
    /// A throughput metric with TorchRec's options.
    pub fn new(warmup_steps: u64, window_seconds: f64) -> Result<Self, MetricError> {
        if warmup_steps < 1 {
            return Err(MetricError::Option {
                metric: "throughput",
                message: "warmup_steps must be at least 1".into(),
            });
        }
        if !(window_seconds >= 1.0 && window_seconds.is_finite()) {
            return Err(MetricError::Option {
                metric: "throughput",
                message: format!("window_seconds must be at least 1, found {window_seconds}"),
            });
        }
        Ok(Self {
            warmup_steps,
            window_seconds,
            steps: 0,
            total_examples: 0,
            warmup_examples: 0,
            after_warmup_s: 0.0,
            previous: None,
            window: VecDeque::new(),
            window_s: 0.0,
            window_examples: 0,
            origin: Instant::now(),
        })
    }

    /// Records one step of `examples` examples, now.
    pub fn update(&mut self, examples: u64) {
        let now = self.origin.elapsed().as_secs_f64();
        self.update_at(examples, now);
    }

    /// Records one step of `examples` examples that ended at `now_s` seconds (any fixed origin,
    /// non-decreasing).
    pub fn update_at(&mut self, examples: u64, now_s: f64) {
        self.steps += 1;
        self.total_examples += examples;
        if self.steps <= self.warmup_steps {
            self.warmup_examples += examples;
            if self.steps == self.warmup_steps {
                self.previous = Some(now_s);
            }
            return;
        }
        let lapse = (now_s - self.previous.unwrap_or(now_s)).max(0.0);
        self.previous = Some(now_s);
        self.after_warmup_s += lapse;
        self.window.push_back((lapse, examples));
        self.window_s += lapse;
        self.window_examples += examples;
        while self.window_s > self.window_seconds {
            let Some((l, e)) = self.window.pop_front() else { break };
            self.window_s -= l;
            self.window_examples -= e;
        }
    }

    /// `total_examples`, and after warm-up `lifetime_throughput` and `window_throughput`
    /// (examples per second).
    pub fn compute(&self) -> Vec<(String, f64)> {
        let mut out = vec![("total_examples".to_owned(), self.total_examples as f64)];
        if self.steps > self.warmup_steps && self.after_warmup_s > 0.0 {
            let lifetime = (self.total_examples - self.warmup_examples) as f64 / self.after_warmup_s;
            let window = if self.window_s > 0.0 { self.window_examples as f64 / self.window_s } else { 0.0 };
            out.push(("lifetime_throughput".to_owned(), lifetime));
            out.push(("window_throughput".to_owned(), window));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_warmup_lifetime_and_window() {
        let mut m = ThroughputMetric::new(2, 3.0).unwrap();
        m.update_at(100, 10.0);
        assert_eq!(m.compute(), vec![("total_examples".to_owned(), 100.0)]);
        m.update_at(100, 11.0); // warm-up ends: the clock starts here
        assert_eq!(m.compute().len(), 1);
        // Steps of 1 s, 2 s, 1 s, 0.5 s with 100, 100, 100, 50 examples.
        for (t, e) in [(12.0, 100), (14.0, 100), (15.0, 100), (15.5, 50)] {
            m.update_at(e, t);
        }
        let v: std::collections::BTreeMap<String, f64> = m.compute().into_iter().collect();
        assert_eq!(v["total_examples"], 550.0);
        assert!((v["lifetime_throughput"] - 350.0 / 4.5).abs() < 1e-12);
        // The window keeps lapses summing to <= 3 s: 2 + 1 + 0.5 → 250 examples / 3.5 s is too
        // long, so the 2 s step goes: 150 examples / 1.5 s.
        assert!((v["window_throughput"] - 100.0).abs() < 1e-12, "{}", v["window_throughput"]);
    }

    #[test]
    fn bad_options_are_errors() {
        assert!(ThroughputMetric::new(0, 100.0).unwrap_err().to_string().contains("warmup_steps"));
        assert!(ThroughputMetric::new(1, 0.5).unwrap_err().to_string().contains("window_seconds"));
        let mut m = ThroughputMetric::new(1, 100.0).unwrap();
        m.update(10);
        m.update(10);
        assert_eq!(m.compute()[0].1, 20.0);
    }
}
