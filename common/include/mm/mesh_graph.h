// SPDX-License-Identifier: MIT
// Per-stage graphs of the mesh's daemons (docs/MESH.md "Device frames"): a stage's per-layer
// GPU work (a shard's attention, an owner's grouped products, the router's chain between its
// hops) recorded once per key (layer and batch shape) with the backend's graphs and replayed
// with one launch, instead of issuing its ~4-10 ops one by one (3-5 us of host each under MPS).
//
// Design notes:
// - Policy (the engine's, common/model.c forward_dev): a key seen for the first time runs op
//   by op; the second time it is recorded (nothing runs while recording) and launched; later
//   it is replayed. Keys (seen or recorded) live in a fixed table; the least recently used
//   entry makes room. A recording that fails turns this cache off (a warning) and the stage
//   runs op by op from then on: same bits either way (the same kernels with the same
//   arguments).
// - The caller's fn must issue backend ops only (no set, get or synchronize: refused while
//   recording) and the same ops with the same pointers for the same key (the key must cover
//   every pointer and size that differs between calls); the data behind the pointers is read
//   when the graph runs. Stream waits on peers' events stay outside (issued before run).
// - On only where the env MM_MESH_GRAPHS is 1 and the backend has graphs (not MM_GPU_OPTIME,
//   not MM_GPU_GRAPHS=0); otherwise mm_mesh_graphs_new gives NULL and run calls fn directly.
//   Off by default: on the H200 (2026-11-30) the graph launches cost the GPU more than the
//   host time they save (batch-1 step 1.22 against 1.15 ms; docs/MESH.md).
// - Not thread-safe: one thread issues a backend's ops (kernels.h).
#ifndef MM_MESH_GRAPH_H
#define MM_MESH_GRAPH_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels.h"
#include "mm/err.h"

typedef struct mm_mesh_graphs mm_mesh_graphs;
typedef mm_err (*mm_mesh_graph_fn)(void *arg);

// mm_mesh_graphs_new: a cache of at most cap graphs on be (borrowed; must outlive it), who
// names the stage in logs. *out is NULL (and MM_OK) when graphs are off (see above).
mm_err mm_mesh_graphs_new(mm_mesh_graphs **out, mm_backend *be, int cap, const char *who);
void mm_mesh_graphs_free(mm_mesh_graphs *g); // accepts NULL

// mm_mesh_graphs_run: fn(arg)'s ops for key (k0, k1): replayed, recorded, or issued (above).
// g NULL, or rows over 64 (a prefill chunk: few launches against its work, and the GPU's
// prefill GEMMs take another path inside a capture), issues fn(arg) directly. Returns fn's
// error or the launch's.
mm_err mm_mesh_graphs_run(mm_mesh_graphs *g, uint64_t k0, uint64_t k1, int64_t rows,
                          mm_mesh_graph_fn fn, void *arg);

// mm_mesh_graphs_env: whether MM_MESH_GRAPHS asks for graphs (read once).
bool mm_mesh_graphs_env(void);

// mm_mesh_views_env: whether device frames' rows are used in place in the link's ring
// (mm_conn_recv_view; MM_MESH_VIEWS, on unless "0"), for shards, owners and the router alike.
// Read once. A stage with views on replays no graphs (a view's place changes per frame).
bool mm_mesh_views_env(void);

// mm_mesh_inplace_env: whether a stage writes the rows it sends straight into the receiver's
// ring (mm_conn_reserve_dev: no copy at the send) where it can: the owner's expert outputs,
// the router's x rows and plan share for a lone owner, and whether the router reads a lone
// shard's reply in place (the copy into its h array enqueued later, off the chain). Needs
// views; MM_MESH_INPLACE=0 turns it off. Read once.
bool mm_mesh_inplace_env(void);

#endif
