// SPDX-License-Identifier: MIT
// AMD side of the vendor layer: maps the CUDA spelling used by kernels/cuda/*.cu onto HIP
// (Debian 12's ROCm 5.2), sets the wavefront width, and leaves out the tensor-core path (no
// WMMA on HIP here: the GEMM kernels fall back to their FMA tiles). Included only through
// kernels/cuda/vendor.h when compiled by hipcc with -DMM_USE_HIP.
#ifndef MM_GPU_VENDOR_HIP_H
#define MM_GPU_VENDOR_HIP_H

#include <hip/hip_runtime.h>

#define MM_GPU_VENDOR "hip"
// gfx90a (CDNA2) runs 64-wide wavefronts; gfx1030 (RDNA2) defaults to 32. Device code sees
// the width of the architecture it is compiled for; host code never depends on it.
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define MM_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define MM_WARP_SIZE 64
#endif
#define MM_GPU_MAX_WARP_SIZE 64
#define MM_GPU_HAVE_WMMA 0
#define MM_GPU_HAVE_STREAM_MEMOPS 0 // (vendor/cuda.h): the cudaipc transport keeps its events

// ROCm 5.2 has no *_sync shuffles; a full wavefront takes part in every call we make.
#define mm_shfl_xor(v, mask) __shfl_xor((v), (mask))
#define mm_shfl_up(v, d)     __shfl_up((v), (d))
#define mm_shfl(v, src)      __shfl((v), (src))
// the device's constant-rate clock in nanoseconds (100 MHz on gfx90a; the mesh's trace stamps)
__device__ __forceinline__ unsigned long long mm_gpu_global_ns(void) {
#if defined(__HIP_DEVICE_COMPILE__)
    return (unsigned long long)wall_clock64() * 10ull;
#else
    return 0; // (the host pass of a device function)
#endif
}

// an int32 load that bypasses the non-coherent caches (volatile: a coherent load on AMD)
__device__ __forceinline__ int mm_ld_cg(const int *p) { return *(const volatile int *)p; }

#define cudaError_t                 hipError_t
#define cudaSuccess                 hipSuccess
#define cudaErrorInsufficientDriver hipErrorInsufficientDriver
#define cudaErrorNoDevice           hipErrorNoDevice
#define cudaGetErrorString          hipGetErrorString
#define cudaGetLastError            hipGetLastError
#define cudaGetDeviceCount          hipGetDeviceCount
#define cudaSetDevice               hipSetDevice
#define cudaGetDevice               hipGetDevice
#define cudaDeviceProp              hipDeviceProp_t
#define cudaGetDeviceProperties     hipGetDeviceProperties
#define cudaDeviceGetAttribute      hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDevAttrWarpSize         hipDeviceAttributeWarpSize
#define cudaErrorMemoryAllocation   hipErrorOutOfMemory
#define cudaDeviceSynchronize       hipDeviceSynchronize
#define cudaMalloc                  hipMalloc
#define cudaFree                    hipFree
#define cudaMallocHost              hipHostMalloc
#define cudaFreeHost                hipHostFree
#define cudaMemcpy                  hipMemcpy
#define cudaMemcpyAsync             hipMemcpyAsync
#define cudaMemcpyPeerAsync         hipMemcpyPeerAsync
#define cudaMemset                  hipMemset
#define cudaMemsetAsync             hipMemsetAsync
#define cudaMemcpyHostToDevice      hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost      hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice    hipMemcpyDeviceToDevice
#define cudaMemcpyDefault           hipMemcpyDefault
#define cudaStream_t                hipStream_t
#define cudaStreamCreate            hipStreamCreate
#define cudaStreamCreateWithFlags   hipStreamCreateWithFlags
#define cudaStreamNonBlocking       hipStreamNonBlocking
#define cudaStreamDestroy           hipStreamDestroy
#define cudaStreamSynchronize       hipStreamSynchronize
#define cudaStreamQuery             hipStreamQuery
#define cudaErrorNotReady           hipErrorNotReady
#define cudaEventQuery              hipEventQuery
#define cudaLaunchHostFunc          hipLaunchHostFunc
#define cudaStreamWaitEvent         hipStreamWaitEvent
#define cudaEvent_t                 hipEvent_t
#define cudaEventCreate             hipEventCreate
#define cudaEventCreateWithFlags    hipEventCreateWithFlags
#define cudaEventDisableTiming      hipEventDisableTiming
#define cudaEventDestroy            hipEventDestroy
#define cudaEventRecord             hipEventRecord
#define cudaEventSynchronize        hipEventSynchronize
#define cudaEventElapsedTime        hipEventElapsedTime
#define cudaFuncSetAttribute        hipFuncSetAttribute
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaIpcMemHandle_t          hipIpcMemHandle_t
#define cudaIpcGetMemHandle         hipIpcGetMemHandle
#define cudaIpcOpenMemHandle        hipIpcOpenMemHandle
#define cudaIpcCloseMemHandle       hipIpcCloseMemHandle
#define cudaIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define cudaErrorUnknown            hipErrorUnknown
#define cudaGraph_t                 hipGraph_t
#define cudaGraphExec_t             hipGraphExec_t
#define cudaStreamBeginCapture      hipStreamBeginCapture
#define cudaStreamEndCapture        hipStreamEndCapture
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaGraphInstantiateWithFlags hipGraphInstantiateWithFlags
#define cudaGraphLaunch             hipGraphLaunch
#define cudaGraphDestroy            hipGraphDestroy
#define cudaGraphExecDestroy        hipGraphExecDestroy
#define cudaIpcEventHandle_t        hipIpcEventHandle_t
#define cudaIpcGetEventHandle       hipIpcGetEventHandle
#define cudaIpcOpenEventHandle      hipIpcOpenEventHandle
#define cudaEventInterprocess       hipEventInterprocess
#define cudaDeviceGetPCIBusId       hipDeviceGetPCIBusId

#define MM_GPU_ERR_NO_DRIVER hipErrorInsufficientDriver
#define MM_GPU_ERR_NO_DEVICE hipErrorNoDevice

#endif
