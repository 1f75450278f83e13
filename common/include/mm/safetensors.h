// SPDX-License-Identifier: MIT
// Read-only, memory-mapped safetensors checkpoints: one file, or a directory with
// model.safetensors or a sharded set described by model.safetensors.index.json.
//
// Design notes: every file is mmap'd PROT_READ/MAP_PRIVATE once at open and stays mapped
// until close, so tensor data pointers are zero-copy views into the page cache: a process
// that touches only some experts pages in only those. Every header is validated at open
// (length, JSON, dtype, shape, offsets inside the file, sizes that match the shape); lookups
// after that cannot fail on the file's account. Lookup is a hash table by name. After open
// the object is immutable and safe to share between threads.
#ifndef MM_SAFETENSORS_H
#define MM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "mm/dtype.h"
#include "mm/err.h"

#define MM_ST_MAX_DIMS 8

typedef struct mm_st_tensor {
    const char *name;             // owned by the mm_safetensors
    enum mm_dtype dtype;
    int n_dims;
    int64_t shape[MM_ST_MAX_DIMS]; // row-major, shape[n_dims-1] is contiguous
    int64_t n_elems;
    const void *data;             // borrowed view into the mapping; may be unaligned
    size_t n_bytes;
    int file;                     // index into the file list (for messages)
} mm_st_tensor;

typedef struct mm_safetensors mm_safetensors;

// mm_safetensors_open maps path: a .safetensors file, or a directory holding
// model.safetensors.index.json (sharded) or model.safetensors. Returns owned *out (close it).
// Errors name the file (and tensor): MM_ENOENT (no file, or a tensor of the index missing
// from its shard), MM_EFORMAT (truncated file, malformed header, bad dtype/shape/offsets),
// MM_ESYS, MM_ENOMEM. Blocks on file I/O.
mm_err mm_safetensors_open(mm_safetensors **out, const char *path, char err[MM_ERRLEN]);
// mm_safetensors_close unmaps everything; accepts NULL.
void mm_safetensors_close(mm_safetensors *st);

// mm_safetensors_find returns the tensor called name or NULL. Thread-safe.
const mm_st_tensor *mm_safetensors_find(const mm_safetensors *st, const char *name);
// mm_safetensors_get finds name and checks its shape (n_dims entries of shape; -1 = any).
// Errors: MM_ENOENT "missing tensor NAME (in DIR)", MM_EFORMAT "FILE: tensor NAME has shape
// [..], expected [..]". Thread-safe.
mm_err mm_safetensors_get(const mm_safetensors *st, const char *name, int n_dims,
                          const int64_t *shape, const mm_st_tensor **out, char err[MM_ERRLEN]);
// mm_safetensors_file_name returns the path of file index i (for messages).
const char *mm_safetensors_file_name(const mm_safetensors *st, int i);
// mm_safetensors_count / _at iterate over every tensor (in no particular order).
size_t mm_safetensors_count(const mm_safetensors *st);
const mm_st_tensor *mm_safetensors_at(const mm_safetensors *st, size_t i);
// mm_safetensors_path returns the path given to open.
const char *mm_safetensors_path(const mm_safetensors *st);


// ---- writing (tests, `moemesh synth`) ---------------------------------------------------------
typedef struct mm_st_entry {
    const char *name;
    enum mm_dtype dtype;
    int n_dims;
    int64_t shape[MM_ST_MAX_DIMS];
    const void *data; // the bytes, or NULL to have fill produce them
} mm_st_entry;

// mm_st_fill_fn writes n_bytes of entry i's data, starting at byte offset, into buf.
typedef void (*mm_st_fill_fn)(void *arg, size_t i, size_t offset, void *buf, size_t n_bytes);

// mm_safetensors_write writes a safetensors file with the n entries in order (header padded
// to 8 bytes). Data comes from entry.data or, when NULL, from fill in chunks (so files larger
// than memory can be written). Errors: MM_ESYS (naming path), MM_EINVAL, MM_ENOMEM.
mm_err mm_safetensors_write(const char *path, const mm_st_entry *e, size_t n, mm_st_fill_fn fill,
                            void *arg, char err[MM_ERRLEN]);

#endif
