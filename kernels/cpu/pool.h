// SPDX-License-Identifier: MIT
// A fixed pool of worker threads for the CPU backend: created once at open, woken per op.
// mm__pool_run splits [0, n) into contiguous chunks (a few per thread) that the caller and the
// workers claim as they come free, and returns when every chunk is done. Which thread runs a
// chunk never changes what it computes: the kernels keep each reduction inside one element's
// own loop.
// Not thread-safe: one caller at a time (the backend's issuing thread).
#ifndef MM_CPU_POOL_H
#define MM_CPU_POOL_H

#include <stdint.h>

#include "mm/err.h"

typedef struct mm__pool mm__pool;
typedef void (*mm__pool_fn)(void *arg, int64_t begin, int64_t end);

mm_err mm__pool_new(mm__pool **out, int n_threads);
void mm__pool_free(mm__pool *p); // accepts NULL; joins the workers
int mm__pool_threads(const mm__pool *p);
// mm__pool_run runs fn over [0, n) split in chunks of at least min_chunk items. Blocks.
void mm__pool_run(mm__pool *p, int64_t n, int64_t min_chunk, mm__pool_fn fn, void *arg);

#endif
