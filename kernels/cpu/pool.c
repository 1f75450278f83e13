// SPDX-License-Identifier: MIT
// CPU worker pool; see pool.h.
//
// Design notes: a job is published by bumping `gen` (release); workers spin briefly on it,
// then sleep on a condition variable, so a decode step's hundreds of small ops do not pay a
// futex wake each, while idle workers do not burn a shared machine. `pending` counts chunks
// not yet finished; the caller spins, then yields, until it reaches zero.
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"

#define SPIN_ITERS 20000

struct worker {
    mm__pool *pool;
    int idx;
    pthread_t tid;
};

struct mm__pool {
    int n_threads;
    struct worker *workers; // n_threads - 1
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint_fast64_t gen;
    atomic_int pending;
    atomic_int sleepers;
    atomic_bool stop;
    // the current job (written before gen is bumped)
    mm__pool_fn fn;
    void *arg;
    int64_t n;
    int n_chunks;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void chunk_range(const mm__pool *p, int c, int64_t *b, int64_t *e) {
    int64_t per = p->n / p->n_chunks, rem = p->n % p->n_chunks;
    *b = c * per + (c < rem ? c : rem);
    *e = *b + per + (c < rem ? 1 : 0);
}

static void *worker_main(void *argp) {
    struct worker *w = argp;
    mm__pool *p = w->pool;
    uint_fast64_t seen = 0;
    for (;;) {
        uint_fast64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen &&
               !atomic_load(&p->stop)) {
            if (++spins < SPIN_ITERS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) // seq_cst: Dekker
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = g;
        if (w->idx < p->n_chunks) {
            int64_t b, e;
            chunk_range(p, w->idx, &b, &e);
            if (e > b)
                p->fn(p->arg, b, e);
            atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
        }
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
        w->idx = i;
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
    if (chunks > p->n_threads)
        chunks = p->n_threads;
    if (chunks <= 1) {
        fn(arg, 0, n);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    p->n_chunks = (int)chunks;
    atomic_store_explicit(&p->pending, (int)chunks - 1, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); // seq_cst, pairs with the sleepers check
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    int64_t b, e;
    chunk_range(p, 0, &b, &e);
    fn(arg, b, e);
    int spins = 0;
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) {
        if (++spins < SPIN_ITERS)
            cpu_relax();
        else
            sched_yield();
    }
}
