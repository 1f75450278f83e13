// SPDX-License-Identifier: MIT
// Helpers shared by the transport implementations in common/transport/ (not a public header).
#ifndef MM_TRANSPORT_INT_H
#define MM_TRANSPORT_INT_H

#include <sched.h>
#include <stdint.h>

#include "mm/transport.h"

// shm.c, for transports layered on a shm conn (cudaipc.c): a spare area of the shared control
// page (both processes see it; zero at the handshake) and which side this conn is.
void *mm__shm_conn_extra(void *shm_ctx, int *side, size_t *n_bytes);

// Busy-wait budget before a waiter sleeps, in ns (env MM_TRANSPORT_SPIN_US, default 50 us).
uint64_t mm__transport_spin_ns(void);

// poll() timeout in ms for an absolute deadline: -1 for none, 0 when passed, rounded up,
// capped at 60 s (callers loop and re-check the deadline).
int mm__deadline_timeout_ms(uint64_t deadline_ns);

static inline void mm__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
// One iteration of a waiter's bounded spin, spun_ns after it began: pause for the first few
// microseconds (5), then sched_yield() so that a peer sharing this CPU (2-vCPU boxes run more
// processes than cores) gets to run and answer instead of waiting for our spin to end.
static inline void mm__spin_once(uint64_t spun_ns) {
    if (spun_ns < 5000)
        mm__cpu_relax();
    else
        sched_yield();
}

#endif
}

// One iteration of a waiter's bounded spin, spun_ns after it began: pause for the first few
// microseconds (5), then sched_yield() so that a peer sharing this CPU (2-vCPU boxes run more
// processes than cores) gets to run and answer instead of waiting for our spin to end.
static inline void mm__spin_once(uint64_t spun_ns) {
    if (spun_ns < 5000)
        mm__cpu_relax();
    else
        sched_yield();
}

#endif
