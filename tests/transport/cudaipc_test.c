// SPDX-License-Identifier: MIT
// cudaipc:// (common/transport/cudaipc.c): device frames between two processes on one GPU.
// - A build without GPU support (plain `make`) refuses cudaipc:// URLs and mm_transport_gpu_use
//   with MM_EUNSUPP naming the missing GPU support (checked here, so this case runs in CI).
// - With GPU support and a device (`make cuda` on the GPU machine): a forked echo server; the
//   client sends device frames gathered from several device segments, host frames between
//   them, frames that wrap the device ring many times (ring_mb=1), a frame larger than the
//   ring (refused), receives replies into device segments and into host memory, and checks
//   every byte. A peer without a GPU gives host frames only. A peer killed while the client
//   waits gives MM_EPEERDOWN at once, not at the deadline. shm:// between two processes that
//   declared a GPU carries device frames by itself; shm://NAME?gpu=0 does not.
// The GPU cases skip, saying why, without GPU support or without a device.
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mm/transport.h"
#include "mm_test.h"

#define W __attribute__((weak))
extern mm_err mm_gpu_device_count(int *n, char why[MM_ERRLEN]) W;
extern mm_err mm_gpu_set_device(int dev) W;
extern mm_err mm_gpu_alloc(void **d_out, size_t n_bytes) W;
extern void mm_gpu_free(void *d) W;
extern mm_err mm_gpu_memcpy_h2d(void *stream, void *d_dst, const void *h_src, size_t n) W;
extern mm_err mm_gpu_memcpy_d2h(void *stream, void *h_dst, const void *d_src, size_t n) W;
extern mm_err mm_gpu_memset(void *stream, void *d_dst, int byte, size_t n) W;
extern mm_err mm_gpu_stream_new(void **stream) W;
extern mm_err mm_gpu_stream_sync(void *stream) W;
extern mm_err mm_gpu_ipc_mem_export(const void *d_ptr, void *handle) W;
#undef W

#define MAX_BYTES (600u << 10) // largest frame of the echo test (the ring is 1 MiB)

static char url[128];

static void make_url(const char *tag) {
    snprintf(url, sizeof(url), "cudaipc://t%d-%s?ring_mb=1", (int)getpid(), tag);
}

static void make_shm_url(const char *tag, const char *query) {
    snprintf(url, sizeof(url), "shm://t%d-%s?%s", (int)getpid(), tag, query);
}

// ---- without GPU support ---------------------------------------------------------------------

static void no_gpu_build_refuses(void) {
    if (mm_gpu_ipc_mem_export)
        MM_SKIP("this build has GPU support (the GPU cases below cover it)");
    char err[MM_ERRLEN] = "";
    mm_listener *l = NULL;
    mm_conn *c = NULL;
    make_url("nogpu");
    MM_FAIL(mm_transport_listen(&l, url, err), MM_EUNSUPP);
    MM_TRUE(strstr(err, "no GPU support") != NULL);
    err[0] = 0;
    MM_FAIL(mm_transport_dial(&c, url, mm_deadline_in_ms(100), err), MM_EUNSUPP);
    MM_TRUE(strstr(err, "no GPU support") != NULL);
    err[0] = 0;
    MM_FAIL(mm_transport_gpu_use(0, NULL, err), MM_EUNSUPP);
    MM_TRUE(strstr(err, "no GPU support") != NULL);
    char known[128];
    mm_transport_schemes(known, sizeof(known));
    MM_TRUE(strstr(known, "cudaipc") != NULL);
}

// ---- with a GPU ------------------------------------------------------------------------------

// The GPU cases fork before any device call (a CUDA context does not survive fork()); the
// child is the echo server. Returns the child's pid.
static pid_t fork_server(void (*serve)(void)) {
    pid_t pid = fork();
    if (pid < 0)
        MM_TEST_FAIL_("fork failed");
    if (pid == 0) {
        serve();
        _exit(0);
    }
    return pid;
}

static void *gpu_setup(bool declare) {
    void *stream = NULL;
    if (mm_gpu_set_device(0) != MM_OK || mm_gpu_stream_new(&stream) != MM_OK)
        MM_TEST_FAIL_("device 0 setup failed");
    if (declare)
        MM_PASS(mm_transport_gpu_use(0, stream, NULL));
    return stream;
}

// Skips unless this build has GPU support and the host a device. Call only in a child or
// after the fork (it creates a context).
static void need_gpu(pid_t child) {
    char why[MM_ERRLEN] = "";
    int n = 0;
    if (!mm_gpu_device_count || !mm_gpu_ipc_mem_export) {
        if (child > 0)
            kill(child, SIGKILL), waitpid(child, NULL, 0);
        MM_SKIP("this build has no GPU support (make cuda builds these cases)");
    }
    if (mm_gpu_device_count(&n, why) != MM_OK || n == 0) {
        if (child > 0)
            kill(child, SIGKILL), waitpid(child, NULL, 0);
        MM_SKIP("no GPU on this host: %s", why);
    }
}

static bool have_gpu_quiet(void) {
    char why[MM_ERRLEN];
    int n = 0;
    return mm_gpu_device_count && mm_gpu_ipc_mem_export && mm_gpu_device_count(&n, why) == MM_OK &&
           n > 0;
}

static bool g_server_gpu = true;

// Echo server: device frames come back as device frames (REPLY, same rows), host frames as
// host frames; ends when the client closes.
static void serve_echo(void) {
    if (!have_gpu_quiet())
        _exit(77);
    (void)gpu_setup(g_server_gpu);
    void *d_buf = NULL;
    uint8_t *h_buf = malloc(MAX_BYTES);
    if (mm_gpu_alloc(&d_buf, MAX_BYTES) != MM_OK || !h_buf)
        _exit(3);
    mm_listener *l = NULL;
    mm_conn *c = NULL;
    if (mm_transport_listen(&l, url, NULL) != MM_OK ||
        mm_listener_accept(l, &c, mm_deadline_in_ms(20000), NULL) != MM_OK)
        _exit(4);
    for (;;) {
        mm_wire_hdr h;
        bool on_dev = false;
        struct iovec dv = {.iov_base = d_buf, .iov_len = MAX_BYTES};
        mm_err rv = mm_conn_recv_dev(c, &h, h_buf, MAX_BYTES, &dv, 1, &on_dev,
                                     mm_deadline_in_ms(20000));
        if (rv == MM_ECLOSED)
            break;
        if (rv != MM_OK)
            _exit(5);
        mm_wire_hdr r;
        if (mm_wire_hdr_init(&r, MM_WIRE_REPLY, (enum mm_wire_format)h.format, h.step_id,
                             h.layer, h.n_rows, h.row_dim) != MM_OK)
            _exit(6);
        r.aux = h.aux;
        if (on_dev) {
            struct iovec sv = {.iov_base = d_buf, .iov_len = (size_t)h.payload_bytes};
            rv = mm_conn_sendv_dev(c, &r, &sv, 1, mm_deadline_in_ms(5000));
        } else {
            rv = mm_conn_send(c, &r, h_buf, mm_deadline_in_ms(5000));
        }
        if (rv != MM_OK)
            _exit(7);
    }
    mm_conn_close(c);
    mm_listener_close(l);
    mm_gpu_free(d_buf);
    _exit(0);
}

static int wait_child(pid_t pid) {
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void fill(uint8_t *p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
}

static void device_frames_roundtrip(void) {
    make_url("echo");
    g_server_gpu = true;
    pid_t child = fork_server(serve_echo);
    need_gpu(child);
    void *stream = gpu_setup(true);
    mm_conn *c = NULL;
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_transport_dial(&c, url, mm_deadline_in_ms(20000), err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("dial %s: %s (%s); server rc %d", url, mm_strerror(rv), err,
                      (kill(child, SIGKILL), wait_child(child)));
    MM_TRUE(mm_conn_dev(c));
    uint8_t *src = malloc(MAX_BYTES), *back = malloc(MAX_BYTES);
    void *d_src = NULL, *d_dst = NULL;
    MM_TRUE(src && back);
    MM_PASS(mm_gpu_alloc(&d_src, MAX_BYTES));
    MM_PASS(mm_gpu_alloc(&d_dst, 3 * MAX_BYTES));
    // 24 frames of 1..600 KiB through a 1 MiB ring: it wraps many times; rows gathered from
    // three device segments and scattered into two.
    for (int k = 0; k < 24; k++) {
        uint32_t rows = 1 + (uint32_t)((k * 7919) % 150); // x 4 KiB rows
        if (k == 5)
            rows = 150;
        const size_t nb = (size_t)rows * 1024 * 4;
        fill(src, nb, (uint32_t)k);
        MM_PASS(mm_gpu_memcpy_h2d(stream, d_src, src, nb));
        MM_PASS(mm_gpu_memset(stream, d_dst, 0xee, 2 * MAX_BYTES));
        mm_wire_hdr h, r;
        // a host frame first (CTRL), as the router sends before rows
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_CTRL, MM_WIRE_BYTES, (uint64_t)k, 0, 1, 12));
        MM_PASS(mm_conn_send(c, &h, "control-msg!", mm_deadline_in_ms(5000)));
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, (uint64_t)k, 3, rows, 1024));
        h.aux = 100u + (uint32_t)k;
        const size_t a = nb / 3 / 4 * 4, b = nb / 2 / 4 * 4;
        struct iovec sv[3] = {{d_src, a}, {(uint8_t *)d_src + a, b - a},
                              {(uint8_t *)d_src + b, nb - b}};
        MM_PASS(mm_conn_sendv_dev(c, &h, sv, 3, mm_deadline_in_ms(5000)));
        bool on_dev = true;
        char txt[64] = "";
        MM_PASS(mm_conn_recv_dev(c, &r, txt, sizeof(txt), NULL, 0, &on_dev,
                                 mm_deadline_in_ms(5000)));
        MM_TRUE(!on_dev);
        MM_EQ(r.payload_bytes, 12);
        MM_TRUE(memcmp(txt, "control-msg!", 12) == 0);
        const size_t half = nb / 2 / 4 * 4;
        struct iovec dv[2] = {{d_dst, half}, {(uint8_t *)d_dst + MAX_BYTES, MAX_BYTES}};
        if (k % 4 == 3) { // a host receiver of a device frame
            MM_PASS(mm_conn_recv_dev(c, &r, back, MAX_BYTES, NULL, 0, &on_dev,
                                     mm_deadline_in_ms(5000)));
            MM_TRUE(!on_dev);
        } else {
            MM_PASS(mm_conn_recv_dev(c, &r, txt, sizeof(txt), dv, 2, &on_dev,
                                     mm_deadline_in_ms(5000)));
            MM_TRUE(on_dev);
            MM_PASS(mm_gpu_memcpy_d2h(stream, back, d_dst, half));
            MM_PASS(mm_gpu_memcpy_d2h(stream, back + half, (uint8_t *)d_dst + MAX_BYTES, nb - half));
            MM_PASS(mm_gpu_stream_sync(stream));
        }
        MM_EQ(r.kind, MM_WIRE_REPLY);
        MM_EQ(r.step_id, (uint64_t)k);
        MM_EQ(r.layer, 3);
        MM_EQ(r.n_rows, rows);
        MM_EQ(r.aux, 100u + (uint32_t)k);
        MM_EQ(r.payload_bytes, nb);
        if (memcmp(src, back, nb) != 0)
            MM_TEST_FAIL_("frame %d (%zu bytes): rows differ after the device round trip", k, nb);
    }
    // pipelined: 4 frames of 400 KiB sent before any reply is read; the 1 MiB rings fill, so
    // the server's replies wait for ring space (freed as this side reads) and reuse ring bytes
    // ordered by the free event
    {
        const size_t nb = 100u * 4096;
        for (int k = 0; k < 4; k++) {
            fill(src, nb, 1000u + (uint32_t)k);
            MM_PASS(mm_gpu_memcpy_h2d(stream, (uint8_t *)d_dst + (size_t)k * nb, src, nb));
        }
        for (int k = 0; k < 4; k++) {
            mm_wire_hdr h;
            MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, 500u + (uint64_t)k, 0, 100,
                                     1024));
            struct iovec sv = {(uint8_t *)d_dst + (size_t)k * nb, nb};
            MM_PASS(mm_conn_sendv_dev(c, &h, &sv, 1, mm_deadline_in_ms(5000)));
        }
        for (int k = 0; k < 4; k++) {
            mm_wire_hdr r;
            bool on_dev = false;
            struct iovec dv = {d_src, MAX_BYTES};
            MM_PASS(mm_conn_recv_dev(c, &r, back, 64, &dv, 1, &on_dev, mm_deadline_in_ms(5000)));
            MM_TRUE(on_dev);
            MM_EQ(r.step_id, 500u + (uint64_t)k);
            MM_PASS(mm_gpu_memcpy_d2h(stream, back, d_src, nb));
            MM_PASS(mm_gpu_stream_sync(stream));
            fill(src, nb, 1000u + (uint32_t)k);
            if (memcmp(src, back, nb) != 0)
                MM_TEST_FAIL_("pipelined frame %d: rows differ", k);
        }
    }
    // a frame larger than the peer's ring is refused, and the conn still works afterwards
    {
        void *d_big = NULL;
        MM_PASS(mm_gpu_alloc(&d_big, 2u << 20));
        mm_wire_hdr h;
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, 99, 0, 512, 1024));
        struct iovec sv = {d_big, 2u << 20};
        MM_FAIL(mm_conn_sendv_dev(c, &h, &sv, 1, mm_deadline_in_ms(1000)), MM_EINVAL);
        MM_EQ(mm_conn_error(c), MM_OK);
        mm_gpu_free(d_big);
    }
    mm_conn_close(c);
    MM_EQ(wait_child(child), 0);
    mm_gpu_free(d_src);
    mm_gpu_free(d_dst);
    free(src);
    free(back);
}

static void peer_without_gpu_host_frames(void) {
    make_url("hostonly");
    g_server_gpu = false; // the server declares no GPU: host frames only
    pid_t child = fork_server(serve_echo);
    need_gpu(child);
    void *stream = gpu_setup(true);
    (void)stream;
    mm_conn *c = NULL;
    MM_PASS(mm_transport_dial(&c, url, mm_deadline_in_ms(20000), NULL));
    MM_TRUE(!mm_conn_dev(c));
    mm_wire_hdr h, r;
    float rows[8] = {1, 2, 3, 4, 5, 6, 7, 8}, back[8] = {0};
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, 1, 0, 2, 4));
    struct iovec sv = {rows, sizeof(rows)};
    MM_FAIL(mm_conn_sendv_dev(c, &h, &sv, 1, mm_deadline_in_ms(1000)), MM_EUNSUPP);
    MM_PASS(mm_conn_send(c, &h, rows, mm_deadline_in_ms(1000)));
    MM_PASS(mm_conn_recv(c, &r, back, sizeof(back), mm_deadline_in_ms(5000)));
    MM_TRUE(memcmp(rows, back, sizeof(rows)) == 0);
    mm_conn_close(c);
    MM_EQ(wait_child(child), 0);
}

// shm:// between two processes that declared a GPU carries device frames by itself; with
// ?gpu=0 it does not (host frames, the conn still works).
static void auto_shm(const char *query, bool want_dev) {
    make_shm_url(want_dev ? "auto" : "off", query);
    g_server_gpu = true;
    pid_t child = fork_server(serve_echo);
    need_gpu(child);
    void *stream = gpu_setup(true);
    mm_conn *c = NULL;
    MM_PASS(mm_transport_dial(&c, url, mm_deadline_in_ms(20000), NULL));
    MM_EQ(mm_conn_dev(c), want_dev);
    const size_t nb = 64u * 4096;
    uint8_t *src = malloc(nb), *back = malloc(nb);
    void *d = NULL;
    MM_TRUE(src && back);
    MM_PASS(mm_gpu_alloc(&d, nb));
    fill(src, nb, 77);
    mm_wire_hdr h, r;
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, 7, 1, 64, 1024));
    bool on_dev = false;
    if (want_dev) {
        MM_PASS(mm_gpu_memcpy_h2d(stream, d, src, nb));
        struct iovec sv = {d, nb};
        MM_PASS(mm_conn_sendv_dev(c, &h, &sv, 1, mm_deadline_in_ms(5000)));
        MM_PASS(mm_gpu_memset(stream, d, 0, nb));
        MM_PASS(mm_conn_recv_dev(c, &r, back, 64, &sv, 1, &on_dev, mm_deadline_in_ms(5000)));
        MM_TRUE(on_dev);
        MM_PASS(mm_gpu_memcpy_d2h(stream, back, d, nb));
        MM_PASS(mm_gpu_stream_sync(stream));
    } else {
        MM_PASS(mm_conn_send(c, &h, src, mm_deadline_in_ms(5000)));
        MM_PASS(mm_conn_recv_dev(c, &r, back, nb, NULL, 0, &on_dev, mm_deadline_in_ms(5000)));
        MM_TRUE(!on_dev);
    }
    MM_EQ(r.step_id, 7);
    MM_TRUE(memcmp(src, back, nb) == 0);
    mm_conn_close(c);
    MM_EQ(wait_child(child), 0);
    mm_gpu_free(d);
    free(src);
    free(back);
}

static void shm_between_gpus_is_device_to_device(void) { auto_shm("ring_mb=1", true); }
static void shm_gpu_0_is_host_frames(void) { auto_shm("gpu=0", false); }

static void serve_then_hang(void) {
    if (!have_gpu_quiet())
        _exit(77);
    gpu_setup(true);
    mm_listener *l = NULL;
    mm_conn *c = NULL;
    if (mm_transport_listen(&l, url, NULL) != MM_OK ||
        mm_listener_accept(l, &c, mm_deadline_in_ms(20000), NULL) != MM_OK)
        _exit(4);
    pause(); // never answers: the client kills us
    _exit(0);
}

static void dead_peer_is_an_error_not_a_hang(void) {
    make_url("dead");
    pid_t child = fork_server(serve_then_hang);
    need_gpu(child);
    gpu_setup(true);
    mm_conn *c = NULL;
    MM_PASS(mm_transport_dial(&c, url, mm_deadline_in_ms(20000), NULL));
    MM_TRUE(mm_conn_dev(c));
    mm_wire_hdr h;
    char buf[64];
    // silent peer: the deadline ends the wait, the conn stays usable
    uint64_t t0 = mm_now_ns();
    MM_FAIL(mm_conn_recv(c, &h, buf, sizeof(buf), mm_deadline_in_ms(200)), MM_ETIMEDOUT);
    MM_TRUE(mm_now_ns() - t0 < 2000000000ull);
    kill(child, SIGKILL);
    t0 = mm_now_ns();
    bool on_dev;
    mm_err rv = mm_conn_recv_dev(c, &h, buf, sizeof(buf), NULL, 0, &on_dev,
                                 mm_deadline_in_ms(10000));
    MM_EQ(rv, MM_EPEERDOWN);
    MM_TRUE(mm_now_ns() - t0 < 5000000000ull); // the death, not the 10 s deadline
    mm_conn_close(c);
    wait_child(child);
}

MM_TESTS = {
    {"no_gpu_build_refuses", no_gpu_build_refuses},
    {"device_frames_roundtrip", device_frames_roundtrip},
    {"peer_without_gpu_host_frames", peer_without_gpu_host_frames},
    {"shm_between_gpus_is_device_to_device", shm_between_gpus_is_device_to_device},
    {"shm_gpu_0_is_host_frames", shm_gpu_0_is_host_frames},
    {"dead_peer_is_an_error_not_a_hang", dead_peer_is_an_error_not_a_hang},
    {NULL, NULL},
};
