// SPDX-License-Identifier: MIT
// tcp://HOST:PORT: data-plane transport over plain TCP sockets (any network; loopback on one
// box when shm:// is not wanted).
//
// Design notes:
// - Non-blocking sockets; every wait is poll() on the socket plus a shutdown eventfd, bounded
//   by the caller's deadline. Receivers spin on recv(MSG_DONTWAIT) for
//   mm__transport_spin_ns() before sleeping (loopback frames land within microseconds).
// - A frame is written with one sendmsg(header, payload iovs) (writev semantics, MSG_NOSIGNAL)
//   and read as header then payload straight into the caller's buffer: no copy, no staging.
// - TCP_NODELAY (no Nagle delay on small frames), SO_KEEPALIVE with short probes and
//   TCP_USER_TIMEOUT so a peer whose box vanished is detected even when nothing is sent.
// - Orderly close sends a BYE frame (when no send is in progress) and shuts the socket down:
//   the peer's recv returns MM_ECLOSED. EOF or a reset without BYE is a dead peer:
//   MM_EPEERDOWN. Name resolution (getaddrinfo) is not bounded by the deadline: use IP
//   literals in deployments.
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mm/transport.h"
#include "transport_int.h"

#define SCRATCH_BYTES (64u << 10) // discard buffer for oversize payloads
#define MAX_IOV 64

struct tcp_conn {
    int fd;
    int efd_shut;         // signalled by shutdown: wakes our own blocked threads
    pid_t owner_pid;      // forked copies only close their descriptors
    pthread_mutex_t tx_mu; // held for a whole frame; shutdown sends BYE only when free
    _Atomic int err;      // sticky mm_err, 0 while healthy
    _Atomic int shut;
    uint8_t *scratch;     // SCRATCH_BYTES, allocated at connect
};

struct tcp_listener {
    int fd;
    int efd_shut;
    _Atomic int shut;
    char url[MM_URL_MAX];
};

static void close_fd(int *fd) {
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

// A fatal error: record it (first one wins) and end the socket so that our other thread's op
// and the peer both stop waiting.
static void conn_fail(struct tcp_conn *c, mm_err e) {
    int expected = 0;
    if (!atomic_compare_exchange_strong(&c->err, &expected, (int)e))
        return;
    if (c->owner_pid == getpid())
        shutdown(c->fd, SHUT_RDWR);
    uint64_t one = 1;
    ssize_t r = write(c->efd_shut, &one, sizeof(one));
    (void)r;
}

static mm_err conn_state(struct tcp_conn *c) {
    if (atomic_load_explicit(&c->shut, memory_order_acquire))
        return MM_ECLOSED;
    return (mm_err)atomic_load_explicit(&c->err, memory_order_acquire);
}

// poll fd for ev (plus the shutdown eventfd) until the deadline.
static mm_err fd_wait(int fd, short ev, int efd_shut, uint64_t deadline_ns) {
    for (;;) {
        struct pollfd p[2] = {{.fd = fd, .events = ev}, {.fd = efd_shut, .events = POLLIN}};
        int r = poll(p, efd_shut >= 0 ? 2 : 1, mm__deadline_timeout_ms(deadline_ns));
        if (r < 0 && errno != EINTR)
            return MM_ESYS;
        if (efd_shut >= 0 && (p[1].revents & POLLIN))
            return MM_ECLOSED;
        if (r > 0 && p[0].revents)
            return MM_OK;
        if (mm_now_ns() >= deadline_ns)
            return MM_ETIMEDOUT;
    }
}

static void set_sockopts(int fd) {
    int one = 1, idle = 10, intvl = 2, cnt = 3;
    unsigned int user_timeout_ms = 10000;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

static struct tcp_conn *conn_new(int fd) {
    struct tcp_conn *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->fd = fd;
    c->owner_pid = getpid();
    c->efd_shut = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->scratch = malloc(SCRATCH_BYTES);
    pthread_mutex_init(&c->tx_mu, NULL);
    if (c->efd_shut < 0 || c->scratch == NULL) {
        close_fd(&c->efd_shut);
        free(c->scratch);
        pthread_mutex_destroy(&c->tx_mu);
        free(c);
        return NULL;
    }
    set_sockopts(fd);
    return c;
}

static void conn_free(struct tcp_conn *c) {
    if (c == NULL)
        return;
    close_fd(&c->fd);
    close_fd(&c->efd_shut);
    free(c->scratch);
    pthread_mutex_destroy(&c->tx_mu);
    free(c);
}

// ---- byte I/O -------------------------------------------------------------------------------

// Reads exactly n bytes into dst (NULL: discard through scratch). *got counts bytes read.
// EOF -> MM_EPEERDOWN; reset -> MM_EPEERDOWN.
static mm_err read_full(struct tcp_conn *c, uint8_t *dst, size_t n, uint64_t deadline_ns,
                        size_t *got) {
    uint64_t spin_end = 0, spin_ns = mm__transport_spin_ns();
    while (*got < n) {
        size_t want = n - *got;
        uint8_t *to = dst ? dst + *got : c->scratch;
        if (dst == NULL && want > SCRATCH_BYTES)
            want = SCRATCH_BYTES;
        ssize_t r = recv(c->fd, to, want, MSG_DONTWAIT);
        if (r > 0) {
            *got += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        mm_err st = conn_state(c); // our own shutdown also ends the stream: report that
        if (st != MM_OK)
            return st;
        if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
            return MM_EPEERDOWN; // EOF, ECONNRESET, ETIMEDOUT (keepalive), EPIPE ...
        uint64_t now = mm_now_ns();
        if (now >= deadline_ns)
            return MM_ETIMEDOUT;
        if (spin_end == 0)
            spin_end = now + spin_ns;
        if (now < spin_end) {
            mm__spin_once(now + spin_ns - spin_end);
            continue;
        }
        mm_err w = fd_wait(c->fd, POLLIN, c->efd_shut, deadline_ns);
        if (w == MM_ETIMEDOUT)
            return w;
        if (w != MM_OK)
            return conn_state(c) != MM_OK ? conn_state(c) : w;
    }
    return MM_OK;
}

// ---- send -----------------------------------------------------------------------------------

// Sends the stream hdr ++ iov[0..n_iov) from its start. *sent counts bytes written.
static mm_err write_stream(struct tcp_conn *c, const mm_wire_hdr *hdr, const struct iovec *iov,
                           int n_iov, uint64_t deadline_ns, uint64_t *sent) {
    int idx = -1;   // -1: header
    size_t off = 0; // inside piece idx
    for (;;) {
        struct iovec v[MAX_IOV];
        int nv = 0;
        int i = idx;
        size_t o = off;
        while (nv < MAX_IOV && i < n_iov) {
            const uint8_t *base = i < 0 ? (const uint8_t *)hdr : iov[i].iov_base;
            size_t len = i < 0 ? sizeof(*hdr) : iov[i].iov_len;
            if (o < len)
                v[nv++] = (struct iovec){.iov_base = (void *)(base + o), .iov_len = len - o};
            i++;
            o = 0;
        }
        if (nv == 0)
            return MM_OK;
        struct msghdr m = {.msg_iov = v, .msg_iovlen = (size_t)nv};
        ssize_t r = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            mm_err st = conn_state(c);
            if (st != MM_OK)
                return st;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return MM_EPEERDOWN; // EPIPE, ECONNRESET
            mm_err w = fd_wait(c->fd, POLLOUT, c->efd_shut, deadline_ns);
            if (w != MM_OK)
                return w == MM_ETIMEDOUT ? w : (conn_state(c) != MM_OK ? conn_state(c) : w);
            continue;
        }
        *sent += (uint64_t)r;
        size_t left = (size_t)r;
        while (left > 0) { // advance (idx, off) by r bytes
            size_t len = idx < 0 ? sizeof(*hdr) : iov[idx].iov_len;
            size_t take = len - off < left ? len - off : left;
            off += take;
            left -= take;
            if (off == len) {
                idx++;
                off = 0;
            }
        }
    }
}

static mm_err tcp_sendv(void *ctx, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                        uint64_t deadline_ns) {
    struct tcp_conn *c = ctx;
    mm_err rv = conn_state(c);
    if (rv != MM_OK)
        return rv;
    pthread_mutex_lock(&c->tx_mu);
    uint64_t sent = 0;
    rv = write_stream(c, hdr, iov, n_iov, deadline_ns, &sent);
    if (rv != MM_OK && !(rv == MM_ETIMEDOUT && sent == 0))
        conn_fail(c, rv == MM_ETIMEDOUT ? MM_ETRANSPORT : rv); // half a frame went out
    pthread_mutex_unlock(&c->tx_mu);
    return rv;
}

static mm_err tcp_send_raw(void *ctx, const void *p, size_t n, uint64_t deadline_ns) {
    struct tcp_conn *c = ctx;
    pthread_mutex_lock(&c->tx_mu);
    uint64_t sent = 0;
    // Sent as "header" bytes of an empty stream: n must not exceed a header.
    mm_err rv = MM_EINVAL;
    if (n <= sizeof(mm_wire_hdr)) {
        mm_wire_hdr h;
        memset(&h, 0, sizeof(h));
        memcpy(&h, p, n);
        rv = write_stream(c, &h, NULL, 0, deadline_ns, &sent);
    }
    pthread_mutex_unlock(&c->tx_mu);
    return rv;
}

// ---- recv -----------------------------------------------------------------------------------

static mm_err tcp_recv(void *ctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                       uint64_t deadline_ns) {
    struct tcp_conn *c = ctx;
    mm_err rv = conn_state(c);
    if (rv != MM_OK)
        return rv;
    size_t got = 0;
    rv = read_full(c, (uint8_t *)hdr, sizeof(*hdr), deadline_ns, &got);
    if (rv != MM_OK) {
        if (!(rv == MM_ETIMEDOUT && got == 0))
            conn_fail(c, rv == MM_ETIMEDOUT ? MM_ETRANSPORT : rv);
        return rv;
    }
    if (mm_wire_hdr_check(hdr, NULL) != MM_OK || hdr->kind == MM_WIRE_HELLO) {
        conn_fail(c, MM_EPROTO);
        return MM_EPROTO;
    }
    if (hdr->kind == MM_WIRE_BYE) {
        conn_fail(c, MM_ECLOSED);
        return MM_ECLOSED;
    }
    bool fits = hdr->payload_bytes <= cap;
    got = 0;
    rv = read_full(c, fits ? buf : NULL, (size_t)hdr->payload_bytes, deadline_ns, &got);
    if (rv != MM_OK) {
        conn_fail(c, rv == MM_ETIMEDOUT ? MM_ETRANSPORT : rv);
        return rv;
    }
    return fits ? MM_OK : MM_EFULL;
}

static bool tcp_rx_ready(void *ctx) {
    struct tcp_conn *c = ctx;
    if (conn_state(c) != MM_OK)
        return true;
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

static int tcp_rx_arm(void *ctx, struct pollfd *pfds) {
    struct tcp_conn *c = ctx;
    pfds[0] = (struct pollfd){.fd = c->fd, .events = POLLIN};
    pfds[1] = (struct pollfd){.fd = c->efd_shut, .events = POLLIN};
    return 2;
}

static void tcp_rx_disarm(void *ctx) { (void)ctx; }

// ---- lifecycle ------------------------------------------------------------------------------

static mm_err tcp_status(void *ctx) { return conn_state(ctx); }

static void tcp_shutdown(void *ctx) {
    struct tcp_conn *c = ctx;
    if (c->owner_pid != getpid())
        return; // forked copy: the socket belongs to the parent
    if (atomic_exchange(&c->shut, 1))
        return;
    if (pthread_mutex_trylock(&c->tx_mu) == 0) {
        if (atomic_load(&c->err) == 0) { // tell the peer this is an orderly close
            mm_wire_hdr h;
            memset(&h, 0, sizeof(h));
            h.kind = MM_WIRE_BYE;
            mm__wire_hdr_seal(&h, 0);
            ssize_t r = send(c->fd, &h, sizeof(h), MSG_DONTWAIT | MSG_NOSIGNAL);
            (void)r; // best effort: a full buffer makes the peer see EOF (MM_EPEERDOWN)
        }
        pthread_mutex_unlock(&c->tx_mu);
    }
    shutdown(c->fd, SHUT_RDWR);
    uint64_t one = 1;
    ssize_t r = write(c->efd_shut, &one, sizeof(one));
    (void)r;
}

static void tcp_close(void *ctx) {
    struct tcp_conn *c = ctx;
    if (c == NULL)
        return;
    tcp_shutdown(c);
    conn_free(c);
}

// ---- handshake ------------------------------------------------------------------------------

static mm_err handshake_send(struct tcp_conn *c, uint64_t deadline_ns) {
    mm_wire_hdr h;
    memset(&h, 0, sizeof(h));
    h.kind = MM_WIRE_HELLO;
    mm__wire_hdr_seal(&h, 0);
    uint64_t sent = 0;
    return write_stream(c, &h, NULL, 0, deadline_ns, &sent);
}

static mm_err handshake_recv(struct tcp_conn *c, uint64_t deadline_ns, char err[MM_ERRLEN]) {
    mm_wire_hdr h;
    size_t got = 0;
    mm_err rv = read_full(c, (uint8_t *)&h, sizeof(h), deadline_ns, &got);
    if (rv != MM_OK)
        return mm_errf(err, rv, "tcp handshake: no HELLO from peer (%s)", mm_strerror(rv));
    char why[MM_ERRLEN] = "";
    if (mm_wire_hdr_check(&h, why) != MM_OK || h.kind != MM_WIRE_HELLO)
        return mm_errf(err, MM_EPROTO, "tcp handshake: peer is not a moemesh v%u data-plane "
                       "endpoint: %s", MM_WIRE_V1, why[0] ? why : "first frame is not HELLO");
    return MM_OK;
}

// ---- listener -------------------------------------------------------------------------------

static mm_err resolve(const mm_url *url, bool passive, struct addrinfo **res,
                      char err[MM_ERRLEN]) {
    if (url->port < 0)
        return mm_errf(err, MM_EINVAL, "tcp URL '%s' needs a port (tcp://HOST:PORT)",
                       url->text);
    char port[16];
    snprintf(port, sizeof(port), "%d", url->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    int g = getaddrinfo(url->host, port, &hints, res);
    if (g != 0)
        return mm_errf(err, MM_EINVAL, "tcp URL '%s': cannot resolve host '%s': %s", url->text,
                       url->host, gai_strerror(g));
    return MM_OK;
}

static mm_err tcp_listen(void **lctx, const mm_url *url, char err[MM_ERRLEN]) {
    struct addrinfo *res = NULL;
    MM_TRY(resolve(url, true, &res, err));
    struct tcp_listener *l = calloc(1, sizeof(*l));
    mm_err rv = MM_OK;
    if (l == NULL) {
        freeaddrinfo(res);
        return mm_errf(err, MM_ENOMEM, "tcp listener");
    }
    l->fd = -1;
    snprintf(l->url, sizeof(l->url), "%s", url->text);
    l->efd_shut = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l->fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l->fd < 0 || l->efd_shut < 0) {
        rv = mm_errf(err, MM_ESYS, "tcp listen %s: socket: %s", url->text, strerror(errno));
        goto fail;
    }
    int one = 1;
    setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(l->fd, res->ai_addr, res->ai_addrlen) != 0) {
        rv = mm_errf(err, errno == EADDRINUSE ? MM_EBUSY : MM_ESYS, "tcp listen %s: bind: %s",
                     url->text, strerror(errno));
        goto fail;
    }
    if (listen(l->fd, 128) != 0) {
        rv = mm_errf(err, MM_ESYS, "tcp listen %s: listen: %s", url->text, strerror(errno));
        goto fail;
    }
    freeaddrinfo(res);
    *lctx = l;
    return MM_OK;
fail:
    freeaddrinfo(res);
    close_fd(&l->fd);
    close_fd(&l->efd_shut);
    free(l);
    return rv;
}

static mm_err tcp_accept(void *lctx, void **cctx, uint64_t deadline_ns, char err[MM_ERRLEN]) {
    struct tcp_listener *l = lctx;
    int s;
    for (;;) {
        if (atomic_load(&l->shut))
            return MM_ECLOSED;
        s = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (s >= 0)
            break;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
            return mm_errf(err, MM_ESYS, "tcp accept %s: %s", l->url, strerror(errno));
        mm_err w = fd_wait(l->fd, POLLIN, l->efd_shut, deadline_ns);
        if (w != MM_OK)
            return w;
    }
    struct tcp_conn *c = conn_new(s);
    if (c == NULL) {
        close(s);
        return mm_errf(err, MM_ENOMEM, "tcp conn");
    }
    // The caller's deadline bounds the wait for a dialer; once one has connected, its HELLO
    // gets at least 2 s: servers polling accept with short deadlines (mm_dataserv: 100 ms)
    // otherwise drop dialers on slow boxes (seen under qemu TCG: "no HELLO from peer").
    uint64_t hs_min = mm_now_ns() + 2000ull * 1000000ull;
    if (deadline_ns < hs_min)
        deadline_ns = hs_min;
    mm_err rv = handshake_recv(c, deadline_ns, err);
    if (rv == MM_OK && (rv = handshake_send(c, deadline_ns)) != MM_OK)
        mm_errf(err, rv, "tcp handshake: could not answer HELLO");
    if (rv != MM_OK) {
        conn_free(c);
        return rv == MM_ETIMEDOUT || rv == MM_ECLOSED ? rv : MM_EPROTO;
    }
    *cctx = c;
    return MM_OK;
}

static void tcp_listener_shutdown(void *lctx) {
    struct tcp_listener *l = lctx;
    atomic_store(&l->shut, 1);
    uint64_t one = 1;
    ssize_t r = write(l->efd_shut, &one, sizeof(one));
    (void)r;
}

static void tcp_listener_close(void *lctx) {
    struct tcp_listener *l = lctx;
    if (l == NULL)
        return;
    close_fd(&l->fd);
    close_fd(&l->efd_shut);
    free(l);
}

// ---- dial -----------------------------------------------------------------------------------

static mm_err tcp_dial(void **cctx, const mm_url *url, uint64_t deadline_ns,
                       char err[MM_ERRLEN]) {
    struct addrinfo *res = NULL;
    MM_TRY(resolve(url, false, &res, err));
    mm_err rv = MM_OK;
    int s = -1;
    for (;;) {
        s = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (s < 0) {
            rv = mm_errf(err, MM_ESYS, "tcp dial %s: socket: %s", url->text, strerror(errno));
            goto out;
        }
        int e = 0;
        if (connect(s, res->ai_addr, res->ai_addrlen) != 0) {
            e = errno;
            if (e == EINPROGRESS) {
                mm_err w = fd_wait(s, POLLOUT, -1, deadline_ns);
                if (w != MM_OK) {
                    rv = mm_errf(err, w, "tcp dial %s: connect: %s", url->text,
                                 mm_strerror(w));
                    goto out;
                }
                socklen_t el = sizeof(e);
                getsockopt(s, SOL_SOCKET, SO_ERROR, &e, &el);
            }
        }
        if (e == 0)
            break;
        close_fd(&s);
        if (e != ECONNREFUSED && e != EINTR && e != EAGAIN) {
            rv = mm_errf(err, MM_ESYS, "tcp dial %s: connect: %s", url->text, strerror(e));
            goto out;
        }
        if (mm_now_ns() >= deadline_ns) {
            rv = mm_errf(err, MM_ETIMEDOUT, "tcp dial %s: no listener before the deadline "
                         "(%s)", url->text, strerror(e));
            goto out;
        }
        usleep(2000);
    }
    struct tcp_conn *c = conn_new(s);
    if (c == NULL) {
        rv = mm_errf(err, MM_ENOMEM, "tcp conn");
        goto out;
    }
    s = -1;
    rv = handshake_send(c, deadline_ns);
    if (rv != MM_OK)
        mm_errf(err, rv, "tcp dial %s: HELLO: %s", url->text, mm_strerror(rv));
    else
        rv = handshake_recv(c, deadline_ns, err);
    if (rv != MM_OK) {
        conn_free(c);
        goto out;
    }
    *cctx = c;
out:
    close_fd(&s);
    freeaddrinfo(res);
    return rv;
}

const struct mm_transport_ops mm__transport_tcp = {
    .version = MM_TRANSPORT_V1,
    .scheme = "tcp",
    .listen = tcp_listen,
    .accept = tcp_accept,
    .listener_shutdown = tcp_listener_shutdown,
    .listener_close = tcp_listener_close,
    .dial = tcp_dial,
    .sendv = tcp_sendv,
    .recv = tcp_recv,
    .rx_ready = tcp_rx_ready,
    .rx_arm = tcp_rx_arm,
    .rx_disarm = tcp_rx_disarm,
    .status = tcp_status,
    .shutdown = tcp_shutdown,
    .close = tcp_close,
    .send_raw = tcp_send_raw,
};
