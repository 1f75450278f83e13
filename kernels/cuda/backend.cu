// SPDX-License-Identifier: MIT
// The GPU backend table (kernels.h) for CUDA and, compiled by hipcc, for HIP: device buffers,
// copies, and every op on one stream of one device. mm_backend_open("cuda:N" / "hip:N")
// reaches mm_cuda_backend_open through a weak symbol, so CPU-only builds simply lack it.
//
// Design notes:
// - One context per backend: the device index, one non-blocking stream that orders every op,
//   and a device error word that kernels set on bad indices (ops.cu). Ops only enqueue;
//   `synchronize` and `get` wait, then turn a set error word into MM_EINVAL (logged once).
// - Threading: as kernels.h says, one thread issues ops on a backend at a time. Each entry
//   point selects the backend's device first, so backends on different devices can share a
//   process.
// - Nothing is allocated per op; buffers come only from buffer_alloc (cudaMalloc, 256-byte
//   aligned, which covers the table's 64-byte promise).
// - Small host-to-device copies (`set` of at most STAGE_MAX bytes, the grouped product's
//   expert table) go through a pinned ring (STAGE_BYTES in STAGE_PARTS parts): memcpy into the
//   ring, then a true async DMA. Entering a part waits for the event recorded when that part
//   was last left (the copies out of it have run), so the caller may reuse src at once and the
//   wait is rare (a part holds thousands of decode-step copies). Larger copies go straight from
//   the caller's (pageable) memory as before.
// - Device-to-host copies (`get`) of GET_PINNED_MIN..GET_PINNED_BYTES bytes (a prefill's last
//   logits row: 608 KB for a 151936-word vocabulary) land in a pinned buffer by DMA, then one
//   memcpy into the caller's memory after the drain `get` does anyway: a copy straight into
//   pageable memory goes through the driver's own staging in pieces (~190-220 us for 608 KB on
//   the H200 machine, MM_GPU_OPTIME). Env MM_GPU_GET_PINNED=0: the direct copy (A/B). The same
//   bytes either way.
// - `fetch` (a result read without draining the stream, so the caller can issue its next
//   step first): one small launch (mm_gpu_fetch_copy, a programmatic dependent of the kernel
//   before it) writes the bytes and the error word into a pinned slot, then an event marks
//   the slot; fetch_wait polls that event alone (MM_GPU_DRAIN_TIMEOUT_MS as every drain).
//   MM_GPU_FETCH_COPY=1: two async copies instead of the launch (A/B). The error word is left
//   set for get/synchronize to report and clear (only a drained stream can clear it without
//   losing a later op's report).
// - Graphs (capture_begin/end, graph_launch): the stream is recorded in thread-local capture
//   mode; set/get/synchronize are refused while recording (they would record host addresses
//   or wait for work that does not run).
// - Per-op timer (env MM_GPU_OPTIME=1, a profile without nsys): every table op is bracketed
//   by a pair of events on the stream; the backend then offers no graphs (so the model issues
//   op by op). Pairs are read when the pool fills, at each get and at close, and summed per
//   op name (products per weight shape) and per step class (a step starts at `embed`; its
//   class is embed's row count, so prefill and decode are apart; embed_rmsnorm, the fused
//   form the chain issues, starts a step too). The table goes to stderr at close, or through
//   mm_gpu_optime_report. An op's time runs from the end of the op before it to its own end
//   on the GPU, so it includes the launch gap in front of it.
//   MM_GPU_OPTIME=2 also holds the stream for 4 ms at the start of every step (a host function
//   enqueued before embed or embed_rmsnorm), so the host has issued the whole step before the
//   GPU starts it:
//   the times are then the GPU's own (kernel plus its launch on the device), without the host
//   gaps of op-by-op issue that =1 includes (tokens/s in that mode mean nothing).
//   MM_GPU_OPTIME_SKIP=N leaves each step class's first N steps out of the table (the first
//   forward of a shape builds caches and loads modules: warm figures only).
//   MM_GPU_OPTIME_SPLIT=1 gives each call of a name within a step its own row ("#n": the
//   n-th call, so per layer for the per-layer ops). MM_GPU_PDL=0 launches the GEMVs without
//   programmatic dependent launch (process-wide; A/B of the early launch). The step's small
//   ops (norms, attention, routing, combine, ...) launch as programmatic dependents that wait
//   at their start (mm_gpu_set_dep_launch; same results); MM_GPU_PDL_ALL=0 launches them
//   plainly, as MM_GPU_OLD_DECODE=1 does (H200, 00:10 UTC: op by op 1550 tok/s vs 1442).
//   MM_GPU_GEMV_WPT=4 caps the warps per 16-row GEMV tile (fewer, longer blocks; same bits).
//   MM_GPU_OLD_DECODE=1 runs the earlier argmax (one block per row), rmsnorm (a warp per row)
//   and attention load grouping, and no early launch of the products (process-wide), for
//   before/after figures in one run (same results).
//   MM_GPU_OLD_CHAIN=1 leaves out the per-layer chain fusions (head_norm_rope_kv,
//   route_with_plan, combine_rmsnorm, embed_rmsnorm: the model then issues the two ops each
//   stands for);
//   MM_GPU_OLD_DECODE and MM_GPU_OLD_FUSIONS leave them out too. The first recorded graph's
//   node, edge and programmatic-edge counts are logged (info) once per backend.
//   MM_GPU_ATT_WIDE=1: decode attention loads a key and a chunk's values in one round each
//   (mm_gpu_set_attention_wide; same bits; off: 23.9 vs 29.2 us per call by ncu, but the
//   whole-model decode no faster, H200 2026-11-30).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_common.cuh"
#include "kernels.h"
#include "mm_gpu.h"

// Grouped expert products copy their expert pointer table and row offsets to the device in
// one copy per call, into one of MOE_SLOTS staging slots used in turn (a slot is rewritten
// only after the stream has run the launches that read it: copies and launches share the
// stream). The host staging is pageable memory, so the runtime has read it when the copy
// returns (see gpu_set) and it can be rewritten at once.
#define MOE_SLOTS 8
#define STAGE_BYTES (1u << 20)
#define STAGE_PARTS 4
#define STAGE_MAX (64u << 10)
#define GET_PINNED_MIN (64u << 10)
#define GET_PINNED_BYTES (8u << 20)
#define AMAX_ROWS 1024 // argmax workspace rows (more rows run in several launches)

#define OT_POOL 2048  // event pairs between two reads
#define OT_KEYS 192   // op names (products by weight shape; with MM_GPU_OPTIME_SPLIT, by call)
#define OT_CLASSES 6  // step classes (embed row counts); the last takes the rest
#define OT_NAME 48

struct optime {
    cudaEvent_t ev[2 * OT_POOL];
    int key[OT_POOL], cls[OT_POOL]; // of each recorded pair
    int used;                       // pairs recorded since the last read
    int n_keys;
    char name[OT_KEYS][OT_NAME];
    double us[OT_CLASSES][OT_KEYS];
    long calls[OT_CLASSES][OT_KEYS];
    long steps[OT_CLASSES];
    int64_t rows[OT_CLASSES]; // embed rows of the class; -1: unused; class 0: outside steps
    int cur;                  // class of the ops issued now
    int hold_ms;              // MM_GPU_OPTIME=2: each step waits this long on the GPU first
    bool split;               // MM_GPU_OPTIME_SPLIT=1: the n-th call of a name in a step is
                              // its own row ("name #n", e.g. one per layer)
    int n_base;               // names seen, for split
    char base[OT_KEYS][OT_NAME];
    int occ[OT_KEYS];         // calls of each base name in the current step
    int skip;                 // MM_GPU_OPTIME_SKIP=N: each class's first N steps are not counted
    long seen[OT_CLASSES];    // steps begun per class, counted or not
};

struct gpu_ctx {
    int dev;
    cudaStream_t stream;
    bool lost; // a drain timed out: the stream is blocked for good (mm__gpu_drain)
    int *d_err; // device word: bit 1 = an op met a bad index
    // moe_matmul staging: slot = moe_cap pointers then moe_cap + 1 int32 offsets
    int moe_cap;         // experts a slot holds (0: not allocated yet)
    size_t moe_slot;     // bytes per slot (multiple of 256)
    int moe_next;        // next slot to use
    char *d_moe, *h_moe; // MOE_SLOTS slots on the device; one slot on the host
    // pinned staging ring for small copies (NULL: pinned memory unavailable, copy directly)
    char *h_stage;
    char *h_get; // pinned landing buffer of `get` (GET_PINNED_BYTES; NULL: copy directly)
    int stage_part;                     // the part in use
    size_t stage_off;                   // next free byte inside it
    cudaEvent_t stage_ev[STAGE_PARTS];  // recorded when the part was left
    bool stage_live[STAGE_PARTS];       // its event has been recorded
    bool capturing;                     // between capture_begin and capture_end
    unsigned long long cap_epoch;       // mm_gpu_wperm_epoch at capture_begin
    bool graph_told;                    // graph_tell has logged a recorded graph
    struct optime *ot;                  // per-op timer (MM_GPU_OPTIME=1), else NULL
    struct mm_backend_ops ops_table;    // gpu_ops less what the env turns off (graphs when ot
                                        // is on; the fused ops with MM_GPU_OLD_DECODE or
                                        // MM_GPU_OLD_FUSIONS)
    // argmax workspace: per row a 64-bit (value, id) key and an arrival count, zero between
    // launches (each launch's last block clears its rows)
    void *d_amax;
    unsigned *d_count; // route_with_plan's arrival count (zero between launches)
    // fetch slots: pinned, MM_FETCH_SLOTS x FETCH_STRIDE bytes (the result, then the error
    // word at MM_FETCH_BYTES); ticket t lives in slot t % MM_FETCH_SLOTS
    char *h_fetch;
    cudaEvent_t fetch_ev[MM_FETCH_SLOTS];
    uint64_t fetch_ticket[MM_FETCH_SLOTS]; // the slot's outstanding ticket, 0: free
    size_t fetch_n[MM_FETCH_SLOTS];
    uint64_t fetch_next;                   // the next ticket (from 1)
    bool fetch_copy; // MM_GPU_FETCH_COPY=1: two async copies instead of the one launch (A/B)
    bool old_kernels; // MM_GPU_OLD_DECODE=1: the earlier argmax/rmsnorm/attention (A/B runs)
};

// ---- per-op timer ------------------------------------------------------------------------------
static void ot_read(struct gpu_ctx *g) {
    struct optime *t = g->ot;
    if (t == NULL || t->used == 0)
        return;
    if (cudaEventSynchronize(t->ev[2 * t->used - 1]) != cudaSuccess) {
        (void)cudaGetLastError();
        t->used = 0;
        return;
    }
    for (int i = 0; i < t->used; i++) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, t->ev[2 * i], t->ev[2 * i + 1]) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
        }
        t->us[t->cls[i]][t->key[i]] += 1e3 * (double)ms;
        t->calls[t->cls[i]][t->key[i]]++;
    }
    t->used = 0;
}

static void ot_begin(struct gpu_ctx *g) {
    struct optime *t = g->ot;
    if (t == NULL)
        return;
    if (t->used == OT_POOL)
        ot_read(g);
    (void)cudaEventRecord(t->ev[2 * t->used], g->stream);
}

static void ot_end(struct gpu_ctx *g, const char *name) {
    struct optime *t = g->ot;
    if (t == NULL || t->cur < 0) // a skipped step: its pair is not kept (the slot is reused)
        return;
    char full[OT_NAME];
    if (t->split && t->cur != 0) { // per call within a step (not the load's many sets)
        int b = 0;
        while (b < t->n_base && strcmp(t->base[b], name) != 0)
            b++;
        if (b == t->n_base && t->n_base < OT_KEYS) {
            snprintf(t->base[b], OT_NAME, "%s", name);
            t->occ[b] = 0;
            t->n_base++;
        }
        if (b < t->n_base) {
            snprintf(full, OT_NAME, "%.40s #%d", name, ++t->occ[b]);
            name = full;
        }
    }
    int k = 0;
    while (k < t->n_keys && strcmp(t->name[k], name) != 0)
        k++;
    if (k == t->n_keys) {
        if (t->n_keys < OT_KEYS) {
            snprintf(t->name[k], OT_NAME, "%s", name);
            t->n_keys++;
        } else {
            k = OT_KEYS - 1; // "other"
            snprintf(t->name[k], OT_NAME, "%s", "(other ops)");
        }
    }
    (void)cudaEventRecord(t->ev[2 * t->used + 1], g->stream);
    t->key[t->used] = k;
    t->cls[t->used] = t->cur;
    t->used++;
}

// A step begins: its ops count in the class of n_rows.
static void ot_step(struct gpu_ctx *g, int64_t n_rows) {
    struct optime *t = g->ot;
    if (t == NULL)
        return;
    int c = 1;
    while (c < OT_CLASSES - 1 && t->rows[c] >= 0 && t->rows[c] != n_rows)
        c++;
    if (t->rows[c] < 0)
        t->rows[c] = n_rows;
    else if (t->rows[c] != n_rows)
        t->rows[c] = -2; // the last class: every other row count
    t->seen[c]++;
    t->cur = t->seen[c] <= t->skip ? -1 : c;
    if (t->cur == c)
        t->steps[c]++;
    for (int b = 0; b < t->n_base; b++)
        t->occ[b] = 0;
    if (t->hold_ms > 0) // the host issues the whole step while the GPU waits: no host gaps
        (void)mm_gpu_stream_hold(g->stream, t->hold_ms);
}

static void ot_print(struct gpu_ctx *g) {
    struct optime *t = g->ot;
    for (int c = 0; c < OT_CLASSES; c++) {
        double tot = 0.0;
        long n_calls = 0;
        for (int k = 0; k < t->n_keys; k++)
            tot += t->us[c][k], n_calls += t->calls[c][k];
        if (n_calls == 0)
            continue;
        const double steps = c == 0 || t->steps[c] == 0 ? 1.0 : (double)t->steps[c];
        if (c == 0)
            fprintf(stderr, "gpu optime %s:%d: ops outside steps (before the first embed or "
                    "embed_rmsnorm), %.1f us in all\n", MM_GPU_VENDOR, g->dev, tot);
        else if (t->rows[c] == -2)
            fprintf(stderr, "gpu optime %s:%d: %ld steps of other row counts, %.1f us of op "
                    "time per step\n", MM_GPU_VENDOR, g->dev, t->steps[c], tot / steps);
        else
            fprintf(stderr, "gpu optime %s:%d: %ld steps of %lld row(s), %.1f us of op time "
                    "per step\n", MM_GPU_VENDOR, g->dev, t->steps[c], (long long)t->rows[c],
                    tot / steps);
        fprintf(stderr, "  %-32s %10s %9s %9s %6s\n", "op", "calls/step", "us/call", "us/step",
                "share");
        bool done[OT_KEYS] = {false};
        for (;;) { // by time, largest first
            int b = -1;
            for (int k = 0; k < t->n_keys; k++)
                if (!done[k] && t->calls[c][k] > 0 && (b < 0 || t->us[c][k] > t->us[c][b]))
                    b = k;
            if (b < 0)
                break;
            done[b] = true;
            fprintf(stderr, "  %-32s %10.2f %9.2f %9.1f %5.1f%%\n", t->name[b],
                    (double)t->calls[c][b] / steps, t->us[c][b] / (double)t->calls[c][b],
                    t->us[c][b] / steps, tot > 0 ? 100.0 * t->us[c][b] / tot : 0.0);
        }
    }
}

static void ot_reset(struct optime *t) {
    memset(t->us, 0, sizeof(t->us));
    memset(t->calls, 0, sizeof(t->calls));
    memset(t->steps, 0, sizeof(t->steps));
    memset(t->seen, 0, sizeof(t->seen));
    for (int c = 0; c < OT_CLASSES; c++)
        t->rows[c] = -1;
    t->rows[0] = 0;
    t->cur = 0;
}

static void ot_close(struct gpu_ctx *g) {
    struct optime *t = g->ot;
    if (t == NULL)
        return;
    ot_read(g);
    ot_print(g);
    for (int i = 0; i < 2 * OT_POOL; i++)
        if (t->ev[i] != NULL)
            (void)cudaEventDestroy(t->ev[i]);
    free(t);
    g->ot = NULL;
}

static bool ot_open(struct gpu_ctx *g) {
    struct optime *t = (struct optime *)calloc(1, sizeof(*t));
    if (t == NULL)
        return false;
    for (int i = 0; i < 2 * OT_POOL; i++)
        if (cudaEventCreate(&t->ev[i]) != cudaSuccess) {
            (void)cudaGetLastError();
            for (int j = 0; j < i; j++)
                (void)cudaEventDestroy(t->ev[j]);
            free(t);
            return false;
        }
    ot_reset(t);
    g->ot = t;
    return true;
}

// Brackets one op: TIMED("name", expression returning mm_err).
#ifdef MM_GPU_DIAG_SKIP
// Diagnostic builds only (`make cuda GPU_EXTRA=-DMM_GPU_DIAG_SKIP`, never a product build): the
// environment's MM_GPU_DIAG_SKIP=name,name,... drops the ops of those per-op timer names
// ("attention", "matmul 5120x2048", "moe_ffn_rows", ...) from every step, so that a benchmark
// shows each op's marginal cost inside the recorded step. The results are wrong.
// MM_GPU_DIAG_TWICE=name,... issues those ops twice instead (for ops that cannot be dropped
// without changing the step's work, such as routing, whose plan sizes the expert products:
// issued twice, an idempotent op's second issue is its cost in the chain).
static bool diag_listed(const char *var, const char *name) {
    const char *s = getenv(var);
    if (s == NULL || name == NULL || name[0] == 0)
        return false;
    const size_t n = strlen(name);
    for (const char *p = s; (p = strstr(p, name)) != NULL; p += n)
        if ((p == s || p[-1] == ',') && (p[n] == 0 || p[n] == ','))
            return true;
    return false;
}
static bool diag_skip(const char *name) { return diag_listed("MM_GPU_DIAG_SKIP", name); }
static bool diag_twice(const char *name) { return diag_listed("MM_GPU_DIAG_TWICE", name); }
#define OT_NAMES(g) true
#else
#define diag_skip(name) false
#define diag_twice(name) false
#define OT_NAMES(g) ((g)->ot != NULL)
#endif

#define TIMED(name, call)                                                                  \
    do {                                                                                   \
        if (diag_skip(name))                                                               \
            return MM_OK;                                                                  \
        if (diag_twice(name))                                                              \
            (void)(call);                                                                  \
        ot_begin(g);                                                                       \
        const mm_err rv_ = (call);                                                         \
        ot_end(g, (name));                                                                 \
        return rv_;                                                                        \
    } while (0)

static const char *shape_name(char buf[OT_NAME], const char *op, int64_t rows, int64_t cols) {
    snprintf(buf, OT_NAME, "%s %lldx%lld", op, (long long)rows, (long long)cols);
    return buf;
}

// The earlier decode kernels, kept for A/B runs (ops.cu; same results).
extern "C" mm_err mm_gpu_rmsnorm_warp(void *stream, const mm_weight *w, float eps, const float *x,
                                      int64_t xs, float *y, int64_t ys, int64_t n_rows);
extern "C" mm_err mm_gpu_attention_ref(void *stream, const struct mm_attn_args *a, int *d_err);

#define CTX(c) struct gpu_ctx *g = (struct gpu_ctx *)(c)
#define ON_DEVICE() MM_GPU_CHECK(cudaSetDevice(g->dev))

// bad_index: an op met an index out of range (the device error word was set): logged, MM_EINVAL.
static mm_err bad_index(void) {
    mm_log_error("gpu: an op met an index out of range (KV position/block, embedding id or row "
                 "index); the rows concerned were skipped");
    return MM_EINVAL;
}

static mm_err check_err_word(struct gpu_ctx *g) {
    if (g->lost) {
        mm_log_error("gpu: device context lost after a drain timed out; restart the process");
        return MM_EDEVICE;
    }
    int h = 0;
    MM_GPU_CHECK(cudaMemcpyAsync(&h, g->d_err, sizeof(int), cudaMemcpyDeviceToHost, g->stream));
    const mm_err drained = mm__gpu_drain(g->stream, "backend drain");
    if (drained != MM_OK) {
        g->lost = drained == MM_ETIMEDOUT; // the stream stays blocked: refuse further drains
        return drained;
    }
    if (h != 0) {
        MM_GPU_CHECK(cudaMemsetAsync(g->d_err, 0, sizeof(int), g->stream));
        return bad_index();
    }
    return MM_OK;
}

static void gpu_close(void *ctx) {
    CTX(ctx);
    if (g == NULL)
        return;
    (void)cudaSetDevice(g->dev);
    ot_close(g);
    if (g->stream != NULL) {
        if (!g->lost) // a lost stream never drains: leave it to process exit
            (void)mm__gpu_drain(g->stream, "close");
        mm_gpu_stream_forget(g->stream); // frees matmul.cu's buffer of a drained stream
        (void)cudaStreamDestroy(g->stream);
    }
    if (g->d_amax != NULL)
        (void)cudaFree(g->d_amax);
    if (g->d_count != NULL)
        (void)cudaFree(g->d_count);
    if (g->d_err != NULL)
        (void)cudaFree(g->d_err);
    if (g->d_moe != NULL)
        (void)cudaFree(g->d_moe);
    free(g->h_moe);
    for (int i = 0; i < STAGE_PARTS; i++)
        if (g->stage_ev[i] != NULL)
            (void)cudaEventDestroy(g->stage_ev[i]);
    if (g->h_stage != NULL)
        (void)cudaFreeHost(g->h_stage);
    if (g->h_get != NULL)
        (void)cudaFreeHost(g->h_get);
    for (int i = 0; i < MM_FETCH_SLOTS; i++)
        if (g->fetch_ev[i] != NULL)
            (void)cudaEventDestroy(g->fetch_ev[i]);
    if (g->h_fetch != NULL)
        (void)cudaFreeHost(g->h_fetch);
    free(g);
}

// h2d: an ordered host-to-device copy after which src may be reused at once; small copies go
// through the pinned ring (see the design notes).
static mm_err h2d(struct gpu_ctx *g, void *dst, const void *src, size_t n_bytes) {
    mm_gpu_wperm_forget(dst, n_bytes); // prefill's permuted-W cache: no copy of rewritten bytes
    if (g->h_stage == NULL || n_bytes > STAGE_MAX) {
        MM_GPU_CHECK(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, g->stream));
        return MM_OK;
    }
    const size_t part = STAGE_BYTES / STAGE_PARTS;
    if (g->stage_off + n_bytes > part) { // leave this part for the next
        int cur = g->stage_part;
        MM_GPU_CHECK(cudaEventRecord(g->stage_ev[cur], g->stream));
        g->stage_live[cur] = true;
        cur = (cur + 1) % STAGE_PARTS;
        if (g->stage_live[cur]) {
            const mm_err w = mm__gpu_wait_event(g->stage_ev[cur], "pinned staging");
            if (w != MM_OK) {
                g->lost = w == MM_ETIMEDOUT;
                return w;
            }
        }
        g->stage_part = cur;
        g->stage_off = 0;
    }
    char *h = g->h_stage + (size_t)g->stage_part * part + g->stage_off;
    memcpy(h, src, n_bytes);
    MM_GPU_CHECK(cudaMemcpyAsync(dst, h, n_bytes, cudaMemcpyHostToDevice, g->stream));
    g->stage_off += (n_bytes + 63) & ~(size_t)63;
    return MM_OK;
}

static mm_err not_capturing(struct gpu_ctx *g, const char *what) {
    if (!g->capturing)
        return MM_OK;
    mm_log_error("gpu: %s while a graph is being captured", what);
    return MM_EINVAL;
}

static mm_err gpu_buffer_alloc(void *ctx, size_t n_bytes, void **out) {
    CTX(ctx);
    if (out == NULL)
        return MM_EINVAL;
    ON_DEVICE();
    return mm_gpu_alloc(out, n_bytes);
}

static void gpu_buffer_free(void *ctx, void *p) {
    CTX(ctx);
    if (p == NULL)
        return;
    (void)cudaSetDevice(g->dev);
    mm_gpu_wperm_forget(p, 0); // prefill's permuted-W cache (matmul.cu): drop copies of p's weights
    // Work still queued may use p: cudaFree waits for the device, as the table requires.
    (void)cudaFree(p);
}

static mm_err gpu_set(void *ctx, void *dst, const void *src, size_t n_bytes) {
    CTX(ctx);
    if (n_bytes == 0)
        return MM_OK;
    if (dst == NULL || src == NULL)
        return MM_EINVAL;
    MM_TRY(not_capturing(g, "set"));
    ON_DEVICE();
    // The caller may reuse src at once: small copies are staged in the pinned ring; larger
    // ones come from pageable memory (malloc, mmap'd checkpoints), and an async copy from
    // pageable memory returns only after the runtime has staged the source. Either way no
    // stream drain; the copy stays ordered with the ops on the stream.
    TIMED("set", h2d(g, dst, src, n_bytes));
}

static mm_err gpu_get(void *ctx, void *dst, const void *src, size_t n_bytes) {
    CTX(ctx);
    if (n_bytes > 0 && (dst == NULL || src == NULL))
        return MM_EINVAL;
    MM_TRY(not_capturing(g, "get"));
    ON_DEVICE();
    // a mid-sized copy lands in the pinned buffer, then one memcpy after the drain
    const bool pinned = g->h_get != NULL && n_bytes >= GET_PINNED_MIN && n_bytes <= GET_PINNED_BYTES;
    if (n_bytes > 0) {
        ot_begin(g);
        MM_GPU_CHECK(cudaMemcpyAsync(pinned ? g->h_get : dst, src, n_bytes,
                                     cudaMemcpyDeviceToHost, g->stream));
        ot_end(g, "get");
    }
    const mm_err rv = check_err_word(g);
    ot_read(g); // the stream has drained: reading the pairs waits for nothing
    if (pinned && (rv == MM_OK || rv == MM_EINVAL)) // drained (EINVAL: an op's bad index)
        memcpy(dst, g->h_get, n_bytes);
    return rv;
}

// fetch: the result and the error word go to a pinned slot by one small launch (or two
// copies with MM_GPU_FETCH_COPY=1), then an event marks the slot; nothing drains the stream.
#define FETCH_STRIDE (MM_FETCH_BYTES + 256)
static mm_err gpu_fetch(void *ctx, const void *src, size_t n_bytes, uint64_t *ticket) {
    CTX(ctx);
    if (src == NULL || ticket == NULL || n_bytes == 0 || n_bytes > MM_FETCH_BYTES)
        return MM_EINVAL;
    MM_TRY(not_capturing(g, "fetch"));
    if (g->lost)
        return MM_EDEVICE;
    ON_DEVICE();
    const uint64_t t = g->fetch_next;
    const int slot = (int)(t % MM_FETCH_SLOTS);
    if (g->fetch_ticket[slot] != 0)
        return MM_EBUSY;
    char *h = g->h_fetch + (size_t)slot * FETCH_STRIDE;
    int *h_err = (int *)(h + MM_FETCH_BYTES);
    ot_begin(g);
    if (g->fetch_copy) {
        MM_GPU_CHECK(cudaMemcpyAsync(h, src, n_bytes, cudaMemcpyDeviceToHost, g->stream));
        MM_GPU_CHECK(cudaMemcpyAsync(h_err, g->d_err, sizeof(int), cudaMemcpyDeviceToHost,
                                     g->stream));
    } else {
        MM_TRY(mm_gpu_fetch_copy(g->stream, h, src, n_bytes, g->d_err, h_err));
    }
    ot_end(g, "fetch");
    MM_GPU_CHECK(cudaEventRecord(g->fetch_ev[slot], g->stream));
    g->fetch_ticket[slot] = t;
    g->fetch_n[slot] = n_bytes;
    g->fetch_next = t + 1;
    *ticket = t;
    return MM_OK;
}

static mm_err gpu_fetch_wait(void *ctx, uint64_t ticket, void *dst) {
    CTX(ctx);
    const int slot = (int)(ticket % MM_FETCH_SLOTS);
    if (dst == NULL || ticket == 0 || g->fetch_ticket[slot] != ticket)
        return MM_EINVAL;
    MM_TRY(not_capturing(g, "fetch_wait"));
    if (g->lost)
        return MM_EDEVICE;
    ON_DEVICE();
    const mm_err rv = mm__gpu_wait_event(g->fetch_ev[slot], "fetch");
    g->fetch_ticket[slot] = 0;
    if (rv != MM_OK) {
        g->lost = rv == MM_ETIMEDOUT; // the stream stays blocked: refuse further drains
        return rv;
    }
    const char *h = g->h_fetch + (size_t)slot * FETCH_STRIDE;
    memcpy(dst, h, g->fetch_n[slot]);
    int err = 0;
    memcpy(&err, h + MM_FETCH_BYTES, sizeof(int));
    // left set: the next get or synchronize reports it again and clears it
    return err != 0 ? bad_index() : MM_OK;
}

static mm_err gpu_synchronize(void *ctx) {
    CTX(ctx);
    MM_TRY(not_capturing(g, "synchronize"));
    ON_DEVICE();
    const mm_err rv = check_err_word(g);
    ot_read(g);
    return rv;
}

static bool weight_ok(const mm_weight *w) {
    return w != NULL && w->data != NULL && w->rows > 0 && w->cols > 0 && w->rows < INT32_MAX &&
           w->cols < INT32_MAX &&
           (w->dtype == MM_DTYPE_BF16 || w->dtype == MM_DTYPE_F16 || w->dtype == MM_DTYPE_F32);
}

static mm_err gpu_matmul(void *ctx, const mm_weight *w, const float *bias, const float *x,
                         int64_t x_stride, float *y, int64_t y_stride, int64_t n_rows) {
    CTX(ctx);
    if (!weight_ok(w) || x == NULL || y == NULL || n_rows < 0 || n_rows > INT32_MAX)
        return MM_EINVAL;
    ON_DEVICE();
    char nm[OT_NAME];
    TIMED(OT_NAMES(g) ? shape_name(nm, "matmul", w->rows, w->cols) : "",
          mm_gpu_matmul(g->stream, w->dtype, w->data, (int)w->rows, (int)w->cols, bias, x,
                        x_stride, y, y_stride, (int)n_rows, MM_GPU_PATH_AUTO));
}

static mm_err gpu_matmul_res(void *ctx, const mm_weight *w, const float *x, int64_t x_stride,
                             const float *res, int64_t res_stride, float *y, int64_t y_stride,
                             int64_t n_rows) {
    CTX(ctx);
    if (!weight_ok(w) || x == NULL || y == NULL || res == NULL || n_rows < 0 ||
        n_rows > INT32_MAX)
        return MM_EINVAL;
    ON_DEVICE();
    char nm[OT_NAME];
    TIMED(OT_NAMES(g) ? shape_name(nm, "matmul_res", w->rows, w->cols) : "",
          mm_gpu_matmul_res(g->stream, w->dtype, w->data, (int)w->rows, (int)w->cols, x, x_stride,
                            res, res_stride, y, y_stride, (int)n_rows));
}

// Grows the staging to hold n experts; allocates only when a layer has more experts than
// any before (once per model in practice), after draining the stream (slots may be in use).
static mm_err moe_staging(struct gpu_ctx *g, int n) {
    if (n <= g->moe_cap)
        return MM_OK;
    size_t slot = ((size_t)n * sizeof(void *) + ((size_t)n + 1) * 4 + 255) & ~(size_t)255;
    char *h = (char *)malloc(slot);
    if (h == NULL)
        return MM_ENOMEM;
    char *d = NULL;
    if (mm__gpu_drain(g->stream, "moe staging") != MM_OK) {
        free(h);
        return MM_EDEVICE;
    }
    cudaError_t e = cudaMalloc((void **)&d, slot * MOE_SLOTS);
    if (e != cudaSuccess) {
        free(h);
        mm_log_error("gpu: moe_matmul staging for %d experts: %s", n, cudaGetErrorString(e));
        return MM_EDEVICE;
    }
    if (g->d_moe != NULL)
        (void)cudaFree(g->d_moe);
    free(g->h_moe);
    g->d_moe = d, g->h_moe = h, g->moe_cap = n, g->moe_slot = slot, g->moe_next = 0;
    return MM_OK;
}

static mm_err gpu_moe_matmul(void *ctx, const mm_weight *experts, const int32_t *offs,
                             int n_experts, const float *x, int64_t x_stride, float *y,
                             int64_t y_stride, int64_t n_rows) {
    CTX(ctx);
    if (experts == NULL || offs == NULL || n_experts <= 0 || x == NULL || y == NULL ||
        n_rows < 0 || n_rows > INT32_MAX || offs[0] != 0 || offs[n_experts] != n_rows)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    const mm_weight *w0 = NULL; // shape and dtype: the first expert with rows
    for (int e = 0; e < n_experts; e++) {
        if (offs[e + 1] < offs[e])
            return MM_EINVAL;
        if (offs[e + 1] > offs[e]) {
            if (!weight_ok(&experts[e]))
                return MM_EINVAL;
            if (w0 == NULL)
                w0 = &experts[e];
            else if (experts[e].rows != w0->rows || experts[e].cols != w0->cols ||
                     experts[e].dtype != w0->dtype)
                return MM_EINVAL;
        }
    }
    ON_DEVICE();
    MM_TRY(moe_staging(g, n_experts));
    char nm[OT_NAME];
    ot_begin(g);
    const void **hp = (const void **)g->h_moe;
    for (int e = 0; e < n_experts; e++)
        hp[e] = offs[e + 1] > offs[e] ? experts[e].data : NULL;
    const size_t pb = (size_t)n_experts * sizeof(void *), ob = ((size_t)n_experts + 1) * 4;
    memcpy(g->h_moe + pb, offs, ob);
    char *d = g->d_moe + (size_t)g->moe_next * g->moe_slot;
    g->moe_next = (g->moe_next + 1) % MOE_SLOTS;
    mm_err rv = h2d(g, d, g->h_moe, pb + ob);
    if (rv == MM_OK)
        rv = mm_gpu_moe_matmul(g->stream, w0->dtype, (const void *const *)d,
                               (const int32_t *)(d + pb), n_experts, (int)w0->rows,
                               (int)w0->cols, x, x_stride, y, y_stride, (int)n_rows,
                               MM_GPU_PATH_AUTO);
    ot_end(g, g->ot ? shape_name(nm, "moe_matmul", w0->rows, w0->cols) : "");
    return rv;
}

static mm_err gpu_rmsnorm(void *ctx, const mm_weight *w, float eps, const float *x, int64_t xs,
                          float *y, int64_t ys, int64_t n_rows) {
    CTX(ctx);
    ON_DEVICE();
    if (g->old_kernels)
        TIMED("rmsnorm", mm_gpu_rmsnorm_warp(g->stream, w, eps, x, xs, y, ys, n_rows));
    TIMED("rmsnorm", mm_gpu_rmsnorm(g->stream, w, eps, x, xs, y, ys, n_rows));
}

static mm_err gpu_rope(void *ctx, const struct mm_rope_args *a) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("rope", mm_gpu_rope(g->stream, a));
}

static mm_err gpu_kv_store(void *ctx, const struct mm_kv_store_args *a) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("kv_store", mm_gpu_kv_store(g->stream, a, g->d_err));
}

static mm_err gpu_attention(void *ctx, const struct mm_attn_args *a) {
    CTX(ctx);
    ON_DEVICE();
    if (g->old_kernels)
        TIMED("attention", mm_gpu_attention_ref(g->stream, a, g->d_err));
    TIMED("attention", mm_gpu_attention(g->stream, a, g->d_err));
}

// attention_tcd.cu: attention_prep's one launch where it takes the call
extern "C" mm_err mm_gpu_attention_prep(void *stream, const struct mm_attn_prep *p,
                                        const struct mm_attn_args *a, int *d_err, int *done);

static mm_err gpu_attention_prep(void *ctx, const struct mm_attn_prep *p,
                                 const struct mm_attn_args *a) {
    CTX(ctx);
    ON_DEVICE();
    if (g->old_kernels)
        return MM_EUNSUPP;
    if (diag_skip("attention_prep"))
        return MM_OK;
    int done = 0;
    ot_begin(g);
    const mm_err rv = mm_gpu_attention_prep(g->stream, p, a, g->d_err, &done);
    if (rv == MM_OK && !done)
        return MM_EUNSUPP; // nothing issued: the caller runs the two ops
    ot_end(g, "attention_prep");
    return rv;
}

// attention_tc.cu: bf16 where every read of the cache goes through the tensor-core contract
extern "C" enum mm_dtype mm_gpu_kv_dtype(int n_kv_heads, int head_dim_k, int head_dim_v);

static enum mm_dtype gpu_kv_dtype(void *ctx, int n_kv_heads, int head_dim_k, int head_dim_v) {
    (void)ctx;
    return mm_gpu_kv_dtype(n_kv_heads, head_dim_k, head_dim_v);
}

static mm_err gpu_embed(void *ctx, const mm_weight *t, const int32_t *ids, int64_t n_rows,
                        float *out, int64_t os) {
    CTX(ctx);
    ON_DEVICE();
    ot_step(g, n_rows);
    TIMED("embed", mm_gpu_embed(g->stream, t, ids, n_rows, out, os, g->d_err));
}

static mm_err gpu_swiglu(void *ctx, const float *gt, int64_t gs, const float *u, int64_t us,
                         float *o, int64_t os, int64_t n_rows, int64_t dim) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("swiglu", mm_gpu_swiglu(g->stream, gt, gs, u, us, o, os, n_rows, dim));
}

static mm_err gpu_route(void *ctx, const struct mm_route_params *p, const float *logits,
                        int64_t ls, int64_t n_rows, int32_t *ids, float *weights) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("route", mm_gpu_route(g->stream, p, logits, ls, n_rows, ids, weights));
}

static mm_err gpu_axpy(void *ctx, const float *alpha, const float *x, int64_t xs, float *y,
                       int64_t ys, int64_t n_rows, int64_t dim) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("axpy", mm_gpu_axpy(g->stream, alpha, x, xs, y, ys, n_rows, dim));
}

static mm_err gpu_sigmoid(void *ctx, float *x, int64_t n) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("sigmoid", mm_gpu_sigmoid(g->stream, x, n));
}

static mm_err gpu_copy_rows(void *ctx, const float *src, int64_t ss, const int32_t *si, float *dst,
                            int64_t ds, const int32_t *di, int64_t n_rows, int64_t dim) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("copy_rows", mm_gpu_copy_rows(g->stream, src, ss, si, dst, ds, di, n_rows, dim, g->d_err));
}

static mm_err gpu_copy(void *ctx, void *dst, const void *src, size_t n_bytes) {
    CTX(ctx);
    if ((dst == NULL || src == NULL) && n_bytes > 0)
        return MM_EINVAL;
    if (n_bytes == 0)
        return MM_OK;
    ON_DEVICE();
    TIMED("copy", mm_gpu_memcpy_d2d(g->stream, dst, src, n_bytes));
}

static mm_err gpu_fill(void *ctx, float *x, float value, int64_t n) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("fill", mm_gpu_fill(g->stream, x, value, n));
}

static mm_err gpu_route_plan(void *ctx, const int32_t *ids, const float *weights, int64_t n_rows,
                             int top_k, int n_experts, int32_t *offs, int32_t *src_row,
                             int32_t *dst_slot, float *wt) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("route_plan", mm_gpu_route_plan(g->stream, ids, weights, n_rows, top_k, n_experts,
                                          offs, src_row, dst_slot, wt, g->d_err));
}

// moe_args_ok: the checks the grouped products on device tables share (expert table and
// offsets given, sizes within the kernels' int range, a weight type they take).
static bool moe_args_ok(const void *const *experts, enum mm_dtype dtype, int64_t rows,
                        int64_t cols, const int32_t *offs, int64_t n_rows) {
    return experts != NULL && offs != NULL && rows > 0 && cols > 0 && rows < INT32_MAX &&
           cols < INT32_MAX && n_rows >= 0 && n_rows <= INT32_MAX &&
           (dtype == MM_DTYPE_BF16 || dtype == MM_DTYPE_F16 || dtype == MM_DTYPE_F32);
}

static mm_err gpu_moe_matmul_dev(void *ctx, const void *const *experts, enum mm_dtype dtype,
                                 int64_t rows, int64_t cols, int n_experts, const int32_t *offs,
                                 const float *x, int64_t x_stride, float *y, int64_t y_stride,
                                 int64_t n_rows) {
    CTX(ctx);
    if (!moe_args_ok(experts, dtype, rows, cols, offs, n_rows))
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    ON_DEVICE();
    char nm[OT_NAME];
    ot_begin(g);
    const mm_err rv = mm_gpu_moe_matmul(g->stream, dtype, experts, offs, n_experts, (int)rows,
                                        (int)cols, x, x_stride, y, y_stride, (int)n_rows,
                                        MM_GPU_PATH_AUTO);
    ot_end(g, g->ot ? shape_name(nm, "moe_matmul_dev", rows, cols) : "");
    return rv;
}

static mm_err gpu_argmax(void *ctx, const float *logits, int64_t stride, int64_t n_rows,
                         int vocab, int32_t *ids) {
    CTX(ctx);
    ON_DEVICE();
    if (g->old_kernels)
        TIMED("argmax", mm_gpu_argmax(g->stream, logits, stride, n_rows, vocab, ids));
    TIMED("argmax", mm_gpu_argmax_ws(g->stream, logits, stride, n_rows, vocab, ids, g->d_amax,
                                     AMAX_ROWS));
}

// graph_tell logs the first recorded graph's shape: nodes, edges, and how many edges are
// programmatic (the small ops and GEMVs launched as programmatic dependents should give
// programmatic edges under stream capture, so that the replay overlaps each kernel's launch
// with the one before as op-by-op issue does). A diagnostic of the replay's speed only. (H200,
// CUDA 13, 2026-11-30: every kernel-to-kernel edge of the recorded steps was programmatic.)
static void graph_tell(struct gpu_ctx *g, cudaGraph_t gr) {
#if MM_GPU_HAVE_WMMA // CUDA (edge data needs 12.3); the HIP runtime has no edge types
    size_t n_nodes = 0, n_edges = 0, n_prog = 0;
    (void)cudaGraphGetNodes(gr, NULL, &n_nodes);
    if (cudaGraphGetEdges(gr, NULL, NULL, NULL, &n_edges) == cudaSuccess && n_edges > 0) {
        cudaGraphNode_t *from = (cudaGraphNode_t *)calloc(n_edges, sizeof(*from));
        cudaGraphNode_t *to = (cudaGraphNode_t *)calloc(n_edges, sizeof(*to));
        cudaGraphEdgeData *ed = (cudaGraphEdgeData *)calloc(n_edges, sizeof(*ed));
        if (from && to && ed && cudaGraphGetEdges(gr, from, to, ed, &n_edges) == cudaSuccess)
            for (size_t i = 0; i < n_edges; i++)
                n_prog += ed[i].type == cudaGraphDependencyTypeProgrammatic;
        free(from);
        free(to);
        free(ed);
    }
    (void)cudaGetLastError();
    mm_log_info("gpu: %s:%d first recorded graph: %zu nodes, %zu edges, %zu programmatic",
                MM_GPU_VENDOR, g->dev, n_nodes, n_edges, n_prog);
#else
    (void)g;
    (void)gr;
#endif
}

// A recording and the permuted-W epoch it was made in (mm_gpu_wperm_epoch): products inside it
// may read cached permuted weights, which a later weight write or free releases; such a graph
// is never replayed (graph_launch: MM_ECLOSED, nothing launched).
struct gpu_graph {
    cudaGraphExec_t ex;
    unsigned long long epoch;
};

static mm_err gpu_capture_begin(void *ctx) {
    CTX(ctx);
    if (g->capturing)
        return MM_EINVAL;
    ON_DEVICE();
    g->cap_epoch = mm_gpu_wperm_epoch();
    MM_GPU_CHECK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
    g->capturing = true;
    return MM_OK;
}

static mm_err gpu_capture_end(void *ctx, void **graph) {
    CTX(ctx);
    if (graph == NULL || !g->capturing)
        return MM_EINVAL;
    *graph = NULL;
    ON_DEVICE();
    g->capturing = false;
    cudaGraph_t gr = NULL;
    cudaError_t e = cudaStreamEndCapture(g->stream, &gr);
    cudaGraphExec_t ex = NULL;
    if (e == cudaSuccess && gr == NULL)
        e = cudaErrorUnknown;
    if (e == cudaSuccess && !g->graph_told) {
        graph_tell(g, gr);
        g->graph_told = true;
    }
    if (e == cudaSuccess)
        e = cudaGraphInstantiateWithFlags(&ex, gr, 0);
    if (gr != NULL)
        (void)cudaGraphDestroy(gr);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); // a failed capture leaves no sticky error behind
        mm_log_warn("gpu: graph capture failed: %s", cudaGetErrorString(e));
        return MM_EDEVICE;
    }
    struct gpu_graph *gg = (struct gpu_graph *)malloc(sizeof(*gg));
    if (gg == NULL) {
        (void)cudaGraphExecDestroy(ex);
        return MM_ENOMEM;
    }
    gg->ex = ex;
    gg->epoch = g->cap_epoch;
    *graph = gg;
    return MM_OK;
}

static mm_err gpu_graph_launch(void *ctx, void *graph) {
    CTX(ctx);
    if (graph == NULL || g->capturing)
        return MM_EINVAL;
    const struct gpu_graph *gg = (const struct gpu_graph *)graph;
    // (not atomic with the launch: a weight written or freed, or the cache's bound lowered, on
    // another thread while this one decodes with it is the caller's race, as without graphs)
    if (gg->epoch != mm_gpu_wperm_epoch())
        return MM_ECLOSED; // it may read a released permuted weight: record it again
    ON_DEVICE();
    MM_GPU_CHECK(cudaGraphLaunch(gg->ex, g->stream));
    return MM_OK;
}

static void gpu_graph_free(void *ctx, void *graph) {
    CTX(ctx);
    if (graph == NULL)
        return;
    (void)cudaSetDevice(g->dev);
    (void)cudaGraphExecDestroy(((struct gpu_graph *)graph)->ex);
    free(graph);
}

static mm_err gpu_combine(void *ctx, const float *alpha, int k, const float *x, int64_t xs,
                          const float *shared, int64_t ss, float *h, int64_t hs, int64_t n_rows,
                          int64_t dim) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("combine", mm_gpu_combine(g->stream, alpha, k, x, xs, shared, ss, h, hs, n_rows, dim));
}

static mm_err gpu_head_norm_rope(void *ctx, float *x, int64_t n_rows, int64_t stride, int n_a,
                                 int n_b, int64_t b_off, int head_dim, const mm_weight *wa,
                                 const mm_weight *wb, float eps, const struct mm_rope_args *ra) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("head_norm_rope", mm_gpu_head_norm_rope(g->stream, x, n_rows, stride, n_a, n_b, b_off,
                                                  head_dim, wa, wb, eps, ra));
}

static mm_err gpu_moe_matmul_rows(void *ctx, const void *const *experts, enum mm_dtype dtype,
                                  int64_t rows, int64_t cols, int n_experts, const int32_t *offs,
                                  const float *x, int64_t x_stride, const int32_t *x_idx,
                                  const float *x_up, float *y, int64_t y_stride,
                                  const int32_t *y_idx, int64_t n_rows) {
    CTX(ctx);
    if (!moe_args_ok(experts, dtype, rows, cols, offs, n_rows))
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    ON_DEVICE();
    char nm[OT_NAME];
    ot_begin(g);
    const mm_err rv = mm_gpu_moe_matmul_rows(g->stream, dtype, experts, offs, n_experts,
                                             (int)rows, (int)cols, x, x_stride, x_idx, x_up,
                                             y, y_stride, y_idx, (int)n_rows);
    if (rv == MM_EUNSUPP) // nothing issued: the caller copies the rows itself
        return rv;
    ot_end(g, g->ot ? shape_name(nm, "moe_matmul_rows", rows, cols) : "");
    return rv;
}

static mm_err gpu_moe_ffn_rows(void *ctx, const void *const *experts_gu,
                               const void *const *experts_down, enum mm_dtype dtype, int64_t d_ff,
                               int64_t d_model, int n_experts, const int32_t *offs, const float *x,
                               int64_t x_stride, const int32_t *x_idx, float *y, int64_t y_stride,
                               const int32_t *y_idx, int64_t n_rows) {
    CTX(ctx);
    if (!moe_args_ok(experts_gu, dtype, 2 * d_ff, d_model, offs, n_rows) || experts_down == NULL ||
        d_ff >= INT32_MAX / 2)
        return MM_EINVAL;
    if (n_rows == 0)
        return MM_OK;
    ON_DEVICE();
    char nm[OT_NAME];
    if (diag_skip("moe_ffn_rows"))
        return MM_OK;
    ot_begin(g);
    const mm_err rv = mm_gpu_moe_ffn_rows(g->stream, dtype, experts_gu, experts_down, offs,
                                          n_experts, (int)d_ff, (int)d_model, x, x_stride, x_idx,
                                          y, y_stride, y_idx, (int)n_rows);
    if (rv == MM_EUNSUPP) // nothing issued: the caller runs the two products
        return rv;
    ot_end(g, g->ot ? shape_name(nm, "moe_ffn_rows", d_ff, d_model) : "");
    return rv;
}

static mm_err gpu_head_norm_rope_kv(void *ctx, float *x, int64_t n_rows, int64_t stride,
                                    int n_a, int n_b, int64_t b_off, int head_dim,
                                    const mm_weight *wa, const mm_weight *wb, float eps,
                                    const struct mm_rope_args *ra,
                                    const struct mm_kv_store_args *st) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("head_norm_rope_kv", mm_gpu_head_norm_rope_kv(g->stream, x, n_rows, stride, n_a, n_b,
                                                        b_off, head_dim, wa, wb, eps, ra, st,
                                                        g->d_err));
}

static mm_err gpu_route_with_plan(void *ctx, const struct mm_route_params *p,
                                  const float *logits, int64_t ls, int64_t n_rows, int32_t *ids,
                                  float *weights, int32_t *offs, int32_t *src_row,
                                  int32_t *dst_slot, float *wt) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("route_with_plan", mm_gpu_route_with_plan(g->stream, p, logits, ls, n_rows, ids,
                                                    weights, offs, src_row, dst_slot, wt,
                                                    g->d_err, g->d_count));
}

static mm_err gpu_combine_rmsnorm(void *ctx, const float *alpha, int k, const float *x,
                                  int64_t xs, const float *shared, int64_t ss, float *h,
                                  int64_t hs, int64_t n_rows, const mm_weight *w, float eps,
                                  float *y, int64_t ys) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("combine_rmsnorm", mm_gpu_combine_rmsnorm(g->stream, alpha, k, x, xs, shared, ss, h,
                                                    hs, n_rows, w, eps, y, ys));
}

static mm_err gpu_embed_rmsnorm(void *ctx, const mm_weight *t, const int32_t *ids,
                                int64_t n_rows, float *out, int64_t os, const mm_weight *w,
                                float eps, float *y, int64_t ys) {
    CTX(ctx);
    ON_DEVICE();
    ot_step(g, n_rows); // a step starts at its embedding, fused or not
    TIMED("embed_rmsnorm", mm_gpu_embed_rmsnorm(g->stream, t, ids, n_rows, out, os, w, eps, y,
                                                ys, g->d_err));
}

static mm_err gpu_add_rmsnorm(void *ctx, const float *a, int64_t as, float *h, int64_t hs,
                              const mm_weight *w, float eps, float *y, int64_t ys,
                              int64_t n_rows) {
    CTX(ctx);
    ON_DEVICE();
    TIMED("add_rmsnorm", mm_gpu_add_rmsnorm(g->stream, a, as, h, hs, w, eps, y, ys, n_rows));
}

static const struct mm_backend_ops gpu_ops = {
    .version = MM_BACKEND_V1,
    .name = MM_GPU_VENDOR,
    .host_memory = false,
    .close = gpu_close,
    .buffer_alloc = gpu_buffer_alloc,
    .buffer_free = gpu_buffer_free,
    .set = gpu_set,
    .get = gpu_get,
    .synchronize = gpu_synchronize,
    .matmul = gpu_matmul,
    .rmsnorm = gpu_rmsnorm,
    .rope = gpu_rope,
    .kv_store = gpu_kv_store,
    .attention = gpu_attention,
    .embed = gpu_embed,
    .swiglu = gpu_swiglu,
    .route = gpu_route,
    .axpy = gpu_axpy,
    .sigmoid = gpu_sigmoid,
    .copy_rows = gpu_copy_rows,
    .fill = gpu_fill,
    .moe_matmul = gpu_moe_matmul,
    .route_plan = gpu_route_plan,
    .moe_matmul_dev = gpu_moe_matmul_dev,
    .argmax = gpu_argmax,
    .capture_begin = gpu_capture_begin,
    .capture_end = gpu_capture_end,
    .graph_launch = gpu_graph_launch,
    .graph_free = gpu_graph_free,
    .combine = gpu_combine,
    .head_norm_rope = gpu_head_norm_rope,
    .moe_matmul_rows = gpu_moe_matmul_rows,
    .moe_ffn_rows = gpu_moe_ffn_rows,
    .add_rmsnorm = gpu_add_rmsnorm,
    .head_norm_rope_kv = gpu_head_norm_rope_kv,
    .route_with_plan = gpu_route_with_plan,
    .combine_rmsnorm = gpu_combine_rmsnorm,
    .embed_rmsnorm = gpu_embed_rmsnorm,
    .kv_dtype = gpu_kv_dtype,
    .fetch = gpu_fetch,
    .fetch_wait = gpu_fetch_wait,
    .matmul_res = gpu_matmul_res,
    .attention_prep = gpu_attention_prep,
    .copy = gpu_copy,
};

extern "C" mm_err mm_cuda_backend_open(mm_backend *be, const mm_backend_params *p,
                                       char err[MM_ERRLEN]) {
    if (be == NULL)
        return MM_EINVAL;
    const int dev = p != NULL ? p->device : 0;
    int n = 0;
    char why[MM_ERRLEN] = "";
    MM_TRY(mm_gpu_device_count(&n, why));
    if (n == 0)
        return mm_errf(err, MM_EUNSUPP, "%s:%d: %s", MM_GPU_VENDOR, dev, why);
    if (dev < 0 || dev >= n)
        return mm_errf(err, MM_EINVAL, "%s:%d: no such device (this host has %d)", MM_GPU_VENDOR,
                       dev, n);
    struct gpu_ctx *g = (struct gpu_ctx *)calloc(1, sizeof(*g));
    if (g == NULL)
        return MM_ENOMEM;
    g->dev = dev;
    mm_err rv = MM_OK;
    cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&g->d_err, sizeof(int));
    if (e == cudaSuccess)
        e = cudaMemset(g->d_err, 0, sizeof(int));
    for (int i = 0; i < STAGE_PARTS && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&g->stage_ev[i], cudaEventDisableTiming);
    if (e == cudaSuccess)
        e = cudaMalloc(&g->d_amax, MM_GPU_ARGMAX_WS_BYTES(AMAX_ROWS));
    if (e == cudaSuccess)
        e = cudaMemset(g->d_amax, 0, MM_GPU_ARGMAX_WS_BYTES(AMAX_ROWS));
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&g->d_count, sizeof(unsigned));
    if (e == cudaSuccess)
        e = cudaMemset(g->d_count, 0, sizeof(unsigned));
    if (e == cudaSuccess && cudaMallocHost((void **)&g->h_stage, STAGE_BYTES) != cudaSuccess) {
        (void)cudaGetLastError(); // no pinned memory: small copies go direct (slower, correct)
        g->h_stage = NULL;
    }
    const char *gp = getenv("MM_GPU_GET_PINNED"); // 0: `get` copies straight to the caller
    if (e == cudaSuccess && !(gp != NULL && strcmp(gp, "0") == 0) &&
        cudaMallocHost((void **)&g->h_get, GET_PINNED_BYTES) != cudaSuccess) {
        (void)cudaGetLastError(); // no pinned memory: direct copies (slower, correct)
        g->h_get = NULL;
    }
    for (int i = 0; i < MM_FETCH_SLOTS && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&g->fetch_ev[i], cudaEventDisableTiming);
    if (e == cudaSuccess &&
        cudaMallocHost((void **)&g->h_fetch, (size_t)MM_FETCH_SLOTS * FETCH_STRIDE) != cudaSuccess) {
        (void)cudaGetLastError(); // no pinned memory: no fetch (callers use get)
        g->h_fetch = NULL;
    }
    g->fetch_next = 1;
    const char *fc = getenv("MM_GPU_FETCH_COPY"); // 1: fetch by two async copies (A/B)
    g->fetch_copy = fc != NULL && fc[0] != '\0' && strcmp(fc, "0") != 0;
    if (e != cudaSuccess) {
        rv = mm_errf(err, MM_EDEVICE, "%s:%d: device setup failed: %s", MM_GPU_VENDOR, dev,
                     cudaGetErrorString(e));
        gpu_close(g);
        return rv;
    }
    g->ops_table = gpu_ops;
    be->ops = &g->ops_table;
    if (g->h_fetch == NULL) {
        g->ops_table.fetch = NULL;
        g->ops_table.fetch_wait = NULL;
    }
    const char *mr = getenv("MM_GPU_MATMUL_RES"); // 0: no residual in o_proj's epilogue (A/B)
    if (mr != NULL && strcmp(mr, "0") == 0)
        g->ops_table.matmul_res = NULL;
    const char *old = getenv("MM_GPU_OLD_DECODE"); // A/B: same results, earlier kernels
    g->old_kernels = old != NULL && old[0] != '\0' && strcmp(old, "0") != 0;
    const char *fu = getenv("MM_GPU_OLD_FUSIONS"); // A/B of the fused ops alone
    const bool no_fusions = g->old_kernels || (fu != NULL && fu[0] != '\0' && strcmp(fu, "0") != 0);
    // process-wide, as the earlier kernels ran (the last backend opened decides)
    mm_gpu_set_early_launch(g->old_kernels ? 0 : 1);
    const char *pdl = getenv("MM_GPU_PDL"); // 0: GEMVs without programmatic dependent launch
    if (pdl != NULL && strcmp(pdl, "0") == 0)
        mm_gpu_set_pdl(0);
    const char *wpt = getenv("MM_GPU_GEMV_WPT"); // 1, 2, 4: cap warps per GEMV tile (A/B)
    if (wpt != NULL && wpt[0] != '\0')
        mm_gpu_set_gemv_wpt(atoi(wpt));
    const char *aw = getenv("MM_GPU_ATT_WIDE"); // 1: decode attention's loads in one round
    if (aw != NULL && aw[0] != '\0')
        mm_gpu_set_attention_wide(strcmp(aw, "0") != 0);
    const char *dep = getenv("MM_GPU_PDL_ALL"); // 0: the small ops without dependent launch
    mm_gpu_set_dep_launch(!g->old_kernels && !(dep != NULL && strcmp(dep, "0") == 0));
    mm_gpu_set_gemv_version(g->old_kernels ? 1 : 2);
    if (no_fusions) { // the model falls back to the separate ops these stand for
        g->ops_table.moe_matmul_rows = NULL;
        g->ops_table.moe_ffn_rows = NULL;
        g->ops_table.add_rmsnorm = NULL;
    }
    if (g->old_kernels) // the earlier attention (mm_gpu_attention_ref) reads f32 caches only
        g->ops_table.kv_dtype = NULL;
    const char *oc = getenv("MM_GPU_OLD_CHAIN"); // A/B of the per-layer chain fusions alone
    if (no_fusions || (oc != NULL && oc[0] != '\0' && strcmp(oc, "0") != 0)) {
        g->ops_table.head_norm_rope_kv = NULL;
        g->ops_table.attention_prep = NULL;
        g->ops_table.route_with_plan = NULL;
        g->ops_table.combine_rmsnorm = NULL;
        g->ops_table.embed_rmsnorm = NULL;
    }
    const char *ot = getenv("MM_GPU_OPTIME");
    if (ot != NULL && strcmp(ot, "0") != 0 && ot[0] != '\0') {
        if (ot_open(g)) { // op by op: a graph would hide the ops from the events
            g->ot->hold_ms = strcmp(ot, "2") == 0 ? 4 : 0;
            const char *sp = getenv("MM_GPU_OPTIME_SPLIT");
            g->ot->split = sp != NULL && sp[0] != '\0' && strcmp(sp, "0") != 0;
            const char *sk = getenv("MM_GPU_OPTIME_SKIP");
            g->ot->skip = sk != NULL ? atoi(sk) : 0;
            if (g->ot->skip < 0)
                g->ot->skip = 0;
            g->ops_table.capture_begin = NULL;
            g->ops_table.capture_end = NULL;
            g->ops_table.graph_launch = NULL;
            g->ops_table.graph_free = NULL;
            mm_log_info("gpu: %s:%d times every op (MM_GPU_OPTIME; no graphs)", MM_GPU_VENDOR,
                        dev);
        } else {
            mm_log_warn("gpu: MM_GPU_OPTIME: no memory or events for the timer; not timing");
        }
    }
    be->ctx = g;
    be->n_threads = 1;
    return MM_OK;
}

// The backend's stream and device, for the cudaipc:// transport (mm_gpu.h).
extern "C" mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev) {
    CTX(backend_ctx);
    if (g == NULL || stream == NULL || dev == NULL)
        return MM_EINVAL;
    *stream = (void *)g->stream;
    *dev = g->dev;
    return MM_OK;
}

// Prints the per-op timer's table (MM_GPU_OPTIME) so far to stderr and starts a new one;
// waits for the stream. No effect when the timer is off.
extern "C" void mm_gpu_optime_report(void *backend_ctx) {
    CTX(backend_ctx);
    if (g == NULL || g->ot == NULL)
        return;
    (void)cudaSetDevice(g->dev);
    ot_read(g);
    ot_print(g);
    ot_reset(g->ot);
}
