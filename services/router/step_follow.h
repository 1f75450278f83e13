// SPDX-License-Identifier: MIT
// Pipelined plans (docs/MESH.md "Pipelined plans"): a client may send step N+1's plan before
// step N's result has come back. The plan names the step it runs after (StepPlan.after_step)
// and its `follow` seqs take their input from the router's own picks of that step: the last
// token emitted for the seq (its sampled token, or the last accepted draft) at the position
// after it. This unit keeps what a follow needs of the last steps (seq, next position, last
// token, or why the seq cannot go on), orders plans (a plan waits until its after_step has
// run) and resolves a plan's follow entries into ordinary ones.
//
// Design notes:
// - A ring of the last FOLLOW_STEPS steps (an after_step older than that is unknown: the plan
//   waits to its deadline and is refused). Steps of several clients interleave freely: a plan
//   only needs its own after_step to be in the ring.
// - No allocation per step: the ring and the resolved plan's arrays are sized at open.
// - Every function runs under the step engine's mutex (mm_follow_wait releases it while it
//   waits).
#ifndef MM_ROUTER_STEP_FOLLOW_H
#define MM_ROUTER_STEP_FOLLOW_H

#include <pthread.h>

#include "mm/ctl.h"

typedef struct mm_follow mm_follow;

// mm_follow_new sizes the ring for plans of at most max_seqs seqs. Returns owned *out.
mm_err mm_follow_new(mm_follow **out, int max_seqs);
void mm_follow_free(mm_follow *f); // accepts NULL

// mm_follow_arrived: plan step_id has reached the router (call first, under the mutex, for
// every plan): a plan following it waits for it to run, not just to arrive.
void mm_follow_arrived(mm_follow *f, uint64_t step_id);

// mm_follow_wait: for a plan with after_step != 0, waits (mu held by the caller, released
// while waiting) until step `after` has been recorded, at most timeout_ms, and at most 2 s for
// it to arrive at all (mm_follow_arrived). MM_OK, or MM_ETIMEDOUT with msg naming the step.
mm_err mm_follow_wait(mm_follow *f, pthread_mutex_t *mu, uint64_t after, int timeout_ms,
                      char *msg, size_t msg_len);

// A step whose picks are still on their way from the device (a plan begun early:
// mm_step_engine_run) records its results with token MM_FOLLOW_PENDING(k), k the seq's pick in
// the step's device picks; a follow entry of such a step resolves to that token (the caller
// embeds the device's pick k instead), and mm_follow_set_tokens / mm_follow_fail then make the
// record final.
#define MM_FOLLOW_PENDING(k) (-2 - (int32_t)(k))
#define MM_FOLLOW_IS_PENDING(t) ((t) <= -2)
#define MM_FOLLOW_PICK(t) (-2 - (int64_t)(t))

// mm_follow_resolve: the plan to run for p (borrowed; the returned plan is valid until the
// next call but one, and shares p's arrays): p itself when it has no follow entries, else a copy whose
// follow entries carry the token and position from step p->after_step (and max_draft cut so
// that draft rows stay before end_pos). An entry that cannot
// run keeps no tokens; mm_follow_dropped then names why. max_ctx: the router's context limit.
const Mmctl__StepPlan *mm_follow_resolve(mm_follow *f, const Mmctl__StepPlan *p, int max_ctx);

// mm_follow_dropped: entry i of the last resolved plan cannot run: its message (and *code),
// else NULL.
const char *mm_follow_dropped(const mm_follow *f, size_t i, int32_t *code);

// mm_follow_n_pending: entries of the last resolved plan that run (not dropped) on a pending
// token (MM_FOLLOW_PENDING(k)).
size_t mm_follow_n_pending(const mm_follow *f);

// mm_follow_set_tokens: the recorded step step_id's pending tokens become the picks they name
// (picks: n of them); wakes plans waiting for it. mm_follow_fail: every seq of that step that
// had not failed fails with (code, msg) instead.
void mm_follow_set_tokens(mm_follow *f, uint64_t step_id, const int32_t *picks, size_t n);
void mm_follow_fail(mm_follow *f, uint64_t step_id, int32_t code, const char *msg);

// mm_follow_record: step p (the plan run, resolved) ended with results res (n_res, plan order;
// 0 when the whole step failed with whole_code/whole_msg). Wakes plans waiting for it.
void mm_follow_record(mm_follow *f, const Mmctl__StepPlan *p, Mmctl__SeqResult *const *res,
                      size_t n_res, uint32_t whole_code, const char *whole_msg);

#endif
