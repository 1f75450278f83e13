// SPDX-License-Identifier: MIT
// The attention shard's role logic: attention layers and the paged KV cache of the sequences it
// owns (next). Today it checks its shard number and reports it in its heartbeat.
#ifndef MM_ATTENTION_H
#define MM_ATTENTION_H

#include "mm/daemon.h"

extern mm_opt attention_opts[]; // --shards

// attention_start checks --instance against --shards. Errors: MM_EINVAL.
mm_err attention_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
void attention_stop(mm_daemon *d, void *arg);

#endif
