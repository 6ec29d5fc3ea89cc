//! Compiles `csrc/autocast.cpp` (the autocast switches tch does not expose) and
//! `csrc/interaction.cpp` (DLRM's interaction as one autograd function) against the libtorch
//! headers torch-sys found: `DEP_TCH_LIBTORCH_LIB` is its `lib` folder.

fn main() {
    println!("cargo:rerun-if-changed=csrc/autocast.cpp");
    println!("cargo:rerun-if-changed=csrc/interaction.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        // torch-sys's `doc-only` build: no libtorch, nothing to link against.
        return;
    };
    let include = std::path::Path::new(&lib).join("..").join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .include(include.join("torch").join("csrc").join("api").join("include"))
        .file("csrc/autocast.cpp")
        .file("csrc/interaction.cpp")
        .compile("trainrec_csrc");
}
