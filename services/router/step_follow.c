// SPDX-License-Identifier: MIT
// Pipelined plans: the router's memory of the last steps' picks; see step_follow.h.
#include "step_follow.h"

#include "mm/time.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FOLLOW_STEPS 8 // steps remembered
#define FOLLOW_MSG 200
#define FOLLOW_SEEN 16    // step ids that reached the router, newest last
#define ARRIVE_MS 2000    // longest wait for the step a plan follows to reach the router

struct step_rec {
    bool used;
    uint64_t step_id;
    size_t n;
    uint64_t *seq;      // (max_seqs) seq ids in plan order
    int32_t *tok;       // (max_seqs) last token emitted (-1: none)
    uint32_t *next_pos; // (max_seqs) position of the seq's next input
    int32_t *code;      // (max_seqs) mm_err the seq failed with (0: ok)
    char (*msg)[FOLLOW_MSG];
};

struct mm_follow {
    int max_seqs;
    pthread_cond_t cv; // CLOCK_MONOTONIC; broadcast per recorded step
    struct step_rec ring[FOLLOW_STEPS];
    int head;          // next slot to write
    uint64_t seen[FOLLOW_SEEN]; // plans that reached mm_step_engine_run (mm_follow_arrived)
    int seen_head;
    // the last two resolved plans (a plan begun early, mm_step_engine_run, is resolved while
    // the step before it still answers from its own); cur: the newer
    struct resolved {
        Mmctl__StepPlan rp;
        Mmctl__SeqStep *rs;   // (max_seqs)
        Mmctl__SeqStep **rsp; // (max_seqs)
        int32_t *tok;         // (max_seqs) the follow entries' input tokens
        int32_t *drop_code;   // (max_seqs) 0: runs
        char (*drop_msg)[FOLLOW_MSG];
        size_t n_resolved;    // entries with drop_code set (0: none)
        size_t n_pending;     // entries that run on a pending token
    } res[2];
    int cur;
};

mm_err mm_follow_new(mm_follow **out, int max_seqs) {
    *out = NULL;
    if (max_seqs < 1)
        return MM_EINVAL;
    mm_follow *f = calloc(1, sizeof(*f));
    if (!f)
        return MM_ENOMEM;
    f->max_seqs = max_seqs;
    const size_t n = (size_t)max_seqs;
    bool ok = true;
    for (int k = 0; k < FOLLOW_STEPS; k++) {
        struct step_rec *r = &f->ring[k];
        r->seq = calloc(n, sizeof(*r->seq));
        r->tok = calloc(n, sizeof(*r->tok));
        r->next_pos = calloc(n, sizeof(*r->next_pos));
        r->code = calloc(n, sizeof(*r->code));
        r->msg = calloc(n, sizeof(*r->msg));
        ok = ok && r->seq && r->tok && r->next_pos && r->code && r->msg;
    }
    for (int k = 0; k < 2; k++) {
        struct resolved *v = &f->res[k];
        v->rs = calloc(n, sizeof(*v->rs));
        v->rsp = calloc(n, sizeof(*v->rsp));
        v->tok = calloc(n, sizeof(*v->tok));
        v->drop_code = calloc(n, sizeof(*v->drop_code));
        v->drop_msg = calloc(n, sizeof(*v->drop_msg));
        ok = ok && v->rs && v->rsp && v->tok && v->drop_code && v->drop_msg;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&f->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (!ok) {
        mm_follow_free(f);
        return MM_ENOMEM;
    }
    *out = f;
    return MM_OK;
}

void mm_follow_free(mm_follow *f) {
    if (!f)
        return;
    for (int k = 0; k < FOLLOW_STEPS; k++) {
        struct step_rec *r = &f->ring[k];
        free(r->seq);
        free(r->tok);
        free(r->next_pos);
        free(r->code);
        free(r->msg);
    }
    for (int k = 0; k < 2; k++) {
        struct resolved *v = &f->res[k];
        free(v->rs);
        free(v->rsp);
        free(v->tok);
        free(v->drop_code);
        free(v->drop_msg);
    }
    pthread_cond_destroy(&f->cv);
    free(f);
}

// find: the newest record of step `id`, or NULL.
static struct step_rec *find(mm_follow *f, uint64_t id) {
    for (int k = 1; k <= FOLLOW_STEPS; k++) {
        struct step_rec *r = &f->ring[(f->head - k + FOLLOW_STEPS) % FOLLOW_STEPS];
        if (r->used && r->step_id == id)
            return r;
    }
    return NULL;
}

void mm_follow_arrived(mm_follow *f, uint64_t step_id) {
    f->seen[f->seen_head] = step_id;
    f->seen_head = (f->seen_head + 1) % FOLLOW_SEEN;
    pthread_cond_broadcast(&f->cv);
}

static bool seen(const mm_follow *f, uint64_t id) {
    for (int k = 0; k < FOLLOW_SEEN; k++)
        if (f->seen[k] == id && id != 0)
            return true;
    return false;
}

mm_err mm_follow_wait(mm_follow *f, pthread_mutex_t *mu, uint64_t after, int timeout_ms,
                      char *msg, size_t msg_len) {
    if (find(f, after))
        return MM_OK;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    const int ms = timeout_ms > 0 ? timeout_ms : 1;
    const struct timespec until = mm_timespec_add_ms(now, ms),
                          arrive = mm_timespec_add_ms(now, ms < ARRIVE_MS ? ms : ARRIVE_MS);
    while (!find(f, after)) {
        // A step that never reached the router (a plan sent just before a router restart, or
        // lost) is given up on quickly; one that arrived may run up to the step's deadline.
        const bool arrived = seen(f, after);
        if (pthread_cond_timedwait(&f->cv, mu, arrived ? &until : &arrive) != ETIMEDOUT ||
            find(f, after))
            continue;
        if (!arrived && !seen(f, after)) {
            snprintf(msg, msg_len, "the plan runs after step %llu, which did not reach the "
                     "router within %d ms (sent before a router restart, or lost)",
                     (unsigned long long)after, ms < ARRIVE_MS ? ms : ARRIVE_MS);
            return MM_ETIMEDOUT;
        }
        if (arrived) {
            snprintf(msg, msg_len, "the plan runs after step %llu, which has not run within "
                     "%d ms (or is older than the last %d steps)", (unsigned long long)after, ms,
                     FOLLOW_STEPS);
            return MM_ETIMEDOUT;
        }
    }
    return MM_OK;
}

// drop: entry i of the resolved plan runs no row, answered with (code, why).
static void drop(struct resolved *v, size_t i, int32_t code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void drop(struct resolved *v, size_t i, int32_t code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->drop_msg[i], FOLLOW_MSG, fmt, ap);
    va_end(ap);
    v->drop_code[i] = code;
    v->n_resolved++;
}

const Mmctl__StepPlan *mm_follow_resolve(mm_follow *f, const Mmctl__StepPlan *p, int max_ctx) {
    f->cur ^= 1; // (the other set may hold the plan of the step still answering)
    struct resolved *v = &f->res[f->cur];
    v->n_resolved = 0;
    v->n_pending = 0;
    bool any = false;
    for (size_t i = 0; i < p->n_seqs && !any; i++)
        any = p->seqs[i]->follow;
    if (!any || p->n_seqs > (size_t)f->max_seqs) // (too many seqs: check_plan refuses it)
        return p;
    const struct step_rec *rec = find(f, p->after_step);
    v->rp = *p;
    v->rp.seqs = v->rsp;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        Mmctl__SeqStep *o = &v->rs[i];
        *o = *q; // shallow: tokens and sampling stay the plan's
        v->rsp[i] = o;
        v->drop_code[i] = 0;
        if (!q->follow)
            continue;
        o->tokens = &v->tok[i]; // (a dropped entry: 0 tokens at a valid address, for memcpy)
        const unsigned long long id = (unsigned long long)q->seq_id,
                                 after = (unsigned long long)p->after_step;
        size_t j = rec && i < rec->n && rec->seq[i] == q->seq_id ? i : (size_t)-1;
        for (size_t k = 0; rec && j == (size_t)-1 && k < rec->n; k++)
            if (rec->seq[k] == q->seq_id)
                j = k;
        if (!rec || j == (size_t)-1) {
            drop(v, i, MM_EINVAL, "seq %llu follows step %llu but was not in it", id, after);
            continue;
        }
        if (rec->code[j] != 0) {
            drop(v, i, rec->code[j], "seq %llu: dropped, it failed at step %llu: %s", id, after,
                 rec->msg[j]);
            continue;
        }
        if (rec->tok[j] < 0 && !MM_FOLLOW_IS_PENDING(rec->tok[j])) {
            drop(v, i, MM_EINVAL, "seq %llu follows step %llu but sampled no token there", id,
                 after);
            continue;
        }
        const uint32_t pos = rec->next_pos[j];
        o->pos = pos; // (also for a dropped entry: the drafting state sees the seq go on)
        if (q->end_pos != 0 && pos >= q->end_pos) {
            drop(v, i, MM_ECANCELED, "seq %llu: dropped at position %u (its end position %u: "
                 "the client ends it)", id, pos, q->end_pos);
            continue;
        }
        if ((int64_t)pos + 1 > (int64_t)max_ctx) {
            drop(v, i, MM_EINVAL, "seq %llu: position %u is at the context limit %d", id, pos,
                 max_ctx);
            continue;
        }
        v->tok[i] = rec->tok[j];
        o->n_tokens = 1;
        v->n_pending += MM_FOLLOW_IS_PENDING(rec->tok[j]);
        // draft rows stay before end_pos: the client reserved KV up to it (the client could
        // not bound max_draft by the tokens its pending step may still add)
        if (q->end_pos != 0 && o->max_draft > q->end_pos - pos - 1)
            o->max_draft = q->end_pos - pos - 1;
    }
    return &v->rp;
}

const char *mm_follow_dropped(const mm_follow *f, size_t i, int32_t *code) {
    const struct resolved *v = &f->res[f->cur];
    if (v->n_resolved == 0 || i >= (size_t)f->max_seqs || v->drop_code[i] == 0)
        return NULL;
    if (code)
        *code = v->drop_code[i];
    return v->drop_msg[i];
}

size_t mm_follow_n_pending(const mm_follow *f) { return f->res[f->cur].n_pending; }

void mm_follow_set_tokens(mm_follow *f, uint64_t step_id, const int32_t *picks, size_t n) {
    struct step_rec *r = find(f, step_id);
    if (!r)
        return;
    for (size_t i = 0; i < r->n; i++)
        if (r->code[i] == 0 && MM_FOLLOW_IS_PENDING(r->tok[i])) {
            const int64_t k = MM_FOLLOW_PICK(r->tok[i]);
            r->tok[i] = k < (int64_t)n ? picks[k] : -1; // (none: "sampled no token")
        }
    pthread_cond_broadcast(&f->cv);
}

void mm_follow_fail(mm_follow *f, uint64_t step_id, int32_t code, const char *msg) {
    struct step_rec *r = find(f, step_id);
    if (!r)
        return;
    for (size_t i = 0; i < r->n; i++)
        if (r->code[i] == 0) {
            r->code[i] = code ? code : MM_EINVAL;
            r->tok[i] = -1;
            snprintf(r->msg[i], FOLLOW_MSG, "%s", msg && msg[0] ? msg : "the step failed");
        }
    pthread_cond_broadcast(&f->cv);
}

void mm_follow_record(mm_follow *f, const Mmctl__StepPlan *p, Mmctl__SeqResult *const *res,
                      size_t n_res, uint32_t whole_code, const char *whole_msg) {
    struct step_rec *r = &f->ring[f->head];
    f->head = (f->head + 1) % FOLLOW_STEPS;
    r->used = true;
    r->step_id = p->step_id;
    r->n = p->n_seqs < (size_t)f->max_seqs ? p->n_seqs : (size_t)f->max_seqs;
    for (size_t i = 0; i < r->n; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        r->seq[i] = q->seq_id;
        r->tok[i] = -1;
        r->next_pos[i] = 0;
        r->code[i] = 0;
        if (n_res != p->n_seqs || res == NULL) { // the whole step failed
            r->code[i] = whole_code ? (int32_t)whole_code : MM_EINVAL;
            snprintf(r->msg[i], FOLLOW_MSG, "%s", whole_msg && whole_msg[0] ? whole_msg
                                                                          : "the step failed");
            continue;
        }
        const Mmctl__SeqResult *s = res[i];
        if (s->error_code != 0) {
            r->code[i] = (int32_t)s->error_code;
            snprintf(r->msg[i], FOLLOW_MSG, "%s", s->error ? s->error : "");
            continue;
        }
        r->tok[i] = s->n_more > 0 ? s->more[s->n_more - 1] : s->token; // (or MM_FOLLOW_PENDING)
        r->next_pos[i] = q->pos + (uint32_t)q->n_tokens + (uint32_t)s->n_more;
    }
    pthread_cond_broadcast(&f->cv);
}
