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

int mm_spec_bucket(int32_t ctx) {
    int b = 0;
    for (int32_t c = ctx / 64; c > 1 && b < MM_SPEC_BUCKETS - 1; c >>= 1)
        b++;
    return b;
}

void mm_spec_cost_add(mm_spec_costs *c, int bucket, int w, double ms) {
    if (bucket < 0 || bucket >= MM_SPEC_BUCKETS || w < 0 || w > MM_SPEC_MAX_W || !(ms >= 0))
        return;
    double *T = &c->T[bucket][w];
    *T = c->measured[bucket][w] ? 0.8 * *T + 0.2 * ms : ms;
    c->measured[bucket][w] = true;
}

double mm_spec_price(const mm_spec_costs *c, int b, int w, int max_w) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    int bb = -1;
    for (int dist = 0; dist < MM_SPEC_BUCKETS && bb < 0; dist++)
        for (int s = -1; s <= 1 && bb < 0; s += 2) {
            int x = b + s * dist;
            if (x < 0 || x >= MM_SPEC_BUCKETS)
                continue;
            for (int k = 0; k <= max_w; k++)
                if (c->measured[x][k])
                    bb = x;
        }
    if (bb < 0)
        return 1.0;
    double T = -1;
    if (c->measured[bb][w]) {
        T = c->T[bb][w];
    } else {
        for (int dist = 1; dist <= max_w && T < 0; dist++) {
            if (w + dist <= max_w && c->measured[bb][w + dist])
                T = c->T[bb][w + dist];
            else if (w - dist >= 0 && c->measured[bb][w - dist])
                T = c->T[bb][w - dist];
        }
    }
    for (int k = 0; k < w; k++) // never below a measured narrower width
        if (c->measured[bb][k] && c->T[bb][k] > T)
            T = c->T[bb][k];
    return T > 0 ? T : 1e-3;
}

int mm_spec_width_sum(const mm_spec_costs *c, int bucket, int max_w, const double *e) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    double best = -1;
    int bw = 0;
    for (int w = 0; w <= max_w; w++) {
        double s = e[w] / mm_spec_price(c, bucket, w, max_w);
        if (s > best * (1 + 1e-9)) {
            best = s;
            bw = w;
        }
    }
    return bw;
}

void mm_spec_expect_add(double *e, int max_w, int cap, double acc) {
    double sum = 0, ak = 1;
    for (int w = 0; w <= max_w && w <= MM_SPEC_MAX_W; w++) {
        if (w <= cap) {
            sum += ak;
            ak *= acc;
        }
        e[w] += sum;
    }
}

int mm_spec_width(const mm_spec_costs *c, int bucket, int max_w, double acc) {
    double e[MM_SPEC_MAX_W + 1] = {0};
    mm_spec_expect_add(e, max_w, max_w, acc);
    return mm_spec_width_sum(c, bucket, max_w, e);
}
