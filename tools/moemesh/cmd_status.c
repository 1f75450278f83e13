// SPDX-License-Identifier: MIT
// `moemesh status`: asks the router for the mesh and prints each daemon's role, addresses,
// identity and health. Exit status: 0 every role has a ready instance, 1 some role has none,
// 2 the router did not answer (or bad flags).
#include <stdio.h>
#include <string.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/ctl.h"
#include "mm/log.h"

static char *s_router;
static long long s_timeout_ms;
static mm_opt s_opts[] = {
    {"router", MM_OPT_STR, &s_router, MM_CTL_DEFAULT_ROUTER, "control address of the router"},
    {"timeout-ms", MM_OPT_INT, &s_timeout_ms, "2000", "how long to wait for the router"},
    {0},
};

static void print_reply(const Mmctl__StatusReply *sr, int *n_ready_roles) {
    const Mmctl__Identity *r = sr->router;
    printf("mesh at %s: protocol %u, build %s, model %s, placement %s; down after %u ms\n\n",
           s_router, r->protocol_version, r->build_id, r->model_fingerprint,
           r->placement_fingerprint, sr->down_after_ms);
    printf("%-10s %4s  %-8s %7s  %-6s %-40s %-24s %-10s %s\n", "ROLE", "INST", "HEALTH", "PID",
           "SEEN", "CONTROL", "DATA", "DEVICE", "DETAIL / IDENTITY");
    int ready[MM_N_ROLES] = {0};
    for (size_t i = 0; i < sr->n_members; i++) {
        const Mmctl__Member *m = sr->members[i];
        const Mmctl__Identity *id = m->identity;
        int ri = mm_role_index(id->role);
        if (ri >= 0 && m->health == MMCTL__HEALTH__HEALTH_READY)
            ready[ri]++;
        char seen[24];
        snprintf(seen, sizeof(seen), "%llums", (unsigned long long)m->last_seen_ms_ago);
        printf("%-10s %4u  %-8s %7u  %-6s %-40s %-24s %-10s %s\n", id->role, id->instance,
               mm_ctl_health_name(m->health), id->pid, seen, id->control_addr,
               id->data_addr[0] ? id->data_addr : "-", id->device, m->detail);
        printf("%-10s %4s  %-8s %7s  %-6s build %s, model %s, placement %s, host %s, "
               "incarnation %016llx, joins %u\n", "", "", "", "", "", id->build_id,
               id->model_fingerprint, id->placement_fingerprint, id->host,
               (unsigned long long)id->incarnation, m->joins);
    }
    *n_ready_roles = 0;
    printf("\n");
    for (int i = 0; i < MM_N_ROLES; i++) {
        printf("%s%s: %d ready", i ? ", " : "", mm_roles[i], ready[i]);
        *n_ready_roles += ready[i] > 0;
    }
    printf("\n");
}

static int run_status(int argc, char **argv) {
    mm_cli cli = {.prog = "moemesh status",
                  .summary = "Print each daemon of the mesh: role, addresses, identity, health "
                             "(asks the router). Exit 0 when every role is ready, 1 when not, 2 "
                             "when the router does not answer.",
                  .opts = s_opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    mm_ctl_client *cl = NULL;
    mm_ctl_msg *rep = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "moemesh status: %s\n", err);
        goto out;
    }
    if (cli.help_shown) {
        rc = 0;
        goto out;
    }
    if (mm_ctl_client_open(&cl, s_router, err) != MM_OK) {
        fprintf(stderr, "moemesh status: %s\n", err);
        goto out;
    }
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    Mmctl__StatusRequest req = MMCTL__STATUS_REQUEST__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &req;
    if (mm_ctl_call(cl, &env, (int)s_timeout_ms, &rep, err) != MM_OK) {
        fprintf(stderr, "moemesh status: the router at %s did not answer: %s\n", s_router, err);
        goto out;
    }
    if (rep->body_case != MMCTL__ENVELOPE__BODY_STATUS_REPLY) {
        fprintf(stderr, "moemesh status: %s answered with %s\n", s_router, mm_ctl_body_name(rep));
        goto out;
    }
    int n_ready = 0;
    print_reply(rep->status_reply, &n_ready);
    rc = n_ready == MM_N_ROLES ? 0 : 1;
out:
    mm_ctl_msg_free(rep);
    mm_ctl_client_close(cl);
    mm_config_fini(&cli);
    return rc;
}

MM_COMMAND(cmd_status, "status", "print each daemon of the mesh: role, address, identity, health",
           run_status)
