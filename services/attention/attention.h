// SPDX-License-Identifier: MIT
// The attention shard's role logic: attention layers and the paged KV cache of the sequences it
// owns. It serves the router on --data (docs/MESH.md): a CTRL frame per step lists its seqs
// (seq_id, pos, n_tokens) and the releases; then per layer a ROWS frame is answered with the
// rows after mm_model_attn_forward. seq_id -> KV slot map; pos must equal the KV length (else
// MM_EPROTO for the step, sent as an MM_WIRE_ERROR on the layer-0 rows).
#ifndef MM_ATTENTION_H
#define MM_ATTENTION_H

#include "mm/daemon.h"

extern mm_opt attention_opts[]; // --shards --kv-mb --max-seqs --max-ctx --max-batch-tokens --threads

// attention_start checks --instance against --shards, opens the model, sizes the KV cache from
// --kv-mb and starts the data server on --data. Errors: MM_EINVAL, the model's and the
// transport's errors.
mm_err attention_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
void attention_stop(mm_daemon *d, void *arg);

#endif
