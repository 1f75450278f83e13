// SPDX-License-Identifier: MIT
// Bump arena; see mm/arena.h.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mm/arena.h"

mm_err mm_arena_init(mm_arena *a, size_t cap_bytes) {
    memset(a, 0, sizeof(*a));
    size_t rounded = (cap_bytes + 63) & ~(size_t)63;
    if (rounded == 0)
        rounded = 64;
    a->base = aligned_alloc(64, rounded);
    if (!a->base)
        return MM_ENOMEM;
    a->cap_bytes = cap_bytes;
    return MM_OK;
}

void mm_arena_fini(mm_arena *a) {
    if (!a)
        return;
    free(a->base);
    memset(a, 0, sizeof(*a));
}

mm_err mm_arena_alloc(mm_arena *a, size_t n_bytes, size_t align, void **out) {
    if (align == 0 || (align & (align - 1)) || align > 64)
        return MM_EINVAL;
    size_t off = (a->used_bytes + align - 1) & ~(align - 1);
    if (off > a->cap_bytes || n_bytes > a->cap_bytes - off)
        return MM_EFULL;
    *out = a->base + off;
    a->used_bytes = off + n_bytes;
    if (a->used_bytes > a->peak_bytes)
        a->peak_bytes = a->used_bytes;
    return MM_OK;
}

void mm_arena_reset(mm_arena *a) { a->used_bytes = 0; }
