// SPDX-License-Identifier: MIT
// Shared daemon lifecycle; see mm/daemon.h.
#include <errno.h>
#include <nng/nng.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <time.h>
#include <unistd.h>

#include "mm/build.h"
#include "mm/daemon.h"
#include "mm/log.h"
#include "mm/time.h"

struct mm_daemon {
    mm_daemon_spec spec;
    mm_daemon_conf conf;
    mm_cli cli;
    mm_opt *opts;            // owned: common flags followed by spec->extra_opts
    char prog[48];           // "moemesh-<role>"
    mm_identity id;
    int sig_fd, ev_fd;
    atomic_int stop_code;    // -1 while running
    pthread_mutex_t mu;      // guards health, detail
    Mmctl__Health health;
    char detail[256];
    mm_ctl_server *srv;
    mm_ctl_client *client;
    pthread_t member;
    bool member_started;
    atomic_bool member_stop;
    atomic_bool joined;
    pthread_mutex_t wait_mu; // with wait_cv: the member thread's interruptible sleep
    pthread_cond_t wait_cv;
};

static const mm_opt common_opts[] = {
    {"router", MM_OPT_STR, NULL, MM_CTL_DEFAULT_ROUTER, "control address of the router (the hub)"},
    {"listen", MM_OPT_STR, NULL, NULL,
     "this daemon's control address (default: beside --router, <role>-<instance>.ctl)"},
    {"data", MM_OPT_STR, NULL, NULL, "data-plane address (shm://, tcp://, rdma://)"},
    {"model", MM_OPT_STR, NULL, NULL, "model directory (config.json + *.safetensors)"},
    {"placement", MM_OPT_STR, NULL, NULL, "placement JSON file (default: uniform over --owners)"},
    {"instance", MM_OPT_INT, NULL, "0", "instance number of this role"},
    {"owners", MM_OPT_INT, NULL, "1", "number of expert owners in the mesh"},
    {"device", MM_OPT_STR, NULL, "cpu", "compute device: cpu, cuda:N or hip:N (cpu-dev: the CPU "
     "with a GPU's device paths, for tests)"},
    {"log-level", MM_OPT_STR, NULL, "info", "error, warn, info or debug"},
    {"heartbeat-ms", MM_OPT_INT, NULL, "250", "interval between heartbeats to the router"},
    {0},
};

static void *common_dst(mm_daemon_conf *c, const char *name) {
    if (!strcmp(name, "router")) return &c->router;
    if (!strcmp(name, "listen")) return &c->listen;
    if (!strcmp(name, "data")) return &c->data;
    if (!strcmp(name, "model")) return &c->model;
    if (!strcmp(name, "placement")) return &c->placement;
    if (!strcmp(name, "instance")) return &c->instance;
    if (!strcmp(name, "owners")) return &c->owners;
    if (!strcmp(name, "device")) return &c->device;
    if (!strcmp(name, "log-level")) return &c->log_level;
    if (!strcmp(name, "heartbeat-ms")) return &c->heartbeat_ms;
    return NULL;
}

static mm_err check_device(const char *dev, char *err) {
    char *end = NULL;
    if (!strcmp(dev, "cpu") || !strcmp(dev, "cpu-dev"))
        return MM_OK;
    const char *num = !strncmp(dev, "cuda:", 5) ? dev + 5 : !strncmp(dev, "hip:", 4) ? dev + 4 : NULL;
    if (num && *num) {
        long v = strtol(num, &end, 10);
        if (*end == 0 && v >= 0 && v < 1024)
            return MM_OK;
    }
    return mm_errf(err, MM_EINVAL, "--device '%s': expected cpu, cpu-dev, cuda:N or hip:N", dev);
}

// The default --listen: an ipc socket beside the router's, named after role and instance.
static void default_listen(mm_daemon *d, char *buf, size_t n) {
    const char *r = d->conf.router;
    const char *slash = strrchr(r, '/');
    if (!strncmp(r, "ipc://", 6) && slash && slash > r + 6)
        snprintf(buf, n, "%.*s/%s-%lld.ctl", (int)(slash - r), r, d->spec.role, d->conf.instance);
    else
        snprintf(buf, n, "ipc:///tmp/moemesh/%s-%lld.ctl", d->spec.role, d->conf.instance);
}

static mm_err build_identity(mm_daemon *d, char *err) {
    mm_identity *id = &d->id;
    memset(id, 0, sizeof(*id));
    id->protocol_version = MM_CTL_PROTOCOL_VERSION;
    snprintf(id->build_id, sizeof(id->build_id), "%s", mm_build_id());
    MM_TRY(mm_identity_model_fingerprint(d->conf.model, id->model_fp, err));
    MM_TRY(mm_identity_placement_fingerprint(d->conf.placement, d->conf.owners, id->placement_fp,
                                             err));
    snprintf(id->role, sizeof(id->role), "%s", d->spec.role);
    id->instance = (uint32_t)d->conf.instance;
    snprintf(id->control_addr, sizeof(id->control_addr), "%s", d->conf.listen);
    snprintf(id->data_addr, sizeof(id->data_addr), "%s", d->conf.data ? d->conf.data : "");
    if (getrandom(&id->incarnation, sizeof(id->incarnation), 0) != sizeof(id->incarnation))
        id->incarnation = mm_now_ns() ^ ((uint64_t)getpid() << 32);
    id->pid = (uint32_t)getpid();
    if (gethostname(id->host, sizeof(id->host) - 1) != 0)
        snprintf(id->host, sizeof(id->host), "unknown");
    snprintf(id->device, sizeof(id->device), "%s", d->conf.device);
    id->heartbeat_ms = (uint32_t)d->conf.heartbeat_ms;
    mm_identity_numerics(d->conf.device, id->numerics, sizeof(id->numerics));
    return MM_OK;
}

static mm_err check_conf(mm_daemon *d, char *err) {
    mm_daemon_conf *c = &d->conf;
    if (mm_log_level_parse(c->log_level) < 0)
        return mm_errf(err, MM_EINVAL, "--log-level '%s': expected error, warn, info or debug",
                       c->log_level);
    MM_TRY(check_device(c->device, err));
    if (c->instance < 0 || c->instance > 65535)
        return mm_errf(err, MM_EINVAL, "--instance %lld: must be 0..65535", c->instance);
    if (c->owners < 1 || c->owners > 65535)
        return mm_errf(err, MM_EINVAL, "--owners %lld: must be 1..65535", c->owners);
    if (c->heartbeat_ms < 10 || c->heartbeat_ms > 60000)
        return mm_errf(err, MM_EINVAL, "--heartbeat-ms %lld: must be 10..60000", c->heartbeat_ms);
    if (!c->router || !*c->router)
        return mm_errf(err, MM_EINVAL, "--router: empty address");
    if (!c->listen || !*c->listen) {
        char buf[MM_ADDR_LEN];
        if (d->spec.is_hub)
            snprintf(buf, sizeof(buf), "%s", c->router);
        else
            default_listen(d, buf, sizeof(buf));
        free(c->listen);
        if (!(c->listen = strdup(buf)))
            return MM_ENOMEM;
    }
    if (strlen(c->listen) >= MM_ADDR_LEN || strlen(c->router) >= MM_ADDR_LEN ||
        (c->data && strlen(c->data) >= MM_ADDR_LEN))
        return mm_errf(err, MM_EINVAL, "an address is longer than %d bytes", MM_ADDR_LEN - 1);
    return MM_OK;
}

mm_err mm_daemon_open(mm_daemon **out, const mm_daemon_spec *spec, int argc, char **argv,
                      int *exit_code) {
    *out = NULL;
    *exit_code = MM_EXIT_ERROR;
    char err[MM_ERRLEN] = "";
    mm_err rv = MM_OK;
    mm_daemon *d = calloc(1, sizeof(*d));
    if (!d) {
        fprintf(stderr, "out of memory\n");
        return MM_ENOMEM;
    }
    d->spec = *spec;
    d->sig_fd = d->ev_fd = -1;
    atomic_init(&d->stop_code, -1);
    pthread_mutex_init(&d->mu, NULL);
    pthread_mutex_init(&d->wait_mu, NULL);
    pthread_cond_init(&d->wait_cv, NULL);
    d->health = MMCTL__HEALTH__HEALTH_STARTING;
    snprintf(d->prog, sizeof(d->prog), "moemesh-%s", spec->role);

    size_t n_common = sizeof(common_opts) / sizeof(common_opts[0]) - 1, n_extra = 0;
    while (spec->extra_opts && spec->extra_opts[n_extra].name)
        n_extra++;
    d->opts = calloc(n_common + n_extra + 1, sizeof(mm_opt));
    if (!d->opts) {
        rv = MM_ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < n_common; i++) {
        d->opts[i] = common_opts[i];
        d->opts[i].dst = common_dst(&d->conf, common_opts[i].name);
    }
    for (size_t i = 0; i < n_extra; i++)
        d->opts[n_common + i] = spec->extra_opts[i];
    d->cli = (mm_cli){.prog = d->prog, .summary = spec->summary, .opts = d->opts};
    if ((rv = mm_config_parse(&d->cli, argc, argv, err)) != MM_OK) {
        fprintf(stderr, "%s: %s\n", d->prog, err);
        *exit_code = MM_EXIT_USAGE;
        goto fail;
    }
    if (d->cli.help_shown) {
        *exit_code = MM_EXIT_OK;
        goto fail;
    }
    if (d->cli.n_args > 0) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", d->prog, d->cli.args[0]);
        rv = MM_EINVAL;
        *exit_code = MM_EXIT_USAGE;
        goto fail;
    }
    if ((rv = check_conf(d, err)) != MM_OK) {
        fprintf(stderr, "%s: %s\n", d->prog, err);
        *exit_code = MM_EXIT_USAGE;
        goto fail;
    }
    mm_log_init(d->prog, (enum mm_log_level)mm_log_level_parse(d->conf.log_level));

    // Stop signals arrive through a signalfd; block them before any library thread exists.
    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    d->sig_fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    d->ev_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (d->sig_fd < 0 || d->ev_fd < 0) {
        rv = MM_ESYS;
        mm_log_error("signalfd/eventfd: %s", strerror(errno));
        goto fail;
    }
    mm_log_info("starting %s, build %s", d->prog, mm_build_id());
    mm_config_log(&d->cli);
    if ((rv = build_identity(d, err)) != MM_OK) {
        mm_log_error("%s", err);
        goto fail;
    }
    mm_log_info("identity %s/%u: protocol %u, build %s, model %s, placement %s, control %s, "
                "data %s", d->id.role, d->id.instance, d->id.protocol_version, d->id.build_id,
                d->id.model_fp, d->id.placement_fp, d->id.control_addr,
                d->id.data_addr[0] ? d->id.data_addr : "(unset)");
    *out = d;
    *exit_code = MM_EXIT_OK;
    return MM_OK;
fail:
    d->stop_code = *exit_code;
    mm_daemon_close(d);
    return rv == MM_OK ? MM_ECANCELED : rv;
}

const mm_daemon_conf *mm_daemon_get_conf(const mm_daemon *d) { return &d->conf; }
const mm_identity *mm_daemon_get_identity(const mm_daemon *d) { return &d->id; }
const char *mm_daemon_role(const mm_daemon *d) { return d->spec.role; }
int mm_daemon_signal_fd(const mm_daemon *d) { return d->sig_fd; }
int mm_daemon_event_fd(const mm_daemon *d) { return d->ev_fd; }

mm_err mm_daemon_set_kv_capacity(mm_daemon *d, const mm_kv_capacity *kv, char err[MM_ERRLEN]) {
    if (d->member_started)
        return mm_errf(err, MM_EINVAL, "the KV capacity must be set before the daemon joins");
    d->id.kv = *kv;
    return MM_OK;
}

void mm_daemon_set_health(mm_daemon *d, Mmctl__Health health, const char *detail) {
    pthread_mutex_lock(&d->mu);
    d->health = health;
    if (detail)
        snprintf(d->detail, sizeof(d->detail), "%s", detail);
    pthread_mutex_unlock(&d->mu);
}

void mm_daemon_request_stop(mm_daemon *d, int code, const char *why) {
    int none = -1;
    if (atomic_compare_exchange_strong(&d->stop_code, &none, code)) {
        if (why)
            mm_log_info("stopping: %s", why);
        uint64_t one = 1;
        ssize_t w = write(d->ev_fd, &one, sizeof(one));
        (void)w;
    }
}

bool mm_daemon_poll_events(mm_daemon *d) {
    struct signalfd_siginfo si;
    while (read(d->sig_fd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        char why[64];
        snprintf(why, sizeof(why), "received %s", strsignal((int)si.ssi_signo));
        mm_daemon_request_stop(d, MM_EXIT_OK, why);
    }
    uint64_t v;
    while (read(d->ev_fd, &v, sizeof(v)) == (ssize_t)sizeof(v)) {
    }
    return atomic_load(&d->stop_code) >= 0;
}

void mm_daemon_wait(mm_daemon *d, int tick_ms, void (*tick)(void *arg), void *arg) {
    uint64_t next = mm_now_ms() + (uint64_t)(tick_ms > 0 ? tick_ms : 0);
    while (!mm_daemon_poll_events(d)) {
        struct pollfd p[2] = {{.fd = d->sig_fd, .events = POLLIN}, {.fd = d->ev_fd, .events = POLLIN}};
        int timeout = -1;
        if (tick_ms > 0) {
            uint64_t now = mm_now_ms();
            timeout = now >= next ? 0 : (int)(next - now);
        }
        poll(p, 2, timeout);
        if (tick_ms > 0 && mm_now_ms() >= next) {
            if (tick)
                tick(arg);
            next = mm_now_ms() + (uint64_t)tick_ms;
        }
    }
}

// ---- the member link -----------------------------------------------------------------------

static int call_timeout_ms(const mm_daemon *d) {
    long long t = d->conf.heartbeat_ms * 2;
    return (int)(t < 300 ? 300 : t > 2000 ? 2000 : t);
}

static void member_sleep(mm_daemon *d, long long ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts = mm_timespec_add_ms(ts, ms);
    pthread_mutex_lock(&d->wait_mu);
    while (!atomic_load(&d->member_stop))
        if (pthread_cond_timedwait(&d->wait_cv, &d->wait_mu, &ts) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&d->wait_mu);
}

// Returns false when the daemon must stop (refused).
static bool member_hello(mm_daemon *d, bool *warned) {
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    Mmctl__Hello hello = MMCTL__HELLO__INIT;
    Mmctl__Identity pid = MMCTL__IDENTITY__INIT;
    mm_ctl_identity_to_pb(&d->id, &pid);
    hello.identity = &pid;
    env.body_case = MMCTL__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_ctl_call(d->client, &env, call_timeout_ms(d), &rep, err);
    if (rv != MM_OK) {
        if (!*warned && !atomic_load(&d->member_stop))
            mm_log_warn("router at %s not answering (%s); retrying every %lld ms", d->conf.router,
                        err, d->conf.heartbeat_ms);
        *warned = true;
        return true;
    }
    bool keep = true;
    char me[40];
    mm_identity_name(&d->id, me, sizeof(me));
    switch (rep->body_case) {
    case MMCTL__ENVELOPE__BODY_WELCOME: {
        const Mmctl__Welcome *w = rep->welcome;
        atomic_store(&d->joined, true);
        *warned = false;
        mm_log_info("joined the mesh: router %s/%u at %s (build %s, down after %u ms)",
                    w->router->role, w->router->instance, d->conf.router, w->router->build_id,
                    w->down_after_ms);
        break;
    }
    case MMCTL__ENVELOPE__BODY_REFUSED: {
        const Mmctl__Refused *r = rep->refused;
        mm_log_error("refused by the router at %s: %s mismatch: router has %s, this daemon (%s) "
                     "has %s (%s)", d->conf.router, r->field, r->router_value, me,
                     r->daemon_value, r->reason);
        mm_daemon_request_stop(d, MM_EXIT_REFUSED, "refused by the router");
        keep = false;
        break;
    }
    case MMCTL__ENVELOPE__BODY_ACK:
        if (!rep->ack->ok) {
            mm_log_error("the router at %s rejected our hello: %s", d->conf.router, rep->ack->error);
            mm_daemon_request_stop(d, MM_EXIT_REFUSED, "hello rejected by the router");
            keep = false;
        }
        break;
    default:
        mm_log_warn("router at %s answered hello with %s; retrying", d->conf.router,
                    mm_ctl_body_name(rep));
    }
    mm_ctl_msg_free(rep);
    return keep;
}

static void member_heartbeat(mm_daemon *d, uint64_t seq, bool *warned) {
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    Mmctl__Heartbeat hb = MMCTL__HEARTBEAT__INIT;
    char detail[256];
    hb.role = d->id.role;
    hb.instance = d->id.instance;
    hb.incarnation = d->id.incarnation;
    hb.seq = seq;
    pthread_mutex_lock(&d->mu);
    hb.health = d->health;
    snprintf(detail, sizeof(detail), "%s", d->detail);
    pthread_mutex_unlock(&d->mu);
    hb.detail = detail;
    env.body_case = MMCTL__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    env.seq = seq;
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_ctl_call(d->client, &env, call_timeout_ms(d), &rep, err);
    if (rv != MM_OK) {
        if (!*warned && !atomic_load(&d->member_stop))
            mm_log_warn("heartbeat to the router at %s failed: %s (will keep trying)",
                        d->conf.router, err);
        *warned = true;
        return;
    }
    if (*warned)
        mm_log_info("the router at %s answers again", d->conf.router);
    *warned = false;
    if (rep->body_case != MMCTL__ENVELOPE__BODY_HEARTBEAT_ACK) {
        mm_log_warn("router answered a heartbeat with %s", mm_ctl_body_name(rep));
    } else {
        switch (rep->heartbeat_ack->action) {
        case MMCTL__HEARTBEAT_ACK__ACTION__ACTION_REJOIN:
            mm_log_info("the router does not know us (it restarted?): saying hello again");
            atomic_store(&d->joined, false);
            break;
        case MMCTL__HEARTBEAT_ACK__ACTION__ACTION_DRAIN:
            mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_DRAINING, NULL);
            break;
        case MMCTL__HEARTBEAT_ACK__ACTION__ACTION_SHUTDOWN:
            mm_daemon_request_stop(d, MM_EXIT_OK, "the router asked us to shut down");
            break;
        default:
            break;
        }
    }
    mm_ctl_msg_free(rep);
}

static void *member_main(void *arg) {
    mm_daemon *d = arg;
    bool warned = false;
    uint64_t seq = 0;
    while (!atomic_load(&d->member_stop)) {
        if (!atomic_load(&d->joined)) {
            if (!member_hello(d, &warned))
                break;
            if (atomic_load(&d->joined))
                continue; // first heartbeat right away: the router learns our health
        } else {
            member_heartbeat(d, ++seq, &warned);
        }
        member_sleep(d, d->conf.heartbeat_ms);
    }
    return NULL;
}

static void member_goodbye(mm_daemon *d) {
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    Mmctl__Goodbye bye = MMCTL__GOODBYE__INIT;
    bye.role = d->id.role;
    bye.instance = d->id.instance;
    bye.incarnation = d->id.incarnation;
    bye.reason = "stopping";
    env.body_case = MMCTL__ENVELOPE__BODY_GOODBYE;
    env.goodbye = &bye;
    char err[MM_ERRLEN] = "";
    if (mm_ctl_call(d->client, &env, 500, &rep, err) != MM_OK)
        mm_log_debug("goodbye to %s: %s", d->conf.router, err);
    mm_ctl_msg_free(rep);
}

// ---- the default control server of a member -----------------------------------------------

static void member_handle(void *arg, const mm_ctl_msg *req, const char *peer, nng_msg **reply) {
    mm_daemon *d = arg;
    switch (req->body_case) {
    case MMCTL__ENVELOPE__BODY_STATUS_REQUEST: {
        mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
        Mmctl__StatusReply sr = MMCTL__STATUS_REPLY__INIT;
        Mmctl__Identity pid = MMCTL__IDENTITY__INIT;
        Mmctl__Member m = MMCTL__MEMBER__INIT, *mp = &m;
        char detail[256];
        mm_ctl_identity_to_pb(&d->id, &pid);
        pthread_mutex_lock(&d->mu);
        m.health = d->health;
        snprintf(detail, sizeof(detail), "%s", d->detail);
        pthread_mutex_unlock(&d->mu);
        m.identity = &pid;
        m.detail = detail;
        sr.router = &pid;
        sr.n_members = 1;
        sr.members = &mp;
        env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REPLY;
        env.status_reply = &sr;
        env.seq = req->seq;
        *reply = mm_ctl_reply(&env);
        return;
    }
    case MMCTL__ENVELOPE__BODY_SHUTDOWN: {
        char why[MM_CTL_MAX_STR + 64];
        snprintf(why, sizeof(why), "shutdown requested by %s: %s", peer, req->shutdown->reason);
        mm_daemon_request_stop(d, MM_EXIT_OK, why);
        return;
    }
    case MMCTL__ENVELOPE__BODY_DRAIN:
        mm_log_info("drain requested by %s: %s", peer, req->drain->reason);
        mm_daemon_set_health(d, MMCTL__HEALTH__HEALTH_DRAINING, NULL);
        return;
    default: {
        char text[96];
        snprintf(text, sizeof(text), "%s does not serve %s", d->prog, mm_ctl_body_name(req));
        *reply = mm_ctl_reply_ack(false, text);
    }
    }
}

void mm_daemon_member_handle(void *arg, const mm_ctl_msg *req, const char *peer,
                             nng_msg **reply) {
    member_handle(arg, req, peer, reply);
}

mm_err mm_daemon_start(mm_daemon *d, char err[MM_ERRLEN]) {
    mm_ctl_handler fn = d->spec.handler ? d->spec.handler : member_handle;
    void *arg = d->spec.handler ? d->spec.handler_arg : d;
    MM_TRY(mm_ctl_server_open(&d->srv, d->conf.listen, d->spec.is_hub ? 8 : 2, fn, arg, err));
    mm_log_info("control server listening on %s", d->conf.listen);
    if (d->spec.is_hub)
        return MM_OK;
    MM_TRY(mm_ctl_client_open(&d->client, d->conf.router, err));
    if (pthread_create(&d->member, NULL, member_main, d) != 0)
        return mm_errf(err, MM_ESYS, "cannot start the member thread");
    d->member_started = true;
    return MM_OK;
}

int mm_daemon_close(mm_daemon *d) {
    if (!d)
        return MM_EXIT_ERROR;
    int code = atomic_load(&d->stop_code);
    if (code < 0)
        code = MM_EXIT_OK;
    if (d->member_started) {
        pthread_mutex_lock(&d->wait_mu);
        atomic_store(&d->member_stop, true);
        pthread_cond_broadcast(&d->wait_cv);
        pthread_mutex_unlock(&d->wait_mu);
        pthread_join(d->member, NULL);
        if (atomic_load(&d->joined))
            member_goodbye(d);
    }
    mm_ctl_client_close(d->client);
    mm_ctl_server_close(d->srv);
    if (d->sig_fd >= 0)
        close(d->sig_fd);
    if (d->ev_fd >= 0)
        close(d->ev_fd);
    if (d->opts && d->cli.opts) {
        mm_config_fini(&d->cli);
        if (code == MM_EXIT_OK && d->id.role[0])
            mm_log_info("stopped");
    }
    free(d->opts);
    pthread_mutex_destroy(&d->mu);
    pthread_mutex_destroy(&d->wait_mu);
    pthread_cond_destroy(&d->wait_cv);
    free(d);
    // The daemon's last act: joins nng's threads so leak checkers see a clean exit. Skipped when
    // a socket close was abandoned (mm_ctl_server_close): nng_fini would park on it too.
    if (!mm_ctl_close_abandoned())
        nng_fini();
    return code;
}

int mm_daemon_main(const mm_daemon_spec *spec, int argc, char **argv) {
    mm_daemon *d = NULL;
    int code = MM_EXIT_ERROR;
    if (mm_daemon_open(&d, spec, argc, argv, &code) != MM_OK)
        return code;
    char err[MM_ERRLEN] = "";
    bool role_started = false;
    if (spec->start && spec->start(d, spec->role_arg, err) != MM_OK) {
        mm_log_error("cannot start: %s", err);
        mm_daemon_request_stop(d, MM_EXIT_ERROR, NULL);
        return mm_daemon_close(d);
    }
    role_started = true;
    if (mm_daemon_start(d, err) != MM_OK) {
        mm_log_error("cannot start: %s", err);
        mm_daemon_request_stop(d, MM_EXIT_ERROR, NULL);
    } else {
        mm_daemon_wait(d, 0, NULL, NULL);
    }
    if (role_started && spec->stop)
        spec->stop(d, spec->role_arg);
    return mm_daemon_close(d);
}
