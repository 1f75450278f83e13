// SPDX-License-Identifier: MIT
// The router's step engine: runs one StepPlan across the mesh (docs/MESH.md) and answers with
// its StepResult. Embeddings, gate, dispatch to expert owners, shared/dense MLPs, combine in
// canonical order, final norm, LM head and sampling run here; attention runs on the shards.
//
// Design notes:
// - Steps are serialised by one mutex: the control server's handler thread that received the
//   plan runs it (the gateway sends one plan at a time, so this is one thread in practice).
//   A pipelined plan (StepPlan.after_step) waits under it for the step it follows
//   (step_follow.h), so plans sent ahead still run in their order.
// - Links: shard s and owner o are dialed (their --data URL from the registry) at the first
//   step that needs them after they join or rejoin (a new incarnation); a failed link is
//   closed and redialed at the next step, never reused, so late frames of a failed step can
//   never be read as this step's.
// - Every wait has a deadline (--step-timeout-ms) and also ends when the registry marks the
//   peer down; a dead peer's socket fails at once (MM_EPEERDOWN).
// - No allocation per step: every buffer is sized at open from --max-batch-tokens and
//   --max-step-seqs. (The reply message itself is packed by nng.)
#ifndef MM_ROUTER_STEP_H
#define MM_ROUTER_STEP_H

#include "mm/ctl.h"
#include "router.h"

typedef struct mm_step_conf {
    const char *model, *placement, *device;
    int owners, shards;
    int max_tokens;    // rows per step
    int max_seqs;      // seqs per step
    int threads;
    int step_timeout_ms;
    int max_ctx;
    // drafting (step_draft.h)
    int draft_max, draft_timeout_ms, draft_max_rows;
    bool draft_adapt;
    int draft_pipeline; // --draft-pipeline: MM_DRAFT_PIPE_OFF / _ON / _AUTO (step_draft.h)
} mm_step_conf;

typedef struct mm_step_engine mm_step_engine;

// mm_step_engine_open opens the model and placement and sizes every buffer. reg (borrowed)
// tells member liveness and data URLs. Returns owned *out. Errors: the model's, the
// placement's, MM_EINVAL (bad sizes), MM_ENOMEM.
mm_err mm_step_engine_open(mm_step_engine **out, const mm_step_conf *c, mm_registry *reg,
                           char err[MM_ERRLEN]);
void mm_step_engine_close(mm_step_engine *e); // accepts NULL

// mm_step_engine_status_hook (a registry detail hook, arg: the engine): publishes the drafting
// metrics deferred by the last steps when no step is running (never waits for one).
void mm_step_engine_status_hook(void *arg);

// mm_step_engine_run runs plan (borrowed) and returns the packed StepResult reply (seq echoes
// the request's). Blocks for the step; thread-safe (serialised).
struct nng_msg *mm_step_engine_run(mm_step_engine *e, const Mmctl__StepPlan *plan, uint64_t seq);

#endif
