// SPDX-License-Identifier: MIT
// The router's per-layer device chain of the routing plan (docs/MESH.md "Device frames"),
// issued op by op: before the owners (FFN norm, router product, route and plan, the owners'
// shares) and after them (pick, combine).
// Used by step.c's plan_layer; backend ops only between the hops (no set, get or synchronize).
#ifndef MM_ROUTER_STEP_DEV_H
#define MM_ROUTER_STEP_DEV_H

#include <stdbool.h>
#include <stdint.h>

#include "mm/err.h"
#include "mm/model.h"

// GPU entry points of the plan (kernels/cuda/mesh_ops.cu), weak: NULL in a build without GPU
// support (then the router has no plan mode and never calls mm_step_dev_*).
#define MM_STEP_DEV_WEAK __attribute__((weak))
extern mm_err mm_gpu_mesh_plan_split(void *stream, const int32_t *d_offs, const int32_t *d_src,
                                     const int32_t *d_dst, const int32_t *d_owner_of,
                                     int n_experts, int n_slots, int n_owners, int32_t *d_out,
                                     int64_t out_stride) MM_STEP_DEV_WEAK;
// the most owners mm_gpu_mesh_plan_split_to takes (mesh_ops.cu SPLIT_MAX_OWNERS)
#define MM_STEP_DEV_MAX_FRAMES 16
extern mm_err mm_gpu_mesh_plan_split_to(void *stream, const int32_t *d_offs,
                                        const int32_t *d_src, const int32_t *d_dst,
                                        const int32_t *d_owner_of, int n_experts, int n_slots,
                                        int n_owners, const float *d_x, int64_t x_rows, int dim,
                                        float *const *d_frames) MM_STEP_DEV_WEAK;
extern mm_err mm_gpu_mesh_pick(void *stream, const float *d_ys, int64_t ys_owner_rows,
                               const int32_t *d_ids, const int32_t *d_owner_of, int n_slots,
                               int dim, float *d_eo) MM_STEP_DEV_WEAK;
#undef MM_STEP_DEV_WEAK

// One MoE layer's device chain on R rows (the router's buffers and scratch; h, x and eo may
// point into a link's ring).
typedef struct mm_step_dev_layer {
    const mm_model *m;
    mm_model_scratch *s;
    void *stream;            // the backend's stream (the mesh ops take it)
    int L;
    int64_t R, nk;           // rows, slots (R x top_k)
    int E, N;                // experts, owners
    float *h, *x;            // (R, D) hidden state, FFN-normed rows (x then the shares)
    const int32_t *of;       // (E) serving owner of each expert, device
    int32_t *shares;         // owners' shares of the plan (owner o at + o * stride)
    int64_t stride;
    float *const *frames;    // several owners (MM_MESH_OWNER_FRAMES): owner o's frame in its
                             // ring (x rows, then its share) or NULL; the split writes them
                             // (mm_gpu_mesh_plan_split_to); NULL: shares at shares + o * stride
    int32_t *plan_at;        // one serving owner: its share's place, where the plan is made
                             // (no split: the share of the owner of every expert is the plan);
                             // NULL: plan in the scratch, then split
    // after the owners
    bool one;                // one serving owner: its reply is in eo already
    const float *ysn;        // several: owner o's reply at ysn + o * ysn_rows * D
    int64_t ysn_rows;
    float *eo;               // (nk, D) expert output of every (row, rank) slot
    const float *sh;         // shared experts' output (NULL: none)
    float *xn_next;          // non-NULL: the combine also writes the next layer's input norm of
                             // h here (mm_model_combine_plan_next)
    // out
    mm_model_plan pl;        // the plan's buffers (valid after route)
    bool normed;             // x holds the FFN norm (route got that far)
    const char *failed;      // the stage that failed (for the error text)
} mm_step_dev_layer;

// mm_step_dev_route: x = FFN norm of h, then the gate, route and plan (mm_model_gate_plan) and
// every owner's share (mm_gpu_mesh_plan_split), or the plan made at plan_at (one serving owner). MM_EUNSUPP: the model has no device path (x
// is made; the plan is not).
mm_err mm_step_dev_route(mm_step_dev_layer *a);
// mm_step_dev_combine: each slot's row from its owner's reply (several owners), then combine
// with the plan's weights into h (mm_model_combine_plan).
mm_err mm_step_dev_combine(mm_step_dev_layer *a);

#endif
