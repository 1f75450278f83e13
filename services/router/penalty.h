// SPDX-License-Identifier: MIT
// Per-sequence token counts for presence/frequency/repetition penalties (mm/sampler.h), kept by
// the router for the sequences whose Sampling asks for a penalty.
//
// Design notes:
// - A fixed table of slots keyed by seq_id (sized at open); a slot's arrays, for max_ctx
//   distinct tokens (dense entries + an open-addressing index), are allocated at its first use
//   and kept for the next seq: no allocation per token, none per seq in the steady state.
// - History by position: a slot covers positions [0, len). Tokens fed at positions >= len were
//   not sampled here: they count as prompt. A sampled token counts as output and extends len;
//   when it is fed back at the next step its position is already covered, so it is not
//   counted twice. A slot is freed by StepPlan.release.
#ifndef MM_ROUTER_PENALTY_H
#define MM_ROUTER_PENALTY_H

#include <stdbool.h>
#include <stdint.h>

#include "mm/err.h"
#include "mm/sampler.h"

typedef struct mm_pen_table mm_pen_table;
typedef struct mm_pen_slot mm_pen_slot;

// mm_pen_table_new sizes n_slots slots of max_ctx tokens. Returns owned *out.
// Errors: MM_EINVAL (sizes <= 0), MM_ENOMEM.
mm_err mm_pen_table_new(mm_pen_table **out, int n_slots, int max_ctx);
void mm_pen_table_free(mm_pen_table *t); // accepts NULL

// mm_pen_table_get returns seq_id's slot, taking a free one for a new seq.
// Errors: MM_EFULL (every slot in use, named in err), MM_ENOMEM.
mm_err mm_pen_table_get(mm_pen_table *t, uint64_t seq_id, mm_pen_slot **out,
                        char err[MM_ERRLEN]);
// mm_pen_table_release frees seq_id's slot (no-op when it has none).
void mm_pen_table_release(mm_pen_table *t, uint64_t seq_id);

// mm_pen_slot_feed records tokens (n, borrowed) fed at positions pos.. (see the notes).
// Errors: MM_EINVAL (a gap: pos past the covered length), MM_EFULL (past max_ctx).
mm_err mm_pen_slot_feed(mm_pen_slot *s, int64_t pos, const int32_t *tokens, uint32_t n,
                        char err[MM_ERRLEN]);
// mm_pen_slot_sampled records token sampled for position pos as output.
mm_err mm_pen_slot_sampled(mm_pen_slot *s, int64_t pos, int32_t token, char err[MM_ERRLEN]);
// mm_pen_slot_hist: the slot's counts (borrowed; valid until the slot changes).
const mm_penalty_hist *mm_pen_slot_hist(const mm_pen_slot *s);

#endif
