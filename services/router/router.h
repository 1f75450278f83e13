// SPDX-License-Identifier: MIT
// The router's member registry: who is in the mesh, with what identity, and whether it is up.
// It answers Hello (identity check), Heartbeat, Goodbye and StatusRequest on the router's
// control address, and a sweep marks silent members down.
//
// Design notes: one mutex guards the table; handlers run on nng threads (several at once) and
// the sweep on the main thread. The table is sized once (MM_REGISTRY_MAX_MEMBERS). A member is
// keyed by role and instance; its incarnation (random per process start) tells a restart from a
// retry, and a heartbeat from an unknown incarnation is told to say hello again.
#ifndef MM_ROUTER_H
#define MM_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "mm/ctl.h"
#include "mm/identity.h"

#define MM_REGISTRY_MAX_MEMBERS 1024

typedef struct mm_registry mm_registry;

// mm_registry_new allocates an empty registry (returns owned: mm_registry_free).
mm_err mm_registry_new(mm_registry **out);
void mm_registry_free(mm_registry *r);

// mm_registry_set_self records the router's own identity (copied) and timing. Call before the
// control server starts.
void mm_registry_set_self(mm_registry *r, const mm_identity *self, uint32_t heartbeat_ms,
                          uint32_t down_after_ms);

// mm_registry_handle is the router's mm_ctl_handler (arg: the registry).
void mm_registry_handle(void *arg, const mm_ctl_msg *req, const char *peer,
                        struct nng_msg **reply);

// mm_registry_peer reports whether member role/instance is up, with its --data URL and
// incarnation (copied; "" and 0 when it never joined). The step engine redials a peer whose
// incarnation changed. Thread-safe.
bool mm_registry_peer(mm_registry *r, const char *role, uint32_t instance,
                      char data_addr[MM_ADDR_LEN], uint64_t *incarnation);

// mm_registry_peer_ctl: like mm_registry_peer, with the member's control (--listen) address;
// up only when the member reports READY (the drafter: drafting available).
bool mm_registry_peer_ctl(mm_registry *r, const char *role, uint32_t instance,
                          char control_addr[MM_ADDR_LEN], uint64_t *incarnation);

// mm_registry_set_limits records the step limits StatusReply reports (thread-safe).
void mm_registry_set_limits(mm_registry *r, uint32_t max_step_seqs, uint32_t max_batch_tokens,
                            uint32_t shards);

// mm_registry_set_self_detail sets the router's own status detail (copied; thread-safe).
void mm_registry_set_self_detail(mm_registry *r, const char *detail);

// mm_registry_set_detail_hook: fn(arg) runs before each status answer, outside the registry's
// lock, so that the owner of the detail can publish what it deferred (it may call
// mm_registry_set_self_detail; it must not block on a step). Set before the server starts.
void mm_registry_set_detail_hook(mm_registry *r, void (*fn)(void *arg), void *arg);

// mm_registry_sweep marks members silent for longer than down_after_ms down (arg: registry).
void mm_registry_sweep(void *arg);

#endif
