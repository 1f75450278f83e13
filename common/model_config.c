// SPDX-License-Identifier: MIT
// config.json readers for the supported families; see mm/model.h. Defaults are those of the
// transformers 5.17 configuration classes, so a checkpoint's config means what it means there.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mm/json.h"
#include "mm/model.h"

#define WHAT "config.json"

static const struct {
    const char *model_type;
    enum mm_arch arch;
} archs[] = {
    {"qwen3_moe", MM_ARCH_QWEN3_MOE}, {"qwen2_moe", MM_ARCH_QWEN2_MOE},
    {"mixtral", MM_ARCH_MIXTRAL},     {"deepseek_v3", MM_ARCH_DEEPSEEK_V3},
    {"glm4_moe", MM_ARCH_GLM4_MOE},   {"qwen3", MM_ARCH_QWEN3},
    {"qwen2", MM_ARCH_QWEN2},
};

struct rd {
    const json_t *j;
    const char *path;
    char *err;
};

static mm_err geti(struct rd *r, const char *key, long long def, bool required, int *out) {
    long long v = 0;
    mm_err rv = required ? mm_json_get_int(r->j, key, r->path, &v, r->err)
                         : mm_json_get_int_or(r->j, key, r->path, def, &v, r->err);
    if (rv == MM_ENOENT)
        return mm_errf(r->err, MM_EFORMAT, "%s: missing '%s'", r->path, key);
    if (rv != MM_OK)
        return MM_EFORMAT;
    if (v < 0 || v > (1 << 30))
        return mm_errf(r->err, MM_EFORMAT, "%s: '%s' = %lld is out of range", r->path, key, v);
    *out = (int)v;
    return MM_OK;
}

static mm_err getf(struct rd *r, const json_t *obj, const char *key, double def, double *out) {
    if (mm_json_get_num_or(obj, key, r->path, def, out, r->err) != MM_OK)
        return MM_EFORMAT;
    return MM_OK;
}

static mm_err getb(struct rd *r, const char *key, bool def, bool *out) {
    if (mm_json_get_bool_or(r->j, key, r->path, def, out, r->err) != MM_OK)
        return MM_EFORMAT;
    return MM_OK;
}

// yarn helpers, as transformers' _compute_yarn_parameters
static double yarn_mscale(double scale, double mscale) {
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}
static double yarn_corr_dim(double n_rot, int dim, double base, double max_pos) {
    return (dim * log(max_pos / (n_rot * 2 * M_PI))) / (2 * log(base));
}

static mm_err read_rope(struct rd *r, mm_model_config *c, int head_dim_for_rope,
                        double partial_default) {
    const json_t *rp = json_object_get(r->j, "rope_parameters");
    if (!json_is_object(rp))
        rp = json_object_get(r->j, "rope_scaling");
    if (rp && !json_is_null(rp) && !json_is_object(rp))
        return mm_errf(r->err, MM_EFORMAT, "%s: 'rope_scaling' must be an object or null",
                       r->path);
    if (json_is_null(rp))
        rp = NULL;
    double theta = 10000.0, partial = partial_default;
    MM_TRY(getf(r, r->j, "rope_theta", 10000.0, &theta));
    MM_TRY(getf(r, r->j, "partial_rotary_factor", partial, &partial));
    const char *type = "default";
    if (rp) {
        MM_TRY(getf(r, rp, "rope_theta", theta, &theta));
        MM_TRY(getf(r, rp, "partial_rotary_factor", partial, &partial));
        const json_t *t = json_object_get(rp, "rope_type");
        if (!json_is_string(t))
            t = json_object_get(rp, "type");
        if (json_is_string(t))
            type = json_string_value(t);
    }
    int dim = (int)(head_dim_for_rope * partial);
    if (dim <= 0 || dim % 2 || dim / 2 > 256)
        return mm_errf(r->err, MM_EUNSUPP, "%s: rotary dim %d (head_dim %d x %g) unsupported",
                       r->path, dim, head_dim_for_rope, partial);
    c->rot_dim = dim;
    c->rope_theta = (float)theta;
    c->rope_mscale = 1.0f;
    const int half = dim / 2;
    for (int i = 0; i < half; i++) // torch: 1 / base ** (arange(0, dim, 2).float() / dim), f32
        c->inv_freq[i] = 1.0f / powf((float)theta, (float)(2 * i) / (float)dim);
    if (strcmp(type, "default") == 0)
        return MM_OK;
    double factor = 0;
    if (strcmp(type, "linear") == 0) {
        MM_TRY(getf(r, rp, "factor", 0, &factor));
        if (factor <= 0)
            return mm_errf(r->err, MM_EFORMAT, "%s: linear rope needs 'factor' > 0", r->path);
        for (int i = 0; i < half; i++)
            c->inv_freq[i] = c->inv_freq[i] / (float)factor;
        return MM_OK;
    }
    if (strcmp(type, "yarn") == 0) {
        double orig = 0, attn_factor = -1, mscale = 0, mscale_all = 0, bf = 0, bs = 0;
        MM_TRY(getf(r, rp, "original_max_position_embeddings", c->max_pos, &orig));
        MM_TRY(getf(r, rp, "factor", 0, &factor));
        if (factor <= 0)
            factor = c->max_pos / orig;
        MM_TRY(getf(r, rp, "attention_factor", -1, &attn_factor));
        MM_TRY(getf(r, rp, "mscale", 0, &mscale));
        MM_TRY(getf(r, rp, "mscale_all_dim", 0, &mscale_all));
        MM_TRY(getf(r, rp, "beta_fast", 0, &bf));
        MM_TRY(getf(r, rp, "beta_slow", 0, &bs));
        bool truncate = true;
        const json_t *tr = json_object_get(rp, "truncate");
        if (json_is_boolean(tr))
            truncate = json_is_true(tr);
        if (bf == 0)
            bf = 32;
        if (bs == 0)
            bs = 1;
        if (attn_factor < 0) {
            if (mscale != 0 && mscale_all != 0)
                attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all);
            else
                attn_factor = yarn_mscale(factor, 1.0);
        }
        double low = yarn_corr_dim(bf, dim, theta, orig), high = yarn_corr_dim(bs, dim, theta, orig);
        if (truncate) {
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0)
            low = 0;
        if (high > dim - 1)
            high = dim - 1;
        if (low == high)
            high += 0.001;
        for (int i = 0; i < half; i++) {
            float pos_freq = powf((float)theta, (float)(2 * i) / (float)dim);
            float extra = 1.0f / pos_freq, inter = 1.0f / ((float)factor * pos_freq);
            float ramp = ((float)i - (float)low) / (float)(high - low);
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            float ext_f = 1.0f - ramp;
            c->inv_freq[i] = inter * (1.0f - ext_f) + extra * ext_f;
        }
        c->rope_mscale = (float)attn_factor;
        return MM_OK;
    }
    return mm_errf(r->err, MM_EUNSUPP, "%s: rope_type '%s' is not supported (default, linear, yarn)",
                   r->path, type);
}

static bool in_list(const json_t *arr, int v) {
    size_t i;
    const json_t *e;
    json_array_foreach(arr, i, e) {
        if (json_is_integer(e) && json_integer_value(e) == v)
            return true;
    }
    return false;
}

static mm_err read_cfg(struct rd *r, mm_model_config *c) {
    const char *mt = NULL;
    if (mm_json_get_str(r->j, "model_type", r->path, &mt, r->err) != MM_OK)
        return mm_errf(r->err, MM_EFORMAT, "%s: missing 'model_type'", r->path);
    bool found = false;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) {
        if (strcmp(mt, archs[i].model_type) == 0) {
            c->arch = archs[i].arch;
            found = true;
        }
    }
    if (!found) {
        const json_t *a = json_array_get(json_object_get(r->j, "architectures"), 0);
        return mm_errf(r->err, MM_EUNSUPP,
                       "%s: architecture '%s'%s%s%s is not supported (qwen3_moe, qwen2_moe, "
                       "mixtral, deepseek_v3, glm4_moe, qwen3, qwen2)",
                       r->path, mt, a ? " (" : "", a ? json_string_value(a) : "", a ? ")" : "");
    }
    snprintf(c->model_type, sizeof c->model_type, "%s", mt);
    if (!mm_json_is_null_or_missing(r->j, "quantization_config"))
        return mm_errf(r->err, MM_EUNSUPP,
                       "%s: quantization_config is not supported (quantized checkpoints, e.g. "
                       "fp8, cannot be computed yet)",
                       r->path);
    const char *act = "silu";
    if (mm_json_get_str_or(r->j, "hidden_act", r->path, "silu", &act, r->err) != MM_OK)
        return MM_EFORMAT;
    if (strcmp(act, "silu") != 0)
        return mm_errf(r->err, MM_EUNSUPP, "%s: hidden_act '%s' is not supported (silu)", r->path,
                       act);
    const enum mm_arch A = c->arch;
    const bool ds = A == MM_ARCH_DEEPSEEK_V3, glm = A == MM_ARCH_GLM4_MOE;
    MM_TRY(geti(r, "vocab_size", 0, true, &c->vocab));
    MM_TRY(geti(r, "hidden_size", 0, true, &c->d_model));
    MM_TRY(geti(r, "num_hidden_layers", 0, true, &c->n_layers));
    MM_TRY(geti(r, "num_attention_heads", 0, true, &c->n_heads));
    MM_TRY(geti(r, "num_key_value_heads", c->n_heads, false, &c->n_kv_heads));
    MM_TRY(geti(r, "max_position_embeddings", 4096, false, &c->max_pos));
    MM_TRY(geti(r, "intermediate_size", 0, true, &c->d_ff));
    if (c->vocab <= 0 || c->d_model <= 0 || c->n_layers <= 0 || c->n_heads <= 0 ||
        c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads)
        return mm_errf(r->err, MM_EFORMAT, "%s: bad sizes (vocab, hidden, layers, heads)",
                       r->path);
    if (c->n_layers > MM_MODEL_MAX_LAYERS)
        return mm_errf(r->err, MM_EUNSUPP, "%s: %d layers (max %d)", r->path, c->n_layers,
                       MM_MODEL_MAX_LAYERS);
    double eps = 1e-6;
    MM_TRY(getf(r, r->j, "rms_norm_eps", A == MM_ARCH_MIXTRAL ? 1e-5 : 1e-6, &eps));
    c->eps = (float)eps;
    MM_TRY(getb(r, "tie_word_embeddings", false, &c->tie_embeddings));
    {
        long long b = -1, e = -1;
        const json_t *je = json_object_get(r->j, "eos_token_id");
        if (json_is_array(je))
            je = json_array_get(je, 0);
        if (json_is_integer(je))
            e = json_integer_value(je);
        if (mm_json_get_int_or(r->j, "bos_token_id", r->path, -1, &b, r->err) != MM_OK)
            b = -1;
        c->bos_id = (int)b;
        c->eos_id = (int)e;
    }
    // head dims
    const json_t *hd = json_object_get(r->j, "head_dim");
    c->head_dim = json_is_integer(hd) ? (int)json_integer_value(hd) : c->d_model / c->n_heads;
    c->head_dim_v = c->head_dim;
    // sliding windows
    bool usw = false;
    MM_TRY(getb(r, "use_sliding_window", false, &usw));
    if (usw)
        return mm_errf(r->err, MM_EUNSUPP, "%s: use_sliding_window is not supported", r->path);
    if (A == MM_ARCH_MIXTRAL && !mm_json_is_null_or_missing(r->j, "sliding_window"))
        MM_TRY(geti(r, "sliding_window", 0, false, &c->window));
    // attention variants
    c->rope_style = MM_ROPE_NEOX;
    switch (A) {
    case MM_ARCH_QWEN3_MOE:
    case MM_ARCH_QWEN3:
        c->qk_norm = true;
        MM_TRY(getb(r, "attention_bias", false, &c->qkv_bias));
        break;
    case MM_ARCH_QWEN2_MOE:
    case MM_ARCH_QWEN2:
        MM_TRY(getb(r, "qkv_bias", true, &c->qkv_bias));
        break;
    case MM_ARCH_GLM4_MOE:
        MM_TRY(getb(r, "use_qk_norm", false, &c->qk_norm));
        MM_TRY(getb(r, "attention_bias", false, &c->qkv_bias));
        break;
    case MM_ARCH_DEEPSEEK_V3: {
        bool ab = false;
        MM_TRY(getb(r, "attention_bias", false, &ab));
        if (ab)
            return mm_errf(r->err, MM_EUNSUPP, "%s: attention_bias with MLA is not supported",
                           r->path);
        c->mla = true;
        const json_t *ql = json_object_get(r->j, "q_lora_rank");
        c->q_lora_rank = json_is_integer(ql) ? (int)json_integer_value(ql) : 0;
        MM_TRY(geti(r, "kv_lora_rank", 0, true, &c->kv_lora_rank));
        MM_TRY(geti(r, "qk_nope_head_dim", 0, true, &c->qk_nope));
        MM_TRY(geti(r, "qk_rope_head_dim", 0, true, &c->qk_rope));
        MM_TRY(geti(r, "v_head_dim", 0, true, &c->v_head_dim));
        c->head_dim = c->qk_nope + c->qk_rope;
        c->head_dim_v = c->v_head_dim;
        c->n_kv_heads = c->n_heads; // decompressed K/V, one per head
        bool inter = true;
        MM_TRY(getb(r, "rope_interleave", true, &inter));
        c->rope_style = inter ? MM_ROPE_INTERLEAVED : MM_ROPE_NEOX;
        c->rot_offset = c->qk_nope;
        break;
    }
    default:
        break;
    }
    if (c->head_dim <= 0 || c->head_dim > 1024)
        return mm_errf(r->err, MM_EFORMAT, "%s: bad head_dim %d", r->path, c->head_dim);
    MM_TRY(read_rope(r, c, ds ? c->qk_rope : c->head_dim, glm ? 0.5 : 1.0));
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    if (ds) {
        const json_t *rp = json_object_get(r->j, "rope_parameters");
        if (!json_is_object(rp))
            rp = json_object_get(r->j, "rope_scaling");
        if (json_is_object(rp)) {
            double msa = 0, factor = 0;
            MM_TRY(getf(r, rp, "mscale_all_dim", 0, &msa));
            MM_TRY(getf(r, rp, "factor", 0, &factor));
            if (msa != 0) {
                double ms = yarn_mscale(factor, msa);
                c->attn_scale = (float)((double)c->attn_scale * ms * ms);
            }
        }
    }
    // MoE
    c->route = (struct mm_route_params){.score = MM_ROUTE_SOFTMAX, .n_group = 1,
                                        .topk_group = 1, .scale = 1.0f};
    switch (A) {
    case MM_ARCH_QWEN3_MOE:
    case MM_ARCH_QWEN2_MOE: {
        const char *ek = json_object_get(r->j, "num_experts") ? "num_experts" : "num_local_experts";
        MM_TRY(geti(r, ek, 0, true, &c->n_experts));
        MM_TRY(geti(r, "num_experts_per_tok", 0, true, &c->top_k));
        MM_TRY(geti(r, "moe_intermediate_size", 0, true, &c->d_ff_expert));
        MM_TRY(getb(r, "norm_topk_prob", false, &c->route.renorm));
        int step = 1;
        MM_TRY(geti(r, "decoder_sparse_step", 1, false, &step));
        const json_t *mlp_only = json_object_get(r->j, "mlp_only_layers");
        if (mlp_only && !json_is_null(mlp_only) && !json_is_array(mlp_only))
            return mm_errf(r->err, MM_EFORMAT, "%s: 'mlp_only_layers' must be a list", r->path);
        for (int l = 0; l < c->n_layers; l++)
            c->layer_moe[l] = !in_list(mlp_only, l) && c->n_experts > 0 && step > 0 &&
                              (l + 1) % step == 0;
        if (A == MM_ARCH_QWEN2_MOE) {
            MM_TRY(geti(r, "shared_expert_intermediate_size", 0, false, &c->d_ff_shared));
            c->shared_gate = c->d_ff_shared > 0;
        }
        break;
    }
    case MM_ARCH_MIXTRAL:
        MM_TRY(geti(r, "num_local_experts", 0, true, &c->n_experts));
        MM_TRY(geti(r, "num_experts_per_tok", 0, true, &c->top_k));
        c->d_ff_expert = c->d_ff;
        c->route.renorm = true;
        for (int l = 0; l < c->n_layers; l++)
            c->layer_moe[l] = true;
        break;
    case MM_ARCH_DEEPSEEK_V3:
    case MM_ARCH_GLM4_MOE: {
        int n_shared = 0, first_dense = 0;
        double scale = 1.0;
        MM_TRY(geti(r, "n_routed_experts", 0, true, &c->n_experts));
        MM_TRY(geti(r, "num_experts_per_tok", 0, true, &c->top_k));
        MM_TRY(geti(r, "moe_intermediate_size", 0, true, &c->d_ff_expert));
        MM_TRY(geti(r, "n_shared_experts", 1, false, &n_shared));
        MM_TRY(geti(r, "first_k_dense_replace", 0, false, &first_dense));
        MM_TRY(geti(r, "n_group", 1, false, &c->route.n_group));
        MM_TRY(geti(r, "topk_group", 1, false, &c->route.topk_group));
        MM_TRY(getb(r, "norm_topk_prob", true, &c->route.renorm));
        MM_TRY(getf(r, r->j, "routed_scaling_factor", 1.0, &scale));
        // transformers' DeepSeek-V3 / GLM-4.5 routers always score with a sigmoid, add the
        // correction bias for the choice and limit groups; so do we.
        c->route.score = MM_ROUTE_SIGMOID;
        c->route.renorm_eps = 1e-20f;
        c->route.scale = (float)scale;
        c->e_bias = true;
        c->d_ff_shared = c->d_ff_expert * n_shared;
        if (c->route.n_group < 1)
            c->route.n_group = 1;
        if (c->route.n_group > 1 &&
            (c->n_experts % c->route.n_group || c->route.topk_group > c->route.n_group ||
             c->route.topk_group < 1))
            return mm_errf(r->err, MM_EFORMAT, "%s: n_group %d / topk_group %d do not fit %d "
                           "experts", r->path, c->route.n_group, c->route.topk_group,
                           c->n_experts);
        for (int l = 0; l < c->n_layers; l++)
            c->layer_moe[l] = l >= first_dense;
        break;
    }
    default:
        break;
    }
    c->route.n_experts = c->n_experts;
    c->route.top_k = c->top_k;
    if (c->n_experts > 0 && (c->top_k <= 0 || c->top_k > c->n_experts || c->n_experts > 1024 ||
                             c->d_ff_expert <= 0))
        return mm_errf(r->err, MM_EUNSUPP, "%s: %d experts with top-%d (ff %d) not supported",
                       r->path, c->n_experts, c->top_k, c->d_ff_expert);
    return MM_OK;
}

mm_err mm_model_config_read(const char *dir, mm_model_config *cfg, char err[MM_ERRLEN]) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    memset(cfg, 0, sizeof(*cfg));
    json_t *j = NULL;
    MM_TRY(mm_json_load_file(path, &j, err));
    struct rd r = {j, path, err};
    mm_err rv = read_cfg(&r, cfg);
    json_decref(j);
    return rv;
}
