// SPDX-License-Identifier: MIT
// moemesh-attention: an attention shard. The lifecycle is mm/daemon.h's; the role is
// attention.c.
#include "attention.h"

int main(int argc, char **argv) {
    mm_daemon_spec spec = {
        .role = "attention",
        .summary = "moemesh attention shard: attention layers and the KV cache of its sequences.",
        .extra_opts = attention_opts,
        .start = attention_start,
        .stop = attention_stop,
    };
    return mm_daemon_main(&spec, argc, argv);
}
