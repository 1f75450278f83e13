// SPDX-License-Identifier: MIT
// Unit tests of common/: error space, config resolution order, arena, JSON getters.
#include <stdlib.h>

#include "mm/arena.h"
#include "mm/config.h"
#include "mm/json.h"
#include "mm_test.h"

static void test_strerror(void) {
    MM_STREQ(mm_strerror(MM_OK), "success");
    MM_STREQ(mm_strerror(MM_EINVAL), "invalid argument");
    MM_STREQ(mm_strerror((mm_err)9999), "unknown error");
}

static char *s_model;
static long long s_port;
static double s_temp;
static bool s_flag;
static mm_opt s_opts[] = {
    {"model", MM_OPT_STR, &s_model, "m0", "model dir"},
    {"port", MM_OPT_INT, &s_port, "8000", "port"},
    {"temperature", MM_OPT_DBL, &s_temp, "1.0", "temperature"},
    {"stream", MM_OPT_BOOL, &s_flag, NULL, "stream"},
    {0},
};

static void test_config_order(void) {
    char err[MM_ERRLEN] = "";
    const char *path = "/tmp/mm_common_test_cfg.json";
    FILE *f = fopen(path, "w");
    MM_TRUE(f != NULL);
    fprintf(f, "{\"model\": \"from-file\", \"port\": 9000, \"temperature\": 0.5}");
    fclose(f);
    setenv("MM_PORT", "9100", 1);
    char *argv[] = {"prog", "--config", (char *)path, "pos1", "--temperature=0.25", "--stream",
                    "pos2", NULL};
    mm_cli cli = {.prog = "prog", .summary = "t", .opts = s_opts};
    MM_PASS(mm_config_parse(&cli, 7, argv, err));
    MM_STREQ(s_model, "from-file");
    MM_EQ(s_port, 9100);
    MM_NEAR(s_temp, 0.25, 0);
    MM_TRUE(s_flag);
    MM_EQ(cli.n_args, 2);
    MM_STREQ(cli.args[0], "pos1");
    MM_STREQ(cli.args[1], "pos2");
    mm_config_fini(&cli);
    unsetenv("MM_PORT");
    remove(path);
}

static void test_config_errors(void) {
    char err[MM_ERRLEN] = "";
    mm_cli cli = {.prog = "prog", .summary = "t", .opts = s_opts};
    char *a1[] = {"prog", "--port", "eighty", NULL};
    MM_FAIL(mm_config_parse(&cli, 3, a1, err), MM_EINVAL);
    MM_TRUE(strstr(err, "--port") && strstr(err, "eighty"));
    char *a2[] = {"prog", "--bogus", NULL};
    MM_FAIL(mm_config_parse(&cli, 2, a2, err), MM_EINVAL);
    MM_TRUE(strstr(err, "--bogus") != NULL);
    char *a3[] = {"prog", "--model", NULL};
    MM_FAIL(mm_config_parse(&cli, 2, a3, err), MM_EINVAL);
    char *a4[] = {"prog", "--config", "/nonexistent/cfg.json", NULL};
    MM_FAIL(mm_config_parse(&cli, 3, a4, err), MM_EINVAL);
    MM_TRUE(strstr(err, "/nonexistent/cfg.json") != NULL);
    mm_config_fini(&cli);
}

static void test_arena(void) {
    mm_arena a;
    void *p, *q;
    MM_PASS(mm_arena_init(&a, 256));
    MM_PASS(mm_arena_alloc(&a, 10, 1, &p));
    MM_PASS(mm_arena_alloc(&a, 16, 64, &q));
    MM_EQ((uintptr_t)q % 64, 0);
    MM_FAIL(mm_arena_alloc(&a, 1000, 8, &p), MM_EFULL);
    mm_arena_reset(&a);
    MM_PASS(mm_arena_alloc(&a, 256, 8, &p));
    MM_FAIL(mm_arena_alloc(&a, 1, 1, &p), MM_EFULL);
    mm_arena_fini(&a);
    mm_arena_fini(&a);
}

static void test_json(void) {
    char err[MM_ERRLEN] = "";
    json_t *j = NULL;
    const char *txt = "{\"a\": 3, \"b\": \"x\", \"c\": 1.5, \"d\": true, \"n\": null}";
    MM_PASS(mm_json_parse(txt, strlen(txt), "doc", &j, err));
    long long a;
    const char *b;
    double c;
    bool d;
    MM_PASS(mm_json_get_int(j, "a", "doc", &a, err));
    MM_EQ(a, 3);
    MM_PASS(mm_json_get_str(j, "b", "doc", &b, err));
    MM_STREQ(b, "x");
    MM_PASS(mm_json_get_num(j, "c", "doc", &c, err));
    MM_NEAR(c, 1.5, 0);
    MM_PASS(mm_json_get_bool_or(j, "d", "doc", false, &d, err));
    MM_TRUE(d);
    MM_FAIL(mm_json_get_int(j, "b", "doc", &a, err), MM_EINVAL);
    MM_TRUE(strstr(err, "'b'") != NULL);
    MM_FAIL(mm_json_get_int(j, "n", "doc", &a, err), MM_ENOENT);
    MM_PASS(mm_json_get_int_or(j, "zz", "doc", 7, &a, err));
    MM_EQ(a, 7);
    json_decref(j);
    MM_FAIL(mm_json_parse("{bad", 4, "body", &j, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "body") != NULL);
}

MM_TESTS = {
    {"strerror", test_strerror},
    {"config resolution order", test_config_order},
    {"config errors name the option", test_config_errors},
    {"arena", test_arena},
    {"json getters", test_json},
    {NULL, NULL},
};
