// SPDX-License-Identifier: MIT
// The compute backend table (STYLE.md 5): every op the model needs, with one implementation
// per device kind (kernels/cpu/ for the host, kernels/cuda/ for CUDA and HIP). model.c and the
// daemons call only these entry points, so a forward pass reads the same on every device.
//
// Design notes:
// - Memory. Every pointer an op takes is *backend memory* (obtained from buffer_alloc, or, when
//   ops->host_memory is true, any host memory, including views into an mmap'd checkpoint),
//   unless the comment says (host). Activations are f32, row-major; a "stride" is the distance
//   in elements (not bytes) between consecutive rows, so views into wider buffers need no copy.
// - Weights are mm_weight views: a 2-D matrix (rows = outputs, cols = inputs), row-major and
//   contiguous, dtype BF16, F16 or F32. On the CPU backend `data` may be unaligned.
// - Exactness (the mesh depends on it). For a given backend, every output element of every op
//   is a pure function of that row's inputs: its reductions run in one fixed order that does
//   not depend on n_rows, on which other rows share the call, on the thread count or on how
//   the work is split. Never split one reduction across threads, and never change blocking
//   with n_rows. A row computed alone and the same row inside a batch are bit-identical.
//   Attention reads keys in position order through the block table, so its bits do not depend
//   on where the blocks sit in the pool.
// - Ordering and threading. Ops on one backend object are issued by one thread at a time (the
//   owner's inference loop). Ops may run asynchronously on a device; `synchronize` waits for
//   all issued work, and `get` is synchronous. The CPU backend runs every op to completion
//   before returning, spread over its own pool of worker threads (created at open).
// - Errors. Ops return MM_EINVAL for arguments outside what the op supports (e.g. an
//   unsupported dtype) and MM_EDEVICE for a device failure; they never abort on bad input.
// - Versioning. MM_BACKEND_V1 fixes the layout below. New members are only ever appended; a
//   NULL optional member has the default written beside it.
#ifndef MM_KERNELS_H
#define MM_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mm/dtype.h"
#include "mm/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MM_BACKEND_V1 1

// A weight matrix: y = W x uses rows = n_out, cols = n_in. A vector (norm weight, bias) is a
// matrix with rows = 1.
typedef struct mm_weight {
    enum mm_dtype dtype; // MM_DTYPE_BF16, MM_DTYPE_F16 or MM_DTYPE_F32
    int64_t rows, cols;  // row-major, contiguous: element (r, c) at index r * cols + c
    const void *data;    // backend memory; borrowed
} mm_weight;

// ---- RoPE ------------------------------------------------------------------------------------
enum mm_rope_style {
    // rotate_half (GPT-NeoX, Llama, Qwen, Mixtral, GLM partial): dim i pairs with i + rot_dim/2,
    // frequency index i mod rot_dim/2.
    MM_ROPE_NEOX = 0,
    // interleaved (GPT-J, DeepSeek rope_interleave): dims 2i and 2i+1 pair, frequency index i.
    // transformers permutes q and k the same way before rotate_half; q.k is unchanged, and
    // this layout is what the kernel writes.
    MM_ROPE_INTERLEAVED = 1,
};

struct mm_rope_args {
    float *x;              // (n_rows, n_heads, ...) f32, rotated in place
    int64_t n_rows;
    int64_t row_stride;    // elements between rows
    int n_heads;
    int64_t head_stride;   // elements between heads within a row
    int rot_offset;        // first rotated element inside a head (DeepSeek: qk_nope_head_dim)
    int rot_dim;           // rotated elements (even); the rest of the head is left alone
    const int32_t *pos;    // (n_rows,) token position of each row
    const float *inv_freq; // (rot_dim/2,) angle of row r, pair i = (float)pos[r] * inv_freq[i]
                           // (computed in f32 as torch does); carries yarn/linear scaling
    float mscale;          // cos and sin are multiplied by this (yarn attention factor; else 1)
    enum mm_rope_style style;
};
// Semantics (neox, h = rot_dim/2, c = cos(angle_i) * mscale, s = sin(angle_i) * mscale):
//   y[i] = x[i] * c - x[i+h] * s;  y[i+h] = x[i+h] * c + x[i] * s       for i < h
// interleaved: the same with the pair (2i, 2i+1) in place of (i, i+h).

// ---- Paged KV cache view (see mm/kv_cache.h for the allocator) -------------------------------
// One layer of the pool. Token t of a sequence lives in slot t % block_size of block
// block_table[t / block_size]; that slot starts at
//     base + block * block_stride + (t % block_size) * slot_stride
// and holds K (n_kv_heads, head_dim_k) followed by V (n_kv_heads, head_dim_v), in the view's
// dtype: f32, or bf16 where the backend's kv_dtype asked for it (then base points at bf16
// elements, cast, and the strides count bf16 elements).
// MLA (DeepSeek V3) is stored decompressed, as transformers computes it: n_kv_heads = n_heads,
// head_dim_k = qk_nope + qk_rope, head_dim_v = v_head_dim.
struct mm_kv_view {
    float *base;            // backend memory: this layer's first slot of block 0
    int block_size;         // tokens per block
    int64_t block_stride;   // elements between block b and b+1 of this layer
    int64_t slot_stride;    // elements between consecutive tokens of a block
    int n_kv_heads, head_dim_k, head_dim_v;
    const int32_t *block_tables; // (n_seqs, max_blocks) block ids, row per sequence
    int max_blocks;              // row length of block_tables
    enum mm_dtype dtype;         // MM_DTYPE_F32 (0: every backend) or MM_DTYPE_BF16 (only a
                                 // backend whose kv_dtype returns it takes such a view: its
                                 // kv_store rounds to nearest even, its attention reads it)
};

// kv_store writes rows into the cache: row r goes to sequence row_seq[r], position
// row_pos[r]. k: (n_rows, n_kv_heads*head_dim_k) with k_stride; v likewise with v_stride.
struct mm_kv_store_args {
    struct mm_kv_view kv;
    const float *k;
    int64_t k_stride;
    const float *v;
    int64_t v_stride;
    int64_t n_rows;
    const int32_t *row_seq; // (n_rows,) row index into kv.block_tables
    const int32_t *row_pos; // (n_rows,) token position; its block must be in the table
};

// attention: causal softmax attention with GQA over the paged cache, for decode and prefill
// alike. Query row r of sequence row_seq[r] at position row_pos[r] attends to that
// sequence's keys at positions 0..row_pos[r] (inclusive), which must already be stored
// (kv_store first, also for the rows of this same call). Head h reads kv head
// h / (n_heads / n_kv_heads). For each (row, head):
//   s_t = scale * dot(q, k_t) (f32, dims in order); p = softmax(s) (max-subtracted, sum in t
//   order); out = sum_t p_t * v_t (t ascending).
// window > 0 limits keys to positions > row_pos[r] - window (sliding window); 0 = none.
struct mm_attn_args {
    struct mm_kv_view kv;
    const float *q;         // (n_rows, n_heads, head_dim_k), row stride q_stride
    int64_t q_stride;
    float *out;             // (n_rows, n_heads, head_dim_v), row stride out_stride
    int64_t out_stride;
    int64_t n_rows;
    const int32_t *row_seq; // (n_rows,)
    const int32_t *row_pos; // (n_rows,)
    int n_heads;
    float scale;            // usually head_dim_k^-0.5 (times yarn mscale^2 for DeepSeek)
    int window;
    int long_ctx;           // 1: some row's position is >= MM_ATT_LONG_POS (as the caller knows
                            // it on the host); a backend may then take a form made for long
                            // contexts; the same results either way (0: not known or short)
    int keys_early;         // 1: each row is the only row of its sequence in this call, and
                            // row_seq, row_pos and the cache tables were copied from the host
                            // (set) before this step's first op, so every key below a row's
                            // position was stored by ops that ended before that copy: a
                            // backend may read them before the op before this one has ended
                            // (only the key at the position may be that op's); 0: not known
};

// The q/k preparation attention_prep does before the attention (head_norm_rope_kv's
// arguments): x (rows of stride) holds n_a query heads from its start and n_b key heads from
// b_off, each of head_dim, normed by wa / wb (NULL: none) and rotated by rope; st stores the
// keys (x's group b) and the values into the cache.
struct mm_attn_prep {
    float *x;
    int64_t stride;
    int n_a, n_b;
    int64_t b_off;
    int head_dim;
    const mm_weight *wa, *wb;
    float eps;
    struct mm_rope_args rope;
    struct mm_kv_store_args st;
};

// MM_ATT_LONG_POS: the position from which a row counts as a long context (mm_attn_args
// long_ctx): 12 of the contract's 64-key blocks (kernels/cuda/attention_tcs.cuh).
#define MM_ATT_LONG_POS 768

// ---- MoE routing -----------------------------------------------------------------------------
enum mm_route_score {
    MM_ROUTE_SOFTMAX = 0, // p = softmax(logits) over all experts (Qwen, Mixtral)
    MM_ROUTE_SIGMOID = 1, // p = sigmoid(logits) (DeepSeek V3, GLM-4.5)
};

struct mm_route_params {
    int n_experts;
    int top_k;
    enum mm_route_score score;
    const float *bias;  // (n_experts,) f32 added to p for the choice only (e_score_correction_
                        // bias), or NULL. The weights returned are the unbiased p.
    int n_group;        // group-limited choice (DeepSeek noaux_tc): n_experts split into n_group
    int topk_group;     // groups; a group's score is the sum of its 2 best choice scores; the
                        // topk_group best groups stay and the others' choice scores become 0.0
                        // (exactly as transformers). n_group <= 1 disables it.
    bool renorm;        // weights /= (sum of the top_k weights + renorm_eps)
    float renorm_eps;   // 0 for Qwen/Mixtral, 1e-20 for DeepSeek/GLM
    float scale;        // weights *= scale after renorm (routed_scaling_factor; else 1)
};
// route: logits (n_rows, n_experts) f32 -> ids (n_rows, top_k) int32 and weights (n_rows,
// top_k) f32 (both backend memory), ordered by descending choice score, ties to the lower
// expert id. Callers that dispatch on the host copy them back with get.

// ---- the table -------------------------------------------------------------------------------
struct mm_backend_ops {
    uint32_t version;   // MM_BACKEND_V1
    const char *name;   // "cpu", "cuda", "hip"
    bool host_memory;   // true: backend memory is host memory (mmap'd weights used in place)

    void (*close)(void *ctx); // frees the context and everything it owns; accepts NULL

    // Buffers. buffer_alloc returns owned, 64-byte aligned memory of n_bytes (MM_ENOMEM,
    // MM_EDEVICE). buffer_free accepts NULL.
    mm_err (*buffer_alloc)(void *ctx, size_t n_bytes, void **out);
    void (*buffer_free)(void *ctx, void *p);
    // set copies n_bytes from host src to backend dst; get copies backend src to host dst
    // (waits for issued work first). (optional for host_memory backends: memcpy)
    mm_err (*set)(void *ctx, void *dst, const void *src, size_t n_bytes);
    mm_err (*get)(void *ctx, void *dst, const void *src, size_t n_bytes);
    mm_err (*synchronize)(void *ctx); // (optional: ops are synchronous)

    // matmul: y[i, j] = sum_k x[i, k] * W[j, k] (+ bias[j]) for i < n_rows, j < w->rows,
    // k < w->cols; x f32 with x_stride, y f32 with y_stride (y must not alias x); bias (w->rows,)
    // f32 or NULL. Each y[i, j] is one dot product in a fixed order (see Exactness).
    mm_err (*matmul)(void *ctx, const mm_weight *w, const float *bias, const float *x,
                     int64_t x_stride, float *y, int64_t y_stride, int64_t n_rows);

    // rmsnorm: y[i, :] = w * (x[i, :] * 1/sqrt(mean(x[i, :]^2) + eps)), dim = w->cols, w a
    // (1, dim) vector of any weight dtype. x and y may alias. Per-head q/k norm is this op
    // with one row per head (n_rows = tokens * heads, stride = head_dim).
    mm_err (*rmsnorm)(void *ctx, const mm_weight *w, float eps, const float *x,
                      int64_t x_stride, float *y, int64_t y_stride, int64_t n_rows);

    mm_err (*rope)(void *ctx, const struct mm_rope_args *a);
    mm_err (*kv_store)(void *ctx, const struct mm_kv_store_args *a);
    mm_err (*attention)(void *ctx, const struct mm_attn_args *a);

    // embed: out[i, :] = f32(table row ids[i]) for i < n_rows; ids (n_rows,) int32, each in
    // [0, table->rows) (MM_EINVAL otherwise, checked before writing). out row stride.
    mm_err (*embed)(void *ctx, const mm_weight *table, const int32_t *ids, int64_t n_rows,
                    float *out, int64_t out_stride);

    // swiglu: out[i, j] = silu(gate[i, j]) * up[i, j], silu(g) = g / (1 + exp(-g)), for
    // j < dim. out may alias gate.
    mm_err (*swiglu)(void *ctx, const float *gate, int64_t gate_stride, const float *up,
                     int64_t up_stride, float *out, int64_t out_stride, int64_t n_rows,
                     int64_t dim);

    // route: see struct mm_route_params.
    mm_err (*route)(void *ctx, const struct mm_route_params *p, const float *logits,
                    int64_t logits_stride, int64_t n_rows, int32_t *ids, float *weights);

    // axpy: y[i, :] += alpha[i] * x[i, :] for i < n_rows, j < dim (alpha NULL: 1). One
    // multiply then one add per element (no fused multiply-add), so every backend rounds alike.
    // Combine calls it once per expert in canonical order.
    mm_err (*axpy)(void *ctx, const float *alpha, const float *x, int64_t x_stride, float *y,
                   int64_t y_stride, int64_t n_rows, int64_t dim);

    // sigmoid: x[i] = 1 / (1 + exp(-x[i])) for i < n, in place (Qwen2-MoE shared-expert gate).
    mm_err (*sigmoid)(void *ctx, float *x, int64_t n);

    // copy_rows: dst[d(i), 0..dim) = src[s(i), 0..dim) for i < n_rows, where s(i) = src_idx[i]
    // (or i when src_idx is NULL) and d(i) = dst_idx[i] (or i); rows are src_stride/dst_stride
    // elements apart; indices are backend memory. Gathers rows for an expert, scatters its
    // output, and assembles MLA keys. Regions must not overlap.
    mm_err (*copy_rows)(void *ctx, const float *src, int64_t src_stride, const int32_t *src_idx,
                        float *dst, int64_t dst_stride, const int32_t *dst_idx, int64_t n_rows,
                        int64_t dim);

    // fill: x[i] = value for i < n.
    mm_err (*fill)(void *ctx, float *x, float value, int64_t n);

    // moe_matmul (optional; NULL: call matmul once per expert with rows): the grouped expert
    // product, all of a layer's routed rows in one call. Rows of x are sorted by expert:
    // expert e owns rows [offs[e], offs[e+1]) (offs (host): n_experts+1 int32, offs[0] == 0,
    // offs[n_experts] == n_rows, non-decreasing). experts (host array of n_experts) are
    // weights of one shape (rows, cols) and dtype; an expert with no rows may have data NULL.
    // y[i, :] = W_e x[i, :] with exactly the bits matmul gives that row (see Exactness), so a
    // grouped call and per-expert calls are interchangeable. No bias.
    mm_err (*moe_matmul)(void *ctx, const mm_weight *experts, const int32_t *offs,
                         int n_experts, const float *x, int64_t x_stride, float *y,
                         int64_t y_stride, int64_t n_rows);

    // ---- optional: a decode step that stays on the device (NULL: the host path) ----------
    // route_plan: the grouped product's plan from route's result, on the device. ids (n_rows,
    // top_k) int32 and weights (n_rows, top_k) f32 in; the n_rows*top_k (row, rank) slots
    // t = i*top_k + r sorted by expert, stable (one expert's slots in slot order), out:
    // offs (n_experts+1) int32 as moe_matmul's offsets; src_row[p] = the x row (t / top_k) of
    // sorted slot p; dst_slot[p] = t; wt (top_k, n_rows) f32 = weights by rank (rank r's
    // weights at wt + r * n_rows), or NULL. All backend memory. An id outside [0, n_experts)
    // counts as expert 0 and makes the next synchronize/get return MM_EINVAL.
    mm_err (*route_plan)(void *ctx, const int32_t *ids, const float *weights, int64_t n_rows,
                         int top_k, int n_experts, int32_t *offs, int32_t *src_row,
                         int32_t *dst_slot, float *wt);
    // moe_matmul_dev: moe_matmul with its expert table and offsets in backend memory, so that
    // no host copy is needed: experts holds n_experts pointers (backend memory, built once at
    // load) to matrices of one shape (rows, cols) and dtype; offs as route_plan writes them;
    // n_rows >= offs[n_experts] (the engine's n * top_k: equal); rows from offs[n_experts] to
    // n_rows belong to no expert and are neither computed nor written (a mesh owner launches
    // for the worst case on its share of a plan: services/expert/expert.c; so does
    // moe_matmul_rows with its x_idx/y_idx). Same bits as moe_matmul.
    mm_err (*moe_matmul_dev)(void *ctx, const void *const *experts, enum mm_dtype dtype,
                             int64_t rows, int64_t cols, int n_experts, const int32_t *offs,
                             const float *x, int64_t x_stride, float *y, int64_t y_stride,
                             int64_t n_rows);
    // argmax: ids[i] = index of the largest of logits row i (vocab values, row stride), the
    // lowest on ties, NaN never chosen; ids (n_rows,) int32 backend memory. Greedy decoding
    // copies back n_rows ids instead of n_rows * vocab logits.
    mm_err (*argmax)(void *ctx, const float *logits, int64_t stride, int64_t n_rows, int vocab,
                     int32_t *ids);
    // Graphs: capture_begin starts recording the ops issued next (nothing runs; no set, get
    // or synchronize may be issued until capture_end); capture_end returns the recording as
    // an owned *graph (graph_free) or an error (the ops were dropped, the backend is usable).
    // graph_launch runs the recorded ops again with the same arguments: pointers are fixed,
    // the data behind them is read when the graph runs. MM_ECLOSED: the recording refers to
    // memory the backend has since released (nothing was launched): free it, record again.
    mm_err (*capture_begin)(void *ctx);
    mm_err (*capture_end)(void *ctx, void **graph);
    mm_err (*graph_launch)(void *ctx, void *graph);
    void (*graph_free)(void *ctx, void *graph);
    // combine (optional; NULL: fill, then axpy per rank, shared, residual): for i < n_rows,
    // j < dim: acc = 0; acc += alpha[r * n_rows + i] * x[(i * k + r) * x_stride + j] for
    // r = 0..k-1 in order; acc += shared[i * shared_stride + j] (shared may be NULL);
    // h[i * h_stride + j] += acc. Each step one multiply then one add, rounded (no fused
    // multiply-add): exactly the bits of that sequence of axpys, in one launch.
    mm_err (*combine)(void *ctx, const float *alpha, int k, const float *x, int64_t x_stride,
                      const float *shared, int64_t shared_stride, float *h, int64_t h_stride,
                      int64_t n_rows, int64_t dim);
    // head_norm_rope (optional; NULL: rmsnorm with one row per head, then rope): a layer's q
    // and k heads prepared in place in one launch. Row r of x (row stride `stride`) holds n_a
    // heads of head_dim from x + r * stride, then n_b heads from x + r * stride + b_offset
    // (q then k of a fused q/k/v product). Group a's heads get rmsnorm with wa, group b's with
    // wb (either NULL: no norm), with exactly rmsnorm's bits; then every head gets rope with
    // rope's pos, inv_freq, rot_offset, rot_dim, mscale and style (its other fields are
    // ignored), with exactly rope's bits.
    mm_err (*head_norm_rope)(void *ctx, float *x, int64_t n_rows, int64_t stride, int n_a,
                             int n_b, int64_t b_offset, int head_dim, const mm_weight *wa,
                             const mm_weight *wb, float eps, const struct mm_rope_args *rope);
    // moe_matmul_rows (optional; NULL or MM_EUNSUPP: swiglu, copy_rows, moe_matmul_dev,
    // copy_rows): moe_matmul_dev whose sorted row p reads x row x_idx[p] and writes y row
    // y_idx[p] (either NULL: row p), i.e. the gather of the routed rows and the scatter of
    // their outputs in the same call; x_up non-NULL: the input row is swiglu(x row, x_up row)
    // (x_up rows have x's stride and index) instead of x. The bits of that sequence of ops.
    // May return MM_EUNSUPP having issued nothing (a shape it does not take: the decode form
    // only); the caller then runs the sequence.
    mm_err (*moe_matmul_rows)(void *ctx, const void *const *experts, enum mm_dtype dtype,
                              int64_t rows, int64_t cols, int n_experts, const int32_t *offs,
                              const float *x, int64_t x_stride, const int32_t *x_idx,
                              const float *x_up, float *y, int64_t y_stride,
                              const int32_t *y_idx, int64_t n_rows);
    // moe_ffn_rows (optional; NULL or MM_EUNSUPP: moe_matmul_rows of [gate; up] into a buffer,
    // then moe_matmul_rows of down with x_up): a MoE layer's routed SwiGLU experts: sorted row p
    // (offs as moe_matmul_dev) reads x row x_idx[p] (NULL: p), h = [gate; up] of its expert
    // (experts_gu: (2 * d_ff, d_model) matrices, gate rows first), y row y_idx[p] (NULL: p) =
    // down (experts_down: (d_model, d_ff)) times swiglu(h[:d_ff], h[d_ff:]). The bits of the
    // two calls. May return MM_EUNSUPP having issued nothing (shapes it does not take).
    mm_err (*moe_ffn_rows)(void *ctx, const void *const *experts_gu,
                           const void *const *experts_down, enum mm_dtype dtype, int64_t d_ff,
                           int64_t d_model, int n_experts, const int32_t *offs, const float *x,
                           int64_t x_stride, const int32_t *x_idx, float *y, int64_t y_stride,
                           const int32_t *y_idx, int64_t n_rows);
    // add_rmsnorm (optional; NULL: axpy with alpha NULL, then rmsnorm): for i < n_rows,
    // h[i, :] += a[i, :] (axpy's one add), then y[i, :] = rmsnorm(w, eps, h[i, :]) with
    // exactly rmsnorm's bits; dim = w->cols. The residual add and the next norm in one pass.
    // y must not alias h or a.
    mm_err (*add_rmsnorm)(void *ctx, const float *a, int64_t a_stride, float *h,
                          int64_t h_stride, const mm_weight *w, float eps, float *y,
                          int64_t y_stride, int64_t n_rows);
    // head_norm_rope_kv (optional; NULL: head_norm_rope, then kv_store): head_norm_rope with
    // these arguments, then kv_store(st), with exactly the bits of the two (st's keys are
    // usually x's group b: a device may then store each key head as it finishes it).
    mm_err (*head_norm_rope_kv)(void *ctx, float *x, int64_t n_rows, int64_t stride, int n_a,
                                int n_b, int64_t b_offset, int head_dim, const mm_weight *wa,
                                const mm_weight *wb, float eps, const struct mm_rope_args *rope,
                                const struct mm_kv_store_args *st);
    // route_with_plan (optional; NULL: route, then route_plan): route(p, logits,
    // logits_stride, n_rows, ids, weights), then route_plan(ids, weights, n_rows, p->top_k,
    // p->n_experts, offs, src_row, dst_slot, wt): every output as the two ops write it.
    mm_err (*route_with_plan)(void *ctx, const struct mm_route_params *p, const float *logits,
                              int64_t logits_stride, int64_t n_rows, int32_t *ids,
                              float *weights, int32_t *offs, int32_t *src_row,
                              int32_t *dst_slot, float *wt);
    // combine_rmsnorm (optional; NULL: combine, then rmsnorm): combine(alpha, k, x, x_stride,
    // shared, shared_stride, h, h_stride, n_rows, dim = w->cols), then y[i, :] =
    // rmsnorm(w, eps, h[i, :]), with exactly the bits of the two (the residual stream's
    // update and the next layer's input norm in one pass). y must not alias h, x or shared.
    mm_err (*combine_rmsnorm)(void *ctx, const float *alpha, int k, const float *x,
                              int64_t x_stride, const float *shared, int64_t shared_stride,
                              float *h, int64_t h_stride, int64_t n_rows, const mm_weight *w,
                              float eps, float *y, int64_t y_stride);
    // embed_rmsnorm (optional; NULL: embed, then rmsnorm): embed(table, ids, n_rows, out,
    // out_stride), then y[i, :] = rmsnorm(w, eps, out[i, :]) (w->cols == table->cols), with
    // exactly the bits of the two (the first layer's input norm). y must not alias out.
    mm_err (*embed_rmsnorm)(void *ctx, const mm_weight *table, const int32_t *ids,
                            int64_t n_rows, float *out, int64_t out_stride, const mm_weight *w,
                            float eps, float *y, int64_t y_stride);
    // kv_dtype (optional; NULL: MM_DTYPE_F32): the element type this backend wants for a KV
    // cache of this shape (mm_kv_params.dtype, struct mm_kv_view.dtype). MM_DTYPE_BF16 only
    // where every attention read of such a cache rounds K and V to bf16 (round to nearest
    // even) anyway, so the stored bf16 gives the same bits as an f32 cache in half the bytes.
    // Decided when a cache is made: the cache keeps its dtype for its life.
    enum mm_dtype (*kv_dtype)(void *ctx, int n_kv_heads, int head_dim_k, int head_dim_v);
    // fetch / fetch_wait (optional, both or neither; NULL: callers use get): a result read
    // without waiting for the ops issued after it, so a caller may issue its next step before
    // it reads this one's (greedy decode's picks). fetch enqueues a copy of n_bytes
    // (1..MM_FETCH_BYTES) of backend memory src, ordered after every op issued before it, into
    // a slot of the backend's own host memory and returns its ticket (MM_EBUSY: MM_FETCH_SLOTS
    // fetches are waiting already; MM_EINVAL while a graph is being recorded). fetch_wait
    // waits for that copy alone (ops issued after the fetch go on running), copies the bytes
    // to host dst and frees the slot; a ticket not outstanding is MM_EINVAL. A bad index met by
    // an op issued before the fetch is MM_EINVAL (dst written all the same); unlike get, the
    // report does not clear it: later fetches report it too until a get or synchronize does.
    mm_err (*fetch)(void *ctx, const void *src, size_t n_bytes, uint64_t *ticket);
    mm_err (*fetch_wait)(void *ctx, uint64_t ticket, void *dst);
    // matmul_res (optional; NULL or MM_EUNSUPP, then nothing was issued: matmul into a scratch,
    // then axpy of it onto the residual): y[i, :] = matmul(w, x[i, :]) (no bias) + res[i, :],
    // the residual added after the product as axpy adds it, so the bits of matmul into t then
    // y = res + t. y may be res (in place); neither may alias x.
    mm_err (*matmul_res)(void *ctx, const mm_weight *w, const float *x, int64_t x_stride,
                         const float *res, int64_t res_stride, float *y, int64_t y_stride,
                         int64_t n_rows);
    // attention_prep (optional; NULL or MM_EUNSUPP with nothing issued: head_norm_rope_kv with
    // p's arguments, then attention(a)): the two in one, with exactly their bits (a's q is p's
    // x before the norms; a device may prepare each kv head's queries and store its key and
    // value inside that head's attention block). Backends take it for decode calls only (a's
    // keys_early: every other key was stored before).
    mm_err (*attention_prep)(void *ctx, const struct mm_attn_prep *p, const struct mm_attn_args *a);
    // copy (optional): n_bytes of backend memory from src to dst (not overlapping), in order
    // with the other ops (a device's own copy engine or kernel; benchmarks time it as the
    // device's copy bandwidth).
    mm_err (*copy)(void *ctx, void *dst, const void *src, size_t n_bytes);
};
#define MM_FETCH_BYTES 4096
#define MM_FETCH_SLOTS 4

// A backend instance: the table plus its context. Not thread-safe (one issuing thread).
typedef struct mm_backend {
    const struct mm_backend_ops *ops;
    void *ctx;
    int n_threads; // CPU worker threads (informational for device backends)
} mm_backend;

typedef struct mm_backend_params {
    int n_threads; // CPU: worker threads including the caller; 0 = all online cores
    int device;    // device index for GPU backends
} mm_backend_params;

// mm_backend_open creates the backend named by spec: "cpu", "cuda:N", "hip:N" (device N).
// Returns owned *out (mm_backend_close). Errors: MM_EUNSUPP (kind not compiled in, named in
// err), MM_EINVAL (bad spec), MM_ENOMEM, MM_EDEVICE.
mm_err mm_backend_open(mm_backend **out, const char *spec, const mm_backend_params *p,
                       char err[MM_ERRLEN]);
// mm_backend_close frees the backend; accepts NULL.
void mm_backend_close(mm_backend *be);

// Constructors of the individual backends, used by mm_backend_open. A backend that is not
// compiled in is a weak undefined symbol (NULL).
mm_err mm_cpu_backend_open(mm_backend *be, const mm_backend_params *p, char err[MM_ERRLEN]);
// "cpu-dev": the CPU kernels with a device backend's contract (kernels/cpu/cpu.c), for running
// and testing the device paths without a GPU.
mm_err mm_cpu_dev_backend_open(mm_backend *be, const mm_backend_params *p, char err[MM_ERRLEN]);
mm_err mm_cuda_backend_open(mm_backend *be, const mm_backend_params *p, char err[MM_ERRLEN]);

#ifdef __cplusplus
}
#endif

#endif
