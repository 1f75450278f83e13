// SPDX-License-Identifier: MIT
// The gateway's chat output splitting (services/gateway/parse.c): reasoning out of <think>
// blocks, Qwen3, GLM and DeepSeek tool call blocks into OpenAI tool_calls, the same result whether the text
// arrives whole or one byte at a time (streaming), and malformed blocks kept as text.
#include <string.h>

#include "../../services/gateway/parse.c"
#include "mm_test.h"

// run feeds text whole (step 0) or in pieces of step bytes, then ends it.
static void run(gw_chat_parse *p, const char *text, size_t step, bool think_open, bool tools) {
    gw_chat_parse_init(p, think_open, tools, "call_x");
    size_t n = strlen(text);
    if (step)
        for (size_t k = step; k < n; k += step)
            gw_chat_parse_feed(p, text, k, false);
    gw_chat_parse_feed(p, text, n, true);
}

static const char *str(const gw_buf *b) { return b->p ? b->p : ""; }

// kept_as_text: each text (fed in pieces of step bytes, tools offered) is content as it is.
static void kept_as_text(const char *const *texts, size_t n, size_t step) {
    for (size_t i = 0; i < n; i++) {
        gw_chat_parse p;
        run(&p, texts[i], step, false, true);
        MM_STREQ(str(&p.content), texts[i]);
        MM_TRUE(p.tool_calls == NULL);
        gw_chat_parse_fini(&p);
    }
}

static void test_think(void) {
    const char *t = "<think>\nLet me see.\n</think>\n\nThe answer is 4.";
    for (size_t step = 0; step <= 3; step++) {
        gw_chat_parse p;
        run(&p, t, step, false, false);
        MM_STREQ(str(&p.reasoning), "Let me see.\n");
        MM_STREQ(str(&p.content), "The answer is 4.");
        MM_TRUE(p.tool_calls == NULL);
        gw_chat_parse_fini(&p);
    }
    // A template that opened the block in the prompt: the output starts inside it.
    gw_chat_parse p;
    run(&p, "hmm</think>\n\nok", 1, true, false);
    MM_STREQ(str(&p.reasoning), "hmm");
    MM_STREQ(str(&p.content), "ok");
    gw_chat_parse_fini(&p);
    // Unterminated reasoning stays reasoning.
    run(&p, "<think>still thinking", 2, false, false);
    MM_STREQ(str(&p.reasoning), "still thinking");
    MM_STREQ(str(&p.content), "");
    gw_chat_parse_fini(&p);
}

// call i of p's tool_calls: its name, and its arguments (a JSON string) unless args is NULL
static void expect_call(const gw_chat_parse *p, size_t i, const char *name, const char *args) {
    json_t *f = json_object_get(json_array_get(p->tool_calls, i), "function");
    MM_STREQ(json_string_value(json_object_get(f, "name")), name);
    if (args)
        MM_STREQ(json_string_value(json_object_get(f, "arguments")), args);
}

static void test_tools(void) {
    const char *t = "I will call it.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                    "{\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": "
                    "\"now\", \"arguments\": {}}\n</tool_call>";
    for (size_t step = 0; step <= 5; step++) {
        gw_chat_parse p;
        run(&p, t, step, false, true);
        MM_STREQ(str(&p.content), "I will call it.\n\n");
        MM_EQ(json_array_size(p.tool_calls), 2);
        json_t *c0 = json_array_get(p.tool_calls, 0);
        MM_STREQ(json_string_value(json_object_get(c0, "id")), "call_x_0");
        MM_STREQ(json_string_value(json_object_get(c0, "type")), "function");
        json_t *f = json_object_get(c0, "function");
        MM_STREQ(json_string_value(json_object_get(f, "name")), "get_weather");
        // arguments is a JSON string, as OpenAI carries it
        MM_STREQ(json_string_value(json_object_get(f, "arguments")),
                 "{\"city\":\"Paris\",\"days\":2}");
        f = json_object_get(json_array_get(p.tool_calls, 1), "function");
        MM_STREQ(json_string_value(json_object_get(f, "name")), "now");
        MM_STREQ(json_string_value(json_object_get(f, "arguments")), "{}");
        gw_chat_parse_fini(&p);
    }
}

static void test_tools_off_and_malformed(void) {
    gw_chat_parse p;
    // Without tools in the request the block is content.
    run(&p, "<tool_call>{\"name\": \"f\"}</tool_call>", 1, false, false);
    MM_STREQ(str(&p.content), "<tool_call>{\"name\": \"f\"}</tool_call>");
    MM_TRUE(p.tool_calls == NULL);
    gw_chat_parse_fini(&p);
    // Not JSON, or no name: kept as the model wrote it.
    run(&p, "a<tool_call>not json</tool_call>b", 0, false, true);
    MM_STREQ(str(&p.content), "a<tool_call>not json</tool_call>b");
    MM_TRUE(p.tool_calls == NULL);
    gw_chat_parse_fini(&p);
    // Unterminated block: text.
    run(&p, "x<tool_call>{\"name\"", 3, false, true);
    MM_STREQ(str(&p.content), "x<tool_call>{\"name\"");
    gw_chat_parse_fini(&p);
    // A tag prefix at the very end is text once the output ends.
    run(&p, "a <tool_ca", 1, false, true);
    MM_STREQ(str(&p.content), "a <tool_ca");
    gw_chat_parse_fini(&p);
    // Reasoning then a tool call.
    run(&p, "<think>plan</think><tool_call>{\"name\":\"g\",\"arguments\":\"{\\\"a\\\":1}\"}</tool_call>",
        4, false, true);
    MM_STREQ(str(&p.reasoning), "plan");
    MM_STREQ(str(&p.content), "");
    MM_STREQ(json_string_value(json_object_get(
                 json_object_get(json_array_get(p.tool_calls, 0), "function"), "arguments")),
             "{\"a\":1}");
    gw_chat_parse_fini(&p);
}

// GLM-4.5/4.6 blocks (their chat templates write an assistant's calls so): the name, then
// <arg_key>/<arg_value> pairs; a value that reads as JSON is that JSON, else a string. Whole
// and streamed; a call without arguments; forms that are neither kept as text.
static void test_glm_tools(void) {
    const char *t = "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
                    "New York</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
                    "<arg_key>opts</arg_key>\n<arg_value>{\"units\": \"C\", \"hourly\": true}"
                    "</arg_value>\n</tool_call>\n<tool_call>now</tool_call>";
    for (size_t step = 0; step <= 7; step++) {
        gw_chat_parse p;
        run(&p, t, step, false, true);
        MM_STREQ(str(&p.content), "Let me check.\n\n");
        MM_EQ(json_array_size(p.tool_calls), 2);
        json_t *f = json_object_get(json_array_get(p.tool_calls, 0), "function");
        MM_STREQ(json_string_value(json_object_get(f, "name")), "get_weather");
        json_error_t je;
        json_t *a = json_loads(json_string_value(json_object_get(f, "arguments")), 0, &je);
        MM_TRUE(json_is_object(a));
        MM_STREQ(json_string_value(json_object_get(a, "city")), "New York");
        MM_EQ(json_integer_value(json_object_get(a, "days")), 3);
        MM_STREQ(json_string_value(json_object_get(json_object_get(a, "opts"), "units")), "C");
        MM_TRUE(json_is_true(json_object_get(json_object_get(a, "opts"), "hourly")));
        json_decref(a);
        expect_call(&p, 1, "now", "{}");
        MM_STREQ(json_string_value(json_object_get(json_array_get(p.tool_calls, 1), "id")),
                 "call_x_1");
        gw_chat_parse_fini(&p);
    }
    // Neither form: a key without its value, text after the name, an unclosed key.
    const char *bad[] = {"<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>",
                         "<tool_call>f(x=1)</tool_call>",
                         "<tool_call>f <arg_key>a<arg_value>1</arg_value></tool_call>",
                         "<tool_call>\n</tool_call>"};
    kept_as_text(bad, sizeof(bad) / sizeof(bad[0]), 2);
}

// DeepSeek-V3 / V3.1 blocks (their chat templates write an assistant's calls so): the wrapper
// tags dropped, V3's "function<sep>NAME\n```json\nARGS\n```" and V3.1's "NAME<sep>ARGS", whole
// and streamed in pieces that split the tags' multi-byte characters; malformed and unterminated
// blocks kept as text.
static void test_deepseek_tools(void) {
    const char *v3 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                     "get_weather\n```json\n{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>"
                     "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    const char *v31 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                      "{\"city\": \"Paris\", \"days\": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now"
                      "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    const char *texts[] = {v3, v31};
    for (int v = 0; v < 2; v++)
        for (size_t step = 0; step <= 7; step++) {
            gw_chat_parse p;
            run(&p, texts[v], step, false, true);
            MM_STREQ(str(&p.content), "Checking.");
            MM_EQ(json_array_size(p.tool_calls), 2);
            expect_call(&p, 0, "get_weather", "{\"city\":\"Paris\",\"days\":2}");
            expect_call(&p, 1, "now", "{}");
            gw_chat_parse_fini(&p);
        }
    // Not a call: no separator, arguments not a JSON object, V3 without the name's line end,
    // an unclosed fence; then an unterminated block.
    const char *bad[] = {"<｜tool▁call▁begin｜>get_weather {}<｜tool▁call▁end｜>",
                         "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
                         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f<｜tool▁call▁end｜>",
                         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}<｜tool▁call▁end｜>",
                         "x<｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\""};
    kept_as_text(bad, sizeof(bad) / sizeof(bad[0]), 3);
    // Without tools in the request the tags are text.
    gw_chat_parse p;
    run(&p, v31, 2, false, false);
    MM_STREQ(str(&p.content), v31);
    MM_TRUE(p.tool_calls == NULL);
    gw_chat_parse_fini(&p);
}

// tool_choice: the prompt wrote "<tool_call>" and the call's head; the output is the rest of
// that call (then maybe more calls). Whole and streamed; a named function, "required" (the
// model writes the name), a second call after it, and an unterminated forced call kept as
// the text with its head.
static void forced_as(gw_chat_parse *p, const char *head, const char *text, size_t step,
                      bool ds) {
    gw_chat_parse_init(p, false, false, "call_x");
    MM_TRUE(gw_chat_parse_force_tool(p, head, ds));
    size_t n = strlen(text);
    if (step)
        for (size_t k = step; k < n; k += step)
            gw_chat_parse_feed(p, text, k, false);
    gw_chat_parse_feed(p, text, n, true);
}

static void forced(gw_chat_parse *p, const char *head, const char *text, size_t step) {
    forced_as(p, head, text, step, false);
}

static void test_forced_tool(void) {
    const char *named = "\n{\"name\": \"get_weather\", \"arguments\": ";
    for (size_t step = 0; step <= 4; step++) {
        gw_chat_parse p;
        forced(&p, named, "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": "
                          "\"now\", \"arguments\": {}}\n</tool_call>", step);
        MM_STREQ(str(&p.content), "\n");
        MM_EQ(json_array_size(p.tool_calls), 2);
        expect_call(&p, 0, "get_weather", "{\"city\":\"Paris\"}");
        expect_call(&p, 1, "now", NULL);
        gw_chat_parse_fini(&p);
        forced(&p, "\n{\"name\": \"", "now\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>", step);
        MM_EQ(json_array_size(p.tool_calls), 1);
        expect_call(&p, 0, "now", "{\"tz\":\"UTC\"}");
        MM_STREQ(str(&p.content), "");
        gw_chat_parse_fini(&p);
    }
    gw_chat_parse p;
    forced(&p, named, "{\"city\": \"Par", 2); // max_tokens hit inside the call
    MM_STREQ(str(&p.content), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par");
    MM_TRUE(p.tool_calls == NULL);
    gw_chat_parse_fini(&p);
    forced(&p, named, "not json</tool_call>", 0); // unreadable: the block as written
    MM_STREQ(str(&p.content),
             "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": not json</tool_call>");
    gw_chat_parse_fini(&p);
}

// tool_choice with DeepSeek's blocks: the prompt wrote the calls' and the call's opening tags
// and the call's head (V3: "function<｜tool▁sep｜>NAME\n```json\n", or for "required" only
// "function<｜tool▁sep｜>"; V3.1: "NAME<｜tool▁sep｜>" or nothing); the output is the rest.
static void test_forced_deepseek(void) {
    const char *v3 = "function<｜tool▁sep｜>get_weather\n```json\n";
    for (size_t step = 0; step <= 5; step++) {
        gw_chat_parse p;
        forced_as(&p, v3, "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>"
                          "function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>"
                          "<｜tool▁calls▁end｜>", step, true);
        MM_STREQ(str(&p.content), "");
        MM_EQ(json_array_size(p.tool_calls), 2);
        expect_call(&p, 0, "get_weather", "{\"city\":\"Paris\"}");
        expect_call(&p, 1, "now", NULL);
        gw_chat_parse_fini(&p);
        forced_as(&p, "function<｜tool▁sep｜>", "now\n```json\n{\"tz\": \"UTC\"}\n```"
                  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", step, true); // required, V3
        MM_EQ(json_array_size(p.tool_calls), 1);
        expect_call(&p, 0, "now", "{\"tz\":\"UTC\"}");
        gw_chat_parse_fini(&p);
        forced_as(&p, "get_weather<｜tool▁sep｜>", "{\"city\": \"Oslo\"}<｜tool▁call▁end｜>"
                  "<｜tool▁calls▁end｜>", step, true); // named, V3.1
        MM_EQ(json_array_size(p.tool_calls), 1);
        expect_call(&p, 0, "get_weather", "{\"city\":\"Oslo\"}");
        MM_STREQ(str(&p.content), "");
        gw_chat_parse_fini(&p);
        forced_as(&p, "", "now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", step,
                  true); // required, V3.1
        MM_EQ(json_array_size(p.tool_calls), 1);
        expect_call(&p, 0, "now", NULL);
        gw_chat_parse_fini(&p);
    }
    gw_chat_parse p;
    forced_as(&p, v3, "{\"city\": \"Par", 2, true); // max_tokens hit inside the call
    MM_STREQ(str(&p.content), "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                              "{\"city\": \"Par");
    MM_TRUE(p.tool_calls == NULL);
    gw_chat_parse_fini(&p);
}

MM_TESTS = {
    {"think blocks become reasoning (whole and streamed)", test_think},
    {"tool_call blocks become tool_calls (whole and streamed)", test_tools},
    {"tool blocks without tools, malformed, unterminated", test_tools_off_and_malformed},
    {"a tool call the prompt opened (tool_choice) is read with its head", test_forced_tool},
    {"GLM-4.5/4.6 tool_call blocks (arg_key/arg_value) become tool_calls", test_glm_tools},
    {"DeepSeek-V3/V3.1 tool call blocks become tool_calls", test_deepseek_tools},
    {"a DeepSeek tool call the prompt opened (tool_choice) is read with its head", test_forced_deepseek},
    {NULL, NULL},
};
