// SPDX-License-Identifier: MIT
// Drafted-token verification (mm/spec.h): greedy acceptance and bits, seeded determinism, and
// the output distribution of speculative sampling against the target's (chi-square).
#include <limits.h>
#include <math.h>

#include "mm/spec.h"
#include "mm_test.h"

#define V 8

static const float ROW[V] = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -1.5f};

static void rows3(float *lg) {
    for (int r = 0; r < 3; r++)
        memcpy(lg + r * V, ROW, sizeof(ROW));
}

static void test_spec_greedy(void) {
    mm_sampler *s = NULL;
    MM_PASS(mm_sampler_new(&s, V));
    float lg[4 * V];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < V; v++)
            lg[r * V + v] = (float)((v * 7 + r * 3) % V) * 0.25f; // argmax of row r: 7*v+3r = 7 mod 8
    int32_t am[4];
    for (int r = 0; r < 4; r++) {
        am[r] = 0;
        for (int v = 1; v < V; v++)
            if (lg[r * V + v] > lg[r * V + am[r]])
                am[r] = v;
    }
    // Drafts equal to the first two argmaxes, then a wrong one.
    int32_t draft[3] = {am[0], am[1], (am[2] + 1) % V}, tok[3];
    float lp[3];
    mm_sample first;
    uint32_t a = 99;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_spec_verify(s, lg, V, NULL, 5, 2, draft, 3, &first, tok, lp, &a, err));
    MM_EQ(a, 2);
    MM_EQ(first.token, am[0]);
    MM_EQ(first.n_top, 2);
    MM_EQ(tok[0], am[1]);
    MM_EQ(tok[1], am[2]);
    // Each token's logprob is the bits plain decoding reports for that row and position.
    for (int r = 0; r < 3; r++) {
        mm_sample p;
        MM_PASS(mm_sampler_pick(s, lg + r * V, NULL, 5 + r, 0, &p, err));
        MM_TRUE(memcmp(r == 0 ? &first.logprob : &lp[r - 1], &p.logprob, 4) == 0);
    }
    // A first draft that disagrees: nothing accepted, the target's token alone.
    draft[0] = (am[0] + 1) % V;
    MM_PASS(mm_spec_verify(s, lg, V, NULL, 5, 0, draft, 3, &first, tok, lp, &a, err));
    MM_EQ(a, 0);
    MM_EQ(first.token, am[0]);
    // No drafts: plain decoding.
    MM_PASS(mm_spec_verify(s, lg, V, NULL, 5, 0, draft, 0, &first, tok, lp, &a, err));
    MM_EQ(a, 0);
    mm_sampler_free(s);
}

// Seeded: the same seed gives the same tokens, and they are plain decoding's.
static void test_spec_seeded_same_tokens(void) {
    mm_sampler *s = NULL;
    MM_PASS(mm_sampler_new(&s, V));
    float lg[3 * V];
    rows3(lg);
    char err[MM_ERRLEN] = "";
    int n_acc = 0;
    for (uint64_t seed = 1; seed <= 200; seed++) {
        mm_sampling sp = {.temperature = 0.8f, .seed = seed};
        int32_t draft[2] = {0, 0}, tok[2], tok2[2];
        float lp[2];
        mm_sample f1, f2, p;
        uint32_t a1, a2;
        MM_PASS(mm_spec_verify(s, lg, V, &sp, 40, 0, draft, 2, &f1, tok, lp, &a1, err));
        MM_PASS(mm_spec_verify(s, lg, V, &sp, 40, 0, draft, 2, &f2, tok2, lp, &a2, err));
        MM_EQ(a1, a2);
        MM_EQ(f1.token, f2.token);
        MM_PASS(mm_sampler_pick(s, lg, &sp, 40, 0, &p, err));
        MM_EQ(f1.token, p.token);
        for (uint32_t m = 0; m < a1; m++) {
            MM_EQ(tok[m], tok2[m]);
            MM_PASS(mm_sampler_pick(s, lg + (m + 1) * V, &sp, 41 + m, 0, &p, err));
            MM_EQ(tok[m], p.token);
        }
        n_acc += a1 > 0;
    }
    MM_TRUE(n_acc > 0 && n_acc < 200); // both outcomes were exercised
    mm_sampler_free(s);
}

static double chi2(const long *obs, const double *p, int k, long n) {
    double x = 0;
    for (int v = 0; v < k; v++) {
        double e = p[v] * (double)n;
        x += ((double)obs[v] - e) * ((double)obs[v] - e) / e;
    }
    return x;
}

// Distribution: with the draft x = token 1 (q one-hot), over 20000 seeds the emitted first
// token must follow p = softmax(ROW); given a rejection it must follow the residual (p without
// x, renormalised); given an acceptance the next token must follow p again. Three chi-square
// tests at a false-alarm rate of 1e-4 each (critical values 29.877 for 7 degrees of freedom,
// 27.856 for 6), plus the acceptance rate within 4.5 standard deviations of p(x) (6.8e-6):
// a correct implementation fails this test with probability below 4e-4. The seeds are fixed,
// so the outcome is reproducible.
static void test_spec_distribution(void) {
    mm_sampler *s = NULL;
    MM_PASS(mm_sampler_new(&s, V));
    float lg[3 * V];
    rows3(lg);
    double p[V], z = 0, pr[V];
    for (int v = 0; v < V; v++)
        z += exp((double)ROW[v]);
    for (int v = 0; v < V; v++)
        p[v] = exp((double)ROW[v]) / z;
    const int32_t x = 1;
    for (int v = 0; v < V; v++)
        pr[v] = v == x ? 0 : p[v] / (1 - p[x]);
    long first[V] = {0}, resid[V] = {0}, second[V] = {0}, n_acc = 0, n_rej = 0;
    const long N = 20000;
    char err[MM_ERRLEN] = "";
    for (long i = 0; i < N; i++) {
        mm_sampling sp = {.temperature = 1.0f, .seed = 1000003ull * (uint64_t)i + 17};
        int32_t draft[2] = {x, x}, tok[2];
        float lp[2];
        mm_sample f;
        uint32_t a;
        MM_PASS(mm_spec_verify(s, lg, V, &sp, 7, 0, draft, 2, &f, tok, lp, &a, err));
        first[f.token]++;
        if (a == 0) {
            MM_TRUE(f.token != x);
            resid[f.token]++;
            n_rej++;
        } else {
            MM_EQ(f.token, x);
            second[tok[0]]++;
            n_acc++;
        }
    }
    double c_first = chi2(first, p, V, N), c_second = chi2(second, p, V, n_acc);
    // the residual has no mass at x: 6 degrees of freedom over the other tokens
    long r6[V - 1];
    double p6[V - 1];
    for (int v = 0, j = 0; v < V; v++)
        if (v != x) {
            r6[j] = resid[v];
            p6[j++] = pr[v];
        }
    double c_resid = chi2(r6, p6, V - 1, n_rej);
    double rate = (double)n_acc / (double)N, sd = sqrt(p[x] * (1 - p[x]) / (double)N);
    fprintf(stderr, "chi2 first %.2f, residual %.2f, after acceptance %.2f; acceptance %.4f "
                    "(p(x) %.4f, sd %.4f)\n", c_first, c_resid, c_second, rate, p[x], sd);
    MM_TRUE(c_first < 29.877);
    MM_TRUE(c_resid < 27.856);
    MM_TRUE(c_second < 29.877);
    MM_TRUE(fabs(rate - p[x]) < 4.5 * sd);
    mm_sampler_free(s);
}

// Width from measured costs: nothing measured -> the widest; drafting that does not pay -> 0;
// a measured width at its EMA; unmeasured widths priced as the nearest measured one and never
// below a measured narrower one; exploration re-measures 0 and the neighbours of the choice.
static void test_spec_width(void) {
    mm_spec_costs c;
    memset(&c, 0, sizeof(c));
    MM_EQ(mm_spec_width(&c, 0, 4, 0.5), 4); // explore: every width costs the same
    MM_EQ(mm_spec_width(&c, 0, 0, 0.9), 0);
    mm_spec_cost_add(&c, 0, 0, 10.0);
    mm_spec_cost_add(&c, 0, 4, 30.0);
    // unmeasured 1..3: nearest measured (1 -> 0's 10 ms, 2 -> tie: the wider, 4's 30 ms)
    MM_NEAR(mm_spec_price(&c, 0, 1, 4), 10.0, 1e-9);
    MM_NEAR(mm_spec_price(&c, 0, 2, 4), 30.0, 1e-9);
    MM_NEAR(mm_spec_price(&c, 0, 3, 4), 30.0, 1e-9);
    // acceptance 0: nothing beats not drafting
    MM_EQ(mm_spec_width(&c, 0, 4, 0.0), 0);
    // acceptance 1: width 1 (unmeasured, priced at width 0's 10 ms) gives 2 tokens per 10 ms
    MM_EQ(mm_spec_width(&c, 0, 4, 1.0), 1);
    mm_spec_cost_add(&c, 0, 1, 25.0); // measured: width 1 is dear
    // 2 and 3 unmeasured: nearest is 1 or 4 -> at least 25 (never below width 1's 25 ms)
    MM_NEAR(mm_spec_price(&c, 0, 2, 4), 25.0, 1e-9);
    MM_NEAR(mm_spec_price(&c, 0, 3, 4), 30.0, 1e-9);
    MM_EQ(mm_spec_width(&c, 0, 4, 1.0), 4);  // 5 tokens per 30 ms
    MM_EQ(mm_spec_width(&c, 0, 4, 0.1), 0);  // low acceptance: not worth 2.5x
    MM_EQ(mm_spec_width(&c, 0, 4, 0.7), 0); // 2.77 tokens per 30 ms < 1 per 10 ms
    // a measured width is priced at its own EMA, even below a narrower one's
    mm_spec_cost_add(&c, 0, 2, 5.0);
    MM_NEAR(mm_spec_price(&c, 0, 2, 4), 5.0, 1e-9);
    MM_EQ(mm_spec_width(&c, 0, 4, 1.0), 2);
    // another range with nothing measured borrows the nearest measured one: the same rows first
    int b5 = mm_spec_bucket(64 << 5, 1);
    MM_NEAR(mm_spec_price(&c, b5, 4, 4), 30.0, 1e-9);
    int b16 = mm_spec_bucket(10, 16);
    mm_spec_cost_add(&c, b16, 0, 40.0);
    // width 4, unmeasured at 16 rows, is priced relative to width 0 as in the range that
    // measured both (bucket 0: 30 / 10), never below the nearest measured width (40)
    MM_NEAR(mm_spec_price(&c, b16, 4, 4), 40.0 * 30.0 / 10.0, 1e-9);
    MM_NEAR(mm_spec_price(&c, b16, 2, 4), 40.0, 1e-9); // bucket 0's width 2 is cheaper than 0
    MM_NEAR(mm_spec_price_low(&c, b16, 4, 4), 0.8 * 120.0, 1e-9);
    MM_NEAR(mm_spec_price(&c, mm_spec_bucket(200, 16), 0, 4), 40.0, 1e-9);
    MM_NEAR(mm_spec_price(&c, mm_spec_bucket(200, 1), 0, 4), 10.0, 1e-9);
    // the EMA follows new measurements; one outlier counts as 3x the estimate at most
    for (int i = 0; i < 60; i++)
        mm_spec_cost_add(&c, 0, 4, 12.0);
    MM_NEAR(c.T[0][4], 12.0, 1e-3);
    mm_spec_cost_add(&c, 0, 4, 1200.0);
    MM_NEAR(c.T[0][4], 12.0 * 0.75 + 36.0 * 0.25, 1e-3);
    // ranges: context (log2 of 64 tokens) x input rows (log2)
    MM_EQ(mm_spec_bucket(10, 1), 0);
    MM_EQ(mm_spec_bucket(300, 1), 2 * MM_SPEC_ROW_BUCKETS);
    MM_EQ(mm_spec_bucket(10, 16), 4);
    MM_EQ(mm_spec_bucket(1 << 30, 1 << 30), MM_SPEC_BUCKETS - 1);
    // exploration: unmeasured 0 first, then the neighbours, then stale ones
    mm_spec_costs e;
    memset(&e, 0, sizeof(e));
    mm_spec_cost_add(&e, 3, 4, 20.0);
    MM_EQ(mm_spec_explore(&e, 3, 4, 4, 64, NULL), 0);
    mm_spec_cost_add(&e, 3, 0, 10.0);
    MM_EQ(mm_spec_explore(&e, 3, 4, 4, 64, NULL), 3);
    mm_spec_cost_add(&e, 3, 3, 15.0);
    MM_EQ(mm_spec_explore(&e, 3, 4, 4, 64, NULL), -1); // all fresh (5 unavailable: max 4)
    for (int i = 0; i < 65; i++)
        mm_spec_cost_add(&e, 3, 4, 20.0);
    MM_EQ(mm_spec_explore(&e, 3, 4, 4, 64, NULL), 0); // 0 is stale
    mm_spec_cost_add(&e, 3, 0, 10.0);
    MM_EQ(mm_spec_explore(&e, 3, 4, 4, 64, NULL), 3);
    MM_EQ(mm_spec_explore(&e, 3, 0, 4, 64, NULL), 1); // choice 0: 1 never measured
    MM_EQ(mm_spec_explore(&e, 3, 4, 0, 64, NULL), -1); // nothing may draft
    // a width far from the choice, priced long ago, is re-measured (after 2 x stale): the
    // choice stays 4, its neighbours 0 and 3 are kept fresh, 1 was priced once at the start
    mm_spec_costs f;
    memset(&f, 0, sizeof(f));
    mm_spec_cost_add(&f, 0, 1, 30.0);
    for (int i = 0; i < 200; i++) {
        mm_spec_cost_add(&f, 0, 4, 20.0);
        if (i % 8 == 0) {
            mm_spec_cost_add(&f, 0, 0, 10.0);
            mm_spec_cost_add(&f, 0, 3, 15.0);
        }
        if (i == 79) // 1 is 100 samples old: stale, but not 2 x stale
            MM_EQ(mm_spec_explore(&f, 0, 4, 4, 64, NULL), -1);
    }
    MM_EQ(mm_spec_explore(&f, 0, 4, 4, 64, NULL), 1); // 250 samples old
    // hold: the last choice stays unless the best beats it by the margin
    mm_spec_costs h;
    memset(&h, 0, sizeof(h));
    mm_spec_cost_add(&h, 0, 0, 10.0);
    mm_spec_cost_add(&h, 0, 1, 19.0);
    double e1[MM_SPEC_MAX_W + 1] = {0};
    mm_spec_expect_add(e1, 1, 1, 1.0); // e = 1, 2: width 1 scores 2/19 vs 1/10 (5% better)
    MM_EQ(mm_spec_width_sum(&h, 0, 1, e1), 1);
    MM_EQ(mm_spec_width_hold(&h, 0, 1, e1, 0, 0.10), 0);  // within 10%: keep 0
    MM_EQ(mm_spec_width_hold(&h, 0, 1, e1, 0, 0.01), 1);  // beyond 1%: change
    MM_EQ(mm_spec_width_hold(&h, 0, 1, e1, -1, 0.10), 1); // no last choice
    MM_EQ(mm_spec_width_hold(&h, 0, 1, e1, 3, 0.10), 1);  // last choice out of range
    // the first samples are averaged, then the EMA
    mm_spec_costs m;
    memset(&m, 0, sizeof(m));
    mm_spec_cost_add(&m, 0, 2, 10.0);
    mm_spec_cost_add(&m, 0, 2, 20.0);
    MM_NEAR(m.T[0][2], 15.0, 1e-9);
    mm_spec_cost_add(&m, 0, 2, 30.0);
    MM_NEAR(m.T[0][2], 20.0, 1e-9);
}

// The gates that make a drafter that agrees rarely cost ~nothing (docs/MESH.md, Drafting):
// exploration only of widths that could pay at the measured acceptance, ahead requests only
// when their proposals are likely enough to be usable. Width-0 price 1.7 ms, width-1 2.7 ms.
static void test_spec_gates(void) {
    mm_spec_costs c;
    memset(&c, 0, sizeof(c));
    mm_spec_cost_add(&c, 0, 1, 2.7);
    for (int i = 0; i < 70; i++) // width 1's price is now stale (70 > 64 samples old)
        mm_spec_cost_add(&c, 0, 0, 1.7);
    MM_TRUE(mm_spec_measured(&c, 0, 0, 4) && mm_spec_measured(&c, 0, 1, 4));
    MM_TRUE(!mm_spec_measured(&c, 0, 2, 4));
    MM_TRUE(mm_spec_measured(&c, mm_spec_bucket(300, 1), 1, 4)); // borrowed from bucket 0
    // lowest plausible prices: measured 0.8 x EMA, never below width 0's; unmeasured: the
    // dearest measured narrower width
    MM_NEAR(mm_spec_price_low(&c, 0, 0, 4), 0.8 * 1.7, 1e-9);
    MM_NEAR(mm_spec_price_low(&c, 0, 1, 4), 0.8 * 2.7, 1e-9);
    MM_NEAR(mm_spec_price_low(&c, 0, 3, 4), 2.7, 1e-9);
    double e15[MM_SPEC_MAX_W + 1] = {0}, e95[MM_SPEC_MAX_W + 1] = {0};
    mm_spec_expect_add(e15, 4, 4, 0.15);
    mm_spec_expect_add(e95, 4, 4, 0.95);
    // acceptance 0.15: not drafting is the choice; width 1 (1.15 tokens for 1.59x the price)
    // is not re-measured, and no ahead request is sent (p x = 0.15^2 x 0.15 << 2.7/1.7 - 1)
    MM_EQ(mm_spec_width_sum(&c, 0, 4, e15), 0);
    MM_EQ(mm_spec_explore(&c, 0, 0, 4, 64, e15), -1);
    MM_EQ(mm_spec_explore(&c, 0, 0, 4, 64, NULL), 1); // ungated (acceptance unknown): it would be
    MM_TRUE(!mm_spec_ahead_pays(&c, 0, 1, 4, 0.15, 1));
    MM_TRUE(!mm_spec_ahead_pays(&c, 0, 1, 4, 0.15, 0));
    // acceptance 0.95 (with the last choice 0 still held): width 1 could pay, so its stale price
    // is re-measured, and ahead requests pay (0.9025 x 0.95 > 0.588)
    MM_EQ(mm_spec_explore(&c, 0, 0, 4, 64, e95), 1);
    MM_TRUE(mm_spec_ahead_pays(&c, 0, 1, 4, 0.95, 1));
    MM_EQ(mm_spec_width_sum(&c, 0, 4, e95), 4); // 2..4 unmeasured, priced as width 1
    MM_TRUE(mm_spec_ahead_pays(&c, 0, 4, 4, 0.95, 4)); // 0.774 x 3.52 > 0.588
    // ... but not after 4 drafts at acceptance 0.6 (0.078 x 1.31 < 0.588)
    MM_TRUE(!mm_spec_ahead_pays(&c, 0, 4, 4, 0.6, 4));
    MM_TRUE(!mm_spec_ahead_pays(&c, 0, 0, 4, 0.95, 0)); // width 0: nothing to serve
    MM_TRUE(!mm_spec_ahead_pays(&c, 0, 1, 4, 0.0, 0));
    // much later, width 1 is more than 2 x stale old: still not re-measured at 0.15
    for (int i = 0; i < 100; i++)
        mm_spec_cost_add(&c, 0, 0, 1.7);
    MM_EQ(mm_spec_explore(&c, 0, 0, 4, 64, e15), -1);
    MM_EQ(mm_spec_explore(&c, 0, 0, 4, 64, e95), 1);
    // an acceptance where width 1 might pay if its price fell by 20% (1.3 x 1.7 > 2.16)
    double e30[MM_SPEC_MAX_W + 1] = {0};
    mm_spec_expect_add(e30, 4, 4, 0.30);
    MM_EQ(mm_spec_explore(&c, 0, 0, 4, 64, e30), 1);
    // an unmeasured width 0 is always measured (every other price is judged against it), and
    // an unmeasured width with no measured narrower one has no lower bound: measured too
    mm_spec_costs u;
    memset(&u, 0, sizeof(u));
    mm_spec_cost_add(&u, 0, 4, 20.0);
    double e0[MM_SPEC_MAX_W + 1] = {0};
    mm_spec_expect_add(e0, 4, 4, 0.01);
    MM_EQ(mm_spec_explore(&u, 0, 4, 4, 64, e0), 0);
    mm_spec_cost_add(&u, 0, 0, 10.0);
    MM_EQ(mm_spec_explore(&u, 0, 4, 4, 64, e0), 3); // 3 unmeasured: its floor is T(0) = 10,
                                                    // e[3] x 20 > e[4] x 10
    // nothing measured at all: prices equal, so an ahead request with any chance pays
    mm_spec_costs z;
    memset(&z, 0, sizeof(z));
    MM_TRUE(mm_spec_ahead_pays(&z, 0, 4, 4, 0.05, 4));
}

// ---- the drafting mode chooser (mm_spec_mode_pick / mm_spec_mode_add) ----------------------

// mode_run: n steps of range r with 4 seqs (a window: 8 steps), each picked by the chooser
// and then recorded as emitting tok[mode] tokens per seq in 1 ms; counts the picks per mode
// into picks (may be NULL).
static void mode_run(mm_spec_modes *m, int r, int n, const double tok[2], const bool can[2],
                     int picks[2]) {
    for (int i = 0; i < n; i++) {
        int mode = mm_spec_mode_pick(m, r, can);
        MM_TRUE(mode == MM_SPEC_SYNC || mode == MM_SPEC_AHEAD);
        if (picks)
            picks[mode]++;
        mm_spec_mode_add(m, r, mode, 4 * tok[mode], 4, 1.0, true);
    }
}

static void test_spec_mode(void) {
    const bool both[2] = {true, true};
    const int WIN1 = MM_SPEC_MODE_WARM + MM_SPEC_MODE_WIN; // steps to a mode's first window
    MM_EQ(MM_SPEC_MODE_WIN * 4, MM_SPEC_MODE_SEQS); // (4 seqs per step: 8 steps a window)
    mm_spec_modes m;
    mm_spec_modes_init(&m);
    // Nothing measured: ahead first, one window, then sync one window; ahead (3 tokens/ms)
    // beats sync (2): ahead is the choice, and sync lost once.
    const double ahead_better[2] = {2.0, 3.0};
    int picks[2] = {0, 0};
    mode_run(&m, 0, WIN1, ahead_better, both, picks);
    MM_EQ(picks[MM_SPEC_AHEAD], WIN1);
    MM_EQ(m.choice[0], MM_SPEC_AHEAD);
    MM_EQ(m.n[0][MM_SPEC_AHEAD], 1);
    MM_NEAR(m.rate[0][MM_SPEC_AHEAD], 3.0, 1e-12);
    mode_run(&m, 0, WIN1, ahead_better, both, picks);
    MM_EQ(picks[MM_SPEC_SYNC], WIN1);
    MM_EQ(m.n[0][MM_SPEC_SYNC], 1);
    MM_NEAR(m.rate[0][MM_SPEC_SYNC], 2.0, 1e-12);
    MM_EQ(m.choice[0], MM_SPEC_AHEAD);
    MM_EQ(m.lost[0], 1);
    MM_EQ(m.switches, 0);
    // Then the choice; sync is measured again (one window) after EVERY << lost steps, and
    // loses again: the interval doubles up to 8x. Exploration is bounded: over 2000 steps,
    // sync runs one window per interval only.
    picks[0] = picks[1] = 0;
    mode_run(&m, 0, (MM_SPEC_MODE_EVERY << 1), ahead_better, both, picks);
    MM_EQ(picks[MM_SPEC_SYNC], 0);
    picks[0] = picks[1] = 0;
    mode_run(&m, 0, 2000, ahead_better, both, picks);
    // windows at steps 0, 266, 788, 1310, 1832 (intervals 256, 512, 512, 512): 2.5% of steps
    MM_EQ(picks[MM_SPEC_SYNC], 5 * WIN1);
    MM_EQ(m.lost[0], 3);
    MM_EQ(m.choice[0], MM_SPEC_AHEAD);

    // Another range, sync better (c=16 with a partly agreeing drafter): the choice becomes
    // sync after the two first windows and stays; range 0's choice is untouched.
    const double sync_better[2] = {1.2, 1.0};
    picks[0] = picks[1] = 0;
    mode_run(&m, 4, 1000, sync_better, both, picks);
    MM_EQ(m.choice[4], MM_SPEC_SYNC);
    MM_EQ(m.choice[0], MM_SPEC_AHEAD);
    MM_EQ(m.switches, 1);
    MM_TRUE(picks[MM_SPEC_SYNC] > 900);
    // The acceptance changes (ahead now better in range 4): the next measurement of ahead
    // takes the choice back, within the longest interval.
    const double now_ahead[2] = {1.0, 1.5};
    mode_run(&m, 4, (MM_SPEC_MODE_EVERY << 3) + 2 * WIN1, now_ahead, both, NULL);
    MM_EQ(m.choice[4], MM_SPEC_AHEAD);
    MM_EQ(m.switches, 2);

    // Within the hold margin the choice does not change (noise must not flip it).
    mm_spec_modes_init(&m);
    const double near[2] = {1.02, 1.0};
    mode_run(&m, 1, 2000, near, both, NULL);
    MM_EQ(m.choice[1], MM_SPEC_AHEAD);
    MM_EQ(m.switches, 0);

    // A mode that cannot pay is never measured: sync's widths would not draft.
    mm_spec_modes_init(&m);
    const bool ahead_only[2] = {false, true};
    picks[0] = picks[1] = 0;
    mode_run(&m, 2, 2000, sync_better, ahead_only, picks);
    MM_EQ(picks[MM_SPEC_SYNC], 0);
    MM_EQ(m.explorations, 1); // ahead's first window
    // Neither can pay: ahead (its probes are never waited for), nothing explored.
    const bool neither[2] = {false, false};
    mm_spec_modes_init(&m);
    picks[0] = picks[1] = 0;
    mode_run(&m, 3, 500, sync_better, neither, picks);
    MM_EQ(picks[MM_SPEC_AHEAD], 500);
    MM_EQ(m.explorations, 0);
    MM_EQ(m.n[3][MM_SPEC_SYNC], 0); // (ahead, running, is measured)

    // The warm-up steps after a change of mode and invalid steps are not counted: their
    // periods (100 ms) do not enter the rate.
    mm_spec_modes_init(&m);
    for (int i = 0; i < MM_SPEC_MODE_WARM; i++)
        mm_spec_mode_add(&m, 5, MM_SPEC_SYNC, 32.0, 32, 100.0, true);
    for (int i = 0; i < MM_SPEC_MODE_WIN; i++) {
        mm_spec_mode_add(&m, 5, MM_SPEC_SYNC, 0.0, 32, 100.0, false); // an idle gap
        mm_spec_mode_add(&m, 5, MM_SPEC_SYNC, 64.0, 32, 1.0, true);   // 2 tokens per seq
    }
    MM_EQ(m.n[5][MM_SPEC_SYNC], 1);
    MM_NEAR(m.rate[5][MM_SPEC_SYNC], 2.0, 1e-12);
    // A change of mode starts a new window: a partial window of ahead, then sync again: the
    // ahead steps count nowhere, and sync's window starts after its warm-up again.
    for (int i = 0; i < MM_SPEC_MODE_WARM + 3; i++)
        mm_spec_mode_add(&m, 5, MM_SPEC_AHEAD, 288.0, 32, 1.0, true);
    for (int i = 0; i < MM_SPEC_MODE_WARM; i++)
        mm_spec_mode_add(&m, 5, MM_SPEC_SYNC, 288.0, 32, 1.0, true);
    MM_EQ(m.n[5][MM_SPEC_AHEAD], 0);
    MM_EQ(m.win_steps[5], 0);
    // One seq per step (c=1): a window needs MM_SPEC_MODE_SEQS counted steps, not 8 (a seq
    // step's tokens vary too much for 8 to tell the modes apart).
    for (int i = 0; i < MM_SPEC_MODE_WARM + MM_SPEC_MODE_SEQS - 1; i++)
        mm_spec_mode_add(&m, 0, MM_SPEC_AHEAD, (double)(1 + i % 5), 1, 1.0, true);
    MM_EQ(m.n[0][MM_SPEC_AHEAD], 0);
    mm_spec_mode_add(&m, 0, MM_SPEC_AHEAD, 3.0, 1, 1.0, true);
    MM_EQ(m.n[0][MM_SPEC_AHEAD], 1);

    // A measurement that never completes (every step invalid) is abandoned after a bounded
    // number of steps, and the other mode is tried.
    mm_spec_modes_init(&m);
    int n_ahead = 0;
    for (int i = 0; i < 500 && m.n[6][MM_SPEC_SYNC] == 0; i++) {
        int mode = mm_spec_mode_pick(&m, 6, both);
        n_ahead += mode == MM_SPEC_AHEAD;
        mm_spec_mode_add(&m, 6, mode, 4.0, 4, 1.0, mode == MM_SPEC_SYNC);
    }
    MM_EQ(n_ahead, MM_SPEC_MODE_WARM + 4 * MM_SPEC_MODE_SEQS);
    MM_EQ(m.n[6][MM_SPEC_SYNC], 1);
    MM_EQ(m.choice[6], MM_SPEC_SYNC);
    // Out-of-range arguments: no crash, nothing recorded.
    mm_spec_mode_add(&m, -1, MM_SPEC_SYNC, 1.0, 1, 1.0, true);
    mm_spec_mode_add(&m, MM_SPEC_ROW_BUCKETS, MM_SPEC_SYNC, 1.0, 1, 1.0, true);
    mm_spec_mode_add(&m, 0, 7, 1.0, 1, 1.0, true);
    MM_EQ(mm_spec_mode_pick(&m, 99, both), MM_SPEC_AHEAD);
    // ranges: log2 of the seqs rounded to the nearest (15 and 16 seqs: one range)
    const int64_t seqs[] = {0, 1, 2, 3, 5, 6, 11, 12, 15, 16, 22, 23, 45, 46, 90, 91, 100000};
    const int want[] = {0, 0, 1, 2, 2, 3, 3, 4, 4, 4, 4, 5, 5, 6, 6, 7, 7};
    for (size_t i = 0; i < sizeof(seqs) / sizeof(seqs[0]); i++)
        MM_EQ(mm_spec_mode_range(seqs[i]), want[i]);
}

// A long-running router: the mode chooser's state stays bounded and sane. A range that ran one
// mode for 2^31 steps in a row (run at INT_MAX) still measures windows (run must not overflow
// into "warm-up" for ever), and a non-finite sample (tokens or period) is skipped instead of
// poisoning the range's rate.
static void test_spec_mode_long_run(void) {
    mm_spec_modes m;
    mm_spec_modes_init(&m);
    const int r = 3;
    for (int i = 0; i < MM_SPEC_MODE_WARM + MM_SPEC_MODE_WIN; i++) // one window of sync
        mm_spec_mode_add(&m, r, MM_SPEC_SYNC, 8.0, 4, 1.0, true);
    MM_EQ(m.n[r][MM_SPEC_SYNC], 1);
    MM_TRUE(m.run[r] > MM_SPEC_MODE_WARM && m.run[r] <= MM_SPEC_MODE_WARM + MM_SPEC_MODE_WIN);
    m.run[r] = INT_MAX; // as after 2^31 - 1 steps of sync in a row
    const uint64_t w0 = m.windows;
    for (int i = 0; i < 4 * MM_SPEC_MODE_WIN; i++) {
        mm_spec_mode_add(&m, r, MM_SPEC_SYNC, 8.0, 4, 1.0, true);
        MM_TRUE(m.run[r] > MM_SPEC_MODE_WARM); // never back in (or below) the warm-up
    }
    MM_EQ(m.windows, w0 + 4);
    MM_EQ(m.n[r][MM_SPEC_SYNC], 5);
    MM_NEAR(m.rate[r][MM_SPEC_SYNC], 2.0, 1e-12);
    // non-finite samples are not counted: the rate stays finite and the window unchanged
    const int steps = m.win_steps[r];
    mm_spec_mode_add(&m, r, MM_SPEC_SYNC, INFINITY, 4, 1.0, true);
    mm_spec_mode_add(&m, r, MM_SPEC_SYNC, 8.0, 4, INFINITY, true);
    mm_spec_mode_add(&m, r, MM_SPEC_SYNC, NAN, 4, 1.0, true);
    MM_EQ(m.win_steps[r], steps);
    for (int i = 0; i < MM_SPEC_MODE_WIN; i++)
        mm_spec_mode_add(&m, r, MM_SPEC_SYNC, 8.0, 4, 1.0, true);
    MM_EQ(m.n[r][MM_SPEC_SYNC], 6);
    MM_TRUE(isfinite(m.rate[r][MM_SPEC_SYNC]));
    MM_NEAR(m.rate[r][MM_SPEC_SYNC], 2.0, 1e-12);
}

MM_TESTS = {
    {"spec mode: draft-ahead or waited drafts by measured tokens per ms", test_spec_mode},
    {"spec mode: bounded state on a long run, non-finite samples skipped",
     test_spec_mode_long_run},
    {"spec width from measured costs and acceptance", test_spec_width},
    {"spec gates: exploration and ahead requests only where they could pay", test_spec_gates},
    {"spec verify greedy: longest agreeing prefix, plain decoding's bits", test_spec_greedy},
    {"spec verify seeded: same seed same tokens, plain decoding's", test_spec_seeded_same_tokens},
    {"spec verify sampled: output distribution is the target's (chi-square)",
     test_spec_distribution},
    {NULL, NULL},
};
