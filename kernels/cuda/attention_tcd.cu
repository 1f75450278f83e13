// SPDX-License-Identifier: MIT
// Decode calls of the tensor-core attention contract (attention_tc.cu) with every warp
// computing: the same bits as attention_tc_kernel, in less time per 64-key block.
//
// Design notes:
// - At decode (at most TC_DECODE_ROWS rows) attention_tc_kernel runs one block of 8 warps per
//   (row, kv head) with the GQA group as the m16 tile of warp 0: the other 7 warps only stage
//   K/V, and warp 0 alone runs the block's 64 score mmas, the softmax and 64 P V mmas, one
//   64-key block after the other (~4 blocks at the bench's 128-230 tokens of context, 4 blocks
//   of 8 warps on the whole GPU at batch 1).
// - Here the same block (same grid, same staging: K/V by cp.async into a stage row per key,
//   converted to bf16 by the thread that copied them, into one of two buffers, the cache table
//   read one block ahead) splits each 64-key block over its 8 warps: warp j computes the
//   scores of keys 8j..8j+7 (one mma n-tile: the same mma sequence over the dims as warp 0's
//   n-tile j), the row maxima meet in shared memory, warp j computes p of its keys, the packed
//   P (bf16) and the f32 p meet in shared memory, and warp j runs the P V mmas of dims
//   16j..16j+15 (two n-tiles; each output n-tile's mma chain over the 4 key steps is the one
//   warp 0 ran). Every rounded operation is attention_tc.cu's tc_block with the same operands:
//   an mma output element depends only on its A row, B column and C element, the per-thread p
//   sums read the p values in the same j order (lane (g, tq) of every warp is the thread
//   (g, tq) of warp 0), the row max is exact in any order (a -0/+0 tie changes no result,
//   see ops.cu's prefill note), so the outputs are the same bits (cuda_attention_tcd_test).
// - The staging (tc_blk, tc_issue, tc_convert), tc_pack, tc_ex2, tc_mma and the ldmatrix loads
//   are attention_tc.cuh's, the same source as attention_tc_kernel's; this file holds the kernel
//   and its launcher and switches.
// - Cost per 64-key block: 8 + 8 mmas per warp instead of 64 + 64 on warp 0, and two barriers
//   instead of one. GQA groups above 16 (one m16 tile) take several blocks per kv head (a row's
//   result does not depend on its tile neighbours: the contract).
// - Measured (H200, 2026-11-30 06:47 UTC, kernels/cuda/bench/tcd_run.sh; docs/BENCHMARKS.md):
//   per call at ~194 tokens of context (ncu) 15.1 us against 19.6 for attention_tc_kernel;
//   whole-model decode batch 1 (4-layer Qwen3-30B-A3B, graph) 1686-1701 tok/s against
//   1635-1659, after a 4096-token prompt 699 against 607 tok/s. Two key blocks in flight
//   (MM_GPU_ATT_TCD_STAGES=2: 203 KB of shared memory) and an L2 prefetch of the keys before
//   the wait (removed) were slower in the whole model (batch 1 1623-1637 and 1653-1670; batch
//   64 24418 and 24379 against 25864), so the default is one block in flight. Calls of 64 rows with this default were not measured: the default takes calls
//   of at most TCD_AUTO_ROWS rows (batch 1 measured; 2..8 rows the same blocks, more of them in
//   one wave), MM_GPU_ATT_TCD=1 every decode call (at most 64 rows), =0 none.
//   CUDA only (HIP has no contract kernel: ops.cu's f32 kernels run there).
// - A bf16 cache (attention_tc.cu's mm_gpu_kv_dtype): no stage and no conversion; each key's
//   K and V rows copied by cp.async straight into one of NB buffers (MM_GPU_ATT_TCD_KB_BUFS: 3,
//   4 or 6), NB - 1 key blocks in flight, the copies of block j + NB - 1 issued after block j's
//   first barrier into the buffer block j - 1 left. Same bits (cuda_attention_tc_test).
// - The kernel's body is tcd_block, a device function, so that attention_tcs.cuh's kernel
//   (decode calls with the key blocks split over many blocks, MM_GPU_ATT_SPLITK, included
//   below) runs it for rows of few key blocks.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tc.cuh"
#include "gpu_common.cuh"
#include "head_rope.cuh"
#include "kernels.h"
#include "mm_gpu.h"

#define TCD_WARPS 8     // one warp per 8-key n-tile of a key block
#define TCD_THREADS (TCD_WARPS * 32)
#define TCD_TPK (TCD_THREADS / TC_KEYS) // threads staging one key
#define TCD_AUTO_ROWS 8 // the default takes calls of at most this many rows (see above)

static int g_tcd = -1;        // -1: from MM_GPU_ATT_TCD at first use; 0 off; 1 on; 2 auto
static int g_tcd_stages = -1; // -1: from MM_GPU_ATT_TCD_STAGES at first use (1 or 2; default 1)
static int g_tcd_kb_bufs = -1; // -1: from MM_GPU_ATT_TCD_KB_BUFS at first use (3, 4, 6; default 4)
static int g_tcd_gsub = -1;    // -1: from MM_GPU_ATT_TCD_GSUB at first use (1..16; default 16)

#if MM_GPU_HAVE_WMMA
#define TCD_HAVE 1

// attention_prep's preparation inside the attention (attention_tcd_prep_kernel): the block of
// (row, kv head) norms and rotates its kv head's queries in x and its key, writes the key and
// the value to the row's cache slot, with head_norm_rope_kv_row_kernel's operations per element
// (head_rope.cuh: lane l holds elements l + 32 j of a 128-dim head), so the same bits; then the block's attention reads them after a barrier. Device copy of
// struct mm_attn_prep's fields.
struct tcd_prep {
    float *x;
    int64_t stride, b_off;
    const void *wa, *wb; // norm weights or NULL
    int wa_f32, wb_f32;  // 1: f32 weights, 0: bf16
    float eps;
    const float *inv_freq;
    float mscale;
    const float *v; // the values' rows
    int64_t v_stride;
    int signal; // where the block signals its dependents (MM_GPU_ATT_SIGNAL): 0 its start, 1
                // after its wait, 2 after the preparation, 3 once its first key block is in
};
#define TCD_PREP_HD 128

__device__ __forceinline__ float tcd_prep_w(const void *w, int f32, int k) {
    return f32 ? ((const float *)w)[k] : mm_gpu_bf16_to_f32(((const uint16_t *)w)[k]);
}

// Before the wait (none of it is the kernel before's): this lane's norm weights (q, k), the
// rotation's cos and sin of its pairs at position pos.
__device__ __forceinline__ void tcd_prep_pre(const tcd_prep &p, int32_t pos, int lane,
                                             float wq[4], float wk[4], float cs[2], float sn[2]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        wq[j] = p.wa != NULL ? tcd_prep_w(p.wa, p.wa_f32, lane + 32 * j) : 0.0f;
        wk[j] = p.wb != NULL ? tcd_prep_w(p.wb, p.wb_f32, lane + 32 * j) : 0.0f;
    }
    float fr[2];
#pragma unroll
    for (int j = 0; j < 2; j++)
        fr[j] = p.inv_freq[lane + 32 * j];
    hr_angles<2>((float)pos, fr, p.mscale, cs, sn);
}

// After the wait: units u = warp, warp + TCD_WARPS, ..: the group's query heads h0 + u (u <
// group), the key (u == group), the value (u == group + 1); slot: the element offset of the
// row's cache slot in the bf16 pool (< 0: none, flagged by the table lookup).
__device__ __forceinline__ void tcd_prep_run(const tcd_prep &p, const struct mm_attn_args &a,
                                             int64_t r, int kvh, int h0, int group, int64_t slot,
                                             int warp, int lane, const float wq[4],
                                             const float wk[4], const float cs[2],
                                             const float sn[2]) {
    const struct mm_kv_view &kv = a.kv;
    uint16_t *const sb = slot >= 0 ? (uint16_t *)kv.base + slot : NULL;
    for (int u = warp; u < group + 2; u += TCD_WARPS) {
        if (u == group + 1) { // the value: a copy
            if (sb != NULL) {
                const float *vr = p.v + r * p.v_stride + (int64_t)kvh * TCD_PREP_HD;
                uint16_t *sv = sb + (int64_t)kv.n_kv_heads * kv.head_dim_k + (int64_t)kvh * TCD_PREP_HD;
#pragma unroll
                for (int j = 0; j < 4; j++)
                    kv_put(sv, true, lane + 32 * j, vr[lane + 32 * j]);
            }
            continue;
        }
        const bool isk = u == group;
        float *xr = p.x + r * p.stride +
                    (isk ? p.b_off + (int64_t)kvh * TCD_PREP_HD : (int64_t)(h0 + u) * TCD_PREP_HD);
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            v[j] = xr[lane + 32 * j];
        if ((isk ? p.wb : p.wa) != NULL)
            hr_norm<4>(v, isk ? wk : wq, TCD_PREP_HD, p.eps);
        hr_rope<4>(v, cs, sn);
#pragma unroll
        for (int j = 0; j < 4; j++)
            xr[lane + 32 * j] = v[j];
        if (isk && sb != NULL) {
            uint16_t *sk = sb + (int64_t)kvh * TCD_PREP_HD;
#pragma unroll
            for (int j = 0; j < 4; j++)
                kv_put(sk, true, lane + 32 * j, v[j]);
        }
    }
}

// This lane's 4 elements of a 128-dim row as bf16 (kv_put's rounding) into a cache row and a key
// buffer row (either may be NULL).
__device__ __forceinline__ void tcd_put2(uint16_t *a, uint16_t *b, const float v[4], int lane) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (a != NULL)
            kv_put(a, true, lane + 32 * j, v[j]);
        if (b != NULL)
            kv_put(b, true, lane + 32 * j, v[j]);
    }
}

// tcd_prep_run with every unit's row loaded before the first is computed (one round of loads:
// warps 0 and 1 hold two units at Qwen3's group of 8, the key among them), each result also
// written where the block's attention reads it: the queries (f32) to qs[u][128], and, where ks
// is not NULL, the key and the value (bf16, kv_put's rounding) to their rows of the key buffer
// (the key's copy from the cache is not issued then). The same operations per element, so the
// same bits in x and in the cache.
__device__ __forceinline__ void tcd_prep_run2(const tcd_prep &p, const struct mm_attn_args &a,
                                              int64_t r, int kvh, int h0, int group, int64_t slot,
                                              int warp, int lane, const float wq[4],
                                              const float wk[4], const float cs[2],
                                              const float sn[2], float *qs, uint16_t *ks,
                                              uint16_t *vs) {
    const struct mm_kv_view &kv = a.kv;
    uint16_t *const sb = slot >= 0 ? (uint16_t *)kv.base + slot : NULL;
    float v[3][4]; // units warp, warp + 8, warp + 16 (group + 2 <= 18)
#pragma unroll
    for (int i = 0; i < 3; i++) {
        const int u = warp + TCD_WARPS * i;
        if (u < group + 2) {
            const float *src =
                u == group + 1 ? p.v + r * p.v_stride + (int64_t)kvh * TCD_PREP_HD
                : u == group   ? p.x + r * p.stride + p.b_off + (int64_t)kvh * TCD_PREP_HD
                               : p.x + r * p.stride + (int64_t)(h0 + u) * TCD_PREP_HD;
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[i][j] = src[lane + 32 * j];
        }
    }
#pragma unroll
    for (int i = 0; i < 3; i++) {
        const int u = warp + TCD_WARPS * i;
        if (u >= group + 2)
            break;
        if (u == group + 1) { // the value: a copy
            tcd_put2(sb != NULL ? sb + (int64_t)kv.n_kv_heads * kv.head_dim_k +
                                      (int64_t)kvh * TCD_PREP_HD
                                : NULL,
                     vs, v[i], lane);
            continue;
        }
        const bool isk = u == group;
        float *xr = p.x + r * p.stride +
                    (isk ? p.b_off + (int64_t)kvh * TCD_PREP_HD : (int64_t)(h0 + u) * TCD_PREP_HD);
        if ((isk ? p.wb : p.wa) != NULL)
            hr_norm<4>(v[i], isk ? wk : wq, TCD_PREP_HD, p.eps);
        hr_rope<4>(v[i], cs, sn);
#pragma unroll
        for (int j = 0; j < 4; j++)
            xr[lane + 32 * j] = v[i][j];
        if (isk) {
            tcd_put2(sb != NULL ? sb + (int64_t)kvh * TCD_PREP_HD : NULL, ks, v[i], lane);
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                qs[u * TCD_PREP_HD + lane + 32 * j] = v[i][j];
        }
    }
}

// One block per (row, gsub query heads of one kv head); gsub <= 16 (one m16 tile: unit u =
// head h0 + u is tile row u). Dynamic shared memory: two f32 stages [TC_KEYS][dk + dv + 4]
// (two key blocks in flight), then two bf16 buffers of [TC_KEYS][ldk] keys and [ldv] values.
// NB > 0: a bf16 cache: no stage, NB key buffers, block j copied straight into buffer j % NB
// while block j - NB + 1 is computed (NB - 1 blocks in flight; NST unused, the launcher gives 1).
// NB 0: an f32 cache (NST stages, two buffers).
// tcd_block: the block of row rb and tile ty (blockIdx.x and .y of attention_tcd_kernel's
// grid; attention_tcs.cuh's kernel runs it for rows of few key blocks), after mm_dep_wait, or
// with early (a.keys_early: the caller has not waited) before it: a bf16 cache's copies of the
// keys below the row's position (stored by earlier steps) are issued first, then the wait,
// then the rest (the key at the position is the kernel before's).
// PREP (attention_tcd_prep_kernel, early, a bf16 cache, one block per kv head, 128-dim heads):
// pp's preparation of the block's heads first (tcd_prep_pre before the wait, tcd_prep_run and
// a barrier after it), so the block's own q and its key at the position are read after it.
// PSM (with PREP; MM_GPU_ATT_PREP_SM): tcd_prep_run2, the queries read from shared memory
// (after the key buffers: [16][128] f32) and, when the row's key falls in the first NB - 1
// blocks, its rows written into the key buffer by the preparation, so that every copy from the
// cache is issued before the wait and none waits on the preparation's stores.
template <int DKM, int DVM, int NST, int NB, bool PREP = false, bool PSM = false>
__device__ __forceinline__ void tcd_block(const struct mm_attn_args &a, int gsub, int *d_err,
                                          unsigned rb, unsigned ty, bool early = false,
                                          const tcd_prep *pp = NULL) {
    static_assert(NST == 1 || NST == 2, "stages");
    static_assert(NB == 0 || NB >= 3, "bf16 buffers");
    constexpr bool KB = NB > 0;
    extern __shared__ __align__(16) unsigned char tcd_sh[];
    __shared__ float red[TCD_WARPS][16];              // each warp's row maxima of its keys
    __shared__ uint32_t pk[TCD_WARPS][32][2];         // P as bf16 pairs: [n-tile][lane][row]
    __shared__ __align__(16) float pf[TCD_WARPS][32][4]; // the same p in f32
    const struct mm_kv_view &kv = a.kv;
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15;
    const int ldk = dkp + 8, ldv = dvp + 8, sw = dk + dv + 4;
    const int kvsz = TC_KEYS * (ldk + ldv);
    float *stage = (float *)tcd_sh; // [NST][TC_KEYS][sw] f32 (f32 cache only)
    uint16_t *kb = (uint16_t *)(stage + (KB ? 0 : NST * TC_KEYS * sw)); // buffer b: kb + b * kvsz
    float *const qsm = PSM ? (float *)(kb + NB * kvsz) : NULL; // PSM: the prepared queries
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int skey = tid / TCD_TPK, part = tid % TCD_TPK; // the key this thread stages
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gsub;
    const int kvh = ty / per_kv, h0 = kvh * group + (ty % per_kv) * gsub;
    const int64_t r = rb;
    const int64_t k_off = (int64_t)kvh * dk,
                  v_off = (int64_t)kv.n_kv_heads * dk + (int64_t)kvh * dv;
    const int32_t sq = a.row_seq[r], pos = a.row_pos[r];
    if (pos < 0 || sq < 0 || pos / kv.block_size >= kv.max_blocks) {
        if (tid == 0)
            tc_flag(d_err);
        return;
    }
    if (!KB && early)
        mm_dep_wait(); // an f32 cache: everything after the wait
    int32_t first = 0;
    if (a.window > 0 && pos - a.window + 1 > 0)
        first = pos - a.window + 1;
    const int32_t c_lo = (first / TC_KEYS) * TC_KEYS;
    bool uin[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        uin[i] = g + 8 * i < gsub;
    // staging: block b's copies go to stage row b % NST (NST blocks in flight), each issue one
    // commit group (empty past pos), so "block b landed" is cp.async.wait_group NST - 1 while
    // the groups of blocks b + 1 .. b + NST - 1 are the only newer ones; the cache table is
    // read one block ahead
    float *const srow0 = stage + skey * sw, *const srow1 = stage + ((NST - 1) * TC_KEYS + skey) * sw;
    // bf16 cache: key skey's rows in buffer b
    // (blk, kr: tc_blk_kb's table entry and slot of the next key to copy)
    int32_t kr = 0;
    auto kb_issue = [&](int32_t b, int buf) {
        uint16_t *k = kb + buf * kvsz + skey * ldk;
        tc_issue_bf16<TCD_TPK>(kv, b, kr, k_off, v_off, k,
                               kb + buf * kvsz + TC_KEYS * ldk + skey * ldv, part, d_err);
    };
    int32_t blk = KB ? tc_blk_kb(kv, sq, c_lo + skey, first, pos, kr, d_err)
                     : tc_blk(kv, sq, c_lo + skey, first, pos, d_err);
    unsigned okm = blk >= 0 ? 1u : 0u; // bit s: stage row s's key staged
    if constexpr (KB) { // blocks 0 .. NB - 2 into buffers 0 .. NB - 2 (one group each)
        tc_zero_pads(kb, NB, kvsz, dk, dv, ldk, ldv);
        int b = 0;
        // PSM: the row's key in the first NB - 1 blocks is written into its buffer row by the
        // preparation (its copy is an empty commit group here)
        const int32_t prel = pos - c_lo;
        const bool pin = PSM && prel < (NB - 1) * TC_KEYS;
        // early: this thread's keys of blocks before the one holding the row's position first
        // (in block order, so its commit groups keep their order)
        for (; early && b < NB - 1 && (pin || c_lo + b * TC_KEYS + skey != pos); b++) {
            if (pin && c_lo + b * TC_KEYS + skey == pos)
                tc_commit();
            else
                kb_issue(blk, b);
            blk = tc_blk_kb(kv, sq, c_lo + (b + 1) * TC_KEYS + skey, first, pos, kr, d_err);
        }
        if constexpr (PREP) {
            float wq[4], wk[4], cs[2], sn[2];
            tcd_prep_pre(*pp, pos, lane, wq, wk, cs, sn);
            int32_t rs_ = 0; // the row's own slot (its table entry: a copy from the host)
            const int32_t pb = tc_blk_kb(kv, sq, pos, pos, pos, rs_, d_err);
            const int64_t slot = pb >= 0 ? (int64_t)pb * kv.block_stride + (int64_t)rs_ * kv.slot_stride
                                         : -1;
            mm_dep_wait();
            if (pp->signal == 1)
                mm_dep_signal();
            if constexpr (PSM) {
                uint16_t *const kbp = kb + (prel / TC_KEYS) * kvsz;
                tcd_prep_run2(*pp, a, r, kvh, h0, group, slot, warp, lane, wq, wk, cs, sn, qsm,
                              pin ? kbp + (prel % TC_KEYS) * ldk : NULL,
                              pin ? kbp + TC_KEYS * ldk + (prel % TC_KEYS) * ldv : NULL);
            } else {
                tcd_prep_run(*pp, a, r, kvh, h0, group, slot, warp, lane, wq, wk, cs, sn);
            }
            __threadfence_block();
            __syncthreads(); // q and the key at the position, as the attention below reads them
            if (pp->signal == 2)
                mm_dep_signal();
        } else if (early) {
            mm_dep_wait();
        }
        for (; b < NB - 1; b++) {
            kb_issue(blk, b);
            blk = tc_blk_kb(kv, sq, c_lo + (b + 1) * TC_KEYS + skey, first, pos, kr, d_err);
        }
    } else {
        tc_issue<TCD_TPK>(kv, c_lo + skey, blk, k_off, v_off, srow0, part);
        if (NST == 2) {
            blk = tc_blk(kv, sq, c_lo + TC_KEYS + skey, first, pos, d_err);
            okm |= blk >= 0 ? 2u : 0u;
            tc_issue<TCD_TPK>(kv, c_lo + TC_KEYS + skey, blk, k_off, v_off, srow1, part);
        }
        blk = tc_blk(kv, sq, c_lo + NST * TC_KEYS + skey, first, pos, d_err);
    }
    // q as A fragments (attention_tc_kernel's qf of warp 0), loaded while the copies fly
    uint32_t qf[DKM / 16][4];
    {
        const float *q_row[2];
#pragma unroll
        for (int i = 0; i < 2; i++)
            q_row[i] = !uin[i] ? NULL
                       : PSM   ? qsm + (g + 8 * i) * TCD_PREP_HD
                               : a.q + r * a.q_stride + (int64_t)(h0 + g + 8 * i) * dk;
        tc_q_frag<DKM>(q_row, dk, tq, qf);
    }
    const float cs = a.scale * 1.4426950408889634f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[2][4]; // n-tiles 2 warp, 2 warp + 1 (dims 16 warp ..)
#pragma unroll
    for (int n = 0; n < 2; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const bool pv = 16 * warp < dvp; // this warp has value dims
    if constexpr (KB) {
        tc_wait<(KB ? NB - 2 : 0)>(); // this thread's copies of block 0 landed (1.. may fly)
    } else {
        tc_wait<NST - 1>();
        tc_convert<DKM, DVM, TCD_TPK>(srow0, okm & 1u, dk, dv, dkp, dvp, kb + skey * ldk,
                                      kb + TC_KEYS * ldk + skey * ldv, part);
        okm = (okm & ~1u) | (blk >= 0 ? 1u : 0u); // block NST into stage row 0
        tc_issue<TCD_TPK>(kv, c_lo + NST * TC_KEYS + skey, blk, k_off, v_off, srow0, part);
        blk = tc_blk(kv, sq, c_lo + (NST + 1) * TC_KEYS + skey, first, pos, d_err);
    }
    __syncthreads(); // buffer 0 ready
    if (PREP && pp->signal == 3)
        mm_dep_signal();
    int bi = 0;
    for (int32_t c0 = c_lo; c0 <= pos; c0 += TC_KEYS) {
        const uint16_t *kc = kb + bi * kvsz, *vc = kc + TC_KEYS * ldk;
        // scores of keys c0 + 8 warp + 2 tq (+1): rows g (s[0..1]) and g + 8 (s[2..3])
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        {
            const uint16_t *kp = kc + (8 * warp + (lane & 7)) * ldk + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int ks = 0; ks < DKM / 16; ks++) {
                if (16 * ks < dkp) {
                    uint32_t b0, b1;
                    tc_ldsm2(b0, b1, kp + 16 * ks);
                    tc_mma(s, qf[ks], b0, b1);
                }
            }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int32_t t = c0 + 8 * warp + 2 * tq + e;
                if (!(uin[i] && t >= first && t <= pos))
                    s[2 * i + e] = -INFINITY;
                mx[i] = fmaxf(mx[i], s[2 * i + e]);
            }
            mx[i] = tc_quad_max(mx[i]);
        }
        if (tq == 0) {
            red[warp][g] = mx[0];
            red[warp][g + 8] = mx[1];
        }
        __syncthreads(); // every warp's maxima
        float al[2], ms[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float x = red[0][g + 8 * i];
#pragma unroll
            for (int w = 1; w < TCD_WARPS; w++)
                x = fmaxf(x, red[w][g + 8 * i]);
            const float mn = fmaxf(m[i], __fmul_rn(x, cs));
            al[i] = mn == m[i] ? 1.0f : tc_ex2(__fsub_rn(m[i], mn));
            ms[i] = mn == -INFINITY ? 0.0f : -mn;
            m[i] = mn;
        }
        {
            const float p0 = tc_ex2(__fmaf_rn(s[0], cs, ms[0]));
            const float p1 = tc_ex2(__fmaf_rn(s[1], cs, ms[0]));
            const float p2 = tc_ex2(__fmaf_rn(s[2], cs, ms[1]));
            const float p3 = tc_ex2(__fmaf_rn(s[3], cs, ms[1]));
            pk[warp][lane][0] = tc_pack(p0, p1);
            pk[warp][lane][1] = tc_pack(p2, p3);
            *(float4 *)pf[warp][lane] = make_float4(p0, p1, p2, p3);
        }
        // bf16 cache: block j + NB - 1's copies into buffer (j + NB - 1) % NB (block j - 1's:
        // every warp read it before the barrier above), then this thread's copies of block
        // j + 1 landed (the groups of blocks j + 2 .. j + NB - 1 are the only newer ones; made
        // visible to all by the barrier below)
        if constexpr (KB) {
            if (c0 + (NB - 1) * TC_KEYS <= pos) {
                kb_issue(blk, bi == 0 ? NB - 1 : bi - 1);
                blk = tc_blk_kb(kv, sq, c0 + NB * TC_KEYS + skey, first, pos, kr, d_err);
            } else {
                tc_commit(); // an empty group: the count of newer groups stays NB - 2
            }
            tc_wait<(KB ? NB - 2 : 0)>();
        }
        // block j + 1 (stage row (j + 1) % NST, issued NST blocks ago) into the other buffer,
        // then block j + 1 + NST's copies into that stage row
        if (!KB && c0 + TC_KEYS <= pos) {
            uint16_t *kn = kb + (bi ^ 1) * kvsz;
            tc_wait<NST - 1>();
            float *const sr = NST == 1 || bi ? srow0 : srow1;
            const unsigned sb = NST == 1 || bi ? 1u : 2u;
            tc_convert<DKM, DVM, TCD_TPK>(sr, (okm & sb) != 0, dk, dv, dkp, dvp,
                                          kn + skey * ldk, kn + TC_KEYS * ldk + skey * ldv, part);
            okm = (okm & ~sb) | (blk >= 0 ? sb : 0u);
            tc_issue<TCD_TPK>(kv, c0 + (NST + 1) * TC_KEYS + skey, blk, k_off, v_off, sr, part);
            blk = tc_blk(kv, sq, c0 + (NST + 2) * TC_KEYS + skey, first, pos, d_err);
        }
        __syncthreads(); // every warp's p
        // p summed per thread in n-tile order (tc_block's j order), then l
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < TCD_WARPS; j++) {
            const float4 p = *(const float4 *)pf[j][lane];
            ps[0] = __fadd_rn(__fadd_rn(ps[0], p.x), p.y);
            ps[1] = __fadd_rn(__fadd_rn(ps[1], p.z), p.w);
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
            l[i] = __fmaf_rn(l[i], al[i], ps[i]);
        if (pv) {
#pragma unroll
            for (int n = 0; n < 2; n++) {
                acc[n][0] = __fmul_rn(acc[n][0], al[0]);
                acc[n][1] = __fmul_rn(acc[n][1], al[0]);
                acc[n][2] = __fmul_rn(acc[n][2], al[1]);
                acc[n][3] = __fmul_rn(acc[n][3], al[1]);
            }
            const int mt = lane >> 3;
            const uint16_t *vp = vc + ((mt & 1) * 8 + (lane & 7)) * ldv + (mt >> 1) * 8 + 16 * warp;
#pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; kk++) {
                const uint32_t pa[4] = {pk[2 * kk][lane][0], pk[2 * kk][lane][1],
                                        pk[2 * kk + 1][lane][0], pk[2 * kk + 1][lane][1]};
                uint32_t b[4];
                tc_ldsm4t(b, vp + kk * 16 * ldv);
                tc_mma(acc[0], pa, b[0], b[1]);
                tc_mma(acc[1], pa, b[2], b[3]);
            }
        }
        // no barrier here: the next buffer was converted (or copied) before the barrier above,
        // and a warp writes red, pk, pf or a buffer again only after the next block's first
        // barrier, which every warp reaches after its reads of this block
        bi = KB ? (bi == NB - 1 ? 0 : bi + 1) : bi ^ 1;
    }
    // l over the row's 4 threads (attention_tc_kernel's butterfly), then this warp's dims
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] = tc_quad_sum(l[i]);
    }
    if (!pv)
        return;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (!uin[i])
            continue;
        const float inv = 1.0f / l[i];
        float *o = a.out + r * a.out_stride + (int64_t)(h0 + g + 8 * i) * dv;
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const int d = 16 * warp + 8 * n + 2 * tq;
            tc_store2(o, d, dv, acc[n][2 * i], acc[n][2 * i + 1], inv);
        }
    }
}

template <int DKM, int DVM, int NST, int NB>
__global__ void __launch_bounds__(TCD_THREADS, 1)
    attention_tcd_kernel(struct mm_attn_args a, int gsub, int *d_err) {
    mm_dep_signal();
    if (!a.keys_early)
        mm_dep_wait();
    tcd_block<DKM, DVM, NST, NB>(a, gsub, d_err, blockIdx.x, blockIdx.y, a.keys_early != 0);
}

// attention_prep on the device: attention_tcd_kernel's blocks with the preparation first; the
// next kernel may launch from where p.signal says (tcd_block; at the start with 0)
template <int NB, bool PSM>
__global__ void __launch_bounds__(TCD_THREADS, 1)
    attention_tcd_prep_kernel(struct mm_attn_args a, struct tcd_prep p, int gsub, int *d_err) {
    if (p.signal == 0)
        mm_dep_signal();
    tcd_block<TCD_PREP_HD, TCD_PREP_HD, 1, NB, true, PSM>(a, gsub, d_err, blockIdx.x, blockIdx.y,
                                                          true, &p);
}

// dynamic shared memory: NST stages and two buffers (f32 cache, nb 0), nb buffers (bf16)
static size_t tcd_shmem(int dk, int dv, int nst, int nb) {
    return nb > 0 ? tc_stage_shmem(dk, dv, 0, nb) : tc_stage_shmem(dk, dv, nst, 2);
}

template <int DKM, int DVM, int NST, int NB>
static mm_err tcd_launch(void *stream, const struct mm_attn_args *a, int gsub, int *d_err) {
    static uint64_t attr_set; // tc_allow_shmem's: this kernel's devices
    const mm_err rv = tc_allow_shmem(attention_tcd_kernel<DKM, DVM, NST, NB>, &attr_set,
                                     tcd_shmem(DKM, DVM, NST, NB));
    if (rv != MM_OK)
        return rv;
    const int group = a->n_heads / a->kv.n_kv_heads;
    dim3 grid((unsigned)a->n_rows, (unsigned)(a->kv.n_kv_heads * (group / gsub)));
    MM_GPU_CHECK(mm_launch_dep(attention_tcd_kernel<DKM, DVM, NST, NB>, grid, dim3(TCD_THREADS),
                               tcd_shmem(a->kv.head_dim_k, a->kv.head_dim_v, NST, NB),
                               (cudaStream_t)stream, *a, gsub, d_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}
#else
#define TCD_HAVE 0
#endif

// decode calls with the key blocks split over many blocks (mm_gpu_attention_tcs; same bits)
#include "attention_tcs.cuh"

// 0 off, 1 every decode call, 2 (MM_GPU_ATT_TCD unset or other values) calls of at most
// TCD_AUTO_ROWS rows
static int tcd_mode(void) {
    if (g_tcd < 0) {
        g_tcd = tc_env_is("MM_GPU_ATT_TCD", "0") ? 0 : tc_env_is("MM_GPU_ATT_TCD", "1") ? 1 : 2;
    }
    return g_tcd;
}

// key blocks in flight: 1 (default: attention_tc_kernel's depth) or 2 (MM_GPU_ATT_TCD_STAGES=2)
static int tcd_stages(void) {
    if (g_tcd_stages < 0) {
        g_tcd_stages = tc_env_is("MM_GPU_ATT_TCD_STAGES", "2") ? 2 : 1;
    }
    return g_tcd_stages;
}

// key buffers of the bf16-cache form: 3, 4 (three blocks in flight, the default) or 6
// (MM_GPU_ATT_TCD_KB_BUFS; dk = dv = 128: 104, 139, 209 KB of shared memory). Same bits. H200
// (09:31 and 09:54 UTC, in turn): decode after a 4096-token prompt 4 buffers 875-890 tok/s
// against 3 buffers 844-850; batch 1 the same within noise (1752/1774 against 1772/1737).
static int tcd_kb_bufs(void) {
    if (g_tcd_kb_bufs < 0) {
        g_tcd_kb_bufs = tc_env_is("MM_GPU_ATT_TCD_KB_BUFS", "6")   ? 6
                        : tc_env_is("MM_GPU_ATT_TCD_KB_BUFS", "3") ? 3
                                                                   : 4;
    }
    return g_tcd_kb_bufs;
}

// the most query heads of a kv head one block takes (tc_group_sub): 16 (the default: Qwen3's
// group of 8 in one block) down to 1 (MM_GPU_ATT_TCD_GSUB: more blocks, each walking the same
// keys for fewer heads; same bits: a row's result does not depend on its tile neighbours)
static int tcd_gsub(void) {
    if (g_tcd_gsub < 0) {
        const char *e = getenv("MM_GPU_ATT_TCD_GSUB");
        const int v = e != NULL ? atoi(e) : 16;
        g_tcd_gsub = v >= 1 && v <= 16 ? v : 16;
    }
    return g_tcd_gsub;
}

// mm_gpu_set_attention_tcd_kb_bufs: 3, 4 or 6 key buffers for a bf16 cache; other values:
// back to MM_GPU_ATT_TCD_KB_BUFS. mm_gpu_set_attention_tcd_gsub: 1..16 heads per block at
// most; other values: back to MM_GPU_ATT_TCD_GSUB. Same bits. Process-wide.
extern "C" void mm_gpu_set_attention_tcd_kb_bufs(int n);
extern "C" void mm_gpu_set_attention_tcd_kb_bufs(int n) {
    g_tcd_kb_bufs = n == 3 || n == 4 || n == 6 ? n : -1;
}
extern "C" void mm_gpu_set_attention_tcd_gsub(int n);
extern "C" void mm_gpu_set_attention_tcd_gsub(int n) { g_tcd_gsub = n >= 1 && n <= 16 ? n : -1; }

// mm_gpu_set_attention_tcd_stages: 1 or 2 key blocks in flight; other values: back to
// MM_GPU_ATT_TCD_STAGES (default 1). Same bits. Process-wide.
extern "C" void mm_gpu_set_attention_tcd_stages(int n);
extern "C" void mm_gpu_set_attention_tcd_stages(int n) { g_tcd_stages = n == 1 || n == 2 ? n : -1; }

// mm_gpu_set_attention_tcd: 1 every decode call of the tensor-core contract (at most 64 rows)
// on attention_tcd_kernel, 2 calls of at most TCD_AUTO_ROWS rows (the default), 0 none (all on
// attention_tc_kernel), < 0 back to MM_GPU_ATT_TCD (read at the next call). Same bits.
// Process-wide.
extern "C" void mm_gpu_set_attention_tcd(int mode);
extern "C" void mm_gpu_set_attention_tcd(int mode) { g_tcd = mode < 0 ? -1 : mode > 2 ? 2 : mode; }

// mm_gpu_attention_tcd: runs a decode call of the contract and sets *done when on and a's
// shape is one it takes (attention_tc.cu calls it after its own shape checks: head dims <= 128,
// multiples of 4, a 16-byte-aligned cache); *done 0 otherwise.
extern "C" mm_err mm_gpu_attention_tcd(void *stream, const struct mm_attn_args *a, int *d_err,
                                       int *done);
extern "C" mm_err mm_gpu_attention_tcd(void *stream, const struct mm_attn_args *a, int *d_err,
                                       int *done) {
    *done = 0;
    const int mode = tcd_mode();
    if (mode == 0 || (mode == 2 && a != NULL && a->n_rows > TCD_AUTO_ROWS))
        return MM_OK;
#if TCD_HAVE
    if (a == NULL || a->n_rows <= 0 || a->n_rows > TC_DECODE_ROWS || a->n_heads <= 0 ||
        a->kv.n_kv_heads <= 0 || a->n_heads % a->kv.n_kv_heads != 0 || a->kv.head_dim_k <= 0 ||
        a->kv.head_dim_v <= 0 || a->kv.head_dim_k > 128 || a->kv.head_dim_v > 128 ||
        a->kv.head_dim_k % 4 != 0 || a->kv.head_dim_v % 4 != 0)
        return MM_OK;
    const int group = a->n_heads / a->kv.n_kv_heads;
    const int gsub = tc_group_sub(group, tcd_gsub());
    const bool small = a->kv.head_dim_k <= 64 && a->kv.head_dim_v <= 64;
    mm_err rv;
    if (a->kv.dtype == MM_DTYPE_BF16) { // attention_tc.cu checked the bf16 shape
        // the key blocks split over many blocks where it takes the call (attention_tcs.cuh,
        // MM_GPU_ATT_SPLITK; same bits)
        const mm_err srv = mm_gpu_attention_tcs(stream, a, gsub, d_err, done);
        if (srv != MM_OK || *done)
            return srv;
        const int nb = tcd_kb_bufs();
        if (nb == 6)
            rv = small ? tcd_launch<64, 64, 1, 6>(stream, a, gsub, d_err)
                       : tcd_launch<128, 128, 1, 6>(stream, a, gsub, d_err);
        else if (nb == 4)
            rv = small ? tcd_launch<64, 64, 1, 4>(stream, a, gsub, d_err)
                       : tcd_launch<128, 128, 1, 4>(stream, a, gsub, d_err);
        else
            rv = small ? tcd_launch<64, 64, 1, 3>(stream, a, gsub, d_err)
                       : tcd_launch<128, 128, 1, 3>(stream, a, gsub, d_err);
    } else {
        rv = tcd_stages() == 1 ? (small ? tcd_launch<64, 64, 1, 0>(stream, a, gsub, d_err)
                                        : tcd_launch<128, 128, 1, 0>(stream, a, gsub, d_err))
                               : (small ? tcd_launch<64, 64, 2, 0>(stream, a, gsub, d_err)
                                        : tcd_launch<128, 128, 2, 0>(stream, a, gsub, d_err));
    }
    if (rv == MM_OK)
        *done = 1;
    return rv;
#else
    (void)stream, (void)a, (void)d_err;
    return MM_OK;
#endif
}

// MM_GPU_ATT_PREP (read at first use): 0 leaves attention_prep to the two launches (A/B).
static int g_att_prep = -1;
// MM_GPU_ATT_PREP_SM (read at first use): 1 (default) the kernel's PSM form (tcd_block), 0 the
// form that reads its queries and the row's key back from global memory (A/B; same bits).
// H200, 2026-12-02 16:42 UTC, in turn twice: decode batch 1 2277.3, 2284.3 tok/s against
// 2214.8, 2201.8 (+3.3%).
static int g_att_prep_sm = -1;

// MM_GPU_ATT_SIGNAL (read at first use): where attention_tcd_prep_kernel's blocks let the next
// kernel (o_proj's product) launch, tcd_prep.signal: 2 (default) once the preparation is done
// and every copy of the cache is issued, so o_proj's weight copies, issued before its wait, do
// not queue ahead of this one-block-per-kv-head kernel's dependent loads; 0 at its start (the
// form before), 1 after its wait, 3 once its first key block has landed. Same bits. H200,
// 2026-12-02 18:43 UTC, in turn twice: decode batch 1 2333.6, 2336.8 tok/s (2) against 2296.4,
// 2283.8 (0), 2311.1, 2291.1 (1), 2331.2, 2324.6 (3).
static int g_att_signal = -1;

// mm_gpu_set_attention_prep_sm: 1 the PSM form of attention_tcd_prep_kernel, 0 the earlier
// one, < 0 back to MM_GPU_ATT_PREP_SM (read at the next call). Same bits. Process-wide.
extern "C" void mm_gpu_set_attention_prep_sm(int on);
extern "C" void mm_gpu_set_attention_prep_sm(int on) { g_att_prep_sm = on < 0 ? -1 : on != 0; }

// mm_gpu_attention_prep: attention_prep (kernels.h) on attention_tcd_prep_kernel where it takes
// the call (*done 1): a decode call (keys_early, not long_ctx, at most TCD_AUTO_ROWS rows) of
// 128-dim heads over a bf16 cache, one block per kv head (a group of at most 16 query heads),
// NeoX rotation of whole heads, bf16 or f32 norm weights, and p's layout the one
// head_norm_rope_kv takes in one launch (the keys x's group b, the same rows and cache); else
// nothing is issued and *done is 0.
extern "C" mm_err mm_gpu_attention_prep(void *stream, const struct mm_attn_prep *p,
                                        const struct mm_attn_args *a, int *d_err, int *done);
extern "C" mm_err mm_gpu_attention_prep(void *stream, const struct mm_attn_prep *p,
                                        const struct mm_attn_args *a, int *d_err, int *done) {
    *done = 0;
#if TCD_HAVE
    if (g_att_prep < 0)
        g_att_prep = !tc_env_is("MM_GPU_ATT_PREP", "0");
    if (!g_att_prep || p == NULL || a == NULL || !a->keys_early || a->long_ctx || a->n_rows <= 0 ||
        a->n_rows > TCD_AUTO_ROWS || tcd_mode() == 0 || tcd_kb_bufs() != 4)
        return MM_OK;
    const struct mm_kv_view &kv = a->kv;
    if (kv.dtype != MM_DTYPE_BF16 || kv.base == NULL || kv.block_tables == NULL ||
        kv.head_dim_k != TCD_PREP_HD || kv.head_dim_v != TCD_PREP_HD || kv.block_size <= 0 ||
        ((uintptr_t)kv.base & 15) != 0 || kv.block_stride % 8 != 0 || kv.slot_stride % 8 != 0 ||
        a->n_heads <= 0 || kv.n_kv_heads <= 0 || a->n_heads % kv.n_kv_heads != 0 ||
        a->q == NULL || a->out == NULL || a->row_seq == NULL || a->row_pos == NULL)
        return MM_OK;
    const int group = a->n_heads / kv.n_kv_heads;
    if (group > 16 || tc_group_sub(group, tcd_gsub()) != group)
        return MM_OK;
    const struct mm_rope_args &ra = p->rope;
    const struct mm_kv_store_args &st = p->st;
    auto w_ok = [](const mm_weight *w) {
        return w == NULL || (w->data != NULL && w->cols == TCD_PREP_HD &&
                             (w->dtype == MM_DTYPE_BF16 || w->dtype == MM_DTYPE_F32));
    };
    if (p->head_dim != TCD_PREP_HD || p->n_a != a->n_heads || p->n_b != kv.n_kv_heads ||
        p->x == NULL || p->x != a->q || p->stride != a->q_stride || !w_ok(p->wa) || !w_ok(p->wb) ||
        ra.style != MM_ROPE_NEOX || ra.rot_offset != 0 || ra.rot_dim != TCD_PREP_HD ||
        ra.pos != a->row_pos || ra.inv_freq == NULL || st.k != p->x + p->b_off ||
        st.k_stride != p->stride || st.v == NULL || st.kv.base != kv.base ||
        st.kv.block_tables != kv.block_tables || st.row_pos != a->row_pos ||
        st.row_seq != a->row_seq || st.n_rows != a->n_rows)
        return MM_OK;
    if (g_att_signal < 0) {
        const char *e = getenv("MM_GPU_ATT_SIGNAL");
        g_att_signal = e != NULL && e[0] >= '0' && e[0] <= '3' && e[1] == 0 ? e[0] - '0' : 2;
    }
    const tcd_prep dp = {p->x,
                         p->stride,
                         p->b_off,
                         p->wa ? p->wa->data : NULL,
                         p->wb ? p->wb->data : NULL,
                         p->wa ? p->wa->dtype == MM_DTYPE_F32 : 0,
                         p->wb ? p->wb->dtype == MM_DTYPE_F32 : 0,
                         p->eps,
                         ra.inv_freq,
                         ra.mscale,
                         st.v,
                         st.v_stride,
                         g_att_signal};
    if (g_att_prep_sm < 0)
        g_att_prep_sm = !tc_env_is("MM_GPU_ATT_PREP_SM", "0");
    static uint64_t attr_set[2];
    const size_t shmem = tcd_shmem(TCD_PREP_HD, TCD_PREP_HD, 1, 4); // the 4 key buffers
    const dim3 grid((unsigned)a->n_rows, (unsigned)kv.n_kv_heads);
    if (g_att_prep_sm) { // the queries after the buffers
        const size_t sm2 = shmem + (size_t)16 * TCD_PREP_HD * 4;
        MM_TRY(tc_allow_shmem(attention_tcd_prep_kernel<4, true>, &attr_set[1], sm2));
        MM_GPU_CHECK(mm_launch_dep(attention_tcd_prep_kernel<4, true>, grid, dim3(TCD_THREADS),
                                   sm2, (cudaStream_t)stream, *a, dp, group, d_err));
    } else {
        MM_TRY(tc_allow_shmem(attention_tcd_prep_kernel<4, false>, &attr_set[0], shmem));
        MM_GPU_CHECK(mm_launch_dep(attention_tcd_prep_kernel<4, false>, grid, dim3(TCD_THREADS),
                                   shmem, (cudaStream_t)stream, *a, dp, group, d_err));
    }
    MM_GPU_CHECK(cudaGetLastError());
    *done = 1;
#else
    (void)stream, (void)p, (void)a, (void)d_err;
#endif
    return MM_OK;
}
