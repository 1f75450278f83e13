// SPDX-License-Identifier: MIT
// moemesh-gpu-bench: kernel-level GPU figures for docs/BENCHMARKS.md, all measured in one run
// against ceilings measured in the same run:
//   copy      device-to-device copy bandwidth (bytes read + written per second): the memory ceiling
//   gemv      bf16 decode products at Qwen3-30B-A3B shapes, batch 1..8, weights rotated over more
//             than the L2 so every call streams from HBM; fraction of the copy bandwidth
//   layer     one MoE layer's decode products at batch 1 (q, k, v, o, router, grouped gate/up/down
//             of 8 routed experts out of 128), replayed from a CUDA graph; bytes read / time
//   ffn       a decode step's MoE FFN (mm_gpu_moe_ffn_rows) against its routed experts, 1..8
//   moe64     grouped expert products at batch 64 (512 routed rows over 128 experts)
//   prefill   4096-token GEMMs in TFLOP/s per path (wgmma tiles, two block sizes; mma.sync
//             tiles; FMA), and the default path's bits against the decode GEMV; the bf16 peak
//             is passed with --peak-tflops (measured by the caller: torch bf16 8192^3 matmul)
// Usage: moemesh-gpu-bench [--device N] [--peak-tflops F] [--quick] [--only SECTION]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vendor.h"
#include "mm_gpu.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define MK(call)                                                                                   \
    do {                                                                                           \
        mm_err r_ = (call);                                                                        \
        if (r_ != MM_OK) {                                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, mm_strerror(r_));         \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static cudaStream_t g_stream;
static bool g_quick;
static const char *g_only; // run one section only (for profilers)
static bool want(const char *sec) { return g_only == NULL || strcmp(g_only, sec) == 0; }

// Random bf16 (uniform [-0.5, 0.5)) filled on the device; never zeros (METHOD.md).
__global__ void fill_bf16(uint16_t *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const float f = (float)(z >> 40) / 16777216.0f - 0.5f;
        p[i] = (uint16_t)(__float_as_uint(f) >> 16);
    }
}
__global__ void fill_f32(float *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + 7) * 0x9e3779b97f4a7c15ull ^ seed;
        z = (z ^ (z >> 29)) * 0xbf58476d1ce4e5b9ull;
        z ^= z >> 32;
        p[i] = (float)(z >> 40) / 8388608.0f - 1.0f;
    }
}

static void *dalloc(size_t n) {
    void *p = NULL;
    MK(mm_gpu_alloc(&p, n));
    return p;
}
static uint16_t *rand_bf16(size_t n, uint64_t seed) {
    uint16_t *p = (uint16_t *)dalloc(n * 2);
    fill_bf16<<<1024, 256, 0, g_stream>>>(p, n, seed);
    CK(cudaGetLastError());
    return p;
}
static float *rand_f32(size_t n, uint64_t seed) {
    float *p = (float *)dalloc(n * 4);
    fill_f32<<<1024, 256, 0, g_stream>>>(p, n, seed);
    CK(cudaGetLastError());
    return p;
}

// Median over 5 repetitions of the mean time of `iters` calls of fn(i), in microseconds.
template <class F>
static double time_us(F fn, int iters) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++)
        fn(i);
    CK(cudaStreamSynchronize(g_stream));
    std::vector<double> t;
    for (int rep = 0; rep < 5; rep++) {
        CK(cudaEventRecord(a, g_stream));
        for (int i = 0; i < iters; i++)
            fn(i);
        CK(cudaEventRecord(b, g_stream));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1000.0 / iters);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// What record() issues, recorded once as a CUDA graph and replayed: time_us of a replay.
template <class F>
static double graph_us(F record, int iters) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
    record();
    CK(cudaStreamEndCapture(g_stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const double us = time_us([&](int) { CK(cudaGraphLaunch(exec, g_stream)); }, iters);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return us;
}

// ---- copy bandwidth ----------------------------------------------------------------------------
static double bench_copy(void) {
    const size_t n = (size_t)2 << 30; // 2 GiB each way
    void *a = dalloc(n), *b = dalloc(n);
    CK(cudaMemsetAsync(a, 1, n, g_stream));
    double us = time_us([&](int) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, g_stream)); }, 10);
    mm_gpu_free(a);
    mm_gpu_free(b);
    const double gbs = 2.0 * n / (us * 1e-6) / 1e9;
    printf("copy      d2d 2 GiB: %.1f us  -> %.0f GB/s (read+write)\n", us, gbs);
    return gbs;
}

// ---- decode GEMV ---------------------------------------------------------------------------------
struct shape {
    const char *name;
    int n_out, n_in;
};

static void bench_gemv(double copy_gbs) {
    const shape shapes[] = {
        {"q/k/v fused", 5120, 2048},
        {"q_proj", 4096, 2048}, {"k_proj", 512, 2048},       {"o_proj", 2048, 4096},
        {"expert gate/up", 768, 2048}, {"expert down", 2048, 768}, {"router", 128, 2048},
        {"lm_head", 151936, 2048},
    };
    const int batches[] = {1, 2, 4, 8};
    printf("\ngemv bf16 (weights rotated over >= 512 MiB so each call reads HBM)\n");
    printf("%-16s %6s %5s %10s %9s %8s %12s\n", "shape", "n_out", "batch", "us/call", "GB/s", "of copy",
           "GEMV v1 us");
    for (const shape &s : shapes) {
        const size_t wn = (size_t)s.n_out * s.n_in;
        const size_t wbytes = wn * 2;
        int copies = (int)std::max<size_t>(1, ((size_t)512 << 20) / wbytes + 1);
        copies = std::min(copies, 256);
        std::vector<uint16_t *> w(copies);
        for (int c = 0; c < copies; c++)
            w[c] = rand_bf16(wn, 1000 + c);
        float *x = rand_f32((size_t)8 * s.n_in, 5);
        float *y = (float *)dalloc((size_t)8 * s.n_out * 4);
        for (int b : batches) {
            if (g_quick && b != 1)
                continue;
            int iters = std::max(20, copies * 2);
            auto run = [&](int i) {
                MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, w[i % copies], s.n_out, s.n_in, NULL, x,
                                 s.n_in, y, s.n_out, b, MM_GPU_PATH_AUTO));
            };
            double us = time_us(run, iters);
            mm_gpu_set_gemv_version(1); // the earlier GEMV beside it (same bits)
            double us1 = time_us(run, iters);
            mm_gpu_set_gemv_version(2);
            const double gbs = wbytes / (us * 1e-6) / 1e9;
            printf("%-16s %6d %5d %10.2f %9.0f %7.1f%% %12.2f\n", s.name, s.n_out, b, us, gbs,
                   100.0 * gbs / copy_gbs, us1);
        }
        for (int c = 0; c < copies; c++)
            mm_gpu_free(w[c]);
        mm_gpu_free(x);
        mm_gpu_free(y);
    }
}

// Routing offsets (E + 1, E <= 128) of k distinct experts with one row each, a different set per
// layer l, copied to the device at d_offs (stream-ordered).
static void routed_offs(int32_t *d_offs, int E, int k, int l) {
    int32_t offs[129];
    int chosen[128] = {0};
    for (int t = 0; t < k; t++)
        chosen[(t * 37 + l * 11 + 5) % E] = 1;
    offs[0] = 0;
    for (int e = 0; e < E; e++)
        offs[e + 1] = offs[e] + chosen[e];
    MK(mm_gpu_memcpy_h2d(g_stream, d_offs, offs, (size_t)(E + 1) * sizeof(int32_t)));
}

// ---- one MoE layer's decode products, batch 1, from a CUDA graph ----------------------------------
// Qwen3-30B-A3B: d_model 2048, 32 q heads x 128, 4 kv heads x 128, 128 experts (768) top-8.
struct layer {
    uint16_t *q, *k, *v, *o, *router;
    uint16_t *gate[128], *up[128], *down[128];
    void **d_gate, **d_up, **d_down; // device tables of the 128 expert pointers
};

static void bench_layer(double copy_gbs) {
    const int D = 2048, QD = 4096, KV = 512, E = 128, F = 768, TOPK = 8;
    const int n_layers = g_quick ? 2 : 4; // distinct layers, > L2 in total
    std::vector<layer> L(n_layers);
    for (int l = 0; l < n_layers; l++) {
        layer &y = L[l];
        uint64_t s = 100 * (l + 1);
        y.q = rand_bf16((size_t)QD * D, s + 1);
        y.k = rand_bf16((size_t)KV * D, s + 2);
        y.v = rand_bf16((size_t)KV * D, s + 3);
        y.o = rand_bf16((size_t)D * QD, s + 4);
        y.router = rand_bf16((size_t)E * D, s + 5);
        // one allocation per kind of expert matrix, as a loader of stacked experts would do
        uint16_t *g = rand_bf16((size_t)E * F * D, s + 6), *u = rand_bf16((size_t)E * F * D, s + 7);
        uint16_t *dn = rand_bf16((size_t)E * D * F, s + 8);
        void *hg[128], *hu[128], *hd[128];
        for (int e = 0; e < E; e++) {
            hg[e] = y.gate[e] = g + (size_t)e * F * D;
            hu[e] = y.up[e] = u + (size_t)e * F * D;
            hd[e] = y.down[e] = dn + (size_t)e * D * F;
        }
        y.d_gate = (void **)dalloc(E * sizeof(void *));
        y.d_up = (void **)dalloc(E * sizeof(void *));
        y.d_down = (void **)dalloc(E * sizeof(void *));
        MK(mm_gpu_memcpy_h2d(g_stream, y.d_gate, hg, sizeof(hg)));
        MK(mm_gpu_memcpy_h2d(g_stream, y.d_up, hu, sizeof(hu)));
        MK(mm_gpu_memcpy_h2d(g_stream, y.d_down, hd, sizeof(hd)));
        MK(mm_gpu_stream_sync(g_stream));
    }
    float *x = rand_f32(QD, 1), *q = (float *)dalloc(QD * 4), *kv = (float *)dalloc(2 * KV * 4);
    float *o = (float *)dalloc(D * 4), *logits = (float *)dalloc(E * 4);
    float *rows = rand_f32((size_t)TOPK * D, 2), *h = (float *)dalloc((size_t)TOPK * F * 4 * 2);
    float *out = (float *)dalloc((size_t)TOPK * D * 4);
    // Routing offsets: 8 distinct experts with one row each (a different set per layer).
    std::vector<int32_t *> d_offs(n_layers);
    for (int l = 0; l < n_layers; l++) {
        d_offs[l] = (int32_t *)dalloc(129 * sizeof(int32_t));
        routed_offs(d_offs[l], E, TOPK, l);
    }
    MK(mm_gpu_stream_sync(g_stream));
    auto run_layer = [&](int l) {
        layer &y = L[l];
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, y.q, QD, D, NULL, x, D, q, QD, 1, -1));
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, y.k, KV, D, NULL, x, D, kv, KV, 1, -1));
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, y.v, KV, D, NULL, x, D, kv + KV, KV, 1, -1));
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, y.o, D, QD, NULL, q, QD, o, D, 1, -1));
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, y.router, E, D, NULL, o, D, logits, E, 1, -1));
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, y.d_gate, d_offs[l], E, F, D, rows, D, h, F, TOPK, -1));
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, y.d_up, d_offs[l], E, F, D, rows, D, h + TOPK * F, F, TOPK, -1));
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, y.d_down, d_offs[l], E, D, F, h, F, out, D, TOPK, -1));
    };
    const double bytes = 2.0 * ((double)QD * D + 2.0 * KV * D + (double)D * QD + (double)E * D +
                                TOPK * 3.0 * F * D);
    // Eager launches, without and with programmatic dependent launch.
    mm_gpu_set_pdl(0);
    double us_nopdl = time_us([&](int i) { run_layer(i % n_layers); }, 40 * n_layers);
    mm_gpu_set_pdl(1);
    double us_eager = time_us([&](int i) { run_layer(i % n_layers); }, 40 * n_layers);
    printf("\nlayer     eager without PDL: %.2f us/layer\n", us_nopdl);
    // Graph of all layers, replayed.
    auto all_layers = [&]() {
        for (int l = 0; l < n_layers; l++)
            run_layer(l);
    };
    const double us_graph = graph_us(all_layers, 40) / n_layers;
    printf("\nlayer     decode batch 1, one Qwen3-30B-A3B MoE layer's products (8 launches: q k v o "
           "router + grouped gate/up/down of 8/128 experts), %.1f MB of weights\n", bytes / 1e6);
    printf("layer     eager: %.2f us/layer -> %.0f GB/s = %.1f%% of copy\n", us_eager,
           bytes / (us_eager * 1e-6) / 1e9, 100.0 * bytes / (us_eager * 1e-6) / 1e9 / copy_gbs);
    printf("layer     graph: %.2f us/layer -> %.0f GB/s = %.1f%% of copy\n", us_graph,
           bytes / (us_graph * 1e-6) / 1e9, 100.0 * bytes / (us_graph * 1e-6) / 1e9 / copy_gbs);
    const double model_bytes = 48 * bytes + 2.0 * 151936.0 * 2048; // + lm_head
    printf("layer     => 48 layers + lm_head: %.2f GB/token; at the graph rate %.0f tokens/s "
           "(matmuls only; attention, norms, routing excluded)\n", model_bytes / 1e9,
           1e6 / (48 * us_graph + 2.0 * 151936 * 2048 / (bytes / us_graph)));
    // the same graph with the earlier GEMV (v1) beside it
    mm_gpu_set_gemv_version(1);
    const double us_graph1 = graph_us(all_layers, 40) / n_layers;
    mm_gpu_set_gemv_version(2);
    printf("layer     graph, GEMV v1: %.2f us/layer -> %.1f%% of copy\n", us_graph1,
           100.0 * bytes / (us_graph1 * 1e-6) / 1e9 / copy_gbs);
    for (int l = 0; l < n_layers; l++) {
        layer &y = L[l];
        mm_gpu_free(y.q), mm_gpu_free(y.k), mm_gpu_free(y.v), mm_gpu_free(y.o), mm_gpu_free(y.router);
        mm_gpu_free(y.gate[0]), mm_gpu_free(y.up[0]), mm_gpu_free(y.down[0]);
        mm_gpu_free(y.d_gate), mm_gpu_free(y.d_up), mm_gpu_free(y.d_down), mm_gpu_free(d_offs[l]);
    }
    mm_gpu_free(x), mm_gpu_free(q), mm_gpu_free(kv), mm_gpu_free(o), mm_gpu_free(logits);
    mm_gpu_free(rows), mm_gpu_free(h), mm_gpu_free(out);
}

// ---- a decode step's MoE FFN against the number of routed experts --------------------------------
// mm_gpu_moe_ffn_rows at Qwen3-30B-A3B's shape ([gate; up] 1536 x 2048 and down 2048 x 768 per
// expert, bf16), k = 1..8 routed experts of one row each (batch 1 routes 8), 8 layers rotated so
// every call reads HBM; eager and replayed from a CUDA graph of all 8 layers. The time per
// expert shows how the products scale with their block count (the SMs' waves of blocks).
static void bench_ffn(double copy_gbs) {
    const int D = 2048, E = 128, F = 768, NL = 8;
    const int ks[] = {1, 2, 3, 4, 5, 6, 7, 8};
    std::vector<void **> d_gu(NL), d_dn(NL);
    std::vector<uint16_t *> gu(NL), dn(NL);
    for (int l = 0; l < NL; l++) {
        gu[l] = rand_bf16((size_t)E * 2 * F * D, 300 + l);
        dn[l] = rand_bf16((size_t)E * D * F, 400 + l);
        void *hg[128], *hd[128];
        for (int e = 0; e < E; e++) {
            hg[e] = gu[l] + (size_t)e * 2 * F * D;
            hd[e] = dn[l] + (size_t)e * D * F;
        }
        d_gu[l] = (void **)dalloc(E * sizeof(void *));
        d_dn[l] = (void **)dalloc(E * sizeof(void *));
        MK(mm_gpu_memcpy_h2d(g_stream, d_gu[l], hg, sizeof(hg)));
        MK(mm_gpu_memcpy_h2d(g_stream, d_dn[l], hd, sizeof(hd)));
    }
    float *x = rand_f32(D, 11), *y = (float *)dalloc((size_t)16 * D * 4);
    int32_t *d_offs = (int32_t *)dalloc((size_t)NL * 129 * 4);
    // slot p reads the one token's x row (idx[p] = 0) and writes y row p (yidx[p] = p)
    int32_t *idx = (int32_t *)dalloc(32 * 4), *yidx = idx + 16;
    {
        int32_t h[32];
        for (int i = 0; i < 16; i++)
            h[i] = 0, h[16 + i] = i;
        MK(mm_gpu_memcpy_h2d(g_stream, idx, h, sizeof(h)));
    }
    printf("\nffn       decode MoE FFN (mm_gpu_moe_ffn_rows), k routed experts of one row each, "
           "%d layers rotated\n", NL);
    printf("ffn       %2s %9s %10s %10s %9s %9s\n", "k", "MB", "eager us", "graph us", "GB/s",
           "of copy");
    for (int k : ks) {
        for (int l = 0; l < NL; l++)
            routed_offs(d_offs + l * 129, E, k, l);
        MK(mm_gpu_stream_sync(g_stream));
        auto run = [&](int i) {
            const int l = i % NL;
            MK(mm_gpu_moe_ffn_rows(g_stream, MM_DTYPE_BF16, (const void *const *)d_gu[l],
                                   (const void *const *)d_dn[l], d_offs + l * 129, E, F, D, x, D,
                                   idx, y, D, yidx, k));
        };
        const double us_eager = time_us(run, 20 * NL); // (also makes the stream's FFN buffer)
        const double us_graph = graph_us([&]() {
            for (int l = 0; l < NL; l++)
                run(l);
        }, 20) / NL;
        const double mb = k * 3.0 * F * D * 2 / 1e6;
        printf("ffn       %2d %9.1f %10.2f %10.2f %9.0f %8.1f%%\n", k, mb, us_eager, us_graph,
               mb * 1e3 / us_graph, 100.0 * mb * 1e3 / us_graph / copy_gbs);
    }
    for (int l = 0; l < NL; l++) {
        mm_gpu_free(gu[l]), mm_gpu_free(dn[l]);
        mm_gpu_free(d_gu[l]), mm_gpu_free(d_dn[l]);
    }
    mm_gpu_free(x), mm_gpu_free(y), mm_gpu_free(d_offs), mm_gpu_free(idx);
}

// Elements whose bits differ between a and b, counted on the device into *cnt.
__global__ void count_diff(const uint32_t *a, const uint32_t *b, size_t n, unsigned long long *cnt) {
    unsigned long long c = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        c += a[i] != b[i];
    if (c)
        atomicAdd(cnt, c);
}
static unsigned long long bits_differ(const float *a, const float *b, size_t n) {
    unsigned long long *d = (unsigned long long *)dalloc(8), h = 0;
    CK(cudaMemsetAsync(d, 0, 8, g_stream));
    count_diff<<<1024, 256, 0, g_stream>>>((const uint32_t *)a, (const uint32_t *)b, n, d);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(&h, d, 8, cudaMemcpyDeviceToHost, g_stream));
    CK(cudaStreamSynchronize(g_stream));
    mm_gpu_free(d);
    return h;
}

// ---- grouped expert products, batch 64 and prefill ------------------------------------------------
static void bench_moe(double copy_gbs, double peak, int n_tok, const char *tag) {
    const int D = 2048, E = 128, F = 768, TOPK = 8;
    const int n_rows = n_tok * TOPK;
    uint16_t *g = rand_bf16((size_t)E * F * D, 71), *dn = rand_bf16((size_t)E * D * F, 72);
    void *hg[128], *hd[128];
    for (int e = 0; e < E; e++) {
        hg[e] = g + (size_t)e * F * D;
        hd[e] = dn + (size_t)e * D * F;
    }
    void **d_g = (void **)dalloc(sizeof(hg)), **d_d = (void **)dalloc(sizeof(hd));
    MK(mm_gpu_memcpy_h2d(g_stream, d_g, hg, sizeof(hg)));
    MK(mm_gpu_memcpy_h2d(g_stream, d_d, hd, sizeof(hd)));
    // Routing: each token picks 8 distinct experts (pseudo-random), rows sorted by expert.
    std::vector<int> cnt(E, 0);
    uint64_t r = 12345;
    for (int t = 0; t < n_tok; t++) {
        int picked[8];
        for (int k = 0; k < TOPK; k++) {
            int e;
            bool dup;
            do {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                e = (int)((r >> 33) % E);
                dup = false;
                for (int j = 0; j < k; j++)
                    dup |= picked[j] == e;
            } while (dup);
            picked[k] = e;
            cnt[e]++;
        }
    }
    std::vector<int32_t> offs(E + 1, 0);
    int touched = 0;
    for (int e = 0; e < E; e++) {
        offs[e + 1] = offs[e] + cnt[e];
        touched += cnt[e] > 0;
    }
    int32_t *d_offs = (int32_t *)dalloc((E + 1) * 4);
    MK(mm_gpu_memcpy_h2d(g_stream, d_offs, offs.data(), (E + 1) * 4));
    float *x = rand_f32((size_t)n_rows * D, 3), *h = (float *)dalloc((size_t)n_rows * F * 4);
    float *y = (float *)dalloc((size_t)n_rows * D * 4);
    MK(mm_gpu_stream_sync(g_stream));
    const int iters = n_tok >= 1024 ? 10 : 50;
    double us_up = time_us([&](int) {
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_g, d_offs, E, F, D, x, D, h, F, n_rows, -1));
    }, iters);
    double us_down = time_us([&](int) {
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_d, d_offs, E, D, F, h, F, y, D, n_rows, -1));
    }, iters);
    if (n_tok >= 1024) { // prefill: each grouped wgmma variant, time and bits vs the grouped GEMV
        float *h_ref = (float *)dalloc((size_t)n_rows * F * 4), *y_ref = (float *)dalloc((size_t)n_rows * D * 4);
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_g, d_offs, E, F, D, x, D, h_ref, F, n_rows, MM_GPU_PATH_GEMV));
        MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_d, d_offs, E, D, F, h_ref, F, y_ref, D, n_rows, MM_GPU_PATH_GEMV));
        const int vars[] = {2, 19, 20, -20, 21, 22, 23, 25, 27}; // < 0: without the permuted-W cache
        const char *vn[] = {"gemm_wg 128 x 128 (W permuted into shared memory)",
                            "gemm_ws grouped, a block per tile", "gemm_ws grouped, persistent",
                            "the same, permuted-W cache off (every expert's W permuted per product)",
                            "20 with the y rows loaded once per tile",
                            "21 with m64n32 / m64n64 wgmmas for tiles of <= 32 / 64 rows",
                            "22 with the tiles published by the producer warp",
                            "23 with outputs by bulk row copies, 4 stages",
                            "25 for <= 16 k stages, else 23"};
        for (int i = 0; i < (int)(sizeof(vars) / sizeof(vars[0])); i++) {
            mm_gpu_set_gemm_tile(vars[i] < 0 ? -vars[i] : vars[i]);
            mm_gpu_set_wperm_mb(vars[i] < 0 ? 0 : -1);
            CK(cudaMemsetAsync(h, 0xff, (size_t)n_rows * F * 4, g_stream));
            CK(cudaMemsetAsync(y, 0xff, (size_t)n_rows * D * 4, g_stream));
            double u1 = time_us([&](int) {
                MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_g, d_offs, E, F, D, x, D, h, F, n_rows, MM_GPU_PATH_WG));
            }, iters);
            const unsigned long long nd1 = bits_differ(h, h_ref, (size_t)n_rows * F);
            // down reads the GEMV's h, so its bits are compared on the same input
            double u2 = time_us([&](int) {
                MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_d, d_offs, E, D, F, h_ref, F, y, D, n_rows, MM_GPU_PATH_WG));
            }, iters);
            const unsigned long long nd2 = bits_differ(y, y_ref, (size_t)n_rows * D);
            printf("%-9s variant %2d gate/up %8.1f us %6.1f TFLOP/s (%.1f%%), down %8.1f us %6.1f TFLOP/s (%.1f%%); "
                   "bits vs grouped GEMV: %llu + %llu differ; %s\n", tag, vars[i], u1,
                   2.0 * n_rows * F * D / u1 / 1e6, 100.0 * 2.0 * n_rows * F * D / u1 / 1e6 / peak, u2,
                   2.0 * n_rows * F * D / u2 / 1e6, 100.0 * 2.0 * n_rows * F * D / u2 / 1e6 / peak, nd1, nd2, vn[i]);
        }
        mm_gpu_set_gemm_tile(0);
        mm_gpu_set_wperm_mb(-1);
        mm_gpu_free(h_ref), mm_gpu_free(y_ref);
    }
    double us_up_mma = 0, us_down_mma = 0;
    if (n_tok >= 1024) { // prefill: the mma.sync tiles beside the default (wgmma on sm_90)
        us_up_mma = time_us([&](int) {
            MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_g, d_offs, E, F, D, x, D, h, F, n_rows, MM_GPU_PATH_MMA));
        }, iters);
        us_down_mma = time_us([&](int) {
            MK(mm_gpu_moe_matmul(g_stream, MM_DTYPE_BF16, d_d, d_offs, E, D, F, h, F, y, D, n_rows, MM_GPU_PATH_MMA));
        }, iters);
    }
    const double flops = 2.0 * n_rows * (double)F * D;
    const double wbytes = 2.0 * touched * (double)F * D;
    printf("\n%-9s grouped experts, %d tokens x top-8 = %d rows over %d experts (%d touched)\n", tag,
           n_tok, n_rows, E, touched);
    printf("%-9s gate/up (768x2048): %8.1f us  %6.1f TFLOP/s (%.1f%% of peak)  weights %.0f GB/s (%.1f%% of copy)\n",
           tag, us_up, flops / us_up / 1e6, 100.0 * flops / us_up / 1e6 / peak, wbytes / us_up / 1e3,
           100.0 * wbytes / us_up / 1e3 / copy_gbs);
    printf("%-9s down (2048x768):    %8.1f us  %6.1f TFLOP/s (%.1f%% of peak)  weights %.0f GB/s (%.1f%% of copy)\n",
           tag, us_down, flops / us_down / 1e6, 100.0 * flops / us_down / 1e6 / peak, wbytes / us_down / 1e3,
           100.0 * wbytes / us_down / 1e3 / copy_gbs);
    if (us_up_mma > 0)
        printf("%-9s mma.sync tiles:     gate/up %8.1f us %6.1f TFLOP/s (%.1f%%), down %8.1f us %6.1f TFLOP/s (%.1f%%)\n",
               tag, us_up_mma, flops / us_up_mma / 1e6, 100.0 * flops / us_up_mma / 1e6 / peak, us_down_mma,
               flops / us_down_mma / 1e6, 100.0 * flops / us_down_mma / 1e6 / peak);
    if (n_tok <= 64)
        printf("%-9s => one layer's routed experts (gate+up+down) for %d tokens: %.1f us\n", tag, n_tok,
               2 * us_up + us_down);
    mm_gpu_free(g), mm_gpu_free(dn), mm_gpu_free(d_g), mm_gpu_free(d_d), mm_gpu_free(d_offs);
    mm_gpu_free(x), mm_gpu_free(h), mm_gpu_free(y);
}

static void bench_prefill(double peak) {
    const int M = 4096;
    // (the router last, and AUTO and the GEMV last among the variants: the kernels' launch order
    // of the shapes before stays as NCU=1's --launch-skip counts it)
    const shape shapes[] = {{"q_proj", 4096, 2048}, {"o_proj", 2048, 4096}, {"square 4096", 4096, 4096},
                            {"lm_head slice", 16384, 2048}, {"router", 128, 2048}};
    printf("\nprefill   dense GEMM, %d tokens, f32 x and y; wgmma times include converting x to bf16\n", M);
    printf("%-16s %6s %6s %10s %9s %8s   %s\n", "shape", "n_out", "n_in", "us", "TFLOP/s", "of peak", "path");
    struct variant {
        int path, tile;
        const char *name;
    };
    const variant vs[] = {{MM_GPU_PATH_WG, 2, "wgmma 128 out x 128 tok"},
                          {MM_GPU_PATH_WG, 3, "wgmma 192 out x 128 tok"},
                          {MM_GPU_PATH_WG, 4, "wgmma 128 out x 192 tok (AUTO for few rows)"},
                          {MM_GPU_PATH_WG, 5, "wgmma 128 x 128, k 128 per stage"},
                          {MM_GPU_PATH_WG, 6, "wgmma 128 x 128, one-way release fence"},
                          {MM_GPU_PATH_WG, 7, "wgmma 128 x 128, no proxy fence (diagnostic, racy)"},
                          {MM_GPU_PATH_MMA, 0, "mma.sync 64x128 tiles"},
                          {MM_GPU_PATH_FMA, 0, "FMA tiles (HIP path)"},
                          // last: a fault in a new kernel leaves the figures above printed
                          // gemm_ws: W permuted into a workspace, both operands by bulk copies
                          // from a producer warpgroup (the first is the one NCU=1 profiles)
                          {MM_GPU_PATH_WG, 13, "wgmma bulk 128 x 128, two accumulators (AUTO < 4096 rows)"},
                          {MM_GPU_PATH_WG, 14, "wgmma bulk 128 x 128, two accumulators, persistent (AUTO)"},
                          {MM_GPU_PATH_WG, -14, "the same, permuted-W cache off (W permuted per product)"},
                          {MM_GPU_PATH_WG, 15, "wgmma bulk 128 x 128, two acc., persistent, wg 1 lags"},
                          {MM_GPU_PATH_WG, 18, "wgmma bulk 128 x 128, two acc., persistent, wg 1 lags, 7 stages"},
                          {MM_GPU_PATH_WG, 11, "wgmma bulk 128 x 128, drains"},
                          {MM_GPU_PATH_WG, 12, "wgmma bulk 128 x 192, drains"},
                          {MM_GPU_PATH_WG, 16, "wgmma bulk 128 x 192, drains, wg 1 lags"},
                          {MM_GPU_PATH_WG, 17, "wgmma bulk 128 x 192, drains, persistent, wg 1 lags"},
                          {MM_GPU_PATH_WG, 8, "wgmma warp-specialised 128 x 128, W row copies"},
                          {MM_GPU_PATH_WG, 9, "wgmma warp-specialised 128 x 128, W by TMA"},
                          {MM_GPU_PATH_WG, 10, "wgmma warp-specialised 128 x 128, W by cp.async"},
                          {MM_GPU_PATH_AUTO, 0, "AUTO"},
                          {MM_GPU_PATH_GEMV, 0, "decode GEMV (few outputs only)"}};
    for (const shape &s : shapes) {
        uint16_t *w = rand_bf16((size_t)s.n_out * s.n_in, 9);
        float *x = rand_f32((size_t)M * s.n_in, 10), *y = (float *)dalloc((size_t)M * s.n_out * 4);
        float *y_ref = (float *)dalloc((size_t)M * s.n_out * 4);
        const double flops = 2.0 * M * (double)s.n_out * s.n_in;
        // the decode GEMV over the same rows: every variant's bits are compared with it
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, w, s.n_out, s.n_in, NULL, x, s.n_in, y_ref, s.n_out, M,
                         MM_GPU_PATH_GEMV));
        for (const variant &v : vs) {
            if (g_quick && v.path == MM_GPU_PATH_FMA)
                continue;
            if ((v.path == MM_GPU_PATH_FMA && s.n_out > 4096) || (v.path == MM_GPU_PATH_GEMV && s.n_out > 1024))
                continue;
            mm_gpu_set_gemm_tile(v.tile < 0 ? -v.tile : v.tile);
            mm_gpu_set_wperm_mb(v.tile < 0 ? 0 : -1); // < 0: without the permuted-W cache
            CK(cudaMemsetAsync(y, 0xff, (size_t)M * s.n_out * 4, g_stream)); // NaN: unwritten shows
            if (mm_gpu_matmul(g_stream, MM_DTYPE_BF16, w, s.n_out, s.n_in, NULL, x, s.n_in, y, s.n_out, M,
                              v.path) != MM_OK) {
                printf("%-16s %6d %6d %10s   %s: not available here\n", s.name, s.n_out, s.n_in, "-", v.name);
                (void)cudaGetLastError();
                continue;
            }
            double us = time_us([&](int) {
                MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, w, s.n_out, s.n_in, NULL, x, s.n_in, y, s.n_out, M, v.path));
            }, v.path == MM_GPU_PATH_FMA ? 3 : 10);
            const unsigned long long nd = bits_differ(y, y_ref, (size_t)M * s.n_out);
            printf("%-16s %6d %6d %10.1f %9.1f %7.1f%%   %s; bits vs GEMV: %llu differ\n", s.name, s.n_out,
                   s.n_in, us, flops / us / 1e6, 100.0 * flops / us / 1e6 / peak, v.name, nd);
        }
        mm_gpu_set_gemm_tile(0);
        mm_gpu_set_wperm_mb(-1);
        // bits: the default path (AUTO) against the decode GEMV forced over the same rows
        MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, w, s.n_out, s.n_in, NULL, x, s.n_in, y, s.n_out, M, MM_GPU_PATH_AUTO));
        std::vector<float> a((size_t)M * s.n_out), b((size_t)M * s.n_out);
        CK(cudaMemcpyAsync(a.data(), y, a.size() * 4, cudaMemcpyDeviceToHost, g_stream));
        CK(cudaMemcpyAsync(b.data(), y_ref, b.size() * 4, cudaMemcpyDeviceToHost, g_stream));
        CK(cudaStreamSynchronize(g_stream));
        size_t diff = 0;
        for (size_t i = 0; i < a.size(); i++)
            diff += memcmp(&a[i], &b[i], 4) != 0;
        printf("%-16s bits: default path vs decode GEMV over %d rows: %zu of %zu elements differ\n", s.name, M,
               diff, a.size());
        mm_gpu_free(w), mm_gpu_free(x), mm_gpu_free(y), mm_gpu_free(y_ref);
    }
    // Where permuting W (one pass over it per product) stops paying: q_proj at fewer tokens.
    printf("\nprefill   q_proj by token count (AUTO: 13 from 128 rows, 14 from 4096)\n");
    const int n_out = 4096, n_in = 2048, rows[] = {128, 256, 512, 1024, 2048};
    const int tiles[] = {4, 13, 15, 18};
    uint16_t *w = rand_bf16((size_t)n_out * n_in, 11);
    float *x = rand_f32((size_t)M * n_in, 12), *y = (float *)dalloc((size_t)M * n_out * 4);
    for (int m : rows) {
        printf("%-9s %5d rows:", "q_proj", m);
        for (int t : tiles) {
            mm_gpu_set_gemm_tile(t);
            double us = time_us([&](int) {
                MK(mm_gpu_matmul(g_stream, MM_DTYPE_BF16, w, n_out, n_in, NULL, x, n_in, y, n_out, m, MM_GPU_PATH_WG));
            }, 10);
            printf("  variant %d %7.1f us %6.1f TFLOP/s", t, us, 2.0 * m * n_out * n_in / us / 1e6);
        }
        printf("\n");
    }
    mm_gpu_set_gemm_tile(0);
    mm_gpu_free(w), mm_gpu_free(x), mm_gpu_free(y);
}

int main(int argc, char **argv) {
    int dev = 0;
    double peak = 989.0; // H100/H200 SXM dense bf16 datasheet; --peak-tflops overrides with a measurement
    const char *peak_src = "datasheet";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            dev = atoi(argv[++i]);
        else if (strcmp(argv[i], "--peak-tflops") == 0 && i + 1 < argc) {
            peak = atof(argv[++i]);
            peak_src = "measured by the caller";
        } else if (strcmp(argv[i], "--quick") == 0) {
            g_quick = true;
        } else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
            g_only = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--device N] [--peak-tflops F] [--quick] [--only gemv|layer|ffn|moe|prefill]\n", argv[0]);
            return 2;
        }
    }
    int n = 0;
    char why[MM_ERRLEN] = "";
    MK(mm_gpu_device_count(&n, why));
    if (n == 0) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    MK(mm_gpu_set_device(dev));
    char name[128];
    int n_sm = 0;
    size_t mem = 0;
    MK(mm_gpu_device_info(dev, name, &n_sm, &mem));
    printf("device    %s, %d SMs, %.0f GiB; bf16 peak %.0f TFLOP/s (%s)\n", name, n_sm,
           mem / 1073741824.0, peak, peak_src);
    CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    const double copy_gbs = bench_copy();
    if (want("gemv"))
        bench_gemv(copy_gbs);
    if (want("layer"))
        bench_layer(copy_gbs);
    if (want("ffn"))
        bench_ffn(copy_gbs);
    if (want("moe")) {
        bench_moe(copy_gbs, peak, 1, "moe1");
        bench_moe(copy_gbs, peak, 64, "moe64");
        bench_moe(copy_gbs, peak, 4096, "moe4k");
    }
    if (want("prefill"))
        bench_prefill(peak);
    CK(cudaStreamDestroy(g_stream));
    return 0;
}
