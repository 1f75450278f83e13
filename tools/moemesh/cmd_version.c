// SPDX-License-Identifier: MIT
// `moemesh version`: the build id every daemon also reports in its hello.
#include <stdio.h>

#include "cmd.h"
#include "mm/build.h"

static int run_version(int argc, char **argv) {
    (void)argc;
    (void)argv;
    printf("moemesh %s\n", mm_build_id());
    return 0;
}
MM_COMMAND(cmd_version, "version", "print the build id", run_version)
