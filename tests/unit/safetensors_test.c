// SPDX-License-Identifier: MIT
// safetensors loader: fixtures open, lookups, shape checks, and every kind of corrupt file the
// test itself makes (truncated, bad header length, malformed JSON, bad offsets, unknown dtype,
// sharded sets with a missing tensor or shard).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mm_test.h"
#include "mm/safetensors.h"

static char tmpdir[256];

static void mk_tmp(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/mm-st-test.XXXXXX");
    MM_TRUE(mkdtemp(tmpdir) != NULL);
}

static const char *tpath(const char *name) {
    static char p[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s", tmpdir, name);
    return p[k];
}

static void write_raw(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    MM_TRUE(f != NULL);
    MM_EQ(fwrite(data, 1, n, f), n);
    fclose(f);
}

// A file with header text hdr and data_bytes bytes of data.
static void write_st(const char *path, const char *hdr, size_t data_bytes) {
    size_t hl = strlen(hdr);
    unsigned char *b = calloc(1, 8 + hl + data_bytes);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, hdr, hl);
    write_raw(path, b, 8 + hl + data_bytes);
    free(b);
}

static void expect_err(const char *path, mm_err code, const char *needle) {
    mm_safetensors *st = NULL;
    char err[MM_ERRLEN] = "";
    MM_FAIL(mm_safetensors_open(&st, path, err), code);
    MM_NULL(st);
    if (!strstr(err, needle))
        MM_TEST_FAIL_("error '%s' does not mention '%s'", err, needle);
}

static void test_fixture_open(void) {
    mm_safetensors *st = NULL;
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_safetensors_open(&st, MM_TEST_DATA("models/qwen3moe-tiny"), err));
    const mm_st_tensor *t = mm_safetensors_find(st, "model.embed_tokens.weight");
    MM_TRUE(t != NULL);
    MM_EQ(t->dtype, MM_DTYPE_BF16);
    MM_EQ(t->n_dims, 2);
    MM_EQ(t->shape[0], 512);
    MM_EQ(t->shape[1], 64);
    MM_EQ(t->n_bytes, 512 * 64 * 2);
    int64_t good[2] = {512, 64}, bad[2] = {64, 512};
    MM_PASS(mm_safetensors_get(st, "model.embed_tokens.weight", 2, good, &t, err));
    MM_FAIL(mm_safetensors_get(st, "model.embed_tokens.weight", 2, bad, &t, err), MM_EFORMAT);
    MM_TRUE(strstr(err, "model.embed_tokens.weight") && strstr(err, "[512,64]") &&
            strstr(err, "model.safetensors"));
    MM_FAIL(mm_safetensors_get(st, "model.layers.9.mlp.gate.weight", 2, good, &t, err),
            MM_ENOENT);
    MM_TRUE(strstr(err, "model.layers.9.mlp.gate.weight") != NULL);
    MM_TRUE(mm_safetensors_count(st) > 100);
    mm_safetensors_close(st);
}

static void test_truncated(void) {
    mk_tmp();
    const char *p = tpath("model.safetensors");
    write_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]}}", 40);
    expect_err(p, MM_EFORMAT, "truncated");
    write_raw(p, "\x10\x00", 2);
    expect_err(p, MM_EFORMAT, "truncated");
    write_raw(p, "", 0);
    expect_err(p, MM_EFORMAT, "truncated");
    // header length larger than the file
    write_raw(p, "\xff\xff\x00\x00\x00\x00\x00\x00{}", 10);
    expect_err(p, MM_EFORMAT, "header length");
}

static void test_malformed(void) {
    mk_tmp();
    const char *p = tpath("x.safetensors");
    write_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]", 16);
    expect_err(p, MM_EFORMAT, "malformed header");
    write_st(p, "[1,2]", 0);
    expect_err(p, MM_EFORMAT, "not a JSON object");
    write_st(p, "{\"w\":{\"dtype\":\"F33\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16);
    expect_err(p, MM_EFORMAT, "F33");
    write_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[5],\"data_offsets\":[0,16]}}", 16);
    expect_err(p, MM_EFORMAT, "tensor w");
    write_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}}", 16);
    expect_err(p, MM_EFORMAT, "shape");
    write_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,0]}}", 16);
    expect_err(p, MM_EFORMAT, "data_offsets");
    write_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4]}}", 16);
    expect_err(p, MM_EFORMAT, "tensor w");
    expect_err(tpath("nope.safetensors"), MM_ENOENT, "nope.safetensors");
}

static void test_write_read_dtypes(void) {
    mk_tmp();
    uint16_t bf[6] = {0x3f80, 0x4000, 0xbf80, 0, 0x4040, 0x4080};
    float f32[3] = {1.5f, -2.0f, 3.25f};
    uint8_t f8[5] = {0x38, 0x40, 0xb8, 0, 0x7e};
    mm_st_entry e[3] = {
        {"b", MM_DTYPE_BF16, 2, {2, 3}, bf},
        {"f", MM_DTYPE_F32, 1, {3}, f32},
        {"e4m3", MM_DTYPE_F8_E4M3, 1, {5}, f8},
    };
    char err[MM_ERRLEN] = "";
    const char *p = tpath("w.safetensors");
    MM_PASS(mm_safetensors_write(p, e, 3, NULL, NULL, err));
    mm_safetensors *st = NULL;
    MM_PASS(mm_safetensors_open(&st, p, err));
    const mm_st_tensor *t = mm_safetensors_find(st, "b");
    MM_TRUE(t && t->dtype == MM_DTYPE_BF16 && t->n_elems == 6 && !memcmp(t->data, bf, 12));
    t = mm_safetensors_find(st, "f");
    MM_TRUE(t && t->dtype == MM_DTYPE_F32 && !memcmp(t->data, f32, 12));
    t = mm_safetensors_find(st, "e4m3"); // f8 is read as data
    MM_TRUE(t && t->dtype == MM_DTYPE_F8_E4M3 && t->n_bytes == 5 && !memcmp(t->data, f8, 5));
    mm_safetensors_close(st);
}

static void test_sharded(void) {
    mk_tmp();
    float a[4] = {1, 2, 3, 4}, b[2] = {5, 6};
    mm_st_entry ea = {"x.a", MM_DTYPE_F32, 1, {4}, a}, eb = {"x.b", MM_DTYPE_F32, 2, {1, 2}, b};
    char err[MM_ERRLEN] = "";
    MM_PASS(mm_safetensors_write(tpath("model-00001-of-00002.safetensors"), &ea, 1, NULL, NULL,
                                 err));
    MM_PASS(mm_safetensors_write(tpath("model-00002-of-00002.safetensors"), &eb, 1, NULL, NULL,
                                 err));
    const char *idx = "{\"metadata\":{},\"weight_map\":{\"x.a\":\"model-00001-of-00002.safetensors\","
                      "\"x.b\":\"model-00002-of-00002.safetensors\"}}";
    write_raw(tpath("model.safetensors.index.json"), idx, strlen(idx));
    mm_safetensors *st = NULL;
    MM_PASS(mm_safetensors_open(&st, tmpdir, err));
    const mm_st_tensor *t = mm_safetensors_find(st, "x.b");
    MM_TRUE(t && t->shape[1] == 2 && !memcmp(t->data, b, 8));
    MM_TRUE(strstr(mm_safetensors_file_name(st, t->file), "00002") != NULL);
    MM_TRUE(mm_safetensors_find(st, "x.a") != NULL);
    mm_safetensors_close(st);
    // the index names a tensor its shard lacks
    idx = "{\"weight_map\":{\"x.a\":\"model-00001-of-00002.safetensors\","
          "\"x.c\":\"model-00002-of-00002.safetensors\"}}";
    write_raw(tpath("model.safetensors.index.json"), idx, strlen(idx));
    expect_err(tmpdir, MM_ENOENT, "x.c");
    // the index names a shard that does not exist
    idx = "{\"weight_map\":{\"x.a\":\"model-00003-of-00002.safetensors\"}}";
    write_raw(tpath("model.safetensors.index.json"), idx, strlen(idx));
    expect_err(tmpdir, MM_ENOENT, "model-00003-of-00002.safetensors");
    // a tensor stored twice
    idx = "{\"weight_map\":{\"x.a\":\"model-00001-of-00002.safetensors\"}}";
    MM_PASS(mm_safetensors_write(tpath("model-00002-of-00002.safetensors"), &ea, 1, NULL, NULL,
                                 err));
    idx = "{\"weight_map\":{\"x.a\":\"model-00001-of-00002.safetensors\",\"y\":"
          "\"model-00002-of-00002.safetensors\"}}";
    write_raw(tpath("model.safetensors.index.json"), idx, strlen(idx));
    expect_err(tmpdir, MM_EFORMAT, "twice");
    // no checkpoint at all
    unlink(tpath("model.safetensors.index.json"));
    expect_err(tmpdir, MM_ENOENT, "model.safetensors");
}

MM_TESTS = {
    {"safetensors fixture open and shape check", test_fixture_open},
    {"safetensors truncated files refused", test_truncated},
    {"safetensors malformed headers refused", test_malformed},
    {"safetensors write/read bf16 f32 f8_e4m3", test_write_read_dtypes},
    {"safetensors sharded index", test_sharded},
    {NULL, NULL},
};
