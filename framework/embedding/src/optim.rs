//! The fused optimizers' per-row update, in fp32 with FBGEMM's operation order.

use crate::{SparseOptimizerConfig, WeightDecayMode};

/// Lanes of the row reductions. Eight independent partial sums (combined pairwise at the
/// end) let the compiler vectorise what would otherwise be a chain of dependent adds, the
/// bottleneck of a row-wise update; the order is fixed, so results stay deterministic, and
/// differ from a sequential sum only by float rounding (well inside FBGEMM parity tolerance).
const LANES: usize = 8;

#[inline(always)]
fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `sum(g^2)`.
#[inline(always)]
pub(crate) fn sum_sq(g: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = g.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += c[i] * c[i];
        }
    }
    for (i, &x) in tail.iter().enumerate() {
        acc[i] += x * x;
    }
    reduce(acc)
}

/// `sum((g + wd * w)^2)`.
#[inline(always)]
fn sum_sq_l2(g: &[f32], w: &[f32], wd: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (gc, wc) = (g.chunks_exact(LANES), w.chunks_exact(LANES));
    let (gt, wt) = (gc.remainder(), wc.remainder());
    for (g, w) in gc.zip(wc) {
        for i in 0..LANES {
            let x = g[i] + wd * w[i];
            acc[i] += x * x;
        }
    }
    for (i, (&g, &w)) in gt.iter().zip(wt).enumerate() {
        let x = g + wd * w;
        acc[i] += x * x;
    }
    reduce(acc)
}

/// Which fused optimizer a step runs (row-wise Adagrad with its weight decay mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Plain SGD.
    Sgd,
    /// Element-wise Adagrad.
    Adagrad,
    /// Exact row-wise Adagrad.
    RowwiseAdagrad(WeightDecayMode),
    /// Adam.
    Adam,
    /// Partial row-wise Adam (row-wise second moment).
    PartialRowwiseAdam,
    /// LAMB.
    Lamb,
}

/// The constants of one fused-optimizer step, resolved on the host as the CPU kernels use
/// them (other kernels, such as the CUDA engine's, take them as arguments and compute the
/// same update).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepConstants {
    /// The optimizer.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f32,
    /// Epsilon (0 for SGD).
    pub eps: f32,
    /// Weight decay (0 where the optimizer has none).
    pub weight_decay: f32,
    /// First-moment decay (Adam, LAMB).
    pub beta1: f32,
    /// Second-moment decay (Adam, LAMB).
    pub beta2: f32,
    /// `1 - beta1^t` (1 where unused).
    pub c1: f32,
    /// `1 - beta2^t` (1 where unused).
    pub c2: f32,
}

impl StepConstants {
    /// The constants of `optimizer`'s update `t` (1 for the first; FBGEMM's `iter`).
    pub fn of(optimizer: &SparseOptimizerConfig, t: u64) -> Self {
        let s = Step::new(optimizer, t);
        let kind = match s.opt {
            Kind::Sgd => OptimizerKind::Sgd,
            Kind::Adagrad => OptimizerKind::Adagrad,
            Kind::Rowwise(mode) => OptimizerKind::RowwiseAdagrad(mode),
            Kind::Adam => OptimizerKind::Adam,
            Kind::PartialRowwiseAdam => OptimizerKind::PartialRowwiseAdam,
            Kind::Lamb => OptimizerKind::Lamb,
        };
        Self {
            kind,
            lr: s.lr,
            eps: s.eps,
            weight_decay: s.weight_decay,
            beta1: s.beta1,
            beta2: s.beta2,
            c1: s.c1,
            c2: s.c2,
        }
    }
}

impl StepConstants {
    /// The constants with the learning rate `lr × multiplier` (computed in f64, as a schedule
    /// sets a PyTorch param group's rate, then stored in f32 as FBGEMM's kernels take it).
    pub fn with_lr_multiplier(mut self, lr: f32, multiplier: f64) -> Self {
        self.lr = scaled_lr(lr, multiplier);
        self
    }
}

/// `lr × multiplier` computed in f64, stored in f32 (exactly `lr` for a multiplier of 1).
pub fn scaled_lr(lr: f32, multiplier: f64) -> f32 {
    (f64::from(lr) * multiplier) as f32
}

/// One step's optimizer with its step-dependent constants resolved.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    opt: Kind,
    lr: f32,
    eps: f32,
    weight_decay: f32,
    beta1: f32,
    beta2: f32,
    /// `1 - beta1^t`.
    c1: f32,
    /// `1 - beta2^t`.
    c2: f32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Sgd,
    Adagrad,
    Rowwise(WeightDecayMode),
    Adam,
    PartialRowwiseAdam,
    Lamb,
}

impl Step {
    /// The step with the learning rate `lr × multiplier` ([`scaled_lr`]).
    pub(crate) fn with_lr_multiplier(mut self, lr: f32, multiplier: f64) -> Self {
        self.lr = scaled_lr(lr, multiplier);
        self
    }

    /// The update of step `t` (1 for the first update).
    pub(crate) fn new(config: &SparseOptimizerConfig, t: u64) -> Self {
        use SparseOptimizerConfig as C;
        let mut s = Step {
            opt: Kind::Sgd,
            lr: config.lr(),
            eps: 0.0,
            weight_decay: 0.0,
            beta1: 0.0,
            beta2: 0.0,
            c1: 1.0,
            c2: 1.0,
        };
        match *config {
            C::Sgd { .. } => {}
            C::Adagrad { eps, .. } => {
                s.opt = Kind::Adagrad;
                s.eps = eps;
            }
            C::RowwiseAdagrad { eps, weight_decay, weight_decay_mode, .. } => {
                s.opt = Kind::Rowwise(weight_decay_mode);
                s.eps = eps;
                s.weight_decay = weight_decay;
            }
            C::Adam { eps, beta1, beta2, weight_decay, .. }
            | C::PartialRowwiseAdam { eps, beta1, beta2, weight_decay, .. }
            | C::Lamb { eps, beta1, beta2, weight_decay, .. } => {
                s.opt = match config {
                    C::Adam { .. } => Kind::Adam,
                    C::PartialRowwiseAdam { .. } => Kind::PartialRowwiseAdam,
                    _ => Kind::Lamb,
                };
                s.eps = eps;
                s.beta1 = beta1;
                s.beta2 = beta2;
                s.weight_decay = weight_decay;
                // FBGEMM: powf(beta, iter) in fp32 with the iteration as a float.
                let t = t as f32;
                s.c1 = 1.0 - beta1.powf(t);
                s.c2 = 1.0 - beta2.powf(t);
            }
        }
        s
    }

    /// Updates one row: `w` its weights (fp32), `state` its optimizer state
    /// (`state_per_row(dim)` floats), `g` its summed gradient (scratch: LAMB overwrites it).
    #[inline(always)]
    pub(crate) fn apply(&self, w: &mut [f32], state: &mut [f32], g: &mut [f32]) {
        let dim = w.len();
        debug_assert_eq!(g.len(), dim);
        let lr = self.lr;
        if self.opt == Kind::Lamb {
            // As FBGEMM, the gradient buffer is reused for the direction r.
            let (m1, m2) = state.split_at_mut(dim);
            let (b1, b2, c1, c2, eps, wd) = (self.beta1, self.beta2, self.c1, self.c2, self.eps, self.weight_decay);
            for (((&w, m), v), g) in w.iter().zip(m1.iter_mut()).zip(m2.iter_mut()).zip(g.iter_mut()) {
                *m = b1 * *m + (1.0 - b1) * *g;
                *v = b2 * *v + (1.0 - b2) * *g * *g;
                *g = (*m / c1) / ((*v / c2).sqrt() + eps) + wd * w;
            }
            let (wn, rn) = (sum_sq(w).sqrt(), sum_sq(g).sqrt());
            let ratio = if wn > 0.0 && rn > 0.0 { wn / rn } else { 1.0 };
            let step = -lr * ratio;
            for (w, &r) in w.iter_mut().zip(g.iter()) {
                *w += step * r;
            }
            return;
        }
        let g: &[f32] = g;
        match self.opt {
            Kind::Sgd => {
                for (w, &g) in w.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            Kind::Adagrad => {
                let eps = self.eps;
                for ((w, m), &g) in w.iter_mut().zip(state.iter_mut()).zip(g) {
                    *m += g * g;
                    *w -= lr * g / (m.sqrt() + eps);
                }
            }
            Kind::Rowwise(mode) => {
                let wd = self.weight_decay;
                let l2 = mode == WeightDecayMode::L2;
                let sum_sq = if l2 { sum_sq_l2(g, w, wd) } else { sum_sq(g) };
                let s = &mut state[0];
                *s += sum_sq / dim as f32;
                let multiplier = lr / (s.sqrt() + self.eps);
                let correction = match mode {
                    WeightDecayMode::None => 1.0,
                    WeightDecayMode::L2 => 1.0 - multiplier * wd,
                    WeightDecayMode::Decoupled => 1.0 - lr * wd,
                };
                if correction == 1.0 {
                    for (w, &g) in w.iter_mut().zip(g) {
                        *w -= multiplier * g;
                    }
                } else {
                    for (w, &g) in w.iter_mut().zip(g) {
                        *w = correction * *w - multiplier * g;
                    }
                }
            }
            Kind::Adam => {
                let (m1, m2) = state.split_at_mut(dim);
                let (b1, b2, c1, c2, eps, wd) = (self.beta1, self.beta2, self.c1, self.c2, self.eps, self.weight_decay);
                for (((w, m), v), &g) in w.iter_mut().zip(m1.iter_mut()).zip(m2.iter_mut()).zip(g) {
                    *m = *m * b1 + g * (1.0 - b1);
                    *v = *v * b2 + g * g * (1.0 - b2);
                    *w -= lr * (*m / c1 / ((*v / c2).sqrt() + eps) + wd * *w);
                }
            }
            Kind::PartialRowwiseAdam => {
                let (v, m1) = state.split_at_mut(1);
                let (b1, b2, c1, c2, eps, wd) = (self.beta1, self.beta2, self.c1, self.c2, self.eps, self.weight_decay);
                let sum_sq = sum_sq(g);
                let v_t = sum_sq / dim as f32 * (1.0 - b2) + v[0] * b2;
                v[0] = v_t;
                let denom = (v_t / c2).sqrt() + eps;
                for ((w, m), &g) in w.iter_mut().zip(m1.iter_mut()).zip(g) {
                    *m = *m * b1 + g * (1.0 - b1);
                    *w -= lr * (*m / c1 / denom + wd * *w);
                }
            }
            Kind::Lamb => {} // handled above, where the gradient buffer is writable
        }
    }
}
