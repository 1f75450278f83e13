// SPDX-License-Identifier: MIT
// The routing plan by many blocks (route_plan.cu's parallel plan, the default from 2048 slots)
// against the one-block plan it replaces (mm_gpu_set_route_plan_par(0), as
// MM_GPU_ROUTE_PLAN_PAR=0) and a host stable counting sort (kernels.h route_plan), element for
// element: offs, src_row, dst_slot and wt for rows 1, 7, 129, 4096, 5000 (and 9000, 20000:
// several chunks per block) x top-k 1, 2, 8 x experts 8, 60, 128, ids per row distinct
// (routing's), piled on two experts (long runs of one expert), ids and weights not 16-byte
// aligned, and out-of-range ids (counted as expert 0, the next synchronize says MM_EINVAL);
// then route_with_plan with the parallel plan (route, then the plan in its own launch) against
// the one-launch form: ids, weights and the plan, calls in a row. And an expert owner's check
// of the plan share it receives (mesh_ops.cu mm_gpu_mesh_plan_check): a good share is left as it
// is, a bad one (each way the contract can break) is emptied in place and flagged. And the
// router's split straight into the owners' frames (mm_gpu_mesh_plan_split_to) against the split
// into its staging (mm_gpu_mesh_plan_split): every share word for word, each frame's x rows the
// source's, frames left NULL untouched.
// Without the GPU backend (plain `make`) or without a GPU, every case skips and says why.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x2545f4914f6cdd1dull
#include "gpu_test.h"

extern void mm_gpu_set_route_plan_par(int min_slots) __attribute__((weak));
extern mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev)
    __attribute__((weak));
extern mm_err mm_gpu_mesh_plan_check(void *stream, int32_t *d_plan, int n_experts, int n_slots,
                                     int rows, uint32_t tag, uint32_t step_lo, uint32_t *h_flag,
                                     uint64_t *d_counts) __attribute__((weak));
extern mm_err mm_gpu_host_pinned(void **p, size_t n_bytes) __attribute__((weak));
extern mm_err mm_gpu_mesh_plan_split(void *stream, const int32_t *d_offs, const int32_t *d_src,
                                     const int32_t *d_dst, const int32_t *d_owner_of,
                                     int n_experts, int n_slots, int n_owners, int32_t *d_out,
                                     int64_t out_stride) __attribute__((weak));
extern mm_err mm_gpu_mesh_plan_split_to(void *stream, const int32_t *d_offs,
                                        const int32_t *d_src, const int32_t *d_dst,
                                        const int32_t *d_owner_of, int n_experts, int n_slots,
                                        int n_owners, const float *d_x, int64_t x_rows, int dim,
                                        float *const *d_frames) __attribute__((weak));
extern void mm_gpu_host_pinned_free(void *p) __attribute__((weak));

static void open_gpu(void) {
    gpu_open(NULL);
    if (!mm_gpu_set_route_plan_par || !gpu->ops->route_plan) {
        gpu_close(NULL);
        MM_SKIP("the GPU backend has no device route_plan or no parallel plan switch");
    }
}

static uint32_t urand(uint32_t n) { // uniform in [0, n)
    gpu_test_rng ^= gpu_test_rng << 13;
    gpu_test_rng ^= gpu_test_rng >> 7;
    gpu_test_rng ^= gpu_test_rng << 17;
    return (uint32_t)((gpu_test_rng >> 16) % n);
}

// The host plan (kernels.h route_plan): a stable counting sort of the slots by expert, an id
// outside [0, E) counting as expert 0.
static void host_plan(const int32_t *ids, const float *w, int n, int K, int E, int32_t *offs,
                      int32_t *src, int32_t *dst, float *wt) {
    const int nk = n * K;
    memset(offs, 0, (size_t)(E + 1) * 4);
    for (int t = 0; t < nk; t++)
        offs[(ids[t] >= 0 && ids[t] < E ? ids[t] : 0) + 1]++;
    for (int e = 0; e < E; e++)
        offs[e + 1] += offs[e];
    int32_t *next = malloc((size_t)E * 4);
    MM_TRUE(next != NULL);
    memcpy(next, offs, (size_t)E * 4);
    for (int t = 0; t < nk; t++) {
        const int p = next[ids[t] >= 0 && ids[t] < E ? ids[t] : 0]++;
        src[p] = t / K, dst[p] = t;
        wt[(int64_t)(t % K) * n + t / K] = w[t];
    }
    free(next);
}

// n_words 4-byte words of device memory d equal h's; names the first that differs.
static void same_words(const char *what, const char *form, const void *d, const void *h,
                       size_t n_words, int n, int K, int E) {
    uint32_t *a = dev_get(d, n_words * 4);
    const uint32_t *b = h;
    for (size_t i = 0; i < n_words; i++)
        if (a[i] != b[i])
            MM_TEST_FAIL_("%d rows, K %d, E %d: %s (%s): word %zu is 0x%08x, host plan 0x%08x",
                          n, K, E, what, form, i, a[i], b[i]);
    free(a);
}

enum ids_kind { IDS_ROUTED, IDS_TWO, IDS_BAD };

// One shape: the plan of the same ids by one block and by many, both against the host plan.
// misalign: ids and weights one element past an aligned address (the kernel's scalar loads).
static void plan_case(int n, int K, int E, enum ids_kind kind, bool misalign) {
    const int nk = n * K, a = misalign ? 1 : 0;
    int32_t *ids = malloc((size_t)nk * 4 + 4), *perm = malloc((size_t)E * 4);
    float *w = malloc((size_t)nk * 4 + 4);
    MM_TRUE(ids && perm && w);
    for (int e = 0; e < E; e++)
        perm[e] = e;
    for (int i = 0; i < n; i++)
        for (int r = 0; r < K; r++) {
            int32_t *id = ids + (int64_t)i * K + r;
            if (kind == IDS_TWO) { // two experts take every slot: long runs of one expert
                *id = urand(5) == 0 ? 0 : E - 1;
                continue;
            }
            const uint32_t j = (uint32_t)r + urand((uint32_t)(E - r)); // K distinct per row
            const int32_t s = perm[r];
            perm[r] = perm[j], perm[j] = s;
            *id = perm[r];
        }
    int n_bad = 0;
    if (kind == IDS_BAD)
        for (int t = 0; t < nk; t += 1 + (int)urand(97))
            ids[t] = (n_bad++ & 1) ? -1 - (int32_t)urand(5) : E + (int32_t)urand(5);
    for (int t = 0; t < nk; t++)
        w[t] = frand();
    int32_t *h_offs = malloc((size_t)(E + 1) * 4), *h_src = malloc((size_t)nk * 4 + 4),
            *h_dst = malloc((size_t)nk * 4 + 4);
    float *h_wt = malloc((size_t)nk * 4 + 4);
    MM_TRUE(h_offs && h_src && h_dst && h_wt);
    host_plan(ids, w, n, K, E, h_offs, h_src, h_dst, h_wt);

    int32_t *d_ids = dev_copy(NULL, (size_t)(nk + a) * 4);
    float *d_w = dev_copy(NULL, (size_t)(nk + a) * 4);
    MM_PASS(gpu->ops->set(gpu->ctx, d_ids + a, ids, (size_t)nk * 4));
    MM_PASS(gpu->ops->set(gpu->ctx, d_w + a, w, (size_t)nk * 4));
    static const char *const form[2] = {"one block", "many blocks"};
    for (int par = 0; par < 2; par++) {
        int32_t *offs = dev_copy(NULL, (size_t)(E + 1) * 4), *src = dev_copy(NULL, (size_t)nk * 4),
                *dst = dev_copy(NULL, (size_t)nk * 4);
        float *wt = dev_copy(NULL, (size_t)nk * 4);
        // stale values a missed element would show
        int32_t *junk = malloc((size_t)(nk > E ? nk : E + 1) * 4);
        MM_TRUE(junk != NULL);
        memset(junk, 0x5a + par, (size_t)(nk > E ? nk : E + 1) * 4);
        MM_PASS(gpu->ops->set(gpu->ctx, offs, junk, (size_t)(E + 1) * 4));
        MM_PASS(gpu->ops->set(gpu->ctx, src, junk, (size_t)nk * 4));
        MM_PASS(gpu->ops->set(gpu->ctx, dst, junk, (size_t)nk * 4));
        MM_PASS(gpu->ops->set(gpu->ctx, wt, junk, (size_t)nk * 4));
        free(junk);
        mm_gpu_set_route_plan_par(par ? 1 : 0); // 1: many blocks from one slot
        MM_PASS(gpu->ops->route_plan(gpu->ctx, d_ids + a, d_w + a, n, K, E, offs, src, dst, wt));
        const mm_err rv = gpu->ops->synchronize(gpu->ctx);
        if (kind == IDS_BAD)
            MM_EQ(rv, MM_EINVAL); // the error word was set (and is cleared now)
        else
            MM_PASS(rv);
        same_words("offs", form[par], offs, h_offs, (size_t)E + 1, n, K, E);
        same_words("src_row", form[par], src, h_src, (size_t)nk, n, K, E);
        same_words("dst_slot", form[par], dst, h_dst, (size_t)nk, n, K, E);
        same_words("wt", form[par], wt, h_wt, (size_t)nk, n, K, E);
        dev_free(offs), dev_free(src), dev_free(dst), dev_free(wt);
    }
    mm_gpu_set_route_plan_par(-1);
    dev_free(d_ids), dev_free(d_w);
    free(ids), free(perm), free(w), free(h_offs), free(h_src), free(h_dst), free(h_wt);
}

static void test_route_plan_par(void) {
    open_gpu();
    static const int rows[] = {1, 7, 129, 4096, 5000}, ks[] = {1, 2, 8}, es[] = {8, 60, 128};
    int n_cases = 0;
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
        for (size_t j = 0; j < sizeof(ks) / sizeof(ks[0]); j++)
            for (size_t k = 0; k < sizeof(es) / sizeof(es[0]); k++) {
                plan_case(rows[i], ks[j], es[k], IDS_ROUTED, false);
                plan_case(rows[i], ks[j], es[k], IDS_TWO, (i + j + k) % 2 == 1);
                n_cases += 2;
            }
    plan_case(9000, 8, 128, IDS_ROUTED, false); // 72000 slots: 2 chunks per block
    plan_case(20000, 8, 60, IDS_TWO, true);     // 160000 slots: 3 chunks, scalar loads
    plan_case(3, 5, 1000, IDS_ROUTED, true);    // more experts than threads
    plan_case(4096, 8, 128, IDS_BAD, false);
    plan_case(129, 2, 8, IDS_BAD, true);
    n_cases += 5;
    printf("route_plan by many blocks == by one block == host plan: %d shapes\n", n_cases);
    gpu_close(NULL);
}

// ---- route_with_plan ----------------------------------------------------------------------------
// levels > 0: logits quantised to that many values (many ties); nan_row >= 0: that row NaN.
static void rwp_case(int n, int E, int K, bool renorm, int levels, int nan_row) {
    const size_t nk = (size_t)n * K;
    float *l = rand_logits(n, E, levels, nan_row);
    struct mm_route_params p = {.n_experts = E, .top_k = K, .score = MM_ROUTE_SOFTMAX,
                                .renorm = renorm, .renorm_eps = renorm ? 1e-20f : 0.0f,
                                .scale = 1.0f};
    float *dl = dev_copy(l, (size_t)n * E * 4);
    // [0]: one launch (MM_GPU_ROUTE_PLAN_PAR=0); [1]: route, then the plan by many blocks
    void *b[2][6];
    for (int j = 0; j < 2; j++) {
        b[j][0] = dev_copy(NULL, nk * 4), b[j][1] = dev_copy(NULL, nk * 4);
        b[j][2] = dev_copy(NULL, (size_t)(E + 1) * 4), b[j][3] = dev_copy(NULL, nk * 4);
        b[j][4] = dev_copy(NULL, nk * 4), b[j][5] = dev_copy(NULL, nk * 4);
    }
    for (int rep = 0; rep < 2; rep++) // in turn, twice: the arrival count stays consistent
        for (int j = 0; j < 2; j++) {
            mm_gpu_set_route_plan_par(j ? 1 : 0);
            MM_PASS(gpu->ops->route_with_plan(gpu->ctx, &p, dl, E, n, b[j][0], b[j][1], b[j][2],
                                              b[j][3], b[j][4], b[j][5]));
        }
    mm_gpu_set_route_plan_par(-1);
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
    static const char *const what[6] = {"ids", "weights", "offs", "src_row", "dst_slot", "wt"};
    for (int i = 0; i < 6; i++) {
        const size_t words = i == 2 ? (size_t)E + 1 : nk;
        uint32_t *x = dev_get(b[0][i], words * 4), *y = dev_get(b[1][i], words * 4);
        for (size_t q = 0; q < words; q++)
            if (x[q] != y[q])
                MM_TEST_FAIL_("route_with_plan %d rows, E %d, K %d: %s word %zu: 0x%08x (one "
                              "launch) vs 0x%08x (parallel plan)", n, E, K, what[i], q, x[q],
                              y[q]);
        free(x), free(y);
    }
    printf("route_with_plan %d rows, E %d, K %d%s%s: parallel plan same bits\n", n, E, K,
           levels > 0 ? ", ties" : "", nan_row >= 0 ? ", a NaN row" : "");
    for (int j = 0; j < 2; j++)
        for (int i = 0; i < 6; i++)
            dev_free(b[j][i]);
    dev_free(dl);
    free(l);
}

static void test_route_with_plan_par(void) {
    open_gpu();
    if (!gpu->ops->route_with_plan) {
        gpu_close(NULL);
        MM_SKIP("the GPU table has no route_with_plan (MM_GPU_OLD_CHAIN or MM_GPU_OLD_DECODE "
                "set?)");
    }
    rwp_case(4096, 128, 8, true, 0, -1); // Qwen3-30B-A3B prefill
    rwp_case(5000, 60, 4, true, 3, 17);  // ties, a NaN row
    rwp_case(129, 8, 2, false, 0, -1);   // Mixtral
    rwp_case(7, 128, 8, true, 0, -1);
    rwp_case(1, 128, 8, true, 0, -1); // one block: no arrival count either way
    rwp_case(1, 60, 4, true, 3, 0);   // one row: ties, then a NaN row (the serial picks)
    rwp_case(1, 8, 2, false, 0, -1);  // one row, no renorm
    rwp_case(300, 8, 1, false, 4, -1);
    gpu_close(NULL);
}

// A plan share of E experts and n slots over `rows` x rows: offs (E+1) | src (n) | dst (n).
// Good: a permutation of the slots in expert order, some experts empty. Each bad form breaks
// one rule; the check must empty exactly those (offs 0, src 0, dst p) and set the flag to
// {tag, step}, and leave a good share's bytes as they were with the flag 0.
static void test_mesh_plan_check(void) {
    gpu_open(NULL);
    void *st = NULL;
    int dev = 0;
    if (!mm_gpu_mesh_plan_check || !mm_gpu_host_pinned || !mm_gpu_backend_stream ||
        mm_gpu_backend_stream(gpu->ctx, &st, &dev) != MM_OK) {
        gpu_close(NULL);
        MM_SKIP("no GPU backend stream or no mesh plan check in this build");
    }
    uint32_t *flag = NULL;
    MM_PASS(mm_gpu_host_pinned((void **)&flag, 8));
    enum { E = 60, N = 700, ROWS = 100 };
    const int W = E + 1 + 2 * N;
    int32_t good[E + 1 + 2 * N], bad[E + 1 + 2 * N];
    int32_t *offs = good, *src = good + E + 1, *dst = src + N;
    offs[0] = 0;
    for (int e = 0; e < E; e++)
        offs[e + 1] = offs[e] + (e % 3 == 1 ? 0 : (e == E - 1 ? N - offs[e] : (int)urand(15)));
    MM_TRUE(offs[E] == N);
    for (int p = 0; p < N; p++)
        src[p] = (int32_t)urand(ROWS), dst[p] = (N - 1 - p);
    const char *what[] = {"none (good)", "offs[0] = 1", "offs falling", "offs[E] > n",
                          "src = rows", "src < 0", "dst = n", "dst < 0", "a share within n, "
                          "offs[E] < n (good)"};
    for (int k = 0; k < 9; k++) {
        memcpy(bad, good, sizeof(good));
        int32_t *bo = bad, *bs = bad + E + 1, *bd = bs + N;
        switch (k) {
        case 1: bo[0] = 1; break;
        case 2: bo[17] = bo[18] + 1; break;
        case 3: bo[E] = N + 1; break;
        case 4: bs[N - 1] = ROWS; break;
        case 5: bs[3] = -1; break;
        case 6: bd[500] = N; break;
        case 7: bd[0] = -5; break;
        case 8: bo[E] = N - 10; break; // fewer slots are this owner's: still valid
        default: break;
        }
        const bool is_bad = k >= 1 && k <= 7;
        flag[0] = flag[1] = 0;
        int32_t *d = dev_copy(bad, sizeof(bad));
        uint64_t c0[E];
        for (int e = 0; e < E; e++)
            c0[e] = 5; // counts so far
        uint64_t *dc = dev_copy(c0, sizeof(c0));
        MM_PASS(mm_gpu_mesh_plan_check(st, d, E, N, ROWS, 7u + (uint32_t)k, 1000u + (uint32_t)k,
                                       flag, dc));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        int32_t *out = dev_get(d, sizeof(bad));
        if (!is_bad) {
            if (memcmp(out, bad, sizeof(bad)) != 0 || flag[0] != 0)
                MM_TEST_FAIL_("plan check, %s: a good share was changed or flagged (flag %u)",
                              what[k], flag[0]);
        } else {
            if (flag[0] != 7u + (uint32_t)k || flag[1] != 1000u + (uint32_t)k)
                MM_TEST_FAIL_("plan check, %s: flag {%u, %u}, want {%u, %u}", what[k], flag[0],
                              flag[1], 7u + (uint32_t)k, 1000u + (uint32_t)k);
            for (int i = 0; i < W; i++) {
                const int32_t want = i <= E ? 0 : i < E + 1 + N ? 0 : i - (E + 1 + N);
                if (out[i] != want)
                    MM_TEST_FAIL_("plan check, %s: word %d is %d after emptying, want %d",
                                  what[k], i, out[i], want);
            }
        }
        uint64_t *c = dev_get(dc, sizeof(c0)); // a good share's rows counted, a bad one's not
        for (int e = 0; e < E; e++) {
            const uint64_t want = is_bad ? 5 : 5 + (uint64_t)(bad[e + 1] - bad[e]);
            if (c[e] != want)
                MM_TEST_FAIL_("plan check, %s: expert %d counted %llu, want %llu", what[k], e,
                              (unsigned long long)c[e], (unsigned long long)want);
        }
        free(c);
        free(out);
        dev_free(d);
        dev_free(dc);
    }
    MM_FAIL(mm_gpu_mesh_plan_check(st, NULL, E, N, ROWS, 1, 0, flag, NULL), MM_EINVAL);
    MM_FAIL(mm_gpu_mesh_plan_check(st, (int32_t *)flag, E, N, ROWS, 0, 0, flag, NULL), MM_EINVAL);
    mm_gpu_host_pinned_free(flag);
    gpu_close(NULL);
}

// mm_gpu_mesh_plan_split_to == mm_gpu_mesh_plan_split share for share, plus the x rows copied
// into each frame; owners whose frame is NULL get nothing written.
static void test_mesh_split_to(void) {
    open_gpu();
    void *st = NULL;
    int dev = 0;
    if (!mm_gpu_mesh_plan_split || !mm_gpu_mesh_plan_split_to || !mm_gpu_backend_stream ||
        mm_gpu_backend_stream(gpu->ctx, &st, &dev) != MM_OK) {
        gpu_close(NULL);
        MM_SKIP("no GPU backend stream or no mesh plan split in this build");
    }
    const int shapes[][4] = {{128, 8, 1, 2048}, {128, 512, 3, 2048}, {60, 7, 5, 64},
                             {8, 16, 2, 24}, {128, 2048, 16, 2048}}; // E, slots, owners, dim
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int E = shapes[si][0], n = shapes[si][1], N = shapes[si][2], D = shapes[si][3];
        const int R = (n + 7) / 8; // x rows (any count: the split copies them)
        const int64_t share = (int64_t)E + 1 + 2 * n, P = (share + D - 1) / D;
        int32_t *offs = calloc((size_t)E + 1, 4), *src = malloc((size_t)n * 4);
        int32_t *dst = malloc((size_t)n * 4), *of = malloc((size_t)E * 4);
        float *x = malloc((size_t)R * D * 4);
        MM_TRUE(offs && src && dst && of && x);
        for (int p = 0; p < n; p++)
            offs[urand((uint32_t)E) + 1]++;
        for (int e = 0; e < E; e++)
            offs[e + 1] += offs[e], of[e] = (int32_t)urand((uint32_t)N);
        for (int p = 0; p < n; p++)
            src[p] = (int32_t)urand((uint32_t)R), dst[p] = (int32_t)((p * 7 + 3) % n);
        for (int i = 0; i < R * D; i++)
            x[i] = (float)urand(1000) - 500.0f;
        int32_t *d_offs = dev_copy(offs, (size_t)(E + 1) * 4), *d_src = dev_copy(src, (size_t)n * 4);
        int32_t *d_dst = dev_copy(dst, (size_t)n * 4), *d_of = dev_copy(of, (size_t)E * 4);
        float *d_x = dev_copy(x, (size_t)R * D * 4);
        int32_t *d_ref = dev_copy(NULL, (size_t)(N * share) * 4);
        MM_PASS(mm_gpu_mesh_plan_split(st, d_offs, d_src, d_dst, d_of, E, n, N, d_ref, share));
        float *frames[16] = {NULL}, *fill = malloc((size_t)(R + P) * D * 4);
        MM_TRUE(fill != NULL);
        for (int i = 0; i < (R + P) * D; i++)
            fill[i] = -7.0f;
        for (int o = 0; o < N; o++)
            frames[o] = o % 3 == 2 ? NULL : dev_copy(fill, (size_t)(R + P) * D * 4);
        MM_PASS(mm_gpu_mesh_plan_split_to(st, d_offs, d_src, d_dst, d_of, E, n, N, d_x, R, D,
                                          frames));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        int32_t *ref = dev_get(d_ref, (size_t)(N * share) * 4);
        for (int o = 0; o < N; o++) {
            if (!frames[o])
                continue;
            float *f = dev_get(frames[o], (size_t)(R + P) * D * 4);
            if (memcmp(f, x, (size_t)R * D * 4) != 0)
                MM_TEST_FAIL_("split_to E %d, %d slots, owner %d of %d: x rows differ", E, n, o,
                              N);
            if (memcmp(f + (size_t)R * D, ref + o * share, (size_t)share * 4) != 0)
                MM_TEST_FAIL_("split_to E %d, %d slots, owner %d of %d: share differs from "
                              "the split's", E, n, o, N);
            for (int64_t i = (int64_t)R * D + share; i < (int64_t)(R + P) * D; i++)
                MM_TRUE(f[i] == -7.0f); // (past the share: untouched)
            free(f);
            dev_free(frames[o]);
        }
        free(ref), free(offs), free(src), free(dst), free(of), free(x), free(fill);
        void *bufs[] = {d_offs, d_src, d_dst, d_of, d_x, d_ref};
        for (size_t i = 0; i < 6; i++)
            dev_free(bufs[i]);
    }
    float *none[17] = {NULL};
    MM_FAIL(mm_gpu_mesh_plan_split_to(st, (int32_t *)none, (int32_t *)none, (int32_t *)none,
                                      (int32_t *)none, 8, 8, 17, (float *)none, 1, 8, none),
            MM_EINVAL); // more than 16 owners
    gpu_close(NULL);
}

MM_TESTS = {
    {"route_plan by many blocks == one block == host plan", test_route_plan_par},
    {"route_with_plan with the parallel plan == one launch bits", test_route_with_plan_par},
    {"mesh plan check: good shares unchanged, bad ones emptied and flagged", test_mesh_plan_check},
    {"mesh plan split into the owners' frames == the split into staging, x rows copied", test_mesh_split_to},
    {0},
};
