// SPDX-License-Identifier: MIT
// `moemesh up`: starts a whole local mesh (router first, then gateway, attention shards, expert
// owners and the drafter) and stays in the foreground as its supervisor.
//
// Design notes:
// - The daemons are the binaries beside this one (moemesh-<role>). Each child joins one process
//   group, unblocks signals, sets PR_SET_PDEATHSIG(SIGTERM) so that it dies with `up` even after
//   a kill -9, and execs. Only async-signal-safe calls run between fork and exec (argv is built
//   before the fork).
// - Signals come through a signalfd (SIGINT, SIGTERM, SIGHUP, SIGCHLD). A stop signal is
//   forwarded to every child; `up` waits for them (5 s, then SIGKILL) and exits 0.
// - A child that dies while the mesh runs is logged and restarted after a backoff that doubles
//   from 250 ms to --restart-max-ms and resets once a child has lived 10 s. A child that exits
//   with status 2 (bad flags) or 127 (cannot exec) would fail the same way again: the mesh stops.
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/ctl.h"
#include "mm/daemon.h"
#include "mm/log.h"
#include "mm/time.h"

#define MAX_CHILDREN 256
#define MAX_ARGS 40
#define STABLE_MS 10000

struct child {
    char role[MM_ROLE_LEN];
    int instance;
    char *argv[MAX_ARGS]; // owned strings; argv[0] is the binary path
    pid_t pid;            // 0 when not running
    uint64_t started_ms;
    uint64_t restart_at_ms; // 0: no restart pending
    int backoff_ms;
    int restarts;
};

static char *s_model, *s_drafter, *s_host, *s_run_dir, *s_router, *s_placement, *s_device,
    *s_log_level, *s_chat_template;
static long long s_owners, s_shards, s_port, s_heartbeat_ms, s_restart_max_ms, s_ready_timeout_ms;
static mm_opt s_opts[] = {
    {"model", MM_OPT_STR, &s_model, NULL, "model directory (config.json + *.safetensors)"},
    {"owners", MM_OPT_INT, &s_owners, "2", "expert owners to start"},
    {"attention-shards", MM_OPT_INT, &s_shards, "1", "attention shards to start"},
    {"drafter", MM_OPT_STR, &s_drafter, NULL,
     "drafting: a draft model directory (same tokenizer as --model) or 'ngram' (prompt lookup)"},
    {"host", MM_OPT_STR, &s_host, "127.0.0.1", "gateway HTTP address"},
    {"port", MM_OPT_INT, &s_port, "8000", "gateway HTTP port"},
    {"chat-template", MM_OPT_STR, &s_chat_template, NULL,
     "a Jinja chat template file the gateway uses instead of the checkpoint's"},
    {"run-dir", MM_OPT_STR, &s_run_dir, "/tmp/moemesh", "directory of the ipc sockets"},
    {"router", MM_OPT_STR, &s_router, NULL, "router control address (default ipc://RUN-DIR/router.ctl)"},
    {"placement", MM_OPT_STR, &s_placement, NULL, "placement JSON file (default uniform)"},
    {"device", MM_OPT_STR, &s_device, "cpu", "device of every daemon: cpu, cuda:N, hip:N (cpu-dev: tests)"},
    {"log-level", MM_OPT_STR, &s_log_level, "info", "log level of up and every daemon"},
    {"heartbeat-ms", MM_OPT_INT, &s_heartbeat_ms, "250", "daemon heartbeat interval"},
    {"restart-max-ms", MM_OPT_INT, &s_restart_max_ms, "5000", "longest wait before restarting a daemon"},
    {"ready-timeout-ms", MM_OPT_INT, &s_ready_timeout_ms, "20000",
     "how long to wait for every role to report ready before warning"},
    {0},
};

static struct child s_children[MAX_CHILDREN];
static int s_n_children;
static pid_t s_pgid;

static void child_free(struct child *c) {
    for (int i = 0; i < MAX_ARGS && c->argv[i]; i++)
        free(c->argv[i]);
    memset(c->argv, 0, sizeof(c->argv));
}

static int add_child(const char *bindir, const char *role, int instance, char *err) {
    if (s_n_children >= MAX_CHILDREN) {
        mm_errf(err, MM_EFULL, "more than %d daemons", MAX_CHILDREN);
        return -1;
    }
    struct child *c = &s_children[s_n_children++];
    memset(c, 0, sizeof(*c));
    snprintf(c->role, sizeof(c->role), "%s", role);
    c->instance = instance;
    c->backoff_ms = 250;
    int n = 0;
    char buf[PATH_MAX + 64];
#define ARG(...) (snprintf(buf, sizeof(buf), __VA_ARGS__), c->argv[n++] = strdup(buf))
    ARG("%s/moemesh-%s", bindir, role);
    ARG("--router"), ARG("%s", s_router);
    if (!strcmp(role, "router"))
        ARG("--listen"), ARG("%s", s_router);
    else
        ARG("--listen"), ARG("ipc://%s/%s-%d.ctl", s_run_dir, role, instance);
    ARG("--instance"), ARG("%d", instance);
    if (s_model)
        ARG("--model"), ARG("%s", s_model);
    ARG("--owners"), ARG("%lld", s_owners);
    if (s_placement)
        ARG("--placement"), ARG("%s", s_placement);
    ARG("--device"), ARG("%s", s_device);
    ARG("--log-level"), ARG("%s", s_log_level);
    ARG("--heartbeat-ms"), ARG("%lld", s_heartbeat_ms);
    if (!strcmp(role, "gateway"))
        ARG("--host"), ARG("%s", s_host), ARG("--port"), ARG("%lld", s_port);
    if (!strcmp(role, "gateway") && s_chat_template && s_chat_template[0])
        ARG("--chat-template"), ARG("%s", s_chat_template);
    if (!strcmp(role, "attention"))
        ARG("--shards"), ARG("%lld", s_shards);
    if (!strcmp(role, "router") || !strcmp(role, "gateway"))
        ARG("--attention-shards"), ARG("%lld", s_shards);
    if (!strcmp(role, "attention") || !strcmp(role, "expert")) {
        // Data-plane address: a shm:// name unique per run dir, so meshes can run side by side.
        uint32_t hsh = 2166136261u;
        for (const char *q = s_run_dir; *q; q++)
            hsh = (hsh ^ (uint8_t)*q) * 16777619u;
        ARG("--data"), ARG("shm://mm-%08x-%c%d", hsh, role[0], instance);
    }
    if (!strcmp(role, "drafter") && s_drafter)
        ARG("--draft-model"), ARG("%s", s_drafter);
#undef ARG
    for (int i = 0; i < n; i++)
        if (!c->argv[i]) {
            mm_errf(err, MM_ENOMEM, "out of memory");
            return -1;
        }
    if (access(c->argv[0], X_OK) != 0) {
        mm_errf(err, MM_ENOENT, "%s: %s (up starts the daemons beside itself)", c->argv[0],
                strerror(errno));
        return -1;
    }
    return 0;
}

static mm_err spawn(struct child *c) {
    pid_t parent = getpid();
    pid_t pgid = s_pgid;
    pid_t pid = fork();
    if (pid < 0)
        return MM_ESYS;
    if (pid == 0) {
        // Child: async-signal-safe calls only until exec.
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        if (setpgid(0, pgid) != 0)
            setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1);
        execv(c->argv[0], c->argv);
        _exit(127);
    }
    // Also set from the parent, so that the group exists before either side runs on.
    if (s_pgid == 0)
        s_pgid = pid;
    setpgid(pid, s_pgid == pid ? pid : s_pgid);
    c->pid = pid;
    c->started_ms = mm_now_ms();
    c->restart_at_ms = 0;
    mm_log_info("started %s/%d (pid %d)", c->role, c->instance, (int)pid);
    return MM_OK;
}

static struct child *find_pid(pid_t pid) {
    for (int i = 0; i < s_n_children; i++)
        if (s_children[i].pid == pid)
            return &s_children[i];
    return NULL;
}

static int n_running(void) {
    int n = 0;
    for (int i = 0; i < s_n_children; i++)
        n += s_children[i].pid > 0;
    return n;
}

static void describe_status(int status, char *buf, size_t n) {
    if (WIFEXITED(status))
        snprintf(buf, n, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, n, "killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        snprintf(buf, n, "ended (status 0x%x)", status);
}

// Reaps every exited child. When running, schedules restarts; returns false when a child failed
// in a way a restart cannot fix.
static bool reap(bool stopping) {
    bool ok = true;
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        struct child *c = find_pid(pid);
        if (!c)
            continue;
        c->pid = 0;
        char how[64];
        describe_status(status, how, sizeof(how));
        if (stopping) {
            mm_log_info("%s/%d (pid %d) %s", c->role, c->instance, (int)pid, how);
            continue;
        }
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        if (code == MM_EXIT_USAGE || code == 127) {
            mm_log_error("%s/%d (pid %d) %s: its flags or binary are wrong, a restart would fail "
                         "the same way; stopping the mesh", c->role, c->instance, (int)pid, how);
            ok = false;
            continue;
        }
        uint64_t now = mm_now_ms();
        if (now - c->started_ms > STABLE_MS)
            c->backoff_ms = 250;
        c->restart_at_ms = now + (uint64_t)c->backoff_ms;
        c->restarts++;
        mm_log_warn("%s/%d (pid %d) %s; restarting in %d ms (restart #%d)", c->role, c->instance,
                    (int)pid, how, c->backoff_ms, c->restarts);
        c->backoff_ms = c->backoff_ms * 2 > s_restart_max_ms ? (int)s_restart_max_ms
                                                              : c->backoff_ms * 2;
    }
    return ok;
}

// Signals every running child (the router too unless spare_router) and, with the router, the
// whole process group.
static void signal_all(int sig, bool spare_router) {
    for (int i = 0; i < s_n_children; i++)
        if (s_children[i].pid > 0 && !(spare_router && !strcmp(s_children[i].role, "router")))
            kill(s_children[i].pid, sig);
    if (!spare_router && s_pgid > 0)
        killpg(s_pgid, sig);
}

static int n_running_members(void) {
    int n = 0;
    for (int i = 0; i < s_n_children; i++)
        n += s_children[i].pid > 0 && strcmp(s_children[i].role, "router") != 0;
    return n;
}

// Reads the signalfd; returns the stop signal seen (0 for none) and reaps on SIGCHLD.
static int drain_signals(int sfd, bool stopping, bool *fatal) {
    struct signalfd_siginfo si;
    int stop = 0;
    while (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (si.ssi_signo == SIGCHLD)
            continue;
        stop = (int)si.ssi_signo;
    }
    if (!reap(stopping))
        *fatal = true;
    return stop;
}

// Asks the router for the members; returns how many roles have a ready instance (-1: no answer).
static int roles_ready(mm_ctl_client *cl, char *missing, size_t n) {
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    Mmctl__StatusRequest sr = MMCTL__STATUS_REQUEST__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    char err[MM_ERRLEN];
    if (mm_ctl_call(cl, &env, 300, &rep, err) != MM_OK)
        return -1;
    int up[MM_N_ROLES] = {0}, n_up = 0;
    if (rep->body_case == MMCTL__ENVELOPE__BODY_STATUS_REPLY)
        for (size_t i = 0; i < rep->status_reply->n_members; i++) {
            const Mmctl__Member *m = rep->status_reply->members[i];
            int r = mm_role_index(m->identity->role);
            if (r >= 0 && m->health == MMCTL__HEALTH__HEALTH_READY)
                up[r]++;
        }
    mm_ctl_msg_free(rep);
    missing[0] = 0;
    for (int r = 0; r < MM_N_ROLES; r++) {
        if (up[r])
            n_up++;
        else
            snprintf(missing + strlen(missing), n - strlen(missing), "%s%s", missing[0] ? " " : "",
                     mm_roles[r]);
    }
    return n_up;
}

static int run_up(int argc, char **argv) {
    mm_cli cli = {.prog = "moemesh up",
                  .summary = "Start the whole local mesh (router, gateway, attention shards, expert "
                             "owners, drafter) and supervise it in the foreground; Ctrl-C stops it.",
                  .opts = s_opts};
    char err[MM_ERRLEN] = "";
    int rc = 1;
    mm_ctl_client *cl = NULL;
    int sfd = -1;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "moemesh up: %s\n", err);
        mm_config_fini(&cli);
        return 2;
    }
    if (cli.help_shown) {
        mm_config_fini(&cli);
        return 0;
    }
    int level = mm_log_level_parse(s_log_level);
    if (level < 0 || s_owners < 1 || s_shards < 1 || s_heartbeat_ms < 10 || s_restart_max_ms < 250) {
        fprintf(stderr, "moemesh up: bad value: --log-level error|warn|info|debug, --owners >= 1, "
                        "--attention-shards >= 1, --heartbeat-ms >= 10, --restart-max-ms >= 250\n");
        mm_config_fini(&cli);
        return 2;
    }
    if (s_drafter && strcmp(s_drafter, "ngram") != 0) {
        char cfgp[PATH_MAX];
        snprintf(cfgp, sizeof(cfgp), "%s/config.json", s_drafter);
        if (access(cfgp, R_OK) != 0) {
            fprintf(stderr, "moemesh up: --drafter %s: no config.json there (a draft model "
                            "directory, or 'ngram')\n", s_drafter);
            mm_config_fini(&cli);
            return 2;
        }
    }
    mm_log_init("moemesh-up", (enum mm_log_level)level);
    // Block the signals before any thread exists (nng starts some), so that only the signalfd
    // ever sees them.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    mm_config_log(&cli);
    if (!s_router) { // owned by the option table from here, freed by mm_config_fini
        char buf[PATH_MAX + 16];
        snprintf(buf, sizeof(buf), "ipc://%s/router.ctl", s_run_dir);
        s_router = strdup(buf);
    }
    if (!s_model)
        mm_log_warn("no --model: the daemons start with model fingerprint 'none'");

    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) {
        mm_log_error("cannot find this binary: %s", strerror(errno));
        goto out;
    }
    exe[n] = 0;
    *strrchr(exe, '/') = 0;
    s_n_children = 0;
    if (add_child(exe, "router", 0, err) < 0 || add_child(exe, "gateway", 0, err) < 0)
        goto fail_err;
    for (int i = 0; i < s_shards; i++)
        if (add_child(exe, "attention", i, err) < 0)
            goto fail_err;
    for (int i = 0; i < s_owners; i++)
        if (add_child(exe, "expert", i, err) < 0)
            goto fail_err;
    if (add_child(exe, "drafter", 0, err) < 0)
        goto fail_err;
    if (mm_ctl_url_prepare(s_router, err) != MM_OK)
        goto fail_err;
    if (mm_ctl_client_open(&cl, s_router, err) != MM_OK)
        goto fail_err;
    char missing[128];
    if (roles_ready(cl, missing, sizeof(missing)) >= 0) {
        mm_log_error("a mesh is already running at %s (see `moemesh status --router %s`); stop "
                     "it or pick another --run-dir", s_router, s_router);
        goto out;
    }

    sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0) {
        mm_log_error("signalfd: %s", strerror(errno));
        goto out;
    }

    // Router first, and wait until it answers: the others then join at their first hello.
    bool fatal = false;
    int stop = 0;
    s_pgid = 0;
    if (spawn(&s_children[0]) != MM_OK) {
        mm_log_error("fork: %s", strerror(errno));
        goto out;
    }
    uint64_t deadline = mm_now_ms() + 10000;
    while (roles_ready(cl, missing, sizeof(missing)) < 0) {
        stop = drain_signals(sfd, false, &fatal);
        if (stop || fatal || s_children[0].pid == 0 || mm_now_ms() > deadline) {
            if (!stop) {
                mm_log_error("the router did not come up at %s", s_router);
                fatal = true;
            }
            goto shutdown;
        }
        poll(&(struct pollfd){.fd = sfd, .events = POLLIN}, 1, 50);
    }
    for (int i = 1; i < s_n_children; i++)
        if (spawn(&s_children[i]) != MM_OK) {
            mm_log_error("fork: %s", strerror(errno));
            fatal = true;
            goto shutdown;
        }

    bool announced = false, warned = false;
    uint64_t started = mm_now_ms();
    while (!stop && !fatal) {
        poll(&(struct pollfd){.fd = sfd, .events = POLLIN}, 1, 100);
        stop = drain_signals(sfd, false, &fatal);
        if (stop || fatal)
            break;
        uint64_t now = mm_now_ms();
        for (int i = 0; i < s_n_children; i++) {
            struct child *c = &s_children[i];
            if (c->pid == 0 && c->restart_at_ms && now >= c->restart_at_ms && spawn(c) != MM_OK)
                mm_log_error("fork %s/%d: %s", c->role, c->instance, strerror(errno));
        }
        if (!announced) {
            int k = roles_ready(cl, missing, sizeof(missing));
            if (k == MM_N_ROLES) {
                announced = true;
                mm_log_info("mesh up: %d daemons, every role ready; http://%s:%lld/health, "
                            "`moemesh status --router %s`", s_n_children, s_host, s_port, s_router);
                printf("moemesh: mesh up on http://%s:%lld (Ctrl-C stops it)\n", s_host, s_port);
                fflush(stdout);
            } else if (!warned && mm_now_ms() - started > (uint64_t)s_ready_timeout_ms) {
                warned = true;
                mm_log_warn("after %lld ms these roles are still not ready: %s", s_ready_timeout_ms,
                            missing);
            }
        }
    }

shutdown:
    if (stop)
        mm_log_info("received %s: stopping %d daemons", strsignal(stop), n_running());
    // Members first, so that their goodbyes reach the router; then the router.
    signal_all(SIGTERM, true);
    deadline = mm_now_ms() + 3000;
    while (n_running_members() > 0 && mm_now_ms() < deadline) {
        poll(&(struct pollfd){.fd = sfd, .events = POLLIN}, 1, 50);
        drain_signals(sfd, true, &fatal);
    }
    signal_all(SIGTERM, false);
    deadline = mm_now_ms() + 5000;
    while (n_running() > 0 && mm_now_ms() < deadline) {
        poll(&(struct pollfd){.fd = sfd, .events = POLLIN}, 1, 50);
        drain_signals(sfd, true, &fatal);
    }
    if (n_running() > 0) {
        mm_log_warn("%d daemons still running after 5 s: killing them", n_running());
        signal_all(SIGKILL, false);
        while (n_running() > 0) {
            int status;
            pid_t pid = waitpid(-1, &status, 0);
            if (pid < 0)
                break;
            struct child *c = find_pid(pid);
            if (c)
                c->pid = 0;
        }
    }
    rc = fatal ? 1 : 0;
    mm_log_info("mesh stopped");
    goto out;
fail_err:
    mm_log_error("%s", err);
out:
    mm_ctl_client_close(cl);
    if (sfd >= 0)
        close(sfd);
    for (int i = 0; i < s_n_children; i++)
        child_free(&s_children[i]);
    mm_config_fini(&cli);
    return rc;
}

MM_COMMAND(cmd_up, "up", "start the whole local mesh and supervise it in the foreground", run_up)
