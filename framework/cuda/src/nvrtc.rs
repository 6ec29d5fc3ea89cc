//! Finding NVRTC and compiling the kernels to PTX.
//!
//! cudarc opens `libnvrtc.so.13` by name and panics when that fails, so the library is found
//! and opened here first, by path: `TRAINREC_NVRTC_DIR`, then the project's `.cuda/` folder
//! (`scripts/ensure-nvrtc.sh` unpacks PyPI's `nvidia-cuda-nvrtc` wheel there), then the
//! `nvidia/cu13/lib` folder of a Python environment (`$VIRTUAL_ENV`, `/opt/torch/.venv`), then
//! the system's search path. Once loaded, cudarc's open of the same name finds it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::{CudaError, KERNEL_SOURCE};

const LIB: &str = "libnvrtc.so.13";
const BUILTINS: &str = "libnvrtc-builtins.so.13.0";

fn candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("TRAINREC_NVRTC_DIR") {
        dirs.push(PathBuf::from(d));
    }
    // The project's .cuda/ beside target/ (tests, and binaries under target/<profile>/).
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cuda/nvidia/cu13/lib"));
    if let Ok(exe) = std::env::current_exe() {
        for up in exe.ancestors().skip(1).take(4) {
            dirs.push(up.join(".cuda/nvidia/cu13/lib"));
        }
    }
    let mut venvs: Vec<PathBuf> = std::env::var_os("VIRTUAL_ENV").map(PathBuf::from).into_iter().collect();
    venvs.push(PathBuf::from("/opt/torch/.venv"));
    for venv in venvs {
        if let Ok(entries) = std::fs::read_dir(venv.join("lib")) {
            for e in entries.flatten() {
                dirs.push(e.path().join("site-packages/nvidia/cu13/lib"));
            }
        }
    }
    dirs
}

/// Opens NVRTC once; the folder it came from (`None`: the system's search path).
fn load() -> &'static Result<Option<PathBuf>, CudaError> {
    static LOADED: OnceLock<Result<Option<PathBuf>, CudaError>> = OnceLock::new();
    LOADED.get_or_init(|| {
        for dir in candidates() {
            let lib = dir.join(LIB);
            if !lib.is_file() {
                continue;
            }
            let open = |p: &Path| {
                // SAFETY: NVRTC's initialisers only set up its own state.
                unsafe {
                    libloading::os::unix::Library::open(
                        Some(p),
                        libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                    )
                }
            };
            if dir.join(BUILTINS).is_file() {
                if let Ok(b) = open(&dir.join(BUILTINS)) {
                    std::mem::forget(b);
                }
            }
            match open(&lib) {
                Ok(l) => {
                    // Stays loaded for the process: cudarc resolves its symbols by name later.
                    std::mem::forget(l);
                    let dir = dir.canonicalize().unwrap_or(dir);
                    tracing::debug!(dir = %dir.display(), "NVRTC loaded");
                    return Ok(Some(dir));
                }
                Err(e) => tracing::warn!("{}: {e}", lib.display()),
            }
        }
        // SAFETY: only tries to open the library (dlopen); no symbol is called.
        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Ok(None);
        }
        Err(CudaError::Unavailable(format!(
            "NVRTC ({LIB}) was not found: run scripts/ensure-nvrtc.sh (PyPI's nvidia-cuda-nvrtc wheel into .cuda/), \
             or set TRAINREC_NVRTC_DIR to the folder holding {LIB}"
        )))
    })
}

/// Where NVRTC was found (`Ok(None)`: on the system's search path), or why it was not.
pub fn nvrtc_location() -> Result<Option<PathBuf>, CudaError> {
    load().clone()
}

/// Compiles [`KERNEL_SOURCE`] to PTX for `arch` (e.g. `compute_90`) with the options that keep
/// results identical to the CPU engine's: no FMA contraction, IEEE division and square root,
/// no flush to zero.
/// Compiled once per architecture and process (every collection of a process shares it).
pub fn compile_ptx(arch: &str) -> Result<Ptx, CudaError> {
    static COMPILED: OnceLock<std::sync::Mutex<std::collections::HashMap<String, String>>> = OnceLock::new();
    let cache = COMPILED.get_or_init(Default::default);
    if let Some(src) = cache.lock().expect("the PTX cache").get(arch) {
        return Ok(Ptx::from_src(src.clone()));
    }
    let src = compile_uncached(arch)?.to_src();
    cache.lock().expect("the PTX cache").insert(arch.to_string(), src.clone());
    Ok(Ptx::from_src(src))
}

fn compile_uncached(arch: &str) -> Result<Ptx, CudaError> {
    load().clone()?;
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("embedding.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts).map_err(|e| CudaError::Compile(format!("{e:?}")))
}
