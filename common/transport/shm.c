// SPDX-License-Identifier: MIT
// shm://NAME: same-box data-plane transport over shared-memory byte rings.
//
// Design notes:
// - Rendezvous: the listener binds the abstract unix socket "\0moemesh-shm/NAME"
//   (SOCK_SEQPACKET; abstract names vanish with the socket, no files to clean up). The dialer
//   creates a memfd holding both rings plus four eventfds and passes them (SCM_RIGHTS) with a
//   HELLO frame; the listener maps them and answers HELLO. After that the socket carries no
//   data: it only tells each side when the other process is gone (it becomes readable/HUP).
// - Segment: a 4 KiB control page, then ring 0 (dialer -> listener) and ring 1 (listener ->
//   dialer), each ring_bytes (power of two, default 2 MiB, shm://NAME?ring_kb=N). A ring is
//   single-producer single-consumer: head (bytes produced) is written only by the producer
//   with release order, tail (bytes consumed) only by the consumer with release order; each
//   side reads the other's counter with acquire. head and tail sit on their own cache lines.
// - Frames are the 64-byte mm_wire_hdr plus the payload padded to 64 bytes, so a header is
//   always 64-aligned and never wraps. A frame larger than the free space (or the ring)
//   streams through in chunks; the producer publishes head every 64 KiB so the consumer
//   copies out while the producer copies in.
// - Waiting: spin mm__transport_spin_ns(), then sleep in poll() on an eventfd plus the
//   socket. The sleeper sets a *_waiting flag, issues a seq_cst fence and re-checks; the other
//   side publishes its counter, fences, and writes the eventfd only when the flag was set
//   (Dekker pattern: no lost wake-up, no syscall when nobody sleeps). Each side has one
//   eventfd for "data arrived" and one for "space freed", so a sending thread and a receiving
//   thread never steal each other's wake-ups.
// - Close: the closer sets closed[side] in the segment and wakes the peer, which returns
//   MM_ECLOSED once the ring is drained. A process that dies leaves closed[] clear; the peer
//   sees its socket hang up and returns MM_EPEERDOWN (after the frames already in the ring).
//   Copies inherited through fork() are closed without touching the shared state (owner_pid).
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "mm/transport.h"
#include "transport_int.h"

#define SEG_MAGIC 0x4d53484du // "MHSM"
#define SEG_VERSION 1u
#define SEG_CTL_BYTES 4096u
#define RING_DEFAULT_BYTES (2u << 20)
#define RING_MIN_BYTES (64u << 10)
#define RING_MAX_BYTES (1u << 30)
#define PUBLISH_CHUNK (64u << 10)
#define N_HELLO_FDS 5 // memfd, listener rx/tx eventfds, dialer rx/tx eventfds
#define HANDSHAKE_MIN_MS 1000 // a dialed peer's HELLO gets at least this long

struct ring {
    _Alignas(64) _Atomic uint64_t head; // bytes produced; producer stores (release)
    _Atomic uint32_t prod_waiting;      // producer sleeps waiting for space
    _Alignas(64) _Atomic uint64_t tail; // bytes consumed; consumer stores (release)
    _Atomic uint32_t cons_waiting;      // consumer sleeps waiting for data
    char pad_[64 - sizeof(uint64_t) - sizeof(uint32_t)];
};

struct seg {
    uint32_t magic;       // SEG_MAGIC, written by the dialer before the HELLO
    uint32_t version;     // SEG_VERSION
    uint64_t ring_bytes;  // bytes of each ring's data area (power of two)
    _Alignas(64) _Atomic uint32_t closed[2]; // side s (0 dialer, 1 listener) closed in order
    struct ring ring[2];  // ring[0]: dialer -> listener, ring[1]: listener -> dialer
};
static_assert(sizeof(struct seg) <= SEG_CTL_BYTES, "shm control page");

struct shm_conn {
    int side;              // 0 dialer, 1 listener
    int sock;              // seqpacket socket: liveness only after the handshake
    int efd_rx, efd_tx;    // ours: woken on data arrived / space freed
    int peer_rx, peer_tx;  // the peer's: we write them
    pid_t owner_pid;       // process that created this conn
    struct seg *seg;
    size_t map_bytes;
    struct ring *tx, *rx;
    uint8_t *tx_data, *rx_data;
    uint64_t mask;         // ring_bytes - 1
    _Atomic int err;       // sticky mm_err, 0 while healthy
    _Atomic int shut;      // mm_conn_shutdown/close called here
    _Atomic int peer_gone; // socket hung up: peer process gone
};

struct shm_listener {
    int fd;
    int efd_shut;
    _Atomic int shut;
    char name[MM_URL_MAX];
};

static const uint8_t zeros64[64];

// ---- helpers --------------------------------------------------------------------------------

static mm_err name_check(const mm_url *url, char err[MM_ERRLEN]) {
    size_t n = strlen(url->host);
    if (url->port != -1)
        return mm_errf(err, MM_EINVAL, "shm URL '%s': a shm name takes no port", url->text);
    if (n == 0 || n > 100)
        return mm_errf(err, MM_EINVAL, "shm URL '%s': name must be 1..100 characters",
                       url->text);
    for (size_t i = 0; i < n; i++) {
        char ch = url->host[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
        if (!ok)
            return mm_errf(err, MM_EINVAL, "shm URL '%s': name may hold only [A-Za-z0-9._-]",
                           url->text);
    }
    return MM_OK;
}

static socklen_t sock_addr(struct sockaddr_un *sa, const char *name) {
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    int n = snprintf(sa->sun_path + 1, sizeof(sa->sun_path) - 1, "moemesh-shm/%s", name);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void efd_signal(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof(one));
    (void)r; // EAGAIN only when the counter is saturated: the reader is awake anyway
}

static void efd_drain(int fd) {
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof(v));
    (void)r;
}

static void close_fd(int *fd) {
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

// Wait until fd has revents in ev or the deadline/shutdown hits. Returns MM_OK when ready.
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

static void conn_free(struct shm_conn *c) {
    if (c == NULL)
        return;
    if (c->seg != NULL)
        munmap(c->seg, c->map_bytes);
    close_fd(&c->sock);
    close_fd(&c->efd_rx);
    close_fd(&c->efd_tx);
    close_fd(&c->peer_rx);
    close_fd(&c->peer_tx);
    free(c);
}

static struct shm_conn *conn_alloc(void) {
    struct shm_conn *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->sock = c->efd_rx = c->efd_tx = c->peer_rx = c->peer_tx = -1;
    c->owner_pid = getpid();
    return c;
}

static void conn_bind_rings(struct shm_conn *c) {
    uint64_t rb = c->seg->ring_bytes;
    uint8_t *data0 = (uint8_t *)c->seg + SEG_CTL_BYTES;
    c->mask = rb - 1;
    c->tx = &c->seg->ring[c->side];
    c->rx = &c->seg->ring[1 - c->side];
    c->tx_data = data0 + (uint64_t)c->side * rb;
    c->rx_data = data0 + (uint64_t)(1 - c->side) * rb;
}

// A fatal error: record it (first one wins), wake our other thread so that its op fails too,
// and mark our side closed so that the peer stops waiting on us.
static void conn_fail(struct shm_conn *c, mm_err e) {
    int expected = 0;
    if (!atomic_compare_exchange_strong(&c->err, &expected, (int)e))
        return;
    efd_signal(c->efd_rx);
    efd_signal(c->efd_tx);
    if (c->owner_pid == getpid()) {
        atomic_store_explicit(&c->seg->closed[c->side], 1, memory_order_release);
        efd_signal(c->peer_rx);
        efd_signal(c->peer_tx);
    }
}

// Failure that ends a wait, checked only after the awaited condition was found false, so
// that frames already in the ring are delivered before a close or a death is reported.
static mm_err conn_failure(struct shm_conn *c) {
    if (atomic_load_explicit(&c->shut, memory_order_acquire))
        return MM_ECLOSED;
    int e = atomic_load_explicit(&c->err, memory_order_acquire);
    if (e != 0)
        return (mm_err)e;
    if (atomic_load_explicit(&c->seg->closed[1 - c->side], memory_order_acquire))
        return MM_ECLOSED;
    if (atomic_load_explicit(&c->peer_gone, memory_order_acquire))
        return MM_EPEERDOWN;
    return MM_OK;
}

// A readable or hung-up socket after the handshake means the peer process is gone.
static void check_sock(struct shm_conn *c, short revents) {
    if (revents & (POLLIN | POLLHUP | POLLERR | POLLRDHUP))
        atomic_store_explicit(&c->peer_gone, 1, memory_order_release);
}

static inline uint64_t rx_avail(struct shm_conn *c) {
    return atomic_load_explicit(&c->rx->head, memory_order_acquire) -
           atomic_load_explicit(&c->rx->tail, memory_order_relaxed);
}

static inline uint64_t tx_space(struct shm_conn *c) {
    return c->mask + 1 -
           (atomic_load_explicit(&c->tx->head, memory_order_relaxed) -
            atomic_load_explicit(&c->tx->tail, memory_order_acquire));
}

// Wait until the rx ring holds >= need bytes (is_tx == false) or the tx ring has >= need free
// bytes (is_tx == true). Spins, then sleeps on the matching eventfd and the socket.
static mm_err ring_wait(struct shm_conn *c, bool is_tx, uint64_t need, uint64_t deadline_ns) {
    uint64_t spin_ns = mm__transport_spin_ns();
    uint64_t spin_end = mm_now_ns() + spin_ns;
    _Atomic uint32_t *flag = is_tx ? &c->tx->prod_waiting : &c->rx->cons_waiting;
    int efd = is_tx ? c->efd_tx : c->efd_rx;
    for (;;) {
        if ((is_tx ? tx_space(c) : rx_avail(c)) >= need)
            return MM_OK;
        mm_err f = conn_failure(c);
        if (f != MM_OK)
            return f;
        uint64_t now = mm_now_ns();
        if (now >= deadline_ns)
            return MM_ETIMEDOUT;
        if (now < spin_end) {
            mm__spin_once(now + spin_ns - spin_end);
            continue;
        }
        atomic_store(flag, 1);
        atomic_thread_fence(memory_order_seq_cst);
        if ((is_tx ? tx_space(c) : rx_avail(c)) >= need || conn_failure(c) != MM_OK) {
            atomic_store(flag, 0);
            continue;
        }
        struct pollfd p[2] = {{.fd = efd, .events = POLLIN},
                              {.fd = c->sock, .events = POLLIN | POLLRDHUP}};
        int r = poll(p, 2, mm__deadline_timeout_ms(deadline_ns));
        atomic_store(flag, 0);
        if (r > 0) {
            if (p[0].revents & POLLIN)
                efd_drain(efd);
            check_sock(c, p[1].revents);
        }
    }
}

// Publish tx head and wake the consumer if it sleeps.
static inline void tx_publish(struct shm_conn *c, uint64_t head) {
    atomic_store_explicit(&c->tx->head, head, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&c->tx->cons_waiting, memory_order_relaxed) &&
        atomic_exchange(&c->tx->cons_waiting, 0))
        efd_signal(c->peer_rx);
}

// Publish rx tail and wake the producer if it sleeps for space.
static inline void rx_release(struct shm_conn *c, uint64_t tail) {
    atomic_store_explicit(&c->rx->tail, tail, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&c->rx->prod_waiting, memory_order_relaxed) &&
        atomic_exchange(&c->rx->prod_waiting, 0))
        efd_signal(c->peer_tx);
}

// ---- send -----------------------------------------------------------------------------------

// The byte stream of one frame: header, the iov pieces, then zero padding to 64 bytes.
struct src_cursor {
    const mm_wire_hdr *hdr;
    const struct iovec *iov;
    int n_iov;
    int i;          // -1: header; 0..n_iov-1: iov; n_iov: padding
    size_t off;     // offset inside the current piece
    size_t pad;     // padding bytes
};

static const uint8_t *cursor_piece(struct src_cursor *s, size_t *len) {
    for (;;) {
        const uint8_t *base;
        size_t n;
        if (s->i < 0) {
            base = (const uint8_t *)s->hdr;
            n = sizeof(mm_wire_hdr);
        } else if (s->i < s->n_iov) {
            base = s->iov[s->i].iov_base;
            n = s->iov[s->i].iov_len;
        } else {
            base = zeros64;
            n = s->pad;
        }
        if (s->off < n) {
            *len = n - s->off;
            return base + s->off;
        }
        if (s->i >= s->n_iov) {
            *len = 0;
            return NULL;
        }
        s->i++;
        s->off = 0;
    }
}

static void ring_copy_in(struct shm_conn *c, uint64_t head, struct src_cursor *s, uint64_t n) {
    while (n > 0) {
        size_t plen = 0;
        const uint8_t *p = cursor_piece(s, &plen);
        MM_ASSERT(p != NULL);
        uint64_t take = plen < n ? plen : n;
        uint64_t pos = head & c->mask;
        uint64_t first = c->mask + 1 - pos;
        if (first >= take) {
            memcpy(c->tx_data + pos, p, take);
        } else {
            memcpy(c->tx_data + pos, p, first);
            memcpy(c->tx_data, p + first, take - first);
        }
        s->off += take;
        head += take;
        n -= take;
    }
}

static mm_err shm_sendv(void *ctx, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                        uint64_t deadline_ns) {
    struct shm_conn *c = ctx;
    uint64_t payload = hdr->payload_bytes;
    uint64_t total = sizeof(mm_wire_hdr) + ((payload + 63) & ~63ull);
    struct src_cursor s = {.hdr = hdr, .iov = iov, .n_iov = n_iov, .i = -1,
                           .pad = (size_t)(total - sizeof(mm_wire_hdr) - payload)};
    // A peer that closed or died reads nothing more: fail before writing into its ring.
    mm_err f = conn_failure(c);
    if (f != MM_OK)
        return f;
    uint64_t head = atomic_load_explicit(&c->tx->head, memory_order_relaxed);
    uint64_t done = 0;
    while (done < total) {
        uint64_t space = tx_space(c);
        if (space == 0) {
            mm_err rv = ring_wait(c, true, 1, deadline_ns);
            if (rv != MM_OK) {
                if (done > 0 && rv == MM_ETIMEDOUT)
                    conn_fail(c, MM_ETRANSPORT); // half a frame in the ring: unusable
                return rv;
            }
            continue;
        }
        uint64_t n = total - done;
        if (n > space)
            n = space;
        if (n > PUBLISH_CHUNK)
            n = PUBLISH_CHUNK;
        ring_copy_in(c, head, &s, n);
        head += n;
        done += n;
        tx_publish(c, head);
    }
    return MM_OK;
}

static mm_err shm_send_raw(void *ctx, const void *p, size_t n, uint64_t deadline_ns) {
    struct shm_conn *c = ctx;
    // Garbage frames are written as one 64-byte-padded "header" slot, like a real frame.
    if (n > sizeof(mm_wire_hdr))
        return MM_EINVAL;
    mm_wire_hdr h;
    memset(&h, 0, sizeof(h));
    memcpy(&h, p, n);
    MM_TRY(ring_wait(c, true, sizeof(h), deadline_ns));
    uint64_t head = atomic_load_explicit(&c->tx->head, memory_order_relaxed);
    memcpy(c->tx_data + (head & c->mask), &h, sizeof(h));
    tx_publish(c, head + sizeof(h));
    return MM_OK;
}

// ---- recv -----------------------------------------------------------------------------------

static mm_err shm_recv(void *ctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                       uint64_t deadline_ns) {
    struct shm_conn *c = ctx;
    if (atomic_load_explicit(&c->err, memory_order_acquire) != 0)
        return (mm_err)atomic_load(&c->err);
    if (atomic_load_explicit(&c->shut, memory_order_acquire))
        return MM_ECLOSED;
    MM_TRY(ring_wait(c, false, sizeof(mm_wire_hdr), deadline_ns));
    uint64_t tail = atomic_load_explicit(&c->rx->tail, memory_order_relaxed);
    memcpy(hdr, c->rx_data + (tail & c->mask), sizeof(*hdr)); // 64-aligned: never wraps
    mm_err rv = mm_wire_hdr_check(hdr, NULL);
    if (rv == MM_OK && hdr->kind == MM_WIRE_HELLO)
        rv = MM_EPROTO;
    if (rv != MM_OK) {
        conn_fail(c, MM_EPROTO);
        return MM_EPROTO;
    }
    tail += sizeof(*hdr);
    if (hdr->kind == MM_WIRE_BYE) {
        rx_release(c, tail);
        conn_fail(c, MM_ECLOSED);
        return MM_ECLOSED;
    }
    uint64_t payload = hdr->payload_bytes;
    uint64_t padded = (payload + 63) & ~63ull;
    bool fits = payload <= cap;
    uint8_t *dst = buf;
    uint64_t done = 0;
    if (padded == 0)
        rx_release(c, tail);
    while (done < padded) {
        // Local tail: the header is consumed but not yet released to the producer.
        uint64_t avail = atomic_load_explicit(&c->rx->head, memory_order_acquire) - tail;
        if (avail == 0) {
            rx_release(c, tail);
            mm_err w = ring_wait(c, false, 1, deadline_ns);
            if (w != MM_OK) {
                if (w == MM_ETIMEDOUT)
                    conn_fail(c, MM_ETRANSPORT); // mid-frame: the stream is unusable
                return w;
            }
            continue;
        }
        uint64_t n = padded - done;
        if (n > avail)
            n = avail;
        if (n > PUBLISH_CHUNK)
            n = PUBLISH_CHUNK;
        if (fits && done < payload) {
            uint64_t m = payload - done < n ? payload - done : n;
            uint64_t pos = tail & c->mask;
            uint64_t first = c->mask + 1 - pos;
            if (first >= m) {
                memcpy(dst + done, c->rx_data + pos, m);
            } else {
                memcpy(dst + done, c->rx_data + pos, first);
                memcpy(dst + done + first, c->rx_data, m - first);
            }
        }
        tail += n;
        done += n;
        rx_release(c, tail);
    }
    return fits ? MM_OK : MM_EFULL;
}

static bool shm_rx_ready(void *ctx) {
    struct shm_conn *c = ctx;
    return rx_avail(c) >= sizeof(mm_wire_hdr) || conn_failure(c) != MM_OK;
}

static int shm_rx_arm(void *ctx, struct pollfd *pfds) {
    struct shm_conn *c = ctx;
    atomic_store(&c->rx->cons_waiting, 1);
    atomic_thread_fence(memory_order_seq_cst);
    pfds[0] = (struct pollfd){.fd = c->efd_rx, .events = POLLIN};
    pfds[1] = (struct pollfd){.fd = c->sock, .events = POLLIN | POLLRDHUP};
    return 2;
}

static void shm_rx_disarm(void *ctx) {
    struct shm_conn *c = ctx;
    atomic_store(&c->rx->cons_waiting, 0);
    efd_drain(c->efd_rx);
    struct pollfd p = {.fd = c->sock, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) > 0)
        check_sock(c, p.revents);
}

// ---- for transports built on shm (cudaipc.c) ------------------------------------------------

// The second half of the control page is free for a transport layered on a shm conn: both
// processes map it (zeroed by the dialer's ftruncate). *side: 0 dialer, 1 listener.
void *mm__shm_conn_extra(void *ctx, int *side, size_t *n_bytes) {
    struct shm_conn *c = ctx;
    static_assert(sizeof(struct seg) <= SEG_CTL_BYTES / 2, "shm control page: extra half");
    *side = c->side;
    *n_bytes = SEG_CTL_BYTES / 2;
    return (uint8_t *)c->seg + SEG_CTL_BYTES / 2;
}

// ---- lifecycle ------------------------------------------------------------------------------

static mm_err shm_status(void *ctx) {
    struct shm_conn *c = ctx;
    mm_err f = conn_failure(c);
    // A peer that closed or died is a failure even while frames remain to be read.
    return f;
}

static void shm_shutdown(void *ctx) {
    struct shm_conn *c = ctx;
    if (c->owner_pid != getpid())
        return; // a forked copy: the connection belongs to the parent
    if (atomic_exchange(&c->shut, 1))
        return;
    atomic_store_explicit(&c->seg->closed[c->side], 1, memory_order_release);
    efd_signal(c->efd_rx); // our own blocked threads
    efd_signal(c->efd_tx);
    efd_signal(c->peer_rx); // the peer, so that it sees closed[] now
    efd_signal(c->peer_tx);
}

static void shm_close(void *ctx) {
    struct shm_conn *c = ctx;
    if (c == NULL)
        return;
    shm_shutdown(c);
    conn_free(c);
}

// ---- handshake ------------------------------------------------------------------------------

static mm_err hello_send(int sock, const int *fds, int n_fds, uint64_t ring_bytes) {
    mm_wire_hdr h;
    memset(&h, 0, sizeof(h));
    h.kind = MM_WIRE_HELLO;
    h.format = MM_WIRE_BYTES;
    h.aux = (uint32_t)(ring_bytes >> 10);
    mm__wire_hdr_seal(&h, 0);
    struct iovec iov = {.iov_base = &h, .iov_len = sizeof(h)};
    union {
        char buf[CMSG_SPACE(sizeof(int) * N_HELLO_FDS)];
        struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (n_fds > 0) {
        memset(&u, 0, sizeof(u));
        m.msg_control = u.buf;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)n_fds);
    }
    ssize_t r = sendmsg(sock, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    return r == (ssize_t)sizeof(h) ? MM_OK : MM_ESYS;
}

// Receives a HELLO and up to N_HELLO_FDS fds (all closed on error; *n_fds = 0 then).
static mm_err hello_recv(int sock, int efd_shut, uint64_t deadline_ns, mm_wire_hdr *h, int *fds,
                         int *n_fds, char err[MM_ERRLEN]) {
    *n_fds = 0;
    mm_err rv = fd_wait(sock, POLLIN, efd_shut, deadline_ns);
    if (rv != MM_OK)
        return mm_errf(err, rv, "shm handshake: no HELLO from peer: %s", mm_strerror(rv));
    struct iovec iov = {.iov_base = h, .iov_len = sizeof(*h)};
    union {
        char buf[CMSG_SPACE(sizeof(int) * N_HELLO_FDS)];
        struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = sizeof(u.buf)};
    ssize_t r = recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r <= 0)
        return mm_errf(err, MM_EPROTO, "shm handshake: peer hung up during HELLO");
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm != NULL; cm = CMSG_NXTHDR(&m, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int n = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < n; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(cm) + (size_t)i * sizeof(int), sizeof(int));
                if (*n_fds < N_HELLO_FDS)
                    fds[(*n_fds)++] = fd;
                else
                    close(fd);
            }
        }
    }
    if (r != (ssize_t)sizeof(*h) || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
        mm_wire_hdr_check(h, NULL) != MM_OK || h->kind != MM_WIRE_HELLO) {
        for (int i = 0; i < *n_fds; i++)
            close(fds[i]);
        *n_fds = 0;
        return mm_errf(err, MM_EPROTO, "shm handshake: peer sent something other than a "
                       "moemesh v%u HELLO", MM_WIRE_V1);
    }
    return MM_OK;
}

// ---- listener -------------------------------------------------------------------------------

static mm_err shm_listen(void **lctx, const mm_url *url, char err[MM_ERRLEN]) {
    MM_TRY(name_check(url, err));
    struct shm_listener *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return mm_errf(err, MM_ENOMEM, "shm listener");
    l->fd = l->efd_shut = -1;
    snprintf(l->name, sizeof(l->name), "%s", url->host);
    mm_err rv = MM_OK;
    l->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    l->efd_shut = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (l->fd < 0 || l->efd_shut < 0) {
        rv = mm_errf(err, MM_ESYS, "shm listen %s: socket/eventfd: %s", url->text,
                     strerror(errno));
        goto fail;
    }
    struct sockaddr_un sa;
    socklen_t sl = sock_addr(&sa, url->host);
    if (bind(l->fd, (struct sockaddr *)&sa, sl) != 0) {
        rv = mm_errf(err, errno == EADDRINUSE ? MM_EBUSY : MM_ESYS,
                     "shm listen %s: bind: %s", url->text, strerror(errno));
        goto fail;
    }
    if (listen(l->fd, 64) != 0) {
        rv = mm_errf(err, MM_ESYS, "shm listen %s: listen: %s", url->text, strerror(errno));
        goto fail;
    }
    *lctx = l;
    return MM_OK;
fail:
    close_fd(&l->fd);
    close_fd(&l->efd_shut);
    free(l);
    return rv;
}

static mm_err map_segment(struct shm_conn *c, int memfd, char err[MM_ERRLEN]) {
    struct stat st;
    if (fstat(memfd, &st) != 0 || st.st_size < (off_t)SEG_CTL_BYTES)
        return mm_errf(err, MM_EPROTO, "shm handshake: shared segment too small");
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED)
        return mm_errf(err, MM_ESYS, "shm handshake: mmap: %s", strerror(errno));
    c->seg = p;
    c->map_bytes = (size_t)st.st_size;
    uint64_t rb = c->seg->ring_bytes;
    if (c->seg->magic != SEG_MAGIC || c->seg->version != SEG_VERSION || rb < RING_MIN_BYTES ||
        rb > RING_MAX_BYTES || (rb & (rb - 1)) != 0 ||
        (uint64_t)st.st_size != SEG_CTL_BYTES + 2 * rb)
        return mm_errf(err, MM_EPROTO, "shm handshake: shared segment layout not understood");
    conn_bind_rings(c);
    return MM_OK;
}

static mm_err shm_accept(void *lctx, void **cctx, uint64_t deadline_ns, char err[MM_ERRLEN]) {
    struct shm_listener *l = lctx;
    struct shm_conn *c = NULL;
    int fds[N_HELLO_FDS];
    int n_fds = 0;
    mm_err rv;
    int s = -1;
    for (;;) {
        if (atomic_load(&l->shut))
            return MM_ECLOSED;
        s = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (s >= 0)
            break;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
            return mm_errf(err, MM_ESYS, "shm accept %s: %s", l->name, strerror(errno));
        rv = fd_wait(l->fd, POLLIN, l->efd_shut, deadline_ns);
        if (rv != MM_OK)
            return rv == MM_ESYS ? mm_errf(err, rv, "shm accept: poll: %s", strerror(errno))
                                 : rv;
    }
    c = conn_alloc();
    if (c == NULL) {
        close(s);
        return mm_errf(err, MM_ENOMEM, "shm conn");
    }
    c->side = 1;
    c->sock = s;
    mm_wire_hdr h;
    // A peer that connected before the deadline gets at least HANDSHAKE_MIN_MS for its HELLO:
    // a dialer arriving just before an accept loop's deadline (dataserv's 1 s turns) was
    // dropped mid-handshake under load ("HELLO: Broken pipe" on its side).
    uint64_t hs = mm_deadline_in_ms(HANDSHAKE_MIN_MS);
    if (deadline_ns > hs)
        hs = deadline_ns;
    MM_TRY_GOTO(rv, hello_recv(s, l->efd_shut, hs, &h, fds, &n_fds, err), fail);
    if (n_fds != N_HELLO_FDS) {
        rv = mm_errf(err, MM_EPROTO, "shm handshake: HELLO carried %d descriptors, expected %d",
                     n_fds, N_HELLO_FDS);
        goto fail;
    }
    // fds: memfd, listener rx, listener tx, dialer rx, dialer tx
    c->efd_rx = fds[1];
    c->efd_tx = fds[2];
    c->peer_rx = fds[3];
    c->peer_tx = fds[4];
    fds[1] = fds[2] = fds[3] = fds[4] = -1;
    MM_TRY_GOTO(rv, map_segment(c, fds[0], err), fail);
    close_fd(&fds[0]);
    n_fds = 0;
    if (hello_send(s, NULL, 0, c->seg->ring_bytes) != MM_OK) {
        rv = mm_errf(err, MM_EPROTO, "shm handshake: could not answer HELLO: %s",
                     strerror(errno));
        goto fail;
    }
    *cctx = c;
    return MM_OK;
fail:
    for (int i = 0; i < n_fds; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    conn_free(c);
    return rv;
}

static void shm_listener_shutdown(void *lctx) {
    struct shm_listener *l = lctx;
    atomic_store(&l->shut, 1);
    efd_signal(l->efd_shut);
}

static void shm_listener_close(void *lctx) {
    struct shm_listener *l = lctx;
    if (l == NULL)
        return;
    close_fd(&l->fd);
    close_fd(&l->efd_shut);
    free(l);
}

// ---- dial -----------------------------------------------------------------------------------

static mm_err shm_dial(void **cctx, const mm_url *url, uint64_t deadline_ns,
                       char err[MM_ERRLEN]) {
    MM_TRY(name_check(url, err));
    uint64_t ring_bytes = RING_DEFAULT_BYTES, kb = 0;
    mm_err q = mm_url_query_u64(url, "ring_kb", &kb);
    if (q == MM_OK) {
        ring_bytes = kb << 10;
        if (kb == 0 || kb > (RING_MAX_BYTES >> 10) || ring_bytes < RING_MIN_BYTES ||
            (ring_bytes & (ring_bytes - 1)) != 0)
            return mm_errf(err, MM_EINVAL, "shm URL '%s': ring_kb must be a power of two "
                           "from %u to %u", url->text, RING_MIN_BYTES >> 10,
                           RING_MAX_BYTES >> 10);
    } else if (q != MM_ENOENT) {
        return mm_errf(err, MM_EINVAL, "shm URL '%s': ring_kb is not a number", url->text);
    }
    struct shm_conn *c = conn_alloc();
    if (c == NULL)
        return mm_errf(err, MM_ENOMEM, "shm conn");
    c->side = 0;
    mm_err rv = MM_OK;
    int memfd = -1, l_rx = -1, l_tx = -1;
    struct sockaddr_un sa;
    socklen_t sl = sock_addr(&sa, url->host);
    for (;;) {
        c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (c->sock < 0) {
            rv = mm_errf(err, MM_ESYS, "shm dial %s: socket: %s", url->text, strerror(errno));
            goto fail;
        }
        if (connect(c->sock, (struct sockaddr *)&sa, sl) == 0)
            break;
        int e = errno;
        close_fd(&c->sock);
        if (e != ECONNREFUSED && e != ENOENT && e != EAGAIN && e != EINTR) {
            rv = mm_errf(err, MM_ESYS, "shm dial %s: connect: %s", url->text, strerror(e));
            goto fail;
        }
        if (mm_now_ns() >= deadline_ns) {
            rv = mm_errf(err, MM_ETIMEDOUT, "shm dial %s: no listener before the deadline "
                         "(%s)", url->text, strerror(e));
            goto fail;
        }
        usleep(2000);
    }
    size_t map_bytes = SEG_CTL_BYTES + 2 * ring_bytes;
    memfd = memfd_create("moemesh-shm", MFD_CLOEXEC);
    if (memfd < 0 || ftruncate(memfd, (off_t)map_bytes) != 0) {
        rv = mm_errf(err, MM_ESYS, "shm dial %s: memfd of %zu bytes: %s", url->text, map_bytes,
                     strerror(errno));
        goto fail;
    }
    void *p = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED) {
        rv = mm_errf(err, MM_ESYS, "shm dial %s: mmap: %s", url->text, strerror(errno));
        goto fail;
    }
    c->seg = p;
    c->map_bytes = map_bytes;
    c->seg->magic = SEG_MAGIC;
    c->seg->version = SEG_VERSION;
    c->seg->ring_bytes = ring_bytes;
    conn_bind_rings(c);
    c->efd_rx = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->efd_tx = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l_rx = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l_tx = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd_rx < 0 || c->efd_tx < 0 || l_rx < 0 || l_tx < 0) {
        rv = mm_errf(err, MM_ESYS, "shm dial %s: eventfd: %s", url->text, strerror(errno));
        goto fail;
    }
    int fds[N_HELLO_FDS] = {memfd, l_rx, l_tx, c->efd_rx, c->efd_tx};
    if (hello_send(c->sock, fds, N_HELLO_FDS, ring_bytes) != MM_OK) {
        rv = mm_errf(err, MM_ESYS, "shm dial %s: HELLO: %s", url->text, strerror(errno));
        goto fail;
    }
    close_fd(&memfd);
    c->peer_rx = l_rx; // the listener's eventfds: we keep our copies to wake it
    c->peer_tx = l_tx;
    l_rx = l_tx = -1;
    mm_wire_hdr h;
    int got[N_HELLO_FDS], n_got = 0;
    rv = hello_recv(c->sock, -1, deadline_ns, &h, got, &n_got, err);
    for (int i = 0; i < n_got; i++)
        close(got[i]);
    if (rv != MM_OK)
        goto fail;
    *cctx = c;
    return MM_OK;
fail:
    close_fd(&memfd);
    close_fd(&l_rx);
    close_fd(&l_tx);
    conn_free(c);
    return rv;
}

// The raw shm transport; the table's shm:// is common/transport/cudaipc.c's layer over it (which
// is exactly this when the build has no GPU support).
const struct mm_transport_ops mm__transport_shm_raw = {
    .version = MM_TRANSPORT_V1,
    .scheme = "shm",
    .listen = shm_listen,
    .accept = shm_accept,
    .listener_shutdown = shm_listener_shutdown,
    .listener_close = shm_listener_close,
    .dial = shm_dial,
    .sendv = shm_sendv,
    .recv = shm_recv,
    .rx_ready = shm_rx_ready,
    .rx_arm = shm_rx_arm,
    .rx_disarm = shm_rx_disarm,
    .status = shm_status,
    .shutdown = shm_shutdown,
    .close = shm_close,
    .send_raw = shm_send_raw,
};
