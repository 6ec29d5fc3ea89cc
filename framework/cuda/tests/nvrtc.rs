//! NVRTC compiles the kernels (where PyPI's nvidia-cuda-nvrtc wheel is installed:
//! `scripts/ensure-nvrtc.sh`, which CI runs), and a machine without CUDA gets errors, not
//! panics.

use trainrec_cuda::{CudaError, KERNELS, compile_ptx, nvrtc_location, probe};

fn nvrtc_or_skip() -> bool {
    match nvrtc_location() {
        Ok(_) => true,
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => panic!("CI=true needs NVRTC: {e}"),
        Err(e) => {
            eprintln!("skipping: {e}");
            false
        }
    }
}

#[test]
fn kernels_compile_to_ptx_for_hopper_and_ampere() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["compute_90", "compute_80"] {
        let ptx = compile_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}")).to_src();
        assert!(ptx.contains(&format!(".target sm_{}", &arch[8..])), "{arch}: {}", &ptx[..ptx.len().min(400)]);
        for kernel in KERNELS {
            for p in ["f32", "f16", "bf16"] {
                let entry = format!(".entry trainrec_{kernel}_{p}(");
                assert!(ptx.contains(&entry), "{arch}: no {entry}");
            }
        }
        assert!(ptx.contains(".entry trainrec_copy_rows("), "{arch}: no trainrec_copy_rows");
        // -fmad=false: no fused multiply-adds in the fp32 kernels (the CPU engine has none).
        assert!(!ptx.contains("fma.rn.f32"), "{arch}: the PTX contracts a * b + c");
    }
}

#[test]
fn a_bad_architecture_is_a_compile_error_with_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    match compile_ptx("compute_7") {
        Err(CudaError::Compile(log)) => assert!(log.contains("compute_7"), "{log}"),
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn without_a_driver_the_probe_says_so() {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("skipping: this machine has a CUDA driver");
        return;
    }
    let e = probe(0).unwrap_err();
    assert!(matches!(e, CudaError::Unavailable(_)), "{e:?}");
    assert!(e.to_string().contains("libcuda") && e.to_string().contains("NVIDIA GPU"), "{e}");
}
