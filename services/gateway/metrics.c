// SPDX-License-Identifier: MIT
// GET /metrics: Prometheus text exposition of the gateway's counters and histograms, with the
// metric families vLLM users know, named moemesh:...; see api.h.
#define H2O_USE_LIBUV 1
#include <h2o.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

void gw_hist_init(gw_hist *h, const double *bounds, int n) {
    memset(h, 0, sizeof(*h));
    h->bounds = bounds;
    h->n_bounds = n > GW_HIST_MAX ? GW_HIST_MAX : n;
}

void gw_hist_add(gw_hist *h, double v) {
    int i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

double gw_hist_quantile(const gw_hist *h, double q) {
    if (h->count == 0)
        return 0;
    uint64_t want = (uint64_t)(q * (double)h->count + 0.999999), acc = 0;
    for (int i = 0; i <= h->n_bounds; i++) {
        acc += h->counts[i];
        if (acc >= want)
            return i < h->n_bounds ? h->bounds[i] : h->bounds[h->n_bounds - 1];
    }
    return h->bounds[h->n_bounds - 1];
}

static const double k_lat[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double k_itl[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05,
                               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5};
static const double k_ovh[] = {1e-6, 2.5e-6, 5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 2.5e-4,
                               5e-4, 1e-3, 2.5e-3, 1e-2};
static const double k_len[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000};

void gw_metrics_init(gw_metrics *m) {
    memset(m, 0, sizeof(*m));
    gw_hist_init(&m->ttft, k_lat, (int)(sizeof(k_lat) / sizeof(k_lat[0])));
    gw_hist_init(&m->e2e, k_lat, (int)(sizeof(k_lat) / sizeof(k_lat[0])));
    gw_hist_init(&m->itl, k_itl, (int)(sizeof(k_itl) / sizeof(k_itl[0])));
    gw_hist_init(&m->overhead, k_ovh, (int)(sizeof(k_ovh) / sizeof(k_ovh[0])));
    gw_hist_init(&m->handoff, k_ovh, (int)(sizeof(k_ovh) / sizeof(k_ovh[0])));
    gw_hist_init(&m->tokens, k_ovh, (int)(sizeof(k_ovh) / sizeof(k_ovh[0])));
    gw_hist_init(&m->plan, k_ovh, (int)(sizeof(k_ovh) / sizeof(k_ovh[0])));
    gw_hist_init(&m->prompt_len, k_len, (int)(sizeof(k_len) / sizeof(k_len[0])));
    gw_hist_init(&m->gen_len, k_len, (int)(sizeof(k_len) / sizeof(k_len[0])));
}

struct out {
    char *p;
    size_t len, cap;
};

__attribute__((format(printf, 2, 3))) static void outf(struct out *o, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(o->p + o->len, o->cap - o->len, fmt, ap);
        va_end(ap);
        if (n < 0)
            return;
        if (o->len + (size_t)n < o->cap) {
            o->len += (size_t)n;
            return;
        }
        size_t cap = (o->cap + (size_t)n + 1) * 2;
        char *p = realloc(o->p, cap);
        if (!p)
            return;
        o->p = p;
        o->cap = cap;
    }
}

static void hist(struct out *o, const char *name, const char *help, const char *labels,
                 const gw_hist *h) {
    outf(o, "# HELP moemesh:%s %s\n# TYPE moemesh:%s histogram\n", name, help, name);
    uint64_t acc = 0;
    for (int i = 0; i < h->n_bounds; i++) {
        acc += h->counts[i];
        outf(o, "moemesh:%s_bucket{%sle=\"%g\"} %llu\n", name, labels, h->bounds[i],
             (unsigned long long)acc);
    }
    acc += h->counts[h->n_bounds];
    outf(o, "moemesh:%s_bucket{%sle=\"+Inf\"} %llu\n", name, labels, (unsigned long long)acc);
    const char *bare = labels[0] ? labels : "";
    size_t bl = strlen(bare);
    outf(o, "moemesh:%s_sum{%.*s} %.9g\n", name, (int)(bl ? bl - 1 : 0), bare, h->sum);
    outf(o, "moemesh:%s_count{%.*s} %llu\n", name, (int)(bl ? bl - 1 : 0), bare,
         (unsigned long long)h->count);
}

static void one(struct out *o, const char *type, const char *name, const char *help,
                const char *labels, double v) {
    outf(o, "# HELP moemesh:%s %s\n# TYPE moemesh:%s %s\nmoemesh:%s{%s} %.9g\n", name, help, name,
         type, name, labels, v);
}

// ---- drafting: the router's counters, from its status detail ---------------------------------
// The router publishes them in its status detail (services/router/step_draft.c, mm_draft_end):
// "... drafting: drafted=D accepted=A emitted=E ... drafter_misses=X drafts=V ahead=R
// ahead_hits=H ahead_misses=M sync=S ... pos_drafted=t0/t1/.. pos_accepted=a0/a1/..
// widths=0:n0,1:n1,.. ... ahead_steps=N sync_steps=N ... mode_switches=N". The gateway holds the
// detail of its last status answer (its periodic mesh check, or a GET /health), so these figures
// are as fresh as that.

#define SPEC_MAX_POS 16

typedef struct spec_counters {
    unsigned long long drafted, accepted, emitted, misses, drafts;
    unsigned long long ahead, ahead_hits, ahead_misses, sync; // draft-ahead (router pipeline)
    unsigned long long ahead_steps, sync_steps, mode_switches; // the mode (--draft-pipeline)
    unsigned long long pos_drafted[SPEC_MAX_POS], pos_accepted[SPEC_MAX_POS];
    unsigned long long widths[SPEC_MAX_POS + 1];
    int n_pos, n_widths;
} spec_counters;

// spec_field: the text after " key=" in the drafting part of detail, or NULL.
static const char *spec_field(const char *d, const char *key) {
    size_t kl = strlen(key);
    for (const char *p = strstr(d, key); p; p = strstr(p + 1, key))
        if ((p == d || p[-1] == ' ') && p[kl] == '=')
            return p + kl + 1;
    return NULL;
}

static unsigned long long spec_num(const char *d, const char *key) {
    const char *v = spec_field(d, key);
    return v ? strtoull(v, NULL, 10) : 0;
}

// spec_list reads "n0/n1/..." after key into out (max entries); returns the count.
static int spec_list(const char *d, const char *key, unsigned long long *out, int max) {
    const char *v = spec_field(d, key);
    int n = 0;
    while (v && n < max && *v >= '0' && *v <= '9') {
        char *end;
        out[n++] = strtoull(v, &end, 10);
        v = *end == '/' ? end + 1 : NULL;
    }
    return n;
}

static void spec_parse(const char *detail, spec_counters *c) {
    memset(c, 0, sizeof(*c));
    const char *d = strstr(detail, "drafting:");
    if (!d)
        return;
    c->drafted = spec_num(d, "drafted");
    c->accepted = spec_num(d, "accepted");
    c->emitted = spec_num(d, "emitted");
    c->misses = spec_num(d, "drafter_misses");
    c->drafts = spec_num(d, "drafts");
    c->ahead = spec_num(d, "ahead");
    c->ahead_hits = spec_num(d, "ahead_hits");
    c->ahead_misses = spec_num(d, "ahead_misses");
    c->sync = spec_num(d, "sync");
    c->ahead_steps = spec_num(d, "ahead_steps");
    c->sync_steps = spec_num(d, "sync_steps");
    c->mode_switches = spec_num(d, "mode_switches");
    int a = spec_list(d, "pos_drafted", c->pos_drafted, SPEC_MAX_POS);
    int b = spec_list(d, "pos_accepted", c->pos_accepted, SPEC_MAX_POS);
    c->n_pos = a < b ? a : b;
    const char *w = spec_field(d, "widths"); // "0:n0,1:n1,..."
    while (w && *w >= '0' && *w <= '9') {
        char *end;
        unsigned long k = strtoul(w, &end, 10);
        if (*end != ':' || k > SPEC_MAX_POS)
            break;
        c->widths[k] = strtoull(end + 1, &end, 10);
        if ((int)k + 1 > c->n_widths)
            c->n_widths = (int)k + 1;
        w = *end == ',' ? end + 1 : NULL;
    }
}

static void spec_metrics(struct out *o, const char *lab, const char *bare, const char *detail) {
    spec_counters c;
    spec_parse(detail, &c);
    one(o, "counter", "spec_decode_num_drafts_total",
        "Speculative decoding: verifications of drafts (a seq's step with at least one draft).",
        bare, (double)c.drafts);
    one(o, "counter", "spec_decode_num_draft_tokens_total",
        "Speculative decoding: drafted tokens verified by the target.", bare, (double)c.drafted);
    one(o, "counter", "spec_decode_num_accepted_tokens_total",
        "Speculative decoding: drafted tokens accepted (each one a token without its own step).",
        bare, (double)c.accepted);
    one(o, "counter", "spec_decode_num_emitted_tokens_total",
        "Speculative decoding: tokens emitted by decode steps of drafting-capable seqs "
        "(accepted drafts plus the target's own token per seq and step).", bare,
        (double)c.emitted);
    one(o, "counter", "spec_decode_drafter_misses_total",
        "Speculative decoding: steps that went on without drafts (drafter down, late or "
        "refusing).", bare, (double)c.misses);
    one(o, "counter", "spec_decode_ahead_requests_total",
        "Speculative decoding: draft requests sent ahead (during the step before the one they "
        "draft for, not waited for).", bare, (double)c.ahead);
    one(o, "counter", "spec_decode_ahead_hits_total",
        "Speculative decoding: seq steps that drafted from ahead proposals (all drafts of the "
        "step before accepted and the drafter's guess of the target's token right).", bare,
        (double)c.ahead_hits);
    one(o, "counter", "spec_decode_ahead_misses_total",
        "Speculative decoding: seq steps that were to draft without valid ahead proposals (a "
        "synchronous request or no drafts).", bare, (double)c.ahead_misses);
    one(o, "counter", "spec_decode_sync_requests_total",
        "Speculative decoding: draft requests waited for before their step.", bare,
        (double)c.sync);
    one(o, "counter", "spec_decode_ahead_mode_steps_total",
        "Speculative decoding: drafting steps run with draft-ahead (router --draft-pipeline "
        "true, or auto's choice or measurement).", bare, (double)c.ahead_steps);
    one(o, "counter", "spec_decode_sync_mode_steps_total",
        "Speculative decoding: drafting steps run with waited drafts (router --draft-pipeline "
        "false, or auto's choice or measurement).", bare, (double)c.sync_steps);
    one(o, "counter", "spec_decode_mode_switches_total",
        "Speculative decoding: changes of the measured better mode (--draft-pipeline auto), "
        "over all seqs ranges.", bare, (double)c.mode_switches);
    one(o, "gauge", "spec_decode_acceptance_rate",
        "Speculative decoding: accepted / drafted tokens so far.", bare,
        c.drafted ? (double)c.accepted / (double)c.drafted : 0);
    one(o, "gauge", "spec_decode_mean_accepted_length",
        "Speculative decoding: accepted tokens per verification so far.", bare,
        c.drafts ? (double)c.accepted / (double)c.drafts : 0);
    outf(o, "# HELP moemesh:spec_decode_num_draft_tokens_per_pos_total Speculative decoding: "
            "drafts verified at each position (0: the first draft of a step; position i is "
            "verified only when 0..i-1 were accepted).\n"
            "# TYPE moemesh:spec_decode_num_draft_tokens_per_pos_total counter\n");
    for (int i = 0; i < c.n_pos; i++)
        outf(o, "moemesh:spec_decode_num_draft_tokens_per_pos_total{%sposition=\"%d\"} %llu\n",
             lab, i, c.pos_drafted[i]);
    outf(o, "# HELP moemesh:spec_decode_num_accepted_tokens_per_pos_total Speculative decoding: "
            "drafts accepted at each position.\n"
            "# TYPE moemesh:spec_decode_num_accepted_tokens_per_pos_total counter\n");
    for (int i = 0; i < c.n_pos; i++)
        outf(o, "moemesh:spec_decode_num_accepted_tokens_per_pos_total{%sposition=\"%d\"} %llu\n",
             lab, i, c.pos_accepted[i]);
    outf(o, "# HELP moemesh:spec_decode_acceptance_rate_per_pos Speculative decoding: accepted / "
            "verified drafts at each position.\n"
            "# TYPE moemesh:spec_decode_acceptance_rate_per_pos gauge\n");
    for (int i = 0; i < c.n_pos; i++)
        outf(o, "moemesh:spec_decode_acceptance_rate_per_pos{%sposition=\"%d\"} %.9g\n", lab, i,
             c.pos_drafted[i] ? (double)c.pos_accepted[i] / (double)c.pos_drafted[i] : 0);
    outf(o, "# HELP moemesh:spec_decode_width_chosen_total Speculative decoding: seq steps by "
            "the draft width chosen for them (0: no drafts asked).\n"
            "# TYPE moemesh:spec_decode_width_chosen_total counter\n");
    for (int i = 0; i < c.n_widths; i++)
        outf(o, "moemesh:spec_decode_width_chosen_total{%swidth=\"%d\"} %llu\n", lab, i,
             c.widths[i]);
}

int gw_metrics_route(void *arg, h2o_req_t *req) {
    gw_api *a = arg;
    const gw_metrics *m = gw_api_metrics(a);
    gw_sched_stats st;
    gw_api_sched_stats(a, &st);
    char lab[256];
    snprintf(lab, sizeof(lab), "model_name=\"%s\",", gw_api_model_name(a));
    size_t ll = strlen(lab);
    char bare[256];
    snprintf(bare, sizeof(bare), "%.*s", (int)(ll - 1), lab);
    struct out o = {0};
    one(&o, "gauge", "num_requests_running", "Sequences in running steps.", bare, st.running);
    one(&o, "gauge", "num_requests_waiting", "Sequences waiting for admission.", bare,
        st.waiting);
    one(&o, "gauge", "kv_cache_usage_perc", "KV cache usage (1 = full), as reserved by admission.",
        bare, st.kv_blocks_total ? (double)st.kv_blocks_used / (double)st.kv_blocks_total : 0);
    one(&o, "counter", "prompt_tokens_total", "Prompt tokens processed.", bare,
        (double)m->prompt_tokens);
    one(&o, "counter", "generation_tokens_total", "Generated tokens.", bare,
        (double)m->generation_tokens);
    outf(&o, "# HELP moemesh:request_success_total Finished requests by finish reason.\n"
             "# TYPE moemesh:request_success_total counter\n");
    static const char *why[4] = {"stop", "length", "tool_calls", "abort"};
    for (int i = 0; i < 4; i++)
        outf(&o, "moemesh:request_success_total{%sfinished_reason=\"%s\"} %llu\n", lab, why[i],
             (unsigned long long)m->req_ok[i]);
    one(&o, "counter", "request_failure_total", "Requests the mesh failed (503 or stream error).",
        bare, (double)m->req_failed);
    outf(&o, "# HELP moemesh:http_requests_total HTTP answers by status class.\n"
             "# TYPE moemesh:http_requests_total counter\n");
    for (int i = 2; i <= 5; i++)
        outf(&o, "moemesh:http_requests_total{%sstatus=\"%dxx\"} %llu\n", lab, i,
             (unsigned long long)m->http_status[i]);
    one(&o, "counter", "num_steps_total", "StepPlans the router answered (or failed).", bare,
        (double)st.steps);
    one(&o, "counter", "num_step_errors_total", "Steps that failed as a whole.", bare,
        (double)st.step_errors);
    hist(&o, "time_to_first_token_seconds", "Time to first token (arrival to first token).", lab,
         &m->ttft);
    hist(&o, "inter_token_latency_seconds", "Time between consecutive tokens of a sequence.", lab,
         &m->itl);
    hist(&o, "e2e_request_latency_seconds", "Arrival to the last token.", lab, &m->e2e);
    hist(&o, "request_prompt_tokens", "Prompt tokens per request.", lab, &m->prompt_len);
    hist(&o, "request_generation_tokens", "Generated tokens per request.", lab, &m->gen_len);
    hist(&o, "gateway_token_overhead_seconds",
         "Gateway time per delivery: the router's StepResult arrival (nng) to the client socket "
         "write.", lab, &m->overhead);
    hist(&o, "gateway_step_handoff_seconds",
         "Per step: StepResult arrival on the nng thread to the loop taking it up.", lab,
         &m->handoff);
    hist(&o, "gateway_step_tokens_seconds",
         "Per step: delivering its tokens to the requests (detokenize, stop strings, events).",
         lab, &m->tokens);
    hist(&o, "gateway_step_plan_seconds",
         "Per step: building and handing the next StepPlan to nng (before any socket write).",
         lab, &m->plan);
    spec_metrics(&o, lab, bare, gw_api_router_detail(a));
    char *copy = h2o_mem_alloc_pool(&req->pool, o.len ? o.len : 1);
    memcpy(copy, o.p, o.len);
    free(o.p);
    req->res.status = 200;
    req->res.reason = "OK";
    req->res.content_length = o.len;
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                   H2O_STRLIT("text/plain; version=0.0.4"));
    h2o_send_inline(req, copy, o.len);
    return 0;
}
