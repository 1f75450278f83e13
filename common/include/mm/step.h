// SPDX-License-Identifier: MIT
// Helpers for the StepPlan/StepResult contract (proto/ctl.proto, docs/MESH.md): a gateway (or
// a test client) builds a step plan in storage sized once, sends it to the router with
// mm_ctl_call, and reads the StepResult.
//
// Design notes: an mm_step_builder owns arrays of protobuf-c structs sized at mm_step_builder_new
// (max seqs, max releases); the envelope it returns points into them and into the callers'
// token arrays (borrowed until the call returns). No allocation per step.
// Threading: one builder per thread.
#ifndef MM_STEP_H
#define MM_STEP_H

#include <stdbool.h>
#include <stdint.h>

#include "mm/ctl.h"
#include "mm/sampler.h"

typedef struct mm_step_builder mm_step_builder;

// mm_step_builder_new returns owned *out sized for max_seqs seqs and max_release releases per
// plan. Errors: MM_EINVAL (0 seqs), MM_ENOMEM.
mm_err mm_step_builder_new(mm_step_builder **out, uint32_t max_seqs, uint32_t max_release);
void mm_step_builder_free(mm_step_builder *b); // accepts NULL

// mm_step_builder_reset starts a new plan with step_id.
void mm_step_builder_reset(mm_step_builder *b, uint64_t step_id);

// mm_step_builder_add appends a seq: n tokens (borrowed until the plan is sent) at position pos;
// sample after the last one with sp (NULL: greedy), reporting n_top top logprobs.
// Errors: MM_EFULL (max_seqs reached), MM_EINVAL (n == 0).
mm_err mm_step_builder_add(mm_step_builder *b, uint64_t seq_id, uint32_t pos,
                           const int32_t *tokens, uint32_t n, bool sample, const mm_sampling *sp,
                           uint32_t n_top);

// mm_step_builder_add_follow appends a seq whose input is the router's own pick of it at the
// plan's after step (pipelined plans, SeqStep.follow): no tokens, sampled with sp and n_top as
// mm_step_builder_add's; end_pos (0: none) drops the entry once the seq's position reaches it.
// Needs mm_step_builder_set_after. Errors: MM_EFULL.
mm_err mm_step_builder_add_follow(mm_step_builder *b, uint64_t seq_id, uint32_t end_pos,
                                  const mm_sampling *sp, uint32_t n_top);

// mm_step_builder_set_after: the plan runs after step after_step (StepPlan.after_step; 0: none).
void mm_step_builder_set_after(mm_step_builder *b, uint64_t after_step);

// mm_step_builder_set_draft lets the router answer up to max_draft more tokens (drafted and
// verified: SeqResult.more) for the seq added last. Only for a sampling seq with n_top 0.
void mm_step_builder_set_draft(mm_step_builder *b, uint32_t max_draft);

// mm_step_builder_set_no_logprob says the sender will not read the logprobs of the seq added
// last (SeqStep.no_logprob): the router may pick its greedy tokens on the device.
void mm_step_builder_set_no_logprob(mm_step_builder *b);

// mm_step_builder_release asks the shards to free seq_id's KV (before this plan's seqs run).
// Errors: MM_EFULL.
mm_err mm_step_builder_release(mm_step_builder *b, uint64_t seq_id);

// mm_step_builder_env returns the plan as an envelope (borrowed: valid until the next reset or
// add), ready for mm_ctl_call(router, env, timeout, &reply, err).
mm_ctl_msg *mm_step_builder_env(mm_step_builder *b);
uint32_t mm_step_builder_n_seqs(const mm_step_builder *b);

// mm_step_result_check checks that reply (borrowed) is the StepResult of plan step_id with one
// result per seq (n_seqs), or a whole-step error. On MM_OK *res points into reply. A
// whole-step error returns its code with the router's text in err.
// Errors: MM_EPROTO (not a step_result, wrong step id or count), the step's error code.
mm_err mm_step_result_check(const mm_ctl_msg *reply, uint64_t step_id, uint32_t n_seqs,
                            const Mmctl__StepResult **res, char err[MM_ERRLEN]);

// mm_step_sampling_from_pb reads a plan's sampling parameters (pb may be NULL: greedy).
void mm_step_sampling_from_pb(const Mmctl__Sampling *pb, mm_sampling *sp);

// mm_step_logprob_line formats "token logprob" (and " top=id:lp,id:lp" when the result has
// alternatives) with %.9g: the line format `moemesh generate --logprobs` and
// `moemesh mesh-generate` print. Returns the length written (truncated to cap).
int mm_step_logprob_line(char *buf, size_t cap, int32_t token, float logprob, uint32_t n_top,
                         const int32_t *top_ids, const float *top_logprobs);

#endif
