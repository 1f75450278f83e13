// SPDX-License-Identifier: MIT
// `moemesh generate`: greedy continuation of a prompt with the in-process engine (KV cache,
// one token per step). Prints the new ids comma-separated on one line; with --prompt the
// prompt is tokenized with the checkpoint's tokenizer.json and --text also prints the text.
// --logprobs prints instead one line per token, "ID LOGPROB[ top=ID:LP,...]" (%.9g, from
// common/sampler.c: the format `moemesh mesh-generate` prints for the mesh).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/engine.h"
#include "mm/sampler.h"
#include "mm/step.h"
#include "mm/tokenizer.h"

static int run_generate(int argc, char **argv) {
    char *model = NULL, *ids_s = NULL, *prompt = NULL, *device = NULL;
    long long max_tokens = 16, threads = 0, top_logprobs = 0;
    bool stop_eos = false, text = false, logprobs = false;
    mm_opt opts[] = {
        {"model", MM_OPT_STR, &model, NULL, "checkpoint directory (config.json + safetensors)"},
        {"ids", MM_OPT_STR, &ids_s, NULL, "prompt token ids, comma-separated"},
        {"prompt", MM_OPT_STR, &prompt, NULL, "prompt text (tokenized with tokenizer.json)"},
        {"max-tokens", MM_OPT_INT, &max_tokens, "16", "tokens to generate"},
        {"stop-at-eos", MM_OPT_BOOL, &stop_eos, "false", "stop after the config's eos token"},
        {"text", MM_OPT_BOOL, &text, "false", "also print the decoded text on a second line"},
        {"device", MM_OPT_STR, &device, "cpu", "cpu, cuda:N or hip:N (cpu-dev: tests)"},
        {"threads", MM_OPT_INT, &threads, "0", "CPU threads (0: all cores)"},
        {"logprobs", MM_OPT_BOOL, &logprobs, "false",
         "print one line per token: id and logprob (%.9g)"},
        {"top-logprobs", MM_OPT_INT, &top_logprobs, "0",
         "with --logprobs: also the N most likely tokens (0-20)"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh generate",
                  .summary = "Print the greedy continuation of a prompt as comma-separated ids.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    int32_t *ids = NULL, *out = NULL;
    float *step_logits = NULL;
    mm_sampler *sampler = NULL;
    mm_engine *e = NULL;
    mm_tokenizer *tk = NULL;
    char *buf = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "generate: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    if (top_logprobs < 0 || top_logprobs > MM_SAMPLER_MAX_TOP) {
        fprintf(stderr, "generate: --top-logprobs %lld: must be 0..%d\n", top_logprobs,
                MM_SAMPLER_MAX_TOP);
        goto done;
    }
    if (!model || !ids_s == !prompt || max_tokens < 1 || max_tokens > 1000000) {
        fprintf(stderr, "generate: --model DIR and exactly one of --ids 1,2,3 or --prompt TEXT "
                        "are required (--max-tokens >= 1)\n");
        goto done;
    }
    rc = 1;
    int64_t n = 0;
    if (prompt || text) {
        if (mm_tokenizer_open(&tk, model, err) != MM_OK) {
            fprintf(stderr, "generate: %s\n", err);
            goto done;
        }
    }
    if (prompt) {
        size_t need = 0, len = strlen(prompt);
        ids = malloc((len + 16) * sizeof(int32_t));
        if (!ids || mm_tokenizer_encode(tk, prompt, len, false, ids, len + 16, &need, err) !=
                        MM_OK) {
            fprintf(stderr, "generate: %s\n", ids ? err : "out of memory");
            goto done;
        }
        n = (int64_t)need;
    } else if (mm_engine_ids_parse(ids_s, &ids, &n, err) != MM_OK) {
        fprintf(stderr, "generate: %s\n", err);
        rc = 2;
        goto done;
    }
    mm_engine_params ep = {.device = device, .n_threads = (int)threads, .max_seqs = 1,
                           .max_ctx = (int)(n + max_tokens)};
    if (mm_engine_open(&e, model, &ep, err) != MM_OK) {
        fprintf(stderr, "generate: %s\n", err);
        goto done;
    }
    out = malloc((size_t)max_tokens * sizeof(int32_t));
    int n_out = 0;
    int32_t eos = stop_eos ? mm_model_cfg(e->model)->eos_id : -1;
    const int vocab = mm_model_cfg(e->model)->vocab;
    if (logprobs) {
        step_logits = malloc((size_t)max_tokens * (size_t)vocab * sizeof(float));
        if (!step_logits || mm_sampler_new(&sampler, vocab) != MM_OK) {
            fprintf(stderr, "generate: out of memory\n");
            goto done;
        }
    }
    if (!out || mm_engine_generate(e, ids, n, (int)max_tokens, eos, out, &n_out, step_logits,
                                   err) != MM_OK) {
        fprintf(stderr, "generate: %s\n", out ? err : "out of memory");
        goto done;
    }
    if (logprobs) {
        for (int i = 0; i < n_out; i++) {
            mm_sample smp;
            char line[1024];
            if (mm_sampler_pick(sampler, step_logits + (size_t)i * (size_t)vocab, NULL, n + i,
                                (uint32_t)top_logprobs, &smp, err) != MM_OK) {
                fprintf(stderr, "generate: %s\n", err);
                goto done;
            }
            if (smp.token != out[i]) { // the engine's argmax and the sampler's greedy agree
                fprintf(stderr, "generate: sampler chose %d where the engine chose %d\n",
                        smp.token, out[i]);
                goto done;
            }
            mm_step_logprob_line(line, sizeof(line), smp.token, smp.logprob, smp.n_top,
                                 smp.top_ids, smp.top_logprobs);
            printf("%s\n", line);
        }
    } else {
        for (int i = 0; i < n_out; i++)
            printf(i ? ",%d" : "%d", (int)out[i]);
        printf("\n");
    }
    if (text) {
        size_t nb = 0, cap = (size_t)n_out * 64 + 16;
        buf = malloc(cap);
        if (buf && mm_tokenizer_decode(tk, out, (size_t)n_out, false, buf, cap, &nb, err) == MM_OK)
            printf("%.*s\n", (int)nb, buf);
    }
    rc = 0;
done:
    mm_sampler_free(sampler);
    free(step_logits);
    free(buf);
    free(out);
    free(ids);
    mm_tokenizer_close(tk);
    mm_engine_close(e);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_generate, "generate", "greedy continuation of a prompt (comma-separated ids)",
           run_generate)
