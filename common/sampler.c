// SPDX-License-Identifier: MIT
// Token choice and logprobs (see mm/sampler.h). Every result is a pure function of the logits
// row, the sampling parameters and the position: no state carries between calls.
#include "mm/sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct mm_sampler {
    int vocab;
    int32_t *idx; // (vocab) candidate ids, sorted by logit (seeded sampling with filters)
    float *p;     // (vocab) candidate weights
    float *y;     // (vocab) the penalised row
};

mm_err mm_sampler_new(mm_sampler **out, int vocab) {
    *out = NULL;
    if (vocab <= 0)
        return MM_EINVAL;
    mm_sampler *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return MM_ENOMEM;
    s->vocab = vocab;
    s->idx = malloc((size_t)vocab * sizeof(*s->idx));
    s->p = malloc((size_t)vocab * sizeof(*s->p));
    s->y = malloc((size_t)vocab * sizeof(*s->y));
    if (s->idx == NULL || s->p == NULL || s->y == NULL) {
        mm_sampler_free(s);
        return MM_ENOMEM;
    }
    *out = s;
    return MM_OK;
}

void mm_sampler_free(mm_sampler *s) {
    if (s == NULL)
        return;
    free(s->idx);
    free(s->p);
    free(s->y);
    free(s);
}

int mm_sampler_is_greedy(const mm_sampling *sp) {
    return sp == NULL || !(sp->temperature > 0.0f) || sp->top_k == 1;
}

int mm_sampling_has_penalty(const mm_sampling *sp) {
    return sp != NULL && (sp->presence_penalty != 0 || sp->frequency_penalty != 0 ||
                          (sp->repetition_penalty != 0 && sp->repetition_penalty != 1));
}

// "a before b": larger logit first, lower id on ties.
static int better(const float *x, int32_t a, int32_t b) {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
}

static uint64_t splitmix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// qsort has no context argument: the row being sorted, per thread.
static _Thread_local const float *t_sort_x;
static int cmp_idx(const void *a, const void *b) {
    int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    if (ia == ib)
        return 0;
    return better(t_sort_x, ia, ib) ? -1 : 1;
}

mm_err mm_sampler_pick(mm_sampler *s, const float *x, const mm_sampling *sp, int64_t pos,
                       uint32_t n_top, mm_sample *out, char err[MM_ERRLEN]) {
    const int V = s->vocab;
    memset(out, 0, sizeof(*out));
    if (n_top > MM_SAMPLER_MAX_TOP)
        return mm_errf(err, MM_EINVAL, "logprobs %u is over the limit of %d", n_top,
                       MM_SAMPLER_MAX_TOP);
    if (sp != NULL && (isnan(sp->temperature) || sp->temperature < 0 || isnan(sp->top_p) ||
                       sp->top_p < 0 || isnan(sp->min_p) || sp->min_p < 0 || sp->min_p > 1))
        return mm_errf(err, MM_EINVAL, "bad sampling values (temperature %g, top_p %g, min_p %g)",
                       (double)sp->temperature, (double)sp->top_p, (double)sp->min_p);
    if (sp != NULL && (!(sp->repetition_penalty >= 0) || !isfinite(sp->repetition_penalty) ||
                       !isfinite(sp->presence_penalty) || !isfinite(sp->frequency_penalty)))
        return mm_errf(err, MM_EINVAL, "bad penalties (presence %g, frequency %g, repetition %g)",
                       (double)sp->presence_penalty, (double)sp->frequency_penalty,
                       (double)sp->repetition_penalty);
    // log-softmax of the raw row: max, then the sum in index order in double.
    int32_t arg = 0;
    for (int32_t i = 0; i < V; i++) {
        if (isnan(x[i]))
            return mm_errf(err, MM_EINVAL, "logit %d is NaN", i);
        if (x[i] > x[arg])
            arg = i;
    }
    const float m = x[arg];
    double sum = 0.0;
    for (int32_t i = 0; i < V; i++)
        sum += exp((double)(x[i] - m));
    const float lse = (float)log(sum);
    const float *raw = x; // logprobs come from the raw row; the choice from the penalised one
    if (mm_sampling_has_penalty(sp) && sp->hist != NULL && sp->hist->n > 0) {
        const float rp = sp->repetition_penalty == 0 ? 1.0f : sp->repetition_penalty;
        memcpy(s->y, x, (size_t)V * sizeof(*x));
        for (uint32_t k = 0; k < sp->hist->n; k++) {
            const mm_tok_count *c = &sp->hist->tok[k];
            if (c->token < 0 || c->token >= V)
                return mm_errf(err, MM_EINVAL, "penalty history token %d is outside the vocab",
                               c->token);
            float v = s->y[c->token];
            if (rp != 1.0f && (c->prompt > 0 || c->output > 0))
                v = v > 0 ? v / rp : v * rp;
            v -= sp->frequency_penalty * (float)c->output;
            if (c->output > 0)
                v -= sp->presence_penalty;
            s->y[c->token] = v;
        }
        x = s->y;
        arg = 0;
        for (int32_t i = 1; i < V; i++)
            if (x[i] > x[arg])
                arg = i;
    }

    // top-n alternatives: insertion into a short sorted list.
    uint32_t nt = n_top < (uint32_t)V ? n_top : (uint32_t)V;
    for (int32_t i = 0; i < V && nt > 0; i++) {
        uint32_t k = out->n_top;
        if (k == nt && !better(raw, i, out->top_ids[k - 1]))
            continue;
        if (k < nt)
            out->n_top++;
        else
            k--;
        while (k > 0 && better(raw, i, out->top_ids[k - 1])) {
            out->top_ids[k] = out->top_ids[k - 1];
            k--;
        }
        out->top_ids[k] = i;
    }
    for (uint32_t j = 0; j < out->n_top; j++)
        out->top_logprobs[j] = (raw[out->top_ids[j]] - m) - lse;

    int32_t tok = arg;
    if (!mm_sampler_is_greedy(sp)) {
        const float inv_t = 1.0f / sp->temperature;
        int32_t n = V;
        for (int32_t i = 0; i < V; i++)
            s->idx[i] = i;
        bool need_sort = (sp->top_k > 0 && sp->top_k < (uint32_t)V) ||
                         (sp->top_p > 0 && sp->top_p < 1) || sp->min_p > 0;
        if (need_sort) {
            t_sort_x = x;
            qsort(s->idx, (size_t)V, sizeof(*s->idx), cmp_idx);
            if (sp->top_k > 0 && sp->top_k < (uint32_t)V)
                n = (int32_t)sp->top_k;
        }
        // weights softmax(x / T) over the candidates (the first is the max).
        const float mt = x[s->idx[0]] > x[arg] ? x[s->idx[0]] : x[arg];
        double z = 0.0;
        for (int32_t j = 0; j < n; j++) {
            s->p[j] = (float)exp((double)((x[s->idx[j]] - mt) * inv_t));
            z += s->p[j];
        }
        if (sp->top_p > 0 && sp->top_p < 1) {
            double c = 0.0;
            int32_t keep = n;
            for (int32_t j = 0; j < n; j++) {
                c += s->p[j] / z;
                if (c >= sp->top_p) {
                    keep = j + 1;
                    break;
                }
            }
            n = keep;
        }
        if (sp->min_p > 0) {
            const float floor_p = sp->min_p * s->p[0];
            int32_t keep = 1;
            while (keep < n && s->p[keep] >= floor_p)
                keep++;
            n = keep;
        }
        z = 0.0;
        for (int32_t j = 0; j < n; j++)
            z += s->p[j];
        // u in [0, 1): a pure function of (seed, pos).
        uint64_t r = splitmix64(sp->seed ^ splitmix64((uint64_t)pos));
        double u = (double)(r >> 11) * (1.0 / 9007199254740992.0) * z;
        tok = s->idx[n - 1];
        double c = 0.0;
        for (int32_t j = 0; j < n; j++) {
            c += s->p[j];
            if (u < c) {
                tok = s->idx[j];
                break;
            }
        }
    }
    out->token = tok;
    out->logprob = (raw[tok] - m) - lse;
    return MM_OK;
}
