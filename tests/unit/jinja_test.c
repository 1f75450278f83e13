// SPDX-License-Identifier: MIT
// Unit tests of common/jinja.c: each construct, whitespace control as transformers configures
// Jinja, Python value semantics, errors with lines, unsupported constructs, and bounds.
// Expected strings were checked against Jinja2 3.1.6 in transformers' configuration.
#include <stdlib.h>
#include <string.h>

#include "mm/jinja.h"
#include "mm/json.h"
#include "mm_test.h"

static const char *CTX =
    "{\"s\": \"  Hello World  \", \"n\": 5, \"f\": 2.5, \"l\": [3, 1, 2], \"e\": [], "
    "\"d\": {\"b\": 2, \"a\": 1, \"c\": {\"x\": [1, 2]}}, \"u\": \"\\u00fcn\\u00ef \\ud83d\\ude00\", "
    "\"none\": null, \"t\": true, "
    "\"messages\": [{\"role\": \"user\", \"content\": \"Hi there\"}, "
    "{\"role\": \"assistant\", \"content\": \"Yo\", \"tool_calls\": [{\"function\": {\"name\": "
    "\"f\", \"arguments\": {\"a\": 1, \"b\": [1, 2.5, null, true]}}}]}]}";

// Renders src with ctx (JSON text or NULL for CTX); returns the code, fills *out / err.
static mm_err render(const char *src, const char *ctx, const mm_jinja_limits *lim, char **out,
                     char err[MM_ERRLEN]) {
    json_t *c = NULL;
    const char *cj = ctx ? ctx : CTX;
    MM_PASS(mm_json_parse(cj, strlen(cj), "ctx", &c, err));
    mm_jinja *t = NULL;
    *out = NULL;
    mm_err rv = mm_jinja_new(src, strlen(src), "t", &t, err);
    if (rv == MM_OK)
        rv = mm_jinja_render(t, c, lim, out, NULL, err);
    mm_jinja_free(t);
    json_decref(c);
    return rv;
}

#define EXPECT(src, want)                                                          \
    do {                                                                           \
        char err_[MM_ERRLEN] = "", *out_ = NULL;                                   \
        mm_err rv_ = render((src), NULL, NULL, &out_, err_);                       \
        if (rv_ != MM_OK)                                                          \
            MM_TEST_FAIL_("render of %s failed: %s", #src, err_);                 \
        MM_STREQ(out_, (want));                                                    \
        free(out_);                                                                \
    } while (0)

#define EXPECT_ERR(src, code, needle)                                              \
    do {                                                                           \
        char err_[MM_ERRLEN] = "", *out_ = NULL;                                   \
        mm_err rv_ = render((src), NULL, NULL, &out_, err_);                       \
        free(out_);                                                                \
        if (rv_ != (code))                                                         \
            MM_TEST_FAIL_("%s: got %d (%s), want %s", #src, (int)rv_, err_, #code); \
        if (!strstr(err_, (needle)))                                               \
            MM_TEST_FAIL_("%s: error \"%s\" lacks \"%s\"", #src, err_, (needle));  \
    } while (0)

static void test_text_and_output(void) {
    EXPECT("plain text", "plain text");
    EXPECT("{{ 'a' }}{{ \"b\" }}{{ 1 }}{{ none }}{{ t }}{{ undefined_thing }}|", "ab1NoneTrue|");
    EXPECT("{{ 'dq' \"sq\" }}{{ '\\u00e9\\x41\\n' }}", "dqsq\xc3\xa9" "A\n");
    EXPECT("{# comment #}x{# multi\nline #}", "x");
    EXPECT("", "");
}

static void test_whitespace_control(void) {
    // trim_blocks removes the newline after a block tag; lstrip_blocks the indentation before.
    EXPECT("  {% if true %}\n    text\n  {% endif %}\n{% for i in [1,2] %}\n  {{ i }}\n{% endfor %}\nend\n",
           "    text\n  1\n  2\nend");
    EXPECT("a  {%- if true -%}  b  {%- endif -%}  c {{- ' d ' -}} e {# comment #} f\n{#- c2 -#}\n g "
           "{%+ if true %}h{% endif %}",
           "abc d e  fg h");
    EXPECT("line1\n    {# indented comment #}\nline2\n  {%- set x = 1 %}\n{{ x }}\n", "line1\nline21");
    EXPECT("{{- 'x' -}}   \n\n  {{- 'y' }}", "xy");
    EXPECT("{%- if true %}   x  {% endif -%}   \n y", "   x  y");
    EXPECT(" \t{% if true %}\t z{% endif %}  \n  {%+ if true %}w{% endif %}", "\t z  \n  w");
    EXPECT("x {# c #}  \n  {# c2 #}\ny {#- c3 -#}  z", "x   \nyz");
    // Variable tags are not affected by trim_blocks/lstrip_blocks.
    EXPECT("  {{ 'v' }}\nnext", "  v\nnext");
    // One trailing newline of the source is dropped; CRLF is normalised.
    EXPECT("\n\n{% if true %}\n  x\n{% endif %}\n\n", "\n\n  x\n");
    EXPECT("a\r\nb{% if true %}\r\nc{% endif %}\r\n", "a\nbc");
}

static void test_raw(void) {
    EXPECT("{% raw %}{{ x }}{% endraw %}", "{{ x }}");
    EXPECT("a\n  {% raw %}\n  {{ x }} {% if %}\n  {% endraw %}\nb", "a\n\n  {{ x }} {% if %}\nb");
    EXPECT("a {%- raw -%}  {{ x }}  {%- endraw -%}  b", "a{{ x }}b");
    EXPECT("a {%+ raw %}  {{ x }}  {%+ endraw +%}\n  b", "a   {{ x }}  \n  b");
    EXPECT("{% for i in [1,2] %}{% raw %}[{{i}}]{% endraw %}{{ i }}{% endfor %}", "[{{i}}]1[{{i}}]2");
    EXPECT_ERR("x\n{% raw %}never closed", MM_EFORMAT, "line 2: 'raw' block is never closed");
}

static void test_if_elif_else(void) {
    EXPECT("{% if n > 10 %}big{% elif n > 3 %}mid{% else %}small{% endif %}", "mid");
    EXPECT("{% if e %}x{% elif none %}y{% else %}z{% endif %}", "z");
    EXPECT("{% if d.zzz %}yes{% else %}no{% endif %}{% if none.foo is defined %}def{% endif %}", "no");
    EXPECT("{{ 'a' if n > 3 else 'b' }}{{ 'a' if n > 30 }}|{{ 1 if true else 2 if false else 3 }}",
           "a|1");
}

static void test_for_loops(void) {
    EXPECT("{% for x in l %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}"
           "{{ loop.last }}{{ loop.length }}{% if not loop.first %}{{ loop.previtem }}{% endif %}"
           "{% if not loop.last %}{{ loop.nextitem }}{% endif %}|{% endfor %}",
           "032TrueFalse31|121FalseFalse332|210FalseTrue31|");
    EXPECT("{% for k, v in d.items() %}{{ loop.index }}:{{ k }}={{ v }};{% endfor %}"
           "{% for k in d %}{{ k }}{% endfor %}",
           "1:b=2;2:a=1;3:c={'x': [1, 2]};bac");
    EXPECT("{% for x in e %}X{% else %}empty{% endfor %}{% for x in l if x > 1 %}{{ x }}"
           "{{ loop.length }}{% endfor %}",
           "empty3222");
    EXPECT("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}"
           "{% break %}{% endif %}{{ x }}{% endfor %}",
           "0134");
    EXPECT("{% for a, b in [(1, 2), (3, 4)] %}{{ a }}{{ b }}{% endfor %}{% for c in 'ab' %}{{ c }}"
           "{% endfor %}{% for x in undefined_list %}never{% endfor %}",
           "1234ab");
    EXPECT("{% for m in messages[::-1] %}{{ loop.index }}{{ m.role }}{% endfor %}",
           "1assistant2user");
}

static void test_set_and_namespace(void) {
    EXPECT("{% set ns = namespace(a=1, b='x') %}{% for i in range(3) %}{% set ns.a = ns.a + i %}"
           "{% set local = i %}{% endfor %}{{ ns.a }}{{ ns.b }}[{{ local }}]",
           "4x[]");
    EXPECT("{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}{% for i in [1] %}"
           "{% set x = 3 %}{{ x }}{% endfor %}{{ x }}",
           "232");
    EXPECT("{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set blk %}inside {{ n }}{% endset %}[{{ blk }}]",
           "12[inside 5]");
    EXPECT("{% set t2 = (1, 'a') %}{{ t2 }}{{ (1,) }}{{ () }}", "(1, 'a')(1,)()");
    EXPECT_ERR("{% set x = 1 %}{% set x.y = 2 %}", MM_EINVAL, "not a namespace");
}

static void test_macros(void) {
    EXPECT("{% macro m(a, b='dflt', c=none) %}<{{ a }}|{{ b }}|{{ c }}>{% endmacro %}{{ m(1) }}"
           "{{ m(1, 2) }}{{ m(1, c=3) }}{{ m('x')|upper }}",
           "<1|dflt|None><1|2|None><1|dflt|3><X|DFLT|NONE>");
    EXPECT("{% macro rec(n) %}{% if n > 0 %}{{ n }}{{ rec(n - 1) }}{% endif %}{% endmacro %}"
           "{{ rec(5) }}",
           "54321");
    // A macro sees the scope it was defined in, and variables set there before the call.
    EXPECT("{% for i in [1, 2] %}{% macro m() %}in{{ i }}{% endmacro %}{{ m() }}{% endfor %}"
           "{% macro g() %}{{ late }}{% endmacro %}{% set late = 'L' %}{{ g() }}",
           "in1in2L");
    EXPECT_ERR("{% for x in [1] %}{{ loop.cycle('a', 'b') }}{% endfor %}", MM_EUNSUPP,
               "loop.cycle");
    EXPECT_ERR("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", MM_EINVAL, "not more than 1");
    EXPECT_ERR("{% macro m(a) %}{% endmacro %}{{ m(zz=1) }}", MM_EINVAL, "keyword argument 'zz'");
}

static void test_tojson(void) {
    EXPECT("{{ d|tojson }}", "{\"b\": 2, \"a\": 1, \"c\": {\"x\": [1, 2]}}");
    EXPECT("{{ d|tojson(indent=2) }}",
           "{\n  \"b\": 2,\n  \"a\": 1,\n  \"c\": {\n    \"x\": [\n      1,\n      2\n    ]\n  }\n}");
    EXPECT("{{ l|tojson(separators=(',',':')) }}{{ d|tojson(sort_keys=true) }}",
           "[3,1,2]{\"a\": 1, \"b\": 2, \"c\": {\"x\": [1, 2]}}");
    // ensure_ascii=False and no HTML escaping (transformers' override of Jinja's tojson).
    EXPECT("{{ u|tojson }}{{ '\"\\\\\\n\\t\\x01<>&\\''|tojson }}",
           "\"\xc3\xbcn\xc3\xaf \xf0\x9f\x98\x80\"\"\\\"\\\\\\n\\t\\u0001<>&'\"");
    EXPECT("{{ messages[1].tool_calls[0].function.arguments|tojson }}",
           "{\"a\": 1, \"b\": [1, 2.5, null, true]}");
    EXPECT("{{ [1.0, 2.50, -0.0, 1e100]|tojson }}{{ {}|tojson }}{{ []|tojson(indent=2) }}",
           "[1.0, 2.5, -0.0, 1e+100]{}[]");
    EXPECT("{{ {'a': {}}|tojson(indent='\\t') }}", "{\n\t\"a\": {}\n}");
    EXPECT_ERR("{{ undefined_x|tojson }}", MM_EINVAL, "not JSON serializable");
}

static void test_filters(void) {
    EXPECT("{{ s|trim }}|{{ s|length }}{{ u|length }}{{ d|length }}{{ undefined_x|length }}",
           "Hello World|15530");
    EXPECT("{{ l|first }}{{ l|last }}{{ l|join(',') }}{{ l|sort }}{{ l|sort(reverse=true) }}"
           "{{ l|reverse|list }}{{ 'abc'|list }}{{ d|list }}{{ d|items|list }}",
           "323,1,2[1, 2, 3][3, 2, 1][2, 1, 3]['a', 'b', 'c']['b', 'a', 'c']"
           "[('b', 2), ('a', 1), ('c', {'x': [1, 2]})]");
    EXPECT("{{ messages|map(attribute='role')|join(', ') }} "
           "{{ messages|selectattr('role', 'equalto', 'user')|list|length }} "
           "{{ messages|rejectattr('role', 'equalto', 'user')|map(attribute='content')|first }} "
           "{{ [1,2,3,4]|select('odd')|list }} {{ ['a','B']|map('upper')|list }}",
           "user, assistant 1 Yo [1, 3] ['A', 'B']");
    EXPECT("{{ undefined_x|default('dft') }}|{{ ''|default('e', true) }}|{{ none|default('n') }}",
           "dft|e|None");
    EXPECT("{{ s|replace('l', 'L') }}{{ s|lower }}{{ s|upper }}{{ 'hello'|capitalize }}"
           "{{ 'a b'|title }}{{ 3.7|int }}{{ '12'|int }}{{ 'x'|int }}{{ 2|float }}{{ -3|abs }}"
           "{{ 42|string ~ 'x' }}{{ [1,1,2]|unique|list }}{{ 'x'|safe }}",
           "  HeLLo WorLd    hello world    HELLO WORLD  HelloA B31202.0342x[1, 2]x");
    EXPECT("{{ 'x'|indent(2) }}{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(4, true) }}",
           "xa\n  b\n\n  c|    a\n    b");
    EXPECT("{{ ['b','A','c']|sort }}{{ messages|sort(attribute='role')|map(attribute='role')|list }}",
           "['A', 'b', 'c']['assistant', 'user']");
    EXPECT("{{ messages|join(', ', attribute='role') }}{{ [1,2,3]|join }}", "user, assistant123");
}

static void test_tests(void) {
    EXPECT("{{ undefined_var is defined }}{{ none is none }}{{ 's' is string }}{{ d is mapping }}"
           "{{ l is iterable }}{{ l is sequence }}{{ 5 is number }}{{ t is true }}{{ t is false }}"
           "{{ 3 is odd }}{{ 4 is even }}{{ 'a' is equalto 'a' }}{{ 1 is eq 1.0 }}"
           "{{ t is boolean }}{{ 1 is integer }}{{ 1.0 is float }}{{ 6 is divisibleby 3 }}",
           "FalseTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrue");
    EXPECT("{% if x is not defined %}nd{% endif %}{{ x is not none }}{{ not x is defined }}"
           "{{ messages[1].tool_calls is defined }}{{ messages[0].tool_calls is defined }}",
           "ndTrueTrueTrueFalse");
}

static void test_operators(void) {
    EXPECT("{{ 'a' in 'cat' }}{{ 1 in l }}{{ 'a' in d }}{{ 'z' not in d }}{{ not 1 }}{{ 1 and 2 }}"
           "{{ 0 or 'x' }}{{ none or '' }}{{ 1 < 2 < 3 }}{{ 'b' > 'a' }}{{ [1,2] < [1,3] }}"
           "{{ 1 == 1.0 }}{{ t == 1 }}",
           "TrueTrueTrueTrueFalse2xTrueTrueTrueTrueTrue");
    EXPECT("{{ 'x' ~ 1 ~ none ~ t }}{{ 'ab' * 3 }}{{ [1] + [2] }}{{ -n }}{{ n - 10 }}",
           "x1NoneTrueababab[1, 2]-5-5");
    EXPECT("{{ not none is none }}{{ -2 ** 2 }}{{ (-2) ** 2 }}{{ 2 ** 3 ** 2 }}{{ 10 - 2 - 3 }}"
           "{{ 2 * 3 ~ 4 }}{{ 1 ~ (2 + 3) }}",
           "False446456415");
    EXPECT("{{ messages|length - 1 }}{{ (messages|length - 1) - 1 }}", "10");
    EXPECT_ERR("{{ 'a' + 1 }}", MM_EINVAL, "unsupported operand types for +: 'str' and 'int'");
    EXPECT_ERR("{{ 1 / 0 }}", MM_EINVAL, "division by zero");
    EXPECT_ERR("{{ 'a' < 1 }}", MM_EINVAL, "not supported between");
}

static void test_numbers_and_repr(void) {
    EXPECT("{{ f }} {{ 1/3 }} {{ 10/2 }} {{ 1e20 }} {{ 1e-5 }} {{ 0.1+0.2 }} {{ 7//2 }} {{ -7//2 }} "
           "{{ -7%3 }} {{ 2**10 }} {{ 1e16 }} {{ 123456789012345.6 }} {{ 0.0001 }}",
           "2.5 0.3333333333333333 5.0 1e+20 1e-05 0.30000000000000004 3 -4 2 1024 1e+16 "
           "123456789012345.6 0.0001");
    EXPECT("{{ -0.0 }} {{ 3.0 }} {{ 1.5e15 }} {{ 12345678901234567.0 }} {{ 2.5e-5 }}",
           "-0.0 3.0 1500000000000000.0 1.2345678901234568e+16 2.5e-05");
    EXPECT("{{ l }} {{ d }} {{ [none, t, 'it\\'s', \"q\\\"\"] }}",
           "[3, 1, 2] {'b': 2, 'a': 1, 'c': {'x': [1, 2]}} [None, True, \"it's\", 'q\"']");
}

static void test_slicing_and_subscripts(void) {
    EXPECT("{{ l[::-1] }}{{ l[1:] }}{{ l[:-1] }}{{ l[-1] }}{{ 'hello'[1:3] }}{{ 'hello'[::-1] }}"
           "{{ u[1] }}{{ l[5] }}{{ l[::2] }}{{ l[-10:10] }}{{ 'abcdef'[4:1:-1] }}",
           "[2, 1, 3][1, 2][3, 1]2elollehn[3, 2][3, 1, 2]edc");
    EXPECT("{{ {'a':1}['a'] }}{{ {'a':{'b':2}}.a.b }}{{ d.c.x[1] }}{{ d['c']['x'] }}", "122[1, 2]");
    EXPECT_ERR("{{ x.y.z }}", MM_EINVAL, "'x' is undefined");
}

static void test_string_methods(void) {
    EXPECT("{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxhixx'.strip('x') }}",
           "Hello World|Hello World  |  Hello World|hi");
    EXPECT("{{ s.split() }}{{ s.split(' ') }}{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}"
           "{{ 'a,b,c'.rsplit(',', 1) }}{{ ' a b  c '.rsplit(None, 1) }}",
           "['Hello', 'World']['', '', 'Hello', 'World', '', '']['a', 'b', '', 'c']['a', 'b,c']"
           "['a,b', 'c'][' a b', 'c']");
    EXPECT("{{ 'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x', 'lo')) }}"
           "{{ 'a-b-c'.replace('-', '+') }}{{ 'a-b-c'.replace('-', '+', 1) }}{{ 'Ab'.upper() }}"
           "{{ 'Ab'.lower() }}{{ 'hello world'.title() }}{{ 'hELLO'.capitalize() }}"
           "{{ 'abcabc'.find('c') }}{{ 'abcabc'.count('b') }}{{ ','.join(['a','b']) }}",
           "TrueTruea+b+ca+b-cABabHello WorldHello22a,b");
    EXPECT("{{ messages[0].content.split(' ')[-1].lstrip('t') }}", "here");
    EXPECT("{{ d.get('a') }}{{ d.get('zz', 'dd') }}{{ d.keys()|list }}{{ d.values()|list|length }}"
           "{{ dict(a=1) }}{{ range(1, 10, 3)|list }}{{ range(5, 0, -2)|list }}",
           "1dd['b', 'a', 'c']3{'a': 1}[1, 4, 7][5, 3, 1]");
    EXPECT_ERR("{{ 'abc'.split('') }}", MM_EINVAL, "empty separator");
    EXPECT_ERR("{{ l.append(1) }}", MM_EINVAL, "unsafe");
}

static void test_raise_exception_and_globals(void) {
    EXPECT_ERR("{% if true %}\n{{ raise_exception('Roles must alternate') }}{% endif %}", MM_EINVAL,
               "line 2: template raised an exception: Roles must alternate");
    char err[MM_ERRLEN], *out = NULL;
    MM_PASS(render("{{ strftime_now('%Y') }}", NULL, NULL, &out, err));
    MM_EQ(strlen(out), 4);
    MM_TRUE(atoi(out) >= 2024);
    free(out);
    EXPECT("{% generation %}gen {{ n }}{% endgeneration %}", "gen 5");
}

static void test_syntax_errors_name_line(void) {
    EXPECT_ERR("ok\n{% if %}{% endif %}", MM_EFORMAT, "line 2: unexpected '%}' in expression");
    EXPECT_ERR("a\nb\n{{ 1 + }}", MM_EFORMAT, "line 3:");
    EXPECT_ERR("x\n{% if true %}never closed", MM_EFORMAT,
               "line 2: 'if' block is never closed (expected 'endif'");
    EXPECT_ERR("{% endif %}", MM_EFORMAT, "unexpected 'endif'");
    EXPECT_ERR("{% for x in l %}\n{% endif %}", MM_EFORMAT,
               "line 2: unexpected 'endif' inside 'for' block opened on line 1");
    EXPECT_ERR("{{ 'unterminated }}", MM_EFORMAT, "unterminated string");
    EXPECT_ERR("{{ x ", MM_EFORMAT, "unterminated tag");
    EXPECT_ERR("{# never closed", MM_EFORMAT, "unterminated comment");
    EXPECT_ERR("{% frobnicate %}", MM_EFORMAT, "unknown tag 'frobnicate'");
    EXPECT_ERR("{% break %}", MM_EFORMAT, "'break' outside a for loop");
    EXPECT_ERR("{{ a $ b }}", MM_EFORMAT, "unexpected character '$'");
    EXPECT_ERR("{{ 'a' +}}", MM_EFORMAT, "unexpected '}}'"); // no \"+}}\" in Jinja
    EXPECT_ERR("{{ none is defined(1) }}", MM_EINVAL, "takes no argument");
}

// Error messages stay valid UTF-8 (they go into JSON replies), even when a multi-byte
// character is cut by truncation or is the offending byte.
static bool valid_utf8(const char *s) {
    json_t *j = json_string(s);
    bool ok = j != NULL;
    json_decref(j);
    return ok;
}

static void test_error_messages_are_utf8(void) {
    char err[MM_ERRLEN], *out = NULL;
    MM_FAIL(render("{{ \xc3\xa9 }}", NULL, NULL, &out, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "0xc3") != NULL);
    MM_TRUE(valid_utf8(err));
    char src[1024] = "{{ raise_exception('";
    for (int i = 0; i < 150; i++)
        strcat(src, "\xe4\xb8\xad"); // U+4E2D, 3 bytes: the message is cut mid-character
    strcat(src, "') }}");
    MM_FAIL(render(src, NULL, NULL, &out, err), MM_EINVAL);
    MM_TRUE(strstr(err, "raised an exception") != NULL);
    MM_TRUE(valid_utf8(err));
    MM_FAIL(render("{{ [1].startswith('x') }}", NULL, NULL, &out, err), MM_EINVAL);
    MM_TRUE(strstr(err, "'list' object has no attribute 'startswith'") != NULL);
}

static void test_unsupported_constructs_named(void) {
    EXPECT_ERR("{% include 'x' %}", MM_EUNSUPP, "unsupported construct: {% include %}");
    EXPECT_ERR("a\n{% extends 'x' %}", MM_EUNSUPP, "line 2: unsupported construct: {% extends %}");
    EXPECT_ERR("{% raw x %}{% endraw %}", MM_EFORMAT, "malformed 'raw'");
    EXPECT_ERR("{% call m() %}x{% endcall %}", MM_EUNSUPP, "{% call %}");
    EXPECT_ERR("{% for x in l recursive %}{% endfor %}", MM_EUNSUPP, "recursive for loop");
    EXPECT_ERR("{{ l|nosuchfilter }}", MM_EUNSUPP, "unsupported filter 'nosuchfilter'");
    EXPECT_ERR("{{ l|dictsort }}", MM_EUNSUPP, "unsupported filter 'dictsort'");
    EXPECT_ERR("{{ 1 is nosuchtest }}", MM_EUNSUPP, "unsupported test 'nosuchtest'");
    EXPECT_ERR("{{ '%s' % 1 }}", MM_EUNSUPP, "string formatting");
    EXPECT_ERR("{{ 'x'.format(1) }}", MM_EUNSUPP, "unsupported string method 'format'");
    EXPECT_ERR("{{ cycler(1, 2) }}", MM_EUNSUPP, "unsupported global 'cycler'");
    EXPECT_ERR("{{ 'x'.upper }}", MM_EUNSUPP, "function object");
}

static void test_bounds_no_crash(void) {
    char err[MM_ERRLEN], *out = NULL;
    // A huge range is refused up front; nested loops hit the step budget.
    MM_FAIL(render("{% for i in range(1000000000) %}x{% endfor %}", NULL, NULL, &out, err), MM_EFULL);
    MM_TRUE(strstr(err, "range()") != NULL);
    mm_jinja_limits lim = {.max_steps = 200000};
    MM_FAIL(render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                   NULL, &lim, &out, err), MM_EFULL);
    MM_TRUE(strstr(err, "step limit") != NULL);
    // Unbounded macro recursion stops at the depth limit.
    MM_FAIL(render("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", NULL, NULL, &out, err),
            MM_EFULL);
    MM_TRUE(strstr(err, "nested deeper") != NULL);
    // Recursion through macros inside deeply nested blocks is bounded by measured stack use.
    size_t nd = 120, kk = 0;
    char *deep = malloc(nd * 30 + 128);
    kk += (size_t)sprintf(deep + kk, "{%% macro r(n) %%}");
    for (size_t i = 0; i < nd; i++)
        kk += (size_t)sprintf(deep + kk, "{%% if true %%}");
    kk += (size_t)sprintf(deep + kk, "{{ r(n + 1) }}");
    for (size_t i = 0; i < nd; i++)
        kk += (size_t)sprintf(deep + kk, "{%% endif %%}");
    sprintf(deep + kk, "{%% endmacro %%}{{ r(0) }}");
    mm_err drv = render(deep, NULL, NULL, &out, err);
    MM_TRUE(drv == MM_EFULL);
    MM_TRUE(strstr(err, "stack") != NULL || strstr(err, "nested deeper") != NULL);
    free(deep);
    // A namespace that contains itself cannot be printed: an error, not a stack overflow.
    MM_FAIL(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", NULL, NULL, &out, err),
            MM_EUNSUPP);
    MM_TRUE(strstr(err, "nested deeper") != NULL);
    // Deeply nested values built by a loop: compared and printed with an error, no crash.
    MM_FAIL(render("{% set ns = namespace(l=[]) %}{% for i in range(200000) %}{% set ns.l = [ns.l] %}"
                   "{% endfor %}{{ ns.l == ns.l }}", NULL, NULL, &out, err), MM_EUNSUPP);
    MM_FAIL(render("{% set ns = namespace(l=[]) %}{% for i in range(200000) %}{% set ns.l = [ns.l] %}"
                   "{% endfor %}{{ ns.l }}", NULL, NULL, &out, err), MM_EUNSUPP);
    // Output and string growth are capped.
    mm_jinja_limits small = {.max_output_bytes = 1000};
    MM_FAIL(render("{{ 'x' * 100000 }}", NULL, &small, &out, err), MM_EFULL);
    MM_FAIL(render("{% for i in range(10000) %}xxxxxxxx{% endfor %}", NULL, &small, &out, err),
            MM_EFULL);
    // Deeply nested expressions are a parse error, not a stack overflow.
    size_t depth = 5000;
    char *src = malloc(depth * 2 + 16);
    size_t k = 0;
    k += (size_t)sprintf(src + k, "{{ ");
    for (size_t i = 0; i < depth; i++)
        src[k++] = '(';
    src[k++] = '1';
    for (size_t i = 0; i < depth; i++)
        src[k++] = ')';
    strcpy(src + k, " }}");
    MM_FAIL(render(src, NULL, NULL, &out, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "nesting deeper") != NULL);
    free(src);
    // Deeply nested blocks too.
    size_t nb = 3000;
    char *blk = malloc(nb * 30 + 1);
    k = 0;
    for (size_t i = 0; i < nb; i++)
        k += (size_t)sprintf(blk + k, "{%% if true %%}");
    for (size_t i = 0; i < nb; i++)
        k += (size_t)sprintf(blk + k, "{%% endif %%}");
    MM_FAIL(render(blk, NULL, NULL, &out, err), MM_EFORMAT);
    free(blk);
}

// Random templates built from Jinja fragments: every outcome is OK or an error; never a crash
// (run under make asan to check memory safety).
static void test_random_templates_no_crash(void) {
    static const char *const frags[] = {
        "{{", "}}", "{%", "%}", "{#", "#}", "-", "+", " if ", " for ", " in ", " endif ",
        " endfor ", " set ", "=", "x", "l", "d", "'s'", "\"q\"", "1", "2.5", "(", ")", "[", "]",
        "{", "}", ":", ",", ".", "|", "tojson", "length", " is ", "defined", " not ", " and ",
        " or ", "~", "*", "/", "%", "\n", "  ", "loop.index", "ns", "namespace(", "macro ",
        "endmacro", "else", "elif", "range(3)", "[::-1]", "messages", "raise_exception('e')",
    };
    size_t nf = sizeof frags / sizeof frags[0];
    unsigned long long seed = 0x9E3779B97F4A7C15ull;
    char buf[512];
    size_t n_ok = 0;
    for (int iter = 0; iter < 3000; iter++) {
        size_t k = 0;
        int nparts = 1 + (int)(seed % 24);
        for (int p = 0; p < nparts; p++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            const char *fr = frags[(seed >> 33) % nf];
            size_t fl = strlen(fr);
            if (k + fl >= sizeof buf)
                break;
            memcpy(buf + k, fr, fl);
            k += fl;
        }
        buf[k] = 0;
        char err[MM_ERRLEN], *out = NULL;
        mm_jinja_limits lim = {.max_steps = 100000, .max_output_bytes = 1 << 20};
        mm_err rv = render(buf, NULL, &lim, &out, err);
        if (rv == MM_OK)
            n_ok++;
        else
            MM_TRUE(err[0] != 0);
        free(out);
    }
    MM_TRUE(n_ok > 0);
}

static void test_iterates(void) {
    const char *yes[] = {"{% for p in m.content %}{% endfor %}",
                         "{% if x %}{% for p in m['content'] %}{% endfor %}{% endif %}",
                         "{% macro v(content) %}{% for i in content %}{% endfor %}{% endmacro %}"};
    const char *no[] = {"{{ m.content }}", "{% for m in messages %}{{ m.content }}{% endfor %}"};
    char err[MM_ERRLEN];
    for (int i = 0; i < 3; i++) {
        mm_jinja *t = NULL;
        MM_PASS(mm_jinja_new(yes[i], strlen(yes[i]), "t", &t, err));
        MM_TRUE(mm_jinja_iterates(t, "content"));
        mm_jinja_free(t);
    }
    for (int i = 0; i < 2; i++) {
        mm_jinja *t = NULL;
        MM_PASS(mm_jinja_new(no[i], strlen(no[i]), "t", &t, err));
        MM_TRUE(!mm_jinja_iterates(t, "content"));
        mm_jinja_free(t);
    }
}

MM_TESTS = {
    {"jinja_text_and_output", test_text_and_output},
    {"jinja_whitespace_control", test_whitespace_control},
    {"jinja_raw", test_raw},
    {"jinja_if_elif_else", test_if_elif_else},
    {"jinja_for_loops", test_for_loops},
    {"jinja_set_and_namespace", test_set_and_namespace},
    {"jinja_macros", test_macros},
    {"jinja_tojson", test_tojson},
    {"jinja_filters", test_filters},
    {"jinja_tests", test_tests},
    {"jinja_operators", test_operators},
    {"jinja_numbers_and_repr", test_numbers_and_repr},
    {"jinja_slicing_and_subscripts", test_slicing_and_subscripts},
    {"jinja_string_methods", test_string_methods},
    {"jinja_raise_exception_and_globals", test_raise_exception_and_globals},
    {"jinja_syntax_errors_name_line", test_syntax_errors_name_line},
    {"jinja_unsupported_constructs_named", test_unsupported_constructs_named},
    {"jinja_error_messages_are_utf8", test_error_messages_are_utf8},
    {"jinja_bounds_no_crash", test_bounds_no_crash},
    {"jinja_random_templates_no_crash", test_random_templates_no_crash},
    {"jinja_iterates_detects_content_loops", test_iterates},
    {NULL, NULL},
};
