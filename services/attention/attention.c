// SPDX-License-Identifier: MIT
// Attention shard role; see attention.h. The data-plane protocol is docs/MESH.md's.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "mm/config.h"
#include "mm/dataserv.h"
#include "mm/log.h"
#include "mm/mesh_graph.h"
#include "mm/mesh_gtrace.h"
#include "mm/mesh_trace.h"
#include "mm/model.h"

static long long s_shards, s_max_seqs, s_max_tokens, s_threads, s_max_ctx;
static double s_kv_mb;
mm_opt attention_opts[] = {
    {"shards", MM_OPT_INT, &s_shards, "1", "number of attention shards in the mesh"},
    {"kv-mb", MM_OPT_DBL, &s_kv_mb, "64", "KV cache budget in MiB (paged pool; fractions allowed, "
     "e.g. 0.25). Stated to the mesh in this shard's hello: the gateway admits by it"},
    {"max-seqs", MM_OPT_INT, &s_max_seqs, "64", "sequences this shard holds at once"},
    {"max-ctx", MM_OPT_INT, &s_max_ctx, "4096", "longest sequence (capped by the model)"},
    {"max-batch-tokens", MM_OPT_INT, &s_max_tokens, "256", "rows per step (as the router's)"},
    {"threads", MM_OPT_INT, &s_threads, "0", "CPU threads (0: all cores)"},
    {0},
};

struct seq_map {
    uint64_t seq_id;
    int32_t slot; // -1: free entry
};

struct step_seq {
    int32_t slot, pos, n;
};

static struct attn {
    mm_backend *be;
    mm_model *model;
    mm_kv_cache *kv;
    mm_model_scratch *scratch;
    mm_dataserv *ds;
    int d_model, n_layers;
    struct seq_map *map;     // (max_seqs)
    struct step_seq *cur;    // (max_tokens) this step's seqs
    int32_t *row_seq, *row_pos; // (max_tokens)
    float *d_h;              // (max_tokens, d_model) backend copy of the rows (device backends)
    int n_cur, n_rows;
    uint64_t step_id;
    uint32_t next_layer;     // the layer whose rows come next
    bool reply_ring;         // views, MM_MESH_INPLACE and MM_SHARD_REPLY_RING (on unless 0)
    bool have_step;
    mm_err step_err;
    char step_msg[200];
} A;

static int map_find(uint64_t id) {
    for (int i = 0; i < s_max_seqs; i++)
        if (A.map[i].slot >= 0 && A.map[i].seq_id == id)
            return i;
    return -1;
}

static void seq_release(uint64_t id) {
    int i = map_find(id);
    if (i < 0)
        return;
    mm_kv_cache_seq_free(A.kv, A.map[i].slot);
    A.map[i].slot = -1;
}

// CTRL: u32 n_seqs, u32 n_release, n_seqs x {u64 seq_id, i32 pos, i32 n}, n_release x u64.
static mm_err on_ctrl(const mm_wire_hdr *h, const uint8_t *p) {
    size_t nb = h->payload_bytes;
    uint32_t ns, nr;
    A.have_step = false;
    if (nb < 8)
        return mm_errf(A.step_msg, MM_EPROTO, "step %llu: short CTRL frame",
                       (unsigned long long)h->step_id);
    memcpy(&ns, p, 4);
    memcpy(&nr, p + 4, 4);
    // Optional tail (drafting): u32 n_trunc, n_trunc x {u64 seq_id, i32 len, i32 0}: forget
    // the positions >= len of each (rejected draft rows), after the releases.
    size_t base = 8 + (size_t)ns * 16 + (size_t)nr * 8;
    uint32_t nt = 0;
    if (nb >= base + 4)
        memcpy(&nt, p + base, 4);
    if ((nb != base && nb != base + 4 + (size_t)nt * 16) || ns > (uint32_t)s_max_tokens)
        return mm_errf(A.step_msg, MM_EPROTO, "step %llu: CTRL frame of %zu bytes for %u seqs "
                       "and %u releases", (unsigned long long)h->step_id, nb, ns, nr);
    A.step_id = h->step_id;
    A.next_layer = 0;
    A.n_cur = 0;
    A.n_rows = 0;
    A.have_step = true;
    A.step_err = MM_OK;
    for (uint32_t i = 0; i < nr; i++) {
        uint64_t id;
        memcpy(&id, p + 8 + (size_t)ns * 16 + (size_t)i * 8, 8);
        seq_release(id);
    }
    for (uint32_t i = 0; i < nt; i++) {
        uint64_t id;
        int32_t len;
        memcpy(&id, p + base + 4 + (size_t)i * 16, 8);
        memcpy(&len, p + base + 12 + (size_t)i * 16, 4);
        int mi = map_find(id);
        if (mi >= 0 && len >= 0 && len < mm_kv_cache_seq_len(A.kv, A.map[mi].slot))
            mm_kv_cache_truncate(A.kv, A.map[mi].slot, len);
    }
    for (uint32_t i = 0; i < ns; i++) {
        uint64_t id;
        int32_t pos, n;
        memcpy(&id, p + 8 + (size_t)i * 16, 8);
        memcpy(&pos, p + 16 + (size_t)i * 16, 4);
        memcpy(&n, p + 20 + (size_t)i * 16, 4);
        if (n < 1 || A.n_rows + n > s_max_tokens || pos < 0)
            return mm_errf(A.step_msg, MM_EPROTO, "seq %llu: %d tokens at %d do not fit "
                           "--max-batch-tokens %lld", (unsigned long long)id, n, pos,
                           s_max_tokens);
        int mi = map_find(id);
        if (mi < 0) {
            if (pos != 0)
                return mm_errf(A.step_msg, MM_EPROTO, "seq %llu: position %d, but this shard "
                               "holds no KV for it (expected 0: restarted shard or released "
                               "seq)", (unsigned long long)id, pos);
            for (mi = 0; mi < s_max_seqs && A.map[mi].slot >= 0; mi++)
                ;
            int32_t slot;
            if (mi == s_max_seqs || mm_kv_cache_seq_new(A.kv, &slot) != MM_OK)
                return mm_errf(A.step_msg, MM_EFULL, "seq %llu: no free sequence slot (--max-seqs "
                               "%lld)", (unsigned long long)id, s_max_seqs);
            A.map[mi].seq_id = id;
            A.map[mi].slot = slot;
        }
        int32_t slot = A.map[mi].slot, len = mm_kv_cache_seq_len(A.kv, slot);
        if (len != pos)
            return mm_errf(A.step_msg, MM_EPROTO, "seq %llu: position %d, but its KV length is %d",
                           (unsigned long long)id, pos, len);
        mm_err rv = mm_kv_cache_reserve(A.kv, slot, pos + n);
        if (rv != MM_OK)
            return mm_errf(A.step_msg, rv, "seq %llu: cannot hold %d tokens: %s (--kv-mb %g, "
                           "--max-ctx %lld)", (unsigned long long)id, pos + n, mm_strerror(rv),
                           s_kv_mb, s_max_ctx);
        A.cur[A.n_cur++] = (struct step_seq){slot, pos, n};
        for (int32_t t = 0; t < n; t++) {
            A.row_seq[A.n_rows] = slot;
            A.row_pos[A.n_rows] = pos + t;
            A.n_rows++;
        }
    }
    return MM_OK;
}

static mm_err on_frame(void *arg, mm_conn *c, const mm_wire_hdr *h, void *payload) {
    (void)arg;
    if (h->kind == MM_WIRE_CTRL) {
        A.step_err = on_ctrl(h, payload);
        if (A.step_err != MM_OK)
            mm_log_warn("step %llu: %s", (unsigned long long)h->step_id, A.step_msg);
        return MM_OK; // no reply: the layer-0 rows get the answer
    }
    if (h->kind != MM_WIRE_ROWS) {
        mm_log_warn("data: unexpected %s frame", mm_wire_kind_name(h->kind));
        return MM_EPROTO;
    }
    if (!A.have_step || h->step_id != A.step_id)
        return mm_dataserv_reply_error(c, h, MM_EPROTO, "rows for a step this shard was not told "
                                       "about (no CTRL frame)");
    if (A.step_err != MM_OK)
        return mm_dataserv_reply_error(c, h, A.step_err, A.step_msg);
    // MM_MODEL_NORMED_FLAG: the frame holds the rows, then their input norm (a device frame)
    const bool normed = (h->flags & MM_MODEL_NORMED_FLAG) != 0;
    // device backends: the rows go through the backend copy d_h and come back in place; a
    // device frame (cudaipc://) already landed in d_h and its reply leaves from there
    // (a device frame's rows are handed over in the conn's ring (MM_MESH_VIEWS, on unless 0) and
    // attention runs on them there, the reply leaving from there: no copy in)
    const bool on_dev = A.d_h != NULL && (payload == (void *)A.d_h || mm_dataserv_on_dev(payload));
    if (h->layer != A.next_layer || h->layer >= (uint32_t)A.n_layers ||
        h->n_rows != (uint32_t)A.n_rows * (normed ? 2u : 1u) ||
        h->row_dim != (uint32_t)A.d_model || h->format != MM_WIRE_F32 ||
        (h->flags & ~MM_MODEL_NORMED_FLAG) != 0 || (normed && !on_dev)) {
        char msg[200];
        snprintf(msg, sizeof(msg), "step %llu: rows for layer %u (%u x %u%s, flags %u), expected "
                 "layer %u (%d x %d f32, or twice the rows as a device frame with flag %u)",
                 (unsigned long long)h->step_id, h->layer, h->n_rows, h->row_dim,
                 on_dev ? ", device" : "", h->flags, A.next_layer, A.n_rows, A.d_model,
                 MM_MODEL_NORMED_FLAG);
        A.step_err = MM_EPROTO;
        snprintf(A.step_msg, sizeof(A.step_msg), "%s", msg);
        return mm_dataserv_reply_error(c, h, MM_EPROTO, msg);
    }
    mm_mesh_trace(h->step_id, (int)h->layer, "rx");
    mm_mesh_gstamp(h->step_id, (int)h->layer, "rx");
    mm_model_rows rows = {.n_rows = A.n_rows, .seq = A.row_seq, .pos = A.row_pos};
    float *hd = on_dev ? (float *)payload : A.d_h; // the rows attention works on (device)
    const size_t nb = (size_t)A.n_rows * (size_t)A.d_model * 4;
    const float *xn = normed ? hd + (size_t)A.n_rows * (size_t)A.d_model : NULL;
    // a device frame's reply written straight into its place in the router's ring where the
    // link gives one (views and MM_MESH_INPLACE: no copy at the send; with the backend's
    // matmul_res the residual is added by o_proj itself, so the shard's stage ends in o_proj)
    void *out = NULL;
    if (on_dev && payload != (void *)A.d_h && A.reply_ring &&
        mm_conn_reserve_dev(c, nb, &out, mm_deadline_in_ms(2000)) != MM_OK)
        out = NULL; // (a send from the view reports whatever is wrong with the link)
    mm_err rv = A.d_h && !on_dev ? A.be->ops->set(A.be->ctx, A.d_h, payload, nb) : MM_OK;
    if (rv == MM_OK)
        rv = mm_model_attn_forward_to(A.model, A.scratch, (int)h->layer, A.kv, &rows,
                                      hd ? hd : (float *)payload, xn,
                                      out ? (float *)out : NULL);
    if (rv == MM_OK && A.d_h && !on_dev)
        rv = A.be->ops->get(A.be->ctx, payload, A.d_h, nb);
    if (rv != MM_OK) {
        A.step_err = rv;
        snprintf(A.step_msg, sizeof(A.step_msg), "attention layer %u failed: %s", h->layer,
                 mm_strerror(rv));
        return mm_dataserv_reply_error(c, h, rv, A.step_msg);
    }
    A.next_layer++;
    mm_mesh_trace(h->step_id, (int)h->layer, "enq");
    mm_mesh_gstamp(h->step_id, (int)h->layer, "enq");
    mm_wire_hdr r;
    MM_TRY(mm_wire_hdr_init(&r, MM_WIRE_REPLY, MM_WIRE_F32, h->step_id, h->layer,
                            (uint32_t)A.n_rows, h->row_dim)); // (a normed frame: half its rows)
    r.row_base = h->row_base;
    if (on_dev) {
        struct iovec dv = {.iov_base = out ? out : hd, .iov_len = nb};
        rv = mm_conn_sendv_dev(c, &r, &dv, 1, mm_deadline_in_ms(2000));
        mm_mesh_trace(h->step_id, (int)h->layer, "tx");
        if (h->layer + 1 == (uint32_t)A.n_layers) {
            mm_mesh_trace_flush();
            mm_mesh_gtrace_flush();
        }
        return rv;
    }
    rv = mm_conn_send(c, &r, payload, mm_deadline_in_ms(2000));
    mm_mesh_trace(h->step_id, (int)h->layer, "tx");
    if (h->layer + 1 == (uint32_t)A.n_layers)
        mm_mesh_trace_flush();
    return rv;
}

mm_err attention_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]) {
    (void)arg;
    const mm_daemon_conf *c = mm_daemon_get_conf(d);
    if (s_shards < 1 || c->instance >= s_shards)
        return mm_errf(err, MM_EINVAL, "--instance %lld: the mesh has --shards %lld attention "
                       "shards (instances 0..%lld)", c->instance, s_shards, s_shards - 1);
    char detail[96];
    snprintf(detail, sizeof(detail), "shard %lld of %lld", c->instance, s_shards);
    if (!c->model || !c->data) {
        mm_log_info("serving attention %s (no --model/--data: control plane only)", detail);
        mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
        return MM_OK;
    }
    if (s_max_tokens < 1 || s_max_seqs < 1 || s_max_ctx < 1)
        return mm_errf(err, MM_EINVAL, "--max-batch-tokens, --max-seqs and --max-ctx must be "
                       ">= 1");
    if (!(s_kv_mb > 0) || s_kv_mb > 1048576.0 * 64)
        return mm_errf(err, MM_EINVAL, "--kv-mb %g: must be > 0 and at most 64 TiB", s_kv_mb);
    mm_backend_params bp = {.n_threads = (int)s_threads};
    mm_mesh_gpu_spin(c->device);
    MM_TRY(mm_backend_open(&A.be, c->device ? c->device : "cpu", &bp, err));
    MM_TRY(mm_model_open(&A.model, c->model, A.be, err));
    const mm_model_config *cfg = mm_model_cfg(A.model);
    A.d_model = cfg->d_model;
    A.n_layers = cfg->n_layers;
    mm_kv_params kp;
    mm_model_kv_params(A.model, &kp);
    kp.max_seqs = (int)s_max_seqs;
    kp.max_ctx = (int)(cfg->max_pos > 0 && s_max_ctx > cfg->max_pos ? cfg->max_pos : s_max_ctx);
    kp.budget_bytes = (size_t)(s_kv_mb * 1048576.0);
    MM_TRY(mm_kv_cache_new(&A.kv, &kp, A.be, err));
    MM_TRY(mm_model_scratch_new(&A.scratch, A.model, s_max_tokens, err));
    A.map = calloc((size_t)s_max_seqs, sizeof(*A.map));
    A.cur = calloc((size_t)s_max_tokens, sizeof(*A.cur));
    A.row_seq = calloc((size_t)s_max_tokens, sizeof(int32_t));
    A.row_pos = calloc((size_t)s_max_tokens, sizeof(int32_t));
    if (!A.map || !A.cur || !A.row_seq || !A.row_pos)
        return MM_ENOMEM;
    // (twice the rows: a frame of rows and their input norm, MM_MODEL_NORMED_FLAG)
    const size_t d_cap = 2 * (size_t)s_max_tokens * (size_t)A.d_model * 4;
    bool dev_frames = false;
    if (!A.be->ops->host_memory) {
        MM_TRY(A.be->ops->buffer_alloc(A.be->ctx, d_cap, (void **)&A.d_h));
        // rows between GPU daemons in device memory where the data plane can (cudaipc://)
        char gerr[MM_ERRLEN] = "";
        dev_frames = mm_transport_gpu_use_backend(A.be->ctx, d_cap, gerr) == MM_OK;
        if (!dev_frames)
            mm_log_info("data plane: host frames only (%s)", gerr);
    }
    // device frames handed over in place (no copy out of the ring; MM_MESH_VIEWS=0: copied into
    // d_h as before)
    const bool views = dev_frames && mm_mesh_views_env();
    A.reply_ring = views && mm_mesh_inplace_env() && !mm_env_off("MM_SHARD_REPLY_RING");
    for (int i = 0; i < s_max_seqs; i++)
        A.map[i].slot = -1;
    size_t cap = (size_t)s_max_tokens * (size_t)A.d_model * 4;
    if (cap < 12 + (size_t)s_max_tokens * 32 + 4096) // CTRL frames with releases, truncations
        cap = 12 + (size_t)s_max_tokens * 32 + 4096;
    if (views)
        MM_TRY(mm_dataserv_start_view(&A.ds, c->data, cap, on_frame, NULL, 1000, NULL, err));
    else
        MM_TRY(mm_dataserv_start_dev(&A.ds, c->data, cap, dev_frames ? A.d_h : NULL, d_cap,
                                     on_frame, NULL, 1000, NULL, err));
    snprintf(detail, sizeof(detail), "shard %lld of %lld, kv %d blocks %s", c->instance,
             s_shards, mm_kv_cache_blocks_total(A.kv), kp.dtype == MM_DTYPE_BF16 ? "bf16" : "f32");
    // the cache's own figure (bf16 on CUDA's tensor-core attention), stated in our Hello: the
    // gateway admits by it (docs/GATEWAY.md, "KV admission")
    mm_kv_capacity kvc = {.block_size = (uint32_t)kp.block_size,
                          .blocks = (uint64_t)mm_kv_cache_blocks_total(A.kv),
                          .token_bytes = (uint32_t)mm_kv_token_bytes(&kp),
                          .budget_bytes = (uint64_t)kp.budget_bytes,
                          .max_seqs = (uint32_t)kp.max_seqs,
                          .max_ctx = (uint32_t)kp.max_ctx};
    MM_TRY(mm_kv_capacity_check(&kvc, err));
    MM_TRY(mm_daemon_set_kv_capacity(d, &kvc, err));
    mm_log_info("kv cache: %s, %zu bytes per token, %lld tokens in --kv-mb %g (%d seqs of up "
                "to %d tokens)", kp.dtype == MM_DTYPE_BF16 ? "bf16" : "f32",
                mm_kv_token_bytes(&kp), (long long)mm_kv_cache_blocks_total(A.kv) * kp.block_size,
                s_kv_mb, kp.max_seqs, kp.max_ctx);
    mm_mesh_trace_open("attention");
    if (dev_frames) // MM_MESH_TRACE_GPU=1: GPU stamps
        mm_mesh_gtrace_open_backend("attention", A.be->ctx);
    mm_log_info("serving attention %s on %s", detail, c->data);
    mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
    return MM_OK;
}

void attention_stop(mm_daemon *d, void *arg) {
    (void)d;
    (void)arg;
    mm_dataserv_stop(A.ds);
    free(A.map);
    free(A.cur);
    free(A.row_seq);
    free(A.row_pos);
    if (A.be)
        A.be->ops->buffer_free(A.be->ctx, A.d_h);
    mm_model_scratch_free(A.scratch);
    mm_kv_cache_free(A.kv);
    mm_model_close(A.model);
    mm_backend_close(A.be);
    memset(&A, 0, sizeof(A));
}
