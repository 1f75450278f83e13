// SPDX-License-Identifier: MIT
// The grouped expert product's plan, made on the device from route's result (kernels.h
// route_plan): per-expert offsets, the sorted slot order (which x row each sorted slot reads,
// which (row, rank) slot it writes) and the rank-major weights combine reads. With it the
// engine's MoE layer needs no copy to the host, so a decode step runs without a drain. Also
// the fused combine (kernels.h combine): the rank-ordered weighted sum, the shared path and
// the residual in one launch instead of k + 3.
//
// Design notes:
// - One block does the whole plan (a decode step has n_rows * top_k = 8..2048 slots): a
//   shared-memory histogram, an exclusive scan over the block (n_experts <= PLAN_MAX_E), then
//   the slots in chunks of the block width; within a chunk a slot's rank among the earlier
//   slots of its expert is counted from a shared copy of the chunk's ids, so the order is
//   stable (slot order inside each expert), exactly the host counting sort's.
// - The plan only permutes rows: the products' bits do not depend on it (kernels.h
//   Exactness), but a stable order keeps the layout identical to the host path's anyway.
// - An id outside [0, n_experts) is counted as expert 0 (the plan stays well formed) and
//   sets the backend's error word.
// - From PLAN_PAR_MIN slots (prefill: 4096 rows x top-8 = 32768 slots, which the one block
//   above took ~350 us to plan on an H200) the plan is made by many blocks instead
//   (route_plan_par_kernel): block b owns a tile of consecutive slots; it counts every slot's
//   expert into two shared histograms (the slots before its tile, and the rest), scans the
//   totals over the experts (offs; block 0 writes them), and places its own slots in chunks
//   of the block width at offs[e] + (slots of e before the tile) + (earlier slots of e in the
//   tile): the stable counting sort's position, so the same plan to the bit as one block's.
//   Each block reads all ids (128 KB at 32768 slots, from L2), which needs no scratch memory
//   and no second pass. route_with_plan then routes in one launch (no arrival count, no last
//   block) and plans in a second. MM_GPU_ROUTE_PLAN_PAR=0 (or mm_gpu_set_route_plan_par(0))
//   keeps the one-block plan at every size; =N (N >= 2) takes the parallel plan from N slots.
//   H200, 04:47 UTC (ncu, base clocks): at 4096 rows x top-8 over 128 experts the route +
//   plan launch took 450 us; now route alone 34 us + the plan (128 blocks) 11 us; the 4K
//   forward of 4 layers 14.66 -> 13.28 ms. Decode (batch 1 and 64, below PLAN_PAR_MIN) keeps
//   the one-launch form: forced to the two launches (=2) it measured the same within noise.
#include <stdint.h>
#include <stdlib.h>

#include "gpu_common.cuh"
#include "kernels.h"
#include "mm_gpu.h"
#include "mma.cuh"
#include "rms.cuh"
#include "route.cuh"

#define PLAN_THREADS 256
#define PLAN_MAX_E 4096

// ids and weights as the plan reads them: written by other blocks of the same kernel (VOL,
// the route + plan kernel's last block) are read past the multiprocessor's L1.
template <bool VOL, typename T>
__device__ __forceinline__ T plan_ld(const T *p) {
    return VOL ? *(const volatile T *)p : *p;
}

// plan_block_scan: thread tid's exclusive prefix of sum over the block's PLAN_THREADS threads:
// an inclusive scan within each warp by shuffles, then the earlier warps' totals through wsum
// (PLAN_THREADS / 32 ints of shared memory; one barrier inside, so every thread calls it).
__device__ __forceinline__ int plan_block_scan(int sum, int tid, int32_t *wsum) {
    const int lane = tid % MM_WARP_SIZE, warp = tid / MM_WARP_SIZE;
    int incl = sum;
#pragma unroll
    for (int d = 1; d < MM_WARP_SIZE; d <<= 1) {
        const int v = mm_shfl_up(incl, d);
        if (lane >= d)
            incl += v;
    }
    if (lane == MM_WARP_SIZE - 1)
        wsum[warp] = incl;
    __syncthreads();
    int run = incl - sum;
    for (int w = 0; w < warp; w++)
        run += wsum[w];
    return run;
}

// The plan of nk = n_rows * top_k slots by one block of PLAN_THREADS threads; base: n_experts
// int32 of shared memory.
template <bool VOL>
__device__ __forceinline__ void plan_body(const int32_t *ids, const float *weights, int n_rows,
                                          int top_k, int n_experts, int32_t *offs,
                                          int32_t *src_row, int32_t *dst_slot, float *wt,
                                          int *d_err, int32_t *base) {
    __shared__ int32_t chunk[PLAN_THREADS];
    __shared__ int32_t wsum[PLAN_THREADS / 32];
    const int nk = n_rows * top_k, tid = threadIdx.x;
    for (int e = tid; e < n_experts; e += blockDim.x)
        base[e] = 0;
    __syncthreads();
    for (int t = tid; t < nk; t += blockDim.x) {
        int e = plan_ld<VOL>(ids + t);
        if (e < 0 || e >= n_experts) {
            if (d_err != NULL)
                atomicOr(d_err, 1);
            e = 0;
        }
        atomicAdd(&base[e], 1);
    }
    __syncthreads();
    { // exclusive scan: thread t owns a run of consecutive experts; the runs' sums are
      // scanned across the warp with shuffles, then across the warps
        const int per = (n_experts + PLAN_THREADS - 1) / PLAN_THREADS;
        const int e0 = tid * per, e1 = min(n_experts, e0 + per);
        int sum = 0;
        for (int e = e0; e < e1; e++)
            sum += base[e];
        int run = plan_block_scan(sum, tid, wsum);
        if (tid == PLAN_THREADS - 1)
            offs[n_experts] = run + sum;
        for (int e = e0; e < e1; e++) {
            const int c = base[e];
            base[e] = run;
            offs[e] = run;
            run += c;
        }
    }
    __syncthreads();
    for (int c0 = 0; c0 < nk; c0 += blockDim.x) {
        const int t = c0 + tid;
        int e = -1;
        if (t < nk) {
            e = plan_ld<VOL>(ids + t);
            if (e < 0 || e >= n_experts)
                e = 0;
        }
        chunk[tid] = e;
        __syncthreads();
        if (e >= 0) {
            int rank = 0;
            for (int j = 0; j < tid; j++)
                rank += chunk[j] == e;
            const int p = base[e] + rank;
            src_row[p] = t / top_k;
            dst_slot[p] = t;
        }
        __syncthreads(); // every read of base[] for this chunk is done
        if (e >= 0)
            atomicAdd(&base[e], 1);
        __syncthreads();
    }
    if (wt != NULL)
        for (int t = tid; t < nk; t += blockDim.x)
            wt[(int64_t)(t % top_k) * n_rows + t / top_k] = plan_ld<VOL>(weights + t);
}

// The same plan when nk = n_rows * top_k <= PLAN_THREADS (decode up to 32 rows at top-8),
// with one barrier: slot t's sorted position is the number of slots of lower experts plus
// the earlier slots of its own expert (the stable counting sort's position), offs[e] the
// number of slots of experts below e; each thread counts over the nk slots' experts in
// shared memory.
template <bool VOL>
__device__ __forceinline__ void plan_small(const int32_t *ids, const float *weights, int n_rows,
                                           int top_k, int n_experts, int32_t *offs,
                                           int32_t *src_row, int32_t *dst_slot, float *wt,
                                           int *d_err) {
    __shared__ int32_t esh[PLAN_THREADS];
    const int nk = n_rows * top_k, tid = threadIdx.x;
    if (tid < nk) {
        int e = plan_ld<VOL>(ids + tid);
        if (e < 0 || e >= n_experts) {
            if (d_err != NULL)
                atomicOr(d_err, 1);
            e = 0;
        }
        esh[tid] = e;
    }
    __syncthreads();
    for (int e = tid; e <= n_experts; e += blockDim.x) {
        int c = 0;
        for (int t = 0; t < nk; t++)
            c += esh[t] < e;
        offs[e] = c;
    }
    if (tid < nk) {
        const int e = esh[tid];
        int p = 0;
        for (int t = 0; t < nk; t++)
            p += esh[t] < e || (t < tid && esh[t] == e);
        src_row[p] = tid / top_k;
        dst_slot[p] = tid;
        if (wt != NULL)
            wt[(int64_t)(tid % top_k) * n_rows + tid / top_k] = plan_ld<VOL>(weights + tid);
    }
}

__global__ void __launch_bounds__(PLAN_THREADS) route_plan_kernel(
    const int32_t *ids, const float *weights, int n_rows, int top_k, int n_experts, int32_t *offs,
    int32_t *src_row, int32_t *dst_slot, float *wt, int *d_err) {
    mm_dep_signal(); // the grouped product after it prefetches its weights meanwhile
    mm_dep_wait();
    extern __shared__ int32_t base[]; // n_experts counts, then running starts
    plan_body<false>(ids, weights, n_rows, top_k, n_experts, offs, src_row, dst_slot, wt, d_err,
                     base);
}

// ---- the plan by many blocks (large slot counts) ------------------------------------------------
#define PLAN_PAR_MIN 2048     // slots from which the parallel plan is the default (256 rows at top-8)
#define PLAN_PAR_BLOCKS 264   // at most this many blocks (2 per SM of an H100/H200); more slots:
                              // several chunks of PLAN_THREADS per block

// one id into a histogram: an id outside [0, E) counts as expert 0 (as plan_body)
__device__ __forceinline__ void plan_count(int32_t *h, int e, int E) {
    atomicAdd(&h[(unsigned)e < (unsigned)E ? e : 0], 1);
}

// Block b places slots [b * chunks * PLAN_THREADS, ...) of the nk = n_rows * top_k slots.
// Dynamic shared memory: 2 * n_experts int32 (before[], then rest[] which becomes the
// running position of each expert).
__global__ void __launch_bounds__(PLAN_THREADS) route_plan_par_kernel(
    const int32_t *ids, const float *weights, int n_rows, int top_k, int n_experts, int chunks,
    int32_t *offs, int32_t *src_row, int32_t *dst_slot, float *wt, int *d_err) {
    mm_dep_signal(); // the grouped product after it prefetches its weights meanwhile
    mm_dep_wait();
    extern __shared__ int32_t hist[];
    __shared__ __align__(16) int32_t chunk[PLAN_THREADS];
    __shared__ int32_t wsum[PLAN_THREADS / 32];
    const int E = n_experts, tid = threadIdx.x;
    const int nk = n_rows * top_k;
    const int start = (int)min((int64_t)blockIdx.x * chunks * PLAN_THREADS, (int64_t)nk);
    const int end = (int)min((int64_t)start + (int64_t)chunks * PLAN_THREADS, (int64_t)nk);
    int32_t *before = hist, *rest = hist + E;
    for (int e = tid; e < 2 * E; e += PLAN_THREADS)
        hist[e] = 0;
    __syncthreads();
    // every slot's expert: before[] for the slots in front of this block's tile, rest[] for
    // the others; 16-byte loads, 4 in flight per thread, where ids is aligned (start is a
    // multiple of 4, so a group of 4 is on one side)
    int t_tail = 0;
    if (((uintptr_t)ids & 15) == 0) {
        const int4 *ids4 = (const int4 *)ids;
        const int n4 = nk / 4;
        int i = tid;
        for (; i + 3 * PLAN_THREADS < n4; i += 4 * PLAN_THREADS) {
            int4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                v[u] = ids4[i + u * PLAN_THREADS];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int32_t *h = 4 * (i + u * PLAN_THREADS) < start ? before : rest;
                plan_count(h, v[u].x, E), plan_count(h, v[u].y, E);
                plan_count(h, v[u].z, E), plan_count(h, v[u].w, E);
            }
        }
        for (; i < n4; i += PLAN_THREADS) {
            const int4 v = ids4[i];
            int32_t *h = 4 * i < start ? before : rest;
            plan_count(h, v.x, E), plan_count(h, v.y, E);
            plan_count(h, v.z, E), plan_count(h, v.w, E);
        }
        t_tail = 4 * n4;
    }
    for (int t = t_tail + tid; t < nk; t += PLAN_THREADS)
        plan_count(t < start ? before : rest, ids[t], E);
    __syncthreads();
    { // exclusive scan of the totals (before + rest) as plan_body's: thread t owns a run of
      // consecutive experts; rest[e] becomes offs[e] + before[e], this block's first position
        const int per = (E + PLAN_THREADS - 1) / PLAN_THREADS;
        const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
        int sum = 0;
        for (int e = e0; e < e1; e++)
            sum += before[e] + rest[e];
        int run = plan_block_scan(sum, tid, wsum);
        if (blockIdx.x == 0 && tid == PLAN_THREADS - 1)
            offs[E] = run + sum;
        for (int e = e0; e < e1; e++) {
            const int b = before[e], c = b + rest[e];
            if (blockIdx.x == 0)
                offs[e] = run;
            rest[e] = run + b;
            run += c;
        }
    }
    __syncthreads();
    // this tile's slots in chunks of the block width: a slot's rank among the chunk's earlier
    // slots of its expert from a shared copy of the chunk's ids (plan_body's order)
    for (int c0 = start; c0 < end; c0 += PLAN_THREADS) {
        const int t = c0 + tid;
        int e = -1;
        if (t < end) {
            e = ids[t];
            if (e < 0 || e >= E) {
                if (d_err != NULL)
                    atomicOr(d_err, 1);
                e = 0;
            }
        }
        chunk[tid] = e;
        __syncthreads();
        if (e >= 0) {
            int rank = 0;
            const int4 *c4 = (const int4 *)chunk;
            const int q4 = tid / 4;
            for (int q = 0; q < q4; q++) {
                const int4 v = c4[q];
                rank += (v.x == e) + (v.y == e) + (v.z == e) + (v.w == e);
            }
            for (int j = 4 * q4; j < tid; j++)
                rank += chunk[j] == e;
            const int p = rest[e] + rank;
            src_row[p] = t / top_k;
            dst_slot[p] = t;
            if (wt != NULL)
                wt[(int64_t)(t % top_k) * n_rows + t / top_k] = weights[t];
        }
        if (c0 + PLAN_THREADS >= end)
            break; // the last chunk: no running counts to advance
        __syncthreads(); // every read of rest[] and chunk[] for this chunk is done
        if (e >= 0)
            atomicAdd(&rest[e], 1);
        __syncthreads();
    }
}

// The parallel plan's threshold in slots (0: never): mm_gpu_set_route_plan_par, else
// MM_GPU_ROUTE_PLAN_PAR (0 off, unset or 1 PLAN_PAR_MIN, N >= 2 from N slots). Process-wide.
static int g_plan_par = -1;

static int64_t plan_par_min(void) {
    if (g_plan_par < 0) {
        const char *e = getenv("MM_GPU_ROUTE_PLAN_PAR");
        const long v = e != NULL && *e != '\0' ? strtol(e, NULL, 10) : 1;
        g_plan_par = v <= 0 ? 0 : v == 1 ? PLAN_PAR_MIN : v > INT32_MAX ? INT32_MAX : (int)v;
    }
    return g_plan_par;
}

// mm_gpu_set_route_plan_par: the plan of route_plan and route_with_plan by many blocks from
// min_slots slots (n_rows * top_k), 0 never (one block at every size), < 0 back to
// MM_GPU_ROUTE_PLAN_PAR (default: from PLAN_PAR_MIN slots). Same plan either way.
// Process-wide.
extern "C" void mm_gpu_set_route_plan_par(int min_slots);
extern "C" void mm_gpu_set_route_plan_par(int min_slots) {
    g_plan_par = min_slots < 0 ? -1 : min_slots;
}

static bool plan_par(int64_t nk) {
    const int64_t m = plan_par_min();
    return m > 0 && nk > 0 && nk >= m;
}

// Launches route_plan_par_kernel for nk = n_rows * top_k > 0 slots (arguments checked).
static mm_err plan_par_launch(cudaStream_t st, const int32_t *d_ids, const float *d_weights,
                              int64_t n_rows, int top_k, int n_experts, int32_t *d_offs,
                              int32_t *d_src_row, int32_t *d_dst_slot, float *d_wt, int *d_err) {
    const int64_t nk = n_rows * top_k;
    const int64_t tiles = (nk + PLAN_THREADS - 1) / PLAN_THREADS;
    const int chunks = (int)((tiles + PLAN_PAR_BLOCKS - 1) / PLAN_PAR_BLOCKS);
    const int64_t blocks = (tiles + chunks - 1) / chunks;
    const size_t shmem = 2 * (size_t)n_experts * sizeof(int32_t);
    MM_GPU_CHECK(mm_launch_dep(route_plan_par_kernel, dim3((unsigned)blocks), dim3(PLAN_THREADS),
        shmem, st, d_ids, d_weights, (int)n_rows, top_k, n_experts, chunks, d_offs, d_src_row,
        d_dst_slot, d_wt, d_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

extern "C" mm_err mm_gpu_route_plan(void *stream, const int32_t *d_ids, const float *d_weights,
                                    int64_t n_rows, int top_k, int n_experts, int32_t *d_offs,
                                    int32_t *d_src_row, int32_t *d_dst_slot, float *d_wt,
                                    int *d_err) {
    if (d_ids == NULL || d_offs == NULL || d_src_row == NULL || d_dst_slot == NULL ||
        (d_wt != NULL && d_weights == NULL) || n_rows < 0 || top_k <= 0 || n_experts <= 0 ||
        n_experts > PLAN_MAX_E || n_rows * top_k > INT32_MAX) {
        mm_log_error("gpu: route_plan: bad arguments (n_rows=%lld top_k=%d n_experts=%d, at most "
                     "%d experts)", (long long)n_rows, top_k, n_experts, PLAN_MAX_E);
        return MM_EINVAL;
    }
    if (plan_par(n_rows * top_k))
        return plan_par_launch((cudaStream_t)stream, d_ids, d_weights, n_rows, top_k, n_experts,
                               d_offs, d_src_row, d_dst_slot, d_wt, d_err);
    const size_t shmem = (size_t)n_experts * sizeof(int32_t);
    MM_GPU_CHECK(mm_launch_dep(route_plan_kernel, dim3(1), dim3(PLAN_THREADS), shmem, (cudaStream_t)stream,
        d_ids, d_weights, (int)n_rows, top_k, n_experts, d_offs, d_src_row, d_dst_slot, d_wt,
        d_err));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// ---- one row's routing by a block (route_plan_fused_kernel, moe_gate_kernel) -------------------
// route_row_scores (one warp): route.cuh's scores of the row's logits l into rsh (the layout of
// route_shmem_bytes) and whether a choice score is NaN (*nan_sh, lane 0). The block then meets
// at a barrier and calls route_row_pick.
__device__ __forceinline__ void route_row_scores(const struct mm_route_params &p, const float *l,
                                                 float *rsh, int *nan_sh, int lane) {
    const int E = p.n_experts, K = p.top_k;
    route_scores(p, l, rsh, rsh + E, (unsigned char *)(rsh + 2 * E + K), lane);
    const int nan = route_warp_nan(p, rsh + E, lane);
    if (lane == 0)
        *nan_sh = nan;
}

// route_row_pick (the whole block): the group limit, the K picks (by rank, or one at a time by
// warp 0 when a choice score is NaN), the ids to ids_out and the finished weights to w_out:
// route_kernel's ids and weights. ids_sh: ROUTE_MAX_EXPERTS int32 of shared memory; sum_sh one
// float. Ends with a barrier.
__device__ __forceinline__ void route_row_pick(const struct mm_route_params &p, float *rsh, int nan,
                                               int32_t *ids_sh, int32_t *ids_out, float *w_out,
                                               float *sum_sh) {
    const int E = p.n_experts, K = p.top_k, tid = threadIdx.x;
    float *prob = rsh, *choice = rsh + E, *wk = rsh + 2 * E;
    unsigned char *taken = (unsigned char *)(rsh + 2 * E + K);
    if (p.n_group > 1) {
        if (tid == 0)
            route_groups(p, choice);
        __syncthreads();
    }
    if (nan)
        route_pick_serial(p, prob, choice, taken, wk, ids_sh, tid / MM_WARP_SIZE == 0,
                          tid % MM_WARP_SIZE);
    else
        route_pick_rank(p, prob, choice, wk, ids_sh);
    for (int t = tid; t < K; t += blockDim.x)
        ids_out[t] = ids_sh[t];
    route_finish_block(p, wk, w_out, sum_sh); // ends with a barrier
}

// ---- route + plan in one launch ------------------------------------------------------------------
// A block of PLAN_THREADS per row routes it with route.cuh's steps (the picks by rank, or
// one at a time when a choice score is NaN; the renorm's divisions one per thread: the same
// ids and weights as route_kernel), writes ids and weights, and the block that finishes last
// (an arrival count in *count, zero between launches: the last block resets it) makes the
// plan from all rows: plan_small up to PLAN_THREADS slots, else route_plan_kernel's body.
// With one row there is no count: the block plans after a barrier. plan false: route only
// (the parallel plan follows in its own launch; count is not touched).
__global__ void __launch_bounds__(PLAN_THREADS) route_plan_fused_kernel(
    struct mm_route_params p, const float *logits, int64_t ls, int n_rows, int32_t *ids,
    float *weights, int32_t *offs, int32_t *src_row, int32_t *dst_slot, float *wt, int *d_err,
    unsigned *count, size_t plan_off, bool plan) {
    extern __shared__ float rsh[]; // route_shmem_bytes, then (at plan_off) the plan's base
    __shared__ int32_t ids_sh[ROUTE_MAX_EXPERTS];
    __shared__ int last, nan_sh;
    __shared__ float sum_sh;
    mm_dep_signal(); // the grouped product after it prefetches its weights meanwhile
    mm_dep_wait();
    const int E = p.n_experts, K = p.top_k, tid = threadIdx.x;
    const int lane = tid % MM_WARP_SIZE, warp = tid / MM_WARP_SIZE;
    const int64_t r = blockIdx.x;
    if (warp == 0)
        route_row_scores(p, logits + r * ls, rsh, &nan_sh, lane);
    __syncthreads();
    route_row_pick(p, rsh, nan_sh, ids_sh, ids + r * K, weights + r * K, &sum_sh); // + barrier
    if (!plan)
        return;
    const bool small = n_rows * K <= PLAN_THREADS;
    int32_t *base = (int32_t *)((char *)rsh + plan_off);
    if (gridDim.x == 1) { // this block's writes are visible to it after the barrier
        if (small)
            plan_small<false>(ids, weights, n_rows, K, E, offs, src_row, dst_slot, wt, d_err);
        else
            plan_body<false>(ids, weights, n_rows, K, E, offs, src_row, dst_slot, wt, d_err,
                             base);
        return;
    }
    __threadfence(); // this row's ids and weights before the arrival
    __syncthreads();
    if (tid == 0)
        last = atomicAdd(count, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence(); // every row's writes are seen by the loads below
    if (tid == 0)
        *count = 0; // every block has arrived: ready for the next launch
    if (small)
        plan_small<true>(ids, weights, n_rows, K, E, offs, src_row, dst_slot, wt, d_err);
    else
        plan_body<true>(ids, weights, n_rows, K, E, offs, src_row, dst_slot, wt, d_err, base);
}

extern "C" mm_err mm_gpu_route_with_plan(void *stream, const struct mm_route_params *p,
                                         const float *d_logits, int64_t ls, int64_t n_rows,
                                         int32_t *d_ids, float *d_weights, int32_t *d_offs,
                                         int32_t *d_src_row, int32_t *d_dst_slot, float *d_wt,
                                         int *d_err, unsigned *d_count) {
    if (p == NULL || d_logits == NULL || d_ids == NULL || d_weights == NULL || d_offs == NULL ||
        d_src_row == NULL || d_dst_slot == NULL || d_count == NULL || n_rows < 0 ||
        !route_params_ok(p) || n_rows * p->top_k > INT32_MAX) {
        mm_log_error("gpu: route_with_plan: bad arguments (n_rows=%lld)", (long long)n_rows);
        return MM_EINVAL;
    }
    if (n_rows == 0) // no routing; the plan of no rows (zero offsets)
        return mm_gpu_route_plan(stream, d_ids, d_weights, 0, p->top_k, p->n_experts, d_offs,
                                 d_src_row, d_dst_slot, d_wt, d_err);
    const size_t plan_off = (route_shmem_bytes(p->n_experts, p->top_k) + 15) & ~(size_t)15;
    const bool par = plan_par(n_rows * p->top_k);
    const size_t shmem = plan_off + (par ? 0 : (size_t)p->n_experts * sizeof(int32_t));
    MM_GPU_CHECK(mm_launch_dep(route_plan_fused_kernel, dim3((unsigned)n_rows), dim3(PLAN_THREADS),
        shmem, (cudaStream_t)stream, *p, d_logits, ls, (int)n_rows, d_ids, d_weights, d_offs,
        d_src_row, d_dst_slot, d_wt, d_err, d_count, plan_off, !par));
    MM_GPU_CHECK(cudaGetLastError());
    if (par)
        return plan_par_launch((cudaStream_t)stream, d_ids, d_weights, n_rows, p->top_k,
                               p->n_experts, d_offs, d_src_row, d_dst_slot, d_wt, d_err);
    return MM_OK;
}

// ---- the MoE gate of a decode step in one launch (kernels.h moe_gate) ---------------------------
// add_rmsnorm (or rmsnorm), the router product and route_with_plan, whose three launches are
// each mostly latency at decode sizes (one block, or 8 blocks of 16 router rows), as one:
// - every block loads the rows of h (+ a), takes their norm from shared memory with
//   add_rmsnorm_kernel's device functions (rms.cuh: the same sum order and rounding), and
//   rounds the normed rows to bf16 into a GEMV v2 x tile (mma.cuh's pack_bf16); block 0 also
//   writes the normed rows to x;
// - block b then computes router outputs [16 b tpb, 16 (b + 1) tpb) as gemv_x_kernel does:
//   the same segments (seg_len), k chunks in the same order, the same mma fragments and the
//   segment sums added in order, so the same logits to the bit; its first round of router rows
//   and the norm's weights are loaded before the wait on the previous kernel (neither is
//   written by a kernel);
// - the block that finishes last (arrival count in *count, reset by that block, so a graph
//   replays) writes h (+ a) to h (every block has read h by then), routes the rows and makes
//   the plan (plan_small / plan_body). One row: route_plan_fused_kernel's steps (route_row_
//   scores, route_row_pick). More: warp w routes row w, all at once, with route_kernel's steps
//   (the picks one at a time, route_finish), the same ids and weights; routing 8 rows one
//   after the other by the block's steps cost 10% of the batch-8 step (H200, 09:21 UTC).
// Rows 1..GATE_MAX_ROWS, bf16 router weights, CUDA (mma) only: other shapes are MM_EUNSUPP and
// the caller issues the three ops. Off unless MM_GPU_FUSED_GATE=1 (backend.cu): the first
// version measured slower than the three launches (docs/BENCHMARKS.md).
#define GATE_MAX_ROWS 8
#define GATE_WARPS (PLAN_THREADS / 32)
#define GATE_UNROLL 8 // 32-wide k chunks of router rows in flight per warp (gemv_x_kernel's)
#define GATE_SMEM_MAX (200 << 10)

struct gate_args {
    const float *a;       // (n_rows, dim) addend, row stride as, or NULL (norm of h alone)
    int64_t as;
    float *h;             // (n_rows, dim), row stride hs: h += a (by the last block)
    int64_t hs;
    const void *nw;       // norm weight (dim), dtype the kernel's DT
    float eps;
    int dim;
    float *x;             // (n_rows, dim) normed rows, row stride xs
    int64_t xs;
    const uint16_t *rw;   // router (E, dim) bf16
    int vec;              // 16-byte router loads are legal
    float *logits;        // (n_rows, E), row stride ls
    int64_t ls;
    int n_rows, wpt;      // rows; warps per 16-output tile (gemv_x_kernel's choice)
    struct mm_route_params p;
    int32_t *ids;         // route_with_plan's outputs
    float *weights;
    int32_t *offs, *src_row, *dst_slot;
    float *wt;
    int *d_err;
    unsigned *count;      // arrival count, zero between launches
    int xb_off, rsz, lsh_off, plan_off; // dynamic shared memory layout (bytes; rsz per row)
};

#if MM_GPU_HAVE_WMMA
// DT: the norm weight's dtype; EPT: norm elements per thread (dim <= EPT * PLAN_THREADS).
// Two blocks' worth of registers per SM at most, so that a block fits beside the GEMV blocks of
// the product before it and is resident, its weights loading, when that product ends.
template <int DT, int EPT>
__global__ void __launch_bounds__(PLAN_THREADS, 2) moe_gate_kernel(const struct gate_args g) {
    extern __shared__ __align__(16) unsigned char gsm[];
    __shared__ float part[SEG_MAX][16 * 8]; // [tile * S + segment][row * 8 + token]
    __shared__ float rs_sh[GATE_MAX_ROWS];
    __shared__ int32_t ids_sh[ROUTE_MAX_EXPERTS];
    __shared__ int nan_sh[GATE_MAX_ROWS];
    __shared__ int last;
    __shared__ float sum_sh;
    constexpr int U = GATE_UNROLL, LB = 8; // LB: loads of h (and a) in flight per thread
    mm_dep_signal(); // the grouped product after it prefetches its weights meanwhile
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int gq = lane >> 2, t = lane & 3;
    const int dim = g.dim, n = g.n_rows, E = g.p.n_experts, K = g.p.top_k;
    const int wpt = g.wpt, tpb = GATE_WARPS / wpt, tib = warp / wpt, wit = warp % wpt;
    const int sl = seg_len(dim), S = (dim + sl - 1) / sl;
    const int r0 = (blockIdx.x * tpb + tib) * 16;
    const bool vec = g.vec != 0;
    const uint16_t *wr0 = g.rw + (size_t)min(r0 + gq, E - 1) * dim;
    const uint16_t *wr1 = g.rw + (size_t)min(r0 + gq + 8, E - 1) * dim;
    uint4 w0v[U], w1v[U];
    auto load_round = [&](int kc, int k_end) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kc + 32 * u < k_end) {
                const int k = kc + 32 * u + 8 * t;
                w0v[u] = load_w8(wr0, k, dim, vec);
                w1v[u] = load_w8(wr1, k, dim, vec);
            }
    };
    // before the wait: the norm's weights and this warp's first round of router rows
    float wv[EPT];
    rms_load_w<DT, PLAN_THREADS, EPT>(g.nw, dim, wv);
    bool have = r0 < E && wit < S;
    if (have)
        load_round(wit * sl, min(dim, (wit + 1) * sl));
    mm_dep_wait();
    float *xf = (float *)gsm;                     // n rows of dim: h (+ a)
    uint16_t *xb = (uint16_t *)(gsm + g.xb_off);  // n rows of ldx: the normed rows in bf16
    const int ldx = mv2_ldx(dim), kp = (dim + 31) / 32 * 32;
    for (int i0 = tid; i0 < n * dim; i0 += LB * PLAN_THREADS) { // all LB loads, then the adds
        float hv[LB], av[LB];
#pragma unroll
        for (int j = 0; j < LB; j++) {
            const int i = i0 + j * PLAN_THREADS, r = i / dim, k = i - r * dim;
            if (i < n * dim) {
                hv[j] = g.h[r * g.hs + k];
                av[j] = g.a != NULL ? g.a[r * g.as + k] : 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < LB; j++) {
            const int i = i0 + j * PLAN_THREADS;
            if (i < n * dim)
                xf[i] = g.a != NULL ? __fadd_rn(hv[j], av[j]) : hv[j]; // axpy's one add
        }
    }
    for (int i = tid; i < n * (kp - dim); i += PLAN_THREADS) // zeros past dim (x tile)
        xb[(i / (kp - dim)) * ldx + dim + i % (kp - dim)] = 0;
    __syncthreads();
    if (warp < n) {
        const float rs = rms_warp_rs(xf + warp * dim, dim, g.eps, lane);
        if (lane == 0)
            rs_sh[warp] = rs;
    }
    __syncthreads();
    for (int r = 0; r < n; r++) {
        float *xr = g.x + r * g.xs;
        uint16_t *br = xb + r * ldx;
        const bool write = blockIdx.x == 0;
        rms_scale_each<PLAN_THREADS, EPT>(xf + r * dim, wv, dim, rs_sh[r], [&](int k, float y) {
            if (write)
                xr[k] = y;
            br[k] = (uint16_t)(pack_bf16(y, 0.0f) & 0xffffu); // y's half of a pair
        });
    }
    __syncthreads();
    // the router product: gemv_x_kernel's loop and epilogue for this block's tiles
    const uint16_t *xg = xb + min(gq, n - 1) * ldx; // token gq (past n: a valid row)
    if (r0 < E) {
        for (int sg = wit; sg < S; sg += wpt) {
            const int k_end = min(dim, (sg + 1) * sl);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int kc = sg * sl; kc < k_end; kc += 32 * U) {
                if (!have)
                    load_round(kc, k_end);
                have = false;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (kc + 32 * u >= k_end)
                        break;
                    const uint4 xv = *(const uint4 *)(xg + kc + 32 * u + 8 * t);
                    const uint32_t A0[4] = {w0v[u].x, w1v[u].x, w0v[u].y, w1v[u].y};
                    const uint32_t B0[2] = {xv.x, xv.y};
                    mma16816(acc, A0, B0);
                    const uint32_t A1[4] = {w0v[u].z, w1v[u].z, w0v[u].w, w1v[u].w};
                    const uint32_t B1[2] = {xv.z, xv.w};
                    mma16816(acc, A1, B1);
                }
            }
            float *pp = part[tib * S + sg];
#pragma unroll
            for (int i = 0; i < 4; i++)
                pp[(gq + (i >> 1) * 8) * 8 + 2 * t + (i & 1)] = acc[i];
        }
    }
    __syncthreads();
    for (int i = tid; i < tpb * 16 * 8; i += PLAN_THREADS) {
        const int tl = i / (16 * 8), rem = i % (16 * 8);
        const int o = (blockIdx.x * tpb + tl) * 16 + rem / 8, tok = rem % 8;
        if (o >= E || tok >= n)
            continue;
        float v = 0.0f;
        for (int sg = 0; sg < S; sg++)
            v = v + part[tl * S + sg][rem];
        g.logits[(int64_t)tok * g.ls + o] = v;
    }
    if (gridDim.x > 1) {
        __threadfence(); // this block's logits before the arrival
        __syncthreads();
        if (tid == 0)
            last = atomicAdd(g.count, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!last)
            return;
        __threadfence(); // every block's logits are seen by the loads below
        if (tid == 0)
            *g.count = 0; // every block has arrived: ready for the next launch
    } else {
        __syncthreads();
    }
    // the last block: the residual stream (every block has read h), then route + plan
    if (g.a != NULL)
        for (int i = tid; i < n * dim; i += PLAN_THREADS) {
            const int r = i / dim, k = i - r * dim;
            g.h[r * g.hs + k] = xf[i];
        }
    __syncthreads(); // xf is read: the routing areas below overlay it
    float *lsh = (float *)(gsm + g.lsh_off);
    for (int i = tid; i < n * E; i += PLAN_THREADS) {
        const int r = i / E, e = i - r * E;
        lsh[i] = plan_ld<true>(g.logits + r * g.ls + e);
    }
    __syncthreads(); // the logits are in lsh
    const int rf = g.rsz / 4; // floats per row's routing area
    if (n == 1) { // route_plan_fused_kernel's steps: the picks by rank (or serial on a NaN),
                  // by the whole block on row 0's area
        if (warp == 0)
            route_row_scores(g.p, lsh, (float *)gsm, &nan_sh[0], lane);
        __syncthreads();
        route_row_pick(g.p, (float *)gsm, nan_sh[0], ids_sh, g.ids, g.weights, &sum_sh);
    } else { // warp w routes row w, all rows at once: the picks one at a time (the same ids
             // as by rank, and the rank path's own choice on a NaN row), then route_finish
             // (lane 0: the same operations as route_finish_block's)
        float *rr = (float *)gsm + warp * rf; // warp w < n: row w's area
        unsigned char *taken = (unsigned char *)(rr + 2 * E + K);
        if (warp < n) {
            route_scores(g.p, lsh + warp * E, rr, rr + E, taken, lane);
            __syncwarp();
            if (g.p.n_group > 1 && lane == 0)
                route_groups(g.p, rr + E);
            __syncwarp();
        }
        route_pick_serial(g.p, rr, rr + E, taken, rr + 2 * E, g.ids + warp * K, warp < n,
                          lane); // a barrier per pick, met by every thread
        if (warp < n && lane == 0)
            route_finish(g.p, rr + 2 * E, g.weights + warp * K);
        __syncthreads();
    }
    if (n * K <= PLAN_THREADS)
        plan_small<false>(g.ids, g.weights, n, K, E, g.offs, g.src_row, g.dst_slot, g.wt,
                          g.d_err);
    else
        plan_body<false>(g.ids, g.weights, n, K, E, g.offs, g.src_row, g.dst_slot, g.wt, g.d_err,
                         (int32_t *)(gsm + g.plan_off));
}
#endif // MM_GPU_HAVE_WMMA

static size_t gate_align(size_t b) { return (b + 15) & ~(size_t)15; }

extern "C" mm_err mm_gpu_moe_gate(void *stream, const float *d_a, int64_t as, float *d_h,
                                  int64_t hs, const mm_weight *nw, float eps, float *d_x,
                                  int64_t xs, const mm_weight *router,
                                  const struct mm_route_params *p, float *d_logits,
                                  int64_t n_rows, int32_t *d_ids, float *d_weights,
                                  int32_t *d_offs, int32_t *d_src_row, int32_t *d_dst_slot,
                                  float *d_wt, int *d_err, unsigned *d_count) {
    if (nw == NULL || nw->data == NULL || router == NULL || router->data == NULL || p == NULL ||
        d_h == NULL || d_x == NULL || d_logits == NULL || d_ids == NULL || d_weights == NULL ||
        d_offs == NULL || d_src_row == NULL || d_dst_slot == NULL || d_count == NULL ||
        n_rows < 0 || nw->rows != 1 || router->cols != nw->cols || router->rows != p->n_experts) {
        mm_log_error("gpu: moe_gate: bad arguments (n_rows=%lld)", (long long)n_rows);
        return MM_EINVAL;
    }
    // the shapes the one launch takes; the rest is the caller's three ops
    const int64_t dim = nw->cols, E = p->n_experts;
    if (!MM_GPU_HAVE_WMMA || n_rows < 1 || n_rows > GATE_MAX_ROWS ||
        router->dtype != MM_DTYPE_BF16 || dim > RMS_MAX_DIM || !route_params_ok(p) ||
        E > PLAN_MAX_E || (nw->dtype != MM_DTYPE_BF16 && nw->dtype != MM_DTYPE_F16 &&
                           nw->dtype != MM_DTYPE_F32))
        return MM_EUNSUPP;
    const int n = (int)n_rows, K = p->top_k;
    const size_t xb_off = gate_align((size_t)n * dim * 4);
    const size_t prod = xb_off + (size_t)n * mv2_ldx((int)dim) * 2;
    const size_t rsz = gate_align(route_shmem_bytes((int)E, K));
    const size_t lsh_off = (size_t)n * rsz, plan_off = gate_align(lsh_off + (size_t)n * E * 4);
    const size_t route = plan_off + (n * K > PLAN_THREADS ? (size_t)E * 4 : 0);
    const size_t shmem = prod > route ? prod : route;
    if (shmem > GATE_SMEM_MAX)
        return MM_EUNSUPP;
#if MM_GPU_HAVE_WMMA
    const int S = (int)((dim + seg_len((int)dim) - 1) / seg_len((int)dim));
    const int wpt = S >= 8 ? 8 : S >= 4 ? 4 : S >= 2 ? 2 : 1; // gemv_x_kernel's
    const int tpb = GATE_WARPS / wpt;
    const unsigned blocks = mm_div_up(E, 16 * tpb);
    struct gate_args g = {d_a, as, d_h, hs, nw->data, eps, (int)dim, d_x, xs,
                          (const uint16_t *)router->data, 0, d_logits, E, n, wpt, *p, d_ids,
                          d_weights, d_offs, d_src_row, d_dst_slot, d_wt, d_err, d_count,
                          (int)xb_off, (int)rsz, (int)lsh_off, (int)plan_off};
    g.vec = dim % 8 == 0 && ((uintptr_t)router->data & 15) == 0;
    const int ei = dim <= 8 * PLAN_THREADS ? 0 : dim <= 16 * PLAN_THREADS ? 1 : 2;
#define GATE_PICK(D)                                                                               \
    (ei == 0 ? moe_gate_kernel<D, 8> : ei == 1 ? moe_gate_kernel<D, 16> : moe_gate_kernel<D, 32>)
    void (*kern)(const struct gate_args) = nw->dtype == MM_DTYPE_BF16  ? GATE_PICK(MM_DTYPE_BF16)
                                           : nw->dtype == MM_DTYPE_F16 ? GATE_PICK(MM_DTYPE_F16)
                                                                       : GATE_PICK(MM_DTYPE_F32);
#undef GATE_PICK
    // per kernel (weight dtype, elements per thread) and device (harmlessly racy, as matmul.cu's)
    static uint64_t attr_set[9];
    const int di = 3 * (nw->dtype == MM_DTYPE_BF16 ? 0 : nw->dtype == MM_DTYPE_F16 ? 1 : 2) + ei;
    int dev = 0;
    MM_GPU_CHECK(cudaGetDevice(&dev));
    if (!(attr_set[di] & (1ull << (dev & 63)))) {
        MM_GPU_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          GATE_SMEM_MAX));
        // the carveout of the decode GEMVs around it (matmul.cu, GEMV v3), so that its blocks
        // can be resident beside theirs without the SM changing its split of L1 and shared
        MM_GPU_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
        attr_set[di] |= 1ull << (dev & 63);
    }
    MM_GPU_CHECK(mm_launch_dep(kern, dim3(blocks), dim3(PLAN_THREADS), shmem,
                               (cudaStream_t)stream, g));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
#else
    (void)as, (void)hs, (void)eps, (void)xs, (void)d_wt, (void)d_err, (void)n, (void)K;
    return MM_EUNSUPP;
#endif
}

// ---- combine: one thread per (row, element), the axpy sequence's exact operations ------------
__global__ void combine_kernel(const float *alpha, int k, const float *x, int64_t xs,
                               const float *shared, int64_t ss, float *h, int64_t hs,
                               int64_t n_rows, int64_t dim) {
    mm_dep_signal();
    mm_dep_wait();
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * dim)
        return;
    const int64_t i = idx / dim, j = idx % dim;
    float acc = 0.0f;
    for (int r = 0; r < k; r++)
        acc = __fadd_rn(acc, __fmul_rn(alpha[(int64_t)r * n_rows + i], x[(i * k + r) * xs + j]));
    if (shared != NULL)
        acc = __fadd_rn(acc, shared[i * ss + j]);
    h[i * hs + j] = __fadd_rn(h[i * hs + j], acc);
}

extern "C" mm_err mm_gpu_combine(void *stream, const float *d_alpha, int k, const float *d_x,
                                 int64_t xs, const float *d_shared, int64_t ss, float *d_h,
                                 int64_t hs, int64_t n_rows, int64_t dim) {
    if (k < 0 || (k > 0 && (d_alpha == NULL || d_x == NULL)) || d_h == NULL || n_rows < 0 ||
        dim < 0)
        return MM_EINVAL;
    if (n_rows * dim == 0)
        return MM_OK;
    MM_GPU_CHECK(mm_launch_dep(combine_kernel, dim3(mm_div_up(n_rows * dim, 256)), dim3(256), 0,
        (cudaStream_t)stream, d_alpha, k, d_x, xs, d_shared, ss, d_h, hs, n_rows, dim));
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}
