// SPDX-License-Identifier: MIT
// The data-plane transport table (mm/transport.h): URL parsing, scheme lookup, and the
// generic layer every transport shares (argument checks, frame sealing and conn_seq
// checking, the sticky error, wait_any over mixed schemes).
//
// Design notes:
// - Adding a transport: write common/transport/<scheme>.c defining
//   `const struct mm_transport_ops mm__transport_<scheme>` and add <scheme> to
//   MM_TRANSPORT_LIST below. Nothing else changes.
// - conn_seq is stamped here on send and checked here on receive, so every provider gets the
//   same lost/duplicated-frame detection. A mismatch breaks the conn with MM_EPROTO.
// - The generic sticky error (gerr) covers failures found here; the provider keeps its own
//   (ops->status). mm_conn_error reports whichever is set.
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mm/log.h"
#include "mm/transport.h"
#include "transport_int.h"

#define MM_TRANSPORT_LIST(X) X(shm) X(tcp) X(rdma) X(cudaipc)

#define X(name) extern const struct mm_transport_ops mm__transport_##name;
MM_TRANSPORT_LIST(X)
#undef X

static const struct mm_transport_ops *const transports[] = {
#define X(name) &mm__transport_##name,
    MM_TRANSPORT_LIST(X)
#undef X
};
#define N_TRANSPORTS (sizeof(transports) / sizeof(transports[0]))

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static bool inited[N_TRANSPORTS];

struct mm_listener {
    const struct mm_transport_ops *ops;
    void *ctx;
    char url[MM_URL_MAX];
};

struct mm_conn {
    const struct mm_transport_ops *ops;
    void *ctx;
    _Atomic int gerr;    // sticky error found by the generic layer (mm_err), 0 when none
    uint64_t tx_seq;     // next conn_seq to stamp; touched by the sending thread only
    uint64_t rx_seq;     // next conn_seq expected; touched by the receiving thread only
    char url[MM_URL_MAX];
};

// ---- tunables -------------------------------------------------------------------------------

uint64_t mm__transport_spin_ns(void) {
    static _Atomic uint64_t cached; // 0: not read yet; stored +1 so that 0 us is representable
    uint64_t v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v == 0) {
        const char *s = getenv("MM_TRANSPORT_SPIN_US");
        uint64_t us = 50; // bounded spin before sleeping; see docs/BENCHMARKS.md
        if (s != NULL && *s != '\0') {
            char *end = NULL;
            unsigned long long x = strtoull(s, &end, 10);
            if (end != NULL && *end == '\0' && x <= 1000000ull)
                us = x;
        }
        v = us * 1000ull + 1;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v - 1;
}

int mm__deadline_timeout_ms(uint64_t deadline_ns) {
    if (deadline_ns == MM_DEADLINE_NONE)
        return -1;
    uint64_t now = mm_now_ns();
    if (now >= deadline_ns)
        return 0;
    uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
    return ms > 60000 ? 60000 : (int)ms; // callers loop, re-checking the deadline
}

// ---- URLs -----------------------------------------------------------------------------------

mm_err mm_url_parse(mm_url *out, const char *s, char err[MM_ERRLEN]) {
    memset(out, 0, sizeof(*out));
    out->port = -1;
    if (s == NULL || *s == '\0')
        return mm_errf(err, MM_EINVAL, "empty transport URL");
    if (strlen(s) >= MM_URL_MAX)
        return mm_errf(err, MM_EINVAL, "transport URL longer than %d bytes", MM_URL_MAX - 1);
    snprintf(out->text, sizeof(out->text), "%s", s);
    const char *sep = strstr(s, "://");
    if (sep == NULL)
        return mm_errf(err, MM_EINVAL, "transport URL '%s' has no scheme:// prefix", s);
    size_t sl = (size_t)(sep - s);
    if (sl == 0 || sl >= sizeof(out->scheme))
        return mm_errf(err, MM_EINVAL, "transport URL '%s': bad scheme length", s);
    for (size_t i = 0; i < sl; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '+'))
            return mm_errf(err, MM_EINVAL, "transport URL '%s': bad character in scheme", s);
    }
    memcpy(out->scheme, s, sl);
    const char *rest = sep + 3;
    const char *q = strchr(rest, '?');
    size_t rl = q ? (size_t)(q - rest) : strlen(rest);
    if (q != NULL)
        snprintf(out->query, sizeof(out->query), "%s", q + 1);
    if (rl == 0)
        return mm_errf(err, MM_EINVAL, "transport URL '%s' has no host or name", s);
    char hp[MM_URL_MAX];
    memcpy(hp, rest, rl);
    hp[rl] = '\0';
    char *portp = NULL;
    if (hp[0] == '[') {
        char *rb = strchr(hp, ']');
        if (rb == NULL)
            return mm_errf(err, MM_EINVAL, "transport URL '%s': unterminated [IPv6]", s);
        *rb = '\0';
        snprintf(out->host, sizeof(out->host), "%s", hp + 1);
        if (rb[1] == ':')
            portp = rb + 2;
        else if (rb[1] != '\0')
            return mm_errf(err, MM_EINVAL, "transport URL '%s': junk after [IPv6]", s);
    } else {
        char *colon = strrchr(hp, ':');
        if (colon != NULL) {
            *colon = '\0';
            portp = colon + 1;
        }
        snprintf(out->host, sizeof(out->host), "%s", hp);
    }
    if (out->host[0] == '\0')
        return mm_errf(err, MM_EINVAL, "transport URL '%s' has an empty host", s);
    if (portp != NULL) {
        char *end = NULL;
        errno = 0;
        long p = strtol(portp, &end, 10);
        if (*portp == '\0' || end == NULL || *end != '\0' || errno != 0 || p < 0 || p > 65535)
            return mm_errf(err, MM_EINVAL, "transport URL '%s': port '%s' is not 0..65535", s,
                           portp);
        out->port = (int)p;
    }
    return MM_OK;
}

mm_err mm_url_query_u64(const mm_url *url, const char *key, uint64_t *out) {
    size_t kl = strlen(key);
    const char *p = url->query;
    while (*p != '\0') {
        const char *amp = strchr(p, '&');
        size_t len = amp ? (size_t)(amp - p) : strlen(p);
        if (len > kl && strncmp(p, key, kl) == 0 && p[kl] == '=') {
            char buf[32];
            size_t vl = len - kl - 1;
            if (vl == 0 || vl >= sizeof(buf))
                return MM_EINVAL;
            memcpy(buf, p + kl + 1, vl);
            buf[vl] = '\0';
            char *end = NULL;
            errno = 0;
            unsigned long long v = strtoull(buf, &end, 10);
            if (errno != 0 || *end != '\0' || buf[0] == '-')
                return MM_EINVAL;
            *out = v;
            return MM_OK;
        }
        p += len;
        if (*p == '&')
            p++;
    }
    return MM_ENOENT;
}

// ---- registry -------------------------------------------------------------------------------

void mm_transport_schemes(char *buf, size_t cap) {
    size_t off = 0;
    if (cap == 0)
        return;
    buf[0] = '\0';
    for (size_t i = 0; i < N_TRANSPORTS && off < cap; i++) {
        int n = snprintf(buf + off, cap - off, "%s%s", i ? ", " : "", transports[i]->scheme);
        if (n < 0)
            break;
        off += (size_t)n;
    }
}

static mm_err lookup(const char *text, mm_url *url, const struct mm_transport_ops **ops,
                     char err[MM_ERRLEN]) {
    MM_TRY(mm_url_parse(url, text, err));
    for (size_t i = 0; i < N_TRANSPORTS; i++) {
        const struct mm_transport_ops *o = transports[i];
        if (strcmp(o->scheme, url->scheme) != 0)
            continue;
        if (o->version != MM_TRANSPORT_V1)
            return mm_errf(err, MM_EUNSUPP, "transport %s:// has interface version %u, "
                           "this build needs %u", o->scheme, o->version, MM_TRANSPORT_V1);
        mm_err rv = MM_OK;
        pthread_mutex_lock(&init_mu);
        if (!inited[i]) {
            if (o->init != NULL)
                rv = o->init(err);
            if (rv == MM_OK)
                inited[i] = true;
        }
        pthread_mutex_unlock(&init_mu);
        if (rv != MM_OK)
            return rv;
        *ops = o;
        return MM_OK;
    }
    char known[128];
    mm_transport_schemes(known, sizeof(known));
    return mm_errf(err, MM_ENOENT, "no data-plane transport for '%s://' in '%s' (known: %s)",
                   url->scheme, text, known);
}

void mm_transport_fini(void) {
    pthread_mutex_lock(&init_mu);
    for (size_t i = 0; i < N_TRANSPORTS; i++) {
        if (inited[i] && transports[i]->fini != NULL)
            transports[i]->fini();
        inited[i] = false;
    }
    pthread_mutex_unlock(&init_mu);
}

// ---- listeners ------------------------------------------------------------------------------

mm_err mm_transport_listen(mm_listener **out, const char *url, char err[MM_ERRLEN]) {
    if (out == NULL)
        return mm_errf(err, MM_EINVAL, "mm_transport_listen: out is NULL");
    *out = NULL;
    mm_url u;
    const struct mm_transport_ops *ops = NULL;
    MM_TRY(lookup(url, &u, &ops, err));
    mm_listener *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return mm_errf(err, MM_ENOMEM, "listener for %s", url);
    l->ops = ops;
    snprintf(l->url, sizeof(l->url), "%s", u.text);
    mm_err rv = ops->listen(&l->ctx, &u, err);
    if (rv != MM_OK) {
        free(l);
        return rv;
    }
    *out = l;
    return MM_OK;
}

static mm_conn *conn_wrap(const struct mm_transport_ops *ops, void *ctx, const char *url) {
    mm_conn *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        ops->close(ctx);
        return NULL;
    }
    c->ops = ops;
    c->ctx = ctx;
    snprintf(c->url, sizeof(c->url), "%s", url);
    return c;
}

mm_err mm_listener_accept(mm_listener *l, mm_conn **out, uint64_t deadline_ns,
                          char err[MM_ERRLEN]) {
    if (l == NULL || out == NULL)
        return mm_errf(err, MM_EINVAL, "mm_listener_accept: NULL argument");
    *out = NULL;
    void *ctx = NULL;
    MM_TRY(l->ops->accept(l->ctx, &ctx, deadline_ns, err));
    mm_conn *c = conn_wrap(l->ops, ctx, l->url);
    if (c == NULL)
        return mm_errf(err, MM_ENOMEM, "conn on %s", l->url);
    *out = c;
    return MM_OK;
}

void mm_listener_shutdown(mm_listener *l) {
    if (l != NULL)
        l->ops->listener_shutdown(l->ctx);
}

void mm_listener_close(mm_listener *l) {
    if (l == NULL)
        return;
    l->ops->listener_close(l->ctx);
    free(l);
}

// ---- conns ----------------------------------------------------------------------------------

mm_err mm_transport_dial(mm_conn **out, const char *url, uint64_t deadline_ns,
                         char err[MM_ERRLEN]) {
    if (out == NULL)
        return mm_errf(err, MM_EINVAL, "mm_transport_dial: out is NULL");
    *out = NULL;
    mm_url u;
    const struct mm_transport_ops *ops = NULL;
    MM_TRY(lookup(url, &u, &ops, err));
    void *ctx = NULL;
    MM_TRY(ops->dial(&ctx, &u, deadline_ns, err));
    mm_conn *c = conn_wrap(ops, ctx, u.text);
    if (c == NULL)
        return mm_errf(err, MM_ENOMEM, "conn to %s", url);
    *out = c;
    return MM_OK;
}

mm_err mm_conn_error(const mm_conn *c) {
    if (c == NULL)
        return MM_EINVAL;
    mm_err g = (mm_err)atomic_load(&((mm_conn *)c)->gerr);
    if (g != MM_OK)
        return g;
    return c->ops->status(c->ctx);
}

const char *mm_conn_url(const mm_conn *c) { return c ? c->url : ""; }

static void conn_break(mm_conn *c, mm_err e) {
    int expected = 0;
    atomic_compare_exchange_strong(&c->gerr, &expected, (int)e);
    c->ops->shutdown(c->ctx); // wakes the other direction; the peer sees the conn end
}

// send_check: what every send checks before the provider sees the frame (host or device
// iov alike): the conn is not broken, the kind is a frame kind, the header's payload size is
// its rows' size and the iov add up to it.
static mm_err send_check(mm_conn *c, const mm_wire_hdr *hdr, const struct iovec *iov,
                         int n_iov) {
    mm_err g = (mm_err)atomic_load(&c->gerr);
    if (g != MM_OK)
        return g;
    if (hdr->kind < MM_WIRE_ROWS || hdr->kind > MM_WIRE_KIND_USER_MAX)
        return MM_EINVAL;
    uint64_t want = 0;
    if (mm_wire_payload_bytes((enum mm_wire_format)hdr->format, hdr->n_rows, hdr->row_dim,
                              &want) != MM_OK ||
        want != hdr->payload_bytes)
        return MM_EINVAL;
    uint64_t have = 0;
    for (int i = 0; i < n_iov; i++) {
        if (iov[i].iov_len > 0 && iov[i].iov_base == NULL)
            return MM_EINVAL;
        have += iov[i].iov_len;
    }
    return have == want ? MM_OK : MM_EINVAL;
}

mm_err mm_conn_sendv(mm_conn *c, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                     uint64_t deadline_ns) {
    if (c == NULL || hdr == NULL || n_iov < 0 || (n_iov > 0 && iov == NULL))
        return MM_EINVAL;
    MM_TRY(send_check(c, hdr, iov, n_iov));
    mm_wire_hdr h = *hdr;
    mm__wire_hdr_seal(&h, c->tx_seq);
    mm_err rv = c->ops->sendv(c->ctx, &h, iov, n_iov, deadline_ns);
    if (rv == MM_OK)
        c->tx_seq++;
    return rv;
}

mm_err mm_conn_send(mm_conn *c, const mm_wire_hdr *hdr, const void *payload,
                    uint64_t deadline_ns) {
    if (hdr == NULL)
        return MM_EINVAL;
    struct iovec iov = {.iov_base = (void *)payload, .iov_len = (size_t)hdr->payload_bytes};
    return mm_conn_sendv(c, hdr, &iov, hdr->payload_bytes ? 1 : 0, deadline_ns);
}

bool mm_conn_dev(const mm_conn *c) {
    return c != NULL && c->ops->dev_ok != NULL && c->ops->dev_ok(c->ctx);
}

mm_err mm_conn_sendv_dev(mm_conn *c, const mm_wire_hdr *hdr, const struct iovec *d_iov,
                         int n_iov, uint64_t deadline_ns) {
    if (c == NULL || hdr == NULL || n_iov < 0 || (n_iov > 0 && d_iov == NULL))
        return MM_EINVAL;
    if (!mm_conn_dev(c) || c->ops->sendv_dev == NULL)
        return MM_EUNSUPP;
    MM_TRY(send_check(c, hdr, d_iov, n_iov));
    mm_wire_hdr h = *hdr;
    mm__wire_hdr_seal(&h, c->tx_seq);
    mm_err rv = c->ops->sendv_dev(c->ctx, &h, d_iov, n_iov, deadline_ns);
    if (rv == MM_OK)
        c->tx_seq++;
    return rv;
}

mm_err mm_conn_reserve_dev(mm_conn *c, size_t n_bytes, void **d_out, uint64_t deadline_ns) {
    if (c == NULL || d_out == NULL || n_bytes == 0)
        return MM_EINVAL;
    *d_out = NULL;
    if (!mm_conn_dev(c) || c->ops->reserve_dev == NULL)
        return MM_EUNSUPP;
    mm_err g = (mm_err)atomic_load(&c->gerr);
    if (g != MM_OK)
        return g;
    return c->ops->reserve_dev(c->ctx, n_bytes, d_out, deadline_ns);
}

// The generic half of every receive: the provider's result, then the conn_seq check.
static mm_err recv_done(mm_conn *c, const mm_wire_hdr *hdr, mm_err rv) {
    if (rv != MM_OK && rv != MM_EFULL)
        return rv;
    if (hdr->conn_seq != c->rx_seq) {
        mm_log_warn("transport %s: frame conn_seq %llu, expected %llu: frames lost or "
                    "duplicated", c->url, (unsigned long long)hdr->conn_seq,
                    (unsigned long long)c->rx_seq);
        conn_break(c, MM_EPROTO);
        return MM_EPROTO;
    }
    c->rx_seq++;
    return rv;
}

mm_err mm_conn_recv_dev(mm_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap,
                        const struct iovec *d_iov, int n_iov, bool *on_dev,
                        uint64_t deadline_ns) {
    if (c == NULL || hdr == NULL || on_dev == NULL || (cap > 0 && buf == NULL) || n_iov < 0 ||
        (n_iov > 0 && d_iov == NULL))
        return MM_EINVAL;
    *on_dev = false;
    mm_err g = (mm_err)atomic_load(&c->gerr);
    if (g != MM_OK)
        return g;
    if (c->ops->recv_dev == NULL)
        return recv_done(c, hdr, c->ops->recv(c->ctx, hdr, buf, cap, deadline_ns));
    return recv_done(c, hdr,
                     c->ops->recv_dev(c->ctx, hdr, buf, cap, d_iov, n_iov, on_dev, deadline_ns));
}

mm_err mm_conn_recv_view(mm_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap,
                         const void **d_view, uint64_t deadline_ns) {
    if (c == NULL || hdr == NULL || d_view == NULL || (cap > 0 && buf == NULL))
        return MM_EINVAL;
    *d_view = NULL;
    if (!mm_conn_dev(c) || c->ops->recv_view == NULL)
        return MM_EUNSUPP;
    mm_err g = (mm_err)atomic_load(&c->gerr);
    if (g != MM_OK)
        return g;
    return recv_done(c, hdr, c->ops->recv_view(c->ctx, hdr, buf, cap, d_view, deadline_ns));
}

mm_err mm_conn_recv(mm_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap, uint64_t deadline_ns) {
    if (c == NULL || hdr == NULL || (cap > 0 && buf == NULL))
        return MM_EINVAL;
    mm_err g = (mm_err)atomic_load(&c->gerr);
    if (g != MM_OK)
        return g;
    return recv_done(c, hdr, c->ops->recv(c->ctx, hdr, buf, cap, deadline_ns));
}

mm_err mm_conn_wait_any(mm_conn *const *conns, size_t n, uint64_t deadline_ns, size_t *ready) {
    if (conns == NULL || ready == NULL || n == 0 || n > MM_CONN_WAIT_MAX)
        return MM_EINVAL;
    for (size_t i = 0; i < n; i++)
        if (conns[i] == NULL)
            return MM_EINVAL;
    uint64_t spin_ns = mm__transport_spin_ns();
    uint64_t spin_end = mm_now_ns() + spin_ns;
    struct pollfd pfds[MM_CONN_WAIT_MAX * MM_TRANSPORT_MAX_PFD];
    for (;;) {
        for (size_t i = 0; i < n; i++) {
            mm_conn *c = conns[i];
            if (atomic_load_explicit(&c->gerr, memory_order_relaxed) != 0 ||
                c->ops->rx_ready(c->ctx)) {
                *ready = i;
                return MM_OK;
            }
        }
        uint64_t now = mm_now_ns();
        if (now >= deadline_ns)
            return MM_ETIMEDOUT;
        if (now < spin_end) {
            mm__spin_once(now + spin_ns - spin_end);
            continue;
        }
        // Sleep: arm every conn, re-check (a frame may have landed before arming), poll.
        int np = 0;
        for (size_t i = 0; i < n; i++)
            np += conns[i]->ops->rx_arm(conns[i]->ctx, pfds + np);
        size_t hit = n;
        for (size_t i = 0; i < n && hit == n; i++)
            if (conns[i]->ops->rx_ready(conns[i]->ctx))
                hit = i;
        if (hit == n) {
            int r = poll(pfds, (nfds_t)np, mm__deadline_timeout_ms(deadline_ns));
            (void)r; // EINTR or timeout: loop re-checks readiness and the deadline
        }
        for (size_t i = 0; i < n; i++)
            conns[i]->ops->rx_disarm(conns[i]->ctx);
        if (hit != n) {
            *ready = hit;
            return MM_OK;
        }
    }
}

void mm_conn_shutdown(mm_conn *c) {
    if (c == NULL)
        return;
    int expected = 0;
    atomic_compare_exchange_strong(&c->gerr, &expected, (int)MM_ECLOSED);
    c->ops->shutdown(c->ctx);
}

void mm_conn_close(mm_conn *c) {
    if (c == NULL)
        return;
    c->ops->close(c->ctx);
    free(c);
}

mm_err mm_conn_reg_mem(mm_conn *c, void *p, size_t n_bytes, mm_mem_reg **out,
                       char err[MM_ERRLEN]) {
    if (c == NULL || out == NULL || (p == NULL && n_bytes > 0))
        return mm_errf(err, MM_EINVAL, "mm_conn_reg_mem: bad argument");
    *out = NULL;
    if (c->ops->reg_mem == NULL)
        return MM_OK;
    void *reg = NULL;
    MM_TRY(c->ops->reg_mem(c->ctx, p, n_bytes, &reg, err));
    *out = (mm_mem_reg *)reg;
    return MM_OK;
}

void mm_conn_dereg_mem(mm_conn *c, mm_mem_reg *reg) {
    if (c == NULL || reg == NULL || c->ops->dereg_mem == NULL)
        return;
    c->ops->dereg_mem(c->ctx, reg);
}

mm_err mm__conn_send_raw(mm_conn *c, const void *p, size_t n, uint64_t deadline_ns) {
    if (c == NULL)
        return MM_EINVAL;
    if (c->ops->send_raw == NULL)
        return MM_EUNSUPP;
    return c->ops->send_raw(c->ctx, p, n, deadline_ns);
}
