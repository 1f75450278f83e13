// SPDX-License-Identifier: MIT
// Device-frame views on links without device frames (mixed meshes, CPU builds): a data server
// started in view mode (mm_dataserv_start_view) still takes host frames into its host buffer
// and tells its handler they are not device rows (mm_dataserv_on_dev false), replies go out as
// before, and mm_conn_recv_view on a host link is refused (MM_EUNSUPP) without consuming the
// frame, which mm_conn_recv then reads. The device path itself is exercised by the GPU mesh
// invariance (kernels/cuda/device_run.sh), where views are on by default.
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../mm_test.h"
#include "mm/dataserv.h"
#include "mm/transport.h"

static int g_frames, g_on_dev;

// echo: a ROWS frame comes back as a REPLY with its floats doubled
static mm_err echo(void *arg, mm_conn *c, const mm_wire_hdr *h, void *payload) {
    (void)arg;
    g_frames++;
    g_on_dev += mm_dataserv_on_dev(payload);
    float *x = payload;
    const size_t n = (size_t)h->payload_bytes / 4;
    for (size_t i = 0; i < n; i++)
        x[i] *= 2.0f;
    mm_wire_hdr r;
    MM_TRY(mm_wire_hdr_init(&r, MM_WIRE_REPLY, MM_WIRE_F32, h->step_id, h->layer, h->n_rows,
                            h->row_dim));
    return mm_conn_send(c, &r, payload, mm_deadline_in_ms(2000));
}

static void test_view_mode_on_host_links(void) {
    char url[96], err[MM_ERRLEN] = "";
    snprintf(url, sizeof(url), "shm://mmview-%d", (int)getpid());
    mm_dataserv *ds = NULL;
    MM_PASS(mm_dataserv_start_view(&ds, url, 4096, echo, NULL, 100, NULL, err));
    mm_conn *c = NULL;
    MM_PASS(mm_transport_dial(&c, url, mm_deadline_in_ms(5000), err));
    MM_TRUE(!mm_conn_dev(c));
    for (int k = 0; k < 3; k++) {
        float x[8], y[8];
        for (int i = 0; i < 8; i++)
            x[i] = (float)(k * 10 + i);
        mm_wire_hdr h;
        MM_PASS(mm_wire_hdr_init(&h, MM_WIRE_ROWS, MM_WIRE_F32, (uint64_t)k, 2, 2, 4));
        MM_PASS(mm_conn_send(c, &h, x, mm_deadline_in_ms(2000)));
        const void *view = (const void *)x;
        mm_wire_hdr r;
        // a host link has no views: refused, the frame left for the plain receive
        MM_FAIL(mm_conn_recv_view(c, &r, y, sizeof(y), &view, mm_deadline_in_ms(2000)),
                MM_EUNSUPP);
        MM_TRUE(view == NULL);
        MM_PASS(mm_conn_recv(c, &r, y, sizeof(y), mm_deadline_in_ms(5000)));
        MM_EQ(r.kind, MM_WIRE_REPLY);
        MM_EQ(r.step_id, (uint64_t)k);
        MM_EQ(r.n_rows, 2u);
        for (int i = 0; i < 8; i++)
            MM_EQ(y[i], 2.0f * x[i]);
    }
    MM_EQ(g_frames, 3);
    MM_EQ(g_on_dev, 0);
    MM_TRUE(!mm_dataserv_on_dev(NULL));
    mm_conn_close(c);
    mm_dataserv_stop(ds);
}

MM_TESTS = {
    {"views: a view-mode data server on a host link takes host frames as before", test_view_mode_on_host_links},
    {NULL, NULL},
};
