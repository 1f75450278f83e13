// SPDX-License-Identifier: MIT
// The data-plane transport conformance suite: the same test functions run for every scheme
// in SCHEMES (shm://, tcp://; rdma:// is added by listing it there). Peers are fork()ed
// processes; tcp binds loopback only, on ports from mm_test_next_port().
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "mm_test.h"
#include "mm/transport.h"

#define LONG_DL() mm_deadline_in_ms(10000) // generous: only a bug reaches it
#define BIG (6u << 20)                    // largest frame the suite sends (> shm ring)

static unsigned char *xbuf(size_t n) {
    unsigned char *p = malloc(n);
    MM_TRUE(p != NULL);
    return p;
}

static void make_url(const char *scheme, char *url, size_t cap) {
    static int n;
    if (strcmp(scheme, "tcp") == 0)
        snprintf(url, cap, "tcp://127.0.0.1:%d", mm_test_next_port());
    else if (strcmp(scheme, "rdma") == 0) // HOST:PORT is the side channel; GIDs are found
        snprintf(url, cap, "rdma://%s:%d",
                 getenv("MM_TEST_RDMA_HOST") ? getenv("MM_TEST_RDMA_HOST") : "127.0.0.1",
                 mm_test_next_port());
    else
        snprintf(url, cap, "%s://mmt-%d-%d", scheme, (int)getpid(), n++);
}

// Listen on a fresh URL of scheme (retrying a few ports taken by other processes).
static mm_listener *listen_fresh(const char *scheme, char *url, size_t cap) {
    char err[MM_ERRLEN] = "";
    mm_listener *l = NULL;
    for (int i = 0; i < 20; i++) {
        make_url(scheme, url, cap);
        mm_err rv = mm_transport_listen(&l, url, err);
        if (rv == MM_OK)
            return l;
        if (rv == MM_EUNSUPP) // rdma:// without an RDMA device, cudaipc:// without GPU support
            MM_SKIP("%s", err);
        if (rv != MM_EBUSY)
            MM_TEST_FAIL_("listen %s: %s (%s)", url, mm_strerror(rv), err);
    }
    MM_TEST_FAIL_("no free address for %s", scheme);
    return NULL;
}

static mm_conn *dial(const char *url) {
    char err[MM_ERRLEN] = "";
    mm_conn *c = NULL;
    mm_err rv = mm_transport_dial(&c, url, LONG_DL(), err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("dial %s: %s (%s)", url, mm_strerror(rv), err);
    return c;
}

static mm_conn *accept_one(mm_listener *l) {
    char err[MM_ERRLEN] = "";
    mm_conn *c = NULL;
    mm_err rv = mm_listener_accept(l, &c, LONG_DL(), err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("accept: %s (%s)", mm_strerror(rv), err);
    return c;
}

static pid_t spawn(void (*fn)(const char *url, int arg), const char *url, int arg) {
    fflush(NULL);
    pid_t pid = fork();
    MM_TRUE(pid >= 0);
    if (pid == 0) {
        fn(url, arg);
        _exit(0);
    }
    return pid;
}

// Waits for pid (killing it after 15 s) and returns its exit status (128+sig when killed).
static int reap(pid_t pid) {
    int st = 0;
    for (int i = 0; i < 1500; i++) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

static unsigned char pat(uint64_t step, size_t i) { return (unsigned char)(step * 131 + i * 7 + 1); }

static void fill(unsigned char *p, size_t n, uint64_t step) {
    for (size_t i = 0; i < n; i++)
        p[i] = pat(step, i);
}

static void check_fill(const unsigned char *p, size_t n, uint64_t step) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pat(step, i))
            MM_TEST_FAIL_("payload byte %zu of step %llu: %u != %u", i,
                          (unsigned long long)step, p[i], pat(step, i));
}

static void send_bytes(mm_conn *c, enum mm_wire_kind kind, uint64_t step, uint32_t src,
                       unsigned char *buf, size_t n) {
    mm_wire_hdr h;
    MM_PASS(mm_wire_hdr_init(&h, kind, MM_WIRE_BYTES, step, 7, 1, (uint32_t)n));
    h.src = src;
    fill(buf, n, step);
    MM_PASS(mm_conn_send(c, &h, buf, LONG_DL()));
}

static size_t size_of_step(uint64_t i) { return (size_t)((i * 2654435761u) % 20000) + 1; }

// ---- ordering -------------------------------------------------------------------------------

#define N_ORDER 2000

static void peer_ordering(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    unsigned char *buf = xbuf(1 << 16);
    for (uint64_t i = 0; i < N_ORDER; i++)
        send_bytes(c, MM_WIRE_ROWS, i, 1, buf, size_of_step(i));
    for (uint64_t i = 0; i < N_ORDER; i++) { // then read the parent's stream back
        mm_wire_hdr h;
        MM_PASS(mm_conn_recv(c, &h, buf, 1 << 16, LONG_DL()));
        MM_EQ(h.step_id, i);
        MM_EQ(h.format, MM_WIRE_F32);
        MM_EQ(h.n_rows, 2);
        MM_EQ(h.row_base, i * 2);
        const float *f = (const float *)buf;
        for (uint32_t k = 0; k < 2 * h.row_dim; k++)
            if (f[k] != (float)(i + k))
                MM_TEST_FAIL_("f32 row value");
    }
    mm_conn_close(c);
    free(buf);
}

static void t_ordering(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    pid_t pid = spawn(peer_ordering, url, 0);
    mm_conn *c = accept_one(l);
    unsigned char *buf = xbuf(1 << 16);
    for (uint64_t i = 0; i < N_ORDER; i++) {
        mm_wire_hdr h;
        MM_PASS(mm_conn_recv(c, &h, buf, 1 << 16, LONG_DL()));
        MM_EQ(h.step_id, i);
        MM_EQ(h.conn_seq, i);
        MM_EQ(h.kind, MM_WIRE_ROWS);
        MM_EQ(h.layer, 7);
        MM_EQ(h.payload_bytes, size_of_step(i));
        check_fill(buf, (size_t)h.payload_bytes, i);
    }
    float *f = (float *)buf;
    for (uint64_t i = 0; i < N_ORDER; i++) {
        uint32_t d = 64 + (uint32_t)(i % 64);
        mm_wire_hdr h;
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_REPLY, MM_WIRE_F32, i, 3, 2, d));
        h.row_base = (uint32_t)(i * 2);
        for (uint32_t k = 0; k < 2 * d; k++)
            f[k] = (float)(i + k);
        MM_PASS(mm_conn_send(c, &h, f, LONG_DL()));
    }
    MM_EQ(reap(pid), 0);
    mm_conn_close(c);
    mm_listener_close(l);
    free(buf);
}

// ---- sizes ----------------------------------------------------------------------------------

static const size_t k_sizes[] = {0, 1, 63, 64, 65, 4095, 16384, 65539, 1u << 20,
                                 (3u << 20) + 5, (5u << 20) + 7};
#define N_SIZES (sizeof(k_sizes) / sizeof(k_sizes[0]))

static void peer_echo(const char *url, int n) {
    mm_conn *c = dial(url);
    unsigned char *buf = xbuf(BIG);
    for (int i = 0; i < n; i++) {
        mm_wire_hdr h;
        MM_PASS(mm_conn_recv(c, &h, buf, BIG, LONG_DL()));
        h.kind = MM_WIRE_REPLY;
        // Echo in two iov pieces to exercise the gather path.
        size_t half = (size_t)h.payload_bytes / 2;
        struct iovec v[2] = {{buf, half}, {buf + half, (size_t)h.payload_bytes - half}};
        MM_PASS(mm_conn_sendv(c, &h, v, 2, LONG_DL()));
    }
    mm_conn_close(c);
    free(buf);
}

static void t_sizes(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    pid_t pid = spawn(peer_echo, url, (int)N_SIZES);
    mm_conn *c = accept_one(l);
    unsigned char *out = xbuf(BIG), *in = xbuf(BIG);
    for (size_t i = 0; i < N_SIZES; i++) {
        size_t n = k_sizes[i];
        send_bytes(c, MM_WIRE_ROWS, 100 + i, 0, out, n);
        mm_wire_hdr h;
        memset(in, 0xee, n + 1);
        MM_PASS(mm_conn_recv(c, &h, in, BIG, LONG_DL()));
        MM_EQ(h.kind, MM_WIRE_REPLY);
        MM_EQ(h.step_id, 100 + i);
        MM_EQ(h.payload_bytes, n);
        check_fill(in, n, 100 + i);
        MM_EQ(in[n], 0xee); // nothing written past the payload
    }
    MM_EQ(reap(pid), 0);
    mm_conn_close(c);
    mm_listener_close(l);
    free(out);
    free(in);
}

// ---- oversize frame: MM_EFULL, frame discarded, conn usable ----------------------------------

static void peer_two_frames(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    unsigned char *buf = xbuf(300000);
    send_bytes(c, MM_WIRE_ROWS, 1, 0, buf, 300000);
    send_bytes(c, MM_WIRE_ROWS, 2, 0, buf, 100);
    mm_wire_hdr h;
    MM_FAIL(mm_conn_recv(c, &h, buf, 16, LONG_DL()), MM_ECLOSED); // parent closes
    mm_conn_close(c);
    free(buf);
}

static void t_oversize(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    pid_t pid = spawn(peer_two_frames, url, 0);
    mm_conn *c = accept_one(l);
    unsigned char buf[1000];
    mm_wire_hdr h;
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_EFULL);
    MM_EQ(h.step_id, 1);
    MM_EQ(h.payload_bytes, 300000);
    MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()));
    MM_EQ(h.step_id, 2);
    check_fill(buf, 100, 2);
    mm_conn_close(c);
    MM_EQ(reap(pid), 0);
    mm_listener_close(l);
}

// ---- many peers, gathered with wait_any -----------------------------------------------------

#define N_PEERS 8
#define N_PER_PEER 50

static void peer_many(const char *url, int k) {
    mm_conn *c = dial(url);
    unsigned char buf[20000];
    for (uint64_t i = 0; i < N_PER_PEER; i++)
        send_bytes(c, MM_WIRE_ROWS, (uint64_t)k * 1000 + i, (uint32_t)k, buf,
                   size_of_step(i + (uint64_t)k));
    mm_wire_hdr h;
    MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()));
    MM_EQ(h.kind, MM_WIRE_REPLY);
    MM_EQ(h.src, k);
    MM_EQ(h.step_id, 9000 + k);
    check_fill(buf, (size_t)h.payload_bytes, h.step_id);
    mm_conn_close(c);
}

static void t_many_peers(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    pid_t pids[N_PEERS];
    mm_conn *conns[N_PEERS];
    int src_of[N_PEERS];
    for (int k = 0; k < N_PEERS; k++)
        pids[k] = spawn(peer_many, url, k);
    for (int k = 0; k < N_PEERS; k++)
        conns[k] = accept_one(l);
    int next[N_PEERS] = {0};
    for (int k = 0; k < N_PEERS; k++)
        src_of[k] = -1;
    unsigned char buf[20000];
    for (int got = 0; got < N_PEERS * N_PER_PEER; got++) {
        size_t i = 0;
        MM_PASS(mm_conn_wait_any(conns, N_PEERS, LONG_DL(), &i));
        mm_wire_hdr h;
        MM_PASS(mm_conn_recv(conns[i], &h, buf, sizeof(buf), LONG_DL()));
        MM_TRUE(h.src < N_PEERS);
        if (src_of[i] < 0)
            src_of[i] = (int)h.src;
        MM_EQ(src_of[i], h.src); // one peer per conn
        MM_EQ(h.step_id, h.src * 1000ull + (uint64_t)next[i]);
        check_fill(buf, (size_t)h.payload_bytes, h.step_id);
        next[i]++;
    }
    for (int i = 0; i < N_PEERS; i++) {
        MM_EQ(next[i], N_PER_PEER);
        send_bytes(conns[i], MM_WIRE_REPLY, 9000 + (uint64_t)src_of[i], (uint32_t)src_of[i],
                   buf, 1000);
    }
    for (int k = 0; k < N_PEERS; k++)
        MM_EQ(reap(pids[k]), 0);
    for (int k = 0; k < N_PEERS; k++)
        mm_conn_close(conns[k]);
    mm_listener_close(l);
}

// ---- peer death -----------------------------------------------------------------------------

static void peer_stream_forever(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    unsigned char buf[16384];
    for (uint64_t i = 0;; i++)
        send_bytes(c, MM_WIRE_ROWS, i, 0, buf, sizeof(buf));
}

static void peer_idle_forever(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    (void)c;
    for (;;)
        pause();
}

struct blocked_op {
    mm_conn *c;
    bool do_send;
    _Atomic int rv;
    _Atomic int started;
};

static void *blocked_op_main(void *arg) {
    struct blocked_op *b = arg;
    const size_t n_big = 4u << 20;
    unsigned char *big = calloc(1, n_big); // per thread: rx and tx threads run together
    MM_TRUE(big != NULL);
    mm_err rv;
    atomic_store(&b->started, 1);
    if (b->do_send) { // the peer never reads: this blocks once the ring/socket buffer fills
        mm_wire_hdr h;
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_BYTES, 1, 0, 1, (uint32_t)n_big));
        do
            rv = mm_conn_send(b->c, &h, big, LONG_DL());
        while (rv == MM_OK);
    } else {
        mm_wire_hdr h;
        rv = mm_conn_recv(b->c, &h, big, n_big, LONG_DL());
    }
    atomic_store(&b->rv, (int)rv);
    free(big);
    return NULL;
}

static void t_peer_death(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    unsigned char *buf = xbuf(1 << 16);

    // 1. Killed mid-stream: frames already delivered come out, then MM_EPEERDOWN (never a
    //    timeout: the deadline is 10 s).
    pid_t pid = spawn(peer_stream_forever, url, 0);
    mm_conn *c = accept_one(l);
    mm_wire_hdr h;
    for (uint64_t i = 0; i < 200; i++) {
        MM_PASS(mm_conn_recv(c, &h, buf, 1 << 16, LONG_DL()));
        MM_EQ(h.step_id, i);
    }
    kill(pid, SIGKILL);
    MM_EQ(reap(pid), 128 + SIGKILL);
    mm_err rv;
    uint64_t n = 0;
    while ((rv = mm_conn_recv(c, &h, buf, 1 << 16, LONG_DL())) == MM_OK) {
        MM_EQ(h.step_id, 200 + n); // still in order up to the end
        n++;
    }
    MM_FAIL(rv, MM_EPEERDOWN);
    MM_FAIL(mm_conn_recv(c, &h, buf, 1 << 16, LONG_DL()), MM_EPEERDOWN); // sticky
    MM_TRUE(mm_conn_error(c) != MM_OK);
    mm_conn_close(c);

    // 2. Killed while we are blocked in recv (other thread) and in send (this thread's peer
    //    never reads): both ops in flight fail, neither waits for its deadline.
    pid = spawn(peer_idle_forever, url, 0);
    c = accept_one(l);
    struct blocked_op rx = {.c = c, .do_send = false}, tx = {.c = c, .do_send = true};
    pthread_t trx, ttx;
    pthread_create(&trx, NULL, blocked_op_main, &rx);
    pthread_create(&ttx, NULL, blocked_op_main, &tx);
    usleep(200000);
    kill(pid, SIGKILL);
    MM_EQ(reap(pid), 128 + SIGKILL);
    pthread_join(trx, NULL);
    pthread_join(ttx, NULL);
    MM_FAIL((mm_err)atomic_load(&rx.rv), MM_EPEERDOWN);
    MM_FAIL((mm_err)atomic_load(&tx.rv), MM_EPEERDOWN);
    mm_conn_close(c);
    mm_listener_close(l);
    free(buf);
}

// ---- deadlines ------------------------------------------------------------------------------

static void peer_answer_late(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    unsigned char buf[64];
    mm_wire_hdr h;
    MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL())); // "go"
    send_bytes(c, MM_WIRE_REPLY, h.step_id, 0, buf, 10);
    // Then never read again: the parent's sends must time out.
    usleep(1500000);
    mm_conn_close(c);
}

static void t_deadline(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    char err[MM_ERRLEN];
    mm_conn *c = NULL;
    // accept with nobody dialing
    MM_FAIL(mm_listener_accept(l, &c, mm_deadline_in_ms(30), err), MM_ETIMEDOUT);
    pid_t pid = spawn(peer_answer_late, url, 0);
    c = accept_one(l);
    unsigned char buf[64];
    mm_wire_hdr h;
    // recv and wait_any on a silent peer time out, and the conn stays usable
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), mm_deadline_in_ms(50)), MM_ETIMEDOUT);
    size_t idx = 99;
    MM_FAIL(mm_conn_wait_any(&c, 1, mm_deadline_in_ms(20), &idx), MM_ETIMEDOUT);
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), mm_now_ns()), MM_ETIMEDOUT); // already past
    MM_PASS(mm_conn_error(c));
    send_bytes(c, MM_WIRE_ROWS, 77, 0, buf, 8);
    MM_PASS(mm_conn_wait_any(&c, 1, LONG_DL(), &idx));
    MM_EQ(idx, 0);
    MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()));
    MM_EQ(h.step_id, 77);
    // sends to a peer that stopped reading time out once the ring / socket buffers fill
    static unsigned char big[4u << 20];
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_BYTES, 1, 0, 1, sizeof(big)));
    mm_err rv = MM_OK;
    for (int i = 0; i < 64 && rv == MM_OK; i++)
        rv = mm_conn_send(c, &h, big, mm_deadline_in_ms(100));
    MM_FAIL(rv, MM_ETIMEDOUT);
    // A timeout mid-frame breaks the conn for good (a half-sent frame cannot be taken back)
    // and says so; one before the first byte leaves it usable. shm's 2 MiB ring cannot hold
    // a 4 MiB frame, so there it is always mid-frame; a socket buffer may be full at a frame
    // boundary.
    mm_err st = mm_conn_error(c);
    MM_TRUE(st == MM_ETRANSPORT || (st == MM_OK && strcmp(scheme, "shm") != 0));
    if (st == MM_ETRANSPORT)
        MM_FAIL(mm_conn_send(c, &h, big, mm_deadline_in_ms(100)), MM_ETRANSPORT);
    MM_EQ(reap(pid), 0);
    mm_conn_close(c);
    mm_listener_close(l);
    // dial with nobody listening
    mm_conn *d = NULL;
    MM_FAIL(mm_transport_dial(&d, url, mm_deadline_in_ms(50), err), MM_ETIMEDOUT);
    MM_NULL(d);
    // dial to a listener that never accepts: the handshake is bounded by the deadline too;
    // the half-open conn it leaves behind fails at accept or at its first use, never hangs
    l = listen_fresh(scheme, url, sizeof(url));
    MM_FAIL(mm_transport_dial(&d, url, mm_deadline_in_ms(50), err), MM_ETIMEDOUT);
    MM_NULL(d);
    mm_err rv2 = mm_listener_accept(l, &c, mm_deadline_in_ms(1000), err);
    if (rv2 == MM_OK) {
        rv2 = mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL());
        MM_TRUE(rv2 == MM_EPEERDOWN || rv2 == MM_ECLOSED);
        mm_conn_close(c);
    } else {
        MM_FAIL(rv2, MM_EPROTO);
    }
    mm_listener_close(l);
}

static void round_trip(mm_conn *c, uint64_t step);

// ---- a non-moemesh client at the listener -----------------------------------------------------

// Connects to the listener's rendezvous without the transport and writes junk, or nothing.
static int raw_connect(const char *scheme, const char *url) {
    mm_url u;
    MM_PASS(mm_url_parse(&u, url, NULL));
    int fd = -1;
    if (strcmp(scheme, "tcp") == 0) {
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)u.port)};
        inet_pton(AF_INET, u.host, &sa.sin_addr);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        MM_TRUE(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    } else if (strcmp(scheme, "shm") == 0) { // abstract unix socket, see common/transport/shm.c
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        int n = snprintf(sa.sun_path + 1, sizeof(sa.sun_path) - 1, "moemesh-shm/%s", u.host);
        fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
        MM_TRUE(connect(fd, (struct sockaddr *)&sa,
                        (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n)) == 0);
    } else {
        MM_SKIP("no raw client for %s:// in this test", scheme);
    }
    return fd;
}

static void t_handshake_garbage(const char *scheme) {
    char url[MM_URL_MAX], err[MM_ERRLEN] = "";
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    mm_conn *c = NULL;
    // 1. junk instead of HELLO: refused with MM_EPROTO
    int fd = raw_connect(scheme, url);
    char junk[64];
    memset(junk, 'x', sizeof(junk));
    MM_EQ(write(fd, junk, sizeof(junk)), sizeof(junk));
    MM_FAIL(mm_listener_accept(l, &c, LONG_DL(), err), MM_EPROTO);
    MM_NULL(c);
    close(fd);
    // 2. a client that connects and says nothing: accept gives up at its deadline
    fd = raw_connect(scheme, url);
    MM_FAIL(mm_listener_accept(l, &c, mm_deadline_in_ms(100), err), MM_ETIMEDOUT);
    close(fd);
    // 3. the listener still serves real peers
    pid_t pid = spawn(peer_echo, url, 1);
    for (;;) { // the silent client of step 2 may still be queued: it fails, then ours comes
        mm_err rv = mm_listener_accept(l, &c, LONG_DL(), err);
        if (rv == MM_OK)
            break;
        MM_FAIL(rv, MM_EPROTO);
    }
    round_trip(c, 31);
    MM_EQ(reap(pid), 0);
    mm_conn_close(c);
    mm_listener_close(l);
}

// ---- cancel / close while blocked -----------------------------------------------------------

static void peer_expect_closed(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    unsigned char buf[64];
    mm_wire_hdr h;
    MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()));
    MM_EQ(h.step_id, 5);
    // The parent shuts the conn down: an orderly close, not a dead peer.
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_ECLOSED);
    mm_conn_close(c);
}

struct accept_op {
    mm_listener *l;
    _Atomic int rv;
};

static void *accept_main(void *arg) {
    struct accept_op *a = arg;
    mm_conn *c = NULL;
    char err[MM_ERRLEN];
    atomic_store(&a->rv, (int)mm_listener_accept(a->l, &c, LONG_DL(), err));
    mm_conn_close(c);
    return NULL;
}

static void t_cancel(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    pid_t pid = spawn(peer_expect_closed, url, 0);
    mm_conn *c = accept_one(l);
    unsigned char buf[64];
    send_bytes(c, MM_WIRE_ROWS, 5, 0, buf, 10);
    struct blocked_op rx = {.c = c, .do_send = false, .rv = -1};
    pthread_t t;
    pthread_create(&t, NULL, blocked_op_main, &rx);
    while (!atomic_load(&rx.started))
        usleep(1000);
    usleep(50000);
    mm_conn_shutdown(c);
    pthread_join(t, NULL);
    MM_FAIL((mm_err)atomic_load(&rx.rv), MM_ECLOSED);
    mm_wire_hdr h;
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_BYTES, 6, 0, 1, 8));
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_ECLOSED);
    MM_FAIL(mm_conn_send(c, &h, buf, LONG_DL()), MM_ECLOSED);
    MM_EQ(reap(pid), 0);
    mm_conn_close(c);
    // a blocked accept is woken by mm_listener_shutdown
    struct accept_op a = {.l = l, .rv = -1};
    pthread_create(&t, NULL, accept_main, &a);
    usleep(50000);
    mm_listener_shutdown(l);
    pthread_join(t, NULL);
    MM_FAIL((mm_err)atomic_load(&a.rv), MM_ECLOSED);
    mm_listener_close(l);
}

// ---- reconnect ------------------------------------------------------------------------------

static void peer_echo_until_killed(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    unsigned char buf[20000];
    for (;;) {
        mm_wire_hdr h;
        if (mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()) != MM_OK)
            _exit(3);
        h.kind = MM_WIRE_REPLY;
        if (mm_conn_send(c, &h, buf, LONG_DL()) != MM_OK)
            _exit(4);
    }
}

static void peer_listen_echo(const char *url, int arg) {
    (void)arg;
    char err[MM_ERRLEN];
    mm_listener *l = NULL;
    if (mm_transport_listen(&l, url, err) != MM_OK)
        _exit(5);
    mm_conn *c = accept_one(l);
    unsigned char buf[20000];
    for (;;) {
        mm_wire_hdr h;
        if (mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()) != MM_OK)
            _exit(3);
        h.kind = MM_WIRE_REPLY;
        if (mm_conn_send(c, &h, buf, LONG_DL()) != MM_OK)
            _exit(4);
    }
}

static void round_trip(mm_conn *c, uint64_t step) {
    unsigned char buf[16384];
    send_bytes(c, MM_WIRE_ROWS, step, 0, buf, sizeof(buf));
    mm_wire_hdr h;
    memset(buf, 0, sizeof(buf));
    MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()));
    MM_EQ(h.step_id, step);
    check_fill(buf, sizeof(buf), step);
}

static void t_reconnect(const char *scheme) {
    char url[MM_URL_MAX];
    mm_wire_hdr h;
    unsigned char buf[64];
    // Listener side: the dialer dies and a new one dials the same listener.
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    for (int round = 0; round < 2; round++) {
        pid_t pid = spawn(peer_echo_until_killed, url, 0);
        mm_conn *c = accept_one(l);
        round_trip(c, 10 + (uint64_t)round);
        kill(pid, SIGKILL);
        MM_EQ(reap(pid), 128 + SIGKILL);
        MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_EPEERDOWN);
        mm_conn_close(c);
    }
    mm_listener_close(l);
    // Dialer side: the listener dies; a new one starts on the same URL; we dial again (the dial
    // retries until the new listener is up).
    for (int round = 0; round < 2; round++) {
        pid_t pid = spawn(peer_listen_echo, url, 0);
        mm_conn *c = dial(url);
        round_trip(c, 20 + (uint64_t)round);
        kill(pid, SIGKILL);
        MM_EQ(reap(pid), 128 + SIGKILL);
        MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_EPEERDOWN);
        mm_conn_close(c);
    }
}

// ---- garbage headers ------------------------------------------------------------------------

static void peer_garbage(const char *url, int variant) {
    mm_conn *c = dial(url);
    unsigned char buf[64];
    send_bytes(c, MM_WIRE_ROWS, 1, 0, buf, 16); // one good frame first
    mm_wire_hdr g;
    MM_PASS(mm_wire_hdr_init(&g, MM_WIRE_ROWS, MM_WIRE_F32, 2, 0, 1, 4));
    switch (variant) {
    case 0: // random bytes
        for (size_t i = 0; i < sizeof(g); i++)
            ((unsigned char *)&g)[i] = (unsigned char)(i * 37 + 11);
        break;
    case 1: // right magic and version, wrong checksum
        mm__wire_hdr_seal(&g, 1);
        g.step_id ^= 1;
        break;
    case 2: // sealed, but payload_bytes disagrees with format x rows x row_dim
        g.payload_bytes = 15;
        mm__wire_hdr_seal(&g, 1);
        break;
    case 3: // sealed, wire version from the future
        mm__wire_hdr_seal(&g, 1);
        g.version = 99;
        g.hdr_check = mm__wire_hdr_sum(&g);
        break;
    default: // sealed, unknown kind
        g.kind = 40;
        mm__wire_hdr_seal(&g, 1);
        break;
    }
    mm_err rv = mm__conn_send_raw(c, &g, sizeof(g), LONG_DL());
    if (rv == MM_EUNSUPP)
        _exit(77);
    MM_PASS(rv);
    MM_TRUE(mm_conn_recv(c, &g, buf, sizeof(buf), LONG_DL()) != MM_OK); // parent hangs up
    mm_conn_close(c);
}

static void t_garbage(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    for (int variant = 0; variant < 5; variant++) {
        pid_t pid = spawn(peer_garbage, url, variant);
        mm_conn *c = accept_one(l);
        unsigned char buf[64];
        mm_wire_hdr h;
        MM_PASS(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()));
        MM_EQ(h.step_id, 1);
        MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_EPROTO);
        MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_EPROTO); // sticky
        MM_FAIL(mm_conn_error(c), MM_EPROTO);
        mm_conn_close(c);
        int st = reap(pid);
        if (st == 77)
            MM_SKIP("%s:// has no raw-send test hook", scheme);
        MM_EQ(st, 0);
    }
    mm_listener_close(l);
}

// ---- an error on one direction fails the op in flight on the other ---------------------------

static void peer_garbage_then_idle(const char *url, int arg) {
    (void)arg;
    mm_conn *c = dial(url);
    usleep(200000); // let the parent's sender fill the ring / socket buffers and block
    unsigned char junk[64];
    memset(junk, 0xab, sizeof(junk));
    MM_PASS(mm__conn_send_raw(c, junk, sizeof(junk), LONG_DL()));
    for (;;)
        pause(); // never reads: only the error can unblock the parent's sender
}

static void t_error_fails_inflight(const char *scheme) {
    char url[MM_URL_MAX];
    mm_listener *l = listen_fresh(scheme, url, sizeof(url));
    pid_t pid = spawn(peer_garbage_then_idle, url, 0);
    mm_conn *c = accept_one(l);
    struct blocked_op tx = {.c = c, .do_send = true, .rv = -1};
    pthread_t t;
    pthread_create(&t, NULL, blocked_op_main, &tx);
    unsigned char buf[64];
    mm_wire_hdr h;
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()), MM_EPROTO);
    pthread_join(t, NULL); // returns because the recv error failed the conn, not by deadline
    MM_FAIL((mm_err)atomic_load(&tx.rv), MM_EPROTO);
    kill(pid, SIGKILL);
    reap(pid);
    mm_conn_close(c);
    mm_listener_close(l);
}

// ---- the table: every case for every scheme -------------------------------------------------

#define CASES(X, s)                                                                    \
    X(s, ordering) X(s, sizes) X(s, oversize) X(s, many_peers) X(s, peer_death)       \
    X(s, deadline) X(s, cancel) X(s, reconnect) X(s, garbage) X(s, error_fails_inflight) \
    X(s, handshake_garbage)

#define DEFINE_CASE(s, t) static void s##_##t(void) { t_##t(#s); }
#define ROW_CASE(s, t) {#s ": " #t, s##_##t},
// rdma:// joins by adding SCHEMES(X, rdma) below (its cases skip without a device).
// cudaipc:// runs the suite with host frames (these processes declare no GPU); a build without
// GPU support skips it (MM_EUNSUPP); tests/transport/cudaipc_test.c covers device frames.
#define SCHEMES(X) CASES(X, shm) CASES(X, tcp) CASES(X, rdma) CASES(X, cudaipc)

SCHEMES(DEFINE_CASE)

// One set mixing schemes: wait_any over an shm conn and a tcp conn.
static void peer_reply_once(const char *url, int delay_ms) {
    mm_conn *c = dial(url);
    usleep((useconds_t)delay_ms * 1000);
    unsigned char buf[100];
    send_bytes(c, MM_WIRE_REPLY, (uint64_t)delay_ms, 0, buf, 100);
    mm_wire_hdr h;
    MM_TRUE(mm_conn_recv(c, &h, buf, sizeof(buf), LONG_DL()) != MM_OK);
    mm_conn_close(c);
}

static void test_wait_any_mixed(void) {
    char u1[MM_URL_MAX], u2[MM_URL_MAX];
    mm_listener *l1 = listen_fresh("shm", u1, sizeof(u1));
    mm_listener *l2 = listen_fresh("tcp", u2, sizeof(u2));
    pid_t p1 = spawn(peer_reply_once, u1, 150);
    pid_t p2 = spawn(peer_reply_once, u2, 30);
    mm_conn *cs[2] = {accept_one(l1), accept_one(l2)};
    bool seen[2] = {false, false};
    for (int k = 0; k < 2; k++) {
        size_t i = 9;
        MM_PASS(mm_conn_wait_any(cs, 2, LONG_DL(), &i));
        MM_TRUE(i < 2 && !seen[i]);
        mm_wire_hdr h;
        unsigned char buf[100];
        MM_PASS(mm_conn_recv(cs[i], &h, buf, sizeof(buf), LONG_DL()));
        MM_EQ(h.step_id, i == 0 ? 150 : 30);
        seen[i] = true;
        // a conn already drained is not reported ready again
        if (k == 0) {
            size_t j = 9;
            mm_err rv = mm_conn_wait_any(&cs[i], 1, mm_deadline_in_ms(5), &j);
            MM_FAIL(rv, MM_ETIMEDOUT);
        }
    }
    mm_conn_close(cs[0]);
    mm_conn_close(cs[1]);
    MM_EQ(reap(p1), 0);
    MM_EQ(reap(p2), 0);
    mm_listener_close(l1);
    mm_listener_close(l2);
}

MM_TESTS = {
    SCHEMES(ROW_CASE)
    {"mixed: wait_any over shm and tcp", test_wait_any_mixed},
    {NULL, NULL},
};
