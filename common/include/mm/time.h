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

// mm_timespec_add_ms: t plus ms (>= 0) milliseconds, tv_nsec kept below 1 s: a deadline for
// pthread_cond_timedwait on a condition variable of t's clock.
static inline struct timespec mm_timespec_add_ms(struct timespec t, int64_t ms) {
    t.tv_sec += (time_t)(ms / 1000);
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

#endif
