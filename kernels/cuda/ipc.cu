// SPDX-License-Identifier: MIT
// Inter-process device memory and events for the cudaipc:// data-plane transport
// (common/transport/cudaipc.c): exporting a device buffer and an event to another process of the
// same host, opening them there, stream-ordered copies into the mapped memory, and the
// cross-process ordering (record an event on one process's stream, make another process's
// stream wait for it). Compiled by nvcc (cudaIpc*) or hipcc (hipIpc*, vendor/hip.h).
//
// Design notes:
// - Handles are opaque 64-byte blobs (cudaIpcMemHandle_t / cudaIpcEventHandle_t are 64 bytes;
//   hipIpc* likewise); the transport ships them in its handshake and never looks inside.
// - Events are created with cudaEventInterprocess | cudaEventDisableTiming (required for IPC).
//   A cudaStreamWaitEvent on an opened event waits for the most recent record made before the
//   call, in whichever process made it: the transport records before it publishes a frame, and
//   waits only after it has seen the frame, so the wait always covers the data.
// - Nothing here blocks except mm_gpu_event_sync; every other call only enqueues.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_common.cuh"
#include "mm_gpu.h"

static_assert(sizeof(cudaIpcMemHandle_t) <= MM_GPU_IPC_HANDLE_BYTES, "IPC memory handle size");
static_assert(sizeof(cudaIpcEventHandle_t) <= MM_GPU_IPC_HANDLE_BYTES, "IPC event handle size");

extern "C" mm_err mm_gpu_ipc_mem_export(const void *d_ptr, void *handle) {
    if (d_ptr == NULL || handle == NULL)
        return MM_EINVAL;
    cudaIpcMemHandle_t h;
    MM_GPU_CHECK(cudaIpcGetMemHandle(&h, (void *)d_ptr));
    memset(handle, 0, MM_GPU_IPC_HANDLE_BYTES);
    memcpy(handle, &h, sizeof(h));
    return MM_OK;
}

extern "C" mm_err mm_gpu_ipc_mem_open(const void *handle, void **d_out) {
    if (handle == NULL || d_out == NULL)
        return MM_EINVAL;
    *d_out = NULL;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    MM_GPU_CHECK(cudaIpcOpenMemHandle(d_out, h, cudaIpcMemLazyEnablePeerAccess));
    return MM_OK;
}

extern "C" void mm_gpu_ipc_mem_close(void *d_ptr) {
    if (d_ptr != NULL)
        (void)cudaIpcCloseMemHandle(d_ptr);
}

extern "C" mm_err mm_gpu_ipc_event_new(void **ev, void *handle) {
    if (ev == NULL || handle == NULL)
        return MM_EINVAL;
    *ev = NULL;
    cudaEvent_t e;
    MM_GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming));
    cudaIpcEventHandle_t h;
    cudaError_t rc = cudaIpcGetEventHandle(&h, e);
    if (rc != cudaSuccess) {
        mm__gpu_report("cudaIpcGetEventHandle(&h, e)", __FILE__, __LINE__, cudaGetErrorString(rc));
        (void)cudaEventDestroy(e);
        return MM_EDEVICE;
    }
    memset(handle, 0, MM_GPU_IPC_HANDLE_BYTES);
    memcpy(handle, &h, sizeof(h));
    *ev = (void *)e;
    return MM_OK;
}

extern "C" mm_err mm_gpu_ipc_event_open(const void *handle, void **ev) {
    if (handle == NULL || ev == NULL)
        return MM_EINVAL;
    *ev = NULL;
    cudaIpcEventHandle_t h;
    memcpy(&h, handle, sizeof(h));
    cudaEvent_t e;
    MM_GPU_CHECK(cudaIpcOpenEventHandle(&e, h));
    *ev = (void *)e;
    return MM_OK;
}

extern "C" void mm_gpu_event_free(void *ev) {
    if (ev != NULL)
        (void)cudaEventDestroy((cudaEvent_t)ev);
}

extern "C" mm_err mm_gpu_event_record(void *ev, void *stream) {
    MM_GPU_CHECK(cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream));
    return MM_OK;
}

extern "C" mm_err mm_gpu_stream_wait_event(void *stream, void *ev) {
    MM_GPU_CHECK(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)ev, 0));
    return MM_OK;
}

extern "C" mm_err mm_gpu_event_sync(void *ev) {
    // bounded: an interprocess event of a peer that died may never complete
    return mm__gpu_wait_event((cudaEvent_t)ev, "interprocess event");
}

extern "C" mm_err mm_gpu_memcpy_any(void *stream, void *d_dst, const void *d_src, size_t n_bytes) {
    if (n_bytes == 0)
        return MM_OK;
    // cudaMemcpyDefault: unified addressing picks device-to-device or peer (another GPU).
    MM_GPU_CHECK(cudaMemcpyAsync(d_dst, d_src, n_bytes, cudaMemcpyDefault, (cudaStream_t)stream));
    return MM_OK;
}

// ---- frame flags (mm_gpu.h) ------------------------------------------------------------------
#if MM_GPU_HAVE_STREAM_MEMOPS
#include <cudaTypedefs.h>
static PFN_cuStreamWaitValue32_v11070 g_wait_value;
static PFN_cuStreamWriteValue32_v11070 g_write_value;
static pthread_once_t g_flags_once = PTHREAD_ONCE_INIT;
static bool g_flags;

// The spin form of a flag wait (mm_gpu_flag_wait with spin): one thread polls the flag
// and lets the stream's next kernel launch only once the flag has its value (so a waiting daemon
// holds one block, never its next stage's blocks, which could hold the SMs the writer needs);
// its own griddepcontrol.wait keeps it from completing before the kernel in front of it. The next
// kernel, a programmatic dependent, is then launched while this one ends: a waiting stream's next
// kernel starts ~2.3 us after a cuStreamWriteValue32 lands, against ~3.9 us behind
// cuStreamWaitValue32 (H200 under MPS, kernels/cuda/bench/ipc_wake.cu modes 1 4 and 1 1).
__global__ void flag_spin_kernel(const uint32_t *f, uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    for (;;) { // relaxed loads: an acquire load per poll would invalidate the SM's L1 each time
        uint32_t x;
        asm volatile("ld.relaxed.sys.global.u32 %0, [%1];\n" : "=r"(x) : "l"(f) : "memory");
        if ((int32_t)(x - v) >= 0)
            break;
    }
    asm volatile("fence.acq_rel.sys;\n" ::: "memory");
#else
    while ((int32_t)(*(const volatile uint32_t *)f - v) < 0) {
    }
    __threadfence_system();
#endif
    mm_dep_signal();
    mm_dep_wait();
}

static void flags_init(void) {
    const char *env = getenv("MM_CUDAIPC_FLAGS");
    if (env && strcmp(env, "0") == 0)
        return;
    cudaDriverEntryPointQueryResult q1, q2;
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", (void **)&g_wait_value, 11070,
                                         cudaEnableDefault, &q1) != cudaSuccess ||
        cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", (void **)&g_write_value, 11070,
                                         cudaEnableDefault, &q2) != cudaSuccess ||
        q1 != cudaDriverEntryPointSuccess || q2 != cudaDriverEntryPointSuccess ||
        !g_wait_value || !g_write_value) {
        (void)cudaGetLastError();
        mm_log_info("cudaipc: no stream memory operations in this driver: interprocess events");
        return;
    }
    g_flags = true;
}
#endif

extern "C" bool mm_gpu_flags_ok(void) {
#if MM_GPU_HAVE_STREAM_MEMOPS
    pthread_once(&g_flags_once, flags_init);
    return g_flags;
#else
    return false;
#endif
}

// flag_op: one stream memory operation on d_flag (write: *d_flag = v after the stream's earlier
// work, with the default memory barrier so that work is visible; else wait until
// (int32_t)(*d_flag - v) >= 0)
static mm_err flag_op(void *stream, const void *d_flag, uint32_t v, bool write, bool spin) {
#if MM_GPU_HAVE_STREAM_MEMOPS
    if (!mm_gpu_flags_ok() || d_flag == NULL)
        return MM_EUNSUPP;
    if (!write && spin) {
        MM_GPU_CHECK(mm_launch_dep(flag_spin_kernel, dim3(1), dim3(1), 0, (cudaStream_t)stream,
                                   (const uint32_t *)d_flag, v));
        return MM_OK;
    }
    const CUdeviceptr at = (CUdeviceptr)(uintptr_t)d_flag;
    const CUresult r = write ? g_write_value((CUstream)stream, at, v, CU_STREAM_WRITE_VALUE_DEFAULT)
                             : g_wait_value((CUstream)stream, at, v, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
        mm__gpu_report(write ? "cuStreamWriteValue32" : "cuStreamWaitValue32", __FILE__, __LINE__,
                       "driver error");
        return MM_EDEVICE;
    }
    return MM_OK;
#else
    (void)stream, (void)d_flag, (void)v, (void)write, (void)spin;
    return MM_EUNSUPP;
#endif
}

extern "C" mm_err mm_gpu_flag_write(void *stream, void *d_flag, uint32_t v) {
    return flag_op(stream, d_flag, v, true, false);
}

extern "C" mm_err mm_gpu_flag_wait(void *stream, const void *d_flag, uint32_t v, bool spin) {
    return flag_op(stream, d_flag, v, false, spin);
}

extern "C" mm_err mm_gpu_flag_set(void *d_flag, uint32_t v) {
    if (d_flag == NULL)
        return MM_EINVAL;
    cudaStream_t s;
    MM_GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const cudaError_t e1 = cudaMemcpyAsync(d_flag, &v, sizeof(v), cudaMemcpyHostToDevice, s);
    const mm_err w = e1 == cudaSuccess ? mm__gpu_drain(s, "frame flag") : MM_EDEVICE;
    (void)cudaStreamDestroy(s);
    if (e1 != cudaSuccess)
        mm__gpu_report("cudaMemcpyAsync(flag)", __FILE__, __LINE__, cudaGetErrorString(e1));
    return w;
}

extern "C" mm_err mm_gpu_device_pci_id(int dev, char id[32]) {
    if (id == NULL)
        return MM_EINVAL;
    MM_GPU_CHECK(cudaDeviceGetPCIBusId(id, 32, dev));
    return MM_OK;
}

extern "C" mm_err mm_gpu_current_device(int *dev) {
    if (dev == NULL)
        return MM_EINVAL;
    MM_GPU_CHECK(cudaGetDevice(dev));
    return MM_OK;
}

// ---- GPU trace stamps of the mesh (MM_MESH_TRACE_GPU=1, common/transport/gtrace.c) -----------
// A one-thread kernel writes the device's global timer (ns, one clock for every process on the
// GPU) into a slot of pinned host memory when the stream reaches it, so the daemons' stage
// boundaries can be merged on the GPU's own time line. A diagnostic: each stamp is a launch.
__global__ void ipc_stamp_kernel(unsigned long long *slot) {
    *slot = mm_gpu_global_ns() | 1ull; // never 0: 0 marks a slot not written yet
    __threadfence_system();
}

extern "C" mm_err mm_gpu_mesh_stamp(void *stream, uint64_t *h_slot) {
    if (h_slot == NULL)
        return MM_EINVAL;
    ipc_stamp_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((unsigned long long *)h_slot);
    MM_GPU_CHECK(cudaGetLastError());
    return MM_OK;
}

// pinned host memory the device writes directly (unified addressing: the same pointer)
extern "C" mm_err mm_gpu_host_pinned(void **p, size_t n_bytes) {
    if (p == NULL || n_bytes == 0)
        return MM_EINVAL;
    *p = NULL;
    MM_GPU_CHECK(cudaMallocHost(p, n_bytes));
    return MM_OK;
}

extern "C" void mm_gpu_host_pinned_free(void *p) {
    if (p != NULL)
        (void)cudaFreeHost(p);
}

// The mesh's device-plan entry points (mesh_ops.cu) are called through weak references
// (services/router/step.c, services/expert/expert.c, which a build without GPU support also
// links), and a weak reference does not pull a member out of libmoemesh.a. This object is
// always linked into a GPU build (the backend calls into it), so its strong references here
// bring mesh_ops.cu's object along.
extern "C" mm_err mm_gpu_mesh_plan_split(void *, const int32_t *, const int32_t *,
                                         const int32_t *, const int32_t *, int, int, int,
                                         int32_t *, int64_t);
extern "C" mm_err mm_gpu_mesh_pick(void *, const float *, int64_t, const int32_t *,
                                   const int32_t *, int, int, float *);
extern "C" mm_err mm_gpu_mesh_count(void *, const int32_t *, int, uint64_t *);
extern "C" mm_err mm_gpu_mesh_plan_check(void *, int32_t *, int, int, int, uint32_t, uint32_t,
                                         uint32_t *, uint64_t *);
extern "C" {
__attribute__((used)) void *mm__gpu_mesh_ops_keep[] = {
    (void *)mm_gpu_mesh_plan_split, (void *)mm_gpu_mesh_pick, (void *)mm_gpu_mesh_count,
    (void *)mm_gpu_mesh_plan_check};
}
