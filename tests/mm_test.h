// SPDX-License-Identifier: MIT
// The project's test harness (acutest/NUTS style). A test file defines static test functions
// and ends with an MM_TESTS table; this header supplies main(). tests/run.sh runs every case
// in its own process with a timeout:  ./t --list  prints the case names; ./t NAME runs one;
// ./t with no argument runs them all in turn. A failed check prints both operands and ends
// the process with status 1; MM_SKIP ends it with status 77.
#ifndef MM_TEST_H
#define MM_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mm/err.h"

typedef struct mm_test_case {
    const char *name;
    void (*fn)(void);
} mm_test_case;

#define MM_TESTS const mm_test_case mm_tests_[]
extern const mm_test_case mm_tests_[];

#define MM_TEST_FAIL_(...)                                     \
    do {                                                       \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);        \
        fprintf(stderr, __VA_ARGS__);                          \
        fprintf(stderr, "\n");                                 \
        exit(1);                                               \
    } while (0)

#define MM_PASS(expr)                                                                      \
    do {                                                                                   \
        mm_err e_ = (expr);                                                                \
        if (e_ != MM_OK)                                                                   \
            MM_TEST_FAIL_("%s returned %d (%s), expected MM_OK", #expr, (int)e_, mm_strerror(e_)); \
    } while (0)

#define MM_FAIL(expr, code)                                                               \
    do {                                                                                  \
        mm_err e_ = (expr);                                                               \
        if (e_ != (code))                                                                 \
            MM_TEST_FAIL_("%s returned %d (%s), expected %s (%s)", #expr, (int)e_,         \
                          mm_strerror(e_), #code, mm_strerror(code));                     \
    } while (0)

#define MM_TRUE(expr)                                                  \
    do {                                                               \
        if (!(expr))                                                   \
            MM_TEST_FAIL_("expected true: %s", #expr);                 \
    } while (0)

#define MM_EQ(a, b)                                                                        \
    do {                                                                                   \
        long long a_ = (long long)(a), b_ = (long long)(b);                                \
        if (a_ != b_)                                                                      \
            MM_TEST_FAIL_("%s == %s: %lld != %lld", #a, #b, a_, b_);                        \
    } while (0)

#define MM_STREQ(a, b)                                                                     \
    do {                                                                                   \
        const char *a_ = (a), *b_ = (b);                                                   \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                                             \
            MM_TEST_FAIL_("%s == %s: \"%s\" != \"%s\"", #a, #b, a_ ? a_ : "(null)",          \
                          b_ ? b_ : "(null)");                                             \
    } while (0)

#define MM_NEAR(a, b, tol)                                                                 \
    do {                                                                                   \
        double a_ = (double)(a), b_ = (double)(b);                                         \
        if (!(fabs(a_ - b_) <= (tol)))                                                     \
            MM_TEST_FAIL_("%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, a_, b_, (double)(tol)); \
    } while (0)

#define MM_NULL(p)                                                      \
    do {                                                                \
        if ((p) != NULL)                                                \
            MM_TEST_FAIL_("expected NULL: %s", #p);                     \
    } while (0)

#define MM_SKIP(...)                                                    \
    do {                                                                \
        fprintf(stdout, "SKIP: ");                                      \
        fprintf(stdout, __VA_ARGS__);                                   \
        fprintf(stdout, "\n");                                          \
        fflush(stdout);                                                 \
        exit(77);                                                       \
    } while (0)

// Path of a test fixture, relative to the repository root where the runner starts tests.
#define MM_TEST_DATA(rel) ("tests/fixtures/" rel)

// A loopback port unlikely to collide with other test processes running at the same time.
static inline int mm_test_next_port(void) {
    static int n;
    return 20000 + (int)((getpid() * 37) % 20000) + (n++ * 2);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (const mm_test_case *t = mm_tests_; t->name; t++)
            printf("%s\n", t->name);
        return 0;
    }
    int ran = 0;
    for (const mm_test_case *t = mm_tests_; t->name; t++) {
        if (argc > 1 && strcmp(argv[1], t->name) != 0)
            continue;
        t->fn();
        ran++;
    }
    if (ran == 0) {
        fprintf(stderr, "no test named '%s'\n", argc > 1 ? argv[1] : "");
        return 2;
    }
    return 0;
}

#endif
