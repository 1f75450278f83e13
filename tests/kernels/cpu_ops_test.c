// SPDX-License-Identifier: MIT
// The CPU backend's ops against plain double-precision references over odd shapes, and the
// exactness rules of kernels.h: a matmul row's bits do not depend on n_rows or the thread
// count, attention's bits do not depend on where the KV blocks sit, routing follows
// transformers' grouped/biased top-k.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm/dtype.h"
#include "mm_test.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float frand(void) { // uniform in [-1, 1)
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

static mm_backend *open_cpu(int threads) {
    mm_backend *be = NULL;
    char err[MM_ERRLEN] = "";
    mm_backend_params p = {.n_threads = threads};
    MM_PASS(mm_backend_open(&be, "cpu", &p, err));
    return be;
}

static void *make_weight(enum mm_dtype dt, int64_t rows, int64_t cols, double *ref) {
    size_t es = mm_dtype_size(dt);
    unsigned char *w = malloc((size_t)(rows * cols) * es);
    for (int64_t i = 0; i < rows * cols; i++) {
        float f = frand() * 0.5f;
        if (dt == MM_DTYPE_BF16) {
            uint16_t h = mm_f32_to_bf16(f);
            memcpy(w + 2 * i, &h, 2);
            ref[i] = mm_bf16_to_f32(h);
        } else if (dt == MM_DTYPE_F16) {
            // f16 from a bf16-representable value in range: exact in both
            uint16_t b = mm_f32_to_bf16(f);
            float g = mm_bf16_to_f32(b);
            uint32_t u;
            memcpy(&u, &g, 4);
            int e = (int)((u >> 23) & 0xff) - 127;
            uint16_t h = 0;
            if (g != 0.0f && e >= -14)
                h = (uint16_t)(((u >> 16) & 0x8000) | (uint16_t)((e + 15) << 10) |
                               ((u >> 13) & 0x3ff));
            memcpy(w + 2 * i, &h, 2);
            ref[i] = mm_f16_to_f32(h);
        } else {
            memcpy(w + 4 * i, &f, 4);
            ref[i] = f;
        }
    }
    return w;
}

static void matmul_case(mm_backend *be, enum mm_dtype dt, int64_t rows, int64_t cols, int64_t n) {
    double *wr = malloc((size_t)(rows * cols) * sizeof(double));
    void *w = make_weight(dt, rows, cols, wr);
    float *x = malloc((size_t)(n * cols) * 4), *y = malloc((size_t)(n * rows) * 4);
    float *b = malloc((size_t)rows * 4);
    for (int64_t i = 0; i < n * cols; i++)
        x[i] = frand();
    for (int64_t i = 0; i < rows; i++)
        b[i] = frand();
    mm_weight W = {dt, rows, cols, w};
    MM_PASS(be->ops->matmul(be->ctx, &W, b, x, cols, y, rows, n));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < rows; j++) {
            double s = b[j];
            for (int64_t k = 0; k < cols; k++)
                s += (double)x[i * cols + k] * wr[j * cols + k];
            MM_NEAR(y[i * rows + j], s, 1e-5 * (1 + sqrt((double)cols)));
        }
    // a row's bits do not depend on n_rows: each row alone
    float *y1 = malloc((size_t)rows * 4);
    for (int64_t i = 0; i < n; i++) {
        MM_PASS(be->ops->matmul(be->ctx, &W, b, x + i * cols, cols, y1, rows, 1));
        MM_TRUE(memcmp(y1, y + i * rows, (size_t)rows * 4) == 0);
    }
    free(y1);
    free(wr);
    free(w);
    free(x);
    free(y);
    free(b);
}

static void t_matmul(void) {
    mm_backend *be = open_cpu(2);
    const int64_t shapes[][3] = {{1, 1, 1},  {7, 13, 3},   {33, 64, 9},  {64, 2048, 5},
                                 {5, 17, 4}, {130, 40, 2}, {16, 24, 11}, {9, 100, 1}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        matmul_case(be, MM_DTYPE_BF16, shapes[s][0], shapes[s][1], shapes[s][2]);
        matmul_case(be, MM_DTYPE_F16, shapes[s][0], shapes[s][1], shapes[s][2]);
        matmul_case(be, MM_DTYPE_F32, shapes[s][0], shapes[s][1], shapes[s][2]);
    }
    mm_weight bad = {MM_DTYPE_I32, 2, 2, &bad};
    float x[4], y[4];
    MM_FAIL(be->ops->matmul(be->ctx, &bad, NULL, x, 2, y, 2, 1), MM_EINVAL);
    mm_backend_close(be);
}

// 1, 2 and 5 threads give the same bits for a batch big enough to be split.
static void t_matmul_threads(void) {
    const int64_t rows = 300, cols = 136, n = 6;
    double *wr = malloc((size_t)(rows * cols) * sizeof(double));
    void *w = make_weight(MM_DTYPE_BF16, rows, cols, wr);
    float *x = malloc((size_t)(n * cols) * 4), *y[3];
    for (int64_t i = 0; i < n * cols; i++)
        x[i] = frand();
    const int th[3] = {1, 2, 5};
    mm_weight W = {MM_DTYPE_BF16, rows, cols, w};
    for (int t = 0; t < 3; t++) {
        mm_backend *be = open_cpu(th[t]);
        y[t] = malloc((size_t)(n * rows) * 4);
        MM_PASS(be->ops->matmul(be->ctx, &W, NULL, x, cols, y[t], rows, n));
        mm_backend_close(be);
    }
    MM_TRUE(memcmp(y[0], y[1], (size_t)(n * rows) * 4) == 0);
    MM_TRUE(memcmp(y[0], y[2], (size_t)(n * rows) * 4) == 0);
    for (int t = 0; t < 3; t++)
        free(y[t]);
    free(x);
    free(w);
    free(wr);
}

static void t_rmsnorm_swiglu(void) {
    mm_backend *be = open_cpu(2);
    const int64_t d = 37, n = 5;
    double wr[37];
    void *w = make_weight(MM_DTYPE_BF16, 1, d, wr);
    float x[5 * 37], y[5 * 37], g[5 * 37], u[5 * 37];
    for (int i = 0; i < n * d; i++) {
        x[i] = frand() * 3;
        g[i] = frand() * 4;
        u[i] = frand();
    }
    mm_weight W = {MM_DTYPE_BF16, 1, d, w};
    MM_PASS(be->ops->rmsnorm(be->ctx, &W, 1e-6f, x, d, y, d, n));
    for (int i = 0; i < n; i++) {
        double ss = 0;
        for (int k = 0; k < d; k++)
            ss += (double)x[i * d + k] * x[i * d + k];
        double r = 1.0 / sqrt(ss / d + 1e-6);
        for (int k = 0; k < d; k++)
            MM_NEAR(y[i * d + k], wr[k] * x[i * d + k] * r, 1e-5);
    }
    MM_PASS(be->ops->swiglu(be->ctx, g, d, u, d, y, d, n, d));
    for (int i = 0; i < n * d; i++)
        MM_NEAR(y[i], g[i] / (1 + exp(-(double)g[i])) * u[i], 1e-6);
    free(w);
    mm_backend_close(be);
}

static void t_rope(void) {
    mm_backend *be = open_cpu(2);
    const int H = 3, hd = 24, off = 8, rot = 16, n = 4;
    float x[4 * 3 * 24], x0[4 * 3 * 24], inv[8];
    int32_t pos[4] = {0, 5, 17, 300};
    for (int i = 0; i < 8; i++)
        inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / rot);
    for (int style = 0; style < 2; style++) {
        for (int i = 0; i < n * H * hd; i++)
            x[i] = x0[i] = frand();
        struct mm_rope_args a = {.x = x, .n_rows = n, .row_stride = H * hd, .n_heads = H,
                                 .head_stride = hd, .rot_offset = off, .rot_dim = rot,
                                 .pos = pos, .inv_freq = inv, .mscale = 1.25f,
                                 .style = (enum mm_rope_style)style};
        MM_PASS(be->ops->rope(be->ctx, &a));
        for (int r = 0; r < n; r++)
            for (int h = 0; h < H; h++) {
                const float *in = x0 + r * H * hd + h * hd, *o = x + r * H * hd + h * hd;
                for (int k = 0; k < off; k++)
                    MM_TRUE(o[k] == in[k]); // the no-rope part is untouched
                for (int i = 0; i < rot / 2; i++) {
                    int i0 = style ? off + 2 * i : off + i;
                    int i1 = style ? off + 2 * i + 1 : off + i + rot / 2;
                    double ang = (double)((float)pos[r] * inv[i]);
                    double c = cos(ang) * 1.25, s = sin(ang) * 1.25;
                    MM_NEAR(o[i0], in[i0] * c - in[i1] * s, 1e-5);
                    MM_NEAR(o[i1], in[i1] * c + in[i0] * s, 1e-5);
                }
            }
    }
    mm_backend_close(be);
}

// Attention over a paged cache vs a plain reference, and the same bits for two different
// block placements of the same sequence.
static void t_attention(void) {
    mm_backend *be = open_cpu(2);
    const int H = 4, KV = 2, dk = 12, dv = 8, bs = 4, T = 13, nblk = 16, maxb = 4;
    const int64_t slot = KV * (dk + dv);
    float *pool = calloc((size_t)(nblk * bs) * (size_t)slot, 4);
    float K[13][2][12], V[13][2][8], q[13 * 4 * 12];
    for (int t = 0; t < T; t++)
        for (int h = 0; h < KV; h++) {
            for (int d = 0; d < dk; d++)
                K[t][h][d] = frand();
            for (int d = 0; d < dv; d++)
                V[t][h][d] = frand();
        }
    for (int i = 0; i < T * H * dk; i++)
        q[i] = frand();
    int32_t tables[2 * 4] = {3, 9, 0, 14, 7, 1, 12, 5}; // seq 0 and seq 1: other blocks
    float out[2][13 * 4 * 8];
    for (int s = 0; s < 2; s++) {
        struct mm_kv_view kv = {.base = pool, .block_size = bs, .block_stride = bs * slot,
                                .slot_stride = slot, .n_kv_heads = KV, .head_dim_k = dk,
                                .head_dim_v = dv, .block_tables = tables, .max_blocks = maxb};
        int32_t seq[13], pos[13];
        for (int t = 0; t < T; t++) {
            seq[t] = s;
            pos[t] = t;
        }
        struct mm_kv_store_args st = {.kv = kv, .k = &K[0][0][0], .k_stride = KV * dk,
                                      .v = &V[0][0][0], .v_stride = KV * dv, .n_rows = T,
                                      .row_seq = seq, .row_pos = pos};
        MM_PASS(be->ops->kv_store(be->ctx, &st));
        struct mm_attn_args aa = {.kv = kv, .q = q, .q_stride = H * dk, .out = out[s],
                                  .out_stride = H * dv, .n_rows = T, .row_seq = seq,
                                  .row_pos = pos, .n_heads = H, .scale = 0.3f};
        MM_PASS(be->ops->attention(be->ctx, &aa));
    }
    MM_TRUE(memcmp(out[0], out[1], sizeof out[0]) == 0);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            int kh = h / (H / KV);
            double sc[13], mx = -1e30, sum = 0;
            for (int p = 0; p <= t; p++) {
                double s = 0;
                for (int d = 0; d < dk; d++)
                    s += (double)q[(t * H + h) * dk + d] * K[p][kh][d];
                sc[p] = s * 0.3;
                mx = sc[p] > mx ? sc[p] : mx;
            }
            for (int p = 0; p <= t; p++)
                sum += exp(sc[p] - mx);
            for (int d = 0; d < dv; d++) {
                double o = 0;
                for (int p = 0; p <= t; p++)
                    o += exp(sc[p] - mx) / sum * V[p][kh][d];
                MM_NEAR(out[0][(t * H + h) * dv + d], o, 1e-5);
            }
        }
    free(pool);
    mm_backend_close(be);
}

static void t_route(void) {
    mm_backend *be = open_cpu(1);
    // softmax top-2 with renorm (Mixtral)
    float l[6] = {0.1f, 2.0f, -1.0f, 1.5f, 0.0f, 1.9f};
    int32_t ids[4];
    float w[4];
    struct mm_route_params p = {.n_experts = 6, .top_k = 2, .score = MM_ROUTE_SOFTMAX,
                                .n_group = 1, .topk_group = 1, .renorm = true, .scale = 1};
    MM_PASS(be->ops->route(be->ctx, &p, l, 6, 1, ids, w));
    MM_EQ(ids[0], 1);
    MM_EQ(ids[1], 5);
    MM_NEAR(w[0], 1 / (1 + exp(1.9 - 2.0)), 1e-6);
    MM_NEAR(w[0] + w[1], 1.0, 1e-6);
    // sigmoid + bias + groups (DeepSeek noaux_tc): 8 experts in 4 groups, keep 2 groups
    float l2[8] = {0.5f, 0.4f, 3.0f, -3.0f, 0.1f, 0.2f, 1.0f, 1.1f};
    float bias[8] = {0, 0, -2.0f, 0, 0.5f, 0.5f, 0, 0};
    p = (struct mm_route_params){.n_experts = 8, .top_k = 3, .score = MM_ROUTE_SIGMOID,
                                 .bias = bias, .n_group = 4, .topk_group = 2, .renorm = true,
                                 .renorm_eps = 1e-20f, .scale = 2.5f};
    int32_t id3[3];
    float w3[3];
    MM_PASS(be->ops->route(be->ctx, &p, l2, 8, 1, id3, w3));
    // choice scores: sig+bias; groups: {0,1}: .62+.60, {2,3}: (.95-2)+.05, {4,5}: 1.02+1.05,
    // {6,7}: .73+.75 -> keep groups 2 and 3; top-3 of {4,5,6,7} by choice: 5, 4, 7
    MM_EQ(id3[0], 5);
    MM_EQ(id3[1], 4);
    MM_EQ(id3[2], 7);
    double s4 = 1 / (1 + exp(-0.1)), s5 = 1 / (1 + exp(-0.2)), s7 = 1 / (1 + exp(-1.1));
    MM_NEAR(w3[0], 2.5 * s5 / (s4 + s5 + s7), 1e-6);
    MM_NEAR(w3[2], 2.5 * s7 / (s4 + s5 + s7), 1e-6);
    p.n_group = 3; // 8 experts do not split into 3 groups
    MM_FAIL(be->ops->route(be->ctx, &p, l2, 8, 1, id3, w3), MM_EINVAL);
    mm_backend_close(be);
}

static void t_misc(void) {
    mm_backend *be = open_cpu(2);
    float x[6] = {1, 2, 3, 4, 5, 6}, y[6] = {0}, a[2] = {2, -1};
    MM_PASS(be->ops->axpy(be->ctx, a, x, 3, y, 3, 2, 3));
    MM_TRUE(y[0] == 2 && y[2] == 6 && y[3] == -4 && y[5] == -6);
    int32_t si[2] = {1, 0}, di[2] = {0, 1};
    float z[6];
    MM_PASS(be->ops->copy_rows(be->ctx, x, 3, si, z, 3, di, 2, 3));
    MM_TRUE(z[0] == 4 && z[3] == 1);
    MM_PASS(be->ops->fill(be->ctx, z, 0.5f, 6));
    MM_TRUE(z[5] == 0.5f);
    MM_PASS(be->ops->sigmoid(be->ctx, z, 1));
    MM_NEAR(z[0], 1 / (1 + exp(-0.5)), 1e-7);
    uint16_t table[6];
    for (int i = 0; i < 6; i++)
        table[i] = mm_f32_to_bf16((float)i);
    mm_weight T = {MM_DTYPE_BF16, 3, 2, table};
    int32_t ids[2] = {2, 0}, bad[1] = {3};
    MM_PASS(be->ops->embed(be->ctx, &T, ids, 2, z, 2));
    MM_TRUE(z[0] == 4 && z[1] == 5 && z[2] == 0);
    MM_FAIL(be->ops->embed(be->ctx, &T, bad, 1, z, 2), MM_EINVAL);
    char err[MM_ERRLEN] = "";
    mm_backend *none = NULL;
    MM_FAIL(mm_backend_open(&none, "tpu:0", NULL, err), MM_EINVAL);
    mm_backend_close(be);
}

// "cpu-dev": the CPU kernels with a device backend's contract and the device path's ops
static void t_cpu_dev(void) {
    mm_backend *be = NULL;
    char err[MM_ERRLEN] = "";
    mm_backend_params p = {.n_threads = 1};
    MM_PASS(mm_backend_open(&be, "cpu-dev", &p, err));
    const struct mm_backend_ops *o = be->ops;
    MM_TRUE(!o->host_memory && strcmp(o->name, "cpu-dev") == 0);
    MM_TRUE(o->argmax && o->fetch && o->fetch_wait && o->route_plan && o->moe_matmul_dev);
    // argmax: the largest, the lowest index on ties, NaN never chosen; a row of NaNs: 0
    const float nan = NAN;
    float lg[12] = {1, 3, 3, 2, nan, -1, nan, -2, nan, nan, nan, nan};
    int32_t ids[3] = {-5, -5, -5};
    MM_PASS(o->argmax(be->ctx, lg, 4, 3, 4, ids));
    MM_TRUE(ids[0] == 1 && ids[1] == 1 && ids[2] == 0);
    // fetch: MM_FETCH_SLOTS tickets outstanding, the next one busy; a stale ticket refused
    uint64_t t[MM_FETCH_SLOTS + 1];
    for (int i = 0; i < MM_FETCH_SLOTS; i++) {
        ids[0] = 100 + i;
        MM_PASS(o->fetch(be->ctx, ids, 4, &t[i]));
    }
    MM_FAIL(o->fetch(be->ctx, ids, 4, &t[MM_FETCH_SLOTS]), MM_EBUSY);
    MM_FAIL(o->fetch(be->ctx, ids, MM_FETCH_BYTES + 1, &t[MM_FETCH_SLOTS]), MM_EINVAL);
    int32_t got = 0;
    MM_PASS(o->fetch_wait(be->ctx, t[2], &got));
    MM_EQ(got, 102);
    MM_FAIL(o->fetch_wait(be->ctx, t[2], &got), MM_EINVAL);
    for (int i = 0; i < MM_FETCH_SLOTS; i++)
        if (i != 2)
            MM_PASS(o->fetch_wait(be->ctx, t[i], &got));
    // route_plan: slots t = row * k + rank sorted by expert, stable; weights by rank
    const int32_t rid[6] = {2, 0, 0, 2, 1, 0}; // 3 rows, top 2, 3 experts
    const float rw[6] = {.1f, .2f, .3f, .4f, .5f, .6f};
    int32_t offs[4], src[6], dst[6];
    float wt[6];
    MM_PASS(o->route_plan(be->ctx, rid, rw, 3, 2, 3, offs, src, dst, wt));
    MM_TRUE(offs[0] == 0 && offs[1] == 3 && offs[2] == 4 && offs[3] == 6);
    const int32_t want_dst[6] = {1, 2, 5, 4, 0, 3};
    for (int i = 0; i < 6; i++) {
        MM_EQ(dst[i], want_dst[i]);
        MM_EQ(src[i], want_dst[i] / 2);
    }
    MM_TRUE(wt[0] == .1f && wt[1] == .3f && wt[2] == .5f && wt[3] == .2f && wt[5] == .6f);
    const int32_t rbad[2] = {0, 7};
    MM_FAIL(o->route_plan(be->ctx, rbad, rw, 1, 2, 3, offs, src, dst, NULL), MM_EINVAL);
    // moe_matmul_dev: expert e's rows [offs[e], offs[e+1]), == moe_matmul per expert
    float W0[4] = {1, 0, 0, 1}, W1[4] = {0, 2, 2, 0}; // (2 x 2) f32
    const void *ex[2] = {W0, W1};
    const int32_t mo[3] = {0, 1, 3};
    float xm[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ym[8] = {0};
    MM_PASS(o->moe_matmul_dev(be->ctx, ex, MM_DTYPE_F32, 2, 2, 2, mo, xm, 2, ym, 2, 4));
    MM_TRUE(ym[0] == 1 && ym[1] == 2 && ym[2] == 8 && ym[3] == 6 && ym[4] == 12 && ym[5] == 10);
    MM_TRUE(ym[6] == 0 && ym[7] == 0); // row 3 belongs to no expert: untouched
    mm_backend_close(be);
}

MM_TESTS = {
    {"cpu-dev backend: argmax, fetch slots, route_plan, moe_matmul_dev", t_cpu_dev},
    {"cpu matmul bf16/f16/f32 odd shapes, row bits independent of n_rows", t_matmul},
    {"cpu matmul same bits with 1, 2, 5 threads", t_matmul_threads},
    {"cpu rmsnorm and swiglu", t_rmsnorm_swiglu},
    {"cpu rope neox and interleaved, partial, mscale", t_rope},
    {"cpu paged attention vs reference, placement-independent bits", t_attention},
    {"cpu routing softmax/sigmoid, bias, groups, renorm, scale", t_route},
    {"cpu axpy copy_rows fill sigmoid embed", t_misc},
    {NULL, NULL},
};
