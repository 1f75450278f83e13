// SPDX-License-Identifier: MIT
// The mesh's device routing plan (docs/MESH.md "Device frames") checked without a GPU: the CPU
// table dressed as a device backend (host_memory false, route_plan and moe_matmul_dev on the
// host; moe_matmul_dev, like the CUDA grouped products, leaves rows past offs[n_experts]
// alone), the router's plan (mm_model_gate_plan), each owner's share of it made the way
// kernels/cuda/mesh_ops.cu makes it (plan_split below: the same algorithm in C), every owner's
// experts on its share (mm_model_experts_plan, worst-case slot count), the pick of each slot's
// row from its owner's reply, and combine with the plan's weights (mm_model_combine_plan) must
// give the host path's bits (mm_model_gate, one expert at a time, mm_model_combine) for 1, 2
// and 3 owners, on models with and without shared experts. With one owner the plan made straight
// in its share's place (mm_model_gate_plan_at, the router's MM_MESH_PLAN_DIRECT) is the share.
// The shard's out-of-place attention (mm_model_attn_forward_to: its reply written in the
// router's ring) gives mm_model_attn_forward's bits and leaves its input alone, through the
// backend's matmul_res (the residual in o_proj's epilogue) and without it; the router's combine
// that also makes the next layer's input norm (mm_model_combine_plan_next) gives the combine's h,
// and the attention on that norm the attention's own bits.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mm_test.h"
#include "mm/model.h"

static const struct mm_backend_ops *g_cpu;

static mm_err h_set(void *ctx, void *dst, const void *src, size_t n) {
    (void)ctx;
    memcpy(dst, src, n);
    return MM_OK;
}

// route_plan: the stable counting sort of kernels.h
static mm_err h_plan(void *ctx, const int32_t *ids, const float *w, int64_t n, int k, int e,
                     int32_t *offs, int32_t *src, int32_t *dst, float *wt) {
    (void)ctx;
    const int64_t nk = n * k;
    memset(offs, 0, (size_t)(e + 1) * 4);
    for (int64_t t = 0; t < nk; t++) {
        if (ids[t] < 0 || ids[t] >= e)
            return MM_EINVAL;
        offs[ids[t] + 1]++;
    }
    for (int x = 0; x < e; x++)
        offs[x + 1] += offs[x];
    int32_t next[1024];
    MM_TRUE(e <= 1024);
    memcpy(next, offs, (size_t)e * 4);
    for (int64_t t = 0; t < nk; t++) {
        const int32_t p = next[ids[t]]++;
        src[p] = (int32_t)(t / k);
        dst[p] = (int32_t)t;
    }
    if (wt)
        for (int64_t t = 0; t < nk; t++)
            wt[(t % k) * n + t / k] = w[t];
    return MM_OK;
}

// moe_matmul_dev: expert e's rows [offs[e], offs[e+1]); rows from offs[n_experts] to n_rows
// belong to no expert and are not touched (as the CUDA tile lookup does)
static mm_err h_moe(void *ctx, const void *const *ex, enum mm_dtype dt, int64_t rows,
                    int64_t cols, int e, const int32_t *offs, const float *x, int64_t xs,
                    float *y, int64_t ys, int64_t n) {
    if (offs[0] != 0 || offs[e] > n)
        return MM_EINVAL;
    for (int i = 0; i < e; i++) {
        if (offs[i + 1] == offs[i])
            continue;
        mm_weight w = {dt, rows, cols, ex[i]};
        MM_TRY(g_cpu->matmul(ctx, &w, NULL, x + offs[i] * xs, xs, y + offs[i] * ys, ys,
                             offs[i + 1] - offs[i]));
    }
    return MM_OK;
}

static void dev_table(struct mm_backend_ops *o) {
    *o = *g_cpu;
    o->name = "cpu-as-device";
    o->host_memory = false;
    o->set = h_set, o->get = h_set;
    o->route_plan = h_plan, o->moe_matmul_dev = h_moe;
    o->moe_matmul_rows = NULL, o->route_with_plan = NULL; // the ops the C fallback spells out
}

// plan_split: mesh_plan_split_kernel's algorithm (kernels/cuda/mesh_ops.cu): owner o's share
// at out + o * stride: offs_o (E+1) | src_o (n) | dst_o (n); the owner's experts' slots first in
// plan order, then every other slot.
static void plan_split(const int32_t *offs, const int32_t *src, const int32_t *dst,
                       const int32_t *owner_of, int E, int n, int n_owners, int32_t *out,
                       int64_t stride) {
    for (int o = 0; o < n_owners; o++) {
        int32_t *offs_o = out + o * stride, *src_o = offs_o + E + 1, *dst_o = src_o + n;
        int32_t own[1025], not_[1025];
        int a = 0, b = 0;
        for (int e = 0; e < E; e++) {
            own[e] = a, not_[e] = b;
            const int c = offs[e + 1] - offs[e];
            if (owner_of[e] == o)
                a += c;
            else
                b += c;
        }
        own[E] = a, not_[E] = b;
        for (int e = 0; e <= E; e++)
            offs_o[e] = own[e];
        for (int p = 0; p < n; p++) {
            int lo = 0, hi = E - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (offs[mid] <= p)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            const int e = lo, j = p - offs[e];
            const int q = owner_of[e] == o ? own[e] + j : a + not_[e] + j;
            src_o[q] = src[p];
            dst_o[q] = dst[p];
        }
    }
}

static uint32_t g_rng = 12345;
static float frand(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return ((float)(g_rng >> 8) / 16777216.0f - 0.5f) * 2.0f;
}

// open_dev: fixture model `name` on the CPU backend dressed as a device (*dev, the caller's: it
// must outlive the model); close with close_dev.
static mm_model *open_dev(const char *name, mm_backend **be, struct mm_backend_ops *dev) {
    char dir[256], err[MM_ERRLEN] = "";
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    mm_backend_params bp = {.n_threads = 1};
    MM_PASS(mm_backend_open(be, "cpu", &bp, err));
    g_cpu = (*be)->ops;
    dev_table(dev);
    (*be)->ops = dev;
    mm_model *m = NULL;
    MM_PASS(mm_model_open(&m, dir, *be, err));
    return m;
}

static void close_dev(mm_model *m, mm_backend *be) {
    mm_model_close(m);
    be->ops = g_cpu;
    mm_backend_close(be);
}

static void check_model(const char *name) {
    char err[MM_ERRLEN] = "";
    mm_backend *be = NULL;
    struct mm_backend_ops dev;
    mm_model *m = open_dev(name, &be, &dev);
    const mm_model_config *c = mm_model_cfg(m);
    const int D = c->d_model, K = c->top_k, E = c->n_experts, R = 8;
    mm_model_scratch *s = NULL, *so = NULL;
    MM_PASS(mm_model_scratch_new(&s, m, R, err));
    MM_PASS(mm_model_scratch_new(&so, m, R, err)); // the owners' (another process's)
    int L = 0;
    while (L < c->n_layers && !mm_model_layer_is_moe(m, L))
        L++;
    MM_TRUE(L < c->n_layers);
    const bool shared = mm_model_layer_has_shared(m, L);
    float *x = calloc((size_t)R * D, 4), *h0 = calloc((size_t)R * D, 4);
    float *href = calloc((size_t)R * D, 4), *h = calloc((size_t)R * D, 4);
    float *sh = calloc((size_t)R * D, 4), *ref = calloc((size_t)R * K * D, 4);
    float *eo = calloc((size_t)R * K * D, 4), *outs = calloc((size_t)3 * R * K * D, 4);
    float *w = calloc((size_t)R * K, 4);
    int32_t *ids = calloc((size_t)R * K, 4), *owner_of = calloc((size_t)E, 4);
    const int64_t stride = (int64_t)E + 1 + 2 * R * K;
    int32_t *shares = calloc((size_t)(3 * stride), 4);
    MM_TRUE(x && h0 && href && h && sh && ref && eo && outs && w && ids && owner_of && shares);
    for (int n = 1; n <= R; n += 5) { // 1 row (decode) and 6 rows
        const int nk = n * K;
        for (int i = 0; i < n * D; i++)
            x[i] = frand(), h0[i] = frand();
        // host path: routing read back, one expert at a time, combine in rank order
        MM_PASS(mm_model_gate(m, s, L, x, n, ids, w));
        for (int t = 0; t < nk; t++)
            MM_PASS(mm_model_expert_forward(m, s, L, ids[t], x + (t / K) * D, 1, ref + t * D));
        if (shared)
            MM_PASS(mm_model_shared_forward(m, s, L, x, n, sh));
        memcpy(href, h0, (size_t)n * D * 4);
        MM_PASS(mm_model_combine(m, s, L, href, n, K, w, ref, shared ? sh : NULL));
        for (int N = 1; N <= 3; N++) {
            for (int e = 0; e < E; e++)
                owner_of[e] = e % N; // the uniform placement
            mm_model_plan pl;
            MM_PASS(mm_model_gate_plan(m, s, L, x, n, &pl));
            for (int t = 0; t < nk; t++)
                MM_EQ(pl.ids[t], ids[t]);
            plan_split(pl.offs, pl.src, pl.dst, owner_of, E, nk, N, shares, stride);
            if (N == 1) { // the plan made in the lone owner's share: the same int32s
                int32_t *at = shares + 2 * stride;
                for (int64_t i = 0; i < stride; i++)
                    at[i] = -7;
                mm_model_plan pa;
                MM_PASS(mm_model_gate_plan_at(m, s, L, x, n, at, &pa));
                MM_TRUE(pa.offs == at && pa.src == at + E + 1 && pa.dst == at + E + 1 + nk);
                MM_TRUE(memcmp(at, shares, (size_t)(E + 1 + 2 * nk) * 4) == 0);
                MM_TRUE(memcmp(pa.wt, pl.wt, (size_t)nk * 4) == 0);
            }
            for (int i = 0; i < 3 * R * K * D; i++)
                outs[i] = NAN; // an owner's other slots: whatever it leaves there
            for (int o = 0; o < N; o++) {
                const int32_t *so_offs = shares + o * stride;
                MM_PASS(mm_model_experts_plan(m, so, L, so_offs, x, so_offs + E + 1,
                                              so_offs + E + 1 + nk, nk,
                                              outs + (size_t)o * R * K * D));
            }
            for (int t = 0; t < nk; t++) { // mm_gpu_mesh_pick
                const int o = owner_of[ids[t]];
                memcpy(eo + t * D, outs + ((size_t)o * R * K + t) * D, (size_t)D * 4);
                if (memcmp(eo + t * D, ref + t * D, (size_t)D * 4) != 0)
                    MM_TEST_FAIL_("%s, %d rows, %d owners: slot %d (expert %d, owner %d) differs "
                                  "from the expert's own product", name, n, N, t, ids[t], o);
            }
            if (shared)
                MM_PASS(mm_model_shared_forward(m, s, L, x, n, sh));
            memcpy(h, h0, (size_t)n * D * 4);
            MM_PASS(mm_model_combine_plan(m, s, L, h, n, pl.wt, eo, shared ? sh : NULL));
            for (int i = 0; i < n * D; i++)
                if (memcmp(&h[i], &href[i], 4) != 0)
                    MM_TEST_FAIL_("%s, %d rows, %d owners: h[%d] = %.9g, host path %.9g", name, n,
                                  N, i, h[i], href[i]);
        }
    }
    free(x), free(h0), free(href), free(h), free(sh), free(ref), free(eo), free(outs), free(w);
    free(ids), free(owner_of), free(shares);
    mm_model_scratch_free(so);
    mm_model_scratch_free(s);
    close_dev(m, be);
}

// matmul_res as the CUDA table's contract says: the product, then res + it
static mm_err h_matmul_res(void *ctx, const mm_weight *w, const float *x, int64_t xs,
                           const float *res, int64_t rs, float *y, int64_t ys, int64_t n) {
    float t[4096];
    if (w->rows > 4096)
        return MM_EUNSUPP;
    for (int64_t i = 0; i < n; i++) {
        MM_TRY(g_cpu->matmul(ctx, w, NULL, x + i * xs, xs, t, w->rows, 1));
        for (int64_t j = 0; j < w->rows; j++)
            y[i * ys + j] = res[i * rs + j] + t[j];
    }
    return MM_OK;
}

// mm_model_attn_forward_to (out of place) == mm_model_attn_forward on a copy, bit for bit, its
// input untouched; with and without matmul_res in the table.
static void t_attn_to(void) {
    char err[MM_ERRLEN] = "";
    mm_backend *be = NULL;
    struct mm_backend_ops dev;
    mm_model *m = open_dev("qwen3moe-tiny", &be, &dev);
    const int D = mm_model_cfg(m)->d_model, R = 6;
    for (int with_res = 0; with_res < 2; with_res++) {
        dev.matmul_res = with_res ? h_matmul_res : NULL;
        mm_kv_params kp;
        mm_model_kv_params(m, &kp);
        kp.max_seqs = 2, kp.max_ctx = 64, kp.budget_bytes = 1 << 20;
        mm_kv_cache *kv1 = NULL, *kv2 = NULL;
        MM_PASS(mm_kv_cache_new(&kv1, &kp, be, err));
        MM_PASS(mm_kv_cache_new(&kv2, &kp, be, err));
        int32_t s1 = 0, s2 = 0;
        MM_PASS(mm_kv_cache_seq_new(kv1, &s1));
        MM_PASS(mm_kv_cache_seq_new(kv2, &s2));
        MM_EQ(s1, s2);
        MM_PASS(mm_kv_cache_reserve(kv1, s1, 2 * R));
        MM_PASS(mm_kv_cache_reserve(kv2, s2, 2 * R));
        mm_model_scratch *sa = NULL, *sb = NULL;
        MM_PASS(mm_model_scratch_new(&sa, m, R, err));
        MM_PASS(mm_model_scratch_new(&sb, m, R, err));
        float *h = calloc((size_t)R * D, 4), *h0 = calloc((size_t)R * D, 4);
        float *out = calloc((size_t)R * D, 4);
        MM_TRUE(h && h0 && out);
        int32_t seq[8], pos[8];
        for (int step = 0; step < 2; step++) { // a prompt of R rows, then R more
            for (int i = 0; i < R; i++)
                seq[i] = s1, pos[i] = step * R + i;
            for (int i = 0; i < R * D; i++)
                h0[i] = frand();
            mm_model_rows rows = {.n_rows = R, .seq = seq, .pos = pos};
            for (int l = 0; l < mm_model_cfg(m)->n_layers; l++) {
                memcpy(h, h0, (size_t)R * D * 4);
                MM_PASS(mm_model_attn_forward(m, sa, l, kv1, &rows, h));
                for (int i = 0; i < R * D; i++)
                    out[i] = NAN;
                MM_PASS(mm_model_attn_forward_to(m, sb, l, kv2, &rows, h0, NULL, out));
                MM_TRUE(memcmp(out, h, (size_t)R * D * 4) == 0);
                memcpy(h, h0, (size_t)R * D * 4); // (h0 is not written: the next layer's input)
            }
        }
        // the router's combine making the next layer's input norm (MM_MODEL_NORMED_FLAG frames):
        // the same h as mm_model_combine_plan, and the shard's attention on it with that norm ==
        // with its own
        const int K = mm_model_cfg(m)->top_k, Lm = 0;
        MM_TRUE(mm_model_layer_is_moe(m, Lm) && mm_model_cfg(m)->n_layers > 1);
        float *wt = malloc((size_t)K * R * 4), *eo = malloc((size_t)R * K * D * 4);
        float *h2 = malloc((size_t)R * D * 4), *xn = malloc((size_t)R * D * 4);
        float *o1 = malloc((size_t)R * D * 4), *o2 = malloc((size_t)R * D * 4);
        MM_TRUE(wt && eo && h2 && xn && o1 && o2);
        for (int i = 0; i < K * R; i++)
            wt[i] = frand();
        for (int i = 0; i < R * K * D; i++)
            eo[i] = frand();
        memcpy(h, h0, (size_t)R * D * 4);
        memcpy(h2, h0, (size_t)R * D * 4);
        MM_PASS(mm_model_combine_plan(m, sa, Lm, h, R, wt, eo, NULL));
        MM_PASS(mm_model_combine_plan_next(m, sb, Lm, h2, R, wt, eo, NULL, xn));
        MM_TRUE(memcmp(h, h2, (size_t)R * D * 4) == 0);
        MM_EQ(mm_model_combine_plan_next(m, sb, mm_model_cfg(m)->n_layers - 1, h2, R, wt, eo, NULL,
                                         xn), MM_EINVAL); // (no next layer)
        for (int i = 0; i < R; i++)
            pos[i] = 2 * R + i;
        mm_model_rows rows2 = {.n_rows = R, .seq = seq, .pos = pos};
        MM_PASS(mm_kv_cache_reserve(kv1, s1, 3 * R));
        MM_PASS(mm_kv_cache_reserve(kv2, s2, 3 * R));
        MM_PASS(mm_model_attn_forward_to(m, sa, Lm + 1, kv1, &rows2, h, NULL, o1));
        MM_PASS(mm_model_attn_forward_to(m, sb, Lm + 1, kv2, &rows2, h2, xn, o2));
        MM_TRUE(memcmp(o1, o2, (size_t)R * D * 4) == 0);
        free(wt), free(eo), free(h2), free(xn), free(o1), free(o2);
        free(h), free(h0), free(out);
        mm_model_scratch_free(sa);
        mm_model_scratch_free(sb);
        mm_kv_cache_free(kv1);
        mm_kv_cache_free(kv2);
    }
    close_dev(m, be);
}

static void t_qwen3(void) { check_model("qwen3moe-tiny"); }
static void t_qwen2(void) { check_model("qwen2moe-tiny"); }
static void t_deepseek(void) { check_model("deepseekv3-tiny"); }

static void t_plain(void) {
    // a host-memory backend has no device path: the router routes on the host
    char err[MM_ERRLEN] = "";
    mm_backend *be = NULL;
    mm_backend_params bp = {.n_threads = 1};
    MM_PASS(mm_backend_open(&be, "cpu", &bp, err));
    mm_model *m = NULL;
    MM_PASS(mm_model_open(&m, "tests/fixtures/models/qwen3moe-tiny", be, err));
    mm_model_scratch *s = NULL;
    MM_PASS(mm_model_scratch_new(&s, m, 4, err));
    float x[64 * 4] = {0};
    mm_model_plan pl;
    MM_EQ(mm_model_gate_plan(m, s, 0, x, 1, &pl), MM_EUNSUPP);
    int32_t offs[1024] = {0};
    MM_EQ(mm_model_experts_plan(m, s, 0, offs, x, offs, offs, 4, x), MM_EUNSUPP);
    MM_EQ(mm_model_gate_plan(m, s, 0, x, 5, &pl), MM_EINVAL); // more rows than the scratch
    mm_model_scratch_free(s);
    mm_model_close(m);
    mm_backend_close(be);
}

MM_TESTS = {
    {"device routing plan split over 1-3 owners == host path (qwen3moe)", t_qwen3},
    {"device routing plan with shared experts == host path (qwen2moe)", t_qwen2},
    {"device routing plan, grouped sigmoid routing == host path (deepseekv3)", t_deepseek},
    {"no device path: plan calls refused", t_plain},
    {"attention out of place == in place, input untouched, with and without matmul_res", t_attn_to},
    {NULL, NULL},
};
