// SPDX-License-Identifier: MIT
// moemesh-router: the hub of the mesh. Today it admits daemons (identity check), tracks their
// heartbeats and answers status; the step loop (embeddings, gate, dispatch, combine, LM head,
// sampling) lands beside registry.c.
#include "mm/daemon.h"
#include "mm/log.h"
#include "router.h"

static long long s_down_after_ms;
static mm_opt s_router_opts[] = {
    {"down-after-ms", MM_OPT_INT, &s_down_after_ms, "0",
     "mark a member down after this long without a heartbeat (0: 4 x --heartbeat-ms)"},
    {0},
};

int main(int argc, char **argv) {
    mm_registry *reg = NULL;
    if (mm_registry_new(&reg) != MM_OK)
        return MM_EXIT_ERROR;
    mm_daemon_spec spec = {
        .role = "router",
        .summary = "moemesh router: the hub every daemon joins; admits, tracks and reports the "
                   "mesh, and runs each step's forward pass.",
        .extra_opts = s_router_opts,
        .handler = mm_registry_handle,
        .handler_arg = reg,
        .is_hub = true,
    };
    mm_daemon *d = NULL;
    int code = MM_EXIT_ERROR;
    if (mm_daemon_open(&d, &spec, argc, argv, &code) != MM_OK) {
        mm_registry_free(reg);
        return code;
    }
    const mm_daemon_conf *c = mm_daemon_get_conf(d);
    long long down_after = s_down_after_ms > 0 ? s_down_after_ms : 4 * c->heartbeat_ms;
    mm_registry_set_self(reg, mm_daemon_get_identity(d), (uint32_t)c->heartbeat_ms,
                         (uint32_t)down_after);
    mm_log_info("members are marked down after %lld ms without a heartbeat", down_after);
    char err[MM_ERRLEN] = "";
    if (mm_daemon_start(d, err) != MM_OK) {
        mm_log_error("cannot start: %s", err);
        mm_daemon_request_stop(d, MM_EXIT_ERROR, NULL);
    } else {
        int tick = (int)(down_after / 8 < 10 ? 10 : down_after / 8 > 100 ? 100 : down_after / 8);
        mm_daemon_wait(d, tick, mm_registry_sweep, reg);
    }
    code = mm_daemon_close(d);
    mm_registry_free(reg);
    return code;
}
