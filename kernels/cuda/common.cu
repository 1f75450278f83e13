// SPDX-License-Identifier: MIT
// Device management, memory and streams for the GPU kernels, and the error report behind
// MM_GPU_CHECK. Device memory is reached only through these calls and the backend table.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>

#include "gpu_common.cuh"
#include "mm_gpu.h"

void mm__gpu_report(const char *stmt, const char *file, int line, const char *msg) {
    int dev = -1;
    (void)cudaGetDevice(&dev);
    mm_log_error("gpu: %s failed on %s:%d at %s:%d: %s", stmt, MM_GPU_VENDOR, dev, file, line, msg);
}

extern "C" mm_err mm_gpu_device_count(int *n, char why[MM_ERRLEN]) {
    if (n == NULL)
        return MM_EINVAL;
    *n = 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e == MM_GPU_ERR_NO_DRIVER || e == MM_GPU_ERR_NO_DEVICE) {
        (void)cudaGetLastError(); // clear the sticky-looking status for later calls
        if (why != NULL)
            snprintf(why, MM_ERRLEN, "no %s device: %s (error %d)", MM_GPU_VENDOR,
                     cudaGetErrorString(e), (int)e);
        return MM_OK;
    }
    if (e != cudaSuccess) {
        mm__gpu_report("cudaGetDeviceCount(&count)", __FILE__, __LINE__, cudaGetErrorString(e));
        if (why != NULL)
            snprintf(why, MM_ERRLEN, "%s device query failed: %s", MM_GPU_VENDOR, cudaGetErrorString(e));
        return MM_EDEVICE;
    }
    *n = count;
    if (count == 0 && why != NULL)
        snprintf(why, MM_ERRLEN, "no %s device", MM_GPU_VENDOR);
    return MM_OK;
}

extern "C" mm_err mm_gpu_device_info(int dev, char name[128], int *n_sm, size_t *mem_bytes) {
    cudaDeviceProp p;
    MM_GPU_CHECK(cudaGetDeviceProperties(&p, dev));
    if (name != NULL)
        snprintf(name, 128, "%s", p.name);
    if (n_sm != NULL)
        *n_sm = p.multiProcessorCount;
    if (mem_bytes != NULL)
        *mem_bytes = p.totalGlobalMem;
    return MM_OK;
}

extern "C" mm_err mm_gpu_set_device(int dev) {
    MM_GPU_CHECK(cudaSetDevice(dev));
    return MM_OK;
}

extern "C" mm_err mm_gpu_alloc(void **d_out, size_t n_bytes) {
    if (d_out == NULL)
        return MM_EINVAL;
    *d_out = NULL;
    if (n_bytes == 0)
        n_bytes = 1; // a valid, freeable pointer for empty tensors
    cudaError_t e = cudaMalloc(d_out, n_bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mm_log_error("gpu: cudaMalloc(%zu bytes) failed: %s", n_bytes, cudaGetErrorString(e));
        *d_out = NULL;
        return e == cudaErrorMemoryAllocation ? MM_ENOMEM : MM_EDEVICE;
    }
    return MM_OK;
}

extern "C" void mm_gpu_free(void *d) {
    if (d != NULL) {
        mm_gpu_wperm_forget(d, 0); // no cached permuted copy of a weight outlives it
        (void)cudaFree(d);
    }
}

extern "C" mm_err mm_gpu_memcpy_h2d(void *stream, void *d_dst, const void *h_src, size_t n_bytes) {
    mm_gpu_wperm_forget(d_dst, n_bytes); // a weight rewritten: its permuted copy is stale
    MM_GPU_CHECK(cudaMemcpyAsync(d_dst, h_src, n_bytes, cudaMemcpyHostToDevice, (cudaStream_t)stream));
    return MM_OK;
}

extern "C" mm_err mm_gpu_memcpy_d2h(void *stream, void *h_dst, const void *d_src, size_t n_bytes) {
    MM_GPU_CHECK(cudaMemcpyAsync(h_dst, d_src, n_bytes, cudaMemcpyDeviceToHost, (cudaStream_t)stream));
    return MM_OK;
}

extern "C" mm_err mm_gpu_memcpy_d2d(void *stream, void *d_dst, const void *d_src, size_t n_bytes) {
    MM_GPU_CHECK(cudaMemcpyAsync(d_dst, d_src, n_bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)stream));
    return MM_OK;
}

extern "C" mm_err mm_gpu_memset(void *stream, void *d_dst, int byte, size_t n_bytes) {
    MM_GPU_CHECK(cudaMemsetAsync(d_dst, byte, n_bytes, (cudaStream_t)stream));
    return MM_OK;
}

extern "C" mm_err mm_gpu_stream_new(void **stream) {
    cudaStream_t s;
    MM_GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *stream = (void *)s;
    return MM_OK;
}

extern "C" void mm_gpu_stream_free(void *stream) {
    if (stream != NULL) {
        mm_gpu_stream_forget(stream); // matmul.cu's buffer of the stream (freed if drained)
        (void)cudaStreamDestroy((cudaStream_t)stream);
    }
}

extern "C" mm_err mm_gpu_stream_sync(void *stream) {
    return mm__gpu_drain((cudaStream_t)stream, "stream sync");
}

static int g_drain_ms = 0; // 0: not read yet (MM_GPU_DRAIN_TIMEOUT_MS, read once)

static int drain_timeout_ms(void) {
    int ms = __atomic_load_n(&g_drain_ms, __ATOMIC_RELAXED);
    if (ms == 0) {
        const char *v = getenv("MM_GPU_DRAIN_TIMEOUT_MS");
        long n = v != NULL ? strtol(v, NULL, 10) : 0;
        ms = n > 0 && n < 86400000L ? (int)n : 30000;
        __atomic_store_n(&g_drain_ms, ms, __ATOMIC_RELAXED);
    }
    return ms;
}

extern "C" void mm_gpu_set_drain_timeout_ms(int ms) {
    __atomic_store_n(&g_drain_ms, ms > 0 && ms < 86400000 ? ms : 0, __ATOMIC_RELAXED);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Polls the stream (ev NULL) or the event until done, a device error or the deadline.
static mm_err poll_done(cudaStream_t stream, cudaEvent_t ev, const char *what) {
    const double t0 = now_s(), limit = 1e-3 * drain_timeout_ms();
    for (;;) {
        const cudaError_t e = ev != NULL ? cudaEventQuery(ev) : cudaStreamQuery(stream);
        if (e == cudaSuccess)
            return MM_OK;
        if (e != cudaErrorNotReady) {
            mm__gpu_report(ev != NULL ? "cudaEventQuery" : "cudaStreamQuery", __FILE__, __LINE__, cudaGetErrorString(e));
            return MM_EDEVICE;
        }
        const double t = now_s() - t0;
        if (t > limit) {
            mm_log_error("gpu: %s: the device stream has not finished after %d ms "
                         "(MM_GPU_DRAIN_TIMEOUT_MS): work waiting on a peer that died mid-copy "
                         "never completes; this process's device context is lost, restart it",
                         what, drain_timeout_ms());
            return MM_ETIMEDOUT;
        }
        if (t > 2e-3) {
            const struct timespec nap = {0, 10000};
            nanosleep(&nap, NULL);
        }
    }
}

static void hold_fn(void *arg) {
    const long ms = (long)(intptr_t)arg;
    const struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

extern "C" mm_err mm_gpu_stream_hold(void *stream, int ms) {
    if (ms < 0)
        return MM_EINVAL;
    MM_GPU_CHECK(cudaLaunchHostFunc((cudaStream_t)stream, hold_fn, (void *)(intptr_t)ms));
    return MM_OK;
}

mm_err mm__gpu_drain(cudaStream_t stream, const char *what) {
    return poll_done(stream, NULL, what);
}

mm_err mm__gpu_wait_event(cudaEvent_t ev, const char *what) {
    return poll_done(NULL, ev, what);
}

// Warp width of device 0's architecture, read once (32 on NVIDIA; 64 or 32 on AMD).
int mm__gpu_warp_size(void) {
    static int ws = 0;
    if (ws == 0) {
        int v = 0;
        if (cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, 0) != cudaSuccess || v <= 0)
            v = MM_GPU_MAX_WARP_SIZE;
        ws = v;
    }
    return ws;
}
