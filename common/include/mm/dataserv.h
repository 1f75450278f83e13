// SPDX-License-Identifier: MIT
// The serving side of the data plane for attention shards and expert owners: one thread that
// listens on --data, accepts the router's connection, and hands every frame to the role's
// handler, which answers on the same conn. When the conn fails (router gone, protocol error,
// the router closing it after a failed step) it is closed and the thread accepts again.
//
// Design notes: one conn at a time (the router is the only client); frames go into one buffer
// sized at start (no allocation per frame). The handler runs on the server thread only, so role
// state needs no lock; tick runs there too, at least every tick_ms while idle.
#ifndef MM_DATASERV_H
#define MM_DATASERV_H

#include <stdbool.h>
#include <stddef.h>

#include "mm/transport.h"

typedef struct mm_dataserv mm_dataserv;

// mm_dataserv_fn handles one frame (hdr and payload borrowed for the call; payload is
// writable scratch the handler may compute in). Returning an error closes the conn (use it
// only for protocol violations; request failures are answered with MM_WIRE_ERROR frames).
typedef mm_err (*mm_dataserv_fn)(void *arg, mm_conn *c, const mm_wire_hdr *hdr, void *payload);
// mm_dataserv_tick runs between frames (periodic work such as load exports).
typedef void (*mm_dataserv_tick)(void *arg);

// mm_dataserv_start listens on url and starts the thread. payload_cap: the largest payload
// accepted (bigger frames are answered with an MM_WIRE_ERROR naming the limit). Returns owned
// *out (mm_dataserv_stop). Errors: those of mm_transport_listen, MM_ENOMEM, MM_ESYS.
mm_err mm_dataserv_start(mm_dataserv **out, const char *url, size_t payload_cap,
                         mm_dataserv_fn fn, mm_dataserv_tick tick, int tick_ms, void *arg,
                         char err[MM_ERRLEN]);
// mm_dataserv_start_dev is mm_dataserv_start for a role on a GPU: on conns that carry device
// frames (cudaipc://, mm_conn_dev) a frame's rows are received into d_buf (the role's device
// buffer, d_cap bytes; borrowed for the server's life, written by copies on the stream declared
// with mm_transport_gpu_use) and the handler gets payload == d_buf; host frames still arrive in
// the host buffer. A device frame of any kind but MM_WIRE_ROWS is answered with an MM_EPROTO
// error frame and never handed over (handlers read other kinds on the host). d_buf NULL: as
// mm_dataserv_start.
mm_err mm_dataserv_start_dev(mm_dataserv **out, const char *url, size_t payload_cap, void *d_buf,
                             size_t d_cap, mm_dataserv_fn fn, mm_dataserv_tick tick, int tick_ms,
                             void *arg, char err[MM_ERRLEN]);
// mm_dataserv_start_view is mm_dataserv_start_dev without the copy of device frames: on conns
// that carry them the handler gets payload pointing at the rows in the conn's device ring
// (mm_conn_recv_view), device memory that work the handler enqueues on the declared stream may
// read and write (the ring bytes go back to the router at the server's next receive, ordered
// after that work). Host frames still arrive in the host buffer; mm_dataserv_on_dev tells the
// two apart.
mm_err mm_dataserv_start_view(mm_dataserv **out, const char *url, size_t payload_cap,
                              mm_dataserv_fn fn, mm_dataserv_tick tick, int tick_ms, void *arg,
                              char err[MM_ERRLEN]);
// mm_dataserv_on_dev: whether the handler's payload is a device frame's rows (a view of
// mm_dataserv_start_view); call it from the handler only (the server thread's state).
bool mm_dataserv_on_dev(const void *payload);

// mm_dataserv_stop stops the thread (bounded by its 100 ms recv poll; an idle accept is woken
// by mm_listener_shutdown), closes everything and frees.
// Accepts NULL.
void mm_dataserv_stop(mm_dataserv *s);

// mm_dataserv_reply_error answers a request frame with MM_WIRE_ERROR (aux = code) carrying msg.
// Returns the send's result.
mm_err mm_dataserv_reply_error(mm_conn *c, const mm_wire_hdr *req, mm_err code,
                               const char *msg);

#endif
