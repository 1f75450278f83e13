// SPDX-License-Identifier: MIT
// Per-hop host timestamps of the mesh's step (router, attention shards, expert owners), for
// finding where a step's time goes (docs/MESH.md "Device frames"). Off unless the env
// MM_MESH_TRACE is set: "1" writes to stderr, any other value is a path prefix and each
// process writes PREFIX.<role>.<pid>. One line per event: "T role step layer tag t_us" with t_us
// CLOCK_MONOTONIC microseconds (one clock for every process of a host, so lines of several
// daemons merge by time). Lines are buffered and written by mm_mesh_trace_flush (call it
// outside the timed path, e.g. at a step's end).
//
// Header-only, state per translation unit: each unit that opens a trace writes its own file,
// named by the role it opens with (a daemon's role; common/transport/cudaipc.c's device hops as
// "ipc", PREFIX.ipc.<pid>, flushed at exit).
#ifndef MM_MESH_TRACE_H
#define MM_MESH_TRACE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mm/time.h"

static FILE *mm__trace_f;
static const char *mm__trace_role;

// mm_mesh_trace_open: reads MM_MESH_TRACE once; returns whether tracing is on.
static inline bool mm_mesh_trace_open(const char *role) {
    const char *v = getenv("MM_MESH_TRACE");
    if (!v || !v[0] || strcmp(v, "0") == 0 || mm__trace_f)
        return mm__trace_f != NULL;
    mm__trace_role = role;
    if (strcmp(v, "1") == 0) {
        mm__trace_f = stderr;
        return true;
    }
    char path[512];
    snprintf(path, sizeof(path), "%s.%s.%d", v, role, (int)getpid());
    mm__trace_f = fopen(path, "w");
    if (mm__trace_f)
        setvbuf(mm__trace_f, NULL, _IOFBF, 1 << 20);
    return mm__trace_f != NULL;
}

static inline void mm_mesh_trace(uint64_t step, int layer, const char *tag) {
    if (mm__trace_f)
        fprintf(mm__trace_f, "T %s %llu %d %s %.1f\n", mm__trace_role, (unsigned long long)step,
                layer, tag, (double)mm_now_ns() / 1e3);
}

static inline void mm_mesh_trace_flush(void) {
    if (mm__trace_f)
        fflush(mm__trace_f);
}

// mm_mesh_gpu_spin: a daemon whose stages run on a GPU (device not "cpu") waits for its next
// frame of a step busy (MM_TRANSPORT_SPIN_US, default here 1000 us instead of the transport's
// 50 us) unless the env says otherwise: its host only passes descriptors and enqueues work, so
// each hop's sleep and wake-up (~10-20 us, H200 run of 2026-11-30 01:52) would be on the
// step's critical path; on a CPU backend the cores compute and the short default stays.
// Call before the process's first transport wait.
static inline void mm_mesh_gpu_spin(const char *device) {
    if (device && strncmp(device, "cpu", 3) != 0 && !getenv("MM_TRANSPORT_SPIN_US"))
        setenv("MM_TRANSPORT_SPIN_US", "1000", 0);
}

#endif
