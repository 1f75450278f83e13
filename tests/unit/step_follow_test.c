// SPDX-License-Identifier: MIT
// Unit tests of the router's pipelined plans (services/router/step_follow.c): a follow entry
// takes the last token and next position the router recorded for its seq at the plan's
// after_step (sampled token, or the last accepted draft); entries that cannot run are dropped
// with an error naming why (failed before, sampled nothing, not in the step, end position,
// context limit); plans wait for their after_step, with a deadline; old steps are forgotten.
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "../../services/router/step_follow.c"
#include "mm/time.h"
#include "mm_test.h"

#define N 8

struct plan {
    Mmctl__StepPlan p;
    Mmctl__SeqStep s[N];
    Mmctl__SeqStep *sp[N];
    int32_t tok[N][4];
};

static void plan_init(struct plan *pl, uint64_t step_id, uint64_t after) {
    memset(pl, 0, sizeof(*pl));
    mmctl__step_plan__init(&pl->p);
    pl->p.step_id = step_id;
    pl->p.after_step = after;
    pl->p.seqs = pl->sp;
}

// add: a seq with n tokens from `first` at pos (n 0: a follow entry with end_pos).
static Mmctl__SeqStep *add(struct plan *pl, uint64_t id, uint32_t pos, int n, int32_t first,
                           uint32_t end_pos) {
    size_t i = pl->p.n_seqs++;
    Mmctl__SeqStep *q = &pl->s[i];
    mmctl__seq_step__init(q);
    q->seq_id = id;
    q->sample = true;
    if (n == 0) {
        q->follow = true;
        q->end_pos = end_pos;
    } else {
        q->pos = pos;
        for (int k = 0; k < n; k++)
            pl->tok[i][k] = first + k;
        q->tokens = pl->tok[i];
        q->n_tokens = (size_t)n;
    }
    pl->sp[i] = q;
    return q;
}

struct results {
    Mmctl__SeqResult r[N];
    Mmctl__SeqResult *rp[N];
    int32_t more[N][4];
};

static void result(struct results *rs, size_t i, uint64_t id, int32_t token, uint32_t code,
                   const char *err, int n_more, int32_t more0) {
    Mmctl__SeqResult *r = &rs->r[i];
    mmctl__seq_result__init(r);
    r->seq_id = id;
    r->token = token;
    r->error_code = code;
    r->error = (char *)err;
    for (int k = 0; k < n_more; k++)
        rs->more[i][k] = more0 + k;
    r->more = rs->more[i];
    r->n_more = (size_t)n_more;
    rs->rp[i] = r;
}

static void test_resolve(void) {
    mm_follow *f = NULL;
    MM_PASS(mm_follow_new(&f, N));
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    char msg[256] = "";
    // step 10: seq 1 decodes (pos 4), 2 fails, 3 is a prompt chunk that samples nothing,
    // 4 decodes with 2 accepted drafts, 6 decodes at the context's last position
    struct plan a;
    plan_init(&a, 10, 0);
    add(&a, 1, 4, 1, 100, 0);
    add(&a, 2, 7, 1, 200, 0);
    add(&a, 3, 0, 3, 300, 0)->sample = false;
    add(&a, 4, 9, 1, 400, 0);
    add(&a, 6, 31, 1, 600, 0);
    MM_TRUE(mm_follow_resolve(f, &a.p, 32) == &a.p); // no follow entry: the plan itself
    MM_NULL(mm_follow_dropped(f, 0, NULL));
    struct results ra;
    result(&ra, 0, 1, 11, 0, "", 0, 0);
    result(&ra, 1, 2, -1, MM_EPEERDOWN, "expert owner 1 is down", 0, 0);
    result(&ra, 2, 3, -1, 0, "", 0, 0);
    result(&ra, 3, 4, 41, 0, "", 2, 42);
    result(&ra, 4, 6, 61, 0, "", 0, 0);
    pthread_mutex_lock(&mu);
    MM_FAIL(mm_follow_wait(f, &mu, 10, 20, msg, sizeof(msg)), MM_ETIMEDOUT);
    MM_TRUE(strstr(msg, "step 10") != NULL);
    mm_follow_record(f, &a.p, ra.rp, 5, 0, "");
    MM_PASS(mm_follow_wait(f, &mu, 10, 20, msg, sizeof(msg)));
    pthread_mutex_unlock(&mu);

    // step 11 after 10, in another order: follow entries of each kind, a new seq, an end position
    struct plan b;
    plan_init(&b, 11, 10);
    add(&b, 4, 0, 0, 0, 0);
    add(&b, 1, 0, 0, 0, 0);
    add(&b, 2, 0, 0, 0, 0);
    add(&b, 3, 0, 0, 0, 0);
    add(&b, 5, 0, 0, 0, 0);  // not in step 10
    add(&b, 7, 0, 2, 700, 0); // an ordinary entry
    add(&b, 6, 0, 0, 0, 0);  // at the context limit
    const Mmctl__StepPlan *r = mm_follow_resolve(f, &b.p, 32);
    MM_TRUE(r != &b.p);
    MM_EQ(r->n_seqs, 7);
    MM_EQ(r->step_id, 11);
    int32_t code = 0;
    // seq 4: the last accepted draft (43) at 9 + 1 + 2
    MM_NULL(mm_follow_dropped(f, 0, NULL));
    MM_EQ(r->seqs[0]->n_tokens, 1);
    MM_EQ(r->seqs[0]->tokens[0], 43);
    MM_EQ(r->seqs[0]->pos, 12);
    MM_NULL(mm_follow_dropped(f, 1, NULL));
    MM_EQ(r->seqs[1]->tokens[0], 11);
    MM_EQ(r->seqs[1]->pos, 5);
    const char *d = mm_follow_dropped(f, 2, &code);
    MM_TRUE(d && strstr(d, "failed at step 10") && strstr(d, "expert owner 1 is down"));
    MM_EQ(code, MM_EPEERDOWN);
    MM_EQ(r->seqs[2]->n_tokens, 0);
    MM_TRUE(r->seqs[2]->tokens != NULL); // (memcpy of 0 tokens from it is defined)
    d = mm_follow_dropped(f, 3, &code);
    MM_TRUE(d && strstr(d, "sampled no token"));
    MM_EQ(code, MM_EINVAL);
    d = mm_follow_dropped(f, 4, &code);
    MM_TRUE(d && strstr(d, "was not in it"));
    MM_NULL(mm_follow_dropped(f, 5, NULL));
    MM_TRUE(r->seqs[5] == b.p.seqs[5] || r->seqs[5]->tokens == b.p.seqs[5]->tokens);
    MM_EQ(r->seqs[5]->tokens[1], 701);
    d = mm_follow_dropped(f, 6, &code);
    MM_TRUE(d && strstr(d, "context limit 32"));
    // the plan as sent is untouched (its arrays are freed by protobuf-c)
    MM_EQ(b.p.seqs[0]->n_tokens, 0);
    MM_TRUE(b.p.seqs[0]->tokens == NULL);

    // end position: seq 1 goes on at 5; an entry ending there is dropped (canceled)
    struct plan c;
    plan_init(&c, 12, 10);
    add(&c, 1, 0, 0, 0, 5);
    add(&c, 4, 0, 0, 0, 14)->max_draft = 4;
    r = mm_follow_resolve(f, &c.p, 32);
    d = mm_follow_dropped(f, 0, &code);
    MM_TRUE(d && strstr(d, "end position 5"));
    MM_EQ(code, MM_ECANCELED);
    MM_NULL(mm_follow_dropped(f, 1, NULL));
    MM_EQ(r->seqs[1]->pos, 12);
    MM_EQ(r->seqs[1]->max_draft, 1); // a draft row at 13 only: 14 is the end position
    MM_EQ(c.p.seqs[1]->max_draft, 4);

    // a whole step refused: its follow entries are dropped with its message
    struct plan e;
    plan_init(&e, 13, 0);
    add(&e, 1, 5, 1, 11, 0);
    mm_follow_record(f, &e.p, NULL, 0, MM_EINVAL, "plan has 9 seqs");
    struct plan g;
    plan_init(&g, 14, 13);
    add(&g, 1, 0, 0, 0, 0);
    mm_follow_resolve(f, &g.p, 32);
    d = mm_follow_dropped(f, 0, &code);
    MM_TRUE(d && strstr(d, "plan has 9 seqs"));
    MM_EQ(code, MM_EINVAL);
    // a plan without follow entries clears the last plan's drops
    mm_follow_resolve(f, &a.p, 32);
    MM_NULL(mm_follow_dropped(f, 0, NULL));

    // the ring keeps the last 8 steps: step 10 is forgotten after 8 more
    for (uint64_t s = 20; s < 28; s++) {
        struct plan x;
        plan_init(&x, s, 0);
        mm_follow_record(f, &x.p, NULL, 0, 0, "");
    }
    pthread_mutex_lock(&mu);
    MM_FAIL(mm_follow_wait(f, &mu, 10, 10, msg, sizeof(msg)), MM_ETIMEDOUT);
    MM_PASS(mm_follow_wait(f, &mu, 27, 10, msg, sizeof(msg)));
    pthread_mutex_unlock(&mu);
    mm_follow_free(f);
}

struct waiter {
    mm_follow *f;
    pthread_mutex_t *mu;
    mm_err rv;
    uint64_t waited_ms;
};

static void *wait_main(void *arg) {
    struct waiter *w = arg;
    char msg[256];
    pthread_mutex_lock(w->mu);
    uint64_t t0 = mm_now_ms();
    w->rv = mm_follow_wait(w->f, w->mu, 77, 5000, msg, sizeof(msg));
    w->waited_ms = mm_now_ms() - t0;
    pthread_mutex_unlock(w->mu);
    return NULL;
}

// A plan that arrives before its after_step waits (the mutex free meanwhile) and goes on as
// soon as that step is recorded.
static void test_wait_order(void) {
    mm_follow *f = NULL;
    MM_PASS(mm_follow_new(&f, N));
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    struct waiter w = {.f = f, .mu = &mu, .rv = MM_EINVAL};
    pthread_t th;
    MM_EQ(pthread_create(&th, NULL, wait_main, &w), 0);
    usleep(50000);
    pthread_mutex_lock(&mu); // free: the waiter released it
    struct plan a;
    plan_init(&a, 77, 0);
    mm_follow_record(f, &a.p, NULL, 0, 0, "");
    pthread_mutex_unlock(&mu);
    pthread_join(th, NULL);
    MM_PASS(w.rv);
    MM_TRUE(w.waited_ms < 4000);
    mm_follow_free(f);
}

// A plan whose after_step never reaches the router (sent before a restart) is refused after
// about 2 s, not the step's whole deadline; one whose step arrived waits for it to run.
static void test_wait_never_arrived(void) {
    mm_follow *f = NULL;
    MM_PASS(mm_follow_new(&f, N));
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    char msg[256] = "";
    pthread_mutex_lock(&mu);
    uint64_t t0 = mm_now_ms();
    MM_FAIL(mm_follow_wait(f, &mu, 5, 20000, msg, sizeof(msg)), MM_ETIMEDOUT);
    uint64_t dt = mm_now_ms() - t0;
    MM_TRUE(dt >= 1900 && dt < 10000);
    MM_TRUE(strstr(msg, "did not reach the router") != NULL);
    mm_follow_arrived(f, 6); // arrived, never recorded: the whole deadline, then "has not run"
    MM_FAIL(mm_follow_wait(f, &mu, 6, 100, msg, sizeof(msg)), MM_ETIMEDOUT);
    MM_TRUE(strstr(msg, "has not run within 100 ms") != NULL);
    pthread_mutex_unlock(&mu);
    mm_follow_free(f);
}

// A step whose picks are still on the device records pending tokens (MM_FOLLOW_PENDING(k): pick
// k): a plan that follows it resolves at once, its entries carrying those (the router embeds
// the device's picks for them); the step before's resolved plan stays valid while it answers;
// the record then becomes final (the picks' tokens) or failed (its followers dropped).
static void test_pending(void) {
    mm_follow *f = NULL;
    MM_PASS(mm_follow_new(&f, N));
    struct plan a; // step 30: seqs 1, 2, 3 decode; 4 is a prompt chunk (samples nothing)
    plan_init(&a, 30, 0);
    add(&a, 1, 4, 1, 100, 0);
    add(&a, 2, 7, 1, 200, 0);
    add(&a, 4, 0, 3, 400, 0)->sample = false;
    add(&a, 3, 9, 1, 300, 0);
    struct results ra;
    result(&ra, 0, 1, MM_FOLLOW_PENDING(0), 0, "", 0, 0);
    result(&ra, 1, 2, MM_FOLLOW_PENDING(1), 0, "", 0, 0);
    result(&ra, 2, 4, -1, 0, "", 0, 0);
    result(&ra, 3, 3, MM_FOLLOW_PENDING(2), 0, "", 0, 0);
    mm_follow_record(f, &a.p, ra.rp, 4, 0, "");
    struct plan b; // step 31 follows 30 in another order, with a new seq and the chunk's seq
    plan_init(&b, 31, 30);
    add(&b, 3, 0, 0, 0, 0);
    add(&b, 9, 0, 2, 900, 0);
    add(&b, 1, 0, 0, 0, 0);
    add(&b, 4, 0, 0, 0, 0); // sampled nothing at 30: dropped
    add(&b, 2, 0, 0, 0, 0);
    const Mmctl__StepPlan *rb = mm_follow_resolve(f, &b.p, 64);
    MM_EQ(mm_follow_n_pending(f), 3);
    MM_EQ(rb->seqs[0]->tokens[0], MM_FOLLOW_PENDING(2));
    MM_EQ(rb->seqs[0]->pos, 10);
    MM_EQ(rb->seqs[1]->tokens[0], 900);
    MM_EQ(rb->seqs[2]->tokens[0], MM_FOLLOW_PENDING(0));
    MM_EQ(rb->seqs[2]->pos, 5);
    MM_TRUE(mm_follow_dropped(f, 3, NULL) != NULL);
    MM_EQ(rb->seqs[4]->tokens[0], MM_FOLLOW_PENDING(1));
    MM_TRUE(MM_FOLLOW_IS_PENDING(MM_FOLLOW_PENDING(0)) && !MM_FOLLOW_IS_PENDING(-1) &&
            MM_FOLLOW_PICK(MM_FOLLOW_PENDING(7)) == 7);
    // the picks arrive: step 30's record is final; a plan resolved now gets the tokens, and
    // step 31's resolved plan (still running) is untouched by that resolve
    const int32_t picks[3] = {11, 21, 31};
    mm_follow_set_tokens(f, 30, picks, 3);
    struct plan c;
    plan_init(&c, 32, 30);
    add(&c, 2, 0, 0, 0, 0);
    add(&c, 1, 0, 0, 0, 0);
    add(&c, 3, 0, 0, 0, 0);
    const Mmctl__StepPlan *rc = mm_follow_resolve(f, &c.p, 64);
    MM_EQ(mm_follow_n_pending(f), 0);
    MM_EQ(rc->seqs[0]->tokens[0], 21);
    MM_EQ(rc->seqs[1]->tokens[0], 11);
    MM_EQ(rc->seqs[2]->tokens[0], 31);
    MM_EQ(rb->seqs[0]->tokens[0], MM_FOLLOW_PENDING(2)); // step 31's own copy
    MM_EQ(rb->seqs[2]->seq_id, 1);
    // pending again (step 33), then failed: its followers are dropped with the message
    struct plan d;
    plan_init(&d, 33, 0);
    add(&d, 1, 5, 1, 11, 0);
    struct results rd;
    result(&rd, 0, 1, MM_FOLLOW_PENDING(0), 0, "", 0, 0);
    mm_follow_record(f, &d.p, rd.rp, 1, 0, "");
    struct plan h;
    plan_init(&h, 35, 33);
    add(&h, 1, 0, 0, 0, 0);
    mm_follow_resolve(f, &h.p, 64);
    MM_EQ(mm_follow_n_pending(f), 1);
    mm_follow_fail(f, 33, MM_EDEVICE, "reading step 33's picks from the device failed");
    mm_follow_resolve(f, &h.p, 64);
    int32_t code = 0;
    const char *why = mm_follow_dropped(f, 0, &code);
    MM_TRUE(why && strstr(why, "failed at step 33") && strstr(why, "picks from the device"));
    MM_EQ(code, MM_EDEVICE);
    MM_EQ(mm_follow_n_pending(f), 0);
    // a pick the step did not make (set_tokens with fewer picks): "sampled no token"
    mm_follow_record(f, &d.p, rd.rp, 1, 0, "");
    mm_follow_set_tokens(f, 33, picks, 0);
    mm_follow_resolve(f, &h.p, 64);
    why = mm_follow_dropped(f, 0, NULL);
    MM_TRUE(why && strstr(why, "sampled no token"));
    mm_follow_free(f);
}

MM_TESTS = {
    {"router pipelined plans: pending device picks, followed at once, then final or failed",
     test_pending},
    {"router pipelined plans: follow entries resolved from the step before, drops named",
     test_resolve},
    {"router pipelined plans: a plan waits for its after_step", test_wait_order},
    {"router pipelined plans: an after_step that never arrives is given up in 2 s",
     test_wait_never_arrived},
    {NULL, NULL},
};
