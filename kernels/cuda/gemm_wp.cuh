// SPDX-License-Identifier: MIT
// Prefill GEMM on wgmma with warp specialisation (sm_90a), included by matmul.cu after
// gemm_wg.cuh (whose helpers, wg_perm32 order and descriptors it shares). gemm_wp: dense
// products only; gemm_ws: dense and grouped (variants 19, 20).
// Two kernels: gemm_wp_kernel (W from registers, variants 8-10, below) and gemm_ws_kernel (both
// operands from shared memory by bulk copies, variants 11-18, further down; 14 and 13 are the
// dense defaults: kernels/cuda/bench/NOTES.md versions 7 and 8).
//
// Same bits as the decode GEMV (kernels.h), by the same argument as gemm_wg.cuh, with one
// change in how W reaches the tensor cores: W is the A operand *from registers*. The A
// fragment of wgmma m64nNk16 is, per warp of the warpgroup (16 rows each), the fragment of
// mma.sync m16n8k16; each consumer thread loads, per row g and g+8 and 32-chunk of k, the 16
// bytes at physical k 8t..8t+7 (ld.shared.v4) and feeds words {0, 1} to k16 step 0 and {2, 3}
// to step 1 in the slots the GEMV gives them (a0a1 = row g word 2s, a2a3 = row g+8, a4a5 = row
// g word 2s+1, a6a7 = row g+8): the GEMV's A registers, unchanged. So W can sit in shared
// memory in its physical order, and arrives there by bulk copies (cp.async.bulk, one
// 128-byte row piece per copy, no per-element work). x (the B operand) comes from shared
// memory in the GEMV's slot order as before; the conversion kernel writes it k-block major
// and already 128-byte swizzled (wg_convert_x_kernel<true>), so one bulk copy brings a whole
// x tile (BN token rows x 64 k) into the layout wgmma reads.
//
// Block: 9 warps. Warpgroups 0 and 1 are the consumers, each 64 outputs x BN tokens; warp 8
// is the producer (it issues every copy). BN is 128: the accumulators take BN registers per
// thread and ptxas allocates at most 168 here (BN 192 built with __maxnreg__(224) did not
// launch on the H200: "too many resources requested for launch", run of 21:52 UTC; with a
// producer warpgroup and setmaxnreg, ptxas still allocates for 65536 / 384 = 168 and
// spills). Accumulators accumulators as in gemm_wg.cuh (running segment + total, drained at
// segment ends). Ring of ST stages of 64 k: full[s] (transaction-count mbarrier the copies
// complete) and empty[s] (one arrival per consumer warp once the wgmmas reading stage s are
// done).
#ifndef MM_GEMM_WP_CUH
#define MM_GEMM_WP_CUH

__host__ __device__ constexpr int wp_x_bytes(int bn) { return bn * 128; }
__host__ __device__ constexpr int wp_stage_bytes(int bn) { return bn * 128 + 128 * 128; }
__host__ __device__ constexpr int wp_smem_bytes(int bn, int st) {
    return st * wp_stage_bytes(bn) + 1024 + 2 * st * 8; // + alignment slack + barriers
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_rs_m64n128k16(float d[64], const uint32_t a[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
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
__device__ __forceinline__ void wgmma_rs_m64n192k16(float d[96], const uint32_t a[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
                 " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
                 " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
                 "{%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
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
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
          "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <int BN>
__device__ __forceinline__ void wgmma_rs_tile(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t db) {
    if constexpr (BN == 192)
        wgmma_rs_m64n192k16(d, a, db);
    else
        wgmma_rs_m64n128k16(d, a, db);
}
__device__ __forceinline__ void wp_bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wp_bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void wp_bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits for the completion of the barrier's phase with this parity. A wait longer than ~4 s
// means a broken ring (a bug): trap rather than hang the stream.
__device__ __forceinline__ void wp_bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    uint64_t t0 = 0;
    for (uint32_t n = 0;; n++) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (done)
            return;
        if ((n & 0xffffu) == 0) {
            uint64_t now;
            asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
            if (n == 0)
                t0 = now;
            else if (now - t0 > 4000000000ull)
                __trap();
        }
    }
}
// The same wait as one asm block: the loop stays invisible to the compiler, so code after it is
// not a divergent path (ptxas serialises wgmmas that follow a compiler-inserted warpgroup
// arrive in a divergent path, C7520). Traps after 2^26 polls (a broken ring).
__device__ __forceinline__ void wp_bar_wait_asm(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\n.reg .u32 n;\nmov.u32 n, 0;\n"
                 "WS_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@p bra WS_DONE;\n"
                 "add.u32 n, n, 1;\n"
                 "setp.lt.u32 p, n, 67108864;\n"
                 "@p bra WS_WAIT;\n"
                 "trap;\n"
                 "WS_DONE:\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// bytes (multiple of 16) from global src to shared dst, completing on mbarrier bar.
__device__ __forceinline__ void wp_bulk(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Pins A-fragment registers in place (no instruction): their definition stays before the
// wgmma.fence, and nothing moves into the pipeline stage that reads them.
__device__ __forceinline__ void wp_fence_regs(uint32_t (&r)[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++)
        asm volatile("" : "+r"(r[i])::"memory");
}

__device__ __forceinline__ uint4 wp_lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
#endif

// a.xb: the k-block-major swizzled workspace (wg_convert_x_kernel<true>); dense; n_in % 8 == 0
// and W 16-byte aligned (bulk copies).
#define WP_THREADS 288
// WM, how W reaches shared memory: WP_W_ROWS one bulk copy per row (128 per stage); WP_W_TMA one
// TMA tile copy per stage (wmap: W as a 2-d tensor, 64 k x 128 row boxes, no swizzle, zeros out
// of bounds); WP_W_CPASYNC 16-byte cp.async by the producer's 32 lanes (32 each per stage,
// zero-filled out of range), each lane's completion arriving on the stage's full barrier
// (cp.async.mbarrier.arrive.noinc). W is read by ld.shared (generic proxy), so the cp.async
// writes need no proxy fence; x still comes by bulk copy.
#define WP_W_ROWS 0
#define WP_W_TMA 1
#define WP_W_CPASYNC 2
template <int BN, int ST, int WM>
__global__ void __launch_bounds__(WP_THREADS, 1) gemm_wp_kernel(mm_wg_args a, const __grid_constant__ CUtensorMap wmap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(BN == 128, "accumulators for BN > 128 do not fit the 168 registers of 288 threads");
    extern __shared__ __align__(1024) unsigned char wp_smem_raw[];
    constexpr int SB = wp_stage_bytes(BN), XB = wp_x_bytes(BN);
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(wp_smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    const uint32_t full0 = sbase + ST * SB, empty0 = full0 + 8 * ST;
    const int m0 = blockIdx.y * BN, mlen = min(BN, a.n_rows - m0);
    const int n0 = blockIdx.x * 128;
    const int n_k = (a.n_in + 63) / 64;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            // the producer's expect_tx arrival, plus one per lane for cp.async W
            wp_bar_init(full0 + 8 * s, WM == WP_W_CPASYNC ? 1 + 32 : 1);
            wp_bar_init(empty0 + 8 * s, 8); // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (mlen <= 0)
        return;
    if (warp == 8) { // producer warp
        const uint16_t *w = (const uint16_t *)a.w0;
        const int wrows = min(128, a.n_out - n0);
        for (int kt = 0; kt < n_k; kt++) {
            const int s = kt % ST;
            if (kt >= ST)
                wp_bar_wait(empty0 + 8 * s, (uint32_t)((kt / ST - 1) & 1));
            const int k0 = 64 * kt;
            const uint32_t wbytes = (uint32_t)min(64, a.n_in - k0) * 2;
            const uint32_t xbytes = (uint32_t)mlen * 128;
            const uint32_t full = full0 + 8 * s, st = sbase + s * SB;
            if (WM == WP_W_CPASYNC) {
                if (lane == 0) {
                    wp_bar_expect(full, xbytes);
                    wp_bulk(st, a.xb + ((size_t)kt * a.n_rows + m0) * 64, xbytes, full);
                }
                // lane l: rows l, l + 32, l + 64, l + 96, all 8 pieces of 16 bytes
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = lane + 32 * i;
#pragma unroll
                    for (int c = 0; c < 8; c++) {
                        const bool ok = r < wrows && k0 + 8 * c < a.n_in;
                        const uint16_t *src = ok ? w + (size_t)(n0 + r) * a.n_in + k0 + 8 * c : w;
                        cp_async16_s(st + XB + r * 128 + 16 * c, src, ok);
                    }
                }
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
                continue;
            }
            if (WM == WP_W_TMA) { // the box's bytes count in full, zeros included
                if (lane == 0) {
                    wp_bar_expect(full, xbytes + 128 * 128);
                    wp_bulk(st, a.xb + ((size_t)kt * a.n_rows + m0) * 64, xbytes, full);
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                                 " [%0], [%1, {%2, %3}], [%4];\n"
                                 ::"r"(st + XB), "l"((uint64_t)&wmap), "r"(k0), "r"(n0), "r"(full)
                                 : "memory");
                }
                continue;
            }
            if (lane == 0) {
                wp_bar_expect(full, xbytes + (uint32_t)wrows * wbytes);
                wp_bulk(st, a.xb + ((size_t)kt * a.n_rows + m0) * 64, xbytes, full);
            }
            __syncwarp();
            for (int r = lane; r < wrows; r += 32)
                wp_bulk(st + XB + r * 128, w + (size_t)(n0 + r) * a.n_in + k0, wbytes, full);
        }
        return;
    }
    const int wgi = warp >> 2, wl = warp & 3, g = lane >> 2, t = lane & 3;
    constexpr int NA = BN / 2;
    float acc[NA], tot[NA];
#pragma unroll
    for (int i = 0; i < NA; i++)
        acc[i] = tot[i] = 0.0f;
    const int sl = seg_len(a.n_in);
    // this thread's W row g of its warp's 16, chunk t of a 32-chunk's 64 bytes
    const uint32_t wrow = (uint32_t)(XB + (64 * wgi + 16 * wl + g) * 128 + 16 * t);
    // One stage per iteration: every wgmma of the stage before has completed when this
    // stage's W registers are written (ptxas serialises wgmmas whose register operands are
    // defined while wgmmas are in flight: C7513), so each consumer keeps one stage (4 k16
    // wgmmas) in flight at a time and the other consumer warpgroup fills the gaps.
    for (int kt = 0; kt < n_k; kt++) {
        const int s = kt % ST;
        const uint32_t st = sbase + s * SB;
        wp_bar_wait(full0 + 8 * s, (uint32_t)((kt / ST) & 1));
        wg_wait<0>();
        if (kt >= 1) { // stage kt - 1's wgmmas are done: release it to the producer
            __syncwarp();
            if (lane == 0)
                wp_bar_arrive(empty0 + 8 * ((kt - 1) % ST));
        }
        uint32_t fr[2][8]; // [chunk][a-fragment of k16 step 0 | step 1]
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
            uint4 u0 = wp_lds128(st + wrow + 64 * cc), u1 = wp_lds128(st + wrow + 8 * 128 + 64 * cc);
            if (64 * kt + 32 * cc + 8 * t >= a.n_in) // past n_in (n_in % 8 == 0): zeros, as the GEMV
                u0 = u1 = make_uint4(0, 0, 0, 0);
            fr[cc][0] = u0.x, fr[cc][1] = u1.x, fr[cc][2] = u0.y, fr[cc][3] = u1.y;
            fr[cc][4] = u0.z, fr[cc][5] = u1.z, fr[cc][6] = u0.w, fr[cc][7] = u1.w;
            wp_fence_regs(fr[cc]);
        }
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
            const int kc = 64 * kt + 32 * cc;
            if (kc >= a.n_in)
                break;
            const uint64_t b0 = wg_desc(st) + (uint64_t)(4 * cc);
            const uint32_t fa[4] = {fr[cc][0], fr[cc][1], fr[cc][2], fr[cc][3]};
            const uint32_t fb[4] = {fr[cc][4], fr[cc][5], fr[cc][6], fr[cc][7]};
            wg_fence();
            wgmma_rs_tile<BN>(acc, fa, b0);
            wgmma_rs_tile<BN>(acc, fb, b0 + 2); // +32 bytes: the chunk's second k16
            wg_commit();
            if (kc + 32 >= a.n_in || (kc + 32) % sl == 0) { // end of a k segment: drain, add
                wg_wait<0>();
                wg_fence_regs<NA>(acc);
#pragma unroll
                for (int i = 0; i < NA; i++) {
                    tot[i] = tot[i] + acc[i];
                    acc[i] = 0.0f;
                }
            }
        }
        wp_fence_regs(fr[0]);
        wp_fence_regs(fr[1]);
    }
    wg_wait<0>();
    // tot[4j + 2h + c]: output row 64wgi + 16wl + g + 8h, token 8j + 2t + c.
    const int orow = n0 + 64 * wgi + 16 * wl + g;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int o = orow + 8 * h;
        if (o >= a.n_out)
            continue;
        const float b = a.bias ? a.bias[o] : 0.0f;
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int tok = 8 * j + 2 * t + c;
                if (tok < mlen) {
                    float v = tot[4 * j + 2 * h + c];
                    if (a.bias)
                        v = v + b;
                    a.y[(size_t)(m0 + tok) * a.y_stride + o] = v;
                }
            }
    }
#else
    (void)a;
    (void)wmap;
    __trap(); // the host launches this only on sm_90 parts, whose sm_90a image has the body
#endif
}

// ---- gemm_ws: warp-specialised, both operands from shared memory, both by bulk copies ------
// The same shared-memory contents as gemm_wg_kernel (W and x both in the GEMV's slot order,
// wg_perm32 inside every 32-chunk, 128-byte swizzle), so the same wgmma instructions sum the
// same products in the same order: the same bits. What changes is how they get there: W is
// permuted into a workspace (wg_convert_w_kernel, 10 us for q_proj's 16.8 MB; once per weight
// when matmul.cu's permuted-W cache keeps the copy, else once per product)
// in the k-block-major swizzled layout wg_convert_x_kernel<true> gives x, so one stage is two
// contiguous runs (128 W rows x 128 bytes, BN x rows x 128 bytes), each one bulk copy issued by
// one producer thread and completing on the stage's full mbarrier (async proxy to async proxy:
// no proxy fence). The consumer warpgroups (0 and 1, 64 outputs x BN tokens each) only wait,
// issue wgmmas and release stages; they do not synchronise with each other.
// The producer is a whole warpgroup (warps 8-11, 384 threads) that gives its registers to the
// consumers with setmaxnreg (producer 40, consumers 232; the roles are the two branches of one
// if/else, else ptxas allocates for the entry cap of 168 and spills). One producer warp (288
// threads) caps every thread at 168 (9 warps put 3 on one scheduler, whose 16384 registers
// give 170 each: also why gemm_wp's 128 x 192 form did not launch with 224) and, built here,
// had ptxas serialise its wgmmas (C7520).
// DUAL: two running accumulators (segment j in acc[j & 1]), so a segment end does not drain
// the tensor pipe: segment j - 1's sum is added to the total after the first chunk of segment j
// is issued and everything before it has completed (wgmma.wait_group 1); the sums are still
// added in segment order, each from zero. H200, q_proj 4096 tokens: 381 TFLOP/s with DUAL, 287
// with drains; persistent 399 (the dense default from 4096 rows).
// W workspace (wg_convert_w_kernel): k block kb (64 k) of output row r at (kb * n_out + r) * 64
// elements, its 16-byte pieces at c ^ (r & 7), slots permuted per 32-chunk, zeros past n_in.
// Grouped (wg != NULL): expert blockIdx.y's matrix wg[e] into wb + e * n_out * ldx; experts
// without rows (offs; NULL: all have) or without a matrix are skipped (their tiles never run).
// ilv (a [gate; up] matrix, n_out % 16 == 0, for WS_OPT_SWIGLU): output row r = 16b + 8h + g
// is source row h * n_out / 2 + 8b + g (gate and up of feature 8b + g in one 16-row group);
// each row's bytes are those of its source row.
__global__ void wg_convert_w_kernel(const uint16_t *w, int n_out, int n_in, uint16_t *wb, int64_t ldx,
                                    const void *const *wg = NULL, const int32_t *offs = NULL,
                                    int ilv = 0) {
    if (wg != NULL) {
        const int e = blockIdx.y;
        w = (const uint16_t *)wg[e];
        if (w == NULL || (offs != NULL && offs[e + 1] <= offs[e]))
            return;
        wb += (int64_t)e * n_out * ldx;
    }
    const int64_t per_row = ldx / 8, n = (int64_t)n_out * per_row;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / per_row;
        const int q = (int)(i % per_row), c = q >> 2, s = (q >> 1) & 1, h = q & 1;
        const int64_t src = ilv ? ((r >> 3) & 1) * (n_out / 2) + 8 * (r >> 4) + (r & 7) : r;
        const uint16_t *wr = w + src * n_in;
        uint32_t v[4];
#pragma unroll
        for (int t = 0; t < 4; t++) { // n_in even, W 4-byte aligned: k < n_in means k + 1 < n_in
            const int k = 32 * c + 8 * t + 4 * s + 2 * h;
            v[t] = k < n_in ? *(const uint32_t *)(wr + k) : 0u;
        }
        uint16_t *dst = wb + ((int64_t)(q >> 3) * n_out + r) * 64 + 8 * ((q & 7) ^ (int)(r & 7));
        *(uint4 *)dst = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The m64n64k16 (wgmma.cuh) and m64n32k16 forms of gemm_wg.cuh's wgmma_m64n128k16 (both operands
// from shared memory, the same descriptors: an N-row x tile is its first N rows). d[4j + 2h + c] is output
// row 16 * (warp % 4) + g + 8h, token 8j + 2t + c, as in the 128-token form, so the first N / 2
// registers of a 128-token accumulator array hold the same elements. An output element depends
// only on its A row, its B column and its old value: the same bits whatever N is.
__device__ __forceinline__ void wgmma_m64n32k16(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "%16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(scale_d));
}
// NB tokens of a BN-token accumulator array (NB <= BN; 128 and 192 as wgmma_tile)
template <int NB, int BN>
__device__ __forceinline__ void ws_wgmma(float (&d)[BN / 2], uint64_t da, uint64_t db, int scale_d = 1) {
    static_assert(NB <= BN, "a tile's tokens fit its accumulators");
    if constexpr (NB == 64)
        wgmma_m64n64k16(d, da, db, scale_d);
    else if constexpr (NB == 32)
        wgmma_m64n32k16(d, da, db, scale_d);
    else
        wgmma_tile<BN>(d, da, db, scale_d);
}
#endif
template <int N>
struct ws_int {
    static constexpr int value = N;
};

__host__ __device__ constexpr int ws_stage_bytes(int bn) { return 128 * 128 + bn * 128; }
#define WS_TSLOTS 8 // WS_OPT_PTILE: tile records in flight (> ST: see the producer)
// WS_OPT_STAGE's output tile: 128 token rows of 128 f32 outputs, 528 bytes apart (16-byte
// aligned rows for the bulk copies; 132 words, so the 4 token rows of a warp's store are 8
// banks apart: no bank conflicts)
#define WS_OUT_LD 132
#define WS_OUT_BYTES (128 * WS_OUT_LD * 4)
#define WS_OPT_STAGE 8
#define WS_OPT_SWIGLU 16
// WS_OPT_SWIGLU's output tile: 128 token rows of 64 bf16 values, one k block of down's x
// workspace (128 bytes per row, in the workspace's slot order and swizzle)
#define WS_GLU_BYTES (128 * 128)
__host__ __device__ constexpr int ws_smem_bytes(int bn, int st, int opt = 0) {
    // + alignment slack + the ring's barriers + WS_OPT_PTILE's barriers and records
    return st * ws_stage_bytes(bn) + 1024 + 2 * st * 8 + WS_TSLOTS * (8 + 16) +
           ((opt & WS_OPT_STAGE) ? WS_OUT_BYTES : (opt & WS_OPT_SWIGLU) ? WS_GLU_BYTES : 0);
}
#define WS_THREADS 384

// a.xb: x workspace (wg_convert_x_kernel<true>); wb: W workspace (wg_convert_w_kernel).
// Tiles (128 outputs x BN tokens, outputs fastest) are taken in a block-strided loop over a 1-d
// grid: one tile per block when the grid has one block per tile, persistent when it has one
// block per SM (the producer then fills the next tile's stages while the consumers store the
// last one's outputs). Stage uses are counted across tiles for the ring's slots and parities.
// GROUPED: token tile ty (tile / tiles_n) is the ty-th BN-row tile over the experts in order
// (mm_tile_find over a.offs, done by every warp on its own, so no block barrier per tile: the
// producer warp and each consumer warp find the same tile); tiles past the real count, or of
// an expert without a matrix, are skipped by all warps alike (no stage use). Expert e's W is
// at wb + e * n_out * ldx; x rows are swizzled relative to their expert's first row
// (wg_convert_x_kernel's offs), and every tile starts at that row + a multiple of BN.
// a.y_idx (grouped prefill through mm_gpu_moe_matmul_rows): product row p is stored to y row
// y_idx[p] (the MoE layer's scatter to (row, rank) slots, a copy: same bits).
// OPT (bits; 0 the earlier form, A/B): WS_OPT_IDX the epilogue loads the thread's y rows once
// per tile before its first store; WS_OPT_TAILN (DUAL, BN 128) a tile of <= 32 or <= 64 rows
// (an expert's last, partly empty tile) runs m64n32 / m64n64 wgmmas instead of m64n128: the
// tensor work of its empty rows is not done (the same stages, W and x bytes; the same bits);
// WS_OPT_PTILE (grouped) the producer warp publishes each tile it fills (first output, first
// row, rows) in a shared-memory record, so the consumer warps read it instead of each looking
// the tile up over the offsets (an L1/L2 round trip and a warp scan per tile, exposed between
// two tiles' wgmmas): record k (the k-th tile with rows) in slot k % WS_TSLOTS, written before
// the tile's first stage is filled and announced on the slot's barrier (one arrival, release);
// a record with rows == 0 ends the walk. The producer writes record k after the ring slot of
// its first stage has come back, i.e. once the consumers have started a tile at or past k - ST
// (every tile has a stage), so they have read record k - WS_TSLOTS (WS_TSLOTS > ST).
// WS_OPT_STAGE (WS_OUT_BYTES more shared memory: 4 stages then fit, not 6): the outputs go
// into a shared-memory tile (a row per token) and consumer thread r < mlen stores token row r
// (y row y_idx[m0 + r]) with one bulk copy (cp.async.bulk, 4 * min(128, n_out - n0) bytes), so
// the consumers issue 64 shared stores each instead of 64 global ones and go on to the next
// tile while the copy engine writes the rows. Needs 16-byte aligned rows (y, y_stride and n_out
// multiples of 4 floats), else the direct stores. Before the tile is written again, the
// threads that issued copies wait until those have read it (bulk wait_group.read), then a
// named barrier (2) of the 256 consumer threads; the writes are made visible to the copies by
// fence.proxy.async and the same barrier. The same values: the same bits.
// WS_OPT_SWIGLU (grouped, not with STAGE; the MoE layer's [gate; up] product,
// mm_gpu_moe_ffn_rows): W is the interleaved [gate; up] copy (wg_convert_w_kernel's ilv: tile
// row 16b + 8h + g of output tile T is gate (h = 0) or up (h = 1) of feature 64T + 8b + g), so
// a consumer thread holds gate and up of one feature for its 32 tokens (tot[4j + c] and
// tot[4j + 2 + c]: the same f32 sums the plain product stores, as only which tile computes an
// output changed, not its k order). The epilogue applies mv2_swiglu (swiglu_kernel's
// expression, as wg_convert_rows_kernel does with x_up) and rounds pairs of features by
// pack_bf16 (the lane holding feature g ^ 1 swaps one value by shuffle), writing the 32-bit
// words into a shared-memory tile laid out as down's x workspace (k block T = features 64T ..
// 64T + 63, 128 bytes per row, slots permuted per 32-chunk, 16-byte pieces at q ^ (row & 7):
// the tile's rows start at their expert's first row + a multiple of 128, so row & 7 is the
// swizzle relative to the expert's first row); features >= n_out / 2 are zeros (the
// conversion's zeros past n_in). Then one consumer thread stores the tile's mlen rows with one
// bulk copy to a.xo + (T * n_rows + m0) * 64: the bytes wg_convert_rows_kernel writes from the
// stored f32 [gate; up] with x_up. Before the tile is written again the copy has read it
// (bulk wait_group.read by the issuing thread, then named barrier 2 of the 256 consumers).
// WS_OPT_HALFN (dense, DUAL, BN 64, none of the other bits): a tile is 64 outputs x 64 tokens,
// both warpgroups on its 64 W rows, warpgroup i on tokens 32i..32i+31 (m64n32 wgmmas): twice the
// tiles (and SMs) of 128-output tiles for products with few outputs (o_proj, q/k/v at batch 64);
// each output's k order is unchanged: the same bits.
#define WS_OPT_IDX 1
#define WS_OPT_TAILN 2
#define WS_OPT_PTILE 4
#define WS_OPT_HALFN 32
template <int BN, int ST, bool DUAL, bool LAG, bool GROUPED = false, int OPT = 0>
__global__ void __launch_bounds__(WS_THREADS, 1) gemm_ws_kernel(mm_wg_args a, const uint16_t *wb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert((OPT & WS_OPT_TAILN) == 0 || (DUAL && BN == 128), "TAILN: two accumulators, 128 tokens");
    static_assert((OPT & WS_OPT_PTILE) == 0 || (GROUPED && ST < WS_TSLOTS), "PTILE: grouped");
    static_assert((OPT & WS_OPT_STAGE) == 0 || BN == 128, "STAGE: 128 tokens");
    static_assert((OPT & WS_OPT_SWIGLU) == 0 || (GROUPED && BN == 128 && (OPT & WS_OPT_STAGE) == 0),
                  "SWIGLU: grouped, 128 tokens, not STAGE");
    constexpr bool PTILE = (OPT & WS_OPT_PTILE) != 0, STAGE = (OPT & WS_OPT_STAGE) != 0;
    constexpr bool GLU = (OPT & WS_OPT_SWIGLU) != 0;
    constexpr bool HALFN = (OPT & WS_OPT_HALFN) != 0;
    static_assert(!HALFN || (OPT == WS_OPT_HALFN && DUAL && BN == 64 && !GROUPED && !LAG),
                  "HALFN: dense, two accumulators, 64 tokens, alone");
    constexpr int TM = HALFN ? 64 : 128; // outputs per tile
    extern __shared__ __align__(1024) unsigned char ws_smem_raw[];
    constexpr int SB = ws_stage_bytes(BN), WB = 128 * 128, NA = BN / 2;
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(ws_smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    const uint32_t obuf = sbase + ST * SB; // STAGE, SWIGLU: the output tile
    const uint32_t full0 = obuf + (STAGE ? WS_OUT_BYTES : GLU ? WS_GLU_BYTES : 0), empty0 = full0 + 8 * ST;
    const uint32_t tbar0 = empty0 + 8 * ST, trec0 = tbar0 + 8 * WS_TSLOTS; // PTILE (16-byte aligned)
    const int tiles_n = (a.n_out + TM - 1) / TM;
    const int tiles_y = GROUPED ? a.n_rows / BN + min(a.n_experts, a.n_rows) : (a.n_rows + BN - 1) / BN;
    const int n_tiles = tiles_n * tiles_y;
    const int n_k = (a.n_in + 63) / 64;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // The tile's first output, first row, rows and W; false: no such tile (grouped). Grouped:
    // called by whole warps (mm_tile_find).
    auto tile_at = [&](int tile, int &n0, int &m0, int &mlen, const uint16_t *&wt) -> bool {
        n0 = tile % tiles_n * TM;
        if constexpr (GROUPED) {
            const mm_tile t = mm_tile_find(a.offs, a.n_experts, BN, tile / tiles_n);
            m0 = t.m0, mlen = t.mlen;
            wt = wb + (size_t)t.e * a.n_out * a.ldx;
            return t.mlen > 0 && a.wg[t.e] != NULL;
        } else {
            m0 = tile / tiles_n * BN, mlen = min(BN, a.n_rows - m0);
            wt = wb;
            return true;
        }
    };
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            wp_bar_init(full0 + 8 * s, 1);  // the producer's expect_tx arrival
            wp_bar_init(empty0 + 8 * s, 8); // one arrival per consumer warp
        }
        if (PTILE)
            for (int i = 0; i < WS_TSLOTS; i++)
                wp_bar_init(tbar0 + 8 * i, 1); // the producer's arrival
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp >= 8) { // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        // dense: lane 0 of warp 8 alone; grouped: all of warp 8 (the tile lookup is a warp
        // scan), lane 0 issuing
        if (warp == 8 && (GROUPED || lane == 0)) {
            int u = 0;  // stage uses so far
            int nt = 0; // PTILE: tiles published so far
            // PTILE: record nt (rows 0: the end), once stage use u's slot has come back
            auto publish = [&](int n0, int m0, int mlen) {
                if (u >= ST)
                    wp_bar_wait(empty0 + 8 * (u % ST), (uint32_t)((u / ST - 1) & 1));
                if (lane == 0) {
                    const uint32_t rec = trec0 + 16 * (nt % WS_TSLOTS);
                    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(rec), "r"(n0),
                                 "r"(m0), "r"(mlen), "r"(0) : "memory");
                    wp_bar_arrive(tbar0 + 8 * (nt % WS_TSLOTS));
                }
                nt++;
            };
            for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
                int n0, m0, mlen;
                const uint16_t *wt;
                if (!tile_at(tile, n0, m0, mlen, wt))
                    continue;
                if constexpr (PTILE)
                    publish(n0, m0, mlen);
                const uint32_t xbytes = (uint32_t)mlen * 128;
                const uint32_t wbytes = (uint32_t)min(TM, a.n_out - n0) * 128;
                for (int kt = 0; kt < n_k; kt++, u++) {
                    const int s = u % ST;
                    if (u >= ST)
                        wp_bar_wait(empty0 + 8 * s, (uint32_t)((u / ST - 1) & 1));
                    if (lane == 0) {
                        const uint32_t full = full0 + 8 * s, st = sbase + s * SB;
                        wp_bar_expect(full, wbytes + xbytes);
                        wp_bulk(st, wt + ((size_t)kt * a.n_out + n0) * 64, wbytes, full);
                        wp_bulk(st + WB, a.xb + ((size_t)kt * a.n_rows + m0) * 64, xbytes, full);
                    }
                }
            }
            if constexpr (PTILE)
                publish(0, 0, 0); // the end
        }
    } else { // consumers: warpgroups 0 and 1
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int wgi = warp >> 2;
        const int sl = seg_len(a.n_in);
        float tot[NA];
        int u0 = 0;                  // stage uses before this tile
        auto release = [&](int kt) { // every wgmma reading the tile's stage kt has completed
            __syncwarp();
            if (lane == 0)
                wp_bar_arrive(empty0 + 8 * ((u0 + kt) % ST));
        };
        // chunk ch (32 k) of an NB-token tile: wait for its stage, 2 wgmmas; fresh: the first
        // ignores acc (D = A * B)
        auto issue = [&](auto nbc, float (&acc)[BN / 2], int ch, bool fresh) {
            constexpr int NB = decltype(nbc)::value;
            const int u = u0 + (ch >> 1), cc = ch & 1, s = u % ST;
            if (cc == 0)
                wp_bar_wait_asm(full0 + 8 * s, (uint32_t)((u / ST) & 1));
            const uint32_t stage = sbase + s * SB;
            const uint64_t half = (uint64_t)(4 * cc);
            const uint64_t a0 = wg_desc(stage + (HALFN ? 0 : wgi * (64 * 128))) + half;
            const uint64_t b0 = wg_desc(stage + WB + (HALFN ? wgi * (BN / 2) * 128 : 0)) + half;
            wg_fence();
            ws_wgmma<NB, BN>(acc, a0, b0, fresh ? 0 : 1);
            ws_wgmma<NB, BN>(acc, a0 + 2, b0 + 2); // +32 bytes: the chunk's second k16
        };
        auto add = [&](auto nbc, float (&acc)[BN / 2]) { // the first NB tokens' sums
            constexpr int NB = decltype(nbc)::value;
            wg_fence_regs<NA>(acc);
#pragma unroll
            for (int i = 0; i < NB / 2; i++) {
                tot[i] = tot[i] + acc[i];
                if constexpr (!DUAL)
                    acc[i] = 0.0f;
            }
        };
        // LAG: warpgroup 1 starts each tile once warpgroup 0 has finished the tile's first two
        // stages (named barrier 1: 128 arrivals + 128 waiters), so that the two do not drain,
        // store outputs or wait for a tile's first stage at the same time. Only where a tile is
        // longer than the ring by 2 stages: warpgroup 0 can then not reach stage 1 of the next
        // tile before warpgroup 1 has started this one, so each arrival meets its own wait.
        const bool lag = LAG && n_k >= ST + 2;
        auto lag_mark = [&](int ch) { // chunk ch of the tile is issued
            if (lag && wgi == 0 && ch == 3)
                asm volatile("bar.arrive 1, 256;\n" ::: "memory");
        };
        const int nch = (a.n_in + 31) / 32;
        // (The generic lambdas' parameters say BN / 2, not NA: a local constexpr in a generic
        // lambda's parameter type crashes cicc, CUDA 13.0.)
        // The tile's k loop on NB-token wgmmas (NB < BN: WS_OPT_TAILN, a tile of <= NB rows),
        // its sums in tot[0 .. NB / 2); ends with every wgmma of the tile completed.
        auto k_loop = [&](auto nbc) {
            if constexpr (!DUAL) {
                float acc[NA];
#pragma unroll
                for (int i = 0; i < NA; i++)
                    acc[i] = 0.0f;
                for (int kt = 0; kt < n_k; kt++) {
#pragma unroll
                    for (int cc = 0; cc < 2; cc++) {
                        const int ch = 2 * kt + cc;
                        if (ch >= nch)
                            break;
                        issue(nbc, acc, ch, false);
                        lag_mark(ch);
                        if (32 * (ch + 1) >= a.n_in || (32 * (ch + 1)) % sl == 0) { // segment end: drain
                            wg_commit();
                            wg_wait<0>();
                            add(nbc, acc);
                        }
                    }
                    wg_commit();
                    wg_wait<1>(); // stage kt - 1's wgmmas are done
                    if (kt >= 1)
                        release(kt - 1);
                }
                wg_wait<0>();
            } else {
                // No instruction but wgmma writes acc0/acc1 (ptxas serialises every wgmma when
                // one does while wgmmas are in flight, C7515): a segment's first wgmma ignores the
                // old value (scale-d 0, D = A * B) instead of a zeroed accumulator. The sum is the
                // same except that an exactly-zero segment sum may be -0 instead of +0, which
                // the total (from +0, round to nearest) turns into the same +0.
                // Zeroed here, where no wgmma is in flight, only so that their registers are
                // dead (not carried from the last tile) while the outputs are stored.
                float acc0[NA], acc1[NA];
#pragma unroll
                for (int i = 0; i < NA; i++)
                    acc0[i] = acc1[i] = 0.0f;
                const int cps = sl / 32; // chunks per segment
                // One segment into `cur`; `prev` holds the segment before (none when first).
                auto segment = [&](float (&cur)[NA], float (&prev)[NA], int c0, bool first) {
                    const int c1 = min(nch, c0 + cps);
                    for (int ch = c0; ch < c1; ch++) {
                        issue(nbc, cur, ch, ch == c0);
                        wg_commit();
                        lag_mark(ch);
                        if (ch == c0) {
                            wg_wait<1>(); // everything before this chunk, so the previous segment
                            if (!first)
                                add(nbc, prev);
                        } else {
                            wg_wait<2>();
                        }
                        // chunk ch - 1 (or ch - 2) completed: release its stage once both its chunks have
                        if ((ch & 1) == 1 && ch >= 3)
                            release((ch >> 1) - 1);
                    }
                };
                bool last_odd = false;
                for (int seg = 0; seg * cps < nch; seg += 2) {
                    segment(acc0, acc1, seg * cps, seg == 0);
                    last_odd = false;
                    if ((seg + 1) * cps >= nch)
                        break;
                    segment(acc1, acc0, (seg + 1) * cps, false);
                    last_odd = true;
                }
                wg_wait<0>();
                if (last_odd)
                    add(nbc, acc1);
                else
                    add(nbc, acc0);
                if (nch % 2 == 1 && n_k >= 2) // its last stage has one chunk: no release above
                    release(n_k - 2);
            }
        };
        // The tile's outputs, the first NB tokens of tot (tokens past mlen are not stored).
        // tot[4j + 2h + c]: output row 64wgi + 16(warp%4) + g + 8h, token 8j + 2t + c.
        // WS_OPT_IDX: the thread's y rows (y_idx) are loaded once, all before the first store
        // (the stores may alias y_idx for the compiler, so without it each store waits for a
        // load issued after the store before it).
        // STAGE: rows 16-byte aligned (else the direct stores below)
        const bool staged = STAGE && ((uintptr_t)a.y & 15) == 0 && a.y_stride % 4 == 0 && a.n_out % 4 == 0;
        bool copies = false; // STAGE: this thread has bulk copies in flight
        auto store = [&](auto nbc, int n0, int m0, int mlen) {
            constexpr int NB = decltype(nbc)::value;
            const int g = lane >> 2, t = lane & 3;
            const int orow = n0 + (HALFN ? 0 : 64 * wgi) + 16 * (warp & 3) + g;
            if constexpr (GLU) {
                if (copies) // thread 0: the last tile's copy has read the tile
                    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                asm volatile("bar.sync 2, 256;\n" ::: "memory");
                const int b = 4 * wgi + (warp & 3);  // 8-feature block of the tile
                const int fl = 8 * b + g;             // this thread's feature in the tile
                const bool live = n0 / 2 + fl < a.n_out / 2;
                const bool odd = (g & 1) != 0;
                // word (features fl & ~1, fl | 1) of a row: 32-chunk b >> 2, piece 4(b >> 2) +
                // (g >> 1) before the swizzle, word b & 3 in the piece
                const int ql = 4 * (b >> 2) + (g >> 1);
#pragma unroll
                for (int j = 0; j < NB / 8; j++) {
                    float v[2];
#pragma unroll
                    for (int c = 0; c < 2; c++)
                        v[c] = live ? mv2_swiglu(tot[4 * j + c], tot[4 * j + 2 + c]) : 0.0f;
                    // even g keeps token 8j + 2t, odd g token 8j + 2t + 1
                    const float o = __shfl_xor_sync(0xffffffffu, odd ? v[0] : v[1], 4);
                    const uint32_t wd = odd ? pack_bf16(o, v[1]) : pack_bf16(v[0], o);
                    const int tok = 8 * j + 2 * t + (odd ? 1 : 0);
                    const uint32_t ad = obuf + (uint32_t)(tok * 128 + 16 * (ql ^ (tok & 7)) + 4 * (b & 3));
                    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ad), "r"(wd) : "memory");
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                asm volatile("bar.sync 2, 256;\n" ::: "memory");
                if (threadIdx.x == 0) {
                    const uint16_t *dst = a.xo + ((size_t)(n0 / 128) * a.n_rows + m0) * 64;
                    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                                 ::"l"(dst), "r"(obuf), "r"((uint32_t)mlen * 128u) : "memory");
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    copies = true;
                }
                return;
            }
            if constexpr (STAGE) {
                if (staged) {
                    if (copies) // the last tile's copies have read the tile
                        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                    asm volatile("bar.sync 2, 256;\n" ::: "memory");
                    const int ol = orow - n0; // output column in the tile
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int o = orow + 8 * h;
                        const float b = a.bias && o < a.n_out ? a.bias[o] : 0.0f;
#pragma unroll
                        for (int j = 0; j < NB / 8; j++)
#pragma unroll
                            for (int c = 0; c < 2; c++) {
                                float v = tot[4 * j + 2 * h + c];
                                if (a.bias)
                                    v = v + b;
                                const uint32_t ad = obuf + (uint32_t)(((8 * j + 2 * t + c) * WS_OUT_LD + ol + 8 * h) * 4);
                                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(ad), "f"(v) : "memory");
                            }
                    }
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    asm volatile("bar.sync 2, 256;\n" ::: "memory");
                    const int r = threadIdx.x; // consumer thread r: token row r
                    copies = r < mlen;
                    if (copies) {
                        const int64_t yr = a.y_idx ? (int64_t)a.y_idx[m0 + r] : (int64_t)(m0 + r);
                        const uint32_t bytes = (uint32_t)min(128, a.n_out - n0) * 4;
                        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                                     ::"l"(a.y + (size_t)yr * a.y_stride + n0),
                                     "r"(obuf + (uint32_t)(r * WS_OUT_LD * 4)), "r"(bytes) : "memory");
                        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    }
                    return;
                }
            }
            constexpr int NY = (OPT & WS_OPT_IDX) ? NB / 4 : 1;
            int yrow[NY]; // [2j + c]: y row of token 8j + 2t + c, -1 past mlen
            if constexpr ((OPT & WS_OPT_IDX) != 0) {
#pragma unroll
                for (int j = 0; j < NB / 8; j++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const int tok = 8 * j + 2 * t + c;
                        yrow[2 * j + c] = tok >= mlen ? -1 : a.y_idx ? a.y_idx[m0 + tok] : m0 + tok;
                    }
            }
            (void)yrow;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int o = orow + 8 * h;
                if (o >= a.n_out)
                    continue;
                const float b = a.bias ? a.bias[o] : 0.0f;
#pragma unroll
                for (int j = 0; j < NB / 8; j++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        if constexpr ((OPT & WS_OPT_IDX) != 0) {
                            if (yrow[2 * j + c] >= 0) {
                                float v = tot[4 * j + 2 * h + c];
                                if (a.bias)
                                    v = v + b;
                                a.y[(size_t)yrow[2 * j + c] * a.y_stride + o] = v;
                            }
                        } else {
                            const int tok = (HALFN ? wgi * (BN / 2) : 0) + 8 * j + 2 * t + c;
                            if (tok < mlen) {
                                float v = tot[4 * j + 2 * h + c];
                                if (a.bias)
                                    v = v + b;
                                const int64_t yr = a.y_idx ? (int64_t)a.y_idx[m0 + tok] : (int64_t)(m0 + tok);
                                a.y[(size_t)yr * a.y_stride + o] = v;
                            }
                        }
                    }
            }
        };
        for (int tile = blockIdx.x, k = 0; PTILE || tile < n_tiles; tile += gridDim.x, k++) {
            int n0, m0, mlen;
            if constexpr (PTILE) { // the producer's record k
                wp_bar_wait_asm(tbar0 + 8 * (k % WS_TSLOTS), (uint32_t)((k / WS_TSLOTS) & 1));
                int z;
                asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(n0), "=r"(m0), "=r"(mlen), "=r"(z)
                             : "r"(trec0 + 16 * (k % WS_TSLOTS)) : "memory");
                (void)z;
                if (mlen == 0)
                    break;
            } else {
                const uint16_t *wt;
                if (!tile_at(tile, n0, m0, mlen, wt))
                    continue; // grouped: no stage use
                (void)wt;
            }
            if (lag && wgi == 1)
                asm volatile("bar.sync 1, 256;\n" ::: "memory");
#pragma unroll
            for (int i = 0; i < NA; i++)
                tot[i] = 0.0f;
            // every wgmma of the tile done: the last stage goes back to the producer, which
            // fills the ring with the next tile's k while this tile's outputs are stored
            auto run = [&](auto nbc) {
                k_loop(nbc);
                release(n_k - 1);
                store(nbc, n0, m0, mlen);
            };
            if constexpr ((OPT & WS_OPT_TAILN) != 0) {
                if (mlen <= 32)
                    run(ws_int<32>{});
                else if (mlen <= 64)
                    run(ws_int<64>{});
                else
                    run(ws_int<BN>{});
            } else {
                run(ws_int<HALFN ? BN / 2 : BN>{});
            }
            u0 += n_k;
        }
        if (copies) // every bulk copy complete before the block ends
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
#else
    (void)a;
    (void)wb;
    __trap(); // the host launches this only on sm_90 parts, whose sm_90a image has the body
#endif
}

#endif
