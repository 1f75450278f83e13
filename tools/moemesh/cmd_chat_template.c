// SPDX-License-Identifier: MIT
// `moemesh chat-template`: renders OpenAI-style messages with a checkpoint's chat template and
// prints the prompt exactly (no trailing newline added).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cmd.h"
#include "mm/chat_template.h"
#include "mm/config.h"
#include "mm/json.h"

static int run_chat_template(int argc, char **argv) {
    char *tok_dir = NULL, *msgs_path = NULL, *tools_path = NULL, *thinking = NULL,
         *kwargs = NULL, *name = NULL;
    bool add_gen = false;
    long long repeat = 0;
    mm_opt opts[] = {
        {"tokenizer", MM_OPT_STR, &tok_dir, NULL, "checkpoint dir with tokenizer_config.json "
                                                 "or chat_template.jinja"},
        {"messages", MM_OPT_STR, &msgs_path, NULL, "JSON file: array of chat messages"},
        {"tools", MM_OPT_STR, &tools_path, NULL, "JSON file: array of tools (optional)"},
        {"add-generation-prompt", MM_OPT_BOOL, &add_gen, NULL, "append the assistant header"},
        {"enable-thinking", MM_OPT_STR, &thinking, NULL, "true|false; unset leaves it undefined"},
        {"kwargs", MM_OPT_STR, &kwargs, NULL, "JSON object of extra template variables"},
        {"template-name", MM_OPT_STR, &name, NULL, "named template (when the config has several)"},
        {"repeat", MM_OPT_INT, &repeat, "0", "benchmark: render N more times, print ms/render "
                                            "on stderr"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh chat-template",
                  .summary = "Render chat messages with a checkpoint's chat template.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 1;
    json_t *msgs = NULL, *tools = NULL, *extra = NULL;
    mm_chat_template *ct = NULL;
    char *out = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "chat-template: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    if (!tok_dir || !msgs_path) {
        fprintf(stderr, "chat-template: --tokenizer DIR and --messages FILE are required\n");
        rc = 2;
        goto done;
    }
    mm_chat_render_opts ro = {.add_generation_prompt = add_gen, .enable_thinking = -1,
                              .template_name = name};
    if (thinking) {
        if (strcmp(thinking, "true") == 0) {
            ro.enable_thinking = 1;
        } else if (strcmp(thinking, "false") == 0) {
            ro.enable_thinking = 0;
        } else {
            fprintf(stderr, "chat-template: --enable-thinking must be true or false, not '%s'\n",
                    thinking);
            rc = 2;
            goto done;
        }
    }
    if (mm_json_load_file(msgs_path, &msgs, err) != MM_OK ||
        (tools_path && mm_json_load_file(tools_path, &tools, err) != MM_OK) ||
        (kwargs && mm_json_parse(kwargs, strlen(kwargs), "--kwargs", &extra, err) != MM_OK)) {
        fprintf(stderr, "chat-template: %s\n", err);
        goto done;
    }
    ro.tools = tools;
    ro.extra = extra;
    if (mm_chat_template_open(tok_dir, &ct, err) != MM_OK ||
        mm_chat_template_render(ct, msgs, &ro, &out, NULL, err) != MM_OK) {
        fprintf(stderr, "chat-template: %s\n", err);
        goto done;
    }
    if (repeat > 0) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long long i = 0; i < repeat; i++) {
            char *again = NULL;
            size_t n = 0;
            if (mm_chat_template_render(ct, msgs, &ro, &again, &n, err) != MM_OK) {
                fprintf(stderr, "chat-template: %s\n", err);
                goto done;
            }
            free(again);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = ((double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6) /
                    (double)repeat;
        fprintf(stderr, "chat-template: %lld renders, %.3f ms/render, %zu bytes, %.1f MB/s\n",
                repeat, ms, strlen(out), (double)strlen(out) / (ms * 1e3));
    }
    fputs(out, stdout);
    rc = fflush(stdout) == 0 ? 0 : 1;
done:
    free(out);
    mm_chat_template_close(ct);
    json_decref(msgs);
    json_decref(tools);
    json_decref(extra);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_chat_template, "chat-template",
           "render chat messages with a checkpoint's chat template", run_chat_template)
