// SPDX-License-Identifier: MIT
// The gateway's step scheduler; see gateway.h (sched.c section) and docs/MESH.md.
//
// Design notes:
// - Everything runs on the loop thread; the only asynchronous event is the StepResult (through
//   mesh.c's wake-up). One plan in flight at a time, or two with --pipeline-plans: the next
//   plan goes out as soon as the previous one is sent (StepPlan.after_step), its decode seqs
//   following the router's own picks (SeqStep.follow), so the router starts the next step
//   without waiting for this loop and the nng round trip. Results come in plan order
//   (mesh.c). A seq that ends while a later plan holds it stays referenced (state DONE, not
//   dropped) until that plan's result is in; its entry there is dropped or its extra token
//   ignored, and its release rides with the plan after.
// - Lists: `waiting` (FCFS queue) and `running` (admission order), doubly linked through the
//   seqs themselves; each plan in flight maps back to its seqs (plan order).
// - Seq ids: id % shards is the seq's attention shard (docs/MESH.md), so the scheduler picks
//   the shard with room at admission and makes the id land there: id = base * shards + shard,
//   base increasing from the start time in microseconds (never reused, even across restarts).
// - The shard count: the router's (StatusReply.attention_shards, gw_sched_router_limits) unless
//   --attention-shards fixes it. Until the router has said it, nothing is admitted (requests
//   wait); a router that comes back with another count fails the running seqs at once (their
//   ids map to shards of the old count: the router routes them by the new one, and the shards
//   would refuse their positions) and pauses admission until the plans in flight are answered,
//   then KV admission starts over from the new shards' statements (adopt_shards). A shard that
//   lived through the change keeps the failed seqs' KV until it restarts (their releases would
//   be routed by the new count).
// - KV admission per shard by what the shard states (gw_sched_shard_report; gateway.h): a
//   shard's `cap` blocks, `max_seqs` and `max_ctx` start unknown (nothing admitted there) and
//   follow each statement; `used` counts the blocks of its running seqs, so a shard that
//   rejoins smaller than what it runs admits nothing until enough of them end.
// - No allocation per step: the plan builders, the plans' seq arrays and the release list are
//   sized once.
#include <stdlib.h>
#include <string.h>

#include "gateway.h"
#include "mm/log.h"
#include "mm/step.h"
#include "mm/time.h"

#define MAX_RELEASE 4096

struct list {
    gw_seq *head, *tail;
    int n;
};

struct plan { // a plan in flight
    gw_sched *s;
    gw_call *call;
    uint64_t step_id;
    int n;
    gw_seq **seqs; // (max_step_seqs) plan order
    int *chunk;    // (max_step_seqs) tokens of each entry (a follow entry: 1)
};

enum shard_state { SH_UNKNOWN, SH_STATED, SH_FALLBACK, SH_BAD };

struct shard {
    int seqs;            // running seqs placed here
    int64_t used;        // their KV blocks
    int64_t cap;         // KV blocks admission may use (0: admits nothing)
    int max_seqs;        // seqs admission may place here
    int max_ctx;         // the longest seq it holds
    int state;           // enum shard_state
    mm_kv_capacity rep;  // what it last stated (a change is logged once)
};

struct gw_sched {
    gw_sched_conf c;
    gw_mesh *mesh;
    gw_sched_ops ops;
    void *arg;
    struct list waiting, running;
    struct shard *sh;         // (n_sh)
    int n_sh;                 // attention shards admission places seqs on (0: not known yet)
    int want_sh;              // the router's new count, adopted once nothing runs (0: none)
    uint64_t next_base, step_id;
    mm_step_builder *b[2];    // one per plan slot: a plan's envelope is borrowed until its
                              // result (mesh.c's sender thread packs it later)
    struct plan fl[2];        // plans in flight: fl[head] the oldest (slots never move: a
    int head, n_fl;           // call's arg points at its slot)
    uint64_t release[MAX_RELEASE];
    int n_release;
    bool stopped;
    bool shards_warned; // the router's shard count differs from --attention-shards
    int paused_for;     // the count a pause of admission was logged for (adopt_shards)
    uint64_t steps, step_errors;
};

static void list_push(struct list *l, gw_seq *q) {
    q->next = NULL;
    q->prev = l->tail;
    if (l->tail)
        l->tail->next = q;
    else
        l->head = q;
    l->tail = q;
    l->n++;
}

static void list_remove(struct list *l, gw_seq *q) {
    if (q->prev)
        q->prev->next = q->next;
    else
        l->head = q->next;
    if (q->next)
        q->next->prev = q->prev;
    else
        l->tail = q->prev;
    q->next = q->prev = NULL;
    l->n--;
}

static int64_t blocks_for(const gw_sched *s, int n_tokens) {
    return (n_tokens + s->c.block_size - 1) / s->c.block_size;
}

mm_err gw_sched_new(gw_sched **out, const gw_sched_conf *c, gw_mesh *mesh,
                    const gw_sched_ops *ops, void *arg, char err[MM_ERRLEN]) {
    *out = NULL;
    if (c->max_waiting < 0 || c->max_step_seqs < 1 || c->max_step_tokens < 1 || c->shards < 0 ||
        c->shards > GW_MAX_SHARDS ||
        c->shard_max_seqs < 0 || !(c->kv_mb >= 0) || c->block_size < 1 ||
        c->max_ctx < 2 || c->step_timeout_ms < 1)
        return mm_errf(err, MM_EINVAL, "scheduler: --max-waiting, --shard-max-seqs, --kv-mb >= 0, "
                       "--attention-shards 0..%d (0: the router's), --max-step-seqs, "
                       "--max-batch-tokens, --step-timeout-ms >= 1 and --max-ctx >= 2 are "
                       "required", GW_MAX_SHARDS);
    if (c->fallback_kv_blocks < 1 || c->fallback_max_seqs < 1)
        return mm_errf(err, MM_EINVAL, "scheduler: the KV budget for shards that state none "
                       "(--kv-mb, --kv-dtype) holds no KV block of this model");
    gw_sched *s = calloc(1, sizeof(*s));
    if (!s)
        return MM_ENOMEM;
    s->c = *c;
    s->mesh = mesh;
    s->ops = *ops;
    s->arg = arg;
    // Ids from the start time in microseconds x 256: a restarted (or second) gateway never
    // reuses an id the shards may still hold.
    s->next_base = (mm_now_ns() / 1000) << 8;
    s->n_sh = c->shards; // (0: the router's, when it says)
    s->sh = calloc((size_t)(c->shards > 0 ? c->shards : 1), sizeof(*s->sh));
    bool ok = s->sh != NULL;
    for (int k = 0; k < 2 && ok; k++) {
        s->fl[k].seqs = calloc((size_t)c->max_step_seqs, sizeof(*s->fl[k].seqs));
        s->fl[k].chunk = calloc((size_t)c->max_step_seqs, sizeof(*s->fl[k].chunk));
        ok = s->fl[k].seqs && s->fl[k].chunk &&
             mm_step_builder_new(&s->b[k], (uint32_t)c->max_step_seqs, MAX_RELEASE) == MM_OK;
    }
    if (!ok) {
        gw_sched_free(s);
        return MM_ENOMEM;
    }
    *out = s; // (every shard SH_UNKNOWN: nothing is admitted before a statement)
    return MM_OK;
}

void gw_sched_free(gw_sched *s) {
    if (!s)
        return;
    for (int k = 0; k < s->n_fl; k++)
        if (s->fl[(s->head + k) % 2].call)
            gw_call_detach(s->fl[(s->head + k) % 2].call);
    for (int k = 0; k < 2; k++) {
        mm_step_builder_free(s->b[k]);
        free(s->fl[k].seqs);
        free(s->fl[k].chunk);
    }
    free(s->sh);
    free(s);
}

mm_err gw_sched_check(const gw_sched *s, int n_prompt, int max_gen, char err[MM_ERRLEN]) {
    if (n_prompt < 1)
        return mm_errf(err, MM_EINVAL, "the prompt is empty (it must have at least one token)");
    if ((int64_t)n_prompt + max_gen > s->c.max_ctx)
        return mm_errf(err, MM_EINVAL,
                       "this model's maximum context length is %d tokens; the request has %d "
                       "prompt tokens and asks for %d more", s->c.max_ctx, n_prompt, max_gen);
    bool known = false;
    for (int i = 0; i < s->n_sh && !known; i++)
        known = s->sh[i].state != SH_UNKNOWN;
    // (no shard's capacity known yet: the seq waits, and fails then if none can hold it)
    if (known && (int64_t)n_prompt + max_gen > gw_sched_seq_kv_tokens(s))
        return mm_errf(err, MM_EINVAL,
                       "the request needs %d tokens of KV cache; one attention shard holds %lld",
                       n_prompt + max_gen, (long long)gw_sched_seq_kv_tokens(s));
    return MM_OK;
}

// shard_seq_tokens: the most tokens one seq may have on shard h.
static int64_t shard_seq_tokens(const gw_sched *s, const struct shard *h) {
    if (h->max_seqs < 1)
        return 0;
    int64_t t = h->cap * s->c.block_size;
    return t < h->max_ctx ? t : h->max_ctx;
}

int64_t gw_sched_seq_kv_tokens(const gw_sched *s) {
    int64_t best = -1;
    for (int i = 0; i < s->n_sh; i++)
        if (s->sh[i].state != SH_UNKNOWN && shard_seq_tokens(s, &s->sh[i]) > best)
            best = shard_seq_tokens(s, &s->sh[i]);
    return best < 0 ? s->c.max_ctx : best;
}

// fits_ever: some shard could hold q once its other seqs end (or a shard is still unknown).
static bool fits_ever(const gw_sched *s, const gw_seq *q) {
    if (s->n_sh == 0 || s->want_sh > 0)
        return true; // the shards are not known yet
    for (int i = 0; i < s->n_sh; i++) {
        const struct shard *h = &s->sh[i];
        if (h->state == SH_UNKNOWN ||
            (h->max_seqs >= 1 && h->cap >= q->kv_blocks &&
             (int64_t)q->n_prompt + q->max_gen <= h->max_ctx))
            return true;
    }
    return false;
}

static void kick(gw_sched *s);

mm_err gw_sched_submit(gw_sched *s, gw_seq **seqs, int n, char err[MM_ERRLEN]) {
    if (s->stopped)
        return mm_errf(err, MM_ECLOSED, "the gateway is shutting down");
    if (s->waiting.n + n > s->c.max_waiting)
        return mm_errf(err, MM_EFULL, "the request queue is full (%d waiting, --max-waiting %d)",
                       s->waiting.n, s->c.max_waiting);
    for (int i = 0; i < n; i++)
        MM_TRY(gw_sched_check(s, seqs[i]->n_prompt, seqs[i]->max_gen, err));
    uint64_t now = mm_now_ns();
    for (int i = 0; i < n; i++) {
        gw_seq *q = seqs[i];
        q->state = GW_SEQ_WAITING;
        q->n_tokens = q->n_prompt;
        q->pos = q->ppos = q->n_gen = q->in_plans = 0;
        q->sample_in = 0;
        q->cancelled = q->ever_planned = false;
        q->kv_blocks = blocks_for(s, q->n_prompt + q->max_gen);
        q->t_submit_ns = now;
        q->t_first_ns = q->t_last_ns = 0;
        list_push(&s->waiting, q);
    }
    kick(s);
    return MM_OK;
}

// finish: q leaves the running set (its KV is released in the next plan) and is dropped, once
// no plan in flight holds it.
static void finish(gw_sched *s, gw_seq *q) {
    if (q->state == GW_SEQ_RUNNING) {
        list_remove(&s->running, q);
        s->sh[q->shard].seqs--;
        s->sh[q->shard].used -= q->kv_blocks;
        if (q->ever_planned) {
            if (s->n_release < MAX_RELEASE)
                s->release[s->n_release++] = q->id;
            else
                mm_log_warn("release list full: seq %llu's KV stays until its shard restarts",
                            (unsigned long long)q->id);
        }
    } else if (q->state == GW_SEQ_WAITING) {
        list_remove(&s->waiting, q);
    }
    q->state = GW_SEQ_DONE;
    if (q->in_plans == 0)
        s->ops.dropped(s->arg, q);
}

static void fail_seq(gw_sched *s, gw_seq *q, mm_err code, const char *msg);

// adopt_shards takes the router's new shard count (want_sh) once no seq of the old count runs
// or rides in a plan in flight: fresh shard records (nothing admitted before their statements,
// which the same status answer brings, or the next one for an adoption deferred to kick), and
// the old count's pending releases dropped (their ids name shards of the old layout). Until
// then admission is paused (admit_one).
static void adopt_shards(gw_sched *s) {
    if (s->want_sh == 0)
        return;
    if (s->running.n > 0 || s->n_fl > 0) {
        if (s->paused_for != s->want_sh) {
            s->paused_for = s->want_sh;
            mm_log_warn("the router now has %d attention shards (the gateway counted %d): "
                        "admission paused until the %d plans in flight are answered",
                        s->want_sh, s->n_sh, s->n_fl);
        }
        return;
    }
    struct shard *sh = calloc((size_t)s->want_sh, sizeof(*sh));
    if (!sh) {
        mm_log_error("no memory for %d attention shard records: kept %d (tried again at the "
                     "next status answer)", s->want_sh, s->n_sh);
        return;
    }
    if (s->n_sh > 0)
        mm_log_warn("attention shards: %d, the router's (was %d); KV admission starts over "
                    "from their statements%s", s->want_sh, s->n_sh,
                    s->n_release > 0 ? "; the old layout's pending releases dropped" : "");
    else
        mm_log_info("attention shards: %d, the router's", s->want_sh);
    free(s->sh);
    s->sh = sh;
    s->n_sh = s->want_sh;
    s->want_sh = s->paused_for = 0;
    s->n_release = 0;
}

void gw_sched_router_limits(gw_sched *s, uint32_t max_step_seqs, uint32_t max_batch_tokens,
                            uint32_t shards) {
    // Plans within the router's limits: a plan above them would be refused whole (every seq in
    // it failed). Only ever lowered (the plan arrays are sized by the configured values).
    if (max_step_seqs > 0 && (int64_t)max_step_seqs < s->c.max_step_seqs) {
        mm_log_warn("gateway --max-step-seqs %d is above the router's %u: planning %u seqs per "
                    "step (set the gateway's flag to the router's)",
                    s->c.max_step_seqs, max_step_seqs, max_step_seqs);
        s->c.max_step_seqs = (int)max_step_seqs;
    }
    if (max_batch_tokens > 0 && (int64_t)max_batch_tokens < s->c.max_step_tokens) {
        mm_log_warn("gateway --max-batch-tokens %d is above the router's %u: planning %u tokens "
                    "per step (set the gateway's flag to the router's)",
                    s->c.max_step_tokens, max_batch_tokens, max_batch_tokens);
        s->c.max_step_tokens = (int)max_batch_tokens;
    }
    if (shards > GW_MAX_SHARDS) {
        mm_log_error("the router reports %u attention shards, above the gateway's %d: ignored",
                     shards, GW_MAX_SHARDS);
    } else if (shards > 0 && s->c.shards > 0 && (int)shards != s->c.shards) {
        if (!s->shards_warned) { // KV admission per shard would be wrong: said once, loudly
            s->shards_warned = true;
            mm_log_error("gateway --attention-shards %d differs from the router's %u: KV "
                         "admission counts the wrong shards; restart the gateway with "
                         "--attention-shards %u (or 0: the router's)", s->c.shards, shards,
                         shards);
        }
    } else if (shards > 0 && s->c.shards == 0) {
        s->want_sh = (int)shards == s->n_sh ? 0 : (int)shards;
        if (s->want_sh > 0 && s->n_sh > 0 && s->running.n > 0) {
            char msg[MM_ERRLEN];
            snprintf(msg, sizeof(msg), "the router's attention shard count changed from %d to %d: "
                     "this sequence's KV is on a shard of the old layout", s->n_sh, s->want_sh);
            mm_log_warn("%s; failing the %d running sequences", msg, s->running.n);
            for (gw_seq *q; (q = s->running.head);)
                fail_seq(s, q, MM_EPEERDOWN, msg);
        }
        adopt_shards(s);
    }
}


// prune fails the waiting seqs that no shard can ever hold (a shard restarted smaller, or
// stated a bad capacity). Not while a plan is built: ops.fail may cancel other seqs.
static void prune(gw_sched *s) {
    for (gw_seq *q = s->waiting.head; q;) {
        if (fits_ever(s, q)) {
            q = q->next;
            continue;
        }
        char msg[MM_ERRLEN];
        snprintf(msg, sizeof(msg), "the request needs %d tokens of KV cache; one attention "
                 "shard holds %lld", q->n_prompt + q->max_gen,
                 (long long)gw_sched_seq_kv_tokens(s));
        fail_seq(s, q, MM_EINVAL, msg);
        q = s->waiting.head; // (the failure may have cancelled others: start over)
    }
}

void gw_sched_shard_report(gw_sched *s, uint32_t shard, const char *name,
                           const mm_kv_capacity *kv) {
    if (shard >= (uint32_t)s->n_sh)
        return; // (a shard count other than ours: gw_sched_router_limits says so)
    struct shard *h = &s->sh[shard];
    if (h->state != SH_UNKNOWN && !memcmp(&h->rep, kv, sizeof(*kv)))
        return; // nothing new
    const bool again = h->state != SH_UNKNOWN;
    h->rep = *kv;
    char kerr[MM_ERRLEN] = "";
    mm_err krv = MM_OK;
    if (mm_kv_capacity_reported(kv)) {
        krv = mm_kv_capacity_check(kv, kerr);
        if (krv == MM_OK && kv->block_size != (uint32_t)s->c.block_size)
            krv = mm_errf(kerr, MM_EINVAL, "KV blocks of %u tokens, the gateway counts blocks "
                          "of %d", kv->block_size, s->c.block_size);
    }
    if (!mm_kv_capacity_reported(kv)) {
        h->state = SH_FALLBACK;
        h->cap = s->c.fallback_kv_blocks;
        h->max_seqs = s->c.fallback_max_seqs;
        h->max_ctx = s->c.max_ctx;
        mm_log_warn("%s states no KV capacity (a shard without --model): "
                    "admitting %lld tokens and %d seqs there, the gateway's fallback from its "
                    "--kv-mb, --kv-dtype and --shard-max-seqs", name,
                    (long long)(h->cap * s->c.block_size), h->max_seqs);
    } else if (krv != MM_OK) {
        h->state = SH_BAD;
        h->cap = 0;
        h->max_seqs = h->max_ctx = 0;
        mm_log_error("%s states a bad KV capacity: %s; not trusted: nothing is admitted on it "
                     "until it states a good one", name, kerr);
    } else {
        h->state = SH_STATED;
        h->cap = (int64_t)kv->blocks;
        h->max_seqs = (int)kv->max_seqs;
        h->max_ctx = (int)kv->max_ctx;
        const double mib = (double)kv->budget_bytes / 1048576.0;
        char note[160] = "";
        if (s->c.kv_mb > 0) {
            int64_t cap = (int64_t)(s->c.kv_mb * 1048576.0 /
                                    ((double)kv->token_bytes * kv->block_size));
            if (cap < h->cap) {
                h->cap = cap;
                snprintf(note, sizeof(note), "; lowered by the gateway's --kv-mb %g", s->c.kv_mb);
            } else if (s->c.kv_mb > mib + 1e-9) {
                mm_log_warn("gateway --kv-mb %g is above %s's %.1f MiB: admitting by the "
                            "shard's", s->c.kv_mb, name, mib);
            }
        }
        if (s->c.shard_max_seqs > 0 && s->c.shard_max_seqs < h->max_seqs) {
            h->max_seqs = s->c.shard_max_seqs;
            snprintf(note + strlen(note), sizeof(note) - strlen(note),
                     "; seqs lowered by the gateway's --shard-max-seqs %d", s->c.shard_max_seqs);
        } else if (s->c.shard_max_seqs > h->max_seqs) {
            mm_log_warn("gateway --shard-max-seqs %d is above %s's %u: admitting by the shard's",
                        s->c.shard_max_seqs, name, kv->max_seqs);
        }
        mm_log_info("%s%s: admitting %lld KV tokens (%llu stated, %u bytes per token, %.1f MiB), "
                    "%d seqs of up to %d tokens%s", name, again ? " states a new capacity" : "",
                    (long long)(h->cap * s->c.block_size),
                    (unsigned long long)(kv->blocks * kv->block_size), kv->token_bytes, mib,
                    h->max_seqs, h->max_ctx, note);
    }
    if (h->used > h->cap)
        mm_log_warn("%s holds %lld KV blocks of running seqs, above its %lld: it admits nothing "
                    "until they end", name, (long long)h->used, (long long)h->cap);
    prune(s);
    kick(s);
}

bool gw_sched_kv_ready(const gw_sched *s, char *why, size_t n) {
    int unknown = 0, bad = 0;
    if (s->n_sh == 0) {
        snprintf(why, n, "the router has not reported its attention shards yet");
        return false;
    }
    for (int i = 0; i < s->n_sh; i++) {
        const struct shard *h = &s->sh[i];
        if (h->cap > 0 && h->max_seqs > 0 && h->max_ctx > 0)
            return true;
        unknown += h->state == SH_UNKNOWN;
        bad += h->state == SH_BAD;
    }
    if (bad > 0)
        snprintf(why, n, "no attention shard has a usable KV capacity (%d stated a bad one: "
                 "see the gateway's log)", bad);
    else if (unknown > 0)
        snprintf(why, n, "no attention shard has stated its KV capacity yet");
    else
        snprintf(why, n, "no attention shard has room for a sequence (KV capacity 0)");
    return false;
}

void gw_sched_fail_waiting(gw_sched *s, mm_err code, const char *msg) {
    for (gw_seq *q; (q = s->waiting.head);)
        fail_seq(s, q, code, msg);
}

void gw_sched_cancel(gw_sched *s, gw_seq *q) {
    if (q->state == GW_SEQ_DONE || q->state == GW_SEQ_NEW)
        return;
    q->cancelled = true;
    if (q->in_plans == 0) { // not in a plan in flight: release now
        finish(s, q);
        kick(s);
    }
}

void gw_sched_get_stats(const gw_sched *s, gw_sched_stats *st) {
    st->running = s->running.n;
    st->waiting = s->waiting.n;
    st->kv_blocks_total = st->kv_blocks_used = 0;
    for (int i = 0; i < s->n_sh; i++) {
        st->kv_blocks_total += s->sh[i].cap;
        st->kv_blocks_used += s->sh[i].used;
    }
    st->steps = s->steps;
    st->step_errors = s->step_errors;
}

// admit: the waiting head moves to running when a shard has a slot and its KV; FCFS.
static gw_seq *admit_one(gw_sched *s) {
    gw_seq *q = s->waiting.head;
    if (!q || s->want_sh > 0) // (a change of the shard count: paused until adopt_shards)
        return NULL;
    int best = -1;
    int64_t best_free = 0;
    for (int i = 0; i < s->n_sh; i++) {
        const struct shard *h = &s->sh[i];
        int64_t free_blocks = h->cap - h->used;
        if (h->seqs < h->max_seqs && free_blocks >= q->kv_blocks &&
            (int64_t)q->n_prompt + q->max_gen <= h->max_ctx &&
            (best < 0 || free_blocks > best_free)) {
            best = i;
            best_free = free_blocks;
        }
    }
    if (best < 0)
        return NULL;
    list_remove(&s->waiting, q);
    q->shard = best;
    q->id = s->next_base++ * (uint64_t)s->n_sh + (uint64_t)best;
    s->sh[best].seqs++;
    s->sh[best].used += q->kv_blocks;
    q->state = GW_SEQ_RUNNING;
    list_push(&s->running, q);
    return q;
}

static void on_step(void *arg, mm_err rv, const mm_ctl_msg *reply, const char *err,
                    uint64_t t_done_ns);

// draft_window: the most draft tokens (up to 8) the router may answer for q after the
// `ahead` tokens that come first (1: the one sampled; 2: a follow entry's pending one too),
// within max_tokens and the context.
static uint32_t draft_window(const gw_sched *s, const gw_seq *q, long ahead) {
    long left = (long)q->max_gen - q->n_gen - ahead,
         room = (long)s->c.max_ctx - q->n_tokens - ahead;
    left = left < room ? left : room;
    return left < 8 ? (left > 0 ? (uint32_t)left : 0) : 8;
}

// plan_add puts up to *budget tokens of q in plan f.
static void plan_add(gw_sched *s, struct plan *f, mm_step_builder *b, gw_seq *q, int *budget) {
    int want = q->n_tokens - q->ppos;
    int n = want < *budget ? want : *budget;
    if (n <= 0 || f->n >= s->c.max_step_seqs)
        return;
    bool sample = q->ppos + n == q->n_tokens;
    if (mm_step_builder_add(b, q->id, (uint32_t)q->ppos, q->tokens + q->ppos, (uint32_t)n,
                            sample, &q->sampling, q->n_top) != MM_OK)
        return;
    if (sample && !q->want_lp)
        mm_step_builder_set_no_logprob(b);
    if (sample && q->n_top == 0) // drafting: the router may answer more tokens (SeqResult.more)
        mm_step_builder_set_draft(b, draft_window(s, q, 1));
    q->ppos += n;
    if (sample)
        q->sample_in = f->step_id;
    q->ever_planned = true;
    q->in_plans++;
    f->chunk[f->n] = n;
    f->seqs[f->n++] = q;
    *budget -= n;
}

// plan_follow puts q, whose next input the plan in flight picks, in plan f as a follow entry
// (pipelined plans): the router feeds its own pick; the entry is dropped at the position whose
// token would be past max_tokens or the context.
static void plan_follow(gw_sched *s, struct plan *f, mm_step_builder *b, gw_seq *q,
                        int *budget) {
    if (*budget < 1 || f->n >= s->c.max_step_seqs)
        return;
    int64_t limit = (int64_t)q->n_prompt + q->max_gen;
    if (limit > s->c.max_ctx)
        limit = s->c.max_ctx;
    if (mm_step_builder_add_follow(b, q->id, (uint32_t)(limit - 1), &q->sampling, q->n_top) !=
        MM_OK)
        return;
    if (!q->want_lp)
        mm_step_builder_set_no_logprob(b);
    if (q->n_top == 0) // (the pending token comes first; the router also stops draft rows
                       // before the end position)
        mm_step_builder_set_draft(b, draft_window(s, q, 2));
    q->sample_in = f->step_id;
    q->in_plans++;
    f->chunk[f->n] = 1;
    f->seqs[f->n++] = q;
    *budget -= 1;
}

// plan_next builds and sends the next plan (after the plans in flight); false when it has no
// seq to run or could not be sent.
static bool plan_next(gw_sched *s) {
    const int slot = (s->head + s->n_fl) % 2;
    struct plan *f = &s->fl[slot];
    mm_step_builder *b = s->b[slot]; // (the other slot's is borrowed by its plan in flight)
    const uint64_t after = s->n_fl > 0 ? s->fl[(s->head + s->n_fl - 1) % 2].step_id : 0;
    mm_step_builder_reset(b, ++s->step_id);
    mm_step_builder_set_after(b, after);
    f->s = s;
    f->step_id = s->step_id;
    f->n = 0;
    for (int i = 0; i < s->n_release; i++)
        mm_step_builder_release(b, s->release[i]);
    int budget = s->c.max_step_tokens;
    // Decode tokens first (they bound inter-token latency), then prefill chunks, FCFS.
    for (gw_seq *q = s->running.head; q && budget > 0; q = q->next) {
        if (q->cancelled)
            continue; // (held by a plan in flight: it ends when that result is in)
        if (q->sample_in != 0)
            plan_follow(s, f, b, q, &budget);
        else if (q->n_tokens - q->ppos == 1)
            plan_add(s, f, b, q, &budget);
    }
    for (gw_seq *q = s->running.head; q && budget > 0; q = q->next)
        if (!q->cancelled && q->sample_in == 0 && q->n_tokens - q->ppos > 1)
            plan_add(s, f, b, q, &budget);
    gw_seq *q;
    while (budget > 0 && f->n < s->c.max_step_seqs && (q = admit_one(s)))
        plan_add(s, f, b, q, &budget);
    // Releases ride with a plan that has seqs: a releases-only plan would be a round trip for
    // nothing (the router does deliver one: send_releases, services/router/step.c). The
    // admission accounting frees the KV at once; the shards free it before the next step runs.
    if (f->n == 0)
        return false;
    mm_log_debug("step %llu: %d seqs, %d releases%s", (unsigned long long)s->step_id, f->n,
                 s->n_release, after ? " (pipelined)" : "");
    char err[MM_ERRLEN] = "";
    s->n_fl++;
    mm_err rv = gw_mesh_step(s->mesh, mm_step_builder_env(b), s->c.step_timeout_ms, on_step, f,
                             &f->call, err);
    s->n_release = 0;
    if (rv != MM_OK) {
        // Cannot even send: fail the plan's seqs as a step error would. The releases are
        // dropped (the router cannot be told), so that this cannot loop.
        f->call = NULL;
        on_step(f, rv, NULL, err, mm_now_ns());
        return false;
    }
    return true;
}

static void kick(gw_sched *s) {
    adopt_shards(s); // (a change of the shard count waits for the old seqs to end)
    const int depth = s->c.pipeline ? 2 : 1;
    while (s->n_fl < depth && !s->stopped && plan_next(s)) {
    }
}

static void fail_seq(gw_sched *s, gw_seq *q, mm_err code, const char *msg) {
    if (!q->cancelled)
        s->ops.fail(s->arg, q, code, msg);
    finish(s, q);
}

static void on_step(void *arg, mm_err rv, const mm_ctl_msg *reply, const char *err,
                    uint64_t t_done_ns) {
    struct plan *f = arg;
    gw_sched *s = f->s;
    uint64_t t_loop = mm_now_ns();
    f->call = NULL;
    s->steps++;
    char msg[MM_ERRLEN] = "";
    const Mmctl__StepResult *res = NULL;
    if (rv == MM_OK) {
        rv = mm_step_result_check(reply, f->step_id, (uint32_t)f->n, &res, msg);
        if (rv != MM_OK && !msg[0])
            snprintf(msg, sizeof(msg), "router: %s", mm_strerror(rv));
    } else {
        snprintf(msg, sizeof(msg), "router call failed: %s", err && err[0] ? err : mm_strerror(rv));
    }
    if (rv != MM_OK) {
        s->step_errors++;
        mm_log_warn("step %llu failed (%d seqs): %s", (unsigned long long)f->step_id, f->n, msg);
    }
    // The plan's releases were sent (or the router is gone, and the shards with it). Any seqs
    // failed below are released in the next plan.
    for (int i = 0; i < f->n; i++) {
        gw_seq *q = f->seqs[i];
        int chunk = f->chunk[i];
        q->in_plans--;
        if (q->sample_in == f->step_id)
            q->sample_in = 0; // no later plan in flight picks for it
        if (q->state == GW_SEQ_DONE) { // ended at an earlier step (pipelined): entry ignored
            if (q->in_plans == 0)
                s->ops.dropped(s->arg, q);
            continue;
        }
        if (q->cancelled) {
            finish(s, q);
            continue;
        }
        if (rv != MM_OK) {
            fail_seq(s, q, rv, msg);
            continue;
        }
        const Mmctl__SeqResult *r = res->results[i];
        if (r->seq_id != q->id) {
            snprintf(msg, sizeof(msg), "router answered seq %llu in the place of seq %llu",
                     (unsigned long long)r->seq_id, (unsigned long long)q->id);
            fail_seq(s, q, MM_EPROTO, msg);
            continue;
        }
        if (r->error_code != 0) {
            fail_seq(s, q, (mm_err)r->error_code, r->error && r->error[0] ? r->error
                                                                         : "the mesh failed");
            continue;
        }
        q->pos += chunk;
        if (q->in_plans == 0)
            q->ppos = q->pos;
        if (q->pos < q->n_tokens)
            continue; // more prompt to go
        if (r->token < 0) {
            fail_seq(s, q, MM_EPROTO, "router sampled no token for a seq that asked for one");
            continue;
        }
        q->tokens[q->n_tokens++] = r->token;
        q->n_gen++;
        if (!q->t_first_ns)
            q->t_first_ns = t_done_ns;
        bool more = s->ops.token(s->arg, q, r, t_done_ns);
        // Accepted drafts: more tokens of the same step, each reported as its own result.
        for (size_t k = 0; k < r->n_more && more && q->n_gen < q->max_gen &&
                           q->n_tokens < s->c.max_ctx; k++) {
            Mmctl__SeqResult x = *r;
            x.token = r->more[k];
            x.logprob = r->more_logprobs[k];
            x.n_top = 0;
            x.n_more = x.n_more_logprobs = 0;
            q->pos++; // the previous token's KV is in the shards: it was a verified draft row
            q->tokens[q->n_tokens++] = x.token;
            q->n_gen++;
            more = s->ops.token(s->arg, q, &x, t_done_ns);
        }
        if (q->in_plans == 0)
            q->ppos = q->pos;
        q->t_last_ns = t_done_ns; // after the call: token() sees the previous token's time
        if (!more || q->n_gen >= q->max_gen || q->n_tokens >= s->c.max_ctx)
            finish(s, q);
    }
    // out of flight: the oldest plan (results come in plan order), or the newest when it could
    // not even be sent
    if (f == &s->fl[s->head])
        s->head = (s->head + 1) % 2;
    s->n_fl--;
    uint64_t t_tokens = mm_now_ns();
    kick(s);
    s->ops.flush(s->arg, t_done_ns, t_loop, t_tokens, mm_now_ns());
}

void gw_sched_stop(gw_sched *s) {
    if (!s || s->stopped)
        return;
    for (gw_seq *q; (q = s->waiting.head);)
        fail_seq(s, q, MM_ECLOSED, "the gateway is shutting down");
    for (gw_seq *q = s->running.head, *next; q; q = next) {
        next = q->next;
        if (q->in_plans == 0)
            fail_seq(s, q, MM_ECLOSED, "the gateway is shutting down");
    }
    s->stopped = true;
}
