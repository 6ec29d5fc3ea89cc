//! Dense optimizers over a tch `VarStore`: SGD, Adam and Adagrad, written here so that their
//! state (momentum buffers, Adam moments and steps, Adagrad sums) can be saved and restored
//! ([`DenseOptimizer::state`], [`DenseOptimizer::load_state`]): libtorch's own optimizers keep
//! theirs out of tch's reach.
//!
//! SGD and Adam follow libtorch's `torch::optim::SGD` / `torch::optim::Adam` (what tch's
//! `nn::Sgd` / `nn::Adam` run) operation for operation: the same roundings in the same order,
//! scalars rounded to the parameter's type as ATen does. Contiguous CPU float32 parameters are
//! updated in a single pass that also fuses the multiply-adds ATen's CPU kernels fuse
//! (`add(other, alpha)`, `addcmul`): on a CPU with FMA it reproduces libtorch's float32 results
//! bit for bit (tested). Other parameters (double, non-contiguous, on a GPU) are updated with
//! tensor operations that round the multiply-adds twice, within an ulp or so of libtorch's.
//!
//! # State names
//!
//! [`DenseOptimizer::state`] names each tensor `<variable>.<part>`, `<variable>` being the
//! parameter's name in the `VarStore` (`vs.variables()`; `#<i>`, the index in
//! `vs.trainable_variables()`, for a parameter the store cannot name), and `<part>`:
//! - SGD with momentum: `momentum_buffer` (the parameter's shape);
//! - Adam: `exp_avg`, `exp_avg_sq` (the parameter's shape) and `step` (int64, shape `[1]`);
//! - Adagrad: `sum` (the parameter's shape).
//!
//! SGD without momentum has no state. A parameter that has not been stepped yet (no gradient
//! so far) has no momentum buffer or Adam moments, and its entries are absent.

use std::collections::HashMap;

use tch::{Kind, Tensor, nn, nn::OptimizerConfig};
use trainrec_types::DenseOptimizerConfig;

/// State part: SGD's momentum buffer.
const MOMENTUM_BUFFER: &str = "momentum_buffer";
/// State part: Adam's first-moment estimate.
const EXP_AVG: &str = "exp_avg";
/// State part: Adam's second-moment estimate.
const EXP_AVG_SQ: &str = "exp_avg_sq";
/// State part: Adam's step count.
const STEP: &str = "step";
/// State part: Adagrad's sum of squared gradients.
const SUM: &str = "sum";

/// PyTorch's Adagrad default `eps`.
const ADAGRAD_EPS: f64 = 1e-10;
/// PyTorch's Adam default `eps`.
const ADAM_EPS: f64 = 1e-8;

/// A dense optimizer over the trainable variables a `VarStore` holds when it is built: SGD
/// (momentum, no dampening, no Nesterov), Adam (no AMSGrad, eps 1e-8) and Adagrad (eps 1e-10,
/// no lr decay, zero initial accumulator), PyTorch's semantics, weight decay being an L2 penalty
/// added to the gradient.
pub struct DenseOptimizer {
    /// Trainable variables, in `vs.trainable_variables()` order.
    params: Vec<Tensor>,
    /// Their names in the state (see the module docs).
    names: Vec<String>,
    /// The update rule and its state.
    rule: Rule,
    /// For SGD and Adam: a stateless libtorch optimizer over the same variables, used only by
    /// [`DenseOptimizer::zero_grad`] to reset the gradients to undefined as libtorch's
    /// `zero_grad()` does (tch has no other way to drop a gradient).
    grad_reset: Option<nn::Optimizer>,
}

/// An update rule and its per-parameter state (indexed like `DenseOptimizer::params`).
enum Rule {
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
        /// Momentum buffers, created on a parameter's first step (none without momentum).
        buffers: Vec<Option<Tensor>>,
    },
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        /// Moments, created on a parameter's first step.
        moments: Vec<Option<AdamMoments>>,
    },
    Adagrad {
        lr: f64,
        weight_decay: f64,
        /// Running sums of squared gradients.
        sums: Vec<Tensor>,
    },
}

/// One parameter's Adam state.
struct AdamMoments {
    /// Steps taken.
    step: i64,
    /// First-moment estimate.
    exp_avg: Tensor,
    /// Second-moment estimate.
    exp_avg_sq: Tensor,
}

/// Why [`DenseOptimizer::load_state`] refused a state; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum OptimStateError {
    /// An entry names no parameter, or a part this optimizer does not keep.
    #[error("unknown entry `{entry}`: this optimizer keeps `<variable>.<part>` with part one of {parts:?}")]
    Unknown {
        /// The entry's name.
        entry: String,
        /// The parts this optimizer keeps.
        parts: &'static [&'static str],
    },
    /// An entry is given twice.
    #[error("entry `{0}` is given twice")]
    Duplicate(String),
    /// An entry the others require is missing (Adagrad's sums; an Adam moment or step without
    /// the other two parts).
    #[error("entry `{0}` is missing")]
    Missing(String),
    /// A tensor's shape is not its parameter's.
    #[error("entry `{entry}` has shape {found:?}, its variable {expected:?}")]
    Shape {
        /// The entry's name.
        entry: String,
        /// The parameter's shape.
        expected: Vec<i64>,
        /// The entry's shape.
        found: Vec<i64>,
    },
    /// A tensor's type or value is unusable (a non-float buffer, a step that is not a
    /// non-negative integer).
    #[error("entry `{entry}`: {reason}")]
    Invalid {
        /// The entry's name.
        entry: String,
        /// What is wrong.
        reason: String,
    },
    /// libtorch failed to copy an entry.
    #[error("entry `{entry}`: {source}")]
    Torch {
        /// The entry's name.
        entry: String,
        /// libtorch's error.
        source: tch::TchError,
    },
}

/// Whether ATen-style fused multiply-adds run in hardware here.
fn fma_in_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("fma")
    }
    #[cfg(target_arch = "aarch64")]
    {
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// `a * b + c`: rounded once when `FUSED` (as ATen's vectorised `fmadd`), else twice.
#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED { a.mul_add(b, c) } else { a * b + c }
}

/// Contiguous CPU float tensors of `n` (> 0) elements each, as slices.
fn cpu_f32(t: &Tensor, n: i64) -> bool {
    t.device() == tch::Device::Cpu && t.kind() == Kind::Float && t.is_contiguous() && t.numel() as i64 == n && n > 0
}

/// The scalars of one SGD step, rounded to float as ATen rounds them.
#[derive(Clone, Copy)]
struct SgdScalars {
    neg_lr: f32,
    momentum: f32,
    weight_decay: f32,
    /// Whether there is a momentum buffer to update.
    momentum_on: bool,
    /// Whether this is the buffer's first step (`buf = d_p`).
    first: bool,
}

/// One SGD step over slices, in libtorch's order: `d_p = g.add(p, wd)`; with momentum
/// `buf = d_p` on the first step, then `buf = buf * momentum + d_p`, and `d_p = buf`;
/// `p.add_(d_p, -lr)`.
#[inline(always)]
fn sgd_kernel<const FUSED: bool>(p: &mut [f32], buf: &mut [f32], g: &[f32], s: SgdScalars) {
    let decay = s.weight_decay != 0.0;
    if !s.momentum_on {
        for (p, &g) in p.iter_mut().zip(g) {
            let d = if decay { madd::<FUSED>(*p, s.weight_decay, g) } else { g };
            *p = madd::<FUSED>(d, s.neg_lr, *p);
        }
        return;
    }
    for ((p, b), &g) in p.iter_mut().zip(buf.iter_mut()).zip(g) {
        let d = if decay { madd::<FUSED>(*p, s.weight_decay, g) } else { g };
        // `add_(d_p, 1 - dampening)` with dampening 0 is a plain (exact-alpha) addition.
        *b = if s.first { d } else { *b * s.momentum + d };
        *p = madd::<FUSED>(*b, s.neg_lr, *p);
    }
}

/// [`sgd_kernel`] built for FMA hardware.
///
/// # Safety
/// The CPU must support FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn sgd_kernel_fma(p: &mut [f32], buf: &mut [f32], g: &[f32], s: SgdScalars) {
    sgd_kernel::<true>(p, buf, g, s)
}

/// One SGD step in a single pass when the parameter, its gradient and its momentum buffer (if
/// any) are contiguous CPU float tensors of one size (else false, nothing done).
fn sgd_in_place(p: &Tensor, buf: Option<&Tensor>, g: &Tensor, s: SgdScalars) -> bool {
    let n = p.numel() as i64;
    if !(cpu_f32(p, n) && cpu_f32(g, n) && buf.is_none_or(|b| cpu_f32(b, n))) {
        return false;
    }
    let n = n as usize;
    // SAFETY: distinct contiguous CPU float tensors of `n` elements (a parameter, its gradient
    // and this optimizer's own buffer); nothing else reads or writes them during the step (the
    // caller holds `&mut DenseOptimizer` and runs under no_grad).
    let (p, g, buf) = unsafe {
        (
            std::slice::from_raw_parts_mut(p.data_ptr().cast::<f32>(), n),
            std::slice::from_raw_parts(g.data_ptr().cast::<f32>().cast_const(), n),
            match buf {
                Some(b) => std::slice::from_raw_parts_mut(b.data_ptr().cast::<f32>(), n),
                None => &mut [][..],
            },
        )
    };
    if fma_in_hardware() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has FMA (checked just above).
        unsafe {
            sgd_kernel_fma(p, buf, g, s)
        };
        #[cfg(not(target_arch = "x86_64"))]
        sgd_kernel::<true>(p, buf, g, s);
    } else {
        sgd_kernel::<false>(p, buf, g, s);
    }
    true
}

/// The scalars of one Adam step, rounded to float as ATen rounds them.
#[derive(Clone, Copy)]
struct AdamScalars {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    weight_decay: f32,
    /// `sqrt(1 - beta2^t)`.
    sqrt_bias_correction2: f32,
    /// `-lr / (1 - beta1^t)`.
    neg_step_size: f32,
    eps: f32,
}

/// One Adam step over slices, in libtorch's order: `g = g.add(p, wd)`;
/// `m.mul_(b1).add_(g, 1 - b1)`; `v.mul_(b2).addcmul_(g, g, 1 - b2)`;
/// `denom = (v.sqrt() / sqrt(bc2)).add_(eps)`; `p.addcdiv_(m, denom, -lr / bc1)`.
#[inline(always)]
fn adam_kernel<const FUSED: bool>(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: AdamScalars) {
    let decay = s.weight_decay != 0.0;
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let g = if decay { madd::<FUSED>(*p, s.weight_decay, g) } else { g };
        *m = madd::<FUSED>(g, s.one_minus_beta1, *m * s.beta1);
        // addcmul: `self + value * t1 * t2`, which ATen's build contracts to
        // `fma(value * t1, t2, self)`.
        *v = madd::<FUSED>(s.one_minus_beta2 * g, g, *v * s.beta2);
        let denom = v.sqrt() / s.sqrt_bias_correction2 + s.eps;
        // addcdiv: `self + value * t1 / t2`.
        *p += s.neg_step_size * *m / denom;
    }
}

/// [`adam_kernel`] built for FMA hardware.
///
/// # Safety
/// The CPU must support FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn adam_kernel_fma(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: AdamScalars) {
    adam_kernel::<true>(p, m, v, g, s)
}

/// One Adam step in a single pass when the parameter, its gradient and its moments are
/// contiguous CPU float tensors of one size (else false, nothing done).
fn adam_in_place(p: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor, s: AdamScalars) -> bool {
    let n = p.numel() as i64;
    if !(cpu_f32(p, n) && cpu_f32(m, n) && cpu_f32(v, n) && cpu_f32(g, n)) {
        return false;
    }
    let n = n as usize;
    // SAFETY: distinct contiguous CPU float tensors of `n` elements (a parameter, its gradient
    // and this optimizer's own moments); nothing else reads or writes them during the step (the
    // caller holds `&mut DenseOptimizer` and runs under no_grad).
    let (p, m, v, g) = unsafe {
        (
            std::slice::from_raw_parts_mut(p.data_ptr().cast::<f32>(), n),
            std::slice::from_raw_parts_mut(m.data_ptr().cast::<f32>(), n),
            std::slice::from_raw_parts_mut(v.data_ptr().cast::<f32>(), n),
            std::slice::from_raw_parts(g.data_ptr().cast::<f32>().cast_const(), n),
        )
    };
    if fma_in_hardware() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has FMA (checked just above).
        unsafe {
            adam_kernel_fma(p, m, v, g, s)
        };
        #[cfg(not(target_arch = "x86_64"))]
        adam_kernel::<true>(p, m, v, g, s);
    } else {
        adam_kernel::<false>(p, m, v, g, s);
    }
    true
}

/// One Adagrad step in a single pass over the parameter, its gradient and its sum, when all
/// three are contiguous CPU float tensors of one size (else false, nothing done): the tensor
/// form reads and writes each of them several times.
fn adagrad_in_place(p: &Tensor, sum: &Tensor, g: &Tensor, lr: f32, weight_decay: f32) -> bool {
    let n = p.numel() as i64;
    if !(cpu_f32(p, n) && cpu_f32(sum, n) && cpu_f32(g, n)) {
        return false;
    }
    let n = n as usize;
    // SAFETY: the three are distinct contiguous CPU float tensors of `n` elements (a parameter,
    // its gradient and this optimizer's own state); nothing else reads or writes them during the
    // step (the caller holds `&mut self` and runs under no_grad).
    let (p, sum, g) = unsafe {
        (
            std::slice::from_raw_parts_mut(p.data_ptr().cast::<f32>(), n),
            std::slice::from_raw_parts_mut(sum.data_ptr().cast::<f32>(), n),
            std::slice::from_raw_parts(g.data_ptr().cast::<f32>().cast_const(), n),
        )
    };
    let eps = ADAGRAD_EPS as f32;
    for ((p, s), &g) in p.iter_mut().zip(sum.iter_mut()).zip(g) {
        let g = g + weight_decay * *p;
        *s += g * g;
        *p -= lr * g / (s.sqrt() + eps);
    }
    true
}

/// `g + weight_decay * p` (or `g` itself without decay), out of place.
fn decayed(g: &Tensor, p: &Tensor, weight_decay: f64) -> Tensor {
    if weight_decay != 0.0 { g + p * weight_decay } else { g.shallow_clone() }
}

/// `n` absent states.
fn nones<T>(n: usize) -> Vec<Option<T>> {
    (0..n).map(|_| None).collect()
}

/// The state names of the trainable variables `params` of `vs`: each one's `VarStore` name,
/// or `#<i>` when no single name holds it.
fn param_names(vs: &nn::VarStore, params: &[Tensor]) -> Vec<String> {
    let named = vs.variables();
    params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut hits = named.iter().filter(|(_, t)| t.f_is_set_to(p).unwrap_or(false));
            match (hits.next(), hits.next()) {
                (Some((name, _)), None) => name.clone(),
                _ => format!("#{i}"),
            }
        })
        .collect()
}

impl DenseOptimizer {
    /// Builds the optimizer for the trainable variables of `vs` (those it holds now).
    pub fn new(vs: &nn::VarStore, config: &DenseOptimizerConfig) -> Result<Self, tch::TchError> {
        let params = vs.trainable_variables();
        let names = param_names(vs, &params);
        let n = params.len();
        let (rule, grad_reset) = match *config {
            DenseOptimizerConfig::Sgd { lr, momentum, weight_decay } => {
                (Rule::Sgd { lr, momentum, weight_decay, buffers: nones(n) }, true)
            }
            DenseOptimizerConfig::Adam { lr, beta1, beta2, weight_decay } => {
                (Rule::Adam { lr, beta1, beta2, weight_decay, moments: nones(n) }, true)
            }
            DenseOptimizerConfig::Adagrad { lr, weight_decay } => {
                let sums = params.iter().map(Tensor::zeros_like).collect();
                (Rule::Adagrad { lr, weight_decay, sums }, false)
            }
        };
        // Plain SGD keeps no state: stepping it is never called, only its `zero_grad`.
        let grad_reset = if grad_reset { Some(nn::Sgd::default().build(vs, 0.0)?) } else { None };
        Ok(Self { params, names, rule, grad_reset })
    }

    /// Clips the gradients as `clipping` says (before [`Self::step`]), as TorchRec's
    /// `GradientClippingOptimizer` clips dense parameters: the norm of each gradient, their
    /// `norm_type`-norm together, and every gradient times `min(1, max_gradient / (total +
    /// 1e-6))`, in fp32 as `torch.nn.utils.clip_grad_norm_` computes it; or every value clamped
    /// (`clip_grad_value_`). Returns the total norm (norm clipping with gradients).
    pub fn clip_gradients(&mut self, clipping: &trainrec_types::DenseClipping) -> Option<f64> {
        let grads: Vec<Tensor> =
            self.params.iter().map(Tensor::grad).filter(|g| g.defined() && g.numel() > 0).collect();
        if grads.is_empty() {
            return None;
        }
        match clipping.kind {
            trainrec_types::ClippingKind::Norm => {
                let p = clipping.norm_type;
                let norm = |t: &Tensor| t.flatten(0, -1).linalg_norm(p, None::<&[i64]>, false, None::<Kind>);
                let total = norm(&Tensor::stack(&grads.iter().map(norm).collect::<Vec<_>>(), 0));
                let coef = ((&total + 1e-6).reciprocal() * clipping.max_gradient).clamp_max(1.0);
                for mut g in grads {
                    let _ = g.f_mul_(&coef).expect("a 0-dim factor multiplies any gradient");
                }
                Some(total.double_value(&[]))
            }
            trainrec_types::ClippingKind::Value => {
                let v = clipping.max_gradient;
                for mut g in grads {
                    let _ = g.clamp_(-v, v);
                }
                None
            }
        }
    }

    /// The learning rate of the next steps.
    pub fn lr(&self) -> f64 {
        match &self.rule {
            Rule::Sgd { lr, .. } | Rule::Adam { lr, .. } | Rule::Adagrad { lr, .. } => *lr,
        }
    }

    /// Sets the learning rate of the next steps (a learning-rate schedule's; PyTorch's
    /// `param_group["lr"] = lr`).
    pub fn set_lr(&mut self, lr: f64) {
        match &mut self.rule {
            Rule::Sgd { lr: l, .. } | Rule::Adam { lr: l, .. } | Rule::Adagrad { lr: l, .. } => *l = lr,
        }
    }

    /// Clears the gradients: SGD and Adam drop them (undefined, libtorch's `zero_grad()`), so a
    /// parameter that then gets no gradient is not stepped; Adagrad zeroes them.
    pub fn zero_grad(&mut self) {
        match &mut self.grad_reset {
            Some(o) => o.zero_grad(),
            None => {
                for p in self.params.iter_mut() {
                    p.zero_grad();
                }
            }
        }
    }

    /// Applies one update from the current gradients; parameters without a gradient are left
    /// alone (and their state too).
    pub fn step(&mut self) {
        let Self { params, rule, .. } = self;
        tch::no_grad(|| {
            for (i, p) in params.iter_mut().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                match rule {
                    Rule::Sgd { lr, momentum, weight_decay, buffers } => {
                        sgd_step(p, &g, &mut buffers[i], *lr, *momentum, *weight_decay)
                    }
                    Rule::Adam { lr, beta1, beta2, weight_decay, moments } => {
                        let m = moments[i].get_or_insert_with(|| AdamMoments {
                            step: 0,
                            exp_avg: p.zeros_like(),
                            exp_avg_sq: p.zeros_like(),
                        });
                        adam_step(p, &g, m, *lr, *beta1, *beta2, *weight_decay)
                    }
                    Rule::Adagrad { lr, weight_decay, sums } => {
                        let s = &mut sums[i];
                        if !adagrad_in_place(p, s, &g, *lr as f32, *weight_decay as f32) {
                            let g = decayed(&g, p, *weight_decay);
                            let _ = s.addcmul_(&g, &g);
                            let update = &g / (s.sqrt() + ADAGRAD_EPS) * *lr;
                            let _ = p.f_sub_(&update).expect("shapes match");
                        }
                    }
                }
            }
        })
    }

    /// The state parts this optimizer keeps per parameter.
    fn parts(&self) -> &'static [&'static str] {
        match &self.rule {
            Rule::Sgd { momentum, .. } if *momentum != 0.0 => &[MOMENTUM_BUFFER],
            Rule::Sgd { .. } => &[],
            Rule::Adam { .. } => &[STEP, EXP_AVG, EXP_AVG_SQ],
            Rule::Adagrad { .. } => &[SUM],
        }
    }

    /// The optimizer's state as named tensors (copies, in parameter order; names in the module
    /// docs): what [`DenseOptimizer::load_state`] restores. Empty for SGD without momentum;
    /// a parameter not stepped yet has no SGD or Adam entries.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let key = |i: usize, part: &str| format!("{}.{part}", self.names[i]);
        let mut out = Vec::new();
        match &self.rule {
            Rule::Sgd { buffers, .. } => {
                for (i, b) in buffers.iter().enumerate() {
                    if let Some(b) = b {
                        out.push((key(i, MOMENTUM_BUFFER), b.copy()));
                    }
                }
            }
            Rule::Adam { moments, .. } => {
                for (i, m) in moments.iter().enumerate() {
                    if let Some(m) = m {
                        out.push((key(i, STEP), Tensor::from_slice(&[m.step])));
                        out.push((key(i, EXP_AVG), m.exp_avg.copy()));
                        out.push((key(i, EXP_AVG_SQ), m.exp_avg_sq.copy()));
                    }
                }
            }
            Rule::Adagrad { sums, .. } => {
                for (i, s) in sums.iter().enumerate() {
                    out.push((key(i, SUM), s.copy()));
                }
            }
        }
        out
    }

    /// Replaces the optimizer's state with `state`, as [`DenseOptimizer::state`] returned it
    /// (any order; tensors on any device, floats of any precision, converted to the
    /// parameter's). Parameters with no entries start afresh (no momentum buffer, no Adam
    /// moments). Everything is checked before anything changes: an unknown or repeated name, a
    /// shape that is not the parameter's, a missing Adagrad sum or an Adam parameter with only
    /// some of its three parts is an error naming the entry.
    pub fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<(), OptimStateError> {
        let parts = self.parts();
        let index: HashMap<&str, usize> = self.names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
        let mut found: Vec<Vec<Option<&Tensor>>> = vec![vec![None; parts.len()]; self.params.len()];
        for (entry, t) in state {
            let unknown = || OptimStateError::Unknown { entry: entry.clone(), parts };
            let (var, part) = entry.rsplit_once('.').ok_or_else(unknown)?;
            let i = *index.get(var).ok_or_else(unknown)?;
            let j = parts.iter().position(|p| *p == part).ok_or_else(unknown)?;
            if found[i][j].is_some() {
                return Err(OptimStateError::Duplicate(entry.clone()));
            }
            let invalid = |reason: String| OptimStateError::Invalid { entry: entry.clone(), reason };
            if part == STEP {
                if t.numel() != 1 {
                    return Err(invalid(format!("a step count is one number, not shape {:?}", t.size())));
                }
                let step = t.f_double_value(&vec![0; t.dim()]).map_err(|e| invalid(e.to_string()))?;
                if !(step >= 0.0 && step.fract() == 0.0 && step < 2f64.powi(53)) {
                    return Err(invalid(format!("step {step} is not a non-negative integer")));
                }
            } else {
                if t.size() != self.params[i].size() {
                    return Err(OptimStateError::Shape {
                        entry: entry.clone(),
                        expected: self.params[i].size(),
                        found: t.size(),
                    });
                }
                if !t.is_floating_point() {
                    return Err(invalid(format!("a {:?} tensor, not floating point", t.kind())));
                }
            }
            found[i][j] = Some(t);
        }
        let name = |i: usize, part: &str| format!("{}.{part}", self.names[i]);
        // Complete sets only.
        for (i, f) in found.iter().enumerate() {
            let present = f.iter().filter(|t| t.is_some()).count();
            let required = matches!(self.rule, Rule::Adagrad { .. });
            if (required || present > 0) && present < parts.len() {
                let j = f.iter().position(Option::is_none).expect("one is missing");
                return Err(OptimStateError::Missing(name(i, parts[j])));
            }
        }
        // Copies in the parameters' type, device and layout, made before anything is replaced.
        let copy = |i: usize, j: usize| -> Result<Option<Tensor>, OptimStateError> {
            let Some(src) = found[i][j] else { return Ok(None) };
            let mut dst = self.params[i].zeros_like();
            tch::no_grad(|| dst.f_copy_(src))
                .map_err(|source| OptimStateError::Torch { entry: name(i, parts[j]), source })?;
            Ok(Some(dst))
        };
        let n = self.params.len();
        match &self.rule {
            Rule::Sgd { .. } if parts.is_empty() => {}
            Rule::Sgd { .. } => {
                let new = (0..n).map(|i| copy(i, 0)).collect::<Result<Vec<_>, _>>()?;
                if let Rule::Sgd { buffers, .. } = &mut self.rule {
                    *buffers = new;
                }
            }
            Rule::Adam { .. } => {
                let mut new = Vec::with_capacity(n);
                for (i, f) in found.iter().enumerate() {
                    new.push(match f[0] {
                        None => None,
                        Some(step) => Some(AdamMoments {
                            step: step.f_double_value(&vec![0; step.dim()]).expect("checked") as i64,
                            exp_avg: copy(i, 1)?.expect("checked"),
                            exp_avg_sq: copy(i, 2)?.expect("checked"),
                        }),
                    });
                }
                if let Rule::Adam { moments, .. } = &mut self.rule {
                    *moments = new;
                }
            }
            Rule::Adagrad { .. } => {
                let new = (0..n).map(|i| copy(i, 0).map(|t| t.expect("checked"))).collect::<Result<Vec<_>, _>>()?;
                if let Rule::Adagrad { sums, .. } = &mut self.rule {
                    *sums = new;
                }
            }
        }
        Ok(())
    }
}

/// One SGD step of parameter `p` with gradient `g` and momentum buffer `buf`.
fn sgd_step(p: &mut Tensor, g: &Tensor, buf: &mut Option<Tensor>, lr: f64, momentum: f64, weight_decay: f64) {
    let s = SgdScalars {
        neg_lr: -lr as f32,
        momentum: momentum as f32,
        weight_decay: weight_decay as f32,
        momentum_on: momentum != 0.0,
        first: buf.is_none(),
    };
    if !s.momentum_on {
        if !sgd_in_place(p, None, g, s) {
            let d_p = decayed(g, p, weight_decay);
            let _ = p.f_sub_(&(d_p * lr)).expect("shapes match");
        }
        return;
    }
    match buf {
        None => {
            let b = p.empty_like();
            if sgd_in_place(p, Some(&b), g, s) {
                *buf = Some(b);
            } else {
                // `buf = d_p`, a tensor of its own (never the gradient itself).
                let b = if weight_decay != 0.0 { decayed(g, p, weight_decay) } else { g.copy() };
                let _ = p.f_sub_(&(&b * lr)).expect("shapes match");
                *buf = Some(b);
            }
        }
        Some(b) => {
            if !sgd_in_place(p, Some(b), g, s) {
                let d_p = decayed(g, p, weight_decay);
                let _ = b.f_mul_scalar_(momentum).expect("a float buffer");
                let _ = b.f_add_(&d_p).expect("shapes match");
                let _ = p.f_sub_(&(&*b * lr)).expect("shapes match");
            }
        }
    }
}

/// One Adam step of parameter `p` with gradient `g` and moments `m`.
fn adam_step(p: &mut Tensor, g: &Tensor, m: &mut AdamMoments, lr: f64, beta1: f64, beta2: f64, weight_decay: f64) {
    m.step += 1;
    // As libtorch: `std::pow(beta, step)` in double.
    let t = m.step as f64;
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = lr / bias_correction1;
    let sqrt_bc2 = bias_correction2.sqrt();
    let s = AdamScalars {
        beta1: beta1 as f32,
        one_minus_beta1: (1.0 - beta1) as f32,
        beta2: beta2 as f32,
        one_minus_beta2: (1.0 - beta2) as f32,
        weight_decay: weight_decay as f32,
        sqrt_bias_correction2: sqrt_bc2 as f32,
        neg_step_size: -step_size as f32,
        eps: ADAM_EPS as f32,
    };
    if adam_in_place(p, &m.exp_avg, &m.exp_avg_sq, g, s) {
        return;
    }
    let g = decayed(g, p, weight_decay);
    let (exp_avg, exp_avg_sq) = (&mut m.exp_avg, &mut m.exp_avg_sq);
    let _ = exp_avg.f_mul_scalar_(beta1).expect("a float moment");
    let _ = exp_avg.f_add_(&(&g * (1.0 - beta1))).expect("shapes match");
    let _ = exp_avg_sq.f_mul_scalar_(beta2).expect("a float moment");
    let _ = exp_avg_sq.f_addcmul_(&(&g * (1.0 - beta2)), &g).expect("shapes match");
    let denom = exp_avg_sq.sqrt() / sqrt_bc2 + ADAM_EPS;
    let _ = p.f_addcdiv_(&(&*exp_avg * -step_size), &denom).expect("shapes match");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adagrad_matches_the_formula() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, -2.0]));
        let mut opt = DenseOptimizer::new(&vs, &DenseOptimizerConfig::Adagrad { lr: 0.5, weight_decay: 0.0 }).unwrap();
        for _ in 0..2 {
            opt.zero_grad();
            (&w * &w).sum(tch::Kind::Float).backward(); // grad = 2w
            opt.step();
        }
        // Float64 recomputation of two Adagrad steps.
        let mut want = [1.0f64, -2.0];
        let mut sum = [0.0f64; 2];
        for _ in 0..2 {
            for i in 0..2 {
                let g = 2.0 * want[i];
                sum[i] += g * g;
                want[i] -= 0.5 * g / (sum[i].sqrt() + 1e-10);
            }
        }
        let got: Vec<f32> = Vec::try_from(&w).unwrap();
        for i in 0..2 {
            assert!((got[i] as f64 - want[i]).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn adagrad_with_weight_decay_matches_the_formula_on_both_paths() {
        let _rng = crate::seeded(0);
        // Float parameters take the single-pass path, double ones the tensor path.
        for kind in [tch::Kind::Float, tch::Kind::Double] {
            let mut vs = nn::VarStore::new(tch::Device::Cpu);
            vs.set_kind(kind);
            let init = [0.3f64, -1.5, 2.0, 0.0];
            let w = vs.root().var_copy("w", &Tensor::from_slice(&init).to_kind(kind));
            assert_eq!(w.kind(), kind);
            let cfg = DenseOptimizerConfig::Adagrad { lr: 0.1, weight_decay: 0.01 };
            let mut opt = DenseOptimizer::new(&vs, &cfg).unwrap();
            let target = Tensor::from_slice(&[1.0f64, 1.0, -1.0, 0.5]).to_kind(kind);
            for _ in 0..3 {
                opt.zero_grad();
                (&w - &target).square().sum(kind).backward(); // grad = 2 (w - t)
                opt.step();
            }
            let t = [1.0f64, 1.0, -1.0, 0.5];
            let (mut want, mut sum) = (init, [0.0f64; 4]);
            for _ in 0..3 {
                for i in 0..4 {
                    let g = 2.0 * (want[i] - t[i]) + 0.01 * want[i];
                    sum[i] += g * g;
                    want[i] -= 0.1 * g / (sum[i].sqrt() + 1e-10);
                }
            }
            let got: Vec<f64> = Vec::try_from(&w.to_kind(tch::Kind::Double)).unwrap();
            for i in 0..4 {
                assert!((got[i] - want[i]).abs() < 1e-6, "{kind:?}: {got:?} vs {want:?}");
            }
        }
    }

    /// Deterministic values in [-1, 1].
    fn values(n: usize, seed: f64) -> Vec<f64> {
        (0..n).map(|i| (seed + 0.37 * i as f64).sin()).collect()
    }

    /// A small MLP: `mlp.w1` `[6, 9]` (54 elements: ATen's vector loop and its scalar tail),
    /// `mlp.w2` `[9, 1]`, and `extra` `[3]`, which takes part in the loss only when asked.
    struct Model {
        vs: nn::VarStore,
        w1: Tensor,
        w2: Tensor,
        extra: Tensor,
        x: Tensor,
        y: Tensor,
        kind: Kind,
    }

    impl Model {
        fn new(kind: Kind) -> Self {
            let mut vs = nn::VarStore::new(tch::Device::Cpu);
            vs.set_kind(kind);
            let t = |v: Vec<f64>, shape: &[i64]| Tensor::from_slice(&v).reshape(shape).to_kind(kind);
            let root = vs.root();
            let w1 = (&root / "mlp").var_copy("w1", &t(values(54, 0.1), &[6, 9]));
            let w2 = (&root / "mlp").var_copy("w2", &t(values(9, 2.0), &[9, 1]));
            let extra = root.var_copy("extra", &t(values(3, 5.0), &[3]));
            assert_eq!((w1.kind(), w2.kind(), extra.kind()), (kind, kind, kind));
            let x = t(values(8 * 6, 7.0), &[8, 6]);
            let y = t(values(8, 9.0), &[8, 1]);
            Self { vs, w1, w2, extra, x, y, kind }
        }

        /// Sets the gradients of a squared-error loss (and of `extra`'s, when `with_extra`).
        fn backward(&self, with_extra: bool) {
            let out = self.x.mm(&self.w1).tanh().mm(&self.w2);
            let mut loss = (out - &self.y).square().mean(self.kind);
            if with_extra {
                loss += (&self.extra * &self.extra).sum(self.kind) * 0.5;
            }
            loss.backward();
        }

        fn params(&self) -> Vec<Vec<f64>> {
            [&self.w1, &self.w2, &self.extra]
                .iter()
                .map(|t| Vec::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap())
                .collect()
        }
    }

    fn configs() -> Vec<DenseOptimizerConfig> {
        let sgd = |momentum, weight_decay| DenseOptimizerConfig::Sgd { lr: 0.1, momentum, weight_decay };
        let adam = |weight_decay| DenseOptimizerConfig::Adam { lr: 0.05, beta1: 0.9, beta2: 0.999, weight_decay };
        vec![sgd(0.0, 0.0), sgd(0.0, 0.01), sgd(0.9, 0.0), sgd(0.9, 0.01), adam(0.0), adam(0.01)]
    }

    /// libtorch's own optimizer for `config`.
    fn torch_optimizer(vs: &nn::VarStore, config: &DenseOptimizerConfig) -> nn::Optimizer {
        match *config {
            DenseOptimizerConfig::Sgd { lr, momentum, weight_decay } => {
                nn::Sgd { momentum, dampening: 0.0, wd: weight_decay, nesterov: false }.build(vs, lr).unwrap()
            }
            DenseOptimizerConfig::Adam { lr, beta1, beta2, weight_decay } => {
                nn::Adam { beta1, beta2, wd: weight_decay, eps: 1e-8, amsgrad: false }.build(vs, lr).unwrap()
            }
            DenseOptimizerConfig::Adagrad { .. } => unreachable!("tch has no Adagrad"),
        }
    }

    #[test]
    fn sgd_and_adam_match_libtorch_on_both_paths() {
        let mut worst = (0.0f64, String::new());
        let mut differing = [0usize; 2]; // float, double
        for kind in [Kind::Float, Kind::Double] {
            for config in configs() {
                let (ours, theirs) = (Model::new(kind), Model::new(kind));
                let mut opt = DenseOptimizer::new(&ours.vs, &config).unwrap();
                let mut torch = torch_optimizer(&theirs.vs, &config);
                for step in 0..5 {
                    // `extra` gets no gradient on the first two steps: both skip it.
                    opt.zero_grad();
                    ours.backward(step >= 2);
                    opt.step();
                    torch.zero_grad();
                    theirs.backward(step >= 2);
                    torch.step();
                }
                let (got, want) = (ours.params(), theirs.params());
                let init = Model::new(kind).params();
                for v in 0..3 {
                    for i in 0..got[v].len() {
                        let (a, b) = (got[v][i], want[v][i]);
                        let rel = (a - b).abs() / b.abs().max(1e-3);
                        assert!(rel <= 1e-6, "{kind:?} {config:?}: variable {v}[{i}]: {a} vs libtorch {b}");
                        differing[usize::from(kind == Kind::Double)] += usize::from(a.to_bits() != b.to_bits());
                        if rel > worst.0 {
                            worst = (rel, format!("{kind:?} {config:?} variable {v}[{i}]"));
                        }
                        // The parameters did move.
                        assert!((b - init[v][i]).abs() > 1e-6, "{config:?}: variable {v}[{i}] did not move");
                    }
                }
            }
        }
        eprintln!(
            "largest relative deviation from libtorch: {:e} ({}); values not bit-equal: {} float, {} double",
            worst.0, worst.1, differing[0], differing[1]
        );
    }

    /// The state as plain values, sorted by name.
    fn state_values(opt: &DenseOptimizer) -> Vec<(String, Vec<f64>)> {
        let mut s: Vec<(String, Vec<f64>)> = opt
            .state()
            .into_iter()
            .map(|(n, t)| (n, Vec::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap()))
            .collect();
        s.sort_by(|a, b| a.0.cmp(&b.0));
        s
    }

    #[test]
    fn state_round_trips_exactly() {
        let mut all = configs();
        all.push(DenseOptimizerConfig::Adagrad { lr: 0.1, weight_decay: 0.01 });
        for kind in [Kind::Float, Kind::Double] {
            for config in &all {
                let a = Model::new(kind);
                let mut opt_a = DenseOptimizer::new(&a.vs, config).unwrap();
                for _ in 0..3 {
                    opt_a.zero_grad();
                    a.backward(false); // `extra` not stepped yet: no SGD/Adam state for it
                    opt_a.step();
                }
                let state = opt_a.state();
                let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
                let want: &[&str] = match config {
                    DenseOptimizerConfig::Sgd { momentum, .. } if *momentum == 0.0 => &[],
                    DenseOptimizerConfig::Sgd { .. } => &["mlp.w1.momentum_buffer", "mlp.w2.momentum_buffer"],
                    DenseOptimizerConfig::Adam { .. } => &[
                        "mlp.w1.step",
                        "mlp.w1.exp_avg",
                        "mlp.w1.exp_avg_sq",
                        "mlp.w2.step",
                        "mlp.w2.exp_avg",
                        "mlp.w2.exp_avg_sq",
                    ],
                    DenseOptimizerConfig::Adagrad { .. } => &["mlp.w1.sum", "mlp.w2.sum", "extra.sum"],
                };
                assert_eq!(names, want, "{config:?}");
                if let DenseOptimizerConfig::Adam { .. } = config {
                    assert_eq!(state[0].1.kind(), Kind::Int64);
                    assert_eq!(state[0].1.int64_value(&[0]), 3);
                }

                // B: same variable values, A's state; C: same values, fresh state.
                let (b, c) = (Model::new(kind), Model::new(kind));
                let (mut vs_b, mut vs_c) = (b.vs, c.vs);
                vs_b.copy(&a.vs).unwrap();
                vs_c.copy(&a.vs).unwrap();
                let b = Model { vs: vs_b, ..b };
                let c = Model { vs: vs_c, ..c };
                let mut opt_b = DenseOptimizer::new(&b.vs, config).unwrap();
                opt_b.load_state(&state).unwrap();
                assert_eq!(state_values(&opt_b), state_values(&opt_a), "{config:?}");
                let mut opt_c = DenseOptimizer::new(&c.vs, config).unwrap();
                for _ in 0..3 {
                    for (m, opt) in [(&a, &mut opt_a), (&b, &mut opt_b), (&c, &mut opt_c)] {
                        opt.zero_grad();
                        m.backward(true);
                        opt.step();
                    }
                }
                let (pa, pb) = (a.params(), b.params());
                for v in 0..3 {
                    for i in 0..pa[v].len() {
                        assert_eq!(pa[v][i].to_bits(), pb[v][i].to_bits(), "{kind:?} {config:?}: variable {v}[{i}]");
                    }
                }
                assert_eq!(state_values(&opt_b), state_values(&opt_a), "{config:?}");
                // Without the state the run differs (plain SGD has none to lose).
                if !want.is_empty() {
                    assert_ne!(c.params(), pa, "{kind:?} {config:?}: the state made no difference");
                }
            }
        }
    }

    #[test]
    fn bad_states_are_refused_and_change_nothing() {
        let m = Model::new(Kind::Float);
        let adam = DenseOptimizerConfig::Adam { lr: 0.05, beta1: 0.9, beta2: 0.999, weight_decay: 0.0 };
        let mut opt = DenseOptimizer::new(&m.vs, &adam).unwrap();
        opt.zero_grad();
        m.backward(true);
        opt.step();
        let good = opt.state();
        let before = state_values(&opt);
        let with = |name: &str, t: Tensor| {
            let mut s: Vec<(String, Tensor)> = good.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            match s.iter_mut().find(|(n, _)| n == name) {
                Some(e) => e.1 = t,
                None => s.push((name.to_string(), t)),
            }
            s
        };
        let err = |s: &[(String, Tensor)], opt: &mut DenseOptimizer| opt.load_state(s).unwrap_err().to_string();

        let e = err(&with("mlp.w1.exp_avg", Tensor::zeros([9, 6], (Kind::Float, tch::Device::Cpu))), &mut opt);
        assert!(e.contains("`mlp.w1.exp_avg`") && e.contains("[9, 6]") && e.contains("[6, 9]"), "{e}");
        let e = err(&with("mlp.w3.exp_avg", Tensor::zeros([6, 9], (Kind::Float, tch::Device::Cpu))), &mut opt);
        assert!(e.contains("unknown entry `mlp.w3.exp_avg`"), "{e}");
        let e = err(&with("mlp.w1.momentum_buffer", Tensor::zeros([6, 9], (Kind::Float, tch::Device::Cpu))), &mut opt);
        assert!(e.contains("unknown entry `mlp.w1.momentum_buffer`"), "{e}");
        let e = err(&with("mlp.w1.step", Tensor::from_slice(&[-1i64])), &mut opt);
        assert!(e.contains("`mlp.w1.step`"), "{e}");
        let e = err(&with("mlp.w1.exp_avg", Tensor::zeros([6, 9], (Kind::Int64, tch::Device::Cpu))), &mut opt);
        assert!(e.contains("`mlp.w1.exp_avg`") && e.contains("floating point"), "{e}");
        let partial: Vec<(String, Tensor)> =
            good.iter().filter(|(n, _)| n != "extra.exp_avg_sq").map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        let e = err(&partial, &mut opt);
        assert!(e.contains("`extra.exp_avg_sq` is missing"), "{e}");
        let mut twice: Vec<(String, Tensor)> = good.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        twice.push(("mlp.w2.exp_avg".into(), good[4].1.shallow_clone()));
        assert!(err(&twice, &mut opt).contains("`mlp.w2.exp_avg` is given twice"));
        // Nothing changed, and the good state still loads.
        assert_eq!(state_values(&opt), before);
        opt.load_state(&good).unwrap();
        assert_eq!(state_values(&opt), before);

        // Another optimizer's state: refused by name.
        let mut sgd =
            DenseOptimizer::new(&m.vs, &DenseOptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, weight_decay: 0.0 })
                .unwrap();
        let e = sgd.load_state(&good).unwrap_err().to_string();
        assert!(e.contains("unknown entry `mlp.w1.step`") && e.contains("momentum_buffer"), "{e}");
        // Adagrad needs every sum.
        let mut adagrad =
            DenseOptimizer::new(&m.vs, &DenseOptimizerConfig::Adagrad { lr: 0.1, weight_decay: 0.0 }).unwrap();
        assert!(adagrad.load_state(&[]).unwrap_err().to_string().contains("`mlp.w1.sum` is missing"));
        // An empty state is SGD's and resets Adam.
        sgd.load_state(&[]).unwrap();
        opt.load_state(&[]).unwrap();
        assert!(opt.state().is_empty());
    }
}
