// SPDX-License-Identifier: MIT
// The OpenAI API of the gateway (api.c): request parsing and validation, the per-request state
// behind the scheduler's seqs, responses (JSON and SSE) and /metrics (metrics.c).
//
// Threading: the loop thread only.
#ifndef MM_GATEWAY_API_H
#define MM_GATEWAY_API_H

#include <stdint.h>

#include "gateway.h"
#include "mm/chat_template.h"
#include "mm/tokenizer.h"

// ---- metrics.c ------------------------------------------------------------------------------
#define GW_HIST_MAX 24
typedef struct gw_hist {
    int n_bounds;
    const double *bounds; // upper bounds in seconds (or units), increasing
    uint64_t counts[GW_HIST_MAX + 1];
    double sum;
    uint64_t count;
} gw_hist;

void gw_hist_init(gw_hist *h, const double *bounds, int n);
void gw_hist_add(gw_hist *h, double v);
// gw_hist_quantile estimates quantile q (0..1) from the buckets (upper bound of the bucket).
double gw_hist_quantile(const gw_hist *h, double q);

typedef struct gw_metrics {
    gw_hist ttft, itl, e2e, overhead, handoff, tokens, plan, prompt_len, gen_len;
    uint64_t prompt_tokens, generation_tokens;
    uint64_t req_ok[4];      // finish reasons: stop, length, tool_calls, abort (cancelled)
    uint64_t req_failed;
    uint64_t http_status[6]; // 2xx..5xx by hundreds (index status/100)
    uint64_t rejected_429, rejected_503;
} gw_metrics;

void gw_metrics_init(gw_metrics *m);

// ---- api.c ----------------------------------------------------------------------------------
typedef struct gw_api gw_api;

typedef struct gw_api_conf {
    const char *model_dir;   // --model (tokenizer, chat template, config)
    const char *model_name;  // served name (--served-model-name, default: the dir's basename)
    const char *api_key;     // NULL or "": no key needed
    int keepalive_ms;        // SSE comment interval while a stream waits
    int health_ms;           // how often the mesh's membership is refreshed
    int health_timeout_ms;
    gw_sched_conf sched;     // max_ctx etc. (sched.max_ctx is capped by the model)
    double kv_mb;            // --kv-mb: caps each shard's stated KV budget (0: none), and
                             // sizes a shard that states none (0: 64 MiB)
    const char *kv_dtype;    // with it, for a shard that states no capacity: "f32" (NULL too)
                             // or "bf16" (bytes per element of that shard's cache)
    const char *chat_template; // --chat-template: a template file instead of the checkpoint's
                               // (NULL or "": the checkpoint's, optional)
} gw_api_conf;

// gw_api_open loads the tokenizer, the chat template (the checkpoint's: optional; a
// --chat-template file: required) and the model config, sizes the scheduler and starts the
// timers. Returns owned *out. Errors: the tokenizer's, config's, the named template file's,
// MM_EINVAL.
mm_err gw_api_open(gw_api **out, uv_loop_t *loop, gw_mesh *mesh, const gw_api_conf *c,
                   char err[MM_ERRLEN]);
// gw_api_routes registers every route of the API on h.
mm_err gw_api_routes(gw_api *a, gw_http *h);

// gw_api_note_status updates the API's view of the mesh (arg: gw_api) from a status answer of
// the router (rv != MM_OK: unreachable, err says why). The API's own periodic check and every
// GET /health answer go through it, so the two never disagree for long. Loop thread only.
void gw_api_note_status(void *arg, mm_err rv, const Mmctl__StatusReply *reply,
                        const char *err);
// gw_api_stop ends every request (503 / error event) and stops the timers (shutdown).
void gw_api_stop(gw_api *a);
void gw_api_free(gw_api *a); // after the loop has closed every handle

// gw_metrics_route serves GET /metrics (arg: gw_api).
int gw_metrics_route(void *arg, h2o_req_t *req);
const gw_metrics *gw_api_metrics(const gw_api *a);
void gw_api_sched_stats(const gw_api *a, gw_sched_stats *st);
const char *gw_api_model_name(const gw_api *a);
// gw_api_router_detail: the router's status detail as of the last status answer ("" before
// one): its drafting counters (step_draft.c), which /metrics exposes.
const char *gw_api_router_detail(const gw_api *a);

#endif
