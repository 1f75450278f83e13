// SPDX-License-Identifier: MIT
// Backend selection by spec string ("cpu", "cpu-dev", "cuda:0", "hip:0"); see kernels.h.
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

// Defined by kernels/cuda when it is compiled in (make cuda / make hip); NULL otherwise.
extern mm_err mm_cuda_backend_open(mm_backend *be, const mm_backend_params *p,
                                   char err[MM_ERRLEN]) __attribute__((weak));

mm_err mm_backend_open(mm_backend **out, const char *spec, const mm_backend_params *p,
                       char err[MM_ERRLEN]) {
    *out = NULL;
    mm_backend_params params = p ? *p : (mm_backend_params){0};
    mm_backend *be = calloc(1, sizeof(*be));
    if (!be)
        return MM_ENOMEM;
    mm_err rv;
    if (!spec || strcmp(spec, "cpu") == 0) {
        rv = mm_cpu_backend_open(be, &params, err);
    } else if (strcmp(spec, "cpu-dev") == 0) {
        rv = mm_cpu_dev_backend_open(be, &params, err);
    } else if (strncmp(spec, "cuda", 4) == 0 || strncmp(spec, "hip", 3) == 0) {
        const char *c = strchr(spec, ':');
        if (c) {
            char *end = NULL;
            long d = strtol(c + 1, &end, 10);
            if (!end || *end || d < 0 || d > 1024) {
                free(be);
                return mm_errf(err, MM_EINVAL, "bad device '%s' (want cpu, cpu-dev, cuda:N or hip:N)",
                               spec);
            }
            params.device = (int)d;
        }
        if (!mm_cuda_backend_open) {
            free(be);
            return mm_errf(err, MM_EUNSUPP,
                           "device '%s': this build has no GPU backend (build with make cuda "
                           "or make hip)",
                           spec);
        }
        rv = mm_cuda_backend_open(be, &params, err);
    } else {
        free(be);
        return mm_errf(err, MM_EINVAL, "unknown device '%s' (want cpu, cpu-dev, cuda:N or hip:N)", spec);
    }
    if (rv != MM_OK) {
        free(be);
        return rv;
    }
    *out = be;
    return MM_OK;
}

void mm_backend_close(mm_backend *be) {
    if (!be)
        return;
    if (be->ops && be->ops->close)
        be->ops->close(be->ctx);
    free(be);
}
