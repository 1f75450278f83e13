// SPDX-License-Identifier: MIT
// moemesh-gateway: the HTTP front door. Wires the shared daemon lifecycle (mm/daemon.h) to one
// libuv loop that runs the HTTP layer (http.c) and the mesh-facing layer (mesh.c).
#include <poll.h>

#define H2O_USE_LIBUV 1
#include <h2o.h>

#include "api.h"
#include "gateway.h"
#include "mm/log.h"

static char *s_host, *s_model_name, *s_api_key, *s_kv_dtype, *s_chat_template;
static long long s_port, s_max_body_bytes, s_health_timeout_ms, s_max_waiting, s_max_step_seqs,
    s_max_batch_tokens, s_shards, s_shard_max_seqs, s_max_ctx, s_step_timeout_ms, s_keepalive_ms,
    s_health_ms;
static double s_kv_mb;
static bool s_pipeline_plans;
static mm_opt s_gateway_opts[] = {
    {"host", MM_OPT_STR, &s_host, "127.0.0.1", "HTTP listen address"},
    {"port", MM_OPT_INT, &s_port, "8000", "HTTP listen port"},
    {"max-body-bytes", MM_OPT_INT, &s_max_body_bytes, "1048576", "largest request body accepted"},
    {"health-timeout-ms", MM_OPT_INT, &s_health_timeout_ms, "1000",
     "deadline of the router query behind GET /health"},
    {"served-model-name", MM_OPT_STR, &s_model_name, "", "model name of the API (default: the "
     "--model directory's name)"},
    {"chat-template", MM_OPT_STR, &s_chat_template, "", "a Jinja chat template file used instead "
     "of the checkpoint's (its special tokens kept), e.g. one that offers tools; one that cannot "
     "be read or compiled stops the gateway at start"},
    {"api-key", MM_OPT_STR, &s_api_key, "", "require Authorization: Bearer KEY (empty: none)"},
    {"max-waiting", MM_OPT_INT, &s_max_waiting, "256",
     "sequences waiting for admission beyond which requests get 429"},
    {"max-step-seqs", MM_OPT_INT, &s_max_step_seqs, "64", "sequences per step (as the router's)"},
    {"max-batch-tokens", MM_OPT_INT, &s_max_batch_tokens, "256",
     "tokens per step (as the router's): decode tokens plus prefill chunks"},
    {"attention-shards", MM_OPT_INT, &s_shards, "0", "attention shards in the mesh: 0 takes "
     "the router's count (requests wait until it has said it); N fixes it (a router with "
     "another count is logged as an error)"},
    {"shard-max-seqs", MM_OPT_INT, &s_shard_max_seqs, "0",
     "sequences admitted per attention shard: 0 takes what each shard states (its --max-seqs); "
     "N lowers that to N, and is the count for a shard that states none (else 64)"},
    {"kv-mb", MM_OPT_DBL, &s_kv_mb, "0", "KV admission per attention shard in MiB: 0 takes the "
     "capacity each shard states in its hello (its --kv-mb in its own cache's bytes per token, "
     "bf16 or f32); N lowers that to N MiB, and is the budget for a shard that states none "
     "(a shard without --model; else 64)"},
    {"kv-dtype", MM_OPT_STR, &s_kv_dtype, "f32", "only for a shard that states no KV capacity: "
     "its cache's elements, f32 or bf16, to size --kv-mb in tokens"},
    {"max-ctx", MM_OPT_INT, &s_max_ctx, "4096", "longest sequence (capped by the model)"},
    {"step-timeout-ms", MM_OPT_INT, &s_step_timeout_ms, "15000",
     "deadline of one StepPlan call to the router"},
    {"keepalive-ms", MM_OPT_INT, &s_keepalive_ms, "1000",
     "SSE keep-alive comment interval while a stream waits (bounds disconnect detection)"},
    {"mesh-check-ms", MM_OPT_INT, &s_health_ms, "250",
     "how often the gateway refreshes the mesh membership (503 when a role is down)"},
    {"pipeline-plans", MM_OPT_BOOL, &s_pipeline_plans, "true",
     "send the next step's plan before the previous result is in (2 in flight; decode seqs "
     "follow the router's picks): the router starts each step without waiting for the gateway; "
     "false: one plan at a time"},
    {0},
};

struct gateway {
    uv_loop_t loop;
    mm_daemon *d;
    gw_http *http;
    gw_mesh *mesh;
    gw_api *api;
    gw_health health;
    uv_poll_t sig_poll, ev_poll;
    uv_timer_t grace;
    bool stopping;
};

static void on_grace(uv_timer_t *t) { uv_stop(t->loop); }

// Without --model the gateway still reports the mesh (/health) but serves no API.
static int no_model_route(void *arg, h2o_req_t *req) {
    (void)arg;
    gw_http_send_error(req, 503, "Service Unavailable", "service_unavailable_error",
                       "this gateway was started without --model: it serves /health only");
    return 0;
}

static void begin_stop(struct gateway *g) {
    if (g->stopping)
        return;
    g->stopping = true;
    gw_http_stop(g->http);      // no new connections; idle ones are asked to close
    gw_api_stop(g->api);        // queued and running requests end (503 / error event)
    gw_mesh_abort(g->mesh);     // router calls in flight end now (their requests get 503)
    uv_poll_stop(&g->sig_poll);
    uv_poll_stop(&g->ev_poll);
    uv_timer_start(&g->grace, on_grace, 300, 0); // let those answers reach their clients
}

static void on_fd(uv_poll_t *p, int status, int events) {
    (void)status;
    (void)events;
    struct gateway *g = p->data;
    if (mm_daemon_poll_events(g->d))
        begin_stop(g);
}

static void close_cb(uv_handle_t *h, void *arg) {
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

int main(int argc, char **argv) {
    mm_daemon_spec spec = {
        .role = "gateway",
        .summary = "moemesh gateway: the HTTP front door (the OpenAI API, /health, /metrics).",
        .extra_opts = s_gateway_opts,
    };
    struct gateway g = {0};
    int code = MM_EXIT_ERROR;
    if (mm_daemon_open(&g.d, &spec, argc, argv, &code) != MM_OK)
        return code;
    char err[MM_ERRLEN] = "";
    uv_loop_init(&g.loop);
    uv_timer_init(&g.loop, &g.grace);
    mm_err rv = gw_mesh_open(&g.mesh, &g.loop, mm_daemon_get_conf(g.d)->router, err);
    if (rv == MM_OK)
        rv = gw_http_open(&g.http, &g.loop, s_host, (int)s_port, (size_t)s_max_body_bytes, err);
    if (rv == MM_OK) {
        gw_api_conf ac = {
            .model_dir = mm_daemon_get_conf(g.d)->model,
            .model_name = s_model_name,
            .api_key = s_api_key,
            .keepalive_ms = (int)s_keepalive_ms,
            .health_ms = (int)s_health_ms,
            .health_timeout_ms = (int)s_health_timeout_ms,
            .kv_mb = s_kv_mb,
            .kv_dtype = s_kv_dtype,
            .chat_template = s_chat_template,
            .sched = {.max_waiting = (int)s_max_waiting,
                      .max_step_seqs = (int)s_max_step_seqs,
                      .max_step_tokens = (int)s_max_batch_tokens,
                      .shards = (int)s_shards,
                      .shard_max_seqs = (int)s_shard_max_seqs,
                      .max_ctx = (int)s_max_ctx,
                      .step_timeout_ms = (int)s_step_timeout_ms,
                      .pipeline = s_pipeline_plans},
        };
        if (s_keepalive_ms < 10 || s_health_ms < 10) {
            rv = mm_errf(err, MM_EINVAL, "--keepalive-ms and --mesh-check-ms must be >= 10");
        } else if (!ac.model_dir || !ac.model_dir[0]) {
            mm_log_warn("no --model: serving /health only (the API answers 503)");
        } else {
            rv = gw_api_open(&g.api, &g.loop, g.mesh, &ac, err);
        }
    }
    if (rv == MM_OK) {
        g.health = (gw_health){.mesh = g.mesh, .self = mm_daemon_get_identity(g.d),
                               .timeout_ms = (int)s_health_timeout_ms,
                               .on_status = g.api ? gw_api_note_status : NULL,
                               .on_status_arg = g.api};
        gw_http_route(g.http, "GET", "/health", gw_health_route, &g.health);
        if (g.api) {
            rv = gw_api_routes(g.api, g.http);
        } else {
            static const char *paths[] = {"/v1/completions", "/v1/chat/completions",
                                          "/v1/models", "/tokenize", "/detokenize", "/metrics"};
            for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++)
                gw_http_route(g.http, NULL, paths[i], no_model_route, NULL);
        }
        if (rv == MM_OK)
            rv = mm_daemon_start(g.d, err);
    }
    if (rv != MM_OK) {
        mm_log_error("cannot start: %s", err);
        mm_daemon_request_stop(g.d, MM_EXIT_ERROR, NULL);
    } else {
        mm_log_info("HTTP on http://%s:%lld (OpenAI API under /v1, /health, /metrics)", s_host,
                    s_port);
        mm_daemon_set_health(g.d, MMCTL__HEALTH__HEALTH_READY, "http ready");
        uv_poll_init(&g.loop, &g.sig_poll, mm_daemon_signal_fd(g.d));
        uv_poll_init(&g.loop, &g.ev_poll, mm_daemon_event_fd(g.d));
        g.sig_poll.data = g.ev_poll.data = &g;
        uv_poll_start(&g.sig_poll, UV_READABLE, on_fd);
        uv_poll_start(&g.ev_poll, UV_READABLE, on_fd);
        uv_run(&g.loop, UV_RUN_DEFAULT);
    }
    // Teardown: h2o first (it owns connection handles), then the mesh, then every other handle.
    gw_api_stop(g.api);
    gw_http_close(g.http);
    gw_mesh_close(g.mesh);
    uv_walk(&g.loop, close_cb, NULL);
    uv_run(&g.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&g.loop) != 0)
        mm_log_warn("event loop closed with handles still open");
    gw_http_free(g.http);
    gw_api_free(g.api);
    gw_mesh_free(g.mesh);
    return mm_daemon_close(g.d);
}
