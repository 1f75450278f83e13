// SPDX-License-Identifier: MIT
// Unit tests of the mesh's common pieces: the sampler (greedy, logprobs, seeded purity, filters),
// the placement (uniform, balanced with replicas, file checks), the step-plan builder and
// result check, and the control-plane validation of step messages.
#include <math.h>
#include <nng/nng.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mm/placement.h"
#include "mm/sampler.h"
#include "mm/step.h"
#include "mm_test.h"

#define V 64

static void fill(float *x, unsigned seed) {
    for (int i = 0; i < V; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) % 10000) / 1000.0f - 5.0f;
    }
}

static void test_sampler_greedy_logprobs(void) {
    mm_sampler *s = NULL;
    float x[V];
    fill(x, 7);
    x[10] = 9.0f;
    x[20] = 9.0f; // tie: the lower id wins
    MM_PASS(mm_sampler_new(&s, V));
    mm_sample o;
    MM_PASS(mm_sampler_pick(s, x, NULL, 3, 5, &o, NULL));
    MM_EQ(o.token, 10);
    MM_EQ(o.n_top, 5u);
    MM_EQ(o.top_ids[0], 10);
    MM_EQ(o.top_ids[1], 20);
    for (uint32_t i = 1; i < o.n_top; i++)
        MM_TRUE(o.top_logprobs[i] <= o.top_logprobs[i - 1]);
    // logprobs are a normalised log-softmax of the raw logits
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp((double)x[i] - 9.0);
    MM_NEAR(o.logprob, (float)(-log(z)), 1e-5);
    MM_TRUE(o.logprob == o.top_logprobs[0]);
    // top_k == 1 and temperature 0 are greedy too
    mm_sampling sp = {.temperature = 1.0f, .top_k = 1, .seed = 9};
    mm_sample o2;
    MM_PASS(mm_sampler_pick(s, x, &sp, 3, 0, &o2, NULL));
    MM_EQ(o2.token, 10);
    MM_TRUE(o2.logprob == o.logprob);
    MM_FAIL(mm_sampler_pick(s, x, NULL, 3, MM_SAMPLER_MAX_TOP + 1, &o, NULL), MM_EINVAL);
    x[3] = NAN;
    MM_FAIL(mm_sampler_pick(s, x, NULL, 3, 0, &o, NULL), MM_EINVAL);
    mm_sampler_free(s);
}

static void test_sampler_seeded(void) {
    mm_sampler *s = NULL;
    float x[V];
    fill(x, 11);
    MM_PASS(mm_sampler_new(&s, V));
    mm_sampling sp = {.temperature = 1.5f, .seed = 1234};
    int seen[V] = {0};
    for (int pos = 0; pos < 200; pos++) {
        mm_sample a, b;
        MM_PASS(mm_sampler_pick(s, x, &sp, pos, 0, &a, NULL));
        // a pure function of (seed, pos): another call (other state in between) agrees
        mm_sampling other = {.temperature = 0.7f, .seed = 99, .top_p = 0.5f};
        MM_PASS(mm_sampler_pick(s, x, &other, pos + 1, 2, &b, NULL));
        MM_PASS(mm_sampler_pick(s, x, &sp, pos, 0, &b, NULL));
        MM_EQ(a.token, b.token);
        seen[a.token] = 1;
    }
    int distinct = 0;
    for (int i = 0; i < V; i++)
        distinct += seen[i];
    MM_TRUE(distinct > 5); // it does sample
    // top_k = 3: only the 3 best ids are ever chosen
    mm_sampling k3 = {.temperature = 5.0f, .top_k = 3, .seed = 5};
    mm_sample g;
    MM_PASS(mm_sampler_pick(s, x, NULL, 0, 3, &g, NULL));
    for (int pos = 0; pos < 100; pos++) {
        mm_sample a;
        MM_PASS(mm_sampler_pick(s, x, &k3, pos, 0, &a, NULL));
        MM_TRUE(a.token == g.top_ids[0] || a.token == g.top_ids[1] || a.token == g.top_ids[2]);
    }
    // min_p = 1: only the argmax survives
    mm_sampling mp = {.temperature = 2.0f, .min_p = 1.0f, .seed = 5};
    mm_sample a;
    MM_PASS(mm_sampler_pick(s, x, &mp, 17, 0, &a, NULL));
    MM_EQ(a.token, g.top_ids[0]);
    mm_sampling bad = {.temperature = -1.0f};
    MM_FAIL(mm_sampler_pick(s, x, &bad, 0, 0, &a, NULL), MM_EINVAL);
    mm_sampler_free(s);
}

static void cfg_tiny(mm_model_config *c) {
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_model_config_read("tests/fixtures/models/qwen3moe-tiny", c, err);
    if (rv != MM_OK)
        MM_SKIP("no fixture: %s", err);
}

static void test_placement_uniform_balanced(void) {
    mm_model_config c;
    cfg_tiny(&c);
    mm_placement *p = NULL;
    MM_PASS(mm_placement_uniform(&p, &c, 3, NULL));
    MM_EQ(p->n_experts, c.n_experts);
    for (int e = 0; e < c.n_experts; e++) {
        MM_EQ(mm_placement_n_rep(p, 1, e), 1);
        MM_EQ(mm_placement_owner(p, 1, e, 0), e % 3);
    }
    MM_EQ(mm_placement_count(p, 0) + mm_placement_count(p, 1) + mm_placement_count(p, 2),
          (long)c.n_layers * c.n_experts);
    mm_placement_free(p);
    char csv[] = "/tmp/mm-load-XXXXXX";
    int fd = mkstemp(csv);
    MM_TRUE(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "layer,expert,tokens\n0,5,1000\n0,6,900\n1,2,50\nlayer,expert,tokens\n0,5,10\n");
    fclose(f);
    MM_PASS(mm_placement_balanced(&p, &c, 2, csv, 1, NULL));
    // the hottest experts of layer 0 sit on different owners; the hottest has a replica
    MM_TRUE(mm_placement_owner(p, 0, 5, 0) != mm_placement_owner(p, 0, 6, 0));
    MM_EQ(mm_placement_n_rep(p, 0, 5), 2);
    MM_EQ(mm_placement_n_rep(p, 0, 7), 1);
    // write, read back, same lists
    char js[] = "/tmp/mm-pl-XXXXXX";
    fd = mkstemp(js);
    f = fdopen(fd, "w");
    MM_PASS(mm_placement_write(p, f, NULL));
    fclose(f);
    mm_placement *q = NULL;
    MM_PASS(mm_placement_load(&q, js, &c, 2, NULL));
    for (int l = 0; l < c.n_layers; l++)
        for (int e = 0; e < c.n_experts; e++) {
            MM_EQ(mm_placement_n_rep(q, l, e), mm_placement_n_rep(p, l, e));
            for (int r = 0; r < mm_placement_n_rep(p, l, e); r++)
                MM_EQ(mm_placement_owner(q, l, e, r), mm_placement_owner(p, l, e, r));
        }
    mm_placement_free(q); // (a failing load sets *out to NULL: free the first one before it)
    char err[MM_ERRLEN] = "";
    MM_FAIL(mm_placement_load(&q, js, &c, 3, err), MM_EINVAL); // owner count disagrees
    MM_TRUE(strstr(err, "--owners 3") != NULL);
    MM_TRUE(q == NULL);
    mm_placement_free(p);
    f = fopen(csv, "w");
    fprintf(f, "0,5\n");
    fclose(f);
    MM_FAIL(mm_placement_balanced(&p, &c, 2, csv, 0, err), MM_EFORMAT);
    MM_TRUE(strstr(err, ":1:") != NULL);
    unlink(csv);
    unlink(js);
}

static void test_placement_bad_files(void) {
    mm_model_config c;
    cfg_tiny(&c);
    const char *bad[] = {
        "{\"version\":2,\"n_layers\":4,\"n_experts\":16,\"n_owners\":1,\"experts\":[]}",
        "{\"version\":1,\"n_layers\":3,\"n_experts\":16,\"n_owners\":1,\"experts\":[]}",
        "{\"version\":1,\"n_layers\":4,\"n_experts\":16,\"n_owners\":1,\"experts\":[[],[],[],[]]}",
        "not json",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char path[] = "/tmp/mm-plb-XXXXXX";
        int fd = mkstemp(path);
        FILE *f = fdopen(fd, "w");
        fputs(bad[i], f);
        fclose(f);
        mm_placement *p = NULL;
        char err[MM_ERRLEN] = "";
        MM_TRUE(mm_placement_load(&p, path, &c, 0, err) != MM_OK);
        MM_TRUE(strstr(err, path) != NULL); // names the file
        MM_NULL(p);
        unlink(path);
    }
    // an owner listed twice for one expert, and an owner id out of range
    char path[] = "/tmp/mm-plb-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "{\"version\":1,\"n_layers\":4,\"n_experts\":16,\"n_owners\":2,\"experts\":[");
    for (int l = 0; l < 4; l++) {
        fprintf(f, l ? ",[" : "[");
        for (int e = 0; e < 16; e++)
            fprintf(f, e ? ",%s" : "%s", l == 2 && e == 3 ? "[1,1]" : "[0]");
        fprintf(f, "]");
    }
    fprintf(f, "]}");
    fclose(f);
    mm_placement *p = NULL;
    char err[MM_ERRLEN] = "";
    MM_FAIL(mm_placement_load(&p, path, &c, 2, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "layer 2 expert 3") != NULL);
    unlink(path);
}

static void test_step_builder_roundtrip(void) {
    mm_step_builder *b = NULL;
    MM_PASS(mm_step_builder_new(&b, 2, 1));
    int32_t t1[3] = {1, 2, 3}, t2[1] = {9};
    mm_sampling sp = {.temperature = 0.5f, .seed = 42, .top_k = 4};
    mm_step_builder_reset(b, 77);
    MM_PASS(mm_step_builder_add(b, 100, 0, t1, 3, true, NULL, 2));
    MM_PASS(mm_step_builder_add(b, 101, 5, t2, 1, true, &sp, 0));
    MM_FAIL(mm_step_builder_add(b, 102, 0, t2, 1, true, NULL, 0), MM_EFULL);
    MM_FAIL(mm_step_builder_add(b, 102, 0, t2, 0, true, NULL, 0), MM_EINVAL);
    MM_PASS(mm_step_builder_release(b, 50));
    MM_FAIL(mm_step_builder_release(b, 51), MM_EFULL);
    nng_msg *m = NULL;
    MM_PASS(mm_ctl_pack(mm_step_builder_env(b), &m, NULL));
    mm_ctl_msg *env = NULL;
    MM_PASS(mm_ctl_unpack(nng_msg_body(m), nng_msg_len(m), &env, NULL));
    nng_msg_free(m);
    MM_EQ(env->body_case, MMCTL__ENVELOPE__BODY_STEP_PLAN);
    const Mmctl__StepPlan *p = env->step_plan;
    MM_EQ(p->step_id, 77u);
    MM_EQ(p->n_seqs, 2u);
    MM_EQ(p->seqs[0]->n_tokens, 3u);
    MM_EQ(p->seqs[0]->tokens[2], 3);
    MM_EQ(p->seqs[0]->logprobs, 2u);
    MM_NULL(p->seqs[0]->sampling);
    mm_sampling back;
    mm_step_sampling_from_pb(p->seqs[1]->sampling, &back);
    MM_TRUE(back.temperature == 0.5f && back.seed == 42 && back.top_k == 4);
    MM_EQ(p->n_release, 1u);
    MM_EQ(p->release[0], 50u);
    mm_ctl_msg_free(env);
    // a seq without tokens is refused by validation
    Mmctl__SeqStep q = MMCTL__SEQ_STEP__INIT;
    Mmctl__SeqStep *qs[1] = {&q};
    Mmctl__StepPlan plan = MMCTL__STEP_PLAN__INIT;
    plan.n_seqs = 1;
    plan.seqs = qs;
    mm_ctl_msg e2 = MMCTL__ENVELOPE__INIT;
    e2.version = MM_CTL_WIRE_VERSION;
    e2.body_case = MMCTL__ENVELOPE__BODY_STEP_PLAN;
    e2.step_plan = &plan;
    char err[MM_ERRLEN] = "";
    MM_FAIL(mm_ctl_validate(&e2, err), MM_EPROTO);
    MM_TRUE(strstr(err, "no tokens") != NULL);
    // pipelined plans: a follow entry needs after_step, no tokens and pos 0
    q.follow = true;
    MM_FAIL(mm_ctl_validate(&e2, err), MM_EPROTO);
    MM_TRUE(strstr(err, "after_step") != NULL);
    plan.after_step = 76;
    MM_PASS(mm_ctl_validate(&e2, err));
    q.pos = 3;
    MM_FAIL(mm_ctl_validate(&e2, err), MM_EPROTO);
    q.pos = 0;
    q.n_tokens = 1;
    q.tokens = t2;
    MM_FAIL(mm_ctl_validate(&e2, err), MM_EPROTO);
    MM_TRUE(strstr(err, "follows the router's pick") != NULL);
    // and the builder makes one that round-trips
    mm_step_builder_reset(b, 78);
    mm_step_builder_set_after(b, 77);
    MM_PASS(mm_step_builder_add_follow(b, 100, 40, &sp, 0));
    MM_PASS(mm_ctl_pack(mm_step_builder_env(b), &m, NULL));
    MM_PASS(mm_ctl_unpack(nng_msg_body(m), nng_msg_len(m), &env, NULL));
    nng_msg_free(m);
    MM_EQ(env->step_plan->after_step, 77u);
    MM_TRUE(env->step_plan->seqs[0]->follow);
    MM_EQ(env->step_plan->seqs[0]->end_pos, 40u);
    MM_EQ(env->step_plan->seqs[0]->n_tokens, 0u);
    mm_ctl_msg_free(env);
    // result check: wrong step id, wrong count, whole-step error
    Mmctl__StepResult r = MMCTL__STEP_RESULT__INIT;
    r.step_id = 77;
    r.error = "";
    mm_ctl_msg re = MMCTL__ENVELOPE__INIT;
    re.body_case = MMCTL__ENVELOPE__BODY_STEP_RESULT;
    re.step_result = &r;
    const Mmctl__StepResult *res = NULL;
    MM_FAIL(mm_step_result_check(&re, 78, 0, &res, err), MM_EPROTO);
    MM_FAIL(mm_step_result_check(&re, 77, 2, &res, err), MM_EPROTO);
    MM_PASS(mm_step_result_check(&re, 77, 0, &res, err));
    r.error_code = MM_EINVAL;
    r.error = "too many tokens";
    MM_FAIL(mm_step_result_check(&re, 77, 0, &res, err), MM_EINVAL);
    MM_TRUE(strstr(err, "too many tokens") != NULL);
    char line[256];
    int32_t ids[2] = {5, 6};
    float lps[2] = {-0.25f, -1.5f};
    mm_step_logprob_line(line, sizeof(line), 5, -0.25f, 2, ids, lps);
    MM_STREQ(line, "5 -0.25 top=5:-0.25,6:-1.5");
    mm_step_builder_free(b);
}

MM_TESTS = {
    {"sampler greedy and logprobs", test_sampler_greedy_logprobs},
    {"sampler seeded is a pure function of seed and position", test_sampler_seeded},
    {"placement uniform, balanced with replicas, write and load", test_placement_uniform_balanced},
    {"placement files with errors are refused naming the file", test_placement_bad_files},
    {"step plan builder, validation and result check", test_step_builder_roundtrip},
    {NULL, NULL},
};
