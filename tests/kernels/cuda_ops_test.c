// SPDX-License-Identifier: MIT
// Every op of the GPU backend (kernels/cuda through the kernels.h table) against the CPU
// backend, over random and odd shapes, by normalised error (NMSE); plus the exactness rules:
// a matmul row's bits do not depend on n_rows (GEMV vs tensor-core tiles), the grouped expert
// product matches per-expert products bit for bit, and axpy rounds like the CPU.
// In a build without the GPU backend (plain `make`), or on a host without a GPU, every case
// skips and says why; `make cuda` builds this test with the backend.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "mm/dtype.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x9e3779b97f4a7c15ull
#include "gpu_test.h"

// Grouped expert product (kernels/cuda/mm_gpu.h); absent without the GPU backend.
extern mm_err mm_gpu_moe_matmul(void *stream, int dtype, const void *const *d_w,
                                const int32_t *d_offs, int n_experts, int n_out, int n_in,
                                const float *d_x, int64_t x_stride, float *d_y, int64_t y_stride,
                                int n_rows, int path) __attribute__((weak));

extern mm_err mm_gpu_argmax(void *stream, const float *d_logits, int64_t ls, int64_t n_rows,
                            int vocab, int32_t *d_ids) __attribute__((weak));

extern mm_err mm_gpu_stream_sync(void *stream) __attribute__((weak));
extern mm_err mm_gpu_stream_hold(void *stream, int ms) __attribute__((weak));
extern mm_err mm_gpu_stream_new(void **stream) __attribute__((weak));
extern void mm_gpu_stream_free(void *stream) __attribute__((weak));
extern void mm_gpu_set_drain_timeout_ms(int ms) __attribute__((weak));

// Dense product with a forced path (kernels/cuda/mm_gpu.h: 0 GEMV, 2 mma.sync tiles, 3 wgmma).
extern mm_err mm_gpu_matmul(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                            const float *d_bias, const float *d_x, int64_t x_stride, float *d_y,
                            int64_t y_stride, int n_rows, int path) __attribute__((weak));
// wgmma variant (2: 128 outputs x 128 tokens, 3: 192 x 128, 4: 128 x 192, 5: 128-wide k, 6: release
// fence, 8: warp-specialised 128 x 128, 9: 8 with W by TMA, 10: 8 with W by cp.async).
extern void mm_gpu_set_gemm_tile(int variant) __attribute__((weak));
// the tensor-core attention contract (attention_tc.cu): 0 pins ops.cu's f32 kernels
extern void mm_gpu_set_attention_tc(int mode) __attribute__((weak));
// The permuted-W cache of the gemm_ws path (kernels/cuda/mm_gpu.h).
extern size_t mm_gpu_wperm_bytes(void) __attribute__((weak));
extern void mm_gpu_set_wperm_mb(long long mb) __attribute__((weak));
// Dense products of 9..127 rows on gemm_ws variant 28 (kernels/cuda/mm_gpu.h).
extern void mm_gpu_set_ws_small(int mode) __attribute__((weak));
extern unsigned long long mm_gpu_ws_small_launches(int variant) __attribute__((weak));
extern void mm_gpu_set_ws_small_bn64(int on) __attribute__((weak));
extern void mm_gpu_set_ws_small_half(int on) __attribute__((weak));
// Dense products of 9..64 rows with the k segments split over blocks (kernels/cuda/mm_gpu.h).
extern void mm_gpu_set_segsplit(int on) __attribute__((weak));
extern unsigned long long mm_gpu_segsplit_launches(void) __attribute__((weak));
extern mm_err mm_gpu_matmul_res(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                                const float *d_x, int64_t x_stride, const float *d_res,
                                int64_t res_stride, float *d_y, int64_t y_stride, int n_rows)
    __attribute__((weak));

static mm_backend *cpu;

// ---- helpers -----------------------------------------------------------------------------------
// sum (a - b)^2 / sum b^2 over n elements at stride (rows of dim within stride).
static double nmse_rows(const float *a, const float *b, int64_t n_rows, int64_t dim, int64_t stride) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n_rows; i++)
        for (int64_t j = 0; j < dim; j++) {
            double x = a[i * stride + j], y = b[i * stride + j];
            if (isnan(x) || isnan(y))
                return INFINITY;
            num += (x - y) * (x - y);
            den += y * y;
        }
    return den > 0 ? num / den : num;
}

#define CHECK_NMSE(what, v, tol)                                                     \
    do {                                                                             \
        double v_ = (v);                                                             \
        printf("%-48s nmse %.3e (tol %.0e)\n", what, v_, (double)(tol));            \
        if (!(v_ <= (tol)))                                                          \
            MM_TEST_FAIL_("%s: nmse %.3e above %.0e", what, v_, (double)(tol));    \
    } while (0)

// A weight of dtype with random values (returns host data in *h, owned).
static mm_weight make_weight(enum mm_dtype dt, int64_t rows, int64_t cols, void **h) {
    size_t n = (size_t)(rows * cols);
    void *p = malloc(n * mm_dtype_size(dt) + 1);
    MM_TRUE(p != NULL);
    for (size_t i = 0; i < n; i++) {
        float v = frand() * 0.5f;
        if (dt == MM_DTYPE_BF16)
            ((uint16_t *)p)[i] = mm_f32_to_bf16(v);
        else if (dt == MM_DTYPE_F32)
            ((float *)p)[i] = v;
        else { // f16 from a value exactly representable: bf16-rounded then converted
            float f = mm_bf16_to_f32(mm_f32_to_bf16(v));
            uint32_t u;
            memcpy(&u, &f, 4);
            uint32_t sign = (u >> 16) & 0x8000u;
            int e = (int)((u >> 23) & 0xff) - 127 + 15;
            uint16_t h16 = (uint16_t)sign;
            if (e > 0 && e < 31)
                h16 = (uint16_t)(sign | ((uint32_t)e << 10) | ((u >> 13) & 0x3ffu));
            ((uint16_t *)p)[i] = h16;
        }
    }
    *h = p;
    return (mm_weight){.dtype = dt, .rows = rows, .cols = cols, .data = p};
}

// ---- matmul ------------------------------------------------------------------------------------
// One product on both backends; returns the NMSE. x_stride/y_stride > dims test views.
static double matmul_case(enum mm_dtype dt, int64_t n_rows, int64_t n_in, int64_t n_out,
                          int64_t xs, int64_t ys, bool bias) {
    void *hw = NULL;
    mm_weight w = make_weight(dt, n_out, n_in, &hw);
    float *x = rand_f32((size_t)(n_rows * xs), 1.0f);
    float *b = bias ? rand_f32((size_t)n_out, 1.0f) : NULL;
    float *y_cpu = calloc((size_t)(n_rows * ys) + 1, sizeof(float));
    float *y_init = calloc((size_t)(n_rows * ys) + 1, sizeof(float));
    for (int64_t i = 0; i < n_rows * ys; i++)
        y_init[i] = y_cpu[i] = NAN; // poison: every element in range must be written
    MM_PASS(cpu->ops->matmul(cpu->ctx, &w, b, x, xs, y_cpu, ys, n_rows));

    mm_weight dw = w;
    dw.data = dev_copy(hw, (size_t)(n_out * n_in) * mm_dtype_size(dt));
    float *dx = dev_copy(x, (size_t)(n_rows * xs) * 4);
    float *db = bias ? dev_copy(b, (size_t)n_out * 4) : NULL;
    float *dy = dev_copy(y_init, (size_t)(n_rows * ys) * 4);
    MM_PASS(gpu->ops->matmul(gpu->ctx, &dw, db, dx, xs, dy, ys, n_rows));
    float *y_gpu = dev_get(dy, (size_t)(n_rows * ys) * 4);
    double e = nmse_rows(y_gpu, y_cpu, n_rows, n_out, ys);
    dev_free((void *)dw.data);
    dev_free(dx);
    dev_free(db);
    dev_free(dy);
    free(hw), free(x), free(b), free(y_cpu), free(y_init), free(y_gpu);
    return e;
}

static void test_matmul_bf16(void) {
    gpu_open(&cpu);
    // decode-shaped (GEMV), odd shapes (scalar loads, partial tiles), prefill-shaped (tiles)
    CHECK_NMSE("bf16 1x2048 -> 768", matmul_case(MM_DTYPE_BF16, 1, 2048, 768, 2048, 768, false), 1e-4);
    CHECK_NMSE("bf16 8x768 -> 2048 +bias", matmul_case(MM_DTYPE_BF16, 8, 768, 2048, 768, 2048, true), 1e-4);
    CHECK_NMSE("bf16 5x100 -> 33 (odd)", matmul_case(MM_DTYPE_BF16, 5, 100, 33, 100, 33, false), 1e-4);
    CHECK_NMSE("bf16 3x2 -> 1 (tiny)", matmul_case(MM_DTYPE_BF16, 3, 2, 1, 2, 1, true), 1e-4);
    CHECK_NMSE("bf16 20x256 -> 200 strided", matmul_case(MM_DTYPE_BF16, 20, 256, 200, 264, 210, true), 1e-4);
    CHECK_NMSE("bf16 37x512 -> 384 (tiles)", matmul_case(MM_DTYPE_BF16, 37, 512, 384, 512, 384, false), 1e-4);
    CHECK_NMSE("bf16 300x1000 -> 130 (odd tiles)", matmul_case(MM_DTYPE_BF16, 300, 1000, 130, 1003, 131, true), 1e-4);
    gpu_close(&cpu);
}

static void test_matmul_f16_f32(void) {
    gpu_open(&cpu);
    CHECK_NMSE("f32 1x64 -> 48", matmul_case(MM_DTYPE_F32, 1, 64, 48, 64, 48, false), 1e-10);
    CHECK_NMSE("f32 70x129 -> 65 +bias", matmul_case(MM_DTYPE_F32, 70, 129, 65, 129, 65, true), 1e-10);
    CHECK_NMSE("f16 9x96 -> 40", matmul_case(MM_DTYPE_F16, 9, 96, 40, 96, 40, true), 1e-10);
    gpu_close(&cpu);
}

// Row r computed alone (n_rows = 1: GEMV) must equal row r inside a batch of 150 (tensor-core
// tiles) bit for bit; also a batch of 20 (GEMV with several token groups).
static void test_matmul_bits_batch_invariant(void) {
    gpu_open(&cpu);
    const int64_t n_in = 520, n_out = 300, n = 150;
    void *hw = NULL;
    mm_weight w = make_weight(MM_DTYPE_BF16, n_out, n_in, &hw);
    float *x = rand_f32((size_t)(n * n_in), 2.0f);
    mm_weight dw = w;
    dw.data = dev_copy(hw, (size_t)(n_out * n_in) * 2);
    float *dx = dev_copy(x, (size_t)(n * n_in) * 4);
    float *dy = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)(n * n_out) * 4, (void **)&dy));
    MM_PASS(gpu->ops->matmul(gpu->ctx, &dw, NULL, dx, n_in, dy, n_out, n));
    float *y_batch = dev_get(dy, (size_t)(n * n_out) * 4);
    MM_PASS(gpu->ops->matmul(gpu->ctx, &dw, NULL, dx, n_in, dy, n_out, 20));
    float *y_20 = dev_get(dy, (size_t)(20 * n_out) * 4);
    int64_t rows[] = {0, 1, 17, 63, 64, 127, 128, 149};
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        int64_t r = rows[i];
        MM_PASS(gpu->ops->matmul(gpu->ctx, &dw, NULL, dx + r * n_in, n_in, dy, n_out, 1));
        float *y1 = dev_get(dy, (size_t)n_out * 4);
        if (memcmp(y1, y_batch + r * n_out, (size_t)n_out * 4) != 0) {
            int64_t j = 0;
            while (y1[j] == y_batch[r * n_out + j])
                j++;
            MM_TEST_FAIL_("row %lld alone differs from the batch of %lld at col %lld: %.9g vs %.9g",
                          (long long)r, (long long)n, (long long)j, y1[j], y_batch[r * n_out + j]);
        }
        if (r < 20 && memcmp(y1, y_20 + r * n_out, (size_t)n_out * 4) != 0)
            MM_TEST_FAIL_("row %lld alone differs from the batch of 20", (long long)r);
        free(y1);
    }
    dev_free((void *)dw.data), dev_free(dx), dev_free(dy);
    free(hw), free(x), free(y_batch), free(y_20);
    gpu_close(&cpu);
}

// Every path of a bf16 product gives each row the GEMV's bits: the wgmma tiles (sm_90) and the
// mma.sync tiles against the GEMV forced over the whole batch, over random and odd shapes
// (several k segments, a segment ending inside a 64-wide k-step, a partial 32-chunk, n_in not a
// multiple of 8, partial row and output tiles, strided x/y, bias). On a mismatch it prints how
// many elements differ and by how much (an accumulation-order difference shows as a few ulp
// with a small NMSE; a kernel bug as a large one).
static int bits_compare(const char *what, const float *a, const float *ref, int64_t n_rows,
                        int64_t n_out, int64_t ys) {
    int64_t diff = 0, first = -1;
    double num = 0, den = 0;
    for (int64_t i = 0; i < n_rows; i++)
        for (int64_t j = 0; j < n_out; j++) {
            float x = a[i * ys + j], y = ref[i * ys + j];
            if (memcmp(&x, &y, 4) != 0) {
                if (first < 0)
                    first = i * ys + j;
                diff++;
            }
            num += ((double)x - y) * ((double)x - y);
            den += (double)y * y;
        }
    if (diff == 0) {
        printf("%-44s bit-identical to the GEMV\n", what);
        return 0;
    }
    printf("%-44s %lld of %lld differ from the GEMV (first at row %lld col %lld: %.9g vs %.9g), "
           "nmse %.3e\n", what, (long long)diff, (long long)(n_rows * n_out),
           (long long)(first / ys), (long long)(first % ys), a[first], ref[first], num / den);
    return 1;
}

static int path_bits_case(int64_t n_rows, int64_t n_in, int64_t n_out, int64_t xs, int64_t ys,
                          bool bias, int *wg_ran) {
    void *hw = NULL;
    (void)make_weight(MM_DTYPE_BF16, n_out, n_in, &hw);
    float *x = rand_f32((size_t)(n_rows * xs), 2.0f);
    float *b = bias ? rand_f32((size_t)n_out, 1.0f) : NULL;
    void *dw = dev_copy(hw, (size_t)(n_out * n_in) * 2);
    float *dx = dev_copy(x, (size_t)(n_rows * xs) * 4);
    float *db = bias ? dev_copy(b, (size_t)n_out * 4) : NULL;
    enum { NP = 21 };
    float *dy[NP] = {NULL};
    // GEMV, MMA, WG (17 variants of mm_gpu_set_gemm_tile)
    const int paths[NP] = {0, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3};
    const int variant[NP] = {2, 2, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16, 17, 18, 8, 9, 10, 28, 29, 30};
    // 11-17: gemm_ws (W permuted into a workspace, both operands by bulk copies from a producer
    // warpgroup; 128 or 192 tokens, drains or two accumulators, one block per tile or
    // persistent, warpgroup 1 lagging or not, 6 or 7 stages). 8, 9, 10: the warp-specialised kernel with W
    // from registers (W by row bulk copies, one TMA tile, or 16-byte cp.async; dense, n_in % 8
    // == 0, else the 128x192 kernel runs in its place); 28: 14 with m64n32 / m64n64 wgmmas for
    // tiles of <= 32 / <= 64 rows (the last tile here), x in the stream's own buffer; 29: 28 on
    // 64-token tiles with 9 stages; 30: 29 on 64-output tiles, a warpgroup per 32 tokens
    const char *names[NP] = {"gemv", "mma.sync", "wgmma 128x128", "wgmma 192x128", "wgmma 128x192",
                             "wgmma 128x128 k128", "wgmma 128x128 rel.fence", "wgmma bulk 128x128",
                             "wgmma bulk 128x192", "wgmma bulk 128x128 2acc",
                             "wgmma bulk 128x128 2acc persist", "wgmma bulk 128x128 2acc pers lag",
                             "wgmma bulk 128x192 lag", "wgmma bulk 128x192 persist lag",
                             "wgmma bulk 128x128 2acc pers lag st7",
                             "wgmma ws 128x128", "wgmma ws 128x128 W tma", "wgmma ws 128x128 W cp.async",
                             "wgmma bulk small tiles (28)", "wgmma bulk 64-token tiles (29)",
                             "wgmma bulk 64x64 tiles (30)"};
    mm_err rv[NP];
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    for (int p = 0; p < NP; p++) {
        const unsigned long long n0 =
            mm_gpu_ws_small_launches && variant[p] >= 28 ? mm_gpu_ws_small_launches(variant[p]) : 0;
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)(n_rows * ys) * 4, (void **)&dy[p]));
        MM_PASS(gpu->ops->fill(gpu->ctx, dy[p], NAN, n_rows * ys));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        if (mm_gpu_set_gemm_tile)
            mm_gpu_set_gemm_tile(variant[p]);
        rv[p] = mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, (int)n_out, (int)n_in, db, dx, xs, dy[p], ys,
                              (int)n_rows, paths[p]);
        MM_PASS(mm_gpu_stream_sync(NULL));
        // variants 28-30 fall back to 4 where W's permuted copy is not cached: make sure they ran
        if (rv[p] == MM_OK && mm_gpu_ws_small_launches && variant[p] >= 28 &&
            mm_gpu_ws_small_launches(variant[p]) != n0 + 1)
            MM_TEST_FAIL_("%s did not run (its W not in the permuted-W cache?)", names[p]);
    }
    if (mm_gpu_set_gemm_tile)
        mm_gpu_set_gemm_tile(0);
    MM_PASS(rv[0]);
    MM_PASS(rv[1]);
    float *y[NP];
    int bad = 0;
    for (int p = 0; p < NP; p++)
        y[p] = dev_get(dy[p], (size_t)(n_rows * ys) * 4);
    for (int64_t i = 0; i < n_rows; i++) // every element in range written, finite
        for (int64_t j = 0; j < n_out; j++)
            if (!isfinite(y[0][i * ys + j]))
                MM_TEST_FAIL_("GEMV output row %lld col %lld is %g", (long long)i, (long long)j,
                              y[0][i * ys + j]);
    for (int p = 1; p < NP; p++) {
        if (rv[p] == MM_EUNSUPP && paths[p] == 3)
            continue; // no wgmma on this device
        if (rv[p] != MM_OK)
            MM_TEST_FAIL_("%s path: %s", names[p], mm_strerror(rv[p]));
        char what[96];
        snprintf(what, sizeof(what), "%s %lldx%lld -> %lld", names[p], (long long)n_rows,
                 (long long)n_in, (long long)n_out);
        bad |= bits_compare(what, y[p], y[0], n_rows, n_out, ys);
        if (paths[p] == 3)
            *wg_ran = 1;
    }
    for (int p = 0; p < NP; p++) {
        dev_free(dy[p]);
        free(y[p]);
    }
    dev_free(dw), dev_free(dx), dev_free(db);
    free(hw), free(x), free(b);
    return bad;
}

static void test_matmul_paths_bits(void) {
    gpu_open(&cpu);
    if (!mm_gpu_matmul || !mm_gpu_stream_sync)
        MM_SKIP("mm_gpu_matmul not linked");
    int bad = 0, wg = 0;
    bad |= path_bits_case(300, 2048, 384, 2048, 384, true, &wg);   // 8 k segments
    bad |= path_bits_case(257, 520, 300, 520, 300, false, &wg);    // partial 32-chunk, 3 segments
    bad |= path_bits_case(130, 130, 77, 136, 80, true, &wg);       // n_in % 8 != 0, strides
    bad |= path_bits_case(64, 4160, 136, 4160, 136, false, &wg);   // segment ends mid k-step
    bad |= path_bits_case(40, 768, 2048, 768, 2048, false, &wg);   // down_proj-shaped, few rows
    bad |= path_bits_case(129, 4096, 200, 4100, 201, true, &wg);   // 16 segments, row tile + 1
    if (bad)
        MM_TEST_FAIL_("a tensor-core path gave other bits than the GEMV (see above)");
    if (!wg)
        printf("wgmma path not available on this device (needs compute capability 9.0)\n");
    gpu_close(&cpu);
}

// Dense products of 9..127 rows on gemm_ws 28 (mm_gpu_set_ws_small 1: 65..127 rows; 2: also
// GEMV v2's shapes with >= 16 output tiles; up to 64 rows also as 29 and 30,
// mm_gpu_set_ws_small_bn64 and _half),
// through the backend's matmul eagerly and recorded
// as a graph (x converted into the stream's own buffer, W from the permuted-W cache), the graph
// replayed over new x: each the GEMV's bits, and the launch count shows that 28 ran both times.
static void test_ws_small_graph(void) {
    gpu_open(NULL);
    if (!mm_gpu_matmul || !mm_gpu_stream_sync || !mm_gpu_set_ws_small || !mm_gpu_ws_small_launches ||
        !mm_gpu_set_gemm_tile || !mm_gpu_set_ws_small_bn64 || !mm_gpu_set_ws_small_half ||
        !gpu->ops->capture_begin)
        MM_SKIP("mm_gpu_set_ws_small not linked");
    if (mm_gpu_set_segsplit)
        mm_gpu_set_segsplit(0); // these shapes would take gemm_seg
    { // wgmma at all?
        float *dx = dev_copy((float[16 * 16]){0}, 16 * 16 * 4), *dy = NULL;
        void *hw = NULL;
        (void)make_weight(MM_DTYPE_BF16, 16, 16, &hw);
        void *dw = dev_copy(hw, 16 * 16 * 2);
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, 16 * 16 * 4, (void **)&dy));
        mm_gpu_set_gemm_tile(28);
        const mm_err rv = mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, 16, 16, NULL, dx, 16, dy, 16, 16, 3);
        mm_gpu_set_gemm_tile(0);
        MM_PASS(mm_gpu_stream_sync(NULL));
        dev_free(dw), dev_free(dx), dev_free(dy);
        free(hw);
        if (rv == MM_EUNSUPP) {
            gpu_close(NULL);
            MM_SKIP("no wgmma on this device (needs compute capability 9.0)");
        }
        MM_PASS(rv);
    }
    const struct { int rows, n_in, n_out, mode; } cs[] = {
        {100, 1032, 300, 1},  // a 128-row tile, n_out off the 128 tile
        {64, 2048, 2304, 2},  // m64n64, exactly 64 rows
        {40, 2056, 2100, 2},  // m64n64, n_in off the 64 k-stage
        {20, 520, 2176, 2},   // m64n32
        {9, 4104, 2048, 2},   // the fewest rows taken, 16 k segments
    };
    int bad = 0;
    for (size_t c = 0; c < sizeof(cs) / sizeof(cs[0]); c++) {
        const int R = cs[c].rows, K = cs[c].n_in, N = cs[c].n_out;
        void *hw = NULL;
        (void)make_weight(MM_DTYPE_BF16, N, K, &hw);
        void *dw = dev_copy(hw, (size_t)N * K * 2);
        float *x = rand_f32((int64_t)R * K, 2.0f), *dx = dev_copy(x, (size_t)R * K * 4);
        float *dy = NULL, *dg = NULL;
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)R * N * 4, (void **)&dy));
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)R * N * 4, (void **)&dg));
        const mm_weight w = {.dtype = MM_DTYPE_BF16, .rows = N, .cols = K, .data = dw};
        mm_gpu_set_ws_small(cs[c].mode);
        for (int round = 0; round < (R <= 64 ? 6 : 2); round++) { // eager, recorded (28, 29, 30)
            mm_gpu_set_ws_small_bn64(round >= 2);
            mm_gpu_set_ws_small_half(round >= 4);
            MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)R * N));
            const int v = 28 + round / 2; // the variant this round must run
            const unsigned long long n0 = mm_gpu_ws_small_launches(v);
            void *graph = NULL;
            if (round % 2 == 1) { // recorded, replayed on new x
                MM_PASS(gpu->ops->capture_begin(gpu->ctx));
                MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R));
                MM_PASS(gpu->ops->capture_end(gpu->ctx, &graph));
                free(x);
                x = rand_f32((int64_t)R * K, 2.0f);
                MM_PASS(gpu->ops->set(gpu->ctx, dx, x, (size_t)R * K * 4));
                MM_PASS(gpu->ops->graph_launch(gpu->ctx, graph));
            } else {
                MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R));
            }
            const unsigned long long ran = mm_gpu_ws_small_launches(v) - n0;
            MM_PASS(gpu->ops->synchronize(gpu->ctx)); // the GEMV below runs on the null stream
            MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, N, K, NULL, dx, K, dg, N, R, 0));
            MM_PASS(mm_gpu_stream_sync(NULL));
            if (graph)
                gpu->ops->graph_free(gpu->ctx, graph);
            float *y = dev_get(dy, (size_t)R * N * 4), *g = dev_get(dg, (size_t)R * N * 4);
            char what[96];
            snprintf(what, sizeof(what), "gemm_ws %d %s %dx%d -> %d (mode %d)", v,
                     round % 2 ? "recorded" : "eager", R, K, N, cs[c].mode);
            bad |= bits_compare(what, y, g, R, N, N);
            if (ran != 1)
                MM_TEST_FAIL_("%s: variant %d launched %llu times, not once", what, v, ran);
            free(y), free(g);
        }
        if (c == 1) { // a weight rewritten after a recording: the graph is refused, not replayed
            void *graph = NULL;
            MM_PASS(gpu->ops->capture_begin(gpu->ctx));
            MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R));
            MM_PASS(gpu->ops->capture_end(gpu->ctx, &graph));
            free(hw);
            (void)make_weight(MM_DTYPE_BF16, N, K, &hw);
            MM_PASS(gpu->ops->set(gpu->ctx, dw, hw, (size_t)N * K * 2)); // drops W's copy
            MM_FAIL(gpu->ops->graph_launch(gpu->ctx, graph), MM_ECLOSED);
            gpu->ops->graph_free(gpu->ctx, graph);
            MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)R * N));
            MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R)); // a new copy
            MM_PASS(gpu->ops->synchronize(gpu->ctx));
            MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, N, K, NULL, dx, K, dg, N, R, 0));
            MM_PASS(mm_gpu_stream_sync(NULL));
            float *y = dev_get(dy, (size_t)R * N * 4), *g = dev_get(dg, (size_t)R * N * 4);
            bad |= bits_compare("gemm_ws after the weight was rewritten", y, g, R, N, N);
            free(y), free(g);
        }
        mm_gpu_set_ws_small_bn64(-1);
        mm_gpu_set_ws_small_half(-1);
        mm_gpu_set_ws_small(0); // the old choice does not take it
        unsigned long long n0 = 0, n1 = 0;
        for (int v = 28; v <= 30; v++)
            n0 += mm_gpu_ws_small_launches(v);
        MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        for (int v = 28; v <= 30; v++)
            n1 += mm_gpu_ws_small_launches(v);
        MM_EQ(n1, n0);
        mm_gpu_set_ws_small(-1);
        dev_free(dw), dev_free(dx), dev_free(dy), dev_free(dg);
        free(hw), free(x);
    }
    if (mm_gpu_set_segsplit)
        mm_gpu_set_segsplit(-1);
    if (bad)
        MM_TEST_FAIL_("gemm_ws 28, 29 or 30 gave other bits than the GEMV (see above)");
    gpu_close(NULL);
}

// Dense products of 1..64 rows on gemm_seg (MM_GPU_PATH_SEG: a block per 128 outputs and k
// segment, the segment sums added in order by a second kernel): the GEMV's bits, forced and as
// AUTO's choice, with a bias, with the residual (mm_gpu_matmul_res, in place as o_proj runs),
// eagerly and recorded then replayed on new x; the launch count shows that it ran.
static void test_segsplit(void) {
    gpu_open(NULL);
    if (!mm_gpu_matmul || !mm_gpu_matmul_res || !mm_gpu_stream_sync || !mm_gpu_set_segsplit ||
        !mm_gpu_segsplit_launches || !gpu->ops->capture_begin)
        MM_SKIP("mm_gpu_set_segsplit not linked");
    // take: whether AUTO gives it gemm_seg (>= 132 blocks; above 32 rows < 4096 outputs)
    const struct { int rows, n_in, n_out; bool bias, take; } cs[] = {
        {64, 4096, 2048, false, true},  // o_proj at batch 64: 16 segments
        {32, 2048, 5120, true, true},   // q/k/v at batch 32: 8 segments, a bias
        {9, 4096, 2048, false, true},   // the fewest rows AUTO gives it
        {33, 8192, 2176, false, true},  // 512-long segments: two register loads of W a segment
        {40, 4160, 2100, false, true},  // segments of 288, the last one 128 long
        {64, 2048, 5120, true, false},  // q/k/v at batch 64: gemm_ws 30 streams it better
        {9, 2048, 128, false, false},   // the router: 8 blocks
        {17, 768, 300, true, false},    // 3 segments, outputs off the 128 tile, rows off 8
        {1, 2048, 512, false, false},   // AUTO leaves <= 8 rows to GEMV v3
    };
    int bad = 0;
    mm_gpu_set_segsplit(1);
    for (size_t c = 0; c < sizeof(cs) / sizeof(cs[0]); c++) {
        const int R = cs[c].rows, K = cs[c].n_in, N = cs[c].n_out;
        void *hw = NULL;
        (void)make_weight(MM_DTYPE_BF16, N, K, &hw);
        void *dw = dev_copy(hw, (size_t)N * K * 2);
        float *x = rand_f32((int64_t)R * K, 2.0f), *dx = dev_copy(x, (size_t)R * K * 4);
        float *b = cs[c].bias ? rand_f32(N, 1.0f) : NULL;
        float *db = b ? dev_copy(b, (size_t)N * 4) : NULL;
        float *res = rand_f32((int64_t)R * N, 3.0f);
        float *dy = NULL, *dg = NULL, *dr = NULL;
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)R * N * 4, (void **)&dy));
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)R * N * 4, (void **)&dg));
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)R * N * 4, (void **)&dr));
        const mm_weight w = {.dtype = MM_DTYPE_BF16, .rows = N, .cols = K, .data = dw};
        for (int round = 0; round < 4; round++) { // forced, AUTO eager, AUTO recorded, residual
            if (round > 1 && !cs[c].take)
                break;
            MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)R * N));
            MM_PASS(gpu->ops->synchronize(gpu->ctx));
            const unsigned long long n0 = mm_gpu_segsplit_launches();
            void *graph = NULL;
            if (round == 0) {
                MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, N, K, db, dx, K, dy, N, R, 4));
                MM_PASS(mm_gpu_stream_sync(NULL));
            } else if (round == 1) {
                MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, N, K, db, dx, K, dy, N, R, -1));
                MM_PASS(mm_gpu_stream_sync(NULL));
            } else if (round == 2) { // recorded, replayed on new x
                MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R)); // the buffer
                MM_PASS(gpu->ops->capture_begin(gpu->ctx));
                MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, K, dy, N, R));
                MM_PASS(gpu->ops->capture_end(gpu->ctx, &graph));
                free(x);
                x = rand_f32((int64_t)R * K, 2.0f);
                MM_PASS(gpu->ops->set(gpu->ctx, dx, x, (size_t)R * K * 4));
                MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)R * N));
                MM_PASS(gpu->ops->graph_launch(gpu->ctx, graph));
                MM_PASS(gpu->ops->synchronize(gpu->ctx));
            } else { // y = product + res, y the residual's own rows
                MM_PASS(gpu->ops->set(gpu->ctx, dy, res, (size_t)R * N * 4));
                MM_PASS(gpu->ops->synchronize(gpu->ctx));
                MM_PASS(mm_gpu_matmul_res(NULL, MM_DTYPE_BF16, dw, N, K, dx, K, dy, N, dy, N, R));
                MM_PASS(mm_gpu_stream_sync(NULL));
            }
            const unsigned long long ran = mm_gpu_segsplit_launches() - n0;
            const float *bias = round == 2 || round == 3 ? NULL : db;
            MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, N, K, bias, dx, K, dg, N, R, 0));
            MM_PASS(mm_gpu_stream_sync(NULL));
            if (graph)
                gpu->ops->graph_free(gpu->ctx, graph);
            float *y = dev_get(dy, (size_t)R * N * 4), *g = dev_get(dg, (size_t)R * N * 4);
            if (round == 3)
                for (int64_t i = 0; i < (int64_t)R * N; i++)
                    g[i] = res[i] + g[i]; // the residual after the product, as axpy adds it
            char what[96];
            snprintf(what, sizeof(what), "gemm_seg %s %dx%d -> %d%s",
                     round == 0 ? "forced" : round == 1 ? (cs[c].take ? "auto" : "auto, not taken") : round == 2 ? "recorded" : "residual",
                     R, K, N, bias ? " +bias" : "");
            bad |= bits_compare(what, y, g, R, N, N);
            const unsigned long long want = round == 1 && !cs[c].take ? 0 : round == 2 ? 2 : 1;
            if (ran != want)
                MM_TEST_FAIL_("%s: gemm_seg ran %llu times, not %llu", what, ran, want);
            free(y), free(g);
        }
        dev_free(dw), dev_free(dx), dev_free(dy), dev_free(dg), dev_free(dr);
        if (db)
            dev_free(db);
        free(hw), free(x), free(b), free(res);
    }
    { // the switch off: AUTO does not take it
        mm_gpu_set_segsplit(0);
        void *hw = NULL;
        (void)make_weight(MM_DTYPE_BF16, 256, 256, &hw);
        void *dw = dev_copy(hw, 256 * 256 * 2);
        float *x = rand_f32(32 * 256, 1.0f), *dx = dev_copy(x, 32 * 256 * 4), *dy = NULL;
        MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, 32 * 256 * 4, (void **)&dy));
        const unsigned long long n0 = mm_gpu_segsplit_launches();
        MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, 256, 256, NULL, dx, 256, dy, 256, 32, -1));
        MM_PASS(mm_gpu_stream_sync(NULL));
        MM_EQ(mm_gpu_segsplit_launches(), n0);
        MM_FAIL(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, 256, 250, NULL, dx, 256, dy, 256, 32, 4),
                MM_EUNSUPP); // n_in % 32 != 0: forced, it refuses
        dev_free(dw), dev_free(dx), dev_free(dy);
        free(hw), free(x);
    }
    mm_gpu_set_segsplit(-1);
    if (bad)
        MM_TEST_FAIL_("gemm_seg gave other bits than the GEMV (see above)");
    gpu_close(NULL);
}

// All routed rows of a layer in one grouped launch = per-expert table matmuls, bit for bit,
// at decode (few rows per expert) and prefill (many) shapes.
static void moe_case(int n_experts, int n_rows, int n_in, int n_out) {
    void **hw = calloc((size_t)n_experts, sizeof(void *));
    void **dws = calloc((size_t)n_experts, sizeof(void *));
    int32_t *offs = calloc((size_t)n_experts + 1, sizeof(int32_t));
    int32_t *cnt = calloc((size_t)n_experts, sizeof(int32_t));
    for (int r = 0; r < n_rows; r++) // skewed assignment, some experts empty
        cnt[(int)((frand() * 0.5f + 0.5f) * (frand() * 0.5f + 0.5f) * n_experts) % n_experts]++;
    for (int e = 0; e < n_experts; e++)
        offs[e + 1] = offs[e] + cnt[e];
    for (int e = 0; e < n_experts; e++) {
        mm_weight w = make_weight(MM_DTYPE_BF16, n_out, n_in, &hw[e]);
        (void)w;
        dws[e] = dev_copy(hw[e], (size_t)n_out * n_in * 2);
    }
    float *x = rand_f32((size_t)n_rows * n_in, 1.0f);
    float *dx = dev_copy(x, (size_t)n_rows * n_in * 4);
    void *d_wtab = dev_copy(dws, (size_t)n_experts * sizeof(void *));
    int32_t *d_offs = dev_copy(offs, (size_t)(n_experts + 1) * 4);
    float *dy = NULL, *dy_ref = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n_rows * n_out * 4, (void **)&dy));
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n_rows * n_out * 4, (void **)&dy_ref));
    MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)n_rows * n_out));
    MM_PASS(gpu->ops->synchronize(gpu->ctx)); // the grouped call below runs on the null stream
    MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)d_wtab, d_offs, n_experts,
                              n_out, n_in, dx, n_in, dy, n_out, n_rows, -1));
    MM_PASS(mm_gpu_stream_sync(NULL)); // the null stream does not order the backend's stream
    for (int e = 0; e < n_experts; e++) {
        if (cnt[e] == 0)
            continue;
        mm_weight w = {.dtype = MM_DTYPE_BF16, .rows = n_out, .cols = n_in, .data = dws[e]};
        MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx + (int64_t)offs[e] * n_in, n_in,
                                 dy_ref + (int64_t)offs[e] * n_out, n_out, cnt[e]));
    }
    float *y = dev_get(dy, (size_t)n_rows * n_out * 4);
    float *y_ref = dev_get(dy_ref, (size_t)n_rows * n_out * 4);
    if (memcmp(y, y_ref, (size_t)n_rows * n_out * 4) != 0)
        MM_TEST_FAIL_("grouped product (%d experts, %d rows) differs from per-expert products",
                      n_experts, n_rows);
    // every grouped path against the grouped GEMV: the wgmma tiles (2) and gemm_ws grouped, a
    // block per tile (19) and persistent (20); the per-expert products above ran AUTO
    if (mm_gpu_set_gemm_tile) {
        const int path[4] = {0, 3, 3, 3}, var[4] = {0, 2, 19, 20};
        const char *name[4] = {"gemv", "wgmma 128x128", "gemm_ws grouped", "gemm_ws grouped persistent"};
        float *yp[4] = {NULL};
        for (int p = 0; p < 4; p++) {
            MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)n_rows * n_out));
            MM_PASS(gpu->ops->synchronize(gpu->ctx));
            mm_gpu_set_gemm_tile(var[p]);
            const mm_err rv = mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)d_wtab,
                                                d_offs, n_experts, n_out, n_in, dx, n_in, dy,
                                                n_out, n_rows, path[p]);
            mm_gpu_set_gemm_tile(0);
            if (rv == MM_EUNSUPP && path[p] == 3)
                continue; // no wgmma on this device
            MM_PASS(rv);
            MM_PASS(mm_gpu_stream_sync(NULL));
            yp[p] = dev_get(dy, (size_t)n_rows * n_out * 4);
        }
        for (int p = 1; p < 4; p++)
            if (yp[p] && bits_compare(name[p], yp[p], yp[0], n_rows, n_out, n_out))
                MM_TEST_FAIL_("grouped %s (%d experts, %d rows, %dx%d) differs from the grouped GEMV",
                              name[p], n_experts, n_rows, n_in, n_out);
        if (memcmp(yp[0], y_ref, (size_t)n_rows * n_out * 4) != 0)
            MM_TEST_FAIL_("grouped GEMV (%d experts, %d rows) differs from per-expert products",
                          n_experts, n_rows);
        for (int p = 0; p < 4; p++)
            free(yp[p]);
    }
    // the same through the backend table (host weight views and offsets)
    if (gpu->ops->moe_matmul) {
        mm_weight *wv = calloc((size_t)n_experts, sizeof(mm_weight));
        for (int e = 0; e < n_experts; e++)
            wv[e] = (mm_weight){.dtype = MM_DTYPE_BF16, .rows = n_out, .cols = n_in,
                                .data = cnt[e] ? dws[e] : NULL};
        MM_PASS(gpu->ops->fill(gpu->ctx, dy, NAN, (int64_t)n_rows * n_out));
        MM_PASS(gpu->ops->moe_matmul(gpu->ctx, wv, offs, n_experts, dx, n_in, dy, n_out, n_rows));
        float *y2 = dev_get(dy, (size_t)n_rows * n_out * 4);
        if (memcmp(y2, y_ref, (size_t)n_rows * n_out * 4) != 0)
            MM_TEST_FAIL_("table moe_matmul (%d experts, %d rows) differs from per-expert products",
                          n_experts, n_rows);
        offs[n_experts] += 1; // offsets that do not end at n_rows are refused
        MM_EQ(gpu->ops->moe_matmul(gpu->ctx, wv, offs, n_experts, dx, n_in, dy, n_out, n_rows),
              MM_EINVAL);
        offs[n_experts] -= 1;
        free(wv), free(y2);
    } else {
        MM_TEST_FAIL_("the CUDA backend table has no moe_matmul");
    }
    printf("grouped %d experts x %d rows (%dx%d): bit-identical\n", n_experts, n_rows, n_in, n_out);
    for (int e = 0; e < n_experts; e++) {
        dev_free(dws[e]);
        free(hw[e]);
    }
    dev_free(dx), dev_free(d_wtab), dev_free(d_offs), dev_free(dy), dev_free(dy_ref);
    free(hw), free(dws), free(offs), free(cnt), free(x), free(y), free(y_ref);
}

static void test_moe_matmul_grouped(void) {
    gpu_open(&cpu);
    if (!mm_gpu_moe_matmul || !mm_gpu_stream_sync)
        MM_SKIP("mm_gpu_moe_matmul not linked");
    moe_case(16, 8, 256, 96);     // decode: about one row per expert
    moe_case(128, 512, 256, 64);  // batch 64 x top-8
    moe_case(8, 1200, 264, 136);  // prefill: many rows per expert, odd n_out
    moe_case(6, 900, 2048, 200);  // prefill, 8 k segments (wgmma tiles on sm_90)
    // gemm_ws grouped (AUTO from 128 rows per expert): expert row counts not multiples of 8,
    // empty experts, partial 32-chunk and odd n_out; then 16 segments, partial output tile
    moe_case(12, 3000, 520, 300);
    moe_case(5, 1400, 4096, 136);
    gpu_close(&cpu);
}

// The permuted-W cache (gemm_ws dense weights) never serves a stale copy: a product, then the
// weight rewritten in place (backend set) and the product again, then freed and a new weight
// likely at the same address; each against the GEMV over the same weight.
static void test_wperm_cache(void) {
    gpu_open(&cpu);
    if (!mm_gpu_matmul || !mm_gpu_stream_sync || !mm_gpu_wperm_bytes || !mm_gpu_set_wperm_mb ||
        !mm_gpu_set_gemm_tile)
        MM_SKIP("mm_gpu_matmul not linked");
    const int n_rows = 300, n_in = 1024, n_out = 256;
    float *x = rand_f32((size_t)n_rows * n_in, 1.0f);
    float *dx = dev_copy(x, (size_t)n_rows * n_in * 4);
    float *dy = NULL, *dg = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n_rows * n_out * 4, (void **)&dy));
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n_rows * n_out * 4, (void **)&dg));
    void *hw = NULL;
    (void)make_weight(MM_DTYPE_BF16, n_out, n_in, &hw);
    void *dw = dev_copy(hw, (size_t)n_out * n_in * 2);
    const size_t held = mm_gpu_wperm_bytes(); // copies of other weights still alive, if any
    bool wg = false;
    for (int round = 0; round < 4; round++) {
        if (round == 1 || round == 3) { // new weight bytes: in place, or in a new buffer
            free(hw);
            (void)make_weight(MM_DTYPE_BF16, n_out, n_in, &hw);
            if (round == 3) {
                dev_free(dw);
                dw = dev_copy(hw, (size_t)n_out * n_in * 2);
            } else {
                MM_PASS(gpu->ops->set(gpu->ctx, dw, hw, (size_t)n_out * n_in * 2));
            }
            MM_EQ(mm_gpu_wperm_bytes(), held); // this weight's copy was dropped
        }
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        mm_gpu_set_gemm_tile(14);
        const mm_err rv = mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, NULL, dx, n_in, dy,
                                        n_out, n_rows, 3);
        mm_gpu_set_gemm_tile(0);
        if (rv == MM_EUNSUPP)
            break; // no wgmma on this device
        MM_PASS(rv);
        wg = true;
        MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, NULL, dx, n_in, dg, n_out,
                              n_rows, 0));
        MM_PASS(mm_gpu_stream_sync(NULL));
        MM_TRUE(mm_gpu_wperm_bytes() > held); // the copy is kept (default bound: 10% of memory)
        float *y = dev_get(dy, (size_t)n_rows * n_out * 4), *g = dev_get(dg, (size_t)n_rows * n_out * 4);
        char what[64];
        snprintf(what, sizeof(what), "gemm_ws cached W, round %d", round);
        if (bits_compare(what, y, g, n_rows, n_out, n_out))
            MM_TEST_FAIL_("round %d: gemm_ws with the cached W differs from the GEMV", round);
        free(y), free(g);
    }
    if (wg) { // bound 0: no copy kept, same bits
        mm_gpu_set_wperm_mb(0);
        MM_EQ(mm_gpu_wperm_bytes(), (size_t)0);
        mm_gpu_set_gemm_tile(14);
        MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, NULL, dx, n_in, dy, n_out,
                              n_rows, 3));
        mm_gpu_set_gemm_tile(0);
        MM_PASS(mm_gpu_stream_sync(NULL));
        MM_EQ(mm_gpu_wperm_bytes(), (size_t)0);
        float *y = dev_get(dy, (size_t)n_rows * n_out * 4), *g = dev_get(dg, (size_t)n_rows * n_out * 4);
        if (bits_compare("gemm_ws uncached W", y, g, n_rows, n_out, n_out))
            MM_TEST_FAIL_("gemm_ws without the cache differs from the GEMV");
        free(y), free(g);
        mm_gpu_set_wperm_mb(-1);
    } else {
        printf("wgmma path not available on this device (needs compute capability 9.0)\n");
    }
    dev_free(dw), dev_free(dx), dev_free(dy), dev_free(dg);
    free(hw), free(x);
    gpu_close(&cpu);
}

// The grouped form: a copy of every expert of a table; rewriting one expert drops it, and so
// does rewriting the table (which is then not cached again); each product against the
// grouped GEMV over the same weights.
static void test_wperm_cache_grouped(void) {
    gpu_open(&cpu);
    if (!mm_gpu_moe_matmul || !mm_gpu_stream_sync || !mm_gpu_wperm_bytes ||
        !mm_gpu_set_wperm_mb || !mm_gpu_set_gemm_tile)
        MM_SKIP("mm_gpu_moe_matmul not linked");
    enum { E = 4 };
    const int n_rows = 600, n_in = 512, n_out = 256;
    int32_t offs[E + 1] = {0, 150, 300, 450, 600};
    void *hw[E], *dws[E];
    for (int e = 0; e < E; e++) {
        (void)make_weight(MM_DTYPE_BF16, n_out, n_in, &hw[e]);
        dws[e] = dev_copy(hw[e], (size_t)n_out * n_in * 2);
    }
    float *x = rand_f32((size_t)n_rows * n_in, 1.0f);
    float *dx = dev_copy(x, (size_t)n_rows * n_in * 4);
    void *d_tab = dev_copy(dws, sizeof(dws));
    int32_t *d_offs = dev_copy(offs, sizeof(offs));
    float *dy = NULL, *dg = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n_rows * n_out * 4, (void **)&dy));
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n_rows * n_out * 4, (void **)&dg));
    const size_t held = mm_gpu_wperm_bytes();
    for (int round = 0; round < 4; round++) {
        if (round == 1) { // expert 2 rewritten in place
            free(hw[2]);
            (void)make_weight(MM_DTYPE_BF16, n_out, n_in, &hw[2]);
            MM_PASS(gpu->ops->set(gpu->ctx, dws[2], hw[2], (size_t)n_out * n_in * 2));
            MM_EQ(mm_gpu_wperm_bytes(), held);
        } else if (round == 2) { // the table rewritten: experts 0 and 1 swapped
            void *t = dws[0];
            dws[0] = dws[1], dws[1] = t;
            MM_PASS(gpu->ops->set(gpu->ctx, d_tab, dws, sizeof(dws)));
            MM_EQ(mm_gpu_wperm_bytes(), held);
        }
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        mm_gpu_set_gemm_tile(20);
        const mm_err rv = mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)d_tab, d_offs,
                                            E, n_out, n_in, dx, n_in, dy, n_out, n_rows, 3);
        mm_gpu_set_gemm_tile(0);
        if (rv == MM_EUNSUPP) {
            printf("wgmma path not available on this device (needs compute capability 9.0)\n");
            break;
        }
        MM_PASS(rv);
        MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)d_tab, d_offs, E,
                                  n_out, n_in, dx, n_in, dg, n_out, n_rows, 0));
        MM_PASS(mm_gpu_stream_sync(NULL));
        if (round < 2)
            MM_TRUE(mm_gpu_wperm_bytes() > held); // kept
        else
            MM_EQ(mm_gpu_wperm_bytes(), held); // a table rewritten in place is not cached again
        float *y = dev_get(dy, (size_t)n_rows * n_out * 4), *g = dev_get(dg, (size_t)n_rows * n_out * 4);
        char what[64];
        snprintf(what, sizeof(what), "gemm_ws grouped cached W, round %d", round);
        if (bits_compare(what, y, g, n_rows, n_out, n_out))
            MM_TEST_FAIL_("round %d: grouped gemm_ws with the cached W differs from the GEMV", round);
        free(y), free(g);
    }
    for (int e = 0; e < E; e++) {
        dev_free(dws[e]);
        free(hw[e]);
    }
    MM_EQ(mm_gpu_wperm_bytes(), held);
    dev_free(dx), dev_free(d_tab), dev_free(d_offs), dev_free(dy), dev_free(dg);
    free(x);
    gpu_close(&cpu);
}

// ---- row ops -------------------------------------------------------------------------------------
static void test_rmsnorm(void) {
    gpu_open(&cpu);
    const enum mm_dtype dts[] = {MM_DTYPE_BF16, MM_DTYPE_F32, MM_DTYPE_F16};
    const int64_t dims[] = {2048, 128, 77};
    for (int c = 0; c < 3; c++) {
        int64_t d = dims[c], n = 33, st = d + 3;
        void *hw = NULL;
        mm_weight w = make_weight(dts[c], 1, d, &hw);
        float *x = rand_f32((size_t)(n * st), 3.0f);
        float *y = rand_f32((size_t)(n * st), 1.0f);
        MM_PASS(cpu->ops->rmsnorm(cpu->ctx, &w, 1e-6f, x, st, y, st, n));
        mm_weight dw = w;
        dw.data = dev_copy(hw, (size_t)d * mm_dtype_size(dts[c]));
        float *dx = dev_copy(x, (size_t)(n * st) * 4);
        MM_PASS(gpu->ops->rmsnorm(gpu->ctx, &dw, 1e-6f, dx, st, dx, st, n)); // in place
        float *g = dev_get(dx, (size_t)(n * st) * 4);
        char what[64];
        snprintf(what, sizeof(what), "rmsnorm dim %lld (%s, in place)", (long long)d, mm_dtype_name(dts[c]));
        CHECK_NMSE(what, nmse_rows(g, y, n, d, st), 1e-11);
        dev_free((void *)dw.data), dev_free(dx);
        free(hw), free(x), free(y), free(g);
    }
    gpu_close(&cpu);
}

static void test_rope(void) {
    gpu_open(&cpu);
    struct { enum mm_rope_style style; int head_dim, rot_offset, rot_dim; float mscale; } cs[] = {
        {MM_ROPE_NEOX, 128, 0, 128, 1.0f},       // Qwen3
        {MM_ROPE_NEOX, 128, 0, 64, 1.0f},        // partial rotary (GLM)
        {MM_ROPE_INTERLEAVED, 192, 128, 64, 1.3f}, // DeepSeek: rope part after nope, yarn mscale
    };
    for (int c = 0; c < 3; c++) {
        const int64_t n = 19, heads = 5, hd = cs[c].head_dim, st = heads * hd + 4;
        float *x = rand_f32((size_t)(n * st), 1.0f);
        int32_t pos[19];
        for (int i = 0; i < n; i++)
            pos[i] = i * 977 % 40000;
        float inv[128];
        for (int i = 0; i < cs[c].rot_dim / 2; i++)
            inv[i] = powf(1e6f, -2.0f * (float)i / (float)cs[c].rot_dim);
        struct mm_rope_args a = {.x = x, .n_rows = n, .row_stride = st, .n_heads = (int)heads,
                                 .head_stride = hd, .rot_offset = cs[c].rot_offset,
                                 .rot_dim = cs[c].rot_dim, .pos = pos, .inv_freq = inv,
                                 .mscale = cs[c].mscale, .style = cs[c].style};
        float *dx = dev_copy(x, (size_t)(n * st) * 4);
        MM_PASS(cpu->ops->rope(cpu->ctx, &a));
        struct mm_rope_args g = a;
        g.x = dx;
        g.pos = dev_copy(pos, sizeof(pos));
        g.inv_freq = dev_copy(inv, sizeof(float) * (size_t)cs[c].rot_dim / 2);
        MM_PASS(gpu->ops->rope(gpu->ctx, &g));
        float *y = dev_get(dx, (size_t)(n * st) * 4);
        char what[64];
        snprintf(what, sizeof(what), "rope %s rot %d/%d", cs[c].style == MM_ROPE_NEOX ? "neox" : "interleaved",
                 cs[c].rot_dim, cs[c].head_dim);
        CHECK_NMSE(what, nmse_rows(y, x, n, st, st), 1e-10);
        dev_free(dx), dev_free((void *)g.pos), dev_free((void *)g.inv_freq);
        free(x), free(y);
    }
    gpu_close(&cpu);
}

// Paged cache with shuffled blocks: kv_store of prefill rows then attention for decode and
// prefill rows, GQA, optional sliding window, MLA-like dk != dv.
static void attn_case(int n_heads, int n_kv, int dk, int dv, int window) {
    const int bs = 16, n_seqs = 3, max_blocks = 12, n_blocks = n_seqs * max_blocks;
    const int lens[3] = {1, 77, 150};
    const int64_t slot = (int64_t)n_kv * (dk + dv), bstride = slot * bs;
    const size_t pool_n = (size_t)(n_blocks * bstride);
    int32_t tables[3 * 12];
    for (int i = 0; i < n_seqs * max_blocks; i++) // a permutation: blocks far apart
        tables[i] = (i * 7 + 3) % n_blocks;
    int32_t *rs = NULL, *rp = NULL;
    const int n_rows = seq_rows(lens, n_seqs, &rs, &rp);
    const int64_t kst = (int64_t)n_kv * dk + 2, vst = (int64_t)n_kv * dv + 1;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv;
    float *k = rand_f32((size_t)(n_rows * kst), 1.0f), *v = rand_f32((size_t)(n_rows * vst), 1.0f);
    float *q = rand_f32((size_t)(n_rows * qst), 1.0f);
    float *pool = calloc(pool_n, 4), *out = calloc((size_t)(n_rows * ost), 4);
    struct mm_kv_view kv = {.base = pool, .block_size = bs, .block_stride = bstride,
                            .slot_stride = slot, .n_kv_heads = n_kv, .head_dim_k = dk,
                            .head_dim_v = dv, .block_tables = tables, .max_blocks = max_blocks};
    struct mm_kv_store_args st = {.kv = kv, .k = k, .k_stride = kst, .v = v, .v_stride = vst,
                                  .n_rows = n_rows, .row_seq = rs, .row_pos = rp};
    struct mm_attn_args at = {.kv = kv, .q = q, .q_stride = qst, .out = out, .out_stride = ost,
                              .n_rows = n_rows, .row_seq = rs, .row_pos = rp, .n_heads = n_heads,
                              .scale = 1.0f / sqrtf((float)dk), .window = window};
    MM_PASS(cpu->ops->kv_store(cpu->ctx, &st));
    MM_PASS(cpu->ops->attention(cpu->ctx, &at));

    struct mm_kv_view dkv = kv;
    dkv.base = dev_copy(pool, pool_n * 4);
    MM_PASS(gpu->ops->fill(gpu->ctx, dkv.base, 0.0f, (int64_t)pool_n));
    dkv.block_tables = dev_copy(tables, sizeof(tables));
    struct mm_kv_store_args dst = st;
    dst.kv = dkv;
    dst.k = dev_copy(k, (size_t)(n_rows * kst) * 4);
    dst.v = dev_copy(v, (size_t)(n_rows * vst) * 4);
    dst.row_seq = dev_copy(rs, (size_t)n_rows * 4);
    dst.row_pos = dev_copy(rp, (size_t)n_rows * 4);
    struct mm_attn_args dat = at;
    dat.kv = dkv;
    dat.q = dev_copy(q, (size_t)(n_rows * qst) * 4);
    dat.out = dev_copy(out, (size_t)(n_rows * ost) * 4);
    dat.row_seq = dst.row_seq;
    dat.row_pos = dst.row_pos;
    MM_PASS(gpu->ops->kv_store(gpu->ctx, &dst));
    MM_PASS(gpu->ops->attention(gpu->ctx, &dat));
    float *g = dev_get(dat.out, (size_t)(n_rows * ost) * 4);
    float *gpool = dev_get(dkv.base, pool_n * 4);
    MM_TRUE(memcmp(gpool, pool, pool_n * 4) == 0); // kv_store is a copy: exact
    char what[96];
    snprintf(what, sizeof(what), "attention %dh/%dkv dk %d dv %d window %d", n_heads, n_kv, dk, dv, window);
    CHECK_NMSE(what, nmse_rows(g, out, n_rows, ost, ost), 1e-10);
    // The last row of sequence 2 alone (decode) equals its value inside the prefill call.
    int64_t last = n_rows - 1;
    struct mm_attn_args one = dat;
    one.q = dat.q + last * qst;
    one.row_seq = dst.row_seq + last;
    one.row_pos = dst.row_pos + last;
    one.n_rows = 1;
    one.out = dat.out;
    MM_PASS(gpu->ops->attention(gpu->ctx, &one));
    float *g1 = dev_get(dat.out, (size_t)ost * 4);
    MM_TRUE(memcmp(g1, g + last * ost, (size_t)ost * 4) == 0);
    dev_free(dkv.base), dev_free((void *)dkv.block_tables), dev_free((void *)dst.k);
    dev_free((void *)dst.v), dev_free((void *)dst.row_seq), dev_free((void *)dst.row_pos);
    dev_free((void *)dat.q), dev_free(dat.out);
    free(rs), free(rp), free(k), free(v), free(q), free(pool), free(out), free(g), free(gpool), free(g1);
}

// The f32 kernels (the contract of HIP builds and of head dims the tensor-core kernel does not
// take) against the CPU at 1e-10; cuda_attention_tc_test checks the tensor-core contract.
static void test_attention(void) {
    gpu_open(&cpu);
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(0);
    attn_case(8, 2, 64, 64, 0);    // GQA 4:1
    attn_case(4, 4, 96, 64, 0);    // MLA-like: dk != dv, n_kv = n_heads
    attn_case(6, 3, 128, 128, 40); // sliding window
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(-1);
    gpu_close(&cpu);
}

static void test_embed_swiglu_axpy_sigmoid_copy(void) {
    gpu_open(&cpu);
    // embed (bf16 table): exact
    void *ht = NULL;
    mm_weight t = make_weight(MM_DTYPE_BF16, 1000, 72, &ht);
    int32_t ids[7] = {0, 999, 5, 5, 123, 998, 1};
    float *o = calloc(7 * 80, 4);
    MM_PASS(cpu->ops->embed(cpu->ctx, &t, ids, 7, o, 80));
    mm_weight dt = t;
    dt.data = dev_copy(ht, 1000 * 72 * 2);
    int32_t *dids = dev_copy(ids, sizeof(ids));
    float *dout = dev_copy(o, 7 * 80 * 4);
    MM_PASS(gpu->ops->fill(gpu->ctx, dout, 0.0f, 7 * 80));
    MM_PASS(gpu->ops->embed(gpu->ctx, &dt, dids, 7, dout, 80));
    float *g = dev_get(dout, 7 * 80 * 4);
    MM_TRUE(memcmp(g, o, 7 * 80 * 4) == 0);
    // an id out of range is reported (at the next synchronize/get), not a crash
    int32_t bad = 1000;
    MM_PASS(gpu->ops->set(gpu->ctx, dids, &bad, 4));
    MM_PASS(gpu->ops->embed(gpu->ctx, &dt, dids, 1, dout, 80));
    MM_FAIL(gpu->ops->synchronize(gpu->ctx), MM_EINVAL);
    MM_PASS(gpu->ops->synchronize(gpu->ctx)); // the error word was cleared
    free(g);

    // swiglu (out aliases gate) and sigmoid
    const int64_t n = 13, d = 300, s = 301;
    float *gt = rand_f32((size_t)(n * s), 4.0f), *up = rand_f32((size_t)(n * s), 1.0f);
    float *dg = dev_copy(gt, (size_t)(n * s) * 4), *du = dev_copy(up, (size_t)(n * s) * 4);
    MM_PASS(cpu->ops->swiglu(cpu->ctx, gt, s, up, s, gt, s, n, d));
    MM_PASS(gpu->ops->swiglu(gpu->ctx, dg, s, du, s, dg, s, n, d));
    g = dev_get(dg, (size_t)(n * s) * 4);
    CHECK_NMSE("swiglu 13x300 (in place)", nmse_rows(g, gt, n, d, s), 1e-12);
    free(g);
    MM_PASS(cpu->ops->sigmoid(cpu->ctx, up, n * s));
    MM_PASS(gpu->ops->sigmoid(gpu->ctx, du, n * s));
    g = dev_get(du, (size_t)(n * s) * 4);
    CHECK_NMSE("sigmoid 3913", nmse_rows(g, up, 1, n * s, n * s), 1e-12);
    free(g);

    // axpy: same rounding as the CPU, bit for bit
    float *x = rand_f32((size_t)(n * s), 1.0f), *y = rand_f32((size_t)(n * s), 1.0f);
    float *al = rand_f32((size_t)n, 1.0f);
    float *dx = dev_copy(x, (size_t)(n * s) * 4), *dy = dev_copy(y, (size_t)(n * s) * 4);
    float *dal = dev_copy(al, (size_t)n * 4);
    MM_PASS(cpu->ops->axpy(cpu->ctx, al, x, s, y, s, n, d));
    MM_PASS(cpu->ops->axpy(cpu->ctx, NULL, x, s, y, s, n, d));
    MM_PASS(gpu->ops->axpy(gpu->ctx, dal, dx, s, dy, s, n, d));
    MM_PASS(gpu->ops->axpy(gpu->ctx, NULL, dx, s, dy, s, n, d));
    g = dev_get(dy, (size_t)(n * s) * 4);
    MM_TRUE(memcmp(g, y, (size_t)(n * s) * 4) == 0);
    printf("axpy: bit-identical to the CPU\n");
    free(g);

    // copy_rows: gather then scatter with indices
    int32_t si[4] = {12, 0, 5, 5}, di[4] = {3, 1, 0, 2};
    float *cp = calloc((size_t)(4 * s), 4);
    MM_PASS(cpu->ops->copy_rows(cpu->ctx, x, s, si, cp, s, di, 4, d));
    int32_t *dsi = dev_copy(si, sizeof(si)), *ddi = dev_copy(di, sizeof(di));
    float *dcp = dev_copy(cp, (size_t)(4 * s) * 4);
    MM_PASS(gpu->ops->fill(gpu->ctx, dcp, 0.0f, 4 * s));
    MM_PASS(gpu->ops->copy_rows(gpu->ctx, dx, s, dsi, dcp, s, ddi, 4, d));
    g = dev_get(dcp, (size_t)(4 * s) * 4);
    MM_TRUE(memcmp(g, cp, (size_t)(4 * s) * 4) == 0);
    free(g);

    dev_free((void *)dt.data), dev_free(dids), dev_free(dout), dev_free(dg), dev_free(du);
    dev_free(dx), dev_free(dy), dev_free(dal), dev_free(dsi), dev_free(ddi), dev_free(dcp);
    free(ht), free(o), free(gt), free(up), free(x), free(y), free(al), free(cp);
    gpu_close(&cpu);
}

// ---- routing -----------------------------------------------------------------------------------
static void route_case(const char *name, struct mm_route_params p, int64_t n_rows) {
    const int E = p.n_experts, K = p.top_k;
    const int64_t ls = E + 5;
    float *logits = rand_f32((size_t)(n_rows * ls), 4.0f);
    float *bias = p.bias ? rand_f32((size_t)E, 0.1f) : NULL;
    p.bias = bias;
    int32_t *ids = calloc((size_t)(n_rows * K), 4);
    float *w = calloc((size_t)(n_rows * K), 4);
    MM_PASS(cpu->ops->route(cpu->ctx, &p, logits, ls, n_rows, ids, w));
    struct mm_route_params dp = p;
    dp.bias = bias ? dev_copy(bias, (size_t)E * 4) : NULL;
    float *dl = dev_copy(logits, (size_t)(n_rows * ls) * 4);
    int32_t *dids = dev_copy(ids, (size_t)(n_rows * K) * 4);
    float *dw = dev_copy(w, (size_t)(n_rows * K) * 4);
    MM_PASS(gpu->ops->route(gpu->ctx, &dp, dl, ls, n_rows, dids, dw));
    int32_t *gi = dev_get(dids, (size_t)(n_rows * K) * 4);
    float *gw = dev_get(dw, (size_t)(n_rows * K) * 4);
    for (int64_t i = 0; i < n_rows * K; i++)
        if (gi[i] != ids[i])
            MM_TEST_FAIL_("%s: row %lld rank %lld: gpu expert %d, cpu %d", name, (long long)(i / K),
                          (long long)(i % K), gi[i], ids[i]);
    CHECK_NMSE(name, nmse_rows(gw, w, n_rows, K, K), 1e-11);
    dev_free((void *)dp.bias), dev_free(dl), dev_free(dids), dev_free(dw);
    free(logits), free(bias), free(ids), free(w), free(gi), free(gw);
}

static void test_route(void) {
    gpu_open(&cpu);
    route_case("route softmax 128 top-8 renorm (Qwen3)",
               (struct mm_route_params){.n_experts = 128, .top_k = 8, .score = MM_ROUTE_SOFTMAX,
                                        .renorm = true, .scale = 1.0f}, 70);
    route_case("route softmax 8 top-2 (Mixtral)",
               (struct mm_route_params){.n_experts = 8, .top_k = 2, .score = MM_ROUTE_SOFTMAX,
                                        .renorm = true, .scale = 1.0f}, 33);
    float one = 1.0f; // non-NULL marker: route_case replaces it with a random bias
    route_case("route sigmoid 256 groups 8/4 bias (DeepSeek V3)",
               (struct mm_route_params){.n_experts = 256, .top_k = 8, .score = MM_ROUTE_SIGMOID,
                                        .bias = &one, .n_group = 8, .topk_group = 4,
                                        .renorm = true, .renorm_eps = 1e-20f, .scale = 2.5f}, 40);
    route_case("route sigmoid 160 top-6 no renorm",
               (struct mm_route_params){.n_experts = 160, .top_k = 6, .score = MM_ROUTE_SIGMOID,
                                        .scale = 1.0f}, 9);
    gpu_close(&cpu);
}

static void test_bad_args(void) {
    gpu_open(&cpu);
    mm_weight w = {.dtype = MM_DTYPE_I8, .rows = 4, .cols = 4, .data = (void *)16};
    float *d = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, 64, (void **)&d));
    MM_FAIL(gpu->ops->matmul(gpu->ctx, &w, NULL, d, 4, d + 8, 4, 1), MM_EINVAL);
    struct mm_route_params p = {.n_experts = 4, .top_k = 5};
    MM_FAIL(gpu->ops->route(gpu->ctx, &p, d, 4, 1, (int32_t *)d, d), MM_EINVAL);
    dev_free(d);
    char err[MM_ERRLEN] = "";
    mm_backend *b = NULL;
    MM_FAIL(mm_backend_open(&b, "cuda:999", NULL, err), MM_EINVAL);
    printf("cuda:999 -> %s\n", err);
    gpu_close(&cpu);
}

// Greedy sampling on the device: argmax with ties to the lower id, NaN skipped.
static void test_argmax(void) {
    gpu_open(&cpu);
    if (!mm_gpu_argmax || !mm_gpu_stream_sync)
        MM_SKIP("mm_gpu_argmax not linked");
    const int64_t n = 5, vocab = 151936, ls = vocab + 3;
    float *l = rand_f32((size_t)(n * ls), 10.0f);
    l[0 * ls + 77] = 50.0f, l[0 * ls + 151935] = 50.0f; // tie: 77 wins
    l[1 * ls + 0] = NAN, l[1 * ls + 5] = 60.0f;
    l[2 * ls + 151935] = 70.0f;
    int32_t want[5];
    for (int64_t i = 0; i < n; i++) {
        int32_t b = -1;
        for (int v = 0; v < vocab; v++)
            if (!isnan(l[i * ls + v]) && (b < 0 || l[i * ls + v] > l[i * ls + b]))
                b = v;
        want[i] = b;
    }
    MM_EQ(want[0], 77);
    float *dl = dev_copy(l, (size_t)(n * ls) * 4);
    int32_t *dids = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)n * 4, (void **)&dids));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    MM_PASS(mm_gpu_argmax(NULL, dl, ls, n, vocab, dids));
    MM_PASS(mm_gpu_stream_sync(NULL));
    int32_t *got = dev_get(dids, (size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        MM_EQ(got[i], want[i]);
    dev_free(dl), dev_free(dids);
    free(l), free(got);
    gpu_close(&cpu);
}

// Drains have a deadline: a stream held longer than the drain timeout gives MM_ETIMEDOUT (not a
// hang), and drains once the hold has passed. (The setter, not MM_GPU_DRAIN_TIMEOUT_MS, which a
// process reads once: with all cases in one process an earlier drain has read it.)
static void test_drain_deadline(void) {
    gpu_open(&cpu);
    if (!mm_gpu_stream_hold || !mm_gpu_stream_new || !mm_gpu_stream_sync || !mm_gpu_set_drain_timeout_ms)
        MM_SKIP("mm_gpu_stream_hold not linked");
    mm_gpu_set_drain_timeout_ms(300);
    void *s = NULL;
    MM_PASS(mm_gpu_stream_new(&s));
    MM_PASS(mm_gpu_stream_hold(s, 1500));
    MM_FAIL(mm_gpu_stream_sync(s), MM_ETIMEDOUT);
    MM_PASS(mm_gpu_stream_hold(s, 0));
    struct timespec ts = {1, 600000000L};
    nanosleep(&ts, NULL);
    MM_PASS(mm_gpu_stream_sync(s));
    mm_gpu_stream_free(s);
    mm_gpu_set_drain_timeout_ms(0);
    gpu_close(&cpu);
}

MM_TESTS = {
    {"matmul bf16 vs cpu", test_matmul_bf16},
    {"matmul f16 f32 vs cpu", test_matmul_f16_f32},
    {"matmul row bits independent of batch", test_matmul_bits_batch_invariant},
    {"matmul paths bits equal gemv", test_matmul_paths_bits},
    {"grouped expert matmul equals per-expert", test_moe_matmul_grouped},
    {"small dense products on gemm_ws, eager and recorded", test_ws_small_graph},
    {"dense products of 1..64 rows with split segments == gemv bits", test_segsplit},
    {"permuted-W cache follows weight writes", test_wperm_cache},
    {"permuted-W cache follows expert and table writes", test_wperm_cache_grouped},
    {"rmsnorm vs cpu", test_rmsnorm},
    {"rope vs cpu", test_rope},
    {"kv_store and attention vs cpu", test_attention},
    {"embed swiglu axpy sigmoid copy_rows vs cpu", test_embed_swiglu_axpy_sigmoid_copy},
    {"route vs cpu", test_route},
    {"argmax (greedy sampling)", test_argmax},
    {"bad arguments", test_bad_args},
    {"drains have a deadline", test_drain_deadline},
    {NULL, NULL},
};
