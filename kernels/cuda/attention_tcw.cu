// SPDX-License-Identifier: MIT
// Prefill attention of the tensor-core contract (attention_tc.cu's head states it) on Hopper's
// warpgroup instruction (wgmma, sm_90a): attention_tcw_kernel, for prefill calls (more than
// TC_DECODE_ROWS rows) over a bf16 cache with dk = dv = 128 (MM_GPU_ATT_TCW=0 /
// mm_gpu_set_attention_tcw(0): off); every other call keeps attention_tc.cu's kernels.
//
// Layout: a block of 2 warpgroups (256 threads) takes 128 (row, head) units of one kv head
// (rows_pb rows x gsub heads, unit u = row * gsub + head, as attention_tc2_kernel), warpgroup w
// units 64 w..64 w + 63 as the wgmma M dimension (warp w4 of the warpgroup: rows 16 w4.. of it,
// so a thread's rows are those of mma.sync's m16 tile: g and g + 8). Per 64-key block:
// S = Q K^T by 8 wgmma m64n64k16 (Q and K from shared memory, K-major, 128-byte swizzle; dims in
// 16-wide steps in ascending order, from a zeroed accumulator as tc_block's mma chain), then
// tc_block's mask / max / exp2 / sum / rescale operations on the same (row, key) elements in the
// same order (a thread's accumulator of m64nN holds, per n8 chunk, the (row, column) elements of
// mma.sync m16n8's fragment), P rounded to bf16 as the register A operand of 4 wgmma
// m64n128k16 with V from shared memory (MN-major: V rows are [key][dim]), 16 keys per step in
// ascending order. Every wgmma group is waited for (wait_group 0) before its accumulators are
// touched again. If wgmma's k16 step rounds as mma.sync's (as it does for the GEMMs:
// gemm_wg.cuh), the outputs carry attention_tc2_kernel's bits (cuda_attention_tc_test).
// Key blocks are skipped per warpgroup (all its units masked) rather than per warp: a wholly
// masked block leaves a row's state unchanged (the contract), so the bits do not depend on it.
// K/V rows: cp.async by all threads (4 per key) straight into the swizzled layout, 3 buffers,
// two blocks in flight (tc_kb_pass's pipeline), a proxy fence before each block's barrier.
// Status (docs/BENCHMARKS.md "Prefill attention on wgmma"): on the H200 (10:29 UTC run) 0
// differing elements vs attention_tc2_kernel in all of cuda_attention_tc_test's "tcw" checks, and
// 546.0 vs 966.5 us per 4096-row call (4K forward 9.04 vs 10.6 ms). The wrong outputs of the
// earlier runs came from the test's block table (not a permutation), not from this kernel.
// On by default since (the 4K forward in the session's side-by-side run: docs/BENCHMARKS.md).
// Pipelined form (default; MM_GPU_ATT_TCW_PIPE=0: the loop above): per warpgroup, S of block
// j + 1 and P V of block j are issued back to back and block j + 1's softmax runs while that P V
// is on the tensor cores (tcwp_step); the next key copies are issued between the P V issue and
// the wait for S, into 4 buffers; every block of a pass is computed by both warpgroups (no
// wgmma in a branch). The Q tile's loads all go out before the first pack and the outputs are
// stored in pairs, in both forms. Same bits (cuda_attention_tc_test, every form); 415 vs 506 us
// per 4096-row call (docs/BENCHMARKS.md "Prefill attention pipelined per warpgroup").
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tc.cuh"
#include "gpu_common.cuh"
#include "kernels.h"
#include "mm_gpu.h"
#include "wgmma.cuh"

static int g_att_tcw = -1; // -1: from MM_GPU_ATT_TCW at first use (off only when "0"); 0; 1
// Diagnostic mode (tests only, set by mm_gpu_set_attention_tcw_diag, never from the environment,
// so no service can run it by mistake; 0 off): kind + 10 * blk, kind 1: the raw S = Q K^T of key block
// blk of the pass (keys 64 blk..) written to dims 0..63 of each unit's output (64..127 zero);
// kind 2: P one-hot (unit with position p takes key 64 blk + p % 64 with weight 1), the output
// is that key's V row; kind 3: kind 2 with the V descriptor's LBO and SBO swapped; kind 4: kind 2
// with P's A-fragment registers in the order {0, 2, 1, 3}. No softmax, no block skipping.
// Full attention variants: kind 5 V descriptor's offsets swapped, 6 P registers {0, 2, 1, 3},
// 7 no key blocks skipped, 8 every block's copies waited for and a barrier after each block.
static int g_att_tcw_diag = 0;
extern "C" void mm_gpu_set_attention_tcw_diag(int mode);
extern "C" void mm_gpu_set_attention_tcw_diag(int mode) { g_att_tcw_diag = mode; }

// mm_gpu_set_attention_tcw: 1 the wgmma prefill kernel for the calls it takes, 0 not, < 0 back
// to MM_GPU_ATT_TCW (default on). Process-wide.
extern "C" void mm_gpu_set_attention_tcw(int mode);
extern "C" void mm_gpu_set_attention_tcw(int mode) { g_att_tcw = mode < 0 ? -1 : mode != 0; }
// S = Q K^T with Q as wgmma's register operand (loaded once per block from the Q tile) instead of
// from shared memory: each m64n64k16 then reads only K's 2 KiB from shared memory, not Q's too
// (the S products read shared memory as fast as they compute otherwise). Same products, same
// order. g_att_tcw_qr: -1 from MM_GPU_ATT_TCW_QR at first use (off only when "0"); 0; 1.
static int g_att_tcw_qr = -1;
extern "C" void mm_gpu_set_attention_tcw_qr(int mode);
extern "C" void mm_gpu_set_attention_tcw_qr(int mode) { g_att_tcw_qr = mode < 0 ? -1 : mode != 0; }
// The key blocks software-pipelined per warpgroup (tcwp_step): block j + 1's softmax runs while
// block j's P V is on the tensor cores, four key buffers. Same operations per
// element, same order: 415 vs 464 us per 4096-row call on the H200 (docs/BENCHMARKS.md).
// g_att_tcw_pipe: -1 from MM_GPU_ATT_TCW_PIPE at first use (off only when "0"); 0; 1.
static int g_att_tcw_pipe = -1;
extern "C" void mm_gpu_set_attention_tcw_pipe(int mode);
extern "C" void mm_gpu_set_attention_tcw_pipe(int mode) {
    g_att_tcw_pipe = mode < 0 ? -1 : mode != 0;
}

#if MM_GPU_HAVE_WMMA
#define TCW_THREADS 256
#define TCW_UNITS 128
#define TCW_BUFS 3
#define TCW_TILE 16384 // bytes of one 64 x 128 bf16 operand tile: two 8 KiB halves of 64 dims
#define TCW_SHMEM (2 * TCW_TILE + TCW_BUFS * 2 * TCW_TILE + 1024) // + 1024-byte alignment slack
#define TCWP_BUFS 4 // the pipelined loop: blocks j .. j + 3 (j + 2, j + 3: copies in flight)
#define TCWP_SHMEM (2 * TCW_TILE + TCWP_BUFS * 2 * TCW_TILE + 1024)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// MN-major (B = V as [key][dim]), 128-byte swizzle: 64 dims per 128-byte row, the two 64-dim
// halves 8 KiB apart (leading byte offset), 8-key atoms 1024 bytes apart (stride byte offset)
__device__ __forceinline__ uint64_t tcw_desc_mn(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3ffff) >> 4) | ((uint64_t)(8192 >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// diagnostic kind 3: tcw_desc_mn with the two offsets swapped
__device__ __forceinline__ uint64_t tcw_desc_mn_swap(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3ffff) >> 4) | ((uint64_t)(1024 >> 4) << 16) |
           ((uint64_t)(8192 >> 4) << 32) | (1ull << 62);
}
// (wg_desc, wg_fence, wg_commit, wg_wait, wg_fence_regs, wgmma_m64n64k16: wgmma.cuh)
__device__ __forceinline__ void tcw_pin_a(uint32_t (&a)[4][4]) {
#pragma unroll
    for (int i = 0; i < 16; i++)
        asm volatile("" : "+r"(a[i >> 2][i & 3])::"memory");
}
// S (64 x 64 f32) += Q (64 x 16, registers: mma.sync's A fragment) K^T (16 x 64, shared, K-major)
__device__ __forceinline__ void tcw_qk_r(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                         int sd = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(sd));
}
__device__ __forceinline__ void tcw_pin_q(uint32_t (&a)[8][4]) {
#pragma unroll
    for (int i = 0; i < 32; i++)
        asm volatile("" : "+r"(a[i >> 2][i & 3])::"memory");
}
// O (64 x 128 f32) += P (64 x 16, registers: mma.sync's A fragment) V (16 x 128, shared, MN-major)
__device__ __forceinline__ void tcw_pv(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// Byte offset of 16-byte piece p (dims 8 p..8 p + 7, p < 16) of row r (< 64) in a 64 x 128
// operand tile: half p / 8, the 128-byte swizzle inside it (piece p % 8 at (p % 8) ^ (r % 8)).
__device__ __forceinline__ uint32_t tcw_off(int r, int p) {
    return (uint32_t)((p >> 3) * 8192 + r * 128 + (((p & 7) ^ (r & 7)) << 4));
}

// tc_block's mask, max, exp2 and sum steps on the 64-key block at c0 of S (s[4 j + e]:
// tc_block's s[j][e], keys c0 + 8 j + 2 tq + (e & 1), rows g (e < 2), g + 8): masked elements
// of s become -inf (tc_mask_max), m moves on (tc_max_step: al, ms), P is packed as wgmma's A
// fragments (pa) and ps gets this thread's p sums per row (tc_p). Shared by tcw_block and the
// pipelined loop (tcwp_step).
__device__ __forceinline__ void tcw_soft(float (&s)[32], int32_t c0, const int32_t (&first)[2],
                                         const int32_t (&pos)[2], float cs, float (&m)[2],
                                         float (&al)[2], uint32_t (&pa)[TC_KEYS / 16][4],
                                         float (&ps)[2]) {
    const int tq = threadIdx.x & 3;
    float(&sj)[TC_KEYS / 8][4] = *reinterpret_cast<float(*)[TC_KEYS / 8][4]>(&s); // s[j][e]
    float mx[2], ms[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        mx[i] = tc_mask_max(sj, i, c0, first[i], pos[i], tq);
        tc_max_step(mx[i], cs, m[i], al[i], ms[i]);
    }
    tc_p(sj, cs, ms, pa, ps);
}

// l and O rescaled by alpha, then l += the block's p sums (tc_block's operations)
__device__ __forceinline__ void tcw_rescale(float (&acc)[64], float (&l)[2], const float (&al)[2],
                                            const float (&ps)[2]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
        l[i] = __fmaf_rn(l[i], al[i], ps[i]);
#pragma unroll
    for (int n = 0; n < 16; n++) {
        acc[4 * n + 0] = __fmul_rn(acc[4 * n + 0], al[0]);
        acc[4 * n + 1] = __fmul_rn(acc[4 * n + 1], al[0]);
        acc[4 * n + 2] = __fmul_rn(acc[4 * n + 2], al[1]);
        acc[4 * n + 3] = __fmul_rn(acc[4 * n + 3], al[1]);
    }
}

// One 64-key block for the warpgroup's 64 units: tc_block's operations (same elements, same
// order) with S and P V on wgmma. qd: the warpgroup's Q tile; kb: the block's K tile (V at
// + TCW_TILE), shared addresses.
template <bool DIAG, bool QR>
__device__ __forceinline__ void tcw_block(uint32_t qa, uint32_t (&qr)[8][4], uint32_t kb, int32_t c0,
                                          const int32_t (&first)[2], const int32_t (&pos)[2],
                                          float cs, float (&m)[2], float (&l)[2],
                                          float (&acc)[64], int kind) {
    const int tq = threadIdx.x & 3;
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; i++)
        s[i] = 0.0f;
    {
        const uint64_t qd = wg_desc(qa), kd = wg_desc(kb);
        wg_fence_regs<32>(s); // the zeros written before the fence (else nvcc sinks them past it)
        if (QR)
            tcw_pin_q(qr);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 8; ks++) { // dims 16 ks..: half ks / 4, +32 bytes per step inside it
            if (QR)
                tcw_qk_r(s, qr[ks], kd + (ks >> 2) * 512 + (ks & 3) * 2);
            else
                wgmma_m64n64k16(s, qd + (ks >> 2) * 512 + (ks & 3) * 2,
                                kd + (ks >> 2) * 512 + (ks & 3) * 2, 1);
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<32>(s);
    }
    if (DIAG && kind == 1) { // raw S into dims 0..63
#pragma unroll
        for (int i = 0; i < 64; i++)
            acc[i] = i < 32 ? s[i] : 0.0f;
        return;
    }
    if (DIAG && kind <= 4) { // one-hot P: row i takes key pos[i] % 64 of the block
        uint32_t pd[TC_KEYS / 16][4];
#pragma unroll
        for (int j = 0; j < TC_KEYS / 8; j++) {
            float pv[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                pv[e] = (8 * j + 2 * tq + (e & 1)) == (pos[e >> 1] & 63) ? 1.0f : 0.0f;
            pd[j >> 1][(j & 1) * 2 + 0] = tc_pack(pv[0], pv[1]);
            pd[j >> 1][(j & 1) * 2 + 1] = tc_pack(pv[2], pv[3]);
        }
        if (kind == 4)
#pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; kk++) {
                const uint32_t t = pd[kk][1];
                pd[kk][1] = pd[kk][2], pd[kk][2] = t;
            }
        const uint64_t vd =
            kind == 3 ? tcw_desc_mn_swap(kb + TCW_TILE) : tcw_desc_mn(kb + TCW_TILE);
        wg_fence_regs<64>(acc);
        tcw_pin_a(pd);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++)
            tcw_pv(acc, pd[kk], vd + kk * 128);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<64>(acc);
        return;
    }
    float al[2], ps[2];
    uint32_t pa[TC_KEYS / 16][4];
    tcw_soft(s, c0, first, pos, cs, m, al, pa, ps);
    tcw_rescale(acc, l, al, ps);
    if (DIAG && kind == 6)
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++) {
            const uint32_t t = pa[kk][1];
            pa[kk][1] = pa[kk][2], pa[kk][2] = t;
        }
    {
        const uint64_t vd = DIAG && kind == 5 ? tcw_desc_mn_swap(kb + TCW_TILE)
                                              : tcw_desc_mn(kb + TCW_TILE);
        wg_fence_regs<64>(acc); // the rescaled O and P written before the fence
        tcw_pin_a(pa);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TC_KEYS / 16; kk++) // keys 16 kk..: two 8-key atoms, 2048 bytes
            tcw_pv(acc, pa[kk], vd + kk * 128);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<64>(acc);
    }
}

// S of the 64-key block at kb into s: 8 wgmma m64n64k16 (Q from the tile at qa, or from qr),
// the first with scale-d 0 (the accumulator's old values ignored: no zeroing write, which would
// have to wait for wgmmas in flight), then the group's commit. Dims in ascending 16-wide steps as
// tcw_block's chain; the only difference, D = A B instead of 0 + A B, is the sign of a zero sum,
// which no later operation tells apart (exp2 of +-0 and max with it give the same values).
template <bool QR>
__device__ __forceinline__ void tcwp_s(uint32_t qa, uint32_t (&qr)[8][4], uint32_t kb,
                                       float (&s)[32]) {
    const uint64_t qd = wg_desc(qa), kd = wg_desc(kb);
    wg_fence_regs<32>(s);
    if (QR)
        tcw_pin_q(qr);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ks++) {
        if (QR)
            tcw_qk_r(s, qr[ks], kd + (ks >> 2) * 512 + (ks & 3) * 2, ks != 0);
        else
            wgmma_m64n64k16(s, qd + (ks >> 2) * 512 + (ks & 3) * 2,
                            kd + (ks >> 2) * 512 + (ks & 3) * 2, ks != 0);
    }
}

// O and l rescaled by the block's alphas (no wgmma in flight on O), then P V of the block at
// kb (its V tile at kb + TCW_TILE) issued as one wgmma group: tcwp_step's and tcwp_last's.
__device__ __forceinline__ void tcwp_pv(uint32_t kb, float (&l)[2], float (&acc)[64],
                                        const float (&al)[2], const float (&ps)[2],
                                        uint32_t (&pa)[TC_KEYS / 16][4]) {
    tcw_rescale(acc, l, al, ps);
    const uint64_t vd = tcw_desc_mn(kb + TCW_TILE);
    wg_fence_regs<64>(acc);
    tcw_pin_a(pa);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / 16; kk++)
        tcw_pv(acc, pa[kk], vd + kk * 128);
    wg_commit();
}

// One step of the pipelined loop (MM_GPU_ATT_TCW_PIPE), for the block at c0 (buffer kb) whose
// softmax ran a step ago (P in pa, alpha and the p sums in al, ps) and the next block (buffer kn,
// at c0 + 64): S of the next block is issued into s, O and l are rescaled (no wgmma in flight),
// P V of this block is issued, and the next block's softmax (its P into pn, the m, al, ps it
// moves on) runs while that P V is on the tensor cores (wait_group 1: the older group, S, done).
// copies() issues the key copies of a later block between the P V issue and that wait.
// Each element sees tcw_block's operations in its order. Nothing in it is conditional (a wgmma
// in flight across a branch makes ptxas serialise them): every block of the pass is computed for
// both warpgroups, where tcw_block skips a block that masks all of a warpgroup's units; such a
// block leaves the state as it was (al 1, p 0, l + 0, O + 0 V).
template <bool QR, class CopyF>
__device__ __forceinline__ void tcwp_step(CopyF copies, uint32_t qa, uint32_t (&qr)[8][4], uint32_t kb,
                                          uint32_t kn, int32_t c0, const int32_t (&first)[2],
                                          const int32_t (&pos)[2], float cs, float (&m)[2],
                                          float (&l)[2], float (&acc)[64], float (&s)[32],
                                          float (&al)[2], float (&ps)[2],
                                          uint32_t (&pa)[TC_KEYS / 16][4],
                                          uint32_t (&pn)[TC_KEYS / 16][4]) {
    tcwp_s<QR>(qa, qr, kn, s);
    wg_commit();
    tcwp_pv(kb, l, acc, al, ps, pa);
    copies(); // the key copies of a later block, issued while both groups run
    wg_wait<1>();
    wg_fence_regs<32>(s);
    tcw_soft(s, c0 + TC_KEYS, first, pos, cs, m, al, pn, ps);
    wg_wait<0>();
    wg_fence_regs<64>(acc);
}

// The last block of a pass (buffer kb, its softmax done: pa, al, ps): O and l rescaled, P V.
__device__ __forceinline__ void tcwp_last(uint32_t kb, float (&l)[2], float (&acc)[64],
                                          const float (&al)[2], const float (&ps)[2],
                                          uint32_t (&pa)[TC_KEYS / 16][4]) {
    tcwp_pv(kb, l, acc, al, ps, pa);
    wg_wait<0>();
    wg_fence_regs<64>(acc);
}
#endif // __CUDA_ARCH_FEAT_SM90_ALL

template <bool DIAG, bool QR, bool PIPE>
__global__ void __launch_bounds__(TCW_THREADS, 1)
    attention_tcw_kernel(struct mm_attn_args a, int gsub, int rows_pb, int *d_err, int diag) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TPK = TCW_THREADS / TC_KEYS; // threads per key of the copies
    mm_dep_signal();
    mm_dep_wait();
    extern __shared__ __align__(1024) unsigned char tcw_raw[];
    __shared__ int32_t r_seq[TCW_UNITS], r_pos[TCW_UNITS], r_first[TCW_UNITS];
    __shared__ int r_state[TCW_UNITS]; // 0 done or invalid, 1 to do, 2 in this pass
    __shared__ int32_t seg[4];         // seq, c_lo, t_lo, t_hi
    __shared__ int32_t wrange[TCW_THREADS / 32][2];
    const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(tcw_raw);
    const uint32_t sbase = (sraw + 1023u) & ~1023u; // Q tiles (warpgroup w at w * TCW_TILE)
    unsigned char *gbase = tcw_raw + (sbase - sraw);
    const uint32_t kvs = sbase + 2 * TCW_TILE; // buffer b: K at kvs + 2 b TCW_TILE, V + TCW_TILE
    const struct mm_kv_view &kv = a.kv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int wg = warp >> 2;
    const int skey = tid / TPK, part = tid % TPK;
    const int group = a.n_heads / kv.n_kv_heads, per_kv = group / gsub;
    const int kvh = blockIdx.y / per_kv, h0 = kvh * group + (blockIdx.y % per_kv) * gsub;
    const int64_t r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * rows_pb; // heavy tiles first
    const int n_units = rows_pb * gsub;
    const int64_t k_off = (int64_t)kvh * 128, v_off = (int64_t)kv.n_kv_heads * 128 + kvh * 128;
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
    // q as bf16 (tc_pack of the pairs tc_block's qf holds; zeros for units without a row) into
    // the warpgroups' swizzled tiles; visible to wgmma after the fence and barrier of the
    // first key block
    // (every load of the thread's 8 pieces issued before the first pack: one memory round trip;
    // 16-byte loads where q and its row stride allow them)
    {
        constexpr int QI = TCW_UNITS * 16 / TCW_THREADS;
        const bool qv4 = ((uintptr_t)a.q & 15) == 0 && (a.q_stride & 3) == 0;
        float4 qv[QI][2];
#pragma unroll
        for (int it = 0; it < QI; it++) {
            const int i = tid + it * TCW_THREADS, u = i >> 4, p = i & 15;
            qv[it][0] = qv[it][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (u < n_units && r0 + u / gsub < a.n_rows) {
                const float *qp =
                    a.q + (r0 + u / gsub) * a.q_stride + (int64_t)(h0 + u % gsub) * 128 + 8 * p;
                if (qv4) {
                    qv[it][0] = *(const float4 *)qp;
                    qv[it][1] = *(const float4 *)(qp + 4);
                } else {
                    qv[it][0] = make_float4(qp[0], qp[1], qp[2], qp[3]);
                    qv[it][1] = make_float4(qp[4], qp[5], qp[6], qp[7]);
                }
            }
        }
#pragma unroll
        for (int it = 0; it < QI; it++) {
            const int i = tid + it * TCW_THREADS, u = i >> 4, p = i & 15;
            const float4 lo = qv[it][0], hi = qv[it][1];
            *(uint4 *)(gbase + (u >> 6) * TCW_TILE + tcw_off(u & 63, p)) =
                make_uint4(tc_pack(lo.x, lo.y), tc_pack(lo.z, lo.w), tc_pack(hi.x, hi.y),
                           tc_pack(hi.z, hi.w));
        }
    }
    // this thread's units: rows g and g + 8 of its warp's 16 in its warpgroup's 64
    auto unit = [&](int i) { return warp * 16 + g + 8 * i; };
    // QR: the thread's Q fragments (mma.sync's A fragment of dims 16 ks.. for rows g, g + 8 of
    // its warp's 16), read once from the tile written above; the units keep them for every pass
    uint32_t qr[8][4];
    if (QR) {
        __syncthreads();
        const unsigned char *qt = gbase + wg * TCW_TILE;
        const int qrow = (warp & 3) * 16 + g;
#pragma unroll
        for (int ks = 0; ks < 8; ks++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                qr[ks][j] = *(const uint32_t *)(qt + tcw_off(qrow + 8 * (j & 1), 2 * ks + (j >> 1)) +
                                                4 * tq);
    }
    auto uin = [&](int i) { return unit(i) < n_units && r0 + unit(i) / gsub < a.n_rows; };
    const float cs = a.scale * 1.4426950408889634f;
    // key block b's copies of key skey (blk, r from tc_blk_kb), 4 of its 16 pieces of K and V
    auto issue = [&](int32_t blk, int32_t r, int b) {
        unsigned char *kt = gbase + 2 * TCW_TILE + b * 2 * TCW_TILE;
        if (blk >= 0) {
            const uint16_t *slot = (const uint16_t *)kv.base + (int64_t)blk * kv.block_stride +
                                   (int64_t)r * kv.slot_stride;
#pragma unroll
            for (int j = 0; j < 16 / TPK; j++) {
                const int p = part + TPK * j;
                const uint32_t o = tcw_off(skey, p);
                tc_cp16(kt + o, slot + k_off + 8 * p);
                tc_cp16(kt + TCW_TILE + o, slot + v_off + 8 * p);
            }
        } else {
            if (blk != TC_NO_KEY)
                tc_flag(d_err);
#pragma unroll
            for (int j = 0; j < 16 / TPK; j++) {
                const uint32_t o = tcw_off(skey, part + TPK * j);
                *(uint4 *)(kt + o) = make_uint4(0u, 0u, 0u, 0u);
                *(uint4 *)(kt + TCW_TILE + o) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        tc_commit();
    };
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
            const int ur = uin(i) ? unit(i) / gsub : 0;
            on[i] = uin(i) && r_state[ur] == 2;
            pos[i] = on[i] ? r_pos[ur] : -1;
            first[i] = on[i] ? r_first[ur] : 0x7fffffff;
        }
        // the warpgroup's key range (wgmma is warpgroup-wide): blocks outside it are masked for
        // all its units and skipped
        int32_t wmax = max(pos[0], pos[1]), wmin = min(first[0], first[1]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
            wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
        }
        if (lane == 0)
            wrange[warp][0] = wmax, wrange[warp][1] = wmin;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < 4; w++) {
            wmax = max(wmax, wrange[4 * wg + w][0]);
            wmin = min(wmin, wrange[4 * wg + w][1]);
        }
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float acc[64];
#pragma unroll
        for (int i = 0; i < 64; i++)
            acc[i] = 0.0f;
        int32_t r;
        int32_t blk = tc_blk_kb(kv, sq, c_lo + skey, t_lo, t_hi, r, d_err);
        if (PIPE && !DIAG) {
            // blocks 0..2 into buffers 0..2; at step j (block c_lo + 64 j in buffer j % 4):
            // blocks <= j + 1 landed, block j + 3's copies into the buffer block j - 1 left
            // (its P V was waited for in step j - 1, before this step's barrier)
            issue(blk, r, 0);
            blk = tc_blk_kb(kv, sq, c_lo + TC_KEYS + skey, t_lo, t_hi, r, d_err);
            issue(blk, r, 1);
            blk = tc_blk_kb(kv, sq, c_lo + 2 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
            issue(blk, r, 2);
            blk = tc_blk_kb(kv, sq, c_lo + 3 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
            tc_wait<2>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            const uint32_t qa = sbase + wg * TCW_TILE;
            float s[32], al[2], ps[2];
            uint32_t pa0[TC_KEYS / 16][4], pa1[TC_KEYS / 16][4];
#pragma unroll
            for (int i = 0; i < 32; i++)
                s[i] = 0.0f;
            tcwp_s<QR>(qa, qr, kvs, s);
            wg_commit();
            wg_wait<0>();
            wg_fence_regs<32>(s);
            tcw_soft(s, c_lo, first, pos, cs, m, al, pa0, ps);
            int bi = 0;
            // step j's barrier and copies, then tcwp_step (pa: block j's P, pn: block j + 1's)
            auto step = [&](int32_t c0, uint32_t(&pa)[TC_KEYS / 16][4],
                            uint32_t(&pn)[TC_KEYS / 16][4]) {
                tc_wait<1>();
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                __syncthreads();
                auto copies = [&]() {
                    if (c0 + 3 * TC_KEYS <= t_hi) {
                        issue(blk, r, (bi + 3) & (TCWP_BUFS - 1));
                        blk = tc_blk_kb(kv, sq, c0 + 4 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
                    } else {
                        tc_commit();
                    }
                };
                const int bn = (bi + 1) & (TCWP_BUFS - 1);
                tcwp_step<QR>(copies, qa, qr, kvs + bi * 2 * TCW_TILE, kvs + bn * 2 * TCW_TILE, c0, first,
                              pos, cs, m, l, acc, s, al, ps, pa, pn);
                bi = bn;
            };
            int32_t c0 = c_lo;
            bool odd = false; // the last block's P is in pa1
            for (;;) {
                if (c0 + TC_KEYS > t_hi)
                    break;
                step(c0, pa0, pa1);
                c0 += TC_KEYS;
                if (c0 + TC_KEYS > t_hi) {
                    odd = true;
                    break;
                }
                step(c0, pa1, pa0);
                c0 += TC_KEYS;
            }
            if (odd)
                tcwp_last(kvs + bi * 2 * TCW_TILE, l, acc, al, ps, pa1);
            else
                tcwp_last(kvs + bi * 2 * TCW_TILE, l, acc, al, ps, pa0);
        } else {
        // tc_kb_pass's pipeline: block j into buffer j % 3 two blocks ahead, one barrier per
        // block; the cp.async (and zero) writes are made visible to wgmma's async proxy by each
        // writer's fence before the barrier
        issue(blk, r, 0);
        blk = tc_blk_kb(kv, sq, c_lo + TC_KEYS + skey, t_lo, t_hi, r, d_err);
        issue(blk, r, 1);
        blk = tc_blk_kb(kv, sq, c_lo + 2 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
        int bi = 0;
        for (int32_t c0 = c_lo; c0 <= t_hi; c0 += TC_KEYS) {
            tc_wait<1>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            if (c0 + 2 * TC_KEYS <= t_hi) {
                issue(blk, r, bi == 0 ? TCW_BUFS - 1 : bi - 1);
                blk = tc_blk_kb(kv, sq, c0 + 3 * TC_KEYS + skey, t_lo, t_hi, r, d_err);
            } else {
                tc_commit();
            }
            if (DIAG && diag % 10 >= 5) { // full attention, variants 5..8
                if (diag % 10 == 7 || (c0 <= wmax && c0 + TC_KEYS - 1 >= wmin))
                    tcw_block<true, false>(sbase + wg * TCW_TILE, qr, kvs + bi * 2 * TCW_TILE, c0, first, pos,
                                    cs, m, l, acc, diag % 10);
                if (diag % 10 == 8) {
                    tc_wait<0>();
                    __syncthreads();
                }
            } else if (DIAG) {
                if (c0 == c_lo + (diag / 10) * TC_KEYS)
                    tcw_block<true, false>(sbase + wg * TCW_TILE, qr, kvs + bi * 2 * TCW_TILE, c0, first, pos,
                                    cs, m, l, acc, diag % 10);
            } else if (c0 <= wmax && c0 + TC_KEYS - 1 >= wmin) {
                tcw_block<false, QR>(sbase + wg * TCW_TILE, qr, kvs + bi * 2 * TCW_TILE, c0, first, pos,
                                 cs, m, l, acc, 0);
            }
            bi = bi == TCW_BUFS - 1 ? 0 : bi + 1;
        }
        }
        if (DIAG && diag % 10 <= 4)
            l[0] = l[1] = 0.25f; // the four threads' sum below: 1
#pragma unroll
        for (int i = 0; i < 2; i++) {
            l[i] = tc_quad_sum(l[i]);
        }
        const bool ov2 = ((uintptr_t)a.out & 7) == 0 && (a.out_stride & 1) == 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!on[i])
                continue;
            const float inv = 1.0f / l[i];
            const int u = unit(i);
            float *o = a.out + (r0 + u / gsub) * a.out_stride + (int64_t)(h0 + u % gsub) * 128;
            if (ov2) { // the two adjacent outputs as one 8-byte store
#pragma unroll
                for (int n = 0; n < 16; n++)
                    *(float2 *)(o + 8 * n + 2 * tq) =
                        make_float2(__fmul_rn(acc[4 * n + 2 * i], inv),
                                    __fmul_rn(acc[4 * n + 2 * i + 1], inv));
            } else {
#pragma unroll
                for (int n = 0; n < 16; n++) {
                    const int d = 8 * n + 2 * tq;
                    o[d] = __fmul_rn(acc[4 * n + 2 * i], inv);
                    o[d + 1] = __fmul_rn(acc[4 * n + 2 * i + 1], inv);
                }
            }
        }
        __syncthreads(); // every r_state read of this pass done
        if (tid < rows_pb && r_state[tid] == 2)
            r_state[tid] = 0;
    }
    tc_wait<0>();
#else
    (void)a, (void)gsub, (void)rows_pb, (void)d_err, (void)diag;
    __trap(); // launched only on compute capability 9.0, whose sm_90a image has the body
#endif
}

#endif // MM_GPU_HAVE_WMMA

// mm_gpu_attention_tcw: runs a on attention_tcw_kernel and sets *done when the switch is on
// and a is a prefill call (more than TC_DECODE_ROWS rows) over a bf16 cache with dk = dv = 128
// on a compute capability 9.0 device; *done 0 otherwise. The caller (mm_gpu_attention_tc) has
// checked the arguments and the cache's shape (tc_kb_shape_ok).
extern "C" mm_err mm_gpu_attention_tcw(void *stream, const struct mm_attn_args *a, int *d_err,
                                       int *done);
extern "C" mm_err mm_gpu_attention_tcw(void *stream, const struct mm_attn_args *a, int *d_err,
                                       int *done) {
    *done = 0;
    if (g_att_tcw < 0)
        g_att_tcw = !tc_env_is("MM_GPU_ATT_TCW", "0");
    if (!g_att_tcw || a == NULL || a->kv.dtype != MM_DTYPE_BF16 || a->n_rows <= TC_DECODE_ROWS ||
        a->kv.head_dim_k != 128 || a->kv.head_dim_v != 128)
        return MM_OK;
#if MM_GPU_HAVE_WMMA
    if (!mm_gpu_cc90())
        return MM_OK;
    if (g_att_tcw_qr < 0)
        g_att_tcw_qr = !tc_env_is("MM_GPU_ATT_TCW_QR", "0");
    if (g_att_tcw_pipe < 0)
        g_att_tcw_pipe = !tc_env_is("MM_GPU_ATT_TCW_PIPE", "0");
    static uint64_t attr_set[5];
    const int diag = g_att_tcw_diag, qr = g_att_tcw_qr, pipe = g_att_tcw_pipe;
    const int group = a->n_heads / a->kv.n_kv_heads;
    const int gsub = tc_group_sub(group, TCW_UNITS), rows_pb = TCW_UNITS / gsub;
    dim3 grid((unsigned)((a->n_rows + rows_pb - 1) / rows_pb),
              (unsigned)(a->kv.n_kv_heads * (group / gsub)));
    // the form's kernel, its attribute flag and shared memory
    auto run = [&](auto kern, uint64_t *set, size_t shmem, int dg) -> mm_err {
        const mm_err rv = tc_allow_shmem(kern, set, shmem);
        if (rv != MM_OK)
            return rv;
        MM_GPU_CHECK(mm_launch_dep(kern, grid, dim3(TCW_THREADS), shmem, (cudaStream_t)stream,
                                   *a, gsub, rows_pb, d_err, dg));
        return MM_OK;
    };
    const mm_err rv =
        diag         ? run(attention_tcw_kernel<true, false, false>, &attr_set[0], TCW_SHMEM, diag)
        : pipe && qr ? run(attention_tcw_kernel<false, true, true>, &attr_set[1], TCWP_SHMEM, 0)
        : pipe       ? run(attention_tcw_kernel<false, false, true>, &attr_set[2], TCWP_SHMEM, 0)
        : qr         ? run(attention_tcw_kernel<false, true, false>, &attr_set[3], TCW_SHMEM, 0)
                     : run(attention_tcw_kernel<false, false, false>, &attr_set[4], TCW_SHMEM, 0);
    if (rv != MM_OK)
        return rv;
    MM_GPU_CHECK(cudaGetLastError());
    *done = 1;
    return MM_OK;
#else
    (void)stream, (void)d_err;
    return MM_OK;
#endif
}
