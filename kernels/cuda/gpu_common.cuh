// SPDX-License-Identifier: MIT
// Device helpers shared by the kernels: bf16 <-> f32 (bf16 kept as raw uint16_t so the same
// code compiles for CUDA and HIP), warp and block reductions written for any warp width.
#ifndef MM_GPU_COMMON_CUH
#define MM_GPU_COMMON_CUH

#include "vendor.h"

__device__ __forceinline__ float mm_gpu_bf16_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

// Round to nearest even, NaN kept quiet (same rule as the CPU backend and torch).
__device__ __forceinline__ uint16_t mm_gpu_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// Two f32 -> packed bf16 (lo in the low half), round to nearest even, by the instruction the
// tensor-core paths round with (cvt.rn.bf16x2.f32: matmul.cu's pack_bf16, attention_tc.cuh's
// tc_pack), so a value stored as bf16 here has the bits those paths give it, NaN included.
// HIP: mm_gpu_f32_to_bf16 (the same for every non-NaN input).
__device__ __forceinline__ uint32_t mm_gpu_pack_bf16x2(float lo, float hi) {
#if MM_GPU_HAVE_WMMA
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)mm_gpu_f32_to_bf16(lo) | ((uint32_t)mm_gpu_f32_to_bf16(hi) << 16);
#endif
}

// Low and high bf16 of a 32-bit word holding two of them (little-endian: element 0 low).
__device__ __forceinline__ float mm_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float mm_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float mm_warp_sum(float v) {
#pragma unroll
    for (int m = MM_WARP_SIZE / 2; m > 0; m >>= 1)
        v += mm_shfl_xor(v, m);
    return v;
}

__device__ __forceinline__ float mm_warp_max(float v) {
#pragma unroll
    for (int m = MM_WARP_SIZE / 2; m > 0; m >>= 1)
        v = fmaxf(v, mm_shfl_xor(v, m));
    return v;
}

// Block-wide sum; every thread gets the result. blockDim.x <= 1024. Uses 32 floats of shared.
__device__ __forceinline__ float mm_block_sum(float v) {
    __shared__ float part[1024 / 32];
    const int lane = threadIdx.x % MM_WARP_SIZE, warp = threadIdx.x / MM_WARP_SIZE;
    const int n_warps = (blockDim.x + MM_WARP_SIZE - 1) / MM_WARP_SIZE;
    v = mm_warp_sum(v);
    __syncthreads();
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < n_warps; i++)
        s += part[i];
    return s;
}

__device__ __forceinline__ float mm_block_max(float v) {
    __shared__ float part[1024 / 32];
    const int lane = threadIdx.x % MM_WARP_SIZE, warp = threadIdx.x / MM_WARP_SIZE;
    const int n_warps = (blockDim.x + MM_WARP_SIZE - 1) / MM_WARP_SIZE;
    v = mm_warp_max(v);
    __syncthreads();
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    float s = -INFINITY;
    for (int i = 0; i < n_warps; i++)
        s = fmaxf(s, part[i]);
    return s;
}

static inline unsigned mm_div_up(long a, long b) { return (unsigned)((a + b - 1) / b); }

#if MM_GPU_HAVE_WMMA
// mm_gpu_cc90: the current device is compute capability 9.0, whose sm_90a image holds the
// wgmma kernels (newer parts run the compute_90 PTX, where they have no body). Cached per
// device (per translation unit); false when the device cannot be asked.
static inline bool mm_gpu_cc90(void) {
    static signed char ok[64]; // 0 unknown, 1 yes, -1 no
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return false;
    if (ok[dev] == 0) {
        int major = 0, minor = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
            return false;
        ok[dev] = major == 9 && minor == 0 ? 1 : -1;
    }
    return ok[dev] > 0;
}
#endif

// ---- programmatic dependent launch of the small ops (sm_90) -------------------------------------
// mm_launch_dep launches k as a programmatic dependent of the stream's previous kernel when
// mm__gpu_dep is set (mm_gpu_set_dep_launch; the backend's default): its blocks may be scheduled
// as soon as that kernel signals (mm_dep_signal at its start), so the launch and block setup
// overlap the previous kernel instead of following it. Every kernel launched this way calls
// mm_dep_wait before its first global load or store, so it still starts its work only after
// the previous kernel has finished and its writes are visible: same results. Without the
// attribute (or on HIP) both device calls do nothing.
extern int mm__gpu_dep;

__device__ __forceinline__ void mm_dep_wait(void) {
#if MM_GPU_HAVE_WMMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mm_dep_signal(void) {
#if MM_GPU_HAVE_WMMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

template <typename... P, typename... A>
static inline cudaError_t mm_launch_dep(void (*k)(P...), dim3 grid, dim3 block, size_t smem,
                                        cudaStream_t st, A... args) {
#if MM_GPU_HAVE_WMMA
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = mm__gpu_dep ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, k, args...);
#else
    hipLaunchKernelGGL(k, grid, block, smem, st, args...);
    return cudaGetLastError();
#endif
}

#endif
