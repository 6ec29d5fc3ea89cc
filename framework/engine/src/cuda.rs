//! Jobs on a GPU (`topology.compute_device = "cuda"`): the dense model on the GPU through
//! libtorch, the tables in GPU memory behind trainrec's CUDA kernels
//! ([`trainrec_cuda::CudaEbc`]), the pooled embeddings and their gradient shared with libtorch
//! as device memory (no copy). One rank for now.
//!
//! trainrec links libtorch's CPU libraries (the `.libtorch/` install has no CUDA half), so the
//! `trainrec` binary opens `libtorch_cuda.so` from the library path when it starts
//! ([`preload_torch_cuda`]; a CUDA build of torch 2.11, e.g. a PyPI wheel's `torch/lib` on
//! `LD_LIBRARY_PATH`), which registers libtorch's CUDA backend. It must come before anything
//! asks libtorch about CUDA (seeding does): libtorch looks its CUDA backend up once and keeps
//! the answer. Everything missing (driver, GPU, NVRTC, libtorch's CUDA half) is a recipe error at
//! `topology.compute_device` saying what and how to fix it.

use tch::Device;
use trainrec_recipe::{Diagnostic, KeyPath, LoadedRecipe, Recipe};

use crate::error::EngineError;

fn diagnostic(loaded: &LoadedRecipe, key: KeyPath, message: String, help: &str) -> EngineError {
    EngineError::Recipe(loaded.locate(vec![Diagnostic::new(key, message).with_help(help)]))
}

/// Where a CUDA job's tables live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// GPU `n` (the dense model on it too).
    Gpu(usize),
    /// The CUDA engine's emulator (host memory, the kernels as host C++; the dense model on
    /// CPU): builds with feature `cuda-emulator` and `TRAINREC_CUDA_EMULATOR=1`, for testing
    /// the CUDA path end to end on machines without a GPU.
    #[cfg(feature = "cuda-emulator")]
    Emulator,
}

impl Target {
    /// The device of the dense model.
    pub(crate) fn dense_device(self) -> Device {
        match self {
            Self::Gpu(n) => Device::Cuda(n),
            #[cfg(feature = "cuda-emulator")]
            Self::Emulator => Device::Cpu,
        }
    }

    /// The job's tables, from the CPU collection's initial values.
    pub(crate) fn collection(
        self,
        ebc: &trainrec_embedding::EmbeddingBagCollection,
    ) -> Result<trainrec_cuda::CudaEbc, EngineError> {
        Ok(match self {
            Self::Gpu(n) => trainrec_cuda::CudaEbc::from_cpu(ebc, n)?,
            #[cfg(feature = "cuda-emulator")]
            Self::Emulator => trainrec_cuda::CudaEbc::emulated(ebc)?,
        })
    }
}

/// Checks that this job can run on GPU 0 and makes libtorch's CUDA backend available.
pub(crate) fn prepare(recipe: &Recipe, loaded: &LoadedRecipe, ranks: usize) -> Result<Target, EngineError> {
    let key = KeyPath::root().key("topology").key("compute_device");
    if ranks > 1 || recipe.topology.world_size > 1 {
        return Err(diagnostic(
            loaded,
            KeyPath::root().key("topology").key("world_size"),
            format!(
                "a CUDA job trains on one GPU for now; this recipe asks for {} ranks",
                recipe.topology.world_size.max(ranks)
            ),
            "set topology.world_size = 1, or train across ranks on CPU (topology.compute_device = \"cpu\")",
        ));
    }
    if let Some(i) = recipe.tables.iter().position(|t| t.mc.is_some()) {
        return Err(diagnostic(
            loaded,
            KeyPath::root().key("tables").index(i).key("mc"),
            format!("table \"{}\": managed collisions do not run on CUDA yet", recipe.tables[i].name),
            "train this recipe with topology.compute_device = \"cpu\"",
        ));
    }
    #[cfg(feature = "cuda-emulator")]
    if std::env::var_os("TRAINREC_CUDA_EMULATOR").is_some_and(|v| v == "1") {
        tracing::warn!("TRAINREC_CUDA_EMULATOR=1: the CUDA engine runs emulated on the host (slow; for tests)");
        return Ok(Target::Emulator);
    }
    let help = "run on a machine with an NVIDIA GPU and its driver, or set topology.compute_device = \"cpu\"";
    let info = trainrec_cuda::probe(0).map_err(|e| diagnostic(loaded, key.clone(), e.to_string(), help))?;
    load_torch_cuda().map_err(|m| {
        diagnostic(
            loaded,
            key,
            m,
            "put a CUDA build of torch 2.11's torch/lib (e.g. a PyPI wheel's) on LD_LIBRARY_PATH; scripts/device-check \
             shows how",
        )
    })?;
    tracing::info!(gpu = %info.name, "training on CUDA");
    Ok(Target::Gpu(0))
}

/// What [`preload_torch_cuda`] found (`Err`: why libtorch_cuda.so could not be opened).
static TORCH_CUDA: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();

/// Opens libtorch's CUDA half from the library path, if it is there (once; a no-op after).
/// Call it first thing in a process that may train on CUDA, before libtorch is asked about
/// CUDA (libtorch caches its first answer). Returns whether it is loaded.
pub fn preload_torch_cuda() -> bool {
    TORCH_CUDA
        .get_or_init(|| {
            // SAFETY: libtorch_cuda's initialisers register its CUDA backend with the libtorch
            // already loaded (same version: the library path's torch 2.11).
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some("libtorch_cuda.so"),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            }
            .map_err(|e| e.to_string())?;
            // Stays loaded for the process.
            std::mem::forget(lib);
            Ok(())
        })
        .is_ok()
}

/// Whether libtorch has a CUDA backend with a GPU (after [`preload_torch_cuda`]).
fn load_torch_cuda() -> Result<(), String> {
    let loaded = preload_torch_cuda();
    if tch::Cuda::is_available() {
        return Ok(());
    }
    match TORCH_CUDA.get() {
        Some(Err(e)) if !loaded => Err(format!(
            "libtorch has no CUDA backend here: the libtorch trainrec runs with is the CPU build, and \
             libtorch_cuda.so could not be opened ({e})"
        )),
        _ => Err("libtorch_cuda.so is loaded but libtorch sees no CUDA device (was it loaded after libtorch \
                  was first asked about CUDA? the trainrec binary loads it at start)"
            .into()),
    }
}
