// SPDX-License-Identifier: MIT
// The gateway's mesh-facing side; see gateway.h.
//
// Design notes (DEPENDENCIES.md section 3): an nng completion runs on an nng thread; it only
// pushes its call on a mutex-guarded list and calls uv_async_send. on_wake, on the loop thread,
// drains the whole list (uv_async_send coalesces wake-ups), runs the callbacks of calls that are
// still attached and frees every call. n_inflight counts calls started and not yet freed, so
// that close can wait for them with a deadline.
// - Step calls complete in the order they were started (pipelined plans: the scheduler has up
//   to 2 in flight and reads their results in plan order): a step call that completes before
//   an earlier one is held until that one has completed.
// - MM_MESH_TRACE (docs/MESH.md): step calls stamp "queue" (handed to the sender thread, when
//   there is one), "send" and "sent" (around the pack and send), "recv" (nng completed) and "done" (the
//   scheduler's callback returned: tokens delivered, the next plan handed over), role
//   "gateway"; kernels/cuda/bench/mesh_trace.py sums them.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway.h"
#include "mm/log.h"
#include "mm/mesh_trace.h"
#include "mm/time.h"

struct gw_call {
    gw_mesh *mesh;
    mm_ctl_async *async;
    gw_status_cb cb;      // a status call
    gw_step_cb step_cb;   // or a step call
    void *arg;
    uint64_t t_done_ns;   // when nng completed the call (mm_now_ns, on the nng thread)
    // step calls start on the sender thread: the plan (borrowed) and a start failure
    mm_ctl_msg *plan;
    int timeout_ms;
    mm_err start_rv;
    char start_err[MM_ERRLEN];
    bool detached;    // loop thread only
    bool completed;   // loop thread only: a step call done, held for an earlier one
    gw_call *next;    // in mesh->done or the sender's queue, under mesh->mu
};

#define MAX_STEP_CALLS 8 // step calls in flight (the scheduler keeps at most 2)

struct gw_mesh {
    uv_loop_t *loop;
    uv_async_t wake;
    bool wake_open;
    mm_ctl_client *client;
    pthread_mutex_t mu; // guards done
    gw_call *done;
    int n_inflight;     // loop thread only
    // The sender thread hands step plans to nng (packing and nng_ctx_send cost about 100 us
    // on the 2-core VM), so the loop writes the last step's tokens to the clients meanwhile.
    pthread_t sender;
    bool sender_running, sender_stop;
    pthread_cond_t cv;  // under mu
    gw_call *to_send, *to_send_tail; // under mu: step plans waiting for the sender, FIFO
    gw_call *steps[MAX_STEP_CALLS];  // loop thread only: step calls in start order
    int n_steps;
};

static uint64_t call_step(const gw_call *c) {
    return c->plan && c->plan->body_case == MMCTL__ENVELOPE__BODY_STEP_PLAN && c->plan->step_plan
               ? c->plan->step_plan->step_id
               : 0;
}

static void on_nng_done(mm_ctl_async *a, void *arg) {
    (void)a;
    gw_call *c = arg;
    gw_mesh *m = c->mesh;
    c->t_done_ns = mm_now_ns();
    if (c->step_cb)
        mm_mesh_trace(call_step(c), -1, "recv");
    pthread_mutex_lock(&m->mu);
    c->next = m->done;
    m->done = c;
    pthread_mutex_unlock(&m->mu);
    uv_async_send(&m->wake);
}

static void finish(gw_call *c) {
    gw_mesh *m = c->mesh;
    mm_ctl_msg *reply = NULL;
    char err[MM_ERRLEN] = "";
    mm_err rv = c->async ? mm_ctl_async_result(c->async, &reply, err) : c->start_rv;
    if (!c->async)
        snprintf(err, sizeof(err), "%s", c->start_err);
    if (!c->detached && c->step_cb) {
        const uint64_t step = call_step(c); // (the callback may free the plan)
        c->step_cb(c->arg, rv, rv == MM_OK ? reply : NULL, err, c->t_done_ns);
        mm_mesh_trace(step, -1, "done");
        mm_mesh_trace_flush();
    } else if (!c->detached) {
        if (rv == MM_OK && reply->body_case != MMCTL__ENVELOPE__BODY_STATUS_REPLY) {
            rv = MM_EPROTO;
            snprintf(err, sizeof(err), "router answered status with %s", mm_ctl_body_name(reply));
        }
        c->cb(c->arg, rv, rv == MM_OK ? reply->status_reply : NULL, err);
    }
    mm_ctl_msg_free(reply);
    mm_ctl_async_free(c->async);
    free(c);
    m->n_inflight--;
}

static gw_call *take_done(gw_mesh *m) {
    pthread_mutex_lock(&m->mu);
    gw_call *list = m->done;
    m->done = NULL;
    pthread_mutex_unlock(&m->mu);
    return list;
}

static void on_wake(uv_async_t *h) {
    gw_mesh *m = h->data;
    for (gw_call *c = take_done(m), *next; c; c = next) {
        next = c->next;
        bool queued = false;
        for (int i = 0; i < m->n_steps && !queued; i++)
            queued = m->steps[i] == c;
        if (queued)
            c->completed = true; // delivered below, in start order
        else
            finish(c);
    }
    while (m->n_steps > 0 && m->steps[0]->completed) {
        gw_call *c = m->steps[0];
        memmove(m->steps, m->steps + 1, (size_t)(m->n_steps - 1) * sizeof(m->steps[0]));
        m->n_steps--;
        finish(c);
    }
}

static void *sender_main(void *arg) {
    gw_mesh *m = arg;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        while (!m->to_send && !m->sender_stop)
            pthread_cond_wait(&m->cv, &m->mu);
        if (m->sender_stop && !m->to_send)
            break;
        gw_call *c = m->to_send;
        m->to_send = c->next;
        if (!m->to_send)
            m->to_send_tail = NULL;
        c->next = NULL;
        pthread_mutex_unlock(&m->mu);
        const uint64_t step = call_step(c);
        mm_mesh_trace(step, -1, "send");
        c->start_rv = m->sender_stop ? MM_ECLOSED
                                     : mm_ctl_call_start(m->client, c->plan, c->timeout_ms,
                                                         on_nng_done, c, &c->async, c->start_err);
        mm_mesh_trace(step, -1, "sent");
        if (c->start_rv != MM_OK) {
            if (m->sender_stop)
                snprintf(c->start_err, sizeof(c->start_err), "the gateway is shutting down");
            c->async = NULL;
            on_nng_done(NULL, c); // completes through the loop like any failed call
        }
        pthread_mutex_lock(&m->mu);
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

mm_err gw_mesh_open(gw_mesh **out, uv_loop_t *loop, const char *router_url, char err[MM_ERRLEN]) {
    *out = NULL;
    gw_mesh *m = calloc(1, sizeof(*m));
    if (!m)
        return MM_ENOMEM;
    m->loop = loop;
    pthread_mutex_init(&m->mu, NULL);
    mm_mesh_trace_open("gateway"); // MM_MESH_TRACE: the step calls' hops
    mm_err rv = mm_ctl_client_open(&m->client, router_url, err);
    if (rv != MM_OK) {
        pthread_mutex_destroy(&m->mu);
        free(m);
        return rv;
    }
    uv_async_init(loop, &m->wake, on_wake);
    m->wake.data = m;
    m->wake_open = true;
    pthread_cond_init(&m->cv, NULL);
    // MM_GATEWAY_SEND_THREAD=1 hands plans to a sender thread, so that packing and nng's send
    // overlap the loop's socket writes. Off by default: on the 2-vCPU VM under load the thread
    // wake-up cost more than the send it moved (docs/BENCHMARKS.md, gateway overhead).
    const char *st = getenv("MM_GATEWAY_SEND_THREAD");
    if (st && st[0] == '1' && pthread_create(&m->sender, NULL, sender_main, m) == 0)
        m->sender_running = true;
    *out = m;
    return MM_OK;
}

mm_err gw_mesh_status(gw_mesh *m, int timeout_ms, gw_status_cb cb, void *arg, gw_call **call,
                      char err[MM_ERRLEN]) {
    *call = NULL;
    gw_call *c = calloc(1, sizeof(*c));
    if (!c)
        return MM_ENOMEM;
    c->mesh = m;
    c->cb = cb;
    c->arg = arg;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    Mmctl__StatusRequest sr = MMCTL__STATUS_REQUEST__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    mm_err rv = mm_ctl_call_start(m->client, &env, timeout_ms, on_nng_done, c, &c->async, err);
    if (rv != MM_OK) {
        free(c);
        return rv;
    }
    m->n_inflight++;
    *call = c;
    return MM_OK;
}

mm_err gw_mesh_step(gw_mesh *m, mm_ctl_msg *plan, int timeout_ms, gw_step_cb cb, void *arg,
                    gw_call **call, char err[MM_ERRLEN]) {
    *call = NULL;
    gw_call *c = calloc(1, sizeof(*c));
    if (!c)
        return MM_ENOMEM;
    c->mesh = m;
    c->step_cb = cb;
    c->arg = arg;
    c->plan = plan;
    c->timeout_ms = timeout_ms;
    if (!m->sender_running) {
        mm_mesh_trace(call_step(c), -1, "send");
        mm_err rv = mm_ctl_call_start(m->client, plan, timeout_ms, on_nng_done, c, &c->async,
                                      err);
        mm_mesh_trace(call_step(c), -1, "sent"); // (c is not freed before the loop runs)
        if (rv != MM_OK) {
            free(c);
            return rv;
        }
    } else {
        mm_mesh_trace(call_step(c), -1, "queue");
        pthread_mutex_lock(&m->mu);
        c->next = NULL; // (pipelined plans: the next may queue behind the one being sent)
        if (m->to_send_tail)
            m->to_send_tail->next = c;
        else
            m->to_send = c;
        m->to_send_tail = c;
        pthread_cond_signal(&m->cv);
        pthread_mutex_unlock(&m->mu);
    }
    if (m->n_steps < MAX_STEP_CALLS)
        m->steps[m->n_steps++] = c;
    m->n_inflight++;
    *call = c;
    return MM_OK;
}

void gw_call_detach(gw_call *c) { c->detached = true; }

const char *gw_mesh_router_url(const gw_mesh *m) { return mm_ctl_client_url(m->client); }

void gw_mesh_abort(gw_mesh *m) {
    if (m)
        mm_ctl_client_abort(m->client);
}

static void sender_join(gw_mesh *m) {
    if (!m->sender_running)
        return;
    pthread_mutex_lock(&m->mu);
    m->sender_stop = true;
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->mu);
    pthread_join(m->sender, NULL);
    m->sender_running = false;
}

void gw_mesh_close(gw_mesh *m) {
    if (!m)
        return;
    sender_join(m); // a plan still waiting completes with MM_ECLOSED
    mm_ctl_client_abort(m->client);
    for (int i = 0; i < m->n_steps; i++) // completed, held for an earlier one: free them
        if (m->steps[i]->completed) {
            m->steps[i]->detached = true;
            finish(m->steps[i]);
        }
    m->n_steps = 0; // the others are finished below, in any order
    // Every call in flight now completes with MM_ECLOSED on an nng thread; collect them here
    // (the loop is no longer running), bounded in case nng misbehaves.
    uint64_t deadline = mm_now_ms() + 2000;
    while (m->n_inflight > 0 && mm_now_ms() < deadline) {
        gw_call *list = take_done(m);
        if (!list) {
            nanosleep(&(struct timespec){0, 1000000}, NULL);
            continue;
        }
        for (gw_call *next; list; list = next) {
            next = list->next;
            list->detached = true;
            finish(list);
        }
    }
    if (m->n_inflight > 0)
        mm_log_warn("%d router calls still in flight at shutdown", m->n_inflight);
    if (m->wake_open)
        uv_close((uv_handle_t *)&m->wake, NULL);
    m->wake_open = false;
}

void gw_mesh_free(gw_mesh *m) {
    if (!m)
        return;
    sender_join(m);
    mm_ctl_client_close(m->client);
    pthread_cond_destroy(&m->cv);
    pthread_mutex_destroy(&m->mu);
    free(m);
}
