//! The registry of the custom binary, shared with the workspace tests that validate and run
//! the plugin recipes.

use trainrec::Registry;
use trainrec_plugin_libsvm::LibSvmSampler;
use trainrec_plugin_wide_deep::WideDeep;

/// The built-ins plus the LIBSVM sampler and the Wide & Deep model.
pub fn registry() -> Registry {
    Registry::builtin().sampler::<LibSvmSampler>().model::<WideDeep>()
}
