// SPDX-License-Identifier: MIT
// Tests of common/chat_template.c: renders byte-equal to transformers' apply_chat_template for
// the real Qwen3 template (fixtures made by transformers), for unseen conversations over
// Qwen3, ChatML, Mixtral-8x7B-Instruct and DeepSeek-V3 (tests/fixtures/templates/cases.json,
// made by gen_cases.py: Jinja2 configured as transformers configures it), loading from a
// checkpoint dir, content parts, named templates, and clear errors.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mm/chat_template.h"
#include "mm/json.h"
#include "mm_test.h"

// Runs the tokenizer helper's fetch script; returns the Qwen3 models dir or skips the test.
static const char *qwen3_dir(void) {
    static char dir[1024];
    FILE *p = popen("bash tests/fetch_qwen3_tokenizer.sh --print-dir 2>&1", "r");
    if (p == NULL)
        MM_SKIP("cannot run tests/fetch_qwen3_tokenizer.sh");
    char line[1024] = "";
    size_t n = fread(line, 1, sizeof line - 1, p);
    line[n] = 0;
    int st = pclose(p);
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = 0;
    if (st != 0)
        MM_SKIP("real Qwen3 tokenizer unavailable: %s", line);
    snprintf(dir, sizeof dir, "%s", line);
    return dir;
}

static int thinking_of(const json_t *c) {
    json_t *v = json_object_get(c, "enable_thinking");
    return json_is_boolean(v) ? json_is_true(v) : -1;
}

// Renders one case object ({messages, tools?, add_generation_prompt?, enable_thinking?}) and
// compares with its "rendered"/"expected" text, or checks the error it names.
static void check_case(const mm_chat_template *ct, const json_t *c, const char *label) {
    mm_chat_render_opts o = {
        .tools = json_is_array(json_object_get(c, "tools")) ? json_object_get(c, "tools") : NULL,
        .add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
        .enable_thinking = thinking_of(c),
        .extra = json_object_get(c, "kwargs"),
    };
    char err[MM_ERRLEN] = "", *out = NULL;
    size_t n = 0;
    mm_err rv = mm_chat_template_render(ct, json_object_get(c, "messages"), &o, &out, &n, err);
    const char *want_err = json_string_value(json_object_get(c, "error"));
    if (want_err) {
        if (rv == MM_OK)
            MM_TEST_FAIL_("%s: rendered, but expected an error containing '%s'", label, want_err);
        if (!strstr(err, want_err))
            MM_TEST_FAIL_("%s: error '%s' lacks '%s'", label, err, want_err);
        free(out);
        return;
    }
    if (rv != MM_OK)
        MM_TEST_FAIL_("%s: render failed: %s", label, err);
    json_t *w = json_object_get(c, "rendered");
    if (w == NULL)
        w = json_object_get(c, "expected");
    MM_TRUE(json_is_string(w));
    if (n != json_string_length(w) || memcmp(out, json_string_value(w), n) != 0) {
        fprintf(stderr, "%s:\n--- got ---\n%s\n--- want ---\n%s\n", label, out,
                json_string_value(w));
        MM_TEST_FAIL_("%s: render differs", label);
    }
    free(out);
}

static void test_qwen3_transformers_fixtures(void) {
    const char *dir = qwen3_dir();
    char err[MM_ERRLEN] = "";
    mm_chat_template *ct = NULL;
    MM_PASS(mm_chat_template_open(dir, &ct, err));
    const char *files[] = {"tests/fixtures/tokenizer/qwen3_cases.json",
                           "tests/fixtures/tokenizer/qwen3_tools_cases.json"};
    int n = 0;
    for (int f = 0; f < 2; f++) {
        json_t *doc = NULL;
        MM_PASS(mm_json_load_file(files[f], &doc, err));
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(doc, "chat"), i, c) {
            char label[256];
            snprintf(label, sizeof label, "%s chat[%zu]", files[f], i);
            check_case(ct, c, label);
            n++;
        }
        json_decref(doc);
    }
    MM_EQ(n, 5);
    mm_chat_template_close(ct);
}

// Cases of tests/fixtures/templates/cases.json whose template matches want_qwen3.
static void run_generated(bool want_qwen3) {
    char err[MM_ERRLEN] = "";
    json_t *doc = NULL;
    MM_PASS(mm_json_load_file("tests/fixtures/templates/cases.json", &doc, err));
    const char *qdir = want_qwen3 ? qwen3_dir() : NULL;
    size_t i;
    json_t *c;
    int n = 0;
    json_array_foreach(json_object_get(doc, "cases"), i, c) {
        const char *tmpl = json_string_value(json_object_get(c, "template"));
        bool is_qwen3 = strcmp(tmpl, "@qwen3") == 0;
        if (is_qwen3 != want_qwen3)
            continue;
        char dir[1024];
        if (is_qwen3)
            snprintf(dir, sizeof dir, "%s", qdir);
        else if (strcmp(tmpl, "@chatml") == 0)
            snprintf(dir, sizeof dir, "tests/fixtures/models/qwen3moe-tiny");
        else
            snprintf(dir, sizeof dir, "tests/fixtures/templates/%s", tmpl);
        mm_chat_template *ct = NULL;
        MM_PASS(mm_chat_template_open(dir, &ct, err));
        check_case(ct, c, json_string_value(json_object_get(c, "name")));
        mm_chat_template_close(ct);
        n++;
    }
    MM_TRUE(n >= 10);
    json_decref(doc);
}

static void test_qwen3_unseen_conversations(void) { run_generated(true); }
static void test_chatml_mixtral_deepseek_conversations(void) { run_generated(false); }

static char *render_str(const mm_chat_template *ct, const char *msgs_json,
                        const mm_chat_render_opts *o, mm_err want, char *err) {
    json_t *m = NULL;
    MM_PASS(mm_json_parse(msgs_json, strlen(msgs_json), "messages", &m, err));
    char *out = NULL;
    MM_FAIL(mm_chat_template_render(ct, m, o, &out, NULL, err), want);
    json_decref(m);
    return out;
}

// The ChatML template every fixture model ships renders the same text in each checkpoint.
static void test_fixture_models_chatml(void) {
    const char *models[] = {"qwen3moe-tiny", "qwen3-tiny-drafter", "mixtral-tiny",
                            "deepseekv3-tiny"};
    for (int i = 0; i < 4; i++) {
        char dir[256], err[MM_ERRLEN] = "";
        snprintf(dir, sizeof dir, "tests/fixtures/models/%s", models[i]);
        mm_chat_template *ct = NULL;
        MM_PASS(mm_chat_template_open(dir, &ct, err));
        mm_chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
        char *out = render_str(ct, "[{\"role\":\"system\",\"content\":\"S\"},"
                                   "{\"role\":\"user\",\"content\":\"Hi\"}]", &o, MM_OK, err);
        MM_STREQ(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n");
        free(out);
        mm_chat_template_close(ct);
    }
}

static void test_content_parts_and_bad_messages(void) {
    char err[MM_ERRLEN] = "";
    mm_chat_template *ct = NULL;
    MM_PASS(mm_chat_template_open("tests/fixtures/models/qwen3moe-tiny", &ct, err));
    char *out = render_str(ct, "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                               "{\"type\":\"text\",\"text\":\"b\"}]}]", NULL, MM_OK, err);
    MM_STREQ(out, "<|im_start|>user\na\nb<|im_end|>\n");
    free(out);
    render_str(ct, "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]",
               NULL, MM_EUNSUPP, err);
    MM_TRUE(strstr(err, "image_url") != NULL);
    render_str(ct, "{\"role\":\"user\"}", NULL, MM_EINVAL, err);
    MM_TRUE(strstr(err, "array") != NULL);
    render_str(ct, "[{\"content\":\"x\"}]", NULL, MM_EINVAL, err);
    MM_TRUE(strstr(err, "role") != NULL);
    // ChatML concatenates content: a null content is a type error in the template, reported.
    render_str(ct, "[{\"role\":\"assistant\",\"content\":null}]", NULL, MM_EINVAL, err);
    MM_TRUE(strstr(err, "line 1") != NULL);
    mm_chat_template_close(ct);
}

static void test_named_templates_and_specials(void) {
    const char *dir = "/tmp/mm_chat_template_test_named";
    char cmd[512], err[MM_ERRLEN] = "";
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    MM_EQ(system(cmd), 0);
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    MM_TRUE(f != NULL);
    fputs("{\"bos_token\": {\"content\": \"<s>\", \"lstrip\": false}, \"eos_token\": \"</s>\","
          " \"pad_token\": null, \"additional_special_tokens\": [\"<x>\", {\"content\": \"<y>\"}],"
          " \"chat_template\": [{\"name\": \"default\", \"template\": \"D{{ bos_token }}"
          "{{ eos_token }}{{ pad_token is defined }}{{ additional_special_tokens|join(',') }}"
          "{{ tools }}{{ extra }}\"}, {\"name\": \"tool_use\", \"template\": \"T{{ tools|length }}\"}]}",
          f);
    fclose(f);
    mm_chat_template *ct = NULL;
    MM_PASS(mm_chat_template_open(dir, &ct, err));
    json_t *extra = json_pack("{s:s}", "extra", "E");
    mm_chat_render_opts o = {.enable_thinking = -1, .extra = extra};
    char *out = render_str(ct, "[]", &o, MM_OK, err);
    MM_STREQ(out, "D<s></s>False<x>,<y>NoneE");
    free(out);
    json_t *tools = json_pack("[{s:s}]", "type", "function");
    o.tools = tools;
    out = render_str(ct, "[]", &o, MM_OK, err);
    MM_STREQ(out, "T1");
    free(out);
    o.template_name = "default";
    out = render_str(ct, "[]", &o, MM_OK, err);
    MM_TRUE(strncmp(out, "D<s>", 4) == 0);
    free(out);
    o.template_name = "nope";
    render_str(ct, "[]", &o, MM_ENOENT, err);
    MM_TRUE(strstr(err, "nope") != NULL);
    json_decref(extra);
    json_decref(tools);
    mm_chat_template_close(ct);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    MM_EQ(system(cmd), 0);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    MM_TRUE(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_open_errors(void) {
    char err[MM_ERRLEN] = "";
    mm_chat_template *ct = NULL;
    MM_FAIL(mm_chat_template_open("/nonexistent/dir", &ct, err), MM_ENOENT);
    MM_NULL(ct);
    const char *dir = "/tmp/mm_chat_template_test_err";
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    MM_EQ(system(cmd), 0);
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_file(path, "{\"chat_template\": ");
    MM_FAIL(mm_chat_template_open(dir, &ct, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "tokenizer_config.json") != NULL);
    write_file(path, "{\"eos_token\": \"</s>\"}");
    MM_FAIL(mm_chat_template_open(dir, &ct, err), MM_ENOENT);
    MM_TRUE(strstr(err, "no chat template") != NULL);
    write_file(path, "{\"chat_template\": 42}");
    MM_FAIL(mm_chat_template_open(dir, &ct, err), MM_EFORMAT);
    // A malformed template names the problem and its line.
    write_file(path, "{\"chat_template\": \"{% for m in messages %}\\n{{ m.content }}\\n{% endif %}\"}");
    MM_FAIL(mm_chat_template_open(dir, &ct, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "line 3") && strstr(err, "endif"));
    // An unsupported construct is named.
    write_file(path, "{\"chat_template\": \"x\\n{% include 'other.jinja' %}\"}");
    MM_FAIL(mm_chat_template_open(dir, &ct, err), MM_EUNSUPP);
    MM_TRUE(strstr(err, "line 2") && strstr(err, "include"));
    // chat_template.jinja wins over tokenizer_config.json.
    write_file(path, "{\"chat_template\": \"from-config\"}");
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    write_file(path, "from-jinja-file\n");
    MM_PASS(mm_chat_template_open(dir, &ct, err));
    char *out = render_str(ct, "[]", NULL, MM_OK, err);
    MM_STREQ(out, "from-jinja-file");
    free(out);
    mm_chat_template_close(ct);
    // A template whose runtime fails reports it at render, not as a crash.
    write_file(path, "{{ messages[0].content.nope() }}");
    MM_PASS(mm_chat_template_open(dir, &ct, err));
    render_str(ct, "[{\"role\":\"user\",\"content\":\"x\"}]", NULL, MM_EUNSUPP, err);
    MM_TRUE(strstr(err, "nope") != NULL);
    mm_chat_template_close(ct);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    MM_EQ(system(cmd), 0);
}

// A template file given by name (the gateway's --chat-template) replaces the checkpoint's, even
// its chat_template.jinja, and keeps its special tokens; a file that is missing or malformed is
// an error naming the file.
static void test_open_file(void) {
    char err[MM_ERRLEN] = "";
    mm_chat_template *ct = NULL;
    const char *dir = "/tmp/mm_chat_template_test_file";
    char cmd[256], path[512], tp[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    MM_EQ(system(cmd), 0);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_file(path, "{\"eos_token\": \"</s>\", \"chat_template\": \"from-config\"}");
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    write_file(path, "from-jinja-file");
    snprintf(tp, sizeof tp, "%s/mine.jinja", dir);
    write_file(tp, "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}");
    MM_PASS(mm_chat_template_open_file(dir, tp, &ct, err));
    mm_chat_render_opts o = {.enable_thinking = -1, .add_generation_prompt = true};
    char *out = render_str(ct, "[{\"role\":\"user\",\"content\":\"hi\"}]", &o, MM_OK, err);
    MM_STREQ(out, "[user]hi[assistant]</s>");
    free(out);
    mm_chat_template_close(ct);
    // a checkpoint without any template of its own takes the file too
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    MM_EQ(remove(path), 0);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_file(path, "{\"eos_token\": \"<e>\"}");
    MM_PASS(mm_chat_template_open_file(dir, tp, &ct, err));
    out = render_str(ct, "[]", &o, MM_OK, err);
    MM_STREQ(out, "[assistant]<e>");
    free(out);
    mm_chat_template_close(ct);
    // errors name the file
    char missing[600];
    snprintf(missing, sizeof missing, "%s/missing.jinja", dir);
    MM_FAIL(mm_chat_template_open_file(dir, missing, &ct, err), MM_ENOENT);
    MM_NULL(ct);
    MM_TRUE(strstr(err, "missing.jinja") != NULL);
    write_file(tp, "x\n{% if %}");
    MM_FAIL(mm_chat_template_open_file(dir, tp, &ct, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "mine.jinja") && strstr(err, "line 2"));
    printf("a malformed file: %s\n", err);
    MM_FAIL(mm_chat_template_open_file(dir, "", &ct, err), MM_EINVAL);
    MM_FAIL(mm_chat_template_open_file(dir, NULL, &ct, err), MM_EINVAL);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    MM_EQ(system(cmd), 0);
}

// deploy/templates/deepseek-v3-tools.jinja (for --chat-template): without tools it renders as
// DeepSeek's shipped V3 template; with tools its system part lists them and shows V3's call form
// (the probe finds it), and an assistant turn of two calls is closed once, after the second.
static void test_deepseek_tools_template(void) {
    char err[MM_ERRLEN] = "";
    const char *dir = "tests/fixtures/templates/deepseek-v3";
    mm_chat_template *mine = NULL, *shipped = NULL;
    MM_PASS(mm_chat_template_open_file(dir, "deploy/templates/deepseek-v3-tools.jinja", &mine, err));
    MM_PASS(mm_chat_template_open(dir, &shipped, err));
    MM_EQ(mm_chat_template_deepseek_tools(mine), 1);
    MM_EQ(mm_chat_template_deepseek_tools(shipped), 0);
    const char *convs[] = {
        "[{\"role\":\"system\",\"content\":\"be brief\"},{\"role\":\"user\",\"content\":\"hi\"},"
        "{\"role\":\"assistant\",\"content\":\"hello\"},{\"role\":\"user\",\"content\":\"more\"}]",
        "[{\"role\":\"user\",\"content\":\"a\"}]",
        "[{\"role\":\"system\",\"content\":\"s1\"},{\"role\":\"system\",\"content\":\"s2\"},"
        "{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"r\"}]"};
    for (size_t i = 0; i < sizeof(convs) / sizeof(convs[0]); i++)
        for (int ag = 0; ag < 2; ag++) {
            mm_chat_render_opts o = {.enable_thinking = -1, .add_generation_prompt = ag};
            char *a = render_str(mine, convs[i], &o, MM_OK, err);
            char *b = render_str(shipped, convs[i], &o, MM_OK, err);
            if (strcmp(a, b) != 0)
                MM_TEST_FAIL_("conversation %zu (generation prompt %d): %s != %s", i, ag, a, b);
            free(a), free(b);
        }
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                               "\"parameters\":{\"type\":\"object\"}}}]", 0, NULL);
    MM_TRUE(tools != NULL);
    mm_chat_render_opts o = {.enable_thinking = -1, .add_generation_prompt = true, .tools = tools};
    char *out = render_str(mine,
        "[{\"role\":\"user\",\"content\":\"w?\"},{\"role\":\"assistant\",\"content\":null,"
        "\"tool_calls\":[{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"arguments\":\"{}\"}},{\"id\":\"b\",\"type\":\"function\",\"function\":{\"name\":"
        "\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Oslo\\\"}\"}}]},"
        "{\"role\":\"tool\",\"content\":\"sun\"},{\"role\":\"tool\",\"content\":\"rain\"}]",
        &o, MM_OK, err);
    MM_TRUE(strstr(out, "\"name\": \"get_weather\"") != NULL); // the tool's JSON, in the system part
    MM_TRUE(strstr(out, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n") != NULL);
    MM_TRUE(strstr(out, "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                        "get_weather\n```json\n{}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>") != NULL);
    const char *end = "```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>"
                      "<｜tool▁output▁begin｜>sun<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>rain"
                      "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>";
    MM_TRUE(strstr(out, end) != NULL);
    MM_TRUE(strlen(out) >= strlen(end) && strcmp(out + strlen(out) - strlen(end), end) == 0);
    free(out);
    json_decref(tools);
    mm_chat_template_close(mine);
    mm_chat_template_close(shipped);
}

// The command prints the prompt with no trailing newline added.
static void test_cli(void) {
    const char *build = getenv("BUILD") ? getenv("BUILD") : "build";
    char cmd[1024];
    FILE *f = fopen("/tmp/mm_ct_cli_msgs.json", "w");
    MM_TRUE(f != NULL);
    fputs("[{\"role\": \"user\", \"content\": \"Hi\"}]", f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s/bin/moemesh chat-template --tokenizer "
             "tests/fixtures/templates/mixtral-8x7b-instruct --messages /tmp/mm_ct_cli_msgs.json "
             "--add-generation-prompt 2>&1", build);
    FILE *p = popen(cmd, "r");
    MM_TRUE(p != NULL);
    char buf[256] = "";
    size_t n = fread(buf, 1, sizeof buf - 1, p);
    buf[n] = 0;
    MM_EQ(pclose(p), 0);
    MM_STREQ(buf, "<s> [INST] Hi [/INST]");
    snprintf(cmd, sizeof cmd, "%s/bin/moemesh chat-template --tokenizer "
             "tests/fixtures/templates/mixtral-8x7b-instruct --messages /tmp/mm_ct_cli_msgs.json "
             "--enable-thinking maybe >/dev/null 2>&1", build);
    MM_TRUE(system(cmd) != 0);
    remove("/tmp/mm_ct_cli_msgs.json");
}

// One compiled template rendered from several threads at once gives the same text each time.
typedef struct render_job {
    const mm_chat_template *ct;
    const json_t *msgs;
    const char *want;
    int bad;
} render_job;

static void *render_loop(void *arg) {
    render_job *j = arg;
    mm_chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
    for (int i = 0; i < 300; i++) {
        char err[MM_ERRLEN], *out = NULL;
        if (mm_chat_template_render(j->ct, j->msgs, &o, &out, NULL, err) != MM_OK ||
            strcmp(out, j->want) != 0)
            j->bad++;
        free(out);
    }
    return NULL;
}

static void test_concurrent_renders(void) {
    char err[MM_ERRLEN] = "";
    mm_chat_template *ct = NULL;
    MM_PASS(mm_chat_template_open("tests/fixtures/templates/deepseek-v3", &ct, err));
    const char *mj = "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"Hi\"}]";
    json_t *m = NULL;
    MM_PASS(mm_json_parse(mj, strlen(mj), "messages", &m, err));
    mm_chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
    char *want = NULL;
    MM_PASS(mm_chat_template_render(ct, m, &o, &want, NULL, err));
    MM_STREQ(want, "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>S"
                   "<\xef\xbd\x9cUser\xef\xbd\x9c>Hi<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>");
    render_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (render_job){.ct = ct, .msgs = m, .want = want};
        MM_EQ(pthread_create(&th[i], NULL, render_loop, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        MM_EQ(jobs[i].bad, 0);
    }
    free(want);
    json_decref(m);
    mm_chat_template_close(ct);
}

// mm_chat_template_hermes_tools, _glm_tools: the gateway forces a tool call's head (tool_choice)
// only for templates whose tools prompt asks for Qwen3's <tool_call>\n{"name": ...} blocks or
// GLM's <tool_call>NAME\n<arg_key> ones.
static void test_hermes_tools(void) {
    char err[MM_ERRLEN] = "";
    const char *no[] = {"tests/fixtures/templates/glm-4.6", "tests/fixtures/templates/deepseek-v3",
                        "tests/fixtures/templates/deepseek-v3.1", "tests/fixtures/templates/kimi-k2",
                        "tests/fixtures/templates/mixtral-8x7b-instruct",
                        "tests/fixtures/models/qwen3moe-tiny"};
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++) {
        mm_chat_template *ct = NULL;
        MM_PASS(mm_chat_template_open(no[i], &ct, err));
        if (mm_chat_template_hermes_tools(ct))
            MM_TEST_FAIL_("%s: taken for a Hermes tools template", no[i]);
        mm_chat_template_close(ct);
    }
    MM_TRUE(!mm_chat_template_hermes_tools(NULL));
    const char *dir = qwen3_dir();
    mm_chat_template *ct = NULL;
    MM_PASS(mm_chat_template_open(dir, &ct, err));
    MM_TRUE(mm_chat_template_hermes_tools(ct));
    MM_TRUE(!mm_chat_template_glm_tools(ct));
    mm_chat_template_close(ct);
    // GLM's <tool_call>NAME\n<arg_key> blocks: glm-4.6's template only
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++) {
        MM_PASS(mm_chat_template_open(no[i], &ct, err));
        if (mm_chat_template_glm_tools(ct) != (i == 0))
            MM_TEST_FAIL_("%s: GLM tools template %s", no[i], i == 0 ? "not found" : "found");
        mm_chat_template_close(ct);
    }
    MM_TRUE(!mm_chat_template_glm_tools(NULL));
    // DeepSeek's blocks: the shipped V3 and V3.1 templates of the fixtures render no tool list
    // (0); templates whose tools prompt shows V3's or V3.1's call form are found (1, 2)
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++) {
        MM_PASS(mm_chat_template_open(no[i], &ct, err));
        if (mm_chat_template_deepseek_tools(ct) != 0)
            MM_TEST_FAIL_("%s: a DeepSeek tools template found", no[i]);
        mm_chat_template_close(ct);
    }
    MM_PASS(mm_chat_template_open(dir, &ct, err));
    MM_EQ(mm_chat_template_deepseek_tools(ct), 0);
    mm_chat_template_close(ct);
    const char *tdir = "/tmp/mm_chat_template_test_ds";
    char cmd[256], path[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", tdir, tdir);
    MM_EQ(system(cmd), 0);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", tdir);
    write_file(path, "{\"eos_token\": \"</s>\"}");
    snprintf(path, sizeof path, "%s/chat_template.jinja", tdir);
    write_file(path, "{% if tools %}Tools: {{ tools | tojson }}. Call as <｜tool▁calls▁begin｜>"
                     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}"
                     "{% for m in messages %}{{ m.content }}{% endfor %}");
    MM_PASS(mm_chat_template_open(tdir, &ct, err));
    MM_EQ(mm_chat_template_deepseek_tools(ct), 1);
    MM_TRUE(!mm_chat_template_hermes_tools(ct) && !mm_chat_template_glm_tools(ct));
    mm_chat_template_close(ct);
    write_file(path, "{% if tools %}Call as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                     "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
                     "<｜tool▁calls▁end｜>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}");
    MM_PASS(mm_chat_template_open(tdir, &ct, err));
    MM_EQ(mm_chat_template_deepseek_tools(ct), 2);
    mm_chat_template_close(ct);
    MM_EQ(mm_chat_template_deepseek_tools(NULL), 0);
    snprintf(cmd, sizeof cmd, "rm -rf %s", tdir);
    MM_EQ(system(cmd), 0);
}

MM_TESTS = {
    {"chat_template_qwen3_transformers_fixtures", test_qwen3_transformers_fixtures},
    {"chat_template_qwen3_unseen_conversations", test_qwen3_unseen_conversations},
    {"chat_template_chatml_mixtral_deepseek", test_chatml_mixtral_deepseek_conversations},
    {"chat_template_fixture_models_chatml", test_fixture_models_chatml},
    {"chat_template_content_parts_and_bad_messages", test_content_parts_and_bad_messages},
    {"chat_template_named_templates_and_specials", test_named_templates_and_specials},
    {"chat_template_open_errors", test_open_errors},
    {"chat_template_open_file", test_open_file},
    {"chat_template_deepseek_v3_tools_file", test_deepseek_tools_template},
    {"chat_template_cli", test_cli},
    {"chat_template_concurrent_renders", test_concurrent_renders},
    {"chat_template_tool_call_forms", test_hermes_tools},
    {NULL, NULL},
};
