// SPDX-License-Identifier: MIT
// The device helpers of the tensor-core attention contract (attention_tc.cu's head states the
// contract), shared by its kernels in attention_tc.cu (attention_tc_kernel, attention_tc2_kernel),
// attention_tcd.cu (attention_tcd_kernel, decode calls) and attention_tcw.cu
// (attention_tcw_kernel, prefill on wgmma), so each rounded operation and each staging step has
// one source: the bf16 packing (tc_pack), ex2 (tc_ex2), the m16n8k16 mma and the ldmatrix
// loads, the cache-table lookup of a key (tc_blk, tc_blk_kb), the cp.async copies of a key's K
// and V into its f32 stage row (tc_issue) and their conversion to bf16 rows (tc_convert), the
// copies straight from a bf16 cache (tc_issue_bf16), and a prefill block's next pass of rows
// (tc_next_pass).
// Host side, for both files' launchers: the kernels' dynamic shared memory size
// (tc_stage_shmem), the once-per-device shared memory allowance (tc_allow_shmem), the heads
// sharing a key block's load (tc_group_sub) and the environment test of the switches
// (tc_env_is). What stays
// in the .cu files: the kernels, their per-block steps (tc_block, tc_block2, the split of
// attention_tcd_kernel) and the launchers and switches.
// CUDA only (mma.sync, ldmatrix, cp.async): the helpers exist when MM_GPU_HAVE_WMMA; the macros
// below always (the host code uses them).
#ifndef MM_GPU_ATTENTION_TC_CUH
#define MM_GPU_ATTENTION_TC_CUH

#include <stdlib.h>
#include <string.h>

#include "gpu_common.cuh"
#include "kernels.h"

#define TC_KEYS 64        // the contract's key block
#define TC_DECODE_ROWS 64 // calls of at most this many rows: one row per block
#define TC_ERR_INDEX 1    // ops.cu's ERR_INDEX: the backend's device error word
#define TC_KB_BUFS 3      // key buffers of the kernels' bf16-cache form: two blocks in flight

#if MM_GPU_HAVE_WMMA

__device__ __forceinline__ void tc_flag(int *d_err) {
    if (d_err != NULL)
        atomicOr(d_err, TC_ERR_INDEX);
}

__device__ __forceinline__ void tc_cp16(void *dst, const void *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void tc_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void tc_wait(void) { // all but the N newest groups
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two f32 -> packed bf16 (lo in the low half), round to nearest even (matmul.cu's pack_bf16).
__device__ __forceinline__ uint32_t tc_pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float tc_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A row's value over the 4 threads that hold it (lanes 4g..4g+3), by a fixed butterfly: the
// same result in all four. tc_quad_max: the maximum; tc_quad_sum: the sum, rounded per add.
__device__ __forceinline__ float tc_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float tc_quad_sum(float x) {
    x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The online softmax's max step for one row, in log2 units: mx (this thread's raw max) becomes
// the row's (tc_quad_max); m' = max(m, c * mx) (fmul is monotonic: the scaled max), alpha =
// 2^(m - m') (1 when unchanged), ms = -m' for p's fma (0 while m' is -inf); m = m'.
__device__ __forceinline__ void tc_max_step(float &mx, float cs, float &m, float &al, float &ms) {
    mx = tc_quad_max(mx);
    const float mn = fmaxf(m, __fmul_rn(mx, cs));
    al = mn == m ? 1.0f : tc_ex2(__fsub_rn(m, mn));
    ms = mn == -INFINITY ? 0.0f : -mn;
    m = mn;
}

// The contract's mask and this thread's raw max for row i (0: g, 1: g + 8) of a 64-key block
// at c0 (s[j][2 i + e]: key c0 + 8 j + 2 tq + e): keys outside [first, pos] become -inf (a
// block wholly inside skips the tests); returns the max over this thread's scores of the row.
__device__ __forceinline__ float tc_mask_max(float (&s)[TC_KEYS / 8][4], int i, int32_t c0,
                                             int32_t first, int32_t pos, int tq) {
    float mx = -INFINITY;
    if (c0 >= first && c0 + TC_KEYS - 1 <= pos) {
#pragma unroll
        for (int j = 0; j < TC_KEYS / 8; j++)
            mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
    } else {
#pragma unroll
        for (int j = 0; j < TC_KEYS / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int32_t t = c0 + 8 * j + 2 * tq + e;
                if (!(t >= first && t <= pos))
                    s[j][2 * i + e] = -INFINITY;
                mx = fmaxf(mx, s[j][2 * i + e]);
            }
    }
    return mx;
}

// Two adjacent outputs o[d], o[d + 1] = a0 / l, a1 / l (as a0 * inv, inv = 1 / l), each only
// below dv.
__device__ __forceinline__ void tc_store2(float *o, int d, int dv, float a0, float a1, float inv) {
    if (d < dv)
        o[d] = __fmul_rn(a0, inv);
    if (d + 1 < dv)
        o[d + 1] = __fmul_rn(a1, inv);
}

// D += A (16x16 row) * B (16x8 col): a[0] row g k 2t.., a[1] row g+8, a[2]/a[3] the same rows
// at k 2t+8..; b0 k 2t.. col g, b1 k 2t+8..; d[0..1] row g cols 2t, 2t+1, d[2..3] row g+8.
__device__ __forceinline__ void tc_mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i (lanes 0..15).
__device__ __forceinline__ void tc_ldsm2(uint32_t &r0, uint32_t &r1, const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(a));
}
// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void tc_ldsm4(uint32_t r[4], const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void tc_ldsm4t(uint32_t r[4], const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The cache block of key t of sequence seq when t is in [t_lo, t_hi] (flagged when the table
// has none), else -1. Loaded one 64-key block ahead of its copies, so the table read's latency
// is not on the issue path.
__device__ __forceinline__ int32_t tc_blk(const struct mm_kv_view &kv, int32_t seq, int32_t t,
                                          int32_t t_lo, int32_t t_hi, int *d_err) {
    if (t < t_lo || t > t_hi)
        return -1;
    if (t < 0 || seq < 0 || t / kv.block_size >= kv.max_blocks) {
        tc_flag(d_err);
        return -1;
    }
    const int32_t blk = kv.block_tables[(int64_t)seq * kv.max_blocks + t / kv.block_size];
    if (blk < 0)
        tc_flag(d_err);
    return blk < 0 ? -1 : blk;
}

// Issues the copies of key t (cache block blk, -1: none) into its stage row ([key][sw] f32,
// sw = dk + dv + 4: K at 0, V at dk), then one commit group (empty when blk < 0): thread part
// of the key's TPK threads takes every TPK-th float4. The same thread converts them
// (tc_convert), so only its own copies need to have landed.
template <int TPK>
__device__ __forceinline__ void tc_issue(const struct mm_kv_view &kv, int32_t t, int32_t blk,
                                         int64_t k_off, int64_t v_off, float *row, int part) {
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    if (blk >= 0) {
        const float *slot = kv.base + (int64_t)blk * kv.block_stride +
                            (int64_t)(t % kv.block_size) * kv.slot_stride;
        for (int i = part; i < dk / 4; i += TPK)
            tc_cp16(row + 4 * i, slot + k_off + 4 * i);
        for (int i = part; i < dv / 4; i += TPK)
            tc_cp16(row + dk + 4 * i, slot + v_off + 4 * i);
    }
    tc_commit();
}

// tc_blk's form for the bf16 cache's kernels: the table entry of key t, raw (a missing entry,
// -1, is flagged by tc_issue_bf16 where it is used, so nothing here waits for the load: it is
// issued one 64-key block ahead of its copies), *r its slot in the block (t % block_size, by a
// shift for the usual power-of-two block sizes); TC_NO_KEY when t is outside [t_lo, t_hi] or
// (flagged) a bad index.
#define TC_NO_KEY INT32_MIN
__device__ __forceinline__ int32_t tc_blk_kb(const struct mm_kv_view &kv, int32_t seq, int32_t t,
                                             int32_t t_lo, int32_t t_hi, int32_t &r, int *d_err) {
    r = 0;
    if (t < t_lo || t > t_hi)
        return TC_NO_KEY;
    const int bs = kv.block_size;
    if (t < 0 || seq < 0 || bs <= 0) {
        tc_flag(d_err);
        return TC_NO_KEY;
    }
    int32_t q;
    if ((bs & (bs - 1)) == 0) {
        q = t >> (__ffs(bs) - 1);
        r = t & (bs - 1);
    } else {
        q = t / bs;
        r = t - q * bs;
    }
    if (q >= kv.max_blocks) {
        tc_flag(d_err);
        return TC_NO_KEY;
    }
    return kv.block_tables[(int64_t)seq * kv.max_blocks + q];
}

// A bf16 cache (struct mm_kv_view.dtype, attention_tc.cu's mm_gpu_kv_dtype): issues the copies
// of key t (cache block blk, -1: none) straight into its bf16 K row (krow) and V row (vrow) of a
// key buffer, 16 bytes (8 dims) a copy, then one commit group; for blk < 0 (a key outside the
// tile's range, or a missing table entry) plain stores of zeros instead, as tc_convert writes
// for a key not staged. Thread part of the key's TPK threads takes every TPK-th piece. The
// cache's bf16 are the f32 values rounded as tc_pack rounds them (ops.cu kv_put), so the
// buffers hold the same bits as tc_convert writes from an f32 cache. Needs dk and dv multiples
// of 8 and 16-byte-aligned slots (mm_gpu_kv_dtype's shapes); the pad dims [dk, dkp) and
// [dv, dvp) are never written here (tc_zero_pads, once per kernel).
// blk and r come from tc_blk_kb (a missing table entry is flagged here, where it is used).
template <int TPK>
__device__ __forceinline__ void tc_issue_bf16(const struct mm_kv_view &kv, int32_t blk, int32_t r,
                                              int64_t k_off, int64_t v_off, uint16_t *krow,
                                              uint16_t *vrow, int part, int *d_err) {
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    if (blk >= 0) {
        const uint16_t *slot = (const uint16_t *)kv.base + (int64_t)blk * kv.block_stride +
                               (int64_t)r * kv.slot_stride;
        for (int i = part; i < dk / 8; i += TPK)
            tc_cp16(krow + 8 * i, slot + k_off + 8 * i);
        for (int i = part; i < dv / 8; i += TPK)
            tc_cp16(vrow + 8 * i, slot + v_off + 8 * i);
    } else {
        if (blk != TC_NO_KEY) // in range, but the table has no block
            tc_flag(d_err);
        for (int i = part; i < dk / 8; i += TPK)
            *(uint4 *)(krow + 8 * i) = make_uint4(0u, 0u, 0u, 0u);
        for (int i = part; i < dv / 8; i += TPK)
            *(uint4 *)(vrow + 8 * i) = make_uint4(0u, 0u, 0u, 0u);
    }
    tc_commit();
}

// tc_next_pass (thread 0 of a prefill block): the rows of the block's next pass: the first
// row still to do (state 1) names the sequence, and every row of it still to do goes to state 2;
// seg = (that sequence, or -1 when no row is left; the start of the key block of its earliest
// first key; its earliest first key; its last position).
__device__ __forceinline__ void tc_next_pass(int rows_pb, int *r_state, const int32_t *r_seq,
                                             const int32_t *r_first, const int32_t *r_pos,
                                             int32_t seg[4]) {
    int32_t sq = -1, c_lo = 0, t_lo = 0, t_hi = -1;
    for (int r = 0; r < rows_pb; r++)
        if (r_state[r] == 1 && sq < 0)
            sq = r_seq[r];
    for (int r = 0; r < rows_pb; r++)
        if (r_state[r] == 1 && r_seq[r] == sq) {
            r_state[r] = 2;
            const int32_t cf = (r_first[r] / TC_KEYS) * TC_KEYS;
            if (t_hi < 0 || cf < c_lo)
                c_lo = cf;
            if (t_hi < 0 || r_first[r] < t_lo)
                t_lo = r_first[r];
            if (r_pos[r] > t_hi)
                t_hi = r_pos[r];
        }
    seg[0] = sq, seg[1] = c_lo, seg[2] = t_lo, seg[3] = t_hi;
}

// Zeros in the pad dims [dk, dkp) of every K row and [dv, dvp) of every V row of nbuf key
// buffers (kb + b * kvsz: [TC_KEYS][ldk] K, then [TC_KEYS][ldv] V), for tc_issue_bf16, which
// leaves them alone (q is zero there, and 0 times stale shared memory could be NaN). dk and dv
// are multiples of 8, so a pad is 0 or 8 dims: one 16-byte store. Visible after the caller's
// next barrier.
__device__ __forceinline__ void tc_zero_pads(uint16_t *kb, int nbuf, int kvsz, int dk, int dv,
                                             int ldk, int ldv) {
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15;
    if (dk == dkp && dv == dvp)
        return;
    for (int i = threadIdx.x; i < nbuf * TC_KEYS; i += blockDim.x) {
        uint16_t *b = kb + (i / TC_KEYS) * kvsz;
        const int key = i % TC_KEYS;
        if (dk < dkp)
            *(uint4 *)(b + key * ldk + dk) = make_uint4(0u, 0u, 0u, 0u);
        if (dv < dvp)
            *(uint4 *)(b + TC_KEYS * ldk + key * ldv + dv) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// This thread's float4s of its key's stage row as bf16 into the K row (dims padded to dkp with
// zeros) and the V row (to dvp); zeros when the key was not staged (ok false). The K and V
// halves stay written out: one helper called twice for them gives the same PTX but for
// register numbering and one integer add's operand order, yet ptxas allocates registers
// differently then (other SASS in 5 of the 14 kernels): not the measured kernels any more.
template <int DKM, int DVM, int TPK>
__device__ __forceinline__ void tc_convert(const float *row, bool ok, int dk, int dv, int dkp,
                                           int dvp, uint16_t *krow, uint16_t *vrow, int part) {
    float4 x[DKM / 4 / TPK];
#pragma unroll
    for (int j = 0; j < DKM / 4 / TPK; j++) {
        const int i = part + TPK * j;
        x[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ok && 4 * i < dk)
            x[j] = *(const float4 *)(row + 4 * i);
    }
#pragma unroll
    for (int j = 0; j < DKM / 4 / TPK; j++) {
        const int i = part + TPK * j;
        if (4 * i < dkp)
            *(uint2 *)(krow + 4 * i) = make_uint2(tc_pack(x[j].x, x[j].y), tc_pack(x[j].z, x[j].w));
    }
    float4 y[DVM / 4 / TPK];
#pragma unroll
    for (int j = 0; j < DVM / 4 / TPK; j++) {
        const int i = part + TPK * j;
        y[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ok && 4 * i < dv)
            y[j] = *(const float4 *)(row + dk + 4 * i);
    }
#pragma unroll
    for (int j = 0; j < DVM / 4 / TPK; j++) {
        const int i = part + TPK * j;
        if (4 * i < dvp)
            *(uint2 *)(vrow + 4 * i) = make_uint2(tc_pack(y[j].x, y[j].y), tc_pack(y[j].z, y[j].w));
    }
}

// ---- host side -------------------------------------------------------------------------------
// Dynamic shared memory of a contract kernel: nst f32 stages [TC_KEYS][dk + dv + 4] (none for a
// bf16 cache), then nbuf bf16 buffers of [TC_KEYS][dkp + 8] keys and [TC_KEYS][dvp + 8] values
// (dims padded to 16).
static inline size_t tc_stage_shmem(int dk, int dv, int nst, int nbuf) {
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15;
    return nst * (size_t)TC_KEYS * (dk + dv + 4) * 4 +
           nbuf * ((size_t)TC_KEYS * (dkp + 8) * 2 + (size_t)TC_KEYS * (dvp + 8) * 2);
}

// Allows kernel k max_shmem bytes of dynamic shared memory (> 48 KiB needs it) once per device
// of this process: *attr_set (k's own) keeps which (harmlessly racy).
template <typename K>
static mm_err tc_allow_shmem(K k, uint64_t *attr_set, size_t max_shmem) {
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    if (!(*attr_set & (1ull << (dev & 63)))) {
        MM_GPU_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)max_shmem));
        *attr_set |= 1ull << (dev & 63);
    }
    return MM_OK;
}

// tc_q_frag: this thread's two units' q (rows g and g + 8 of the m16 tile; q_row[i] their q
// rows, NULL for a unit not in the tile) as the mma A fragments: qf[ks][i + 2 half] = unit i's
// dims 16 ks + 8 half + 2 tq, + 1, rounded to bf16 (zeros past dk and for absent units).
template <int DKM>
__device__ __forceinline__ void tc_q_frag(const float *const (&q_row)[2], int dk, int tq,
                                          uint32_t (&qf)[DKM / 16][4]) {
#pragma unroll
    for (int ks = 0; ks < DKM / 16; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = j & 1, d = 16 * ks + 8 * (j >> 1) + 2 * tq;
            float x0 = 0.0f, x1 = 0.0f;
            if (q_row[i] != NULL) {
                if (d < dk)
                    x0 = q_row[i][d];
                if (d + 1 < dk)
                    x1 = q_row[i][d + 1];
            }
            qf[ks][j] = tc_pack(x0, x1);
        }
}

// tc_scores: the contract's raw scores of one 64-key block for the warp's 16 units from the K
// tile kb ([key][dim] bf16 rows of ldk, dims past dkp skipped): s[j] = keys 8 j + 2 tq (+1) of
// rows g (s[j][0..1]) and g + 8 ([2..3]), dims in 16-wide steps in ascending order.
template <int DKM>
__device__ __forceinline__ void tc_scores(const uint32_t (&qf)[DKM / 16][4], const uint16_t *kb,
                                          int ldk, int dkp, float (&s)[TC_KEYS / 8][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < TC_KEYS / 8; j++)
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    // lane's ldmatrix row: matrix mt = lane / 8 is keys 8 (mt / 2) + lane % 8 of the 16-key
    // pair, dims 8 (mt % 2) of the 16-dim step
    const int mt = lane >> 3;
    const uint16_t *kp = kb + ((mt >> 1) * 8 + (lane & 7)) * ldk + (mt & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < DKM / 16; ks++) {
        if (16 * ks < dkp) {
#pragma unroll
            for (int np = 0; np < TC_KEYS / 16; np++) {
                uint32_t b[4];
                tc_ldsm4(b, kp + np * 16 * ldk + 16 * ks);
                tc_mma(s[2 * np], qf[ks], b[0], b[1]);
                tc_mma(s[2 * np + 1], qf[ks], b[2], b[3]);
            }
        }
    }
}

// tc_p: p = 2^(fma(x, c, ms)) of a block's masked scores s (ms: -m' per row, 0 while m' is
// -inf) as the P V A fragments (pa), and p summed per thread in j order (ps): tc_softmax's p
// step, also attention_tcs.cuh's third phase-B form's.
__device__ __forceinline__ void tc_p(const float (&s)[TC_KEYS / 8][4], float cs,
                                     const float (&ms)[2], uint32_t (&pa)[TC_KEYS / 16][4],
                                     float (&ps)[2]) {
    ps[0] = ps[1] = 0.0f;
#pragma unroll
    for (int j = 0; j < TC_KEYS / 8; j++) {
        const float p0 = tc_ex2(__fmaf_rn(s[j][0], cs, ms[0]));
        const float p1 = tc_ex2(__fmaf_rn(s[j][1], cs, ms[0]));
        const float p2 = tc_ex2(__fmaf_rn(s[j][2], cs, ms[1]));
        const float p3 = tc_ex2(__fmaf_rn(s[j][3], cs, ms[1]));
        ps[0] = __fadd_rn(__fadd_rn(ps[0], p0), p1);
        ps[1] = __fadd_rn(__fadd_rn(ps[1], p2), p3);
        pa[j >> 1][(j & 1) * 2 + 0] = tc_pack(p0, p1);
        pa[j >> 1][(j & 1) * 2 + 1] = tc_pack(p2, p3);
    }
}

// tc_softmax: the contract's online softmax step on one block's masked scores s, given this
// thread's raw row maxima mx (over its own scores): the row max over the row's 4 threads (a
// fixed butterfly), m' = max(m, c * max x), alpha (al), p = 2^(fma(x, c, -m')) as the P V A
// fragments (pa), p summed per thread in j order, l = fma(l, alpha, that sum).
__device__ __forceinline__ void tc_softmax(const float (&s)[TC_KEYS / 8][4], float (&mx)[2],
                                           float cs, float (&m)[2], float (&l)[2],
                                           uint32_t (&pa)[TC_KEYS / 16][4], float (&al)[2]) {
    // in log2 units: t = x * cs; m' = max(m, max t) (fmul is monotonic: max of the
    // scaled scores = the scaled max); p = 2^(x * cs - m') in one fma
    float ms[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        tc_max_step(mx[i], cs, m[i], al[i], ms[i]);
    }
    float ps[2];
    tc_p(s, cs, ms, pa, ps);
#pragma unroll
    for (int i = 0; i < 2; i++)
        l[i] = __fmaf_rn(l[i], al[i], ps[i]);
}

#endif // MM_GPU_HAVE_WMMA

// The heads of a kv group that share a key block's load: the largest divisor of group that is
// at most max (both launchers' gsub).
static inline int tc_group_sub(int group, int max) {
    int gsub = 1;
    for (int s = 1; s <= max && s <= group; s++)
        if (group % s == 0)
            gsub = s;
    return gsub;
}

// Whether environment variable name is set to exactly val: for both files' switch readers
// (tc_mode, tcd_mode, ...), each of which keeps its answer in its own static.
static inline int tc_env_is(const char *name, const char *val) {
    const char *e = getenv(name);
    return e != NULL && strcmp(e, val) == 0;
}

#endif // MM_GPU_ATTENTION_TC_CUH
