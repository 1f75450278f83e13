// SPDX-License-Identifier: MIT
// Paged KV cache: a pool of fixed-size blocks carved once from a byte budget, a block table
// per sequence slot, and blocks returned to the pool when a sequence ends (vLLM-style).
//
// Design notes: the pool is one backend buffer laid out [block][layer][slot][K | V] (f32, or
// bf16 where the backend asks for it: mm_kv_params.dtype; K = n_kv_heads*head_dim_k,
// V = n_kv_heads*head_dim_v elements per token), so a sequence's block ids
// are shared by all layers. Block tables are a (max_seqs, max_blocks) int32 array kept on the
// host and mirrored to backend memory when the backend is not host memory. Nothing is
// allocated after new: reserve only pops free block ids. Attention reads through the table,
// so where a block sits never changes the result. Not thread-safe: one owner (the engine or
// the attention daemon's loop).
#ifndef MM_KV_CACHE_H
#define MM_KV_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "mm/err.h"

typedef struct mm_kv_params {
    int n_layers;
    int n_kv_heads;
    int head_dim_k, head_dim_v;
    int block_size;      // tokens per block (e.g. 16)
    size_t budget_bytes; // pool size; n_blocks = budget / block bytes
    int max_seqs;        // sequence slots
    int max_ctx;         // longest sequence in tokens (sets the table width)
    enum mm_dtype dtype; // MM_DTYPE_F32 (0) or MM_DTYPE_BF16 (mm_model_kv_params asks the
                         // backend's kv_dtype); the pool's element type
} mm_kv_params;

// mm_kv_token_bytes: bytes one token takes in a pool of p's shape and dtype (all layers, K
// and V): what budget_bytes is divided by (times block_size). 0 for a dtype the cache does not
// take.
size_t mm_kv_token_bytes(const mm_kv_params *p);

typedef struct mm_kv_cache mm_kv_cache;

// mm_kv_cache_new sizes the pool from p->budget_bytes in backend memory of be (borrowed; must
// outlive the cache). Returns owned *out. Errors: MM_EINVAL (bad params, a dtype other than
// f32/bf16, a bf16 cache on a backend whose kv_dtype does not ask for it for this shape, or a
// budget smaller than one block, named in err), MM_ENOMEM, MM_EDEVICE.
mm_err mm_kv_cache_new(mm_kv_cache **out, const mm_kv_params *p, mm_backend *be,
                       char err[MM_ERRLEN]);
// mm_kv_cache_free releases everything; accepts NULL.
void mm_kv_cache_free(mm_kv_cache *kv);

// mm_kv_cache_seq_new takes a free sequence slot (length 0). Errors: MM_EFULL.
mm_err mm_kv_cache_seq_new(mm_kv_cache *kv, int32_t *seq);
// mm_kv_cache_seq_free returns the slot and all its blocks to the pool; ignores a free slot.
void mm_kv_cache_seq_free(mm_kv_cache *kv, int32_t seq);
// mm_kv_cache_reserve makes positions [0, n_tokens) of seq addressable, taking blocks from
// the pool as needed. Errors: MM_EINVAL (bad seq, n_tokens > max_ctx), MM_EFULL (pool
// exhausted: nothing is taken then). Never allocates memory.
mm_err mm_kv_cache_reserve(mm_kv_cache *kv, int32_t seq, int32_t n_tokens);
// mm_kv_cache_truncate forgets positions >= n_tokens of seq (returns whole blocks past it),
// e.g. after rejected draft tokens.
void mm_kv_cache_truncate(mm_kv_cache *kv, int32_t seq, int32_t n_tokens);
// mm_kv_cache_seq_len is the number of positions reserved for seq.
int32_t mm_kv_cache_seq_len(const mm_kv_cache *kv, int32_t seq);

// mm_kv_cache_view fills the kernels' view of one layer (block tables included).
void mm_kv_cache_view(const mm_kv_cache *kv, int layer, struct mm_kv_view *out);

int mm_kv_cache_blocks_total(const mm_kv_cache *kv);
int mm_kv_cache_blocks_free(const mm_kv_cache *kv);
const mm_kv_params *mm_kv_cache_params(const mm_kv_cache *kv);

#endif
