// SPDX-License-Identifier: MIT
// Chat template loading and rendering over mm_jinja; see mm/chat_template.h.
//
// Design notes: the render context is built exactly as transformers builds it for
// apply_chat_template: the special tokens map (set tokens only, as strings), then the caller's
// extra kwargs, then messages, tools (None when absent), documents (None) and
// add_generation_prompt. enable_thinking is an ordinary kwarg, passed only when set.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mm/chat_template.h"
#include "mm/json.h"

typedef struct named_tmpl {
    char *name;
    mm_jinja *t;
    bool iterates_content; // the template walks message content parts itself
} named_tmpl;

struct mm_chat_template {
    named_tmpl *tmpls;
    size_t n_tmpls;
    json_t *specials; // owned object: token name -> string
};

void mm_chat_template_close(mm_chat_template *ct) {
    if (ct == NULL)
        return;
    for (size_t i = 0; i < ct->n_tmpls; i++) {
        free(ct->tmpls[i].name);
        mm_jinja_free(ct->tmpls[i].t);
    }
    free(ct->tmpls);
    json_decref(ct->specials);
    free(ct);
}

static mm_err add_tmpl(mm_chat_template *ct, const char *name, const char *src, size_t n,
                       char *err) {
    named_tmpl *nt = realloc(ct->tmpls, (ct->n_tmpls + 1) * sizeof *nt);
    if (nt == NULL)
        return mm_errf(err, MM_ENOMEM, "out of memory");
    ct->tmpls = nt;
    char label[80];
    snprintf(label, sizeof label, "chat template '%s'", name);
    mm_jinja *t = NULL;
    MM_TRY(mm_jinja_new(src, n, label, &t, err));
    ct->tmpls[ct->n_tmpls].name = strdup(name);
    ct->tmpls[ct->n_tmpls].t = t;
    ct->tmpls[ct->n_tmpls].iterates_content = mm_jinja_iterates(t, "content");
    if (ct->tmpls[ct->n_tmpls].name == NULL) {
        mm_jinja_free(t);
        return mm_errf(err, MM_ENOMEM, "out of memory");
    }
    ct->n_tmpls++;
    return MM_OK;
}

static mm_err new_ct(const json_t *specials, mm_chat_template **out, char *err) {
    mm_chat_template *ct = calloc(1, sizeof *ct);
    if (ct == NULL)
        return mm_errf(err, MM_ENOMEM, "out of memory");
    ct->specials = specials ? json_deep_copy(specials) : json_object();
    if (ct->specials == NULL || !json_is_object(ct->specials)) {
        mm_chat_template_close(ct);
        return mm_errf(err, MM_EINVAL, "special tokens must be a JSON object");
    }
    *out = ct;
    return MM_OK;
}

mm_err mm_chat_template_open_source(const char *src, const json_t *special_tokens,
                                    mm_chat_template **out, char err[MM_ERRLEN]) {
    *out = NULL;
    mm_chat_template *ct;
    MM_TRY(new_ct(special_tokens, &ct, err));
    mm_err rv = add_tmpl(ct, "default", src, strlen(src), err);
    if (rv != MM_OK) {
        mm_chat_template_close(ct);
        return rv;
    }
    *out = ct;
    return MM_OK;
}

static mm_err read_file(const char *path, char **out, size_t *n, char *err) {
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return mm_errf(err, MM_ENOENT, "%s: cannot open: %s", path, strerror(errno));
    char *buf = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, cap);
            if (nb == NULL) {
                free(buf);
                fclose(f);
                return mm_errf(err, MM_ENOMEM, "out of memory reading %s", path);
            }
            buf = nb;
        }
        size_t k = fread(buf + len, 1, cap - len - 1, f);
        len += k;
        if (k == 0)
            break;
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return mm_errf(err, MM_ESYS, "%s: read error", path);
    }
    buf[len] = 0;
    *out = buf;
    *n = len;
    return MM_OK;
}

// Token value in tokenizer_config.json: a string or an AddedToken dict {"content": ...}.
static const char *token_text(const json_t *v) {
    if (json_is_string(v))
        return json_string_value(v);
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static mm_err collect_specials(const json_t *cfg, json_t *specials, const char *path, char *err) {
    static const char *const names[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token", NULL};
    for (int i = 0; names[i]; i++) {
        const char *s = token_text(json_object_get(cfg, names[i]));
        if (s && *s)
            json_object_set_new(specials, names[i], json_string(s));
    }
    json_t *add = json_object_get(cfg, "additional_special_tokens");
    if (json_is_array(add) && json_array_size(add) > 0) {
        json_t *arr = json_array();
        size_t i;
        json_t *v;
        json_array_foreach(add, i, v) {
            const char *s = token_text(v);
            if (s == NULL) {
                json_decref(arr);
                return mm_errf(err, MM_EFORMAT, "%s: additional_special_tokens[%zu] is not a token",
                               path, i);
            }
            json_array_append_new(arr, json_string(s));
        }
        json_object_set_new(specials, "additional_special_tokens", arr);
    }
    return MM_OK;
}

// open_impl: mm_chat_template_open, or with tmpl_path the template read from that file instead
// (the directory's special tokens kept).
static mm_err open_impl(const char *dir, const char *tmpl_path, mm_chat_template **out,
                        char err[MM_ERRLEN]) {
    *out = NULL;
    char path[4096];
    mm_err rv = MM_OK;
    json_t *cfg = NULL;
    char *jinja = NULL;
    size_t jinja_n = 0;
    mm_chat_template *ct = NULL;
    MM_TRY(new_ct(NULL, &ct, err));

    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    rv = mm_json_load_file(path, &cfg, err);
    if (rv != MM_OK && rv != MM_ENOENT)
        goto fail;
    if (cfg && !json_is_object(cfg)) {
        rv = mm_errf(err, MM_EFORMAT, "%s: not a JSON object", path);
        goto fail;
    }
    if (cfg)
        MM_TRY_GOTO(rv, collect_specials(cfg, ct->specials, path, err), fail);

    char jpath[4096];
    snprintf(jpath, sizeof jpath, "%s/chat_template.jinja", dir);
    rv = read_file(tmpl_path ? tmpl_path : jpath, &jinja, &jinja_n, err);
    if (rv == MM_OK) {
        rv = add_tmpl(ct, "default", jinja, jinja_n, err);
        if (rv != MM_OK && tmpl_path) { // name the file the user gave
            char why[MM_ERRLEN];
            snprintf(why, sizeof why, "%s", err);
            mm_errf(err, rv, "%s: %s", tmpl_path, why);
        }
        if (rv != MM_OK)
            goto fail;
    } else if (rv != MM_ENOENT || tmpl_path) {
        goto fail;
    } else {
        json_t *tv = cfg ? json_object_get(cfg, "chat_template") : NULL;
        if (tv == NULL || json_is_null(tv)) {
            rv = mm_errf(err, MM_ENOENT, "%s: no chat template (neither chat_template.jinja nor "
                         "a chat_template in tokenizer_config.json)", dir);
            goto fail;
        }
        if (json_is_string(tv)) {
            MM_TRY_GOTO(rv, add_tmpl(ct, "default", json_string_value(tv), json_string_length(tv),
                                     err), fail);
        } else if (json_is_array(tv)) {
            size_t i;
            json_t *e;
            json_array_foreach(tv, i, e) {
                json_t *nm = json_object_get(e, "name"), *tx = json_object_get(e, "template");
                if (!json_is_string(nm) || !json_is_string(tx)) {
                    rv = mm_errf(err, MM_EFORMAT, "%s: chat_template[%zu] needs string 'name' "
                                 "and 'template'", path, i);
                    goto fail;
                }
                MM_TRY_GOTO(rv, add_tmpl(ct, json_string_value(nm), json_string_value(tx),
                                         json_string_length(tx), err), fail);
            }
        } else {
            rv = mm_errf(err, MM_EFORMAT, "%s: chat_template must be a string or a list of "
                         "{name, template}", path);
            goto fail;
        }
    }
    free(jinja);
    json_decref(cfg);
    *out = ct;
    return MM_OK;
fail:
    free(jinja);
    json_decref(cfg);
    mm_chat_template_close(ct);
    return rv;
}

mm_err mm_chat_template_open(const char *dir, mm_chat_template **out, char err[MM_ERRLEN]) {
    return open_impl(dir, NULL, out, err);
}

mm_err mm_chat_template_open_file(const char *dir, const char *path, mm_chat_template **out,
                                  char err[MM_ERRLEN]) {
    *out = NULL;
    if (path == NULL || path[0] == 0)
        return mm_errf(err, MM_EINVAL, "chat template: no file named");
    return open_impl(dir, path, out, err);
}

static const named_tmpl *pick(const mm_chat_template *ct, const mm_chat_render_opts *o,
                              char *err) {
    const char *want = o->template_name;
    if (want == NULL && ct->n_tmpls == 1)
        return &ct->tmpls[0];
    if (want == NULL && o->tools) {
        for (size_t i = 0; i < ct->n_tmpls; i++)
            if (strcmp(ct->tmpls[i].name, "tool_use") == 0)
                return &ct->tmpls[i];
    }
    if (want == NULL)
        want = "default";
    for (size_t i = 0; i < ct->n_tmpls; i++)
        if (strcmp(ct->tmpls[i].name, want) == 0)
            return &ct->tmpls[i];
    mm_errf(err, MM_ENOENT, "no chat template named '%s'", want);
    return NULL;
}

// Copies messages; when flatten is set, content given as a list of text parts becomes one
// string (parts joined with "\n", as vLLM does for templates that expect string content).
static mm_err normalize_messages(const json_t *messages, bool flatten, json_t **out, char *err) {
    if (!json_is_array(messages))
        return mm_errf(err, MM_EINVAL, "messages must be a JSON array");
    json_t *res = json_array();
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) {
            json_decref(res);
            return mm_errf(err, MM_EINVAL, "messages[%zu] is not an object", i);
        }
        if (!json_is_string(json_object_get(m, "role"))) {
            json_decref(res);
            return mm_errf(err, MM_EINVAL, "messages[%zu] has no string 'role'", i);
        }
        json_t *c = json_object_get(m, "content");
        json_t *copy = json_copy(m);
        if (flatten && json_is_array(c)) {
            size_t cap = 64, len = 0, k;
            char *buf = malloc(cap);
            json_t *part;
            mm_err rv = MM_OK;
            json_array_foreach(c, k, part) {
                const char *type = json_string_value(json_object_get(part, "type"));
                json_t *txt = json_object_get(part, "text");
                if (json_is_string(part)) {
                    txt = part;
                } else if (type == NULL || strcmp(type, "text") != 0 || !json_is_string(txt)) {
                    rv = mm_errf(err, type && strcmp(type, "text") != 0 ? MM_EUNSUPP : MM_EINVAL,
                                 "messages[%zu].content[%zu]: %s%s%s", i, k,
                                 type ? "content part type '" : "expected {\"type\": \"text\", \"text\": ...}",
                                 type ? type : "", type ? "' is not supported (text only)" : "");
                    break;
                }
                size_t tn = json_string_length(txt);
                if (buf && len + tn + 2 > cap) {
                    while (len + tn + 2 > cap)
                        cap *= 2;
                    char *nb = realloc(buf, cap);
                    if (nb == NULL) {
                        free(buf);
                        buf = NULL;
                    } else {
                        buf = nb;
                    }
                }
                if (buf == NULL) {
                    rv = mm_errf(err, MM_ENOMEM, "out of memory");
                    break;
                }
                if (k > 0)
                    buf[len++] = '\n';
                memcpy(buf + len, json_string_value(txt), tn);
                len += tn;
            }
            if (rv != MM_OK) {
                free(buf);
                json_decref(copy);
                json_decref(res);
                return rv;
            }
            json_object_set_new(copy, "content", json_stringn(buf ? buf : "", len));
            free(buf);
        }
        json_array_append_new(res, copy);
    }
    *out = res;
    return MM_OK;
}

mm_err mm_chat_template_render(const mm_chat_template *ct, const json_t *messages,
                               const mm_chat_render_opts *opts, char **out, size_t *out_len,
                               char err[MM_ERRLEN]) {
    *out = NULL;
    mm_chat_render_opts o = opts ? *opts : (mm_chat_render_opts){.enable_thinking = -1};
    const named_tmpl *nt = pick(ct, &o, err);
    if (nt == NULL)
        return MM_ENOENT;
    if (o.tools && !json_is_array(o.tools) && !json_is_null(o.tools))
        return mm_errf(err, MM_EINVAL, "tools must be a JSON array");
    if (o.extra && !json_is_object(o.extra))
        return mm_errf(err, MM_EINVAL, "extra template kwargs must be a JSON object");
    json_t *msgs = NULL;
    // A template that iterates message content itself gets the parts unchanged, exactly as
    // transformers passes them; one that concatenates content as a string gets the text parts
    // joined (transformers would fail there; vLLM joins the same way).
    MM_TRY(normalize_messages(messages, !nt->iterates_content, &msgs, err));
    json_t *ctx = json_deep_copy(ct->specials);
    if (o.extra)
        json_object_update(ctx, (json_t *)o.extra);
    if (o.enable_thinking >= 0)
        json_object_set_new(ctx, "enable_thinking", json_boolean(o.enable_thinking));
    json_object_set_new(ctx, "messages", msgs);
    json_object_set(ctx, "tools", o.tools ? (json_t *)o.tools : json_null());
    json_object_set_new(ctx, "documents", json_null());
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(o.add_generation_prompt));
    mm_err rv = mm_jinja_render(nt->t, ctx, o.limits, out, out_len, err);
    json_decref(ctx);
    return rv;
}

// tools_probe: whether a render of one tool and one plain user message holds both needles
// (the second may be NULL).
static bool tools_probe(const mm_chat_template *ct, const char *needle, const char *needle2) {
    if (!ct)
        return false;
    json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", "x");
    json_t *tools = json_pack("[{s:s, s:{s:s, s:s, s:{s:s}}}]", "type", "function", "function",
                              "name", "f", "description", "d", "parameters", "type", "object");
    mm_chat_render_opts ro = {.add_generation_prompt = true, .enable_thinking = -1, .tools = tools};
    char *out = NULL, err[MM_ERRLEN] = "";
    size_t n = 0;
    bool yes = false;
    if (msgs && tools && mm_chat_template_render(ct, msgs, &ro, &out, &n, err) == MM_OK)
        yes = memmem(out, n, needle, strlen(needle)) != NULL &&
              (!needle2 || memmem(out, n, needle2, strlen(needle2)) != NULL);
    free(out);
    json_decref(msgs);
    json_decref(tools);
    return yes;
}

bool mm_chat_template_hermes_tools(const mm_chat_template *ct) {
    return tools_probe(ct, "<tool_call>\n{\"name\"", NULL);
}

bool mm_chat_template_glm_tools(const mm_chat_template *ct) {
    return tools_probe(ct, "<tool_call>", "<arg_key>");
}

int mm_chat_template_deepseek_tools(const mm_chat_template *ct) {
    static const char *const OPEN = "<｜tool▁call▁begin｜>", *const SEP = "<｜tool▁sep｜>";
    char v3[128];
    snprintf(v3, sizeof v3, "%sfunction%s", OPEN, SEP);
    if (tools_probe(ct, v3, NULL))
        return 1;
    return tools_probe(ct, OPEN, SEP) ? 2 : 0;
}
