// SPDX-License-Identifier: MIT
// Verification of drafted tokens (speculative decoding), shared by the router and the tests.
//
// Design notes: the draft rows of a seq ride in the same forward pass as its input tokens, so
// row 0's logits give the token after the inputs and row m + 1's (draft m's row) the token
// after draft m. Each token is picked by mm_sampler_pick exactly as plain decoding would pick
// it at that position (greedy: argmax; seeded: the inverse CDF of the filtered softmax at
// u(seed, position)), and draft m is accepted while it equals the token picked before it. With
// a deterministic drafter (q one-hot at x) this is speculative sampling: x is accepted with
// probability p(x) = min(1, p(x) / q(x)), and when rejected the emitted token is distributed as
// p without x, renormalised, the residual max(0, p - q) normalised. So the output has the
// target's distribution, and for a given seed it is the very token sequence of plain decoding.
// (A drafter with a non-degenerate q would need the general rule with separate uniforms; the
// drafters here are greedy or n-gram, so q is one-hot.)
#ifndef MM_SPEC_H
#define MM_SPEC_H

#include <stdint.h>

#include "mm/sampler.h"

// mm_spec_verify checks n_draft drafts against logits (host, (1 + n_draft) rows of vocab:
// the last input row, then each draft's row) for a seq whose next token goes to position at.
// first receives the token after the inputs (with n_top alternatives); the tokens after each
// accepted draft go to tok/lp (n_draft room). Returns MM_OK with *accepted (0..n_draft): the
// seq emits first->token then tok[0, *accepted). Errors: mm_sampler_pick's (message in err).
mm_err mm_spec_verify(mm_sampler *s, const float *logits, int vocab, const mm_sampling *sp,
                      int64_t at, uint32_t n_top, const int32_t *draft, uint32_t n_draft,
                      mm_sample *first, int32_t *tok, float *lp, uint32_t *accepted,
                      char err[MM_ERRLEN]);

#endif
