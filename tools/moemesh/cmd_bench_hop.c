// SPDX-License-Identifier: MIT
// `moemesh bench-hop`: one-hop latency and bandwidth of a data-plane transport. Listens on
// --url, forks a peer that dials it, then for each size in --bytes:
//   latency: ping-pong; hop = RTT/2 measured by the parent, and one-way = the receiver's
//            CLOCK_MONOTONIC minus the sender's stamp in the payload (one clock on one box);
//   bandwidth: a stream of frames then one ack from the peer.
// With --peers N (> 1) it forks N peers and measures the mesh's per-layer pattern instead:
// one step = send a frame to every peer, then gather every reply with mm_conn_wait_any.
// Buffers are allocated before measuring; nothing is allocated per frame.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/transport.h"

#define MAX_SIZES 16
#define STEP_QUIT UINT64_MAX

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double pct_us(uint64_t *v, size_t n, double p) {
    qsort(v, n, sizeof(*v), cmp_u64);
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return (double)v[i] / 1000.0;
}

// The peer: echo PINGs as PONGs with the one-way time, ack bandwidth streams, quit on CTRL.
static int run_peer(const char *url, size_t max_bytes) {
    char err[MM_ERRLEN] = "";
    mm_conn *c = NULL;
    mm_err rv = mm_transport_dial(&c, url, mm_deadline_in_ms(10000), err);
    if (rv != MM_OK) {
        fprintf(stderr, "bench-hop peer: dial %s: %s (%s)\n", url, mm_strerror(rv), err);
        return 1;
    }
    unsigned char *buf = malloc(max_bytes + 64);
    if (buf == NULL)
        return 1;
    for (;;) {
        mm_wire_hdr h;
        rv = mm_conn_recv(c, &h, buf, max_bytes + 64, mm_deadline_in_ms(60000));
        uint64_t now = mm_now_ns();
        if (rv != MM_OK) {
            fprintf(stderr, "bench-hop peer: recv: %s\n", mm_strerror(rv));
            break;
        }
        if (h.kind == MM_WIRE_CTRL && h.step_id == STEP_QUIT)
            break;
        if (h.kind == MM_WIRE_PING) {
            if (h.payload_bytes >= 16) {
                uint64_t t0;
                memcpy(&t0, buf, 8);
                uint64_t d = now - t0;
                memcpy(buf + 8, &d, 8);
            }
            h.kind = MM_WIRE_PONG;
            rv = mm_conn_send(c, &h, buf, mm_deadline_in_ms(10000));
        } else if (h.kind == MM_WIRE_ROWS && h.aux == 0) { // last frame of a stream: ack
            mm_wire_hdr a;
            mm_wire_hdr_init(&a, MM_WIRE_REPLY, MM_WIRE_BYTES, h.step_id, 0, 0, 0);
            rv = mm_conn_send(c, &a, NULL, mm_deadline_in_ms(10000));
        }
        if (rv != MM_OK) {
            fprintf(stderr, "bench-hop peer: send: %s\n", mm_strerror(rv));
            break;
        }
    }
    mm_conn_close(c);
    free(buf);
    return rv == MM_OK ? 0 : 1;
}

static mm_err bench_size(mm_conn *c, size_t bytes, long long iters, long long warmup,
                         long long bw_mb, unsigned char *buf, uint64_t *rtt, uint64_t *ow) {
    mm_wire_hdr h, r;
    const uint64_t dl = 10000; // ms per operation: only a broken peer reaches it
    memset(buf, 0x5a, bytes);
    for (long long i = -warmup; i < iters; i++) {
        MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_PING, MM_WIRE_BYTES, (uint64_t)(i + warmup), 0, 1,
                                (uint32_t)bytes));
        uint64_t t0 = mm_now_ns();
        if (bytes >= 16)
            memcpy(buf, &t0, 8);
        MM_TRY(mm_conn_send(c, &h, buf, mm_deadline_in_ms(dl)));
        MM_TRY(mm_conn_recv(c, &r, buf, bytes, mm_deadline_in_ms(dl)));
        uint64_t t1 = mm_now_ns();
        if (r.kind != MM_WIRE_PONG || r.step_id != h.step_id)
            return MM_EPROTO;
        if (i >= 0) {
            rtt[i] = t1 - t0;
            uint64_t d = 0;
            if (bytes >= 16)
                memcpy(&d, buf + 8, 8);
            ow[i] = d;
        }
    }
    double p50 = pct_us(rtt, (size_t)iters, 0.50) / 2, p99 = pct_us(rtt, (size_t)iters, 0.99) / 2;
    double o50 = 0, o99 = 0;
    if (bytes >= 16) {
        o50 = pct_us(ow, (size_t)iters, 0.50);
        o99 = pct_us(ow, (size_t)iters, 0.99);
    }
    // Bandwidth: stream n frames, the peer acks the last one.
    uint64_t n = ((uint64_t)bw_mb << 20) / bytes;
    if (n < 8)
        n = 8;
    uint64_t t0 = mm_now_ns();
    for (uint64_t i = 0; i < n; i++) {
        MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_BYTES, i, 0, 1, (uint32_t)bytes));
        h.aux = (uint32_t)(n - 1 - i);
        MM_TRY(mm_conn_send(c, &h, buf, mm_deadline_in_ms(dl)));
    }
    MM_TRY(mm_conn_recv(c, &r, buf, bytes, mm_deadline_in_ms(dl)));
    double secs = (double)(mm_now_ns() - t0) / 1e9;
    double gbps = (double)n * (double)bytes / secs / 1e9;
    printf("%-10zu %8lld %10.2f %10.2f %10.2f %10.2f %9.2f\n", bytes, iters, p50, p99, o50, o99,
           gbps);
    fflush(stdout);
    return MM_OK;
}

// Fan-out + gather: step time = send to all peers, then wait_any/recv every PONG.
static mm_err bench_fanout(mm_conn **conns, size_t n, size_t bytes, long long iters,
                           long long warmup, unsigned char *buf, uint64_t *step, uint64_t *ow) {
    mm_conn *pending[MM_CONN_WAIT_MAX];
    const uint64_t dl_ms = 10000;
    memset(buf, 0x5a, bytes);
    for (long long i = -warmup; i < iters; i++) {
        mm_wire_hdr h, r;
        uint64_t t0 = mm_now_ns(), worst = 0;
        uint64_t dl = mm_deadline_in_ms(dl_ms);
        for (size_t k = 0; k < n; k++) {
            MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_PING, MM_WIRE_BYTES, (uint64_t)(i + warmup), 0,
                                    1, (uint32_t)bytes));
            h.row_base = (uint32_t)k;
            uint64_t ts = mm_now_ns();
            if (bytes >= 16)
                memcpy(buf, &ts, 8);
            MM_TRY(mm_conn_send(conns[k], &h, buf, dl));
            pending[k] = conns[k];
        }
        size_t n_pending = n;
        while (n_pending > 0) {
            size_t j = 0;
            MM_TRY(mm_conn_wait_any(pending, n_pending, dl, &j));
            MM_TRY(mm_conn_recv(pending[j], &r, buf, bytes, dl));
            if (r.kind != MM_WIRE_PONG || r.step_id != (uint64_t)(i + warmup))
                return MM_EPROTO;
            uint64_t d = 0;
            if (bytes >= 16)
                memcpy(&d, buf + 8, 8);
            if (d > worst)
                worst = d;
            pending[j] = pending[--n_pending];
        }
        if (i >= 0) {
            step[i] = mm_now_ns() - t0;
            ow[i] = worst;
        }
    }
    double p50 = pct_us(step, (size_t)iters, 0.50), p99 = pct_us(step, (size_t)iters, 0.99);
    double o50 = pct_us(ow, (size_t)iters, 0.50), o99 = pct_us(ow, (size_t)iters, 0.99);
    printf("%-10zu %8lld %6zu %11.2f %11.2f %10.2f %10.2f\n", bytes, iters, n, p50, p99, o50,
           o99);
    fflush(stdout);
    return MM_OK;
}

static int run_bench_hop(int argc, char **argv) {
    char *url = NULL, *bytes_s = NULL;
    long long iters = 0, warmup = 0, bw_mb = 0, n_peers = 0;
    mm_opt opts[] = {
        {"url", MM_OPT_STR, &url, "shm://bench-hop", "transport URL to measure (shm://NAME, "
                                                     "tcp://127.0.0.1:PORT)"},
        {"bytes", MM_OPT_STR, &bytes_s, "16384,1048576", "frame payload sizes, comma-separated"},
        {"iters", MM_OPT_INT, &iters, "20000", "ping-pongs per size (1 MiB+ sizes use fewer: "
                                               "at least 500, about iters*16KiB/size)"},
        {"warmup", MM_OPT_INT, &warmup, "1000", "ping-pongs discarded before measuring"},
        {"bw-mb", MM_OPT_INT, &bw_mb, "512", "MiB streamed per size for the bandwidth figure"},
        {"peers", MM_OPT_INT, &n_peers, "1", "peers to fork; > 1 measures fan-out + gather "
                                             "steps (send to all, wait_any every reply)"},
        {NULL, 0, NULL, NULL, NULL},
    };
    mm_cli cli = {.prog = "moemesh bench-hop",
                  .summary = "Measure one-hop latency (p50/p99) and bandwidth of a data-plane "
                             "transport against a forked peer.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "moemesh bench-hop: %s\n", err);
        mm_config_fini(&cli);
        return 2;
    }
    if (cli.help_shown) {
        mm_config_fini(&cli);
        return 0;
    }
    int status = 1;
    size_t sizes[MAX_SIZES], n_sizes = 0, max_bytes = 0;
    for (char *s = bytes_s; s && *s;) {
        char *end = NULL;
        unsigned long long v = strtoull(s, &end, 10);
        if (end == s || v == 0 || v > (256ull << 20) || n_sizes == MAX_SIZES ||
            (*end != ',' && *end != '\0')) {
            fprintf(stderr, "moemesh bench-hop: --bytes '%s': want up to %d sizes of 1..%u "
                    "bytes, comma-separated\n", bytes_s, MAX_SIZES, 256u << 20);
            mm_config_fini(&cli);
            return 2;
        }
        sizes[n_sizes++] = (size_t)v;
        if (v > max_bytes)
            max_bytes = (size_t)v;
        s = *end == ',' ? end + 1 : end;
    }
    if (n_sizes == 0 || iters < 10 || warmup < 0 || bw_mb < 1 || n_peers < 1 ||
        n_peers > 64) {
        fprintf(stderr, "moemesh bench-hop: need --bytes, --iters >= 10, --warmup >= 0, "
                "--bw-mb >= 1, --peers 1..64\n");
        mm_config_fini(&cli);
        return 2;
    }
    mm_listener *l = NULL;
    mm_conn *conns[64] = {NULL};
    pid_t pids[64];
    size_t n_conns = 0;
    unsigned char *buf = malloc(max_bytes + 64);
    uint64_t *rtt = calloc((size_t)iters, sizeof(uint64_t));
    uint64_t *ow = calloc((size_t)iters, sizeof(uint64_t));
    for (int k = 0; k < 64; k++)
        pids[k] = -1;
    mm_err rv = mm_transport_listen(&l, url, err);
    if (rv != MM_OK || buf == NULL || rtt == NULL || ow == NULL) {
        fprintf(stderr, "moemesh bench-hop: listen %s: %s (%s)\n", url, mm_strerror(rv), err);
        goto out;
    }
    for (long long k = 0; k < n_peers; k++) {
        fflush(NULL);
        pids[k] = fork();
        if (pids[k] == 0)
            _exit(run_peer(url, max_bytes));
    }
    for (; n_conns < (size_t)n_peers; n_conns++) {
        rv = mm_listener_accept(l, &conns[n_conns], mm_deadline_in_ms(10000), err);
        if (rv != MM_OK) {
            fprintf(stderr, "moemesh bench-hop: accept on %s: %s (%s)\n", url,
                    mm_strerror(rv), err);
            goto out;
        }
    }
    const char *spin = getenv("MM_TRANSPORT_SPIN_US");
    printf("bench-hop %s  (hop = ping-pong RTT/2; one-way = peer clock - sender stamp, same "
           "CLOCK_MONOTONIC; spin %s us)\n", url, spin ? spin : "50 (default)");
    if (n_peers == 1)
        printf("%-10s %8s %10s %10s %10s %10s %9s\n", "bytes", "iters", "hop_p50us",
               "hop_p99us", "1way_p50", "1way_p99", "bw_GB/s");
    else
        printf("%-10s %8s %6s %11s %11s %10s %10s   (step = send to all + gather all; 1way = "
               "slowest peer's)\n", "bytes", "iters", "peers", "step_p50us", "step_p99us",
               "1way_p50", "1way_p99");
    for (size_t i = 0; i < n_sizes; i++) {
        long long it = iters;
        if (sizes[i] > 16384) {
            long long scaled = (long long)((double)iters * 16384.0 / (double)sizes[i]);
            it = scaled < 500 ? 500 : scaled;
            if (it > iters)
                it = iters;
        }
        long long wu = warmup < it ? warmup : it;
        if (n_peers == 1)
            rv = bench_size(conns[0], sizes[i], it, wu, bw_mb, buf, rtt, ow);
        else
            rv = bench_fanout(conns, n_conns, sizes[i], it, wu, buf, rtt, ow);
        if (rv != MM_OK) {
            fprintf(stderr, "moemesh bench-hop: %zu bytes: %s\n", sizes[i], mm_strerror(rv));
            goto out;
        }
    }
    status = 0;
out:
    for (size_t k = 0; k < n_conns; k++) {
        mm_wire_hdr q;
        mm_wire_hdr_init(&q, MM_WIRE_CTRL, MM_WIRE_BYTES, STEP_QUIT, 0, 0, 0);
        mm_conn_send(conns[k], &q, NULL, mm_deadline_in_ms(1000));
    }
    for (int k = 0; k < 64; k++) {
        if (pids[k] <= 0)
            continue;
        int st = 0;
        for (int i = 0; i < 300 && waitpid(pids[k], &st, WNOHANG) == 0; i++)
            usleep(10000);
        if (waitpid(pids[k], &st, WNOHANG) == 0) {
            kill(pids[k], SIGKILL);
            waitpid(pids[k], &st, 0);
        }
    }
    for (size_t k = 0; k < n_conns; k++)
        mm_conn_close(conns[k]);
    mm_listener_close(l);
    free(buf);
    free(rtt);
    free(ow);
    mm_config_fini(&cli);
    return status;
}
MM_COMMAND(cmd_bench_hop, "bench-hop",
           "one-hop latency and bandwidth of a data-plane transport (shm://, tcp://)",
           run_bench_hop)
