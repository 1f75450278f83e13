// SPDX-License-Identifier: MIT
// Drafted-token verification; see mm/spec.h.
#include "mm/spec.h"

mm_err mm_spec_verify(mm_sampler *s, const float *logits, int vocab, const mm_sampling *sp,
                      int64_t at, uint32_t n_top, const int32_t *draft, uint32_t n_draft,
                      mm_sample *first, int32_t *tok, float *lp, uint32_t *accepted,
                      char err[MM_ERRLEN]) {
    *accepted = 0;
    MM_TRY(mm_sampler_pick(s, logits, sp, at, n_top, first, err));
    int32_t prev = first->token;
    uint32_t a = 0;
    while (a < n_draft && prev == draft[a]) {
        mm_sample ms;
        MM_TRY(mm_sampler_pick(s, logits + (int64_t)(a + 1) * vocab, sp, at + 1 + a, 0, &ms,
                               err));
        tok[a] = ms.token;
        lp[a] = ms.logprob;
        prev = ms.token;
        *accepted = ++a;
    }
    return MM_OK;
}
