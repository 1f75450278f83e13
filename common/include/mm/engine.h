// SPDX-License-Identifier: MIT
// The in-process engine: one model, its backend, a paged KV cache and scratch, running whole
// sequences through mm_model_forward (the reference the mesh is held to). Used by
// `moemesh logits|generate|bench-model` and by the tests. Not thread-safe: one owner.
#ifndef MM_ENGINE_H
#define MM_ENGINE_H

#include <stdint.h>

#include "mm/model.h"

typedef struct mm_engine_params {
    const char *device;  // "cpu" (default), "cuda:N"
    int n_threads;       // CPU threads; 0 = all cores
    int max_ctx;         // longest sequence (tokens); 0 = 4096 (capped by the model)
    int max_seqs;        // KV sequence slots; 0 = 4
    int64_t max_rows;    // rows per forward call (prefill chunk); 0 = 256
    size_t kv_bytes;     // KV pool budget; 0 = enough for max_seqs * max_ctx
} mm_engine_params;

typedef struct mm_engine {
    mm_backend *be;
    mm_model *model;
    mm_kv_cache *kv;
    mm_model_scratch *scratch;
    float *logits;       // (max_rows, vocab) backend
    float *h_logits;     // (max_rows, vocab) host
    int32_t *row_pos, *row_seq; // (max_rows) host: a prefill forward's per-row inputs
    bool *row_want;             // (max_rows) host
    int64_t max_rows;
    int max_ctx;
} mm_engine;

// mm_engine_open opens backend, model, cache and scratch. Returns owned *out. Errors as
// mm_backend_open / mm_model_open, with the message in err.
mm_err mm_engine_open(mm_engine **out, const char *model_dir, const mm_engine_params *p,
                      char err[MM_ERRLEN]);
void mm_engine_close(mm_engine *e); // accepts NULL

// mm_engine_prefill appends tokens ids (n) to sequence seq (from mm_kv_cache_seq_new), in
// chunks of max_rows. If logits (host, (n, vocab)) is not NULL every position's logits are
// written; if last (host, (vocab)) is not NULL the last position's. Errors: MM_EINVAL (bad
// id, too long: named in err), MM_EFULL (KV pool exhausted).
mm_err mm_engine_prefill(mm_engine *e, int32_t seq, const int32_t *ids, int64_t n,
                         float *logits, float *last, char err[MM_ERRLEN]);

// mm_engine_prefill_greedy: mm_engine_prefill, then *next = the greedy token after the last
// position, picked on the backend when it has argmax (one id comes back, not the logits).
mm_err mm_engine_prefill_greedy(mm_engine *e, int32_t seq, const int32_t *ids, int64_t n,
                                int32_t *next, char err[MM_ERRLEN]);

// mm_engine_argmax: index of the largest of n values (the first on ties, as torch.argmax).
int32_t mm_engine_argmax(const float *x, int64_t n);

// mm_engine_greedy: the greedy ids (host, n) of n logits rows at logits (backend memory inside
// e->logits, rows vocab apart; n <= max_rows): picked on the backend when it has argmax (n ints
// come back), else the rows are read into e->h_logits and scanned with mm_engine_argmax.
mm_err mm_engine_greedy(mm_engine *e, const float *logits, int64_t n, int32_t *ids);

// mm_engine_decode_greedy: greedy decoding of n_seqs sequences together (1..max_rows, each
// from mm_kv_cache_seq_new and distinct), one forward pass per step: step 0 appends first[i]
// to seqs[i], each later step the previous step's pick; out (steps x n_seqs, step-major)
// receives the picks. Stops after `steps` steps, or after the first step in which some
// sequence picked eos (eos >= 0); *done = the steps whose picks are in out. Each sequence then
// holds the tokens fed: first[i] and its picks of every step before the last (so the last
// picks are the next tokens to feed, as after mm_engine_prefill_greedy). Where the model can
// overlap (mm_model_can_overlap: a device with argmax and fetch) step t+1 is issued before
// step t's picks are read, so the device does not wait for the host between steps; a step
// issued past the stop is discarded (its positions dropped from the cache). Env
// MM_ENGINE_OVERLAP=0: one step at a time (same picks). Errors as mm_engine_prefill, naming
// the step; picks of the steps before a failed one stay in out (*done counts them).
// mm_engine_overlaps: whether mm_engine_decode_greedy overlaps its steps on e (the model can,
// and MM_ENGINE_OVERLAP is not 0).
bool mm_engine_overlaps(const mm_engine *e);
mm_err mm_engine_decode_greedy(mm_engine *e, const int32_t *seqs, int n_seqs,
                               const int32_t *first, int steps, int32_t eos, int32_t *out,
                               int *done, char err[MM_ERRLEN]);

// mm_engine_generate: prefill prompt into a fresh sequence, then greedy-decode max_new tokens
// one at a time with the KV cache; out (max_new) receives them. If eos >= 0 it stops after
// emitting eos; *n_out is the count. If step_logits (host, (max_new, vocab)) is not NULL it
// receives the logits each token was chosen from.
mm_err mm_engine_generate(mm_engine *e, const int32_t *prompt, int64_t n_prompt, int max_new,
                          int32_t eos, int32_t *out, int *n_out, float *step_logits,
                          char err[MM_ERRLEN]);

// mm_engine_ids_parse reads "1,2, 3" into a malloc'd array (*out, free it) of *n ids.
// Errors: MM_EINVAL naming the bad item; MM_ENOMEM.
mm_err mm_engine_ids_parse(const char *s, int32_t **out, int64_t *n, char err[MM_ERRLEN]);

#endif
