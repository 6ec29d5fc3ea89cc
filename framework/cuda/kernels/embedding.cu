// trainrec's CUDA embedding kernels, compiled at run time with NVRTC (see src/nvrtc.rs).
//
// The same file also compiles as host C++ under the emulator (framework/cuda/emu), which
// defines the CUDA built-ins this file uses; the tests run it against the CPU engine. So:
//  - only these built-ins: threadIdx, blockIdx, blockDim, gridDim, __syncwarp, __shared__,
//    __float_as_uint, __uint_as_float, sqrtf; no atomics, no warp shuffles;
//  - every thread of a block reaches every __syncwarp the same number of times (loops over
//    work are block-uniform; idle warps skip the work, not the barriers).
//
// Every value is computed with the CPU engine's operations in its order (the host compiles
// without FMA contraction, NVRTC with -fmad=false), so fp32 results are bit-identical to it:
//  - pooling sums a bag's rows in order, `acc += w * row`, then `acc *= 1 / L` (mean);
//  - a row's gradient sums its occurrences in the host's sorted order, `g += scale * grad`;
//  - row reductions (row-wise Adagrad, LAMB's norms) use the engine's eight partial sums
//    (`d mod 8`), combined ((0+4)+(1+5))+((2+6)+(3+7));
//  - fp16 / bf16 stores round to nearest even or stochastically with the engine's per-row
//    xorshift64* stream (four 16-bit draws per 64-bit word).
//
// Threads: blocks of 32 x WARPS; each warp owns one bag (pooling), one id (gather) or one
// unique row (update); lanes stride over the embedding dimension.

#define WARPS 4
#define MAX_DIM 1024
#define PER_LANE (MAX_DIM / 32)

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// ------------------------------------------------------------------ storage types

struct F16 { u16 bits; };
struct BF16 { u16 bits; };

__device__ __forceinline__ float load_f32(float x) { return x; }

__device__ __forceinline__ float load_f32(BF16 x) { return __uint_as_float(((u32)x.bits) << 16); }

// IEEE half to single, exact: the magnitude's bits shifted into place and scaled by 2^112
// (normal and subnormal halves alike); infinities and NaNs get the all-ones exponent.
__device__ __forceinline__ float load_f32(F16 x) {
    u32 h = x.bits;
    u32 magnitude = (h & 0x7fffu) << 13;
    float scaled = __uint_as_float(magnitude) * __uint_as_float(0x77800000u);
    u32 bits = ((h & 0x7c00u) == 0x7c00u) ? (magnitude | 0x7f800000u) : __float_as_uint(scaled);
    return __uint_as_float(bits | ((h & 0x8000u) << 16));
}

// Round to nearest, ties to even: round up when the first dropped bit is set and either a
// later dropped bit or the kept last bit is set.
__device__ __forceinline__ bool round_up(u32 bits, u32 round_bit) {
    return (bits & round_bit) != 0 && (bits & (3u * round_bit - 1u)) != 0;
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u); // quiet NaN
    return (u16)((x >> 16) + (round_up(x, 0x8000u) ? 1u : 0u));
}

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x & 0x80000000u) >> 16;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) return (u16)(sign | 0x7c00u | (man != 0 ? 0x0200u : 0u) | (man >> 13));
    int e = (int)(exp >> 23) - 127 + 15;
    if (e >= 0x1f) return (u16)(sign | 0x7c00u); // overflow: infinity
    if (e <= 0) { // a subnormal half, or zero
        if (14 - e > 24) return (u16)sign;
        u32 m = man | 0x00800000u;
        u32 r = m >> (14 - e);
        if (round_up(m, 1u << (13 - e))) r += 1u;
        return (u16)(sign | r);
    }
    u32 r = sign | ((u32)e << 10) | (man >> 13);
    return (u16)(r + (round_up(man, 0x1000u) ? 1u : 0u)); // a carry moves into the exponent
}

__device__ __forceinline__ float bits16_to_f32(F16, u16 b) { F16 h; h.bits = b; return load_f32(h); }
__device__ __forceinline__ float bits16_to_f32(BF16, u16 b) { BF16 h; h.bits = b; return load_f32(h); }
__device__ __forceinline__ u16 nearest_bits(F16, float x) { return f32_to_f16_bits(x); }
__device__ __forceinline__ u16 nearest_bits(BF16, float x) { return f32_to_bf16_bits(x); }

// Stochastic rounding between the two neighbours of x: up with probability proportional to
// the distance from the lower one; `u` is a uniform 16-bit draw.
template <typename H>
__device__ __forceinline__ u16 stochastic_bits(float x, u16 u) {
    H tag;
    u16 nearest = nearest_bits(tag, x);
    float n = bits16_to_f32(tag, nearest);
    u32 xb = __float_as_uint(x);
    bool finite = (xb & 0x7f800000u) != 0x7f800000u;
    if (n == x || !finite) return nearest;
    u16 lo, hi;
    if (fabsf(n) < fabsf(x)) {
        lo = nearest;
        hi = (u16)(nearest + 1);
    } else if ((nearest & 0x7fffu) == 0) {
        lo = nearest;
        hi = nearest;
    } else {
        lo = (u16)(nearest - 1);
        hi = nearest;
    }
    float l = fabsf(bits16_to_f32(tag, lo)), h = fabsf(bits16_to_f32(tag, hi));
    bool h_finite = (__float_as_uint(h) & 0x7f800000u) != 0x7f800000u;
    if (!h_finite || h == l) return lo;
    float p = (fabsf(x) - l) / (h - l);
    float r = ((float)u + 0.5f) / 65536.0f;
    return r < p ? hi : lo;
}

__device__ __forceinline__ void store_f32(float* dst, float x, u16) { *dst = x; }
__device__ __forceinline__ void store_nearest(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void store_nearest(F16* dst, float x) { dst->bits = f32_to_f16_bits(x); }
__device__ __forceinline__ void store_nearest(BF16* dst, float x) { dst->bits = f32_to_bf16_bits(x); }
__device__ __forceinline__ void store_stochastic(float* dst, float x, u16) { *dst = x; }
__device__ __forceinline__ void store_stochastic(F16* dst, float x, u16 u) { dst->bits = stochastic_bits<F16>(x, u); }
__device__ __forceinline__ void store_stochastic(BF16* dst, float x, u16 u) { dst->bits = stochastic_bits<BF16>(x, u); }

// The engine's per-row stream: splitmix64 of the key seeds xorshift64*.
__device__ __forceinline__ u64 rng_seed(u64 key) {
    u64 z = key + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) | 1ull;
}

__device__ __forceinline__ u64 rng_next(u64* s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

// Ids outside 0..rows read (and update) row 0, as the CPU kernels.
__device__ __forceinline__ i64 clamp_row(i64 id, i64 rows) { return (id >= 0 && id < rows) ? id : 0; }

// ------------------------------------------------------------------ forward

// Pools `n` bags of one feature: bag b covers values[offsets[b]..offsets[b+1]] (per-id
// weights optional), written to out[b * width + col + d] for d < dim, mean-pooled or not.
template <typename W>
__device__ void pool(const W* __restrict__ table, i64 rows, int dim, const i64* __restrict__ values,
                     const i64* __restrict__ offsets, const float* __restrict__ weights, i64 n, int mean,
                     float* __restrict__ out, i64 width, i64 col) {
    int lane = threadIdx.x, warp = threadIdx.y;
    for (i64 b = (i64)blockIdx.x * WARPS + warp; b < n; b += (i64)gridDim.x * WARPS) {
        float acc[PER_LANE];
        for (int k = 0; k < PER_LANE; k++) acc[k] = 0.0f;
        i64 start = offsets[b], end = offsets[b + 1];
        for (i64 p = start; p < end; p++) {
            i64 r = clamp_row(values[p], rows);
            float a = weights ? weights[p] : 1.0f;
            const W* src = table + r * dim;
            for (int k = 0, d = lane; d < dim; k++, d += 32) acc[k] += a * load_f32(src[d]);
        }
        float inv = (mean && end > start) ? 1.0f / (float)(end - start) : 1.0f;
        float* dst = out + b * width + col;
        for (int k = 0, d = lane; d < dim; k++, d += 32) dst[d] = (mean && end > start) ? acc[k] * inv : acc[k];
    }
}

// Copies the rows of `n` ids into out[i * dim + d] (sequence lookups).
template <typename W>
__device__ void gather(const W* __restrict__ table, i64 rows, int dim, const i64* __restrict__ ids, i64 n,
                       float* __restrict__ out) {
    int lane = threadIdx.x, warp = threadIdx.y;
    for (i64 i = (i64)blockIdx.x * WARPS + warp; i < n; i += (i64)gridDim.x * WARPS) {
        const W* src = table + clamp_row(ids[i], rows) * dim;
        for (int d = lane; d < dim; d += 32) out[i * dim + d] = load_f32(src[d]);
    }
}

// ------------------------------------------------------------------ backward + optimizer

// Optimizer codes (src/kernels.rs, `Opt`).
#define OPT_SGD 0
#define OPT_ADAGRAD 1
#define OPT_ROWWISE 2
#define OPT_ADAM 3
#define OPT_PARTIAL_ROWWISE_ADAM 4
#define OPT_LAMB 5
// Row-wise Adagrad's weight decay modes.
#define WD_NONE 0
#define WD_L2 1
#define WD_DECOUPLED 2

// One step's constants, resolved on the host (FBGEMM's bias corrections included).
struct StepArgs {
    int opt;
    int wd_mode;
    float lr, eps, weight_decay, beta1, beta2;
    float c1; // 1 - beta1^t
    float c2; // 1 - beta2^t
    int stochastic;
    u64 rng_key; // the step's key; each row's stream is keyed rng_key ^ (table << 40) ^ row
    u64 table;
};

// The engine's eight-lane sum of squares: lanes 0..7 of the warp each sum d = lane mod 8 in
// order; lane 0 combines them. `x(d)` is read from shared memory. Returns on every lane.
#define ROW_SUM_SQ(result, expr)                                                     \
    do {                                                                             \
        if (active && lane < 8) {                                                    \
            float part = 0.0f;                                                       \
            for (int d = lane; d < dim; d += 8) { float x = (expr); part += x * x; } \
            s_part[warp][lane] = part;                                               \
        }                                                                            \
        __syncwarp();                                                                \
        float* q = s_part[warp];                                                     \
        result = ((q[0] + q[4]) + (q[1] + q[5])) + ((q[2] + q[6]) + (q[3] + q[7]));  \
        __syncwarp();                                                                \
    } while (0)

// The fused backward of one table: unique row u (of `uniques`) is rows[u]; its occurrences
// are occ_src/occ_scale[seg[u]..seg[u+1]] (each an offset into `grad` where dim upstream
// gradient values start, and the factor on them). Sums each row's gradient, then runs the
// optimizer on the row and its state (`spr` floats per row).
template <typename W>
__device__ void update(W* __restrict__ table, float* __restrict__ state, int dim, int spr,
                       const i64* __restrict__ rows, const u32* __restrict__ seg, const u32* __restrict__ occ_src,
                       const float* __restrict__ occ_scale, i64 uniques, const float* __restrict__ grad,
                       StepArgs s) {
    __shared__ float s_g[WARPS][MAX_DIM];  // the row's gradient (LAMB: then its direction r)
    __shared__ float s_w[WARPS][MAX_DIM];  // the row's weights in fp32
    __shared__ u64 s_bits[WARPS][MAX_DIM / 4];
    __shared__ float s_part[WARPS][8];
    __shared__ float s_scalar[WARPS][2];
    int lane = threadIdx.x, warp = threadIdx.y;
    i64 stride = (i64)gridDim.x * WARPS;
    for (i64 base = (i64)blockIdx.x * WARPS; base < uniques; base += stride) {
        i64 u = base + warp;
        bool active = u < uniques;
        i64 row = active ? rows[u] : 0;
        W* w_row = table + row * dim;
        float* st = state + row * spr;
        float* g = s_g[warp];
        float* wf = s_w[warp];
        if (active) {
            u32 start = seg[u], end = seg[u + 1];
            for (int d = lane; d < dim; d += 32) {
                float acc = 0.0f;
                for (u32 i = start; i < end; i++) acc += occ_scale[i] * grad[(i64)occ_src[i] + d];
                g[d] = acc;
                wf[d] = load_f32(w_row[d]);
            }
        }
        __syncwarp();
        if (s.opt == OPT_SGD) {
            if (active)
                for (int d = lane; d < dim; d += 32) wf[d] -= s.lr * g[d];
        } else if (s.opt == OPT_ADAGRAD) {
            if (active)
                for (int d = lane; d < dim; d += 32) {
                    float m = st[d] + g[d] * g[d];
                    st[d] = m;
                    wf[d] -= s.lr * g[d] / (sqrtf(m) + s.eps);
                }
        } else if (s.opt == OPT_ROWWISE) {
            float sum;
            float wd = s.weight_decay;
            if (s.wd_mode == WD_L2) {
                ROW_SUM_SQ(sum, g[d] + wd * wf[d]);
            } else {
                ROW_SUM_SQ(sum, g[d]);
            }
            if (active && lane == 0) {
                float acc = st[0] + sum / (float)dim;
                st[0] = acc;
                float multiplier = s.lr / (sqrtf(acc) + s.eps);
                float correction = s.wd_mode == WD_L2 ? 1.0f - multiplier * wd
                                   : s.wd_mode == WD_DECOUPLED ? 1.0f - s.lr * wd : 1.0f;
                s_scalar[warp][0] = multiplier;
                s_scalar[warp][1] = correction;
            }
            __syncwarp();
            if (active) {
                float multiplier = s_scalar[warp][0], correction = s_scalar[warp][1];
                for (int d = lane; d < dim; d += 32) {
                    if (correction == 1.0f) wf[d] -= multiplier * g[d];
                    else wf[d] = correction * wf[d] - multiplier * g[d];
                }
            }
        } else if (s.opt == OPT_ADAM) {
            if (active)
                for (int d = lane; d < dim; d += 32) {
                    float m = st[d] * s.beta1 + g[d] * (1.0f - s.beta1);
                    float v = st[dim + d] * s.beta2 + g[d] * g[d] * (1.0f - s.beta2);
                    st[d] = m;
                    st[dim + d] = v;
                    wf[d] -= s.lr * (m / s.c1 / (sqrtf(v / s.c2) + s.eps) + s.weight_decay * wf[d]);
                }
        } else if (s.opt == OPT_PARTIAL_ROWWISE_ADAM) {
            float sum;
            ROW_SUM_SQ(sum, g[d]);
            float v_t = sum / (float)dim * (1.0f - s.beta2) + (active ? st[0] : 0.0f) * s.beta2;
            float denom = sqrtf(v_t / s.c2) + s.eps;
            __syncwarp(); // every lane has read st[0] before lane 0 writes it
            if (active) {
                if (lane == 0) st[0] = v_t;
                for (int d = lane; d < dim; d += 32) {
                    float m = st[1 + d] * s.beta1 + g[d] * (1.0f - s.beta1);
                    st[1 + d] = m;
                    wf[d] -= s.lr * (m / s.c1 / denom + s.weight_decay * wf[d]);
                }
            }
        } else if (s.opt == OPT_LAMB) {
            if (active)
                for (int d = lane; d < dim; d += 32) {
                    float m = s.beta1 * st[d] + (1.0f - s.beta1) * g[d];
                    float v = s.beta2 * st[dim + d] + (1.0f - s.beta2) * g[d] * g[d];
                    st[d] = m;
                    st[dim + d] = v;
                    g[d] = (m / s.c1) / (sqrtf(v / s.c2) + s.eps) + s.weight_decay * wf[d];
                }
            __syncwarp();
            float w_sq, r_sq;
            ROW_SUM_SQ(w_sq, wf[d]);
            ROW_SUM_SQ(r_sq, g[d]);
            float wn = sqrtf(w_sq), rn = sqrtf(r_sq);
            float ratio = (wn > 0.0f && rn > 0.0f) ? wn / rn : 1.0f;
            float step = -s.lr * ratio;
            if (active)
                for (int d = lane; d < dim; d += 32) wf[d] += step * g[d];
        }
        __syncwarp();
        // Store the row: fp32 as is; 16-bit to nearest, or stochastically with the row's stream.
        if (s.stochastic) {
            if (active && lane == 0) {
                u64 rng = rng_seed(s.rng_key ^ (s.table << 40) ^ (u64)row);
                for (int c = 0; c < (dim + 3) / 4; c++) s_bits[warp][c] = rng_next(&rng);
            }
            __syncwarp();
            if (active)
                for (int d = lane; d < dim; d += 32)
                    store_stochastic(&w_row[d], wf[d], (u16)(s_bits[warp][d / 4] >> (16 * (d % 4))));
        } else if (active) {
            for (int d = lane; d < dim; d += 32) store_nearest(&w_row[d], wf[d]);
        }
        __syncwarp();
    }
}

// ------------------------------------------------------------------ cache slots

// Copies n records of `bytes` bytes: record i from src + (src_rows ? src_rows[i] : i) *
// src_stride to dst + (dst_rows ? dst_rows[i] : i) * dst_stride (a cache's slots to and from
// a staging buffer). One warp per record, lanes over its bytes.
extern "C" __global__ void trainrec_copy_rows(const unsigned char* __restrict__ src, i64 src_stride,
                                              const i64* __restrict__ src_rows, unsigned char* __restrict__ dst,
                                              i64 dst_stride, const i64* __restrict__ dst_rows, i64 n, i64 bytes) {
    int lane = threadIdx.x, warp = threadIdx.y;
    for (i64 i = (i64)blockIdx.x * WARPS + warp; i < n; i += (i64)gridDim.x * WARPS) {
        const unsigned char* from = src + (src_rows ? src_rows[i] : i) * src_stride;
        unsigned char* to = dst + (dst_rows ? dst_rows[i] : i) * dst_stride;
        for (i64 b = lane; b < bytes; b += 32) to[b] = from[b];
    }
}

// ------------------------------------------------------------------ entry points

#define ENTRY_POINTS(SUFFIX, W)                                                                                \
    extern "C" __global__ void trainrec_pool_##SUFFIX(const W* table, i64 rows, int dim, const i64* values,    \
                                                      const i64* offsets, const float* weights, i64 n,          \
                                                      int mean, float* out, i64 width, i64 col) {               \
        pool<W>(table, rows, dim, values, offsets, weights, n, mean, out, width, col);                         \
    }                                                                                                          \
    extern "C" __global__ void trainrec_gather_##SUFFIX(const W* table, i64 rows, int dim, const i64* ids,     \
                                                        i64 n, float* out) {                                    \
        gather<W>(table, rows, dim, ids, n, out);                                                              \
    }                                                                                                          \
    extern "C" __global__ void trainrec_update_##SUFFIX(W* table, float* state, int dim, int spr,              \
                                                        const i64* rows, const u32* seg, const u32* occ_src,    \
                                                        const float* occ_scale, i64 uniques,                    \
                                                        const float* grad, StepArgs s) {                        \
        update<W>(table, state, dim, spr, rows, seg, occ_src, occ_scale, uniques, grad, s);                    \
    }

ENTRY_POINTS(f32, float)
ENTRY_POINTS(f16, F16)
ENTRY_POINTS(bf16, BF16)
