// SPDX-License-Identifier: MIT
// The gateway scheduler's KV admission (services/gateway/sched.c) by the capacity each attention
// shard states (gw_sched_shard_report): nothing is admitted before a statement, admission
// follows the statement (a bf16 shard's twice-the-tokens included), the gateway's --kv-mb /
// --shard-max-seqs only lower it, a shard stating nothing gets the fallback, a bad statement is
// not trusted, a shard that restarts with another capacity is followed, and the shard count is
// the router's unless --attention-shards fixes it. The mesh is a stub
// that records each plan; the test answers it as the router would.
#include <string.h>

#include "../../services/gateway/sched.c"
#include "mm_test.h"

// ---- the mesh stub: one plan in flight at a time (pipeline off) -----------------------------
static struct {
    gw_step_cb cb;
    void *arg;
    mm_ctl_msg *plan;
    int n_sent;
} g_mesh;
static int g_dummy_call;

mm_err gw_mesh_step(gw_mesh *m, mm_ctl_msg *plan, int timeout_ms, gw_step_cb cb, void *arg,
                    gw_call **call, char err[MM_ERRLEN]) {
    (void)m;
    (void)timeout_ms;
    (void)err;
    g_mesh.cb = cb;
    g_mesh.arg = arg;
    g_mesh.plan = plan;
    g_mesh.n_sent++;
    *call = (gw_call *)&g_dummy_call;
    return MM_OK;
}

void gw_call_detach(gw_call *c) { (void)c; }

// answer the plan in flight: every seq that samples gets token 7
static void answer_plan(void) {
    MM_TRUE(g_mesh.cb != NULL);
    const Mmctl__StepPlan *p = g_mesh.plan->step_plan;
    Mmctl__SeqResult rs[64], *rp[64];
    MM_TRUE(p->n_seqs <= 64);
    for (size_t i = 0; i < p->n_seqs; i++) {
        mmctl__seq_result__init(&rs[i]);
        rs[i].seq_id = p->seqs[i]->seq_id;
        rs[i].token = p->seqs[i]->sample ? 7 : -1;
        rp[i] = &rs[i];
    }
    Mmctl__StepResult r = MMCTL__STEP_RESULT__INIT;
    r.step_id = p->step_id;
    r.n_results = p->n_seqs;
    r.results = rp;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STEP_RESULT;
    env.step_result = &r;
    gw_step_cb cb = g_mesh.cb;
    g_mesh.cb = NULL;
    cb(g_mesh.arg, MM_OK, &env, "", mm_now_ns());
}

// ---- the owner's side ---------------------------------------------------------------------
static struct {
    int tokens, failed, dropped;
    mm_err last_code;
    char last_msg[MM_ERRLEN];
} g_own;

static bool on_token(void *arg, gw_seq *q, const Mmctl__SeqResult *r, uint64_t t) {
    (void)arg, (void)q, (void)r, (void)t;
    g_own.tokens++;
    return true;
}
static void on_fail(void *arg, gw_seq *q, mm_err code, const char *msg) {
    (void)arg, (void)q;
    g_own.failed++;
    g_own.last_code = code;
    snprintf(g_own.last_msg, sizeof(g_own.last_msg), "%s", msg);
}
static void on_dropped(void *arg, gw_seq *q) {
    (void)arg, (void)q;
    g_own.dropped++;
}
static void on_flush(void *arg, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    (void)arg, (void)a, (void)b, (void)c, (void)d;
}
static const gw_sched_ops k_ops = {on_token, on_fail, on_dropped, on_flush};

#define MAX_TOK 1024
struct tseq {
    gw_seq s;
    int32_t tokens[MAX_TOK];
};

// a seq of n_prompt + max_gen tokens (KV need: (n_prompt + max_gen) / 16 blocks, rounded up)
static gw_seq *mk(struct tseq *t, int n_prompt, int max_gen) {
    memset(t, 0, sizeof(*t));
    for (int i = 0; i < n_prompt; i++)
        t->tokens[i] = 1 + i;
    t->s.tokens = t->tokens;
    t->s.n_prompt = n_prompt;
    t->s.max_gen = max_gen;
    t->s.owner = t;
    return &t->s;
}

static gw_sched *open_sched(int shards, double kv_mb, int shard_max_seqs) {
    memset(&g_mesh, 0, sizeof(g_mesh));
    memset(&g_own, 0, sizeof(g_own));
    gw_sched_conf c = {.max_waiting = 64, .max_step_seqs = 16, .max_step_tokens = 4096,
                       .shards = shards, .shard_max_seqs = shard_max_seqs, .kv_mb = kv_mb,
                       .fallback_kv_blocks = 100, .fallback_max_seqs = 4, .block_size = 16,
                       .max_ctx = 4096, .step_timeout_ms = 1000, .pipeline = false};
    gw_sched *s = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(gw_sched_new(&s, &c, NULL, &k_ops, NULL, err));
    return s;
}

// what a CPU shard with --kv-mb mb states (f32, 1024 bytes per token: qwen3moe-tiny's shape)
static mm_kv_capacity cap_of(uint64_t blocks, uint32_t token_bytes, uint32_t max_seqs) {
    return (mm_kv_capacity){.block_size = 16, .blocks = blocks, .token_bytes = token_bytes,
                            .budget_bytes = blocks * 16 * token_bytes, .max_seqs = max_seqs,
                            .max_ctx = 4096};
}

static void submit(gw_sched *s, gw_seq *q) {
    char err[MM_ERRLEN] = "";
    MM_PASS(gw_sched_submit(s, &q, 1, err));
}

static void stats(gw_sched *s, int *running, int *waiting, int64_t *total, int64_t *used) {
    gw_sched_stats st;
    gw_sched_get_stats(s, &st);
    *running = st.running;
    *waiting = st.waiting;
    *total = st.kv_blocks_total;
    *used = st.kv_blocks_used;
}

// Nothing is admitted before a shard states its capacity; then exactly what fits is admitted,
// per shard, and a later statement of the second shard takes the rest.
static void test_admission_by_statement(void) {
    gw_sched *s = open_sched(2, 0, 0);
    struct tseq t[3];
    for (int i = 0; i < 3; i++)
        submit(s, mk(&t[i], 10, 150)); // 160 tokens: 10 blocks each
    int run, wait;
    int64_t total, used;
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 0);
    MM_EQ(wait, 3);
    MM_EQ(g_mesh.n_sent, 0);
    char why[160] = "";
    MM_TRUE(!gw_sched_kv_ready(s, why, sizeof(why)));
    MM_TRUE(strstr(why, "stated") != NULL);
    mm_kv_capacity c0 = cap_of(25, 1024, 8); // 400 tokens: two seqs of 10 blocks fit
    gw_sched_shard_report(s, 0, "attention/0", &c0);
    MM_TRUE(gw_sched_kv_ready(s, why, sizeof(why)));
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 2);
    MM_EQ(wait, 1);
    MM_EQ(total, 25);
    MM_EQ(used, 20);
    MM_EQ(g_mesh.n_sent, 1);
    MM_EQ(g_mesh.plan->step_plan->n_seqs, 2);
    for (size_t i = 0; i < 2; i++) // seq id % shards: both on shard 0
        MM_EQ(g_mesh.plan->step_plan->seqs[i]->seq_id % 2, 0);
    // the same statement again changes nothing
    gw_sched_shard_report(s, 0, "attention/0", &c0);
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 2);
    // shard 1 states room for one seq: the third goes there with the next plan
    mm_kv_capacity c1 = cap_of(10, 1024, 8);
    gw_sched_shard_report(s, 1, "attention/1", &c1);
    answer_plan();
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 3);
    MM_EQ(wait, 0);
    MM_EQ(total, 35);
    MM_EQ(used, 30);
    const Mmctl__StepPlan *p = g_mesh.plan->step_plan;
    MM_EQ(p->n_seqs, 3);
    MM_EQ(p->seqs[2]->seq_id % 2, 1);
    // a request bigger than any shard's is refused at submit, naming the KV
    struct tseq big;
    gw_seq *bq = mk(&big, 10, 400);
    char err[MM_ERRLEN] = "";
    MM_FAIL(gw_sched_submit(s, &bq, 1, err), MM_EINVAL);
    MM_TRUE(strstr(err, "KV cache") != NULL && strstr(err, "400") != NULL);
    MM_EQ(gw_sched_seq_kv_tokens(s), 400);
    gw_sched_stop(s);
    gw_sched_free(s);
}

// A bf16 shard (8192 bytes per token where f32 takes 16384, Qwen3-30B-A3B) states twice the
// tokens of the same --kv-mb, and the gateway admits them: no --kv-dtype needed.
static void test_bf16_statement(void) {
    gw_sched *s = open_sched(1, 0, 0);
    const uint64_t budget = 64ull << 20;
    mm_kv_capacity c = {.block_size = 16, .blocks = budget / (16 * 8192), .token_bytes = 8192,
                        .budget_bytes = budget, .max_seqs = 64, .max_ctx = 40960};
    struct tseq t[2];
    submit(s, mk(&t[0], 100, 3900));
    submit(s, mk(&t[1], 100, 3800)); // 4000 + 3900 tokens: both run at once (250 + 244 blocks
                                     // of 512; the f32 figure, 256, would run one at a time)
    gw_sched_shard_report(s, 0, "attention/0", &c);
    MM_EQ(gw_sched_seq_kv_tokens(s), 8192); // f32 by the gateway's old formula: 4096
    int run, wait;
    int64_t total, used;
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 2);
    MM_EQ(wait, 0);
    MM_EQ(total, 512);
    gw_sched_stop(s);
    gw_sched_free(s);
}

// The gateway's --kv-mb and --shard-max-seqs lower what a shard states, never raise it.
static void test_flags_lower_only(void) {
    gw_sched *s = open_sched(1, 0.25, 1); // 0.25 MiB at 1024 bytes per token: 16 blocks
    mm_kv_capacity c = cap_of(25, 1024, 8);
    gw_sched_shard_report(s, 0, "attention/0", &c);
    MM_EQ(gw_sched_seq_kv_tokens(s), 256);
    struct tseq t[2];
    submit(s, mk(&t[0], 10, 20));
    submit(s, mk(&t[1], 10, 20)); // fits the KV, but one seq at a time (--shard-max-seqs 1)
    int run, wait;
    int64_t total, used;
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 1);
    MM_EQ(wait, 1);
    MM_EQ(total, 16);
    answer_plan(); // the next plan is built: still no room for the second seq
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 1);
    MM_EQ(wait, 1);
    MM_EQ(g_mesh.plan->step_plan->n_seqs, 1);
    gw_sched_stop(s);
    gw_sched_free(s);
    s = open_sched(1, 100, 100); // above the shard's: the shard's figures hold
    gw_sched_shard_report(s, 0, "attention/0", &c);
    MM_EQ(gw_sched_seq_kv_tokens(s), 400);
    gw_sched_stop(s);
    gw_sched_free(s);
}

// A shard that states nothing (no --model) is sized by the fallback.
static void test_fallback(void) {
    gw_sched *s = open_sched(1, 0, 0);
    struct tseq t[5];
    for (int i = 0; i < 5; i++)
        submit(s, mk(&t[i], 2, 2));
    mm_kv_capacity none = {0};
    gw_sched_shard_report(s, 0, "attention/0", &none);
    char why[160];
    MM_TRUE(gw_sched_kv_ready(s, why, sizeof(why)));
    MM_EQ(gw_sched_seq_kv_tokens(s), 1600); // fallback_kv_blocks 100
    int run, wait;
    int64_t total, used;
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 4); // fallback_max_seqs
    MM_EQ(wait, 1);
    gw_sched_stop(s);
    gw_sched_free(s);
}

// Bad statements are not trusted: the shard admits nothing; once every shard is known and none
// can hold a waiting seq, that seq fails (MM_EINVAL) instead of waiting forever.
static void test_bad_statement(void) {
    gw_sched *s = open_sched(2, 0, 0);
    struct tseq t;
    submit(s, mk(&t, 10, 10));
    mm_kv_capacity bad[] = {cap_of(0, 1024, 8), cap_of(25, 1024, 0), cap_of(25, 0, 8),
                            cap_of(25, 1024, 8), cap_of(25, 1024, 8)};
    bad[3].budget_bytes = 100;  // more blocks than the budget holds
    bad[4].block_size = 32;     // not the gateway's block size
    bad[4].budget_bytes *= 2;
    char why[160];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        gw_sched_shard_report(s, 0, "attention/0", &bad[i]);
        int run, wait;
        int64_t total, used;
        stats(s, &run, &wait, &total, &used);
        MM_EQ(run, 0);
        MM_EQ(wait, 1); // shard 1 unknown yet: it may still hold it
        MM_EQ(total, 0);
        MM_TRUE(!gw_sched_kv_ready(s, why, sizeof(why)));
        MM_TRUE(strstr(why, "bad") != NULL);
        MM_EQ(g_own.failed, 0);
    }
    gw_sched_shard_report(s, 1, "attention/1", &bad[0]);
    MM_EQ(g_own.failed, 1);
    MM_EQ(g_own.last_code, MM_EINVAL);
    MM_TRUE(strstr(g_own.last_msg, "KV cache") != NULL);
    // a good statement afterwards is taken
    mm_kv_capacity good = cap_of(25, 1024, 8);
    gw_sched_shard_report(s, 1, "attention/1", &good);
    MM_TRUE(gw_sched_kv_ready(s, why, sizeof(why)));
    MM_EQ(gw_sched_seq_kv_tokens(s), 400);
    gw_sched_stop(s);
    gw_sched_free(s);
}

// A shard that rejoins with another capacity (restarted with other flags) is followed: smaller
// than what it runs, it admits nothing until enough ends; waiting seqs that it can never hold
// any more fail; larger, it admits more.
static void test_restatement(void) {
    gw_sched *s = open_sched(1, 0, 0);
    struct tseq t[4];
    submit(s, mk(&t[0], 10, 150));
    submit(s, mk(&t[1], 10, 150)); // 2 x 10 blocks running
    submit(s, mk(&t[2], 10, 150)); // waits
    mm_kv_capacity c = cap_of(25, 1024, 8);
    gw_sched_shard_report(s, 0, "attention/0", &c);
    int run, wait;
    int64_t total, used;
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 2);
    MM_EQ(wait, 1);
    c = cap_of(12, 1024, 8); // restarted smaller: 12 blocks, 20 held by the running seqs
    gw_sched_shard_report(s, 0, "attention/0", &c);
    answer_plan();
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 2);
    MM_EQ(wait, 1);
    MM_EQ(total, 12);
    gw_seq *q3 = mk(&t[3], 10, 200); // 210 tokens: more than the shard holds now (192)
    char err[MM_ERRLEN] = "";
    MM_FAIL(gw_sched_submit(s, &q3, 1, err), MM_EINVAL);
    MM_TRUE(strstr(err, "192") != NULL);
    MM_EQ(g_own.failed, 0);
    c = cap_of(8, 1024, 8); // smaller again: the waiting 10-block seq can never run now
    gw_sched_shard_report(s, 0, "attention/0", &c);
    MM_EQ(g_own.failed, 1);
    MM_EQ(g_own.last_code, MM_EINVAL);
    stats(s, &run, &wait, &total, &used);
    MM_EQ(wait, 0);
    c = cap_of(60, 1024, 8); // larger: room for more
    gw_sched_shard_report(s, 0, "attention/0", &c);
    stats(s, &run, &wait, &total, &used);
    MM_EQ(total, 60);
    MM_EQ(gw_sched_seq_kv_tokens(s), 960);
    gw_sched_stop(s);
    gw_sched_free(s);
}

// --attention-shards 0 (the default): the router's count. Nothing is admitted before the router
// has said it (a shard's statement before that is not placed); then the seqs land on its shards
// (id % count). A router that comes back with another count fails the running seqs of the old
// count at once and pauses admission until the plan in flight is answered, then admission
// starts over from the new shards' statements. A fixed
// --attention-shards keeps its count whatever the router says.
static void test_router_shard_count(void) {
    gw_sched *s = open_sched(0, 0, 0);
    struct tseq t[5];
    gw_seq *q[5];
    for (int i = 0; i < 3; i++)
        submit(s, q[i] = mk(&t[i], 10, 150)); // 10 blocks each
    int run, wait;
    int64_t total, used;
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 0);
    MM_EQ(wait, 3);
    char why[160] = "";
    MM_TRUE(!gw_sched_kv_ready(s, why, sizeof(why)));
    MM_TRUE(strstr(why, "router has not reported") != NULL);
    mm_kv_capacity c0 = cap_of(25, 1024, 8), c1 = cap_of(10, 1024, 8);
    gw_sched_shard_report(s, 0, "attention/0", &c0); // before the count: not placed
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 0);
    MM_EQ(g_mesh.n_sent, 0);
    gw_sched_router_limits(s, 0, 0, 70000); // above GW_MAX_SHARDS: ignored
    MM_EQ(s->n_sh, 0);
    gw_sched_router_limits(s, 0, 0, 2);
    MM_EQ(s->n_sh, 2);
    gw_sched_shard_report(s, 0, "attention/0", &c0);
    gw_sched_shard_report(s, 1, "attention/1", &c1);
    MM_TRUE(gw_sched_kv_ready(s, why, sizeof(why)));
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 2); // both on shard 0 (most free blocks); the third waits for the plan slot
    MM_EQ(total, 35);
    MM_EQ(g_mesh.plan->step_plan->n_seqs, 2);
    MM_EQ(g_mesh.plan->step_plan->seqs[0]->seq_id % 2, 0);
    MM_EQ(g_mesh.plan->step_plan->seqs[1]->seq_id % 2, 0);
    answer_plan();
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 3);
    MM_EQ(g_mesh.plan->step_plan->seqs[2]->seq_id % 2, 1); // shard 1 had the most room left
    // the router comes back with 3 shards: the 2-shard seqs fail at once (their KV is on the
    // old layout), and nothing new is admitted until the plan in flight is answered
    gw_sched_router_limits(s, 0, 0, 3);
    MM_EQ(g_own.failed, 3);
    MM_EQ(g_own.last_code, MM_EPEERDOWN);
    MM_TRUE(strstr(g_own.last_msg, "shard count changed from 2 to 3") != NULL);
    MM_EQ(s->n_sh, 2);
    submit(s, q[3] = mk(&t[3], 10, 20));
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 0);
    MM_EQ(wait, 1);
    answer_plan(); // the plan in flight held them: they are dropped with its result
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 0);
    MM_EQ(s->n_sh, 3);
    MM_EQ(total, 0); // fresh records: nothing admitted before the new shards state
    MM_EQ(wait, 1);
    mm_kv_capacity c2 = cap_of(40, 1024, 8);
    gw_sched_shard_report(s, 2, "attention/2", &c2);
    stats(s, &run, &wait, &total, &used);
    MM_EQ(run, 1);
    MM_EQ(total, 40);
    const Mmctl__StepPlan *p = g_mesh.plan->step_plan;
    MM_EQ(p->seqs[p->n_seqs - 1]->seq_id % 3, 2);
    gw_sched_router_limits(s, 0, 0, 3); // the same count again: nothing changes
    MM_EQ(s->n_sh, 3);
    stats(s, &run, &wait, &total, &used);
    MM_EQ(total, 40);
    gw_sched_stop(s);
    gw_sched_free(s);
    // a fixed count stays (the difference is logged as an error)
    s = open_sched(2, 0, 0);
    gw_sched_router_limits(s, 0, 0, 3);
    MM_EQ(s->n_sh, 2);
    gw_sched_shard_report(s, 1, "attention/1", &c1);
    submit(s, q[4] = mk(&t[4], 10, 20));
    MM_EQ(g_mesh.plan->step_plan->seqs[0]->seq_id % 2, 1);
    gw_sched_stop(s);
    gw_sched_free(s);
}

MM_TESTS = {
    {"gateway sched: admission by the shards' stated KV capacity", test_admission_by_statement},
    {"gateway sched: a bf16 shard's capacity is admitted whole", test_bf16_statement},
    {"gateway sched: --kv-mb and --shard-max-seqs only lower it", test_flags_lower_only},
    {"gateway sched: a shard stating nothing gets the fallback", test_fallback},
    {"gateway sched: bad statements are not trusted", test_bad_statement},
    {"gateway sched: a restarted shard's new capacity is followed", test_restatement},
    {"gateway sched: the router's shard count is followed", test_router_shard_count},
    {NULL, NULL},
};
