// SPDX-License-Identifier: MIT
// The set-up the GPU op tests (tests/kernels/cuda_*_test.c) share: opening and closing the CUDA
// backend (and the CPU backend some compare with), seeded random data, the rows of a paged-cache
// batch, device copies and a bitwise comparison. Include it after kernels.h and mm_test.h.
// Conventions:
// - This header defines `static mm_backend *gpu;`, the backend under test: gpu_open sets it,
//   gpu_close clears it, and every helper here uses it. A test that compares with the CPU
//   backend keeps its own `static mm_backend *cpu;` and passes &cpu to gpu_open and gpu_close
//   (NULL where it has none).
// - The including file defines GPU_TEST_SEED (a nonzero 64-bit state) before the #include:
//   frand's xorshift starts there, so each test keeps its own random data.
// A failed check in a helper names this header's line (MM_TEST_FAIL_ prints __FILE__).
#ifndef MM_GPU_TEST_H
#define MM_GPU_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "mm_test.h"

#ifndef GPU_TEST_SEED
#error "define GPU_TEST_SEED (frand's starting state) before including gpu_test.h"
#endif

static mm_backend *gpu;

// Opens cuda:0 into gpu and, where cpu_out is not NULL, the CPU backend (2 threads) into
// *cpu_out. Skips the case where the GPU backend is not built or there is no GPU; fails on any
// other error.
static inline void gpu_open(mm_backend **cpu_out) {
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_backend_open(&gpu, "cuda:0", NULL, err);
    if (rv == MM_EUNSUPP)
        MM_SKIP("%s", err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("opening cuda:0: %s (%s)", mm_strerror(rv), err);
    if (cpu_out != NULL) {
        mm_backend_params p = {.n_threads = 2};
        MM_PASS(mm_backend_open(cpu_out, "cpu", &p, err));
    }
}

// Closes what gpu_open opened (pass the same cpu_out) and clears the pointers.
static inline void gpu_close(mm_backend **cpu_out) {
    mm_backend_close(gpu);
    gpu = NULL;
    if (cpu_out != NULL) {
        mm_backend_close(*cpu_out);
        *cpu_out = NULL;
    }
}

static uint64_t gpu_test_rng = GPU_TEST_SEED;

static inline float frand(void) { // uniform in [-1, 1)
    gpu_test_rng ^= gpu_test_rng << 13;
    gpu_test_rng ^= gpu_test_rng >> 7;
    gpu_test_rng ^= gpu_test_rng << 17;
    return (float)((gpu_test_rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

// n random floats in [-scale, scale) (owned: free).
static inline float *rand_f32(int64_t n, float scale) {
    float *p = malloc((size_t)n * 4 + 4);
    MM_TRUE(p != NULL);
    for (int64_t i = 0; i < n; i++)
        p[i] = frand() * scale;
    return p;
}

// Router logits of n rows of E experts: frand() * 4 each, quantised to `levels` values where
// levels > 0 (many ties); row nan_row, where it is one of the n, NaN at every third expert.
// Owned: free.
static inline float *rand_logits(int n, int E, int levels, int nan_row) {
    float *l = malloc((size_t)n * E * 4);
    MM_TRUE(l != NULL);
    for (int64_t i = 0; i < (int64_t)n * E; i++) {
        float v = frand() * 4.0f;
        if (levels > 0)
            v = floorf((v + 4.0f) / 8.0f * (float)levels) / (float)levels;
        l[i] = v;
    }
    if (nan_row >= 0 && nan_row < n)
        for (int e = 0; e < E; e += 3)
            l[(int64_t)nan_row * E + e] = NAN;
    return l;
}

// The rows of n_seqs sequences of lens[s] tokens each, sequence after sequence: (*rs)[r] is row
// r's sequence and (*rp)[r] its position (both owned: free). Returns the number of rows.
static inline int seq_rows(const int *lens, int n_seqs, int32_t **rs, int32_t **rp) {
    int n_rows = 0;
    for (int s = 0; s < n_seqs; s++)
        n_rows += lens[s];
    *rs = malloc((size_t)n_rows * 4 + 4), *rp = malloc((size_t)n_rows * 4 + 4);
    MM_TRUE(*rs != NULL && *rp != NULL);
    for (int s = 0, r = 0; s < n_seqs; s++)
        for (int p = 0; p < lens[s]; p++, r++)
            (*rs)[r] = s, (*rp)[r] = p;
    return n_rows;
}

// seq_rows' rows in another order: runs of 1, 2, ..., 11, 1, 2, ... rows of one sequence, the
// sequences in turn (so a block of rows holds rows of several). order[i] (n_rows of them, the
// sum of lens) is the original row of row i.
static inline void interleave_rows(const int *lens, int n_seqs, int n_rows, int32_t *order) {
    int32_t *next = calloc((size_t)n_seqs, 4), *start = malloc((size_t)n_seqs * 4);
    MM_TRUE(next && start);
    for (int s = 0, r = 0; s < n_seqs; s++)
        start[s] = r, r += lens[s];
    for (int i = 0, s = 0, run = 1; i < n_rows;) {
        for (int j = 0; j < run && next[s] < lens[s] && i < n_rows; j++)
            order[i++] = start[s] + next[s]++;
        s = (s + 1) % n_seqs, run = run % 11 + 1;
    }
    free(next), free(start);
}

// Device memory of n_bytes (at least 4) holding h's bytes (h NULL: left as it is); dev_free.
static inline void *dev_copy(const void *h, size_t n_bytes) {
    void *d = NULL;
    MM_PASS(gpu->ops->buffer_alloc(gpu->ctx, n_bytes ? n_bytes : 4, &d));
    if (n_bytes && h != NULL)
        MM_PASS(gpu->ops->set(gpu->ctx, d, h, n_bytes));
    return d;
}

// Host copy of n_bytes of device memory d (owned: free).
static inline void *dev_get(const void *d, size_t n_bytes) {
    void *h = malloc(n_bytes + 1);
    MM_TRUE(h != NULL);
    MM_PASS(gpu->ops->get(gpu->ctx, h, d, n_bytes));
    return h;
}

static inline void dev_free(void *d) { gpu->ops->buffer_free(gpu->ctx, d); }

// Row maps of a test's grouped product of n sorted rows: row p reads source row (5p + 3) % n_src
// and writes output row (7p + 1) % *yfull, where *yfull is n + 3 raised until 7 does not divide
// it (7 and *yfull coprime: the n output rows are distinct, and 3 or more are never written).
// *xi and *yi are owned (free).
static inline void plan_rows(int n, int n_src, int32_t **xi, int32_t **yi, int64_t *yfull) {
    int64_t yf = (int64_t)n + 3;
    while (yf % 7 == 0)
        yf++;
    int32_t *x = malloc((size_t)n * 4 + 4), *y = malloc((size_t)n * 4 + 4);
    MM_TRUE(x != NULL && y != NULL);
    for (int p = 0; p < n; p++) {
        x[p] = (int32_t)(((int64_t)p * 5 + 3) % n_src);
        y[p] = (int32_t)(((int64_t)p * 7 + 1) % yf);
    }
    *xi = x, *yi = y, *yfull = yf;
}

// How many of the n floats differ from b's in their bits.
static inline int64_t n_diff(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++)
        d += memcmp(a + i, b + i, 4) != 0;
    return d;
}

#endif
