// SPDX-License-Identifier: MIT
// `moemesh placement`: write an expert placement (docs/MESH.md): uniform over N owners, or
// balanced from a measured load CSV with the K hottest experts of each layer replicated.
#include <stdio.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/placement.h"

static int run_placement(int argc, char **argv) {
    char *model = NULL, *balanced = NULL, *out_path = NULL;
    long long owners = 0, hot = 0;
    bool uniform = false;
    mm_opt opts[] = {
        {"model", MM_OPT_STR, &model, NULL, "checkpoint directory (its config.json)"},
        {"owners", MM_OPT_INT, &owners, "0", "number of expert owners"},
        {"uniform", MM_OPT_BOOL, &uniform, "false", "expert e on owner e % N (the default)"},
        {"balanced", MM_OPT_STR, &balanced, NULL,
         "LOAD.csv (layer,expert,tokens from the owners): balance owners by load"},
        {"replicate-hot", MM_OPT_INT, &hot, "0",
         "with --balanced: one more replica of the K hottest experts of each layer"},
        {"out", MM_OPT_STR, &out_path, NULL, "write here instead of stdout"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh placement",
                  .summary = "Write an expert placement JSON for a model and N owners.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    mm_placement *p = NULL;
    FILE *f = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "placement: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    if (!model || owners < 1 || (uniform && balanced) || (hot && !balanced)) {
        fprintf(stderr, "placement: needs --model DIR --owners N (>= 1) and at most one of "
                        "--uniform or --balanced LOAD.csv; --replicate-hot K needs --balanced\n");
        goto done;
    }
    rc = 1;
    mm_model_config cfg;
    if (mm_model_config_read(model, &cfg, err) != MM_OK) {
        fprintf(stderr, "placement: %s\n", err);
        goto done;
    }
    mm_err rv = balanced ? mm_placement_balanced(&p, &cfg, (int)owners, balanced, (int)hot, err)
                         : mm_placement_uniform(&p, &cfg, (int)owners, err);
    if (rv != MM_OK) {
        fprintf(stderr, "placement: %s\n", err);
        goto done;
    }
    f = out_path ? fopen(out_path, "w") : stdout;
    if (!f) {
        fprintf(stderr, "placement: cannot write %s\n", out_path);
        goto done;
    }
    if (mm_placement_write(p, f, err) != MM_OK) {
        fprintf(stderr, "placement: %s\n", err);
        goto done;
    }
    rc = 0;
done:
    if (f && f != stdout)
        fclose(f);
    mm_placement_free(p);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_placement, "placement", "write an expert placement JSON (uniform or balanced)",
           run_placement)
