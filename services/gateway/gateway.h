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
// gw_step_cb runs on the loop thread with the router's answer to a StepPlan (reply borrowed for
// the call, NULL on error) and t_done_ns, the mm_now_ns() at which nng completed the call.
typedef void (*gw_step_cb)(void *arg, mm_err rv, const mm_ctl_msg *reply, const char *err,
                           uint64_t t_done_ns);
// gw_mesh_step sends plan (borrowed until cb runs: the sender thread packs it) to the router
// with a deadline
// of timeout_ms; on MM_OK cb runs exactly once later on the loop (unless detached).
mm_err gw_mesh_step(gw_mesh *m, mm_ctl_msg *plan, int timeout_ms, gw_step_cb cb, void *arg,
                    gw_call **call, char err[MM_ERRLEN]);
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
    // (optional) also told every status answer /health gets, so that the API's view of the
    // mesh is never older than what /health last reported. Runs on the loop thread.
    void (*on_status)(void *arg, mm_err rv, const Mmctl__StatusReply *reply, const char *err);
    void *on_status_arg;
} gw_health;

// gw_health_route handles GET /health (arg: gw_health): 200 when every role has at least one
// ready instance ("status":"ok") or only the optional drafter is missing ("degraded"), 503
// otherwise, with each role's instances, addresses, identities and health.
int gw_health_route(void *arg, h2o_req_t *req);

// gw_health_json builds the /health body from a status reply (NULL: router unreachable, err
// says why) and sets *all_up (every required role up; the drafter is optional). Returns owned
// JSON. Exposed for tests and `moemesh status`.
json_t *gw_health_json(const Mmctl__StatusReply *reply, const mm_identity *self,
                       const char *router_url, const char *err, bool *all_up);

// ---- sched.c: the step scheduler -------------------------------------------------------------
// One owner of all sequence state, on the loop thread. At most one StepPlan is in flight; when
// its StepResult arrives the scheduler delivers the tokens (ops.token), builds and sends the
// next plan at once, and only then lets the HTTP side write (ops.flush), so the router computes
// while the gateway talks to clients. Each plan: the releases of ended seqs, then every running
// seq's decode token, then prefill chunks in admission order under the per-step token budget,
// then newly admitted seqs (FCFS: the queue's head waits for KV and seq slots; nothing passes
// it). A seq is admitted only when its whole KV need (prompt + max new tokens, in blocks) fits
// its shard's free blocks, so a running seq never runs out of KV.
//
// KV admission by the shards' own capacity: each attention shard states its KV cache (blocks,
// block size, bytes per token, budget, max seqs, max ctx) in its Hello (mm_kv_capacity); the
// router's StatusReply hands it to the gateway, which calls gw_sched_shard_report for every
// attention member. A shard admits nothing until its capacity is known. The gateway's
// --kv-mb / --shard-max-seqs only lower what a shard states (a cap), and size a shard that
// states nothing (a shard without --model: the fallback). A bad statement
// (mm_kv_capacity_check) is logged naming the shard and not trusted: that shard admits
// nothing. A shard that rejoins with another capacity is picked up at the next status answer.
#include "mm/identity.h"
#include "mm/sampler.h"

typedef struct gw_sched gw_sched;

#define GW_MAX_SHARDS 1024 // attention shards at most (seq ids: base * shards + shard, base
                           // ~2^8 x microseconds of uptime, stay below 2^64 for years)

typedef struct gw_sched_conf {
    int max_waiting;          // queued seqs beyond which submit says MM_EFULL (HTTP 429)
    int max_step_seqs;        // the router's --max-step-seqs
    int max_step_tokens;      // the router's --max-batch-tokens
    int shards;               // attention shards (seq -> shard: seq_id % shards); 0: the
                              // router's count (StatusReply), nothing admitted before it
    int shard_max_seqs;       // --shard-max-seqs: caps each shard's stated max seqs (0: none)
    double kv_mb;             // --kv-mb: caps each shard's stated KV budget in MiB (0: none)
    int64_t fallback_kv_blocks; // KV blocks of a shard that states no capacity (from --kv-mb,
                              // else 64 MiB, --kv-dtype and the model)
    int fallback_max_seqs;    // max seqs of a shard that states none (--shard-max-seqs, else 64)
    int block_size;           // tokens per KV block (a shard stating another is not trusted)
    int max_ctx;              // longest sequence (prompt + generated)
    int step_timeout_ms;      // deadline of one StepPlan call
    bool pipeline;            // --pipeline-plans: the next plan goes out before the previous
                              // result is in (2 in flight; docs/GATEWAY.md)
} gw_sched_conf;

enum gw_seq_state { GW_SEQ_NEW, GW_SEQ_WAITING, GW_SEQ_RUNNING, GW_SEQ_DONE };

typedef struct gw_seq {
    // Set by the owner before gw_sched_submit; tokens holds n_prompt ids and room for max_gen
    // more (owned by the owner, which keeps it alive until ops.dropped).
    int32_t *tokens;
    int n_prompt, max_gen;
    mm_sampling sampling;
    uint32_t n_top;
    bool want_lp; // the request reads logprobs (else the router may pick on the device)
    void *owner;
    int index;
    // Scheduler state (read-only for the owner).
    uint64_t id;
    int shard, state;
    int n_tokens, pos, n_gen; // tokens known, tokens in the KV, tokens generated
    int ppos;                 // tokens planned: pos plus the prompt chunks in flight
    int in_plans;             // plans in flight holding the seq (0: none)
    uint64_t sample_in;       // step id of the plan in flight that samples its next token
    bool cancelled, ever_planned;
    int64_t kv_blocks;
    uint64_t t_submit_ns, t_first_ns, t_last_ns;
    struct gw_seq *next, *prev;
} gw_seq;

typedef struct gw_sched_ops {
    // token: s sampled r->token (r borrowed for the call; t_done_ns: the StepResult's arrival).
    // Return false when the seq is finished (eos, stop, length).
    bool (*token)(void *arg, gw_seq *s, const Mmctl__SeqResult *r, uint64_t t_done_ns);
    // fail: the mesh failed s (code, one-line msg); s is released.
    void (*fail)(void *arg, gw_seq *s, mm_err code, const char *msg);
    // dropped: the scheduler holds no reference to s any more (after finish, fail or cancel).
    void (*dropped)(void *arg, gw_seq *s);
    // flush: a step's results were delivered and the next plan is on its way. Times (mm_now_ns):
    // t_done the StepResult's arrival (nng thread), t_loop when the loop took it up, t_tokens
    // when every token was delivered, t_sent when the next plan had been handed to nng.
    void (*flush)(void *arg, uint64_t t_done, uint64_t t_loop, uint64_t t_tokens,
                  uint64_t t_sent);
} gw_sched_ops;

typedef struct gw_sched_stats {
    int running, waiting;
    int64_t kv_blocks_used, kv_blocks_total;
    uint64_t steps, step_errors;
} gw_sched_stats;

// gw_sched_router_limits lowers the plan limits to the router's (StatusReply; 0: unknown),
// logging the mismatch of the flags once per change; a different shard count is logged as an
// error (KV admission per shard cannot be fixed at run time). Loop thread only.
void gw_sched_router_limits(gw_sched *s, uint32_t max_step_seqs, uint32_t max_batch_tokens,
                            uint32_t shards);

// gw_sched_shard_report tells the scheduler what attention shard `shard` (its instance; name:
// "attention/N" for logs) states about its KV cache (kv borrowed; all 0: states nothing).
// Admission on that shard follows from the next plan on; a change (restart with other flags)
// is logged once, a bad statement (MM_EINVAL from mm_kv_capacity_check, a block size other
// than conf.block_size) is logged as an error naming the shard and the shard admits nothing.
// Waiting seqs that no shard can ever hold any more fail (MM_EINVAL). Loop thread only.
void gw_sched_shard_report(gw_sched *s, uint32_t shard, const char *name,
                           const mm_kv_capacity *kv);
// gw_sched_kv_ready says whether some shard has a known, usable capacity; when not, why holds
// one line saying what is missing (n bytes).
bool gw_sched_kv_ready(const gw_sched *s, char *why, size_t n);
// gw_sched_fail_waiting fails every waiting seq with code and msg (the mesh cannot serve and
// no shard's capacity is known: nothing would ever admit them).
void gw_sched_fail_waiting(gw_sched *s, mm_err code, const char *msg);

// gw_sched_new returns owned *out. ops and arg are borrowed. Errors: MM_EINVAL, MM_ENOMEM.
mm_err gw_sched_new(gw_sched **out, const gw_sched_conf *c, gw_mesh *mesh,
                    const gw_sched_ops *ops, void *arg, char err[MM_ERRLEN]);
void gw_sched_free(gw_sched *s); // accepts NULL; call after the loop stopped
// gw_sched_check says whether a seq with n_prompt tokens and max_gen new ones could ever run.
// Errors: MM_EINVAL naming the limit (context, KV capacity).
mm_err gw_sched_check(const gw_sched *s, int n_prompt, int max_gen, char err[MM_ERRLEN]);
// gw_sched_seq_kv_tokens: the most tokens (prompt + generated) one seq's KV can hold on the
// largest shard whose capacity is known (the conf's max_ctx while none is known).
int64_t gw_sched_seq_kv_tokens(const gw_sched *s);
// gw_sched_submit queues n seqs (one request's choices) at the tail. Errors: MM_EFULL (queue
// full: nothing queued), MM_EINVAL (gw_sched_check failed).
mm_err gw_sched_submit(gw_sched *s, gw_seq **seqs, int n, char err[MM_ERRLEN]);
// gw_sched_cancel: the owner lost interest in q (client gone); no more token/fail calls for it;
// its KV is released in the next plan; ops.dropped runs (maybe before this returns).
void gw_sched_cancel(gw_sched *s, gw_seq *q);
void gw_sched_get_stats(const gw_sched *s, gw_sched_stats *st);
// gw_sched_stop fails every queued and running seq with MM_ECLOSED (shutdown).
void gw_sched_stop(gw_sched *s);

#endif
