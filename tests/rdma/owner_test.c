// SPDX-License-Identifier: MIT
// An expert owner (moemesh-expert) reached over rdma:// answers exactly as over tcp://: two
// owners of the tiny Qwen3-MoE fixture are started, one with --data tcp://, one with
// --data rdma://; the same CTRL + ROWS frames (every expert of every layer, the router's
// docs/MESH.md protocol) go to both and the REPLY rows must be bit-identical. Without an RDMA
// device the rdma:// owner must refuse to start (exit non-zero); with one (soft-RoCE in the VM
// of `make test-rdma`) the comparison runs.
//   env: MM_TEST_EXPERT_BIN (default $BIN/moemesh-expert, BIN default build/bin),
//        MM_TEST_MODEL (default tests/fixtures/models/qwen3moe-tiny)
#include <signal.h>
#include <sys/wait.h>

#include "mm_test.h"
#include "mm/transport.h"

#define D_MODEL 64
#define N_LAYERS 4
#define N_EXPERTS 16
#define ROWS_PER_EXPERT 3

static const char *env_or(const char *name, const char *def) {
    const char *v = getenv(name);
    return v != NULL && *v != '\0' ? v : def;
}

static pid_t start_owner(const char *data_url, const char *dir, const char *log) {
    // tests/run.sh sets BIN=$BUILD/bin: make asan/ubsan start their own instrumented owner
    char def_bin[512];
    snprintf(def_bin, sizeof(def_bin), "%s/moemesh-expert", env_or("BIN", "build/bin"));
    const char *bin = env_or("MM_TEST_EXPERT_BIN", def_bin);
    const char *model = env_or("MM_TEST_MODEL", "tests/fixtures/models/qwen3moe-tiny");
    char router[256], listen[256];
    snprintf(router, sizeof(router), "ipc://%s/router.ctl", dir);
    snprintf(listen, sizeof(listen), "ipc://%s/%s.ctl", dir, log);
    char logpath[256];
    snprintf(logpath, sizeof(logpath), "%s/%s.log", dir, log);
    fflush(NULL);
    pid_t pid = fork();
    MM_TRUE(pid >= 0);
    if (pid == 0) {
        if (freopen(logpath, "w", stderr) == NULL)
            _exit(120);
        execl(bin, bin, "--model", model, "--router", router, "--listen", listen, "--data",
              data_url, "--threads", "1", (char *)NULL);
        _exit(121);
    }
    return pid;
}

static void dump_logs(const char *dir) {
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "tail -n 15 %s/*.log >&2", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "(no owner logs)\n");
}

static void stop_owner(pid_t pid) {
    kill(pid, SIGTERM);
    int st = 0;
    for (int i = 0; i < 500 && waitpid(pid, &st, WNOHANG) == 0; i++)
        usleep(10000);
    if (waitpid(pid, &st, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
    }
}

// Sends layer L's segments (every expert, ROWS_PER_EXPERT rows each) and reads the reply
// rows into out (N_EXPERTS * ROWS_PER_EXPERT * D_MODEL floats).
static void owner_layer(mm_conn *c, uint32_t layer, float *out) {
    uint32_t ctrl[1 + 2 * N_EXPERTS];
    ctrl[0] = N_EXPERTS;
    for (uint32_t e = 0; e < N_EXPERTS; e++) {
        ctrl[1 + 2 * e] = e;
        ctrl[2 + 2 * e] = ROWS_PER_EXPERT;
    }
    const uint32_t n_rows = N_EXPERTS * ROWS_PER_EXPERT;
    static float x[N_EXPERTS * ROWS_PER_EXPERT * D_MODEL];
    for (uint32_t i = 0; i < n_rows * D_MODEL; i++)
        x[i] = (float)((int)((i * 2654435761u + layer * 97u) % 2001u) - 1000) / 700.0f;
    mm_wire_hdr h;
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_CTRL, MM_WIRE_BYTES, 100 + layer, layer, 1,
                             sizeof(ctrl)));
    MM_PASS(mm_conn_send(c, &h, ctrl, mm_deadline_in_ms(20000)));
    MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, 100 + layer, layer, n_rows,
                             D_MODEL));
    MM_PASS(mm_conn_send(c, &h, x, mm_deadline_in_ms(20000)));
    mm_wire_hdr r;
    MM_PASS(mm_conn_recv(c, &r, out, sizeof(x), mm_deadline_in_ms(60000)));
    if (r.kind != MM_WIRE_REPLY)
        MM_TEST_FAIL_("owner answered kind %u (aux %u: %.*s)", r.kind, r.aux,
                      (int)r.payload_bytes, (const char *)out);
    MM_EQ(r.step_id, 100 + layer);
    MM_EQ(r.n_rows, n_rows);
    MM_EQ(r.payload_bytes, sizeof(x));
}

static void test_owner_rdma_equals_tcp(void) {
    char dir[] = "/tmp/mm-owner-rdma.XXXXXX";
    MM_TRUE(mkdtemp(dir) != NULL);
    int port = mm_test_next_port();
    char tcp_url[64], rdma_url[64];
    snprintf(tcp_url, sizeof(tcp_url), "tcp://127.0.0.1:%d", port);
    snprintf(rdma_url, sizeof(rdma_url), "rdma://127.0.0.1:%d", port + 1);

    // Is there an RDMA device? (listen fails with MM_EUNSUPP when not)
    char err[MM_ERRLEN] = "";
    mm_listener *probe = NULL;
    char purl[64];
    snprintf(purl, sizeof(purl), "rdma://127.0.0.1:%d", mm_test_next_port());
    bool have_rdma = mm_transport_listen(&probe, purl, err) != MM_EUNSUPP;
    mm_listener_close(probe);

    pid_t rdma_pid = start_owner(rdma_url, dir, "expert-rdma");
    if (!have_rdma) { // it must refuse to start, saying why
        int st = 0;
        for (int i = 0; i < 2000 && waitpid(rdma_pid, &st, WNOHANG) == 0; i++)
            usleep(10000);
        if (waitpid(rdma_pid, &st, WNOHANG) == 0 && !WIFEXITED(st)) {
            stop_owner(rdma_pid);
            MM_TEST_FAIL_("moemesh-expert --data rdma:// kept running without an RDMA device");
        }
        MM_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0);
        MM_SKIP("no RDMA device: the rdma:// owner refused to start (exit %d), as it must; "
                "the comparison runs under `make test-rdma`", WEXITSTATUS(st));
    }
    pid_t tcp_pid = start_owner(tcp_url, dir, "expert-tcp");
    mm_conn *ct = NULL, *cr = NULL;
    mm_err rv = mm_transport_dial(&ct, tcp_url, mm_deadline_in_ms(180000), err);
    if (rv != MM_OK) {
        dump_logs(dir);
        MM_TEST_FAIL_("dial %s: %s (%s)", tcp_url, mm_strerror(rv), err);
    }
    rv = mm_transport_dial(&cr, rdma_url, mm_deadline_in_ms(180000), err);
    if (rv != MM_OK) {
        dump_logs(dir);
        MM_TEST_FAIL_("dial %s: %s (%s)", rdma_url, mm_strerror(rv), err);
    }
    static float yt[N_EXPERTS * ROWS_PER_EXPERT * D_MODEL], yr[N_EXPERTS * ROWS_PER_EXPERT * D_MODEL];
    for (uint32_t layer = 0; layer < N_LAYERS; layer++) {
        owner_layer(ct, layer, yt);
        memset(yr, 0, sizeof(yr));
        owner_layer(cr, layer, yr);
        double norm = 0;
        for (size_t i = 0; i < sizeof(yt) / sizeof(yt[0]); i++)
            norm += (double)yt[i] * yt[i];
        MM_TRUE(norm > 0 && norm == norm); // the owner computed something real
        if (memcmp(yt, yr, sizeof(yt)) != 0)
            MM_TEST_FAIL_("layer %u: rdma:// reply differs from tcp://", layer);
        printf("layer %u: %u rows x %d from both owners, bit-identical (|y|^2 = %.6g)\n", layer,
               N_EXPERTS * ROWS_PER_EXPERT, D_MODEL, norm);
    }
    mm_conn_close(ct);
    mm_conn_close(cr);
    stop_owner(tcp_pid);
    stop_owner(rdma_pid);
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    MM_EQ(system(cmd), 0);
}

MM_TESTS = {
    {"rdma: expert owner over rdma:// answers as over tcp://", test_owner_rdma_equals_tcp},
    {NULL, NULL},
};
