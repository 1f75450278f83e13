// SPDX-License-Identifier: MIT
// Hugging Face tokenizer.json, byte-level BPE: load, encode, decode and streaming decode.
//
// Design notes:
// - Encode follows tokenizers' pipeline: added tokens that are not "normalized" are matched on
//   the raw text (leftmost-longest, with lstrip/rstrip/single_word); the pieces between them
//   are normalized (utf8proc); "normalized" added tokens are then matched on the normalized
//   text; what is left goes through the pre-tokenizer stages (each a PCRE2 regex split with
//   tokenizers' SplitDelimiterBehavior) and then BPE, one pre-token ("word") at a time.
// - BPE works on raw bytes: vocab strings are mapped back through GPT-2's bytes_to_unicode
//   table at load, so a word's initial symbols are byte ids and merges are a hash map
//   (left id, right id) -> (rank, merged id). The lowest rank merges first, leftmost on ties,
//   exactly as tokenizers' Word::merge_all. Words up to 64 bytes use an O(n^2) scan, longer
//   ones a binary heap (O(n log n)), so a megabyte of spaces is not quadratic.
// - Word cache: a fixed table of slots pointing into a fixed pool, filled lock-free (a slot
//   goes from NULL to an immutable entry once, by CAS) and never evicted, so concurrent
//   encoders share it without locks and nothing is allocated per token. When the pool is
//   full the cache stops growing; results never depend on it.
// - PCRE2 patterns are compiled with UTF|UCP and JIT. Oniguruma (what tokenizers uses) counts
//   U+0085 as \s and PCRE2 does not, so \s and \S are rewritten to include it.
// - Decode concatenates token bytes and replaces invalid UTF-8 per maximal subpart, as Rust's
//   String::from_utf8_lossy does; the stream decoder holds at most 3 bytes of an unfinished
//   character and yields the same text.
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <utf8proc.h>

#include "mm/json.h"
#include "mm/tokenizer.h"

#define MAX_STAGES 8
#define MAX_TEMPLATE 16
#define SCAN_MAX 64                    // words up to this many bytes use the quadratic scan
#define CACHE_SLOTS (1u << 16)         // word cache slots (power of two)
#define CACHE_POOL_BYTES (6u << 20)    // word cache entries live here; never freed until close
#define CACHE_MAX_WORD 64              // longer words are not cached
#define CACHE_PROBES 8
#define MAX_VOCAB_ID 16000000          // ids beyond this are rejected as malformed

enum { TOK_VALID = 1, TOK_ADDED = 2, TOK_SPECIAL = 4 };

struct tok_entry {
    uint32_t off;   // into tk->tbytes: the bytes this id decodes to
    uint32_t len;
    uint8_t flags;  // TOK_*
};

struct key_entry {  // vocab map entry: the tokenizer.json spelling of a token
    uint32_t off;   // into tk->kbytes
    uint32_t len;
    int32_t id;
};

struct pair_slot {
    uint64_t key;   // (left << 32) | right; PAIR_EMPTY when free
    uint32_t rank;
    int32_t id;
};
#define PAIR_EMPTY UINT64_MAX

enum split_behavior { SB_REMOVED, SB_ISOLATED, SB_MERGED_PREV, SB_MERGED_NEXT, SB_CONTIGUOUS };
enum stage_kind { ST_SPLIT, ST_BYTELEVEL };

struct stage {
    enum stage_kind kind;
    pcre2_code *re;         // owned; NULL for a ByteLevel stage without use_regex
    bool jit;               // re was JIT-compiled
    enum split_behavior behavior;
    bool invert;
    bool add_prefix_space;  // ByteLevel only
};

struct added_tok {
    uint32_t off, len;      // match text in tk->kbytes (normalized when normalized is set)
    uint32_t orig_off, orig_len; // content as written, for mm_tokenizer_token_id
    int32_t id;
    bool lstrip, rstrip, single_word, normalized, special;
};

struct centry {             // word cache entry, followed by bytes (padded to 4) and ids
    uint64_t hash;
    uint16_t n_bytes;
    uint16_t n_ids;
    uint32_t pad_;
};

struct mm_tokenizer {
    // ids -> bytes
    struct tok_entry *tokens;   // (n_tokens,)
    size_t n_tokens;            // max id + 1
    char *tbytes;               // token bytes arena
    size_t tbytes_len, tbytes_cap;
    size_t max_token_bytes;
    // spelling -> id (open addressing, linear probing; slot = entry index + 1, 0 = free)
    struct key_entry *keys;
    size_t n_keys, keys_cap;
    char *kbytes;
    size_t kbytes_len, kbytes_cap;
    uint32_t *kslots;
    uint32_t kmask;
    // merges
    struct pair_slot *pairs;
    uint32_t pmask;
    int32_t byte_id[256];       // initial symbol of each byte; -1 if the vocab lacks it
    uint32_t b2u[256];          // GPT-2 bytes_to_unicode
    int32_t unk_id;             // -1: unknown bytes are dropped (tokenizers without unk)
    bool fuse_unk;
    bool ignore_merges;
    // normalizer: utf8proc options, 0 for none
    int norm_opts;
    // pre-tokenizer
    struct stage stages[MAX_STAGES];
    int n_stages;
    bool bytelevel;             // a ByteLevel pre-tokenizer was declared (it must be last)
    // added tokens: set 0 matched on raw text, set 1 on normalized text; each sorted by first
    // byte, then longest first; first[s][b]..first[s][b+1] indexes the run for byte b.
    struct added_tok *added[2];
    size_t n_added[2];
    uint32_t first[2][257];
    // post-processor template for add_special
    int32_t prefix_ids[MAX_TEMPLATE], suffix_ids[MAX_TEMPLATE];
    int n_prefix, n_suffix;
    // word cache
    struct centry *_Atomic *cslots;
    unsigned char *cpool;
    atomic_size_t cpool_used;
};

// ---- small helpers ---------------------------------------------------------------------------

static uint64_t hash_bytes(const void *p_, size_t n) {
    const unsigned char *p = p_;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, p, n);
    h = (h ^ v) * 0x94d049bb133111ebull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

static inline uint64_t hash_pair(uint64_t key) {
    key *= 0x9E3779B97F4A7C15ull;
    return key ^ (key >> 29);
}

// GPT-2 bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 map to
// U+0100.. in byte order.
static void bytelevel_table(uint32_t b2u[256]) {
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        b2u[b] = keep ? (uint32_t)b : 256 + n++;
    }
}

// u2b is the inverse of bytelevel_table: code point (< 324) -> byte, or -1.
static void bytelevel_inverse(int16_t u2b[324]) {
    uint32_t b2u[256];
    bytelevel_table(b2u);
    for (int i = 0; i < 324; i++)
        u2b[i] = -1;
    for (int b = 0; b < 256; b++)
        u2b[b2u[b]] = (int16_t)b;
}

// ---- UTF-8 -----------------------------------------------------------------------------------

enum { U8_VALID, U8_INVALID, U8_INCOMPLETE };

// utf8_class classifies the sequence at s (n >= 1 bytes available): U8_VALID with its length,
// U8_INVALID with the length of the maximal subpart to replace by one U+FFFD, or
// U8_INCOMPLETE when the n bytes are a valid prefix that the input ends inside.
static int utf8_class(const uint8_t *s, size_t n, size_t *len) {
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *len = 1;
        return U8_VALID;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; // range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF)
        need = 2;
    else if (b0 == 0xE0)
        need = 3, lo = 0xA0;
    else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF)
        need = 3;
    else if (b0 == 0xED)
        need = 3, hi = 0x9F;
    else if (b0 == 0xF0)
        need = 4, lo = 0x90;
    else if (b0 >= 0xF1 && b0 <= 0xF3)
        need = 4;
    else if (b0 == 0xF4)
        need = 4, hi = 0x8F;
    else {
        *len = 1;
        return U8_INVALID;
    }
    for (size_t k = 1; k < need; k++) {
        if (k >= n) {
            *len = k;
            return U8_INCOMPLETE;
        }
        uint8_t c = s[k];
        uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (c < l || c > h) {
            *len = k;
            return U8_INVALID;
        }
    }
    *len = need;
    return U8_VALID;
}

static uint32_t utf8_decode(const uint8_t *s, size_t len) {
    switch (len) {
    case 1: return s[0];
    case 2: return ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    case 3: return ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    default:
        return ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
               ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
    }
}

static size_t utf8_encode(uint32_t cp, uint8_t *o) {
    if (cp < 0x80) {
        o[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (uint8_t)(0xC0 | (cp >> 6));
        o[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | (cp >> 12));
        o[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | (cp >> 18));
    o[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

static bool is_ascii(const uint8_t *s, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, s + i, 8);
        if (v & 0x8080808080808080ull)
            return false;
    }
    for (; i < n; i++)
        if (s[i] & 0x80)
            return false;
    return true;
}

// utf8_validate returns true when s is valid UTF-8; otherwise *bad is the first bad offset.
static bool utf8_validate(const uint8_t *s, size_t n, size_t *bad) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t len;
        if (utf8_class(s + i, n - i, &len) != U8_VALID) {
            *bad = i;
            return false;
        }
        i += len;
    }
    return true;
}

// Rust's char::is_whitespace (the White_Space property).
static bool is_ws(uint32_t c) {
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

// A word character for single_word added tokens: alphanumeric or '_'.
static bool is_word_char(uint32_t c) {
    if (c < 0x80)
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
               c == '_';
    utf8proc_category_t cat = utf8proc_category((utf8proc_int32_t)c);
    return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
           (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// Last code point before s+end (s valid UTF-8, end > 0).
static uint32_t cp_before(const uint8_t *s, size_t end, size_t *start) {
    size_t i = end - 1;
    while (i > 0 && (s[i] & 0xC0) == 0x80)
        i--;
    *start = i;
    return utf8_decode(s + i, end - i);
}

static uint32_t cp_at(const uint8_t *s, size_t n, size_t *len) {
    if (utf8_class(s, n, len) != U8_VALID) {
        *len = 1;
        return 0xFFFD;
    }
    return utf8_decode(s, *len);
}

// ---- maps ------------------------------------------------------------------------------------

static mm_err grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap)
        return MM_OK;
    size_t nc = *cap ? *cap : 1024;
    while (nc < need)
        nc *= 2;
    void *q = realloc(*p, nc * elem);
    if (!q)
        return MM_ENOMEM;
    *p = q;
    *cap = nc;
    return MM_OK;
}

static mm_err kbytes_add(mm_tokenizer *tk, const void *s, size_t n, uint32_t *off) {
    MM_TRY(grow((void **)&tk->kbytes, &tk->kbytes_cap, tk->kbytes_len + n + 1, 1));
    memcpy(tk->kbytes + tk->kbytes_len, s, n);
    tk->kbytes[tk->kbytes_len + n] = 0;
    *off = (uint32_t)tk->kbytes_len;
    tk->kbytes_len += n + 1;
    return MM_OK;
}

static mm_err tbytes_add(mm_tokenizer *tk, const void *s, size_t n, uint32_t *off) {
    MM_TRY(grow((void **)&tk->tbytes, &tk->tbytes_cap, tk->tbytes_len + n, 1));
    memcpy(tk->tbytes + tk->tbytes_len, s, n);
    *off = (uint32_t)tk->tbytes_len;
    tk->tbytes_len += n;
    return MM_OK;
}

static int32_t vocab_find(const mm_tokenizer *tk, const char *s, size_t n) {
    if (!tk->kslots)
        return -1;
    for (uint32_t i = (uint32_t)hash_bytes(s, n) & tk->kmask;; i = (i + 1) & tk->kmask) {
        uint32_t e = tk->kslots[i];
        if (e == 0)
            return -1;
        const struct key_entry *k = &tk->keys[e - 1];
        if (k->len == n && !memcmp(tk->kbytes + k->off, s, n))
            return k->id;
    }
}

// vocab_put inserts or overwrites spelling s -> id. The table is sized before inserting.
static mm_err vocab_put(mm_tokenizer *tk, const char *s, size_t n, int32_t id) {
    uint32_t i = (uint32_t)hash_bytes(s, n) & tk->kmask;
    for (;; i = (i + 1) & tk->kmask) {
        uint32_t e = tk->kslots[i];
        if (e == 0)
            break;
        struct key_entry *k = &tk->keys[e - 1];
        if (k->len == n && !memcmp(tk->kbytes + k->off, s, n)) {
            k->id = id;
            return MM_OK;
        }
    }
    MM_TRY(grow((void **)&tk->keys, &tk->keys_cap, tk->n_keys + 1, sizeof(*tk->keys)));
    struct key_entry *k = &tk->keys[tk->n_keys];
    MM_TRY(kbytes_add(tk, s, n, &k->off));
    k->len = (uint32_t)n;
    k->id = id;
    tk->kslots[i] = (uint32_t)++tk->n_keys;
    return MM_OK;
}

static inline bool pair_get(const mm_tokenizer *tk, int32_t a, int32_t b, uint32_t *rank,
                            int32_t *id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint32_t i = (uint32_t)hash_pair(key) & tk->pmask;; i = (i + 1) & tk->pmask) {
        const struct pair_slot *s = &tk->pairs[i];
        if (s->key == key) {
            *rank = s->rank;
            *id = s->id;
            return true;
        }
        if (s->key == PAIR_EMPTY)
            return false;
    }
}

static void pair_put(mm_tokenizer *tk, int32_t a, int32_t b, uint32_t rank, int32_t id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint32_t i = (uint32_t)hash_pair(key) & tk->pmask;; i = (i + 1) & tk->pmask) {
        struct pair_slot *s = &tk->pairs[i];
        if (s->key == PAIR_EMPTY || s->key == key) { // a duplicate merge keeps the later rank
            s->key = key;
            s->rank = rank;
            s->id = id;
            return;
        }
    }
}

static uint32_t pow2_at_least(size_t n) {
    uint32_t p = 1024;
    while (p < n)
        p *= 2;
    return p;
}

// ---- loading ---------------------------------------------------------------------------------

// Context for error messages: the file being read.
struct load {
    mm_tokenizer *tk;
    const char *file;
    char *err;
    int16_t u2b[324];
};

// token_bytes turns a tokenizer.json spelling into the bytes it decodes to: byte-level
// characters map back to their bytes; a spelling with any other character is taken as its
// own UTF-8 (tokenizers' ByteLevel decoder does the same).
static size_t token_bytes(const struct load *ld, const char *s, size_t n, uint8_t *out) {
    const uint8_t *u = (const uint8_t *)s;
    size_t o = 0, i = 0;
    while (i < n) {
        size_t len;
        if (utf8_class(u + i, n - i, &len) != U8_VALID)
            break;
        uint32_t cp = utf8_decode(u + i, len);
        if (cp >= 324 || ld->u2b[cp] < 0)
            break;
        out[o++] = (uint8_t)ld->u2b[cp];
        i += len;
    }
    if (i == n)
        return o;
    memcpy(out, s, n);
    return n;
}

static mm_err set_token(struct load *ld, int32_t id, const char *s, size_t n, uint8_t flags) {
    mm_tokenizer *tk = ld->tk;
    uint8_t stackbuf[256];
    uint8_t *buf = n <= sizeof(stackbuf) ? stackbuf : malloc(n);
    if (!buf)
        return MM_ENOMEM;
    size_t m = token_bytes(ld, s, n, buf);
    struct tok_entry *t = &tk->tokens[id];
    mm_err rv = tbytes_add(tk, buf, m, &t->off);
    if (buf != stackbuf)
        free(buf);
    MM_TRY(rv);
    t->len = (uint32_t)m;
    t->flags = TOK_VALID | flags;
    if (m > tk->max_token_bytes)
        tk->max_token_bytes = m;
    return MM_OK;
}

static mm_err get_id(struct load *ld, json_t *v, const char *what, int32_t *id) {
    if (!json_is_integer(v))
        return mm_errf(ld->err, MM_EFORMAT, "%s: %s is not an integer id", ld->file, what);
    json_int_t x = json_integer_value(v);
    if (x < 0 || x > MAX_VOCAB_ID)
        return mm_errf(ld->err, MM_EFORMAT, "%s: %s has id %lld, outside 0..%d", ld->file, what,
                       (long long)x, MAX_VOCAB_ID);
    *id = (int32_t)x;
    return MM_OK;
}

static bool json_flag(json_t *o, const char *key, bool def) {
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

static mm_err normalize_text(const mm_tokenizer *tk, const uint8_t *s, size_t n, uint8_t **out,
                             size_t *out_n);

static mm_err load_vocab(struct load *ld, json_t *vocab, json_t *added) {
    mm_tokenizer *tk = ld->tk;
    // Size the id table from the largest id of the vocab and the added tokens.
    int32_t max_id = -1, id;
    const char *key;
    json_t *v;
    char what[96];
    json_object_foreach(vocab, key, v) {
        snprintf(what, sizeof(what), "vocab entry '%.40s'", key);
        MM_TRY(get_id(ld, v, what, &id));
        if (id > max_id)
            max_id = id;
    }
    size_t i;
    json_array_foreach(added, i, v) {
        if (!json_is_object(v))
            return mm_errf(ld->err, MM_EFORMAT, "%s: added_tokens[%zu] is not an object",
                           ld->file, i);
        snprintf(what, sizeof(what), "added_tokens[%zu].id", i);
        MM_TRY(get_id(ld, json_object_get(v, "id"), what, &id));
        if (id > max_id)
            max_id = id;
        json_t *c = json_object_get(v, "content");
        if (!json_is_string(c) || json_string_length(c) == 0)
            return mm_errf(ld->err, MM_EFORMAT,
                           "%s: added_tokens[%zu].content is missing or empty", ld->file, i);
    }
    if (max_id < 0)
        return mm_errf(ld->err, MM_EFORMAT, "%s: model.vocab is empty", ld->file);
    tk->n_tokens = (size_t)max_id + 1;
    tk->tokens = calloc(tk->n_tokens, sizeof(*tk->tokens));
    size_t n_keys = json_object_size(vocab);
    tk->kmask = pow2_at_least(n_keys * 2) - 1;
    tk->kslots = calloc((size_t)tk->kmask + 1, sizeof(*tk->kslots));
    if (!tk->tokens || !tk->kslots)
        return MM_ENOMEM;
    json_object_foreach(vocab, key, v) {
        id = (int32_t)json_integer_value(v);
        size_t n = strlen(key);
        MM_TRY(vocab_put(tk, key, n, id));
        MM_TRY(set_token(ld, id, key, n, 0));
    }
    // Added tokens: their content decodes in place of any vocab spelling of the same id.
    size_t n_added = json_array_size(added);
    for (int s = 0; s < 2; s++) {
        tk->added[s] = calloc(n_added ? n_added : 1, sizeof(struct added_tok));
        if (!tk->added[s])
            return MM_ENOMEM;
    }
    json_array_foreach(added, i, v) {
        id = (int32_t)json_integer_value(json_object_get(v, "id"));
        json_t *c = json_object_get(v, "content");
        const char *content = json_string_value(c);
        size_t n = json_string_length(c);
        bool special = json_flag(v, "special", false);
        // Not in the vocab map: merges, byte symbols and unk resolve in the model's vocab
        // only, as in tokenizers; mm_tokenizer_token_id looks at added tokens first.
        MM_TRY(set_token(ld, id, content, n, TOK_ADDED | (special ? TOK_SPECIAL : 0)));
        bool normalized = json_flag(v, "normalized", !special);
        struct added_tok a = {
            .id = id,
            .lstrip = json_flag(v, "lstrip", false),
            .rstrip = json_flag(v, "rstrip", false),
            .single_word = json_flag(v, "single_word", false),
            .normalized = normalized && tk->norm_opts != 0,
            .special = special,
        };
        // A normalized token is matched in normalized text, so normalize its content too.
        uint8_t *norm = NULL;
        size_t norm_n = n;
        if (a.normalized)
            MM_TRY(normalize_text(tk, (const uint8_t *)content, n, &norm, &norm_n));
        mm_err rv = kbytes_add(tk, norm ? (const char *)norm : content, norm_n, &a.off);
        free(norm);
        MM_TRY(rv);
        MM_TRY(kbytes_add(tk, content, n, &a.orig_off));
        a.orig_len = (uint32_t)n;
        a.len = (uint32_t)norm_n;
        if (a.len == 0)
            continue;
        int set = a.normalized ? 1 : 0;
        tk->added[set][tk->n_added[set]++] = a;
    }
    return MM_OK;
}

static void sort_added(mm_tokenizer *tk) {
    // Insertion sort by (first byte, longest first, id): C11 qsort has no context argument
    // and added-token lists are short (tens to hundreds).
    for (int s = 0; s < 2; s++) {
        struct added_tok *a = tk->added[s];
        size_t n = tk->n_added[s];
        for (size_t i = 1; i < n; i++) {
            struct added_tok x = a[i];
            size_t j = i;
            while (j > 0) {
                // compare a[j-1] with x
                uint8_t f1 = (uint8_t)tk->kbytes[a[j - 1].off], f2 = (uint8_t)tk->kbytes[x.off];
                bool after = f1 > f2 || (f1 == f2 && (a[j - 1].len < x.len ||
                                                      (a[j - 1].len == x.len && a[j - 1].id > x.id)));
                if (!after)
                    break;
                a[j] = a[j - 1];
                j--;
            }
            a[j] = x;
        }
        uint32_t k = 0;
        for (int b = 0; b <= 256; b++) {
            while (k < n && (uint8_t)tk->kbytes[a[k].off] < b)
                k++;
            tk->first[s][b] = k;
        }
        tk->first[s][256] = (uint32_t)n;
    }
}

static mm_err load_merges(struct load *ld, json_t *merges) {
    mm_tokenizer *tk = ld->tk;
    size_t n = json_array_size(merges);
    tk->pmask = pow2_at_least(n * 2 + 16) - 1;
    tk->pairs = malloc(((size_t)tk->pmask + 1) * sizeof(*tk->pairs));
    if (!tk->pairs)
        return MM_ENOMEM;
    for (size_t i = 0; i <= tk->pmask; i++)
        tk->pairs[i].key = PAIR_EMPTY;
    char *cat = NULL;
    size_t cat_cap = 0;
    mm_err rv = MM_OK;
    size_t i;
    json_t *m;
    json_array_foreach(merges, i, m) {
        const char *a, *b;
        size_t na, nb;
        if (json_is_string(m)) {
            // "a b": exactly two tokens separated by one space (tokenizers' rule).
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ') || sp == s || sp[1] == 0) {
                rv = mm_errf(ld->err, MM_EFORMAT,
                             "%s: model.merges[%zu] '%.60s' is not two tokens separated by one "
                             "space", ld->file, i, s);
                break;
            }
            a = s, na = (size_t)(sp - s), b = sp + 1, nb = strlen(sp + 1);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            na = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            nb = json_string_length(json_array_get(m, 1));
        } else {
            rv = mm_errf(ld->err, MM_EFORMAT,
                         "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", ld->file,
                         i);
            break;
        }
        int32_t ia = vocab_find(tk, a, na), ib = vocab_find(tk, b, nb);
        if (ia < 0 || ib < 0) {
            rv = mm_errf(ld->err, MM_EFORMAT, "%s: model.merges[%zu]: token '%.*s' is not in the "
                         "vocab", ld->file, i, (int)(ia < 0 ? (na > 60 ? 60 : na) : (nb > 60 ? 60 : nb)),
                         ia < 0 ? a : b);
            break;
        }
        if (na + nb > cat_cap) {
            cat_cap = (na + nb) * 2 + 64;
            char *c2 = realloc(cat, cat_cap);
            if (!c2) {
                rv = MM_ENOMEM;
                break;
            }
            cat = c2;
        }
        memcpy(cat, a, na);
        memcpy(cat + na, b, nb);
        int32_t im = vocab_find(tk, cat, na + nb);
        if (im < 0) {
            rv = mm_errf(ld->err, MM_EFORMAT, "%s: model.merges[%zu]: merged token '%.*s' is not "
                         "in the vocab", ld->file, i, (int)(na + nb > 60 ? 60 : na + nb), cat);
            break;
        }
        pair_put(tk, ia, ib, (uint32_t)i, im);
    }
    free(cat);
    return rv;
}

static mm_err load_normalizer(struct load *ld, json_t *norm) {
    if (!norm || json_is_null(norm))
        return MM_OK;
    const char *type = json_string_value(json_object_get(norm, "type"));
    if (!type)
        return mm_errf(ld->err, MM_EFORMAT, "%s: normalizer has no 'type'", ld->file);
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(norm, "normalizers");
        if (!json_is_array(list))
            return mm_errf(ld->err, MM_EFORMAT, "%s: Sequence normalizer has no 'normalizers' "
                           "array", ld->file);
        size_t i;
        json_t *v;
        json_array_foreach(list, i, v) {
            int before = ld->tk->norm_opts;
            MM_TRY(load_normalizer(ld, v));
            if (before && ld->tk->norm_opts != before)
                return mm_errf(ld->err, MM_EUNSUPP, "%s: a Sequence of two different Unicode "
                               "normalization forms is not supported", ld->file);
        }
        return MM_OK;
    }
    int opts;
    if (!strcmp(type, "NFC"))
        opts = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    else if (!strcmp(type, "NFD"))
        opts = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
    else if (!strcmp(type, "NFKC"))
        opts = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    else if (!strcmp(type, "NFKD"))
        opts = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
    else
        return mm_errf(ld->err, MM_EUNSUPP, "%s: normalizer type '%s' is not supported (NFC, "
                       "NFD, NFKC, NFKD or a Sequence of one of them)", ld->file, type);
    ld->tk->norm_opts = opts;
    return MM_OK;
}

// rewrite_pattern copies an Oniguruma pattern for PCRE2, making \s and \S include U+0085 as
// Oniguruma's Unicode \s does. Returns a malloc'd string.
static char *rewrite_pattern(const char *p) {
    size_t n = strlen(p);
    char *o = malloc(n * 12 + 1);
    if (!o)
        return NULL;
    size_t j = 0;
    int in_class = 0;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (c == '\\' && i + 1 < n) {
            char d = p[i + 1];
            if (d == 's') {
                const char *r = in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
                memcpy(o + j, r, strlen(r));
                j += strlen(r);
            } else if (d == 'S' && !in_class) {
                memcpy(o + j, "[^\\s\\x{85}]", 11);
                j += 11;
            } else {
                o[j++] = c;
                o[j++] = d;
            }
            i++;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = 1;
            o[j++] = c;
            // A ']' right after '[' or '[^' is a literal.
            if (i + 1 < n && p[i + 1] == '^')
                o[j++] = p[++i];
            if (i + 1 < n && p[i + 1] == ']')
                o[j++] = p[++i];
            continue;
        }
        if (c == '[' && in_class && i + 1 < n && p[i + 1] == ':') {
            const char *end = strstr(p + i + 2, ":]"); // POSIX class [:alpha:]
            if (end) {
                size_t len = (size_t)(end + 2 - (p + i));
                memcpy(o + j, p + i, len);
                j += len;
                i += len - 1;
                continue;
            }
        }
        if (c == ']' && in_class)
            in_class = 0;
        o[j++] = c;
    }
    o[j] = 0;
    return o;
}

static mm_err compile_re(struct load *ld, const char *pattern, bool literal, struct stage *st) {
    char *pat = literal ? strdup(pattern) : rewrite_pattern(pattern);
    if (!pat)
        return MM_ENOMEM;
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    st->re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opts, &ec, &eo, NULL);
    free(pat);
    if (!st->re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof(msg));
        return mm_errf(ld->err, MM_EFORMAT, "%s: pre-tokenizer regex '%.80s' does not compile "
                       "at offset %zu: %s", ld->file, pattern, (size_t)eo, (char *)msg);
    }
    st->jit = pcre2_jit_compile(st->re, PCRE2_JIT_COMPLETE) == 0;
    return MM_OK;
}

static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static mm_err add_stage(struct load *ld, struct stage **st) {
    mm_tokenizer *tk = ld->tk;
    if (tk->bytelevel)
        return mm_errf(ld->err, MM_EUNSUPP, "%s: a pre-tokenizer after ByteLevel is not "
                       "supported", ld->file);
    if (tk->n_stages == MAX_STAGES)
        return mm_errf(ld->err, MM_EUNSUPP, "%s: more than %d pre-tokenizers", ld->file,
                       MAX_STAGES);
    *st = &tk->stages[tk->n_stages++];
    memset(*st, 0, sizeof(**st));
    return MM_OK;
}

static mm_err load_pretok(struct load *ld, json_t *pt) {
    if (!pt || json_is_null(pt))
        return MM_OK;
    const char *type = json_string_value(json_object_get(pt, "type"));
    if (!type)
        return mm_errf(ld->err, MM_EFORMAT, "%s: pre_tokenizer has no 'type'", ld->file);
    struct stage *st;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(pt, "pretokenizers");
        if (!json_is_array(list))
            return mm_errf(ld->err, MM_EFORMAT, "%s: Sequence pre_tokenizer has no "
                           "'pretokenizers' array", ld->file);
        size_t i;
        json_t *v;
        json_array_foreach(list, i, v) MM_TRY(load_pretok(ld, v));
        return MM_OK;
    }
    if (!strcmp(type, "Split")) {
        MM_TRY(add_stage(ld, &st));
        st->kind = ST_SPLIT;
        json_t *pat = json_object_get(pt, "pattern");
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        if (!re && !lit)
            return mm_errf(ld->err, MM_EFORMAT, "%s: Split pre_tokenizer has no pattern.Regex "
                           "or pattern.String", ld->file);
        const char *b = json_string_value(json_object_get(pt, "behavior"));
        if (!b)
            return mm_errf(ld->err, MM_EFORMAT, "%s: Split pre_tokenizer has no 'behavior'",
                           ld->file);
        if (!strcmp(b, "Removed"))
            st->behavior = SB_REMOVED;
        else if (!strcmp(b, "Isolated"))
            st->behavior = SB_ISOLATED;
        else if (!strcmp(b, "MergedWithPrevious"))
            st->behavior = SB_MERGED_PREV;
        else if (!strcmp(b, "MergedWithNext"))
            st->behavior = SB_MERGED_NEXT;
        else if (!strcmp(b, "Contiguous"))
            st->behavior = SB_CONTIGUOUS;
        else
            return mm_errf(ld->err, MM_EFORMAT, "%s: Split behavior '%s' is unknown", ld->file,
                           b);
        st->invert = json_flag(pt, "invert", false);
        return compile_re(ld, re ? re : lit, re == NULL, st);
    }
    if (!strcmp(type, "ByteLevel")) {
        MM_TRY(add_stage(ld, &st));
        st->kind = ST_BYTELEVEL;
        st->behavior = SB_ISOLATED;
        st->add_prefix_space = json_flag(pt, "add_prefix_space", true);
        ld->tk->bytelevel = true;
        if (json_flag(pt, "use_regex", true))
            return compile_re(ld, GPT2_PATTERN, false, st);
        if (!st->add_prefix_space)
            ld->tk->n_stages--; // only maps bytes, which BPE on raw bytes does anyway
        return MM_OK;
    }
    if (!strcmp(type, "Digits")) {
        MM_TRY(add_stage(ld, &st));
        st->kind = ST_SPLIT;
        st->behavior = json_flag(pt, "individual_digits", false) ? SB_ISOLATED : SB_CONTIGUOUS;
        return compile_re(ld, "\\p{N}", false, st);
    }
    if (!strcmp(type, "Whitespace")) {
        MM_TRY(add_stage(ld, &st));
        st->kind = ST_SPLIT;
        st->behavior = SB_REMOVED;
        st->invert = true;
        return compile_re(ld, "\\w+|[^\\w\\s]+", false, st);
    }
    if (!strcmp(type, "WhitespaceSplit")) {
        MM_TRY(add_stage(ld, &st));
        st->kind = ST_SPLIT;
        st->behavior = SB_REMOVED;
        return compile_re(ld, "\\s+", false, st);
    }
    return mm_errf(ld->err, MM_EUNSUPP, "%s: pre_tokenizer type '%s' is not supported (Split, "
                   "ByteLevel, Digits, Whitespace, WhitespaceSplit, Sequence)", ld->file, type);
}

static mm_err template_ids(struct load *ld, json_t *specials, const char *name, int32_t *ids,
                           int *n) {
    json_t *ent = json_object_get(specials, name);
    json_t *list = json_object_get(ent, "ids");
    if (!json_is_array(list))
        return mm_errf(ld->err, MM_EFORMAT, "%s: post_processor special token '%s' has no ids",
                       ld->file, name);
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v) {
        int32_t id;
        MM_TRY(get_id(ld, v, "post_processor special token", &id));
        if (*n == MAX_TEMPLATE)
            return mm_errf(ld->err, MM_EUNSUPP, "%s: post_processor adds more than %d tokens",
                           ld->file, MAX_TEMPLATE);
        ids[(*n)++] = id;
    }
    return MM_OK;
}

static mm_err load_post(struct load *ld, json_t *pp) {
    mm_tokenizer *tk = ld->tk;
    if (!pp || json_is_null(pp))
        return MM_OK;
    const char *type = json_string_value(json_object_get(pp, "type"));
    if (!type)
        return mm_errf(ld->err, MM_EFORMAT, "%s: post_processor has no 'type'", ld->file);
    if (!strcmp(type, "ByteLevel"))
        return MM_OK; // only trims offsets
    if (!strcmp(type, "Sequence")) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(pp, "processors"), i, v) MM_TRY(load_post(ld, v));
        return MM_OK;
    }
    if (!strcmp(type, "TemplateProcessing")) {
        json_t *single = json_object_get(pp, "single");
        json_t *specials = json_object_get(pp, "special_tokens");
        if (!json_is_array(single))
            return mm_errf(ld->err, MM_EFORMAT, "%s: TemplateProcessing has no 'single' list",
                           ld->file);
        bool seen_seq = false;
        size_t i;
        json_t *item;
        json_array_foreach(single, i, item) {
            json_t *sp = json_object_get(item, "SpecialToken");
            if (json_object_get(item, "Sequence")) {
                seen_seq = true;
            } else if (sp) {
                const char *name = json_string_value(json_object_get(sp, "id"));
                if (!name)
                    return mm_errf(ld->err, MM_EFORMAT, "%s: TemplateProcessing item %zu has "
                                   "no id", ld->file, i);
                if (seen_seq)
                    MM_TRY(template_ids(ld, specials, name, tk->suffix_ids, &tk->n_suffix));
                else
                    MM_TRY(template_ids(ld, specials, name, tk->prefix_ids, &tk->n_prefix));
            } else {
                return mm_errf(ld->err, MM_EFORMAT, "%s: TemplateProcessing item %zu is "
                               "neither SpecialToken nor Sequence", ld->file, i);
            }
        }
        return MM_OK;
    }
    return mm_errf(ld->err, MM_EUNSUPP, "%s: post_processor type '%s' is not supported "
                   "(ByteLevel, TemplateProcessing, Sequence)", ld->file, type);
}

static mm_err load_decoder(struct load *ld, json_t *dec) {
    if (!dec || json_is_null(dec))
        return mm_errf(ld->err, MM_EUNSUPP, "%s: no decoder (only the ByteLevel decoder is "
                       "supported)", ld->file);
    const char *type = json_string_value(json_object_get(dec, "type"));
    if (!type)
        return mm_errf(ld->err, MM_EFORMAT, "%s: decoder has no 'type'", ld->file);
    if (!strcmp(type, "ByteLevel"))
        return MM_OK;
    if (!strcmp(type, "Sequence")) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(dec, "decoders"), i, v) MM_TRY(load_decoder(ld, v));
        return MM_OK;
    }
    return mm_errf(ld->err, MM_EUNSUPP, "%s: decoder type '%s' is not supported (ByteLevel)",
                   ld->file, type);
}

static mm_err load_model(struct load *ld, json_t *root) {
    mm_tokenizer *tk = ld->tk;
    json_t *model = json_object_get(root, "model");
    if (!model || json_is_null(model))
        return mm_errf(ld->err, MM_EFORMAT, "%s: missing 'model'", ld->file);
    if (!json_is_object(model))
        return mm_errf(ld->err, MM_EFORMAT, "%s: 'model' is not an object", ld->file);
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    const char *type = json_string_value(json_object_get(model, "type"));
    if (!type && json_object_get(model, "type"))
        return mm_errf(ld->err, MM_EFORMAT, "%s: model.type is not a string", ld->file);
    if (!type && merges) // tokenizers infers an untagged model from its fields
        type = "BPE";
    if (!type)
        return mm_errf(ld->err, MM_EFORMAT, "%s: model has no 'type'", ld->file);
    if (strcmp(type, "BPE"))
        return mm_errf(ld->err, MM_EUNSUPP, "%s: model type '%s' is not supported (only BPE)",
                       ld->file, type);
    if (!json_is_object(vocab))
        return mm_errf(ld->err, MM_EFORMAT, "%s: model.vocab is missing or not an object",
                       ld->file);
    if (!json_is_array(merges))
        return mm_errf(ld->err, MM_EFORMAT, "%s: model.merges is missing or not an array",
                       ld->file);
    json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_array(added) && !json_is_null(added))
        return mm_errf(ld->err, MM_EFORMAT, "%s: added_tokens is not an array", ld->file);
    const char *s;
    if ((s = json_string_value(json_object_get(model, "continuing_subword_prefix"))) && *s)
        return mm_errf(ld->err, MM_EUNSUPP, "%s: BPE continuing_subword_prefix '%s' is not "
                       "supported", ld->file, s);
    if ((s = json_string_value(json_object_get(model, "end_of_word_suffix"))) && *s)
        return mm_errf(ld->err, MM_EUNSUPP, "%s: BPE end_of_word_suffix '%s' is not supported",
                       ld->file, s);
    if (json_flag(model, "byte_fallback", false))
        return mm_errf(ld->err, MM_EUNSUPP, "%s: BPE byte_fallback is not supported", ld->file);
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0)
        return mm_errf(ld->err, MM_EUNSUPP, "%s: BPE dropout is not supported", ld->file);
    tk->ignore_merges = json_flag(model, "ignore_merges", false);
    tk->fuse_unk = json_flag(model, "fuse_unk", false);

    // The normalizer first: normalized added tokens are stored normalized.
    MM_TRY(load_normalizer(ld, json_object_get(root, "normalizer")));
    json_t *none = added ? NULL : json_array();
    mm_err rv = load_vocab(ld, vocab, added ? added : none);
    json_decref(none);
    MM_TRY(rv);
    sort_added(tk);
    MM_TRY(load_merges(ld, merges));
    MM_TRY(load_pretok(ld, json_object_get(root, "pre_tokenizer")));
    if (!tk->bytelevel)
        return mm_errf(ld->err, MM_EUNSUPP, "%s: BPE without a ByteLevel pre-tokenizer (e.g. "
                       "SentencePiece-style Metaspace) is not supported", ld->file);
    MM_TRY(load_post(ld, json_object_get(root, "post_processor")));
    MM_TRY(load_decoder(ld, json_object_get(root, "decoder")));

    tk->unk_id = -1;
    const char *unk = json_string_value(json_object_get(model, "unk_token"));
    if (unk && (tk->unk_id = vocab_find(tk, unk, strlen(unk))) < 0)
        return mm_errf(ld->err, MM_EFORMAT, "%s: unk_token '%s' is not in the vocab", ld->file,
                       unk);
    bytelevel_table(tk->b2u);
    for (int b = 0; b < 256; b++) {
        uint8_t u[4];
        size_t n = utf8_encode(tk->b2u[b], u);
        tk->byte_id[b] = vocab_find(tk, (const char *)u, n);
    }
    // Every template id must exist.
    for (int i = 0; i < tk->n_prefix + tk->n_suffix; i++) {
        int32_t id = i < tk->n_prefix ? tk->prefix_ids[i] : tk->suffix_ids[i - tk->n_prefix];
        if ((size_t)id >= tk->n_tokens || !(tk->tokens[id].flags & TOK_VALID))
            return mm_errf(ld->err, MM_EFORMAT, "%s: post_processor adds id %d, which is not in "
                           "the vocab", ld->file, (int)id);
    }
    return MM_OK;
}

mm_err mm_tokenizer_open(mm_tokenizer **out, const char *path, char err[MM_ERRLEN]) {
    if (!out || !path)
        return mm_errf(err, MM_EINVAL, "mm_tokenizer_open: NULL argument");
    *out = NULL;
    char file[4096];
    struct stat sb;
    if (stat(path, &sb) != 0)
        return mm_errf(err, MM_ENOENT, "%s: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode))
        snprintf(file, sizeof(file), "%s/tokenizer.json", path);
    else
        snprintf(file, sizeof(file), "%s", path);
    json_t *root = NULL;
    mm_err rv = mm_json_load_file(file, &root, err);
    if (rv != MM_OK)
        return rv;
    mm_tokenizer *tk = calloc(1, sizeof(*tk));
    struct load ld = {.tk = tk, .file = file, .err = err};
    bytelevel_inverse(ld.u2b);
    if (!tk) {
        rv = MM_ENOMEM;
        goto fail;
    }
    if (!json_is_object(root)) {
        rv = mm_errf(err, MM_EFORMAT, "%s: top level is not a JSON object", file);
        goto fail;
    }
    MM_TRY_GOTO(rv, load_model(&ld, root), fail);
    tk->cslots = calloc(CACHE_SLOTS, sizeof(*tk->cslots));
    tk->cpool = malloc(CACHE_POOL_BYTES);
    if (!tk->cslots || !tk->cpool) {
        rv = MM_ENOMEM;
        goto fail;
    }
    atomic_init(&tk->cpool_used, 0);
    json_decref(root);
    *out = tk;
    return MM_OK;
fail:
    if (rv == MM_ENOMEM)
        mm_errf(err, MM_ENOMEM, "%s: out of memory while loading", file);
    json_decref(root);
    mm_tokenizer_close(tk);
    return rv;
}

void mm_tokenizer_close(mm_tokenizer *tk) {
    if (!tk)
        return;
    for (int i = 0; i < tk->n_stages; i++)
        pcre2_code_free(tk->stages[i].re);
    free(tk->tokens);
    free(tk->tbytes);
    free(tk->keys);
    free(tk->kbytes);
    free(tk->kslots);
    free(tk->pairs);
    free(tk->added[0]);
    free(tk->added[1]);
    free((void *)tk->cslots);
    free(tk->cpool);
    free(tk);
}

// ---- normalizer ------------------------------------------------------------------------------

struct buf {
    uint8_t *p;
    size_t n, cap;
};

static bool buf_append(struct buf *b, const void *s, size_t n) {
    if (n == 0)
        return true;
    if (b->n + n > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n)
            c *= 2;
        uint8_t *q = realloc(b->p, c);
        if (!q)
            return false;
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return true;
}

// normalize_run normalizes one segment with utf8proc into out, through the code point
// scratch *cps (grown as needed).
static mm_err normalize_run(const mm_tokenizer *tk, const uint8_t *s, size_t n, struct buf *out,
                            utf8proc_int32_t **cps, size_t *cps_cap) {
    for (;;) {
        utf8proc_ssize_t r = utf8proc_decompose(s, (utf8proc_ssize_t)n, *cps,
                                                (utf8proc_ssize_t)*cps_cap, tk->norm_opts);
        if (r < 0)
            return r == UTF8PROC_ERROR_NOMEM ? MM_ENOMEM : MM_EINVAL;
        if ((size_t)r > *cps_cap) {
            size_t c = (size_t)r * 2 + 16;
            utf8proc_int32_t *q = realloc(*cps, c * sizeof(**cps));
            if (!q)
                return MM_ENOMEM;
            *cps = q;
            *cps_cap = c;
            continue;
        }
        // reencode composes/reorders and writes UTF-8 over the code point buffer
        utf8proc_ssize_t m = utf8proc_reencode(*cps, r, tk->norm_opts);
        if (m < 0)
            return MM_EINVAL;
        return buf_append(out, *cps, (size_t)m) ? MM_OK : MM_ENOMEM;
    }
}

// normalize_text sets *out to a malloc'd normalized copy of s, or to NULL when s is unchanged
// by the normalizer (no normalizer, or ASCII text, which every Unicode form leaves alone).
// Only runs of non-ASCII characters, each with the ASCII character before it (a base a
// combining mark may compose with), go through utf8proc: a boundary before an ASCII character
// is a boundary of every normalization form, because ASCII characters are starters that never
// compose with what precedes them.
static mm_err normalize_text(const mm_tokenizer *tk, const uint8_t *s, size_t n, uint8_t **out,
                             size_t *out_n) {
    *out = NULL;
    *out_n = n;
    if (!tk->norm_opts || is_ascii(s, n))
        return MM_OK;
    struct buf b = {0};
    utf8proc_int32_t *cps = NULL;
    size_t cps_cap = 0, i = 0;
    mm_err rv = MM_OK;
    while (i < n && rv == MM_OK) {
        size_t j = i;
        while (j < n && s[j] < 0x80)
            j++;
        if (j == n) {
            if (!buf_append(&b, s + i, n - i))
                rv = MM_ENOMEM;
            break;
        }
        size_t seg = j > i ? j - 1 : j;
        if (!buf_append(&b, s + i, seg - i)) {
            rv = MM_ENOMEM;
            break;
        }
        size_t k = j;
        while (k < n && s[k] >= 0x80)
            k++;
        rv = normalize_run(tk, s + seg, k - seg, &b, &cps, &cps_cap);
        i = k;
    }
    free(cps);
    if (rv != MM_OK) {
        free(b.p);
        return rv;
    }
    if (!b.p && !(b.p = malloc(1))) // empty input cannot reach here; keep *out non-NULL
        return MM_ENOMEM;
    *out = b.p;
    *out_n = b.n;
    return MM_OK;
}

// ---- word cache ------------------------------------------------------------------------------

static inline const int32_t *centry_ids(const struct centry *c) {
    return (const int32_t *)((const unsigned char *)(c + 1) + ((c->n_bytes + 3u) & ~3u));
}

static const struct centry *cache_get(const mm_tokenizer *tk, uint64_t h, const uint8_t *w,
                                      size_t n) {
    uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);
    for (int p = 0; p < CACHE_PROBES; p++, i = (i + 1) & (CACHE_SLOTS - 1)) {
        const struct centry *c = atomic_load_explicit(&tk->cslots[i], memory_order_acquire);
        if (!c)
            return NULL;
        if (c->hash == h && c->n_bytes == n && !memcmp(c + 1, w, n))
            return c;
    }
    return NULL;
}

// cache_put publishes w -> ids. The cache is the one part of a tokenizer that encode changes:
// entries are carved from the pool by an atomic counter and published by CAS, never replaced.
static void cache_put(const mm_tokenizer *tk_, uint64_t h, const uint8_t *w, size_t n,
                      const int32_t *ids, size_t k) {
    mm_tokenizer *tk = (mm_tokenizer *)tk_; // allocated mutable; only atomics are touched
    if (k > UINT16_MAX ||
        atomic_load_explicit(&tk->cpool_used, memory_order_relaxed) >= CACHE_POOL_BYTES)
        return;
    size_t bytes = (sizeof(struct centry) + ((n + 3) & ~(size_t)3) + 4 * k + 7) & ~(size_t)7;
    size_t off = atomic_fetch_add_explicit(&tk->cpool_used, bytes, memory_order_relaxed);
    if (off + bytes > CACHE_POOL_BYTES)
        return;
    struct centry *c = (struct centry *)(tk->cpool + off);
    c->hash = h;
    c->n_bytes = (uint16_t)n;
    c->n_ids = (uint16_t)k;
    memcpy(c + 1, w, n);
    memcpy((void *)centry_ids(c), ids, 4 * k);
    uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);
    for (int p = 0; p < CACHE_PROBES; p++, i = (i + 1) & (CACHE_SLOTS - 1)) {
        struct centry *expected = NULL;
        if (atomic_compare_exchange_strong_explicit(&tk->cslots[i], &expected, c,
                                                    memory_order_release, memory_order_acquire))
            return;
        if (expected->hash == h && expected->n_bytes == n && !memcmp(expected + 1, w, n))
            return; // another thread published the same word
    }
}

// ---- encode ----------------------------------------------------------------------------------

struct enc {
    const mm_tokenizer *tk;
    int32_t *ids; // caller's; written below cap
    size_t cap;
    size_t n;     // ids produced so far (may exceed cap)
    pcre2_match_data *md[MAX_STAGES];
    // BPE scratch, grown to the longest word seen in this call
    int32_t *sym, *nid, *next, *prev;
    uint32_t *rank;
    uint64_t *heap;
    size_t work_cap;
    uint8_t *pfx; // ByteLevel add_prefix_space copy
    size_t pfx_cap;
    mm_err rv;
    char *err;
};

static inline void emit(struct enc *e, int32_t id) {
    if (e->n < e->cap)
        e->ids[e->n] = id;
    e->n++;
}

static bool work_reserve(struct enc *e, size_t n) {
    if (n <= e->work_cap)
        return true;
    size_t c = e->work_cap ? e->work_cap : 256;
    while (c < n)
        c *= 2;
    int32_t *a = realloc(e->sym, c * 4), *b = a ? realloc(e->nid, c * 4) : NULL;
    if (a)
        e->sym = a;
    if (b)
        e->nid = b;
    int32_t *d = b ? realloc(e->next, c * 4) : NULL;
    if (d)
        e->next = d;
    int32_t *f = d ? realloc(e->prev, c * 4) : NULL;
    if (f)
        e->prev = f;
    uint32_t *g = f ? realloc(e->rank, c * 4) : NULL;
    if (g)
        e->rank = g;
    uint64_t *h = g ? realloc(e->heap, c * 3 * 8) : NULL;
    if (h)
        e->heap = h;
    if (!h) {
        e->rv = mm_errf(e->err, MM_ENOMEM, "tokenizer: out of memory for a %zu-byte word", n);
        return false;
    }
    e->work_cap = c;
    return true;
}

static inline void pair_rank(const mm_tokenizer *tk, struct enc *e, int32_t i) {
    int32_t j = e->next[i];
    if (j < 0 || !pair_get(tk, e->sym[i], e->sym[j], &e->rank[i], &e->nid[i]))
        e->rank[i] = UINT32_MAX;
}

// merge_at merges symbol i with its successor.
static inline void merge_at(struct enc *e, int32_t i) {
    int32_t j = e->next[i];
    e->sym[i] = e->nid[i];
    e->next[i] = e->next[j];
    if (e->next[j] >= 0)
        e->prev[e->next[j]] = i;
    e->rank[j] = UINT32_MAX;
    e->sym[j] = -1;
}

// Short words: scan for the lowest-rank pair each round (first wins ties: the leftmost).
static void bpe_scan(const mm_tokenizer *tk, struct enc *e) {
    for (;;) {
        uint32_t best = UINT32_MAX;
        int32_t bi = -1;
        for (int32_t i = 0; i >= 0; i = e->next[i])
            if (e->rank[i] < best)
                best = e->rank[i], bi = i;
        if (bi < 0)
            return;
        merge_at(e, bi);
        pair_rank(tk, e, bi);
        if (e->prev[bi] >= 0)
            pair_rank(tk, e, e->prev[bi]);
    }
}

static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v)
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && h[c + 1] < h[c])
            c++;
        if (v <= h[c])
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n)
        h[i] = v;
    return top;
}

// Long words: a heap of (rank, position); stale entries are skipped when the pair at that
// position no longer has that rank (a rank names one merge, so equal rank = same pair).
static void bpe_heap(const mm_tokenizer *tk, struct enc *e, size_t m) {
    size_t hn = 0;
    for (size_t i = 0; i < m; i++)
        if (e->rank[i] != UINT32_MAX)
            heap_push(e->heap, &hn, ((uint64_t)e->rank[i] << 32) | i);
    while (hn) {
        uint64_t top = heap_pop(e->heap, &hn);
        int32_t i = (int32_t)(uint32_t)top;
        uint32_t r = (uint32_t)(top >> 32);
        if (e->sym[i] < 0 || e->rank[i] != r)
            continue;
        merge_at(e, i);
        pair_rank(tk, e, i);
        if (e->rank[i] != UINT32_MAX)
            heap_push(e->heap, &hn, ((uint64_t)e->rank[i] << 32) | (uint32_t)i);
        int32_t p = e->prev[i];
        if (p >= 0) {
            pair_rank(tk, e, p);
            if (e->rank[p] != UINT32_MAX)
                heap_push(e->heap, &hn, ((uint64_t)e->rank[p] << 32) | (uint32_t)p);
        }
    }
}

static void bpe_word(struct enc *e, const uint8_t *w, size_t n) {
    const mm_tokenizer *tk = e->tk;
    if (n == 1 && tk->byte_id[w[0]] >= 0) { // one byte: its symbol, no merge possible
        emit(e, tk->byte_id[w[0]]);
        return;
    }
    uint64_t h = 0;
    if (n <= CACHE_MAX_WORD) {
        h = hash_bytes(w, n);
        const struct centry *c = cache_get(tk, h, w, n);
        if (c) {
            const int32_t *ids = centry_ids(c);
            for (size_t k = 0; k < c->n_ids; k++)
                emit(e, ids[k]);
            return;
        }
    }
    if (!work_reserve(e, n))
        return;
    if (tk->ignore_merges && n <= 256) {
        // A word that is itself a vocab entry is one token (Llama 3 style).
        char spell[256 * 2];
        size_t sl = 0;
        for (size_t i = 0; i < n; i++)
            sl += utf8_encode(tk->b2u[w[i]], (uint8_t *)spell + sl);
        int32_t id = vocab_find(tk, spell, sl);
        if (id >= 0) {
            emit(e, id);
            if (n <= CACHE_MAX_WORD)
                cache_put(tk, h, w, n, &id, 1);
            return;
        }
    }
    size_t m = 0;
    bool last_unk = false;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tk->byte_id[w[i]];
        if (id < 0) {
            if (tk->unk_id < 0)
                continue; // tokenizers drops a byte it has no symbol for when there is no unk
            if (tk->fuse_unk && last_unk)
                continue;
            id = tk->unk_id;
            last_unk = true;
        } else {
            last_unk = false;
        }
        e->sym[m++] = id;
    }
    if (m == 0)
        return;
    for (size_t i = 0; i < m; i++) {
        e->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
        e->prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i < m; i++)
        pair_rank(tk, e, (int32_t)i);
    if (m <= SCAN_MAX)
        bpe_scan(tk, e);
    else
        bpe_heap(tk, e, m);
    size_t k = 0;
    for (int32_t i = 0; i >= 0; i = e->next[i])
        e->sym[k++] = e->sym[i];
    for (size_t i = 0; i < k; i++)
        emit(e, e->sym[i]);
    if (n <= CACHE_MAX_WORD)
        cache_put(tk, h, w, n, e->sym, k);
}

static void run_stage(struct enc *e, int k, const uint8_t *s, size_t n);

// A Split stage turns its input into a partition of (piece, is_match) and combines the
// pieces by tokenizers' SplitDelimiterBehavior, holding at most one piece back.
struct splitter {
    struct enc *e;
    int k;
    const uint8_t *s;
    enum split_behavior b;
    bool have; // a piece [ps, pe) is held back
    bool pm;   // ... and whether it is (or ends in) a match, per the behavior's rule
    size_t ps, pe;
};

static void sp_piece(struct splitter *sp, size_t a, size_t b, bool m) {
    switch (sp->b) {
    case SB_ISOLATED:
        run_stage(sp->e, sp->k + 1, sp->s + a, b - a);
        return;
    case SB_REMOVED:
        if (!m)
            run_stage(sp->e, sp->k + 1, sp->s + a, b - a);
        return;
    case SB_MERGED_PREV: // a match joins the piece before it, unless that one is a match
        if (m && sp->have && !sp->pm) {
            sp->pe = b;
            sp->pm = true;
            return;
        }
        break;
    case SB_MERGED_NEXT: // a match joins the piece after it, unless that one is a match
        if (!m && sp->have && sp->pm) {
            sp->pe = b;
            sp->pm = false;
            return;
        }
        break;
    case SB_CONTIGUOUS: // runs of matches become one piece
        if (sp->have && m == sp->pm) {
            sp->pe = b;
            return;
        }
        break;
    }
    if (sp->have)
        run_stage(sp->e, sp->k + 1, sp->s + sp->ps, sp->pe - sp->ps);
    sp->have = true;
    sp->ps = a;
    sp->pe = b;
    sp->pm = m;
}

static void run_stage(struct enc *e, int k, const uint8_t *s, size_t n) {
    if (n == 0 || e->rv != MM_OK)
        return;
    const mm_tokenizer *tk = e->tk;
    if (k == tk->n_stages) {
        bpe_word(e, s, n);
        return;
    }
    const struct stage *st = &tk->stages[k];
    if (st->kind == ST_BYTELEVEL && st->add_prefix_space && s[0] != ' ') {
        if (n + 1 > e->pfx_cap) {
            uint8_t *p = realloc(e->pfx, n + 1);
            if (!p) {
                e->rv = mm_errf(e->err, MM_ENOMEM, "tokenizer: out of memory");
                return;
            }
            e->pfx = p;
            e->pfx_cap = n + 1;
        }
        e->pfx[0] = ' ';
        memcpy(e->pfx + 1, s, n);
        s = e->pfx;
        n++;
    }
    if (!st->re) {
        run_stage(e, k + 1, s, n);
        return;
    }
    struct splitter sp = {.e = e, .k = k, .s = s, .b = st->behavior};
    pcre2_match_data *md = e->md[k];
    size_t prev = 0, off = 0;
    bool jit = st->jit;
    while (off < n) {
        int rc = jit ? pcre2_jit_match(st->re, s, n, off, 0, md, NULL)
                     : pcre2_match(st->re, s, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && jit) {
            jit = false; // the interpreter keeps its backtracking state on the heap
            continue;
        }
        if (rc < 0) {
            PCRE2_UCHAR msg[120];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            e->rv = mm_errf(e->err, MM_EINVAL, "tokenizer: pre-tokenizer regex failed at byte "
                            "%zu: %s", off, (char *)msg);
            return;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { // an empty match splits nothing; step over one character
            size_t len;
            utf8_class(s + ms, n - ms, &len);
            off = ms + len;
            continue;
        }
        if (ms > prev)
            sp_piece(&sp, prev, ms, st->invert);
        sp_piece(&sp, ms, me, !st->invert);
        prev = off = me;
        if (e->rv != MM_OK)
            return;
    }
    if (prev < n)
        sp_piece(&sp, prev, n, st->invert);
    if (sp.have)
        run_stage(e, k + 1, s + sp.ps, sp.pe - sp.ps);
}

// added_next finds the leftmost-longest added token of set in s[from, n).
static bool added_next(const mm_tokenizer *tk, int set, const uint8_t *s, size_t n, size_t from,
                       size_t *ms, const struct added_tok **tok) {
    if (tk->n_added[set] == 0)
        return false;
    const struct added_tok *a = tk->added[set];
    const uint32_t *first = tk->first[set];
    for (size_t i = from; i < n; i++) {
        uint32_t lo = first[s[i]], hi = first[s[i] + 1];
        for (uint32_t j = lo; j < hi; j++)
            if (a[j].len <= n - i && !memcmp(tk->kbytes + a[j].off, s + i, a[j].len)) {
                *ms = i;
                *tok = &a[j];
                return true;
            }
    }
    return false;
}

static void encode_normalized(struct enc *e, const uint8_t *s, size_t n);

// split_added emits the added tokens of set found in s and passes the text between them on:
// set 0 (raw text) to normalization, set 1 (normalized text) to the pre-tokenizer.
static void split_added(struct enc *e, int set, const uint8_t *s, size_t n) {
    const mm_tokenizer *tk = e->tk;
    size_t done = 0, pos = 0, ms;
    const struct added_tok *t;
    while (e->rv == MM_OK && added_next(tk, set, s, n, pos, &ms, &t)) {
        size_t me = ms + t->len;
        pos = me;
        if (ms < done)
            continue; // inside whitespace an earlier token's rstrip took
        size_t a = ms, b = me, cs;
        if (t->single_word) {
            bool word_before = ms > 0 && is_word_char(cp_before(s, ms, &cs));
            size_t len;
            bool word_after = me < n && is_word_char(cp_at(s + me, n - me, &len));
            if (word_before || word_after)
                continue;
        }
        if (t->lstrip)
            while (a > done && is_ws(cp_before(s, a, &cs)))
                a = cs;
        if (t->rstrip) {
            size_t len;
            while (b < n && is_ws(cp_at(s + b, n - b, &len)))
                b += len;
        }
        if (set == 0)
            encode_normalized(e, s + done, a - done);
        else
            run_stage(e, 0, s + done, a - done);
        emit(e, t->id);
        done = b;
    }
    if (set == 0)
        encode_normalized(e, s + done, n - done);
    else
        run_stage(e, 0, s + done, n - done);
}

static void encode_normalized(struct enc *e, const uint8_t *s, size_t n) {
    if (n == 0 || e->rv != MM_OK)
        return;
    uint8_t *norm;
    size_t nn;
    mm_err rv = normalize_text(e->tk, s, n, &norm, &nn);
    if (rv != MM_OK) {
        e->rv = mm_errf(e->err, rv, "tokenizer: normalization failed: %s", mm_strerror(rv));
        return;
    }
    split_added(e, 1, norm ? norm : s, nn);
    free(norm);
}

mm_err mm_tokenizer_encode(const mm_tokenizer *tk, const char *text, size_t n_bytes,
                           bool add_special, int32_t *ids, size_t cap, size_t *n_ids,
                           char err[MM_ERRLEN]) {
    if (!tk || (!text && n_bytes) || !n_ids || (!ids && cap))
        return mm_errf(err, MM_EINVAL, "mm_tokenizer_encode: NULL argument");
    *n_ids = 0;
    const uint8_t *s = (const uint8_t *)text;
    size_t bad;
    if (!is_ascii(s, n_bytes) && !utf8_validate(s, n_bytes, &bad))
        return mm_errf(err, MM_EINVAL, "text is not valid UTF-8 at byte %zu", bad);
    struct enc e = {.tk = tk, .ids = ids, .cap = cap, .err = err};
    for (int k = 0; k < tk->n_stages; k++)
        if (tk->stages[k].re &&
            !(e.md[k] = pcre2_match_data_create_from_pattern(tk->stages[k].re, NULL)))
            e.rv = mm_errf(err, MM_ENOMEM, "tokenizer: out of memory");
    if (e.rv == MM_OK) {
        if (add_special)
            for (int i = 0; i < tk->n_prefix; i++)
                emit(&e, tk->prefix_ids[i]);
        if (n_bytes)
            split_added(&e, 0, s, n_bytes);
        if (add_special)
            for (int i = 0; i < tk->n_suffix; i++)
                emit(&e, tk->suffix_ids[i]);
    }
    for (int k = 0; k < tk->n_stages; k++)
        pcre2_match_data_free(e.md[k]);
    free(e.sym);
    free(e.nid);
    free(e.next);
    free(e.prev);
    free(e.rank);
    free(e.heap);
    free(e.pfx);
    if (e.rv != MM_OK)
        return e.rv;
    *n_ids = e.n;
    return e.n > cap ? MM_EFULL : MM_OK;
}

// ---- decode ----------------------------------------------------------------------------------

static inline bool id_ok(const mm_tokenizer *tk, int32_t id) {
    return id >= 0 && (size_t)id < tk->n_tokens && (tk->tokens[id].flags & TOK_VALID);
}

static const uint8_t FFFD[3] = {0xEF, 0xBF, 0xBD};

mm_err mm_tokenizer_decode(const mm_tokenizer *tk, const int32_t *ids, size_t n_ids,
                           bool skip_special, char *out, size_t cap, size_t *n_bytes,
                           char err[MM_ERRLEN]) {
    if (!tk || (!ids && n_ids) || !n_bytes || (!out && cap))
        return mm_errf(err, MM_EINVAL, "mm_tokenizer_decode: NULL argument");
    *n_bytes = 0;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (!id_ok(tk, ids[i]))
            return mm_errf(err, MM_EINVAL, "id %d (position %zu) is not in the vocabulary of %zu",
                           (int)ids[i], i, tk->n_tokens);
        if (!(skip_special && (tk->tokens[ids[i]].flags & TOK_SPECIAL)))
            total += tk->tokens[ids[i]].len;
    }
    uint8_t *raw = malloc(total ? total : 1);
    if (!raw)
        return mm_errf(err, MM_ENOMEM, "decode: out of memory");
    size_t r = 0;
    for (size_t i = 0; i < n_ids; i++) {
        const struct tok_entry *t = &tk->tokens[ids[i]];
        if (!(skip_special && (t->flags & TOK_SPECIAL))) {
            memcpy(raw + r, tk->tbytes + t->off, t->len);
            r += t->len;
        }
    }
    // String::from_utf8_lossy: one U+FFFD per maximal invalid subpart, a truncated
    // sequence at the end included.
    size_t o = 0;
    for (size_t i = 0; i < total;) {
        size_t len;
        int c = utf8_class(raw + i, total - i, &len);
        const uint8_t *src = c == U8_VALID ? raw + i : FFFD;
        size_t sl = c == U8_VALID ? len : 3;
        if (o + sl <= cap)
            memcpy(out + o, src, sl);
        o += sl;
        i += len;
    }
    free(raw);
    if (o < cap)
        out[o] = 0;
    *n_bytes = o;
    return o > cap ? MM_EFULL : MM_OK;
}

mm_err mm_tokenizer_token_id(const mm_tokenizer *tk, const char *token, int32_t *id) {
    if (!tk || !token || !id)
        return MM_EINVAL;
    size_t n = strlen(token);
    for (int set = 0; set < 2; set++)
        for (size_t i = 0; i < tk->n_added[set]; i++) {
            const struct added_tok *a = &tk->added[set][i];
            if (a->orig_len == n && !memcmp(tk->kbytes + a->orig_off, token, n)) {
                *id = a->id;
                return MM_OK;
            }
        }
    int32_t v = vocab_find(tk, token, n);
    if (v < 0)
        return MM_ENOENT;
    *id = v;
    return MM_OK;
}

mm_err mm_tokenizer_token_bytes(const mm_tokenizer *tk, int32_t id, const char **bytes,
                                size_t *n_bytes) {
    if (!tk || !bytes || !n_bytes || !id_ok(tk, id))
        return MM_EINVAL;
    *bytes = tk->tbytes + tk->tokens[id].off;
    *n_bytes = tk->tokens[id].len;
    return MM_OK;
}

size_t mm_tokenizer_vocab_size(const mm_tokenizer *tk) {
    return tk ? tk->n_tokens : 0;
}

bool mm_tokenizer_is_special(const mm_tokenizer *tk, int32_t id) {
    return tk && id_ok(tk, id) && (tk->tokens[id].flags & TOK_SPECIAL);
}

size_t mm_tokenizer_max_token_bytes(const mm_tokenizer *tk) {
    return tk ? tk->max_token_bytes : 0;
}

// ---- streaming decode ------------------------------------------------------------------------

size_t mm_detok_stream_out_max(const mm_tokenizer *tk) {
    return 3 * (mm_tokenizer_max_token_bytes(tk) + 3) + 1;
}

mm_err mm_detok_stream_init(mm_detok_stream *st, const mm_tokenizer *tk, bool skip_special) {
    if (!st || !tk)
        return MM_EINVAL;
    memset(st, 0, sizeof(*st));
    st->tk = tk;
    st->skip_special = skip_special;
    return MM_OK;
}

static inline void put(uint8_t *out, size_t *o, const uint8_t *src, size_t n) {
    memcpy(out + *o, src, n);
    *o += n;
}

mm_err mm_detok_stream_feed(mm_detok_stream *st, int32_t id, char *out_, size_t cap,
                            size_t *n_bytes) {
    if (!st || !st->tk || !n_bytes || (!out_ && cap))
        return MM_EINVAL;
    *n_bytes = 0;
    const mm_tokenizer *tk = st->tk;
    if (!id_ok(tk, id))
        return MM_EINVAL;
    const struct tok_entry *te = &tk->tokens[id];
    if (st->skip_special && (te->flags & TOK_SPECIAL))
        return MM_OK;
    const uint8_t *t = (const uint8_t *)tk->tbytes + te->off;
    size_t tl = te->len, np = st->n_pending;
    size_t need = 3 * (np + tl); // every byte a U+FFFD at worst
    if (need > cap) {
        *n_bytes = need;
        return MM_EFULL;
    }
    uint8_t *out = (uint8_t *)out_;
    // Sequences that start in the held bytes end within them plus 4 token bytes.
    uint8_t tmp[8];
    size_t take = tl < 4 ? tl : 4;
    memcpy(tmp, st->pending, np);
    memcpy(tmp + np, t, take);
    size_t tn = np + take, p = 0, o = 0, len;
    while (p < np) {
        int c = utf8_class(tmp + p, tn - p, &len);
        if (c == U8_INCOMPLETE) { // the token ended inside this character: hold it all
            memmove(st->pending, tmp + p, tn - p);
            st->n_pending = (uint8_t)(tn - p);
            *n_bytes = o;
            return MM_OK;
        }
        put(out, &o, c == U8_VALID ? tmp + p : FFFD, c == U8_VALID ? len : 3);
        p += len;
    }
    st->n_pending = 0;
    for (size_t q = p - np; q < tl; q += len) {
        int c = utf8_class(t + q, tl - q, &len);
        if (c == U8_INCOMPLETE) {
            memcpy(st->pending, t + q, tl - q);
            st->n_pending = (uint8_t)(tl - q);
            break;
        }
        put(out, &o, c == U8_VALID ? t + q : FFFD, c == U8_VALID ? len : 3);
    }
    if (o < cap)
        out[o] = 0;
    *n_bytes = o;
    return MM_OK;
}

mm_err mm_detok_stream_flush(mm_detok_stream *st, char *out, size_t cap, size_t *n_bytes) {
    if (!st || !n_bytes || (!out && cap))
        return MM_EINVAL;
    *n_bytes = 0;
    if (st->n_pending == 0)
        return MM_OK;
    if (cap < 3) {
        *n_bytes = 3;
        return MM_EFULL;
    }
    memcpy(out, FFFD, 3);
    if (cap > 3)
        out[3] = 0;
    st->n_pending = 0;
    *n_bytes = 3;
    return MM_OK;
}

void mm_detok_stream_fini(mm_detok_stream *st) {
    if (st)
        memset(st, 0, sizeof(*st));
}
