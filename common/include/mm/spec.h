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

#include <stdbool.h>
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

// ---- draft width from measured costs --------------------------------------------------------
// The step time of each width (the widest draft asked for in a step), kept per range of the
// step's shape: the context length (log2 buckets of 64 tokens) and the step's input rows (log2
// buckets: 1, 2-3, 4-7, ...; a step of 16 decode seqs costs another time than a step of 1), as
// an EMA; the width maximising expected tokens per second. The caller measures "step time" as
// it likes; the router uses the whole period from one step's start to the next step's start
// (its own forward pass, the drafter's round trip, the gateway's work on the result), so that
// every cost drafting adds is charged to the width that added it.

#define MM_SPEC_MAX_W 8
#define MM_SPEC_CTX_BUCKETS 8
#define MM_SPEC_ROW_BUCKETS 8
#define MM_SPEC_BUCKETS (MM_SPEC_CTX_BUCKETS * MM_SPEC_ROW_BUCKETS)

typedef struct mm_spec_costs {
    double T[MM_SPEC_BUCKETS][MM_SPEC_MAX_W + 1];   // ms (EMA)
    uint32_t n[MM_SPEC_BUCKETS][MM_SPEC_MAX_W + 1]; // samples taken (0: unmeasured)
    uint64_t at[MM_SPEC_BUCKETS][MM_SPEC_MAX_W + 1]; // ticks[bucket] at the last sample
    uint64_t ticks[MM_SPEC_BUCKETS];                // samples taken in the bucket
} mm_spec_costs;

// mm_spec_bucket: the range of a step whose longest seq has ctx tokens and that has rows input
// rows (drafts not counted). Buckets are ctx_range * MM_SPEC_ROW_BUCKETS + rows_range.
int mm_spec_bucket(int32_t ctx, int64_t rows);
// mm_spec_cost_add records a step of width w (0..MM_SPEC_MAX_W) that took ms. The price is the
// mean of the first 4 samples, then an EMA weighing a new sample 1/4; a sample over 3x the
// current estimate counts as 3x (one preempted step on a shared machine must not set the
// price).
void mm_spec_cost_add(mm_spec_costs *c, int bucket, int w, double ms);
// mm_spec_price: the step time of width w in bucket (or, when nothing is measured there, in
// the nearest bucket with measurements: same row range first). Measured: its EMA. Unmeasured:
// the nearest measured width's (the wider on a tie), and never below a measured narrower
// width's. Nothing measured at all: 1 for every width.
double mm_spec_price(const mm_spec_costs *c, int bucket, int w, int max_w);
// mm_spec_width: the w in [0, max_w] maximising (sum_{i<=w} acc^i) / price(w); 0 when no
// width beats not drafting.
int mm_spec_width(const mm_spec_costs *c, int bucket, int max_w, double acc);
// For a step's shared width: mm_spec_expect_add adds to e[w] (w = 0..max_w) the expected tokens
// of a seq with per-token acceptance acc drafting min(w, cap); mm_spec_width_sum picks the w
// maximising e[w] / price(w). (The step's time depends on its widest draft, so the seqs share
// one width, each weighted by its own acceptance.)
void mm_spec_expect_add(double *e, int max_w, int cap, double acc);
int mm_spec_width_sum(const mm_spec_costs *c, int bucket, int max_w, const double *e);
// mm_spec_width_hold: mm_spec_width_sum's choice, unless prev (the last choice; -1: none) is
// within margin of it (score(best) <= score(prev) * (1 + margin)): then prev. Changing width
// has costs no price shows (the drafter catching up on the tokens of the steps it was not
// asked; samples of a width only count after a step of the same width), and prices measured
// on a shared machine are noisy: a near tie must not flip the width step after step.
int mm_spec_width_hold(const mm_spec_costs *c, int bucket, int max_w, const double *e, int prev,
                       double margin);
// mm_spec_explore: a width to measure this step instead of the chosen w, or -1. Prices of
// unmeasured wider widths are optimistic (those of narrower ones), so the choice itself tries
// them; narrower widths, not drafting (0) above all, are never tried that way. Candidates: 0,
// w - 1 and w + 1 (<= max_w), in that order; the first that is unmeasured in bucket, else the
// first whose last sample is more than stale samples of the bucket old; else the width
// (any other measured one) with the oldest price, when older than 2 x stale.
// e (NULL: no gate, e.g. while the acceptance is unknown): the step's expected tokens per width
// (mm_spec_expect_add); a candidate x is then tried only when its optimistic score could beat
// the choice's, e[x] / mm_spec_price_low(x) > e[w] / mm_spec_price(w), except an unmeasured 0
// (the price every other is judged against): a width that cannot pay at the measured
// acceptance is not measured, so a drafter that agrees rarely costs no exploration steps.
int mm_spec_explore(const mm_spec_costs *c, int bucket, int w, int max_w, uint64_t stale,
                    const double *e);
// mm_spec_measured: whether mm_spec_price(c, bucket, w, max_w) comes from samples of w itself
// (in bucket, or the nearest bucket with measurements that mm_spec_price borrows from).
bool mm_spec_measured(const mm_spec_costs *c, int bucket, int w, int max_w);
// MM_SPEC_PRICE_SLACK: how much lower than its EMA a measured width's price may plausibly be
// (the machine's load drifts between samples; 20%). Exploration gate only.
#define MM_SPEC_PRICE_SLACK 0.20
// mm_spec_price_low: the lowest plausible step time of w in bucket (own bucket only). Measured:
// (1 - MM_SPEC_PRICE_SLACK) x its EMA, never below the measured width-0 price (a step that
// drafts does all a step without drafts does). Unmeasured: the highest price of a measured
// narrower width (the rule: never below a measured narrower width), 0 when there is
// none (nothing bounds it: worth measuring).
double mm_spec_price_low(const mm_spec_costs *c, int bucket, int w, int max_w);
// mm_spec_ahead_pays: does an ahead request (draft-ahead: sent during a step, for the next
// one) pay for a seq of per-token acceptance acc that drafts nd tokens this step, when its
// proposals would serve width w (>= 1) next step? They are usable only if all nd drafts are
// accepted and the drafter's guess of the target's next token is right: p = acc^(nd + 1);
// then they add x = sum_{i=1..w} acc^i expected tokens to the seq's 1. The drafter's work is
// spent either way and, on a device shared with the target, slows the target's steps. It pays
// when the next step's expected tokens per ms beat not drafting at the measured prices:
// (1 + p x) / T(w) > 1 / T(0), i.e. p x > T(w) / T(0) - 1 (the seq's part of the step at the
// width's price, each proposal discounted by the chance it is usable). False for w < 1 or
// acc <= 0. Nothing measured: prices equal, so any p x > 0 pays (that is how they get measured).
bool mm_spec_ahead_pays(const mm_spec_costs *c, int bucket, int w, int max_w, double acc,
                        int nd);

// ---- drafting mode from measured throughput -------------------------------------------------
// A step's drafts come one of two ways (services/router/step_draft.h): ahead (asked during the
// step before, not waited for: the drafter works while the mesh runs, but the proposals are
// usable only when all of that step's drafts were accepted and the drafter's guess of the
// target's next token was right) or synchronously (asked before the step and waited for).
// Which gives more tokens per second depends on the acceptance and on the batch (on the H200,
// a self-draft at concurrency 1 ran 2.07x ahead and 1.71x waited; a 62%-accepting drafter at
// concurrency 16 0.97x ahead and 1.08x waited), so the router measures both and uses the
// better (the "auto" mode). Each mode is an arm with its own measured price per seqs range
// (mm_spec_mode_range: c=1 and c=16 are different machines): the emitted tokens per seq per ms
// of its steps (each step's whole period, start to next start, as the width prices count it),
// summed over a window of at least MM_SPEC_MODE_WIN counted steps and MM_SPEC_MODE_SEQS seq
// steps, an EMA over windows. Per seq: a GPU step of 12 seqs costs about what one of 22 does,
// so the rate per seq compares windows of different batch sizes in one range. The
// MM_SPEC_MODE_WARM steps of a range after a change of its mode are not counted (the ahead
// pipeline fills; the gateway still writes the tokens of steps of the other mode). The mode
// not chosen is measured again, one window, every MM_SPEC_MODE_EVERY steps of the range
// (doubling, up to 8x, each time it loses again), and only when it could pay (the caller's
// can[]: e.g. its width prices choose a width above 0). Drafting off is not a third arm: each
// mode's width choice falls back to width 0 where no width pays.
#define MM_SPEC_SYNC 0  // drafts asked before the step, waited for
#define MM_SPEC_AHEAD 1 // drafts asked during the step before (draft-ahead)
#define MM_SPEC_MODE_WARM 2
#define MM_SPEC_MODE_WIN 8   // a window: at least 8 counted steps
#define MM_SPEC_MODE_SEQS 32 // and at least 32 seq steps (c=1: 32 steps; the tokens of one seq
                             // step vary a lot, e.g. 1 to 5 at width 4)
#define MM_SPEC_MODE_EVERY 64
#define MM_SPEC_MODE_HOLD 0.03 // the choice changes only for a 3% better measured rate

typedef struct mm_spec_modes {
    // per range (mm_spec_mode_range, MM_SPEC_ROW_BUCKETS of them) and mode:
    double rate[MM_SPEC_ROW_BUCKETS][2]; // tokens per seq per ms (EMA over windows)
    uint32_t n[MM_SPEC_ROW_BUCKETS][2];  // windows measured
    int choice[MM_SPEC_ROW_BUCKETS];     // the better measured mode, -1: none measured
    int explore[MM_SPEC_ROW_BUCKETS];    // the mode being measured instead, -1: none
    uint32_t explore_steps[MM_SPEC_ROW_BUCKETS]; // steps it has run (abandoned past 4 windows)
    uint32_t since[MM_SPEC_ROW_BUCKETS]; // steps of the choice since the other was measured
    uint32_t lost[MM_SPEC_ROW_BUCKETS];  // measurements in a row where the other lost (0..3)
    // per range: its last step's mode (-1: none) and the steps in a row in it; the window being
    // summed (counted steps of win_mode in a row)
    int last_mode[MM_SPEC_ROW_BUCKETS], run[MM_SPEC_ROW_BUCKETS]; // run: up to WARM + 1
    int win_mode[MM_SPEC_ROW_BUCKETS], win_steps[MM_SPEC_ROW_BUCKETS];
    uint32_t win_seqs[MM_SPEC_ROW_BUCKETS]; // seq steps in the window
    double win_tok[MM_SPEC_ROW_BUCKETS], win_ms[MM_SPEC_ROW_BUCKETS];
    uint64_t windows, explorations, switches; // counters (switches: the choice changed)
} mm_spec_modes;

void mm_spec_modes_init(mm_spec_modes *m);
// mm_spec_mode_range: the range of a step with seqs sampling seqs: log2 rounded to the nearest
// (1; 2; 3-5; 6-11; 12-22; 23-45; 46-90; 91+), so that 15 and 16 seqs (a step of a c=16 load
// while one seq is between requests) are one range; the number of decoding seqs, not the rows
// (a prompt joining the step does not move it to another range).
int mm_spec_mode_range(int64_t seqs);
// mm_spec_mode_pick: the mode (MM_SPEC_SYNC or MM_SPEC_AHEAD) for a step of range range;
// can[mode]: whether that mode could pay this step (a mode that cannot is never explored).
// Unmeasured modes that can pay are measured first (ahead before sync); then the choice, with a
// window of the other when due. Deterministic: no clock, no randomness.
int mm_spec_mode_pick(mm_spec_modes *m, int range, const bool can[2]);
// mm_spec_mode_add records a finished step of mode in range: tokens emitted by its seqs sampling
// seqs, its period ms; valid false (an idle gap before the next step, nothing to draft): the
// step is skipped (it still counts as a step of its mode for the warm-up).
void mm_spec_mode_add(mm_spec_modes *m, int range, int mode, double tokens, uint32_t seqs,
                      double ms, bool valid);

#endif
