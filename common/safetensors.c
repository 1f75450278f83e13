// SPDX-License-Identifier: MIT
// safetensors reader: mmap + header validation + name lookup; see mm/safetensors.h.
// Format: u64 little-endian header length N, N bytes of JSON
// {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data region that offsets are relative to.
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mm/json.h"
#include "mm/safetensors.h"

#define MAX_HEADER_BYTES (256u << 20)

struct st_file {
    char *path;
    void *map;
    size_t map_bytes;
};

struct mm_safetensors {
    char *path;
    struct st_file *files;
    int n_files;
    mm_st_tensor *tensors;
    size_t n_tensors, cap_tensors;
    uint32_t *slots; // open-addressing hash: tensor index + 1, 0 = empty
    size_t n_slots;
};

static const char *dtype_names[MM_DTYPE_COUNT] = {
    [MM_DTYPE_F32] = "F32", [MM_DTYPE_F16] = "F16", [MM_DTYPE_BF16] = "BF16",
    [MM_DTYPE_F8_E4M3] = "F8_E4M3", [MM_DTYPE_F8_E5M2] = "F8_E5M2", [MM_DTYPE_F64] = "F64",
    [MM_DTYPE_I64] = "I64", [MM_DTYPE_I32] = "I32", [MM_DTYPE_I16] = "I16", [MM_DTYPE_I8] = "I8",
    [MM_DTYPE_U8] = "U8", [MM_DTYPE_BOOL] = "BOOL",
};
static const size_t dtype_sizes[MM_DTYPE_COUNT] = {
    [MM_DTYPE_F32] = 4, [MM_DTYPE_F16] = 2, [MM_DTYPE_BF16] = 2, [MM_DTYPE_F8_E4M3] = 1,
    [MM_DTYPE_F8_E5M2] = 1, [MM_DTYPE_F64] = 8, [MM_DTYPE_I64] = 8, [MM_DTYPE_I32] = 4,
    [MM_DTYPE_I16] = 2, [MM_DTYPE_I8] = 1, [MM_DTYPE_U8] = 1, [MM_DTYPE_BOOL] = 1,
};

size_t mm_dtype_size(enum mm_dtype t) {
    return (unsigned)t < MM_DTYPE_COUNT ? dtype_sizes[t] : 0;
}

const char *mm_dtype_name(enum mm_dtype t) {
    return (unsigned)t < MM_DTYPE_COUNT ? dtype_names[t] : "?";
}

int mm_dtype_parse(const char *s, enum mm_dtype *out) {
    for (int i = 0; i < MM_DTYPE_COUNT; i++) {
        if (strcmp(s, dtype_names[i]) == 0) {
            *out = (enum mm_dtype)i;
            return 0;
        }
    }
    return -1;
}

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; // FNV-1a
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static mm_err add_tensor(mm_safetensors *st, mm_st_tensor *t) {
    if (st->n_tensors == st->cap_tensors) {
        size_t cap = st->cap_tensors ? st->cap_tensors * 2 : 256;
        mm_st_tensor *nt = realloc(st->tensors, cap * sizeof(*nt));
        if (!nt)
            return MM_ENOMEM;
        st->tensors = nt;
        st->cap_tensors = cap;
    }
    st->tensors[st->n_tensors++] = *t;
    return MM_OK;
}

static mm_err build_index(mm_safetensors *st, char *err) {
    size_t n = 16;
    while (n < st->n_tensors * 2)
        n *= 2;
    st->slots = calloc(n, sizeof(uint32_t));
    if (!st->slots)
        return MM_ENOMEM;
    st->n_slots = n;
    for (size_t i = 0; i < st->n_tensors; i++) {
        size_t h = hash_str(st->tensors[i].name) & (n - 1);
        while (st->slots[h]) {
            const mm_st_tensor *o = &st->tensors[st->slots[h] - 1];
            if (strcmp(o->name, st->tensors[i].name) == 0)
                return mm_errf(err, MM_EFORMAT, "%s: tensor %s appears twice (also in %s)",
                               st->files[st->tensors[i].file].path, o->name,
                               st->files[o->file].path);
            h = (h + 1) & (n - 1);
        }
        st->slots[h] = (uint32_t)(i + 1);
    }
    return MM_OK;
}

const mm_st_tensor *mm_safetensors_find(const mm_safetensors *st, const char *name) {
    if (!st || !st->slots)
        return NULL;
    size_t h = hash_str(name) & (st->n_slots - 1);
    while (st->slots[h]) {
        const mm_st_tensor *t = &st->tensors[st->slots[h] - 1];
        if (strcmp(t->name, name) == 0)
            return t;
        h = (h + 1) & (st->n_slots - 1);
    }
    return NULL;
}

static void shape_str(char *buf, size_t n, int n_dims, const int64_t *shape) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int i = 0; i < n_dims && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (o < n)
        snprintf(buf + o, n - o, "]");
}

mm_err mm_safetensors_get(const mm_safetensors *st, const char *name, int n_dims,
                          const int64_t *shape, const mm_st_tensor **out, char err[MM_ERRLEN]) {
    const mm_st_tensor *t = mm_safetensors_find(st, name);
    if (!t)
        return mm_errf(err, MM_ENOENT, "missing tensor %s (in %s)", name, st->path);
    bool ok = t->n_dims == n_dims;
    for (int i = 0; ok && i < n_dims; i++)
        ok = shape[i] < 0 || shape[i] == t->shape[i];
    if (!ok) {
        char a[96], b[96];
        shape_str(a, sizeof a, t->n_dims, t->shape);
        shape_str(b, sizeof b, n_dims, shape);
        return mm_errf(err, MM_EFORMAT, "%s: tensor %s has shape %s, expected %s",
                       st->files[t->file].path, name, a, b);
    }
    *out = t;
    return MM_OK;
}

const char *mm_safetensors_file_name(const mm_safetensors *st, int i) {
    return (i >= 0 && i < st->n_files) ? st->files[i].path : "?";
}
size_t mm_safetensors_count(const mm_safetensors *st) { return st->n_tensors; }
const mm_st_tensor *mm_safetensors_at(const mm_safetensors *st, size_t i) {
    return i < st->n_tensors ? &st->tensors[i] : NULL;
}
const char *mm_safetensors_path(const mm_safetensors *st) { return st->path; }

// parse_header validates one file's header and appends its tensors.
static mm_err parse_file(mm_safetensors *st, int fi, char *err) {
    struct st_file *f = &st->files[fi];
    const unsigned char *base = f->map;
    if (f->map_bytes < 8)
        return mm_errf(err, MM_EFORMAT, "%s: truncated file (%zu bytes, no header length)",
                       f->path, f->map_bytes);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | base[i];
    if (hlen > MAX_HEADER_BYTES || hlen > f->map_bytes - 8)
        return mm_errf(err, MM_EFORMAT,
                       "%s: header length %llu exceeds the file (%zu bytes): truncated or not "
                       "a safetensors file",
                       f->path, (unsigned long long)hlen, f->map_bytes);
    const unsigned char *data = base + 8 + hlen;
    size_t data_bytes = f->map_bytes - 8 - (size_t)hlen;
    json_error_t je;
    json_t *root = json_loadb((const char *)base + 8, (size_t)hlen, 0, &je);
    if (!root)
        return mm_errf(err, MM_EFORMAT, "%s: malformed header JSON: %s (column %d)", f->path,
                       je.text, je.column);
    mm_err rv = MM_OK;
    if (!json_is_object(root)) {
        rv = mm_errf(err, MM_EFORMAT, "%s: header is not a JSON object", f->path);
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0)
            continue;
        json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
               *jo = json_object_get(v, "data_offsets");
        if (!json_is_object(v) || !json_is_string(jd) || !json_is_array(js) ||
            !json_is_array(jo) || json_array_size(jo) != 2) {
            rv = mm_errf(err, MM_EFORMAT,
                         "%s: tensor %s: header entry needs dtype, shape and data_offsets[2]",
                         f->path, key);
            goto out;
        }
        mm_st_tensor t = {.file = fi};
        if (mm_dtype_parse(json_string_value(jd), &t.dtype) != 0) {
            rv = mm_errf(err, MM_EFORMAT, "%s: tensor %s: unknown dtype '%s'", f->path, key,
                         json_string_value(jd));
            goto out;
        }
        if (json_array_size(js) > MM_ST_MAX_DIMS) {
            rv = mm_errf(err, MM_EFORMAT, "%s: tensor %s: %zu dimensions (max %d)", f->path, key,
                         json_array_size(js), MM_ST_MAX_DIMS);
            goto out;
        }
        t.n_dims = (int)json_array_size(js);
        t.n_elems = 1;
        for (int d = 0; d < t.n_dims; d++) {
            json_t *e = json_array_get(js, (size_t)d);
            if (!json_is_integer(e) || json_integer_value(e) < 0 ||
                json_integer_value(e) > ((int64_t)1 << 40)) {
                rv = mm_errf(err, MM_EFORMAT, "%s: tensor %s: bad shape entry %d", f->path, key,
                             d);
                goto out;
            }
            t.shape[d] = json_integer_value(e);
            if (t.shape[d] && t.n_elems > ((int64_t)1 << 50) / t.shape[d]) {
                rv = mm_errf(err, MM_EFORMAT, "%s: tensor %s: shape too large", f->path, key);
                goto out;
            }
            t.n_elems *= t.shape[d];
        }
        json_t *jb = json_array_get(jo, 0), *je2 = json_array_get(jo, 1);
        if (!json_is_integer(jb) || !json_is_integer(je2) || json_integer_value(jb) < 0 ||
            json_integer_value(je2) < json_integer_value(jb)) {
            rv = mm_errf(err, MM_EFORMAT, "%s: tensor %s: bad data_offsets", f->path, key);
            goto out;
        }
        uint64_t b = (uint64_t)json_integer_value(jb), e = (uint64_t)json_integer_value(je2);
        t.n_bytes = (size_t)(e - b);
        if (t.n_bytes != (uint64_t)t.n_elems * mm_dtype_size(t.dtype)) {
            rv = mm_errf(err, MM_EFORMAT,
                         "%s: tensor %s: data_offsets span %zu bytes but shape and dtype %s "
                         "need %llu",
                         f->path, key, t.n_bytes, mm_dtype_name(t.dtype),
                         (unsigned long long)t.n_elems * mm_dtype_size(t.dtype));
            goto out;
        }
        if (e > data_bytes) {
            rv = mm_errf(err, MM_EFORMAT,
                         "%s: tensor %s: data ends at byte %llu but the file holds only %zu "
                         "data bytes (truncated file)",
                         f->path, key, (unsigned long long)e, data_bytes);
            goto out;
        }
        t.data = data + b;
        t.name = strdup(key);
        if (!t.name) {
            rv = MM_ENOMEM;
            goto out;
        }
        if ((rv = add_tensor(st, &t)) != MM_OK) {
            free((char *)t.name);
            goto out;
        }
    }
out:
    json_decref(root);
    return rv;
}

static mm_err map_file(struct st_file *f, char *err) {
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return mm_errf(err, errno == ENOENT ? MM_ENOENT : MM_ESYS, "%s: %s", f->path,
                       strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return mm_errf(err, MM_ESYS, "%s: fstat: %s", f->path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return mm_errf(err, MM_EFORMAT, "%s: not a regular file", f->path);
    }
    f->map_bytes = (size_t)sb.st_size;
    if (f->map_bytes == 0) {
        close(fd);
        return mm_errf(err, MM_EFORMAT, "%s: truncated file (empty)", f->path);
    }
    f->map = mmap(NULL, f->map_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        return mm_errf(err, MM_ESYS, "%s: mmap: %s", f->path, strerror(e));
    }
    return MM_OK;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int add_file(mm_safetensors *st, char *path) { // takes ownership of path
    for (int i = 0; i < st->n_files; i++) {
        if (strcmp(st->files[i].path, path) == 0) {
            free(path);
            return i;
        }
    }
    struct st_file *nf = realloc(st->files, (size_t)(st->n_files + 1) * sizeof(*nf));
    if (!nf) {
        free(path);
        return -1;
    }
    st->files = nf;
    st->files[st->n_files] = (struct st_file){.path = path};
    return st->n_files++;
}

static mm_err open_index(mm_safetensors *st, const char *dir, const char *index_path, char *err) {
    json_t *root = NULL;
    MM_TRY(mm_json_load_file(index_path, &root, err));
    mm_err rv = MM_OK;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        rv = mm_errf(err, MM_EFORMAT, "%s: missing object 'weight_map'", index_path);
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(wm, key, v) {
        if (!json_is_string(v) || strchr(json_string_value(v), '/')) {
            rv = mm_errf(err, MM_EFORMAT, "%s: weight_map entry %s must be a file name",
                         index_path, key);
            goto out;
        }
        char *p = path_join(dir, json_string_value(v));
        if (!p || add_file(st, p) < 0) {
            rv = MM_ENOMEM;
            goto out;
        }
    }
    for (int i = 0; i < st->n_files; i++) {
        MM_TRY_GOTO(rv, map_file(&st->files[i], err), out);
        MM_TRY_GOTO(rv, parse_file(st, i, err), out);
    }
    MM_TRY_GOTO(rv, build_index(st, err), out);
    json_object_foreach(wm, key, v) {
        const mm_st_tensor *t = mm_safetensors_find(st, key);
        if (!t) {
            rv = mm_errf(err, MM_ENOENT, "%s/%s: missing tensor %s named by %s", dir,
                         json_string_value(v), key, index_path);
            goto out;
        }
    }
out:
    json_decref(root);
    return rv;
}

mm_err mm_safetensors_open(mm_safetensors **out, const char *path, char err[MM_ERRLEN]) {
    *out = NULL;
    mm_safetensors *st = calloc(1, sizeof(*st));
    if (!st)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    st->path = strdup(path);
    if (!st->path) {
        rv = MM_ENOMEM;
        goto fail;
    }
    struct stat sb;
    if (stat(path, &sb) != 0) {
        rv = mm_errf(err, MM_ENOENT, "%s: %s", path, strerror(errno));
        goto fail;
    }
    if (S_ISDIR(sb.st_mode)) {
        char *idx = path_join(path, "model.safetensors.index.json");
        if (!idx) {
            rv = MM_ENOMEM;
            goto fail;
        }
        if (access(idx, F_OK) == 0) {
            rv = open_index(st, path, idx, err);
            free(idx);
            if (rv != MM_OK)
                goto fail;
            *out = st;
            return MM_OK;
        }
        free(idx);
        char *single = path_join(path, "model.safetensors");
        if (!single) {
            rv = MM_ENOMEM;
            goto fail;
        }
        if (access(single, F_OK) != 0) {
            rv = mm_errf(err, MM_ENOENT,
                         "%s: no model.safetensors.index.json or model.safetensors", path);
            free(single);
            goto fail;
        }
        if (add_file(st, single) < 0) {
            rv = MM_ENOMEM;
            goto fail;
        }
    } else {
        char *p = strdup(path);
        if (!p || add_file(st, p) < 0) {
            rv = MM_ENOMEM;
            goto fail;
        }
    }
    MM_TRY_GOTO(rv, map_file(&st->files[0], err), fail);
    MM_TRY_GOTO(rv, parse_file(st, 0, err), fail);
    MM_TRY_GOTO(rv, build_index(st, err), fail);
    *out = st;
    return MM_OK;
fail:
    mm_safetensors_close(st);
    return rv;
}

void mm_safetensors_close(mm_safetensors *st) {
    if (!st)
        return;
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map)
            munmap(st->files[i].map, st->files[i].map_bytes);
        free(st->files[i].path);
    }
    for (size_t i = 0; i < st->n_tensors; i++)
        free((char *)st->tensors[i].name);
    free(st->files);
    free(st->tensors);
    free(st->slots);
    free(st->path);
    free(st);
}

// ---- writer ---------------------------------------------------------------------------------
mm_err mm_safetensors_write(const char *path, const mm_st_entry *e, size_t n, mm_st_fill_fn fill,
                            void *arg, char err[MM_ERRLEN]) {
    json_t *h = json_object();
    if (!h)
        return MM_ENOMEM;
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        size_t es = mm_dtype_size(e[i].dtype);
        if (!es || e[i].n_dims < 0 || e[i].n_dims > MM_ST_MAX_DIMS || (!e[i].data && !fill)) {
            json_decref(h);
            return mm_errf(err, MM_EINVAL, "%s: bad entry %s", path, e[i].name);
        }
        uint64_t bytes = es;
        json_t *shape = json_array();
        for (int d = 0; d < e[i].n_dims; d++) {
            bytes *= (uint64_t)e[i].shape[d];
            json_array_append_new(shape, json_integer(e[i].shape[d]));
        }
        json_t *t = json_pack("{s:s, s:o, s:[I,I]}", "dtype", mm_dtype_name(e[i].dtype), "shape",
                              shape, "data_offsets", (json_int_t)off, (json_int_t)(off + bytes));
        if (!t || json_object_set_new(h, e[i].name, t) != 0) {
            json_decref(h);
            return MM_ENOMEM;
        }
        off += bytes;
    }
    json_object_set_new(h, "__metadata__", json_pack("{s:s}", "format", "pt"));
    char *text = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (!text)
        return MM_ENOMEM;
    size_t tl = strlen(text), padded = (tl + 7) & ~(size_t)7;
    mm_err rv = MM_OK;
    FILE *f = fopen(path, "wb");
    unsigned char *buf = malloc(1 << 20);
    if (!f || !buf) {
        rv = f ? MM_ENOMEM : mm_errf(err, MM_ESYS, "%s: %s", path, strerror(errno));
        goto out;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    bool ok = fwrite(len8, 1, 8, f) == 8 && fwrite(text, 1, tl, f) == tl;
    for (size_t i = tl; ok && i < padded; i++)
        ok = fputc(' ', f) != EOF;
    for (size_t i = 0; ok && i < n; i++) {
        size_t bytes = mm_dtype_size(e[i].dtype);
        for (int d = 0; d < e[i].n_dims; d++)
            bytes *= (size_t)e[i].shape[d];
        if (e[i].data) {
            ok = fwrite(e[i].data, 1, bytes, f) == bytes;
            continue;
        }
        for (size_t o = 0; ok && o < bytes; o += 1 << 20) {
            size_t c = bytes - o < (1u << 20) ? bytes - o : (1u << 20);
            fill(arg, i, o, buf, c);
            ok = fwrite(buf, 1, c, f) == c;
        }
    }
    if (!ok)
        rv = mm_errf(err, MM_ESYS, "%s: write failed: %s", path, strerror(errno));
out:
    if (f && fclose(f) != 0 && rv == MM_OK)
        rv = mm_errf(err, MM_ESYS, "%s: close: %s", path, strerror(errno));
    free(buf);
    free(text);
    return rv;
}
