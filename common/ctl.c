// SPDX-License-Identifier: MIT
// Control plane codec, REP server and REQ client over nng; see mm/ctl.h.
//
// Design notes:
// - Server contexts run a two-state machine (RECV -> handler -> SEND -> RECV) on their aio
//   callback. Closing sets `closing`, stops every aio (nng_aio_stop waits for a running
//   callback, and any later submit fails at once), then closes the socket.
// - A synchronous call opens its own nng context, so calls from several threads never cancel
//   each other (a REQ socket's plain send would).
#include <arpa/inet.h>
#include <errno.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "mm/ctl.h"
#include "mm/log.h"
#include "mm/mesh_trace.h"
#include "mm/time.h"

// ---- codec ---------------------------------------------------------------------------------

mm_err mm_ctl_pack(mm_ctl_msg *env, nng_msg **out, char err[MM_ERRLEN]) {
    env->version = MM_CTL_WIRE_VERSION;
    size_t n = mmctl__envelope__get_packed_size(env);
    if (n > MM_CTL_MAX_MSG_BYTES)
        return mm_errf(err, MM_EINVAL, "control message %s is %zu bytes, over the %u limit",
                       mm_ctl_body_name(env), n, MM_CTL_MAX_MSG_BYTES);
    nng_msg *m = NULL;
    if (nng_msg_alloc(&m, n) != 0)
        return mm_errf(err, MM_ENOMEM, "nng_msg_alloc(%zu)", n);
    mmctl__envelope__pack(env, nng_msg_body(m));
    *out = m;
    return MM_OK;
}

static mm_err check_str(const char *s, const char *what, char *err) {
    if (s == NULL)
        return mm_errf(err, MM_EPROTO, "%s missing", what);
    if (strnlen(s, MM_CTL_MAX_STR + 1) > MM_CTL_MAX_STR)
        return mm_errf(err, MM_EPROTO, "%s longer than %d bytes", what, MM_CTL_MAX_STR);
    return MM_OK;
}

static mm_err check_role(const char *role, const char *what, char *err) {
    MM_TRY(check_str(role, what, err));
    if (mm_role_index(role) < 0)
        return mm_errf(err, MM_EPROTO, "%s '%.40s' is not a role", what, role);
    return MM_OK;
}

static mm_err check_identity(const Mmctl__Identity *id, const char *what, char *err) {
    if (id == NULL)
        return mm_errf(err, MM_EPROTO, "%s: identity missing", what);
    MM_TRY(check_role(id->role, "identity.role", err));
    const struct { const char *s; const char *name; size_t max; } f[] = {
        {id->build_id, "identity.build_id", 63},
        {id->model_fingerprint, "identity.model_fingerprint", MM_FP_LEN - 1},
        {id->placement_fingerprint, "identity.placement_fingerprint", MM_FP_LEN - 1},
        {id->control_addr, "identity.control_addr", MM_ADDR_LEN - 1},
        {id->data_addr, "identity.data_addr", MM_ADDR_LEN - 1},
        {id->host, "identity.host", 63},
        {id->device, "identity.device", 31},
        {id->numerics, "identity.numerics", 31},
    };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
        MM_TRY(check_str(f[i].s, f[i].name, err));
        if (strlen(f[i].s) > f[i].max)
            return mm_errf(err, MM_EPROTO, "%s longer than %zu bytes", f[i].name, f[i].max);
    }
    if (id->instance > 65535)
        return mm_errf(err, MM_EPROTO, "identity.instance %u out of range", id->instance);
    return MM_OK;
}

#define NEED(ptr, name)                                                                  \
    do {                                                                                 \
        if ((ptr) == NULL)                                                               \
            return mm_errf(err, MM_EPROTO, "body %s missing", name);                     \
    } while (0)

mm_err mm_ctl_validate(const mm_ctl_msg *e, char err[MM_ERRLEN]) {
    if (e->version != MM_CTL_WIRE_VERSION)
        return mm_errf(err, MM_EPROTO, "wire version %u, expected %u", e->version,
                       MM_CTL_WIRE_VERSION);
    switch (e->body_case) {
    case MMCTL__ENVELOPE__BODY_HELLO:
        NEED(e->hello, "hello");
        return check_identity(e->hello->identity, "hello", err);
    case MMCTL__ENVELOPE__BODY_WELCOME:
        NEED(e->welcome, "welcome");
        return check_identity(e->welcome->router, "welcome", err);
    case MMCTL__ENVELOPE__BODY_REFUSED:
        NEED(e->refused, "refused");
        MM_TRY(check_str(e->refused->field, "refused.field", err));
        MM_TRY(check_str(e->refused->router_value, "refused.router_value", err));
        MM_TRY(check_str(e->refused->daemon_value, "refused.daemon_value", err));
        return check_str(e->refused->reason, "refused.reason", err);
    case MMCTL__ENVELOPE__BODY_HEARTBEAT:
        NEED(e->heartbeat, "heartbeat");
        MM_TRY(check_role(e->heartbeat->role, "heartbeat.role", err));
        return check_str(e->heartbeat->detail, "heartbeat.detail", err);
    case MMCTL__ENVELOPE__BODY_HEARTBEAT_ACK:
        NEED(e->heartbeat_ack, "heartbeat_ack");
        return MM_OK;
    case MMCTL__ENVELOPE__BODY_GOODBYE:
        NEED(e->goodbye, "goodbye");
        MM_TRY(check_role(e->goodbye->role, "goodbye.role", err));
        return check_str(e->goodbye->reason, "goodbye.reason", err);
    case MMCTL__ENVELOPE__BODY_STATUS_REQUEST:
        NEED(e->status_request, "status_request");
        return MM_OK;
    case MMCTL__ENVELOPE__BODY_STATUS_REPLY:
        NEED(e->status_reply, "status_reply");
        MM_TRY(check_identity(e->status_reply->router, "status_reply.router", err));
        for (size_t i = 0; i < e->status_reply->n_members; i++) {
            const Mmctl__Member *m = e->status_reply->members[i];
            if (m == NULL)
                return mm_errf(err, MM_EPROTO, "status_reply.members[%zu] missing", i);
            MM_TRY(check_identity(m->identity, "status_reply.member", err));
            MM_TRY(check_str(m->detail, "member.detail", err));
        }
        return MM_OK;
    case MMCTL__ENVELOPE__BODY_SHUTDOWN:
        NEED(e->shutdown, "shutdown");
        return check_str(e->shutdown->reason, "shutdown.reason", err);
    case MMCTL__ENVELOPE__BODY_DRAIN:
        NEED(e->drain, "drain");
        return check_str(e->drain->reason, "drain.reason", err);
    case MMCTL__ENVELOPE__BODY_ACK:
        NEED(e->ack, "ack");
        return check_str(e->ack->error, "ack.error", err);
    case MMCTL__ENVELOPE__BODY_STEP_PLAN:
        NEED(e->step_plan, "step_plan");
        for (size_t i = 0; i < e->step_plan->n_seqs; i++) {
            const Mmctl__SeqStep *q = e->step_plan->seqs[i];
            if (q == NULL)
                return mm_errf(err, MM_EPROTO, "step_plan.seqs[%zu] missing", i);
            if (q->n_tokens == 0 && !q->follow)
                return mm_errf(err, MM_EPROTO, "step_plan.seqs[%zu] (seq %llu) has no tokens", i,
                               (unsigned long long)q->seq_id);
            if (q->follow && (q->n_tokens != 0 || q->pos != 0 || e->step_plan->after_step == 0))
                return mm_errf(err, MM_EPROTO, "step_plan.seqs[%zu] (seq %llu) follows the "
                               "router's pick: it needs after_step, no tokens and pos 0 (has "
                               "%zu tokens, pos %u, after_step %llu)", i,
                               (unsigned long long)q->seq_id, q->n_tokens, q->pos,
                               (unsigned long long)e->step_plan->after_step);
        }
        return MM_OK;
    case MMCTL__ENVELOPE__BODY_STEP_RESULT:
        NEED(e->step_result, "step_result");
        MM_TRY(check_str(e->step_result->error, "step_result.error", err));
        for (size_t i = 0; i < e->step_result->n_results; i++) {
            const Mmctl__SeqResult *q = e->step_result->results[i];
            if (q == NULL)
                return mm_errf(err, MM_EPROTO, "step_result.results[%zu] missing", i);
            MM_TRY(check_str(q->error, "seq_result.error", err));
            if (q->n_more != q->n_more_logprobs)
                return mm_errf(err, MM_EPROTO, "seq_result: %zu more tokens but %zu logprobs",
                               q->n_more, q->n_more_logprobs);
            for (size_t j = 0; j < q->n_top; j++)
                if (q->top[j] == NULL)
                    return mm_errf(err, MM_EPROTO, "seq_result.top[%zu] missing", j);
        }
        return MM_OK;
    case MMCTL__ENVELOPE__BODY_DRAFT_REQUEST:
        NEED(e->draft_request, "draft_request");
        for (size_t i = 0; i < e->draft_request->n_seqs; i++)
            if (e->draft_request->seqs[i] == NULL)
                return mm_errf(err, MM_EPROTO, "draft_request.seqs[%zu] missing", i);
        return MM_OK;
    case MMCTL__ENVELOPE__BODY_DRAFT_REPLY:
        NEED(e->draft_reply, "draft_reply");
        for (size_t i = 0; i < e->draft_reply->n_seqs; i++)
            if (e->draft_reply->seqs[i] == NULL)
                return mm_errf(err, MM_EPROTO, "draft_reply.seqs[%zu] missing", i);
        return MM_OK;
    case MMCTL__ENVELOPE__BODY__NOT_SET:
    default:
        return mm_errf(err, MM_EPROTO, "envelope has no known body (case %d)", (int)e->body_case);
    }
}

mm_err mm_ctl_unpack(const void *buf, size_t n, mm_ctl_msg **out, char err[MM_ERRLEN]) {
    *out = NULL;
    if (n > MM_CTL_MAX_MSG_BYTES)
        return mm_errf(err, MM_EPROTO, "%zu bytes is over the %u limit", n, MM_CTL_MAX_MSG_BYTES);
    mm_ctl_msg *e = mmctl__envelope__unpack(NULL, n, buf);
    if (e == NULL)
        return mm_errf(err, MM_EPROTO, "not a control envelope (%zu bytes that do not decode)", n);
    mm_err rv = mm_ctl_validate(e, err);
    if (rv != MM_OK) {
        mmctl__envelope__free_unpacked(e, NULL);
        return rv;
    }
    *out = e;
    return MM_OK;
}

void mm_ctl_msg_free(mm_ctl_msg *env) {
    if (env)
        mmctl__envelope__free_unpacked(env, NULL);
}

const char *mm_ctl_body_name(const mm_ctl_msg *env) {
    switch (env->body_case) {
    case MMCTL__ENVELOPE__BODY_HELLO: return "hello";
    case MMCTL__ENVELOPE__BODY_WELCOME: return "welcome";
    case MMCTL__ENVELOPE__BODY_REFUSED: return "refused";
    case MMCTL__ENVELOPE__BODY_HEARTBEAT: return "heartbeat";
    case MMCTL__ENVELOPE__BODY_HEARTBEAT_ACK: return "heartbeat_ack";
    case MMCTL__ENVELOPE__BODY_GOODBYE: return "goodbye";
    case MMCTL__ENVELOPE__BODY_STATUS_REQUEST: return "status_request";
    case MMCTL__ENVELOPE__BODY_STATUS_REPLY: return "status_reply";
    case MMCTL__ENVELOPE__BODY_SHUTDOWN: return "shutdown";
    case MMCTL__ENVELOPE__BODY_DRAIN: return "drain";
    case MMCTL__ENVELOPE__BODY_ACK: return "ack";
    case MMCTL__ENVELOPE__BODY_STEP_PLAN: return "step_plan";
    case MMCTL__ENVELOPE__BODY_STEP_RESULT: return "step_result";
    case MMCTL__ENVELOPE__BODY_DRAFT_REQUEST: return "draft_request";
    case MMCTL__ENVELOPE__BODY_DRAFT_REPLY: return "draft_reply";
    default: return "none";
    }
}

void mm_ctl_identity_to_pb(const mm_identity *id, Mmctl__Identity *pb) {
    mmctl__identity__init(pb);
    pb->protocol_version = id->protocol_version;
    pb->build_id = (char *)id->build_id;
    pb->model_fingerprint = (char *)id->model_fp;
    pb->placement_fingerprint = (char *)id->placement_fp;
    pb->role = (char *)id->role;
    pb->instance = id->instance;
    pb->control_addr = (char *)id->control_addr;
    pb->data_addr = (char *)id->data_addr;
    pb->incarnation = id->incarnation;
    pb->pid = id->pid;
    pb->host = (char *)id->host;
    pb->device = (char *)id->device;
    pb->heartbeat_ms = id->heartbeat_ms;
    pb->numerics = (char *)id->numerics;
    pb->kv_block_size = id->kv.block_size;
    pb->kv_blocks = id->kv.blocks;
    pb->kv_token_bytes = id->kv.token_bytes;
    pb->kv_budget_bytes = id->kv.budget_bytes;
    pb->max_seqs = id->kv.max_seqs;
    pb->max_ctx = id->kv.max_ctx;
}

void mm_ctl_identity_from_pb(const Mmctl__Identity *pb, mm_identity *id) {
    memset(id, 0, sizeof(*id));
    id->protocol_version = pb->protocol_version;
    snprintf(id->build_id, sizeof(id->build_id), "%s", pb->build_id);
    snprintf(id->model_fp, sizeof(id->model_fp), "%s", pb->model_fingerprint);
    snprintf(id->placement_fp, sizeof(id->placement_fp), "%s", pb->placement_fingerprint);
    snprintf(id->role, sizeof(id->role), "%s", pb->role);
    id->instance = pb->instance;
    snprintf(id->control_addr, sizeof(id->control_addr), "%s", pb->control_addr);
    snprintf(id->data_addr, sizeof(id->data_addr), "%s", pb->data_addr);
    id->incarnation = pb->incarnation;
    id->pid = pb->pid;
    snprintf(id->host, sizeof(id->host), "%s", pb->host);
    snprintf(id->device, sizeof(id->device), "%s", pb->device);
    id->heartbeat_ms = pb->heartbeat_ms;
    snprintf(id->numerics, sizeof(id->numerics), "%s", pb->numerics);
    id->kv.block_size = pb->kv_block_size;
    id->kv.blocks = pb->kv_blocks;
    id->kv.token_bytes = pb->kv_token_bytes;
    id->kv.budget_bytes = pb->kv_budget_bytes;
    id->kv.max_seqs = pb->max_seqs;
    id->kv.max_ctx = pb->max_ctx;
}

const char *mm_ctl_health_name(Mmctl__Health h) {
    switch (h) {
    case MMCTL__HEALTH__HEALTH_STARTING: return "starting";
    case MMCTL__HEALTH__HEALTH_READY: return "ready";
    case MMCTL__HEALTH__HEALTH_DRAINING: return "draining";
    case MMCTL__HEALTH__HEALTH_DOWN: return "down";
    default: return "unknown";
    }
}

// ---- helpers -------------------------------------------------------------------------------

mm_err mm_ctl_url_prepare(const char *url, char err[MM_ERRLEN]) {
    if (url == NULL || !*url)
        return mm_errf(err, MM_EINVAL, "empty control address");
    if (strncmp(url, "ipc://", 6) != 0)
        return MM_OK;
    const char *path = url + 6;
    if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
        return mm_errf(err, MM_EINVAL, "%s: ipc path longer than %zu bytes", url,
                       sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
    char dir[256];
    snprintf(dir, sizeof(dir), "%s", path);
    for (char *p = dir + 1; *p; p++) // mkdir -p of every parent
        if (*p == '/') {
            *p = 0;
            if (mkdir(dir, 0755) != 0 && errno != EEXIST)
                return mm_errf(err, MM_ESYS, "%s: mkdir %s: %s", url, dir, strerror(errno));
            *p = '/';
        }
    return MM_OK;
}

static void peer_name(nng_msg *m, char *buf, size_t n) {
    nng_pipe p = nng_msg_get_pipe(m);
    nng_sockaddr sa;
    uint64_t pid = 0;
    if (nng_pipe_get_addr(p, NNG_OPT_REMADDR, &sa) == 0) {
        char ip[64];
        if (sa.s_family == NNG_AF_INET) {
            inet_ntop(AF_INET, &sa.s_in.sa_addr, ip, sizeof(ip));
            snprintf(buf, n, "tcp %s:%u", ip, ntohs(sa.s_in.sa_port));
            return;
        }
        if (sa.s_family == NNG_AF_INET6) {
            inet_ntop(AF_INET6, sa.s_in6.sa_addr, ip, sizeof(ip));
            snprintf(buf, n, "tcp [%s]:%u", ip, ntohs(sa.s_in6.sa_port));
            return;
        }
    }
    if (nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_PID, &pid) == 0) {
        snprintf(buf, n, "ipc pid %llu", (unsigned long long)pid);
        return;
    }
    snprintf(buf, n, "pipe %u", (unsigned)nng_pipe_id(p));
}

static mm_err nng_to_mm(int rv) {
    switch (rv) {
    case 0: return MM_OK;
    case NNG_ETIMEDOUT: return MM_ETIMEDOUT;
    case NNG_ECLOSED: return MM_ECLOSED;
    case NNG_ECANCELED: return MM_ECANCELED;
    case NNG_ENOMEM: return MM_ENOMEM;
    case NNG_EADDRINVAL: case NNG_EINVAL: case NNG_ENOTSUP: return MM_EINVAL;
    default: return MM_ETRANSPORT;
    }
}

static mm_err set_limits(nng_socket s, const char *url, char *err) {
    int rv = nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, MM_CTL_MAX_MSG_BYTES);
    if (rv == 0)
        rv = nng_socket_set_ms(s, NNG_OPT_RECONNMINT, 50);
    if (rv == 0)
        rv = nng_socket_set_ms(s, NNG_OPT_RECONNMAXT, 500);
    if (rv != 0)
        return mm_errf(err, MM_ETRANSPORT, "%s: socket options: %s", url, nng_strerror(rv));
    return MM_OK;
}

nng_msg *mm_ctl_reply(mm_ctl_msg *env) {
    nng_msg *m = NULL;
    char err[MM_ERRLEN] = "";
    if (mm_ctl_pack(env, &m, err) != MM_OK) {
        mm_log_error("ctl: cannot pack %s reply: %s", mm_ctl_body_name(env), err);
        return NULL;
    }
    return m;
}

nng_msg *mm_ctl_reply_ack(bool ok, const char *error) {
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    Mmctl__Ack ack = MMCTL__ACK__INIT;
    char buf[MM_CTL_MAX_STR];
    ack.ok = ok;
    snprintf(buf, sizeof(buf), "%s", error ? error : "");
    ack.error = buf;
    env.body_case = MMCTL__ENVELOPE__BODY_ACK;
    env.ack = &ack;
    return mm_ctl_reply(&env);
}

// ---- server --------------------------------------------------------------------------------

enum { SRV_RECV, SRV_SEND };

struct srv_ctx {
    mm_ctl_server *srv;
    nng_ctx ctx;
    nng_aio *aio;
    int state;
    bool ctx_open;
    uint64_t trace_step; // MM_MESH_TRACE: step id + 1 of the plan being answered (0: none)
};

struct mm_ctl_server {
    nng_socket sock;
    bool sock_open;
    atomic_bool closing;
    mm_ctl_handler fn;
    void *arg;
    int n_ctx;
    struct srv_ctx *ctxs; // (n_ctx,)
    char url[MM_ADDR_LEN];
};

static void srv_recv(struct srv_ctx *c) {
    c->state = SRV_RECV;
    nng_ctx_recv(c->ctx, c->aio);
}

static void on_srv_aio(void *arg) {
    struct srv_ctx *c = arg;
    mm_ctl_server *s = c->srv;
    int rv = nng_aio_result(c->aio);
    if (c->state == SRV_SEND) {
        if (c->trace_step) {
            mm_mesh_trace(c->trace_step - 1, -1, "sent");
            mm_mesh_trace_flush();
            c->trace_step = 0;
        }
        if (rv != 0) {
            nng_msg_free(nng_aio_get_msg(c->aio));
            nng_aio_set_msg(c->aio, NULL);
        }
        if (atomic_load(&s->closing) || rv == NNG_ECLOSED || rv == NNG_ECANCELED)
            return;
        srv_recv(c);
        return;
    }
    if (rv != 0) {
        if (atomic_load(&s->closing) || rv == NNG_ECLOSED || rv == NNG_ECANCELED)
            return;
        mm_log_warn("ctl %s: receive failed: %s", s->url, nng_strerror(rv));
        srv_recv(c);
        return;
    }
    const uint64_t t_rx = mm__trace_f ? mm_now_ns() : 0;
    nng_msg *m = nng_aio_get_msg(c->aio);
    nng_aio_set_msg(c->aio, NULL); // ours now: the aio must not point at it once freed
    char peer[96], err[MM_ERRLEN] = "";
    peer_name(m, peer, sizeof(peer));
    mm_ctl_msg *req = NULL;
    nng_msg *reply = NULL;
    if (mm_ctl_unpack(nng_msg_body(m), nng_msg_len(m), &req, err) != MM_OK) {
        mm_log_warn("ctl %s: rejected a message from %s: %s", s->url, peer, err);
        char text[MM_ERRLEN + 32];
        snprintf(text, sizeof(text), "rejected: %s", err);
        reply = mm_ctl_reply_ack(false, text);
    } else {
        if (mm__trace_f && req->body_case == MMCTL__ENVELOPE__BODY_STEP_PLAN) {
            // (the receive's time, known once the plan says its step)
            fprintf(mm__trace_f, "T ctl %llu -1 rx %.1f\n",
                    (unsigned long long)req->step_plan->step_id, (double)t_rx / 1e3);
            mm_mesh_trace(req->step_plan->step_id, -1, "unpacked");
            c->trace_step = req->step_plan->step_id + 1;
        }
        s->fn(s->arg, req, peer, &reply);
        if (reply == NULL)
            reply = mm_ctl_reply_ack(true, NULL);
        mm_ctl_msg_free(req);
    }
    nng_msg_free(m);
    if (reply == NULL) { // could not even build an ack: let the peer's deadline fire
        srv_recv(c);
        return;
    }
    nng_aio_set_msg(c->aio, reply);
    c->state = SRV_SEND;
    nng_ctx_send(c->ctx, c->aio);
}

mm_err mm_ctl_server_open(mm_ctl_server **out, const char *url, int n_ctx, mm_ctl_handler fn,
                          void *arg, char err[MM_ERRLEN]) {
    *out = NULL;
    MM_TRY(mm_ctl_url_prepare(url, err));
    mm_mesh_trace_open("ctl"); // MM_MESH_TRACE: a step plan's receive, unpack, reply sent
    mm_ctl_server *s = calloc(1, sizeof(*s));
    if (!s)
        return MM_ENOMEM;
    mm_err rv = MM_OK;
    int nrv;
    snprintf(s->url, sizeof(s->url), "%s", url);
    s->fn = fn;
    s->arg = arg;
    s->n_ctx = n_ctx < 1 ? 1 : n_ctx;
    s->ctxs = calloc((size_t)s->n_ctx, sizeof(*s->ctxs));
    if (!s->ctxs) {
        rv = MM_ENOMEM;
        goto fail;
    }
    if ((nrv = nng_rep0_open(&s->sock)) != 0) {
        rv = mm_errf(err, nng_to_mm(nrv), "%s: rep socket: %s", url, nng_strerror(nrv));
        goto fail;
    }
    s->sock_open = true;
    MM_TRY_GOTO(rv, set_limits(s->sock, url, err), fail);
    for (int i = 0; i < s->n_ctx; i++) {
        struct srv_ctx *c = &s->ctxs[i];
        c->srv = s;
        if ((nrv = nng_ctx_open(&c->ctx, s->sock)) != 0 ||
            (nrv = nng_aio_alloc(&c->aio, on_srv_aio, c)) != 0) {
            rv = mm_errf(err, nng_to_mm(nrv), "%s: context: %s", url, nng_strerror(nrv));
            goto fail;
        }
        c->ctx_open = true;
    }
    if ((nrv = nng_listen(s->sock, url, NULL, 0)) != 0) {
        rv = mm_errf(err, nng_to_mm(nrv) == MM_EINVAL ? MM_EINVAL : MM_ETRANSPORT,
                     "cannot listen on %s: %s", url, nng_strerror(nrv));
        goto fail;
    }
    for (int i = 0; i < s->n_ctx; i++)
        srv_recv(&s->ctxs[i]);
    *out = s;
    return MM_OK;
fail:
    mm_ctl_server_close(s);
    return rv;
}

static void server_teardown(mm_ctl_server *s) {
    for (int i = 0; s->ctxs && i < s->n_ctx; i++)
        if (s->ctxs[i].aio)
            nng_aio_stop(s->ctxs[i].aio);
    // A handler that was running when close began hands its reply to nng_ctx_send on an aio
    // that is already stopped: nng then returns without a callback and the reply stays on the
    // aio. Free it here (callbacks clear the aio's message whenever they take one).
    for (int i = 0; s->ctxs && i < s->n_ctx; i++)
        if (s->ctxs[i].aio) {
            nng_msg *left = nng_aio_get_msg(s->ctxs[i].aio);
            nng_aio_set_msg(s->ctxs[i].aio, NULL);
            if (left != NULL)
                nng_msg_free(left);
        }
    if (s->sock_open)
        nng_close(s->sock);
    for (int i = 0; s->ctxs && i < s->n_ctx; i++)
        if (s->ctxs[i].aio)
            nng_aio_free(s->ctxs[i].aio);
    free(s->ctxs);
    free(s);
}

// nng 1.5.2 can park nng_close forever when a peer disconnects while an aio of the socket is
// being scheduled (nanomsg/nng#1813, fixed upstream in 1.8). A stopping daemon must not hang on
// it, so the teardown runs on a helper thread and close waits for it at most this long; past
// that the socket is abandoned to the process exit (logged), which reclaims it.
#define SERVER_CLOSE_WAIT_MS 2000

static atomic_bool g_close_abandoned;

bool mm_ctl_close_abandoned(void) { return atomic_load(&g_close_abandoned); }

struct server_closer {
    mm_ctl_server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done, abandoned;
};

static void *server_closer_main(void *arg) {
    struct server_closer *c = arg;
    server_teardown(c->srv);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    bool abandoned = c->abandoned;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (abandoned) { // the waiter gave up and left the closer to us
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
        free(c);
    }
    return NULL;
}

// mono_wait_init: a mutex and a condition variable whose timed waits use CLOCK_MONOTONIC.
static void mono_wait_init(pthread_mutex_t *mu, pthread_cond_t *cv) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(mu, NULL);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

// mono_after: the CLOCK_MONOTONIC time ms from now (ms <= 0: now), for pthread_cond_timedwait
// on a mono_wait_init condition variable.
static struct timespec mono_after(int ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return ms > 0 ? mm_timespec_add_ms(t, ms) : t;
}

void mm_ctl_server_close(mm_ctl_server *s) {
    if (!s)
        return;
    atomic_store(&s->closing, true);
    struct server_closer *c = calloc(1, sizeof(*c));
    pthread_t th;
    if (!c) {
        server_teardown(s);
        return;
    }
    c->srv = s;
    mono_wait_init(&c->mu, &c->cv);
    if (pthread_create(&th, NULL, server_closer_main, c) != 0) {
        server_teardown(s);
        c->done = true;
    } else {
        pthread_detach(th);
    }
    const struct timespec until = mono_after(SERVER_CLOSE_WAIT_MS);
    pthread_mutex_lock(&c->mu);
    while (!c->done)
        if (pthread_cond_timedwait(&c->cv, &c->mu, &until) == ETIMEDOUT)
            break;
    bool done = c->done;
    if (!done)
        c->abandoned = true;
    pthread_mutex_unlock(&c->mu);
    if (!done) {
        atomic_store(&g_close_abandoned, true);
        mm_log_warn("control server close did not finish in %d ms (nng 1.5.2 close race, "
                    "nanomsg/nng#1813); leaving the socket to the process exit",
                    SERVER_CLOSE_WAIT_MS);
        return;
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

// ---- client --------------------------------------------------------------------------------

struct mm_ctl_client {
    nng_socket sock;
    char url[MM_ADDR_LEN];
};

mm_err mm_ctl_client_open(mm_ctl_client **out, const char *url, char err[MM_ERRLEN]) {
    *out = NULL;
    if (!url || !*url)
        return mm_errf(err, MM_EINVAL, "empty router address");
    mm_ctl_client *c = calloc(1, sizeof(*c));
    if (!c)
        return MM_ENOMEM;
    snprintf(c->url, sizeof(c->url), "%s", url);
    int nrv = nng_req0_open(&c->sock);
    if (nrv != 0) {
        free(c);
        return mm_errf(err, MM_ETRANSPORT, "%s: req socket: %s", url, nng_strerror(nrv));
    }
    mm_err rv = set_limits(c->sock, url, err);
    // Our deadlines decide; REQ's own resend (default 60 s) would only duplicate a request.
    if (rv == MM_OK && (nrv = nng_socket_set_ms(c->sock, NNG_OPT_REQ_RESENDTIME,
                                                NNG_DURATION_INFINITE)) != 0)
        rv = mm_errf(err, MM_ETRANSPORT, "%s: resend time: %s", url, nng_strerror(nrv));
    if (rv == MM_OK && (nrv = nng_dial(c->sock, url, NULL, NNG_FLAG_NONBLOCK)) != 0)
        rv = mm_errf(err, nng_to_mm(nrv) == MM_EINVAL ? MM_EINVAL : MM_ETRANSPORT,
                     "cannot dial %s: %s", url, nng_strerror(nrv));
    if (rv != MM_OK) {
        nng_close(c->sock);
        free(c);
        return rv;
    }
    *out = c;
    return MM_OK;
}

void mm_ctl_client_abort(mm_ctl_client *c) {
    if (c)
        nng_close(c->sock); // a second nng_close (in mm_ctl_client_close) returns ECLOSED
}

void mm_ctl_client_close(mm_ctl_client *c) {
    if (!c)
        return;
    nng_close(c->sock);
    free(c);
}

const char *mm_ctl_client_url(const mm_ctl_client *c) { return c->url; }

mm_err mm_ctl_call(mm_ctl_client *c, mm_ctl_msg *req, int timeout_ms, mm_ctl_msg **reply,
                   char err[MM_ERRLEN]) {
    *reply = NULL;
    nng_msg *m = NULL;
    MM_TRY(mm_ctl_pack(req, &m, err));
    nng_ctx ctx;
    nng_aio *aio = NULL;
    int nrv;
    mm_err rv = MM_OK;
    if ((nrv = nng_ctx_open(&ctx, c->sock)) != 0) {
        nng_msg_free(m);
        return mm_errf(err, nng_to_mm(nrv), "%s: %s", c->url, nng_strerror(nrv));
    }
    if ((nrv = nng_aio_alloc(&aio, NULL, NULL)) != 0) {
        nng_msg_free(m);
        nng_ctx_close(ctx);
        return MM_ENOMEM;
    }
    uint64_t deadline = mm_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 1);
    nng_aio_set_timeout(aio, timeout_ms > 0 ? timeout_ms : 1);
    nng_aio_set_msg(aio, m);
    nng_ctx_send(ctx, aio);
    nng_aio_wait(aio);
    if ((nrv = nng_aio_result(aio)) != 0) {
        nng_msg_free(nng_aio_get_msg(aio));
        rv = mm_errf(err, nng_to_mm(nrv), "%s to %s: send: %s", mm_ctl_body_name(req), c->url,
                     nrv == NNG_ETIMEDOUT ? "no peer within the deadline" : nng_strerror(nrv));
        goto out;
    }
    uint64_t now = mm_now_ms();
    nng_aio_set_timeout(aio, now >= deadline ? 1 : (nng_duration)(deadline - now));
    nng_ctx_recv(ctx, aio);
    nng_aio_wait(aio);
    if ((nrv = nng_aio_result(aio)) != 0) {
        rv = mm_errf(err, nng_to_mm(nrv), "%s to %s: no reply: %s", mm_ctl_body_name(req),
                     c->url, nng_strerror(nrv));
        goto out;
    }
    m = nng_aio_get_msg(aio);
    char derr[MM_ERRLEN] = "";
    rv = mm_ctl_unpack(nng_msg_body(m), nng_msg_len(m), reply, derr);
    nng_msg_free(m);
    if (rv != MM_OK)
        mm_errf(err, rv, "bad reply from %s: %s", c->url, derr);
out:
    nng_aio_free(aio);
    nng_ctx_close(ctx);
    return rv;
}

// ---- async call ----------------------------------------------------------------------------

struct mm_ctl_async {
    nng_ctx ctx;
    nng_aio *aio;
    pthread_mutex_t mu; // guards done (mm_ctl_async_wait)
    pthread_cond_t cv;  // CLOCK_MONOTONIC; signalled when done is set
    bool done;
    bool sending;
    uint64_t deadline_ms;
    mm_err rv;
    char err[MM_ERRLEN];
    mm_ctl_msg *reply;
    mm_ctl_async_cb cb;
    void *arg;
    char url[MM_ADDR_LEN];
};

// async_finish marks the call done (waking mm_ctl_async_wait), then runs the owner's callback.
static void async_finish(mm_ctl_async *a) {
    pthread_mutex_lock(&a->mu);
    a->done = true;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    if (a->cb)
        a->cb(a, a->arg);
}

static void on_async(void *arg) {
    mm_ctl_async *a = arg;
    int nrv = nng_aio_result(a->aio);
    if (a->sending) {
        if (nrv != 0) {
            nng_msg_free(nng_aio_get_msg(a->aio));
            a->rv = mm_errf(a->err, nng_to_mm(nrv), "%s: send: %s", a->url, nng_strerror(nrv));
            async_finish(a);
            return;
        }
        a->sending = false;
        uint64_t now = mm_now_ms();
        nng_aio_set_timeout(a->aio, now >= a->deadline_ms ? 1
                                                          : (nng_duration)(a->deadline_ms - now));
        nng_ctx_recv(a->ctx, a->aio);
        return;
    }
    if (nrv != 0) {
        a->rv = mm_errf(a->err, nng_to_mm(nrv), "%s: no reply: %s", a->url, nng_strerror(nrv));
    } else {
        nng_msg *m = nng_aio_get_msg(a->aio);
        char derr[MM_ERRLEN] = "";
        a->rv = mm_ctl_unpack(nng_msg_body(m), nng_msg_len(m), &a->reply, derr);
        if (a->rv != MM_OK)
            mm_errf(a->err, a->rv, "bad reply from %s: %s", a->url, derr);
        nng_msg_free(m);
    }
    async_finish(a);
}

mm_err mm_ctl_call_start(mm_ctl_client *c, mm_ctl_msg *req, int timeout_ms, mm_ctl_async_cb cb,
                         void *arg, mm_ctl_async **out, char err[MM_ERRLEN]) {
    *out = NULL;
    nng_msg *m = NULL;
    MM_TRY(mm_ctl_pack(req, &m, err));
    mm_ctl_async *a = calloc(1, sizeof(*a));
    if (!a) {
        nng_msg_free(m);
        return MM_ENOMEM;
    }
    int nrv;
    if ((nrv = nng_ctx_open(&a->ctx, c->sock)) != 0) {
        nng_msg_free(m);
        free(a);
        return mm_errf(err, nng_to_mm(nrv), "%s: %s", c->url, nng_strerror(nrv));
    }
    if (nng_aio_alloc(&a->aio, on_async, a) != 0) {
        nng_msg_free(m);
        nng_ctx_close(a->ctx);
        free(a);
        return MM_ENOMEM;
    }
    mono_wait_init(&a->mu, &a->cv);
    snprintf(a->url, sizeof(a->url), "%s", c->url);
    a->cb = cb;
    a->arg = arg;
    a->sending = true;
    if (timeout_ms < 1)
        timeout_ms = 1;
    a->deadline_ms = mm_now_ms() + (uint64_t)timeout_ms;
    nng_aio_set_timeout(a->aio, timeout_ms);
    nng_aio_set_msg(a->aio, m);
    nng_ctx_send(a->ctx, a->aio);
    *out = a;
    return MM_OK;
}

mm_err mm_ctl_async_result(mm_ctl_async *a, mm_ctl_msg **reply, char err[MM_ERRLEN]) {
    *reply = NULL;
    if (a->rv != MM_OK) {
        if (err)
            snprintf(err, MM_ERRLEN, "%s", a->err);
        return a->rv;
    }
    *reply = a->reply;
    a->reply = NULL;
    return MM_OK;
}

bool mm_ctl_async_wait(mm_ctl_async *a, int timeout_ms) {
    const struct timespec until = mono_after(timeout_ms);
    pthread_mutex_lock(&a->mu);
    while (!a->done && timeout_ms > 0)
        if (pthread_cond_timedwait(&a->cv, &a->mu, &until) == ETIMEDOUT)
            break;
    bool done = a->done;
    pthread_mutex_unlock(&a->mu);
    return done;
}

void mm_ctl_async_free(mm_ctl_async *a) {
    if (!a)
        return;
    // Stops the aio: a call still in flight is cancelled (its context closed below, so a late
    // reply is dropped by nng and never reaches a newer call); waits for a callback still
    // running on another thread.
    nng_aio_free(a->aio);
    nng_ctx_close(a->ctx);
    mm_ctl_msg_free(a->reply);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    free(a);
}
