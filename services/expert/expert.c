// SPDX-License-Identifier: MIT
// Expert owner role; see expert.h.
#include <stdio.h>

#include "expert.h"
#include "mm/json.h"
#include "mm/log.h"

mm_err expert_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]) {
    (void)arg;
    const mm_daemon_conf *c = mm_daemon_get_conf(d);
    if (c->instance >= c->owners)
        return mm_errf(err, MM_EINVAL, "--instance %lld: the mesh has only --owners %lld expert "
                       "owners (instances 0..%lld)", c->instance, c->owners, c->owners - 1);
    char detail[128];
    if (!c->model) {
        snprintf(detail, sizeof(detail), "owner %lld of %lld, no model", c->instance, c->owners);
    } else if (c->placement) {
        snprintf(detail, sizeof(detail), "owner %lld of %lld, placement %s", c->instance,
                 c->owners, c->placement);
    } else {
        char path[4096];
        json_t *cfg = NULL;
        long long n = 0;
        snprintf(path, sizeof(path), "%s/config.json", c->model);
        MM_TRY(mm_json_load_file(path, &cfg, err));
        // The expert count goes by several names across architectures.
        const char *keys[] = {"num_experts", "n_routed_experts", "num_local_experts"};
        for (size_t i = 0; i < 3 && n == 0; i++)
            if (mm_json_get_int_or(cfg, keys[i], path, 0, &n, err) != MM_OK)
                n = 0;
        json_decref(cfg);
        if (n <= 0)
            return mm_errf(err, MM_EINVAL, "%s: no expert count (num_experts, n_routed_experts "
                           "or num_local_experts)", path);
        long long lo = n * c->instance / c->owners, hi = n * (c->instance + 1) / c->owners;
        snprintf(detail, sizeof(detail), "experts %lld-%lld of %lld", lo, hi - 1, n);
    }
    mm_log_info("holding %s", detail);
    mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
    return MM_OK;
}

void expert_stop(mm_daemon *d, void *arg) {
    (void)d;
    (void)arg;
}
