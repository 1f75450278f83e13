// SPDX-License-Identifier: MIT
// Weights binding and the forward-pass stages; see mm/model.h for the stage contract.
//
// Design notes: weights are mm_weight views into the mmap'd safetensors (host-memory
// backends) or uploaded once into backend buffers (device backends). Small vectors that the
// ops take as f32 (biases, routing correction bias) are converted once at open. Each stage
// is a short, fixed sequence of backend ops on one caller-owned scratch; nothing allocates
// after mm_model_scratch_new. Math follows transformers 5.17 modeling_<family>.py.
//
// The device path of the engine (mm_model_forward on a backend with route_plan and
// moe_matmul_dev): the step's inputs (ids, positions, sequences, wanted rows) go to the
// backend in one copy; routing is planned on the device (route_plan), the grouped products
// read expert pointer tables uploaded once at open, and combine reads the rank-major weights
// the plan wrote, so a step issues no read-back. On device backends each expert's gate and up
// matrices share one buffer ([gate; up], rows 2F), and the engine runs them as one grouped
// product of 2F outputs: an output's bits depend only on its own row and n_in (kernels.h
// Exactness), so this equals the separate products the mesh's owners run. With capture_begin
// the whole step is recorded once per (rows, wanted rows) shape as a graph and replayed
// (MM_GPU_GRAPHS=0 turns that off; MM_DEVICE_ROUTING=0 turns the whole device path off). On
// device backends q, k and v share one buffer too and run as one product, followed by one
// head_norm_rope launch (MM_FUSED_QKV=0: separate products, norms and ropes). Greedy decode
// can overlap steps there (mm_model_pick_async, mm_model_forward_next): the argmax writes the
// picks where the next step's ids go and the backend's fetch starts them to the host, so the
// next step is issued (its positions copied, its recording launched) before they are read.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mm/config.h"
#include "mm/log.h"
#include "mm/model.h"
#include "mm/safetensors.h"

// ---- model ----------------------------------------------------------------------------------
struct layer {
    mm_weight attn_norm, ffn_norm;
    mm_weight wq, wk, wv, wo, q_norm, k_norm;
    mm_weight wqkv;                                   // device: [wq; wk; wv] in one buffer (wq,
                                                      // wk, wv are views), or data NULL
    float *bq, *bk, *bv;                              // (n_out,) f32 backend, or NULL; with
                                                      // wqkv, bq is [bq; bk; bv] contiguous
    mm_weight wq_a, q_a_norm, wq_b, wkv_a, kv_a_norm, wkv_b; // MLA
    mm_weight router;                                 // (n_experts, d_model)
    float *e_bias;                                    // (n_experts,) f32 backend, or NULL
    mm_weight *eg, *eu, *ed;                          // (n_experts) gate/up (ff, d), down (d, ff)
    mm_weight sg, su, sd;                             // shared experts or dense MLP
    mm_weight s_gate;                                 // Qwen2-MoE shared_expert_gate (1, d)
    bool has_shared;
    bool gu_fused;                                    // eg[e], eu[e] contiguous: [gate; up]
    const void *const *egu_tab, *const *eg_tab, *const *eu_tab, *const *ed_tab; // device path:
                                                      // backend arrays of E expert pointers
};

struct mm_model {
    mm_model_config c;
    mm_backend *be;
    mm_safetensors *st;
    mm_weight embed, norm, head;
    float *inv_freq; // (rot_dim/2) backend
    struct layer *layers;
    void **owned;    // backend buffers to free
    size_t n_owned, cap_owned;
    bool dev;        // the engine's device path (see the design notes)
};

const mm_model_config *mm_model_cfg(const mm_model *m) { return &m->c; }
mm_backend *mm_model_backend(const mm_model *m) { return m->be; }
bool mm_model_layer_is_moe(const mm_model *m, int layer) {
    return layer >= 0 && layer < m->c.n_layers && m->c.layer_moe[layer];
}
bool mm_model_layer_has_shared(const mm_model *m, int layer) {
    return layer >= 0 && layer < m->c.n_layers && m->layers[layer].has_shared;
}

static mm_err own(mm_model *m, void *p) {
    if (m->n_owned == m->cap_owned) {
        size_t cap = m->cap_owned ? 2 * m->cap_owned : 64;
        void **n = realloc(m->owned, cap * sizeof(void *));
        if (!n)
            return MM_ENOMEM;
        m->owned = n;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return MM_OK;
}

static mm_err upload(mm_model *m, const void *src, size_t n_bytes, void **out) {
    void *p = NULL;
    MM_TRY(m->be->ops->buffer_alloc(m->be->ctx, n_bytes, &p));
    mm_err rv = own(m, p);
    if (rv != MM_OK) {
        m->be->ops->buffer_free(m->be->ctx, p);
        return rv;
    }
    MM_TRY(m->be->ops->set(m->be->ctx, p, src, n_bytes));
    *out = p;
    return MM_OK;
}

// bind: weight `name` of shape (rows, cols); rows == 0 means a 1-D vector of cols.
static mm_err bind(mm_model *m, const char *name, int64_t rows, int64_t cols, mm_weight *w,
                   char *err) {
    const mm_st_tensor *t = NULL;
    int64_t shape[2] = {rows, cols};
    if (rows == 0)
        MM_TRY(mm_safetensors_get(m->st, name, 1, &shape[1], &t, err));
    else
        MM_TRY(mm_safetensors_get(m->st, name, 2, shape, &t, err));
    if (t->dtype != MM_DTYPE_BF16 && t->dtype != MM_DTYPE_F16 && t->dtype != MM_DTYPE_F32)
        return mm_errf(err, MM_EUNSUPP, "%s: tensor %s has dtype %s (bf16, f16 or f32 needed)",
                       mm_safetensors_file_name(m->st, t->file), name, mm_dtype_name(t->dtype));
    *w = (mm_weight){.dtype = t->dtype, .rows = rows ? rows : 1, .cols = cols, .data = t->data};
    if (!m->be->ops->host_memory) {
        void *p = NULL;
        MM_TRY(upload(m, t->data, t->n_bytes, &p));
        w->data = p;
    }
    return MM_OK;
}

// bind_f32: a 1-D tensor converted to an owned f32 backend array.
static mm_err bind_f32(mm_model *m, const char *name, int64_t n, float **out, char *err) {
    mm_weight w;
    MM_TRY(bind(m, name, 0, n, &w, err));
    const mm_st_tensor *t = mm_safetensors_find(m->st, name);
    float *tmp = malloc((size_t)n * 4);
    if (!tmp)
        return MM_ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        switch (t->dtype) {
        case MM_DTYPE_BF16:
            memcpy(&h, (const char *)t->data + 2 * i, 2);
            tmp[i] = mm_bf16_to_f32(h);
            break;
        case MM_DTYPE_F16:
            memcpy(&h, (const char *)t->data + 2 * i, 2);
            tmp[i] = mm_f16_to_f32(h);
            break;
        default:
            memcpy(&tmp[i], (const char *)t->data + 4 * i, 4);
        }
    }
    mm_err rv = upload(m, tmp, (size_t)n * 4, (void **)out);
    free(tmp);
    return rv;
}

#define LNAME(buf, l, fmt, ...) snprintf(buf, sizeof buf, "model.layers.%d." fmt, l, ##__VA_ARGS__)

static mm_err bind_mlp(mm_model *m, int l, const char *prefix, int64_t ff, mm_weight *g,
                       mm_weight *u, mm_weight *d, char *err) {
    char n[256];
    const int64_t D = m->c.d_model;
    LNAME(n, l, "%s.gate_proj.weight", prefix);
    MM_TRY(bind(m, n, ff, D, g, err));
    LNAME(n, l, "%s.up_proj.weight", prefix);
    MM_TRY(bind(m, n, ff, D, u, err));
    LNAME(n, l, "%s.down_proj.weight", prefix);
    MM_TRY(bind(m, n, D, ff, d, err));
    return MM_OK;
}

// upload_cat: one owned backend buffer holding a's bytes then b's (b may be NULL).
static mm_err upload_cat(mm_model *m, const void *a, size_t na, const void *b, size_t nb,
                         void **out) {
    void *p = NULL;
    MM_TRY(m->be->ops->buffer_alloc(m->be->ctx, na + nb, &p));
    mm_err rv = own(m, p);
    if (rv != MM_OK) {
        m->be->ops->buffer_free(m->be->ctx, p);
        return rv;
    }
    MM_TRY(m->be->ops->set(m->be->ctx, p, a, na));
    if (b)
        MM_TRY(m->be->ops->set(m->be->ctx, (char *)p + na, b, nb));
    *out = p;
    return MM_OK;
}

// Experts on a device backend: expert e's gate and up rows in one buffer, gate first, so
// that eg[e] and eu[e] are views of it and the engine can run both as one product. Hub layout
// (per-expert tensors, gate and up of one dtype) or the fused transformers-5 layout (whose
// gate_up_proj slice of an expert already is [gate; up]).
static mm_err bind_experts_dev(mm_model *m, int l, const char *moe, struct layer *L,
                               const mm_st_tensor *gu, char *err) {
    const mm_model_config *c = &m->c;
    const int64_t D = c->d_model, F = c->d_ff_expert, E = c->n_experts;
    const bool mix = c->arch == MM_ARCH_MIXTRAL;
    char n[256];
    const mm_st_tensor *dn = NULL;
    if (gu) {
        const mm_st_tensor *t = NULL;
        int64_t s1[3] = {E, 2 * F, D}, s2[3] = {E, D, F};
        LNAME(n, l, "%s.experts.gate_up_proj", moe);
        MM_TRY(mm_safetensors_get(m->st, n, 3, s1, &t, err));
        LNAME(n, l, "%s.experts.down_proj", moe);
        MM_TRY(mm_safetensors_get(m->st, n, 3, s2, &dn, err));
        if (t->dtype != MM_DTYPE_BF16 || dn->dtype != MM_DTYPE_BF16)
            return mm_errf(err, MM_EUNSUPP, "fused experts of layer %d must be bf16", l);
        gu = t;
    }
    for (int64_t e = 0; e < E; e++) {
        void *p = NULL;
        enum mm_dtype dt = MM_DTYPE_BF16;
        size_t half = 0;
        if (gu) {
            half = (size_t)(F * D) * 2;
            MM_TRY(upload_cat(m, (const char *)gu->data + (size_t)e * 2 * half, 2 * half, NULL,
                              0, &p));
            void *q = NULL;
            MM_TRY(upload_cat(m, (const char *)dn->data + (size_t)e * half, half, NULL, 0, &q));
            L->ed[e] = (mm_weight){MM_DTYPE_BF16, D, F, q};
        } else {
            const mm_st_tensor *tg = NULL, *tu = NULL;
            int64_t sh[2] = {F, D};
            LNAME(n, l, "%s.experts.%lld.%s.weight", moe, (long long)e, mix ? "w1" : "gate_proj");
            MM_TRY(mm_safetensors_get(m->st, n, 2, sh, &tg, err));
            LNAME(n, l, "%s.experts.%lld.%s.weight", moe, (long long)e, mix ? "w3" : "up_proj");
            MM_TRY(mm_safetensors_get(m->st, n, 2, sh, &tu, err));
            dt = tg->dtype;
            if (tu->dtype != dt || (dt != MM_DTYPE_BF16 && dt != MM_DTYPE_F16 &&
                                    dt != MM_DTYPE_F32))
                return mm_errf(err, MM_EUNSUPP, "%s: experts.%lld gate and up of layer %d have "
                               "dtypes %s and %s (one of bf16, f16, f32 needed)",
                               mm_safetensors_file_name(m->st, tg->file), (long long)e, l,
                               mm_dtype_name(dt), mm_dtype_name(tu->dtype));
            half = tg->n_bytes;
            MM_TRY(upload_cat(m, tg->data, tg->n_bytes, tu->data, tu->n_bytes, &p));
            LNAME(n, l, "%s.experts.%lld.%s.weight", moe, (long long)e, mix ? "w2" : "down_proj");
            MM_TRY(bind(m, n, D, F, &L->ed[e], err));
        }
        L->eg[e] = (mm_weight){dt, F, D, p};
        L->eu[e] = (mm_weight){dt, F, D, (const char *)p + half};
    }
    L->gu_fused = true;
    return MM_OK;
}

// Experts: Hub layout (experts.N.{gate,up,down}_proj / Mixtral w1,w3,w2), or the fused
// transformers-5 layout (experts.gate_up_proj (E, 2*ff, d), experts.down_proj (E, d, ff)).
static mm_err bind_experts(mm_model *m, int l, const char *moe, struct layer *L, char *err) {
    const mm_model_config *c = &m->c;
    const int64_t D = c->d_model, F = c->d_ff_expert, E = c->n_experts;
    L->eg = calloc((size_t)E * 3, sizeof(mm_weight));
    if (!L->eg)
        return MM_ENOMEM;
    L->eu = L->eg + E;
    L->ed = L->eg + 2 * E;
    char n[256];
    LNAME(n, l, "%s.experts.gate_up_proj", moe);
    const mm_st_tensor *gu = mm_safetensors_find(m->st, n);
    if (gu && m->be->ops->host_memory) {
        const mm_st_tensor *t = NULL;
        int64_t s1[3] = {E, 2 * F, D}, s2[3] = {E, D, F};
        MM_TRY(mm_safetensors_get(m->st, n, 3, s1, &t, err));
        LNAME(n, l, "%s.experts.down_proj", moe);
        const mm_st_tensor *dn = NULL;
        MM_TRY(mm_safetensors_get(m->st, n, 3, s2, &dn, err));
        if (t->dtype != MM_DTYPE_BF16 || dn->dtype != MM_DTYPE_BF16)
            return mm_errf(err, MM_EUNSUPP, "fused experts of layer %d must be bf16", l);
        for (int64_t e = 0; e < E; e++) {
            const uint16_t *b = (const uint16_t *)t->data + e * 2 * F * D;
            L->eg[e] = (mm_weight){MM_DTYPE_BF16, F, D, b};
            L->eu[e] = (mm_weight){MM_DTYPE_BF16, F, D, b + F * D};
            L->ed[e] = (mm_weight){MM_DTYPE_BF16, D, F, (const uint16_t *)dn->data + e * D * F};
        }
        return MM_OK;
    }
    const bool mix = c->arch == MM_ARCH_MIXTRAL;
    if (!m->be->ops->host_memory) // device: [gate; up] of each expert in one buffer
        return bind_experts_dev(m, l, moe, L, gu, err);
    for (int64_t e = 0; e < E; e++) {
        LNAME(n, l, "%s.experts.%lld.%s.weight", moe, (long long)e, mix ? "w1" : "gate_proj");
        MM_TRY(bind(m, n, F, D, &L->eg[e], err));
        LNAME(n, l, "%s.experts.%lld.%s.weight", moe, (long long)e, mix ? "w3" : "up_proj");
        MM_TRY(bind(m, n, F, D, &L->eu[e], err));
        LNAME(n, l, "%s.experts.%lld.%s.weight", moe, (long long)e, mix ? "w2" : "down_proj");
        MM_TRY(bind(m, n, D, F, &L->ed[e], err));
    }
    return MM_OK;
}

// f32_of: a 1-D tensor of n values converted to f32 into dst (host).
static mm_err f32_of(mm_model *m, const char *name, int64_t n, float *dst, char *err) {
    const mm_st_tensor *t = NULL;
    MM_TRY(mm_safetensors_get(m->st, name, 1, &n, &t, err));
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        switch (t->dtype) {
        case MM_DTYPE_BF16:
            memcpy(&h, (const char *)t->data + 2 * i, 2);
            dst[i] = mm_bf16_to_f32(h);
            break;
        case MM_DTYPE_F16:
            memcpy(&h, (const char *)t->data + 2 * i, 2);
            dst[i] = mm_f16_to_f32(h);
            break;
        case MM_DTYPE_F32:
            memcpy(&dst[i], (const char *)t->data + 4 * i, 4);
            break;
        default:
            return mm_errf(err, MM_EUNSUPP, "%s: tensor %s has dtype %s (bf16, f16 or f32 "
                           "needed)", mm_safetensors_file_name(m->st, t->file), name,
                           mm_dtype_name(t->dtype));
        }
    }
    return MM_OK;
}

// Device backends: q, k and v of a layer in one buffer ([wq; wk; wv], rows (H + 2 KV) hd), so
// that the engine and the attention daemon run one product (an output's bits depend only on
// its own weight row, kernels.h Exactness); wq, wk, wv stay views of it. Biases likewise in one
// f32 array. Checkpoints whose q/k/v differ in dtype keep separate buffers.
static mm_err bind_qkv_dev(mm_model *m, int l, struct layer *L, char *err) {
    const mm_model_config *c = &m->c;
    const int64_t D = c->d_model, H = c->n_heads, KV = c->n_kv_heads, hd = c->head_dim;
    const char *nm[3] = {"q_proj", "k_proj", "v_proj"};
    const int64_t rows[3] = {H * hd, KV * hd, KV * hd};
    const mm_st_tensor *t[3];
    char n[256];
    for (int i = 0; i < 3; i++) {
        int64_t sh[2] = {rows[i], D};
        LNAME(n, l, "self_attn.%s.weight", nm[i]);
        MM_TRY(mm_safetensors_get(m->st, n, 2, sh, &t[i], err));
    }
    const enum mm_dtype dt = t[0]->dtype;
    mm_weight *w[3] = {&L->wq, &L->wk, &L->wv};
    if (t[1]->dtype != dt || t[2]->dtype != dt ||
        (dt != MM_DTYPE_BF16 && dt != MM_DTYPE_F16 && dt != MM_DTYPE_F32)) {
        for (int i = 0; i < 3; i++) {
            LNAME(n, l, "self_attn.%s.weight", nm[i]);
            MM_TRY(bind(m, n, rows[i], D, w[i], err));
        }
    } else {
        void *p = NULL;
        const size_t tot = t[0]->n_bytes + t[1]->n_bytes + t[2]->n_bytes;
        MM_TRY(m->be->ops->buffer_alloc(m->be->ctx, tot, &p));
        mm_err rv = own(m, p);
        if (rv != MM_OK) {
            m->be->ops->buffer_free(m->be->ctx, p);
            return rv;
        }
        size_t off = 0;
        for (int i = 0; i < 3; i++) {
            MM_TRY(m->be->ops->set(m->be->ctx, (char *)p + off, t[i]->data, t[i]->n_bytes));
            *w[i] = (mm_weight){dt, rows[i], D, (const char *)p + off};
            off += t[i]->n_bytes;
        }
        L->wqkv = (mm_weight){dt, rows[0] + rows[1] + rows[2], D, p};
    }
    if (!c->qkv_bias)
        return MM_OK;
    const int64_t nb = rows[0] + rows[1] + rows[2];
    float *tmp = malloc((size_t)nb * 4);
    if (!tmp)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    for (int i = 0, off = 0; i < 3 && rv == MM_OK; off += (int)rows[i], i++) {
        LNAME(n, l, "self_attn.%s.bias", nm[i]);
        rv = f32_of(m, n, rows[i], tmp + off, err);
    }
    if (rv == MM_OK)
        rv = upload(m, tmp, (size_t)nb * 4, (void **)&L->bq);
    free(tmp);
    MM_TRY(rv);
    L->bk = L->bq + rows[0];
    L->bv = L->bk + rows[1];
    return MM_OK;
}

static mm_err bind_layer(mm_model *m, int l, char *err) {
    const mm_model_config *c = &m->c;
    struct layer *L = &m->layers[l];
    const int64_t D = c->d_model, H = c->n_heads, KV = c->n_kv_heads, hd = c->head_dim;
    char n[256];
    LNAME(n, l, "input_layernorm.weight");
    MM_TRY(bind(m, n, 0, D, &L->attn_norm, err));
    LNAME(n, l, "post_attention_layernorm.weight");
    MM_TRY(bind(m, n, 0, D, &L->ffn_norm, err));
    if (c->mla) {
        const int64_t qk = c->qk_nope + c->qk_rope;
        if (c->q_lora_rank > 0) {
            LNAME(n, l, "self_attn.q_a_proj.weight");
            MM_TRY(bind(m, n, c->q_lora_rank, D, &L->wq_a, err));
            LNAME(n, l, "self_attn.q_a_layernorm.weight");
            MM_TRY(bind(m, n, 0, c->q_lora_rank, &L->q_a_norm, err));
            LNAME(n, l, "self_attn.q_b_proj.weight");
            MM_TRY(bind(m, n, H * qk, c->q_lora_rank, &L->wq_b, err));
        } else {
            LNAME(n, l, "self_attn.q_proj.weight");
            MM_TRY(bind(m, n, H * qk, D, &L->wq, err));
        }
        LNAME(n, l, "self_attn.kv_a_proj_with_mqa.weight");
        MM_TRY(bind(m, n, c->kv_lora_rank + c->qk_rope, D, &L->wkv_a, err));
        LNAME(n, l, "self_attn.kv_a_layernorm.weight");
        MM_TRY(bind(m, n, 0, c->kv_lora_rank, &L->kv_a_norm, err));
        LNAME(n, l, "self_attn.kv_b_proj.weight");
        MM_TRY(bind(m, n, H * (c->qk_nope + c->v_head_dim), c->kv_lora_rank, &L->wkv_b, err));
        LNAME(n, l, "self_attn.o_proj.weight");
        MM_TRY(bind(m, n, D, H * c->v_head_dim, &L->wo, err));
    } else if (!m->be->ops->host_memory) {
        MM_TRY(bind_qkv_dev(m, l, L, err));
        LNAME(n, l, "self_attn.o_proj.weight");
        MM_TRY(bind(m, n, D, H * hd, &L->wo, err));
        if (c->qk_norm) {
            LNAME(n, l, "self_attn.q_norm.weight");
            MM_TRY(bind(m, n, 0, hd, &L->q_norm, err));
            LNAME(n, l, "self_attn.k_norm.weight");
            MM_TRY(bind(m, n, 0, hd, &L->k_norm, err));
        }
    } else {
        LNAME(n, l, "self_attn.q_proj.weight");
        MM_TRY(bind(m, n, H * hd, D, &L->wq, err));
        LNAME(n, l, "self_attn.k_proj.weight");
        MM_TRY(bind(m, n, KV * hd, D, &L->wk, err));
        LNAME(n, l, "self_attn.v_proj.weight");
        MM_TRY(bind(m, n, KV * hd, D, &L->wv, err));
        LNAME(n, l, "self_attn.o_proj.weight");
        MM_TRY(bind(m, n, D, H * hd, &L->wo, err));
        if (c->qkv_bias) {
            LNAME(n, l, "self_attn.q_proj.bias");
            MM_TRY(bind_f32(m, n, H * hd, &L->bq, err));
            LNAME(n, l, "self_attn.k_proj.bias");
            MM_TRY(bind_f32(m, n, KV * hd, &L->bk, err));
            LNAME(n, l, "self_attn.v_proj.bias");
            MM_TRY(bind_f32(m, n, KV * hd, &L->bv, err));
        }
        if (c->qk_norm) {
            LNAME(n, l, "self_attn.q_norm.weight");
            MM_TRY(bind(m, n, 0, hd, &L->q_norm, err));
            LNAME(n, l, "self_attn.k_norm.weight");
            MM_TRY(bind(m, n, 0, hd, &L->k_norm, err));
        }
    }
    if (!c->layer_moe[l]) {
        L->has_shared = true;
        return bind_mlp(m, l, "mlp", c->d_ff, &L->sg, &L->su, &L->sd, err);
    }
    const char *moe = c->arch == MM_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
    LNAME(n, l, "%s.gate.weight", moe);
    MM_TRY(bind(m, n, c->n_experts, D, &L->router, err));
    if (c->e_bias) {
        LNAME(n, l, "%s.gate.e_score_correction_bias", moe);
        if (mm_safetensors_find(m->st, n)) {
            MM_TRY(bind_f32(m, n, c->n_experts, &L->e_bias, err));
        } else { // transformers initialises the buffer to zeros when absent
            float *z = calloc((size_t)c->n_experts, 4);
            if (!z)
                return MM_ENOMEM;
            mm_err rv = upload(m, z, (size_t)c->n_experts * 4, (void **)&L->e_bias);
            free(z);
            MM_TRY(rv);
        }
    }
    MM_TRY(bind_experts(m, l, moe, L, err));
    if (c->d_ff_shared > 0) {
        L->has_shared = true;
        bool qwen2 = c->arch == MM_ARCH_QWEN2_MOE;
        MM_TRY(bind_mlp(m, l, qwen2 ? "mlp.shared_expert" : "mlp.shared_experts", c->d_ff_shared,
                        &L->sg, &L->su, &L->sd, err));
        if (c->shared_gate) {
            LNAME(n, l, "mlp.shared_expert_gate.weight");
            MM_TRY(bind(m, n, 1, D, &L->s_gate, err));
        }
    }
    return MM_OK;
}

// upload_ptrs: an owned backend array of the n data pointers of ws (the expert table the
// device path's grouped products read), or of base + off for each (off in bytes).
static mm_err upload_ptrs(mm_model *m, const mm_weight *ws, int n, const void *const **out) {
    const void **h = malloc((size_t)n * sizeof(void *));
    if (!h)
        return MM_ENOMEM;
    for (int i = 0; i < n; i++)
        h[i] = ws[i].data;
    mm_err rv = upload(m, h, (size_t)n * sizeof(void *), (void **)out);
    free(h);
    return rv;
}

// The device path needs a device backend with route_plan and moe_matmul_dev, and every
// layer's experts in one dtype; then each MoE layer gets its expert pointer tables.
static mm_err bind_dev_tables(mm_model *m) {
    const struct mm_backend_ops *ops = m->be->ops;
    const mm_model_config *c = &m->c;
    m->dev = !ops->host_memory && ops->route_plan && ops->moe_matmul_dev &&
             !mm_env_off("MM_DEVICE_ROUTING");
    for (int l = 0; m->dev && l < c->n_layers; l++) {
        const struct layer *L = &m->layers[l];
        if (!c->layer_moe[l])
            continue;
        for (int e = 1; e < c->n_experts; e++)
            if (L->eg[e].dtype != L->eg[0].dtype || L->ed[e].dtype != L->ed[0].dtype ||
                L->eu[e].dtype != L->eu[0].dtype)
                m->dev = false;
    }
    if (!m->dev)
        return MM_OK;
    for (int l = 0; l < c->n_layers; l++) {
        struct layer *L = &m->layers[l];
        if (!c->layer_moe[l])
            continue;
        const int E = c->n_experts;
        if (L->gu_fused) {
            MM_TRY(upload_ptrs(m, L->eg, E, &L->egu_tab));
        } else {
            MM_TRY(upload_ptrs(m, L->eg, E, &L->eg_tab));
            MM_TRY(upload_ptrs(m, L->eu, E, &L->eu_tab));
        }
        MM_TRY(upload_ptrs(m, L->ed, E, &L->ed_tab));
    }
    return MM_OK;
}

mm_err mm_model_open(mm_model **out, const char *dir, mm_backend *be, char err[MM_ERRLEN]) {
    *out = NULL;
    mm_model *m = calloc(1, sizeof(*m));
    if (!m)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    m->be = be;
    MM_TRY_GOTO(rv, mm_model_config_read(dir, &m->c, err), fail);
    MM_TRY_GOTO(rv, mm_safetensors_open(&m->st, dir, err), fail);
    const mm_model_config *c = &m->c;
    MM_TRY_GOTO(rv, bind(m, "model.embed_tokens.weight", c->vocab, c->d_model, &m->embed, err),
                fail);
    MM_TRY_GOTO(rv, bind(m, "model.norm.weight", 0, c->d_model, &m->norm, err), fail);
    if (c->tie_embeddings) // transformers ties lm_head to the embedding, stored or not
        m->head = m->embed;
    else
        MM_TRY_GOTO(rv, bind(m, "lm_head.weight", c->vocab, c->d_model, &m->head, err), fail);
    MM_TRY_GOTO(rv, upload(m, c->inv_freq, (size_t)(c->rot_dim / 2) * 4, (void **)&m->inv_freq),
                fail);
    m->layers = calloc((size_t)c->n_layers, sizeof(struct layer));
    if (!m->layers) {
        rv = MM_ENOMEM;
        goto fail;
    }
    for (int l = 0; l < c->n_layers; l++)
        MM_TRY_GOTO(rv, bind_layer(m, l, err), fail);
    MM_TRY_GOTO(rv, bind_dev_tables(m), fail);
    *out = m;
    return MM_OK;
fail:
    mm_model_close(m);
    return rv;
}

void mm_model_close(mm_model *m) {
    if (!m)
        return;
    for (size_t i = 0; i < m->n_owned; i++)
        m->be->ops->buffer_free(m->be->ctx, m->owned[i]);
    free(m->owned);
    if (m->layers)
        for (int l = 0; l < m->c.n_layers; l++)
            free(m->layers[l].eg);
    free(m->layers);
    mm_safetensors_close(m->st);
    free(m);
}

static double wbytes(const mm_weight *w) {
    return w->data ? (double)w->rows * (double)w->cols * (double)mm_dtype_size(w->dtype) : 0;
}

double mm_model_decode_bytes(const mm_model *m) {
    const mm_model_config *c = &m->c;
    double b = wbytes(&m->head) + wbytes(&m->norm) + wbytes(&m->embed) / c->vocab;
    for (int l = 0; l < c->n_layers; l++) {
        const struct layer *L = &m->layers[l];
        b += wbytes(&L->attn_norm) + wbytes(&L->ffn_norm) + wbytes(&L->wq) + wbytes(&L->wk) +
             wbytes(&L->wv) + wbytes(&L->wo) + wbytes(&L->q_norm) + wbytes(&L->k_norm) +
             wbytes(&L->wq_a) + wbytes(&L->q_a_norm) + wbytes(&L->wq_b) + wbytes(&L->wkv_a) +
             wbytes(&L->kv_a_norm) + wbytes(&L->wkv_b) + wbytes(&L->router) +
             wbytes(&L->sg) + wbytes(&L->su) + wbytes(&L->sd) + wbytes(&L->s_gate);
        if (c->layer_moe[l])
            b += c->top_k * (wbytes(&L->eg[0]) + wbytes(&L->eu[0]) + wbytes(&L->ed[0]));
    }
    return b;
}

static unsigned touch(const mm_weight *w) {
    unsigned s = 0;
    const volatile unsigned char *p = w->data;
    size_t n = (size_t)wbytes(w);
    for (size_t i = 0; p && i < n; i += 4096)
        s += p[i];
    return s;
}

unsigned mm_model_touch(const mm_model *m) {
    if (!m->be->ops->host_memory) // device weights: nothing to page in
        return 0;
    unsigned s = touch(&m->embed) + touch(&m->norm) + touch(&m->head);
    for (int l = 0; l < m->c.n_layers; l++) {
        const struct layer *L = &m->layers[l];
        const mm_weight *ws[] = {&L->attn_norm, &L->ffn_norm, &L->wq, &L->wk, &L->wv, &L->wo,
                                 &L->q_norm, &L->k_norm, &L->wq_a, &L->q_a_norm, &L->wq_b,
                                 &L->wkv_a, &L->kv_a_norm, &L->wkv_b, &L->router, &L->sg,
                                 &L->su, &L->sd, &L->s_gate};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            s += touch(ws[i]);
        if (m->c.layer_moe[l])
            for (int e = 0; e < m->c.n_experts; e++)
                s += touch(&L->eg[e]) + touch(&L->eu[e]) + touch(&L->ed[e]);
    }
    return s;
}

void mm_model_kv_params(const mm_model *m, mm_kv_params *p) {
    memset(p, 0, sizeof(*p));
    p->n_layers = m->c.n_layers;
    p->n_kv_heads = m->c.n_kv_heads;
    p->head_dim_k = m->c.head_dim;
    p->head_dim_v = m->c.head_dim_v;
    p->block_size = 16;
    // the backend's cache dtype (bf16 where its attention rounds K and V to bf16 anyway). MLA
    // keeps f32: its real head dims (DeepSeek V3: 192 for keys) are outside the tensor-core
    // contract, so a bf16 MLA cache would exist only for small test models
    const struct mm_backend_ops *ops = m->be->ops;
    p->dtype = !m->c.mla && ops->kv_dtype ? ops->kv_dtype(m->be->ctx, p->n_kv_heads,
                                                          p->head_dim_k, p->head_dim_v)
                                          : MM_DTYPE_F32;
}

// ---- scratch --------------------------------------------------------------------------------
#define MM_MODEL_GRAPHS 8

struct mm_model_scratch {
    int64_t max_rows;
    mm_backend *be;
    void **bufs;
    int n_bufs;
    // backend f32 buffers
    float *xn, *q, *k, *v, *ao, *tmp;       // attention
    float *qkv;                             // fused q/k/v rows (device backends) or NULL
    float *qa, *ckv, *kvn, *kvb;            // MLA
    float *g, *u, *f;                       // FFN (rows, ff_max)
    float *rl;                              // router logits (rows, n_experts)
    float *acc, *alpha, *sgate;             // combine / shared gate
    int32_t *pos_d, *seq_d, *idx_d, *idx2_d; // backend int arrays
    int32_t *ids_d;
    // engine (mm_model_forward)
    float *h, *x, *xin, *yout, *eo, *sh, *hn;
    int32_t *ids, *cnt, *slot_list, *row_list, *want_idx; // host
    float *wts;                                           // host
    int32_t *offs2;                                       // host (E+1): a chunk's offsets
    int32_t *rt;                                          // host (2, R, K): routing result
    // device path (mm_model.dev): the step's inputs, [ids | pos | seq | wanted rows], R each
    // (pos_d and seq_d point into it), filled from h_in by one set per step
    bool dev;
    int32_t *in_d, *h_in;
    int64_t picks; // ids at in_d that mm_model_pick_async left for mm_model_forward_next
    int64_t rows_n; // rows whose pos/seq mm_model_attn_forward last set (h_in holds them), -1
    int long_ctx;   // the staged rows reach MM_ATT_LONG_POS (mm_attn_args long_ctx; step key)
    int solo;       // each staged row is its sequence's only row (mm_attn_args keys_early;
                    // step key)
    int32_t *offs_d, *src_d, *dst_d, *tok_d; // routing plan (E+1, R*K, R*K), argmax (R)
    float *wt_d;                             // rank-major routing weights (K, R)
    // recorded steps, keyed by shape and the buffers baked into them
    struct step_graph {
        int64_t n, nw;
        int long_ctx, solo; // baked into the attention calls
        const void *kv, *pool, *tables, *logits; // the cache, and its buffers (a cache freed
                                                 // and another made at the same address)
        void *graph;
        uint64_t used;
    } graphs[MM_MODEL_GRAPHS];
    struct step_graph last; // the previous step's key (a shape seen twice gets recorded)
    uint64_t tick;
    bool no_graphs;         // capture failed once, or MM_GPU_GRAPHS=0
};

static mm_err sbuf(mm_model_scratch *s, size_t n_bytes, void **out) {
    void *p = NULL;
    MM_TRY(s->be->ops->buffer_alloc(s->be->ctx, n_bytes ? n_bytes : 4, &p));
    s->bufs[s->n_bufs++] = p;
    *out = p;
    return MM_OK;
}

void mm_model_scratch_free(mm_model_scratch *s) {
    if (!s)
        return;
    for (int i = 0; i < MM_MODEL_GRAPHS; i++)
        if (s->graphs[i].graph)
            s->be->ops->graph_free(s->be->ctx, s->graphs[i].graph);
    for (int i = 0; i < s->n_bufs; i++)
        s->be->ops->buffer_free(s->be->ctx, s->bufs[i]);
    free(s->bufs);
    free(s->h_in);
    free(s->ids);
    free(s->cnt);
    free(s->slot_list);
    free(s->row_list);
    free(s->want_idx);
    free(s->wts);
    free(s->offs2);
    free(s->rt);
    free(s);
}

mm_err mm_model_scratch_new(mm_model_scratch **out, const mm_model *m, int64_t max_rows,
                            char err[MM_ERRLEN]) {
    *out = NULL;
    if (max_rows <= 0)
        return mm_errf(err, MM_EINVAL, "scratch: max_rows must be > 0");
    const mm_model_config *c = &m->c;
    mm_model_scratch *s = calloc(1, sizeof(*s));
    if (!s)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    s->max_rows = max_rows;
    s->be = m->be;
    s->bufs = calloc(64, sizeof(void *));
    if (!s->bufs) {
        rv = MM_ENOMEM;
        goto fail;
    }
    const size_t R = (size_t)max_rows, D = (size_t)c->d_model, H = (size_t)c->n_heads;
    const size_t K = c->top_k > 0 ? (size_t)c->top_k : 1, E = c->n_experts > 0 ? (size_t)c->n_experts : 1;
    size_t ff = (size_t)c->d_ff;
    if ((size_t)c->d_ff_expert > ff)
        ff = (size_t)c->d_ff_expert;
    if ((size_t)c->d_ff_shared > ff)
        ff = (size_t)c->d_ff_shared;
    // device path: all n*K routed rows in one grouped call (no chunks), gate and up side by
    // side in g (2F wide)
    s->dev = m->dev;
    const size_t RX = s->dev ? R * K : R, Fe = (size_t)c->d_ff_expert;
    const size_t g_n = s->dev && RX * 2 * Fe > R * ff ? RX * 2 * Fe : R * ff;
    const size_t uf_n = s->dev && RX * Fe > R * ff ? RX * Fe : R * ff;
    const size_t qdim = H * (size_t)c->head_dim, vdim = (size_t)c->n_kv_heads * c->head_dim_v;
    const size_t kdim = (size_t)c->n_kv_heads * c->head_dim;
    const size_t aodim = H * (size_t)c->head_dim_v;
#define F32(field, n) MM_TRY_GOTO(rv, sbuf(s, (n) * 4, (void **)&s->field), fail)
    F32(xn, R * D);
    F32(q, R * qdim);
    F32(k, R * kdim);
    if (!m->be->ops->host_memory && !c->mla && !mm_env_off("MM_FUSED_QKV"))
        F32(qkv, R * (qdim + 2 * kdim));
    F32(v, R * vdim);
    F32(ao, R * aodim);
    F32(tmp, R * D);
    if (c->mla) {
        F32(qa, R * (size_t)(c->q_lora_rank > 0 ? c->q_lora_rank : 1));
        F32(ckv, R * (size_t)(c->kv_lora_rank + c->qk_rope));
        F32(kvn, R * (size_t)c->kv_lora_rank);
        F32(kvb, R * H * (size_t)(c->qk_nope + c->v_head_dim));
    }
    F32(g, g_n);
    F32(u, uf_n);
    F32(f, uf_n);
    F32(rl, R * E);
    F32(acc, R * D);
    F32(alpha, R * K); // combine: rank r's weights at alpha + r * n
    F32(sgate, R);
    F32(in_d, 4 * R);
    s->pos_d = s->in_d + R;
    s->seq_d = s->in_d + 2 * R;
    F32(idx_d, R * (H > K ? H : K));
    F32(idx2_d, R * K);
    F32(ids_d, 2 * R * K); // gate: ids (n, K) then their weights (n, K), read in one get
    F32(h, R * D);
    F32(x, R * D);
    F32(xin, RX * D);
    F32(yout, RX * D);
    if (s->dev) {
        F32(offs_d, E + 1);
        F32(src_d, R * K);
        F32(dst_d, R * K);
        F32(wt_d, R * K);
    }
    if (m->be->ops->argmax)
        F32(tok_d, R);
    F32(eo, R * K * D);
    F32(sh, R * D);
    F32(hn, R * D);
#undef F32
    s->ids = malloc(R * K * 4);
    s->wts = malloc(R * K * 4);
    s->cnt = malloc((E + 1) * 4);
    s->slot_list = malloc(R * K * 4);
    s->row_list = malloc(R * (K > H ? K : H) * 4);
    s->want_idx = malloc(R * 4);
    s->offs2 = malloc((E + 1) * 4);
    s->rt = malloc(2 * R * K * 4);
    s->h_in = malloc(4 * R * 4);
    s->rows_n = -1;
    s->no_graphs = !m->be->ops->capture_begin || mm_env_off("MM_GPU_GRAPHS");
    if (!s->ids || !s->wts || !s->cnt || !s->slot_list || !s->row_list || !s->want_idx ||
        !s->offs2 || !s->rt || !s->h_in) {
        rv = MM_ENOMEM;
        goto fail;
    }
    *out = s;
    return MM_OK;
fail:
    mm_model_scratch_free(s);
    if (rv == MM_ENOMEM)
        mm_errf(err, rv, "scratch for %lld rows: out of memory", (long long)max_rows);
    return rv;
}

// ---- stages ---------------------------------------------------------------------------------
#define OPS (m->be->ops)
#define CTX (m->be->ctx)

static mm_err check_rows(const mm_model_scratch *s, int64_t n) {
    return (s && n >= 0 && n <= s->max_rows) ? MM_OK : MM_EINVAL;
}

mm_err mm_model_embed(const mm_model *m, mm_model_scratch *s, const int32_t *ids, int64_t n,
                      float *h) {
    MM_TRY(check_rows(s, n));
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->c.vocab)
            return MM_EINVAL;
    MM_TRY(OPS->set(CTX, s->idx_d, ids, (size_t)n * 4));
    return OPS->embed(CTX, &m->embed, s->idx_d, n, h, m->c.d_model);
}

static mm_err attn_mla(const mm_model *m, mm_model_scratch *s, const struct layer *L,
                       const float *xn, int64_t n, float **q_out, float **k_out, float **v_out,
                       int64_t *q_stride) {
    const mm_model_config *c = &m->c;
    const int64_t H = c->n_heads, nope = c->qk_nope, rope = c->qk_rope, vd = c->v_head_dim;
    const int64_t qk = nope + rope, ckv_w = c->kv_lora_rank + rope;
    if (c->q_lora_rank > 0) { // q = q_b(q_a_norm(q_a(x)))
        MM_TRY(OPS->matmul(CTX, &L->wq_a, NULL, xn, c->d_model, s->qa, c->q_lora_rank, n));
        MM_TRY(OPS->rmsnorm(CTX, &L->q_a_norm, c->eps, s->qa, c->q_lora_rank, s->qa,
                            c->q_lora_rank, n));
        MM_TRY(OPS->matmul(CTX, &L->wq_b, NULL, s->qa, c->q_lora_rank, s->q, H * qk, n));
    } else {
        MM_TRY(OPS->matmul(CTX, &L->wq, NULL, xn, c->d_model, s->q, H * qk, n));
    }
    // compressed kv = [kv_lora | k_rope]; k_pass, v = kv_b(kv_a_norm(kv_lora part))
    MM_TRY(OPS->matmul(CTX, &L->wkv_a, NULL, xn, c->d_model, s->ckv, ckv_w, n));
    MM_TRY(OPS->rmsnorm(CTX, &L->kv_a_norm, c->eps, s->ckv, ckv_w, s->kvn, c->kv_lora_rank, n));
    MM_TRY(OPS->matmul(CTX, &L->wkv_b, NULL, s->kvn, c->kv_lora_rank, s->kvb, H * (nope + vd),
                       n));
    // rope on q's rope part (every head) and on the shared k_rope
    struct mm_rope_args ra = {.x = s->q, .n_rows = n, .row_stride = H * qk, .n_heads = (int)H,
                              .head_stride = qk, .rot_offset = (int)nope, .rot_dim = (int)rope,
                              .pos = s->pos_d, .inv_freq = m->inv_freq,
                              .mscale = c->rope_mscale, .style = c->rope_style};
    MM_TRY(OPS->rope(CTX, &ra));
    ra.x = s->ckv + c->kv_lora_rank;
    ra.row_stride = ckv_w;
    ra.n_heads = 1;
    ra.rot_offset = 0;
    MM_TRY(OPS->rope(CTX, &ra));
    // K (n, H, nope + rope) = [k_pass_h | k_rope]; V (n, H, vd)
    for (int64_t i = 0; i < n * H; i++)
        s->row_list[i] = (int32_t)(i / H);
    MM_TRY(OPS->set(CTX, s->idx_d, s->row_list, (size_t)(n * H) * 4));
    MM_TRY(OPS->copy_rows(CTX, s->kvb, nope + vd, NULL, s->k, qk, NULL, n * H, nope));
    MM_TRY(OPS->copy_rows(CTX, s->ckv + c->kv_lora_rank, ckv_w, s->idx_d, s->k + nope, qk, NULL,
                          n * H, rope));
    MM_TRY(OPS->copy_rows(CTX, s->kvb + nope, nope + vd, NULL, s->v, vd, NULL, n * H, vd));
    *q_out = s->q;
    *k_out = s->k;
    *v_out = s->v;
    *q_stride = H * qk;
    return MM_OK;
}

// attn_std: q, k, v of n rows, normed and rotated; their rows are *qs / *kvs apart. With the
// layer's fused q/k/v weight and the backend's head_norm_rope: one product and one launch,
// q, k and v side by side in s->qkv; with its head_norm_rope_kv the same launch also stores
// k and v into the cache as st (its view and rows set by the caller) says, and *stored is set.
// With the backend's head_norm_rope_kv, that launch is left to the caller: its arguments go
// to *pp (pp->x set; *stored set), which the caller issues with or before the attention
// (attention_prep where the backend takes it).
static mm_err attn_std(const mm_model *m, mm_model_scratch *s, const struct layer *L,
                       const float *xn, int64_t n, float **q, float **k, float **v, int64_t *qs,
                       int64_t *kvs, struct mm_kv_store_args *st, bool *stored,
                       struct mm_attn_prep *pp) {
    const mm_model_config *c = &m->c;
    const int64_t H = c->n_heads, KV = c->n_kv_heads, hd = c->head_dim, D = c->d_model;
    if (L->wqkv.data && s->qkv && OPS->head_norm_rope) {
        const int64_t W = (H + 2 * KV) * hd;
        MM_TRY(OPS->matmul(CTX, &L->wqkv, L->bq, xn, D, s->qkv, W, n));
        struct mm_rope_args ra = {.rot_offset = 0, .rot_dim = c->rot_dim, .pos = s->pos_d,
                                  .inv_freq = m->inv_freq, .mscale = c->rope_mscale,
                                  .style = c->rope_style};
        *q = s->qkv, *k = s->qkv + H * hd, *v = s->qkv + (H + KV) * hd;
        *qs = *kvs = W;
        const mm_weight *wa = c->qk_norm ? &L->q_norm : NULL, *wb = c->qk_norm ? &L->k_norm : NULL;
        if (OPS->head_norm_rope_kv) { // and kv_store, the same bits
            st->k = *k, st->v = *v;
            st->k_stride = st->v_stride = W;
            *stored = true;
            *pp = (struct mm_attn_prep){.x = s->qkv, .stride = W, .n_a = (int)H, .n_b = (int)KV,
                                        .b_off = H * hd, .head_dim = (int)hd, .wa = wa, .wb = wb,
                                        .eps = c->eps, .rope = ra, .st = *st};
            return MM_OK;
        }
        return OPS->head_norm_rope(CTX, s->qkv, n, W, (int)H, (int)KV, H * hd, (int)hd, wa, wb,
                                   c->eps, &ra);
    }
    *q = s->q, *k = s->k, *v = s->v;
    *qs = H * hd, *kvs = KV * hd;
    MM_TRY(OPS->matmul(CTX, &L->wq, L->bq, xn, D, s->q, H * hd, n));
    MM_TRY(OPS->matmul(CTX, &L->wk, L->bk, xn, D, s->k, KV * hd, n));
    MM_TRY(OPS->matmul(CTX, &L->wv, L->bv, xn, D, s->v, KV * hd, n));
    if (c->qk_norm) { // per-head RMSNorm: one row per head
        MM_TRY(OPS->rmsnorm(CTX, &L->q_norm, c->eps, s->q, hd, s->q, hd, n * H));
        MM_TRY(OPS->rmsnorm(CTX, &L->k_norm, c->eps, s->k, hd, s->k, hd, n * KV));
    }
    struct mm_rope_args ra = {.x = s->q, .n_rows = n, .row_stride = H * hd, .n_heads = (int)H,
                              .head_stride = hd, .rot_offset = 0, .rot_dim = c->rot_dim,
                              .pos = s->pos_d, .inv_freq = m->inv_freq,
                              .mscale = c->rope_mscale, .style = c->rope_style};
    MM_TRY(OPS->rope(CTX, &ra));
    ra.x = s->k;
    ra.row_stride = KV * hd;
    ra.n_heads = (int)KV;
    return OPS->rope(CTX, &ra);
}

// check_attn_rows: the cache fits the model and every row's position is reserved.
static mm_err check_attn_rows(const mm_model *m, const mm_kv_cache *kv, const mm_model_rows *rows) {
    const mm_model_config *c = &m->c;
    const mm_kv_params *kp = mm_kv_cache_params(kv);
    if (kp->n_kv_heads != c->n_kv_heads || kp->head_dim_k != c->head_dim ||
        kp->head_dim_v != c->head_dim_v || kp->n_layers != c->n_layers)
        return MM_EINVAL;
    for (int64_t i = 0; i < rows->n_rows; i++)
        if (rows->pos[i] < 0 || rows->pos[i] >= mm_kv_cache_seq_len(kv, rows->seq[i]))
            return MM_EINVAL; // position not reserved
    return MM_OK;
}

// long_ctx: 1 when some row's position is at least MM_ATT_LONG_POS (mm_attn_args long_ctx: a
// backend may take its long-context attention; the same bits either way).
static int long_ctx(const mm_model_rows *rows) {
    for (int64_t i = 0; i < rows->n_rows; i++)
        if (rows->pos[i] >= MM_ATT_LONG_POS)
            return 1;
    return 0;
}

// solo: 1 when no two rows share a sequence (a decode step without drafts), so that every key
// below a row's position was stored by an earlier step (mm_attn_args keys_early). Calls of
// more than 64 rows (prefill chunks, not recorded) are not checked: 0.
static int solo(const mm_model_rows *rows) {
    if (rows->n_rows > 64)
        return 0;
    for (int64_t i = 1; i < rows->n_rows; i++)
        for (int64_t j = 0; j < i; j++)
            if (rows->seq[i] == rows->seq[j])
                return 0;
    return 1;
}

// attn_core: the attention of layer on n rows whose positions and sequences are in s->pos_d
// and s->seq_d already. defer_residual: the output projection stays in s->tmp and h is not
// updated (the caller adds it with the backend's add_rmsnorm); else out (which may be h; h
// itself is not written) = h + the output, through the backend's matmul_res where it takes the
// product (the residual in o_proj's epilogue), else o_proj into s->tmp and an axpy. xn: the
// layer's input norm of h, made already (the previous layer's combine_rmsnorm wrote it), or NULL
// (made here into s->xn).
static mm_err attn_core(const mm_model *m, mm_model_scratch *s, int layer, mm_kv_cache *kv,
                        int64_t n, float *h, bool defer_residual, float *out,
                        const float *xn);

mm_err mm_model_attn_forward(const mm_model *m, mm_model_scratch *s, int layer, mm_kv_cache *kv,
                             const mm_model_rows *rows, float *h) {
    return mm_model_attn_forward_to(m, s, layer, kv, rows, h, NULL, h);
}

mm_err mm_model_attn_forward_to(const mm_model *m, mm_model_scratch *s, int layer,
                                mm_kv_cache *kv, const mm_model_rows *rows, float *h,
                                const float *xn, float *out) {
    const mm_model_config *c = &m->c;
    const int64_t n = rows->n_rows;
    if (layer < 0 || layer >= c->n_layers || !kv)
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (n == 0)
        return MM_OK;
    MM_TRY(check_attn_rows(m, kv, rows));
    // positions and sequences to the backend in one copy (staged in h_in where forward_dev
    // stages them), and only when they differ from the last call's: a shard calls this once
    // per layer with the same rows
    const int64_t R = s->max_rows;
    if (s->rows_n != n || memcmp(s->h_in + R, rows->pos, (size_t)n * 4) != 0 ||
        memcmp(s->h_in + 2 * R, rows->seq, (size_t)n * 4) != 0) {
        s->rows_n = -1;
        memcpy(s->h_in + R, rows->pos, (size_t)n * 4);
        memcpy(s->h_in + 2 * R, rows->seq, (size_t)n * 4);
        MM_TRY(OPS->set(CTX, s->pos_d, s->h_in + R, (size_t)(R + n) * 4));
        s->rows_n = n;
        s->long_ctx = long_ctx(rows);
        s->solo = solo(rows);
    }
    return attn_core(m, s, layer, kv, n, h, false, out ? out : h, xn);
}

static mm_err attn_core(const mm_model *m, mm_model_scratch *s, int layer, mm_kv_cache *kv,
                        int64_t n, float *h, bool defer_residual, float *out,
                        const float *xn) {
    const mm_model_config *c = &m->c;
    const struct layer *L = &m->layers[layer];
    const int64_t D = c->d_model, H = c->n_heads;
    if (!xn) {
        MM_TRY(OPS->rmsnorm(CTX, &L->attn_norm, c->eps, h, D, s->xn, D, n));
        xn = s->xn;
    }
    float *q = s->q, *k = s->k, *v = s->v;
    int64_t qs = H * c->head_dim, ks = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t vs = (int64_t)c->n_kv_heads * c->head_dim_v;
    struct mm_kv_store_args st = {.n_rows = n, .row_seq = s->seq_d, .row_pos = s->pos_d};
    mm_kv_cache_view(kv, layer, &st.kv);
    bool stored = false;
    struct mm_attn_prep prep = {.x = NULL}; // head_norm_rope_kv's launch, left to below
    if (c->mla) {
        MM_TRY(attn_mla(m, s, L, xn, n, &q, &k, &v, &qs));
    } else {
        MM_TRY(attn_std(m, s, L, xn, n, &q, &k, &v, &qs, &ks, &st, &stored, &prep));
        vs = ks;
    }
    st.k = k, st.k_stride = ks, st.v = v, st.v_stride = vs;
    if (!stored)
        MM_TRY(OPS->kv_store(CTX, &st));
    struct mm_attn_args aa = {.kv = st.kv, .q = q, .q_stride = qs, .out = s->ao,
                              .out_stride = H * c->head_dim_v, .n_rows = n,
                              .row_seq = s->seq_d, .row_pos = s->pos_d, .n_heads = (int)H,
                              .scale = c->attn_scale, .window = c->window,
                              .long_ctx = s->long_ctx, .keys_early = s->solo};
    // a decode call (one row a sequence, short contexts): the q/k preparation may go into the
    // attention's launch (attention_prep)
    const bool prep_ok = prep.x && OPS->attention_prep && s->solo && !s->long_ctx && n <= 8;
    mm_err arv = prep_ok ? OPS->attention_prep(CTX, &prep, &aa) : MM_EUNSUPP;
    if (arv == MM_EUNSUPP) {
        if (prep.x) // not taken: the preparation, then the attention
            MM_TRY(OPS->head_norm_rope_kv(CTX, prep.x, n, prep.stride, prep.n_a, prep.n_b,
                                          prep.b_off, prep.head_dim, prep.wa, prep.wb, prep.eps,
                                          &prep.rope, &prep.st));
        arv = OPS->attention(CTX, &aa);
    }
    MM_TRY(arv);
    if (!defer_residual && OPS->matmul_res) { // the residual in o_proj's epilogue: same bits
        const mm_err rv = OPS->matmul_res(CTX, &L->wo, s->ao, H * c->head_dim_v, h, D, out, D, n);
        if (rv != MM_EUNSUPP)
            return rv;
    }
    MM_TRY(OPS->matmul(CTX, &L->wo, NULL, s->ao, H * c->head_dim_v, s->tmp, D, n));
    if (defer_residual)
        return MM_OK;
    if (out != h)
        MM_TRY(OPS->copy_rows(CTX, h, D, NULL, out, D, NULL, n, D));
    return OPS->axpy(CTX, NULL, s->tmp, D, out, D, n, D); // residual
}

mm_err mm_model_ffn_norm(const mm_model *m, mm_model_scratch *s, int layer, const float *h,
                         int64_t n, float *x) {
    if (layer < 0 || layer >= m->c.n_layers)
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    return OPS->rmsnorm(CTX, &m->layers[layer].ffn_norm, m->c.eps, h, m->c.d_model, x,
                        m->c.d_model, n);
}

mm_err mm_model_gate(const mm_model *m, mm_model_scratch *s, int layer, const float *x,
                     int64_t n, int32_t *ids, float *weights) {
    const mm_model_config *c = &m->c;
    if (!mm_model_layer_is_moe(m, layer))
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (n == 0)
        return MM_OK;
    const struct layer *L = &m->layers[layer];
    MM_TRY(OPS->matmul(CTX, &L->router, NULL, x, c->d_model, s->rl, c->n_experts, n));
    struct mm_route_params rp = c->route;
    rp.bias = L->e_bias;
    // ids and weights side by side in one backend buffer: one get (one stream drain on a
    // device) brings both back
    const size_t nk = (size_t)(n * c->top_k);
    MM_TRY(OPS->route(CTX, &rp, s->rl, c->n_experts, n, s->ids_d, (float *)(s->ids_d + nk)));
    MM_TRY(OPS->get(CTX, s->rt, s->ids_d, 2 * nk * 4));
    memcpy(ids, s->rt, nk * 4);
    memcpy(weights, s->rt + nk, nk * 4);
    return MM_OK;
}

static mm_err swiglu_mlp(const mm_model *m, mm_model_scratch *s, const mm_weight *g,
                         const mm_weight *u, const mm_weight *d, const float *x, int64_t n,
                         float *out) {
    const int64_t D = m->c.d_model, F = g->rows;
    MM_TRY(OPS->matmul(CTX, g, NULL, x, D, s->g, F, n));
    MM_TRY(OPS->matmul(CTX, u, NULL, x, D, s->u, F, n));
    MM_TRY(OPS->swiglu(CTX, s->g, F, s->u, F, s->f, F, n, F));
    return OPS->matmul(CTX, d, NULL, s->f, F, out, D, n);
}

mm_err mm_model_expert_forward(const mm_model *m, mm_model_scratch *s, int layer, int expert,
                               const float *x, int64_t n, float *out) {
    if (!mm_model_layer_is_moe(m, layer) || expert < 0 || expert >= m->c.n_experts)
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (n == 0)
        return MM_OK;
    const struct layer *L = &m->layers[layer];
    return swiglu_mlp(m, s, &L->eg[expert], &L->eu[expert], &L->ed[expert], x, n, out);
}

mm_err mm_model_experts_forward(const mm_model *m, mm_model_scratch *s, int layer,
                                const int32_t *offs, const float *x, int64_t n, float *out) {
    const int E = m->c.n_experts;
    if (!mm_model_layer_is_moe(m, layer) || !offs || offs[0] != 0 || offs[E] != n)
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    for (int e = 0; e < E; e++)
        if (offs[e + 1] < offs[e])
            return MM_EINVAL;
    if (n == 0)
        return MM_OK;
    const struct layer *L = &m->layers[layer];
    const int64_t D = m->c.d_model, F = m->c.d_ff_expert;
    if (!OPS->moe_matmul) { // one expert at a time: the same per-row arithmetic
        for (int e = 0; e < E; e++)
            if (offs[e + 1] > offs[e])
                MM_TRY(swiglu_mlp(m, s, &L->eg[e], &L->eu[e], &L->ed[e], x + offs[e] * D,
                                  offs[e + 1] - offs[e], out + offs[e] * D));
        return MM_OK;
    }
    MM_TRY(OPS->moe_matmul(CTX, L->eg, offs, E, x, D, s->g, F, n));
    MM_TRY(OPS->moe_matmul(CTX, L->eu, offs, E, x, D, s->u, F, n));
    MM_TRY(OPS->swiglu(CTX, s->g, F, s->u, F, s->f, F, n, F));
    return OPS->moe_matmul(CTX, L->ed, offs, E, s->f, F, out, D, n);
}

mm_err mm_model_shared_forward(const mm_model *m, mm_model_scratch *s, int layer,
                               const float *x, int64_t n, float *out) {
    if (!mm_model_layer_has_shared(m, layer))
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (n == 0)
        return MM_OK;
    const struct layer *L = &m->layers[layer];
    const int64_t D = m->c.d_model;
    if (!L->s_gate.data)
        return swiglu_mlp(m, s, &L->sg, &L->su, &L->sd, x, n, out);
    // Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
    MM_TRY(swiglu_mlp(m, s, &L->sg, &L->su, &L->sd, x, n, s->tmp));
    MM_TRY(OPS->matmul(CTX, &L->s_gate, NULL, x, D, s->sgate, 1, n));
    MM_TRY(OPS->sigmoid(CTX, s->sgate, n));
    MM_TRY(OPS->fill(CTX, out, 0.0f, n * D));
    return OPS->axpy(CTX, s->sgate, s->tmp, D, out, D, n, D);
}

// combine_core: h += sum over ranks r (in order) of alpha[r*n + i] * expert_out[i*k + r], then
// + shared; alpha (k, n) backend memory.
static mm_err combine_core(const mm_model *m, mm_model_scratch *s, float *h, int64_t n, int k,
                           const float *alpha, const float *expert_out, const float *shared) {
    const int64_t D = m->c.d_model;
    if (OPS->combine) // one launch, the same operations
        return OPS->combine(CTX, alpha, k, expert_out, D, shared, D, h, D, n, D);
    MM_TRY(OPS->fill(CTX, s->acc, 0.0f, n * D));
    for (int r = 0; r < k; r++) // canonical order: top-k rank
        MM_TRY(OPS->axpy(CTX, alpha + r * n, expert_out + r * D, (int64_t)k * D, s->acc, D, n,
                         D));
    if (shared)
        MM_TRY(OPS->axpy(CTX, NULL, shared, D, s->acc, D, n, D));
    return OPS->axpy(CTX, NULL, s->acc, D, h, D, n, D);
}

// combine_norm: combine_core, then y = rmsnorm(w, eps, h) when w is non-NULL (the next
// layer's input norm or the final norm): one op where the backend has combine_rmsnorm, the
// same bits.
static mm_err combine_norm(const mm_model *m, mm_model_scratch *s, float *h, int64_t n, int k,
                           const float *alpha, const float *expert_out, const float *shared,
                           const mm_weight *w, float *y) {
    const int64_t D = m->c.d_model;
    if (w && OPS->combine_rmsnorm)
        return OPS->combine_rmsnorm(CTX, alpha, k, expert_out, D, shared, D, h, D, n, w,
                                    m->c.eps, y, D);
    MM_TRY(combine_core(m, s, h, n, k, alpha, expert_out, shared));
    return w ? OPS->rmsnorm(CTX, w, m->c.eps, h, D, y, D, n) : MM_OK;
}

mm_err mm_model_combine(const mm_model *m, mm_model_scratch *s, int layer, float *h, int64_t n,
                        int k, const float *weights, const float *expert_out,
                        const float *shared) {
    if (layer < 0 || layer >= m->c.n_layers || k < 0 || (k > 0 && (!weights || !expert_out)) ||
        k > (m->c.top_k > 0 ? m->c.top_k : 0))
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (n == 0)
        return MM_OK;
    // the weights by rank (column r at wts + r * n), copied to the backend once
    for (int r = 0; r < k; r++)
        for (int64_t i = 0; i < n; i++)
            s->wts[r * n + i] = weights[i * k + r];
    if (k > 0)
        MM_TRY(OPS->set(CTX, s->alpha, s->wts, (size_t)(n * k) * 4));
    return combine_core(m, s, h, n, k, s->alpha, expert_out, shared);
}

mm_err mm_model_final_norm(const mm_model *m, mm_model_scratch *s, const float *h, int64_t n,
                           float *x) {
    MM_TRY(check_rows(s, n));
    return OPS->rmsnorm(CTX, &m->norm, m->c.eps, h, m->c.d_model, x, m->c.d_model, n);
}

mm_err mm_model_head(const mm_model *m, mm_model_scratch *s, const float *x, int64_t n,
                     float *logits) {
    MM_TRY(check_rows(s, n));
    return OPS->matmul(CTX, &m->head, NULL, x, m->c.d_model, logits, m->c.vocab, n);
}

// ---- engine ---------------------------------------------------------------------------------
// MoE FFN of one layer on the engine's rows: route (one read of the routing result), sort the
// (row, rank) slots by expert, run all of them through mm_model_experts_forward (one grouped
// product per projection where the backend has one), scatter outputs to the slots, combine.
static mm_err moe_layer(const mm_model *m, mm_model_scratch *s, int l, int64_t n) {
    const mm_model_config *c = &m->c;
    const int K = c->top_k, E = c->n_experts;
    const int64_t D = c->d_model;
    MM_TRY(mm_model_gate(m, s, l, s->x, n, s->ids, s->wts + 0));
    // counting sort of the n*K (row, rank) slots by expert, stable in slot order
    float *w = s->wts; // gate wrote weights here; copy before combine reuses wts
    memset(s->cnt, 0, (size_t)(E + 1) * 4);
    for (int64_t t = 0; t < n * K; t++) {
        if (s->ids[t] < 0 || s->ids[t] >= E)
            return MM_EPROTO;
        s->cnt[s->ids[t] + 1]++;
    }
    for (int e = 0; e < E; e++)
        s->cnt[e + 1] += s->cnt[e];
    for (int64_t t = 0; t < n * K; t++)
        s->slot_list[s->cnt[s->ids[t]]++] = (int32_t)t; // cnt[e] ends at start of e+1
    for (int e = E; e > 0; e--)
        s->cnt[e] = s->cnt[e - 1];
    s->cnt[0] = 0;
    // all routed slots at once, in chunks of at most max_rows sorted slots: gather their x
    // rows, run every expert's rows in one stage call, scatter to the (row, rank) slots
    for (int64_t c0 = 0; c0 < n * K; c0 += s->max_rows) {
        const int64_t c1 = c0 + s->max_rows < n * K ? c0 + s->max_rows : n * K, ne = c1 - c0;
        for (int e = 0; e <= E; e++) {
            int64_t o = s->cnt[e] < c0 ? c0 : s->cnt[e] > c1 ? c1 : s->cnt[e];
            s->offs2[e] = (int32_t)(o - c0);
        }
        s->offs2[0] = 0, s->offs2[E] = (int32_t)ne;
        for (int64_t i = 0; i < ne; i++)
            s->row_list[i] = s->slot_list[c0 + i] / K;
        MM_TRY(OPS->set(CTX, s->idx_d, s->row_list, (size_t)ne * 4));
        MM_TRY(OPS->set(CTX, s->idx2_d, s->slot_list + c0, (size_t)ne * 4));
        MM_TRY(OPS->copy_rows(CTX, s->x, D, s->idx_d, s->xin, D, NULL, ne, D));
        MM_TRY(mm_model_experts_forward(m, s, l, s->offs2, s->xin, ne, s->yout));
        MM_TRY(OPS->copy_rows(CTX, s->yout, D, NULL, s->eo, D, s->idx2_d, ne, D));
    }
    if (m->layers[l].has_shared)
        MM_TRY(mm_model_shared_forward(m, s, l, s->x, n, s->sh));
    // combine reads weights (n, K) while using s->wts as a column buffer: keep a copy
    float *wcopy = (float *)s->slot_list; // slot_list is free now; same size as ids
    memcpy(wcopy, w, (size_t)(n * K) * 4);
    return mm_model_combine(m, s, l, s->h, n, K, wcopy, s->eo,
                            m->layers[l].has_shared ? s->sh : NULL);
}

// ---- the engine's device path -----------------------------------------------------------------
// gate_plan: router product, route and route_plan of layer on n rows of x, into the
// scratch's plan buffers (ids_d, offs_d, src_d, dst_d, wt_d); issues ops only.
static mm_err gate_plan(const mm_model *m, mm_model_scratch *s, int l, const float *x,
                        int64_t n, int32_t *offs_d, int32_t *src_d, int32_t *dst_d) {
    const mm_model_config *c = &m->c;
    const struct layer *L = &m->layers[l];
    const int K = c->top_k, E = c->n_experts;
    MM_TRY(OPS->matmul(CTX, &L->router, NULL, x, c->d_model, s->rl, E, n));
    struct mm_route_params rp = c->route;
    rp.bias = L->e_bias;
    float *wts_d = (float *)(s->ids_d + n * K);
    if (OPS->route_with_plan) // one op where the backend has it, the same outputs
        return OPS->route_with_plan(CTX, &rp, s->rl, E, n, s->ids_d, wts_d, offs_d, src_d, dst_d,
                                    s->wt_d);
    MM_TRY(OPS->route(CTX, &rp, s->rl, E, n, s->ids_d, wts_d));
    return OPS->route_plan(CTX, s->ids_d, wts_d, n, K, E, offs_d, src_d, dst_d, s->wt_d);
}

// experts_plan: the routed experts of layer L on nk plan slots: sorted slot p reads x row
// src[p], its output goes to out row dst[p]; [gate; up] (or gate, up) and down as grouped
// products over device expert tables. Issues ops only.
static mm_err experts_plan(const mm_model *m, mm_model_scratch *s, const struct layer *L,
                           const int32_t *offs, const float *x, const int32_t *src,
                           const int32_t *dst, int64_t nk, float *out) {
    const mm_model_config *c = &m->c;
    const int E = c->n_experts;
    const int64_t D = c->d_model, F = c->d_ff_expert;
    const enum mm_dtype dg = L->eg[0].dtype, dd = L->ed[0].dtype;
    // [gate; up] reads the routed x rows through the plan's src itself where the backend
    // takes it (moe_matmul_rows), else after a gather into s->xin; down then applies SwiGLU
    // to its input rows and writes each output to its (row, rank) slot through dst itself,
    // else SwiGLU, the product and a scatter run as ops of their own
    const float *gp = s->g, *up = s->g + F; // SwiGLU's inputs and their row stride
    int64_t gus = 2 * F;
    mm_err rv = MM_EUNSUPP;
    // both products in one call where the backend takes it (moe_ffn_rows: SwiGLU in [gate; up]'s
    // epilogue, no f32 intermediate); the same bits as the calls below
    if (L->gu_fused && dg == dd && OPS->moe_ffn_rows) {
        rv = OPS->moe_ffn_rows(CTX, (const void *const *)L->egu_tab, (const void *const *)L->ed_tab,
                               dg, F, D, E, offs, x, D, src, out, D, dst, nk);
        if (rv != MM_EUNSUPP)
            return rv;
    }
    if (L->gu_fused && OPS->moe_matmul_rows)
        rv = OPS->moe_matmul_rows(CTX, (const void *const *)L->egu_tab, dg, 2 * F, D, E, offs,
                                  x, D, src, NULL, s->g, 2 * F, NULL, nk);
    if (rv != MM_EUNSUPP) {
        MM_TRY(rv);
    } else if (L->gu_fused) {
        MM_TRY(OPS->copy_rows(CTX, x, D, src, s->xin, D, NULL, nk, D));
        MM_TRY(OPS->moe_matmul_dev(CTX, (const void *const *)L->egu_tab, dg, 2 * F, D, E, offs,
                                   s->xin, D, s->g, 2 * F, nk));
    } else {
        MM_TRY(OPS->copy_rows(CTX, x, D, src, s->xin, D, NULL, nk, D));
        MM_TRY(OPS->moe_matmul_dev(CTX, (const void *const *)L->eg_tab, dg, F, D, E, offs,
                                   s->xin, D, s->g, F, nk));
        MM_TRY(OPS->moe_matmul_dev(CTX, (const void *const *)L->eu_tab, L->eu[0].dtype, F, D, E,
                                   offs, s->xin, D, s->u, F, nk));
        up = s->u, gus = F;
    }
    rv = OPS->moe_matmul_rows ? OPS->moe_matmul_rows(CTX, (const void *const *)L->ed_tab, dd, D,
                                                     F, E, offs, gp, gus, NULL, up, out, D, dst,
                                                     nk)
                              : MM_EUNSUPP;
    if (rv != MM_EUNSUPP)
        return rv;
    MM_TRY(OPS->swiglu(CTX, gp, gus, up, gus, s->f, F, nk, F));
    MM_TRY(OPS->moe_matmul_dev(CTX, (const void *const *)L->ed_tab, dd, D, F, E, offs, s->f, F,
                               s->yout, D, nk));
    return OPS->copy_rows(CTX, s->yout, D, NULL, out, D, dst, nk, D);
}

// moe_layer_dev: moe_layer with the plan made on the device: route, plan, gather the routed
// rows in expert order, [gate; up] (or gate, up) and down as grouped products over device
// expert tables, scatter to the (row, rank) slots, combine with the plan's rank-major weights
// (and then norm_w's norm of h into norm_y, if norm_w: combine_norm).
static mm_err moe_layer_dev(const mm_model *m, mm_model_scratch *s, int l, int64_t n,
                            const mm_weight *norm_w, float *norm_y) {
    const struct layer *L = &m->layers[l];
    const int K = m->c.top_k;
    MM_TRY(gate_plan(m, s, l, s->x, n, s->offs_d, s->src_d, s->dst_d));
    MM_TRY(experts_plan(m, s, L, s->offs_d, s->x, s->src_d, s->dst_d, n * K, s->eo));
    if (L->has_shared)
        MM_TRY(mm_model_shared_forward(m, s, l, s->x, n, s->sh));
    return combine_norm(m, s, s->h, n, K, s->wt_d, s->eo, L->has_shared ? s->sh : NULL, norm_w,
                        norm_y);
}

// ---- the mesh's device path (mm/model.h) ------------------------------------------------------
mm_err mm_model_gate_plan(const mm_model *m, mm_model_scratch *s, int layer, const float *x,
                          int64_t n, mm_model_plan *plan) {
    return mm_model_gate_plan_at(m, s, layer, x, n, NULL, plan);
}

mm_err mm_model_gate_plan_at(const mm_model *m, mm_model_scratch *s, int layer, const float *x,
                             int64_t n, int32_t *at, mm_model_plan *plan) {
    if (!mm_model_layer_is_moe(m, layer) || !plan || n <= 0)
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (!s->dev)
        return MM_EUNSUPP;
    const int64_t E = m->c.n_experts, nk = n * m->c.top_k;
    int32_t *offs = at ? at : s->offs_d, *src = at ? at + E + 1 : s->src_d;
    int32_t *dst = at ? at + E + 1 + nk : s->dst_d;
    MM_TRY(gate_plan(m, s, layer, x, n, offs, src, dst));
    *plan = (mm_model_plan){.ids = s->ids_d, .offs = offs, .src = src, .dst = dst, .wt = s->wt_d};
    return MM_OK;
}

mm_err mm_model_experts_plan(const mm_model *m, mm_model_scratch *s, int layer,
                             const int32_t *offs, const float *x, const int32_t *src,
                             const int32_t *dst, int64_t n_slots, float *out) {
    if (!mm_model_layer_is_moe(m, layer) || !offs || !x || !src || !dst || !out || n_slots < 0 ||
        n_slots > s->max_rows * (int64_t)m->c.top_k)
        return MM_EINVAL;
    if (!s->dev)
        return MM_EUNSUPP;
    if (n_slots == 0)
        return MM_OK;
    return experts_plan(m, s, &m->layers[layer], offs, x, src, dst, n_slots, out);
}

mm_err mm_model_combine_plan_next(const mm_model *m, mm_model_scratch *s, int layer, float *h,
                                  int64_t n, const float *wt, const float *expert_out,
                                  const float *shared, float *xn) {
    if (!mm_model_layer_is_moe(m, layer) || !wt || !expert_out ||
        (xn && layer + 1 >= m->c.n_layers))
        return MM_EINVAL;
    MM_TRY(check_rows(s, n));
    if (n == 0)
        return MM_OK;
    return combine_norm(m, s, h, n, m->c.top_k, wt, expert_out, shared,
                        xn ? &m->layers[layer + 1].attn_norm : NULL, xn);
}

mm_err mm_model_combine_plan(const mm_model *m, mm_model_scratch *s, int layer, float *h,
                             int64_t n, const float *wt, const float *expert_out,
                             const float *shared) {
    return mm_model_combine_plan_next(m, s, layer, h, n, wt, expert_out, shared, NULL);
}

// forward_dev_ops: the whole step from the inputs in s->in_d; issues ops only (no set, get
// or synchronize), so it can be recorded as a graph. MLA's key assembly sets an index list:
// MLA models are not recorded (see forward_dev).
static mm_err forward_dev_ops(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv, int64_t n,
                              int64_t nw, float *logits) {
    const int64_t D = m->c.d_model, R = s->max_rows;
    const int n_layers = m->c.n_layers;
    // chain: each layer's combine also writes the next layer's input norm (or the final norm
    // of every row) into s->xn, in one op where the backend has combine_rmsnorm (same bits)
    const bool chain = OPS->combine_rmsnorm != NULL;
    bool normed = false; // s->xn holds this layer's input norm already
    if (OPS->embed_rmsnorm && n_layers > 0) { // and the first layer's input norm, one op
        MM_TRY(OPS->embed_rmsnorm(CTX, &m->embed, s->in_d, n, s->h, D, &m->layers[0].attn_norm,
                                  m->c.eps, s->xn, D));
        normed = true;
    } else {
        MM_TRY(OPS->embed(CTX, &m->embed, s->in_d, n, s->h, D));
    }
    for (int l = 0; l < n_layers; l++) {
        // the residual add of the attention output and the FFN norm in one op where the
        // backend has it (same bits as axpy then rmsnorm)
        const bool fuse = OPS->add_rmsnorm != NULL;
        MM_TRY(attn_core(m, s, l, kv, n, s->h, fuse, s->h, normed ? s->xn : NULL));
        if (fuse)
            MM_TRY(OPS->add_rmsnorm(CTX, s->tmp, D, s->h, D, &m->layers[l].ffn_norm, m->c.eps,
                                    s->x, D, n));
        else
            MM_TRY(mm_model_ffn_norm(m, s, l, s->h, n, s->x));
        const mm_weight *next = !chain             ? NULL
                                : l + 1 < n_layers ? &m->layers[l + 1].attn_norm
                                : nw > 0           ? &m->norm
                                                   : NULL;
        if (mm_model_layer_is_moe(m, l)) {
            MM_TRY(moe_layer_dev(m, s, l, n, next, s->xn));
        } else {
            MM_TRY(mm_model_shared_forward(m, s, l, s->x, n, s->sh));
            MM_TRY(combine_norm(m, s, s->h, n, 0, NULL, NULL, s->sh, next, s->xn));
        }
        normed = next != NULL;
    }
    if (nw == 0)
        return MM_OK;
    if (chain && nw == n) // every row wanted (in order): their final norms are s->xn
        return mm_model_head(m, s, s->xn, nw, logits);
    if (chain) { // every row's final norm is in s->xn: the wanted rows
        MM_TRY(OPS->copy_rows(CTX, s->xn, D, s->in_d + 3 * R, s->hn, D, NULL, nw, D));
    } else {
        MM_TRY(OPS->copy_rows(CTX, s->h, D, s->in_d + 3 * R, s->xin, D, NULL, nw, D));
        MM_TRY(mm_model_final_norm(m, s, s->xin, nw, s->hn));
    }
    return mm_model_head(m, s, s->hn, nw, logits);
}

static struct step_graph step_key(int64_t n, int64_t nw, int long_ctx, int solo_rows,
                                  const mm_kv_cache *kv, const void *logits) {
    struct mm_kv_view v;
    mm_kv_cache_view(kv, 0, &v);
    return (struct step_graph){.n = n, .nw = nw, .long_ctx = long_ctx, .solo = solo_rows,
                               .kv = kv, .pool = v.base,
                               .tables = v.block_tables, .logits = logits};
}

// Launches g's recording. MM_ECLOSED from the backend: it refers to memory since released (a
// cached weight copy) and nothing ran: the recording is dropped, the step runs op by op and
// the next step of this shape records it again.
static mm_err replay(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv,
                     struct step_graph *g, int64_t n, int64_t nw, float *logits) {
    const mm_err rv = OPS->graph_launch(CTX, g->graph);
    if (rv != MM_ECLOSED)
        return rv;
    OPS->graph_free(CTX, g->graph);
    g->graph = NULL;
    s->last = *g;
    return forward_dev_ops(m, s, kv, n, nw, logits);
}

static bool same_key(const struct step_graph *g, const struct step_graph *k) {
    return g->n == k->n && g->nw == k->nw && g->long_ctx == k->long_ctx && g->solo == k->solo &&
           g->kv == k->kv &&
           g->pool == k->pool &&
           g->tables == k->tables && g->logits == k->logits;
}

// forward_dev: checks on the host, the inputs in one copy, then the step: replayed when this
// shape was recorded, recorded when it repeats the previous step's shape (decode), else
// issued op by op.
// ids NULL: the rows' ids are the picks mm_model_pick_async left at in_d (only the rest of the
// inputs is copied).
static mm_err forward_dev(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv,
                          const mm_model_rows *rows, const int32_t *ids, const bool *want_logits,
                          float *logits) {
    const int64_t n = rows->n_rows, R = s->max_rows;
    if (!kv || (!ids && n > s->picks))
        return MM_EINVAL;
    for (int64_t i = 0; ids && i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->c.vocab)
            return MM_EINVAL;
    MM_TRY(check_attn_rows(m, kv, rows));
    int64_t nw = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids)
            s->h_in[i] = ids[i];
        s->h_in[R + i] = rows->pos[i];
        s->h_in[2 * R + i] = rows->seq[i];
        if (!want_logits || want_logits[i])
            s->h_in[3 * R + nw++] = (int32_t)i;
    }
    s->rows_n = -1; // pos_d/seq_d rewritten: mm_model_attn_forward sets its rows again
    s->long_ctx = long_ctx(rows);
    s->solo = solo(rows);
    if (ids) {
        s->picks = 0; // the ids' place is rewritten
        MM_TRY(OPS->set(CTX, s->in_d, s->h_in, (size_t)(3 * R + (nw > 0 ? nw : 0)) * 4));
    } else {
        MM_TRY(OPS->set(CTX, s->in_d + R, s->h_in + R, (size_t)(2 * R + (nw > 0 ? nw : 0)) * 4));
    }
    // Steps of more than 64 rows (prefill chunks) are not recorded: their launches are few
    // against their work, and inside a capture the GPU's prefill GEMMs cannot take their
    // workspace path (kernels/cuda/matmul.cu launch_wg: the mma.sync tiles instead, same bits)
    if (s->no_graphs || m->c.mla || n > 64)
        return forward_dev_ops(m, s, kv, n, nw, logits);
    s->tick++;
    const struct step_graph key = step_key(n, nw, s->long_ctx, s->solo, kv, logits);
    for (int i = 0; i < MM_MODEL_GRAPHS; i++) {
        struct step_graph *g = &s->graphs[i];
        if (g->graph && same_key(g, &key)) {
            g->used = s->tick;
            return replay(m, s, kv, g, n, nw, logits);
        }
    }
    if (!same_key(&s->last, &key)) {
        s->last = key;
        return forward_dev_ops(m, s, kv, n, nw, logits);
    }
    // the same shape twice in a row: record it (nothing runs while recording), then run it
    MM_TRY(OPS->capture_begin(CTX));
    mm_err rv = forward_dev_ops(m, s, kv, n, nw, logits);
    void *graph = NULL;
    mm_err rc = OPS->capture_end(CTX, &graph);
    if (rv != MM_OK || rc != MM_OK) {
        if (graph)
            OPS->graph_free(CTX, graph);
        mm_log_warn("model: recording a step of %lld rows failed (%s); steps run op by op from "
                    "now on", (long long)n, mm_strerror(rv != MM_OK ? rv : rc));
        s->no_graphs = true;
        return forward_dev_ops(m, s, kv, n, nw, logits);
    }
    struct step_graph *slot = &s->graphs[0]; // a free slot, else the least recently used
    for (int i = 0; i < MM_MODEL_GRAPHS; i++) {
        if (!s->graphs[i].graph) {
            slot = &s->graphs[i];
            break;
        }
        if (s->graphs[i].used < slot->used)
            slot = &s->graphs[i];
    }
    if (slot->graph)
        OPS->graph_free(CTX, slot->graph);
    *slot = key;
    slot->graph = graph;
    slot->used = s->tick;
    return replay(m, s, kv, slot, n, nw, logits);
}

bool mm_model_scratch_graphs(mm_model_scratch *s, bool on) {
    const bool was = !s->no_graphs;
    s->no_graphs = !on || !s->dev || !s->be->ops->capture_begin;
    return was;
}

mm_err mm_model_argmax(const mm_model *m, mm_model_scratch *s, const float *logits, int64_t n,
                       int32_t *ids) {
    MM_TRY(check_rows(s, n));
    if (!OPS->argmax || !s->tok_d)
        return MM_EUNSUPP;
    if (n == 0)
        return MM_OK;
    MM_TRY(OPS->argmax(CTX, logits, m->c.vocab, n, m->c.vocab, s->tok_d));
    return OPS->get(CTX, ids, s->tok_d, (size_t)n * 4);
}

bool mm_model_can_overlap(const mm_model *m, const mm_model_scratch *s) {
    return s && s->dev && s->tok_d && OPS->argmax && OPS->fetch && OPS->fetch_wait;
}

mm_err mm_model_pick_async(const mm_model *m, mm_model_scratch *s, const float *logits, int64_t n,
                           uint64_t *ticket) {
    MM_TRY(check_rows(s, n));
    if (!mm_model_can_overlap(m, s))
        return MM_EUNSUPP;
    if (n < 1 || (size_t)n * 4 > MM_FETCH_BYTES || !logits || !ticket)
        return MM_EINVAL;
    s->picks = 0;
    MM_TRY(OPS->argmax(CTX, logits, m->c.vocab, n, m->c.vocab, s->in_d));
    s->picks = n;
    return OPS->fetch(CTX, s->in_d, (size_t)n * 4, ticket);
}

mm_err mm_model_pick_wait(const mm_model *m, mm_model_scratch *s, uint64_t ticket, int32_t *ids) {
    if (!mm_model_can_overlap(m, s))
        return MM_EUNSUPP;
    const mm_err rv = OPS->fetch_wait(CTX, ticket, ids);
    // a bad index reported here stays set on the device until a synchronize or get reports
    // and clears it: clear it now, so that the next call of this scratch does not fail for it
    if (rv == MM_EINVAL && OPS->synchronize)
        (void)OPS->synchronize(CTX);
    return rv;
}

mm_err mm_model_forward_next(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv,
                             const mm_model_rows *rows, const bool *want_logits, float *logits) {
    MM_TRY(check_rows(s, rows->n_rows));
    if (!mm_model_can_overlap(m, s))
        return MM_EUNSUPP;
    if (rows->n_rows < 1)
        return MM_EINVAL;
    return forward_dev(m, s, kv, rows, NULL, want_logits, logits);
}

mm_err mm_model_embed_picks(const mm_model *m, mm_model_scratch *s, const int32_t *ids, int64_t n,
                            const int32_t *rows, const int32_t *src, int64_t np, float *h) {
    MM_TRY(check_rows(s, n));
    if (!mm_model_can_overlap(m, s))
        return MM_EUNSUPP;
    if (n < 1 || !h)
        return MM_EINVAL;
    if (!ids) {
        if (n > s->picks)
            return MM_EINVAL;
        return OPS->embed(CTX, &m->embed, s->in_d, n, h, m->c.d_model);
    }
    const int64_t H = m->c.n_heads, K = m->c.top_k;
    if (np < 0 || np > n || (np > 0 && (!rows || !src)) ||
        n + 2 * np > s->max_rows * (H > K ? H : K)) // (idx_d: the ids, then src, then rows)
        return MM_EINVAL;
    for (int64_t k = 0; k < np; k++)
        if (rows[k] < 0 || rows[k] >= n || src[k] < 0 || src[k] >= s->picks)
            return MM_EINVAL;
    for (int64_t i = 0; i < n; i++) // (a pick's row too: a placeholder the copy overwrites)
        if (ids[i] < 0 || ids[i] >= m->c.vocab)
            return MM_EINVAL;
    MM_TRY(OPS->set(CTX, s->idx_d, ids, (size_t)n * 4));
    if (np > 0) {
        MM_TRY(OPS->set(CTX, s->idx_d + n, src, (size_t)np * 4));
        MM_TRY(OPS->set(CTX, s->idx_d + n + np, rows, (size_t)np * 4));
        // the picks' ids into their rows: 4-byte words copied as they are (width 1)
        MM_TRY(OPS->copy_rows(CTX, (const float *)s->in_d, 1, s->idx_d + n, (float *)s->idx_d, 1,
                              s->idx_d + n + np, np, 1));
    }
    return OPS->embed(CTX, &m->embed, s->idx_d, n, h, m->c.d_model);
}

mm_err mm_model_forward(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv,
                        const mm_model_rows *rows, const int32_t *ids, const bool *want_logits,
                        float *logits) {
    const int64_t n = rows->n_rows, D = m->c.d_model;
    MM_TRY(check_rows(s, n));
    if (!ids && n > 0)
        return MM_EINVAL;
    if (n == 0)
        return MM_OK;
    if (s->dev)
        return forward_dev(m, s, kv, rows, ids, want_logits, logits);
    MM_TRY(mm_model_embed(m, s, ids, n, s->h));
    for (int l = 0; l < m->c.n_layers; l++) {
        MM_TRY(mm_model_attn_forward(m, s, l, kv, rows, s->h));
        MM_TRY(mm_model_ffn_norm(m, s, l, s->h, n, s->x));
        if (mm_model_layer_is_moe(m, l)) {
            MM_TRY(moe_layer(m, s, l, n));
        } else {
            MM_TRY(mm_model_shared_forward(m, s, l, s->x, n, s->sh));
            MM_TRY(mm_model_combine(m, s, l, s->h, n, 0, NULL, NULL, s->sh));
        }
    }
    int64_t nw = 0;
    for (int64_t i = 0; i < n; i++)
        if (!want_logits || want_logits[i])
            s->want_idx[nw++] = (int32_t)i;
    if (nw == 0)
        return MM_OK;
    MM_TRY(OPS->set(CTX, s->idx_d, s->want_idx, (size_t)nw * 4));
    MM_TRY(OPS->copy_rows(CTX, s->h, D, s->idx_d, s->xin, D, NULL, nw, D));
    MM_TRY(mm_model_final_norm(m, s, s->xin, nw, s->hn));
    return mm_model_head(m, s, s->hn, nw, logits);
}
