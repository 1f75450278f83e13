// SPDX-License-Identifier: MIT
// Paged KV cache; see mm/kv_cache.h.
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "mm/kv_cache.h"

struct mm_kv_cache {
    mm_kv_params p;
    mm_backend *be;
    void *pool;             // backend memory, n_blocks blocks of p.dtype elements
    int n_blocks;
    int max_blocks;         // per sequence
    int64_t slot_floats;    // K + V of one token, in elements (f32 or bf16)
    size_t elem_bytes;      // 4 (f32) or 2 (bf16)
    int32_t *free_ids;      // stack of free block ids
    int n_free;
    int32_t *tables;        // (max_seqs, max_blocks) host; -1 = none
    int32_t *d_tables;      // backend mirror (== tables on host-memory backends)
    int32_t *seq_blocks;    // (max_seqs) blocks held
    int32_t *seq_len;       // (max_seqs) reserved positions
    bool *seq_used;
};

size_t mm_kv_token_bytes(const mm_kv_params *p) {
    const size_t eb = p->dtype == MM_DTYPE_F32 ? 4 : p->dtype == MM_DTYPE_BF16 ? 2 : 0;
    return (size_t)p->n_layers * (size_t)p->n_kv_heads * (size_t)(p->head_dim_k + p->head_dim_v) *
           eb;
}

mm_err mm_kv_cache_new(mm_kv_cache **out, const mm_kv_params *p, mm_backend *be,
                       char err[MM_ERRLEN]) {
    *out = NULL;
    if (!p || !be || p->n_layers <= 0 || p->n_kv_heads <= 0 || p->head_dim_k <= 0 ||
        p->head_dim_v <= 0 || p->block_size <= 0 || p->max_seqs <= 0 || p->max_ctx <= 0)
        return mm_errf(err, MM_EINVAL, "kv cache: bad parameters");
    if (p->dtype != MM_DTYPE_F32 && p->dtype != MM_DTYPE_BF16)
        return mm_errf(err, MM_EINVAL, "kv cache: dtype %s (f32 or bf16 only)",
                       mm_dtype_name(p->dtype));
    if (p->dtype == MM_DTYPE_BF16 &&
        (!be->ops->kv_dtype || be->ops->kv_dtype(be->ctx, p->n_kv_heads, p->head_dim_k,
                                                 p->head_dim_v) != MM_DTYPE_BF16))
        return mm_errf(err, MM_EINVAL, "kv cache: backend %s does not read a bf16 cache of %d "
                       "kv heads, head dims %d/%d", be->ops->name, p->n_kv_heads, p->head_dim_k,
                       p->head_dim_v);
    mm_kv_cache *kv = calloc(1, sizeof(*kv));
    if (!kv)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    kv->p = *p;
    kv->be = be;
    kv->slot_floats = (int64_t)p->n_kv_heads * (p->head_dim_k + p->head_dim_v);
    kv->elem_bytes = p->dtype == MM_DTYPE_BF16 ? 2 : 4;
    size_t block_bytes = mm_kv_token_bytes(p) * (size_t)p->block_size;
    size_t nb = p->budget_bytes / block_bytes;
    if (nb < 1) {
        rv = mm_errf(err, MM_EINVAL, "kv cache: budget %zu bytes is less than one block (%zu)",
                     p->budget_bytes, block_bytes);
        goto fail;
    }
    if (nb > INT32_MAX / 2)
        nb = INT32_MAX / 2;
    kv->n_blocks = (int)nb;
    kv->max_blocks = (p->max_ctx + p->block_size - 1) / p->block_size;
    MM_TRY_GOTO(rv, be->ops->buffer_alloc(be->ctx, nb * block_bytes, &kv->pool), fail);
    size_t n_tab = (size_t)p->max_seqs * (size_t)kv->max_blocks;
    kv->free_ids = malloc(nb * sizeof(int32_t));
    kv->tables = malloc(n_tab * sizeof(int32_t));
    kv->seq_blocks = calloc((size_t)p->max_seqs, sizeof(int32_t));
    kv->seq_len = calloc((size_t)p->max_seqs, sizeof(int32_t));
    kv->seq_used = calloc((size_t)p->max_seqs, sizeof(bool));
    if (!kv->free_ids || !kv->tables || !kv->seq_blocks || !kv->seq_len || !kv->seq_used) {
        rv = MM_ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < n_tab; i++)
        kv->tables[i] = -1;
    for (int i = 0; i < kv->n_blocks; i++) // pop order: block 0 first
        kv->free_ids[i] = kv->n_blocks - 1 - i;
    kv->n_free = kv->n_blocks;
    if (be->ops->host_memory) {
        kv->d_tables = kv->tables;
    } else {
        MM_TRY_GOTO(rv, be->ops->buffer_alloc(be->ctx, n_tab * 4, (void **)&kv->d_tables), fail);
        MM_TRY_GOTO(rv, be->ops->set(be->ctx, kv->d_tables, kv->tables, n_tab * 4), fail);
    }
    *out = kv;
    return MM_OK;
fail:
    mm_kv_cache_free(kv);
    return rv;
}

void mm_kv_cache_free(mm_kv_cache *kv) {
    if (!kv)
        return;
    if (kv->pool)
        kv->be->ops->buffer_free(kv->be->ctx, kv->pool);
    if (kv->d_tables && kv->d_tables != kv->tables)
        kv->be->ops->buffer_free(kv->be->ctx, kv->d_tables);
    free(kv->free_ids);
    free(kv->tables);
    free(kv->seq_blocks);
    free(kv->seq_len);
    free(kv->seq_used);
    free(kv);
}

static void sync_row(mm_kv_cache *kv, int32_t seq) {
    if (kv->d_tables == kv->tables)
        return;
    size_t off = (size_t)seq * (size_t)kv->max_blocks;
    (void)kv->be->ops->set(kv->be->ctx, kv->d_tables + off, kv->tables + off,
                           (size_t)kv->max_blocks * 4);
}

mm_err mm_kv_cache_seq_new(mm_kv_cache *kv, int32_t *seq) {
    for (int i = 0; i < kv->p.max_seqs; i++) {
        if (!kv->seq_used[i]) {
            kv->seq_used[i] = true;
            kv->seq_len[i] = 0;
            kv->seq_blocks[i] = 0;
            *seq = i;
            return MM_OK;
        }
    }
    return MM_EFULL;
}

void mm_kv_cache_truncate(mm_kv_cache *kv, int32_t seq, int32_t n_tokens) {
    if (seq < 0 || seq >= kv->p.max_seqs || !kv->seq_used[seq] || n_tokens < 0)
        return;
    int32_t keep = (n_tokens + kv->p.block_size - 1) / kv->p.block_size;
    int32_t *row = kv->tables + (size_t)seq * (size_t)kv->max_blocks;
    while (kv->seq_blocks[seq] > keep) {
        int32_t b = --kv->seq_blocks[seq];
        kv->free_ids[kv->n_free++] = row[b];
        row[b] = -1;
    }
    if (kv->seq_len[seq] > n_tokens)
        kv->seq_len[seq] = n_tokens;
    sync_row(kv, seq);
}

void mm_kv_cache_seq_free(mm_kv_cache *kv, int32_t seq) {
    if (seq < 0 || seq >= kv->p.max_seqs || !kv->seq_used[seq])
        return;
    mm_kv_cache_truncate(kv, seq, 0);
    kv->seq_used[seq] = false;
}

mm_err mm_kv_cache_reserve(mm_kv_cache *kv, int32_t seq, int32_t n_tokens) {
    if (seq < 0 || seq >= kv->p.max_seqs || !kv->seq_used[seq] || n_tokens < 0 ||
        n_tokens > kv->p.max_ctx)
        return MM_EINVAL;
    int32_t need = (n_tokens + kv->p.block_size - 1) / kv->p.block_size;
    if (need - kv->seq_blocks[seq] > kv->n_free)
        return MM_EFULL;
    int32_t *row = kv->tables + (size_t)seq * (size_t)kv->max_blocks;
    bool changed = false;
    while (kv->seq_blocks[seq] < need) {
        row[kv->seq_blocks[seq]++] = kv->free_ids[--kv->n_free];
        changed = true;
    }
    if (n_tokens > kv->seq_len[seq])
        kv->seq_len[seq] = n_tokens;
    if (changed)
        sync_row(kv, seq);
    return MM_OK;
}

int32_t mm_kv_cache_seq_len(const mm_kv_cache *kv, int32_t seq) {
    return (seq >= 0 && seq < kv->p.max_seqs && kv->seq_used[seq]) ? kv->seq_len[seq] : 0;
}

void mm_kv_cache_view(const mm_kv_cache *kv, int layer, struct mm_kv_view *out) {
    const int64_t layer_floats = kv->slot_floats * kv->p.block_size;
    *out = (struct mm_kv_view){
        .base = (float *)((char *)kv->pool + (size_t)layer * (size_t)layer_floats * kv->elem_bytes),
        .block_size = kv->p.block_size,
        .block_stride = layer_floats * kv->p.n_layers,
        .slot_stride = kv->slot_floats,
        .n_kv_heads = kv->p.n_kv_heads,
        .head_dim_k = kv->p.head_dim_k,
        .head_dim_v = kv->p.head_dim_v,
        .block_tables = kv->d_tables,
        .max_blocks = kv->max_blocks,
        .dtype = kv->p.dtype,
    };
}

int mm_kv_cache_blocks_total(const mm_kv_cache *kv) { return kv->n_blocks; }
int mm_kv_cache_blocks_free(const mm_kv_cache *kv) { return kv->n_free; }
const mm_kv_params *mm_kv_cache_params(const mm_kv_cache *kv) { return &kv->p; }
