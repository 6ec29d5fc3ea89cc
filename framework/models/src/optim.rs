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
                    let g = if *weight_decay != 0.0 { &g + &*p * *weight_decay } else { g };
                    let _ = s.addcmul_(&g, &g);
                    let update = &g / (s.sqrt() + 1e-10) * *lr;
                    let _ = p.f_sub_(&update).expect("shapes match");
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
}
