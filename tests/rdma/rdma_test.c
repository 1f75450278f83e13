// SPDX-License-Identifier: MIT
// rdma:// specifics beyond the shared conformance suite (tests/transport/conformance_test.c):
// on a host without an RDMA device, listen and dial fail at once with MM_EUNSUPP and a message
// saying so (never a silent fallback); with a device (soft-RoCE in the VM of `make
// test-rdma`), URL options are checked, identities must match, the MTU option is honoured,
// and a conn survives a frame much larger than its ring (credit flow).
#include <signal.h>
#include <sys/wait.h>

#include "mm_test.h"
#include "mm/transport.h"

static bool have_device(void) {
    char err[MM_ERRLEN] = "";
    mm_listener *l = NULL;
    char url[64];
    snprintf(url, sizeof(url), "rdma://127.0.0.1:%d", mm_test_next_port());
    mm_err rv = mm_transport_listen(&l, url, err);
    mm_listener_close(l);
    return rv != MM_EUNSUPP;
}

static void test_no_device_fails_clearly(void) {
    if (have_device())
        MM_SKIP("this host has an RDMA device");
    char err[MM_ERRLEN] = "";
    mm_listener *l = NULL;
    mm_conn *c = NULL;
    MM_FAIL(mm_transport_listen(&l, "rdma://127.0.0.1:24999", err), MM_EUNSUPP);
    MM_NULL(l);
    MM_TRUE(strstr(err, "no RDMA device") != NULL);
    MM_TRUE(strstr(err, "tcp://") != NULL); // says what to use instead
    err[0] = '\0';
    uint64_t t0 = mm_now_ns();
    MM_FAIL(mm_transport_dial(&c, "rdma://127.0.0.1:24999", mm_deadline_in_ms(5000), err),
            MM_EUNSUPP);
    MM_TRUE(mm_now_ns() - t0 < 2000000000ull); // fails at once, not at the deadline
    MM_NULL(c);
    MM_TRUE(strstr(err, "no RDMA device") != NULL);
    // rdma:// is in the table: the error is "no device", not "unknown scheme"
    char schemes[128];
    mm_transport_schemes(schemes, sizeof(schemes));
    MM_TRUE(strstr(schemes, "rdma") != NULL);
}

static void need_device(void) {
    if (!have_device())
        MM_SKIP("no RDMA device (run `make test-rdma` for the soft-RoCE VM)");
}

static void test_bad_options(void) {
    need_device();
    char err[MM_ERRLEN] = "";
    mm_listener *l = NULL;
    MM_FAIL(mm_transport_listen(&l, "rdma://127.0.0.1:24998?slotz=4", err), MM_EINVAL);
    MM_TRUE(strstr(err, "slotz") != NULL);
    MM_FAIL(mm_transport_listen(&l, "rdma://127.0.0.1:24998?mtu=1500", err), MM_EINVAL);
    MM_FAIL(mm_transport_listen(&l, "rdma://127.0.0.1:24998?slots=1", err), MM_EINVAL);
    MM_FAIL(mm_transport_listen(&l, "rdma://127.0.0.1", err), MM_EINVAL);
    MM_NULL(l);
}

static void peer_dial_id(const char *url) {
    char err[MM_ERRLEN] = "";
    mm_conn *c = NULL;
    mm_err rv = mm_transport_dial(&c, url, mm_deadline_in_ms(10000), err);
    if (rv != MM_EIDENTITY) {
        fprintf(stderr, "dial %s: %s (%s), expected identity mismatch\n", url,
                mm_strerror(rv), err);
        _exit(1);
    }
    if (strstr(err, "'alpha'") == NULL || strstr(err, "'beta'") == NULL) {
        fprintf(stderr, "message does not name both identities: %s\n", err);
        _exit(2);
    }
    _exit(0);
}

static void test_identity_mismatch(void) {
    need_device();
    int port = mm_test_next_port();
    char lurl[96], durl[96], err[MM_ERRLEN] = "";
    snprintf(lurl, sizeof(lurl), "rdma://127.0.0.1:%d?id=alpha", port);
    snprintf(durl, sizeof(durl), "rdma://127.0.0.1:%d?id=beta", port);
    mm_listener *l = NULL;
    MM_PASS(mm_transport_listen(&l, lurl, err));
    pid_t pid = fork();
    MM_TRUE(pid >= 0);
    if (pid == 0)
        peer_dial_id(durl);
    mm_conn *c = NULL;
    MM_FAIL(mm_listener_accept(l, &c, mm_deadline_in_ms(10000), err), MM_EIDENTITY);
    MM_NULL(c);
    int st = 0;
    waitpid(pid, &st, 0);
    MM_TRUE(WIFEXITED(st));
    MM_EQ(WEXITSTATUS(st), 0);
    mm_listener_close(l);
}

#define BIG_FRAME ((3u << 20) + 3) // > 2x the ring of 4 slots x 256 KiB

static void peer_echo_big(const char *url) {
    char err[MM_ERRLEN] = "";
    mm_conn *c = NULL;
    mm_err rv = mm_transport_dial(&c, url, mm_deadline_in_ms(10000), err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("peer: dial: %s (%s)", mm_strerror(rv), err);
    unsigned char *buf = malloc(BIG_FRAME);
    for (int i = 0; i < 3; i++) {
        mm_wire_hdr h;
        MM_PASS(mm_conn_recv(c, &h, buf, BIG_FRAME, mm_deadline_in_ms(30000)));
        h.kind = MM_WIRE_REPLY;
        MM_PASS(mm_conn_send(c, &h, buf, mm_deadline_in_ms(30000)));
    }
    mm_conn_close(c);
    free(buf);
    _exit(0);
}

// Small ring (4 slots of 256 KiB) and MTU 512 on the listener; the dialer keeps defaults, so
// the two ends have different geometry and the lower MTU wins.
static void test_small_ring_big_frames_mtu(void) {
    need_device();
    int port = mm_test_next_port();
    char lurl[96], durl[96], err[MM_ERRLEN] = "";
    snprintf(lurl, sizeof(lurl), "rdma://127.0.0.1:%d?slots=4&slot_kb=256&mtu=512", port);
    snprintf(durl, sizeof(durl), "rdma://127.0.0.1:%d", port);
    mm_listener *l = NULL;
    MM_PASS(mm_transport_listen(&l, lurl, err));
    fflush(NULL);
    pid_t pid = fork();
    MM_TRUE(pid >= 0);
    if (pid == 0)
        peer_echo_big(durl);
    mm_conn *c = NULL;
    MM_PASS(mm_listener_accept(l, &c, mm_deadline_in_ms(10000), err));
    unsigned char *out = malloc(BIG_FRAME), *in = malloc(BIG_FRAME);
    MM_TRUE(out != NULL && in != NULL);
    for (uint32_t i = 0; i < BIG_FRAME; i++)
        out[i] = (unsigned char)(i * 13 + 5);
    // A registered buffer works like any other (registration is once, up front).
    mm_mem_reg *reg = NULL;
    MM_PASS(mm_conn_reg_mem(c, out, BIG_FRAME, &reg, err));
    MM_TRUE(reg != NULL);
    for (int k = 0; k < 3; k++) {
        uint32_t n = k == 1 ? 1 : BIG_FRAME - (uint32_t)k;
        mm_wire_hdr h;
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_BYTES, (uint64_t)k, 0, 1, n));
        MM_PASS(mm_conn_send(c, &h, out, mm_deadline_in_ms(30000)));
        memset(in, 0, n);
        MM_PASS(mm_conn_recv(c, &h, in, BIG_FRAME, mm_deadline_in_ms(30000)));
        MM_EQ(h.step_id, (uint64_t)k);
        MM_EQ(h.payload_bytes, n);
        MM_TRUE(memcmp(in, out, n) == 0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    MM_TRUE(WIFEXITED(st));
    MM_EQ(WEXITSTATUS(st), 0);
    mm_conn_dereg_mem(c, reg);
    mm_conn_close(c);
    mm_listener_close(l);
    free(out);
    free(in);
}

MM_TESTS = {
    {"rdma: no device fails clearly", test_no_device_fails_clearly},
    {"rdma: bad URL options", test_bad_options},
    {"rdma: identity mismatch", test_identity_mismatch},
    {"rdma: small ring, big frames, mtu 512", test_small_ring_big_frames_mtu},
    {NULL, NULL},
};
