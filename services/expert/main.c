// SPDX-License-Identifier: MIT
// moemesh-expert: an expert owner. The lifecycle is mm/daemon.h's; the role is expert.c.
#include "expert.h"

int main(int argc, char **argv) {
    mm_daemon_spec spec = {
        .role = "expert",
        .summary = "moemesh expert owner: runs the FFNs of the experts its placement gives it.",
        .extra_opts = expert_opts,
        .start = expert_start,
        .stop = expert_stop,
    };
    return mm_daemon_main(&spec, argc, argv);
}
