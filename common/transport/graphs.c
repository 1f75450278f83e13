// SPDX-License-Identifier: MIT
// Switches of the mesh's device frames; see mm/mesh_graph.h.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mm/mesh_graph.h"

static bool g_views, g_inplace;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

// env_on: whether the switch name is on (unless set to "0")
static bool env_on(const char *name) {
    const char *v = getenv(name);
    return !(v && strcmp(v, "0") == 0);
}

static void env_read(void) {
    g_views = env_on("MM_MESH_VIEWS");
    g_inplace = g_views && env_on("MM_MESH_INPLACE"); // (in place needs views)
}

bool mm_mesh_views_env(void) {
    pthread_once(&g_once, env_read);
    return g_views;
}

bool mm_mesh_inplace_env(void) {
    pthread_once(&g_once, env_read);
    return g_inplace;
}
