// SPDX-License-Identifier: MIT
// A query or key head's preparation in registers, and the store of a cache element, shared by
// head_norm_rope_kv's kernels (ops.cu) and attention_prep's attention blocks (attention_tcd.cu),
// so both give the same bits from one source: lane l of a warp holds elements l + W j (j < J, W the warp width) of a head
// of J W dims; NeoX rotation pairs (j, j + J / 2) sit in one lane.
#ifndef MM_GPU_HEAD_ROPE_CUH
#define MM_GPU_HEAD_ROPE_CUH

#include "gpu_common.cuh"

// rmsnorm of the head (dims = J W): the lane-strided sum of squares in j order, the warp's
// butterfly, then w * (v * rs) per element (w: this lane's J weights).
template <int J>
__device__ __forceinline__ void hr_norm(float (&v)[J], const float *w, int dims, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++)
        ss += v[j] * v[j];
    ss = mm_warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / (float)dims + eps);
#pragma unroll
    for (int j = 0; j < J; j++)
        v[j] = w[j] * (v[j] * rs);
}

// cos and sin (times mscale) of this lane's rotation pairs at position pos (rope_kernel's
// expressions); fr: the lane's JH frequencies inv_freq[l + W j]; cs, sn: JH each.
template <int JH>
__device__ __forceinline__ void hr_angles(float pos, const float *fr, float mscale, float *cs,
                                          float *sn) {
#pragma unroll
    for (int j = 0; j < JH; j++) {
        const float ang = pos * fr[j];
        cs[j] = cosf(ang) * mscale;
        sn[j] = sinf(ang) * mscale;
    }
}

// the NeoX rotation of the head's pairs (j, j + J / 2) (rope_kernel's expressions)
template <int J>
__device__ __forceinline__ void hr_rope(float (&v)[J], const float *cs, const float *sn) {
#pragma unroll
    for (int j = 0; j < J / 2; j++) {
        const float c = cs[j], s = sn[j];
        const float x0 = v[j], x1 = v[j + J / 2];
        const float y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
        v[j] = y0;
        v[j + J / 2] = y1;
    }
}

// One element of a cache slot: f32, or bf16 (the low half of mm_gpu_pack_bf16x2: the rounding
// the tensor-core attention applies to an f32 cache's K and V, so either cache gives it the
// same bf16 operands).
__device__ __forceinline__ void kv_put(void *slot, bool kb, int64_t i, float y) {
    if (kb)
        ((uint16_t *)slot)[i] = (uint16_t)(mm_gpu_pack_bf16x2(y, 0.0f) & 0xffffu);
    else
        ((float *)slot)[i] = y;
}

#endif
