// SPDX-License-Identifier: MIT
// moemesh-drafter: the draft model for speculative decoding. The lifecycle is mm/daemon.h's;
// the role is drafter.c.
#include "drafter.h"

int main(int argc, char **argv) {
    mm_daemon_spec spec = {
        .role = "drafter",
        .summary = "moemesh drafter: proposes draft tokens for speculative decoding.",
        .extra_opts = drafter_opts,
        .handler = drafter_handle,
        .start = drafter_start,
        .stop = drafter_stop,
    };
    return mm_daemon_main(&spec, argc, argv);
}
