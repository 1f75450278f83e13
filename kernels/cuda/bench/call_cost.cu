// SPDX-License-Identifier: MIT
// Host time per CUDA call (enqueue only, 2000 calls on one non-blocking stream): a plain launch,
// cudaLaunchKernelEx with and without the programmatic-serialization attribute (our kernels'
// form), an 8 KB device-to-device cudaMemcpyAsync, event records (plain and interprocess),
// cuStreamWriteValue32, cudaSetDevice, and a launch + synchronize round trip. What a mesh
// daemon's stage costs its host per call (kernels/cuda/bench/NOTES.md "Host cost per CUDA call").
//     nvcc -O2 -arch=sm_90 -o call_cost kernels/cuda/bench/call_cost.cu && ./call_cost
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdio.h>
#include <time.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)
__global__ void empty(int *p) { if (p && threadIdx.x == 1234567) *p = 1; }
__global__ void pdl(int *p) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (p && threadIdx.x == 1234567) *p = 1;
    asm volatile("griddepcontrol.launch_dependents;");
}
static double now_us() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
int main() {
    CK(cudaSetDevice(0));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int *d; CK(cudaMalloc(&d, 1 << 20));
    cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaEvent_t iev; CK(cudaEventCreateWithFlags(&iev, cudaEventDisableTiming | cudaEventInterprocess));
    PFN_cuStreamWriteValue32_v11070 wv; cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", (void **)&wv, 11070, cudaEnableDefault, &q));
    const int N = 2000;
    for (int rep = 0; rep < 2; rep++) {
        double t0, t1;
        // (a) plain launch
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) empty<<<1, 32, 0, st>>>(d);
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("plain launch            %.2f us/call\n", (t1 - t0) / N);
        // (b) cudaLaunchKernelEx with PDL
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(1); cfg.blockDim = dim3(32); cfg.stream = st;
        cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at; cfg.numAttrs = 1;
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaLaunchKernelEx(&cfg, pdl, d));
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("launch with PDL attr    %.2f us/call\n", (t1 - t0) / N);
        // (b2) cudaLaunchKernelEx without attrs
        cfg.numAttrs = 0;
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaLaunchKernelEx(&cfg, empty, d));
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("launchEx no attr        %.2f us/call\n", (t1 - t0) / N);
        // (c) memcpy d2d 8 KB
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaMemcpyAsync(d + 4096, d, 8192, cudaMemcpyDeviceToDevice, st));
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("memcpyAsync d2d 8 KB    %.2f us/call\n", (t1 - t0) / N);
        // (c2) memcpy default kind
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaMemcpyAsync(d + 4096, d, 8192, cudaMemcpyDefault, st));
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("memcpyAsync default 8KB %.2f us/call\n", (t1 - t0) / N);
        // (d) event record
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaEventRecord(ev, st));
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("eventRecord             %.2f us/call\n", (t1 - t0) / N);
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaEventRecord(iev, st));
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("eventRecord (IPC)       %.2f us/call\n", (t1 - t0) / N);
        // (e) write value
        CK(cudaStreamSynchronize(st)); t0 = now_us();
        for (int i = 0; i < N; i++) wv((CUstream)st, (CUdeviceptr)(d + 8192), i, 0);
        t1 = now_us(); CK(cudaStreamSynchronize(st));
        printf("cuStreamWriteValue32    %.2f us/call\n", (t1 - t0) / N);
        // (f) cudaSetDevice
        t0 = now_us();
        for (int i = 0; i < N; i++) CK(cudaSetDevice(0));
        t1 = now_us();
        printf("cudaSetDevice           %.2f us/call\n", (t1 - t0) / N);
        // (g) launch latency: launch + sync round trip
        t0 = now_us();
        for (int i = 0; i < 200; i++) { empty<<<1, 32, 0, st>>>(d); CK(cudaStreamSynchronize(st)); }
        t1 = now_us();
        printf("launch + sync           %.2f us\n", (t1 - t0) / 200);
    }
    return 0;
}
