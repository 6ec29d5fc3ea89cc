//! Jobs on a GPU (`topology.compute_device = "cuda"`): the dense model on the GPU through
//! libtorch, the tables in GPU memory behind trainrec's CUDA kernels
//! ([`trainrec_cuda::CudaEbc`]), the pooled embeddings and their gradient shared with libtorch
//! as device memory (no copy).
//!
//! Across ranks (`topology.world_size > 1`), rank `r` trains on GPU `r % local_world_size`:
//! the tables are sharded by the plan as on CPU ([`trainrec_sharding::ShardedEbc`]), each rank's
//! shards and replicas moved into a `CudaEbc` on its GPU, and the ranks talk through an NCCL
//! process group ([`trainrec_comm::NcclGroup`], bootstrapped over the thread or MPI group)
//! used by the same sharding code and dense data parallelism as the CPU engines.
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

    /// The GPU (`None` on the emulator).
    pub(crate) fn gpu(self) -> Option<usize> {
        match self {
            Self::Gpu(n) => Some(n),
            #[cfg(feature = "cuda-emulator")]
            Self::Emulator => None,
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

/// Checks that rank `rank` of this job can run on its GPU (`rank % local_world_size`) and
/// makes libtorch's CUDA backend available.
pub(crate) fn prepare(recipe: &Recipe, loaded: &LoadedRecipe, rank: usize) -> Result<Target, EngineError> {
    let key = KeyPath::root().key("topology").key("compute_device");
    let topo = &recipe.topology;
    let per_host = topo.local_world_size.unwrap_or(topo.world_size).max(1);
    #[cfg(feature = "cuda-emulator")]
    if std::env::var_os("TRAINREC_CUDA_EMULATOR").is_some_and(|v| v == "1") {
        tracing::warn!("TRAINREC_CUDA_EMULATOR=1: the CUDA engine runs emulated on the host (slow; for tests)");
        return Ok(Target::Emulator);
    }
    let help = "run on a machine with an NVIDIA GPU and its driver, or set topology.compute_device = \"cpu\"";
    let info = trainrec_cuda::probe(0).map_err(|e| diagnostic(loaded, key.clone(), e.to_string(), help))?;
    if per_host > info.devices {
        // Every rank of a host sees this alike, so all stop here, none waiting for the others.
        let at = if topo.local_world_size.is_some() { "local_world_size" } else { "world_size" };
        return Err(diagnostic(
            loaded,
            KeyPath::root().key("topology").key(at),
            format!(
                "{per_host} ranks per host train on one GPU each, but the CUDA driver sees {} GPU(s) here",
                info.devices
            ),
            "set topology.world_size (or topology.local_world_size, ranks per host) to at most the host's GPU count",
        ));
    }
    let gpu = rank % per_host;
    let info = if gpu == 0 {
        info
    } else {
        trainrec_cuda::probe(gpu).map_err(|e| diagnostic(loaded, key.clone(), e.to_string(), help))?
    };
    load_torch_cuda().map_err(|m| {
        diagnostic(
            loaded,
            key,
            m,
            "put a CUDA build of torch 2.11's torch/lib (e.g. a PyPI wheel's) on LD_LIBRARY_PATH; scripts/device-check \
             shows how",
        )
    })?;
    tracing::info!(rank, gpu, name = %info.name, "training on CUDA");
    Ok(Target::Gpu(gpu))
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

/// This rank's NCCL process group on GPU `gpu`, bootstrapped over `bootstrap` (collective).
/// A machine without NCCL is a recipe error at `topology.compute_device` on every rank.
pub(crate) fn nccl_group(
    bootstrap: &dyn trainrec_comm::ProcessGroup,
    gpu: usize,
    loaded: &LoadedRecipe,
) -> Result<std::sync::Arc<dyn trainrec_comm::ProcessGroup>, EngineError> {
    let group = trainrec_comm::NcclGroup::new(bootstrap, gpu, crate::runtime::COLLECTIVE_TIMEOUT).map_err(|e| {
        diagnostic(
            loaded,
            KeyPath::root().key("topology").key("compute_device"),
            format!("CUDA ranks talk through NCCL: {e}"),
            "install NCCL (PyPI's nvidia-nccl-cu13 wheel: link libnccl.so to its libnccl.so.2 and put its folder on \
             LD_LIBRARY_PATH), or train with topology.world_size = 1",
        )
    })?;
    tracing::info!(rank = bootstrap.rank(), gpu, "NCCL process group");
    Ok(std::sync::Arc::new(group))
}
