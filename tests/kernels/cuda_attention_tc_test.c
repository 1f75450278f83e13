// SPDX-License-Identifier: MIT
// The tensor-core attention contract (kernels/cuda/attention_tc.cu, MM_GPU_ATT_TC=1): against
// the CPU backend's f32 attention within a bf16-input tolerance, and bit for bit between the
// ways a row can reach it: a whole prompt in one call (prefill tiles of 8 warps, of 4 warps,
// with one key buffer instead of two, and with two m16 tiles per warp), token-by-token decode
// steps of all sequences (one row per sequence per call, cache written step by step), chunked
// prefill (chunks of 37, 128, 1, then 200 rows, each stored before its attention) and rows of
// the sequences interleaved in one call. The cache starts as NaN, so keys a row must not see
// (not yet written, or written for later rows only) cannot leak into it. Odd shapes: GQA 1, 3,
// 8, 16, head dims 16..128, dk != dv, a sliding window, contexts that are not multiples of the
// 64-key block. (Head dims above 128 keep ops.cu's f32 kernels: not tested here.)
// Without the GPU backend (plain `make`) or without a GPU, every case skips and says why.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x5851f42d4c957f2dull
#include "gpu_test.h"

extern void mm_gpu_set_attention_tc(int mode) __attribute__((weak));
extern void mm_gpu_set_attention_tc_warps(int warps) __attribute__((weak));
extern void mm_gpu_set_attention_tc_db(int mode) __attribute__((weak));
// prefill calls with two m16 tiles per warp (attention_tc2_kernel); absent in older builds
extern void mm_gpu_set_attention_tc_mt(int mt) __attribute__((weak));
extern mm_err mm_gpu_attention_tc(void *stream, const struct mm_attn_args *a, int *d_err, int *done)
    __attribute__((weak));
// decode calls with every warp computing (attention_tcd.cu): 0 none (attention_tc_kernel); its
// key buffers for a bf16 cache (3, 4, 6) and heads per block (1..16)
extern void mm_gpu_set_attention_tcd(int mode) __attribute__((weak));
extern void mm_gpu_set_attention_tcd_kb_bufs(int n) __attribute__((weak));
extern void mm_gpu_set_attention_tcd_gsub(int n) __attribute__((weak));

// prefill calls over a bf16 cache with dk = dv = 128 on wgmma (attention_tcw.cu, sm_90a):
// 1 on, 0 off, < 0 MM_GPU_ATT_TCW (default off); absent in older builds
extern void mm_gpu_set_attention_tcw(int mode) __attribute__((weak));
// its diagnostic modes (kind + 10 * key block; attention_tcw.cu's g_att_tcw_diag): 0 off
extern void mm_gpu_set_attention_tcw_diag(int mode) __attribute__((weak));
// S with Q as the register operand (1) or from shared memory (0); < 0: MM_GPU_ATT_TCW_QR
extern void mm_gpu_set_attention_tcw_qr(int mode) __attribute__((weak));
// the key blocks software-pipelined per warpgroup (1) or one after the other (0); < 0:
// MM_GPU_ATT_TCW_PIPE
extern void mm_gpu_set_attention_tcw_pipe(int mode) __attribute__((weak));

static mm_backend *cpu;

static void open_backends(void) {
    if (!mm_gpu_set_attention_tc || !mm_gpu_attention_tc || !mm_gpu_set_attention_tc_warps ||
        !mm_gpu_set_attention_tc_db)
        MM_SKIP("GPU kernels not linked (plain build; `make cuda` builds this test with them)");
    gpu_open(&cpu);
    mm_gpu_set_attention_tc(1);
    mm_gpu_set_attention_tc_warps(8);
    mm_gpu_set_attention_tc_db(1);
    if (mm_gpu_set_attention_tc_mt)
        mm_gpu_set_attention_tc_mt(1);
}

static void close_backends(void) {
    mm_gpu_set_attention_tc(-1);
    mm_gpu_set_attention_tc_warps(-1);
    mm_gpu_set_attention_tc_db(-1);
    if (mm_gpu_set_attention_tc_mt)
        mm_gpu_set_attention_tc_mt(-1);
    gpu_close(&cpu);
}

// Rows in the order of `order` (order[i]: original row), uploaded: q, k, v, seq, pos.
struct tc_rows {
    float *q, *k, *v;
    int32_t *seq, *pos;
};

static struct tc_rows tc_upload(const int32_t *order, int n_rows, const float *q, int64_t qst,
                                const float *k, int64_t kst, const float *v, int64_t vst,
                                const int32_t *rs, const int32_t *rp) {
    float *hq = malloc((size_t)(n_rows * qst) * 4), *hk = malloc((size_t)(n_rows * kst) * 4);
    float *hv = malloc((size_t)(n_rows * vst) * 4);
    int32_t *hs = malloc((size_t)n_rows * 4), *hp = malloc((size_t)n_rows * 4);
    MM_TRUE(hq && hk && hv && hs && hp);
    for (int i = 0; i < n_rows; i++) {
        const int o = order[i];
        memcpy(hq + (int64_t)i * qst, q + (int64_t)o * qst, (size_t)qst * 4);
        memcpy(hk + (int64_t)i * kst, k + (int64_t)o * kst, (size_t)kst * 4);
        memcpy(hv + (int64_t)i * vst, v + (int64_t)o * vst, (size_t)vst * 4);
        hs[i] = rs[o], hp[i] = rp[o];
    }
    struct tc_rows r = {dev_copy(hq, (size_t)(n_rows * qst) * 4),
                        dev_copy(hk, (size_t)(n_rows * kst) * 4),
                        dev_copy(hv, (size_t)(n_rows * vst) * 4), dev_copy(hs, (size_t)n_rows * 4),
                        dev_copy(hp, (size_t)n_rows * 4)};
    free(hq), free(hk), free(hv), free(hs), free(hp);
    return r;
}

static void tc_rows_free(struct tc_rows *r) {
    void *b[] = {r->q, r->k, r->v, r->seq, r->pos};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        gpu->ops->buffer_free(gpu->ctx, b[i]);
}

// Runs rows [r, r + n) of u (stored first, then attended) in calls of sizes[] (the last size
// repeats), with the outputs at the same row offsets of d_out.
static void tc_run(const struct mm_kv_view *kv, const struct tc_rows *u, int n_rows, int64_t qst,
                   int64_t kst, int64_t vst, float *d_out, int64_t ost, int n_heads, int dk,
                   int window, const int *sizes, int n_sizes) {
    for (int r = 0, i = 0; r < n_rows; i++) {
        const int want = sizes[i < n_sizes ? i : n_sizes - 1];
        const int n = want < n_rows - r ? want : n_rows - r;
        struct mm_kv_store_args st = {.kv = *kv,
                                      .k = u->k + (int64_t)r * kst,
                                      .k_stride = kst,
                                      .v = u->v + (int64_t)r * vst,
                                      .v_stride = vst,
                                      .n_rows = n,
                                      .row_seq = u->seq + r,
                                      .row_pos = u->pos + r};
        MM_PASS(gpu->ops->kv_store(gpu->ctx, &st));
        struct mm_attn_args at = {.kv = *kv,
                                  .q = u->q + (int64_t)r * qst,
                                  .q_stride = qst,
                                  .out = d_out + (int64_t)r * ost,
                                  .out_stride = ost,
                                  .n_rows = n,
                                  .row_seq = u->seq + r,
                                  .row_pos = u->pos + r,
                                  .n_heads = n_heads,
                                  .scale = 1.0f / sqrtf((float)dk),
                                  .window = window};
        MM_PASS(gpu->ops->attention(gpu->ctx, &at));
        r += n;
    }
    MM_PASS(gpu->ops->synchronize(gpu->ctx));
}

// All n_rows of u in one attention call over the cache as it is (no store) into d_out, filled
// with 7 first, under the contract and tile settings in force.
static void tc_whole(const struct mm_kv_view *kv, const struct tc_rows *u, int n_rows, int64_t qst,
                     float *d_out, int64_t ost, int n_heads, int dk, int window) {
    MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, (int64_t)n_rows * ost));
    struct mm_attn_args at = {.kv = *kv,
                              .q = u->q,
                              .q_stride = qst,
                              .out = d_out,
                              .out_stride = ost,
                              .n_rows = n_rows,
                              .row_seq = u->seq,
                              .row_pos = u->pos,
                              .n_heads = n_heads,
                              .scale = 1.0f / sqrtf((float)dk),
                              .window = window};
    MM_PASS(gpu->ops->attention(gpu->ctx, &at));
}

// The bf16 cache (struct mm_kv_view.dtype, the backend's kv_dtype for head dims multiples of
// 8): kv is the f32 case's view, all its f32 whole-prompt outputs (row-major, seq-major rows).
// Each way a row reaches the contract again, each time from a cache of NaN (bf16 0xffff),
// stored by kv_store into bf16 then attended: the whole prompt with the default tiles (one per
// warp, 8 warps), 4 warps, two tiles per warp, and with the contract switched off (a bf16 cache
// is read by the contract anyway); chunks of 37, 128, 1, 200; decode steps (attention_tcd.cu
// with 3, 6 and 4 key buffers, then attention_tc_kernel with mm_gpu_set_attention_tcd(0)); the
// sequences interleaved (one and two tiles). *d_out_n: output elements differing from all, summed; *d_store_n: cache
// elements that are not the host's round-to-nearest-even bf16 of k and v after the first run.
static void tc_case_kb(const struct mm_kv_view *kv, const int32_t *tables, int64_t pool_n,
                       const int *lens, int n_seqs, int n_rows, const float *q, const float *k,
                       const float *v, const int32_t *rs, const int32_t *rp, int n_heads, int dk,
                       int dv, int window, const float *all, float *d_out, int64_t *d_out_n,
                       int64_t *d_store_n, int *n_runs) {
    const int n_kv = kv->n_kv_heads, bs = kv->block_size;
    const int64_t kst = (int64_t)n_kv * dk, vst = (int64_t)n_kv * dv;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv,
                  on = (int64_t)n_rows * ost;
    struct mm_kv_view kb = *kv;
    kb.dtype = MM_DTYPE_BF16;
    kb.base = dev_copy(NULL, (size_t)pool_n * 2);
    uint16_t *nan16 = malloc((size_t)pool_n * 2);
    int32_t *order = malloc((size_t)n_rows * 4);
    MM_TRUE(nan16 && order);
    memset(nan16, 0xff, (size_t)pool_n * 2);
    int max_len = 0;
    for (int s = 0; s < n_seqs; s++)
        max_len = lens[s] > max_len ? lens[s] : max_len;
    int64_t d = 0;
    *d_store_n = -1;
    *n_runs = 0;
    // compares the outputs (row i of the call order = original row order[i]) with all
    void *d_cache = kb.base;
#define KB_FRESH()                                                                                   do {                                                                                                 MM_PASS(gpu->ops->set(gpu->ctx, d_cache, nan16, (size_t)pool_n * 2));                            MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));                                          } while (0)
#define KB_CHECK()                                                                                   do {                                                                                                 float *got_ = dev_get(d_out, (size_t)on * 4);                                                    for (int i_ = 0; i_ < n_rows; i_++)                                                                  d += n_diff(all + (int64_t)order[i_] * ost, got_ + (int64_t)i_ * ost, ost);                  free(got_);                                                                                      ++*n_runs;                                                                                   } while (0)

    // whole prompt, seq-major, under four settings; then the stored bits
    for (int i = 0; i < n_rows; i++)
        order[i] = i;
    struct tc_rows u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    const int whole[1] = {n_rows};
    for (int var = 0; var < 4; var++) {
        if (var == 1)
            mm_gpu_set_attention_tc_warps(4);
        else if (var == 2 && mm_gpu_set_attention_tc_mt)
            mm_gpu_set_attention_tc_mt(2);
        else if (var == 3)
            mm_gpu_set_attention_tc(0);
        KB_FRESH();
        tc_run(&kb, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, whole, 1);
        mm_gpu_set_attention_tc_warps(8);
        if (mm_gpu_set_attention_tc_mt)
            mm_gpu_set_attention_tc_mt(1);
        mm_gpu_set_attention_tc(1);
        KB_CHECK();
        if (var == 0) {
            uint16_t *c16 = dev_get(kb.base, (size_t)pool_n * 2);
            const int64_t slot = kv->slot_stride, bstride = kv->block_stride;
            int64_t ds = 0;
            for (int i = 0; i < n_rows; i++) {
                const int32_t blk = tables[(int64_t)rs[i] * kv->max_blocks + rp[i] / bs];
                const uint16_t *sl = c16 + (int64_t)blk * bstride + (int64_t)(rp[i] % bs) * slot;
                for (int64_t j = 0; j < kst; j++)
                    ds += sl[j] != mm_f32_to_bf16(k[(int64_t)i * kst + j]);
                for (int64_t j = 0; j < vst; j++)
                    ds += sl[kst + j] != mm_f32_to_bf16(v[(int64_t)i * vst + j]);
            }
            free(c16);
            *d_store_n = ds;
        }
    }
    // chunked prefill
    const int chunks[4] = {37, 128, 1, 200};
    KB_FRESH();
    tc_run(&kb, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, chunks, 4);
    KB_CHECK();
    tc_rows_free(&u);

    // decode steps: step p holds position p of every sequence that long; attention_tcd.cu's
    // kernel with 4 key buffers (the default), with 6 and one head per block, with 3 and two heads per block,
    // then attention_tc_kernel
    int n = 0;
    for (int p = 0; p < max_len; p++)
        for (int s = 0, r = 0; s < n_seqs; r += lens[s], s++)
            if (p < lens[s])
                order[n++] = r + p;
    u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    const bool tcd_knobs = mm_gpu_set_attention_tcd_kb_bufs && mm_gpu_set_attention_tcd_gsub;
    for (int tcd = 3; tcd >= (mm_gpu_set_attention_tcd ? 0 : 3); tcd--) {
        if ((tcd == 2 || tcd == 1) && !tcd_knobs)
            continue;
        if (tcd == 2)
            mm_gpu_set_attention_tcd_kb_bufs(6), mm_gpu_set_attention_tcd_gsub(1);
        else if (tcd == 1)
            mm_gpu_set_attention_tcd_kb_bufs(3), mm_gpu_set_attention_tcd_gsub(2);
        else if (tcd == 0)
            mm_gpu_set_attention_tcd(0);
        KB_FRESH();
        for (int p = 0, r = 0; p < max_len; p++) {
            int w = 0;
            for (int s = 0; s < n_seqs; s++)
                w += p < lens[s];
            const int one[1] = {w};
            struct tc_rows us = u;
            us.q += (int64_t)r * qst, us.k += (int64_t)r * kst, us.v += (int64_t)r * vst;
            us.seq += r, us.pos += r;
            tc_run(&kb, &us, w, qst, kst, vst, d_out + (int64_t)r * ost, ost, n_heads, dk, window,
                   one, 1);
            r += w;
        }
        if (mm_gpu_set_attention_tcd)
            mm_gpu_set_attention_tcd(-1);
        if (tcd_knobs)
            mm_gpu_set_attention_tcd_kb_bufs(-1), mm_gpu_set_attention_tcd_gsub(-1);
        KB_CHECK();
    }
    tc_rows_free(&u);

    // the sequences' rows interleaved, one call, one then two tiles per warp
    interleave_rows(lens, n_seqs, n_rows, order);
    u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    for (int mt = 1; mt <= (mm_gpu_set_attention_tc_mt ? 2 : 1); mt++) {
        if (mm_gpu_set_attention_tc_mt)
            mm_gpu_set_attention_tc_mt(mt);
        KB_FRESH();
        tc_run(&kb, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, whole, 1);
        KB_CHECK();
    }
    if (mm_gpu_set_attention_tc_mt)
        mm_gpu_set_attention_tc_mt(1);
    tc_rows_free(&u);
#undef KB_FRESH
#undef KB_CHECK
    *d_out_n = d;
    gpu->ops->buffer_free(gpu->ctx, kb.base);
    free(nan16), free(order);
}

// A block table that is a permutation of [0, n): i -> (i * m + 3) % n with m >= 7 the first
// stride coprime to n (i * 7 + 3 alone aliases blocks when 7 divides n: 7 sequences of 70 blocks
// each hit only 70 of the 490, so the sequences overwrote each other's keys in the cache and
// kv_store's racing writes to a shared slot made the reference and the checked run read
// different caches: the "wrong" tcw outputs of the 10:11 and 10:20 UTC H200 runs). Checked.
static int32_t *perm_tables(int n) {
    int m = 7;
    for (;;) {
        int a = m, b = n;
        while (b != 0) {
            const int t = a % b;
            a = b, b = t;
        }
        if (a == 1)
            break;
        m += 2;
    }
    int32_t *t = malloc((size_t)n * 4);
    unsigned char *seen = calloc((size_t)n, 1);
    MM_TRUE(t != NULL && seen != NULL);
    for (int i = 0; i < n; i++) {
        t[i] = (int32_t)(((int64_t)i * m + 3) % n);
        MM_TRUE(!seen[t[i]]);
        seen[t[i]] = 1;
    }
    free(seen);
    return t;
}

static void tc_case(int n_heads, int n_kv, int dk, int dv, int window, const int *lens,
                    int n_seqs) {
    const int bs = 16;
    int max_len = 0;
    for (int s = 0; s < n_seqs; s++)
        if (lens[s] > max_len)
            max_len = lens[s];
    const int max_blocks = (max_len + bs - 1) / bs + 1, n_blocks = n_seqs * max_blocks;
    const int64_t slot = (int64_t)n_kv * (dk + dv), bstride = slot * bs;
    const int64_t pool_n = (int64_t)n_blocks * bstride;
    int32_t *tables = perm_tables(n_blocks); // a sequence's blocks far apart
    int32_t *rs = NULL, *rp = NULL;
    const int n_rows = seq_rows(lens, n_seqs, &rs, &rp);
    const int64_t kst = (int64_t)n_kv * dk, vst = (int64_t)n_kv * dv;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv,
                  on = (int64_t)n_rows * ost;
    float *k = rand_f32(n_rows * kst, 1.0f), *v = rand_f32(n_rows * vst, 1.0f);
    float *q = rand_f32(n_rows * qst, 3.0f);

    // CPU reference (f32)
    float *pool = calloc((size_t)pool_n, 4), *ref = calloc((size_t)on, 4);
    MM_TRUE(pool && ref);
    struct mm_kv_view hkv = {.base = pool,
                             .block_size = bs,
                             .block_stride = bstride,
                             .slot_stride = slot,
                             .n_kv_heads = n_kv,
                             .head_dim_k = dk,
                             .head_dim_v = dv,
                             .block_tables = tables,
                             .max_blocks = max_blocks};
    struct mm_kv_store_args hst = {.kv = hkv,
                                   .k = k,
                                   .k_stride = kst,
                                   .v = v,
                                   .v_stride = vst,
                                   .n_rows = n_rows,
                                   .row_seq = rs,
                                   .row_pos = rp};
    struct mm_attn_args hat = {.kv = hkv,
                               .q = q,
                               .q_stride = qst,
                               .out = ref,
                               .out_stride = ost,
                               .n_rows = n_rows,
                               .row_seq = rs,
                               .row_pos = rp,
                               .n_heads = n_heads,
                               .scale = 1.0f / sqrtf((float)dk),
                               .window = window};
    MM_PASS(cpu->ops->kv_store(cpu->ctx, &hst));
    MM_PASS(cpu->ops->attention(cpu->ctx, &hat));

    struct mm_kv_view kv = hkv;
    kv.base = dev_copy(NULL, (size_t)pool_n * 4);
    kv.block_tables = dev_copy(tables, (size_t)n_blocks * 4);
    float *d_out = dev_copy(NULL, (size_t)on * 4);
    int32_t *order = malloc((size_t)n_rows * 4);
    MM_TRUE(order != NULL);

    // 1. whole prompt: all rows in one call (seq-major order)
    for (int i = 0; i < n_rows; i++)
        order[i] = i;
    struct tc_rows u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    MM_PASS(gpu->ops->fill(gpu->ctx, kv.base, NAN, pool_n));
    MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
    const int whole[1] = {n_rows};
    tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, whole, 1);
    float *all = dev_get(d_out, (size_t)on * 4);
    double num = 0, den = 0;
    for (int64_t i = 0; i < on; i++) {
        const double x = all[i], y = ref[i];
        num += isnan(x) ? INFINITY : (x - y) * (x - y);
        den += y * y;
    }
    const double nmse = den > 0 ? num / den : num;
    // the same call through ops.cu's f32 kernels: it must differ (else the contract did not
    // take this shape and the comparisons below would test the f32 kernels)
    mm_gpu_set_attention_tc(0);
    tc_whole(&kv, &u, n_rows, qst, d_out, ost, n_heads, dk, window);
    mm_gpu_set_attention_tc(1);
    float *got = dev_get(d_out, (size_t)on * 4);
    const int64_t d_f32 = n_diff(all, got, on);
    free(got);

    // 1b. the same call with 4 warps per block (other tiles), with one key buffer (two
    // barriers per block), and with two m16 tiles per warp (256 units per block)
    int64_t d_warps = 0;
    for (int var = 0; var < 3; var++) {
        if (var == 0)
            mm_gpu_set_attention_tc_warps(4);
        else if (var == 1)
            mm_gpu_set_attention_tc_db(0);
        else if (mm_gpu_set_attention_tc_mt)
            mm_gpu_set_attention_tc_mt(2);
        else
            continue;
        tc_whole(&kv, &u, n_rows, qst, d_out, ost, n_heads, dk, window);
        mm_gpu_set_attention_tc_warps(8);
        mm_gpu_set_attention_tc_db(1);
        if (mm_gpu_set_attention_tc_mt)
            mm_gpu_set_attention_tc_mt(1);
        got = dev_get(d_out, (size_t)on * 4);
        d_warps += n_diff(all, got, on);
        free(got);
    }

    // 2. chunked prefill: 37, 128, 1, then 200 rows per call, each chunk stored first
    MM_PASS(gpu->ops->fill(gpu->ctx, kv.base, NAN, pool_n));
    MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
    const int chunks[4] = {37, 128, 1, 200};
    tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, chunks, 4);
    got = dev_get(d_out, (size_t)on * 4);
    const int64_t d_chunks = n_diff(all, got, on);
    free(got);
    tc_rows_free(&u);

    // 3. decode steps: step i holds position i of every sequence that long (one row each)
    int n = 0;
    for (int p = 0; p < max_len; p++)
        for (int s = 0, r = 0; s < n_seqs; r += lens[s], s++)
            if (p < lens[s])
                order[n++] = r + p;
    u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    MM_PASS(gpu->ops->fill(gpu->ctx, kv.base, NAN, pool_n));
    MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
    for (int p = 0, r = 0; p < max_len; p++) {
        int w = 0;
        for (int s = 0; s < n_seqs; s++)
            w += p < lens[s];
        const int one[1] = {w};
        struct tc_rows us = u;
        us.q += (int64_t)r * qst, us.k += (int64_t)r * kst, us.v += (int64_t)r * vst;
        us.seq += r, us.pos += r;
        tc_run(&kv, &us, w, qst, kst, vst, d_out + (int64_t)r * ost, ost, n_heads, dk, window, one,
               1);
        r += w;
    }
    got = dev_get(d_out, (size_t)on * 4);
    int64_t d_decode = 0;
    for (int i = 0; i < n_rows; i++)
        d_decode += n_diff(all + (int64_t)order[i] * ost, got + (int64_t)i * ost, ost);
    free(got);
    tc_rows_free(&u);

    // 4. the sequences' rows interleaved in runs of 1..11 rows, one call (one tile per warp,
    // then two: several sequences' passes in one block)
    interleave_rows(lens, n_seqs, n_rows, order);
    u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    int64_t d_mixed = 0;
    for (int mt = 1; mt <= (mm_gpu_set_attention_tc_mt ? 2 : 1); mt++) {
        if (mm_gpu_set_attention_tc_mt)
            mm_gpu_set_attention_tc_mt(mt);
        MM_PASS(gpu->ops->fill(gpu->ctx, kv.base, NAN, pool_n));
        MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
        tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, whole, 1);
        got = dev_get(d_out, (size_t)on * 4);
        for (int i = 0; i < n_rows; i++)
            d_mixed += n_diff(all + (int64_t)order[i] * ost, got + (int64_t)i * ost, ost);
        free(got);
    }
    if (mm_gpu_set_attention_tc_mt)
        mm_gpu_set_attention_tc_mt(1);
    tc_rows_free(&u);

    // 5. a bf16 cache where the backend makes one (head dims multiples of 8): the same bits
    const bool kb_shape = dk % 8 == 0 && dv % 8 == 0;
    MM_TRUE(gpu->ops->kv_dtype != NULL);
    MM_EQ((int)gpu->ops->kv_dtype(gpu->ctx, n_kv, dk, dv),
          (int)(kb_shape ? MM_DTYPE_BF16 : MM_DTYPE_F32));
    int64_t d_kb = 0, d_store = 0;
    int kb_runs = 0;
    if (kb_shape)
        tc_case_kb(&kv, tables, pool_n, lens, n_seqs, n_rows, q, k, v, rs, rp, n_heads, dk, dv,
                   window, all, d_out, &d_kb, &d_store, &kb_runs);

    printf("tc attention %dh/%dkv dk %d dv %d window %d, %d rows of %d seqs: nmse vs cpu %.3e "
           "(tol 2e-4), %lld elements differ from the f32 kernels; differing elements vs the "
           "whole-prompt call: 4 warps + one key buffer + two tiles per warp %lld, chunks %lld, decode steps %lld, seqs "
           "interleaved %lld "
           "(of %lld)\n",
           n_heads, n_kv, dk, dv, window, n_rows, n_seqs, nmse, (long long)d_f32,
           (long long)d_warps, (long long)d_chunks, (long long)d_decode, (long long)d_mixed,
           (long long)on);
    if (kb_shape)
        printf("  bf16 cache: %lld elements differ from the f32 cache's whole-prompt call over %d "
               "runs (whole x4 settings, chunks, decode x4 kernels/settings, interleaved x2); %lld "
               "stored elements differ from the host's bf16 of k, v\n",
               (long long)d_kb, kb_runs, (long long)d_store);
    else
        printf("  bf16 cache: not for this shape (head dims not multiples of 8): kv_dtype f32\n");
    fflush(stdout);
    MM_TRUE(nmse <= 2e-4);
    MM_TRUE(d_f32 > 0);
    MM_EQ(d_warps, 0);
    MM_EQ(d_chunks, 0);
    MM_EQ(d_decode, 0);
    MM_EQ(d_mixed, 0);
    MM_EQ(d_kb, 0);
    MM_EQ(d_store, 0);
    gpu->ops->buffer_free(gpu->ctx, kv.base);
    gpu->ops->buffer_free(gpu->ctx, (void *)kv.block_tables);
    gpu->ops->buffer_free(gpu->ctx, d_out);
    free(tables), free(rs), free(rp), free(k), free(v), free(q), free(pool), free(ref), free(all);
    free(order);
}

// attention_tcw_kernel against attention_tc2_kernel (today's prefill kernel), bit for bit, over
// a bf16 cache filled with NaN first: the whole prompt in one call with the switch off is the
// reference; then with it on: the whole prompt, chunks of 100 and 300 rows (calls starting
// mid-sequence; chunks of at most 64 rows would be decode calls), and the sequences' rows
// interleaved. Prints the differing elements, the largest difference and the NMSE of each way.
static void tcw_case(int n_heads, int n_kv, int window, const int *lens, int n_seqs) {
    const int bs = 16, dk = 128, dv = 128;
    int max_len = 0;
    for (int s = 0; s < n_seqs; s++)
        max_len = lens[s] > max_len ? lens[s] : max_len;
    const int max_blocks = (max_len + bs - 1) / bs + 1, n_blocks = n_seqs * max_blocks;
    const int64_t slot = (int64_t)n_kv * (dk + dv), bstride = slot * bs;
    const int64_t pool_n = (int64_t)n_blocks * bstride;
    int32_t *tables = perm_tables(n_blocks);
    int32_t *rs = NULL, *rp = NULL;
    const int n_rows = seq_rows(lens, n_seqs, &rs, &rp);
    const int64_t kst = (int64_t)n_kv * dk, vst = (int64_t)n_kv * dv;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv,
                  on = (int64_t)n_rows * ost;
    float *k = rand_f32(n_rows * kst, 1.0f), *v = rand_f32(n_rows * vst, 1.0f);
    float *q = rand_f32(n_rows * qst, 3.0f);
    struct mm_kv_view kv = {.base = dev_copy(NULL, (size_t)pool_n * 2),
                            .dtype = MM_DTYPE_BF16,
                            .block_size = bs,
                            .block_stride = bstride,
                            .slot_stride = slot,
                            .n_kv_heads = n_kv,
                            .head_dim_k = dk,
                            .head_dim_v = dv,
                            .block_tables = dev_copy(tables, (size_t)n_blocks * 4),
                            .max_blocks = max_blocks};
    uint16_t *nan16 = malloc((size_t)pool_n * 2);
    int32_t *order = malloc((size_t)n_rows * 4);
    MM_TRUE(nan16 && order);
    memset(nan16, 0xff, (size_t)pool_n * 2);
    float *d_out = dev_copy(NULL, (size_t)on * 4);
    for (int i = 0; i < n_rows; i++)
        order[i] = i;
    struct tc_rows u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    const int whole[1] = {n_rows}, chunks[2] = {100, 300};
    float *ref = NULL;
    int64_t d_tot = 0;
    if (mm_gpu_set_attention_tc_mt) // the reference: two m16 tiles per warp (the default)
        mm_gpu_set_attention_tc_mt(2);
    for (int way = 0; way < 4; way++) {
        if (way == 3) { // interleaved rows
            tc_rows_free(&u);
            interleave_rows(lens, n_seqs, n_rows, order);
            u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
        }
        mm_gpu_set_attention_tcw(way > 0);
        MM_PASS(gpu->ops->set(gpu->ctx, kv.base, nan16, (size_t)pool_n * 2));
        MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
        if (way == 2)
            tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, chunks, 2);
        else
            tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, window, whole, 1);
        mm_gpu_set_attention_tcw(-1);
        float *got = dev_get(d_out, (size_t)on * 4);
        if (way == 0) {
            ref = got;
            continue;
        }
        int64_t d = 0;
        double mx = 0, num = 0, den = 0;
        for (int i = 0; i < n_rows; i++) {
            const float *a = ref + (int64_t)order[i] * ost, *b = got + (int64_t)i * ost;
            d += n_diff(a, b, ost);
            for (int64_t j = 0; j < ost; j++) {
                const double e = isnan(b[j]) ? INFINITY : fabs((double)a[j] - b[j]);
                mx = e > mx ? e : mx;
                num += e * e, den += (double)a[j] * a[j];
            }
        }
        printf("tcw %dh/%dkv window %d, %d rows of %d seqs, %s: %lld of %lld elements differ from "
               "attention_tc2_kernel, max |diff| %.3e, nmse %.3e\n",
               n_heads, n_kv, window, n_rows, n_seqs,
               way == 1 ? "whole" : way == 2 ? "chunks 100/300" : "interleaved", (long long)d,
               (long long)on, mx, den > 0 ? num / den : num);
        fflush(stdout);
        d_tot += d;
        free(got);
    }
    tc_rows_free(&u);
    if (mm_gpu_set_attention_tc_mt)
        mm_gpu_set_attention_tc_mt(1);
    MM_EQ(d_tot, 0);
    gpu->ops->buffer_free(gpu->ctx, kv.base);
    gpu->ops->buffer_free(gpu->ctx, (void *)kv.block_tables);
    gpu->ops->buffer_free(gpu->ctx, d_out);
    free(tables), free(rs), free(rp), free(k), free(v), free(q), free(ref), free(nan16), free(order);
}

static void test_tcw(void) {
    open_backends();
    if (!mm_gpu_set_attention_tcw) {
        close_backends();
        MM_SKIP("no attention_tcw.cu in this build");
    }
    const int lens[7] = {1, 15, 64, 65, 200, 517, 1100}, two[2] = {300, 77};
    for (int form = 0; form < 4; form++) {
        const int qr = form & 1, pipe = form >> 1;
        if ((qr && !mm_gpu_set_attention_tcw_qr) || (pipe && !mm_gpu_set_attention_tcw_pipe))
            continue;
        if (mm_gpu_set_attention_tcw_qr)
            mm_gpu_set_attention_tcw_qr(qr);
        if (mm_gpu_set_attention_tcw_pipe)
            mm_gpu_set_attention_tcw_pipe(pipe);
        printf("Q from %s, key blocks %s:\n", qr ? "registers" : "shared memory",
               pipe ? "pipelined" : "one after the other");
        tcw_case(32, 4, 0, lens, 7); // Qwen3-30B-A3B's heads
        tcw_case(6, 3, 40, two, 2);  // sliding window, GQA 2
        tcw_case(16, 16, 0, two, 2); // no GQA: 128 rows per block
    }
    if (mm_gpu_set_attention_tcw_qr)
        mm_gpu_set_attention_tcw_qr(-1);
    if (mm_gpu_set_attention_tcw_pipe)
        mm_gpu_set_attention_tcw_pipe(-1);
    close_backends();
}

static float bf(float x) { return mm_bf16_to_f32(mm_f32_to_bf16(x)); }

// attention_tcw_kernel's diagnostic modes against host references, one sequence of 300 rows,
// 32 heads over 4 kv heads (runs only with MM_TCW_DIAG_TEST=1): kind 1 the raw S of a key block
// (tolerance: f32 sums in another order), kinds 2..4 one-hot P (a V row, exact). Prints, per
// mode, the elements off and samples (expected vs got, and which key / dim the got value is).
static void test_tcw_diag(void) {
    const char *env = getenv("MM_TCW_DIAG_TEST");
    if (env == NULL || strcmp(env, "1") != 0)
        MM_SKIP("diagnostics: MM_TCW_DIAG_TEST=1 runs them");
    open_backends();
    if (!mm_gpu_set_attention_tcw || !mm_gpu_set_attention_tcw_diag) {
        close_backends();
        MM_SKIP("no attention_tcw.cu diagnostics in this build");
    }
    const int n_heads = 32, n_kv = 4, bs = 16, dk = 128, dv = 128, lens[1] = {300};
    const int max_blocks = (300 + bs - 1) / bs + 1, n_blocks = max_blocks;
    const int64_t slot = (int64_t)n_kv * (dk + dv), bstride = slot * bs;
    const int64_t pool_n = (int64_t)n_blocks * bstride;
    int32_t *tables = perm_tables(n_blocks);
    int32_t *rs = NULL, *rp = NULL;
    const int n_rows = seq_rows(lens, 1, &rs, &rp);
    const int64_t kst = (int64_t)n_kv * dk, vst = (int64_t)n_kv * dv;
    const int64_t qst = (int64_t)n_heads * dk, ost = (int64_t)n_heads * dv,
                  on = (int64_t)n_rows * ost;
    float *k = rand_f32(n_rows * kst, 1.0f), *v = rand_f32(n_rows * vst, 1.0f);
    float *q = rand_f32(n_rows * qst, 3.0f);
    struct mm_kv_view kv = {.base = dev_copy(NULL, (size_t)pool_n * 2),
                            .dtype = MM_DTYPE_BF16,
                            .block_size = bs,
                            .block_stride = bstride,
                            .slot_stride = slot,
                            .n_kv_heads = n_kv,
                            .head_dim_k = dk,
                            .head_dim_v = dv,
                            .block_tables = dev_copy(tables, (size_t)n_blocks * 4),
                            .max_blocks = max_blocks};
    int32_t *order = malloc((size_t)n_rows * 4);
    float *want = malloc((size_t)on * 4);
    MM_TRUE(order && want);
    for (int i = 0; i < n_rows; i++)
        order[i] = i;
    float *d_out = dev_copy(NULL, (size_t)on * 4);
    struct tc_rows u = tc_upload(order, n_rows, q, qst, k, kst, v, vst, rs, rp);
    const int whole[1] = {n_rows};
    const int modes[] = {1, 21, 2, 22, 3, 4};
    const int group = n_heads / n_kv;
    // K / V of key t, kv head h, dim d (bf16 values; 0 past the sequence). In the diagnostic
    // modes the kernel's keys past the last position of the row's tile (rows_pb = 16 rows: 8
    // heads per block) are zeros: KEYR is KEYV limited to row r's tile.
#define KEYV(arr, t, h, d) ((t) < n_rows ? bf((arr)[(int64_t)(t) * kst + (h) * 128 + (d)]) : 0.0f)
#define KEYR(arr, t, h, d) ((t) <= (r | 15) ? KEYV(arr, t, h, d) : 0.0f)
    for (size_t mi = 0; mi < sizeof(modes) / sizeof(modes[0]); mi++) {
        const int mode = modes[mi], kind = mode % 10, blk = mode / 10;
        for (int r = 0; r < n_rows; r++)
            for (int h = 0; h < n_heads; h++) {
                const int kvh = h / group;
                float *w = want + (int64_t)r * ost + h * 128;
                for (int d = 0; d < 128; d++) {
                    if (kind == 1) {
                        double sum = 0;
                        const int t = 64 * blk + d;
                        if (d < 64)
                            for (int x = 0; x < 128; x++)
                                sum += (double)bf(q[(int64_t)r * qst + h * 128 + x]) *
                                       KEYR(k, t, kvh, x);
                        w[d] = (float)sum;
                    } else {
                        w[d] = KEYR(v, 64 * blk + r % 64, kvh, d);
                    }
                }
            }
        mm_gpu_set_attention_tcw_diag(mode);
        mm_gpu_set_attention_tcw(1);
        MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
        tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, 0, whole, 1);
        mm_gpu_set_attention_tcw(-1);
        mm_gpu_set_attention_tcw_diag(0);
        float *got = dev_get(d_out, (size_t)on * 4);
        int64_t off = 0, shown = 0;
        for (int64_t i = 0; i < on; i++) {
            const double tol = kind == 1 ? 2e-3 * (1.0 + fabs(want[i])) : 0.0;
            if (!(fabs((double)got[i] - want[i]) <= tol))
                off++;
        }
        printf("DIAG mode %d (kind %d: %s, key block %d): %lld of %lld elements off\n", mode, kind,
               kind == 1   ? "raw S"
               : kind == 2 ? "one-hot P V"
               : kind == 3 ? "one-hot P V, V desc LBO/SBO swapped"
                           : "one-hot P V, P regs {0,2,1,3}",
               blk, (long long)off, (long long)on);
        for (int r = 0; r < n_rows && shown < 6; r += 37)
            for (int h = 0; h < n_heads && shown < 6; h += 13) {
                const int kvh = h / group;
                const float *w = want + (int64_t)r * ost + h * 128, *g = got + (int64_t)r * ost + h * 128;
                int bad = 0;
                for (int d = 0; d < 128; d++)
                    bad += !(fabs((double)g[d] - w[d]) <= (kind == 1 ? 2e-3 * (1.0 + fabs(w[d])) : 0.0));
                printf("  row %d head %d: %d of 128 off; d0..3 want %.5g %.5g %.5g %.5g got %.5g %.5g "
                       "%.5g %.5g; d64 want %.5g got %.5g\n",
                       r, h, bad, w[0], w[1], w[2], w[3], g[0], g[1], g[2], g[3], w[64], g[64]);
                if (bad == 0)
                    continue;
                shown++;
                if (kind != 1) { // which key's V row (and dims) the output matches best
                    int bk = -1, bn = -1;
                    for (int t = 0; t < 64 * 5; t++) {
                        int n = 0;
                        for (int d = 0; d < 128; d++)
                            n += g[d] == KEYV(v, t, kvh, d);
                        if (n > bn)
                            bn = n, bk = t;
                    }
                    printf("    best V key %d (want %d): %d of 128 dims equal;", bk,
                           64 * blk + r % 64, bn);
                    for (int d = 0; d < 6; d++) { // dims of the wanted key holding g[d]
                        int dd = -1;
                        for (int x = 0; x < 128 && dd < 0; x++)
                            if (g[d] == KEYV(v, 64 * blk + r % 64, kvh, x))
                                dd = x;
                        printf(" g[%d]=want[%d]", d, dd);
                    }
                    printf("\n");
                } else { // which (key, head) S column the got values are
                    for (int d = 0; d < 4; d++) {
                        int bt = -1;
                        double be = 1e30;
                        for (int t = 0; t < 64 * 5; t++) {
                            double sum = 0;
                            for (int x = 0; x < 128; x++)
                                sum += (double)bf(q[(int64_t)r * qst + h * 128 + x]) *
                                       KEYV(k, t, kvh, x);
                            if (fabs(sum - g[d]) < be)
                                be = fabs(sum - g[d]), bt = t;
                        }
                        printf("    got[%d] %.5g nearest S key %d (|e| %.2g)\n", d, g[d], bt, be);
                    }
                }
            }
        fflush(stdout);
        free(got);
    }
#undef KEYV
#undef KEYR
    // full attention: the tcw kernel (0) and its variants 5..8 against attention_tc2_kernel
    if (mm_gpu_set_attention_tc_mt)
        mm_gpu_set_attention_tc_mt(2);
    float *ref = NULL;
    const int fulls[] = {-1, 0, 5, 6, 7, 8, 0};
    for (size_t fi = 0; fi < sizeof(fulls) / sizeof(fulls[0]); fi++) {
        const int mode = fulls[fi];
        mm_gpu_set_attention_tcw_diag(mode < 0 ? 0 : mode);
        mm_gpu_set_attention_tcw(mode >= 0);
        MM_PASS(gpu->ops->fill(gpu->ctx, d_out, 7.0f, on));
        tc_run(&kv, &u, n_rows, qst, kst, vst, d_out, ost, n_heads, dk, 0, whole, 1);
        mm_gpu_set_attention_tcw(-1);
        mm_gpu_set_attention_tcw_diag(0);
        float *got = dev_get(d_out, (size_t)on * 4);
        if (mode < 0) {
            ref = got;
            continue;
        }
        double num = 0, den = 0;
        for (int64_t i = 0; i < on; i++) {
            const double e = isnan(got[i]) ? INFINITY : fabs((double)ref[i] - got[i]);
            num += e * e, den += (double)ref[i] * ref[i];
        }
        int64_t rows_bad = 0;
        for (int r = 0; r < n_rows; r++)
            rows_bad += n_diff(ref + (int64_t)r * ost, got + (int64_t)r * ost, ost) != 0;
        printf("DIAG full attention variant %d: %lld of %lld elements differ, %lld of %d rows, "
               "nmse %.3e; row 0 h0 d0..2 ref %.6g %.6g %.6g got %.6g %.6g %.6g; row 299 d0 ref "
               "%.6g got %.6g\n",
               mode, (long long)n_diff(ref, got, on), (long long)on, (long long)rows_bad, n_rows,
               num / (den > 0 ? den : 1), ref[0], ref[1], ref[2], got[0], got[1], got[2],
               ref[299 * ost], got[299 * ost]);
        for (int r = 0; r < n_rows; r += 64) { // first differing row per 64
            const int64_t dd = n_diff(ref + (int64_t)r * ost, got + (int64_t)r * ost, ost);
            printf("    row %d: %lld of %lld differ\n", r, (long long)dd, (long long)ost);
        }
        fflush(stdout);
        free(got);
    }
    free(ref);
    tc_rows_free(&u);
    gpu->ops->buffer_free(gpu->ctx, kv.base);
    gpu->ops->buffer_free(gpu->ctx, (void *)kv.block_tables);
    gpu->ops->buffer_free(gpu->ctx, d_out);
    free(tables), free(rs), free(rp), free(k), free(v), free(q), free(want), free(order);
    close_backends();
}

static void test_tc_gqa8(void) {
    open_backends();
    const int two[2] = {300, 77};
    tc_case(32, 4, 128, 128, 0, two, 2); // Qwen3-30B-A3B's heads
    close_backends();
}

static void test_tc_shapes(void) {
    open_backends();
    const int one[1] = {517}, two[2] = {300, 77}, three[3] = {1, 129, 250};
    const int small[2] = {70, 5}, mla[1] = {65}, odd[1] = {130};
    tc_case(8, 2, 64, 64, 0, one, 1);       // head_dim 64, GQA 4
    tc_case(16, 16, 128, 128, 0, three, 3); // no GQA: 128 rows per block
    tc_case(6, 3, 128, 128, 40, two, 2);    // sliding window, GQA 2
    tc_case(12, 4, 64, 128, 100, three, 3); // GQA 3 (126 units per block), dk != dv
    tc_case(32, 2, 96, 64, 0, two, 2);      // GQA 16, dk 96
    tc_case(4, 2, 16, 16, 0, small, 2);     // the fixtures' head_dim 16
    tc_case(4, 4, 24, 16, 0, mla, 1);       // MLA-tiny-like: dk 24 (padded to 32), dv 16
    tc_case(2, 1, 36, 20, 0, odd, 1);       // odd dims (multiples of 4)
    close_backends();
}

MM_TESTS = {
    {"tc attention GQA 8: cpu tolerance, decode == chunks == whole bits", test_tc_gqa8},
    {"tc attention odd shapes: cpu tolerance, decode == chunks == whole bits", test_tc_shapes},
    {"tcw attention (wgmma prefill) == attention_tc2_kernel bits", test_tcw},
    {"tcw diagnostics (MM_TCW_DIAG_TEST=1)", test_tcw_diag},
    {NULL, NULL},
};
