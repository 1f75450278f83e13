// SPDX-License-Identifier: MIT
// Drafter role; see drafter.h.
#include <stdio.h>
#include <sys/stat.h>

#include "drafter.h"
#include "mm/log.h"

static char *s_draft_model;
mm_opt drafter_opts[] = {
    {"draft-model", MM_OPT_STR, &s_draft_model, NULL,
     "draft model directory (unset: the drafter serves no drafts)"},
    {0},
};

mm_err drafter_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]) {
    (void)arg;
    char detail[300];
    if (s_draft_model) {
        char path[4096];
        struct stat st;
        snprintf(path, sizeof(path), "%s/config.json", s_draft_model);
        if (stat(path, &st) != 0)
            return mm_errf(err, MM_ENOENT, "--draft-model %s: no config.json", s_draft_model);
        snprintf(detail, sizeof(detail), "draft model %.250s", s_draft_model);
    } else {
        snprintf(detail, sizeof(detail), "no draft model (drafting off)");
    }
    mm_log_info("%s", detail);
    mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_READY, detail);
    return MM_OK;
}

void drafter_stop(mm_daemon *d, void *arg) {
    (void)d;
    (void)arg;
}
