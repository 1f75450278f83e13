// SPDX-License-Identifier: MIT
// Monotonic clock helpers.
#ifndef MM_TIME_H
#define MM_TIME_H

#include <stdint.h>
#include <time.h>

static inline uint64_t mm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint64_t mm_now_ms(void) { return mm_now_ns() / 1000000ull; }

#endif
