// SPDX-License-Identifier: MIT
// GET /health: the mesh as the router sees it; see gateway.h.
#define H2O_USE_LIBUV 1
#include <h2o.h>
#include <string.h>

#include "gateway.h"
#include "mm/log.h"

// Guard for the request while the router call is in flight: allocated in req->pool with a
// dispose callback, so a client that goes away before we answer detaches the call instead of
// leaving it a dangling req (DEPENDENCIES.md section 2, gotcha 3).
struct health_req {
    h2o_req_t *req;
    gw_call *call; // NULL once answered
    gw_health *h;
};

static json_t *member_json(const Mmctl__Member *m) {
    const Mmctl__Identity *id = m->identity;
    char inc[24];
    snprintf(inc, sizeof(inc), "%016llx", (unsigned long long)id->incarnation);
    json_t *ident = json_pack("{s:I, s:s, s:s, s:s, s:s}", "protocol_version",
                              (json_int_t)id->protocol_version, "build_id", id->build_id,
                              "model_fingerprint", id->model_fingerprint, "placement_fingerprint",
                              id->placement_fingerprint, "incarnation", inc);
    json_t *out =
        json_pack("{s:s, s:I, s:s, s:b, s:s, s:s, s:I, s:s, s:s, s:s, s:I, s:I, s:o}",
                     "role", id->role, "instance", (json_int_t)id->instance,
                     "health", mm_ctl_health_name(m->health),
                     "up", (int)(m->health == MMCTL__HEALTH__HEALTH_READY),
                     "control_addr", id->control_addr, "data_addr", id->data_addr,
                     "pid", (json_int_t)id->pid, "host", id->host, "device", id->device,
                     "detail", m->detail, "last_seen_ms_ago", (json_int_t)m->last_seen_ms_ago,
                     "joins", (json_int_t)m->joins, "identity", ident);
    // an attention shard's stated KV capacity (what the gateway admits by), as stated
    if (out && (id->kv_block_size || id->kv_blocks || id->kv_token_bytes || id->kv_budget_bytes ||
                id->max_seqs || id->max_ctx))
        json_object_set_new(out, "kv_capacity",
                            json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "tokens",
                                      (json_int_t)(id->kv_blocks * id->kv_block_size),
                                      "blocks", (json_int_t)id->kv_blocks, "block_size",
                                      (json_int_t)id->kv_block_size, "token_bytes",
                                      (json_int_t)id->kv_token_bytes, "budget_bytes",
                                      (json_int_t)id->kv_budget_bytes, "max_seqs",
                                      (json_int_t)id->max_seqs, "max_ctx",
                                      (json_int_t)id->max_ctx));
    return out;
}

json_t *gw_health_json(const Mmctl__StatusReply *reply, const mm_identity *self,
                       const char *router_url, const char *err, bool *all_up) {
    json_t *roles = json_object();
    int n_up[MM_N_ROLES] = {0};
    for (int r = 0; r < MM_N_ROLES; r++)
        json_object_set_new(roles, mm_roles[r], json_pack("{s:i, s:[]}", "up", 0, "instances"));
    if (reply) {
        for (size_t i = 0; i < reply->n_members; i++) {
            const Mmctl__Member *m = reply->members[i];
            int r = mm_role_index(m->identity->role);
            if (r < 0)
                continue;
            json_t *role = json_object_get(roles, mm_roles[r]);
            json_array_append_new(json_object_get(role, "instances"), member_json(m));
            if (m->health == MMCTL__HEALTH__HEALTH_READY)
                json_object_set_new(role, "up", json_integer(++n_up[r]));
        }
    } else if (self) {
        // No router: say what we know, which is ourselves.
        Mmctl__Identity pb = MMCTL__IDENTITY__INIT;
        Mmctl__Member m = MMCTL__MEMBER__INIT;
        mm_ctl_identity_to_pb(self, &pb);
        m.identity = &pb;
        m.health = MMCTL__HEALTH__HEALTH_READY;
        m.detail = "this gateway (router unreachable)";
        json_t *role = json_object_get(roles, "gateway");
        json_array_append_new(json_object_get(role, "instances"), member_json(&m));
        json_object_set_new(role, "up", json_integer(++n_up[0]));
    }
    // The drafter is optional: without one, steps go on without drafts and output is the same
    // (DESIGN.md failure behaviour), so a mesh missing only its drafter still serves: 200 with
    // "status":"degraded", so that a load balancer keeps it in rotation. Any other role missing
    // means requests would fail: 503.
    json_t *missing = json_array();
    *all_up = true;
    bool degraded = false;
    for (int r = 0; r < MM_N_ROLES; r++)
        if (n_up[r] == 0) {
            if (!strcmp(mm_roles[r], "drafter"))
                degraded = true;
            else
                *all_up = false;
            json_array_append_new(missing, json_string(mm_roles[r]));
        }
    const char *status = !*all_up ? "unavailable" : degraded ? "degraded" : "ok";
    json_t *out = json_pack("{s:s, s:s, s:o, s:o}", "status", status,
                            "router", router_url ? router_url : "", "missing", missing, "roles",
                            roles);
    if (reply)
        json_object_set_new(out, "down_after_ms", json_integer(reply->down_after_ms));
    if (err)
        json_object_set_new(out, "error", json_string(err));
    return out;
}

static void answer(h2o_req_t *req, gw_health *h, const Mmctl__StatusReply *reply,
                   const char *err) {
    bool all_up = false;
    json_t *body = gw_health_json(reply, h->self, gw_mesh_router_url(h->mesh), err, &all_up);
    gw_http_send_json(req, all_up ? 200 : 503, all_up ? "OK" : "Service Unavailable", body);
    json_decref(body);
}

static void on_status(void *arg, mm_err rv, const Mmctl__StatusReply *reply, const char *err) {
    struct health_req *hr = arg;
    hr->call = NULL; // answered: the dispose guard has nothing left to detach
    if (hr->h->on_status)
        hr->h->on_status(hr->h->on_status_arg, rv, reply, err);
    char text[MM_ERRLEN + 64];
    if (rv != MM_OK)
        snprintf(text, sizeof(text), "router unreachable: %s", err);
    answer(hr->req, hr->h, rv == MM_OK ? reply : NULL, rv == MM_OK ? NULL : text);
}

static void on_dispose(void *p) {
    struct health_req *hr = p;
    if (hr->call)
        gw_call_detach(hr->call);
}

int gw_health_route(void *arg, h2o_req_t *req) {
    gw_health *h = arg;
    struct health_req *hr = h2o_mem_alloc_shared(&req->pool, sizeof(*hr), on_dispose);
    hr->req = req;
    hr->h = h;
    hr->call = NULL;
    char err[MM_ERRLEN] = "";
    if (gw_mesh_status(h->mesh, h->timeout_ms, on_status, hr, &hr->call, err) != MM_OK) {
        char text[MM_ERRLEN + 64];
        snprintf(text, sizeof(text), "router unreachable: %s", err);
        answer(req, h, NULL, text);
    }
    return 0;
}
