// SPDX-License-Identifier: MIT
// Per-stage graphs of the mesh's daemons; see mm/mesh_graph.h.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mm/log.h"
#include "mm/mesh_graph.h"

struct entry {
    uint64_t k0, k1;
    void *graph; // NULL: seen once, not recorded
    uint64_t used;
    bool on;     // slot holds a key
};

struct mm_mesh_graphs {
    mm_backend *be;
    int cap;
    uint64_t tick;
    bool off; // a recording failed: op by op from now on
    int n_recorded;
    char who[48];
    struct entry *e; // (cap)
};

static bool g_env;
static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;

static void env_read(void) {
    const char *v = getenv("MM_MESH_GRAPHS");
    g_env = v && (strcmp(v, "1") == 0 || strcmp(v, "on") == 0 || strcmp(v, "true") == 0);
}

bool mm_mesh_graphs_env(void) {
    pthread_once(&g_env_once, env_read);
    return g_env;
}

static bool g_views;
static pthread_once_t g_views_once = PTHREAD_ONCE_INIT;

static void views_read(void) {
    const char *v = getenv("MM_MESH_VIEWS");
    g_views = !(v && strcmp(v, "0") == 0);
}

bool mm_mesh_views_env(void) {
    pthread_once(&g_views_once, views_read);
    return g_views;
}

static pthread_once_t g_inplace_once = PTHREAD_ONCE_INIT;
static bool g_inplace;

static void inplace_read(void) {
    const char *v = getenv("MM_MESH_INPLACE");
    g_inplace = !(v && strcmp(v, "0") == 0);
}

bool mm_mesh_inplace_env(void) {
    pthread_once(&g_inplace_once, inplace_read);
    return g_inplace && mm_mesh_views_env();
}

mm_err mm_mesh_graphs_new(mm_mesh_graphs **out, mm_backend *be, int cap, const char *who) {
    *out = NULL;
    if (!mm_mesh_graphs_env() || be == NULL || be->ops->host_memory || cap < 1 ||
        !be->ops->capture_begin || !be->ops->capture_end || !be->ops->graph_launch ||
        !be->ops->graph_free)
        return MM_OK;
    const char *off = getenv("MM_GPU_GRAPHS");
    if (off && strcmp(off, "0") == 0)
        return MM_OK;
    mm_mesh_graphs *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return MM_ENOMEM;
    g->e = calloc((size_t)cap, sizeof(*g->e));
    if (g->e == NULL) {
        free(g);
        return MM_ENOMEM;
    }
    g->be = be;
    g->cap = cap;
    snprintf(g->who, sizeof(g->who), "%s", who ? who : "stage");
    mm_log_info("mesh graphs: %s records its per-layer GPU work (MM_MESH_GRAPHS=1, %d graphs)",
                g->who, cap);
    *out = g;
    return MM_OK;
}

void mm_mesh_graphs_free(mm_mesh_graphs *g) {
    if (g == NULL)
        return;
    for (int i = 0; i < g->cap; i++)
        if (g->e[i].graph)
            g->be->ops->graph_free(g->be->ctx, g->e[i].graph);
    free(g->e);
    free(g);
}

mm_err mm_mesh_graphs_run(mm_mesh_graphs *g, uint64_t k0, uint64_t k1, int64_t rows,
                          mm_mesh_graph_fn fn, void *arg) {
    if (g == NULL || g->off || rows > 64 || rows < 1)
        return fn(arg);
    const struct mm_backend_ops *ops = g->be->ops;
    void *ctx = g->be->ctx;
    g->tick++;
    struct entry *hit = NULL, *victim = &g->e[0];
    for (int i = 0; i < g->cap; i++) {
        struct entry *x = &g->e[i];
        if (x->on && x->k0 == k0 && x->k1 == k1) {
            hit = x;
            break;
        }
        // room: a free slot, else the least recently used
        if (victim->on && (!x->on || x->used < victim->used))
            victim = x;
    }
    if (hit && hit->graph) {
        hit->used = g->tick;
        return ops->graph_launch(ctx, hit->graph);
    }
    if (hit == NULL) { // first sight: op by op, remembered
        if (victim->graph)
            ops->graph_free(ctx, victim->graph);
        *victim = (struct entry){.k0 = k0, .k1 = k1, .used = g->tick, .on = true};
        return fn(arg);
    }
    // seen before: record (nothing runs), then launch
    hit->used = g->tick;
    mm_err rv = ops->capture_begin(ctx);
    if (rv != MM_OK) {
        mm_log_warn("mesh graphs: %s cannot record (%s); its work is issued op by op from now on",
                    g->who, mm_strerror(rv));
        g->off = true;
        return fn(arg);
    }
    rv = fn(arg);
    void *graph = NULL;
    mm_err rc = ops->capture_end(ctx, &graph);
    if (rv != MM_OK || rc != MM_OK || graph == NULL) {
        if (graph)
            ops->graph_free(ctx, graph);
        mm_log_warn("mesh graphs: recording %s (key %llu/%llu, %lld rows) failed (%s); its work "
                    "is issued op by op from now on", g->who, (unsigned long long)k0,
                    (unsigned long long)k1, (long long)rows,
                    mm_strerror(rv != MM_OK ? rv : rc != MM_OK ? rc : MM_EDEVICE));
        g->off = true;
        return fn(arg); // the recorded ops did not run
    }
    hit->graph = graph;
    if (g->n_recorded++ == 0)
        mm_log_info("mesh graphs: %s recorded its first graph (key %llu/%llu, %lld rows)", g->who,
                    (unsigned long long)k0, (unsigned long long)k1, (long long)rows);
    return ops->graph_launch(ctx, graph);
}
