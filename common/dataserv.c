// SPDX-License-Identifier: MIT
// Data-plane server thread for shards and owners (see mm/dataserv.h).
#include "mm/dataserv.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "mm/log.h"

struct mm_dataserv {
    mm_listener *l;
    pthread_t th;
    bool started;
    atomic_bool stop;
    size_t cap;
    void *buf; // (cap) frame payloads
    void *d_buf; // (d_cap) device frames' payloads (the role's device buffer), or NULL
    size_t d_cap;
    bool view;   // device frames handed over in place (mm_dataserv_start_view)
    mm_dataserv_fn fn;
    mm_dataserv_tick tick;
    int tick_ms;
    void *arg;
    char url[MM_URL_MAX];
};

mm_err mm_dataserv_reply_error(mm_conn *c, const mm_wire_hdr *req, mm_err code,
                               const char *msg) {
    mm_wire_hdr h;
    uint32_t n = (uint32_t)strlen(msg);
    MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_ERROR, MM_WIRE_BYTES, req->step_id, req->layer, 1, n));
    h.aux = (uint32_t)code;
    h.row_base = req->row_base;
    return mm_conn_send(c, &h, msg, mm_deadline_in_ms(1000));
}

static _Thread_local const void *tl_view; // the device payload being handled, or NULL

bool mm_dataserv_on_dev(const void *payload) {
    return payload != NULL && payload == tl_view;
}

static void *serve(void *arg) {
    mm_dataserv *s = arg;
    uint64_t next_tick = mm_now_ms() + (uint64_t)s->tick_ms;
    while (!atomic_load(&s->stop)) {
        mm_conn *c = NULL;
        char err[MM_ERRLEN] = "";
        // A long accept deadline: a dialer that arrives near its end still gets time for the
        // handshake, and mm_listener_shutdown wakes the accept at once when stopping.
        uint64_t wait_ms = s->tick ? (uint64_t)s->tick_ms : 1000;
        mm_err rv = mm_listener_accept(s->l, &c, mm_deadline_in_ms(wait_ms < 1000 ? 1000 : wait_ms),
                                       err);
        if (s->tick && mm_now_ms() >= next_tick) {
            s->tick(s->arg);
            next_tick = mm_now_ms() + (uint64_t)s->tick_ms;
        }
        if (rv == MM_ETIMEDOUT)
            continue;
        if (rv != MM_OK) {
            if (rv != MM_ECLOSED)
                mm_log_warn("data %s: accept: %s (%s)", s->url, mm_strerror(rv), err);
            continue;
        }
        mm_log_info("data %s: router connected", s->url);
        while (!atomic_load(&s->stop)) {
            mm_wire_hdr h;
            bool on_dev = false;
            const void *view = NULL;
            if (s->view && mm_conn_dev(c)) {
                rv = mm_conn_recv_view(c, &h, s->buf, s->cap, &view, mm_deadline_in_ms(100));
                on_dev = view != NULL;
            } else if (s->d_buf != NULL && mm_conn_dev(c)) {
                struct iovec dv = {.iov_base = s->d_buf, .iov_len = s->d_cap};
                rv = mm_conn_recv_dev(c, &h, s->buf, s->cap, &dv, 1, &on_dev,
                                      mm_deadline_in_ms(100));
            } else {
                rv = mm_conn_recv(c, &h, s->buf, s->cap, mm_deadline_in_ms(100));
            }
            if (s->tick && mm_now_ms() >= next_tick) {
                s->tick(s->arg);
                next_tick = mm_now_ms() + (uint64_t)s->tick_ms;
            }
            if (rv == MM_ETIMEDOUT && mm_conn_error(c) == MM_OK)
                continue;
            if (rv == MM_EFULL) {
                char msg[128];
                snprintf(msg, sizeof(msg), "frame of %llu bytes is over this daemon's limit of "
                         "%zu (--max-batch-tokens)", (unsigned long long)h.payload_bytes,
                         on_dev ? s->d_cap : s->cap);
                mm_log_warn("data %s: %s", s->url, msg);
                if (mm_dataserv_reply_error(c, &h, MM_EFULL, msg) == MM_OK)
                    continue;
                break;
            }
            if (rv != MM_OK) {
                if (rv != MM_ECLOSED)
                    mm_log_warn("data %s: conn ended: %s", s->url, mm_strerror(rv));
                break;
            }
            if (on_dev && h.kind != MM_WIRE_ROWS) {
                // handlers read every other kind on the host (CTRL lists): a device pointer
                // there would be dereferenced by the CPU
                char msg[128];
                snprintf(msg, sizeof(msg), "a %s frame as device rows (device frames carry "
                         "rows only)", mm_wire_kind_name(h.kind));
                mm_log_warn("data %s: %s", s->url, msg);
                if (mm_dataserv_reply_error(c, &h, MM_EPROTO, msg) == MM_OK)
                    continue;
                break;
            }
            void *payload = view ? (void *)view : on_dev ? s->d_buf : s->buf;
            tl_view = view;
            mm_err hr = s->fn(s->arg, c, &h, payload);
            tl_view = NULL;
            if (hr != MM_OK) { // (a protocol violation, or a send that failed: named here)
                mm_log_warn("data %s: a %s frame (step %llu, layer %d) ended the conn: %s",
                            s->url, mm_wire_kind_name(h.kind), (unsigned long long)h.step_id,
                            h.layer == MM_WIRE_NO_LAYER ? -1 : (int)h.layer, mm_strerror(hr));
                break;
            }
        }
        mm_conn_close(c);
        mm_log_info("data %s: router disconnected; accepting again", s->url);
    }
    return NULL;
}

mm_err mm_dataserv_start(mm_dataserv **out, const char *url, size_t payload_cap,
                         mm_dataserv_fn fn, mm_dataserv_tick tick, int tick_ms, void *arg,
                         char err[MM_ERRLEN]) {
    return mm_dataserv_start_dev(out, url, payload_cap, NULL, 0, fn, tick, tick_ms, arg, err);
}

static mm_err start(mm_dataserv **out, const char *url, size_t payload_cap, void *d_buf,
                    size_t d_cap, bool view, mm_dataserv_fn fn, mm_dataserv_tick tick,
                    int tick_ms, void *arg, char err[MM_ERRLEN]);

mm_err mm_dataserv_start_dev(mm_dataserv **out, const char *url, size_t payload_cap, void *d_buf,
                             size_t d_cap, mm_dataserv_fn fn, mm_dataserv_tick tick, int tick_ms,
                             void *arg, char err[MM_ERRLEN]) {
    return start(out, url, payload_cap, d_buf, d_cap, false, fn, tick, tick_ms, arg, err);
}

mm_err mm_dataserv_start_view(mm_dataserv **out, const char *url, size_t payload_cap,
                              mm_dataserv_fn fn, mm_dataserv_tick tick, int tick_ms, void *arg,
                              char err[MM_ERRLEN]) {
    return start(out, url, payload_cap, NULL, 0, true, fn, tick, tick_ms, arg, err);
}

static mm_err start(mm_dataserv **out, const char *url, size_t payload_cap, void *d_buf,
                    size_t d_cap, bool view, mm_dataserv_fn fn, mm_dataserv_tick tick,
                    int tick_ms, void *arg, char err[MM_ERRLEN]) {
    *out = NULL;
    mm_dataserv *s = calloc(1, sizeof(*s));
    if (!s)
        return MM_ENOMEM;
    s->view = view;
    s->cap = payload_cap;
    s->d_buf = d_buf;
    s->d_cap = d_buf ? d_cap : 0;
    s->buf = aligned_alloc(64, (payload_cap + 63) / 64 * 64);
    s->fn = fn;
    s->tick = tick;
    s->tick_ms = tick_ms > 0 ? tick_ms : 1000;
    s->arg = arg;
    snprintf(s->url, sizeof(s->url), "%s", url);
    mm_err rv = MM_OK;
    if (!s->buf) {
        rv = MM_ENOMEM;
        goto fail;
    }
    MM_TRY_GOTO(rv, mm_transport_listen(&s->l, url, err), fail);
    if (pthread_create(&s->th, NULL, serve, s) != 0) {
        rv = mm_errf(err, MM_ESYS, "cannot start the data thread");
        goto fail;
    }
    s->started = true;
    *out = s;
    return MM_OK;
fail:
    mm_dataserv_stop(s);
    return rv;
}

void mm_dataserv_stop(mm_dataserv *s) {
    if (!s)
        return;
    atomic_store(&s->stop, true);
    if (s->l)
        mm_listener_shutdown(s->l);
    if (s->started)
        pthread_join(s->th, NULL);
    mm_listener_close(s->l);
    free(s->buf);
    free(s);
}
