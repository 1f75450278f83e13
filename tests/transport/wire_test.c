// SPDX-License-Identifier: MIT
// Unit tests of the data-plane frame header (mm/wire.h) and transport URL handling.
#include "mm_test.h"
#include "mm/transport.h"

static void test_payload_bytes(void) {
    uint64_t n = 0;
    MM_PASS(mm_wire_payload_bytes(MM_WIRE_F32, 3, 4096, &n));
    MM_EQ(n, 3 * 4096 * 4);
    MM_PASS(mm_wire_payload_bytes(MM_WIRE_BF16, 3, 4096, &n));
    MM_EQ(n, 3 * 4096 * 2);
    MM_PASS(mm_wire_payload_bytes(MM_WIRE_Q8_32, 2, 64, &n));
    MM_EQ(n, 2 * 2 * 36);
    MM_PASS(mm_wire_payload_bytes(MM_WIRE_I32, 5, 1, &n));
    MM_EQ(n, 20);
    MM_PASS(mm_wire_payload_bytes(MM_WIRE_BYTES, 1, 7, &n));
    MM_EQ(n, 7);
    MM_PASS(mm_wire_payload_bytes(MM_WIRE_F32, 0, 4096, &n));
    MM_EQ(n, 0);
    MM_FAIL(mm_wire_payload_bytes(MM_WIRE_Q8_32, 1, 33, &n), MM_EINVAL);
    MM_FAIL(mm_wire_payload_bytes((enum mm_wire_format)77, 1, 1, &n), MM_EINVAL);
    MM_FAIL(mm_wire_payload_bytes(MM_WIRE_F32, 0xffffffffu, 0xffffffffu, &n), MM_EINVAL);
}

static void test_hdr_init_check(void) {
    mm_wire_hdr h;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_BF16, 42, 3, 8, 2048));
    MM_EQ(h.payload_bytes, 8 * 2048 * 2);
    MM_EQ(h.step_id, 42);
    MM_EQ(h.layer, 3);
    MM_FAIL(mm_wire_hdr_check(&h, err), MM_EPROTO); // not sealed yet
    mm__wire_hdr_seal(&h, 5);
    MM_PASS(mm_wire_hdr_check(&h, err));
    MM_EQ(h.conn_seq, 5);
    mm_wire_hdr t = h;
    t.n_rows = 9; // checksum catches it
    MM_FAIL(mm_wire_hdr_check(&t, err), MM_EPROTO);
    MM_TRUE(strstr(err, "checksum") != NULL);
    t = h;
    t.payload_bytes = 1;
    mm__wire_hdr_seal(&t, 5); // consistent checksum, inconsistent size
    MM_FAIL(mm_wire_hdr_check(&t, err), MM_EPROTO);
    MM_TRUE(strstr(err, "payload_bytes") != NULL);
    t = h;
    t.magic = 0x12345678;
    MM_FAIL(mm_wire_hdr_check(&t, err), MM_EPROTO);
    MM_TRUE(strstr(err, "magic") != NULL);
    MM_FAIL(mm_wire_hdr_init(&h, MM_WIRE_HELLO, MM_WIRE_BYTES, 0, 0, 0, 0), MM_EINVAL);
    MM_FAIL(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_Q8_32, 0, 0, 1, 48), MM_EINVAL);
    MM_STREQ(mm_wire_kind_name(MM_WIRE_REPLY), "reply");
    MM_STREQ(mm_wire_format_name(MM_WIRE_Q8_32), "q8_32");
    MM_STREQ(mm_wire_format_name(999), "?");
}

static void test_url_parse(void) {
    mm_url u;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_url_parse(&u, "tcp://127.0.0.1:7000", err));
    MM_STREQ(u.scheme, "tcp");
    MM_STREQ(u.host, "127.0.0.1");
    MM_EQ(u.port, 7000);
    MM_PASS(mm_url_parse(&u, "tcp://[::1]:80", err));
    MM_STREQ(u.host, "::1");
    MM_EQ(u.port, 80);
    MM_PASS(mm_url_parse(&u, "shm://expert-3?ring_kb=512", err));
    MM_STREQ(u.host, "expert-3");
    MM_EQ(u.port, -1);
    uint64_t v = 0;
    MM_PASS(mm_url_query_u64(&u, "ring_kb", &v));
    MM_EQ(v, 512);
    MM_FAIL(mm_url_query_u64(&u, "nope", &v), MM_ENOENT);
    MM_FAIL(mm_url_parse(&u, "127.0.0.1:7000", err), MM_EINVAL);
    MM_TRUE(strstr(err, "scheme") != NULL);
    MM_FAIL(mm_url_parse(&u, "tcp://host:99999", err), MM_EINVAL);
    MM_FAIL(mm_url_parse(&u, "tcp://host:x1", err), MM_EINVAL);
    MM_FAIL(mm_url_parse(&u, "tcp://", err), MM_EINVAL);
    MM_FAIL(mm_url_parse(&u, "", err), MM_EINVAL);
    MM_FAIL(mm_url_parse(&u, "TCP://a:1", err), MM_EINVAL);
}

static void test_lookup_errors(void) {
    char err[MM_ERRLEN] = "";
    mm_listener *l = NULL;
    mm_conn *c = NULL;
    MM_FAIL(mm_transport_listen(&l, "pigeon://x", err), MM_ENOENT);
    MM_TRUE(strstr(err, "shm") != NULL && strstr(err, "tcp") != NULL); // names the known ones
    MM_NULL(l);
    MM_FAIL(mm_transport_listen(&l, "shm://bad/name", err), MM_EINVAL);
    MM_FAIL(mm_transport_listen(&l, "shm://name:12", err), MM_EINVAL);
    MM_FAIL(mm_transport_listen(&l, "tcp://127.0.0.1", err), MM_EINVAL);
    MM_TRUE(strstr(err, "port") != NULL);
    MM_FAIL(mm_transport_dial(&c, "shm://x?ring_kb=3", mm_deadline_in_ms(10), err), MM_EINVAL);
    MM_NULL(c);
    char known[64];
    mm_transport_schemes(known, sizeof(known));
    MM_TRUE(strncmp(known, "shm, tcp", 8) == 0); // later transports append themselves
    size_t i;
    MM_FAIL(mm_conn_wait_any(NULL, 0, 0, &i), MM_EINVAL);
    mm_listener_close(NULL);
    mm_conn_close(NULL);
}

static void test_listen_busy(void) {
    char err[MM_ERRLEN] = "", url[64];
    snprintf(url, sizeof(url), "shm://busy-%d", (int)getpid());
    mm_listener *a = NULL, *b = NULL;
    MM_PASS(mm_transport_listen(&a, url, err));
    MM_FAIL(mm_transport_listen(&b, url, err), MM_EBUSY);
    mm_listener_close(a);
    MM_PASS(mm_transport_listen(&b, url, err)); // the name is free again once closed
    mm_listener_close(b);
}

MM_TESTS = {
    {"wire payload bytes per format", test_payload_bytes},
    {"wire header init, seal and check", test_hdr_init_check},
    {"transport url parse", test_url_parse},
    {"transport lookup and argument errors", test_lookup_errors},
    {"transport listen on a busy name", test_listen_busy},
    {NULL, NULL},
};
