// SPDX-License-Identifier: MIT
// `moemesh`: the command-line tool for everything that is not a daemon. Dispatches to the
// subcommands that registered themselves (see cmd.h).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "mm/log.h"

#define MAX_COMMANDS 64
static const mm_command *g_cmds[MAX_COMMANDS];
static int g_n_cmds;

void mm_command_register(const mm_command *cmd) {
    if (g_n_cmds < MAX_COMMANDS)
        g_cmds[g_n_cmds++] = cmd;
}

static int cmp_cmd(const void *a, const void *b) {
    return strcmp((*(const mm_command *const *)a)->name, (*(const mm_command *const *)b)->name);
}

static void usage(FILE *f) {
    fprintf(f, "usage: moemesh COMMAND [options]\n\n"
               "The moemesh tool: starts a local mesh, inspects it, and runs the model, tokenizer\n"
               "and benchmarks in one process. `moemesh COMMAND --help` describes each command.\n\n"
               "commands:\n");
    for (int i = 0; i < g_n_cmds; i++)
        fprintf(f, "  %-16s %s\n", g_cmds[i]->name, g_cmds[i]->summary);
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    qsort(g_cmds, (size_t)g_n_cmds, sizeof(g_cmds[0]), cmp_cmd);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        usage(stdout);
        return argc < 2 ? 2 : 0;
    }
    for (int i = 0; i < g_n_cmds; i++)
        if (!strcmp(argv[1], g_cmds[i]->name)) {
            mm_log_init("moemesh", MM_LOG_WARN);
            return g_cmds[i]->run(argc - 1, argv + 1);
        }
    fprintf(stderr, "moemesh: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
