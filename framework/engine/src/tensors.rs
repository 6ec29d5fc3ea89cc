//! Moving data between the embedding engine's `f32` slices and libtorch tensors without copies.

use tch::{Device, Kind, Tensor};
use trainrec_embedding::{BatchContext, DeviceSlice, EmbeddingError, EmbeddingLookup, Memory, Pooled, PooledGrad};
use trainrec_sparse::KeyedJaggedTensor;

/// The libtorch device of an engine's memory (an emulated device's memory is host memory).
pub fn device_of(memory: Memory) -> Device {
    match memory {
        Memory::Cuda(n) => Device::Cuda(n),
        Memory::Host | Memory::Emulated => Device::Cpu,
    }
}

/// The engine's pooled embeddings of `kjt` as a new `[batch, width]` float tensor in the
/// engine's memory, written in place by [`EmbeddingLookup::forward_into`] (no intermediate
/// buffer); `ctx`: the batch's context (see the trait).
pub fn pooled_tensor(
    engine: &dyn EmbeddingLookup,
    kjt: &KeyedJaggedTensor,
    ctx: &mut BatchContext,
) -> Result<Tensor, EmbeddingError> {
    let (b, w) = (kjt.examples(), engine.width());
    let memory = engine.memory();
    let t = Tensor::empty([b as i64, w as i64], (Kind::Float, device_of(memory)));
    let out = match memory {
        // SAFETY: `t` is a new contiguous CPU float tensor of `b * w` elements that nothing
        // else references while the slice lives.
        Memory::Host if b * w == 0 => Pooled::Host(&mut []),
        Memory::Host => Pooled::Host(unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<f32>(), b * w) }),
        // SAFETY: `t` is a new contiguous float tensor of `b * w` elements in the engine's
        // memory, alive until after the engine's work on it: the engine's kernels run on the
        // default stream, before any later libtorch work on `t` (libtorch's default stream is
        // the same stream).
        Memory::Cuda(_) | Memory::Emulated => Pooled::Device(unsafe { DeviceSlice::new(t.data_ptr() as u64, b * w) }),
    };
    engine.forward_into(kjt, ctx, out)?;
    Ok(t)
}

/// The pooled embeddings as the leaf tensor of a training step, whose gradient the sparse
/// update reads: fp32, or in the dense compute precision when the model takes them so
/// ([`trainrec_models::DenseModel::pooled_in_compute_precision`]), cast here outside autograd.
pub fn pooled_leaf(
    sparse: Tensor,
    precision: trainrec_types::DensePrecision,
    model: &dyn trainrec_models::DenseModel,
) -> Tensor {
    let sparse = match precision {
        trainrec_types::DensePrecision::Bf16 if model.pooled_in_compute_precision() => sparse.to_kind(Kind::BFloat16),
        _ => sparse,
    };
    sparse.set_requires_grad(true)
}

/// Calls `f` with the pooled output's gradient `grad` as the engine of `memory` takes it: a
/// host slice (in place when `grad` is a contiguous CPU float tensor), or a contiguous float
/// tensor in the engine's memory, by address.
pub fn with_grad_buffer<R>(grad: &Tensor, memory: Memory, f: impl FnOnce(PooledGrad<'_>) -> R) -> R {
    match memory {
        Memory::Host => with_f32_slice(grad, |g| f(PooledGrad::Host(g))),
        Memory::Cuda(_) | Memory::Emulated => {
            let g = grad.to_device(device_of(memory)).to_kind(Kind::Float).contiguous();
            // SAFETY: `g` is a contiguous float tensor of `numel` values in the engine's
            // memory, alive until `f` returns; the engine reads it on the default stream, in
            // order with libtorch's work that produced it and before any later reuse of its
            // memory.
            f(PooledGrad::Device(unsafe { DeviceSlice::new(g.data_ptr() as u64, g.numel()) }))
        }
    }
}

/// Calls `f` with the values of `t` as one row-major `f32` slice: in place when `t` is already
/// a contiguous CPU float tensor, else through a contiguous float copy.
pub fn with_f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> R {
    let t = if t.kind() == Kind::Float && t.device() == Device::Cpu && t.is_contiguous() {
        t.shallow_clone()
    } else {
        t.to_device(Device::Cpu).to_kind(Kind::Float).contiguous()
    };
    let n = t.numel();
    if n == 0 {
        return f(&[]);
    }
    // SAFETY: `t` is a contiguous CPU float tensor of `n` elements; this function holds a
    // reference to it for the slice's whole life and nothing writes it meanwhile (the slice is
    // only lent to `f`, which cannot reach the tensor's storage mutably through safe code).
    let s = unsafe { std::slice::from_raw_parts(t.data_ptr().cast::<f32>().cast_const(), n) };
    f(s)
}

/// Makes glibc's allocator keep freed memory: allocations up to 32 MiB come from the heap
/// (not a fresh `mmap` each time) and the heap is never trimmed, so a training step's large
/// tensors (activations, the pooled embeddings and their gradient, ~14 MB each for a
/// Criteo-sized DLRM) reuse pages already mapped instead of faulting in zeroed ones every step;
/// all threads share one arena.
/// Process-wide; returns whether glibc accepted both settings (always false off glibc).
pub fn tune_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        const M_ARENA_MAX: i32 = -8;
        // SAFETY: mallopt only changes allocator parameters; any value is accepted or refused.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
                && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1
                // One arena: a buffer one rank thread allocates and another frees (the thread
                // backend's messages) returns to a heap that is never trimmed, instead of a
                // per-thread heap that shrinks (page faults and TLB shootdowns every step).
                && mallopt(M_ARENA_MAX, 1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_read_in_place_or_through_a_copy() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
        assert_eq!(with_f32_slice(&t, |s| s.to_vec()), vec![1.0, 2.0, 3.0, 4.0]);
        // A transposed view is not contiguous: read through a copy, in row-major order.
        assert_eq!(with_f32_slice(&t.tr(), |s| s.to_vec()), vec![1.0, 3.0, 2.0, 4.0]);
        let d = Tensor::from_slice(&[0.5f64, -1.0]);
        assert_eq!(with_f32_slice(&d, |s| s.to_vec()), vec![0.5, -1.0]);
        assert!(with_f32_slice(&Tensor::zeros([0], (Kind::Float, Device::Cpu)), |s| s.is_empty()));
    }
}
