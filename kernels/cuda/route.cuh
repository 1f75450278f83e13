// SPDX-License-Identifier: MIT
// The routing steps (kernels.h route) as device functions, so that the one-warp route kernel
// (ops.cu) and the route + plan kernel (route_plan.cu) run the same source for every rounded
// operation: the scores (softmax or sigmoid, warp 0, lane-strided sums and a butterfly), the
// bias, the group limit (lane 0), the K picks, the renorm and scale (lane 0, in rank order).
//
// Design notes:
// - route_pick_serial picks the K experts one after the other (a warp argmax over the
//   untaken experts per pick), route_pick_rank all at once: each thread counts, for its
//   experts, how many experts rank before them (higher choice score, then lower id); rank
//   r < K is pick r. `better` is a strict total order unless a choice score is NaN, so both
//   give the same ids then; with a NaN score the serial scan's result depends on its order,
//   and callers take route_pick_serial for that row (route_warp_nan).
// - Only the picks differ between the two; the weights are prob[id] in pick order, then the
//   same lane-0 renorm and scale (route_finish), so the bits are the same.
#ifndef MM_GPU_ROUTE_CUH
#define MM_GPU_ROUTE_CUH

#include "gpu_common.cuh"
#include "kernels.h"

#define ROUTE_MAX_EXPERTS 1024

// a ranks before b: higher score, then lower id
__device__ __forceinline__ bool better(float sa, int a, float sb, int b) {
    return sa > sb || (sa == sb && a < b);
}

// Warp argmax of (score, id) pairs; id -1 means none. Every lane gets the winner.
__device__ __forceinline__ void warp_best(float &s, int &id) {
#pragma unroll
    for (int m = MM_WARP_SIZE / 2; m > 0; m >>= 1) {
        const float os = mm_shfl_xor(s, m);
        const int oid = mm_shfl_xor(id, m);
        if (oid >= 0 && (id < 0 || better(os, oid, s, id))) {
            s = os;
            id = oid;
        }
    }
}

// The route parameters a GPU routing kernel takes (shared memory per row, group rule limits).
static inline bool route_params_ok(const struct mm_route_params *p) {
    const int E = p->n_experts, K = p->top_k;
    if (E <= 0 || E > ROUTE_MAX_EXPERTS || K <= 0 || K > E ||
        (p->score != MM_ROUTE_SOFTMAX && p->score != MM_ROUTE_SIGMOID))
        return false;
    return !(p->n_group > 1 && (E % p->n_group || p->n_group > 64 || p->topk_group <= 0 ||
                                p->topk_group > p->n_group || E / p->n_group < 2));
}

// Shared memory of one row's routing: prob (E) f32, choice (E) f32, wk (K) f32 (the picked
// weights until final), taken (E) bytes.
static inline size_t route_shmem_bytes(int E, int K) {
    return (size_t)(2 * E + K) * sizeof(float) + (size_t)E;
}

// Warp 0's part: prob and choice of every expert, taken cleared. Lane-strided loops and the
// warp's butterflies fix the order of the softmax's max and sum. The caller then meets at a
// barrier before route_groups / the picks.
__device__ __forceinline__ void route_scores(const struct mm_route_params &p, const float *l,
                                             float *prob, float *choice, unsigned char *taken,
                                             int lane) {
    const int E = p.n_experts;
    if (p.score == MM_ROUTE_SOFTMAX) {
        float mx = -INFINITY;
        for (int e = lane; e < E; e += MM_WARP_SIZE)
            mx = fmaxf(mx, l[e]);
        mx = mm_warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < E; e += MM_WARP_SIZE) {
            prob[e] = expf(l[e] - mx);
            sum += prob[e];
        }
        sum = mm_warp_sum(sum);
        for (int e = lane; e < E; e += MM_WARP_SIZE)
            prob[e] /= sum;
    } else {
        for (int e = lane; e < E; e += MM_WARP_SIZE)
            prob[e] = 1.0f / (1.0f + expf(-l[e]));
    }
    for (int e = lane; e < E; e += MM_WARP_SIZE) {
        choice[e] = p.bias ? prob[e] + p.bias[e] : prob[e];
        taken[e] = 0;
    }
}

// Group scores (sum of the two best choice scores) then the kept groups, on one thread: G is
// small (8 for DeepSeek V3) and the rule must match the CPU's exactly. n_group > 1 only.
__device__ __forceinline__ void route_groups(const struct mm_route_params &p, float *choice) {
    const int E = p.n_experts, G = p.n_group, per = E / G;
    float gs[64];
    bool keep[64];
    for (int g = 0; g < G; g++) {
        const float *c = choice + g * per;
        int b0 = 0;
        for (int i = 1; i < per; i++)
            if (better(c[i], i, c[b0], b0))
                b0 = i;
        int b1 = b0 == 0 ? 1 : 0;
        for (int i = 0; i < per; i++)
            if (i != b0 && better(c[i], i, c[b1], b1))
                b1 = i;
        gs[g] = c[b0] + c[b1];
        keep[g] = false;
    }
    for (int t = 0; t < p.topk_group; t++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || better(gs[g], g, gs[best], best)))
                best = g;
        keep[best] = true;
    }
    for (int e = 0; e < E; e++)
        if (!keep[e / per])
            choice[e] = 0.0f;
}

// Who runs a pick step and its barrier: the whole block (G::first(lane) threadIdx.x, stride
// blockDim.x, __syncthreads), or one warp alone (route_plan.cu's route_warp_group).
struct route_block_group {
    __device__ static unsigned first(int) { return threadIdx.x; }
    __device__ static unsigned stride() { return blockDim.x; }
    __device__ static void sync() { __syncthreads(); }
};

// The K picks one at a time by one warp (active; threads that pass active false only meet
// the barriers), G::sync() after each pick (with the block's barrier every thread of the block
// must reach it). ids_out (K) gets the ids.
template <class G>
__device__ __forceinline__ void route_pick_serial_by(const struct mm_route_params &p,
                                                     const float *prob, const float *choice,
                                                     unsigned char *taken, float *wk,
                                                     int32_t *ids_out, bool active, int lane) {
    const int E = p.n_experts, K = p.top_k;
    for (int t = 0; t < K; t++) {
        if (active) {
            float bs = 0.0f;
            int bid = -1;
            for (int e = lane; e < E; e += MM_WARP_SIZE)
                if (!taken[e] && (bid < 0 || better(choice[e], e, bs, bid))) {
                    bs = choice[e];
                    bid = e;
                }
            warp_best(bs, bid);
            if (lane == 0) {
                taken[bid] = 1;
                ids_out[t] = bid;
                wk[t] = prob[bid];
            }
        }
        G::sync();
    }
}

// by warp 0 of the block (the other warps pass active false)
__device__ __forceinline__ void route_pick_serial(const struct mm_route_params &p,
                                                  const float *prob, const float *choice,
                                                  unsigned char *taken, float *wk,
                                                  int32_t *ids_out, bool active, int lane) {
    route_pick_serial_by<route_block_group>(p, prob, choice, taken, wk, ids_out, active, lane);
}

// Warp 0 after route_scores (each lane reads back the choice scores it wrote): 1 on every
// lane when some choice score is NaN (then the picks must be route_pick_serial's; the group
// limit only turns scores into 0, so checking before it is safe).
__device__ __forceinline__ int route_warp_nan(const struct mm_route_params &p, const float *choice,
                                              int lane) {
    int nan = 0;
    for (int e = lane; e < p.n_experts; e += MM_WARP_SIZE)
        nan |= isnan(choice[e]) ? 1 : 0;
#pragma unroll
    for (int m = MM_WARP_SIZE / 2; m > 0; m >>= 1)
        nan |= mm_shfl_xor(nan, m);
    return nan;
}

// The K picks at once: G's threads each rank their experts against all E (see the notes).
// ids_sh (K, shared) gets the ids; wk the weights. Ends with G::sync(). No NaN choice score.
template <class G>
__device__ __forceinline__ void route_pick_rank_by(const struct mm_route_params &p,
                                                   const float *prob, const float *choice,
                                                   float *wk, int32_t *ids_sh, int lane) {
    const int E = p.n_experts, K = p.top_k;
    for (int e = G::first(lane); e < E; e += G::stride()) {
        const float ce = choice[e];
        int rank = 0;
        if ((E & 3) == 0) { // choice is 16-byte aligned (route_shmem_bytes' layout)
            const float4 *c4 = (const float4 *)choice;
#pragma unroll 4
            for (int j4 = 0; j4 < E / 4; j4++) {
                const float4 c = c4[j4];
                rank += better(c.x, 4 * j4, ce, e);
                rank += better(c.y, 4 * j4 + 1, ce, e);
                rank += better(c.z, 4 * j4 + 2, ce, e);
                rank += better(c.w, 4 * j4 + 3, ce, e);
            }
        } else {
            for (int j = 0; j < E; j++)
                rank += better(choice[j], j, ce, e);
        }
        if (rank < K)
            ids_sh[rank] = e;
    }
    G::sync();
    for (int t = G::first(lane); t < K; t += G::stride())
        wk[t] = prob[ids_sh[t]];
    G::sync();
}

// by the whole block
__device__ __forceinline__ void route_pick_rank(const struct mm_route_params &p,
                                                const float *prob, const float *choice,
                                                float *wk, int32_t *ids_sh) {
    route_pick_rank_by<route_block_group>(p, prob, choice, wk, ids_sh, 0);
}

// The renorm's divisor: the K picked weights wk summed in pick order, plus renorm_eps.
__device__ __forceinline__ float route_wsum(const struct mm_route_params &p, const float *wk) {
    float sum = 0.0f;
    for (int t = 0; t < p.top_k; t++)
        sum += wk[t];
    return sum + p.renorm_eps;
}

// One picked weight v finished: divided by sum (route_wsum) with renorm, then scaled.
__device__ __forceinline__ float route_wfinish(const struct mm_route_params &p, float v, float sum) {
    if (p.renorm)
        v /= sum;
    if (p.scale != 1.0f && p.scale != 0.0f)
        v *= p.scale;
    return v;
}

// The whole block: route_finish's renorm and scale (the sum on thread 0, then each weight's
// division and scale on its own thread: the same operations per weight), written to w (K).
// sum_sh: one float of shared memory. Starts and ends with a barrier.
__device__ __forceinline__ void route_finish_block(const struct mm_route_params &p, float *wk,
                                                   float *w, float *sum_sh) {
    __syncthreads(); // wk complete
    if (p.renorm && threadIdx.x == 0)
        *sum_sh = route_wsum(p, wk);
    __syncthreads();
    for (int t = threadIdx.x; t < p.top_k; t += blockDim.x)
        w[t] = route_wfinish(p, wk[t], p.renorm ? *sum_sh : 0.0f);
    __syncthreads();
}

// Lane 0: renorm and scale of the picked weights wk in pick order, written to w (K).
__device__ __forceinline__ void route_finish(const struct mm_route_params &p, const float *wk,
                                             float *w) {
    const float sum = p.renorm ? route_wsum(p, wk) : 0.0f;
    for (int t = 0; t < p.top_k; t++)
        w[t] = route_wfinish(p, wk[t], sum);
}

#endif
