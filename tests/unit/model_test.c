// SPDX-License-Identifier: MIT
// The model against transformers (tests/fixtures/models/*: logits of every position within
// 1e-4, 24 greedy tokens equal wherever the top-2 margin exceeds 1e-3), the exactness the mesh
// relies on (decode == full pass, a row alone == the same row in a batch of 7, any thread
// count, any block placement: all bit for bit), and bad checkpoints refused by name.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mm_test.h"
#include "mm/engine.h"
#include "mm/safetensors.h"

#define DIR_OF(name) MM_TEST_DATA("models/" name)

static mm_engine *open_engine(const char *dir, int threads, int max_seqs, int64_t max_rows) {
    mm_engine *e = NULL;
    char err[MM_ERRLEN] = "";
    mm_engine_params p = {.n_threads = threads, .max_seqs = max_seqs, .max_rows = max_rows,
                          .max_ctx = 256};
    mm_err rv = mm_engine_open(&e, dir, &p, err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("open %s: %s (%s)", dir, mm_strerror(rv), err);
    return e;
}

static float *read_f32(const char *path, size_t n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        MM_TEST_FAIL_("cannot open %s", path);
    float *b = malloc(n * 4);
    MM_EQ(fread(b, 4, n, f), n);
    fclose(f);
    return b;
}

static int32_t *json_ids(const json_t *arr, size_t *n) {
    *n = json_array_size(arr);
    int32_t *ids = malloc(*n * 4 + 4);
    for (size_t i = 0; i < *n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    return ids;
}

// ---- transformers agreement ------------------------------------------------------------------
static void check_fixture(const char *name) {
    char dir[256], path[512], err[MM_ERRLEN] = "";
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    snprintf(path, sizeof path, "%s/reference.json", dir);
    json_error_t je;
    json_t *ref = json_load_file(path, 0, &je);
    MM_TRUE(ref != NULL);
    mm_engine *e = open_engine(dir, 0, 2, 64); // 64-row chunks: prompts of 61 take 1 chunk,
    const int V = mm_model_cfg(e->model)->vocab; // longer ones would take several
    double worst = 0;
    int compared = 0, ties = 0;
    size_t i;
    json_t *p;
    json_array_foreach(json_object_get(ref, "prompts"), i, p) {
        size_t n;
        int32_t *ids = json_ids(json_object_get(p, "ids"), &n);
        snprintf(path, sizeof path, "%s/%s", dir,
                 json_string_value(json_object_get(p, "logits_file")));
        float *want = read_f32(path, n * V), *got = malloc(n * V * 4);
        int32_t seq;
        MM_PASS(mm_kv_cache_seq_new(e->kv, &seq));
        MM_PASS(mm_engine_prefill(e, seq, ids, (int64_t)n, got, NULL, err));
        mm_kv_cache_seq_free(e->kv, seq);
        for (size_t k = 0; k < n * V; k++) {
            double d = fabs((double)got[k] - want[k]);
            if (!(d <= 1e-4))
                MM_TEST_FAIL_("%s prompt %zu position %zu token %zu: logit %.7g, transformers "
                              "%.7g", name, i, k / V, k % V, got[k], want[k]);
            worst = d > worst ? d : worst;
        }
        size_t ng;
        int32_t *greedy = json_ids(json_object_get(p, "greedy"), &ng);
        const json_t *margin = json_object_get(p, "top2_margin");
        int32_t out[64];
        int n_out = 0;
        MM_PASS(mm_engine_generate(e, ids, (int64_t)n, (int)ng, -1, out, &n_out, NULL, err));
        MM_EQ(n_out, ng);
        for (size_t t = 0; t < ng; t++) {
            if (out[t] == greedy[t]) {
                compared++;
                continue;
            }
            if (json_real_value(json_array_get(margin, t)) > 1e-3)
                MM_TEST_FAIL_("%s prompt %zu greedy step %zu: %d, transformers %d (margin %g)",
                              name, i, t, out[t], greedy[t],
                              json_real_value(json_array_get(margin, t)));
            ties++; // a near tie: the continuations may part here; stop comparing
            break;
        }
        free(greedy);
        free(want);
        free(got);
        free(ids);
    }
    printf("%s: max |dlogit| %.3g over %zu prompts; %d greedy tokens equal, %d near ties\n",
           name, worst, json_array_size(json_object_get(ref, "prompts")), compared, ties);
    mm_engine_close(e);
    json_decref(ref);
}

#define FIXTURE_TEST(fn, name) \
    static void fn(void) { check_fixture(name); }
FIXTURE_TEST(t_qwen3moe, "qwen3moe-tiny")
FIXTURE_TEST(t_mixtral, "mixtral-tiny")
FIXTURE_TEST(t_deepseek, "deepseekv3-tiny")
FIXTURE_TEST(t_qwen3, "qwen3-tiny-drafter")
FIXTURE_TEST(t_qwen2moe, "qwen2moe-tiny")
FIXTURE_TEST(t_glm4moe, "glm4moe-tiny")
FIXTURE_TEST(t_qwen3moe_var, "qwen3moe-var")
FIXTURE_TEST(t_mixtral_var, "mixtral-var")
FIXTURE_TEST(t_deepseek_var, "deepseekv3-var")
FIXTURE_TEST(t_qwen3_var, "qwen3-var")

// ---- exactness -------------------------------------------------------------------------------
static int32_t *prompt_ids(const char *name, int idx, size_t *n) {
    char path[512];
    snprintf(path, sizeof path, "tests/fixtures/models/%s/reference.json", name);
    json_error_t je;
    json_t *ref = json_load_file(path, 0, &je);
    MM_TRUE(ref != NULL);
    int32_t *ids = json_ids(
        json_object_get(json_array_get(json_object_get(ref, "prompts"), (size_t)idx), "ids"), n);
    json_decref(ref);
    return ids;
}

// Decoding token by token with the KV cache gives the full pass's logits, bit for bit.
static void decode_equals_full(const char *name) {
    char dir[256], err[MM_ERRLEN] = "";
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    size_t n;
    int32_t *ids = prompt_ids(name, 3, &n);
    mm_engine *e = open_engine(dir, 0, 2, 256);
    const int V = mm_model_cfg(e->model)->vocab;
    float *full = malloc(n * V * 4), *step = malloc(n * V * 4);
    int32_t a, b;
    MM_PASS(mm_kv_cache_seq_new(e->kv, &a));
    MM_PASS(mm_engine_prefill(e, a, ids, (int64_t)n, full, NULL, err));
    MM_PASS(mm_kv_cache_seq_new(e->kv, &b));
    for (size_t t = 0; t < n; t++)
        MM_PASS(mm_engine_prefill(e, b, ids + t, 1, step + t * V, NULL, err));
    for (size_t t = 0; t < n; t++)
        if (memcmp(full + t * V, step + t * V, (size_t)V * 4) != 0)
            MM_TEST_FAIL_("%s: position %zu differs between full pass and decode", name, t);
    free(full);
    free(step);
    free(ids);
    mm_engine_close(e);
}
static void t_decode_full_qwen(void) { decode_equals_full("qwen3moe-tiny"); }
static void t_decode_full_mla(void) { decode_equals_full("deepseekv3-tiny"); }
static void t_decode_full_glm(void) { decode_equals_full("glm4moe-tiny"); }

// A sequence computed alone equals the same sequence computed inside a 7-sequence batch
// (mixed with other sequences' rows in the same calls, its KV in other blocks), bit for bit;
// the decode step too.
static void batch_invariance(const char *name) {
    char dir[256], err[MM_ERRLEN] = "";
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    mm_engine *e = open_engine(dir, 0, 8, 256);
    const int V = mm_model_cfg(e->model)->vocab;
    size_t n;
    int32_t *p = prompt_ids(name, 0, &n); // 10 tokens
    // alone: prefill then one decode step
    float *alone = malloc((n + 1) * V * 4);
    int32_t s0;
    MM_PASS(mm_kv_cache_seq_new(e->kv, &s0));
    MM_PASS(mm_engine_prefill(e, s0, p, (int64_t)n, alone, NULL, err));
    int32_t next = 7;
    MM_PASS(mm_engine_prefill(e, s0, &next, 1, alone + n * V, NULL, err));
    // batch: 7 sequences; sequence 3 has the same prompt; rows interleaved across sequences
    int32_t seqs[7], rseq[256], rpos[256], rids[256];
    int64_t nr = 0, mine[16];
    int nm = 0;
    for (int s = 0; s < 7; s++) {
        MM_PASS(mm_kv_cache_seq_new(e->kv, &seqs[s]));
        MM_PASS(mm_kv_cache_reserve(e->kv, seqs[s], (int32_t)n + 1));
    }
    for (size_t t = 0; t < n; t++) {
        for (int s = 0; s < 7; s++) {
            rseq[nr] = seqs[s];
            rpos[nr] = (int32_t)t;
            rids[nr] = s == 3 ? p[t] : (int32_t)((p[t] * 31 + s * 17 + t) % V);
            if (s == 3)
                mine[nm++] = nr;
            nr++;
        }
    }
    float *logits = malloc((size_t)nr * V * 4);
    mm_model_rows rows = {.n_rows = nr, .seq = rseq, .pos = rpos};
    MM_PASS(mm_model_forward(e->model, e->scratch, e->kv, &rows, rids, NULL, e->logits));
    memcpy(logits, e->logits, (size_t)nr * V * 4);
    for (int k = 0; k < nm; k++)
        if (memcmp(logits + mine[k] * V, alone + k * V, (size_t)V * 4) != 0)
            MM_TEST_FAIL_("%s: prefill row %d differs alone vs in a batch of 7", name, k);
    // decode: 7 rows, one per sequence
    nr = 0;
    for (int s = 0; s < 7; s++) {
        rseq[nr] = seqs[s];
        rpos[nr] = (int32_t)n;
        rids[nr] = s == 3 ? next : (int32_t)(s * 13 + 1);
        nr++;
    }
    rows.n_rows = nr;
    MM_PASS(mm_model_forward(e->model, e->scratch, e->kv, &rows, rids, NULL, e->logits));
    if (memcmp(e->logits + 3 * V, alone + n * V, (size_t)V * 4) != 0)
        MM_TEST_FAIL_("%s: decode row differs alone vs in a batch of 7", name);
    free(logits);
    free(alone);
    free(p);
    mm_engine_close(e);
}
static void t_batch_qwen(void) { batch_invariance("qwen3moe-tiny"); }
static void t_batch_mla(void) { batch_invariance("deepseekv3-var"); }
static void t_batch_qwen2(void) { batch_invariance("qwen2moe-tiny"); }

// Stage level: an expert on one row == the same row among 7; gate likewise.
static void t_stage_rows(void) {
    mm_engine *e = open_engine(DIR_OF("qwen3moe-tiny"), 0, 1, 16);
    const mm_model_config *c = mm_model_cfg(e->model);
    const int D = c->d_model, K = c->top_k;
    float x[7 * 64], one[64], y7[7 * 64], y1[64];
    for (int i = 0; i < 7 * D; i++)
        x[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
    memcpy(one, x + 3 * D, (size_t)D * 4);
    MM_PASS(mm_model_expert_forward(e->model, e->scratch, 1, 5, x, 7, y7));
    MM_PASS(mm_model_expert_forward(e->model, e->scratch, 1, 5, one, 1, y1));
    MM_TRUE(memcmp(y7 + 3 * D, y1, (size_t)D * 4) == 0);
    int32_t ids7[7 * 8], ids1[8];
    float w7[7 * 8], w1[8];
    MM_PASS(mm_model_gate(e->model, e->scratch, 1, x, 7, ids7, w7));
    MM_PASS(mm_model_gate(e->model, e->scratch, 1, one, 1, ids1, w1));
    MM_TRUE(memcmp(ids7 + 3 * K, ids1, (size_t)K * 4) == 0);
    MM_TRUE(memcmp(w7 + 3 * K, w1, (size_t)K * 4) == 0);
    MM_FAIL(mm_model_expert_forward(e->model, e->scratch, 1, c->n_experts, one, 1, y1),
            MM_EINVAL);
    MM_FAIL(mm_model_expert_forward(e->model, e->scratch, 1, 0, x, 17, y1), MM_EINVAL);
    mm_engine_close(e);
}

// 1 thread and 3 threads give the same bits.
static void t_threads(void) {
    char err[MM_ERRLEN] = "";
    size_t n;
    int32_t *p = prompt_ids("deepseekv3-tiny", 4, &n);
    float *a = NULL, *b = NULL;
    for (int k = 0; k < 2; k++) {
        mm_engine *e = open_engine(DIR_OF("deepseekv3-tiny"), k ? 3 : 1, 1, 64);
        const int V = mm_model_cfg(e->model)->vocab;
        float *l = malloc(n * V * 4);
        int32_t s;
        MM_PASS(mm_kv_cache_seq_new(e->kv, &s));
        MM_PASS(mm_engine_prefill(e, s, p, (int64_t)n, l, NULL, err));
        if (k) {
            b = l;
            MM_TRUE(memcmp(a, b, n * V * 4) == 0);
        } else {
            a = l;
        }
        mm_engine_close(e);
    }
    free(a);
    free(b);
    free(p);
}

// ---- KV cache --------------------------------------------------------------------------------
static void t_kv_cache(void) {
    mm_backend *be = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_backend_open(&be, "cpu", NULL, err));
    mm_kv_params p = {.n_layers = 2, .n_kv_heads = 1, .head_dim_k = 4, .head_dim_v = 4,
                      .block_size = 4, .max_seqs = 3, .max_ctx = 32};
    p.budget_bytes = 5 * (size_t)(2 * 4 * 8 * 4); // 5 blocks
    mm_kv_cache *kv = NULL;
    MM_PASS(mm_kv_cache_new(&kv, &p, be, err));
    MM_EQ(mm_kv_cache_blocks_total(kv), 5);
    int32_t a, b;
    MM_PASS(mm_kv_cache_seq_new(kv, &a));
    MM_PASS(mm_kv_cache_seq_new(kv, &b));
    MM_PASS(mm_kv_cache_reserve(kv, a, 9)); // 3 blocks
    MM_EQ(mm_kv_cache_blocks_free(kv), 2);
    MM_FAIL(mm_kv_cache_reserve(kv, b, 12), MM_EFULL);
    MM_EQ(mm_kv_cache_blocks_free(kv), 2); // nothing taken on failure
    MM_FAIL(mm_kv_cache_reserve(kv, b, 33), MM_EINVAL);
    mm_kv_cache_truncate(kv, a, 4);
    MM_EQ(mm_kv_cache_blocks_free(kv), 4);
    MM_EQ(mm_kv_cache_seq_len(kv, a), 4);
    mm_kv_cache_seq_free(kv, a);
    MM_EQ(mm_kv_cache_blocks_free(kv), 5);
    MM_PASS(mm_kv_cache_reserve(kv, b, 20));
    MM_EQ(mm_kv_cache_blocks_free(kv), 0);
    struct mm_kv_view v;
    mm_kv_cache_view(kv, 1, &v);
    MM_EQ(v.slot_stride, 8);
    MM_EQ(v.block_stride, 2 * 4 * 8);
    mm_kv_cache_free(kv);
    p.budget_bytes = 10;
    MM_FAIL(mm_kv_cache_new(&kv, &p, be, err), MM_EINVAL);
    mm_backend_close(be);
}

// ---- bad checkpoints -------------------------------------------------------------------------
static char tmpdir[256];

static void copy_file(const char *src, const char *dst, long truncate_by) {
    FILE *f = fopen(src, "rb");
    MM_TRUE(f != NULL);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n);
    MM_EQ(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    f = fopen(dst, "wb");
    MM_TRUE(f != NULL);
    fwrite(b, 1, (size_t)(n - truncate_by), f);
    fclose(f);
    free(b);
}

static void setup_bad(const char *model) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/mm-model-test.XXXXXX");
    MM_TRUE(mkdtemp(tmpdir) != NULL);
    char s[512], d[512];
    snprintf(s, sizeof s, "tests/fixtures/models/%s/config.json", model);
    snprintf(d, sizeof d, "%s/config.json", tmpdir);
    copy_file(s, d, 0);
    snprintf(s, sizeof s, "tests/fixtures/models/%s/model.safetensors", model);
    snprintf(d, sizeof d, "%s/model.safetensors", tmpdir);
    copy_file(s, d, 0);
}

static void cleanup_bad(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", tmpdir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", tmpdir);
    unlink(p);
    rmdir(tmpdir);
}

static void expect_refused(mm_err code, const char *needle1, const char *needle2) {
    mm_backend *be = NULL;
    mm_model *m = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_backend_open(&be, "cpu", NULL, err));
    MM_FAIL(mm_model_open(&m, tmpdir, be, err), code);
    MM_NULL(m);
    if (!strstr(err, needle1) || (needle2 && !strstr(err, needle2)))
        MM_TEST_FAIL_("message '%s' should name '%s'%s%s", err, needle1, needle2 ? " and " : "",
                      needle2 ? needle2 : "");
    printf("refused: %s\n", err);
    mm_backend_close(be);
}

static void edit_config(const char *key, json_t *value) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", tmpdir);
    json_error_t je;
    json_t *j = json_load_file(p, 0, &je);
    MM_TRUE(j != NULL);
    json_object_set_new(j, key, value);
    MM_EQ(json_dump_file(j, p, JSON_INDENT(1)), 0);
    json_decref(j);
}

static void t_bad_arch(void) {
    setup_bad("qwen3moe-tiny");
    edit_config("model_type", json_string("llama4_text"));
    expect_refused(MM_EUNSUPP, "llama4_text", "config.json");
    edit_config("model_type", json_string("qwen3_moe"));
    edit_config("hidden_act", json_string("gelu"));
    expect_refused(MM_EUNSUPP, "gelu", NULL);
    edit_config("hidden_act", json_string("silu"));
    edit_config("rope_scaling", json_pack("{s:s,s:f}", "rope_type", "dynamic", "factor", 2.0));
    expect_refused(MM_EUNSUPP, "dynamic", NULL);
    edit_config("rope_scaling", json_null());
    edit_config("quantization_config", json_pack("{s:s}", "quant_method", "fp8"));
    expect_refused(MM_EUNSUPP, "quantization_config", NULL);
    edit_config("quantization_config", json_null());
    edit_config("num_hidden_layers", json_string("four"));
    expect_refused(MM_EFORMAT, "num_hidden_layers", NULL);
    cleanup_bad();
}

static void t_bad_header(void) {
    setup_bad("mixtral-tiny");
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors", tmpdir);
    FILE *f = fopen(p, "r+b");
    fseek(f, 40, SEEK_SET);
    fwrite("}}}garbage{{{", 1, 13, f);
    fclose(f);
    expect_refused(MM_EFORMAT, "model.safetensors", "header");
    cleanup_bad();
}

static void t_truncated(void) {
    setup_bad("deepseekv3-tiny");
    char s[512], d[512];
    snprintf(s, sizeof s, "tests/fixtures/models/deepseekv3-tiny/model.safetensors");
    snprintf(d, sizeof d, "%s/model.safetensors", tmpdir);
    copy_file(s, d, 1000);
    expect_refused(MM_EFORMAT, "truncated", "model.safetensors");
    cleanup_bad();
}

// Rewrite the checkpoint with one tensor dropped or reshaped.
static void rewrite(const char *drop, const char *reshape) {
    char p[512], err[MM_ERRLEN] = "";
    snprintf(p, sizeof p, "%s/model.safetensors", tmpdir);
    mm_safetensors *st = NULL;
    MM_PASS(mm_safetensors_open(&st, p, err));
    size_t n = mm_safetensors_count(st), k = 0;
    mm_st_entry *e = calloc(n, sizeof(*e));
    char **copies = calloc(n, sizeof(char *));
    for (size_t i = 0; i < n; i++) {
        const mm_st_tensor *t = mm_safetensors_at(st, i);
        if (drop && strcmp(t->name, drop) == 0)
            continue;
        copies[k] = malloc(t->n_bytes + 1);
        memcpy(copies[k], t->data, t->n_bytes);
        e[k] = (mm_st_entry){.name = strdup(t->name), .dtype = t->dtype, .n_dims = t->n_dims,
                             .data = copies[k]};
        memcpy(e[k].shape, t->shape, sizeof t->shape);
        if (reshape && strcmp(t->name, reshape) == 0) { // same bytes, transposed shape
            e[k].shape[0] = t->shape[1];
            e[k].shape[1] = t->shape[0];
        }
        k++;
    }
    mm_safetensors_close(st);
    MM_PASS(mm_safetensors_write(p, e, k, NULL, NULL, err));
    for (size_t i = 0; i < k; i++) {
        free((char *)e[i].name);
        free(copies[i]);
    }
    free(copies);
    free(e);
}

static void t_missing_tensor(void) {
    setup_bad("qwen2moe-tiny");
    rewrite("model.layers.1.mlp.experts.3.up_proj.weight", NULL);
    expect_refused(MM_ENOENT, "model.layers.1.mlp.experts.3.up_proj.weight", NULL);
    cleanup_bad();
    setup_bad("glm4moe-tiny");
    rewrite("model.layers.2.self_attn.k_proj.bias", NULL);
    expect_refused(MM_ENOENT, "model.layers.2.self_attn.k_proj.bias", NULL);
    cleanup_bad();
}

static void t_wrong_shape(void) {
    setup_bad("deepseekv3-tiny");
    rewrite(NULL, "model.layers.1.self_attn.kv_b_proj.weight");
    expect_refused(MM_EFORMAT, "model.layers.1.self_attn.kv_b_proj.weight", "[32,128]");
    cleanup_bad();
}

static void t_missing_config(void) {
    mm_backend *be = NULL;
    mm_model *m = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_backend_open(&be, "cpu", NULL, err));
    MM_FAIL(mm_model_open(&m, "/nonexistent/model", be, err), MM_ENOENT);
    MM_TRUE(strstr(err, "/nonexistent/model/config.json") != NULL);
    mm_backend_close(be);
}

MM_TESTS = {
    {"model qwen3moe-tiny vs transformers", t_qwen3moe},
    {"model mixtral-tiny vs transformers", t_mixtral},
    {"model deepseekv3-tiny vs transformers", t_deepseek},
    {"model qwen3-tiny-drafter vs transformers", t_qwen3},
    {"model qwen2moe-tiny vs transformers", t_qwen2moe},
    {"model glm4moe-tiny vs transformers", t_glm4moe},
    {"model qwen3moe-var vs transformers", t_qwen3moe_var},
    {"model mixtral-var vs transformers", t_mixtral_var},
    {"model deepseekv3-var vs transformers", t_deepseek_var},
    {"model qwen3-var vs transformers", t_qwen3_var},
    {"model decode == full pass bits (qwen3_moe)", t_decode_full_qwen},
    {"model decode == full pass bits (MLA)", t_decode_full_mla},
    {"model decode == full pass bits (glm4_moe)", t_decode_full_glm},
    {"model batch of 7 == alone bits (qwen3_moe)", t_batch_qwen},
    {"model batch of 7 == alone bits (MLA)", t_batch_mla},
    {"model batch of 7 == alone bits (qwen2_moe)", t_batch_qwen2},
    {"model stages: expert and gate row alone == in 7", t_stage_rows},
    {"model 1 thread == 3 threads bits", t_threads},
    {"kv cache pool accounting", t_kv_cache},
    {"model refuses unknown architecture and options", t_bad_arch},
    {"model refuses corrupt header", t_bad_header},
    {"model refuses truncated data", t_truncated},
    {"model refuses missing tensor", t_missing_tensor},
    {"model refuses wrong shape", t_wrong_shape},
    {"model refuses missing config", t_missing_config},
    {NULL, NULL},
};
