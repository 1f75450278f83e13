// SPDX-License-Identifier: MIT
// Switches of the mesh's device frames; see mm/mesh_graph.h.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mm/mesh_graph.h"

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
