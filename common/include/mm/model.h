// SPDX-License-Identifier: MIT
// A Hugging Face checkpoint (config.json + safetensors) as a model: its configuration, its
// weights bound to a backend, and the forward pass as separate *stages* that the in-process
// engine and the mesh daemons call alike, with exactly the same arithmetic.
//
// Families: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, glm4_moe, and the dense qwen3 / qwen2
// (draft models). Math follows transformers 5.17 (the fixtures' reference), in f32 from the
// checkpoint's bf16/f16/f32 weights.
//
// Design notes:
// - One layer is: h += attn(input_norm(h))        mm_model_attn_forward (KV in an mm_kv_cache)
//                 x = post_attention_norm(h)       mm_model_ffn_norm
//   MoE layer:    ids, w = gate(x)                 mm_model_gate (per row: top-k ids + weights)
//                 y_e = expert_e(x rows)           mm_model_expert_forward (SwiGLU, any rows)
//                 s = shared experts(x)            mm_model_shared_forward (if any)
//                 h += combine                     mm_model_combine (rank order, then shared)
//   dense layer:  s = mlp(x); h += s               mm_model_shared_forward + mm_model_combine
//   end:          logits = lm_head(final_norm(h))  mm_model_final_norm + mm_model_head
//   mm_model_forward is just that loop; a daemon may run any stage for any subset of rows.
// - Batch invariance: every stage computes each row independently with the backend's fixed
//   reduction order, so a row's bits do not depend on the rows it shares a call with, on
//   n_rows, on the thread count or on which process ran the stage. combine sums in top-k rank
//   order (never arrival order): acc = w_0*y_0; acc += w_1*y_1; ...; acc += shared; h += acc.
// - Weights are views into the mmap'd checkpoint on host-memory backends (zero-copy for bf16;
//   an expert's pages are touched only when that expert runs); biases and the routing
//   correction bias are converted to small owned f32 arrays at open.
// - Memory: every activation pointer a stage takes is backend memory of the model's backend
//   (host memory on the CPU backend), f32 row-major with rows d_model apart unless stated.
//   Stages allocate nothing: they use the caller's mm_model_scratch, sized at start.
// - Threading: an mm_model is immutable after open and may be shared by threads; each thread
//   needs its own scratch, and backend calls must be serialised per backend object.
#ifndef MM_MODEL_H
#define MM_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels.h"
#include "mm/err.h"
#include "mm/kv_cache.h"

#define MM_MODEL_MAX_LAYERS 256

enum mm_arch {
    MM_ARCH_QWEN3_MOE = 0,
    MM_ARCH_QWEN2_MOE,
    MM_ARCH_MIXTRAL,
    MM_ARCH_DEEPSEEK_V3,
    MM_ARCH_GLM4_MOE,
    MM_ARCH_QWEN3,
    MM_ARCH_QWEN2,
};

typedef struct mm_model_config {
    enum mm_arch arch;
    char model_type[32];     // config.json model_type ("qwen3_moe")
    int vocab;               // vocab_size
    int d_model;             // hidden_size
    int n_layers;
    int n_heads, n_kv_heads;
    int head_dim;            // q/k head dim (MLA: qk_nope + qk_rope)
    int head_dim_v;          // v head dim (== head_dim except MLA)
    float eps;               // rms_norm_eps
    bool tie_embeddings;
    int max_pos;             // max_position_embeddings
    int bos_id, eos_id;      // -1 when null

    // attention
    bool qk_norm;            // per-head RMSNorm on q and k (Qwen3, GLM use_qk_norm)
    bool qkv_bias;           // bias on q/k/v projections (Qwen2, GLM attention_bias)
    int window;              // sliding window (0 = none)
    float attn_scale;        // softmax scale
    // MLA (deepseek_v3)
    bool mla;
    int q_lora_rank;         // 0: plain q_proj
    int kv_lora_rank, qk_nope, qk_rope, v_head_dim;

    // rope
    enum mm_rope_style rope_style;
    int rot_dim;             // rotated dims per head (partial rotary, MLA rope part)
    int rot_offset;          // first rotated dim in a head (MLA: qk_nope)
    float rope_theta;
    float rope_mscale;       // cos/sin factor (yarn attention_factor)
    float inv_freq[256];     // (rot_dim/2) f32

    // FFN / MoE
    int d_ff;                // dense MLP intermediate_size
    int n_experts;           // routed experts (0: dense model)
    int top_k;
    int d_ff_expert;         // moe_intermediate_size
    int d_ff_shared;         // shared expert(s) total intermediate (0: none)
    bool shared_gate;        // Qwen2-MoE sigmoid(shared_expert_gate(x)) on the shared output
    struct mm_route_params route; // .bias is per layer: see mm_model_gate
    bool e_bias;             // e_score_correction_bias present
    bool layer_moe[MM_MODEL_MAX_LAYERS]; // layer i is an MoE layer
} mm_model_config;

typedef struct mm_model mm_model;

// mm_model_config_read parses dir/config.json into *cfg. Errors name the file and the key:
// MM_ENOENT (no config.json), MM_EFORMAT (bad JSON / missing key / bad value), MM_EUNSUPP
// (unknown architecture or an option this code does not implement, e.g. a quantization
// config, a hidden_act other than silu, an unknown rope_type).
mm_err mm_model_config_read(const char *dir, mm_model_config *cfg, char err[MM_ERRLEN]);

// mm_model_open reads the config and binds every weight of dir's checkpoint to be (borrowed;
// it must outlive the model). Every tensor is checked for presence, shape and dtype.
// Returns owned *out (mm_model_close). Errors: as mm_model_config_read, plus the loader's
// (mm/safetensors.h) and MM_EFORMAT "FILE: tensor NAME has shape ..., expected ...".
mm_err mm_model_open(mm_model **out, const char *dir, mm_backend *be, char err[MM_ERRLEN]);
// mm_model_close releases the model; accepts NULL.
void mm_model_close(mm_model *m);
const mm_model_config *mm_model_cfg(const mm_model *m);
mm_backend *mm_model_backend(const mm_model *m);
// mm_model_weight_bytes: bytes of weights one decode token reads (attention, router, top_k
// routed + shared experts or dense MLP per layer, embedding row, final norm, LM head).
double mm_model_decode_bytes(const mm_model *m);
// mm_model_touch reads one byte of every 4 KiB page of every weight, so that later token
// steps take no page faults (an engine that will use all experts, and benchmarks; an expert
// daemon touches only its own experts by running them). Returns a checksum to keep the reads.
unsigned mm_model_touch(const mm_model *m);
// mm_model_kv_params fills the KV-cache geometry this model needs and the dtype its backend
// wants (kv_dtype: bf16 on CUDA's tensor-core contract, else f32; budget etc. left to caller).
void mm_model_kv_params(const mm_model *m, mm_kv_params *p);

// ---- scratch --------------------------------------------------------------------------------
typedef struct mm_model_scratch mm_model_scratch;
// mm_model_scratch_new sizes per-call scratch for up to max_rows rows per stage call.
// Returns owned *out. Errors: MM_ENOMEM, MM_EDEVICE.
mm_err mm_model_scratch_new(mm_model_scratch **out, const mm_model *m, int64_t max_rows,
                            char err[MM_ERRLEN]);
void mm_model_scratch_free(mm_model_scratch *s); // accepts NULL

// ---- stages (all return MM_EINVAL on bad arguments, e.g. n_rows > max_rows) ------------------
// Rows given to attention: row i belongs to KV sequence seq[i] at position pos[i] (host
// arrays). Positions of a sequence must be reserved in kv (mm_kv_cache_reserve) beforehand.
typedef struct mm_model_rows {
    int64_t n_rows;
    const int32_t *seq; // (n_rows,) host
    const int32_t *pos; // (n_rows,) host
} mm_model_rows;

// h (n, d_model) = embedding rows of ids (n,) host. MM_EINVAL for an id outside the vocab.
mm_err mm_model_embed(const mm_model *m, mm_model_scratch *s, const int32_t *ids, int64_t n,
                      float *h);
// h += o_proj(attention(input_norm(h))) for layer; stores the rows' K/V in kv first.
mm_err mm_model_attn_forward(const mm_model *m, mm_model_scratch *s, int layer, mm_kv_cache *kv,
                             const mm_model_rows *rows, float *h);
// mm_model_attn_forward out of place: out = h + o_proj(attention(input_norm(h))), the same bits
// as mm_model_attn_forward on a copy of h; h is not written (out may be h). xn: input_norm(h)
// made already (the router's combine made it: MM_MODEL_NORMED_FLAG), or NULL. On a backend with
// matmul_res the residual is added in o_proj's own epilogue (no add of its own, and no copy of
// h): a mesh shard writes its reply straight into the router's ring this way.
mm_err mm_model_attn_forward_to(const mm_model *m, mm_model_scratch *s, int layer,
                                mm_kv_cache *kv, const mm_model_rows *rows, float *h,
                                const float *xn, float *out);
// x = post_attention_layernorm(h), (n, d_model).
mm_err mm_model_ffn_norm(const mm_model *m, mm_model_scratch *s, int layer, const float *h,
                         int64_t n, float *x);
// Is layer an MoE layer (gate + experts), or a dense one (mm_model_shared_forward is its MLP)?
bool mm_model_layer_is_moe(const mm_model *m, int layer);
// Router: ids (n, top_k) int32 and weights (n, top_k) f32, both host, in rank order.
mm_err mm_model_gate(const mm_model *m, mm_model_scratch *s, int layer, const float *x,
                     int64_t n, int32_t *ids, float *weights);
// out (n, d_model) = down(silu(gate(x)) * up(x)) of routed expert `expert` of layer, for n
// contiguous rows x (n, d_model). Pure per row.
mm_err mm_model_expert_forward(const mm_model *m, mm_model_scratch *s, int layer, int expert,
                               const float *x, int64_t n, float *out);
// out (n, d_model) = the routed experts of layer on rows sorted by expert: expert e's rows are
// x rows [offs[e], offs[e+1]) (offs host, n_experts+1 int32, offs[0] == 0, offs[n_experts] ==
// n, non-decreasing). Each row's bits equal mm_model_expert_forward's for that row and expert.
// Uses the backend's grouped product (moe_matmul: 3 products for the whole layer) when it has
// one, else one expert at a time. The engine calls this; an owner may call either.
mm_err mm_model_experts_forward(const mm_model *m, mm_model_scratch *s, int layer,
                                const int32_t *offs, const float *x, int64_t n, float *out);
// Whether layer has a shared path: shared expert(s) on an MoE layer, the MLP on a dense one.
bool mm_model_layer_has_shared(const mm_model *m, int layer);
// out (n, d_model) = shared experts (times sigmoid gate for Qwen2-MoE) or the dense MLP.
mm_err mm_model_shared_forward(const mm_model *m, mm_model_scratch *s, int layer,
                               const float *x, int64_t n, float *out);
// h[i] += (sum over r < k, in r order, of weights[i*k + r] * expert_out[i*k + r]) + shared[i].
// expert_out (n*k, d_model) holds row i's rank-r expert output at row i*k + r; weights (n, k)
// host; shared (n, d_model) or NULL; k may be 0 (dense layer).
mm_err mm_model_combine(const mm_model *m, mm_model_scratch *s, int layer, float *h, int64_t n,
                        int k, const float *weights, const float *expert_out,
                        const float *shared);
// x = final norm(h), (n, d_model).
mm_err mm_model_final_norm(const mm_model *m, mm_model_scratch *s, const float *h, int64_t n,
                           float *x);
// logits (n, vocab) = lm_head(x).
mm_err mm_model_head(const mm_model *m, mm_model_scratch *s, const float *x, int64_t n,
                     float *logits);

// ---- the mesh on devices: a layer's routing plan kept on the device -------------------------
// (models whose backend has the engine's device path: route_plan and moe_matmul_dev; else
// these return MM_EUNSUPP and the host stages above serve.) The router plans, owners run the
// plan's rows, the router combines: no host read of the routing, and each row's bits are the
// engine's (the same ops as mm_model_forward's device path).
typedef struct mm_model_plan { // backend memory, in the scratch: valid until its next plan
    const int32_t *ids;  // (n, top_k) expert ids, rank order
    const int32_t *offs; // (n_experts + 1) first sorted slot of each expert (route_plan's)
    const int32_t *src;  // (n * top_k) x row of each sorted slot
    const int32_t *dst;  // (n * top_k) (row, rank) slot i * top_k + r of each sorted slot
    const float *wt;     // (top_k, n) the weights by rank (rank r's at wt + r * n)
} mm_model_plan;
// A plan frame, router -> expert owner (docs/MESH.md, "plan frames"): a CTRL frame {u32
// MM_MODEL_PLAN_MARK, u32 rows, u32 slots, u32 0}, then one device frame of the rows x rows
// (d_model floats each) followed by the owner's share of the plan, int32 offs (n_experts + 1),
// src and dst (slots each), packed into mm_model_plan_rows rows of d_model.
#define MM_MODEL_PLAN_MARK 0xFFFFFFFFu
// The same plan frame in one piece (the router's default; MM_MESH_PLAN_CTRL=1 sends the CTRL
// frame as before): the device frame alone, its header's flags MM_MODEL_PLAN_FLAG and aux the
// slots; rows = n_rows - mm_model_plan_rows(n_experts, slots, d_model).
#define MM_MODEL_PLAN_FLAG 0x1u
// A shard's rows frame whose header flags carry MM_MODEL_NORMED_FLAG holds 2 x its rows: h, then
// the layer's input norm of h (the router's combine made both: mm_model_combine_plan_next).
#define MM_MODEL_NORMED_FLAG 0x2u
static inline int64_t mm_model_plan_rows(int64_t n_experts, int64_t n_slots, int64_t d_model) {
    return (n_experts + 1 + 2 * n_slots + d_model - 1) / d_model;
}
// mm_model_gate_plan: mm_model_gate without the read-back: router product, route and
// route_plan of layer on x (n, d_model) on the device.
mm_err mm_model_gate_plan(const mm_model *m, mm_model_scratch *s, int layer, const float *x,
                          int64_t n, mm_model_plan *plan);
// mm_model_gate_plan with the plan's offs, src and dst written at `at` (backend memory, int32s:
// offs (n_experts + 1), src (n x top_k), dst (n x top_k), the plan frame's share layout) instead
// of the scratch; at NULL: mm_model_gate_plan. The same values.
mm_err mm_model_gate_plan_at(const mm_model *m, mm_model_scratch *s, int layer, const float *x,
                             int64_t n, int32_t *at, mm_model_plan *plan);
// mm_model_experts_plan: the routed experts of layer on n_slots plan slots (all backend
// memory): sorted slot p reads x row src[p] and its output goes to out row dst[p], expert e's
// slots being [offs[e], offs[e+1]). offs[n_experts] may be below n_slots (an owner's share of
// a plan): slots from offs[n_experts] on belong to no expert, and their out rows dst[p] may be
// written with unspecified values (src/dst entries there must still be valid rows). n_slots
// sizes the launches only (worst case), so no count has to come to the host. Each computed
// row has the bits of mm_model_expert_forward.
mm_err mm_model_experts_plan(const mm_model *m, mm_model_scratch *s, int layer,
                             const int32_t *offs, const float *x, const int32_t *src,
                             const int32_t *dst, int64_t n_slots, float *out);
// mm_model_combine_plan: mm_model_combine with the weights by rank in backend memory (a plan's
// wt): h[i] += sum over r < top_k of wt[r * n + i] * expert_out[i * top_k + r], then shared.
mm_err mm_model_combine_plan(const mm_model *m, mm_model_scratch *s, int layer, float *h,
                             int64_t n, const float *wt, const float *expert_out,
                             const float *shared);
// mm_model_combine_plan, then xn = layer + 1's input norm of the new h (one op where the backend
// has combine_rmsnorm, the same bits as the two): the router sends a lone shard both. xn NULL:
// mm_model_combine_plan.
mm_err mm_model_combine_plan_next(const mm_model *m, mm_model_scratch *s, int layer, float *h,
                                  int64_t n, const float *wt, const float *expert_out,
                                  const float *shared, float *xn);

// ---- the in-process engine -------------------------------------------------------------------
// mm_model_forward runs the whole model on n rows (ids host; rows as for attention) and writes
// logits (n, vocab) into logits (backend memory). Only the rows with want_logits == NULL or
// want_logits[i] get logits computed (the others' logits rows are left untouched); they are
// packed: logits row j is the j-th wanted row. Uses only the stage functions above.
// On a device backend with route_plan and moe_matmul_dev the step stays on the device (one
// copy of the inputs, routing planned there, no read-back); with graphs, a shape repeated in
// consecutive calls (decode) is recorded once and replayed. Same bits either way.
mm_err mm_model_forward(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv,
                        const mm_model_rows *rows, const int32_t *ids, const bool *want_logits,
                        float *logits);
// mm_model_scratch_graphs turns the recording/replay of steps on or off for scratch s (on
// only where the device path and the backend's graphs exist); returns whether it was on.
bool mm_model_scratch_graphs(mm_model_scratch *s, bool on);
// mm_model_argmax: greedy ids (n, host) of the first n rows of logits (backend memory, rows
// vocab apart; ties to the lower id), computed on the backend: n ints come back, not the
// logits. MM_EUNSUPP when the backend has no argmax (read the logits and pick on the host).
mm_err mm_model_argmax(const mm_model *m, mm_model_scratch *s, const float *logits, int64_t n,
                       int32_t *ids);

// ---- overlapped greedy decode (the engine's device path with argmax and fetch) ---------------
// A step is issued before the previous step's picks reach the host: mm_model_pick_async picks
// the greedy ids of logits' first n rows on the device, leaves them where the next step's ids
// go and starts their copy to the host (returns its ticket); mm_model_forward_next runs the
// next step with those ids (row i takes the pick of logits row i, n_rows <= the picks left)
// without waiting for them; mm_model_pick_wait(ticket) waits for that copy alone. Same bits as
// mm_model_argmax then mm_model_forward with the read ids. A bad index an op met before the
// picks' copy is mm_model_pick_wait's MM_EINVAL (the device's error word is then cleared, as get
// clears it). mm_model_can_overlap says whether m and s have it; the others are MM_EUNSUPP
// without it. Any mm_model_forward drops the picks left (mm_model_forward_next is then
// MM_EINVAL until the next mm_model_pick_async).
bool mm_model_can_overlap(const mm_model *m, const mm_model_scratch *s);
mm_err mm_model_pick_async(const mm_model *m, mm_model_scratch *s, const float *logits, int64_t n,
                           uint64_t *ticket);
mm_err mm_model_pick_wait(const mm_model *m, mm_model_scratch *s, uint64_t ticket, int32_t *ids);
mm_err mm_model_forward_next(const mm_model *m, mm_model_scratch *s, mm_kv_cache *kv,
                             const mm_model_rows *rows, const bool *want_logits, float *logits);
// mm_model_embed_picks: mm_model_embed of n rows whose ids are ids[] (host), except rows
// rows[k] (k < np), which take pick src[k] of those mm_model_pick_async left, read on the device
// (ids[rows[k]] must hold some id of the vocab, overwritten there): the mesh's router starts a step with it before the previous step's
// picks reach its host. ids NULL: row i takes pick i (np ignored). MM_EINVAL for a row or pick
// out of range, or fewer picks left than named.
mm_err mm_model_embed_picks(const mm_model *m, mm_model_scratch *s, const int32_t *ids, int64_t n,
                            const int32_t *rows, const int32_t *src, int64_t np, float *h);

#endif
