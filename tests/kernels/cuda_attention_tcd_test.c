// SPDX-License-Identifier: MIT
// Decode attention forms against the kernels whose bits they must keep, every output bit:
// - attention_tcd_kernel (kernels/cuda/attention_tcd.cu: decode calls of the tensor-core
//   contract with every warp computing) against attention_tc_kernel's decode form, called
//   directly and through mm_gpu_attention, with one and two key blocks in flight;
// - ops.cu's f32 decode kernel with wide loads (MM_GPU_ATT_WIDE) against the earlier load
//   grouping (mm_gpu_attention_ref).
// Rows are decode-sized calls (1, 5, 33, 64 rows) over 4 sequences of a paged cache filled with
// random values (keys past a row's position are there, so any leak shows), at positions that
// cross the 64-key blocks and the 128-key chunks (0, 1, 62..65, 127..129, 191, 200, 255, 256,
// 300, 517, 1000), GQA ratios 1, 3, 4, 8, 16 and 32, head dims 16..128 (64 and 128 among them,
// dk != dv, odd multiples of 4) and sliding windows. Without the GPU backend (plain `make`) or
// without a GPU, every case skips and says why.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm_test.h"

#define GPU_TEST_SEED 0x2545f4914f6cdd1dull
#include "gpu_test.h"

extern mm_err mm_gpu_attention(void *stream, const struct mm_attn_args *a, int *d_err)
    __attribute__((weak));
extern mm_err mm_gpu_attention_ref(void *stream, const struct mm_attn_args *a, int *d_err)
    __attribute__((weak));
extern mm_err mm_gpu_attention_tc(void *stream, const struct mm_attn_args *a, int *d_err, int *done)
    __attribute__((weak));
extern mm_err mm_gpu_attention_tcd(void *stream, const struct mm_attn_args *a, int *d_err,
                                   int *done) __attribute__((weak));
extern void mm_gpu_set_attention_tc(int mode) __attribute__((weak));
extern void mm_gpu_set_attention_tcd(int mode) __attribute__((weak));
extern void mm_gpu_set_attention_tcd_stages(int n) __attribute__((weak));
extern void mm_gpu_set_attention_wide(int on) __attribute__((weak));
extern mm_err mm_gpu_stream_sync(void *stream) __attribute__((weak));

#define BS 16         // cache block size (tokens)
#define MAX_BLOCKS 72 // per sequence: 1152 positions
#define N_SEQS 4

static const int32_t positions[] = {0, 1, 62, 63, 64, 65, 127, 128, 129, 191, 200, 255, 256, 300,
                                    517, 1000};
#define N_POS ((int)(sizeof(positions) / sizeof(positions[0])))

// The two forms' outputs of one call, compared word by word; returns the differing words.
static int64_t diff_dev(const float *d1, const float *d2, int64_t n) {
    float *a = dev_get(d1, (size_t)n * 4), *b = dev_get(d2, (size_t)n * 4);
    const int64_t d = n_diff(a, b, n);
    int64_t nan7 = 0; // outputs never written keep the fill (7.0)
    for (int64_t i = 0; i < n; i++)
        nan7 += a[i] == 7.0f;
    free(a), free(b);
    MM_EQ(nan7, 0);
    return d;
}

// wide 0: the contract's decode forms; 1: the f32 kernel's load groupings.
static void attn_case(int n_heads, int n_kv, int dk, int dv, int window, int wide) {
    const int n_blocks = N_SEQS * MAX_BLOCKS;
    const int64_t slot = (int64_t)n_kv * (dk + dv), pool_n = (int64_t)n_blocks * BS * slot;
    int32_t tables[N_SEQS * MAX_BLOCKS];
    for (int i = 0; i < n_blocks; i++) // a permutation: a sequence's blocks far apart
        tables[i] = (int32_t)(((int64_t)i * 7 + 3) % n_blocks);
    float *pool = rand_f32(pool_n, 1.0f);
    const int max_rows = 64;
    float *q = rand_f32((int64_t)max_rows * n_heads * dk, 2.0f);
    const int64_t ost = (int64_t)n_heads * dv, on = (int64_t)max_rows * ost;
    float *fill = malloc((size_t)on * 4);
    MM_TRUE(fill != NULL);
    for (int64_t i = 0; i < on; i++)
        fill[i] = 7.0f;
    struct mm_attn_args at = {
        .kv = {.base = dev_copy(pool, (size_t)pool_n * 4),
               .block_size = BS,
               .block_stride = BS * slot,
               .slot_stride = slot,
               .n_kv_heads = n_kv,
               .head_dim_k = dk,
               .head_dim_v = dv,
               .block_tables = dev_copy(tables, sizeof(tables)),
               .max_blocks = MAX_BLOCKS},
        .q = dev_copy(q, (size_t)max_rows * n_heads * dk * 4),
        .q_stride = (int64_t)n_heads * dk,
        .out_stride = ost,
        .n_heads = n_heads,
        .scale = 1.0f / sqrtf((float)dk),
        .window = window};
    float *o1 = dev_copy(NULL, (size_t)on * 4), *o2 = dev_copy(NULL, (size_t)on * 4),
          *o3 = dev_copy(NULL, (size_t)on * 4);
    const int row_counts[4] = {1, 5, 33, 64};
    int64_t diffs = 0, outputs = 0;
    for (int rc = 0; rc < 4; rc++) {
        const int n = row_counts[rc];
        int32_t rs[64], rp[64];
        for (int r = 0; r < n; r++) // every position in every sequence over the calls
            rs[r] = (r + rc) % N_SEQS, rp[r] = positions[(r * 5 + rc * 3) % N_POS];
        at.n_rows = n;
        at.row_seq = dev_copy(rs, (size_t)n * 4);
        at.row_pos = dev_copy(rp, (size_t)n * 4);
        MM_PASS(gpu->ops->set(gpu->ctx, o1, fill, (size_t)on * 4));
        MM_PASS(gpu->ops->set(gpu->ctx, o2, fill, (size_t)on * 4));
        MM_PASS(gpu->ops->set(gpu->ctx, o3, fill, (size_t)on * 4));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        if (!wide) {
            int done = 0;
            mm_gpu_set_attention_tcd(0);
            at.out = o1;
            MM_PASS(mm_gpu_attention_tc(NULL, &at, NULL, &done)); // attention_tc_kernel
            MM_TRUE(done == 1);
            // directly, then through the entry point; 2 then 1 key blocks in flight, and the
            // other way round in the next call
            mm_gpu_set_attention_tcd(1);
            mm_gpu_set_attention_tcd_stages(rc % 2 ? 1 : 2);
            at.out = o2;
            MM_PASS(mm_gpu_attention_tcd(NULL, &at, NULL, &done));
            MM_TRUE(done == 1);
            mm_gpu_set_attention_tcd_stages(rc % 2 ? 2 : 1);
            at.out = o3;
            MM_PASS(mm_gpu_attention(NULL, &at, NULL));
            mm_gpu_set_attention_tcd_stages(-1);
            mm_gpu_set_attention_tcd(-1);
        } else {
            at.out = o1;
            MM_PASS(mm_gpu_attention_ref(NULL, &at, NULL));
            mm_gpu_set_attention_wide(1);
            at.out = o2;
            MM_PASS(mm_gpu_attention(NULL, &at, NULL));
            at.out = o3;
            MM_PASS(mm_gpu_attention(NULL, &at, NULL));
            mm_gpu_set_attention_wide(0);
        }
        MM_PASS(mm_gpu_stream_sync(NULL));
        const int64_t m = (int64_t)n * ost;
        diffs += diff_dev(o1, o2, m) + diff_dev(o1, o3, m);
        outputs += 2 * m;
        dev_free((void *)at.row_seq), dev_free((void *)at.row_pos);
    }
    printf("%s %dh/%dkv dk %d dv %d window %d, calls of 1/5/33/64 rows: %lld of %lld outputs "
           "differ\n",
           wide ? "f32 wide loads vs earlier grouping" : "tc decode: every warp vs warp 0",
           n_heads, n_kv, dk, dv, window, (long long)diffs, (long long)outputs);
    fflush(stdout);
    MM_EQ(diffs, 0);
    void *b[] = {at.kv.base, (void *)at.kv.block_tables, (void *)at.q, o1, o2, o3};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
    free(pool), free(q), free(fill);
}

static void open_tc(int on) {
    if (!mm_gpu_attention || !mm_gpu_attention_ref || !mm_gpu_attention_tc ||
        !mm_gpu_attention_tcd || !mm_gpu_set_attention_tc || !mm_gpu_set_attention_tcd ||
        !mm_gpu_set_attention_tcd_stages ||
        !mm_gpu_set_attention_wide || !mm_gpu_stream_sync)
        MM_SKIP("GPU kernels not linked (plain build; `make cuda` builds this test with them)");
    gpu_open(NULL);
    mm_gpu_set_attention_tc(on);
}

static void close_tc(void) {
    mm_gpu_set_attention_tc(-1);
    gpu_close(NULL);
}

static void test_tcd_bits(void) {
    open_tc(1);
    attn_case(32, 4, 128, 128, 0, 0);  // Qwen3-30B-A3B: GQA 8
    attn_case(8, 8, 64, 64, 0, 0);     // GQA 1, head dim 64
    attn_case(16, 4, 128, 128, 0, 0);  // GQA 4
    attn_case(8, 2, 64, 64, 100, 0);   // GQA 4, dim 64, sliding window
    attn_case(12, 4, 64, 128, 0, 0);   // GQA 3, dk != dv
    attn_case(32, 2, 96, 64, 0, 0);    // GQA 16, dk 96
    attn_case(64, 2, 128, 128, 0, 0);  // GQA 32: two blocks per kv head here, one tile there
    attn_case(6, 3, 128, 128, 40, 0);  // window inside one block
    attn_case(4, 2, 16, 16, 0, 0);     // the fixtures' head dim 16
    attn_case(2, 1, 36, 20, 0, 0);     // odd dims (multiples of 4)
    close_tc();
}

static void test_wide_bits(void) {
    open_tc(0);
    attn_case(32, 4, 128, 128, 0, 1); // GQA 8
    attn_case(8, 8, 64, 64, 0, 1);    // GQA 1, head dim 64
    attn_case(16, 4, 128, 128, 0, 1); // GQA 4
    attn_case(8, 2, 64, 64, 100, 1);  // sliding window
    attn_case(16, 2, 192, 128, 0, 1); // keys past one round
    attn_case(12, 4, 100, 60, 50, 1); // odd dims, window
    close_tc();
}

MM_TESTS = {
    {"tc decode attention: every-warp form == warp-0 form bits", test_tcd_bits},
    {"f32 decode attention: wide loads == earlier grouping bits (rows 1..64)", test_wide_bits},
    {NULL, NULL},
};
