// SPDX-License-Identifier: MIT
// mm_model_experts_forward (all of a layer's routed rows sorted by expert) against
// mm_model_expert_forward one expert at a time, bit for bit: on the CPU backend (no
// moe_matmul: the per-expert fallback) and on a CPU backend whose table carries a grouped
// moe_matmul (the path device backends take), so that path's offsets and scratch use are
// checked without a GPU. Bad offsets are refused.
#include <stdlib.h>
#include <string.h>

#include "mm_test.h"
#include "mm/model.h"

#define MODEL "tests/fixtures/models/qwen3moe-tiny"

static const struct mm_backend_ops *g_cpu_ops; // the real CPU table, for the grouped stand-in

// moe_matmul for the test table: each expert's rows through the CPU matmul (a grouped call
// must give exactly these bits, kernels.h). Counts its calls.
static int g_grouped_calls;
static mm_err test_moe_matmul(void *ctx, const mm_weight *ex, const int32_t *offs, int n_experts,
                              const float *x, int64_t xs, float *y, int64_t ys, int64_t n_rows) {
    if (offs[0] != 0 || offs[n_experts] != n_rows)
        return MM_EINVAL;
    g_grouped_calls++;
    for (int e = 0; e < n_experts; e++)
        if (offs[e + 1] > offs[e])
            MM_TRY(g_cpu_ops->matmul(ctx, &ex[e], NULL, x + offs[e] * xs, xs, y + offs[e] * ys, ys,
                                     offs[e + 1] - offs[e]));
    return MM_OK;
}

static float frand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static void check(bool grouped) {
    char err[MM_ERRLEN] = "";
    mm_backend *be = NULL;
    mm_backend_params bp = {.n_threads = 2};
    MM_PASS(mm_backend_open(&be, "cpu", &bp, err));
    struct mm_backend_ops ops = *be->ops;
    const struct mm_backend_ops *saved = be->ops;
    g_cpu_ops = saved;
    if (grouped) {
        ops.moe_matmul = test_moe_matmul;
        be->ops = &ops;
    }
    mm_model *m = NULL;
    MM_PASS(mm_model_open(&m, MODEL, be, err));
    const mm_model_config *c = mm_model_cfg(m);
    const int E = c->n_experts, D = c->d_model, n = 23;
    mm_model_scratch *s = NULL;
    MM_PASS(mm_model_scratch_new(&s, m, 32, err));
    int layer = 0;
    while (!mm_model_layer_is_moe(m, layer))
        layer++;
    // rows sorted by expert: a skewed count per expert, some experts empty
    int32_t *offs = calloc((size_t)E + 1, 4);
    unsigned seed = 7;
    for (int i = 0; i < n; i++) {
        int e = (int)((frand(&seed) + 1.0f) * 0.5f * (frand(&seed) + 1.0f) * 0.5f * E) % E;
        offs[e + 1]++;
    }
    for (int e = 0; e < E; e++)
        offs[e + 1] += offs[e];
    float *x = malloc((size_t)n * D * 4), *y = malloc((size_t)n * D * 4);
    float *want = malloc((size_t)n * D * 4);
    for (int i = 0; i < n * D; i++)
        x[i] = frand(&seed);
    for (int e = 0; e < E; e++)
        if (offs[e + 1] > offs[e])
            MM_PASS(mm_model_expert_forward(m, s, layer, e, x + (size_t)offs[e] * D,
                                            offs[e + 1] - offs[e], want + (size_t)offs[e] * D));
    g_grouped_calls = 0;
    memset(y, 0xff, (size_t)n * D * 4);
    MM_PASS(mm_model_experts_forward(m, s, layer, offs, x, n, y));
    MM_TRUE(memcmp(y, want, (size_t)n * D * 4) == 0);
    MM_EQ(g_grouped_calls, grouped ? 3 : 0); // gate, up, down: one call each
    // offsets that do not end at n, or decrease, are refused; a dense layer too
    offs[E] = n + 1;
    MM_FAIL(mm_model_experts_forward(m, s, layer, offs, x, n, y), MM_EINVAL);
    offs[E] = n;
    if (E > 2 && offs[2] > 0) {
        int32_t keep = offs[1];
        offs[1] = offs[2] + 1;
        MM_FAIL(mm_model_experts_forward(m, s, layer, offs, x, n, y), MM_EINVAL);
        offs[1] = keep;
    }
    MM_FAIL(mm_model_experts_forward(m, s, layer, NULL, x, n, y), MM_EINVAL);
    MM_FAIL(mm_model_experts_forward(m, s, layer, offs, x, 33, y), MM_EINVAL); // > max_rows
    free(offs), free(x), free(y), free(want);
    mm_model_scratch_free(s);
    mm_model_close(m);
    be->ops = saved;
    mm_backend_close(be);
}

static void test_fallback(void) { check(false); }
static void test_grouped(void) { check(true); }

MM_TESTS = {
    {"experts_forward == expert_forward bits (per-expert fallback)", test_fallback},
    {"experts_forward == expert_forward bits (grouped moe_matmul path)", test_grouped},
    {NULL, NULL},
};
