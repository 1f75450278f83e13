// SPDX-License-Identifier: MIT
// The router's drafting state; see step_draft.h and docs/MESH.md (Drafting).
#include "step_draft.h"
#include "step_follow.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
#define MEASURE_USE 0.5  // a step measuring its width sends ahead requests only for seqs whose
                         // proposals are more likely usable than not (acc^(nd+1) >= 0.5): the
                         // others draft by synchronous requests, so the width gets its sample

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
    int cap;            // this step: the most drafts it may take (0: may not draft)
    bool probe_due;     // this step: a probe is due (pipeline: an ahead request of k 1)
    // draft-ahead (pipeline): the proposals of an ahead request, made while the step before ran
    bool ah_pend;       // in the ahead request in flight
    bool ah_ok;         // the drafts that request assumed accepted were all accepted
    uint64_t ah_step;   // the step (step_no) whose drafts it assumed
    int32_t ah_len;     // committed tokens when it was sent (the drafter holds them once answered)
    int32_t ah_base;    // position of its first proposal: ah_len + the drafts assumed
    uint32_t ah_k;      // proposals asked for
    uint32_t ah_n;      // proposals held (0: none): ah_tok[0] is the drafter's guess of the
                        // target's token at ah_base, the rest drafts after it
    int32_t ah_tok[MM_DRAFT_MAX_K + 1];
    uint32_t ah_off, ah_avail; // this step: valid drafts are ah_tok[ah_off, ah_off + ah_avail)
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
    bool off; // the drafter of incarnation cl_inc answered DraftReply.off: not asked again until
              // another incarnation registers (drafter_link clears it with the new client)
    // the request (sized at open)
    Mmctl__DraftSeq *dq;
    Mmctl__DraftSeq **dqp;
    int32_t *dq_plan;  // plan index of each request seq
    uint64_t *rel; // (MAX_REL) released seqs the drafter has not been told of yet
    size_t n_rel;
    mm_spec_costs costs[2]; // step time per (step range, widest draft asked for in the step),
                            // per mode (MM_SPEC_SYNC, MM_SPEC_AHEAD)
    mm_spec_modes modes;    // the measured tokens per ms of each mode (--draft-pipeline auto)
    int step_mode;          // this step's mode (MM_SPEC_SYNC / _AHEAD), -1: none
    int step_range;         // the range of its sampling seqs (mm_spec_mode_range)
    double step_tok;        // tokens it emitted (sampling seqs: accepted drafts + 1)
    uint32_t step_seqs;     // sampling seqs it verified
    uint64_t mode_steps[2]; // drafting steps per mode
    int step_w, step_bucket; // this step's: widest draft asked for; range (mm_spec_bucket)
    uint64_t n_steps; // steps with a seq that allowed drafting (probes: every PROBE_EVERY-th)
    bool step_ok;     // this step's drafter call (if any) answered
    bool step_cost;   // this step's period is a sample of its width's cost
    uint64_t step_no, step_t0; // steps begun; when this one began (ns)
    uint64_t explored;
    uint64_t explore_gated; // exploration steps refused: no candidate could pay (mm_spec_explore)
    uint64_t ahead_gated;   // seq steps refused an ahead request (mm_spec_ahead_pays)
    uint64_t measure_steps; // pipeline steps measuring a width (unmeasured or explored)
    int prev_w;              // the widest draft asked for in the step before, + its mode x
                             // (MM_SPEC_MAX_W + 1) (-1: no sample)
    int same_w;              // steps before this one in a row with its width (prev_w's run,
                             // up to 2)
    int explore_w, explore_left; // a width being measured, for explore_left more steps
    int choice[2];           // per mode: the last width chosen by price (not exploring), -1
    float acc_all; // per-draft-token acceptance over all seqs (slow EMA): a new seq's start
    uint32_t acc_n; // samples in acc_all (its first 50 are averaged: the 0.6 start is a guess)
    uint32_t probes_failed; // probes missed in a row over all seqs (0..4): a new seq's start, so
                            // that short requests of a drafter that never agrees probe rarely
    uint64_t req_no;        // Envelope.seq of the last request: increasing, from the wall clock
                            // (us) at open, so also across router restarts (step_draft.h)
    double sync_ms;         // a synchronous request's round trip (EMA of sync_n samples)
    uint32_t sync_n;
    // draft-ahead (pipeline): the one ahead request in flight (of client cl), or NULL
    mm_ctl_async *ah;
    uint64_t ah_step_id, ah_req, ah_sent_ns; // its DraftRequest.step_id, Envelope.seq, send time
    size_t ah_nq, ah_nrel;  // its seqs; the releases it carried (d->rel's first ah_nrel)
    uint64_t *ah_ids;       // (n_t) its seqs, in request order
    double ahead_ms;        // an ahead request's round trip (EMA: send to the reply in hand)
    double ah_wait_ms;      // time steps spent waiting for ahead replies, in all
    // metrics
    uint64_t drafted, accepted, emitted, verified, misses, requests;
    uint64_t ah_reqs, ah_hits, ah_misses, syncs;
    uint64_t pos_tried[MM_DRAFT_MAX_K], pos_ok[MM_DRAFT_MAX_K], widths[MM_DRAFT_MAX_K + 1];
    uint64_t detail_ns;  // when the status detail line was last built (0: never)
    bool detail_dirty;   // steps ended since (mm_draft_detail_flush builds it)
};

#define DETAIL_EVERY_NS 50000000ull // the detail line is rebuilt at most every 50 ms per step

mm_err mm_draft_open(mm_draft **out, const mm_draft_conf *c, mm_registry *reg,
                     char err[MM_ERRLEN]) {
    *out = NULL;
    if (c->max_k < 0 || c->max_k > MM_DRAFT_MAX_K || c->timeout_ms < 1 || c->max_rows < 0)
        return mm_errf(err, MM_EINVAL, "--draft-max must be 0..%d, --draft-timeout-ms >= 1, "
                       "--draft-max-rows >= 0", MM_DRAFT_MAX_K);
    if (c->pipeline != MM_DRAFT_PIPE_OFF && c->pipeline != MM_DRAFT_PIPE_ON &&
        c->pipeline != MM_DRAFT_PIPE_AUTO)
        return mm_errf(err, MM_EINVAL, "--draft-pipeline: mode %d is not false (%d), true (%d) "
                       "or auto (%d)", c->pipeline, MM_DRAFT_PIPE_OFF, MM_DRAFT_PIPE_ON,
                       MM_DRAFT_PIPE_AUTO);
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
    d->ah_ids = calloc((size_t)d->n_t, sizeof(*d->ah_ids));
    if (!d->t || !d->dq || !d->dqp || !d->dq_plan || !d->rel || !d->ah_ids) {
        mm_draft_close(d);
        return MM_ENOMEM;
    }
    d->backoff_ms = 250;
    d->acc_all = 0.6f;
    d->prev_w = -1;
    d->choice[0] = d->choice[1] = -1;
    d->step_mode = -1;
    mm_spec_modes_init(&d->modes);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    d->req_no = (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000u;
    *out = d;
    return MM_OK;
}

void mm_draft_close(mm_draft *d) {
    if (!d)
        return;
    mm_ctl_async_free(d->ah); // before its client
    for (int i = 0; d->t && i < d->n_t; i++)
        free(d->t[i].hist);
    free(d->t);
    free(d->dq);
    free(d->dqp);
    free(d->dq_plan);
    free(d->rel);
    free(d->ah_ids);
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
        r->cap = 0;
        r->probe_due = r->ah_pend = r->ah_ok = false;
        r->ah_n = r->ah_k = r->ah_off = r->ah_avail = 0;
        return r;
    }
    return NULL;
}

static void forget(mm_draft *d, uint64_t id) {
    struct rseq *r = find(d, id);
    if (r)
        r->used = false;
}

static void ahead_drop(mm_draft *d);

bool mm_draft_may_draft(mm_draft *d) {
    char url[MM_ADDR_LEN];
    uint64_t inc = 0;
    if (d->c.max_k <= 0 || !mm_registry_peer_ctl(d->reg, "drafter", 0, url, &inc) || !url[0])
        return false;
    return !(d->off && inc == d->cl_inc);
}

// drafter_off: the drafter answered that it has no draft model (DraftReply.off)
static void drafter_off(mm_draft *d) {
    if (!d->off)
        mm_log_info("the drafter has no draft model: steps go on without drafts until it restarts");
    d->off = true;
}

// drafter_link: the client for the drafter's current incarnation, or NULL (down, backing off).
static mm_ctl_client *drafter_link(mm_draft *d) {
    char url[MM_ADDR_LEN], err[MM_ERRLEN] = "";
    uint64_t inc = 0;
    if (!mm_registry_peer_ctl(d->reg, "drafter", 0, url, &inc) || !url[0])
        return NULL;
    if (!d->cl || inc != d->cl_inc) {
        ahead_drop(d); // a request to the old incarnation: its client goes
        mm_ctl_client_close(d->cl);
        d->cl = NULL;
        if (mm_ctl_client_open(&d->cl, url, err) != MM_OK) {
            mm_log_warn("drafter at %s: %s", url, err);
            return NULL;
        }
        d->cl_inc = inc;
        d->off = false;
        d->backoff_until = 0;
        d->backoff_ms = 250;
        d->warned = false;
        for (int i = 0; i < d->n_t; i++)
            d->t[i].dr_from = 0; // a new drafter process holds nothing
        d->n_rel = 0;
        d->ah_nrel = 0;
        mm_log_info("linked to the drafter at %s", url);
    }
    if (mm_now_ns() < d->backoff_until || d->off)
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

// drafter_answered: a request was answered: the backoff starts over, the next failure warns
// again, and the first `sent` pending releases (those the request carried) are the drafter's.
static void drafter_answered(mm_draft *d, size_t sent) {
    d->backoff_ms = 250;
    d->warned = false;
    if (sent > d->n_rel)
        sent = d->n_rel;
    memmove(d->rel, d->rel + sent, (d->n_rel - sent) * sizeof(*d->rel));
    d->n_rel -= sent;
    d->ah_nrel = 0;
}

// acc_all_add: one draft token's outcome into the all-seqs acceptance: the mean of the first 50
// (a drafter that never agrees no longer spends ~120 drafted tokens wearing the 0.6 start
// down), then an EMA of rate 0.02.
static void acc_all_add(mm_draft *d, float ok) {
    float a = d->acc_n < 49 ? 1.0f / (float)(d->acc_n + 2) : 0.02f;
    d->acc_all += a * (ok - d->acc_all);
    d->acc_n++;
}

// acc_sample: one proposed token's outcome (a draft verified, or an ahead guess compared with
// the target's token) into seq r's acceptance and the all-seqs one.
static void acc_sample(mm_draft *d, struct rseq *r, bool ok) {
    r->acc += 0.15f * ((ok ? 1.0f : 0.0f) - r->acc);
    acc_all_add(d, ok ? 1.0f : 0.0f);
}

static double ema(double v, double x, uint32_t n) {
    return n == 0 ? x : v + 0.25 * (x - v);
}

// request_env: the DraftRequest for the first nq seqs of d->dqp, with the releases the drafter
// has not been told of, in env (rq is the caller's and must outlive the send); numbered with
// the next request number, so the drafter can skip a seq's part of an older request.
static void request_env(mm_draft *d, uint64_t step_id, size_t nq, Mmctl__DraftRequest *rq,
                        mm_ctl_msg *env) {
    mmctl__draft_request__init(rq);
    rq->step_id = step_id;
    rq->n_seqs = nq;
    rq->seqs = d->dqp;
    rq->n_release = d->n_rel;
    rq->release = d->rel;
    mmctl__envelope__init(env);
    env->body_case = MMCTL__ENVELOPE__BODY_DRAFT_REQUEST;
    env->draft_request = rq;
    env->seq = ++d->req_no;
}

// ---- draft-ahead (pipeline) ----------------------------------------------------------------

// ahead_drop forgets the ahead request in flight: cancelled (a reply still coming is dropped
// with its nng context, never read as another request's), every seq's part in it cleared. The
// drafter may or may not have applied it: each seq's dr_from stays at what the drafter held for
// sure before it (the request's `from`), which both cases satisfy.
static void ahead_drop(mm_draft *d) {
    mm_ctl_async_free(d->ah);
    d->ah = NULL;
    for (size_t j = 0; j < d->ah_nq; j++) {
        struct rseq *r = find(d, d->ah_ids[j]);
        if (r)
            r->ah_pend = false;
    }
    d->ah_nq = 0;
}

// ahead_collect: the ahead request in flight, waited for at most wait_ms (0: a look). Answered:
// each seq's proposals are kept and what the drafter holds of it advances to the tokens it was
// sent as committed. Failed (timed out: a dead or frozen drafter, refused, a reply not for this
// request): dropped, and the drafter backs off as after a late synchronous request. Not yet
// answered after a look: kept for a later step.
static void ahead_collect(mm_draft *d, int wait_ms) {
    if (!d->ah)
        return;
    const uint64_t t0 = mm_now_ns();
    bool done = mm_ctl_async_wait(d->ah, wait_ms);
    d->ah_wait_ms += (double)(mm_now_ns() - t0) / 1e6;
    if (!done && wait_ms <= 0)
        return;
    char err[MM_ERRLEN] = "", why[MM_ERRLEN + 96];
    mm_ctl_msg *rep = NULL;
    mm_err rv = done ? mm_ctl_async_result(d->ah, &rep, err) : MM_ETIMEDOUT;
    const Mmctl__DraftReply *dr = rv == MM_OK && rep->body_case == MMCTL__ENVELOPE__BODY_DRAFT_REPLY
                                      ? rep->draft_reply : NULL;
    if (dr && dr->off) {
        mm_ctl_msg_free(rep);
        ahead_drop(d);
        drafter_off(d);
        return;
    }
    if (rv != MM_OK || !dr || dr->n_seqs != d->ah_nq || dr->step_id != d->ah_step_id ||
        rep->seq != d->ah_req) {
        if (rv != MM_OK)
            snprintf(why, sizeof(why), "ahead request: no answer within %d ms (%s)",
                     d->c.timeout_ms, err[0] ? err : mm_strerror(rv));
        else if (rep->body_case == MMCTL__ENVELOPE__BODY_ACK && rep->ack->error[0])
            snprintf(why, sizeof(why), "ahead request: %s", rep->ack->error);
        else
            snprintf(why, sizeof(why), "ahead request: a reply that is not its draft_reply (%s, "
                     "%zu seqs for %zu, step %llu for %llu, request %llu for %llu)",
                     mm_ctl_body_name(rep), dr ? dr->n_seqs : 0, d->ah_nq,
                     (unsigned long long)(dr ? dr->step_id : 0),
                     (unsigned long long)d->ah_step_id, (unsigned long long)rep->seq,
                     (unsigned long long)d->ah_req);
        mm_ctl_msg_free(rep);
        ahead_drop(d);
        drafter_failed(d, why);
        return;
    }
    d->ahead_ms = ema(d->ahead_ms, (double)(mm_now_ns() - d->ah_sent_ns) / 1e6,
                      d->ahead_ms > 0);
    drafter_answered(d, d->ah_nrel);
    for (size_t j = 0; j < d->ah_nq; j++) {
        const Mmctl__DraftOut *o = dr->seqs[j];
        struct rseq *r = find(d, d->ah_ids[j]);
        if (!r || !r->ah_pend || o->seq_id != d->ah_ids[j])
            continue; // released (or a new seq of that id) since
        r->ah_pend = false;
        if (o->resync >= 0) { // the drafter lost it: the next request starts from what it has
            r->dr_from = o->resync < r->len ? o->resync : r->len;
            continue;
        }
        if (r->ah_len > r->dr_from && r->ah_len <= r->len)
            r->dr_from = r->ah_len;
        uint32_t m = 0;
        while (m < o->n_tokens && m < r->ah_k && m <= MM_DRAFT_MAX_K && o->tokens[m] >= 0 &&
               o->tokens[m] < d->c.vocab) {
            r->ah_tok[m] = o->tokens[m];
            m++;
        }
        r->ah_n = m;
    }
    mm_ctl_msg_free(rep);
    mm_ctl_async_free(d->ah);
    d->ah = NULL;
    d->ah_nq = 0;
}

// ahead_check: seq r's proposals against its history (this step's inputs recorded). Valid when
// the drafts they assumed were all accepted (ah_ok) and the tokens the target emitted since
// equal the first proposals (in the steady state one token: g, the guess of the token after
// the drafts); the proposals after those are then drafts for this step (ah_off, ah_avail).
// Each proposal compared is an acceptance sample, like a draft verified (a probe's g gives its
// outcome at no cost to the step). Proposals are checked once.
static void ahead_check(mm_draft *d, struct rseq *r) {
    r->ah_off = r->ah_avail = 0;
    const uint32_t n = r->ah_n;
    if (n == 0 || r->ah_pend)
        return;
    r->ah_n = 0;
    const int64_t m = (int64_t)r->len - r->ah_base; // tokens the target emitted from ah_base on
    if (!r->ah_ok || r->broken || m < 1)
        return;
    const bool low = r->acc < 0.05f;
    uint32_t i = 0;
    while ((int64_t)i < m && i < n && r->hist[r->ah_base + (int64_t)i] == r->ah_tok[i])
        acc_sample(d, r, true), i++;
    if ((int64_t)i < m && i < n)
        acc_sample(d, r, false);
    if (i > 0)
        d->probes_failed = 0;
    else if (low && d->probes_failed < 4)
        d->probes_failed++;
    if ((int64_t)i == m && i < n) {
        r->ah_off = i;
        r->ah_avail = n - i;
    }
}

// ahead_k: the proposals to ask seq r (plan index i) for in this step's ahead request, 0 for
// none. A probe: 1 (g alone: its outcome is known at the next step without verifying
// anything). Else k = its width next step + 1 (the first proposal is the guess g of the
// target's token after the drafts), only when W > 0, the seq is not under 5% acceptance (nor,
// in a step measuring its width, under MEASURE_USE), and (--draft-adapt) the request pays
// for it (mm_spec_ahead_pays:
// its proposals are usable only when all nd drafts of this step are accepted and g is right,
// acc^(nd + 1); a seq refused sets *gated).
static uint32_t ahead_k(mm_draft *d, const struct rseq *r, uint32_t nd, int W, int b,
                        bool measuring, bool *gated) {
    *gated = false;
    if (!r || r->cap <= 0 || r->broken || r->last_step != d->step_no)
        return 0;
    if (r->probe_due)
        return 1;
    if ((d->c.adapt && r->acc < 0.05f) || W <= 0)
        return 0;
    if (measuring) { // usable proposals measure the width as well as drafts asked for do
        double use = (double)r->acc;
        for (uint32_t m = 0; m < nd; m++)
            use *= (double)r->acc;
        if (use < MEASURE_USE)
            return 0;
    }
    // the next step's width: this one's, within this step's max_draft (the next step's is not
    // known: it may be a per-step cap or what is left of the request) and the context
    int64_t cap = W < r->cap ? W : r->cap;
    if (cap > (int64_t)d->c.max_ctx - r->len - (int64_t)nd - 1)
        cap = (int64_t)d->c.max_ctx - r->len - (int64_t)nd - 1;
    if (cap <= 0)
        return 0; // the seq ends or fills its context: nothing to draft next step
    if (d->c.adapt &&
        !mm_spec_ahead_pays(&d->costs[MM_SPEC_AHEAD], b, (int)cap, d->c.max_k, (double)r->acc,
                            (int)nd)) {
        *gated = true;
        return 0;
    }
    return (uint32_t)cap + 1;
}

// ahead_send sends the next step's ahead request (pipeline; none while one is in flight: a
// drafter slower than the steps is not flooded, it is waited for or skipped). Per seq with
// ahead_k > 0: its tokens since what the drafter holds, then this step's drafts (assumed
// accepted), k = ahead_k. Width W 0 (drafting does not pay): probes only.
static void ahead_send(mm_draft *d, const Mmctl__StepPlan *p, const uint32_t *n_draft,
                       const int32_t *draft, int W, int b, bool measuring) {
    if (d->ah)
        return;
    bool any = false, gated;
    uint64_t n_gated = 0; // refusals of the scan: all seqs' when none may ask
    for (size_t i = 0; i < p->n_seqs && !any; i++) {
        any = ahead_k(d, find(d, p->seqs[i]->seq_id), n_draft[i], W, b, measuring, &gated) > 0;
        n_gated += gated;
    }
    if (!any) // (the refusals, counted once per seq step: otherwise by the loop below)
        d->ahead_gated += n_gated;
    // the link first: a new drafter incarnation resets what it holds of every seq (dr_from)
    mm_ctl_client *cl = any ? drafter_link(d) : NULL;
    if (!cl) // nothing to ask, or the drafter is down or backing off
        return;
    size_t nq = 0, n_tok = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        struct rseq *r = find(d, q->seq_id);
        const int32_t nd = (int32_t)n_draft[i];
        const uint32_t k = ahead_k(d, r, n_draft[i], W, b, measuring, &gated);
        d->ahead_gated += gated;
        if (k == 0)
            continue;
        const size_t add = (size_t)(r->len - r->dr_from) + (size_t)nd;
        // add 0: the drafter just answered this very history without drafts (a synchronous
        // request; n-gram lookup found nothing): asking again would get the same nothing
        if (add == 0 || nq >= (size_t)d->n_t || add > 200000 ||
            (nq > 0 && n_tok + add > CATCHUP_MAX))
            continue; // catch-up bounded per request, as for synchronous requests
        // the drafts after the committed tokens (verification writes the accepted ones there
        // too; r->cap <= max_ctx - len keeps them inside the history buffer)
        memcpy(r->hist + r->len, draft + i * MM_DRAFT_MAX_K, (size_t)nd * 4);
        Mmctl__DraftSeq *s = &d->dq[nq];
        mmctl__draft_seq__init(s);
        s->seq_id = q->seq_id;
        s->from = (uint32_t)r->dr_from;
        s->tokens = r->hist + r->dr_from;
        s->n_tokens = add;
        s->k = k;
        d->dqp[nq] = s;
        d->ah_ids[nq++] = q->seq_id;
        n_tok += add;
        r->ah_pend = r->ah_ok = true;
        r->ah_step = d->step_no;
        r->ah_len = r->len;
        r->ah_base = r->len + nd;
        r->ah_k = k;
        r->ah_n = 0;
    }
    if (nq == 0)
        return;
    d->ah_nq = nq;
    Mmctl__DraftRequest rq;
    mm_ctl_msg env;
    request_env(d, p->step_id, nq, &rq, &env);
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_ctl_call_start(cl, &env, d->c.timeout_ms, NULL, NULL, &d->ah, err);
    if (rv != MM_OK) {
        d->ah = NULL;
        for (size_t j = 0; j < nq; j++)
            find(d, d->ah_ids[j])->ah_pend = false;
        d->ah_nq = 0;
        char why[MM_ERRLEN + 32];
        snprintf(why, sizeof(why), "ahead request: %s", err[0] ? err : mm_strerror(rv));
        drafter_failed(d, why);
        return;
    }
    mm_log_debug("draft step %llu: ahead request of %zu seqs sent", (unsigned long long)d->step_no,
                 nq);
    d->ah_step_id = p->step_id;
    d->ah_req = env.seq;
    d->ah_sent_ns = mm_now_ns();
    d->ah_nrel = d->n_rel;
    d->ah_reqs++;
    d->requests++;
}

// sync_pays (pipeline): does a synchronous request for the seqs without valid ahead proposals
// (d->dq[0, nq)) pay for its wait? It adds the measured round trip sync_ms to a step whose price
// is T = T(W) (common/spec.c), and adds sum_{i=1..k} a^i expected tokens per seq asked (a its
// acceptance, k its width); the step's expected tokens without it are E (each sampling seq's
// own token plus its ahead drafts' expected acceptance). It pays when tokens per ms rise:
// (E + extra) / (T + sync_ms) > E / T, i.e. extra / E > sync_ms / T. Unmeasured sync_ms or no
// step priced yet: it pays (that request, that step measure them).
static bool sync_pays(mm_draft *d, const Mmctl__StepPlan *p, const bool *active,
                      const uint32_t *n_draft, size_t nq, int bucket, int W) {
    bool priced = false;
    for (int x = 0; x < MM_SPEC_BUCKETS && !priced; x++)
        priced = d->costs[MM_SPEC_AHEAD].ticks[x] > 0;
    if (d->sync_n == 0 || !priced)
        return true;
    double E = 0, extra = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        if (!q->sample || !active[i])
            continue;
        const struct rseq *r = find(d, q->seq_id);
        double ai = 1, a = r ? (double)r->acc : 0;
        E += 1;
        for (uint32_t m = 0; m < n_draft[i]; m++)
            E += (ai *= a);
    }
    for (size_t j = 0; j < nq; j++) {
        const struct rseq *r = find(d, d->dq[j].seq_id);
        double ai = 1, a = r ? (double)r->acc : 0;
        for (uint32_t m = 0; m < d->dq[j].k; m++)
            extra += (ai *= a);
    }
    const double T = mm_spec_price(&d->costs[MM_SPEC_AHEAD], bucket, W, d->c.max_k);
    return E > 0 && extra * T > d->sync_ms * E;
}

// draft_sync asks the drafter for the nq seqs in d->dq and waits for the answer (at most
// --draft-timeout-ms): drafts into draft/n_draft by plan index (d->dq_plan). A late, dead or
// refusing drafter: no drafts this step, backoff.
static void draft_sync(mm_draft *d, uint64_t step_id, size_t nq, uint32_t *n_draft,
                       int32_t *draft) {
    mm_ctl_client *cl = drafter_link(d);
    if (!cl) { // drafter down or backing off: these seqs draft nothing after all
        for (size_t j = 0; j < nq; j++)
            find(d, d->dq[j].seq_id)->asked = 0;
        return;
    }
    Mmctl__DraftRequest rq;
    mm_ctl_msg env;
    request_env(d, step_id, nq, &rq, &env);
    mm_ctl_msg *rep = NULL;
    char err[MM_ERRLEN] = "";
    d->requests++;
    d->syncs++;
    const uint64_t t0 = mm_now_ns();
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
    if (rep->body_case == MMCTL__ENVELOPE__BODY_DRAFT_REPLY && rep->draft_reply->off) {
        drafter_off(d);
        for (size_t j = 0; j < nq; j++) // as with no drafter: these seqs draft nothing
            find(d, d->dq[j].seq_id)->asked = 0;
        mm_ctl_msg_free(rep);
        return;
    }
    if (rep->body_case != MMCTL__ENVELOPE__BODY_DRAFT_REPLY ||
        rep->draft_reply->n_seqs != nq || rep->draft_reply->step_id != step_id) {
        drafter_failed(d, rep->body_case == MMCTL__ENVELOPE__BODY_ACK && rep->ack->error[0]
                              ? rep->ack->error : "a reply that is not a draft_reply for the step");
        d->step_ok = false;
        d->step_cost = false;
        mm_ctl_msg_free(rep);
        return;
    }
    d->sync_ms = ema(d->sync_ms, (double)(mm_now_ns() - t0) / 1e6, d->sync_n++);
    drafter_answered(d, d->n_rel); // the request carried every pending release
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
    // With the pipeline the period also holds this step's wait for its ahead reply (below,
    // after step_t0): the drafter's work that did not overlap the step before.
    const uint64_t now = mm_now_ns();
    bool goes_on = false;
    for (size_t i = 0; i < p->n_seqs && !goes_on; i++) {
        const struct rseq *r = p->seqs[i]->pos > 0 ? find(d, p->seqs[i]->seq_id) : NULL;
        goes_on = r && r->last_step == d->step_no;
    }
    // The width's sample goes to its mode's prices; a change of mode starts the run over (the
    // steps just before were of the other mode). The mode's sample: the step's tokens per seq
    // over the same period (mm_spec_mode_add: not counted in the warm-up after a change).
    const double ms = (double)(now - d->step_t0) / 1e6;
    const int wkey = d->step_w + (d->step_mode > 0 ? d->step_mode : 0) * (MM_SPEC_MAX_W + 1);
    if (d->step_cost && goes_on && d->c.max_k > 0 && d->step_mode >= 0 && wkey == d->prev_w &&
        d->same_w >= 2)
        mm_spec_cost_add(&d->costs[d->step_mode], d->step_bucket, d->step_w, ms);
    if (d->step_mode >= 0 && d->c.max_k > 0)
        mm_spec_mode_add(&d->modes, d->step_range, d->step_mode, d->step_tok, d->step_seqs, ms,
                         d->step_cost && goes_on);
    int w_now = d->step_cost && goes_on && d->step_mode >= 0 ? wkey : -1;
    // (counted up to 2, all its test needs: a width held for 2^31 steps must not wrap negative
    // and stop the width's price samples)
    d->same_w = w_now >= 0 && w_now == d->prev_w ? (d->same_w < 2 ? d->same_w + 1 : 2) : 1;
    d->prev_w = w_now;
    d->step_no++;
    d->step_t0 = now;
    d->step_w = 0;
    d->step_bucket = 0;
    d->step_mode = -1;
    d->step_tok = 0;
    d->step_seqs = 0;
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
            if (d->ah_nrel > 0)
                d->ah_nrel--;
        }
        d->rel[d->n_rel++] = p->release[i];
    }
    int32_t max_ctx_step = 0;
    int64_t rows = 0, n_sample = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        n_draft[i] = 0;
        if (active[i])
            rows += (int64_t)q->n_tokens;
        n_sample += active[i] && q->sample;
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
        r->cap = 0;
        r->probe_due = false;
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
        r->cap = cap;
        r->n_steps++;
        mm_spec_expect_add(ex, d->c.max_k, cap, (double)r->acc);
        if (cap > maxw_step)
            maxw_step = cap;
    }
    if (maxw_step > 0)
        d->n_steps++;
    // The step's mode (--draft-pipeline; auto: mm_spec_mode_pick by the range of its sampling
    // seqs, each mode eligible when its own width prices choose a width above 0 for these
    // seqs). A step where no seq may draft takes the range's choice without a pick (it
    // measures nothing).
    const int range = mm_spec_mode_range(n_sample);
    int mode = d->c.pipeline == MM_DRAFT_PIPE_ON ? MM_SPEC_AHEAD : MM_SPEC_SYNC;
    if (d->c.pipeline == MM_DRAFT_PIPE_AUTO && maxw_step > 0) {
        bool can[2];
        for (int m = 0; m < 2; m++)
            can[m] = !d->c.adapt || mm_spec_width_sum(&d->costs[m], b, maxw_step, ex) > 0;
        mode = mm_spec_mode_pick(&d->modes, range, can);
    } else if (d->c.pipeline == MM_DRAFT_PIPE_AUTO) {
        mode = d->modes.choice[range] >= 0 ? d->modes.choice[range] : MM_SPEC_AHEAD;
    }
    const bool pipe = mode == MM_SPEC_AHEAD;
    if (d->prev_w >= 0 && d->prev_w / (MM_SPEC_MAX_W + 1) != mode)
        d->explore_left = 0; // a width being measured: its samples would not count (new run)
    d->step_mode = mode;
    d->step_range = range;
    d->mode_steps[mode] += maxw_step > 0;
    mm_spec_costs *costs = &d->costs[mode];
    int W = maxw_step;
    bool exploring = false;
    if (d->c.adapt && maxw_step > 0)
        W = d->choice[mode] = mm_spec_width_hold(costs, b, maxw_step, ex, d->choice[mode], HOLD);
    if (d->c.adapt && maxw_step > 0 && d->explore_left > 0) {
        W = d->explore_w < maxw_step ? d->explore_w : maxw_step;
        d->explore_left--;
        exploring = true;
    } else if (d->c.adapt && maxw_step > 0 && d->n_steps % EXPLORE_EVERY == 0) {
        // gated by the seqs' expected tokens once any acceptance was measured: a width that
        // cannot pay even at its lowest plausible price is not measured (mm_spec_explore)
        const double *gate = d->acc_n > 0 ? ex : NULL;
        int x = mm_spec_explore(costs, b, W, maxw_step, STALE, gate);
        if (x >= 0) {
            W = d->explore_w = x;
            d->explore_left = 2; // the next 2 steps too: the last one's period is the sample
            d->explored++;
            exploring = true;
        } else if (gate && mm_spec_explore(costs, b, W, maxw_step, STALE, NULL) >= 0) {
            d->explore_gated++;
        }
    }
    // Pipeline: a step whose width is to be measured (explored, or chosen at an optimistic
    // price because it was never measured) drafts its seqs without usable ahead proposals by
    // synchronous requests, made whether or not they pay (after waiting for an ahead request
    // in flight), and sends ahead requests only for seqs likely to use them (MEASURE_USE).
    // Otherwise the width's price is never sampled when ahead proposals are rarely usable (a
    // seq without them drafts 0, so the step counts as width 0), and the optimistic price keeps
    // the width chosen, with an ahead request every step that the drafter works on for nothing.
    const bool measuring = pipe && d->c.adapt && W > 0 &&
                           (exploring || !mm_spec_measured(costs, b, W, d->c.max_k));
    d->measure_steps += measuring;
    d->step_cost = maxw_step > 0; // a step where no seq may draft says nothing of widths
    if (pipe || d->ah) {
        // The ahead reply: waited for (within its deadline) only when a seq of it can draft
        // with its proposals in this very step (its drafts all accepted, not a probe, W > 0);
        // otherwise a look, and a reply not in yet stays in flight for a later step.
        // A step measuring its width waits for it too, so that its seqs without proposals can
        // make the synchronous request (none is made while the drafter is busy with an ahead
        // request; the step would count as width 0 and the width would stay unmeasured).
        // So does a synchronous step (auto) after an ahead step: the drafter is busy with that
        // request anyway, and its valid proposals are drafts (hits) this step too.
        bool wait = (measuring || (!pipe && W > 0)) && d->ah;
        for (size_t i = 0; i < p->n_seqs && d->ah && W > 0 && !wait; i++) {
            const struct rseq *r = find(d, p->seqs[i]->seq_id);
            wait = r && r->cap > 0 && r->ah_pend && r->ah_ok && r->ah_k > 1 &&
                   r->len == r->ah_base + 1 && !(d->c.adapt && r->acc < 0.05f);
        }
        int wait_ms = 0;
        if (wait) { // to the request's own deadline (nng ends the call then), and a little
            uint64_t gone_ms = (mm_now_ns() - d->ah_sent_ns) / 1000000ull;
            wait_ms = (int)((uint64_t)d->c.timeout_ms > gone_ms ? d->c.timeout_ms - gone_ms : 0) +
                      20;
        }
        mm_log_debug("draft step %llu: W %d, ahead %s, wait %d ms", (unsigned long long)d->step_no,
                     W, d->ah ? "in flight" : "none", wait_ms);
        ahead_collect(d, wait_ms);
    }
    for (size_t i = 0; i < p->n_seqs; i++) { // (no proposals: none, as with the pipeline off)
        struct rseq *r = find(d, p->seqs[i]->seq_id);
        if (r && r->last_step == d->step_no)
            ahead_check(d, r);
    }
    size_t nq = 0, n_tok = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        struct rseq *r = find(d, q->seq_id);
        if (!r || r->last_step != d->step_no || r->cap <= 0)
            continue;
        const int cap = r->cap;
        int k = cap < W ? cap : W;
        if (d->c.adapt && r->acc < 0.05f) {
            // all such seqs probe in the same steps (one call): every PROBE_EVERY-th drafting
            // step, the interval doubling per probe that kept it under 5% (a probe after
            // steps without drafts makes the drafter catch up on all their tokens). Pipeline:
            // the probe is an ahead request (sent below, never waited for), this step drafts 0.
            uint64_t every = (uint64_t)PROBE_EVERY << (r->probes < 4 ? r->probes : 4);
            bool probe = d->n_steps % every == 0;
            k = probe && !pipe ? 1 : 0; // 1 draft tells whether it still misses
            r->probe_due = probe && pipe;
            r->probes += probe;
        } else {
            r->probes = 0;
            // Pipeline, no width pays (W 0): every PROBE_EVERY-th drafting step the seq probes
            // all the same (an ahead request of k 1: g alone, never waited for, no draft rows),
            // so that its acceptance, and the all-seqs one new seqs start from, keep following
            // the drafter. Exploration is gated by them: without these samples a drafter that
            // agreed rarely at first would never be tried again (e.g. n-gram lookup on a
            // workload that turns repetitive).
            r->probe_due = pipe && d->c.adapt && W == 0 && d->n_steps % PROBE_EVERY == 0;
        }
        if (k > room)
            k = (int)room;
        if (k <= 0)
            continue;
        if (r->ah_avail > 0) { // a hit: drafts made during the step before
            uint32_t asked = (uint32_t)k; // a width beyond what the ahead request asked for is
            if (asked > r->ah_k - r->ah_off) // not the drafter's miss
                asked = r->ah_k - r->ah_off;
            uint32_t m = asked < r->ah_avail ? asked : r->ah_avail;
            memcpy(draft + i * MM_DRAFT_MAX_K, r->ah_tok + r->ah_off, m * 4);
            n_draft[i] = m;
            r->asked = asked;
            room -= m;
            d->ah_hits++;
            continue;
        }
        if (pipe && d->cl) // (a mesh that never had a drafter counts no misses)
            d->ah_misses++;
        size_t add = (size_t)(r->len - r->dr_from);
        // The drafter's forward passes over tokens it lacks (a seq back from steps of width 0, a
        // probe) are bounded per request, or one request of 16 long catch-ups outlasts the
        // deadline and stalls the step: the first seq always goes, the others while the total
        // stays under CATCHUP_MAX (the rest catch up in later steps, drafting then).
        if (nq >= (size_t)d->n_t || add > 200000 || (nq > 0 && n_tok + add > CATCHUP_MAX))
            continue;
        r->asked = (uint32_t)k;
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
    // Pipeline: the seqs without ahead proposals wait for a synchronous request only when it
    // pays (sync_pays), and not while an ahead request is still in flight (the drafter is busy
    // with it; they get theirs from the next ahead request). --draft-adapt false (no cost
    // model: every seq drafts --draft-max): always.
    if (nq > 0 && pipe && d->c.adapt &&
        (d->ah || (!measuring && !sync_pays(d, p, active, n_draft, nq, b, W)))) {
        for (size_t j = 0; j < nq; j++)
            find(d, d->dq[j].seq_id)->asked = 0;
        nq = 0;
    }
    if (nq > 0)
        draft_sync(d, p->step_id, nq, n_draft, draft);
    for (size_t i = 0; i < p->n_seqs; i++) { // the step's width: the widest draft asked for
        const struct rseq *r = find(d, p->seqs[i]->seq_id);
        if (r && r->last_step == d->step_no && (int)r->asked > d->step_w)
            d->step_w = (int)r->asked;
    }
    if (pipe)
        ahead_send(d, p, n_draft, draft, W, b, measuring);
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


void mm_draft_verified(mm_draft *d, const Mmctl__SeqStep *q, uint32_t n_draft,
                       uint32_t accepted, const int32_t *drafts) {
    d->emitted += accepted + 1;
    d->step_tok += accepted + 1;
    d->step_seqs++;
    struct rseq *r = find(d, q->seq_id);
    uint32_t chosen = r && r->last_step == d->step_no ? r->asked : 0;
    d->widths[chosen <= MM_DRAFT_MAX_K ? chosen : MM_DRAFT_MAX_K]++;
    if (r && accepted == n_draft && r->asked > n_draft) // asked for more than it had:
        acc_sample(d, r, false);                        // the chain ended there
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
        if (r->ah_step == d->step_no) // the ahead request sent this step assumed them all
            r->ah_ok = false;
    }
    for (uint32_t m = 0; m < n_draft && m <= accepted; m++) {
        bool ok = m < accepted;
        d->pos_tried[m]++;
        d->pos_ok[m] += ok;
        acc_sample(d, r, ok);
    }
    d->drafted += n_draft;
    d->accepted += accepted;
    d->verified++;
}

// app appends to the detail text buf (MM_CTL_MAX_STR) at *n; a piece that does not fit whole
// is left out, and nothing more after it.
static void app(char *buf, int *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void app(char *buf, int *n, const char *fmt, ...) {
    if (*n >= MM_CTL_MAX_STR - 1)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *n, (size_t)(MM_CTL_MAX_STR - *n), fmt, ap);
    va_end(ap);
    if (w >= 0 && *n + w > MM_CTL_MAX_STR - 1) { // whole pieces only: a cut number would read
        buf[*n] = 0;                            // as a smaller count (the gateway's counters)
        *n = MM_CTL_MAX_STR - 1;                // and nothing more is appended
        return;
    }
    *n = w < 0 ? *n : *n + w;
}

static void detail_build(mm_draft *d);

void mm_draft_fed(mm_draft *d, const Mmctl__StepPlan *p, const int32_t *picks, size_t n) {
    for (size_t i = 0; d->c.max_k > 0 && i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        if (q->n_tokens != 1 || !MM_FOLLOW_IS_PENDING(q->tokens[0]) ||
            MM_FOLLOW_PICK(q->tokens[0]) >= (int64_t)n)
            continue;
        struct rseq *r = find(d, q->seq_id);
        if (r && !r->broken && r->last_step == d->step_no && (int64_t)q->pos < (int64_t)r->len)
            r->hist[q->pos] = picks[MM_FOLLOW_PICK(q->tokens[0])];
    }
}

void mm_draft_end(mm_draft *d, uint64_t step_ns) {
    (void)step_ns;
    if (d->c.max_k == 0)
        return;
    // ~1 KB of formatted numbers (3.8 us a step on the CPU VM, on the path between steps): at
    // most every 50 ms while steps run; a status request on an idle engine flushes the rest
    // (mm_draft_detail_flush), so no reader sees counters older than 50 ms of steps
    const uint64_t now = mm_now_ns();
    if (d->detail_ns != 0 && now - d->detail_ns < DETAIL_EVERY_NS) {
        d->detail_dirty = true;
        return;
    }
    d->detail_ns = now;
    d->detail_dirty = false;
    detail_build(d);
}

void mm_draft_detail_flush(mm_draft *d) {
    if (!d || d->c.max_k == 0 || !d->detail_dirty)
        return;
    d->detail_ns = mm_now_ns();
    d->detail_dirty = false;
    detail_build(d);
}

// detail_build publishes the drafting metrics as the router's status detail.
static void detail_build(mm_draft *d) {
    char buf[MM_CTL_MAX_STR];
    int n = 0;
    // draft-ahead: ahead requests sent, seq steps that drafted from ahead proposals (hits) and
    // that were to draft without valid ones (misses: a synchronous request or width 0),
    // synchronous requests; below, the round trips and the time steps waited for ahead replies
    app(buf, &n, "hub; drafting: drafted=%llu accepted=%llu emitted=%llu rate=%.3f "
        "mean_accepted=%.3f drafter_misses=%llu drafts=%llu ahead=%llu ahead_hits=%llu "
        "ahead_misses=%llu sync=%llu by_pos=",
        (unsigned long long)d->drafted, (unsigned long long)d->accepted,
        (unsigned long long)d->emitted,
        d->drafted ? (double)d->accepted / (double)d->drafted : 0.0,
        d->verified ? (double)d->accepted / (double)d->verified : 0.0,
        (unsigned long long)d->misses, (unsigned long long)d->verified,
        (unsigned long long)d->ah_reqs, (unsigned long long)d->ah_hits,
        (unsigned long long)d->ah_misses, (unsigned long long)d->syncs);
    for (int k = 0; k < d->c.max_k; k++)
        app(buf, &n, "%s%.3f", k ? "/" : "",
            d->pos_tried[k] ? (double)d->pos_ok[k] / (double)d->pos_tried[k] : 0.0);
    app(buf, &n, " pos_drafted=");
    for (int k = 0; k < d->c.max_k; k++)
        app(buf, &n, "%s%llu", k ? "/" : "", (unsigned long long)d->pos_tried[k]);
    app(buf, &n, " pos_accepted=");
    for (int k = 0; k < d->c.max_k; k++)
        app(buf, &n, "%s%llu", k ? "/" : "", (unsigned long long)d->pos_ok[k]);
    app(buf, &n, " widths=");
    for (int k = 0; k <= d->c.max_k; k++)
        app(buf, &n, "%s%d:%llu", k ? "," : "", k, (unsigned long long)d->widths[k]);
    // the step-time prices (ms) of the last step's range and mode, '-' where unmeasured
    const mm_spec_costs *co = &d->costs[d->step_mode == MM_SPEC_AHEAD];
    app(buf, &n, " range=%d prices_ms=", d->step_bucket);
    for (int k = 0; k <= d->c.max_k; k++) {
        if (co->n[d->step_bucket][k])
            app(buf, &n, "%s%.2f", k ? "/" : "", co->T[d->step_bucket][k]);
        else
            app(buf, &n, "%s-", k ? "/" : "");
    }
    static const char *const pipe_name[] = {"false", "true", "auto"};
    app(buf, &n, " explored=%llu pipeline=%s ahead_ms=%.2f sync_ms=%.2f ahead_wait_ms=%.0f",
        (unsigned long long)d->explored, pipe_name[d->c.pipeline], d->ahead_ms, d->sync_ms,
        d->ah_wait_ms);
    // the mode (draft-ahead or waited drafts): drafting steps run in each; auto: measurements
    // of the mode not chosen, changes of the choice, and for the last step's row range the
    // choice and each mode's measured tokens per seq per ms ('-': unmeasured)
    const mm_spec_modes *mo = &d->modes;
    const int rr = d->step_range;
    app(buf, &n, " ahead_steps=%llu sync_steps=%llu mode_explored=%llu mode_switches=%llu "
        "mode_range=%d mode=%s mode_rates=", (unsigned long long)d->mode_steps[MM_SPEC_AHEAD],
        (unsigned long long)d->mode_steps[MM_SPEC_SYNC], (unsigned long long)mo->explorations,
        (unsigned long long)mo->switches, rr,
        mo->choice[rr] == MM_SPEC_AHEAD ? "ahead" : mo->choice[rr] == MM_SPEC_SYNC ? "sync" : "-");
    for (int m = MM_SPEC_AHEAD; m >= MM_SPEC_SYNC; m--) {
        if (mo->n[rr][m])
            app(buf, &n, "%s%.4f", m == MM_SPEC_AHEAD ? "" : "/", mo->rate[rr][m]);
        else
            app(buf, &n, "%s-", m == MM_SPEC_AHEAD ? "" : "/");
    }
    // every row range's choice ("range:mode", e.g. 0:ahead,4:sync; '-' when none has one)
    app(buf, &n, " mode_by_range=");
    bool any = false;
    for (int r = 0; r < MM_SPEC_ROW_BUCKETS; r++)
        if (mo->choice[r] >= 0) {
            app(buf, &n, "%s%d:%s", any ? "," : "", r,
                mo->choice[r] == MM_SPEC_AHEAD ? "ahead" : "sync");
            any = true;
        }
    if (!any)
        app(buf, &n, "-");
    // the gates: exploration steps refused (no width could pay), seq steps refused an ahead
    // request (its proposals unlikely to be usable), pipeline steps measuring a width
    app(buf, &n, " explore_gated=%llu ahead_gated=%llu measure=%llu",
        (unsigned long long)d->explore_gated, (unsigned long long)d->ahead_gated,
        (unsigned long long)d->measure_steps);
    mm_registry_set_self_detail(d->reg, buf);
}
