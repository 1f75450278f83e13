// SPDX-License-Identifier: MIT
// Decode attention forms against the kernels whose bits they must keep, every output bit:
// - attention_tcd_kernel (kernels/cuda/attention_tcd.cu: decode calls of the tensor-core
//   contract with every warp computing) against attention_tc_kernel's decode form, called
//   directly and through mm_gpu_attention, with one and two key blocks in flight;
// - ops.cu's f32 decode kernel with wide loads (MM_GPU_ATT_WIDE) against the earlier load
//   grouping (mm_gpu_attention_ref);
// - attention_tcs_kernel (attention_tcs.cuh: the key blocks split over many blocks,
//   MM_GPU_ATT_SPLITK) against both, over contexts up to 9000 keys (split_case below).
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
#include "mm/dtype.h"
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
extern mm_err mm_gpu_attention_tcs(void *stream, const struct mm_attn_args *a, int gsub,
                                   int *d_err, int *done) __attribute__((weak));
extern void mm_gpu_set_attention_splitk(int mode) __attribute__((weak));
extern void mm_gpu_set_attention_splitk_min(int n) __attribute__((weak));
// phase B with a softmax warp feeding the value warps (1) or every warp's own softmax (0)
extern void mm_gpu_set_attention_splitk_pb(int mode) __attribute__((weak));

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

// ---- the key blocks split over many blocks (attention_tcs.cu) ---------------------------------
// Long contexts: 8 sequences of 1, 63, 64, 65, 200, 1000, 4097 and 9000 keys in a bf16 (or f32)
// paged cache of 16-token blocks (tables that send every sequence's blocks far apart, sequences
// sharing the pool under other permutations), calls of 1..8 rows, each row another sequence at
// its last position (the lengths in another order per call). Per call: attention_tc_kernel
// (the reference), attention_tcd_kernel, attention_tcs_kernel called directly (every row split,
// or rows of at most 20 key blocks on its tcd_block, every other call), and the entry point
// with the split on (its default threshold); every output bit compared. An f32 cache: the split refuses it and
// the entry point's fallback (attention_tcd_kernel) gives the same bits. Then a call with a bad
// row: the error flag set as attention_tcd_kernel sets it, the good rows' bits kept.
#define SK_BLOCKS 570 // per sequence: 9120 positions
static int sk_blocks = SK_BLOCKS; // the cache's table length (a larger one in the last case)
#define SK_POOL 1200  // cache blocks in the pool
#define SK_SEQS 8
static const int32_t sk_lens[SK_SEQS] = {1, 63, 64, 65, 200, 1000, 4097, 9000};

static int sk_gsub(int group) { // attention_tcd's default: the largest divisor <= 16
    int gs = 1;
    for (int s = 1; s <= 16 && s <= group; s++)
        if (group % s == 0)
            gs = s;
    return gs;
}

static void split_case(int n_heads, int n_kv, int dk, int dv, int window, int bf16) {
    const int64_t slot = (int64_t)n_kv * (dk + dv), pool_n = (int64_t)SK_POOL * BS * slot;
    int32_t *tables = malloc((size_t)SK_SEQS * sk_blocks * 4);
    MM_TRUE(tables != NULL);
    for (int s = 0; s < SK_SEQS; s++)
        for (int i = 0; i < sk_blocks; i++)
            tables[s * sk_blocks + i] = (int32_t)(((int64_t)i * 7 + 3 + s * 131) % SK_POOL);
    float *pool = rand_f32(pool_n, 1.0f);
    uint16_t *pool16 = malloc((size_t)pool_n * 2);
    MM_TRUE(pool16 != NULL);
    for (int64_t i = 0; i < pool_n; i++) { // the cache's values: bf16 (as f32 for an f32 cache)
        pool16[i] = mm_f32_to_bf16(pool[i]);
        pool[i] = mm_bf16_to_f32(pool16[i]);
    }
    const int max_rows = SK_SEQS;
    float *q = rand_f32((int64_t)max_rows * n_heads * dk, 2.0f);
    const int64_t ost = (int64_t)n_heads * dv, on = (int64_t)max_rows * ost;
    float *fill = malloc((size_t)on * 4);
    MM_TRUE(fill != NULL);
    for (int64_t i = 0; i < on; i++)
        fill[i] = 7.0f;
    struct mm_attn_args at = {
        .kv = {.base = bf16 ? dev_copy(pool16, (size_t)pool_n * 2)
                            : dev_copy(pool, (size_t)pool_n * 4),
               .block_size = BS,
               .block_stride = BS * slot,
               .slot_stride = slot,
               .n_kv_heads = n_kv,
               .head_dim_k = dk,
               .head_dim_v = dv,
               .block_tables = dev_copy(tables, (size_t)SK_SEQS * sk_blocks * 4),
               .max_blocks = sk_blocks,
               .dtype = bf16 ? MM_DTYPE_BF16 : MM_DTYPE_F32},
        .q = dev_copy(q, (size_t)max_rows * n_heads * dk * 4),
        .q_stride = (int64_t)n_heads * dk,
        .out_stride = ost,
        .n_heads = n_heads,
        .scale = 1.0f / sqrtf((float)dk),
        .window = window};
    float *o[6];
    for (int i = 0; i < 6; i++)
        o[i] = dev_copy(NULL, (size_t)on * 4);
    int *d_err = dev_copy(NULL, 4);
    const int gsub = sk_gsub(n_heads / n_kv);
    int64_t diffs = 0, outputs = 0;
    for (int n = 1; n <= max_rows; n++) {
        int32_t rs[SK_SEQS], rp[SK_SEQS];
        for (int r = 0; r < n; r++) { // another sequence and length order per call
            rs[r] = (r * 3 + n) % SK_SEQS;
            rp[r] = sk_lens[(r * 5 + n * 3) % SK_SEQS] - 1;
        }
        at.n_rows = n;
        at.row_seq = dev_copy(rs, (size_t)n * 4);
        at.row_pos = dev_copy(rp, (size_t)n * 4);
        for (int i = 0; i < 6; i++)
            MM_PASS(gpu->ops->set(gpu->ctx, o[i], fill, (size_t)on * 4));
        MM_PASS(gpu->ops->synchronize(gpu->ctx));
        int done = 0;
        mm_gpu_set_attention_splitk(0);
        mm_gpu_set_attention_tcd(0);
        at.out = o[0];
        MM_PASS(mm_gpu_attention_tc(NULL, &at, NULL, &done)); // attention_tc_kernel
        MM_TRUE(done == 1);
        mm_gpu_set_attention_tcd(1);
        at.out = o[1];
        MM_PASS(mm_gpu_attention_tcd(NULL, &at, NULL, &done)); // attention_tcd_kernel
        MM_TRUE(done == 1);
        mm_gpu_set_attention_splitk(1);
        // every row split (odd calls), or rows of at most 20 key blocks on tcd_block (even)
        mm_gpu_set_attention_splitk_min(n % 2 ? 0 : 20);
        at.out = o[2];
        MM_PASS(mm_gpu_attention_tcs(NULL, &at, gsub, NULL, &done)); // attention_tcs_kernel
        MM_EQ(done, bf16 ? 1 : 0); // an f32 cache: refused
        mm_gpu_set_attention_splitk_min(-1);
        mm_gpu_set_attention_tcd(-1);
        at.out = o[3];
        MM_PASS(mm_gpu_attention(NULL, &at, NULL)); // the entry point, split on
        // keys_early (the rows' sequences differ, the rows and the cache were copied before):
        // the keys below each position copied before the kernel's wait, the same bits
        at.keys_early = 1;
        at.out = o[4];
        MM_PASS(mm_gpu_attention(NULL, &at, NULL));
        mm_gpu_set_attention_splitk(0);
        mm_gpu_set_attention_tcd(1);
        at.out = o[5];
        MM_PASS(mm_gpu_attention_tcd(NULL, &at, NULL, &done));
        MM_TRUE(done == 1);
        mm_gpu_set_attention_splitk(1);
        mm_gpu_set_attention_tcd(-1);
        at.keys_early = 0;
        MM_PASS(mm_gpu_stream_sync(NULL));
        const int64_t m = (int64_t)n * ost;
        diffs += diff_dev(o[0], o[1], m) + diff_dev(o[0], o[3], m);
        diffs += diff_dev(o[0], o[4], m) + diff_dev(o[0], o[5], m);
        outputs += 4 * m;
        if (bf16) {
            diffs += diff_dev(o[0], o[2], m);
            outputs += m;
        }
        mm_gpu_set_attention_splitk(-1);
        dev_free((void *)at.row_seq), dev_free((void *)at.row_pos);
    }
    // a bad row (position -1) among good ones: flagged by both, good rows' bits kept
    int64_t bad_diffs = 0;
    int flags[2] = {0, 0};
    if (bf16) {
        const int n = 4;
        const int32_t rs[4] = {6, 0, 7, 2}, rp[4] = {4096, -1, 8999, 199};
        at.n_rows = n;
        at.row_seq = dev_copy(rs, sizeof(rs));
        at.row_pos = dev_copy(rp, sizeof(rp));
        for (int k = 0; k < 2; k++) {
            const int zero = 0;
            MM_PASS(gpu->ops->set(gpu->ctx, d_err, &zero, 4));
            MM_PASS(gpu->ops->set(gpu->ctx, o[k], fill, (size_t)on * 4));
            MM_PASS(gpu->ops->synchronize(gpu->ctx));
            mm_gpu_set_attention_tcd(1);
            mm_gpu_set_attention_splitk(k);
            int done = 0;
            at.out = o[k];
            MM_PASS(mm_gpu_attention_tcd(NULL, &at, d_err, &done));
            MM_TRUE(done == 1);
            MM_PASS(mm_gpu_stream_sync(NULL));
            int *h = dev_get(d_err, 4);
            flags[k] = *h;
            free(h);
        }
        mm_gpu_set_attention_splitk(-1);
        mm_gpu_set_attention_tcd(-1);
        float *a = dev_get(o[0], (size_t)n * ost * 4), *b = dev_get(o[1], (size_t)n * ost * 4);
        bad_diffs = n_diff(a, b, n * ost);
        for (int64_t i = ost; i < 2 * ost; i++) // the bad row: left alone by both
            bad_diffs += a[i] != 7.0f || b[i] != 7.0f;
        for (int64_t i = 0; i < n * ost; i++)
            bad_diffs += (i < ost || i >= 2 * ost) && b[i] == 7.0f;
        free(a), free(b);
        dev_free((void *)at.row_seq), dev_free((void *)at.row_pos);
        MM_EQ(flags[0], 1);
        MM_EQ(flags[1], 1);
        MM_EQ(bad_diffs, 0);
    }
    printf("split-K decode (%s cache) %dh/%dkv dk %d dv %d window %d, contexts 1..9000, calls of "
           "1..8 rows: %lld of %lld outputs differ%s\n",
           bf16 ? "bf16" : "f32 (refused; the fallback's bits)", n_heads, n_kv, dk, dv, window,
           (long long)diffs, (long long)outputs,
           bf16 ? (bad_diffs == 0 && flags[1] == 1 ? "; bad row flagged" : "; BAD ROW CHECK FAILED")
                : "");
    fflush(stdout);
    MM_EQ(diffs, 0);
    void *b[] = {at.kv.base, (void *)at.kv.block_tables, (void *)at.q, o[0], o[1], o[2], o[3],
                 o[4], o[5], d_err};
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        dev_free(b[i]);
    free(pool), free(pool16), free(q), free(fill), free(tables);
}

static void test_split_bits(void) {
    if (!mm_gpu_attention_tcs || !mm_gpu_set_attention_splitk || !mm_gpu_set_attention_splitk_min)
        MM_SKIP("GPU kernels not linked (plain build; `make cuda` builds this test with them)");
    open_tc(1);
    for (int pb = 0; pb < (mm_gpu_set_attention_splitk_pb ? 4 : 1); pb++) {
        if (mm_gpu_set_attention_splitk_pb) {
            mm_gpu_set_attention_splitk_pb(pb);
            printf("phase B %s:\n", pb == 3   ? "with its value chains in a second kernel"
                                     : pb == 2 ? "with every block's softmax at once"
                                     : pb == 1 ? "with a softmax warp"
                                               : "every warp's own softmax");
        }
        split_case(32, 4, 128, 128, 0, 1);    // Qwen3-30B-A3B: GQA 8
        split_case(32, 4, 128, 128, 1000, 1); // a sliding window over several key blocks
        split_case(16, 16, 64, 64, 0, 1);     // GQA 1, head dim 64
        split_case(6, 3, 128, 128, 40, 1);    // GQA 2, a window inside one block
        split_case(12, 4, 64, 128, 0, 1);     // GQA 3, dk != dv
        split_case(64, 2, 128, 128, 0, 1);    // GQA 32: two tiles per kv head
        split_case(8, 2, 40, 24, 100, 1);     // dims padded to 16 (multiples of 8), a window
    }
    if (mm_gpu_set_attention_splitk_pb)
        mm_gpu_set_attention_splitk_pb(-1);
    // a cache of four times the table after the others (the default form): the split kernels'
    // shared memory, sized by the cache, above what the first calls of this process asked
    printf("a larger cache, the default form:\n");
    sk_blocks = 4 * SK_BLOCKS;
    split_case(32, 4, 128, 128, 0, 1);
    sk_blocks = SK_BLOCKS;
    split_case(32, 4, 128, 128, 0, 0); // an f32 cache: refused, the fallback's bits
    close_tc();
}

MM_TESTS = {
    {"tc decode attention: every-warp form == warp-0 form bits", test_tcd_bits},
    {"tc decode attention: split-K form == every-warp form bits (contexts to 9000)",
     test_split_bits},
    {"f32 decode attention: wide loads == earlier grouping bits (rows 1..64)", test_wide_bits},
    {NULL, NULL},
};
