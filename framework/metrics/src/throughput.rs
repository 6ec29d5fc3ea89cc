//! Training throughput in examples per second (TorchRec `throughput.py`).

use std::collections::VecDeque;
use std::time::Instant;

use crate::state::{of_kind, with_kind};
use crate::{MetricError, MetricState};

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
///
/// **Checkpoints.** [`ThroughputMetric::state`] saves the step and example counts and the
/// measured time lapses (durations, not clock readings); [`ThroughputMetric::load_state`]
/// restores them, so `total_examples` continues exactly and the throughputs continue over the
/// time spent training. Wall-clock time cannot be restored: the first step after a load
/// restarts the clock, like the last warm-up step (its examples are counted, not timed), and
/// the time between the checkpoint and that step is not counted.
#[derive(Clone, Debug)]
pub struct ThroughputMetric {
    warmup_steps: u64,
    window_seconds: f64,
    steps: u64,
    total_examples: u64,
    /// Examples of the steps not timed: warm-up and the first step after a load.
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
        if self.previous.is_none() {
            // The first step after `load_state`: restart the clock, as at the end of warm-up.
            self.warmup_examples += examples;
            self.previous = Some(now_s);
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

    /// The counts and measured lapses (see [`ThroughputMetric`]), each array named
    /// `throughput.<name>`: the options `warmup_steps` and `window_seconds`, the counts `steps`,
    /// `total_examples` and `untimed_examples`, the timed seconds `after_warmup_s`, and the
    /// window's steps `window_lapses` (seconds) / `window_examples` with their running sum
    /// `window_s`. Counts are exact below 2^53.
    pub fn state(&self) -> MetricState {
        let mut state = MetricState::default();
        state.push_counts("warmup_steps", [self.warmup_steps]);
        state.push("window_seconds", [self.window_seconds]);
        state.push_counts("steps", [self.steps]);
        state.push_counts("total_examples", [self.total_examples]);
        state.push_counts("untimed_examples", [self.warmup_examples]);
        state.push("after_warmup_s", [self.after_warmup_s]);
        state.push("window_lapses", self.window.iter().map(|&(lapse, _)| lapse));
        state.push_counts("window_examples", self.window.iter().map(|&(_, examples)| examples));
        state.push("window_s", [self.window_s]);
        with_kind("throughput", state)
    }

    /// Restores what [`ThroughputMetric::state`] saved into a metric with the same options; the
    /// next step restarts the clock. A state that does not fit is an error and changes nothing.
    pub fn load_state(&mut self, state: &MetricState) -> Result<(), MetricError> {
        self.load(state).map_err(|e| e.in_metric("throughput"))
    }

    fn load(&mut self, state: &MetricState) -> Result<(), MetricError> {
        const NAMES: [&str; 9] = [
            "warmup_steps",
            "window_seconds",
            "steps",
            "total_examples",
            "untimed_examples",
            "after_warmup_s",
            "window_lapses",
            "window_examples",
            "window_s",
        ];
        let state = of_kind("throughput", state, &NAMES)?;
        state.expect_array("warmup_steps", &[self.warmup_steps as f64])?;
        state.expect_array("window_seconds", &[self.window_seconds])?;
        let count = |name: &str| -> Result<u64, MetricError> {
            state.get_len(name, 1)?;
            Ok(state.counts(name)?[0])
        };
        let seconds = |name: &str| -> Result<f64, MetricError> {
            match state.scalar(name)? {
                v if v.is_finite() && v >= 0.0 => Ok(v),
                v => Err(MetricError::bad_state(format!("{name} = {v} is not a duration in seconds"))),
            }
        };
        let (steps, total_examples, untimed) = (count("steps")?, count("total_examples")?, count("untimed_examples")?);
        if untimed > total_examples {
            return Err(MetricError::bad_state(format!(
                "untimed_examples {untimed} exceeds total_examples {total_examples}"
            )));
        }
        let (after_warmup_s, window_s) = (seconds("after_warmup_s")?, seconds("window_s")?);
        let examples = state.counts("window_examples")?;
        state.finite("window_lapses")?;
        let lapses = state.get_len("window_lapses", examples.len())?;
        if let Some((i, l)) = lapses.iter().enumerate().find(|(_, l)| **l < 0.0) {
            return Err(MetricError::bad_state(format!("window_lapses[{i}] = {l} is negative")));
        }
        let window_examples = examples.iter().sum::<u64>();
        if window_examples > total_examples - untimed {
            return Err(MetricError::bad_state(format!(
                "the window holds {window_examples} examples, more than the {} timed ones",
                total_examples - untimed
            )));
        }
        self.steps = steps;
        self.total_examples = total_examples;
        self.warmup_examples = untimed;
        self.after_warmup_s = after_warmup_s;
        self.previous = None;
        self.window = lapses.iter().copied().zip(examples).collect();
        self.window_s = window_s;
        self.window_examples = window_examples;
        Ok(())
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

    #[test]
    fn state_restores_counts_and_lapses_and_restarts_the_clock() {
        let mut m = ThroughputMetric::new(2, 3.0).unwrap();
        for (t, e) in [(10.0, 100), (11.0, 100), (12.0, 100), (14.0, 100)] {
            m.update_at(e, t);
        }
        let state = m.state();
        let mut r = ThroughputMetric::new(2, 3.0).unwrap();
        r.load_state(&state).unwrap();
        assert_eq!(r.state(), state);
        let bits = |v: Vec<(String, f64)>| v.into_iter().map(|(n, v)| (n, v.to_bits())).collect::<Vec<_>>();
        assert_eq!(bits(r.compute()), bits(m.compute()));
        // Another clock: the first step restarts it (counted, not timed), the next is timed.
        r.update_at(50, 1000.0);
        let v: std::collections::BTreeMap<String, f64> = r.compute().into_iter().collect();
        assert_eq!((v["total_examples"], v["lifetime_throughput"]), (450.0, 200.0 / 3.0));
        r.update_at(100, 1001.0);
        let v: std::collections::BTreeMap<String, f64> = r.compute().into_iter().collect();
        assert_eq!(v["total_examples"], 550.0);
        assert_eq!(v["lifetime_throughput"], 300.0 / 4.0);
        // Lapses 1, 2 (restored) and 1 exceed 3 s: the oldest goes, 200 examples in 3 s remain.
        assert_eq!(v["window_throughput"], 200.0 / 3.0);
        assert!(
            ThroughputMetric::new(3, 3.0).unwrap().load_state(&state).unwrap_err().to_string().contains("warmup_steps")
        );
    }

    #[test]
    fn damaged_state_is_rejected_and_changes_nothing() {
        let mut m = ThroughputMetric::new(1, 5.0).unwrap();
        for (i, e) in [7u64, 9, 11, 13].into_iter().enumerate() {
            m.update_at(e, i as f64 * 0.5);
        }
        let state = m.state();
        let mut r = ThroughputMetric::new(1, 5.0).unwrap();
        r.load_state(&state).unwrap();
        for i in 0..state.arrays.len() {
            let mut variants = Vec::new();
            let mut s = state.clone();
            s.arrays.remove(i);
            variants.push(s);
            let mut s = state.clone();
            s.arrays[i].1.push(0.0);
            variants.push(s);
            let mut s = state.clone();
            s.arrays[i].1[0] = f64::NAN;
            variants.push(s);
            let mut s = state.clone();
            s.arrays[i].1[0] = -1.0;
            variants.push(s);
            for (v, s) in variants.iter().enumerate() {
                let name = &state.arrays[i].0;
                assert!(matches!(r.load_state(s), Err(MetricError::BadState { .. })), "{name}, variant {v}");
                assert_eq!(r.state(), state, "{name}, variant {v}");
            }
        }
        let mut s = state.clone();
        s.arrays.iter_mut().find(|(n, _)| n == "throughput.untimed_examples").unwrap().1[0] = 1000.0;
        assert!(r.load_state(&s).unwrap_err().to_string().contains("exceeds total_examples"));
    }
}
