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
// One function per weight dtype and shape, written out so that the accumulators live in
// registers (a loop over an accumulator array, or a dtype switch inside the k loop, made GCC
// keep them on the stack and ran at a third of the memory bandwidth). Decode streams one
// weight row at a time: interleaving four rows (four streams) measured 16-18 GB/s per core
// against 23-26 GB/s for one.
#define AVX2 __attribute__((target("avx2,fma,f16c")))

#define LD_BF16(w, k)                                                                          \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                                     \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(w) + (k)))), \
        16))
#define LD_F16(w, k) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(w) + (k))))
#define LD_F32(w, k) _mm256_loadu_ps((const float *)(w) + (k))

AVX2 static inline float hsum8(__m256 v) {
    // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the same order as dot_ref
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); // l0+l4 ..
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));        // (a0+a2), (a1+a3)
    __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 0x55)); // b0 + b1
    return _mm_cvtss_f32(c);
}

// Finish one (x row, w row) pair: the same for every variant below.
#define FINISH(a0, a1, x, w, k, K, dt, out)                                                    \
    do {                                                                                       \
        float s_ = hsum8(_mm256_add_ps(a0, a1)), t_ = 0.0f;                                    \
        for (int64_t kk_ = (k); kk_ < (K); kk_++)                                              \
            t_ += (x)[kk_] * wval(dt, w, kk_);                                                 \
        (out) = s_ + t_;                                                                       \
    } while (0)

#define DEF_KERNELS(SUF, DT, LD)                                                               \
    /* one x row, one w row */                                                                 \
    AVX2 static void dot1_##SUF(const float *x, const void *w, int64_t K, float *out) {        \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                              \
        int64_t k = 0;                                                                         \
        for (; k + 16 <= K; k += 16) {                                                         \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), LD(w, k), a0);                        \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), LD(w, k + 8), a1);                \
        }                                                                                      \
        if (k + 8 <= K) {                                                                      \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), LD(w, k), a0);                        \
            k += 8;                                                                            \
        }                                                                                      \
        FINISH(a0, a1, x, w, k, K, DT, *out);                                                  \
    }                                                                                          \
    /* four x rows, one w row */                                                               \
    AVX2 static void dot4x_##SUF(const float *const *x, const void *w, int64_t K, float *out) { \
        const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];                            \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,          \
               a21 = a00, a30 = a00, a31 = a00;                                                \
        int64_t k = 0;                                                                         \
        for (; k + 16 <= K; k += 16) {                                                         \
            __m256 w0 = LD(w, k), w1 = LD(w, k + 8);                                           \
            a00 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), w0, a00);                           \
            a01 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), w1, a01);                       \
            a10 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), w0, a10);                           \
            a11 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), w1, a11);                       \
            a20 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k), w0, a20);                           \
            a21 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k + 8), w1, a21);                       \
            a30 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k), w0, a30);                           \
            a31 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k + 8), w1, a31);                       \
        }                                                                                      \
        if (k + 8 <= K) {                                                                      \
            __m256 w0 = LD(w, k);                                                              \
            a00 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), w0, a00);                           \
            a10 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), w0, a10);                           \
            a20 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k), w0, a20);                           \
            a30 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k), w0, a30);                           \
            k += 8;                                                                            \
        }                                                                                      \
        FINISH(a00, a01, x0, w, k, K, DT, out[0]);                                             \
        FINISH(a10, a11, x1, w, k, K, DT, out[1]);                                             \
        FINISH(a20, a21, x2, w, k, K, DT, out[2]);                                             \
        FINISH(a30, a31, x3, w, k, K, DT, out[3]);                                             \
    }

DEF_KERNELS(bf16, MM_DTYPE_BF16, LD_BF16)
DEF_KERNELS(f16, MM_DTYPE_F16, LD_F16)
DEF_KERNELS(f32, MM_DTYPE_F32, LD_F32)

static void dot_avx2(enum mm_dtype dt, const float *const *x, int nr, const void *w, int64_t K,
                     float *out) {
    int r = 0;
    switch (dt) {
    case MM_DTYPE_BF16:
        for (; r + 4 <= nr; r += 4)
            dot4x_bf16(x + r, w, K, out + r);
        for (; r < nr; r++)
            dot1_bf16(x[r], w, K, out + r);
        break;
    case MM_DTYPE_F16:
        for (; r + 4 <= nr; r += 4)
            dot4x_f16(x + r, w, K, out + r);
        for (; r < nr; r++)
            dot1_f16(x[r], w, K, out + r);
        break;
    default:
        for (; r + 4 <= nr; r += 4)
            dot4x_f32(x + r, w, K, out + r);
        for (; r < nr; r++)
            dot1_f32(x[r], w, K, out + r);
        break;
    }
}

#endif

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
