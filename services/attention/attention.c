// SPDX-License-Identifier: MIT
// Attention shard role; see attention.h.
#include <stdio.h>

#include "attention.h"
#include "mm/log.h"

static long long s_shards;
mm_opt attention_opts[] = {
    {"shards", MM_OPT_INT, &s_shards, "1", "number of attention shards in the mesh"},
    {0},
};

mm_err attention_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]) {
    (void)arg;
    const mm_daemon_conf *c = mm_daemon_get_conf(d);
    if (s_shards < 1 || c->instance >= s_shards)
        return mm_errf(err, MM_EINVAL, "--instance %lld: the mesh has --shards %lld attention "
                       "shards (instances 0..%lld)", c->instance, s_shards, s_shards - 1);
    char detail[64];
    snprintf(detail, sizeof(detail), "shard %lld of %lld", c->instance, s_shards);
    mm_log_info("serving attention %s", detail);
    mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
    return MM_OK;
}

void attention_stop(mm_daemon *d, void *arg) {
    (void)d;
    (void)arg;
}
