// SPDX-License-Identifier: MIT
// Matrix products over weights in the checkpoint's (out, in) layout: the decode GEMV (few
// rows), the tiled prefill GEMM, and their grouped forms for routed experts (all of a layer's
// rows in one launch).
//
// Design notes:
// - Exactness (kernels.h): an output's bits must not depend on n_rows or on the other rows of
//   the call. On CUDA every bf16 product goes through the same instruction, mma.sync
//   m16n8k16 (bf16 x bf16 -> f32), with x rounded to bf16, one accumulator per output, k in
//   ascending 32-wide chunks, and the same k-slot mapping in both paths: inside a chunk,
//   lane quad t feeds physical k 8t+4s..8t+4s+3 into mma step s (slots 2t,2t+1 and
//   2t+8,2t+9). The GEMV puts W in the A operand (16 outputs x 8 tokens per mma); the GEMM
//   puts x in A (16 tokens x 8 outputs). Each output element is the same sum of the same
//   products either way; tests/kernels/cuda_ops_test.c checks the bits of both paths.
// - f16/f32 weights, and every dtype on HIP (no mma there), use the FMA tiles: f32 x, one
//   fmaf chain per output in k order, the same code for every n_rows.
// - Decode (<= 8 rows per tile) runs GEMV v2 (gemv_x_kernel: x tile in shared memory, W in
//   registers) or v3 (gemv_bulk_kernel, MM_GPU_GEMV_BULK: each block's whole W by bulk copies
//   into shared memory, more bytes in flight per SM), both with GEMV v1's mma sequence.
// - A "tile" is up to TM consecutive rows of x sharing one weight matrix. Grouped products
//   find their (expert, first row) by a warp scan over the per-expert offsets inside each
//   block: no extra launch and no workspace. Grid y is an upper bound on the tile count
//   (n_rows/TM + active experts); blocks past the real count exit at once.
// - Prefill on sm_90 (H100/H200) runs on wgmma (gemm_wg.cuh): x converted once per product
//   into a stream-ordered bf16 workspace with the k slots permuted so that each k16 wgmma sums
//   the products one GEMV mma sums. Other CUDA parts, or no workspace memory, take the
//   mma.sync tiles. x is rounded to bf16 on every CUDA path. The dense default from 128 rows,
//   and grouped products with >= 128 rows per expert, run gemm_ws (gemm_wp.cuh): W permuted
//   into a workspace (kept in a bounded cache, MM_GPU_WPERM_MB), both operands
//   by bulk copies (cp.async.bulk) from a producer warpgroup; gemm_wp's variant 9 takes W by TMA.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_common.cuh"
#include "mm_gpu.h"
#if MM_GPU_HAVE_WMMA
#include <cudaTypedefs.h> // cuTensorMapEncodeTiled's type (TMA maps for gemm_wp.cuh)
#endif

// ---- tile lookup ---------------------------------------------------------------------------
struct mm_tile {
    int e;    // expert (0 for dense)
    int m0;   // first row of x / y
    int mlen; // rows in this tile, 1..TM; 0: no tile
};

// Tile `y` of a grouped product with TM-row tiles. Called by one whole warp; every lane gets
// the answer. The offsets of TF_BATCH warp-widths of experts (128 on CUDA) are loaded in one
// round before the scan, so a layer's lookup costs one memory round trip, not one per 32
// experts (the loads do not depend on each other; the early exit kept them apart).
#define TF_BATCH 4
// An int32 load, through the L2 only with CG (data another kernel may have written since this
// SM last cached it, read before griddepcontrol.wait).
template <bool CG>
__device__ __forceinline__ int32_t ld_i32(const int32_t *p) {
    return CG ? mm_ld_cg(p) : *p;
}

template <bool CG = false>
__device__ __forceinline__ mm_tile mm_tile_find(const int32_t *offs, int n_experts, int tm, int y) {
    const int lane = threadIdx.x % MM_WARP_SIZE;
    int base = 0; // tiles before this chunk of experts
    mm_tile t = {0, 0, 0};
    for (int eb = 0; eb < n_experts; eb += TF_BATCH * MM_WARP_SIZE) {
        int lo_b[TF_BATCH], hi_b[TF_BATCH];
#pragma unroll
        for (int i = 0; i < TF_BATCH; i++) {
            const int e = eb + i * MM_WARP_SIZE + lane;
            lo_b[i] = e < n_experts ? ld_i32<CG>(offs + e) : 0;
            hi_b[i] = e < n_experts ? ld_i32<CG>(offs + e + 1) : 0;
        }
#pragma unroll
        for (int i = 0; i < TF_BATCH; i++) {
            const int e0 = eb + i * MM_WARP_SIZE;
            if (e0 >= n_experts)
                break;
            const int e = e0 + lane;
            const int lo = lo_b[i], cnt = hi_b[i] - lo_b[i];
            const int nt = cnt > 0 ? (cnt + tm - 1) / tm : 0;
            int incl = nt;
#pragma unroll
            for (int d = 1; d < MM_WARP_SIZE; d <<= 1) {
                const int v = mm_shfl_up(incl, d);
                if (lane >= d)
                    incl += v;
            }
            const int excl = incl - nt;
            const int total = mm_shfl(incl, MM_WARP_SIZE - 1);
            int code = (y >= base + excl && y < base + incl) ? lane : -1;
#pragma unroll
            for (int m = MM_WARP_SIZE / 2; m > 0; m >>= 1)
                code = max(code, mm_shfl_xor(code, m));
            if (code >= 0) {
                const int j = y - base - excl;
                const int m0 = lo + j * tm, ml = min(tm, cnt - j * tm);
                t.e = mm_shfl(e, code);
                t.m0 = mm_shfl(m0, code);
                t.mlen = mm_shfl(ml, code);
                return t;
            }
            base += total;
        }
    }
    return t;
}

// The block's tile (dense or grouped) and weight matrix; false when it has none.
template <bool GROUPED, int TM>
__device__ __forceinline__ bool block_tile(const void *w0, const void *const *wg, const int32_t *offs,
                                           int n_experts, int n_rows, mm_tile *tile, const void **w) {
    __shared__ mm_tile tile_s;
    if (GROUPED) {
        if (threadIdx.x < MM_WARP_SIZE) {
            mm_tile t = mm_tile_find(offs, n_experts, TM, blockIdx.y);
            if (threadIdx.x == 0)
                tile_s = t;
        }
        __syncthreads();
        *tile = tile_s;
        if (tile->mlen == 0)
            return false;
        *w = wg[tile->e];
        return *w != NULL;
    }
    tile->e = 0;
    tile->m0 = blockIdx.y * TM;
    tile->mlen = min(TM, n_rows - tile->m0);
    *w = w0;
    return tile->mlen > 0;
}

struct mm_mat_args {
    const float *x;
    int64_t x_stride;
    const void *w0;           // dense weight
    const void *const *wg;    // grouped: per-expert weights (device array)
    const int32_t *offs;      // grouped: (n_experts + 1)
    int n_experts;
    int n_rows, n_in, n_out;
    const float *bias;        // (n_out,) or NULL
    float *y;
    int64_t y_stride;
    int vec;                  // 16-byte loads of x and w are legal
    const int32_t *x_idx;     // GEMV v2 only: row p of the product reads x row x_idx[p] (NULL: p)
    const int32_t *y_idx;     // GEMV v2 only: row p writes y row y_idx[p] (NULL: p)
    const float *x_up;        // GEMV v2 only: x is swiglu(x, x_up) (same stride and rows), or NULL
    int xcap;                 // GEMV v3 grouped: x rows staged at a time (0: 8, a whole tile)
    int pdl;                  // GEMV v3 grouped: 0 as every kernel; PDL_LATE, PDL_EARLY (below)
    const float *res;         // GEMV v2/v3 only: y row r = product + res row r (mm_gpu_matmul_res)
    int64_t res_stride;
    int wef;                  // GEMV v3: W's bulk copies evict first from the L2 (MM_GPU_W_EF)
};
// GEMV v3 grouped's programmatic-launch modes (mm_gpu_moe_ffn_rows at decode): PDL_LATE lets the
// next kernel launch only after this one's griddepcontrol.wait (so once the kernel before this
// one is complete); PDL_EARLY, for a product launched right after a PDL_LATE one whose plan
// (offsets, row indices, expert pointers) was complete before that one started, looks its tile
// up and issues its W copies before its own wait, through the L2.
#define PDL_LATE 1
#define PDL_EARLY 2

// ---- element loads -------------------------------------------------------------------------
__device__ __forceinline__ float mm_f16_to_f32_dev(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0)
            return __uint_as_float(sign);
        // subnormal: value = man * 2^-24
        const float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31)
        return __uint_as_float(sign | 0x7f800000u | (man << 13));
    return __uint_as_float(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

template <int DT>
__device__ __forceinline__ float wget(const void *w, int64_t i) {
    if (DT == MM_DTYPE_BF16)
        return mm_gpu_bf16_to_f32(((const uint16_t *)w)[i]);
    if (DT == MM_DTYPE_F16)
        return mm_f16_to_f32_dev(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

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

// 8 f32 of an x row from k, as 4 bf16 pairs (zeros past n_in).
__device__ __forceinline__ uint4 load_x8(const float *row, int k, int n_in, bool vec) {
    float v[8];
    if (vec && k + 8 <= n_in) {
        const float4 a = __ldg((const float4 *)(row + k)), b = __ldg((const float4 *)(row + k + 4));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = k + j < n_in ? row[k + j] : 0.0f;
    }
    return make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]),
                      pack_bf16(v[6], v[7]));
}

// 8 f32 of an x row from k as two float4 (zeros past n_in); converted by the caller.
__device__ __forceinline__ void load_x8f(const float *row, int k, int n_in, bool vec, float4 &lo,
                                         float4 &hi) {
    if (vec && k + 8 <= n_in) {
        lo = __ldg((const float4 *)(row + k));
        hi = __ldg((const float4 *)(row + k + 4));
    } else {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = k + j < n_in ? row[k + j] : 0.0f;
        lo = make_float4(v[0], v[1], v[2], v[3]);
        hi = make_float4(v[4], v[5], v[6], v[7]);
    }
}

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

// ---- GEMV through mma: W in A (16 outputs), x^T in B (8 tokens per group) -----------------------
// A block of 8 warps covers 8/wpt row tiles of 16 outputs; the wpt warps of a tile take its
// segments round-robin, park the partial sums in shared memory, and the block adds them in
// segment order.
#define MV_WARPS 8
#define MV_UNROLL 4 // 32-wide k chunks in flight per warp (NG = 1); two blocks per SM

// Programmatic dependent launch (sm_90): a GEMV lets the next kernel launch at once, and
// before waiting for the previous kernel it prefetches its dense weight rows into L2 (they
// do not depend on earlier kernels), so one matrix's HBM latency hides behind the previous
// kernel's tail. Everything the previous kernel may write (x, offsets) or read (y) is touched
// only after griddepcontrol.wait. mm_gpu_set_pdl(0) turns it off.
static bool g_pdl = true;
// mm_gpu_set_gemv_wpt: warps per 16-row tile of dense GEMVs capped at this (0: by segment
// count, up to 8). Fewer warps per tile = more tiles per block, fewer blocks (q/k/v: 320
// blocks at 8, more than the 264 resident at 2 per SM; 160 at 4). Same bits: each segment's
// sum is parked and the segments are added in order whichever warp ran them.
static int g_gemv_wpt = 0;

template <int NG, bool GROUPED>
__global__ void __launch_bounds__(MV_WARPS * 32, 2) gemv_mma_kernel(mm_mat_args a, int wpt) {
    __shared__ float part[SEG_MAX][16 * 8 * NG]; // [tile * S + segment][row * 8NG + token]
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    if (!GROUPED) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const int tpb = MV_WARPS / wpt;
        const int r0 = (blockIdx.x * tpb + warp / wpt) * 16;
        const int sl = seg_len(a.n_in), S = (a.n_in + sl - 1) / sl;
        if (r0 < a.n_out) {
            const uint16_t *w = (const uint16_t *)a.w0;
            const int row = min(r0 + (lane & 15), a.n_out - 1);
            for (int sg = warp % wpt; sg < S; sg += wpt) // 128-byte lines, two lanes per row
                for (int k = sg * sl + (lane >> 4) * 64; k < min(a.n_in, (sg + 1) * sl); k += 128)
                    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w + (size_t)row * a.n_in + k));
        }
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    mm_tile tile;
    const void *wv;
    if (!block_tile<GROUPED, 8 * NG>(a.w0, a.wg, a.offs, a.n_experts, a.n_rows, &tile, &wv))
        return;
    const uint16_t *w = (const uint16_t *)wv;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int tpb = MV_WARPS / wpt, tib = warp / wpt, wit = warp % wpt;
    const int sl = seg_len(a.n_in), S = (a.n_in + sl - 1) / sl;
    const int r0 = (blockIdx.x * tpb + tib) * 16;
    const uint16_t *wr0 = w + (size_t)min(r0 + g, a.n_out - 1) * a.n_in;
    const uint16_t *wr1 = w + (size_t)min(r0 + g + 8, a.n_out - 1) * a.n_in;
    const float *xr[NG];
#pragma unroll
    for (int q = 0; q < NG; q++) // token 8q+g of the tile; past mlen re-read a valid row
        xr[q] = a.x + (size_t)(tile.m0 + min(8 * q + g, tile.mlen - 1)) * a.x_stride;
    const bool vec = a.vec != 0;
    if (r0 < a.n_out) {
        for (int sg = wit; sg < S; sg += wpt) {
            const int k_end = min(a.n_in, (sg + 1) * sl);
            float acc[NG][4];
#pragma unroll
            for (int q = 0; q < NG; q++)
                acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;
            // All weight and x loads of up to U chunks are issued before the first mma: the
            // x reads (L1/L2 hits) must not serialise with the tensor-core chain.
            constexpr int U = MV_UNROLL / NG;
            for (int kc = sg * sl; kc < k_end; kc += 32 * U) {
                uint4 w0v[U], w1v[U];
                float4 xa[U][NG], xb[U][NG];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int k = kc + 32 * u + 8 * t;
                    if (kc + 32 * u < k_end) {
                        w0v[u] = load_w8(wr0, k, a.n_in, vec);
                        w1v[u] = load_w8(wr1, k, a.n_in, vec);
#pragma unroll
                        for (int q = 0; q < NG; q++)
                            load_x8f(xr[q], k, a.n_in, vec, xa[u][q], xb[u][q]);
                    }
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (kc + 32 * u >= k_end)
                        break;
#pragma unroll
                    for (int q = 0; q < NG; q++) {
                        const uint32_t A0[4] = {w0v[u].x, w1v[u].x, w0v[u].y, w1v[u].y};
                        const uint32_t B0[2] = {pack_bf16(xa[u][q].x, xa[u][q].y),
                                                pack_bf16(xa[u][q].z, xa[u][q].w)};
                        mma16816(acc[q], A0, B0);
                        const uint32_t A1[4] = {w0v[u].z, w1v[u].z, w0v[u].w, w1v[u].w};
                        const uint32_t B1[2] = {pack_bf16(xb[u][q].x, xb[u][q].y),
                                                pack_bf16(xb[u][q].z, xb[u][q].w)};
                        mma16816(acc[q], A1, B1);
                    }
                }
            }
            // acc[q][0..1]: outputs g, tokens 8q+2t, +1; acc[q][2..3]: output g+8.
            float *pp = part[tib * S + sg];
#pragma unroll
            for (int q = 0; q < NG; q++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    pp[(g + (i >> 1) * 8) * (8 * NG) + 8 * q + 2 * t + (i & 1)] = acc[q][i];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tpb * 16 * 8 * NG; i += MV_WARPS * 32) {
        const int tl = i / (16 * 8 * NG), rem = i % (16 * 8 * NG);
        const int o = (blockIdx.x * tpb + tl) * 16 + rem / (8 * NG), tok = rem % (8 * NG);
        if (o >= a.n_out || tok >= tile.mlen)
            continue;
        float v = 0.0f;
        for (int sg = 0; sg < S; sg++)
            v = v + part[tl * S + sg][rem];
        if (a.bias)
            v = v + a.bias[o];
        a.y[(size_t)(tile.m0 + tok) * a.y_stride + o] = v;
    }
}

// ---- GEMV v2 (decode, 1..8 tokens per tile): x in shared memory, whole segments in flight ------
// The same mma sequence as gemv_mma_kernel<1> (same A and B fragments, same segment split and
// order, same epilogue), so the same bits; what changes is when the loads are issued:
// - x of the tile is rounded to bf16 once per block into shared memory (row stride
//   mv2_ldx(n_in), zeros past n_in), so a lane's x fragment for a 32-chunk is one 16-byte
//   shared load at use time instead of 8 registers held from issue; the registers go to W:
//   MV2_UNROLL = 8 chunks in flight per warp, a whole 256-wide k segment in one round (was 4).
// - Dense products issue the first round of W loads *before* griddepcontrol.wait (W is never
//   written by the kernel before), so with PDL the weight fetch overlaps the previous kernel;
//   later segments are prefetched into L2 as before. Grouped products issue W right after the
//   tile lookup (one round of offset loads, mm_tile_find), before staging x.
// - Optional row indices (x_idx, y_idx): the grouped product gathers its x rows and scatters
//   its y rows itself (the copies around it in the MoE layer), bit-exact since they are copies.
// - Optional x_up: the x it reads is swiglu(x, x_up), computed while staging with the
//   expression of swiglu_kernel (ops.cu), so the down product needs no SwiGLU launch before it.
// Taken for bf16 on the GEMV path with <= 8 rows per tile (grouped) or <= MV2_DENSE_ROWS rows
// (dense, in 8-row tiles; auto_path also sends dense products of 33..64 rows here when their
// weights are small) when the x tile fits MV2_SMEM_MAX.
#define MV2_UNROLL 8
#define MV2_SMEM_MAX (96 << 10) // > 48 KiB: allowed once per device and kernel (launch)
#define MV2_DENSE_ROWS 64             // dense products up to this many rows (8-row tiles)
#define MV2_DENSE_W_MAX (20ll << 20)  // ... of at most 20 MB of weights
#define MV2_GROUPED_ROWS 1            // grouped products: up to this many rows per expert
// The two limits are measured (H200, 23:36 UTC run, per-op GPU times at batch 64): dense
// 2048x4096 (16.8 MB) 56 us in v2 vs 99 us on wgmma, 128x2048 9.4 vs 52.6, but 5120x2048
// (21 MB) 64.7 vs 56.8; grouped [gate; up] at ~4 rows per expert 307 us vs 243 in v1 (and v3,
// 2026-11-30 15:20 UTC: 334 vs 242, down 220 vs 131 with the separate ops; NOTES.md). The
// staging of the x tile is the suspect (each thread's pieces are loaded one after the
// other: one memory round trip per 8-element piece, 8 or more per thread at 8 rows).
static int g_gemv_version = 2; // mm_gpu_set_gemv_version: 1 = gemv_mma_kernel only (A/B runs)

// bf16 per shared x row: n_in rounded up to 32 (zeros past n_in), + 32 so that the rows read by
// lanes g and g + 1 in one quarter-warp fall in other banks.
__host__ __device__ __forceinline__ int mv2_ldx(int n_in) { return (n_in + 31) / 32 * 32 + 32; }

// silu(g) * u, written as swiglu_kernel (ops.cu) writes it, so both round alike (the op test
// checks the fused path against that kernel bit for bit).
__device__ __forceinline__ float mv2_swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// The tile's mlen x rows into shared memory (row stride ldx) as bf16 pairs (pack_bf16, as every
// path rounds x), zeros past n_in; row m read from x row xrow(m); with a.x_up the value is
// swiglu(x, x_up) of the same row and column. GEMV v2 and v3.
template <class RowF>
__device__ __forceinline__ void mv_stage_x(const mm_mat_args &a, uint16_t *xsm, int ldx, int mlen,
                                           bool vec, RowF xrow) {
    const int kp = (a.n_in + 31) / 32 * 32, per_row = kp / 8;
    const bool aligned_up = ((uintptr_t)a.x_up & 15) == 0;
    for (int p = threadIdx.x; p < mlen * per_row; p += MV_WARPS * 32) {
        const int m = p / per_row, k = (p % per_row) * 8;
        const int xr = xrow(m);
        float4 lo, hi;
        load_x8f(a.x + (size_t)xr * a.x_stride, k, a.n_in, vec, lo, hi);
        if (a.x_up) { // zeros past n_in stay zeros: silu(0) * 0 = +0
            float4 ul, uh;
            load_x8f(a.x_up + (size_t)xr * a.x_stride, k, a.n_in, vec && aligned_up, ul, uh);
            lo = make_float4(mv2_swiglu(lo.x, ul.x), mv2_swiglu(lo.y, ul.y),
                             mv2_swiglu(lo.z, ul.z), mv2_swiglu(lo.w, ul.w));
            hi = make_float4(mv2_swiglu(hi.x, uh.x), mv2_swiglu(hi.y, uh.y),
                             mv2_swiglu(hi.z, uh.z), mv2_swiglu(hi.w, uh.w));
        }
        *(uint4 *)&xsm[m * ldx + k] = make_uint4(pack_bf16(lo.x, lo.y), pack_bf16(lo.z, lo.w),
                                                 pack_bf16(hi.x, hi.y), pack_bf16(hi.z, hi.w));
    }
}

// The epilogue of GEMV v2 and v3: output o of token tok is 0 + the segment sums in segment order
// (part[(tile * S + segment) * 128 + row * 8 + token]) + bias, stored to y row yrow(tok).
template <class RowF>
__device__ __forceinline__ void mv_store_y(const mm_mat_args &a, const float *part, int S, int tpb,
                                           int bx, int mlen, RowF yrow) {
    for (int i = threadIdx.x; i < tpb * 16 * 8; i += MV_WARPS * 32) {
        const int tl = i / (16 * 8), rem = i % (16 * 8);
        const int o = (bx * tpb + tl) * 16 + rem / 8, tok = rem % 8;
        if (o >= a.n_out || tok >= mlen)
            continue;
        float v = 0.0f;
        for (int sg = 0; sg < S; sg++)
            v = v + part[(tl * S + sg) * (16 * 8) + rem];
        if (a.bias)
            v = v + a.bias[o];
        const int yr = yrow(tok);
        if (a.res) // the residual after the product, as axpy adds it (res + v: the same bits)
            v = a.res[(size_t)yr * a.res_stride + o] + v;
        a.y[(size_t)yr * a.y_stride + o] = v;
    }
}

// Dense products of more than 8 rows run as ty token tiles of 8 rows interleaved along grid x
// (block b: output block b / ty, token tile b % ty), so the ty blocks that read the same weight
// rows run side by side and all but the first find them in L2.
template <bool GROUPED>
__global__ void __launch_bounds__(MV_WARPS * 32, 2) gemv_x_kernel(mm_mat_args a, int wpt, int ty) {
    extern __shared__ __align__(16) uint16_t xsm[]; // tile rows x mv2_ldx(n_in) bf16
    __shared__ float part[SEG_MAX][16 * 8];          // [tile * S + segment][row * 8 + token]
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    constexpr int U = MV2_UNROLL;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int tpb = MV_WARPS / wpt, tib = warp / wpt, wit = warp % wpt;
    const int sl = seg_len(a.n_in), S = (a.n_in + sl - 1) / sl;
    const int bx = GROUPED ? (int)blockIdx.x : (int)blockIdx.x / ty;
    const int r0 = (bx * tpb + tib) * 16;
    const int ldx = mv2_ldx(a.n_in);
    const bool vec = a.vec != 0;
    uint4 w0v[U], w1v[U];
    const uint16_t *wr0 = NULL, *wr1 = NULL;
    auto load_round = [&](int kc, int k_end) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kc + 32 * u < k_end) {
                const int k = kc + 32 * u + 8 * t;
                w0v[u] = load_w8(wr0, k, a.n_in, vec);
                w1v[u] = load_w8(wr1, k, a.n_in, vec);
            }
    };
    auto set_rows = [&](const void *wv) {
        const uint16_t *w = (const uint16_t *)wv;
        wr0 = w + (size_t)min(r0 + g, a.n_out - 1) * a.n_in;
        wr1 = w + (size_t)min(r0 + g + 8, a.n_out - 1) * a.n_in;
    };
    bool have = false; // the warp's first round of W is in w0v/w1v already
    if (!GROUPED && r0 < a.n_out) {
        set_rows(a.w0);
        if (wit < S) {
            load_round(wit * sl, min(a.n_in, (wit + 1) * sl));
            have = true;
        }
        const uint16_t *w = (const uint16_t *)a.w0;
        const int row = min(r0 + (lane & 15), a.n_out - 1);
        for (int sg = wit + wpt; sg < S; sg += wpt) // later segments: into L2
            for (int k = sg * sl + (lane >> 4) * 64; k < min(a.n_in, (sg + 1) * sl); k += 128)
                asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w + (size_t)row * a.n_in + k));
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    mm_tile tile;
    const void *wv = a.w0;
    if (GROUPED) {
        if (!block_tile<GROUPED, 8>(a.w0, a.wg, a.offs, a.n_experts, a.n_rows, &tile, &wv))
            return;
    } else {
        tile.e = 0;
        tile.m0 = (int)(blockIdx.x % ty) * 8;
        tile.mlen = min(8, a.n_rows - tile.m0);
    }
    if (GROUPED && r0 < a.n_out && wit < S) {
        set_rows(wv);
        load_round(wit * sl, min(a.n_in, (wit + 1) * sl));
        have = true;
    }
    mv_stage_x(a, xsm, ldx, tile.mlen, vec,
               [&](int m) { return a.x_idx ? a.x_idx[tile.m0 + m] : tile.m0 + m; });
    __syncthreads();
    const uint16_t *xg = xsm + min(g, tile.mlen - 1) * ldx; // token g (past mlen: a valid row)
    if (r0 < a.n_out) {
        for (int sg = wit; sg < S; sg += wpt) {
            const int k_end = min(a.n_in, (sg + 1) * sl);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int kc = sg * sl; kc < k_end; kc += 32 * U) {
                if (!have)
                    load_round(kc, k_end);
                have = false;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (kc + 32 * u >= k_end)
                        break;
                    const uint4 xv = *(const uint4 *)(xg + kc + 32 * u + 8 * t);
                    const uint32_t A0[4] = {w0v[u].x, w1v[u].x, w0v[u].y, w1v[u].y};
                    const uint32_t B0[2] = {xv.x, xv.y};
                    mma16816(acc, A0, B0);
                    const uint32_t A1[4] = {w0v[u].z, w1v[u].z, w0v[u].w, w1v[u].w};
                    const uint32_t B1[2] = {xv.z, xv.w};
                    mma16816(acc, A1, B1);
                }
            }
            // acc[0..1]: outputs g, tokens 2t, 2t+1; acc[2..3]: output g+8.
            float *pp = part[tib * S + sg];
#pragma unroll
            for (int i = 0; i < 4; i++)
                pp[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)] = acc[i];
        }
    }
    __syncthreads();
    mv_store_y(a, &part[0][0], S, tpb, bx, tile.mlen,
               [&](int tok) { return a.y_idx ? a.y_idx[tile.m0 + tok] : tile.m0 + tok; });
}

// ---- GEMM through mma: x in A (16 tokens), W^T in B (8 outputs) ---------------------------------
#define MM_BM 128
#define MM_BN 128
#define MM_BK 32
#define MM_LD 40 // bf16 per shared row: 32 + 8 padding
#define MM_THREADS 256 // 8 warps: 2 (m) x 4 (n), each 64 x 32

template <bool GROUPED>
__global__ void __launch_bounds__(MM_THREADS) gemm_mma_kernel(mm_mat_args a) {
    __shared__ __align__(16) uint16_t smem[2][(MM_BM + MM_BN) * MM_LD];
    mm_tile tile;
    const void *wv;
    if (!block_tile<GROUPED, MM_BM>(a.w0, a.wg, a.offs, a.n_experts, a.n_rows, &tile, &wv))
        return;
    const uint16_t *w = (const uint16_t *)wv;
    const int n0 = blockIdx.x * MM_BN;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
    const bool vec = a.vec != 0;

    // Staging: each thread moves 2 x 8 elements of x and 2 x 8 of w per chunk (128 rows x 4
    // eight-element pieces = 512 pieces per operand over 256 threads).
    uint4 xs[2], ws[2];
    auto load = [&](int kc) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int p = threadIdx.x + i * MM_THREADS, r = p >> 2, c = (p & 3) * 8;
            xs[i] = r < tile.mlen ? load_x8(a.x + (size_t)(tile.m0 + r) * a.x_stride, kc + c, a.n_in, vec)
                                  : make_uint4(0, 0, 0, 0);
            ws[i] = n0 + r < a.n_out ? load_w8(w + (size_t)(n0 + r) * a.n_in, kc + c, a.n_in, vec)
                                     : make_uint4(0, 0, 0, 0);
        }
    };
    auto store = [&](int st) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int p = threadIdx.x + i * MM_THREADS, r = p >> 2, c = (p & 3) * 8;
            *(uint4 *)&smem[st][r * MM_LD + c] = xs[i];
            *(uint4 *)&smem[st][(MM_BM + r) * MM_LD + c] = ws[i];
        }
    };
    float acc[4][4][4], tot[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                acc[i][j][c] = tot[i][j][c] = 0.0f;
    const int sl = seg_len(a.n_in);

    load(0);
    store(0);
    __syncthreads();
    int st = 0;
    for (int kc = 0; kc < a.n_in; kc += MM_BK) {
        const bool more = kc + MM_BK < a.n_in;
        if (more)
            load(kc + MM_BK);
        const uint16_t *sx = smem[st], *sw = smem[st] + MM_BM * MM_LD;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            uint32_t A[4][4], B[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint2 lo = *(const uint2 *)&sx[(wm + 16 * i + g) * MM_LD + 8 * t + 4 * s];
                const uint2 hi = *(const uint2 *)&sx[(wm + 16 * i + g + 8) * MM_LD + 8 * t + 4 * s];
                A[i][0] = lo.x; A[i][1] = hi.x; A[i][2] = lo.y; A[i][3] = hi.y;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint2 b = *(const uint2 *)&sw[(wn + 8 * j + g) * MM_LD + 8 * t + 4 * s];
                B[j][0] = b.x; B[j][1] = b.y;
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma16816(acc[i][j], A[i], B[j]);
        }
        if (!more || (kc + MM_BK) % sl == 0) { // end of a k segment: tot += acc, acc = 0
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        tot[i][j][c] = tot[i][j][c] + acc[i][j][c];
                        acc[i][j][c] = 0.0f;
                    }
        }
        if (more)
            store(st ^ 1);
        __syncthreads();
        st ^= 1;
    }
    // tot[i][j][0..1]: token wm+16i+g, outputs wn+8j+2t, +1; [2..3]: token +8.
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wm + 16 * i + g + 8 * h;
            if (r >= tile.mlen)
                continue;
            float *yr = a.y + (size_t)(tile.m0 + r) * a.y_stride;
#pragma unroll
            for (int j = 0; j < 4; j++) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const int o = n0 + wn + 8 * j + 2 * t + c;
                    if (o < a.n_out) {
                        float v = tot[i][j][2 * h + c];
                        if (a.bias)
                            v = v + a.bias[o];
                        yr[o] = v;
                    }
                }
            }
        }
    }
}
// ---- GEMM through mma, cp.async pipeline (aligned shapes) -----------------------------------------
// The same arithmetic and k segments as gemm_mma_kernel, fed by a MA_STAGES-deep cp.async
// pipeline: x stays f32 in shared memory and is rounded to bf16 (pack_bf16) when the A
// fragments are built, w is copied as is. Block tile 64 x 128, 8 warps of 32 x 32 each: the
// segment sums double the accumulators, and this size keeps them under 128 registers so two
// blocks share an SM (ncu: one block of 64x128-per-warp tiles left the schedulers idle).
// Needs a.vec (16-byte aligned rows, n_in % 8 == 0).
#define MA_STAGES 4
#define MA_BM 64
#define MA_BN 128
#define MA_XLD 36 // floats per shared x row: 32 + 4 (16-byte aligned, conflict-free float4 reads)
#define MA_WLD 40 // bf16 per shared w row: 32 + 8
#define MA_STAGE_BYTES (MA_BM * MA_XLD * 4 + MA_BN * MA_WLD * 2)
#define MA_SMEM (MA_STAGES * MA_STAGE_BYTES)

__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0; // 0: nothing read, 16 zero bytes written
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait(void) { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <bool GROUPED>
__global__ void __launch_bounds__(MM_THREADS, 2) gemm_mma_async_kernel(mm_mat_args a) {
    extern __shared__ __align__(16) unsigned char ma_smem[];
    mm_tile tile;
    const void *wv;
    if (!block_tile<GROUPED, MA_BM>(a.w0, a.wg, a.offs, a.n_experts, a.n_rows, &tile, &wv))
        return;
    const uint16_t *w = (const uint16_t *)wv;
    const int n0 = blockIdx.x * MA_BN;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp / 4) * 32, wn = (warp % 4) * 32;
    const int n_k = (a.n_in + MM_BK - 1) / MM_BK;
    auto xs = [&](int st) { return (float *)(ma_smem + st * MA_STAGE_BYTES); };
    auto ws = [&](int st) { return (uint16_t *)(ma_smem + st * MA_STAGE_BYTES + MA_BM * MA_XLD * 4); };
    auto load = [&](int kt, int st) {
        const int kc = kt * MM_BK;
        float *sx = xs(st);
        uint16_t *sw = ws(st);
#pragma unroll
        for (int i = 0; i < 2; i++) { // x: 64 rows x 8 pieces of 4 floats
            const int p = threadIdx.x + i * MM_THREADS, r = p >> 3, c = (p & 7) * 4;
            const bool ok = r < tile.mlen && kc + c < a.n_in;
            const float *src = ok ? a.x + (size_t)(tile.m0 + r) * a.x_stride + kc + c : a.x;
            cp_async16(sx + r * MA_XLD + c, src, ok);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) { // w: 128 rows x 4 pieces of 8 bf16
            const int p = threadIdx.x + i * MM_THREADS, r = p >> 2, c = (p & 3) * 8;
            const bool ok = n0 + r < a.n_out && kc + c < a.n_in;
            const uint16_t *src = ok ? w + (size_t)(n0 + r) * a.n_in + kc + c : w;
            cp_async16(sw + r * MA_WLD + c, src, ok);
        }
    };
    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                acc[i][j][c] = tot[i][j][c] = 0.0f;
    const int sl = seg_len(a.n_in);
#pragma unroll
    for (int s0 = 0; s0 < MA_STAGES - 1; s0++) {
        if (s0 < n_k)
            load(s0, s0);
        cp_async_commit();
    }
    for (int kt = 0; kt < n_k; kt++) {
        cp_async_wait<MA_STAGES - 2>();
        __syncthreads(); // stage kt landed for everyone; stage kt-1 is free to refill
        if (kt + MA_STAGES - 1 < n_k)
            load(kt + MA_STAGES - 1, (kt + MA_STAGES - 1) % MA_STAGES);
        cp_async_commit();
        const float *sx = xs(kt % MA_STAGES);
        const uint16_t *sw = ws(kt % MA_STAGES);
#pragma unroll
        for (int s = 0; s < 2; s++) {
            uint32_t A[2][4], B[4][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float4 lo = *(const float4 *)&sx[(wm + 16 * i + g) * MA_XLD + 8 * t + 4 * s];
                const float4 hi = *(const float4 *)&sx[(wm + 16 * i + g + 8) * MA_XLD + 8 * t + 4 * s];
                A[i][0] = pack_bf16(lo.x, lo.y);
                A[i][1] = pack_bf16(hi.x, hi.y);
                A[i][2] = pack_bf16(lo.z, lo.w);
                A[i][3] = pack_bf16(hi.z, hi.w);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint2 b = *(const uint2 *)&sw[(wn + 8 * j + g) * MA_WLD + 8 * t + 4 * s];
                B[j][0] = b.x;
                B[j][1] = b.y;
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma16816(acc[i][j], A[i], B[j]);
        }
        if (kt == n_k - 1 || ((kt + 1) * MM_BK) % sl == 0) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        tot[i][j][c] = tot[i][j][c] + acc[i][j][c];
                        acc[i][j][c] = 0.0f;
                    }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wm + 16 * i + g + 8 * h;
            if (r >= tile.mlen)
                continue;
            float *yr = a.y + (size_t)(tile.m0 + r) * a.y_stride;
#pragma unroll
            for (int j = 0; j < 4; j++) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const int o = n0 + wn + 8 * j + 2 * t + c;
                    if (o < a.n_out) {
                        float v = tot[i][j][2 * h + c];
                        if (a.bias)
                            v = v + a.bias[o];
                        yr[o] = v;
                    }
                }
            }
        }
    }
}
#include "gemm_wg.cuh"
#include "gemm_wp.cuh"

// ---- GEMV v3 (decode): W by bulk copies into shared memory --------------------------------------
// GEMV v2's tiles, segments and mma sequence (so the same bits), with W taken through shared
// memory instead of registers: at the block's start (dense: before griddepcontrol.wait;
// grouped: right after the tile lookup) warp 0 asks for *all* of the block's W rows, one
// cp.async.bulk per row (n_in * 2 bytes) completing on its 16-row tile's mbarrier, so a block
// has its whole W (25-132 KB at the Qwen3-30B-A3B shapes) in flight at once, and with up to 3-5
// blocks per SM (no W registers) up to ~200 KB per SM, where v2 holds 8 KB per warp in
// registers (128 KB per SM) and walks longer rows in rounds (o_proj: 2, down: 2 for warp 0).
// A block is one 16-row tile (wpt = 8 warps over its segments; MM_GPU_GEMV_BULK_TPB=0: v2's
// tiles per block).
// Each warp then reads its A fragments from shared memory (the same 16 bytes per lane v2 loads
// from global: row g / g + 8, k 8t..8t+7 of each 32-chunk) and its B fragments from the x tile.
// W rows have stride mv2_ldx(n_in) (as x: lanes g and g + 1 of a quarter-warp in other banks);
// their k past n_in up to the 32-chunk end is zeroed, as v2's loads give zeros there; rows past
// n_out are not copied (an mma row depends only on its own A row, and those outputs are not
// stored). Grouped: warp 0 loads the expert pointers and the x and y row indices in the round of
// the offsets (mv3_tile_find), so the W copies start one L2 round trip after the block's start
// and the epilogue stores without a dependent index load. A grouped expert's W that is not
// 16-byte aligned (no bulk copy possible) is copied by the block's threads instead (same bits).
// Taken where GEMV v2 is, for n_in % 8 == 0 (rows of whole 16-byte pieces) and a 16-byte aligned
// dense W, when the block's shared memory fits MV3_SMEM_MAX (mm_gpu_set_gemv_bulk: which
// products).
#define MV3_SMEM_MAX (224 << 10) // of the 227 KiB a block may have (static: 1 KiB)

// mbarrier and bulk-copy helpers of GEMV v3 (plain sm_90: gemm_wp.cuh's are sm_90a-only).
__device__ __forceinline__ void mv3_bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mv3_bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// bytes (a multiple of 16) from global src (16-byte aligned) to shared dst, completing on bar
__device__ __forceinline__ void mv3_bulk(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// mv3_bulk with an L2 policy (mv3_evict_first's: the weights' lines go first, so that a step's
// small data read again later, activations, norms, the cache, stay in the L2)
__device__ __forceinline__ void mv3_bulk_pol(uint32_t dst, const void *src, uint32_t bytes,
                                             uint32_t bar, uint64_t pol) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1], %2, [%3], %4;\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}
__device__ __forceinline__ uint64_t mv3_evict_first(void) {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
// Waits for the phase of this parity; traps after 2^26 polls (copies that never land: a bug)
// rather than hang the stream.
__device__ __forceinline__ void mv3_bar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\n.reg .u32 n;\nmov.u32 n, 0;\n"
                 "MV3_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@p bra MV3_DONE;\n"
                 "add.u32 n, n, 1;\n"
                 "setp.lt.u32 p, n, 67108864;\n"
                 "@p bra MV3_WAIT;\n"
                 "trap;\n"
                 "MV3_DONE:\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// mm_tile_find for GEMV v3's warp 0, with the tile's weight matrix and, for lane m < 8, row m's
// x and y rows (x_idx / y_idx, or the row itself; lanes past mlen: the tile's last row). With at
// most 128 experts and 128 rows the pointers and indices are loaded before the offsets, in the
// same round, and shuffled out after the scan; beyond that they are loaded after it.
template <bool CG>
__device__ __forceinline__ mm_tile mv3_tile_find(const mm_mat_args &a, const void **w, int *xrow,
                                                 int *yrow) {
    const int lane = threadIdx.x % 32;
    const bool pe = a.n_experts <= 4 * 32, pr = a.n_rows <= 4 * 32;
    unsigned long long wp[4];
    int xi[4], yi[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int j = lane + 32 * i;
        wp[i] = pe && j < a.n_experts ? (unsigned long long)a.wg[j] : 0ull;
        xi[i] = pr && a.x_idx && j < a.n_rows ? ld_i32<CG>(a.x_idx + j) : j;
        yi[i] = pr && a.y_idx && j < a.n_rows ? ld_i32<CG>(a.y_idx + j) : j;
    }
    const mm_tile t = mm_tile_find<CG>(a.offs, a.n_experts, 8, blockIdx.y);
    if (t.mlen == 0)
        return t;
    const int p = t.m0 + min(lane, t.mlen - 1);
    unsigned long long wv = 0;
    int xr = p, yr = p;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned long long v = __shfl_sync(0xffffffffu, wp[i], t.e & 31);
        const int vx = __shfl_sync(0xffffffffu, xi[i], p & 31);
        const int vy = __shfl_sync(0xffffffffu, yi[i], p & 31);
        if (i == t.e >> 5)
            wv = v;
        if (i == p >> 5)
            xr = vx, yr = vy;
    }
    *w = pe ? (const void *)wv : a.wg[t.e];
    *xrow = pr || !a.x_idx ? xr : ld_i32<CG>(a.x_idx + p);
    *yrow = pr || !a.y_idx ? yr : ld_i32<CG>(a.y_idx + p);
    return t;
}

template <bool GROUPED, int MINB, bool PASSES>
__global__ void __launch_bounds__(MV_WARPS * 32, MINB) gemv_bulk_kernel(mm_mat_args a, int wpt, int ty) {
    // dynamic: tpb * 16 W rows, then min(cap, n_rows) x rows (both of mv2_ldx(n_in) bf16), then
    // part[tpb * S][16 * 8] f32 (gemv_bulk_xs and gemv_bulk_smem size it on the host)
    extern __shared__ __align__(16) uint16_t wsm[];
    __shared__ __align__(8) uint64_t bars[MV_WARPS]; // per 16-row tile: its W rows' copies
    __shared__ int info[3 + 2 * 8];                  // grouped: m0, mlen, bulk; x rows; y rows
    __shared__ const void *w_s;
    const bool early = GROUPED && a.pdl == PDL_EARLY;
    if (!(GROUPED && a.pdl == PDL_LATE))
        asm volatile("griddepcontrol.launch_dependents;\n" ::);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int tpb = MV_WARPS / wpt, tib = warp / wpt, wit = warp % wpt;
    const int sl = seg_len(a.n_in), S = (a.n_in + sl - 1) / sl;
    const int bx = GROUPED ? (int)blockIdx.x : (int)blockIdx.x / ty;
    const int rb = bx * tpb * 16, r0 = rb + tib * 16;
    const int nrw = min(tpb * 16, a.n_out - rb); // W rows the block copies (>= 1)
    const int ldx = mv2_ldx(a.n_in);
    const int cap = PASSES && a.xcap > 0 ? a.xcap : 8; // x rows staged per pass
    uint16_t *xsm = wsm + (size_t)tpb * 16 * ldx;
    float *part = (float *)(xsm + (size_t)min(cap, a.n_rows) * ldx);
    const uint32_t wsa = (uint32_t)__cvta_generic_to_shared(wsm);
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    if (threadIdx.x == 0) {
        for (int i = 0; i < tpb; i++)
            mv3_bar_init(bar0 + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    // warp 0: per tile lane 0's arrival expecting the tile's bytes, then a bulk copy per row
    // (lanes in parallel); not 16-byte aligned: arrivals of 0 bytes, the block copies W below
    auto issue = [&](const uint16_t *w) -> int {
        const int ok = ((uintptr_t)w & 15) == 0;
        if (lane == 0)
            for (int i = 0; i < tpb; i++)
                mv3_bar_expect(bar0 + 8 * i,
                              ok ? (uint32_t)max(0, min(16, nrw - 16 * i)) * (uint32_t)a.n_in * 2u : 0u);
        __syncwarp();
        if (ok) {
            const uint64_t pol = a.wef ? mv3_evict_first() : 0;
            for (int i = lane; i < nrw; i += 32) {
                const uint32_t dst = wsa + (uint32_t)i * (uint32_t)ldx * 2u;
                const uint16_t *src = w + (size_t)(rb + i) * a.n_in;
                if (a.wef)
                    mv3_bulk_pol(dst, src, (uint32_t)a.n_in * 2u, bar0 + 8 * (i / 16), pol);
                else
                    mv3_bulk(dst, src, (uint32_t)a.n_in * 2u, bar0 + 8 * (i / 16));
            }
        }
        return ok;
    };
    mm_tile tile;
    const uint16_t *w = (const uint16_t *)a.w0;
    int bulk = 1;
    if (!GROUPED && warp == 0)
        issue(w); // W is never written by an earlier kernel: before the wait
    if (!early)
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (GROUPED && a.pdl == PDL_LATE)
        asm volatile("griddepcontrol.launch_dependents;\n" ::);
    if (GROUPED) {
        if (warp == 0) {
            const void *wv = NULL;
            int xr = 0, yr = 0;
            const mm_tile tt = early ? mv3_tile_find<true>(a, &wv, &xr, &yr)
                                     : mv3_tile_find<false>(a, &wv, &xr, &yr);
            const int ml = wv != NULL ? tt.mlen : 0;
            const int ok = ml > 0 ? issue((const uint16_t *)wv) : 0;
            if (lane == 0)
                info[0] = tt.m0, info[1] = ml, info[2] = ok, w_s = wv;
            if (lane < 8)
                info[3 + lane] = xr, info[11 + lane] = yr;
        }
        __syncthreads();
        if (early) // the tile and its W copies are under way; x is the kernel before's output
            asm volatile("griddepcontrol.wait;\n" ::: "memory");
        tile.e = 0, tile.m0 = info[0], tile.mlen = info[1], bulk = info[2];
        w = (const uint16_t *)w_s;
        if (tile.mlen == 0)
            return; // no copies were issued
    } else {
        tile.e = 0;
        tile.m0 = (int)(blockIdx.x % ty) * 8;
        tile.mlen = min(8, a.n_rows - tile.m0);
    }
    const int kp = (a.n_in + 31) / 32 * 32, zp = kp - a.n_in; // W's zeros past n_in
    for (int p = threadIdx.x; p < tpb * 16 * zp; p += MV_WARPS * 32)
        wsm[(size_t)(p / zp) * ldx + a.n_in + p % zp] = 0;
    if (!bulk)
        for (int p = threadIdx.x; p < nrw * a.n_in; p += MV_WARPS * 32)
            wsm[(size_t)(p / a.n_in) * ldx + p % a.n_in] = w[(size_t)(rb + p / a.n_in) * a.n_in + p % a.n_in];
    // The tile's rows in passes of at most cap rows (grouped: a.xcap, so that a smaller x tile
    // leaves room for more blocks per SM; one pass where cap >= mlen): each pass stages its rows,
    // runs the whole mma sequence on them over the W the block holds and stores their outputs.
    // A token's outputs depend only on its own x row: the same bits in any number of passes.
#pragma unroll 1
    for (int s0 = 0; s0 < (PASSES ? tile.mlen : 1); s0 += cap) {
        const int ml = PASSES ? min(cap, tile.mlen - s0) : tile.mlen;
        if (s0 > 0)
            __syncthreads(); // the pass before has read part and its x rows
        mv_stage_x(a, xsm, ldx, ml, a.vec != 0, [&](int m) {
            return GROUPED ? info[3 + s0 + m] : a.x_idx ? a.x_idx[tile.m0 + m] : tile.m0 + m;
        });
        __syncthreads();
        if (r0 < a.n_out) {
            mv3_bar_wait(bar0 + 8 * tib, 0); // after the first pass: phase 0 is complete
            const uint16_t *xg = xsm + min(g, ml - 1) * ldx; // token g (past ml: a valid row)
            const uint16_t *wa = wsm + (size_t)(tib * 16 + g) * ldx, *wb = wa + 8 * ldx;
            for (int sg = wit; sg < S; sg += wpt) {
                const int k_end = min(a.n_in, (sg + 1) * sl);
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
                for (int kc = sg * sl; kc < k_end; kc += 32) {
                    const int k = kc + 8 * t;
                    const uint4 xv = *(const uint4 *)(xg + k);
                    const uint4 w0v = *(const uint4 *)(wa + k), w1v = *(const uint4 *)(wb + k);
                    const uint32_t A0[4] = {w0v.x, w1v.x, w0v.y, w1v.y};
                    const uint32_t B0[2] = {xv.x, xv.y};
                    mma16816(acc, A0, B0);
                    const uint32_t A1[4] = {w0v.z, w1v.z, w0v.w, w1v.w};
                    const uint32_t B1[2] = {xv.z, xv.w};
                    mma16816(acc, A1, B1);
                }
                // acc[0..1]: outputs g, tokens 2t, 2t+1; acc[2..3]: output g+8.
                float *pp = part + (tib * S + sg) * (16 * 8);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    pp[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)] = acc[i];
            }
        }
        __syncthreads();
        mv_store_y(a, part, S, tpb, bx, ml, [&](int tok) {
            return GROUPED ? info[11 + s0 + tok] : a.y_idx ? a.y_idx[tile.m0 + tok] : tile.m0 + tok;
        });
    }
}


// ---- dense products of 9..64 rows with the segments split over blocks --------------------------
// A batch-decode product of few output tiles (o_proj at 64 rows: 16 tiles of 128 outputs) keeps
// few SMs streaming W. gemm_seg_kernel gives each (128-output tile, token tile of up to 64 rows,
// k segment) its own block: the segment's chain of mma steps, the GEMV's operands and order
// (gemv_bulk_kernel's inner loop: W rows g and g + 8 at k = kc + 8t, two m16n8k16 steps a
// 32-wide chunk, from zero), parked as that segment's sum in a workspace [S][n_rows][n_out];
// gemm_seg_fold_kernel adds the sums in segment order, 0 + p0 + p1 + ..., then bias, then the
// residual, as mv_store_y does: the GEMV's bits. W goes from global memory straight into each
// warp's registers (every element is used by one warp), issued before the wait for the kernel
// before (W is never written by it); x's segment is staged in shared memory as bf16 (pack_bf16)
// after it.
#define SEG_WARPS 8  // a block: 8 warps of 16 outputs
#define SEG_TN 64    // tokens per block, at most
#define SEG_CH 8     // 32-wide k chunks held in registers at a time (256 of k)
template <int NT> // token groups of 8 (tokens of the tile: <= 8 NT)
__global__ void __launch_bounds__(SEG_WARPS * 32, 2) gemm_seg_kernel(mm_mat_args a, float *ws, int tn) {
    extern __shared__ __align__(16) uint16_t sxs[]; // [8 NT][sl + 8] bf16
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int sl = seg_len(a.n_in), sg = blockIdx.z;
    const int k0 = sg * sl, k1 = min(a.n_in, k0 + sl);
    const int o0 = blockIdx.x * (SEG_WARPS * 16) + warp * 16;
    const int m0 = blockIdx.y * tn, ml = min(min(tn, 8 * NT), a.n_rows - m0);
    const int ldx = sl + 8;
    const uint16_t *w = (const uint16_t *)a.w0;
    const uint16_t *wa = w + (size_t)min(o0 + g, a.n_out - 1) * a.n_in;
    const uint16_t *wb = w + (size_t)min(o0 + g + 8, a.n_out - 1) * a.n_in;
    uint4 w0[SEG_CH], w1[SEG_CH];
    auto load_w = [&](int kb) {
#pragma unroll
        for (int i = 0; i < SEG_CH; i++) {
            const int k = kb + 32 * i + 8 * t;
            if (kb + 32 * i < k1) {
                w0[i] = __ldg((const uint4 *)(wa + k));
                w1[i] = __ldg((const uint4 *)(wb + k));
            }
        }
    };
    load_w(k0);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    // x's rows m0.. of this segment as bf16 (rows past ml: zeros, never stored)
    const int per_row = (k1 - k0) / 8;
    for (int p = threadIdx.x; p < 8 * NT * per_row; p += SEG_WARPS * 32) {
        const int m = p / per_row, k = (p % per_row) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m < ml) {
            float4 lo, hi;
            load_x8f(a.x + (size_t)(m0 + m) * a.x_stride, k0 + k, a.n_in, a.vec != 0, lo, hi);
            v = make_uint4(pack_bf16(lo.x, lo.y), pack_bf16(lo.z, lo.w), pack_bf16(hi.x, hi.y),
                           pack_bf16(hi.z, hi.w));
        }
        *(uint4 *)&sxs[m * ldx + k] = v;
    }
    __syncthreads();
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int kb = k0; kb < k1; kb += 32 * SEG_CH) {
        if (kb > k0)
            load_w(kb);
#pragma unroll
        for (int i = 0; i < SEG_CH; i++) {
            if (kb + 32 * i >= k1)
                break;
            const int kx = kb - k0 + 32 * i + 8 * t;
            const uint32_t A0[4] = {w0[i].x, w1[i].x, w0[i].y, w1[i].y};
            const uint32_t A1[4] = {w0[i].z, w1[i].z, w0[i].w, w1[i].w};
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint4 xv = *(const uint4 *)&sxs[(8 * j + g) * ldx + kx];
                const uint32_t B0[2] = {xv.x, xv.y}, B1[2] = {xv.z, xv.w};
                mma16816(acc[j], A0, B0);
                mma16816(acc[j], A1, B1);
            }
        }
    }
    // acc[j][0..1]: output o0 + g, tokens 8j + 2t, + 1; acc[j][2..3]: output o0 + g + 8
    float *wsg = ws + (size_t)sg * a.n_rows * a.n_out;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int o = o0 + g + (i >> 1) * 8, tok = 8 * j + 2 * t + (i & 1);
            if (o < a.n_out && tok < ml)
                wsg[(size_t)(m0 + tok) * a.n_out + o] = acc[j][i];
        }
}

// y row r, output o = 0 + the S segment sums in order (+ bias) (res + that), as mv_store_y.
__global__ void __launch_bounds__(256) gemm_seg_fold_kernel(mm_mat_args a, const float *ws, int S) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    const int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (i >= (int64_t)a.n_rows * a.n_out)
        return;
    const int r = (int)(i / a.n_out), o = (int)(i % a.n_out);
    const size_t plane = (size_t)a.n_rows * a.n_out;
    float v = 0.0f;
    for (int sg = 0; sg < S; sg++)
        v = v + ws[(size_t)sg * plane + i];
    if (a.bias)
        v = v + a.bias[o];
    if (a.res)
        v = a.res[(size_t)r * a.res_stride + o] + v;
    a.y[(size_t)r * a.y_stride + o] = v;
}

#endif // MM_GPU_HAVE_WMMA

// ---- tiled FMA GEMM (any dtype, any vendor) ------------------------------------------------------
// 64x64 block tile, k chunks of 32 staged as f32, 256 threads with 4x4 outputs each; every
// output is one fmaf chain in k order.
#define FMA_BM 64
#define FMA_BN 64
#define FMA_BK 32
#define FMA_THREADS 256

template <int DT, bool GROUPED>
__global__ void __launch_bounds__(FMA_THREADS) gemm_fma_kernel(mm_mat_args a) {
    __shared__ float xs[FMA_BK][FMA_BM + 1];
    __shared__ float wsm[FMA_BK][FMA_BN + 1];
    mm_tile tile;
    const void *w;
    if (!block_tile<GROUPED, FMA_BM>(a.w0, a.wg, a.offs, a.n_experts, a.n_rows, &tile, &w))
        return;
    const int n0 = blockIdx.x * FMA_BN;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j] = 0.0f;
    for (int kc = 0; kc < a.n_in; kc += FMA_BK) {
        for (int p = threadIdx.x; p < FMA_BM * FMA_BK; p += FMA_THREADS) {
            const int r = p / FMA_BK, c = p % FMA_BK, k = kc + c;
            xs[c][r] = (r < tile.mlen && k < a.n_in) ? a.x[(size_t)(tile.m0 + r) * a.x_stride + k] : 0.0f;
            wsm[c][r] = (n0 + r < a.n_out && k < a.n_in) ? wget<DT>(w, (int64_t)(n0 + r) * a.n_in + k) : 0.0f;
        }
        __syncthreads();
        const int kn = min(FMA_BK, a.n_in - kc);
        for (int k = 0; k < kn; k++) {
            float xa[4], wb[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                xa[i] = xs[k][ty + 16 * i];
                wb[i] = wsm[k][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[i][j] = fmaf(xa[i], wb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = ty + 16 * i;
        if (r >= tile.mlen)
            continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int o = n0 + tx + 16 * j;
            if (o < a.n_out) {
                float v = acc[i][j];
                if (a.bias)
                    v = v + a.bias[o];
                a.y[(size_t)(tile.m0 + r) * a.y_stride + o] = v;
            }
        }
    }
}

// ---- dispatch --------------------------------------------------------------------------------
static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

#if MM_GPU_HAVE_WMMA
static int g_wg_tile = 0; // wgmma block variant (mm_gpu_set_gemm_tile); 0: per product kind

// An on/off switch read from the environment once: on unless `name` is "0". *cached: -1 not
// read yet (a setter may store 0 or 1, or -1 to read the environment again).
static bool switch_on(int *cached, const char *name) {
    if (*cached < 0) {
        const char *e = getenv(name);
        *cached = e && strcmp(e, "0") == 0 ? 0 : 1;
    }
    return *cached > 0;
}

// The wgmma kernel runs on compute capability 9.0 only (mm_gpu_cc90); MM_GPU_WGMMA=0 turns the
// path off (diagnosis; the mma.sync tiles give the same bits). Read once.
static bool wg_device_ok(void) {
    static int off = -1;
    if (off < 0) {
        const char *env = getenv("MM_GPU_WGMMA");
        off = env && strcmp(env, "0") == 0;
    }
    return !off && mm_gpu_cc90();
}

static bool wg_usable(const mm_mat_args &a) {
    const uintptr_t wa = (uintptr_t)a.w0;
    return a.n_in % 2 == 0 && (a.wg != NULL || (wa & 3u) == 0) && wg_device_ok();
}

// One wgmma variant's launch (NWG warpgroups, BN tokens, KB k per stage, ST stages, fence FN).
template <bool GROUPED, int NWG, int BN, int KB, int ST, int FN = 0>
static mm_err launch_wg_kernel(cudaStream_t st, const mm_wg_args &w, uint64_t bit) {
    static uint64_t attr_set; // > 48 KiB of dynamic shared memory, allowed once per device
    const int active = GROUPED ? min(w.n_experts, w.n_rows) : 1;
    const unsigned tiles_y = GROUPED ? (unsigned)(w.n_rows / BN + active) : mm_div_up(w.n_rows, BN);
    if (!(attr_set & bit)) {
        MM_GPU_CHECK(cudaFuncSetAttribute(gemm_wg_kernel<GROUPED, NWG, BN, KB, ST, FN>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          wg_smem_bytes(NWG, BN, KB, ST)));
        attr_set |= bit;
    }
    dim3 grid(mm_div_up(w.n_out, 64 * NWG), tiles_y);
    gemm_wg_kernel<GROUPED, NWG, BN, KB, ST, FN><<<grid, NWG * 128, wg_smem_bytes(NWG, BN, KB, ST), st>>>(w);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// The warp-specialised kernel (gemm_wp.cuh): producer warp + two consumer warpgroups, BN
// tokens, ST stages.
// WP_W_TMA: W through a TMA tensor map, encoded per call through the driver's
// cuTensorMapEncodeTiled; NULL when the driver offers none (then W comes by row copies).
// driver_entry: a driver API function through the runtime's entry points (no -lcuda), NULL
// when this driver has none (the runtime's error is cleared).
static void *driver_entry(const char *name, unsigned version) {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        return p;
    (void)cudaGetLastError();
    return NULL;
}

static PFN_cuTensorMapEncodeTiled_v12000 wp_encode_fn(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static int tried;
    if (!tried) {
        fn = (PFN_cuTensorMapEncodeTiled_v12000)driver_entry("cuTensorMapEncodeTiled", 12000);
        tried = 1;
    }
    return fn;
}

template <int BN, int ST, int WM>
static mm_err launch_wp_kernel(cudaStream_t st, const mm_wg_args &w, uint64_t bit) {
    static uint64_t attr_set;
    CUtensorMap map;
    memset(&map, 0, sizeof(map));
    if (WM == WP_W_TMA) {
        PFN_cuTensorMapEncodeTiled_v12000 enc = wp_encode_fn();
        if (enc == NULL)
            return launch_wp_kernel<BN, ST, WP_W_ROWS>(st, w, bit);
        const cuuint64_t dims[2] = {(cuuint64_t)w.n_in, (cuuint64_t)w.n_out};
        const cuuint64_t strides[1] = {(cuuint64_t)w.n_in * 2};
        const cuuint32_t box[2] = {64, 128}, estr[2] = {1, 1};
        const CUresult r = enc(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)w.w0, dims, strides,
                               box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) // same bits through the row copies
            return launch_wp_kernel<BN, ST, WP_W_ROWS>(st, w, bit);
    }
    if (!(attr_set & bit)) {
        MM_GPU_CHECK(cudaFuncSetAttribute(gemm_wp_kernel<BN, ST, WM>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          wp_smem_bytes(BN, ST)));
        attr_set |= bit;
    }
    dim3 grid(mm_div_up(w.n_out, 128), mm_div_up(w.n_rows, BN));
    gemm_wp_kernel<BN, ST, WM><<<grid, WP_THREADS, wp_smem_bytes(BN, ST), st>>>(w, map);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// AUTO's dense variant (H200, 23:28 UTC): gemm_ws persistent (14) from 4096 rows with at most
// 8192 outputs (measured faster than 13 and 4 on q_proj, o_proj, 4096^2; with the permuted-W
// cache, 16384 x 2048 is faster on 13); gemm_ws (13) from 128 rows
// with at most 4096 outputs (measured on q_proj at 128-2048 rows: 4 has too few blocks there)
// and from 1024 rows with more outputs (not measured between 1024 and 4096 rows: W is then
// reused by >= 8 token tiles, so its permutation, one pass over W, ~10 us per 16.8 MB, is
// repaid as at 4096 rows). With many outputs and few rows it would not be: 4.
static int ws_small_mode(void);
static int ws_auto_variant(const mm_mat_args &a) {
    if (a.n_rows > 8 && a.n_rows < 128 && ws_small_mode() > 0)
        return 28; // 4 where W's permuted copy is not cached (launch_wg)
    if (a.n_rows >= 4096 && a.n_out <= 8192) // 16384 x 2048 at 4096 rows: 13 faster (669 vs
        return 14;                           // 740 us, and 688 vs 699 us: H200 runs 23:48/23:54)
    if (a.n_rows >= 1024 || (a.n_rows >= 128 && a.n_out <= 4096))
        return 13;
    return 4;
}

// MM_GPU_WS_SMALL (read once; mm_gpu_set_ws_small), dense bf16 products of 9..127 rows (batch
// decode: a 64-row step's LM head and q/k/v): 0, as before: GEMV v2 (8-row tiles) for up to 64
// rows of at most MV2_DENSE_W_MAX weights, else gemm_wg 128 x 192 (4, W permuted on its way by
// 4-byte copies, 3x the tensor work of 64 rows) eagerly and the mma.sync tiles inside recorded
// graphs (x f32 from L2 in every block); 1: those that took 4 or the mma.sync tiles run
// gemm_ws persistent (28) on the cached permuted W, its tiles of <= 32 / <= 64 rows on m64n32 /
// m64n64 wgmmas (WS_OPT_TAILN), eagerly and inside graphs (x workspace: cws_get); 2 (default):
// also those GEMV v2 took, when they have at least WS_SMALL_TILES tiles of 128 outputs. Where
// W's copy is neither cached nor fits the cache's bound, as 0. The same bits in all. H200
// (14:12 and 14:20 UTC, 4-layer Qwen3-30B-A3B shape, engine decode tok/s, 0 / 1 / 2): batch 16
// 8040 / 7958 / 9296, batch 32 13390 / 13296 / 18966, batch 64 25394 / 27451 / 29630; per
// 64-row call LM head 398 -> 178 us (1), o_proj 56 -> 40 us (2), q/k/v 65 -> 24 us.
// MM_GPU_WS_SMALL_BN64 (read once; mm_gpu_set_ws_small_bn64): 1 (default) runs 28's products of
// <= 64 rows as 29, 64-token tiles with 9 stages of 24 KB (more bytes in flight per SM than 28's
// 6 stages sized for 128 tokens; H200 batch 64: 30323 / 30181 vs 29424 / 29539 tok/s, LM head
// 166 us, o_proj 37); 0 28. Same bits.
#define WS_SMALL_DEFAULT 2
#define WS_SMALL_TILES 16
static int g_ws_small = -1; // -1: not read yet
static int g_ws_bn64 = -1;  // -1: not read yet
// MM_GPU_WS_SMALL_HALF (read once; mm_gpu_set_ws_small_half): 1 (default) runs 29's products
// with fewer than WS_HALF_TILES tiles of 128 outputs as 30 (64-output tiles, each warpgroup on
// 32 of the tokens: twice the blocks; H200 14:37 UTC, batch 64: 30487 / 30673 vs 30249 / 30230
// tok/s, o_proj 37 -> 33 us, q/k/v 24 -> 22; batch 32 19266 vs 18946); 0 29. Same bits.
#define WS_HALF_TILES 132
static int g_ws_half = -1; // -1: not read yet

static bool ws_half(void) { return switch_on(&g_ws_half, "MM_GPU_WS_SMALL_HALF"); }

static bool ws_bn64(void) { return switch_on(&g_ws_bn64, "MM_GPU_WS_SMALL_BN64"); }
static unsigned long long g_ws_small_n[3]; // variants 28-30 launched (mm_gpu_ws_small_launches)

static int ws_small_mode(void) {
    if (g_ws_small < 0) {
        const char *e = getenv("MM_GPU_WS_SMALL");
        const int v = e && e[0] ? atoi(e) : WS_SMALL_DEFAULT;
        g_ws_small = v >= 0 && v <= 2 ? v : WS_SMALL_DEFAULT;
    }
    return g_ws_small;
}

// AUTO's grouped variant: gemm_ws grouped and persistent (20) when the experts hold >= 128
// rows each on average (a 4K-token prefill: ~256), so that permuting every expert's W (once,
// into the permuted-W cache, or once per product beyond its bound: one pass over the layer's
// expert weights) is repaid, and that copy stays under WS_GROUPED_W_MAX; else gemm_wg 128 x
// 128 (2), which permutes W on its way into shared memory.
// Which gemm_ws grouped variant (MM_GPU_WS_GROUPED, read once: 19-23, 25, 27; default
// WS_GROUPED_DEFAULT): 20 the earlier epilogue and full 128-token tiles, 21 y rows loaded once
// per tile (WS_OPT_IDX), 22 also m64n32 / m64n64 wgmmas for tiles of <= 32 / <= 64 rows
// (WS_OPT_TAILN), 23 also the tiles published by the producer (WS_OPT_PTILE), 25 23 with the
// outputs stored through shared memory by bulk copies (WS_OPT_STAGE; 4 stages), 27 25 for
// products of at most
// WS_STAGE_MAX_K k stages (down: 12) and 23 for longer ones ([gate; up]: 32; alone, 25 was
// faster on down and slower on a gate: not measured in the forward yet); 19 one block per tile.
// All the same bits.
// Default 25: the 4K forward (H200, kernels/cuda/bench/NOTES.md prefill version 16) 11.50 ms
// vs 11.66 with 23, 13.25 with 20 (06:59 UTC); 12.29 with 21 and 12.25 with 22 (06:47 UTC).
// (24, 23 with warpgroup 1 lagging, 11.70, and 26, 23 with 4 stages, 11.62: removed.)
#define WS_GROUPED_W_MAX (2048ull << 20)
#define WS_GROUPED_DEFAULT 25
#define WS_STAGE_MAX_K 16
static int g_ws_grouped = -1; // -1: not read yet

// the gemm_ws grouped variants (19-23, 25, 27)
static bool ws_grouped_ok(int v) { return (v >= 19 && v <= 23) || v == 25 || v == 27; }

static int ws_grouped_variant(void) {
    if (g_ws_grouped < 0) {
        const char *e = getenv("MM_GPU_WS_GROUPED");
        const int v = e ? atoi(e) : 0;
        g_ws_grouped = ws_grouped_ok(v) ? v : WS_GROUPED_DEFAULT;
    }
    return g_ws_grouped;
}

static int ws_auto_grouped(const mm_mat_args &a, int64_t ldx) {
    const int active = min(a.n_experts, a.n_rows);
    const size_t wbytes = (size_t)a.n_experts * (size_t)a.n_out * (size_t)ldx * 2;
    return a.n_rows / active >= 128 && wbytes <= WS_GROUPED_W_MAX ? ws_grouped_variant() : 2;
}

// gemm_ws (gemm_wp.cuh): W permuted into a workspace, both operands by bulk copies, BN tokens,
// ST stages, two running accumulators (DUAL) or a drain at each segment end; PERSIST: one
// block per SM walking the tiles, else one block per tile; LAG: warpgroup 1 a tile behind by
// two stages.
// GROUPED: tiles over (token tile of an expert, output tile); wb holds every expert's W.
// OPT: gemm_ws_kernel's WS_OPT_* bits.
template <int BN, int ST, bool DUAL, bool PERSIST = false, bool LAG = false, bool GROUPED = false, int OPT = 0>
static mm_err launch_ws_kernel(cudaStream_t st, const mm_wg_args &w, const uint16_t *wb, uint64_t bit) {
    static uint64_t attr_set;
    static int sms[64];
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    if (!(attr_set & bit)) {
        MM_GPU_CHECK(cudaFuncSetAttribute(gemm_ws_kernel<BN, ST, DUAL, LAG, GROUPED, OPT>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          ws_smem_bytes(BN, ST, OPT)));
        MM_GPU_CHECK(cudaDeviceGetAttribute(&sms[dev & 63], cudaDevAttrMultiProcessorCount, dev));
        attr_set |= bit;
    }
    const unsigned tiles_y = GROUPED ? (unsigned)(w.n_rows / BN + min(w.n_experts, w.n_rows))
                                     : mm_div_up(w.n_rows, BN);
    const unsigned tiles = mm_div_up(w.n_out, (OPT & WS_OPT_HALFN) ? 64 : 128) * tiles_y;
    const unsigned sm = (unsigned)(sms[dev & 63] > 0 ? sms[dev & 63] : 1);
    const unsigned grid = PERSIST && tiles > sm ? sm : tiles;
    gemm_ws_kernel<BN, ST, DUAL, LAG, GROUPED, OPT><<<grid, WS_THREADS, ws_smem_bytes(BN, ST, OPT), st>>>(w, wb);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- permuted-W cache (weights of the gemm_ws variants) ----------------------------------------
// gemm_ws reads W from a permuted copy (wg_convert_w_kernel: ~10 us per 16.8 MB, every
// product). The weights see every prefill, so their copies are kept: built on a weight's
// first gemm_ws product, keyed by (device, W, n_out, n_in), read by later products. Grouped
// products: one copy of every expert of a table, keyed by the device table of expert
// pointers (the expert pointers are read back once, at the build, to know which memory the
// copy stands for).
// Bound: MM_GPU_WPERM_MB (default 10% of the device's memory; 0: no cache); a weight whose copy
// does not fit is not cached (its products permute W per product, as before): no eviction, so
// a model larger than the bound cannot make every product rebuild. A copy is the same bytes
// the per-product workspace would hold, so cached or not the bits are the same.
// Staleness: a copy is dropped when its weight's bytes (or a grouped copy's table or any of
// its experts) may change: mm_gpu_wperm_forget from the backend's host-to-device copies (`set`
// and the grouped products' staging ring) and buffer_free, and from mm_gpu_free and
// mm_gpu_memcpy_h2d. Weights or tables written by other means (a kernel, a peer copy) must be
// forgotten by the writer. A table rewritten after its copy was built (the staging ring's
// slots) is not cached again (a short list of such tables). Thread-safe (one mutex; the
// lookup is a short list walk).
struct wperm_entry {
    int dev;
    const void *w;          // dense: W; grouped: the device table (a.wg)
    int n_out, n_in;
    int n_experts;          // 0: dense
    int ilv;                // grouped: wg_convert_w_kernel's interleaved [gate; up] rows
    uintptr_t *ex;          // grouped: the table's expert pointers (host copy, owned)
    size_t bytes;           // of the copy
    uint16_t *wb;           // owned (cudaMalloc); grouped: expert e at e * n_out * ldx
    cudaEvent_t ev;         // recorded after the copy was written, on st
    cudaStream_t st;
};
#define WP_VOLATILE 16
static const void *g_wp_vol[WP_VOLATILE]; // tables rewritten while cached: never cached again
static int g_wp_vol_next;
static pthread_mutex_t g_wp_mu = PTHREAD_MUTEX_INITIALIZER;
static wperm_entry *g_wp;
static int g_wp_n, g_wp_cap;
static size_t g_wp_used;
static long long g_wp_mb = -2; // -2: not read yet; -1: default; else MiB (mm_gpu_set_wperm_mb)
static int g_wp_count;         // entries, read without the lock for the empty fast path

// The bound in bytes for device dev (call with the lock held).
static size_t wperm_limit(int dev) {
    if (g_wp_mb == -2) {
        g_wp_mb = -1;
        const char *e = getenv("MM_GPU_WPERM_MB");
        if (e != NULL && e[0] != '\0') {
            char *end = NULL;
            const long long v = strtoll(e, &end, 10);
            if (end == e || *end != '\0' || v < 0)
                mm_log_error("gpu: MM_GPU_WPERM_MB=%s is not a number of MiB >= 0; using the "
                             "default (10%% of device memory)", e);
            else
                g_wp_mb = v;
        }
    }
    if (g_wp_mb >= 0)
        return (size_t)g_wp_mb << 20;
    static size_t total[64]; // per device, read once (lock held)
    if (total[dev & 63] == 0) {
        cudaDeviceProp pr;
        if (cudaGetDeviceProperties(&pr, dev) == cudaSuccess)
            total[dev & 63] = pr.totalGlobalMem;
        else
            (void)cudaGetLastError();
    }
    return total[dev & 63] / 10;
}

// Dropped copies move the epoch (mm_gpu_wperm_epoch): a recorded graph may point at one (the
// small products of variants 28-30 read W from the cache inside graphs), and the backend
// refuses to replay a graph recorded in an earlier epoch.
static unsigned long long g_wp_epoch;

static void wperm_drop(int i) { // lock held
    __atomic_fetch_add(&g_wp_epoch, 1ull, __ATOMIC_RELEASE);
    free(g_wp[i].ex);
    (void)cudaFree(g_wp[i].wb);
    (void)cudaEventDestroy(g_wp[i].ev);
    g_wp_used -= g_wp[i].bytes;
    g_wp[i] = g_wp[--g_wp_n];
    __atomic_store_n(&g_wp_count, g_wp_n, __ATOMIC_RELEASE);
}

// The cached permuted copy of a's W (dense: W; grouped: every expert of a.wg; ldx per row),
// building it on stream st when it is not there and fits the bound; NULL: not cached (the
// caller permutes into its workspace). ilv (grouped): the interleaved [gate; up] copy
// (WS_OPT_SWIGLU), an entry of its own beside the plain copy of the same table.
// lookup (a capturing stream): only a copy built on st itself, never a build (no allocation,
// kernel or event wait may enter a recorded graph); NULL otherwise.
static const uint16_t *wperm_get(cudaStream_t st, const mm_mat_args &a, int64_t ldx, int ilv = 0,
                                 bool lookup = false) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    const bool grouped = a.wg != NULL;
    const void *key = grouped ? (const void *)a.wg : a.w0;
    const int ne = grouped ? a.n_experts : 0;
    pthread_mutex_lock(&g_wp_mu);
    const uint16_t *out = NULL;
    bool vol = false;
    for (int i = 0; grouped && i < WP_VOLATILE; i++)
        vol |= g_wp_vol[i] == key;
    for (int i = 0; i < g_wp_n; i++) {
        wperm_entry &e = g_wp[i];
        if (e.dev == dev && e.w == key && e.n_experts == ne && e.n_out == a.n_out && e.n_in == a.n_in &&
            e.ilv == ilv) {
            if (lookup && e.st != st)
                break;
            if (e.st != st && cudaStreamWaitEvent(st, e.ev, 0) != cudaSuccess) {
                (void)cudaGetLastError();
                break; // not known to be written for this stream: do not use it
            }
            out = e.wb;
            break;
        }
    }
    const size_t bytes = (size_t)(grouped ? ne : 1) * (size_t)a.n_out * (size_t)ldx * 2;
    bool room = !lookup && out == NULL && !vol && g_wp_used + bytes <= wperm_limit(dev);
    if (room && g_wp_n == g_wp_cap) {
        const int cap = g_wp_cap ? 2 * g_wp_cap : 64;
        wperm_entry *n = (wperm_entry *)realloc(g_wp, (size_t)cap * sizeof(*n));
        if (n != NULL)
            g_wp = n, g_wp_cap = cap;
        room = n != NULL;
    }
    if (room) {
        wperm_entry e = {dev, key, a.n_out, a.n_in, ne, ilv, NULL, bytes, NULL, NULL, st};
        if (grouped) { // the experts the copy stands for (once per table: a stream drain)
            e.ex = (uintptr_t *)malloc((size_t)ne * sizeof(uintptr_t));
            if (e.ex == NULL ||
                cudaMemcpyAsync(e.ex, a.wg, (size_t)ne * sizeof(void *), cudaMemcpyDeviceToHost, st) != cudaSuccess ||
                cudaStreamSynchronize(st) != cudaSuccess) {
                (void)cudaGetLastError();
                free(e.ex);
                pthread_mutex_unlock(&g_wp_mu);
                return NULL;
            }
        }
        if (cudaMalloc((void **)&e.wb, bytes) != cudaSuccess) {
            (void)cudaGetLastError(); // no memory for it: permute per product
            e.wb = NULL;
        } else if (cudaEventCreateWithFlags(&e.ev, cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            (void)cudaFree(e.wb);
            e.wb = NULL;
        }
        if (e.wb == NULL) {
            free(e.ex);
        } else {
            const int64_t wp = (int64_t)a.n_out * (ldx / 8), wcb = (wp + 255) / 256;
            if (grouped) { // every expert of the table, rows or not
                const int64_t per = (132 * 16 + ne - 1) / ne;
                wg_convert_w_kernel<<<dim3((unsigned)(wcb < per ? wcb : per), (unsigned)ne), 256, 0, st>>>(
                    NULL, a.n_out, a.n_in, e.wb, ldx, a.wg, NULL, ilv);
            } else {
                wg_convert_w_kernel<<<(unsigned)(wcb < 132 * 16 ? wcb : 132 * 16), 256, 0, st>>>(
                    (const uint16_t *)a.w0, a.n_out, a.n_in, e.wb, ldx);
            }
            if (cudaGetLastError() != cudaSuccess || cudaEventRecord(e.ev, st) != cudaSuccess) {
                (void)cudaGetLastError();
                (void)cudaEventDestroy(e.ev);
                (void)cudaFree(e.wb);
                free(e.ex);
            } else {
                g_wp[g_wp_n++] = e;
                g_wp_used += bytes;
                __atomic_store_n(&g_wp_count, g_wp_n, __ATOMIC_RELEASE);
                out = e.wb;
            }
        }
    }
    pthread_mutex_unlock(&g_wp_mu);
    return out;
}

// Whether a dense weight's permuted copy is in the cache or would fit its bound (no build).
static bool wperm_fits(const mm_mat_args &a, int64_t ldx) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    const size_t bytes = (size_t)a.n_out * (size_t)ldx * 2;
    pthread_mutex_lock(&g_wp_mu);
    bool ok = g_wp_used + bytes <= wperm_limit(dev);
    for (int i = 0; !ok && i < g_wp_n; i++) {
        const wperm_entry &e = g_wp[i];
        ok = e.dev == dev && e.w == a.w0 && e.n_experts == 0 && e.n_out == a.n_out &&
             e.n_in == a.n_in && e.ilv == 0;
    }
    pthread_mutex_unlock(&g_wp_mu);
    return ok;
}

// ---- x workspace of the small gemm_ws products, also inside recorded graphs -----------------
// Decode steps of up to 64 rows are recorded as CUDA graphs (common/model.c), where a product
// may not take a stream-ordered workspace (no allocation nodes). Dense products of 9..127 rows
// on gemm_ws (variant 28, ws_small_mode) therefore convert x into a device buffer of the stream
// (CWS_BYTES, allocated at the stream's first such product outside a capture, reused by every
// later one: the stream orders them) and read W from the permuted-W cache; inside a capture
// they run only when both are there (else the mma.sync tiles, the same bits). FFD_G_BYTES more
// after it hold a decode MoE FFN's [gate | up] rows (launch_ffn_dec). The buffer is
// freed by mm_gpu_stream_forget (the backend, before it destroys its stream) and never moves
// while the stream lives, so recorded graphs stay valid.
#define CWS_BYTES (2u << 20) // x of 64 rows of up to 16384 k (bf16)
#define FFD_G_BYTES (4u << 20) // after it: the [gate | up] rows of a decode MoE FFN (f32)
#define SEG_WS_BYTES (16u << 20) // after that: gemm_seg_kernel's segment sums (f32)
#define CWS_MAX 64
struct cws_entry {
    int dev;
    cudaStream_t st;
    void *buf;
};
static cws_entry g_cws[CWS_MAX];
static int g_cws_n;
static pthread_mutex_t g_cws_mu = PTHREAD_MUTEX_INITIALIZER;

// The stream's buffer; alloc: allocate it when missing (never inside a capture). NULL: none.
static void *cws_get(cudaStream_t st, int dev, bool alloc) {
    void *out = NULL;
    pthread_mutex_lock(&g_cws_mu);
    for (int i = 0; i < g_cws_n && out == NULL; i++)
        if (g_cws[i].dev == dev && g_cws[i].st == st)
            out = g_cws[i].buf;
    if (out == NULL && alloc && g_cws_n < CWS_MAX) {
        if (cudaMalloc(&out, (size_t)CWS_BYTES + FFD_G_BYTES + SEG_WS_BYTES) != cudaSuccess) {
            (void)cudaGetLastError();
            out = NULL;
        } else {
            g_cws[g_cws_n++] = cws_entry{dev, st, out};
        }
    }
    pthread_mutex_unlock(&g_cws_mu);
    return out;
}

// MM_GPU_SEGSPLIT (read once; mm_gpu_set_segsplit): 1 (default) runs dense bf16 products of
// SEG_ROWS_MIN..SEG_TN rows as seg_auto says (batch decode's o_proj, and its q/k/v up to 32
// rows; not the router, not the LM head) as gemm_seg_kernel + gemm_seg_fold_kernel, their
// segment sums in the stream's buffer (cws_get; inside a capture only once an eager call made
// it); 0 as before (gemm_ws 29/30 or GEMV v2). Same bits. H200, 2026-12-02, engine decode
// with every such product on it (before seg_auto's rule): batch 16 10904 vs 10092 tok/s, 32
// 20866 vs 19322, 64 31149 vs 30774; batch 8 with MM_GPU_SEGSPLIT_MIN=1 6970 vs 6906, batch 1
// 1919 vs 2015; with the rule, from 1 row: batch 1 1772 vs 2005, batch 4 -1.2%, batch 8 +0.8%
// (so not below 9 rows).
#define SEG_ROWS_MIN 9
static int g_segsplit = -1; // -1: not read yet
static unsigned long long g_seg_n;

static int seg_count(int n_in) { return (n_in + seg_len(n_in) - 1) / seg_len(n_in); }

// Whether gemm_seg takes the product (its shape; the buffer is checked by launch_seg).
static bool seg_shape_ok(const mm_mat_args &a) {
    return a.wg == NULL && a.x_idx == NULL && a.y_idx == NULL && a.x_up == NULL &&
           a.n_rows >= 1 && a.n_rows <= SEG_TN && a.n_in % 32 == 0 && aligned16(a.w0) &&
           (size_t)seg_count(a.n_in) * a.n_rows * a.n_out * 4 <= SEG_WS_BYTES;
}

// MM_GPU_SEGSPLIT_MIN (A/B, read once): the fewest rows AUTO gives gemm_seg (1..64; default
// SEG_ROWS_MIN: up to 8 rows GEMV v3 streams W over enough blocks).
static int seg_rows_min(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("MM_GPU_SEGSPLIT_MIN");
        const int n = e && e[0] ? atoi(e) : SEG_ROWS_MIN;
        v = n >= 1 && n <= SEG_TN ? n : SEG_ROWS_MIN;
    }
    return v;
}

// AUTO's rule (H200, 2026-12-02, per-op GPU time at 32 / 64 rows, gemm_seg against the paths
// before it): o_proj 2048 x 4096 15.8 vs 33.5 / 21.5 vs 33.7 us, q/k/v 5120 x 2048 19.7 vs 21.6
// / 28.9 vs 21.9 (gemm_ws 30's 80 tiles of 64 outputs stream it well at 64 rows), the router 128
// x 2048 (8 blocks) 9.2 vs 9.4 / 12.5 vs 9.4. So: at least SEG_BLOCKS_MIN blocks, and above 32
// rows only products of fewer than SEG_WIDE_OUT outputs.
#define SEG_BLOCKS_MIN 132
#define SEG_WIDE_OUT 4096
static bool seg_auto(const mm_mat_args &a) {
    const long long blocks = (long long)mm_div_up(a.n_out, SEG_WARPS * 16) * seg_count(a.n_in);
    return switch_on(&g_segsplit, "MM_GPU_SEGSPLIT") && a.n_rows >= seg_rows_min() &&
           blocks >= SEG_BLOCKS_MIN && (a.n_rows <= 32 || a.n_out < SEG_WIDE_OUT) &&
           seg_shape_ok(a);
}

// MM_GPU_SEG_TN (A/B, read once): tokens per gemm_seg block, 16, 32 or 64 (default SEG_TN);
// a product of more rows takes several token tiles, each reading its W (the same bits).
static int seg_tn(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("MM_GPU_SEG_TN");
        const int n = e && e[0] ? atoi(e) : SEG_TN;
        v = n == 16 || n == 32 || n == 64 ? n : SEG_TN;
    }
    return v;
}

// Runs the product as gemm_seg (*ran set) where its shape and the stream's buffer allow.
static mm_err launch_seg(cudaStream_t st, const mm_mat_args &a, bool *ran) {
    *ran = false;
    if (!seg_shape_ok(a))
        return MM_OK;
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MM_GPU_CHECK(cudaStreamIsCapturing(st, &cs));
    char *buf = (char *)cws_get(st, dev, cs == cudaStreamCaptureStatusNone);
    if (buf == NULL)
        return MM_OK;
    float *ws = (float *)(buf + CWS_BYTES + FFD_G_BYTES);
    const int sl = seg_len(a.n_in), S = seg_count(a.n_in);
    const int tn = seg_tn(), nt = (min(a.n_rows, tn) + 7) / 8;
    const int ki = nt <= 2 ? 0 : nt <= 4 ? 1 : 2; // the form: NT = 2 << ki token groups
    const size_t smem = (size_t)8 * (2 << ki) * (sl + 8) * 2;
    void (*const ks[3])(mm_mat_args, float *, int) = {gemm_seg_kernel<2>, gemm_seg_kernel<4>,
                                                      gemm_seg_kernel<8>};
    static uint64_t attr_set; // harmlessly racy, as for the other kernels
    if (!(attr_set & (1ull << (dev & 63)))) {
        for (int i = 0; i < 3; i++)
            MM_GPU_CHECK(cudaFuncSetAttribute(ks[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              MV3_SMEM_MAX));
        attr_set |= 1ull << (dev & 63);
    }
    if (smem > MV3_SMEM_MAX)
        return MM_OK;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3(mm_div_up(a.n_out, SEG_WARPS * 16), mm_div_up(a.n_rows, tn), S);
    cfg.blockDim = dim3(SEG_WARPS * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = g_pdl ? 1 : 0; // as the GEMVs
    MM_GPU_CHECK(cudaLaunchKernelEx(&cfg, ks[ki], a, ws, tn));
    cfg.gridDim = dim3(mm_div_up((int64_t)a.n_rows * a.n_out, 256));
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = 0;
    MM_GPU_CHECK(cudaLaunchKernelEx(&cfg, gemm_seg_fold_kernel, a, (const float *)ws, S));
    MM_GPU_CHECK(cudaGetLastError());
    __atomic_fetch_add(&g_seg_n, 1ull, __ATOMIC_RELAXED);
    *ran = true;
    return MM_OK;
}
#endif // MM_GPU_HAVE_WMMA

extern "C" void mm_gpu_stream_forget(void *stream) {
#if MM_GPU_HAVE_WMMA
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    // a stream handle names one stream of one device, whichever is current (the null stream:
    // the current device's)
    pthread_mutex_lock(&g_cws_mu);
    for (int i = 0; i < g_cws_n; i++)
        if (g_cws[i].st == (cudaStream_t)stream && (stream != NULL || g_cws[i].dev == dev)) {
            // a stream with work still queued (a lost one) keeps its buffer: leaked, never
            // handed to a later stream that gets the same handle
            if (cudaStreamQuery((cudaStream_t)stream) == cudaSuccess)
                (void)cudaFree(g_cws[i].buf);
            else
                (void)cudaGetLastError();
            g_cws[i] = g_cws[--g_cws_n];
            break;
        }
    pthread_mutex_unlock(&g_cws_mu);
#else
    (void)stream;
#endif
}

// cuMemGetAddressRange through the runtime's driver entry points (no -lcuda), for the range of
// the allocation a freed pointer starts.
typedef int (*mm_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);
#if MM_GPU_HAVE_WMMA
static mm_range_fn wperm_range_fn(void) {
    static mm_range_fn fn;
    static int tried;
    if (!tried) {
        fn = (mm_range_fn)driver_entry("cuMemGetAddressRange", 3020);
        tried = 1;
    }
    return fn;
}
#endif

extern "C" void mm_gpu_wperm_forget(const void *d_ptr, size_t n_bytes) {
#if MM_GPU_HAVE_WMMA
    if (d_ptr == NULL || __atomic_load_n(&g_wp_count, __ATOMIC_ACQUIRE) == 0)
        return;
    uintptr_t lo = (uintptr_t)d_ptr, hi = lo + n_bytes;
    const bool write = n_bytes > 0; // else a free
    if (n_bytes == 0) { // the allocation d_ptr is in (a free): its range, else everything
        unsigned long long base = 0;
        size_t size = 0;
        mm_range_fn fn = wperm_range_fn();
        if (fn != NULL && fn(&base, &size, (unsigned long long)lo) == 0)
            lo = (uintptr_t)base, hi = lo + size;
        else
            lo = 0, hi = UINTPTR_MAX;
    }
    pthread_mutex_lock(&g_wp_mu);
    for (int i = 0; i < g_wp_n;) {
        const wperm_entry &e = g_wp[i];
        const size_t wbytes = (size_t)e.n_out * (size_t)e.n_in * 2;
        const uintptr_t w = (uintptr_t)e.w;
        bool hit = false, table = false;
        if (e.n_experts == 0) {
            hit = w < hi && lo < w + wbytes;
        } else {
            table = hit = w < hi && lo < w + (size_t)e.n_experts * sizeof(void *);
            for (int x = 0; !hit && x < e.n_experts; x++)
                hit = e.ex[x] != 0 && e.ex[x] < hi && lo < e.ex[x] + wbytes;
        }
        if (hit && table && write) { // a table rewritten in place: not cached again
            g_wp_vol[g_wp_vol_next] = e.w;
            g_wp_vol_next = (g_wp_vol_next + 1) % WP_VOLATILE;
        }
        if (hit)
            wperm_drop(i);
        else
            i++;
    }
    pthread_mutex_unlock(&g_wp_mu);
#else
    (void)d_ptr, (void)n_bytes;
#endif
}

extern "C" void mm_gpu_set_wperm_mb(long long mb) {
#if MM_GPU_HAVE_WMMA
    pthread_mutex_lock(&g_wp_mu);
    g_wp_mb = mb < 0 ? -2 : mb;
    if (mb == 0)
        while (g_wp_n > 0)
            wperm_drop(g_wp_n - 1);
    pthread_mutex_unlock(&g_wp_mu);
#else
    (void)mb;
#endif
}

extern "C" size_t mm_gpu_wperm_bytes(void) {
#if MM_GPU_HAVE_WMMA
    pthread_mutex_lock(&g_wp_mu);
    const size_t b = g_wp_used;
    pthread_mutex_unlock(&g_wp_mu);
    return b;
#else
    return 0;
#endif
}

#if MM_GPU_HAVE_WMMA
// Prefill conversion for gemm_ws (mm_gpu_set_prefill_fuse, MM_GPU_PF_FUSE; 1 by default, 0:
// the earlier form). 1: x goes into the k-block-major swizzled workspace by
// wg_convert_rows_kernel (one warp per row: the row's expert and swizzle found once per row,
// not once per 16-byte piece with a 64-bit division), and grouped products taken by
// mm_gpu_moe_matmul_rows with >= 128 rows per expert run on gemm_ws with the MoE layer's
// gather (x_idx), SwiGLU (x_up) and scatter (y_idx) inside (no copy_rows and swiglu launches
// around them). The same bytes in the workspace and the same values stored: the same bits.
static int g_pf_fuse = -1; // -1: not read yet

static bool pf_fuse(void) { return switch_on(&g_pf_fuse, "MM_GPU_PF_FUSE"); }

// x (f32, any stride) -> the TILED workspace of wg_convert_x_kernel<true> (same layout, same
// bytes), one warp per workspace row r: source row x_idx[r] (NULL: r); x_up (NULL: none): the
// value is mv2_swiglu(x, up) of the same source row and column (swiglu_kernel's expression);
// offs (grouped): the swizzle is (r - offs[e]) & 7 for r's expert e, else r & 7. VEC2: x (and
// x_up) rows 8-byte aligned, read as float2 (k is even).
template <bool VEC2>
__global__ void wg_convert_rows_kernel(const float *x, int64_t xs, const int32_t *x_idx,
                                       const float *x_up, int n_rows, int n_in, uint16_t *xb,
                                       int64_t ldx, const int32_t *offs, int n_experts) {
    const int lane = threadIdx.x & 31;
    const int per_row = (int)(ldx / 8);
    const int64_t wstep = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n_rows; r += wstep) {
        int sw = (int)(r & 7);
        if (offs != NULL) { // the last expert whose rows start at or before r (as wg_convert_x_kernel)
            int lo = 0, hi = n_experts; // offs[lo] <= r < offs[hi]
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (offs[mid] <= r)
                    lo = mid;
                else
                    hi = mid;
            }
            sw = (int)((r - offs[lo]) & 7);
        }
        const int64_t src = x_idx != NULL ? (int64_t)x_idx[r] : r;
        const float *xr = x + src * xs;
        const float *ur = x_up != NULL ? x_up + src * xs : NULL;
        for (int q = lane; q < per_row; q += 32) {
            const int c = q >> 2, s = (q >> 1) & 1, h = q & 1;
            uint32_t v[4];
#pragma unroll
            for (int t = 0; t < 4; t++) { // n_in even: k < n_in means k + 1 < n_in
                const int k = 32 * c + 8 * t + 4 * s + 2 * h;
                float2 f = make_float2(0.0f, 0.0f);
                if (k < n_in) {
                    if (VEC2) {
                        f = *(const float2 *)(xr + k);
                        if (ur != NULL) {
                            const float2 u = *(const float2 *)(ur + k);
                            f = make_float2(mv2_swiglu(f.x, u.x), mv2_swiglu(f.y, u.y));
                        }
                    } else {
                        f = make_float2(xr[k], xr[k + 1]);
                        if (ur != NULL)
                            f = make_float2(mv2_swiglu(f.x, ur[k]), mv2_swiglu(f.y, ur[k + 1]));
                    }
                }
                v[t] = pack_bf16(f.x, f.y);
            }
            uint16_t *dst = xb + ((int64_t)(q >> 3) * n_rows + r) * 64 + 8 * ((q & 7) ^ sw);
            *(uint4 *)dst = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

// wg_convert_rows_kernel<true> with each lane's loads of 4 pieces (16 float2 of x, as many of
// x_up) issued before any of their conversions and stores: the plain loop issues a piece's 4
// loads and waits for them before its store, piece by piece, so a warp has ~1 KB in flight.
// The same values converted by the same operations (mv2_swiglu only where k < n_in, zeros past
// n_in), packed by pack_bf16 and stored to the same places: the same bytes. x, x_up rows
// 8-byte aligned (VEC2); read through the read-only path (nothing in the kernel writes them).
// UP: x_up is not NULL.
#define WG_CONV_IT 4
template <bool UP>
__global__ void wg_convert_rows4_kernel(const float *__restrict__ x, int64_t xs,
                                        const int32_t *__restrict__ x_idx,
                                        const float *__restrict__ x_up, int n_rows, int n_in,
                                        uint16_t *__restrict__ xb, int64_t ldx,
                                        const int32_t *__restrict__ offs, int n_experts) {
    const int lane = threadIdx.x & 31;
    const int per_row = (int)(ldx / 8);
    const int64_t wstep = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n_rows; r += wstep) {
        int sw = (int)(r & 7);
        if (offs != NULL) { // as wg_convert_rows_kernel
            int lo = 0, hi = n_experts;
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (offs[mid] <= r)
                    lo = mid;
                else
                    hi = mid;
            }
            sw = (int)((r - offs[lo]) & 7);
        }
        const int64_t src = x_idx != NULL ? (int64_t)x_idx[r] : r;
        const float *xr = x + src * xs;
        const float *ur = UP ? x_up + src * xs : NULL;
        for (int q0 = 0; q0 < per_row; q0 += 32 * WG_CONV_IT) {
            float2 f[WG_CONV_IT][4], u[WG_CONV_IT][UP ? 4 : 1];
#pragma unroll
            for (int i = 0; i < WG_CONV_IT; i++) {
                const int q = q0 + 32 * i + lane;
                const int c = q >> 2, s = (q >> 1) & 1, h = q & 1;
#pragma unroll
                for (int t = 0; t < 4; t++) { // n_in even: k < n_in means k + 1 < n_in
                    const int k = 32 * c + 8 * t + 4 * s + 2 * h;
                    const bool ok = q < per_row && k < n_in;
                    f[i][t] = ok ? __ldg((const float2 *)(xr + k)) : make_float2(0.0f, 0.0f);
                    if constexpr (UP)
                        u[i][t] = ok ? __ldg((const float2 *)(ur + k)) : make_float2(0.0f, 0.0f);
                }
            }
#pragma unroll
            for (int i = 0; i < WG_CONV_IT; i++) {
                const int q = q0 + 32 * i + lane;
                if (q >= per_row)
                    break;
                const int c = q >> 2, s = (q >> 1) & 1, h = q & 1;
                uint32_t v[4];
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    const int k = 32 * c + 8 * t + 4 * s + 2 * h;
                    float2 g = f[i][t];
                    if constexpr (UP)
                        if (k < n_in)
                            g = make_float2(mv2_swiglu(g.x, u[i][t].x), mv2_swiglu(g.y, u[i][t].y));
                    v[t] = pack_bf16(g.x, g.y);
                }
                uint16_t *dst = xb + ((int64_t)(q >> 3) * n_rows + r) * 64 + 8 * ((q & 7) ^ sw);
                *(uint4 *)dst = make_uint4(v[0], v[1], v[2], v[3]);
            }
        }
    }
}

// MM_GPU_CONV_BATCH (read once; mm_gpu_set_conv_batch): 1 (default) the row conversion takes
// wg_convert_rows4_kernel where x (and x_up) rows are 8-byte aligned; 0 wg_convert_rows_kernel
// always (A/B). The same bytes.
static int g_conv_batch = -1; // -1: not read yet

static bool conv_batch(void) { return switch_on(&g_conv_batch, "MM_GPU_CONV_BATCH"); }

// x rows (x_idx, x_up as wg_convert_rows_kernel) into the TILED workspace xb, a warp per row.
static void convert_rows(cudaStream_t st, const float *x, int64_t xs, const int32_t *x_idx,
                         const float *x_up, int n_rows, int n_in, uint16_t *xb, int64_t ldx,
                         const int32_t *offs, int n_experts) {
    const int64_t rb = ((int64_t)n_rows + 7) / 8;
    const unsigned rblocks = (unsigned)(rb < 132 * 16 ? rb : 132 * 16);
    const bool v2 = ((uintptr_t)x & 7) == 0 && xs % 2 == 0 && (x_up == NULL || ((uintptr_t)x_up & 7) == 0);
    if (v2 && conv_batch() && x_up != NULL)
        wg_convert_rows4_kernel<true><<<rblocks, 256, 0, st>>>(x, xs, x_idx, x_up, n_rows, n_in, xb,
                                                               ldx, offs, n_experts);
    else if (v2 && conv_batch())
        wg_convert_rows4_kernel<false><<<rblocks, 256, 0, st>>>(x, xs, x_idx, NULL, n_rows, n_in, xb,
                                                                ldx, offs, n_experts);
    else if (v2)
        wg_convert_rows_kernel<true><<<rblocks, 256, 0, st>>>(x, xs, x_idx, x_up, n_rows, n_in, xb, ldx,
                                                              offs, n_experts);
    else
        wg_convert_rows_kernel<false><<<rblocks, 256, 0, st>>>(x, xs, x_idx, x_up, n_rows, n_in, xb, ldx,
                                                               offs, n_experts);
}

// wg_stream_ok: *bit is the current device's bit (1 << device) when the stream may take the
// wgmma products' stream-ordered workspaces, 0 when not: inside a stream capture (decode graphs
// take the mma.sync tiles: no allocation nodes or pool calls in captured graphs; same bits). The
// device's default pool then keeps 1 GiB between products (set once per device).
// *capturing (when given): the stream is capturing (*bit_out is then 0).
static mm_err wg_stream_ok(cudaStream_t st, uint64_t *bit_out, bool *capturing = NULL) {
    static uint64_t pool_set;
    *bit_out = 0;
    if (capturing)
        *capturing = false;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) {
        (void)cudaGetLastError();
        return MM_OK;
    }
    if (cs != cudaStreamCaptureStatusNone) {
        if (capturing)
            *capturing = cs == cudaStreamCaptureStatusActive;
        return MM_OK;
    }
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    const uint64_t bit = 1ull << (dev & 63);
    if (!(pool_set & bit)) {
        cudaMemPool_t pool;
        MM_GPU_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
        uint64_t keep = 1024ull << 20;
        MM_GPU_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
        pool_set |= bit;
    }
    *bit_out = bit;
    return MM_OK;
}

// Converts x into a stream-ordered workspace (bf16, permuted; gemm_wg.cuh) and runs the
// wgmma tiles. *ran is false, with MM_OK, when the workspace could not be had or the stream is
// capturing: the caller then takes the mma.sync path, which gives the same bits. The workspace comes from the
// device's default memory pool (cudaMallocAsync, released with cudaFreeAsync on the same
// stream), which keeps up to 1 GiB reserved between products so that steady-state
// prefill does not map memory (a grouped gemm_ws product of a 4K prefill takes ~0.95 GB: x and
// every expert's permuted W).
// Inside a capture only dense variant 28 runs (ws_small_mode; its W cached and its x in the
// stream's buffer, cws_get); everything else reports *ran false there.
template <bool GROUPED>
static mm_err launch_wg(cudaStream_t st, const mm_mat_args &a, bool *ran) {
    *ran = false;
    uint64_t bit = 0;
    bool capturing = false;
    MM_TRY(wg_stream_ok(st, &bit, &capturing));
    if (bit == 0 && !capturing)
        return MM_OK;
    const int64_t ldx = (a.n_in + WG_LDX - 1) / WG_LDX * WG_LDX;
    // Variant: the explicit one (mm_gpu_set_gemm_tile), else grouped 2, dense
    // ws_auto_variant (14, 13 or 4). The warp-specialised kernels with W
    // from registers (8, 9, 10: gemm_wp.cuh; q_proj 57, 300, 222 TFLOP/s at 23:28 UTC) take
    // dense products with n_in % 8 == 0 and 16-byte aligned W (bulk copies); others run
    // gemm_wg.cuh's 4. 11-18 (gemm_ws_kernel: W permuted into the workspace too, both operands
    // by bulk copies) take any dense product wg_usable allows; permuting W costs a pass over it
    // (~10 us for 16.8 MB).
    // Grouped: 19 (gemm_ws grouped, a block per tile), 20 (the same persistent), 21-23 (20
    // with WS_OPT_IDX, + WS_OPT_TAILN, + WS_OPT_PTILE), 25 (as ws_grouped_variant says) or
    // gemm_wg's 2-7 (ws_auto_grouped picks MM_GPU_WS_GROUPED's or 2; 13 and 14 stand for 19 and
    // 20, other dense-only variants for 2; 27 for 25 or 23); dense: 19 stands for 13, 20-27 for 14.
    int var = g_wg_tile ? g_wg_tile : GROUPED ? ws_auto_grouped(a, ldx) : ws_auto_variant(a);
    const bool wp_ok = !GROUPED && a.n_in % 8 == 0 && aligned16(a.w0);
    if (var >= 8 && var <= 10 && !wp_ok)
        var = 4;
    if (GROUPED)
        var = var == 13 || var == 19 ? 19 : var == 14 || var >= 28 ? 20 : var >= 20 ? var : var >= 8 ? 2 : var;
    if (GROUPED && var == 27) // by the k loop's length
        var = (a.n_in + 63) / 64 <= WS_STAGE_MAX_K ? 25 : 23;
    else if (!GROUPED && var >= 19 && (var < 28 || var > 30))
        var = var == 19 ? 13 : 14;
    const bool rows = a.x_idx != NULL || a.y_idx != NULL || a.x_up != NULL;
    if (rows && !(GROUPED && var >= 19))
        return MM_EUNSUPP; // row indices and SwiGLU: gemm_ws grouped only (nothing issued)
    if (capturing && (GROUPED || var < 28 || var > 30))
        return MM_OK;
    const size_t xbytes = (size_t)a.n_rows * (size_t)ldx * 2;
    const uint16_t *wcached = NULL;
    void *ws = NULL;
    bool own_ws = false; // ws from the stream's buffer (cws_get): not freed here
    if (var >= 28 && var <= 30) { // only on the cached W; x in the stream's buffer where it fits
        int dev = 0;
        MM_GPU_CHECK(cudaGetDevice(&dev));
        wcached = wperm_get(st, a, ldx, 0, capturing);
        if (wcached != NULL && xbytes <= CWS_BYTES)
            ws = cws_get(st, dev, !capturing);
        own_ws = ws != NULL;
        if (capturing && (wcached == NULL || ws == NULL))
            return MM_OK; // the mma.sync tiles, the same bits
        if (wcached == NULL)
            var = 4;
        else if (a.n_rows <= 64 && g_wg_tile == 0 && ws_bn64())
            var = ws_half() && (a.n_out + 127) / 128 < WS_HALF_TILES ? 30 : 29;
        if (capturing)
            bit = 1ull << (dev & 63); // the kernel's attributes were set by an eager product
    }
    const bool tiled = var >= 8, wperm = var >= 11;
    // the cached permuted W where there is one (wperm_get builds it on first use)
    if (wperm && wcached == NULL)
        wcached = wperm_get(st, a, ldx);
    const size_t wbytes = wperm && wcached == NULL
                              ? (size_t)(GROUPED ? a.n_experts : 1) * (size_t)a.n_out * (size_t)ldx * 2
                              : 0;
    if (ws == NULL && cudaMallocAsync(&ws, xbytes + wbytes, st) != cudaSuccess) {
        (void)cudaGetLastError();
        return MM_OK;
    }
    // W workspace (wperm): the cached copy, else after x's in the workspace
    const uint16_t *wb = wcached ? wcached : (const uint16_t *)((char *)ws + xbytes);
    const int64_t pieces = (int64_t)a.n_rows * (ldx / 8);
    const int64_t cb = (pieces + 255) / 256;
    const unsigned cblocks = (unsigned)(cb < 132 * 16 ? cb : 132 * 16);
    if (tiled && (rows || pf_fuse())) { // a warp per row (8 per block)
        convert_rows(st, a.x, a.x_stride, a.x_idx, a.x_up, a.n_rows, a.n_in, (uint16_t *)ws, ldx,
                     GROUPED ? a.offs : NULL, a.n_experts);
    } else if (tiled) // grouped gemm_ws: rows swizzled relative to their expert's first row
        wg_convert_x_kernel<true><<<cblocks, 256, 0, st>>>(a.x, a.x_stride, a.n_rows, a.n_in, (uint16_t *)ws,
                                                           ldx, GROUPED ? a.offs : NULL, a.n_experts);
    else
        wg_convert_x_kernel<false><<<cblocks, 256, 0, st>>>(a.x, a.x_stride, a.n_rows, a.n_in, (uint16_t *)ws, ldx);
    MM_GPU_CHECK(cudaGetLastError());
    if (wperm && wcached == NULL) {
        const int64_t wp = (int64_t)a.n_out * (ldx / 8), wcb = (wp + 255) / 256;
        if (GROUPED) { // every expert with rows, about 16 blocks each
            const int64_t per = (132 * 16 + a.n_experts - 1) / a.n_experts;
            const dim3 grid((unsigned)(wcb < per ? wcb : per), (unsigned)a.n_experts);
            wg_convert_w_kernel<<<grid, 256, 0, st>>>(NULL, a.n_out, a.n_in, (uint16_t *)wb, ldx,
                                                      a.wg, a.offs);
        } else {
            wg_convert_w_kernel<<<(unsigned)(wcb < 132 * 16 ? wcb : 132 * 16), 256, 0, st>>>(
                (const uint16_t *)a.w0, a.n_out, a.n_in, (uint16_t *)wb, ldx);
        }
        MM_GPU_CHECK(cudaGetLastError());
    }
    mm_wg_args w = {(const uint16_t *)ws, ldx, a.w0, a.wg, a.offs, a.n_experts, a.n_rows, a.n_in,
                    a.n_out, a.bias, a.y, a.y_stride, a.y_idx};
    mm_err rv;
    // Default (H200, 2026-11-29, kernels/cuda/bench/NOTES.md; every variant bit-equal to the
    // GEMV there): dense products on gemm_ws 128 x 128 with two accumulators, persistent from
    // 4096 rows (14: q_proj 399 TFLOP/s vs 381 for 13 and 240 for 4, 23:28 UTC), one block per
    // tile from 128 or 1024 rows (ws_auto_variant; 13: q_proj at 128 / 512 / 2048 rows 32.9 /
    // 37.4 / 99.2 us vs 51.1 / 51.3 / 147.9 for 4), others on 128 outputs x 192 tokens (4); grouped
    // products on 128 x 128 (experts hold ~256 rows each at a 4K prefill, so 192-token tiles
    // would run half empty).
    switch (var) {
    case 8: rv = launch_wp_kernel<128, 6, WP_W_ROWS>(st, w, bit); break;
    case 9: rv = launch_wp_kernel<128, 6, WP_W_TMA>(st, w, bit); break;
    case 10: rv = launch_wp_kernel<128, 6, WP_W_CPASYNC>(st, w, bit); break;
    case 11: rv = launch_ws_kernel<128, 6, false>(st, w, wb, bit); break;
    case 12: rv = launch_ws_kernel<192, 5, false>(st, w, wb, bit); break;
    case 13: rv = launch_ws_kernel<128, 6, true>(st, w, wb, bit); break;
    case 14: rv = launch_ws_kernel<128, 6, true, true>(st, w, wb, bit); break;
    case 15: rv = launch_ws_kernel<128, 6, true, true, true>(st, w, wb, bit); break;
    case 16: rv = launch_ws_kernel<192, 5, false, false, true>(st, w, wb, bit); break;
    case 17: rv = launch_ws_kernel<192, 5, false, true, true>(st, w, wb, bit); break;
    case 18: rv = launch_ws_kernel<128, 7, true, true, true>(st, w, wb, bit); break;
    case 19: rv = launch_ws_kernel<128, 6, true, false, false, true>(st, w, wb, bit); break;
    case 20: rv = launch_ws_kernel<128, 6, true, true, false, true>(st, w, wb, bit); break;
    case 21: rv = launch_ws_kernel<128, 6, true, true, false, true, WS_OPT_IDX>(st, w, wb, bit); break;
    case 22: rv = launch_ws_kernel<128, 6, true, true, false, true, WS_OPT_IDX | WS_OPT_TAILN>(st, w, wb, bit); break;
    case 23:
        rv = launch_ws_kernel<128, 6, true, true, false, true, WS_OPT_IDX | WS_OPT_TAILN | WS_OPT_PTILE>(st, w, wb, bit);
        break;
    case 25:
        rv = launch_ws_kernel<128, 4, true, true, false, true,
                              WS_OPT_IDX | WS_OPT_TAILN | WS_OPT_PTILE | WS_OPT_STAGE>(st, w, wb, bit);
        break;
    case 28: rv = launch_ws_kernel<128, 6, true, true, false, false, WS_OPT_TAILN>(st, w, wb, bit); break;
    case 29: rv = launch_ws_kernel<64, 9, true, true, false, false, 0>(st, w, wb, bit); break;
    case 30: rv = launch_ws_kernel<64, 9, true, true, false, false, WS_OPT_HALFN>(st, w, wb, bit); break;
    case 3: rv = launch_wg_kernel<GROUPED, 3, 128, 64, 5>(st, w, bit); break;
    case 4: rv = launch_wg_kernel<GROUPED, 2, 192, 64, 5>(st, w, bit); break;
    case 5: rv = launch_wg_kernel<GROUPED, 2, 128, 128, 3>(st, w, bit); break;
    case 6: rv = launch_wg_kernel<GROUPED, 2, 128, 64, 5, 1>(st, w, bit); break;
    case 7: rv = launch_wg_kernel<GROUPED, 2, 128, 64, 5, 2>(st, w, bit); break; // diagnostic
    default: rv = launch_wg_kernel<GROUPED, 2, 128, 64, 5>(st, w, bit); break;
    }
    if (!own_ws)
        MM_GPU_CHECK(cudaFreeAsync(ws, st));
    if (rv == MM_OK)
        *ran = true;
    if (rv == MM_OK && var >= 28 && var <= 30)
        __atomic_fetch_add(&g_ws_small_n[var - 28], 1ull, __ATOMIC_RELAXED);
    return rv;
}

// ---- the MoE layer's expert FFN in two products, SwiGLU in [gate; up]'s epilogue -----------------
// MM_GPU_PF_SWIGLU_EPI (read once; mm_gpu_set_pf_swiglu_epi): 1 (default) lets
// mm_gpu_moe_ffn_rows run a prefill MoE layer's routed experts as [gate; up] on gemm_ws with
// WS_OPT_SWIGLU (W interleaved so a tile holds gate and up of 64 features; the epilogue applies
// SwiGLU and writes down's bf16 x workspace directly) and down on gemm_ws reading that
// workspace, so the f32 [gate; up] output (201 MB per layer at 4K tokens of Qwen3-30B-A3B) and
// the conversion pass that read it back are gone; 0: MM_EUNSUPP (the model runs the two
// mm_gpu_moe_matmul_rows calls). The same bits either way.
static int g_pf_glu = -1; // -1: not read yet

static bool pf_glu(void) { return switch_on(&g_pf_glu, "MM_GPU_PF_SWIGLU_EPI"); }

// The gemm_ws grouped variant launch_wg<true> resolves for a (19-23, 25), or below 19 (gemm_wg).
static int ws_grouped_var(const mm_mat_args &a, int64_t ldx) {
    int var = g_wg_tile ? g_wg_tile : ws_auto_grouped(a, ldx);
    if (var >= 8 && var <= 10)
        var = 4;
    var = var == 13 || var == 19 ? 19 : var == 14 || var >= 28 ? 20 : var >= 20 ? var : var >= 8 ? 2 : var;
    if (var == 27)
        var = (a.n_in + 63) / 64 <= WS_STAGE_MAX_K ? 25 : 23;
    return var;
}

// launch_wg's grouped gemm_ws launches (var from ws_grouped_var, >= 19).
static mm_err launch_ws_grouped(int var, cudaStream_t st, const mm_wg_args &w, const uint16_t *wb,
                                uint64_t bit) {
    switch (var) {
    case 19: return launch_ws_kernel<128, 6, true, false, false, true>(st, w, wb, bit);
    case 20: return launch_ws_kernel<128, 6, true, true, false, true>(st, w, wb, bit);
    case 21: return launch_ws_kernel<128, 6, true, true, false, true, WS_OPT_IDX>(st, w, wb, bit);
    case 22: return launch_ws_kernel<128, 6, true, true, false, true, WS_OPT_IDX | WS_OPT_TAILN>(st, w, wb, bit);
    case 23:
        return launch_ws_kernel<128, 6, true, true, false, true, WS_OPT_IDX | WS_OPT_TAILN | WS_OPT_PTILE>(
            st, w, wb, bit);
    default:
        return launch_ws_kernel<128, 4, true, true, false, true,
                                WS_OPT_IDX | WS_OPT_TAILN | WS_OPT_PTILE | WS_OPT_STAGE>(st, w, wb, bit);
    }
}

// gu: the [gate; up] product's arguments (x, x_idx, offs, n_rows; n_out = 2F, F % 8 == 0);
// wd: down's expert table (D x F); down's output row p goes to y row y_idx[p]. *ran false with
// MM_OK: nothing issued but permuted-W cache builds (capturing stream, no workspace, a
// product gemm_ws would not take): the caller runs the two products.
static mm_err launch_ffn(cudaStream_t st, const mm_mat_args &gu, const void *const *wd, float *y,
                         int64_t y_stride, const int32_t *y_idx, bool *ran) {
    *ran = false;
    uint64_t bit = 0;
    MM_TRY(wg_stream_ok(st, &bit));
    if (bit == 0)
        return MM_OK;
    const int F = gu.n_out / 2, D = gu.n_in, E = gu.n_experts;
    const int64_t ldg = (D + WG_LDX - 1) / WG_LDX * WG_LDX, ldd = (F + WG_LDX - 1) / WG_LDX * WG_LDX;
    mm_mat_args dn = {NULL, F, NULL, wd, gu.offs, E, gu.n_rows, F, D, NULL, y, y_stride,
                      0, NULL, y_idx, NULL};
    if (ws_grouped_var(gu, ldg) < 19 || ws_grouped_var(dn, ldd) < 19)
        return MM_OK;
    const int vd = ws_grouped_var(dn, ldd);
    const uint16_t *wgc = wperm_get(st, gu, ldg, 1), *wdc = wperm_get(st, dn, ldd);
    const size_t xg = (size_t)gu.n_rows * (size_t)ldg * 2, xd = (size_t)gu.n_rows * (size_t)ldd * 2;
    const size_t wgb = wgc ? 0 : (size_t)E * (size_t)gu.n_out * (size_t)ldg * 2;
    const size_t wdb = wdc ? 0 : (size_t)E * (size_t)D * (size_t)ldd * 2;
    char *ws = NULL;
    if (cudaMallocAsync((void **)&ws, xg + xd + wgb + wdb, st) != cudaSuccess) {
        (void)cudaGetLastError();
        return MM_OK;
    }
    uint16_t *xgu = (uint16_t *)ws, *xdn = (uint16_t *)(ws + xg);
    const uint16_t *wbg = wgc ? wgc : (const uint16_t *)(ws + xg + xd);
    const uint16_t *wbd = wdc ? wdc : (const uint16_t *)(ws + xg + xd + wgb);
    // [gate; up]'s x: the routed rows, as launch_wg converts them
    convert_rows(st, gu.x, gu.x_stride, gu.x_idx, NULL, gu.n_rows, D, xgu, ldg, gu.offs, E);
    MM_GPU_CHECK(cudaGetLastError());
    const int64_t per = (132 * 16 + E - 1) / E;
    if (wgc == NULL) { // every expert with rows, as launch_wg, interleaved
        const int64_t wcb = ((int64_t)gu.n_out * (ldg / 8) + 255) / 256;
        wg_convert_w_kernel<<<dim3((unsigned)(wcb < per ? wcb : per), (unsigned)E), 256, 0, st>>>(
            NULL, gu.n_out, D, (uint16_t *)wbg, ldg, gu.wg, gu.offs, 1);
        MM_GPU_CHECK(cudaGetLastError());
    }
    if (wdc == NULL) {
        const int64_t wcb = ((int64_t)D * (ldd / 8) + 255) / 256;
        wg_convert_w_kernel<<<dim3((unsigned)(wcb < per ? wcb : per), (unsigned)E), 256, 0, st>>>(
            NULL, D, F, (uint16_t *)wbd, ldd, wd, gu.offs);
        MM_GPU_CHECK(cudaGetLastError());
    }
    mm_wg_args wg = {xgu, ldg, NULL, gu.wg, gu.offs, E, gu.n_rows, D, gu.n_out, NULL, NULL, 0, NULL, xdn};
    mm_err rv = launch_ws_kernel<128, 6, true, true, false, true,
                                 WS_OPT_IDX | WS_OPT_TAILN | WS_OPT_PTILE | WS_OPT_SWIGLU>(st, wg, wbg, bit);
    if (rv == MM_OK) {
        mm_wg_args w = {xdn, ldd, NULL, wd, gu.offs, E, gu.n_rows, F, D, NULL, y, y_stride, y_idx, NULL};
        rv = launch_ws_grouped(vd, st, w, wbd, bit);
    }
    MM_GPU_CHECK(cudaFreeAsync(ws, st));
    if (rv == MM_OK)
        *ran = true;
    return rv;
}
#endif

#if MM_GPU_HAVE_WMMA
// Shared memory of GEMV v2's x tile for a bf16 GEMV with per_tile_rows rows per tile (<= 8 per
// tile, at most n_rows), or 0 when v2 does not take it (more rows per tile, a row too long for
// MV2_SMEM_MAX, or v2 switched off).
static size_t gemv_x_smem(const mm_mat_args &a, int per_tile_rows) {
    if (g_gemv_version < 2 || per_tile_rows > 8 || (a.wg != NULL && per_tile_rows > MV2_GROUPED_ROWS))
        return 0;
    const size_t rows = (size_t)min(8, a.n_rows);
    const size_t bytes = rows * (size_t)mv2_ldx(a.n_in) * 2;
    return bytes <= MV2_SMEM_MAX ? bytes : 0;
}

// GEMV v3 (gemv_bulk_kernel): MM_GPU_GEMV_BULK (read once unless mm_gpu_set_gemv_bulk set it):
// 0 off (v2); 1 v3 for the products v2 takes of at most 8 rows (dense; grouped as v2: one row
// per expert on average), the LM head included, so that batch-1 decode runs no v2 beside v3
// (mixing them cost 6-11% on the H200: a block of one needs the L1 the other's carveout takes);
// 2 v3 for every product v2 takes (dense 9..64 rows too). g_gemv_bulk_n counts v3 launches
// (tests).
// MM_GPU_GEMV_BULK_CARVEOUT (diagnosis, read once): the kernel's preferred shared-memory
// carveout in percent; unset: the largest; -1: none (the driver's choice).
// MM_GPU_GEMV_BULK_TPB (A/B, read once): 1 (default) v3 blocks of one 16-row tile whatever the
// segment count (down, 3 segments: 16 rows, 42 KB, 3 busy warps per block); 0 v2's tiles per
// block (down: 64 rows, 110 KB). Same bits. H200, 07:03 UTC: decode batch 1 1707/1725 tok/s
// with 1 against 1613/1597 with 0 (v2 1580/1594): the small blocks leave room on the SMs for
// the kernels launched early beside them.
#define GEMV_BULK_DEFAULT 1
static int g_gemv_bulk = -1; // -1: not read yet
static int g_gemv_bulk_carve = -2; // -2: not read yet
static int g_gemv_bulk_tpb1;
static unsigned long long g_gemv_bulk_n;

// MM_GPU_GEMV_XCAP (read once unless mm_gpu_set_gemv_xcap set it): x rows a grouped GEMV v3
// block stages at a time, 1, 2, 4 or 8; unset or 0: 1 for products of at most XCAP1_ROWS rows,
// else 8. A tile of more rows runs in passes over the W the block holds (same bits). A decode
// step's tiles hold one row each at batch 1 (a token's top-k experts are distinct), and at cap 1
// [gate; up]'s block (2048 k) takes 74.8 KB instead of 101.5: 3 blocks per SM instead of 2.
// H200, 2026-11-30 16:43 UTC: [gate; up] 25.7 -> 23.3 us per call op by op; batch 16 -6% at cap
// 1 (its tiles hold several rows). In recorded decode steps batch 1 is unchanged against the
// kernel before the passes (17:32 UTC, NOTES.md): programmatic launches already hid it there.
#define XCAP1_ROWS 16
static int g_gemv_xcap = -1; // -1: not read yet

// MM_GPU_GEMV_GTPB (read once unless mm_gpu_set_gemv_gtpb set it): 16-row tiles per grouped GEMV
// v3 block, 1, 2 or 4, where its segments leave warps idle (tiles x segments <= 8 warps, one
// segment per warp: down's 768-long rows are 3 segments, so one tile keeps 3 of 8 warps busy;
// [gate; up]'s 2048 are 8 and keep one tile); unset: GEMV_GTPB_DEFAULT. Each output's segment
// sums and their order are the tile's own: the same bits. H200, 2026-11-30 20:14 UTC, 2 against
// 1 in turn: down 15.7 vs 19.5 us per call op by op, decode batch 1 1943-1947 vs 1891-1898
// tok/s, batch 4 / 8 / 16 +4.2 / +4.2 / +7.4%. At 20:19, two segments per warp allowed: [gate;
// up] in 2-tile blocks (128 KB, one per SM) 26.7 vs 24.0 us, down in 4-tile blocks batch 1
// 1951-1956 but batch 4 / 8 / 16 -4.6 / -6.5 / -7.9% against 2-tile down blocks: not kept.
#define GEMV_GTPB_DEFAULT 2
static int g_gemv_gtpb = -1; // -1: not read yet

static int gemv_gtpb(void) {
    if (g_gemv_gtpb < 0) {
        const char *e = getenv("MM_GPU_GEMV_GTPB");
        const int v = e && e[0] ? atoi(e) : GEMV_GTPB_DEFAULT;
        g_gemv_gtpb = v == 1 || v == 2 || v == 4 ? v : GEMV_GTPB_DEFAULT;
    }
    return g_gemv_gtpb;
}

static int gemv_xcap(int n_rows) {
    if (g_gemv_xcap < 0) {
        const char *e = getenv("MM_GPU_GEMV_XCAP");
        const int v = e && e[0] ? atoi(e) : 0;
        g_gemv_xcap = v == 1 || v == 2 || v == 4 || v == 8 ? v : 0;
    }
    return g_gemv_xcap > 0 ? g_gemv_xcap : n_rows <= XCAP1_ROWS ? 1 : 8;
}

// The x tile's bytes of a GEMV v3 block of a (grouped: at most a.xcap rows).
static size_t gemv_bulk_xs(const mm_mat_args &a) {
    const int cap = a.wg != NULL && a.xcap > 0 ? a.xcap : 8;
    return (size_t)min(cap, min(8, a.n_rows)) * (size_t)mv2_ldx(a.n_in) * 2;
}

static int gemv_bulk_mode(void) {
    if (g_gemv_bulk < 0) {
        const char *e = getenv("MM_GPU_GEMV_BULK");
        const int v = e && e[0] ? atoi(e) : GEMV_BULK_DEFAULT;
        g_gemv_bulk = v >= 0 && v <= 2 ? v : GEMV_BULK_DEFAULT;
    }
    if (g_gemv_bulk_carve == -2) {
        const char *c = getenv("MM_GPU_GEMV_BULK_CARVEOUT");
        const int v = c && c[0] ? atoi(c) : cudaSharedmemCarveoutMaxShared;
        g_gemv_bulk_carve = v >= -1 && v <= 100 ? v : cudaSharedmemCarveoutMaxShared;
        const char *t1 = getenv("MM_GPU_GEMV_BULK_TPB");
        g_gemv_bulk_tpb1 = !(t1 && strcmp(t1, "0") == 0);
    }
    return g_gemv_bulk;
}

// GEMV v3's forms: PASSES (grouped products whose x tile holds fewer rows than a tile may have,
// a.xcap) compiled for 4 blocks per SM (64 registers, 8 bytes of spills; for 3 it takes 70, so
// only 3 fit: down's 28 KB blocks fit 4), the others for 3 (58-59 registers, 4 fit; their
// shared memory allows at most 3 at the dense decode shapes) with one pass, the code of the
// form before the passes. H200 17:13 UTC, the passes' form for 4 against one form for all at 79
// registers (3 per SM), in turn: batch 1 +1.1%, batch 4 / 8 / 16 +3.9 / +3.5 / +6.0%, down 21.3
// -> 19.2 us per call; 17:32 UTC, with the one-pass form for 3 (58 registers) beside it, batch
// 4 / 8 / 16 are back at the figures of the binaries before the passes (4631-4641 / 6568-6585
// / 9261-9292 tok/s against 4641-4650 / 6565-6614 / 9353-9426), where the passes' form for 4
// alone gave 4446-4451 / 6356-6370 / 9058-9078. A grouped form for 6 per SM (40 registers, 56
// bytes of spills) was slower at batch 1 (1801-1826 tok/s) and not kept.
//
// MM_GPU_W_EF (read once): 1 (default) gives GEMV v3's W copies an evict-first L2 policy, so
// that the weights streamed once a step (over 1 GB at the Qwen3-30B-A3B shape, 20x the L2) do
// not push out the small data the step's one-block ops read back (the residual, norm weights,
// the KV cache, the plan; the reasoning: their L2 hit rates were not measured). The same bits. H200,
// 2026-12-02 14:50 UTC, on / off in turn: decode batch 1 2221.1, 2226.5, 2209.4 against
// 2118.8, 2115.0, 2135.8 tok/s (+4.6%); batch 64 31312 against 31627 (its products are
// mostly not v3). 0: no policy.
static int g_wef = -1;

// Launches gemv_bulk_kernel<GROUPED, MINB, PASSES> with cfg (its shared-memory limit raised once
// per device and form).
template <bool GROUPED, int MINB, bool PASSES>
static mm_err launch_bulk(cudaLaunchConfig_t *cfg, const mm_mat_args &a0, int wpt, int ty) {
    mm_mat_args a = a0;
    a.wef = switch_on(&g_wef, "MM_GPU_W_EF");
    static uint64_t attr_set; // harmlessly racy, as for the other kernels
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    if (!(attr_set & (1ull << (dev & 63)))) {
        MM_GPU_CHECK(cudaFuncSetAttribute(gemv_bulk_kernel<GROUPED, MINB, PASSES>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, MV3_SMEM_MAX));
        if (g_gemv_bulk_carve >= 0)
            MM_GPU_CHECK(cudaFuncSetAttribute(gemv_bulk_kernel<GROUPED, MINB, PASSES>,
                                              cudaFuncAttributePreferredSharedMemoryCarveout,
                                              g_gemv_bulk_carve));
        attr_set |= 1ull << (dev & 63);
    }
    MM_GPU_CHECK(cudaLaunchKernelEx(cfg, gemv_bulk_kernel<GROUPED, MINB, PASSES>, a, wpt, ty));
    return MM_OK;
}

// Shared memory of a GEMV v3 block (W rows of its tpb tiles, the x tile of xs_bytes, the
// segment sums), or 0 where v3 does not take the product (see gemv_bulk_kernel).
static size_t gemv_bulk_smem(const mm_mat_args &a, int wpt, size_t xs_bytes) {
    const int mode = gemv_bulk_mode();
    if (mode == 0 || a.n_in % 8 != 0)
        return 0;
    if (a.wg == NULL && (!aligned16(a.w0) || (mode != 2 && a.n_rows > 8)))
        return 0;
    const int tpb = MV_WARPS / wpt, S = (a.n_in + seg_len(a.n_in) - 1) / seg_len(a.n_in);
    const size_t bytes = (size_t)tpb * 16 * mv2_ldx(a.n_in) * 2 + xs_bytes + (size_t)tpb * S * 16 * 8 * 4;
    return bytes <= MV3_SMEM_MAX ? bytes : 0;
}

// GEMV v3's choice for a product launch() gives GEMV v2 or v3 (wpt: v2's warps per tile): sets
// *wpt3 (v3's) and, grouped, a->xcap; returns v3's shared memory per block, 0 where v2 takes it.
static size_t bulk_choice(mm_mat_args *a, int wpt, int *wpt3) {
    *wpt3 = gemv_bulk_mode() > 0 && g_gemv_bulk_tpb1 ? MV_WARPS : wpt;
    if (a->wg != NULL) {
        a->xcap = gemv_xcap(a->n_rows);
        const int t = gemv_gtpb(), S = (a->n_in + seg_len(a->n_in) - 1) / seg_len(a->n_in);
        if (*wpt3 == MV_WARPS && t > 1 && S * t <= MV_WARPS)
            *wpt3 = MV_WARPS / t; // several tiles per block, each of its segments on a warp
    }
    return gemv_bulk_smem(*a, *wpt3, gemv_bulk_xs(*a));
}
#endif

template <bool GROUPED>
static mm_err launch(cudaStream_t st, int path, int dtype, mm_mat_args a, int per_tile_rows) {
    const int active = GROUPED ? min(a.n_experts, a.n_rows) : 1;
    auto tiles = [&](int tm) -> unsigned {
        return GROUPED ? (unsigned)(a.n_rows / tm + active) : mm_div_up(a.n_rows, tm);
    };
#if MM_GPU_HAVE_WMMA
    if (dtype == MM_DTYPE_BF16 && path == MM_GPU_PATH_GEMV) {
        const int ng = per_tile_rows <= 8 ? 1 : per_tile_rows <= 16 ? 2 : 4;
        const int S = (a.n_in + seg_len(a.n_in) - 1) / seg_len(a.n_in);
        int wpt = S >= 8 ? 8 : S >= 4 ? 4 : S >= 2 ? 2 : 1; // warps per 16-row tile
        if (!GROUPED && g_gemv_wpt > 0 && g_gemv_wpt < wpt &&
            (MV_WARPS / g_gemv_wpt) * S <= SEG_MAX)
            wpt = g_gemv_wpt; // A/B: fewer, longer blocks (part[] holds tiles x segments)
        dim3 grid(mm_div_up(a.n_out, 16 * (MV_WARPS / wpt)), tiles(8 * ng));
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.gridDim = grid;
        cfg.blockDim = dim3(MV_WARPS * 32);
        cfg.stream = st;
        cfg.attrs = attr;
        cfg.numAttrs = g_pdl ? 1 : 0;
        const size_t xs_bytes = gemv_x_smem(a, GROUPED ? per_tile_rows : min(per_tile_rows, 8));
        if (xs_bytes > 0 && (GROUPED || a.n_rows <= MV2_DENSE_ROWS)) { // GEMV v2 (same bits)
            const int ty = GROUPED ? 1 : (a.n_rows + 7) / 8; // dense: 8-row tiles along x
            cfg.gridDim = GROUPED ? dim3(grid.x, tiles(8)) : dim3(grid.x * ty, 1);
            int wpt3 = wpt;
            const size_t bulk_bytes = bulk_choice(&a, wpt, &wpt3);
            if (bulk_bytes > 0) { // GEMV v3 (same bits): W by bulk copies into shared memory
                cfg.dynamicSmemBytes = bulk_bytes;
                const unsigned gx3 = mm_div_up(a.n_out, 16 * (MV_WARPS / wpt3));
                cfg.gridDim = GROUPED ? dim3(gx3, tiles(8)) : dim3(gx3 * ty, 1);
                if constexpr (GROUPED) {
                    if (a.xcap < min(8, a.n_rows)) // tiles may take several passes
                        MM_TRY((launch_bulk<true, 4, true>(&cfg, a, wpt3, ty)));
                    else
                        MM_TRY((launch_bulk<true, 3, false>(&cfg, a, wpt3, ty)));
                } else {
                    MM_TRY((launch_bulk<false, 3, false>(&cfg, a, wpt3, ty)));
                }
                __atomic_fetch_add(&g_gemv_bulk_n, 1ull, __ATOMIC_RELAXED);
                return MM_OK;
            }
            cfg.dynamicSmemBytes = xs_bytes;
            static uint64_t attr_set; // harmlessly racy, as for the GEMM tiles
            int dev = 0;
            MM_GPU_CHECK(cudaGetDevice(&dev));
            if (!(attr_set & (1ull << (dev & 63)))) {
                MM_GPU_CHECK(cudaFuncSetAttribute(gemv_x_kernel<GROUPED>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  MV2_SMEM_MAX));
                attr_set |= 1ull << (dev & 63);
            }
            MM_GPU_CHECK(cudaLaunchKernelEx(&cfg, gemv_x_kernel<GROUPED>, a, wpt, ty));
            return MM_OK;
        }
        if (a.x_idx || a.y_idx || a.x_up || a.res)
            return MM_EUNSUPP; // only v2 takes these (mm_gpu_moe_matmul_rows checks first)
        switch (ng) {
        case 1: MM_GPU_CHECK(cudaLaunchKernelEx(&cfg, gemv_mma_kernel<1, GROUPED>, a, wpt)); break;
        case 2: MM_GPU_CHECK(cudaLaunchKernelEx(&cfg, gemv_mma_kernel<2, GROUPED>, a, wpt)); break;
        default: MM_GPU_CHECK(cudaLaunchKernelEx(&cfg, gemv_mma_kernel<4, GROUPED>, a, wpt)); break;
        }
        MM_GPU_CHECK(cudaGetLastError());
        return MM_OK;
    }
    if (dtype == MM_DTYPE_BF16 && path == MM_GPU_PATH_WG) {
        if (!wg_usable(a)) {
            mm_log_error("gpu: matmul path wgmma needs an sm_90 device, even n_in and 4-byte "
                         "aligned weights (n_in=%d)", a.n_in);
            return MM_EUNSUPP;
        }
        bool ran = false;
        const mm_err rv = launch_wg<GROUPED>(st, a, &ran);
        if (rv != MM_OK || ran)
            return rv;
        // not run (no workspace, or inside a capture without the cached W): GEMV v2 where it
        // takes the product (what ws_small_mode 2 took it from), else the mma.sync tiles; the
        // same bits
        if (!GROUPED && ws_small_mode() > 0 && a.n_rows <= MV2_DENSE_ROWS && gemv_x_smem(a, 8) > 0 &&
            (a.n_rows <= 32 || (long long)a.n_out * a.n_in * 2 <= MV2_DENSE_W_MAX))
            return launch<GROUPED>(st, MM_GPU_PATH_GEMV, dtype, a, per_tile_rows);
        path = MM_GPU_PATH_MMA;
    }
    if (dtype == MM_DTYPE_BF16 && path == MM_GPU_PATH_MMA) {
        // > 48 KiB of dynamic shared memory must be allowed once per device and kernel. The
        // flag is racy only in the harmless way (two threads both set the same attribute).
        static uint64_t attr_set[2];
        if (a.vec) {
            dim3 grid(mm_div_up(a.n_out, MA_BN), tiles(MA_BM));
            int dev = 0;
            MM_GPU_CHECK(cudaGetDevice(&dev));
            const uint64_t bit = 1ull << (dev & 63);
            if (!(attr_set[GROUPED] & bit)) {
                MM_GPU_CHECK(cudaFuncSetAttribute(gemm_mma_async_kernel<GROUPED>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, MA_SMEM));
                attr_set[GROUPED] |= bit;
            }
            gemm_mma_async_kernel<GROUPED><<<grid, MM_THREADS, MA_SMEM, st>>>(a);
        } else {
            dim3 grid(mm_div_up(a.n_out, MM_BN), tiles(MM_BM));
            gemm_mma_kernel<GROUPED><<<grid, MM_THREADS, 0, st>>>(a);
        }
        MM_GPU_CHECK(cudaGetLastError());
        return MM_OK;
    }
#endif
    if (path != MM_GPU_PATH_FMA) {
        mm_log_error("gpu: matmul path %d is not built for dtype %s on %s", path,
                     dtype == MM_DTYPE_BF16 ? "bf16" : "f16/f32", MM_GPU_VENDOR);
        return MM_EUNSUPP;
    }
    dim3 grid(mm_div_up(a.n_out, FMA_BN), tiles(FMA_BM));
    switch (dtype) {
    case MM_DTYPE_BF16: gemm_fma_kernel<MM_DTYPE_BF16, GROUPED><<<grid, FMA_THREADS, 0, st>>>(a); break;
    case MM_DTYPE_F16: gemm_fma_kernel<MM_DTYPE_F16, GROUPED><<<grid, FMA_THREADS, 0, st>>>(a); break;
    case MM_DTYPE_F32: gemm_fma_kernel<MM_DTYPE_F32, GROUPED><<<grid, FMA_THREADS, 0, st>>>(a); break;
    default: return MM_EINVAL;
    }
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// The path a product of `rows_per_tile` rows takes by default. Every path of one dtype gives
// the same bits, so this is a speed choice only.
static int default_path(int dtype, int rows_per_tile) {
    if (!MM_GPU_HAVE_WMMA || dtype != MM_DTYPE_BF16)
        return MM_GPU_PATH_FMA;
    return rows_per_tile <= 32 ? MM_GPU_PATH_GEMV : MM_GPU_PATH_MMA;
}

// default_path, with the wgmma tiles for prefill where this device and shape allow them, and
// GEMV v2 for dense products of up to MV2_DENSE_ROWS rows whose weights are at most
// MV2_DENSE_W_MAX (batch-64 decode: o_proj, q/k/v, router; not the LM head).
static int auto_path(int dtype, int rows_per_tile, const mm_mat_args &a) {
    int p = default_path(dtype, rows_per_tile);
#if MM_GPU_HAVE_WMMA
    if (p != MM_GPU_PATH_FMA && a.wg == NULL && a.n_rows > 8 && a.n_rows < 128 && ws_small_mode() > 0 &&
        wg_usable(a)) { // gemm_ws 28 where W's permuted copy is or can be cached (ws_small_mode)
        const bool v2 = a.n_rows <= MV2_DENSE_ROWS && gemv_x_smem(a, 8) > 0 &&
                        (p == MM_GPU_PATH_GEMV || (g_gemv_version >= 2 &&
                         (long long)a.n_out * a.n_in * 2 <= MV2_DENSE_W_MAX));
        const bool take = !v2 || (ws_small_mode() >= 2 && a.n_out >= 128 * WS_SMALL_TILES);
        if (take && wperm_fits(a, (a.n_in + WG_LDX - 1) / WG_LDX * WG_LDX))
            return MM_GPU_PATH_WG;
    }
    if (p == MM_GPU_PATH_MMA && a.wg == NULL && g_gemv_version >= 2 &&
        a.n_rows <= MV2_DENSE_ROWS && (long long)a.n_out * a.n_in * 2 <= MV2_DENSE_W_MAX &&
        gemv_x_smem(a, 8) > 0)
        p = MM_GPU_PATH_GEMV;
    if (p == MM_GPU_PATH_MMA && wg_usable(a))
        return MM_GPU_PATH_WG;
#else
    (void)a;
#endif
    return p;
}

static bool dtype_ok(int dtype) {
    return dtype == MM_DTYPE_BF16 || dtype == MM_DTYPE_F16 || dtype == MM_DTYPE_F32;
}

extern "C" mm_err mm_gpu_matmul(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                                const float *d_bias, const float *d_x, int64_t x_stride, float *d_y,
                                int64_t y_stride, int n_rows, int path) {
    if (d_w == NULL || d_x == NULL || d_y == NULL || n_rows < 0 || n_in <= 0 || n_out <= 0 ||
        !dtype_ok(dtype) || x_stride < n_in || y_stride < n_out) {
        mm_log_error("gpu: matmul: bad arguments (dtype=%d w=%p x=%p y=%p n_rows=%d n_in=%d "
                     "n_out=%d x_stride=%lld y_stride=%lld)", dtype, d_w, (const void *)d_x,
                     (void *)d_y, n_rows, n_in, n_out, (long long)x_stride, (long long)y_stride);
        return MM_EINVAL;
    }
    if (n_rows == 0)
        return MM_OK;
    mm_mat_args a = {d_x, x_stride, d_w, NULL, NULL, 1, n_rows, n_in, n_out, d_bias, d_y, y_stride,
                     0, NULL, NULL, NULL};
    a.vec = n_in % 8 == 0 && x_stride % 4 == 0 && aligned16(d_x) && aligned16(d_w);
#if MM_GPU_HAVE_WMMA
    if (dtype == MM_DTYPE_BF16 && (path == MM_GPU_PATH_SEG || (path < 0 && seg_auto(a)))) {
        bool ran = false;
        MM_TRY(launch_seg((cudaStream_t)stream, a, &ran));
        if (ran)
            return MM_OK;
    }
#endif
    if (path == MM_GPU_PATH_SEG)
        return MM_EUNSUPP;
    if (path < 0)
        path = auto_path(dtype, n_rows, a);
    return launch<false>((cudaStream_t)stream, path, dtype, a, n_rows);
}

// mm_gpu_matmul_res: mm_gpu_matmul (bf16, no bias) whose rows get the residual res added after
// the product in GEMV v2/v3's epilogue; MM_EUNSUPP (nothing issued) where the product would
// take another path.
extern "C" mm_err mm_gpu_matmul_res(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                                    const float *d_x, int64_t x_stride, const float *d_res,
                                    int64_t res_stride, float *d_y, int64_t y_stride, int n_rows) {
    if (d_w == NULL || d_x == NULL || d_y == NULL || d_res == NULL || n_rows < 0 || n_in <= 0 ||
        n_out <= 0 || !dtype_ok(dtype) || x_stride < n_in || y_stride < n_out ||
        res_stride < n_out)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
#if MM_GPU_HAVE_WMMA
    mm_mat_args a = {d_x, x_stride, d_w, NULL, NULL, 1, n_rows, n_in, n_out, NULL, d_y, y_stride,
                     0, NULL, NULL, NULL};
    a.vec = n_in % 8 == 0 && x_stride % 4 == 0 && aligned16(d_x) && aligned16(d_w);
    a.res = d_res;
    a.res_stride = res_stride;
    if (dtype == MM_DTYPE_BF16 && seg_auto(a)) { // gemm_seg's fold adds res as mv_store_y does
        bool ran = false;
        MM_TRY(launch_seg((cudaStream_t)stream, a, &ran));
        if (ran)
            return MM_OK;
    }
    // launch<false>'s GEMV v2/v3 condition: only their epilogue (mv_store_y) adds res
    if (dtype != MM_DTYPE_BF16 || auto_path(dtype, n_rows, a) != MM_GPU_PATH_GEMV ||
        n_rows > MV2_DENSE_ROWS || gemv_x_smem(a, min(n_rows, 8)) == 0)
        return MM_EUNSUPP;
    return launch<false>((cudaStream_t)stream, MM_GPU_PATH_GEMV, dtype, a, n_rows);
#else
    (void)stream, (void)res_stride, (void)y_stride;
    return MM_EUNSUPP;
#endif
}

extern "C" mm_err mm_gpu_moe_matmul(void *stream, int dtype, const void *const *d_w,
                                    const int32_t *d_offs, int n_experts, int n_out, int n_in,
                                    const float *d_x, int64_t x_stride, float *d_y,
                                    int64_t y_stride, int n_rows, int path) {
    if (d_w == NULL || d_offs == NULL || n_experts <= 0 || d_x == NULL || d_y == NULL ||
        n_rows < 0 || n_in <= 0 || n_out <= 0 || !dtype_ok(dtype) || x_stride < n_in ||
        y_stride < n_out) {
        mm_log_error("gpu: moe_matmul: bad arguments (dtype=%d n_experts=%d n_rows=%d n_in=%d "
                     "n_out=%d)", dtype, n_experts, n_rows, n_in, n_out);
        return MM_EINVAL;
    }
    if (n_rows == 0)
        return MM_OK;
    mm_mat_args a = {d_x, x_stride, NULL, d_w, d_offs, n_experts, n_rows, n_in, n_out, NULL, d_y,
                     y_stride, 0, NULL, NULL, NULL};
    // Per-expert matrices must start 16-byte aligned for the vector loads (buffer_alloc and
    // checkpoint tensors with n_in % 8 == 0 are).
    a.vec = n_in % 8 == 0 && x_stride % 4 == 0 && aligned16(d_x);
    const int active = min(n_experts, n_rows);
    const int per = (n_rows + active - 1) / active;
    if (path < 0)
        path = auto_path(dtype, per, a);
    return launch<true>((cudaStream_t)stream, path, dtype, a, per);
}

extern "C" mm_err mm_gpu_moe_matmul_rows(void *stream, int dtype, const void *const *d_w,
                                         const int32_t *d_offs, int n_experts, int n_out, int n_in,
                                         const float *d_x, int64_t x_stride,
                                         const int32_t *d_x_idx, const float *d_x_up, float *d_y,
                                         int64_t y_stride, const int32_t *d_y_idx, int n_rows) {
    if (d_w == NULL || d_offs == NULL || n_experts <= 0 || d_x == NULL || d_y == NULL ||
        n_rows < 0 || n_in <= 0 || n_out <= 0 || !dtype_ok(dtype) || x_stride < n_in ||
        y_stride < n_out) {
        mm_log_error("gpu: moe_matmul_rows: bad arguments (dtype=%d n_experts=%d n_rows=%d "
                     "n_in=%d n_out=%d)", dtype, n_experts, n_rows, n_in, n_out);
        return MM_EINVAL;
    }
    if (n_rows == 0)
        return MM_OK;
#if MM_GPU_HAVE_WMMA
    mm_mat_args a = {d_x, x_stride, NULL, d_w, d_offs, n_experts, n_rows, n_in, n_out, NULL, d_y,
                     y_stride, 0, d_x_idx, d_y_idx, d_x_up};
    a.vec = n_in % 8 == 0 && x_stride % 4 == 0 && aligned16(d_x);
    const int active = min(n_experts, n_rows);
    const int per = (n_rows + active - 1) / active;
    const int path = dtype == MM_DTYPE_BF16 ? auto_path(dtype, per, a) : MM_GPU_PATH_FMA;
    if (path == MM_GPU_PATH_WG && pf_fuse()) { // prefill: gemm_ws grouped with the rows inside
        bool ran = false;
        const mm_err rv = launch_wg<true>((cudaStream_t)stream, a, &ran);
        return rv != MM_OK ? rv : ran ? MM_OK : MM_EUNSUPP; // not ran: nothing was issued
    }
    if (path != MM_GPU_PATH_GEMV || gemv_x_smem(a, per) == 0)
        return MM_EUNSUPP;
    return launch<true>((cudaStream_t)stream, MM_GPU_PATH_GEMV, dtype, a, per);
#else
    (void)d_x_idx, (void)d_y_idx, (void)d_x_up;
    return MM_EUNSUPP;
#endif
}

#if MM_GPU_HAVE_WMMA
// MM_GPU_FFN_DEC (read once unless mm_gpu_set_ffn_dec set it): 0 leaves a decode step's MoE FFN
// to the caller's two calls. g_ffd_n counts the FFNs run here (tests). Taken up to XCAP1_ROWS
// rows: H200, 2026-11-30 16:51 UTC, batch 1 1824-1843 tok/s against 1810-1833 with the two
// calls (three pairs in turn; op by op 39.0 against 44.0 us per layer), batch 2 +1.3%, batch
// 4-16 (once each) 1-2% below the two calls.
static int g_ffd = -1;
static unsigned long long g_ffd_n;

// A decode step's MoE FFN (at most 16 rows, both products on GEMV v3, the stream's
// buffer for the [gate | up] rows: inside a capture only once an eager call made it): [gate; up]
// with PDL_LATE, then down with PDL_EARLY, so down's blocks look their tiles up and stream their
// W while [gate; up]'s last blocks run. The same launches as the caller's two calls otherwise:
// the same bits. *ran false: nothing issued.
static mm_err launch_ffn_dec(cudaStream_t st, const void *const *wgu, const void *const *wd,
                             const int32_t *offs, int E, int F, int D, const float *x,
                             int64_t x_stride, const int32_t *x_idx, float *y, int64_t y_stride,
                             const int32_t *y_idx, int n_rows, bool *ran) {
    *ran = false;
    // (v3 blocks of one 16-row tile: launch<true> then takes the warps per tile bulk_choice
    // takes below)
    if (!switch_on(&g_ffd, "MM_GPU_FFN_DEC") || gemv_bulk_mode() == 0 || !g_gemv_bulk_tpb1 ||
        n_rows > E || n_rows > XCAP1_ROWS || F % 8 != 0 ||
        (size_t)n_rows * 2 * F * 4 > FFD_G_BYTES)
        return MM_OK;
    mm_mat_args gu = {x, x_stride, NULL, wgu, offs, E, n_rows, D, 2 * F, NULL, NULL, 2 * F, 0,
                      x_idx, NULL, NULL, 0, PDL_LATE};
    gu.vec = D % 8 == 0 && x_stride % 4 == 0 && aligned16(x);
    mm_mat_args dn = {NULL, 2 * F, NULL, wd, offs, E, n_rows, F, D, NULL, y, y_stride, 0, NULL,
                      y_idx, NULL, 0, PDL_EARLY};
    dn.vec = 1; // the stream's rows: 16-byte aligned, stride 2 d_ff (d_ff % 8 == 0)
    // both must take GEMV v3 (launch<true>'s own choice, per tile rows 1): down's early reads rely
    // on [gate; up]'s late trigger
    int w3 = 0;
    if (gemv_x_smem(gu, 1) == 0 || gemv_x_smem(dn, 1) == 0 ||
        bulk_choice(&gu, MV_WARPS, &w3) == 0 || bulk_choice(&dn, MV_WARPS, &w3) == 0)
        return MM_OK;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MM_GPU_CHECK(cudaStreamIsCapturing(st, &cs));
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    char *buf = (char *)cws_get(st, dev, cs == cudaStreamCaptureStatusNone);
    if (buf == NULL)
        return MM_OK;
    float *g = (float *)(buf + CWS_BYTES);
    gu.y = g;
    dn.x = g;
    dn.x_up = g + F;
    MM_TRY(launch<true>(st, MM_GPU_PATH_GEMV, MM_DTYPE_BF16, gu, 1));
    MM_TRY(launch<true>(st, MM_GPU_PATH_GEMV, MM_DTYPE_BF16, dn, 1));
    __atomic_fetch_add(&g_ffd_n, 1ull, __ATOMIC_RELAXED);
    *ran = true;
    return MM_OK;
}
#endif

extern "C" mm_err mm_gpu_moe_ffn_rows(void *stream, int dtype, const void *const *d_wgu,
                                      const void *const *d_wd, const int32_t *d_offs, int n_experts,
                                      int d_ff, int d_model, const float *d_x, int64_t x_stride,
                                      const int32_t *d_x_idx, float *d_y, int64_t y_stride,
                                      const int32_t *d_y_idx, int n_rows) {
    if (d_wgu == NULL || d_wd == NULL || d_offs == NULL || n_experts <= 0 || d_x == NULL ||
        d_y == NULL || n_rows < 0 || d_ff <= 0 || d_ff > INT32_MAX / 2 || d_model <= 0 ||
        !dtype_ok(dtype) || x_stride < d_model || y_stride < d_model) {
        mm_log_error("gpu: moe_ffn_rows: bad arguments (dtype=%d n_experts=%d n_rows=%d d_ff=%d "
                     "d_model=%d)", dtype, n_experts, n_rows, d_ff, d_model);
        return MM_EINVAL;
    }
    if (n_rows == 0)
        return MM_OK;
#if MM_GPU_HAVE_WMMA
    if (dtype == MM_DTYPE_BF16) { // decode: GEMV v3's two launches, down's W streamed early
        bool ran = false;
        MM_TRY(launch_ffn_dec((cudaStream_t)stream, d_wgu, d_wd, d_offs, n_experts, d_ff, d_model,
                              d_x, x_stride, d_x_idx, d_y, y_stride, d_y_idx, n_rows, &ran));
        if (ran)
            return MM_OK;
    }
    // gemm_ws's interleaved tiles hold 8-feature groups; the products gemm_ws takes (bf16, >= 128
    // rows per expert on average, sm_90a), as mm_gpu_moe_matmul_rows would take each
    if (dtype != MM_DTYPE_BF16 || !pf_fuse() || !pf_glu() || d_ff % 8 != 0)
        return MM_EUNSUPP;
    mm_mat_args a = {d_x, x_stride, NULL, d_wgu, d_offs, n_experts, n_rows, d_model, 2 * d_ff, NULL,
                     NULL, 0, 0, d_x_idx, NULL, NULL};
    const int active = min(n_experts, n_rows);
    const int per = (n_rows + active - 1) / active;
    if (auto_path(dtype, per, a) != MM_GPU_PATH_WG)
        return MM_EUNSUPP;
    bool ran = false;
    const mm_err rv = launch_ffn((cudaStream_t)stream, a, d_wd, d_y, y_stride, d_y_idx, &ran);
    return rv != MM_OK ? rv : ran ? MM_OK : MM_EUNSUPP;
#else
    (void)d_x_idx, (void)d_y_idx;
    return MM_EUNSUPP;
#endif
}

extern "C" void mm_gpu_set_ffn_dec(int on) {
#if MM_GPU_HAVE_WMMA
    g_ffd = on < 0 ? -1 : on ? 1 : 0;
#else
    (void)on;
#endif
}

extern "C" unsigned long long mm_gpu_ffn_dec_launches(void) {
#if MM_GPU_HAVE_WMMA
    return __atomic_load_n(&g_ffd_n, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

extern "C" void mm_gpu_set_gemv_gtpb(int t) {
#if MM_GPU_HAVE_WMMA
    g_gemv_gtpb = t == 1 || t == 2 || t == 4 ? t : -1;
#else
    (void)t;
#endif
}

extern "C" void mm_gpu_set_gemv_xcap(int cap) {
#if MM_GPU_HAVE_WMMA
    g_gemv_xcap = cap == 1 || cap == 2 || cap == 4 || cap == 8 ? cap : -1;
#else
    (void)cap;
#endif
}

extern "C" void mm_gpu_set_conv_batch(int on) {
#if MM_GPU_HAVE_WMMA
    g_conv_batch = on < 0 ? -1 : on != 0;
#else
    (void)on;
#endif
}

extern "C" void mm_gpu_set_pf_swiglu_epi(int on) {
#if MM_GPU_HAVE_WMMA
    g_pf_glu = on < 0 ? -1 : on != 0;
#else
    (void)on;
#endif
}

// The prefill conversion and the grouped products' fused rows (above launch_wg): 1 on, 0 the
// earlier form (A/B runs; the same bits either way), -1 back to MM_GPU_PF_FUSE.
extern "C" void mm_gpu_set_prefill_fuse(int on) {
#if MM_GPU_HAVE_WMMA
    g_pf_fuse = on < 0 ? -1 : on != 0;
#else
    (void)on;
#endif
}

extern "C" void mm_gpu_set_gemv_version(int v) {
#if MM_GPU_HAVE_WMMA
    g_gemv_version = v >= 2 ? 2 : 1;
#else
    (void)v;
#endif
}

extern "C" void mm_gpu_set_gemv_bulk(int mode) {
#if MM_GPU_HAVE_WMMA
    g_gemv_bulk = mode >= 0 && mode <= 2 ? mode : -1;
#else
    (void)mode;
#endif
}

extern "C" unsigned long long mm_gpu_gemv_bulk_launches(void) {
#if MM_GPU_HAVE_WMMA
    return __atomic_load_n(&g_gemv_bulk_n, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

extern "C" void mm_gpu_set_gemm_tile(int variant) {
#if MM_GPU_HAVE_WMMA
    g_wg_tile = (variant >= 2 && variant <= 23) || variant == 25 || variant == 27 || (variant >= 28 && variant <= 30) ? variant : 0;
#else
    (void)variant;
#endif
}

extern "C" void mm_gpu_set_ws_small(int mode) {
#if MM_GPU_HAVE_WMMA
    g_ws_small = mode >= 0 && mode <= 2 ? mode : -1;
#else
    (void)mode;
#endif
}

extern "C" void mm_gpu_set_segsplit(int on) {
#if MM_GPU_HAVE_WMMA
    g_segsplit = on < 0 ? -1 : on ? 1 : 0;
#else
    (void)on;
#endif
}

extern "C" unsigned long long mm_gpu_segsplit_launches(void) {
#if MM_GPU_HAVE_WMMA
    return __atomic_load_n(&g_seg_n, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

extern "C" void mm_gpu_set_ws_small_half(int on) {
#if MM_GPU_HAVE_WMMA
    g_ws_half = on < 0 ? -1 : on ? 1 : 0;
#else
    (void)on;
#endif
}

extern "C" void mm_gpu_set_ws_small_bn64(int on) {
#if MM_GPU_HAVE_WMMA
    g_ws_bn64 = on < 0 ? -1 : on ? 1 : 0;
#else
    (void)on;
#endif
}

extern "C" unsigned long long mm_gpu_ws_small_launches(int variant) {
#if MM_GPU_HAVE_WMMA
    return variant >= 28 && variant <= 30 ? __atomic_load_n(&g_ws_small_n[variant - 28], __ATOMIC_RELAXED) : 0;
#else
    (void)variant;
    return 0;
#endif
}

extern "C" unsigned long long mm_gpu_wperm_epoch(void) {
#if MM_GPU_HAVE_WMMA
    return __atomic_load_n(&g_wp_epoch, __ATOMIC_ACQUIRE);
#else
    return 0;
#endif
}

extern "C" void mm_gpu_set_gemv_wpt(int wpt) {
#if MM_GPU_HAVE_WMMA
    g_gemv_wpt = wpt == 1 || wpt == 2 || wpt == 4 ? wpt : 0;
#else
    (void)wpt;
#endif
}

extern "C" void mm_gpu_set_pdl(int on) {
#if MM_GPU_HAVE_WMMA
    g_pdl = on != 0;
#else
    (void)on;
#endif
}
