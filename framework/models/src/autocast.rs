//! Mixed-precision dense compute: [`Autocast`], a region in which libtorch runs matrix products
//! in bf16, as `torch.autocast(device_type, dtype=torch.bfloat16)` does.
//!
//! Inside the region, libtorch's autocast dispatch casts the inputs and weights of matrix
//! products (`linear`, `addmm`, `mm`, `bmm`, `matmul`) to bf16 and returns bf16 outputs;
//! element-wise ops follow their inputs; ops that need range run in fp32; `cat` promotes to the
//! widest input. Weight casts are cached for the region. The parameters stay fp32: the casts are
//! ordinary autograd ops, so the backward runs the products in bf16 too and hands each fp32
//! parameter an fp32 gradient. Run the backward after the region closes, as with PyTorch.

use tch::Device;
use trainrec_types::DensePrecision;

unsafe extern "C" {
    fn trainrec_autocast_enter(cuda: i32, half: i32, prev_enabled: *mut i32, prev_dtype: *mut i32) -> i32;
    fn trainrec_autocast_exit(cuda: i32, prev_enabled: i32, prev_dtype: i32) -> i32;
}

/// An open autocast region on this thread (autocast state is thread-local); closing it (drop)
/// restores the state it found. Not `Send`: it must close on the thread that opened it.
#[must_use = "the region closes when the guard drops"]
pub struct Autocast {
    cuda: i32,
    prev_enabled: i32,
    prev_dtype: i32,
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl Autocast {
    /// Opens a bf16 region for the tensors on `device` when `precision` is
    /// [`DensePrecision::Bf16`]; `None` for fp32 (nothing to switch).
    pub fn open(precision: DensePrecision, device: Device) -> Option<Self> {
        match precision {
            DensePrecision::Fp32 => None,
            DensePrecision::Bf16 => {
                let cuda = i32::from(device.is_cuda());
                let (mut prev_enabled, mut prev_dtype) = (0, 0);
                // SAFETY: the shim writes both out-parameters, which live for the call.
                let rc = unsafe { trainrec_autocast_enter(cuda, 0, &mut prev_enabled, &mut prev_dtype) };
                // The shim only fails if libtorch throws on its own thread-local switches,
                // which it does not; compute then simply stays fp32.
                (rc == 0).then_some(Self { cuda, prev_enabled, prev_dtype, _thread_bound: std::marker::PhantomData })
            }
        }
    }

    /// Runs `f` inside a region for `precision` on `device` (see [`Autocast::open`]).
    pub fn run<T>(precision: DensePrecision, device: Device, f: impl FnOnce() -> T) -> T {
        let _region = Self::open(precision, device);
        f()
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // SAFETY: restores the state `open` read on this thread (the guard is not `Send`).
        unsafe {
            trainrec_autocast_exit(self.cuda, self.prev_enabled, self.prev_dtype);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor, nn, nn::Module};

    /// Inside the region a linear layer computes in bf16 (its output is bf16 and equals the
    /// product of the bf16-rounded operands, accumulated in fp32); outside, fp32 again; the
    /// weight's gradient is fp32 and matches a float64 recomputation from the bf16 operands.
    #[test]
    fn linear_layers_compute_in_bf16_inside_the_region_only() {
        let _rng = crate::seeded(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let layer = nn::linear(vs.root() / "l", 64, 32, Default::default());
        let x = Tensor::randn([16, 64], (Kind::Float, Device::Cpu));
        let y = Autocast::run(DensePrecision::Bf16, Device::Cpu, || layer.forward(&x));
        assert_eq!(y.kind(), Kind::BFloat16);
        let after = layer.forward(&x);
        assert_eq!(after.kind(), Kind::Float);
        let fp32 = Autocast::run(DensePrecision::Fp32, Device::Cpu, || layer.forward(&x));
        assert_eq!(fp32.kind(), Kind::Float);

        // float64 reference from the bf16-rounded operands.
        let r = |t: &Tensor| t.to_kind(Kind::BFloat16).to_kind(Kind::Double);
        let want = r(&x).matmul(&r(&layer.ws).tr()) + r(layer.bs.as_ref().unwrap());
        let err = (y.to_kind(Kind::Double) - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        assert!(err <= scale * 2f64.powi(-7), "bf16 linear off by {err} (scale {scale})");

        y.to_kind(Kind::Float).sum(Kind::Float).backward();
        let g = layer.ws.grad();
        assert_eq!(g.kind(), Kind::Float);
        // d(sum y)/dW[o, i] = sum over the batch of x[b, i] (bf16-rounded).
        let want_g = r(&x).sum_dim_intlist(0, false, Kind::Double).unsqueeze(0).expand([32, 64], false);
        let gerr = (g.to_kind(Kind::Double) - &want_g).abs().max().double_value(&[]);
        let gscale = want_g.abs().max().double_value(&[]);
        assert!(gerr <= gscale * 2f64.powi(-6), "weight gradient off by {gerr} (scale {gscale})");
    }

    /// Regions nest and restore the state they found, and a region that is not open leaves
    /// fp32 alone.
    #[test]
    fn regions_nest_and_restore() {
        let _rng = crate::seeded(0);
        let a = Tensor::randn([8, 8], (Kind::Float, Device::Cpu));
        let outer = Autocast::open(DensePrecision::Bf16, Device::Cpu);
        {
            let _inner = Autocast::open(DensePrecision::Bf16, Device::Cpu);
            assert_eq!(a.mm(&a).kind(), Kind::BFloat16);
        }
        assert_eq!(a.mm(&a).kind(), Kind::BFloat16, "the outer region is still open");
        drop(outer);
        assert_eq!(a.mm(&a).kind(), Kind::Float);
        assert!(Autocast::open(DensePrecision::Fp32, Device::Cpu).is_none());
    }
}
