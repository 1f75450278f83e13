// SPDX-License-Identifier: MIT
// Data-plane transports: point-to-point, reliable, ordered frame connections chosen by URL
// scheme from one static table (common/transport/transport.c). A frame is a mm_wire_hdr
// (mm/wire.h) plus its payload. shm:// (same box, shared-memory rings; rows device to device
// between GPU processes, see "device payloads"), cudaipc:// (the explicit GPU form), tcp:// and
// rdma:// exist, one file plus one table entry each.
//
// Design notes:
// - Blocking calls with deadlines, no callbacks: a mesh step is synchronous (send the rows
//   to every owner, then gather a reply from each before a deadline). Every call that can
//   wait takes an absolute deadline_ns on CLOCK_MONOTONIC (mm_now_ns() + budget; see
//   mm_deadline_in_ms) and returns MM_ETIMEDOUT when it passes. MM_DEADLINE_NONE waits
//   forever and is meant for tests and tools only.
// - No allocation per message: mm_conn_recv writes the payload into memory the caller sized
//   at start; senders pass their own buffers, which the transport only reads.
// - Errors on a connection are sticky: once a conn fails (peer died, protocol violation, a
//   deadline expiring in the middle of a frame, mm_conn_shutdown) every op in flight on it
//   returns an error promptly and so does every later op. The cure is mm_conn_close and a
//   new dial/accept. A deadline expiring before any byte of a frame moved is harmless: the
//   conn stays usable.
// - Peer death is detected by the OS (a socket closing when the process dies), so a dead
//   peer gives MM_EPEERDOWN within milliseconds, not at the deadline. An orderly mm_conn_close
//   on the other side gives MM_ECLOSED (frames sent before the close are delivered first).
//   A peer that is alive but silent is only caught by the deadline (MM_ETIMEDOUT). Like a
//   socket write, a send to a peer that just died may still succeed (the frame lands in the
//   ring or socket buffer); the recv of its reply reports MM_EPEERDOWN.
// - Waiting: a blocked call spins for MM_TRANSPORT_SPIN_US (env, default 50 us; pause for
//   5 us, then sched_yield so that a peer sharing the CPU can run), then sleeps in poll() on
//   eventfds/sockets: an idle receiver costs no CPU. On boxes with dedicated cores a longer
//   spin (200-500 us) gives the lowest latency; MM_TRANSPORT_SPIN_US=0 never spins
//   (docs/BENCHMARKS.md has figures for each).
// - Waiting on several connections: mm_conn_wait_any (spins briefly, then sleeps in poll()
//   on every conn's wake fds). Gather pattern, in the caller:
//       pending = all conns;
//       while (pending) { mm_conn_wait_any(pending, n, deadline, &i);
//                         mm_conn_recv(pending[i], ...); remove i from pending; }
// - Threading: listeners and conns are not movable between processes (fork gives the child
//   copies it must not use: it may only mm_conn_close them, see mm_conn_close). Within a
//   process, per conn: at most one thread in send calls and at most one thread in recv /
//   wait_any calls at a time (full duplex); mm_conn_shutdown from any thread at any time.
//
// Typical use (router side; an expert owner is the mirror image: accept, then loop recv ->
// compute -> send REPLY with the same step_id/layer/row_base):
//     mm_conn *owner[N];                          // dialed once at start, e.g.
//     mm_transport_dial(&owner[i], "shm://expert-3", mm_deadline_in_ms(5000), err);
//     // per layer of a step:
//     uint64_t dl = mm_deadline_in_ms(2000);
//     for (i...) { mm_wire_hdr h;
//                  mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, step, layer, n_rows[i],
//                                   d_model);
//                  h.row_base = first_row[i]; h.aux = expert_id[i];
//                  mm_conn_send(owner[i], &h, rows[i], dl); }
//     for (k = 0; k < N; k++) { mm_conn_wait_any(pending, n_pending, dl, &j);
//                  mm_conn_recv(pending[j], &h, reply_buf, reply_cap, dl);
//                  check h.kind == MM_WIRE_REPLY, h.step_id == step, h.layer == layer,
//                  then place rows by h.row_base (canonical order, never arrival order);
//                  remove j from pending; }
//   Any error: fail the step's requests, mm_conn_close the conn, re-dial when the control
//   plane says the peer is back. A step that timed out leaves its late replies in the
//   stream: they carry the old step_id, so either drop frames with step_id < step or (simpler)
//   close the conn and re-dial; never pair replies by their position in the stream.
//
// err arguments: optional caller buffers (MM_ERRLEN bytes, may be NULL) that receive a
// one-line description of a failure naming the URL and the OS error; untouched on success.
//
// Error codes used here (mm/err.h): MM_ETIMEDOUT deadline passed; MM_EPEERDOWN peer vanished
// (process died, connection reset); MM_ECLOSED orderly close by the peer or by
// mm_conn_shutdown here; MM_EPROTO frame failed mm_wire_hdr_check or a handshake was not ours;
// MM_EFULL a received payload larger than the caller's buffer (frame discarded, conn usable);
// MM_EINVAL bad URL or argument; MM_ENOENT no transport for a scheme; MM_ESYS / MM_ETRANSPORT
// OS failures (the errno text goes into err or the log).
#ifndef MM_TRANSPORT_H
#define MM_TRANSPORT_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "mm/err.h"
#include "mm/time.h"
#include "mm/wire.h"

#define MM_DEADLINE_NONE UINT64_MAX

// mm_deadline_in_ms returns the absolute deadline ms milliseconds from now.
static inline uint64_t mm_deadline_in_ms(uint64_t ms) { return mm_now_ns() + ms * 1000000ull; }

// ---- URLs -----------------------------------------------------------------------------------

#define MM_URL_MAX 256

// A parsed data-plane URL: scheme://host[:port][?key=value&...].
//   shm://NAME[?ring_kb=N]     NAME: [A-Za-z0-9._-]{1,100}, a same-box rendezvous name
//     (also ?gpu=0: no device frames; ?ring_mb=M: device ring size; see "device payloads")
//   cudaipc://NAME[?ring_kb=N&ring_mb=M]  explicit device frames between GPU processes
//   tcp://HOST:PORT            HOST: IPv4 literal, [IPv6] literal or a resolvable name
typedef struct mm_url {
    char text[MM_URL_MAX];   // the URL as given
    char scheme[16];         // "shm", "tcp", ...
    char host[MM_URL_MAX];   // shm: NAME; tcp: host (without brackets)
    int port;                // 0..65535; -1 when the URL has none
    char query[MM_URL_MAX];  // text after '?', "" when none
} mm_url;

// mm_url_parse fills *out from s. Pure; thread-safe. Errors: MM_EINVAL naming what is wrong.
mm_err mm_url_parse(mm_url *out, const char *s, char err[MM_ERRLEN]);

// mm_url_query_u64 finds key=value in url->query. Returns MM_OK and *out, MM_ENOENT when the
// key is absent, MM_EINVAL when the value is not a number. Pure; thread-safe.
mm_err mm_url_query_u64(const mm_url *url, const char *key, uint64_t *out);

// ---- objects --------------------------------------------------------------------------------

typedef struct mm_listener mm_listener; // accepts conns on one URL
typedef struct mm_conn mm_conn;         // one connected peer, full duplex
typedef struct mm_mem_reg mm_mem_reg;   // a registered memory region (transports that need it)

// mm_transport_listen opens a listener on url (binds; for tcp:// use a loopback or explicit
// address). Returns owned *out (release with mm_listener_close). Does not block. Errors:
// MM_ENOENT unknown scheme (err lists the known ones), MM_EINVAL bad URL, MM_EBUSY address in
// use, MM_ESYS. Thread-safe.
mm_err mm_transport_listen(mm_listener **out, const char *url, char err[MM_ERRLEN]);

// mm_listener_accept waits until a peer dials, completes the handshake (bounded by deadline_ns,
// but a peer that dialed before it gets at least 1 s on shm://) and returns an owned conn in *out (release with mm_conn_close). A peer that
// connects but fails the handshake is dropped and reported as MM_EPROTO (the listener stays
// usable). Errors: MM_ETIMEDOUT, MM_EPROTO, MM_ECLOSED (mm_listener_shutdown), MM_ESYS.
// One thread at a time per listener.
mm_err mm_listener_accept(mm_listener *l, mm_conn **out, uint64_t deadline_ns,
                          char err[MM_ERRLEN]);

// mm_listener_shutdown makes a blocked and every later accept return MM_ECLOSED. Safe from
// any thread at any time; idempotent; never blocks.
void mm_listener_shutdown(mm_listener *l);

// mm_listener_close frees l and releases its address; accepts NULL. Conns already accepted
// live on. Must not race with an accept in another thread (call mm_listener_shutdown first).
void mm_listener_close(mm_listener *l);

// mm_transport_dial connects to url and completes the handshake. While the listener is not
// there yet (connection refused, no such name) it retries every few ms until deadline_ns, so
// daemons may start in any order. Returns owned *out (mm_conn_close). Errors: MM_ETIMEDOUT,
// MM_ENOENT unknown scheme, MM_EINVAL bad URL, MM_EPROTO the peer is not a moemesh endpoint
// of this wire version, MM_ESYS. Thread-safe.
mm_err mm_transport_dial(mm_conn **out, const char *url, uint64_t deadline_ns,
                         char err[MM_ERRLEN]);

// mm_conn_send sends one frame: hdr (filled by mm_wire_hdr_init; the caller's copy is only
// read, the transport stamps magic/version/conn_seq/hdr_check on its own copy) then
// hdr->payload_bytes bytes from payload (borrowed for the call; may be NULL when 0 bytes).
// Blocks until the whole frame is handed to the transport (shm: in the ring; tcp: in the
// socket buffer), i.e. payload may be reused on return; not until the peer has read it.
// Errors: MM_EINVAL (reserved kind, header inconsistent with mm_wire_payload_bytes),
// MM_ETIMEDOUT (before any byte went: conn still usable; mid-frame: conn broken),
// MM_EPEERDOWN, MM_ECLOSED, MM_ETRANSPORT. One sending thread per conn.
mm_err mm_conn_send(mm_conn *c, const mm_wire_hdr *hdr, const void *payload,
                    uint64_t deadline_ns);

// mm_conn_sendv is mm_conn_send with the payload gathered from iov[0..n_iov) (borrowed), whose
// lengths must add up to hdr->payload_bytes (else MM_EINVAL). Lets the router send rows that
// are not contiguous without copying them together first.
mm_err mm_conn_sendv(mm_conn *c, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                     uint64_t deadline_ns);

// mm_conn_recv waits for the next frame, validates its header (mm_wire_hdr_check), writes the
// header to *hdr and its payload to buf (caller-owned, cap bytes). Frames arrive in the order
// they were sent. Errors: MM_ETIMEDOUT (no frame began before deadline_ns: conn usable; a
// frame began but did not finish: conn broken, later ops return MM_ETRANSPORT), MM_EFULL (payload_bytes > cap: *hdr is
// filled, the payload discarded, the conn stays usable), MM_EPROTO (garbage header: conn
// broken), MM_EPEERDOWN, MM_ECLOSED (peer closed in order, or mm_conn_shutdown here).
// One receiving thread per conn.
mm_err mm_conn_recv(mm_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap, uint64_t deadline_ns);

#define MM_CONN_WAIT_MAX 256 // most conns one mm_conn_wait_any call may watch

// mm_conn_wait_any waits until one of conns[0..n) is "ready": its next mm_conn_recv will not
// wait (a frame has begun arriving, or the conn has failed, so recv returns the error at
// once). Writes the index to *ready. Conns may mix schemes. Idle waiting costs no CPU after a
// short spin. Errors: MM_ETIMEDOUT, MM_EINVAL (n == 0, n > MM_CONN_WAIT_MAX or a NULL entry). The calling thread
// counts as the receiving thread of every conn in the set.
mm_err mm_conn_wait_any(mm_conn *const *conns, size_t n, uint64_t deadline_ns, size_t *ready);

// mm_conn_shutdown fails the conn: blocked and later ops here return MM_ECLOSED, and the peer
// sees MM_ECLOSED after the frames already sent. Does not free. Safe from any thread at any
// time; idempotent; never blocks.
void mm_conn_shutdown(mm_conn *c);

// mm_conn_close shuts c down (as mm_conn_shutdown) and frees it; accepts NULL. No other thread
// may be using c. In a forked child, closing the parent's conns is allowed and does not
// disturb the parent's connection beyond dropping the child's copy of the descriptors.
void mm_conn_close(mm_conn *c);

// mm_conn_error returns the sticky error of c (MM_OK while healthy). Thread-safe.
mm_err mm_conn_error(const mm_conn *c);

// mm_conn_url returns the URL c was dialed to or accepted on (borrowed, lives as long as c).
const char *mm_conn_url(const mm_conn *c);

// mm_conn_reg_mem registers [p, p+n_bytes) with c's transport so that frames sent from or
// received into it can move without staging (RDMA, GPU peer copies). Register once at start,
// never per message. Returns owned *out (mm_conn_dereg_mem), or *out = NULL with MM_OK on
// transports that need no registration (shm, tcp). Errors: MM_ENOMEM, MM_EDEVICE,
// MM_ETRANSPORT. Not on the hot path; thread-safe against send/recv on the same conn.
mm_err mm_conn_reg_mem(mm_conn *c, void *p, size_t n_bytes, mm_mem_reg **out,
                       char err[MM_ERRLEN]);
// mm_conn_dereg_mem releases a registration; accepts NULL.
void mm_conn_dereg_mem(mm_conn *c, mm_mem_reg *reg);

// ---- device payloads (shm:// between GPU processes, cudaipc://) ------------------------------
// Between two processes of one host that both declared a GPU (mm_transport_gpu_use), shm:// conns
// carry device frames as well (selected automatically at the handshake; ?gpu=0 in the URL turns
// it off, for both ends, since they use the same URL). cudaipc://NAME[?ring_mb=N] is the explicit
// form (its own rendezvous name; refused without GPU support). The device path: the sender
// copies a frame's rows straight from its device memory into a ring of device memory (ring_mb,
// default 64 MiB per direction) that the
// receiver exported (CUDA/HIP IPC), on its own stream, and records an interprocess event; the
// receiver's stream waits for that event and copies the rows out into its device buffers. No
// host copy and no stream drain on either side. Where either end has no GPU the conn carries
// host frames only (mm_conn_dev false). A build without GPU support has plain shm:// and
// refuses cudaipc:// URLs with MM_EUNSUPP ("this build has no GPU support").

// mm_transport_gpu_use declares, once per process and before dialing or listening on cudaipc://,
// the device and the stream (cudaStream_t/hipStream_t, e.g. mm_gpu_backend_stream's) that
// device frames are copied on; their copies are ordered with the caller's work on that stream.
// Errors: MM_EUNSUPP (no GPU support in this build), MM_EINVAL.
mm_err mm_transport_gpu_use(int dev, void *stream, char err[MM_ERRLEN]);

// mm_transport_gpu_use_backend: mm_transport_gpu_use with the device and stream of a GPU
// backend (backend_ctx: mm_backend.ctx of a "cuda:N"/"hip:N" backend), so that device frames are
// ordered with the backend's ops. max_frame_bytes: the largest frame this process will receive;
// its device rings hold at least two (more than ring_mb when needed, up to 4 GiB). Errors:
// MM_EUNSUPP without GPU support, MM_EINVAL.
mm_err mm_transport_gpu_use_backend(void *backend_ctx, size_t max_frame_bytes,
                                    char err[MM_ERRLEN]);

// mm_conn_dev: true when c can carry device frames (cudaipc:// with a GPU on both ends).
bool mm_conn_dev(const mm_conn *c);

// mm_conn_sendv_dev sends one frame whose payload is gathered from device memory d_iov[0..n)
// (borrowed; lengths add up to hdr->payload_bytes). The copies are enqueued on the declared
// stream after the work already there, and the call returns once the frame is announced: the
// caller may overwrite the sources with work enqueued later on the same stream. Errors: as
// mm_conn_sendv; MM_EUNSUPP when !mm_conn_dev(c); MM_EINVAL for a frame larger than the
// receiver's ring (ring_mb); MM_EDEVICE.
mm_err mm_conn_sendv_dev(mm_conn *c, const mm_wire_hdr *hdr, const struct iovec *d_iov,
                         int n_iov, uint64_t deadline_ns);

// mm_conn_reserve_dev: the place of c's next device frame of n_bytes in the receiver's device
// ring, for work on the declared stream to write the payload there directly (no copy at the
// send): waits, up to deadline_ns, for the ring space to be given back, orders the stream after
// the receiver's reads of it, and sets *d_out (256-byte aligned). The next mm_conn_sendv_dev on
// c whose one segment is exactly [*d_out, n_bytes) and whose payload is n_bytes sends the frame
// from there without a copy; any other send or a new reservation leaves it unused (its bytes
// are simply not announced: the next frame may take the same place, written later in stream
// order, and the receiver never reads them). Errors:
// MM_EUNSUPP (no device frames, or a transport without reservations), MM_EINVAL (larger than
// the ring), MM_ETIMEDOUT (no space in time; nothing reserved), a dead conn's error.
mm_err mm_conn_reserve_dev(mm_conn *c, size_t n_bytes, void **d_out, uint64_t deadline_ns);

// mm_conn_recv_dev is mm_conn_recv that also takes device frames: a host frame's payload goes
// to buf (cap bytes) and *on_dev = false; a device frame's payload is copied, in order, into
// the device segments d_iov[0..n) (MM_EFULL when they hold less than payload_bytes) by copies
// enqueued on the declared stream (work enqueued later on it sees the rows) and *on_dev = true.
// With n_iov == 0 a device frame is copied into buf and waited for (a host receiver).
mm_err mm_conn_recv_dev(mm_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap,
                        const struct iovec *d_iov, int n_iov, bool *on_dev,
                        uint64_t deadline_ns);

// mm_conn_recv_view is mm_conn_recv_dev without the copy of a device frame: *d_view points at
// its rows in the conn's device ring (after a wait for them enqueued on the declared stream), and
// stays valid for work the caller enqueues on that stream until its next receive, or wait for
// input, on c (the ring bytes are given back to the sender then, ordered after that work) or
// until c is closed (which drains the stream first); the caller may write the rows in place.
// While a view is out, a send on c never gives its bytes back for want of ring space (the
// sender over them waits, to its deadline). A host frame's payload goes to buf (cap bytes) and
// *d_view is NULL. The view is 256-byte aligned. MM_EUNSUPP where the transport has no views
// (then use mm_conn_recv_dev).
mm_err mm_conn_recv_view(mm_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap,
                         const void **d_view, uint64_t deadline_ns);

// mm_transport_schemes writes the registered schemes, comma-separated, into buf (caller's,
// cap bytes, always NUL-terminated when cap > 0). Thread-safe.
void mm_transport_schemes(char *buf, size_t cap);

// mm_transport_fini calls every initialised transport's fini. Call at process exit after all
// listeners and conns are closed; optional.
void mm_transport_fini(void);

// Test hook (conformance suite only): writes n raw bytes into c's stream bypassing framing,
// so tests can prove that garbage is rejected with MM_EPROTO. MM_EUNSUPP where a transport
// cannot. Same threading as mm_conn_send. Never use in services.
mm_err mm__conn_send_raw(mm_conn *c, const void *p, size_t n, uint64_t deadline_ns);

// ---- the provider interface -----------------------------------------------------------------
// A transport implements this table in common/transport/<scheme>.c and is listed once in
// MM_TRANSPORT_LIST in transport.c. The generic layer (transport.c) validates arguments,
// keeps the sticky error, and implements wait_any on top of rx_ready/rx_arm/rx_disarm.
// ctx pointers are the provider's; the generic layer never looks inside.

#define MM_TRANSPORT_V1 1u
#define MM_TRANSPORT_MAX_PFD 4 // pollfds one conn may need to sleep on

struct mm_transport_ops {
    uint32_t version;   // MM_TRANSPORT_V1; bump on any layout or semantic change
    const char *scheme; // URL scheme this implementation serves ("shm", "tcp", "rdma")
    mm_err (*init)(char err[MM_ERRLEN]); // (optional) once per process before first use
    void (*fini)(void);                  // (optional) from mm_transport_fini
    mm_err (*listen)(void **lctx, const mm_url *url, char err[MM_ERRLEN]);
    mm_err (*accept)(void *lctx, void **cctx, uint64_t deadline_ns, char err[MM_ERRLEN]);
    void (*listener_shutdown)(void *lctx); // any thread; wakes accept
    void (*listener_close)(void *lctx);
    mm_err (*dial)(void **cctx, const mm_url *url, uint64_t deadline_ns, char err[MM_ERRLEN]);
    // (optional) default: *reg = NULL, MM_OK (no registration needed)
    mm_err (*reg_mem)(void *cctx, void *p, size_t n_bytes, void **reg, char err[MM_ERRLEN]);
    void (*dereg_mem)(void *cctx, void *reg); // (optional with reg_mem)
    // send: hdr is already sealed (magic, version, conn_seq, hdr_check) and validated;
    // iov lengths add up to hdr->payload_bytes.
    mm_err (*sendv)(void *cctx, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                    uint64_t deadline_ns);
    // recv: must validate the header with mm_wire_hdr_check (MM_EPROTO, conn broken), return
    // MM_EFULL after discarding an oversize payload, and map BYE to MM_ECLOSED. The generic
    // layer checks conn_seq.
    mm_err (*recv)(void *cctx, mm_wire_hdr *hdr, void *buf, size_t cap, uint64_t deadline_ns);
    // rx_ready: non-blocking; true when recv would not wait (data or failure pending).
    bool (*rx_ready)(void *cctx);
    // rx_arm: announce that the caller will sleep; fill up to MM_TRANSPORT_MAX_PFD pollfds
    // that become readable when rx_ready may have turned true; returns how many. The caller
    // re-checks rx_ready after arming (lost-wakeup rule), then polls, then calls rx_disarm.
    int (*rx_arm)(void *cctx, struct pollfd *pfds);
    void (*rx_disarm)(void *cctx);
    mm_err (*status)(void *cctx); // sticky error, MM_OK while healthy; any thread
    void (*shutdown)(void *cctx); // any thread, never blocks; wakes blocked ops
    void (*close)(void *cctx);    // frees; no concurrent use
    mm_err (*send_raw)(void *cctx, const void *p, size_t n, uint64_t deadline_ns); // (optional)
    // Device frames (optional, appended; NULL: the transport has none; see mm_conn_dev).
    bool (*dev_ok)(void *cctx);
    mm_err (*sendv_dev)(void *cctx, const mm_wire_hdr *hdr, const struct iovec *d_iov,
                        int n_iov, uint64_t deadline_ns);
    mm_err (*recv_dev)(void *cctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                       const struct iovec *d_iov, int n_iov, bool *on_dev,
                       uint64_t deadline_ns);
    // (optional, appended; NULL: no views; see mm_conn_recv_view)
    mm_err (*recv_view)(void *cctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                        const void **d_view, uint64_t deadline_ns);
    // (optional, appended; NULL: no reservations; see mm_conn_reserve_dev)
    mm_err (*reserve_dev)(void *cctx, size_t n_bytes, void **d_out, uint64_t deadline_ns);
};

#endif
