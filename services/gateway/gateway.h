// SPDX-License-Identifier: MIT
// The gateway's internal interfaces. Three layers, one file each:
//   http.c    h2o (libuv flavour) server: listener, route table, JSON responses. Knows nothing
//             of the mesh; the OpenAI API registers its routes here.
//   mesh.c    the mesh-facing side: an nng REQ client to the router whose completions are
//             handed to the uv loop (queue + uv_async_send, drained whole on each wake-up).
//   health.c  GET /health: asks the router for the member list and reports every role.
// main.c wires them to the shared daemon lifecycle (mm/daemon.h).
//
// Threading: everything here runs on the uv loop thread except mesh.c's nng callbacks, which
// only queue and wake the loop.
#ifndef MM_GATEWAY_H
#define MM_GATEWAY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

#include "mm/ctl.h"
#include "mm/daemon.h"

// ---- http.c ----------------------------------------------------------------------------------
typedef struct gw_http gw_http;
typedef struct st_h2o_req_t h2o_req_t;

// gw_route_fn handles one request whose method and path matched; it must answer (now or later
// from the loop) with gw_http_send_json / h2o_send_*. Returns 0.
typedef int (*gw_route_fn)(void *arg, h2o_req_t *req);

// gw_http_open binds host:port on loop (errors: MM_EINVAL bad host, MM_ETRANSPORT bind/listen,
// naming the address). max_body_bytes caps request bodies (h2o buffers them whole).
mm_err gw_http_open(gw_http **out, uv_loop_t *loop, const char *host, int port,
                    size_t max_body_bytes, char err[MM_ERRLEN]);
// gw_http_route adds a route for an exact path; method NULL accepts any method. Call before
// traffic arrives. Errors: MM_EFULL.
mm_err gw_http_route(gw_http *h, const char *method, const char *path, gw_route_fn fn, void *arg);
// gw_http_send_json answers req with status and body (borrowed; serialised here).
void gw_http_send_json(h2o_req_t *req, int status, const char *reason, json_t *body);
// gw_http_send_error answers with an OpenAI-style error body {"error":{"message","type","code"}}.
void gw_http_send_error(h2o_req_t *req, int status, const char *reason, const char *type,
                        const char *message);
// gw_http_stop closes the listener and asks open connections to finish (graceful).
void gw_http_stop(gw_http *h);
// gw_http_close disposes the h2o context and config; run the loop afterwards so that the
// handles close, then free with gw_http_free.
void gw_http_close(gw_http *h);
void gw_http_free(gw_http *h);

// ---- mesh.c ----------------------------------------------------------------------------------
typedef struct gw_mesh gw_mesh;
typedef struct gw_call gw_call;

// gw_status_cb runs on the loop thread with the router's StatusReply (borrowed, NULL on error)
// or an error and its text. Never runs for a call detached before completion.
typedef void (*gw_status_cb)(void *arg, mm_err rv, const Mmctl__StatusReply *reply,
                             const char *err);

// gw_mesh_open dials the router (background reconnects) and installs the loop wake-up.
mm_err gw_mesh_open(gw_mesh **out, uv_loop_t *loop, const char *router_url, char err[MM_ERRLEN]);
// gw_mesh_status asks the router for the member list with a deadline of timeout_ms. On MM_OK cb
// runs exactly once later on the loop (unless detached); *call identifies the request.
mm_err gw_mesh_status(gw_mesh *m, int timeout_ms, gw_status_cb cb, void *arg, gw_call **call,
                      char err[MM_ERRLEN]);
// gw_call_detach: the requester is gone (client disconnected); cb will not run.
void gw_call_detach(gw_call *c);
const char *gw_mesh_router_url(const gw_mesh *m);
// gw_mesh_abort fails every call in flight at once (shutdown); their callbacks still run.
void gw_mesh_abort(gw_mesh *m);
// gw_mesh_close waits (bounded) for calls in flight, then closes the wake-up handle; run the
// loop afterwards so that it closes, then gw_mesh_free.
void gw_mesh_close(gw_mesh *m);
void gw_mesh_free(gw_mesh *m);

// ---- health.c --------------------------------------------------------------------------------
typedef struct gw_health {
    gw_mesh *mesh;
    const mm_identity *self; // the gateway's own identity (for answers without a router)
    int timeout_ms;          // deadline of the status call to the router
} gw_health;

// gw_health_route handles GET /health (arg: gw_health): 200 when every role has at least one
// ready instance, 503 otherwise, with each role's instances, addresses, identities and health.
int gw_health_route(void *arg, h2o_req_t *req);

// gw_health_json builds the /health body from a status reply (NULL: router unreachable, err
// says why) and sets *all_up. Returns owned JSON. Exposed for tests and `moemesh status`.
json_t *gw_health_json(const Mmctl__StatusReply *reply, const mm_identity *self,
                       const char *router_url, const char *err, bool *all_up);

#endif
