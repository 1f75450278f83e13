// SPDX-License-Identifier: MIT
// The prefill products' fused forms (kernels/cuda/matmul.cu, mm_gpu_set_prefill_fuse): the
// gemm_ws x conversion a warp per row, and grouped products of >= 128 rows per expert taken by
// mm_gpu_moe_matmul_rows on gemm_ws with the MoE layer's gather (x_idx), SwiGLU (x_up) and
// scatter (y_idx) inside. Each must give the bits of what it replaces: the grouped GEMV over
// rows gathered (and SwiGLU'd by the backend's swiglu op) beforehand, stored to the scattered
// rows; the dense product with the earlier conversion and the GEMV. Rows never written keep
// their fill. Without the GPU backend, or without an sm_90 device (no wgmma), the cases skip.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x2545f4914f6cdd1dull
#include "gpu_test.h"

extern mm_err mm_gpu_matmul(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                            const float *d_bias, const float *d_x, int64_t x_stride, float *d_y,
                            int64_t y_stride, int n_rows, int path) __attribute__((weak));
extern mm_err mm_gpu_moe_matmul(void *stream, int dtype, const void *const *d_w,
                                const int32_t *d_offs, int n_experts, int n_out, int n_in,
                                const float *d_x, int64_t x_stride, float *d_y, int64_t y_stride,
                                int n_rows, int path) __attribute__((weak));
extern mm_err mm_gpu_moe_matmul_rows(void *stream, int dtype, const void *const *d_w,
                                     const int32_t *d_offs, int n_experts, int n_out, int n_in,
                                     const float *d_x, int64_t x_stride, const int32_t *d_x_idx,
                                     const float *d_x_up, float *d_y, int64_t y_stride,
                                     const int32_t *d_y_idx, int n_rows) __attribute__((weak));
extern mm_err mm_gpu_moe_ffn_rows(void *stream, int dtype, const void *const *d_wgu,
                                  const void *const *d_wd, const int32_t *d_offs, int n_experts,
                                  int d_ff, int d_model, const float *d_x, int64_t x_stride,
                                  const int32_t *d_x_idx, float *d_y, int64_t y_stride,
                                  const int32_t *d_y_idx, int n_rows) __attribute__((weak));
extern void mm_gpu_set_pf_swiglu_epi(int on) __attribute__((weak));
extern void mm_gpu_set_conv_batch(int on) __attribute__((weak));
extern void mm_gpu_set_wperm_mb(long long mb) __attribute__((weak));
extern void mm_gpu_set_gemm_tile(int variant) __attribute__((weak));
extern void mm_gpu_set_prefill_fuse(int on) __attribute__((weak));
extern mm_err mm_gpu_stream_sync(void *stream) __attribute__((weak));

// n random bf16 values (the top half of random floats in [-1, 1)); owned: free.
static uint16_t *rand_bf16(int64_t n) {
    uint16_t *w = malloc((size_t)n * 2 + 2);
    MM_TRUE(w != NULL);
    for (int64_t i = 0; i < n; i++) {
        const float f = frand();
        uint32_t u;
        memcpy(&u, &f, 4);
        w[i] = (uint16_t)(u >> 16);
    }
    return w;
}

static void open_or_skip(void) {
    gpu_open(NULL);
    if (!mm_gpu_matmul || !mm_gpu_moe_matmul || !mm_gpu_moe_matmul_rows || !mm_gpu_set_gemm_tile ||
        !mm_gpu_set_prefill_fuse || !mm_gpu_stream_sync)
        MM_SKIP("the CUDA matmul entry points are not linked");
    // the wgmma path needs compute capability 9.0: a small product tells
    uint16_t *w = rand_bf16(64 * 64);
    float *x = rand_f32(128 * 64, 1.0f);
    void *dw = dev_copy(w, 64 * 64 * 2), *dx = dev_copy(x, 128 * 64 * 4), *dy = dev_copy(NULL, 128 * 64 * 4);
    const mm_err rv = mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, 64, 64, NULL, dx, 64, dy, 64, 128, 3);
    MM_PASS(mm_gpu_stream_sync(NULL));
    dev_free(dw), dev_free(dx), dev_free(dy), free(w), free(x);
    if (rv == MM_EUNSUPP) {
        gpu_close(NULL);
        MM_SKIP("no wgmma path on this device (needs compute capability 9.0)");
    }
    MM_PASS(rv);
}

// E experts with cnt[e] rows each (sorted by expert), n_src source rows; sorted row p reads
// source row xi[p] (glu: the input is swiglu(gate, up) of the source row [gate | up]) and its
// output goes to row yi[p] of yfull rows. variant: mm_gpu_set_gemm_tile's (0 AUTO, 19-23, 25, 27, or
// 2, which must refuse). xs_pad: the source row stride past its width (odd: the scalar loads).
static int g_ys_pad = 5; // y row stride: n_out + g_ys_pad

static void grouped_case(int n_out, int n_in, int n_src, int E, const int *cnt, bool glu,
                         int variant, int xs_pad) {
    int32_t offs[65] = {0};
    for (int e = 0; e < E; e++)
        offs[e + 1] = offs[e] + cnt[e];
    const int n = offs[E];
    const int64_t xw = glu ? 2 * (int64_t)n_in : n_in, xs = xw + xs_pad, ys = n_out + g_ys_pad;
    int32_t *xi, *yi;
    int64_t yfull;
    plan_rows(n, n_src, &xi, &yi, &yfull);
    float *xsrc = rand_f32((int64_t)n_src * xs, 2.0f);
    float *xg = malloc((size_t)(n * xs) * 4 + 4);
    MM_TRUE(xg != NULL);
    for (int p = 0; p < n; p++)
        memcpy(xg + (int64_t)p * xs, xsrc + (int64_t)xi[p] * xs, (size_t)xs * 4);
    void *wp[64];
    uint16_t *wh[64];
    for (int e = 0; e < E; e++) {
        wh[e] = rand_bf16((int64_t)n_out * n_in);
        wp[e] = dev_copy(wh[e], (size_t)n_out * n_in * 2);
    }
    void *dwp = dev_copy(wp, (size_t)E * sizeof(void *));
    int32_t *doffs = dev_copy(offs, (size_t)(E + 1) * 4);
    int32_t *dxi = dev_copy(xi, (size_t)n * 4), *dyi = dev_copy(yi, (size_t)n * 4);
    float *dxsrc = dev_copy(xsrc, (size_t)(n_src * xs) * 4), *dxg = dev_copy(xg, (size_t)(n * xs) * 4);
    float *df = dev_copy(NULL, (size_t)n * n_in * 4);
    float *yref = dev_copy(NULL, (size_t)(n * ys) * 4), *yrow = dev_copy(NULL, (size_t)(yfull * ys) * 4);
    const float *xin = dxg;
    int64_t xin_s = xs;
    if (glu) { // the op the fused form stands for
        MM_PASS(gpu->ops->swiglu(gpu->ctx, dxg, xs, dxg + n_in, xs, df, n_in, n, n_in));
        xin = df, xin_s = n_in;
    }
    MM_PASS(gpu->ops->fill(gpu->ctx, yref, -3.0f, n * ys));
    MM_PASS(gpu->ops->fill(gpu->ctx, yrow, -5.0f, yfull * ys));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    // reference: the grouped GEMV (the bits every path keeps)
    MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs, E, n_out, n_in,
                              xin, xin_s, yref, ys, n, 0));
    mm_gpu_set_prefill_fuse(1);
    mm_gpu_set_gemm_tile(variant);
    const float *xup = glu ? dxsrc + n_in : NULL;
    const mm_err rr = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs, E,
                                             n_out, n_in, dxsrc, xs, dxi, xup, yrow, ys, dyi, n);
    mm_gpu_set_gemm_tile(0);
    // switched off: refused, nothing written
    mm_gpu_set_prefill_fuse(0);
    const mm_err off = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs,
                                              E, n_out, n_in, dxsrc, xs, dxi, xup, yrow, ys, dyi, n);
    mm_gpu_set_prefill_fuse(-1);
    MM_PASS(mm_gpu_stream_sync(NULL));
    MM_EQ(off, MM_EUNSUPP);
    if (variant == 2) { // gemm_wg has no row indices: refused before issuing anything
        MM_EQ(rr, MM_EUNSUPP);
    } else {
        MM_PASS(rr);
    }
    float *h_ref = dev_get(yref, (size_t)(n * ys) * 4), *h_row = dev_get(yrow, (size_t)(yfull * ys) * 4);
    float *want = malloc((size_t)(yfull * ys) * 4);
    MM_TRUE(want != NULL);
    for (int64_t i = 0; i < yfull * ys; i++)
        want[i] = -5.0f;
    if (rr == MM_OK)
        for (int p = 0; p < n; p++)
            for (int j = 0; j < n_out; j++)
                want[(int64_t)yi[p] * ys + j] = h_ref[(int64_t)p * ys + j];
    const int64_t diff = n_diff(h_row, want, yfull * ys);
    printf("grouped %dx%d%s, %d rows over %d experts, x stride %lld, y stride %lld, variant %d: %s, "
           "%lld of %lld elements differ from the gathered GEMV's\n", n_out, n_in,
           glu ? " (swiglu input)" : "", n, E, (long long)xs, (long long)ys, variant,
           rr == MM_OK ? "fused" : "refused", (long long)diff,
           (long long)(yfull * ys));
    MM_EQ(diff, 0);
    for (int e = 0; e < E; e++) {
        free(wh[e]);
        dev_free(wp[e]);
    }
    free(xi), free(yi), free(xsrc), free(xg), free(h_ref), free(h_row), free(want);
    void *bufs[] = {dwp, doffs, dxi, dyi, dxsrc, dxg, df, yref, yrow};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        dev_free(bufs[i]);
}

static void test_grouped_rows(void) {
    open_or_skip();
    // >= 128 rows per expert on average (gemm_ws grouped); counts not multiples of 8, an empty
    // expert, one expert of a few rows, tiles ending inside an expert
    const int c8[8] = {130, 0, 301, 128, 257, 7, 140, 200};
    const int c5[5] = {129, 300, 2, 200, 140};
    grouped_case(200, 520, 700, 8, c8, false, 0, 2);   // partial 32-chunk, [gate; up]-like
    grouped_case(200, 520, 700, 8, c8, true, 0, 2);    // down-like: swiglu input, scatter
    grouped_case(136, 300, 333, 5, c5, true, 0, 1);    // odd stride: scalar loads
    grouped_case(96, 2048, 900, 5, c5, false, 19, 4);  // 8 k segments, a block per tile
    grouped_case(96, 2048, 900, 5, c5, true, 20, 4);   // persistent
    // 21: the y rows loaded once per tile; 22: also the m64n32 / m64n64 forms for tiles of <= 32 /
    // <= 64 rows (c8's last tiles hold 2, 45, 1, 7, 12, 72 rows; c5's 1, 44, 2, 72, 12)
    grouped_case(200, 520, 700, 8, c8, false, 21, 2);
    grouped_case(200, 520, 700, 8, c8, true, 22, 2);
    grouped_case(136, 300, 333, 5, c5, false, 22, 1);
    grouped_case(96, 2048, 900, 5, c5, true, 22, 4);
    grouped_case(200, 520, 700, 8, c8, true, 23, 2); // 23: 22 + tiles published by the producer
    grouped_case(96, 2048, 900, 5, c5, false, 23, 4);
    // 25: outputs through shared memory and bulk row copies, which need rows of whole 16 bytes:
    // the y stride a multiple of 4 (g_ys_pad 4; else the direct stores, as with pad 5)
    g_ys_pad = 4;
    grouped_case(200, 520, 700, 8, c8, true, 25, 2);
    grouped_case(136, 300, 333, 5, c5, false, 25, 1);
    grouped_case(96, 2048, 900, 5, c5, true, 25, 4);
    grouped_case(200, 520, 700, 8, c8, true, 27, 2);  // 27: 25 at 9 k stages
    grouped_case(96, 2048, 900, 5, c5, false, 27, 4); // 27: 23 at 32
    g_ys_pad = 5;
    grouped_case(200, 520, 700, 8, c8, false, 25, 2);
    grouped_case(200, 520, 700, 8, c8, false, 2, 2);   // gemm_wg: refused
    gpu_close(NULL);
}

// Dense gemm_ws products with the row-per-warp conversion against the earlier conversion and
// the GEMV, all bit for bit.
static void dense_case(int n_out, int n_in, int n_rows, int xs_pad, int variant) {
    const int64_t xs = n_in + xs_pad, ys = n_out + 3;
    uint16_t *w = rand_bf16((int64_t)n_out * n_in);
    float *x = rand_f32((int64_t)n_rows * xs, 1.5f);
    void *dw = dev_copy(w, (size_t)n_out * n_in * 2);
    float *dx = dev_copy(x, (size_t)(n_rows * xs) * 4);
    float *y[3];
    for (int i = 0; i < 3; i++) {
        y[i] = dev_copy(NULL, (size_t)(n_rows * ys) * 4);
        MM_PASS(gpu->ops->fill(gpu->ctx, y[i], -7.0f, n_rows * ys));
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, NULL, dx, xs, y[0], ys, n_rows, 0));
    mm_gpu_set_gemm_tile(variant);
    mm_gpu_set_prefill_fuse(1);
    MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, NULL, dx, xs, y[1], ys, n_rows, 3));
    mm_gpu_set_prefill_fuse(0);
    MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, NULL, dx, xs, y[2], ys, n_rows, 3));
    mm_gpu_set_prefill_fuse(-1);
    mm_gpu_set_gemm_tile(0);
    MM_PASS(mm_gpu_stream_sync(NULL));
    float *h[3];
    for (int i = 0; i < 3; i++)
        h[i] = dev_get(y[i], (size_t)(n_rows * ys) * 4);
    const int64_t d1 = n_diff(h[1], h[0], n_rows * ys), d2 = n_diff(h[2], h[0], n_rows * ys);
    printf("dense %dx%d, %d rows, x stride %lld, variant %d: row conversion %lld, earlier %lld of "
           "%lld elements differ from the GEMV's\n", n_out, n_in, n_rows, (long long)xs, variant,
           (long long)d1, (long long)d2, (long long)(n_rows * ys));
    MM_EQ(d1, 0);
    MM_EQ(d2, 0);
    for (int i = 0; i < 3; i++)
        dev_free(y[i]), free(h[i]);
    dev_free(dw), dev_free(dx), free(w), free(x);
}

static void test_dense_conversion(void) {
    open_or_skip();
    dense_case(300, 520, 333, 2, 0);  // AUTO (13)
    dense_case(300, 520, 333, 1, 13); // odd stride: scalar loads
    dense_case(256, 2048, 4096, 0, 14);
    dense_case(130, 1000, 257, 6, 11);
    gpu_close(NULL);
}

// The MoE layer's routed experts through mm_gpu_moe_ffn_rows ([gate; up] on gemm_ws with the
// SwiGLU epilogue writing down's bf16 x workspace, W interleaved) against the two products it
// replaces (mm_gpu_moe_matmul_rows of [gate; up] into an f32 buffer, then of down with x_up),
// bit for bit in every y element (rows never written keep their fill). E experts with cnt[e]
// rows; n_src = ceil(rows / top_k) source rows (sorted row p reads row (5p + 3) % n_src; its
// output goes to row (7p + 1) % yfull). d_ff % 8 != 0 must be refused (nothing written).
// variant: mm_gpu_set_gemm_tile's (0 AUTO; 2 must be refused). wperm: the permuted-W cache on
// (built by the first call, read by a second) or off (W permuted per call into the workspace).
static void ffn_case(int D, int F, int E, const int *cnt, int top_k, int ys_pad, int variant,
                     bool wperm) {
    int32_t offs[65] = {0};
    for (int e = 0; e < E; e++)
        offs[e + 1] = offs[e] + cnt[e];
    const int n = offs[E], n_src = (n + top_k - 1) / top_k;
    const int64_t xs = D + 2, ys = D + ys_pad;
    int32_t *xi, *yi;
    int64_t yfull;
    plan_rows(n, n_src, &xi, &yi, &yfull);
    float *xsrc = rand_f32((int64_t)n_src * xs, 2.0f);
    void *wgu[64], *wd[64];
    for (int e = 0; e < E; e++) {
        uint16_t *a = rand_bf16((int64_t)2 * F * D), *b = rand_bf16((int64_t)D * F);
        wgu[e] = dev_copy(a, (size_t)2 * F * D * 2);
        wd[e] = dev_copy(b, (size_t)D * F * 2);
        free(a), free(b);
    }
    void *dwgu = dev_copy(wgu, (size_t)E * sizeof(void *)), *dwd = dev_copy(wd, (size_t)E * sizeof(void *));
    int32_t *doffs = dev_copy(offs, (size_t)(E + 1) * 4);
    int32_t *dxi = dev_copy(xi, (size_t)n * 4), *dyi = dev_copy(yi, (size_t)n * 4);
    float *dx = dev_copy(xsrc, (size_t)(n_src * xs) * 4);
    float *dg = dev_copy(NULL, (size_t)n * 2 * F * 4);
    float *y[3];
    for (int i = 0; i < 3; i++) {
        y[i] = dev_copy(NULL, (size_t)(yfull * ys) * 4);
        MM_PASS(gpu->ops->fill(gpu->ctx, y[i], -5.0f, yfull * ys));
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    if (!wperm)
        mm_gpu_set_wperm_mb(0);
    mm_gpu_set_gemm_tile(variant);
    // the earlier form: switched off, the fused call is refused; then the two products
    mm_gpu_set_pf_swiglu_epi(0);
    const mm_err off = mm_gpu_moe_ffn_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwgu,
                                           (const void *const *)dwd, doffs, E, F, D, dx, xs, dxi,
                                           y[0], ys, dyi, n);
    mm_err r1 = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwgu, doffs, E,
                                       2 * F, D, dx, xs, dxi, NULL, dg, 2 * F, NULL, n);
    if (r1 == MM_EUNSUPP) { // not gemm_ws (variant 2): the ops the model runs then
        float *dxg = dev_copy(NULL, (size_t)n * D * 4);
        MM_PASS(gpu->ops->copy_rows(gpu->ctx, dx, xs, dxi, dxg, D, NULL, n, D));
        MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)dwgu, doffs, E, 2 * F,
                                  D, dxg, D, dg, 2 * F, n, -1));
        MM_PASS(mm_gpu_stream_sync(NULL));
        dev_free(dxg);
    } else {
        MM_PASS(r1);
    }
    mm_err r2 = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwd, doffs, E, D,
                                       F, dg, 2 * F, NULL, dg + F, y[0], ys, dyi, n);
    if (r2 == MM_EUNSUPP) {
        float *df = dev_copy(NULL, (size_t)n * F * 4), *dy = dev_copy(NULL, (size_t)n * D * 4);
        MM_PASS(gpu->ops->swiglu(gpu->ctx, dg, 2 * F, dg + F, 2 * F, df, F, n, F));
        MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)dwd, doffs, E, D, F, df,
                                  F, dy, D, n, -1));
        MM_PASS(gpu->ops->copy_rows(gpu->ctx, dy, D, NULL, y[0], ys, dyi, n, D));
        MM_PASS(mm_gpu_stream_sync(NULL));
        dev_free(df), dev_free(dy);
    } else {
        MM_PASS(r2);
    }
    // the SwiGLU epilogue, twice (with the cache: built, then read)
    mm_gpu_set_pf_swiglu_epi(1);
    mm_err rf[2];
    for (int i = 0; i < 2; i++)
        rf[i] = mm_gpu_moe_ffn_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwgu,
                                    (const void *const *)dwd, doffs, E, F, D, dx, xs, dxi, y[1 + i],
                                    ys, dyi, n);
    mm_gpu_set_pf_swiglu_epi(-1);
    mm_gpu_set_gemm_tile(0);
    MM_PASS(mm_gpu_stream_sync(NULL));
    if (!wperm)
        mm_gpu_set_wperm_mb(-1);
    MM_EQ(off, MM_EUNSUPP);
    const bool refuse = F % 8 != 0 || variant == 2;
    float *h[3];
    for (int i = 0; i < 3; i++)
        h[i] = dev_get(y[i], (size_t)(yfull * ys) * 4);
    int64_t d[2], written = 0;
    for (int i = 0; i < 2; i++)
        d[i] = n_diff(h[1 + i], h[0], yfull * ys);
    for (int64_t i = 0; i < yfull * ys; i++)
        written += h[0][i] != -5.0f;
    printf("ffn D %d F %d, %d rows over %d experts (top-%d, %d source rows), y stride %lld, "
           "variant %d, W cache %s: %s; %lld / %lld of %lld elements differ from the two products' "
           "(%lld written)\n", D, F, n, E, top_k, n_src, (long long)ys, variant, wperm ? "on" : "off",
           rf[0] == MM_OK ? "fused" : "refused", (long long)d[0], (long long)d[1],
           (long long)(yfull * ys), (long long)written);
    if (refuse) {
        MM_EQ(rf[0], MM_EUNSUPP);
        MM_EQ(rf[1], MM_EUNSUPP);
        // nothing written: the fill everywhere
        int64_t touched = 0;
        for (int i = 1; i < 3; i++)
            for (int64_t k = 0; k < yfull * ys; k++)
                touched += h[i][k] != -5.0f;
        MM_EQ(touched, 0);
    } else {
        MM_PASS(rf[0]);
        MM_PASS(rf[1]);
        MM_EQ(d[0], 0);
        MM_EQ(d[1], 0);
        MM_TRUE(written > 0);
    }
    for (int e = 0; e < E; e++)
        dev_free(wgu[e]), dev_free(wd[e]);
    for (int i = 0; i < 3; i++)
        dev_free(y[i]), free(h[i]);
    free(xi), free(yi), free(xsrc);
    void *bufs[] = {dwgu, dwd, doffs, dxi, dyi, dx, dg};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        dev_free(bufs[i]);
}

static void test_ffn_swiglu_epilogue(void) {
    open_or_skip();
    if (!mm_gpu_moe_ffn_rows || !mm_gpu_set_pf_swiglu_epi || !mm_gpu_set_wperm_mb)
        MM_SKIP("mm_gpu_moe_ffn_rows is not linked");
    // experts of 0, 1, 63, 64, 65, 200 rows beside larger ones (>= 128 rows per expert on
    // average, so gemm_ws takes both products): last tiles of 1, 63, 64, 65, 72, 60, 44 rows
    const int c8[8] = {0, 1, 63, 64, 65, 200, 700, 300};
    const int c3[3] = {129, 256, 7};
    ffn_case(520, 200, 8, c8, 8, 4, 0, true);    // F % 64 != 0: the last tile half features
    ffn_case(520, 200, 8, c8, 2, 5, 0, true);    // top-2; y stride: down's direct stores
    ffn_case(1024, 768, 8, c8, 8, 4, 0, true);   // the Qwen3-30B-A3B d_ff
    ffn_case(1024, 768, 8, c8, 8, 4, 0, false);  // W permuted per call (cache off)
    ffn_case(264, 136, 3, c3, 2, 4, 23, true);   // down on 23
    ffn_case(264, 136, 3, c3, 8, 5, 19, false);  // down on 19 (a block per tile)
    ffn_case(520, 100, 8, c8, 8, 4, 0, true);    // d_ff % 8 != 0: refused
    ffn_case(520, 200, 8, c8, 8, 4, 2, true);    // gemm_wg: refused
    gpu_close(NULL);
}

// The row conversion piece by piece (mm_gpu_set_conv_batch(0), the earlier loop) on cases the
// tests above run with the default (each lane's loads of 4 pieces first): both against the
// same references.
static void test_conv_piecewise(void) {
    open_or_skip();
    if (!mm_gpu_set_conv_batch || !mm_gpu_moe_ffn_rows || !mm_gpu_set_pf_swiglu_epi || !mm_gpu_set_wperm_mb)
        MM_SKIP("mm_gpu_set_conv_batch is not linked");
    const int c8[8] = {130, 0, 301, 128, 257, 7, 140, 200};
    const int c5[5] = {129, 300, 2, 200, 140};
    const int f8[8] = {0, 1, 63, 64, 65, 200, 700, 300};
    mm_gpu_set_conv_batch(0);
    grouped_case(200, 520, 700, 8, c8, true, 0, 2);  // swiglu input, scatter
    grouped_case(136, 300, 333, 5, c5, true, 0, 1);  // odd stride: the scalar loads either way
    grouped_case(96, 2048, 900, 5, c5, false, 23, 4);
    dense_case(300, 520, 333, 2, 0);
    dense_case(256, 2048, 4096, 0, 14);
    ffn_case(520, 200, 8, f8, 8, 4, 0, true);
    mm_gpu_set_conv_batch(-1);
    gpu_close(NULL);
}

MM_TESTS = {
    {"row conversion piece by piece: the same bits", test_conv_piecewise},
    {"moe_ffn_rows: SwiGLU in [gate; up]'s epilogue == the two products' bits", test_ffn_swiglu_epilogue},
    {"grouped prefill rows on gemm_ws: gathered GEMV bits", test_grouped_rows},
    {"dense gemm_ws row conversion: GEMV bits", test_dense_conversion},
    {NULL, NULL},
};
