// SPDX-License-Identifier: MIT
// The router's step engine; see step.h and docs/MESH.md.
#include "step.h"

#include <nng/nng.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/uio.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mm/config.h"
#include "mm/log.h"
#include "mm/time.h"
#include "mm/mesh_gtrace.h"
#include "mm/mesh_graph.h"
#include "mm/mesh_trace.h"
#include "mm/model.h"
#include "mm/placement.h"
#include "mm/sampler.h"
#include "mm/spec.h"
#include "mm/step.h"
#include "mm/transport.h"
#include "penalty.h"
#include "step_dev.h"
#include "step_draft.h"
#include "step_follow.h"

#define MAX_RELEASE 4096
#define MSG_LEN 320
#define PEN_SLOTS 256 // most running seqs with penalties (penalty.h)
#define MAX_SAMPLE_WORKERS 7 // sampling threads besides the step's own
#define POOL_MIN_SEQS 4      // fewer sampling seqs than this are sampled inline
#define HANDOFF_MIN_CPUS 4   // the hand-over's spin is on by default from this many CPUs

// GPU entry point of the device routing plan (kernels/cuda/backend.cu), weak: NULL in a build
// without GPU support (then no plan mode); the plan's own (mesh_ops.cu) are in step_dev.h.
extern mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev)
    __attribute__((weak));

struct peer {
    const char *role;  // "attention" | "expert"
    const char *what;  // "attention shard" | "expert owner"
    int inst;
    mm_conn *conn;
    uint64_t inc;      // incarnation the conn was dialed for
    uint64_t dead_inc; // incarnation known dead (its socket died under a link)
    uint64_t retry_ns; // after a failed dial: no new dial before this (mm_now_ns)
    bool live;         // usable this step
    char why[MSG_LEN]; // why not live
    bool gpu;          // conn carries device frames (cudaipc:// between GPU daemons)
    // per exchange
    int64_t off, n;    // region of the staging buffers (rows)
    struct iovec *iov; // gpu: device segments the rows leave from and the reply lands in
    int n_iov;
    struct iovec one;  // storage when one segment does
    struct iovec seg[2]; // plan mode: the x rows and the owner's share of the plan
    bool pending;
    bool failed;       // lost during this exchange (tolerant gathers)
    bool want_view;    // gpu: take the reply in place in the link's ring (MM_MESH_VIEWS)
    const float *view; // where it is (valid until the next receive on the link), or NULL
};

// Sampling pool: the picks of a step's seqs are independent (each a pure function of its logits
// row, sampling values and position), so they run on several threads, each with its own sampler
// scratch; the bits do not depend on which thread picked. Workers sleep on `go` between steps.
struct sample_pool;
struct pool_arg {
    struct sample_pool *pl;
    int k; // this worker's sampler
};
struct sample_pool {
    pthread_t th[MAX_SAMPLE_WORKERS];
    mm_sampler *smp[MAX_SAMPLE_WORKERS];
    struct pool_arg arg[MAX_SAMPLE_WORKERS];
    int n;                 // workers started
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen;          // bumped per job (0: none yet)
    int finished;          // workers done with the current job
    bool stop;
    atomic_int next;       // next item of the current job
    int n_items;
    struct mm_step_engine *e;
    const Mmctl__StepPlan *plan;
};

struct mm_step_engine {
    pthread_mutex_t mu;
    // the hand-over to a waiting plan (engine_lock; MM_ROUTER_HANDOFF: 0 off, 1 on; unset: on
    // with at least HANDOFF_MIN_CPUS online CPUs)
    bool handoff;
    atomic_bool in_tail;     // the running step has picked: its lock is free soon
    pthread_mutex_t tail_mu;
    pthread_cond_t tail_cv;
    mm_step_conf c;
    mm_registry *reg;
    mm_backend *be;
    mm_model *model;
    mm_model_scratch *scratch;
    mm_placement *pl;
    mm_sampler *sampler;
    mm_pen_table *pen;   // token counts of the seqs with penalties
    const mm_model_config *cfg;
    int D, K, E, V;
    struct peer *shards, *owners;
    // per-step buffers (sized at open)
    int32_t *ids;        // (max_tokens) token ids of the active rows
    float *h, *x, *sh;   // (max_tokens, D)
    float *stage;        // (max_tokens, D) shard exchange
    int32_t *gids;       // (max_tokens, K)
    float *gw;           // (max_tokens, K)
    float *xs, *ys;      // (max_tokens * K, D) owner exchange
    float *eo;           // (max_tokens * K, D) expert outputs at row i*K + r
    int32_t *slot_of;    // (max_tokens * K) slot for each staged row
    uint8_t *todo;       // (max_tokens * K) slot still needs an expert output this layer
    int32_t *e_cnt;      // (owners, E) rows per (owner, expert)
    int32_t *e_owner;    // (E) serving owner this layer
    int32_t *e_off;      // (owners, E) write cursor
    uint8_t *ctrl;       // CTRL frame payloads
    float *last, *hn, *logits; // (max_seqs, D) x2, (max_seqs, V)
    // device backends (not host_memory): backend copies of the arrays the stages work on; the
    // host arrays above stay the exchange buffers, copied in and out around each stage group
    bool dev;
    float *d_h, *d_x, *d_sh, *d_eo, *d_last, *d_hn, *d_logits;
    // device data plane (peers with gpu links): owner rows gathered on the device (d_xs, by
    // copy_rows with d_xsrc), replies landing in d_ys and scattered into d_eo by d_slot
    float *d_xs, *d_ys;
    int32_t *d_xsrc, *d_slot; // (max_tokens * K) device copies of xsrc / slot_of
    int32_t *lrows, *d_lrows; // (LR) rows of h the LM head reads, on the host and the device
    int32_t *xsrc;            // (max_tokens * K) source row of each staged slot
    struct iovec *iov;        // (max_seqs + shards) shards' device segments
    // device routing plan (plan_layer): owners get the layer's x rows and their share of the
    // plan made on the device, so no host reads the routing during a step
    bool plan_on;             // device path, GPU entry points, MM_MESH_DEVICE_PLAN not 0
    void *stream;             // the backend's stream (the GPU entry points take it)
    int32_t *owner_of;        // (n_layers, E) serving owner of each expert (-1: none live)
    int32_t *d_owner_of;      // (n_layers, E) its device copy
    uint8_t *plan_live;       // (owners) liveness owner_of was made for
    uint8_t *plan_serve;      // (n_layers, owners) owner serves some expert of the layer
    int32_t *plan_nserve;     // (n_layers) owners serving the layer; 0: not every expert has
                              // a live owner on a device link (the host path answers)
    bool plan_made;
    int64_t plan_stride;      // int32s per owner's share of a layer's plan (whole rows of D
                              // for the largest plan); the shares follow the x rows in d_x
    float *d_ysn;             // (owners, T*K, D) owners' replies when several serve a layer
    bool views;               // one serving owner's reply read in place (MM_MESH_VIEWS, on
                              // unless 0)
    bool plan_ctrl;           // plan frames announced by a CTRL frame (MM_MESH_PLAN_CTRL=1);
                              // else the shape rides in the device frame's header
    bool normed_rows;         // MM_ROUTER_NORMED_ROWS (on unless 0, with views and in place): a
                              // lone shard's next frame made by the combine, h and its norm
    float *next_frame;        // that frame, made: attn_send sends it (NULL: none)
    bool owner_frames;        // MM_MESH_OWNER_FRAMES (on unless 0): several owners' frames made
                              // in their rings by the split (plan_layer)
    bool plan_direct;         // MM_MESH_PLAN_DIRECT (on unless 0): a layer's plan made in its
                              // one serving owner's share (plan_layer)
    bool inplace;             // MM_MESH_INPLACE (mm/mesh_graph.h): a lone owner's frame written
                              // in its ring; a lone shard's reply read in place (h_view)
    const void *h_view;       // this layer's h rows in the shard link's ring (valid until the
                              // next receive on it), not yet copied into d_h (h_from_view)
    // per-seq state
    int32_t *seq_shard, *seq_row; // (max_seqs): shard, first active row (-1: inactive)
    bool *seq_failed;
    char (*seq_msg)[MSG_LEN];
    int32_t *seq_code;
    // the reply
    Mmctl__SeqResult *res;
    Mmctl__SeqResult **res_p;
    Mmctl__TopLogprob *top;
    Mmctl__TopLogprob **top_p;
    mm_sample *smp;
    // sampling of a step's seqs (prepared in order, picked in parallel, applied in order)
    struct sample_pool pool;
    bool pool_up;
    mm_sampling *sp_of;  // (max_seqs) sampling values of each seq
    int64_t *lrow;       // (max_seqs) logits row of its first pick
    int32_t *items;      // (max_seqs) seqs to pick this step
    int32_t *pick_ids;   // (LR) greedy ids picked on the device (SeqStep.no_logprob)
    int64_t scratch_rows; // rows the model scratch holds
    int32_t *srv_of;     // (max_seqs) mm_spec_verify's result
    uint32_t *acc_of;    // (max_seqs) drafts accepted
    mm_pen_slot **ps_of; // (max_seqs) penalty slot of each seq this step (NULL: none)
    // drafting (step_draft.h)
    mm_draft *dr;
    int draft_rows;      // most draft rows per step
    int32_t *seq_n;      // (max_seqs) rows of each seq this step: its tokens + its drafts
    bool *active;        // (max_seqs)
    uint32_t *n_draft;   // (max_seqs)
    uint32_t *n_acc;     // (max_seqs) drafts accepted
    int32_t *draft;      // (max_seqs, MM_DRAFT_MAX_K)
    float *draft_lp;     // (max_seqs, MM_DRAFT_MAX_K) logprobs of the tokens after `token`
    int32_t *draft_tok;  // (max_seqs, MM_DRAFT_MAX_K) those tokens
    mm_follow *fl;       // pipelined plans: the last steps' picks (step_follow.h)
    bool sh_host;        // this step: some shard takes host rows (run_start)
    int32_t *pk_row, *pk_src; // (max_tokens) rows embedding a device pick, and which (run_start)
    // A plan begun early (MM_ROUTER_EARLY, on unless 0; docs/MESH.md "Steps begun early"): a
    // step whose picks are made on the device starts their copy to the host, then begins the
    // plan waiting to follow it (its checks, its CTRL frames, the embedding of those picks on the
    // device and the first layer's rows to the shards: step_begin) before it reads them; the
    // plan's own thread goes on from there once it has the engine.
    bool early;
    _Atomic(const Mmctl__StepPlan *) wait_p; // a follow plan waiting for the engine
    pthread_cond_t begun_cv;          // (mu) a begun plan's thread took it over
    const Mmctl__StepPlan *begun;     // the plan begun (as its thread holds it), or NULL
    const Mmctl__StepPlan *begun_p;   // ... resolved
    int64_t begun_R;                  // its rows
    uint64_t begun_t0;
    mm_err begun_lrv;                 // its forward's start failed (fails its rows)
    char begun_msg[MSG_LEN];
    mm_err pred_rv;                   // the picks it embedded never came back: its rows fail,
                                      // with early_msg (read before its own tail writes it)
    char early_msg[MSG_LEN];          // a begun-from step's error after its results were built
};

static const char *peer_name(const struct peer *p, char *buf, size_t n) {
    snprintf(buf, n, "%s %d", p->what, p->inst);
    return buf;
}

static void peer_drop(struct peer *p) {
    mm_conn_close(p->conn);
    p->conn = NULL;
    p->pending = false;
    p->gpu = false;
    p->view = NULL; // it pointed into the link's ring, freed with the conn
}

// peer_ensure: is the peer up in the registry, with a healthy link (dialed now if needed)?
static bool peer_ensure(mm_step_engine *e, struct peer *p) {
    char url[MM_ADDR_LEN], name[64], err[MM_ERRLEN] = "";
    uint64_t inc = 0;
    bool up = mm_registry_peer(e->reg, p->role, (uint32_t)p->inst, url, &inc);
    p->live = false;
    if (!up) {
        peer_drop(p);
        snprintf(p->why, sizeof(p->why), "%s is down (not joined or no heartbeat)",
                 peer_name(p, name, sizeof(name)));
        return false;
    }
    if (p->conn && (inc != p->inc || mm_conn_error(p->conn) != MM_OK))
        peer_drop(p);
    if (inc == p->dead_inc) { // its process is gone: wait for a new incarnation to join
        snprintf(p->why, sizeof(p->why), "%s is down (its process died; waiting for it to "
                 "rejoin)", peer_name(p, name, sizeof(name)));
        return false;
    }
    if (!p->conn && mm_now_ns() < p->retry_ns) // a dial just failed: fail fast, retry soon
        return false;
    if (!p->conn) {
        if (!url[0]) {
            snprintf(p->why, sizeof(p->why), "%s joined without a --data address",
                     peer_name(p, name, sizeof(name)));
            return false;
        }
        // The registry says the peer is up, so its listener exists; a loaded box can still take
        // longer than a few hundred ms to finish the handshake (seen under load and under
        // qemu TCG), and failing here fails the whole step. 1.5 s keeps a stale peer's
        // failure inside the 2 s bound users see.
        mm_err rv = mm_transport_dial(&p->conn, url, mm_deadline_in_ms(1500), err);
        if (rv != MM_OK) {
            p->conn = NULL;
            p->retry_ns = mm_now_ns() + 300000000ull;
            snprintf(p->why, sizeof(p->why), "%.60s: cannot connect to %.80s: %.100s",
                     peer_name(p, name, sizeof(name)), url, err[0] ? err : mm_strerror(rv));
            mm_log_warn("%s", p->why);
            return false;
        }
        p->inc = inc;
        p->gpu = e->dev && mm_conn_dev(p->conn);
        mm_log_info("linked to %s at %s%s", peer_name(p, name, sizeof(name)), url,
                    p->gpu ? " (rows device to device)" : "");
    }
    p->live = true;
    return true;
}

// ---- sampling pool ---------------------------------------------------------------------------

// pick_dev: pick_one for a greedy seq whose ids were picked on the device (e->pick_ids):
// the same tokens and the same acceptance as mm_spec_verify's greedy picks; logprobs 0 (the
// sender reads none: SeqStep.no_logprob).
static void pick_dev(mm_step_engine *e, int32_t i) {
    const int32_t *ids = e->pick_ids + e->lrow[i];
    const int32_t *draft = e->draft + (size_t)i * MM_DRAFT_MAX_K;
    mm_sample *s = &e->smp[i];
    s->token = ids[0];
    s->logprob = 0;
    s->n_top = 0;
    uint32_t a = 0;
    int32_t prev = ids[0];
    while (a < e->n_draft[i] && prev == draft[a]) {
        e->draft_tok[(size_t)i * MM_DRAFT_MAX_K + a] = ids[a + 1];
        e->draft_lp[(size_t)i * MM_DRAFT_MAX_K + a] = 0;
        prev = ids[a + 1];
        a++;
    }
    e->acc_of[i] = a;
    e->srv_of[i] = MM_OK;
}

// pick_one verifies seq i's rows (plain decoding's picks; mm/spec.h) with sampler scratch smp.
// Writes only seq i's outputs.
static void pick_one(mm_step_engine *e, const Mmctl__StepPlan *p, int32_t i, mm_sampler *smp) {
    const Mmctl__SeqStep *q = p->seqs[i];
    const int64_t at = (int64_t)q->pos + (int64_t)q->n_tokens;
    uint32_t a = 0;
    e->srv_of[i] = (int32_t)mm_spec_verify(smp, e->logits + e->lrow[i] * e->V, e->V, &e->sp_of[i],
                                           at, q->logprobs, e->draft + i * MM_DRAFT_MAX_K,
                                           e->n_draft[i], &e->smp[i],
                                           e->draft_tok + i * MM_DRAFT_MAX_K,
                                           e->draft_lp + i * MM_DRAFT_MAX_K, &a, e->seq_msg[i]);
    e->acc_of[i] = a;
}

static void pool_take(struct sample_pool *pl, mm_sampler *smp) {
    for (;;) {
        int k = atomic_fetch_add(&pl->next, 1);
        if (k >= pl->n_items)
            return;
        pick_one(pl->e, pl->plan, pl->e->items[k], smp);
    }
}

static void *pool_worker(void *arg) {
    struct sample_pool *pl = ((struct pool_arg *)arg)->pl;
    const int me = ((struct pool_arg *)arg)->k;
    uint64_t seen = 0; // jobs start at gen 1: a worker started late still takes the first
    for (;;) {
        pthread_mutex_lock(&pl->mu);
        while (!pl->stop && pl->gen == seen)
            pthread_cond_wait(&pl->go, &pl->mu);
        if (pl->stop) {
            pthread_mutex_unlock(&pl->mu);
            return NULL;
        }
        seen = pl->gen;
        pthread_mutex_unlock(&pl->mu);
        pool_take(pl, pl->smp[me]);
        pthread_mutex_lock(&pl->mu);
        if (++pl->finished == pl->n)
            pthread_cond_signal(&pl->done);
        pthread_mutex_unlock(&pl->mu);
    }
}

// pool_run picks the n seqs in e->items on the pool and the calling thread; returns when all are
// done. Fewer than POOL_MIN_SEQS (or no workers): inline.
static void pool_run(mm_step_engine *e, const Mmctl__StepPlan *p, int n) {
    struct sample_pool *pl = &e->pool;
    if (!e->pool_up || pl->n == 0 || n < POOL_MIN_SEQS) {
        for (int k = 0; k < n; k++)
            pick_one(e, p, e->items[k], e->sampler);
        return;
    }
    pthread_mutex_lock(&pl->mu);
    pl->e = e;
    pl->plan = p;
    pl->n_items = n;
    atomic_store(&pl->next, 0);
    pl->finished = 0;
    pl->gen++;
    pthread_cond_broadcast(&pl->go);
    pthread_mutex_unlock(&pl->mu);
    pool_take(pl, e->sampler);
    pthread_mutex_lock(&pl->mu);
    while (pl->finished < pl->n)
        pthread_cond_wait(&pl->done, &pl->mu);
    pthread_mutex_unlock(&pl->mu);
}

// pool_start: min(MAX_SAMPLE_WORKERS, online cores - 1) workers, each with its own sampler.
// Failing to start one only means fewer.
static void pool_start(mm_step_engine *e) {
    struct sample_pool *pl = &e->pool;
    pthread_mutex_init(&pl->mu, NULL);
    pthread_cond_init(&pl->go, NULL);
    pthread_cond_init(&pl->done, NULL);
    e->pool_up = true;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int want = cores > 1 ? (int)(cores - 1) : 0;
    if (want > MAX_SAMPLE_WORKERS)
        want = MAX_SAMPLE_WORKERS;
    for (int k = 0; k < want; k++) {
        if (mm_sampler_new(&pl->smp[k], e->V) != MM_OK)
            break;
        pl->arg[k] = (struct pool_arg){.pl = pl, .k = k};
        int rc = pthread_create(&pl->th[k], NULL, pool_worker, &pl->arg[k]);
        if (rc == 0)
            pl->n++; // no job runs before open returns, so n is final when one does
        if (rc != 0) {
            mm_sampler_free(pl->smp[k]);
            pl->smp[k] = NULL;
            break;
        }
    }
}

static void pool_stop(mm_step_engine *e) {
    struct sample_pool *pl = &e->pool;
    if (!e->pool_up)
        return;
    pthread_mutex_lock(&pl->mu);
    pl->stop = true;
    pthread_cond_broadcast(&pl->go);
    pthread_mutex_unlock(&pl->mu);
    for (int k = 0; k < pl->n; k++)
        pthread_join(pl->th[k], NULL);
    for (int k = 0; k < MAX_SAMPLE_WORKERS; k++)
        mm_sampler_free(pl->smp[k]);
    pthread_cond_destroy(&pl->go);
    pthread_cond_destroy(&pl->done);
    pthread_mutex_destroy(&pl->mu);
    e->pool_up = false;
}

static int cfg_max_ctx(const mm_model_config *c, int want) {
    return c->max_pos > 0 && want > c->max_pos ? c->max_pos : want;
}

mm_err mm_step_engine_open(mm_step_engine **out, const mm_step_conf *c, mm_registry *reg,
                           char err[MM_ERRLEN]) {
    *out = NULL;
    if (c->max_tokens < 1 || c->max_seqs < 1 || c->shards < 1 || c->owners < 1 ||
        c->step_timeout_ms < 1)
        return mm_errf(err, MM_EINVAL, "--max-batch-tokens, --max-step-seqs, "
                       "--attention-shards, --owners and --step-timeout-ms must be >= 1");
    mm_step_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return MM_ENOMEM;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->tail_mu, NULL);
    pthread_cond_init(&e->tail_cv, NULL);
    // the hand-over's spin pays where the host has cores to spare; on a small one the spinning
    // thread takes the core the replying step needs (2-vCPU VM, gateway c=1: often ~2x the
    // tokens/s without it), so there it is off unless asked for
    const char *ho = getenv("MM_ROUTER_HANDOFF");
    e->handoff = ho && ho[0] ? strcmp(ho, "0") != 0
                             : sysconf(_SC_NPROCESSORS_ONLN) >= HANDOFF_MIN_CPUS;
    e->early = !mm_env_off("MM_ROUTER_EARLY");
    pthread_cond_init(&e->begun_cv, NULL);
    atomic_init(&e->wait_p, NULL);
    e->c = *c;
    e->reg = reg;
    mm_err rv = MM_OK;
    mm_backend_params bp = {.n_threads = c->threads};
    mm_mesh_gpu_spin(c->device);
    MM_TRY_GOTO(rv, mm_backend_open(&e->be, c->device ? c->device : "cpu", &bp, err), fail);
    MM_TRY_GOTO(rv, mm_model_open(&e->model, c->model, e->be, err), fail);
    e->cfg = mm_model_cfg(e->model);
    e->D = e->cfg->d_model;
    e->K = e->cfg->n_experts > 0 ? e->cfg->top_k : 0;
    e->E = e->cfg->n_experts;
    e->V = e->cfg->vocab;
    e->c.max_ctx = cfg_max_ctx(e->cfg, c->max_ctx > 0 ? c->max_ctx : 4096);
    if (e->E > 0)
        MM_TRY_GOTO(rv, mm_placement_open(&e->pl, c->placement, e->cfg, c->owners, err), fail);
    int64_t T = c->max_tokens, S = c->max_seqs, KK = e->K > 0 ? e->K : 1;
    int64_t rows = T > S ? T : S;
    MM_TRY_GOTO(rv, mm_model_scratch_new(&e->scratch, e->model, rows, err), fail);
    e->scratch_rows = rows;
    MM_TRY_GOTO(rv, mm_sampler_new(&e->sampler, e->V), fail);
    MM_TRY_GOTO(rv, mm_pen_table_new(&e->pen, PEN_SLOTS, e->c.max_ctx), fail);
    size_t D = (size_t)e->D;
    e->shards = calloc((size_t)c->shards, sizeof(*e->shards));
    e->owners = calloc((size_t)c->owners, sizeof(*e->owners));
    e->ids = calloc((size_t)T, 4);
    e->h = calloc((size_t)T * D, 4);
    e->x = calloc((size_t)T * D, 4);
    e->sh = calloc((size_t)T * D, 4);
    e->stage = calloc((size_t)T * D, 4);
    e->gids = calloc((size_t)(T * KK), 4);
    e->gw = calloc((size_t)(T * KK), 4);
    e->xs = calloc((size_t)(T * KK) * D, 4);
    e->ys = calloc((size_t)(T * KK) * D, 4);
    e->eo = calloc((size_t)(T * KK) * D, 4);
    e->slot_of = calloc((size_t)(T * KK), 4);
    e->todo = calloc((size_t)(T * KK), 1);
    e->e_cnt = calloc((size_t)c->owners * (size_t)(e->E + 1), 4);
    e->e_off = calloc((size_t)c->owners * (size_t)(e->E + 1), 4);
    e->e_owner = calloc((size_t)(e->E + 1), 4);
    mm_draft_conf dc = {.max_k = c->draft_max, .timeout_ms = c->draft_timeout_ms,
                        .adapt = c->draft_adapt, .max_rows = c->draft_max_rows,
                        .pipeline = c->draft_pipeline,
                        .max_ctx = e->c.max_ctx, .vocab = e->V, .n_shards = c->shards};
    MM_TRY_GOTO(rv, mm_draft_open(&e->dr, &dc, reg, err), fail);
    e->draft_rows = c->draft_max > 0 ? c->draft_max_rows : 0;
    const int64_t LR = S + e->draft_rows; // logits rows: each seq's last row + the draft rows
    e->dev = !e->be->ops->host_memory;
    if (e->dev) {
        void *ctx = e->be->ctx;
        mm_err (*alloc)(void *, size_t, void **) = e->be->ops->buffer_alloc;
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)T * D * 4, (void **)&e->d_h), fail);
        // d_x: the rows, then room for each owner's share of a plan (plan_layer)
        e->plan_stride = e->E > 0 ? mm_model_plan_rows(e->E, T * KK, D) * (int64_t)D : 0;
        MM_TRY_GOTO(rv, alloc(ctx, ((size_t)T * D + (size_t)c->owners * (size_t)e->plan_stride) * 4,
                              (void **)&e->d_x), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)T * D * 4, (void **)&e->d_sh), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)(T * KK) * D * 4, (void **)&e->d_eo), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)LR * D * 4, (void **)&e->d_last), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)LR * D * 4, (void **)&e->d_hn), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)LR * (size_t)e->V * 4, (void **)&e->d_logits), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)(T * KK) * D * 4, (void **)&e->d_xs), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)(T * KK) * D * 4, (void **)&e->d_ys), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)(T * KK) * 4, (void **)&e->d_xsrc), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)(T * KK) * 4, (void **)&e->d_slot), fail);
        MM_TRY_GOTO(rv, alloc(ctx, (size_t)LR * 4, (void **)&e->d_lrows), fail);
        // rows to and from GPU daemons device to device where the link allows (cudaipc://)
        char gerr[MM_ERRLEN] = "";
        if (mm_transport_gpu_use_backend(e->be->ctx, (size_t)(T * KK) * D * 4, gerr) != MM_OK)
            mm_log_info("data plane: host frames only (%s)", gerr);
        // device routing plan (plan_layer): needs the GPU entry points and the model's device
        // path (its first MM_EUNSUPP turns it off); MM_MESH_DEVICE_PLAN=0 turns it off
        const char *pe = getenv("MM_MESH_DEVICE_PLAN");
        int sdev = 0;
        e->plan_on = e->E > 0 && mm_gpu_mesh_plan_split && mm_gpu_mesh_pick &&
                     mm_gpu_backend_stream && !(pe && strcmp(pe, "0") == 0) &&
                     mm_gpu_backend_stream(ctx, &e->stream, &sdev) == MM_OK;
        // the owners' replies of several serving owners (d_ysn) grow with owners x rows: where
        // the device has no room, the plan mode is off (the host path serves), not the router
        const size_t ysn = (size_t)c->owners * (size_t)(T * KK) * D * 4;
        if (e->plan_on && c->owners > 1 && alloc(ctx, ysn, (void **)&e->d_ysn) != MM_OK) {
            mm_log_warn("device routing plan off: no device memory for %d owners' replies "
                        "(%.1f MiB; MM_MESH_DEVICE_PLAN=0 turns it off without trying)",
                        c->owners, (double)ysn / 1048576.0);
            e->d_ysn = NULL;
            e->plan_on = false;
        }
        if (e->plan_on) {
            const size_t NL = (size_t)e->cfg->n_layers, N = (size_t)c->owners, E = (size_t)e->E;
            MM_TRY_GOTO(rv, alloc(ctx, NL * E * 4, (void **)&e->d_owner_of), fail);
            e->owner_of = calloc(NL * E, 4);
            e->plan_live = calloc(N, 1);
            e->plan_serve = calloc(NL * N, 1);
            e->plan_nserve = calloc(NL, 4);
            if (!e->owner_of || !e->plan_live || !e->plan_serve || !e->plan_nserve) {
                rv = MM_ENOMEM;
                goto fail;
            }
            e->views = mm_mesh_views_env();
            e->inplace = mm_mesh_inplace_env();
            e->plan_direct = !mm_env_off("MM_MESH_PLAN_DIRECT");
            e->owner_frames = !mm_env_off("MM_MESH_OWNER_FRAMES");
            e->normed_rows = e->views && e->inplace && !mm_env_off("MM_ROUTER_NORMED_ROWS");
            const char *pc = getenv("MM_MESH_PLAN_CTRL");
            e->plan_ctrl = pc && strcmp(pc, "1") == 0;
        }
    }
    e->xsrc = calloc((size_t)(T * KK), 4);
    e->iov = calloc((size_t)S + (size_t)c->shards, sizeof(struct iovec));
    e->ctrl = calloc(8 + (size_t)S * 16 + MAX_RELEASE * 8 + 8 * (size_t)(e->E + 1) +
                     mm_draft_ctrl_max(e->dr), 1);
    e->last = calloc((size_t)LR * D, 4);
    e->hn = calloc((size_t)LR * D, 4);
    e->logits = calloc((size_t)LR * (size_t)e->V, 4);
    e->pick_ids = calloc((size_t)LR, 4);
    e->lrows = calloc((size_t)LR, 4);
    e->seq_n = calloc((size_t)S, 4);
    e->active = calloc((size_t)S, 1);
    e->n_draft = calloc((size_t)S, 4);
    e->n_acc = calloc((size_t)S, 4);
    e->draft = calloc((size_t)S * MM_DRAFT_MAX_K, 4);
    e->draft_lp = calloc((size_t)S * MM_DRAFT_MAX_K, 4);
    e->draft_tok = calloc((size_t)S * MM_DRAFT_MAX_K, 4);
    e->seq_shard = calloc((size_t)S, 4);
    e->seq_row = calloc((size_t)S, 4);
    e->seq_failed = calloc((size_t)S, 1);
    e->seq_msg = calloc((size_t)S, MSG_LEN);
    e->seq_code = calloc((size_t)S, 4);
    e->res = calloc((size_t)S, sizeof(*e->res));
    e->res_p = calloc((size_t)S, sizeof(*e->res_p));
    e->top = calloc((size_t)S * MM_SAMPLER_MAX_TOP, sizeof(*e->top));
    e->top_p = calloc((size_t)S * MM_SAMPLER_MAX_TOP, sizeof(*e->top_p));
    e->smp = calloc((size_t)S, sizeof(*e->smp));
    e->sp_of = calloc((size_t)S, sizeof(*e->sp_of));
    e->lrow = calloc((size_t)S, sizeof(*e->lrow));
    e->items = calloc((size_t)S, sizeof(*e->items));
    e->srv_of = calloc((size_t)S, sizeof(*e->srv_of));
    e->acc_of = calloc((size_t)S, sizeof(*e->acc_of));
    e->ps_of = calloc((size_t)S, sizeof(*e->ps_of));
    e->pk_row = calloc((size_t)T, 4);
    e->pk_src = calloc((size_t)T, 4);
    if (!e->pk_row || !e->pk_src || !e->shards || !e->owners || !e->ids || !e->h || !e->x || !e->sh || !e->stage ||
        !e->gids || !e->gw || !e->xs || !e->ys || !e->eo || !e->slot_of || !e->todo || !e->e_cnt ||
        !e->e_off || !e->e_owner || !e->ctrl || !e->last || !e->hn || !e->logits || !e->pick_ids || !e->lrows ||
        !e->seq_shard || !e->seq_row || !e->seq_failed || !e->seq_msg || !e->seq_code ||
        !e->res || !e->res_p || !e->top || !e->top_p || !e->smp || !e->seq_n || !e->active ||
        !e->n_draft || !e->n_acc || !e->draft || !e->draft_lp || !e->draft_tok || !e->xsrc ||
        !e->iov || !e->sp_of || !e->lrow || !e->items || !e->srv_of || !e->acc_of ||
        !e->ps_of || mm_follow_new(&e->fl, S) != MM_OK) {
        rv = MM_ENOMEM;
        goto fail;
    }
    for (int i = 0; i < c->shards; i++)
        e->shards[i] = (struct peer){.role = "attention", .what = "attention shard", .inst = i};
    for (int i = 0; i < c->owners; i++)
        e->owners[i] = (struct peer){.role = "expert", .what = "expert owner", .inst = i};
    pool_start(e);
    mm_mesh_trace_open("router");
    if (e->dev) // MM_MESH_TRACE_GPU=1: GPU stamps of the stages
        mm_mesh_gtrace_open_backend("router", e->be->ctx);
    *out = e;
    return MM_OK;
fail:
    mm_step_engine_close(e);
    return rv;
}

void mm_step_engine_close(mm_step_engine *e) {
    if (!e)
        return;
    for (int i = 0; e->shards && i < e->c.shards; i++)
        peer_drop(&e->shards[i]);
    for (int i = 0; e->owners && i < e->c.owners; i++)
        peer_drop(&e->owners[i]);
    free(e->shards); free(e->owners); free(e->ids); free(e->h); free(e->x); free(e->sh);
    free(e->stage); free(e->gids); free(e->gw); free(e->xs); free(e->ys); free(e->eo);
    free(e->slot_of); free(e->todo); free(e->e_cnt); free(e->e_off); free(e->e_owner); free(e->ctrl);
    free(e->last); free(e->hn); free(e->logits); free(e->pick_ids); free(e->seq_shard); free(e->seq_row);
    free(e->seq_failed); free(e->seq_msg); free(e->seq_code); free(e->res); free(e->res_p);
    free(e->top); free(e->top_p); free(e->smp);
    free(e->seq_n); free(e->active); free(e->n_draft); free(e->n_acc); free(e->draft);
    pool_stop(e);
    free(e->draft_lp); free(e->draft_tok); free(e->xsrc); free(e->iov);
    free(e->sp_of); free(e->lrow); free(e->items); free(e->srv_of); free(e->acc_of);
    free(e->ps_of);
    free(e->pk_row); free(e->pk_src);
    free(e->lrows);
    free(e->owner_of); free(e->plan_live); free(e->plan_serve); free(e->plan_nserve);
    mm_draft_close(e->dr);
    mm_follow_free(e->fl);
    mm_sampler_free(e->sampler);
    mm_pen_table_free(e->pen);
    mm_placement_free(e->pl);
    mm_model_scratch_free(e->scratch);
    mm_model_close(e->model);
    if (e->be) {
        float *dv[] = {e->d_h, e->d_x, e->d_sh, e->d_eo, e->d_last, e->d_hn, e->d_logits,
                       e->d_xs, e->d_ys, (float *)e->d_xsrc, (float *)e->d_slot,
                       (float *)e->d_owner_of, e->d_ysn,
                       (float *)e->d_lrows};
        for (size_t i = 0; i < sizeof(dv) / sizeof(dv[0]); i++)
            e->be->ops->buffer_free(e->be->ctx, dv[i]);
    }
    mm_backend_close(e->be);
    pthread_cond_destroy(&e->tail_cv);
    pthread_cond_destroy(&e->begun_cv);
    pthread_mutex_destroy(&e->tail_mu);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

// ---- device staging (backends whose memory is not host memory) -----------------------------
// DP: the array a stage works on (the backend copy on a device); to_dev/to_host copy n floats
// between the host exchange array and its backend copy (nothing on host-memory backends).
#define DP(e, f) ((e)->dev ? (e)->d_##f : (e)->f)
static mm_err to_dev(mm_step_engine *e, float *d, const float *h, int64_t n) {
    return e->dev && n > 0 ? e->be->ops->set(e->be->ctx, d, h, (size_t)n * 4) : MM_OK;
}
static mm_err to_host(mm_step_engine *e, float *h, const float *d, int64_t n) {
    return e->dev && n > 0 ? e->be->ops->get(e->be->ctx, h, d, (size_t)n * 4) : MM_OK;
}

// ---- exchanges ------------------------------------------------------------------------------

// lose: the peer's link is gone for this step (marked failed, not live, conn closed).
static void lose(struct peer *p, mm_err rv, const char *why) {
    if (rv == MM_EPEERDOWN)
        p->dead_inc = p->inc;
    snprintf(p->why, sizeof(p->why), "%s", why);
    p->want_view = false;
    p->failed = true;
    p->live = false;
    peer_drop(p);
}

// gather waits for the REPLY of every pending peer in ps (n of them) for (step, layer) and
// writes its rows at buf + p->off rows. On failure: names the peer in msg, returns the error.
// tolerant: a peer whose link fails (died, silent past the deadline, marked down) is lost()
// and the others are still gathered; the caller retries its rows elsewhere. An MM_WIRE_ERROR
// answer or a protocol violation always fails.
static mm_err gather(mm_step_engine *e, struct peer *ps, int n, uint64_t step, uint32_t layer,
                     float *buf, bool tolerant, char *msg) {
    mm_conn *set[MM_CONN_WAIT_MAX];
    struct peer *who[MM_CONN_WAIT_MAX];
    char name[64];
    size_t np = 0;
    for (int i = 0; i < n; i++)
        if (ps[i].pending) {
            set[np] = ps[i].conn;
            who[np++] = &ps[i];
        }
    const uint64_t deadline = mm_deadline_in_ms((uint64_t)e->c.step_timeout_ms);
    while (np > 0) {
        uint64_t now = mm_now_ns(), slice = now + 200000000ull;
        if (now >= deadline) {
            snprintf(msg, MSG_LEN, "%s did not answer layer %u within %d ms (--step-timeout-ms)",
                     peer_name(who[0], name, sizeof(name)), layer, e->c.step_timeout_ms);
            if (!tolerant)
                return MM_ETIMEDOUT;
            for (size_t i = 0; i < np; i++)
                lose(who[i], MM_ETIMEDOUT, msg);
            return MM_OK;
        }
        size_t r = 0;
        mm_err rv = mm_conn_wait_any(set, np, slice < deadline ? slice : deadline, &r);
        if (rv == MM_ETIMEDOUT) {
            // Ask the registry: a peer marked down fails the step now, not at the deadline.
            for (size_t i = 0; i < np; i++) {
                char url[MM_ADDR_LEN];
                uint64_t inc;
                if (!mm_registry_peer(e->reg, who[i]->role, (uint32_t)who[i]->inst, url, &inc) ||
                    inc != who[i]->inc) {
                    snprintf(msg, MSG_LEN, "%s went down during layer %u",
                             peer_name(who[i], name, sizeof(name)), layer);
                    if (!tolerant)
                        return MM_EPEERDOWN;
                    lose(who[i], MM_ETIMEDOUT, msg);
                    set[i] = set[np - 1];
                    who[i] = who[np - 1];
                    np--;
                    i--;
                }
            }
            continue;
        }
        if (rv != MM_OK) {
            snprintf(msg, MSG_LEN, "waiting for layer %u: %s", layer, mm_strerror(rv));
            return rv;
        }
        struct peer *p = who[r];
        mm_wire_hdr h;
        size_t cap = (size_t)p->n * (size_t)e->D * 4;
        bool on_dev = false; // gpu links: the reply's rows land in p->iov on the device
        p->view = NULL;
        const bool want_view = p->want_view; // one exchange's choice
        p->want_view = false;
        if (p->gpu && want_view) { // or stay in the link's ring (p->view)
            const void *v = NULL;
            rv = mm_conn_recv_view(p->conn, &h, buf + p->off * e->D, cap > 256 ? cap : 256, &v,
                                   deadline);
            p->view = v;
            on_dev = v != NULL;
        } else if (p->gpu)
            rv = mm_conn_recv_dev(p->conn, &h, buf + p->off * e->D, cap > 256 ? cap : 256, p->iov,
                                  p->n_iov, &on_dev, deadline);
        else
            rv = mm_conn_recv(p->conn, &h, buf + p->off * e->D, cap > 256 ? cap : 256, deadline);
        if (rv != MM_OK) {
            if (rv == MM_EPEERDOWN)
                p->dead_inc = p->inc;
            snprintf(msg, MSG_LEN, "%s: %s during layer %u", peer_name(p, name, sizeof(name)),
                     rv == MM_EPEERDOWN ? "connection lost (process died?)" : mm_strerror(rv),
                     layer);
            if (!tolerant || rv == MM_EFULL)
                return rv;
            lose(p, rv, msg);
            set[r] = set[np - 1];
            who[r] = who[np - 1];
            np--;
            continue;
        }
        if (h.kind == MM_WIRE_ERROR) {
            const char *t = (const char *)(buf + p->off * e->D);
            int tl = (int)(h.payload_bytes < 200 ? h.payload_bytes : 200);
            snprintf(msg, MSG_LEN, "%s: %.*s", peer_name(p, name, sizeof(name)), tl, t);
            p->pending = false; // answered: the link stays in step
            return h.aux ? (mm_err)h.aux : MM_EPROTO;
        }
        if (h.kind != MM_WIRE_REPLY || h.step_id != step || h.layer != layer ||
            h.n_rows != (uint32_t)p->n || h.row_dim != (uint32_t)e->D ||
            h.format != MM_WIRE_F32) {
            snprintf(msg, MSG_LEN, "%s sent %s for step %llu layer %u (%u rows), expected a "
                     "reply for step %llu layer %u (%lld rows)", peer_name(p, name, sizeof(name)),
                     mm_wire_kind_name(h.kind), (unsigned long long)h.step_id, h.layer, h.n_rows,
                     (unsigned long long)step, layer, (long long)p->n);
            mm_log_warn("%s", msg);
            return MM_EPROTO;
        }
        if (p->gpu && !on_dev) { // answered through host memory: put the rows where they belong
            const uint8_t *src = (const uint8_t *)(buf + p->off * e->D);
            for (int k = 0; k < p->n_iov; k++) {
                MM_TRY(e->be->ops->set(e->be->ctx, p->iov[k].iov_base, src, p->iov[k].iov_len));
                src += p->iov[k].iov_len;
            }
        }
        p->pending = false;
        set[r] = set[np - 1];
        who[r] = who[np - 1];
        np--;
    }
    return MM_OK;
}

static mm_err send_frame(struct peer *p, enum mm_wire_kind kind, enum mm_wire_format fmt,
                         uint64_t step, uint32_t layer, uint32_t n_rows, uint32_t dim,
                         const void *payload, int timeout_ms, char *msg) {
    mm_wire_hdr h;
    char name[64];
    mm_err rv = mm_wire_hdr_init(&h, kind, fmt, step, layer, n_rows, dim);
    if (rv == MM_OK)
        rv = mm_conn_send(p->conn, &h, payload, mm_deadline_in_ms((uint64_t)timeout_ms));
    if (rv == MM_EPEERDOWN)
        p->dead_inc = p->inc;
    if (rv != MM_OK)
        snprintf(msg, MSG_LEN, "%s: sending layer %d: %s", peer_name(p, name, sizeof(name)),
                 layer == MM_WIRE_NO_LAYER ? -1 : (int)layer,
                 rv == MM_EPEERDOWN ? "connection lost (process died?)" : mm_strerror(rv));
    return rv;
}

// send_frame_dev: p->iov's device segments as one device frame; flags and aux go in its
// header (a plan frame in one piece: MM_MODEL_PLAN_FLAG and its slots; else 0).
static mm_err send_frame_dev(struct peer *p, enum mm_wire_kind kind, uint64_t step,
                             uint32_t layer, uint32_t n_rows, uint32_t dim, uint16_t flags,
                             uint32_t aux, int timeout_ms, char *msg) {
    mm_wire_hdr h;
    char name[64];
    mm_err rv = mm_wire_hdr_init(&h, kind, MM_WIRE_F32, step, layer, n_rows, dim);
    h.flags = flags;
    h.aux = aux;
    if (rv == MM_OK)
        rv = mm_conn_sendv_dev(p->conn, &h, p->iov, p->n_iov,
                               mm_deadline_in_ms((uint64_t)timeout_ms));
    if (rv == MM_EPEERDOWN)
        p->dead_inc = p->inc;
    if (rv != MM_OK)
        snprintf(msg, MSG_LEN, "%s: sending layer %d rows device to device: %s",
                 peer_name(p, name, sizeof(name)), (int)layer,
                 rv == MM_EPEERDOWN ? "connection lost (process died?)" : mm_strerror(rv));
    return rv;
}

// ---- the step -------------------------------------------------------------------------------

// pending: tokens MM_FOLLOW_PENDING(k) are the device's picks of the step before (a plan begun
// early: ids the device's argmax makes, so inside the vocab)
static mm_err check_plan(mm_step_engine *e, const Mmctl__StepPlan *p, bool pending, char *msg) {
    if (p->n_seqs > (size_t)e->c.max_seqs)
        return mm_errf(msg, MM_EINVAL, "plan has %zu seqs; this router takes at most %d per step "
                       "(--max-step-seqs)", p->n_seqs, e->c.max_seqs);
    if (p->n_release > MAX_RELEASE)
        return mm_errf(msg, MM_EINVAL, "plan releases %zu seqs; at most %d per step",
                       p->n_release, MAX_RELEASE);
    size_t rows = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        rows += q->n_tokens;
        for (size_t j = 0; j < i; j++)
            if (p->seqs[j]->seq_id == q->seq_id)
                return mm_errf(msg, MM_EINVAL, "seq %llu appears twice in the plan",
                               (unsigned long long)q->seq_id);
        for (size_t t = 0; t < q->n_tokens; t++)
            if ((q->tokens[t] < 0 || q->tokens[t] >= e->V) &&
                !(pending && MM_FOLLOW_IS_PENDING(q->tokens[t])))
                return mm_errf(msg, MM_EINVAL, "seq %llu: token %d is outside the vocab (%d)",
                               (unsigned long long)q->seq_id, q->tokens[t], e->V);
        if ((uint64_t)q->pos + q->n_tokens > (uint64_t)e->c.max_ctx)
            return mm_errf(msg, MM_EINVAL, "seq %llu: positions up to %llu exceed the context "
                           "limit %d", (unsigned long long)q->seq_id,
                           (unsigned long long)q->pos + q->n_tokens, e->c.max_ctx);
        if (q->logprobs > MM_SAMPLER_MAX_TOP)
            return mm_errf(msg, MM_EINVAL, "seq %llu: logprobs %u is over %d",
                           (unsigned long long)q->seq_id, q->logprobs, MM_SAMPLER_MAX_TOP);
        const Mmctl__Sampling *s = q->sampling;
        if (s && (!(s->repetition_penalty >= 0) || !(s->repetition_penalty < 1e30f) ||
                  !(s->presence_penalty > -1e30f && s->presence_penalty < 1e30f) ||
                  !(s->frequency_penalty > -1e30f && s->frequency_penalty < 1e30f)))
            return mm_errf(msg, MM_EINVAL, "seq %llu: bad penalties (presence %g, frequency %g, "
                           "repetition %g)", (unsigned long long)q->seq_id,
                           (double)s->presence_penalty, (double)s->frequency_penalty,
                           (double)s->repetition_penalty);
    }
    if (rows > (size_t)e->c.max_tokens)
        return mm_errf(msg, MM_EINVAL, "plan has %zu tokens; this router takes at most %d per "
                       "step (--max-batch-tokens)", rows, e->c.max_tokens);
    return MM_OK;
}

// fail_active marks every active seq failed with (code, msg).
static void fail_active(mm_step_engine *e, const Mmctl__StepPlan *p, mm_err code, const char *m) {
    for (size_t i = 0; i < p->n_seqs; i++)
        if (e->seq_row[i] >= 0 && !e->seq_failed[i]) {
            e->seq_failed[i] = true;
            e->seq_code[i] = code;
            snprintf(e->seq_msg[i], MSG_LEN, "%s", m);
        }
}

static void drop_pending(struct peer *ps, int n) {
    for (int i = 0; i < n; i++)
        if (ps[i].pending)
            peer_drop(&ps[i]);
}

// h_from_view: a lone shard's reply read in place (e->h_view: the layer's R rows of h in its
// link's ring) copied into d_h, where the combine and the next layer read h; enqueued after the
// stages that read the view (off the step's chain: the owners work meanwhile). No-op without.
static mm_err h_from_view(mm_step_engine *e, int64_t R) {
    if (!e->h_view)
        return MM_OK;
    const float *v = e->h_view;
    e->h_view = NULL;
    return e->be->ops->copy_rows(e->be->ctx, v, e->D, NULL, e->d_h, e->D, NULL, R, e->D);
}

// ---- the device routing plan -----------------------------------------------------------------
// plan_refresh: each expert's serving owner per layer (the first live owner of its replica
// list, as the host path picks) for the owners' liveness now, uploaded when it changed. A layer
// whose experts do not all have a live serving owner on a device link gets plan_nserve 0 (the
// host path answers it: it knows the replicas and the errors). Runs before each MoE layer: a
// link lost during the step changes the liveness.
static mm_err plan_refresh(mm_step_engine *e) {
    const int N = e->c.owners, E = e->E, NL = e->cfg->n_layers;
    bool same = e->plan_made;
    for (int o = 0; o < N; o++) {
        const uint8_t l = e->owners[o].live ? (e->owners[o].gpu ? 1 : 2) : 0;
        same = same && e->plan_live[o] == l;
        e->plan_live[o] = l;
    }
    if (same)
        return MM_OK;
    memset(e->plan_serve, 0, (size_t)NL * (size_t)N);
    for (int L = 0; L < NL; L++) {
        int32_t *of = e->owner_of + (size_t)L * E;
        bool ok = mm_model_layer_is_moe(e->model, L);
        for (int x = 0; x < E && ok; x++) {
            of[x] = -1;
            for (int r = 0; r < mm_placement_n_rep(e->pl, L, x) && of[x] < 0; r++) {
                const int o = mm_placement_owner(e->pl, L, x, r);
                if (e->owners[o].live)
                    of[x] = o;
            }
            ok = of[x] >= 0 && e->owners[of[x]].gpu;
            if (ok)
                e->plan_serve[(size_t)L * N + of[x]] = 1;
        }
        int ns = 0;
        for (int o = 0; o < N && ok; o++)
            ns += e->plan_serve[(size_t)L * N + o];
        e->plan_nserve[L] = ok ? ns : 0;
    }
    // not made until the device copy is: a failed upload must not leave the next call seeing
    // the same liveness and keeping a device map that disagrees with plan_serve (the owners
    // sent frames would then lack slots that the pick reads)
    e->plan_made = false;
    MM_TRY(e->be->ops->set(e->be->ctx, e->d_owner_of, e->owner_of, (size_t)NL * (size_t)E * 4));
    e->plan_made = true;
    return MM_OK;
}

// plan_layer: the MoE part of layer L with the routing planned on the router's device and
// never read back: router product, route and route_plan (mm_model_gate_plan), each serving
// owner's share of the plan (mm_gpu_mesh_plan_split), then to each owner one CTRL frame
// {MM_MODEL_PLAN_MARK, rows, slots, 0} and one device frame of the x rows followed by its
// share; it answers an output row for every (row, rank) slot (its own slots valid). One serving owner:
// the reply lands in eo; several: each in its region of d_ysn, and every slot's row is picked
// from its owner's (mm_gpu_mesh_pick). Combine with the plan's weights: the engine's ops, so
// the engine's bits. *done false (and MM_OK): an owner was lost during the exchange, so the
// caller runs the layer's MoE on the host path (replicas, errors); or the model has no device
// path (plan mode is then off).
// PLAN_TRY: plan_layer's local (device) failures, named in msg (the requests' error text).
#define PLAN_TRY(what, x)                                                                     \
    do {                                                                                      \
        const mm_err plan_rv_ = (x);                                                          \
        if (plan_rv_ != MM_OK) {                                                              \
            snprintf(msg, MSG_LEN, "layer %d: device routing plan: %s failed: %s", L, what,   \
                     mm_strerror(plan_rv_));                                                  \
            return plan_rv_;                                                                  \
        }                                                                                     \
    } while (0)

static mm_err plan_layer(mm_step_engine *e, uint64_t step, int L, int64_t R, bool shared,
                         char *msg, bool *done, bool *normed) {
    const int D = e->D, N = e->c.owners, E = e->E;
    const int64_t nk = R * e->K, TK = (int64_t)e->c.max_tokens * e->K;
    const int tmo = e->c.step_timeout_ms;
    *done = false;
    const int32_t *of = e->d_owner_of + (size_t)L * E;
    const int64_t P = mm_model_plan_rows(E, nk, D);
    float *xr = e->d_x; // the x rows, then owner 0's share right after them
    // a lone owner (MM_MESH_INPLACE): the FFN norm and the share written straight into the
    // frame's place in its ring (no copy at the send); else in d_x, copied by the send
    bool in_ring = false;
    struct peer *o0 = &e->owners[0];
    if (e->inplace && N == 1 && e->plan_serve[(size_t)L * N] && o0->live && o0->gpu) {
        void *at = NULL;
        in_ring = mm_conn_reserve_dev(o0->conn, (size_t)((R + P) * D) * 4, &at,
                                      mm_deadline_in_ms((uint64_t)tmo)) == MM_OK;
        if (in_ring)
            xr = at; // (else the send from d_x reports whatever is wrong with the link)
    }
    int32_t *shares = (int32_t *)(xr + R * D);
    const bool one = e->plan_nserve[L] == 1;
    // several owners (MM_MESH_OWNER_FRAMES, on unless 0, with in-place frames): each serving
    // owner's frame reserved in its ring, and the split writes every share and copies the x
    // rows there in one launch, so the sends copy nothing (else: from d_x, 2 copies an owner)
    float *frames[MM_STEP_DEV_MAX_FRAMES] = {NULL};
    bool direct = e->inplace && e->owner_frames && N > 1 && N <= MM_STEP_DEV_MAX_FRAMES &&
                  mm_gpu_mesh_plan_split_to != NULL;
    for (int o = 0; o < N && direct; o++) {
        struct peer *op = &e->owners[o];
        if (!e->plan_serve[(size_t)L * N + o])
            continue;
        void *at = NULL;
        direct = op->live && op->gpu && op->conn &&
                 mm_conn_reserve_dev(op->conn, (size_t)((R + P) * D) * 4, &at,
                                     mm_deadline_in_ms((uint64_t)tmo)) == MM_OK;
        frames[o] = at; // (a reservation left unused is no harm: the next send takes its place)
    }
    // one serving owner (it serves every expert of the layer): the plan is made in its share's
    // place (MM_MESH_PLAN_DIRECT, on unless 0; no split launch)
    int32_t *plan_at = NULL;
    for (int o = 0; o < N && one && e->plan_direct && !direct; o++)
        if (e->plan_serve[(size_t)L * N + o])
            plan_at = shares + o * e->plan_stride;
    // FFN norm, router product, route and plan, the owners' shares (step_dev.c).
    // h: a lone shard's reply where it sits in its link's ring (h_view), else d_h
    mm_step_dev_layer dl = {.m = e->model, .s = e->scratch, .stream = e->stream, .L = L, .R = R,
                            .nk = nk, .E = E, .N = N,
                            .h = e->h_view ? (float *)e->h_view : e->d_h, .x = xr, .of = of,
                            .shares = shares, .stride = e->plan_stride, .plan_at = plan_at,
                            .frames = direct ? frames : NULL,
                            .one = one,
                            .ysn = e->d_ysn, .ysn_rows = TK, .eo = e->d_eo,
                            .sh = shared ? e->d_sh : NULL};
    mm_err rv = mm_step_dev_route(&dl);
    *normed = dl.normed && !in_ring; // the host path's x is d_x
    dl.h = e->d_h;
    if (rv == MM_EUNSUPP && dl.normed) {
        mm_log_info("device routing plan: the model has no device path; routing on the host");
        e->plan_on = false;
        return MM_OK;
    }
    PLAN_TRY(dl.failed ? dl.failed : "the routing chain", rv);
    for (int o = 0; o < N; o++) {
        struct peer *op = &e->owners[o];
        op->n = 0;
        op->failed = false;
        op->want_view = false;
        if (!e->plan_serve[(size_t)L * N + o])
            continue;
        // the plan's shape: in the device frame's header (flags, aux), or in a CTRL frame
        // before it (MM_MESH_PLAN_CTRL=1: one more frame and wake-up per owner and layer)
        const uint32_t c4[4] = {MM_MODEL_PLAN_MARK, (uint32_t)R, (uint32_t)nk, 0};
        rv = e->plan_ctrl ? send_frame(op, MM_WIRE_CTRL, MM_WIRE_BYTES, step, (uint32_t)L, 1,
                                       sizeof(c4), c4, tmo, msg)
                          : MM_OK;
        if (rv == MM_OK) { // owner 0: rows and share in one piece
            op->seg[0] = (struct iovec){.iov_base = direct ? frames[o] : xr,
                                        .iov_len = (size_t)((o && !direct ? R : R + P) * D) * 4};
            op->seg[1] = (struct iovec){.iov_base = shares + o * e->plan_stride,
                                        .iov_len = (size_t)(P * D) * 4};
            op->iov = op->seg;
            op->n_iov = o && !direct ? 2 : 1;
            rv = send_frame_dev(op, MM_WIRE_ROWS, step, (uint32_t)L, (uint32_t)(R + P),
                                (uint32_t)D, e->plan_ctrl ? 0 : MM_MODEL_PLAN_FLAG,
                                e->plan_ctrl ? 0 : (uint32_t)nk, tmo, msg);
        }
        if (rv == MM_EINVAL)
            return rv;
        if (rv != MM_OK) {
            lose(op, rv, msg);
            continue;
        }
        // the reply: nk rows into eo (one owner) or its region of d_ysn
        op->off = 0;
        op->n = nk;
        op->one = (struct iovec){.iov_base = one ? e->d_eo : e->d_ysn + o * TK * D,
                                 .iov_len = (size_t)(nk * D) * 4};
        op->iov = &op->one;
        op->n_iov = 1;
        op->want_view = one && e->views; // combine reads the one owner's reply in place
        op->pending = true;
    }
    mm_mesh_trace(step, L, "o_send");
    mm_mesh_gstamp(step, L, "o_send");
    // while the owners work. x in the lone owner's ring (in_ring) went with its link when a
    // send to it failed (lose closed the conn: the peer's ring is unmapped, and reading it would
    // fault the device); the layer then runs on the host path, which makes x and runs the
    // shared experts itself.
    if (shared && !(in_ring && o0->conn == NULL))
        PLAN_TRY("shared experts",
                 mm_model_shared_forward(e->model, e->scratch, L, xr, R, e->d_sh));
    // a lone shard's next frame (MM_ROUTER_NORMED_ROWS): its place reserved in the shard's ring,
    // the reply copied there (instead of into d_h; off the chain, as that copy), the combine run
    // there and the next layer's input norm written after it, so the send copies nothing and
    // the shard runs no norm. d_h is not updated then: the next reply lands there before anything
    // reads it (the last layer never takes this path); a layer that ends on the host path still
    // copies the reply into d_h (run_layers' h_from_view: e->h_view is kept until the combine).
    float *nf = NULL;
    struct peer *s0 = &e->shards[0];
    if (e->normed_rows && e->h_view && e->c.shards == 1 && L + 1 < e->cfg->n_layers &&
        s0->live && s0->gpu && s0->conn && s0->n == R) {
        void *at = NULL;
        if (mm_conn_reserve_dev(s0->conn, (size_t)(2 * R * D) * 4, &at,
                                mm_deadline_in_ms((uint64_t)tmo)) == MM_OK)
            nf = at;
    }
    if (nf)
        PLAN_TRY("h from the shard's reply",
                 e->be->ops->copy_rows(e->be->ctx, e->h_view, D, NULL, nf, D, NULL, R, D));
    else
        PLAN_TRY("h from the shard's reply", h_from_view(e, R));
    mm_err grv = gather(e, e->owners, N, step, (uint32_t)L, e->ys, true, msg);
    if (grv == MM_EUNSUPP) {
        // an owner that cannot run plan frames (no device path in its process: its
        // MM_DEVICE_ROUTING, its experts' dtypes) answered so: the plan mode is off from here
        // on, the other owners' answers are collected (each gather has its deadline), and the
        // layer runs on the host path, so no step fails for it
        mm_log_warn("device routing plan off (%s); routing on the host", msg);
        e->plan_on = false;
        while ((grv = gather(e, e->owners, N, step, (uint32_t)L, e->ys, true, msg)) ==
               MM_EUNSUPP)
            ;
        return grv; // MM_OK with *done false: the host path
    }
    MM_TRY(grv);
    mm_mesh_trace(step, L, "o_back");
    mm_mesh_gstamp(step, L, "o_back");
    for (int o = 0; o < N; o++)
        if (e->plan_serve[(size_t)L * N + o] && e->owners[o].failed) {
            mm_log_warn("step %llu layer %d: %s; the layer's experts go through the host path",
                        (unsigned long long)step, L, e->owners[o].why);
            return MM_OK;
        }
    // pick (several owners) and combine (step_dev.c); one owner's reply read where it landed
    // in the link's ring (views)
    const float *reply = NULL;
    for (int o = 0; o < N && one; o++)
        if (e->plan_serve[(size_t)L * N + o] && e->owners[o].view)
            reply = e->owners[o].view;
    if (reply)
        dl.eo = (float *)reply;
    if (nf) {
        dl.h = nf;
        dl.xn_next = nf + R * D;
    }
    rv = mm_step_dev_combine(&dl);
    PLAN_TRY(dl.failed ? dl.failed : "picking and combining the owners' rows", rv);
    if (nf) { // h is in the frame: nothing to copy into d_h
        e->h_view = NULL;
        e->next_frame = nf;
    }
    *done = true;
    return MM_OK;
}

#undef PLAN_TRY

// ctrl_send: completes and sends shard s's CTRL frame for step p: its ns seqs are already in
// e->ctrl from byte 8 up to c; the counts, p's releases and the shard's pending draft
// truncations (rejected draft rows) are added here. The one writer of the frame, for
// run_layers and send_releases. Returns send_frame's error (msg set).
static mm_err ctrl_send(mm_step_engine *e, int s, const Mmctl__StepPlan *p, uint32_t ns,
                        uint8_t *c, char *msg) {
    const uint32_t nr = (uint32_t)p->n_release;
    memcpy(e->ctrl, &ns, 4);
    memcpy(e->ctrl + 4, &nr, 4);
    for (size_t i = 0; i < p->n_release; i++, c += 8)
        memcpy(c, &p->release[i], 8);
    c += mm_draft_ctrl_tail(e->dr, s, c);
    MM_TRY(send_frame(&e->shards[s], MM_WIRE_CTRL, MM_WIRE_BYTES, p->step_id, MM_WIRE_NO_LAYER,
                      1, (uint32_t)(c - e->ctrl), e->ctrl, e->c.step_timeout_ms, msg));
    mm_draft_ctrl_sent(e->dr, s);
    return MM_OK;
}

// send_releases: a plan without rows (releases only, or every seq dropped) still frees its
// releases on the shards: each live shard gets the CTRL frame run_layers would have sent (no
// seqs, the releases, pending draft truncations) and no rows after it. Without it a
// releases-only plan (mesh-generate's last) was lost and the shard kept those seqs' KV slots
// until --max-seqs ran out ("no free sequence slot"). A failed send is logged; a broken link
// is dropped (the next step relinks, and a restarted shard holds no KV anyway).
static void send_releases(mm_step_engine *e, const Mmctl__StepPlan *p) {
    for (int s = 0; s < e->c.shards; s++) {
        struct peer *sp = &e->shards[s];
        if (!sp->live)
            continue;
        char msg[MSG_LEN] = "";
        if (ctrl_send(e, s, p, 0, e->ctrl + 8, msg) != MM_OK) {
            mm_log_warn("step %llu (releases only): %s", (unsigned long long)p->step_id, msg);
            if (sp->conn && mm_conn_error(sp->conn) != MM_OK)
                peer_drop(sp);
        }
    }
}

// attn_send: layer L's rows to the shards (each shard's seqs in plan order): device frames
// straight from d_h, host frames through `stage`.
static mm_err attn_send(mm_step_engine *e, const Mmctl__StepPlan *p, int L, char *msg) {
    const uint64_t step = p->step_id;
    const int D = e->D, M = e->c.shards, tmo = e->c.step_timeout_ms;
    for (int s = 0; s < M; s++) {
        struct peer *sp = &e->shards[s];
        if (!sp->live || sp->n == 0)
            continue;
        if (sp->gpu) {
            // the frame the combine made (h and its norm, in the shard's ring: no copy)
            float *nf = M == 1 ? e->next_frame : NULL;
            e->next_frame = NULL;
            struct iovec *iov0 = sp->iov, one = {.iov_base = nf,
                                                 .iov_len = (size_t)(2 * sp->n * D) * 4};
            const int n0 = sp->n_iov;
            if (nf)
                sp->iov = &one, sp->n_iov = 1;
            const mm_err srv = send_frame_dev(sp, MM_WIRE_ROWS, step, (uint32_t)L,
                                              (uint32_t)(nf ? 2 * sp->n : sp->n), (uint32_t)D,
                                              nf ? MM_MODEL_NORMED_FLAG : 0, 0, tmo, msg);
            sp->iov = iov0, sp->n_iov = n0;
            MM_TRY(srv);
            sp->pending = true;
            // a lone shard's reply read in place where the layer's MoE goes through the
            // device plan (plan_layer reads h there; h_from_view copies it into d_h)
            sp->want_view = e->inplace && M == 1 && e->plan_on && !e->sh_host &&
                            sp->n_iov == 1 && sp->iov[0].iov_base == (void *)e->d_h &&
                            mm_model_layer_is_moe(e->model, L);
            continue;
        }
        int64_t o = sp->off;
        for (size_t i = 0; i < p->n_seqs; i++)
            if (e->seq_row[i] >= 0 && e->seq_shard[i] == s) {
                int64_t n = (int64_t)e->seq_n[i];
                memcpy(e->stage + o * D, e->h + (int64_t)e->seq_row[i] * D,
                       (size_t)(n * D) * 4);
                o += n;
            }
        MM_TRY(send_frame(sp, MM_WIRE_ROWS, MM_WIRE_F32, step, (uint32_t)L,
                          (uint32_t)sp->n, (uint32_t)D, e->stage + sp->off * D, tmo, msg));
        sp->pending = true;
    }
    mm_mesh_trace(step, L, "a_send");
    mm_mesh_gstamp(step, L, "a_send");
    return MM_OK;
}

// run_start: the forward pass's start: each live shard's CTRL frame (its seqs and the
// releases) and its rows' region, then the embedding into h. early (a plan begun early): the
// ids are the picks the step before left on the device (mm_model_embed_picks), and layer 0's
// rows go to the shards too. Returns an error (msg set) that fails the active rows.
static mm_err run_start(mm_step_engine *e, const Mmctl__StepPlan *p, int64_t R, bool early,
                        char *msg) {
    const uint64_t step = p->step_id;
    const int D = e->D, M = e->c.shards;
    e->h_view = NULL;
    e->next_frame = NULL;
    // Per shard: CTRL with its seqs and the releases; then its rows' region in `stage`.
    int64_t off = 0;
    int n_iov = 0;
    e->sh_host = false; // some shard takes host rows: keep e->h current on the host
    for (int s = 0; s < M; s++) {
        struct peer *sp = &e->shards[s];
        if (!sp->live)
            continue;
        uint32_t ns = 0;
        uint8_t *c = e->ctrl + 8;
        sp->off = off;
        sp->n = 0;
        sp->iov = e->iov + n_iov;
        sp->n_iov = 0;
        for (size_t i = 0; i < p->n_seqs; i++) {
            if (e->seq_row[i] < 0 || e->seq_shard[i] != s)
                continue;
            const Mmctl__SeqStep *q = p->seqs[i];
            int32_t pos = (int32_t)q->pos, n = e->seq_n[i];
            memcpy(c, &q->seq_id, 8);
            memcpy(c + 8, &pos, 4);
            memcpy(c + 12, &n, 4);
            c += 16;
            ns++;
            sp->n += n;
            if (sp->gpu) { // device segments of d_h, contiguous seqs merged
                uint8_t *at = (uint8_t *)(e->d_h + (int64_t)e->seq_row[i] * D);
                size_t len = (size_t)n * (size_t)D * 4;
                struct iovec *last = sp->n_iov ? &sp->iov[sp->n_iov - 1] : NULL;
                if (last && (uint8_t *)last->iov_base + last->iov_len == at)
                    last->iov_len += len;
                else
                    sp->iov[sp->n_iov++] = (struct iovec){.iov_base = at, .iov_len = len};
            }
        }
        n_iov += sp->n_iov;
        if (!sp->gpu && sp->n > 0)
            e->sh_host = true;
        MM_TRY(ctrl_send(e, s, p, ns, c, msg));
        off += sp->n;
    }
    mm_mesh_trace(step, -1, "ctrl");
    if (early) { // rows with a pending token take the device's pick it names
        int64_t np = 0;
        bool same = true; // row r takes pick r, every row: the picks are the ids as they lie
        for (int64_t r = 0; r < R; r++)
            if (MM_FOLLOW_IS_PENDING(e->ids[r])) {
                e->pk_src[np] = (int32_t)MM_FOLLOW_PICK(e->ids[r]);
                e->pk_row[np] = (int32_t)r;
                same = same && e->pk_src[np] == r;
                np++;
                e->ids[r] = 0; // (a placeholder the pick overwrites on the device)
            }
        same = same && np == R;
        MM_TRY(mm_model_embed_picks(e->model, e->scratch, same ? NULL : e->ids, R, e->pk_row,
                                    e->pk_src, np, DP(e, h)));
    } else
        MM_TRY(mm_model_embed(e->model, e->scratch, e->ids, R, DP(e, h)));
    mm_mesh_trace(step, -1, "embed");
    mm_mesh_gstamp(step, -1, "embed");
    if (e->sh_host)
        MM_TRY(to_host(e, e->h, e->d_h, R * D));
    if (early)
        MM_TRY(attn_send(e, p, 0, msg));
    return MM_OK;
}

// run_layers: the forward pass of the active rows. Returns an error (msg set) that fails them.
// On a device backend, a peer whose link carries device frames (p->gpu, cudaipc://) gets its
// rows straight from the backend arrays and answers into them (no host copy, no drain); other
// peers go through the host exchange arrays as before (one `get` per stage group). run_start
// has run (step_begin); begun: early, so layer 0's rows are with the shards already.
static mm_err run_layers(mm_step_engine *e, const Mmctl__StepPlan *p, int64_t R, bool begun,
                         char *msg) {
    const uint64_t step = p->step_id;
    const int D = e->D, K = e->K, M = e->c.shards, N = e->c.owners;
    const int tmo = e->c.step_timeout_ms;
    const bool sh_host = e->sh_host; // (run_start ran: step_begin)
    const int n_layers = e->cfg->n_layers;
    for (int L = 0; L < n_layers; L++) {
        // h back on the host after this layer: for host-path shards, and after the last layer
        // on a host backend (the sampled rows are read from e->h; a device gathers them from
        // d_h itself: mm_step_engine_run)
        const bool h_out = sh_host || (L == n_layers - 1 && !e->dev);
        // attention on the shards: each shard's rows (seqs in plan order)
        if (!(begun && L == 0))
            MM_TRY(attn_send(e, p, L, msg));
        e->h_view = NULL;
        MM_TRY(gather(e, e->shards, M, step, (uint32_t)L, e->stage, false, msg));
        if (M == 1 && e->shards[0].view) // (a view: one segment of all R rows, want_view above)
            e->h_view = e->shards[0].view;
        mm_mesh_trace(step, L, "a_back");
        mm_mesh_gstamp(step, L, "a_back");
        for (int s = 0; s < M; s++) {
            struct peer *sp = &e->shards[s];
            if (!sp->live || sp->n == 0 || sp->gpu) // gpu: the reply already landed in d_h
                continue;
            int64_t o = sp->off;
            for (size_t i = 0; i < p->n_seqs; i++)
                if (e->seq_row[i] >= 0 && e->seq_shard[i] == s) {
                    int64_t n = (int64_t)e->seq_n[i];
                    float *hr = e->h + (int64_t)e->seq_row[i] * D;
                    memcpy(hr, e->stage + o * D, (size_t)(n * D) * 4);
                    if (e->dev && n > 0) // only this shard's rows: gpu shards' are in d_h
                        MM_TRY(to_dev(e, e->d_h + (int64_t)e->seq_row[i] * D, hr, n * D));
                    o += n;
                }
        }
        const bool shared = mm_model_layer_has_shared(e->model, L);
        bool normed = false; // DP(e, x) holds the FFN norm (plan_layer makes it)
        if (e->plan_on && mm_model_layer_is_moe(e->model, L)) {
            // routing planned and kept on the device (plan_layer)
            MM_TRY(plan_refresh(e));
            bool done = false;
            if (e->plan_nserve[L] > 0)
                MM_TRY(plan_layer(e, step, L, R, shared, msg, &done, &normed));
            MM_TRY(h_from_view(e, R)); // (a plan that ended early: the host path reads d_h)
            if (done) {
                mm_mesh_trace(step, L, "comb");
                mm_mesh_gstamp(step, L, "comb");
                if (h_out)
                    MM_TRY(to_host(e, e->h, e->d_h, R * D));
                continue;
            }
        }
        if (!normed)
            MM_TRY(mm_model_ffn_norm(e->model, e->scratch, L, DP(e, h), R, DP(e, x)));
        if (!mm_model_layer_is_moe(e->model, L)) {
            MM_TRY(mm_model_shared_forward(e->model, e->scratch, L, DP(e, x), R, DP(e, sh)));
            MM_TRY(mm_model_combine(e->model, e->scratch, L, DP(e, h), R, 0, NULL, NULL,
                                    DP(e, sh)));
            if (h_out)
                MM_TRY(to_host(e, e->h, e->d_h, R * D));
            continue;
        }
        MM_TRY(mm_model_gate(e->model, e->scratch, L, DP(e, x), R, e->gids, e->gw));
        mm_mesh_trace(step, L, "gate");
        bool x_host = !e->dev; // e->x holds this layer's rows (fetched when a host owner needs)
        // Expert outputs: every (row, rank) slot is served by the first live owner of its
        // expert's replica list; a link lost during the exchange is retried on the next replica
        // (the result bits do not depend on which replica computed them).
        const int E = e->E;
        for (int64_t t = 0; t < R * K; t++) {
            int32_t x = e->gids[t];
            if (x < 0 || x >= E)
                return mm_errf(msg, MM_EPROTO, "gate gave expert %d at layer %d", x, L);
        }
        const int64_t n_slots = R * K;
        if (n_slots <= 0 || n_slots > (int64_t)e->c.max_tokens * K)
            return mm_errf(msg, MM_EINVAL, "layer %d: %lld routed slots", L, (long long)n_slots);
        memset(e->todo, 1, (size_t)n_slots);
        int64_t n_todo = n_slots;
        bool shared_done = false;
        while (n_todo > 0) {
            memset(e->e_cnt, 0, (size_t)N * (size_t)(E + 1) * 4);
            for (int x = 0; x < E; x++)
                e->e_owner[x] = -1;
            for (int64_t t = 0; t < R * K; t++) {
                if (!e->todo[t])
                    continue;
                int32_t x = e->gids[t];
                if (e->e_owner[x] < 0) {
                    for (int r = 0; r < mm_placement_n_rep(e->pl, L, x) && e->e_owner[x] < 0;
                         r++) {
                        int o = mm_placement_owner(e->pl, L, x, r);
                        if (e->owners[o].live)
                            e->e_owner[x] = o;
                    }
                    if (e->e_owner[x] < 0) {
                        int o0 = mm_placement_owner(e->pl, L, x, 0);
                        return mm_errf(msg, MM_EPEERDOWN, "expert %d of layer %d has no live "
                                       "owner (%s)", x, L, e->owners[o0].why);
                    }
                }
                e->e_cnt[e->e_owner[x] * (E + 1) + x]++;
            }
            // Layout: owners in instance order, experts ascending, slots in order.
            int64_t base = 0;
            bool ow_host = false, ow_dev = false;
            for (int o = 0; o < N; o++) {
                struct peer *op = &e->owners[o];
                op->off = base;
                op->n = 0;
                op->failed = false;
                op->want_view = false;
                for (int x = 0; x < E; x++) {
                    e->e_off[o * (E + 1) + x] = (int32_t)(base + op->n);
                    op->n += e->e_cnt[o * (E + 1) + x];
                }
                base += op->n;
                if (op->n > 0 && !op->gpu)
                    ow_host = true;
                if (op->n > 0 && op->gpu)
                    ow_dev = true;
            }
            if (ow_host && !x_host) { // host-path owners read the rows from e->x
                MM_TRY(to_host(e, e->x, e->d_x, R * D));
                x_host = true;
            }
            for (int64_t t = 0; t < R * K; t++) {
                if (!e->todo[t])
                    continue;
                int32_t x = e->gids[t], o = e->e_owner[x];
                int32_t at = e->e_off[o * (E + 1) + x]++;
                e->slot_of[at] = (int32_t)t;
                e->xsrc[at] = (int32_t)(t / K);
                if (x_host && !(e->dev && e->owners[o].gpu))
                    memcpy(e->xs + (int64_t)at * D, e->x + (t / K) * D, (size_t)D * 4);
            }
            if (e->dev) {
                // slot tables on the device; gpu owners' rows gathered there in one launch
                MM_TRY(e->be->ops->set(e->be->ctx, e->d_slot, e->slot_of, (size_t)base * 4));
                MM_TRY(e->be->ops->set(e->be->ctx, e->d_xsrc, e->xsrc, (size_t)base * 4));
                if (ow_dev)
                    MM_TRY(e->be->ops->copy_rows(e->be->ctx, e->d_x, D, e->d_xsrc, e->d_xs, D,
                                                 NULL, base, D));
            }
            for (int o = 0; o < N; o++) {
                struct peer *op = &e->owners[o];
                if (op->n == 0)
                    continue;
                uint32_t nseg = 0;
                uint8_t *c = e->ctrl + 4;
                for (int x = 0; x < E; x++) {
                    uint32_t cnt = (uint32_t)e->e_cnt[o * (E + 1) + x], ux = (uint32_t)x;
                    if (cnt == 0)
                        continue;
                    memcpy(c, &ux, 4);
                    memcpy(c + 4, &cnt, 4);
                    c += 8;
                    nseg++;
                }
                memcpy(e->ctrl, &nseg, 4);
                mm_err rv = send_frame(op, MM_WIRE_CTRL, MM_WIRE_BYTES, step, (uint32_t)L, 1,
                                       (uint32_t)(c - e->ctrl), e->ctrl, tmo, msg);
                if (rv == MM_OK && op->gpu) {
                    // rows leave from d_xs; the reply lands in d_ys at the same place
                    op->one = (struct iovec){.iov_base = e->d_xs + op->off * D,
                                             .iov_len = (size_t)op->n * (size_t)D * 4};
                    op->iov = &op->one;
                    op->n_iov = 1;
                    rv = send_frame_dev(op, MM_WIRE_ROWS, step, (uint32_t)L, (uint32_t)op->n,
                                        (uint32_t)D, 0, 0, tmo, msg);
                    op->one.iov_base = e->d_ys + op->off * D;
                } else if (rv == MM_OK) {
                    rv = send_frame(op, MM_WIRE_ROWS, MM_WIRE_F32, step, (uint32_t)L,
                                    (uint32_t)op->n, (uint32_t)D, e->xs + op->off * D, tmo, msg);
                }
                if (rv == MM_EINVAL)
                    return rv;
                if (rv != MM_OK)
                    lose(op, rv, msg);
                else
                    op->pending = true;
            }
            mm_mesh_trace(step, L, "o_send");
            // The shared experts run here while the owners work.
            if (shared && !shared_done)
                MM_TRY(mm_model_shared_forward(e->model, e->scratch, L, DP(e, x), R, DP(e, sh)));
            shared_done = true;
            MM_TRY(gather(e, e->owners, N, step, (uint32_t)L, e->ys, true, msg));
            mm_mesh_trace(step, L, "o_back");
            for (int o = 0; o < N; o++) {
                struct peer *op = &e->owners[o];
                if (op->n == 0)
                    continue;
                if (op->failed) {
                    mm_log_warn("step %llu layer %d: %s; its %lld rows go to replicas",
                                (unsigned long long)step, L, op->why, (long long)op->n);
                    continue;
                }
                if (e->dev) {
                    // host replies first up to d_ys, then every reply's rows to their slots
                    if (!op->gpu)
                        MM_TRY(to_dev(e, e->d_ys + op->off * D, e->ys + op->off * D,
                                      op->n * D));
                    MM_TRY(e->be->ops->copy_rows(e->be->ctx, e->d_ys + op->off * D, D,
                                                 NULL, e->d_eo, D, e->d_slot + op->off, op->n,
                                                 D));
                }
                for (int64_t at = op->off; at < op->off + op->n; at++) {
                    int32_t t = e->slot_of[at];
                    if (!e->dev)
                        memcpy(e->eo + (int64_t)t * D, e->ys + at * D, (size_t)D * 4);
                    e->todo[t] = 0;
                }
                n_todo -= op->n;
            }
        }
        MM_TRY(mm_model_combine(e->model, e->scratch, L, DP(e, h), R, K, e->gw, DP(e, eo),
                                shared ? DP(e, sh) : NULL));
        mm_mesh_trace(step, L, "comb");
        if (h_out)
            MM_TRY(to_host(e, e->h, e->d_h, R * D));
    }
    return MM_OK;
}

void mm_step_engine_status_hook(void *arg) {
    mm_step_engine *e = arg;
    if (e && pthread_mutex_trylock(&e->mu) == 0) { // (busy: the line is <= 50 ms of steps old)
        mm_draft_detail_flush(e->dr);
        pthread_mutex_unlock(&e->mu);
    }
}

// ---- the hand-over between steps --------------------------------------------------------------
// A pipelined plan arrives long before the step it follows ends (0.8 ms at batch 1, 3 ms at 64
// concurrent on the H200) and its thread slept in the engine's lock: waking it after the unlock
// put 30-54 us between one step's reply and the next one's start (06:45 UTC trace). Instead it
// sleeps until the running step has picked its tokens (what is left is its results and reply,
// ~20 us), then spins on the lock (at most HANDOFF_SPIN_NS, then blocks). MM_ROUTER_HANDOFF=0:
// the plain lock; unset, the plain lock on hosts of fewer than HANDOFF_MIN_CPUS CPUs (there the
// spinning thread takes the replying step's core).
#define HANDOFF_SPIN_NS 2000000ull

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void tail_set(mm_step_engine *e, bool on) {
    pthread_mutex_lock(&e->tail_mu);
    atomic_store(&e->in_tail, on);
    if (on)
        pthread_cond_broadcast(&e->tail_cv);
    pthread_mutex_unlock(&e->tail_mu);
}

// wait_publish: a follow plan about to wait for the engine offers itself to be begun early by
// the step it follows (begin_next); wait_unpublish withdraws the offer once it has the engine.
static void wait_publish(mm_step_engine *e, const Mmctl__StepPlan *p) {
    if (!e->early || !p->after_step || atomic_load(&e->wait_p) != NULL)
        return;
    const Mmctl__StepPlan *none = NULL;
    atomic_compare_exchange_strong(&e->wait_p, &none, p);
}

static void wait_unpublish(mm_step_engine *e, const Mmctl__StepPlan *p) {
    const Mmctl__StepPlan *mine = p;
    atomic_compare_exchange_strong(&e->wait_p, &mine, NULL);
}

static void engine_lock(mm_step_engine *e, const Mmctl__StepPlan *p) {
    wait_publish(e, p);
    if (!e->handoff) {
        pthread_mutex_lock(&e->mu);
        return;
    }
    uint64_t spin_from = 0;
    while (pthread_mutex_trylock(&e->mu) != 0) {
        wait_publish(e, p); // (taken by a step that then did not begin it)
        if (atomic_load(&e->in_tail)) { // the running step is replying: the lock is near
            const uint64_t now = mm_now_ns();
            if (!spin_from)
                spin_from = now;
            if (now - spin_from > HANDOFF_SPIN_NS) {
                pthread_mutex_lock(&e->mu);
                break;
            }
            cpu_relax();
            continue;
        }
        spin_from = 0;
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        const struct timespec until = mm_timespec_add_ms(now, 1); // (then look at the lock)
        pthread_mutex_lock(&e->tail_mu);
        if (!atomic_load(&e->in_tail))
            pthread_cond_timedwait(&e->tail_cv, &e->tail_mu, &until);
        pthread_mutex_unlock(&e->tail_mu);
    }
    atomic_store(&e->in_tail, false);
}

// step_begin: a plan's start, up to its forward's first layer: its place after the step it
// follows, its checks, its active rows, and (rows > 0) run_start. A refusal of the whole plan is
// returned (msg set); *lrv is run_start's failure, which fails the rows. early (begin_next: the
// engine's step before it runs this on its own thread, its picks still on their way): the plan
// must take some of that step's pending picks (mm_follow_n_pending), pass its checks, and have
// every seq on a live shard, without draft rows or penalties;
// else MM_EBUSY, with nothing sent, released or drafted (the plan's own thread then begins it as
// usual).
static mm_err step_begin(mm_step_engine *e, const Mmctl__StepPlan **pp, bool early, int64_t *R_out,
                         mm_err *lrv, uint64_t *t0, char *msg) {
    const Mmctl__StepPlan *p = *pp;
    *R_out = 0;
    *lrv = MM_OK;
    mm_follow_arrived(e->fl, p->step_id); // (a plan that follows it now waits for it to run)
    // Pipelined plans: run after step after_step (waited for), follow seqs take its picks.
    mm_err rv = p->after_step && !early ? mm_follow_wait(e->fl, &e->mu, p->after_step,
                                                         e->c.step_timeout_ms, msg, MSG_LEN)
                                        : MM_OK;
    // The wait gave the lock up and took it back after another step's tail: that step's
    // in_tail would make the next plan spin its whole HANDOFF_SPIN_NS through this step.
    if (p->after_step && e->handoff && !early)
        atomic_store(&e->in_tail, false);
    if (rv == MM_OK) {
        p = mm_follow_resolve(e->fl, p, e->c.max_ctx);
        *pp = p;
        // (no draft rows: row i is seq i's one token; a plan that allows drafts is begun early
        // only while no drafter could give it any: the gateway allows them in every plan; the
        // trace names why an early begin was refused, docs/MESH.md)
        const bool may_draft = early && mm_draft_may_draft(e->dr);
        for (size_t i = 0; may_draft && i < p->n_seqs; i++)
            if (p->seqs[i]->max_draft != 0) {
                mm_mesh_trace(p->step_id, -1, "early_no_draft");
                return MM_EBUSY;
            }
        if (early && mm_follow_n_pending(e->fl) == 0) {
            mm_mesh_trace(p->step_id, -1, "early_no_pending");
            return MM_EBUSY;
        }
        rv = check_plan(e, p, early, msg);
        if (rv != MM_OK && early)
            mm_mesh_trace(p->step_id, -1, "early_no_check");
    }
    if (rv != MM_OK)
        return early ? MM_EBUSY : rv;
    mm_mesh_trace(p->step_id, -1, "checked");
    const int M = e->c.shards, N = e->c.owners;
    for (int s = 0; s < M; s++)
        peer_ensure(e, &e->shards[s]);
    if (e->E > 0 && p->n_seqs > 0) // a plan of releases only needs no owner
        for (int o = 0; o < N; o++)
            peer_ensure(e, &e->owners[o]);
    // early: every seq on a live shard (a seq of a shard that is down gets its error from the
    // plan's own thread) and without penalties (their counts would be fed the pending tokens)
    for (size_t i = 0; early && i < p->n_seqs; i++) {
        const struct peer *sp = &e->shards[p->seqs[i]->seq_id % (uint64_t)M];
        mm_sampling sp_i;
        mm_step_sampling_from_pb(p->seqs[i]->sampling, &sp_i);
        if (!sp->live || mm_sampling_has_penalty(&sp_i)) {
            mm_mesh_trace(p->step_id, -1, "early_no_shard");
            return MM_EBUSY;
        }
    }
    for (size_t i = 0; i < p->n_release; i++)
        mm_pen_table_release(e->pen, p->release[i]);
    // Active rows: the seqs of live shards, in plan order; each seq's tokens, then its drafts.
    *t0 = mm_now_ns();
    int64_t R = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        int s = (int)(q->seq_id % (uint64_t)M);
        e->seq_shard[i] = s;
        e->seq_failed[i] = false;
        e->seq_code[i] = 0;
        e->seq_msg[i][0] = 0;
        e->active[i] = e->shards[s].live && !mm_follow_dropped(e->fl, i, NULL);
        if (e->active[i])
            R += (int64_t)q->n_tokens;
    }
    mm_mesh_trace(p->step_id, -1, "linked");
    mm_draft_begin(e->dr, p, e->active, early ? 0 : (int64_t)e->c.max_tokens - R, e->n_draft,
                   e->draft);
    mm_mesh_trace(p->step_id, -1, "drafted");
    R = 0;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        int s = e->seq_shard[i];
        e->n_acc[i] = 0;
        if (!e->active[i]) {
            e->seq_row[i] = -1;
            e->seq_failed[i] = true;
            int32_t dcode = 0; // a follow entry that cannot run (step_follow.h), or shard down
            const char *dmsg = mm_follow_dropped(e->fl, i, &dcode);
            e->seq_code[i] = dmsg ? dcode : MM_EPEERDOWN;
            snprintf(e->seq_msg[i], MSG_LEN, "%s", dmsg ? dmsg : e->shards[s].why);
            continue;
        }
        e->seq_row[i] = (int32_t)R;
        e->seq_n[i] = (int32_t)(q->n_tokens + e->n_draft[i]);
        memcpy(e->ids + R, q->tokens, q->n_tokens * 4);
        memcpy(e->ids + R + q->n_tokens, e->draft + i * MM_DRAFT_MAX_K, e->n_draft[i] * 4);
        R += (int64_t)e->seq_n[i];
    }
    mm_mesh_trace(p->step_id, (int)R, "rows"); // (the layer field carries the row count)
    mm_mesh_trace(p->step_id, -1, "start");
    *R_out = R;
    if (R == 0 && p->n_release > 0)
        send_releases(e, p);
    if (R > 0)
        *lrv = run_start(e, p, R, early, msg);
    return MM_OK;
}

// begin_next: the step `prev` has started its picks' copy to the host; if the plan that follows
// it is waiting for the engine (wait_publish), begin it here (step_begin, early) so that its
// device work queues behind prev's. Returns whether it was begun: its thread goes on from there.
static bool begin_next(mm_step_engine *e, const Mmctl__StepPlan *prev) {
    const Mmctl__StepPlan *q = atomic_load(&e->wait_p);
    if (!q || q->after_step != prev->step_id ||
        !atomic_compare_exchange_strong(&e->wait_p, &q, NULL))
        return false;
    const Mmctl__StepPlan *rp = q;
    char msg[MSG_LEN] = "";
    int64_t R = 0;
    mm_err lrv = MM_OK;
    uint64_t t0 = 0;
    mm_mesh_trace(q->step_id, -1, "run");
    if (step_begin(e, &rp, true, &R, &lrv, &t0, msg) != MM_OK) {
        mm_mesh_trace(q->step_id, -1, "not_begun");
        return false;
    }
    e->begun = q;
    e->begun_p = rp;
    e->begun_R = R;
    e->begun_t0 = t0;
    e->begun_lrv = lrv;
    snprintf(e->begun_msg, MSG_LEN, "%s", msg);
    e->pred_rv = MM_OK;
    return true;
}

struct nng_msg *mm_step_engine_run(mm_step_engine *e, const Mmctl__StepPlan *p, uint64_t seq) {
    engine_lock(e, p);
    wait_unpublish(e, p);
    // a plan begun by the step before it runs next: another plan waits for its thread (which
    // may be waiting for in_tail in engine_lock: set it again, as engine_lock cleared it)
    while (e->begun && e->begun != p) {
        if (e->handoff)
            tail_set(e, true);
        pthread_cond_wait(&e->begun_cv, &e->mu);
    }
    char msg[MSG_LEN] = "";
    Mmctl__StepResult sr = MMCTL__STEP_RESULT__INIT;
    sr.step_id = p->step_id;
    sr.error = "";
    int64_t R = 0;
    uint64_t t0 = 0;
    mm_err lrv = MM_OK; // the forward's start failed (fails the active rows)
    bool begun = false, recorded = false;
    bool early = false; // picks left on the device, read after the next plan is begun
    uint64_t ticket = 0;
    int64_t ns_early = 0; // their count
    mm_err rv = MM_OK;
    if (e->begun == p) { // begun early: its checks, rows and forward's start are done
        begun = true;
        p = e->begun_p;
        R = e->begun_R;
        t0 = e->begun_t0;
        lrv = e->begun_lrv;
        snprintf(msg, MSG_LEN, "%s", e->begun_msg);
        e->begun = NULL;
        pthread_cond_broadcast(&e->begun_cv);
        mm_mesh_trace(p->step_id, -1, "taken");
    } else {
        mm_mesh_trace(p->step_id, -1, "run");
        e->pred_rv = MM_OK;
        rv = step_begin(e, &p, false, &R, &lrv, &t0, msg);
    }
    if (rv != MM_OK) {
        mm_log_warn("step %llu refused: %s", (unsigned long long)p->step_id, msg);
        sr.error_code = (uint32_t)rv;
        sr.error = msg;
        goto reply;
    }
    const int M = e->c.shards, N = e->c.owners;
    if (R > 0) {
        rv = lrv != MM_OK ? lrv : run_layers(e, p, R, begun, msg);
        mm_mesh_trace(p->step_id, -1, "layers");
        if (rv == MM_OK && e->pred_rv != MM_OK) { // its input picks never reached the host
            rv = e->pred_rv;
            snprintf(msg, MSG_LEN, "%s", e->early_msg);
        }
        e->pred_rv = MM_OK;
        if (rv != MM_OK) {
            if (!msg[0]) // a local stage that returned a code only: the requests still get a text
                snprintf(msg, MSG_LEN, "the router's forward pass of step %llu failed: %s",
                         (unsigned long long)p->step_id, mm_strerror(rv));
            mm_log_warn("step %llu failed (%lld rows): %s", (unsigned long long)p->step_id,
                        (long long)R, msg);
            fail_active(e, p, rv, msg);
            drop_pending(e->shards, M);
            drop_pending(e->owners, N);
            // A peer that failed mid-frame or answered an error is out of step: relink.
            for (int s = 0; s < M; s++)
                if (e->shards[s].conn && mm_conn_error(e->shards[s].conn) != MM_OK)
                    peer_drop(&e->shards[s]);
            for (int o = 0; o < N; o++)
                if (e->owners[o].conn && mm_conn_error(e->owners[o].conn) != MM_OK)
                    peer_drop(&e->owners[o]);
        } else {
            // final norm + head on the last row of each sampling seq and on its draft rows,
            // then sampling and verification.
            // (a device gathers them from d_h: no read of h)
            int64_t ns = 0, nsamp = 0;
            for (size_t i = 0; i < p->n_seqs; i++)
                if (e->seq_row[i] >= 0 && p->seqs[i]->sample) {
                    nsamp++;
                    int64_t r = e->seq_row[i] + (int64_t)p->seqs[i]->n_tokens - 1;
                    if (!e->dev)
                        memcpy(e->last + ns * e->D, e->h + r * e->D,
                               (size_t)e->D * 4 * (1 + e->n_draft[i]));
                    for (uint32_t k = 0; e->dev && k <= e->n_draft[i]; k++)
                        e->lrows[ns + k] = (int32_t)(r + k);
                    ns += 1 + e->n_draft[i];
                }
            // On a device, a step whose sampling seqs are all greedy, without penalties and
            // read no logprobs is picked there: ns ids come back instead of ns x vocab logits
            // (48 MB for 80 rows of a Qwen3 vocabulary) and no host scan runs.
            bool dev_pick = e->dev && ns > 0 && ns <= e->scratch_rows;
            for (size_t i = 0; i < p->n_seqs && dev_pick; i++) {
                const Mmctl__SeqStep *q = p->seqs[i];
                if (e->seq_row[i] < 0 || !q->sample)
                    continue;
                mm_sampling sp;
                mm_step_sampling_from_pb(q->sampling, &sp);
                dev_pick = q->no_logprob && q->logprobs == 0 && mm_sampler_is_greedy(&sp) &&
                           !mm_sampling_has_penalty(&sp);
            }
            // the rows wanted are h's first ns rows in order (decode steps without drafts:
            // one row per seq, every seq sampled): the final norm reads h itself, no gather
            bool in_order = e->dev;
            for (int64_t k = 0; k < ns && in_order; k++)
                in_order = e->lrows[k] == (int32_t)k;
            if (ns > 0) {
                rv = e->dev && !in_order
                         ? e->be->ops->set(e->be->ctx, e->d_lrows, e->lrows, (size_t)ns * 4)
                         : MM_OK;
                if (rv == MM_OK && e->dev && !in_order)
                    rv = e->be->ops->copy_rows(e->be->ctx, e->d_h, e->D, e->d_lrows, e->d_last,
                                               e->D, NULL, ns, e->D);
                if (rv == MM_OK)
                    rv = mm_model_final_norm(e->model, e->scratch, in_order ? e->d_h : DP(e, last),
                                             ns, DP(e, hn));
                if (rv == MM_OK)
                    rv = mm_model_head(e->model, e->scratch, DP(e, hn), ns, DP(e, logits));
                mm_mesh_trace(p->step_id, -1, "head");
                mm_mesh_gstamp(p->step_id, -1, "head");
                // Begun early (begin_next) can be the next plan of a step whose seqs are all
                // picked on the device, without draft rows: its picks stay on the device, where
                // the next step's embedding reads them, and come to the host by a fetch.
                early = rv == MM_OK && dev_pick && e->early && ns == nsamp &&
                        (size_t)ns * 4 <= MM_FETCH_BYTES &&
                        mm_model_can_overlap(e->model, e->scratch);
                if (early) {
                    const mm_err arv = mm_model_pick_async(e->model, e->scratch, DP(e, logits),
                                                           ns, &ticket);
                    if (arv != MM_OK) // (nothing issued: picked as below)
                        early = false;
                    else
                        mm_mesh_trace(p->step_id, -1, "fetch");
                    ns_early = ns;
                }
                if (rv == MM_OK && dev_pick && !early) {
                    const mm_err arv =
                        mm_model_argmax(e->model, e->scratch, DP(e, logits), ns, e->pick_ids);
                    if (arv == MM_EUNSUPP)
                        dev_pick = false; // no argmax on this backend: the host picks
                    else
                        rv = arv;
                }
                if (rv == MM_OK && !dev_pick)
                    rv = to_host(e, e->logits, e->d_logits, ns * (int64_t)e->V);
                if (rv != MM_OK) {
                    snprintf(msg, MSG_LEN, "LM head failed: %s", mm_strerror(rv));
                    fail_active(e, p, rv, msg);
                }
            }
            // Sampling in three passes: prepare each seq in order (penalty counts, its logits
            // row), pick them all (in parallel: independent, same bits), apply in order (draft
            // state, penalty counts of the sampled token).
            int64_t j = 0;
            int n_items = 0;
            for (size_t i = 0; i < p->n_seqs && rv == MM_OK; i++) {
                const Mmctl__SeqStep *q = p->seqs[i];
                e->lrow[i] = -1;
                if (e->seq_row[i] < 0)
                    continue;
                mm_sampling sp;
                mm_step_sampling_from_pb(q->sampling, &sp);
                // Penalties: the seq's token counts (its fed tokens first), per seq only.
                mm_pen_slot *ps = NULL;
                if (mm_sampling_has_penalty(&sp)) {
                    mm_err prv = mm_pen_table_get(e->pen, q->seq_id, &ps, e->seq_msg[i]);
                    if (prv == MM_OK)
                        prv = mm_pen_slot_feed(ps, q->pos, q->tokens, (uint32_t)q->n_tokens,
                                               e->seq_msg[i]);
                    if (prv != MM_OK) {
                        e->seq_failed[i] = true;
                        e->seq_code[i] = prv;
                        if (q->sample)
                            j += 1 + e->n_draft[i];
                        continue;
                    }
                    sp.hist = mm_pen_slot_hist(ps);
                }
                if (!q->sample)
                    continue;
                e->sp_of[i] = sp;
                e->ps_of[i] = ps;
                e->lrow[i] = j;
                e->items[n_items++] = (int32_t)i;
                j += 1 + e->n_draft[i];
            }
            // Verification of the draft rows (mm/spec.h): plain decoding's picks, drafts
            // accepted while they equal them.
            if (rv == MM_OK && early) // tokens when the picks come (after the next plan's begin)
                for (int k = 0; k < n_items; k++) {
                    const int32_t i = e->items[k];
                    e->smp[i].token = MM_FOLLOW_PENDING(e->lrow[i]); // (its pick: one row)
                    e->smp[i].logprob = 0;
                    e->smp[i].n_top = 0;
                    e->acc_of[i] = 0;
                    e->srv_of[i] = MM_OK;
                }
            else if (rv == MM_OK && dev_pick)
                for (int k = 0; k < n_items; k++)
                    pick_dev(e, e->items[k]);
            else if (rv == MM_OK)
                pool_run(e, p, n_items);
            for (int k = 0; k < n_items; k++) {
                const int32_t i = e->items[k];
                const Mmctl__SeqStep *q = p->seqs[i];
                const mm_err srv = (mm_err)e->srv_of[i];
                if (srv != MM_OK) {
                    e->seq_failed[i] = true;
                    e->seq_code[i] = srv;
                    continue;
                }
                e->n_acc[i] = e->acc_of[i];
                mm_draft_verified(e->dr, q, e->n_draft[i], e->acc_of[i],
                                  e->draft + i * MM_DRAFT_MAX_K);
                if (e->ps_of[i] != NULL) { // penalties (no drafts for these: step_draft.c)
                    const int64_t at = (int64_t)q->pos + (int64_t)q->n_tokens;
                    mm_err prv = mm_pen_slot_sampled(e->ps_of[i], at, e->smp[i].token,
                                                     e->seq_msg[i]);
                    if (prv != MM_OK) {
                        e->seq_failed[i] = true;
                        e->seq_code[i] = prv;
                    }
                }
            }
            if (!early) {
                mm_mesh_trace(p->step_id, -1, "picked");
                if (e->handoff)
                    tail_set(e, true); // a plan waiting for the lock may start spinning
            }
            mm_log_debug("step %llu: %lld rows in %.3f ms", (unsigned long long)p->step_id,
                         (long long)R, (double)(mm_now_ns() - t0) / 1e6);
        }
    }
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Mmctl__SeqStep *q = p->seqs[i];
        Mmctl__SeqResult *r = &e->res[i];
        mmctl__seq_result__init(r);
        r->seq_id = q->seq_id;
        r->token = -1;
        r->error = "";
        if (e->seq_failed[i]) {
            r->error_code = (uint32_t)e->seq_code[i];
            r->error = e->seq_msg[i];
        } else if (q->sample) {
            const mm_sample *s = &e->smp[i];
            r->token = s->token;
            r->logprob = s->logprob;
            r->n_top = s->n_top;
            r->drafted = e->n_draft[i];
            r->n_more = r->n_more_logprobs = e->n_acc[i];
            r->more = e->draft_tok + i * MM_DRAFT_MAX_K;
            r->more_logprobs = e->draft_lp + i * MM_DRAFT_MAX_K;
            r->top = e->top_p + i * MM_SAMPLER_MAX_TOP;
            for (uint32_t k = 0; k < s->n_top; k++) {
                Mmctl__TopLogprob *t = &e->top[i * MM_SAMPLER_MAX_TOP + k];
                mmctl__top_logprob__init(t);
                t->token = s->top_ids[k];
                t->logprob = s->top_logprobs[k];
                r->top[k] = t;
            }
        }
        e->res_p[i] = r;
    }
    sr.n_results = p->n_seqs;
    sr.results = e->res_p;
    mm_draft_end(e->dr, mm_now_ns() - t0);
    if (early) {
        // The results are built but for their tokens: record them pending, begin the plan that
        // follows (if it waits), then read the picks. From here on the per-seq arrays belong to
        // the plan begun; this step answers from e->res alone.
        mm_follow_record(e->fl, p, e->res_p, sr.n_results, 0, "");
        recorded = true;
        const bool next = begin_next(e, p);
        const mm_err prv = mm_model_pick_wait(e->model, e->scratch, ticket, e->pick_ids);
        if (prv == MM_OK) {
            for (size_t i = 0; i < p->n_seqs; i++)
                if (e->res[i].error_code == 0 && MM_FOLLOW_IS_PENDING(e->res[i].token))
                    e->res[i].token = e->pick_ids[MM_FOLLOW_PICK(e->res[i].token)];
            mm_follow_set_tokens(e->fl, p->step_id, e->pick_ids, (size_t)ns_early);
            if (next) // the begun plan's tokens, for the drafting histories
                mm_draft_fed(e->dr, e->begun_p, e->pick_ids, (size_t)ns_early);
        } else {
            snprintf(e->early_msg, MSG_LEN, "reading step %llu's picks from the device failed: %s",
                     (unsigned long long)p->step_id, mm_strerror(prv));
            mm_log_warn("%s", e->early_msg);
            for (size_t i = 0; i < p->n_seqs; i++) {
                e->res[i].token = -1;
                e->res[i].error_code = (uint32_t)prv;
                e->res[i].error = e->early_msg;
            }
            mm_follow_fail(e->fl, p->step_id, prv, e->early_msg);
            if (next) // its rows embedded these picks: they fail too (with early_msg)
                e->pred_rv = prv;
        }
        mm_mesh_trace(p->step_id, -1, "picked");
        if (e->handoff)
            tail_set(e, true);
    }
reply:;
    if (e->handoff && !atomic_load(&e->in_tail)) // (a step that picked nothing: refused, failed)
        tail_set(e, true);
    if (!recorded)
        mm_follow_record(e->fl, p, e->res_p, sr.n_results, sr.error_code, sr.error);
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STEP_RESULT;
    env.step_result = &sr;
    env.seq = seq;
    struct nng_msg *out = mm_ctl_reply(&env);
    mm_mesh_trace(p->step_id, -1, "reply");
    mm_mesh_trace_flush();
    mm_mesh_gtrace_flush();
    pthread_mutex_unlock(&e->mu);
    return out;
}
