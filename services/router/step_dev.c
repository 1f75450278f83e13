// SPDX-License-Identifier: MIT
// The router's per-layer device chain of the routing plan; see step_dev.h.
#include "step_dev.h"

#include <stddef.h>

mm_err mm_step_dev_route(mm_step_dev_layer *a) {
    a->normed = false;
    a->failed = NULL;
    if (!mm_gpu_mesh_plan_split)
        return MM_EUNSUPP;
    a->failed = "FFN norm";
    mm_err rv = mm_model_ffn_norm(a->m, a->s, a->L, a->h, a->R, a->x);
    if (rv != MM_OK)
        return rv;
    a->normed = true;
    a->failed = "router product and routing (mm_model_gate_plan)";
    rv = mm_model_gate_plan_at(a->m, a->s, a->L, a->x, a->R, a->plan_at, &a->pl);
    if (rv != MM_OK)
        return rv;
    if (a->plan_at) { // the one serving owner's share is the plan itself
        a->failed = NULL;
        return MM_OK;
    }
    a->failed = "the owners' shares (mm_gpu_mesh_plan_split)";
    rv = a->frames ? mm_gpu_mesh_plan_split_to(a->stream, a->pl.offs, a->pl.src, a->pl.dst, a->of,
                                               a->E, (int)a->nk, a->N, a->x, a->R,
                                               mm_model_cfg(a->m)->d_model, a->frames)
                   : mm_gpu_mesh_plan_split(a->stream, a->pl.offs, a->pl.src, a->pl.dst, a->of,
                                            a->E, (int)a->nk, a->N, a->shares, a->stride);
    if (rv == MM_OK)
        a->failed = NULL;
    return rv;
}

mm_err mm_step_dev_combine(mm_step_dev_layer *a) {
    a->failed = NULL;
    if (!a->one && !mm_gpu_mesh_pick)
        return MM_EUNSUPP;
    const int D = mm_model_cfg(a->m)->d_model;
    mm_err rv = MM_OK;
    if (!a->one) {
        a->failed = "picking the owners' rows (mm_gpu_mesh_pick)";
        rv = mm_gpu_mesh_pick(a->stream, a->ysn, a->ysn_rows, a->pl.ids, a->of, (int)a->nk, D,
                              a->eo);
        if (rv != MM_OK)
            return rv;
    }
    a->failed = "combine (mm_model_combine_plan)";
    rv = mm_model_combine_plan_next(a->m, a->s, a->L, a->h, a->R, a->pl.wt, a->eo, a->sh,
                                    a->xn_next);
    if (rv == MM_OK)
        a->failed = NULL;
    return rv;
}
