// SPDX-License-Identifier: MIT
// The router's member registry; see router.h.
#include <nng/nng.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "mm/log.h"
#include "mm/time.h"
#include "router.h"

struct member {
    bool used;
    bool up;
    mm_identity id;
    Mmctl__Health health;
    uint64_t last_seen_ms;     // monotonic
    uint64_t up_since_unix_ms; // wall clock, for status
    uint32_t joins;
    char detail[256];
    char peer[96];
};

struct mm_registry {
    pthread_mutex_t mu;
    mm_identity self;
    uint64_t self_since_unix_ms;
    char self_detail[MM_CTL_MAX_STR]; // the router's status detail ("hub"; drafting metrics)
    uint32_t heartbeat_ms, down_after_ms;
    uint32_t max_step_seqs, max_batch_tokens, shards; // step limits for StatusReply (0: none)
    struct member *members; // (MM_REGISTRY_MAX_MEMBERS,)
    void (*detail_fn)(void *); // run before each status answer (set before the server starts)
    void *detail_arg;
};

void mm_registry_set_detail_hook(mm_registry *r, void (*fn)(void *arg), void *arg) {
    r->detail_fn = fn;
    r->detail_arg = arg;
}

void mm_registry_set_limits(mm_registry *r, uint32_t max_step_seqs, uint32_t max_batch_tokens,
                            uint32_t shards) {
    pthread_mutex_lock(&r->mu);
    r->max_step_seqs = max_step_seqs;
    r->max_batch_tokens = max_batch_tokens;
    r->shards = shards;
    pthread_mutex_unlock(&r->mu);
}

static uint64_t unix_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (uint64_t)tv.tv_sec * 1000u + (uint64_t)tv.tv_usec / 1000u;
}

mm_err mm_registry_new(mm_registry **out) {
    mm_registry *r = calloc(1, sizeof(*r));
    if (!r)
        return MM_ENOMEM;
    r->members = calloc(MM_REGISTRY_MAX_MEMBERS, sizeof(*r->members));
    if (!r->members) {
        free(r);
        return MM_ENOMEM;
    }
    pthread_mutex_init(&r->mu, NULL);
    *out = r;
    return MM_OK;
}

void mm_registry_free(mm_registry *r) {
    if (!r)
        return;
    pthread_mutex_destroy(&r->mu);
    free(r->members);
    free(r);
}

void mm_registry_set_self(mm_registry *r, const mm_identity *self, uint32_t heartbeat_ms,
                          uint32_t down_after_ms) {
    pthread_mutex_lock(&r->mu);
    r->self = *self;
    r->self_since_unix_ms = unix_ms();
    r->heartbeat_ms = heartbeat_ms;
    r->down_after_ms = down_after_ms;
    pthread_mutex_unlock(&r->mu);
}

static struct member *find(mm_registry *r, const char *role, uint32_t instance) {
    for (int i = 0; i < MM_REGISTRY_MAX_MEMBERS; i++) {
        struct member *m = &r->members[i];
        if (m->used && m->id.instance == instance && !strcmp(m->id.role, role))
            return m;
    }
    return NULL;
}

static struct member *find_free(mm_registry *r) {
    for (int i = 0; i < MM_REGISTRY_MAX_MEMBERS; i++)
        if (!r->members[i].used)
            return &r->members[i];
    return NULL;
}

static nng_msg *refuse(mm_registry *r, const mm_identity *them, const char *peer,
                       const char *field, const char *ours_val, const char *theirs_val,
                       const char *reason) {
    char name[40];
    mm_identity_name(them, name, sizeof(name));
    mm_log_error("refused %s (pid %u on %s, %s, control %s): %s mismatch: router has %s, %s has "
                 "%s (%s)", name, them->pid, them->host, peer, them->control_addr, field,
                 ours_val, name, theirs_val, reason);
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    Mmctl__Refused rf = MMCTL__REFUSED__INIT;
    Mmctl__Identity self = MMCTL__IDENTITY__INIT;
    mm_ctl_identity_to_pb(&r->self, &self);
    rf.field = (char *)field;
    rf.router_value = (char *)ours_val;
    rf.daemon_value = (char *)theirs_val;
    rf.reason = (char *)reason;
    rf.router = &self;
    env.body_case = MMCTL__ENVELOPE__BODY_REFUSED;
    env.refused = &rf;
    return mm_ctl_reply(&env);
}

static nng_msg *on_hello(mm_registry *r, const Mmctl__Hello *h, const char *peer) {
    mm_identity them;
    mm_ctl_identity_from_pb(h->identity, &them);
    const char *field = NULL;
    char ours_val[MM_ADDR_LEN], theirs_val[MM_ADDR_LEN];
    if (mm_identity_check(&r->self, &them, &field, ours_val, theirs_val) != MM_OK)
        return refuse(r, &them, peer, field, ours_val, theirs_val,
                      "daemons mesh only when protocol, build, model and placement agree");
    if (!strcmp(them.role, "router"))
        return refuse(r, &them, peer, "role", "router (this one is the hub)", "router",
                      "a mesh has one router hub; point --router at it instead");
    char name[40];
    mm_identity_name(&them, name, sizeof(name));
    struct member *m = find(r, them.role, them.instance);
    if (m && m->id.incarnation == them.incarnation) {
        // A retried hello (our welcome was lost): just welcome again.
    } else if (m) {
        if (m->up)
            mm_log_warn("%s rejoined as a new process (pid %u -> %u); the previous one is "
                        "replaced", name, m->id.pid, them.pid);
        else
            mm_log_info("%s rejoined (pid %u, %s, control %s, join #%u)", name, them.pid, peer,
                        them.control_addr, m->joins + 1);
        m->joins++;
        m->up_since_unix_ms = unix_ms();
        m->health = MMCTL__HEALTH__HEALTH_STARTING;
        m->detail[0] = 0;
    } else {
        if (!(m = find_free(r))) {
            mm_log_error("cannot admit %s: the registry holds %d members already", name,
                         MM_REGISTRY_MAX_MEMBERS);
            return mm_ctl_reply_ack(false, "router registry full");
        }
        memset(m, 0, sizeof(*m));
        m->used = true;
        m->joins = 1;
        m->up_since_unix_ms = unix_ms();
        m->health = MMCTL__HEALTH__HEALTH_STARTING;
        mm_log_info("%s joined: pid %u on %s (%s), control %s, data %s, device %s", name,
                    them.pid, them.host, peer, them.control_addr,
                    them.data_addr[0] ? them.data_addr : "(unset)", them.device);
    }
    if (them.heartbeat_ms * 2 > r->down_after_ms)
        mm_log_warn("%s heartbeats every %u ms, but members are marked down after %u ms of "
                    "silence: expect flapping", name, them.heartbeat_ms, r->down_after_ms);
    if (mm_kv_capacity_reported(&them.kv)) { // (the gateway, which admits by it, checks too)
        char kerr[MM_ERRLEN] = "";
        if (mm_kv_capacity_check(&them.kv, kerr) != MM_OK)
            mm_log_error("%s states a bad KV capacity: %s (gateways will not trust it)", name,
                         kerr);
        else if (m->id.incarnation != them.incarnation)
            mm_log_info("%s KV capacity: %llu tokens (%llu blocks of %u, %u bytes per token), "
                        "%u seqs of up to %u tokens", name,
                        (unsigned long long)(them.kv.blocks * them.kv.block_size),
                        (unsigned long long)them.kv.blocks, them.kv.block_size,
                        them.kv.token_bytes, them.kv.max_seqs, them.kv.max_ctx);
    }
    m->id = them;
    m->up = true;
    m->last_seen_ms = mm_now_ms();
    snprintf(m->peer, sizeof(m->peer), "%s", peer);

    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    Mmctl__Welcome w = MMCTL__WELCOME__INIT;
    Mmctl__Identity self = MMCTL__IDENTITY__INIT;
    mm_ctl_identity_to_pb(&r->self, &self);
    w.router = &self;
    w.heartbeat_ms = r->heartbeat_ms;
    w.down_after_ms = r->down_after_ms;
    env.body_case = MMCTL__ENVELOPE__BODY_WELCOME;
    env.welcome = &w;
    return mm_ctl_reply(&env);
}

static nng_msg *on_heartbeat(mm_registry *r, const Mmctl__Heartbeat *hb, uint64_t seq) {
    struct member *m = find(r, hb->role, hb->instance);
    Mmctl__HeartbeatAck ack = MMCTL__HEARTBEAT_ACK__INIT;
    if (!m || m->id.incarnation != hb->incarnation) {
        ack.action = MMCTL__HEARTBEAT_ACK__ACTION__ACTION_REJOIN;
    } else {
        if (!m->up) {
            char name[40];
            mm_log_info("%s is back up (silent for %llu ms)", mm_identity_name(&m->id, name, 40),
                        (unsigned long long)(mm_now_ms() - m->last_seen_ms));
        }
        m->up = true;
        m->last_seen_ms = mm_now_ms();
        m->health = hb->health;
        snprintf(m->detail, sizeof(m->detail), "%s", hb->detail);
    }
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_HEARTBEAT_ACK;
    env.heartbeat_ack = &ack;
    env.seq = seq;
    return mm_ctl_reply(&env);
}

static void on_goodbye(mm_registry *r, const Mmctl__Goodbye *g) {
    struct member *m = find(r, g->role, g->instance);
    if (!m || m->id.incarnation != g->incarnation)
        return;
    char name[40];
    mm_log_info("%s left: %s", mm_identity_name(&m->id, name, 40), g->reason);
    m->up = false;
    m->health = MMCTL__HEALTH__HEALTH_DOWN;
}

static int cmp_member(const void *a, const void *b) {
    const struct member *x = *(const struct member *const *)a, *y = *(const struct member *const *)b;
    int rx = mm_role_index(x->id.role), ry = mm_role_index(y->id.role);
    if (rx != ry)
        return rx - ry;
    return x->id.instance < y->id.instance ? -1 : x->id.instance > y->id.instance;
}

static nng_msg *on_status(mm_registry *r, uint64_t seq) {
    int n = 0;
    struct member *sorted[MM_REGISTRY_MAX_MEMBERS];
    for (int i = 0; i < MM_REGISTRY_MAX_MEMBERS; i++)
        if (r->members[i].used)
            sorted[n++] = &r->members[i];
    qsort(sorted, (size_t)n, sizeof(sorted[0]), cmp_member);
    // Control-plane only (not the per-token path): the reply is built in heap temporaries.
    Mmctl__Member *ms = calloc((size_t)n + 1, sizeof(*ms));
    Mmctl__Member **mps = calloc((size_t)n + 1, sizeof(*mps));
    Mmctl__Identity *ids = calloc((size_t)n + 1, sizeof(*ids));
    nng_msg *out = NULL;
    if (!ms || !mps || !ids)
        goto done;
    uint64_t now = mm_now_ms();
    mmctl__member__init(&ms[0]);
    mm_ctl_identity_to_pb(&r->self, &ids[0]);
    ms[0].identity = &ids[0];
    ms[0].health = MMCTL__HEALTH__HEALTH_READY;
    ms[0].joins = 1;
    ms[0].up_since_unix_ms = r->self_since_unix_ms;
    ms[0].detail = r->self_detail[0] ? r->self_detail : "hub";
    mps[0] = &ms[0];
    for (int i = 0; i < n; i++) {
        struct member *m = sorted[i];
        Mmctl__Member *pm = &ms[i + 1];
        mmctl__member__init(pm);
        mm_ctl_identity_to_pb(&m->id, &ids[i + 1]);
        pm->identity = &ids[i + 1];
        pm->health = m->up ? m->health : MMCTL__HEALTH__HEALTH_DOWN;
        pm->last_seen_ms_ago = now - m->last_seen_ms;
        pm->detail = m->detail;
        pm->joins = m->joins;
        pm->up_since_unix_ms = m->up_since_unix_ms;
        mps[i + 1] = pm;
    }
    Mmctl__StatusReply sr = MMCTL__STATUS_REPLY__INIT;
    Mmctl__Identity self = MMCTL__IDENTITY__INIT;
    mm_ctl_identity_to_pb(&r->self, &self);
    sr.router = &self;
    sr.n_members = (size_t)n + 1;
    sr.members = mps;
    sr.down_after_ms = r->down_after_ms;
    sr.max_step_seqs = r->max_step_seqs;
    sr.max_batch_tokens = r->max_batch_tokens;
    sr.attention_shards = r->shards;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REPLY;
    env.status_reply = &sr;
    env.seq = seq;
    out = mm_ctl_reply(&env);
done:
    free(ms);
    free(mps);
    free(ids);
    return out;
}

void mm_registry_handle(void *arg, const mm_ctl_msg *req, const char *peer, nng_msg **reply) {
    mm_registry *r = arg;
    if (req->body_case == MMCTL__ENVELOPE__BODY_STATUS_REQUEST && r->detail_fn)
        r->detail_fn(r->detail_arg); // (outside r->mu: it may set the detail)
    pthread_mutex_lock(&r->mu);
    switch (req->body_case) {
    case MMCTL__ENVELOPE__BODY_HELLO:
        *reply = on_hello(r, req->hello, peer);
        break;
    case MMCTL__ENVELOPE__BODY_HEARTBEAT:
        *reply = on_heartbeat(r, req->heartbeat, req->seq);
        break;
    case MMCTL__ENVELOPE__BODY_GOODBYE:
        on_goodbye(r, req->goodbye);
        break;
    case MMCTL__ENVELOPE__BODY_STATUS_REQUEST:
        *reply = on_status(r, req->seq);
        break;
    default: {
        char text[96];
        snprintf(text, sizeof(text), "the router does not serve %s", mm_ctl_body_name(req));
        mm_log_warn("%s sent %s, which the router does not serve", peer, mm_ctl_body_name(req));
        *reply = mm_ctl_reply_ack(false, text);
    }
    }
    pthread_mutex_unlock(&r->mu);
}

void mm_registry_sweep(void *arg) {
    mm_registry *r = arg;
    pthread_mutex_lock(&r->mu);
    // Read the clock under the lock: a heartbeat handled between an earlier reading and the
    // lock would stamp last_seen_ms after `now`, and the unsigned difference would wrap.
    uint64_t now = mm_now_ms();
    for (int i = 0; i < MM_REGISTRY_MAX_MEMBERS; i++) {
        struct member *m = &r->members[i];
        if (!m->used || !m->up || m->last_seen_ms >= now ||
            now - m->last_seen_ms <= r->down_after_ms)
            continue;
        m->up = false;
        m->health = MMCTL__HEALTH__HEALTH_DOWN;
        char name[40];
        mm_log_warn("%s (pid %u, control %s) marked down: no heartbeat for %llu ms",
                    mm_identity_name(&m->id, name, 40), m->id.pid, m->id.control_addr,
                    (unsigned long long)(now - m->last_seen_ms));
    }
    pthread_mutex_unlock(&r->mu);
}

bool mm_registry_peer(mm_registry *r, const char *role, uint32_t instance,
                      char data_addr[MM_ADDR_LEN], uint64_t *incarnation) {
    pthread_mutex_lock(&r->mu);
    struct member *m = find(r, role, instance);
    bool up = m && m->up && m->health != MMCTL__HEALTH__HEALTH_DOWN;
    if (m) {
        snprintf(data_addr, MM_ADDR_LEN, "%s", m->id.data_addr);
        *incarnation = m->id.incarnation;
    } else {
        data_addr[0] = 0;
        *incarnation = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return up;
}

bool mm_registry_peer_ctl(mm_registry *r, const char *role, uint32_t instance,
                          char control_addr[MM_ADDR_LEN], uint64_t *incarnation) {
    pthread_mutex_lock(&r->mu);
    struct member *m = find(r, role, instance);
    bool up = m && m->up && m->health == MMCTL__HEALTH__HEALTH_READY;
    if (m) {
        snprintf(control_addr, MM_ADDR_LEN, "%s", m->id.control_addr);
        *incarnation = m->id.incarnation;
    } else {
        control_addr[0] = 0;
        *incarnation = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return up;
}

void mm_registry_set_self_detail(mm_registry *r, const char *detail) {
    pthread_mutex_lock(&r->mu);
    snprintf(r->self_detail, sizeof(r->self_detail), "%s", detail);
    pthread_mutex_unlock(&r->mu);
}
