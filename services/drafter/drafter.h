// SPDX-License-Identifier: MIT
// The drafter's role logic: proposes draft tokens for speculative decoding (docs/MESH.md,
// Drafting). Two kinds: a small dense draft model sharing the target's tokenizer (--draft-model
// DIR: greedy continuation with its own paged KV cache, rolled back to the committed prefix at
// each request; all seqs of a request in the same forward passes: one over the tokens each
// seq's KV lacks, then one per draft position with a row per seq) and prompt lookup
// (--draft-model ngram: no model). The router asks with a DraftRequest on this daemon's
// --listen address before a step; the answer is one DraftOut per seq. Requests are served one
// at a time (a mutex); buffers per tracked seq are allocated once per slot, the batch's row
// arrays once at start, the reply per request. --max-seqs seqs are tracked; when full, the
// one named longest ago makes room. --device cuda:N runs the draft model on that GPU.
#ifndef MM_DRAFTER_H
#define MM_DRAFTER_H

#include "mm/daemon.h"

extern mm_opt drafter_opts[]; // --draft-model

// drafter_start checks --draft-model (a directory with config.json) when given.
// Errors: MM_ENOENT naming the path.
mm_err drafter_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
void drafter_stop(mm_daemon *d, void *arg);
// drafter_handle serves DraftRequest; everything else goes to mm_daemon_member_handle.
void drafter_handle(void *arg, const mm_ctl_msg *req, const char *peer, struct nng_msg **reply);

#endif
