// SPDX-License-Identifier: MIT
// In-process engine over the model stages; see mm/engine.h.
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mm/config.h"
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

// issue: step t of mm_engine_decode_greedy (positions len0 + t), its ids the host's `ids`
// (step 0, or one step at a time) or the device's picks of step t - 1 (ids NULL); with overlap
// the picks are started on their way to the host (*ticket).
static mm_err issue(mm_engine *e, const int32_t *seqs, int n, const int32_t *len0, int t,
                    const int32_t *ids, bool overlap, uint64_t *ticket, char err[MM_ERRLEN]) {
    int32_t *pos = e->row_pos, *sq = e->row_seq;
    for (int i = 0; i < n; i++) {
        pos[i] = len0[i] + t;
        sq[i] = seqs[i];
        if (pos[i] + 1 > e->max_ctx)
            return mm_errf(err, MM_EINVAL, "decode step %d: sequence %d would exceed max context %d",
                           t, seqs[i], e->max_ctx);
        const mm_err rv = mm_kv_cache_reserve(e->kv, seqs[i], pos[i] + 1);
        if (rv != MM_OK)
            return mm_errf(err, rv, "decode step %d: kv cache: cannot reserve %d positions for "
                           "sequence %d", t, pos[i] + 1, seqs[i]);
    }
    mm_model_rows rows = {.n_rows = n, .seq = sq, .pos = pos};
    mm_err rv = ids ? mm_model_forward(e->model, e->scratch, e->kv, &rows, ids, NULL, e->logits)
                    : mm_model_forward_next(e->model, e->scratch, e->kv, &rows, NULL, e->logits);
    if (rv == MM_OK && overlap)
        rv = mm_model_pick_async(e->model, e->scratch, e->logits, n, ticket);
    return rv == MM_OK ? MM_OK : mm_errf(err, rv, "decode step %d: %s", t, mm_strerror(rv));
}

bool mm_engine_overlaps(const mm_engine *e) {
    return mm_model_can_overlap(e->model, e->scratch) && !mm_env_off("MM_ENGINE_OVERLAP");
}

mm_err mm_engine_decode_greedy(mm_engine *e, const int32_t *seqs, int n_seqs,
                               const int32_t *first, int steps, int32_t eos, int32_t *out,
                               int *done, char err[MM_ERRLEN]) {
    const mm_model_config *c = mm_model_cfg(e->model);
    *done = 0;
    if (!seqs || !first || !out || n_seqs < 1 || n_seqs > e->max_rows || steps < 0)
        return mm_errf(err, MM_EINVAL, "decode: %d sequences (1..%lld) and %d steps", n_seqs,
                       (long long)e->max_rows, steps);
    if (steps == 0)
        return MM_OK;
    int32_t *len0 = malloc((size_t)n_seqs * sizeof(int32_t));
    if (!len0)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    for (int i = 0; i < n_seqs && rv == MM_OK; i++) {
        len0[i] = mm_kv_cache_seq_len(e->kv, seqs[i]);
        if (first[i] < 0 || first[i] >= c->vocab)
            rv = mm_errf(err, MM_EINVAL, "decode: token id %d of sequence %d is outside the "
                         "vocabulary (%d)", first[i], seqs[i], c->vocab);
        for (int j = 0; j < i && rv == MM_OK; j++)
            if (seqs[j] == seqs[i])
                rv = mm_errf(err, MM_EINVAL, "decode: sequence %d given twice", seqs[i]);
    }
    if (rv != MM_OK) {
        free(len0);
        return rv;
    }
    const bool overlap = mm_engine_overlaps(e) && (size_t)n_seqs * 4 <= MM_FETCH_BYTES;
    uint64_t cur = 0; // the ticket of step t's picks, on their way (overlap)
    char err2[MM_ERRLEN] = "";
    if (overlap)
        rv = issue(e, seqs, n_seqs, len0, 0, first, true, &cur, err);
    for (int t = 0; t < steps && rv == MM_OK; t++) {
        int32_t *picks = out + (size_t)t * n_seqs;
        mm_err ahead = MM_OK;
        if (!overlap) {
            const int32_t *ids = t == 0 ? first : picks - n_seqs;
            rv = issue(e, seqs, n_seqs, len0, t, ids, false, NULL, err);
            if (rv == MM_OK)
                rv = mm_engine_greedy(e, e->logits, n_seqs, picks);
            if (rv != MM_OK)
                break;
        } else {
            // step t + 1 goes out before step t's picks are read; an error there is reported
            // once step t's picks are in (unless step t ends the run)
            uint64_t nxt = 0;
            if (t + 1 < steps)
                ahead = issue(e, seqs, n_seqs, len0, t + 1, NULL, true, &nxt, err2);
            rv = mm_model_pick_wait(e->model, e->scratch, cur, picks);
            cur = ahead == MM_OK ? nxt : 0;
            if (rv != MM_OK) {
                mm_errf(err, rv, "decode step %d: reading the picks: %s", t, mm_strerror(rv));
                break;
            }
        }
        *done = t + 1;
        bool stop = false;
        for (int i = 0; i < n_seqs && eos >= 0; i++)
            stop |= picks[i] == eos;
        if (stop)
            break;
        if (ahead != MM_OK) {
            rv = ahead;
            memcpy(err, err2, MM_ERRLEN);
        }
    }
    if (cur) { // a step past the stop or the failure is on its way: wait for it, drop its picks
        int32_t *scratch = e->row_pos; // n_seqs ints, unused now
        (void)mm_model_pick_wait(e->model, e->scratch, cur, scratch);
    }
    for (int i = 0; i < n_seqs; i++) // the tokens fed: first and every pick but the last
        mm_kv_cache_truncate(e->kv, seqs[i], len0[i] + *done);
    free(len0);
    return rv;
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
    if (!step_logits && max_new > 0) { // greedy ids only: decode steps overlapped where possible
        out[(*n_out)++] = tok;
        if ((eos >= 0 && tok == eos) || max_new == 1)
            goto out;
        int done = 0;
        rv = mm_engine_decode_greedy(e, &seq, 1, &tok, max_new - 1, eos, out + 1, &done, err);
        *n_out += done;
        goto out;
    }
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
