// SPDX-License-Identifier: MIT
// Subcommands of the `moemesh` tool. Each lives in its own cmd_<name>.c and registers itself
// with MM_COMMAND, so adding one touches no shared file.
#ifndef MOEMESH_CMD_H
#define MOEMESH_CMD_H

typedef struct mm_command {
    const char *name;    // "logits", "up", ...
    const char *summary; // one line for `moemesh --help`
    int (*run)(int argc, char **argv); // argv[0] is the subcommand name; returns exit status
} mm_command;

void mm_command_register(const mm_command *cmd);

#define MM_COMMAND(ident, name_, summary_, fn_)                                    \
    static const mm_command ident = {.name = name_, .summary = summary_, .run = fn_}; \
    __attribute__((constructor)) static void ident##_register(void) { mm_command_register(&ident); }

#endif
