// SPDX-License-Identifier: MIT
// In-process engine over the model stages; see mm/engine.h.
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mm/engine.h"

mm_err mm_engine_open(mm_engine **out, const char *model_dir, const mm_engine_params *p,
                      char err[MM_ERRLEN]) {
    *out = NULL;
    mm_engine_params ep = p ? *p : (mm_engine_params){0};
    mm_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    mm_backend_params bp = {.n_threads = ep.n_threads};
    MM_TRY_GOTO(rv, mm_backend_open(&e->be, ep.device ? ep.device : "cpu", &bp, err), fail);
    MM_TRY_GOTO(rv, mm_model_open(&e->model, model_dir, e->be, err), fail);
    const mm_model_config *c = mm_model_cfg(e->model);
    e->max_rows = ep.max_rows > 0 ? ep.max_rows : 256;
    e->max_ctx = ep.max_ctx > 0 ? ep.max_ctx : 4096;
    if (e->max_ctx > c->max_pos && c->max_pos > 0)
        e->max_ctx = c->max_pos;
    mm_kv_params kp;
    mm_model_kv_params(e->model, &kp);
    kp.max_seqs = ep.max_seqs > 0 ? ep.max_seqs : 4;
    kp.max_ctx = e->max_ctx;
    size_t per_tok = mm_kv_token_bytes(&kp); // the cache's dtype (bf16 on CUDA's contract)
    kp.budget_bytes = ep.kv_bytes ? ep.kv_bytes
                                  : per_tok * (size_t)(kp.max_ctx + kp.block_size) * kp.max_seqs;
    MM_TRY_GOTO(rv, mm_kv_cache_new(&e->kv, &kp, e->be, err), fail);
    MM_TRY_GOTO(rv, mm_model_scratch_new(&e->scratch, e->model, e->max_rows, err), fail);
    size_t lb = (size_t)e->max_rows * (size_t)c->vocab * 4;
    MM_TRY_GOTO(rv, e->be->ops->buffer_alloc(e->be->ctx, lb, (void **)&e->logits), fail);
    e->h_logits = malloc(lb);
    e->row_pos = malloc((size_t)e->max_rows * sizeof(int32_t));
    e->row_seq = malloc((size_t)e->max_rows * sizeof(int32_t));
    e->row_want = malloc((size_t)e->max_rows * sizeof(bool));
    if (!e->h_logits || !e->row_pos || !e->row_seq || !e->row_want) {
        rv = MM_ENOMEM;
        goto fail;
    }
    *out = e;
    return MM_OK;
fail:
    mm_engine_close(e);
    return rv;
}

void mm_engine_close(mm_engine *e) {
    if (!e)
        return;
    if (e->logits)
        e->be->ops->buffer_free(e->be->ctx, e->logits);
    free(e->h_logits);
    free(e->row_pos);
    free(e->row_seq);
    free(e->row_want);
    mm_model_scratch_free(e->scratch);
    mm_kv_cache_free(e->kv);
    mm_model_close(e->model);
    mm_backend_close(e->be);
    free(e);
}

int32_t mm_engine_argmax(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return (int32_t)b;
}

mm_err mm_engine_greedy(mm_engine *e, const float *logits, int64_t n, int32_t *ids) {
    const int vocab = mm_model_cfg(e->model)->vocab;
    mm_err rv = mm_model_argmax(e->model, e->scratch, logits, n, ids);
    if (rv != MM_EUNSUPP)
        return rv;
    MM_TRY(e->be->ops->get(e->be->ctx, e->h_logits, logits, (size_t)n * (size_t)vocab * 4));
    for (int64_t i = 0; i < n; i++)
        ids[i] = mm_engine_argmax(e->h_logits + i * vocab, vocab);
    return MM_OK;
}

// prefill: mm_engine_prefill, and when next is not NULL the greedy next token after the last
// position (on the backend when it has argmax: one int comes back instead of the logits).
static mm_err prefill(mm_engine *e, int32_t seq, const int32_t *ids, int64_t n, float *logits,
                      float *last, int32_t *next, char err[MM_ERRLEN]) {
    const mm_model_config *c = mm_model_cfg(e->model);
    int32_t p0 = mm_kv_cache_seq_len(e->kv, seq);
    if (n <= 0)
        return mm_errf(err, MM_EINVAL, "no tokens");
    if (p0 + n > e->max_ctx)
        return mm_errf(err, MM_EINVAL, "sequence of %lld tokens exceeds max context %d",
                       (long long)(p0 + n), e->max_ctx);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab)
            return mm_errf(err, MM_EINVAL, "token id %d at %lld is outside the vocabulary (%d)",
                           ids[i], (long long)i, c->vocab);
    mm_err rv = mm_kv_cache_reserve(e->kv, seq, (int32_t)(p0 + n));
    if (rv != MM_OK)
        return mm_errf(err, rv, "kv cache: cannot reserve %lld positions",
                       (long long)(p0 + n));
    // forward calls of up to max_rows rows (the scratch's size)
    const int64_t chunk = e->max_rows;
    int32_t *posbuf = e->row_pos, *seqbuf = e->row_seq;
    bool *want = e->row_want;
    for (int64_t b = 0; b < n; b += chunk) {
        int64_t cn = n - b < chunk ? n - b : chunk;
        for (int64_t i = 0; i < cn; i++) {
            posbuf[i] = (int32_t)(p0 + b + i);
            seqbuf[i] = seq;
            want[i] = logits != NULL || ((last != NULL || next != NULL) && b + i == n - 1);
        }
        mm_model_rows rows = {.n_rows = cn, .seq = seqbuf, .pos = posbuf};
        int64_t nw = 0;
        for (int64_t i = 0; i < cn; i++)
            nw += want[i];
        MM_TRY(mm_model_forward(e->model, e->scratch, e->kv, &rows, ids + b, want, e->logits));
        if (nw == 0)
            continue;
        size_t row_bytes = (size_t)c->vocab * 4;
        if (next && !logits && !last && b + cn == n) // greedy only: the id, not the logits
            return mm_engine_greedy(e, e->logits + (nw - 1) * c->vocab, 1, next);
        MM_TRY(e->be->ops->get(e->be->ctx, e->h_logits, e->logits, (size_t)nw * row_bytes));
        if (logits)
            memcpy(logits + b * c->vocab, e->h_logits, (size_t)nw * row_bytes);
        if (last && b + cn == n)
            memcpy(last, e->h_logits + (nw - 1) * c->vocab, row_bytes);
        if (next && b + cn == n)
            *next = mm_engine_argmax(e->h_logits + (nw - 1) * c->vocab, c->vocab);
    }
    return MM_OK;
}

mm_err mm_engine_prefill(mm_engine *e, int32_t seq, const int32_t *ids, int64_t n,
                         float *logits, float *last, char err[MM_ERRLEN]) {
    return prefill(e, seq, ids, n, logits, last, NULL, err);
}

mm_err mm_engine_prefill_greedy(mm_engine *e, int32_t seq, const int32_t *ids, int64_t n,
                                int32_t *next, char err[MM_ERRLEN]) {
    if (!next)
        return mm_errf(err, MM_EINVAL, "prefill_greedy: no place for the next token");
    return prefill(e, seq, ids, n, NULL, NULL, next, err);
}

mm_err mm_engine_generate(mm_engine *e, const int32_t *prompt, int64_t n_prompt, int max_new,
                          int32_t eos, int32_t *out, int *n_out, float *step_logits,
                          char err[MM_ERRLEN]) {
    const mm_model_config *c = mm_model_cfg(e->model);
    *n_out = 0;
    int32_t seq = -1;
    mm_err rv = mm_kv_cache_seq_new(e->kv, &seq);
    if (rv != MM_OK)
        return mm_errf(err, rv, "kv cache: no free sequence slot");
    // without step_logits only the greedy ids are needed: the backend picks them (argmax)
    float *last = step_logits ? malloc((size_t)c->vocab * 4) : NULL;
    if (step_logits && !last) {
        mm_kv_cache_seq_free(e->kv, seq);
        return MM_ENOMEM;
    }
    int32_t tok = 0;
    MM_TRY_GOTO(rv, prefill(e, seq, prompt, n_prompt, NULL, last, last ? NULL : &tok, err), out);
    for (int t = 0; t < max_new; t++) {
        if (step_logits) {
            memcpy(step_logits + (size_t)t * c->vocab, last, (size_t)c->vocab * 4);
            tok = mm_engine_argmax(last, c->vocab);
        }
        out[(*n_out)++] = tok;
        if ((eos >= 0 && tok == eos) || t + 1 == max_new)
            break;
        MM_TRY_GOTO(rv, prefill(e, seq, &tok, 1, NULL, last, last ? NULL : &tok, err), out);
    }
out:
    free(last);
    mm_kv_cache_seq_free(e->kv, seq);
    return rv;
}

mm_err mm_engine_ids_parse(const char *s, int32_t **out, int64_t *n, char err[MM_ERRLEN]) {
    *out = NULL;
    *n = 0;
    size_t cap = 16, k = 0;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    if (!ids)
        return MM_ENOMEM;
    const char *p = s;
    for (;;) {
        while (*p == ' ')
            p++;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return mm_errf(err, MM_EINVAL, "ids: '%.40s' is not a non-negative integer", p);
        }
        if (k == cap) {
            int32_t *q = realloc(ids, (cap *= 2) * sizeof(int32_t));
            if (!q) {
                free(ids);
                return MM_ENOMEM;
            }
            ids = q;
        }
        ids[k++] = (int32_t)v;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == 0)
            break;
        if (*p != ',') {
            free(ids);
            return mm_errf(err, MM_EINVAL, "ids: unexpected '%c' (want comma-separated ids)", *p);
        }
        p++;
    }
    *out = ids;
    *n = (int64_t)k;
    return MM_OK;
}
