// SPDX-License-Identifier: MIT
// The pieces of the bf16 mma products that other kernels reuse for the same bits (matmul.cu's
// GEMV and GEMM; route_plan.cu's MoE gate computes the router product with them): the one
// rounding of x to bf16, the mma.sync instruction, the 8-element weight load, the fixed k
// segments and GEMV v2's shared x row stride. See matmul.cu's design notes for the contract.
#ifndef MM_GPU_MMA_CUH
#define MM_GPU_MMA_CUH

#include "gpu_common.cuh"

// Two f32 -> packed bf16 (a low), round to nearest even. Every path that feeds the tensor
// cores converts through this one function, so x rounds identically everywhere.
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
#if MM_GPU_HAVE_WMMA
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(b), "f"(a));
    return r;
#else
    return (uint32_t)mm_gpu_f32_to_bf16(a) | ((uint32_t)mm_gpu_f32_to_bf16(b) << 16);
#endif
}

#if MM_GPU_HAVE_WMMA
// ---- mma.sync m16n8k16 (CUDA) ----------------------------------------------------------------
// D += A (16x16, row) * B (16x8, col). a[0]: row g slots 2t..; a[1]: row g+8; a[2], a[3]: the
// same rows at slots 2t+8..; b[0]: slots 2t.., col g; b[1]: slots 2t+8.., col g. d[0], d[1]:
// row g cols 2t, 2t+1; d[2], d[3]: row g+8.
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 8 bf16 of a weight row from k (zeros past n_in); fast when vec and the 8 are in range.
__device__ __forceinline__ uint4 load_w8(const uint16_t *row, int k, int n_in, bool vec) {
    if (vec && k + 8 <= n_in)
        return __ldg((const uint4 *)(row + k));
    uint16_t h[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        h[j] = k + j < n_in ? row[k + j] : (uint16_t)0;
    return make_uint4(h[0] | ((uint32_t)h[1] << 16), h[2] | ((uint32_t)h[3] << 16),
                      h[4] | ((uint32_t)h[5] << 16), h[6] | ((uint32_t)h[7] << 16));
}

#endif // MM_GPU_HAVE_WMMA

// ---- K segments ------------------------------------------------------------------------------
// Both mma paths split k into S <= 16 fixed segments of seg_len(n_in) (a multiple of 32, at
// least 256): each segment accumulates its chunks from zero, and the segment sums are added
// in segment order, 0 + p0 + p1 + ... . The GEMV spreads segments over warps (parallelism for
// small matrices at batch 1); the GEMM walks them in order with a second accumulator. The
// split depends on n_in only, so the bits do not depend on the path or on n_rows.
#define SEG_MAX 16
__host__ __device__ __forceinline__ int seg_len(int n_in) {
    int l = (n_in + SEG_MAX - 1) / SEG_MAX;
    l = (l + 31) / 32 * 32;
    return l < 256 ? 256 : l;
}

// bf16 per shared x row: n_in rounded up to 32 (zeros past n_in), + 32 so that the rows read by
// lanes g and g + 1 in one quarter-warp fall in other banks.
__host__ __device__ __forceinline__ int mv2_ldx(int n_in) { return (n_in + 31) / 32 * 32 + 32; }

#endif
