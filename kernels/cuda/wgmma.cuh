// SPDX-License-Identifier: MIT
// Hopper's warpgroup tensor-core instruction (wgmma, sm_90a): the primitives the wgmma GEMMs
// (gemm_wg.cuh, gemm_wp.cuh) and the wgmma prefill attention (attention_tcw.cu) share. Device
// code of compute capability 9.0a only (the callers' bodies are under the same guard).
#ifndef MM_GPU_WGMMA_CUH
#define MM_GPU_WGMMA_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row atoms 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3ffff) >> 4) | ((uint64_t)(16 >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence(void) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit(void) {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// every wgmma group but the N newest completed
template <int N>
__device__ __forceinline__ void wg_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins registers in place (no instruction): every write to them stays before the next asm
// volatile (wgmma.fence: the PTX rule for accumulator and A registers written before a wgmma),
// and every read after the last one (wgmma.wait_group); so the compiler moves no accumulator
// read or write across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void wg_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}
// D (64 x 64 f32) = A (64 x 16) B (16 x 64) + (scale_d ? D : 0), both operands from shared
// memory, K-major (descriptors da, db). d[4j + 2h + c] is row 16 * (warp % 4) + g + 8h, column
// 8j + 2t + c (mma.sync m16n8's fragment per n8 chunk).
__device__ __forceinline__ void wgmma_m64n64k16(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}
#endif // __CUDA_ARCH_FEAT_SM90_ALL

#endif // MM_GPU_WGMMA_CUH
