//! Dense optimizers over a tch `VarStore`.

use tch::{Tensor, nn, nn::OptimizerConfig};
use trainrec_recipe::DenseOptimizerConfig;

/// A dense optimizer: libtorch's own for SGD and Adam, Adagrad written here (tch has none),
/// with PyTorch's defaults (eps 1e-10, no lr decay, zero initial accumulator).
pub enum DenseOptimizer {
    /// A libtorch optimizer.
    Torch(nn::Optimizer),
    /// Adagrad over the store's trainable variables.
    Adagrad {
        /// Trainable variables.
        params: Vec<Tensor>,
        /// Running sums of squared gradients.
        sums: Vec<Tensor>,
        /// Learning rate.
        lr: f64,
        /// L2 penalty.
        weight_decay: f64,
    },
}

/// PyTorch's Adagrad default `eps`.
const ADAGRAD_EPS: f64 = 1e-10;

/// One Adagrad step in a single pass over the parameter, its gradient and its sum, when all
/// three are contiguous CPU float tensors of one size (else false, nothing done): the tensor
/// form reads and writes each of them several times.
fn adagrad_in_place(p: &Tensor, sum: &Tensor, g: &Tensor, lr: f32, weight_decay: f32) -> bool {
    let cpu_f32 = |t: &Tensor| t.device() == tch::Device::Cpu && t.kind() == tch::Kind::Float && t.is_contiguous();
    let n = p.numel();
    if !(cpu_f32(p) && cpu_f32(sum) && cpu_f32(g)) || sum.numel() != n || g.numel() != n || n == 0 {
        return false;
    }
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

impl DenseOptimizer {
    /// Builds the optimizer for the trainable variables of `vs`.
    pub fn new(vs: &nn::VarStore, config: &DenseOptimizerConfig) -> Result<Self, tch::TchError> {
        Ok(match *config {
            DenseOptimizerConfig::Sgd { lr, momentum, weight_decay } => {
                Self::Torch(nn::Sgd { momentum, dampening: 0.0, wd: weight_decay, nesterov: false }.build(vs, lr)?)
            }
            DenseOptimizerConfig::Adam { lr, beta1, beta2, weight_decay } => {
                Self::Torch(nn::Adam { beta1, beta2, wd: weight_decay, eps: 1e-8, amsgrad: false }.build(vs, lr)?)
            }
            DenseOptimizerConfig::Adagrad { lr, weight_decay } => {
                let params = vs.trainable_variables();
                let sums = params.iter().map(Tensor::zeros_like).collect();
                Self::Adagrad { params, sums, lr, weight_decay }
            }
        })
    }

    /// Clears the gradients.
    pub fn zero_grad(&mut self) {
        match self {
            Self::Torch(o) => o.zero_grad(),
            Self::Adagrad { params, .. } => {
                for p in params.iter_mut() {
                    p.zero_grad();
                }
            }
        }
    }

    /// Applies one update from the current gradients.
    pub fn step(&mut self) {
        match self {
            Self::Torch(o) => o.step(),
            Self::Adagrad { params, sums, lr, weight_decay } => tch::no_grad(|| {
                for (p, s) in params.iter_mut().zip(sums.iter_mut()) {
                    let g = p.grad();
                    if !g.defined() {
                        continue;
                    }
                    if !adagrad_in_place(p, s, &g, *lr as f32, *weight_decay as f32) {
                        let g = if *weight_decay != 0.0 { &g + &*p * *weight_decay } else { g };
                        let _ = s.addcmul_(&g, &g);
                        let update = &g / (s.sqrt() + ADAGRAD_EPS) * *lr;
                        let _ = p.f_sub_(&update).expect("shapes match");
                    }
                }
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adagrad_matches_the_formula() {
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
        // Float parameters take the single-pass path, double ones the tensor path.
        for kind in [tch::Kind::Float, tch::Kind::Double] {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let init = [0.3f64, -1.5, 2.0, 0.0];
            let w = vs.root().var_copy("w", &Tensor::from_slice(&init).to_kind(kind));
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
}
