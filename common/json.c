// SPDX-License-Identifier: MIT
// Typed getters over jansson; see mm/json.h.
#include <errno.h>
#include <string.h>

#include "mm/json.h"

mm_err mm_json_load_file(const char *path, json_t **out, char err[MM_ERRLEN]) {
    json_error_t je;
    *out = json_load_file(path, JSON_DECODE_ANY, &je);
    if (*out)
        return MM_OK;
    if (je.line < 0 || strstr(je.text, "unable to open"))
        return mm_errf(err, MM_ENOENT, "%s: %s", path, je.text);
    return mm_errf(err, MM_EFORMAT, "%s: line %d column %d: %s", path, je.line, je.column,
                   je.text);
}

mm_err mm_json_parse(const char *text, size_t n, const char *what, json_t **out,
                     char err[MM_ERRLEN]) {
    json_error_t je;
    *out = json_loadb(text, n, JSON_DECODE_ANY, &je);
    if (*out)
        return MM_OK;
    return mm_errf(err, MM_EFORMAT, "%s is not valid JSON: line %d column %d: %s", what, je.line,
                   je.column, je.text);
}

bool mm_json_is_null_or_missing(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return v == NULL || json_is_null(v);
}

static mm_err get(const json_t *obj, const char *key, const char *what, json_t **v, char *err) {
    if (!json_is_object(obj))
        return mm_errf(err, MM_EINVAL, "%s is not a JSON object", what);
    *v = json_object_get(obj, key);
    if (*v == NULL || json_is_null(*v))
        return mm_errf(err, MM_ENOENT, "%s: missing '%s'", what, key);
    return MM_OK;
}

mm_err mm_json_get_int(const json_t *obj, const char *key, const char *what, long long *out,
                       char err[MM_ERRLEN]) {
    json_t *v = NULL;
    MM_TRY(get(obj, key, what, &v, err));
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
        return MM_OK;
    }
    if (json_is_real(v) && json_real_value(v) == (double)(long long)json_real_value(v)) {
        *out = (long long)json_real_value(v);
        return MM_OK;
    }
    return mm_errf(err, MM_EINVAL, "%s: '%s' must be an integer", what, key);
}

mm_err mm_json_get_int_or(const json_t *obj, const char *key, const char *what, long long def,
                          long long *out, char err[MM_ERRLEN]) {
    if (mm_json_is_null_or_missing(obj, key)) {
        *out = def;
        return MM_OK;
    }
    return mm_json_get_int(obj, key, what, out, err);
}

mm_err mm_json_get_num(const json_t *obj, const char *key, const char *what, double *out,
                       char err[MM_ERRLEN]) {
    json_t *v = NULL;
    MM_TRY(get(obj, key, what, &v, err));
    if (!json_is_number(v))
        return mm_errf(err, MM_EINVAL, "%s: '%s' must be a number", what, key);
    *out = json_number_value(v);
    return MM_OK;
}

mm_err mm_json_get_num_or(const json_t *obj, const char *key, const char *what, double def,
                          double *out, char err[MM_ERRLEN]) {
    if (mm_json_is_null_or_missing(obj, key)) {
        *out = def;
        return MM_OK;
    }
    return mm_json_get_num(obj, key, what, out, err);
}

mm_err mm_json_get_bool_or(const json_t *obj, const char *key, const char *what, bool def,
                           bool *out, char err[MM_ERRLEN]) {
    if (mm_json_is_null_or_missing(obj, key)) {
        *out = def;
        return MM_OK;
    }
    json_t *v = json_object_get(obj, key);
    if (!json_is_boolean(v))
        return mm_errf(err, MM_EINVAL, "%s: '%s' must be true or false", what, key);
    *out = json_is_true(v);
    return MM_OK;
}

mm_err mm_json_get_str(const json_t *obj, const char *key, const char *what, const char **out,
                       char err[MM_ERRLEN]) {
    json_t *v = NULL;
    MM_TRY(get(obj, key, what, &v, err));
    if (!json_is_string(v))
        return mm_errf(err, MM_EINVAL, "%s: '%s' must be a string", what, key);
    *out = json_string_value(v);
    return MM_OK;
}

mm_err mm_json_get_str_or(const json_t *obj, const char *key, const char *what, const char *def,
                          const char **out, char err[MM_ERRLEN]) {
    if (mm_json_is_null_or_missing(obj, key)) {
        *out = def;
        return MM_OK;
    }
    return mm_json_get_str(obj, key, what, out, err);
}
