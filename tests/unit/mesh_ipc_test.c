// SPDX-License-Identifier: MIT
// The device-frame layer of shm:// / cudaipc:// (common/transport/cudaipc.c) on the CPU: this
// file defines the GPU entry points the layer takes as weak symbols with a fake "GPU" whose
// memory is host memory, whose copies run at once and whose stream is a log of operations
// (copies, event records and waits, and the test's own "work"). Both ends live in this process.
// It checks the ring accounting of the deferred free and of views, which the GPU run
// (cudaipc_test, the mesh invariance) only shows when something goes wrong:
// - a view's free event is not recorded by the receive that hands it out, but at the next
//   receive or wait for input, after the work the receiver queued on the view;
// - while a view is out, a sender that would reuse its ring bytes waits and fails with
//   MM_ETIMEDOUT at its deadline, writing nothing there; once the free is paid its stream waits
//   for the free event before it copies over those bytes;
// - a side holding a view that is itself short of space does not pay its own free (the work on
//   the view may still be queued after the send);
// - a conn closed with a free owed records nothing on its (destroyed) event; a new conn to the
//   same listener starts with fresh accounting;
// - MM_CUDAIPC_EAGER_FREE=1 records a copying receive's free inside the receive, never a view's;
// - a view-mode data server (mm_dataserv_start_view) hands its handler the rows in the ring
//   (mm_dataserv_on_dev true), and answers a device frame that is not rows (a CTRL list its
//   handler would read on the host) with an error instead of handing over a device pointer.
// - frame flags (when both ends have them): the sender writes 1, 2, ... after each frame's rows,
//   the receiver waits for exactly that value, each direction on its own word; a conn's close
//   sets its own word to the last value it waited for.
// In a build with GPU support (make CUDA=1) the real entry points exist and this file skips.
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../mm_test.h"
#include "mm/dataserv.h"
#include "mm/transport.h"

#ifndef MM_HAVE_CUDA
// the real declarations: a fake whose signature drifts from them does not compile
#include "cuda/mm_gpu.h"

// ---- the fake GPU ------------------------------------------------------------------------------
enum op_kind { OP_COPY, OP_RECORD, OP_WAIT, OP_WORK, OP_FWRITE, OP_FWAIT, OP_FSET };
struct op {
    enum op_kind k;
    const void *ev;  // OP_RECORD, OP_WAIT: the event (its creator's object)
    const void *src; // OP_COPY, OP_WORK; OP_FWAIT: the flag
    void *dst;       // OP_FWRITE, OP_FSET: the flag
    size_t n;        // bytes; OP_F*: the value
};
#define LOG_MAX 65536
static struct op g_log[LOG_MAX];
static int g_n;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void log_op(struct op o) {
    pthread_mutex_lock(&g_mu);
    if (g_n < LOG_MAX)
        g_log[g_n++] = o;
    pthread_mutex_unlock(&g_mu);
}

// an event: created (target == itself) or opened from another's handle (target: the creator's)
struct fev {
    struct fev *target;
};


mm_err mm_gpu_ipc_mem_export(const void *d_ptr, void *handle) {
    memset(handle, 0, 64);
    memcpy(handle, &d_ptr, sizeof(d_ptr));
    return MM_OK;
}
mm_err mm_gpu_ipc_mem_open(const void *handle, void **d_out) {
    memcpy(d_out, handle, sizeof(*d_out));
    return MM_OK;
}
void mm_gpu_ipc_mem_close(void *d_ptr) { (void)d_ptr; }
mm_err mm_gpu_ipc_event_new(void **ev, void *handle) {
    struct fev *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return MM_ENOMEM;
    e->target = e;
    memset(handle, 0, 64);
    memcpy(handle, &e, sizeof(e));
    *ev = e;
    return MM_OK;
}
mm_err mm_gpu_ipc_event_open(const void *handle, void **ev) {
    struct fev *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return MM_ENOMEM;
    memcpy(&e->target, handle, sizeof(e->target));
    *ev = e;
    return MM_OK;
}
void mm_gpu_event_free(void *ev) { free(ev); }
mm_err mm_gpu_event_record(void *ev, void *stream) {
    (void)stream;
    log_op((struct op){.k = OP_RECORD, .ev = ((struct fev *)ev)->target});
    return MM_OK;
}
mm_err mm_gpu_stream_wait_event(void *stream, void *ev) {
    (void)stream;
    log_op((struct op){.k = OP_WAIT, .ev = ((struct fev *)ev)->target});
    return MM_OK;
}
mm_err mm_gpu_memcpy_any(void *stream, void *d_dst, const void *d_src, size_t n) {
    (void)stream;
    memcpy(d_dst, d_src, n);
    log_op((struct op){.k = OP_COPY, .src = d_src, .dst = d_dst, .n = n});
    return MM_OK;
}
mm_err mm_gpu_stream_sync(void *stream) {
    (void)stream;
    return MM_OK;
}
mm_err mm_gpu_device_pci_id(int dev, char id[32]) {
    snprintf(id, 32, "fake:%d", dev);
    return MM_OK;
}
mm_err mm_gpu_set_device(int dev) {
    (void)dev;
    return MM_OK;
}
mm_err mm_gpu_alloc(void **d_out, size_t n_bytes) { // 256-byte aligned, as cudaMalloc's
    *d_out = aligned_alloc(256, (n_bytes + 255) / 256 * 256);
    if (*d_out == NULL)
        return MM_ENOMEM;
    memset(*d_out, 0, n_bytes);
    return MM_OK;
}
void mm_gpu_free(void *d) { free(d); }
// frame flags (off unless a case turns them on before its conns are made): a wait whose value
// the flag has not reached yet would block a real stream; here it is counted as a fault
static bool g_flags;
static int g_flag_faults;
bool mm_gpu_flags_ok(void) { return g_flags; }
mm_err mm_gpu_flag_write(void *stream, void *d_flag, uint32_t v) {
    (void)stream;
    memcpy(d_flag, &v, 4);
    log_op((struct op){.k = OP_FWRITE, .dst = d_flag, .n = v});
    return MM_OK;
}
mm_err mm_gpu_flag_wait(void *stream, const void *d_flag, uint32_t v, bool spin) {
    (void)stream, (void)spin;
    uint32_t cur;
    memcpy(&cur, d_flag, 4);
    if ((int32_t)(cur - v) < 0)
        g_flag_faults++;
    log_op((struct op){.k = OP_FWAIT, .src = d_flag, .n = v});
    return MM_OK;
}
mm_err mm_gpu_flag_set(void *d_flag, uint32_t v) {
    memcpy(d_flag, &v, 4);
    log_op((struct op){.k = OP_FSET, .dst = d_flag, .n = v});
    return MM_OK;
}

// ---- helpers -----------------------------------------------------------------------------------
#define FRAME (400u << 10) // bytes: two fit in the 1 MiB ring, a third reuses the first's bytes
#define DIM 256u
#define ROWS (FRAME / (DIM * 4))

static char g_url[96];
static mm_listener *g_l;
static mm_conn *g_srv;

static void *accept_main(void *arg) {
    (void)arg;
    char err[MM_ERRLEN] = "";
    if (mm_listener_accept(g_l, &g_srv, mm_deadline_in_ms(5000), err) != MM_OK)
        g_srv = NULL;
    return NULL;
}

// open: a listener and one conn to it (*cli dialed, *srv accepted), both with device frames
static void open_pair(const char *tag, mm_conn **cli, mm_conn **srv) {
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_transport_gpu_use(0, (void *)0x5, err));
    if (g_l == NULL) {
        snprintf(g_url, sizeof(g_url), "cudaipc://mmipc-%d-%s?ring_mb=1", (int)getpid(), tag);
        MM_PASS(mm_transport_listen(&g_l, g_url, err));
    }
    pthread_t th;
    MM_TRUE(pthread_create(&th, NULL, accept_main, NULL) == 0);
    MM_PASS(mm_transport_dial(cli, g_url, mm_deadline_in_ms(5000), err));
    pthread_join(th, NULL);
    MM_TRUE(g_srv != NULL);
    *srv = g_srv;
    MM_TRUE(mm_conn_dev(*cli) && mm_conn_dev(*srv));
}

// close_pair: open_pair's inverse (both conns, then the listener)
static void close_pair(mm_conn *cli, mm_conn *srv) {
    mm_conn_close(cli);
    mm_conn_close(srv);
    mm_listener_close(g_l);
    g_l = NULL;
}

// send one device frame of FRAME bytes from d (host memory standing for device memory)
static mm_err send_frame(mm_conn *c, uint64_t step, const float *d, uint64_t deadline_ns) {
    mm_wire_hdr h;
    MM_TRY(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, step, 0, ROWS, DIM));
    struct iovec v = {.iov_base = (void *)d, .iov_len = FRAME};
    return mm_conn_sendv_dev(c, &h, &v, 1, deadline_ns);
}

static float *frame_data(float base) {
    float *d = malloc(FRAME);
    MM_TRUE(d != NULL);
    for (size_t i = 0; i < FRAME / 4; i++)
        d[i] = base + (float)i;
    return d;
}

static int count_since(int mark, enum op_kind k) {
    int n = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = mark; i < g_n; i++)
        n += g_log[i].k == k;
    pthread_mutex_unlock(&g_mu);
    return n;
}

// index of the first op of kind k at or after mark (-1: none)
static int first_since(int mark, enum op_kind k) {
    int at = -1;
    pthread_mutex_lock(&g_mu);
    for (int i = mark; i < g_n && at < 0; i++)
        if (g_log[i].k == k)
            at = i;
    pthread_mutex_unlock(&g_mu);
    return at;
}

static int log_mark(void) {
    pthread_mutex_lock(&g_mu);
    int n = g_n;
    pthread_mutex_unlock(&g_mu);
    return n;
}

// wait for input on c for a moment (nothing comes): the "look for input" of a receiver
static void look(mm_conn *c) {
    size_t r = 0;
    MM_FAIL(mm_conn_wait_any(&c, 1, mm_deadline_in_ms(5), &r), MM_ETIMEDOUT);
}

// ---- cases -------------------------------------------------------------------------------------

static void test_view_free_after_work(void) {
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("work", &cli, &srv);
    float *d = frame_data(1.0f);
    MM_PASS(send_frame(cli, 1, d, mm_deadline_in_ms(2000)));
    int mark = log_mark();
    mm_wire_hdr h;
    const void *view = NULL;
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &view, mm_deadline_in_ms(2000)));
    MM_TRUE(view != NULL);
    MM_EQ(h.step_id, 1u);
    MM_TRUE(memcmp(view, d, FRAME) == 0);
    MM_TRUE((uintptr_t)view % 256 == 0);
    MM_EQ(count_since(mark, OP_COPY), 0);   // in place: no copy out of the ring
    MM_EQ(count_since(mark, OP_RECORD), 0); // the free is not paid by the receive
    log_op((struct op){.k = OP_WORK, .src = view, .n = FRAME}); // the stage's work on the rows
    const int work = log_mark() - 1;
    look(srv);
    const int rec = first_since(mark, OP_RECORD);
    MM_TRUE(rec > work); // paid at the wait for input, after the work
    MM_EQ(count_since(mark, OP_RECORD), 1);
    look(srv); // owed once: nothing more
    MM_EQ(count_since(mark, OP_RECORD), 1);
    // a copying receive defers its free the same way (after the copy out)
    MM_PASS(send_frame(cli, 2, d, mm_deadline_in_ms(2000)));
    float *dst = malloc(FRAME);
    struct iovec dv = {.iov_base = dst, .iov_len = FRAME};
    bool on_dev = false;
    mark = log_mark();
    MM_PASS(mm_conn_recv_dev(srv, &h, NULL, 0, &dv, 1, &on_dev, mm_deadline_in_ms(2000)));
    MM_TRUE(on_dev);
    MM_TRUE(memcmp(dst, d, FRAME) == 0);
    MM_EQ(count_since(mark, OP_RECORD), 0);
    const int copy = first_since(mark, OP_COPY);
    MM_TRUE(copy >= mark);
    look(srv);
    MM_TRUE(first_since(mark, OP_RECORD) > copy);
    free(dst);
    free(d);
    close_pair(cli, srv);
}

static void test_view_holds_ring(void) {
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("hold", &cli, &srv);
    float *d1 = frame_data(1.0f), *d2 = frame_data(2.0f), *d3 = frame_data(3.0f);
    MM_PASS(send_frame(cli, 1, d1, mm_deadline_in_ms(2000)));
    mm_wire_hdr h;
    const void *v1 = NULL;
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v1, mm_deadline_in_ms(2000)));
    MM_TRUE(v1 != NULL);
    MM_PASS(send_frame(cli, 2, d2, mm_deadline_in_ms(2000))); // the ring's second half
    // the third frame goes over the first's bytes, still a view out: the sender must not
    // write them; it waits to its deadline and reports it, the conn still usable
    int mark = log_mark();
    MM_FAIL(send_frame(cli, 3, d3, mm_deadline_in_ms(40)), MM_ETIMEDOUT);
    MM_EQ(count_since(mark, OP_COPY), 0);
    MM_TRUE(memcmp(v1, d1, FRAME) == 0);
    MM_EQ(mm_conn_error(cli), MM_OK);
    // the receiver takes the next frame: the first's free is paid (after its work), and the
    // sender's stream waits for that record before it copies over the first's bytes
    log_op((struct op){.k = OP_WORK, .src = v1, .n = FRAME});
    const void *v2 = NULL;
    mark = log_mark();
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v2, mm_deadline_in_ms(2000)));
    MM_EQ(h.step_id, 2u);
    MM_TRUE(memcmp(v2, d2, FRAME) == 0);
    const int rec = first_since(mark, OP_RECORD);
    MM_TRUE(rec >= mark);
    const void *free_ev = g_log[rec].ev;
    MM_PASS(send_frame(cli, 3, d3, mm_deadline_in_ms(2000)));
    int wait = -1, copy = -1;
    for (int i = rec + 1; i < log_mark(); i++) {
        if (g_log[i].k == OP_WAIT && g_log[i].ev == free_ev && wait < 0)
            wait = i;
        if (g_log[i].k == OP_COPY && g_log[i].dst == v1 && copy < 0)
            copy = i;
    }
    MM_TRUE(wait > rec);
    MM_TRUE(copy > wait);
    const void *v3 = NULL;
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v3, mm_deadline_in_ms(2000)));
    MM_EQ(h.step_id, 3u);
    MM_TRUE(v3 == v1);
    MM_TRUE(memcmp(v3, d3, FRAME) == 0);
    free(d1);
    free(d2);
    free(d3);
    close_pair(cli, srv);
}

// srv holds a view of cli's frame and is itself short of space in cli's ring (cli owes the
// free of srv's first frame): srv must not pay its own free then (the view's work may still be
// queued after the send), so it waits to its deadline instead
static void test_view_not_paid_by_send(void) {
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("send", &cli, &srv);
    float *d = frame_data(5.0f);
    float *dst = malloc(FRAME);
    MM_PASS(send_frame(cli, 1, d, mm_deadline_in_ms(2000)));
    mm_wire_hdr h;
    const void *v = NULL;
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v, mm_deadline_in_ms(2000)));
    MM_PASS(send_frame(srv, 10, d, mm_deadline_in_ms(2000)));
    struct iovec dv = {.iov_base = dst, .iov_len = FRAME};
    bool on_dev = false;
    MM_PASS(mm_conn_recv_dev(cli, &h, NULL, 0, &dv, 1, &on_dev, mm_deadline_in_ms(2000)));
    MM_PASS(send_frame(srv, 11, d, mm_deadline_in_ms(2000)));
    int mark = log_mark();
    MM_FAIL(send_frame(srv, 12, d, mm_deadline_in_ms(30)), MM_ETIMEDOUT);
    MM_EQ(count_since(mark, OP_RECORD), 0); // neither side paid anything
    MM_EQ(count_since(mark, OP_COPY), 0);
    // cli, short of space in srv's ring while owing srv a free, pays it first (srv may wait
    // for it): here srv's ring has room, so this only checks the conn still works both ways
    MM_PASS(mm_conn_recv_dev(cli, &h, NULL, 0, &dv, 1, &on_dev, mm_deadline_in_ms(2000)));
    MM_EQ(h.step_id, 11u);
    MM_PASS(send_frame(srv, 12, d, mm_deadline_in_ms(2000)));
    free(dst);
    free(d);
    close_pair(cli, srv);
}

static void test_close_with_free_owed(void) {
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("close", &cli, &srv);
    float *d = frame_data(7.0f);
    MM_PASS(send_frame(cli, 1, d, mm_deadline_in_ms(2000)));
    mm_wire_hdr h;
    const void *v = NULL;
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v, mm_deadline_in_ms(2000)));
    int mark = log_mark();
    mm_conn_close(srv); // a free owed: nothing is recorded on the event being destroyed
    mm_conn_close(cli);
    MM_EQ(count_since(mark, OP_RECORD), 0);
    // a new conn to the same listener: fresh rings and counters, frames lap the ring
    open_pair("close", &cli, &srv);
    for (uint64_t k = 0; k < 7; k++) {
        d[0] = (float)k;
        MM_PASS(send_frame(cli, k, d, mm_deadline_in_ms(2000)));
        MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v, mm_deadline_in_ms(2000)));
        MM_EQ(h.step_id, k);
        MM_TRUE(memcmp(v, d, FRAME) == 0);
    }
    free(d);
    close_pair(cli, srv);
}

static void test_eager_free(void) {
    setenv("MM_CUDAIPC_EAGER_FREE", "1", 1);
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("eager", &cli, &srv); // (the switch is read where the GPU is declared)
    float *d = frame_data(9.0f), *dst = malloc(FRAME);
    struct iovec dv = {.iov_base = dst, .iov_len = FRAME};
    bool on_dev = false;
    mm_wire_hdr h;
    MM_PASS(send_frame(cli, 1, d, mm_deadline_in_ms(2000)));
    int mark = log_mark();
    MM_PASS(mm_conn_recv_dev(srv, &h, NULL, 0, &dv, 1, &on_dev, mm_deadline_in_ms(2000)));
    MM_EQ(count_since(mark, OP_RECORD), 1); // inside the receive, after the copy
    MM_TRUE(first_since(mark, OP_RECORD) > first_since(mark, OP_COPY));
    MM_PASS(send_frame(cli, 2, d, mm_deadline_in_ms(2000)));
    const void *v = NULL;
    mark = log_mark();
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &v, mm_deadline_in_ms(2000)));
    MM_EQ(count_since(mark, OP_RECORD), 0); // a view's never is
    look(srv);
    MM_EQ(count_since(mark, OP_RECORD), 1);
    unsetenv("MM_CUDAIPC_EAGER_FREE");
    MM_PASS(mm_transport_gpu_use(0, (void *)0x5, NULL));
    free(dst);
    free(d);
    close_pair(cli, srv);
}

// Frames of many sizes (wrap skips included) lap the 1 MiB ring 20+ times, taken as views (with
// work on them) or copied out, sometimes two behind the sender (a send over unfreed bytes times
// out and the receiver catches up, or, caught up, waits for input and so gives back its last).
// From the log: every sender copy into ring bytes read before comes after a stream wait on the
// free event whose latest record before it follows the last read of those bytes (what keeps
// the sender off bytes a receiver still reads), and the rows arrive intact.
static void test_ring_accounting(void) {
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("acct", &cli, &srv);
    const size_t RING = 1u << 20, MAXB = 400u << 10;
    float *src = malloc(MAXB), *dst = malloc(MAXB);
    MM_TRUE(src && dst);
    static int last_read[(1u << 20) / 256]; // per 256-byte block: log index of its last read
    for (size_t b = 0; b < RING / 256; b++)
        last_read[b] = -1;
    const uint8_t *ring = NULL;
    const void *data_ev = NULL;
    const int mark0 = log_mark();
    uint32_t rng = 12345;
    uint64_t sent = 0, got = 0;
    int scanned = mark0, behind_timeouts = 0;
    while (got < 120) {
        rng = rng * 1103515245u + 12345u;
        const uint32_t rows = 1 + (rng >> 8) % (uint32_t)(MAXB / (DIM * 4));
        const size_t nb = (size_t)rows * DIM * 4;
        // the sender runs ahead by up to two frames; a send over unfreed bytes times out
        mm_err rv = MM_ETIMEDOUT;
        if (sent < 120 && sent - got < 2) {
            for (size_t i = 0; i < nb / 4; i++)
                src[i] = (float)(sent * 7 + i);
            mm_wire_hdr h;
            MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, sent, 0, rows, DIM));
            struct iovec v = {.iov_base = src, .iov_len = nb};
            rv = mm_conn_sendv_dev(cli, &h, &v, 1, mm_deadline_in_ms(2));
            if (rv == MM_OK)
                sent++;
            else {
                MM_EQ(rv, MM_ETIMEDOUT);
                behind_timeouts++;
            }
        }
        if (rv == MM_OK && sent - got < 2 && (rng >> 4) % 2)
            continue; // leave it queued: the next send may need the receiver to catch up
        if (got == sent) {
            // caught up, yet the frame needs the bytes of the last one taken (a wrap skip can
            // put it there): they come back when the receiver waits for input, as in the mesh
            if (rv == MM_ETIMEDOUT)
                look(srv);
            continue;
        }
        mm_wire_hdr r;
        const bool as_view = (rng >> 12) % 3 != 0;
        const void *v = NULL;
        if (as_view) {
            MM_PASS(mm_conn_recv_view(srv, &r, NULL, 0, &v, mm_deadline_in_ms(2000)));
            MM_TRUE(v != NULL);
            log_op((struct op){.k = OP_WORK, .src = v, .n = r.payload_bytes});
        } else {
            struct iovec dv = {.iov_base = dst, .iov_len = MAXB};
            bool on_dev = false;
            MM_PASS(mm_conn_recv_dev(srv, &r, NULL, 0, &dv, 1, &on_dev, mm_deadline_in_ms(2000)));
            MM_TRUE(on_dev);
        }
        MM_EQ(r.step_id, got);
        const float *rows_at = as_view ? v : dst;
        for (size_t i = 0; i < r.payload_bytes / 4; i += 97)
            MM_EQ(rows_at[i], (float)(got * 7 + i));
        got++;
        // replay the new log entries: reads mark their blocks, sender copies are checked
        const int end = log_mark();
        for (int i = scanned; i < end; i++) {
            const struct op *o = &g_log[i];
            if (ring == NULL && o->k == OP_COPY && o->src == src)
                ring = o->dst; // the first frame sits at the ring's start
            if (o->k == OP_RECORD && data_ev == NULL)
                data_ev = o->ev; // the sender's first record follows its first copy
        }
        if (ring == NULL)
            continue;
        for (int i = scanned; i < end; i++) {
            const struct op *o = &g_log[i];
            const uint8_t *rd = o->k == OP_WORK ? o->src : o->k == OP_COPY ? o->src : NULL;
            if (rd && rd >= ring && rd < ring + RING) {
                for (size_t b = (size_t)(rd - ring) / 256; b * 256 < (size_t)(rd - ring) + o->n; b++)
                    last_read[b] = i;
                continue;
            }
            const uint8_t *wr = o->k == OP_COPY ? o->dst : NULL;
            if (!(wr && wr >= ring && wr < ring + RING))
                continue;
            int lr = -1;
            for (size_t b = (size_t)(wr - ring) / 256; b * 256 < (size_t)(wr - ring) + o->n; b++)
                if (last_read[b] > lr)
                    lr = last_read[b];
            if (lr < 0)
                continue; // never read: first lap
            int w = -1, rec = -1;
            for (int j = i - 1; j >= mark0 && w < 0; j--)
                if (g_log[j].k == OP_WAIT && g_log[j].ev != data_ev)
                    w = j;
            for (int j = w - 1; j >= mark0 && rec < 0 && w >= 0; j--)
                if (g_log[j].k == OP_RECORD && g_log[j].ev != data_ev)
                    rec = j;
            if (!(w >= 0 && rec > lr))
                MM_TEST_FAIL_("ring bytes overwritten before their reader let go");
        }
        scanned = end;
    }
    MM_EQ(got, 120u);
    MM_TRUE(behind_timeouts > 0); // the sender did run into unfreed bytes
    free(src);
    free(dst);
    close_pair(cli, srv);
}

// Reservations (mm_conn_reserve_dev): the frame written in place is sent without a copy; its
// place waits for the receiver's free like a copied frame's, and the stream wait on the free
// event comes at the reservation, before the caller's writes; a send of other rows after a
// reservation copies as before; bad sizes are refused.
static void test_reserve_in_place(void) {
    mm_conn *cli = NULL, *srv = NULL;
    open_pair("rsv", &cli, &srv);
    void *p = NULL;
    MM_FAIL(mm_conn_reserve_dev(cli, 0, &p, mm_deadline_in_ms(100)), MM_EINVAL);
    MM_FAIL(mm_conn_reserve_dev(NULL, 16, &p, mm_deadline_in_ms(100)), MM_EINVAL);
    MM_FAIL(mm_conn_reserve_dev(cli, 2u << 20, &p, mm_deadline_in_ms(100)), MM_EINVAL);
    MM_TRUE(p == NULL);
    MM_EQ(mm_conn_error(cli), MM_OK);
    float *want = frame_data(0.0f);
    // frame k goes over frame k-2's bytes (freed when the receiver takes frame k-1)
    for (int k = 0; k < 6; k++) {
        const int mark = log_mark();
        MM_PASS(mm_conn_reserve_dev(cli, FRAME, &p, mm_deadline_in_ms(2000)));
        MM_TRUE(p != NULL && ((uintptr_t)p % 256) == 0);
        if (k >= 2) // over bytes read before: the stream waits for their free, before writing
            MM_TRUE(first_since(mark, OP_WAIT) >= mark);
        const int wrote = log_mark();
        for (size_t i = 0; i < FRAME / 4; i++) // the "kernel" writing the rows in place
            ((float *)p)[i] = (float)(k * 1000) + (float)i;
        log_op((struct op){.k = OP_WORK, .src = p, .n = FRAME});
        mm_wire_hdr h;
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, (uint64_t)k, 0, ROWS, DIM));
        struct iovec v = {.iov_base = p, .iov_len = FRAME};
        MM_PASS(mm_conn_sendv_dev(cli, &h, &v, 1, mm_deadline_in_ms(2000)));
        MM_EQ(count_since(wrote, OP_COPY), 0); // sent from where it was written
        MM_EQ(count_since(wrote, OP_WAIT), 0);
        MM_EQ(count_since(wrote, OP_RECORD), 1);
        const void *got = NULL;
        MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &got, mm_deadline_in_ms(2000)));
        MM_EQ(h.step_id, (uint64_t)k);
        MM_TRUE(got == p);
        for (size_t i = 0; i < FRAME / 4; i += 101)
            MM_EQ(((const float *)got)[i], (float)(k * 1000) + (float)i);
        log_op((struct op){.k = OP_WORK, .src = got, .n = FRAME});
    }
    // a view still out (frame 5) and frame 6 sent but not taken: frame 7 would go over frame
    // 5's bytes, so no place until the receiver lets go; then the wait comes first
    MM_PASS(send_frame(cli, 6, want, mm_deadline_in_ms(2000)));
    int mark = log_mark();
    MM_FAIL(mm_conn_reserve_dev(cli, FRAME, &p, mm_deadline_in_ms(30)), MM_ETIMEDOUT);
    MM_EQ(count_since(mark, OP_WAIT), 0);
    MM_EQ(mm_conn_error(cli), MM_OK);
    mm_wire_hdr h;
    const void *got = NULL;
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &got, mm_deadline_in_ms(2000))); // pays 5's
    MM_EQ(h.step_id, 6u);
    mark = log_mark();
    MM_PASS(mm_conn_reserve_dev(cli, FRAME, &p, mm_deadline_in_ms(2000)));
    MM_TRUE(first_since(mark, OP_WAIT) >= mark);
    look(srv); // (frame 6's view let go)
    // that reservation, then a send of other rows: copied as before, into the reserved place
    mark = log_mark();
    MM_PASS(send_frame(cli, 50, want, mm_deadline_in_ms(2000)));
    MM_EQ(count_since(mark, OP_COPY), 1);
    MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &got, mm_deadline_in_ms(2000)));
    MM_EQ(h.step_id, 50u);
    MM_TRUE(memcmp(got, want, FRAME) == 0);
    free(want);
    close_pair(cli, srv);
}

static int g_ds_rows, g_ds_dev, g_ds_other_dev;

// the shard's shape: rows worked on in place and answered from there
static mm_err ds_handler(void *arg, mm_conn *c, const mm_wire_hdr *h, void *payload) {
    (void)arg;
    if (h->kind != MM_WIRE_ROWS) {
        g_ds_other_dev += mm_dataserv_on_dev(payload);
        return MM_OK;
    }
    g_ds_rows++;
    g_ds_dev += mm_dataserv_on_dev(payload);
    float *x = payload;
    for (size_t i = 0; i < h->payload_bytes / 4; i++)
        x[i] *= 2.0f;
    mm_wire_hdr r;
    MM_TRY(mm_wire_hdr_init(&r, MM_WIRE_REPLY, MM_WIRE_F32, h->step_id, h->layer, h->n_rows,
                            h->row_dim));
    struct iovec v = {.iov_base = payload, .iov_len = h->payload_bytes};
    return mm_conn_sendv_dev(c, &r, &v, 1, mm_deadline_in_ms(2000));
}

static void test_dataserv_views(void) {
    char err[MM_ERRLEN] = "", url[96];
    MM_PASS(mm_transport_gpu_use(0, (void *)0x5, err));
    snprintf(url, sizeof(url), "cudaipc://mmipcds-%d?ring_mb=1", (int)getpid());
    mm_dataserv *ds = NULL;
    MM_PASS(mm_dataserv_start_view(&ds, url, 4096, ds_handler, NULL, 100, NULL, err));
    mm_conn *c = NULL;
    MM_PASS(mm_transport_dial(&c, url, mm_deadline_in_ms(5000), err));
    MM_TRUE(mm_conn_dev(c));
    float x[2 * DIM], y[2 * DIM];
    struct iovec xv = {.iov_base = x, .iov_len = sizeof(x)}, yv = {.iov_base = y,
                                                                   .iov_len = sizeof(y)};
    mm_wire_hdr h, r;
    char buf[256];
    bool on_dev = false;
    for (int k = 0; k < 3; k++) {
        for (size_t i = 0; i < 2 * DIM; i++)
            x[i] = (float)(k * 1000 + (int)i);
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, (uint64_t)k, 0, 2, DIM));
        MM_PASS(mm_conn_sendv_dev(c, &h, &xv, 1, mm_deadline_in_ms(2000)));
        MM_PASS(mm_conn_recv_dev(c, &r, buf, sizeof(buf), &yv, 1, &on_dev,
                                 mm_deadline_in_ms(5000)));
        MM_TRUE(on_dev);
        MM_EQ(r.kind, MM_WIRE_REPLY);
        for (size_t i = 0; i < 2 * DIM; i++)
            MM_EQ(y[i], 2.0f * x[i]);
        // a CTRL list sent as device rows: refused by the server, never handed over
        uint32_t list[64] = {1, 7, 2};
        struct iovec lv = {.iov_base = list, .iov_len = sizeof(list)};
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_CTRL, MM_WIRE_BYTES, (uint64_t)k, 0, 1,
                                 sizeof(list)));
        MM_PASS(mm_conn_sendv_dev(c, &h, &lv, 1, mm_deadline_in_ms(2000)));
        memset(buf, 0, sizeof(buf));
        MM_PASS(mm_conn_recv_dev(c, &r, buf, sizeof(buf) - 1, &yv, 1, &on_dev,
                                 mm_deadline_in_ms(5000)));
        MM_EQ(r.kind, MM_WIRE_ERROR);
        MM_EQ(r.aux, (uint32_t)MM_EPROTO);
        MM_TRUE(strstr(buf, "rows only") != NULL);
    }
    MM_EQ(g_ds_rows, 3);
    MM_EQ(g_ds_dev, 3);
    MM_EQ(g_ds_other_dev, 0);
    mm_conn_close(c);
    mm_dataserv_stop(ds);
}

// Frame flags: the sender's stream writes 1, 2, ... past the receiver's ring after each frame's
// rows (instead of recording the data event), the receiver's stream waits for exactly that
// value before it reads them (never before the write, in this fake), views and copies alike,
// each direction its own sequence; closing a conn sets its own flag to the last value it waited
// for (releasing a wait whose writer died).
static void test_frame_flags(void) {
    g_flags = true;
    g_flag_faults = 0;
    mm_conn *cli = NULL, *srv = NULL;
    const int mark = log_mark();
    open_pair("flags", &cli, &srv);
    float *d = frame_data(3.0f), *dst = malloc(FRAME);
    mm_wire_hdr h;
    for (int i = 1; i <= 5; i++) {
        MM_PASS(send_frame(cli, (uint64_t)i, d, mm_deadline_in_ms(2000)));
        if (i % 2) {
            const void *view = NULL;
            MM_PASS(mm_conn_recv_view(srv, &h, NULL, 0, &view, mm_deadline_in_ms(2000)));
            MM_TRUE(memcmp(view, d, FRAME) == 0);
        } else {
            struct iovec dv = {.iov_base = dst, .iov_len = FRAME};
            bool on_dev = false;
            MM_PASS(mm_conn_recv_dev(srv, &h, NULL, 0, &dv, 1, &on_dev, mm_deadline_in_ms(2000)));
            MM_TRUE(on_dev && memcmp(dst, d, FRAME) == 0);
        }
        MM_EQ(h.step_id, (uint64_t)i);
    }
    MM_PASS(send_frame(srv, 9, d, mm_deadline_in_ms(2000))); // the other direction: from 1
    const void *view = NULL;
    MM_PASS(mm_conn_recv_view(cli, &h, NULL, 0, &view, mm_deadline_in_ms(2000)));
    MM_EQ(h.step_id, 9u);
    pthread_mutex_lock(&g_mu);
    int nw = 0, nwait = 0, bad = 0;
    const void *to_srv = NULL;
    for (int i = mark; i < g_n; i++) {
        const struct op *o = &g_log[i];
        if (o->k == OP_FWRITE && nw < 5) {
            nw++;
            bad += o->n != (size_t)nw;
            to_srv = o->dst;
        } else if (o->k == OP_FWRITE) {
            bad += o->n != 1 || o->dst == to_srv; // srv -> cli: its own word, its own count
        }
        if (o->k == OP_FWAIT && nwait < 5) {
            nwait++;
            bad += o->n != (size_t)nwait || o->src != to_srv;
        }
    }
    pthread_mutex_unlock(&g_mu);
    MM_EQ(bad, 0);
    MM_EQ(nw, 5);
    MM_EQ(nwait, 5);
    MM_EQ(count_since(mark, OP_FWRITE), 6);
    MM_EQ(count_since(mark, OP_FWAIT), 6);
    MM_EQ(g_flag_faults, 0);
    const int closed = log_mark();
    close_pair(cli, srv);
    MM_TRUE(count_since(closed, OP_FSET) == 2); // each side's own word, before its drain
    pthread_mutex_lock(&g_mu);
    bool srv_set = false;
    for (int i = closed; i < g_n; i++)
        if (g_log[i].k == OP_FSET && g_log[i].dst == to_srv)
            srv_set = g_log[i].n == 5;
    pthread_mutex_unlock(&g_mu);
    MM_TRUE(srv_set);
    free(d);
    free(dst);
    g_flags = false;
}

#define CASE(name, fn) {name, fn}
#else
static void gpu_build(void) {
    MM_SKIP("this build has GPU support: the real device path is cudaipc_test's (on a GPU)");
}
#define CASE(name, fn) {name, gpu_build}
#endif

MM_TESTS = {
    CASE("ipc frame flags: written after the rows, waited for in turn, released at close", test_frame_flags),
    CASE("ipc views: the free is paid after the work on the view", test_view_free_after_work),
    CASE("ipc views: a held view's bytes are not reused; the sender times out", test_view_holds_ring),
    CASE("ipc views: a send short of space does not pay a held view's free", test_view_not_paid_by_send),
    CASE("ipc views: a conn closed with a free owed records nothing; redial works", test_close_with_free_owed),
    CASE("ipc views: MM_CUDAIPC_EAGER_FREE=1 pays copies in the receive, never views", test_eager_free),
    CASE("ipc views: ring bytes are never written before their reader let go", test_ring_accounting),
    CASE("ipc views: a view-mode data server hands over rows in place, never other kinds", test_dataserv_views),
    CASE("ipc reservations: a frame written in place is sent without a copy, ring order kept", test_reserve_in_place),
    {NULL, NULL},
};
