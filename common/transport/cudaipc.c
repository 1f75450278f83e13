// SPDX-License-Identifier: MIT
// cudaipc://NAME and shm://NAME: shm plus device frames between GPU processes of one host
// (mm/transport.h).
//
// Selection: shm:// is this layer in "auto" mode: device frames between two processes that
// both declared a GPU (mm_transport_gpu_use), host frames otherwise; in a build without GPU
// support, or with ?gpu=0 in the URL (both ends use the same URL), it is the raw shm transport
// and nothing more (no handshake of its own). cudaipc://NAME is the explicit form: rendezvous
// "gpu.NAME", refused (MM_EUNSUPP) in a build without GPU support.
//
// Design notes:
// - Layering: a conn is a shm conn (frames, liveness, deadlines, wait_any all come from shm.c)
//   plus, per direction, a ring of device memory that the
//   receiver allocates and exports (IPC memory handle) and the sender maps. Host frames travel
//   through the shm ring unchanged. A device frame travels as a descriptor in the shm ring (a
//   frame marked by the reserved conn_seq DESC_SEQ, carrying the real sealed header and where
//   its rows lie in the device ring); its rows are copied by the sender's stream into the
//   receiver's device ring.
// - Ordering without host waits, per direction, with two interprocess events:
//     data: the sender records it on its stream after copying a frame's rows, before the
//           descriptor is published; the receiver's stream waits for it before copying out.
//           With frame flags (both sides' drivers have stream memory operations, said in the
//           HELLO; MM_CUDAIPC_FLAGS=0: events) the sender's stream instead writes the frame's
//           sequence number (1, 2, ... per direction, carried in the descriptor, checked in
//           turn by the receiver) into a u32 just past the receiver's ring, and the receiver's
//           stream waits until the word reaches it (cyclic >=): a waiting stream wakes sooner
//           than on an event's record, and the receiver owns the word, so closing a conn first
//           sets it to the last value waited for, releasing a wait whose writer died. A frame
//           of at most MM_CUDAIPC_SPIN_BYTES (default 64 KB: every frame of a batch-1 step,
//           the owner's reply of 8 routed rows the largest) is waited for by a polling kernel
//           instead of cuStreamWaitValue32 (mm_gpu_flag_wait's spin): its stream's next kernel
//           starts ~1.6 us sooner, which the latency-bound chain of a small step gains (mesh
//           batch 1 -5%, gateway c=1 +8%); larger frames keep the stream wait (with every
//           frame spun, 64 sequences lost 2-3%; with frames to 128 KB, the gateway at c=16 3%)
//           (docs/BENCHMARKS.md).
//     free: the receiver records it on its stream after its copy-out is enqueued, then
//           advances `freed` (bytes of the device ring it is done with) in the shm control
//           page; before writing over ring bytes it has used before, the sender's stream waits
//           for it (once per lap: a wait covers every read up to the `freed` seen before it).
//           The record is deferred to the receiver's next receive or look for input on the
//           conn (or its own wait for ring space), off the step's path: its stage work is
//           issued first (MM_CUDAIPC_EAGER_FREE=1 records inside a copying receive, as before;
//           a view's is always deferred). A conn closed with a record owed records nothing:
//           conn_free drains the stream before the ring and the events go.
//   A wait on an IPC event covers its latest record made before the wait, and each record here
//   happens before the counter or descriptor that makes the other side wait, so each wait
//   covers what it must (later records only add work).
// - Views (mm_conn_recv_view): a device frame's rows are not copied out; the receiver works on
//   them in the ring, and the deferred free (never paid for a send's want of space while a view
//   is out) is recorded after that work. A view lives until the next receive or wait for input
//   on the conn: the shards and owners hand it to one frame's work, the router to one combine.
//   Kernels take the view as float/int32 rows, so a descriptor's offset must be a multiple of
//   ALIGN (the sender's frames always are): any other is MM_EPROTO, never a misaligned pointer.
// - Ring space: the sender allocates frames (padded to 256 bytes, never wrapping: a frame that
//   would is placed at the ring's start, the tail skipped) from the device ring by `head`; a
//   frame may be written once the bytes one lap before it are freed (or were never written). A
//   sender short of space polls `freed` until its deadline (MM_ETIMEDOUT, nothing sent: the
//   receiver frees a frame at its next receive or wait for input, so this only waits on a
//   receiver that is behind or holds a view it has not let go). A frame larger than the ring
//   is refused (MM_EINVAL, naming ring_mb).
// - Handshake (after shm's): each side sends HELLO_SEQ {has GPU, device, PCI id, ring handle,
//   data/free event handles}, opens the peer's handles when both have a GPU, then sends
//   ACK_SEQ {opened ok}; the device path is on only when both opened everything, so the two
//   ends always agree on it. Without a GPU on one side the conn carries host frames only.
// - The GPU calls (kernels/cuda/ipc.cu) are weak symbols: a build without GPU support has
//   none, and cudaipc:// URLs are refused with MM_EUNSUPP.
// - Death: the peer's death is shm's (socket hang-up: MM_EPEERDOWN). A conn closed or
//   inherited through fork() frees its device resources only in the process that made it.
//   Known gap (events only, no frame flags): a stream wait is enqueued only for a frame whose
//   descriptor arrived (its data event recorded), but if the sender dies before its GPU runs
//   that record, the receiver's stream may wait on it for good (CUDA leaves an IPC event of a
//   dead process undefined), and the receiver's next stream drain has no deadline (the
//   backend's get). With frame flags the conn's close releases the wait (above).
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mm/log.h"
#include "mm/mesh_trace.h"
#include "mm/transport.h"
#include "transport_int.h"

// ---- the GPU entry points (kernels/cuda/mm_gpu.h), weak: NULL in a build without them ----------
#define HANDLE_BYTES 64 // MM_GPU_IPC_HANDLE_BYTES
#define W __attribute__((weak))
extern mm_err mm_gpu_ipc_mem_export(const void *d_ptr, void *handle) W;
extern mm_err mm_gpu_ipc_mem_open(const void *handle, void **d_out) W;
extern void mm_gpu_ipc_mem_close(void *d_ptr) W;
extern mm_err mm_gpu_ipc_event_new(void **ev, void *handle) W;
extern mm_err mm_gpu_ipc_event_open(const void *handle, void **ev) W;
extern void mm_gpu_event_free(void *ev) W;
extern mm_err mm_gpu_event_record(void *ev, void *stream) W;
extern mm_err mm_gpu_stream_wait_event(void *stream, void *ev) W;
extern mm_err mm_gpu_memcpy_any(void *stream, void *d_dst, const void *d_src, size_t n) W;
extern mm_err mm_gpu_stream_sync(void *stream) W;
extern mm_err mm_gpu_device_pci_id(int dev, char id[32]) W;
extern mm_err mm_gpu_set_device(int dev) W;
extern mm_err mm_gpu_alloc(void **d_out, size_t n_bytes) W;
extern void mm_gpu_free(void *d) W;
extern mm_err mm_gpu_backend_stream(void *backend_ctx, void **stream, int *dev) W;
extern bool mm_gpu_flags_ok(void) W;
extern mm_err mm_gpu_flag_write(void *stream, void *d_flag, uint32_t v) W;
extern mm_err mm_gpu_flag_wait(void *stream, const void *d_flag, uint32_t v, bool spin) W;
extern mm_err mm_gpu_flag_set(void *d_flag, uint32_t v) W;
#undef W

extern const struct mm_transport_ops mm__transport_shm_raw;
#define SHM (&mm__transport_shm_raw)

#define DESC_SEQ UINT64_MAX         // conn_seq of a device-frame descriptor
#define HELLO_SEQ (UINT64_MAX - 1)  // conn_seq of the handshake frames
#define ACK_SEQ (UINT64_MAX - 2)
#define IPC_MAGIC 0x43504955u       // "UIPC"
#define IPC_VERSION 2u // 2: frame flags (struct hello.flags, struct desc.seq)
#define RING_DEFAULT_MB 64
#define RING_MAX_MB 4096
#define ALIGN 256u

static const char *const NO_GPU = "this build has no GPU support (build with make cuda or make hip)";

// Frame flags: both sides' builds and drivers have stream memory operations (and
// MM_CUDAIPC_FLAGS is not 0); said in the HELLO, so the two ends agree.
static bool have_flags(void) {
    return mm_gpu_flags_ok && mm_gpu_flag_write && mm_gpu_flag_wait && mm_gpu_flag_set &&
           mm_gpu_flags_ok();
}

static bool have_gpu_code(void) {
    return mm_gpu_ipc_mem_export && mm_gpu_ipc_mem_open && mm_gpu_ipc_mem_close &&
           mm_gpu_ipc_event_new && mm_gpu_ipc_event_open && mm_gpu_event_free &&
           mm_gpu_event_record && mm_gpu_stream_wait_event && mm_gpu_memcpy_any &&
           mm_gpu_stream_sync && mm_gpu_device_pci_id && mm_gpu_set_device && mm_gpu_alloc &&
           mm_gpu_free;
}

// The process's GPU (mm_transport_gpu_use).
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static bool g_set;
static int g_dev;
static void *g_stream;
static char g_pci[32];
static uint64_t g_ring_min; // bytes: twice the largest frame the process expects (0: none)
static bool g_eager_free;   // MM_CUDAIPC_EAGER_FREE=1 (read at mm_transport_gpu_use)
#define SPIN_BYTES_DEFAULT (64u << 10)
static uint64_t g_spin_bytes = SPIN_BYTES_DEFAULT; // MM_CUDAIPC_SPIN_BYTES (likewise): the
                                                   // largest frame the polling kernel waits for

mm_err mm_transport_gpu_use(int dev, void *stream, char err[MM_ERRLEN]) {
    if (!have_gpu_code())
        return mm_errf(err, MM_EUNSUPP, "cudaipc: %s", NO_GPU);
    if (dev < 0)
        return mm_errf(err, MM_EINVAL, "cudaipc: bad device %d", dev);
    char pci[32] = "";
    if (mm_gpu_device_pci_id(dev, pci) != MM_OK)
        return mm_errf(err, MM_EDEVICE, "cudaipc: cannot read the PCI id of device %d", dev);
    pthread_mutex_lock(&g_mu);
    g_set = true;
    const char *ef = getenv("MM_CUDAIPC_EAGER_FREE");
    g_eager_free = ef && strcmp(ef, "1") == 0;
    const char *sb = getenv("MM_CUDAIPC_SPIN_BYTES");
    g_spin_bytes = SPIN_BYTES_DEFAULT;
    if (sb && *sb) {
        char *end = NULL;
        errno = 0;
        const unsigned long long x = strtoull(sb, &end, 10);
        if (errno || *end || *sb == '-')
            mm_log_warn("cudaipc: MM_CUDAIPC_SPIN_BYTES=%s is not a byte count: %u used", sb,
                        SPIN_BYTES_DEFAULT);
        else
            g_spin_bytes = x;
    }
    g_dev = dev;
    g_stream = stream;
    snprintf(g_pci, sizeof(g_pci), "%s", pci);
    pthread_mutex_unlock(&g_mu);
    return MM_OK;
}

mm_err mm_transport_gpu_use_backend(void *backend_ctx, size_t max_frame_bytes,
                                    char err[MM_ERRLEN]) {
    if (!have_gpu_code() || !mm_gpu_backend_stream)
        return mm_errf(err, MM_EUNSUPP, "cudaipc: %s", NO_GPU);
    void *stream = NULL;
    int dev = -1;
    if (mm_gpu_backend_stream(backend_ctx, &stream, &dev) != MM_OK)
        return mm_errf(err, MM_EINVAL, "cudaipc: not a GPU backend");
    MM_TRY(mm_transport_gpu_use(dev, stream, err));
    pthread_mutex_lock(&g_mu);
    g_ring_min = 2 * (uint64_t)max_frame_bytes;
    pthread_mutex_unlock(&g_mu);
    return MM_OK;
}

// Shared counters in the spare half of shm's control page: freed[s] = bytes of side s's
// device rx ring that side s is done with (written by side s only).
struct ipc_ctl {
    _Alignas(64) _Atomic uint64_t freed[2];
};

struct hello {
    uint32_t magic, version;
    uint32_t has_gpu;
    int32_t dev;
    char pci[32];
    uint64_t ring_bytes;
    int32_t pid;
    uint32_t flags;                // 1: frame flags (have_flags)
    uint8_t ring[HANDLE_BYTES];    // my rx ring (ring_bytes, then FLAG_BYTES: the flag word)
    uint8_t ev_data[HANDLE_BYTES]; // recorded by me after writing into the peer's ring
    uint8_t ev_free[HANDLE_BYTES]; // recorded by me after reading my ring
};

struct ack {
    uint32_t magic;
    uint32_t ok; // 1: I opened every handle of yours
};

struct desc {
    mm_wire_hdr hdr; // the real frame's header, sealed by the generic layer
    uint64_t off;    // rows at ring + off
    uint64_t end;    // the sender's head after this frame (absolute bytes, wrap skips included)
    uint32_t seq;    // frame flags: the flag value written after the rows (0: none)
    uint32_t pad_;
};
#define FLAG_BYTES ALIGN // after a ring's bytes: the u32 flag its sender writes

struct ipc_conn {
    void *shm;
    bool plain;          // shm:// without the layer: every call goes to the raw shm
    pid_t owner_pid;
    bool dev;            // device frames on
    int gpu;             // device index
    void *stream;
    struct ipc_ctl *ctl;
    int side;
    // frame flags (both sides have them): the sender writes a sequence number into the flag
    // word after the receiver's ring once a frame's rows are written; the receiver's stream
    // waits for it instead of the data event (a wait that may be enqueued early wakes sooner)
    bool flags;
    uint32_t tx_seq;     // the last value written into the peer's flag
    uint32_t rx_seq;     // the last value my stream waited for in my flag
    uint32_t rx_next;    // the value the next descriptor must carry (each frame adds one)
    // rx: my ring, the peer's data event (opened), my free event
    void *rx_ring;
    uint64_t rx_bytes;
    void *rx_ev_data, *rx_ev_free;
    // tx: the peer's ring (mapped), my data event, the peer's free event (opened)
    void *tx_ring;
    uint64_t tx_bytes, tx_head;
    uint64_t tx_waited; // the peer's `freed` my stream last waited for (its reads up to it ordered)
    void *tx_ev_data, *tx_ev_free;
    // rx: the free event of a received frame is recorded (and `freed` advanced) when this side
    // next receives or looks for input on the conn, not on the receive itself: off the step's
    // path (the receiver's stage work is issued first). free_due: a record is owed, up to
    // free_end.
    bool free_due;
    uint64_t free_end;
    bool view_held; // a view of the last frame is out (mm_conn_recv_view): its free waits for
                    // the next receive or wait for input, never for a send's want of space
    // tx: a reservation (mm_conn_reserve_dev): the next frame's place, [rsv_pos, +rsv_n) of the
    // peer's ring, ending the head at rsv_end; the send whose one segment is exactly it skips
    // the copy
    bool rsv;
    uint64_t rsv_pos, rsv_end, rsv_n;
    struct desc scratch; // descriptor landing place when the caller's buffer is smaller
};

struct ipc_listener {
    void *shm;
    bool plain;
    mm_url url; // its ring_mb sizes the rings of accepted conns
};

// ---- helpers --------------------------------------------------------------------------------

// The shm URL under a cudaipc URL: the same query, name "gpu.NAME" (its own rendezvous); under a
// shm URL, the URL itself.
static mm_err shm_url(const mm_url *u, mm_url *out, char err[MM_ERRLEN]) {
    char text[MM_URL_MAX];
    const bool explicit_ = strcmp(u->scheme, "cudaipc") == 0;
    int n = snprintf(text, sizeof(text), "shm://%s%s%s%s", explicit_ ? "gpu." : "", u->host,
                     u->query[0] ? "?" : "", u->query);
    if (n < 0 || (size_t)n >= sizeof(text))
        return mm_errf(err, MM_EINVAL, "cudaipc URL '%s' too long", u->text);
    if (u->port != -1)
        return mm_errf(err, MM_EINVAL, "%s URL '%s': a name takes no port", u->scheme, u->text);
    return mm_url_parse(out, text, err);
}

// Whether a URL's conns skip this layer: shm:// in a build without GPU support or with ?gpu=0.
static mm_err plain_mode(const mm_url *u, bool *plain, char err[MM_ERRLEN]) {
    uint64_t gpu = 1;
    mm_err q = mm_url_query_u64(u, "gpu", &gpu);
    if (q == MM_EINVAL || (q == MM_OK && gpu > 1))
        return mm_errf(err, MM_EINVAL, "%s URL '%s': gpu must be 0 or 1", u->scheme, u->text);
    const bool explicit_ = strcmp(u->scheme, "cudaipc") == 0;
    if (explicit_ && !have_gpu_code())
        return mm_errf(err, MM_EUNSUPP, "cudaipc URL '%s': %s", u->text, NO_GPU);
    if (explicit_ && gpu == 0)
        return mm_errf(err, MM_EINVAL, "cudaipc URL '%s': gpu=0 (use shm://)", u->text);
    *plain = !explicit_ && (!have_gpu_code() || gpu == 0);
    return MM_OK;
}

static mm_err ring_mb(const mm_url *u, uint64_t *bytes, char err[MM_ERRLEN]) {
    uint64_t mb = RING_DEFAULT_MB;
    mm_err q = mm_url_query_u64(u, "ring_mb", &mb);
    if (q == MM_EINVAL || (q == MM_OK && (mb == 0 || mb > RING_MAX_MB)))
        return mm_errf(err, MM_EINVAL, "%s URL '%s': ring_mb must be 1..%d", u->scheme, u->text,
                       RING_MAX_MB);
    *bytes = mb << 20;
    return MM_OK;
}

static void conn_free(struct ipc_conn *c) {
    if (c == NULL)
        return;
    if (c->owner_pid == getpid() && have_gpu_code()) {
        if (c->gpu >= 0)
            (void)mm_gpu_set_device(c->gpu);
        // a wait of my stream on a frame whose writer died (or never ran its write) would hold
        // the drain below for good: the flag is mine, so I release it
        if (c->flags && c->rx_ring != NULL)
            (void)mm_gpu_flag_set((uint8_t *)c->rx_ring + c->rx_bytes, c->rx_seq);
        if (c->stream != NULL && (c->tx_ring != NULL || c->rx_ring != NULL))
            (void)mm_gpu_stream_sync(c->stream); // copies into the peer's ring are done
        mm_gpu_ipc_mem_close(c->tx_ring);
        mm_gpu_event_free(c->tx_ev_free);
        mm_gpu_event_free(c->rx_ev_data);
        mm_gpu_event_free(c->tx_ev_data);
        mm_gpu_event_free(c->rx_ev_free);
        mm_gpu_free(c->rx_ring);
    }
    if (c->shm != NULL)
        SHM->close(c->shm);
    free(c);
}

static mm_err send_internal(struct ipc_conn *c, uint64_t seq, const void *p, uint32_t n,
                            uint64_t deadline_ns) {
    mm_wire_hdr h;
    MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_CTRL, MM_WIRE_BYTES, 0, MM_WIRE_NO_LAYER, 1, n));
    mm__wire_hdr_seal(&h, seq);
    struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
    return SHM->sendv(c->shm, &h, &iov, 1, deadline_ns);
}

static mm_err recv_internal(struct ipc_conn *c, uint64_t seq, void *p, uint32_t n,
                            uint64_t deadline_ns, char err[MM_ERRLEN]) {
    mm_wire_hdr h;
    mm_err rv = SHM->recv(c->shm, &h, p, n, deadline_ns);
    if (rv != MM_OK)
        return mm_errf(err, rv, "cudaipc handshake: %s", mm_strerror(rv));
    if (h.conn_seq != seq || h.payload_bytes != n)
        return mm_errf(err, MM_EPROTO, "cudaipc handshake: the peer is not a cudaipc endpoint "
                       "of this version");
    return MM_OK;
}

// Both sides: exchange HELLO, open the peer's handles when both have a GPU, exchange ACK.
static mm_err handshake(struct ipc_conn *c, const mm_url *u, uint64_t deadline_ns,
                        char err[MM_ERRLEN]) {
    size_t extra = 0;
    c->ctl = mm__shm_conn_extra(c->shm, &c->side, &extra);
    static_assert(sizeof(struct ipc_ctl) <= 2048, "cudaipc control block");
    struct hello me, peer;
    memset(&me, 0, sizeof(me));
    me.magic = IPC_MAGIC;
    me.version = IPC_VERSION;
    me.pid = (int32_t)getpid();
    pthread_mutex_lock(&g_mu);
    bool gpu = g_set;
    c->gpu = gpu ? g_dev : -1;
    c->stream = g_stream;
    snprintf(me.pci, sizeof(me.pci), "%s", g_pci);
    const uint64_t ring_min = g_ring_min;
    pthread_mutex_unlock(&g_mu);
    mm_err rv = MM_OK;
    if (gpu) {
        uint64_t rb = 0;
        MM_TRY(ring_mb(u, &rb, err));
        if (rb < ring_min) // room for two of the largest frames this process expects
            rb = (ring_min + (1u << 20) - 1) >> 20 << 20;
        if (rb > ((uint64_t)RING_MAX_MB << 20))
            rb = (uint64_t)RING_MAX_MB << 20;
        c->rx_bytes = rb;
        if (mm_gpu_set_device(c->gpu) != MM_OK ||
            mm_gpu_alloc(&c->rx_ring, rb + FLAG_BYTES) != MM_OK ||
            (have_flags() && mm_gpu_flag_set((uint8_t *)c->rx_ring + rb, 0) != MM_OK) ||
            mm_gpu_ipc_mem_export(c->rx_ring, me.ring) != MM_OK ||
            mm_gpu_ipc_event_new(&c->tx_ev_data, me.ev_data) != MM_OK ||
            mm_gpu_ipc_event_new(&c->rx_ev_free, me.ev_free) != MM_OK) {
            mm_log_warn("cudaipc %s: cannot set up the device ring (%llu MiB) on device %d: "
                        "host frames only", u->text, (unsigned long long)(rb >> 20), c->gpu);
            gpu = false;
        }
        me.has_gpu = gpu;
        me.dev = c->gpu;
        me.ring_bytes = rb;
        me.flags = gpu && have_flags();
    }
    rv = send_internal(c, HELLO_SEQ, &me, sizeof(me), deadline_ns);
    if (rv != MM_OK)
        return mm_errf(err, rv, "cudaipc %s handshake: %s", u->text, mm_strerror(rv));
    MM_TRY(recv_internal(c, HELLO_SEQ, &peer, sizeof(peer), deadline_ns, err));
    if (peer.magic != IPC_MAGIC || peer.version != IPC_VERSION)
        return mm_errf(err, MM_EPROTO, "cudaipc %s handshake: peer speaks version %u, this "
                       "build %u", u->text, peer.version, IPC_VERSION);
    struct ack a = {.magic = IPC_MAGIC, .ok = 0};
    if (gpu && peer.has_gpu) {
        if (peer.ring_bytes < ALIGN || peer.ring_bytes > ((uint64_t)RING_MAX_MB << 20))
            return mm_errf(err, MM_EPROTO, "cudaipc %s handshake: peer ring of %llu bytes",
                           u->text, (unsigned long long)peer.ring_bytes);
        c->tx_bytes = peer.ring_bytes;
        if (mm_gpu_ipc_mem_open(peer.ring, &c->tx_ring) == MM_OK &&
            mm_gpu_ipc_event_open(peer.ev_data, &c->rx_ev_data) == MM_OK &&
            mm_gpu_ipc_event_open(peer.ev_free, &c->tx_ev_free) == MM_OK)
            a.ok = 1;
        else
            mm_log_warn("cudaipc %s: cannot open the device ring of pid %d (device %s): host "
                        "frames only", u->text, peer.pid, peer.pci);
    }
    rv = send_internal(c, ACK_SEQ, &a, sizeof(a), deadline_ns);
    if (rv != MM_OK)
        return mm_errf(err, rv, "cudaipc %s handshake: %s", u->text, mm_strerror(rv));
    struct ack pa;
    MM_TRY(recv_internal(c, ACK_SEQ, &pa, sizeof(pa), deadline_ns, err));
    c->dev = a.ok && pa.ok && pa.magic == IPC_MAGIC;
    c->flags = c->dev && me.flags == 1 && peer.flags == 1;
    c->rx_next = 1;
    if (c->dev)
        mm_mesh_trace_open("ipc"); // MM_MESH_TRACE: the device hops' host calls
    mm_log_debug("cudaipc %s: %s (my device %s, peer pid %d device %s)", u->text,
                 c->dev ? c->flags ? "device frames, flags" : "device frames, events"
                       : "host frames only", me.pci, peer.pid, peer.pci);
    return MM_OK;
}

static struct ipc_conn *conn_alloc(void *shm) {
    struct ipc_conn *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->shm = shm;
    c->gpu = -1;
    c->owner_pid = getpid();
    return c;
}

// ---- listener / dial ------------------------------------------------------------------------

static mm_err ipc_listen(void **lctx, const mm_url *url, char err[MM_ERRLEN]) {
    mm_url su;
    uint64_t rb;
    bool plain = false;
    MM_TRY(plain_mode(url, &plain, err));
    MM_TRY(shm_url(url, &su, err));
    MM_TRY(ring_mb(url, &rb, err));
    struct ipc_listener *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return mm_errf(err, MM_ENOMEM, "cudaipc listener");
    mm_err rv = SHM->listen(&l->shm, &su, err);
    if (rv != MM_OK) {
        free(l);
        return rv;
    }
    l->url = *url;
    l->plain = plain;
    *lctx = l;
    return MM_OK;
}

static mm_err ipc_accept(void *lctx, void **cctx, uint64_t deadline_ns, char err[MM_ERRLEN]) {
    struct ipc_listener *l = lctx;
    void *s = NULL;
    MM_TRY(SHM->accept(l->shm, &s, deadline_ns, err));
    struct ipc_conn *c = conn_alloc(s);
    if (c == NULL) {
        SHM->close(s);
        return mm_errf(err, MM_ENOMEM, "cudaipc conn");
    }
    c->plain = l->plain;
    if (c->plain) {
        *cctx = c;
        return MM_OK;
    }
    // A handshake that fails is the dialer's problem: drop the conn, the listener stays usable.
    // A peer that got through shm's handshake gets at least 1 s for ours (as shm's HELLO).
    uint64_t hs = mm_deadline_in_ms(1000);
    mm_err rv = handshake(c, &l->url, deadline_ns > hs ? deadline_ns : hs, err);
    if (rv != MM_OK) {
        conn_free(c);
        return rv == MM_ETIMEDOUT || rv == MM_ECLOSED || rv == MM_EPEERDOWN ? MM_EPROTO : rv;
    }
    *cctx = c;
    return MM_OK;
}

static void ipc_listener_shutdown(void *lctx) {
    struct ipc_listener *l = lctx;
    SHM->listener_shutdown(l->shm);
}

static void ipc_listener_close(void *lctx) {
    struct ipc_listener *l = lctx;
    if (l == NULL)
        return;
    SHM->listener_close(l->shm);
    free(l);
}

static mm_err ipc_dial(void **cctx, const mm_url *url, uint64_t deadline_ns,
                       char err[MM_ERRLEN]) {
    mm_url su;
    uint64_t rb;
    bool plain = false;
    MM_TRY(plain_mode(url, &plain, err));
    MM_TRY(shm_url(url, &su, err));
    MM_TRY(ring_mb(url, &rb, err));
    void *s = NULL;
    MM_TRY(SHM->dial(&s, &su, deadline_ns, err));
    struct ipc_conn *c = conn_alloc(s);
    if (c == NULL) {
        SHM->close(s);
        return mm_errf(err, MM_ENOMEM, "cudaipc conn");
    }
    c->plain = plain;
    if (plain) {
        *cctx = c;
        return MM_OK;
    }
    mm_err rv = handshake(c, url, deadline_ns, err);
    if (rv != MM_OK) {
        conn_free(c);
        return rv;
    }
    *cctx = c;
    return MM_OK;
}

// ---- frames ---------------------------------------------------------------------------------

static bool ipc_dev_ok(void *ctx) {
    struct ipc_conn *c = ctx;
    return c->dev;
}

static mm_err ipc_sendv(void *ctx, const mm_wire_hdr *hdr, const struct iovec *iov, int n_iov,
                        uint64_t deadline_ns) {
    struct ipc_conn *c = ctx;
    return SHM->sendv(c->shm, hdr, iov, n_iov, deadline_ns);
}

// flush_free: the free event owed for the frames received so far is recorded on the stream
// (after their copy-out and whatever followed it) and then `freed` advanced, so a sender that
// waits for the event waits for those reads. A failed record ends the conn (the ring's state is
// unknown).
static mm_err flush_free(struct ipc_conn *c) {
    if (!c->free_due)
        return MM_OK;
    c->free_due = false;
    c->view_held = false;
    mm_err rv = mm_gpu_set_device(c->gpu);
    if (rv == MM_OK)
        rv = mm_gpu_event_record(c->rx_ev_free, c->stream);
    if (rv != MM_OK) {
        SHM->shutdown(c->shm);
        return MM_EDEVICE;
    }
    atomic_store_explicit(&c->ctl->freed[c->side], c->free_end, memory_order_release);
    return MM_OK;
}

static void nap_us(long us) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = us * 1000};
    nanosleep(&ts, NULL);
}

// tx_place: where the next frame of n payload bytes goes in the peer's ring ([*pos_out, +n),
// head after it *end_out), once its bytes one lap before are freed (waited for up to
// deadline_ns; MM_ETIMEDOUT with nothing changed), with the stream ordered after the peer's
// reads of them. Does not advance the head (the send that announces the frame does).
static mm_err tx_place(struct ipc_conn *c, uint64_t n, uint64_t deadline_ns, uint64_t *pos_out,
                       uint64_t *end_out) {
    mm_err f = SHM->status(c->shm);
    if (f != MM_OK)
        return f;
    const uint64_t padded = (n + ALIGN - 1) / ALIGN * ALIGN;
    if (padded > c->tx_bytes) {
        mm_log_warn("cudaipc: a frame of %llu bytes is larger than the peer's device ring "
                    "(%llu MiB; raise ring_mb)", (unsigned long long)n,
                    (unsigned long long)(c->tx_bytes >> 20));
        return MM_EINVAL;
    }
    // Where the frame goes: after head, or at the ring's start when it would wrap.
    uint64_t start = c->tx_head;
    uint64_t pos = start % c->tx_bytes;
    if (pos + padded > c->tx_bytes)
        start += c->tx_bytes - pos, pos = 0;
    const uint64_t end = start + padded;
    // Free when every byte one lap before [start, end) was freed; bytes at or past the old
    // head were never written (the skipped tail), so at most the old head must be freed.
    uint64_t need = end > c->tx_bytes ? end - c->tx_bytes : 0;
    if (need > c->tx_head)
        need = c->tx_head;
    _Atomic uint64_t *freed = &c->ctl->freed[1 - c->side];
    uint64_t spin_end = mm_now_ns() + mm__transport_spin_ns();
    // short of space: first pay what this side owes (the peer may be waiting for it to send us
    // a frame it must send before it reads ours)
    if (atomic_load_explicit(freed, memory_order_acquire) < need && !c->view_held &&
        (f = flush_free(c)) != MM_OK)
        return f;
    while (atomic_load_explicit(freed, memory_order_acquire) < need) {
        uint64_t now = mm_now_ns();
        if (now >= deadline_ns)
            return MM_ETIMEDOUT; // nothing sent yet: the conn stays usable
        f = SHM->status(c->shm);
        if (f != MM_OK)
            return f;
        if (now < spin_end)
            mm__spin_once(now + mm__transport_spin_ns() - spin_end);
        else
            nap_us(20);
    }
    mm_err rv = mm_gpu_set_device(c->gpu);
    // Bytes used before: let our stream wait until the receiver's reads of them have run. A
    // wait covers every read up to the `freed` seen before it (the receiver records the event
    // before it advances `freed`), so one wait serves the sends until need passes that: about
    // one wait per lap of the ring instead of one per frame.
    if (rv == MM_OK && end > c->tx_bytes && need > c->tx_waited) {
        const uint64_t seen = atomic_load_explicit(freed, memory_order_acquire);
        rv = mm_gpu_stream_wait_event(c->stream, c->tx_ev_free);
        if (rv == MM_OK)
            c->tx_waited = seen;
    }
    if (rv != MM_OK)
        return MM_EDEVICE;
    *pos_out = pos;
    *end_out = end;
    return MM_OK;
}

static mm_err ipc_reserve_dev(void *ctx, size_t n_bytes, void **d_out, uint64_t deadline_ns) {
    struct ipc_conn *c = ctx;
    c->rsv = false;
    if (!c->dev)
        return MM_EUNSUPP;
    uint64_t pos = 0, end = 0;
    MM_TRY(tx_place(c, n_bytes, deadline_ns, &pos, &end));
    c->rsv = true;
    c->rsv_pos = pos;
    c->rsv_end = end;
    c->rsv_n = n_bytes;
    *d_out = (uint8_t *)c->tx_ring + pos;
    return MM_OK;
}

static mm_err ipc_sendv_dev(void *ctx, const mm_wire_hdr *hdr, const struct iovec *d_iov,
                            int n_iov, uint64_t deadline_ns) {
    struct ipc_conn *c = ctx;
    if (!c->dev)
        return MM_EUNSUPP;
    const uint64_t n = hdr->payload_bytes;
    // the frame written in place by the caller's stream (mm_conn_reserve_dev): no copy
    const bool in_place = c->rsv && n_iov == 1 && n == c->rsv_n && d_iov[0].iov_len == n &&
                          d_iov[0].iov_base == (uint8_t *)c->tx_ring + c->rsv_pos;
    uint64_t pos = c->rsv_pos, end = c->rsv_end;
    c->rsv = false;
    if (in_place)
        MM_TRY(SHM->status(c->shm)); // (tx_place's first check; the place is taken)
    else
        MM_TRY(tx_place(c, n, deadline_ns, &pos, &end));
    mm_err rv = mm_gpu_set_device(c->gpu);
    uint64_t o = 0;
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "s_in");
    for (int i = 0; i < (in_place ? 0 : n_iov) && rv == MM_OK; i++) {
        rv = mm_gpu_memcpy_any(c->stream, (uint8_t *)c->tx_ring + pos + o, d_iov[i].iov_base,
                               d_iov[i].iov_len);
        o += d_iov[i].iov_len;
    }
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "s_cp");
    const uint32_t seq = c->tx_seq + 1;
    if (rv == MM_OK && c->flags)
        rv = mm_gpu_flag_write(c->stream, (uint8_t *)c->tx_ring + c->tx_bytes, seq);
    else if (rv == MM_OK)
        rv = mm_gpu_event_record(c->tx_ev_data, c->stream);
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "s_rec");
    if (rv != MM_OK)
        return MM_EDEVICE; // nothing announced: the ring bytes are simply not used
    if (c->flags)
        c->tx_seq = seq;
    struct desc d = {.hdr = *hdr, .off = pos, .end = end, .seq = c->flags ? seq : 0};
    rv = send_internal(c, DESC_SEQ, &d, sizeof(d), deadline_ns);
    if (rv == MM_OK)
        c->tx_head = end;
    else if (c->flags) // the flag moved past a frame never announced: the receiver would refuse
        SHM->shutdown(c->shm); // the next descriptor (out of turn); end the conn here instead
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "s_desc");
    return rv;
}

// rx_wait: my stream waits for a frame's rows: for its flag value (frame flags), else for the
// peer's data event (recorded before the descriptor was published).
static mm_err rx_wait(struct ipc_conn *c, const struct desc *d) {
    if (!c->flags)
        return mm_gpu_stream_wait_event(c->stream, c->rx_ev_data);
    MM_TRY(mm_gpu_flag_wait(c->stream, (uint8_t *)c->rx_ring + c->rx_bytes, d->seq,
                            g_spin_bytes > 0 && d->hdr.payload_bytes <= g_spin_bytes));
    c->rx_seq = d->seq;
    return MM_OK;
}

// recv_core: a host frame into buf; a device frame's rows copied into d_iov (or buf when n_iov
// is 0), or, with view, not copied: *view = their place in the ring (mm_conn_recv_view).
static mm_err recv_core(struct ipc_conn *c, mm_wire_hdr *hdr, void *buf, size_t cap,
                        const struct iovec *d_iov, int n_iov, bool *on_dev, const void **view,
                        uint64_t deadline_ns) {
    *on_dev = false;
    if (c->plain)
        return SHM->recv(c->shm, hdr, buf, cap, deadline_ns);
    mm_err fr = flush_free(c); // the last frame's free event, before waiting for the next
    if (fr != MM_OK)
        return fr;
    // Descriptors need sizeof(struct desc) bytes: land in the scratch when buf is smaller.
    const bool small = cap < sizeof(struct desc);
    uint8_t *land = small ? (uint8_t *)&c->scratch : buf;
    size_t land_cap = small ? sizeof(struct desc) : cap;
    mm_err rv = SHM->recv(c->shm, hdr, land, land_cap, deadline_ns);
    if (rv != MM_OK && rv != MM_EFULL)
        return rv;
    if (hdr->conn_seq != DESC_SEQ) { // a host frame
        if (hdr->conn_seq == HELLO_SEQ || hdr->conn_seq == ACK_SEQ) {
            SHM->shutdown(c->shm);
            return MM_EPROTO;
        }
        if (small && rv == MM_OK) {
            if (hdr->payload_bytes > cap)
                return MM_EFULL;
            if (hdr->payload_bytes > 0)
                memcpy(buf, land, (size_t)hdr->payload_bytes);
        }
        return rv;
    }
    struct desc d;
    if (rv != MM_OK || hdr->payload_bytes != sizeof(d)) {
        SHM->shutdown(c->shm);
        return MM_EPROTO;
    }
    memcpy(&d, land, sizeof(d));
    *hdr = d.hdr;
    const uint64_t n = hdr->payload_bytes;
    // (off and n checked apart: a peer's off near 2^64 must not wrap the sum into range)
    if (!c->dev || mm_wire_hdr_check(hdr, NULL) != MM_OK || d.off > c->rx_bytes ||
        n > c->rx_bytes - d.off || d.end < n || d.off % ALIGN != 0 ||
        (c->flags && d.seq != c->rx_next)) { // (a flag value out of turn could hold my stream)
        mm_log_warn("cudaipc: bad device-frame descriptor (offset %llu, %llu bytes, flag %u "
                    "where %u was due)", (unsigned long long)d.off, (unsigned long long)n,
                    d.seq, c->flags ? c->rx_next : 0);
        SHM->shutdown(c->shm);
        return MM_EPROTO;
    }
    if (c->flags)
        c->rx_next++;
    if (view != NULL) { // no copy: the rows stay in the ring until the free is paid
        mm_mesh_trace(hdr->step_id, (int)hdr->layer, "r_desc");
        rv = mm_gpu_set_device(c->gpu);
        if (rv == MM_OK && n > 0)
            rv = rx_wait(c, &d);
        if (rv != MM_OK) {
            SHM->shutdown(c->shm);
            return MM_EDEVICE;
        }
        mm_mesh_trace(hdr->step_id, (int)hdr->layer, "r_wait");
        *view = (const uint8_t *)c->rx_ring + d.off;
        c->free_due = true; // never eager: the caller's work on the rows comes first
        c->free_end = d.end;
        c->view_held = true;
        *on_dev = true;
        return MM_OK;
    }
    uint64_t have = 0;
    for (int i = 0; i < n_iov; i++)
        have += d_iov[i].iov_len;
    const bool to_host = n_iov == 0;
    const bool fits = to_host ? n <= cap : n <= have;
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "r_desc");
    rv = mm_gpu_set_device(c->gpu);
    if (rv == MM_OK && fits && n > 0)
        rv = rx_wait(c, &d);
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "r_wait");
    const uint8_t *src = (const uint8_t *)c->rx_ring + d.off;
    if (rv == MM_OK && fits && to_host && n > 0) {
        rv = mm_gpu_memcpy_any(c->stream, buf, src, (size_t)n);
        if (rv == MM_OK)
            rv = mm_gpu_stream_sync(c->stream);
    } else if (rv == MM_OK && fits) {
        uint64_t o = 0;
        for (int i = 0; i < n_iov && o < n && rv == MM_OK; i++) {
            uint64_t take = d_iov[i].iov_len < n - o ? d_iov[i].iov_len : n - o;
            rv = mm_gpu_memcpy_any(c->stream, d_iov[i].iov_base, src + o, (size_t)take);
            o += take;
        }
    }
    mm_mesh_trace(hdr->step_id, (int)hdr->layer, "r_cp");
    if (rv != MM_OK) {
        SHM->shutdown(c->shm); // the ring's state is unknown: the conn is done
        return MM_EDEVICE;
    }
    // the free event is owed (flush_free at the next receive or look for input); a frame
    // read to the host was drained already, but the same rule keeps one path
    c->free_due = true;
    c->free_end = d.end;
    if (g_eager_free) // MM_CUDAIPC_EAGER_FREE=1: recorded here, as before (A/B of the deferral)
        MM_TRY(flush_free(c));
    *on_dev = !to_host;
    return fits ? MM_OK : MM_EFULL;
}

static mm_err ipc_recv_dev(void *ctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                           const struct iovec *d_iov, int n_iov, bool *on_dev,
                           uint64_t deadline_ns) {
    return recv_core(ctx, hdr, buf, cap, d_iov, n_iov, on_dev, NULL, deadline_ns);
}

static mm_err ipc_recv_view(void *ctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                            const void **d_view, uint64_t deadline_ns) {
    // (mm_conn_recv_view checked the conn has device frames and set *d_view NULL)
    bool on_dev = false;
    return recv_core(ctx, hdr, buf, cap, NULL, 0, &on_dev, d_view, deadline_ns);
}

static mm_err ipc_recv(void *ctx, mm_wire_hdr *hdr, void *buf, size_t cap,
                       uint64_t deadline_ns) {
    bool on_dev;
    return ipc_recv_dev(ctx, hdr, buf, cap, NULL, 0, &on_dev, deadline_ns);
}

static bool ipc_rx_ready(void *ctx) {
    struct ipc_conn *c = ctx;
    if (c->free_due) // looking for input: pay the free event owed (a failure ends the conn,
        (void)flush_free(c); // which the receive then reports)
    return SHM->rx_ready(c->shm);
}

static int ipc_rx_arm(void *ctx, struct pollfd *pfds) {
    struct ipc_conn *c = ctx;
    if (c->free_due)
        (void)flush_free(c);
    return SHM->rx_arm(c->shm, pfds);
}

static void ipc_rx_disarm(void *ctx) {
    struct ipc_conn *c = ctx;
    SHM->rx_disarm(c->shm);
}

static mm_err ipc_status(void *ctx) {
    struct ipc_conn *c = ctx;
    return SHM->status(c->shm);
}

static void ipc_shutdown(void *ctx) {
    struct ipc_conn *c = ctx;
    SHM->shutdown(c->shm);
}

static void ipc_close(void *ctx) {
    struct ipc_conn *c = ctx;
    if (c == NULL)
        return;
    SHM->shutdown(c->shm);
    conn_free(c);
}

static mm_err ipc_send_raw(void *ctx, const void *p, size_t n, uint64_t deadline_ns) {
    struct ipc_conn *c = ctx;
    return SHM->send_raw(c->shm, p, n, deadline_ns);
}

// shm:// (auto: device frames where both ends have a GPU) and cudaipc:// (explicit).
const struct mm_transport_ops mm__transport_shm = {
    .version = MM_TRANSPORT_V1,
    .scheme = "shm",
    .listen = ipc_listen,
    .accept = ipc_accept,
    .listener_shutdown = ipc_listener_shutdown,
    .listener_close = ipc_listener_close,
    .dial = ipc_dial,
    .sendv = ipc_sendv,
    .recv = ipc_recv,
    .rx_ready = ipc_rx_ready,
    .rx_arm = ipc_rx_arm,
    .rx_disarm = ipc_rx_disarm,
    .status = ipc_status,
    .shutdown = ipc_shutdown,
    .close = ipc_close,
    .send_raw = ipc_send_raw,
    .dev_ok = ipc_dev_ok,
    .sendv_dev = ipc_sendv_dev,
    .recv_dev = ipc_recv_dev,
    .recv_view = ipc_recv_view,
    .reserve_dev = ipc_reserve_dev,
};

const struct mm_transport_ops mm__transport_cudaipc = {
    .version = MM_TRANSPORT_V1,
    .scheme = "cudaipc",
    .listen = ipc_listen,
    .accept = ipc_accept,
    .listener_shutdown = ipc_listener_shutdown,
    .listener_close = ipc_listener_close,
    .dial = ipc_dial,
    .sendv = ipc_sendv,
    .recv = ipc_recv,
    .rx_ready = ipc_rx_ready,
    .rx_arm = ipc_rx_arm,
    .rx_disarm = ipc_rx_disarm,
    .status = ipc_status,
    .shutdown = ipc_shutdown,
    .close = ipc_close,
    .send_raw = ipc_send_raw,
    .dev_ok = ipc_dev_ok,
    .sendv_dev = ipc_sendv_dev,
    .recv_dev = ipc_recv_dev,
    .recv_view = ipc_recv_view,
    .reserve_dev = ipc_reserve_dev,
};
