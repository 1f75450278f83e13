// SPDX-License-Identifier: MIT
// `moemesh synth`: write a synthetic checkpoint in Hugging Face layout (config.json, sharded
// safetensors with model.safetensors.index.json, a tokenizer copied from a fixture) with
// deterministic random bf16 weights, in the shape of a real model with fewer layers. For
// benchmarks and load tests; the weights mean nothing. --residual-scale S --residual-from L
// multiplies the output projections (o_proj, down_proj) of layers >= L by S: the later layers then
// add little to the residual stream, so the target's first L layers (a layer-skip draft model)
// agree with it often, a stand-in for a trained draft model when none can be downloaded.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/safetensors.h"

struct shape {
    const char *family, *name;
    int vocab, d_model, n_heads, n_kv_heads, head_dim, d_ff, n_experts, top_k, d_ff_expert;
    double rope_theta;
    int max_pos;
};

static const struct shape shapes[] = {
    {"qwen3_moe", "qwen3-30b-a3b", 151936, 2048, 32, 4, 128, 6144, 128, 8, 768, 1e6, 40960},
    {"qwen3_moe", "qwen3-235b-a22b", 151936, 4096, 64, 4, 128, 12288, 128, 8, 1536, 1e6, 40960},
    {"qwen3_moe", "tiny", 512, 64, 4, 2, 16, 128, 16, 4, 32, 1e4, 512},
    {"mixtral", "mixtral-8x7b", 32000, 4096, 32, 8, 128, 14336, 8, 2, 14336, 1e6, 32768},
    {"mixtral", "tiny", 512, 64, 4, 2, 16, 96, 8, 2, 96, 1e6, 512},
    // dense (draft models for the MoE shapes of the same vocabulary): d_ff is the MLP's
    {"qwen3", "qwen3-0.6b", 151936, 1024, 16, 8, 128, 3072, 0, 0, 0, 1e6, 40960},
    {"qwen3", "tiny", 512, 64, 4, 2, 16, 128, 0, 0, 0, 1e4, 512},
};

// ---- deterministic weights: a counter-based hash, so any byte range can be made alone --------
struct gen {
    uint64_t seed;
    const mm_st_entry *e;
    const uint8_t *is_norm; // per entry: 1 = RMSNorm weight (ones)
    const float *scale;     // per entry: factor on the random values (--residual-scale)
};

static inline uint64_t mix64(uint64_t x) { // splitmix64 finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void fill(void *arg, size_t i, size_t offset, void *buf, size_t n_bytes) {
    const struct gen *g = arg;
    uint16_t *o = buf;
    size_t n = n_bytes / 2, first = offset / 2;
    if (g->is_norm[i]) {
        for (size_t k = 0; k < n; k++)
            o[k] = 0x3f80; // 1.0
        return;
    }
    const uint64_t key = mix64(g->seed ^ ((uint64_t)i << 40));
    // uniform in [-0.0346, 0.0346]: std 0.02, as initializer_range
    const float scale = 0.0346f / 32768.0f * g->scale[i];
    for (size_t k = 0; k < n; k++) {
        size_t idx = first + k;
        uint64_t h = mix64(key + (idx >> 2));
        int v = (int)(int16_t)(h >> (16 * (idx & 3)));
        o[k] = f2bf((float)v * scale);
    }
}

// The entries being listed: names and shapes, and per entry how fill() makes its values.
struct ents {
    mm_st_entry *e;
    uint8_t *norm;   // 1 = RMSNorm weight (ones)
    float *scale;    // factor on the random values
    int n;
    float out_scale; // scale of the output projections of the layer being listed
};

static int add(struct ents *t, const char *name, int64_t r, int64_t c, int is_norm) {
    mm_st_entry *e = &t->e[t->n];
    *e = (mm_st_entry){.name = strdup(name), .dtype = MM_DTYPE_BF16, .n_dims = r ? 2 : 1};
    if (r) {
        e->shape[0] = r;
        e->shape[1] = c;
    } else {
        e->shape[0] = c;
    }
    size_t len = strlen(name);
    bool out_proj = (len > 14 && strcmp(name + len - 14, ".o_proj.weight") == 0) ||
                    (len > 17 && strcmp(name + len - 17, ".down_proj.weight") == 0) ||
                    (len > 10 && strcmp(name + len - 10, ".w2.weight") == 0);
    t->norm[t->n] = (uint8_t)is_norm;
    t->scale[t->n] = out_proj ? t->out_scale : 1.0f;
    return t->n++;
}

static mm_err copy_file(const char *src, const char *dst, char *err) {
    FILE *a = fopen(src, "rb");
    if (!a)
        return mm_errf(err, MM_ENOENT, "%s: %s", src, strerror(errno));
    FILE *b = fopen(dst, "wb");
    if (!b) {
        fclose(a);
        return mm_errf(err, MM_ESYS, "%s: %s", dst, strerror(errno));
    }
    char buf[65536];
    size_t r;
    while ((r = fread(buf, 1, sizeof buf, a)) > 0)
        fwrite(buf, 1, r, b);
    fclose(a);
    return fclose(b) == 0 ? MM_OK : mm_errf(err, MM_ESYS, "%s: %s", dst, strerror(errno));
}

static mm_err write_config(const char *dir, const struct shape *s, int layers, char *err) {
    json_t *j;
    if (strcmp(s->family, "qwen3_moe") == 0)
        j = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:b, s:i,"
                      " s:[], s:f, s:f, s:s, s:i, s:b, s:b, s:s}",
                      "architectures", "Qwen3MoeForCausalLM", "model_type", "qwen3_moe",
                      "vocab_size", s->vocab, "hidden_size", s->d_model, "num_hidden_layers",
                      layers, "num_attention_heads", s->n_heads, "num_key_value_heads",
                      s->n_kv_heads, "head_dim", s->head_dim, "intermediate_size", s->d_ff,
                      "num_experts", s->n_experts, "num_experts_per_tok", s->top_k,
                      "moe_intermediate_size", s->d_ff_expert, "norm_topk_prob", 1,
                      "decoder_sparse_step", 1, "mlp_only_layers", "rms_norm_eps", 1e-6,
                      "rope_theta", s->rope_theta, "hidden_act", "silu",
                      "max_position_embeddings", s->max_pos, "tie_word_embeddings", 0,
                      "attention_bias", 0, "torch_dtype", "bfloat16");
    else if (strcmp(s->family, "qwen3") == 0)
        j = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:s, s:i, s:b,"
                      " s:b, s:s}",
                      "architectures", "Qwen3ForCausalLM", "model_type", "qwen3",
                      "vocab_size", s->vocab, "hidden_size", s->d_model, "num_hidden_layers",
                      layers, "num_attention_heads", s->n_heads, "num_key_value_heads",
                      s->n_kv_heads, "head_dim", s->head_dim, "intermediate_size", s->d_ff,
                      "rms_norm_eps", 1e-6, "rope_theta", s->rope_theta, "hidden_act", "silu",
                      "max_position_embeddings", s->max_pos, "tie_word_embeddings", 0,
                      "attention_bias", 0, "torch_dtype", "bfloat16");
    else
        j = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:s,"
                      " s:i, s:b, s:n, s:s}",
                      "architectures", "MixtralForCausalLM", "model_type", "mixtral",
                      "vocab_size", s->vocab, "hidden_size", s->d_model, "num_hidden_layers",
                      layers, "num_attention_heads", s->n_heads, "num_key_value_heads",
                      s->n_kv_heads, "head_dim", s->head_dim, "intermediate_size", s->d_ff,
                      "num_local_experts", s->n_experts, "num_experts_per_tok", s->top_k,
                      "rms_norm_eps", 1e-5, "rope_theta", s->rope_theta, "hidden_act", "silu",
                      "max_position_embeddings", s->max_pos, "tie_word_embeddings", 0,
                      "sliding_window", "torch_dtype", "bfloat16");
    if (!j)
        return mm_errf(err, MM_ENOMEM, "config.json: cannot build");
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    int rc = json_dump_file(j, p, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return rc == 0 ? MM_OK : mm_errf(err, MM_ESYS, "%s: cannot write", p);
}

static int run_synth(int argc, char **argv) {
    char *family = NULL, *shape_name = NULL, *out = NULL, *tok_from = NULL;
    long long layers = 2, seed = 1, res_from = 1;
    double res_scale = 1.0;
    mm_opt opts[] = {
        {"family", MM_OPT_STR, &family, "qwen3_moe", "qwen3_moe, mixtral or qwen3 (dense)"},
        {"shape", MM_OPT_STR, &shape_name, "qwen3-30b-a3b",
         "qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, qwen3-0.6b (qwen3) or tiny"},
        {"layers", MM_OPT_INT, &layers, "2", "decoder layers to write"},
        {"seed", MM_OPT_INT, &seed, "1", "weights seed"},
        {"residual-scale", MM_OPT_DBL, &res_scale, "1",
         "factor on the output projections (o_proj, down_proj) of layers >= --residual-from: "
         "below 1, the first layers decide most tokens (an agreeing layer-skip draft model)"},
        {"residual-from", MM_OPT_INT, &res_from, "1", "first layer --residual-scale applies to"},
        {"out", MM_OPT_STR, &out, NULL, "output directory (created)"},
        {"tokenizer-from", MM_OPT_STR, &tok_from, "tests/fixtures/models/qwen3moe-tiny",
         "directory whose tokenizer.json / tokenizer_config.json are copied"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh synth",
                  .summary = "Write a synthetic HF checkpoint with random bf16 weights.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    struct ents t = {.out_scale = 1.0f};
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "synth: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    const struct shape *s = NULL;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (strcmp(shapes[i].family, family) == 0 && strcmp(shapes[i].name, shape_name) == 0)
            s = &shapes[i];
    if (!s || !out || layers < 1 || layers > 256) {
        fprintf(stderr, "synth: need --out DIR, --layers 1..256 and a known --family/--shape "
                        "(family '%s' shape '%s' unknown)\n", family, shape_name);
        goto done;
    }
    if (!(res_scale > 0 && res_scale <= 1) || res_from < 0) {
        fprintf(stderr, "synth: --residual-scale must be in (0, 1] (got %g) and --residual-from "
                        ">= 0 (got %lld)\n", res_scale, res_from);
        goto done;
    }
    rc = 1;
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "synth: %s: %s\n", out, strerror(errno));
        goto done;
    }
    const bool mix = strcmp(s->family, "mixtral") == 0;
    const bool dense = strcmp(s->family, "qwen3") == 0;
    const int64_t D = s->d_model, H = s->n_heads, KV = s->n_kv_heads, hd = s->head_dim;
    const int64_t E = s->n_experts, F = s->d_ff_expert;
    size_t cap = 8 + (size_t)layers * (size_t)(16 + 3 * E);
    t.e = calloc(cap, sizeof(*t.e));
    t.norm = calloc(cap, 1);
    t.scale = calloc(cap, sizeof(*t.scale));
    if (!t.e || !t.norm || !t.scale) {
        fprintf(stderr, "synth: out of memory\n");
        goto done;
    }
    // shard 0: embeddings, final norm, head; shard l+1: layer l
    int shard_start[258], n_shards = 0;
    shard_start[n_shards++] = t.n;
    add(&t, "model.embed_tokens.weight", s->vocab, D, 0);
    add(&t, "model.norm.weight", 0, D, 1);
    add(&t, "lm_head.weight", s->vocab, D, 0);
    char nm[256];
    for (int l = 0; l < layers; l++) {
        shard_start[n_shards++] = t.n;
        t.out_scale = l >= res_from ? (float)res_scale : 1.0f;
#define L(fmt, ...) (snprintf(nm, sizeof nm, "model.layers.%d." fmt, l, ##__VA_ARGS__), nm)
        add(&t, L("input_layernorm.weight"), 0, D, 1);
        add(&t, L("post_attention_layernorm.weight"), 0, D, 1);
        add(&t, L("self_attn.q_proj.weight"), H * hd, D, 0);
        add(&t, L("self_attn.k_proj.weight"), KV * hd, D, 0);
        add(&t, L("self_attn.v_proj.weight"), KV * hd, D, 0);
        add(&t, L("self_attn.o_proj.weight"), D, H * hd, 0);
        if (!mix) {
            add(&t, L("self_attn.q_norm.weight"), 0, hd, 1);
            add(&t, L("self_attn.k_norm.weight"), 0, hd, 1);
        }
        if (dense) {
            add(&t, L("mlp.gate_proj.weight"), s->d_ff, D, 0);
            add(&t, L("mlp.up_proj.weight"), s->d_ff, D, 0);
            add(&t, L("mlp.down_proj.weight"), D, s->d_ff, 0);
            continue;
        }
        const char *moe = mix ? "block_sparse_moe" : "mlp";
        add(&t, L("%s.gate.weight", moe), E, D, 0);
        for (int64_t x = 0; x < E; x++) {
            add(&t, L("%s.experts.%lld.%s.weight", moe, (long long)x,
                               mix ? "w1" : "gate_proj"), F, D, 0);
            add(&t, L("%s.experts.%lld.%s.weight", moe, (long long)x,
                               mix ? "w3" : "up_proj"), F, D, 0);
            add(&t, L("%s.experts.%lld.%s.weight", moe, (long long)x,
                               mix ? "w2" : "down_proj"), D, F, 0);
        }
#undef L
    }
    shard_start[n_shards] = t.n;
    mm_st_entry *e = t.e;
    struct gen g = {.seed = (uint64_t)seed, .e = e, .is_norm = t.norm, .scale = t.scale};
    json_t *wm = json_object();
    double total = 0;
    for (int sh = 0; sh < n_shards; sh++) {
        char fname[64], path[4096];
        snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", sh + 1, n_shards);
        snprintf(path, sizeof path, "%s/%s", out, fname);
        struct gen gs = g;
        gs.e = e + shard_start[sh];
        gs.is_norm = t.norm + shard_start[sh];
        gs.scale = t.scale + shard_start[sh];
        // fill() indexes entries from the shard's first one; offset the seed by it so weights
        // do not depend on how the checkpoint is sharded
        gs.seed = g.seed + (uint64_t)shard_start[sh] * 0x1000193ull;
        if (mm_safetensors_write(path, e + shard_start[sh], (size_t)(shard_start[sh + 1] -
                                 shard_start[sh]), fill, &gs, err) != MM_OK) {
            fprintf(stderr, "synth: %s\n", err);
            json_decref(wm);
            goto done;
        }
        for (int i = shard_start[sh]; i < shard_start[sh + 1]; i++) {
            json_object_set_new(wm, e[i].name, json_string(fname));
            total += (double)e[i].shape[0] * (e[i].n_dims > 1 ? (double)e[i].shape[1] : 1) * 2;
        }
        fprintf(stderr, "synth: wrote %s\n", path);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    json_t *idx = json_pack("{s:{s:f}, s:o}", "metadata", "total_size", total, "weight_map", wm);
    if (!idx || json_dump_file(idx, path, JSON_INDENT(1)) != 0) {
        fprintf(stderr, "synth: %s: cannot write\n", path);
        json_decref(idx);
        goto done;
    }
    json_decref(idx);
    if (write_config(out, s, (int)layers, err) != MM_OK) {
        fprintf(stderr, "synth: %s\n", err);
        goto done;
    }
    const char *tf[] = {"tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        char a[4096], b[4096];
        snprintf(a, sizeof a, "%s/%s", tok_from, tf[i]);
        snprintf(b, sizeof b, "%s/%s", out, tf[i]);
        if (copy_file(a, b, err) != MM_OK)
            fprintf(stderr, "synth: warning: no tokenizer copied: %s\n", err);
    }
    printf("%s: %s %s, %lld layers, %.2f GB of bf16 weights in %d shards", out, s->family,
           s->name, layers, total / 1e9, n_shards);
    if (res_scale != 1.0 && res_from < layers)
        printf(", output projections of layers %lld.. scaled by %g", res_from, res_scale);
    printf("\n");
    rc = 0;
done:
    for (int i = 0; i < t.n; i++)
        free((char *)t.e[i].name);
    free(t.e);
    free(t.norm);
    free(t.scale);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_synth, "synth", "write a synthetic checkpoint (HF layout, random bf16)", run_synth)
