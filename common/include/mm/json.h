// SPDX-License-Identifier: MIT
// A thin layer over jansson: loading with located errors, and typed getters whose errors name
// the field ("config.json: 'num_experts' must be an integer"). The json_t values are
// jansson's; callers may use jansson directly for anything else.
#ifndef MM_JSON_H
#define MM_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "mm/err.h"

// mm_json_load_file parses path into *out (returns owned: json_decref it). Errors: MM_ENOENT
// (cannot open), MM_EFORMAT (syntax, with line and column).
mm_err mm_json_load_file(const char *path, json_t **out, char err[MM_ERRLEN]);
// mm_json_parse parses n bytes of text. what names the source in errors ("request body").
mm_err mm_json_parse(const char *text, size_t n, const char *what, json_t **out,
                     char err[MM_ERRLEN]);

// Getters. A missing key gives MM_ENOENT unless a default applies (the _or forms); a value of
// the wrong type gives MM_EINVAL. what names the object in the message ("config.json").
mm_err mm_json_get_int(const json_t *obj, const char *key, const char *what, long long *out,
                       char err[MM_ERRLEN]);
mm_err mm_json_get_int_or(const json_t *obj, const char *key, const char *what, long long def,
                          long long *out, char err[MM_ERRLEN]);
mm_err mm_json_get_num(const json_t *obj, const char *key, const char *what, double *out,
                       char err[MM_ERRLEN]);
mm_err mm_json_get_num_or(const json_t *obj, const char *key, const char *what, double def,
                          double *out, char err[MM_ERRLEN]);
mm_err mm_json_get_bool_or(const json_t *obj, const char *key, const char *what, bool def,
                           bool *out, char err[MM_ERRLEN]);
// *out is borrowed from obj.
mm_err mm_json_get_str(const json_t *obj, const char *key, const char *what, const char **out,
                       char err[MM_ERRLEN]);
mm_err mm_json_get_str_or(const json_t *obj, const char *key, const char *what, const char *def,
                          const char **out, char err[MM_ERRLEN]);

// mm_json_is_null_or_missing: true when key is absent or JSON null.
bool mm_json_is_null_or_missing(const json_t *obj, const char *key);

#endif
