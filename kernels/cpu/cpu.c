// SPDX-License-Identifier: MIT
// The CPU backend: every op of kernels.h on host memory, threaded over a fixed worker pool,
// with AVX2+FMA dot products chosen at run time (dot.c).
//
// Design notes: work is split over output elements that are independent (weight rows for
// matmul, token rows for norms, (row, head) pairs for attention), never inside a reduction,
// so a result's bits do not depend on the thread count or on the other rows of the call.
// Every op completes before returning; nothing is allocated per call.
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu/dot.h"
#include "cpu/pool.h"
#include "kernels.h"

#define MAX_ROUTE_EXPERTS 1024

struct cpu_ctx {
    mm__pool *pool;
    mm__dot_fn dot;
    const char *dot_name;
};

static bool weight_ok(const mm_weight *w) {
    return w && w->data && w->rows > 0 && w->cols > 0 &&
           (w->dtype == MM_DTYPE_BF16 || w->dtype == MM_DTYPE_F16 || w->dtype == MM_DTYPE_F32);
}

// ---- buffers --------------------------------------------------------------------------------
static mm_err cpu_buffer_alloc(void *ctx, size_t n_bytes, void **out) {
    (void)ctx;
    void *p = NULL;
    if (posix_memalign(&p, 64, n_bytes ? (n_bytes + 63) & ~(size_t)63 : 64) != 0)
        return MM_ENOMEM;
    *out = p;
    return MM_OK;
}
static void cpu_buffer_free(void *ctx, void *p) {
    (void)ctx;
    free(p);
}
static mm_err cpu_copy(void *ctx, void *dst, const void *src, size_t n) {
    (void)ctx;
    if (n)
        memmove(dst, src, n);
    return MM_OK;
}
static mm_err cpu_sync(void *ctx) {
    (void)ctx;
    return MM_OK;
}

// ---- matmul ---------------------------------------------------------------------------------
struct mm_job {
    struct cpu_ctx *c;
    const mm_weight *w;
    const float *bias, *x;
    float *y;
    int64_t xs, ys, n, tile;
};

static void matmul_chunk(void *arg, int64_t j0, int64_t j1) {
    const struct mm_job *m = arg;
    const size_t row_bytes = (size_t)m->w->cols * mm_dtype_size(m->w->dtype);
    const float *xp[4];
    float out[4];
    for (int64_t i0 = 0; i0 < m->n; i0 += m->tile) { // x tiles that stay in cache
        int64_t i1 = i0 + m->tile < m->n ? i0 + m->tile : m->n;
        for (int64_t j = j0; j < j1; j++) {
            const void *wr = (const char *)m->w->data + (size_t)j * row_bytes;
            float b = m->bias ? m->bias[j] : 0.0f;
            for (int64_t i = i0; i < i1; i += 4) {
                int nr = i1 - i >= 4 ? 4 : (int)(i1 - i);
                for (int r = 0; r < nr; r++)
                    xp[r] = m->x + (i + r) * m->xs;
                m->c->dot(m->w->dtype, xp, nr, wr, m->w->cols, out);
                for (int r = 0; r < nr; r++)
                    m->y[(i + r) * m->ys + j] = m->bias ? out[r] + b : out[r];
            }
        }
    }
}

static mm_err cpu_matmul(void *ctx, const mm_weight *w, const float *bias, const float *x,
                         int64_t x_stride, float *y, int64_t y_stride, int64_t n_rows) {
    if (!weight_ok(w) || !x || !y || n_rows < 0)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    int64_t tile = (256 * 1024) / (w->cols * 4);
    tile = tile < 4 ? 4 : (tile & ~(int64_t)3);
    struct mm_job m = {ctx, w, bias, x, y, x_stride, y_stride, n_rows, tile};
    // at least ~32k multiply-adds per chunk before waking a worker
    int64_t min_rows = 32768 / (w->cols * n_rows) + 1;
    mm__pool_run(((struct cpu_ctx *)ctx)->pool, w->rows, min_rows, matmul_chunk, &m);
    return MM_OK;
}

// ---- rmsnorm --------------------------------------------------------------------------------
struct norm_job {
    const mm_weight *w;
    float eps;
    const float *x;
    float *y;
    int64_t xs, ys;
};

static void norm_chunk(void *arg, int64_t b, int64_t e) {
    const struct norm_job *j = arg;
    const int64_t d = j->w->cols;
    for (int64_t i = b; i < e; i++) {
        const float *x = j->x + i * j->xs;
        float *y = j->y + i * j->ys;
        float ss = 0.0f;
        for (int64_t k = 0; k < d; k++)
            ss += x[k] * x[k];
        float r = 1.0f / sqrtf(ss / (float)d + j->eps);
        for (int64_t k = 0; k < d; k++)
            y[k] = mm__wget(j->w->dtype, j->w->data, k) * (x[k] * r);
    }
}

static mm_err cpu_rmsnorm(void *ctx, const mm_weight *w, float eps, const float *x,
                          int64_t x_stride, float *y, int64_t y_stride, int64_t n_rows) {
    if (!weight_ok(w) || w->rows != 1 || !x || !y)
        return MM_EINVAL;
    struct norm_job j = {w, eps, x, y, x_stride, y_stride};
    mm__pool_run(((struct cpu_ctx *)ctx)->pool, n_rows, 4096 / w->cols + 1, norm_chunk, &j);
    return MM_OK;
}

// ---- rope -----------------------------------------------------------------------------------
static void rope_chunk(void *arg, int64_t b, int64_t e) {
    const struct mm_rope_args *a = arg;
    const int half = a->rot_dim / 2;
    for (int64_t r = b; r < e; r++) {
        float pos = (float)a->pos[r];
        for (int i = 0; i < half; i++) {
            float ang = pos * a->inv_freq[i];
            float c = cosf(ang) * a->mscale, s = sinf(ang) * a->mscale;
            for (int h = 0; h < a->n_heads; h++) {
                float *x = a->x + r * a->row_stride + h * a->head_stride + a->rot_offset;
                int i0 = a->style == MM_ROPE_NEOX ? i : 2 * i;
                int i1 = a->style == MM_ROPE_NEOX ? i + half : 2 * i + 1;
                float x0 = x[i0], x1 = x[i1];
                x[i0] = x0 * c - x1 * s;
                x[i1] = x1 * c + x0 * s;
            }
        }
    }
}

static mm_err cpu_rope(void *ctx, const struct mm_rope_args *a) {
    if (!a || !a->x || !a->pos || !a->inv_freq || a->rot_dim <= 0 || (a->rot_dim & 1))
        return MM_EINVAL;
    mm__pool_run(((struct cpu_ctx *)ctx)->pool, a->n_rows, 16, rope_chunk, (void *)a);
    return MM_OK;
}

// ---- paged KV cache -------------------------------------------------------------------------
static inline float *kv_slot(const struct mm_kv_view *kv, int32_t seq, int32_t pos) {
    int32_t blk = kv->block_tables[(int64_t)seq * kv->max_blocks + pos / kv->block_size];
    return kv->base + (int64_t)blk * kv->block_stride + (int64_t)(pos % kv->block_size) *
                                                            kv->slot_stride;
}

static mm_err cpu_kv_store(void *ctx, const struct mm_kv_store_args *a) {
    (void)ctx;
    if (!a || !a->kv.base || !a->kv.block_tables || a->kv.dtype != MM_DTYPE_F32)
        return MM_EINVAL; // f32 caches only (no kv_dtype: the CPU never asks for bf16)
    const int64_t nk = (int64_t)a->kv.n_kv_heads * a->kv.head_dim_k;
    const int64_t nv = (int64_t)a->kv.n_kv_heads * a->kv.head_dim_v;
    for (int64_t r = 0; r < a->n_rows; r++) {
        if (a->row_pos[r] < 0 || a->row_pos[r] / a->kv.block_size >= a->kv.max_blocks ||
            a->kv.block_tables[(int64_t)a->row_seq[r] * a->kv.max_blocks +
                               a->row_pos[r] / a->kv.block_size] < 0)
            return MM_EINVAL;
        float *slot = kv_slot(&a->kv, a->row_seq[r], a->row_pos[r]);
        memcpy(slot, a->k + r * a->k_stride, (size_t)nk * 4);
        memcpy(slot + nk, a->v + r * a->v_stride, (size_t)nv * 4);
    }
    return MM_OK;
}

static void attn_chunk(void *arg, int64_t b, int64_t e) {
    const struct mm_attn_args *a = arg;
    const struct mm_kv_view *kv = &a->kv;
    const int dk = kv->head_dim_k, dv = kv->head_dim_v;
    const int group = a->n_heads / kv->n_kv_heads;
    const int64_t v_off = (int64_t)kv->n_kv_heads * dk;
    for (int64_t t = b; t < e; t++) {
        int64_t r = t / a->n_heads;
        int h = (int)(t % a->n_heads), kvh = h / group;
        const float *q = a->q + r * a->q_stride + (int64_t)h * dk;
        float *o = a->out + r * a->out_stride + (int64_t)h * dv;
        int32_t seq = a->row_seq[r], pos = a->row_pos[r];
        int32_t first = 0;
        if (a->window > 0 && pos - a->window + 1 > 0)
            first = pos - a->window + 1;
        // pass 1: max score; pass 2: exp-weighted sum of v (keys in position order)
        float mx = -INFINITY;
        for (int32_t p = first; p <= pos; p++) {
            const float *k = kv_slot(kv, seq, p) + (int64_t)kvh * dk;
            float s = 0.0f;
            for (int d = 0; d < dk; d++)
                s += q[d] * k[d];
            s *= a->scale;
            if (s > mx)
                mx = s;
        }
        for (int d = 0; d < dv; d++)
            o[d] = 0.0f;
        float sum = 0.0f;
        for (int32_t p = first; p <= pos; p++) {
            const float *slot = kv_slot(kv, seq, p);
            const float *k = slot + (int64_t)kvh * dk;
            const float *v = slot + v_off + (int64_t)kvh * dv;
            float s = 0.0f;
            for (int d = 0; d < dk; d++)
                s += q[d] * k[d];
            s *= a->scale;
            float pr = expf(s - mx);
            sum += pr;
            for (int d = 0; d < dv; d++)
                o[d] += pr * v[d];
        }
        float inv = 1.0f / sum;
        for (int d = 0; d < dv; d++)
            o[d] *= inv;
    }
}

static mm_err cpu_attention(void *ctx, const struct mm_attn_args *a) {
    if (!a || !a->q || !a->out || a->n_heads <= 0 || a->kv.n_kv_heads <= 0 ||
        a->n_heads % a->kv.n_kv_heads != 0 || a->kv.dtype != MM_DTYPE_F32)
        return MM_EINVAL;
    for (int64_t r = 0; r < a->n_rows; r++)
        if (a->row_pos[r] < 0 || a->row_pos[r] / a->kv.block_size >= a->kv.max_blocks)
            return MM_EINVAL;
    mm__pool_run(((struct cpu_ctx *)ctx)->pool, a->n_rows * a->n_heads, 1, attn_chunk,
                 (void *)a);
    return MM_OK;
}

// ---- small row ops --------------------------------------------------------------------------
static mm_err cpu_embed(void *ctx, const mm_weight *t, const int32_t *ids, int64_t n_rows,
                        float *out, int64_t out_stride) {
    (void)ctx;
    if (!weight_ok(t) || !ids || !out)
        return MM_EINVAL;
    for (int64_t i = 0; i < n_rows; i++)
        if (ids[i] < 0 || ids[i] >= t->rows)
            return MM_EINVAL;
    const size_t row_bytes = (size_t)t->cols * mm_dtype_size(t->dtype);
    for (int64_t i = 0; i < n_rows; i++) {
        const void *src = (const char *)t->data + (size_t)ids[i] * row_bytes;
        for (int64_t k = 0; k < t->cols; k++)
            out[i * out_stride + k] = mm__wget(t->dtype, src, k);
    }
    return MM_OK;
}

static mm_err cpu_swiglu(void *ctx, const float *g, int64_t gs, const float *u, int64_t us,
                         float *o, int64_t os, int64_t n_rows, int64_t dim) {
    (void)ctx;
    for (int64_t i = 0; i < n_rows; i++)
        for (int64_t j = 0; j < dim; j++) {
            float x = g[i * gs + j];
            o[i * os + j] = x / (1.0f + expf(-x)) * u[i * us + j];
        }
    return MM_OK;
}

static mm_err cpu_axpy(void *ctx, const float *alpha, const float *x, int64_t xs, float *y,
                       int64_t ys, int64_t n_rows, int64_t dim) {
    (void)ctx;
    for (int64_t i = 0; i < n_rows; i++) {
        float a = alpha ? alpha[i] : 1.0f;
        for (int64_t j = 0; j < dim; j++) {
            float p = alpha ? a * x[i * xs + j] : x[i * xs + j];
            y[i * ys + j] = y[i * ys + j] + p;
        }
    }
    return MM_OK;
}

static mm_err cpu_sigmoid(void *ctx, float *x, int64_t n) {
    (void)ctx;
    for (int64_t i = 0; i < n; i++)
        x[i] = 1.0f / (1.0f + expf(-x[i]));
    return MM_OK;
}

static mm_err cpu_copy_rows(void *ctx, const float *src, int64_t ss, const int32_t *si,
                            float *dst, int64_t ds, const int32_t *di, int64_t n_rows,
                            int64_t dim) {
    (void)ctx;
    for (int64_t i = 0; i < n_rows; i++) {
        int64_t a = si ? si[i] : i, b = di ? di[i] : i;
        if (a < 0 || b < 0)
            return MM_EINVAL;
        memcpy(dst + b * ds, src + a * ss, (size_t)dim * 4);
    }
    return MM_OK;
}

static mm_err cpu_fill(void *ctx, float *x, float value, int64_t n) {
    (void)ctx;
    for (int64_t i = 0; i < n; i++)
        x[i] = value;
    return MM_OK;
}

// ---- routing --------------------------------------------------------------------------------
// better(a, b): a ranks before b (higher score, then lower id)
static inline bool better(const float *s, int a, int b) {
    return s[a] > s[b] || (s[a] == s[b] && a < b);
}

static mm_err cpu_route(void *ctx, const struct mm_route_params *p, const float *logits,
                        int64_t ls, int64_t n_rows, int32_t *ids, float *weights) {
    (void)ctx;
    const int E = p->n_experts, K = p->top_k;
    if (E <= 0 || E > MAX_ROUTE_EXPERTS || K <= 0 || K > E)
        return MM_EINVAL;
    const bool grouped = p->n_group > 1;
    if (grouped && (E % p->n_group || p->topk_group <= 0 || p->topk_group > p->n_group ||
                    E / p->n_group < 2))
        return MM_EINVAL;
    float prob[MAX_ROUTE_EXPERTS], choice[MAX_ROUTE_EXPERTS];
    for (int64_t r = 0; r < n_rows; r++) {
        const float *l = logits + r * ls;
        if (p->score == MM_ROUTE_SOFTMAX) {
            float mx = l[0];
            for (int e = 1; e < E; e++)
                mx = l[e] > mx ? l[e] : mx;
            float sum = 0.0f;
            for (int e = 0; e < E; e++) {
                prob[e] = expf(l[e] - mx);
                sum += prob[e];
            }
            for (int e = 0; e < E; e++)
                prob[e] /= sum;
        } else {
            for (int e = 0; e < E; e++)
                prob[e] = 1.0f / (1.0f + expf(-l[e]));
        }
        for (int e = 0; e < E; e++)
            choice[e] = p->bias ? prob[e] + p->bias[e] : prob[e];
        if (grouped) {
            const int G = p->n_group, per = E / G;
            float gs[MAX_ROUTE_EXPERTS];
            bool keep[MAX_ROUTE_EXPERTS];
            for (int g = 0; g < G; g++) { // sum of the group's two best choice scores
                const float *c = choice + g * per;
                int b0 = 0;
                for (int i = 1; i < per; i++)
                    if (better(c, i, b0))
                        b0 = i;
                int b1 = b0 == 0 ? 1 : 0;
                for (int i = 0; i < per; i++)
                    if (i != b0 && better(c, i, b1))
                        b1 = i;
                gs[g] = c[b0] + c[b1];
                keep[g] = false;
            }
            for (int t = 0; t < p->topk_group; t++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || better(gs, g, best)))
                        best = g;
                keep[best] = true;
            }
            for (int e = 0; e < E; e++)
                if (!keep[e / per])
                    choice[e] = 0.0f; // transformers' masked_fill(..., 0.0)
        }
        int32_t *id = ids + r * K;
        float *w = weights + r * K;
        for (int t = 0; t < K; t++) { // selection of the top_k by choice score
            int best = -1;
            for (int e = 0; e < E; e++) {
                bool taken = false;
                for (int u = 0; u < t; u++)
                    taken |= id[u] == e;
                if (!taken && (best < 0 || better(choice, e, best)))
                    best = e;
            }
            id[t] = best;
            w[t] = prob[best];
        }
        if (p->renorm) {
            float sum = 0.0f;
            for (int t = 0; t < K; t++)
                sum += w[t];
            sum += p->renorm_eps;
            for (int t = 0; t < K; t++)
                w[t] /= sum;
        }
        if (p->scale != 1.0f && p->scale != 0.0f)
            for (int t = 0; t < K; t++)
                w[t] *= p->scale;
    }
    return MM_OK;
}

// ---- "cpu-dev": the CPU kernels with a device backend's contract ------------------------------
// host_memory false (weights copied in, data moved by set/get), and the device path's ops:
// route_plan, moe_matmul_dev, argmax, fetch/fetch_wait, each run at once (the CPU has no
// queue: a fetch's slot holds the bytes when fetch returns). So the model's and the mesh
// router's device paths (device routing plans, device picks, steps begun early) run, and are
// tested, on a machine without a GPU. Slower than "cpu" (every weight copied once at load).
static mm_err cpu_route_plan(void *ctx, const int32_t *ids, const float *weights, int64_t n,
                             int k, int e, int32_t *offs, int32_t *src, int32_t *dst,
                             float *wt) {
    (void)ctx;
    if (!ids || !offs || !src || !dst || n < 0 || k < 1 || e < 1 || (wt && !weights))
        return MM_EINVAL;
    const int64_t nk = n * k;
    mm_err rv = MM_OK;
    // Counting sort in offs itself: offs[x + 1] counts expert x's slots (an id out of range
    // counts as expert 0, as the contract says, and is reported now); summed, offs[x + 1] is
    // expert x's end; shifted up one place, expert x's start, the cursor its slots are written
    // at, which ends at its end: offs then holds the plan's offsets.
    memset(offs, 0, (size_t)(e + 1) * 4);
    for (int64_t t = 0; t < nk; t++) {
        if (ids[t] < 0 || ids[t] >= e)
            rv = MM_EINVAL;
        offs[(ids[t] >= 0 && ids[t] < e ? ids[t] : 0) + 1]++;
    }
    for (int x = 1; x < e; x++)
        offs[x + 1] += offs[x];
    for (int x = e; x > 0; x--)
        offs[x] = offs[x - 1];
    for (int64_t t = 0; t < nk; t++) { // stable: one expert's slots in slot order
        const int32_t p = offs[(ids[t] >= 0 && ids[t] < e ? ids[t] : 0) + 1]++;
        src[p] = (int32_t)(t / k);
        dst[p] = (int32_t)t;
    }
    if (wt)
        for (int64_t t = 0; t < nk; t++)
            wt[(t % k) * n + t / k] = weights[t];
    return rv;
}

static mm_err cpu_moe_matmul_dev(void *ctx, const void *const *experts, enum mm_dtype dtype,
                                 int64_t rows, int64_t cols, int n_experts, const int32_t *offs,
                                 const float *x, int64_t xs, float *y, int64_t ys,
                                 int64_t n_rows) {
    if (!experts || !offs || n_experts < 1 || offs[0] != 0 || offs[n_experts] > n_rows)
        return MM_EINVAL;
    for (int i = 0; i < n_experts; i++) { // rows from offs[n_experts] on belong to none
        if (offs[i + 1] < offs[i])
            return MM_EINVAL;
        if (offs[i + 1] == offs[i])
            continue;
        const mm_weight w = {dtype, rows, cols, experts[i]};
        MM_TRY(cpu_matmul(ctx, &w, NULL, x + (int64_t)offs[i] * xs, xs, y + (int64_t)offs[i] * ys,
                          ys, offs[i + 1] - offs[i]));
    }
    return MM_OK;
}

// the largest of each row, the lowest index on ties, NaN never chosen (a row of NaNs: 0)
static mm_err cpu_argmax(void *ctx, const float *logits, int64_t stride, int64_t n, int vocab,
                         int32_t *ids) {
    (void)ctx;
    if (!logits || !ids || n < 0 || vocab < 1)
        return MM_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        const float *r = logits + i * stride;
        int32_t best = -1;
        float bv = 0;
        for (int j = 0; j < vocab; j++)
            if (r[j] == r[j] && (best < 0 || r[j] > bv))
                best = j, bv = r[j];
        ids[i] = best < 0 ? 0 : best;
    }
    return MM_OK;
}

struct cpu_dev_ctx {
    struct cpu_ctx cpu; // (first: the CPU kernels take it as their ctx)
    uint64_t fetch_next;
    uint64_t fetch_ticket[MM_FETCH_SLOTS]; // 0: free
    size_t fetch_n[MM_FETCH_SLOTS];
    unsigned char fetch_buf[MM_FETCH_SLOTS][MM_FETCH_BYTES];
};

static mm_err cpu_fetch(void *ctx, const void *src, size_t n_bytes, uint64_t *ticket) {
    struct cpu_dev_ctx *c = ctx;
    if (!src || !ticket || n_bytes == 0 || n_bytes > MM_FETCH_BYTES)
        return MM_EINVAL;
    const uint64_t t = c->fetch_next;
    const int slot = (int)(t % MM_FETCH_SLOTS);
    if (c->fetch_ticket[slot] != 0)
        return MM_EBUSY;
    memcpy(c->fetch_buf[slot], src, n_bytes);
    c->fetch_ticket[slot] = t;
    c->fetch_n[slot] = n_bytes;
    c->fetch_next = t + 1;
    *ticket = t;
    return MM_OK;
}

static mm_err cpu_fetch_wait(void *ctx, uint64_t ticket, void *dst) {
    struct cpu_dev_ctx *c = ctx;
    const int slot = (int)(ticket % MM_FETCH_SLOTS);
    if (!dst || ticket == 0 || c->fetch_ticket[slot] != ticket)
        return MM_EINVAL;
    memcpy(dst, c->fetch_buf[slot], c->fetch_n[slot]);
    c->fetch_ticket[slot] = 0;
    return MM_OK;
}

// ---- table ----------------------------------------------------------------------------------
static void cpu_close(void *ctx) {
    struct cpu_ctx *c = ctx;
    if (!c)
        return;
    mm__pool_free(c->pool);
    free(c);
}

static const struct mm_backend_ops cpu_ops = {
    .version = MM_BACKEND_V1,
    .name = "cpu",
    .host_memory = true,
    .close = cpu_close,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .set = cpu_copy,
    .get = cpu_copy,
    .synchronize = cpu_sync,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .embed = cpu_embed,
    .swiglu = cpu_swiglu,
    .route = cpu_route,
    .axpy = cpu_axpy,
    .sigmoid = cpu_sigmoid,
    .copy_rows = cpu_copy_rows,
    .fill = cpu_fill,
};

static struct mm_backend_ops cpu_dev_ops; // cpu_ops with the device contract (cpu-dev above)
static pthread_once_t cpu_dev_once = PTHREAD_ONCE_INIT;

static void cpu_dev_ops_init(void) {
    struct mm_backend_ops o = cpu_ops;
    o.name = "cpu-dev";
    o.host_memory = false;
    o.route_plan = cpu_route_plan;
    o.moe_matmul_dev = cpu_moe_matmul_dev;
    o.argmax = cpu_argmax;
    o.fetch = cpu_fetch;
    o.fetch_wait = cpu_fetch_wait;
    cpu_dev_ops = o;
}

static mm_err cpu_open(mm_backend *be, const mm_backend_params *p, bool dev, char err[MM_ERRLEN]);

mm_err mm_cpu_backend_open(mm_backend *be, const mm_backend_params *p, char err[MM_ERRLEN]) {
    return cpu_open(be, p, false, err);
}

mm_err mm_cpu_dev_backend_open(mm_backend *be, const mm_backend_params *p,
                               char err[MM_ERRLEN]) {
    return cpu_open(be, p, true, err);
}

static mm_err cpu_open(mm_backend *be, const mm_backend_params *p, bool dev, char err[MM_ERRLEN]) {
    // (a cpu-dev context is a CPU context followed by its fetch slots)
    struct cpu_ctx *c = dev ? calloc(1, sizeof(struct cpu_dev_ctx)) : calloc(1, sizeof(*c));
    if (!c)
        return MM_ENOMEM;
    if (dev)
        ((struct cpu_dev_ctx *)c)->fetch_next = 1;
    int n = p && p->n_threads > 0 ? p->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1)
        n = 1;
    if (n > 256)
        n = 256;
    mm_err rv = mm__pool_new(&c->pool, n);
    if (rv != MM_OK) {
        free(c);
        return mm_errf(err, rv, "cpu backend: cannot start %d worker threads", n);
    }
    c->dot = mm__dot_select(&c->dot_name);
    if (dev)
        pthread_once(&cpu_dev_once, cpu_dev_ops_init); // (read-only afterwards)
    be->ops = dev ? &cpu_dev_ops : &cpu_ops;
    be->ctx = c;
    be->n_threads = n;
    return MM_OK;
}
