// SPDX-License-Identifier: MIT
// CPU dot-product kernels shared by the CPU backend's ops (internal to kernels/cpu).
#ifndef MM_CPU_DOT_H
#define MM_CPU_DOT_H

#include <stdint.h>

#include "mm/dtype.h"

// out[r] = dot(x[r][0..K), w[0..K)) for r < nr; w is one weight row of dtype dt (may be
// unaligned). The bits of out[r] depend only on x[r], w and K.
typedef void (*mm__dot_fn)(enum mm_dtype dt, const float *const *x, int nr, const void *w,
                           int64_t K, float *out);

// mm__dot_select picks the best variant this CPU supports (once, at backend open).
mm__dot_fn mm__dot_select(const char **name);
// mm__wget reads element k of a weight row as f32.
float mm__wget(enum mm_dtype dt, const void *w, int64_t k);

#endif
