// SPDX-License-Identifier: MIT
// The engine's device path (mm_model_forward on a backend with route_plan, moe_matmul_dev,
// argmax and graphs) checked without a GPU: the CPU table is dressed as a device backend
// (host_memory false, so weights are uploaded and experts get [gate; up] buffers and device
// pointer tables), with host versions of the new members and a graph recorder that stores
// each op with its arguments while capturing and replays them on launch. Its logits must
// equal the plain CPU path's bit for bit (prefill, decode steps, a batch of three; MoE with
// and without shared experts, MLA), recorded steps must be replayed, and the device argmax
// must pick the host argmax's ids.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mm_test.h"
#include "mm/dtype.h"
#include "mm/engine.h"
#include "mm/kv_cache.h"
#include "mm/model.h"

// the tensor-core attention contract (kernels/cuda/attention_tc.cu, the default on CUDA): 0
// pins ops.cu's f32 kernels, < 0 back to the default (absent from builds without CUDA)
extern void mm_gpu_set_attention_tc(int mode) __attribute__((weak));
// bf16 KV caches under the contract (attention_tc.cu): 0 f32 always, 1 bf16 where allowed, < 0
// back to MM_GPU_KV_BF16
extern void mm_gpu_set_kv_bf16(int mode) __attribute__((weak));
static enum mm_dtype g_run_kv_dtype; // the cache dtype of run()'s last model

static const struct mm_backend_ops *g_cpu; // the real CPU table

// ---- graph recorder: while capturing, ops are stored (thunk + a copy of the arguments) -------
typedef mm_err (*thunk_fn)(void *ctx, const void *blob);
struct rec {
    thunk_fn fn;
    void *blob;
};
struct graph {
    struct rec *r;
    int n, cap;
};
static struct graph *g_rec; // the graph being recorded, or NULL
static int g_captures, g_launches;
// g_stale_odd: graph_launch answers MM_ECLOSED (a recording the backend no longer honours,
// nothing run) at every odd-numbered launch, the first after each recording among them;
// g_stale_n counts those answers
static bool g_stale_odd;
static int g_stale_n;

static mm_err push(thunk_fn fn, const void *blob, size_t n) {
    struct graph *g = g_rec;
    if (g->n == g->cap) {
        g->cap = g->cap ? 2 * g->cap : 64;
        g->r = realloc(g->r, (size_t)g->cap * sizeof(*g->r));
        MM_TRUE(g->r != NULL);
    }
    void *b = malloc(n);
    MM_TRUE(b != NULL);
    memcpy(b, blob, n);
    g->r[g->n++] = (struct rec){fn, b};
    return MM_OK;
}

#define RECORD(thunk, args)                                                                  \
    do {                                                                                     \
        if (g_rec)                                                                           \
            return push(thunk, &(args), sizeof(args));                                       \
        return thunk(ctx, &(args));                                                          \
    } while (0)

struct a_matmul {
    const mm_weight *w; // the model's, alive as long as the model
    const float *bias, *x;
    int64_t xs;
    float *y;
    int64_t ys, n;
};
static mm_err t_matmul(void *ctx, const void *b) {
    const struct a_matmul *a = b;
    return g_cpu->matmul(ctx, a->w, a->bias, a->x, a->xs, a->y, a->ys, a->n);
}
static mm_err w_matmul(void *ctx, const mm_weight *w, const float *bias, const float *x,
                       int64_t xs, float *y, int64_t ys, int64_t n) {
    struct a_matmul a = {w, bias, x, xs, y, ys, n};
    RECORD(t_matmul, a);
}

struct a_rmsnorm {
    const mm_weight *w;
    float eps;
    const float *x;
    int64_t xs;
    float *y;
    int64_t ys, n;
};
static mm_err t_rmsnorm(void *ctx, const void *b) {
    const struct a_rmsnorm *a = b;
    return g_cpu->rmsnorm(ctx, a->w, a->eps, a->x, a->xs, a->y, a->ys, a->n);
}
static mm_err w_rmsnorm(void *ctx, const mm_weight *w, float eps, const float *x, int64_t xs,
                        float *y, int64_t ys, int64_t n) {
    struct a_rmsnorm a = {w, eps, x, xs, y, ys, n};
    RECORD(t_rmsnorm, a);
}

static mm_err t_rope(void *ctx, const void *b) { return g_cpu->rope(ctx, b); }
static mm_err w_rope(void *ctx, const struct mm_rope_args *a) { RECORD(t_rope, *a); }
static mm_err t_kv_store(void *ctx, const void *b) { return g_cpu->kv_store(ctx, b); }
static mm_err w_kv_store(void *ctx, const struct mm_kv_store_args *a) { RECORD(t_kv_store, *a); }
static mm_err t_attention(void *ctx, const void *b) { return g_cpu->attention(ctx, b); }
static mm_err w_attention(void *ctx, const struct mm_attn_args *a) { RECORD(t_attention, *a); }

struct a_embed {
    const mm_weight *t;
    const int32_t *ids;
    int64_t n;
    float *out;
    int64_t os;
};
static mm_err t_embed(void *ctx, const void *b) {
    const struct a_embed *a = b;
    return g_cpu->embed(ctx, a->t, a->ids, a->n, a->out, a->os);
}
static mm_err w_embed(void *ctx, const mm_weight *t, const int32_t *ids, int64_t n, float *out,
                      int64_t os) {
    struct a_embed a = {t, ids, n, out, os};
    RECORD(t_embed, a);
}

struct a_swiglu {
    const float *g;
    int64_t gs;
    const float *u;
    int64_t us;
    float *o;
    int64_t os, n, dim;
};
static mm_err t_swiglu(void *ctx, const void *b) {
    const struct a_swiglu *a = b;
    return g_cpu->swiglu(ctx, a->g, a->gs, a->u, a->us, a->o, a->os, a->n, a->dim);
}
static mm_err w_swiglu(void *ctx, const float *g, int64_t gs, const float *u, int64_t us,
                       float *o, int64_t os, int64_t n, int64_t dim) {
    struct a_swiglu a = {g, gs, u, us, o, os, n, dim};
    RECORD(t_swiglu, a);
}

struct a_route {
    struct mm_route_params p;
    const float *l;
    int64_t ls, n;
    int32_t *ids;
    float *w;
};
static mm_err t_route(void *ctx, const void *b) {
    const struct a_route *a = b;
    return g_cpu->route(ctx, &a->p, a->l, a->ls, a->n, a->ids, a->w);
}
static mm_err w_route(void *ctx, const struct mm_route_params *p, const float *l, int64_t ls,
                      int64_t n, int32_t *ids, float *w) {
    struct a_route a = {*p, l, ls, n, ids, w};
    RECORD(t_route, a);
}

struct a_axpy {
    const float *alpha, *x;
    int64_t xs;
    float *y;
    int64_t ys, n, dim;
};
static mm_err t_axpy(void *ctx, const void *b) {
    const struct a_axpy *a = b;
    return g_cpu->axpy(ctx, a->alpha, a->x, a->xs, a->y, a->ys, a->n, a->dim);
}
static mm_err w_axpy(void *ctx, const float *alpha, const float *x, int64_t xs, float *y,
                     int64_t ys, int64_t n, int64_t dim) {
    struct a_axpy a = {alpha, x, xs, y, ys, n, dim};
    RECORD(t_axpy, a);
}

struct a_sigmoid {
    float *x;
    int64_t n;
};
static mm_err t_sigmoid(void *ctx, const void *b) {
    const struct a_sigmoid *a = b;
    return g_cpu->sigmoid(ctx, a->x, a->n);
}
static mm_err w_sigmoid(void *ctx, float *x, int64_t n) {
    struct a_sigmoid a = {x, n};
    RECORD(t_sigmoid, a);
}

struct a_copy {
    const float *src;
    int64_t ss;
    const int32_t *si;
    float *dst;
    int64_t ds;
    const int32_t *di;
    int64_t n, dim;
};
static mm_err t_copy(void *ctx, const void *b) {
    const struct a_copy *a = b;
    return g_cpu->copy_rows(ctx, a->src, a->ss, a->si, a->dst, a->ds, a->di, a->n, a->dim);
}
static mm_err w_copy(void *ctx, const float *src, int64_t ss, const int32_t *si, float *dst,
                     int64_t ds, const int32_t *di, int64_t n, int64_t dim) {
    struct a_copy a = {src, ss, si, dst, ds, di, n, dim};
    RECORD(t_copy, a);
}

struct a_fill {
    float *x;
    float v;
    int64_t n;
};
static mm_err t_fill(void *ctx, const void *b) {
    const struct a_fill *a = b;
    return g_cpu->fill(ctx, a->x, a->v, a->n);
}
static mm_err w_fill(void *ctx, float *x, float v, int64_t n) {
    struct a_fill a = {x, v, n};
    RECORD(t_fill, a);
}

// route_plan on the host: the stable counting sort of kernels.h, read from memory at run time
struct a_plan {
    const int32_t *ids;
    const float *w;
    int64_t n;
    int k, e;
    int32_t *offs, *src, *dst;
    float *wt;
};
static mm_err t_plan(void *ctx, const void *b) {
    (void)ctx;
    const struct a_plan *a = b;
    const int64_t nk = a->n * a->k;
    memset(a->offs, 0, (size_t)(a->e + 1) * 4);
    for (int64_t t = 0; t < nk; t++) {
        if (a->ids[t] < 0 || a->ids[t] >= a->e)
            return MM_EINVAL;
        a->offs[a->ids[t] + 1]++;
    }
    for (int e = 0; e < a->e; e++)
        a->offs[e + 1] += a->offs[e];
    int32_t *next = malloc((size_t)a->e * 4);
    MM_TRUE(next != NULL);
    memcpy(next, a->offs, (size_t)a->e * 4);
    for (int64_t t = 0; t < nk; t++) {
        const int32_t p = next[a->ids[t]]++;
        a->src[p] = (int32_t)(t / a->k);
        a->dst[p] = (int32_t)t;
    }
    free(next);
    if (a->wt)
        for (int64_t t = 0; t < nk; t++)
            a->wt[(t % a->k) * a->n + t / a->k] = a->w[t];
    return MM_OK;
}
static int g_plans;
static mm_err w_plan(void *ctx, const int32_t *ids, const float *w, int64_t n, int k, int e,
                     int32_t *offs, int32_t *src, int32_t *dst, float *wt) {
    g_plans++;
    struct a_plan a = {ids, w, n, k, e, offs, src, dst, wt};
    RECORD(t_plan, a);
}

struct a_moe {
    const void *const *ex;
    enum mm_dtype dt;
    int64_t rows, cols;
    int e;
    const int32_t *offs;
    const float *x;
    int64_t xs;
    float *y;
    int64_t ys, n;
};
static mm_err t_moe(void *ctx, const void *b) {
    const struct a_moe *a = b;
    if (a->offs[0] != 0 || a->offs[a->e] != a->n)
        return MM_EINVAL;
    for (int e = 0; e < a->e; e++) {
        if (a->offs[e + 1] == a->offs[e])
            continue;
        mm_weight w = {a->dt, a->rows, a->cols, a->ex[e]};
        MM_TRY(g_cpu->matmul(ctx, &w, NULL, a->x + a->offs[e] * a->xs, a->xs,
                             a->y + a->offs[e] * a->ys, a->ys, a->offs[e + 1] - a->offs[e]));
    }
    return MM_OK;
}
static mm_err w_moe(void *ctx, const void *const *ex, enum mm_dtype dt, int64_t rows,
                    int64_t cols, int e, const int32_t *offs, const float *x, int64_t xs,
                    float *y, int64_t ys, int64_t n) {
    struct a_moe a = {ex, dt, rows, cols, e, offs, x, xs, y, ys, n};
    RECORD(t_moe, a);
}

struct a_argmax {
    const float *l;
    int64_t ls, n;
    int vocab;
    int32_t *ids;
};
static mm_err t_argmax(void *ctx, const void *b) {
    (void)ctx;
    const struct a_argmax *a = b;
    for (int64_t i = 0; i < a->n; i++) {
        int best = 0;
        for (int v = 1; v < a->vocab; v++)
            if (a->l[i * a->ls + v] > a->l[i * a->ls + best])
                best = v;
        a->ids[i] = best;
    }
    return MM_OK;
}
static mm_err w_argmax(void *ctx, const float *l, int64_t ls, int64_t n, int vocab, int32_t *ids) {
    struct a_argmax a = {l, ls, n, vocab, ids};
    RECORD(t_argmax, a);
}

// combine on the host: the axpy sequence's operations, one multiply then one add each
struct a_combine {
    const float *alpha;
    int k;
    const float *x;
    int64_t xs;
    const float *sh;
    int64_t ss;
    float *h;
    int64_t hs, n, dim;
};
static int g_combines;
static mm_err t_combine(void *ctx, const void *b) {
    (void)ctx;
    const struct a_combine *a = b;
    for (int64_t i = 0; i < a->n; i++)
        for (int64_t j = 0; j < a->dim; j++) {
            float acc = 0.0f;
            for (int r = 0; r < a->k; r++) {
                const float p = a->alpha[r * a->n + i] * a->x[(i * a->k + r) * a->xs + j];
                acc = acc + p;
            }
            if (a->sh)
                acc = acc + a->sh[i * a->ss + j];
            a->h[i * a->hs + j] = a->h[i * a->hs + j] + acc;
        }
    return MM_OK;
}
static mm_err w_combine(void *ctx, const float *alpha, int k, const float *x, int64_t xs,
                        const float *sh, int64_t ss, float *h, int64_t hs, int64_t n,
                        int64_t dim) {
    g_combines++;
    struct a_combine a = {alpha, k, x, xs, sh, ss, h, hs, n, dim};
    RECORD(t_combine, a);
}

// head_norm_rope on the host: the CPU rmsnorm (one row per head) and rope, row by row
struct a_hnr {
    float *x;
    int64_t n, stride;
    int na, nb;
    int64_t boff;
    int hd;
    const mm_weight *wa, *wb;
    float eps;
    struct mm_rope_args ra;
};
static int g_hnrs;
static mm_err t_hnr(void *ctx, const void *b) {
    const struct a_hnr *a = b;
    for (int64_t r = 0; r < a->n; r++) {
        float *xa = a->x + r * a->stride, *xb = xa + a->boff;
        if (a->wa)
            MM_TRY(g_cpu->rmsnorm(ctx, a->wa, a->eps, xa, a->hd, xa, a->hd, a->na));
        if (a->wb)
            MM_TRY(g_cpu->rmsnorm(ctx, a->wb, a->eps, xb, a->hd, xb, a->hd, a->nb));
        struct mm_rope_args ra = a->ra;
        ra.x = xa, ra.n_rows = 1, ra.row_stride = a->stride, ra.n_heads = a->na;
        ra.head_stride = a->hd, ra.pos = a->ra.pos + r;
        MM_TRY(g_cpu->rope(ctx, &ra));
        ra.x = xb, ra.n_heads = a->nb;
        MM_TRY(g_cpu->rope(ctx, &ra));
    }
    return MM_OK;
}
static mm_err w_hnr(void *ctx, float *x, int64_t n, int64_t stride, int na, int nb, int64_t boff,
                    int hd, const mm_weight *wa, const mm_weight *wb, float eps,
                    const struct mm_rope_args *ra) {
    g_hnrs++;
    struct a_hnr a = {x, n, stride, na, nb, boff, hd, wa, wb, eps, *ra};
    RECORD(t_hnr, a);
}

// moe_matmul_rows on the host: the gather, the grouped product and the scatter it stands for
struct a_moe_rows {
    struct a_moe p; // x, y: the indexed rows
    const int32_t *xi, *yi;
    const float *xu; // swiglu's up rows, or NULL
};
static int g_moe_rows;
static mm_err t_moe_rows(void *ctx, const void *b) {
    const struct a_moe_rows *a = b;
    const int64_t n = a->p.n, xw = a->p.cols, yw = a->p.rows;
    float *xg = malloc((size_t)(n * xw + 1) * 4), *yg = malloc((size_t)(n * yw + 1) * 4);
    float *ug = malloc((size_t)(n * xw + 1) * 4);
    MM_TRUE(xg != NULL && yg != NULL && ug != NULL);
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = a->xi ? a->xi[i] : i;
        memcpy(xg + i * xw, a->p.x + r * a->p.xs, (size_t)xw * 4);
        if (a->xu)
            memcpy(ug + i * xw, a->xu + r * a->p.xs, (size_t)xw * 4);
    }
    mm_err rv = a->xu ? g_cpu->swiglu(ctx, xg, xw, ug, xw, xg, xw, n, xw) : MM_OK;
    free(ug);
    struct a_moe q = a->p;
    q.x = xg, q.xs = xw, q.y = yg, q.ys = yw;
    if (rv == MM_OK)
        rv = t_moe(ctx, &q);
    for (int64_t i = 0; rv == MM_OK && i < n; i++)
        memcpy(a->p.y + (a->yi ? a->yi[i] : i) * a->p.ys, yg + i * yw, (size_t)yw * 4);
    free(xg), free(yg);
    return rv;
}
static int g_moe_rows_unsupp; // calls refused as the CUDA backend refuses them
static mm_err w_moe_rows(void *ctx, const void *const *ex, enum mm_dtype dt, int64_t rows,
                         int64_t cols, int e, const int32_t *offs, const float *x, int64_t xs,
                         const int32_t *xi, const float *xu, float *y, int64_t ys,
                         const int32_t *yi, int64_t n) {
    // like the CUDA backend (GEMV v2 only at one row per expert on average): more rows are
    // refused before anything is issued, and the model runs the separate ops instead
    const int64_t active = n < e ? n : e;
    if (active > 0 && (n + active - 1) / active > 1) {
        g_moe_rows_unsupp++;
        return MM_EUNSUPP;
    }
    g_moe_rows++;
    struct a_moe_rows a = {{ex, dt, rows, cols, e, offs, x, xs, y, ys, n}, xi, yi, xu};
    RECORD(t_moe_rows, a);
}

// add_rmsnorm on the host: axpy then rmsnorm
struct a_add_rms {
    const float *a;
    int64_t as;
    float *h;
    int64_t hs;
    const mm_weight *w;
    float eps;
    float *y;
    int64_t ys, n;
};
static int g_add_rms;
static mm_err t_add_rms(void *ctx, const void *b) {
    const struct a_add_rms *a = b;
    MM_TRY(g_cpu->axpy(ctx, NULL, a->a, a->as, a->h, a->hs, a->n, a->w->cols));
    return g_cpu->rmsnorm(ctx, a->w, a->eps, a->h, a->hs, a->y, a->ys, a->n);
}
static mm_err w_add_rms(void *ctx, const float *x, int64_t xs, float *h, int64_t hs,
                        const mm_weight *w, float eps, float *y, int64_t ys, int64_t n) {
    g_add_rms++;
    struct a_add_rms a = {x, xs, h, hs, w, eps, y, ys, n};
    RECORD(t_add_rms, a);
}

// the per-layer chain fusions on the host: the two ops each stands for
static int g_chain; // head_norm_rope_kv, route_with_plan and combine_rmsnorm calls
struct a_hnr_kv {
    struct a_hnr h;
    struct mm_kv_store_args st;
};
static mm_err t_hnr_kv(void *ctx, const void *b) {
    const struct a_hnr_kv *a = b;
    MM_TRY(t_hnr(ctx, &a->h));
    return g_cpu->kv_store(ctx, &a->st);
}
static mm_err w_hnr_kv(void *ctx, float *x, int64_t n, int64_t stride, int na, int nb,
                       int64_t boff, int hd, const mm_weight *wa, const mm_weight *wb, float eps,
                       const struct mm_rope_args *ra, const struct mm_kv_store_args *st) {
    g_hnrs++, g_chain++;
    struct a_hnr_kv a = {{x, n, stride, na, nb, boff, hd, wa, wb, eps, *ra}, *st};
    RECORD(t_hnr_kv, a);
}
struct a_route_plan {
    struct a_route r;
    struct a_plan p;
};
static mm_err t_route_plan(void *ctx, const void *b) {
    const struct a_route_plan *a = b;
    MM_TRY(t_route(ctx, &a->r));
    return t_plan(ctx, &a->p);
}
static mm_err w_route_plan(void *ctx, const struct mm_route_params *p, const float *l,
                           int64_t ls, int64_t n, int32_t *ids, float *w, int32_t *offs,
                           int32_t *src, int32_t *dst, float *wt) {
    g_plans++, g_chain++;
    struct a_route_plan a = {{*p, l, ls, n, ids, w},
                             {ids, w, n, p->top_k, p->n_experts, offs, src, dst, wt}};
    RECORD(t_route_plan, a);
}
struct a_combine_rms {
    struct a_combine c;
    struct a_rmsnorm r;
};
static mm_err t_combine_rms(void *ctx, const void *b) {
    const struct a_combine_rms *a = b;
    MM_TRY(t_combine(ctx, &a->c));
    return t_rmsnorm(ctx, &a->r);
}
static mm_err w_combine_rms(void *ctx, const float *alpha, int k, const float *x, int64_t xs,
                            const float *sh, int64_t ss, float *h, int64_t hs, int64_t n,
                            const mm_weight *w, float eps, float *y, int64_t ys) {
    g_combines++, g_chain++;
    struct a_combine_rms a = {{alpha, k, x, xs, sh, ss, h, hs, n, w->cols},
                              {w, eps, h, hs, y, ys, n}};
    RECORD(t_combine_rms, a);
}

struct a_embed_rms {
    struct a_embed e;
    struct a_rmsnorm r;
};
static mm_err t_embed_rms(void *ctx, const void *b) {
    const struct a_embed_rms *a = b;
    MM_TRY(t_embed(ctx, &a->e));
    return t_rmsnorm(ctx, &a->r);
}
static mm_err w_embed_rms(void *ctx, const mm_weight *t, const int32_t *ids, int64_t n,
                          float *out, int64_t os, const mm_weight *w, float eps, float *y,
                          int64_t ys) {
    g_chain++;
    struct a_embed_rms a = {{t, ids, n, out, os}, {w, eps, out, os, y, ys, n}};
    RECORD(t_embed_rms, a);
}

static mm_err w_set(void *ctx, void *dst, const void *src, size_t n) {
    return g_rec ? MM_EINVAL : g_cpu->set(ctx, dst, src, n);
}
static mm_err w_get(void *ctx, void *dst, const void *src, size_t n) {
    return g_rec ? MM_EINVAL : g_cpu->get(ctx, dst, src, n);
}

// fetch on the dressed table: the CPU ops have run when they return, so the copy is made at
// issue; slots and tickets behave as the GPU backend's (MM_FETCH_SLOTS, EBUSY, stale tickets)
static uint64_t g_fnext = 1, g_fticket[MM_FETCH_SLOTS];
static char g_fbuf[MM_FETCH_SLOTS][MM_FETCH_BYTES];
static size_t g_fn[MM_FETCH_SLOTS];
static int g_fetches;
static mm_err w_fetch(void *ctx, const void *src, size_t n, uint64_t *ticket) {
    (void)ctx;
    if (g_rec || !src || !ticket || n == 0 || n > MM_FETCH_BYTES)
        return MM_EINVAL;
    const int slot = (int)(g_fnext % MM_FETCH_SLOTS);
    if (g_fticket[slot])
        return MM_EBUSY;
    memcpy(g_fbuf[slot], src, n);
    g_fn[slot] = n;
    g_fticket[slot] = g_fnext;
    *ticket = g_fnext++;
    g_fetches++;
    return MM_OK;
}
static mm_err w_fetch_wait(void *ctx, uint64_t ticket, void *dst) {
    (void)ctx;
    const int slot = (int)(ticket % MM_FETCH_SLOTS);
    if (g_rec || !dst || !ticket || g_fticket[slot] != ticket)
        return MM_EINVAL;
    memcpy(dst, g_fbuf[slot], g_fn[slot]);
    g_fticket[slot] = 0;
    return MM_OK;
}
static int fetches_outstanding(void) {
    int n = 0;
    for (int i = 0; i < MM_FETCH_SLOTS; i++)
        n += g_fticket[i] != 0;
    return n;
}

static mm_err w_capture_begin(void *ctx) {
    (void)ctx;
    if (g_rec)
        return MM_EINVAL;
    g_rec = calloc(1, sizeof(*g_rec));
    return g_rec ? MM_OK : MM_ENOMEM;
}
static mm_err w_capture_end(void *ctx, void **graph) {
    (void)ctx;
    if (!g_rec)
        return MM_EINVAL;
    *graph = g_rec;
    g_rec = NULL;
    g_captures++;
    return MM_OK;
}
static mm_err w_graph_launch(void *ctx, void *graph) {
    const struct graph *g = graph;
    g_launches++;
    if (g_stale_odd && g_launches % 2 == 1) {
        g_stale_n++;
        return MM_ECLOSED;
    }
    for (int i = 0; i < g->n; i++)
        MM_TRY(g->r[i].fn(ctx, g->r[i].blob));
    return MM_OK;
}
static void w_graph_free(void *ctx, void *graph) {
    (void)ctx;
    struct graph *g = graph;
    for (int i = 0; g && i < g->n; i++)
        free(g->r[i].blob);
    if (g)
        free(g->r);
    free(g);
}

// The CPU table as a device backend with every optional member of the device path (chain:
// also the per-layer chain fusions).
static void dev_table(struct mm_backend_ops *o, bool graphs, bool chain) {
    *o = *g_cpu;
    o->name = "cpu-as-device";
    o->host_memory = false;
    o->set = w_set, o->get = w_get;
    o->matmul = w_matmul, o->rmsnorm = w_rmsnorm, o->rope = w_rope, o->kv_store = w_kv_store;
    o->attention = w_attention, o->embed = w_embed, o->swiglu = w_swiglu, o->route = w_route;
    o->axpy = w_axpy, o->sigmoid = w_sigmoid, o->copy_rows = w_copy, o->fill = w_fill;
    o->route_plan = w_plan, o->moe_matmul_dev = w_moe, o->argmax = w_argmax;
    o->combine = w_combine, o->head_norm_rope = w_hnr;
    o->moe_matmul_rows = w_moe_rows, o->add_rmsnorm = w_add_rms;
    if (chain) {
        o->head_norm_rope_kv = w_hnr_kv, o->route_with_plan = w_route_plan;
        o->combine_rmsnorm = w_combine_rms, o->embed_rmsnorm = w_embed_rms;
    }
    o->fetch = w_fetch, o->fetch_wait = w_fetch_wait;
    if (graphs) {
        o->capture_begin = w_capture_begin, o->capture_end = w_capture_end;
        o->graph_launch = w_graph_launch, o->graph_free = w_graph_free;
    }
}

// ---- the run both backends do ------------------------------------------------------------------
#define STEPS 5

// Runs a prompt of 7 (every row's logits), STEPS greedy decode steps of one row, then 3
// sequences decoding together for 3 steps; returns all logits in order (malloc'd) and the
// greedy ids picked after each single-row step (host argmax of the logits, or the backend's
// argmax through mm_model_argmax when dev_argmax).
static float *run(const char *dir, mm_backend *be, bool dev_argmax, int32_t *picked,
                  size_t *n_out) {
    char err[MM_ERRLEN] = "";
    mm_model *m = NULL;
    MM_PASS(mm_model_open(&m, dir, be, err));
    const mm_model_config *c = mm_model_cfg(m);
    const int V = c->vocab;
    mm_model_scratch *s = NULL;
    MM_PASS(mm_model_scratch_new(&s, m, 8, err));
    mm_kv_params kp;
    mm_model_kv_params(m, &kp);
    kp.max_seqs = 4;
    kp.max_ctx = 64;
    kp.budget_bytes = mm_kv_token_bytes(&kp) * (64 + 16) * 4;
    g_run_kv_dtype = kp.dtype;
    mm_kv_cache *kv = NULL;
    MM_PASS(mm_kv_cache_new(&kv, &kp, be, err));
    float *lg = NULL;
    MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)8 * V * 4, (void **)&lg));
    const size_t total = (size_t)(7 + STEPS + 3 * 3) * V;
    float *all = malloc(total * 4), *o = all;
    int32_t seq[3];
    for (int i = 0; i < 3; i++)
        MM_PASS(mm_kv_cache_seq_new(kv, &seq[i]));
    int32_t ids[8] = {11, 42, 7, 300 % V, 5, 99 % V, 18}, pos[8], sq[8];
    for (int i = 0; i < 7; i++)
        pos[i] = i, sq[i] = seq[0];
    MM_PASS(mm_kv_cache_reserve(kv, seq[0], 7));
    mm_model_rows rows = {.n_rows = 7, .seq = sq, .pos = pos};
    MM_PASS(mm_model_forward(m, s, kv, &rows, ids, NULL, lg));
    MM_PASS(be->ops->get(be->ctx, o, lg, (size_t)7 * V * 4));
    int32_t tok = 0;
    for (int v = 1; v < V; v++)
        tok = o[6 * V + v] > o[6 * V + tok] ? v : tok;
    o += 7 * V;
    for (int t = 0; t < STEPS; t++) {
        pos[0] = 7 + t;
        sq[0] = seq[0];
        MM_PASS(mm_kv_cache_reserve(kv, seq[0], pos[0] + 1));
        rows.n_rows = 1;
        MM_PASS(mm_model_forward(m, s, kv, &rows, &tok, NULL, lg));
        MM_PASS(be->ops->get(be->ctx, o, lg, (size_t)V * 4));
        if (dev_argmax) {
            MM_PASS(mm_model_argmax(m, s, lg, 1, &tok));
        } else {
            MM_FAIL(mm_model_argmax(m, s, lg, 1, &tok), MM_EUNSUPP);
            tok = 0;
            for (int v = 1; v < V; v++)
                tok = o[v] > o[tok] ? v : tok;
        }
        picked[t] = tok;
        o += V;
    }
    // three sequences together (one of them long, two new ones at different positions)
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < 3; i++) {
            sq[i] = seq[i];
            pos[i] = mm_kv_cache_seq_len(kv, seq[i]);
            ids[i] = (int32_t)((t * 31 + i * 7 + 3) % V);
            MM_PASS(mm_kv_cache_reserve(kv, seq[i], pos[i] + 1));
        }
        rows.n_rows = 3;
        bool want[3] = {true, t != 1, true};
        MM_PASS(mm_model_forward(m, s, kv, &rows, ids, want, lg));
        const int nw = 2 + (t != 1);
        MM_PASS(be->ops->get(be->ctx, o, lg, (size_t)nw * V * 4));
        o += (size_t)3 * V; // the unwanted row's place stays as it was (compared: both alike)
    }
    be->ops->buffer_free(be->ctx, lg);
    mm_kv_cache_free(kv);
    mm_model_scratch_free(s);
    mm_model_close(m);
    *n_out = total;
    return all;
}

// cpu_fixture: the CPU backend (its table kept in g_cpu) and fixture name's directory in dir.
static mm_backend *cpu_fixture(const char *name, char dir[256]) {
    char err[MM_ERRLEN] = "";
    snprintf(dir, 256, "tests/fixtures/models/%s", name);
    mm_backend *be = NULL;
    mm_backend_params bp = {.n_threads = 2};
    MM_PASS(mm_backend_open(&be, "cpu", &bp, err));
    g_cpu = be->ops;
    return be;
}

static void check(const char *name, bool graphs, bool chain) {
    char dir[256];
    mm_backend *be = cpu_fixture(name, dir);
    int32_t want_ids[STEPS], got_ids[STEPS];
    size_t n_ref = 0, n_dev = 0;
    float *ref = run(dir, be, false, want_ids, &n_ref);
    struct mm_backend_ops dev;
    dev_table(&dev, graphs, chain);
    be->ops = &dev;
    g_captures = g_launches = g_plans = g_combines = g_hnrs = g_moe_rows = g_add_rms = 0;
    g_moe_rows_unsupp = g_chain = 0;
    float *got = run(dir, be, true, got_ids, &n_dev);
    be->ops = g_cpu;
    MM_EQ(n_ref, n_dev);
    // the unwanted row of the batch's middle step is uninitialised in both: mask it out
    for (size_t i = 0; i < n_ref; i++)
        if (memcmp(&ref[i], &got[i], 4) != 0) {
            const size_t V = n_ref / (7 + STEPS + 9), row = i / V;
            if (row == 7 + STEPS + 3 + 2)
                continue;
            MM_TEST_FAIL_("%s%s: logit row %zu token %zu differs: %.9g vs %.9g (CPU path)", name,
                          graphs ? " (graphs)" : "", row, i % V, got[i], ref[i]);
        }
    for (int t = 0; t < STEPS; t++)
        MM_EQ(got_ids[t], want_ids[t]);
    MM_TRUE(g_plans > 0); // the device routing plan was used
    MM_TRUE(g_combines > 0);
    MM_TRUE(g_add_rms > 0);  // the residual add fused into the FFN norm
    MM_TRUE(g_moe_rows > 0);        // gather/scatter taken by the grouped products (decode)
    MM_TRUE(g_moe_rows_unsupp > 0); // and refused (prefill): the separate ops, same bits
    if (strstr(name, "deepseek") == NULL)
        MM_TRUE(g_hnrs > 0); // the fused q/k/v path was taken
    MM_TRUE(chain ? g_chain > 0 : g_chain == 0);
    printf("%s%s: %zu logits equal bit for bit; %d plans, %d graphs recorded, %d replays; "
           "moe_matmul_rows %d taken, %d refused; %d chain fusions\n",
           name, graphs ? " with graphs" : "", n_ref, g_plans, g_captures, g_launches,
           g_moe_rows, g_moe_rows_unsupp, g_chain);
    if (graphs && strstr(name, "deepseek") == NULL) {
        // single-row decode repeats: recorded at the second step, replayed from the third
        MM_TRUE(g_captures >= 1);
        MM_TRUE(g_launches >= STEPS - 1);
    }
    free(ref), free(got);
    mm_backend_close(be);
}

static float frand_u(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

// ---- on a real GPU (a `make cuda` build on a machine with one; skipped otherwise) --------------
static mm_backend *open_gpu(void) {
    char err[MM_ERRLEN] = "";
    mm_backend *be = NULL;
    mm_err rv = mm_backend_open(&be, "cuda:0", NULL, err);
    if (rv == MM_EUNSUPP)
        MM_SKIP("%s", err);
    MM_PASS(rv);
    if (!be->ops->route_plan || !be->ops->moe_matmul_dev) {
        mm_backend_close(be);
        MM_SKIP("the GPU backend has no route_plan");
    }
    return be;
}

// The GPU cases' comparison of two runs: every logit (the batch's unwanted middle row, unset in
// both, masked out) and every greedy id bit for bit; prints the first differing logit.
static void same_runs(const char *name, const float *ref, const float *got, size_t n_ref,
                      size_t n_dev, const int32_t *want_ids, const int32_t *got_ids) {
    MM_EQ(n_ref, n_dev);
    const size_t V = n_ref / (7 + STEPS + 9);
    size_t diff = 0;
    for (size_t i = 0; i < n_ref; i++)
        if (memcmp(&ref[i], &got[i], 4) != 0 && i / V != 7 + STEPS + 3 + 2 && diff++ == 0)
            printf("%s: first difference at row %zu token %zu: %.9g vs %.9g\n", name, i / V,
                   i % V, got[i], ref[i]);
    MM_EQ(diff, 0);
    for (int t = 0; t < STEPS; t++)
        MM_EQ(got_ids[t], want_ids[t]);
}

// The GPU's device path (plan, [gate; up] products, graphs, device argmax) against the same
// GPU's host-routed path (MM_DEVICE_ROUTING=0): same bits.
static void gpu_case(const char *name) {
    mm_backend *be = open_gpu();
    char dir[256];
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    int32_t want_ids[STEPS], got_ids[STEPS];
    size_t n_ref = 0, n_dev = 0;
    setenv("MM_DEVICE_ROUTING", "0", 1);
    float *ref = run(dir, be, true, want_ids, &n_ref);
    unsetenv("MM_DEVICE_ROUTING");
    float *got = run(dir, be, true, got_ids, &n_dev);
    same_runs(name, ref, got, n_ref, n_dev, want_ids, got_ids);
    printf("%s on cuda:0: device path == host-routed path, %zu logits bit for bit\n", name,
           n_ref);
    free(ref), free(got);
    mm_backend_close(be);
}

// The same GPU run with the earlier decode kernels and no fused ops (MM_GPU_OLD_DECODE=1:
// GEMV v1, warp rmsnorm, earlier attention loads, one-block argmax, no add_rmsnorm or
// moe_matmul_rows) against the default: every logit and greedy id bit for bit.
static void gpu_old_new_case(const char *name) {
    mm_backend *be = NULL;
    char dir[256];
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    int32_t want_ids[STEPS], got_ids[STEPS];
    size_t n_ref = 0, n_dev = 0;
    // the earlier kernels include the f32 attention's earlier load grouping: both runs on the f32
    // attention contract (the tensor-core one has its own bits)
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(0);
    setenv("MM_GPU_OLD_DECODE", "1", 1);
    be = open_gpu();
    MM_TRUE(be->ops->add_rmsnorm == NULL && be->ops->moe_matmul_rows == NULL);
    float *ref = run(dir, be, true, want_ids, &n_ref);
    mm_backend_close(be);
    unsetenv("MM_GPU_OLD_DECODE");
    be = open_gpu();
    if (!be->ops->add_rmsnorm || !be->ops->moe_matmul_rows)
        MM_TEST_FAIL_("the default GPU table lacks add_rmsnorm / moe_matmul_rows");
    float *got = run(dir, be, true, got_ids, &n_dev);
    same_runs(name, ref, got, n_ref, n_dev, want_ids, got_ids);
    printf("%s on cuda:0: new decode kernels and fused ops == earlier kernels, %zu logits bit "
           "for bit\n", name, n_ref);
    free(ref), free(got);
    mm_backend_close(be);
    if (mm_gpu_set_attention_tc)
        mm_gpu_set_attention_tc(-1);
}

// The same GPU run without the per-layer chain fusions (MM_GPU_OLD_CHAIN=1: head_norm_rope
// then kv_store, route then route_plan, combine then the next norm) against the default:
// every logit and greedy id bit for bit.
static void gpu_chain_case(const char *name) {
    char dir[256];
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    int32_t want_ids[STEPS], got_ids[STEPS];
    size_t n_ref = 0, n_dev = 0;
    setenv("MM_GPU_OLD_CHAIN", "1", 1);
    mm_backend *be = open_gpu();
    MM_TRUE(be->ops->head_norm_rope_kv == NULL && be->ops->route_with_plan == NULL &&
            be->ops->combine_rmsnorm == NULL && be->ops->embed_rmsnorm == NULL);
    float *ref = run(dir, be, true, want_ids, &n_ref);
    mm_backend_close(be);
    unsetenv("MM_GPU_OLD_CHAIN");
    be = open_gpu();
    if (!be->ops->head_norm_rope_kv || !be->ops->route_with_plan || !be->ops->combine_rmsnorm ||
        !be->ops->embed_rmsnorm)
        MM_TEST_FAIL_("the default GPU table lacks the chain fusions");
    float *got = run(dir, be, true, got_ids, &n_dev);
    same_runs(name, ref, got, n_ref, n_dev, want_ids, got_ids);
    printf("%s on cuda:0: chain fusions == separate ops, %zu logits bit for bit\n", name, n_ref);
    free(ref), free(got);
    mm_backend_close(be);
}

// The same GPU run with an f32 KV cache (mm_gpu_set_kv_bf16(0), as MM_GPU_KV_BF16=0) against
// the default bf16 cache of the tensor-core contract: every logit and greedy id bit for bit
// (the contract rounds K and V to bf16 either way), and the default really made a bf16 cache.
static void gpu_kv_bf16_case(const char *name) {
    char dir[256];
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    int32_t want_ids[STEPS], got_ids[STEPS];
    size_t n_ref = 0, n_dev = 0;
    mm_backend *be = open_gpu();
    if (!mm_gpu_set_kv_bf16)
        MM_TEST_FAIL_("the GPU build lacks mm_gpu_set_kv_bf16");
    mm_gpu_set_kv_bf16(0);
    float *ref = run(dir, be, true, want_ids, &n_ref);
    const enum mm_dtype d_ref = g_run_kv_dtype;
    mm_gpu_set_kv_bf16(1);
    float *got = run(dir, be, true, got_ids, &n_dev);
    const enum mm_dtype d_got = g_run_kv_dtype;
    mm_gpu_set_kv_bf16(-1);
    MM_EQ((int)d_ref, (int)MM_DTYPE_F32);
    MM_EQ((int)d_got, (int)MM_DTYPE_BF16);
    same_runs(name, ref, got, n_ref, n_dev, want_ids, got_ids);
    printf("%s on cuda:0: bf16 KV cache == f32 KV cache, %zu logits bit for bit\n", name, n_ref);
    free(ref), free(got);
    mm_backend_close(be);
}

static void test_gpu_kv_bf16(void) {
    gpu_kv_bf16_case("qwen3moe-tiny");
    gpu_kv_bf16_case("qwen2moe-tiny");
    gpu_kv_bf16_case("mixtral-var"); // head_dim 8: padded to 16 in the kernels
    gpu_kv_bf16_case("glm4moe-tiny");
}

static void test_gpu_chain(void) {
    gpu_chain_case("qwen3moe-tiny");
    gpu_chain_case("qwen2moe-tiny");
    gpu_chain_case("mixtral-var");
    gpu_chain_case("glm4moe-tiny");
}

static void test_gpu_old_new(void) {
    gpu_old_new_case("qwen3moe-tiny");
    gpu_old_new_case("qwen2moe-tiny");
    gpu_old_new_case("mixtral-var");
}

static void test_gpu_qwen3moe(void) { gpu_case("qwen3moe-tiny"); }
static void test_gpu_qwen2moe(void) { gpu_case("qwen2moe-tiny"); }
static void test_gpu_mixtral(void) { gpu_case("mixtral-var"); }

// route_plan on the GPU against the host's stable counting sort, and a bad id reported.
static void test_gpu_plan(void) {
    mm_backend *be = open_gpu();
    const int n = 64, K = 8, E = 128, nk = n * K;
    int32_t *ids = malloc(nk * 4), *offs = malloc((E + 1) * 4), *src = malloc(nk * 4);
    int32_t *dst = malloc(nk * 4);
    float *w = malloc(nk * 4), *wt = malloc(nk * 4);
    unsigned seed = 1;
    for (int t = 0; t < nk; t++) {
        seed = seed * 1664525u + 1013904223u;
        ids[t] = (int32_t)((seed >> 8) % (t % 3 ? 17u : (unsigned)E)); // skewed: low ids
        w[t] = (float)t * 0.25f;
    }
    struct a_plan a = {ids, w, n, K, E, malloc((E + 1) * 4), malloc(nk * 4), malloc(nk * 4),
                       malloc(nk * 4)};
    MM_PASS(t_plan(NULL, &a));
    void *d_ids = NULL, *d_w = NULL, *d_offs = NULL, *d_src = NULL, *d_dst = NULL, *d_wt = NULL;
    MM_PASS(be->ops->buffer_alloc(be->ctx, nk * 4, &d_ids));
    MM_PASS(be->ops->buffer_alloc(be->ctx, nk * 4, &d_w));
    MM_PASS(be->ops->buffer_alloc(be->ctx, (E + 1) * 4, &d_offs));
    MM_PASS(be->ops->buffer_alloc(be->ctx, nk * 4, &d_src));
    MM_PASS(be->ops->buffer_alloc(be->ctx, nk * 4, &d_dst));
    MM_PASS(be->ops->buffer_alloc(be->ctx, nk * 4, &d_wt));
    MM_PASS(be->ops->set(be->ctx, d_ids, ids, nk * 4));
    MM_PASS(be->ops->set(be->ctx, d_w, w, nk * 4));
    MM_PASS(be->ops->route_plan(be->ctx, d_ids, d_w, n, K, E, d_offs, d_src, d_dst, d_wt));
    MM_PASS(be->ops->get(be->ctx, offs, d_offs, (E + 1) * 4));
    MM_PASS(be->ops->get(be->ctx, src, d_src, nk * 4));
    MM_PASS(be->ops->get(be->ctx, dst, d_dst, nk * 4));
    MM_PASS(be->ops->get(be->ctx, wt, d_wt, nk * 4));
    MM_TRUE(memcmp(offs, a.offs, (E + 1) * 4) == 0);
    MM_TRUE(memcmp(src, a.src, nk * 4) == 0);
    MM_TRUE(memcmp(dst, a.dst, nk * 4) == 0);
    MM_TRUE(memcmp(wt, a.wt, nk * 4) == 0);
    ids[5] = E + 3; // out of range: reported at the next read
    printf("an out-of-range expert id next: the backend logs one 'index out of range' error\n");
    MM_PASS(be->ops->set(be->ctx, d_ids, ids, nk * 4));
    MM_PASS(be->ops->route_plan(be->ctx, d_ids, d_w, n, K, E, d_offs, d_src, d_dst, d_wt));
    MM_FAIL(be->ops->get(be->ctx, offs, d_offs, (E + 1) * 4), MM_EINVAL);
    MM_EQ(offs[E], nk); // still well formed
    MM_PASS(be->ops->synchronize(be->ctx)); // reported once
    void *bufs[] = {d_ids, d_w, d_offs, d_src, d_dst, d_wt};
    for (int i = 0; i < 6; i++)
        be->ops->buffer_free(be->ctx, bufs[i]);
    // combine in one launch == fill + an axpy per rank + shared + residual, bit for bit
    if (be->ops->combine) {
        const int64_t D = 1000, kk = 8, rows = 5;
        float *hx = malloc((size_t)(rows * kk * D) * 4), *hs = malloc((size_t)(rows * D) * 4);
        float *hh = malloc((size_t)(rows * D) * 4), *ha = malloc((size_t)(rows * kk) * 4);
        float *r1 = malloc((size_t)(rows * D) * 4), *r2 = malloc((size_t)(rows * D) * 4);
        for (int64_t i = 0; i < rows * kk * D; i++)
            hx[i] = frand_u(&seed) * 3.0f;
        for (int64_t i = 0; i < rows * D; i++)
            hs[i] = frand_u(&seed), hh[i] = frand_u(&seed) * 10.0f;
        for (int64_t i = 0; i < rows * kk; i++)
            ha[i] = frand_u(&seed);
        float *dx = NULL, *dsh = NULL, *dh = NULL, *da = NULL, *dacc = NULL;
        MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)(rows * kk * D) * 4, (void **)&dx));
        MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)(rows * D) * 4, (void **)&dsh));
        MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)(rows * D) * 4, (void **)&dh));
        MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)(rows * kk) * 4, (void **)&da));
        MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)(rows * D) * 4, (void **)&dacc));
        MM_PASS(be->ops->set(be->ctx, dx, hx, (size_t)(rows * kk * D) * 4));
        MM_PASS(be->ops->set(be->ctx, dsh, hs, (size_t)(rows * D) * 4));
        MM_PASS(be->ops->set(be->ctx, da, ha, (size_t)(rows * kk) * 4));
        MM_PASS(be->ops->set(be->ctx, dh, hh, (size_t)(rows * D) * 4));
        MM_PASS(be->ops->fill(be->ctx, dacc, 0.0f, rows * D));
        for (int r = 0; r < kk; r++)
            MM_PASS(be->ops->axpy(be->ctx, da + r * rows, dx + r * D, kk * D, dacc, D, rows, D));
        MM_PASS(be->ops->axpy(be->ctx, NULL, dsh, D, dacc, D, rows, D));
        MM_PASS(be->ops->axpy(be->ctx, NULL, dacc, D, dh, D, rows, D));
        MM_PASS(be->ops->get(be->ctx, r1, dh, (size_t)(rows * D) * 4));
        MM_PASS(be->ops->set(be->ctx, dh, hh, (size_t)(rows * D) * 4));
        MM_PASS(be->ops->combine(be->ctx, da, (int)kk, dx, D, dsh, D, dh, D, rows, D));
        MM_PASS(be->ops->get(be->ctx, r2, dh, (size_t)(rows * D) * 4));
        MM_TRUE(memcmp(r1, r2, (size_t)(rows * D) * 4) == 0);
        printf("combine in one launch == the axpy sequence, %lld values bit for bit\n",
               (long long)(rows * D));
        void *cb[] = {dx, dsh, dh, da, dacc};
        for (int i = 0; i < 5; i++)
            be->ops->buffer_free(be->ctx, cb[i]);
        free(hx), free(hs), free(hh), free(ha), free(r1), free(r2);
    }
    // head_norm_rope in one launch == per-head rmsnorm + rope launches, bit for bit
    if (be->ops->head_norm_rope) {
        const int64_t rows = 3, H = 4, KV = 2, hd = 128, W = (H + 2 * KV) * hd;
        float *hx = malloc((size_t)(rows * W) * 4), *r1 = malloc((size_t)(rows * W) * 4);
        float *r2 = malloc((size_t)(rows * W) * 4), freq[64];
        uint16_t wq[128], wk[128];
        int32_t pos[3] = {0, 17, 4000};
        for (int64_t i = 0; i < rows * W; i++)
            hx[i] = frand_u(&seed) * 4.0f;
        for (int i = 0; i < 128; i++)
            wq[i] = mm_f32_to_bf16(1.0f + 0.5f * frand_u(&seed)),
            wk[i] = mm_f32_to_bf16(1.0f + 0.5f * frand_u(&seed));
        for (int i = 0; i < 64; i++)
            freq[i] = 1.0f / powf(10000.0f, (float)i / 64.0f);
        void *dx = NULL, *dwq = NULL, *dwk = NULL, *dpos = NULL, *dfreq = NULL;
        MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)(rows * W) * 4, &dx));
        MM_PASS(be->ops->buffer_alloc(be->ctx, 256, &dwq));
        MM_PASS(be->ops->buffer_alloc(be->ctx, 256, &dwk));
        MM_PASS(be->ops->buffer_alloc(be->ctx, 12, &dpos));
        MM_PASS(be->ops->buffer_alloc(be->ctx, 256, &dfreq));
        MM_PASS(be->ops->set(be->ctx, dwq, wq, 256));
        MM_PASS(be->ops->set(be->ctx, dwk, wk, 256));
        MM_PASS(be->ops->set(be->ctx, dpos, pos, 12));
        MM_PASS(be->ops->set(be->ctx, dfreq, freq, 256));
        mm_weight mq = {MM_DTYPE_BF16, 1, hd, dwq}, mk = {MM_DTYPE_BF16, 1, hd, dwk};
        float *x = dx;
        MM_PASS(be->ops->set(be->ctx, dx, hx, (size_t)(rows * W) * 4));
        for (int64_t r = 0; r < rows; r++) {
            MM_PASS(be->ops->rmsnorm(be->ctx, &mq, 1e-6f, x + r * W, hd, x + r * W, hd, H));
            MM_PASS(be->ops->rmsnorm(be->ctx, &mk, 1e-6f, x + r * W + H * hd, hd,
                                     x + r * W + H * hd, hd, KV));
        }
        struct mm_rope_args ra = {.x = x, .n_rows = rows, .row_stride = W, .n_heads = (int)H,
                                  .head_stride = hd, .rot_offset = 0, .rot_dim = 128,
                                  .pos = dpos, .inv_freq = dfreq, .mscale = 1.0f,
                                  .style = MM_ROPE_NEOX};
        MM_PASS(be->ops->rope(be->ctx, &ra));
        ra.x = x + H * hd, ra.n_heads = (int)KV;
        MM_PASS(be->ops->rope(be->ctx, &ra));
        MM_PASS(be->ops->get(be->ctx, r1, dx, (size_t)(rows * W) * 4));
        MM_PASS(be->ops->set(be->ctx, dx, hx, (size_t)(rows * W) * 4));
        MM_PASS(be->ops->head_norm_rope(be->ctx, x, rows, W, (int)H, (int)KV, H * hd, (int)hd,
                                        &mq, &mk, 1e-6f, &ra));
        MM_PASS(be->ops->get(be->ctx, r2, dx, (size_t)(rows * W) * 4));
        MM_TRUE(memcmp(r1, r2, (size_t)(rows * W) * 4) == 0);
        MM_TRUE(memcmp(r1, hx, (size_t)(rows * W) * 4) != 0); // it did something
        printf("head_norm_rope in one launch == rmsnorm + rope launches, bit for bit\n");
        void *hb[] = {dx, dwq, dwk, dpos, dfreq};
        for (int i = 0; i < 5; i++)
            be->ops->buffer_free(be->ctx, hb[i]);
        free(hx), free(r1), free(r2);
    }
    free(ids), free(offs), free(src), free(dst), free(w), free(wt);
    free(a.offs), free(a.src), free(a.dst), free(a.wt);
    mm_backend_close(be);
}

// ---- overlapped greedy decode (mm_engine_decode_greedy) -----------------------------------------
// The same picks and the same cache with the next step issued before the picks are read as
// one step at a time (MM_ENGINE_OVERLAP=0): 8 steps of one sequence; an eos stop (the step
// issued past it discarded: the sequence continues with the picks the one-at-a-time run made);
// three sequences together; refusals and a run past max context.
static void overlap_checks(mm_engine *e, const char *what, bool expect_overlap) {
    char err[MM_ERRLEN] = "";
    const int V = mm_model_cfg(e->model)->vocab;
    const int32_t prompt[5] = {11, 42 % V, 7, 5, 18};
    int32_t sa, sb, sc, ref[8], got[8], tok = 0, tok0 = 0;
    int done = -1;
    MM_PASS(mm_kv_cache_seq_new(e->kv, &sa));
    MM_PASS(mm_engine_prefill_greedy(e, sa, prompt, 5, &tok0, err));
    setenv("MM_ENGINE_OVERLAP", "0", 1);
    MM_TRUE(!mm_engine_overlaps(e));
    MM_PASS(mm_engine_decode_greedy(e, &sa, 1, &tok0, 8, -1, ref, &done, err));
    unsetenv("MM_ENGINE_OVERLAP");
    MM_EQ(done, 8);
    MM_EQ(mm_kv_cache_seq_len(e->kv, sa), 5 + 8);
    MM_EQ(mm_engine_overlaps(e), expect_overlap);
    MM_PASS(mm_kv_cache_seq_new(e->kv, &sb));
    MM_PASS(mm_engine_prefill_greedy(e, sb, prompt, 5, &tok, err));
    MM_EQ(tok, tok0);
    MM_PASS(mm_engine_decode_greedy(e, &sb, 1, &tok, 8, -1, got, &done, err));
    MM_EQ(done, 8);
    MM_EQ(mm_kv_cache_seq_len(e->kv, sb), 5 + 8);
    for (int t = 0; t < 8; t++)
        MM_EQ(got[t], ref[t]);
    // eos: the first step that picks ref[3] ends the run
    int k = 0;
    while (ref[k] != ref[3])
        k++;
    MM_PASS(mm_kv_cache_seq_new(e->kv, &sc));
    MM_PASS(mm_engine_prefill_greedy(e, sc, prompt, 5, &tok, err));
    MM_PASS(mm_engine_decode_greedy(e, &sc, 1, &tok, 8, ref[3], got, &done, err));
    MM_EQ(done, k + 1);
    MM_EQ(mm_kv_cache_seq_len(e->kv, sc), 5 + k + 1);
    for (int t = 0; t <= k; t++)
        MM_EQ(got[t], ref[t]);
    if (k < 7) { // the rest from the last pick: the one-at-a-time run's picks
        tok = got[k];
        MM_PASS(mm_engine_decode_greedy(e, &sc, 1, &tok, 7 - k, -1, got, &done, err));
        MM_EQ(done, 7 - k);
        for (int t = 0; t < 7 - k; t++)
            MM_EQ(got[t], ref[k + 1 + t]);
    }
    // three sequences together, both ways
    const int32_t seqs[3] = {sa, sb, sc}, first[3] = {3, 9 % V, 27 % V};
    int32_t b_ref[12], b_got[12];
    int32_t len[3];
    for (int i = 0; i < 3; i++)
        len[i] = mm_kv_cache_seq_len(e->kv, seqs[i]);
    setenv("MM_ENGINE_OVERLAP", "0", 1);
    MM_PASS(mm_engine_decode_greedy(e, seqs, 3, first, 4, -1, b_ref, &done, err));
    unsetenv("MM_ENGINE_OVERLAP");
    for (int i = 0; i < 3; i++) {
        MM_EQ(mm_kv_cache_seq_len(e->kv, seqs[i]), len[i] + 4);
        mm_kv_cache_truncate(e->kv, seqs[i], len[i]);
    }
    MM_PASS(mm_engine_decode_greedy(e, seqs, 3, first, 4, -1, b_got, &done, err));
    MM_EQ(done, 4);
    for (int i = 0; i < 12; i++)
        MM_EQ(b_got[i], b_ref[i]);
    // refusals: nothing runs, nothing changes
    const int32_t twice[2] = {sa, sa}, bad[1] = {V};
    MM_FAIL(mm_engine_decode_greedy(e, seqs, 0, first, 4, -1, got, &done, err), MM_EINVAL);
    MM_FAIL(mm_engine_decode_greedy(e, twice, 2, first, 4, -1, got, &done, err), MM_EINVAL);
    MM_TRUE(strstr(err, "twice") != NULL);
    MM_FAIL(mm_engine_decode_greedy(e, &sa, 1, bad, 4, -1, got, &done, err), MM_EINVAL);
    MM_TRUE(strstr(err, "vocabulary") != NULL);
    MM_EQ(done, 0);
    // past max context: the steps that fit run, the error names the limit, the cache holds
    // the tokens fed
    const int32_t la = mm_kv_cache_seq_len(e->kv, sa), room = e->max_ctx - la;
    int32_t *many = malloc((size_t)(room + 4) * 4);
    MM_FAIL(mm_engine_decode_greedy(e, &sa, 1, first, room + 3, -1, many, &done, err), MM_EINVAL);
    MM_TRUE(strstr(err, "max context") != NULL);
    MM_EQ(done, room);
    MM_EQ(mm_kv_cache_seq_len(e->kv, sa), la + room);
    free(many);
    for (int i = 0; i < 3; i++)
        mm_kv_cache_seq_free(e->kv, seqs[i]);
    printf("%s: overlapped greedy decode (%s) == one step at a time: 8 steps, eos stop at step "
           "%d and on, 3 sequences x 4 steps, max context\n", what,
           expect_overlap ? "steps overlapped" : "no overlap on this backend", k);
}

// the dressed table (every device member, graphs, fetch), and the plain CPU table (no overlap)
static void engine_case(const char *name, bool dressed) {
    char dir[256], err[MM_ERRLEN] = "";
    mm_backend *be = cpu_fixture(name, dir);
    struct mm_backend_ops dev;
    dev_table(&dev, true, true);
    if (dressed)
        be->ops = &dev;
    g_fetches = 0;
    mm_engine e = {.be = be, .max_rows = 8, .max_ctx = 48};
    MM_PASS(mm_model_open(&e.model, dir, be, err));
    const int V = mm_model_cfg(e.model)->vocab;
    MM_PASS(mm_model_scratch_new(&e.scratch, e.model, e.max_rows, err));
    mm_kv_params kp;
    mm_model_kv_params(e.model, &kp);
    kp.max_seqs = 4;
    kp.max_ctx = e.max_ctx;
    kp.budget_bytes = mm_kv_token_bytes(&kp) * (size_t)(e.max_ctx + 16) * 4;
    MM_PASS(mm_kv_cache_new(&e.kv, &kp, be, err));
    MM_PASS(be->ops->buffer_alloc(be->ctx, (size_t)e.max_rows * V * 4, (void **)&e.logits));
    e.h_logits = malloc((size_t)e.max_rows * V * 4);
    e.row_pos = malloc((size_t)e.max_rows * 4);
    e.row_seq = malloc((size_t)e.max_rows * 4);
    e.row_want = malloc((size_t)e.max_rows);
    overlap_checks(&e, name, dressed);
    if (dressed) {
        MM_TRUE(g_fetches > 0);
        MM_EQ(fetches_outstanding(), 0);
    }
    be->ops->buffer_free(be->ctx, e.logits);
    free(e.h_logits), free(e.row_pos), free(e.row_seq), free(e.row_want);
    mm_kv_cache_free(e.kv);
    mm_model_scratch_free(e.scratch);
    mm_model_close(e.model);
    be->ops = g_cpu;
    mm_backend_close(be);
}
static void test_engine_overlap(void) {
    engine_case("qwen3moe-tiny", true);
    engine_case("qwen2moe-tiny", true);
    engine_case("deepseekv3-tiny", true);
    engine_case("qwen3moe-tiny", false);
}

// On the GPU: the engine's overlapped decode (fetch by the one-launch copy, and by two copies
// with MM_GPU_FETCH_COPY=1) == one step at a time; fetch's slots and refusals.
static void gpu_engine_case(const char *name, const char *fetch_copy) {
    char dir[256], err[MM_ERRLEN] = "";
    snprintf(dir, sizeof dir, "tests/fixtures/models/%s", name);
    if (fetch_copy)
        setenv("MM_GPU_FETCH_COPY", fetch_copy, 1);
    mm_engine *e = NULL;
    mm_engine_params ep = {.device = "cuda:0", .max_seqs = 4, .max_ctx = 48, .max_rows = 8};
    mm_err rv = mm_engine_open(&e, dir, &ep, err);
    unsetenv("MM_GPU_FETCH_COPY");
    if (rv == MM_EUNSUPP)
        MM_SKIP("%s", err);
    MM_PASS(rv);
    char what[96];
    snprintf(what, sizeof what, "%s on cuda:0%s", name, fetch_copy ? " (fetch by copies)" : "");
    overlap_checks(e, what, true);
    mm_engine_close(e);
}
static void test_gpu_engine_overlap(void) {
    gpu_engine_case("qwen3moe-tiny", NULL);
    gpu_engine_case("qwen3moe-tiny", "1");
    gpu_engine_case("glm4moe-tiny", NULL);
    // the backend's fetch: slots, refusals, stale tickets, results in order of issue
    mm_backend *be = open_gpu();
    const struct mm_backend_ops *o = be->ops;
    MM_TRUE(o->fetch && o->fetch_wait);
    int32_t *d = NULL, h[MM_FETCH_BYTES / 4], back[MM_FETCH_BYTES / 4];
    MM_PASS(o->buffer_alloc(be->ctx, MM_FETCH_BYTES * 2, (void **)&d));
    uint64_t tk[MM_FETCH_SLOTS + 1], extra = 0;
    for (int i = 0; i < MM_FETCH_SLOTS; i++) {
        for (int j = 0; j < MM_FETCH_BYTES / 4; j++)
            h[j] = i * 100000 + j;
        MM_PASS(o->set(be->ctx, d, h, MM_FETCH_BYTES));
        MM_PASS(o->fetch(be->ctx, d, i == 1 ? 7 : MM_FETCH_BYTES, &tk[i])); // 7: a byte tail
    }
    MM_FAIL(o->fetch(be->ctx, d, 4, &extra), MM_EBUSY);
    MM_FAIL(o->fetch(be->ctx, d, 0, &extra), MM_EINVAL);
    MM_FAIL(o->fetch(be->ctx, d, MM_FETCH_BYTES + 1, &extra), MM_EINVAL);
    for (int i = MM_FETCH_SLOTS - 1; i >= 0; i--) { // waited for in any order
        memset(back, 0xff, sizeof back);
        MM_PASS(o->fetch_wait(be->ctx, tk[i], back));
        const int n = i == 1 ? 1 : MM_FETCH_BYTES / 4;
        for (int j = 0; j < n; j++)
            MM_EQ(back[j], i * 100000 + j);
        if (i == 1) { // 7 bytes: the eighth is untouched
            MM_EQ(((unsigned char *)back)[6], (unsigned char)((100000 + 1) >> 16));
            MM_EQ(((unsigned char *)back)[7], 0xff);
        }
        MM_FAIL(o->fetch_wait(be->ctx, tk[i], back), MM_EINVAL); // no longer outstanding
    }
    MM_FAIL(o->fetch_wait(be->ctx, 0, back), MM_EINVAL);
    MM_PASS(o->fetch(be->ctx, (const char *)d + 4, 8, &tk[MM_FETCH_SLOTS])); // at an offset
    MM_PASS(o->fetch_wait(be->ctx, tk[MM_FETCH_SLOTS], back));
    MM_EQ(back[0], (MM_FETCH_SLOTS - 1) * 100000 + 1);
    // a bad index met by an op before the fetch: the fetch reports it (its bytes still come
    // back) and leaves it for synchronize, which reports and clears it; the next fetch is clean
    uint16_t tab[4 * 8] = {0};
    mm_weight table = {.data = NULL, .dtype = MM_DTYPE_BF16, .rows = 4, .cols = 8};
    MM_PASS(o->buffer_alloc(be->ctx, sizeof tab, (void **)&table.data));
    MM_PASS(o->set(be->ctx, (void *)table.data, tab, sizeof tab));
    const int32_t bad_id = 9;
    int32_t *d_id = NULL;
    float *d_row = NULL;
    MM_PASS(o->buffer_alloc(be->ctx, 4, (void **)&d_id));
    MM_PASS(o->buffer_alloc(be->ctx, 8 * 4, (void **)&d_row));
    MM_PASS(o->set(be->ctx, d_id, &bad_id, 4));
    MM_PASS(o->embed(be->ctx, &table, d_id, 1, d_row, 8));
    MM_PASS(o->fetch(be->ctx, d, 8, &tk[0]));
    MM_FAIL(o->fetch_wait(be->ctx, tk[0], back), MM_EINVAL);
    MM_EQ(back[0], (MM_FETCH_SLOTS - 1) * 100000);
    MM_FAIL(o->synchronize(be->ctx), MM_EINVAL);
    MM_PASS(o->fetch(be->ctx, d, 8, &tk[0]));
    MM_PASS(o->fetch_wait(be->ctx, tk[0], back));
    MM_PASS(o->synchronize(be->ctx));
    o->buffer_free(be->ctx, (void *)table.data);
    o->buffer_free(be->ctx, d_id);
    o->buffer_free(be->ctx, d_row);
    o->buffer_free(be->ctx, d);
    mm_backend_close(be);
    printf("cuda:0 fetch: %d slots in flight, the next refused, results whole and in place, a "
           "bad index reported once\n", MM_FETCH_SLOTS);
}

static void test_qwen3moe(void) { check("qwen3moe-tiny", false, true); }
static void test_qwen3moe_graphs(void) { check("qwen3moe-tiny", true, true); }
static void test_qwen3moe_nochain(void) { check("qwen3moe-tiny", true, false); }
static void test_qwen2moe_graphs(void) { check("qwen2moe-tiny", true, true); }
static void test_mixtral_graphs(void) { check("mixtral-var", true, true); }
static void test_glm4moe_graphs(void) { check("glm4moe-tiny", true, true); }
static void test_deepseek(void) { check("deepseekv3-tiny", true, true); }
// recordings refused at launch (MM_ECLOSED: a weight copy they read was released) are freed,
// the step runs op by op and the shape is recorded again: the same bits
static void test_qwen3moe_stale(void) {
    g_stale_odd = true;
    g_stale_n = 0;
    check("qwen3moe-tiny", true, true);
    g_stale_odd = false;
    MM_TRUE(g_stale_n >= 2);
    printf("%d replays refused as stale, each step run op by op instead\n", g_stale_n);
}

MM_TESTS = {
    {"device path == cpu path bits (qwen3_moe)", test_qwen3moe},
    {"device path with graphs == cpu path bits (qwen3_moe)", test_qwen3moe_graphs},
    {"device path without the chain fusions == cpu path bits (qwen3_moe)", test_qwen3moe_nochain},
    {"device path with graphs == cpu path bits (qwen2_moe, shared expert)", test_qwen2moe_graphs},
    {"device path with graphs == cpu path bits (mixtral)", test_mixtral_graphs},
    {"device path with graphs == cpu path bits (glm4_moe)", test_glm4moe_graphs},
    {"device path == cpu path bits (MLA: not recorded)", test_deepseek},
    {"device path with stale recordings refused == cpu path bits (qwen3_moe)", test_qwen3moe_stale},
    {"cuda: route_plan == host sort, bad id reported; combine, head_norm_rope bits", test_gpu_plan},
    {"cuda: device path == host-routed path bits (qwen3_moe)", test_gpu_qwen3moe},
    {"cuda: device path == host-routed path bits (qwen2_moe)", test_gpu_qwen2moe},
    {"cuda: device path == host-routed path bits (mixtral)", test_gpu_mixtral},
    {"cuda: new decode kernels and fused ops == MM_GPU_OLD_DECODE bits", test_gpu_old_new},
    {"cuda: chain fusions == MM_GPU_OLD_CHAIN bits (4 models)", test_gpu_chain},
    {"cuda: bf16 KV cache == f32 KV cache bits (4 models)", test_gpu_kv_bf16},
    {"engine: overlapped greedy decode == one step at a time (dressed table, CPU)",
     test_engine_overlap},
    {"cuda: engine's overlapped greedy decode == one step at a time; fetch slots",
     test_gpu_engine_overlap},
    {NULL, NULL},
};
