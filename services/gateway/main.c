// SPDX-License-Identifier: MIT
// moemesh-gateway: the HTTP front door. Wires the shared daemon lifecycle (mm/daemon.h) to one
// libuv loop that runs the HTTP layer (http.c) and the mesh-facing layer (mesh.c).
#include <poll.h>

#define H2O_USE_LIBUV 1
#include <h2o.h>

#include "gateway.h"
#include "mm/log.h"

static char *s_host;
static long long s_port, s_max_body_bytes, s_health_timeout_ms;
static mm_opt s_gateway_opts[] = {
    {"host", MM_OPT_STR, &s_host, "127.0.0.1", "HTTP listen address"},
    {"port", MM_OPT_INT, &s_port, "8000", "HTTP listen port"},
    {"max-body-bytes", MM_OPT_INT, &s_max_body_bytes, "1048576", "largest request body accepted"},
    {"health-timeout-ms", MM_OPT_INT, &s_health_timeout_ms, "1000",
     "deadline of the router query behind GET /health"},
    {0},
};

struct gateway {
    uv_loop_t loop;
    mm_daemon *d;
    gw_http *http;
    gw_mesh *mesh;
    gw_health health;
    uv_poll_t sig_poll, ev_poll;
    uv_timer_t grace;
    bool stopping;
};

static void on_grace(uv_timer_t *t) { uv_stop(t->loop); }

static void begin_stop(struct gateway *g) {
    if (g->stopping)
        return;
    g->stopping = true;
    gw_http_stop(g->http);      // no new connections; idle ones are asked to close
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
        .summary = "moemesh gateway: the HTTP front door (GET /health now; the OpenAI API next).",
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
        g.health = (gw_health){.mesh = g.mesh, .self = mm_daemon_get_identity(g.d),
                               .timeout_ms = (int)s_health_timeout_ms};
        gw_http_route(g.http, "GET", "/health", gw_health_route, &g.health);
        rv = mm_daemon_start(g.d, err);
    }
    if (rv != MM_OK) {
        mm_log_error("cannot start: %s", err);
        mm_daemon_request_stop(g.d, MM_EXIT_ERROR, NULL);
    } else {
        mm_log_info("HTTP on http://%s:%lld (GET /health)", s_host, s_port);
        mm_daemon_set_health(g.d, MMCTL__HEALTH__HEALTH_READY, "http ready");
        uv_poll_init(&g.loop, &g.sig_poll, mm_daemon_signal_fd(g.d));
        uv_poll_init(&g.loop, &g.ev_poll, mm_daemon_event_fd(g.d));
        g.sig_poll.data = g.ev_poll.data = &g;
        uv_poll_start(&g.sig_poll, UV_READABLE, on_fd);
        uv_poll_start(&g.ev_poll, UV_READABLE, on_fd);
        uv_run(&g.loop, UV_RUN_DEFAULT);
    }
    // Teardown: h2o first (it owns connection handles), then the mesh, then every other handle.
    gw_http_close(g.http);
    gw_mesh_close(g.mesh);
    uv_walk(&g.loop, close_cb, NULL);
    uv_run(&g.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&g.loop) != 0)
        mm_log_warn("event loop closed with handles still open");
    gw_http_free(g.http);
    gw_mesh_free(g.mesh);
    return mm_daemon_close(g.d);
}
