// SPDX-License-Identifier: MIT
// Drafted-token verification; see mm/spec.h.
#include "mm/spec.h"

#include <math.h>
#include <string.h>

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

static int log2_range(int64_t x, int n) {
    int b = 0;
    for (int64_t c = x; c > 1 && b < n - 1; c >>= 1)
        b++;
    return b;
}

int mm_spec_bucket(int32_t ctx, int64_t rows) {
    return log2_range(ctx / 64, MM_SPEC_CTX_BUCKETS) * MM_SPEC_ROW_BUCKETS +
           log2_range(rows, MM_SPEC_ROW_BUCKETS);
}

void mm_spec_cost_add(mm_spec_costs *c, int bucket, int w, double ms) {
    if (bucket < 0 || bucket >= MM_SPEC_BUCKETS || w < 0 || w > MM_SPEC_MAX_W || !(ms >= 0))
        return;
    double *T = &c->T[bucket][w];
    if (c->n[bucket][w] == 0) {
        *T = ms;
    } else {
        if (ms > 3 * *T)
            ms = 3 * *T;
        double a = 1.0 / (double)(c->n[bucket][w] + 1); // the mean of the first 4 samples
        if (a < 0.25)
            a = 0.25;
        *T += a * (ms - *T);
    }
    c->n[bucket][w]++;
    c->at[bucket][w] = ++c->ticks[bucket];
}

static bool any_measured(const mm_spec_costs *c, int b, int max_w) {
    for (int k = 0; k <= max_w; k++)
        if (c->n[b][k])
            return true;
    return false;
}

// nearest_bucket: b if it has measurements, else the nearest that has (distance: ranges apart,
// the row range counting double, so that a step of the same size is preferred), or -1.
static int nearest_bucket(const mm_spec_costs *c, int b, int max_w) {
    if (any_measured(c, b, max_w))
        return b;
    const int bc = b / MM_SPEC_ROW_BUCKETS, br = b % MM_SPEC_ROW_BUCKETS;
    int best = -1, best_d = 1 << 30;
    for (int x = 0; x < MM_SPEC_BUCKETS; x++) {
        if (!any_measured(c, x, max_w))
            continue;
        int dc = x / MM_SPEC_ROW_BUCKETS - bc, dr = x % MM_SPEC_ROW_BUCKETS - br;
        int dist = (dc < 0 ? -dc : dc) + 2 * (dr < 0 ? -dr : dr);
        if (dist < best_d) {
            best_d = dist;
            best = x;
        }
    }
    return best;
}

// borrowed: the price of w, unmeasured in bucket bb, from the nearest other bucket x that
// measured it, relative to a narrower width k measured in both (the widest such): T_bb(k) x
// T_x(w) / T_x(k). A step of another shape costs another time, but what drafting w adds to a
// step relative to k is a better guess than nothing (without it, every new range would take a
// width that drafts at width 0's price until measured there). -1: no such bucket.
static double borrowed(const mm_spec_costs *c, int bb, int w) {
    const int bc = bb / MM_SPEC_ROW_BUCKETS, br = bb % MM_SPEC_ROW_BUCKETS;
    double T = -1;
    int best_d = 1 << 30;
    for (int x = 0; x < MM_SPEC_BUCKETS; x++) {
        if (x == bb || !c->n[x][w] || !(c->T[x][w] > 0))
            continue;
        int k = w - 1;
        while (k >= 0 && !(c->n[x][k] && c->n[bb][k] && c->T[x][k] > 0))
            k--;
        if (k < 0)
            continue;
        int dc = x / MM_SPEC_ROW_BUCKETS - bc, dr = x % MM_SPEC_ROW_BUCKETS - br;
        int dist = (dc < 0 ? -dc : dc) + 2 * (dr < 0 ? -dr : dr);
        if (dist < best_d) {
            best_d = dist;
            T = c->T[bb][k] * c->T[x][w] / c->T[x][k];
        }
    }
    return T;
}

double mm_spec_price(const mm_spec_costs *c, int b, int w, int max_w) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    if (b < 0 || b >= MM_SPEC_BUCKETS || w < 0 || w > max_w)
        return 1.0;
    int bb = nearest_bucket(c, b, max_w);
    if (bb < 0)
        return 1.0;
    if (c->n[bb][w])
        return c->T[bb][w] > 0 ? c->T[bb][w] : 1e-3;
    double T = -1;
    for (int dist = 1; dist <= max_w && T < 0; dist++) {
        if (w + dist <= max_w && c->n[bb][w + dist])
            T = c->T[bb][w + dist];
        else if (w - dist >= 0 && c->n[bb][w - dist])
            T = c->T[bb][w - dist];
    }
    for (int k = 0; k < w; k++) // never below a measured narrower width
        if (c->n[bb][k] && c->T[bb][k] > T)
            T = c->T[bb][k];
    double Tb = borrowed(c, bb, w); // nor below its relative price in another range
    if (Tb > T)
        T = Tb;
    return T > 0 ? T : 1e-3;
}

bool mm_spec_measured(const mm_spec_costs *c, int b, int w, int max_w) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    if (b < 0 || b >= MM_SPEC_BUCKETS || w < 0 || w > max_w)
        return false;
    int bb = nearest_bucket(c, b, max_w);
    return bb >= 0 && c->n[bb][w] > 0;
}

double mm_spec_price_low(const mm_spec_costs *c, int b, int w, int max_w) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    if (b < 0 || b >= MM_SPEC_BUCKETS || w < 0 || w > max_w)
        return 0;
    if (c->n[b][w]) {
        double T = (1.0 - MM_SPEC_PRICE_SLACK) * c->T[b][w];
        if (w > 0 && c->n[b][0] && c->T[b][0] > T)
            T = c->T[b][0];
        return T;
    }
    double T = 0;
    for (int k = 0; k < w; k++)
        if (c->n[b][k] && c->T[b][k] > T)
            T = c->T[b][k];
    double Tb = (1.0 - MM_SPEC_PRICE_SLACK) * borrowed(c, b, w);
    return Tb > T ? Tb : T;
}

// explore_pays: may candidate x be measured instead of the choice w? Always without e; an
// unmeasured 0 always; else when its optimistic score beats the choice's (mm/spec.h).
static bool explore_pays(const mm_spec_costs *c, int b, int x, int w, int max_w, const double *e) {
    if (!e || (x == 0 && c->n[b][0] == 0))
        return true;
    return e[x] * mm_spec_price(c, b, w, max_w) > e[w] * mm_spec_price_low(c, b, x, max_w);
}

int mm_spec_explore(const mm_spec_costs *c, int b, int w, int max_w, uint64_t stale,
                    const double *e) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    if (b < 0 || b >= MM_SPEC_BUCKETS || max_w <= 0)
        return -1;
    if (w < 0)
        w = 0;
    if (w > max_w)
        w = max_w;
    int cand[3] = {0, w - 1, w + 1};
    for (int i = 0; i < 3; i++)
        if (cand[i] >= 0 && cand[i] <= max_w && cand[i] != w && c->n[b][cand[i]] == 0 &&
            explore_pays(c, b, cand[i], w, max_w, e))
            return cand[i];
    for (int i = 0; i < 3; i++)
        if (cand[i] >= 0 && cand[i] <= max_w && cand[i] != w && c->n[b][cand[i]] &&
            c->ticks[b] - c->at[b][cand[i]] > stale && explore_pays(c, b, cand[i], w, max_w, e))
            return cand[i];
    // any other measured width whose price is older than 2 x stale (a wide width priced on an
    // unlucky sample would never be chosen, so never measured again), while it could pay
    int best = -1;
    uint64_t age = 2 * stale;
    for (int k = 0; k <= max_w; k++)
        if (k != w && c->n[b][k] && c->ticks[b] - c->at[b][k] > age &&
            explore_pays(c, b, k, w, max_w, e)) {
            age = c->ticks[b] - c->at[b][k];
            best = k;
        }
    return best;
}

bool mm_spec_ahead_pays(const mm_spec_costs *c, int b, int w, int max_w, double acc, int nd) {
    if (max_w > MM_SPEC_MAX_W)
        max_w = MM_SPEC_MAX_W;
    if (w < 1 || w > max_w || !(acc > 0) || nd < 0)
        return false;
    if (acc > 1)
        acc = 1;
    double p = acc, x = 0, ai = 1;
    for (int i = 0; i < nd; i++)
        p *= acc;
    for (int i = 1; i <= w; i++)
        x += (ai *= acc);
    const double t0 = mm_spec_price(c, b, 0, max_w), tw = mm_spec_price(c, b, w, max_w);
    return p * x * t0 > tw - t0;
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

int mm_spec_width_hold(const mm_spec_costs *c, int bucket, int max_w, const double *e, int prev,
                       double margin) {
    int w = mm_spec_width_sum(c, bucket, max_w, e);
    if (prev < 0 || prev > max_w || prev > MM_SPEC_MAX_W || prev == w)
        return w;
    double sw = e[w] / mm_spec_price(c, bucket, w, max_w);
    double sp = e[prev] / mm_spec_price(c, bucket, prev, max_w);
    return sw > sp * (1 + margin) ? w : prev;
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

// ---- drafting mode (mm/spec.h) --------------------------------------------------------------

void mm_spec_modes_init(mm_spec_modes *m) {
    memset(m, 0, sizeof(*m));
    for (int r = 0; r < MM_SPEC_ROW_BUCKETS; r++)
        m->choice[r] = m->explore[r] = m->last_mode[r] = m->win_mode[r] = -1;
}

int mm_spec_mode_range(int64_t seqs) {
    // floor(log2(seqs) + 0.5): seqs >= 2^(r - 1/2), i.e. seqs^2 >= 2^(2r - 1)
    int r = 0;
    while (r < MM_SPEC_ROW_BUCKETS - 1 && seqs > 0 && (double)seqs * (double)seqs >=
                                                          (double)(1ull << (2 * r + 1)))
        r++;
    return r;
}

// explore_start: range r measures mode x from this step (its first of the measurement).
static int explore_start(mm_spec_modes *m, int r, int x) {
    m->explore[r] = x;
    m->explore_steps[r] = 1;
    m->explorations++;
    return x;
}

// explore_end: range r's measurement is over (done or abandoned); the next one is due in
// MM_SPEC_MODE_EVERY << lost steps.
static void explore_end(mm_spec_modes *m, int r) {
    m->explore[r] = -1;
    m->explore_steps[r] = 0;
    m->since[r] = 0;
}

// window_reset: range r's open window starts empty.
static void window_reset(mm_spec_modes *m, int r) {
    m->win_steps[r] = 0;
    m->win_seqs[r] = 0;
    m->win_tok[r] = m->win_ms[r] = 0;
}

// mode_window: a window of mode in range r measured rate (tokens per seq per ms).
static void mode_window(mm_spec_modes *m, int r, int mode, double rate) {
    double *R = &m->rate[r][mode];
    uint32_t *n = &m->n[r][mode];
    if (*n == 0) {
        *R = rate;
    } else { // the mean of the first 3 windows, then an EMA weighing a new one 0.3
        double a = 1.0 / (double)(*n + 1);
        *R += (a < 0.3 ? 0.3 : a) * (rate - *R);
    }
    (*n)++;
    m->windows++;
    const bool explored = m->explore[r] == mode;
    if (explored)
        explore_end(m, r);
    const int c = m->choice[r], o = 1 - mode;
    if (c < 0) {
        m->choice[r] = mode;
    } else if (c == mode) { // the choice measured again: the other may now be the better
        if (m->n[r][o] && m->rate[r][o] > m->rate[r][c] * (1 + MM_SPEC_MODE_HOLD)) {
            m->choice[r] = o;
            m->switches++;
            m->lost[r] = 0;
        }
    } else if (*R > m->rate[r][c] * (1 + MM_SPEC_MODE_HOLD)) { // the other, better
        m->choice[r] = mode;
        m->switches++;
        m->lost[r] = 0;
    } else if (explored && m->lost[r] < 3) { // the other, still not better: measured rarer
        m->lost[r]++;
    }
}

void mm_spec_mode_add(mm_spec_modes *m, int r, int mode, double tokens, uint32_t seqs,
                      double ms, bool valid) {
    if (r < 0 || r >= MM_SPEC_ROW_BUCKETS || (mode != MM_SPEC_SYNC && mode != MM_SPEC_AHEAD))
        return;
    // (run is only compared with the warm-up: it stops growing past it, so a long-running
    // router's run of one mode never overflows)
    m->run[r] = mode != m->last_mode[r]            ? 1
                : m->run[r] <= MM_SPEC_MODE_WARM ? m->run[r] + 1
                                                 : MM_SPEC_MODE_WARM + 1;
    m->last_mode[r] = mode;
    if (m->win_mode[r] != mode || m->run[r] <= MM_SPEC_MODE_WARM) { // a new window
        m->win_mode[r] = mode;
        window_reset(m, r);
    }
    if (!valid || m->run[r] <= MM_SPEC_MODE_WARM || !(tokens >= 0) || !(ms > 0) ||
        !isfinite(tokens) || !isfinite(ms) || seqs == 0)
        return;
    m->win_tok[r] += tokens / seqs;
    m->win_ms[r] += ms;
    m->win_seqs[r] += seqs;
    if (++m->win_steps[r] < MM_SPEC_MODE_WIN || m->win_seqs[r] < MM_SPEC_MODE_SEQS)
        return;
    mode_window(m, r, mode, m->win_tok[r] / m->win_ms[r]);
    window_reset(m, r);
}

int mm_spec_mode_pick(mm_spec_modes *m, int r, const bool can[2]) {
    if (r < 0 || r >= MM_SPEC_ROW_BUCKETS)
        return MM_SPEC_AHEAD;
    const int c = m->choice[r];
    int x = m->explore[r];
    if (x >= 0) { // a measurement in progress, abandoned when it cannot pay or takes too long
        if (can[x] && m->explore_steps[r] < MM_SPEC_MODE_WARM + 4 * MM_SPEC_MODE_SEQS) {
            m->explore_steps[r]++;
            return x;
        }
        explore_end(m, r);
        if (m->lost[r] < 3) // (an unmeasured mode is then tried only when due, not at once)
            m->lost[r]++;
        if (c < 0 && can[1 - x]) // nothing measured yet: the other mode's turn
            return explore_start(m, r, 1 - x);
    } else if (c < 0) { // nothing measured in the range: ahead first, then sync
        x = can[MM_SPEC_AHEAD] ? MM_SPEC_AHEAD : can[MM_SPEC_SYNC] ? MM_SPEC_SYNC : -1;
        if (x >= 0)
            return explore_start(m, r, x);
    }
    if (c < 0)
        return MM_SPEC_AHEAD;
    const int o = 1 - c;
    if (can[o] && ((m->n[r][o] == 0 && m->lost[r] == 0) ||
                   m->since[r] >= (uint32_t)MM_SPEC_MODE_EVERY << m->lost[r]))
        return explore_start(m, r, o);
    m->since[r]++;
    return c;
}
