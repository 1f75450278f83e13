// SPDX-License-Identifier: MIT
// NVIDIA side of the vendor layer: the CUDA runtime under its own names, warp width 32, and
// the tensor-core (WMMA) path. Included only through kernels/cuda/vendor.h.
#ifndef MM_GPU_VENDOR_CUDA_H
#define MM_GPU_VENDOR_CUDA_H

#include <cuda_runtime.h>
#include <mma.h>
#include <cuda_bf16.h>

#define MM_GPU_VENDOR "cuda"
#define MM_WARP_SIZE 32
#define MM_GPU_MAX_WARP_SIZE 32
// Tensor cores through nvcuda::wmma (bf16 x bf16 -> f32); HIP builds take the FMA path.
#define MM_GPU_HAVE_WMMA 1
// Stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32, reached through the
// runtime's driver entry points): the cudaipc transport's frame flags (kernels/cuda/ipc.cu).
// HIP builds keep the interprocess events.
#define MM_GPU_HAVE_STREAM_MEMOPS 1
typedef __nv_bfloat16 mm_gpu_wmma_bf16;
namespace mm_wmma = nvcuda::wmma;

#define mm_shfl_xor(v, mask) __shfl_xor_sync(0xffffffffu, (v), (mask))
#define mm_shfl_up(v, d)     __shfl_up_sync(0xffffffffu, (v), (d))
#define mm_shfl(v, src)      __shfl_sync(0xffffffffu, (v), (src))
// nanoseconds of the device's global timer (one clock for every process on the GPU; the mesh's
// GPU trace stamps, ipc.cu)
__device__ __forceinline__ unsigned long long mm_gpu_global_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// an int32 load through the L2 only (not an SM's cache of it: another kernel may have written it)
__device__ __forceinline__ int mm_ld_cg(const int *p) { return __ldcg(p); }

// "no GPU here" codes: a host without the driver reports InsufficientDriver (35), a host with
// the driver and no card NoDevice (100). Both mean: skip, not fail.
#define MM_GPU_ERR_NO_DRIVER cudaErrorInsufficientDriver
#define MM_GPU_ERR_NO_DEVICE cudaErrorNoDevice

#endif
