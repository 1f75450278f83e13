// SPDX-License-Identifier: MIT
// `moemesh mesh-generate`: a direct client of the router's step protocol (docs/MESH.md) that
// bypasses HTTP, for tests, tools and benchmarks. It schedules like the gateway: one StepPlan
// per step with every active sequence (prompt chunks and decode tokens together), releases
// finished sequences in the next plan, and prints sequence 0 in the format of
// `moemesh generate` (--logprobs: one "ID LOGPROB[ top=...]" line per token, %.9g).
// --concurrent K adds K-1 other sequences (rotations of the prompt, admitted one per step, or
// all at the first step with --stagger false, generating different lengths) that share
// sequence 0's steps.
// --draft N lets the router verify up to N drafted tokens per seq per step (SeqStep.max_draft;
// the tokens it accepts come back in SeqResult.more); the counts go to stderr.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/ctl.h"
#include "mm/engine.h"
#include "mm/mesh_trace.h"
#include "mm/step.h"
#include "mm/time.h"

struct gseq {
    uint64_t id;
    int32_t *prompt;
    int64_t n_prompt, fed; // prompt tokens sent so far
    int32_t *out;
    float *lp;
    int32_t (*top_id)[MM_SAMPLER_MAX_TOP];
    float (*top_lp)[MM_SAMPLER_MAX_TOP];
    uint32_t *n_top;
    int max_new, n_out;
    int start_step;
    uint64_t sampling_in; // the plan in flight that picks its next token (0: none)
    bool done, released, failed;
    char err[MM_CTL_MAX_STR];
};

struct flight { // a plan sent, its result not collected yet
    uint64_t step_id;
    mm_ctl_async *call;
    int n_seqs;
    bool decode_only;
    uint64_t t_send;
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// print_ms: the --timing line of n (> 0) times v in ms (sorted here): "<what> n: mean, min,
// p50, p90" and tail.
static void print_ms(double *v, int n, const char *what, const char *tail) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    fprintf(stderr, "%s %d: mean %.3f ms, min %.3f ms, p50 %.3f ms, p90 %.3f ms%s\n", what, n,
            sum / n, v[0], v[n / 2], v[n * 9 / 10], tail);
}

static void print_seq(const struct gseq *s, bool logprobs, int idx, bool label) {
    if (label)
        printf("# seq %d\n", idx);
    if (s->failed) {
        printf("error: %s\n", s->err);
        return;
    }
    if (!logprobs) {
        for (int i = 0; i < s->n_out; i++)
            printf(i ? ",%d" : "%d", (int)s->out[i]);
        printf("\n");
        return;
    }
    for (int i = 0; i < s->n_out; i++) {
        char line[1024];
        mm_step_logprob_line(line, sizeof(line), s->out[i], s->lp[i], s->n_top[i], s->top_id[i],
                             s->top_lp[i]);
        printf("%s\n", line);
    }
}

static int run_mesh_generate(int argc, char **argv) {
    char *router = NULL, *ids_s = NULL;
    long long max_tokens = 16, concurrent = 1, top = 0, chunk = 0, timeout_ms = 15000, seed = 0,
              max_batch = 256, draft = 0;
    uint64_t n_drafted = 0, n_accepted = 0, n_dsteps = 0;
    double temperature = 0;
    bool logprobs = false, all = false, timing = false, pipeline = false, stagger = true;
    mm_opt opts[] = {
        {"router", MM_OPT_STR, &router, MM_CTL_DEFAULT_ROUTER, "the router's control URL"},
        {"ids", MM_OPT_STR, &ids_s, NULL, "prompt token ids, comma-separated"},
        {"max-tokens", MM_OPT_INT, &max_tokens, "16", "tokens to generate"},
        {"logprobs", MM_OPT_BOOL, &logprobs, "false", "one line per token: id and logprob"},
        {"top-logprobs", MM_OPT_INT, &top, "0", "with --logprobs: the N best tokens too"},
        {"concurrent", MM_OPT_INT, &concurrent, "1", "sequences sharing the steps (1..256)"},
        {"stagger", MM_OPT_BOOL, &stagger, "true",
         "admit the --concurrent sequences one per step (false: all from the first step, as far "
         "as --max-batch-tokens lets their prompts in)"},
        {"chunk", MM_OPT_INT, &chunk, "0", "prefill chunk in tokens (0: whole prompt)"},
        {"max-batch-tokens", MM_OPT_INT, &max_batch, "256", "tokens per step (router's limit)"},
        {"temperature", MM_OPT_DBL, &temperature, "0", "0: greedy; else seeded sampling"},
        {"seed", MM_OPT_INT, &seed, "0", "sampling seed of seq 0 (seq j: seed + j)"},
        {"all", MM_OPT_BOOL, &all, "false", "print every sequence (with '# seq J' lines)"},
        {"draft", MM_OPT_INT, &draft, "0", "drafted tokens each seq may take per step (0: off)"},
        {"timing", MM_OPT_BOOL, &timing, "false", "print step timings to stderr"},
        {"pipeline", MM_OPT_BOOL, &pipeline, "false",
         "send each plan before the previous result is in (StepPlan.after_step; decode seqs "
         "follow the router's picks): 2 plans in flight"},
        {"timeout-ms", MM_OPT_INT, &timeout_ms, "15000", "deadline of one step's call"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh mesh-generate",
                  .summary = "Generate through a running mesh by sending StepPlans to the router "
                             "(no HTTP); prints like `moemesh generate`.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    int32_t *ids = NULL;
    int64_t n = 0;
    struct gseq *S = NULL;
    mm_ctl_client *cl = NULL;
    mm_step_builder *b = NULL;
    double *step_ms = NULL, *period_ms = NULL;
    int n_step_ms = 0, n_period = 0;
    double max_ms = -1; // the slowest decode step (call time), its index and step_id
    int max_i = -1;
    uint64_t max_id = 0;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "mesh-generate: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    if (!ids_s || max_tokens < 1 || max_tokens > 100000 || concurrent < 1 || concurrent > 256 ||
        top < 0 || top > MM_SAMPLER_MAX_TOP || chunk < 0 || max_batch < 1 || draft < 0 ||
        draft > 64) {
        fprintf(stderr, "mesh-generate: needs --ids 1,2,3; --max-tokens 1..100000, --concurrent "
                        "1..256, --top-logprobs 0..%d, --chunk >= 0\n", MM_SAMPLER_MAX_TOP);
        goto done;
    }
    if (mm_engine_ids_parse(ids_s, &ids, &n, err) != MM_OK) {
        fprintf(stderr, "mesh-generate: %s\n", err);
        goto done;
    }
    rc = 1;
    const int K = (int)concurrent;
    S = calloc((size_t)K, sizeof(*S));
    const int n_step_max = (int)(max_tokens + 8) * 4 + 1024;
    step_ms = calloc((size_t)n_step_max, sizeof(double));
    period_ms = calloc((size_t)n_step_max, sizeof(double));
    if (!S || !step_ms || !period_ms)
        goto oom;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t id_base = ((uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000) << 8;
    for (int j = 0; j < K; j++) {
        struct gseq *s = &S[j];
        s->id = id_base + (uint64_t)j;
        s->n_prompt = j == 0 ? n : (n > (j % 3) ? n - (j % 3) : 1);
        s->max_new = j == 0 ? (int)max_tokens : (int)max_tokens + (j % 4) - 1;
        if (s->max_new < 1)
            s->max_new = 1;
        s->start_step = stagger ? j : 0;
        s->prompt = malloc((size_t)s->n_prompt * 4);
        s->out = malloc((size_t)s->max_new * 4);
        s->lp = malloc((size_t)s->max_new * 4);
        s->top_id = malloc((size_t)s->max_new * sizeof(*s->top_id));
        s->top_lp = malloc((size_t)s->max_new * sizeof(*s->top_lp));
        s->n_top = calloc((size_t)s->max_new, 4);
        if (!s->prompt || !s->out || !s->lp || !s->top_id || !s->top_lp || !s->n_top)
            goto oom;
        for (int64_t t = 0; t < s->n_prompt; t++)
            s->prompt[t] = ids[(t + j) % n];
    }
    if (mm_ctl_client_open(&cl, router, err) != MM_OK ||
        mm_step_builder_new(&b, (uint32_t)K, (uint32_t)K) != MM_OK) {
        fprintf(stderr, "mesh-generate: %s\n", err[0] ? err : "out of memory");
        goto done;
    }
    uint64_t step_id = (id_base >> 8) * 16; // increasing across runs
    mm_mesh_trace_open("client"); // MM_MESH_TRACE: plan sent / result in, per step
    const uint64_t t_start = mm_now_ns();
    // Plans in flight, oldest first: 1 at a time, or 2 with --pipeline (the next plan goes out
    // before the previous result is in; its decode seqs follow the router's picks).
    const int depth = pipeline ? 2 : 1;
    struct flight fl[2] = {{0}};
    int n_fl = 0;
    uint64_t t_last_res = 0; // when the previous decode-only result came in (0: none)
    bool prev_decode = false;
    for (int step = 0;;) {
        if (n_fl < depth) { // build the next plan
            const uint64_t after = n_fl > 0 ? fl[n_fl - 1].step_id : 0;
            mm_step_builder_reset(b, ++step_id);
            mm_step_builder_set_after(b, after);
            int64_t budget = max_batch;
            int live = 0;
            bool decode_only = true;
            for (int j = 0; j < K; j++) {
                struct gseq *s = &S[j];
                if (s->done) {
                    if (!s->released) // (marked released once a plan carries it)
                        mm_step_builder_release(b, s->id);
                    continue;
                }
                live++;
                if (step < s->start_step)
                    continue;
                mm_sampling sp = {.temperature = (float)temperature, .seed = (uint64_t)seed + j};
                const uint32_t n_top = logprobs ? (uint32_t)top : 0;
                int left = s->max_new - s->n_out - 1; // tokens wanted after this step's
                if (s->fed < s->n_prompt) {
                    int64_t c = s->n_prompt - s->fed;
                    if (chunk > 0 && c > chunk)
                        c = chunk;
                    if (c > budget)
                        c = budget;
                    if (c <= 0)
                        continue;
                    bool last = s->fed + c == s->n_prompt;
                    mm_step_builder_add(b, s->id, (uint32_t)s->fed, s->prompt + s->fed,
                                        (uint32_t)c, last, &sp, n_top);
                    if (last && !logprobs)
                        mm_step_builder_set_no_logprob(b);
                    if (last)
                        s->sampling_in = step_id;
                    s->fed += c;
                    budget -= c;
                    decode_only = false;
                    continue;
                } else if (budget <= 0) {
                    continue;
                } else if (s->sampling_in != 0) {
                    // its input is the token the plan in flight picks: the router feeds it;
                    // the entry is dropped at the position of its last token (max tokens)
                    mm_step_builder_add_follow(b, s->id, (uint32_t)(s->n_prompt + s->max_new - 1),
                                               &sp, n_top);
                    left--; // (at least the token in flight comes first)
                } else {
                    mm_step_builder_add(b, s->id, (uint32_t)(s->n_prompt + s->n_out - 1),
                                        &s->out[s->n_out - 1], 1, true, &sp, n_top);
                }
                if (!logprobs) // none printed: the router may pick greedy tokens on the device
                    mm_step_builder_set_no_logprob(b);
                if (draft > 0 && !(logprobs && top > 0))
                    mm_step_builder_set_draft(b, (uint32_t)(left <= 0 ? 0
                                                            : left < draft ? left : draft));
                s->sampling_in = step_id;
                budget--;
            }
            if (live == 0 && n_fl == 0 && mm_step_builder_n_seqs(b) == 0) {
                if (mm_step_builder_env(b)->step_plan->n_release > 0) {
                    // one last plan carrying only releases
                    mm_step_builder_set_after(b, 0);
                    mm_ctl_msg *rep = NULL;
                    if (mm_ctl_call(cl, mm_step_builder_env(b), (int)timeout_ms, &rep, err) ==
                        MM_OK)
                        mm_ctl_msg_free(rep);
                }
                break;
            }
            if (mm_step_builder_n_seqs(b) > 0) {
                mm_mesh_trace(step_id, -1, "send");
                struct flight *f = &fl[n_fl];
                f->step_id = step_id;
                f->n_seqs = mm_step_builder_n_seqs(b);
                f->decode_only = decode_only;
                f->t_send = mm_now_ns();
                if (mm_ctl_call_start(cl, mm_step_builder_env(b), (int)timeout_ms, NULL, NULL,
                                      &f->call, err) != MM_OK) {
                    fprintf(stderr, "mesh-generate: step %llu: %s\n",
                            (unsigned long long)step_id, err);
                    goto done;
                }
                for (int j = 0; j < K; j++)
                    S[j].released = S[j].released || S[j].done;
                n_fl++;
                step++;
                continue;
            }
            // (nothing to send: releases ride with a later plan)
            step += n_fl == 0; // (seqs waiting for their start step)
            if (n_fl == 0)
                continue;
        }
        // collect the oldest plan's result
        struct flight *f = &fl[0];
        mm_ctl_msg *rep = NULL;
        const Mmctl__StepResult *res = NULL;
        mm_err rv = mm_ctl_async_wait(f->call, (int)timeout_ms + 1000)
                        ? mm_ctl_async_result(f->call, &rep, err)
                        : mm_errf(err, MM_ETIMEDOUT, "no answer within %lld ms", timeout_ms);
        if (rv == MM_OK)
            rv = mm_step_result_check(rep, f->step_id, (uint32_t)f->n_seqs, &res, err);
        if (rv != MM_OK) {
            fprintf(stderr, "mesh-generate: step %llu: %s\n", (unsigned long long)f->step_id,
                    err);
            mm_ctl_msg_free(rep);
            goto done;
        }
        const uint64_t t_res = mm_now_ns();
        mm_mesh_trace(f->step_id, -1, "recv");
        if (f->decode_only && n_step_ms < n_step_max) {
            const double ms = (double)(t_res - f->t_send) / 1e6;
            if (ms > max_ms) {
                max_ms = ms;
                max_i = n_step_ms;
                max_id = f->step_id;
            }
            step_ms[n_step_ms++] = ms;
            if (prev_decode && n_period < n_step_max)
                period_ms[n_period++] = (double)(t_res - t_last_res) / 1e6;
        }
        prev_decode = f->decode_only;
        t_last_res = t_res;
        for (size_t i = 0; i < res->n_results; i++) {
            const Mmctl__SeqResult *r = res->results[i];
            struct gseq *s = NULL;
            for (int j = 0; j < K && !s; j++)
                if (S[j].id == r->seq_id)
                    s = &S[j];
            if (!s)
                continue;
            if (s->sampling_in == f->step_id)
                s->sampling_in = 0; // no later plan in flight picks for it
            if (s->done)
                continue; // ended at an earlier step: its pipelined entry is dropped
            if (r->error_code != 0) {
                s->failed = s->done = true;
                snprintf(s->err, sizeof(s->err), "%s (%s)", r->error,
                         mm_strerror((mm_err)r->error_code));
                continue;
            }
            if (r->token < 0)
                continue;
            s->out[s->n_out] = r->token;
            s->lp[s->n_out] = r->logprob;
            s->n_top[s->n_out] = (uint32_t)r->n_top;
            for (size_t k = 0; k < r->n_top && k < MM_SAMPLER_MAX_TOP; k++) {
                s->top_id[s->n_out][k] = r->top[k]->token;
                s->top_lp[s->n_out][k] = r->top[k]->logprob;
            }
            if (++s->n_out >= s->max_new)
                s->done = true;
            n_drafted += r->drafted;
            n_accepted += r->n_more;
            n_dsteps += r->drafted > 0;
            for (size_t k = 0; k < r->n_more && !s->done; k++) {
                s->out[s->n_out] = r->more[k];
                s->lp[s->n_out] = r->more_logprobs[k];
                s->n_top[s->n_out] = 0;
                if (++s->n_out >= s->max_new)
                    s->done = true;
            }
        }
        mm_ctl_msg_free(rep);
        mm_ctl_async_free(f->call);
        fl[0] = fl[1];
        n_fl--;
    }
    mm_mesh_trace_flush();
    for (int j = 0; j < (all ? K : 1); j++)
        print_seq(&S[j], logprobs, j, all);
    if (timing && n_step_ms > 0) {
        print_ms(step_ms, n_step_ms, "decode steps", "");
        // a rare slow step hides in the mean: name it (index among the decode steps, step_id
        // for MM_MESH_TRACE's files)
        fprintf(stderr, "decode step max: %.3f ms at decode step %d (step_id %llu)\n", max_ms,
                max_i, (unsigned long long)max_id);
    }
    if (timing && n_period > 0) { // result to result: the step rate, pipelined or not
        print_ms(period_ms, n_period, "decode period",
                 pipeline ? " (result to result, 2 plans in flight)" : " (result to result)");
    }
    if (timing) {
        long long tok = 0;
        for (int j = 0; j < K; j++)
            tok += S[j].n_out;
        double sec = (double)(mm_now_ns() - t_start) / 1e9;
        fprintf(stderr, "generated %lld tokens in %.3f s: %.1f tokens/s (prefill included)\n",
                tok, sec, sec > 0 ? (double)tok / sec : 0.0);
    }
    if (draft > 0)
        fprintf(stderr, "drafting: drafted %llu accepted %llu in %llu seq-steps\n",
                (unsigned long long)n_drafted, (unsigned long long)n_accepted,
                (unsigned long long)n_dsteps);
    rc = 0;
    for (int j = 0; j < (all ? K : 1); j++)
        if (S[j].failed) {
            fprintf(stderr, "mesh-generate: seq %d failed: %s\n", j, S[j].err);
            rc = 1;
        }
    goto done;
oom:
    fprintf(stderr, "mesh-generate: out of memory\n");
done:
    for (int j = 0; S && j < concurrent; j++) {
        free(S[j].prompt);
        free(S[j].out);
        free(S[j].lp);
        free(S[j].top_id);
        free(S[j].top_lp);
        free(S[j].n_top);
    }
    free(S);
    free(step_ms);
    free(period_ms);
    free(ids);
    mm_step_builder_free(b);
    mm_ctl_client_close(cl);
    mm_config_fini(&cli);
    return rc;
}
MM_COMMAND(cmd_mesh_generate, "mesh-generate",
           "generate through a running mesh via StepPlans (no HTTP); prints like generate",
           run_mesh_generate)
