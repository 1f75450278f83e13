// SPDX-License-Identifier: MIT
// Read rate of bulk copies (cp.async.bulk, global -> shared) against the size of each copy, at
// the decode GEMV v3's shapes (docs/BENCHMARKS.md "Bulk copy size"): each block copies its own
// contiguous piece of `per` bytes into shared memory as per / req copies of req bytes (one
// mbarrier, lanes of warp 0 issuing them in parallel, as gemv_bulk_kernel does with one copy per
// W row), waits for them and exits. A launch reads grid * per bytes from a 4 GiB buffer at an
// offset rotated every launch, so nothing comes from the L2. Rate = bytes / kernel time (CUDA
// events around 20 launches, best of 5 such runs). Also a plain streaming read (16-byte loads,
// 8 in flight per thread) of the same bytes by the same grid, and cudaMemcpy's copy rate.
//     nvcc -O2 -arch=sm_90 -o bulk_rate kernels/cuda/bench/bulk_rate.cu && ./bulk_rate
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

__global__ void __launch_bounds__(256) bulk_kernel(const char *src, int per, int req, unsigned *sink) {
    extern __shared__ __align__(128) char sm[];
    __shared__ __align__(8) uint64_t bar;
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(&bar);
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(sm);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(b) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const char *p = src + (size_t)blockIdx.x * per;
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(per) : "memory");
        __syncwarp();
        for (int i = threadIdx.x; i < per / req; i += 32)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                         ::"r"(d + (uint32_t)(i * req)), "l"(p + (size_t)i * req), "r"(req), "r"(b) : "memory");
    }
    asm volatile("{\n.reg .pred q;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 q, [%0], 0;\n@!q bra W;\n}\n"
                 ::"r"(b) : "memory");
    if (threadIdx.x == 0 && sm[per - 1] == 123 && sm[0] == 45)
        atomicAdd(sink, 1u); // keeps the copies observable
}

__global__ void __launch_bounds__(256) load_kernel(const char *src, int per, unsigned *sink) {
    const uint4 *p = (const uint4 *)(src + (size_t)blockIdx.x * per);
    const int n = per / 16;
    uint32_t acc = 0;
    for (int i = threadIdx.x; i < n; i += 256 * 8) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            v[u] = i + u * 256 < n ? __ldcs(p + i + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 8; u++)
            acc ^= v[u].x ^ v[u].w;
    }
    if (acc == 0x12345678u)
        atomicAdd(sink, 1u);
}

static const size_t BUF = (size_t)4 << 30;

// best-of-5 rate in GB/s of `launch` reading grid * per bytes per launch, offsets rotated
template <class F>
static double rate(F launch, int grid, int per) {
    const size_t bytes = (size_t)grid * per;
    const size_t slots = BUF / ((bytes + 4095) / 4096 * 4096);
    cudaEvent_t a, z;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&z));
    double best = 0;
    size_t slot = 0;
    for (int run = 0; run < 6; run++) {
        CK(cudaEventRecord(a));
        for (int it = 0; it < 20; it++) {
            launch((size_t)(slot % slots) * ((bytes + 4095) / 4096 * 4096));
            slot++;
        }
        CK(cudaEventRecord(z));
        CK(cudaEventSynchronize(z));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, z));
        const double gbs = (double)bytes * 20 / (ms * 1e-3) / 1e9;
        if (run > 0 && gbs > best)
            best = gbs;
    }
    CK(cudaGetLastError());
    return best;
}

int main(void) {
    char *buf = NULL;
    unsigned *sink = NULL;
    CK(cudaMalloc(&buf, BUF));
    CK(cudaMemset(buf, 1, BUF));
    CK(cudaMalloc(&sink, 4));
    CK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    { // cudaMemcpy device to device, bytes read + written
        char *dst = NULL;
        const size_t n = (size_t)1 << 30;
        CK(cudaMalloc(&dst, n));
        cudaEvent_t a, z;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&z));
        CK(cudaMemcpy(dst, buf, n, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(a));
        for (int i = 0; i < 5; i++)
            CK(cudaMemcpy(dst, buf + (size_t)(i % 3) * n, n, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(z));
        CK(cudaEventSynchronize(z));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, z));
        printf("copy (cudaMemcpy D2D, read + write): %.0f GB/s\n", 2.0 * n * 5 / (ms * 1e-3) / 1e9);
        CK(cudaFree(dst));
    }
    // (bytes per block, blocks per SM, label): down's 2-tile blocks (32 rows x 1536 B), [gate;
    // up]'s 1-tile blocks (16 rows x 4096 B), o_proj's (16 rows x 8192 B); waves: 1 and 2
    struct cfg { int per, bps, waves; const char *what; } cfgs[] = {
        {32 * 1536, 4, 1, "down-like: 32 rows x 1536 B, 4 blocks/SM, 1 wave"},
        {32 * 1536, 4, 2, "down-like: 32 rows x 1536 B, 4 blocks/SM, 2 waves"},
        {16 * 4096, 3, 2, "gate/up-like: 16 rows x 4096 B, 3 blocks/SM, 2 waves"},
        {16 * 8192, 1, 1, "o_proj-like: 16 rows x 8192 B, 1 block/SM, 1 wave"},
    };
    const int reqs[] = {256, 512, 1536, 4096, 8192, 16384, 49152, 65536, 131072};
    for (const cfg &c : cfgs) {
        const int grid = sms * c.bps * c.waves;
        printf("%s: grid %d, %.1f MB a launch\n", c.what, grid, (double)grid * c.per / 1e6);
        for (int r : reqs) {
            if (r > c.per || c.per % r != 0)
                continue;
            const double g = rate([&](size_t off) {
                bulk_kernel<<<grid, 256, c.per>>>(buf + off, c.per, r, sink);
            }, grid, c.per);
            printf("  bulk copies of %6d B (%3d a block): %6.0f GB/s\n", r, c.per / r, g);
        }
        const double g = rate([&](size_t off) { load_kernel<<<grid, 256>>>(buf + off, c.per, sink); },
                              grid, c.per);
        printf("  16-byte loads (8 in flight a thread):   %6.0f GB/s\n", g);
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
