// SPDX-License-Identifier: MIT
// Attention on the tensor cores: one contract for decode and prefill (the default on CUDA;
// MM_GPU_ATT_TC=0 or mm_gpu_set_attention_tc(0) turns it off, then ops.cu's f32 kernels run).
//
// The contract, for every (row, head) of kernels.h's attention:
// - q, k and v are rounded to bf16 (round to nearest even); scores x = q . k by mma.sync
//   m16n8k16 with f32 accumulation, dims in 16-wide steps in ascending order.
// - Keys in blocks of TC_KEYS = 64 aligned to absolute position 0 (keys 0..63, 64..127, ...),
//   walked in ascending order from the block holding the first visible key to the block
//   holding the row's own position. Per block, in f32 with c = scale * log2 e: x = -inf for
//   keys outside [first, pos]; m' = max(m, c * max x) (the max in log2 units); alpha = m' == m ?
//   1 : 2^(m - m'); p = 2^(fma(x, c, -m')) (ex2.approx.ftz); l = l * alpha + (the row's p summed
//   per thread in a fixed order); out = out * alpha, then out += P V with P rounded to bf16, 16
//   keys per mma step in ascending order. At the end the four threads' l are summed by a fixed
//   butterfly; out = out * (1 / l).
// - An mma output element (i, j) depends only on row i of A, column j of B and element (i, j)
//   of C, so a row's result depends only on its own query, its keys and the fixed partition:
//   the same bits whether the row is decoded alone, in a batch of other sequences, or is one
//   of many prefill rows (any chunking, any neighbours in the tile). A block that is wholly
//   masked for a row leaves its state unchanged (alpha = 1 exactly, p = 0, and P V adds exact
//   zeros: keys outside a tile's [t_lo, t_hi] are staged as zeros, and the keys in that range
//   are stored values), so a row that rides in a tile with later rows gets the bits it gets
//   alone.
// Prefill calls (more than TC_DECODE_ROWS rows) take attention_tc2_kernel by default: the same
// block structure with two m16 tiles per warp (256 units per block of 8 warps, q as bf16 in shared
// memory), below; MM_GPU_ATT_TC_MT=1 gives them the one-tile kernel described next.
// Layout: a block of NW warps (8, or 4 with MM_GPU_ATT_TC_WARPS=4: two blocks per
// multiprocessor with one key buffer) takes up to 16 NW (row, head) units of one kv head: rows_pb
// rows x gsub query heads of that kv head (the GQA group, or a slice of it), unit u = row * gsub +
// head; warp w computes units 16w..16w+15 (the mma M dimension). Prefill calls (more than
// TC_DECODE_ROWS rows) take 16 NW / gsub rows per block; decode calls one row per block (only the
// first ceil(gsub / 16) warps compute; all stage keys). Each block's 64 keys (K and V, f32 in the
// cache) come into shared memory by cp.async while the previous block is computed (the cache
// table read one block earlier still), each thread converting the float4s it copied to bf16
// ([key][dim] rows padded by 8 so ldmatrix reads are conflict-free) into the other of two
// buffers while this block is computed from the first, one barrier per block
// (MM_GPU_ATT_TC_DB=0: one buffer, two barriers per block); K fragments by ldmatrix,
// V by ldmatrix.trans; P stays in registers (the score accumulators are the next mma's A
// fragments). Rows of several sequences in one block are done one sequence at a time
// (passes), like ops.cu's prefill kernel.
// A bf16 cache (struct mm_kv_view.dtype; mm_gpu_kv_dtype below makes one by default where every
// read goes through these kernels: MM_GPU_KV_BF16=0 keeps f32): ops.cu's kv_store and
// head_norm_rope_kv round K and V with the instruction tc_pack rounds an f32 cache's K and V
// with, so the kernels see the same bf16 operands and give the same bits. Their KB forms
// (tc_kb_pass, attention_tcd_kernel's NB) have no f32 stage and no conversion: each thread's
// cp.async copies go straight into the ldmatrix layout ([key][dim] rows padded by 8), into one of
// TC_KB_BUFS (3) buffers, two key blocks in flight, one barrier per block (H200, 2026-11-30 09:20
// and 09:31 UTC: 1015 vs 1119 us per 4096-row prefill call by the per-op timer, the 4K forward
// 11.20 vs 11.60 ms; decode after a 4K prompt 844-850 vs 679 tok/s; docs/BENCHMARKS.md). (The
// f32 branches below keep their earlier indentation inside the KB test: same code as before.)
// Shapes: head dims up to 128, multiples of 4, a 16-byte-aligned cache; other shapes (and HIP
// builds) keep ops.cu's kernels for decode and prefill alike, so the contract never depends on
// the number of rows. (A 192/128 form ran on the H200 at 01:48 UTC with wrong results, cause
// not found; removed.)
// Measured (H200, 02:01 UTC, docs/BENCHMARKS.md): 1199.7 us per 4096-row call of Qwen3-30B-A3B's
// heads (f32 kernels 6750.3; one buffer 1478.0; 4 warps 1979.8 at 01:53), decode batch 1 within
// a few percent of the f32 kernels (+4% in that run). Two tiles per warp (04:04 and 04:16 UTC,
// ncu): 1.08 ms vs 1.19 for the one-tile kernel, the 4K forward 14.5 vs 15.2 ms (ncu on the latter: 1 warp issued every 3.6 cycles per
// scheduler, 2 warps per scheduler, tensor pipe 6%: latency and instruction bound, ~1170
// instructions per warp per 64-key block, ~30% of them the staging).
// Files: the device helpers (bf16 packing, ex2, mma and ldmatrix wrappers, the cache-table lookup,
// the K/V staging by cp.async and its conversion to bf16) are in attention_tc.cuh, shared with
// attention_tcd.cu (decode calls with every warp computing); the kernels, tc_block, tc_block2 and
// the launchers and switches are here.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tc.cuh"
#include "gpu_common.cuh"
#include "kernels.h"
#include "mm_gpu.h"

static int g_att_tc = -1;       // -1: from MM_GPU_ATT_TC at first use; 0 off; 1 on
static int g_att_tc_warps = -1; // -1: from MM_GPU_ATT_TC_WARPS (4 or 8; default 8)
static int g_att_tc_db = -1;    // -1: from MM_GPU_ATT_TC_DB (0: one key buffer; default 1)
static int g_att_tc_mt = -1;    // -1: from MM_GPU_ATT_TC_MT (1: one m16 tile per warp; default 2)
static int g_kv_bf16 = -1;      // -1: from MM_GPU_KV_BF16 at the next cache made; 0 f32; 1 bf16

#if MM_GPU_HAVE_WMMA
#define TC_HAVE 1

// The key blocks of one pass from a bf16 cache (both prefill kernels' and the one-tile kernel's
// KB form): blocks c_lo, c_lo + 64, .. up to t_hi, block j copied by tc_issue_bf16 into buffer
// j % TC_KB_BUFS two blocks ahead, so one block's copies fly while two blocks are computed.
// Per block: this thread waits for its own copies of block j (cp.async.wait_group 1: block
// j + 1's group is the only newer one; every issue commits one group, empty past t_hi), one
// barrier (block j visible to all; every warp done with block j - 1's buffer), block j + 2's
// copies into that buffer, then compute(c0, buffer) (the caller's tc_block / tc_block2). The
// caller's barriers before the pass (the pass loop's) order the last pass's reads of the
// buffers before this pass's first copies. skey, part: this thread's key and piece of it.
template <int TPK, typename F>
__device__ __forceinline__ void tc_kb_pass(const struct mm_kv_view &kv, int32_t sq, int32_t c_lo,
                                           int32_t t_lo, int32_t t_hi, int64_t k_off,
                                           int64_t v_off, uint16_t *kb, int kvsz, int ldk,
                                           int ldv, int skey, int part, int *d_err, F compute) {
    auto issue = [&](int32_t blk, int32_t r, int b) {
        uint16_t *k = kb + b * kvsz + skey * ldk;
        tc_issue_bf16<TPK>(kv, blk, r, k_off, v_off, k, kb + b * kvsz + TC_KEYS * ldk + skey * ldv,
                           part, d_err);
    };
    int32_t r;
    int32_t blk = tc_blk_kb(kv, sq, c_lo + skey, t_lo, t_hi, r, d_err);
    issue(blk, r, 0);
    blk = tc_blk_kb(kv, sq, c_lo + TC_KEYS + skey, t_lo, t_hi, r, d_err);
    issue(blk, r, 1);
    blk = tc_blk_kb(kv, sq, c_lo + 2 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
    int bi = 0;
    for (int32_t c0 = c_lo; c0 <= t_hi; c0 += TC_KEYS) {
        tc_wait<1>();    // this thread's copies of block c0 landed
        __syncthreads(); // everyone's; every read of the buffer of block c0 - 64 done
        if (c0 + 2 * TC_KEYS <= t_hi) {
            issue(blk, r, bi == 0 ? TC_KB_BUFS - 1 : bi - 1);
            blk = tc_blk_kb(kv, sq, c0 + 3 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
        } else {
            tc_commit(); // an empty group: block c0 + 64's stays the newest but one
        }
        compute(c0, kb + bi * kvsz);
        bi = bi == TC_KB_BUFS - 1 ? 0 : bi + 1;
    }
}

// One 64-key block for the warp's 16 units (rows g and g + 8 of this thread): scores from kb,
// mask, online softmax update of m, l and acc, P V from vb.
template <int DKM, int DVM>
__device__ __forceinline__ void
tc_block(const uint32_t (&qf)[DKM / 16][4], const uint16_t *kb, const uint16_t *vb, int ldk,
         int ldv, int dkp, int dvp, int32_t c0, const int32_t (&first)[2], const int32_t (&pos)[2],
         float cs, float (&m)[2], float (&l)[2], float (&acc)[DVM / 8][4]) {
    const int lane = threadIdx.x & 31, tq = lane & 3;
    // scores: s[j] = keys c0 + 8 j + 2 tq (+1) of rows g (s[j][0..1]) and g + 8 ([2..3])
    float s[TC_KEYS / 8][4];
    tc_scores<DKM>(qf, kb, ldk, dkp, s);
    // mask (keys outside [first, pos]: -inf; blocks wholly inside skip the tests), row
    // max of the raw scores over the row's 4 threads (a fixed butterfly)
    float mx[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        mx[i] = tc_mask_max(s, i, c0, first[i], pos[i], tq);
    // the online softmax step: m, alpha, P (the A fragments of P V), l
    uint32_t pa[TC_KEYS / 16][4];
    float al[2];
    tc_softmax(s, mx, cs, m, l, pa, al);
#pragma unroll
    for (int n = 0; n < DVM / 8; n++) {
        acc[n][0] = __fmul_rn(acc[n][0], al[0]);
        acc[n][1] = __fmul_rn(acc[n][1], al[0]);
        acc[n][2] = __fmul_rn(acc[n][2], al[1]);
        acc[n][3] = __fmul_rn(acc[n][3], al[1]);
    }
    {
        // ldmatrix.trans row: matrix mt is keys 8 (mt % 2) + lane % 8 of the 16-key
        // step, dims 8 (mt / 2) of the 16-dim pair
        const int mt = lane >> 3;
        const uint16_t *vp = vb + ((mt & 1) * 8 + (lane & 7)) * ldv + (mt >> 1) * 8;
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++)
#pragma unroll
            for (int dp = 0; dp < DVM / 16; dp++) {
                if (16 * dp < dvp) {
                    uint32_t b[4];
                    tc_ldsm4t(b, vp + kk * 16 * ldv + 16 * dp);
                    tc_mma(acc[2 * dp], pa[kk], b[0], b[1]);
                    tc_mma(acc[2 * dp + 1], pa[kk], b[2], b[3]);
                }
            }
    }
}

// KB: the cache is bf16 (TC_KB_BUFS key buffers filled by tc_issue_bf16, DB unused), else f32.
template <int DKM, int DVM, int NW, bool DB, bool KB>
__global__ void __launch_bounds__(NW * 32, 8 / NW)
    attention_tc_kernel(struct mm_attn_args a, int gsub, int rows_pb, int *d_err) {
    constexpr int NT = NW * 32, UNITS = NW * 16, TPK = NT / TC_KEYS;
    static_assert(NT % TC_KEYS == 0, "threads per key");
    mm_dep_signal();
    mm_dep_wait();
    extern __shared__ __align__(16) unsigned char tc_sh[];
    __shared__ int32_t r_seq[UNITS], r_pos[UNITS], r_first[UNITS];
    __shared__ int r_state[UNITS]; // 0 done or invalid, 1 to do, 2 in this pass
    __shared__ int32_t seg[4];     // seq, c_lo, t_lo, t_hi
    const struct mm_kv_view &kv = a.kv;
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15;
    const int ldk = dkp + 8, ldv = dvp + 8, sw = dk + dv + 4;
    float *stage = (float *)tc_sh;                                // [TC_KEYS][sw] f32 (f32 cache)
    uint16_t *kb = (uint16_t *)(stage + (KB ? 0 : TC_KEYS * sw)); // [TC_KEYS][ldk] bf16
    uint16_t *vb = kb + TC_KEYS * ldk;                            // [TC_KEYS][ldv] bf16
    const int kvsz = TC_KEYS * (ldk + ldv); // one key buffer (K then V)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int skey = tid / TPK, part = tid % TPK; // the key this thread stages and converts
    if constexpr (KB)
        tc_zero_pads(kb, TC_KB_BUFS, kvsz, dk, dv, ldk, ldv);
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gsub;
    const int kvh = blockIdx.y / per_kv, h0 = kvh * group + (blockIdx.y % per_kv) * gsub;
    // heavy (late) row tiles first: the causal prefix grows with the row
    const int64_t r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * rows_pb;
    const int n_units = rows_pb * gsub;
    const int64_t k_off = (int64_t)kvh * dk,
                  v_off = (int64_t)kv.n_kv_heads * dk + (int64_t)kvh * dv;
    if (tid < rows_pb) {
        const int64_t r = r0 + tid;
        int st = 0;
        int32_t sq = -1, ps = -1, fi = 0;
        if (r < a.n_rows) {
            sq = a.row_seq[r], ps = a.row_pos[r];
            if (ps < 0 || sq < 0 || ps / kv.block_size >= kv.max_blocks) {
                tc_flag(d_err);
            } else {
                st = 1;
                if (a.window > 0 && ps - a.window + 1 > 0)
                    fi = ps - a.window + 1;
            }
        }
        r_seq[tid] = sq, r_pos[tid] = ps, r_first[tid] = fi, r_state[tid] = st;
    }
    // this thread's units: rows g and g + 8 of the warp's m16 tile
    int ur[2], uh[2];
    bool uin[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int u = warp * 16 + g + 8 * i;
        uin[i] = u < n_units && r0 + u / gsub < a.n_rows;
        ur[i] = u < n_units ? u / gsub : 0;
        uh[i] = u < n_units ? u % gsub : 0;
    }
    // q as A fragments: qf[ks][i + 2 half] = row i's dims 16 ks + 8 half + 2 tq, +1
    const float *q_row[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        q_row[i] = uin[i] ? a.q + (r0 + ur[i]) * a.q_stride + (int64_t)(h0 + uh[i]) * dk : NULL;
    uint32_t qf[DKM / 16][4];
    tc_q_frag<DKM>(q_row, dk, tq, qf);
    const float cs = a.scale * 1.4426950408889634f;
    const bool wcomp = warp * 16 < n_units; // this warp has units to compute
    for (;;) {
        __syncthreads();
        if (tid == 0)
            tc_next_pass(rows_pb, r_state, r_seq, r_first, r_pos, seg);
        __syncthreads();
        const int32_t sq = seg[0], c_lo = seg[1], t_lo = seg[2], t_hi = seg[3];
        if (sq < 0)
            break;
        bool on[2];
        int32_t pos[2], first[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            on[i] = uin[i] && r_state[ur[i]] == 2;
            pos[i] = on[i] ? r_pos[ur[i]] : -1;
            first[i] = on[i] ? r_first[ur[i]] : 0x7fffffff;
        }
        // the warp's key range: blocks outside it are masked for all its units (skipped)
        int32_t wmax = max(pos[0], pos[1]), wmin = min(first[0], first[1]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
            wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
        }
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float acc[DVM / 8][4];
#pragma unroll
        for (int n = 0; n < DVM / 8; n++)
            acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        if constexpr (KB) {
            // bf16 cache: block j's keys copied straight into buffer j % 3 two blocks ahead
            // (issued while block j - 2 is computed), one barrier per block
            tc_kb_pass<TPK>(kv, sq, c_lo, t_lo, t_hi, k_off, v_off, kb, kvsz, ldk, ldv, skey, part,
                            d_err, [&](int32_t c0, const uint16_t *kc) {
                                if (wcomp && c0 <= wmax && c0 + TC_KEYS - 1 >= wmin)
                                    tc_block<DKM, DVM>(qf, kc, kc + TC_KEYS * ldk, ldk, ldv, dkp,
                                                       dvp, c0, first, pos, cs, m, l, acc);
                            });
        } else {
        float *srow = stage + skey * sw;
        int32_t blk = tc_blk(kv, sq, c_lo + skey, t_lo, t_hi, d_err);
        bool ok = blk >= 0;
        tc_issue<TPK>(kv, c_lo + skey, blk, k_off, v_off, srow, part);
        blk = tc_blk(kv, sq, c_lo + TC_KEYS + skey, t_lo, t_hi, d_err); // the next block's
        if constexpr (!DB) {
            for (int32_t c0 = c_lo; c0 <= t_hi; c0 += TC_KEYS) {
                __syncthreads(); // every read of kb/vb of the last block done
                tc_wait<0>();    // this thread's copies of this block landed
                tc_convert<DKM, DVM, TPK>(srow, ok, dk, dv, dkp, dvp, kb + skey * ldk,
                                          vb + skey * ldv, part);
                __syncthreads(); // kb/vb ready; every stage read done
                if (c0 + TC_KEYS <= t_hi) {
                    ok = blk >= 0;
                    tc_issue<TPK>(kv, c0 + TC_KEYS + skey, blk, k_off, v_off, srow, part);
                    blk = tc_blk(kv, sq, c0 + 2 * TC_KEYS + skey, t_lo, t_hi, d_err);
                }
                if (wcomp && c0 <= wmax && c0 + TC_KEYS - 1 >= wmin)
                    tc_block<DKM, DVM>(qf, kb, vb, ldk, ldv, dkp, dvp, c0, first, pos, cs, m, l,
                                       acc);
            }
        } else {
            // two bf16 buffers: block c0 + 64 is converted (and c0 + 128's copies issued) while
            // c0 is computed from the other buffer; one barrier per block
            __syncthreads(); // the last pass's reads of both buffers done
            tc_wait<0>();
            tc_convert<DKM, DVM, TPK>(srow, ok, dk, dv, dkp, dvp, kb + skey * ldk, vb + skey * ldv,
                                      part);
            if (c_lo + TC_KEYS <= t_hi) {
                ok = blk >= 0;
                tc_issue<TPK>(kv, c_lo + TC_KEYS + skey, blk, k_off, v_off, srow, part);
                blk = tc_blk(kv, sq, c_lo + 2 * TC_KEYS + skey, t_lo, t_hi, d_err);
            }
            __syncthreads(); // buffer 0 ready
            int bi = 0;
            for (int32_t c0 = c_lo; c0 <= t_hi; c0 += TC_KEYS) {
                if (c0 + TC_KEYS <= t_hi) {
                    uint16_t *kn = kb + (bi ^ 1) * kvsz;
                    tc_wait<0>(); // this thread's copies of the next block landed
                    tc_convert<DKM, DVM, TPK>(srow, ok, dk, dv, dkp, dvp, kn + skey * ldk,
                                              kn + TC_KEYS * ldk + skey * ldv, part);
                    if (c0 + 2 * TC_KEYS <= t_hi) {
                        ok = blk >= 0;
                        tc_issue<TPK>(kv, c0 + 2 * TC_KEYS + skey, blk, k_off, v_off, srow, part);
                        blk = tc_blk(kv, sq, c0 + 3 * TC_KEYS + skey, t_lo, t_hi, d_err);
                    }
                }
                if (wcomp && c0 <= wmax && c0 + TC_KEYS - 1 >= wmin) {
                    const uint16_t *kc = kb + bi * kvsz;
                    tc_block<DKM, DVM>(qf, kc, kc + TC_KEYS * ldk, ldk, ldv, dkp, dvp, c0, first,
                                       pos, cs, m, l, acc);
                }
                __syncthreads(); // the next buffer ready; this one's reads done
                bi ^= 1;
            }
        }
        } // f32 cache
        // l over the row's 4 threads (a butterfly: the same sum in all four), then the outputs
#pragma unroll
        for (int i = 0; i < 2; i++) {
            l[i] = tc_quad_sum(l[i]);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!on[i])
                continue;
            const float inv = 1.0f / l[i];
            float *o = a.out + (r0 + ur[i]) * a.out_stride + (int64_t)(h0 + uh[i]) * dv;
#pragma unroll
            for (int n = 0; n < DVM / 8; n++) {
                const int d = 8 * n + 2 * tq;
                tc_store2(o, d, dv, acc[n][2 * i], acc[n][2 * i + 1], inv);
            }
        }
        __syncthreads(); // every r_state read of this pass done
        if (tid < rows_pb && r_state[tid] == 2)
            r_state[tid] = 0;
    }
}

// ---- two m16 tiles per warp (MM_GPU_ATT_TC_MT=2, prefill calls only) --------------------------
template <int DKM, int DVM>
__device__ __forceinline__ void
tc_block2(const uint16_t *qs, int ldq, const uint16_t *kb, const uint16_t *vb, int ldk, int ldv,
          int dkp, int dvp, int32_t c0, const int32_t (&first)[4], const int32_t (&pos)[4], float cs,
          float (&m)[4], float (&l)[4], float (&acc)[2][DVM / 8][4]) {
    const int lane = threadIdx.x & 31, tq = lane & 3;
    float s[2][TC_KEYS / 8][4];
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int j = 0; j < TC_KEYS / 8; j++)
            s[t][j][0] = s[t][j][1] = s[t][j][2] = s[t][j][3] = 0.0f;
    {
        const int mt = lane >> 3;
        const uint16_t *kp = kb + ((mt >> 1) * 8 + (lane & 7)) * ldk + (mt & 1) * 8;
        // A fragments of tile t: matrix mt rows 8 (mt & 1) + lane % 8, dims 8 (mt >> 1)
        const uint16_t *qp = qs + ((mt & 1) * 8 + (lane & 7)) * ldq + (mt >> 1) * 8;
#pragma unroll
        for (int ks = 0; ks < DKM / 16; ks++) {
            if (16 * ks < dkp) {
                uint32_t qa[2][4];
                tc_ldsm4(qa[0], qp + 16 * ks);
                tc_ldsm4(qa[1], qp + 16 * ldq + 16 * ks);
#pragma unroll
                for (int np = 0; np < TC_KEYS / 16; np++) {
                    uint32_t b[4];
                    tc_ldsm4(b, kp + np * 16 * ldk + 16 * ks);
#pragma unroll
                    for (int t = 0; t < 2; t++) {
                        tc_mma(s[t][2 * np], qa[t], b[0], b[1]);
                        tc_mma(s[t][2 * np + 1], qa[t], b[2], b[3]);
                    }
                }
            }
        }
    }
    // rows: k = 2 t + i is tile t's row g + 8 i (s[t][j][2 i + e])
    float mx[4];
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int i = 0; i < 2; i++)
            mx[2 * t + i] = tc_mask_max(s[t], i, c0, first[2 * t + i], pos[2 * t + i], tq);
    float al[4], ms[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        tc_max_step(mx[k], cs, m[k], al[k], ms[k]);
    }
    uint32_t pa[2][TC_KEYS / 16][4];
#pragma unroll
    for (int t = 0; t < 2; t++) {
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < TC_KEYS / 8; j++) {
            const float p0 = tc_ex2(__fmaf_rn(s[t][j][0], cs, ms[2 * t]));
            const float p1 = tc_ex2(__fmaf_rn(s[t][j][1], cs, ms[2 * t]));
            const float p2 = tc_ex2(__fmaf_rn(s[t][j][2], cs, ms[2 * t + 1]));
            const float p3 = tc_ex2(__fmaf_rn(s[t][j][3], cs, ms[2 * t + 1]));
            ps[0] = __fadd_rn(__fadd_rn(ps[0], p0), p1);
            ps[1] = __fadd_rn(__fadd_rn(ps[1], p2), p3);
            pa[t][j >> 1][(j & 1) * 2 + 0] = tc_pack(p0, p1);
            pa[t][j >> 1][(j & 1) * 2 + 1] = tc_pack(p2, p3);
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
            l[2 * t + i] = __fmaf_rn(l[2 * t + i], al[2 * t + i], ps[i]);
#pragma unroll
        for (int n = 0; n < DVM / 8; n++) {
            acc[t][n][0] = __fmul_rn(acc[t][n][0], al[2 * t]);
            acc[t][n][1] = __fmul_rn(acc[t][n][1], al[2 * t]);
            acc[t][n][2] = __fmul_rn(acc[t][n][2], al[2 * t + 1]);
            acc[t][n][3] = __fmul_rn(acc[t][n][3], al[2 * t + 1]);
        }
    }
    {
        const int mt = lane >> 3;
        const uint16_t *vp = vb + ((mt & 1) * 8 + (lane & 7)) * ldv + (mt >> 1) * 8;
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++)
#pragma unroll
            for (int dp = 0; dp < DVM / 16; dp++) {
                if (16 * dp < dvp) {
                    uint32_t b[4];
                    tc_ldsm4t(b, vp + kk * 16 * ldv + 16 * dp);
#pragma unroll
                    for (int t = 0; t < 2; t++) {
                        tc_mma(acc[t][2 * dp], pa[t][kk], b[0], b[1]);
                        tc_mma(acc[t][2 * dp + 1], pa[t][kk], b[2], b[3]);
                    }
                }
            }
    }
}

// The prefill kernel with two m16 tiles per warp: attention_tc_kernel<DKM, DVM, 8, true>'s block
// structure (passes per sequence, the staging and conversion of each 64-key block into one of
// two bf16 buffers, one barrier per block) with 256 units per block; warp w takes units
// 32 w..32 w + 31 (tile t: 32 w + 16 t ..). Only for calls of more than TC_DECODE_ROWS rows.
// KB: the cache is bf16 (tc_kb_pass: TC_KB_BUFS key buffers, no f32 stage), else f32.
#define TC2_WARPS 8
template <int DKM, int DVM, bool KB>
__global__ void __launch_bounds__(TC2_WARPS * 32, 1)
    attention_tc2_kernel(struct mm_attn_args a, int gsub, int rows_pb, int *d_err) {
    constexpr int NT = TC2_WARPS * 32, UNITS = TC2_WARPS * 32, TPK = NT / TC_KEYS;
    static_assert(NT % TC_KEYS == 0, "threads per key");
    mm_dep_signal();
    mm_dep_wait();
    extern __shared__ __align__(16) unsigned char tc_sh[];
    __shared__ int32_t r_seq[UNITS], r_pos[UNITS], r_first[UNITS];
    __shared__ int r_state[UNITS];
    __shared__ int32_t seg[4];
    const struct mm_kv_view &kv = a.kv;
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15;
    const int ldk = dkp + 8, ldv = dvp + 8, sw = dk + dv + 4, ldq = ldk;
    float *stage = (float *)tc_sh; // [TC_KEYS][sw] f32 (f32 cache only)
    // 2 (f32 cache) or TC_KB_BUFS (bf16) x ([TC_KEYS][ldk] + [TC_KEYS][ldv]) bf16
    uint16_t *kb = (uint16_t *)(stage + (KB ? 0 : TC_KEYS * sw));
    const int kvsz = TC_KEYS * (ldk + ldv);
    uint16_t *qs = kb + (KB ? TC_KB_BUFS : 2) * kvsz; // [UNITS][ldq] bf16
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int skey = tid / TPK, part = tid % TPK;
    if constexpr (KB)
        tc_zero_pads(kb, TC_KB_BUFS, kvsz, dk, dv, ldk, ldv);
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gsub;
    const int kvh = blockIdx.y / per_kv, h0 = kvh * group + (blockIdx.y % per_kv) * gsub;
    const int64_t r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * rows_pb;
    const int n_units = rows_pb * gsub;
    const int64_t k_off = (int64_t)kvh * dk,
                  v_off = (int64_t)kv.n_kv_heads * dk + (int64_t)kvh * dv;
    if (tid < rows_pb) {
        const int64_t r = r0 + tid;
        int st = 0;
        int32_t sq = -1, ps = -1, fi = 0;
        if (r < a.n_rows) {
            sq = a.row_seq[r], ps = a.row_pos[r];
            if (ps < 0 || sq < 0 || ps / kv.block_size >= kv.max_blocks) {
                tc_flag(d_err);
            } else {
                st = 1;
                if (a.window > 0 && ps - a.window + 1 > 0)
                    fi = ps - a.window + 1;
            }
        }
        r_seq[tid] = sq, r_pos[tid] = ps, r_first[tid] = fi, r_state[tid] = st;
    }
    // q as bf16 rows (tc_pack of the pairs tc_block's qf holds; zeros past dk and for units
    // without a row), visible after the pass loop's first barrier
    for (int i = tid; i < UNITS * (dkp / 2); i += NT) {
        const int u = i / (dkp / 2), d = 2 * (i % (dkp / 2));
        float x0 = 0.0f, x1 = 0.0f;
        if (u < n_units && r0 + u / gsub < a.n_rows) {
            const float *qp = a.q + (r0 + u / gsub) * a.q_stride + (int64_t)(h0 + u % gsub) * dk;
            if (d < dk)
                x0 = qp[d];
            if (d + 1 < dk)
                x1 = qp[d + 1];
        }
        *(uint32_t *)(qs + u * ldq + d) = tc_pack(x0, x1);
    }
    // this thread's units: k = 2 t + i is row g + 8 i of tile t (unit 32 warp + 16 t + g + 8 i);
    // recomputed where needed (at a pass's start and end) rather than held in registers
    auto unit = [&](int k) { return warp * 32 + 16 * (k >> 1) + g + 8 * (k & 1); };
    auto uin = [&](int k) { return unit(k) < n_units && r0 + unit(k) / gsub < a.n_rows; };
    const uint16_t *qw = qs + warp * 32 * ldq;
    const float cs = a.scale * 1.4426950408889634f;
    const bool wcomp = warp * 32 < n_units;
    for (;;) {
        __syncthreads();
        if (tid == 0)
            tc_next_pass(rows_pb, r_state, r_seq, r_first, r_pos, seg);
        __syncthreads();
        const int32_t sq = seg[0], c_lo = seg[1], t_lo = seg[2], t_hi = seg[3];
        if (sq < 0)
            break;
        bool on[4];
        int32_t pos[4], first[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int ur = uin(k) ? unit(k) / gsub : 0;
            on[k] = uin(k) && r_state[ur] == 2;
            pos[k] = on[k] ? r_pos[ur] : -1;
            first[k] = on[k] ? r_first[ur] : 0x7fffffff;
        }
        int32_t wmax = max(max(pos[0], pos[1]), max(pos[2], pos[3]));
        int32_t wmin = min(min(first[0], first[1]), min(first[2], first[3]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
            wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
        }
        float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float acc[2][DVM / 8][4];
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int n = 0; n < DVM / 8; n++)
                acc[t][n][0] = acc[t][n][1] = acc[t][n][2] = acc[t][n][3] = 0.0f;
        if constexpr (KB) {
            tc_kb_pass<TPK>(kv, sq, c_lo, t_lo, t_hi, k_off, v_off, kb, kvsz, ldk, ldv, skey, part,
                            d_err, [&](int32_t c0, const uint16_t *kc) {
                                if (wcomp && c0 <= wmax && c0 + TC_KEYS - 1 >= wmin)
                                    tc_block2<DKM, DVM>(qw, ldq, kc, kc + TC_KEYS * ldk, ldk, ldv,
                                                        dkp, dvp, c0, first, pos, cs, m, l, acc);
                            });
        } else {
        float *srow = stage + skey * sw;
        auto blk_of = [&](int32_t t) -> int32_t { return tc_blk(kv, sq, t, t_lo, t_hi, d_err); };
        auto issue = [&](int32_t t, int32_t b) {
            tc_issue<TPK>(kv, t, b, k_off, v_off, srow, part);
        };
        int32_t blk = blk_of(c_lo + skey);
        bool ok = blk >= 0;
        issue(c_lo + skey, blk);
        blk = blk_of(c_lo + TC_KEYS + skey);
        __syncthreads(); // the last pass's reads of both buffers done
        tc_wait<0>();
        tc_convert<DKM, DVM, TPK>(srow, ok, dk, dv, dkp, dvp, kb + skey * ldk,
                                  kb + TC_KEYS * ldk + skey * ldv, part);
        if (c_lo + TC_KEYS <= t_hi) {
            ok = blk >= 0;
            issue(c_lo + TC_KEYS + skey, blk);
            blk = blk_of(c_lo + 2 * TC_KEYS + skey);
        }
        __syncthreads(); // buffer 0 ready
        int bi = 0;
        for (int32_t c0 = c_lo; c0 <= t_hi; c0 += TC_KEYS) {
            if (c0 + TC_KEYS <= t_hi) {
                uint16_t *kn = kb + (bi ^ 1) * kvsz;
                tc_wait<0>();
                tc_convert<DKM, DVM, TPK>(srow, ok, dk, dv, dkp, dvp, kn + skey * ldk,
                                          kn + TC_KEYS * ldk + skey * ldv, part);
                if (c0 + 2 * TC_KEYS <= t_hi) {
                    ok = blk >= 0;
                    issue(c0 + 2 * TC_KEYS + skey, blk);
                    blk = blk_of(c0 + 3 * TC_KEYS + skey);
                }
            }
            if (wcomp && c0 <= wmax && c0 + TC_KEYS - 1 >= wmin) {
                const uint16_t *kc = kb + bi * kvsz;
                tc_block2<DKM, DVM>(qw, ldq, kc, kc + TC_KEYS * ldk, ldk, ldv, dkp, dvp, c0, first,
                                    pos, cs, m, l, acc);
            }
            __syncthreads();
            bi ^= 1;
        }
        } // f32 cache
#pragma unroll
        for (int k = 0; k < 4; k++) {
            l[k] = tc_quad_sum(l[k]);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (!on[k])
                continue;
            const float inv = 1.0f / l[k];
            const int u = unit(k);
            float *o = a.out + (r0 + u / gsub) * a.out_stride + (int64_t)(h0 + u % gsub) * dv;
            const int t = k >> 1, i = k & 1;
#pragma unroll
            for (int n = 0; n < DVM / 8; n++) {
                const int d = 8 * n + 2 * tq;
                tc_store2(o, d, dv, acc[t][n][2 * i], acc[t][n][2 * i + 1], inv);
            }
        }
        __syncthreads();
        if (tid < rows_pb && r_state[tid] == 2)
            r_state[tid] = 0;
    }
}

// attention_tc2_kernel's: one stage and two buffers (f32 cache) or TC_KB_BUFS buffers (bf16),
// then q ([TC2_WARPS * 32][dkp + 8] bf16)
static size_t tc2_shmem(int dk, int dv, bool kb) {
    return (kb ? tc_stage_shmem(dk, dv, 0, TC_KB_BUFS) : tc_stage_shmem(dk, dv, 1, 2)) +
           (size_t)TC2_WARPS * 32 * (((dk + 15) & ~15) + 8) * 2;
}

// tc_launch_kernel: k (an attention_tc or attention_tc2 instance) over the call's grid (blocks
// of rows_pb rows x kv heads x head groups of gsub), n_threads a block, shmem bytes of dynamic
// shared memory; k allowed max_shmem first (tc_allow_shmem, *attr_set k's own).
static mm_err tc_launch_kernel(void (*k)(struct mm_attn_args, int, int, int *), uint64_t *attr_set,
                               size_t max_shmem, int n_threads, size_t shmem, void *stream,
                               const struct mm_attn_args *a, int gsub, int rows_pb, int *d_err) {
    const mm_err rv = tc_allow_shmem(k, attr_set, max_shmem);
    if (rv != MM_OK)
        return rv;
    const int group = a->n_heads / a->kv.n_kv_heads;
    dim3 grid((unsigned)((a->n_rows + rows_pb - 1) / rows_pb),
              (unsigned)(a->kv.n_kv_heads * (group / gsub)));
    MM_GPU_CHECK(mm_launch_dep(k, grid, dim3(n_threads), shmem, (cudaStream_t)stream, *a, gsub,
                               rows_pb, d_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

template <int DKM, int DVM, bool KB>
static mm_err tc2_launch(void *stream, const struct mm_attn_args *a, int gsub, int rows_pb,
                         int *d_err) {
    static uint64_t attr_set;
    return tc_launch_kernel(attention_tc2_kernel<DKM, DVM, KB>, &attr_set, tc2_shmem(DKM, DVM, KB),
                            TC2_WARPS * 32, tc2_shmem(a->kv.head_dim_k, a->kv.head_dim_v, KB),
                            stream, a, gsub, rows_pb, d_err);
}

// attention_tc_kernel's: one stage, one or two (db) buffers (f32 cache); TC_KB_BUFS (bf16)
static size_t tc_shmem(int dk, int dv, bool db, bool kb) {
    return kb ? tc_stage_shmem(dk, dv, 0, TC_KB_BUFS) : tc_stage_shmem(dk, dv, 1, db ? 2 : 1);
}

template <int DKM, int DVM, int NW, bool DB, bool KB>
static mm_err tc_launch(void *stream, const struct mm_attn_args *a, int gsub, int rows_pb,
                        int *d_err) {
    static uint64_t attr_set;
    return tc_launch_kernel(attention_tc_kernel<DKM, DVM, NW, DB, KB>, &attr_set,
                            tc_shmem(DKM, DVM, DB, KB), NW * 32,
                            tc_shmem(a->kv.head_dim_k, a->kv.head_dim_v, DB, KB), stream, a, gsub,
                            rows_pb, d_err);
}

// DB only matters for an f32 cache (the bf16 form has one pipeline): kb takes DB = true.
template <int NW, bool DB>
static mm_err tc_launch_dims(void *stream, const struct mm_attn_args *a, int gsub, int rows_pb,
                             int *d_err) {
    const bool small = a->kv.head_dim_k <= 64 && a->kv.head_dim_v <= 64;
    if (a->kv.dtype == MM_DTYPE_BF16)
        return small ? tc_launch<64, 64, NW, true, true>(stream, a, gsub, rows_pb, d_err)
                     : tc_launch<128, 128, NW, true, true>(stream, a, gsub, rows_pb, d_err);
    return small ? tc_launch<64, 64, NW, DB, false>(stream, a, gsub, rows_pb, d_err)
                 : tc_launch<128, 128, NW, DB, false>(stream, a, gsub, rows_pb, d_err);
}

// A bf16 cache's shape for these kernels (tc_issue_bf16's 16-byte copies): head dims multiples
// of 8 (up to 128, checked by the caller), 16-byte-aligned slots.
static bool tc_kb_shape_ok(const struct mm_kv_view *kv) {
    return kv->head_dim_k % 8 == 0 && kv->head_dim_v % 8 == 0 && ((uintptr_t)kv->base & 15) == 0 &&
           kv->block_stride % 8 == 0 && kv->slot_stride % 8 == 0;
}
#else
#define TC_HAVE 0
#endif

static int tc_mode(void) {
    if (g_att_tc < 0) {
        g_att_tc = !tc_env_is("MM_GPU_ATT_TC", "0"); // on unless MM_GPU_ATT_TC=0
    }
    return g_att_tc;
}

static int tc_warps(void) {
    if (g_att_tc_warps < 0) {
        g_att_tc_warps = tc_env_is("MM_GPU_ATT_TC_WARPS", "4") ? 4 : 8;
    }
    return g_att_tc_warps;
}

// m16 tiles per warp of prefill calls: 2 (attention_tc2_kernel, the default) or 1
// (attention_tc_kernel, MM_GPU_ATT_TC_MT=1). Same bits either way.
static int tc_mt(void) {
    if (g_att_tc_mt < 0) {
        g_att_tc_mt = tc_env_is("MM_GPU_ATT_TC_MT", "1") ? 1 : 2;
    }
    return g_att_tc_mt;
}

static int tc_db(void) {
    if (g_att_tc_db < 0) {
        g_att_tc_db = !tc_env_is("MM_GPU_ATT_TC_DB", "0");
    }
    return g_att_tc_db;
}

// mm_gpu_set_attention_tc_db: 1 two bf16 key buffers (the next block converted while this one
// is computed, one barrier per block), 0 one buffer (two barriers per block), < 0 back to
// MM_GPU_ATT_TC_DB (default 1). Same bits either way. Process-wide.
extern "C" void mm_gpu_set_attention_tc_db(int mode);
extern "C" void mm_gpu_set_attention_tc_db(int mode) { g_att_tc_db = mode < 0 ? -1 : mode != 0; }

// mm_gpu_set_attention_tc_mt: m16 tiles per warp for prefill calls (more than 64 rows): 2
// (attention_tc2_kernel: 256 units per block of 8 warps, q in shared memory), 1 (8 or 4 warps of
// one tile each: attention_tc_kernel, which decode calls always take); other values: back to
// MM_GPU_ATT_TC_MT (default 2). Same bits. Process-wide.
extern "C" void mm_gpu_set_attention_tc_mt(int mt);
extern "C" void mm_gpu_set_attention_tc_mt(int mt) { g_att_tc_mt = mt == 1 || mt == 2 ? mt : -1; }

// mm_gpu_set_attention_tc: 1 the tensor-core contract for every attention call whose shape it
// takes (decode and prefill alike), 0 ops.cu's f32 kernels, < 0 back to MM_GPU_ATT_TC (read at
// the next call; on unless it is "0"). Process-wide.
extern "C" void mm_gpu_set_attention_tc(int mode);
extern "C" void mm_gpu_set_attention_tc(int mode) { g_att_tc = mode < 0 ? -1 : mode != 0; }

// mm_gpu_set_kv_bf16: 1 bf16 KV caches where mm_gpu_kv_dtype allows them (the default), 0 f32
// caches always, < 0 back to MM_GPU_KV_BF16 (read at the next cache made; on unless "0").
// Process-wide; a cache keeps the dtype it was made with.
extern "C" void mm_gpu_set_kv_bf16(int mode);
extern "C" void mm_gpu_set_kv_bf16(int mode) { g_kv_bf16 = mode < 0 ? -1 : mode != 0; }

// mm_gpu_kv_dtype: the dtype of a new KV cache of this shape (the backend's kv_dtype):
// MM_DTYPE_BF16 when the contract is on (mm_gpu_set_attention_tc / MM_GPU_ATT_TC), bf16 caches
// are allowed (mm_gpu_set_kv_bf16 / MM_GPU_KV_BF16) and every read of the cache goes through
// the contract's kernels: head dims multiples of 8 up to 128 (the shapes mm_gpu_attention_tc
// takes, whatever the number of rows, with tc_issue_bf16's 16-byte copies); else MM_DTYPE_F32.
// The contract rounds K and V to bf16 (cvt.rn) before every product, and ops.cu's kv_store
// rounds with the same instruction, so attention over the bf16 cache gives the bits it gives
// over an f32 cache (cuda_attention_tc_test), in half the bytes. A bf16 cache is then read by
// the contract even if it is switched off later (mm_gpu_attention_tc); ops.cu's f32 kernels
// refuse it. HIP builds (no contract kernels): f32 always.
extern "C" enum mm_dtype mm_gpu_kv_dtype(int n_kv_heads, int head_dim_k, int head_dim_v);
extern "C" enum mm_dtype mm_gpu_kv_dtype(int n_kv_heads, int head_dim_k, int head_dim_v) {
    if (g_kv_bf16 < 0)
        g_kv_bf16 = !tc_env_is("MM_GPU_KV_BF16", "0");
    const bool shape = n_kv_heads > 0 && head_dim_k > 0 && head_dim_v > 0 && head_dim_k <= 128 &&
                       head_dim_v <= 128 && head_dim_k % 8 == 0 && head_dim_v % 8 == 0;
    return TC_HAVE && shape && g_kv_bf16 && tc_mode() ? MM_DTYPE_BF16 : MM_DTYPE_F32;
}

// mm_gpu_set_attention_tc_warps: warps per block of the contract's kernel, 4 (two blocks per
// multiprocessor) or 8 (one); other values: back to MM_GPU_ATT_TC_WARPS. Same bits either way
// (a row's result does not depend on its neighbours in the tile). Process-wide.
extern "C" void mm_gpu_set_attention_tc_warps(int warps);
extern "C" void mm_gpu_set_attention_tc_warps(int warps) {
    g_att_tc_warps = warps == 4 || warps == 8 ? warps : -1;
}

// attention_tcd.cu: decode calls with every warp computing (same bits; MM_GPU_ATT_TCD)
extern "C" mm_err mm_gpu_attention_tcd(void *stream, const struct mm_attn_args *a, int *d_err,
                                       int *done);

// attention_tcw.cu: prefill calls over a bf16 cache with dk = dv = 128 on wgmma (same bits;
// MM_GPU_ATT_TCW, on unless 0)
extern "C" mm_err mm_gpu_attention_tcw(void *stream, const struct mm_attn_args *a, int *d_err,
                                       int *done);

// mm_gpu_attention_tc: runs a on the tensor cores and sets *done when the contract is on and
// takes a's shape (head dims, cache alignment: never the number of rows); *done 0 otherwise
// (bad arguments included: the f32 launchers report them).
extern "C" mm_err mm_gpu_attention_tc(void *stream, const struct mm_attn_args *a, int *d_err,
                                      int *done);
extern "C" mm_err mm_gpu_attention_tc(void *stream, const struct mm_attn_args *a, int *d_err,
                                      int *done) {
    *done = 0;
    // a bf16 cache is read by the contract whatever the switch (its dtype was chosen with the
    // contract on, and no other kernel reads it: mm_gpu_kv_dtype)
    const bool kb = a != NULL && a->kv.dtype == MM_DTYPE_BF16;
    if (!tc_mode() && !kb)
        return MM_OK;
#if TC_HAVE
    if (a == NULL || a->q == NULL || a->out == NULL || a->row_seq == NULL || a->row_pos == NULL ||
        a->kv.base == NULL || a->kv.block_tables == NULL || a->n_heads <= 0 ||
        a->kv.n_kv_heads <= 0 || a->n_heads % a->kv.n_kv_heads != 0 || a->kv.block_size <= 0 ||
        a->n_rows <= 0 || a->n_rows > (int64_t)0x7fffffff)
        return MM_OK;
    const struct mm_kv_view *kv = &a->kv;
    const int dk = kv->head_dim_k, dv = kv->head_dim_v;
    if (dk <= 0 || dv <= 0 || dk % 4 != 0 || dv % 4 != 0 || dk > 128 || dv > 128 ||
        ((uintptr_t)kv->base & 15) != 0 || kv->block_stride % 4 != 0 || kv->slot_stride % 4 != 0)
        return MM_OK;
    if (kv->dtype != MM_DTYPE_F32 && !(kb && tc_kb_shape_ok(kv)))
        return MM_OK; // ops.cu refuses the call (a dtype or bf16 shape no kernel reads)
    if (a->n_rows <= TC_DECODE_ROWS) { // decode calls: every warp computes (attention_tcd.cu)
        const mm_err drv = mm_gpu_attention_tcd(stream, a, d_err, done);
        if (drv != MM_OK || *done)
            return drv;
    }
    if (kb && a->n_rows > TC_DECODE_ROWS) { // prefill over a bf16 cache: wgmma where it takes it
        const mm_err wrv = mm_gpu_attention_tcw(stream, a, d_err, done);
        if (wrv != MM_OK || *done)
            return wrv;
    }
    const bool two = tc_mt() == 2 && a->n_rows > TC_DECODE_ROWS; // prefill: two m16 tiles per warp
    const int nw = two ? TC2_WARPS : tc_warps(), units = nw * 16 * (two ? 2 : 1);
    const int group = a->n_heads / kv->n_kv_heads;
    const int gsub = tc_group_sub(group, units);
    const int rows_pb = a->n_rows <= TC_DECODE_ROWS ? 1 : units / gsub;
    mm_err rv;
    const bool small = dk <= 64 && dv <= 64;
    if (two && kb)
        rv = small ? tc2_launch<64, 64, true>(stream, a, gsub, rows_pb, d_err)
                   : tc2_launch<128, 128, true>(stream, a, gsub, rows_pb, d_err);
    else if (two)
        rv = small ? tc2_launch<64, 64, false>(stream, a, gsub, rows_pb, d_err)
                   : tc2_launch<128, 128, false>(stream, a, gsub, rows_pb, d_err);
    else if (nw == 4)
        rv = tc_db() ? tc_launch_dims<4, true>(stream, a, gsub, rows_pb, d_err)
                     : tc_launch_dims<4, false>(stream, a, gsub, rows_pb, d_err);
    else
        rv = tc_db() ? tc_launch_dims<8, true>(stream, a, gsub, rows_pb, d_err)
                     : tc_launch_dims<8, false>(stream, a, gsub, rows_pb, d_err);
    if (rv == MM_OK)
        *done = 1;
    return rv;
#else
    (void)stream, (void)a, (void)d_err, (void)kb;
    return MM_OK;
#endif
}
