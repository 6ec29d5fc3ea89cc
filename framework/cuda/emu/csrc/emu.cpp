// Host launchers of the CUDA embedding kernels (see emu.h): extern "C" for the Rust tests.
#include "emu.h"

#include <mutex>
#include <thread>
#include <vector>

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;
std::barrier<>* emu_block_barrier;

#include "../../kernels/embedding.cu"

static std::mutex launch_lock;

template <class F>
static void launch(unsigned grid, F kernel) {
    std::lock_guard<std::mutex> guard(launch_lock);
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{32, WARPS, 1};
    const unsigned threads = 32 * WARPS;
    for (unsigned b = 0; b < grid; b++) {
        std::barrier<> barrier(threads);
        emu_block_barrier = &barrier;
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (unsigned t = 0; t < threads; t++) {
            pool.emplace_back([=] {
                threadIdx = dim3{t % 32, t / 32, 0};
                blockIdx = dim3{b, 0, 0};
                kernel();
            });
        }
        for (auto& th : pool) th.join();
    }
}

#define EMU_ENTRY_POINTS(SUFFIX, W)                                                                             \
    extern "C" void emu_pool_##SUFFIX(unsigned grid, const W* table, i64 rows, int dim, const i64* values,     \
                                      const i64* offsets, const float* weights, i64 n, int mean, float* out,   \
                                      i64 width, i64 col) {                                                     \
        launch(grid, [=] { trainrec_pool_##SUFFIX(table, rows, dim, values, offsets, weights, n, mean, out,    \
                                                  width, col); });                                              \
    }                                                                                                           \
    extern "C" void emu_gather_##SUFFIX(unsigned grid, const W* table, i64 rows, int dim, const i64* ids,      \
                                        i64 n, float* out) {                                                    \
        launch(grid, [=] { trainrec_gather_##SUFFIX(table, rows, dim, ids, n, out); });                         \
    }                                                                                                           \
    extern "C" void emu_update_##SUFFIX(unsigned grid, W* table, float* state, int dim, int spr,               \
                                        const i64* rows, const u32* seg, const u32* occ_src,                    \
                                        const float* occ_scale, i64 uniques, const float* grad,                 \
                                        const StepArgs* s) {                                                    \
        StepArgs args = *s;                                                                                     \
        launch(grid, [=] {                                                                                      \
            trainrec_update_##SUFFIX(table, state, dim, spr, rows, seg, occ_src, occ_scale, uniques, grad,     \
                                     args);                                                                     \
        });                                                                                                     \
    }

EMU_ENTRY_POINTS(f32, float)
EMU_ENTRY_POINTS(f16, F16)
EMU_ENTRY_POINTS(bf16, BF16)

extern "C" void emu_copy_rows(unsigned grid, const unsigned char* src, i64 src_stride, const i64* src_rows,
                              unsigned char* dst, i64 dst_stride, const i64* dst_rows, i64 n, i64 bytes) {
    launch(grid, [=] { trainrec_copy_rows(src, src_stride, src_rows, dst, dst_stride, dst_rows, n, bytes); });
}
