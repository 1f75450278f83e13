// SPDX-License-Identifier: MIT
// `moemesh tokenize` and `moemesh detokenize`: text <-> ids through a checkpoint's
// tokenizer.json (mm/tokenizer.h), plus `tokenize --bench FILE` for encode throughput.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cmd.h"
#include "mm/config.h"
#include "mm/time.h"
#include "mm/tokenizer.h"

static mm_err read_file(const char *path, char **buf, size_t *n, char err[MM_ERRLEN]) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return mm_errf(err, MM_ENOENT, "%s: %s", path, strerror(errno));
    size_t cap = 1 << 16, len = 0;
    char *b = malloc(cap);
    while (b) {
        size_t r = fread(b + len, 1, cap - len, f);
        len += r;
        if (len < cap)
            break;
        char *b2 = realloc(b, cap * 2);
        if (!b2) {
            free(b);
            b = NULL;
            break;
        }
        b = b2;
        cap *= 2;
    }
    bool bad = ferror(f);
    fclose(f);
    if (!b)
        return mm_errf(err, MM_ENOMEM, "%s: out of memory", path);
    if (bad) {
        free(b);
        return mm_errf(err, MM_ESYS, "%s: read error", path);
    }
    *buf = b;
    *n = len;
    return MM_OK;
}

// encode_all encodes text into a growing id buffer (*ids, *cap), retrying on MM_EFULL.
static mm_err encode_all(const mm_tokenizer *tk, const char *text, size_t n, bool add_special,
                         int32_t **ids, size_t *cap, size_t *n_ids, char err[MM_ERRLEN]) {
    mm_err rv = mm_tokenizer_encode(tk, text, n, add_special, *ids, *cap, n_ids, err);
    if (rv != MM_EFULL)
        return rv;
    int32_t *p = realloc(*ids, (*n_ids + 16) * sizeof(int32_t));
    if (!p)
        return mm_errf(err, MM_ENOMEM, "out of memory for %zu ids", *n_ids);
    *ids = p;
    *cap = *n_ids + 16;
    return mm_tokenizer_encode(tk, text, n, add_special, *ids, *cap, n_ids, err);
}

// bench reports encode throughput over the file: the first pass on a fresh tokenizer (empty
// word cache), then repeated passes for about `seconds`. chunk > 0 encodes chunk-byte pieces
// (cut at character boundaries) as separate calls, as a server sees separate requests.
static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int bench(const char *tok_path, const char *file, long long chunk, double seconds,
                 char err[MM_ERRLEN]) {
    char *text = NULL;
    size_t n = 0;
    if (read_file(file, &text, &n, err) != MM_OK) {
        fprintf(stderr, "tokenize: %s\n", err);
        return 1;
    }
    uint64_t t0 = mm_now_ns();
    mm_tokenizer *tk = NULL;
    if (mm_tokenizer_open(&tk, tok_path, err) != MM_OK) {
        fprintf(stderr, "tokenize: %s\n", err);
        free(text);
        return 1;
    }
    double load_s = (double)(mm_now_ns() - t0) / 1e9;
    size_t cap = n + 16, n_ids = 0, total_ids = 0;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    int rc = 0;
    double first_s = 0, warm_s = 0, first_wall = 0, warm_wall = 0;
    int passes = 0;
    while (ids && (passes == 0 || warm_s < seconds || passes < 2)) {
        uint64_t s0 = cpu_ns(), w0 = mm_now_ns();
        total_ids = 0;
        for (size_t off = 0; off < n;) {
            size_t len = chunk > 0 && (size_t)chunk < n - off ? (size_t)chunk : n - off;
            while (off + len < n && ((unsigned char)text[off + len] & 0xC0) == 0x80)
                len++; // do not cut a character
            if (encode_all(tk, text + off, len, false, &ids, &cap, &n_ids, err) != MM_OK) {
                fprintf(stderr, "tokenize: %s: %s\n", file, err);
                rc = 1;
                goto out;
            }
            total_ids += n_ids;
            off += len;
        }
        double dt = (double)(cpu_ns() - s0) / 1e9, dw = (double)(mm_now_ns() - w0) / 1e9;
        if (passes == 0) {
            first_s = dt;
            first_wall = dw;
        } else {
            warm_s += dt;
            warm_wall += dw;
        }
        passes++;
    }
    printf("file %s: %zu bytes, %zu ids (%.2f bytes/id), chunk %s\n", file, n, total_ids,
           total_ids ? (double)n / (double)total_ids : 0.0, chunk > 0 ? "per-call" : "whole file");
    if (chunk > 0)
        printf("chunk size %lld bytes\n", chunk);
    printf("load %.3f s\n", load_s);
    // MB/s per CPU-second of this thread (what one core does), and per wall-second (lower
    // when the machine is shared).
    printf("first pass (cold word cache) %.1f MB/s cpu, %.1f MB/s wall\n",
           (double)n / first_s / 1e6, (double)n / first_wall / 1e6);
    printf("warm passes (%d) %.1f MB/s cpu, %.1f MB/s wall\n", passes - 1,
           (double)n * (passes - 1) / warm_s / 1e6, (double)n * (passes - 1) / warm_wall / 1e6);
out:
    free(ids);
    free(text);
    mm_tokenizer_close(tk);
    return rc;
}

static int run_tokenize(int argc, char **argv) {
    char *tok = NULL, *text = NULL, *file = NULL, *bench_file = NULL;
    bool add_special = false;
    long long chunk = 0;
    double seconds = 2.0;
    mm_opt opts[] = {
        {"tokenizer", MM_OPT_STR, &tok, NULL, "checkpoint directory or tokenizer.json"},
        {"text", MM_OPT_STR, &text, NULL, "text to encode"},
        {"file", MM_OPT_STR, &file, NULL, "encode this file's bytes instead of --text"},
        {"add-special", MM_OPT_BOOL, &add_special, "false",
         "apply the post-processor template (e.g. a BOS token)"},
        {"bench", MM_OPT_STR, &bench_file, NULL, "measure encode throughput over FILE"},
        {"bench-chunk", MM_OPT_INT, &chunk, "0", "with --bench: bytes per encode call (0: all)"},
        {"bench-seconds", MM_OPT_DBL, &seconds, "2", "with --bench: time for warm passes"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh tokenize",
                  .summary = "Print the ids of --text (or --file) comma-separated on one line.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    char *buf = NULL;
    int32_t *ids = NULL;
    mm_tokenizer *tk = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "tokenize: %s\n", err);
        goto out;
    }
    if (cli.help_shown) {
        rc = 0;
        goto out;
    }
    if (!tok) {
        fprintf(stderr, "tokenize: --tokenizer DIR is required\n");
        goto out;
    }
    if (bench_file) {
        rc = bench(tok, bench_file, chunk, seconds, err);
        goto out;
    }
    if (!text == !file) {
        fprintf(stderr, "tokenize: give exactly one of --text STR or --file FILE\n");
        goto out;
    }
    rc = 1;
    size_t n;
    if (file) {
        if (read_file(file, &buf, &n, err) != MM_OK) {
            fprintf(stderr, "tokenize: %s\n", err);
            goto out;
        }
    } else {
        n = strlen(text);
    }
    if (mm_tokenizer_open(&tk, tok, err) != MM_OK) {
        fprintf(stderr, "tokenize: %s\n", err);
        goto out;
    }
    size_t cap = n + 16, n_ids = 0;
    ids = malloc(cap * sizeof(int32_t));
    if (!ids || encode_all(tk, file ? buf : text, n, add_special, &ids, &cap, &n_ids, err) != MM_OK) {
        fprintf(stderr, "tokenize: %s\n", ids ? err : "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_ids; i++)
        printf(i ? ",%d" : "%d", (int)ids[i]);
    printf("\n");
    rc = 0;
out:
    free(ids);
    free(buf);
    mm_tokenizer_close(tk);
    mm_config_fini(&cli);
    return rc;
}

// parse_ids reads "1,2, 3" into a malloc'd array.
static mm_err parse_ids(const char *s, int32_t **out, size_t *n, char err[MM_ERRLEN]) {
    size_t cap = 16, k = 0;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    const char *p = s;
    while (ids) {
        while (*p == ' ')
            p++;
        if (*p == 0 && k == 0)
            break; // empty list
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return mm_errf(err, MM_EINVAL, "--ids: '%.40s' is not a non-negative integer", p);
        }
        if (k == cap) {
            int32_t *q = realloc(ids, (cap *= 2) * sizeof(int32_t));
            if (!q)
                break;
            ids = q;
        }
        ids[k++] = (int32_t)v;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == 0) {
            *out = ids;
            *n = k;
            return MM_OK;
        }
        if (*p != ',') {
            free(ids);
            return mm_errf(err, MM_EINVAL, "--ids: expected ',' at '%.40s'", p);
        }
        p++;
    }
    if (!ids)
        return mm_errf(err, MM_ENOMEM, "out of memory");
    *out = ids;
    *n = k;
    return MM_OK;
}

static int run_detokenize(int argc, char **argv) {
    char *tok = NULL, *ids_s = NULL;
    bool skip_special = false;
    mm_opt opts[] = {
        {"tokenizer", MM_OPT_STR, &tok, NULL, "checkpoint directory or tokenizer.json"},
        {"ids", MM_OPT_STR, &ids_s, NULL, "comma-separated ids, e.g. 9707,1879"},
        {"skip-special", MM_OPT_BOOL, &skip_special, "false", "drop special tokens"},
        {0},
    };
    mm_cli cli = {.prog = "moemesh detokenize",
                  .summary = "Print the text of --ids, followed by a newline.",
                  .opts = opts};
    char err[MM_ERRLEN] = "";
    int rc = 2;
    int32_t *ids = NULL;
    char *out = NULL;
    mm_tokenizer *tk = NULL;
    if (mm_config_parse(&cli, argc, argv, err) != MM_OK) {
        fprintf(stderr, "detokenize: %s\n", err);
        goto done;
    }
    if (cli.help_shown) {
        rc = 0;
        goto done;
    }
    if (!tok || !ids_s) {
        fprintf(stderr, "detokenize: --tokenizer DIR and --ids LIST are required\n");
        goto done;
    }
    size_t n = 0;
    if (parse_ids(ids_s, &ids, &n, err) != MM_OK) {
        fprintf(stderr, "detokenize: %s\n", err);
        goto done;
    }
    rc = 1;
    if (mm_tokenizer_open(&tk, tok, err) != MM_OK) {
        fprintf(stderr, "detokenize: %s\n", err);
        goto done;
    }
    size_t len = 0;
    mm_err e = mm_tokenizer_decode(tk, ids, n, skip_special, NULL, 0, &len, err);
    if (e == MM_EFULL) {
        out = malloc(len + 1);
        e = out ? mm_tokenizer_decode(tk, ids, n, skip_special, out, len + 1, &len, err)
                : mm_errf(err, MM_ENOMEM, "out of memory");
    }
    if (e != MM_OK) {
        fprintf(stderr, "detokenize: %s\n", err);
        goto done;
    }
    fwrite(out ? out : "", 1, len, stdout);
    printf("\n");
    rc = 0;
done:
    free(out);
    free(ids);
    mm_tokenizer_close(tk);
    mm_config_fini(&cli);
    return rc;
}

MM_COMMAND(cmd_tokenize, "tokenize", "encode text to ids with a checkpoint's tokenizer.json",
           run_tokenize)
MM_COMMAND(cmd_detokenize, "detokenize", "decode ids to text with a checkpoint's tokenizer.json",
           run_detokenize)
