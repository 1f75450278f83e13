// SPDX-License-Identifier: MIT
// The mesh's per-stage graph cache (mm/mesh_graph.h) on a fake backend whose "graphs" record
// which ops a stage issued: a key runs op by op the first time, is recorded and launched the
// second, replayed after; keys are told apart; a failed recording turns the cache off (op by
// op from then on); without MM_MESH_GRAPHS=1, on a host backend, or over 64 rows, nothing is
// recorded. The GPU's own capture is exercised by the GPU mesh invariance (device_run.sh).
#include <stdlib.h>

#include "../mm_test.h"
#include "mm/mesh_graph.h"

static struct {
    bool capturing;
    bool fail_end;   // capture_end fails
    int issued;      // ops that ran op by op
    int recorded;    // ops issued while capturing (they do not run)
    int launched;    // graph launches
    int ran_in_graph; // ops run by graph launches
    int freed;       // graphs freed
} F;

struct fake_graph {
    int n_ops;
};

static mm_err f_begin(void *ctx) {
    (void)ctx;
    if (F.capturing)
        return MM_EINVAL;
    F.capturing = true;
    return MM_OK;
}

static mm_err f_end(void *ctx, void **graph) {
    (void)ctx;
    F.capturing = false;
    *graph = NULL;
    if (F.fail_end)
        return MM_EDEVICE;
    struct fake_graph *g = malloc(sizeof(*g));
    g->n_ops = F.recorded;
    F.recorded = 0;
    *graph = g;
    return MM_OK;
}

static mm_err f_launch(void *ctx, void *graph) {
    (void)ctx;
    F.launched++;
    F.ran_in_graph += ((struct fake_graph *)graph)->n_ops;
    return MM_OK;
}

static void f_free(void *ctx, void *graph) {
    (void)ctx;
    F.freed++;
    free(graph);
}

// the stage: three ops
static mm_err stage(void *arg) {
    int *calls = arg;
    (*calls)++;
    for (int i = 0; i < 3; i++) {
        if (F.capturing)
            F.recorded++;
        else
            F.issued++;
    }
    return MM_OK;
}

static const struct mm_backend_ops dev_ops = {
    .host_memory = false,
    .capture_begin = f_begin,
    .capture_end = f_end,
    .graph_launch = f_launch,
    .graph_free = f_free,
};

static mm_backend dev_be = {.ops = &dev_ops};

static void test_policy(void) {
    memset(&F, 0, sizeof(F));
    mm_mesh_graphs *g = NULL;
    MM_PASS(mm_mesh_graphs_new(&g, &dev_be, 2, "test"));
    MM_TRUE(g != NULL);
    int calls = 0;
    MM_PASS(mm_mesh_graphs_run(g, 1, 7, 1, stage, &calls)); // first sight: op by op
    MM_EQ(F.issued, 3);
    MM_EQ(F.launched, 0);
    MM_PASS(mm_mesh_graphs_run(g, 1, 7, 1, stage, &calls)); // recorded, then launched
    MM_EQ(F.issued, 3);
    MM_EQ(F.launched, 1);
    MM_EQ(F.ran_in_graph, 3);
    MM_PASS(mm_mesh_graphs_run(g, 1, 7, 1, stage, &calls)); // replayed: fn not called
    MM_EQ(calls, 2);
    MM_EQ(F.launched, 2);
    MM_EQ(F.ran_in_graph, 6);
    MM_PASS(mm_mesh_graphs_run(g, 1, 8, 1, stage, &calls)); // another key: op by op
    MM_EQ(F.issued, 6);
    MM_EQ(F.launched, 2);
    MM_PASS(mm_mesh_graphs_run(g, 2, 7, 1, stage, &calls)); // a third key evicts the LRU (1/7)
    MM_EQ(F.freed, 1);
    MM_PASS(mm_mesh_graphs_run(g, 1, 7, 1, stage, &calls)); // 1/7 forgotten: op by op again
    MM_EQ(F.issued, 12);
    MM_EQ(F.launched, 2);
    MM_PASS(mm_mesh_graphs_run(g, 1, 7, 65, stage, &calls)); // over 64 rows: never recorded
    MM_PASS(mm_mesh_graphs_run(g, 1, 7, 65, stage, &calls));
    MM_EQ(F.issued, 18);
    MM_EQ(F.launched, 2);
    mm_mesh_graphs_free(g);
    MM_EQ(F.freed, 1); // no graph was left in the table (1/7 re-seen only once)
    MM_TRUE(!F.capturing);
}

static void test_failed_recording(void) {
    memset(&F, 0, sizeof(F));
    mm_mesh_graphs *g = NULL;
    MM_PASS(mm_mesh_graphs_new(&g, &dev_be, 4, "test"));
    int calls = 0;
    F.fail_end = true;
    MM_PASS(mm_mesh_graphs_run(g, 3, 1, 4, stage, &calls));
    MM_PASS(mm_mesh_graphs_run(g, 3, 1, 4, stage, &calls)); // recording fails: issued op by op
    MM_EQ(F.issued, 6);
    MM_EQ(F.launched, 0);
    MM_TRUE(!F.capturing);
    F.fail_end = false;
    for (int i = 0; i < 3; i++) // off for good
        MM_PASS(mm_mesh_graphs_run(g, 3, 1, 4, stage, &calls));
    MM_EQ(F.issued, 15);
    MM_EQ(F.launched, 0);
    mm_mesh_graphs_free(g);
}

static mm_err failing(void *arg) {
    (void)arg;
    if (F.capturing)
        F.recorded++;
    return MM_EINVAL;
}

static void test_stage_error(void) {
    memset(&F, 0, sizeof(F));
    mm_mesh_graphs *g = NULL;
    MM_PASS(mm_mesh_graphs_new(&g, &dev_be, 4, "test"));
    MM_FAIL(mm_mesh_graphs_run(g, 1, 1, 1, failing, NULL), MM_EINVAL);
    MM_FAIL(mm_mesh_graphs_run(g, 1, 1, 1, failing, NULL), MM_EINVAL); // while recording
    MM_TRUE(!F.capturing);
    MM_EQ(F.launched, 0);
    mm_mesh_graphs_free(g);
}

static void test_off(void) {
    memset(&F, 0, sizeof(F));
    static const struct mm_backend_ops host_ops = {.host_memory = true,
                                                    .capture_begin = f_begin,
                                                    .capture_end = f_end,
                                                    .graph_launch = f_launch,
                                                    .graph_free = f_free};
    mm_backend host_be = {.ops = &host_ops};
    mm_mesh_graphs *g = (mm_mesh_graphs *)&host_be;
    MM_PASS(mm_mesh_graphs_new(&g, &host_be, 4, "test"));
    MM_TRUE(g == NULL); // host memory: nothing to record
    static const struct mm_backend_ops bare_ops = {.host_memory = false};
    mm_backend bare_be = {.ops = &bare_ops};
    MM_PASS(mm_mesh_graphs_new(&g, &bare_be, 4, "test"));
    MM_TRUE(g == NULL); // no graphs in the backend
    int calls = 0;
    for (int i = 0; i < 3; i++)
        MM_PASS(mm_mesh_graphs_run(NULL, 1, 1, 1, stage, &calls)); // NULL: op by op
    MM_EQ(F.issued, 9);
}

static void test_env_off(void) {
    if (mm_mesh_graphs_env())
        MM_SKIP("MM_MESH_GRAPHS is on in this process");
    mm_mesh_graphs *g = (mm_mesh_graphs *)&dev_be;
    MM_PASS(mm_mesh_graphs_new(&g, &dev_be, 4, "test"));
    MM_TRUE(g == NULL);
}

static void with_env(void (*fn)(void)) {
    setenv("MM_MESH_GRAPHS", "1", 1);
    unsetenv("MM_GPU_GRAPHS");
    fn();
}
static void t_policy(void) { with_env(test_policy); }
static void t_failed(void) { with_env(test_failed_recording); }
static void t_error(void) { with_env(test_stage_error); }
static void t_off(void) { with_env(test_off); }
static void t_env_off(void) {
    unsetenv("MM_MESH_GRAPHS");
    test_env_off();
}

MM_TESTS = {
    {"mesh graphs: op by op, recorded, replayed, keys, LRU, rows over 64", t_policy},
    {"mesh graphs: a failed recording turns the cache off", t_failed},
    {"mesh graphs: a stage's error ends the recording and is returned", t_error},
    {"mesh graphs: off on host backends, without graphs, and for NULL", t_off},
    {"mesh graphs: off without MM_MESH_GRAPHS=1", t_env_off},
    {NULL, NULL},
};
