// SPDX-License-Identifier: MIT
// `moemesh logits`: run the in-process engine over a prompt and write every position's logits
// as float32 little-endian [T, vocab] (the format of tests/fixtures/models/*/logits_<i>.f32).
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/engine.h"

static int run_logits(int argc, char **argv) {
    char *model = NULL, *ids_s = NULL, *outp = NULL, *device = NULL;
    long long threads = 0, rows = 0;
    mm_opt opts[] = {
        {"model", MM_OPT_STR, &model, NULL, "checkpoint directory (config.json + safetensors)"},
        {"ids", MM_OPT_STR, &ids_s, NULL, "prompt token ids, comma-separated"},
        {"out", MM_OPT_STR, &outp, NULL, "output file: float32 LE [T, vocab]"},
        {"device", MM_OPT_STR, &device, "cpu", "cpu, cuda:N or hip:N (cpu-dev: tests)"},
        {"threads", MM_OPT_INT, &threads, "0", "CPU threads (0: all cores)"},
        {"prefill-rows", MM_OPT_INT, &rows, "0",
         "rows per forward call (the engine's max_rows, 0..8192; 0: the engine's default, 256)"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh logits",
                  .summary = "Write the logits of every prompt position (float32 [T, vocab]).",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    int32_t *ids = NULL;
    float *logits = NULL;
    mm_engine *e = NULL;
    FILE *f = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "logits: %s\n", err);
        goto out;
    }
    if (cli.help_shown) {
        rc = 0;
        goto out;
    }
    if (!model || !ids_s || !outp) {
        fprintf(stderr, "logits: --model DIR, --ids 1,2,3 and --out FILE are required\n");
        goto out;
    }
    if (rows < 0 || rows > 8192) {
        fprintf(stderr, "logits: --prefill-rows %lld: want 0..8192 (0: the engine's default)\n", rows);
        goto out;
    }
    int64_t n = 0;
    if (mm_engine_ids_parse(ids_s, &ids, &n, err) != MM_OK) {
        fprintf(stderr, "logits: %s\n", err);
        goto out;
    }
    rc = 1;
    mm_engine_params ep = {.device = device, .n_threads = (int)threads, .max_seqs = 1,
                           .max_ctx = (int)n, .max_rows = rows};
    if (mm_engine_open(&e, model, &ep, err) != MM_OK) {
        fprintf(stderr, "logits: %s\n", err);
        goto out;
    }
    const int vocab = mm_model_cfg(e->model)->vocab;
    logits = malloc((size_t)n * (size_t)vocab * 4);
    int32_t seq = -1;
    if (!logits || mm_kv_cache_seq_new(e->kv, &seq) != MM_OK) {
        fprintf(stderr, "logits: out of memory\n");
        goto out;
    }
    if (mm_engine_prefill(e, seq, ids, n, logits, NULL, err) != MM_OK) {
        fprintf(stderr, "logits: %s\n", err);
        goto out;
    }
    f = fopen(outp, "wb");
    if (!f || fwrite(logits, 4, (size_t)n * vocab, f) != (size_t)n * vocab) {
        fprintf(stderr, "logits: %s: %s\n", outp, strerror(errno));
        goto out;
    }
    if (fclose(f) != 0) {
        f = NULL;
        fprintf(stderr, "logits: %s: %s\n", outp, strerror(errno));
        goto out;
    }
    f = NULL;
    rc = 0;
out:
    if (f)
        fclose(f);
    free(logits);
    free(ids);
    mm_engine_close(e);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_logits, "logits", "write a prompt's logits [T, vocab] as float32", run_logits)
