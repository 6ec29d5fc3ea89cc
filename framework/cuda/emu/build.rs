//! Compiles the CUDA kernels as host C++ (csrc/emu.cpp includes kernels/embedding.cu) without
//! floating-point contraction, so they compute what NVRTC's `-fmad=false` build computes.

fn main() {
    println!("cargo:rerun-if-changed=csrc/emu.h");
    println!("cargo:rerun-if-changed=csrc/emu.cpp");
    println!("cargo:rerun-if-changed=../kernels/embedding.cu");
    cc::Build::new()
        .cpp(true)
        .file("csrc/emu.cpp")
        .std("c++20")
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-maybe-uninitialized")
        .opt_level(2)
        .compile("trainrec_cuda_emu");
    println!("cargo:rustc-link-lib=stdc++");
}
