// SPDX-License-Identifier: MIT
// moemesh-router: placeholder entry point until the daemon lands (see DESIGN.md, issue 2).
#include <stdio.h>

#include "mm/config.h"
#include "mm/log.h"

int main(int argc, char **argv) {
    static mm_opt opts[] = {{0}};
    mm_cli cli = {.prog = "moemesh-router", .summary = "moemesh router daemon.", .opts = opts};
    char err[MM_ERRLEN];
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "moemesh-router: %s\n", err);
        return 2;
    }
    return 0;
}
