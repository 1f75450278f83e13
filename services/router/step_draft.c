// SPDX-License-Identifier: MIT
// The router's drafting state; see step_draft.h and docs/MESH.md (Drafting).
#include "step_draft.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mm/log.h"
#include "mm/spec.h"
#include "mm/time.h"

#define PROBE_EVERY 64   // low-acceptance seqs draft again (1 token) every PROBE_EVERY-th step,
                         // doubling (up to 16x) while they stay under 5%
#define CATCHUP_MAX 512  // tokens the drafter catches up on per request (beyond the first seq)
#define MAX_REL 4096     // releases kept for the drafter's next request (older ones dropped)
#define HOLD 0.10        // the width changes only for a 10% better expected tokens/s
#define EXPLORE_EVERY 8  // every EXPLORE_EVERY-th drafting step may measure another width
#define STALE 64         // a width's price older than STALE samples of its range is re-measured

struct rseq {
    uint64_t id;
    bool used, broken; // broken: a gap in its history (no drafting)
    int32_t *hist;     // (max_ctx) committed tokens; owned, allocated once per table slot
    int32_t len;       // committed tokens (= its KV length in the shards after truncation)
    int32_t dr_from;   // tokens the drafter holds of it
    bool trunc;        // the shards hold rejected draft rows past trunc_len
    int32_t trunc_len;
    float acc;         // per-draft-token acceptance (EMA); a draft asked for and not given
                       // counts as rejected
    uint32_t n_steps;
    uint32_t asked;    // drafts asked for this step
    uint64_t last_step; // the step (mm_draft.step_no) it was last in
    uint32_t probes;    // probes while under 5% acceptance (the interval doubles with each)
};

struct mm_draft {
    mm_draft_conf c;
    mm_registry *reg;
    struct rseq *t;
    int n_t;
    mm_ctl_client *cl;
    uint64_t cl_inc;
    uint64_t backoff_until, backoff_ms;
    bool warned;
    // the request (sized at open)
    Mmctl__DraftSeq *dq;
    Mmctl__DraftSeq **dqp;
    int32_t *dq_plan;  // plan index of each request seq
    uint64_t *rel; // (MAX_REL) released seqs the drafter has not been told of yet
    size_t n_rel;
    mm_spec_costs costs; // step time per (step range, widest draft asked for in the step)
    int step_w, step_bucket; // this step's: widest draft asked for; range (mm_spec_bucket)
    uint64_t n_steps; // steps with a seq that allowed drafting (probes: every PROBE_EVERY-th)
    bool step_ok;     // this step's drafter call (if any) answered
    bool step_cost;   // this step's period is a sample of its width's cost
    uint64_t step_no, step_t0; // steps begun; when this one began (ns)
    uint64_t explored;
    int prev_w;              // the widest draft asked for in the step before (-1: no sample)
    int same_w;              // steps before this one in a row with its width (prev_w's run)
    int explore_w, explore_left; // a width being measured, for explore_left more steps
    int choice;              // the last width chosen by price (not exploring), -1: none
    float acc_all; // per-draft-token acceptance over all seqs (slow EMA): a new seq's start
    uint32_t acc_n; // samples in acc_all (its first 50 are averaged: the 0.6 start is a guess)
    uint32_t probes_failed; // probes missed in a row over all seqs (0..4): a new seq's start, so
                            // that short requests of a drafter that never agrees probe rarely
    // metrics
    uint64_t drafted, accepted, emitted, verified, misses, requests;
    uint64_t pos_tried[MM_DRAFT_MAX_K], pos_ok[MM_DRAFT_MAX_K], widths[MM_DRAFT_MAX_K + 1];
};

mm_err mm_draft_open(mm_draft **out, const mm_draft_conf *c, mm_registry *reg,
                     char err[MM_ERRLEN]) {
    *out = NULL;
    if (c->max_k < 0 || c->max_k > MM_DRAFT_MAX_K || c->timeout_ms < 1 || c->max_rows < 0)
        return mm_errf(err, MM_EINVAL, "--draft-max must be 0..%d, --draft-timeout-ms >= 1, "
                       "--draft-max-rows >= 0", MM_DRAFT_MAX_K);
    mm_draft *d = calloc(1, sizeof(*d));
    if (!d)
        return MM_ENOMEM;
    d->c = *c;
    d->reg = reg;
    d->n_t = 256;
    d->t = calloc((size_t)d->n_t, sizeof(*d->t));
    d->dq = calloc((size_t)d->n_t, sizeof(*d->dq));
    d->dqp = calloc((size_t)d->n_t, sizeof(*d->dqp));
    d->dq_plan = calloc((size_t)d->n_t, sizeof(*d->dq_plan));
    d->rel = calloc(MAX_REL, sizeof(*d->rel));
    if (!d->t || !d->dq || !d->dqp || !d->dq_plan || !d->rel) {
        mm_draft_close(d);
        return MM_ENOMEM;
    }
    d->backoff_ms = 250;
    d->acc_all = 0.6f;
    d->prev_w = -1;
    d->choice = -1;
    *out = d;
    return MM_OK;
}

void mm_draft_close(mm_draft *d) {
    if (!d)
        return;
    for (int i = 0; d->t && i < d->n_t; i++)
        free(d->t[i].hist);
    free(d->t);
    free(d->dq);
    free(d->dqp);
    free(d->dq_plan);
    free(d->rel);
    mm_ctl_client_close(d->cl);
    free(d);
}

static struct rseq *find(mm_draft *d, uint64_t id) {
    for (int i = 0; i < d->n_t; i++)
        if (d->t[i].used && d->t[i].id == id)
            return &d->t[i];
    return NULL;
}

static struct rseq *track(mm_draft *d, uint64_t id) {
    for (int i = 0; i < d->n_t; i++) {
        struct rseq *r = &d->t[i];
        if (r->used)
            continue;
        if (!r->hist && !(r->hist = malloc((size_t)d->c.max_ctx * 4)))
            return NULL;
        r->id = id;
        r->used = true;
        r->broken = r->trunc = false;
        r->len = r->dr_from = r->trunc_len = 0;
        r->acc = d->acc_all; // not a fixed guess: a new seq of a drafter that never agrees
        r->n_steps = 0;      // would draft (and lose) until its own EMA fell
        r->asked = 0;
        r->last_step = 0;
        r->probes = d->probes_failed;
        return r;
    }
    return NULL;
}

static void forget(mm_draft *d, uint64_t id) {
    struct rseq *r = find(d, id);
    if (r)
        r->used = false;
}

// drafter_link: the client for the drafter's current incarnation, or NULL (down, backing off).
static mm_ctl_client *drafter_link(mm_draft *d) {
    char url[MM_ADDR_LEN], err[MM_ERRLEN] = "";
    uint64_t inc = 0;
    if (!mm_registry_peer_ctl(d->reg, "drafter", 0, url, &inc) || !url[0])
        return NULL;
    if (!d->cl || inc != d->cl_inc) {
        mm_ctl_client_close(d->cl);
        d->cl = NULL;
        if (mm_ctl_client_open(&d->cl, url, err) != MM_OK) {
            mm_log_warn("drafter at %s: %s", url, err);
            return NULL;
        }
        d->cl_inc = inc;
        d->backoff_until = 0;
        d->backoff_ms = 250;
        d->warned = false;
        for (int i = 0; i < d->n_t; i++)
            d->t[i].dr_from = 0; // a new drafter process holds nothing
        d->n_rel = 0;
        mm_log_info("drafting with the drafter at %s", url);
    }
    if (mm_now_ns() < d->backoff_until)
        return NULL;
    return d->cl;
}

static void drafter_failed(mm_draft *d, const char *why) {
    d->misses++;
    if (!d->warned)
        mm_log_warn("drafter: %s; steps go on without drafts (retry in %llu ms)", why,
                    (unsigned long long)d->backoff_ms);
    else
        mm_log_debug("drafter: %s", why);
    d->warned = true;
    d->backoff_until = mm_now_ns() + d->backoff_ms * 1000000ull;
    d->backoff_ms = d->backoff_ms * 2 > 5000 ? 5000 : d->backoff_ms * 2;
}

void mm_draft_begin(mm_draft *d, const Mmctl__StepPlan *p, const bool *active, int64_t room,
                    uint32_t *n_draft, int32_t *draft) {
    // The previous step's cost: the period from its start to this one's, when this step goes
    // on with a seq of it (the gateway sent this plan as soon as it had that step's result; not
    // after an idle gap). The period holds all the step's costs: the drafter's round trip, the
    // forward pass over the draft rows, verification, the gateway's work on more tokens. Only
    // when the 2 steps before it had the same width: the gateway hands the next plan to the
    // router before it writes the tokens of a result to the clients (and the clients read them
    // on the same cores later still), so a step's period also holds work on the tokens of the
    // steps before it (a width-0 step right after width-4 steps would be charged for 5 tokens
    // per seq; exploration therefore runs 3 steps of its width and the last one is the sample).
    const uint64_t now = mm_now_ns();
    bool goes_on = false;
    for (size_t i = 0; i < p->n_seqs && !goes_on; i++) {
        const struct rseq *r = p->seqs[i]->pos > 0 ? find(d, p->seqs[i]->seq_id) : NULL;
        goes_on = r && r->last_step == d->step_no;
    }
    if (d->step_cost && goes_on && d->c.max_k > 0 && d->step_w == d->prev_w && d->same_w >= 2)
        mm_spec_cost_add(&d->costs, d->step_bucket, d->step_w, (double)(now - d->step_t0) / 1e6);
    int w_now = d->step_cost && goes_on ? d->step_w : -1;
    d->same_w = w_now >= 0 && w_now == d->prev_w ? d->same_w + 1 : 1;
    d->prev_w = w_now;
    d->step_no++;
    d->step_t0 = now;
    d->step_w = 0;
    d->step_bucket = 0;
    d->step_ok = true;
    d->step_cost = false;
    for (size_t i = 0; i < p->n_release; i++) {
        forget(d, p->release[i]);
        // The drafter learns of releases with its next request, which may be many steps away
        // (steps of width 0 ask nothing): kept until then, or its seq table fills with ended
        // seqs and it drafts for no new one. Full (4096 pending): the oldest are dropped.
        if (d->n_rel == MAX_REL) {
            memmove(d->rel, d->rel + 1, (MAX_REL - 1) * sizeof(*d->rel));
            d->n_rel--;
        }
        d->rel[d->n_rel++] = p->release[i];
    }
    int32_t max_ctx_step = 0;
    int64_t rows = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        n_draft[i] = 0;
        if (active[i])
            rows += (int64_t)q->n_tokens;
        struct rseq *r = find(d, q->seq_id);
        if (q->pos == 0) {
            if (r)
                r->used = false;
            r = track(d, q->seq_id);
        }
        if (!r)
            continue;
        r->last_step = d->step_no;
        r->asked = 0;
        if ((int32_t)q->pos != r->len || r->len + (int64_t)q->n_tokens > d->c.max_ctx)
            r->broken = true;
        if (r->broken)
            continue;
        memcpy(r->hist + r->len, q->tokens, q->n_tokens * 4);
        r->len += (int32_t)q->n_tokens;
        if (q->sample && r->len > max_ctx_step)
            max_ctx_step = r->len;
    }
    if (d->c.max_k == 0)
        return;
    const int b = mm_spec_bucket(max_ctx_step, rows);
    d->step_bucket = b;
    if (room > d->c.max_rows)
        room = d->c.max_rows;
    // The step's width W: the seqs' expected tokens (each by its own acceptance) per measured
    // step time; each eligible seq then drafts min(W, its cap), except a seq whose acceptance
    // has fallen below 5% (it drafts 0; every PROBE_EVERY-th step all such seqs probe at once,
    // so that probing costs one drafter call per PROBE_EVERY steps). Every EXPLORE_EVERY-th
    // step W may be another width whose price is unmeasured or stale (mm_spec_explore): 0
    // above all, which the choice itself never tries once a width that drafts is measured.
    double ex[MM_SPEC_MAX_W + 1] = {0};
    int maxw_step = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        n_draft[i] = 0;
        const Mmctl__Sampling *sa = q->sampling; // penalties: counts change per token
        bool pen = sa && (sa->presence_penalty != 0 || sa->frequency_penalty != 0 ||
                          (sa->repetition_penalty != 0 && sa->repetition_penalty != 1));
        if (!q->sample || q->max_draft == 0 || q->logprobs != 0 || !active[i] || pen)
            continue;
        struct rseq *r = find(d, q->seq_id);
        if (!r || r->broken)
            continue;
        int cap = d->c.max_k;
        if ((int64_t)cap > (int64_t)q->max_draft)
            cap = (int)q->max_draft;
        if (cap > d->c.max_ctx - r->len)
            cap = d->c.max_ctx - r->len;
        if (cap <= 0)
            continue;
        n_draft[i] = (uint32_t)cap; // the cap, for the pass below
        r->n_steps++;
        mm_spec_expect_add(ex, d->c.max_k, cap, (double)r->acc);
        if (cap > maxw_step)
            maxw_step = cap;
    }
    if (maxw_step > 0)
        d->n_steps++;
    int W = maxw_step;
    if (d->c.adapt && maxw_step > 0)
        W = d->choice = mm_spec_width_hold(&d->costs, b, maxw_step, ex, d->choice, HOLD);
    if (d->c.adapt && maxw_step > 0 && d->explore_left > 0) {
        W = d->explore_w < maxw_step ? d->explore_w : maxw_step;
        d->explore_left--;
    } else if (d->c.adapt && maxw_step > 0 && d->n_steps % EXPLORE_EVERY == 0) {
        int x = mm_spec_explore(&d->costs, b, W, maxw_step, STALE);
        if (x >= 0) {
            W = d->explore_w = x;
            d->explore_left = 2; // the next 2 steps too: the last one's period is the sample
            d->explored++;
        }
    }
    d->step_cost = maxw_step > 0; // a step where no seq may draft says nothing of widths
    size_t nq = 0, n_tok = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        int cap = (int)n_draft[i];
        n_draft[i] = 0;
        if (cap == 0)
            continue;
        struct rseq *r = find(d, q->seq_id);
        int k = cap < W ? cap : W;
        if (d->c.adapt && r->acc < 0.05f) {
            // all such seqs probe in the same steps (one call): every PROBE_EVERY-th drafting
            // step, the interval doubling per probe that kept it under 5% (a probe after
            // steps without drafts makes the drafter catch up on all their tokens)
            uint64_t every = (uint64_t)PROBE_EVERY << (r->probes < 4 ? r->probes : 4);
            bool probe = d->n_steps % every == 0;
            k = probe ? 1 : 0; // 1 draft tells whether it still misses
            r->probes += probe;
        } else {
            r->probes = 0;
        }
        if (k > room)
            k = (int)room;
        size_t add = (size_t)(r->len - r->dr_from);
        // The drafter's forward passes over tokens it lacks (a seq back from steps of width 0, a
        // probe) are bounded per request, or one request of 16 long catch-ups outlasts the
        // deadline and stalls the step: the first seq always goes, the others while the total
        // stays under CATCHUP_MAX (the rest catch up in later steps, drafting then).
        if (k <= 0 || nq >= (size_t)d->n_t || add > 200000 ||
            (nq > 0 && n_tok + add > CATCHUP_MAX))
            continue;
        r->asked = (uint32_t)k;
        if (k > d->step_w)
            d->step_w = k;
        Mmctl__DraftSeq *s = &d->dq[nq];
        mmctl__draft_seq__init(s);
        s->seq_id = q->seq_id;
        s->from = (uint32_t)r->dr_from;
        s->tokens = r->hist + r->dr_from;
        s->n_tokens = add;
        s->k = (uint32_t)k;
        d->dqp[nq] = s;
        d->dq_plan[nq++] = (int32_t)i;
        n_tok += add;
        room -= k;
    }
    if (nq == 0)
        return;
    mm_ctl_client *cl = drafter_link(d);
    if (!cl) { // drafter down or backing off: this step is a width-0 step after all
        for (size_t j = 0; j < nq; j++)
            find(d, d->dq[j].seq_id)->asked = 0;
        d->step_w = 0;
        return;
    }
    Mmctl__DraftRequest rq = MMCTL__DRAFT_REQUEST__INIT;
    rq.step_id = p->step_id;
    rq.n_seqs = nq;
    rq.seqs = d->dqp;
    rq.n_release = d->n_rel;
    rq.release = d->rel;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_DRAFT_REQUEST;
    env.draft_request = &rq;
    mm_ctl_msg *rep = NULL;
    char err[MM_ERRLEN] = "";
    d->requests++;
    mm_err rv = mm_ctl_call(cl, &env, d->c.timeout_ms, &rep, err);
    if (rv != MM_OK) {
        char why[MM_ERRLEN + 64];
        snprintf(why, sizeof(why), "no answer within %d ms (%s)", d->c.timeout_ms,
                 err[0] ? err : mm_strerror(rv));
        drafter_failed(d, why);
        d->step_ok = false;
        d->step_cost = false;
        return;
    }
    if (rep->body_case != MMCTL__ENVELOPE__BODY_DRAFT_REPLY ||
        rep->draft_reply->n_seqs != nq) {
        drafter_failed(d, rep->body_case == MMCTL__ENVELOPE__BODY_ACK && rep->ack->error[0]
                              ? rep->ack->error : "a reply that is not a draft_reply for the step");
        d->step_ok = false;
        d->step_cost = false;
        mm_ctl_msg_free(rep);
        return;
    }
    d->backoff_ms = 250;
    d->warned = false;
    d->n_rel = 0; // the drafter has them
    for (size_t j = 0; j < nq; j++) {
        const Mmctl__DraftOut *o = rep->draft_reply->seqs[j];
        int32_t i = d->dq_plan[j];
        struct rseq *r = find(d, d->dq[j].seq_id);
        if (!r || o->seq_id != d->dq[j].seq_id)
            continue;
        if (o->resync >= 0) {
            r->dr_from = o->resync < r->len ? o->resync : r->len;
            r->asked = 0; // the drafter lost its history: not the drafts' fault
            continue;
        }
        r->dr_from = r->len;
        uint32_t m = 0;
        while (m < o->n_tokens && m < d->dq[j].k && o->tokens[m] >= 0 &&
               o->tokens[m] < d->c.vocab) {
            draft[(size_t)i * MM_DRAFT_MAX_K + m] = o->tokens[m];
            m++;
        }
        n_draft[i] = m;
    }
    mm_ctl_msg_free(rep);
}

size_t mm_draft_ctrl_max(const mm_draft *d) { return 4 + (size_t)d->n_t * 16; }

size_t mm_draft_ctrl_tail(mm_draft *d, int s, uint8_t *buf) {
    uint32_t n = 0;
    uint8_t *c = buf + 4;
    for (int i = 0; i < d->n_t; i++) {
        struct rseq *r = &d->t[i];
        if (!r->used || !r->trunc || (int)(r->id % (uint64_t)d->c.n_shards) != s)
            continue;
        int32_t zero = 0;
        memcpy(c, &r->id, 8);
        memcpy(c + 8, &r->trunc_len, 4);
        memcpy(c + 12, &zero, 4);
        c += 16;
        n++;
    }
    if (n == 0)
        return 0;
    memcpy(buf, &n, 4);
    return (size_t)(c - buf);
}

void mm_draft_ctrl_sent(mm_draft *d, int s) {
    for (int i = 0; i < d->n_t; i++) {
        struct rseq *r = &d->t[i];
        if (r->used && r->trunc && (int)(r->id % (uint64_t)d->c.n_shards) == s)
            r->trunc = false;
    }
}

// acc_all_add: one draft token's outcome into the all-seqs acceptance: the mean of the first 50
// (a drafter that never agrees no longer spends ~120 drafted tokens wearing the 0.6 start
// down), then an EMA of rate 0.02.
static void acc_all_add(mm_draft *d, float ok) {
    float a = d->acc_n < 49 ? 1.0f / (float)(d->acc_n + 2) : 0.02f;
    d->acc_all += a * (ok - d->acc_all);
    d->acc_n++;
}

void mm_draft_verified(mm_draft *d, const Mmctl__SeqStep *q, uint32_t n_draft,
                       uint32_t accepted, const int32_t *drafts) {
    d->emitted += accepted + 1;
    struct rseq *r = find(d, q->seq_id);
    uint32_t chosen = r && r->last_step == d->step_no ? r->asked : 0;
    d->widths[chosen <= MM_DRAFT_MAX_K ? chosen : MM_DRAFT_MAX_K]++;
    if (r && accepted == n_draft && r->asked > n_draft) { // asked for more than it had:
        r->acc += 0.15f * (0.0f - r->acc);                // the chain ended there
        acc_all_add(d, 0.0f);
    }
    if (n_draft == 0 || !r)
        return;
    if (accepted > 0)
        d->probes_failed = 0;
    else if (r->acc < 0.05f && d->probes_failed < 4) // a probe (1 draft) that missed
        d->probes_failed++;
    memcpy(r->hist + r->len, drafts, accepted * 4);
    r->len += (int32_t)accepted;
    if (accepted < n_draft) {
        r->trunc = true;
        r->trunc_len = r->len;
    }
    for (uint32_t m = 0; m < n_draft && m <= accepted; m++) {
        bool ok = m < accepted;
        d->pos_tried[m]++;
        d->pos_ok[m] += ok;
        r->acc += 0.15f * ((ok ? 1.0f : 0.0f) - r->acc);
        acc_all_add(d, ok ? 1.0f : 0.0f);
    }
    d->drafted += n_draft;
    d->accepted += accepted;
    d->verified++;
}

void mm_draft_end(mm_draft *d, uint64_t step_ns) {
    (void)step_ns;
    if (d->c.max_k == 0)
        return;
    char buf[MM_CTL_MAX_STR];
    int n = snprintf(buf, sizeof(buf), "hub; drafting: drafted=%llu accepted=%llu emitted=%llu "
                     "rate=%.3f mean_accepted=%.3f drafter_misses=%llu drafts=%llu by_pos=",
                     (unsigned long long)d->drafted, (unsigned long long)d->accepted,
                     (unsigned long long)d->emitted,
                     d->drafted ? (double)d->accepted / (double)d->drafted : 0.0,
                     d->verified ? (double)d->accepted / (double)d->verified : 0.0,
                     (unsigned long long)d->misses, (unsigned long long)d->verified);
    for (int k = 0; k < d->c.max_k && n < (int)sizeof(buf) - 32; k++)
        n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s%.3f", k ? "/" : "",
                      d->pos_tried[k] ? (double)d->pos_ok[k] / (double)d->pos_tried[k] : 0.0);
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, " pos_drafted=");
    for (int k = 0; k < d->c.max_k && n < (int)sizeof(buf) - 32; k++)
        n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s%llu", k ? "/" : "",
                      (unsigned long long)d->pos_tried[k]);
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, " pos_accepted=");
    for (int k = 0; k < d->c.max_k && n < (int)sizeof(buf) - 32; k++)
        n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s%llu", k ? "/" : "",
                      (unsigned long long)d->pos_ok[k]);
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, " widths=");
    for (int k = 0; k <= d->c.max_k && n < (int)sizeof(buf) - 32; k++)
        n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s%d:%llu", k ? "," : "", k,
                      (unsigned long long)d->widths[k]);
    // the step-time prices (ms) of the last step's range, '-' where unmeasured
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, " range=%d prices_ms=", d->step_bucket);
    for (int k = 0; k <= d->c.max_k && n < (int)sizeof(buf) - 32; k++) {
        if (d->costs.n[d->step_bucket][k])
            n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s%.2f", k ? "/" : "",
                          d->costs.T[d->step_bucket][k]);
        else
            n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s-", k ? "/" : "");
    }
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, " explored=%llu",
                  (unsigned long long)d->explored);
    mm_registry_set_self_detail(d->reg, buf);
}
