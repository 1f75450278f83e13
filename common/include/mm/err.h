// SPDX-License-Identifier: MIT
// One error space for the whole project: every fallible function returns mm_err.
// Foreign failures (errno, nng, cuda, ibverbs) are wrapped as MM_ESYS / MM_EDEVICE /
// MM_ETRANSPORT, and their native detail goes into the caller's err[MM_ERRLEN] buffer.
#ifndef MM_ERR_H
#define MM_ERR_H

#include <stdio.h>
#include <stdlib.h>

#define MM_ERRLEN 256

#define MM_ERR_MAP(X)                                         \
    X(OK,         0, "success")                               \
    X(ENOMEM,     1, "out of memory")                         \
    X(EINVAL,     2, "invalid argument")                      \
    X(ETIMEDOUT,  3, "timed out")                             \
    X(ECLOSED,    4, "object is closed")                      \
    X(EPROTO,     5, "peer violated the wire protocol")       \
    X(EDEVICE,    6, "accelerator failure")                   \
    X(ETRANSPORT, 7, "transport failure")                     \
    X(ESYS,       8, "system call failed")                    \
    X(ENOENT,     9, "not found")                             \
    X(EFORMAT,   10, "malformed file")                        \
    X(EUNSUPP,   11, "unsupported")                           \
    X(EIDENTITY, 12, "identity mismatch")                     \
    X(EBUSY,     13, "resource busy")                         \
    X(EFULL,     14, "capacity exhausted")                    \
    X(ECANCELED, 15, "operation canceled")                    \
    X(EPEERDOWN, 16, "peer is down")

typedef enum mm_err {
#define X(name, val, str) MM_##name = (val),
    MM_ERR_MAP(X)
#undef X
} mm_err;

// mm_strerror returns a static description of err; never NULL ("unknown error" for codes
// outside the map). Thread-safe.
const char *mm_strerror(mm_err err);

// mm_errf formats a message into err (which may be NULL) and returns code, so that
// `return mm_errf(err, MM_EINVAL, "field %s", name);` both reports and propagates.
mm_err mm_errf(char *err, mm_err code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#define MM_TRY(expr)                  \
    do {                              \
        mm_err rv_ = (expr);          \
        if (rv_ != MM_OK)             \
            return rv_;               \
    } while (0)

#define MM_TRY_GOTO(rv, expr, label)  \
    do {                              \
        (rv) = (expr);                \
        if ((rv) != MM_OK)            \
            goto label;               \
    } while (0)

// Always compiled in: for invariants only, never for bad input.
#define MM_ASSERT(expr)                                                               \
    do {                                                                              \
        if (!(expr)) {                                                                \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #expr); \
            abort();                                                                  \
        }                                                                             \
    } while (0)

#endif
