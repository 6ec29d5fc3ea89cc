// The CUDA built-ins kernels/embedding.cu uses, for host C++: each block runs as
// blockDim.x * blockDim.y threads meeting at a barrier for __syncwarp (so warps advance in
// lock step, which the kernels' block-uniform barriers allow), blocks one after another
// (so __shared__ arrays can be statics), one launch at a time.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>

struct dim3 {
    unsigned x, y, z;
};

extern thread_local dim3 threadIdx;
extern thread_local dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
extern std::barrier<>* emu_block_barrier;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline void __syncwarp(unsigned = 0xffffffffu) { emu_block_barrier->arrive_and_wait(); }

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
