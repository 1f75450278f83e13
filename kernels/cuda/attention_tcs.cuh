// SPDX-License-Identifier: MIT
// Decode calls of the tensor-core attention contract (attention_tc.cu) over long contexts, the
// key blocks split over many multiprocessors: the same bits as attention_tcd_kernel (and so as
// attention_tc_kernel), in less time once a row has many 64-key blocks. Included by
// attention_tcd.cu alone (its kernel runs attention_tcd.cu's tcd_block for rows of few key
// blocks, and device code cannot be called across files).
//
// Design notes:
// - attention_tcd_kernel walks a row's key blocks one after the other in one block per (row,
//   kv head): at 4096 keys 64 rounds of (copies, two barriers, scores, softmax, P V), ~137 us
//   per call on the H200 for ~8 MB read. But in the contract only the out accumulator is a
//   real chain (the P V mma accumulates into C = the scaled running out); the scores of every
//   key block, their mask and raw row maxima do not depend on earlier blocks, and the running
//   max, alpha, p and l are cheap chains once the scores are there.
// - Grid (G, tiles, rows), 8 warps a block. A row of at most min_kb key blocks
//   (MM_GPU_ATT_SPLITK_MIN) is attention_tcd_kernel's block: block 0 of its tile runs
//   tcd_block (the others return). Longer rows:
// - Phase A (every block, one warp per 64-key block, each block striding over the row's key
//   blocks): the warp copies its block's K rows (bf16 cache; zeros for keys outside [first,
//   pos], as tc_issue_bf16 writes them) into its own shared buffer, asks L2 for the block's V
//   rows (prefetch: phase B reads them soon), computes the scores by attention_tcd_kernel's mma
//   sequence (n-tile jn = keys 8 jn.., dims in 16-wide steps in ascending order: the same
//   operands and C chain per output element), masks them as it does (-inf outside [first,
//   pos] and for heads past the tile) and stores them, f32, to the workspace record of the
//   (row, tile, key block) in the lane layout the P fragments need ([n-tile][lane][4]).
// - Hand-off: the blocks of a (row, tile) count themselves on a device counter (threadfence,
//   atomicAdd); the last one (or the only one, when the row has at most 8 key blocks) runs
//   phase B and sets the counter back to 0 for the next call.
// - Phase B (the last block): the row's cache table entries into shared memory (one round),
//   then warp w (w < 4) takes value dims 32 w .. 32 w + 31 (four n-tiles; no block-wide barrier
//   from here): per key block in order its own copies of the score record and of its value
//   columns (cp.async, TCS_RING - 1 blocks in flight), then tc_block's softmax step: raw row max
//   over the row's 4 threads (the same butterfly), m' = max(m, fmul(mx, cs)), alpha, p =
//   ex2(fma(x, cs, -m')), the per-thread p sums in n-tile order, l = fma(l, alpha, ps), out =
//   out * alpha, then the 4 P V mmas per n-tile (P rounded to bf16, 16 keys per step in
//   ascending order, C = out). Block j's P V and block j + 1's softmax are one stretch of code
//   (the scheduler interleaves them: only out is a chain). Every warp recomputes p and l
//   (cheap); only its four out n-tiles are its own. At the end l's butterfly and out * (1 / l),
//   as attention_tcd_kernel. Each rounded operation has attention_tcd's operands, so the
//   outputs are the same bits (cuda_attention_tcd_test).
// - Workspace: per (device, stream) a buffer of rows x tiles x key blocks score records (4 KB
//   each: 16 units x 64 keys f32; 20.5 KB with phase B's third form, which also keeps the
//   block's row maxima and value rows there) and the counters, made (cudaMalloc, counters zeroed on the
//   stream) by an uncaptured call for calls of up to TCS_MAX_ROWS rows of that cache shape (a
//   decode step's first run is uncaptured: common/model.c records a shape the second time it
//   runs); a call that finds it too small while the stream is capturing, a cache that is not
//   bf16, more than TCS_MAX_ROWS rows or a table of more than TCS_TAB blocks per sequence leave
//   the call to attention_tcd_kernel (same bits). A grown buffer does not free the smaller one
//   (a recorded graph may still name it).
// - Bad rows (pos < 0, a bad sequence, pos past the table) set the error flag and leave their
//   outputs alone, as attention_tcd_kernel; a missing table entry is flagged and read as zeros.
// - Switches: MM_GPU_ATT_SPLITK (0 off, 1 on, 2 (default) the calls marked long_ctx;
//   mm_gpu_set_attention_splitk), MM_GPU_ATT_SPLITK_MIN (rows of at most this many key blocks
//   take tcd_block; mm_gpu_set_attention_splitk_min). Positions are device data inside a
//   recorded decode step, so the kernel chooses per row on the device; the caller's long_ctx
//   (common/model.c: some row at position >= MM_ATT_LONG_POS = 12 key blocks, the recorded
//   steps keyed by it) keeps calls of short rows only on attention_tcd_kernel, where the split
//   kernel lost 4-6% (below). MM_GPU_ATT_SPLITK_PB picks phase B's form (3, the default:
//   attention_tcs_pv_kernel after phase A alone; 2: tcs_phase_b3; 1: tcs_phase_b2; 0: the one
//   below).
// - Measured (H200, 2026-11-30 12:15 UTC, 4-layer synthetic Qwen3-30B-A3B, bf16 cache, batch 1;
//   docs/BENCHMARKS.md): per call after a 4096-token prompt 90.4 us against 139.6 for
//   attention_tcd_kernel (per-op timer), decode 1054 / 1060 tok/s against 871 / 868 (+21.5%);
//   at 128 tokens of context (rows on tcd_block) 1635 / 1616 against 1697 / 1720 (-4..-6%, cause
//   not established), so by default only for calls marked long_ctx (mode 2). Every row split
//   (MIN 0): 18.9 against 17.6 us per call at 5 key blocks, 26.5 against 25.4 at 9: MIN 12
//   lies past both (the crossover
//   interpolated, not measured). Phase B costs ~1.1 us per key block (slope between 9 and 65
//   blocks), far above its arithmetic; what bounds it is not established (the run's ncu caught
//   a warm-up call). The first form (11:55 UTC: 8 phase-B warps of 16 dims, the cache table
//   read from global one block ahead, 4 slots) gave 96.6 us per call.
// CUDA only (mma.sync, ldmatrix, cp.async): HIP builds compile the switches alone.
#ifndef MM_GPU_ATTENTION_TCS_CUH
#define MM_GPU_ATTENTION_TCS_CUH

#include <pthread.h>

#define TCS_WARPS 8             // phase A: one key block per warp
#define TCS_PBW 4               // phase B: 32 value dims per warp
#define TCS_REC (TC_KEYS * 16)  // floats of one score record (16 units x 64 keys)
// third phase-B form: a record is the scores, the block's 16 raw row maxima, then its value
// rows as 4 slices of 32 dims (TCS_VSLOT3 bytes each, swizzled: tcs_vswz); TCS_RS3 floats apart
// (the other forms' records are TCS_REC floats apart)
#define TCS_VWS (TCS_REC + 16)
#define TCS_RS3 (TCS_VWS + 4 * TC_KEYS * 16)
#define TCS_RING 5              // phase B: key blocks in a warp's ring (4 in flight)
#define TCS_LDV 40              // bf16 per value row of a warp's 32 dims (80 B: no conflicts)
#define TCS_SLOT (TCS_REC * 4 + TC_KEYS * TCS_LDV * 2) // bytes of one ring slot (9216)
#define TCS_TAB 4096            // cache blocks per sequence at most (table in shared memory)
// phase B with a softmax warp (MM_GPU_ATT_SPLITK_PB): its ring of score records, the
// P ring it hands the value warps (per lane: 16 words of P fragments, 2 alphas, 2 spare), their
// value rings
#define TCS_PR 8                           // score records in flight
#define TCS_PS 4                           // P slots
#define TCS_PSLOT (32 * 20 * 4)            // bytes of one P slot (20 words a lane: 16-byte aligned)
#define TCS_VR 7                           // a value warp's ring (6 key blocks in flight)
#define TCS_VSLOT (TC_KEYS * TCS_LDV * 2)  // bytes of one value slot (5120)

#define TCS_MAX_CTAS 16         // phase A blocks per (row, tile) at most (8 key blocks each)
#define TCS_MAX_ROWS 8          // calls of at most this many rows
#define TCS_MAX_WS (1ull << 30) // workspace bytes at most (larger: attention_tcd_kernel)
#define TCS_SHORT_NB 4          // tcd_block's key buffers for the rows of few key blocks
#define TCS_MIN_DEFAULT 12      // MM_GPU_ATT_SPLITK_MIN unset: rows of <= 12 key blocks: tcd_block
#define TCS_DEFAULT 2           // MM_GPU_ATT_SPLITK unset: calls the caller marks long_ctx

static int g_tcs = -1;     // -1: from MM_GPU_ATT_SPLITK at first use; 0 off; 1 on; 2 auto
static int g_tcs_min = -1; // -1: from MM_GPU_ATT_SPLITK_MIN at first use
static int g_tcs_pb = -1;  // -1: from MM_GPU_ATT_SPLITK_PB at first use ("0" .. "3")
#define TCS_PB_DEFAULT 3   // MM_GPU_ATT_SPLITK_PB unset or another value

#if MM_GPU_HAVE_WMMA
#define TCS_HAVE 1
static_assert(TCS_WARPS * 32 == TCD_THREADS, "tcd_block runs in these blocks");

__device__ __forceinline__ void tcs_prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// grid (G, tiles = n_kv_heads x (group / gsub), rows); ws: [rows][tiles][max_kb] records; cnt:
// [rows][tiles] counters (0 between calls). DKM, DVM: attention_tcd_kernel's (64 when both
// head dims are at most 64, else 128).
// named barriers of phase B's second form (0 is __syncthreads)
__device__ __forceinline__ void tcs_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void tcs_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Phase B's pieces that both forms run in their value warps (warp w: value dims 32 w ..):
// tcs_vcopy: block jb's value columns (keys lane and lane + 32: zeros outside [first, pos],
// past dv, or for a missing table entry) into vd ([key][TCS_LDV] bf16), cp.async, uncommitted.
__device__ __forceinline__ void tcs_vcopy(uint16_t *vd, const struct mm_kv_view &kv,
                                          const uint16_t *vbase, const int32_t *tab, int32_t e0,
                                          int32_t c_lo, int jb, int32_t first, int32_t pos,
                                          int dv, int warp, int lane, int *d_err) {
    const int bs = kv.block_size;
    const bool bs2 = (bs & (bs - 1)) == 0;
    const int bsh = __ffs(bs) - 1;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int key = lane + 32 * h;
        const int32_t t = c_lo + jb * TC_KEYS + key;
        uint16_t *row = vd + key * TCS_LDV;
        const uint16_t *vs = NULL;
        if (t >= first && t <= pos) {
            const int32_t q = bs2 ? t >> bsh : t / bs, kr = t - q * bs;
            const int32_t blk = tab[q - e0];
            if (blk >= 0)
                vs = vbase + (int64_t)blk * kv.block_stride + (int64_t)kr * kv.slot_stride;
            else
                tc_flag(d_err);
        }
#pragma unroll
        for (int pc = 0; pc < 4; pc++) {
            if (vs != NULL && 32 * warp + 8 * pc < dv)
                tc_cp16(row + 8 * pc, vs + 8 * pc);
            else
                *(uint4 *)(row + 8 * pc) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}
// tcs_pv: out = out * alpha (ax0: row g, ax1: row g + 8), then P V of the warp's four n-tiles
// from the value columns at vp (this lane's ldmatrix row already added)
__device__ __forceinline__ void tcs_pv(float (&acc)[4][4], const uint16_t *vp,
                                       const uint32_t (&px)[TC_KEYS / 16][4], float ax0,
                                       float ax1) {
#pragma unroll
    for (int n = 0; n < 4; n++) {
        acc[n][0] = __fmul_rn(acc[n][0], ax0);
        acc[n][1] = __fmul_rn(acc[n][1], ax0);
        acc[n][2] = __fmul_rn(acc[n][2], ax1);
        acc[n][3] = __fmul_rn(acc[n][3], ax1);
    }
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / 16; kk++) {
#pragma unroll
        for (int dp = 0; dp < 2; dp++) {
            uint32_t b[4];
            tc_ldsm4t(b, vp + kk * 16 * TCS_LDV + 16 * dp);
            tc_mma(acc[2 * dp], px[kk], b[0], b[1]);
            tc_mma(acc[2 * dp + 1], px[kk], b[2], b[3]);
        }
    }
}
// tcs_store: the warp's dims of its rows' outputs, out / l (lr: the row's l after the butterfly)
__device__ __forceinline__ void tcs_store(const struct mm_attn_args &a, int64_t r, int h0, int dv,
                                          const bool (&uin)[2], const float (&acc)[4][4],
                                          const float (&lr)[2], int warp, int g, int tq) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (!uin[i])
            continue;
        const float inv = 1.0f / lr[i];
        float *o = a.out + r * a.out_stride + (int64_t)(h0 + g + 8 * i) * dv;
#pragma unroll
        for (int n = 0; n < 4; n++) {
            const int d = 32 * warp + 8 * n + 2 * tq;
            tc_store2(o, d, dv, acc[n][2 * i], acc[n][2 * i + 1], inv);
        }
    }
}

// Phase B, second form (MM_GPU_ATT_SPLITK_PB, default): the softmax chain in one warp, the out
// chains in the value warps. Warp TCS_PBW (the softmax warp) walks the key blocks in order: its
// ring of score records (TCS_PR - 1 in flight), tc_softmax on each (the same operands and order as phase B's
// first form, whose every warp ran it), then its lanes' P fragments and alphas into slot
// jb % TCS_PS of the P ring, released by a named barrier (full); it waits for the slot to be
// free (empty) from block TCS_PS on. Value warp w (32 w < dv) walks the same blocks with its own
// ring of value columns (TCS_VR - 1 in flight), takes block jb's P and alphas from the ring
// (lane for lane: the fragments are per lane, as the first form's), frees the slot, and runs the
// first form's out * alpha and P V. At the end the softmax warp leaves each lane's l (after the
// row's butterfly) for the value warps' stores. Only the softmax work leaves the value warps, so
// every rounded operation has the first form's operands: the same bits. The value warps no
// longer wait on the scores and the softmax, the softmax warp not on the P V chain.
// Measured (H200, 2026-12-01 01:47-02:05 UTC, decode after a 4096-token prompt, 4-layer
// Qwen3-30B-A3B shape): 72-73 us per call against 78 for the first form, decode 1299-1313 vs
// 1255-1269 tok/s. Two softmax warps (one per 8 units) were slower (76.8 us); value rows
// brought by a loader warp's bulk copies much slower (152 us: 64 small bulk copies per key
// block), by two loader warps' cp.async no better (71.6 us): neither kept. Phase B still takes
// ~1.05 us per key block (globaltimer stamps in a diagnostic build); read with the forms tried
// (docs/BENCHMARKS.md), its warps are bound by their own instruction streams (one warp per
// scheduler, ~10 cycles an instruction), the softmax warp's ~200 instructions a block and the
// value warps' ~140 alike: two softmax warps and loader warps together are the next form.
__device__ __forceinline__ void tcs_phase_b2(const struct mm_attn_args &a, const struct mm_kv_view &kv,
                                             const float *rec0, const int32_t *tab, int64_t r,
                                             int h0, int32_t first, int32_t pos, int32_t c_lo,
                                             int nkb, int32_t e0, float cs, const bool (&uin)[2],
                                             int64_t v_off, int *d_err) {
    extern __shared__ __align__(16) unsigned char tcs_sh[];
    const int dv = kv.head_dim_v, dvp = (dv + 15) & ~15;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int nv = (dvp + 31) / 32; // value warps
    const int nb = 32 * (nv + 1);   // threads at each named barrier
    unsigned char *const recr = tcs_sh + TCS_TAB * 4;    // the softmax warp's record ring
    unsigned char *const pring = recr + TCS_PR * TCS_REC * 4; // P slots
    float *const lfin = (float *)(pring + TCS_PS * TCS_PSLOT); // 32 lanes x 2: final l
    unsigned char *const vring0 = (unsigned char *)(lfin + 64);
    // barrier ids: full[s] 1 + s, empty[s] 1 + TCS_PS + s, the final l 1 + 2 TCS_PS
    if (warp == TCS_PBW) {
        auto issue = [&](int jb, int sl) { // block jb's record: this lane's own pieces
            unsigned char *p = recr + sl * TCS_REC * 4;
            const float *src = rec0 + (int64_t)jb * TCS_REC;
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++)
                tc_cp16(p + (jn * 32 + lane) * 16, src + (jn * 32 + lane) * 4);
            tc_commit();
        };
#pragma unroll
        for (int b = 0; b < TCS_PR - 1; b++) {
            if (b < nkb)
                issue(b, b);
            else
                tc_commit();
        }
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        for (int jb = 0; jb < nkb; jb++) {
            const int nx = jb + TCS_PR - 1;
            if (nx < nkb)
                issue(nx, nx % TCS_PR); // into block jb - 1's slot (read by this lane only)
            else
                tc_commit();
            tc_wait<TCS_PR - 1>(); // this lane's pieces of block jb landed
            const unsigned char *p = recr + (jb % TCS_PR) * TCS_REC * 4;
            float sc[TC_KEYS / 8][4];
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++) {
                const float4 x = *(const float4 *)(p + (jn * 32 + lane) * 16);
                sc[jn][0] = x.x, sc[jn][1] = x.y, sc[jn][2] = x.z, sc[jn][3] = x.w;
            }
            const int ps = jb % TCS_PS;
            uint32_t *dst = (uint32_t *)(pring + ps * TCS_PSLOT) + lane * 20;
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int jn = 0; jn < TC_KEYS / 8; jn++)
                    mx[i] = fmaxf(mx[i], fmaxf(sc[jn][2 * i], sc[jn][2 * i + 1]));
            uint32_t px[TC_KEYS / 16][4];
            float ax[2];
            tc_softmax(sc, mx, cs, m, l, px, ax);
            if (jb >= TCS_PS)
                tcs_bar_sync(1 + TCS_PS + ps, nb); // the value warps are done with jb - PS
#pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; kk++)
                *(uint4 *)(dst + 4 * kk) = make_uint4(px[kk][0], px[kk][1], px[kk][2], px[kk][3]);
            dst[16] = __float_as_uint(ax[0]), dst[17] = __float_as_uint(ax[1]);
            __threadfence_block();
            tcs_bar_arrive(1 + ps, nb);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            l[i] = tc_quad_sum(l[i]);
        }
        lfin[2 * lane] = l[0], lfin[2 * lane + 1] = l[1];
        __threadfence_block();
        tcs_bar_arrive(1 + 2 * TCS_PS, nb);
        tc_wait<0>();
        return;
    }
    if (warp >= nv)
        return;
    // value warp: dims 32 warp .. 32 warp + 31
    unsigned char *const ring = vring0 + warp * TCS_VR * TCS_VSLOT;
    const uint16_t *const vbase = (const uint16_t *)kv.base + v_off + 32 * warp;
    auto issue = [&](int jb, int sl) { // block jb's value columns
        tcs_vcopy((uint16_t *)(ring + sl * TCS_VSLOT), kv, vbase, tab, e0, c_lo, jb, first, pos,
                  dv, warp, lane, d_err);
        tc_commit();
    };
#pragma unroll
    for (int b = 0; b < TCS_VR - 1; b++) {
        if (b < nkb)
            issue(b, b);
        else
            tc_commit();
    }
    float acc[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const int mt = lane >> 3;
    const int voff = ((mt & 1) * 8 + (lane & 7)) * TCS_LDV + (mt >> 1) * 8;
    for (int jb = 0; jb < nkb; jb++) {
        __syncwarp(); // every lane done with block jb - 1's slot
        const int nx = jb + TCS_VR - 1;
        if (nx < nkb)
            issue(nx, nx % TCS_VR);
        else
            tc_commit();
        tc_wait<TCS_VR - 1>(); // this lane's copies of block jb landed
        __syncwarp();          // every lane's
        const int ps = jb % TCS_PS;
        tcs_bar_sync(1 + ps, nb); // block jb's P and alphas are in slot ps
        const uint32_t *src = (const uint32_t *)(pring + ps * TCS_PSLOT) + lane * 20;
        uint32_t px[TC_KEYS / 16][4];
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++) {
            const uint4 u = *(const uint4 *)(src + 4 * kk);
            px[kk][0] = u.x, px[kk][1] = u.y, px[kk][2] = u.z, px[kk][3] = u.w;
        }
        const float ax0 = __uint_as_float(src[16]), ax1 = __uint_as_float(src[17]);
        if (jb + TCS_PS < nkb) // the softmax warp waits for this slot again
            tcs_bar_arrive(1 + TCS_PS + ps, nb);
        tcs_pv(acc, (const uint16_t *)(ring + (jb % TCS_VR) * TCS_VSLOT) + voff, px, ax0, ax1);
    }
    tcs_bar_sync(1 + 2 * TCS_PS, nb); // the softmax warp's final l
    tc_wait<0>();
    const float lr[2] = {lfin[2 * lane], lfin[2 * lane + 1]};
    tcs_store(a, r, h0, dv, uin, acc, lr, warp, g, tq);
}


// Phase B, third form (MM_GPU_ATT_SPLITK_PB=2): the softmax of every key block at once, the
// value rows read back contiguous. Of the contract's chains only out (C of the P V mmas) needs
// the blocks in order: the running max is a fold of the blocks' raw row maxima, and given it,
// each block's alpha, p and p sums depend on that block alone; l is a cheap fma chain. Phase A
// leaves after each block's scores its raw row maxima and its value rows, gathered 256
// contiguous bytes a load, as 4 slices of 32 dims (tcs_vswz's layout). Then: (1) the maxima
// into shared memory, and lanes 0..15 of warp 0 fold them in block order (m' = max(m, fmul(max,
// cs)), tc_max_step's expression) into the running max after every block; (2) the 8 warps take
// the blocks in turn: from the record's scores and the running maxima before and after the
// block, tc_max_step's alpha and -m', tc_softmax's p (ex2 of the fma), its per-thread sums in
// n-tile order and the P fragments, written over the lane's own first 5 pieces of the record
// (P words, then the p sums and alphas); (3) value warp w (dims 32 w ..) walks the blocks in
// order with a ring of its value slice and the P pieces (TCS_VR3 - 1 blocks in flight, every
// copy 512 contiguous bytes an instruction, where the other forms gather 16 bytes a key): l =
// fma(l, alpha, ps), then tcs_pv's out * alpha and P V. Every rounded operation has the other
// forms' operands in their order: the same bits. Default (TCS_PB_DEFAULT).
// Measured (H200, 2026-12-01 03:52-03:59 UTC, decode after a 4096-token prompt, 4-layer
// Qwen3-30B-A3B shape; docs/BENCHMARKS.md): 51.6 us per call against 74.3 for the second form,
// decode 1458-1461 vs 1281-1282 tok/s. What had held phase B: the value copies, 16 bytes a key
// per lane from rows 2 KB apart (a diagnostic build without them: 36.7 us instead of 73.0),
// not the softmax (this form without the value copies' change: 73.0 us); 8 value warps of 16
// dims with 3 blocks in flight: 82.8 us. Phase A's key rows in this form are also copied 16
// lanes a row (256 contiguous bytes a copy): 49.9 vs 51.6 us (04:05 UTC).
#define TCS_VR3 6                           // a value warp's ring (5 blocks in flight)
#define TCS_VSLOT3 (TC_KEYS * 64)           // a value warp's slice of a block: 64 keys x 32 dims
#define TCS_PSLOT3 (5 * 32 * 16)            // the P pieces of a block (5 x 16 bytes a lane)
#define TCS_SLOT3 (TCS_VSLOT3 + TCS_PSLOT3) // one slot of a value warp's ring
// Byte offset of dims 8 c .. 8 c + 7 (c < 4) of key k in a value slice: rows of 64 bytes, the
// 16-byte pieces swizzled by key bits 1..2, so that ldmatrix's 8 rows of a piece fall in 8
// different bank groups
__device__ __forceinline__ uint32_t tcs_vswz(int k, int c) {
    return (uint32_t)(k * 64 + 16 * (c ^ ((k >> 1) & 3)));
}
// One key block of the value chain of the third and fourth forms: this lane's P pieces at pp
// (the P fragments, then (p sums, alphas) 128 pieces on) into px and pa (tcs_b3_take); then
// l = fma(l, alpha, ps), tcs_pv's out * alpha and the P V mmas of the four n-tiles, the value
// columns read by ldmatrix from the swizzled slice vp (tcs_vswz) (tcs_b3_chain)
__device__ __forceinline__ void tcs_b3_take(const uint4 *pp, int lane, uint32_t (&px)[TC_KEYS / 16][4],
                                            float4 &pa) {
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / 16; kk++) {
        const uint4 u = pp[kk * 32 + lane];
        px[kk][0] = u.x, px[kk][1] = u.y, px[kk][2] = u.z, px[kk][3] = u.w;
    }
    pa = *(const float4 *)(pp + 4 * 32 + lane);
}
__device__ __forceinline__ void tcs_b3_chain(float (&acc)[4][4], float (&l)[2],
                                             const uint32_t (&px)[TC_KEYS / 16][4], float4 pa,
                                             const unsigned char *vp, int lane) {
    const int mt = lane >> 3;
    l[0] = __fmaf_rn(l[0], pa.z, pa.x);
    l[1] = __fmaf_rn(l[1], pa.w, pa.y);
#pragma unroll
    for (int n = 0; n < 4; n++) {
        acc[n][0] = __fmul_rn(acc[n][0], pa.z);
        acc[n][1] = __fmul_rn(acc[n][1], pa.z);
        acc[n][2] = __fmul_rn(acc[n][2], pa.w);
        acc[n][3] = __fmul_rn(acc[n][3], pa.w);
    }
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / 16; kk++) {
        const int key = kk * 16 + (mt & 1) * 8 + (lane & 7);
#pragma unroll
        for (int dp = 0; dp < 2; dp++) {
            uint32_t b[4];
            tc_ldsm4t(b, (const uint16_t *)(vp + tcs_vswz(key, (mt >> 1) + 2 * dp)));
            tc_mma(acc[2 * dp], px[kk], b[0], b[1]);
            tc_mma(acc[2 * dp + 1], px[kk], b[2], b[3]);
        }
    }
}
// Step (1), by the whole block: block jb's raw row maxima from the records into mrun[jb][16],
// then lanes 0..15 of warp 0 fold them in block order into the running max after each block
// (m' = max(m, fmul(max, cs)), tc_max_step's expression). NT: the block's threads.
template <int NT>
__device__ __forceinline__ void tcs_b3_fold(float *mrun, const float *rec0, int nkb, float cs) {
    const int tid = threadIdx.x;
    for (int i = tid; i < nkb * 16; i += NT)
        mrun[i] = rec0[(int64_t)(i >> 4) * TCS_RS3 + TCS_REC + (i & 15)];
    __syncthreads();
    if (tid < 16) {
        float m = -INFINITY;
        for (int jb = 0; jb < nkb; jb++) {
            m = fmaxf(m, __fmul_rn(mrun[jb * 16 + tid], cs));
            mrun[jb * 16 + tid] = m;
        }
    }
    __syncthreads();
}
// Step (2) for key block jb: from its masked scores sc and the running maxima before and after
// it, tc_max_step's alpha (al) and -m', then tc_softmax's p (tc_p: the P fragments px, the p
// sums ps).
__device__ __forceinline__ void tcs_b3_p(const float *mrun, int jb, float cs,
                                         const float (&sc)[TC_KEYS / 8][4],
                                         uint32_t (&px)[TC_KEYS / 16][4], float (&ps)[2],
                                         float (&al)[2]) {
    const int g = (threadIdx.x & 31) >> 2;
    float ms[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const float mp = jb > 0 ? mrun[(jb - 1) * 16 + g + 8 * i] : -INFINITY;
        const float mn = mrun[jb * 16 + g + 8 * i];
        al[i] = mn == mp ? 1.0f : tc_ex2(__fsub_rn(mp, mn));
        ms[i] = mn == -INFINITY ? 0.0f : -mn;
    }
    tc_p(sc, cs, ms, px, ps);
}
// steps (1) and (2), by the whole block
__device__ __forceinline__ void tcs_b3_soft(float *rec0, int nkb, float cs) {
    extern __shared__ __align__(16) unsigned char tcs_sh[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float *const mrun = (float *)(tcs_sh + TCS_TAB * 4); // [nkb][16]: maxima, then running max
    tcs_b3_fold<TCD_THREADS>(mrun, rec0, nkb, cs);
    // (2) every block's P, p sums and alphas (the warp's next block's scores loaded while it
    // computes this one's)
    float4 nxs[TC_KEYS / 8];
    if (warp < nkb)
#pragma unroll
        for (int jn = 0; jn < TC_KEYS / 8; jn++)
            nxs[jn] = ((const float4 *)(rec0 + (int64_t)warp * TCS_RS3))[jn * 32 + lane];
    for (int jb = warp; jb < nkb; jb += TCS_WARPS) {
        float4 *rp = (float4 *)(rec0 + (int64_t)jb * TCS_RS3);
        float sc[TC_KEYS / 8][4];
#pragma unroll
        for (int jn = 0; jn < TC_KEYS / 8; jn++) {
            const float4 x = nxs[jn];
            sc[jn][0] = x.x, sc[jn][1] = x.y, sc[jn][2] = x.z, sc[jn][3] = x.w;
        }
        if (jb + TCS_WARPS < nkb)
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++)
                nxs[jn] = ((const float4 *)(rec0 + (int64_t)(jb + TCS_WARPS) * TCS_RS3))[jn * 32 + lane];
        float al[2], ps[2];
        uint32_t px[TC_KEYS / 16][4];
        tcs_b3_p(mrun, jb, cs, sc, px, ps, al);
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++)
            rp[kk * 32 + lane] = make_float4(__uint_as_float(px[kk][0]), __uint_as_float(px[kk][1]),
                                             __uint_as_float(px[kk][2]), __uint_as_float(px[kk][3]));
        rp[4 * 32 + lane] = make_float4(ps[0], ps[1], al[0], al[1]);
    }
    __syncthreads(); // every block's pieces written (and the running maxima no longer read)
}
// step (3) for value dims 32 q .. 32 q + 31, by one warp, its ring of VR slots at ring. NPR 0
// (the third form): each slot holds a block's value slice and its P pieces, both copied from
// the record. NPR > 0 (the fourth form): the slots hold the value slices alone, and block jb's
// P pieces are taken from slot jb % NPR of pring, which its P warp fills (full barrier 1 + s,
// empty barrier 1 + NPR + s, two warps each).
template <int VR, int NPR>
__device__ __forceinline__ void tcs_b3_pv(const struct mm_attn_args &a, const float *rec0,
                                          int64_t r, int h0, int nkb, const bool (&uin)[2], int q,
                                          unsigned char *ring, const unsigned char *pring) {
    constexpr int SLOT = NPR ? TCS_VSLOT3 : TCS_SLOT3;
    const int dv = a.kv.head_dim_v;
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int warp = q; // (the slice and the dims stored: tcs_store's warp)
    auto issue = [&](int jb, int sl) { // block jb's value slice (and P pieces)
        unsigned char *p = ring + sl * SLOT;
        const float *src = rec0 + (int64_t)jb * TCS_RS3;
        const unsigned char *vs = (const unsigned char *)(src + TCS_VWS) + warp * TCS_VSLOT3;
#pragma unroll
        for (int i = 0; i < TCS_VSLOT3 / 512; i++)
            tc_cp16(p + (i * 32 + lane) * 16, vs + (i * 32 + lane) * 16);
        if (!NPR)
#pragma unroll
            for (int c = 0; c < 5; c++)
                tc_cp16(p + TCS_VSLOT3 + (c * 32 + lane) * 16, src + (c * 32 + lane) * 4);
        tc_commit();
    };
#pragma unroll
    for (int b = 0; b < VR - 1; b++) {
        if (b < nkb)
            issue(b, b);
        else
            tc_commit();
    }
    float acc[4][4], l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 4; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    for (int jb = 0; jb < nkb; jb++) {
        __syncwarp(); // every lane done with block jb - 1's slot
        const int nx = jb + VR - 1;
        if (nx < nkb)
            issue(nx, nx % VR);
        else
            tc_commit();
        tc_wait<VR - 1>(); // this lane's copies of block jb landed
        __syncwarp();      // every lane's
        const unsigned char *sp = ring + (jb % VR) * SLOT;
        uint32_t px[TC_KEYS / 16][4];
        float4 pa;
        if (NPR) {
            const int sl = jb % (NPR ? NPR : 1);
            tcs_bar_sync(1 + sl, 64); // block jb's P pieces are in slot sl
            tcs_b3_take((const uint4 *)(pring + sl * TCS_PSLOT3), lane, px, pa);
            if (jb + NPR < nkb) // its P warp waits for this slot again
                tcs_bar_arrive(1 + NPR + sl, 64);
        } else {
            tcs_b3_take((const uint4 *)(sp + TCS_VSLOT3), lane, px, pa);
        }
        tcs_b3_chain(acc, l, px, pa, sp, lane);
    }
    tc_wait<0>();
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] = tc_quad_sum(l[i]);
    }
    tcs_store(a, r, h0, dv, uin, acc, l, warp, g, tq);
}
__device__ __forceinline__ void tcs_phase_b3(const struct mm_attn_args &a, float *rec0, int64_t r,
                                             int h0, int nkb, float cs, const bool (&uin)[2]) {
    extern __shared__ __align__(16) unsigned char tcs_sh[];
    const int dvp = (a.kv.head_dim_v + 15) & ~15, warp = threadIdx.x >> 5;
    tcs_b3_soft(rec0, nkb, cs);
    if (warp < (dvp + 31) / 32)
        tcs_b3_pv<TCS_VR3, 0>(a, rec0, r, h0, nkb, uin, warp,
                              tcs_sh + TCS_TAB * 4 + warp * TCS_VR3 * TCS_SLOT3, NULL);
}

// Phase B, fourth form (MM_GPU_ATT_SPLITK_PB=3): all of phase B in a second kernel,
// attention_tcs_pv_kernel, a programmatic dependent of the first (which runs phase A alone and
// needs no hand-off: the second waits for it at griddepcontrol.wait). One block of TCS4_NP + 1 warps per
// 32 value dims of each (row, tile), so a row's records stream into (dvp / 32) multiprocessors,
// where the third form's last block took them all through one SM's link to the L2 (~26 KB a key
// block: four value slices and four copies of the P pieces; ~0.5 us a block). In each block:
// the third form's step (1) (the maxima folded in block order by lanes 0..15), then warps
// 0..TCS4_NP - 1 compute the key blocks' P, p sums and alphas (step (2)'s expressions; warp w
// the blocks w, w + TCS4_NP, .., from its own ring of score records) into P slot w, which warp
// TCS4_NP, the value warp, takes in block order (full and empty named barriers of two warps,
// the second form's protocol) for step (3)'s out and l chains over its ring of value slices.
// The same operations on the same operands as the third form: the same bits. Shared memory:
// max_kb x 16 running maxima, then the rings (tcs_pv_shmem); more than TCS_PV_SHMEM_MAX (a
// cache of more than ~2000 key blocks a sequence) takes the third form. Default.
// Measured (H200, 2026-12-01 05:58 UTC, 4-layer Qwen3-30B-A3B shape, batch 1; docs/BENCHMARKS.md):
// per call after a 4096-token prompt 40.1 us against 49.9 for the third form (per-op timer),
// decode 1640-1645 vs 1490-1495 tok/s; after 8192 tokens 1388 vs 1162; batch 8 after 1024
// tokens 1849 vs 1780. ncu (L2 flushed between kernels, so an upper bound): phase A 13.3 us,
// the second kernel ~25 us; what bounds the second is not established: six P warps instead of
// four gave +0.7%, and the value warp's next block's loads placed between its mma k-steps lost
// 6% (its wait for the next P slot then sits inside the current block's chain).
#define TCS4_SR 3  // a P warp's ring of score records (its next 2 blocks in flight)
#define TCS4_NP 4  // P warps, one P slot each
#define TCS4_VR 10 // the value warp's ring of value slices (9 in flight)
#define TCS_PV_SHMEM_MAX (200u << 10) // larger (max_kb past ~2000): the third form
static size_t tcs_pv_shmem(int max_kb) {
    return (size_t)max_kb * 16 * 4 + (size_t)TCS4_NP * TCS4_SR * TCS_REC * 4 +
           (size_t)TCS4_NP * TCS_PSLOT3 +
           (size_t)TCS4_VR * TCS_VSLOT3;
}
__global__ void __launch_bounds__(32 * (TCS4_NP + 1))
    attention_tcs_pv_kernel(struct mm_attn_args a, int gsub, int max_kb, int min_kb, float *ws) {
    mm_dep_signal();
    mm_dep_wait();
    extern __shared__ __align__(16) unsigned char tcs_sh[];
    const struct mm_kv_view &kv = a.kv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gsub;
    const int kvh = blockIdx.y / per_kv, h0 = kvh * group + (blockIdx.y % per_kv) * gsub;
    const int64_t r = blockIdx.z;
    const int32_t sq = a.row_seq[r], pos = a.row_pos[r];
    if (pos < 0 || sq < 0 || pos / kv.block_size >= kv.max_blocks)
        return; // (flagged by the first kernel)
    int32_t first = 0;
    if (a.window > 0 && pos - a.window + 1 > 0)
        first = pos - a.window + 1;
    const int32_t c_lo = (first / TC_KEYS) * TC_KEYS;
    const int nkb = pos / TC_KEYS - c_lo / TC_KEYS + 1;
    if (nkb <= min_kb) // done by tcd_block in the first kernel
        return;
    const int64_t unit = r * gridDim.y + blockIdx.y;
    const float *const rec0 = ws + unit * max_kb * TCS_RS3;
    const float cs = a.scale * 1.4426950408889634f;
    const int q = blockIdx.x; // value dims 32 q .. 32 q + 31
    float *const mrun = (float *)tcs_sh; // [nkb][16]: maxima, then the running max
    unsigned char *const sring = tcs_sh + (size_t)max_kb * 16 * 4;
    unsigned char *const pring = sring + TCS4_NP * TCS4_SR * TCS_REC * 4;
    unsigned char *const vring = pring + TCS4_NP * TCS_PSLOT3;
    tcs_b3_fold<32 * (TCS4_NP + 1)>(mrun, rec0, nkb, cs); // (1), the third form's
    // barrier ids: full[w] 1 + w, empty[w] 1 + TCS4_NP + w (P warp w and the value warp)
    if (warp < TCS4_NP) { // (2) blocks warp, warp + TCS4_NP, ..: their P pieces into slot warp
        unsigned char *const myring = sring + warp * TCS4_SR * TCS_REC * 4;
        auto issue = [&](int jb, int sl) { // block jb's scores: this lane's own pieces
            unsigned char *p = myring + sl * TCS_REC * 4;
            const float *src = rec0 + (int64_t)jb * TCS_RS3;
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++)
                tc_cp16(p + (jn * 32 + lane) * 16, src + (jn * 32 + lane) * 4);
            tc_commit();
        };
#pragma unroll
        for (int b = 0; b < TCS4_SR - 1; b++) {
            if (warp + b * TCS4_NP < nkb)
                issue(warp + b * TCS4_NP, b);
            else
                tc_commit();
        }
        for (int it = 0, jb = warp; jb < nkb; it++, jb += TCS4_NP) {
            const int nx = jb + (TCS4_SR - 1) * TCS4_NP;
            if (nx < nkb)
                issue(nx, (it + TCS4_SR - 1) % TCS4_SR); // into its previous block's slot
            else
                tc_commit();
            tc_wait<TCS4_SR - 1>(); // this lane's pieces of block jb landed
            const unsigned char *sp = myring + (it % TCS4_SR) * TCS_REC * 4;
            float sc[TC_KEYS / 8][4];
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++) {
                const float4 x = *(const float4 *)(sp + (jn * 32 + lane) * 16);
                sc[jn][0] = x.x, sc[jn][1] = x.y, sc[jn][2] = x.z, sc[jn][3] = x.w;
            }
            float al[2], ps[2];
            uint32_t px[TC_KEYS / 16][4];
            tcs_b3_p(mrun, jb, cs, sc, px, ps, al);
            const int sl = warp; // (= jb % TCS4_NP)
            if (jb >= TCS4_NP)
                tcs_bar_sync(1 + TCS4_NP + sl, 64); // the value warp is done with block jb - TCS4_NP
            uint4 *dst = (uint4 *)(pring + sl * TCS_PSLOT3);
#pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; kk++)
                dst[kk * 32 + lane] = make_uint4(px[kk][0], px[kk][1], px[kk][2], px[kk][3]);
            dst[4 * 32 + lane] = make_uint4(__float_as_uint(ps[0]), __float_as_uint(ps[1]),
                                            __float_as_uint(al[0]), __float_as_uint(al[1]));
            __threadfence_block();
            tcs_bar_arrive(1 + sl, 64);
        }
        tc_wait<0>();
        return;
    }
    // (3) the value warp: the out and l chains of dims 32 q .., the value slices by its own ring
    bool uin[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        uin[i] = g + 8 * i < gsub;
    tcs_b3_pv<TCS4_VR, TCS4_NP>(a, rec0, r, h0, nkb, uin, q, vring, pring);
}

template <int DKM, int DVM, int PB>
__global__ void __launch_bounds__(TCD_THREADS, 1)
    attention_tcs_kernel(struct mm_attn_args a, int gsub, int max_kb, int min_kb, float *ws,
                         unsigned *cnt, int *d_err) {
    mm_dep_signal();
    if (!a.keys_early) // else the rows of few key blocks wait inside tcd_block, the others below
        mm_dep_wait();
    extern __shared__ __align__(16) unsigned char tcs_sh[];
    __shared__ int last;
    const struct mm_kv_view &kv = a.kv;
    const int dk = kv.head_dim_k, dv = kv.head_dim_v;
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15, ldk = dkp + 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gsub;
    const int kvh = blockIdx.y / per_kv, h0 = kvh * group + (blockIdx.y % per_kv) * gsub;
    const int64_t r = blockIdx.z;
    const int64_t k_off = (int64_t)kvh * dk,
                  v_off = (int64_t)kv.n_kv_heads * dk + (int64_t)kvh * dv;
    const int32_t sq = a.row_seq[r], pos = a.row_pos[r];
    if (pos < 0 || sq < 0 || pos / kv.block_size >= kv.max_blocks) {
        if (tid == 0)
            tc_flag(d_err);
        return;
    }
    int32_t first = 0;
    if (a.window > 0 && pos - a.window + 1 > 0)
        first = pos - a.window + 1;
    const int32_t c_lo = (first / TC_KEYS) * TC_KEYS;
    const int nkb = pos / TC_KEYS - c_lo / TC_KEYS + 1; // the row's key blocks
    if (nkb <= min_kb) { // few key blocks: attention_tcd_kernel's block
        if (blockIdx.x == 0)
            tcd_block<DKM, DVM, 1, TCS_SHORT_NB>(a, gsub, d_err, blockIdx.z, blockIdx.y,
                                                 a.keys_early != 0);
        return;
    }
    if (a.keys_early)
        mm_dep_wait();
    const int nct = min((nkb + TCS_WARPS - 1) / TCS_WARPS, (int)gridDim.x); // blocks with work
    if ((int)blockIdx.x >= nct)
        return;
    const int64_t unit = r * gridDim.y + blockIdx.y;
    constexpr int RS = PB >= 2 ? TCS_RS3 : TCS_REC; // floats between records
    float *const rec0 = ws + unit * max_kb * RS;
    bool uin[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        uin[i] = g + 8 * i < gsub;
    const float cs = a.scale * 1.4426950408889634f;

    // ---- phase A: scores of key blocks blockIdx.x * 8 + warp, + 8 G, ..
    {
        uint16_t *const kw = (uint16_t *)tcs_sh + warp * TC_KEYS * ldk; // this warp's K rows
        if (dk < dkp) // pad dims: zeros (q is zero there; stale shared memory could be NaN)
            for (int key = lane; key < TC_KEYS; key += 32)
                *(uint4 *)(kw + key * ldk + dk) = make_uint4(0u, 0u, 0u, 0u);
        // q as A fragments (attention_tcd_kernel's qf)
        const float *q_row[2];
#pragma unroll
        for (int i = 0; i < 2; i++)
            q_row[i] = uin[i] ? a.q + r * a.q_stride + (int64_t)(h0 + g + 8 * i) * dk : NULL;
        uint32_t qf[DKM / 16][4];
        tc_q_frag<DKM>(q_row, dk, tq, qf);
        for (int jb = blockIdx.x * TCS_WARPS + warp; jb < nkb; jb += gridDim.x * TCS_WARPS) {
            const int32_t c0 = c_lo + jb * TC_KEYS;
            __syncwarp(); // the last block's ldmatrix reads done before the copies overwrite
            const uint16_t *vrow[2] = {NULL, NULL}; // keys lane, lane + 32: their value rows
            const uint16_t *krw[2] = {NULL, NULL};  // ... and key rows
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int key = lane + 32 * h;
                int32_t kr;
                const int32_t blk = tc_blk_kb(kv, sq, c0 + key, first, pos, kr, d_err);
                uint16_t *krow = kw + key * ldk;
                if (blk >= 0) {
                    const uint16_t *slot = (const uint16_t *)kv.base +
                                           (int64_t)blk * kv.block_stride +
                                           (int64_t)kr * kv.slot_stride;
                    if (PB < 2)
                        for (int i = 0; i < dk / 8; i++)
                            tc_cp16(krow + 8 * i, slot + k_off + 8 * i);
                    krw[h] = slot + k_off;
                    vrow[h] = slot + v_off;
                    if (PB < 2) { // phase B reads the value rows soon
                        const uintptr_t v0 = (uintptr_t)(slot + v_off), v1 = v0 + 2 * (uintptr_t)dv;
                        for (uintptr_t ln = v0 & ~(uintptr_t)127; ln < v1; ln += 128)
                            tcs_prefetch_l2((const void *)ln);
                    }
                } else {
                    if (blk != TC_NO_KEY) // in range, but the table has no block
                        tc_flag(d_err);
                    if (PB < 2)
                        for (int i = 0; i < dk / 8; i++)
                            *(uint4 *)(krow + 8 * i) = make_uint4(0u, 0u, 0u, 0u);
                }
            }
            if (PB >= 2) { // the key rows 16 lanes a row: each copy 256 contiguous bytes
                const int pc = lane & 15;
#pragma unroll 8
                for (int i = 0; i < TC_KEYS / 2; i++) {
                    const int key = 2 * i + (lane >> 4);
                    const uint16_t *kp = (const uint16_t *)__shfl_sync(
                        0xffffffffu, (unsigned long long)(i >= 16 ? krw[1] : krw[0]), key & 31);
                    uint16_t *dst = kw + key * ldk + 8 * pc;
                    if (pc >= dk / 8)
                        continue;
                    if (kp != NULL)
                        tc_cp16(dst, kp + 8 * pc);
                    else
                        *(uint4 *)dst = make_uint4(0u, 0u, 0u, 0u);
                }
            }
            tc_commit();
            tc_wait<0>();
            __syncwarp(); // every lane's rows visible to the warp
            float s[TC_KEYS / 8][4];
            tc_scores<DKM>(qf, kw, ldk, dkp, s);
            float4 *rec = (float4 *)(rec0 + (int64_t)jb * RS);
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++) {
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int32_t t = c0 + 8 * jn + 2 * tq + e;
                        if (!(uin[i] && t >= first && t <= pos))
                            s[jn][2 * i + e] = -INFINITY;
                    }
                rec[jn * 32 + lane] = make_float4(s[jn][0], s[jn][1], s[jn][2], s[jn][3]);
            }
            if (PB >= 2) { // the block's raw row maxima as tc_softmax's callers take them
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int i = 0; i < 2; i++) {
#pragma unroll
                    for (int jn = 0; jn < TC_KEYS / 8; jn++)
                        mx[i] = fmaxf(mx[i], fmaxf(s[jn][2 * i], s[jn][2 * i + 1]));
                    mx[i] = tc_quad_max(mx[i]);
                }
                float *bm = rec0 + (int64_t)jb * RS + TCS_REC;
                if (tq == 0)
                    bm[g] = mx[0], bm[g + 8] = mx[1];
                // the block's value rows into its slices (zeros for keys outside [first,
                // pos], missing entries and dims past dv, as tcs_vcopy): 16 lanes a row, two
                // rows an instruction, so each load reads 256 contiguous bytes
                unsigned char *vws = (unsigned char *)(rec0 + (int64_t)jb * RS + TCS_VWS);
                const int pc = lane & 15, vw = pc >> 2, vc = pc & 3;
                const bool pin = vw < (dvp + 31) / 32, pdv = 8 * pc < dv;
#pragma unroll
                for (int rd = 0; rd < 4; rd++) {
                    uint4 v[8];
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int key = 2 * (rd * 8 + i) + (lane >> 4);
                        const uint16_t *vp = (const uint16_t *)__shfl_sync(
                            0xffffffffu, (unsigned long long)(rd >= 2 ? vrow[1] : vrow[0]), key & 31);
                        v[i] = vp != NULL && pdv ? *(const uint4 *)(vp + 8 * pc)
                                                 : make_uint4(0u, 0u, 0u, 0u);
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int key = 2 * (rd * 8 + i) + (lane >> 4);
                        if (pin)
                            *(uint4 *)(vws + vw * TCS_VSLOT3 + tcs_vswz(key, vc)) = v[i];
                    }
                }
            }
        }
    }

    if (PB == 3) // phase B: attention_tcs_pv_kernel, after this kernel
        return;
    // ---- hand-off: the last block of the (row, tile) goes on
    __threadfence();
    __syncthreads(); // also: every warp's phase-A reads of shared memory done
    if (nct > 1) {
        if (tid == 0) {
            const unsigned old = atomicAdd(cnt + unit, 1u);
            last = old == (unsigned)(nct - 1);
            if (last) {
                cnt[unit] = 0u; // every block of this call has counted: ready for the next call
                __threadfence();
            }
        }
        __syncthreads();
        if (!last)
            return;
    }

    // ---- phase B
    // the row's cache table entries (blocks e0 ..) into shared memory, for the value copies
    const int bs = kv.block_size;
    const int32_t e0 = c_lo / bs, ne = pos / bs - e0 + 1; // ne <= max_blocks <= TCS_TAB
    int32_t *const tab = (int32_t *)tcs_sh;
    if (PB < 2) // (the third form reads the value rows phase A left in the records)
        for (int i = tid; i < ne; i += TCD_THREADS)
            tab[i] = kv.block_tables[(int64_t)sq * kv.max_blocks + e0 + i];
    __syncthreads();
    if (PB == 2) {
        tcs_phase_b3(a, rec0, r, h0, nkb, cs, uin);
        return;
    }
    if (PB == 1) {
        tcs_phase_b2(a, kv, rec0, tab, r, h0, first, pos, c_lo, nkb, e0, cs, uin, v_off, d_err);
        return;
    }
    // warp w: dims 32 w .. 32 w + 31 over every key block in order
    if (warp >= TCS_PBW || 32 * warp >= dvp)
        return;
    unsigned char *const ring = tcs_sh + TCS_TAB * 4 + warp * TCS_RING * TCS_SLOT;
    const uint16_t *const vbase = (const uint16_t *)kv.base + v_off + 32 * warp;
    // block jb's score record (this thread's own pieces) and value columns (keys lane and
    // lane + 32: zeros outside [first, pos], past dv, or for a missing table entry) into slot sl
    auto issue = [&](int jb, int sl) {
        unsigned char *p = ring + sl * TCS_SLOT;
        const float *src = rec0 + (int64_t)jb * TCS_REC;
#pragma unroll
        for (int jn = 0; jn < TC_KEYS / 8; jn++)
            tc_cp16(p + (jn * 32 + lane) * 16, src + (jn * 32 + lane) * 4);
        tcs_vcopy((uint16_t *)(p + TCS_REC * 4), kv, vbase, tab, e0, c_lo, jb, first, pos, dv, warp,
                  lane, d_err);
        tc_commit();
    };
#pragma unroll
    for (int b = 0; b < TCS_RING - 1; b++) {
        if (b < nkb)
            issue(b, b);
        else
            tc_commit();
    }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    // tc_block's softmax step on the masked scores in slot sl: row max over the row's 4
    // threads, m, alpha (*ax), p as the P fragments (px), l
    auto soft = [&](int sl, uint32_t (&px)[TC_KEYS / 16][4], float (&ax)[2]) {
        const unsigned char *p = ring + sl * TCS_SLOT;
        float s[TC_KEYS / 8][4];
#pragma unroll
        for (int jn = 0; jn < TC_KEYS / 8; jn++) {
            const float4 x = *(const float4 *)(p + (jn * 32 + lane) * 16);
            s[jn][0] = x.x, s[jn][1] = x.y, s[jn][2] = x.z, s[jn][3] = x.w;
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int jn = 0; jn < TC_KEYS / 8; jn++)
                mx[i] = fmaxf(mx[i], fmaxf(s[jn][2 * i], s[jn][2 * i + 1]));
        tc_softmax(s, mx, cs, m, l, px, ax);
    };
    // out = out * alpha, then P V of the warp's four n-tiles from slot sl's value columns
    const int mt = lane >> 3;
    const int voff = ((mt & 1) * 8 + (lane & 7)) * TCS_LDV + (mt >> 1) * 8;
    auto pv = [&](int sl, const uint32_t (&px)[TC_KEYS / 16][4], const float (&ax)[2]) {
        tcs_pv(acc, (const uint16_t *)(ring + sl * TCS_SLOT + TCS_REC * 4) + voff, px, ax[0],
               ax[1]);
    };
    // software pipelined: iteration jb runs block jb's P V (the out chain) and block jb + 1's
    // softmax (independent of out) in one stretch of code
    uint32_t pa[TC_KEYS / 16][4];
    float al[2];
    tc_wait<TCS_RING - 2>(); // this thread's copies of block 0 landed
    __syncwarp();            // every lane's
    soft(0, pa, al);
    for (int jb = 0; jb + 1 < nkb; jb++) {
        __syncwarp(); // every lane done with block jb - 1's slot
        const int nx = jb + TCS_RING - 1;
        if (nx < nkb)
            issue(nx, nx % TCS_RING); // into block jb - 1's slot
        else
            tc_commit(); // an empty group: the count of newer groups stays TCS_RING - 2
        tc_wait<TCS_RING - 2>(); // this thread's copies of block jb + 1 landed
        __syncwarp();            // every lane's
        uint32_t pn[TC_KEYS / 16][4];
        float an[2];
        soft((jb + 1) % TCS_RING, pn, an);
        pv(jb % TCS_RING, pa, al);
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                pa[kk][e] = pn[kk][e];
        al[0] = an[0], al[1] = an[1];
    }
    pv((nkb - 1) % TCS_RING, pa, al);
    // l over the row's 4 threads (attention_tcd_kernel's butterfly), then this warp's dims
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] = tc_quad_sum(l[i]);
    }
    tcs_store(a, r, h0, dv, uin, acc, l, warp, g, tq);
}

// dynamic shared memory: tcd_block's key buffers, phase A's 8 warps' K rows, or phase B's
// table and rings (the largest)
static size_t tcs_shmem(int dk, int dv) {
    const int dkp = (dk + 15) & ~15, dvp = (dv + 15) & ~15;
    const size_t sh = tcd_shmem(dk, dv, 1, TCS_SHORT_NB);
    const size_t pa = (size_t)TCS_WARPS * TC_KEYS * (dkp + 8) * 2;
    const size_t pb = (size_t)TCS_TAB * 4 + (size_t)((dvp + 31) / 32) * TCS_RING * TCS_SLOT;
    const size_t pb2 = (size_t)TCS_TAB * 4 + (size_t)TCS_PR * TCS_REC * 4 +
                       (size_t)TCS_PS * TCS_PSLOT + 64 * 4 +
                       (size_t)((dvp + 31) / 32) * TCS_VR * TCS_VSLOT;
    const size_t pb3 = (size_t)TCS_TAB * 4 + (size_t)((dvp + 31) / 32) * TCS_VR3 * TCS_SLOT3;
    const size_t x = sh > pa ? sh : pa, y0 = pb > pb2 ? pb : pb2, y = y0 > pb3 ? y0 : pb3;
    return x > y ? x : y;
}

// The workspace of one (device, stream): score records and counters (see the head).
struct tcs_ws {
    int dev;
    void *stream;
    float *rec;    // device: records
    size_t rec_n;  // floats
    unsigned *cnt; // device: counters, 0 between calls
    size_t cnt_n;
};
#define TCS_WS_MAX 16
static struct tcs_ws g_tcs_ws[TCS_WS_MAX];
static int g_tcs_ws_n;
static pthread_mutex_t g_tcs_mu = PTHREAD_MUTEX_INITIALIZER;

// *rec, *cnt: a workspace of at least rec_n floats and cnt_n counters for stream st on the
// current device, made (for want_rec, want_cnt) when the stream is not capturing; NULL when
// there is none (capturing, no memory, or the table is full): the caller falls back.
static mm_err tcs_workspace(cudaStream_t st, size_t rec_n, size_t cnt_n, size_t want_rec,
                            size_t want_cnt, float **rec, unsigned **cnt) {
    *rec = NULL, *cnt = NULL;
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    pthread_mutex_lock(&g_tcs_mu);
    struct tcs_ws *w = NULL;
    for (int i = 0; i < g_tcs_ws_n; i++)
        if (g_tcs_ws[i].dev == dev && g_tcs_ws[i].stream == (void *)st)
            w = &g_tcs_ws[i];
    if (w != NULL && w->rec_n >= rec_n && w->cnt_n >= cnt_n) {
        *rec = w->rec, *cnt = w->cnt;
        pthread_mutex_unlock(&g_tcs_mu);
        return MM_OK;
    }
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cap) != cudaSuccess) {
        (void)cudaGetLastError();
        cap = cudaStreamCaptureStatusActive;
    }
    if (cap != cudaStreamCaptureStatusNone || (w == NULL && g_tcs_ws_n == TCS_WS_MAX)) {
        pthread_mutex_unlock(&g_tcs_mu);
        return MM_OK;
    }
    float *nr = NULL;
    unsigned *nc = NULL;
    if (cudaMalloc((void **)&nr, want_rec * 4) != cudaSuccess ||
        cudaMalloc((void **)&nc, want_cnt * 4) != cudaSuccess ||
        cudaMemsetAsync(nc, 0, want_cnt * 4, st) != cudaSuccess) {
        (void)cudaGetLastError(); // no memory: the caller falls back
        if (nr != NULL)
            (void)cudaFree(nr);
        if (nc != NULL)
            (void)cudaFree(nc);
        pthread_mutex_unlock(&g_tcs_mu);
        return MM_OK;
    }
    if (w == NULL)
        w = &g_tcs_ws[g_tcs_ws_n++];
    // the smaller buffers stay allocated: a recorded graph may name them
    *w = (struct tcs_ws){dev, (void *)st, nr, want_rec, nc, want_cnt};
    *rec = nr, *cnt = nc;
    pthread_mutex_unlock(&g_tcs_mu);
    return MM_OK;
}

template <int DKM, int DVM, int PB>
static mm_err tcs_launch(void *stream, const struct mm_attn_args *a, int gsub, int max_kb,
                         int min_kb, float *rec, unsigned *cnt, int *d_err) {
    static uint64_t attr_set; // tc_allow_shmem's: this kernel's devices
    const mm_err rv = tc_allow_shmem(attention_tcs_kernel<DKM, DVM, PB>, &attr_set,
                                     tcs_shmem(DKM, DVM));
    if (rv != MM_OK)
        return rv;
    const int group = a->n_heads / a->kv.n_kv_heads;
    const int tiles = a->kv.n_kv_heads * (group / gsub);
    const int gx = min((max_kb + TCS_WARPS - 1) / TCS_WARPS, TCS_MAX_CTAS);
    dim3 grid((unsigned)gx, (unsigned)tiles, (unsigned)a->n_rows);
    MM_GPU_CHECK(mm_launch_dep(attention_tcs_kernel<DKM, DVM, PB>, grid, dim3(TCD_THREADS),
                               tcs_shmem(a->kv.head_dim_k, a->kv.head_dim_v), (cudaStream_t)stream,
                               *a, gsub, max_kb, min_kb, rec, cnt, d_err));
    MM_GPU_CHECK(cudaGetLastError());
    if (PB == 3) {
        static uint64_t attr_pv;
        const size_t sh = tcs_pv_shmem(max_kb); // (at most TCS_PV_SHMEM_MAX: the caller's check)
        // the allowance is set once per device: the most any call may ask (its caches differ)
        MM_TRY(tc_allow_shmem(attention_tcs_pv_kernel, &attr_pv, TCS_PV_SHMEM_MAX));
        const int dvp = (a->kv.head_dim_v + 15) & ~15;
        dim3 g2((unsigned)((dvp + 31) / 32), (unsigned)tiles, (unsigned)a->n_rows);
        MM_GPU_CHECK(mm_launch_dep(attention_tcs_pv_kernel, g2, dim3(32 * (TCS4_NP + 1)), sh,
                                   (cudaStream_t)stream, *a, gsub, max_kb, min_kb, rec));
        MM_GPU_CHECK(cudaGetLastError());
    }
    return MM_OK;
}
#else
#define TCS_HAVE 0
#endif

// 0 off, 1 on, 2 auto: the calls whose caller marks them long_ctx (mm_attn_args; common/model.c
// sets it when some row's position is at least MM_ATT_LONG_POS, and keys its recorded steps by
// it) (MM_GPU_ATT_SPLITK; unset or other values: TCS_DEFAULT)
static int tcs_mode(void) {
    if (g_tcs < 0) {
        g_tcs = tc_env_is("MM_GPU_ATT_SPLITK", "0")   ? 0
                : tc_env_is("MM_GPU_ATT_SPLITK", "1") ? 1
                : tc_env_is("MM_GPU_ATT_SPLITK", "2") ? 2
                                                      : TCS_DEFAULT;
    }
    return g_tcs;
}

// rows of at most this many 64-key blocks take tcd_block (MM_GPU_ATT_SPLITK_MIN, 0..1000000;
// unset or other values: TCS_MIN_DEFAULT)
static int tcs_min(void) {
    if (g_tcs_min < 0) {
        const char *e = getenv("MM_GPU_ATT_SPLITK_MIN");
        char *end = NULL;
        const long v = e != NULL ? strtol(e, &end, 10) : -1;
        g_tcs_min = e != NULL && end != e && *end == '\0' && v >= 0 && v <= 1000000
                        ? (int)v
                        : TCS_MIN_DEFAULT;
    }
    return g_tcs_min;
}

// mm_gpu_set_attention_splitk: 1 decode calls of a bf16 cache (at most TCS_MAX_ROWS rows) on
// attention_tcs_kernel, 2 those marked long_ctx, 0 none, < 0 back to MM_GPU_ATT_SPLITK (read at
// the next call). Same bits. Process-wide.
extern "C" void mm_gpu_set_attention_splitk(int mode);
extern "C" void mm_gpu_set_attention_splitk(int mode) {
    g_tcs = mode < 0 ? -1 : mode >= 2 ? 2 : mode != 0;
}

// mm_gpu_set_attention_splitk_min: rows of at most n key blocks take tcd_block inside
// attention_tcs_kernel (0: none); n < 0: back to MM_GPU_ATT_SPLITK_MIN. Same bits.
// Process-wide.
extern "C" void mm_gpu_set_attention_splitk_min(int n);
extern "C" void mm_gpu_set_attention_splitk_min(int n) { g_tcs_min = n < 0 ? -1 : n; }

// mm_gpu_set_attention_splitk_pb: phase B of the split kernel in a second kernel, one block per
// 32 value dims (3), with every block's softmax at once before the value warps' chain (2), a
// softmax warp feeding the value warps (1), or every value warp running the softmax itself
// (0); < 0: back to MM_GPU_ATT_SPLITK_PB (default TCS_PB_DEFAULT). Same bits. Process-wide.
extern "C" void mm_gpu_set_attention_splitk_pb(int mode);
extern "C" void mm_gpu_set_attention_splitk_pb(int mode) {
    g_tcs_pb = mode < 0 ? -1 : mode > 3 ? TCS_PB_DEFAULT : mode;
}

// mm_gpu_attention_tcs: runs a decode call of the contract split over the key blocks and sets
// *done when on and it takes a (bf16 cache, at most TCS_MAX_ROWS rows, at most TCS_TAB cache
// blocks per sequence, a workspace to hand); *done 0 otherwise. mm_gpu_attention_tcd calls it
// after its own shape checks (head dims <= 128, multiples of 4; attention_tc.cu's bf16 shape:
// multiples of 8, 16-byte-aligned slots); gsub: its heads per block.
extern "C" mm_err mm_gpu_attention_tcs(void *stream, const struct mm_attn_args *a, int gsub,
                                       int *d_err, int *done);
extern "C" mm_err mm_gpu_attention_tcs(void *stream, const struct mm_attn_args *a, int gsub,
                                       int *d_err, int *done) {
    *done = 0;
    const int mode = tcs_mode();
    if (mode == 0 || a == NULL || (mode == 2 && !a->long_ctx) || a->kv.dtype != MM_DTYPE_BF16 ||
        a->n_rows <= 0 ||
        a->n_rows > TCS_MAX_ROWS || a->kv.block_size <= 0 || a->kv.max_blocks <= 0 ||
        a->kv.max_blocks > TCS_TAB || gsub <= 0 || a->kv.n_kv_heads <= 0 ||
        a->n_heads % a->kv.n_kv_heads != 0 || (a->n_heads / a->kv.n_kv_heads) % gsub != 0)
        return MM_OK;
#if TCS_HAVE
    const int group = a->n_heads / a->kv.n_kv_heads;
    const size_t tiles = (size_t)a->kv.n_kv_heads * (size_t)(group / gsub);
    const int64_t keys = (int64_t)a->kv.max_blocks * a->kv.block_size;
    const size_t max_kb = (size_t)((keys + TC_KEYS - 1) / TC_KEYS);
    if (g_tcs_pb < 0)
        g_tcs_pb = tc_env_is("MM_GPU_ATT_SPLITK_PB", "0")   ? 0
                   : tc_env_is("MM_GPU_ATT_SPLITK_PB", "1") ? 1
                   : tc_env_is("MM_GPU_ATT_SPLITK_PB", "2") ? 2
                   : tc_env_is("MM_GPU_ATT_SPLITK_PB", "3") ? 3
                                                            : TCS_PB_DEFAULT;
    // the third form keeps the running maxima of every key block in its rings' shared memory,
    // and the value rows in its records (TCS_RS3 floats a record): else the second form
    const int dvp = (a->kv.head_dim_v + 15) & ~15;
    int pb = g_tcs_pb;
    if (pb >= 2 && (max_kb * 16 * 4 > (size_t)((dvp + 31) / 32) * TCS_VR3 * TCS_SLOT3 ||
                    tiles * max_kb * TCS_RS3 * TCS_MAX_ROWS * 4 > TCS_MAX_WS))
        pb = 1;
    if (pb == 3 && tcs_pv_shmem((int)max_kb) > TCS_PV_SHMEM_MAX)
        pb = 2;
    const size_t per_row = tiles * max_kb * (pb >= 2 ? TCS_RS3 : TCS_REC);
    if (per_row * TCS_MAX_ROWS * 4 > TCS_MAX_WS || max_kb > 0x7fffffff)
        return MM_OK;
    float *rec = NULL;
    unsigned *cnt = NULL;
    MM_TRY(tcs_workspace((cudaStream_t)stream, per_row * (size_t)a->n_rows,
                         tiles * (size_t)a->n_rows, per_row * TCS_MAX_ROWS, tiles * TCS_MAX_ROWS,
                         &rec, &cnt));
    if (rec == NULL)
        return MM_OK;
    const bool small = a->kv.head_dim_k <= 64 && a->kv.head_dim_v <= 64; // tcd's forms
    const int mk = tcs_min();
    const int M = (int)max_kb;

    const mm_err rv =
        pb == 3   ? (small ? tcs_launch<64, 64, 3>(stream, a, gsub, M, mk, rec, cnt, d_err)
                           : tcs_launch<128, 128, 3>(stream, a, gsub, M, mk, rec, cnt, d_err))
        : pb == 2 ? (small ? tcs_launch<64, 64, 2>(stream, a, gsub, M, mk, rec, cnt, d_err)
                           : tcs_launch<128, 128, 2>(stream, a, gsub, M, mk, rec, cnt, d_err))
        : pb == 1 ? (small ? tcs_launch<64, 64, 1>(stream, a, gsub, M, mk, rec, cnt, d_err)
                           : tcs_launch<128, 128, 1>(stream, a, gsub, M, mk, rec, cnt, d_err))
                  : (small ? tcs_launch<64, 64, 0>(stream, a, gsub, M, mk, rec, cnt, d_err)
                           : tcs_launch<128, 128, 0>(stream, a, gsub, M, mk, rec, cnt, d_err));
    if (rv == MM_OK)
        *done = 1;
    return rv;
#else
    (void)stream, (void)d_err;
    return MM_OK;
#endif
}

#endif // MM_GPU_ATTENTION_TCS_CUH
