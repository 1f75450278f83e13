// SPDX-License-Identifier: MIT
// `moemesh bench-model`: prompt and decode speed of the in-process engine, and decode's share
// of the memory-bandwidth roofline: (weight bytes one decode token reads) x (tokens/s) divided
// by the bandwidth measured in the same run: on the CPU the read bandwidth of all threads
// streaming a large buffer; on a device (a backend with its own memory) the device's copy
// bandwidth (bytes read + written by its copy of a buffer larger than its caches).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cmd.h"
#include "mm/config.h"
#include "mm/engine.h"
#include "mm/kv_cache.h"
#include "mm/time.h"

// ---- bandwidth: every thread sums its slice of a buffer larger than any cache ---------------
struct bw_arg {
    const float *p;
    size_t n;
    float sum;
};

#if defined(__x86_64__)
__attribute__((target("avx2"))) static float sum_avx2(const float *p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float s = 0;
    for (int k = 0; k < 8; k++)
        s += t[k];
    return s;
}
#endif

static void *bw_thread(void *argp) {
    struct bw_arg *a = argp;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2")) {
        a->sum = sum_avx2(a->p, a->n);
        return NULL;
    }
#endif
    float s = 0;
    for (size_t i = 0; i < a->n; i++)
        s += a->p[i];
    a->sum = s;
    return NULL;
}

// read_bandwidth streams a bytes-long buffer with all threads for at least `seconds` and
// returns the sustained rate in bytes/s (the average over the whole time, so a machine that
// is busy now is measured as busy as the decode that follows). *memcpy_bw: one memcpy of the
// buffer, bytes copied per second.
static double read_bandwidth(float *buf, float *dst, size_t bytes, int threads, double seconds,
                             double *memcpy_bw) {
    const size_t n = bytes / 4, per = (n / (size_t)threads) & ~(size_t)31;
    double total = 0, t_all = 0;
    uint64_t start = mm_now_ns();
    do {
        pthread_t tid[64];
        struct bw_arg args[64];
        for (int t = 0; t < threads; t++) {
            args[t] = (struct bw_arg){buf + (size_t)t * per, per, 0};
            pthread_create(&tid[t], NULL, bw_thread, &args[t]);
        }
        for (int t = 0; t < threads; t++)
            pthread_join(tid[t], NULL);
        total += (double)per * threads * 4;
        t_all = (double)(mm_now_ns() - start) / 1e9;
    } while (t_all < seconds);
    uint64_t t0 = mm_now_ns();
    memcpy(dst, buf, bytes);
    *memcpy_bw = bytes / ((double)(mm_now_ns() - t0) / 1e9);
    return total / t_all;
}

// dev_copy_bandwidth: the device's copy rate (bytes read + written per second) over `seconds`
// (at least 8 copies, issued 4 at a time between waits so that the device does not idle
// between them) of bytes between a and b, both backend memory; 0 on a failed copy.
static double dev_copy_bandwidth(const mm_backend *be, void *a, void *b, size_t bytes,
                                 double seconds) {
    if (be->ops->copy(be->ctx, b, a, bytes) != MM_OK || be->ops->synchronize(be->ctx) != MM_OK)
        return 0; // (the first copy: warm-up)
    int n = 0;
    double t = 0;
    const uint64_t t0 = mm_now_ns();
    do {
        for (int i = 0; i < 4; i++, n++)
            if (be->ops->copy(be->ctx, n % 2 ? a : b, n % 2 ? b : a, bytes) != MM_OK)
                return 0;
        if (be->ops->synchronize(be->ctx) != MM_OK)
            return 0;
        t = (double)(mm_now_ns() - t0) / 1e9;
    } while (n < 8 || t < seconds);
    return 2.0 * (double)bytes * n / t;
}

// read_pass: one read of the whole buffer by all threads; returns seconds.
static double read_pass(const float *buf, size_t bytes, int threads) {
    const size_t n = bytes / 4, per = (n / (size_t)threads) & ~(size_t)31;
    pthread_t tid[64];
    struct bw_arg args[64];
    uint64_t t0 = mm_now_ns();
    for (int t = 0; t < threads; t++) {
        args[t] = (struct bw_arg){buf + (size_t)t * per, per, 0};
        pthread_create(&tid[t], NULL, bw_thread, &args[t]);
    }
    for (int t = 0; t < threads; t++)
        pthread_join(tid[t], NULL);
    return (double)(mm_now_ns() - t0) / 1e9;
}

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// batch_decode: `batch` sequences (a short prompt each) then `steps` decode steps in which
// every sequence adds one token, all in one forward pass per step (logits for every row).
// The fed ids are a fixed sequence (no sampling: reading batch x vocab logits back would time
// the copy, not the model); a step ends when the backend has finished it (synchronize).
static int batch_decode(mm_engine *e, long long batch, long long plen, long long steps,
                        char *err) {
    const mm_model_config *c = mm_model_cfg(e->model);
    int32_t seqs[256], pos[256], sq[256], ids[256];
    int n_seq = 0, rc = 1;
    float *last = malloc((size_t)c->vocab * 4);
    int32_t *pids = malloc((size_t)plen * 4);
    if (!last || !pids)
        goto out;
    for (long long i = 0; i < plen; i++)
        pids[i] = (int32_t)((i * 104729 + 7) % c->vocab);
    for (; n_seq < batch; n_seq++) {
        if (mm_kv_cache_seq_new(e->kv, &seqs[n_seq]) != MM_OK) {
            snprintf(err, MM_ERRLEN, "kv cache: no slot for sequence %d", n_seq);
            goto out;
        }
        pids[0] = (int32_t)(n_seq % c->vocab); // distinct prompts
        if (mm_engine_prefill(e, seqs[n_seq], pids, plen, NULL, last, err) != MM_OK) {
            n_seq++;
            goto out;
        }
    }
    double dt = 0;
    for (long long t = -2; t < steps; t++) { // two warm-up steps
        for (int i = 0; i < n_seq; i++) {
            pos[i] = mm_kv_cache_seq_len(e->kv, seqs[i]);
            sq[i] = seqs[i];
            ids[i] = (int32_t)((t * 7919 + i * 31 + 5 + 2 * 7919) % c->vocab);
            if (mm_kv_cache_reserve(e->kv, seqs[i], pos[i] + 1) != MM_OK) {
                snprintf(err, MM_ERRLEN, "kv cache: cannot grow sequence %d", i);
                goto out;
            }
        }
        mm_model_rows rows = {.n_rows = n_seq, .seq = sq, .pos = pos};
        uint64_t t0 = mm_now_ns();
        mm_err rv = mm_model_forward(e->model, e->scratch, e->kv, &rows, ids, NULL, e->logits);
        if (rv == MM_OK && e->be->ops->synchronize)
            rv = e->be->ops->synchronize(e->be->ctx);
        if (rv != MM_OK) {
            snprintf(err, MM_ERRLEN, "batch decode step failed: %s", mm_strerror(rv));
            goto out;
        }
        if (t >= 0)
            dt += (double)(mm_now_ns() - t0) / 1e9;
    }
    printf("batch %lld decode: %lld steps in %.3f s = %.2f ms/step, %.1f tokens/s (prompts of "
           "%lld tokens, logits of every row computed, no sampling)\n", batch, steps, dt,
           1e3 * dt / steps, batch * steps / dt, plen);
    // greedy: every row's pick fed back (mm_engine_decode_greedy: steps overlapped where the
    // backend can), two warm-up steps first
    int32_t *picks = malloc((size_t)(steps > 2 ? steps : 2) * (size_t)n_seq * 4);
    int done = 0;
    if (!picks)
        goto out;
    for (int i = 0; i < n_seq; i++)
        ids[i] = (int32_t)((i * 31 + 11) % c->vocab);
    if (mm_engine_decode_greedy(e, seqs, n_seq, ids, 2, -1, picks, &done, err) != MM_OK) {
        free(picks);
        goto out;
    }
    uint64_t t1 = mm_now_ns();
    mm_err grv = mm_engine_decode_greedy(e, seqs, n_seq, picks + n_seq, (int)steps, -1, picks,
                                         &done, err);
    const double gt = (double)(mm_now_ns() - t1) / 1e9;
    free(picks);
    if (grv != MM_OK)
        goto out;
    printf("batch %lld greedy decode: %lld steps in %.3f s = %.2f ms/step, %.1f tokens/s (each "
           "row's pick fed back, next step issued before the picks are read: %s)\n", batch,
           steps, gt, 1e3 * gt / steps, batch * steps / gt,
           mm_engine_overlaps(e) ? "yes" : "no");
    rc = 0;
out:
    for (int i = 0; i < n_seq; i++)
        mm_kv_cache_seq_free(e->kv, seqs[i]);
    free(last);
    free(pids);
    return rc;
}

// greedy_run: n greedy decode steps of sequence seq from *tok (mm_engine_decode_greedy, steps
// overlapped where the backend can); *tok becomes the last pick. 0 on success.
static int greedy_run(mm_engine *e, int32_t seq, int32_t *tok, long long n, int32_t *picks,
                      char *err) {
    int done = 0;
    if (mm_engine_decode_greedy(e, &seq, 1, tok, (int)n, -1, picks, &done, err) != MM_OK)
        return 1;
    *tok = picks[n - 1];
    return 0;
}

static int run_bench_model(int argc, char **argv) {
    char *model = NULL, *device = NULL;
    long long threads = 0, prompt = 128, decode = 32, bw_mb = 1024, warm = 4, rounds = 3;
    long long batch = 1, prefill_rows = 128, prompt_rounds = 1, dev_copy_mb = 2048;
    double bw_seconds = 2.0;
    bool paired = true;
    char *paired_s = NULL;
    mm_opt opts[] = {
        {"model", MM_OPT_STR, &model, NULL, "checkpoint directory"},
        {"prompt-tokens", MM_OPT_INT, &prompt, "128", "prompt length for the prefill figure"},
        {"prefill-rows", MM_OPT_INT, &prefill_rows, "128",
         "rows per forward call in the prompt (the engine's max_rows, 1..8192)"},
        {"prompt-rounds", MM_OPT_INT, &prompt_rounds, "1",
         "time the prompt this many times (each a new sequence; the first also builds caches)"},
        {"decode-tokens", MM_OPT_INT, &decode, "32", "tokens to decode for the decode figure"},
        {"warmup-tokens", MM_OPT_INT, &warm, "4", "decode steps before timing (pages in)"},
        {"paired", MM_OPT_STR, &paired_s, "auto",
         "true: alternate each decode token with one host bandwidth pass; false: bw-seconds "
         "first, then the tokens back to back; auto: true on cpu, false on a GPU (the host "
         "pass is not the GPU's roofline and only delays the next step's launch)"},
        {"bw-seconds", MM_OPT_DBL, &bw_seconds, "2", "unpaired: bandwidth time per round"},
        {"rounds", MM_OPT_INT, &rounds, "3", "decode rounds (each with a bandwidth pass)"},
        {"threads", MM_OPT_INT, &threads, "0", "CPU threads (0: all cores)"},
        {"bw-mb", MM_OPT_INT, &bw_mb, "1024", "buffer for the host bandwidth measurement (MiB)"},
        {"dev-copy-mb", MM_OPT_INT, &dev_copy_mb, "2048",
         "a device: each of the two buffers its copy bandwidth (the roofline) is measured "
         "with (MiB; at least 64)"},
        {"device", MM_OPT_STR, &device, "cpu", "cpu, cuda:N or hip:N (cpu-dev: tests)"},
        {"batch", MM_OPT_INT, &batch, "1",
         "also decode this many sequences together (2..128: one forward pass per step)"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh bench-model",
                  .summary = "Prompt and decode tokens/s, and decode's share of the memory "
                             "roofline.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    mm_engine *e = NULL;
    int32_t *ids = NULL, *picks = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "bench-model: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    if (!model || prompt < 1 || decode < 1 || bw_mb < 64 || rounds < 1 || rounds > 64 ||
        batch < 1 || batch > 128 || dev_copy_mb < 64 || dev_copy_mb > (1 << 20)) {
        fprintf(stderr, "bench-model: --model DIR is required (--rounds 1..64, --batch 1..128, "
                "--bw-mb >= 64, --dev-copy-mb 64..1048576)\n");
        goto done;
    }
    if (!strcasecmp(paired_s, "auto"))
        paired = strcmp(device, "cpu") == 0;
    else if (!mm_parse_bool(paired_s, &paired)) {
        fprintf(stderr, "bench-model: --paired takes a value, true, false or auto (got '%s')\n",
                paired_s);
        goto done;
    }
    if (prefill_rows < 1 || prefill_rows > 8192 || prefill_rows < batch || prompt_rounds < 1 ||
        prompt_rounds > 64) {
        fprintf(stderr, "bench-model: --prefill-rows must be 1..8192 and >= --batch (%lld), "
                "--prompt-rounds 1..64\n", batch);
        goto done;
    }
    rc = 1;
    mm_engine_params ep = {.device = device, .n_threads = (int)threads,
                           .max_seqs = batch > 1 ? (int)batch + 1 : 2,
                           .max_ctx = (int)(prompt + decode * (rounds + 1) + warm + 8),
                           .max_rows = prefill_rows};
    uint64_t t0 = mm_now_ns();
    if (mm_engine_open(&e, model, &ep, err) != MM_OK) {
        fprintf(stderr, "bench-model: %s\n", err);
        goto done;
    }
    const mm_model_config *c = mm_model_cfg(e->model);
    printf("model %s: %s, %d layers, d_model %d, %d experts top-%d, vocab %d; %d threads; "
           "open %.2f s\n", model, c->model_type, c->n_layers, c->d_model, c->n_experts,
           c->top_k, c->vocab, e->be->n_threads, (double)(mm_now_ns() - t0) / 1e9);
    const mm_kv_params *kvp = mm_kv_cache_params(e->kv);
    printf("kv cache: %s, %zu bytes per token, %d blocks of %d tokens\n",
           mm_dtype_name(kvp->dtype), mm_kv_token_bytes(kvp), mm_kv_cache_blocks_total(e->kv),
           kvp->block_size);
    ids = malloc((size_t)(prompt + decode + warm) * sizeof(int32_t));
    picks = malloc((size_t)decode * sizeof(int32_t));
    float *last = malloc((size_t)c->vocab * 4);
    if (!ids || !last || !picks) {
        free(last);
        goto done;
    }
    for (long long i = 0; i < prompt + decode + warm; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % c->vocab);
    t0 = mm_now_ns();
    unsigned ck = mm_model_touch(e->model);
    printf("paged in all weights in %.2f s (checksum %u)\n", (double)(mm_now_ns() - t0) / 1e9,
           ck);
    // warm-up: a short sequence that touches attention, head and (some) experts
    int32_t s;
    mm_kv_cache_seq_new(e->kv, &s);
    int32_t tok = 0;
    for (long long i = 0; i < warm; i++)
        if (mm_engine_prefill_greedy(e, s, ids + i, 1, &tok, err) != MM_OK)
            goto fail;
    mm_kv_cache_seq_free(e->kv, s);
    // prompt (rounds > 1: each a new sequence; the figure is the best, the first also builds
    // caches such as the GPU's permuted weights)
    double pt = 0;
    for (long long r = 0; r < prompt_rounds; r++) {
        if (r > 0)
            mm_kv_cache_seq_free(e->kv, s);
        mm_kv_cache_seq_new(e->kv, &s);
        t0 = mm_now_ns();
        if (mm_engine_prefill(e, s, ids, prompt, NULL, last, err) != MM_OK)
            goto fail;
        const double t = (double)(mm_now_ns() - t0) / 1e9;
        if (prompt_rounds > 1)
            printf("prompt round %lld: %lld tokens in %.4f s = %.1f tok/s (%lld rows per forward)\n",
                   r + 1, prompt, t, prompt / t, prefill_rows);
        if (r == 0 || t < pt)
            pt = t;
    }
    // decode (greedy), in rounds; each round also measures the read bandwidth right before,
    // so a busy machine shows up in both figures. The best round of each is reported.
    tok = mm_engine_argmax(last, c->vocab);
    double best_dtps = 0, best_bw = 0, best_cp = 0;
    const double bytes = mm_model_decode_bytes(e->model);
    printf("prompt: %lld tokens in %.3f s = %.1f tok/s\n", prompt, pt, prompt / pt);
    printf("weights read per decode token: %.1f MB\n", bytes / 1e6);
    printf("decode steps overlapped (each issued before the previous pick is read): %s\n",
           mm_engine_overlaps(e) && !paired ? "yes" : "no");
    // a device: its copy bandwidth is the roofline (the host's is not what its steps read at)
    const mm_backend *be = e->be;
    void *dva = NULL, *dvb = NULL;
    size_t dvn = (size_t)dev_copy_mb << 20;
    const bool dev = !be->ops->host_memory && be->ops->copy && be->ops->buffer_alloc &&
                     be->ops->synchronize;
    while (dev && dvn >= ((size_t)64 << 20)) {
        if (be->ops->buffer_alloc(be->ctx, dvn, &dva) == MM_OK) {
            if (be->ops->buffer_alloc(be->ctx, dvn, &dvb) == MM_OK)
                break;
            be->ops->buffer_free(be->ctx, dva);
            dva = NULL;
        }
        dvn /= 2; // less device memory free than asked: a smaller buffer
    }
    if (dev && !dvb)
        fprintf(stderr, "bench-model: no device memory for the copy bandwidth buffers; the "
                "host's read bandwidth stands in\n");
    if (dvb)
        printf("roofline: the device's copy bandwidth (bytes read + written, two buffers of %zu "
               "MiB), measured before each round\n", dvn >> 20);
    // the host buffer: the host's roofline, or the paired read passes
    float *bwbuf = NULL, *bwdst = NULL;
    const size_t bwb = !dvb || paired ? (size_t)bw_mb << 20 : 0;
    if (bwb > 0) {
        if (posix_memalign((void **)&bwbuf, 64, bwb) || posix_memalign((void **)&bwdst, 64, bwb)) {
            fprintf(stderr, "bench-model: no memory for the bandwidth buffer\n");
            free(bwbuf);
            if (dvb)
                be->ops->buffer_free(be->ctx, dva), be->ops->buffer_free(be->ctx, dvb);
            goto fail;
        }
        for (size_t i = 0; i < bwb / 4; i++)
            bwbuf[i] = (float)(i & 1023);
        memset(bwdst, 0, bwb);
    }
    double fr[64];
    int n_fr = 0;
    for (long long r = 0; r < rounds; r++) {
        double cp_bw = 0, bw = 0;
        if (dvb)
            bw = dev_copy_bandwidth(be, dva, dvb, dvn, bw_seconds);
        else if (!paired)
            bw = read_bandwidth(bwbuf, bwdst, bwb, e->be->n_threads, bw_seconds, &cp_bw);
        if (mm_kv_cache_seq_len(e->kv, s) + decode > e->max_ctx) {
            mm_kv_cache_seq_free(e->kv, s); // start over: the same context length each round
            mm_kv_cache_seq_new(e->kv, &s);
            if (mm_engine_prefill(e, s, ids, prompt, NULL, last, err) != MM_OK)
                goto fail;
            tok = mm_engine_argmax(last, c->vocab);
        }
        // paired (default): each decode token is followed by one read pass over the buffer,
        // so decode and bandwidth are sampled alternately under the same load
        double dt = 0, bw_t = 0, bw_bytes = 0;
        if (!paired) { // the tokens back to back: each step issued before the last one's pick
                       // is read where the backend can (mm_engine_decode_greedy)
            t0 = mm_now_ns();
            if (greedy_run(e, s, &tok, decode, picks, err) != 0)
                goto fail;
            dt = (double)(mm_now_ns() - t0) / 1e9;
        }
        for (long long i = 0; paired && i < decode; i++) {
            t0 = mm_now_ns();
            // greedy: the backend picks the token when it can (one id read back per step)
            if (mm_engine_prefill_greedy(e, s, &tok, 1, &tok, err) != MM_OK)
                goto fail;
            dt += (double)(mm_now_ns() - t0) / 1e9;
            bw_t += read_pass(bwbuf, bwb, e->be->n_threads);
            bw_bytes += (double)(((bwb / 4) / (size_t)e->be->n_threads) & ~(size_t)31) *
                        e->be->n_threads * 4;
        }
        if (paired && !dvb)
            bw = bw_bytes / bw_t;
        double dtps = decode / dt;
        if (dvb)
            printf("round %lld: device copy bandwidth %.1f GB/s; decode %lld tokens %.2f tok/s "
                   "(%.3f ms/token) = %.1f%% of it\n", r + 1, bw / 1e9, decode, dtps,
                   1e3 / dtps, 100.0 * dtps * bytes / bw);
        else
            printf("round %lld: read bandwidth %.2f GB/s%s; decode %lld tokens %.2f tok/s (%.1f "
                   "ms/token) = %.1f%% of that round's roofline\n", r + 1, bw / 1e9,
                   paired ? " (paired)" : "", decode, dtps, 1e3 / dtps, 100.0 * dtps * bytes / bw);
        if (n_fr < 64)
            fr[n_fr++] = dtps * bytes / bw;
        best_dtps = dtps > best_dtps ? dtps : best_dtps;
        best_bw = bw > best_bw ? bw : best_bw;
        best_cp = cp_bw > best_cp ? cp_bw : best_cp;
    }
    free(bwbuf);
    free(bwdst);
    if (dvb)
        be->ops->buffer_free(be->ctx, dva), be->ops->buffer_free(be->ctx, dvb);
    free(last);
    last = NULL;
    qsort(fr, (size_t)n_fr, sizeof(double), cmp_dbl);
    printf("decode share of the same round's %s: median %.1f%% (min %.1f%%, max %.1f%%) over %d "
           "rounds\n", dvb ? "device copy bandwidth" : "sustained bandwidth", 100 * fr[n_fr / 2],
           100 * fr[0], 100 * fr[n_fr - 1], n_fr);
    printf("decode: best %.2f tok/s (%.1f ms/token)\n", best_dtps, 1e3 / best_dtps);
    if (dvb) {
        printf("device copy bandwidth: best %.1f GB/s\n", best_bw / 1e9);
    } else {
        printf("memory read bandwidth (%d threads, %lld MiB buffer): best %.2f GB/s",
               e->be->n_threads, bw_mb, best_bw / 1e9);
        if (!paired)
            printf("; memcpy %.2f GB/s", best_cp / 1e9);
        printf("\n");
    }
    printf("decode roofline at the best bandwidth: %.2f tok/s; best decode %.1f%% of it (%.2f "
           "GB/s of weights)\n", best_bw / bytes, 100.0 * best_dtps * bytes / best_bw,
           best_dtps * bytes / 1e9);
    // a device backend replays recorded steps (graphs): one more round op by op shows what
    // the recording saves (launch cost)
    if (mm_model_scratch_graphs(e->scratch, false)) {
        mm_kv_cache_seq_free(e->kv, s);
        mm_kv_cache_seq_new(e->kv, &s);
        if (mm_engine_prefill_greedy(e, s, ids, prompt, &tok, err) != MM_OK)
            goto fail;
        t0 = mm_now_ns();
        if (greedy_run(e, s, &tok, decode, picks, err) != 0)
            goto fail;
        const double dt = (double)(mm_now_ns() - t0) / 1e9;
        mm_model_scratch_graphs(e->scratch, true);
        printf("decode op by op (no graph replay): %.2f tok/s (%.1f ms/token)\n", decode / dt,
               1e3 * dt / decode);
    }
    if (batch > 1) {
        mm_kv_cache_seq_free(e->kv, s);
        if (batch_decode(e, batch, prompt < 32 ? prompt : 32, decode, err) != 0)
            goto fail;
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "bench-model: %s\n", err);
    free(last);
done:
    free(ids);
    free(picks);
    mm_engine_close(e);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_bench_model, "bench-model", "prompt/decode tok/s and decode roofline fraction",
           run_bench_model)
