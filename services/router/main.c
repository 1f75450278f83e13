// SPDX-License-Identifier: MIT
// moemesh-router: the hub of the mesh. It admits daemons (identity check), tracks their
// heartbeats and answers status (registry.c), and with --model runs each StepPlan's forward
// pass across the shards and owners (step.c).
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "mm/daemon.h"
#include "mm/log.h"
#include "router.h"
#include "step.h"
#include "step_draft.h"

static long long s_draft_max, s_draft_timeout_ms, s_draft_rows;
static bool s_draft_adapt;
static char *s_draft_pipeline;
static long long s_down_after_ms, s_shards, s_max_tokens, s_max_seqs, s_threads, s_timeout_ms,
    s_max_ctx;
static mm_opt s_router_opts[] = {
    {"down-after-ms", MM_OPT_INT, &s_down_after_ms, "0",
     "mark a member down after this long without a heartbeat (0: 4 x --heartbeat-ms)"},
    {"attention-shards", MM_OPT_INT, &s_shards, "1", "attention shards in the mesh"},
    {"max-batch-tokens", MM_OPT_INT, &s_max_tokens, "256", "rows (tokens) per step"},
    {"max-step-seqs", MM_OPT_INT, &s_max_seqs, "64", "sequences per step"},
    {"max-ctx", MM_OPT_INT, &s_max_ctx, "4096", "longest sequence (capped by the model)"},
    {"threads", MM_OPT_INT, &s_threads, "0", "CPU threads (0: all cores)"},
    {"step-timeout-ms", MM_OPT_INT, &s_timeout_ms, "10000",
     "longest wait for a shard's or owner's answer within a step"},
    {"draft-max", MM_OPT_INT, &s_draft_max, "4",
     "widest draft per seq per step (0: no drafting; at most 8)"},
    {"draft-timeout-ms", MM_OPT_INT, &s_draft_timeout_ms, "200",
     "longest wait for the drafter before a step (late: the step runs without drafts)"},
    {"draft-max-rows", MM_OPT_INT, &s_draft_rows, "64", "draft rows per step, all seqs"},
    {"draft-adapt", MM_OPT_BOOL, &s_draft_adapt, "true",
     "choose each seq's width from measured step times and acceptance (false: --draft-max)"},
    {"draft-pipeline", MM_OPT_STR, &s_draft_pipeline, "auto",
     "true: draft ahead (ask the drafter for a step's drafts while the step before runs, "
     "without waiting); false: ask before each step and wait; auto: per step shape (rows), "
     "whichever of the two measures more tokens per second"},
    {0},
};

static struct {
    mm_registry *reg;
    mm_step_engine *eng;
} R;

// Step plans go to the step engine; everything else to the registry.
static void on_ctl(void *arg, const mm_ctl_msg *req, const char *peer, struct nng_msg **reply) {
    (void)arg;
    if (req->body_case == MMCTL__ENVELOPE__BODY_STEP_PLAN) {
        if (R.eng) {
            *reply = mm_step_engine_run(R.eng, req->step_plan, req->seq);
        } else {
            *reply = mm_ctl_reply_ack(false, "this router was started without --model: it "
                                             "serves no steps");
        }
        return;
    }
    mm_registry_handle(R.reg, req, peer, reply);
}

// pipeline_mode: --draft-pipeline's value as MM_DRAFT_PIPE_*, -1 when it is none of them.
static int pipeline_mode(const char *v) {
    if (!v || !strcasecmp(v, "auto"))
        return MM_DRAFT_PIPE_AUTO;
    if (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") ||
        !strcasecmp(v, "on"))
        return MM_DRAFT_PIPE_ON;
    if (!strcmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no") ||
        !strcasecmp(v, "off"))
        return MM_DRAFT_PIPE_OFF;
    return -1;
}

int main(int argc, char **argv) {
    mm_registry *reg = NULL;
    if (mm_registry_new(&reg) != MM_OK)
        return MM_EXIT_ERROR;
    R.reg = reg;
    mm_daemon_spec spec = {
        .role = "router",
        .summary = "moemesh router: the hub every daemon joins; admits, tracks and reports the "
                   "mesh, and runs each step's forward pass.",
        .extra_opts = s_router_opts,
        .handler = on_ctl,
        .handler_arg = NULL,
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
    const int pipeline = pipeline_mode(s_draft_pipeline);
    if (pipeline < 0) {
        fprintf(stderr, "moemesh-router: --draft-pipeline: '%s' is not auto, true or false\n",
                s_draft_pipeline);
        mm_daemon_close(d);
        mm_registry_free(reg);
        return MM_EXIT_USAGE;
    }
    // The step engine takes these as int (rows, seqs, ms): a value it would truncate is a usage
    // error naming the flag, not a wrapped limit. Rows per step also size the owners' frames
    // (rows x top-k x d_model), which the owners bound to 2^24 rows.
    const struct {
        const char *name;
        long long v, hi;
    } lim[] = {
        {"max-batch-tokens", s_max_tokens, 1 << 24}, {"max-step-seqs", s_max_seqs, 1 << 24},
        {"attention-shards", s_shards, 65535},       {"max-ctx", s_max_ctx, INT_MAX},
        {"threads", s_threads, 4096},                {"step-timeout-ms", s_timeout_ms, INT_MAX},
        {"draft-max", s_draft_max, INT_MAX},         {"draft-timeout-ms", s_draft_timeout_ms, INT_MAX},
        {"draft-max-rows", s_draft_rows, INT_MAX},   {"down-after-ms", s_down_after_ms, INT_MAX},
    };
    for (size_t i = 0; i < sizeof(lim) / sizeof(lim[0]); i++)
        if (lim[i].v < 0 || lim[i].v > lim[i].hi) {
            fprintf(stderr, "moemesh-router: --%s %lld: out of range 0..%lld\n", lim[i].name,
                    lim[i].v, lim[i].hi);
            mm_daemon_close(d);
            mm_registry_free(reg);
            return MM_EXIT_USAGE;
        }
    if (c->model) {
        mm_step_conf sc = {
            .model = c->model, .placement = c->placement, .device = c->device,
            .owners = (int)c->owners, .shards = (int)s_shards, .max_tokens = (int)s_max_tokens,
            .max_seqs = (int)s_max_seqs, .threads = (int)s_threads,
            .step_timeout_ms = (int)s_timeout_ms, .max_ctx = (int)s_max_ctx,
            .draft_max = (int)s_draft_max, .draft_timeout_ms = (int)s_draft_timeout_ms,
            .draft_max_rows = (int)s_draft_rows, .draft_adapt = s_draft_adapt,
            .draft_pipeline = pipeline,
        };
        if (mm_step_engine_open(&R.eng, &sc, reg, err) != MM_OK) {
            mm_log_error("cannot open the step engine: %s", err);
            code = mm_daemon_close(d);
            mm_registry_free(reg);
            return code == MM_EXIT_OK ? MM_EXIT_ERROR : code;
        }
        mm_log_info("step engine: %lld attention shards, %lld owners, %lld tokens / %lld seqs "
                    "per step", s_shards, c->owners, s_max_tokens, s_max_seqs);
        mm_registry_set_limits(reg, (uint32_t)s_max_seqs, (uint32_t)s_max_tokens,
                               (uint32_t)s_shards);
        mm_registry_set_detail_hook(reg, mm_step_engine_status_hook, R.eng);
    }
    if (mm_daemon_start(d, err) != MM_OK) {
        mm_log_error("cannot start: %s", err);
        mm_daemon_request_stop(d, MM_EXIT_ERROR, NULL);
    } else {
        int tick = (int)(down_after / 8 < 10 ? 10 : down_after / 8 > 100 ? 100 : down_after / 8);
        mm_daemon_wait(d, tick, mm_registry_sweep, reg);
    }
    // The control server (and so every step in flight) stops inside mm_daemon_close; the
    // engine goes after it.
    code = mm_daemon_close(d);
    mm_step_engine_close(R.eng);
    mm_registry_free(reg);
    return code;
}
