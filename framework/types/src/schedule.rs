//! Learning-rate schedules: TorchRec's `WarmupOptimizer` stages. A schedule is a list of
//! stages; step `t` (0 for the run's first update, counted over the whole run) takes the first
//! stage whose `max_iters` is at least `t`, and its learning rate is the optimizer's `lr` times
//! that stage's multiplier; after the last stage the multiplier is 1.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Word;
use crate::diagnostic::{Diagnostic, KeyPath};

/// How a stage scales the learning rate at step `t` (TorchRec's `WarmupPolicy`); `t` counts
/// from the run's first update, not from the stage's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WarmupPolicy {
    /// `value + (1 - value) * t / max_iters`: from `value` at step 0 up to 1 at `max_iters`.
    Linear,
    /// `value`.
    Constant,
    /// `(1 - t / decay_iters) ^ value`: down to 0 at `decay_iters`.
    Poly,
    /// `value ^ floor(t / decay_iters)`: times `value` every `decay_iters` steps.
    Step,
    /// `1 / sqrt(t)`.
    #[serde(rename = "inv_sqrt")]
    InvSqrt,
    /// SGDR without period growth: `value + (1 - value) * (1 + cos(pi * (t mod sgdr_period) /
    /// sgdr_period)) / 2`, restarting at 1 every `sgdr_period` steps.
    CosineAnnealingWarmRestarts,
    /// `value + (end_value - value) * (t - start_interpolating_iters) / (max_iters -
    /// start_interpolating_iters)`.
    Interpolate,
}

impl Word for WarmupPolicy {
    const WORDS: &'static [Self] = &[
        Self::Linear,
        Self::Constant,
        Self::Poly,
        Self::Step,
        Self::InvSqrt,
        Self::CosineAnnealingWarmRestarts,
        Self::Interpolate,
    ];
    fn name(self) -> &'static str {
        match self {
            Self::Linear => "linear",
            Self::Constant => "constant",
            Self::Poly => "poly",
            Self::Step => "step",
            Self::InvSqrt => "inv_sqrt",
            Self::CosineAnnealingWarmRestarts => "cosine_annealing_warm_restarts",
            Self::Interpolate => "interpolate",
        }
    }
}

fn one() -> f64 {
    1.0
}

fn one_step() -> u64 {
    1
}

/// One stage of a learning-rate schedule (TorchRec's `WarmupStage`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WarmupStage {
    /// How the stage scales the learning rate (`linear`, `constant`, `poly`, `step`, `inv_sqrt`,
    /// `cosine_annealing_warm_restarts`, `interpolate`; see the book's schedules chapter).
    pub policy: WarmupPolicy,
    /// The last step this stage applies to, counted from the run's first update (step 0); each
    /// stage's must be greater than the previous stage's.
    pub max_iters: u64,
    /// The policy's parameter: the starting multiplier of `linear`, the multiplier of
    /// `constant`, the exponent of `poly`, the factor of `step`, the floor of
    /// `cosine_annealing_warm_restarts`, the starting value of `interpolate`.
    #[serde(default = "one")]
    pub value: f64,
    /// A factor on the stage's multiplier.
    #[serde(default = "one")]
    pub lr_scale: f64,
    /// `poly`: the step at which the multiplier reaches 0 (default: `max_iters`). `step`: steps
    /// between two decays (default: 1).
    #[serde(default)]
    pub decay_iters: Option<u64>,
    /// `cosine_annealing_warm_restarts`: steps per cosine period.
    #[serde(default = "one_step")]
    pub sgdr_period: u64,
    /// `interpolate`: the step the interpolation starts from.
    #[serde(default)]
    pub start_interpolating_iters: Option<u64>,
    /// `interpolate`: the multiplier reached at `max_iters`.
    #[serde(default)]
    pub end_value: Option<f64>,
}

impl WarmupStage {
    /// The stage's multiplier at step `t`, `lr_scale` included.
    pub fn multiplier(&self, t: u64) -> f64 {
        let t = t as f64;
        let m = match self.policy {
            WarmupPolicy::Linear => self.value + (1.0 - self.value) * t / self.max_iters as f64,
            WarmupPolicy::Constant => self.value,
            WarmupPolicy::Poly => (1.0 - t / self.decay_iters.unwrap_or(self.max_iters) as f64).powf(self.value),
            WarmupPolicy::Step => self.value.powf((t as u64 / self.decay_iters.unwrap_or(1).max(1)) as f64),
            WarmupPolicy::InvSqrt => 1.0 / t.sqrt(),
            WarmupPolicy::CosineAnnealingWarmRestarts => {
                let period = self.sgdr_period.max(1);
                let t_cur = (t as u64 % period) as f64;
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * t_cur / period as f64).cos());
                self.value + (1.0 - self.value) * cos
            }
            WarmupPolicy::Interpolate => {
                let start = self.start_interpolating_iters.unwrap_or(0) as f64;
                let end = self.end_value.unwrap_or(self.value);
                self.value + (end - self.value) * (t - start) / (self.max_iters as f64 - start)
            }
        };
        m * self.lr_scale
    }
}

/// The learning-rate multiplier of step `t` (0 for the first update) under `stages`: the first
/// stage whose `max_iters` is at least `t`; 1 after the last stage, and without stages.
pub fn lr_multiplier(stages: &[WarmupStage], t: u64) -> f64 {
    stages.iter().find(|s| t <= s.max_iters).map_or(1.0, |s| s.multiplier(t))
}

/// The problems of a schedule at `key` (an array of stages): stages out of order, missing or
/// non-finite parameters, and multipliers that are not a finite number at some step (`inv_sqrt`
/// at step 0, `poly` past its `decay_iters`).
pub fn check_schedule(stages: &[WarmupStage], key: &KeyPath) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let mut previous: Option<u64> = None;
    for (i, s) in stages.iter().enumerate() {
        let at = key.index(i);
        match previous {
            None if s.max_iters == 0 => {
                out.push(Diagnostic::new(at.key("max_iters"), "max_iters must be at least 1"));
            }
            Some(p) if s.max_iters <= p => out.push(Diagnostic::new(
                at.key("max_iters"),
                format!("max_iters = {} must be greater than the previous stage's {p}", s.max_iters),
            )),
            _ => {}
        }
        let first_step = previous.map_or(0, |p| p + 1);
        previous = Some(s.max_iters);
        for (name, v) in [("value", Some(s.value)), ("lr_scale", Some(s.lr_scale)), ("end_value", s.end_value)] {
            if v.is_some_and(|v| !v.is_finite()) {
                out.push(Diagnostic::new(at.key(name), format!("{name} must be a finite number")));
            }
        }
        match s.policy {
            WarmupPolicy::InvSqrt if first_step == 0 => out.push(
                Diagnostic::new(at.key("policy"), "inv_sqrt gives step 0 an infinite learning rate")
                    .with_help("start the schedule with a warm-up stage (e.g. linear) before inv_sqrt"),
            ),
            WarmupPolicy::Poly if s.decay_iters.is_some_and(|d| d < s.max_iters) => out.push(Diagnostic::new(
                at.key("decay_iters"),
                format!(
                    "poly: decay_iters = {} is before the stage's max_iters = {}: past it the multiplier is not a number",
                    s.decay_iters.unwrap_or(0),
                    s.max_iters
                ),
            )),
            WarmupPolicy::Poly if s.decay_iters == Some(0) => {
                out.push(Diagnostic::new(at.key("decay_iters"), "decay_iters must be at least 1"));
            }
            WarmupPolicy::Step if s.decay_iters == Some(0) => {
                out.push(Diagnostic::new(at.key("decay_iters"), "decay_iters must be at least 1"));
            }
            WarmupPolicy::CosineAnnealingWarmRestarts if s.sgdr_period == 0 => {
                out.push(Diagnostic::new(at.key("sgdr_period"), "sgdr_period must be at least 1"));
            }
            WarmupPolicy::Interpolate => match (s.start_interpolating_iters, s.end_value) {
                (Some(start), Some(_)) if start >= s.max_iters => out.push(Diagnostic::new(
                    at.key("start_interpolating_iters"),
                    format!("start_interpolating_iters = {start} must be less than max_iters = {}", s.max_iters),
                )),
                (Some(_), Some(_)) => {}
                (None, _) => out.push(Diagnostic::new(
                    at.key("start_interpolating_iters"),
                    "interpolate needs start_interpolating_iters and end_value",
                )),
                (_, None) => out.push(Diagnostic::new(
                    at.key("end_value"),
                    "interpolate needs start_interpolating_iters and end_value",
                )),
            },
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(policy: WarmupPolicy, max_iters: u64, value: f64) -> WarmupStage {
        WarmupStage {
            policy,
            max_iters,
            value,
            lr_scale: 1.0,
            decay_iters: None,
            sgdr_period: 1,
            start_interpolating_iters: None,
            end_value: None,
        }
    }

    /// Hand-computed multipliers: the stage boundaries are inclusive and `t` counts from the
    /// run's start.
    #[test]
    fn multipliers_follow_the_stages() {
        let s = [stage(WarmupPolicy::Linear, 4, 0.2), stage(WarmupPolicy::Poly, 8, 1.0)];
        assert_eq!(lr_multiplier(&s, 0), 0.2);
        assert!((lr_multiplier(&s, 2) - 0.6).abs() < 1e-15);
        assert_eq!(lr_multiplier(&s, 4), 1.0);
        // Step 5 is poly's: (1 - 5/8)^1.
        assert!((lr_multiplier(&s, 5) - 0.375).abs() < 1e-15);
        assert_eq!(lr_multiplier(&s, 8), 0.0);
        assert_eq!(lr_multiplier(&s, 9), 1.0);
        assert_eq!(lr_multiplier(&[], 3), 1.0);
    }

    #[test]
    fn bad_schedules_are_named() {
        let key = KeyPath::root().key("optimizer").key("dense_schedule");
        let s = [stage(WarmupPolicy::InvSqrt, 5, 1.0), stage(WarmupPolicy::Constant, 5, 0.5)];
        let d: Vec<String> = check_schedule(&s, &key).iter().map(|d| format!("{}: {}", d.key, d.message)).collect();
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d[0].starts_with("optimizer.dense_schedule[0].policy: inv_sqrt"), "{d:?}");
        assert!(d[1].starts_with("optimizer.dense_schedule[1].max_iters"), "{d:?}");
        let interp = [stage(WarmupPolicy::Interpolate, 5, 1.0)];
        assert_eq!(check_schedule(&interp, &key).len(), 1);
        let ok = [stage(WarmupPolicy::Linear, 5, 0.0), stage(WarmupPolicy::InvSqrt, 9, 1.0)];
        assert!(check_schedule(&ok, &key).is_empty());
    }
}
