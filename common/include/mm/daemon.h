// SPDX-License-Identifier: MIT
// The lifecycle every moemesh daemon shares: common flags, logging, identity, signals, the
// control link to the router (hello, heartbeat, goodbye) and the daemon's own control server.
//
// Design notes:
// - mm_daemon_open blocks SIGTERM/SIGINT/SIGHUP in the calling thread before any library thread
//   starts, so every thread inherits the mask and the signals arrive only through
//   mm_daemon_signal_fd (a signalfd). A daemon with an event loop polls that fd and
//   mm_daemon_event_fd; a daemon without one calls mm_daemon_wait.
// - The member link (every role but the router) runs on its own thread: Hello until Welcome
//   (a Refused ends the daemon with MM_EXIT_REFUSED), then a Heartbeat every --heartbeat-ms;
//   a HeartbeatAck asking to rejoin (the router restarted) goes back to Hello. Every call has
//   a deadline; an unreachable router is logged once and retried, never waited on forever.
// - Teardown: mm_daemon_close sends Goodbye (bounded), stops the thread, closes the sockets and
//   frees everything.
#ifndef MM_DAEMON_H
#define MM_DAEMON_H

#include <stdbool.h>

#include "mm/config.h"
#include "mm/ctl.h"
#include "mm/identity.h"

// Exit status of a daemon: 0 clean stop, 1 runtime error, 2 bad flags, 3 refused by the router.
enum { MM_EXIT_OK = 0, MM_EXIT_ERROR = 1, MM_EXIT_USAGE = 2, MM_EXIT_REFUSED = 3 };

// The flags every daemon takes (names fixed: deploy files are written from them).
typedef struct mm_daemon_conf {
    char *router;          // --router URL: the hub's control address
    char *listen;          // --listen URL: this daemon's control address
    char *data;            // --data URL: data-plane address (may be unset)
    char *model;           // --model DIR
    char *placement;       // --placement FILE (unset: uniform over --owners)
    char *device;          // --device cpu|cuda:N|hip:N
    char *log_level;       // --log-level error|warn|info|debug
    long long instance;    // --instance N
    long long owners;      // --owners N: expert owners in the mesh (uniform placement)
    long long heartbeat_ms; // --heartbeat-ms
} mm_daemon_conf;

typedef struct mm_daemon mm_daemon;

typedef struct mm_daemon_spec {
    const char *role;       // one of mm_roles
    const char *summary;    // one sentence for --help
    mm_opt *extra_opts;     // role flags (NULL-terminated table) or NULL; parsed with the rest
    mm_ctl_handler handler; // requests on --listen; NULL: the member default (status, drain,
                            // shutdown). The router passes its registry here.
    void *handler_arg;
    bool is_hub;            // the router: listens on --listen (default: --router), no member link
    // Role hooks for mm_daemon_main (optional). start runs after open and before the daemon
    // joins the mesh (load what the role holds, set health); stop runs after the wait ends.
    mm_err (*start)(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
    void (*stop)(mm_daemon *d, void *arg);
    void *role_arg;
} mm_daemon_spec;

// mm_daemon_member_handle is the member default handler (status, drain, shutdown; arg: the
// mm_daemon), for a role handler that serves more bodies and passes the rest on.
void mm_daemon_member_handle(void *arg, const mm_ctl_msg *req, const char *peer,
                             struct nng_msg **reply);

// mm_daemon_open parses argv (--help prints and sets *exit_code 0 with *out NULL), initialises
// logging, blocks the stop signals, computes the identity (fingerprints read --model and
// --placement) and logs the effective configuration. On error it prints the reason to stderr,
// sets *exit_code (MM_EXIT_USAGE or MM_EXIT_ERROR) and returns the error. *out is owned:
// mm_daemon_close it.
mm_err mm_daemon_open(mm_daemon **out, const mm_daemon_spec *spec, int argc, char **argv,
                      int *exit_code);

// mm_daemon_start opens the control server on --listen and, for members, starts the member
// link to --router. Errors: MM_ETRANSPORT / MM_EINVAL naming the address.
mm_err mm_daemon_start(mm_daemon *d, char err[MM_ERRLEN]);

// Accessors (borrowed, valid until mm_daemon_close).
const mm_daemon_conf *mm_daemon_get_conf(const mm_daemon *d);
const mm_identity *mm_daemon_get_identity(const mm_daemon *d);
const char *mm_daemon_role(const mm_daemon *d);

// mm_daemon_set_kv_capacity states the KV capacity (copied) that this daemon's Hello carries
// (an attention shard, from its role start hook). Call before mm_daemon_start (the identity is
// read by the member thread afterwards). Errors: MM_EINVAL when the member link already runs.
mm_err mm_daemon_set_kv_capacity(mm_daemon *d, const mm_kv_capacity *kv, char err[MM_ERRLEN]);

// mm_daemon_set_health sets what the next heartbeat reports (detail: short text, may be NULL).
// Thread-safe.
void mm_daemon_set_health(mm_daemon *d, Mmctl__Health health, const char *detail);

// File descriptors to poll for readability: stop signals, and events from the member link or
// the control server (refusal, shutdown request). When either is readable, call
// mm_daemon_poll_events, which returns true when the daemon should stop.
int mm_daemon_signal_fd(const mm_daemon *d);
int mm_daemon_event_fd(const mm_daemon *d);
bool mm_daemon_poll_events(mm_daemon *d);

// mm_daemon_request_stop asks the daemon to stop with exit status code. Thread-safe.
void mm_daemon_request_stop(mm_daemon *d, int code, const char *why);

// mm_daemon_wait blocks until a stop signal, a refusal or a shutdown request (for daemons with
// no event loop of their own) and returns. tick_ms > 0 calls tick(arg) that often (router
// sweeps); tick may be NULL.
void mm_daemon_wait(mm_daemon *d, int tick_ms, void (*tick)(void *arg), void *arg);

// mm_daemon_close says goodbye to the router (bounded by 500 ms), stops everything, frees the
// daemon and returns its exit status. It ends with nng_fini(): close every other nng socket
// first, and call it last, just before main returns. Accepts NULL (returns MM_EXIT_ERROR).
int mm_daemon_close(mm_daemon *d);

// mm_daemon_main is the whole life of a daemon with no event loop: open, start, wait, close.
// Returns the exit status for main().
int mm_daemon_main(const mm_daemon_spec *spec, int argc, char **argv);

#endif
