// SPDX-License-Identifier: MIT
// Drafter role; see drafter.h and docs/MESH.md (Drafting).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "drafter.h"
#include "mm/engine.h"
#include "mm/kv_cache.h"
#include "mm/log.h"

#define MAX_K 16 // most tokens proposed per seq per request

static char *s_draft_model;
static long long s_max_seqs, s_max_ctx, s_threads;
mm_opt drafter_opts[] = {
    {"draft-model", MM_OPT_STR, &s_draft_model, NULL,
     "draft model directory, or 'ngram' (prompt lookup, no model); unset: no drafts"},
    {"max-seqs", MM_OPT_INT, &s_max_seqs, "64", "sequences the drafter tracks at once"},
    {"max-ctx", MM_OPT_INT, &s_max_ctx, "4096", "longest sequence (capped by the model)"},
    {"threads", MM_OPT_INT, &s_threads, "1", "CPU threads of the draft model (0: all cores)"},
    {0},
};

// One tracked sequence: tok[0, n_commit) are committed (the target's), tok[n_commit, n_have)
// our last proposals; the draft model's KV holds tok[0, n_kv).
struct dseq {
    uint64_t id;
    bool used;
    int32_t slot; // KV slot (model kind)
    int32_t *tok; // (max_ctx) owned
    int32_t n_commit, n_have, n_kv;
    uint64_t used_at; // the request (D.n_req) that last named it
    uint64_t req;     // the router's number (Envelope.seq) of the last request applied to it
    // this request's batch (model kind)
    uint32_t k;   // drafts wanted
    uint32_t m;   // drafts made
    int32_t *out; // the reply's tokens (k room)
};

static struct drafter {
    pthread_mutex_t mu;
    mm_daemon *d;
    bool ngram, ready;
    bool off; // started without a draft model: requests get DraftReply.off
    mm_engine *eng;
    int32_t max_ctx;
    struct dseq *seqs; // (max_seqs)
    // one batched forward pass (model kind), sized once: rows of all seqs of a request
    int64_t max_rows;
    int32_t *row_seq, *row_pos, *row_id; // (max_rows)
    struct dseq **row_of;               // (max_rows) whose row; NULL: not a wanted row
    bool *want;                          // (max_rows)
    int32_t *ids;                        // (max_rows) greedy drafts picked on the backend
    struct dseq **batch;                 // (max_seqs) the seqs drafting in this request
    uint64_t n_req, n_proposed, n_forwards;
} D = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct dseq *seq_find(uint64_t id) {
    for (long long i = 0; i < s_max_seqs; i++)
        if (D.seqs[i].used && D.seqs[i].id == id)
            return &D.seqs[i];
    return NULL;
}

static void seq_forget(struct dseq *s) {
    if (!s)
        return;
    if (D.eng && s->slot >= 0)
        mm_kv_cache_seq_free(D.eng->kv, s->slot);
    s->used = false;
    s->slot = -1;
    s->n_commit = s->n_have = s->n_kv = 0;
}

static struct dseq *seq_new(uint64_t id) {
    // Full: the seq named longest ago makes room, unless this request named it (a release the
    // router could not pass on, e.g. dropped in a step we missed, must not block new seqs).
    struct dseq *lru = NULL;
    for (long long i = 0; i < s_max_seqs; i++) {
        struct dseq *s = &D.seqs[i];
        if (!s->used) {
            lru = NULL;
            break;
        }
        if (s->used_at != D.n_req && (!lru || s->used_at < lru->used_at))
            lru = s;
    }
    if (lru)
        seq_forget(lru);
    for (long long i = 0; i < s_max_seqs; i++) {
        struct dseq *s = &D.seqs[i];
        if (s->used)
            continue;
        if (!s->tok && !(s->tok = malloc((size_t)D.max_ctx * 4))) // once per slot
            return NULL;
        s->slot = -1;
        if (D.eng && mm_kv_cache_seq_new(D.eng->kv, &s->slot) != MM_OK)
            return NULL;
        s->id = id;
        s->used = true;
        s->n_commit = s->n_have = s->n_kv = 0;
        s->req = 0;
        return s;
    }
    return NULL;
}

// ngram: prompt lookup. The longest suffix (3, 2, then 1 tokens) of the committed sequence that
// occurred earlier; propose what followed its latest earlier occurrence.
static uint32_t draft_ngram(const struct dseq *s, uint32_t k, int32_t *out) {
    const int32_t *t = s->tok;
    int32_t n = s->n_commit;
    for (int g = 3; g >= 1; g--) {
        if (n < g + 1)
            continue;
        for (int32_t i = n - g - 1; i >= 0; i--) {
            if (memcmp(t + i, t + n - g, (size_t)g * 4) != 0)
                continue;
            uint32_t m = 0;
            for (int32_t j = i + g; j < n && m < k; j++)
                out[m++] = t[j];
            return m;
        }
    }
    return 0;
}

// batch_run runs the n rows in D.row_* through the draft model in one forward pass and, for
// each wanted row (D.want), appends the argmax of its logits to its seq's drafts.
static mm_err batch_run(int64_t n, char err[MM_ERRLEN]) {
    if (n == 0)
        return MM_OK;
    mm_model_rows rows = {.n_rows = n, .seq = D.row_seq, .pos = D.row_pos};
    mm_err rv = mm_model_forward(D.eng->model, D.eng->scratch, D.eng->kv, &rows, D.row_id, D.want,
                                 D.eng->logits);
    D.n_forwards++;
    if (rv != MM_OK)
        return mm_errf(err, rv, "draft model forward pass of %lld rows: %s", (long long)n,
                       mm_strerror(rv));
    int64_t nw = 0;
    for (int64_t i = 0; i < n; i++)
        nw += D.want[i];
    if (nw == 0)
        return MM_OK;
    // Greedy drafts, picked on the backend where it can (a GPU returns nw ids instead of nw
    // rows of vocab logits).
    rv = mm_engine_greedy(D.eng, D.eng->logits, nw, D.ids);
    if (rv != MM_OK)
        return mm_errf(err, rv, "draft model logits: %s", mm_strerror(rv));
    int64_t j = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!D.want[i])
            continue;
        struct dseq *s = D.row_of[i];
        s->out[s->m++] = D.ids[j++];
    }
    return MM_OK;
}

// draft_batch: greedy continuations of the nb seqs in D.batch (each wants s->k >= 1 drafts into
// s->out) with the draft model, all seqs in the same forward passes: first one pass (or more,
// max_rows at a time) over every seq's tokens its KV lacks, whose last row gives each its first
// draft; then one pass per further draft position, one row per seq still drafting. Each seq's
// KV keeps the longest prefix it already holds. A failed pass ends drafting for the whole
// request (the drafts made so far stand; the KV is cut back to what is certainly right).
static void draft_batch(int nb, char err[MM_ERRLEN]) {
    uint32_t max_k = 0;
    int nok = 0;
    for (int b = 0; b < nb; b++) {
        struct dseq *s = D.batch[b];
        int32_t keep = s->n_kv < s->n_commit - 1 ? s->n_kv : s->n_commit - 1;
        mm_kv_cache_truncate(D.eng->kv, s->slot, keep);
        s->n_kv = keep;
        s->m = 0;
        if (mm_kv_cache_reserve(D.eng->kv, s->slot, s->n_commit + (int32_t)s->k - 1) != MM_OK) {
            mm_log_warn("seq %llu: draft model KV full: no drafts", (unsigned long long)s->id);
            s->k = 0;
            continue;
        }
        D.batch[nok++] = s;
        if (s->k > max_k)
            max_k = s->k;
    }
    nb = nok;
    // catch-up: the rows each seq's KV lacks (at least its last committed token)
    int64_t n = 0;
    mm_err rv = MM_OK;
    for (int b = 0; b < nb && rv == MM_OK; b++) {
        struct dseq *s = D.batch[b];
        for (int32_t p = s->n_kv; p < s->n_commit && rv == MM_OK; p++) {
            D.row_seq[n] = s->slot;
            D.row_pos[n] = p;
            D.row_id[n] = s->tok[p];
            D.want[n] = p == s->n_commit - 1;
            D.row_of[n] = s;
            if (++n == D.max_rows) {
                rv = batch_run(n, err);
                n = 0;
            }
        }
    }
    if (rv == MM_OK)
        rv = batch_run(n, err);
    if (rv != MM_OK) {
        for (int b = 0; b < nb; b++) {
            mm_kv_cache_truncate(D.eng->kv, D.batch[b]->slot, 0);
            D.batch[b]->n_kv = 0;
            D.batch[b]->m = 0;
        }
        return;
    }
    for (int b = 0; b < nb; b++)
        D.batch[b]->n_kv = D.batch[b]->n_commit;
    // draft positions 1 .. max_k - 1: each drafting seq feeds its latest draft
    for (uint32_t m = 1; m < max_k; m++) {
        n = 0;
        for (int b = 0; b < nb; b++) {
            struct dseq *s = D.batch[b];
            if (s->k <= m || s->m != m)
                continue;
            D.row_seq[n] = s->slot;
            D.row_pos[n] = s->n_commit + (int32_t)m - 1;
            D.row_id[n] = s->out[m - 1];
            D.want[n] = true;
            D.row_of[n] = s;
            n++; // nb <= max_seqs <= max_rows (drafter_start)
        }
        if (n == 0)
            break;
        if (batch_run(n, err) != MM_OK)
            break;
        for (int b = 0; b < nb; b++)
            if (D.batch[b]->m == m + 1)
                D.batch[b]->n_kv++;
    }
    for (int b = 0; b < nb; b++) {
        struct dseq *s = D.batch[b];
        mm_kv_cache_truncate(D.eng->kv, s->slot, s->n_kv);
        memcpy(s->tok + s->n_commit, s->out, s->m * 4);
        s->n_have = s->n_commit + (int32_t)s->m;
    }
}

// on_draft answers a DraftRequest (docs/MESH.md, Drafting). Under D.mu.
static struct nng_msg *on_draft(const Mmctl__DraftRequest *rq, uint64_t seq) {
    size_t n = rq->n_seqs;
    Mmctl__DraftOut *outs = calloc(n ? n : 1, sizeof(*outs));
    Mmctl__DraftOut **outp = calloc(n ? n : 1, sizeof(*outp));
    int32_t *toks = calloc((n ? n : 1) * MAX_K, 4);
    struct nng_msg *reply = NULL;
    if (!outs || !outp || !toks)
        goto done;
    for (size_t i = 0; i < rq->n_release; i++)
        seq_forget(seq_find(rq->release[i]));
    char err[MM_ERRLEN] = "";
    int nb = 0;
    for (size_t i = 0; i < n; i++) {
        const Mmctl__DraftSeq *q = rq->seqs[i];
        Mmctl__DraftOut *o = &outs[i];
        mmctl__draft_out__init(o);
        o->seq_id = q->seq_id;
        o->resync = -1;
        o->tokens = toks + i * MAX_K;
        outp[i] = o;
        struct dseq *s = seq_find(q->seq_id);
        // A request older (by the router's number) than one already applied to this seq is
        // late (the router abandoned it: a frozen drafter, its deadline): applying it would
        // put back tokens the router has since replaced, with no way for it to know. Skipped:
        // no drafts, and the router, which no longer waits for it, never reads the answer.
        if (s && seq < s->req)
            continue;
        if (!s && q->from == 0)
            s = seq_new(q->seq_id);
        if (s) {
            s->used_at = D.n_req;
            s->req = seq;
        }
        if (!s || (int64_t)q->from > s->n_commit) {
            o->resync = s ? s->n_commit : 0;
            if (!s && q->from == 0)
                o->resync = -1; // no room: just no drafts
            continue;
        }
        if ((int64_t)q->from + (int64_t)q->n_tokens + MAX_K + 1 > D.max_ctx) {
            seq_forget(s); // too long to track: no drafts for it
            continue;
        }
        // The longest run of the new tokens that we already hold (and hold KV for) is kept.
        int32_t c = 0, from = (int32_t)q->from;
        while (c < (int32_t)q->n_tokens && from + c < s->n_have && s->tok[from + c] == q->tokens[c])
            c++;
        if (s->n_kv > from + c)
            s->n_kv = from + c; // draft_batch truncates the cache to n_kv
        if (q->n_tokens > 0) // (an empty repeated field decodes as NULL)
            memcpy(s->tok + from, q->tokens, q->n_tokens * 4);
        s->n_commit = s->n_have = from + (int32_t)q->n_tokens;
        uint32_t k = q->k < MAX_K ? q->k : MAX_K;
        if (k == 0 || s->n_commit == 0)
            continue;
        if (D.ngram) {
            o->n_tokens = draft_ngram(s, k, o->tokens);
            D.n_proposed += o->n_tokens;
        } else if (nb < s_max_seqs) { // (a seq named twice in a request drafts once)
            bool dup = false;
            for (int b = 0; b < nb; b++)
                dup |= D.batch[b] == s;
            if (dup)
                continue;
            s->k = k;
            s->out = o->tokens;
            D.batch[nb++] = s;
        }
    }
    if (nb > 0) {
        draft_batch(nb, err);
        if (err[0])
            mm_log_warn("draft model: %s", err);
        for (size_t i = 0; i < n; i++)
            for (int b = 0; b < nb; b++)
                if (outs[i].tokens == D.batch[b]->out) {
                    outs[i].n_tokens = D.batch[b]->m;
                    D.n_proposed += D.batch[b]->m;
                }
    }
    D.n_req++;
    Mmctl__DraftReply dr = MMCTL__DRAFT_REPLY__INIT;
    dr.step_id = rq->step_id;
    dr.n_seqs = n;
    dr.seqs = outp;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_DRAFT_REPLY;
    env.draft_reply = &dr;
    env.seq = seq;
    reply = mm_ctl_reply(&env);
done:
    free(outs);
    free(outp);
    free(toks);
    return reply ? reply : mm_ctl_reply_ack(false, "drafter: out of memory");
}

void drafter_handle(void *arg, const mm_ctl_msg *req, const char *peer, struct nng_msg **reply) {
    (void)arg;
    if (req->body_case != MMCTL__ENVELOPE__BODY_DRAFT_REQUEST) {
        if (D.d)
            mm_daemon_member_handle(D.d, req, peer, reply);
        else
            *reply = mm_ctl_reply_ack(false, "drafter: starting");
        return;
    }
    pthread_mutex_lock(&D.mu);
    if (D.off) { // a reply the router keeps: it stops asking until this drafter restarts
        Mmctl__DraftReply dr = MMCTL__DRAFT_REPLY__INIT;
        dr.step_id = req->draft_request->step_id;
        dr.off = true;
        mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
        env.body_case = MMCTL__ENVELOPE__BODY_DRAFT_REPLY;
        env.draft_reply = &dr;
        env.seq = req->seq;
        *reply = mm_ctl_reply(&env);
    } else if (!D.ready)
        *reply = mm_ctl_reply_ack(false, "drafter: no draft model loaded");
    else
        *reply = on_draft(req->draft_request, req->seq);
    pthread_mutex_unlock(&D.mu);
}

mm_err drafter_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]) {
    (void)arg;
    char detail[300];
    pthread_mutex_lock(&D.mu);
    D.d = d;
    pthread_mutex_unlock(&D.mu);
    if (s_max_seqs < 1 || s_max_ctx < 16)
        return mm_errf(err, MM_EINVAL, "--max-seqs must be >= 1 and --max-ctx >= 16");
    const mm_daemon_conf *c = mm_daemon_get_conf(d);
    if (!s_draft_model) {
        pthread_mutex_lock(&D.mu);
        D.off = true;
        pthread_mutex_unlock(&D.mu);
        snprintf(detail, sizeof(detail), "no draft model (drafting off)");
        mm_log_info("%s", detail);
        mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
        return MM_OK;
    }
    D.ngram = !strcmp(s_draft_model, "ngram");
    D.max_ctx = (int32_t)s_max_ctx;
    if (!D.ngram) {
        char path[4096];
        struct stat st;
        snprintf(path, sizeof(path), "%s/config.json", s_draft_model);
        if (stat(path, &st) != 0)
            return mm_errf(err, MM_ENOENT, "--draft-model %s: no config.json (a model directory "
                           "or 'ngram')", s_draft_model);
        mm_engine_params ep = {.device = c->device, .n_threads = (int)s_threads,
                               .max_ctx = (int)s_max_ctx, .max_seqs = (int)s_max_seqs,
                               .max_rows = s_max_seqs > 256 ? s_max_seqs : 256};
        MM_TRY(mm_engine_open(&D.eng, s_draft_model, &ep, err));
        D.max_ctx = D.eng->max_ctx;
        D.max_rows = D.eng->max_rows;
        D.row_seq = malloc((size_t)D.max_rows * 4);
        D.row_pos = malloc((size_t)D.max_rows * 4);
        D.row_id = malloc((size_t)D.max_rows * 4);
        D.row_of = malloc((size_t)D.max_rows * sizeof(*D.row_of));
        D.want = malloc((size_t)D.max_rows);
        D.ids = malloc((size_t)D.max_rows * 4);
        D.batch = malloc((size_t)s_max_seqs * sizeof(*D.batch));
        if (!D.row_seq || !D.row_pos || !D.row_id || !D.row_of || !D.want || !D.ids || !D.batch)
            return MM_ENOMEM;
    }
    if (!(D.seqs = calloc((size_t)s_max_seqs, sizeof(*D.seqs))))
        return MM_ENOMEM;
    for (long long i = 0; i < s_max_seqs; i++)
        D.seqs[i].slot = -1;
    if (D.ngram)
        snprintf(detail, sizeof(detail), "ngram (prompt lookup)");
    else
        snprintf(detail, sizeof(detail), "draft model %.250s", s_draft_model);
    pthread_mutex_lock(&D.mu);
    D.ready = true;
    pthread_mutex_unlock(&D.mu);
    mm_log_info("drafting with %s", detail);
    mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
    return MM_OK;
}

void drafter_stop(mm_daemon *d, void *arg) {
    (void)d;
    (void)arg;
    pthread_mutex_lock(&D.mu);
    D.ready = false;
    D.d = NULL;
    for (long long i = 0; D.seqs && i < s_max_seqs; i++)
        free(D.seqs[i].tok);
    free(D.seqs);
    D.seqs = NULL;
    free(D.row_seq);
    free(D.row_pos);
    free(D.row_id);
    free(D.row_of);
    free(D.want);
    free(D.ids);
    free(D.batch);
    D.row_seq = D.row_pos = D.row_id = NULL;
    D.row_of = D.batch = NULL;
    D.want = NULL;
    mm_engine_close(D.eng);
    D.eng = NULL;
    pthread_mutex_unlock(&D.mu);
}
