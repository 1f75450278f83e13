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
#include <string.h>

#include "gpu_common.cuh"
#include "kernels.h"
#include "mm_gpu.h"
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

// ---- one row: the weights' finish and the plan from shared memory ------------------------------
// route_plan_fused_kernel's path for a decode call of one row (no arrival count): after the
// picks (ids_sh, wk complete), thread t < K finishes weight t as route_finish_block does
// (route_wsum here on each such thread, then route_wfinish) and places slot t at plan_small's position
// (the count of lower experts among the row's K picks; a row's picks are distinct); every
// thread then counts offs as plan_small does, all from shared memory. The same outputs as
// route_finish_block then plan_small, without their two barriers and the reads of ids and
// weights back from global memory (the chain of this one-block op is its dependent steps:
// docs/BENCHMARKS.md "The router product and its routing in one launch").
// MM_GPU_ROUTE_ONE_ROW=0: the general path (A/B).
__device__ __forceinline__ void plan_one_row(const struct mm_route_params &p, const int32_t *ids_sh,
                                             const float *wk, float *weights, int32_t *offs,
                                             int32_t *src_row, int32_t *dst_slot, float *wt,
                                             int *d_err) {
    const int E = p.n_experts, K = p.top_k, tid = threadIdx.x;
    auto eid = [&](int t) { // plan_small's reading of an id: out of range counts as expert 0
        const int e = ids_sh[t];
        return e < 0 || e >= E ? 0 : e;
    };
    if (tid < K) {
        const float v = route_wfinish(p, wk[tid], p.renorm ? route_wsum(p, wk) : 0.0f);
        weights[tid] = v;
        if (wt != NULL)
            wt[tid] = v;
        const int raw = ids_sh[tid], e = eid(tid);
        if ((raw < 0 || raw >= E) && d_err != NULL)
            atomicOr(d_err, 1);
        int pos = 0;
        for (int t = 0; t < K; t++)
            pos += eid(t) < e || (t < tid && eid(t) == e);
        src_row[pos] = 0;
        dst_slot[pos] = tid;
    }
    for (int e = tid; e <= E; e += blockDim.x) {
        int c = 0;
        for (int t = 0; t < K; t++)
            c += eid(t) < e;
        offs[e] = c;
    }
}

static int g_one_row = -1;
static bool one_row_on(void) {
    if (g_one_row < 0) {
        const char *e = getenv("MM_GPU_ROUTE_ONE_ROW");
        g_one_row = e != NULL && strcmp(e, "0") == 0 ? 0 : 1;
    }
    return g_one_row > 0;
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
    unsigned *count, size_t plan_off, bool plan, bool one_row) {
    extern __shared__ float rsh[]; // route_shmem_bytes, then (at plan_off) the plan's base
    __shared__ int32_t ids_sh[ROUTE_MAX_EXPERTS];
    __shared__ int last, nan_sh;
    __shared__ float sum_sh;
    mm_dep_signal(); // the grouped product after it prefetches its weights meanwhile
    mm_dep_wait();
    const int E = p.n_experts, K = p.top_k, tid = threadIdx.x;
    const int lane = tid % MM_WARP_SIZE, warp = tid / MM_WARP_SIZE;
    float *prob = rsh, *choice = rsh + E, *wk = rsh + 2 * E;
    unsigned char *taken = (unsigned char *)(rsh + 2 * E + K);
    const int64_t r = blockIdx.x;
    if (warp == 0) {
        route_scores(p, logits + r * ls, prob, choice, taken, lane);
        const int nan = route_warp_nan(p, choice, lane);
        if (lane == 0)
            nan_sh = nan;
    }
    __syncthreads();
    if (p.n_group > 1) {
        if (tid == 0)
            route_groups(p, choice);
        __syncthreads();
    }
    if (nan_sh)
        route_pick_serial(p, prob, choice, taken, wk, ids_sh, warp == 0, lane);
    else
        route_pick_rank(p, prob, choice, wk, ids_sh);
    for (int t = tid; t < K; t += blockDim.x)
        ids[r * K + t] = ids_sh[t];
    if (one_row && plan && n_rows == 1 && K <= (int)blockDim.x) { // the picks are complete
        plan_one_row(p, ids_sh, wk, weights, offs, src_row, dst_slot, wt, d_err);
        return;
    }
    route_finish_block(p, wk, weights + r * K, &sum_sh); // ends with a barrier
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

// ---- routing a warp per row (prefill) ------------------------------------------------------------
// route_with_plan's routing at many rows (ops.cu's prefill row-op forms: from 128 rows, with
// the parallel plan) by route_rows_warp_kernel: a block of RW_WARPS warps, each routing one
// row alone with route.cuh's steps (scores, NaN check, group limit, then the picks by rank or,
// with a NaN choice score, one at a time) and route_finish on lane 0 (the same operations per
// weight as route_finish_block), so the same ids and weights as route_plan_fused_kernel, whose
// 256-thread block per row kept one warp busy for the scores (34 us at 4096 rows, ncu).
// The picks below are route.cuh's route_pick_serial_by and route_pick_rank_by with a warp's
// barrier instead of the block's; up to 8 experts per lane, a row without a NaN choice score is picked one at a
// time from registers (K rounds of a warp argmax: cheaper for one warp than ranking each
// expert against all E; the same ids as the ranks, route.cuh), a row with one by
// route_pick_serial_warp. H200 (ncu, 4096 rows, E 128, K 8): 26.0 us (the block per row) ->
// 23.0 (a warp per row, ranks) -> 12.3 (register picks).
#define RW_WARPS 8
#define RW_SHMEM_MAX (48u << 10)
extern "C" int mm__gpu_rowops_pf(int64_t n_rows); // ops.cu
extern "C" void mm__gpu_rowops_pf_count(void);     // ops.cu

// A warp's barrier over its shared memory (HIP's wavefront runs in lockstep: a fence orders
// its writes).
__device__ __forceinline__ void rw_warp_sync(void) {
#if MM_GPU_HAVE_WMMA
    __syncwarp();
#else
    __threadfence_block();
#endif
}

// route.cuh's pick steps by one warp alone (its lanes, its barrier)
struct route_warp_group {
    __device__ static int first(int lane) { return lane; }
    __device__ static int stride() { return MM_WARP_SIZE; }
    __device__ static void sync() { rw_warp_sync(); }
};

__device__ __forceinline__ void route_pick_serial_warp(const struct mm_route_params &p,
                                                       const float *prob, const float *choice,
                                                       unsigned char *taken, float *wk,
                                                       int32_t *ids_out, int lane) {
    route_pick_serial_by<route_warp_group>(p, prob, choice, taken, wk, ids_out, true, lane);
}

// route_pick_serial_warp with this lane's choice scores (experts lane + W j, j < EPL, E <= W
// EPL) and taken flags in registers: the same scan order and warp argmax, each pick lane 0's
// (with a NaN score the lanes' warp argmax can differ: route_pick_serial takes lane 0's), so
// the same picks, and, without a NaN choice score, route_pick_rank's. ids_out and wk in shared
// memory. route_rows_warp_kernel takes it for rows without a NaN choice score only (H200,
// 12:02 UTC: the first form, without the broadcast, picked -1 on a NaN row; the NaN rows keep
// route_pick_serial_warp, checked on the device at 11:50).
template <int EPL>
__device__ __forceinline__ void route_pick_serial_reg(const struct mm_route_params &p,
                                                      const float *prob, const float *choice,
                                                      float *wk, int32_t *ids_out, int lane) {
    const int E = p.n_experts, K = p.top_k;
    float cv[EPL];
    unsigned tk = 0; // bit j: expert lane + W j taken
#pragma unroll
    for (int j = 0; j < EPL; j++)
        cv[j] = lane + MM_WARP_SIZE * j < E ? choice[lane + MM_WARP_SIZE * j] : 0.0f;
    for (int t = 0; t < K; t++) {
        float bs = 0.0f;
        int bid = -1;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            const int e = lane + MM_WARP_SIZE * j;
            if (e < E && !((tk >> j) & 1u) && (bid < 0 || better(cv[j], e, bs, bid))) {
                bs = cv[j];
                bid = e;
            }
        }
        warp_best(bs, bid);
        bid = mm_shfl(bid, 0); // lane 0's, as route_pick_serial (lanes may differ on NaN ties)
        if (bid % MM_WARP_SIZE == lane)
            tk |= 1u << (bid / MM_WARP_SIZE);
        if (lane == 0) {
            ids_out[t] = bid;
            wk[t] = prob[bid];
        }
    }
    rw_warp_sync();
}

__device__ __forceinline__ void route_pick_rank_warp(const struct mm_route_params &p,
                                                     const float *prob, const float *choice,
                                                     float *wk, int32_t *ids_sh, int lane) {
    route_pick_rank_by<route_warp_group>(p, prob, choice, wk, ids_sh, lane);
}

// A warp's shared memory: route_shmem_bytes (prob, choice, wk, taken), then K ids; 16-byte
// multiples so that every warp's choice is 16-byte aligned.
static size_t rw_warp_bytes(int E, int K) {
    return ((route_shmem_bytes(E, K) + 15) & ~(size_t)15) + (((size_t)K * 4 + 15) & ~(size_t)15);
}

// EPL > 0: the picks one at a time from registers (E <= W EPL); 0: from shared memory, by
// rank without a NaN choice score.
template <int EPL>
__global__ void __launch_bounds__(RW_WARPS * MM_WARP_SIZE) route_rows_warp_kernel(
    struct mm_route_params p, const float *logits, int64_t ls, int n_rows, int32_t *ids,
    float *weights, int warp_bytes, int ids_off) {
    extern __shared__ float4 rw_sh[];
    mm_dep_signal();
    mm_dep_wait();
    const int E = p.n_experts, K = p.top_k;
    const int lane = threadIdx.x % MM_WARP_SIZE, warp = threadIdx.x / MM_WARP_SIZE;
    const int64_t r = (int64_t)blockIdx.x * RW_WARPS + warp;
    if (r >= n_rows)
        return; // no block barrier below
    float *rsh = (float *)((char *)rw_sh + (size_t)warp * warp_bytes);
    float *prob = rsh, *choice = rsh + E, *wk = rsh + 2 * E;
    unsigned char *taken = (unsigned char *)(rsh + 2 * E + K);
    int32_t *ids_sh = (int32_t *)((char *)rsh + ids_off);
    route_scores(p, logits + r * ls, prob, choice, taken, lane);
    const int nan = route_warp_nan(p, choice, lane);
    rw_warp_sync();
    if (p.n_group > 1) {
        if (lane == 0)
            route_groups(p, choice);
        rw_warp_sync();
    }
    if (EPL > 0 && !nan) { // (EPL 0: not instantiated)
        route_pick_serial_reg<(EPL > 0 ? EPL : 1)>(p, prob, choice, wk, ids_sh, lane);
    } else if (nan) {
        route_pick_serial_warp(p, prob, choice, taken, wk, ids_sh, lane);
    } else {
        route_pick_rank_warp(p, prob, choice, wk, ids_sh, lane);
    }
    for (int t = lane; t < K; t += MM_WARP_SIZE)
        ids[r * K + t] = ids_sh[t];
    if (lane == 0)
        route_finish(p, wk, weights + r * K);
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
    const size_t rwb = rw_warp_bytes(p->n_experts, p->top_k);
    if (par && RW_WARPS * rwb <= RW_SHMEM_MAX && n_rows <= INT32_MAX && mm__gpu_rowops_pf(n_rows)) {
        // a warp per row, then the parallel plan
        mm__gpu_rowops_pf_count();
        const int ws = mm__gpu_warp_size(), E = p->n_experts;
        void (*kern)(struct mm_route_params, const float *, int64_t, int, int32_t *, float *, int,
                     int) = E <= ws ? route_rows_warp_kernel<1> : E <= 2 * ws ? route_rows_warp_kernel<2>
                                  : E <= 4 * ws ? route_rows_warp_kernel<4>
                                  : E <= 8 * ws ? route_rows_warp_kernel<8> : route_rows_warp_kernel<0>;
        MM_GPU_CHECK(mm_launch_dep(kern, dim3(mm_div_up(n_rows, RW_WARPS)),
            dim3(RW_WARPS * mm__gpu_warp_size()), RW_WARPS * rwb, (cudaStream_t)stream, *p,
            d_logits, ls, (int)n_rows, d_ids, d_weights, (int)rwb, (int)plan_off));
        MM_GPU_CHECK(cudaGetLastError());
        return plan_par_launch((cudaStream_t)stream, d_ids, d_weights, n_rows, p->top_k,
                               p->n_experts, d_offs, d_src_row, d_dst_slot, d_wt, d_err);
    }
    const size_t shmem = plan_off + (par ? 0 : (size_t)p->n_experts * sizeof(int32_t));
    MM_GPU_CHECK(mm_launch_dep(route_plan_fused_kernel, dim3((unsigned)n_rows), dim3(PLAN_THREADS),
        shmem, (cudaStream_t)stream, *p, d_logits, ls, (int)n_rows, d_ids, d_weights, d_offs,
        d_src_row, d_dst_slot, d_wt, d_err, d_count, plan_off, !par, one_row_on()));
    MM_GPU_CHECK(cudaGetLastError());
    if (par)
        return plan_par_launch((cudaStream_t)stream, d_ids, d_weights, n_rows, p->top_k,
                               p->n_experts, d_offs, d_src_row, d_dst_slot, d_wt, d_err);
    return MM_OK;
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
