// SPDX-License-Identifier: MIT
// GPU-side stamps of the mesh's step; see mm/mesh_gtrace.h.
#include "mm/mesh_gtrace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mm/err.h"
#include "mm/log.h"

// GPU entry points (kernels/cuda/ipc.cu), weak: NULL in a build without GPU support.
#define W __attribute__((weak))
extern mm_err mm_gpu_mesh_stamp(void *stream, uint64_t *h_slot) W;
extern mm_err mm_gpu_host_pinned(void **p, size_t n_bytes) W;
extern void mm_gpu_host_pinned_free(void *p) W;
extern mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev) W;
#undef W

#define GT_SLOTS (1u << 16) // stamps in flight at most (a full ring drops new stamps)

struct gstamp {
    uint64_t step;
    int layer;
    const char *tag;
};

static struct {
    bool tried, on;
    void *stream;
    FILE *f;
    char role[32];
    volatile uint64_t *t; // (GT_SLOTS) pinned: the GPU writes each stamp's time here (0: not yet)
    struct gstamp *m;     // (GT_SLOTS) what each slot stamps
    uint64_t head, tail;  // stamps issued / written out
    uint64_t dropped;
} G;

static void gtrace_exit(void) {
    // the stamps the GPU has reached by now; a slot it has not reached is left out
    mm_mesh_gtrace_flush();
    if (G.f && G.dropped > 0)
        fprintf(G.f, "# %llu stamps dropped (ring full)\n", (unsigned long long)G.dropped);
    if (G.f)
        fflush(G.f);
}

bool mm_mesh_gtrace_open(const char *role, void *stream) {
    if (G.tried)
        return G.on;
    G.tried = true;
    const char *v = getenv("MM_MESH_TRACE"), *g = getenv("MM_MESH_TRACE_GPU");
    if (!v || !v[0] || strcmp(v, "0") == 0 || strcmp(v, "1") == 0 || !g || strcmp(g, "1") != 0)
        return false;
    if (!mm_gpu_mesh_stamp || !mm_gpu_host_pinned || !mm_gpu_host_pinned_free || !stream) {
        mm_log_warn("MM_MESH_TRACE_GPU=1: no GPU stamps here (%s)",
                    stream ? "this build has no GPU support" : "no device stream");
        return false;
    }
    void *t = NULL;
    G.m = calloc(GT_SLOTS, sizeof(*G.m));
    if (!G.m || mm_gpu_host_pinned(&t, GT_SLOTS * sizeof(uint64_t)) != MM_OK) {
        mm_log_warn("MM_MESH_TRACE_GPU=1: cannot allocate the stamp ring; no GPU stamps");
        free(G.m);
        G.m = NULL;
        return false;
    }
    memset(t, 0, GT_SLOTS * sizeof(uint64_t));
    char path[512];
    snprintf(path, sizeof(path), "%s.g-%s.%d", v, role, (int)getpid());
    G.f = fopen(path, "w");
    if (!G.f) {
        mm_log_warn("MM_MESH_TRACE_GPU=1: cannot write %s; no GPU stamps", path);
        mm_gpu_host_pinned_free(t);
        free(G.m);
        G.m = NULL;
        return false;
    }
    setvbuf(G.f, NULL, _IOFBF, 1 << 20);
    snprintf(G.role, sizeof(G.role), "%s", role);
    G.t = t;
    G.stream = stream;
    G.on = true;
    atexit(gtrace_exit);
    return true;
}

bool mm_mesh_gtrace_open_backend(const char *role, void *backend_ctx) {
    void *stream = NULL;
    int dev = 0;
    if (!mm_gpu_backend_stream || mm_gpu_backend_stream(backend_ctx, &stream, &dev) != MM_OK)
        return false;
    return mm_mesh_gtrace_open(role, stream);
}

void mm_mesh_gstamp(uint64_t step, int layer, const char *tag) {
    if (!G.on)
        return;
    if (G.head - G.tail >= GT_SLOTS) {
        G.dropped++;
        return;
    }
    const uint32_t i = (uint32_t)(G.head % GT_SLOTS);
    G.t[i] = 0;
    G.m[i] = (struct gstamp){.step = step, .layer = layer, .tag = tag};
    if (mm_gpu_mesh_stamp(G.stream, (uint64_t *)&G.t[i]) != MM_OK) {
        G.dropped++;
        return;
    }
    G.head++;
}

void mm_mesh_gtrace_flush(void) {
    if (!G.on)
        return;
    while (G.tail < G.head) {
        const uint32_t i = (uint32_t)(G.tail % GT_SLOTS);
        const uint64_t t = G.t[i];
        if (t == 0) // not reached yet (stream order: neither are the later ones)
            break;
        fprintf(G.f, "G %s %llu %d %s %.3f\n", G.role, (unsigned long long)G.m[i].step,
                G.m[i].layer, G.m[i].tag, (double)t / 1e3);
        G.tail++;
    }
    fflush(G.f);
}
