//! Zero-initialised, page-aligned buffers for weights and optimizer state, backed by
//! anonymous memory mappings that ask the kernel for transparent huge pages: random row
//! access over gigabytes of weights is TLB-bound with 4 KiB pages.

use std::marker::PhantomData;

use memmap2::MmapMut;

use crate::EmbeddingError;

/// Plain old data: every bit pattern, including all zeros, is a valid value.
///
/// # Safety
/// Implementors must have no padding, no invalid bit patterns and no drop glue.
pub(crate) unsafe trait Pod: Copy + Send + Sync + 'static {}
// SAFETY: primitive floats and the `half` types are 2/4-byte values valid for any bits.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for half::f16 {}
// SAFETY: as above.
unsafe impl Pod for half::bf16 {}

/// A fixed-length zeroed buffer of `T`.
pub(crate) struct HugeBuf<T: Pod> {
    map: Option<MmapMut>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> HugeBuf<T> {
    /// A buffer of `len` zeros; `what` names it in the error when memory is short.
    pub(crate) fn zeroed(len: usize, what: &str) -> Result<Self, EmbeddingError> {
        if len == 0 {
            return Ok(Self { map: None, len, _t: PhantomData });
        }
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| too_big(what, usize::MAX))?;
        let map = MmapMut::map_anon(bytes)
            .map_err(|e| EmbeddingError::Config(format!("cannot allocate {bytes} bytes for {what}: {e}")))?;
        #[cfg(target_os = "linux")]
        {
            // Advisory: without THP support the mapping simply keeps 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(Self { map: Some(map), len, _t: PhantomData })
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match &self.map {
            // SAFETY: the mapping is page aligned (hence aligned for T), `len * size_of::<T>()`
            // bytes long, zero-initialised by the kernel and T is valid for any bits (Pod).
            Some(m) => unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<T>(), self.len) },
            None => &[],
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        match &mut self.map {
            // SAFETY: as in `as_slice`; the `&mut self` borrow makes the access unique.
            Some(m) => unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<T>(), self.len) },
            None => &mut [],
        }
    }
}

fn too_big(what: &str, bytes: usize) -> EmbeddingError {
    EmbeddingError::Config(format!("{what} needs more than {bytes} bytes: does not fit in memory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_writable_and_empty() {
        let mut b = HugeBuf::<f32>::zeroed(1 << 20, "test").unwrap();
        assert_eq!(b.len(), 1 << 20);
        assert!(b.as_slice().iter().all(|&x| x == 0.0));
        b.as_mut_slice()[12345] = 2.5;
        assert_eq!(b.as_slice()[12345], 2.5);
        assert_eq!(b.as_slice().as_ptr() as usize % 4096, 0, "page aligned");
        let e = HugeBuf::<half::bf16>::zeroed(0, "empty").unwrap();
        assert!(e.as_slice().is_empty());
        assert!(HugeBuf::<f32>::zeroed(usize::MAX / 2, "huge table").is_err());
    }
}
