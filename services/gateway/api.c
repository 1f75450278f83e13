// SPDX-License-Identifier: MIT
// The OpenAI API on the gateway; see api.h.
//
// Design notes:
// - A request (struct greq, malloc'd) owns its choices; each choice embeds the gw_seq the
//   scheduler runs. refs = 1 for the HTTP side + 1 per seq the scheduler holds; the request is
//   freed when both sides let go. The HTTP side lets go in the pool's dispose callback (the
//   guard of DEPENDENCIES.md section 2, gotcha 3): from then on req is never touched and every
//   seq still running is cancelled (its KV released in the next plan).
// - Streams: one h2o_send outstanding at a time; events produced meanwhile accumulate in
//   `pend` and go out from proceed. The last buffer travels with H2O_SEND_STATE_FINAL from the
//   request's pool (h2o does not say when it has been written).
// - A stream starts (200 + headers) at its first token, or at the first keep-alive tick while
//   it waits, so that an HTTP/1.1 client that left is noticed (h2o only sees it on a write).
//   Before that, a mesh failure is an HTTP 503; after, an error event and data: [DONE].
// - Text: every token goes through the choice's streaming detokenizer; stop strings are
//   searched in the text, and the tail that could still become a stop string is held back.
//   Chat output is then split into reasoning (<think>..</think>), content and tool calls
//   (Qwen3's <tool_call>{json}</tool_call>) as it becomes final.
#define H2O_USE_LIBUV 1
#include <h2o.h>
#include <libgen.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

#include "api.h"
#include "parse.h"
#include "mm/json.h"
#include "mm/log.h"
#include "mm/model.h"
#include "mm/time.h"

#define MAX_CHOICES 128
#define MAX_STOPS 16
#define MAX_STOP_LEN 256
#define MAX_EOS 8
#define MAX_PROMPT_IDS (1 << 20)

enum { API_COMPLETION, API_CHAT };
enum { FIN_NONE, FIN_STOP, FIN_LENGTH, FIN_TOOLS };

struct greq;

struct choice {
    gw_seq seq;
    struct greq *g;
    int prompt_index;
    mm_detok_stream ds;
    gw_buf text;     // visible generated text (cut at a stop string)
    size_t safe;          // bytes of text that are final
    size_t sent;          // completions stream: bytes of text sent
    int finish;
    bool done;
    // logprobs (when asked): per generated token
    float *lp;
    int32_t *top_id;      // (max_gen, n_top)
    float *top_lp;
    uint32_t *n_top;
    int n_lp_sent;        // stream: entries sent
    size_t lp_off;        // stream: text_offset of the next entry
    // chat parsing
    gw_chat_parse cp;
    size_t r_sent, c_sent;
    size_t tools_sent;
    bool role_sent, echo_sent;
};

struct greq {
    gw_api *api;
    h2o_req_t *req;            // NULL once the HTTP side is gone
    h2o_generator_t gen;       // stream
    int kind;
    bool stream, include_usage, echo, want_lp, return_ids, ignore_eos, parse_tools;
    bool skip_special; // skip_special_tokens (not given: false where tools are parsed)
    uint32_t n_top;
    int n_choices, n_prompts, n;
    struct choice *ch;
    int32_t *prompt_ids;       // all prompts back to back
    int *prompt_off, *prompt_len; // (n_prompts)
    char **prompt_text;        // (n_prompts) for echo (owned)
    char *stops[MAX_STOPS];
    int n_stops;
    size_t max_stop;
    int refs;
    int n_live;                // choices not yet done
    bool started, final_sent, sending, failed, dirty, think_open, ending, responded;
    char *tool_head;           // owned: the tool call head the prompt wrote (tool_choice), or NULL
    int fail_status;
    char fail_msg[MM_ERRLEN];
    mm_err fail_code;
    gw_buf pend, flight;
    char id[48];
    long long created;
    uint64_t t_arrive_ns, t_last_write_ns, t_tok_done_ns;
    struct greq *next, *prev;  // all live requests (api->live)
    struct greq *dnext;        // dirty list
};

// The tool call forms a template's tools prompt may ask for (gw_api.tool_style, found by the
// probes of mm/chat_template.h): none the output parser reads, Qwen3's (Hermes) <tool_call>
// JSON, GLM's <tool_call>NAME<arg_key>..., DeepSeek V3's and V3.1's blocks.
enum { TS_NONE, TS_HERMES, TS_GLM, TS_DS3, TS_DS31 };

struct gw_api {
    uv_loop_t *loop;
    gw_mesh *mesh;
    gw_sched *sched;
    gw_api_conf c;
    char model_name[256];
    char model_name_json[1600]; // escaped for a JSON string
    mm_tokenizer *tk;
    mm_chat_template *ct;
    char ct_err[MM_ERRLEN];
    int tool_style;    // TS_*: the call form the template's tools prompt asks for (at open)
    int32_t eos[MAX_EOS];
    int n_eos;
    int max_ctx;
    long long created;
    uint64_t next_id;
    gw_metrics m;
    struct greq *live, *dirty;
    uv_timer_t ka_timer, health_timer;
    bool timers_open;
    // mesh health as last seen
    bool mesh_ok;
    char mesh_why[MM_ERRLEN + 32]; // room for "router unreachable: " + an mm_err text
    char router_detail[MM_CTL_MAX_STR]; // the router's status detail (drafting metrics)
    gw_call *health_call;
    bool stopping;
};

// ---- small helpers -------------------------------------------------------------------------

static void count_status(gw_api *a, int status) {
    if (status >= 200 && status < 600)
        a->m.http_status[status / 100]++;
}

static const char *reason_of(int status) {
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    default: return "Service Unavailable";
    }
}

static json_t *error_json(int status, const char *msg, const char *param, const char *code) {
    const char *type = status == 400 || status == 404 || status == 413 ? "invalid_request_error"
                       : status == 401                                 ? "authentication_error"
                       : status == 429                                 ? "rate_limit_error"
                       : status == 503 ? "service_unavailable_error"
                                       : "server_error";
    return json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", msg, "type", type, "param",
                     param ? json_string(param) : json_null(), "code",
                     code ? json_string(code) : json_null());
}

static void send_error(gw_api *a, h2o_req_t *req, int status, const char *param,
                       const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static void send_error(gw_api *a, h2o_req_t *req, int status, const char *param,
                       const char *code, const char *fmt, ...) {
    char msg[MM_ERRLEN + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    json_t *body = error_json(status, msg, param, code);
    if (status == 429)
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_RETRY_AFTER, NULL,
                       H2O_STRLIT("1"));
    count_status(a, status);
    if (status == 429)
        a->m.rejected_429++;
    if (status == 503)
        a->m.rejected_503++;
    gw_http_send_json(req, status, reason_of(status), body);
    json_decref(body);
}

static void send_json(gw_api *a, h2o_req_t *req, json_t *body) {
    count_status(a, 200);
    gw_http_send_json(req, 200, "OK", body);
}

// utf8_json: a JSON string of n bytes, with invalid UTF-8 replaced by U+FFFD.
static json_t *utf8_json(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j)
        return j;
    gw_buf b = {0};
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3
                                  : (c & 0xF8) == 0xF0 ? 4 : 0;
        bool ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + k] & 0xC0) == 0x80;
        if (ok) {
            gw_buf_add(&b, s + i, len);
            i += len;
        } else {
            gw_buf_adds(&b, "\xEF\xBF\xBD");
            i++;
        }
    }
    j = json_stringn(b.p ? b.p : "", b.len);
    free(b.p);
    return j ? j : json_string("");
}

static json_t *token_json(gw_api *a, int32_t id) {
    const char *bytes = NULL;
    size_t n = 0;
    if (mm_tokenizer_token_bytes(a->tk, id, &bytes, &n) != MM_OK)
        return json_string("");
    return utf8_json(bytes, n);
}

static json_t *token_bytes_json(gw_api *a, int32_t id) {
    const char *bytes = NULL;
    size_t n = 0;
    json_t *arr = json_array();
    if (mm_tokenizer_token_bytes(a->tk, id, &bytes, &n) == MM_OK)
        for (size_t i = 0; i < n; i++)
            json_array_append_new(arr, json_integer((unsigned char)bytes[i]));
    return arr;
}

static bool is_eos(const gw_api *a, int32_t t) {
    for (int i = 0; i < a->n_eos; i++)
        if (a->eos[i] == t)
            return true;
    return false;
}

// ---- request lifetime ----------------------------------------------------------------------

static void greq_free(struct greq *g) {
    gw_api *a = g->api;
    if (g->dirty)
        for (struct greq **pp = &a->dirty; *pp; pp = &(*pp)->dnext)
            if (*pp == g) {
                *pp = g->dnext;
                break;
            }
    if (g->prev)
        g->prev->next = g->next;
    else if (a->live == g)
        a->live = g->next;
    if (g->next)
        g->next->prev = g->prev;
    for (int i = 0; i < g->n_choices; i++) {
        struct choice *c = &g->ch[i];
        mm_detok_stream_fini(&c->ds);
        free(c->text.p);
        gw_chat_parse_fini(&c->cp);
        free(c->lp);
        free(c->top_id);
        free(c->top_lp);
        free(c->n_top);
        free(c->seq.tokens);
    }
    free(g->ch);
    free(g->tool_head);
    for (int i = 0; i < g->n_prompts; i++)
        free(g->prompt_text ? g->prompt_text[i] : NULL);
    free(g->prompt_text);
    free(g->prompt_ids);
    free(g->prompt_off);
    free(g->prompt_len);
    for (int i = 0; i < g->n_stops; i++)
        free(g->stops[i]);
    free(g->pend.p);
    free(g->flight.p);
    free(g);
}

static void greq_unref(struct greq *g) {
    if (--g->refs == 0)
        greq_free(g);
}

static void mark_dirty(struct greq *g) {
    if (g->dirty || !g->req)
        return;
    g->dirty = true;
    g->dnext = g->api->dirty;
    g->api->dirty = g;
}

static void on_dispose(void *p) {
    struct greq *g = *(struct greq **)p;
    gw_api *a = g->api;
    g->req = NULL;
    g->refs++; // cancel may drop seqs (and refs) right away
    if (g->n_live > 0 && !g->failed)
        a->m.req_ok[3]++; // the client left before the end
    for (int i = 0; i < g->n_choices; i++)
        if (!g->ch[i].done && g->ch[i].seq.state != GW_SEQ_NEW)
            gw_sched_cancel(a->sched, &g->ch[i].seq);
    greq_unref(g);
    greq_unref(g); // the HTTP side's reference
}

// ---- SSE output ----------------------------------------------------------------------------

static void flush_stream(struct greq *g);

static void on_proceed(h2o_generator_t *gen, h2o_req_t *req) {
    (void)req;
    struct greq *g = H2O_STRUCT_FROM_MEMBER(struct greq, gen, gen);
    g->sending = false;
    g->flight.len = 0;
    flush_stream(g);
}

static void on_stop(h2o_generator_t *gen, h2o_req_t *req) {
    (void)req;
    struct greq *g = H2O_STRUCT_FROM_MEMBER(struct greq, gen, gen);
    g->sending = false; // the dispose guard runs next and cancels the seqs
}

static void start_stream(struct greq *g) {
    if (g->started || !g->req)
        return;
    h2o_req_t *req = g->req;
    req->res.status = 200;
    req->res.reason = "OK";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                   H2O_STRLIT("text/event-stream"));
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CACHE_CONTROL, NULL,
                   H2O_STRLIT("no-cache"));
    g->gen.proceed = on_proceed;
    g->gen.stop = on_stop;
    h2o_start_response(req, &g->gen);
    g->started = true;
    count_status(g->api, 200);
}

static void flush_stream(struct greq *g) {
    if (!g->req || g->sending || g->final_sent || !g->started)
        return;
    if (g->ending) {
        // The last buffer: from the request's pool, since h2o never says when it is written.
        char *copy = h2o_mem_alloc_pool(&g->req->pool, g->pend.len ? g->pend.len : 1);
        memcpy(copy, g->pend.p ? g->pend.p : "", g->pend.len);
        h2o_iovec_t v = h2o_iovec_init(copy, g->pend.len);
        g->pend.len = 0;
        g->final_sent = true;
        g->t_last_write_ns = mm_now_ns();
        h2o_send(g->req, &v, 1, H2O_SEND_STATE_FINAL);
        return;
    }
    if (g->pend.len == 0)
        return;
    gw_buf t = g->flight;
    g->flight = g->pend;
    g->pend = t;
    g->pend.len = 0;
    g->sending = true;
    h2o_iovec_t v = h2o_iovec_init(g->flight.p, g->flight.len);
    g->t_last_write_ns = mm_now_ns();
    h2o_send(g->req, &v, 1, H2O_SEND_STATE_IN_PROGRESS);
}

// end_stream sends what is pending plus tail as the final buffer (from the request's pool).
static void end_stream(struct greq *g, const char *tail) {
    if (!g->req || g->final_sent)
        return;
    start_stream(g);
    gw_buf_adds(&g->pend, tail);
    g->ending = true;
    flush_stream(g); // now, or from proceed when a write is in flight
}

static void sse_event(struct greq *g, json_t *obj) {
    char *s = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    if (!s)
        return;
    gw_buf_adds(&g->pend, "data: ");
    gw_buf_adds(&g->pend, s);
    gw_buf_adds(&g->pend, "\n\n");
    free(s);
}

// ---- responses -----------------------------------------------------------------------------

static const char *finish_name(int f) {
    return f == FIN_STOP ? "stop" : f == FIN_LENGTH ? "length" : f == FIN_TOOLS ? "tool_calls"
                                                                                : NULL;
}

static json_t *usage_json(const struct greq *g) {
    long long p = 0, c = 0;
    for (int i = 0; i < g->n_prompts; i++)
        p += g->prompt_len[i];
    for (int i = 0; i < g->n_choices; i++)
        c += g->ch[i].seq.n_gen;
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)p, "completion_tokens",
                     (json_int_t)c, "total_tokens", (json_int_t)(p + c));
}

static json_t *chunk_base(struct greq *g) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", g->id, "object",
                     g->kind == API_CHAT ? "chat.completion.chunk" : "text_completion",
                     "created", (json_int_t)g->created, "model", g->api->model_name);
}

// completions logprobs object for entries [from, to) of c (text_offset from base).
static json_t *cmpl_logprobs(struct greq *g, struct choice *c, int from, int to, size_t *off) {
    gw_api *a = g->api;
    json_t *toks = json_array(), *tlp = json_array(), *top = json_array(), *offs = json_array();
    const int32_t *gen = c->seq.tokens + c->seq.n_prompt;
    for (int i = from; i < to; i++) {
        json_array_append_new(toks, token_json(a, gen[i]));
        json_array_append_new(tlp, json_real(c->lp[i]));
        json_t *t = json_object();
        for (uint32_t k = 0; k < c->n_top[i]; k++) {
            json_t *name = token_json(a, c->top_id[(size_t)i * g->n_top + k]);
            json_object_set_new(t, json_string_value(name),
                                json_real(c->top_lp[(size_t)i * g->n_top + k]));
            json_decref(name);
        }
        json_array_append_new(top, t);
        json_array_append_new(offs, json_integer((json_int_t)*off));
        const char *b;
        size_t n = 0;
        if (mm_tokenizer_token_bytes(a->tk, gen[i], &b, &n) == MM_OK)
            *off += n;
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", tlp,
                     "top_logprobs", top, "text_offset", offs);
}

static json_t *chat_logprobs(struct greq *g, struct choice *c, int from, int to) {
    gw_api *a = g->api;
    json_t *content = json_array();
    const int32_t *gen = c->seq.tokens + c->seq.n_prompt;
    for (int i = from; i < to; i++) {
        json_t *top = json_array();
        for (uint32_t k = 0; k < c->n_top[i]; k++) {
            int32_t id = c->top_id[(size_t)i * g->n_top + k];
            json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token", token_json(a, id),
                                                 "logprob",
                                                 (double)c->top_lp[(size_t)i * g->n_top + k],
                                                 "bytes", token_bytes_json(a, id)));
        }
        json_array_append_new(content, json_pack("{s:o, s:f, s:o, s:o}", "token",
                                                 token_json(a, gen[i]), "logprob",
                                                 (double)c->lp[i], "bytes",
                                                 token_bytes_json(a, gen[i]), "top_logprobs",
                                                 top));
    }
    return json_pack("{s:o}", "content", content);
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *arr = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(arr, json_integer(ids[i]));
    return arr;
}

static void record_done(struct greq *g) {
    gw_api *a = g->api;
    uint64_t now = mm_now_ns();
    long long gen = 0;
    for (int i = 0; i < g->n_choices; i++) {
        struct choice *c = &g->ch[i];
        gen += c->seq.n_gen;
        if (c->finish == FIN_STOP)
            a->m.req_ok[0]++;
        else if (c->finish == FIN_LENGTH)
            a->m.req_ok[1]++;
        else if (c->finish == FIN_TOOLS)
            a->m.req_ok[2]++;
    }
    for (int i = 0; i < g->n_prompts; i++) {
        a->m.prompt_tokens += (uint64_t)g->prompt_len[i];
        gw_hist_add(&a->m.prompt_len, g->prompt_len[i]);
    }
    a->m.generation_tokens += (uint64_t)gen;
    gw_hist_add(&a->m.gen_len, (double)gen);
    gw_hist_add(&a->m.e2e, (double)(now - g->t_arrive_ns) / 1e9);
}

static json_t *chat_message(struct choice *c) {
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    bool has_tools = c->cp.tool_calls && json_array_size(c->cp.tool_calls) > 0;
    // Content that is only whitespace around tool calls is no content.
    bool blank = true;
    for (size_t i = 0; i < c->cp.content.len; i++)
        if (!strchr(" \t\r\n", c->cp.content.p[i]))
            blank = false;
    if (c->cp.content.len && !(has_tools && blank))
        json_object_set_new(msg, "content", utf8_json(c->cp.content.p, c->cp.content.len));
    else
        json_object_set_new(msg, "content", has_tools ? json_null() : json_string(""));
    if (c->cp.reasoning.len)
        json_object_set_new(msg, "reasoning_content",
                            utf8_json(c->cp.reasoning.p, c->cp.reasoning.len));
    if (has_tools)
        json_object_set(msg, "tool_calls", c->cp.tool_calls);
    return msg;
}

// respond: every choice is done; answer the whole request (non-stream) or end the stream.
static void respond(struct greq *g) {
    gw_api *a = g->api;
    if (!g->req || g->responded)
        return;
    g->responded = true;
    if (g->failed) {
        a->m.req_failed++;
        if (!g->started) {
            send_error(a, g->req, g->fail_status, NULL,
                       g->fail_status == 503 ? "mesh_unavailable" : NULL, "%s", g->fail_msg);
            return;
        }
        json_t *e = error_json(g->fail_status, g->fail_msg, NULL,
                               g->fail_status == 503 ? "mesh_unavailable" : NULL);
        sse_event(g, e);
        end_stream(g, "data: [DONE]\n\n");
        return;
    }
    record_done(g);
    if (g->stream) {
        if (g->include_usage) {
            json_t *u = chunk_base(g);
            json_object_set_new(u, "choices", json_array());
            json_object_set_new(u, "usage", usage_json(g));
            sse_event(g, u);
        }
        end_stream(g, "data: [DONE]\n\n");
        return;
    }
    json_t *choices = json_array();
    for (int i = 0; i < g->n_choices; i++) {
        struct choice *c = &g->ch[i];
        json_t *ch;
        if (g->kind == API_CHAT) {
            ch = json_pack("{s:i, s:o, s:o, s:s}", "index", i, "message", chat_message(c),
                           "logprobs",
                           g->want_lp ? chat_logprobs(g, c, 0, c->seq.n_gen) : json_null(),
                           "finish_reason", finish_name(c->finish));
        } else {
            gw_buf t = {0};
            const char *pt = g->echo ? g->prompt_text[c->prompt_index] : "";
            gw_buf_adds(&t, pt);
            gw_buf_add(&t, c->text.p ? c->text.p : "", c->text.len);
            size_t off = strlen(pt);
            ch = json_pack("{s:i, s:o, s:o, s:s}", "index", i, "text",
                           utf8_json(t.p ? t.p : "", t.len), "logprobs",
                           g->want_lp ? cmpl_logprobs(g, c, 0, c->seq.n_gen, &off) : json_null(),
                           "finish_reason", finish_name(c->finish));
            free(t.p);
        }
        if (g->return_ids) {
            json_object_set_new(ch, "token_ids", ids_json(c->seq.tokens + c->seq.n_prompt,
                                                          c->seq.n_gen));
            json_object_set_new(ch, "prompt_token_ids",
                                ids_json(g->prompt_ids + g->prompt_off[c->prompt_index],
                                         g->prompt_len[c->prompt_index]));
        }
        json_array_append_new(choices, ch);
    }
    json_t *body = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", g->id, "object",
                             g->kind == API_CHAT ? "chat.completion" : "text_completion",
                             "created", (json_int_t)g->created, "model", a->model_name,
                             "choices", choices, "usage", usage_json(g));
    send_json(a, g->req, body);
    json_decref(body);
}

// ---- text: stop strings, chat parsing ------------------------------------------------------

// suffix_hold: bytes at the end of text that are a proper prefix of some stop string.
static size_t suffix_hold(const struct greq *g, const char *t, size_t n) {
    size_t best = 0;
    for (int s = 0; s < g->n_stops; s++) {
        size_t sl = strlen(g->stops[s]);
        for (size_t k = sl - 1; k > best; k--)
            if (k <= n && memcmp(t + n - k, g->stops[s], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

// json_escape_into appends s[0, n) as the inside of a JSON string: quotes, backslashes and
// control characters escaped, invalid UTF-8 replaced by U+FFFD.
static void json_escape_into(gw_buf *b, const char *s, size_t n) {
    if (!gw_buf_reserve(b, n * 6 + 1))
        return;
    char *o = b->p + b->len;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = (char)c;
            i++;
        } else if (c < 0x20) {
            static const char hex[] = "0123456789abcdef";
            if (c == '\n') {
                *o++ = '\\';
                *o++ = 'n';
            } else {
                memcpy(o, "\\u00", 4);
                o[4] = hex[c >> 4];
                o[5] = hex[c & 15];
                o += 6;
            }
            i++;
        } else if (c < 0x80) {
            *o++ = (char)c;
            i++;
        } else {
            size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
            bool ok = len > 0 && i + len <= n && c >= 0xC2 && c <= 0xF4;
            for (size_t k = 1; ok && k < len; k++)
                ok = ((unsigned char)s[i + k] & 0xC0) == 0x80;
            if (ok && len == 3) { // no overlongs, no surrogates
                unsigned char d = (unsigned char)s[i + 1];
                ok = !(c == 0xE0 && d < 0xA0) && !(c == 0xED && d >= 0xA0);
            } else if (ok && len == 4) {
                unsigned char d = (unsigned char)s[i + 1];
                ok = !(c == 0xF0 && d < 0x90) && !(c == 0xF4 && d >= 0x90);
            }
            if (ok) {
                memcpy(o, s + i, len);
                o += len;
                i += len;
            } else {
                memcpy(o, "\xEF\xBF\xBD", 3);
                o += 3;
                i++;
            }
        }
    }
    b->len = (size_t)(o - b->p);
    b->p[b->len] = 0;
}

// stream_text_fast appends the common event (a text or content delta, nothing else) without
// building JSON objects: the per-token path of most streams. Returns false when the event needs
// more (role, reasoning, tool calls, logprobs, the end) and the general path must build it.
static bool stream_text_fast(struct greq *g, struct choice *c) {
    if (g->want_lp || c->done || (g->echo && !c->echo_sent))
        return false;
    const char *t;
    size_t n;
    if (g->kind == API_CHAT) {
        if (!c->role_sent || c->cp.reasoning.len > c->r_sent ||
            (c->cp.tool_calls && json_array_size(c->cp.tool_calls) > c->tools_sent))
            return false;
        if (c->cp.content.len == c->c_sent)
            return true; // nothing new
        t = c->cp.content.p + c->c_sent;
        n = c->cp.content.len - c->c_sent;
        bool blank = true;
        for (size_t i = 0; i < n && blank; i++)
            blank = strchr(" \t\r\n", t[i]) != NULL;
        if (blank && c->cp.tools)
            return true; // whitespace before a possible tool call: wait (as the general path)
        c->c_sent = c->cp.content.len;
    } else {
        if (c->safe == c->sent)
            return true;
        t = c->text.p + c->sent;
        n = c->safe - c->sent;
        c->sent = c->safe;
    }
    gw_buf *b = &g->pend;
    char head[512];
    int hn = snprintf(head, sizeof(head),
                      "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":\"%s\","
                      "\"choices\":[{\"index\":%d,%s\"", g->id,
                      g->kind == API_CHAT ? "chat.completion.chunk" : "text_completion",
                      g->created, g->api->model_name_json, c->seq.index,
                      g->kind == API_CHAT ? "\"delta\":{\"content\":" : "\"text\":");
    gw_buf_add(b, head, (size_t)hn);
    json_escape_into(b, t, n);
    gw_buf_adds(b, g->kind == API_CHAT ? "\"},\"logprobs\":null,\"finish_reason\":null}]"
                                       : "\",\"logprobs\":null,\"finish_reason\":null}]");
    gw_buf_adds(b, g->include_usage ? ",\"usage\":null}\n\n" : "}\n\n");
    return true;
}

// stream_choice appends the events for c's new output (tokens since the last event).
static void stream_choice(struct greq *g, struct choice *c) {
    if (stream_text_fast(g, c))
        return;
    json_t *delta = NULL;
    json_t *ch = json_pack("{s:i}", "index", c->seq.index);
    bool any = false;
    if (g->kind == API_CHAT) {
        delta = json_object();
        if (!c->role_sent) {
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", json_string(""));
            c->role_sent = true;
            any = true;
        }
        if (c->cp.reasoning.len > c->r_sent) {
            json_object_set_new(delta, "reasoning_content",
                                utf8_json(c->cp.reasoning.p + c->r_sent,
                                          c->cp.reasoning.len - c->r_sent));
            c->r_sent = c->cp.reasoning.len;
            any = true;
        }
        if (c->cp.content.len > c->c_sent) {
            bool blank = true;
            for (size_t i = c->c_sent; i < c->cp.content.len; i++)
                if (!strchr(" \t\r\n", c->cp.content.p[i]))
                    blank = false;
            bool hold = blank && !c->done; // whitespace before a tool call: wait
            bool drop = blank && c->done && c->cp.tool_calls;
            if (!hold && !drop) {
                json_object_set_new(delta, "content", utf8_json(c->cp.content.p + c->c_sent,
                                                                c->cp.content.len - c->c_sent));
                any = true;
            }
            if (!hold)
                c->c_sent = c->cp.content.len;
        }
        size_t nt = c->cp.tool_calls ? json_array_size(c->cp.tool_calls) : 0;
        if (nt > c->tools_sent) {
            json_t *arr = json_array();
            for (size_t i = c->tools_sent; i < nt; i++) {
                json_t *tc = json_deep_copy(json_array_get(c->cp.tool_calls, i));
                json_object_set_new(tc, "index", json_integer((json_int_t)i));
                json_array_append_new(arr, tc);
            }
            json_object_set_new(delta, "tool_calls", arr);
            c->tools_sent = nt;
            any = true;
        }
        json_object_set_new(ch, "delta", delta);
    } else {
        size_t from = c->sent, to = c->safe;
        gw_buf t = {0};
        if (g->echo && !c->echo_sent) { // the prompt comes first, as OpenAI streams it
            gw_buf_adds(&t, g->prompt_text[c->prompt_index] ? g->prompt_text[c->prompt_index]
                                                            : "");
            c->echo_sent = true;
            any = true;
        }
        gw_buf_add(&t, c->text.p ? c->text.p + from : "", to - from);
        json_object_set_new(ch, "text", utf8_json(t.p ? t.p : "", t.len));
        free(t.p);
        c->sent = to;
        any = any || to > from;
    }
    if (g->want_lp && c->n_lp_sent < c->seq.n_gen) {
        json_object_set_new(ch, "logprobs",
                            g->kind == API_CHAT
                                ? chat_logprobs(g, c, c->n_lp_sent, c->seq.n_gen)
                                : cmpl_logprobs(g, c, c->n_lp_sent, c->seq.n_gen, &c->lp_off));
        c->n_lp_sent = c->seq.n_gen;
        any = true;
    } else {
        json_object_set_new(ch, "logprobs", json_null());
    }
    json_object_set_new(ch, "finish_reason",
                        c->done && finish_name(c->finish) ? json_string(finish_name(c->finish))
                                                          : json_null());
    if (c->done)
        any = true;
    if (!any) {
        json_decref(ch);
        return;
    }
    json_t *ev = chunk_base(g);
    json_object_set_new(ev, "choices", json_pack("[o]", ch));
    if (g->include_usage)
        json_object_set_new(ev, "usage", json_null());
    sse_event(g, ev);
}

// choice_end: c will get no more tokens (finish set unless it failed).
static void choice_end(struct greq *g, struct choice *c) {
    if (c->done)
        return;
    if (c->finish != FIN_NONE && !(c->finish == FIN_STOP && c->safe == c->text.len && 0)) {
        char tail[16];
        size_t n = 0;
        if (mm_detok_stream_flush(&c->ds, tail, sizeof(tail), &n) == MM_OK && n)
            gw_buf_add(&c->text, tail, n);
    }
    c->safe = c->text.len;
    if (g->kind == API_CHAT) {
        gw_chat_parse_feed(&c->cp, c->text.p ? c->text.p : "", c->text.len, true);
        if (c->cp.tool_calls && json_array_size(c->cp.tool_calls) > 0 && c->finish == FIN_STOP)
            c->finish = FIN_TOOLS;
    }
    c->done = true;
    g->n_live--;
    if (g->stream && !g->failed && g->req) {
        start_stream(g);
        stream_choice(g, c);
    }
}

// ---- scheduler callbacks -------------------------------------------------------------------

static bool on_token(void *arg, gw_seq *s, const Mmctl__SeqResult *r, uint64_t t_done_ns) {
    gw_api *a = arg;
    struct choice *c = s->owner;
    struct greq *g = c->g;
    (void)a;
    if (s->n_gen == 1)
        gw_hist_add(&a->m.ttft, (double)(t_done_ns - s->t_submit_ns) / 1e9);
    else if (s->t_last_ns)
        gw_hist_add(&a->m.itl, (double)(t_done_ns - s->t_last_ns) / 1e9);
    int i = s->n_gen - 1;
    if (g->want_lp) {
        c->lp[i] = r->logprob;
        uint32_t k = (uint32_t)r->n_top < g->n_top ? (uint32_t)r->n_top : g->n_top;
        c->n_top[i] = k;
        for (uint32_t j = 0; j < k; j++) {
            c->top_id[(size_t)i * g->n_top + j] = r->top[j]->token;
            c->top_lp[(size_t)i * g->n_top + j] = r->top[j]->logprob;
        }
    }
    g->t_tok_done_ns = t_done_ns;
    if (!g->ignore_eos && is_eos(a, r->token)) {
        c->finish = FIN_STOP;
        choice_end(g, c);
        mark_dirty(g);
        return false;
    }
    char piece[512];
    size_t n = 0;
    if (mm_detok_stream_feed(&c->ds, r->token, piece, sizeof(piece), &n) == MM_OK && n) {
        size_t before = c->text.len;
        gw_buf_add(&c->text, piece, n);
        if (g->n_stops) {
            size_t from = before > g->max_stop ? before - g->max_stop : 0;
            const char *best = NULL;
            for (int k = 0; k < g->n_stops; k++) {
                const char *m = memmem(c->text.p + from, c->text.len - from, g->stops[k],
                                       strlen(g->stops[k]));
                if (m && (!best || m < best))
                    best = m;
            }
            if (best) {
                c->text.len = (size_t)(best - c->text.p);
                c->text.p[c->text.len] = 0;
                c->finish = FIN_STOP;
                mm_detok_stream_fini(&c->ds);
                mm_detok_stream_init(&c->ds, a->tk, g->skip_special);
                choice_end(g, c);
                mark_dirty(g);
                return false;
            }
        }
    }
    if (s->n_gen >= s->max_gen) {
        c->finish = FIN_LENGTH;
        choice_end(g, c);
        mark_dirty(g);
        return false;
    }
    c->safe = c->text.len - suffix_hold(g, c->text.p ? c->text.p : "", c->text.len);
    if (g->kind == API_CHAT)
        gw_chat_parse_feed(&c->cp, c->text.p ? c->text.p : "", c->safe, false);
    if (g->stream && g->req) {
        start_stream(g);
        stream_choice(g, c);
    }
    mark_dirty(g);
    return true;
}

static void on_fail(void *arg, gw_seq *s, mm_err code, const char *msg) {
    gw_api *a = arg;
    struct choice *c = s->owner;
    struct greq *g = c->g;
    if (!g->failed) {
        g->failed = true;
        g->fail_code = code;
        g->fail_status = code == MM_EINVAL || code == MM_EUNSUPP ? 400 : 503;
        snprintf(g->fail_msg, sizeof(g->fail_msg), "%s%s",
                 g->fail_status == 503 ? "the mesh failed this request: " : "", msg);
        // The other choices of this request end too.
        for (int i = 0; i < g->n_choices; i++)
            if (&g->ch[i] != c && !g->ch[i].done)
                gw_sched_cancel(a->sched, &g->ch[i].seq);
    }
    c->finish = FIN_NONE;
    mark_dirty(g);
}

static void on_dropped(void *arg, gw_seq *s) {
    (void)arg;
    struct choice *c = s->owner;
    struct greq *g = c->g;
    if (!c->done) {
        c->done = true;
        g->n_live--;
    }
    if (g->n_live == 0 && g->req && !g->final_sent)
        mark_dirty(g);
    greq_unref(g);
}

static void on_flush(void *arg, uint64_t t_done_ns, uint64_t t_loop, uint64_t t_tokens,
                     uint64_t t_sent) {
    gw_api *a = arg;
    if (t_done_ns) {
        gw_hist_add(&a->m.handoff, (double)(t_loop - t_done_ns) / 1e9);
        gw_hist_add(&a->m.tokens, (double)(t_tokens - t_loop) / 1e9);
        gw_hist_add(&a->m.plan, (double)(t_sent - t_tokens) / 1e9);
    }
    struct greq *list = a->dirty;
    a->dirty = NULL;
    for (struct greq *g = list, *next; g; g = next) {
        next = g->dnext;
        g->dirty = false;
        if (!g->req)
            continue;
        if (g->n_live == 0)
            respond(g);
        flush_stream(g);
        if (t_done_ns)
            gw_hist_add(&a->m.overhead, (double)(mm_now_ns() - t_done_ns) / 1e9);
    }
}

static const gw_sched_ops k_ops = {
    .token = on_token, .fail = on_fail, .dropped = on_dropped, .flush = on_flush};

// ---- request parsing -----------------------------------------------------------------------

struct perr {
    int status;
    const char *param;
    const char *code;
    char msg[MM_ERRLEN + 64];
};

__attribute__((format(printf, 4, 5))) static bool bad(struct perr *e, int status,
                                                      const char *param, const char *fmt, ...) {
    e->status = status;
    e->param = param;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    return false;
}

static bool get_num(const json_t *body, const char *key, double lo, double hi, double *out,
                    struct perr *e) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v))
        return true;
    if (!json_is_number(v))
        return bad(e, 400, key, "'%s' must be a number", key);
    double d = json_number_value(v);
    if (!(d >= lo && d <= hi))
        return bad(e, 400, key, "'%s' must be between %g and %g (got %g)", key, lo, hi, d);
    *out = d;
    return true;
}

static bool get_int(const json_t *body, const char *key, long long lo, long long hi,
                    long long *out, struct perr *e) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v))
        return true;
    if (!json_is_integer(v))
        return bad(e, 400, key, "'%s' must be an integer", key);
    long long d = json_integer_value(v);
    if (d < lo || d > hi)
        return bad(e, 400, key, "'%s' must be between %lld and %lld (got %lld)", key, lo, hi, d);
    *out = d;
    return true;
}

static bool get_bool(const json_t *body, const char *key, bool *out, struct perr *e) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v))
        return true;
    if (!json_is_boolean(v))
        return bad(e, 400, key, "'%s' must be a boolean", key);
    *out = json_is_true(v);
    return true;
}

struct common {
    long long max_tokens; // -1: not given
    double temperature, top_p, min_p, presence, frequency, repetition;
    long long top_k, n, seed;
    bool has_seed, stream, include_usage, ignore_eos, return_ids;
    int skip_special; // -1: not given
};

// parse_common reads the sampling and output fields both endpoints share.
static bool parse_common(gw_api *a, struct greq *g, const json_t *body, struct common *o,
                         struct perr *e) {
    (void)a;
    *o = (struct common){.max_tokens = -1, .temperature = 1.0, .top_p = 1.0, .top_k = 0,
                         .n = 1, .repetition = 1.0, .skip_special = -1};
    json_t *model = json_object_get(body, "model");
    if (model && !json_is_null(model)) {
        if (!json_is_string(model))
            return bad(e, 400, "model", "'model' must be a string");
        const char *m = json_string_value(model);
        if (strcmp(m, g->api->model_name) != 0 && strcmp(m, g->api->c.model_dir) != 0) {
            e->code = "model_not_found";
            return bad(e, 404, "model", "The model `%s` does not exist (this server has `%s`).",
                       m, g->api->model_name);
        }
    }
    if (!get_num(body, "temperature", 0, 2, &o->temperature, e) ||
        !get_num(body, "top_p", 1e-9, 1, &o->top_p, e) ||
        !get_int(body, "top_k", -1, 1 << 30, &o->top_k, e) ||
        !get_num(body, "min_p", 0, 1, &o->min_p, e) ||
        !get_num(body, "presence_penalty", -2, 2, &o->presence, e) ||
        !get_num(body, "frequency_penalty", -2, 2, &o->frequency, e) ||
        !get_num(body, "repetition_penalty", 1e-9, 100, &o->repetition, e) ||
        !get_int(body, "n", 1, MAX_CHOICES, &o->n, e) ||
        !get_bool(body, "stream", &o->stream, e) ||
        !get_bool(body, "ignore_eos", &o->ignore_eos, e) ||
        !get_bool(body, "return_token_ids", &o->return_ids, e))
        return false;
    json_t *ss = json_object_get(body, "skip_special_tokens");
    if (ss && !json_is_null(ss)) {
        bool v = true;
        if (!get_bool(body, "skip_special_tokens", &v, e))
            return false;
        o->skip_special = v;
    }
    json_t *seed = json_object_get(body, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed))
            return bad(e, 400, "seed", "'seed' must be an integer");
        o->seed = json_integer_value(seed);
        o->has_seed = true;
    }
    json_t *so = json_object_get(body, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return bad(e, 400, "stream_options", "'stream_options' must be an object");
        if (!o->stream)
            return bad(e, 400, "stream_options",
                       "'stream_options' is only allowed when 'stream' is true");
        json_t *iu = json_object_get(so, "include_usage");
        if (iu && !json_is_null(iu) && !json_is_boolean(iu))
            return bad(e, 400, "stream_options.include_usage",
                       "'stream_options.include_usage' must be a boolean");
        o->include_usage = iu && json_is_true(iu);
    }
    json_t *stop = json_object_get(body, "stop");
    if (stop && !json_is_null(stop)) {
        json_t *one = json_is_string(stop) ? stop : NULL;
        size_t n = one ? 1 : json_is_array(stop) ? json_array_size(stop) : 0;
        if (!one && !json_is_array(stop))
            return bad(e, 400, "stop", "'stop' must be a string or a list of strings");
        if (n > MAX_STOPS)
            return bad(e, 400, "stop", "'stop' has %zu strings; at most %d", n, MAX_STOPS);
        for (size_t i = 0; i < n; i++) {
            json_t *s = one ? one : json_array_get(stop, i);
            if (!json_is_string(s))
                return bad(e, 400, "stop", "'stop[%zu]' must be a string", i);
            size_t sl = json_string_length(s);
            if (sl == 0 || sl > MAX_STOP_LEN)
                return bad(e, 400, "stop", "'stop' strings must have 1..%d bytes", MAX_STOP_LEN);
            g->stops[g->n_stops++] = strdup(json_string_value(s));
            if (sl > g->max_stop)
                g->max_stop = sl;
        }
    }
    return true;
}

static bool parse_ids(const json_t *arr, int vocab, gw_buf *ids_out, const char *param,
                      struct perr *e) {
    size_t n = json_array_size(arr);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= vocab)
            return bad(e, 400, param, "'%s' token ids must be integers in 0..%d", param,
                       vocab - 1);
        int32_t id = (int32_t)json_integer_value(v);
        gw_buf_add(ids_out, (const char *)&id, sizeof(id));
    }
    return true;
}

// add_prompt appends one prompt (text or ids) to g.
static bool add_prompt(struct greq *g, const char *text, size_t text_len, const json_t *ids,
                       gw_buf *all, gw_buf *offs, gw_buf *lens,
                       gw_buf *texts, struct perr *e) {
    gw_api *a = g->api;
    size_t before = all->len / sizeof(int32_t);
    char *echo = NULL;
    if (ids) {
        if (!parse_ids(ids, (int)mm_tokenizer_vocab_size(a->tk), all, "prompt", e))
            return false;
        const int32_t *p = (const int32_t *)(all->p + before * sizeof(int32_t));
        size_t n = all->len / sizeof(int32_t) - before, nb = 0;
        mm_tokenizer_decode(a->tk, p, n, false, NULL, 0, &nb, NULL);
        echo = malloc(nb + 1);
        if (echo && mm_tokenizer_decode(a->tk, p, n, false, echo, nb + 1, &nb, NULL) == MM_OK)
            echo[nb] = 0;
        else if (echo)
            echo[0] = 0;
    } else {
        size_t cap = text_len + 16, n = 0;
        if (!gw_buf_reserve(all, cap * sizeof(int32_t)))
            return bad(e, 500, NULL, "out of memory");
        char err[MM_ERRLEN] = "";
        mm_err rv = mm_tokenizer_encode(a->tk, text, text_len, false,
                                        (int32_t *)(all->p + all->len), cap, &n, err);
        if (rv != MM_OK)
            return bad(e, 400, "prompt", "'prompt' cannot be tokenized: %s", err);
        all->len += n * sizeof(int32_t);
        echo = strndup(text, text_len);
    }
    int off = (int)before, len = (int)(all->len / sizeof(int32_t) - before);
    gw_buf_add(offs, (const char *)&off, sizeof(off));
    gw_buf_add(lens, (const char *)&len, sizeof(len));
    gw_buf_add(texts, (const char *)&echo, sizeof(echo));
    g->n_prompts++;
    return true;
}

static struct greq *greq_new(gw_api *a, h2o_req_t *req, int kind) {
    struct greq *g = calloc(1, sizeof(*g));
    if (!g)
        return NULL;
    g->api = a;
    g->req = req;
    g->kind = kind;
    g->refs = 1;
    g->t_arrive_ns = mm_now_ns();
    g->created = (long long)time(NULL);
    snprintf(g->id, sizeof(g->id), "%s-%016llx%08llx", kind == API_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)a->created, (unsigned long long)++a->next_id);
    return g;
}

static uint64_t random_seed(void) {
    static uint64_t x;
    x += mm_now_ns() ^ 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// submit builds the choices of g from its prompts and queues them; answers errors itself.
static void submit(gw_api *a, struct greq *g, const struct common *o, struct perr *e) {
    h2o_req_t *req = g->req;
    g->stream = o->stream;
    g->include_usage = o->include_usage;
    g->ignore_eos = o->ignore_eos;
    g->return_ids = o->return_ids;
    // special tokens stay in the text where the request parses tool calls (a tokenizer may mark
    // the call's tags special), unless it says otherwise
    g->skip_special = o->skip_special >= 0 ? o->skip_special : !g->parse_tools;
    g->n = (int)o->n;
    if ((long long)g->n_prompts * o->n > MAX_CHOICES) {
        bad(e, 400, "n", "%d prompts x n=%lld choices: at most %d", g->n_prompts, o->n,
            MAX_CHOICES);
        goto fail;
    }
    if (!a->mesh_ok) {
        bad(e, 503, NULL, "the mesh cannot serve: %s", a->mesh_why);
        e->code = "mesh_unavailable";
        goto fail;
    }
    g->n_choices = g->n_prompts * g->n;
    g->ch = calloc((size_t)g->n_choices, sizeof(*g->ch));
    if (!g->ch) {
        bad(e, 500, NULL, "out of memory");
        goto fail;
    }
    gw_seq *seqs[MAX_CHOICES];
    for (int i = 0; i < g->n_choices; i++) {
        struct choice *c = &g->ch[i];
        int p = i / g->n;
        c->g = g;
        c->prompt_index = p;
        char idp[64];
        snprintf(idp, sizeof(idp), "call_%s_%d", g->id + 9, i);
        gw_chat_parse_init(&c->cp, g->think_open, g->parse_tools, idp);
        if (g->tool_head &&
            !gw_chat_parse_force_tool(&c->cp, g->tool_head, g->api->tool_style >= TS_DS3)) {
            bad(e, 500, "tool_choice", "out of memory");
            goto fail;
        }
        int np = g->prompt_len[p];
        // Without max_tokens: the rest of the context, or of what one shard's KV holds.
        long long room = gw_sched_seq_kv_tokens(a->sched) < a->max_ctx
                             ? gw_sched_seq_kv_tokens(a->sched) : a->max_ctx;
        long long max_gen = o->max_tokens >= 0 ? o->max_tokens : room - np;
        if (max_gen < 1)
            max_gen = 1;
        char err[MM_ERRLEN] = "";
        if (gw_sched_check(a->sched, np, (int)max_gen, err) != MM_OK) {
            bad(e, 400, o->max_tokens >= 0 ? "max_tokens" : "prompt", "%s", err);
            goto fail;
        }
        c->seq.tokens = malloc(((size_t)np + (size_t)max_gen) * sizeof(int32_t));
        if (!c->seq.tokens) {
            bad(e, 500, NULL, "out of memory");
            goto fail;
        }
        memcpy(c->seq.tokens, g->prompt_ids + g->prompt_off[p], (size_t)np * sizeof(int32_t));
        c->seq.n_prompt = np;
        c->seq.max_gen = (int)max_gen;
        c->seq.owner = c;
        c->seq.index = i;
        c->seq.n_top = g->n_top;
        c->seq.want_lp = g->want_lp;
        c->seq.sampling = (mm_sampling){.temperature = (float)o->temperature,
                                        .top_p = (float)o->top_p,
                                        .top_k = o->top_k > 0 ? (uint32_t)o->top_k : 0,
                                        .min_p = (float)o->min_p,
                                        .presence_penalty = (float)o->presence,
                                        .frequency_penalty = (float)o->frequency,
                                        .repetition_penalty = (float)o->repetition,
                                        .seed = o->has_seed ? (uint64_t)o->seed + (uint64_t)(i % g->n)
                                                            : random_seed()};
        mm_detok_stream_init(&c->ds, a->tk, g->skip_special);
        if (g->want_lp) {
            c->lp = calloc((size_t)max_gen, sizeof(float));
            c->n_top = calloc((size_t)max_gen, sizeof(uint32_t));
            size_t k = (size_t)max_gen * (g->n_top ? g->n_top : 1);
            c->top_id = calloc(k, sizeof(int32_t));
            c->top_lp = calloc(k, sizeof(float));
            if (!c->lp || !c->n_top || !c->top_id || !c->top_lp) {
                bad(e, 500, NULL, "out of memory");
                goto fail;
            }
        }
        seqs[i] = &c->seq;
    }
    char err[MM_ERRLEN] = "";
    // The guard first: a step that fails at once may answer (and drop the seqs) inside submit.
    g->n_live = g->n_choices;
    g->refs += g->n_choices;
    mm_err rv = gw_sched_submit(a->sched, seqs, g->n_choices, err);
    if (rv != MM_OK) {
        g->n_live = 0;
        g->refs -= g->n_choices;
        bad(e, rv == MM_EFULL ? 429 : rv == MM_EINVAL ? 400 : 503, NULL, "%s", err);
        e->code = rv == MM_EFULL ? "queue_full" : NULL;
        goto fail;
    }
    struct greq **guard = h2o_mem_alloc_shared(&req->pool, sizeof(*guard), on_dispose);
    *guard = g;
    g->next = a->live;
    if (a->live)
        a->live->prev = g;
    a->live = g;
    return;
fail:
    send_error(a, req, e->status, e->param, e->code, "%s", e->msg);
    greq_free(g);
}

static bool check_auth(gw_api *a, h2o_req_t *req) {
    if (!a->c.api_key || !a->c.api_key[0])
        return true;
    ssize_t i = h2o_find_header(&req->headers, H2O_TOKEN_AUTHORIZATION, -1);
    size_t kl = strlen(a->c.api_key);
    if (i >= 0) {
        h2o_iovec_t v = req->headers.entries[i].value;
        if (v.len == 7 + kl && strncasecmp(v.base, "Bearer ", 7) == 0 &&
            memcmp(v.base + 7, a->c.api_key, kl) == 0)
            return true;
    }
    send_error(a, req, 401, NULL, "invalid_api_key", "%s",
               i >= 0 ? "Incorrect API key provided."
                      : "You didn't provide an API key (Authorization: Bearer KEY).");
    return false;
}

// parse_body: the request's JSON object, or an answered error (NULL).
static json_t *parse_body(gw_api *a, h2o_req_t *req) {
    if (!check_auth(a, req))
        return NULL;
    json_error_t je;
    json_t *body = json_loadb(req->entity.base ? req->entity.base : "", req->entity.len,
                              JSON_REJECT_DUPLICATES, &je);
    if (!body) {
        send_error(a, req, 400, NULL, NULL, "the body is not valid JSON: %s (line %d column %d)",
                   je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(body)) {
        send_error(a, req, 400, NULL, NULL, "the body must be a JSON object");
        json_decref(body);
        return NULL;
    }
    return body;
}

static bool take_prompts(struct greq *g, gw_buf *all, gw_buf *offs, gw_buf *lens,
                         gw_buf *texts) {
    g->prompt_ids = (int32_t *)all->p;
    g->prompt_off = (int *)offs->p;
    g->prompt_len = (int *)lens->p;
    g->prompt_text = (char **)texts->p;
    return true;
}

static int route_completions(void *arg, h2o_req_t *req) {
    gw_api *a = arg;
    json_t *body = parse_body(a, req);
    if (!body)
        return 0;
    struct greq *g = greq_new(a, req, API_COMPLETION);
    struct perr e = {0};
    struct common o;
    gw_buf all = {0}, offs = {0}, lens = {0}, texts = {0};
    bool ok = parse_common(a, g, body, &o, &e);
    long long lp = -1;
    if (ok)
        ok = get_int(body, "max_tokens", 1, 1 << 30, &o.max_tokens, &e) &&
             get_bool(body, "echo", &g->echo, &e);
    if (ok && o.max_tokens < 0)
        o.max_tokens = 16; // OpenAI's default for completions
    if (ok) {
        json_t *l = json_object_get(body, "logprobs");
        if (l && !json_is_null(l) && !json_is_integer(l))
            ok = bad(&e, 400, "logprobs", "'logprobs' must be an integer (0..%d) or null",
                     MM_SAMPLER_MAX_TOP);
        else
            ok = get_int(body, "logprobs", 0, MM_SAMPLER_MAX_TOP, &lp, &e);
    }
    if (ok && lp >= 0) {
        g->want_lp = true;
        g->n_top = (uint32_t)lp;
    }
    json_t *prompt = json_object_get(body, "prompt");
    if (ok && (!prompt || json_is_null(prompt)))
        ok = bad(&e, 400, "prompt", "'prompt' is required");
    if (ok) {
        if (json_is_string(prompt)) {
            ok = add_prompt(g, json_string_value(prompt), json_string_length(prompt), NULL, &all,
                            &offs, &lens, &texts, &e);
        } else if (json_is_array(prompt) && json_array_size(prompt) > 0) {
            json_t *first = json_array_get(prompt, 0);
            if (json_is_integer(first)) {
                ok = add_prompt(g, NULL, 0, prompt, &all, &offs, &lens, &texts, &e);
            } else {
                size_t i;
                json_t *v;
                json_array_foreach(prompt, i, v) {
                    if (!ok)
                        break;
                    if (json_is_string(v))
                        ok = add_prompt(g, json_string_value(v), json_string_length(v), NULL,
                                        &all, &offs, &lens, &texts, &e);
                    else if (json_is_array(v) && json_array_size(v) > 0)
                        ok = add_prompt(g, NULL, 0, v, &all, &offs, &lens, &texts, &e);
                    else
                        ok = bad(&e, 400, "prompt",
                                 "'prompt[%zu]' must be a string or a non-empty list of token "
                                 "ids", i);
                    if (ok && g->n_prompts > MAX_CHOICES)
                        ok = bad(&e, 400, "prompt", "at most %d prompts", MAX_CHOICES);
                }
            }
        } else {
            ok = bad(&e, 400, "prompt",
                     "'prompt' must be a string, a list of strings, a list of token ids or a "
                     "list of such lists");
        }
    }
    take_prompts(g, &all, &offs, &lens, &texts);
    json_decref(body);
    if (!ok) {
        send_error(a, req, e.status, e.param, e.code, "%s", e.msg);
        greq_free(g);
        return 0;
    }
    submit(a, g, &o, &e);
    return 0;
}

// ---- chat ----------------------------------------------------------------------------------

static bool check_messages(const json_t *msgs, struct perr *e) {
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return bad(e, 400, "messages", "'messages' must be a non-empty list");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        if (!json_is_object(m))
            return bad(e, 400, "messages", "'messages[%zu]' must be an object", i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role)
            return bad(e, 400, "messages", "'messages[%zu].role' must be a string", i);
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") &&
            strcmp(role, "tool") && strcmp(role, "developer"))
            return bad(e, 400, "messages",
                       "'messages[%zu].role' '%s' is not one of system, developer, user, "
                       "assistant, tool", i, role);
        json_t *c = json_object_get(m, "content");
        if (c && !json_is_null(c) && !json_is_string(c)) {
            if (!json_is_array(c))
                return bad(e, 400, "messages",
                           "'messages[%zu].content' must be a string, a list of parts or null",
                           i);
            size_t k;
            json_t *p;
            json_array_foreach(c, k, p) {
                const char *t = json_string_value(json_object_get(p, "type"));
                if (!t || strcmp(t, "text") || !json_is_string(json_object_get(p, "text")))
                    return bad(e, 400, "messages",
                               "'messages[%zu].content[%zu]' must be {\"type\": \"text\", "
                               "\"text\": string} (this model reads text only)", i, k);
            }
        } else if ((!c || json_is_null(c)) && strcmp(role, "assistant") != 0) {
            return bad(e, 400, "messages", "'messages[%zu].content' is required for role '%s'",
                       i, role);
        }
        json_t *tc = json_object_get(m, "tool_calls");
        if (tc && !json_is_null(tc) && !json_is_array(tc))
            return bad(e, 400, "messages", "'messages[%zu].tool_calls' must be a list", i);
    }
    return true;
}

static bool check_tools(const json_t *tools, const json_t *choice, struct perr *e) {
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools))
            return bad(e, 400, "tools", "'tools' must be a list");
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            const char *type = json_string_value(json_object_get(t, "type"));
            json_t *f = json_object_get(t, "function");
            if (!type || strcmp(type, "function") || !json_is_object(f) ||
                !json_is_string(json_object_get(f, "name")))
                return bad(e, 400, "tools",
                           "'tools[%zu]' must be {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", i);
        }
    }
    if (choice && !json_is_null(choice)) {
        if (json_is_string(choice)) {
            const char *s = json_string_value(choice);
            if (strcmp(s, "none") && strcmp(s, "auto") && strcmp(s, "required"))
                return bad(e, 400, "tool_choice",
                           "'tool_choice' must be none, auto, required or a function");
        } else if (!json_is_object(choice) ||
                   !json_is_string(json_object_get(json_object_get(choice, "function"),
                                                   "name"))) {
            return bad(e, 400, "tool_choice",
                       "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}");
        }
        if (!tools || json_is_null(tools) || json_array_size(tools) == 0)
            if (!json_is_string(choice) || strcmp(json_string_value(choice), "none"))
                return bad(e, 400, "tool_choice", "'tool_choice' needs 'tools'");
        const char *name =
            json_is_object(choice)
                ? json_string_value(json_object_get(json_object_get(choice, "function"), "name"))
                : NULL;
        bool found = name == NULL;
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            const char *tn = json_string_value(json_object_get(json_object_get(t, "function"),
                                                               "name"));
            found = found || (tn && !strcmp(tn, name));
        }
        if (!found)
            return bad(e, 400, "tool_choice", "'tool_choice' names function '%s', which is not "
                       "in 'tools'", name);
    }
    return true;
}

// force_tool_call: tool_choice "required" or a named function, with a template whose tools
// prompt asks for one of the call forms the output parser reads: the prompt opens the call
// itself, so the model writes the rest of it; *head (owned) gets what follows the call's
// opening tag, for the output parser. style TS_HERMES, Qwen3's <tool_call> blocks
// (mm_chat_template_hermes_tools): "<tool_call>\n{\"name\": " and, for a named function, its
// name and ", \"arguments\": " (closing a <think> block the template opened first). TS_GLM
// (mm_chat_template_glm_tools): "<tool_call>" and, for a named function, its name. TS_DS3 and
// TS_DS31, DeepSeek V3's and V3.1's blocks (mm_chat_template_deepseek_tools): the calls' and
// the call's opening tags, then V3's "function<｜tool▁sep｜>" and for a named function its
// name and the opening of the JSON fence, or for V3.1 a named function's name and
// "<｜tool▁sep｜>". GLM and DeepSeek do not force a name of other characters than letters,
// digits, '_', '-' and '.' (gw_tool_name_len). Other templates: nothing changes (*head NULL; the
// model is not constrained). False out of memory.
static bool force_tool_call(const json_t *choice, int style, bool *think_open, char **out,
                            size_t *out_len, char **head) {
    *head = NULL;
    const bool required = json_is_string(choice) && !strcmp(json_string_value(choice), "required");
    if (!required && !json_is_object(choice))
        return true;
    const json_t *fn = json_object_get(json_object_get(choice, "function"), "name");
    const char *fname = required ? NULL : json_string_value(fn);
    if (style != TS_HERMES && fname &&
        (!fname[0] || gw_tool_name_len(fname, strlen(fname)) != strlen(fname)))
        return true; // a name the block cannot hold as it is: the model is not constrained
    gw_buf h = {0};
    if (!gw_buf_reserve(&h, 0))
        return false;
    h.p[0] = 0; // (GLM or V3.1, required: an empty head)
    if (style == TS_GLM) {
        if (fname)
            gw_buf_adds(&h, fname);
    } else if (style == TS_DS3) {
        gw_buf_adds(&h, "function");
        gw_buf_adds(&h, GW_DS_SEP);
        if (fname) {
            gw_buf_adds(&h, fname);
            gw_buf_adds(&h, "\n```json\n");
        }
    } else if (style == TS_DS31) {
        if (fname) {
            gw_buf_adds(&h, fname);
            gw_buf_adds(&h, GW_DS_SEP);
        }
    } else if (required) {
        gw_buf_adds(&h, "\n{\"name\": \"");
    } else {
        char *q = json_dumps(fn, JSON_ENCODE_ANY); // the name as a JSON string, escaped
        if (!q) {
            free(h.p);
            return false;
        }
        gw_buf_adds(&h, "\n{\"name\": ");
        gw_buf_adds(&h, q);
        gw_buf_adds(&h, ", \"arguments\": ");
        free(q);
    }
    if (!h.p)
        return false;
    const char *close = *think_open ? "\n</think>\n\n" : "";
    const char *open = style >= TS_DS3 ? GW_DS_CALLS_OPEN GW_DS_OPEN : "<tool_call>";
    const size_t nc = strlen(close), no = strlen(open), n = *out_len + nc + no + h.len;
    char *o = realloc(*out, n + 1);
    if (!o) {
        free(h.p);
        return false;
    }
    memcpy(o + *out_len, close, nc);
    memcpy(o + *out_len + nc, open, no);
    memcpy(o + *out_len + nc + no, h.p, h.len);
    o[n] = 0;
    *out = o;
    *out_len = n;
    *think_open = false;
    *head = h.p;
    return true;
}

// render_chat renders body's messages with the template into *out (owned).
static bool render_chat(gw_api *a, const json_t *body, bool *think_open, char **out,
                        size_t *out_len, char **tool_head, struct perr *e) {
    if (!a->ct)
        return bad(e, 400, "messages", "this model has no chat template (%s); use "
                   "/v1/completions", a->ct_err);
    json_t *msgs = json_object_get(body, "messages");
    json_t *tools = json_object_get(body, "tools");
    json_t *choice = json_object_get(body, "tool_choice");
    if (!check_messages(msgs, e) || !check_tools(tools, choice, e))
        return false;
    mm_chat_render_opts ro = {.add_generation_prompt = true, .enable_thinking = -1};
    bool none = choice && json_is_string(choice) && !strcmp(json_string_value(choice), "none");
    if (tools && json_is_array(tools) && json_array_size(tools) && !none)
        ro.tools = tools;
    json_t *kw = json_object_get(body, "chat_template_kwargs");
    json_t *extra = NULL;
    if (kw && !json_is_null(kw)) {
        if (!json_is_object(kw))
            return bad(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
        json_t *et = json_object_get(kw, "enable_thinking");
        if (et && !json_is_null(et)) {
            if (!json_is_boolean(et))
                return bad(e, 400, "chat_template_kwargs.enable_thinking",
                           "'chat_template_kwargs.enable_thinking' must be a boolean");
            ro.enable_thinking = json_is_true(et);
        }
        extra = json_deep_copy(kw);
        json_object_del(extra, "enable_thinking");
        ro.extra = extra;
    }
    bool ag = true;
    if (!get_bool(body, "add_generation_prompt", &ag, e)) {
        json_decref(extra);
        return false;
    }
    ro.add_generation_prompt = ag;
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_chat_template_render(a->ct, msgs, &ro, out, out_len, err);
    json_decref(extra);
    if (rv != MM_OK)
        return bad(e, 400, "messages", "the chat template cannot render these messages: %s",
                   err);
    // A template that opens the thinking block itself: the output starts inside it.
    size_t n = *out_len;
    while (n > 0 && ((*out)[n - 1] == '\n' || (*out)[n - 1] == ' '))
        n--;
    *think_open = n >= 7 && memcmp(*out + n - 7, "<think>", 7) == 0;
    // (only where an assistant turn was opened, and the template writes blocks the parser reads)
    if (ro.tools && choice && ag && a->tool_style != TS_NONE &&
        !force_tool_call(choice, a->tool_style, think_open, out, out_len, tool_head)) {
        free(*out);
        *out = NULL;
        return bad(e, 500, "tool_choice", "out of memory");
    }
    return true;
}

static int route_chat(void *arg, h2o_req_t *req) {
    gw_api *a = arg;
    json_t *body = parse_body(a, req);
    if (!body)
        return 0;
    struct greq *g = greq_new(a, req, API_CHAT);
    struct perr e = {0};
    struct common o;
    gw_buf all = {0}, offs = {0}, lens = {0}, texts = {0};
    bool ok = parse_common(a, g, body, &o, &e);
    long long mct = -1, top = -1;
    if (ok)
        ok = get_int(body, "max_tokens", 1, 1 << 30, &o.max_tokens, &e) &&
             get_int(body, "max_completion_tokens", 1, 1 << 30, &mct, &e) &&
             get_bool(body, "logprobs", &g->want_lp, &e) &&
             get_int(body, "top_logprobs", 0, MM_SAMPLER_MAX_TOP, &top, &e);
    if (ok && mct >= 0)
        o.max_tokens = mct;
    if (ok && top >= 0 && !g->want_lp)
        ok = bad(&e, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (ok && g->want_lp)
        g->n_top = top > 0 ? (uint32_t)top : 0;
    char *text = NULL;
    size_t text_len = 0;
    if (ok)
        ok = render_chat(a, body, &g->think_open, &text, &text_len, &g->tool_head, &e);
    if (ok) {
        json_t *tools = json_object_get(body, "tools");
        json_t *choice = json_object_get(body, "tool_choice");
        bool none = choice && json_is_string(choice) &&
                    !strcmp(json_string_value(choice), "none");
        g->parse_tools = json_is_array(tools) && json_array_size(tools) > 0 && !none;
        ok = add_prompt(g, text, text_len, NULL, &all, &offs, &lens, &texts, &e);
    }
    free(text);
    take_prompts(g, &all, &offs, &lens, &texts);
    json_decref(body);
    if (!ok) {
        send_error(a, req, e.status, e.param, e.code, "%s", e.msg);
        greq_free(g);
        return 0;
    }
    submit(a, g, &o, &e);
    return 0;
}

// ---- models, tokenize, detokenize ----------------------------------------------------------

static int route_models(void *arg, h2o_req_t *req) {
    gw_api *a = arg;
    if (!check_auth(a, req))
        return 0;
    json_t *body = json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:s, s:i}]}", "object", "list",
                             "data", "id", a->model_name, "object", "model", "created",
                             (json_int_t)a->created, "owned_by", "moemesh", "root",
                             a->c.model_dir, "max_model_len", a->max_ctx);
    send_json(a, req, body);
    json_decref(body);
    return 0;
}

static int route_tokenize(void *arg, h2o_req_t *req) {
    gw_api *a = arg;
    json_t *body = parse_body(a, req);
    if (!body)
        return 0;
    struct perr e = {0};
    struct greq *g = greq_new(a, req, API_COMPLETION);
    gw_buf all = {0}, offs = {0}, lens = {0}, texts = {0};
    bool ok = true, add_special = false;
    json_t *model = json_object_get(body, "model");
    if (model && !json_is_null(model) &&
        (!json_is_string(model) || (strcmp(json_string_value(model), a->model_name) &&
                                    strcmp(json_string_value(model), a->c.model_dir)))) {
        e.code = "model_not_found";
        ok = bad(&e, 404, "model", "The model `%s` does not exist (this server has `%s`).",
                 json_is_string(model) ? json_string_value(model) : "?", a->model_name);
    }
    if (ok)
        ok = get_bool(body, "add_special_tokens", &add_special, &e);
    json_t *prompt = json_object_get(body, "prompt");
    if (ok && json_object_get(body, "messages")) {
        char *text = NULL;
        size_t n = 0;
        bool think = false;
        char *head = NULL; // (the tokens count the tool call head a tool_choice writes)
        ok = render_chat(a, body, &think, &text, &n, &head, &e) &&
             add_prompt(g, text, n, NULL, &all, &offs, &lens, &texts, &e);
        free(text);
        free(head);
    } else if (ok) {
        if (!json_is_string(prompt))
            ok = bad(&e, 400, "prompt", "'prompt' (a string) or 'messages' is required");
        else if (json_string_length(prompt) == 0)
            ok = true;
        else {
            size_t cap = json_string_length(prompt) + 16, n = 0;
            char err[MM_ERRLEN] = "";
            if (!gw_buf_reserve(&all, cap * 4))
                ok = bad(&e, 500, NULL, "out of memory");
            else if (mm_tokenizer_encode(a->tk, json_string_value(prompt),
                                         json_string_length(prompt), add_special,
                                         (int32_t *)all.p, cap, &n, err) != MM_OK)
                ok = bad(&e, 400, "prompt", "'prompt' cannot be tokenized: %s", err);
            else
                all.len = n * 4;
        }
    }
    if (ok) {
        json_t *ids = ids_json((const int32_t *)all.p, (int)(all.len / 4));
        json_t *out = json_pack("{s:o, s:I, s:i}", "tokens", ids, "count",
                                (json_int_t)(all.len / 4), "max_model_len", a->max_ctx);
        send_json(a, req, out);
        json_decref(out);
    } else {
        send_error(a, req, e.status, e.param, e.code, "%s", e.msg);
    }
    take_prompts(g, &all, &offs, &lens, &texts);
    greq_free(g);
    json_decref(body);
    return 0;
}

static int route_detokenize(void *arg, h2o_req_t *req) {
    gw_api *a = arg;
    json_t *body = parse_body(a, req);
    if (!body)
        return 0;
    struct perr e = {0};
    gw_buf ids = {0};
    json_t *t = json_object_get(body, "tokens");
    bool ok = json_is_array(t)
                  ? parse_ids(t, (int)mm_tokenizer_vocab_size(a->tk), &ids, "tokens", &e)
                  : bad(&e, 400, "tokens", "'tokens' (a list of token ids) is required");
    if (ok) {
        size_t n = 0;
        mm_tokenizer_decode(a->tk, (const int32_t *)ids.p, ids.len / 4, false, NULL, 0, &n, NULL);
        char *text = malloc(n + 1);
        if (text && mm_tokenizer_decode(a->tk, (const int32_t *)ids.p, ids.len / 4, false, text,
                                        n + 1, &n, NULL) == MM_OK) {
            json_t *out = json_pack("{s:o}", "prompt", utf8_json(text, n));
            send_json(a, req, out);
            json_decref(out);
        } else {
            send_error(a, req, 500, NULL, NULL, "cannot decode");
        }
        free(text);
    } else {
        send_error(a, req, e.status, e.param, e.code, "%s", e.msg);
    }
    free(ids.p);
    json_decref(body);
    return 0;
}

// ---- timers: keep-alive and mesh health ----------------------------------------------------

static void on_ka(uv_timer_t *t) {
    gw_api *a = t->data;
    uint64_t now = mm_now_ns(), gap = (uint64_t)a->c.keepalive_ms * 1000000ull;
    for (struct greq *g = a->live; g; g = g->next) {
        if (!g->stream || !g->req || g->final_sent || g->n_live == 0)
            continue;
        uint64_t last = g->t_last_write_ns ? g->t_last_write_ns : g->t_arrive_ns;
        if (now - last < gap)
            continue;
        start_stream(g);
        gw_buf_adds(&g->pend, ": keep-alive\n\n");
        g->t_last_write_ns = now;
        flush_stream(g);
    }
}

// fail_stuck: when the mesh cannot serve and no shard has a usable KV capacity, nothing would
// ever admit the waiting seqs: they end now (503) instead of waiting for a capacity.
static void fail_stuck(gw_api *a) {
    char kv_why[160];
    if (!a->mesh_ok && !gw_sched_kv_ready(a->sched, kv_why, sizeof(kv_why)))
        gw_sched_fail_waiting(a->sched, MM_EPEERDOWN, a->mesh_why);
    // Requests failed here (or by a capacity statement, gw_sched_shard_report) are answered
    // now: no step result may come to flush them.
    if (a->dirty)
        on_flush(a, 0, 0, 0, 0);
}

void gw_api_note_status(void *arg, mm_err rv, const Mmctl__StatusReply *reply,
                        const char *err) {
    gw_api *a = arg;
    if (rv != MM_OK) {
        a->mesh_ok = false;
        snprintf(a->mesh_why, sizeof(a->mesh_why), "router unreachable: %s", err);
        fail_stuck(a);
        return;
    }
    if (reply->n_members > 0 && !strcmp(reply->members[0]->identity->role, "router"))
        snprintf(a->router_detail, sizeof(a->router_detail), "%s", reply->members[0]->detail);
    gw_sched_router_limits(a->sched, reply->max_step_seqs, reply->max_batch_tokens,
                           reply->attention_shards);
    // every attention shard's KV capacity (Identity fields 14-19): admission follows it
    for (size_t i = 0; i < reply->n_members; i++) {
        const Mmctl__Identity *pid = reply->members[i]->identity;
        if (!pid || strcmp(pid->role, "attention") != 0)
            continue;
        mm_identity id;
        char name[40];
        mm_ctl_identity_from_pb(pid, &id);
        gw_sched_shard_report(a->sched, id.instance, mm_identity_name(&id, name, sizeof(name)),
                              &id.kv);
    }
    static const char *need[] = {"attention", "expert"};
    char why[MM_ERRLEN] = "";
    for (size_t k = 0; k < 2; k++) {
        int up = 0;
        for (size_t i = 0; i < reply->n_members; i++)
            if (!strcmp(reply->members[i]->identity->role, need[k]) &&
                reply->members[i]->health == MMCTL__HEALTH__HEALTH_READY)
                up++;
        if (up == 0)
            snprintf(why + strlen(why), sizeof(why) - strlen(why), "%sno %s is up",
                     why[0] ? "; " : "", need[k]);
    }
    char kv_why[160];
    if (!why[0] && !gw_sched_kv_ready(a->sched, kv_why, sizeof(kv_why)))
        snprintf(why, sizeof(why), "%s", kv_why);
    a->mesh_ok = why[0] == 0;
    snprintf(a->mesh_why, sizeof(a->mesh_why), "%s", why);
    fail_stuck(a);
}

static void on_health(void *arg, mm_err rv, const Mmctl__StatusReply *reply, const char *err) {
    gw_api *a = arg;
    a->health_call = NULL;
    gw_api_note_status(a, rv, reply, err);
}

static void on_health_timer(uv_timer_t *t) {
    gw_api *a = t->data;
    if (a->health_call || a->stopping)
        return;
    char err[MM_ERRLEN] = "";
    if (gw_mesh_status(a->mesh, a->c.health_timeout_ms, on_health, a, &a->health_call, err) !=
        MM_OK) {
        a->mesh_ok = false;
        snprintf(a->mesh_why, sizeof(a->mesh_why), "router unreachable: %s", err);
        fail_stuck(a);
    }
}

// ---- open / close --------------------------------------------------------------------------

static void add_eos(gw_api *a, int32_t id) {
    if (id < 0 || is_eos(a, id) || a->n_eos >= MAX_EOS)
        return;
    a->eos[a->n_eos++] = id;
}

mm_err gw_api_open(gw_api **out, uv_loop_t *loop, gw_mesh *mesh, const gw_api_conf *c,
                   char err[MM_ERRLEN]) {
    *out = NULL;
    if (!c->model_dir || !c->model_dir[0])
        return mm_errf(err, MM_EINVAL, "--model DIR is required (tokenizer, chat template, "
                                       "context length)");
    gw_api *a = calloc(1, sizeof(*a));
    if (!a)
        return MM_ENOMEM;
    a->loop = loop;
    a->mesh = mesh;
    a->c = *c;
    a->created = (long long)time(NULL);
    a->mesh_ok = true; // until the first status answer says otherwise
    gw_metrics_init(&a->m);
    if (c->model_name && c->model_name[0]) {
        snprintf(a->model_name, sizeof(a->model_name), "%s", c->model_name);
    } else {
        char tmp[1024];
        snprintf(tmp, sizeof(tmp), "%s", c->model_dir);
        size_t n = strlen(tmp);
        while (n > 1 && tmp[n - 1] == '/')
            tmp[--n] = 0;
        snprintf(a->model_name, sizeof(a->model_name), "%s", basename(tmp));
    }
    {
        gw_buf mb = {0};
        json_escape_into(&mb, a->model_name, strlen(a->model_name));
        snprintf(a->model_name_json, sizeof(a->model_name_json), "%s", mb.p ? mb.p : "");
        free(mb.p);
    }
    mm_err rv;
    mm_model_config cfg;
    MM_TRY_GOTO(rv, mm_model_config_read(c->model_dir, &cfg, err), fail);
    MM_TRY_GOTO(rv, mm_tokenizer_open(&a->tk, c->model_dir, err), fail);
    if (c->chat_template && c->chat_template[0]) { // asked for: a file that fails stops us
        MM_TRY_GOTO(rv, mm_chat_template_open_file(c->model_dir, c->chat_template, &a->ct, err),
                    fail);
        mm_log_info("chat template from %s", c->chat_template);
    } else if (mm_chat_template_open(c->model_dir, &a->ct, a->ct_err) != MM_OK) {
        mm_log_warn("no chat template: %s (POST /v1/chat/completions answers 400)", a->ct_err);
        a->ct = NULL;
    }
    if (a->ct) {
        if (mm_chat_template_hermes_tools(a->ct)) {
            a->tool_style = TS_HERMES;
        } else if (mm_chat_template_glm_tools(a->ct)) {
            a->tool_style = TS_GLM;
        } else {
            const int ds = mm_chat_template_deepseek_tools(a->ct);
            a->tool_style = ds == 1 ? TS_DS3 : ds == 2 ? TS_DS31 : TS_NONE;
        }
    }
    add_eos(a, cfg.eos_id);
    static const char *names[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>",
                                  "<|end_of_text|>", "</s>"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        int32_t id;
        if (mm_tokenizer_token_id(a->tk, names[i], &id) == MM_OK)
            add_eos(a, id);
    }
    gw_sched_conf sc = c->sched;
    if (cfg.max_pos > 0 && sc.max_ctx > cfg.max_pos)
        sc.max_ctx = cfg.max_pos;
    a->max_ctx = sc.max_ctx;
    sc.block_size = 16; // mm_model_kv_params
    int hv = cfg.head_dim_v > 0 ? cfg.head_dim_v : cfg.head_dim;
    // the shards' bytes per element (their mm_kv_token_bytes): f32 unless told bf16
    double elem_bytes = 4.0;
    if (c->kv_dtype != NULL && strcmp(c->kv_dtype, "bf16") == 0) {
        elem_bytes = 2.0;
    } else if (c->kv_dtype != NULL && c->kv_dtype[0] != '\0' && strcmp(c->kv_dtype, "f32") != 0) {
        rv = mm_errf(err, MM_EINVAL, "--kv-dtype %s: f32 or bf16 (as the shards' caches)",
                     c->kv_dtype);
        goto fail;
    }
    // Admission follows each shard's own statement of its KV capacity (gw_sched_shard_report);
    // --kv-mb and --shard-max-seqs only lower it, and size a shard that states none (64 MiB
    // and 64 seqs, the shards' defaults, when not given).
    double block_bytes =
        (double)cfg.n_kv_heads * (cfg.head_dim + hv) * elem_bytes * sc.block_size * cfg.n_layers;
    if (!(c->kv_mb >= 0)) {
        rv = mm_errf(err, MM_EINVAL, "--kv-mb %g: must be >= 0 (0: the shards' own)", c->kv_mb);
        goto fail;
    }
    const double fb_mb = c->kv_mb > 0 ? c->kv_mb : 64.0;
    sc.kv_mb = c->kv_mb;
    sc.fallback_kv_blocks = block_bytes > 0 ? (int64_t)(fb_mb * 1048576.0 / block_bytes) : 0;
    sc.fallback_max_seqs = sc.shard_max_seqs > 0 ? sc.shard_max_seqs : 64;
    MM_TRY_GOTO(rv, gw_sched_new(&a->sched, &sc, mesh, &k_ops, a, err), fail);
    char n_sh[24] = "the router's";
    if (sc.shards > 0)
        snprintf(n_sh, sizeof(n_sh), "%d", sc.shards);
    mm_log_info("serving %s: context %d, %s attention shards (KV admission by their stated "
                "capacity%s), eos ids %d", a->model_name, a->max_ctx, n_sh,
                c->kv_mb > 0 ? ", at most the gateway's --kv-mb" : "", a->n_eos);
    uv_timer_init(loop, &a->ka_timer);
    uv_timer_init(loop, &a->health_timer);
    a->ka_timer.data = a->health_timer.data = a;
    a->timers_open = true;
    uv_timer_start(&a->ka_timer, on_ka, (uint64_t)c->keepalive_ms, (uint64_t)c->keepalive_ms);
    uv_timer_start(&a->health_timer, on_health_timer, 0, (uint64_t)c->health_ms);
    *out = a;
    return MM_OK;
fail:
    gw_api_free(a);
    return rv;
}

mm_err gw_api_routes(gw_api *a, gw_http *h) {
    MM_TRY(gw_http_route(h, "POST", "/v1/completions", route_completions, a));
    MM_TRY(gw_http_route(h, "POST", "/v1/chat/completions", route_chat, a));
    MM_TRY(gw_http_route(h, "GET", "/v1/models", route_models, a));
    MM_TRY(gw_http_route(h, "POST", "/tokenize", route_tokenize, a));
    MM_TRY(gw_http_route(h, "POST", "/detokenize", route_detokenize, a));
    MM_TRY(gw_http_route(h, "GET", "/metrics", gw_metrics_route, a));
    return MM_OK;
}

void gw_api_stop(gw_api *a) {
    if (!a || a->stopping)
        return;
    a->stopping = true;
    if (a->health_call)
        gw_call_detach(a->health_call);
    a->health_call = NULL;
    if (a->timers_open) {
        uv_timer_stop(&a->ka_timer);
        uv_timer_stop(&a->health_timer);
    }
    gw_sched_stop(a->sched);
    on_flush(a, 0, 0, 0, 0);
}

void gw_api_free(gw_api *a) {
    if (!a)
        return;
    gw_sched_free(a->sched);
    mm_chat_template_close(a->ct);
    mm_tokenizer_close(a->tk);
    free(a);
}

const gw_metrics *gw_api_metrics(const gw_api *a) { return &a->m; }
void gw_api_sched_stats(const gw_api *a, gw_sched_stats *st) { gw_sched_get_stats(a->sched, st); }
const char *gw_api_model_name(const gw_api *a) { return a->model_name; }

const char *gw_api_router_detail(const gw_api *a) { return a->router_detail; }
