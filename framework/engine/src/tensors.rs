//! Moving data between the embedding engine's `f32` slices and libtorch tensors without copies.

use tch::{Device, Kind, Tensor};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingError};
use trainrec_sparse::KeyedJaggedTensor;

/// The collection's pooled embeddings of `kjt` as a new `[batch, width]` CPU float tensor,
/// written in place by [`EmbeddingBagCollection::forward_into`] (no intermediate buffer).
pub fn pooled_tensor(ebc: &EmbeddingBagCollection, kjt: &KeyedJaggedTensor) -> Result<Tensor, EmbeddingError> {
    let (b, w) = (kjt.stride(), ebc.width());
    let t = Tensor::empty([b as i64, w as i64], (Kind::Float, Device::Cpu));
    // SAFETY: `t` is a new contiguous CPU float tensor of `b * w` elements that nothing else
    // references while the slice lives.
    let out = unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<f32>(), b * w) };
    ebc.forward_into(kjt, out)?;
    Ok(t)
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
