// SPDX-License-Identifier: MIT
// Device helpers of the mesh's device routing plan (docs/MESH.md "Device frames"): the router
// splits a layer's plan (route_plan's offs/src/dst) into each expert owner's share, picks each
// (row, rank) slot's output from its owner's reply, and owners count their experts' rows,
// all on the device, so that no host reads the routing during a step; owners check the share
// they receive before their products read it (mm_gpu_mesh_plan_check). Pure index and copy
// work: no arithmetic on the rows, so nothing here can change a bit. Compiled by nvcc or
// hipcc (vendor.h). The C callers (services/router/step.c, services/expert/expert.c) declare
// these entry points weak: a build without GPU support has none.
//
// Design notes:
// - mesh_plan_split: one block per owner. A serial scan over the experts (E <= MAX_E, in shared
//   memory; 128 experts take well under a microsecond) gives each owner's offsets; the sorted
//   slots are then placed in parallel: the owner's experts' slots first, in the plan's order
//   (expert ascending, slot order within an expert: exactly route_plan's order restricted to
//   the owner), then every other slot (so the owner's share is a permutation of all n_slots
//   slots and every src/dst entry past offs[E] is still a valid row; mm_model_experts_plan's
//   contract).
#include "gpu_common.cuh"
#include "mm/err.h"

#define MAX_E 1024
#define SPLIT_THREADS 256

// The owners' frames (mm_gpu_mesh_plan_split_to), by value: owner o's x rows and share, or NULL.
#define SPLIT_MAX_OWNERS 16
struct split_places {
    float *x[SPLIT_MAX_OWNERS];
    int32_t *share[SPLIT_MAX_OWNERS];
};

// out + o * out_stride (places.share[o] where the places are given, that owner skipped where it
// is NULL): offs_o (E+1) | src_o (n) | dst_o (n), int32. Blocks (o, y > 0), with the places
// given: slice y - 1 of the x_n floats of x_src copied to places.x[o] (gridDim.y - 1 slices).
__global__ void mesh_plan_split_kernel(const int32_t *offs, const int32_t *src,
                                       const int32_t *dst, const int32_t *owner_of, int E,
                                       int n, int32_t *out, int64_t out_stride,
                                       split_places places, int use_places,
                                       const float *x_src, int64_t x_n) {
    if (use_places && blockIdx.y > 0) { // the x rows into the owner's frame
        float *xo = places.x[blockIdx.x];
        if (xo == NULL)
            return;
        const int64_t per = (x_n + gridDim.y - 2) / (gridDim.y - 1), a = (blockIdx.y - 1) * per;
        const int64_t b = a + per < x_n ? a + per : x_n;
        for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x)
            xo[i] = x_src[i];
        return;
    }
    if (use_places && places.share[blockIdx.x] == NULL)
        return;
    __shared__ int32_t s_offs[MAX_E + 1];
    __shared__ int32_t s_own[MAX_E + 1];  // owned-slot offsets of each expert (scan)
    __shared__ int32_t s_not[MAX_E + 1];  // not-owned-slot offsets of each expert (scan)
    __shared__ int32_t s_is[MAX_E];       // expert owned by this block's owner
    const int o = blockIdx.x;
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        s_offs[e] = offs[e];
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        s_is[e] = owner_of[e] == o;
    __syncthreads();
    if (threadIdx.x == 0) {
        int a = 0, b = 0;
        for (int e = 0; e < E; e++) {
            s_own[e] = a;
            s_not[e] = b;
            const int c = s_offs[e + 1] - s_offs[e];
            if (s_is[e])
                a += c;
            else
                b += c;
        }
        s_own[E] = a;
        s_not[E] = b;
    }
    __syncthreads();
    int32_t *offs_o = use_places ? places.share[o] : out + (int64_t)o * out_stride;
    int32_t *src_o = offs_o + E + 1, *dst_o = src_o + n;
    const int n_own = s_own[E];
    for (int e = threadIdx.x; e <= E; e += blockDim.x) // another owner's expert: no slots
        offs_o[e] = s_own[e];
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        // the expert of sorted slot p: the last e with offs[e] <= p (offs non-decreasing)
        int lo = 0, hi = E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (s_offs[mid] <= p)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int e = lo, j = p - s_offs[e];
        const int q = s_is[e] ? s_own[e] + j : n_own + s_not[e] + j;
        src_o[q] = src[p];
        dst_o[q] = dst[p];
    }
}

// eo[t] = ys[owner_of[ids[t]] * ys_owner_rows + t] for t < n, rows of dim floats.
__global__ void mesh_pick_kernel(const float *ys, int64_t ys_owner_rows, const int32_t *ids,
                                 const int32_t *owner_of, float *eo, int dim) {
    const int t = blockIdx.x;
    const int o = owner_of[ids[t]];
    const float *s = ys + ((int64_t)o * ys_owner_rows + t) * dim;
    float *d = eo + (int64_t)t * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        d[j] = s[j];
}

// counts[e] += offs[e+1] - offs[e] for e < E.
__global__ void mesh_count_kernel(const int32_t *offs, int E, uint64_t *counts) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x)
        counts[e] += (uint64_t)(offs[e + 1] - offs[e]);
}

// A plan share that breaks mm_model_experts_plan's contract (offs non-decreasing from 0 up to at
// most n; every src in [0, rows); every dst in [0, n)) is emptied in place before the products
// read it (offs all 0: no expert has rows; src 0 and dst p: valid rows past offs[E]), so no
// product reads or writes outside its buffers, and flag[0] = tag, flag[1] = step_lo (pinned host
// memory the owner's host reads at its next frame). One block; nothing is changed in a good share,
// whose rows per expert are added to counts (if not NULL; mesh_count_kernel's sums).
__global__ void mesh_plan_check_kernel(int32_t *offs, int E, int32_t *src, int32_t *dst, int n,
                                       int rows, uint32_t tag, uint32_t step_lo,
                                       volatile uint32_t *flag, uint64_t *counts) {
    int bad = threadIdx.x == 0 && (offs[0] != 0 || offs[E] > n);
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        bad |= offs[e + 1] < offs[e];
    for (int p = threadIdx.x; p < n; p += blockDim.x)
        bad |= src[p] < 0 || src[p] >= rows || dst[p] < 0 || dst[p] >= n;
    if (!__syncthreads_or(bad)) {
        for (int e = threadIdx.x; counts != NULL && e < E; e += blockDim.x)
            counts[e] += (uint64_t)(offs[e + 1] - offs[e]);
        return;
    }
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        offs[e] = 0;
    for (int p = threadIdx.x; p < n; p += blockDim.x)
        src[p] = 0, dst[p] = p;
    if (threadIdx.x == 0) {
        flag[1] = step_lo;
        __threadfence_system();
        flag[0] = tag;
        __threadfence_system();
    }
}

// mm_gpu_mesh_plan_check: an expert owner's check of the plan share it received (offs (E+1),
// src and dst (n_slots) at d_plan, device, writable: the frame's own bytes) against x rows of
// `rows`: a bad share is emptied in place and h_flag (pinned host, 2 words, device-writable)
// set to {tag (non-zero), step_lo}; see mesh_plan_check_kernel. d_counts (device, n_experts
// u64, or NULL): a good share's rows per expert added, as mm_gpu_mesh_count does.
extern "C" mm_err mm_gpu_mesh_plan_check(void *stream, int32_t *d_plan, int n_experts,
                                         int n_slots, int rows, uint32_t tag, uint32_t step_lo,
                                         uint32_t *h_flag, uint64_t *d_counts) {
    if (!d_plan || !h_flag || n_experts < 1 || n_slots < 0 || rows < 1 || tag == 0)
        return MM_EINVAL;
    mesh_plan_check_kernel<<<1, SPLIT_THREADS, 0, (cudaStream_t)stream>>>(
        d_plan, n_experts, d_plan + n_experts + 1, d_plan + n_experts + 1 + n_slots, n_slots,
        rows, tag, step_lo, h_flag, d_counts);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// mm_gpu_mesh_plan_split: for owners 0..n_owners-1, owner o's share of a plan (offs (E+1), src
// and dst (n_slots), device) at out + o * out_stride int32s: offs_o (E+1), src_o, dst_o
// (n_slots each). owner_of (E, device): the owner serving each expert (any other value: none).
// Where an expert is not the owner's, offs_o gives it no slots.
extern "C" mm_err mm_gpu_mesh_plan_split(void *stream, const int32_t *d_offs,
                                         const int32_t *d_src, const int32_t *d_dst,
                                         const int32_t *d_owner_of, int n_experts, int n_slots,
                                         int n_owners, int32_t *d_out, int64_t out_stride) {
    if (!d_offs || !d_src || !d_dst || !d_owner_of || !d_out || n_experts < 1 ||
        n_experts > MAX_E || n_slots < 0 || n_owners < 1 ||
        out_stride < (int64_t)n_experts + 1 + 2 * (int64_t)n_slots)
        return MM_EINVAL;
    split_places none = {};
    mesh_plan_split_kernel<<<n_owners, SPLIT_THREADS, 0, (cudaStream_t)stream>>>(
        d_offs, d_src, d_dst, d_owner_of, n_experts, n_slots, d_out, out_stride, none, 0, NULL, 0);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// mm_gpu_mesh_plan_split_to: mm_gpu_mesh_plan_split with each owner's share written straight into
// its frame: d_frames[o] (device; NULL: owner o gets no frame) holds x_rows x dim floats, copied
// from d_x, then owner o's share (offs, src, dst as above), so the router sends each frame as
// it lies (in the owner's ring: no copy at the send). One launch for every owner's share and x.
// n_owners at most 16 (MM_EINVAL beyond).
extern "C" mm_err mm_gpu_mesh_plan_split_to(void *stream, const int32_t *d_offs,
                                            const int32_t *d_src, const int32_t *d_dst,
                                            const int32_t *d_owner_of, int n_experts, int n_slots,
                                            int n_owners, const float *d_x, int64_t x_rows,
                                            int dim, float *const *d_frames) {
    if (!d_offs || !d_src || !d_dst || !d_owner_of || !d_x || !d_frames || n_experts < 1 ||
        n_experts > MAX_E || n_slots < 0 || n_owners < 1 || n_owners > SPLIT_MAX_OWNERS ||
        x_rows < 1 || dim < 1)
        return MM_EINVAL;
    split_places pl = {};
    for (int o = 0; o < n_owners; o++) {
        pl.x[o] = d_frames[o];
        pl.share[o] = d_frames[o] ? (int32_t *)(d_frames[o] + x_rows * dim) : NULL;
    }
    const int64_t x_n = x_rows * dim;
    const int64_t slices = (x_n + SPLIT_THREADS * 8 - 1) / (SPLIT_THREADS * 8);
    const dim3 grid((unsigned)n_owners, (unsigned)(1 + (slices < 64 ? slices : 64)));
    mesh_plan_split_kernel<<<grid, SPLIT_THREADS, 0, (cudaStream_t)stream>>>(
        d_offs, d_src, d_dst, d_owner_of, n_experts, n_slots, NULL, 0, pl, 1, d_x, x_n);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// mm_gpu_mesh_pick: eo row t = row t of the reply of the owner of slot t's expert: ys holds
// each owner's reply of n_slots rows (dim floats) at ys + o * ys_owner_rows * dim.
extern "C" mm_err mm_gpu_mesh_pick(void *stream, const float *d_ys, int64_t ys_owner_rows,
                                   const int32_t *d_ids, const int32_t *d_owner_of, int n_slots,
                                   int dim, float *d_eo) {
    if (!d_ys || !d_ids || !d_owner_of || !d_eo || n_slots < 0 || dim < 1 ||
        ys_owner_rows < n_slots)
        return MM_EINVAL;
    if (n_slots == 0)
        return MM_OK;
    mesh_pick_kernel<<<n_slots, 256, 0, (cudaStream_t)stream>>>(d_ys, ys_owner_rows, d_ids,
                                                                d_owner_of, d_eo, dim);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// mm_gpu_mesh_count: counts[e] += offs[e+1] - offs[e] (device u64 array of n_experts).
extern "C" mm_err mm_gpu_mesh_count(void *stream, const int32_t *d_offs, int n_experts,
                                    uint64_t *d_counts) {
    if (!d_offs || !d_counts || n_experts < 1)
        return MM_EINVAL;
    mesh_count_kernel<<<1, 256, 0, (cudaStream_t)stream>>>(d_offs, n_experts, d_counts);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}
