// SPDX-License-Identifier: MIT
// rdma://HOST:PORT[?slots=N&slot_kb=N&mtu=N&gid_index=N&dev=NAME&port=N&id=S]: data-plane
// transport over libibverbs reliable-connected queue pairs (InfiniBand, RoCE v2, soft-RoCE).
// HOST:PORT is the TCP side channel that sets the connection up and watches the peer's life;
// rows travel as RDMA writes with immediate data into the peer's ring.
//
// Design notes:
// - Setup: a tcp:// conn (tcp.c, used through its ops table, HELLO handshake included) carries
//   one CTRL frame each way: identity string (default "moemesh-data/v1/rdma1", or ?id=),
//   GID/LID, QP number, PSN, rkey, the address and
//   geometry of the receive ring and of the credit word, MTU. Identities must be equal
//   (MM_EIDENTITY names both). The dialer sends first, the acceptor answers once its QP is
//   ready to receive (RTR), and the dialer confirms with a READY frame once it is, so
//   neither side writes into a QP that cannot take it yet. Every step has the caller's
//   deadline (accept: once a dialer is connected, its setup gets at least SETUP_MIN_MS).
// - Memory: each conn registers, once at setup, a receive region (credit word + ring of
//   `slots` slots of `slot_kb` KiB, remote-writable) and a send staging ring of the peer's
//   geometry (local only). Nothing is registered per message. A frame (64-byte mm_wire_hdr +
//   payload) is copied into consecutive staging slots and goes out as one RDMA WRITE WITH
//   IMMEDIATE per slot to the same slot index in the peer's ring; the immediate says which
//   slot it landed in and whether it starts a frame, and every write consumes one posted
//   receive on the peer, whose completion (recv CQ) is the "row arrived" signal. RC keeps
//   the writes in order.
// - Flow control: the receiver counts slots it has copied out and RDMA-writes that
//   cumulative count (8 bytes, inline) into the sender's credit word: after every frame and
//   every quarter ring inside a large frame. A sender posts slot k only when
//   k < min(credit, send completions) + slots (and keeps at most its own `slots` writes in
//   flight, which sizes its send queue), so a slow receiver is never overwritten and a frame
//   larger than the ring streams through it.
// - Waiting: poll the CQ for a bounded spin (MM_TRANSPORT_SPIN_US), then arm the CQ's
//   completion channel and sleep in poll() on it, on the side-channel socket and on a
//   shutdown eventfd, bounded by the deadline. Credits arrive as plain writes with no
//   event, so a sender starved of credits re-checks the credit word every millisecond.
// - Failure: the side channel is the liveness signal (the peer's process dying closes its
//   socket at once); a work completion in error (retry exceeded, flush) fails the conn too.
//   Complete frames already in the ring are delivered before the error. Sticky errors as in
//   mm/transport.h. A QP in error is never reused: the conn is closed (every verbs object
//   destroyed) and the next dial/accept builds a fresh QP. Orderly close posts a BYE write
//   behind the data (RC order), waits for queued writes to complete (while the peer lives,
//   at most 10 s), then sends the side channel's BYE.
// - Threading: one sending thread (tx_mu) and one receiving thread per conn. The receive
//   thread also posts credit writes; the send CQ is polled under scq_mu by either thread.
//   ibv_post_send/recv are thread-safe in rdma-core providers.
// - Memory path: rows are staged through pinned host memory. Registering GPU memory
//   (dma-buf / nvidia-peermem) is not implemented: mm_conn_reg_mem registers host memory
//   only, and the send path does not use registrations yet (every frame is staged: one copy
//   on each side; docs/BENCHMARKS.md says what that costs on a real NIC).
// - Fork: verbs objects belong to the process that made them; a forked child only frees its
//   copies (no verbs calls), like tcp.c.
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "mm/log.h"
#include "mm/transport.h"
#include "transport_int.h"

extern const struct mm_transport_ops mm__transport_tcp;
#define TCP (&mm__transport_tcp)

#define DEF_SLOTS 32
#define DEF_SLOT_KB 128
#define MAX_SLOTS 4096
#define IMM_FIRST 1u // first chunk of a frame: slot holds mm_wire_hdr + payload head
#define IMM_CONT 2u  // continuation chunk: payload only
#define IMM_BYE 3u   // orderly close; no data
#define IMM(kind, slot) (((uint32_t)(kind) << 28) | (uint32_t)(slot))
#define CREDIT_MAX 16     // credit writes in flight at most
#define EXTRA_RECVS 8     // receives beyond the ring: BYE, raw
#define WRID_DATA 1u
#define WRID_CREDIT 2u
#define WRID_BYE 3u
#define CLOSE_DRAIN_MS 10000 // bound for a peer that is alive but whose NIC stopped acking
#define BYE_GRACE_MS 200  // side channel said BYE; the RDMA BYE may still be on the wire
#define SETUP_MIN_MS 5000 // an accepted dialer's setup gets at least this long (see accept)
#define INFO_MAGIC "MMRDMA1"
#define ID_LEN 64

struct rdma_params {
    char dev[64];      // "" = first device with an active port
    int port;          // HCA port, default 1
    int gid_index;     // -1 = find a RoCE v2 IPv4 GID (preferring the URL's address)
    uint32_t n_slots;  // receive ring slots
    uint32_t slot_bytes;
    int mtu;           // enum ibv_mtu, 0 = port's active MTU
    char id[ID_LEN];   // identity string both sides must share
};

// Setup message, one CTRL frame each way. Little-endian fixed layout.
struct conn_info {
    char magic[8];
    char id[ID_LEN];
    uint8_t gid[16];
    uint32_t qpn, psn, rkey, n_slots, slot_bytes, mtu, lid, link_layer;
    uint64_t rx_addr, credit_addr;
};
_Static_assert(sizeof(struct conn_info) == 136, "conn_info is wire layout");

struct rdma_listener {
    void *tcp;
    struct rdma_params p;
    char host[MM_URL_MAX];
};

struct rdma_conn {
    pid_t owner_pid;
    void *tcp;          // side channel (tcp.c ctx), owned
    int efd_shut;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *rx_ch, *tx_ch;
    struct ibv_cq *rx_cq, *tx_cq;
    struct ibv_qp *qp;
    struct ibv_mr *rx_mr, *tx_mr;
    uint8_t *rx_mem;    // [credit page 4 KiB][rx ring n_rx x rx_slot_bytes]
    size_t rx_mem_bytes;
    uint8_t *tx_mem;    // staging ring n_tx x tx_slot_bytes (the peer's geometry)
    size_t tx_mem_bytes;
    uint32_t n_rx, rx_slot_bytes, n_tx, tx_slot_bytes;
    uint64_t remote_rx_addr, remote_credit_addr;
    uint32_t remote_rkey;
    // receive side: touched by the receiving thread only
    uint32_t *rx_len;   // (n_rx,) byte length of the chunk in each slot
    uint8_t *rx_kind;   // (n_rx,) IMM_* of the chunk in each slot
    uint64_t rx_arrived, rx_consumed, rx_reported;
    bool rx_bye;
    mm_err rx_err;      // first error completion on the recv CQ
    mm_err rx_broken;   // a frame failed half-way or was garbage: sticky for recv
    // send side
    pthread_mutex_t tx_mu;   // a whole frame; shutdown posts BYE only when free
    pthread_mutex_t scq_mu;  // tx_cq poll/arm
    pthread_mutex_t side_mu; // side-channel checks
    uint64_t tx_posted;      // data chunks posted (sending thread)
    uint32_t tx_budget;      // data writes in flight at most (sizes the send queue)
    _Atomic uint64_t tx_done;
    _Atomic uint32_t credit_inflight;
    _Atomic int bye_done;
    _Atomic int err;    // sticky mm_err
    _Atomic int shut;
    _Atomic int side;   // side-channel verdict: 0 alive, MM_ECLOSED, MM_EPEERDOWN, MM_EPROTO
    char name[96];      // "dev/port gid[i]" for messages
};

struct rdma_reg {
    struct ibv_mr *mr;
};

static _Atomic int logged_path;

// ---- helpers --------------------------------------------------------------------------------

static void close_fd(int *fd) {
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

static void conn_fail(struct rdma_conn *c, mm_err e) {
    int expected = 0;
    if (!atomic_compare_exchange_strong(&c->err, &expected, (int)e))
        return;
    // First failure: wake our other thread at once and tell the peer (its side channel ends).
    if (c->owner_pid == getpid()) {
        if (c->tcp != NULL)
            TCP->shutdown(c->tcp);
        uint64_t one = 1;
        ssize_t r = write(c->efd_shut, &one, sizeof(one));
        (void)r;
    }
}

static mm_err conn_state(struct rdma_conn *c) {
    if (atomic_load_explicit(&c->shut, memory_order_acquire))
        return MM_ECLOSED;
    return (mm_err)atomic_load_explicit(&c->err, memory_order_acquire);
}

static void spin_once(uint64_t spun_ns) {
    if (spun_ns < 5000)
        mm__cpu_relax();
    else
        sched_yield(); // a peer sharing this CPU gets to run
}

static int mtu_enum(uint64_t bytes) {
    switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    case 4096: return IBV_MTU_4096;
    default: return 0;
    }
}

static int mtu_bytes(int e) { return e >= IBV_MTU_256 && e <= IBV_MTU_4096 ? 128 << e : 0; }

// Finds key=value in query and copies value into out (cap bytes). MM_ENOENT when absent.
static mm_err query_str(const char *query, const char *key, char *out, size_t cap) {
    size_t kl = strlen(key);
    const char *p = query;
    while (*p != '\0') {
        const char *amp = strchr(p, '&');
        size_t len = amp ? (size_t)(amp - p) : strlen(p);
        if (len > kl && strncmp(p, key, kl) == 0 && p[kl] == '=') {
            size_t vl = len - kl - 1;
            if (vl == 0 || vl >= cap)
                return MM_EINVAL;
            memcpy(out, p + kl + 1, vl);
            out[vl] = '\0';
            return MM_OK;
        }
        p += len;
        if (*p == '&')
            p++;
    }
    return MM_ENOENT;
}

static mm_err parse_params(const mm_url *url, struct rdma_params *p, char err[MM_ERRLEN]) {
    memset(p, 0, sizeof(*p));
    p->port = 1;
    p->gid_index = -1;
    p->n_slots = DEF_SLOTS;
    p->slot_bytes = DEF_SLOT_KB << 10;
    // Default identity: a moemesh rdma:// endpoint of this wire version. The daemons' build,
    // model and placement are checked by the control plane before the router dials a data
    // URL; a deployment can pin more here with ?id= (e.g. a mesh name), which must match.
    snprintf(p->id, sizeof(p->id), "moemesh-data/v%u/rdma1", MM_WIRE_V1);
    if (url->port < 0)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s' needs a side-channel port "
                       "(rdma://HOST:PORT)", url->text);
    // Every key must be known: a typo must not silently run with defaults.
    const char *q = url->query;
    while (*q != '\0') {
        const char *amp = strchr(q, '&');
        size_t len = amp ? (size_t)(amp - q) : strlen(q);
        const char *eq = memchr(q, '=', len);
        size_t kl = eq ? (size_t)(eq - q) : len;
        static const char *const known[] = {"slots", "slot_kb", "mtu", "gid_index", "dev",
                                            "port", "id"};
        bool ok = false;
        for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
            if (strlen(known[i]) == kl && strncmp(q, known[i], kl) == 0)
                ok = true;
        if (!ok)
            return mm_errf(err, MM_EINVAL, "rdma URL '%s': unknown option '%.*s' (known: "
                           "slots, slot_kb, mtu, gid_index, dev, port, id)", url->text,
                           (int)kl, q);
        q += len;
        if (*q == '&')
            q++;
    }
    uint64_t v = 0;
    mm_err rv;
    if ((rv = mm_url_query_u64(url, "slots", &v)) == MM_OK) {
        if (v < 2 || v > MAX_SLOTS)
            return mm_errf(err, MM_EINVAL, "rdma URL '%s': slots=%llu, want 2..%d", url->text,
                           (unsigned long long)v, MAX_SLOTS);
        p->n_slots = (uint32_t)v;
    } else if (rv != MM_ENOENT)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': slots is not a number", url->text);
    if ((rv = mm_url_query_u64(url, "slot_kb", &v)) == MM_OK) {
        if (v < 4 || v > 65536)
            return mm_errf(err, MM_EINVAL, "rdma URL '%s': slot_kb=%llu, want 4..65536",
                           url->text, (unsigned long long)v);
        p->slot_bytes = (uint32_t)v << 10;
    } else if (rv != MM_ENOENT)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': slot_kb is not a number", url->text);
    if ((rv = mm_url_query_u64(url, "mtu", &v)) == MM_OK) {
        p->mtu = mtu_enum(v);
        if (p->mtu == 0)
            return mm_errf(err, MM_EINVAL, "rdma URL '%s': mtu=%llu, want 256, 512, 1024, "
                           "2048 or 4096", url->text, (unsigned long long)v);
    } else if (rv != MM_ENOENT)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': mtu is not a number", url->text);
    if ((rv = mm_url_query_u64(url, "gid_index", &v)) == MM_OK) {
        if (v > 65535)
            return mm_errf(err, MM_EINVAL, "rdma URL '%s': gid_index=%llu", url->text,
                           (unsigned long long)v);
        p->gid_index = (int)v;
    } else if (rv != MM_ENOENT)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': gid_index is not a number", url->text);
    if ((rv = mm_url_query_u64(url, "port", &v)) == MM_OK) {
        if (v < 1 || v > 255)
            return mm_errf(err, MM_EINVAL, "rdma URL '%s': port=%llu", url->text,
                           (unsigned long long)v);
        p->port = (int)v;
    } else if (rv != MM_ENOENT)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': port is not a number", url->text);
    if ((rv = query_str(url->query, "dev", p->dev, sizeof(p->dev))) == MM_EINVAL)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': bad dev=", url->text);
    if ((rv = query_str(url->query, "id", p->id, sizeof(p->id))) == MM_EINVAL)
        return mm_errf(err, MM_EINVAL, "rdma URL '%s': bad id= (1..%d bytes)", url->text,
                       ID_LEN - 1);
    return MM_OK;
}

// The side channel's URL: same host and port, scheme tcp.
static void tcp_url_of(const mm_url *url, mm_url *t) {
    *t = *url;
    snprintf(t->scheme, sizeof(t->scheme), "tcp");
    t->query[0] = '\0';
    if (strchr(url->host, ':') != NULL)
        snprintf(t->text, sizeof(t->text), "tcp://[%.240s]:%d", url->host, url->port);
    else
        snprintf(t->text, sizeof(t->text), "tcp://%.240s:%d", url->host, url->port);
}

// ---- init: is there any RDMA device at all? -------------------------------------------------

static mm_err rdma_init(char err[MM_ERRLEN]) {
    int n = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    int e = errno;
    if (list != NULL)
        ibv_free_device_list(list);
    if (list == NULL || n == 0)
        return mm_errf(err, MM_EUNSUPP, "rdma://: no RDMA device on this host "
                       "(ibv_get_device_list: %s); rdma:// needs an RDMA NIC or soft-RoCE "
                       "(modprobe rdma_rxe; rdma link add rxe0 type rxe netdev ETH); "
                       "use tcp:// instead",
                       list == NULL ? strerror(e ? e : ENODEV) : "0 devices");
    return MM_OK;
}

// ---- completion queues ----------------------------------------------------------------------

static mm_err wc_error(struct rdma_conn *c, enum ibv_wc_status st) {
    if (atomic_load(&c->shut))
        return MM_ECLOSED;
    switch (st) {
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_REM_ABORT_ERR:
        return MM_EPEERDOWN;
    default:
        return MM_ETRANSPORT;
    }
}

static void poll_tx_cq(struct rdma_conn *c) {
    struct ibv_wc wc[16];
    pthread_mutex_lock(&c->scq_mu);
    for (;;) {
        int n = ibv_poll_cq(c->tx_cq, 16, wc);
        if (n <= 0)
            break;
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                mm_err e = wc_error(c, wc[i].status);
                if (e != MM_ECLOSED && atomic_load(&c->err) == 0)
                    mm_log_debug("rdma %s: send completion %s", c->name,
                                 ibv_wc_status_str(wc[i].status));
                conn_fail(c, e);
            }
            switch (wc[i].wr_id) {
            case WRID_DATA: atomic_fetch_add(&c->tx_done, 1); break;
            case WRID_CREDIT: atomic_fetch_sub(&c->credit_inflight, 1); break;
            case WRID_BYE: atomic_store(&c->bye_done, 1); break;
            default: break;
            }
        }
    }
    pthread_mutex_unlock(&c->scq_mu);
}

static int post_recvs(struct rdma_conn *c, int n) {
    struct ibv_recv_wr wr = {.wr_id = 0, .sg_list = NULL, .num_sge = 0}, *bad = NULL;
    for (int i = 0; i < n; i++)
        if (ibv_post_recv(c->qp, &wr, &bad) != 0)
            return -1;
    return 0;
}

// Moves recv completions into the arrival record (receiving thread only).
static void poll_rx_cq(struct rdma_conn *c) {
    struct ibv_wc wc[16];
    for (;;) {
        int n = ibv_poll_cq(c->rx_cq, 16, wc);
        if (n <= 0)
            return;
        int repost = 0;
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                if (c->rx_err == MM_OK)
                    c->rx_err = wc_error(c, wc[i].status);
                continue;
            }
            repost++;
            if (c->rx_bye || c->rx_err != MM_OK)
                continue;
            if (wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc[i].wc_flags & IBV_WC_WITH_IMM)) {
                c->rx_err = MM_EPROTO;
                continue;
            }
            uint32_t imm = ntohl(wc[i].imm_data);
            uint32_t kind = imm >> 28, slot = imm & 0x0fffffffu;
            if (kind == IMM_BYE) {
                c->rx_bye = true;
                continue;
            }
            if ((kind != IMM_FIRST && kind != IMM_CONT) ||
                slot != (uint32_t)(c->rx_arrived % c->n_rx) ||
                wc[i].byte_len > c->rx_slot_bytes ||
                c->rx_arrived - c->rx_consumed >= c->n_rx) {
                c->rx_err = MM_EPROTO;
                continue;
            }
            c->rx_len[slot] = wc[i].byte_len;
            c->rx_kind[slot] = (uint8_t)kind;
            c->rx_arrived++;
        }
        if (repost > 0 && post_recvs(c, repost) != 0 && c->rx_err == MM_OK)
            c->rx_err = MM_ETRANSPORT;
    }
}

static void drain_channel(struct ibv_comp_channel *ch) {
    struct ibv_cq *cq;
    void *cq_ctx;
    while (ibv_get_cq_event(ch, &cq, &cq_ctx) == 0)
        ibv_ack_cq_events(cq, 1);
}

// Reports the slots copied out so far to the peer's credit word (receiving thread).
static void flush_credits(struct rdma_conn *c, bool force) {
    uint64_t unrep = c->rx_consumed - c->rx_reported;
    if (unrep == 0 || (!force && unrep < (c->n_rx + 3) / 4))
        return;
    if (conn_state(c) != MM_OK)
        return;
    poll_tx_cq(c);
    if (atomic_load(&c->credit_inflight) >= CREDIT_MAX)
        return; // retried on the next call; the writes in flight complete without the peer
    uint64_t val = htole64(c->rx_consumed);
    struct ibv_sge sge = {.addr = (uintptr_t)&val, .length = sizeof(val), .lkey = 0};
    struct ibv_send_wr wr = {
        .wr_id = WRID_CREDIT, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
        .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED,
        .wr.rdma = {.remote_addr = c->remote_credit_addr, .rkey = c->remote_rkey}};
    struct ibv_send_wr *bad = NULL;
    atomic_fetch_add(&c->credit_inflight, 1);
    if (ibv_post_send(c->qp, &wr, &bad) != 0) {
        atomic_fetch_sub(&c->credit_inflight, 1);
        conn_fail(c, MM_ETRANSPORT);
        return;
    }
    c->rx_reported = c->rx_consumed;
}

// ---- side channel ---------------------------------------------------------------------------

// Non-blocking look at the side channel: 0 while the peer is alive, else MM_ECLOSED (it sent
// BYE), MM_EPEERDOWN (socket closed or reset) or MM_EPROTO (unexpected traffic).
static mm_err side_check(struct rdma_conn *c) {
    int s = atomic_load(&c->side);
    if (s != 0)
        return (mm_err)s;
    if (pthread_mutex_trylock(&c->side_mu) != 0)
        return MM_OK; // the other thread is looking
    s = atomic_load(&c->side);
    if (s == 0 && TCP->rx_ready(c->tcp)) {
        mm_wire_hdr h;
        mm_err rv = TCP->recv(c->tcp, &h, NULL, 0, mm_now_ns());
        if (rv == MM_ECLOSED && !atomic_load(&c->shut))
            s = MM_ECLOSED;
        else if (rv == MM_OK || rv == MM_EFULL || rv == MM_EPROTO)
            s = MM_EPROTO;
        else if (rv != MM_ETIMEDOUT)
            s = atomic_load(&c->shut) ? MM_ECLOSED : MM_EPEERDOWN;
        if (s != 0)
            atomic_store(&c->side, s);
    }
    pthread_mutex_unlock(&c->side_mu);
    return (mm_err)s;
}

// pollfds of the side channel (its socket and its shutdown eventfd). Returns how many.
static int side_fds(struct rdma_conn *c, struct pollfd *out, int cap) {
    struct pollfd t[MM_TRANSPORT_MAX_PFD];
    int n = TCP->rx_arm(c->tcp, t);
    if (n > cap)
        n = cap;
    memcpy(out, t, (size_t)n * sizeof(*t));
    return n;
}

// ---- receive --------------------------------------------------------------------------------

// Waits until a chunk is in the ring (MM_OK), or returns why not. A frame already complete
// is always delivered before an error.
static mm_err rx_wait(struct rdma_conn *c, uint64_t deadline_ns) {
    uint64_t start = mm_now_ns(), spin = mm__transport_spin_ns();
    uint64_t grace_end = 0;
    for (;;) {
        poll_rx_cq(c);
        if (c->rx_arrived > c->rx_consumed)
            return MM_OK; // complete frames are delivered before any error
        if (atomic_load(&c->shut))
            return MM_ECLOSED;
        if (c->rx_bye) {
            conn_fail(c, MM_ECLOSED);
            return MM_ECLOSED;
        }
        if (c->rx_err != MM_OK) {
            conn_fail(c, c->rx_err);
            return c->rx_err;
        }
        mm_err st = conn_state(c);
        if (st != MM_OK)
            return st;
        mm_err side = side_check(c);
        uint64_t now = mm_now_ns();
        if (side == MM_ECLOSED) {
            // Orderly close: the BYE write was posted behind the data; give it a moment.
            if (grace_end == 0)
                grace_end = now + BYE_GRACE_MS * 1000000ull;
            if (now >= grace_end || now >= deadline_ns) {
                conn_fail(c, MM_ECLOSED);
                return MM_ECLOSED;
            }
        } else if (side != MM_OK) {
            poll_rx_cq(c); // data that landed before the socket closed comes first
            if (c->rx_arrived > c->rx_consumed)
                return MM_OK;
            conn_fail(c, side);
            return side;
        }
        if (now >= deadline_ns)
            return MM_ETIMEDOUT;
        flush_credits(c, true); // before sleeping, the peer learns every freed slot
        if (now - start < spin) {
            spin_once(now - start);
            continue;
        }
        if (ibv_req_notify_cq(c->rx_cq, 0) != 0) {
            conn_fail(c, MM_ETRANSPORT);
            return MM_ETRANSPORT;
        }
        poll_rx_cq(c); // lost-wakeup rule: a completion may have landed before arming
        if (c->rx_arrived > c->rx_consumed || c->rx_bye || c->rx_err != MM_OK)
            continue;
        struct pollfd p[2 + MM_TRANSPORT_MAX_PFD];
        p[0] = (struct pollfd){.fd = c->rx_ch->fd, .events = POLLIN};
        p[1] = (struct pollfd){.fd = c->efd_shut, .events = POLLIN};
        int np = 2 + (side == MM_OK ? side_fds(c, p + 2, MM_TRANSPORT_MAX_PFD) : 0);
        int tmo = mm__deadline_timeout_ms(grace_end ? (grace_end < deadline_ns ? grace_end
                                                                               : deadline_ns)
                                                    : deadline_ns);
        if (c->rx_consumed != c->rx_reported && (tmo < 0 || tmo > 1))
            tmo = 1; // a credit write was deferred (too many in flight): retry soon
        (void)poll(p, (nfds_t)np, tmo);
        drain_channel(c->rx_ch);
    }
}

// Fails the conn for a broken frame and returns what the caller should see.
static mm_err rx_break(struct rdma_conn *c, mm_err rv) {
    mm_err sticky = rv == MM_ETIMEDOUT ? MM_ETRANSPORT : rv; // half a frame: no resync
    conn_fail(c, sticky);
    if (c->rx_broken == MM_OK)
        c->rx_broken = sticky;
    return rv;
}

static mm_err rdma_recv(void *ctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                        uint64_t deadline_ns) {
    struct rdma_conn *c = ctx;
    if (atomic_load(&c->shut))
        return MM_ECLOSED;
    if (c->rx_broken != MM_OK)
        return c->rx_broken;
    mm_err rv = rx_wait(c, deadline_ns);
    if (rv != MM_OK)
        return rv;
    uint32_t slot = (uint32_t)(c->rx_consumed % c->n_rx);
    const uint8_t *sp = c->rx_mem + 4096 + (size_t)slot * c->rx_slot_bytes;
    uint32_t len = c->rx_len[slot];
    if (c->rx_kind[slot] == IMM_CONT || len < sizeof(*hdr))
        return rx_break(c, MM_EPROTO);
    memcpy(hdr, sp, sizeof(*hdr));
    if (c->rx_kind[slot] != IMM_FIRST || mm_wire_hdr_check(hdr, NULL) != MM_OK ||
        hdr->kind == MM_WIRE_HELLO)
        return rx_break(c, MM_EPROTO);
    if (hdr->kind == MM_WIRE_BYE)
        return rx_break(c, MM_ECLOSED);
    uint64_t total = sizeof(*hdr) + hdr->payload_bytes;
    if (len != (total < c->rx_slot_bytes ? total : c->rx_slot_bytes))
        return rx_break(c, MM_EPROTO);
    bool fits = hdr->payload_bytes <= cap;
    uint64_t off = len - sizeof(*hdr);
    if (fits && off > 0)
        memcpy(buf, sp + sizeof(*hdr), off);
    c->rx_consumed++;
    while (off < hdr->payload_bytes) {
        flush_credits(c, false);
        rv = rx_wait(c, deadline_ns);
        if (rv != MM_OK)
            return rx_break(c, rv);
        slot = (uint32_t)(c->rx_consumed % c->n_rx);
        sp = c->rx_mem + 4096 + (size_t)slot * c->rx_slot_bytes;
        uint64_t want = hdr->payload_bytes - off;
        if (want > c->rx_slot_bytes)
            want = c->rx_slot_bytes;
        if (c->rx_kind[slot] != IMM_CONT || c->rx_len[slot] != want)
            return rx_break(c, MM_EPROTO);
        if (fits)
            memcpy((uint8_t *)buf + off, sp, want);
        off += want;
        c->rx_consumed++;
    }
    flush_credits(c, true);
    return fits ? MM_OK : MM_EFULL;
}

static bool rdma_rx_ready(void *ctx) {
    struct rdma_conn *c = ctx;
    if (conn_state(c) != MM_OK)
        return true;
    poll_rx_cq(c);
    if (c->rx_arrived > c->rx_consumed || c->rx_bye || c->rx_err != MM_OK)
        return true;
    flush_credits(c, true);
    return side_check(c) != MM_OK;
}

static int rdma_rx_arm(void *ctx, struct pollfd *pfds) {
    struct rdma_conn *c = ctx;
    ibv_req_notify_cq(c->rx_cq, 0); // a failure shows up as readiness on the next check
    pfds[0] = (struct pollfd){.fd = c->rx_ch->fd, .events = POLLIN};
    pfds[1] = (struct pollfd){.fd = c->efd_shut, .events = POLLIN};
    return 2 + side_fds(c, pfds + 2, MM_TRANSPORT_MAX_PFD - 2);
}

static void rdma_rx_disarm(void *ctx) {
    struct rdma_conn *c = ctx;
    drain_channel(c->rx_ch);
}

// ---- send -----------------------------------------------------------------------------------

// Waits until staging slot tx_posted is free here and credited by the peer.
static mm_err tx_wait(struct rdma_conn *c, uint64_t deadline_ns) {
    uint64_t start = mm_now_ns(), spin = mm__transport_spin_ns();
    volatile uint64_t *credit = (volatile uint64_t *)c->rx_mem;
    for (;;) {
        poll_tx_cq(c);
        uint64_t cr = le64toh(__atomic_load_n(credit, __ATOMIC_ACQUIRE));
        uint64_t done = atomic_load(&c->tx_done);
        uint64_t lim = (cr < done ? cr : done) + c->n_tx;
        if (c->tx_posted < lim && c->tx_posted - done < c->tx_budget)
            return MM_OK;
        mm_err st = conn_state(c);
        if (st != MM_OK)
            return st;
        mm_err side = side_check(c);
        if (side != MM_OK) {
            conn_fail(c, side);
            return side;
        }
        uint64_t now = mm_now_ns();
        if (now >= deadline_ns)
            return MM_ETIMEDOUT;
        if (now - start < spin) {
            spin_once(now - start);
            continue;
        }
        pthread_mutex_lock(&c->scq_mu);
        int arm = ibv_req_notify_cq(c->tx_cq, 0);
        pthread_mutex_unlock(&c->scq_mu);
        if (arm != 0) {
            conn_fail(c, MM_ETRANSPORT);
            return MM_ETRANSPORT;
        }
        poll_tx_cq(c);
        if (atomic_load(&c->tx_done) != done)
            continue;
        struct pollfd p[2 + MM_TRANSPORT_MAX_PFD];
        p[0] = (struct pollfd){.fd = c->tx_ch->fd, .events = POLLIN};
        p[1] = (struct pollfd){.fd = c->efd_shut, .events = POLLIN};
        int np = 2 + side_fds(c, p + 2, MM_TRANSPORT_MAX_PFD);
        int tmo = mm__deadline_timeout_ms(deadline_ns);
        if (tmo < 0 || tmo > 1)
            tmo = 1; // credits land as plain writes without an event: re-check every ms
        (void)poll(p, (nfds_t)np, tmo);
        drain_channel(c->tx_ch);
    }
}

static mm_err post_chunk(struct rdma_conn *c, uint32_t slot, uint32_t len, uint32_t kind) {
    struct ibv_sge sge = {.addr = (uintptr_t)(c->tx_mem + (size_t)slot * c->tx_slot_bytes),
                          .length = len, .lkey = c->tx_mr->lkey};
    struct ibv_send_wr wr = {
        .wr_id = WRID_DATA, .sg_list = &sge, .num_sge = 1,
        .opcode = IBV_WR_RDMA_WRITE_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
        .imm_data = htonl(IMM(kind, slot)),
        .wr.rdma = {.remote_addr = c->remote_rx_addr + (uint64_t)slot * c->tx_slot_bytes,
                    .rkey = c->remote_rkey}};
    struct ibv_send_wr *bad = NULL;
    int e = ibv_post_send(c->qp, &wr, &bad);
    if (e != 0) {
        mm_log_debug("rdma %s: ibv_post_send: %s", c->name, strerror(e));
        return MM_ETRANSPORT;
    }
    c->tx_posted++;
    return MM_OK;
}

static mm_err rdma_sendv(void *ctx, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                         uint64_t deadline_ns) {
    struct rdma_conn *c = ctx;
    mm_err rv = conn_state(c);
    if (rv != MM_OK)
        return rv;
    pthread_mutex_lock(&c->tx_mu);
    uint64_t left = sizeof(*hdr) + hdr->payload_bytes;
    bool first = true;
    int vi = 0;
    size_t vo = 0; // cursor in iov
    while (left > 0) {
        rv = tx_wait(c, deadline_ns);
        if (rv != MM_OK) {
            if (!(rv == MM_ETIMEDOUT && first))
                conn_fail(c, rv == MM_ETIMEDOUT ? MM_ETRANSPORT : rv); // half a frame out
            break;
        }
        uint32_t slot = (uint32_t)(c->tx_posted % c->n_tx);
        uint8_t *dst = c->tx_mem + (size_t)slot * c->tx_slot_bytes;
        uint32_t len = left < c->tx_slot_bytes ? (uint32_t)left : c->tx_slot_bytes;
        uint32_t off = 0;
        if (first) {
            memcpy(dst, hdr, sizeof(*hdr));
            off = sizeof(*hdr);
        }
        while (off < len) { // gather the payload into the staging slot
            while (vi < n_iov && vo == iov[vi].iov_len) {
                vi++;
                vo = 0;
            }
            size_t take = iov[vi].iov_len - vo;
            if (take > len - off)
                take = len - off;
            memcpy(dst + off, (const uint8_t *)iov[vi].iov_base + vo, take);
            vo += take;
            off += (uint32_t)take;
        }
        rv = post_chunk(c, slot, len, first ? IMM_FIRST : IMM_CONT);
        if (rv != MM_OK) {
            conn_fail(c, rv);
            break;
        }
        first = false;
        left -= len;
    }
    pthread_mutex_unlock(&c->tx_mu);
    return rv;
}

static mm_err rdma_send_raw(void *ctx, const void *p, size_t n, uint64_t deadline_ns) {
    struct rdma_conn *c = ctx;
    if (n == 0 || n > c->tx_slot_bytes)
        return MM_EINVAL;
    pthread_mutex_lock(&c->tx_mu);
    mm_err rv = tx_wait(c, deadline_ns);
    if (rv == MM_OK) {
        uint32_t slot = (uint32_t)(c->tx_posted % c->n_tx);
        memcpy(c->tx_mem + (size_t)slot * c->tx_slot_bytes, p, n);
        rv = post_chunk(c, slot, (uint32_t)n, IMM_FIRST);
    }
    pthread_mutex_unlock(&c->tx_mu);
    return rv;
}

// ---- lifecycle ------------------------------------------------------------------------------

static mm_err rdma_status(void *ctx) {
    struct rdma_conn *c = ctx;
    mm_err st = conn_state(c);
    if (st != MM_OK)
        return st;
    // A dead peer counts only once its frames are read: side_check is left to recv/rx_ready.
    return MM_OK;
}

static bool post_bye(struct rdma_conn *c) {
    struct ibv_send_wr wr = {
        .wr_id = WRID_BYE, .sg_list = NULL, .num_sge = 0,
        .opcode = IBV_WR_RDMA_WRITE_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
        .imm_data = htonl(IMM(IMM_BYE, 0)),
        .wr.rdma = {.remote_addr = c->remote_credit_addr, .rkey = c->remote_rkey}};
    struct ibv_send_wr *bad = NULL;
    return ibv_post_send(c->qp, &wr, &bad) == 0;
}

static void rdma_shutdown(void *ctx) {
    struct rdma_conn *c = ctx;
    if (c->owner_pid != getpid())
        return; // forked copy: the verbs objects and the socket belong to the parent
    if (atomic_exchange(&c->shut, 1))
        return;
    bool bye = false;
    if (c->qp != NULL && pthread_mutex_trylock(&c->tx_mu) == 0) {
        if (atomic_load(&c->err) == 0 && atomic_load(&c->side) == 0)
            bye = post_bye(c); // behind every data write already posted (RC order)
        pthread_mutex_unlock(&c->tx_mu);
    }
    if (!bye) { // the peer learns of the close from the side channel's BYE instead
        atomic_store(&c->bye_done, 1);
        if (c->tcp != NULL)
            TCP->shutdown(c->tcp);
    }
    uint64_t one = 1;
    ssize_t r = write(c->efd_shut, &one, sizeof(one));
    (void)r;
}

static void conn_free(struct rdma_conn *c) {
    if (c == NULL)
        return;
    bool mine = c->owner_pid == getpid();
    if (mine) {
        if (c->qp != NULL)
            ibv_destroy_qp(c->qp);
        if (c->rx_cq != NULL)
            ibv_destroy_cq(c->rx_cq);
        if (c->tx_cq != NULL)
            ibv_destroy_cq(c->tx_cq);
        if (c->rx_ch != NULL)
            ibv_destroy_comp_channel(c->rx_ch);
        if (c->tx_ch != NULL)
            ibv_destroy_comp_channel(c->tx_ch);
        if (c->rx_mr != NULL)
            ibv_dereg_mr(c->rx_mr);
        if (c->tx_mr != NULL)
            ibv_dereg_mr(c->tx_mr);
        if (c->pd != NULL)
            ibv_dealloc_pd(c->pd);
        if (c->ctx != NULL)
            ibv_close_device(c->ctx);
    }
    if (c->tcp != NULL)
        TCP->close(c->tcp); // sends the side channel's BYE (tcp.c skips it in forked copies)
    close_fd(&c->efd_shut);
    free(c->rx_mem);
    free(c->tx_mem);
    free(c->rx_len);
    free(c->rx_kind);
    pthread_mutex_destroy(&c->tx_mu);
    pthread_mutex_destroy(&c->scq_mu);
    pthread_mutex_destroy(&c->side_mu);
    free(c);
}

static void rdma_close(void *ctx) {
    struct rdma_conn *c = ctx;
    if (c == NULL)
        return;
    if (c->owner_pid == getpid() && c->qp != NULL) {
        rdma_shutdown(c);
        // Let queued writes and the BYE reach the peer before the QP goes away (bounded).
        uint64_t end = mm_now_ns() + CLOSE_DRAIN_MS * 1000000ull;
        while (mm_now_ns() < end && atomic_load(&c->err) == 0 && side_check(c) == MM_OK) {
            poll_tx_cq(c);
            if (atomic_load(&c->bye_done) && atomic_load(&c->tx_done) >= c->tx_posted)
                break;
            usleep(200);
        }
    }
    conn_free(c);
}

// ---- setup ----------------------------------------------------------------------------------

static mm_err open_device(struct rdma_conn *c, const struct rdma_params *p,
                          struct ibv_port_attr *pa, char err[MM_ERRLEN]) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (list == NULL || n == 0) {
        if (list != NULL)
            ibv_free_device_list(list);
        return mm_errf(err, MM_EUNSUPP, "rdma://: no RDMA device on this host");
    }
    mm_err rv = MM_OK;
    for (int i = 0; i < n && c->ctx == NULL; i++) {
        const char *name = ibv_get_device_name(list[i]);
        if (p->dev[0] != '\0' && strcmp(name, p->dev) != 0)
            continue;
        struct ibv_context *ctx = ibv_open_device(list[i]);
        if (ctx == NULL) {
            rv = mm_errf(err, MM_ETRANSPORT, "rdma: ibv_open_device(%s): %s", name,
                         strerror(errno));
            continue;
        }
        if (ibv_query_port(ctx, (uint8_t)p->port, pa) != 0 || pa->state != IBV_PORT_ACTIVE) {
            rv = mm_errf(err, MM_ETRANSPORT, "rdma: %s port %d is not active", name, p->port);
            ibv_close_device(ctx);
            continue;
        }
        c->ctx = ctx;
        snprintf(c->name, sizeof(c->name), "%s/%d", name, p->port);
        rv = MM_OK;
    }
    if (c->ctx == NULL && rv == MM_OK)
        rv = mm_errf(err, MM_ENOENT, "rdma: no RDMA device named '%s' (dev=)", p->dev);
    ibv_free_device_list(list);
    return rv;
}

static bool gid_is_v4(const union ibv_gid *g) {
    static const uint8_t pre[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g->raw, pre, 12) == 0;
}

// Picks the GID: the one asked for, else a RoCE v2 IPv4-mapped GID (the one holding
// prefer_host's address when there is one).
static mm_err pick_gid(struct rdma_conn *c, const struct rdma_params *p,
                       const struct ibv_port_attr *pa, const char *prefer_host, int *index,
                       union ibv_gid *gid, char err[MM_ERRLEN]) {
    if (pa->link_layer != IBV_LINK_LAYER_ETHERNET) { // InfiniBand: LID routing, GID 0
        *index = p->gid_index >= 0 ? p->gid_index : 0;
        if (ibv_query_gid(c->ctx, (uint8_t)p->port, *index, gid) != 0)
            return mm_errf(err, MM_ETRANSPORT, "rdma %s: no GID %d", c->name, *index);
        return MM_OK;
    }
    if (p->gid_index >= 0) {
        struct ibv_gid_entry e;
        if (ibv_query_gid_ex(c->ctx, (uint32_t)p->port, (uint32_t)p->gid_index, &e, 0) != 0)
            return mm_errf(err, MM_EINVAL, "rdma %s: gid_index=%d is not in the GID table",
                           c->name, p->gid_index);
        *index = p->gid_index;
        *gid = e.gid;
        return MM_OK;
    }
    struct in_addr want;
    bool have_want = prefer_host != NULL && inet_pton(AF_INET, prefer_host, &want) == 1;
    int found = -1;
    for (int i = 0; i < pa->gid_tbl_len; i++) {
        struct ibv_gid_entry e;
        if (ibv_query_gid_ex(c->ctx, (uint32_t)p->port, (uint32_t)i, &e, 0) != 0)
            continue;
        if (e.gid_type != IBV_GID_TYPE_ROCE_V2 || !gid_is_v4(&e.gid))
            continue;
        if (found < 0 || (have_want && memcmp(e.gid.raw + 12, &want, 4) == 0)) {
            found = i;
            *gid = e.gid;
            if (have_want && memcmp(e.gid.raw + 12, &want, 4) == 0)
                break;
        }
    }
    if (found < 0)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: no RoCE v2 IPv4 GID (give the netdev an "
                       "IPv4 address, or choose one with ?gid_index=)", c->name);
    *index = found;
    return MM_OK;
}

static mm_err side_send(struct rdma_conn *c, const void *p, uint32_t n, uint64_t seq,
                        uint64_t deadline_ns) {
    mm_wire_hdr h;
    MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_CTRL, MM_WIRE_BYTES, seq, MM_WIRE_NO_LAYER, 1, n));
    mm__wire_hdr_seal(&h, seq);
    struct iovec v = {.iov_base = (void *)p, .iov_len = n};
    return TCP->sendv(c->tcp, &h, &v, 1, deadline_ns);
}

static mm_err side_recv(struct rdma_conn *c, void *p, uint32_t n, uint64_t deadline_ns) {
    mm_wire_hdr h;
    mm_err rv = TCP->recv(c->tcp, &h, p, n, deadline_ns);
    if (rv == MM_EFULL || (rv == MM_OK && (h.kind != MM_WIRE_CTRL || h.payload_bytes != n)))
        return MM_EPROTO;
    return rv;
}

static mm_err qp_to_rts(struct rdma_conn *c, const struct rdma_params *p, int my_mtu,
                        uint32_t my_psn, const struct conn_info *peer,
                        const struct ibv_port_attr *pa, int gid_index, char err[MM_ERRLEN]) {
    int mtu = my_mtu < (int)le32toh(peer->mtu) ? my_mtu : (int)le32toh(peer->mtu);
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)mtu;
    a.dest_qp_num = le32toh(peer->qpn);
    a.rq_psn = le32toh(peer->psn);
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = (uint8_t)p->port;
    if (pa->link_layer == IBV_LINK_LAYER_ETHERNET) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
        a.ah_attr.grh.hop_limit = 64;
    } else {
        a.ah_attr.dlid = (uint16_t)le32toh(peer->lid);
    }
    int e = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                          IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                          IBV_QP_MIN_RNR_TIMER);
    if (e != 0)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: QP to RTR: %s", c->name, strerror(e));
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;   // 4.096 us * 2^14 = 67 ms per try
    a.retry_cnt = 7;
    a.rnr_retry = 7;  // receivers repost at once; RNR only when a peer stalls
    a.sq_psn = my_psn;
    a.max_rd_atomic = 1;
    e = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                      IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (e != 0)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: QP to RTS: %s", c->name, strerror(e));
    return MM_OK;
}

static mm_err alloc_region(uint8_t **mem, size_t n) {
    void *m = NULL;
    if (posix_memalign(&m, 4096, n) != 0)
        return MM_ENOMEM;
    memset(m, 0, n);
    *mem = m;
    return MM_OK;
}

// Builds the verbs objects over an established side channel and exchanges conn_info.
static mm_err conn_setup(struct rdma_conn *c, const struct rdma_params *p, bool dialer,
                         const char *host, uint64_t deadline_ns, char err[MM_ERRLEN]) {
    struct ibv_port_attr pa;
    int gid_index = 0;
    union ibv_gid gid;
    MM_TRY(open_device(c, p, &pa, err));
    MM_TRY(pick_gid(c, p, &pa, host, &gid_index, &gid, err));
    c->pd = ibv_alloc_pd(c->ctx);
    c->rx_ch = ibv_create_comp_channel(c->ctx);
    c->tx_ch = ibv_create_comp_channel(c->ctx);
    if (c->pd == NULL || c->rx_ch == NULL || c->tx_ch == NULL)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: PD/completion channel: %s", c->name,
                       strerror(errno));
    fcntl(c->rx_ch->fd, F_SETFL, fcntl(c->rx_ch->fd, F_GETFL) | O_NONBLOCK);
    fcntl(c->tx_ch->fd, F_SETFL, fcntl(c->tx_ch->fd, F_GETFL) | O_NONBLOCK);
    c->n_rx = p->n_slots;
    c->rx_slot_bytes = p->slot_bytes;
    c->rx_mem_bytes = 4096 + (size_t)c->n_rx * c->rx_slot_bytes;
    c->rx_len = calloc(c->n_rx, sizeof(*c->rx_len));
    c->rx_kind = calloc(c->n_rx, sizeof(*c->rx_kind));
    if (c->rx_len == NULL || c->rx_kind == NULL || alloc_region(&c->rx_mem, c->rx_mem_bytes))
        return mm_errf(err, MM_ENOMEM, "rdma: %zu-byte receive ring", c->rx_mem_bytes);
    c->rx_mr = ibv_reg_mr(c->pd, c->rx_mem, c->rx_mem_bytes,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (c->rx_mr == NULL)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: ibv_reg_mr(%zu bytes): %s (memlock "
                       "limit? ulimit -l / LimitMEMLOCK=infinity)", c->name, c->rx_mem_bytes,
                       strerror(errno));
    int rx_depth = (int)c->n_rx + EXTRA_RECVS;
    c->tx_budget = p->n_slots; // the peer's ring is not known yet: bound writes in flight
    int tx_depth = (int)c->tx_budget + CREDIT_MAX + 4;
    c->rx_cq = ibv_create_cq(c->ctx, rx_depth, NULL, c->rx_ch, 0);
    c->tx_cq = ibv_create_cq(c->ctx, tx_depth, NULL, c->tx_ch, 0);
    if (c->rx_cq == NULL || c->tx_cq == NULL)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: ibv_create_cq: %s", c->name,
                       strerror(errno));
    struct ibv_qp_init_attr qa = {
        .send_cq = c->tx_cq, .recv_cq = c->rx_cq, .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = (uint32_t)tx_depth, .max_recv_wr = (uint32_t)rx_depth,
                .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = 64}};
    c->qp = ibv_create_qp(c->pd, &qa);
    if (c->qp == NULL)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: ibv_create_qp(RC): %s", c->name,
                       strerror(errno));
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0,
                            .port_num = (uint8_t)p->port,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    int e = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                          IBV_QP_ACCESS_FLAGS);
    if (e != 0)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: QP to INIT: %s", c->name, strerror(e));
    if (post_recvs(c, rx_depth) != 0)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: ibv_post_recv failed", c->name);

    struct conn_info me, peer;
    memset(&me, 0, sizeof(me));
    memcpy(me.magic, INFO_MAGIC, sizeof(INFO_MAGIC));
    snprintf(me.id, sizeof(me.id), "%s", p->id);
    memcpy(me.gid, gid.raw, 16);
    uint32_t psn = (uint32_t)(mm_now_ns() ^ ((uint64_t)getpid() << 8)) & 0xffffffu;
    int mtu = p->mtu ? p->mtu : (int)pa.active_mtu;
    if (mtu > (int)pa.active_mtu)
        mtu = (int)pa.active_mtu;
    me.qpn = htole32(c->qp->qp_num);
    me.psn = htole32(psn);
    me.rkey = htole32(c->rx_mr->rkey);
    me.n_slots = htole32(c->n_rx);
    me.slot_bytes = htole32(c->rx_slot_bytes);
    me.mtu = htole32((uint32_t)mtu);
    me.lid = htole32(pa.lid);
    me.link_layer = htole32(pa.link_layer);
    me.credit_addr = htole64((uintptr_t)c->rx_mem);
    me.rx_addr = htole64((uintptr_t)(c->rx_mem + 4096));
    mm_err rv;
    if (dialer) {
        if ((rv = side_send(c, &me, sizeof(me), 0, deadline_ns)) != MM_OK ||
            (rv = side_recv(c, &peer, sizeof(peer), deadline_ns)) != MM_OK)
            return mm_errf(err, rv, "rdma setup: exchange with the listener: %s",
                           mm_strerror(rv));
    } else {
        if ((rv = side_recv(c, &peer, sizeof(peer), deadline_ns)) != MM_OK)
            return mm_errf(err, rv == MM_ETIMEDOUT ? rv : MM_EPROTO,
                           "rdma setup: no connection info from the dialer: %s",
                           mm_strerror(rv));
    }
    peer.id[ID_LEN - 1] = '\0';
    if (memcmp(peer.magic, INFO_MAGIC, sizeof(INFO_MAGIC)) != 0)
        return mm_errf(err, MM_EPROTO, "rdma setup: peer is not an rdma:// endpoint");
    if (strcmp(peer.id, me.id) != 0) {
        if (!dialer) // answer anyway, so that the dialer can name the mismatch too
            (void)side_send(c, &me, sizeof(me), 0, deadline_ns);
        return mm_errf(err, MM_EIDENTITY, "rdma setup: identity mismatch: ours '%s', peer's "
                       "'%s'", me.id, peer.id);
    }
    if (le32toh(peer.link_layer) != pa.link_layer)
        return mm_errf(err, MM_EPROTO, "rdma setup: link layers differ (ours %u, peer %u)",
                       pa.link_layer, le32toh(peer.link_layer));
    c->n_tx = le32toh(peer.n_slots);
    c->tx_slot_bytes = le32toh(peer.slot_bytes);
    uint32_t pmtu = le32toh(peer.mtu);
    if (c->n_tx < 2 || c->n_tx > MAX_SLOTS || c->tx_slot_bytes < 4096 ||
        c->tx_slot_bytes > (64u << 20) || pmtu < IBV_MTU_256 || pmtu > IBV_MTU_4096)
        return mm_errf(err, MM_EPROTO, "rdma setup: peer ring %u x %u bytes, mtu %u: out of "
                       "range", c->n_tx, c->tx_slot_bytes, pmtu);
    c->remote_rx_addr = le64toh(peer.rx_addr);
    c->remote_credit_addr = le64toh(peer.credit_addr);
    c->remote_rkey = le32toh(peer.rkey);
    c->tx_mem_bytes = (size_t)c->n_tx * c->tx_slot_bytes;
    if (alloc_region(&c->tx_mem, c->tx_mem_bytes) != MM_OK)
        return mm_errf(err, MM_ENOMEM, "rdma: %zu-byte send ring", c->tx_mem_bytes);
    c->tx_mr = ibv_reg_mr(c->pd, c->tx_mem, c->tx_mem_bytes, IBV_ACCESS_LOCAL_WRITE);
    if (c->tx_mr == NULL)
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: ibv_reg_mr(%zu bytes): %s", c->name,
                       c->tx_mem_bytes, strerror(errno));
    MM_TRY(qp_to_rts(c, p, mtu, psn, &peer, &pa, gid_index, err));
    static const char ready[8] = "READY";
    char got[8];
    if (dialer) {
        if ((rv = side_send(c, ready, sizeof(ready), 1, deadline_ns)) != MM_OK)
            return mm_errf(err, rv, "rdma setup: READY: %s", mm_strerror(rv));
    } else {
        if ((rv = side_send(c, &me, sizeof(me), 0, deadline_ns)) != MM_OK ||
            (rv = side_recv(c, got, sizeof(got), deadline_ns)) != MM_OK)
            return mm_errf(err, rv == MM_ETIMEDOUT ? rv : MM_EPROTO,
                           "rdma setup: answer/READY: %s", mm_strerror(rv));
        if (memcmp(got, ready, sizeof(ready)) != 0)
            return mm_errf(err, MM_EPROTO, "rdma setup: dialer did not confirm READY");
    }
    char gs[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, gid.raw, gs, sizeof(gs));
    snprintf(c->name + strlen(c->name), sizeof(c->name) - strlen(c->name), " gid[%d]",
             gid_index);
    int mt = mtu < (int)pmtu ? mtu : (int)pmtu;
    if (!atomic_exchange(&logged_path, 1))
        mm_log_info("rdma: %s %s (%s), RC QP %u, MTU %d, ring %u x %u KiB; memory path: "
                    "pinned host memory (GPU memory registration via dma-buf/peermem is "
                    "not built)", c->name, gs,
                    pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE v2" : "InfiniBand",
                    c->qp->qp_num, mtu_bytes(mt), c->n_rx, c->rx_slot_bytes >> 10);
    else
        mm_log_debug("rdma: %s %s QP %u -> peer QP %u, MTU %d", c->name, gs, c->qp->qp_num,
                     le32toh(peer.qpn), mtu_bytes(mt));
    return MM_OK;
}

static struct rdma_conn *conn_new(void *tcp) {
    struct rdma_conn *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->owner_pid = getpid();
    c->tcp = tcp;
    c->efd_shut = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_init(&c->tx_mu, NULL);
    pthread_mutex_init(&c->scq_mu, NULL);
    pthread_mutex_init(&c->side_mu, NULL);
    if (c->efd_shut < 0) {
        c->tcp = NULL;
        conn_free(c);
        return NULL;
    }
    return c;
}

// ---- listener and dial ----------------------------------------------------------------------

static mm_err rdma_listen(void **lctx, const mm_url *url, char err[MM_ERRLEN]) {
    struct rdma_listener *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return mm_errf(err, MM_ENOMEM, "rdma listener");
    mm_err rv = parse_params(url, &l->p, err);
    if (rv == MM_OK) {
        mm_url t;
        tcp_url_of(url, &t);
        snprintf(l->host, sizeof(l->host), "%s", url->host);
        rv = TCP->listen(&l->tcp, &t, err);
    }
    if (rv != MM_OK) {
        free(l);
        return rv;
    }
    *lctx = l;
    return MM_OK;
}

static mm_err rdma_accept(void *lctx, void **cctx, uint64_t deadline_ns, char err[MM_ERRLEN]) {
    struct rdma_listener *l = lctx;
    void *tcp = NULL;
    MM_TRY(TCP->accept(l->tcp, &tcp, deadline_ns, err));
    // The caller's deadline bounds the wait for a dialer. Once one is here, its setup (device
    // open, ring registration, QP transitions, two round trips) gets at least SETUP_MIN_MS:
    // servers that poll accept with short deadlines (mm_dataserv: 100 ms) would otherwise
    // drop every rdma:// dialer on a slow box. Still bounded; the dialer's own deadline too.
    uint64_t setup_min = mm_now_ns() + SETUP_MIN_MS * 1000000ull;
    if (deadline_ns < setup_min)
        deadline_ns = setup_min;
    struct rdma_conn *c = conn_new(tcp);
    if (c == NULL) {
        TCP->close(tcp);
        return mm_errf(err, MM_ENOMEM, "rdma conn");
    }
    mm_err rv = conn_setup(c, &l->p, false, l->host, deadline_ns, err);
    if (rv != MM_OK) {
        conn_free(c);
        return rv;
    }
    *cctx = c;
    return MM_OK;
}

static void rdma_listener_shutdown(void *lctx) {
    struct rdma_listener *l = lctx;
    TCP->listener_shutdown(l->tcp);
}

static void rdma_listener_close(void *lctx) {
    struct rdma_listener *l = lctx;
    if (l == NULL)
        return;
    TCP->listener_close(l->tcp);
    free(l);
}

static mm_err rdma_dial(void **cctx, const mm_url *url, uint64_t deadline_ns,
                        char err[MM_ERRLEN]) {
    struct rdma_params p;
    MM_TRY(parse_params(url, &p, err));
    mm_url t;
    tcp_url_of(url, &t);
    void *tcp = NULL;
    MM_TRY(TCP->dial(&tcp, &t, deadline_ns, err));
    struct rdma_conn *c = conn_new(tcp);
    if (c == NULL) {
        TCP->close(tcp);
        return mm_errf(err, MM_ENOMEM, "rdma conn");
    }
    mm_err rv = conn_setup(c, &p, true, NULL, deadline_ns, err);
    if (rv != MM_OK) {
        conn_free(c);
        return rv;
    }
    *cctx = c;
    return MM_OK;
}

// ---- memory registration --------------------------------------------------------------------

// Registers host memory with the conn's protection domain (local write + remote write), so
// that callers can pin their row buffers once at start. GPU pointers are not supported here.
static mm_err rdma_reg_mem(void *cctx, void *p, size_t n_bytes, void **reg,
                           char err[MM_ERRLEN]) {
    struct rdma_conn *c = cctx;
    struct rdma_reg *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return mm_errf(err, MM_ENOMEM, "rdma reg");
    r->mr = ibv_reg_mr(c->pd, p, n_bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (r->mr == NULL) {
        int e = errno;
        free(r);
        return mm_errf(err, MM_ETRANSPORT, "rdma %s: ibv_reg_mr(%zu bytes): %s", c->name,
                       n_bytes, strerror(e));
    }
    *reg = r;
    return MM_OK;
}

static void rdma_dereg_mem(void *cctx, void *reg) {
    struct rdma_conn *c = cctx;
    struct rdma_reg *r = reg;
    if (r == NULL)
        return;
    if (c->owner_pid == getpid())
        ibv_dereg_mr(r->mr);
    free(r);
}

const struct mm_transport_ops mm__transport_rdma = {
    .version = MM_TRANSPORT_V1,
    .scheme = "rdma",
    .init = rdma_init,
    .listen = rdma_listen,
    .accept = rdma_accept,
    .listener_shutdown = rdma_listener_shutdown,
    .listener_close = rdma_listener_close,
    .dial = rdma_dial,
    .reg_mem = rdma_reg_mem,
    .dereg_mem = rdma_dereg_mem,
    .sendv = rdma_sendv,
    .recv = rdma_recv,
    .rx_ready = rdma_rx_ready,
    .rx_arm = rdma_rx_arm,
    .rx_disarm = rdma_rx_disarm,
    .status = rdma_status,
    .shutdown = rdma_shutdown,
    .close = rdma_close,
    .send_raw = rdma_send_raw,
};
