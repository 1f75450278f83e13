// SPDX-License-Identifier: MIT
// Bump arenas: sized once at start, reset as a whole (per request or per step). Not
// thread-safe; each arena has one owner.
#ifndef MM_ARENA_H
#define MM_ARENA_H

#include <stddef.h>

#include "mm/err.h"

typedef struct mm_arena {
    unsigned char *base; // owned; cap_bytes long, 64-byte aligned
    size_t cap_bytes;
    size_t used_bytes;
    size_t peak_bytes;   // high-water mark since init, for sizing reports
} mm_arena;

// mm_arena_init allocates cap_bytes. Errors: MM_ENOMEM.
mm_err mm_arena_init(mm_arena *a, size_t cap_bytes);
// mm_arena_fini frees the storage; accepts a zeroed or finished arena.
void mm_arena_fini(mm_arena *a);
// mm_arena_alloc returns n_bytes aligned to align (a power of two, <= 64) in *out, or
// MM_EFULL when the arena cannot hold them (the arena is unchanged then).
mm_err mm_arena_alloc(mm_arena *a, size_t n_bytes, size_t align, void **out);
// mm_arena_reset forgets every allocation; the memory is kept.
void mm_arena_reset(mm_arena *a);

#endif
