// SPDX-License-Identifier: MIT
// CPU worker pool; see pool.h.
//
// Design notes: a job is split into more chunks than threads; the caller and the workers claim
// chunks one at a time from a shared counter, so a worker the OS has not scheduled yet (a busy
// or oversubscribed machine) delays nothing: the caller simply runs the chunks itself. The
// caller then waits only for chunks already claimed (being run right now).
// `state` packs (job generation << 32 | next chunk); a claim is a CAS that succeeds only while
// the generation is unchanged, so a late worker can never run a chunk of a newer job with the
// parameters of an older one. Job parameters are relaxed atomics written before the
// generation is published (release) and re-validated by that CAS.
// Idle workers spin briefly on the generation, then sleep on a condition variable.
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "pool.h"

#define SPIN_ITERS 4000
#define CHUNKS_PER_THREAD 4

struct worker {
    mm__pool *pool;
    pthread_t tid;
};

struct mm__pool {
    int n_threads;
    struct worker *workers; // n_threads - 1
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t state;  // gen << 32 | next chunk to claim
    atomic_int done;         // chunks finished in the current job
    atomic_int sleepers;
    atomic_bool stop;
    // the current job
    _Atomic(mm__pool_fn) fn;
    _Atomic(void *) arg;
    _Atomic int64_t n;
    atomic_int n_chunks;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void chunk_range(int64_t n, int n_chunks, int c, int64_t *b, int64_t *e) {
    int64_t per = n / n_chunks, rem = n % n_chunks;
    *b = c * per + (c < rem ? c : rem);
    *e = *b + per + (c < rem ? 1 : 0);
}

// run_chunks claims and runs chunks of job gen until none is left; returns how many it ran.
static int run_chunks(mm__pool *p, uint32_t gen) {
    int ran = 0;
    for (;;) {
        uint64_t s = atomic_load_explicit(&p->state, memory_order_acquire);
        if ((uint32_t)(s >> 32) != gen)
            return ran;
        mm__pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
        int64_t n = atomic_load_explicit(&p->n, memory_order_relaxed);
        int nc = atomic_load_explicit(&p->n_chunks, memory_order_relaxed);
        uint32_t c = (uint32_t)s;
        if ((int)c >= nc)
            return ran;
        if (!atomic_compare_exchange_weak_explicit(&p->state, &s, s + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue; // another thread claimed it, or a new job started: re-read
        int64_t b, e;
        chunk_range(n, nc, (int)c, &b, &e);
        if (e > b)
            fn(arg, b, e);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        ran++;
    }
}

static void *worker_main(void *argp) {
    struct worker *w = argp;
    mm__pool *p = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = (uint32_t)(atomic_load(&p->state) >> 32)) == seen && !atomic_load(&p->stop)) {
            if (++spins < SPIN_ITERS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((uint32_t)(atomic_load(&p->state) >> 32) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu); // seq_cst loads: pairs with the publisher
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = g;
        run_chunks(p, g);
    }
}

mm_err mm__pool_new(mm__pool **out, int n_threads) {
    *out = NULL;
    if (n_threads < 1)
        n_threads = 1;
    mm__pool *p = calloc(1, sizeof(*p));
    if (!p)
        return MM_ENOMEM;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->workers = calloc((size_t)n_threads, sizeof(struct worker));
    if (!p->workers) {
        mm__pool_free(p);
        return MM_ENOMEM;
    }
    for (int i = 1; i < n_threads; i++) {
        struct worker *w = &p->workers[i - 1];
        w->pool = p;
        if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
            p->n_threads = i; // join the ones started
            mm__pool_free(p);
            return MM_ESYS;
        }
    }
    *out = p;
    return MM_OK;
}

void mm__pool_free(mm__pool *p) {
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++)
        pthread_join(p->workers[i - 1].tid, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
}

int mm__pool_threads(const mm__pool *p) { return p->n_threads; }

void mm__pool_run(mm__pool *p, int64_t n, int64_t min_chunk, mm__pool_fn fn, void *arg) {
    if (n <= 0)
        return;
    if (min_chunk < 1)
        min_chunk = 1;
    int64_t chunks = n / min_chunk;
    if (chunks > (int64_t)p->n_threads * CHUNKS_PER_THREAD)
        chunks = (int64_t)p->n_threads * CHUNKS_PER_THREAD;
    if (chunks <= 1 || p->n_threads == 1) {
        fn(arg, 0, n);
        return;
    }
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&p->n, n, memory_order_relaxed);
    atomic_store_explicit(&p->n_chunks, (int)chunks, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint32_t gen = (uint32_t)(atomic_load_explicit(&p->state, memory_order_relaxed) >> 32) + 1;
    atomic_store(&p->state, (uint64_t)gen << 32); // seq_cst publish, pairs with sleepers
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_chunks(p, gen);
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < (int)chunks) {
        if (++spins < SPIN_ITERS)
            cpu_relax();
        else
            sched_yield();
    }
}
