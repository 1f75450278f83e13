// SPDX-License-Identifier: MIT
// The data plane of a real expert owner and attention shard (their binaries, started here with
// no router: they serve --data before joining), driven frame by frame: the owner computes its
// experts bit-identically to the in-process stage function, refuses rows for an expert its
// placement gives another owner (MM_WIRE_ERROR naming it), refuses rows without a CTRL frame
// and segment lists out of order or past its rows,
// and exports its load CSV at exit; the shard checks positions (a seq it holds no KV for must
// start at 0; pos must equal the KV length) and matches mm_model_attn_forward bit for bit.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mm/model.h"
#include "mm/transport.h"
#include "mm_test.h"

#define MODEL "tests/fixtures/models/qwen3moe-tiny"

static char s_dir[64];

static pid_t spawn(const char *bin, char *const extra[], const char *data) {
    const char *bindir = getenv("BIN") ? getenv("BIN") : "build/bin";
    char path[512], router[128], listen[128];
    snprintf(path, sizeof(path), "%s/%s", bindir, bin);
    snprintf(router, sizeof(router), "ipc://%s/no-router.ctl", s_dir);
    snprintf(listen, sizeof(listen), "ipc://%s/%s.ctl", s_dir, bin);
    char *argv[32] = {path, "--router", router, "--listen", listen, "--model", MODEL,
                      "--data", (char *)data, "--threads", "1", "--log-level", "warn"};
    int n = 13;
    for (int i = 0; extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); // a failing test (exit) takes the daemon with it
        execv(path, argv);
        _exit(127);
    }
    return pid;
}

static void cleanup_dir(void) {
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", s_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", s_dir);
}

static void stop(pid_t pid) {
    kill(pid, SIGTERM);
    for (int i = 0; i < 50; i++) {
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return;
        usleep(100000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

static void send_ctrl(mm_conn *c, uint64_t step, uint32_t layer, const void *p, uint32_t n) {
    mm_wire_hdr h;
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_CTRL, MM_WIRE_BYTES, step, layer, 1, n));
    MM_PASS(mm_conn_send(c, &h, p, mm_deadline_in_ms(2000)));
}

static void send_rows(mm_conn *c, uint64_t step, uint32_t layer, const float *x, uint32_t n,
                      uint32_t d) {
    mm_wire_hdr h;
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, step, layer, n, d));
    MM_PASS(mm_conn_send(c, &h, x, mm_deadline_in_ms(2000)));
}

// send_rows_hdr: rows with header flags and aux (a plan frame in one piece: MM_MODEL_PLAN_FLAG
// and its slots)
static void send_rows_hdr(mm_conn *c, uint64_t step, uint32_t layer, const float *x, uint32_t n,
                          uint32_t d, uint16_t flags, uint32_t aux) {
    mm_wire_hdr h;
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, step, layer, n, d));
    h.flags = flags;
    h.aux = aux;
    MM_PASS(mm_conn_send(c, &h, x, mm_deadline_in_ms(2000)));
}

static mm_wire_hdr recv_frame(mm_conn *c, void *buf, size_t cap) {
    mm_wire_hdr h;
    MM_PASS(mm_conn_recv(c, &h, buf, cap, mm_deadline_in_ms(5000)));
    return h;
}

// expect_error: the next frame on c is an ERROR of code whose message contains needle (NULL:
// any message).
static void expect_error(mm_conn *c, mm_err code, const char *needle) {
    char buf[4096];
    mm_wire_hdr h = recv_frame(c, buf, sizeof(buf));
    MM_EQ(h.kind, MM_WIRE_ERROR);
    MM_EQ(h.aux, (uint32_t)code);
    buf[h.payload_bytes < sizeof(buf) ? h.payload_bytes : sizeof(buf) - 1] = 0;
    if (needle)
        MM_TRUE(strstr(buf, needle) != NULL);
}

static void setup(mm_backend **be, mm_model **m, mm_model_scratch **s) {
    char err[MM_ERRLEN] = "";
    snprintf(s_dir, sizeof(s_dir), "/tmp/mm-dp-%d", (int)getpid());
    mkdir(s_dir, 0755);
    mm_backend_params bp = {.n_threads = 1};
    MM_PASS(mm_backend_open(be, "cpu", &bp, err));
    if (mm_model_open(m, MODEL, *be, err) != MM_OK)
        MM_SKIP("no fixture: %s", err);
    MM_PASS(mm_model_scratch_new(s, *m, 16, err));
}

static void test_owner(void) {
    mm_backend *be = NULL;
    mm_model *m = NULL;
    mm_model_scratch *s = NULL;
    setup(&be, &m, &s);
    const int D = mm_model_cfg(m)->d_model;
    char data[64], csv[128];
    snprintf(data, sizeof(data), "shm://mmdp-%d-e", (int)getpid());
    snprintf(csv, sizeof(csv), "%s/load.csv", s_dir);
    char *extra[] = {"--owners", "2", "--instance", "0", "--load-csv", csv, NULL};
    pid_t pid = spawn("moemesh-expert", extra, data);
    mm_conn *c = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_transport_dial(&c, data, mm_deadline_in_ms(10000), err));
    float x[3 * 64], y[3 * 64], want[3 * 64];
    MM_TRUE(D <= 64);
    for (int i = 0; i < 3 * D; i++)
        x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
    // expert 2 of layer 1 is owner 0's under the uniform placement (2 % 2 == 0): 2 rows,
    // then expert 4: 1 row
    uint32_t seg[5] = {2, 2, 2, 4, 1};
    send_ctrl(c, 7, 1, seg, sizeof(seg));
    send_rows(c, 7, 1, x, 3, (uint32_t)D);
    mm_wire_hdr h = recv_frame(c, y, sizeof(y));
    MM_EQ(h.kind, MM_WIRE_REPLY);
    MM_EQ(h.step_id, 7u);
    MM_EQ(h.layer, 1u);
    MM_EQ(h.n_rows, 3u);
    MM_PASS(mm_model_expert_forward(m, s, 1, 2, x, 2, want));
    MM_PASS(mm_model_expert_forward(m, s, 1, 4, x + 2 * D, 1, want + 2 * D));
    MM_TRUE(memcmp(y, want, (size_t)(3 * D) * 4) == 0); // bit for bit
    // expert 3 is owner 1's: refused with a clear error, the conn stays usable
    uint32_t seg2[3] = {1, 3, 1};
    send_ctrl(c, 8, 0, seg2, sizeof(seg2));
    send_rows(c, 8, 0, x, 1, (uint32_t)D);
    expect_error(c, MM_EINVAL, "does not hold expert 3 of layer 0");
    // rows with no CTRL frame before them
    send_rows(c, 9, 0, x, 1, (uint32_t)D);
    expect_error(c, MM_EPROTO, NULL);
    // segment lists that would run rows through the wrong experts or count rows never served
    // are refused at the CTRL frame, naming what is wrong: experts out of order (4 then 2,
    // both this owner's), row counts past what the owner takes (here wrapping a u32 sum to 1)
    uint32_t seg_desc[5] = {2, 4, 1, 2, 2};
    send_ctrl(c, 11, 1, seg_desc, sizeof(seg_desc));
    expect_error(c, MM_EPROTO, "not in ascending order");
    uint32_t seg_wrap[5] = {2, 2, 0xFFFFFFFFu, 4, 2};
    send_ctrl(c, 12, 1, seg_wrap, sizeof(seg_wrap));
    expect_error(c, MM_EPROTO, "more rows than this owner takes");
    send_rows(c, 12, 1, x, 1, (uint32_t)D); // and the rows after it: no CTRL frame stands
    expect_error(c, MM_EPROTO, NULL);
    // a plan frame's CTRL (the router's device routing plan) to an owner without device
    // frames, and one of the wrong size: refused
    uint32_t plan[4] = {MM_MODEL_PLAN_MARK, 1, 1, 0};
    send_ctrl(c, 13, 1, plan, sizeof(plan));
    expect_error(c, MM_EPROTO, "no device frames");
    send_ctrl(c, 14, 1, plan, 12);
    expect_error(c, MM_EPROTO, NULL);
    // the same in one piece (the shape in the rows frame's header: MM_MODEL_PLAN_FLAG, aux the
    // slots): refused without device frames, with slots past the rows' top-k, with flags no
    // kind defines (each naming what is wrong), and a stale plan CTRL frame does not carry over
    send_rows_hdr(c, 15, 1, x, 3, (uint32_t)D, MM_MODEL_PLAN_FLAG, 1);
    expect_error(c, MM_EPROTO, "and no device frames");
    send_rows_hdr(c, 16, 1, x, 3, (uint32_t)D, MM_MODEL_PLAN_FLAG, 1000000);
    expect_error(c, MM_EPROTO, "bad plan frame (flags 0x1");
    send_rows_hdr(c, 17, 1, x, 3, (uint32_t)D, MM_MODEL_PLAN_FLAG | 0x8, 1);
    expect_error(c, MM_EPROTO, "bad plan frame (flags 0x9");
    send_rows_hdr(c, 18, 1, x, 3, (uint32_t)D, 0x4, 0);
    expect_error(c, MM_EPROTO, "unknown flags 0x4");
    send_ctrl(c, 19, 1, seg, sizeof(seg));
    send_rows_hdr(c, 19, 1, x, 3, (uint32_t)D, 0x4, 0); // flags refused even after a CTRL frame
    expect_error(c, MM_EPROTO, "unknown flags 0x4");
    send_rows(c, 19, 1, x, 3, (uint32_t)D); // and the CTRL frame no longer stands
    expect_error(c, MM_EPROTO, NULL);
    // and it still serves
    send_ctrl(c, 10, 1, seg, sizeof(seg));
    send_rows(c, 10, 1, x, 3, (uint32_t)D);
    h = recv_frame(c, y, sizeof(y));
    MM_EQ(h.kind, MM_WIRE_REPLY);
    MM_TRUE(memcmp(y, want, (size_t)(3 * D) * 4) == 0);
    mm_conn_close(c);
    stop(pid);
    FILE *f = fopen(csv, "r");
    MM_TRUE(f != NULL);
    char line[128];
    int found = 0;
    while (fgets(line, sizeof(line), f))
        found += !strcmp(line, "1,2,4\n") + !strcmp(line, "1,4,2\n");
    fclose(f);
    MM_EQ(found, 2); // counts of both steps
    cleanup_dir();
    mm_model_scratch_free(s);
    mm_model_close(m);
    mm_backend_close(be);
}

static void test_shard(void) {
    mm_backend *be = NULL;
    mm_model *m = NULL;
    mm_model_scratch *s = NULL;
    setup(&be, &m, &s);
    const int D = mm_model_cfg(m)->d_model;
    char data[64];
    snprintf(data, sizeof(data), "shm://mmdp-%d-a", (int)getpid());
    char *extra[] = {"--shards", "1", "--kv-mb", "4", "--max-seqs", "4", NULL};
    pid_t pid = spawn("moemesh-attention", extra, data);
    mm_conn *c = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_transport_dial(&c, data, mm_deadline_in_ms(10000), err));
    // the reference: an in-process cache, same stage function
    mm_kv_params kp;
    mm_model_kv_params(m, &kp);
    kp.max_seqs = 1;
    kp.max_ctx = 64;
    kp.budget_bytes = 1 << 20;
    mm_kv_cache *kv = NULL;
    MM_PASS(mm_kv_cache_new(&kv, &kp, be, err));
    int32_t slot;
    MM_PASS(mm_kv_cache_seq_new(kv, &slot));
    float x[2 * 64], ref[2 * 64], y[2 * 64];
    char buf[4096];
    for (int i = 0; i < 2 * D; i++)
        x[i] = (float)((i * 13) % 29) / 10.0f - 1.4f;
    // a seq the shard does not hold, at pos 3: refused on the layer-0 rows
    uint8_t ctrl[8 + 16];
    uint32_t ns = 1, nr = 0;
    uint64_t id = 5;
    int32_t pos = 3, n = 2;
    memcpy(ctrl, &ns, 4), memcpy(ctrl + 4, &nr, 4), memcpy(ctrl + 8, &id, 8);
    memcpy(ctrl + 16, &pos, 4), memcpy(ctrl + 20, &n, 4);
    send_ctrl(c, 1, MM_WIRE_NO_LAYER, ctrl, sizeof(ctrl));
    send_rows(c, 1, 0, x, 2, (uint32_t)D);
    mm_wire_hdr h = recv_frame(c, buf, sizeof(buf));
    MM_EQ(h.kind, MM_WIRE_ERROR);
    MM_EQ(h.aux, (uint32_t)MM_EPROTO);
    buf[h.payload_bytes] = 0;
    MM_TRUE(strstr(buf, "seq 5: position 3") != NULL);
    // from 0: both layers, bit for bit with the in-process stage
    pos = 0;
    memcpy(ctrl + 16, &pos, 4);
    send_ctrl(c, 2, MM_WIRE_NO_LAYER, ctrl, sizeof(ctrl));
    memcpy(ref, x, sizeof(float) * 2 * (size_t)D);
    memcpy(y, x, sizeof(float) * 2 * (size_t)D);
    MM_PASS(mm_kv_cache_reserve(kv, slot, 2));
    int32_t rs[2] = {slot, slot}, rp[2] = {0, 1};
    mm_model_rows rows = {.n_rows = 2, .seq = rs, .pos = rp};
    for (uint32_t L = 0; L < 2; L++) {
        send_rows(c, 2, L, y, 2, (uint32_t)D);
        h = recv_frame(c, y, sizeof(y));
        MM_EQ(h.kind, MM_WIRE_REPLY);
        MM_EQ(h.layer, L);
        MM_PASS(mm_model_attn_forward(m, s, (int)L, kv, &rows, ref));
        MM_TRUE(memcmp(y, ref, sizeof(float) * 2 * (size_t)D) == 0);
    }
    // a wrong position for a held seq (its KV length is 2): refused
    pos = 1;
    n = 1;
    memcpy(ctrl + 16, &pos, 4), memcpy(ctrl + 20, &n, 4);
    send_ctrl(c, 3, MM_WIRE_NO_LAYER, ctrl, sizeof(ctrl));
    send_rows(c, 3, 0, x, 1, (uint32_t)D);
    h = recv_frame(c, buf, sizeof(buf));
    MM_EQ(h.kind, MM_WIRE_ERROR);
    buf[h.payload_bytes] = 0;
    MM_TRUE(strstr(buf, "its KV length is 2") != NULL);
    // rows for the wrong layer (the shard expects layer 0 first)
    pos = 2;
    memcpy(ctrl + 16, &pos, 4);
    send_ctrl(c, 4, MM_WIRE_NO_LAYER, ctrl, sizeof(ctrl));
    send_rows(c, 4, 1, x, 1, (uint32_t)D);
    h = recv_frame(c, buf, sizeof(buf));
    MM_EQ(h.kind, MM_WIRE_ERROR);
    // released, the seq can start again at 0
    uint8_t rel[8 + 16 + 8];
    ns = 1, nr = 1, pos = 0, n = 1;
    memcpy(rel, &ns, 4), memcpy(rel + 4, &nr, 4), memcpy(rel + 8, &id, 8);
    memcpy(rel + 16, &pos, 4), memcpy(rel + 20, &n, 4), memcpy(rel + 24, &id, 8);
    send_ctrl(c, 5, MM_WIRE_NO_LAYER, rel, sizeof(rel));
    send_rows(c, 5, 0, x, 1, (uint32_t)D);
    h = recv_frame(c, y, sizeof(y));
    MM_EQ(h.kind, MM_WIRE_REPLY);
    mm_conn_close(c);
    stop(pid);
    cleanup_dir();
    mm_kv_cache_free(kv);
    mm_model_scratch_free(s);
    mm_model_close(m);
    mm_backend_close(be);
}

MM_TESTS = {
    {"expert owner: exact outputs, refuses experts it does not hold, load CSV", test_owner},
    {"attention shard: position checks, release, exact attention", test_shard},
    {NULL, NULL},
};
