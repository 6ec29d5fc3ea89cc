//! DLRM (Naumov et al. 2019) as TorchRec builds it: a dense-arch MLP, pairwise dot
//! interaction of the dense output with every pooled embedding, and an over-arch MLP.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tch::{Tensor, nn, nn::Module};
use trainrec_types::Diagnostic;

use crate::mlp::{self, mlp_parameters};
use crate::script::{ScriptModule, Vars};
use crate::{DenseModel, ModelError, ModelInputs};

/// DLRM as TorchRec builds it: a dense-arch MLP, pairwise dot interactions with every pooled
/// embedding, and an over-arch MLP. `[model]` with `kind = "dlrm"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DlrmConfig {
    /// Layer sizes of the dense-arch MLP over the dense features (ReLU after each). The last
    /// size must equal the embedding dim of every table.
    pub dense_arch: Vec<usize>,
    /// Layer sizes of the over-arch MLP (ReLU after each but the last). The last size must equal
    /// the number of tasks (1 for a single task): one logit per task.
    pub over_arch: Vec<usize>,
}

/// The DLRM dense part.
pub struct Dlrm {
    dense: nn::Sequential,
    over: nn::Sequential,
    num_sparse: i64,
    dim: i64,
    /// Flat positions `i * (F + 1) + j` (`i < j`) of the pairs in a sample's `[F + 1, F + 1]`
    /// Gram matrix of `[d, e_0, .., e_{F-1}]`: TorchRec's `triu_indices(F + 1, F + 1, 1)`.
    upper: Tensor,
    /// The mirrored positions `j * (F + 1) + i` of the same pairs.
    lower: Tensor,
}

unsafe extern "C" {
    fn trainrec_dlrm_interaction(
        d: *const torch_sys::C_tensor,
        emb: *const torch_sys::C_tensor,
        out: *mut *mut torch_sys::C_tensor,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> i32;
}

/// DLRM's interaction `[d, <x_i, x_j> for i < j]` of `d` `[B, D]` and `emb` `[B, F, D]` (CPU
/// tensors of one floating kind) through `csrc/interaction.cpp`: one autograd function whose
/// backward is one batched product; libtorch's message when it throws.
pub(crate) fn interaction_cpu(d: &Tensor, emb: &Tensor) -> Result<Tensor, String> {
    let mut out = std::ptr::null_mut();
    let mut err = [0 as std::ffi::c_char; 512];
    // SAFETY: `d` and `emb` are live tensors for the whole call, `err` is writable for its
    // length, and on success `out` is a tensor the C++ side allocated for us to own.
    let rc = unsafe { trainrec_dlrm_interaction(d.as_ptr(), emb.as_ptr(), &mut out, err.as_mut_ptr(), err.len()) };
    if rc != 0 || out.is_null() {
        // SAFETY: the C++ side wrote a NUL-terminated message into `err` (snprintf).
        return Err(unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned());
    }
    // SAFETY: `out` is a heap tensor handed over by the C++ side, owned by no one else.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `positions` `[P]` as a `[batch, P]` gather index (a stride-0 view, no copy): a gather along
/// the columns is about twice as fast as `index_select` on the CPU, four times in bf16.
fn gather_index(positions: &Tensor, batch: i64) -> Tensor {
    positions.unsqueeze(0).expand([batch, -1], false)
}

/// [`mlp::mlp`] (same layers and parameter names) with each ReLU applied in place on its
/// layer's fresh output: one activation-sized allocation and write fewer per layer, forward
/// and backward (a linear layer's backward does not read its output).
fn mlp_inplace(vs: &nn::Path, input: usize, sizes: &[usize], relu_last: bool) -> nn::Sequential {
    let mut seq = nn::seq();
    let mut prev = input as i64;
    for (i, &size) in sizes.iter().enumerate() {
        seq = seq.add(nn::linear(vs / format!("layer{i}"), prev, size as i64, mlp::torch_linear(prev)));
        if relu_last || i + 1 < sizes.len() {
            seq = seq.add_fn(|x| x.shallow_clone().relu_());
        }
        prev = size as i64;
    }
    seq
}

impl Dlrm {
    /// Builds the parameters under `vs`; `config` must have passed [`crate::TypedModel::check`].
    pub fn new(vs: &nn::Path, config: &DlrmConfig, num_dense: usize, num_sparse: usize) -> Self {
        let dim = *config.dense_arch.last().unwrap_or(&0) as i64;
        let n = num_sparse as i64 + 1;
        let interactions = (n * (n - 1) / 2) as usize;
        let (mut upper, mut lower) = (Vec::with_capacity(interactions), Vec::with_capacity(interactions));
        for i in 0..n {
            for j in i + 1..n {
                upper.push(i * n + j);
                lower.push(j * n + i);
            }
        }
        let index = |v: &[i64]| Tensor::from_slice(v).to_device(vs.device());
        Self {
            dense: mlp_inplace(&(vs / "dense_arch"), num_dense, &config.dense_arch, true),
            over: mlp_inplace(&(vs / "over_arch"), dim as usize + interactions, &config.over_arch, false),
            num_sparse: num_sparse as i64,
            dim,
            upper: index(&upper),
            lower: index(&lower),
        }
    }

    /// TorchRec's `InteractionArch`: `[d, <x_i, x_j> for i < j]` over `x = [d, e_0, ..]`, the
    /// pairs in `triu_indices` order.
    ///
    /// Under bf16 autocast the dense arch's output `d` is bf16; the pooled embeddings (fp32)
    /// are cast to it before the concatenation, which then moves half the bytes and hands the
    /// batched product bf16 operands (autocast would cast the fp32 concatenation, twice: once
    /// per factor).
    ///
    /// On the CPU the whole interaction is one autograd function written for it
    /// (`csrc/interaction.cpp`, [`interaction_cpu`]): the same batched products as
    /// [`Self::interaction_ops`], with plain copies where those ops gather and scatter
    /// (libtorch's bf16 gathers and scatters go through fp32 buffers). Its pairs are the Gram
    /// matrix's upper entries exactly, as TorchRec's; the ops' `upper + lower - upper` can
    /// differ from them in the last bit where the product kernel rounds a mirrored pair of
    /// entries differently. The gradients are the same bit for bit.
    fn interaction(&self, d: &Tensor, sparse: &Tensor) -> Tensor {
        let batch = d.size()[0];
        let emb = sparse.view([batch, self.num_sparse, self.dim]);
        let emb = if emb.kind() == d.kind() { emb } else { emb.to_kind(d.kind()) };
        if d.device() == tch::Device::Cpu && d.is_floating_point() {
            // A libtorch error there would be one these tensor ops raise too: they report it.
            if let Ok(x) = interaction_cpu(d, &emb) {
                return x;
            }
        }
        self.interaction_ops(d, &emb)
    }

    /// [`Self::interaction`] in libtorch's ops (CUDA tensors), `emb` `[B, F, D]` of `d`'s kind.
    ///
    /// The Gram matrix `X X^T` is one batched product. With gradients, its second factor is
    /// detached and the output reads both mirrored entries, `upper + lower - upper.detach()`
    /// (the value of one dot): the backward is then a single batched product `(G + G^T) X`
    /// instead of autograd's two, whose transposed half also costs a strided sum.
    fn interaction_ops(&self, d: &Tensor, emb: &Tensor) -> Tensor {
        let batch = d.size()[0];
        let n = self.num_sparse + 1;
        let all = Tensor::cat(&[&d.unsqueeze(1), emb], 1);
        let upper = gather_index(&self.upper, batch);
        let pairs = if all.requires_grad() {
            let gram = all.bmm(&all.detach().transpose(1, 2)).view([batch, n * n]);
            let lower = gather_index(&self.lower, batch);
            gram.gather(1, &upper, false) + gram.gather(1, &lower, false) - gram.detach().gather(1, &upper, false)
        } else {
            all.bmm(&all.transpose(1, 2)).view([batch, n * n]).gather(1, &upper, false)
        };
        Tensor::cat(&[d, &pairs], 1)
    }
}

impl DenseModel for Dlrm {
    fn forward(&self, dense: &Tensor, sparse: &Tensor, _train: bool) -> Tensor {
        let d = self.dense.forward(dense);
        let x = self.interaction(&d, sparse);
        self.over.forward(&x)
    }

    /// The embeddings only meet the interaction's batched product.
    fn pooled_in_compute_precision(&self) -> bool {
        true
    }

    fn torchscript(&self, vars: &Vars, m: &mut ScriptModule) -> Result<(), ModelError> {
        let mut body = Vec::new();
        let d = m.mlp(&mut body, vars, "dense_arch", "dense", true)?;
        let upper = m.tensor("dlrm_upper", &self.upper)?;
        let (f, dim, n) = (self.num_sparse, self.dim, self.num_sparse + 1);
        body.push(format!("    b = {d}.size(0)"));
        body.push(format!("    xs = torch.cat([torch.unsqueeze({d}, 1), torch.reshape(sparse, [b, {f}, {dim}])], 1)"));
        body.push(format!("    gram = torch.reshape(torch.bmm(xs, torch.transpose(xs, 1, 2)), [b, {}])", n * n));
        body.push(format!("    x = torch.cat([{d}, torch.index_select(gram, 1, {upper})], 1)"));
        let out = m.mlp(&mut body, vars, "over_arch", "x", false)?;
        m.method(format!(
            "def dense_forward(self, dense: Tensor, sparse: Tensor) -> Tensor:\n{}\n    return {out}\n",
            body.join("\n")
        ));
        Ok(())
    }
}

/// Registers DLRM as `kind = "dlrm"`, through the same typed API a plugin uses.
pub type DlrmFactory = crate::TypedModelFactory<Dlrm>;

impl crate::TypedModel for Dlrm {
    type Config = DlrmConfig;
    const KIND: &'static str = "dlrm";

    fn check(cfg: &DlrmConfig, inputs: &ModelInputs) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        mlp::check_layer_sizes("dense_arch", &cfg.dense_arch, 1, None, &mut out);
        mlp::check_layer_sizes("over_arch", &cfg.over_arch, 1, None, &mut out);
        mlp::check_last_is_num_tasks("over_arch", &cfg.over_arch, inputs.num_tasks, &mut out);
        if let Some(&dim) = cfg.dense_arch.last() {
            mlp::check_dims_match_dense_arch("DLRM", dim, inputs, &mut out);
        }
        mlp::check_has_dense("DLRM", inputs, &mut out);
        out
    }

    fn build(vs: &nn::Path, cfg: &DlrmConfig, inputs: &ModelInputs) -> Result<Self, ModelError> {
        Ok(Dlrm::new(vs, cfg, inputs.num_dense, inputs.sparse.len()))
    }
    fn parameters(cfg: &DlrmConfig, inputs: &ModelInputs) -> Option<u128> {
        let dim = *cfg.dense_arch.last().unwrap_or(&0);
        let n = inputs.sparse.len() + 1;
        let over_in = dim + n * (n - 1) / 2;
        Some(mlp_parameters(inputs.num_dense, &cfg.dense_arch) + mlp_parameters(over_in, &cfg.over_arch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelFactory;
    use trainrec_types::KeyPath;

    fn inputs(dims: &[usize]) -> ModelInputs {
        ModelInputs {
            num_dense: 3,
            sparse: dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
            sparse_dim_keys: (0..dims.len()).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
            num_tasks: 1,
            sequences: Vec::new(),
        }
    }

    #[test]
    fn interaction_matches_a_hand_computation() {
        let _rng = crate::seeded(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmConfig { dense_arch: vec![2], over_arch: vec![1] };
        let m = Dlrm::new(&vs.root(), &cfg, 3, 2);
        let dense = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).view([1, 3]);
        let sparse = Tensor::from_slice(&[1.0f32, 0.0, 0.5, 2.0]).view([1, 4]);
        // Recompute by hand: d = relu(W x + b); features [d, e0, e1]; dots (d.e0, d.e1, e0.e1).
        let d = m.dense.forward(&dense);
        let dv: Vec<f32> = Vec::try_from(d.view([-1])).unwrap();
        let e0 = [1.0f32, 0.0];
        let e1 = [0.5f32, 2.0];
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let x = Tensor::from_slice(&[dv[0], dv[1], dot(&dv, &e0), dot(&dv, &e1), dot(&e0, &e1)]).view([1, 5]);
        let want = m.over.forward(&x).double_value(&[0, 0]);
        let got = m.forward(&dense, &sparse, false).double_value(&[0, 0]);
        assert!((want - got).abs() < 1e-6, "{want} vs {got}");
    }

    #[test]
    fn interaction_gradients_match_plain_autograd() {
        // The detached-factor Gram matrix must give the gradients of the textbook form
        // (concatenate, full bmm, triu gather) with respect to the embeddings and the dense arch.
        let _rng = crate::seeded(1);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmConfig { dense_arch: vec![8, 4], over_arch: vec![6, 1] };
        let m = Dlrm::new(&vs.root(), &cfg, 3, 5);
        let dense = Tensor::rand([7, 3], (tch::Kind::Float, tch::Device::Cpu));
        let emb = Tensor::randn([7, 20], (tch::Kind::Float, tch::Device::Cpu));
        let grads = |reference: bool| {
            let sparse = emb.detach().set_requires_grad(true);
            let logits = if reference {
                let d = m.dense.forward(&dense);
                let all = Tensor::cat(&[d.unsqueeze(1), sparse.view([7, 5, 4])], 1);
                let dots = all.bmm(&all.transpose(1, 2));
                let t = Tensor::triu_indices(6, 6, 1, (tch::Kind::Int64, tch::Device::Cpu));
                let pairs = dots.index(&[None, Some(&t.get(0)), Some(&t.get(1))]);
                m.over.forward(&Tensor::cat(&[d, pairs], 1))
            } else {
                m.forward(&dense, &sparse, true)
            };
            for v in vs.trainable_variables() {
                let mut v = v;
                v.zero_grad();
            }
            (logits.square().sum(tch::Kind::Float)).backward();
            let mut out: Vec<Vec<f32>> = vec![Vec::try_from(sparse.grad().view([-1])).unwrap()];
            for v in vs.trainable_variables() {
                out.push(Vec::try_from(v.grad().view([-1])).unwrap());
            }
            (Vec::<f32>::try_from(logits.view([-1])).unwrap(), out)
        };
        let (want_l, want) = grads(true);
        let (got_l, got) = grads(false);
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + x.abs()));
        assert!(close(&want_l, &got_l), "{want_l:?} vs {got_l:?}");
        for (w, g) in want.iter().zip(&got) {
            assert!(close(w, g), "{w:?} vs {g:?}");
        }
        // Eval mode (no grad) gives the same logits.
        let eval: Vec<f32> = tch::no_grad(|| Vec::try_from(m.forward(&dense, &emb, false).view([-1])).unwrap());
        assert!(close(&want_l, &eval), "{want_l:?} vs {eval:?}");
    }

    /// Under bf16 autocast the model computes in bf16 (bf16 logits) and tracks the fp32 model:
    /// logits and every gradient (the embeddings' and each fp32 parameter's) agree to bf16's
    /// precision, the parameters' gradients stay fp32.
    #[test]
    fn bf16_autocast_tracks_fp32() {
        let _rng = crate::seeded(4);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmConfig { dense_arch: vec![32, 16], over_arch: vec![32, 1] };
        let m = Dlrm::new(&vs.root(), &cfg, 5, 6);
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        let (dense, emb) = (Tensor::rand([64, 5], opts), Tensor::randn([64, 6 * 16], opts) * 0.3);
        let run = |precision| {
            let sparse = emb.detach().set_requires_grad(true);
            let logits = crate::Autocast::run(precision, tch::Device::Cpu, || m.forward(&dense, &sparse, true));
            let kind = logits.kind();
            for v in vs.trainable_variables() {
                let mut v = v;
                v.zero_grad();
            }
            let logits = logits.to_kind(tch::Kind::Float);
            logits.square().sum(tch::Kind::Float).backward();
            let mut grads = vec![sparse.grad()];
            // Copies: zero_grad clears the same gradient tensors in place on the next run.
            grads.extend(vs.trainable_variables().iter().map(|v| v.grad().copy()));
            (kind, logits, grads)
        };
        let (k32, l32, g32) = run(trainrec_types::DensePrecision::Fp32);
        let (k16, l16, g16) = run(trainrec_types::DensePrecision::Bf16);
        assert_eq!((k32, k16), (tch::Kind::Float, tch::Kind::BFloat16));
        let rel = |a: &Tensor, b: &Tensor| {
            let scale = a.abs().max().double_value(&[]).max(1e-12);
            (a - b).abs().max().double_value(&[]) / scale
        };
        assert!(rel(&l32, &l16) < 0.03, "logits differ by {}", rel(&l32, &l16));
        for (i, (a, b)) in g32.iter().zip(&g16).enumerate() {
            assert_eq!(b.kind(), tch::Kind::Float, "gradient {i}");
            assert!(rel(a, b) < 0.05, "gradient {i} differs by {}", rel(a, b));
        }
    }

    #[test]
    fn the_cpu_interaction_gives_torchrecs_pairs_and_the_same_gradients() {
        let _rng = crate::seeded(5);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmConfig { dense_arch: vec![16], over_arch: vec![1] };
        let m = Dlrm::new(&vs.root(), &cfg, 3, 7);
        for kind in [tch::Kind::Float, tch::Kind::BFloat16] {
            let opts = (kind, tch::Device::Cpu);
            let (d, emb) = (Tensor::randn([33, 16], opts), Tensor::randn([33, 7, 16], opts));
            let upstream = Tensor::randn([33, 16 + 28], opts);
            let run = |fast: bool| {
                let (d, emb) = (d.detach().set_requires_grad(true), emb.detach().set_requires_grad(true));
                let out = if fast {
                    interaction_cpu(&d, &emb).expect("the C++ interaction")
                } else {
                    m.interaction_ops(&d, &emb)
                };
                (&out * &upstream).sum(kind).backward();
                (out.detach(), d.grad(), emb.grad())
            };
            let (fast, ops) = (run(true), run(false));
            assert_eq!(fast.0.size(), [33, 16 + 28]);
            // TorchRec's definition: the Gram matrix's upper triangle, row by row, after `d`.
            let all = Tensor::cat(&[&d.unsqueeze(1), &emb], 1);
            let gram = all.bmm(&all.transpose(1, 2)).view([33, 64]);
            let want = Tensor::cat(&[&d, &gram.index_select(1, &m.upper)], 1);
            assert!(fast.0.equal(&want), "{kind:?} values");
            let close = (&fast.0 - &ops.0).abs().max().double_value(&[]);
            assert!(close <= 1e-2 * want.abs().max().double_value(&[]), "{kind:?}: {close}");
            assert!(fast.1.equal(&ops.1), "{kind:?} gradient of d");
            assert!(fast.2.equal(&ops.2), "{kind:?} gradient of the embeddings");
        }
    }

    #[test]
    fn no_grad_interaction_matches_the_batched_product() {
        // Criteo-like sizes: 26 features of dim 64.
        let _rng = crate::seeded(2);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = DlrmConfig { dense_arch: vec![16, 64], over_arch: vec![8, 1] };
        let m = Dlrm::new(&vs.root(), &cfg, 3, 26);
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        let (d, sparse) = (Tensor::randn([600, 64], opts), Tensor::randn([600, 26 * 64], opts));
        let got = tch::no_grad(|| m.interaction(&d, &sparse));
        let all = Tensor::cat(&[d.unsqueeze(1), sparse.view([600, 26, 64])], 1);
        let t = Tensor::triu_indices(27, 27, 1, (tch::Kind::Int64, tch::Device::Cpu));
        let pairs = all.bmm(&all.transpose(1, 2)).index(&[None, Some(&t.get(0)), Some(&t.get(1))]);
        let want = Tensor::cat(&[d, pairs], 1);
        assert_eq!(got.size(), want.size());
        let err = (&got - &want).abs().max().double_value(&[]);
        assert!(err < 1e-3, "max error {err}");
    }

    #[test]
    fn check_names_the_mismatched_dim_and_bad_over_arch() {
        let cfg = serde_json::json!({"dense_arch": [8, 4], "over_arch": [8, 2]});
        let problems = DlrmFactory::default().check(&cfg, &inputs(&[4, 5]));
        let keys: Vec<String> = problems.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["model.over_arch[1]", "tables[1].dim"]);
        assert!(
            DlrmFactory::default()
                .check(&serde_json::json!({"dense_arch": [4], "over_arch": [1]}), &inputs(&[4, 4]))
                .is_empty()
        );
        // Two tasks: two logits.
        let two = ModelInputs { num_tasks: 2, ..inputs(&[4, 4]) };
        assert!(
            DlrmFactory::default().check(&serde_json::json!({"dense_arch": [4], "over_arch": [8, 2]}), &two).is_empty()
        );
        let p = DlrmFactory::default().check(&serde_json::json!({"dense_arch": [4], "over_arch": [8, 1]}), &two);
        assert!(p[0].message.contains("size 2 (one logit per task)"), "{}", p[0].message);
    }
}
