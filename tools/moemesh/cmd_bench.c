// SPDX-License-Identifier: MIT
// `moemesh bench`: a load generator for the gateway's OpenAI API. --concurrency N client
// threads each send streaming POST /v1/completions requests (their own HTTP/1.1 client over a
// socket; chunked SSE parsed as it arrives) until --requests M have been sent in all, and the
// tool reports time to first token, inter-token latency and end-to-end latency (p50/p99) and
// output tokens/s, with a progress bar on stderr. It then reads the gateway's /metrics for its
// own per-token overhead (StepResult arrival to the client socket write).
//
// Design notes: prompts are token ids (--prompt-tokens P, varied per request so no two are
// equal), ignore_eos so every request generates exactly --max-tokens, seeded sampling. Token
// counts come from the final usage chunk (stream_options.include_usage); the arrival time of
// every SSE data event is one token's time (the gateway sends one event per token and choice,
// except when a token ends inside a UTF-8 character and its text waits for the next).
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/time.h"

static char *s_url, *s_model;
static long long s_conc, s_reqs, s_prompt_tokens, s_max_tokens, s_timeout_ms, s_vocab;
static double s_temperature;
static bool s_quiet;
static mm_opt s_opts[] = {
    {"url", MM_OPT_STR, &s_url, "http://127.0.0.1:8000", "the gateway's base URL"},
    {"concurrency", MM_OPT_INT, &s_conc, "1", "requests in flight at once (client threads)"},
    {"requests", MM_OPT_INT, &s_reqs, "16", "requests in all"},
    {"prompt-tokens", MM_OPT_INT, &s_prompt_tokens, "32", "prompt length in tokens"},
    {"max-tokens", MM_OPT_INT, &s_max_tokens, "64", "tokens generated per request"},
    {"vocab", MM_OPT_INT, &s_vocab, "256", "prompt ids are drawn from [3, vocab)"},
    {"temperature", MM_OPT_DBL, &s_temperature, "1", "sampling temperature (seeded per request)"},
    {"model", MM_OPT_STR, &s_model, "", "model field of the requests (empty: omitted)"},
    {"timeout-ms", MM_OPT_INT, &s_timeout_ms, "120000", "deadline of one request"},
    {"quiet", MM_OPT_BOOL, &s_quiet, "false", "no progress bar"},
    {0},
};

struct result {
    bool ok;
    int status;
    int n_events, n_tokens;
    double ttft_ms, e2e_ms;
    double *itl;  // (n_events - 1) gaps in ms
    char err[160];
};

static struct {
    char host[256];
    int port;
    struct sockaddr_storage addr;
    socklen_t addr_len;
    atomic_int next, done;
    _Atomic uint64_t last_ns; // when the last request finished (the wall clock's end)
    struct result *res;
} B;

static int parse_url(const char *url, char *err) {
    const char *p = url;
    if (strncmp(p, "http://", 7) == 0)
        p += 7;
    else if (strstr(p, "://"))
        return snprintf(err, 200, "--url %s: only http:// is supported", url), -1;
    const char *colon = strchr(p, ':'), *slash = strchr(p, '/');
    size_t hl = colon ? (size_t)(colon - p) : slash ? (size_t)(slash - p) : strlen(p);
    if (hl == 0 || hl >= sizeof(B.host))
        return snprintf(err, 200, "--url %s: no host", url), -1;
    memcpy(B.host, p, hl);
    B.host[hl] = 0;
    B.port = colon ? atoi(colon + 1) : 80;
    if (B.port < 1 || B.port > 65535)
        return snprintf(err, 200, "--url %s: bad port", url), -1;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof(port), "%d", B.port);
    int rv = getaddrinfo(B.host, port, &hints, &ai);
    if (rv != 0 || !ai)
        return snprintf(err, 200, "--url %s: %s", url, gai_strerror(rv)), -1;
    memcpy(&B.addr, ai->ai_addr, ai->ai_addrlen);
    B.addr_len = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

static int dial(void) {
    int fd = socket(B.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct timeval tv = {.tv_sec = s_timeout_ms / 1000, .tv_usec = (s_timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&B.addr, B.addr_len) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static bool send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) {
            if (w < 0 && errno == EINTR)
                continue;
            return false;
        }
        p += w;
        n -= (size_t)w;
    }
    return true;
}

// One SSE data event arrived at t (ms since the request was sent).
static void on_event(struct result *r, const char *ev, size_t n, double t, double *last) {
    if (n >= 6 && memcmp(ev, "[DONE]", 6) == 0)
        return;
    if (memmem(ev, n, "\"error\"", 7)) {
        r->ok = false;
        snprintf(r->err, sizeof(r->err), "error event: %.*s", (int)(n > 120 ? 120 : n), ev);
        return;
    }
    const char *u = memmem(ev, n, "\"completion_tokens\":", 20);
    if (u) {
        r->n_tokens = atoi(u + 20);
        return;
    }
    if (r->n_events == 0)
        r->ttft_ms = t;
    else if (r->n_events - 1 < (int)s_max_tokens + 8)
        r->itl[r->n_events - 1] = t - *last;
    r->n_events++;
    *last = t;
}

static void run_one(int idx, struct result *r) {
    char body[65536];
    int n = snprintf(body, sizeof(body),
                     "{\"prompt\":[");
    for (long long i = 0; i < s_prompt_tokens && n < (int)sizeof(body) - 512; i++)
        n += snprintf(body + n, sizeof(body) - (size_t)n, "%s%lld", i ? "," : "",
                      3 + ((long long)idx * 131 + i * 17 + (i * i) % 7) % (s_vocab - 3));
    n += snprintf(body + n, sizeof(body) - (size_t)n,
                  "],\"max_tokens\":%lld,\"temperature\":%g,\"seed\":%d,\"ignore_eos\":true,"
                  "\"stream\":true,\"stream_options\":{\"include_usage\":true}%s%s%s}",
                  s_max_tokens, s_temperature, idx, s_model[0] ? ",\"model\":\"" : "", s_model,
                  s_model[0] ? "\"" : "");
    char head[512];
    int hn = snprintf(head, sizeof(head),
                      "POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: "
                      "application/json\r\nAccept: text/event-stream\r\nContent-Length: %d\r\n"
                      "Connection: close\r\n\r\n", B.host, B.port, n);
    r->itl = calloc((size_t)s_max_tokens + 8, sizeof(double));
    uint64_t t0 = mm_now_ns();
    int fd = dial();
    if (fd < 0) {
        snprintf(r->err, sizeof(r->err), "cannot connect: %s", strerror(errno));
        return;
    }
    if (!send_all(fd, head, (size_t)hn) || !send_all(fd, body, (size_t)n)) {
        snprintf(r->err, sizeof(r->err), "send: %s", strerror(errno));
        close(fd);
        return;
    }
    // Read: headers, then chunked body; SSE events split on "\n\n" in the de-chunked stream.
    static __thread char buf[1 << 16], sse[1 << 17];
    size_t blen = 0, slen = 0;
    bool in_body = false, chunked = false;
    size_t chunk_left = 0;
    bool want_size = true;
    double last = 0;
    bool eof = false;
    r->ok = true;
    while (!eof) {
        ssize_t got = recv(fd, buf + blen, sizeof(buf) - blen, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        double t = (double)(mm_now_ns() - t0) / 1e6;
        blen += (size_t)got;
        size_t off = 0;
        if (!in_body) {
            char *e = memmem(buf, blen, "\r\n\r\n", 4);
            if (!e)
                continue;
            r->status = atoi(buf + 9);
            chunked = memmem(buf, (size_t)(e - buf), "chunked", 7) != NULL;
            off = (size_t)(e - buf) + 4;
            in_body = true;
        }
        // De-chunk what we have into sse.
        while (off < blen) {
            if (!chunked) {
                size_t k = blen - off;
                if (slen + k > sizeof(sse))
                    k = sizeof(sse) - slen;
                memcpy(sse + slen, buf + off, k);
                slen += k;
                off = blen;
                break;
            }
            if (want_size) {
                char *e = memmem(buf + off, blen - off, "\r\n", 2);
                if (!e)
                    break;
                chunk_left = strtoul(buf + off, NULL, 16);
                off = (size_t)(e - buf) + 2;
                want_size = false;
                if (chunk_left == 0) {
                    eof = true; // the last chunk: parse what came, then stop
                    off = blen;
                    break;
                }
                continue;
            }
            size_t k = blen - off < chunk_left ? blen - off : chunk_left;
            if (slen + k > sizeof(sse))
                k = sizeof(sse) - slen;
            memcpy(sse + slen, buf + off, k);
            slen += k;
            off += k;
            chunk_left -= k;
            if (chunk_left == 0) {
                if (blen - off < 2)
                    break; // the chunk's CRLF comes later
                off += 2;
                want_size = true;
            }
        }
        memmove(buf, buf + off, blen - off);
        blen -= off;
        // Events.
        size_t so = 0;
        for (;;) {
            char *e = memmem(sse + so, slen - so, "\n\n", 2);
            if (!e)
                break;
            const char *ev = sse + so;
            size_t evn = (size_t)(e - ev);
            if (evn >= 6 && memcmp(ev, "data: ", 6) == 0)
                on_event(r, ev + 6, evn - 6, t, &last);
            so = (size_t)(e - sse) + 2;
        }
        memmove(sse, sse + so, slen - so);
        slen -= so;
    }
    close(fd);
    r->e2e_ms = (double)(mm_now_ns() - t0) / 1e6;
    if (r->status != 200) {
        r->ok = false;
        if (!r->err[0])
            snprintf(r->err, sizeof(r->err), "HTTP %d: %.100s", r->status, sse);
    } else if (r->ok && r->n_tokens == 0) {
        r->ok = false;
        snprintf(r->err, sizeof(r->err), "stream ended without usage");
    }
}

static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        int i = atomic_fetch_add(&B.next, 1);
        if (i >= s_reqs)
            return NULL;
        run_one(i, &B.res[i]);
        uint64_t now = mm_now_ns(), prev = atomic_load(&B.last_ns);
        while (now > prev && !atomic_compare_exchange_weak(&B.last_ns, &prev, now))
            ;
        atomic_fetch_add(&B.done, 1);
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double q) {
    if (n == 0)
        return 0;
    qsort(v, n, sizeof(*v), cmp_d);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

// metrics_overhead reads gateway_token_overhead_seconds from /metrics: count, sum, and the
// bucket bounds under which 50% and 99% fall.
static void metrics_overhead(void) {
    int fd = dial();
    if (fd < 0)
        return;
    char req[256];
    int n = snprintf(req, sizeof(req), "GET /metrics HTTP/1.1\r\nHost: %s:%d\r\nConnection: "
                     "close\r\n\r\n", B.host, B.port);
    if (!send_all(fd, req, (size_t)n)) {
        close(fd);
        return;
    }
    size_t cap = 1 << 20, len = 0;
    char *text = malloc(cap + 1);
    ssize_t got;
    while (text && len < cap && (got = recv(fd, text + len, cap - len, 0)) > 0)
        len += (size_t)got;
    close(fd);
    if (!text)
        return;
    text[len] = 0;
    double le[32], cnt[32], sum = 0, count = 0;
    int nb = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "moemesh:gateway_token_overhead_seconds", 38) != 0)
            continue;
        char *sp = strrchr(line, ' ');
        if (!sp)
            continue;
        double v = atof(sp + 1);
        char *l = strstr(line, "le=\"");
        if (strstr(line, "_bucket") && l && nb < 32) {
            le[nb] = strncmp(l + 4, "+Inf", 4) == 0 ? 1e9 : atof(l + 4);
            cnt[nb++] = v;
        } else if (strstr(line, "_sum")) {
            sum = v;
        } else if (strstr(line, "_count")) {
            count = v;
        }
    }
    free(text);
    if (count <= 0)
        return;
    double p50 = 0, p99 = 0;
    for (int i = nb - 1; i >= 0; i--) {
        if (cnt[i] >= 0.5 * count)
            p50 = le[i];
        if (cnt[i] >= 0.99 * count)
            p99 = le[i];
    }
    double top = nb >= 2 ? le[nb - 2] : 0; // the largest finite bound
    printf("gateway overhead per delivery (StepResult arrival -> socket write, gateway /metrics, "
           "all traffic so far): mean %.1f us, p50 %s %.0f us, p99 %s %.0f us (%.0f deliveries)\n",
           sum / count * 1e6, p50 >= 1e9 ? ">" : "<=", (p50 >= 1e9 ? top : p50) * 1e6,
           p99 >= 1e9 ? ">" : "<=", (p99 >= 1e9 ? top : p99) * 1e6, count);
}

static int run_bench(int argc, char **argv) {
    mm_cli cli = {.prog = "moemesh bench",
                  .summary = "Load the gateway with streaming completions and report TTFT, "
                             "inter-token latency, end-to-end latency (p50/p99) and output "
                             "tokens/s.",
                  .opts = s_opts};
    char err[MM_ERRLEN] = "";
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "moemesh bench: %s\n", err);
        return 2;
    }
    if (cli.help_shown)
        return 0;
    if (s_conc < 1 || s_conc > 4096 || s_reqs < 1 || s_prompt_tokens < 1 ||
        s_prompt_tokens > 8192 || s_max_tokens < 1 || s_max_tokens > 1000000 || s_vocab < 4) {
        fprintf(stderr, "moemesh bench: --concurrency 1..4096, --requests >= 1, --prompt-tokens "
                        "1..8192, --max-tokens >= 1 and --vocab >= 4 are required\n");
        return 2;
    }
    if (parse_url(s_url, err) != 0) {
        fprintf(stderr, "moemesh bench: %s\n", err);
        return 2;
    }
    B.res = calloc((size_t)s_reqs, sizeof(*B.res));
    int nt = (int)(s_conc < s_reqs ? s_conc : s_reqs);
    pthread_t *th = calloc((size_t)nt, sizeof(*th));
    if (!B.res || !th)
        return 1;
    uint64_t t0 = mm_now_ns();
    for (int i = 0; i < nt; i++)
        pthread_create(&th[i], NULL, worker, NULL);
    // Progress bar while the workers run.
    for (;;) {
        int d = atomic_load(&B.done);
        if (!s_quiet) {
            int w = 40, f = (int)((long long)d * w / s_reqs);
            fprintf(stderr, "\r[%.*s%.*s] %d/%lld requests, %.1f s", f,
                    "########################################", w - f,
                    "                                        ", d, s_reqs,
                    (double)(mm_now_ns() - t0) / 1e9);
        }
        if (d >= s_reqs)
            break;
        usleep(100000);
    }
    if (!s_quiet)
        fprintf(stderr, "\n");
    for (int i = 0; i < nt; i++)
        pthread_join(th[i], NULL);
    // up to the last request's end, not the progress loop's wake-up (it sleeps 100 ms: short
    // runs read up to 100 ms too long)
    uint64_t t1 = atomic_load(&B.last_ns);
    double wall = (double)((t1 > t0 ? t1 : mm_now_ns()) - t0) / 1e9;
    size_t n_ok = 0, n_itl = 0;
    long long tokens = 0;
    double *ttft = calloc((size_t)s_reqs, sizeof(double)), *e2e = calloc((size_t)s_reqs, 8);
    double *itl = calloc((size_t)s_reqs * ((size_t)s_max_tokens + 8), sizeof(double));
    const char *first_err = NULL;
    for (long long i = 0; i < s_reqs; i++) {
        struct result *r = &B.res[i];
        if (!r->ok) {
            if (!first_err)
                first_err = r->err;
            continue;
        }
        ttft[n_ok] = r->ttft_ms;
        e2e[n_ok++] = r->e2e_ms;
        tokens += r->n_tokens;
        for (int k = 0; k + 1 < r->n_events && k < (int)s_max_tokens + 8; k++)
            itl[n_itl++] = r->itl[k];
    }
    printf("moemesh bench: %s, concurrency %lld, %lld requests (%zu ok, %lld failed), prompt "
           "%lld tokens, %lld new tokens each\n", s_url, s_conc, s_reqs, n_ok, s_reqs - (long long)n_ok,
           s_prompt_tokens, s_max_tokens);
    if (first_err)
        printf("first error: %s\n", first_err);
    printf("TTFT ms:          p50 %8.2f  p99 %8.2f\n", pct(ttft, n_ok, 0.5), pct(ttft, n_ok, 0.99));
    printf("ITL ms:           p50 %8.2f  p99 %8.2f\n", pct(itl, n_itl, 0.5), pct(itl, n_itl, 0.99));
    printf("E2E ms:           p50 %8.2f  p99 %8.2f\n", pct(e2e, n_ok, 0.5), pct(e2e, n_ok, 0.99));
    printf("output tokens/s:  %.1f (%lld tokens in %.2f s), requests/s %.2f\n",
           (double)tokens / wall, tokens, wall, (double)n_ok / wall);
    metrics_overhead();
    for (long long i = 0; i < s_reqs; i++)
        free(B.res[i].itl);
    free(B.res);
    free(th);
    free(ttft);
    free(e2e);
    free(itl);
    return n_ok == (size_t)s_reqs ? 0 : 1;
}

MM_COMMAND(cmd_bench, "bench", "load the gateway with streaming completions: TTFT, ITL, tokens/s",
           run_bench)
