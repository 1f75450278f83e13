// SPDX-License-Identifier: MIT
// Dot products of f32 activation rows with weight rows (bf16, f16, f32): the inner loop of
// every matmul on the CPU backend.
//
// Design notes: the arithmetic of one dot product is fixed per process: AVX2+FMA variants are
// chosen once at start with __builtin_cpu_supports (never -march=native: the binary must run
// on any x86-64), otherwise portable C. The 4-row variants load a weight chunk once and apply
// it to four activation rows, but perform for each row exactly the operations of the 1-row
// variant, so a row's result is the same bits whether it is computed alone or in a batch.
// Per row: two 8-lane accumulators over 16-element steps, one more 8-element step, a fixed
// horizontal sum, then a scalar tail added last.
#include <string.h>

#include "dot.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

// ---- portable -------------------------------------------------------------------------------
static inline float wval(enum mm_dtype dt, const void *w, int64_t k) {
    switch (dt) {
    case MM_DTYPE_BF16: {
        uint16_t h;
        memcpy(&h, (const char *)w + 2 * k, 2);
        return mm_bf16_to_f32(h);
    }
    case MM_DTYPE_F16: {
        uint16_t h;
        memcpy(&h, (const char *)w + 2 * k, 2);
        return mm_f16_to_f32(h);
    }
    default: {
        float f;
        memcpy(&f, (const char *)w + 4 * k, 4);
        return f;
    }
    }
}

float mm__wget(enum mm_dtype dt, const void *w, int64_t k) { return wval(dt, w, k); }

static void dot_ref(enum mm_dtype dt, const float *const *x, int nr, const void *w, int64_t K,
                    float *out) {
    for (int r = 0; r < nr; r++) {
        float lane[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; l++)
                lane[l] += x[r][k + l] * wval(dt, w, k + l);
        float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                  ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        float t = 0.0f;
        for (; k < K; k++)
            t += x[r][k] * wval(dt, w, k);
        out[r] = s + t;
    }
}

#if HAVE_X86
// ---- AVX2 + FMA -----------------------------------------------------------------------------
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline __m256 load8(enum mm_dtype dt, const void *w, int64_t k) {
    if (dt == MM_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == MM_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    return _mm256_loadu_ps((const float *)w + k);
}

AVX2 static inline float hsum8(__m256 v) {
    // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the same order as dot_ref
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); // l0+l4 ..
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));        // (a0+a2), (a1+a3)
    __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 0x55)); // b0 + b1
    return _mm_cvtss_f32(c);
}

#define DEF_DOT_AVX2(NR)                                                                       \
    AVX2 static void dot_avx2_##NR(enum mm_dtype dt, const float *const *x, const void *w,     \
                                   int64_t K, float *out) {                                    \
        __m256 a0[NR], a1[NR];                                                                 \
        for (int r = 0; r < NR; r++)                                                           \
            a0[r] = a1[r] = _mm256_setzero_ps();                                               \
        int64_t k = 0;                                                                         \
        for (; k + 16 <= K; k += 16) {                                                         \
            __m256 w0 = load8(dt, w, k), w1 = load8(dt, w, k + 8);                             \
            for (int r = 0; r < NR; r++) {                                                     \
                a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k), w0, a0[r]);                 \
                a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k + 8), w1, a1[r]);             \
            }                                                                                  \
        }                                                                                      \
        if (k + 8 <= K) {                                                                      \
            __m256 w0 = load8(dt, w, k);                                                       \
            for (int r = 0; r < NR; r++)                                                       \
                a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k), w0, a0[r]);                 \
            k += 8;                                                                            \
        }                                                                                      \
        for (int r = 0; r < NR; r++) {                                                         \
            float s = hsum8(_mm256_add_ps(a0[r], a1[r]));                                      \
            float t = 0.0f;                                                                    \
            for (int64_t kk = k; kk < K; kk++)                                                 \
                t += x[r][kk] * wval(dt, w, kk);                                               \
            out[r] = s + t;                                                                    \
        }                                                                                      \
    }
DEF_DOT_AVX2(1)
DEF_DOT_AVX2(4)

// One activation row against four weight rows: the per-pair operations are exactly those of
// dot_avx2_1 (same accumulators, steps, horizontal sum and tail); only the interleaving across
// the four independent pairs differs, which hides FMA latency when a decode step has one row.
AVX2 static void dot_avx2_1x4(enum mm_dtype dt, const float *x, const void *const *w, int64_t K,
                              float *out) {
    __m256 a0[4], a1[4];
    for (int c = 0; c < 4; c++)
        a0[c] = a1[c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int c = 0; c < 4; c++) {
            a0[c] = _mm256_fmadd_ps(x0, load8(dt, w[c], k), a0[c]);
            a1[c] = _mm256_fmadd_ps(x1, load8(dt, w[c], k + 8), a1[c]);
        }
    }
    if (k + 8 <= K) {
        __m256 x0 = _mm256_loadu_ps(x + k);
        for (int c = 0; c < 4; c++)
            a0[c] = _mm256_fmadd_ps(x0, load8(dt, w[c], k), a0[c]);
        k += 8;
    }
    for (int c = 0; c < 4; c++) {
        float s = hsum8(_mm256_add_ps(a0[c], a1[c]));
        float t = 0.0f;
        for (int64_t kk = k; kk < K; kk++)
            t += x[kk] * wval(dt, w[c], kk);
        out[c] = s + t;
    }
}

static void dot4w_avx2(enum mm_dtype dt, const float *x, const void *const *w, int64_t K,
                       float *out) {
    dot_avx2_1x4(dt, x, w, K, out);
}

static void dot_avx2(enum mm_dtype dt, const float *const *x, int nr, const void *w, int64_t K,
                     float *out) {
    int r = 0;
    for (; r + 4 <= nr; r += 4)
        dot_avx2_4(dt, x + r, w, K, out + r);
    for (; r < nr; r++)
        dot_avx2_1(dt, x + r, w, K, out + r);
}
#endif

static void dot4w_ref(enum mm_dtype dt, const float *x, const void *const *w, int64_t K,
                      float *out) {
    for (int c = 0; c < 4; c++)
        dot_ref(dt, &x, 1, w[c], K, out + c);
}

mm__dot4w_fn mm__dot4w_select(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return dot4w_avx2;
#endif
    return dot4w_ref;
}

mm__dot_fn mm__dot_select(const char **name) {
#if HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        if (name)
            *name = "avx2+fma";
        return dot_avx2;
    }
#endif
    if (name)
        *name = "portable";
    return dot_ref;
}
