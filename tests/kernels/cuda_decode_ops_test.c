// SPDX-License-Identifier: MIT
// The decode-step kernels that were widened for batch-1 latency keep their results exactly:
// the multi-block argmax (mm_gpu_argmax_ws, the backend's argmax) picks the same ids as the
// one-block kernel and the host rule (ties to the lower id across blocks, -0 ties +0, NaN
// never chosen, an all-NaN row gives 0, more rows than its workspace, a workspace left clean
// for the next call); rmsnorm with a block per row has the bits of the warp-per-row kernel;
// attention with more loads in flight has the bits of the earlier load grouping; the per-op
// timer (MM_GPU_OPTIME=1) gives a table without graphs and the same results; GEMV v2 (x tile in
// shared memory, whole segments of W in flight, gather/scatter row indices) has the earlier
// GEMV's bits, and so has GEMV v3 (W by bulk copies into shared memory, its grouped x tile in
// passes of a few rows); add_rmsnorm has the bits of axpy then rmsnorm.
// Without the GPU backend (plain `make`) or without a GPU, every case skips and says why.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm/dtype.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x2545f4914f6cdd1dull
#include "gpu_test.h"

extern mm_err mm_gpu_argmax(void *stream, const float *d_logits, int64_t ls, int64_t n_rows,
                            int vocab, int32_t *d_ids) __attribute__((weak));
extern mm_err mm_gpu_argmax_ws(void *stream, const float *d_logits, int64_t ls, int64_t n_rows,
                               int vocab, int32_t *d_ids, void *d_ws, int ws_rows)
    __attribute__((weak));
extern mm_err mm_gpu_rmsnorm(void *stream, const mm_weight *w, float eps, const float *d_x,
                             int64_t xs, float *d_y, int64_t ys, int64_t n_rows)
    __attribute__((weak));
extern mm_err mm_gpu_rmsnorm_warp(void *stream, const mm_weight *w, float eps, const float *d_x,
                                  int64_t xs, float *d_y, int64_t ys, int64_t n_rows)
    __attribute__((weak));
extern mm_err mm_gpu_attention(void *stream, const struct mm_attn_args *a, int *d_err)
    __attribute__((weak));
extern mm_err mm_gpu_attention_ref(void *stream, const struct mm_attn_args *a, int *d_err)
    __attribute__((weak));
extern void mm_gpu_set_attention_prefill(int mode) __attribute__((weak));
// the tensor-core attention contract (attention_tc.cu, the default): 0 pins ops.cu's f32
// kernels, whose load groupings and prefill form these cases compare
extern void mm_gpu_set_attention_tc(int mode) __attribute__((weak));
extern mm_err mm_gpu_stream_sync(void *stream) __attribute__((weak));
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
extern void mm_gpu_set_gemv_version(int v) __attribute__((weak));
extern void mm_gpu_set_gemv_bulk(int mode) __attribute__((weak));
extern unsigned long long mm_gpu_gemv_bulk_launches(void) __attribute__((weak));
extern void mm_gpu_set_segsplit(int on) __attribute__((weak)); // 9..64 rows: gemm_seg
extern void mm_gpu_optime_report(void *backend_ctx) __attribute__((weak));
extern void mm_gpu_set_gemv_xcap(int cap) __attribute__((weak));
extern void mm_gpu_set_gemv_gtpb(int t) __attribute__((weak));
extern mm_err mm_gpu_moe_ffn_rows(void *stream, int dtype, const void *const *d_wgu,
                                  const void *const *d_wd, const int32_t *d_offs, int n_experts,
                                  int d_ff, int d_model, const float *d_x, int64_t x_stride,
                                  const int32_t *d_x_idx, float *d_y, int64_t y_stride,
                                  const int32_t *d_y_idx, int n_rows) __attribute__((weak));
extern void mm_gpu_set_ffn_dec(int on) __attribute__((weak));
extern unsigned long long mm_gpu_ffn_dec_launches(void) __attribute__((weak));

static void open_gpu(void) {
    if (!mm_gpu_argmax_ws || !mm_gpu_stream_sync)
        MM_SKIP("GPU kernels not linked (plain build; `make cuda` builds this test with them)");
    gpu_open(NULL);
}

// The host rule: highest value, ties to the lower id (== ties -0 and +0), NaN skipped, 0 when
// every value is NaN.
static int32_t host_argmax(const float *l, int vocab) {
    int32_t b = -1;
    for (int v = 0; v < vocab; v++)
        if (!isnan(l[v]) && (b < 0 || l[v] > l[b]))
            b = v;
    return b < 0 ? 0 : b;
}

static void argmax_case(int vocab, int ws_rows) {
    const int64_t n = 9, ls = vocab + 5;
    float *l = malloc((size_t)(n * ls) * 4);
    MM_TRUE(l != NULL);
    for (int64_t i = 0; i < n * ls; i++)
        l[i] = frand() * 10.0f;
    const int hi = vocab - 1, mid = vocab / 2;
    l[0 * ls + 0] = 50.0f, l[0 * ls + hi] = 50.0f; // tie between the first and last block
    l[1 * ls + 0] = NAN, l[1 * ls + mid] = 60.0f;
    l[2 * ls + hi] = 70.0f;
    for (int v = 0; v < vocab; v++) { // row 3: all negative but a -0 (low id) and a +0
        l[3 * ls + v] = -1.0f - (float)(v % 7);
        l[4 * ls + v] = NAN;     // row 4: all NaN
        l[5 * ls + v] = -INFINITY; // row 5: NaN first, then -inf only
    }
    l[3 * ls + hi] = 0.0f, l[3 * ls + mid / 2] = -0.0f;
    l[5 * ls + 0] = NAN;
    for (int v = 0; v < vocab; v++) // row 6: many equal maxima; the lowest id wins
        l[6 * ls + v] = (v % 1000 == 999) ? 9.5f : l[6 * ls + v];
    int32_t want[9];
    for (int64_t i = 0; i < n; i++)
        want[i] = host_argmax(l + i * ls, vocab);
    float *dl = dev_copy(l, (size_t)(n * ls) * 4);
    int32_t *d1 = dev_copy(NULL, (size_t)n * 4), *d2 = dev_copy(NULL, (size_t)n * 4);
    void *ws = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)ws_rows * 12, &ws));
    const int32_t zero[64] = {0};
    for (int i = 0; i < ws_rows * 3; i += 16)
        MM_PASS(gpu->ops->set(gpu->ctx, (int32_t *)ws + i,
                              zero, (size_t)(ws_rows * 3 - i < 16 ? ws_rows * 3 - i : 16) * 4));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    MM_PASS(mm_gpu_argmax(NULL, dl, ls, n, vocab, d1));
    for (int rep = 0; rep < 3; rep++) { // the workspace must be clean again after each call
        MM_PASS(mm_gpu_argmax_ws(NULL, dl, ls, n, vocab, d2, ws, ws_rows));
        MM_PASS(mm_gpu_stream_sync(NULL));
        int32_t *g1 = dev_get(d1, (size_t)n * 4), *g2 = dev_get(d2, (size_t)n * 4);
        for (int64_t i = 0; i < n; i++) {
            MM_EQ(g1[i], want[i]);
            MM_EQ(g2[i], want[i]);
        }
        free(g1), free(g2);
    }
    // through the table (the backend's own workspace)
    MM_PASS(gpu->ops->fill(gpu->ctx, (float *)d2, 0.0f, n));
    MM_PASS(gpu->ops->argmax(gpu->ctx, dl, ls, n, vocab, d2));
    int32_t *g2 = dev_get(d2, (size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        MM_EQ(g2[i], want[i]);
    int32_t *gw = dev_get(ws, (size_t)ws_rows * 12);
    for (int i = 0; i < ws_rows * 3; i++)
        MM_EQ(gw[i], 0);
    printf("argmax vocab %d, %lld rows, workspace %d rows: ids equal the host rule and the "
           "one-block kernel\n", vocab, (long long)n, ws_rows);
    free(g2), free(gw), free(l);
    gpu->ops->buffer_free(gpu->ctx, dl);
    gpu->ops->buffer_free(gpu->ctx, d1);
    gpu->ops->buffer_free(gpu->ctx, d2);
    gpu->ops->buffer_free(gpu->ctx, ws);
}

static void test_argmax_blocks(void) {
    open_gpu();
    argmax_case(151936, 64); // Qwen3's vocab: 75 blocks per row
    argmax_case(2048, 64);   // exactly one block
    argmax_case(2049, 4);    // one element into a second block; 9 rows in 3 launches
    argmax_case(7, 1);       // one row per launch
    gpu_close(NULL);
}

static void test_rmsnorm_bits(void) {
    open_gpu();
    if (!mm_gpu_rmsnorm || !mm_gpu_rmsnorm_warp)
        MM_SKIP("rmsnorm kernels not linked");
    const int dims[] = {1, 31, 128, 2048, 2050, 5000, 8192, 8193};
    const int rows[] = {1, 3, 70};
    const enum mm_dtype dts[] = {MM_DTYPE_BF16, MM_DTYPE_F32};
    for (size_t a = 0; a < sizeof(dims) / sizeof(dims[0]); a++)
        for (size_t b = 0; b < sizeof(rows) / sizeof(rows[0]); b++)
            for (size_t c = 0; c < 2; c++) {
                const int d = dims[a], n = rows[b];
                const int64_t st = d + 3;
                float *x = malloc((size_t)(n * st) * 4);
                MM_TRUE(x != NULL);
                for (int64_t i = 0; i < n * st; i++)
                    x[i] = frand() * 3.0f;
                void *hw = malloc((size_t)d * 4);
                for (int k = 0; k < d; k++) {
                    const float v = 1.0f + frand() * 0.5f;
                    if (dts[c] == MM_DTYPE_BF16)
                        ((uint16_t *)hw)[k] = mm_f32_to_bf16(v);
                    else
                        ((float *)hw)[k] = v;
                }
                void *dw = dev_copy(hw, (size_t)d * mm_dtype_size(dts[c]));
                mm_weight w = {.data = dw, .dtype = dts[c], .rows = 1, .cols = d};
                float *dx = dev_copy(x, (size_t)(n * st) * 4);
                float *dy1 = dev_copy(x, (size_t)(n * st) * 4);
                float *dy2 = dev_copy(x, (size_t)(n * st) * 4);
                MM_PASS(gpu->ops->synchronize(gpu->ctx));
                MM_PASS(mm_gpu_rmsnorm_warp(NULL, &w, 1e-6f, dx, st, dy1, st, n));
                MM_PASS(mm_gpu_rmsnorm(NULL, &w, 1e-6f, dx, st, dy2, st, n));
                MM_PASS(mm_gpu_stream_sync(NULL));
                MM_PASS(gpu->ops->rmsnorm(gpu->ctx, &w, 1e-6f, dx, st, dx, st, n)); // in place
                float *y1 = dev_get(dy1, (size_t)(n * st) * 4);
                float *y2 = dev_get(dy2, (size_t)(n * st) * 4);
                float *y3 = dev_get(dx, (size_t)(n * st) * 4);
                MM_TRUE(memcmp(y1, y2, (size_t)(n * st) * 4) == 0);
                MM_TRUE(memcmp(y1, y3, (size_t)(n * st) * 4) == 0);
                free(x), free(hw), free(y1), free(y2), free(y3);
                gpu->ops->buffer_free(gpu->ctx, dw);
                gpu->ops->buffer_free(gpu->ctx, dx);
                gpu->ops->buffer_free(gpu->ctx, dy1);
                gpu->ops->buffer_free(gpu->ctx, dy2);
            }
    printf("rmsnorm: block per row bit-identical to warp per row (8 dims x 3 row counts x "
           "bf16/f32, in place too)\n");
    gpu_close(NULL);
}

// Attention over a paged cache: the widened loads against the earlier grouping, bit for bit.
static void attn_bits_case(int n_heads, int n_kv, int dk, int dv, int window) {
    const int bs = 16, n_seqs = 3, max_blocks = 20, n_blocks = n_seqs * max_blocks;
    const int lens[3] = {1, 77, 300};
    const int64_t slot = (int64_t)n_kv * (dk + dv), bstride = slot * bs;
    const size_t pool_n = (size_t)(n_blocks * bstride);
    int32_t tables[3 * 20];
    for (int i = 0; i < n_seqs * max_blocks; i++)
        tables[i] = (i * 7 + 3) % n_blocks;
    int32_t *rs = NULL, *rp = NULL;
    const int n_rows = seq_rows(lens, n_seqs, &rs, &rp);
    const int64_t kst = (int64_t)n_kv * dk, vst = (int64_t)n_kv * dv;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv;
    float *k = rand_f32(n_rows * kst, 1.0f), *v = rand_f32(n_rows * vst, 1.0f);
    float *q = rand_f32(n_rows * qst, 2.0f);
    struct mm_kv_view kv = {.base = NULL, .block_size = bs, .block_stride = bstride,
                            .slot_stride = slot, .n_kv_heads = n_kv, .head_dim_k = dk,
                            .head_dim_v = dv, .block_tables = NULL, .max_blocks = max_blocks};
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, pool_n * 4, (void **)&kv.base));
    MM_PASS(gpu->ops->fill(gpu->ctx, kv.base, 0.0f, (int64_t)pool_n));
    kv.block_tables = dev_copy(tables, sizeof(tables));
    struct mm_kv_store_args st = {.kv = kv, .k = dev_copy(k, (size_t)(n_rows * kst) * 4),
                                  .k_stride = kst, .v = dev_copy(v, (size_t)(n_rows * vst) * 4),
                                  .v_stride = vst, .n_rows = n_rows,
                                  .row_seq = dev_copy(rs, (size_t)n_rows * 4),
                                  .row_pos = dev_copy(rp, (size_t)n_rows * 4)};
    MM_PASS(gpu->ops->kv_store(gpu->ctx, &st));
    struct mm_attn_args at = {.kv = kv, .q = dev_copy(q, (size_t)(n_rows * qst) * 4),
                              .q_stride = qst, .out_stride = ost, .n_rows = n_rows,
                              .row_seq = st.row_seq, .row_pos = st.row_pos, .n_heads = n_heads,
                              .scale = 1.0f / sqrtf((float)dk), .window = window};
    float *o1 = NULL, *o2 = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)(n_rows * ost) * 4, (void **)&o1));
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, (size_t)(n_rows * ost) * 4, (void **)&o2));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    at.out = o1;
    MM_PASS(mm_gpu_attention_ref(NULL, &at, NULL));
    at.out = o2;
    MM_PASS(mm_gpu_attention(NULL, &at, NULL));
    MM_PASS(mm_gpu_stream_sync(NULL));
    float *g1 = dev_get(o1, (size_t)(n_rows * ost) * 4), *g2 = dev_get(o2, (size_t)(n_rows * ost) * 4);
    MM_TRUE(memcmp(g1, g2, (size_t)(n_rows * ost) * 4) == 0);
    // decode-shaped: one row per sequence (its last position), few blocks: the default kernel
    // against the earlier grouping
    int32_t ds[3], dp[3];
    for (int i = 0; i < n_seqs; i++)
        ds[i] = i, dp[i] = lens[i] - 1;
    at.n_rows = n_seqs;
    at.row_seq = dev_copy(ds, sizeof(ds));
    at.row_pos = dev_copy(dp, sizeof(dp));
    MM_PASS(gpu->ops->fill(gpu->ctx, o1, 1.0f, n_seqs * ost));
    MM_PASS(gpu->ops->fill(gpu->ctx, o2, 2.0f, n_seqs * ost));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    at.out = o1;
    MM_PASS(mm_gpu_attention_ref(NULL, &at, NULL));
    at.out = o2;
    MM_PASS(mm_gpu_attention(NULL, &at, NULL)); // the default kernel
    MM_PASS(mm_gpu_stream_sync(NULL));
    float *d1 = dev_get(o1, (size_t)(n_seqs * ost) * 4), *d2 = dev_get(o2, (size_t)(n_seqs * ost) * 4);
    MM_TRUE(memcmp(d1, d2, (size_t)(n_seqs * ost) * 4) == 0);
    printf("attention %dh/%dkv dk %d dv %d window %d, %d rows, and %d decode rows: bits equal "
           "the earlier load grouping\n", n_heads, n_kv, dk, dv, window, n_rows, n_seqs);
    free(d1), free(d2);
    gpu->ops->buffer_free(gpu->ctx, (void *)at.row_seq);
    gpu->ops->buffer_free(gpu->ctx, (void *)at.row_pos);
    free(g1), free(g2), free(k), free(v), free(q), free(rs), free(rp);
    void *bufs[] = {kv.base, (void *)kv.block_tables, (void *)st.k, (void *)st.v,
                    (void *)st.row_seq, (void *)st.row_pos, (void *)at.q, o1, o2};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, bufs[i]);
}

static void test_attention_bits(void) {
    open_gpu();
    if (!mm_gpu_attention || !mm_gpu_attention_ref)
        MM_SKIP("attention kernels not linked");
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(0);
    attn_bits_case(32, 4, 128, 128, 0); // Qwen3-30B-A3B's heads
    attn_bits_case(8, 2, 64, 64, 0);
    attn_bits_case(4, 4, 96, 64, 0);    // dk != dv, dk not a multiple of 64
    attn_bits_case(6, 3, 128, 128, 40); // sliding window
    attn_bits_case(2, 1, 36, 20, 0);    // odd small dims
    attn_bits_case(2, 1, 36, 22, 0);    // dv not a multiple of 4: 4-byte value copies
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(-1);
    gpu_close(NULL);
}

// ---- prefill attention (K/V chunks shared by many rows) against the decode kernel ---------------
// The prefill kernel (mm_gpu_set_attention_prefill(2): every call) must give every (row, head)
// the decode kernel's bits (mode 0): all rows in one call; the same rows in chunks of other
// sizes (a prompt chunked differently); rows of two sequences interleaved in runs, so a block
// holds rows of both. Counts the differing output elements and reports them.
static void attn_pf_case(int n_heads, int n_kv, int dk, int dv, int window, const int *lens,
                         int n_seqs) {
    const int bs = 16, max_blocks = 48, n_blocks = n_seqs * max_blocks;
    const int64_t slot = (int64_t)n_kv * (dk + dv), bstride = slot * bs;
    const size_t pool_n = (size_t)(n_blocks * bstride);
    int32_t *tables = malloc((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++)
        tables[i] = (int32_t)(((int64_t)i * 7 + 3) % n_blocks);
    int32_t *rs = NULL, *rp = NULL;
    const int n_rows = seq_rows(lens, n_seqs, &rs, &rp);
    const int64_t kst = (int64_t)n_kv * dk, vst = (int64_t)n_kv * dv;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv;
    const int64_t on = (int64_t)n_rows * ost;
    float *k = rand_f32(n_rows * kst, 1.0f), *v = rand_f32(n_rows * vst, 1.0f);
    float *q = rand_f32(n_rows * qst, 3.0f);
    struct mm_kv_view kv = {.base = NULL, .block_size = bs, .block_stride = bstride,
                            .slot_stride = slot, .n_kv_heads = n_kv, .head_dim_k = dk,
                            .head_dim_v = dv, .block_tables = NULL, .max_blocks = max_blocks};
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, pool_n * 4, (void **)&kv.base));
    MM_PASS(gpu->ops->fill(gpu->ctx, kv.base, 0.0f, (int64_t)pool_n));
    kv.block_tables = dev_copy(tables, (size_t)n_blocks * 4);
    int32_t *d_rs = dev_copy(rs, (size_t)n_rows * 4), *d_rp = dev_copy(rp, (size_t)n_rows * 4);
    struct mm_kv_store_args st = {.kv = kv, .k = dev_copy(k, (size_t)(n_rows * kst) * 4),
                                  .k_stride = kst, .v = dev_copy(v, (size_t)(n_rows * vst) * 4),
                                  .v_stride = vst, .n_rows = n_rows, .row_seq = d_rs,
                                  .row_pos = d_rp};
    MM_PASS(gpu->ops->kv_store(gpu->ctx, &st));
    float *d_q = dev_copy(q, (size_t)(n_rows * qst) * 4);
    float *o_ref = dev_copy(NULL, (size_t)on * 4), *o_pf = dev_copy(NULL, (size_t)on * 4);
    MM_PASS(gpu->ops->fill(gpu->ctx, o_ref, 1.0f, on));
    MM_PASS(gpu->ops->fill(gpu->ctx, o_pf, 2.0f, on));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    struct mm_attn_args at = {.kv = kv, .q = d_q, .q_stride = qst, .out = o_ref,
                              .out_stride = ost, .n_rows = n_rows, .row_seq = d_rs,
                              .row_pos = d_rp, .n_heads = n_heads,
                              .scale = 1.0f / sqrtf((float)dk), .window = window};
    mm_gpu_set_attention_prefill(0);
    MM_PASS(mm_gpu_attention(NULL, &at, NULL)); // the decode kernel
    mm_gpu_set_attention_prefill(2);
    at.out = o_pf;
    MM_PASS(mm_gpu_attention(NULL, &at, NULL)); // all rows in one call
    MM_PASS(mm_gpu_stream_sync(NULL));
    float *ref = dev_get(o_ref, (size_t)on * 4), *got = dev_get(o_pf, (size_t)on * 4);
    const int64_t d_one = n_diff(ref, got, on);
    // chunks of 37, 128, 1, then 200 at a time (one chunk may span two sequences)
    MM_PASS(gpu->ops->fill(gpu->ctx, o_pf, 3.0f, on));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    const int sizes[4] = {37, 128, 1, 200};
    for (int r = 0, i = 0; r < n_rows; i++) {
        const int n = sizes[i < 3 ? i : 3] < n_rows - r ? sizes[i < 3 ? i : 3] : n_rows - r;
        struct mm_attn_args c = at;
        c.q = d_q + (int64_t)r * qst, c.out = o_pf + (int64_t)r * ost, c.n_rows = n;
        c.row_seq = d_rs + r, c.row_pos = d_rp + r;
        MM_PASS(mm_gpu_attention(NULL, &c, NULL));
        r += n;
    }
    MM_PASS(mm_gpu_stream_sync(NULL));
    free(got);
    got = dev_get(o_pf, (size_t)on * 4);
    const int64_t d_chunks = n_diff(ref, got, on);
    // rows of the sequences interleaved in runs of 1..11 rows: row i of the call is original
    // row perm[i]; its output goes to the same place as before (out row perm[i])
    int32_t *perm = malloc((size_t)n_rows * 4);
    MM_TRUE(perm != NULL);
    interleave_rows(lens, n_seqs, n_rows, perm);
    float *qp = malloc((size_t)(n_rows * qst) * 4);
    int32_t *rsp = malloc((size_t)n_rows * 4), *rpp = malloc((size_t)n_rows * 4);
    for (int i = 0; i < n_rows; i++) {
        memcpy(qp + (int64_t)i * qst, q + (int64_t)perm[i] * qst, (size_t)qst * 4);
        rsp[i] = rs[perm[i]], rpp[i] = rp[perm[i]];
    }
    float *d_qp = dev_copy(qp, (size_t)(n_rows * qst) * 4);
    int32_t *d_rsp = dev_copy(rsp, (size_t)n_rows * 4), *d_rpp = dev_copy(rpp, (size_t)n_rows * 4);
    MM_PASS(gpu->ops->fill(gpu->ctx, o_pf, 4.0f, on));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    struct mm_attn_args mx = at;
    mx.q = d_qp, mx.row_seq = d_rsp, mx.row_pos = d_rpp;
    MM_PASS(mm_gpu_attention(NULL, &mx, NULL));
    MM_PASS(mm_gpu_stream_sync(NULL));
    free(got);
    got = dev_get(o_pf, (size_t)on * 4);
    int64_t d_mixed = 0;
    for (int i = 0; i < n_rows; i++)
        d_mixed += n_diff(ref + (int64_t)perm[i] * ost, got + (int64_t)i * ost, ost);
    mm_gpu_set_attention_prefill(1);
    printf("attention prefill kernel %dh/%dkv dk %d dv %d window %d, %d rows of %d seqs: "
           "differing elements vs the decode kernel: one call %lld, chunks %lld, seqs "
           "interleaved %lld (of %lld)\n", n_heads, n_kv, dk, dv, window, n_rows, n_seqs,
           (long long)d_one, (long long)d_chunks, (long long)d_mixed, (long long)on);
    MM_EQ(d_one, 0);
    MM_EQ(d_chunks, 0);
    MM_EQ(d_mixed, 0);
    free(ref), free(got), free(k), free(v), free(q), free(rs), free(rp), free(tables);
    free(perm), free(qp), free(rsp), free(rpp);
    void *bufs[] = {kv.base, (void *)kv.block_tables, (void *)st.k, (void *)st.v, d_rs, d_rp,
                    d_q, o_ref, o_pf, d_qp, d_rsp, d_rpp};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, bufs[i]);
}

static void test_attention_prefill_bits(void) {
    open_gpu();
    if (!mm_gpu_attention || !mm_gpu_set_attention_prefill)
        MM_SKIP("attention kernels not linked");
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(0); // the f32 prefill kernel against the f32 decode kernel
    const int two[2] = {300, 77}, one[1] = {517}, three[3] = {1, 129, 250};
    attn_pf_case(32, 4, 128, 128, 0, two, 2); // Qwen3-30B-A3B's heads (GQA 8)
    attn_pf_case(8, 2, 64, 64, 0, one, 1);    // head_dim 64, GQA 4
    attn_pf_case(16, 16, 128, 128, 0, three, 3); // no GQA: 64 rows per block
    attn_pf_case(6, 3, 128, 128, 40, two, 2); // sliding window, GQA 2
    attn_pf_case(12, 4, 64, 128, 100, three, 3); // GQA 3, dk != dv, window over chunks
    attn_pf_case(32, 2, 96, 64, 0, two, 2);   // GQA 16: two head blocks per kv head; dk 96
    attn_pf_case(4, 1, 36, 20, 0, one, 1);    // odd small dims (multiples of 4)
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(-1);
    gpu_close(NULL);
}

// ---- GEMV v2 against the earlier GEMV, bit for bit ------------------------------------------------
static uint16_t *rand_w(size_t n) {
    uint16_t *w = malloc(n * 2);
    MM_TRUE(w != NULL);
    for (size_t i = 0; i < n; i++)
        w[i] = mm_f32_to_bf16(frand() * 0.25f);
    return w;
}

// Whether GEMV v3 (bulk copies) ran for the calls since the last call of bulk_taken.
static bool bulk_taken(void) {
    static unsigned long long last;
    const unsigned long long n = mm_gpu_gemv_bulk_launches ? mm_gpu_gemv_bulk_launches() : 0;
    const bool r = n > last;
    last = n;
    return r;
}

// Dense: y = x W^T (+ bias) through mm_gpu_matmul with GEMV v1, v2 and v3 (bulk modes 2 and 1,
// where linked); x rows xpad floats apart beyond n_in (3: no vector loads of x), y strided,
// every element compared (including the untouched padding between rows). Returns 1 if v3 took
// the product in mode 2, | 2 if it took it in mode 1 (the default).
static int gemv_dense_case(int n_out, int n_in, int n_rows, bool bias, int xpad) {
    const int64_t xs = n_in + xpad, ys = n_out + 5;
    uint16_t *w = rand_w((size_t)n_out * n_in);
    float *x = malloc((size_t)(n_rows * xs) * 4), *b = malloc((size_t)n_out * 4);
    for (int64_t i = 0; i < n_rows * xs; i++)
        x[i] = frand() * 2.0f;
    for (int i = 0; i < n_out; i++)
        b[i] = frand();
    void *dw = dev_copy(w, (size_t)n_out * n_in * 2);
    float *dx = dev_copy(x, (size_t)(n_rows * xs) * 4), *db = dev_copy(b, (size_t)n_out * 4);
    float *y[4];
    for (int v = 0; v < 4; v++) {
        y[v] = dev_copy(NULL, (size_t)(n_rows * ys) * 4);
        MM_PASS(gpu->ops->fill(gpu->ctx, y[v], -7.0f, n_rows * ys));
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    const int nv = mm_gpu_set_gemv_bulk ? 4 : 2;
    int taken = 0;
    for (int v = 0; v < nv; v++) { // v1, v2, then bulk modes 2 (the LM head's size too) and 1
        mm_gpu_set_gemv_version(v == 0 ? 1 : 2);
        if (mm_gpu_set_gemv_bulk)
            mm_gpu_set_gemv_bulk(v == 2 ? 2 : v == 3 ? 1 : 0);
        bulk_taken();
        MM_PASS(mm_gpu_matmul(NULL, MM_DTYPE_BF16, dw, n_out, n_in, bias ? db : NULL, dx, xs,
                              y[v], ys, n_rows, -1));
        const bool ran = bulk_taken();
        MM_TRUE(v >= 2 || !ran); // v3 never runs with its switch off
        if (v >= 2 && ran)
            taken |= v - 1;
    }
    if (mm_gpu_set_gemv_bulk)
        mm_gpu_set_gemv_bulk(-1);
    mm_gpu_set_gemv_version(2);
    MM_PASS(mm_gpu_stream_sync(NULL));
    float *h[4];
    for (int v = 0; v < nv; v++)
        h[v] = dev_get(y[v], (size_t)(n_rows * ys) * 4);
    for (int v = 1; v < nv; v++) {
        size_t diff = 0;
        for (int64_t i = 0; i < n_rows * ys; i++)
            if (memcmp(&h[0][i], &h[v][i], 4) != 0 && diff++ == 0)
                printf("  dense %dx%d rows %d, variant %d: first difference at %lld: %.9g vs %.9g "
                       "(v1)\n", n_out, n_in, n_rows, v, (long long)i, h[v][i], h[0][i]);
        MM_EQ(diff, 0);
    }
    free(w), free(x), free(b);
    for (int v = 0; v < nv; v++)
        free(h[v]);
    void *bufs[] = {dw, dx, db, y[0], y[1], y[2], y[3]};
    for (size_t i = 0; i < 7; i++)
        gpu->ops->buffer_free(gpu->ctx, bufs[i]);
    return taken;
}

// Grouped: E experts, rows sorted by expert (counts cnt[], empty experts among them). v1 over
// pre-gathered rows with the outputs scattered on the host is the reference for v2 with
// x_idx/y_idx (mm_gpu_moe_matmul_rows), and for v2 without indices; the backend's
// moe_matmul_rows against copy_rows + moe_matmul_dev + copy_rows as well. glu: the source
// rows are [gate | up] and the product's input is swiglu(gate, up): the reference runs the
// swiglu op on the gathered rows first. GEMV v3 (where linked) runs both v2 forms too and must
// give v1's bits; x rows are xpad floats apart beyond their width (odd: no vector loads), and
// each expert's W starts wmis bytes past a 16-byte boundary (8: v3 cannot bulk-copy it; needs
// an odd xpad and no SwiGLU input, as v1 and v2 then load W without vectors). Returns 1 if v3 took both products
// in bulk mode 2, | 2 if it took both in mode 1 (the default).
static int gemv_grouped_case(int n_out, int n_in, int n_src, int E, const int *cnt, bool glu,
                              int xpad, int wmis) {
    int offs[257] = {0};
    for (int e = 0; e < E; e++)
        offs[e + 1] = offs[e] + cnt[e];
    const int n = offs[E];
    int64_t yfull = (int64_t)n + 2; // output rows, 2 never written
    if (yfull % 7 == 0)
        yfull++;
    const int64_t xw = glu ? 2 * n_in : n_in, xs = xw + xpad, ys = n_out + 3;
    int32_t *xi = malloc((size_t)n * 4), *yi = malloc((size_t)n * 4);
    for (int p = 0; p < n; p++) {
        xi[p] = (p * 5 + 3) % n_src;            // sorted row p reads source row xi[p] and
        yi[p] = (int32_t)((p * 7 + 1) % yfull); // writes output row yi[p], all distinct
    }
    float *xsrc = malloc((size_t)(n_src * xs) * 4), *xg = malloc((size_t)(n * xs) * 4);
    for (int64_t i = 0; i < n_src * xs; i++)
        xsrc[i] = frand() * 2.0f;
    for (int p = 0; p < n; p++)
        memcpy(xg + p * xs, xsrc + xi[p] * xs, (size_t)xs * 4);
    void *wp[256], *wbase[256];
    uint16_t *wh[256];
    for (int e = 0; e < E; e++) {
        wh[e] = rand_w((size_t)n_out * n_in);
        wbase[e] = cnt[e] > 0 || e % 2 ? dev_copy(NULL, (size_t)n_out * n_in * 2 + 16) : NULL;
        wp[e] = wbase[e] ? (char *)wbase[e] + wmis : NULL;
        if (wp[e])
            MM_PASS(gpu->ops->set(gpu->ctx, wp[e], wh[e], (size_t)n_out * n_in * 2));
    }
    void **dwp = dev_copy(wp, (size_t)E * sizeof(void *));
    int32_t *doffs = dev_copy(offs, (size_t)(E + 1) * 4);
    int32_t *dxi = dev_copy(xi, (size_t)n * 4), *dyi = dev_copy(yi, (size_t)n * 4);
    float *dxsrc = dev_copy(xsrc, (size_t)(n_src * xs) * 4), *dxg = dev_copy(xg, (size_t)(n * xs) * 4);
    float *y1 = dev_copy(NULL, (size_t)(n * ys) * 4), *y2 = dev_copy(NULL, (size_t)(n * ys) * 4);
    float *y3 = dev_copy(NULL, (size_t)(yfull * ys) * 4), *y4 = dev_copy(NULL, (size_t)(yfull * ys) * 4);
    float *y2b[2], *y3b[2]; // bulk modes 2 and 1
    for (int v = 0; v < 2; v++)
        y2b[v] = dev_copy(NULL, (size_t)(n * ys) * 4), y3b[v] = dev_copy(NULL, (size_t)(yfull * ys) * 4);
    float *tmp = dev_copy(NULL, (size_t)(n * ys) * 4), *xin = dev_copy(NULL, (size_t)(n * xs) * 4);
    float *df = dev_copy(NULL, (size_t)(n * n_in) * 4); // the product's input rows
    const float *xin_p = dxg;
    int64_t xin_s = xs;
    if (glu) {
        MM_PASS(gpu->ops->swiglu(gpu->ctx, dxg, xs, dxg + n_in, xs, df, n_in, n, n_in));
        xin_p = df, xin_s = n_in;
    }
    MM_PASS(gpu->ops->fill(gpu->ctx, y1, -3.0f, n * ys));
    MM_PASS(gpu->ops->fill(gpu->ctx, y2, -3.0f, n * ys));
    MM_PASS(gpu->ops->fill(gpu->ctx, y3, -5.0f, yfull * ys));
    MM_PASS(gpu->ops->fill(gpu->ctx, y4, -5.0f, yfull * ys));
    for (int v = 0; v < 2; v++) {
        MM_PASS(gpu->ops->fill(gpu->ctx, y2b[v], -3.0f, n * ys));
        MM_PASS(gpu->ops->fill(gpu->ctx, y3b[v], -5.0f, yfull * ys));
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    if (mm_gpu_set_gemv_bulk)
        mm_gpu_set_gemv_bulk(0); // v2 (y2, y3); v3 below
    bulk_taken();
    mm_gpu_set_gemv_version(1);
    MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs, E, n_out, n_in,
                              xin_p, xin_s, y1, ys, n, -1));
    mm_gpu_set_gemv_version(2);
    MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs, E, n_out, n_in,
                              xin_p, xin_s, y2, ys, n, -1));
    const float *xup = glu ? dxsrc + n_in : NULL;
    const mm_err rr = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs,
                                             E, n_out, n_in, dxsrc, xs, dxi, xup, y3, ys, dyi, n);
    MM_TRUE(!bulk_taken()); // v3 never runs with its switch off
    // GEMV v3: the plain grouped product and the one with row indices (and SwiGLU)
    int taken = 0;
    mm_err rrb = MM_EUNSUPP;
    for (int v = 0; mm_gpu_set_gemv_bulk && v < 2; v++) {
        mm_gpu_set_gemv_bulk(v ? 1 : 2);
        MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs, E, n_out,
                                  n_in, xin_p, xin_s, y2b[v], ys, n, -1));
        const bool t1 = bulk_taken();
        rrb = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, (const void *const *)dwp, doffs, E, n_out,
                                     n_in, dxsrc, xs, dxi, xup, y3b[v], ys, dyi, n);
        if (t1 && bulk_taken())
            taken |= 1 << v;
        MM_EQ(rrb, rr);
        mm_gpu_set_gemv_bulk(-1);
    }
    MM_PASS(mm_gpu_stream_sync(NULL));
    // the backend's op (its stream) against the sequence it stands for
    mm_err rb = gpu->ops->moe_matmul_rows(gpu->ctx, (const void *const *)dwp, MM_DTYPE_BF16, n_out,
                                          n_in, E, doffs, dxsrc, xs, dxi, xup, y4, ys, dyi, n);
    if (rb == MM_EUNSUPP) {
        MM_PASS(gpu->ops->copy_rows(gpu->ctx, dxsrc, xs, dxi, xin, xs, NULL, n, xs));
        if (glu)
            MM_PASS(gpu->ops->swiglu(gpu->ctx, xin, xs, xin + n_in, xs, xin, xs, n, n_in));
        MM_PASS(gpu->ops->moe_matmul_dev(gpu->ctx, (const void *const *)dwp, MM_DTYPE_BF16, n_out,
                                         n_in, E, doffs, xin, xs, tmp, ys, n));
        MM_PASS(gpu->ops->copy_rows(gpu->ctx, tmp, ys, NULL, y4, ys, dyi, n, n_out));
    } else {
        MM_PASS(rb);
    }
    float *h1 = dev_get(y1, (size_t)(n * ys) * 4), *h2 = dev_get(y2, (size_t)(n * ys) * 4);
    float *h3 = dev_get(y3, (size_t)(yfull * ys) * 4), *h4 = dev_get(y4, (size_t)(yfull * ys) * 4);
    float *h2b[2] = {NULL, NULL}, *h3b[2] = {NULL, NULL};
    for (int v = 0; mm_gpu_set_gemv_bulk && v < 2; v++)
        h2b[v] = dev_get(y2b[v], (size_t)(n * ys) * 4), h3b[v] = dev_get(y3b[v], (size_t)(yfull * ys) * 4);
    MM_TRUE(memcmp(h1, h2, (size_t)(n * ys) * 4) == 0);
    size_t diff_b = 0; // bulk modes 2 and 1 (if linked) against v1
    for (int v = 0; mm_gpu_set_gemv_bulk && v < 2; v++)
        for (int64_t i = 0; i < n * ys; i++)
            if (memcmp(&h1[i], &h2b[v][i], 4) != 0 && diff_b++ == 0)
                printf("  grouped %dx%d, bulk mode %d: first difference at %lld: %.9g vs %.9g (v1)\n",
                       n_out, n_in, v ? 1 : 2, (long long)i, h2b[v][i], h1[i]);
    MM_EQ(diff_b, 0);
    float *want = malloc((size_t)(yfull * ys) * 4);
    for (int64_t i = 0; i < yfull * ys; i++)
        want[i] = -5.0f;
    for (int p = 0; p < n; p++)
        for (int j = 0; j < n_out; j++)
            want[yi[p] * ys + j] = h1[p * ys + j];
    size_t diff = 0;
    if (rr == MM_OK) {
        for (int64_t i = 0; i < yfull * ys; i++)
            if (memcmp(&want[i], &h3[i], 4) != 0 && diff++ == 0)
                printf("  grouped rows %dx%d: first difference at %lld: %.9g vs %.9g\n", n_out,
                       n_in, (long long)i, h3[i], want[i]);
    } else {
        MM_EQ(rr, MM_EUNSUPP);
    }
    MM_EQ(diff, 0);
    for (int v = 0; rrb == MM_OK && v < 2; v++)
        for (int64_t i = 0; i < yfull * ys; i++)
            if (memcmp(&want[i], &h3b[v][i], 4) != 0 && diff_b++ == 0)
                printf("  grouped rows %dx%d, bulk mode %d: first difference at %lld: %.9g vs %.9g\n",
                       n_out, n_in, v ? 1 : 2, (long long)i, h3b[v][i], want[i]);
    MM_EQ(diff_b, 0);
    MM_TRUE(memcmp(want, h4, (size_t)(yfull * ys) * 4) == 0);
    printf("grouped %dx%d%s, %d rows over %d experts: v2 == v1 bits; with row indices %s; "
           "backend op %s; v3 %s, bulk mode 1 %s\n", n_out, n_in,
           glu ? " (input swiglu(gate, up))" : "", n, E,
           rr == MM_OK ? "bit-identical" : "not taken (MM_EUNSUPP)",
           rb == MM_OK ? "fused, bit-identical" : "fell back to the copies",
           !mm_gpu_set_gemv_bulk ? "not linked" : taken & 1 ? "taken, bit-identical" : "not taken",
           taken & 2 ? "taken, bit-identical" : "not taken");
    for (int e = 0; e < E; e++) {
        free(wh[e]);
        gpu->ops->buffer_free(gpu->ctx, wbase[e]);
    }
    free(xi), free(yi), free(xsrc), free(xg), free(h1), free(h2), free(h3), free(h4);
    free(h2b[0]), free(h3b[0]), free(h2b[1]), free(h3b[1]), free(want);
    void *bufs[] = {dwp, doffs, dxi, dyi, dxsrc, dxg, y1, y2, y3, y4, y2b[0], y3b[0], y2b[1],
                    y3b[1], tmp, xin, df};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, bufs[i]);
    return taken;
}

static void test_gemv_v2_bits(void) {
    open_gpu();
    if (!mm_gpu_matmul || !mm_gpu_moe_matmul_rows || !mm_gpu_set_gemv_version ||
        !gpu->ops->moe_matmul_rows)
        MM_SKIP("GEMV v2 not linked");
    // Qwen3-30B-A3B decode shapes, then odd ones: n_in not a multiple of 8 (no vector loads),
    // below one segment, segments of 12 chunks (two rounds), bias, 1..8 rows
    const int dense[][4] = {{5120, 2048, 1, 0}, {4096, 2048, 3, 0}, {2048, 4096, 1, 0},
                            {2048, 4096, 8, 0}, {128, 2048, 1, 0},  {151936 / 16, 2048, 2, 0},
                            {77, 1000, 5, 1},   {130, 6000, 2, 1},  {33, 200, 7, 0},
                            {1000, 2050, 1, 1}, {16, 8, 1, 0},      {2048, 768, 6, 1},
                            // batch 64 (v2 in 8-row tiles; v1 takes the wgmma path there)
                            {5120, 2048, 64, 0}, {2048, 4096, 64, 0}, {128, 2048, 64, 0},
                            {2048, 4096, 17, 1}, {77, 1000, 33, 1},   {300, 2048, 40, 0}};
    for (size_t i = 0; i < sizeof(dense) / sizeof(dense[0]); i++)
        gemv_dense_case(dense[i][0], dense[i][1], dense[i][2], dense[i][3] != 0, 3);
    printf("dense GEMV v2 (and v3) == v1 bits: %zu shapes (strided x and y, bias, 1..64 rows)\n",
           sizeof(dense) / sizeof(dense[0]));
    const int c8[16] = {1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1}; // decode: 8 of 16
    const int c13[16] = {3, 0, 1, 0, 0, 0, 2, 1, 0, 0, 4, 0, 0, 1, 0, 1}; // a 3- and a 4-row expert
    const int c40[64] = {[0] = 9, [5] = 1, [17] = 12, [40] = 2, [63] = 16}; // tiles of 8 + rest
    gemv_grouped_case(1536, 2048, 1, 16, c8, false, 1, 0); // [gate; up] at batch 1
    gemv_grouped_case(2048, 768, 8, 16, c8, false, 1, 0);  // down at batch 1 (8 slot rows)
    gemv_grouped_case(2048, 768, 8, 16, c8, true, 1, 0);   // down reading swiglu([gate; up])
    gemv_grouped_case(1536, 2048, 4, 16, c13, false, 1, 0);
    gemv_grouped_case(100, 300, 13, 16, c13, false, 1, 0); // odd shapes, W rows of 300: no vectors
    gemv_grouped_case(100, 300, 13, 16, c13, true, 1, 0);  // swiglu with unaligned up rows
    gemv_grouped_case(96, 1000, 5, 64, c40, false, 1, 0);  // 64 experts: two offset-lookup rounds
    gemv_grouped_case(96, 1000, 5, 64, c40, true, 1, 0);
    gpu_close(NULL);
}

// GEMV v3 (W by bulk copies into shared memory) == v1 and v2, bit for bit, on odd shapes: 1..8
// rows (and 33/40: 8-row tiles), n_out not a multiple of the 16-row tile, n_in a multiple of 8
// but not of the 32-chunk (the zeroed W tail), one segment (8 tiles per block) up to 16
// segments, bias, x rows with and without vector loads; grouped with empty experts and NULL
// matrices, gather/scatter indices, SwiGLU input, 64 experts, and experts whose W is not
// 16-byte aligned (copied by the block's threads). Each shape must be taken by v3 (counted
// launches), except n_in % 8 != 0 and rows too long for shared memory, which must stay on v2.
static void test_gemv_bulk_bits(void) {
    open_gpu();
    if (!mm_gpu_matmul || !mm_gpu_moe_matmul_rows || !mm_gpu_set_gemv_version ||
        !mm_gpu_set_gemv_bulk || !mm_gpu_gemv_bulk_launches)
        MM_SKIP("GEMV v3 not linked");
    setvbuf(stdout, NULL, _IOLBF, 0); // each shape's line before a failure in the next one
    if (mm_gpu_set_segsplit)
        mm_gpu_set_segsplit(0); // the dense shapes of 9..64 rows would take gemm_seg
    // n_out, n_in, rows, bias, x pad, taken by v3
    const int dense[][6] = {{37, 264, 1, 1, 0, 1},     {100, 776, 2, 0, 4, 1},
                            {5, 8, 3, 1, 0, 1},        {1000, 1016, 4, 0, 0, 1},
                            {333, 2056, 5, 1, 3, 1},   {2056, 768, 6, 0, 0, 1},
                            {130, 4104, 7, 1, 0, 1},   {16, 8, 8, 0, 4, 1},
                            {5120, 2048, 1, 0, 0, 1},  {2048, 4096, 1, 1, 0, 1},
                            {2048, 4096, 8, 0, 0, 1},  {300, 2048, 40, 1, 0, 1},
                            {77, 1000, 33, 0, 4, 1},   {77, 1001, 3, 1, 0, 0},
                            {17, 12000, 1, 0, 0, 0}};
    for (size_t i = 0; i < sizeof(dense) / sizeof(dense[0]); i++) {
        // v3 in mode 2 as the table says; in mode 1 the same up to 8 rows
        const int want = dense[i][5] | (dense[i][5] && dense[i][2] <= 8 ? 2 : 0);
        const int taken = gemv_dense_case(dense[i][0], dense[i][1], dense[i][2], dense[i][3] != 0,
                                          dense[i][4]);
        if (taken != want)
            printf("  dense %dx%d rows %d: taken %d, expected %d (1: mode 2, 2: mode 1)\n",
                   dense[i][0], dense[i][1], dense[i][2], taken, want);
        MM_EQ(taken, want);
    }
    printf("dense GEMV v3 == v2 == v1 bits: %zu shapes\n", sizeof(dense) / sizeof(dense[0]));
    const int c8[16] = {1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1};
    const int c13[16] = {3, 0, 1, 0, 0, 0, 2, 1, 0, 0, 4, 0, 0, 1, 0, 1};
    const int c40[64] = {[0] = 9, [5] = 1, [17] = 12, [40] = 2, [63] = 16};
    const int c3[4] = {2, 0, 1, 0};
    // grouped: v3 in both modes
    MM_EQ(gemv_grouped_case(1536, 2048, 1, 16, c8, false, 0, 0), 3);  // [gate; up], vector x
    MM_EQ(gemv_grouped_case(2048, 768, 8, 16, c8, true, 0, 0), 3);    // down on swiglu, vector x
    MM_EQ(gemv_grouped_case(1544, 2048, 1, 16, c8, false, 0, 0), 3);  // n_out % 16 != 0
    MM_EQ(gemv_grouped_case(100, 264, 5, 16, c8, false, 0, 0), 3);    // W tail zeroed
    MM_EQ(gemv_grouped_case(100, 264, 5, 16, c8, true, 3, 0), 3);
    MM_EQ(gemv_grouped_case(2056, 776, 8, 16, c8, false, 1, 8), 3);   // W not 16-byte aligned
    MM_EQ(gemv_grouped_case(40, 8, 3, 4, c3, false, 0, 0), 3);        // 8-wide rows, 3 rows
    MM_EQ(gemv_grouped_case(100, 264, 13, 16, c13, false, 0, 0), 3);
    MM_EQ(gemv_grouped_case(100, 264, 13, 16, c13, true, 3, 0), 3);
    MM_EQ(gemv_grouped_case(40, 8, 4, 16, c13, false, 0, 0), 3);      // one 8-wide row, 8 tiles
    MM_EQ(gemv_grouped_case(96, 1000, 5, 64, c40, false, 1, 8), 3);
    MM_EQ(gemv_grouped_case(96, 1000, 5, 64, c40, true, 0, 0), 3);
    MM_EQ(gemv_grouped_case(100, 300, 13, 16, c13, false, 1, 0), 0);  // n_in % 8: v2
    int c150[160]; // > 128 experts and rows: pointers and indices loaded after the lookup
    for (int e = 0; e < 160; e++)
        c150[e] = e % 16 != 3;
    MM_EQ(gemv_grouped_case(24, 64, 150, 160, c150, false, 0, 0), 3);
    if (mm_gpu_set_segsplit)
        mm_gpu_set_segsplit(-1);
    gpu_close(NULL);
}

// ---- a decode step's MoE FFN through mm_gpu_moe_ffn_rows against the caller's two calls ---------
// Whether mm_gpu_moe_ffn_rows ran a decode FFN since the last call of ffd_taken.
static bool ffd_taken(void) {
    static unsigned long long last;
    const unsigned long long n = mm_gpu_ffn_dec_launches();
    const bool r = n > last;
    last = n;
    return r;
}

// E experts with cnt[e] slot rows each (sorted by expert); slot p reads source row
// (5p + 3) % n_src (rows xpad floats apart beyond d_model: odd, no vector loads) and its output
// goes to row (7p + 1) % yfull; each expert's W starts wmis bytes past a 16-byte boundary (8:
// copied by the blocks' threads). Reference: mm_gpu_set_ffn_dec(0), where mm_gpu_moe_ffn_rows
// must refuse, then the two mm_gpu_moe_matmul_rows calls the model makes. Then its own launches
// ([gate; up] triggering its dependents late, down looking its plan up and issuing its W before
// its wait) on the NULL stream twice, and through the backend's op eagerly and recorded in a
// graph replayed twice: every y element bit for bit, rows never written keep their fill. fused:
// whether it must take the FFN (false: it must refuse and write nothing).
static void ffd_case(int D, int F, int E, const int *cnt, int n_src, int xpad, int wmis, bool fused) {
    int offs[257] = {0};
    for (int e = 0; e < E; e++)
        offs[e + 1] = offs[e] + cnt[e];
    const int n = offs[E];
    const int64_t xs = D + xpad, ys = D + 5;
    int32_t *xi, *yi;
    int64_t yfull;
    plan_rows(n, n_src, &xi, &yi, &yfull);
    float *xsrc = rand_f32((int64_t)n_src * xs, 2.0f);
    void *gu[256], *dn[256], *gub[256], *dnb[256];
    for (int e = 0; e < E; e++) {
        uint16_t *a = rand_w((size_t)2 * F * D), *b = rand_w((size_t)D * F);
        gub[e] = dev_copy(NULL, (size_t)2 * F * D * 2 + 16);
        dnb[e] = dev_copy(NULL, (size_t)D * F * 2 + 16);
        gu[e] = (char *)gub[e] + wmis, dn[e] = (char *)dnb[e] + wmis;
        MM_PASS(gpu->ops->set(gpu->ctx, gu[e], a, (size_t)2 * F * D * 2));
        MM_PASS(gpu->ops->set(gpu->ctx, dn[e], b, (size_t)D * F * 2));
        free(a), free(b);
    }
    void *dgu = dev_copy(gu, (size_t)E * sizeof(void *)), *ddn = dev_copy(dn, (size_t)E * sizeof(void *));
    int32_t *doffs = dev_copy(offs, (size_t)(E + 1) * 4);
    int32_t *dxi = dev_copy(xi, (size_t)n * 4), *dyi = dev_copy(yi, (size_t)n * 4);
    float *dx = dev_copy(xsrc, (size_t)(n_src * xs) * 4);
    float *dg = dev_copy(NULL, (size_t)n * 2 * F * 4);
    enum { NY = 6 }; // reference, NULL stream x2, backend eager, graph x2
    float *y[NY];
    for (int i = 0; i < NY; i++) {
        y[i] = dev_copy(NULL, (size_t)(yfull * ys) * 4);
        MM_PASS(gpu->ops->fill(gpu->ctx, y[i], -5.0f, yfull * ys));
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    const void *const *wgu = (const void *const *)dgu, *const *wdn = (const void *const *)ddn;
    mm_gpu_set_ffn_dec(0);
    ffd_taken();
    MM_EQ(mm_gpu_moe_ffn_rows(NULL, MM_DTYPE_BF16, wgu, wdn, doffs, E, F, D, dx, xs, dxi, y[0], ys,
                              dyi, n), MM_EUNSUPP);
    mm_err r1 = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, wgu, doffs, E, 2 * F, D, dx, xs, dxi,
                                       NULL, dg, 2 * F, NULL, n);
    float *tmp = dev_copy(NULL, (size_t)n * (xs > 2 * F ? xs : 2 * F) * 4);
    float *tmp2 = dev_copy(NULL, (size_t)n * D * 4);
    if (r1 == MM_EUNSUPP) { // more rows than GEMV v2 takes: the ops the model runs then
        MM_PASS(gpu->ops->copy_rows(gpu->ctx, dx, xs, dxi, tmp, D, NULL, n, D));
        MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, wgu, doffs, E, 2 * F, D, tmp, D, dg, 2 * F,
                                  n, -1));
    } else {
        MM_PASS(r1);
    }
    mm_err r2 = mm_gpu_moe_matmul_rows(NULL, MM_DTYPE_BF16, wdn, doffs, E, D, F, dg, 2 * F, NULL,
                                       dg + F, y[0], ys, dyi, n);
    if (r2 == MM_EUNSUPP) {
        MM_PASS(gpu->ops->swiglu(gpu->ctx, dg, 2 * F, dg + F, 2 * F, tmp, F, n, F));
        MM_PASS(mm_gpu_moe_matmul(NULL, MM_DTYPE_BF16, wdn, doffs, E, D, F, tmp, F, tmp2, D, n, -1));
        MM_PASS(gpu->ops->copy_rows(gpu->ctx, tmp2, D, NULL, y[0], ys, dyi, n, D));
    } else {
        MM_PASS(r2);
    }
    MM_PASS(mm_gpu_stream_sync(NULL));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    MM_TRUE(!ffd_taken());
    mm_gpu_set_ffn_dec(1);
    mm_err rf[2];
    bool took[3];
    for (int i = 0; i < 2; i++) {
        rf[i] = mm_gpu_moe_ffn_rows(NULL, MM_DTYPE_BF16, wgu, wdn, doffs, E, F, D, dx, xs, dxi,
                                    y[1 + i], ys, dyi, n);
        took[i] = ffd_taken();
    }
    MM_PASS(mm_gpu_stream_sync(NULL));
    // the backend's op on its own stream: eagerly, then recorded and replayed twice
    const mm_err rb = gpu->ops->moe_ffn_rows(gpu->ctx, wgu, wdn, MM_DTYPE_BF16, F, D, E, doffs,
                                             dx, xs, dxi, y[3], ys, dyi, n);
    took[2] = ffd_taken();
    void *graph = NULL;
    MM_PASS(gpu->ops->capture_begin(gpu->ctx));
    const mm_err rg = gpu->ops->moe_ffn_rows(gpu->ctx, wgu, wdn, MM_DTYPE_BF16, F, D, E, doffs,
                                             dx, xs, dxi, y[4], ys, dyi, n);
    MM_PASS(gpu->ops->capture_end(gpu->ctx, &graph));
    const bool took_g = ffd_taken();
    for (int i = 0; i < 2; i++) {
        if (i == 1) { // the second replay into a freshly filled y: all of it written again
            MM_PASS(gpu->ops->fill(gpu->ctx, y[4], -5.0f, yfull * ys));
            MM_PASS(gpu->ops->synchronize(gpu->ctx));
        }
        if (rg == MM_OK)
            MM_PASS(gpu->ops->graph_launch(gpu->ctx, graph));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        if (i == 0)
            MM_PASS(gpu->ops->copy_rows(gpu->ctx, y[4], ys, NULL, y[5], ys, NULL, yfull, ys));
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    gpu->ops->graph_free(gpu->ctx, graph);
    mm_gpu_set_ffn_dec(-1);
    float *h[NY];
    for (int i = 0; i < NY; i++)
        h[i] = dev_get(y[i], (size_t)(yfull * ys) * 4);
    int64_t written = 0, d[NY] = {0};
    for (int64_t i = 0; i < yfull * ys; i++)
        written += h[0][i] != -5.0f;
    for (int v = 1; v < NY; v++)
        d[v] = n_diff(h[v], h[0], yfull * ys);
    printf("ffn decode D %d F %d, %d slots over %d experts, x pad %d, W %d bytes off: %s; %lld / "
           "%lld / %lld / %lld / %lld of %lld elements differ from the two products' (%lld "
           "written)\n", D, F, n, E, xpad, wmis, rf[0] == MM_OK ? "taken" : "refused",
           (long long)d[1], (long long)d[2], (long long)d[3], (long long)d[4], (long long)d[5],
           (long long)(yfull * ys), (long long)written);
    MM_TRUE(written > 0);
    if (fused) {
        MM_PASS(rf[0]);
        MM_PASS(rf[1]);
        MM_PASS(rb);
        MM_PASS(rg);
        MM_TRUE(took[0] && took[1] && took[2] && took_g);
        for (int v = 1; v < NY; v++)
            MM_EQ(d[v], 0);
    } else {
        MM_EQ(rf[0], MM_EUNSUPP);
        MM_EQ(rf[1], MM_EUNSUPP);
        MM_EQ(rb, MM_EUNSUPP);
        MM_EQ(rg, MM_EUNSUPP);
        MM_TRUE(!took[0] && !took[1] && !took[2] && !took_g);
        for (int v = 1; v < NY; v++) { // nothing written
            int64_t touched = 0;
            for (int64_t i = 0; i < yfull * ys; i++)
                touched += h[v][i] != -5.0f;
            MM_EQ(touched, 0);
        }
    }
    for (int e = 0; e < E; e++)
        dev_free(gub[e]), dev_free(dnb[e]);
    for (int i = 0; i < NY; i++)
        dev_free(y[i]), free(h[i]);
    free(xi), free(yi), free(xsrc);
    void *bufs[] = {dgu, ddn, doffs, dxi, dyi, dx, dg, tmp, tmp2};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        dev_free(bufs[i]);
}

static void test_ffn_decode_bits(void) {
    open_gpu();
    if (!mm_gpu_moe_ffn_rows || !mm_gpu_set_ffn_dec || !mm_gpu_ffn_dec_launches ||
        !mm_gpu_moe_matmul_rows || !gpu->ops->moe_ffn_rows || !gpu->ops->capture_begin)
        MM_SKIP("the decode MoE FFN is not linked");
    setvbuf(stdout, NULL, _IOLBF, 0);
    const int c8[16] = {1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1};   // batch 1, top-8
    const int c13[16] = {3, 0, 1, 0, 0, 0, 2, 1, 0, 0, 4, 0, 0, 1, 0, 1}; // tiles of 1..4 rows
    const int c16[16] = {[0] = 8, [15] = 8};                              // two 8-row tiles
    const int c40[64] = {[0] = 9, [5] = 1, [17] = 12, [40] = 2, [63] = 16}; // 40 rows
    const int c6[4] = {3, 0, 3, 0};                                       // more slots than experts
    ffd_case(2048, 768, 16, c8, 1, 0, 0, true);    // Qwen3-30B-A3B's shape at batch 1
    ffd_case(2048, 768, 16, c13, 4, 0, 0, true);
    ffd_case(264, 136, 16, c13, 5, 3, 0, true);    // odd stride: scalar x loads; W tail zeroed
    ffd_case(264, 136, 16, c13, 5, 1, 8, true);    // W not 16-byte aligned: copied by threads
    ffd_case(520, 200, 16, c16, 2, 0, 0, true);    // a row per pass: 8 passes per tile
    int c160[160] = {0}; // > 128 experts: pointers and indices loaded after the lookup
    for (int e = 3; e < 160; e += 13)
        c160[e] = 1; // 13 slots
    ffd_case(64, 24, 160, c160, 9, 0, 0, true);
    if (mm_gpu_set_gemv_xcap) { // x staged 2 and 8 rows at a time
        mm_gpu_set_gemv_xcap(2);
        ffd_case(2048, 768, 16, c13, 4, 0, 0, true);
        mm_gpu_set_gemv_xcap(8);
        ffd_case(520, 200, 16, c16, 2, 0, 0, true);
        mm_gpu_set_gemv_xcap(-1);
    }
    if (mm_gpu_set_gemv_gtpb) { // 1, 2 and 4 tiles per block where the segments leave warps idle
        mm_gpu_set_gemv_gtpb(1);
        ffd_case(2048, 768, 16, c8, 1, 0, 0, true);
        ffd_case(264, 136, 16, c13, 5, 3, 0, true);
        mm_gpu_set_gemv_gtpb(2);
        ffd_case(2048, 768, 16, c8, 1, 0, 0, true);
        ffd_case(2048, 768, 16, c13, 4, 0, 0, true);
        ffd_case(264, 136, 16, c13, 5, 1, 8, true);
        mm_gpu_set_gemv_gtpb(4);
        ffd_case(264, 136, 16, c13, 5, 3, 0, true);
        ffd_case(520, 200, 16, c16, 2, 0, 0, true);
        mm_gpu_set_gemv_gtpb(-1);
    }
    ffd_case(520, 100, 16, c13, 5, 0, 0, false);   // d_ff % 8 != 0: refused
    ffd_case(264, 136, 4, c6, 2, 0, 0, false);     // 6 slots over 4 experts: refused
    ffd_case(520, 200, 64, c40, 7, 0, 0, false);   // 40 slots (> 16): refused
    gpu_close(NULL);
}

// GEMV v3 grouped with its x tile staged 1, 2 or 8 rows at a time (mm_gpu_set_gemv_xcap; the
// default stages one row for products of up to 16 rows): tiles of more rows run in passes over
// the W the block holds; every output bit for bit as v1's, and v3 must take every case
// (counted launches).
static void test_gemv_bulk_xcap(void) {
    open_gpu();
    if (!mm_gpu_moe_matmul_rows || !mm_gpu_set_gemv_version || !mm_gpu_set_gemv_bulk ||
        !mm_gpu_gemv_bulk_launches || !mm_gpu_set_gemv_xcap)
        MM_SKIP("GEMV v3's x passes not linked");
    setvbuf(stdout, NULL, _IOLBF, 0);
    const int c8[16] = {1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1};
    const int c13[16] = {3, 0, 1, 0, 0, 0, 2, 1, 0, 0, 4, 0, 0, 1, 0, 1};
    const int c40[64] = {[0] = 9, [5] = 1, [17] = 12, [40] = 2, [63] = 16};
    const int caps[3] = {1, 2, 8};
    for (int i = 0; i < 3; i++) {
        mm_gpu_set_gemv_xcap(caps[i]);
        printf("x staged %d row(s) at a time:\n", caps[i]);
        MM_EQ(gemv_grouped_case(1536, 2048, 1, 16, c8, false, 0, 0), 3);
        MM_EQ(gemv_grouped_case(2048, 768, 8, 16, c13, true, 0, 0), 3); // 2..4-row tiles
        MM_EQ(gemv_grouped_case(100, 264, 13, 16, c13, false, 3, 0), 3);
        MM_EQ(gemv_grouped_case(2056, 776, 8, 16, c13, false, 1, 8), 3); // W copied by threads
        MM_EQ(gemv_grouped_case(96, 1000, 5, 64, c40, true, 0, 0), 3);   // 8-row tiles
    }
    mm_gpu_set_gemv_xcap(-1);
    if (mm_gpu_set_gemv_gtpb) { // several tiles per block where segments leave warps idle
        for (int t = 1; t <= 4; t *= 2) {
            mm_gpu_set_gemv_gtpb(t);
            printf("%d tiles per block:\n", t);
            MM_EQ(gemv_grouped_case(2048, 768, 8, 16, c13, true, 0, 0), 3);
            MM_EQ(gemv_grouped_case(100, 264, 13, 16, c13, false, 3, 0), 3);
            MM_EQ(gemv_grouped_case(2056, 776, 8, 16, c13, false, 1, 8), 3);
            MM_EQ(gemv_grouped_case(96, 1000, 5, 64, c40, true, 0, 0), 3);
        }
        mm_gpu_set_gemv_gtpb(-1);
    }
    gpu_close(NULL);
}

// add_rmsnorm: h += a then rmsnorm(h), against axpy then rmsnorm (both h and y bit for bit).
static void test_add_rmsnorm_bits(void) {
    open_gpu();
    if (!gpu->ops->add_rmsnorm)
        MM_SKIP("add_rmsnorm not in the table");
    const int dims[] = {1, 31, 2048, 2050, 8192, 8193};
    const int rows[] = {1, 3, 70};
    const enum mm_dtype dts[] = {MM_DTYPE_BF16, MM_DTYPE_F32};
    for (size_t a = 0; a < sizeof(dims) / sizeof(dims[0]); a++)
        for (size_t b = 0; b < sizeof(rows) / sizeof(rows[0]); b++)
            for (size_t c = 0; c < 2; c++) {
                const int d = dims[a], n = rows[b];
                const int64_t hs = d + 3, as = d + 1, ys = d + 5;
                float *h = malloc((size_t)(n * hs) * 4), *ad = malloc((size_t)(n * as) * 4);
                for (int64_t i = 0; i < n * hs; i++)
                    h[i] = frand() * 3.0f;
                for (int64_t i = 0; i < n * as; i++)
                    ad[i] = frand();
                h[0] = -0.0f, ad[0] = 0.0f; // the sign of a zero sum follows the add
                void *hw = malloc((size_t)d * 4);
                for (int k = 0; k < d; k++) {
                    const float v = 1.0f + frand() * 0.5f;
                    if (dts[c] == MM_DTYPE_BF16)
                        ((uint16_t *)hw)[k] = mm_f32_to_bf16(v);
                    else
                        ((float *)hw)[k] = v;
                }
                void *dw = dev_copy(hw, (size_t)d * mm_dtype_size(dts[c]));
                mm_weight w = {.data = dw, .dtype = dts[c], .rows = 1, .cols = d};
                float *dh1 = dev_copy(h, (size_t)(n * hs) * 4), *dh2 = dev_copy(h, (size_t)(n * hs) * 4);
                float *da = dev_copy(ad, (size_t)(n * as) * 4);
                float *dy1 = dev_copy(NULL, (size_t)(n * ys) * 4), *dy2 = dev_copy(NULL, (size_t)(n * ys) * 4);
                MM_PASS(gpu->ops->fill(gpu->ctx, dy1, 9.0f, n * ys));
                MM_PASS(gpu->ops->fill(gpu->ctx, dy2, 9.0f, n * ys));
                MM_PASS(gpu->ops->axpy(gpu->ctx, NULL, da, as, dh1, hs, n, d));
                MM_PASS(gpu->ops->rmsnorm(gpu->ctx, &w, 1e-6f, dh1, hs, dy1, ys, n));
                MM_PASS(gpu->ops->add_rmsnorm(gpu->ctx, da, as, dh2, hs, &w, 1e-6f, dy2, ys, n));
                float *h1 = dev_get(dh1, (size_t)(n * hs) * 4), *h2 = dev_get(dh2, (size_t)(n * hs) * 4);
                float *y1 = dev_get(dy1, (size_t)(n * ys) * 4), *y2 = dev_get(dy2, (size_t)(n * ys) * 4);
                MM_TRUE(memcmp(h1, h2, (size_t)(n * hs) * 4) == 0);
                MM_TRUE(memcmp(y1, y2, (size_t)(n * ys) * 4) == 0);
                free(h), free(ad), free(hw), free(h1), free(h2), free(y1), free(y2);
                void *bufs[] = {dw, dh1, dh2, da, dy1, dy2};
                for (size_t i = 0; i < 6; i++)
                    gpu->ops->buffer_free(gpu->ctx, bufs[i]);
            }
    printf("add_rmsnorm bit-identical to axpy then rmsnorm (6 dims x 3 row counts x bf16/f32; "
           "h and y)\n");
    gpu_close(NULL);
}

// matmul_res (the residual in the GEMV's epilogue: a mesh shard's o_proj) against matmul then
// axpy onto a copy of the residual, bit for bit, out of place (res untouched, y's padding
// untouched) and in place (y == res); refused, with nothing written, where the product does not
// run on GEMV v2/v3 (more than 64 rows).
static void test_matmul_res_bits(void) {
    open_gpu();
    if (!gpu->ops->matmul_res)
        MM_SKIP("matmul_res not in the table");
    const int shapes[][2] = {{2048, 4096}, {2048, 4096}, {136, 264}, {64, 24}};
    const int rows[] = {1, 3, 8, 40};
    int taken = 0;
    for (size_t a = 0; a < 4; a++)
        for (size_t b = 0; b < 4; b++) {
            const int no = shapes[a][0], ni = shapes[a][1], n = rows[b];
            const int64_t xs = ni + (a == 1 ? 3 : 0), rs = no + 1, ys = no + 5;
            uint16_t *hw = rand_w((size_t)no * ni);
            float *x = malloc((size_t)(n * xs) * 4), *r = malloc((size_t)(n * rs) * 4);
            for (int64_t i = 0; i < n * xs; i++)
                x[i] = frand();
            for (int64_t i = 0; i < n * rs; i++)
                r[i] = frand() * 4.0f;
            r[0] = -0.0f;
            void *dw = dev_copy(hw, (size_t)no * ni * 2);
            mm_weight w = {.data = dw, .dtype = MM_DTYPE_BF16, .rows = no, .cols = ni};
            float *dx = dev_copy(x, (size_t)(n * xs) * 4), *dr = dev_copy(r, (size_t)(n * rs) * 4);
            float *dr2 = dev_copy(r, (size_t)(n * rs) * 4), *dr3 = dev_copy(r, (size_t)(n * rs) * 4);
            float *dt = dev_copy(NULL, (size_t)(n * no) * 4);
            float *dy = dev_copy(NULL, (size_t)(n * ys) * 4);
            MM_PASS(gpu->ops->fill(gpu->ctx, dy, 7.0f, n * ys));
            // reference: the product, then axpy onto the residual (in dr2)
            MM_PASS(gpu->ops->matmul(gpu->ctx, &w, NULL, dx, xs, dt, no, n));
            MM_PASS(gpu->ops->axpy(gpu->ctx, NULL, dt, no, dr2, rs, n, no));
            const mm_err rv = gpu->ops->matmul_res(gpu->ctx, &w, dx, xs, dr, rs, dy, ys, n);
            float *ref = dev_get(dr2, (size_t)(n * rs) * 4), *y = dev_get(dy, (size_t)(n * ys) * 4);
            float *r1 = dev_get(dr, (size_t)(n * rs) * 4);
            MM_TRUE(memcmp(r1, r, (size_t)(n * rs) * 4) == 0); // res untouched
            if (rv == MM_EUNSUPP) {
                MM_TRUE(!(no == 2048 && n <= 8)); // (o_proj's shape at decode is taken)
                for (int64_t i = 0; i < n * ys; i++)
                    MM_TRUE(y[i] == 7.0f); // nothing written
            } else {
                MM_PASS(rv);
                taken++;
                for (int i = 0; i < n; i++) {
                    MM_TRUE(memcmp(y + i * ys, ref + i * rs, (size_t)no * 4) == 0);
                    for (int j = no; j < ys && i + 1 < n; j++)
                        MM_TRUE(y[i * ys + j] == 7.0f);
                }
                // in place: y == res
                MM_PASS(gpu->ops->matmul_res(gpu->ctx, &w, dx, xs, dr3, rs, dr3, rs, n));
                float *r3 = dev_get(dr3, (size_t)(n * rs) * 4);
                MM_TRUE(memcmp(r3, ref, (size_t)(n * rs) * 4) == 0);
                free(r3);
            }
            free(hw), free(x), free(r), free(ref), free(y), free(r1);
            void *bufs[] = {dw, dx, dr, dr2, dr3, dt, dy};
            for (size_t i = 0; i < 7; i++)
                gpu->ops->buffer_free(gpu->ctx, bufs[i]);
        }
    MM_TRUE(taken >= 6); // (at least o_proj's shape at 1, 3 and 8 rows, both strides)
    printf("matmul_res == matmul then axpy, bit for bit, in and out of place (%d cases taken)\n",
           taken);
    gpu_close(NULL);
}

// MM_GPU_OPTIME=1: the backend offers no graphs and its ops give the same results.
static void optime_case(const char *mode, bool split) {
    setenv("MM_GPU_OPTIME", mode, 1);
    if (split)
        setenv("MM_GPU_OPTIME_SPLIT", "1", 1);
    open_gpu();
    unsetenv("MM_GPU_OPTIME");
    unsetenv("MM_GPU_OPTIME_SPLIT");
    MM_TRUE(gpu->ops->capture_begin == NULL && gpu->ops->graph_launch == NULL);
    const int vocab = 5000;
    float *l = malloc((size_t)vocab * 4);
    for (int v = 0; v < vocab; v++)
        l[v] = frand();
    l[4321] = 3.0f;
    float *dl = dev_copy(l, (size_t)vocab * 4);
    int32_t *d = dev_copy(NULL, 4);
    for (int i = 0; i < 3; i++)
        MM_PASS(gpu->ops->argmax(gpu->ctx, dl, vocab, 1, vocab, d));
    int32_t *g = dev_get(d, 4);
    MM_EQ(g[0], 4321);
    mm_gpu_optime_report(gpu->ctx); // a table on stderr: argmax 3 calls, set, get
    free(g), free(l);
    gpu->ops->buffer_free(gpu->ctx, dl);
    gpu->ops->buffer_free(gpu->ctx, d);
    gpu_close(NULL);
}

// =1, =2 (steps held on the GPU; no step here, so nothing is held) and rows per call
// (MM_GPU_OPTIME_SPLIT=1: "argmax #1", "#2", "#3" on stderr)
static void test_optime(void) {
    if (!mm_gpu_argmax_ws || !mm_gpu_optime_report)
        MM_SKIP("GPU kernels not linked (plain build)");
    optime_case("1", false);
    optime_case("2", false);
    optime_case("2", true);
}

MM_TESTS = {
    {"argmax over many blocks equals the host rule", test_argmax_blocks},
    {"rmsnorm block per row: warp kernel's bits", test_rmsnorm_bits},
    {"attention wider loads: same bits", test_attention_bits},
    {"attention prefill kernel: decode kernel bits", test_attention_prefill_bits},
    {"per-op timer: no graphs, same results", test_optime},
    {"gemv v2 (x in shared memory, row indices) == gemv v1 bits", test_gemv_v2_bits},
    {"gemv v3 (W by bulk copies into shared memory) == v2 == v1 bits", test_gemv_bulk_bits},
    {"add_rmsnorm == axpy then rmsnorm bits", test_add_rmsnorm_bits},
    {"gemv v3 grouped, x in passes of 1, 2 or 8 rows == v1 bits", test_gemv_bulk_xcap},
    {"moe_ffn_rows at decode (down's W before its wait) == the two products' bits", test_ffn_decode_bits},
    {"matmul_res (residual in the GEMV epilogue) == matmul then axpy", test_matmul_res_bits},
    {NULL, NULL},
};
