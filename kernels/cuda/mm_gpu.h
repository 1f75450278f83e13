// SPDX-License-Identifier: MIT
// C entry points of the GPU kernels (kernels/cuda/*.cu, built by nvcc for CUDA or by hipcc for
// AMD). The backend table (kernels/cuda/backend.cu) is written on top of these; tests and the
// GPU bench call them directly. Every pointer named d_* is device memory; `stream` is the
// vendor stream (cudaStream_t / hipStream_t) or NULL for the default stream. Launchers only
// enqueue work: they never block and never allocate. Shapes are row-major, weights bf16 in
// the checkpoint's (out, in) layout, activations f32.
// Errors: MM_EINVAL for a bad shape or pointer (message logged), MM_EDEVICE when the launch
// fails (statement and location logged by MM_GPU_CHECK).
#ifndef MM_GPU_H
#define MM_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "mm/err.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- devices and memory -----------------------------------------------------------------
// mm_gpu_device_count sets *n to the number of usable devices; 0 (and MM_OK) when the host
// has no driver or no card (cudaErrorInsufficientDriver 35 / cudaErrorNoDevice 100), with the
// reason in why (may be NULL). Other failures return MM_EDEVICE.
mm_err mm_gpu_device_count(int *n, char why[MM_ERRLEN]);
// mm_gpu_device_info writes the device's name, multiprocessor count and memory size.
mm_err mm_gpu_device_info(int dev, char name[128], int *n_sm, size_t *mem_bytes);
mm_err mm_gpu_set_device(int dev);
// mm_gpu_alloc returns owned device memory (free with mm_gpu_free, which accepts NULL).
mm_err mm_gpu_alloc(void **d_out, size_t n_bytes);
void mm_gpu_free(void *d);
mm_err mm_gpu_memcpy_h2d(void *stream, void *d_dst, const void *h_src, size_t n_bytes);
mm_err mm_gpu_memcpy_d2h(void *stream, void *h_dst, const void *d_src, size_t n_bytes);
mm_err mm_gpu_memcpy_d2d(void *stream, void *d_dst, const void *d_src, size_t n_bytes);
mm_err mm_gpu_memset(void *stream, void *d_dst, int byte, size_t n_bytes);
mm_err mm_gpu_stream_new(void **stream);
void mm_gpu_stream_free(void *stream);
mm_err mm_gpu_stream_sync(void *stream); // bounded: MM_ETIMEDOUT after MM_GPU_DRAIN_TIMEOUT_MS
// mm_gpu_stream_hold enqueues a host function that sleeps ms milliseconds: the stream's later
// work waits for it (tests of the bounded drains use it to stand for a peer that never frees).
mm_err mm_gpu_stream_hold(void *stream, int ms);
// mm_gpu_set_drain_timeout_ms sets every drain's deadline (ms > 0; 0 or less: the environment's
// MM_GPU_DRAIN_TIMEOUT_MS again, default 30000). Process-wide.
void mm_gpu_set_drain_timeout_ms(int ms);

// ---- matrix products ----------------------------------------------------------------------
// Paths of a product. AUTO picks GEMV or MMA for bf16 on CUDA (they give the same bits for a
// row whatever n_rows is, kernels.h "Exactness") and FMA otherwise; forcing FMA for bf16 on
// CUDA gives other bits (f32 x), so only benches and tests force a path.
enum mm_gpu_path {
    MM_GPU_PATH_AUTO = -1,
    MM_GPU_PATH_GEMV = 0, // CUDA, bf16: W in the mma A operand, up to 32 rows per tile (decode)
    MM_GPU_PATH_FMA = 1,  // any vendor, any dtype: 64x64 FMA tiles, f32 x
    MM_GPU_PATH_MMA = 2,  // CUDA, bf16: mma.sync tiles (prefill): 64x128 fed by a 4-stage
                          // cp.async pipeline, 128x128 register-staged for unaligned shapes
    MM_GPU_PATH_WG = 3,   // CUDA sm_90, bf16, even n_in: wgmma tiles (prefill, AUTO's choice
                          // there); x goes through a stream-ordered workspace (cudaMallocAsync
                          // on `stream`, freed on it; MMA when none can be had or the
                          // stream is capturing). Same bits.
    MM_GPU_PATH_SEG = 4,  // CUDA, bf16, dense, 1..64 rows, n_in % 32 == 0: a block per (128
                          // outputs, k segment), the segment sums added in order by a second
                          // kernel (the stream's buffer; MM_EUNSUPP where it cannot run).
                          // AUTO's choice for 9..64 rows of few output tiles. Same bits.
};

// d_y[i, j] = sum_k d_x[i, k] * W[j, k] (+ d_bias[j]) for i < n_rows, j < n_out, k < n_in.
// W (n_out, n_in) row-major of dtype (enum mm_dtype: BF16, F16, F32); x and y f32 with row
// strides in elements; d_bias NULL or (n_out,) f32. On CUDA bf16 products round x to bf16 and
// run on the tensor cores; other dtypes, and HIP, use f32 FMA. path: enum mm_gpu_path.
mm_err mm_gpu_matmul(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                     const float *d_bias, const float *d_x, int64_t x_stride, float *d_y,
                     int64_t y_stride, int n_rows, int path);
// mm_gpu_matmul_res: y = the product (bf16 W, no bias) + res, row by row, the residual added in
// the GEMV's epilogue after the product (the bits of the product then axpy onto res); y may be
// res. MM_EUNSUPP, nothing issued, where the product would not run on GEMV v2/v3.
mm_err mm_gpu_matmul_res(void *stream, int dtype, const void *d_w, int n_out, int n_in,
                         const float *d_x, int64_t x_stride, const float *d_res,
                         int64_t res_stride, float *d_y, int64_t y_stride, int n_rows);

// Grouped expert product, all of a layer's routed rows in one launch. Rows of d_x are sorted
// by expert: expert e owns rows [d_offs[e], d_offs[e+1]) (d_offs: n_experts+1 int32 on the
// device, d_offs[0] == 0, d_offs[n_experts] == n_rows). d_w is a device array of n_experts
// device pointers to (n_out, n_in) matrices of dtype, 16-byte aligned (NULL allowed for an
// expert with no rows). Row r of d_y gets x_r . W_e^T, with the same bits as mm_gpu_matmul.
mm_err mm_gpu_moe_matmul(void *stream, int dtype, const void *const *d_w, const int32_t *d_offs,
                         int n_experts, int n_out, int n_in, const float *d_x, int64_t x_stride,
                         float *d_y, int64_t y_stride, int n_rows, int path);

// mm_gpu_moe_matmul_rows: mm_gpu_moe_matmul whose sorted row p reads x row d_x_idx[p] and
// writes y row d_y_idx[p] (either NULL: p), i.e. the gather and the scatter around a grouped
// product in the same launch, with the bits of that sequence; d_x_up non-NULL: the input is
// swiglu(x, x_up) (kernels.h swiglu's bits; x_up rows share x's stride and indices). Only the
// decode GEMV (v2) takes these: MM_EUNSUPP, with nothing enqueued, for other shapes (more than
// 8 rows per expert on average, a row too long for its shared x tile, not bf16, HIP, GEMV
// v1); the caller then runs the separate ops.
mm_err mm_gpu_moe_matmul_rows(void *stream, int dtype, const void *const *d_w,
                              const int32_t *d_offs, int n_experts, int n_out, int n_in,
                              const float *d_x, int64_t x_stride, const int32_t *d_x_idx,
                              const float *d_x_up, float *d_y, int64_t y_stride,
                              const int32_t *d_y_idx, int n_rows);

// mm_gpu_moe_ffn_rows: a prefill MoE layer's routed SwiGLU experts in two grouped products:
// sorted row p (experts by d_offs as mm_gpu_moe_matmul) reads x row d_x_idx[p] (NULL: p),
// [gate; up] (d_wgu[e]: (2 d_ff, d_model), gate rows first), SwiGLU, down (d_wd[e]: (d_model,
// d_ff)) into y row d_y_idx[p] (NULL: p): the bits of mm_gpu_moe_matmul_rows([gate; up]) into
// an f32 buffer, then mm_gpu_moe_matmul_rows(down) with x_up. [gate; up]'s epilogue applies
// SwiGLU and writes down's bf16 input workspace directly (gemm_ws WS_OPT_SWIGLU, on an
// interleaved permuted copy of d_wgu kept in the permuted-W cache). At decode (bf16, n_rows <=
// 16 and <= n_experts, both products on GEMV v3, d_ff % 8 == 0, mm_gpu_set_ffn_dec on) the two products
// run as GEMV v3's launches with the [gate | up] rows in a buffer of the stream, down's blocks
// looking their tiles up and streaming their W before [gate; up] has finished (inside a capture
// only once an eager call made that buffer). MM_EUNSUPP, with nothing enqueued but permuted-W
// cache builds, unless one of the two applies (prefill: both products would run on gemm_ws
// (bf16, >= 128 rows per expert on average, sm_90a), d_ff % 8 == 0, the stream is not capturing
// and mm_gpu_set_prefill_fuse and mm_gpu_set_pf_swiglu_epi are on); the caller then runs the
// two products.
mm_err mm_gpu_moe_ffn_rows(void *stream, int dtype, const void *const *d_wgu,
                           const void *const *d_wd, const int32_t *d_offs, int n_experts, int d_ff,
                           int d_model, const float *d_x, int64_t x_stride, const int32_t *d_x_idx,
                           float *d_y, int64_t y_stride, const int32_t *d_y_idx, int n_rows);
// mm_gpu_set_pf_swiglu_epi: 1 (default; env MM_GPU_PF_SWIGLU_EPI=0 starts it at 0) lets
// mm_gpu_moe_ffn_rows run; 0 makes it MM_EUNSUPP (the earlier two products); -1 back to the
// environment's choice. Same bits. Process-wide; CUDA only.
void mm_gpu_set_pf_swiglu_epi(int on);
// mm_gpu_set_ffn_dec: 1 (default; env MM_GPU_FFN_DEC=0 starts it at 0) lets mm_gpu_moe_ffn_rows
// run a decode step's two products itself; 0 leaves them to the caller; -1 back to the
// environment's choice. Same bits. mm_gpu_ffn_dec_launches counts those FFNs. Process-wide;
// CUDA only (0 elsewhere).
void mm_gpu_set_ffn_dec(int on);
unsigned long long mm_gpu_ffn_dec_launches(void);
// mm_gpu_set_gemv_xcap: x rows a grouped GEMV v3 block stages at a time (1, 2, 4 or 8; any
// other value: back to MM_GPU_GEMV_XCAP or the default, 1 for products of at most 16 rows, else
// 8); a tile of more rows runs in passes. Same bits. Process-wide; CUDA only.
void mm_gpu_set_gemv_xcap(int cap);
// mm_gpu_set_gemv_gtpb: 16-row tiles per grouped GEMV v3 block (1, 2 or 4, where tiles x
// segments fit the block's 8 warps; any other value: back to MM_GPU_GEMV_GTPB). Same bits.
// Process-wide.
void mm_gpu_set_gemv_gtpb(int t);
// mm_gpu_set_conv_batch: 1 (default; env MM_GPU_CONV_BATCH=0 starts it at 0) converts gemm_ws's
// x a warp per row with each lane's loads of 4 pieces issued before their stores; 0 piece by
// piece (A/B). Same bytes; -1 back to the environment's choice. Process-wide; CUDA only.
void mm_gpu_set_conv_batch(int on);

// mm_gpu_set_gemv_version: 2 (default) runs bf16 decode products of <= 8 rows per tile on
// GEMV v2 (x tile in shared memory, whole k segments of W in flight, first loads before the
// PDL wait); 1 keeps every product on the earlier kernel (A/B runs; MM_GPU_OLD_DECODE=1 sets
// it). Same bits. Process-wide; CUDA only.
void mm_gpu_set_gemv_version(int v);
// mm_gpu_set_gemv_bulk: GEMV v3 (W of each block by bulk copies into shared memory, the same
// bits as v2) for products v2 takes with n_in % 8 == 0: 0 off; 1 those of at most 8 rows
// (dense; grouped as v2), the LM head included; 2 all of them; -1 back to env MM_GPU_GEMV_BULK
// (read once; default GEMV_BULK_DEFAULT in matmul.cu). mm_gpu_gemv_bulk_launches counts v3
// launches (tests). Process-wide; CUDA only.
void mm_gpu_set_gemv_bulk(int mode);
unsigned long long mm_gpu_gemv_bulk_launches(void);

// mm_gpu_set_pdl turns programmatic dependent launch of the decode GEMV on (default) or off
// (CUDA sm_90; no effect on HIP). Process-wide; call before issuing work.
void mm_gpu_set_pdl(int on);
// mm_gpu_set_gemv_wpt caps the warps per 16-row tile of dense decode GEMVs (1, 2 or 4; 0:
// default, by segment count up to 8): fewer blocks, each over more output rows. Same bits.
// Process-wide; CUDA only (A/B runs).
void mm_gpu_set_gemv_wpt(int wpt);
// mm_gpu_set_early_launch: the kernels that feed a product (rmsnorm, attention, copy_rows,
// swiglu) let the product's dependent launch start at their own start (default on; ops.cu).
// Process-wide; same results either way.
void mm_gpu_set_early_launch(int on);
// mm_gpu_set_dep_launch: the small ops of a decode step (norms, head_norm_rope, kv_store,
// attention, embed, route, route_plan, combine, copy_rows, swiglu, argmax) launch as
// programmatic dependents of the kernel before them (sm_90) and wait for it at their start, so
// their launch overlaps it. Off until set; the CUDA backend sets it on when opened (env
// MM_GPU_PDL_ALL=0 or MM_GPU_OLD_DECODE=1: off). Same results. Process-wide.
void mm_gpu_set_dep_launch(int on);

// mm_gpu_set_gemm_tile picks the wgmma block (benches, tests): 0 (default) per product kind
// (dense 14, 13 or 4 by rows and outputs, grouped 20 or 2 by rows per expert: matmul.cu
// ws_auto_variant, ws_auto_grouped); 2: 128
// outputs x 128 tokens, 3: 192 x 128, 4: 128 x 192, 5: 128 x 128 with 128-wide k stages, 6: 2
// with the one-way release proxy fence; 8-10: W from registers (gemm_wp_kernel); 11-18: both
// operands by bulk copies from a producer warpgroup, W permuted into a workspace
// (gemm_ws_kernel: 11 128 x 128 with drains, 12 128 x 192, 13 128 x 128 with two
// accumulators, 14 the same persistent, 15 persistent with warpgroup 1 lagging, 16/17 12 with
// the lag / persistent + lag, 18 15 with 7 stages); 8-18 dense only; 19, 20: gemm_ws for
// grouped products (a block per tile, persistent; AUTO takes MM_GPU_WS_GROUPED's, default
// 25, from 128 rows per expert; dense products take 13, 14 for them); 21-23: 20 with the y rows
// loaded once per tile, + m64n32/m64n64 wgmmas for tiles of <= 32/64 rows, + tiles published
// by the producer warp; 25: 23 with the outputs stored through shared memory by bulk copies (4
// stages); 27: 25 for products of <= 16 k stages,
// 23 for longer ones (grouped only; dense take 14). Same bits in all. 7: a
// bench-only diagnostic without the proxy fence (racy; never for results). Process-wide.
void mm_gpu_set_gemm_tile(int variant);
// (28: gemm_ws persistent, dense, m64n32 / m64n64 wgmmas for tiles of <= 32 / <= 64 rows, on the
// cached permuted W only (else 4); what mm_gpu_set_ws_small's modes pick. 29: the same on
// 64-token tiles with 9 stages; 30: 29 on 64-output tiles, each warpgroup on 32 tokens.)
// mm_gpu_set_ws_small: dense bf16 products of 9..127 rows (batch decode's LM head and q/k/v):
// 0 as before (GEMV v2, else gemm_wg 4 eagerly and the mma.sync tiles inside recorded graphs);
// 1 those that took 4 or the mma.sync tiles on gemm_ws 28, eagerly and inside graphs; 2
// (default; env MM_GPU_WS_SMALL) also those GEMV v2 took, from 16 tiles of 128 outputs; -1 back
// to the environment's choice. Same bits. Process-wide. mm_gpu_ws_small_launches(v) counts
// variant v's (28, 29, 30) launches (recorded ones when they are recorded).
void mm_gpu_set_ws_small(int mode);
// mm_gpu_set_ws_small_bn64: 1 runs those of <= 64 rows as variant 29 (64-token tiles, 9
// stages), 0 as 28, -1 the environment's MM_GPU_WS_SMALL_BN64 (default 1). Same bits.
void mm_gpu_set_ws_small_bn64(int on);
// mm_gpu_set_ws_small_half: 1 runs those of fewer than 132 tiles of 128 outputs as variant 30
// (64-output tiles, each warpgroup on half the tokens), 0 as 29, -1 the environment's
// MM_GPU_WS_SMALL_HALF (default 1). Same bits.
void mm_gpu_set_ws_small_half(int on);
unsigned long long mm_gpu_ws_small_launches(int variant);
// mm_gpu_set_segsplit: 1 lets AUTO run dense bf16 products of 9..64 rows with fewer than 132
// tiles of 128 outputs (batch decode's q/k/v, o_proj, router) on MM_GPU_PATH_SEG, 0 not, -1 the
// environment's MM_GPU_SEGSPLIT (default 1). Same bits. mm_gpu_segsplit_launches counts its
// products (recorded ones when they are recorded).
void mm_gpu_set_segsplit(int on);
unsigned long long mm_gpu_segsplit_launches(void);
// mm_gpu_wperm_epoch moves whenever a permuted-W copy is dropped (a weight written or freed,
// the bound lowered): graphs recorded before may point at it (variants 28-30), so the backend
// replays only graphs recorded in the current epoch.
unsigned long long mm_gpu_wperm_epoch(void);
// mm_gpu_stream_forget frees what matmul.cu keeps per stream (the x buffer of variant 28, which
// recorded graphs use); call it once the stream has drained, before destroying it.
void mm_gpu_stream_forget(void *stream);
// mm_gpu_set_prefill_fuse: 1 (default; env MM_GPU_PF_FUSE=0 starts it at 0) converts gemm_ws's x
// a warp per row and lets mm_gpu_moe_matmul_rows take grouped prefill products (>= 128 rows per
// expert) on gemm_ws with its gather, SwiGLU and scatter inside; 0: the earlier conversion, and
// those products MM_EUNSUPP (the model then gathers, runs SwiGLU and scatters as ops). Same bits;
// -1: back to the environment's choice. Process-wide; CUDA only.
void mm_gpu_set_prefill_fuse(int on);

// Permuted-W cache (matmul.cu): gemm_ws keeps each weight's permuted copy on the device (dense
// W; grouped: all experts of a device pointer table), built on first use, up to
// MM_GPU_WPERM_MB MiB (default 10% of device memory; 0: off). mm_gpu_wperm_forget drops the
// copies of weights (or tables) overlapping [d_ptr, d_ptr + n_bytes); n_bytes 0: the whole
// allocation d_ptr is in. Whoever writes or frees device memory that may hold a weight or an
// expert table calls it first (the backend's host-to-device copies and buffer_free,
// mm_gpu_free and mm_gpu_memcpy_h2d do). mm_gpu_set_wperm_mb sets the bound (-1: MM_GPU_WPERM_MB / default again; 0 also drops
// every copy); mm_gpu_wperm_bytes is the memory the copies hold. Thread-safe.
void mm_gpu_wperm_forget(const void *d_ptr, size_t n_bytes);
void mm_gpu_set_wperm_mb(long long mb);
size_t mm_gpu_wperm_bytes(void);

// ---- row ops (kernels.h semantics; d_err: device error word set on bad indices) -----------
mm_err mm_gpu_rmsnorm(void *stream, const mm_weight *w, float eps, const float *d_x, int64_t xs,
                      float *d_y, int64_t ys, int64_t n_rows);
// mm_gpu_add_rmsnorm: kernels.h add_rmsnorm (h += a, then y = rmsnorm(h), the two launches'
// bits) in one launch, a block per row (rows longer than 8192: the two launches).
mm_err mm_gpu_add_rmsnorm(void *stream, const float *d_a, int64_t as, float *d_h, int64_t hs,
                          const mm_weight *w, float eps, float *d_y, int64_t ys, int64_t n_rows);
mm_err mm_gpu_rope(void *stream, const struct mm_rope_args *a);
mm_err mm_gpu_kv_store(void *stream, const struct mm_kv_store_args *a, int *d_err);
mm_err mm_gpu_attention(void *stream, const struct mm_attn_args *a, int *d_err);
// mm_gpu_set_attention_wide: decode-sized attention (<= 264 (row, head) blocks) loads a
// 128-dim key and a 128-key chunk's values in one round each (on), or in 2 and 4 rounds
// (default; env MM_GPU_ATT_WIDE=1 turns it on at backend open). Same bits. Process-wide.
void mm_gpu_set_attention_wide(int on);
// mm_gpu_set_attention_prefill: 0 the decode kernel for every call, 1 (default unless
// MM_GPU_ATT_PREFILL=0) the prefill kernel (K/V chunks in shared memory for 64 (row, head)
// units) from 128 rows, 2 the prefill kernel for every call it can take. Same bits in every
// mode. Process-wide.
void mm_gpu_set_attention_prefill(int mode);
mm_err mm_gpu_embed(void *stream, const mm_weight *t, const int32_t *d_ids, int64_t n_rows,
                    float *d_out, int64_t os, int *d_err);
mm_err mm_gpu_swiglu(void *stream, const float *d_g, int64_t gs, const float *d_u, int64_t us,
                     float *d_o, int64_t os, int64_t n_rows, int64_t dim);
mm_err mm_gpu_route(void *stream, const struct mm_route_params *p, const float *d_logits,
                    int64_t ls, int64_t n_rows, int32_t *d_ids, float *d_weights);
mm_err mm_gpu_axpy(void *stream, const float *d_alpha, const float *d_x, int64_t xs, float *d_y,
                   int64_t ys, int64_t n_rows, int64_t dim);
mm_err mm_gpu_sigmoid(void *stream, float *d_x, int64_t n);
mm_err mm_gpu_copy_rows(void *stream, const float *d_src, int64_t ss, const int32_t *d_si,
                        float *d_dst, int64_t ds, const int32_t *d_di, int64_t n_rows, int64_t dim,
                        int *d_err);
mm_err mm_gpu_fill(void *stream, float *d_x, float v, int64_t n);
// mm_gpu_argmax: greedy sampling, d_ids[i] = argmax of row i of d_logits (n_rows, vocab) with
// row stride ls; ties to the lower id, NaN never chosen (an all-NaN row gives 0).
mm_err mm_gpu_argmax(void *stream, const float *d_logits, int64_t ls, int64_t n_rows, int vocab,
                     int32_t *d_ids);
// mm_gpu_argmax_ws: the same result from many blocks per row (one pass; each block's best
// (value, id) meets the others' in a 64-bit atomic max, the row's last block writes the id).
// d_ws: MM_GPU_ARGMAX_WS_BYTES(ws_rows) bytes of device memory, zero before the first call;
// every call leaves it zero again. Calls that share d_ws must be ordered (one stream). More
// rows than ws_rows run in several launches.
#define MM_GPU_ARGMAX_WS_BYTES(ws_rows) ((size_t)(ws_rows) * 12u)
mm_err mm_gpu_argmax_ws(void *stream, const float *d_logits, int64_t ls, int64_t n_rows,
                        int vocab, int32_t *d_ids, void *d_ws, int ws_rows);
// mm_gpu_fetch_copy: one small launch (a programmatic dependent of the kernel before it) that
// copies n bytes of device memory d_src to h_dst and the device word *d_err to *h_err, both
// pinned host memory written from the device (unified addressing), so a result leaves without
// a copy-engine operation. n <= 65536.
mm_err mm_gpu_fetch_copy(void *stream, void *h_dst, const void *d_src, size_t n, const int *d_err,
                         int *h_err);
// mm_gpu_route_plan: the grouped product's plan from route's ids/weights (kernels.h
// route_plan), one launch (one block, or many from 2048 slots: route_plan.cu); d_wt may be
// NULL (then d_weights may be too). Out-of-range ids count as expert 0 and set d_err.
// n_experts <= 4096.
mm_err mm_gpu_route_plan(void *stream, const int32_t *d_ids, const float *d_weights,
                         int64_t n_rows, int top_k, int n_experts, int32_t *d_offs,
                         int32_t *d_src_row, int32_t *d_dst_slot, float *d_wt, int *d_err);
// mm_gpu_combine: kernels.h combine (rank-ordered weighted sum + shared + residual, the axpy
// sequence's bits) in one launch.
mm_err mm_gpu_combine(void *stream, const float *d_alpha, int k, const float *d_x, int64_t xs,
                      const float *d_shared, int64_t ss, float *d_h, int64_t hs, int64_t n_rows,
                      int64_t dim);
// mm_gpu_head_norm_rope: kernels.h head_norm_rope (per-head rmsnorm then rope of q and k
// heads in place, the separate launches' bits) in one launch.
mm_err mm_gpu_head_norm_rope(void *stream, float *d_x, int64_t n_rows, int64_t stride, int n_a,
                             int n_b, int64_t b_off, int head_dim, const mm_weight *wa,
                             const mm_weight *wb, float eps, const struct mm_rope_args *ra);

// mm_gpu_head_norm_rope_kv: kernels.h head_norm_rope_kv (head_norm_rope, then kv_store of st)
// in one launch when st's keys are x's group b (the fused q/k/v layout), else the two.
mm_err mm_gpu_head_norm_rope_kv(void *stream, float *d_x, int64_t n_rows, int64_t stride,
                                int n_a, int n_b, int64_t b_off, int head_dim,
                                const mm_weight *wa, const mm_weight *wb, float eps,
                                const struct mm_rope_args *ra, const struct mm_kv_store_args *st,
                                int *d_err);
// mm_gpu_route_with_plan: kernels.h route_with_plan (route, then route_plan of its ids and
// weights) in one launch: a block per row routes it, the last block to finish plans (from
// 2048 slots: route, then mm_gpu_route_plan's parallel plan in a second launch).
// d_count: one device word, zero before the first call; each call leaves it zero. Calls that
// share it must be ordered (one stream). Same bits as mm_gpu_route then mm_gpu_route_plan.
mm_err mm_gpu_route_with_plan(void *stream, const struct mm_route_params *p,
                              const float *d_logits, int64_t ls, int64_t n_rows, int32_t *d_ids,
                              float *d_weights, int32_t *d_offs, int32_t *d_src_row,
                              int32_t *d_dst_slot, float *d_wt, int *d_err, unsigned *d_count);
// mm_gpu_embed_rmsnorm: kernels.h embed_rmsnorm (embed, then y = rmsnorm(out)) in one launch,
// a block per row (rows longer than 8192: the two launches).
mm_err mm_gpu_embed_rmsnorm(void *stream, const mm_weight *t, const int32_t *d_ids,
                            int64_t n_rows, float *d_out, int64_t os, const mm_weight *w,
                            float eps, float *d_y, int64_t ys, int *d_err);
// mm_gpu_combine_rmsnorm: kernels.h combine_rmsnorm (combine, then y = rmsnorm(h)) in one
// launch, a block per row (rows longer than 8192: the two launches).
mm_err mm_gpu_combine_rmsnorm(void *stream, const float *d_alpha, int k, const float *d_x,
                              int64_t xs, const float *d_shared, int64_t ss, float *d_h,
                              int64_t hs, int64_t n_rows, const mm_weight *w, float eps,
                              float *d_y, int64_t ys);

// ---- inter-process memory and events (kernels/cuda/ipc.cu; the cudaipc:// transport) ----------
// Handles are opaque MM_GPU_IPC_HANDLE_BYTES blobs to ship to another process of the same host.
#define MM_GPU_IPC_HANDLE_BYTES 64
// mm_gpu_ipc_mem_export writes the handle of d_ptr (the base of a mm_gpu_alloc buffer).
mm_err mm_gpu_ipc_mem_export(const void *d_ptr, void *handle);
// mm_gpu_ipc_mem_open maps another process's exported buffer; *d_out is released with
// mm_gpu_ipc_mem_close (accepts NULL). Peer access is enabled lazily for another device.
mm_err mm_gpu_ipc_mem_open(const void *handle, void **d_out);
void mm_gpu_ipc_mem_close(void *d_ptr);
// mm_gpu_ipc_event_new returns an owned interprocess event (mm_gpu_event_free) and its handle;
// mm_gpu_ipc_event_open opens another process's (also freed with mm_gpu_event_free).
mm_err mm_gpu_ipc_event_new(void **ev, void *handle);
mm_err mm_gpu_ipc_event_open(const void *handle, void **ev);
void mm_gpu_event_free(void *ev);
// record ev on stream; make stream wait for ev's latest record (enqueue only, never block).
mm_err mm_gpu_event_record(void *ev, void *stream);
mm_err mm_gpu_stream_wait_event(void *stream, void *ev);
mm_err mm_gpu_event_sync(void *ev); // blocks until ev's latest record has run
// Frame flags (the cudaipc transport, common/transport/cudaipc.c): a u32 in device memory (an
// IPC-mapped one of another process on this GPU included) that one stream writes after the work
// it orders, and another's stream waits for, enqueued possibly before the write (on the H200
// under MPS a waiting stream wakes ~4 us after such a write, ~13 us after an interprocess
// event's record: docs/BENCHMARKS.md "Frame flags"). mm_gpu_flags_ok:
// the build and the driver have them (CUDA: cuStreamWaitValue32 / cuStreamWriteValue32 through
// the runtime's driver entry points; HIP: not yet); MM_CUDAIPC_FLAGS=0 says no.
// mm_gpu_flag_write: *d_flag = v once the stream's earlier work is done (and visible);
// mm_gpu_flag_wait: the stream waits until (int32_t)(*d_flag - v) >= 0 (a cyclic compare, so
// the sequence may wrap): with spin, by a one-thread kernel polling the word that lets the
// stream's next kernel launch once it has its value (~2.3 us from the write to that kernel's
// start against ~3.9 behind cuStreamWaitValue32, H200 under MPS, at the cost of a launch: the
// caller picks it for latency-bound frames); mm_gpu_flag_set: *d_flag = v now, from the host, by a stream of its
// own (not behind the callers' streams, which may be waiting for it): releases a wait whose
// writer died.
bool mm_gpu_flags_ok(void);
mm_err mm_gpu_flag_write(void *stream, void *d_flag, uint32_t v);
mm_err mm_gpu_flag_wait(void *stream, const void *d_flag, uint32_t v, bool spin);
mm_err mm_gpu_flag_set(void *d_flag, uint32_t v);

// mm_gpu_memcpy_any: stream-ordered copy between any device pointers (also IPC-mapped ones of
// another device: a peer copy).
mm_err mm_gpu_memcpy_any(void *stream, void *d_dst, const void *d_src, size_t n_bytes);
// The PCI bus id of device dev (identifies a GPU across processes), and the calling thread's
// current device.
mm_err mm_gpu_device_pci_id(int dev, char id[32]);
mm_err mm_gpu_current_device(int *dev);
// mm_gpu_backend_stream: the stream and device of a GPU backend context (mm_backend.ctx of a
// "cuda:N"/"hip:N" backend; kernels/cuda/backend.cu), so that a transport can order its copies
// with the backend's ops.
mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev);
// mm_gpu_optime_report: with MM_GPU_OPTIME=1 the backend times every op (backend.cu); this
// prints the table so far to stderr and starts a new one. No effect otherwise.
void mm_gpu_optime_report(void *backend_ctx);

#ifdef __cplusplus
}
#endif
#endif
