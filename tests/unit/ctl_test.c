// SPDX-License-Identifier: MIT
// Unit tests of the control plane (common/ctl.c) and identities (common/identity.c): protobuf
// round trips, rejection of garbage and of malformed envelopes, fingerprints, and a real REP
// server / REQ client over ipc:// (garbage on the wire, deadlines, async calls).
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mm/ctl.h"
#include "mm/identity.h"
#include "mm/log.h"
#include "mm/time.h"
#include "mm_test.h"

static void fill_identity(mm_identity *id, const char *role, uint32_t instance) {
    memset(id, 0, sizeof(*id));
    id->protocol_version = MM_CTL_PROTOCOL_VERSION;
    snprintf(id->build_id, sizeof(id->build_id), "0.1.0+test");
    snprintf(id->model_fp, sizeof(id->model_fp), "sha256:0123456789abcdef");
    snprintf(id->placement_fp, sizeof(id->placement_fp), "sha256:fedcba9876543210");
    snprintf(id->role, sizeof(id->role), "%s", role);
    id->instance = instance;
    snprintf(id->control_addr, sizeof(id->control_addr), "ipc:///tmp/x/%s-%u.ctl", role, instance);
    snprintf(id->data_addr, sizeof(id->data_addr), "shm://x");
    id->incarnation = 0x1122334455667788ull;
    id->pid = 4242;
    snprintf(id->host, sizeof(id->host), "box1");
    snprintf(id->device, sizeof(id->device), "cuda:1");
    id->heartbeat_ms = 250;
    snprintf(id->numerics, sizeof(id->numerics), "attention=tc");
}

// Packs env and unpacks it again (validated).
static mm_ctl_msg *round_trip(mm_ctl_msg *env) {
    nng_msg *m = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_ctl_pack(env, &m, err));
    mm_ctl_msg *out = NULL;
    mm_err rv = mm_ctl_unpack(nng_msg_body(m), nng_msg_len(m), &out, err);
    if (rv != MM_OK)
        fprintf(stderr, "unpack: %s\n", err);
    MM_PASS(rv);
    nng_msg_free(m);
    return out;
}

static void test_hello_round_trip(void) {
    mm_identity id, back;
    fill_identity(&id, "expert", 7);
    Mmctl__Identity pb;
    mm_ctl_identity_to_pb(&id, &pb);
    Mmctl__Hello hello = MMCTL__HELLO__INIT;
    hello.identity = &pb;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    env.seq = 99;
    mm_ctl_msg *out = round_trip(&env);
    MM_EQ(out->version, MM_CTL_WIRE_VERSION);
    MM_EQ(out->seq, 99);
    MM_EQ(out->body_case, MMCTL__ENVELOPE__BODY_HELLO);
    mm_ctl_identity_from_pb(out->hello->identity, &back);
    MM_TRUE(memcmp(&id, &back, sizeof(id)) == 0);
    mm_ctl_msg_free(out);
}

static const mm_kv_capacity k_cap = {.block_size = 16, .blocks = 3000, .token_bytes = 8192,
                                      .budget_bytes = 3000ull * 16 * 8192 + 100,
                                      .max_seqs = 48, .max_ctx = 40960};

// An attention shard's Hello carries its KV capacity (Identity fields 14-19) and the Member
// entries of a status answer hand it on; a daemon that states none reads back as not reported.
static void test_hello_kv_capacity(void) {
    mm_identity id, back;
    fill_identity(&id, "attention", 1);
    id.kv = k_cap;
    Mmctl__Identity pb;
    mm_ctl_identity_to_pb(&id, &pb);
    MM_EQ(pb.kv_blocks, 3000);
    MM_EQ(pb.kv_token_bytes, 8192);
    Mmctl__Hello hello = MMCTL__HELLO__INIT;
    hello.identity = &pb;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    mm_ctl_msg *out = round_trip(&env);
    mm_ctl_identity_from_pb(out->hello->identity, &back);
    MM_TRUE(memcmp(&id, &back, sizeof(id)) == 0);
    MM_TRUE(mm_kv_capacity_reported(&back.kv));
    MM_EQ(back.kv.blocks, 3000);
    MM_EQ(back.kv.block_size, 16);
    MM_EQ(back.kv.budget_bytes, 3000ull * 16 * 8192 + 100);
    MM_EQ(back.kv.max_seqs, 48);
    MM_EQ(back.kv.max_ctx, 40960);
    mm_ctl_msg_free(out);
    // the same through a StatusReply's Member (what the gateway reads)
    Mmctl__Member m = MMCTL__MEMBER__INIT, *mp = &m;
    m.identity = &pb;
    m.health = MMCTL__HEALTH__HEALTH_READY;
    Mmctl__StatusReply sr = MMCTL__STATUS_REPLY__INIT;
    mm_identity rid;
    Mmctl__Identity rpb;
    fill_identity(&rid, "router", 0);
    mm_ctl_identity_to_pb(&rid, &rpb);
    sr.router = &rpb;
    sr.n_members = 1;
    sr.members = &mp;
    mm_ctl_msg env2 = MMCTL__ENVELOPE__INIT;
    env2.body_case = MMCTL__ENVELOPE__BODY_STATUS_REPLY;
    env2.status_reply = &sr;
    out = round_trip(&env2);
    MM_EQ(out->status_reply->members[0]->identity->kv_blocks, 3000);
    MM_EQ(out->status_reply->members[0]->identity->max_seqs, 48);
    mm_ctl_msg_free(out);
    // not stated (another role, a shard without --model): all zero
    fill_identity(&id, "expert", 0);
    mm_ctl_identity_to_pb(&id, &pb);
    env.hello = &hello;
    out = round_trip(&env);
    mm_ctl_identity_from_pb(out->hello->identity, &back);
    MM_TRUE(!mm_kv_capacity_reported(&back.kv));
    mm_ctl_msg_free(out);
}

// A peer's stated capacity is checked field by field before anyone trusts it.
static void test_kv_capacity_check(void) {
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_kv_capacity_check(&k_cap, err));
    mm_kv_capacity c = {0};
    MM_TRUE(!mm_kv_capacity_reported(&c));
    MM_FAIL(mm_kv_capacity_check(&c, err), MM_EINVAL);
    static const struct {
        const char *field;
        int which;
        uint64_t v;
    } bad[] = {{"block size", 0, 0},       {"block size", 0, 5000},
               {"KV blocks", 1, 0},        {"KV blocks", 1, 1ull << 31},
               {"bytes per token", 2, 0},  {"bytes per token", 2, (1ull << 30) + 1},
               {"budget", 3, 0},           {"budget", 3, 3000ull * 16 * 8192 - 1},
               {"max seqs", 4, 0},         {"max seqs", 4, (1u << 20) + 1},
               {"max ctx", 5, 0},          {"max ctx", 5, (1u << 24) + 1},
               {"KV tokens", 6, 0}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        c = k_cap;
        switch (bad[i].which) {
        case 0: c.block_size = (uint32_t)bad[i].v; break;
        case 1: c.blocks = bad[i].v; break;
        case 2: c.token_bytes = (uint32_t)bad[i].v; break;
        case 3: c.budget_bytes = bad[i].v; break;
        case 4: c.max_seqs = (uint32_t)bad[i].v; break;
        case 5: c.max_ctx = (uint32_t)bad[i].v; break;
        default: // 2^40 tokens and more: 2^31-1 blocks of 4096
            c.blocks = 0x7fffffffull;
            c.block_size = 4096;
            c.token_bytes = 1;
            c.budget_bytes = ~0ull;
        }
        err[0] = 0;
        MM_FAIL(mm_kv_capacity_check(&c, err), MM_EINVAL);
        if (!strstr(err, bad[i].field))
            fprintf(stderr, "case %zu: '%s' does not name %s\n", i, err, bad[i].field);
        MM_TRUE(strstr(err, bad[i].field) != NULL);
    }
}

static void test_status_round_trip(void) {
    mm_identity ids[3];
    Mmctl__Identity pbs[3];
    Mmctl__Member ms[3], *mps[3];
    const char *roles[3] = {"router", "attention", "drafter"};
    for (int i = 0; i < 3; i++) {
        fill_identity(&ids[i], roles[i], (uint32_t)i);
        mm_ctl_identity_to_pb(&ids[i], &pbs[i]);
        mmctl__member__init(&ms[i]);
        ms[i].identity = &pbs[i];
        ms[i].health = i == 2 ? MMCTL__HEALTH__HEALTH_DOWN : MMCTL__HEALTH__HEALTH_READY;
        ms[i].detail = "d";
        ms[i].last_seen_ms_ago = 10u * (unsigned)i;
        ms[i].joins = (uint32_t)i + 1;
        mps[i] = &ms[i];
    }
    Mmctl__StatusReply sr = MMCTL__STATUS_REPLY__INIT;
    sr.router = &pbs[0];
    sr.n_members = 3;
    sr.members = mps;
    sr.down_after_ms = 1000;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REPLY;
    env.status_reply = &sr;
    mm_ctl_msg *out = round_trip(&env);
    MM_EQ(out->status_reply->n_members, 3);
    MM_EQ(out->status_reply->down_after_ms, 1000);
    MM_STREQ(out->status_reply->members[1]->identity->role, "attention");
    MM_EQ(out->status_reply->members[2]->health, MMCTL__HEALTH__HEALTH_DOWN);
    MM_EQ(out->status_reply->members[2]->joins, 3);
    MM_STREQ(mm_ctl_body_name(out), "status_reply");
    mm_ctl_msg_free(out);
}

static void test_small_bodies_round_trip(void) {
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *out;
    Mmctl__Heartbeat hb = MMCTL__HEARTBEAT__INIT;
    hb.role = "gateway";
    hb.instance = 3;
    hb.incarnation = 77;
    hb.seq = 5;
    hb.health = MMCTL__HEALTH__HEALTH_DRAINING;
    hb.detail = "http ready";
    env.body_case = MMCTL__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    out = round_trip(&env);
    MM_STREQ(out->heartbeat->role, "gateway");
    MM_EQ(out->heartbeat->incarnation, 77);
    MM_EQ(out->heartbeat->health, MMCTL__HEALTH__HEALTH_DRAINING);
    mm_ctl_msg_free(out);

    Mmctl__HeartbeatAck ack = MMCTL__HEARTBEAT_ACK__INIT;
    ack.action = MMCTL__HEARTBEAT_ACK__ACTION__ACTION_REJOIN;
    env.body_case = MMCTL__ENVELOPE__BODY_HEARTBEAT_ACK;
    env.heartbeat_ack = &ack;
    out = round_trip(&env);
    MM_EQ(out->heartbeat_ack->action, MMCTL__HEARTBEAT_ACK__ACTION__ACTION_REJOIN);
    mm_ctl_msg_free(out);

    mm_identity rid;
    fill_identity(&rid, "router", 0);
    Mmctl__Identity rpb;
    mm_ctl_identity_to_pb(&rid, &rpb);
    Mmctl__Refused rf = MMCTL__REFUSED__INIT;
    rf.field = "model fingerprint";
    rf.router_value = "sha256:aaaa";
    rf.daemon_value = "sha256:bbbb";
    rf.reason = "why";
    rf.router = &rpb;
    env.body_case = MMCTL__ENVELOPE__BODY_REFUSED;
    env.refused = &rf;
    out = round_trip(&env);
    MM_STREQ(out->refused->daemon_value, "sha256:bbbb");
    mm_ctl_msg_free(out);

    Mmctl__Shutdown sd = MMCTL__SHUTDOWN__INIT;
    sd.reason = "maintenance";
    env.body_case = MMCTL__ENVELOPE__BODY_SHUTDOWN;
    env.shutdown = &sd;
    out = round_trip(&env);
    MM_STREQ(out->shutdown->reason, "maintenance");
    mm_ctl_msg_free(out);

    Mmctl__Drain dr = MMCTL__DRAIN__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_DRAIN;
    env.drain = &dr;
    out = round_trip(&env);
    MM_EQ(out->body_case, MMCTL__ENVELOPE__BODY_DRAIN);
    mm_ctl_msg_free(out);
}

static void test_garbage_rejected(void) {
    char err[MM_ERRLEN];
    mm_ctl_msg *out = NULL;
    unsigned char buf[512];
    unsigned seed = 12345;
    int rejected = 0;
    for (int i = 0; i < 5000; i++) {
        size_t n = (size_t)(rand_r(&seed) % (int)sizeof(buf));
        for (size_t k = 0; k < n; k++)
            buf[k] = (unsigned char)rand_r(&seed);
        mm_err rv = mm_ctl_unpack(buf, n, &out, err);
        if (rv == MM_OK) { // random bytes that happen to decode must still be a valid envelope
            MM_PASS(mm_ctl_validate(out, err));
            mm_ctl_msg_free(out);
        } else {
            MM_EQ(rv, MM_EPROTO);
            MM_NULL(out);
            rejected++;
        }
    }
    MM_TRUE(rejected > 4900);
    MM_FAIL(mm_ctl_unpack("", 0, &out, err), MM_EPROTO); // empty: no version, no body
    MM_FAIL(mm_ctl_unpack("\xff\xff\xff", 3, &out, err), MM_EPROTO);
    MM_TRUE(strstr(err, "decode") != NULL || strstr(err, "version") != NULL);
}

static void test_truncated_rejected(void) {
    mm_identity id;
    fill_identity(&id, "attention", 1);
    Mmctl__Identity pb;
    mm_ctl_identity_to_pb(&id, &pb);
    Mmctl__Hello hello = MMCTL__HELLO__INIT;
    hello.identity = &pb;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    nng_msg *m = NULL;
    char err[MM_ERRLEN];
    MM_PASS(mm_ctl_pack(&env, &m, err));
    size_t n = nng_msg_len(m);
    int rejected = 0;
    for (size_t cut = 1; cut < n; cut++) {
        mm_ctl_msg *out = NULL;
        if (mm_ctl_unpack(nng_msg_body(m), cut, &out, err) == MM_EPROTO)
            rejected++;
        mm_ctl_msg_free(out);
    }
    MM_TRUE(rejected >= (int)n - 2); // a cut at a field boundary may still decode validly
    nng_msg_free(m);
}

static mm_err pack_unpack_raw(mm_ctl_msg *env, char *err) {
    // Packs without mm_ctl_pack (which sets the version) to test validation of what peers send.
    size_t n = mmctl__envelope__get_packed_size(env);
    unsigned char *buf = malloc(n + 1);
    mmctl__envelope__pack(env, buf);
    mm_ctl_msg *out = NULL;
    mm_err rv = mm_ctl_unpack(buf, n, &out, err);
    mm_ctl_msg_free(out);
    free(buf);
    return rv;
}

static void test_invalid_envelopes(void) {
    char err[MM_ERRLEN];
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    Mmctl__StatusRequest sr = MMCTL__STATUS_REQUEST__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    env.version = 2;
    MM_FAIL(pack_unpack_raw(&env, err), MM_EPROTO);
    MM_TRUE(strstr(err, "wire version 2") != NULL);
    env.version = MM_CTL_WIRE_VERSION;
    MM_PASS(pack_unpack_raw(&env, err));

    mm_ctl_msg none = MMCTL__ENVELOPE__INIT;
    none.version = MM_CTL_WIRE_VERSION;
    MM_FAIL(pack_unpack_raw(&none, err), MM_EPROTO);
    MM_TRUE(strstr(err, "no known body") != NULL);

    Mmctl__Hello hello = MMCTL__HELLO__INIT; // no identity
    mm_ctl_msg h = MMCTL__ENVELOPE__INIT;
    h.version = MM_CTL_WIRE_VERSION;
    h.body_case = MMCTL__ENVELOPE__BODY_HELLO;
    h.hello = &hello;
    MM_FAIL(pack_unpack_raw(&h, err), MM_EPROTO);
    MM_TRUE(strstr(err, "identity missing") != NULL);

    mm_identity id;
    fill_identity(&id, "expert", 0);
    snprintf(id.role, sizeof(id.role), "wizard");
    Mmctl__Identity pb;
    mm_ctl_identity_to_pb(&id, &pb);
    hello.identity = &pb;
    MM_FAIL(pack_unpack_raw(&h, err), MM_EPROTO);
    MM_TRUE(strstr(err, "wizard") != NULL);

    fill_identity(&id, "expert", 0);
    mm_ctl_identity_to_pb(&id, &pb);
    char longfp[200];
    memset(longfp, 'f', sizeof(longfp) - 1);
    longfp[sizeof(longfp) - 1] = 0;
    pb.model_fingerprint = longfp;
    MM_FAIL(pack_unpack_raw(&h, err), MM_EPROTO);
    MM_TRUE(strstr(err, "model_fingerprint") != NULL);
    pb.model_fingerprint = id.model_fp;
    pb.instance = 70000;
    MM_FAIL(pack_unpack_raw(&h, err), MM_EPROTO);
    pb.instance = 1;
    MM_PASS(pack_unpack_raw(&h, err));
}

static void test_oversize_rejected(void) {
    char err[MM_ERRLEN];
    char *big = malloc(MM_CTL_MAX_MSG_BYTES + 10);
    memset(big, 'x', MM_CTL_MAX_MSG_BYTES + 9);
    big[MM_CTL_MAX_MSG_BYTES + 9] = 0;
    Mmctl__Shutdown sd = MMCTL__SHUTDOWN__INIT;
    sd.reason = big;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_SHUTDOWN;
    env.shutdown = &sd;
    nng_msg *m = NULL;
    MM_FAIL(mm_ctl_pack(&env, &m, err), MM_EINVAL);
    MM_NULL(m);
    mm_ctl_msg *out = NULL;
    MM_FAIL(mm_ctl_unpack(big, MM_CTL_MAX_MSG_BYTES + 1, &out, err), MM_EPROTO);
    big[MM_CTL_MAX_STR + 1] = 0; // a string over MM_CTL_MAX_STR in a small message
    env.version = MM_CTL_WIRE_VERSION;
    MM_FAIL(pack_unpack_raw(&env, err), MM_EPROTO);
    MM_TRUE(strstr(err, "shutdown.reason") != NULL);
    big[MM_CTL_MAX_STR] = 0;
    MM_PASS(pack_unpack_raw(&env, err));
    free(big);
}

// ---- identities ----------------------------------------------------------------------------

static void test_model_fingerprint(void) {
    char a[MM_FP_LEN], a2[MM_FP_LEN], b[MM_FP_LEN], err[MM_ERRLEN];
    MM_PASS(mm_identity_model_fingerprint(MM_TEST_DATA("models/qwen3moe-tiny"), a, err));
    MM_PASS(mm_identity_model_fingerprint(MM_TEST_DATA("models/qwen3moe-tiny"), a2, err));
    MM_PASS(mm_identity_model_fingerprint(MM_TEST_DATA("models/mixtral-tiny"), b, err));
    MM_STREQ(a, a2);
    MM_TRUE(strcmp(a, b) != 0);
    MM_TRUE(!strncmp(a, "sha256:", 7) && strlen(a) == 7 + 16);
    MM_PASS(mm_identity_model_fingerprint(NULL, a, err));
    MM_STREQ(a, "none");
    MM_FAIL(mm_identity_model_fingerprint("/nonexistent/model", a, err), MM_ENOENT);
    MM_TRUE(strstr(err, "/nonexistent/model") != NULL);
    MM_FAIL(mm_identity_model_fingerprint("tests", a, err), MM_ENOENT); // no config.json
    MM_TRUE(strstr(err, "config.json") != NULL);
}

static void test_model_fingerprint_bad_header(void) {
    char dir[] = "/tmp/mm_ctl_test_modelXXXXXX", path[256], fp[MM_FP_LEN], err[MM_ERRLEN];
    MM_TRUE(mkdtemp(dir) != NULL);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"num_experts\": 4}", f);
    fclose(f);
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    f = fopen(path, "w");
    fputs("\xff\xff\xff\xff\xff\xff\xff\x7f{}", f); // absurd header length
    fclose(f);
    MM_FAIL(mm_identity_model_fingerprint(dir, fp, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "model.safetensors") != NULL);
    remove(path);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    remove(path);
    rmdir(dir);
}

static void test_placement_fingerprint(void) {
    char a[MM_FP_LEN], b[MM_FP_LEN], c[MM_FP_LEN], err[MM_ERRLEN];
    const char *p1 = "/tmp/mm_ctl_test_p1.json", *p2 = "/tmp/mm_ctl_test_p2.json";
    FILE *f = fopen(p1, "w");
    fputs("{\"owners\": [[0,1],[2,3]], \"version\": 1}", f);
    fclose(f);
    f = fopen(p2, "w");
    fputs("{\n  \"version\" : 1,\n  \"owners\" : [ [0, 1], [2, 3] ]\n}\n", f);
    fclose(f);
    MM_PASS(mm_identity_placement_fingerprint(p1, 1, a, err));
    MM_PASS(mm_identity_placement_fingerprint(p2, 7, b, err)); // owners ignored with a file
    MM_STREQ(a, b);
    MM_PASS(mm_identity_placement_fingerprint(NULL, 2, a, err));
    MM_PASS(mm_identity_placement_fingerprint("", 2, b, err));
    MM_PASS(mm_identity_placement_fingerprint(NULL, 3, c, err));
    MM_STREQ(a, b);
    MM_TRUE(strcmp(a, c) != 0);
    MM_FAIL(mm_identity_placement_fingerprint(NULL, 0, a, err), MM_EINVAL);
    f = fopen(p1, "w");
    fputs("{not json", f);
    fclose(f);
    MM_FAIL(mm_identity_placement_fingerprint(p1, 1, a, err), MM_EFORMAT);
    MM_TRUE(strstr(err, p1) != NULL);
    MM_FAIL(mm_identity_placement_fingerprint("/nonexistent.json", 1, a, err), MM_ENOENT);
    remove(p1);
    remove(p2);
}

static void test_identity_check(void) {
    mm_identity a, b;
    fill_identity(&a, "router", 0);
    fill_identity(&b, "expert", 3);
    const char *field = NULL;
    char av[MM_ADDR_LEN], bv[MM_ADDR_LEN];
    MM_PASS(mm_identity_check(&a, &b, &field, av, bv)); // role, addresses may differ
    snprintf(b.model_fp, sizeof(b.model_fp), "sha256:bbbbbbbbbbbbbbbb");
    MM_FAIL(mm_identity_check(&a, &b, &field, av, bv), MM_EIDENTITY);
    MM_STREQ(field, "model fingerprint");
    MM_STREQ(av, "sha256:0123456789abcdef");
    MM_STREQ(bv, "sha256:bbbbbbbbbbbbbbbb");
    b.protocol_version = 9; // checked first
    MM_FAIL(mm_identity_check(&a, &b, &field, av, bv), MM_EIDENTITY);
    MM_STREQ(field, "protocol version");
    MM_STREQ(bv, "9");
    fill_identity(&b, "expert", 3);
    snprintf(b.build_id, sizeof(b.build_id), "0.2.0+other");
    MM_FAIL(mm_identity_check(&a, &b, &field, av, bv), MM_EIDENTITY);
    MM_STREQ(field, "build id");
    fill_identity(&b, "expert", 3);
    snprintf(b.placement_fp, sizeof(b.placement_fp), "sha256:1");
    MM_FAIL(mm_identity_check(&a, &b, &field, av, bv), MM_EIDENTITY);
    MM_STREQ(field, "placement fingerprint");
    // numerics: two GPU daemons must agree (the attention contract changes bits); a daemon that
    // declares none (CPU) meshes with any
    fill_identity(&b, "expert", 3);
    snprintf(a.numerics, sizeof(a.numerics), "attention=tc");
    snprintf(b.numerics, sizeof(b.numerics), "attention=f32");
    MM_FAIL(mm_identity_check(&a, &b, &field, av, bv), MM_EIDENTITY);
    MM_STREQ(field, "numerics (MM_GPU_ATT_TC)");
    MM_STREQ(av, "attention=tc");
    MM_STREQ(bv, "attention=f32");
    b.numerics[0] = '\0';
    MM_PASS(mm_identity_check(&a, &b, &field, av, bv));
    MM_PASS(mm_identity_check(&b, &a, &field, av, bv));
    snprintf(b.numerics, sizeof(b.numerics), "attention=tc");
    MM_PASS(mm_identity_check(&a, &b, &field, av, bv));
    a.numerics[0] = b.numerics[0] = '\0';
    char nm[32];
    unsetenv("MM_GPU_ATT_TC");
    mm_identity_numerics("cuda:0", nm, sizeof(nm));
    MM_STREQ(nm, "attention=tc");
    setenv("MM_GPU_ATT_TC", "0", 1);
    mm_identity_numerics("cuda:1", nm, sizeof(nm));
    MM_STREQ(nm, "attention=f32");
    unsetenv("MM_GPU_ATT_TC");
    mm_identity_numerics("hip:0", nm, sizeof(nm));
    MM_STREQ(nm, "attention=f32");
    mm_identity_numerics("cpu", nm, sizeof(nm));
    MM_STREQ(nm, "");
    MM_EQ(mm_role_index("drafter"), 4);
    MM_EQ(mm_role_index("nobody"), -1);
}

// ---- server and client over ipc -------------------------------------------------------------

static atomic_int s_handled;

static void echo_handler(void *arg, const mm_ctl_msg *req, const char *peer, nng_msg **reply) {
    (void)arg;
    MM_TRUE(peer && *peer);
    atomic_fetch_add(&s_handled, 1);
    if (req->body_case == MMCTL__ENVELOPE__BODY_SHUTDOWN) {
        *reply = mm_ctl_reply_ack(true, req->shutdown->reason); // echo the text back
        return;
    }
    *reply = NULL; // generic ack
}

static void make_url(char *buf, size_t n, const char *tag) {
    snprintf(buf, n, "ipc:///tmp/mm_ctl_test_%d/%s.ctl", (int)getpid(), tag);
}

static void test_server_client(void) {
    char url[128], err[MM_ERRLEN] = "";
    make_url(url, sizeof(url), "a");
    mm_ctl_server *srv = NULL;
    mm_ctl_client *cl = NULL;
    MM_PASS(mm_ctl_server_open(&srv, url, 2, echo_handler, NULL, err));
    MM_PASS(mm_ctl_client_open(&cl, url, err));
    Mmctl__Shutdown sd = MMCTL__SHUTDOWN__INIT;
    sd.reason = "echo me";
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    env.body_case = MMCTL__ENVELOPE__BODY_SHUTDOWN;
    env.shutdown = &sd;
    MM_PASS(mm_ctl_call(cl, &env, 2000, &rep, err));
    MM_EQ(rep->body_case, MMCTL__ENVELOPE__BODY_ACK);
    MM_TRUE(rep->ack->ok);
    MM_STREQ(rep->ack->error, "echo me");
    mm_ctl_msg_free(rep);

    // Garbage on the wire from a raw REQ socket: the server answers with an error Ack naming
    // the problem and keeps serving.
    nng_socket raw;
    MM_EQ(nng_req0_open(&raw), 0);
    MM_EQ(nng_dial(raw, url, NULL, 0), 0);
    MM_EQ(nng_socket_set_ms(raw, NNG_OPT_RECVTIMEO, 2000), 0);
    MM_EQ(nng_send(raw, "\x08\x01garbage\xff\xff", 11, 0), 0);
    void *buf = NULL;
    size_t n = 0;
    MM_EQ(nng_recv(raw, &buf, &n, NNG_FLAG_ALLOC), 0);
    mm_ctl_msg *ack = NULL;
    MM_PASS(mm_ctl_unpack(buf, n, &ack, err));
    MM_EQ(ack->body_case, MMCTL__ENVELOPE__BODY_ACK);
    MM_TRUE(!ack->ack->ok);
    MM_TRUE(strstr(ack->ack->error, "rejected") != NULL);
    mm_ctl_msg_free(ack);
    nng_free(buf, n);
    nng_close(raw);

    Mmctl__StatusRequest sr = MMCTL__STATUS_REQUEST__INIT;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    MM_PASS(mm_ctl_call(cl, &env, 2000, &rep, err));
    MM_TRUE(rep->ack->ok);
    mm_ctl_msg_free(rep);
    MM_EQ(atomic_load(&s_handled), 2); // the garbage never reached the handler
    mm_ctl_client_close(cl);
    mm_ctl_server_close(srv);
    char dir[64];
    snprintf(dir, sizeof(dir), "/tmp/mm_ctl_test_%d", (int)getpid());
    rmdir(dir);
}

static void test_call_deadline(void) {
    char url[128], err[MM_ERRLEN] = "";
    make_url(url, sizeof(url), "nobody");
    mm_ctl_client *cl = NULL;
    MM_PASS(mm_ctl_client_open(&cl, url, err));
    Mmctl__StatusRequest sr = MMCTL__STATUS_REQUEST__INIT;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    uint64_t t0 = mm_now_ms();
    MM_FAIL(mm_ctl_call(cl, &env, 200, &rep, err), MM_ETIMEDOUT);
    MM_TRUE(mm_now_ms() - t0 < 5000); // bounded (generous: busy CI machines)
    MM_NULL(rep);
    mm_ctl_client_close(cl);
    MM_FAIL(mm_ctl_client_open(&cl, "bogus://x", err), MM_EINVAL);
}

struct async_box {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int calls;
};

static void on_async_done(mm_ctl_async *call, void *arg) {
    (void)call;
    struct async_box *b = arg;
    pthread_mutex_lock(&b->mu);
    b->calls++;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static void test_async_call(void) {
    char url[128], err[MM_ERRLEN] = "";
    make_url(url, sizeof(url), "async");
    mm_ctl_server *srv = NULL;
    mm_ctl_client *cl = NULL;
    MM_PASS(mm_ctl_server_open(&srv, url, 2, echo_handler, NULL, err));
    MM_PASS(mm_ctl_client_open(&cl, url, err));
    struct async_box box = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    Mmctl__StatusRequest sr = MMCTL__STATUS_REQUEST__INIT;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    env.body_case = MMCTL__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    mm_ctl_async *a = NULL;
    MM_PASS(mm_ctl_call_start(cl, &env, 2000, on_async_done, &box, &a, err));
    pthread_mutex_lock(&box.mu);
    while (box.calls == 0)
        pthread_cond_wait(&box.cv, &box.mu); // the call's own deadline bounds this
    pthread_mutex_unlock(&box.mu);
    MM_PASS(mm_ctl_async_result(a, &rep, err));
    MM_EQ(rep->body_case, MMCTL__ENVELOPE__BODY_ACK);
    mm_ctl_msg_free(rep);
    mm_ctl_async_free(a);
    mm_ctl_server_close(srv);

    // With the server gone the call ends by its deadline, with an error, exactly once.
    MM_PASS(mm_ctl_call_start(cl, &env, 150, on_async_done, &box, &a, err));
    pthread_mutex_lock(&box.mu);
    while (box.calls == 1)
        pthread_cond_wait(&box.cv, &box.mu);
    pthread_mutex_unlock(&box.mu);
    MM_TRUE(mm_ctl_async_result(a, &rep, err) != MM_OK);
    MM_NULL(rep);
    mm_ctl_async_free(a);
    usleep(50000);
    MM_EQ(box.calls, 2);
    mm_ctl_client_close(cl);
    char dir[64];
    snprintf(dir, sizeof(dir), "/tmp/mm_ctl_test_%d", (int)getpid());
    rmdir(dir);
}

// slow_echo_handler: a Shutdown is answered with its reason echoed, after sleeping the number
// of ms the reason names.
static void slow_echo_handler(void *arg, const mm_ctl_msg *req, const char *peer,
                              nng_msg **reply) {
    (void)arg;
    (void)peer;
    if (req->body_case == MMCTL__ENVELOPE__BODY_SHUTDOWN) {
        usleep((useconds_t)atoi(req->shutdown->reason) * 1000);
        *reply = mm_ctl_reply_ack(true, req->shutdown->reason);
        return;
    }
    *reply = NULL;
}

// Send now, collect later (cb NULL + mm_ctl_async_wait): a wait returns at its deadline when the
// reply is not in; an abandoned call's late reply is never taken for a newer call's; a call to
// nobody ends by its own deadline.
static void test_async_wait(void) {
    char url[128], err[MM_ERRLEN] = "";
    make_url(url, sizeof(url), "await");
    mm_ctl_server *srv = NULL;
    mm_ctl_client *cl = NULL;
    MM_PASS(mm_ctl_server_open(&srv, url, 2, slow_echo_handler, NULL, err));
    MM_PASS(mm_ctl_client_open(&cl, url, err));
    Mmctl__Shutdown sd = MMCTL__SHUTDOWN__INIT;
    mm_ctl_msg env = MMCTL__ENVELOPE__INIT, *rep = NULL;
    env.body_case = MMCTL__ENVELOPE__BODY_SHUTDOWN;
    env.shutdown = &sd;
    sd.reason = "400"; // answered after 400 ms
    mm_ctl_async *a = NULL, *b = NULL;
    MM_PASS(mm_ctl_call_start(cl, &env, 5000, NULL, NULL, &a, err));
    uint64_t t0 = mm_now_ms();
    MM_TRUE(!mm_ctl_async_wait(a, 0));  // a poll
    MM_TRUE(!mm_ctl_async_wait(a, 50)); // the wait's own deadline
    MM_TRUE(mm_now_ms() - t0 >= 45);
    mm_ctl_async_free(a); // abandoned: its reply ("400") comes later and must go nowhere
    sd.reason = "0";
    MM_PASS(mm_ctl_call_start(cl, &env, 5000, NULL, NULL, &b, err));
    MM_TRUE(mm_ctl_async_wait(b, 5000));
    MM_PASS(mm_ctl_async_result(b, &rep, err));
    MM_EQ(rep->body_case, MMCTL__ENVELOPE__BODY_ACK);
    MM_STREQ(rep->ack->error, "0");
    mm_ctl_msg_free(rep);
    mm_ctl_async_free(b);
    // the abandoned call's reply has now been sent; a third call still gets its own
    usleep(500000);
    sd.reason = "1";
    MM_PASS(mm_ctl_call_start(cl, &env, 5000, NULL, NULL, &b, err));
    MM_TRUE(mm_ctl_async_wait(b, 5000));
    MM_PASS(mm_ctl_async_result(b, &rep, err));
    MM_STREQ(rep->ack->error, "1");
    mm_ctl_msg_free(rep);
    mm_ctl_async_free(b);
    mm_ctl_server_close(srv);
    // nobody answers: the call ends by its own deadline (150 ms), the wait sees it end; or, when
    // the request still went out on the pipe of the server being closed, by that pipe's
    // failure (seen once under load: MM_ETRANSPORT): either way an error and no reply, in time
    MM_PASS(mm_ctl_call_start(cl, &env, 150, NULL, NULL, &b, err));
    t0 = mm_now_ms();
    MM_TRUE(mm_ctl_async_wait(b, 10000));
    MM_TRUE(mm_now_ms() - t0 < 5000);
    const mm_err end = mm_ctl_async_result(b, &rep, err);
    MM_TRUE(end == MM_ETIMEDOUT || end == MM_ETRANSPORT);
    MM_NULL(rep);
    mm_ctl_async_free(b);
    mm_ctl_client_close(cl);
    char dir[64];
    snprintf(dir, sizeof(dir), "/tmp/mm_ctl_test_%d", (int)getpid());
    rmdir(dir);
}

static void test_url_prepare(void) {
    char err[MM_ERRLEN], url[300];
    MM_PASS(mm_ctl_url_prepare("tcp://127.0.0.1:5000", err));
    memset(url, 'a', sizeof(url) - 1);
    url[sizeof(url) - 1] = 0;
    memcpy(url, "ipc:///", 7);
    MM_FAIL(mm_ctl_url_prepare(url, err), MM_EINVAL);
    MM_FAIL(mm_ctl_url_prepare("", err), MM_EINVAL);
}

MM_TESTS = {
    {"ctl hello round trip", test_hello_round_trip},
    {"ctl status round trip", test_status_round_trip},
    {"ctl hello carries the KV capacity", test_hello_kv_capacity},
    {"identity KV capacity check", test_kv_capacity_check},
    {"ctl small bodies round trip", test_small_bodies_round_trip},
    {"ctl random garbage rejected", test_garbage_rejected},
    {"ctl truncated messages rejected", test_truncated_rejected},
    {"ctl invalid envelopes rejected", test_invalid_envelopes},
    {"ctl oversize rejected", test_oversize_rejected},
    {"identity model fingerprint", test_model_fingerprint},
    {"identity model fingerprint bad header", test_model_fingerprint_bad_header},
    {"identity placement fingerprint", test_placement_fingerprint},
    {"identity check names the field", test_identity_check},
    {"ctl server and client, garbage on the wire", test_server_client},
    {"ctl call deadline", test_call_deadline},
    {"ctl async call", test_async_call},
    {"ctl async call: send now, collect later with a deadline", test_async_wait},
    {"ctl url prepare", test_url_prepare},
    {NULL, NULL},
};
