// SPDX-License-Identifier: MIT
// The gateway's HTTP layer: h2o 2.2.5 on libuv, cleartext HTTP/1.1 and h2c; see gateway.h.
//
// Design notes (DEPENDENCIES.md section 2): SIGPIPE is ignored by the daemon lifecycle; request
// bodies are capped by max_request_entity_size (h2o buffers them whole, default 1 GiB); one
// handler at "/" dispatches on exact paths from a fixed route table, so 404 and 405 answers are
// ours and JSON. Handlers that answer later must guard req with h2o_mem_alloc_shared (see
// health.c): before the response starts h2o has no stop callback.
#define H2O_USE_LIBUV 1
#include <h2o.h>
#include <string.h>

#include "gateway.h"
#include "mm/log.h"

#define MAX_ROUTES 64

struct route {
    const char *method; // NULL: any
    const char *path;
    gw_route_fn fn;
    void *arg;
};

struct dispatcher {
    h2o_handler_t super;
    gw_http *http;
};

struct gw_http {
    uv_loop_t *loop;
    h2o_globalconf_t config;
    h2o_context_t ctx;
    h2o_accept_ctx_t accept_ctx;
    uv_tcp_t listener;
    bool listening, ctx_ready, config_ready;
    struct route routes[MAX_ROUTES];
    int n_routes;
    size_t max_body;
};

static void add_json_type(h2o_req_t *req) {
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                   H2O_STRLIT("application/json"));
}

void gw_http_send_json(h2o_req_t *req, int status, const char *reason, json_t *body) {
    char *text = json_dumps(body, JSON_COMPACT);
    size_t n = text ? strlen(text) : 2;
    // The body must outlive this call: h2o writes it later, so it goes in the request's pool.
    char *copy = h2o_mem_alloc_pool(&req->pool, n + 1);
    memcpy(copy, text ? text : "{}", n);
    copy[n] = '\n';
    free(text);
    req->res.status = status;
    req->res.reason = reason;
    req->res.content_length = n + 1;
    add_json_type(req);
    h2o_send_inline(req, copy, n + 1);
}

void gw_http_send_error(h2o_req_t *req, int status, const char *reason, const char *type,
                        const char *message) {
    json_t *body = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", message, "type",
                             type, "param", json_null(), "code", json_null());
    gw_http_send_json(req, status, reason, body);
    json_decref(body);
}

static int on_req(h2o_handler_t *self, h2o_req_t *req) {
    gw_http *h = ((struct dispatcher *)self)->http;
    const h2o_iovec_t p = req->path_normalized;
    if (req->entity.base && req->entity.len > h->max_body) {
        char msg[160];
        snprintf(msg, sizeof(msg), "the request body has %zu bytes; this server takes at most "
                 "%zu (--max-body-bytes)", req->entity.len, h->max_body);
        json_t *body = json_pack("{s:{s:s, s:s, s:n, s:s}}", "error", "message", msg, "type",
                                 "invalid_request_error", "param", "code", "body_too_large");
        gw_http_send_json(req, 413, "Payload Too Large", body);
        json_decref(body);
        return 0;
    }
    bool path_known = false;
    for (int i = 0; i < h->n_routes; i++) {
        const struct route *r = &h->routes[i];
        if (strlen(r->path) != p.len || memcmp(r->path, p.base, p.len) != 0)
            continue;
        path_known = true;
        if (r->method && (strlen(r->method) != req->method.len ||
                          memcmp(r->method, req->method.base, req->method.len) != 0))
            continue;
        return r->fn(r->arg, req);
    }
    char msg[300];
    if (path_known) {
        snprintf(msg, sizeof(msg), "method %.*s is not allowed on %.*s", (int)req->method.len,
                 req->method.base, (int)(p.len > 200 ? 200 : p.len), p.base);
        gw_http_send_error(req, 405, "Method Not Allowed", "invalid_request_error", msg);
    } else {
        snprintf(msg, sizeof(msg), "no such endpoint: %.*s", (int)(p.len > 200 ? 200 : p.len),
                 p.base);
        gw_http_send_error(req, 404, "Not Found", "invalid_request_error", msg);
    }
    return 0;
}

static void on_accept(uv_stream_t *listener, int status) {
    gw_http *h = listener->data;
    if (status != 0)
        return;
    uv_tcp_t *conn = h2o_mem_alloc(sizeof(*conn));
    uv_tcp_init(listener->loop, conn);
    if (uv_accept(listener, (uv_stream_t *)conn) != 0) {
        uv_close((uv_handle_t *)conn, (uv_close_cb)free);
        return;
    }
    h2o_socket_t *sock = h2o_uv_socket_create((uv_stream_t *)conn, (uv_close_cb)free);
    h2o_accept(&h->accept_ctx, sock); // h2o owns conn from here
}

mm_err gw_http_open(gw_http **out, uv_loop_t *loop, const char *host, int port,
                    size_t max_body_bytes, char err[MM_ERRLEN]) {
    *out = NULL;
    if (port < 1 || port > 65535)
        return mm_errf(err, MM_EINVAL, "--port %d: must be 1..65535", port);
    gw_http *h = calloc(1, sizeof(*h));
    if (!h)
        return MM_ENOMEM;
    h->loop = loop;
    h2o_config_init(&h->config);
    h->config_ready = true;
    // h2o answers bodies over its own limit with a plain-text 413 before any handler runs; ours
    // (checked in on_req) answers in the API's JSON shape, so h2o's is set further out as the
    // hard cap on what it buffers.
    h->max_body = max_body_bytes;
    h->config.max_request_entity_size = max_body_bytes <= SIZE_MAX / 8 ? max_body_bytes * 8
                                                                        : max_body_bytes;
    h2o_hostconf_t *hc =
        h2o_config_register_host(&h->config, h2o_iovec_init(H2O_STRLIT("default")), 65535);
    h2o_pathconf_t *pc = h2o_config_register_path(hc, "/", 0);
    struct dispatcher *dh = (struct dispatcher *)h2o_create_handler(pc, sizeof(*dh));
    dh->super.on_req = on_req;
    dh->http = h;
    h2o_context_init(&h->ctx, loop, &h->config);
    h->ctx_ready = true;
    h->accept_ctx.ctx = &h->ctx;
    h->accept_ctx.hosts = h->config.hosts;

    struct sockaddr_storage sa;
    int rv;
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)&sa) != 0 &&
        uv_ip6_addr(host, port, (struct sockaddr_in6 *)&sa) != 0) {
        rv = -1;
        mm_errf(err, MM_EINVAL, "--host '%s': not an IPv4 or IPv6 address", host);
        goto fail_inval;
    }
    uv_tcp_init(loop, &h->listener);
    h->listener.data = h;
    h->listening = true;
    if ((rv = uv_tcp_bind(&h->listener, (struct sockaddr *)&sa, 0)) != 0 ||
        (rv = uv_listen((uv_stream_t *)&h->listener, 128, on_accept)) != 0) {
        mm_errf(err, MM_ETRANSPORT, "cannot listen on %s:%d: %s", host, port, uv_strerror(rv));
        *out = h; // the listener handle must be closed through the loop
        return MM_ETRANSPORT;
    }
    *out = h;
    return MM_OK;
fail_inval:
    *out = h;
    return MM_EINVAL;
}

mm_err gw_http_route(gw_http *h, const char *method, const char *path, gw_route_fn fn, void *arg) {
    if (h->n_routes >= MAX_ROUTES)
        return MM_EFULL;
    h->routes[h->n_routes++] = (struct route){method, path, fn, arg};
    return MM_OK;
}

void gw_http_stop(gw_http *h) {
    if (!h)
        return;
    if (h->listening && !uv_is_closing((uv_handle_t *)&h->listener))
        uv_close((uv_handle_t *)&h->listener, NULL);
    if (h->ctx_ready && !h->ctx.shutdown_requested)
        h2o_context_request_shutdown(&h->ctx);
}

void gw_http_close(gw_http *h) {
    if (!h)
        return;
    gw_http_stop(h);
    if (h->ctx_ready) {
        // h2o 2.2.5's HTTP/2 shutdown arms a one-second GOAWAY resend timer even with no
        // connection; disposing the context with it still linked trips an assertion.
        if (h2o_timeout_is_linked(&h->ctx.http2._graceful_shutdown_timeout))
            h2o_timeout_unlink(&h->ctx.http2._graceful_shutdown_timeout);
        h2o_context_dispose(&h->ctx);
    }
    h->ctx_ready = false;
    if (h->config_ready)
        h2o_config_dispose(&h->config);
    h->config_ready = false;
}

void gw_http_free(gw_http *h) { free(h); }
