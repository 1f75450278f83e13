// SPDX-License-Identifier: MIT
// A Jinja2 interpreter for the subset real chat templates use, configured as Hugging Face
// transformers configures it (trim_blocks, lstrip_blocks, loop controls, default Undefined,
// raise_exception, strftime_now, and transformers' own tojson). A construct outside the
// subset is an MM_EUNSUPP error naming it and its line, never silently wrong text.
#ifndef MM_JINJA_H
#define MM_JINJA_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "mm/err.h"

typedef struct mm_jinja mm_jinja;

// Resource bounds for one render. Zero fields take the defaults in brackets.
typedef struct mm_jinja_limits {
    size_t max_steps;        // evaluated nodes per render [20,000,000]
    size_t max_output_bytes; // rendered text, and any one string value [64 MiB]
    size_t max_memory_bytes; // scratch for values during one render [512 MiB]
    int max_call_depth;      // nested macro calls [64]
    size_t max_range;        // elements one range() may produce [1,000,000]
    size_t max_stack_bytes;  // C stack the evaluator may use, measured [1 MiB]; the calling
                             // thread needs this much stack beyond its own use
} mm_jinja_limits;

// mm_jinja_new compiles n bytes of template source. name labels errors ("chat_template").
// Returns owned *out (free with mm_jinja_free). Errors: MM_EFORMAT (syntax error, with the
// line), MM_EUNSUPP (a construct outside the subset, named with its line), MM_ENOMEM.
// Does not block; thread-safe (no shared state).
mm_err mm_jinja_new(const char *src, size_t n, const char *name, mm_jinja **out,
                    char err[MM_ERRLEN]);
// mm_jinja_iterates reports whether some {% for %} of t iterates over a value named field:
// a variable `field`, an attribute `x.field` or an item `x['field']` (optionally filtered).
// Chat templates use it to tell whether they walk message content parts themselves.
bool mm_jinja_iterates(const mm_jinja *t, const char *field);

// mm_jinja_free releases t; accepts NULL.
void mm_jinja_free(mm_jinja *t);

// mm_jinja_render renders t with the variables of ctx (a JSON object, borrowed; may be NULL).
// limits may be NULL for the defaults. On MM_OK *out is an owned NUL-terminated string
// (free()) of *out_len bytes. Errors: MM_EINVAL (template raised an error through
// raise_exception, or a runtime error such as an undefined attribute or a type error, with the
// template line), MM_EUNSUPP (unsupported filter, test, method or feature), MM_EFULL (a limit
// was hit), MM_ENOMEM. A compiled template may be rendered from several threads at once.
mm_err mm_jinja_render(const mm_jinja *t, const json_t *ctx, const mm_jinja_limits *limits,
                       char **out, size_t *out_len, char err[MM_ERRLEN]);

#endif
