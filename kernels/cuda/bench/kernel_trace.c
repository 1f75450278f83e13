// SPDX-License-Identifier: MIT
// Kernel time line by CUPTI activity records, for runs on the GPU machine (which has no Nsight
// Systems): a library the CUDA driver loads into any process through CUDA_INJECTION64_PATH,
// recording every kernel's start and end on the GPU clock (graph nodes included, the kernels
// of a recorded step each with their own times) and writing them at exit to $TRACE_OUT (default
// /tmp/kernels.tsv): start ns, end ns, mangled name, grid x, grid y, block x, graph id, dynamic
// shared memory, one kernel a line. kernel_trace.py reads it back as a decode step's chain.
//     gcc -O2 -shared -fPIC -o libkernel_trace.so kernels/cuda/bench/kernel_trace.c
//         -I/usr/local/cuda/include -L/usr/local/cuda/lib -lcupti -Wl,-rpath,'$ORIGIN'
//     (one command; libcupti.so.13 beside the library), then
//     CUDA_INJECTION64_PATH=$PWD/libkernel_trace.so TRACE_OUT=k.tsv moemesh bench-model ...
// Tracing costs the decode step ~1-2% (H200, 2026-12-02).
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

static void CUPTIAPI buf_req(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = (size_t)8 << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buf_done(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                              size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (buf && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || !out)
            continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        fprintf(out, "%llu\t%llu\t%s\t%d\t%d\t%d\t%u\t%d\n", (unsigned long long)k->start,
                (unsigned long long)k->end, k->name ? k->name : "?", k->gridX, k->gridY, k->blockX,
                k->graphId, k->dynamicSharedMemory);
    }
    free(buf);
}

static void flush(void) {
    cuptiActivityFlushAll(1);
    if (out)
        fclose(out);
    out = NULL;
}

int InitializeInjection(void);
int InitializeInjection(void) {
    const char *p = getenv("TRACE_OUT");
    out = fopen(p ? p : "/tmp/kernels.tsv", "w");
    if (!out)
        return 0;
    if (cuptiActivityRegisterCallbacks(buf_req, buf_done) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fclose(out);
        out = NULL;
        return 0;
    }
    atexit(flush);
    return 1;
}
