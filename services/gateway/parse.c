// SPDX-License-Identifier: MIT
// Chat output splitting: reasoning, tool calls, content; see parse.h.
#include "parse.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool gw_buf_reserve(gw_buf *b, size_t more) {
    if (b->len + more + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return false;
    b->p = p;
    b->cap = cap;
    return true;
}

void gw_buf_add(gw_buf *b, const char *s, size_t n) {
    if (!n || !gw_buf_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void gw_buf_adds(gw_buf *b, const char *s) { gw_buf_add(b, s, strlen(s)); }

static const char *const T_OPEN = "<think>", *const T_CLOSE = "</think>",
                         *const C_OPEN = "<tool_call>", *const C_CLOSE = "</tool_call>";
// DeepSeek's tags (parse.h); the calls' wrapper is dropped from the text
static const char *const DS_CALLS_OPEN = GW_DS_CALLS_OPEN, *const DS_CALLS_CLOSE = GW_DS_CALLS_CLOSE,
                         *const DS_OPEN = GW_DS_OPEN, *const DS_CLOSE = GW_DS_CLOSE,
                         *const DS_SEP = GW_DS_SEP;

void gw_chat_parse_init(gw_chat_parse *p, bool think_open, bool tools, const char *id_prefix) {
    memset(p, 0, sizeof(*p));
    p->mode = think_open ? GW_PARSE_THINK : GW_PARSE_CONTENT;
    p->tools = tools;
    snprintf(p->id_prefix, sizeof(p->id_prefix), "%s", id_prefix ? id_prefix : "call");
}

bool gw_chat_parse_force_tool(gw_chat_parse *p, const char *head, bool ds) {
    free(p->forced);
    p->forced = strdup(head);
    if (!p->forced)
        return false;
    p->tools = true;
    p->mode = GW_PARSE_TOOL;
    p->ds = ds;
    return true;
}

void gw_chat_parse_fini(gw_chat_parse *p) {
    free(p->forced);
    free(p->reasoning.p);
    free(p->content.p);
    json_decref(p->tool_calls);
    memset(p, 0, sizeof(*p));
}

// tag_hold: bytes at the end of t[0, n) that are a proper prefix of tag.
static size_t tag_hold(const char *t, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && memcmp(t + n - k, tag, k) == 0)
            return k;
    return 0;
}

static bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

size_t gw_tool_name_len(const char *s, size_t n) {
    size_t k = 0;
    while (k < n && (isalnum((unsigned char)s[k]) || s[k] == '_' || s[k] == '-' || s[k] == '.'))
        k++;
    return k;
}

// A GLM-4.5/4.6 block's body: NAME, then <arg_key>K</arg_key><arg_value>V</arg_value> pairs
// (whitespace between them), as those templates write an assistant's tool_calls (a value that
// is not a string as JSON, a string as it is). Returns {"name", "arguments": {K: V}} (V: its
// JSON where it reads as JSON, else the string), or NULL where the body is not that form.
static json_t *glm_tool_call(const char *s, size_t n) {
    static const char *const KO = "<arg_key>", *const KC = "</arg_key>", *const VO = "<arg_value>",
                             *const VC = "</arg_value>";
    const char *e = s + n;
    while (s < e && is_space(*s))
        s++;
    const char *nb = s;
    const size_t nlen = gw_tool_name_len(s, (size_t)(e - s));
    if (nlen == 0)
        return NULL;
    s += nlen;
    json_t *args = json_object(), *out = NULL;
    char *key = NULL;
    for (;;) {
        while (s < e && is_space(*s))
            s++;
        if (s == e) {
            out = json_pack("{s:s%, s:O}", "name", nb, nlen, "arguments", args);
            break;
        }
        const size_t ko = strlen(KO), kc = strlen(KC), vo = strlen(VO), vc = strlen(VC);
        if ((size_t)(e - s) < ko || memcmp(s, KO, ko) != 0)
            break;
        s += ko;
        const char *k_end = memmem(s, (size_t)(e - s), KC, kc);
        if (!k_end)
            break;
        free(key);
        key = strndup(s, (size_t)(k_end - s));
        s = k_end + kc;
        while (s < e && is_space(*s))
            s++;
        if (!key || (size_t)(e - s) < vo || memcmp(s, VO, vo) != 0)
            break;
        s += vo;
        const char *v_end = memmem(s, (size_t)(e - s), VC, vc);
        if (!v_end)
            break;
        json_error_t je;
        json_t *v = json_loadb(s, (size_t)(v_end - s), JSON_DECODE_ANY, &je);
        if (!v)
            v = json_stringn(s, (size_t)(v_end - s));
        if (!v || json_object_set_new(args, key, v) != 0)
            break;
        s = v_end + vc;
    }
    free(key);
    json_decref(args);
    return out;
}

// A DeepSeek block's body (see DS_OPEN): {"name", "arguments"} (ARGS parsed as JSON), or NULL.
static json_t *ds_tool_call(const char *s, size_t n) {
    const char *e = s + n, *sep = memmem(s, n, DS_SEP, strlen(DS_SEP));
    if (!sep)
        return NULL;
    const char *a = s, *b = sep; // the part before the separator, trimmed
    while (a < b && is_space(*a))
        a++;
    while (b > a && is_space(b[-1]))
        b--;
    const char *r = sep + strlen(DS_SEP), *nb, *ne;
    if (b - a == 8 && memcmp(a, "function", 8) == 0) { // V3: the name on the line after
        nb = r;
        ne = memchr(r, '\n', (size_t)(e - r));
        if (!ne)
            return NULL;
        r = ne + 1;
        if ((size_t)(e - r) >= 7 && memcmp(r, "```json", 7) == 0) {
            r += 7;
            const char *f = e; // the closing fence
            while (f > r && is_space(f[-1]))
                f--;
            if (f - r < 3 || memcmp(f - 3, "```", 3) != 0)
                return NULL;
            e = f - 3;
        }
    } else { // V3.1: the name before the separator
        nb = a, ne = b;
    }
    while (nb < ne && is_space(*nb))
        nb++;
    while (ne > nb && is_space(ne[-1]))
        ne--;
    if (ne == nb)
        return NULL;
    json_error_t je;
    json_t *args = json_loadb(r, (size_t)(e - r), JSON_DECODE_ANY, &je);
    if (!json_is_object(args)) {
        json_decref(args);
        return NULL;
    }
    return json_pack("{s:s%, s:o}", "name", nb, (size_t)(ne - nb), "arguments", args);
}

// add_tool_call: a block's body between open and close; ds: a DeepSeek block.
static void add_tool_call(gw_chat_parse *p, const char *s, size_t n, bool ds) {
    json_t *j = NULL;
    if (ds) {
        j = ds_tool_call(s, n);
    } else {
        json_error_t je;
        j = json_loadb(s, n, 0, &je);
        if (!json_is_object(j)) {
            json_decref(j);
            j = glm_tool_call(s, n);
        }
    }
    const char *name = json_is_object(j) ? json_string_value(json_object_get(j, "name")) : NULL;
    if (!name) {
        // Not a tool call we can read: keep it as content, as the model wrote it.
        gw_buf_adds(&p->content, ds ? DS_OPEN : C_OPEN);
        gw_buf_add(&p->content, s, n);
        gw_buf_adds(&p->content, ds ? DS_CLOSE : C_CLOSE);
        json_decref(j);
        return;
    }
    json_t *args = json_object_get(j, "arguments");
    if (!args)
        args = json_object_get(j, "parameters");
    char *args_s = !args ? strdup("{}")
                   : json_is_string(args) ? strdup(json_string_value(args))
                                          : json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!p->tool_calls)
        p->tool_calls = json_array();
    char id[96];
    snprintf(id, sizeof(id), "%s_%zu", p->id_prefix, json_array_size(p->tool_calls));
    json_array_append_new(p->tool_calls,
                          json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function",
                                    "function", "name", name, "arguments",
                                    args_s ? args_s : "{}"));
    free(args_s);
    json_decref(j);
}

static void skip_newlines(gw_chat_parse *p, const char *t, size_t limit) {
    while (p->parsed < limit && t[p->parsed] == '\n')
        p->parsed++;
    p->skip_nl = p->parsed == limit; // more newlines may come with the next piece
}

void gw_chat_parse_feed(gw_chat_parse *p, const char *t, size_t limit, bool final) {
    while (p->parsed < limit) {
        if (p->skip_nl) {
            skip_newlines(p, t, limit);
            if (p->parsed == limit)
                return;
        }
        const char *s = t + p->parsed;
        size_t n = limit - p->parsed;
        if (p->mode == GW_PARSE_THINK) {
            const char *e = memmem(s, n, T_CLOSE, strlen(T_CLOSE));
            if (e) {
                gw_buf_add(&p->reasoning, s, (size_t)(e - s));
                p->parsed += (size_t)(e - s) + strlen(T_CLOSE);
                p->mode = GW_PARSE_CONTENT;
                skip_newlines(p, t, limit); // the template's blank line after </think>
                continue;
            }
            size_t hold = final ? 0 : tag_hold(s, n, T_CLOSE);
            gw_buf_add(&p->reasoning, s, n - hold);
            p->parsed += n - hold;
            return;
        }
        if (p->mode == GW_PARSE_TOOL) {
            const char *close = p->ds ? DS_CLOSE : C_CLOSE;
            const char *e = memmem(s, n, close, strlen(close));
            if (!e) {
                if (final) { // unterminated: the text as it is (with the prompt's head)
                    gw_buf_adds(&p->content, p->ds ? DS_OPEN : C_OPEN);
                    if (p->forced)
                        gw_buf_adds(&p->content, p->forced);
                    gw_buf_add(&p->content, s, n);
                    p->parsed = limit;
                }
                return;
            }
            if (p->forced) { // the first block: its head was written by the prompt
                gw_buf b = {0};
                gw_buf_adds(&b, p->forced);
                gw_buf_add(&b, s, (size_t)(e - s));
                add_tool_call(p, b.p ? b.p : "", b.len, p->ds);
                free(b.p);
                free(p->forced);
                p->forced = NULL;
            } else {
                add_tool_call(p, s, (size_t)(e - s), p->ds);
            }
            p->parsed += (size_t)(e - s) + strlen(close);
            p->mode = GW_PARSE_CONTENT;
            if (p->ds) // the newline between DeepSeek's calls
                skip_newlines(p, t, limit);
            continue;
        }
        // the first of the tags that open something here (tools: the tool-call tags too)
        const char *const tags[] = {T_OPEN, C_OPEN, DS_OPEN, DS_CALLS_OPEN, DS_CALLS_CLOSE};
        const int n_tags = p->tools ? 5 : 1;
        const char *e = NULL;
        int which = -1;
        for (int k = 0; k < n_tags; k++) {
            const char *m = memmem(s, n, tags[k], strlen(tags[k]));
            if (m && (!e || m < e))
                e = m, which = k;
        }
        if (e) {
            gw_buf_add(&p->content, s, (size_t)(e - s));
            p->parsed += (size_t)(e - s) + strlen(tags[which]);
            if (which >= 3) { // DeepSeek's wrapper around its calls: dropped
                if (which == 3)
                    skip_newlines(p, t, limit);
                continue;
            }
            p->mode = which == 0 ? GW_PARSE_THINK : GW_PARSE_TOOL;
            p->ds = which == 2;
            if (which == 0)
                skip_newlines(p, t, limit);
            continue;
        }
        size_t hold = 0;
        if (!final)
            for (int k = 0; k < n_tags; k++) {
                size_t h2 = tag_hold(s, n, tags[k]);
                hold = h2 > hold ? h2 : hold;
            }
        gw_buf_add(&p->content, s, n - hold);
        p->parsed += n - hold;
        return;
    }
}
