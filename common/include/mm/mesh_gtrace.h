// SPDX-License-Identifier: MIT
// GPU-side stamps of the mesh's step (MM_MESH_TRACE_GPU=1 beside MM_MESH_TRACE=PREFIX): each
// stamp is a one-thread kernel on the daemon's stream that writes the device's global timer (ns,
// one clock for all processes on the GPU) into pinned host memory when the stream reaches it,
// so the router's, shards' and owners' stage boundaries line up on the GPU's time line: how
// long each stage runs on the GPU, and how long the GPU waits between the daemons' stages
// (docs/MESH.md "Device frames"; merged by kernels/cuda/bench/mesh_trace.py).
// Lines "G role step layer tag t_us" go to PREFIX.g-<role>.<pid>, written by
// mm_mesh_gtrace_flush for the stamps the GPU has reached (call it off the timed path, e.g. where
// mm_mesh_trace_flush is called). A diagnostic: each stamp costs a launch (~2-5 us of host, ~2
// us of GPU), so traced steps are slower; off (no call does anything) unless both variables are
// set and the build has GPU support. One thread per process issues stamps (the daemon's step or
// data thread).
#ifndef MM_MESH_GTRACE_H
#define MM_MESH_GTRACE_H

#include <stdbool.h>
#include <stdint.h>

// mm_mesh_gtrace_open: role names the file; stream is the backend's stream the stages run on.
// Returns whether GPU stamps are on. Later calls return the first call's answer.
bool mm_mesh_gtrace_open(const char *role, void *stream);
// mm_mesh_gtrace_open_backend: mm_mesh_gtrace_open on the stream of the GPU backend whose ctx
// is backend_ctx (mm_gpu_backend_stream); false, opening nothing, where there is none.
bool mm_mesh_gtrace_open_backend(const char *role, void *backend_ctx);
// mm_mesh_gstamp: a stamp (step, layer, tag) enqueued on the stream (tag: a string literal).
void mm_mesh_gstamp(uint64_t step, int layer, const char *tag);
// mm_mesh_gtrace_flush: writes the stamps the GPU has reached, in order (never waits).
void mm_mesh_gtrace_flush(void);

#endif
