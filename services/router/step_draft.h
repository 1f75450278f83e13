// SPDX-License-Identifier: MIT
// The router's side of speculative decoding (docs/MESH.md, Drafting): it keeps each seq's
// committed tokens, asks the drafter for proposals (ahead, during the step before; or before a
// step, waiting with a deadline; a dead, late or refusing drafter means no drafts), chooses each seq's
// draft width from measured step times and acceptance, queues KV truncations of rejected draft
// rows for the shards, and keeps the metrics.
//
// Design notes:
// - Who asks whom: the router asks the drafter (its --listen control address, from the
//   registry) because only the router sees every committed token of every seq (plans carry the
//   inputs, results the accepted drafts) and it must know the drafts before the forward pass.
// - Verification lives in step.c: draft rows are more rows of their seq in the same forward
//   pass; each row's token is picked by mm_sampler_pick exactly as without drafting (greedy:
//   argmax; sampled: the inverse CDF at u(seed, position)), and a draft is accepted while it
//   equals the picked token. With a deterministic drafter (q one-hot) this is speculative
//   sampling: the draft x is accepted with probability p(x) = min(1, p(x)/q(x)), and on
//   rejection the token is distributed as p without x, renormalised (the residual
//   max(0, p - q)); so the output is the target's distribution, and for a given seed the very
//   tokens of plain decoding, whatever the widths.
// - Width (mm/spec.h): one width W per step (the step's time depends on its widest draft):
//   the w maximising the seqs' expected tokens (sum over seqs of sum_{i<=min(w,cap)} a^i, a the
//   seq's per-token acceptance EMA; a new seq starts from the EMA over all seqs) per price T(w).
//   T(w) is the EMA of the period from a step's start to the next step's start (all a step
//   costs: drafter round trip, draft rows, the gateway's work on the tokens), counted only when
//   the next step goes on with a seq of it (no idle gap) and the 2 steps before had the same
//   width (the gateway delivers a result's tokens while the next step runs), per range of context
//   length x input rows. Unmeasured widths: the nearest measured one's price, never below a
//   measured narrower one. Every 8th drafting step may explore (3 steps) width 0 or the
//   choice's neighbours when unmeasured or stale. Seqs under 5% acceptance draft 0 (probing
//   1 draft together every 64th step).
// - Draft-ahead (--draft-pipeline true, and auto's ahead steps): when a step's rows are
//   fixed, the router sends the drafter, without waiting, one DraftRequest for the next
//   step: per seq its new committed tokens followed by this step's drafts (assumed accepted), k = W + 1. The drafter's first
//   proposal g guesses the target's token after them, the rest are drafts for the next step.
//   So the drafter works while the step runs in the mesh. At the next step the router knows
//   the real history: a seq's proposals are valid when every draft was accepted and the
//   target's token equals g; then its drafts are the proposals after g (a hit). Every g
//   compared is an acceptance sample, at no cost. A seq without valid proposals (a miss) gets a
//   synchronous request as without the pipeline when that pays (sync_pays: its expected extra
//   tokens against the measured round trip; always with --draft-adapt false), else width 0
//   this step. One ahead request is in
//   flight at a time; the next step waits for it (within its deadline) only when a seq of it
//   can use its proposals at once; otherwise it only looks, and a reply not in yet is looked
//   for again later (probes of low-acceptance seqs are ahead requests of k 1 and never waited
//   for). A new drafter incarnation, a failed or abandoned request: backoff as for a late
//   synchronous request. Requests carry an increasing number (Envelope.seq, from the wall clock
//   at start) so the drafter ignores a seq's part of a request older than one it has applied
//   (an abandoned request may reach it late), and replies are matched by step_id and seq.
// - Mode (--draft-pipeline auto, the default): each step is an ahead step (as above) or a
//   synchronous one (as with --draft-pipeline false), chosen per row range of the step
//   (mm_spec_mode_pick, mm/spec.h: c=1 and c=16 are measured apart) by the measured emitted
//   tokens per seq per ms of each mode, the other re-measured one window (8 steps after 2 of
//   warm-up) every 64 steps of the range, doubling to 512 while it keeps losing, and only when
//   its width prices choose a width above 0. Each mode has its own width prices (an ahead
//   step's period holds the drafter's work that did not overlap, a synchronous one's its whole
//   round trip). A synchronous step after an ahead step waits for the ahead reply in flight and
//   drafts from its valid proposals; the other seqs get the synchronous request. true / false:
//   always ahead / always synchronous (false: no ahead request ever).
// - State per tracked seq (allocated once per table slot, not per token). One thread: all
//   calls are made under the step engine's mutex.
#ifndef MM_ROUTER_STEP_DRAFT_H
#define MM_ROUTER_STEP_DRAFT_H

#include <stdint.h>

#include "mm/ctl.h"
#include "router.h"

#define MM_DRAFT_MAX_K 8 // widest draft per seq per step

// --draft-pipeline: how a step's drafts are asked for
#define MM_DRAFT_PIPE_OFF 0  // false: before each step, waited for
#define MM_DRAFT_PIPE_ON 1   // true: ahead, during the step before
#define MM_DRAFT_PIPE_AUTO 2 // auto: per step, the mode measured better for the step's rows

typedef struct mm_draft_conf {
    int max_k;          // --draft-max (0: drafting off)
    int timeout_ms;     // --draft-timeout-ms
    bool adapt;         // --draft-adapt (false: always max_k)
    int max_rows;       // --draft-max-rows: draft rows per step
    int pipeline;       // --draft-pipeline: MM_DRAFT_PIPE_OFF / _ON / _AUTO (Design notes)
    int max_ctx, vocab, n_shards;
} mm_draft_conf;

typedef struct mm_draft mm_draft;

mm_err mm_draft_open(mm_draft **out, const mm_draft_conf *c, mm_registry *reg,
                     char err[MM_ERRLEN]);
void mm_draft_close(mm_draft *d); // accepts NULL

// mm_draft_begin runs before a step: forgets released seqs, records each seq's input tokens,
// and (for sampling seqs that allow it: max_draft > 0, logprobs 0, active[i]) takes drafts from
// the ahead proposals or asks the drafter, then (pipeline) sends the next step's ahead request.
// Writes n_draft[i] (0..MM_DRAFT_MAX_K) and draft[i * MM_DRAFT_MAX_K ...] for each plan seq;
// the total never exceeds room rows. Blocks at most --draft-timeout-ms on the drafter.
void mm_draft_begin(mm_draft *d, const Mmctl__StepPlan *p, const bool *active, int64_t room,
                    uint32_t *n_draft, int32_t *draft);

// mm_draft_may_draft: whether a step could get drafts now (drafting on and a drafter
// registered); a step begun early (step.c) must have none, and is only begun without one.
bool mm_draft_may_draft(mm_draft *d);

// mm_draft_ctrl_tail writes shard s's pending truncations as the CTRL tail (u32 n, n x {u64
// seq, i32 len, i32 0}) at buf and returns its bytes (0 when none). mm_draft_ctrl_sent marks
// them sent once the frame went out.
size_t mm_draft_ctrl_tail(mm_draft *d, int s, uint8_t *buf);
void mm_draft_ctrl_sent(mm_draft *d, int s);
size_t mm_draft_ctrl_max(const mm_draft *d); // largest tail in bytes

// mm_draft_verified records seq i's outcome: accepted of n_draft drafts (the shards hold
// n_draft rows past its inputs; the rejected ones are truncated at the next step).
void mm_draft_verified(mm_draft *d, const Mmctl__SeqStep *q, uint32_t n_draft,
                       uint32_t accepted, const int32_t *drafts);

// mm_draft_fed: the step just begun (p, the last mm_draft_begin's plan) fed some seqs a token
// still on the device then (MM_FOLLOW_PENDING(k): a plan begun early); picks (n) are those
// tokens now, for the seqs' histories.
void mm_draft_fed(mm_draft *d, const Mmctl__StepPlan *p, const int32_t *picks, size_t n);

// mm_draft_end closes the step: its wall time feeds the width costs; metrics are published in
// the router's status detail (at most every 50 ms while steps run: mm_draft_detail_flush).
void mm_draft_end(mm_draft *d, uint64_t step_ns);
// mm_draft_detail_flush publishes the metrics of steps that ended since the status detail was
// last built (mm_draft_end rebuilds it at most every 50 ms). Same thread rules as mm_draft_end.
void mm_draft_detail_flush(mm_draft *d);

#endif
