//! Where a `CudaEbc`'s buffers live and its kernels run: a GPU through cudarc, or
//! (feature `emulator`, for tests) host memory with the kernels compiled as host C++
//! (`trainrec-cuda-emu`), so everything above this module runs the same code either way.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use trainrec_embedding::WeightPrecision;

use crate::host::{self, StepArgs};
use crate::{CudaError, KERNELS, WARPS, driver};

// SAFETY: `StepArgs` is `repr(C)` plain old data with the layout of the kernels' `StepArgs`.
unsafe impl DeviceRepr for StepArgs {}

/// A buffer of the backend's memory.
pub(crate) enum Buf<T> {
    /// GPU memory.
    Dev(CudaSlice<T>),
    /// Host memory (the emulator).
    #[cfg_attr(not(feature = "emulator"), allow(dead_code))]
    Host(Vec<T>),
}

impl<T> Buf<T> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Dev(d) => d.len(),
            Self::Host(h) => h.len(),
        }
    }
}

/// One kernel argument.
pub(crate) enum Arg {
    /// An address in the backend's memory (0: null).
    Ptr(u64),
    I64(i64),
    I32(i32),
    Step(StepArgs),
}

/// A kernel of [`KERNELS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    Pool,
    Gather,
    Update,
    /// `trainrec_copy_rows` (bytes: no precision).
    CopyRows,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Self::Pool => "pool",
            Self::Gather => "gather",
            Self::Update => "update",
            Self::CopyRows => "copy_rows",
        }
    }
}

pub(crate) enum Backend {
    Cuda {
        stream: Arc<CudaStream>,
        functions: HashMap<String, CudaFunction>,
    },
    #[cfg(feature = "emulator")]
    Emulator,
}

fn entry(kernel: Kernel, p: WeightPrecision) -> String {
    match kernel {
        Kernel::CopyRows => "trainrec_copy_rows".into(),
        _ => format!("trainrec_{}_{}", kernel.name(), host::suffix(p)),
    }
}

impl Backend {
    /// GPU `device`'s default stream (ordered with libtorch's default stream) and the kernels
    /// compiled for its architecture.
    pub(crate) fn cuda(device: usize, compute_capability: (i32, i32)) -> Result<Self, CudaError> {
        let ctx = CudaContext::new(device).map_err(driver("cuCtxCreate"))?;
        let stream = ctx.default_stream();
        let (major, minor) = compute_capability;
        let ptx = crate::compile_ptx(&format!("compute_{major}{minor}"))?;
        let module = ctx.load_module(ptx).map_err(driver("cuModuleLoadData"))?;
        let mut functions = HashMap::new();
        for kernel in KERNELS {
            for p in [WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16] {
                let name = format!("trainrec_{kernel}_{}", host::suffix(p));
                let f = module.load_function(&name).map_err(driver("cuModuleGetFunction"))?;
                functions.insert(name, f);
            }
        }
        let copy = entry(Kernel::CopyRows, WeightPrecision::Fp32);
        functions.insert(copy.clone(), module.load_function(&copy).map_err(driver("cuModuleGetFunction"))?);
        Ok(Self::Cuda { stream, functions })
    }

    /// A copy stream of the highest priority, ordered against this backend's stream.
    pub(crate) fn copy_stream(&self) -> Result<crate::copy::CopyStream, CudaError> {
        match self {
            Self::Cuda { stream, .. } => crate::copy::CopyStream::new(stream.context(), stream.clone()),
            #[cfg(feature = "emulator")]
            Self::Emulator => Ok(crate::copy::CopyStream::emulated()),
        }
    }

    /// A copy of `v` in the backend's memory (`v` may be empty).
    pub(crate) fn upload<T: DeviceRepr + Copy>(&self, v: &[T]) -> Result<Buf<T>, CudaError> {
        match self {
            Self::Cuda { stream, .. } => {
                if v.is_empty() {
                    // SAFETY: a one-element allocation nothing reads before it is written.
                    let b = unsafe { stream.alloc::<T>(1) }.map_err(driver("cuMemAlloc"))?;
                    return Ok(Buf::Dev(b));
                }
                Ok(Buf::Dev(stream.clone_htod(v).map_err(driver("cuMemcpyHtoD"))?))
            }
            #[cfg(feature = "emulator")]
            Self::Emulator => Ok(Buf::Host(v.to_vec())),
        }
    }

    /// `n` zeros (at least one element).
    pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits + Copy + Default>(
        &self,
        n: usize,
    ) -> Result<Buf<T>, CudaError> {
        match self {
            Self::Cuda { stream, .. } => Ok(Buf::Dev(stream.alloc_zeros::<T>(n.max(1)).map_err(driver("cuMemAlloc"))?)),
            #[cfg(feature = "emulator")]
            Self::Emulator => Ok(Buf::Host(vec![T::default(); n.max(1)])),
        }
    }

    /// The buffer's contents on the host.
    pub(crate) fn download<T: DeviceRepr + Copy>(&self, b: &Buf<T>) -> Result<Vec<T>, CudaError> {
        match (self, b) {
            (Self::Cuda { stream, .. }, Buf::Dev(d)) => stream.clone_dtoh(d).map_err(driver("cuMemcpyDtoH")),
            (_, Buf::Host(h)) => Ok(h.clone()),
            #[cfg(feature = "emulator")]
            (Self::Emulator, Buf::Dev(_)) => unreachable!("the emulator holds host buffers"),
        }
    }

    /// Overwrites the buffer's first `v.len()` elements.
    pub(crate) fn write<T: DeviceRepr + Copy>(&self, v: &[T], b: &mut Buf<T>) -> Result<(), CudaError> {
        match (self, b) {
            (Self::Cuda { stream, .. }, Buf::Dev(d)) => {
                let mut view = d.slice_mut(..v.len());
                stream.memcpy_htod(v, &mut view).map_err(driver("cuMemcpyHtoD"))
            }
            (_, Buf::Host(h)) => {
                h[..v.len()].copy_from_slice(v);
                Ok(())
            }
            #[cfg(feature = "emulator")]
            (Self::Emulator, Buf::Dev(_)) => unreachable!("the emulator holds host buffers"),
        }
    }

    /// The address of element `offset` of a buffer a kernel writes.
    pub(crate) fn addr_mut<T>(&self, b: &mut Buf<T>, offset: usize) -> u64 {
        match b {
            Buf::Host(h) => h[offset..].as_mut_ptr() as u64,
            dev => self.addr(dev, offset),
        }
    }

    /// The address of the buffer's element `offset` (what a kernel's pointer argument takes).
    pub(crate) fn addr<T>(&self, b: &Buf<T>, offset: usize) -> u64 {
        match (self, b) {
            (Self::Cuda { stream, .. }, Buf::Dev(d)) => {
                // One stream: the guard's event bookkeeping is not needed.
                let (ptr, _guard) = d.device_ptr(stream);
                ptr + (offset * size_of::<T>()) as u64
            }
            (_, Buf::Host(h)) => h[offset..].as_ptr() as u64,
            #[cfg(feature = "emulator")]
            (Self::Emulator, Buf::Dev(_)) => unreachable!("the emulator holds host buffers"),
        }
    }

    /// Launches `kernel` for `p` over `warps` warps' worth of work (bags, ids or rows).
    ///
    /// # Safety
    /// `args` must be the kernel's parameters in order and type (`kernels/embedding.cu`), with
    /// pointers into live buffers of this backend large enough for every index the kernel
    /// reads or writes.
    pub(crate) unsafe fn launch(
        &self,
        kernel: Kernel,
        p: WeightPrecision,
        warps: usize,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        let grid = host::grid(warps);
        match self {
            Self::Cuda { stream, functions } => {
                let name = entry(kernel, p);
                let f = &functions[&name];
                let mut l = stream.launch_builder(f);
                for a in args {
                    match a {
                        Arg::Ptr(x) => l.arg(x),
                        Arg::I64(x) => l.arg(x),
                        Arg::I32(x) => l.arg(x),
                        Arg::Step(x) => l.arg(x),
                    };
                }
                let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (32, WARPS, 1), shared_mem_bytes: 0 };
                // SAFETY: the caller's contract.
                unsafe { l.launch(config) }
                    .map_err(|e| CudaError::Driver(format!("cuLaunchKernel ({name}): {e:?}")))?;
                Ok(())
            }
            #[cfg(feature = "emulator")]
            Self::Emulator => {
                // SAFETY: the caller's contract (host addresses).
                unsafe { emulate(kernel, p, grid.min(2), args) };
                Ok(())
            }
        }
    }

    /// Waits for every launch so far.
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        match self {
            Self::Cuda { stream, .. } => stream.synchronize().map_err(driver("cuStreamSynchronize")),
            #[cfg(feature = "emulator")]
            Self::Emulator => Ok(()),
        }
    }
}

/// Runs a launch on the emulator: at most two blocks, so warps loop over the work as on a GPU
/// with more of it than blocks.
#[cfg(feature = "emulator")]
unsafe fn emulate(kernel: Kernel, p: WeightPrecision, grid: u32, args: &[Arg]) {
    use trainrec_cuda_emu as emu;
    let precision = match p {
        WeightPrecision::Fp32 => emu::Precision::F32,
        WeightPrecision::Fp16 => emu::Precision::F16,
        WeightPrecision::Bf16 => emu::Precision::Bf16,
    };
    let ptr = |i: usize| match args[i] {
        Arg::Ptr(x) => x,
        _ => panic!("argument {i} of {kernel:?} is not a pointer"),
    };
    let int = |i: usize| match args[i] {
        Arg::I64(x) => x,
        Arg::I32(x) => i64::from(x),
        _ => panic!("argument {i} of {kernel:?} is not an integer"),
    };
    // SAFETY (all three): the caller's contract; the pointers are host addresses of live
    // buffers, and the raw entry points take exactly these arguments.
    unsafe {
        match kernel {
            Kernel::Pool => emu::pool(
                grid,
                precision,
                ptr(0),
                int(1),
                int(2) as i32,
                ptr(3),
                ptr(4),
                ptr(5),
                int(6),
                int(7) as i32,
                ptr(8),
                int(9),
                int(10),
            ),
            Kernel::Gather => emu::gather(grid, precision, ptr(0), int(1), int(2) as i32, ptr(3), int(4), ptr(5)),
            Kernel::CopyRows => emu::copy_rows(grid, ptr(0), int(1), ptr(2), ptr(3), int(4), ptr(5), int(6), int(7)),
            Kernel::Update => {
                let Arg::Step(step) = &args[10] else { panic!("argument 10 of update is not the step") };
                emu::update(
                    grid,
                    precision,
                    ptr(0),
                    ptr(1),
                    int(2) as i32,
                    int(3) as i32,
                    ptr(4),
                    ptr(5),
                    ptr(6),
                    ptr(7),
                    int(8),
                    ptr(9),
                    (step as *const StepArgs).cast(),
                )
            }
        }
    }
}
