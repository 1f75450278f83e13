// SPDX-License-Identifier: MIT
// The control plane: protobuf-c envelopes (proto/ctl.proto) over nng REQ/REP sockets.
//
// Design notes:
// - Every decoded message is validated (wire version, a body present, required sub-messages,
//   string lengths, known roles) before anyone reads it; a peer's garbage gives MM_EPROTO and a
//   log line naming the peer, never a crash. Every socket has NNG_OPT_RECVMAXSZ set.
// - mm_ctl_server: a REP listener with a few nng contexts; the handler runs on nng threads,
//   possibly several at once, so it must be thread-safe.
// - mm_ctl_client: a REQ dialer that reconnects in the background. Every call has a deadline.
// - Threading: servers and clients are safe to use from any thread; close them from one.
#ifndef MM_CTL_H
#define MM_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mm/err.h"
#include "mm/identity.h"
#include "proto/ctl.pb-c.h"

#define MM_CTL_WIRE_VERSION 1      // Envelope.version
#define MM_CTL_PROTOCOL_VERSION 1  // Identity.protocol_version (part of the identity check)
#define MM_CTL_MAX_MSG_BYTES (1u << 20) // NNG_OPT_RECVMAXSZ of every control socket
#define MM_CTL_MAX_STR 1024        // longest string field accepted in a control message
#define MM_CTL_DEFAULT_ROUTER "ipc:///tmp/moemesh/router.ctl"

typedef Mmctl__Envelope mm_ctl_msg;

// ---- codec ---------------------------------------------------------------------------------

// mm_ctl_pack serialises env (borrowed; its version is set here) into a new nng message
// (*out, returns owned). Errors: MM_EINVAL (over MM_CTL_MAX_MSG_BYTES), MM_ENOMEM.
struct nng_msg;
mm_err mm_ctl_pack(mm_ctl_msg *env, struct nng_msg **out, char err[MM_ERRLEN]);

// mm_ctl_unpack decodes and validates n bytes (borrowed). *out is owned: mm_ctl_msg_free it.
// Errors: MM_EPROTO with the reason in err.
mm_err mm_ctl_unpack(const void *buf, size_t n, mm_ctl_msg **out, char err[MM_ERRLEN]);

// mm_ctl_validate checks a decoded envelope (see Design notes). Errors: MM_EPROTO.
mm_err mm_ctl_validate(const mm_ctl_msg *env, char err[MM_ERRLEN]);

// mm_ctl_msg_free frees an envelope from mm_ctl_unpack; accepts NULL.
void mm_ctl_msg_free(mm_ctl_msg *env);

// mm_ctl_body_name names env's body ("hello", "status_reply", ...), for logs.
const char *mm_ctl_body_name(const mm_ctl_msg *env);

// mm_ctl_identity_to_pb fills pb with pointers borrowed from id (valid while id lives).
void mm_ctl_identity_to_pb(const mm_identity *id, Mmctl__Identity *pb);
// mm_ctl_identity_from_pb copies a validated pb identity into id.
void mm_ctl_identity_from_pb(const Mmctl__Identity *pb, mm_identity *id);

// mm_ctl_health_name: "starting", "ready", "draining", "down", "unknown".
const char *mm_ctl_health_name(Mmctl__Health h);

// ---- server (REP) --------------------------------------------------------------------------

typedef struct mm_ctl_server mm_ctl_server;

// mm_ctl_handler answers one validated request. peer names the sender for logs ("ipc pid 42",
// "tcp 10.0.0.5:5123"). It returns the reply in *reply (owned by the server after return; leave
// NULL to send a generic Ack{ok}). Runs on an nng thread; several may run at once.
typedef void (*mm_ctl_handler)(void *arg, const mm_ctl_msg *req, const char *peer,
                               struct nng_msg **reply);

// mm_ctl_server_open listens on url (creating the directory of an ipc:// path) and serves with
// n_ctx concurrent contexts. Errors: MM_EINVAL (bad URL), MM_ETRANSPORT (address in use, ...),
// MM_ENOMEM. The handler may run before this returns.
mm_err mm_ctl_server_open(mm_ctl_server **out, const char *url, int n_ctx, mm_ctl_handler fn,
                          void *arg, char err[MM_ERRLEN]);
// mm_ctl_server_close stops every context (waiting for running handlers, at most 2 s: past
// that, an nng 1.5.2 close race is assumed and the socket is left to the process exit), closes the socket
// and frees the server. Accepts NULL. Must not be called from a handler.
void mm_ctl_server_close(mm_ctl_server *srv);
// mm_ctl_close_abandoned: has some mm_ctl_server_close given up on its socket in this process?
// Then nng_fini() would park too, so the process should exit without it. Thread-safe.
bool mm_ctl_close_abandoned(void);

// mm_ctl_reply_ack builds an Ack reply (ok, or an error text) for a handler.
struct nng_msg *mm_ctl_reply_ack(bool ok, const char *error);
// mm_ctl_reply packs env as a handler's reply; returns NULL (and logs) when packing fails.
struct nng_msg *mm_ctl_reply(mm_ctl_msg *env);

// ---- client (REQ) --------------------------------------------------------------------------

typedef struct mm_ctl_client mm_ctl_client;

// mm_ctl_client_open dials url without waiting: the connection is made, and remade after a
// peer restart, in the background. Errors: MM_EINVAL (bad URL), MM_ETRANSPORT, MM_ENOMEM.
mm_err mm_ctl_client_open(mm_ctl_client **out, const char *url, char err[MM_ERRLEN]);
// mm_ctl_client_abort closes the socket so that calls in progress on other threads return
// MM_ECLOSED at once; the client must still be freed with mm_ctl_client_close.
void mm_ctl_client_abort(mm_ctl_client *c);
// mm_ctl_client_close closes and frees; accepts NULL. No call may be in progress.
void mm_ctl_client_close(mm_ctl_client *c);
const char *mm_ctl_client_url(const mm_ctl_client *c);

// mm_ctl_call sends req (borrowed) and waits at most timeout_ms in all for the reply, which is
// validated and returned in *reply (owned: mm_ctl_msg_free). Blocks; thread-safe (each call
// has its own nng context). Errors: MM_ETIMEDOUT (no peer or no answer in time), MM_ECLOSED,
// MM_EPROTO (bad reply), MM_ETRANSPORT.
mm_err mm_ctl_call(mm_ctl_client *c, mm_ctl_msg *req, int timeout_ms, mm_ctl_msg **reply,
                   char err[MM_ERRLEN]);

// Asynchronous call, for daemons with an event loop. mm_ctl_call_start returns MM_OK and then
// cb runs exactly once, on an nng thread, never inside mm_ctl_call_start; or it returns an
// error and cb never runs. After cb (not inside it), the owner reads the outcome with
// mm_ctl_async_result and frees the call with mm_ctl_async_free, from any thread. cb may be
// NULL: the owner then learns of the outcome with mm_ctl_async_wait (send now, collect later).
// timeout_ms bounds the whole call: by then it has ended, with a reply or MM_ETIMEDOUT.
typedef struct mm_ctl_async mm_ctl_async;
typedef void (*mm_ctl_async_cb)(mm_ctl_async *call, void *arg);
mm_err mm_ctl_call_start(mm_ctl_client *c, mm_ctl_msg *req, int timeout_ms, mm_ctl_async_cb cb,
                         void *arg, mm_ctl_async **out, char err[MM_ERRLEN]);
// mm_ctl_async_result returns the call's outcome; on MM_OK *reply is owned by the caller.
mm_err mm_ctl_async_result(mm_ctl_async *call, mm_ctl_msg **reply, char err[MM_ERRLEN]);
// mm_ctl_async_wait waits at most timeout_ms (0: does not wait) for the call to end and says
// whether it has (then mm_ctl_async_result may be read). Blocks up to timeout_ms; thread-safe.
bool mm_ctl_async_wait(mm_ctl_async *call, int timeout_ms);
// mm_ctl_async_free accepts NULL; must not be called from the call's own callback. A call not
// ended yet is cancelled (abandoned): its reply, if one still comes, is dropped with its nng
// context and can never be taken for the reply of another call.
void mm_ctl_async_free(mm_ctl_async *call);

// mm_ctl_url_prepare creates the parent directory of an ipc:// path (mode 0755). Errors:
// MM_EINVAL (path too long for a unix socket), MM_ESYS.
mm_err mm_ctl_url_prepare(const char *url, char err[MM_ERRLEN]);

#endif
