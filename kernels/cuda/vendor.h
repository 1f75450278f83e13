// SPDX-License-Identifier: MIT
// The only vendor switch in the tree (STYLE.md 1, 5): kernels/cuda/*.cu are written in CUDA
// spelling and compiled either by nvcc (vendor/cuda.h) or by hipcc with -DMM_USE_HIP
// (vendor/hip.h, which remaps the names, warp width and missing features). Everything else in
// kernels/cuda includes this header and never tests the vendor itself.
#ifndef MM_GPU_VENDOR_H
#define MM_GPU_VENDOR_H

#if defined(MM_USE_HIP)
#include "vendor/hip.h"
#else
#include "vendor/cuda.h"
#endif

#include <stdint.h>

extern "C" {
#include "mm/dtype.h"
#include "mm/err.h"
#include "mm/log.h"
}

// mm__gpu_report logs a failed device call with its statement, device, location and the
// vendor's message (kernels/cuda/common.cu). Thread-safe.
void mm__gpu_report(const char *stmt, const char *file, int line, const char *msg);

// mm__gpu_warp_size is the warp width of the device architecture (host side, cached).
int mm__gpu_warp_size(void);

// mm__gpu_drain waits for every op issued on stream, with a deadline (MM_GPU_DRAIN_TIMEOUT_MS,
// default 30000): it polls (spinning for the first 2 ms, then sleeping 10 us between polls)
// instead of blocking in the driver, so work that can never finish (a copy waiting on an
// interprocess event of a peer that died mid-frame) gives MM_ETIMEDOUT, logged with `what`,
// instead of a hang. Device errors give MM_EDEVICE. After a timeout the stream is still
// blocked: callers treat the device context as lost (kernels/cuda/common.cu).
mm_err mm__gpu_drain(cudaStream_t stream, const char *what);
// mm__gpu_wait_event: the same wait for one recorded event.
mm_err mm__gpu_wait_event(cudaEvent_t ev, const char *what);

// MM_GPU_CHECK evaluates a runtime call; on failure it logs and returns MM_EDEVICE from the
// enclosing function (which must return mm_err). Library code never aborts on a device error.
#define MM_GPU_CHECK(call)                                                          \
    do {                                                                            \
        cudaError_t e_ = (call);                                                    \
        if (e_ != cudaSuccess) {                                                    \
            mm__gpu_report(#call, __FILE__, __LINE__, cudaGetErrorString(e_));      \
            return MM_EDEVICE;                                                      \
        }                                                                           \
    } while (0)

// MM_GPU_LAUNCHED checks a kernel launch (bad configuration, missing image for the arch).
#define MM_GPU_LAUNCHED(what) MM_GPU_CHECK(((void)(what), cudaGetLastError()))

#endif
