// SPDX-License-Identifier: MIT
// The GPU backend's moe_gate (the MoE gate of a decode step in one launch: kernels/cuda/
// route_plan.cu) against the ops it stands for, bit for bit, through the backend table:
// add_rmsnorm (or rmsnorm, with no addend), matmul of the router, route_with_plan. Every output
// is compared (h, x, logits, ids, weights, offs, src_row, dst_slot, wt) over rows 1..8 and the
// routing families of the fixtures (Qwen3 and Qwen2-MoE softmax top-k with renorm, Mixtral 8
// experts top-2, DeepSeek/GLM sigmoid with bias, groups and scale), odd expert counts (60, 30:
// a last router tile of fewer than 16 rows, E % 4 != 0), an odd d_model (100: no 16-byte loads,
// padding in the x tile), bf16/f16/f32 norm weights, long rows (4096: 16 k segments; 7168), a
// plan of more slots than a block's threads, and a NaN row (the one-at-a-time picks). Each
// case runs twice in a row and twice more from a recorded graph (the arrival count must be
// back at zero each time), with the outputs poisoned in between. Shapes outside the one
// launch (0 or 9 rows, an f32 router, rows too long for shared memory) must be MM_EUNSUPP.
// Without the GPU backend (plain `make`) or without a GPU, every case skips and says why.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm/dtype.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x6a09e667f3bcc909ull
#include "gpu_test.h"

static void open_gpu(void) {
    setenv("MM_GPU_FUSED_GATE", "1", 0); // in the table whatever the default (a set 0 skips)
    gpu_open(NULL);
    if (!gpu->ops->moe_gate) {
        gpu_close(NULL);
        MM_SKIP("the GPU table has no moe_gate (MM_GPU_FUSED_GATE=0, MM_GPU_OLD_CHAIN, "
                "MM_GPU_OLD_FUSIONS or MM_GPU_OLD_DECODE set?)");
    }
}

// d's n_bytes equal e's (both device memory); names the first differing 4-byte word.
static void same_dev(const char *what, const char *how, const void *d, const void *e,
                     size_t n_bytes) {
    uint32_t *a = dev_get(d, n_bytes), *b = dev_get(e, n_bytes);
    for (size_t i = 0; i < n_bytes / 4; i++)
        if (a[i] != b[i])
            MM_TEST_FAIL_("%s (%s): word %zu differs: 0x%08x (moe_gate) vs 0x%08x (separate "
                          "ops)", what, how, i, a[i], b[i]);
    free(a), free(b);
}

static void fill_dev(void *d, size_t n_bytes, uint8_t v) {
    uint8_t *h = malloc(n_bytes);
    memset(h, v, n_bytes);
    MM_PASS(gpu->ops->set(gpu->ctx, d, h, n_bytes));
    free(h);
}

// A weight of rows x cols in dtype dt with values base + frand() * spread (device; data owned).
static mm_weight rand_weight(int64_t rows, int64_t cols, enum mm_dtype dt, float base,
                             float spread) {
    const size_t n = (size_t)(rows * cols), es = dt == MM_DTYPE_F32 ? 4 : 2;
    void *h = malloc(n * es);
    for (size_t i = 0; i < n; i++) {
        const float v = base + frand() * spread;
        if (dt == MM_DTYPE_BF16)
            ((uint16_t *)h)[i] = mm_f32_to_bf16(v);
        else if (dt == MM_DTYPE_F16) // (a norm weight) in [0.5, 2): exponent 14 or 15
            ((uint16_t *)h)[i] = (uint16_t)(((v >= 1.0f ? 15u : 14u) << 10) |
                                            ((uint32_t)((frand() + 1.0f) * 512.0f) & 0x3ffu));
        else
            ((float *)h)[i] = v;
    }
    mm_weight w = {.dtype = dt, .rows = rows, .cols = cols, .data = dev_copy(h, n * es)};
    free(h);
    return w;
}

struct gate_case {
    int n, dim, E, K;
    enum mm_route_score score;
    bool bias, renorm;
    float scale;
    int n_group, topk_group;
    bool addend;          // h += a first (the engine), or the norm of h alone (the router daemon)
    enum mm_dtype wdt;    // norm weight dtype
    int nan_row;          // this row of h gets a NaN (-1: none)
};

// the outputs of one form: [0] the separate ops, [1] moe_gate
struct outs {
    float *h, *x, *logits, *w, *wt;
    int32_t *ids, *offs, *src, *dst;
};

static void outs_new(struct outs *o, const float *h, int n, int dim, int E, int K) {
    const size_t nk = (size_t)n * K;
    o->h = dev_copy(h, (size_t)n * dim * 4), o->x = dev_copy(NULL, (size_t)n * dim * 4);
    o->logits = dev_copy(NULL, (size_t)n * E * 4);
    o->ids = dev_copy(NULL, nk * 4), o->w = dev_copy(NULL, nk * 4);
    o->offs = dev_copy(NULL, (size_t)(E + 1) * 4), o->src = dev_copy(NULL, nk * 4);
    o->dst = dev_copy(NULL, nk * 4), o->wt = dev_copy(NULL, nk * 4);
}

// h back to its starting rows, every output poisoned with byte v
static void outs_reset(struct outs *o, const float *h, int n, int dim, int E, int K, uint8_t v) {
    const size_t nk = (size_t)n * K;
    MM_PASS(gpu->ops->set(gpu->ctx, o->h, h, (size_t)n * dim * 4));
    fill_dev(o->x, (size_t)n * dim * 4, v), fill_dev(o->logits, (size_t)n * E * 4, v);
    fill_dev(o->ids, nk * 4, v), fill_dev(o->w, nk * 4, v), fill_dev(o->wt, nk * 4, v);
    fill_dev(o->offs, (size_t)(E + 1) * 4, v), fill_dev(o->src, nk * 4, v);
    fill_dev(o->dst, nk * 4, v);
}

static void outs_same(const struct outs *f, const struct outs *s, const char *how, int n,
                      int dim, int E, int K) {
    const size_t nk = (size_t)n * K;
    same_dev("h", how, f->h, s->h, (size_t)n * dim * 4);
    same_dev("x", how, f->x, s->x, (size_t)n * dim * 4);
    same_dev("logits", how, f->logits, s->logits, (size_t)n * E * 4);
    same_dev("ids", how, f->ids, s->ids, nk * 4);
    same_dev("weights", how, f->w, s->w, nk * 4);
    same_dev("offs", how, f->offs, s->offs, (size_t)(E + 1) * 4);
    same_dev("src_row", how, f->src, s->src, nk * 4);
    same_dev("dst_slot", how, f->dst, s->dst, nk * 4);
    same_dev("wt", how, f->wt, s->wt, nk * 4);
}

static void outs_free(struct outs *o) {
    void *b[] = {o->h, o->x, o->logits, o->w, o->wt, o->ids, o->offs, o->src, o->dst};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
}

static mm_err gate_call(const struct gate_case *c, const float *da, const mm_weight *nw,
                        const mm_weight *rw, const struct mm_route_params *p, struct outs *o) {
    return gpu->ops->moe_gate(gpu->ctx, c->addend ? da : NULL, c->dim, o->h, c->dim, nw, 1e-6f,
                              o->x, c->dim, rw, p, o->logits, c->n, o->ids, o->w, o->offs,
                              o->src, o->dst, o->wt);
}

static void gate_run(const struct gate_case *c) {
    const int n = c->n, dim = c->dim, E = c->E, K = c->K;
    float *h = rand_f32((int64_t)n * dim, 3.0f), *a = rand_f32((int64_t)n * dim, 1.0f);
    if (c->nan_row >= 0)
        h[(size_t)c->nan_row * dim + dim / 3] = NAN;
    float *bh = rand_f32(E, 0.1f);
    mm_weight nw = rand_weight(1, dim, c->wdt, 1.0f, 0.5f);
    // router rows of about unit norm against the normed x: logits of a few units
    mm_weight rw = rand_weight(E, dim, MM_DTYPE_BF16, 0.0f, 3.0f / sqrtf((float)dim));
    struct mm_route_params p = {.n_experts = E, .top_k = K, .score = c->score,
                                .bias = c->bias ? dev_copy(bh, (size_t)E * 4) : NULL,
                                .n_group = c->n_group, .topk_group = c->topk_group,
                                .renorm = c->renorm, .renorm_eps = c->renorm ? 1e-20f : 0.0f,
                                .scale = c->scale};
    float *da = dev_copy(a, (size_t)n * dim * 4);
    struct outs o[2];
    outs_new(&o[0], h, n, dim, E, K);
    outs_new(&o[1], h, n, dim, E, K);
    // the separate ops
    if (c->addend)
        MM_PASS(gpu->ops->add_rmsnorm(gpu->ctx, da, dim, o[0].h, dim, &nw, 1e-6f, o[0].x, dim, n));
    else
        MM_PASS(gpu->ops->rmsnorm(gpu->ctx, &nw, 1e-6f, o[0].h, dim, o[0].x, dim, n));
    MM_PASS(gpu->ops->matmul(gpu->ctx, &rw, NULL, o[0].x, dim, o[0].logits, E, n));
    MM_PASS(gpu->ops->route_with_plan(gpu->ctx, &p, o[0].logits, E, n, o[0].ids, o[0].w,
                                      o[0].offs, o[0].src, o[0].dst, o[0].wt));
    // the one launch, twice in a row (h back to its start each time)
    for (int rep = 0; rep < 2; rep++) {
        outs_reset(&o[1], h, n, dim, E, K, (uint8_t)(0x5a + rep));
        MM_PASS(gate_call(c, da, &nw, &rw, &p, &o[1]));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        outs_same(&o[1], &o[0], rep ? "second call" : "first call", n, dim, E, K);
    }
    // recorded once, replayed twice
    void *graph = NULL;
    if (gpu->ops->capture_begin) {
        outs_reset(&o[1], h, n, dim, E, K, 0x33);
        MM_PASS(gpu->ops->capture_begin(gpu->ctx));
        const mm_err rv = gate_call(c, da, &nw, &rw, &p, &o[1]);
        void *g = NULL;
        const mm_err rv2 = gpu->ops->capture_end(gpu->ctx, &g);
        MM_PASS(rv);
        MM_PASS(rv2);
        graph = g;
        for (int rep = 0; rep < 2; rep++) {
            outs_reset(&o[1], h, n, dim, E, K, (uint8_t)(0x71 + rep));
            MM_PASS(gpu->ops->graph_launch(gpu->ctx, graph));
            MM_PASS(gpu->ops->synchronize(gpu->ctx));
            outs_same(&o[1], &o[0], rep ? "second replay" : "first replay", n, dim, E, K);
        }
        gpu->ops->graph_free(gpu->ctx, graph);
    }
    printf("moe_gate %d rows, d_model %d, E %d, K %d, %s%s%s, scale %g, groups %d/%d, %s, %s "
           "norm weight%s: same bits as the separate ops (2 calls%s)\n", n, dim, E, K,
           c->score == MM_ROUTE_SOFTMAX ? "softmax" : "sigmoid", c->bias ? " + bias" : "",
           c->renorm ? ", renorm" : "", (double)c->scale, c->n_group, c->topk_group,
           c->addend ? "h += a" : "no addend", mm_dtype_name(c->wdt),
           c->nan_row >= 0 ? ", a NaN row" : "", graph ? ", 2 graph replays" : "");
    outs_free(&o[0]), outs_free(&o[1]);
    dev_free(da), dev_free((void *)nw.data), dev_free((void *)rw.data), dev_free((void *)p.bias);
    free(h), free(a), free(bh);
}

#define SOFT(n, dim, E, K, addend, wdt) \
    (struct gate_case){n, dim, E, K, MM_ROUTE_SOFTMAX, false, true, 1.0f, 0, 0, addend, wdt, -1}

static void test_qwen3(void) {
    open_gpu();
    for (int n = 1; n <= 8; n++) // Qwen3-30B-A3B: d_model 2048, 128 experts, top-8
        gate_run(&SOFT(n, 2048, 128, 8, true, MM_DTYPE_BF16));
    gate_run(&SOFT(1, 2048, 128, 8, false, MM_DTYPE_BF16)); // the router daemon's form
    gate_run(&SOFT(3, 2048, 128, 8, false, MM_DTYPE_BF16));
    gpu_close(NULL);
}

static void test_families(void) {
    open_gpu();
    gate_run(&SOFT(2, 2048, 60, 4, true, MM_DTYPE_BF16));  // Qwen2-MoE: 60 experts, top-4
    gate_run(&SOFT(5, 2048, 60, 4, true, MM_DTYPE_F32));
    struct gate_case mix = SOFT(4, 4096, 8, 2, true, MM_DTYPE_BF16); // Mixtral, 16 segments
    mix.renorm = false;
    gate_run(&mix);
    mix.n = 1;
    gate_run(&mix);
    // DeepSeek V3 / GLM-4.5: sigmoid, correction bias, groups, renorm + scale
    struct gate_case ds = {2, 7168, 256, 8, MM_ROUTE_SIGMOID, true, true, 2.5f, 8, 4, true,
                           MM_DTYPE_BF16, -1};
    gate_run(&ds);
    ds.n = 4, ds.dim = 5120, ds.E = 160, ds.K = 8, ds.n_group = 1, ds.topk_group = 1;
    ds.scale = 1.0f; // GLM-4.5-like: 160 experts, no groups
    gate_run(&ds);
    gpu_close(NULL);
}

static void test_odd(void) {
    open_gpu();
    gate_run(&SOFT(3, 100, 30, 3, true, MM_DTYPE_F32));  // odd d_model, E % 4 != 0
    gate_run(&SOFT(8, 100, 30, 3, false, MM_DTYPE_F16)); // f16 norm weight, no addend
    gate_run(&SOFT(7, 64, 16, 4, true, MM_DTYPE_BF16));  // the tiny fixtures' size
    gate_run(&SOFT(8, 256, 64, 40, true, MM_DTYPE_BF16)); // 320 slots: the block-wide plan
    struct gate_case nan = SOFT(3, 512, 32, 4, true, MM_DTYPE_BF16);
    nan.nan_row = 1; // the one-at-a-time picks on that row
    gate_run(&nan);
    gpu_close(NULL);
}

// shapes the one launch does not take: MM_EUNSUPP, and nothing written
static void test_unsupported(void) {
    open_gpu();
    const int dim = 2048, E = 128, K = 8;
    float *h = rand_f32(16 * dim, 1.0f);
    mm_weight nw = rand_weight(1, dim, MM_DTYPE_BF16, 1.0f, 0.5f);
    mm_weight rw = rand_weight(E, dim, MM_DTYPE_BF16, 0.0f, 0.05f);
    mm_weight rf = rand_weight(E, dim, MM_DTYPE_F32, 0.0f, 0.05f);
    struct mm_route_params p = {.n_experts = E, .top_k = K, .renorm = true, .scale = 1.0f};
    struct outs o;
    outs_new(&o, h, 16, dim, E, K);
    outs_reset(&o, h, 16, dim, E, K, 0x44);
    struct gate_case c = SOFT(9, dim, E, K, true, MM_DTYPE_BF16);
    MM_FAIL(gate_call(&c, o.x, &nw, &rw, &p, &o), MM_EUNSUPP); // 9 rows
    c.n = 0;
    MM_FAIL(gate_call(&c, o.x, &nw, &rw, &p, &o), MM_EUNSUPP); // no rows
    c.n = 4;
    MM_FAIL(gate_call(&c, o.x, &nw, &rf, &p, &o), MM_EUNSUPP); // f32 router
    mm_weight big = rand_weight(1, 8192, MM_DTYPE_BF16, 1.0f, 0.5f);
    mm_weight rbig = {.dtype = MM_DTYPE_BF16, .rows = E, .cols = 8192, .data = rw.data};
    // 8 rows of 8192: more shared memory than the launch takes
    MM_FAIL(gpu->ops->moe_gate(gpu->ctx, NULL, 8192, o.h, 8192, &big, 1e-6f, o.x, 8192, &rbig,
                               &p, o.logits, 8, o.ids, o.w, o.offs, o.src, o.dst, o.wt),
            MM_EUNSUPP);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    uint8_t *x = dev_get(o.x, (size_t)16 * dim * 4);
    for (size_t i = 0; i < (size_t)16 * dim * 4; i++)
        if (x[i] != 0x44)
            MM_TEST_FAIL_("x byte %zu written by a refused call", i);
    free(x);
    outs_free(&o);
    dev_free((void *)nw.data), dev_free((void *)rw.data), dev_free((void *)rf.data);
    dev_free((void *)big.data);
    free(h);
    printf("moe_gate: 9 rows, 0 rows, an f32 router, 8 rows of 8192: MM_EUNSUPP, nothing "
           "written\n");
    gpu_close(NULL);
}

MM_TESTS = {
    {"moe_gate == add_rmsnorm, router matmul, route_with_plan bits (Qwen3, rows 1..8)",
     test_qwen3},
    {"moe_gate bits: Qwen2-MoE, Mixtral, DeepSeek/GLM routing", test_families},
    {"moe_gate bits: odd shapes, f16/f32 norms, a big plan, a NaN row", test_odd},
    {"moe_gate refuses other shapes (MM_EUNSUPP, nothing issued)", test_unsupported},
    {0},
};
