// SPDX-License-Identifier: MIT
// Unit tests of the sampler's presence/frequency/repetition penalties (vLLM's semantics) on
// hand-computed logits, and of the router's per-sequence counts (services/router/penalty.c).
#include <math.h>
#include <string.h>

#include "../../services/router/penalty.c"
#include "mm/sampler.h"
#include "mm_test.h"

// Row of 6 logits; history: token 0 twice in the output, token 1 in the prompt only, token 2
// once in the output and once in the prompt, token 4 (negative logit) once in the output.
static const float X[6] = {3.0f, 2.9f, 2.5f, 1.0f, -0.5f, 0.0f};
static const mm_tok_count H[4] = {
    {.token = 0, .prompt = 0, .output = 2},
    {.token = 1, .prompt = 1, .output = 0},
    {.token = 2, .prompt = 1, .output = 1},
    {.token = 4, .prompt = 0, .output = 1},
};
static const mm_penalty_hist HIST = {.tok = H, .n = 4};

// The top logprobs ask for every token: they are the raw row's, while the choice is the
// penalised row's argmax; out->top_ids lists tokens by raw logit.
static int32_t pick(mm_sampler *s, mm_sampling sp, mm_sample *o) {
    sp.hist = &HIST;
    MM_PASS(mm_sampler_pick(s, X, &sp, 7, 6, o, NULL));
    return o->token;
}

static void test_penalty_math(void) {
    mm_sampler *s = NULL;
    MM_PASS(mm_sampler_new(&s, 6));
    mm_sample o, raw;
    MM_PASS(mm_sampler_pick(s, X, NULL, 7, 6, &raw, NULL));
    MM_EQ(raw.token, 0);
    // frequency 0.2: 0 -> 3.0 - 0.4 = 2.6; 1 stays 2.9 (prompt only); 2 -> 2.3: token 1 wins.
    MM_EQ(pick(s, (mm_sampling){.frequency_penalty = 0.2f}, &o), 1);
    // frequency 0.04: 0 -> 2.92 still above 2.9.
    MM_EQ(pick(s, (mm_sampling){.frequency_penalty = 0.04f}, &o), 0);
    // presence 0.05: 0 -> 2.95 (counted once, not twice): still 0; with 0.11: 2.89 < 2.9.
    MM_EQ(pick(s, (mm_sampling){.presence_penalty = 0.05f}, &o), 0);
    MM_EQ(pick(s, (mm_sampling){.presence_penalty = 0.11f}, &o), 1);
    // repetition 2 over prompt and output: 0 -> 1.5, 1 -> 1.45, 2 -> 1.25, 4 -> -1.0; 3 (1.0)
    // and 5 (0.0) unseen: token 0 still wins; with 3.5: 0 -> 0.857, 1 -> 0.829, 2 -> 0.714, so
    // the unseen token 3 (1.0) wins.
    MM_EQ(pick(s, (mm_sampling){.repetition_penalty = 2.0f}, &o), 0);
    MM_EQ(pick(s, (mm_sampling){.repetition_penalty = 3.5f}, &o), 3);
    // rep 4: 0 -> 0.75, 1 -> 0.725, 2 -> 0.625, unseen 3 stays 1.0 and wins; a negative
    // presence (a reward) of -1.5 lifts the output tokens 0, 2, 4: 0 -> 2.25 wins.
    MM_EQ(pick(s, (mm_sampling){.repetition_penalty = 4.0f}, &o), 3);
    MM_EQ(pick(s, (mm_sampling){.repetition_penalty = 4.0f, .presence_penalty = -1.5f}, &o), 0);
    // rep 1.25 then freq 0.3: 0 -> 2.4 - 0.6 = 1.8, 1 -> 2.32, 2 -> 2.0 - 0.3 = 1.7: 1 wins.
    MM_EQ(pick(s, (mm_sampling){.repetition_penalty = 1.25f, .frequency_penalty = 0.3f}, &o), 1);
    // order (repetition first, then frequency/presence), on a row {-0.5, 0.0, -3.0} with
    // token 0 once in the output: rep 2, freq -0.99 (a reward): -0.5 * 2 + 0.99 = -0.01 < 0.0,
    // so token 1 wins; subtracting first would give (-0.5 + 0.99) / 2 = 0.245 and token 0.
    {
        const float y[3] = {-0.5f, 0.0f, -3.0f};
        const mm_tok_count h2[1] = {{.token = 0, .prompt = 0, .output = 1}};
        const mm_penalty_hist hh = {.tok = h2, .n = 1};
        mm_sampler *s3 = NULL;
        MM_PASS(mm_sampler_new(&s3, 3));
        mm_sampling sp = {.repetition_penalty = 2.0f, .frequency_penalty = -1.0f, .hist = &hh};
        MM_PASS(mm_sampler_pick(s3, y, &sp, 0, 0, &o, NULL));
        MM_EQ(o.token, 0); // -0.5 * 2 + 1 = 0.0 ties token 1's 0.0: the lower id
        sp.frequency_penalty = -0.99f;
        MM_PASS(mm_sampler_pick(s3, y, &sp, 0, 0, &o, NULL));
        MM_EQ(o.token, 1);
        mm_sampler_free(s3);
    }
    // logprobs stay the raw row's whatever the penalties (vLLM's raw_logprobs default)
    MM_EQ(pick(s, (mm_sampling){.frequency_penalty = 1.0f}, &o), 1);
    MM_TRUE(o.logprob == raw.top_logprobs[1]);
    MM_EQ(o.top_ids[0], 0);
    for (int k = 0; k < 6; k++)
        MM_TRUE(o.top_logprobs[k] == raw.top_logprobs[k]);
    // neutral values or no history: the plain pick, bit for bit
    MM_EQ(pick(s, (mm_sampling){.repetition_penalty = 1.0f}, &o), 0);
    mm_sampling nh = {.frequency_penalty = 2.0f};
    MM_PASS(mm_sampler_pick(s, X, &nh, 7, 0, &o, NULL));
    MM_EQ(o.token, 0);
    // seeded sampling draws from the penalised row: token 0 has p ~ 0.37 raw (T = 1) and
    // ~ 0.002 at 3.0 - 2 * 2 - 2 = -3.0; over 200 positions: ~74 draws vs ~0.4.
    mm_sampling sd = {.temperature = 1.0f, .seed = 11};
    int raw0 = 0, pen0 = 0;
    for (int64_t pos = 0; pos < 200; pos++) {
        sd.presence_penalty = sd.frequency_penalty = 0.0f;
        sd.hist = NULL;
        MM_PASS(mm_sampler_pick(s, X, &sd, pos, 0, &o, NULL));
        raw0 += o.token == 0;
        sd.presence_penalty = sd.frequency_penalty = 2.0f;
        sd.hist = &HIST;
        MM_PASS(mm_sampler_pick(s, X, &sd, pos, 0, &o, NULL));
        pen0 += o.token == 0;
    }
    MM_TRUE(raw0 > 40);
    MM_TRUE(pen0 < 6);
    // bad values are refused
    mm_sampling bad = {.repetition_penalty = -1.0f, .hist = &HIST};
    MM_FAIL(mm_sampler_pick(s, X, &bad, 0, 0, &o, NULL), MM_EINVAL);
    bad = (mm_sampling){.presence_penalty = NAN, .hist = &HIST};
    MM_FAIL(mm_sampler_pick(s, X, &bad, 0, 0, &o, NULL), MM_EINVAL);
    const mm_tok_count hb[1] = {{.token = 6, .output = 1}};
    const mm_penalty_hist hbad = {.tok = hb, .n = 1};
    bad = (mm_sampling){.presence_penalty = 1.0f, .hist = &hbad};
    MM_FAIL(mm_sampler_pick(s, X, &bad, 0, 0, &o, NULL), MM_EINVAL);
    mm_sampler_free(s);
}

static const mm_tok_count *find_tok(const mm_penalty_hist *h, int32_t t) {
    for (uint32_t i = 0; i < h->n; i++)
        if (h->tok[i].token == t)
            return &h->tok[i];
    return NULL;
}

static void test_penalty_counts(void) {
    mm_pen_table *t = NULL;
    char err[MM_ERRLEN];
    MM_PASS(mm_pen_table_new(&t, 2, 16));
    mm_pen_slot *a = NULL, *b = NULL, *c = NULL;
    MM_PASS(mm_pen_table_get(t, 100, &a, err));
    // prompt in two chunks, then sampled tokens fed back (not counted twice)
    const int32_t p1[3] = {5, 7, 5}, p2[2] = {9, 5};
    MM_PASS(mm_pen_slot_feed(a, 0, p1, 3, err));
    MM_PASS(mm_pen_slot_feed(a, 3, p2, 2, err));
    MM_PASS(mm_pen_slot_sampled(a, 5, 7, err));
    const int32_t d1[1] = {7};
    MM_PASS(mm_pen_slot_feed(a, 5, d1, 1, err));
    MM_PASS(mm_pen_slot_sampled(a, 6, 7, err));
    MM_PASS(mm_pen_slot_feed(a, 6, d1, 1, err));
    MM_PASS(mm_pen_slot_sampled(a, 7, 5, err));
    const mm_penalty_hist *h = mm_pen_slot_hist(a);
    MM_EQ(h->n, 3u);
    MM_EQ(find_tok(h, 5)->prompt, 3u);
    MM_EQ(find_tok(h, 5)->output, 1u);
    MM_EQ(find_tok(h, 7)->prompt, 1u);
    MM_EQ(find_tok(h, 7)->output, 2u);
    MM_EQ(find_tok(h, 9)->prompt, 1u);
    MM_EQ(find_tok(h, 9)->output, 0u);
    // a gap and a wrong sample position are refused
    MM_FAIL(mm_pen_slot_feed(a, 12, d1, 1, err), MM_EINVAL);
    MM_FAIL(mm_pen_slot_sampled(a, 3, 1, err), MM_EINVAL);
    // the same seq finds its slot; a third seq finds none; release frees and clears
    MM_PASS(mm_pen_table_get(t, 100, &c, err));
    MM_TRUE(c == a);
    MM_PASS(mm_pen_table_get(t, 200, &b, err));
    MM_TRUE(b != a);
    MM_FAIL(mm_pen_table_get(t, 300, &c, err), MM_EFULL);
    mm_pen_table_release(t, 100);
    MM_PASS(mm_pen_table_get(t, 300, &c, err));
    MM_EQ(mm_pen_slot_hist(c)->n, 0u);
    MM_PASS(mm_pen_slot_feed(c, 0, p2, 2, err));
    MM_EQ(mm_pen_slot_hist(c)->n, 2u);
    MM_TRUE(find_tok(mm_pen_slot_hist(c), 7) == NULL);
    // past max_ctx distinct tokens: refused, never overflowing
    int32_t many[17];
    for (int i = 0; i < 17; i++)
        many[i] = 1000 + i;
    MM_PASS(mm_pen_slot_feed(b, 0, many, 16, err));
    MM_FAIL(mm_pen_slot_feed(b, 16, many + 16, 1, err), MM_EFULL);
    mm_pen_table_free(t);
}

MM_TESTS = {
    {"sampler penalties: hand-computed repetition, frequency, presence; raw logprobs",
     test_penalty_math},
    {"sampler penalties: router per-seq counts (prompt vs output, release, full)",
     test_penalty_counts},
    {NULL, NULL},
};
