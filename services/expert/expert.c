// SPDX-License-Identifier: MIT
// Expert owner role; see expert.h. The data-plane protocol is docs/MESH.md's.
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert.h"
#include "mm/dataserv.h"
#include "mm/log.h"
#include "mm/mesh_graph.h"
#include "mm/mesh_gtrace.h"
#include "mm/mesh_trace.h"
#include "mm/model.h"
#include "mm/placement.h"

static long long s_max_tokens, s_threads, s_load_ms;
static char *s_load_csv;
mm_opt expert_opts[] = {
    {"max-batch-tokens", MM_OPT_INT, &s_max_tokens, "256", "rows per step (as the router's)"},
    {"threads", MM_OPT_INT, &s_threads, "0", "CPU threads (0: all cores)"},
    {"load-csv", MM_OPT_STR, &s_load_csv, NULL,
     "write per-(layer, expert) token counts here (layer,expert,tokens), periodically and at "
     "exit"},
    {"load-interval-ms", MM_OPT_INT, &s_load_ms, "2000", "how often --load-csv is rewritten"},
    {0},
};

#define MAX_SEG 4096
#define MAX_TOKENS (1 << 24) // --max-batch-tokens at most

// GPU entry points (kernels/cuda/backend.cu, mesh_ops.cu), weak: NULL in a build without GPU
// support (then no plan frames: the router sends none to an owner without device frames).
#define W __attribute__((weak))
extern mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev) W;
extern mm_err mm_gpu_mesh_count(void *stream, const int32_t *d_offs, int n_experts,
                                uint64_t *d_counts) W;
extern mm_err mm_gpu_mesh_plan_check(void *stream, int32_t *d_plan, int n_experts, int n_slots,
                                     int rows, uint32_t tag, uint32_t step_lo,
                                     uint32_t *h_flag, uint64_t *d_counts) W;
extern mm_err mm_gpu_host_pinned(void **p, size_t n_bytes) W;
extern void mm_gpu_host_pinned_free(void *p) W;
#undef W

static struct owner {
    mm_backend *be;
    mm_model *model;
    mm_model_scratch *scratch;
    mm_placement *pl;
    mm_dataserv *ds;
    int id, d_model, n_layers, n_experts, top_k;
    uint64_t *tokens;        // (n_layers, n_experts) rows served
    bool dirty;
    float *out;              // (max rows, d_model) outputs
    float *d_x, *d_out;      // backend copies of the rows and outputs (device backends)
    int32_t *offs;           // (n_experts + 1) row offsets of one grouped call
    bool dev_frames;         // the data plane may deliver rows in device memory (cudaipc://)
    uint32_t seg_e[MAX_SEG], seg_n[MAX_SEG];
    uint32_t n_seg, seg_rows;
    uint64_t seg_step;
    uint32_t seg_layer;
    bool have_seg;
    int64_t max_rows;
    int64_t max_slots;       // max_rows x top_k: rows of O.out / d_out (a frame's rows at most)
    // plan frames (the router's device routing plan): x rows, then this owner's share of the
    // plan (offs, src, dst int32), all on the device; rows served counted there too
    bool plan;               // the announced frame is a plan frame
    uint32_t plan_rows, plan_slots;
    void *stream;
    uint64_t *d_tokens;      // (n_layers, n_experts) rows served through plan frames
    uint64_t *tokens_dev;    // host copy read at each load write
    uint32_t bad_layer, bad_step; // a bad share seen (layer + 1, step's low 32 bits; 0: none),
                             // refused at the next plan frame (plan_flag_poll)
    uint32_t *bad_plan;      // pinned {layer + 1, step's low 32 bits} of a plan share the device
                             // check emptied (mm_gpu_mesh_plan_check); {0, 0}: none
} O;

// The load CSV is written by a thread of its own: the data thread's tick (load_tick, between
// two frames, so on a step's path) only reads the counts and hands a copy over. Writing it there
// put the file system's latency on a step: a write that took 1 s (its .tmp a FIFO opened late)
// held one CPU mesh step for 773 ms, and on a disk busy writing back a just-synthesized model
// fopen/fclose/rename can take that long. (tests/e2e/mesh_load_csv_test.sh)
static struct load_writer {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    bool started, stop, due; // due: snap holds counts not written yet
    atomic_bool retry;       // the last write failed: hand the counts over again
    uint64_t *snap;          // (n_layers, n_experts) counts handed over (under mu)
    uint64_t *buf;           // the writer's copy (its thread only)
} W = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

// write_csv: the counts in cnt to --load-csv (through PATH.tmp and a rename). Writer thread.
static bool write_csv(const uint64_t *cnt) {
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", s_load_csv);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        mm_log_warn("cannot write %s: %s", tmp, strerror(errno));
        return false;
    }
    fprintf(f, "layer,expert,tokens\n");
    for (int l = 0; l < O.n_layers; l++)
        for (int e = 0; e < O.n_experts; e++)
            if (mm_placement_owns(O.pl, l, e, O.id))
                fprintf(f, "%d,%d,%llu\n", l, e,
                        (unsigned long long)cnt[(size_t)l * (size_t)O.n_experts + e]);
    if (fclose(f) != 0 || rename(tmp, s_load_csv) != 0) {
        mm_log_warn("cannot write %s: %s", s_load_csv, strerror(errno));
        return false;
    }
    return true;
}

static void *load_writer_main(void *arg) {
    (void)arg;
    const size_t ne = (size_t)O.n_layers * (size_t)O.n_experts;
    pthread_mutex_lock(&W.mu);
    for (;;) {
        while (!W.due && !W.stop)
            pthread_cond_wait(&W.cv, &W.mu);
        if (!W.due) // stopping, nothing left to write
            break;
        memcpy(W.buf, W.snap, ne * sizeof(uint64_t));
        W.due = false;
        pthread_mutex_unlock(&W.mu);
        atomic_store(&W.retry, !write_csv(W.buf));
        pthread_mutex_lock(&W.mu);
    }
    pthread_mutex_unlock(&W.mu);
    return NULL;
}

// plan_flag_poll (data thread: each tick and each plan frame): takes the device check's verdict
// on earlier plan shares (mm_gpu_mesh_plan_check writes {layer + 1, step} to pinned memory,
// the step word first) and logs it once; on_plan refuses the next plan frame naming it.
static void plan_flag_poll(void) {
    if (!O.bad_plan)
        return;
    const uint32_t tag = __atomic_exchange_n(&O.bad_plan[0], 0u, __ATOMIC_ACQ_REL);
    if (tag == 0 || O.bad_layer != 0)
        return; // (a second bad share before the refusal: the first one is named)
    O.bad_layer = tag;
    O.bad_step = __atomic_load_n(&O.bad_plan[1], __ATOMIC_ACQUIRE);
    mm_log_error("the router's plan for layer %u of step %u (low 32 bits) broke the plan "
                 "contract (offsets not rising from 0 within the slots, or a row or slot index "
                 "out of range): its experts were not run and that reply's rows were not theirs; "
                 "the next plan frame is refused", tag - 1, O.bad_step);
}

// load_tick (data thread, every --load-interval-ms; and once at stop): when rows were served
// since the last one (or the last write failed), read the plan frames' counts from the device
// and hand the counts to the writer. Never waits for the file.
static void load_tick(void *arg) {
    (void)arg;
    plan_flag_poll();
    if (!s_load_csv || !W.started || (!O.dirty && !atomic_load(&W.retry)))
        return;
    const size_t ne = (size_t)O.n_layers * (size_t)O.n_experts;
    // (a failed read keeps the last counts: zeroing them made the CSV's counters go back)
    if (O.d_tokens && O.be->ops->get(O.be->ctx, O.tokens_dev, O.d_tokens, ne * 8) != MM_OK)
        mm_log_warn("reading the plan frames' row counts from the device failed; %s keeps the "
                    "last counts read", s_load_csv);
    pthread_mutex_lock(&W.mu);
    for (size_t i = 0; i < ne; i++)
        W.snap[i] = O.tokens[i] + (O.d_tokens ? O.tokens_dev[i] : 0);
    W.due = true;
    pthread_cond_signal(&W.cv);
    pthread_mutex_unlock(&W.mu);
    O.dirty = false;
    atomic_store(&W.retry, false);
}

static mm_err load_writer_start(char err[MM_ERRLEN]) {
    if (!s_load_csv)
        return MM_OK;
    const size_t ne = (size_t)O.n_layers * (size_t)O.n_experts;
    W.snap = calloc(ne, sizeof(uint64_t));
    W.buf = calloc(ne, sizeof(uint64_t));
    if (!W.snap || !W.buf)
        return MM_ENOMEM;
    if (pthread_create(&W.th, NULL, load_writer_main, NULL) != 0)
        return mm_errf(err, MM_ESYS, "cannot start the --load-csv writer thread");
    W.started = true;
    return MM_OK;
}

// load_writer_stop: the last counts written (the data thread has stopped), then the thread ends.
static void load_writer_stop(void) {
    if (W.started) {
        load_tick(NULL);
        pthread_mutex_lock(&W.mu);
        W.stop = true;
        pthread_cond_signal(&W.cv);
        pthread_mutex_unlock(&W.mu);
        pthread_join(W.th, NULL);
    }
    free(W.snap);
    free(W.buf);
    W.snap = W.buf = NULL;
    W.started = W.stop = W.due = false;
    atomic_store(&W.retry, false);
}

// CTRL: u32 n_seg, then n_seg x {u32 expert, u32 n_rows}, experts ascending; or a plan frame's
// {u32 MM_MODEL_PLAN_MARK, u32 rows, u32 slots, u32 0} (mm/model.h).
static mm_err on_ctrl(mm_conn *c, const mm_wire_hdr *h, const uint8_t *p) {
    uint32_t n;
    O.have_seg = false;
    O.plan = false;
    mm_mesh_trace(h->step_id, (int)h->layer, "crx");
    if (h->payload_bytes < 4)
        return mm_dataserv_reply_error(c, h, MM_EPROTO, "short CTRL frame");
    memcpy(&n, p, 4);
    if (n == MM_MODEL_PLAN_MARK) {
        uint32_t v[4];
        if (h->payload_bytes != sizeof(v))
            return mm_dataserv_reply_error(c, h, MM_EPROTO, "bad CTRL frame (plan)");
        memcpy(v, p, sizeof(v));
        if (v[1] < 1 || v[1] > O.max_rows || v[2] > (uint64_t)v[1] * (uint64_t)O.top_k ||
            v[3] != 0 || !O.dev_frames) {
            char msg[160];
            snprintf(msg, sizeof(msg), "bad plan CTRL frame (%u rows, %u slots, reserved %u; "
                     "this owner takes %lld rows, top-k %d, reserved 0%s)", v[1], v[2], v[3],
                     (long long)O.max_rows, O.top_k, O.dev_frames ? "" : ", and no device frames");
            return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
        }
        O.plan = true;
        O.plan_rows = v[1];
        O.plan_slots = v[2];
        O.seg_step = h->step_id;
        O.seg_layer = h->layer;
        O.have_seg = true;
        return MM_OK;
    }
    if (n > MAX_SEG || h->payload_bytes != 4 + (uint64_t)n * 8)
        return mm_dataserv_reply_error(c, h, MM_EPROTO, "bad CTRL frame (segment list)");
    O.n_seg = n;
    O.seg_rows = 0;
    uint64_t rows = 0;
    for (uint32_t i = 0; i < n; i++) {
        memcpy(&O.seg_e[i], p + 4 + i * 8, 4);
        memcpy(&O.seg_n[i], p + 8 + i * 8, 4);
        rows += O.seg_n[i];
        // the rows' experts come from this list by position (on_frame's offsets): out of order
        // it would run rows through the wrong experts, and a sum past the buffer (or past
        // 2^32) would count rows never served
        if ((i > 0 && O.seg_e[i] <= O.seg_e[i - 1]) || rows > (uint64_t)O.max_slots) {
            char msg[160];
            snprintf(msg, sizeof(msg), "bad CTRL frame (segment list): %s at segment %u "
                     "(expert %u, %u rows)", rows > (uint64_t)O.max_slots ?
                     "more rows than this owner takes (--max-batch-tokens x top-k)" :
                     "experts not in ascending order", i, O.seg_e[i], O.seg_n[i]);
            return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
        }
    }
    O.seg_rows = (uint32_t)rows;
    O.seg_step = h->step_id;
    O.seg_layer = h->layer;
    O.have_seg = true;
    return MM_OK;
}

// replied: a reply to layer L's frame is on its way (rv: its send): traced, and the trace
// written out after the last layer (off the step's path).
static mm_err replied(const mm_wire_hdr *h, int L, mm_err rv) {
    mm_mesh_trace(h->step_id, L, "tx");
    if (L == O.n_layers - 1) {
        mm_mesh_trace_flush();
        mm_mesh_gtrace_flush();
    }
    return rv;
}

// a device frame's rows: in place in the conn's ring, or in d_x (MM_MESH_VIEWS=0)
static bool dev_payload(const void *payload) {
    return O.d_x != NULL && (payload == (void *)O.d_x || mm_dataserv_on_dev(payload));
}

// on_plan: a plan frame (after its CTRL, or its shape in its header: MM_MODEL_PLAN_FLAG): x
// rows (plan_rows of them), then this owner's share of the router's plan as int32s: offs
// (n_experts + 1), src and dst (plan_slots each), all in d_x. The experts run on the device
// straight from the plan (mm_model_experts_plan; slots past offs[n_experts] are other owners'
// and left unspecified), and the reply is one output row per slot, written straight into the
// reply's place in the router's ring where the link gives one (mm_conn_reserve_dev: views and
// MM_MESH_INPLACE), else in d_out and copied by the send. The plan's indices never reach the
// host: the device checks the share before the products read it (mm_gpu_mesh_plan_check:
// offsets rising from 0 within the slots, rows and slots in range); a bad share is emptied
// there (no product reads or writes outside its buffers), but its reply still goes out, with
// rows that are not the experts' (the host would have to wait for its GPU to know). The host
// sees the flag at the next tick or frame (plan_flag_poll), logs it and refuses the next plan
// frame naming the bad one, so the router fails that step and relinks; a bad share at a step's
// last MoE layer is not refused within its own step.
static mm_err on_plan(mm_conn *c, const mm_wire_hdr *h, void *payload) {
    const int64_t R = O.plan_rows, nk = O.plan_slots, D = O.d_model, E = O.n_experts;
    const int64_t P = mm_model_plan_rows(E, nk, D);
    const int L = (int)h->layer;
    char msg[200];
    O.have_seg = false;
    O.plan = false;
    mm_mesh_trace(h->step_id, L, "rx");
    mm_mesh_gstamp(h->step_id, L, "rx");
    if (O.seg_step != h->step_id || O.seg_layer != h->layer || h->n_rows != (uint64_t)(R + P) ||
        h->row_dim != (uint32_t)D || h->format != MM_WIRE_F32 || h->layer >= (uint32_t)O.n_layers ||
        !dev_payload(payload)) {
        snprintf(msg, sizeof(msg), "step %llu layer %u: %u rows of %u that do not match the plan "
                 "its CTRL frame or header announced (%lld + %lld rows of %lld, as a device frame)",
                 (unsigned long long)h->step_id, h->layer, h->n_rows, h->row_dim, (long long)R,
                 (long long)P, (long long)D);
        return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
    }
    plan_flag_poll();
    if (O.bad_layer != 0) { // an earlier share was bad (flag set by the device)
        char bad[MM_ERRLEN];
        snprintf(bad, sizeof(bad), "the router's plan for layer %u of step %u (low 32 bits) "
                 "broke the plan contract (offsets not rising from 0 within the slots, or a row "
                 "or slot index out of range): its experts were not run; step %llu layer %u "
                 "refused", O.bad_layer - 1, O.bad_step, (unsigned long long)h->step_id,
                 h->layer);
        O.bad_layer = O.bad_step = 0;
        return mm_dataserv_reply_error(c, h, MM_EPROTO, bad);
    }
    const float *x = payload; // d_x, or the frame in place (views)
    int32_t *offs = (int32_t *)(x + R * D), *src = offs + E + 1, *dst = src + nk;
    // (with the check, the rows served are counted by it: no launch of its own after the send)
    if (O.bad_plan && mm_gpu_mesh_plan_check(O.stream, offs, (int)E, (int)nk, (int)R,
                                             (uint32_t)L + 1, (uint32_t)h->step_id, O.bad_plan,
                                             O.d_tokens ? O.d_tokens + (size_t)L * (size_t)E
                                                        : NULL) != MM_OK) {
        snprintf(msg, sizeof(msg), "step %llu layer %d: the plan check could not be issued",
                 (unsigned long long)h->step_id, L);
        return mm_dataserv_reply_error(c, h, MM_EDEVICE, msg);
    }
    // the outputs written straight into the reply's place in the router's ring where the link
    // allows (MM_MESH_INPLACE; no copy at the send), else into d_out
    const size_t nb = (size_t)(nk * D) * 4;
    void *out = NULL;
    if (x != O.d_x && mm_mesh_inplace_env() &&
        mm_conn_reserve_dev(c, nb, &out, mm_deadline_in_ms(2000)) != MM_OK)
        out = NULL; // (a send from d_out reports whatever is wrong with the link)
    float *plan_out = out ? out : O.d_out; // where the outputs go
    mm_err rv = mm_model_experts_plan(O.model, O.scratch, L, offs, x, src, dst, nk, plan_out);
    if (rv != MM_OK) {
        snprintf(msg, sizeof(msg), "experts of layer %d (a plan of %lld slots) failed: %s", L,
                 (long long)nk, mm_strerror(rv));
        return mm_dataserv_reply_error(c, h, rv, msg);
    }
    O.dirty = true;
    mm_mesh_trace(h->step_id, L, "enq");
    mm_mesh_gstamp(h->step_id, L, "enq");
    mm_wire_hdr r;
    MM_TRY(mm_wire_hdr_init(&r, MM_WIRE_REPLY, MM_WIRE_F32, h->step_id, h->layer, (uint32_t)nk,
                            h->row_dim));
    r.row_base = h->row_base;
    struct iovec dv = {.iov_base = plan_out, .iov_len = nb};
    rv = replied(h, L, mm_conn_sendv_dev(c, &r, &dv, 1, mm_deadline_in_ms(2000)));
    // the rows served, counted after the reply is on its way (off the step's path; the next
    // frame's rows land in d_x after it, in stream order)
    if (rv == MM_OK && O.d_tokens && !O.bad_plan &&
        mm_gpu_mesh_count(O.stream, offs, (int)E, O.d_tokens + (size_t)L * (size_t)E) != MM_OK)
        mm_log_warn("step %llu layer %d: counting the rows served failed; --load-csv misses them",
                    (unsigned long long)h->step_id, L);
    return rv;
}

static mm_err on_frame(void *arg, mm_conn *c, const mm_wire_hdr *h, void *payload) {
    (void)arg;
    if (h->kind == MM_WIRE_CTRL)
        return on_ctrl(c, h, payload);
    if (h->kind != MM_WIRE_ROWS) {
        mm_log_warn("data: unexpected %s frame", mm_wire_kind_name(h->kind));
        return MM_EPROTO;
    }
    char msg[200];
    if (h->flags & MM_MODEL_PLAN_FLAG) { // a plan frame in one piece: its shape in the header
        O.have_seg = false;
        O.plan = false;
        const uint64_t nk = h->aux, D = (uint64_t)O.d_model;
        const uint64_t P = (uint64_t)mm_model_plan_rows(O.n_experts, (int64_t)nk, (int64_t)D);
        const uint64_t R = h->n_rows > P ? h->n_rows - P : 0;
        if (h->flags != MM_MODEL_PLAN_FLAG || nk > (uint64_t)O.max_slots || R < 1 ||
            R > (uint64_t)O.max_rows || nk > R * (uint64_t)O.top_k || !O.dev_frames) {
            snprintf(msg, sizeof(msg), "bad plan frame (flags 0x%x, %u rows of which %llu the "
                     "plan's for %u slots; this owner takes %lld rows, top-k %d, flags 0x%x%s)",
                     h->flags, h->n_rows, (unsigned long long)P, h->aux, (long long)O.max_rows,
                     O.top_k, MM_MODEL_PLAN_FLAG, O.dev_frames ? "" : ", and no device frames");
            return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
        }
        O.plan_rows = (uint32_t)R;
        O.plan_slots = (uint32_t)nk;
        O.seg_step = h->step_id;
        O.seg_layer = h->layer;
        return on_plan(c, h, payload);
    }
    if (h->flags != 0) {
        snprintf(msg, sizeof(msg), "rows frame with unknown flags 0x%x", h->flags);
        O.have_seg = false;
        O.plan = false;
        return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
    }
    if (O.plan)
        return on_plan(c, h, payload);
    mm_mesh_trace(h->step_id, (int)h->layer, "rx");
    if (!O.have_seg || O.seg_step != h->step_id || O.seg_layer != h->layer ||
        O.seg_rows != h->n_rows || h->n_rows > O.max_slots ||
        h->row_dim != (uint32_t)O.d_model || h->format != MM_WIRE_F32 ||
        h->layer >= (uint32_t)O.n_layers) {
        snprintf(msg, sizeof(msg), "step %llu layer %u: %u rows of %u that no CTRL frame "
                 "announced (or over the %lld this owner takes)", (unsigned long long)h->step_id,
                 h->layer, h->n_rows, h->row_dim, (long long)O.max_slots);
        O.have_seg = false;
        return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
    }
    O.have_seg = false;
    const int L = (int)h->layer;
    for (uint32_t i = 0; i < O.n_seg; i++) {
        if (O.seg_e[i] >= (uint32_t)O.n_experts || !mm_placement_owns(O.pl, L, (int)O.seg_e[i], O.id)) {
            snprintf(msg, sizeof(msg), "expert owner %d does not hold expert %u of layer %d "
                     "(its placement names other owners for it)", O.id, O.seg_e[i], L);
            mm_log_warn("step %llu: refused rows: %s", (unsigned long long)h->step_id, msg);
            return mm_dataserv_reply_error(c, h, MM_EINVAL, msg);
        }
    }
    const float *x = payload;
    float *y = O.out;
    // device backends: the rows are already in O.d_x when they came as a device frame
    // (cudaipc://); otherwise all rows in one copy, outputs back in one copy after the experts
    const bool on_dev = dev_payload(payload);
    const size_t nb = (size_t)h->n_rows * (size_t)O.d_model * 4;
    if (O.d_x) {
        mm_err rv = on_dev ? MM_OK : O.be->ops->set(O.be->ctx, O.d_x, payload, nb);
        if (rv != MM_OK)
            return mm_dataserv_reply_error(c, h, rv, "copy of the rows to the device failed");
        x = on_dev ? payload : O.d_x, y = O.d_out;
    }
    // All of this frame's experts in grouped calls (mm_model_experts_forward: 3 products per
    // call on a backend with moe_matmul), at most max_rows rows per call; each row's bits are
    // mm_model_expert_forward's. Segments are in ascending expert order, so a chunk of rows
    // [c0, c1) maps to offsets by clamping each expert's first row into the chunk.
    const int64_t R = (int64_t)O.seg_rows;
    for (int64_t c0 = 0; c0 < R; c0 += O.max_rows) {
        const int64_t c1 = c0 + O.max_rows < R ? c0 + O.max_rows : R;
        int64_t start = 0;
        uint32_t si = 0;
        for (int e = 0; e <= O.n_experts; e++) {
            while (si < O.n_seg && (int)O.seg_e[si] < e)
                start += O.seg_n[si++];
            int64_t at = start < c0 ? c0 : start > c1 ? c1 : start;
            O.offs[e] = (int32_t)(at - c0);
        }
        O.offs[O.n_experts] = (int32_t)(c1 - c0);
        mm_err rv = mm_model_experts_forward(O.model, O.scratch, L, O.offs,
                                             x + c0 * (int64_t)O.d_model, c1 - c0,
                                             y + c0 * (int64_t)O.d_model);
        if (rv != MM_OK) {
            snprintf(msg, sizeof(msg), "experts of layer %d (rows %lld..%lld) failed: %s", L,
                     (long long)c0, (long long)c1, mm_strerror(rv));
            return mm_dataserv_reply_error(c, h, rv, msg);
        }
    }
    for (uint32_t i = 0; i < O.n_seg; i++)
        O.tokens[(size_t)L * (size_t)O.n_experts + O.seg_e[i]] += O.seg_n[i];
    O.dirty = true;
    mm_mesh_trace(h->step_id, L, "enq");
    mm_wire_hdr r;
    MM_TRY(mm_wire_hdr_init(&r, MM_WIRE_REPLY, MM_WIRE_F32, h->step_id, h->layer, h->n_rows,
                            h->row_dim));
    r.row_base = h->row_base;
    if (on_dev) { // outputs straight from the device into the router's ring
        struct iovec dv = {.iov_base = O.d_out, .iov_len = nb};
        return replied(h, L, mm_conn_sendv_dev(c, &r, &dv, 1, mm_deadline_in_ms(2000)));
    }
    if (O.d_x) {
        mm_err rv = O.be->ops->get(O.be->ctx, O.out, O.d_out, nb);
        if (rv != MM_OK)
            return mm_dataserv_reply_error(c, h, rv, "copy of the outputs from the device failed");
    }
    return replied(h, L, mm_conn_send(c, &r, O.out, mm_deadline_in_ms(2000)));
}

mm_err expert_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]) {
    (void)arg;
    const mm_daemon_conf *c = mm_daemon_get_conf(d);
    if (c->instance >= c->owners)
        return mm_errf(err, MM_EINVAL, "--instance %lld: the mesh has only --owners %lld expert "
                       "owners (instances 0..%lld)", c->instance, c->owners, c->owners - 1);
    char detail[128];
    if (!c->model) {
        snprintf(detail, sizeof(detail), "owner %lld of %lld, no model", c->instance, c->owners);
        mm_log_info("holding %s", detail);
        mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
        return MM_OK;
    }
    if (s_max_tokens < 1 || s_max_tokens > MAX_TOKENS) // (the buffer sizes below stay exact)
        return mm_errf(err, MM_EINVAL, "--max-batch-tokens must be 1..%d (got %lld)", MAX_TOKENS,
                       s_max_tokens);
    mm_model_config cfg;
    MM_TRY(mm_model_config_read(c->model, &cfg, err));
    MM_TRY(mm_placement_open(&O.pl, c->placement, &cfg, (int)c->owners, err));
    O.id = (int)c->instance;
    O.n_layers = cfg.n_layers;
    O.n_experts = cfg.n_experts;
    O.d_model = cfg.d_model;
    O.top_k = cfg.top_k;
    long held = mm_placement_count(O.pl, O.id);
    snprintf(detail, sizeof(detail), "owner %d of %lld, %ld (layer, expert) pairs", O.id,
             c->owners, held);
    if (!c->data) {
        mm_log_info("holding %s (no --data: control plane only)", detail);
        mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
        return MM_OK;
    }
    mm_backend_params bp = {.n_threads = (int)s_threads};
    mm_mesh_gpu_spin(c->device);
    MM_TRY(mm_backend_open(&O.be, c->device ? c->device : "cpu", &bp, err));
    MM_TRY(mm_model_open(&O.model, c->model, O.be, err));
    O.max_rows = s_max_tokens;
    MM_TRY(mm_model_scratch_new(&O.scratch, O.model, O.max_rows, err));
    int64_t rows = s_max_tokens * (cfg.top_k > 0 ? cfg.top_k : 1);
    O.max_slots = rows;
    O.out = malloc((size_t)rows * (size_t)O.d_model * 4);
    O.tokens = calloc((size_t)O.n_layers * (size_t)O.n_experts, sizeof(uint64_t));
    O.offs = calloc((size_t)O.n_experts + 1, sizeof(int32_t));
    if (!O.out || !O.tokens || !O.offs)
        return MM_ENOMEM;
    size_t cap = (size_t)rows * (size_t)O.d_model * 4;
    // d_x also takes a plan frame (on_plan): up to max_rows x rows, then the share of a plan of
    // max_rows * top_k slots as whole rows of d_model int32s; more than rows x rows where
    // top_k is 1 (or d_model is small)
    const int64_t plan_x = s_max_tokens + mm_model_plan_rows(O.n_experts, rows, O.d_model);
    const size_t cap_x = plan_x > rows ? (size_t)plan_x * (size_t)O.d_model * 4 : cap;
    if (!O.be->ops->host_memory) {
        MM_TRY(O.be->ops->buffer_alloc(O.be->ctx, cap_x, (void **)&O.d_x));
        MM_TRY(O.be->ops->buffer_alloc(O.be->ctx, cap, (void **)&O.d_out));
        // rows between GPU daemons in device memory where the data plane can (cudaipc://)
        char gerr[MM_ERRLEN] = "";
        O.dev_frames = mm_transport_gpu_use_backend(O.be->ctx, cap_x, gerr) == MM_OK;
        if (!O.dev_frames)
            mm_log_info("data plane: host frames only (%s)", gerr);
        // rows of plan frames are counted on the device (read at each load write)
        int sdev = 0;
        if (O.dev_frames && mm_gpu_mesh_count && mm_gpu_backend_stream &&
            mm_gpu_backend_stream(O.be->ctx, &O.stream, &sdev) == MM_OK) {
            const size_t ne = (size_t)O.n_layers * (size_t)O.n_experts;
            MM_TRY(O.be->ops->buffer_alloc(O.be->ctx, ne * 8, (void **)&O.d_tokens));
            O.tokens_dev = calloc(ne, 8);
            if (!O.tokens_dev)
                return MM_ENOMEM;
            MM_TRY(O.be->ops->set(O.be->ctx, O.d_tokens, O.tokens_dev, ne * 8));
            // plan frames' shares are checked on the device before their products read them
            // (MM_MESH_PLAN_CHECK=0: not checked, for an A/B of the check's cost)
            const char *pc = getenv("MM_MESH_PLAN_CHECK");
            if (pc && !strcmp(pc, "0")) {
                mm_log_warn("MM_MESH_PLAN_CHECK=0: plan frames' indices are not checked");
            } else {
                if (!mm_gpu_mesh_plan_check || !mm_gpu_host_pinned ||
                    mm_gpu_host_pinned((void **)&O.bad_plan, 8) != MM_OK)
                    return mm_errf(err, MM_ENOMEM, "no pinned host word for the plan check");
                O.bad_plan[0] = O.bad_plan[1] = 0;
            }
        }
    }
    // device frames handed over in place (no copy out of the ring; MM_MESH_VIEWS=0: into d_x)
    const bool views = O.dev_frames && mm_mesh_views_env();
    O.dirty = true; // write a first (all-zero) CSV soon after start
    MM_TRY(load_writer_start(err));
    const int tick_ms = s_load_ms > 0 ? (int)s_load_ms : 2000;
    if (views)
        MM_TRY(mm_dataserv_start_view(&O.ds, c->data, cap, on_frame, load_tick, tick_ms, NULL,
                                      err));
    else
        MM_TRY(mm_dataserv_start_dev(&O.ds, c->data, cap, O.dev_frames ? O.d_x : NULL, cap_x,
                                     on_frame, load_tick, tick_ms, NULL, err));
    mm_mesh_trace_open("expert");
    if (O.stream) // MM_MESH_TRACE_GPU=1: GPU stamps of the plan frames' products
        mm_mesh_gtrace_open("expert", O.stream);
    mm_log_info("holding %s; serving on %s", detail, c->data);
    mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
    return MM_OK;
}

void expert_stop(mm_daemon *d, void *arg) {
    (void)d;
    (void)arg;
    mm_dataserv_stop(O.ds);
    if (O.tokens)
        load_writer_stop();
    free(O.out);
    free(O.tokens);
    free(O.offs);
    free(O.tokens_dev);
    if (O.bad_plan && mm_gpu_host_pinned_free)
        mm_gpu_host_pinned_free(O.bad_plan);
    if (O.be) {
        O.be->ops->buffer_free(O.be->ctx, O.d_tokens);
        O.be->ops->buffer_free(O.be->ctx, O.d_x);
        O.be->ops->buffer_free(O.be->ctx, O.d_out);
    }
    mm_model_scratch_free(O.scratch);
    mm_model_close(O.model);
    mm_backend_close(O.be);
    mm_placement_free(O.pl);
    memset(&O, 0, sizeof(O));
}
