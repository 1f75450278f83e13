// SPDX-License-Identifier: MIT
// The error space's strings and the err-buffer helper.
#include <stdarg.h>

#include "mm/err.h"

const char *mm_strerror(mm_err err) {
    switch (err) {
#define X(name, val, str) \
    case MM_##name:       \
        return str;
        MM_ERR_MAP(X)
#undef X
    }
    return "unknown error";
}

mm_err mm_errf(char *err, mm_err code, const char *fmt, ...) {
    if (err != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, MM_ERRLEN, fmt, ap);
        va_end(ap);
    }
    return code;
}
