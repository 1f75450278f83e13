// SPDX-License-Identifier: MIT
// The row norm's device functions (kernels.h rmsnorm), shared by ops.cu's norm kernels (rmsnorm,
// add_rmsnorm, combine_rmsnorm, embed_rmsnorm) and route_plan.cu's MoE gate, so that every one
// of them rounds a row's norm with the same operations in the same order.
#ifndef MM_GPU_RMS_CUH
#define MM_GPU_RMS_CUH

#include "gpu_common.cuh"
#include "kernels.h"

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

// One warp (lane 0..W-1): the row's 1/sqrt(mean(x^2) + eps) from xsh (dim), the sum of squares
// in the lane-strided order then the butterfly; every lane gets it.
__device__ __forceinline__ float rms_warp_rs(const float *xsh, int dim, float eps, int lane) {
    float ss = 0.0f;
#pragma unroll 8
    for (int k = lane; k < dim; k += MM_WARP_SIZE)
        ss += xsh[k] * xsh[k];
    ss = mm_warp_sum(ss);
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

// Every thread: out(k, w[k] * (xsh[k] * rs)) for its elements k = threadIdx.x + i * NT (wv from
// rms_load_w), in i order.
template <int NT, int EPT, class Out>
__device__ __forceinline__ void rms_scale_each(const float *xsh, const float *wv, int dim, float rs,
                                               Out out) {
#pragma unroll
    for (int i = 0; i < EPT; i++) {
        const int k = threadIdx.x + i * NT;
        if (k < dim)
            out(k, wv[i] * (xsh[k] * rs));
    }
}

// rms_scale_each into yr[k]. yr may be xsh (each element is read and written by one thread).
template <int NT = RMS_THREADS, int EPT = RMS_MAX_DIM / NT>
__device__ __forceinline__ void rms_scale(const float *xsh, const float *wv, int dim, float rs,
                                          float *yr) {
    rms_scale_each<NT, EPT>(xsh, wv, dim, rs, [&](int k, float y) { yr[k] = y; });
}

template <int NT = RMS_THREADS, int EPT = RMS_MAX_DIM / NT>
__device__ __forceinline__ void rms_from_shared(const float *xsh, const float *wv, int dim, float eps,
                                                float *yr) {
    __shared__ float rs_sh;
    __syncthreads();
    if (threadIdx.x < MM_WARP_SIZE) {
        const float rs = rms_warp_rs(xsh, dim, eps, threadIdx.x);
        if (threadIdx.x == 0)
            rs_sh = rs;
    }
    __syncthreads();
    rms_scale<NT, EPT>(xsh, wv, dim, rs_sh, yr);
}

#endif
