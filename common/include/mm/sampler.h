// SPDX-License-Identifier: MIT
// Picking the next token from a logits row, and its logprobs: the one function the router and
// `moemesh generate --logprobs` share, so the mesh and the in-process engine print the same bits.
//
// Design notes:
// - Logprobs are log-softmax of the raw logits (before temperature, top-k/p), in f32 with the
//   normalising sum accumulated in double in index order: a pure function of the row.
// - Greedy (temperature <= 0 or top_k == 1): argmax, the lowest id on ties (torch.argmax).
// - Seeded: the uniform number for a token is a pure function of (seed, pos), pos being the
//   position the sampled token will occupy, so a seeded request gives the same tokens whatever
//   shares its steps. Filters apply in the order top_k, top_p, min_p on softmax(logits / T).
// - Penalties (vLLM's semantics) change a copy of the row before greedy argmax, temperature and
//   the filters, from the token counts in sp->hist: repetition (token seen in prompt or output):
//   logit > 0 divided by it, otherwise multiplied; then frequency * output count and presence
//   (output count > 0) are subtracted. Logprobs stay those of the raw row (vLLM's default
//   logprobs_mode "raw_logprobs").
// - An mm_sampler holds scratch sized once for the vocab: no allocation per token. One thread.
#ifndef MM_SAMPLER_H
#define MM_SAMPLER_H

#include <stdint.h>

#include "mm/err.h"

#define MM_SAMPLER_MAX_TOP 20 // most top logprobs one token reports (OpenAI's limit)

// One distinct token of a sequence's history and how often it occurred.
typedef struct mm_tok_count {
    int32_t token;
    uint32_t prompt; // occurrences in the prompt (every token fed that was not sampled)
    uint32_t output; // occurrences in the generated output
} mm_tok_count;

typedef struct mm_penalty_hist {
    const mm_tok_count *tok; // (n) distinct tokens, any order
    uint32_t n;
} mm_penalty_hist;

typedef struct mm_sampling {
    float temperature; // <= 0: greedy
    float top_p;       // 0 or >= 1: off
    uint32_t top_k;    // 0: off
    float min_p;       // 0: off
    uint64_t seed;
    float presence_penalty;   // 0: off
    float frequency_penalty;  // 0: off
    float repetition_penalty; // 0 or 1: off; else > 0
    const mm_penalty_hist *hist; // borrowed; the counts penalties apply to (NULL: none)
} mm_sampling;

typedef struct mm_sample {
    int32_t token;
    float logprob;                          // log-softmax of the raw logits at token
    uint32_t n_top;
    int32_t top_ids[MM_SAMPLER_MAX_TOP];    // best first (ties: lower id first)
    float top_logprobs[MM_SAMPLER_MAX_TOP];
} mm_sample;

typedef struct mm_sampler mm_sampler;

// mm_sampler_new sizes scratch for vocab entries. Returns owned *out (mm_sampler_free).
// Errors: MM_EINVAL (vocab <= 0), MM_ENOMEM.
mm_err mm_sampler_new(mm_sampler **out, int vocab);
void mm_sampler_free(mm_sampler *s); // accepts NULL

// mm_sampler_pick chooses the token after logits (vocab, host, borrowed) with sp (NULL:
// greedy) for position pos, and fills out with its logprob and the n_top best (capped at
// MM_SAMPLER_MAX_TOP). Errors: MM_EINVAL (n_top too large, a NaN logit, bad sampling values,
// named in err). Not thread-safe (scratch).
mm_err mm_sampler_pick(mm_sampler *s, const float *logits, const mm_sampling *sp, int64_t pos,
                       uint32_t n_top, mm_sample *out, char err[MM_ERRLEN]);

// mm_sampler_greedy reports whether sp selects greedy decoding.
int mm_sampler_is_greedy(const mm_sampling *sp);

// mm_sampling_has_penalty reports whether sp asks for a non-neutral penalty.
int mm_sampling_has_penalty(const mm_sampling *sp);

#endif
