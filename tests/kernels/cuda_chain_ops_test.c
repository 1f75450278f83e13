// SPDX-License-Identifier: MIT
// The GPU backend's per-layer chain fusions against the ops each stands for, bit for bit,
// through the backend table: route_with_plan == route then route_plan (softmax and sigmoid
// with bias, renorm and scale, group-limited choice, frequent ties, a NaN row, 1..200 rows,
// calls in a row so the arrival count is reset), head_norm_rope_kv == head_norm_rope then
// kv_store (the fused q/k/v layout of Qwen3; NeoX and interleaved, partial rotation, with and
// without norms; x and the whole cache compared) and its fallback for other layouts,
// combine_rmsnorm == combine then rmsnorm (with and without the shared row, bf16 and f32
// norm weights; h and y compared), embed_rmsnorm == embed then rmsnorm, and the prefill
// forms of add_rmsnorm, combine_rmsnorm, head_norm_rope_kv and embed_rmsnorm (ops.cu,
// MM_GPU_ROWOPS_PF) against the decode forms at 4096 rows, odd row counts and dims, and decode
// shapes, and route_with_plan's warp-per-row routing against route then route_plan.
// Without the GPU backend (plain `make`) or without a GPU, every case skips and says why.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm/dtype.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x9e3779b97f4a7c15ull
#include "gpu_test.h"

extern mm_err mm_gpu_attention(void *stream, const struct mm_attn_args *a, int *d_err)
    __attribute__((weak));
extern mm_err mm_gpu_attention_ref(void *stream, const struct mm_attn_args *a, int *d_err)
    __attribute__((weak));
extern void mm_gpu_set_attention_wide(int on) __attribute__((weak));
// the tensor-core attention contract (attention_tc.cu, the CUDA default): 0 pins ops.cu's f32
// kernels, whose load groupings the wide-load case compares
extern void mm_gpu_set_attention_tc(int mode) __attribute__((weak));
extern mm_err mm_gpu_stream_sync(void *stream) __attribute__((weak));
// ops.cu's prefill row-op forms: 0 never, 1 from 128 rows (default), 2 wherever they apply
extern void mm_gpu_set_rowops_pf(int mode) __attribute__((weak));
extern unsigned long long mm_gpu_rowops_pf_launches(void) __attribute__((weak));

// PF_TAKEN(want, call): the call's prefill-form runs launched a prefill form (want) or did not
// (!want), by the backend's own count of those launches (ops.cu), so a shape that silently
// falls back to the decode form (and would compare that form with itself) is caught.
#define PF_TAKEN(want, call)                                                                      \
    do {                                                                                          \
        const unsigned long long b_ = mm_gpu_rowops_pf_launches();                                \
        call;                                                                                     \
        if ((mm_gpu_rowops_pf_launches() > b_) != (want))                                         \
            MM_TEST_FAIL_("%s: the prefill form was %s", #call, (want) ? "not taken" : "taken"); \
    } while (0)
// route_plan.cu: the parallel plan from min_slots slots (< 0: back to the default)
extern void mm_gpu_set_route_plan_par(int min_slots) __attribute__((weak));

static void open_gpu(void) {
    gpu_open(NULL);
    if (!gpu->ops->route_with_plan || !gpu->ops->head_norm_rope_kv || !gpu->ops->combine_rmsnorm ||
        !gpu->ops->embed_rmsnorm) {
        gpu_close(NULL);
        MM_SKIP("the GPU table has no chain fusions (MM_GPU_OLD_CHAIN, MM_GPU_OLD_FUSIONS or "
                "MM_GPU_OLD_DECODE set?)");
    }
}

// d's n_bytes equal e's (both device memory); names the first differing 4-byte word.
static void same_dev(const char *what, const void *d, const void *e, size_t n_bytes) {
    uint32_t *a = dev_get(d, n_bytes), *b = dev_get(e, n_bytes);
    for (size_t i = 0; i < n_bytes / 4; i++)
        if (a[i] != b[i])
            MM_TEST_FAIL_("%s: word %zu differs: 0x%08x (fused) vs 0x%08x (separate ops)", what,
                          i, a[i], b[i]);
    free(a), free(b);
}

static void fill_dev(void *d, size_t n_bytes, uint8_t v) {
    uint8_t *h = malloc(n_bytes);
    memset(h, v, n_bytes);
    MM_PASS(gpu->ops->set(gpu->ctx, d, h, n_bytes));
    free(h);
}

// ---- route_with_plan ----------------------------------------------------------------------------
// levels > 0: logits quantised to that many values (many ties); nan_row >= 0: that row NaN.
static void route_case(int n, int E, int K, enum mm_route_score score, bool bias, bool renorm,
                       float scale, int n_group, int topk_group, int levels, int nan_row) {
    const size_t nk = (size_t)n * K;
    float *l = rand_logits(n, E, levels, nan_row), *bh = malloc((size_t)E * 4);
    for (int e = 0; e < E; e++)
        bh[e] = frand() * 0.1f;
    struct mm_route_params p = {.n_experts = E, .top_k = K, .score = score,
                                .bias = bias ? dev_copy(bh, (size_t)E * 4) : NULL,
                                .n_group = n_group, .topk_group = topk_group, .renorm = renorm,
                                .renorm_eps = renorm ? 1e-20f : 0.0f, .scale = scale};
    float *dl = dev_copy(l, (size_t)n * E * 4);
    // [0]: route then route_plan; [1]: route_with_plan
    int32_t *ids[2], *offs[2], *src[2], *dst[2];
    float *w[2], *wt[2];
    for (int j = 0; j < 2; j++) {
        ids[j] = dev_copy(NULL, nk * 4), w[j] = dev_copy(NULL, nk * 4);
        offs[j] = dev_copy(NULL, (size_t)(E + 1) * 4), src[j] = dev_copy(NULL, nk * 4);
        dst[j] = dev_copy(NULL, nk * 4), wt[j] = dev_copy(NULL, nk * 4);
        fill_dev(ids[j], nk * 4, (uint8_t)(0x11 * (j + 1)));
        fill_dev(w[j], nk * 4, (uint8_t)(0x11 * (j + 1)));
        fill_dev(wt[j], nk * 4, (uint8_t)(0x11 * (j + 1)));
    }
    MM_PASS(gpu->ops->route(gpu->ctx, &p, dl, E, n, ids[0], w[0]));
    MM_PASS(gpu->ops->route_plan(gpu->ctx, ids[0], w[0], n, K, E, offs[0], src[0], dst[0],
                                 wt[0]));
    for (int rep = 0; rep < 3; rep++) // the arrival count must be back at zero each time
        MM_PASS(gpu->ops->route_with_plan(gpu->ctx, &p, dl, E, n, ids[1], w[1], offs[1], src[1],
                                          dst[1], wt[1]));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("ids", ids[1], ids[0], nk * 4);
    same_dev("weights", w[1], w[0], nk * 4);
    same_dev("offs", offs[1], offs[0], (size_t)(E + 1) * 4);
    same_dev("src_row", src[1], src[0], nk * 4);
    same_dev("dst_slot", dst[1], dst[0], nk * 4);
    same_dev("wt", wt[1], wt[0], nk * 4);
    printf("route_with_plan %d rows, E %d, K %d, %s%s%s, scale %g, groups %d/%d, %s%s: same "
           "bits\n", n, E, K, score == MM_ROUTE_SOFTMAX ? "softmax" : "sigmoid",
           bias ? " + bias" : "", renorm ? ", renorm" : "", (double)scale, n_group, topk_group,
           levels > 0 ? "ties" : "no ties", nan_row >= 0 ? ", a NaN row" : "");
    for (int j = 0; j < 2; j++) {
        void *b[] = {ids[j], w[j], offs[j], src[j], dst[j], wt[j]};
        for (size_t i = 0; i < 6; i++)
            gpu->ops->buffer_free(gpu->ctx, b[i]);
    }
    gpu->ops->buffer_free(gpu->ctx, dl);
    gpu->ops->buffer_free(gpu->ctx, (void *)p.bias);
    free(l), free(bh);
}

static void test_route_with_plan(void) {
    open_gpu();
    route_case(1, 128, 8, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1); // Qwen3 decode
    route_case(64, 128, 8, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1);
    route_case(200, 128, 8, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1);
    route_case(3, 128, 8, MM_ROUTE_SOFTMAX, false, false, 1.0f, 0, 0, 6, -1); // ties
    route_case(5, 60, 4, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 3, 2);    // NaN row
    route_case(7, 8, 2, MM_ROUTE_SOFTMAX, false, false, 1.0f, 0, 0, 0, -1);   // Mixtral
    route_case(4, 30, 3, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 4, -1);   // E % 4 != 0
    route_case(9, 64, 6, MM_ROUTE_SIGMOID, true, true, 2.5f, 8, 3, 0, -1);    // DeepSeek-like
    route_case(2, 256, 8, MM_ROUTE_SIGMOID, true, true, 2.5f, 8, 4, 5, -1);   // ties, groups
    route_case(33, 1000, 300, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1); // K > block
    route_case(1, 1024, 8, MM_ROUTE_SIGMOID, true, false, 1.0f, 0, 0, 0, -1);
    // one row (the one-row finish and plan from shared memory): groups, ties and a scale; a
    // NaN row; K past the block (the general path)
    route_case(1, 256, 8, MM_ROUTE_SIGMOID, true, true, 2.5f, 8, 4, 5, -1);
    route_case(1, 60, 4, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 3, 0);
    route_case(1, 1000, 300, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1);
    gpu_close(NULL);
}

// ---- head_norm_rope_kv --------------------------------------------------------------------------
static void hnr_kv_case(int n, int H, int KV, int hd, int rot_off, int rot_dim,
                        enum mm_rope_style style, bool norms, bool fused_layout) {
    const int bs = 16, n_seqs = 3, max_blocks = 8, n_blocks = n_seqs * max_blocks;
    const int64_t W = (int64_t)(H + 2 * KV) * hd, slot = (int64_t)KV * 2 * hd;
    const size_t pool_n = (size_t)(n_blocks * bs * slot), xn = (size_t)(n * W);
    int32_t tables[3 * 8], rs[64], rp[64];
    for (int i = 0; i < n_seqs * max_blocks; i++)
        tables[i] = (i * 5 + 1) % n_blocks;
    for (int r = 0; r < n; r++)
        rs[r] = r % n_seqs, rp[r] = (r * 37 + 5) % (bs * max_blocks);
    float *x = malloc(xn * 4), *inv = malloc((size_t)rot_dim * 2);
    for (size_t i = 0; i < xn; i++)
        x[i] = frand() * 3.0f;
    for (int i = 0; i < rot_dim / 2; i++)
        inv[i] = powf(1e6f, -2.0f * (float)i / (float)rot_dim);
    uint16_t *wq = malloc((size_t)hd * 2), *wk = malloc((size_t)hd * 2);
    for (int i = 0; i < hd; i++) {
        wq[i] = mm_f32_to_bf16(1.0f + frand() * 0.5f);
        wk[i] = mm_f32_to_bf16(1.0f + frand() * 0.5f);
    }
    mm_weight wa = {.data = dev_copy(wq, (size_t)hd * 2), .dtype = MM_DTYPE_BF16, .rows = 1,
                    .cols = hd};
    mm_weight wb = {.data = dev_copy(wk, (size_t)hd * 2), .dtype = MM_DTYPE_BF16, .rows = 1,
                    .cols = hd};
    struct mm_rope_args ra = {.rot_offset = rot_off, .rot_dim = rot_dim,
                              .pos = dev_copy(rp, (size_t)n * 4),
                              .inv_freq = dev_copy(inv, (size_t)rot_dim / 2 * 4),
                              .mscale = 1.0f, .style = style};
    float *dx[2], *pool[2];
    struct mm_kv_store_args st[2];
    const int32_t *dt = dev_copy(tables, sizeof(tables)), *ds = dev_copy(rs, (size_t)n * 4);
    for (int j = 0; j < 2; j++) {
        dx[j] = dev_copy(x, xn * 4);
        pool[j] = dev_copy(NULL, pool_n * 4);
        fill_dev(pool[j], pool_n * 4, 0x7f);
        st[j] = (struct mm_kv_store_args){
            .kv = {.base = pool[j], .block_size = bs, .block_stride = bs * slot,
                   .slot_stride = slot, .n_kv_heads = KV, .head_dim_k = hd, .head_dim_v = hd,
                   .block_tables = dt, .max_blocks = max_blocks},
            .k = dx[j] + (int64_t)H * hd, .k_stride = W, .v = dx[j] + (int64_t)(H + KV) * hd,
            .v_stride = W, .n_rows = n, .row_seq = ds, .row_pos = ra.pos};
    }
    // another layout (fused_layout false: the keys read from a copy, not from x's group b):
    // the backend must run the two ops then
    float *kcopy = NULL;
    if (!fused_layout) {
        kcopy = dev_copy(NULL, xn * 4);
        st[1].k = kcopy + (int64_t)H * hd;
    }
    const mm_weight *pa = norms ? &wa : NULL, *pb = norms ? &wb : NULL;
    MM_PASS(gpu->ops->head_norm_rope(gpu->ctx, dx[0], n, W, H, KV, (int64_t)H * hd, hd, pa, pb,
                                     1e-6f, &ra));
    MM_PASS(gpu->ops->kv_store(gpu->ctx, &st[0]));
    if (!fused_layout) { // kcopy holds what x will hold after head_norm_rope
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        float *h0 = dev_get(dx[0], xn * 4);
        MM_PASS(gpu->ops->set(gpu->ctx, kcopy, h0, xn * 4));
        free(h0);
    }
    MM_PASS(gpu->ops->head_norm_rope_kv(gpu->ctx, dx[1], n, W, H, KV, (int64_t)H * hd, hd, pa,
                                        pb, 1e-6f, &ra, &st[1]));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("x (q, k, v)", dx[1], dx[0], xn * 4);
    same_dev("cache", pool[1], pool[0], pool_n * 4);
    printf("head_norm_rope_kv %d rows, %d/%d heads of %d, rotation %d+%d %s, %s, %s: same "
           "bits\n", n, H, KV, hd, rot_off, rot_dim, style == MM_ROPE_NEOX ? "neox" : "interleaved",
           norms ? "norms" : "no norms", fused_layout ? "one launch" : "other layout (two)");
    void *b[] = {dx[0], dx[1], pool[0], pool[1], (void *)dt, (void *)ds, (void *)ra.pos,
                 (void *)ra.inv_freq, (void *)wa.data, (void *)wb.data, kcopy};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, b[i]);
    free(x), free(inv), free(wq), free(wk);
}

static void test_head_norm_rope_kv(void) {
    open_gpu();
    hnr_kv_case(1, 32, 4, 128, 0, 128, MM_ROPE_NEOX, true, true); // Qwen3-30B-A3B decode
    hnr_kv_case(5, 32, 4, 128, 0, 128, MM_ROPE_NEOX, true, true);
    hnr_kv_case(64, 16, 2, 64, 0, 64, MM_ROPE_INTERLEAVED, true, true);
    hnr_kv_case(3, 12, 4, 96, 16, 48, MM_ROPE_NEOX, true, true); // partial rotation
    hnr_kv_case(3, 8, 8, 40, 8, 16, MM_ROPE_INTERLEAVED, false, true); // no norms
    hnr_kv_case(2, 8, 2, 64, 0, 64, MM_ROPE_NEOX, true, false);  // the fallback
    gpu_close(NULL);
}

// ---- combine_rmsnorm ----------------------------------------------------------------------------
static void combine_rms_case(int n, int k, int dim, bool shared, enum mm_dtype wdt) {
    const size_t hn = (size_t)n * dim, xn = (size_t)n * k * dim;
    float *x = malloc(xn * 4 + 4), *al = malloc((size_t)n * k * 4 + 4), *h = malloc(hn * 4);
    float *sh = malloc(hn * 4);
    for (size_t i = 0; i < xn; i++)
        x[i] = frand();
    for (int i = 0; i < n * k; i++)
        al[i] = frand() * 0.3f + 0.2f;
    for (size_t i = 0; i < hn; i++)
        h[i] = frand() * 5.0f, sh[i] = frand();
    void *wh = malloc((size_t)dim * 4);
    for (int i = 0; i < dim; i++) {
        const float v = 1.0f + frand() * 0.5f;
        if (wdt == MM_DTYPE_BF16)
            ((uint16_t *)wh)[i] = mm_f32_to_bf16(v);
        else
            ((float *)wh)[i] = v;
    }
    mm_weight w = {.data = dev_copy(wh, (size_t)dim * (wdt == MM_DTYPE_BF16 ? 2 : 4)),
                   .dtype = wdt, .rows = 1, .cols = dim};
    float *dx = dev_copy(x, xn * 4), *da = dev_copy(al, (size_t)n * k * 4);
    float *dsh = shared ? dev_copy(sh, hn * 4) : NULL;
    float *dh[2], *dy[2];
    for (int j = 0; j < 2; j++) {
        dh[j] = dev_copy(h, hn * 4);
        dy[j] = dev_copy(NULL, hn * 4);
        fill_dev(dy[j], hn * 4, (uint8_t)(0x22 * (j + 1)));
    }
    MM_PASS(gpu->ops->combine(gpu->ctx, da, k, dx, dim, dsh, dim, dh[0], dim, n, dim));
    MM_PASS(gpu->ops->rmsnorm(gpu->ctx, &w, 1e-6f, dh[0], dim, dy[0], dim, n));
    MM_PASS(gpu->ops->combine_rmsnorm(gpu->ctx, da, k, dx, dim, dsh, dim, dh[1], dim, n, &w,
                                      1e-6f, dy[1], dim));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("h", dh[1], dh[0], hn * 4);
    same_dev("y", dy[1], dy[0], hn * 4);
    printf("combine_rmsnorm %d rows, k %d, dim %d, %s, %s weights: same bits\n", n, k, dim,
           shared ? "shared row" : "no shared row", wdt == MM_DTYPE_BF16 ? "bf16" : "f32");
    void *b[] = {dh[0], dh[1], dy[0], dy[1], dx, da, dsh, (void *)w.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, b[i]);
    free(x), free(al), free(h), free(sh), free(wh);
}

static void test_combine_rmsnorm(void) {
    open_gpu();
    combine_rms_case(1, 8, 2048, false, MM_DTYPE_BF16); // Qwen3-30B-A3B decode
    combine_rms_case(64, 8, 2048, false, MM_DTYPE_BF16);
    combine_rms_case(3, 4, 1000, true, MM_DTYPE_F32);
    combine_rms_case(5, 0, 300, true, MM_DTYPE_BF16); // a dense layer: the shared row only
    combine_rms_case(2, 2, 9000, false, MM_DTYPE_BF16); // past the block kernel: two launches
    gpu_close(NULL);
}

// ---- embed_rmsnorm ------------------------------------------------------------------------------
// An embedding table of vocab x dim random values in [-0.2, 0.2), f32 or bf16 (owned: free).
static void *host_table(int vocab, int dim, enum mm_dtype tdt) {
    void *th = malloc((size_t)vocab * dim * (tdt == MM_DTYPE_F32 ? 4 : 2));
    for (int64_t i = 0; i < (int64_t)vocab * dim; i++) {
        const float v = frand() * 0.2f;
        if (tdt == MM_DTYPE_F32)
            ((float *)th)[i] = v;
        else
            ((uint16_t *)th)[i] = mm_f32_to_bf16(v);
    }
    return th;
}

static void embed_rms_case(int n, int vocab, int dim, enum mm_dtype tdt, enum mm_dtype wdt) {
    const size_t tb = tdt == MM_DTYPE_F32 ? 4 : 2, wb = wdt == MM_DTYPE_F32 ? 4 : 2;
    void *wh = malloc((size_t)dim * wb), *th = host_table(vocab, dim, tdt);
    for (int i = 0; i < dim; i++) {
        const float v = 1.0f + frand() * 0.5f;
        if (wdt == MM_DTYPE_F32)
            ((float *)wh)[i] = v;
        else
            ((uint16_t *)wh)[i] = mm_f32_to_bf16(v);
    }
    int32_t ids[64];
    for (int i = 0; i < n; i++)
        ids[i] = (i * 7919 + 13) % vocab;
    mm_weight t = {.data = dev_copy(th, (size_t)vocab * dim * tb), .dtype = tdt, .rows = vocab,
                   .cols = dim};
    mm_weight w = {.data = dev_copy(wh, (size_t)dim * wb), .dtype = wdt, .rows = 1, .cols = dim};
    int32_t *di = dev_copy(ids, (size_t)n * 4);
    const size_t on = (size_t)n * dim;
    float *dout[2], *dy[2];
    for (int j = 0; j < 2; j++) {
        dout[j] = dev_copy(NULL, on * 4), dy[j] = dev_copy(NULL, on * 4);
        fill_dev(dout[j], on * 4, (uint8_t)(0x33 * (j + 1)));
        fill_dev(dy[j], on * 4, (uint8_t)(0x33 * (j + 1)));
    }
    MM_PASS(gpu->ops->embed(gpu->ctx, &t, di, n, dout[0], dim));
    MM_PASS(gpu->ops->rmsnorm(gpu->ctx, &w, 1e-6f, dout[0], dim, dy[0], dim, n));
    MM_PASS(gpu->ops->embed_rmsnorm(gpu->ctx, &t, di, n, dout[1], dim, &w, 1e-6f, dy[1], dim));
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("out", dout[1], dout[0], on * 4);
    same_dev("y", dy[1], dy[0], on * 4);
    printf("embed_rmsnorm %d rows, %s table %dx%d, %s norm: same bits\n", n,
           tdt == MM_DTYPE_F32 ? "f32" : "bf16", vocab, dim, wdt == MM_DTYPE_F32 ? "f32" : "bf16");
    void *b[] = {dout[0], dout[1], dy[0], dy[1], di, (void *)t.data, (void *)w.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, b[i]);
    free(th), free(wh);
}

static void test_embed_rmsnorm(void) {
    open_gpu();
    embed_rms_case(1, 1000, 2048, MM_DTYPE_BF16, MM_DTYPE_BF16);
    embed_rms_case(64, 500, 2048, MM_DTYPE_BF16, MM_DTYPE_BF16);
    embed_rms_case(3, 300, 1000, MM_DTYPE_F32, MM_DTYPE_F32);
    embed_rms_case(2, 100, 9000, MM_DTYPE_BF16, MM_DTYPE_BF16); // two launches
    gpu_close(NULL);
}

// ---- decode attention with wide loads ---------------------------------------------------------
// Decode rows (one per sequence, at the end of contexts of 1..300 keys: 1-3 chunks), the wide
// load form against the earlier grouping (mm_gpu_attention_ref), every output bit.
static void attn_wide_case(int n_heads, int n_kv, int dk, int dv, int window) {
    const int bs = 16, n_seqs = 4, max_blocks = 20, n_blocks = n_seqs * max_blocks;
    const int lens[4] = {1, 77, 128, 300};
    const int64_t slot = (int64_t)n_kv * (dk + dv), pool_n = n_blocks * bs * slot;
    int32_t tables[4 * 20], ds[4], dp[4];
    for (int i = 0; i < n_seqs * max_blocks; i++)
        tables[i] = (i * 7 + 3) % n_blocks;
    for (int i = 0; i < n_seqs; i++)
        ds[i] = i, dp[i] = lens[i] - 1;
    float *pool = malloc((size_t)pool_n * 4), *q = malloc((size_t)n_seqs * n_heads * dk * 4);
    for (int64_t i = 0; i < pool_n; i++)
        pool[i] = frand();
    for (int64_t i = 0; i < (int64_t)n_seqs * n_heads * dk; i++)
        q[i] = frand() * 2.0f;
    const int64_t ost = (int64_t)n_heads * dv;
    struct mm_attn_args at = {
        .kv = {.base = dev_copy(pool, (size_t)pool_n * 4), .block_size = bs,
               .block_stride = bs * slot, .slot_stride = slot, .n_kv_heads = n_kv,
               .head_dim_k = dk, .head_dim_v = dv, .block_tables = dev_copy(tables, sizeof(tables)),
               .max_blocks = max_blocks},
        .q = dev_copy(q, (size_t)n_seqs * n_heads * dk * 4), .q_stride = (int64_t)n_heads * dk,
        .out_stride = ost, .n_rows = n_seqs, .row_seq = dev_copy(ds, sizeof(ds)),
        .row_pos = dev_copy(dp, sizeof(dp)), .n_heads = n_heads,
        .scale = 1.0f / sqrtf((float)dk), .window = window};
    float *o1 = dev_copy(NULL, (size_t)(n_seqs * ost) * 4), *o2 = dev_copy(NULL, (size_t)(n_seqs * ost) * 4);
    fill_dev(o1, (size_t)(n_seqs * ost) * 4, 0x11);
    fill_dev(o2, (size_t)(n_seqs * ost) * 4, 0x22);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    at.out = o1;
    MM_PASS(mm_gpu_attention_ref(NULL, &at, NULL));
    mm_gpu_set_attention_wide(1);
    at.out = o2;
    const mm_err rv = mm_gpu_attention(NULL, &at, NULL);
    mm_gpu_set_attention_wide(0);
    MM_PASS(rv);
    MM_PASS(mm_gpu_stream_sync(NULL));
    same_dev("attention out", o2, o1, (size_t)(n_seqs * ost) * 4);
    printf("attention wide loads, %dh/%dkv dk %d dv %d window %d, contexts 1/77/128/300: same "
           "bits as the earlier grouping\n", n_heads, n_kv, dk, dv, window);
    void *b[] = {at.kv.base, (void *)at.kv.block_tables, (void *)at.q, (void *)at.row_seq,
                 (void *)at.row_pos, o1, o2};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, b[i]);
    free(pool), free(q);
}

static void test_attention_wide(void) {
    open_gpu();
    if (!mm_gpu_attention || !mm_gpu_attention_ref || !mm_gpu_set_attention_wide ||
        !mm_gpu_stream_sync)
        MM_SKIP("GPU kernels not linked");
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(0);
    attn_wide_case(32, 4, 128, 128, 0); // Qwen3-30B-A3B
    attn_wide_case(8, 8, 64, 64, 0);
    attn_wide_case(16, 2, 192, 128, 0); // keys past one round
    attn_wide_case(12, 4, 100, 60, 50); // odd dims, sliding window
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(-1);
    gpu_close(NULL);
}

// ---- prefill forms of the row ops (ops.cu, MM_GPU_ROWOPS_PF) --------------------------------------
// Each case runs the op twice on the same inputs, with the forms above (mode 0) and with the
// prefill forms wherever they apply (mode 2), and compares every output word.
static void *host_w(int dim, enum mm_dtype wdt) {
    void *wh = malloc((size_t)dim * 4);
    for (int i = 0; i < dim; i++) {
        const float v = 1.0f + frand() * 0.5f;
        if (wdt == MM_DTYPE_F32)
            ((float *)wh)[i] = v;
        else if (wdt == MM_DTYPE_BF16)
            ((uint16_t *)wh)[i] = mm_f32_to_bf16(v);
        else // f16 in [1, 1.5): exponent 15, a random mantissa below 0x200
            ((uint16_t *)wh)[i] = (uint16_t)(0x3c00 + (int)((v - 0.5f) * 255.0f) % 0x200);
    }
    return wh;
}

static const char *dt_name(enum mm_dtype d) {
    return d == MM_DTYPE_F32 ? "f32" : d == MM_DTYPE_BF16 ? "bf16" : "f16";
}

// add_rmsnorm: rows of a (stride as) into h (stride hs), norm into y (stride ys)
static void pf_add_rms_case(int n, int dim, int pad, enum mm_dtype wdt) {
    const int64_t S = dim + pad;
    const size_t N = (size_t)n * S;
    float *a = rand_f32((int64_t)N, 2.0f), *h = rand_f32((int64_t)N, 5.0f);
    void *wh = host_w(dim, wdt);
    mm_weight w = {.data = dev_copy(wh, (size_t)dim * (wdt == MM_DTYPE_F32 ? 4 : 2)),
                   .dtype = wdt, .rows = 1, .cols = dim};
    float *da = dev_copy(a, N * 4), *dh[2], *dy[2];
    for (int j = 0; j < 2; j++) {
        dh[j] = dev_copy(h, N * 4);
        dy[j] = dev_copy(NULL, N * 4);
        fill_dev(dy[j], N * 4, 0x33);
        mm_gpu_set_rowops_pf(j == 0 ? 0 : 2);
        MM_PASS(gpu->ops->add_rmsnorm(gpu->ctx, da, S, dh[j], S, &w, 1e-6f, dy[j], S, n));
    }
    mm_gpu_set_rowops_pf(1);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("add_rmsnorm h", dh[1], dh[0], N * 4);
    same_dev("add_rmsnorm y", dy[1], dy[0], N * 4);
    printf("add_rmsnorm %d rows, dim %d, stride %lld, %s weights: prefill form same bits\n", n,
           dim, (long long)S, dt_name(wdt));
    void *b[] = {da, dh[0], dh[1], dy[0], dy[1], (void *)w.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
    free(a), free(h), free(wh);
}

static void pf_combine_rms_case(int n, int k, int dim, bool shared, enum mm_dtype wdt) {
    const size_t hn = (size_t)n * dim, xn = (size_t)n * k * dim;
    float *x = rand_f32((int64_t)xn + 4, 1.0f), *al = rand_f32((int64_t)n * k + 4, 0.3f);
    float *h = rand_f32((int64_t)hn, 5.0f), *sh = rand_f32((int64_t)hn, 1.0f);
    void *wh = host_w(dim, wdt);
    mm_weight w = {.data = dev_copy(wh, (size_t)dim * (wdt == MM_DTYPE_F32 ? 4 : 2)),
                   .dtype = wdt, .rows = 1, .cols = dim};
    float *dx = dev_copy(x, xn * 4 + 16), *da = dev_copy(al, (size_t)n * k * 4 + 16);
    float *dsh = shared ? dev_copy(sh, hn * 4) : NULL;
    float *dh[2], *dy[2];
    for (int j = 0; j < 2; j++) {
        dh[j] = dev_copy(h, hn * 4);
        dy[j] = dev_copy(NULL, hn * 4);
        fill_dev(dy[j], hn * 4, 0x44);
        mm_gpu_set_rowops_pf(j == 0 ? 0 : 2);
        MM_PASS(gpu->ops->combine_rmsnorm(gpu->ctx, da, k, dx, dim, dsh, dim, dh[j], dim, n, &w,
                                          1e-6f, dy[j], dim));
    }
    mm_gpu_set_rowops_pf(1);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("combine_rmsnorm h", dh[1], dh[0], hn * 4);
    same_dev("combine_rmsnorm y", dy[1], dy[0], hn * 4);
    printf("combine_rmsnorm %d rows, k %d, dim %d, %s, %s weights: prefill form same bits\n", n,
           k, dim, shared ? "shared row" : "no shared row", dt_name(wdt));
    void *b[] = {dh[0], dh[1], dy[0], dy[1], dx, da, dsh, (void *)w.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        if (b[i])
            dev_free(b[i]);
    free(x), free(al), free(h), free(sh), free(wh);
}

// head_norm_rope_kv on the fused q/k/v layout, every row in its own cache slot (seq r % 2,
// position r / 2), cache f32 or bf16; x and the whole cache compared.
static void pf_hnr_kv_case(int n, int H, int KV, bool norms, enum mm_dtype kdt) {
    const int hd = 128, bs = 16, n_seqs = 2, max_blocks = (n / n_seqs) / bs + 2;
    const int n_blocks = n_seqs * max_blocks;
    const int64_t W = (int64_t)(H + 2 * KV) * hd, slot = (int64_t)KV * 2 * hd;
    const size_t es = kdt == MM_DTYPE_BF16 ? 2 : 4;
    const size_t pool_b = (size_t)n_blocks * bs * slot * es, xn = (size_t)n * W;
    int32_t *tables = malloc((size_t)n_blocks * 4), *rs = malloc((size_t)n * 4);
    int32_t *rp = malloc((size_t)n * 4);
    for (int i = 0; i < n_blocks; i++)
        tables[i] = n_blocks - 1 - i;
    for (int r = 0; r < n; r++)
        rs[r] = r % n_seqs, rp[r] = r / n_seqs;
    float *x = rand_f32((int64_t)xn, 3.0f), *inv = malloc((size_t)hd / 2 * 4);
    for (int i = 0; i < hd / 2; i++)
        inv[i] = powf(1e6f, -2.0f * (float)i / (float)hd);
    void *wq = host_w(hd, MM_DTYPE_BF16), *wk = host_w(hd, MM_DTYPE_BF16);
    mm_weight wa = {.data = dev_copy(wq, (size_t)hd * 2), .dtype = MM_DTYPE_BF16, .rows = 1,
                    .cols = hd};
    mm_weight wb = {.data = dev_copy(wk, (size_t)hd * 2), .dtype = MM_DTYPE_BF16, .rows = 1,
                    .cols = hd};
    struct mm_rope_args ra = {.rot_offset = 0, .rot_dim = hd, .pos = dev_copy(rp, (size_t)n * 4),
                              .inv_freq = dev_copy(inv, (size_t)hd / 2 * 4), .mscale = 1.0f,
                              .style = MM_ROPE_NEOX};
    const int32_t *dt = dev_copy(tables, (size_t)n_blocks * 4), *ds = dev_copy(rs, (size_t)n * 4);
    float *dx[2];
    void *pool[2];
    const mm_weight *pa = norms ? &wa : NULL, *pb = norms ? &wb : NULL;
    for (int j = 0; j < 2; j++) {
        dx[j] = dev_copy(x, xn * 4);
        pool[j] = dev_copy(NULL, pool_b);
        fill_dev(pool[j], pool_b, 0x7f);
        struct mm_kv_store_args st = {
            .kv = {.base = pool[j], .dtype = kdt, .block_size = bs, .block_stride = bs * slot,
                   .slot_stride = slot, .n_kv_heads = KV, .head_dim_k = hd, .head_dim_v = hd,
                   .block_tables = dt, .max_blocks = max_blocks},
            .k = dx[j] + (int64_t)H * hd, .k_stride = W, .v = dx[j] + (int64_t)(H + KV) * hd,
            .v_stride = W, .n_rows = n, .row_seq = ds, .row_pos = ra.pos};
        mm_gpu_set_rowops_pf(j == 0 ? 0 : 2);
        MM_PASS(gpu->ops->head_norm_rope_kv(gpu->ctx, dx[j], n, W, H, KV, (int64_t)H * hd, hd, pa,
                                            pb, 1e-6f, &ra, &st));
    }
    mm_gpu_set_rowops_pf(1);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("head_norm_rope_kv x", dx[1], dx[0], xn * 4);
    same_dev("head_norm_rope_kv cache", pool[1], pool[0], pool_b);
    printf("head_norm_rope_kv %d rows, %d/%d heads of %d, %s, %s cache: prefill form same bits\n",
           n, H, KV, hd, norms ? "norms" : "no norms", dt_name(kdt));
    void *b[] = {dx[0], dx[1], pool[0], pool[1], (void *)dt, (void *)ds, (void *)ra.pos,
                 (void *)ra.inv_freq, (void *)wa.data, (void *)wb.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
    free(tables), free(rs), free(rp), free(x), free(inv), free(wq), free(wk);
}

static void pf_embed_rms_case(int n, int vocab, int dim, enum mm_dtype tdt, enum mm_dtype wdt) {
    const size_t tb = tdt == MM_DTYPE_F32 ? 4 : 2;
    void *wh = host_w(dim, wdt), *th = host_table(vocab, dim, tdt);
    int32_t *ids = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++)
        ids[i] = (i * 7919 + 13) % vocab;
    mm_weight t = {.data = dev_copy(th, (size_t)vocab * dim * tb), .dtype = tdt, .rows = vocab,
                   .cols = dim};
    mm_weight w = {.data = dev_copy(wh, (size_t)dim * (wdt == MM_DTYPE_F32 ? 4 : 2)),
                   .dtype = wdt, .rows = 1, .cols = dim};
    int32_t *di = dev_copy(ids, (size_t)n * 4);
    const size_t on = (size_t)n * dim;
    float *dout[2], *dy[2];
    for (int j = 0; j < 2; j++) {
        dout[j] = dev_copy(NULL, on * 4), dy[j] = dev_copy(NULL, on * 4);
        fill_dev(dout[j], on * 4, 0x55);
        fill_dev(dy[j], on * 4, 0x55);
        mm_gpu_set_rowops_pf(j == 0 ? 0 : 2);
        MM_PASS(gpu->ops->embed_rmsnorm(gpu->ctx, &t, di, n, dout[j], dim, &w, 1e-6f, dy[j], dim));
    }
    mm_gpu_set_rowops_pf(1);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("embed_rmsnorm out", dout[1], dout[0], on * 4);
    same_dev("embed_rmsnorm y", dy[1], dy[0], on * 4);
    printf("embed_rmsnorm %d rows, %s table %dx%d, %s norm: prefill form same bits\n", n,
           dt_name(tdt), vocab, dim, dt_name(wdt));
    void *b[] = {dout[0], dout[1], dy[0], dy[1], di, (void *)t.data, (void *)w.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
    free(th), free(wh), free(ids);
}

static void test_rowops_pf(void) {
    open_gpu();
    if (!mm_gpu_set_rowops_pf || !mm_gpu_rowops_pf_launches)
        MM_SKIP("the backend has no prefill row-op forms");
    PF_TAKEN(true, pf_add_rms_case(4096, 2048, 0, MM_DTYPE_BF16)); // Qwen3-30B-A3B 4K prefill
    pf_add_rms_case(129, 2048, 4, MM_DTYPE_F32);
    pf_add_rms_case(1, 2048, 0, MM_DTYPE_BF16); // decode shapes (forced)
    pf_add_rms_case(64, 2048, 0, MM_DTYPE_BF16);
    pf_add_rms_case(77, 1000, 8, MM_DTYPE_F16);
    pf_add_rms_case(5, 8192, 0, MM_DTYPE_BF16);
    pf_add_rms_case(3, 4100, 0, MM_DTYPE_BF16);
    PF_TAKEN(false, pf_add_rms_case(9, 1002, 0, MM_DTYPE_BF16)); // not in 16-byte pieces: the first form twice
    PF_TAKEN(true, pf_combine_rms_case(4096, 8, 2048, false, MM_DTYPE_BF16)); // 4K prefill
    pf_combine_rms_case(1000, 8, 2048, true, MM_DTYPE_F32);
    pf_combine_rms_case(1, 8, 2048, false, MM_DTYPE_BF16); // decode shapes (forced)
    pf_combine_rms_case(64, 8, 2048, false, MM_DTYPE_BF16);
    pf_combine_rms_case(131, 3, 4000, true, MM_DTYPE_BF16); // fewer ranks than one load group
    pf_combine_rms_case(7, 5, 8192, false, MM_DTYPE_F16);
    pf_combine_rms_case(50, 0, 1024, true, MM_DTYPE_BF16); // a dense layer: the shared row only
    pf_combine_rms_case(33, 8, 2052, false, MM_DTYPE_BF16);
    PF_TAKEN(true, pf_hnr_kv_case(4096, 32, 4, true, MM_DTYPE_BF16)); // 4K prefill, the bf16 cache
    pf_hnr_kv_case(4096, 32, 4, true, MM_DTYPE_F32);
    pf_hnr_kv_case(129, 32, 4, false, MM_DTYPE_BF16);
    pf_hnr_kv_case(1, 32, 4, true, MM_DTYPE_BF16); // decode shapes (forced)
    pf_hnr_kv_case(64, 32, 4, true, MM_DTYPE_F32);
    pf_hnr_kv_case(333, 16, 2, true, MM_DTYPE_BF16);
    pf_hnr_kv_case(7, 8, 8, true, MM_DTYPE_F32);
    pf_hnr_kv_case(50, 64, 4, true, MM_DTYPE_BF16); // 72 heads: the form of 2 heads per warp
    pf_hnr_kv_case(129, 64, 8, false, MM_DTYPE_F32);
    PF_TAKEN(true, pf_embed_rms_case(4096, 5000, 2048, MM_DTYPE_BF16, MM_DTYPE_BF16)); // 4K prefill
    pf_embed_rms_case(1, 1000, 2048, MM_DTYPE_BF16, MM_DTYPE_BF16);
    pf_embed_rms_case(130, 300, 1000, MM_DTYPE_F32, MM_DTYPE_F32);
    pf_embed_rms_case(9, 100, 8192, MM_DTYPE_BF16, MM_DTYPE_F16);
    PF_TAKEN(false, pf_embed_rms_case(5, 100, 1002, MM_DTYPE_BF16, MM_DTYPE_BF16)); // the first form twice
    // route_with_plan's routing a warp per row (with the parallel plan, forced at every size)
    // against route (ops.cu's one-warp kernel, picks one at a time) then route_plan
    if (mm_gpu_set_route_plan_par) {
        mm_gpu_set_rowops_pf(2);
        mm_gpu_set_route_plan_par(2);
        PF_TAKEN(true, route_case(4096, 128, 8, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1)); // 4K prefill
        route_case(4096, 128, 8, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 6, 4000); // ties, NaN
        route_case(1, 128, 8, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1);
        route_case(129, 60, 4, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 3, 2);
        route_case(77, 30, 3, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 4, -1); // E % 4 != 0
        route_case(300, 256, 8, MM_ROUTE_SIGMOID, true, true, 2.5f, 8, 4, 5, -1); // groups
        PF_TAKEN(false, route_case(9, 1000, 300, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, 0, -1)); // too big
        mm_gpu_set_route_plan_par(-1);
        mm_gpu_set_rowops_pf(1);
    }
    gpu_close(NULL);
}

// ---- attention_prep: head_norm_rope_kv and the decode attention in one launch -----------------
// n rows of distinct sequences at positions pos[] over a bf16 cache whose other keys are
// random; once as head_norm_rope_kv then attention, once as attention_prep (on copies of x and
// of the cache): x (q, k, v), the whole cache and the output compared word for word. want:
// the backend takes the call (else MM_EUNSUPP with nothing issued: the copies stay as made).
static void prep_case(int n, const int32_t *pos, int H, int KV, bool norms, enum mm_dtype wdt,
                      bool want) {
    const int hd = 128, bs = 16, n_seqs = 8, max_blocks = 64, n_blocks = n_seqs * max_blocks;
    const int64_t W = (int64_t)(H + 2 * KV) * hd, slot = (int64_t)KV * 2 * hd;
    const size_t pool_b = (size_t)n_blocks * bs * slot * 2, xn = (size_t)n * W;
    int32_t *tables = malloc((size_t)n_blocks * 4), rs[8], rp[8];
    MM_TRUE(tables != NULL && n <= 8);
    for (int i = 0; i < n_blocks; i++)
        tables[i] = (i * 37 + 11) % n_blocks;
    for (int r = 0; r < n; r++)
        rs[r] = (r * 3 + 1) % n_seqs, rp[r] = pos[r];
    uint16_t *pool = malloc(pool_b);
    MM_TRUE(pool != NULL);
    for (size_t i = 0; i < pool_b / 2; i++)
        pool[i] = mm_f32_to_bf16(frand());
    float *x = rand_f32((int64_t)xn, 3.0f), *inv = malloc((size_t)hd / 2 * 4);
    for (int i = 0; i < hd / 2; i++)
        inv[i] = powf(1e6f, -2.0f * (float)i / (float)hd);
    void *wq = host_w(hd, wdt), *wk = host_w(hd, wdt);
    const size_t wsz = wdt == MM_DTYPE_F32 ? 4 : 2;
    mm_weight wa = {.data = dev_copy(wq, (size_t)hd * wsz), .dtype = wdt, .rows = 1, .cols = hd};
    mm_weight wb = {.data = dev_copy(wk, (size_t)hd * wsz), .dtype = wdt, .rows = 1, .cols = hd};
    const int32_t *dt = dev_copy(tables, (size_t)n_blocks * 4), *ds = dev_copy(rs, (size_t)n * 4);
    const int32_t *dp = dev_copy(rp, (size_t)n * 4);
    float *dinv = dev_copy(inv, (size_t)hd / 2 * 4);
    float *dx[2], *out[2];
    void *dpool[2];
    const size_t on = (size_t)n * H * hd;
    for (int j = 0; j < 2; j++) {
        dx[j] = dev_copy(x, xn * 4);
        dpool[j] = dev_copy(pool, pool_b);
        out[j] = dev_copy(NULL, on * 4);
        fill_dev(out[j], on * 4, 0x7f);
    }
    const mm_weight *pa = norms ? &wa : NULL, *pb = norms ? &wb : NULL;
    for (int j = 0; j < 2; j++) {
        struct mm_kv_view kv = {.base = dpool[j], .dtype = MM_DTYPE_BF16, .block_size = bs,
                                .block_stride = bs * slot, .slot_stride = slot, .n_kv_heads = KV,
                                .head_dim_k = hd, .head_dim_v = hd, .block_tables = dt,
                                .max_blocks = max_blocks};
        struct mm_kv_store_args st = {.kv = kv, .k = dx[j] + (int64_t)H * hd, .k_stride = W,
                                      .v = dx[j] + (int64_t)(H + KV) * hd, .v_stride = W,
                                      .n_rows = n, .row_seq = ds, .row_pos = dp};
        struct mm_rope_args ra = {.rot_offset = 0, .rot_dim = hd, .pos = dp, .inv_freq = dinv,
                                  .mscale = 1.0f, .style = MM_ROPE_NEOX};
        struct mm_attn_args aa = {.kv = kv, .q = dx[j], .q_stride = W, .out = out[j],
                                  .out_stride = (int64_t)H * hd, .n_rows = n, .row_seq = ds,
                                  .row_pos = dp, .n_heads = H, .scale = 0.0883883f,
                                  .keys_early = 1};
        if (j == 0) {
            MM_PASS(gpu->ops->head_norm_rope_kv(gpu->ctx, dx[0], n, W, H, KV, (int64_t)H * hd, hd,
                                                pa, pb, 1e-6f, &ra, &st));
            MM_PASS(gpu->ops->attention(gpu->ctx, &aa));
        } else {
            struct mm_attn_prep pp = {.x = dx[1], .stride = W, .n_a = H, .n_b = KV,
                                      .b_off = (int64_t)H * hd, .head_dim = hd, .wa = pa,
                                      .wb = pb, .eps = 1e-6f, .rope = ra, .st = st};
            const mm_err rv = gpu->ops->attention_prep(gpu->ctx, &pp, &aa);
            if (!want) {
                MM_FAIL(rv, MM_EUNSUPP);
                MM_PASS(gpu->ops->head_norm_rope_kv(gpu->ctx, dx[1], n, W, H, KV,
                                                    (int64_t)H * hd, hd, pa, pb, 1e-6f, &ra, &st));
                MM_PASS(gpu->ops->attention(gpu->ctx, &aa));
            } else {
                MM_PASS(rv);
            }
        }
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    same_dev("attention_prep x (q, k, v)", dx[1], dx[0], xn * 4);
    same_dev("attention_prep cache", dpool[1], dpool[0], pool_b);
    same_dev("attention_prep output", out[1], out[0], on * 4);
    printf("attention_prep %d rows (positions %d..), %d/%d heads, %s, %s weights: %s, same bits\n",
           n, rp[0], H, KV, norms ? "norms" : "no norms", dt_name(wdt),
           want ? "one launch" : "refused, two launches");
    void *b[] = {dx[0], dx[1], dpool[0], dpool[1], out[0], out[1], (void *)dt, (void *)ds,
                 (void *)dp, dinv, (void *)wa.data, (void *)wb.data};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
    free(tables), free(pool), free(x), free(inv), free(wq), free(wk);
}

// attention_tcd.cu: 1 the kernel form that writes the row's key and queries into shared memory
// (the default), 0 the form that reads them back from global memory; < 0 back to the default
extern void mm_gpu_set_attention_prep_sm(int on) __attribute__((weak));

static void test_attention_prep(void) {
    open_gpu();
    if (!gpu->ops->attention_prep)
        MM_SKIP("the GPU table has no attention_prep (MM_GPU_OLD_CHAIN set?)");
    const int32_t p1[] = {0}, p2[] = {63}, p3[] = {64}, p4[] = {130}, p5[] = {700};
    const int32_t p6[] = {191}, p7[] = {192}; // the last key of the 3 buffers filled early, the next
    const int32_t p8[] = {5, 64, 127, 128, 300, 0, 701, 66};
    for (int form = 1; form >= (mm_gpu_set_attention_prep_sm ? 0 : 1); form--) {
        if (mm_gpu_set_attention_prep_sm)
            mm_gpu_set_attention_prep_sm(form);
        printf("attention_prep, the %s form:\n", form ? "shared-memory" : "global read-back");
        prep_case(1, p1, 32, 4, true, MM_DTYPE_BF16, true); // Qwen3-30B-A3B, the first token
        prep_case(1, p2, 32, 4, true, MM_DTYPE_BF16, true); // the last key of a block
        prep_case(1, p3, 32, 4, true, MM_DTYPE_BF16, true); // the first key of a block
        prep_case(1, p4, 32, 4, true, MM_DTYPE_BF16, true);
        prep_case(1, p6, 32, 4, true, MM_DTYPE_BF16, true);
        prep_case(1, p7, 32, 4, true, MM_DTYPE_BF16, true);
        prep_case(1, p5, 32, 4, true, MM_DTYPE_F32, true);
        prep_case(8, p8, 32, 4, true, MM_DTYPE_BF16, true); // 8 sequences at once
        prep_case(3, p8, 16, 2, false, MM_DTYPE_BF16, true); // no norms, GQA 8
        prep_case(2, p8, 64, 4, true, MM_DTYPE_BF16, true); // a group of 16
        prep_case(2, p8, 64, 2, true, MM_DTYPE_BF16, false); // a group of 32: refused
    }
    if (mm_gpu_set_attention_prep_sm)
        mm_gpu_set_attention_prep_sm(-1);
    gpu_close(NULL);
}

MM_TESTS = {
    {"route_with_plan == route then route_plan bits", test_route_with_plan},
    {"head_norm_rope_kv == head_norm_rope then kv_store bits", test_head_norm_rope_kv},
    {"combine_rmsnorm == combine then rmsnorm bits", test_combine_rmsnorm},
    {"embed_rmsnorm == embed then rmsnorm bits", test_embed_rmsnorm},
    {"decode attention wide loads == earlier grouping bits", test_attention_wide},
    {"prefill row-op forms == the decode forms bits", test_rowops_pf},
    {"attention_prep == head_norm_rope_kv then attention bits", test_attention_prep},
    {0},
};
