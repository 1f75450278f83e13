// SPDX-License-Identifier: MIT
// Switches of the mesh's device frames (docs/MESH.md "Device frames"), read once from the env
// by every stage (shards, owners, the router). (The file's name is historical: it also held
// the per-stage CUDA graphs, removed 2026-11-30 after measurement.)
#ifndef MM_MESH_GRAPH_H
#define MM_MESH_GRAPH_H

#include <stdbool.h>

// mm_mesh_views_env: whether device frames' rows are used in place in the link's ring
// (mm_conn_recv_view; MM_MESH_VIEWS, on unless "0"), for shards, owners and the router alike.
// Read once.
bool mm_mesh_views_env(void);

// mm_mesh_inplace_env: whether a stage writes the rows it sends straight into the receiver's
// ring (mm_conn_reserve_dev: no copy at the send) where it can: the owner's expert outputs,
// the router's x rows and plan share for a lone owner, a shard's reply (MM_SHARD_REPLY_RING),
// a lone shard's next frame made by the router's combine (MM_ROUTER_NORMED_ROWS), and whether
// the router reads a lone shard's reply in place (the copy into its h array enqueued later,
// off the chain). Needs views; MM_MESH_INPLACE=0 turns it off. Read once.
bool mm_mesh_inplace_env(void);

#endif
