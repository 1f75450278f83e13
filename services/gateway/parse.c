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

void gw_chat_parse_init(gw_chat_parse *p, bool think_open, bool tools, const char *id_prefix) {
    memset(p, 0, sizeof(*p));
    p->mode = think_open ? GW_PARSE_THINK : GW_PARSE_CONTENT;
    p->tools = tools;
    snprintf(p->id_prefix, sizeof(p->id_prefix), "%s", id_prefix ? id_prefix : "call");
}

bool gw_chat_parse_force_tool(gw_chat_parse *p, const char *head) {
    free(p->forced);
    p->forced = strdup(head);
    if (!p->forced)
        return false;
    p->tools = true;
    p->mode = GW_PARSE_TOOL;
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

// A GLM-4.5/4.6 block's body: NAME, then <arg_key>K</arg_key><arg_value>V</arg_value> pairs
// (whitespace between them), as those templates write an assistant's tool_calls (a value that
// is not a string as JSON, a string as it is). Returns {"name", "arguments": {K: V}} (V: its
// JSON where it reads as JSON, else the string), or NULL where the body is not that form.
static json_t *glm_tool_call(const char *s, size_t n) {
    static const char *const KO = "<arg_key>", *const KC = "</arg_key>", *const VO = "<arg_value>",
                             *const VC = "</arg_value>";
    const char *e = s + n;
    while (s < e && (*s == ' ' || *s == '\n' || *s == '\r' || *s == '\t'))
        s++;
    const char *nb = s;
    while (s < e && (isalnum((unsigned char)*s) || *s == '_' || *s == '-' || *s == '.'))
        s++;
    if (s == nb)
        return NULL;
    const size_t nlen = (size_t)(s - nb);
    json_t *args = json_object(), *out = NULL;
    char *key = NULL;
    for (;;) {
        while (s < e && (*s == ' ' || *s == '\n' || *s == '\r' || *s == '\t'))
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
        while (s < e && (*s == ' ' || *s == '\n' || *s == '\r' || *s == '\t'))
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

static void add_tool_call(gw_chat_parse *p, const char *s, size_t n) {
    json_error_t je;
    json_t *j = json_loadb(s, n, 0, &je);
    if (!json_is_object(j)) {
        json_decref(j);
        j = glm_tool_call(s, n);
    }
    const char *name = json_is_object(j) ? json_string_value(json_object_get(j, "name")) : NULL;
    if (!name) {
        // Not a tool call we can read: keep it as content, as the model wrote it.
        gw_buf_adds(&p->content, C_OPEN);
        gw_buf_add(&p->content, s, n);
        gw_buf_adds(&p->content, C_CLOSE);
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
            const char *e = memmem(s, n, C_CLOSE, strlen(C_CLOSE));
            if (!e) {
                if (final) { // unterminated: the text as it is (with the prompt's head)
                    gw_buf_adds(&p->content, C_OPEN);
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
                add_tool_call(p, b.p ? b.p : "", b.len);
                free(b.p);
                free(p->forced);
                p->forced = NULL;
            } else {
                add_tool_call(p, s, (size_t)(e - s));
            }
            p->parsed += (size_t)(e - s) + strlen(C_CLOSE);
            p->mode = GW_PARSE_CONTENT;
            continue;
        }
        const char *th = memmem(s, n, T_OPEN, strlen(T_OPEN));
        const char *tc = p->tools ? memmem(s, n, C_OPEN, strlen(C_OPEN)) : NULL;
        const char *e = th && (!tc || th < tc) ? th : tc;
        if (e) {
            gw_buf_add(&p->content, s, (size_t)(e - s));
            bool think = e == th;
            p->parsed += (size_t)(e - s) + strlen(think ? T_OPEN : C_OPEN);
            p->mode = think ? GW_PARSE_THINK : GW_PARSE_TOOL;
            if (think)
                skip_newlines(p, t, limit);
            continue;
        }
        size_t hold = 0;
        if (!final) {
            hold = tag_hold(s, n, T_OPEN);
            if (p->tools) {
                size_t h2 = tag_hold(s, n, C_OPEN);
                hold = h2 > hold ? h2 : hold;
            }
        }
        gw_buf_add(&p->content, s, n - hold);
        p->parsed += n - hold;
        return;
    }
}
