// SPDX-License-Identifier: MIT
// Row-wise ops of the backend table on the GPU: rmsnorm, rope, paged KV store and attention,
// embedding, SwiGLU, MoE routing, axpy, sigmoid, row copies. Semantics are kernels.h's.
//
// Design notes:
// - Exactness: each output's reductions have one fixed blocking that depends on the op's
//   dimensions only (norms and routing: lane-strided partials of one warp then a fixed
//   butterfly, whether a warp or a block loads the row; a block per (row, head) for attention with key chunks aligned to absolute
//   positions), never on n_rows or the other rows of the call.
// - Bad indices found on the device (a negative position, a block id past the table, an
//   embedding id out of range) skip the row and set a bit in the backend's device error word
//   (`d_err`); the backend turns it into MM_EINVAL at the next synchronize/get.
// - Attention keeps one online-softmax chain per (row, head): 128-key chunks, chunk max, then
//   p = exp(s - m), out = out * exp(m_old - m) + sum_t p_t v_t (t ascending). The KV cache is
//   f32 (kernels.h). Steps of many rows (prefill chunks) take attention_pf_kernel, which stages
//   each chunk's K/V once for 64 (row, head) units and keeps every unit's operations and order.
//   At decode only n_heads blocks run, so the kernel is latency-bound: each thread's score
//   reads its key in 16-byte loads, 64 floats in flight, and the value sums load 32 keys'
//   values before accumulating them in t order (one fmaf each, as before: the arithmetic does
//   not change with the loads' grouping).
// - Chain fusions (decode: fewer one-block launches per layer): head_norm_rope_kv_kernel
//   stores each key head into the cache as it finishes it and copies the value heads (the
//   bits of head_norm_rope then kv_store); combine_rmsnorm_kernel runs combine's operations
//   for a row, then the row's norm as rmsnorm_row_kernel (the next layer's input norm).
//   route_plan.cu has route + plan; the routing steps are route.cuh's.
// - Prefill forms (MM_GPU_ROWOPS_PF; "prefill forms of the row ops" below): from 128 rows the
//   row ops above issue a row's loads before its stores; the same operations, so the same bits.
#include <math.h>
#include <stdlib.h>

#include "gpu_common.cuh"
#include "head_rope.cuh"
#include "kernels.h"
#include "mm_gpu.h"
#include "route.cuh"

#define ERR_INDEX 1

__device__ __forceinline__ void flag(int *d_err, int bit) {
    if (d_err != NULL)
        atomicOr(d_err, bit);
}

template <int DT>
__device__ __forceinline__ float wload(const void *w, int64_t i) {
    if (DT == MM_DTYPE_BF16)
        return mm_gpu_bf16_to_f32(((const uint16_t *)w)[i]);
    if (DT == MM_DTYPE_F16) {
        const uint16_t h = ((const uint16_t *)w)[i];
        const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
        const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
        if (exp == 0) {
            const float v = (float)man * 5.9604644775390625e-8f;
            return sign ? -v : v;
        }
        if (exp == 31)
            return __uint_as_float(sign | 0x7f800000u | (man << 13));
        return __uint_as_float(sign | ((exp - 15 + 127) << 23) | (man << 13));
    }
    return ((const float *)w)[i];
}

static unsigned warp_threads(void) { return (unsigned)mm__gpu_warp_size(); }

// ---- early launch of the product that follows ----------------------------------------------------
// The decode GEMV is launched as a programmatic dependent (matmul.cu, sm_90): it may start as
// soon as the kernel before it signals launch_dependents, prefetch its weight rows into L2
// and then wait (griddepcontrol.wait) for that kernel to finish before it touches x or y. The
// kernels that feed a product (rmsnorm, attention, copy_rows, swiglu) signal at their start,
// so the product's launch and weight fetch overlap them. The signal changes no result (the
// product still waits for the whole kernel); without a dependent launch it does nothing.
// mm_gpu_set_early_launch(0) turns it off (A/B runs).
static int g_early = 1;

extern "C" void mm_gpu_set_early_launch(int on) { g_early = on != 0; }

// mm_gpu_set_dep_launch: the decode step's small ops (norms, head_norm_rope, kv_store,
// attention, embed, route, copy_rows, swiglu, argmax, and route_plan.cu's plan and combine)
// launch as programmatic dependents (gpu_common.cuh mm_launch_dep) and wait at their start.
// Off until set; the backend sets it on at open (env MM_GPU_PDL_ALL=0: off). Same results.
int mm__gpu_dep = 0;
extern "C" void mm_gpu_set_dep_launch(int on) { mm__gpu_dep = on != 0; }

__device__ __forceinline__ void early_launch(int on) {
#if MM_GPU_HAVE_WMMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (on)
        asm volatile("griddepcontrol.launch_dependents;\n" ::);
#else
    (void)on;
#endif
}

// ---- rmsnorm ---------------------------------------------------------------------------------
// The sum of squares is one fixed order: lane l of a warp sums x[l], x[l + W], x[l + 2W], ...
// (W the warp width) in turn, then the lanes meet in a butterfly (every lane gets the same
// sum). rmsnorm_row_kernel keeps that order but first loads the row into shared memory with a
// whole block (a decode row of 2048 is 8 loads per thread, all in flight, instead of 64 per
// lane in rounds of 8), then one warp sums from shared memory and every thread scales its
// elements: the bits of rmsnorm_kernel (one warp per row), which stays for rows too long for
// shared memory and as the reference of the op test.
#define RMS_THREADS 256
#define RMS_MAX_DIM 8192

// The norm of a row already in shared memory (xsh, dim), written to yr: the sum of squares in
// one warp in the lane-strided order, then every thread scales its elements by its weights wv
// (rms_load_w). Shared by rmsnorm_row_kernel and add_rmsnorm_kernel, so both have the warp
// kernel's bits.
// This thread's weights (elements threadIdx.x + i * RMS_THREADS), loaded before the row so
// that both are in flight together.
// NT: the block's threads (RMS_THREADS, or CR_THREADS for combine_rmsnorm_kernel; the same
// arithmetic per element either way).
// EPT: the elements each thread scales (dim <= NT * EPT).
template <int DT, int NT = RMS_THREADS, int EPT = RMS_MAX_DIM / NT>
__device__ __forceinline__ void rms_load_w(const void *w, int dim, float wv[EPT]) {
#pragma unroll
    for (int i = 0; i < EPT; i++) {
        const int k = threadIdx.x + i * NT;
        wv[i] = k < dim ? wload<DT>(w, k) : 0.0f;
    }
}

// 1 / sqrt(mean(x^2) + eps) of the row in xsh (dim floats), summed by warp 0 in lane-strided
// order and a butterfly, for the whole block. Starts and ends with a barrier.
__device__ __forceinline__ float rms_inv_shared(const float *xsh, int dim, float eps) {
    __shared__ float rs_sh;
    __syncthreads();
    if (threadIdx.x < MM_WARP_SIZE) {
        const int lane = threadIdx.x;
        float ss = 0.0f;
#pragma unroll 8
        for (int k = lane; k < dim; k += MM_WARP_SIZE)
            ss += xsh[k] * xsh[k];
        ss = mm_warp_sum(ss);
        if (lane == 0)
            rs_sh = 1.0f / sqrtf(ss / (float)dim + eps);
    }
    __syncthreads();
    const float rs = rs_sh;
    return rs;
}

template <int NT = RMS_THREADS, int EPT = RMS_MAX_DIM / NT>
__device__ __forceinline__ void rms_from_shared(const float *xsh, const float *wv, int dim, float eps,
                                                float *yr) {
    const float rs = rms_inv_shared(xsh, dim, eps);
#pragma unroll
    for (int i = 0; i < EPT; i++) {
        const int k = threadIdx.x + i * NT;
        if (k < dim)
            yr[k] = wv[i] * (xsh[k] * rs);
    }
}

template <int DT>
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_row_kernel(const void *w, int dim, float eps,
                                                                  const float *x, int64_t xs,
                                                                  float *y, int64_t ys, int early) {
    extern __shared__ float xsh[]; // dim
    early_launch(early);
    float wv[RMS_MAX_DIM / RMS_THREADS];
    rms_load_w<DT>(w, dim, wv); // weights: never written by a kernel, before the wait
    mm_dep_wait();
    const int64_t r = blockIdx.x;
    const float *xr = x + r * xs;
    for (int k = threadIdx.x; k < dim; k += RMS_THREADS)
        xsh[k] = xr[k];
    rms_from_shared(xsh, wv, dim, eps, y + r * ys);
}

// add_rmsnorm (kernels.h): h += a (axpy's one rounded add per element), then the row's norm
// from shared memory as rmsnorm_row_kernel takes it. A block per row.
template <int DT>
__global__ void __launch_bounds__(RMS_THREADS) add_rmsnorm_kernel(const float *a, int64_t as,
                                                                  float *h, int64_t hs,
                                                                  const void *w, int dim, float eps,
                                                                  float *y, int64_t ys, int early) {
    extern __shared__ float xsh[]; // dim
    early_launch(early);
    float wv[RMS_MAX_DIM / RMS_THREADS];
    rms_load_w<DT>(w, dim, wv); // weights: never written by a kernel, before the wait
    mm_dep_wait();
    const int64_t r = blockIdx.x;
    const float *ar = a + r * as;
    float *hr = h + r * hs;
    for (int k = threadIdx.x; k < dim; k += RMS_THREADS) {
        const float v = __fadd_rn(hr[k], ar[k]);
        hr[k] = v;
        xsh[k] = v;
    }
    rms_from_shared(xsh, wv, dim, eps, y + r * ys);
}

// combine_rmsnorm (kernels.h): combine_kernel's operations for each element of the row (the
// rank-ordered products and adds, the shared row, the residual add; explicit _rn, so no
// contraction), then the norm of the new row from shared memory as rmsnorm_row_kernel takes
// it. A block of CR_THREADS per row, EPT elements per thread (dim <= CR_THREADS * EPT, EPT a
// power of two picked by the host); each thread sums its elements rank by rank with the loads
// of UNR ranks issued together, so ~32 loads per thread are in flight instead of one
// element's k at a time (a one-block kernel is latency-bound).
#define CR_THREADS 512
template <int DT, int EPT>
__global__ void __launch_bounds__(CR_THREADS) combine_rmsnorm_kernel(
    const float *alpha, int k, const float *x, int64_t xs, const float *shared, int64_t ss,
    float *h, int64_t hs, int64_t n_rows, const void *w, int dim, float eps, float *y, int64_t ys,
    int early) {
    constexpr int UNR = EPT >= 16 ? 2 : EPT >= 8 ? 4 : 8; // ranks whose loads go together
    extern __shared__ float xsh[]; // dim
    early_launch(early);
    float wv[EPT];
    rms_load_w<DT, CR_THREADS, EPT>(w, dim, wv); // weights: never written by a kernel
    mm_dep_wait();
    const int64_t i = blockIdx.x;
    float *hr = h + i * hs;
    const float *xr = x + i * k * xs;
    // the residual and shared rows first, with the ranks' loads (not after the sums: one
    // round trip to memory fewer in this one-block op's chain; the same values)
    float acc[EPT], hv[EPT], sv[EPT];
#pragma unroll
    for (int q = 0; q < EPT; q++) {
        const int j = threadIdx.x + q * CR_THREADS;
        acc[q] = 0.0f;
        hv[q] = j < dim ? hr[j] : 0.0f;
        sv[q] = shared != NULL && j < dim ? shared[i * ss + j] : 0.0f;
    }
    int r = 0;
    for (; r + UNR <= k; r += UNR) {
        float xv[UNR][EPT], av[UNR];
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            av[u] = alpha[(int64_t)(r + u) * n_rows + i];
#pragma unroll
            for (int q = 0; q < EPT; q++) {
                const int j = threadIdx.x + q * CR_THREADS;
                xv[u][q] = j < dim ? xr[(int64_t)(r + u) * xs + j] : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; u++)
#pragma unroll
            for (int q = 0; q < EPT; q++)
                acc[q] = __fadd_rn(acc[q], __fmul_rn(av[u], xv[u][q]));
    }
    for (; r < k; r++) {
        const float a = alpha[(int64_t)r * n_rows + i];
#pragma unroll
        for (int q = 0; q < EPT; q++) {
            const int j = threadIdx.x + q * CR_THREADS;
            if (j < dim)
                acc[q] = __fadd_rn(acc[q], __fmul_rn(a, xr[(int64_t)r * xs + j]));
        }
    }
#pragma unroll
    for (int q = 0; q < EPT; q++) {
        const int j = threadIdx.x + q * CR_THREADS;
        if (j < dim) {
            float a = acc[q];
            if (shared != NULL)
                a = __fadd_rn(a, sv[q]);
            const float v = __fadd_rn(hv[q], a);
            hr[j] = v;
            xsh[j] = v;
        }
    }
    rms_from_shared<CR_THREADS, EPT>(xsh, wv, dim, eps, y + i * ys);
}

// ---- prefill forms of the row ops (many rows) -------------------------------------------------
// add_rmsnorm, combine_rmsnorm, embed_rmsnorm and head_norm_rope_kv have a second form for
// calls of many rows (prefill chunks), with every element's operations and their order as
// above, so the same bits: each thread issues all its loads of the row (16-byte pieces) before
// its first store (the forms above interleave loads and stores in a loop the compiler cannot
// reorder, as h and a may alias: one round trip per element step), and head_norm_rope_kv runs
// a block per row, each head in registers from its load to its stores (no barrier between norm
// and rope, one load and one store per element; the NeoX pairs (i, i + 64) of a 128-dim head
// sit in one lane) and the row's cos/sin computed once per warp, not once per head.
// H200, ncu per 4096-row call of Qwen3-30B-A3B (2026-11-30 12:02 UTC): head_norm_rope_kv
// 105.0 -> 58.1 us, add_rmsnorm 55.5 -> 32.2 (the copy rate), combine_rmsnorm 96.5 -> 94.7
// (bytes-bound both), embed_rmsnorm 52.7 -> 24.2; the 4K forward of 4 layers 9.0 -> 8.6 ms.
// MM_GPU_ROWOPS_PF (read at first use; mm_gpu_set_rowops_pf): 0 the forms above always, 1
// (default) the prefill forms from ROWOPS_PF_MIN rows, 2 the prefill forms wherever they apply
// (tests). Decode steps (1..64 rows) keep the forms above. route_plan.cu's routing a warp per
// row (route_with_plan with the parallel plan) follows the same switch.
#define ROWOPS_PF_MIN 128
static int g_rowops_pf = -1; // -1: not read yet

extern "C" void mm_gpu_set_rowops_pf(int mode);
extern "C" void mm_gpu_set_rowops_pf(int mode) { g_rowops_pf = mode < 0 ? 0 : mode > 2 ? 2 : mode; }

static bool rowops_pf(int64_t n_rows) {
    if (g_rowops_pf < 0) {
        const char *e = getenv("MM_GPU_ROWOPS_PF");
        g_rowops_pf = e && e[0] != '\0' ? (atoi(e) < 0 ? 0 : atoi(e) > 2 ? 2 : atoi(e)) : 1;
    }
    return g_rowops_pf == 2 || (g_rowops_pf == 1 && n_rows >= ROWOPS_PF_MIN);
}

// For route_plan.cu's warp-per-row routing (the same switch and threshold).
extern "C" int mm__gpu_rowops_pf(int64_t n_rows);
extern "C" int mm__gpu_rowops_pf(int64_t n_rows) { return rowops_pf(n_rows) ? 1 : 0; }

// Launches of the prefill forms (tests: a form taken where it should be, not where it must not).
static unsigned long long g_rowops_pf_n;
extern "C" void mm__gpu_rowops_pf_count(void);
extern "C" void mm__gpu_rowops_pf_count(void) {
    __atomic_fetch_add(&g_rowops_pf_n, 1ull, __ATOMIC_RELAXED);
}
extern "C" unsigned long long mm_gpu_rowops_pf_launches(void);
extern "C" unsigned long long mm_gpu_rowops_pf_launches(void) {
    return __atomic_load_n(&g_rowops_pf_n, __ATOMIC_RELAXED);
}

// 16-byte pieces: the pointer 16-byte aligned and the stride a multiple of 4 floats
static bool al16(const void *p, int64_t stride) {
    return ((uintptr_t)p & 15) == 0 && stride % 4 == 0;
}

// This thread's weights for its VPT pieces (elements 4 * (threadIdx.x + i * NT) + 0..3).
template <int DT, int NT, int VPT>
__device__ __forceinline__ void rms_load_w4(const void *w, int dim, float4 wv[VPT]) {
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        const int k = 4 * (threadIdx.x + i * NT);
        wv[i] = k < dim ? make_float4(wload<DT>(w, k), wload<DT>(w, k + 1), wload<DT>(w, k + 2),
                                      wload<DT>(w, k + 3))
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// rms_from_shared with each thread scaling its VPT pieces: the same sum (one warp, the
// lane-strided order, butterfly), the same wv * (x * rs) per element. dim % 4 == 0, yr 16-byte
// aligned.
template <int NT, int VPT>
__device__ __forceinline__ void rms_from_shared4(const float *xsh, const float4 *wv, int dim,
                                                 float eps, float *yr) {
    const float rs = rms_inv_shared(xsh, dim, eps);
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        const int k4 = threadIdx.x + i * NT;
        if (4 * k4 < dim) {
            const float4 xv = ((const float4 *)xsh)[k4];
            float4 y;
            y.x = wv[i].x * (xv.x * rs);
            y.y = wv[i].y * (xv.y * rs);
            y.z = wv[i].z * (xv.z * rs);
            y.w = wv[i].w * (xv.w * rs);
            ((float4 *)yr)[k4] = y;
        }
    }
}

__device__ __forceinline__ float4 add4_rn(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                       __fadd_rn(a.w, b.w));
}

// add_rmsnorm_kernel's prefill form: a block of RMS_THREADS per row, VPT pieces per thread.
template <int DT, int VPT>
__global__ void __launch_bounds__(RMS_THREADS) add_rmsnorm_pf_kernel(const float *a, int64_t as,
                                                                     float *h, int64_t hs,
                                                                     const void *w, int dim,
                                                                     float eps, float *y,
                                                                     int64_t ys, int early) {
    extern __shared__ float4 xsh4[]; // dim / 4
    early_launch(early);
    float4 wv[VPT];
    rms_load_w4<DT, RMS_THREADS, VPT>(w, dim, wv); // weights: never written by a kernel
    mm_dep_wait();
    const int64_t r = blockIdx.x;
    const float4 *ar = (const float4 *)(a + r * as);
    float4 *hr = (float4 *)(h + r * hs);
    float4 av[VPT], hv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        const int k4 = threadIdx.x + i * RMS_THREADS;
        if (4 * k4 < dim) {
            hv[i] = hr[k4];
            av[i] = ar[k4];
        }
    }
#pragma unroll
    for (int i = 0; i < VPT; i++) {
        const int k4 = threadIdx.x + i * RMS_THREADS;
        if (4 * k4 < dim) {
            const float4 v = add4_rn(hv[i], av[i]);
            hr[k4] = v;
            xsh4[k4] = v;
        }
    }
    rms_from_shared4<RMS_THREADS, VPT>((const float *)xsh4, wv, dim, eps, y + r * ys);
}

// combine_rmsnorm_kernel's prefill form: a block of CR_THREADS per row, VPT pieces per thread;
// the loads of UNR ranks (and the row's h and shared pieces) issued together, then each
// element's rank-ordered products and adds, the shared row and the residual add as there.
template <int DT, int VPT>
__global__ void __launch_bounds__(CR_THREADS) combine_rmsnorm_pf_kernel(
    const float *alpha, int k, const float *x, int64_t xs, const float *shared, int64_t ss,
    float *h, int64_t hs, int64_t n_rows, const void *w, int dim, float eps, float *y, int64_t ys,
    int early) {
    constexpr int UNR = 8 / VPT; // ranks whose loads go together
    extern __shared__ float4 xsh4[]; // dim / 4
    early_launch(early);
    float4 wv[VPT];
    rms_load_w4<DT, CR_THREADS, VPT>(w, dim, wv); // weights: never written by a kernel
    mm_dep_wait();
    const int64_t i = blockIdx.x;
    float4 *hr = (float4 *)(h + i * hs);
    const float *xr = x + i * k * xs;
    float4 acc[VPT], hv[VPT], sv[VPT];
#pragma unroll
    for (int q = 0; q < VPT; q++) {
        acc[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const int j4 = threadIdx.x + q * CR_THREADS;
        if (4 * j4 < dim) {
            hv[q] = hr[j4];
            if (shared != NULL)
                sv[q] = ((const float4 *)(shared + i * ss))[j4];
        }
    }
    int r = 0;
    for (; r + UNR <= k; r += UNR) {
        float4 xv[UNR][VPT];
        float av[UNR];
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            av[u] = alpha[(int64_t)(r + u) * n_rows + i];
#pragma unroll
            for (int q = 0; q < VPT; q++) {
                const int j4 = threadIdx.x + q * CR_THREADS;
                xv[u][q] = 4 * j4 < dim ? ((const float4 *)(xr + (int64_t)(r + u) * xs))[j4]
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; u++)
#pragma unroll
            for (int q = 0; q < VPT; q++) {
                acc[q].x = __fadd_rn(acc[q].x, __fmul_rn(av[u], xv[u][q].x));
                acc[q].y = __fadd_rn(acc[q].y, __fmul_rn(av[u], xv[u][q].y));
                acc[q].z = __fadd_rn(acc[q].z, __fmul_rn(av[u], xv[u][q].z));
                acc[q].w = __fadd_rn(acc[q].w, __fmul_rn(av[u], xv[u][q].w));
            }
    }
    for (; r < k; r++) {
        const float av = alpha[(int64_t)r * n_rows + i];
#pragma unroll
        for (int q = 0; q < VPT; q++) {
            const int j4 = threadIdx.x + q * CR_THREADS;
            if (4 * j4 < dim) {
                const float4 xv = ((const float4 *)(xr + (int64_t)r * xs))[j4];
                acc[q].x = __fadd_rn(acc[q].x, __fmul_rn(av, xv.x));
                acc[q].y = __fadd_rn(acc[q].y, __fmul_rn(av, xv.y));
                acc[q].z = __fadd_rn(acc[q].z, __fmul_rn(av, xv.z));
                acc[q].w = __fadd_rn(acc[q].w, __fmul_rn(av, xv.w));
            }
        }
    }
#pragma unroll
    for (int q = 0; q < VPT; q++) {
        const int j4 = threadIdx.x + q * CR_THREADS;
        if (4 * j4 < dim) {
            float4 a = acc[q];
            if (shared != NULL)
                a = add4_rn(a, sv[q]);
            const float4 v = add4_rn(hv[q], a);
            hr[j4] = v;
            xsh4[j4] = v;
        }
    }
    rms_from_shared4<CR_THREADS, VPT>((const float *)xsh4, wv, dim, eps, y + i * ys);
}

template <int DT>
__global__ void rmsnorm_kernel(const void *w, int dim, float eps, const float *x, int64_t xs,
                               float *y, int64_t ys, int64_t n_rows, int early) {
    early_launch(early);
    const int lane = threadIdx.x % MM_WARP_SIZE;
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x / MM_WARP_SIZE) + threadIdx.x / MM_WARP_SIZE;
    if (r >= n_rows)
        return;
    const float *xr = x + r * xs;
    float *yr = y + r * ys;
    float ss = 0.0f;
#pragma unroll 8 // loads of 8 steps in flight (a decode row is one warp: latency-bound)
    for (int k = lane; k < dim; k += MM_WARP_SIZE)
        ss += xr[k] * xr[k];
    ss = mm_warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll 8
    for (int k = lane; k < dim; k += MM_WARP_SIZE)
        yr[k] = wload<DT>(w, k) * (xr[k] * rs);
}

// rmsnorm with a warp per row whatever the shape (the op test's reference for the bits of the
// block-per-row kernel). Not declared in mm_gpu.h: tests declare it themselves.
extern "C" mm_err mm_gpu_rmsnorm_warp(void *stream, const mm_weight *w, float eps, const float *x,
                                      int64_t xs, float *y, int64_t ys, int64_t n_rows);

extern "C" mm_err mm_gpu_rmsnorm(void *stream, const mm_weight *w, float eps, const float *x,
                                 int64_t xs, float *y, int64_t ys, int64_t n_rows) {
    if (w == NULL || w->data == NULL || w->rows != 1 || w->cols <= 0 || x == NULL || y == NULL ||
        n_rows < 0)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    if (w->cols > RMS_MAX_DIM || n_rows > INT32_MAX)
        return mm_gpu_rmsnorm_warp(stream, w, eps, x, xs, y, ys, n_rows);
    const int dim = (int)w->cols;
    const size_t shmem = (size_t)dim * sizeof(float);
    const unsigned grid = (unsigned)n_rows;
    cudaStream_t st = (cudaStream_t)stream;
    switch (w->dtype) {
    case MM_DTYPE_BF16: MM_GPU_CHECK(mm_launch_dep(rmsnorm_row_kernel<MM_DTYPE_BF16>, dim3(grid), dim3(RMS_THREADS), shmem, st, w->data, dim, eps, x, xs, y, ys, g_early)); break;
    case MM_DTYPE_F16: MM_GPU_CHECK(mm_launch_dep(rmsnorm_row_kernel<MM_DTYPE_F16>, dim3(grid), dim3(RMS_THREADS), shmem, st, w->data, dim, eps, x, xs, y, ys, g_early)); break;
    case MM_DTYPE_F32: MM_GPU_CHECK(mm_launch_dep(rmsnorm_row_kernel<MM_DTYPE_F32>, dim3(grid), dim3(RMS_THREADS), shmem, st, w->data, dim, eps, x, xs, y, ys, g_early)); break;
    default: return MM_EINVAL;
    }
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

extern "C" mm_err mm_gpu_add_rmsnorm(void *stream, const float *a, int64_t as, float *h,
                                     int64_t hs, const mm_weight *w, float eps, float *y,
                                     int64_t ys, int64_t n_rows) {
    if (w == NULL || w->data == NULL || w->rows != 1 || w->cols <= 0 || a == NULL || h == NULL ||
        y == NULL || n_rows < 0)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    if (w->cols > RMS_MAX_DIM || n_rows > INT32_MAX) { // the two launches it stands for
        MM_TRY(mm_gpu_axpy(stream, NULL, a, as, h, hs, n_rows, w->cols));
        return mm_gpu_rmsnorm(stream, w, eps, h, hs, y, ys, n_rows);
    }
    const int dim = (int)w->cols;
    const size_t shmem = (size_t)dim * sizeof(float);
    const unsigned grid = (unsigned)n_rows;
    cudaStream_t st = (cudaStream_t)stream;
    if (dim % 4 == 0 && al16(a, as) && al16(h, hs) && al16(y, ys) && rowops_pf(n_rows)) {
        mm__gpu_rowops_pf_count();
        const int vpt = dim <= 4 * RMS_THREADS ? 1 : dim <= 8 * RMS_THREADS ? 2
                        : dim <= 16 * RMS_THREADS ? 4 : 8;
        void (*kern)(const float *, int64_t, float *, int64_t, const void *, int, float, float *,
                     int64_t, int) = NULL;
#define AR_PICK(D)                                                                                  \
    kern = vpt == 1 ? add_rmsnorm_pf_kernel<D, 1> : vpt == 2 ? add_rmsnorm_pf_kernel<D, 2>          \
           : vpt == 4 ? add_rmsnorm_pf_kernel<D, 4> : add_rmsnorm_pf_kernel<D, 8>
        switch (w->dtype) {
        case MM_DTYPE_BF16: AR_PICK(MM_DTYPE_BF16); break;
        case MM_DTYPE_F16: AR_PICK(MM_DTYPE_F16); break;
        case MM_DTYPE_F32: AR_PICK(MM_DTYPE_F32); break;
        default: return MM_EINVAL;
        }
#undef AR_PICK
        MM_GPU_CHECK(mm_launch_dep(kern, dim3(grid), dim3(RMS_THREADS), shmem, st, a, as, h, hs,
                                   w->data, dim, eps, y, ys, g_early));
        MM_GPU_CHECK(cudaGetLastError());
        return MM_OK;
    }
    switch (w->dtype) {
    case MM_DTYPE_BF16: MM_GPU_CHECK(mm_launch_dep(add_rmsnorm_kernel<MM_DTYPE_BF16>, dim3(grid), dim3(RMS_THREADS), shmem, st, a, as, h, hs, w->data, dim, eps, y, ys, g_early)); break;
    case MM_DTYPE_F16: MM_GPU_CHECK(mm_launch_dep(add_rmsnorm_kernel<MM_DTYPE_F16>, dim3(grid), dim3(RMS_THREADS), shmem, st, a, as, h, hs, w->data, dim, eps, y, ys, g_early)); break;
    case MM_DTYPE_F32: MM_GPU_CHECK(mm_launch_dep(add_rmsnorm_kernel<MM_DTYPE_F32>, dim3(grid), dim3(RMS_THREADS), shmem, st, a, as, h, hs, w->data, dim, eps, y, ys, g_early)); break;
    default: return MM_EINVAL;
    }
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

extern "C" mm_err mm_gpu_combine_rmsnorm(void *stream, const float *alpha, int k,
                                         const float *x, int64_t xs, const float *shared,
                                         int64_t ss, float *h, int64_t hs, int64_t n_rows,
                                         const mm_weight *w, float eps, float *y, int64_t ys) {
    if (w == NULL || w->data == NULL || w->rows != 1 || w->cols <= 0 || k < 0 ||
        (k > 0 && (alpha == NULL || x == NULL)) || h == NULL || y == NULL || n_rows < 0)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    if (w->cols > RMS_MAX_DIM || n_rows > INT32_MAX) { // the two launches it stands for
        MM_TRY(mm_gpu_combine(stream, alpha, k, x, xs, shared, ss, h, hs, n_rows, w->cols));
        return mm_gpu_rmsnorm(stream, w, eps, h, hs, y, ys, n_rows);
    }
    const int dim = (int)w->cols;
    const size_t shmem = (size_t)dim * sizeof(float);
    const unsigned grid = (unsigned)n_rows;
    cudaStream_t st = (cudaStream_t)stream;
    const int ept = dim <= CR_THREADS ? 1 : dim <= 2 * CR_THREADS ? 2 : dim <= 4 * CR_THREADS ? 4
                    : dim <= 8 * CR_THREADS ? 8 : 16;
    void (*kern)(const float *, int, const float *, int64_t, const float *, int64_t, float *,
                 int64_t, int64_t, const void *, int, float, float *, int64_t, int) = NULL;
    // the prefill form: 16-byte pieces of every row it reads or writes
    const bool pf = dim % 4 == 0 && (k == 0 || al16(x, xs)) && (shared == NULL || al16(shared, ss)) &&
                    al16(h, hs) && al16(y, ys) && rowops_pf(n_rows);
    const int vpt = dim <= 4 * CR_THREADS ? 1 : dim <= 8 * CR_THREADS ? 2 : 4;
#define CR_PICK_PF(D)                                                                               \
    kern = vpt == 1 ? combine_rmsnorm_pf_kernel<D, 1> : vpt == 2 ? combine_rmsnorm_pf_kernel<D, 2>  \
           : combine_rmsnorm_pf_kernel<D, 4>
    if (pf) {
        mm__gpu_rowops_pf_count();
        switch (w->dtype) {
        case MM_DTYPE_BF16: CR_PICK_PF(MM_DTYPE_BF16); break;
        case MM_DTYPE_F16: CR_PICK_PF(MM_DTYPE_F16); break;
        case MM_DTYPE_F32: CR_PICK_PF(MM_DTYPE_F32); break;
        default: return MM_EINVAL;
        }
        MM_GPU_CHECK(mm_launch_dep(kern, dim3(grid), dim3(CR_THREADS), shmem, st, alpha, k, x, xs,
                                   shared, ss, h, hs, n_rows, w->data, dim, eps, y, ys, g_early));
        MM_GPU_CHECK(cudaGetLastError());
        return MM_OK;
    }
#undef CR_PICK_PF
#define CR_PICK(D)                                                                                  \
    kern = ept == 1 ? combine_rmsnorm_kernel<D, 1> : ept == 2 ? combine_rmsnorm_kernel<D, 2>        \
           : ept == 4 ? combine_rmsnorm_kernel<D, 4> : ept == 8 ? combine_rmsnorm_kernel<D, 8>      \
           : combine_rmsnorm_kernel<D, 16>
    switch (w->dtype) {
    case MM_DTYPE_BF16: CR_PICK(MM_DTYPE_BF16); break;
    case MM_DTYPE_F16: CR_PICK(MM_DTYPE_F16); break;
    case MM_DTYPE_F32: CR_PICK(MM_DTYPE_F32); break;
    default: return MM_EINVAL;
    }
#undef CR_PICK
    MM_GPU_CHECK(mm_launch_dep(kern, dim3(grid), dim3(CR_THREADS), shmem, st, alpha, k, x, xs,
                               shared, ss, h, hs, n_rows, w->data, dim, eps, y, ys, g_early));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

extern "C" mm_err mm_gpu_rmsnorm_warp(void *stream, const mm_weight *w, float eps, const float *x,
                                      int64_t xs, float *y, int64_t ys, int64_t n_rows) {
    if (w == NULL || w->data == NULL || w->rows != 1 || w->cols <= 0 || x == NULL || y == NULL ||
        n_rows < 0)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    const unsigned ws = warp_threads(), rows_per_block = 256 / ws;
    dim3 grid(mm_div_up(n_rows, rows_per_block));
    cudaStream_t st = (cudaStream_t)stream;
    switch (w->dtype) {
    case MM_DTYPE_BF16: rmsnorm_kernel<MM_DTYPE_BF16><<<grid, 256, 0, st>>>(w->data, (int)w->cols, eps, x, xs, y, ys, n_rows, g_early); break;
    case MM_DTYPE_F16: rmsnorm_kernel<MM_DTYPE_F16><<<grid, 256, 0, st>>>(w->data, (int)w->cols, eps, x, xs, y, ys, n_rows, g_early); break;
    case MM_DTYPE_F32: rmsnorm_kernel<MM_DTYPE_F32><<<grid, 256, 0, st>>>(w->data, (int)w->cols, eps, x, xs, y, ys, n_rows, g_early); break;
    default: return MM_EINVAL;
    }
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- rope: one thread per (row, head, pair) ---------------------------------------------------
__global__ void rope_kernel(struct mm_rope_args a) {
    const int half = a.rot_dim / 2;
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t total = a.n_rows * a.n_heads * half;
    if (idx >= total)
        return;
    const int i = (int)(idx % half);
    const int h = (int)((idx / half) % a.n_heads);
    const int64_t r = idx / ((int64_t)half * a.n_heads);
    const float ang = (float)a.pos[r] * a.inv_freq[i];
    const float c = cosf(ang) * a.mscale, s = sinf(ang) * a.mscale;
    float *x = a.x + r * a.row_stride + h * a.head_stride + a.rot_offset;
    const int i0 = a.style == MM_ROPE_NEOX ? i : 2 * i;
    const int i1 = a.style == MM_ROPE_NEOX ? i + half : 2 * i + 1;
    const float x0 = x[i0], x1 = x[i1];
    x[i0] = x0 * c - x1 * s;
    x[i1] = x1 * c + x0 * s;
}

extern "C" mm_err mm_gpu_rope(void *stream, const struct mm_rope_args *a) {
    if (a == NULL || a->x == NULL || a->pos == NULL || a->inv_freq == NULL || a->rot_dim <= 0 ||
        (a->rot_dim & 1) || a->n_heads <= 0 || a->n_rows < 0 ||
        (a->style != MM_ROPE_NEOX && a->style != MM_ROPE_INTERLEAVED))
        return MM_EINVAL;
    const int64_t total = a->n_rows * a->n_heads * (a->rot_dim / 2);
    if (total == 0)
        return MM_OK;
    rope_kernel<<<mm_div_up(total, 256), 256, 0, (cudaStream_t)stream>>>(*a);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- q/k head preparation in one launch: per-head rmsnorm, then rope ----------------------------
// One warp per (row, head): group a (n_a heads from the row start), then group b (n_b heads
// from b_off). The norm is rmsnorm_kernel's arithmetic for that head row (same lane-strided
// sum, butterfly, scale), the rope is rope_kernel's per pair, so the bits equal the separate
// launches'. A block's warps meet at one barrier between the two phases.
__device__ __forceinline__ float wload_rt(int dt, const void *w, int64_t i) {
    return dt == MM_DTYPE_BF16 ? wload<MM_DTYPE_BF16>(w, i)
           : dt == MM_DTYPE_F16 ? wload<MM_DTYPE_F16>(w, i) : wload<MM_DTYPE_F32>(w, i);
}

// kv_slot (below): the cache slot of (seq, pos), or NULL (error word set) for a bad index;
// kv_slot_at: its element offset from kv.base (any dtype), or -1.
__device__ __forceinline__ float *kv_slot(const struct mm_kv_view &kv, int32_t seq, int32_t pos,
                                          int *d_err);
__device__ __forceinline__ int64_t kv_slot_at(const struct mm_kv_view &kv, int32_t seq,
                                              int32_t pos, int *d_err);

// kv_put (head_rope.cuh): one element of a cache slot, f32 or bf16.

// STORE (head_norm_rope_kv_kernel): also kv_store's work for the row: group b's heads are the
// keys (n_b == n_kv_heads, head_dim == head_dim_k) and each key warp writes every element of
// its head to the cache slot as it writes it to x (the same value); n_v more warps per row
// copy the value heads (st->v) to the slot. kv_store copies x's final values, so the cache
// gets the same bits.
template <bool STORE>
__device__ __forceinline__ void hnr_body(float *x, int64_t n_rows, int64_t stride, int n_a,
                                         int n_b, int64_t b_off, int hd, const void *wa,
                                         int wa_dt, const void *wb, int wb_dt, float eps,
                                         const struct mm_rope_args &ra,
                                         const struct mm_kv_store_args *st, int *d_err) {
    const int lane = threadIdx.x % MM_WARP_SIZE;
    const int64_t wid = (int64_t)blockIdx.x * (blockDim.x / MM_WARP_SIZE) + threadIdx.x / MM_WARP_SIZE;
    const int n_v = STORE ? st->kv.n_kv_heads : 0;
    const int nh = n_a + n_b + n_v;
    const bool active = wid < n_rows * nh;
    const int64_t r = active ? wid / nh : 0;
    const int h = active ? (int)(wid % nh) : 0;
    // STORE: this head's place in the row's cache slot (keys, values), f32 or bf16 (kb)
    void *slot = NULL;
    const bool kb = STORE && st->kv.dtype == MM_DTYPE_BF16;
    if (STORE && active && h >= n_a) {
        const int64_t at = kv_slot_at(st->kv, st->row_seq[r], st->row_pos[r], d_err);
        int64_t off = -1; // this head's first element
        if (at >= 0 && h >= n_a + n_b) { // a value head: a copy
            const int hv = h - n_a - n_b, dv = st->kv.head_dim_v;
            const float *vr = st->v + r * st->v_stride + (int64_t)hv * dv;
            off = at + (int64_t)st->kv.n_kv_heads * st->kv.head_dim_k + (int64_t)hv * dv;
            void *sv = kb ? (void *)((uint16_t *)st->kv.base + off) : (void *)(st->kv.base + off);
            for (int k = lane; k < dv; k += MM_WARP_SIZE)
                kv_put(sv, kb, k, vr[k]);
        } else if (at >= 0) {
            off = at + (int64_t)(h - n_a) * hd;
        }
        if (off >= 0)
            slot = kb ? (void *)((uint16_t *)st->kv.base + off) : (void *)(st->kv.base + off);
    }
    const bool vhead = STORE && h >= n_a + n_b;
    float *xr = x + r * stride + (h < n_a ? (int64_t)h * hd : b_off + (int64_t)(h - n_a) * hd);
    const void *w = h < n_a ? wa : wb;
    const int dt = h < n_a ? wa_dt : wb_dt;
    const int ro = ra.rot_offset, rd = ra.rot_dim;
    if (active && !vhead && w != NULL) {
        float ss = 0.0f;
#pragma unroll 8
        for (int k = lane; k < hd; k += MM_WARP_SIZE)
            ss += xr[k] * xr[k];
        ss = mm_warp_sum(ss);
        const float rs = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll 8
        for (int k = lane; k < hd; k += MM_WARP_SIZE) {
            const float y = wload_rt(dt, w, k) * (xr[k] * rs);
            xr[k] = y;
            if (STORE && slot != NULL && (k < ro || k >= ro + rd))
                kv_put(slot, kb, k, y); // not rotated: final now
        }
    } else if (STORE && active && !vhead && slot != NULL) {
        for (int k = lane; k < hd; k += MM_WARP_SIZE) // no norm: the elements rope leaves
            if (k < ro || k >= ro + rd)
                kv_put(slot, kb, k, xr[k]);
    }
    __syncthreads();
    if (!active || vhead)
        return;
    const int half = rd / 2;
    float *xh = xr + ro;
    for (int i = lane; i < half; i += MM_WARP_SIZE) {
        const float ang = (float)ra.pos[r] * ra.inv_freq[i];
        const float c = cosf(ang) * ra.mscale, sn = sinf(ang) * ra.mscale;
        const int i0 = ra.style == MM_ROPE_NEOX ? i : 2 * i;
        const int i1 = ra.style == MM_ROPE_NEOX ? i + half : 2 * i + 1;
        const float x0 = xh[i0], x1 = xh[i1];
        const float y0 = x0 * c - x1 * sn, y1 = x1 * c + x0 * sn;
        xh[i0] = y0;
        xh[i1] = y1;
        if (STORE && slot != NULL) {
            kv_put(slot, kb, ro + i0, y0);
            kv_put(slot, kb, ro + i1, y1);
        }
    }
}

__global__ void head_norm_rope_kernel(float *x, int64_t n_rows, int64_t stride, int n_a, int n_b,
                                      int64_t b_off, int hd, const void *wa, int wa_dt,
                                      const void *wb, int wb_dt, float eps, struct mm_rope_args ra) {
    mm_dep_signal();
    mm_dep_wait();
    hnr_body<false>(x, n_rows, stride, n_a, n_b, b_off, hd, wa, wa_dt, wb, wb_dt, eps, ra, NULL,
                    NULL);
}

__global__ void head_norm_rope_kv_kernel(float *x, int64_t n_rows, int64_t stride, int n_a,
                                         int n_b, int64_t b_off, int hd, const void *wa,
                                         int wa_dt, const void *wb, int wb_dt, float eps,
                                         struct mm_rope_args ra, struct mm_kv_store_args st,
                                         int *d_err) {
    mm_dep_signal();
    mm_dep_wait();
    hnr_body<true>(x, n_rows, stride, n_a, n_b, b_off, hd, wa, wa_dt, wb, wb_dt, eps, ra, &st,
                   d_err);
}

// head_norm_rope_kv_kernel's prefill form (see "prefill forms of the row ops" above): NeoX
// rotation of whole heads of HD dims, keys from group b of x, values of HD dims. A warp takes
// HNR_PF_UNITS (row, head) units in turn, each held in registers (lane l: elements l + W j, W
// the warp width), all loaded before the first is computed: the norm (rmsnorm_kernel's
// lane-strided sum and scale), the rotation of the pairs (i, i + HD / 2), which sit in one
// lane, with rope_kernel's expressions, then x and the cache slot written once. A value head
// is copied to its slot. The operations of hnr_body<true> per element, so the same bits.
#define HNR_PF_UNITS 2
#define HNR_PF_HD 128
template <int HD>
__global__ void __launch_bounds__(256) head_norm_rope_kv_pf_kernel(
    float *x, int64_t n_rows, int64_t stride, int n_a, int n_b, int64_t b_off, const void *wa,
    int wa_dt, const void *wb, int wb_dt, float eps, struct mm_rope_args ra,
    struct mm_kv_store_args st, int *d_err) {
    constexpr int J = HD / MM_WARP_SIZE, JH = J / 2, U = HNR_PF_UNITS;
    static_assert(J % 2 == 0, "a lane holds both elements of its NeoX pairs");
    mm_dep_signal();
    mm_dep_wait();
    const int lane = threadIdx.x % MM_WARP_SIZE;
    const int64_t gw = (int64_t)blockIdx.x * (blockDim.x / MM_WARP_SIZE) + threadIdx.x / MM_WARP_SIZE;
    const int n_v = st.kv.n_kv_heads, nh = n_a + n_b + n_v;
    const int64_t units = n_rows * nh;
    const bool kb = st.kv.dtype == MM_DTYPE_BF16;
    float v[U][J], wv[U][J], fr[U][JH];
    int64_t rr[U], at[U];
    int hh[U];
    float pos[U];
    // every load of the warp's units first: the head, its norm weights, the rotation's
    // frequencies and position, and (keys and values) the cache slot
#pragma unroll
    for (int t = 0; t < U; t++) {
        const int64_t u = gw * U + t;
        hh[t] = -1;
        rr[t] = 0;
        at[t] = -1;
        if (u >= units)
            continue;
        const int64_t r = u / nh;
        const int h = (int)(u % nh);
        rr[t] = r;
        hh[t] = h;
        const float *src = h < n_a         ? x + r * stride + (int64_t)h * HD
                           : h < n_a + n_b ? x + r * stride + b_off + (int64_t)(h - n_a) * HD
                                           : st.v + r * st.v_stride + (int64_t)(h - n_a - n_b) * HD;
#pragma unroll
        for (int j = 0; j < J; j++)
            v[t][j] = src[lane + MM_WARP_SIZE * j];
        if (h < n_a + n_b) {
            const void *w = h < n_a ? wa : wb;
            const int dt = h < n_a ? wa_dt : wb_dt;
#pragma unroll
            for (int j = 0; j < J; j++)
                wv[t][j] = w != NULL ? wload_rt(dt, w, lane + MM_WARP_SIZE * j) : 0.0f;
#pragma unroll
            for (int j = 0; j < JH; j++)
                fr[t][j] = ra.inv_freq[lane + MM_WARP_SIZE * j];
            pos[t] = (float)ra.pos[r];
        }
        if (h >= n_a)
            at[t] = kv_slot_at(st.kv, st.row_seq[r], st.row_pos[r], d_err);
    }
#pragma unroll
    for (int t = 0; t < U; t++) {
        const int h = hh[t];
        if (h < 0)
            continue;
        const int64_t r = rr[t];
        if (h >= n_a + n_b) { // a value head: a copy
            if (at[t] >= 0) {
                const int64_t off = at[t] + (int64_t)st.kv.n_kv_heads * st.kv.head_dim_k +
                                    (int64_t)(h - n_a - n_b) * HD;
                void *sv = kb ? (void *)((uint16_t *)st.kv.base + off) : (void *)(st.kv.base + off);
#pragma unroll
                for (int j = 0; j < J; j++)
                    kv_put(sv, kb, lane + MM_WARP_SIZE * j, v[t][j]);
            }
            continue;
        }
        if ((h < n_a ? wa : wb) != NULL) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < J; j++)
                ss += v[t][j] * v[t][j];
            ss = mm_warp_sum(ss);
            const float rs = 1.0f / sqrtf(ss / (float)HD + eps);
#pragma unroll
            for (int j = 0; j < J; j++)
                v[t][j] = wv[t][j] * (v[t][j] * rs);
        }
#pragma unroll
        for (int j = 0; j < JH; j++) {
            const float ang = pos[t] * fr[t][j];
            const float c = cosf(ang) * ra.mscale, sn = sinf(ang) * ra.mscale;
            const float x0 = v[t][j], x1 = v[t][j + JH];
            const float y0 = x0 * c - x1 * sn, y1 = x1 * c + x0 * sn;
            v[t][j] = y0;
            v[t][j + JH] = y1;
        }
        float *xr = x + r * stride + (h < n_a ? (int64_t)h * HD : b_off + (int64_t)(h - n_a) * HD);
#pragma unroll
        for (int j = 0; j < J; j++)
            xr[lane + MM_WARP_SIZE * j] = v[t][j];
        if (h >= n_a && at[t] >= 0) {
            const int64_t off = at[t] + (int64_t)(h - n_a) * HD;
            void *sk = kb ? (void *)((uint16_t *)st.kv.base + off) : (void *)(st.kv.base + off);
#pragma unroll
            for (int j = 0; j < J; j++)
                kv_put(sk, kb, lane + MM_WARP_SIZE * j, v[t][j]);
        }
    }
}

// A block per row (UPW units per warp: warp w takes heads w, w + NW, ...; NW warps of 256
// threads): as head_norm_rope_kv_pf_kernel, but the row's rotation cos and sin (rope_kernel's
// expressions of the same inputs, so the same values) are computed once per warp for all its
// heads instead of once per head, the norm weights of each group and the cache slot loaded
// once per warp.
template <int HD, int UPW>
__global__ void __launch_bounds__(256) head_norm_rope_kv_row_kernel(
    float *x, int64_t stride, int n_a, int n_b, int64_t b_off, const void *wa, int wa_dt,
    const void *wb, int wb_dt, float eps, struct mm_rope_args ra, struct mm_kv_store_args st,
    int *d_err) {
    constexpr int J = HD / MM_WARP_SIZE, JH = J / 2, NW = 256 / MM_WARP_SIZE;
    static_assert(J % 2 == 0, "a lane holds both elements of its NeoX pairs");
    mm_dep_signal();
    mm_dep_wait();
    const int lane = threadIdx.x % MM_WARP_SIZE, warp = threadIdx.x / MM_WARP_SIZE;
    const int64_t r = blockIdx.x;
    const int n_v = st.kv.n_kv_heads, nh = n_a + n_b + n_v;
    const bool kb = st.kv.dtype == MM_DTYPE_BF16;
    float v[UPW][J];
    bool kvw = false; // this warp has a key or value head
#pragma unroll
    for (int t = 0; t < UPW; t++) {
        const int h = warp + NW * t;
        if (h >= nh)
            continue;
        kvw = kvw || h >= n_a;
        const float *src = h < n_a         ? x + r * stride + (int64_t)h * HD
                           : h < n_a + n_b ? x + r * stride + b_off + (int64_t)(h - n_a) * HD
                                           : st.v + r * st.v_stride + (int64_t)(h - n_a - n_b) * HD;
#pragma unroll
        for (int j = 0; j < J; j++)
            v[t][j] = src[lane + MM_WARP_SIZE * j];
    }
    float wva[J], wvb[J], fr[JH];
#pragma unroll
    for (int j = 0; j < J; j++) {
        wva[j] = wa != NULL ? wload_rt(wa_dt, wa, lane + MM_WARP_SIZE * j) : 0.0f;
        wvb[j] = wb != NULL ? wload_rt(wb_dt, wb, lane + MM_WARP_SIZE * j) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < JH; j++)
        fr[j] = ra.inv_freq[lane + MM_WARP_SIZE * j];
    const float pos = (float)ra.pos[r];
    const int64_t at = kvw ? kv_slot_at(st.kv, st.row_seq[r], st.row_pos[r], d_err) : -1;
    float cs[JH], sn[JH];
    hr_angles<JH>(pos, fr, ra.mscale, cs, sn);
#pragma unroll
    for (int t = 0; t < UPW; t++) {
        const int h = warp + NW * t;
        if (h >= nh)
            continue;
        if (h >= n_a + n_b) { // a value head: a copy
            if (at >= 0) {
                const int64_t off = at + (int64_t)st.kv.n_kv_heads * st.kv.head_dim_k +
                                    (int64_t)(h - n_a - n_b) * HD;
                void *sv = kb ? (void *)((uint16_t *)st.kv.base + off) : (void *)(st.kv.base + off);
#pragma unroll
                for (int j = 0; j < J; j++)
                    kv_put(sv, kb, lane + MM_WARP_SIZE * j, v[t][j]);
            }
            continue;
        }
        if ((h < n_a ? wa : wb) != NULL)
            hr_norm<J>(v[t], h < n_a ? wva : wvb, HD, eps);
        hr_rope<J>(v[t], cs, sn);
        float *xr = x + r * stride + (h < n_a ? (int64_t)h * HD : b_off + (int64_t)(h - n_a) * HD);
#pragma unroll
        for (int j = 0; j < J; j++)
            xr[lane + MM_WARP_SIZE * j] = v[t][j];
        if (h >= n_a && at >= 0) {
            const int64_t off = at + (int64_t)(h - n_a) * HD;
            void *sk = kb ? (void *)((uint16_t *)st.kv.base + off) : (void *)(st.kv.base + off);
#pragma unroll
            for (int j = 0; j < J; j++)
                kv_put(sk, kb, lane + MM_WARP_SIZE * j, v[t][j]);
        }
    }
}
#define HNR_ROW_MAX_UPW 6

extern "C" mm_err mm_gpu_head_norm_rope(void *stream, float *d_x, int64_t n_rows, int64_t stride,
                                        int n_a, int n_b, int64_t b_off, int head_dim,
                                        const mm_weight *wa, const mm_weight *wb, float eps,
                                        const struct mm_rope_args *ra) {
    if (d_x == NULL || ra == NULL || ra->pos == NULL || ra->inv_freq == NULL || n_rows < 0 ||
        n_a < 0 || n_b < 0 || head_dim <= 0 || ra->rot_dim <= 0 || (ra->rot_dim & 1) ||
        ra->rot_offset < 0 || ra->rot_offset + ra->rot_dim > head_dim ||
        (ra->style != MM_ROPE_NEOX && ra->style != MM_ROPE_INTERLEAVED) ||
        (wa != NULL && (wa->data == NULL || wa->cols != head_dim)) ||
        (wb != NULL && (wb->data == NULL || wb->cols != head_dim)))
        return MM_EINVAL;
    const int64_t warps = n_rows * (n_a + n_b);
    if (warps == 0)
        return MM_OK;
    const unsigned per_block = 256 / warp_threads();
    MM_GPU_CHECK(mm_launch_dep(head_norm_rope_kernel, dim3(mm_div_up(warps, per_block)), dim3(256), 0,
        (cudaStream_t)stream, d_x, n_rows, stride, n_a, n_b, b_off, head_dim, wa ? wa->data : NULL,
        wa ? (int)wa->dtype : 0, wb ? wb->data : NULL, wb ? (int)wb->dtype : 0, eps, *ra));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- paged KV cache ---------------------------------------------------------------------------
// The cache is f32, or bf16 (struct mm_kv_view.dtype) where attention_tc.cu's
// mm_gpu_kv_dtype chose it: only the tensor-core contract's kernels read a bf16 cache (they
// round an f32 cache's K and V to bf16 with the same instruction kv_put stores with, so both
// caches give them the same operands); ops.cu's f32 kernels refuse it (MM_EINVAL).
__device__ __forceinline__ int64_t kv_slot_at(const struct mm_kv_view &kv, int32_t seq,
                                              int32_t pos, int *d_err) {
    if (pos < 0 || seq < 0 || pos / kv.block_size >= kv.max_blocks) {
        flag(d_err, ERR_INDEX);
        return -1;
    }
    const int32_t blk = kv.block_tables[(int64_t)seq * kv.max_blocks + pos / kv.block_size];
    if (blk < 0) {
        flag(d_err, ERR_INDEX);
        return -1;
    }
    return (int64_t)blk * kv.block_stride + (int64_t)(pos % kv.block_size) * kv.slot_stride;
}

__device__ __forceinline__ float *kv_slot(const struct mm_kv_view &kv, int32_t seq, int32_t pos,
                                          int *d_err) {
    const int64_t at = kv_slot_at(kv, seq, pos, d_err);
    return at < 0 ? NULL : kv.base + at;
}

__global__ void kv_store_kernel(struct mm_kv_store_args a, int *d_err) {
    mm_dep_signal();
    mm_dep_wait();
    const int64_t nk = (int64_t)a.kv.n_kv_heads * a.kv.head_dim_k;
    const int64_t nv = (int64_t)a.kv.n_kv_heads * a.kv.head_dim_v;
    const int64_t r = blockIdx.x;
    const int64_t at = kv_slot_at(a.kv, a.row_seq[r], a.row_pos[r], d_err);
    if (at < 0)
        return;
    if (a.kv.dtype == MM_DTYPE_BF16) { // pairs (nk, nv even: kv_bf16_shape_ok)
        uint32_t *slot = (uint32_t *)((uint16_t *)a.kv.base + at);
        for (int64_t j = 2 * threadIdx.x; j < nk + nv; j += 2 * blockDim.x) {
            const float *x = j < nk ? a.k + r * a.k_stride + j : a.v + r * a.v_stride + (j - nk);
            slot[j / 2] = mm_gpu_pack_bf16x2(x[0], x[1]);
        }
        return;
    }
    float *slot = a.kv.base + at;
    for (int64_t j = threadIdx.x; j < nk + nv; j += blockDim.x)
        slot[j] = j < nk ? a.k[r * a.k_stride + j] : a.v[r * a.v_stride + (j - nk)];
}

// A bf16 view's shape: the one mm_gpu_kv_dtype gives bf16 for (head dims multiples of 8 up to
// 128, 16-byte-aligned slots), so stores go in pairs and the readers copy 16-byte pieces.
static bool kv_bf16_shape_ok(const struct mm_kv_view *kv) {
    return kv->head_dim_k > 0 && kv->head_dim_v > 0 && kv->head_dim_k <= 128 &&
           kv->head_dim_v <= 128 && kv->head_dim_k % 8 == 0 && kv->head_dim_v % 8 == 0 &&
           ((uintptr_t)kv->base & 15) == 0 && kv->block_stride % 8 == 0 &&
           kv->slot_stride % 8 == 0;
}

// A view these kernels take: f32, or bf16 of kv_bf16_shape_ok's shape.
static bool kv_view_ok(const struct mm_kv_view *kv) {
    return kv->dtype == MM_DTYPE_F32 || (kv->dtype == MM_DTYPE_BF16 && kv_bf16_shape_ok(kv));
}

extern "C" mm_err mm_gpu_kv_store(void *stream, const struct mm_kv_store_args *a, int *d_err) {
    if (a == NULL || a->kv.base == NULL || a->kv.block_tables == NULL || a->k == NULL ||
        a->v == NULL || a->row_seq == NULL || a->row_pos == NULL || a->kv.block_size <= 0 ||
        a->n_rows < 0 || !kv_view_ok(&a->kv))
        return MM_EINVAL;
    if (a->n_rows == 0)
        return MM_OK;
    MM_GPU_CHECK(mm_launch_dep(kv_store_kernel, dim3((unsigned)a->n_rows), dim3(256), 0,
                               (cudaStream_t)stream, *a, d_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// head_norm_rope then kv_store (kernels.h head_norm_rope_kv) in one launch when the keys
// kv_store reads are group b of x (st->k == x + b_off, same row stride, n_b == n_kv_heads,
// head_dim == head_dim_k, the same rows); otherwise the two launches.
extern "C" mm_err mm_gpu_head_norm_rope_kv(void *stream, float *d_x, int64_t n_rows,
                                           int64_t stride, int n_a, int n_b, int64_t b_off,
                                           int head_dim, const mm_weight *wa, const mm_weight *wb,
                                           float eps, const struct mm_rope_args *ra,
                                           const struct mm_kv_store_args *st, int *d_err) {
    if (st == NULL || st->kv.base == NULL || st->kv.block_tables == NULL || st->k == NULL ||
        st->v == NULL || st->row_seq == NULL || st->row_pos == NULL || st->kv.block_size <= 0 ||
        st->n_rows < 0 || !kv_view_ok(&st->kv))
        return MM_EINVAL;
    const bool one = d_x != NULL && st->k == d_x + b_off && st->k_stride == stride &&
                     n_b == st->kv.n_kv_heads && head_dim == st->kv.head_dim_k &&
                     st->n_rows == n_rows && st->kv.head_dim_v > 0;
    if (!one) {
        MM_TRY(mm_gpu_head_norm_rope(stream, d_x, n_rows, stride, n_a, n_b, b_off, head_dim, wa,
                                     wb, eps, ra));
        return mm_gpu_kv_store(stream, st, d_err);
    }
    if (ra == NULL || ra->pos == NULL || ra->inv_freq == NULL || n_rows < 0 || n_a < 0 ||
        n_b < 0 || head_dim <= 0 || ra->rot_dim <= 0 || (ra->rot_dim & 1) ||
        ra->rot_offset < 0 || ra->rot_offset + ra->rot_dim > head_dim ||
        (ra->style != MM_ROPE_NEOX && ra->style != MM_ROPE_INTERLEAVED) ||
        (wa != NULL && (wa->data == NULL || wa->cols != head_dim)) ||
        (wb != NULL && (wb->data == NULL || wb->cols != head_dim)))
        return MM_EINVAL;
    const int64_t warps = n_rows * (n_a + 2 * (int64_t)n_b);
    if (warps == 0)
        return MM_OK;
    const unsigned per_block = 256 / warp_threads();
    if (ra->style == MM_ROPE_NEOX && ra->rot_offset == 0 && ra->rot_dim == head_dim &&
        head_dim == HNR_PF_HD && st->kv.head_dim_v == HNR_PF_HD &&
        HNR_PF_HD % (2 * warp_threads()) == 0 && rowops_pf(n_rows)) {
        const int upw = (int)mm_div_up(n_a + 2 * (int64_t)n_b, per_block); // a block per row
        if (upw <= HNR_ROW_MAX_UPW && n_rows <= INT32_MAX) {
            mm__gpu_rowops_pf_count();
            void (*kern)(float *, int64_t, int, int, int64_t, const void *, int, const void *, int,
                         float, struct mm_rope_args, struct mm_kv_store_args, int *) =
                upw == 1   ? head_norm_rope_kv_row_kernel<HNR_PF_HD, 1>
                : upw == 2 ? head_norm_rope_kv_row_kernel<HNR_PF_HD, 2>
                : upw == 3 ? head_norm_rope_kv_row_kernel<HNR_PF_HD, 3>
                : upw == 4 ? head_norm_rope_kv_row_kernel<HNR_PF_HD, 4>
                : upw == 5 ? head_norm_rope_kv_row_kernel<HNR_PF_HD, 5>
                           : head_norm_rope_kv_row_kernel<HNR_PF_HD, 6>;
            MM_GPU_CHECK(mm_launch_dep(kern, dim3((unsigned)n_rows), dim3(256), 0,
                (cudaStream_t)stream, d_x, stride, n_a, n_b, b_off, wa ? wa->data : NULL,
                wa ? (int)wa->dtype : 0, wb ? wb->data : NULL, wb ? (int)wb->dtype : 0, eps, *ra,
                *st, d_err));
            MM_GPU_CHECK(cudaGetLastError());
            return MM_OK;
        }
        const int64_t pw = mm_div_up(warps, HNR_PF_UNITS); // warps of HNR_PF_UNITS units
        MM_GPU_CHECK(mm_launch_dep(head_norm_rope_kv_pf_kernel<HNR_PF_HD>,
            dim3(mm_div_up(pw, per_block)), dim3(256), 0, (cudaStream_t)stream, d_x, n_rows,
            stride, n_a, n_b, b_off, wa ? wa->data : NULL, wa ? (int)wa->dtype : 0,
            wb ? wb->data : NULL, wb ? (int)wb->dtype : 0, eps, *ra, *st, d_err));
        MM_GPU_CHECK(cudaGetLastError());
        return MM_OK;
    }
    MM_GPU_CHECK(mm_launch_dep(head_norm_rope_kv_kernel, dim3(mm_div_up(warps, per_block)),
        dim3(256), 0, (cudaStream_t)stream, d_x, n_rows, stride, n_a, n_b, b_off, head_dim,
        wa ? wa->data : NULL, wa ? (int)wa->dtype : 0, wb ? wb->data : NULL,
        wb ? (int)wb->dtype : 0, eps, *ra, *st, d_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

#define ATT_THREADS 128
#define ATT_CHUNK 128 // keys per online-softmax step, aligned to absolute positions
#define ATT_MAX_DV 512
// Loads in flight (the arithmetic and its order do not depend on them): a key's score reads
// ATT_K_VEC float4 per round (a 128-dim key in 2 rounds), the value sums ATT_V_KEYS keys'
// values per round.
// (The previous grouping, 8 and 16, stays as mm_gpu_attention_ref for the op test's bit check.)
#define ATT_K_VEC_DEF 16
#define ATT_V_KEYS_DEF 32
// Wide form (mm_gpu_set_attention_wide(1), env MM_GPU_ATT_WIDE=1; off): a 128-dim key in one
// round and a whole 128-key chunk's values in one round, so a decode chunk costs one round
// trip for the scores and one for the values instead of 2 and 4. Same fmaf sequence (the bits
// do not depend on the grouping; cuda_attention_tcd_test, rows 1..64). 255 registers per
// thread (no spills), so only for decode-sized calls (<= ATT_WIDE_MAX_BLOCKS (row, head)
// blocks). Measured (H200, 06:38 UTC, MM_GPU_ATT_TC=0): 23.9 us per decode call at ~194 tokens
// of context by ncu against 29.2, but the whole-model decode no faster (batch 1 1577 / 1588
// tok/s against 1589 / 1586), so it stays off. (The CUDA default is the tensor-core contract,
// attention_tc.cu / attention_tcd.cu; this kernel serves HIP and head dims above 128.)
#define ATT_K_VEC_WIDE 32
#define ATT_V_KEYS_WIDE 128
#define ATT_WIDE_MAX_BLOCKS 264
static int g_att_wide = 0;
extern "C" void mm_gpu_set_attention_wide(int on) { g_att_wide = on != 0; }

#if MM_GPU_HAVE_WMMA
__device__ __forceinline__ void att_cp16(void *dst, const void *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
#define ATT_HAVE_CP 1
#else
#define ATT_HAVE_CP 0
#endif

// One block per (row, head). Dynamic shared: q (dk) + scores (ATT_CHUNK).
template <int ATT_K_VEC, int ATT_V_KEYS>
__global__ void __launch_bounds__(ATT_THREADS) attention_kernel(struct mm_attn_args a, int *d_err,
                                                                int early) {
    early_launch(early);
    mm_dep_wait();
    extern __shared__ __align__(16) float sh[];
    __shared__ const float *slots[ATT_CHUNK];
    const struct mm_kv_view &kv = a.kv;
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    float *qs = sh, *ps = sh + dk;
    const int64_t r = blockIdx.x;
    const int h = blockIdx.y, kvh = h / (a.n_heads / kv.n_kv_heads);
    const int32_t seq = a.row_seq[r], pos = a.row_pos[r];
    float *o = a.out + r * a.out_stride + (int64_t)h * dv;
    if (pos < 0 || seq < 0 || pos / kv.block_size >= kv.max_blocks) {
        if (threadIdx.x == 0)
            flag(d_err, ERR_INDEX);
        return;
    }
    for (int d = threadIdx.x; d < dk; d += ATT_THREADS)
        qs[d] = a.q[r * a.q_stride + (int64_t)h * dk + d];
    int32_t first = 0;
    if (a.window > 0 && pos - a.window + 1 > 0)
        first = pos - a.window + 1;
    const int64_t v_off = (int64_t)kv.n_kv_heads * dk;
    float acc[ATT_MAX_DV / ATT_THREADS];
#pragma unroll
    for (int j = 0; j < ATT_MAX_DV / ATT_THREADS; j++)
        acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    __syncthreads();
    for (int32_t c0 = (first / ATT_CHUNK) * ATT_CHUNK; c0 <= pos; c0 += ATT_CHUNK) {
        // Scores: one thread per key, dims in order.
        const int32_t t = c0 + threadIdx.x;
        float s = -INFINITY;
        slots[threadIdx.x] = NULL;
        const float *k = NULL;
        if (t >= first && t <= pos) {
            k = kv_slot(kv, seq, t, d_err);
            slots[threadIdx.x] = k;
        }
        if (t >= first && t <= pos) {
            if (k != NULL) {
                k += (int64_t)kvh * dk;
                float dot = 0.0f;
                if ((dk & 3) == 0 && ((uintptr_t)k & 15) == 0) {
                    for (int d0 = 0; d0 < dk; d0 += 4 * ATT_K_VEC) {
                        float4 kk[ATT_K_VEC];
#pragma unroll
                        for (int q = 0; q < ATT_K_VEC; q++)
                            kk[q] = d0 + 4 * q < dk ? *(const float4 *)(k + d0 + 4 * q)
                                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                        for (int q = 0; q < ATT_K_VEC; q++) {
                            const int d = d0 + 4 * q;
                            if (d < dk) {
                                dot = fmaf(qs[d], kk[q].x, dot);
                                dot = fmaf(qs[d + 1], kk[q].y, dot);
                                dot = fmaf(qs[d + 2], kk[q].z, dot);
                                dot = fmaf(qs[d + 3], kk[q].w, dot);
                            }
                        }
                    }
                } else {
                    for (int d = 0; d < dk; d++)
                        dot = fmaf(qs[d], k[d], dot);
                }
                s = dot * a.scale;
            }
        }
        const float cmax = mm_block_max(s);
        const float m_new = fmaxf(m, cmax);
        const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
        ps[threadIdx.x] = s == -INFINITY ? 0.0f : expf(s - m_new);
        __syncthreads();
        const int n_t = min(ATT_CHUNK, pos - c0 + 1);
        float psum = 0.0f;
        for (int j = 0; j < n_t; j++)
            psum += ps[j];
        l = l * alpha + psum;
#pragma unroll
        for (int j = 0; j < ATT_MAX_DV / ATT_THREADS; j++) {
            const int d = threadIdx.x + j * ATT_THREADS;
            if (d >= dv)
                break;
            float sum = 0.0f;
            const int64_t vo = v_off + (int64_t)kvh * dv + d;
            for (int u0 = 0; u0 < n_t; u0 += ATT_V_KEYS) {
                float vv[ATT_V_KEYS];
#pragma unroll
                for (int q = 0; q < ATT_V_KEYS; q++) {
                    const float *slot = u0 + q < n_t ? slots[u0 + q] : NULL;
                    vv[q] = slot == NULL ? 0.0f : slot[vo];
                }
#pragma unroll
                for (int q = 0; q < ATT_V_KEYS; q++) {
                    const int u = u0 + q;
                    if (u < n_t && ps[u] != 0.0f && slots[u] != NULL)
                        sum = fmaf(ps[u], vv[q], sum);
                }
            }
            acc[j] = acc[j] * alpha + sum;
        }
        m = m_new;
        __syncthreads();
    }
    const float inv = 1.0f / l;
#pragma unroll
    for (int j = 0; j < ATT_MAX_DV / ATT_THREADS; j++) {
        const int d = threadIdx.x + j * ATT_THREADS;
        if (d < dv)
            o[d] = acc[j] * inv;
    }
}

static mm_err attention_launch(void *stream, const struct mm_attn_args *a, int *d_err, bool ref) {
    if (a == NULL || a->q == NULL || a->out == NULL || a->row_seq == NULL || a->row_pos == NULL ||
        a->kv.dtype != MM_DTYPE_F32 || a->kv.base == NULL || a->kv.block_tables == NULL || a->n_heads <= 0 ||
        a->kv.n_kv_heads <= 0 || a->n_heads % a->kv.n_kv_heads != 0 || a->kv.block_size <= 0 ||
        a->kv.head_dim_k <= 0 || a->kv.head_dim_v <= 0 || a->kv.head_dim_v > ATT_MAX_DV ||
        a->kv.head_dim_k > 4096 || a->n_rows < 0)
        return MM_EINVAL;
    if (a->n_rows == 0)
        return MM_OK;
    const size_t shmem = (size_t)(a->kv.head_dim_k + ATT_CHUNK) * sizeof(float);
    dim3 grid((unsigned)a->n_rows, (unsigned)a->n_heads);
    if (ref)
        attention_kernel<8, 16><<<grid, ATT_THREADS, shmem, (cudaStream_t)stream>>>(*a, d_err, g_early);
    else if (g_att_wide && a->n_rows * a->n_heads <= ATT_WIDE_MAX_BLOCKS) // 255 registers: few blocks
        MM_GPU_CHECK(mm_launch_dep(attention_kernel<ATT_K_VEC_WIDE, ATT_V_KEYS_WIDE>, grid,
                                   dim3(ATT_THREADS), shmem, (cudaStream_t)stream, *a, d_err, g_early));
    else
        MM_GPU_CHECK(mm_launch_dep(attention_kernel<ATT_K_VEC_DEF, ATT_V_KEYS_DEF>, grid,
                                   dim3(ATT_THREADS), shmem, (cudaStream_t)stream, *a, d_err, g_early));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- prefill attention: K/V chunks staged once per block for many (row, head) units -----------
// The decode kernel above runs one block per (row, head), so at a 4096-row prefill every (row,
// head) re-reads its whole causal K/V prefix (66 ms per Qwen3-30B-A3B layer on an H200). This
// kernel gives each (row, head) the same arithmetic in the same order, but a block holds
// PF_UNITS (row, head) units: R consecutive rows x Gb query heads of one kv head (Gb a divisor
// of the GQA group), and for each 128-key chunk (aligned to absolute positions, as above) it
// copies the chunk's keys and values of that kv head into shared memory once (cp.async, the next
// chunk's keys while this chunk's values are summed, its values while the next scores are
// computed). Per unit and chunk, exactly the decode kernel's operations:
//   s_t = (fmaf chain over d = 0..dk-1 of q_d k_t,d, from 0) * scale, rounded (-inf outside
//   [first, pos] or where the slot is missing); m_new = max(m, max_t s_t); alpha = m == -inf ?
//   0 : expf(m - m_new); p_t = s_t == -inf ? 0 : expf(s_t - m_new); psum = p_0 + p_1 + ...
//   (t ascending, plain adds); l = fma(l, alpha, psum); per d: sum = fmaf chain of p_t v_t,d over
//   t ascending, skipping p_t == 0; acc = fma(alpha, acc, sum); finally out = acc * (1 / l).
// (Contraction as nvcc compiles the decode kernel: s's multiply and the subtractions are not
// fused, the l and acc updates are; written here with explicit _rn intrinsics so no compiler
// choice can differ. A key past a row's pos contributes a zero p, which adds nothing to psum and
// is skipped in the value sums, so the tile may compute whole chunks for every unit.) The max
// reduction's order does not matter (max is exact; a -0/+0 tie only moves exp(+-0) = 1).
// Only the units whose chunk range contains the chunk update their state. Rows of different
// sequences in one block are taken one sequence at a time (segments); each segment walks the
// chunks from its units' lowest first chunk to their highest position.
// Threads: 256; scores as a 64 units x 128 keys tile (4 units x 8 keys per thread), value sums
// as 64 units x 128 dims (4 x 8). Needs head_dim_k, head_dim_v <= 128 and multiples of 4 and a
// 16-byte aligned cache (the launcher checks; otherwise the decode kernel runs). CUDA only (the
// tile needs ~205 KB of shared memory); under HIP the decode kernel runs.
#define PF_THREADS 256
#define PF_UNITS 64
#define PF_DMAX 128
#define PF_LD 132 // floats per staged key/value/query row (conflict-free float4 columns)
#define PF_PLD 68 // floats per key row of p
#define PF_MIN_ROWS 128
#define PF_SHMEM ((size_t)(3 * ATT_CHUNK * PF_LD + ATT_CHUNK * PF_PLD) * sizeof(float) - \
                  (size_t)(ATT_CHUNK - PF_UNITS) * PF_LD * sizeof(float))
static int g_att_pf = -1; // -1: from MM_GPU_ATT_PREFILL at first use (0 off); 1 auto; 2 always

#if ATT_HAVE_CP
#define ATT_HAVE_PF 1
__device__ __forceinline__ void pf_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void pf_wait1(void) {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// Copies the keys (kv_off 0) or values of chunk c0 of sequence seq, kv head kvh, into dst
// ([key][PF_LD]): warp w takes keys w, w + 8, ..., lane i the i-th float4 of a key. Keys
// outside [t_lo, t_hi] or without a slot are not copied; with ok != NULL their validity is
// recorded there. One commit group.
__device__ __forceinline__ void pf_stage(const struct mm_kv_view &kv, int32_t seq, int kvh, int dim,
                                         int64_t kv_off, int32_t c0, int32_t t_lo, int32_t t_hi,
                                         float *dst, int *ok, int *d_err) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int key = warp; key < ATT_CHUNK; key += PF_THREADS / 32) {
        const int32_t t = c0 + key;
        const float *slot = NULL;
        if (t >= t_lo && t <= t_hi)
            slot = kv_slot(kv, seq, t, d_err);
        if (ok != NULL && lane == 0)
            ok[key] = slot != NULL;
        if (slot != NULL && lane * 4 < dim)
            att_cp16(dst + key * PF_LD + lane * 4, slot + kv_off + lane * 4);
    }
    pf_commit();
}

__global__ void __launch_bounds__(PF_THREADS, 1) attention_pf_kernel(struct mm_attn_args a, int gb,
                                                                     int *d_err, int early) {
    early_launch(early);
    extern __shared__ __align__(16) float sh[];
    float *ks = sh, *vs = ks + ATT_CHUNK * PF_LD, *qs = vs + ATT_CHUNK * PF_LD;
    float *ps = qs + PF_UNITS * PF_LD; // [key][PF_PLD]
    __shared__ int kok[ATT_CHUNK];
    __shared__ int32_t u_row[PF_UNITS], u_seq[PF_UNITS], u_pos[PF_UNITS], u_first[PF_UNITS];
    __shared__ int u_state[PF_UNITS]; // 0 done or invalid, 1 to do, 2 in this segment
    __shared__ int u_part[PF_UNITS];  // this chunk updates the unit
    __shared__ float u_alpha[PF_UNITS], u_inv[PF_UNITS];
    __shared__ int32_t seg[4];        // seq, c_lo, t_lo, t_hi
    const struct mm_kv_view &kv = a.kv;
    const int dk = kv.head_dim_k, dv = kv.head_dim_v, tid = threadIdx.x;
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gb, rows_pb = PF_UNITS / gb;
    const int kvh = blockIdx.y / per_kv, h0 = kvh * group + (blockIdx.y % per_kv) * gb;
    // heavy (late) row tiles first: the causal prefix grows with the row
    const int64_t r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * rows_pb;
    const int64_t v_off = (int64_t)kv.n_kv_heads * dk + (int64_t)kvh * dv;
    if (tid < PF_UNITS) {
        const int rl = tid / gb;
        const int64_t r = r0 + rl;
        int st = 0;
        int32_t sq = -1, ps_ = -1, fi = 0;
        if (rl < rows_pb && r < a.n_rows) {
            sq = a.row_seq[r], ps_ = a.row_pos[r];
            if (ps_ < 0 || sq < 0 || ps_ / kv.block_size >= kv.max_blocks) {
                flag(d_err, ERR_INDEX);
            } else {
                st = 1;
                if (a.window > 0 && ps_ - a.window + 1 > 0)
                    fi = ps_ - a.window + 1;
            }
        }
        u_row[tid] = (int32_t)(rl < rows_pb ? r - r0 : 0);
        u_seq[tid] = sq, u_pos[tid] = ps_, u_first[tid] = fi, u_state[tid] = st;
    }
    for (int i = tid; i < PF_UNITS * (dk / 4); i += PF_THREADS) {
        const int u = i / (dk / 4), d = 4 * (i % (dk / 4));
        const int64_t r = r0 + u / gb;
        float4 q4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (u / gb < rows_pb && r < a.n_rows) {
            const float *qp = a.q + r * a.q_stride + (int64_t)(h0 + u % gb) * dk + d;
            q4 = make_float4(qp[0], qp[1], qp[2], qp[3]);
        }
        *(float4 *)(qs + u * PF_LD + d) = q4;
    }
    // score tile: units ug*4 + i, keys kg + 16 j; value tile: units ug*4 + i, dims dg*4 + {0..3}
    // and 64 + dg*4 + {0..3}
    const int ug = tid / 16, kg = tid % 16;
    for (;;) {
        __syncthreads();
        if (tid == 0) {
            int32_t sq = -1, c_lo = 0, t_lo = 0, t_hi = -1;
            for (int u = 0; u < PF_UNITS; u++)
                if (u_state[u] == 1 && sq < 0)
                    sq = u_seq[u];
            for (int u = 0; u < PF_UNITS; u++)
                if (u_state[u] == 1 && u_seq[u] == sq) {
                    u_state[u] = 2;
                    const int32_t cf = (u_first[u] / ATT_CHUNK) * ATT_CHUNK;
                    if (t_hi < 0 || cf < c_lo)
                        c_lo = cf;
                    if (t_hi < 0 || u_first[u] < t_lo)
                        t_lo = u_first[u];
                    if (u_pos[u] > t_hi)
                        t_hi = u_pos[u];
                }
            seg[0] = sq, seg[1] = c_lo, seg[2] = t_lo, seg[3] = t_hi;
        }
        __syncthreads();
        const int32_t sq = seg[0], c_lo = seg[1], t_lo = seg[2], t_hi = seg[3];
        if (sq < 0)
            break;
        float m[4], l = 0.0f, acc[4][8];
        bool mine[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            m[i] = -INFINITY;
            mine[i] = u_state[ug * 4 + i] == 2;
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc[i][j] = 0.0f;
        }
        pf_stage(kv, sq, kvh, dk, (int64_t)kvh * dk, c_lo, t_lo, t_hi, ks, kok, d_err);
        pf_stage(kv, sq, kvh, dv, v_off, c_lo, t_lo, t_hi, vs, NULL, d_err);
        for (int32_t c0 = c_lo; c0 <= t_hi; c0 += ATT_CHUNK) {
            pf_wait1(); // this chunk's keys (its values may still be on their way)
            __syncthreads();
            if (tid < PF_UNITS) {
                const int32_t cf = (u_first[tid] / ATT_CHUNK) * ATT_CHUNK;
                u_part[tid] = u_state[tid] == 2 && c0 >= cf && c0 <= u_pos[tid];
            }
            float s[4][8];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    s[i][j] = 0.0f;
            for (int d0 = 0; d0 < dk; d0 += 4) {
                float4 qv[4], kv4[8];
#pragma unroll
                for (int i = 0; i < 4; i++)
                    qv[i] = *(const float4 *)(qs + (ug * 4 + i) * PF_LD + d0);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    kv4[j] = *(const float4 *)(ks + (kg + 16 * j) * PF_LD + d0);
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        s[i][j] = __fmaf_rn(qv[i].x, kv4[j].x, s[i][j]);
                        s[i][j] = __fmaf_rn(qv[i].y, kv4[j].y, s[i][j]);
                        s[i][j] = __fmaf_rn(qv[i].z, kv4[j].z, s[i][j]);
                        s[i][j] = __fmaf_rn(qv[i].w, kv4[j].w, s[i][j]);
                    }
            }
            __syncthreads(); // u_part written; every read of ks done
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int u = ug * 4 + i;
                const int32_t pos = u_pos[u], first = u_first[u];
                float cmax = -INFINITY;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int32_t t = c0 + kg + 16 * j;
                    s[i][j] = kok[kg + 16 * j] && t >= first && t <= pos ? __fmul_rn(s[i][j], a.scale)
                                                                         : -INFINITY;
                    cmax = fmaxf(cmax, s[i][j]);
                }
#pragma unroll
                for (int o = 8; o > 0; o >>= 1)
                    cmax = fmaxf(cmax, mm_shfl_xor(cmax, o));
                if (u_part[u]) { // same value in all 16 threads of the unit
                    const float m_new = fmaxf(m[i], cmax);
                    if (kg == 0)
                        u_alpha[u] = m[i] == -INFINITY ? 0.0f : expf(__fsub_rn(m[i], m_new));
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        ps[(kg + 16 * j) * PF_PLD + u] =
                            s[i][j] == -INFINITY ? 0.0f : expf(__fsub_rn(s[i][j], m_new));
                    m[i] = m_new;
                }
            }
            __syncthreads(); // p and alpha written; the keys' buffer is free
            {
                const int32_t cn = c0 + ATT_CHUNK;
                if (cn <= t_hi)
                    pf_stage(kv, sq, kvh, dk, (int64_t)kvh * dk, cn, t_lo, t_hi, ks, kok, d_err);
                else
                    pf_commit();
            }
            const int n_k = min(ATT_CHUNK, t_hi - c0 + 1); // later keys have p = 0 everywhere
            if (tid < PF_UNITS && u_part[tid]) {
                float psum = 0.0f;
                for (int t = 0; t < n_k; t++)
                    psum = __fadd_rn(psum, ps[t * PF_PLD + tid]);
                l = __fmaf_rn(l, u_alpha[tid], psum);
            }
            pf_wait1(); // this chunk's values (the next chunk's keys may still be on their way)
            __syncthreads();
            {
                const int dg = kg;
                float sum[4][8];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        sum[i][j] = 0.0f;
                for (int t = 0; t < n_k; t++) {
                    const float4 p4 = *(const float4 *)(ps + t * PF_PLD + ug * 4);
                    const float4 va = *(const float4 *)(vs + t * PF_LD + dg * 4);
                    const float4 vb = *(const float4 *)(vs + t * PF_LD + 64 + dg * 4);
                    const float pv[4] = {p4.x, p4.y, p4.z, p4.w};
                    const float vv[8] = {va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        if (pv[i] != 0.0f) {
#pragma unroll
                            for (int j = 0; j < 8; j++)
                                sum[i][j] = __fmaf_rn(pv[i], vv[j], sum[i][j]);
                        }
                }
#pragma unroll
                for (int i = 0; i < 4; i++)
                    if (u_part[ug * 4 + i]) {
                        const float al = u_alpha[ug * 4 + i];
#pragma unroll
                        for (int j = 0; j < 8; j++)
                            acc[i][j] = __fmaf_rn(al, acc[i][j], sum[i][j]);
                    }
            }
            __syncthreads(); // every read of p, alpha and the values done
            {
                const int32_t cn = c0 + ATT_CHUNK;
                if (cn <= t_hi)
                    pf_stage(kv, sq, kvh, dv, v_off, cn, t_lo, t_hi, vs, NULL, d_err);
                else
                    pf_commit();
            }
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        if (tid < PF_UNITS && u_state[tid] == 2)
            u_inv[tid] = 1.0f / l;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int u = ug * 4 + i;
            if (!mine[i])
                continue;
            float *o = a.out + (r0 + u_row[u]) * a.out_stride + (int64_t)(h0 + u % gb) * dv;
            const float inv = u_inv[u];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int d = (j < 4 ? kg * 4 + j : 64 + kg * 4 + j - 4);
                if (d < dv)
                    o[d] = __fmul_rn(acc[i][j], inv);
            }
        }
        __syncthreads();
        if (tid < PF_UNITS && u_state[tid] == 2)
            u_state[tid] = 0;
    }
}
#else
#define ATT_HAVE_PF 0
#endif

// The prefill kernel when it applies (CUDA, mode on, shapes it takes); *done false otherwise.
static mm_err attention_pf_launch(void *stream, const struct mm_attn_args *a, int *d_err,
                                  bool force, bool *done) {
    *done = false;
#if ATT_HAVE_PF
    if (g_att_pf < 0) {
        const char *e = getenv("MM_GPU_ATT_PREFILL");
        g_att_pf = e != NULL && e[0] == '0' && e[1] == '\0' ? 0 : 1;
    }
    if (a == NULL || a->q == NULL || a->out == NULL || a->row_seq == NULL || a->row_pos == NULL ||
        a->kv.dtype != MM_DTYPE_F32 || a->kv.base == NULL || a->kv.block_tables == NULL ||
        a->n_heads <= 0 || a->kv.n_kv_heads <= 0 || a->n_heads % a->kv.n_kv_heads != 0 ||
        a->kv.block_size <= 0 || a->n_rows <= 0 || a->n_rows > (int64_t)PF_UNITS * 0x7fffffff)
        return MM_OK; // the decode launcher reports bad arguments
    if (!force && (g_att_pf == 0 || (g_att_pf == 1 && a->n_rows < PF_MIN_ROWS)))
        return MM_OK;
    const struct mm_kv_view *kv = &a->kv;
    if (kv->head_dim_k > PF_DMAX || kv->head_dim_v > PF_DMAX || kv->head_dim_k % 4 != 0 ||
        kv->head_dim_v % 4 != 0 || ((uintptr_t)kv->base & 15) != 0 || kv->block_stride % 4 != 0 ||
        kv->slot_stride % 4 != 0)
        return MM_OK;
    const int group = a->n_heads / kv->n_kv_heads;
    int gb = 1;
    for (int g = 1; g <= 8 && g <= group; g++)
        if (group % g == 0)
            gb = g;
    const int rows_pb = PF_UNITS / gb;
    static uint64_t attr_set; // > 48 KiB: allowed once per device (harmlessly racy)
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    if (!(attr_set & (1ull << (dev & 63)))) {
        MM_GPU_CHECK(cudaFuncSetAttribute(attention_pf_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PF_SHMEM));
        attr_set |= 1ull << (dev & 63);
    }
    dim3 grid((unsigned)((a->n_rows + rows_pb - 1) / rows_pb),
              (unsigned)(kv->n_kv_heads * (group / gb)));
    attention_pf_kernel<<<grid, PF_THREADS, PF_SHMEM, (cudaStream_t)stream>>>(*a, gb, d_err, g_early);
    MM_GPU_CHECK(cudaGetLastError());
    *done = true;
#else
    (void)stream, (void)a, (void)d_err, (void)force;
#endif
    return MM_OK;
}

// mm_gpu_set_attention_prefill: 0 off (the decode kernel for every call), 1 auto (the prefill
// kernel from PF_MIN_ROWS rows: the default, unless MM_GPU_ATT_PREFILL=0), 2 always (tests).
// Process-wide. Same bits in every mode.
extern "C" void mm_gpu_set_attention_prefill(int mode) { g_att_pf = mode < 0 ? 0 : mode > 2 ? 2 : mode; }

// attention_tc.cu: the tensor-core contract (MM_GPU_ATT_TC=1) for every call it takes
extern "C" mm_err mm_gpu_attention_tc(void *stream, const struct mm_attn_args *a, int *d_err, int *done);

// MM_GPU_ATT_EARLY (read at first use): 0 clears mm_attn_args keys_early (A/B: every copy of
// the cache after the kernel's wait); unset or 1: as the caller says. The same bits either way.
static int g_att_early = -1;

extern "C" mm_err mm_gpu_attention(void *stream, const struct mm_attn_args *a, int *d_err) {
    if (g_att_early < 0) {
        const char *e = getenv("MM_GPU_ATT_EARLY");
        g_att_early = !(e && e[0] == '0' && e[1] == 0);
    }
    struct mm_attn_args late;
    if (a != NULL && a->keys_early && !g_att_early) {
        late = *a;
        late.keys_early = 0;
        a = &late;
    }
    int tc = 0;
    const mm_err trv = mm_gpu_attention_tc(stream, a, d_err, &tc);
    if (trv != MM_OK || tc)
        return trv;
    if (a != NULL && a->kv.dtype != MM_DTYPE_F32) { // a bf16 cache: the contract's kernels only
        mm_log_error("attention: a %s KV cache is read only by the tensor-core contract, which "
                     "did not take this call (%d heads, %d kv heads, head dims %d/%d)",
                     mm_dtype_name(a->kv.dtype), a->n_heads, a->kv.n_kv_heads,
                     a->kv.head_dim_k, a->kv.head_dim_v);
        return MM_EINVAL;
    }
    bool done = false; // many rows (prefill chunks): the prefill kernel, same bits
    const mm_err rv = attention_pf_launch(stream, a, d_err, g_att_pf == 2, &done);
    if (rv != MM_OK || done)
        return rv;
    return attention_launch(stream, a, d_err, false);
}

// The attention with the earlier load grouping (tests: the bits must not depend on it). Not
// declared in mm_gpu.h.
extern "C" mm_err mm_gpu_attention_ref(void *stream, const struct mm_attn_args *a, int *d_err);
extern "C" mm_err mm_gpu_attention_ref(void *stream, const struct mm_attn_args *a, int *d_err) {
    return attention_launch(stream, a, d_err, true);
}

// ---- embed, swiglu, axpy, sigmoid, copy_rows, fill --------------------------------------------------
template <int DT>
__global__ void embed_kernel(const void *table, int64_t rows, int64_t cols, const int32_t *ids,
                             float *out, int64_t os, int *d_err) {
    mm_dep_signal();
    mm_dep_wait();
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0)
            flag(d_err, ERR_INDEX);
        return;
    }
    for (int64_t k = threadIdx.x; k < cols; k += blockDim.x)
        out[i * os + k] = wload<DT>(table, (int64_t)id * cols + k);
}

// embed_rmsnorm (kernels.h): embed_kernel's row (the table row converted to f32; a bad id
// flags the error word and leaves the out row as it was), then the norm of the out row as
// rmsnorm_row_kernel takes it. A block per row; tdt: the table's dtype.
template <int DT>
__global__ void __launch_bounds__(RMS_THREADS) embed_rmsnorm_kernel(
    const void *table, int tdt, int64_t rows, int cols, const int32_t *ids, float *out,
    int64_t os, const void *w, float eps, float *y, int64_t ys, int *d_err, int early) {
    extern __shared__ float xsh[]; // cols
    early_launch(early);
    float wv[RMS_MAX_DIM / RMS_THREADS];
    rms_load_w<DT>(w, cols, wv); // weights: never written by a kernel, before the wait
    mm_dep_wait();
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    float *orow = out + i * os;
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0)
            flag(d_err, ERR_INDEX);
        for (int k = threadIdx.x; k < cols; k += RMS_THREADS)
            xsh[k] = orow[k];
    } else {
        for (int k = threadIdx.x; k < cols; k += RMS_THREADS) {
            const float v = wload_rt(tdt, table, (int64_t)id * cols + k);
            orow[k] = v;
            xsh[k] = v;
        }
    }
    rms_from_shared(xsh, wv, cols, eps, y + i * ys);
}

// embed_rmsnorm_kernel's prefill form (see "prefill forms of the row ops"): the row's table
// elements (or, for a bad id, out's row as it is) all loaded before the first store, VPT
// pieces of 4 per thread; the same values (wload_rt) and rms_from_shared4's norm.
template <int DT, int VPT>
__global__ void __launch_bounds__(RMS_THREADS) embed_rmsnorm_pf_kernel(
    const void *table, int tdt, int64_t rows, int cols, const int32_t *ids, float *out,
    int64_t os, const void *w, float eps, float *y, int64_t ys, int *d_err, int early) {
    extern __shared__ float4 xsh4[]; // cols / 4
    early_launch(early);
    float4 wv[VPT];
    rms_load_w4<DT, RMS_THREADS, VPT>(w, cols, wv); // weights: never written by a kernel
    mm_dep_wait();
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    float4 *orow = (float4 *)(out + i * os);
    const bool bad = id < 0 || id >= rows;
    if (bad && threadIdx.x == 0)
        flag(d_err, ERR_INDEX);
    float4 ev[VPT];
#pragma unroll
    for (int q = 0; q < VPT; q++) {
        const int k4 = threadIdx.x + q * RMS_THREADS;
        if (4 * k4 < cols) {
            if (bad) {
                ev[q] = orow[k4];
            } else {
                const int64_t e = (int64_t)id * cols + 4 * k4;
                ev[q] = make_float4(wload_rt(tdt, table, e), wload_rt(tdt, table, e + 1),
                                    wload_rt(tdt, table, e + 2), wload_rt(tdt, table, e + 3));
            }
        }
    }
#pragma unroll
    for (int q = 0; q < VPT; q++) {
        const int k4 = threadIdx.x + q * RMS_THREADS;
        if (4 * k4 < cols) {
            if (!bad)
                orow[k4] = ev[q];
            xsh4[k4] = ev[q];
        }
    }
    rms_from_shared4<RMS_THREADS, VPT>((const float *)xsh4, wv, cols, eps, y + i * ys);
}

extern "C" mm_err mm_gpu_embed_rmsnorm(void *stream, const mm_weight *t, const int32_t *ids,
                                       int64_t n_rows, float *out, int64_t os, const mm_weight *w,
                                       float eps, float *y, int64_t ys, int *d_err) {
    if (t == NULL || t->data == NULL || t->rows <= 0 || t->cols <= 0 || ids == NULL ||
        out == NULL || n_rows < 0 || w == NULL || w->data == NULL || w->rows != 1 ||
        w->cols != t->cols || y == NULL ||
        (t->dtype != MM_DTYPE_BF16 && t->dtype != MM_DTYPE_F16 && t->dtype != MM_DTYPE_F32))
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    if (w->cols > RMS_MAX_DIM || n_rows > INT32_MAX) { // the two launches it stands for
        MM_TRY(mm_gpu_embed(stream, t, ids, n_rows, out, os, d_err));
        return mm_gpu_rmsnorm(stream, w, eps, out, os, y, ys, n_rows);
    }
    const int cols = (int)t->cols;
    const size_t shmem = (size_t)cols * sizeof(float);
    cudaStream_t st = (cudaStream_t)stream;
    if (cols % 4 == 0 && al16(out, os) && al16(y, ys) && rowops_pf(n_rows)) {
        mm__gpu_rowops_pf_count();
        const int vpt = cols <= 4 * RMS_THREADS ? 1 : cols <= 8 * RMS_THREADS ? 2
                        : cols <= 16 * RMS_THREADS ? 4 : 8;
        void (*kern)(const void *, int, int64_t, int, const int32_t *, float *, int64_t,
                     const void *, float, float *, int64_t, int *, int) = NULL;
#define ER_PICK(D)                                                                                  \
    kern = vpt == 1 ? embed_rmsnorm_pf_kernel<D, 1> : vpt == 2 ? embed_rmsnorm_pf_kernel<D, 2>      \
           : vpt == 4 ? embed_rmsnorm_pf_kernel<D, 4> : embed_rmsnorm_pf_kernel<D, 8>
        switch (w->dtype) {
        case MM_DTYPE_BF16: ER_PICK(MM_DTYPE_BF16); break;
        case MM_DTYPE_F16: ER_PICK(MM_DTYPE_F16); break;
        case MM_DTYPE_F32: ER_PICK(MM_DTYPE_F32); break;
        default: return MM_EINVAL;
        }
#undef ER_PICK
        MM_GPU_CHECK(mm_launch_dep(kern, dim3((unsigned)n_rows), dim3(RMS_THREADS), shmem, st,
                                   t->data, (int)t->dtype, t->rows, cols, ids, out, os, w->data,
                                   eps, y, ys, d_err, g_early));
        MM_GPU_CHECK(cudaGetLastError());
        return MM_OK;
    }
    switch (w->dtype) {
    case MM_DTYPE_BF16: MM_GPU_CHECK(mm_launch_dep(embed_rmsnorm_kernel<MM_DTYPE_BF16>, dim3((unsigned)n_rows), dim3(RMS_THREADS), shmem, st, t->data, (int)t->dtype, t->rows, cols, ids, out, os, w->data, eps, y, ys, d_err, g_early)); break;
    case MM_DTYPE_F16: MM_GPU_CHECK(mm_launch_dep(embed_rmsnorm_kernel<MM_DTYPE_F16>, dim3((unsigned)n_rows), dim3(RMS_THREADS), shmem, st, t->data, (int)t->dtype, t->rows, cols, ids, out, os, w->data, eps, y, ys, d_err, g_early)); break;
    case MM_DTYPE_F32: MM_GPU_CHECK(mm_launch_dep(embed_rmsnorm_kernel<MM_DTYPE_F32>, dim3((unsigned)n_rows), dim3(RMS_THREADS), shmem, st, t->data, (int)t->dtype, t->rows, cols, ids, out, os, w->data, eps, y, ys, d_err, g_early)); break;
    default: return MM_EINVAL;
    }
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

extern "C" mm_err mm_gpu_embed(void *stream, const mm_weight *t, const int32_t *ids, int64_t n_rows,
                               float *out, int64_t os, int *d_err) {
    if (t == NULL || t->data == NULL || t->rows <= 0 || t->cols <= 0 || ids == NULL || out == NULL ||
        n_rows < 0)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    cudaStream_t st = (cudaStream_t)stream;
    switch (t->dtype) {
    case MM_DTYPE_BF16: MM_GPU_CHECK(mm_launch_dep(embed_kernel<MM_DTYPE_BF16>, dim3((unsigned)n_rows), dim3(256), 0, st, t->data, t->rows, t->cols, ids, out, os, d_err)); break;
    case MM_DTYPE_F16: MM_GPU_CHECK(mm_launch_dep(embed_kernel<MM_DTYPE_F16>, dim3((unsigned)n_rows), dim3(256), 0, st, t->data, t->rows, t->cols, ids, out, os, d_err)); break;
    case MM_DTYPE_F32: MM_GPU_CHECK(mm_launch_dep(embed_kernel<MM_DTYPE_F32>, dim3((unsigned)n_rows), dim3(256), 0, st, t->data, t->rows, t->cols, ids, out, os, d_err)); break;
    default: return MM_EINVAL;
    }
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

__global__ void swiglu_kernel(const float *g, int64_t gs, const float *u, int64_t us, float *o,
                              int64_t os, int64_t n_rows, int64_t dim, int early) {
    early_launch(early);
    mm_dep_wait();
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * dim)
        return;
    const int64_t i = idx / dim, j = idx % dim;
    const float x = g[i * gs + j];
    o[i * os + j] = x / (1.0f + expf(-x)) * u[i * us + j];
}

extern "C" mm_err mm_gpu_swiglu(void *stream, const float *g, int64_t gs, const float *u, int64_t us,
                                float *o, int64_t os, int64_t n_rows, int64_t dim) {
    if (g == NULL || u == NULL || o == NULL || n_rows < 0 || dim < 0)
        return MM_EINVAL;
    if (n_rows * dim == 0)
        return MM_OK;
    MM_GPU_CHECK(mm_launch_dep(swiglu_kernel, dim3(mm_div_up(n_rows * dim, 256)), dim3(256), 0, (cudaStream_t)stream, g, gs, u, us, o, os, n_rows, dim, g_early));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// One multiply then one add, never fused (kernels.h: every backend rounds alike).
__global__ void axpy_kernel(const float *alpha, const float *x, int64_t xs, float *y, int64_t ys,
                            int64_t n_rows, int64_t dim) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * dim)
        return;
    const int64_t i = idx / dim, j = idx % dim;
    const float p = alpha ? __fmul_rn(alpha[i], x[i * xs + j]) : x[i * xs + j];
    y[i * ys + j] = __fadd_rn(y[i * ys + j], p);
}

extern "C" mm_err mm_gpu_axpy(void *stream, const float *alpha, const float *x, int64_t xs, float *y,
                              int64_t ys, int64_t n_rows, int64_t dim) {
    if (x == NULL || y == NULL || n_rows < 0 || dim < 0)
        return MM_EINVAL;
    if (n_rows * dim == 0)
        return MM_OK;
    axpy_kernel<<<mm_div_up(n_rows * dim, 256), 256, 0, (cudaStream_t)stream>>>(alpha, x, xs, y, ys, n_rows, dim);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

__global__ void sigmoid_kernel(float *x, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = 1.0f / (1.0f + expf(-x[i]));
}

extern "C" mm_err mm_gpu_sigmoid(void *stream, float *x, int64_t n) {
    if (x == NULL || n < 0)
        return MM_EINVAL;
    if (n == 0)
        return MM_OK;
    sigmoid_kernel<<<mm_div_up(n, 256), 256, 0, (cudaStream_t)stream>>>(x, n);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

__global__ void copy_rows_kernel(const float *src, int64_t ss, const int32_t *si, float *dst,
                                 int64_t ds, const int32_t *di, int64_t dim, int *d_err,
                                 int early) {
    early_launch(early);
    mm_dep_wait();
    const int64_t i = blockIdx.x;
    const int64_t a = si ? si[i] : i, b = di ? di[i] : i;
    if (a < 0 || b < 0) {
        if (threadIdx.x == 0)
            flag(d_err, ERR_INDEX);
        return;
    }
    for (int64_t k = threadIdx.x; k < dim; k += blockDim.x)
        dst[b * ds + k] = src[a * ss + k];
}

extern "C" mm_err mm_gpu_copy_rows(void *stream, const float *src, int64_t ss, const int32_t *si,
                                   float *dst, int64_t ds, const int32_t *di, int64_t n_rows,
                                   int64_t dim, int *d_err) {
    if (src == NULL || dst == NULL || n_rows < 0 || dim < 0)
        return MM_EINVAL;
    if (n_rows == 0 || dim == 0)
        return MM_OK;
    MM_GPU_CHECK(mm_launch_dep(copy_rows_kernel, dim3((unsigned)n_rows), dim3(256), 0, (cudaStream_t)stream, src, ss, si, dst, ds, di, dim, d_err, g_early));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

__global__ void fill_kernel(float *x, float v, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = v;
}

extern "C" mm_err mm_gpu_fill(void *stream, float *x, float v, int64_t n) {
    if (x == NULL || n < 0)
        return MM_EINVAL;
    if (n == 0)
        return MM_OK;
    fill_kernel<<<mm_div_up(n, 256), 256, 0, (cudaStream_t)stream>>>(x, v, n);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- routing: one warp per row ----------------------------------------------------------------
// The steps are route.cuh's (shared with route_plan.cu's route + plan kernel).
__global__ void route_kernel(struct mm_route_params p, const float *logits, int64_t ls,
                             int32_t *ids, float *weights) {
    extern __shared__ float rsh[];
    mm_dep_signal();
    mm_dep_wait();
    const int E = p.n_experts, K = p.top_k, lane = threadIdx.x;
    // wk: the K picked weights, kept in shared memory until they are final (the renorm and
    // scale read them back: from global memory each read was a round trip to L2)
    float *prob = rsh, *choice = rsh + E, *wk = rsh + 2 * E;
    unsigned char *taken = (unsigned char *)(rsh + 2 * E + K);
    const int64_t r = blockIdx.x;
    route_scores(p, logits + r * ls, prob, choice, taken, lane);
    __syncthreads(); // the block is one warp
    if (p.n_group > 1) {
        if (lane == 0)
            route_groups(p, choice);
        __syncthreads(); // the block is one warp
    }
    route_pick_serial(p, prob, choice, taken, wk, ids + r * K, true, lane);
    if (lane == 0) // the same operations in the same order as before, on wk
        route_finish(p, wk, weights + r * K);
}

extern "C" mm_err mm_gpu_route(void *stream, const struct mm_route_params *p, const float *logits,
                               int64_t ls, int64_t n_rows, int32_t *ids, float *weights) {
    if (p == NULL || logits == NULL || ids == NULL || weights == NULL || n_rows < 0)
        return MM_EINVAL;
    if (!route_params_ok(p))
        return MM_EINVAL;
    const int E = p->n_experts, K = p->top_k;
    if (n_rows == 0)
        return MM_OK;
    const size_t shmem = route_shmem_bytes(E, K);
    MM_GPU_CHECK(mm_launch_dep(route_kernel, dim3((unsigned)n_rows), dim3(warp_threads()), shmem, (cudaStream_t)stream, *p, logits, ls, ids, weights));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- sampling: greedy argmax, one block per row -----------------------------------------------
// Highest logit, ties to the lower id (the engine's host argmax rule); NaN never wins.
// block_argmax combines every thread's (best, id) of one block (id -1: none yet): the larger
// value wins, ties go to the lower id. All threads call it; the result is in thread 0's
// (best, id), and it returns true there only.
__device__ __forceinline__ bool block_argmax(float &best, int &id) {
    __shared__ float bv[1024 / 32];
    __shared__ int bi[1024 / 32];
#pragma unroll
    for (int m = MM_WARP_SIZE / 2; m > 0; m >>= 1) {
        const float ob = mm_shfl_xor(best, m);
        const int oi = mm_shfl_xor(id, m);
        if (oi >= 0 && (id < 0 || ob > best || (ob == best && oi < id))) {
            best = ob;
            id = oi;
        }
    }
    const int lane = threadIdx.x % MM_WARP_SIZE, warp = threadIdx.x / MM_WARP_SIZE;
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = id;
    }
    __syncthreads();
    if (threadIdx.x != 0)
        return false;
    for (int w = 1; w < (int)(blockDim.x / MM_WARP_SIZE); w++)
        if (bi[w] >= 0 && (id < 0 || bv[w] > best || (bv[w] == best && bi[w] < id))) {
            best = bv[w];
            id = bi[w];
        }
    return true;
}

__global__ void argmax_kernel(const float *logits, int64_t ls, int vocab, int32_t *ids) {
    const float *l = logits + (int64_t)blockIdx.x * ls;
    float best = -INFINITY;
    int id = -1;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float x = l[v];
        if (id < 0 ? !isnan(x) : x > best) { // strided ascending: first hit keeps the lower id
            best = x;
            id = v;
        }
    }
    if (block_argmax(best, id))
        ids[blockIdx.x] = id < 0 ? 0 : id;
}

// ---- argmax over many blocks per row: one pass, 64-bit atomic max -------------------------------
// Each block takes AMAX_SPAN consecutive logits of its row and finds its best (value, id)
// with argmax_kernel's rules; the pair becomes a 64-bit key ordered like the rule (value bits
// made monotone in the high word, -0 taken as +0 since the comparisons tie them; the inverted
// id in the low word, so equal values prefer the lower id) and meets the other blocks' in an
// atomicMax on the row's word. The row's last block to arrive (a counter after a fence) reads
// the winner, writes the id and zeroes the word and the counter for the next call. Key 0 is
// below every real key: a row of NaN only keeps 0 and gives id 0, as argmax_kernel does.
#define AMAX_THREADS 256
#define AMAX_PER_THREAD 8
#define AMAX_SPAN (AMAX_THREADS * AMAX_PER_THREAD)

__device__ __forceinline__ unsigned long long amax_key(float x, int id) {
    uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(~(uint32_t)id);
}

__global__ void __launch_bounds__(AMAX_THREADS) argmax_ws_kernel(const float *logits, int64_t ls,
                                                                 int vocab, int32_t *ids,
                                                                 unsigned long long *key,
                                                                 unsigned *arrived) {
    mm_dep_wait();
    const int64_t r = blockIdx.y;
    const float *l = logits + r * ls;
    const int v0 = blockIdx.x * AMAX_SPAN + threadIdx.x;
    float xv[AMAX_PER_THREAD];
#pragma unroll
    for (int j = 0; j < AMAX_PER_THREAD; j++) { // all loads in flight
        const int v = v0 + j * AMAX_THREADS;
        xv[j] = v < vocab ? l[v] : 0.0f;
    }
    float best = -INFINITY;
    int id = -1;
#pragma unroll
    for (int j = 0; j < AMAX_PER_THREAD; j++) {
        const int v = v0 + j * AMAX_THREADS;
        const float x = xv[j];
        if (v < vocab && (id < 0 ? !isnan(x) : x > best)) { // ascending: ties keep the lower id
            best = x;
            id = v;
        }
    }
    if (!block_argmax(best, id))
        return;
    if (id >= 0)
        atomicMax(&key[r], amax_key(best, id));
    __threadfence();
    if (atomicAdd(&arrived[r], 1u) != gridDim.x - 1)
        return;
    const unsigned long long k = atomicExch(&key[r], 0ull); // every block's max is in
    arrived[r] = 0;
    ids[r] = k == 0 ? 0 : (int32_t)~(uint32_t)k;
}

extern "C" mm_err mm_gpu_argmax_ws(void *stream, const float *logits, int64_t ls, int64_t n_rows,
                                   int vocab, int32_t *ids, void *d_ws, int ws_rows) {
    if (logits == NULL || ids == NULL || d_ws == NULL || ws_rows <= 0 || ws_rows > 65535 ||
        n_rows < 0 || vocab <= 0 || ls < vocab)
        return MM_EINVAL;
    unsigned long long *key = (unsigned long long *)d_ws;
    unsigned *arrived = (unsigned *)(key + ws_rows);
    const unsigned blocks = mm_div_up(vocab, AMAX_SPAN);
    for (int64_t r0 = 0; r0 < n_rows; r0 += ws_rows) {
        const int64_t nr = n_rows - r0 < ws_rows ? n_rows - r0 : ws_rows;
        MM_GPU_CHECK(mm_launch_dep(argmax_ws_kernel, dim3(blocks, (unsigned)nr), dim3(AMAX_THREADS), 0,
                                   (cudaStream_t)stream, logits + r0 * ls, ls, vocab, ids + r0, key, arrived));
        MM_GPU_CHECK(cudaGetLastError());
    }
    return MM_OK;
}

extern "C" mm_err mm_gpu_argmax(void *stream, const float *logits, int64_t ls, int64_t n_rows,
                                int vocab, int32_t *ids) {
    if (logits == NULL || ids == NULL || n_rows < 0 || vocab <= 0 || ls < vocab)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    argmax_kernel<<<(unsigned)n_rows, 256, 0, (cudaStream_t)stream>>>(logits, ls, vocab, ids);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- fetch: a result copied to pinned host memory by the device (backend fetch) -------------------
__global__ void __launch_bounds__(128) fetch_kernel(unsigned char *dst, const unsigned char *src,
                                                    unsigned n, const int *err, int *err_dst) {
    mm_dep_wait();
    const bool words = ((((uintptr_t)dst | (uintptr_t)src | n) & 3u) == 0);
    if (words) {
        for (unsigned i = threadIdx.x; i < n / 4; i += blockDim.x)
            ((unsigned *)dst)[i] = ((const unsigned *)src)[i];
    } else {
        for (unsigned i = threadIdx.x; i < n; i += blockDim.x)
            dst[i] = src[i];
    }
    if (threadIdx.x == 0)
        *err_dst = *err;
    __threadfence_system();
}

extern "C" mm_err mm_gpu_fetch_copy(void *stream, void *h_dst, const void *d_src, size_t n,
                                    const int *d_err, int *h_err) {
    if (h_dst == NULL || d_src == NULL || d_err == NULL || h_err == NULL || n == 0 || n > 65536)
        return MM_EINVAL;
    MM_GPU_CHECK(mm_launch_dep(fetch_kernel, dim3(1), dim3(128), 0, (cudaStream_t)stream,
                               (unsigned char *)h_dst, (const unsigned char *)d_src, (unsigned)n,
                               d_err, h_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}
