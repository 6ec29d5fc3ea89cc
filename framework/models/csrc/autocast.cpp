// The autocast switches of libtorch that tch 0.24 does not expose (its `tch::autocast` turns on
// CUDA's only, and only when CUDA is available): per device type, on/off and the dtype, as
// `torch.autocast(device_type, dtype)` sets them on entry and restores them on exit.
#include <ATen/autocast_mode.h>

namespace {
c10::DeviceType device_type(int cuda) { return cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU; }
}  // namespace

extern "C" {

// Enters an autocast region on the CPU (cuda = 0) or CUDA (cuda = 1) in bf16 (half = 0) or fp16
// (half = 1); writes the previous state to *prev_enabled and *prev_dtype for the matching
// trainrec_autocast_exit. Returns 0, or -1 when libtorch threw.
int trainrec_autocast_enter(int cuda, int half, int* prev_enabled, int* prev_dtype) {
  try {
    const auto dev = device_type(cuda);
    *prev_enabled = at::autocast::is_autocast_enabled(dev) ? 1 : 0;
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dev));
    at::autocast::set_autocast_enabled(dev, true);
    at::autocast::set_autocast_dtype(dev, half ? at::kHalf : at::kBFloat16);
    at::autocast::increment_nesting();
    return 0;
  } catch (...) {
    return -1;
  }
}

// Leaves the region: the outermost exit drops the cached low-precision weight copies, then the
// device's previous state comes back.
int trainrec_autocast_exit(int cuda, int prev_enabled, int prev_dtype) {
  try {
    const auto dev = device_type(cuda);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(dev, prev_enabled != 0);
    at::autocast::set_autocast_dtype(dev, static_cast<c10::ScalarType>(prev_dtype));
    return 0;
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
