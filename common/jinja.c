// SPDX-License-Identifier: MIT
// Jinja2 interpreter for chat templates: lexer -> parser -> AST -> tree-walking evaluator over
// its own value type (JSON-like values plus namespaces, loop objects and callables).
//
// Design notes:
// - Configured as transformers configures Jinja for apply_chat_template: trim_blocks and
//   lstrip_blocks on, keep_trailing_newline off, default (lenient) Undefined, loop controls
//   (break/continue), the {% generation %} block of transformers' AssistantTracker (rendered
//   transparently), globals raise_exception/strftime_now/range/namespace/dict, and tojson as
//   transformers overrides it (json.dumps with ensure_ascii=False, no HTML escaping).
// - Semantics follow Python where templates can see them: str() and repr() of values, float
//   repr (shortest round-trip), truthiness, == across int/float/bool, negative indexes, slices,
//   string methods counting code points, dict insertion order.
// - Memory: a compiled template owns one chunked arena (AST, literals). Each render owns a
//   second arena for every value it makes; nothing is freed until the render ends, so values
//   need no reference counts. Errors inside the parser and the evaluator longjmp back to the
//   API entry, which frees the arena; no other resource is held across a longjmp.
// - Bounds: a step budget (nodes evaluated), an output/string size cap, a scratch memory cap,
//   a macro depth cap, a range() length cap and a parser nesting cap. Each gives MM_EFULL or
//   MM_EFORMAT with a message, never a crash.
// - Unsupported constructs (extends/include/import/call and filter blocks, recursive loops,
//   unknown filters, tests and methods) are MM_EUNSUPP errors naming the construct and line.
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <limits.h>
#include <locale.h>
#include <wctype.h>

#include "mm/jinja.h"

// ---- failure and arena -----------------------------------------------------------------------

typedef struct jfail {
    jmp_buf jb;
    mm_err code;
    char msg[MM_ERRLEN];
} jfail;

typedef struct achunk {
    struct achunk *next;
    size_t cap, used;
    max_align_t data[];
} achunk;

typedef struct jarena {
    achunk *head;
    size_t total, limit;
    jfail *fail;
    bool cached; // chunks come from and return to the per-thread cache
} jarena;

static _Noreturn void fail_at(jfail *f, mm_err code, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

// Replaces bytes that do not form valid UTF-8 (a token cut by truncation, a stray byte of the
// template) with '?', so messages can go into JSON error replies.
static void utf8_sanitize(char *s) {
    unsigned char *p = (unsigned char *)s;
    while (*p) {
        int n = *p < 0x80 ? 1 : (*p & 0xE0) == 0xC0 ? 2 : (*p & 0xF0) == 0xE0 ? 3
              : (*p & 0xF8) == 0xF0 ? 4 : 0;
        bool ok = n > 0;
        for (int k = 1; ok && k < n; k++)
            ok = (p[k] & 0xC0) == 0x80;
        if (ok && n == 2 && *p < 0xC2)
            ok = false; // overlong
        if (!ok) {
            *p++ = '?';
            continue;
        }
        p += n;
    }
}

static _Noreturn void fail_at(jfail *f, mm_err code, int line, const char *fmt, ...) {
    char tmp[MM_ERRLEN - 24];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (line > 0)
        snprintf(f->msg, sizeof f->msg, "line %d: %s", line, tmp);
    else
        snprintf(f->msg, sizeof f->msg, "%s", tmp);
    utf8_sanitize(f->msg);
    f->code = code;
    longjmp(f->jb, 1);
}

// Render arenas reuse their chunks through a per-thread cache: on this class of VM a page
// fault costs microseconds, and fresh chunks for every render made a 200-message render 15x
// slower than the work itself. The cache holds at most CHUNK_CACHE_MAX bytes per thread and
// is freed by a thread-exit destructor.
#define CHUNK_BYTES 65536
#define CHUNK_CACHE_MAX ((size_t)8 << 20)

typedef struct chunk_cache {
    achunk *head;
    size_t bytes;
} chunk_cache;

static pthread_key_t g_cache_key;
static pthread_once_t g_cache_once = PTHREAD_ONCE_INIT;

static void cache_destroy(void *p) {
    chunk_cache *cc = p;
    achunk *c = cc->head;
    while (c) {
        achunk *next = c->next;
        free(c);
        c = next;
    }
    free(cc);
}

static void cache_key_init(void) {
    if (pthread_key_create(&g_cache_key, cache_destroy) != 0)
        g_cache_key = (pthread_key_t)-1;
}

static chunk_cache *thread_cache(void) {
    pthread_once(&g_cache_once, cache_key_init);
    if (g_cache_key == (pthread_key_t)-1)
        return NULL;
    chunk_cache *cc = pthread_getspecific(g_cache_key);
    if (cc == NULL) {
        cc = calloc(1, sizeof *cc);
        if (cc && pthread_setspecific(g_cache_key, cc) != 0) {
            free(cc);
            cc = NULL;
        }
    }
    return cc;
}

static void arena_fini(jarena *a) {
    chunk_cache *cc = a->cached ? thread_cache() : NULL;
    achunk *c = a->head;
    while (c) {
        achunk *next = c->next;
        if (cc && c->cap == CHUNK_BYTES && cc->bytes + CHUNK_BYTES <= CHUNK_CACHE_MAX) {
            c->next = cc->head;
            cc->head = c;
            cc->bytes += CHUNK_BYTES;
        } else {
            free(c);
        }
        c = next;
    }
    a->head = NULL;
    a->total = 0;
}

static void *arena_alloc(jarena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0)
        n = 16;
    achunk *c = a->head;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = n > CHUNK_BYTES ? n : CHUNK_BYTES;
        if (a->total + cap > a->limit)
            fail_at(a->fail, MM_EFULL, 0, "template scratch memory limit (%zu bytes) exceeded",
                    a->limit);
        chunk_cache *cc = a->cached && cap == CHUNK_BYTES ? thread_cache() : NULL;
        if (cc && cc->head) {
            c = cc->head;
            cc->head = c->next;
            cc->bytes -= CHUNK_BYTES;
        } else {
            c = malloc(sizeof(achunk) + cap);
            if (c == NULL)
                fail_at(a->fail, MM_ENOMEM, 0, "out of memory");
            c->cap = cap;
        }
        c->used = 0;
        c->next = a->head;
        a->head = c;
        a->total += cap;
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    return p;
}

static char *arena_strndup(jarena *a, const char *s, size_t n) {
    char *p = arena_alloc(a, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

// ---- values ----------------------------------------------------------------------------------

enum vtype { VU, VN, VB, VI, VF, VS, VL, VD, VNS, VFN };

typedef struct jv {
    uint8_t t;
    union {
        bool b;
        long long i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        struct jlist *l;
        struct jdict *d;
        struct jfn *fn;
        const char *uname; // VU: what was undefined, for messages
    };
} jv;

typedef struct jlist {
    size_t n, cap;
    jv *v;
    bool tuple; // prints as (a, b) like a Python tuple
} jlist;

typedef struct jdict {
    size_t n, cap;
    jv *k;
    jv *v;
} jdict;

typedef struct node node;

enum fnkind { FN_GLOBAL, FN_METHOD, FN_MACRO };

struct frame;

typedef struct jfn {
    int kind;
    const char *name;
    jv self;              // FN_METHOD
    const node *mac;      // FN_MACRO
    struct frame *scope;  // FN_MACRO: frame the macro was defined in (its closure)
} jfn;

// ---- AST -------------------------------------------------------------------------------------

enum nkind {
    // expressions
    N_LIT, N_NAME, N_LIST, N_DICT, N_ATTR, N_ITEM, N_SLICE, N_CALL, N_FILTER, N_TEST,
    N_BIN, N_NEG, N_POS, N_AND, N_OR, N_NOT, N_CMP, N_COND,
    // statements
    N_BODY, N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_BREAK, N_CONTINUE,
};

struct node {
    int k;
    int line;
    node *a, *b, *c, *d;
    node **v;        // children (args, items, body statements, dict keys/values interleaved)
    size_t nv;
    const char **names; // kwarg names (NULL = positional) / params / targets / cmp ops
    size_t nn;
    const char *s;   // identifier, operator, filter/test name, text
    size_t sn;
    bool neg;        // N_TEST: "is not"
    jv lit;
};

struct mm_jinja {
    jarena ar;
    jfail fail;
    node *root;
    char name[64];
};

// ---- lexer -----------------------------------------------------------------------------------

enum tkind { TK_EOF, TK_TEXT, TK_VBEGIN, TK_VEND, TK_BBEGIN, TK_BEND, TK_NAME, TK_STR, TK_INT,
             TK_FLOAT, TK_OP };

typedef struct tok {
    int t;
    int line;
    const char *p;
    size_t n;
    long long i;
    double f;
} tok;

typedef struct parser {
    mm_jinja *t;
    jfail *fail;
    jarena *ar;
    const char *src;
    size_t n;
    tok *toks;
    size_t ntok, captok;
    size_t pos;
    int depth;
} parser;

#define MAX_PARSE_DEPTH 128

static void push_tok(parser *ps, tok tk) {
    if (ps->ntok == ps->captok) {
        size_t cap = ps->captok ? ps->captok * 2 : 256;
        tok *nt = realloc(ps->toks, cap * sizeof(tok));
        if (nt == NULL)
            fail_at(ps->fail, MM_ENOMEM, 0, "out of memory");
        ps->toks = nt;
        ps->captok = cap;
    }
    ps->toks[ps->ntok++] = tk;
}

static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned char c = s[0];
    if (c < 0x80 || n < 2) {
        *cp = c;
        return 1;
    }
    if ((c & 0xE0) == 0xC0) {
        *cp = ((uint32_t)(c & 0x1F) << 6) | (s[1] & 0x3F);
        return 2;
    }
    if ((c & 0xF0) == 0xE0 && n >= 3) {
        *cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
        return 3;
    }
    if ((c & 0xF8) == 0xF0 && n >= 4) {
        *cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
              ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
        return 4;
    }
    *cp = c;
    return 1;
}

static size_t utf8_encode(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Python's str.isspace() set.
static bool py_space(uint32_t c) {
    return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

// Length of the run of Python whitespace ending at s+n (for rstrip).
static size_t rstrip_len(const char *s, size_t n) {
    while (n > 0) {
        size_t k = 1;
        while (k < n && k < 4 && ((unsigned char)s[n - k] & 0xC0) == 0x80)
            k++;
        uint32_t cp;
        utf8_decode((const unsigned char *)s + n - k, k, &cp);
        if (!py_space(cp))
            break;
        n -= k;
    }
    return n;
}

static size_t lstrip_off(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (!py_space(cp))
            break;
        i += k;
    }
    return i;
}

static int count_nl(const char *s, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++)
        c += s[i] == '\n';
    return c;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

// Unescapes a string literal body as Jinja does (Python "unicode-escape").
static void lex_string(parser *ps, const char *s, size_t n, int line, tok *out) {
    char *buf = arena_alloc(ps->ar, n + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) {
            buf[o++] = s[i];
            continue;
        }
        char e = s[++i];
        switch (e) {
        case 'n': buf[o++] = '\n'; break;
        case 't': buf[o++] = '\t'; break;
        case 'r': buf[o++] = '\r'; break;
        case 'a': buf[o++] = '\a'; break;
        case 'b': buf[o++] = '\b'; break;
        case 'f': buf[o++] = '\f'; break;
        case 'v': buf[o++] = '\v'; break;
        case '\\': buf[o++] = '\\'; break;
        case '\'': buf[o++] = '\''; break;
        case '"': buf[o++] = '"'; break;
        case '\n': break;
        case 'x': case 'u': case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            if (i + (size_t)nd >= n)
                fail_at(ps->fail, MM_EFORMAT, line, "truncated \\%c escape in string", e);
            for (int k = 1; k <= nd; k++) {
                int h = hexval(s[i + (size_t)k]);
                if (h < 0)
                    fail_at(ps->fail, MM_EFORMAT, line, "bad \\%c escape in string", e);
                cp = cp * 16 + (uint32_t)h;
            }
            i += (size_t)nd;
            if (cp > 0x10FFFF)
                fail_at(ps->fail, MM_EFORMAT, line, "escape beyond U+10FFFF in string");
            o += utf8_encode(cp, buf + o);
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = 0;
                int k = 0;
                while (k < 3 && i < n && s[i] >= '0' && s[i] <= '7') {
                    cp = cp * 8 + (uint32_t)(s[i] - '0');
                    i++;
                    k++;
                }
                i--;
                o += utf8_encode(cp, buf + o);
            } else {
                buf[o++] = '\\';
                buf[o++] = e;
            }
        }
    }
    buf[o] = 0;
    out->p = buf;
    out->n = o;
}

static const char *const OPS[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%",
                                  "~", "<", ">", "(", ")", "[", "]", "{", "}", ",", ".", ":",
                                  "|", "=", ";", NULL};

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static bool word_at(const char *s, size_t n, size_t pos, const char *w) {
    size_t wn = strlen(w);
    return pos + wn <= n && memcmp(s + pos, w, wn) == 0 &&
           (pos + wn == n || !(isalnum((unsigned char)s[pos + wn]) || s[pos + wn] == '_'));
}

// {% raw %}...{% endraw %}: *pos is just after "{%" and its sign. If a raw block starts here,
// emits its body as text with Jinja's whitespace rules (raw begin: "-%}" strips what follows,
// no trim_blocks; endraw: like any block tag) and returns true.
static bool lex_raw(parser *ps, size_t *pos, int *line, bool *line_starting, int tag_line) {
    const char *s = ps->src;
    size_t n = ps->n, p = *pos;
    while (p < n && is_ws(s[p]))
        p++;
    if (!word_at(s, n, p, "raw"))
        return false;
    p += 3;
    while (p < n && is_ws(s[p]))
        p++;
    bool strip_after = false;
    if (p + 3 <= n && memcmp(s + p, "-%}", 3) == 0) {
        strip_after = true;
        p += 3;
    } else if (p + 2 <= n && memcmp(s + p, "%}", 2) == 0) {
        p += 2;
    } else {
        return false; // not a raw tag after all: let the parser report it
    }
    if (strip_after)
        p += lstrip_off(s + p, n - p);
    bool ls = s[p - 1] == '\n';
    // Find "{%[-+]? endraw [-+]?%}".
    size_t body = p, q = p;
    for (;; q++) {
        if (q + 1 >= n)
            fail_at(ps->fail, MM_EFORMAT, tag_line, "'raw' block is never closed (expected 'endraw')");
        if (s[q] != '{' || s[q + 1] != '%')
            continue;
        size_t r = q + 2;
        char sign = (r < n && (s[r] == '-' || s[r] == '+')) ? s[r] : 0;
        if (sign)
            r++;
        while (r < n && is_ws(s[r]))
            r++;
        if (!word_at(s, n, r, "endraw"))
            continue;
        r += 6;
        while (r < n && is_ws(s[r]))
            r++;
        char esign = 0;
        if (r < n && (s[r] == '-' || s[r] == '+')) {
            esign = s[r];
            r++;
        }
        if (r + 2 > n || memcmp(s + r, "%}", 2) != 0)
            continue;
        r += 2;
        size_t tn = q - body;
        if (sign == '-') {
            tn = rstrip_len(s + body, tn);
        } else if (sign != '+') {
            size_t lp = tn;
            while (lp > 0 && s[body + lp - 1] != '\n')
                lp--;
            if ((lp > 0 || ls) && lp < tn && lstrip_off(s + body + lp, tn - lp) == tn - lp)
                tn = lp;
        }
        if (tn > 0)
            push_tok(ps, (tok){.t = TK_TEXT, .line = *line + count_nl(s + *pos, body - *pos),
                               .p = s + body, .n = tn});
        if (esign == '-')
            r += lstrip_off(s + r, n - r);
        else if (esign != '+' && r < n && s[r] == '\n')
            r++;
        *line += count_nl(s + *pos, r - *pos);
        *pos = r;
        *line_starting = s[r - 1] == '\n';
        return true;
    }
}

static void lex(parser *ps) {
    const char *s = ps->src;
    size_t n = ps->n, pos = 0;
    int line = 1;
    bool line_starting = true;
    while (pos < n) {
        size_t open = n;
        char kind = 0;
        for (size_t i = pos; i + 1 < n; i++) {
            if (s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#')) {
                open = i;
                kind = s[i + 1];
                break;
            }
        }
        size_t tn = open - pos;
        if (open == n) {
            push_tok(ps, (tok){.t = TK_TEXT, .line = line, .p = s + pos, .n = tn});
            break;
        }
        char sign = (open + 2 < n && (s[open + 2] == '-' || s[open + 2] == '+')) ? s[open + 2] : 0;
        // "{{-" and "{%-" strip but "{{ -1 }}" must not: Jinja requires the sign right
        // after the delimiter, which is what this checks.
        if (sign == '-') {
            tn = rstrip_len(s + pos, tn);
        } else if (sign != '+' && kind != '{') {
            size_t lp = tn;
            while (lp > 0 && s[pos + lp - 1] != '\n')
                lp--;
            if ((lp > 0 || line_starting) && lp < tn &&
                lstrip_off(s + pos + lp, tn - lp) == tn - lp)
                tn = lp;
        }
        if (tn > 0)
            push_tok(ps, (tok){.t = TK_TEXT, .line = line, .p = s + pos, .n = tn});
        line += count_nl(s + pos, open - pos);
        pos = open + 2 + (sign ? 1 : 0);
        int tag_line = line;
        if (kind == '#') {
            size_t j = pos;
            while (j + 1 < n && !(s[j] == '#' && s[j + 1] == '}'))
                j++;
            if (j + 1 >= n)
                fail_at(ps->fail, MM_EFORMAT, tag_line, "unterminated comment ('{#' without '#}')");
            bool strip = j > pos && s[j - 1] == '-';
            bool keep = j > pos && s[j - 1] == '+';
            line += count_nl(s + pos, j + 2 - pos);
            pos = j + 2;
            if (strip) {
                size_t k = lstrip_off(s + pos, n - pos);
                line += count_nl(s + pos, k);
                pos += k;
            } else if (!keep && pos < n && s[pos] == '\n') {
                pos++;
                line++;
            }
            line_starting = s[pos - 1] == '\n';
            continue;
        }
        bool is_var = kind == '{';
        if (!is_var && lex_raw(ps, &pos, &line, &line_starting, tag_line))
            continue;
        push_tok(ps, (tok){.t = is_var ? TK_VBEGIN : TK_BBEGIN, .line = tag_line});
        int depth = 0;
        for (;;) {
            while (pos < n && is_ws(s[pos])) {
                if (s[pos] == '\n')
                    line++;
                pos++;
            }
            if (pos >= n)
                fail_at(ps->fail, MM_EFORMAT, tag_line, "unterminated tag ('%s' without '%s')",
                        is_var ? "{{" : "{%", is_var ? "}}" : "%}");
            if (depth == 0) {
                const char *endm = is_var ? "}}" : "%}";
                char esign = 0;
                size_t at = pos;
                // "-}}", "-%}" and "+%}"; Jinja has no "+}}" (there '+' is an operator).
                if ((s[pos] == '-' || (s[pos] == '+' && !is_var)) && pos + 3 <= n &&
                    strncmp(s + pos + 1, endm, 2) == 0) {
                    esign = s[pos];
                    at = pos + 1;
                }
                if (at + 2 <= n && strncmp(s + at, endm, 2) == 0) {
                    pos = at + 2;
                    if (esign == '-') {
                        size_t k = lstrip_off(s + pos, n - pos);
                        line += count_nl(s + pos, k);
                        pos += k;
                    } else if (!is_var && esign != '+' && pos < n && s[pos] == '\n') {
                        pos++;
                        line++;
                    }
                    push_tok(ps, (tok){.t = is_var ? TK_VEND : TK_BEND, .line = line});
                    line_starting = s[pos - 1] == '\n';
                    break;
                }
            }
            char c = s[pos];
            if (isalpha((unsigned char)c) || c == '_') {
                size_t j = pos;
                while (j < n && (isalnum((unsigned char)s[j]) || s[j] == '_'))
                    j++;
                push_tok(ps, (tok){.t = TK_NAME, .line = line, .p = s + pos, .n = j - pos});
                pos = j;
            } else if (isdigit((unsigned char)c)) {
                size_t j = pos;
                bool isf = false;
                while (j < n && (isdigit((unsigned char)s[j]) || s[j] == '_'))
                    j++;
                if (j + 1 < n && s[j] == '.' && isdigit((unsigned char)s[j + 1])) {
                    isf = true;
                    j++;
                    while (j < n && (isdigit((unsigned char)s[j]) || s[j] == '_'))
                        j++;
                }
                if (j < n && (s[j] == 'e' || s[j] == 'E')) {
                    size_t k = j + 1;
                    if (k < n && (s[k] == '+' || s[k] == '-'))
                        k++;
                    if (k < n && isdigit((unsigned char)s[k])) {
                        isf = true;
                        j = k;
                        while (j < n && isdigit((unsigned char)s[j]))
                            j++;
                    }
                }
                char buf[64];
                size_t bn = 0;
                for (size_t k = pos; k < j && bn < sizeof buf - 1; k++)
                    if (s[k] != '_')
                        buf[bn++] = s[k];
                buf[bn] = 0;
                tok tk = {.t = isf ? TK_FLOAT : TK_INT, .line = line, .p = s + pos, .n = j - pos};
                if (isf) {
                    tk.f = strtod(buf, NULL);
                } else {
                    char *e;
                    unsigned long long u = strtoull(buf, &e, 10);
                    if (u > (unsigned long long)INT64_MAX)
                        fail_at(ps->fail, MM_EUNSUPP, line, "integer literal %s is too large", buf);
                    tk.i = (long long)u;
                }
                push_tok(ps, tk);
                pos = j;
            } else if (c == '\'' || c == '"') {
                size_t j = pos + 1;
                while (j < n && s[j] != c) {
                    if (s[j] == '\\' && j + 1 < n)
                        j++;
                    j++;
                }
                if (j >= n)
                    fail_at(ps->fail, MM_EFORMAT, line, "unterminated string literal");
                tok tk = {.t = TK_STR, .line = line};
                lex_string(ps, s + pos + 1, j - pos - 1, line, &tk);
                line += count_nl(s + pos, j - pos);
                push_tok(ps, tk);
                pos = j + 1;
            } else {
                const char *op = NULL;
                for (int k = 0; OPS[k]; k++) {
                    size_t on = strlen(OPS[k]);
                    if (pos + on <= n && strncmp(s + pos, OPS[k], on) == 0) {
                        op = OPS[k];
                        break;
                    }
                }
                if (op == NULL && (unsigned char)c < 0x80)
                    fail_at(ps->fail, MM_EFORMAT, line, "unexpected character '%c' in tag", c);
                if (op == NULL)
                    fail_at(ps->fail, MM_EFORMAT, line, "unexpected byte 0x%02x in tag",
                            (unsigned char)c);
                if (op[0] == '(' || op[0] == '[' || op[0] == '{')
                    depth++;
                if ((op[0] == ')' || op[0] == ']' || op[0] == '}') && depth > 0)
                    depth--;
                push_tok(ps, (tok){.t = TK_OP, .line = line, .p = op, .n = strlen(op)});
                pos += strlen(op);
            }
        }
    }
    push_tok(ps, (tok){.t = TK_EOF, .line = line});
}

// ---- parser ----------------------------------------------------------------------------------

static tok *peek(parser *ps) { return &ps->toks[ps->pos]; }
static tok *peek2(parser *ps) {
    return ps->pos + 1 < ps->ntok ? &ps->toks[ps->pos + 1] : &ps->toks[ps->ntok - 1];
}
static tok *next_tok(parser *ps) {
    tok *t = &ps->toks[ps->pos];
    if (t->t != TK_EOF)
        ps->pos++;
    return t;
}
static bool is_op(const tok *t, const char *op) {
    return t->t == TK_OP && t->n == strlen(op) && memcmp(t->p, op, t->n) == 0;
}
static bool is_name(const tok *t, const char *nm) {
    return t->t == TK_NAME && t->n == strlen(nm) && memcmp(t->p, nm, t->n) == 0;
}

static const char *tok_desc(parser *ps, const tok *t) {
    switch (t->t) {
    case TK_EOF: return "end of template";
    case TK_TEXT: return "template text";
    case TK_VBEGIN: return "'{{'";
    case TK_VEND: return "'}}'";
    case TK_BBEGIN: return "'{%'";
    case TK_BEND: return "'%}'";
    case TK_STR: return "string literal";
    case TK_INT: case TK_FLOAT: return "number";
    default: {
        size_t n = t->n < 40 ? t->n : 40;
        char *b = arena_alloc(ps->ar, n + 3);
        b[0] = '\'';
        memcpy(b + 1, t->p, n);
        b[n + 1] = '\'';
        b[n + 2] = 0;
        return b;
    }
    }
}

static void expect_op(parser *ps, const char *op) {
    tok *t = next_tok(ps);
    if (!is_op(t, op))
        fail_at(ps->fail, MM_EFORMAT, t->line, "expected '%s', got %s", op, tok_desc(ps, t));
}

static void expect_bend(parser *ps, const char *what) {
    tok *t = next_tok(ps);
    if (t->t != TK_BEND)
        fail_at(ps->fail, MM_EFORMAT, t->line, "expected '%%}' to end '%s', got %s", what,
                tok_desc(ps, t));
}

static const char *expect_name(parser *ps) {
    tok *t = next_tok(ps);
    if (t->t != TK_NAME)
        fail_at(ps->fail, MM_EFORMAT, t->line, "expected a name, got %s", tok_desc(ps, t));
    return arena_strndup(ps->ar, t->p, t->n);
}

static node *mk(parser *ps, int k, int line) {
    node *nd = arena_alloc(ps->ar, sizeof(node));
    memset(nd, 0, sizeof *nd);
    nd->k = k;
    nd->line = line;
    return nd;
}

static void *grow(parser *ps, void *arr, size_t n, size_t elem) {
    if (n != 0 && (n < 4 || (n & (n - 1)) != 0))
        return arr;
    size_t cap = n == 0 ? 4 : n * 2;
    void *na = arena_alloc(ps->ar, cap * elem);
    if (n)
        memcpy(na, arr, n * elem);
    return na;
}

static void add_kid(parser *ps, node *p, node *kid) {
    p->v = grow(ps, p->v, p->nv, sizeof(node *));
    p->v[p->nv++] = kid;
}

static void add_name(parser *ps, node *p, const char *nm) {
    p->names = grow(ps, p->names, p->nn, sizeof(char *));
    p->names[p->nn++] = nm;
}

static node *parse_expr(parser *ps, bool condexpr);
static node *parse_unary(parser *ps, bool with_filter);
static node *parse_primary(parser *ps);
static node *parse_postfix(parser *ps, node *nd);

static void enter(parser *ps, int line) {
    if (++ps->depth > MAX_PARSE_DEPTH)
        fail_at(ps->fail, MM_EFORMAT, line, "expression or block nesting deeper than %d",
                MAX_PARSE_DEPTH);
}

// Parses "(args)" after the '(' was seen; fills v (values) and names (NULL = positional).
static void parse_call_args(parser *ps, node *call) {
    expect_op(ps, "(");
    bool kw_seen = false;
    while (!is_op(peek(ps), ")")) {
        if (call->nv > 0)
            expect_op(ps, ",");
        if (is_op(peek(ps), ")"))
            break;
        if (is_op(peek(ps), "*") || is_op(peek(ps), "**"))
            fail_at(ps->fail, MM_EUNSUPP, peek(ps)->line, "unsupported construct: *args/**kwargs in a call");
        const char *kw = NULL;
        if (peek(ps)->t == TK_NAME && is_op(peek2(ps), "=")) {
            kw = expect_name(ps);
            next_tok(ps);
            kw_seen = true;
        } else if (kw_seen) {
            fail_at(ps->fail, MM_EFORMAT, peek(ps)->line, "positional argument after keyword argument");
        }
        add_kid(ps, call, parse_expr(ps, true));
        // names parallels v
        call->names = grow(ps, call->names, call->nn, sizeof(char *));
        call->names[call->nn++] = kw;
    }
    expect_op(ps, ")");
}

static node *parse_tuple(parser *ps, bool condexpr) {
    int line = peek(ps)->line;
    node *first = parse_expr(ps, condexpr);
    if (!is_op(peek(ps), ","))
        return first;
    node *l = mk(ps, N_LIST, line);
    l->neg = true; // tuple
    add_kid(ps, l, first);
    while (is_op(peek(ps), ",")) {
        next_tok(ps);
        tok *t = peek(ps);
        if (t->t == TK_VEND || t->t == TK_BEND || is_op(t, ")") || is_name(t, "if"))
            break;
        add_kid(ps, l, parse_expr(ps, condexpr));
    }
    return l;
}

static node *parse_primary(parser *ps) {
    tok *t = next_tok(ps);
    node *nd;
    switch (t->t) {
    case TK_NAME:
        nd = mk(ps, N_LIT, t->line);
        if (is_name(t, "true") || is_name(t, "True")) {
            nd->lit = (jv){.t = VB, .b = true};
        } else if (is_name(t, "false") || is_name(t, "False")) {
            nd->lit = (jv){.t = VB, .b = false};
        } else if (is_name(t, "none") || is_name(t, "None")) {
            nd->lit = (jv){.t = VN};
        } else {
            nd->k = N_NAME;
            nd->s = arena_strndup(ps->ar, t->p, t->n);
        }
        return nd;
    case TK_STR: {
        nd = mk(ps, N_LIT, t->line);
        size_t total = t->n;
        const char *p = t->p;
        while (peek(ps)->t == TK_STR) {
            tok *u = next_tok(ps);
            char *b = arena_alloc(ps->ar, total + u->n + 1);
            memcpy(b, p, total);
            memcpy(b + total, u->p, u->n);
            total += u->n;
            b[total] = 0;
            p = b;
        }
        nd->lit = (jv){.t = VS, .s = {p, total}};
        return nd;
    }
    case TK_INT:
        nd = mk(ps, N_LIT, t->line);
        nd->lit = (jv){.t = VI, .i = t->i};
        return nd;
    case TK_FLOAT:
        nd = mk(ps, N_LIT, t->line);
        nd->lit = (jv){.t = VF, .f = t->f};
        return nd;
    case TK_OP:
        if (is_op(t, "(")) {
            if (is_op(peek(ps), ")")) {
                next_tok(ps);
                nd = mk(ps, N_LIST, t->line);
                nd->neg = true; // ()
                return nd;
            }
            node *e = parse_tuple(ps, true);
            expect_op(ps, ")");
            return e;
        }
        if (is_op(t, "[")) {
            nd = mk(ps, N_LIST, t->line);
            while (!is_op(peek(ps), "]")) {
                if (nd->nv > 0)
                    expect_op(ps, ",");
                if (is_op(peek(ps), "]"))
                    break;
                add_kid(ps, nd, parse_expr(ps, true));
            }
            expect_op(ps, "]");
            return nd;
        }
        if (is_op(t, "{")) {
            nd = mk(ps, N_DICT, t->line);
            while (!is_op(peek(ps), "}")) {
                if (nd->nv > 0)
                    expect_op(ps, ",");
                if (is_op(peek(ps), "}"))
                    break;
                add_kid(ps, nd, parse_expr(ps, true));
                expect_op(ps, ":");
                add_kid(ps, nd, parse_expr(ps, true));
            }
            expect_op(ps, "}");
            return nd;
        }
        break;
    default:
        break;
    }
    fail_at(ps->fail, MM_EFORMAT, t->line, "unexpected %s in expression", tok_desc(ps, t));
}

static node *parse_subscript(parser *ps, node *obj, int line) {
    // after '['
    node *parts[3] = {NULL, NULL, NULL};
    int nparts = 0;
    bool is_slice = false;
    for (;;) {
        if (is_op(peek(ps), ":")) {
            next_tok(ps);
            is_slice = true;
            if (++nparts > 2)
                fail_at(ps->fail, MM_EFORMAT, line, "too many ':' in slice");
            continue;
        }
        if (is_op(peek(ps), "]"))
            break;
        if (parts[nparts])
            fail_at(ps->fail, MM_EFORMAT, peek(ps)->line, "expected ']' or ':' in subscript");
        parts[nparts] = parse_expr(ps, true);
        if (is_op(peek(ps), ",")) 
            fail_at(ps->fail, MM_EUNSUPP, line, "unsupported construct: tuple subscript");
    }
    expect_op(ps, "]");
    node *nd;
    if (is_slice) {
        nd = mk(ps, N_SLICE, line);
        nd->a = obj;
        nd->b = parts[0];
        nd->c = parts[1];
        nd->d = parts[2];
    } else {
        if (!parts[0])
            fail_at(ps->fail, MM_EFORMAT, line, "empty subscript");
        nd = mk(ps, N_ITEM, line);
        nd->a = obj;
        nd->b = parts[0];
    }
    return nd;
}

static node *parse_postfix(parser *ps, node *nd) {
    for (;;) {
        tok *t = peek(ps);
        if (is_op(t, ".")) {
            next_tok(ps);
            tok *u = next_tok(ps);
            node *a = mk(ps, N_ATTR, t->line);
            a->a = nd;
            if (u->t == TK_NAME) {
                a->s = arena_strndup(ps->ar, u->p, u->n);
            } else if (u->t == TK_INT) {
                a->k = N_ITEM;
                a->b = mk(ps, N_LIT, u->line);
                a->b->lit = (jv){.t = VI, .i = u->i};
            } else {
                fail_at(ps->fail, MM_EFORMAT, u->line, "expected attribute name after '.', got %s",
                        tok_desc(ps, u));
            }
            nd = a;
        } else if (is_op(t, "[")) {
            next_tok(ps);
            nd = parse_subscript(ps, nd, t->line);
        } else if (is_op(t, "(")) {
            node *c = mk(ps, N_CALL, t->line);
            c->a = nd;
            parse_call_args(ps, c);
            nd = c;
        } else {
            return nd;
        }
    }
}

static node *parse_filters(parser *ps, node *nd) {
    for (;;) {
        tok *t = peek(ps);
        if (is_op(t, "|")) {
            next_tok(ps);
            node *f = mk(ps, N_FILTER, t->line);
            f->s = expect_name(ps);
            while (is_op(peek(ps), ".")) {
                next_tok(ps);
                const char *more = expect_name(ps);
                size_t n1 = strlen(f->s), n2 = strlen(more);
                char *b = arena_alloc(ps->ar, n1 + n2 + 2);
                memcpy(b, f->s, n1);
                b[n1] = '.';
                memcpy(b + n1 + 1, more, n2 + 1);
                f->s = b;
            }
            f->a = nd;
            if (is_op(peek(ps), "("))
                parse_call_args(ps, f);
            nd = f;
        } else if (is_name(t, "is")) {
            next_tok(ps);
            node *te = mk(ps, N_TEST, t->line);
            if (is_name(peek(ps), "not")) {
                next_tok(ps);
                te->neg = true;
            }
            tok *nm = peek(ps);
            if (nm->t == TK_NAME) {
                te->s = expect_name(ps);
            } else if (nm->t == TK_OP && (is_op(nm, "==") || is_op(nm, "!=") || is_op(nm, "<") ||
                                          is_op(nm, "<=") || is_op(nm, ">") || is_op(nm, ">="))) {
                next_tok(ps);
                te->s = arena_strndup(ps->ar, nm->p, nm->n);
            } else {
                fail_at(ps->fail, MM_EFORMAT, nm->line, "expected a test name after 'is', got %s",
                        tok_desc(ps, nm));
            }
            te->a = nd;
            tok *u = peek(ps);
            if (is_op(u, "(")) {
                parse_call_args(ps, te);
            } else if ((u->t == TK_NAME || u->t == TK_STR || u->t == TK_INT || u->t == TK_FLOAT ||
                        is_op(u, "[") || is_op(u, "{")) &&
                       !is_name(u, "else") && !is_name(u, "or") && !is_name(u, "and") &&
                       !is_name(u, "if") && !is_name(u, "in") && !is_name(u, "not")) {
                if (is_name(u, "is"))
                    fail_at(ps->fail, MM_EFORMAT, u->line, "cannot chain tests with 'is'");
                node *arg = parse_postfix(ps, parse_primary(ps));
                add_kid(ps, te, arg);
                add_name(ps, te, NULL);
            }
            nd = te;
        } else if (is_op(t, "(")) {
            node *c = mk(ps, N_CALL, t->line);
            c->a = nd;
            parse_call_args(ps, c);
            nd = c;
        } else {
            return nd;
        }
    }
}

static node *parse_unary(parser *ps, bool with_filter) {
    tok *t = peek(ps);
    node *nd;
    enter(ps, t->line);
    if (is_op(t, "-") || is_op(t, "+")) {
        next_tok(ps);
        nd = mk(ps, is_op(t, "-") ? N_NEG : N_POS, t->line);
        nd->a = parse_unary(ps, false);
    } else {
        nd = parse_postfix(ps, parse_primary(ps));
    }
    if (with_filter)
        nd = parse_filters(ps, nd);
    ps->depth--;
    return nd;
}

static node *mkbin(parser *ps, const char *op, node *a, node *b, int line) {
    node *nd = mk(ps, N_BIN, line);
    nd->s = op;
    nd->a = a;
    nd->b = b;
    return nd;
}

static node *parse_pow(parser *ps) {
    node *l = parse_unary(ps, true);
    while (is_op(peek(ps), "**")) {
        int line = next_tok(ps)->line;
        l = mkbin(ps, "**", l, parse_unary(ps, true), line);
    }
    return l;
}

static node *parse_mul(parser *ps) {
    node *l = parse_pow(ps);
    for (;;) {
        tok *t = peek(ps);
        const char *op = is_op(t, "*") ? "*" : is_op(t, "/") ? "/" : is_op(t, "//") ? "//"
                       : is_op(t, "%") ? "%" : NULL;
        if (!op)
            return l;
        next_tok(ps);
        l = mkbin(ps, op, l, parse_pow(ps), t->line);
    }
}

static node *parse_concat(parser *ps) {
    node *l = parse_mul(ps);
    while (is_op(peek(ps), "~")) {
        int line = next_tok(ps)->line;
        l = mkbin(ps, "~", l, parse_mul(ps), line);
    }
    return l;
}

static node *parse_add(parser *ps) {
    node *l = parse_concat(ps);
    for (;;) {
        tok *t = peek(ps);
        const char *op = is_op(t, "+") ? "+" : is_op(t, "-") ? "-" : NULL;
        if (!op)
            return l;
        next_tok(ps);
        l = mkbin(ps, op, l, parse_concat(ps), t->line);
    }
}

static node *parse_cmp(parser *ps) {
    int line = peek(ps)->line;
    node *first = parse_add(ps);
    node *cmp = NULL;
    for (;;) {
        tok *t = peek(ps);
        const char *op = NULL;
        if (t->t == TK_OP && (is_op(t, "==") || is_op(t, "!=") || is_op(t, "<") || is_op(t, "<=") ||
                              is_op(t, ">") || is_op(t, ">="))) {
            op = arena_strndup(ps->ar, t->p, t->n);
            next_tok(ps);
        } else if (is_name(t, "in")) {
            op = "in";
            next_tok(ps);
        } else if (is_name(t, "not") && is_name(peek2(ps), "in")) {
            op = "not in";
            next_tok(ps);
            next_tok(ps);
        } else {
            break;
        }
        if (!cmp) {
            cmp = mk(ps, N_CMP, line);
            cmp->a = first;
        }
        add_kid(ps, cmp, parse_add(ps));
        add_name(ps, cmp, op);
    }
    return cmp ? cmp : first;
}

static node *parse_not(parser *ps) {
    tok *t = peek(ps);
    if (is_name(t, "not")) {
        next_tok(ps);
        enter(ps, t->line);
        node *nd = mk(ps, N_NOT, t->line);
        nd->a = parse_not(ps);
        ps->depth--;
        return nd;
    }
    return parse_cmp(ps);
}

static node *parse_and(parser *ps) {
    node *l = parse_not(ps);
    while (is_name(peek(ps), "and")) {
        int line = next_tok(ps)->line;
        node *nd = mk(ps, N_AND, line);
        nd->a = l;
        nd->b = parse_not(ps);
        l = nd;
    }
    return l;
}

static node *parse_or(parser *ps) {
    node *l = parse_and(ps);
    while (is_name(peek(ps), "or")) {
        int line = next_tok(ps)->line;
        node *nd = mk(ps, N_OR, line);
        nd->a = l;
        nd->b = parse_and(ps);
        l = nd;
    }
    return l;
}

static node *parse_expr(parser *ps, bool condexpr) {
    enter(ps, peek(ps)->line);
    node *e = parse_or(ps);
    while (condexpr && is_name(peek(ps), "if")) {
        int line = next_tok(ps)->line;
        node *c = mk(ps, N_COND, line);
        c->a = e;                 // value if true
        c->b = parse_or(ps);      // condition
        if (is_name(peek(ps), "else")) {
            next_tok(ps);
            c->c = parse_expr(ps, true);
        }
        e = c;
    }
    ps->depth--;
    return e;
}

// ---- statements ------------------------------------------------------------------------------

typedef struct block_ctx {
    const char *opener;   // "for", "if", ...
    int line;             // line of the opener
    const char *const *ends;
    int loop_depth;
    int macro_depth;
} block_ctx;

static node *parse_body(parser *ps, block_ctx *bc, const char **end_found);

static bool name_in(const tok *t, const char *const *list) {
    for (int i = 0; list && list[i]; i++)
        if (is_name(t, list[i]))
            return true;
    return false;
}

static node *parse_if(parser *ps, int line, block_ctx *outer) {
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    node *nd = mk(ps, N_IF, line);
    nd->a = parse_tuple(ps, false); // as Jinja: a tuple, no inline if-expression at top level
    expect_bend(ps, "if");
    block_ctx bc = {"if", line, ends, outer->loop_depth, outer->macro_depth};
    const char *end;
    nd->b = parse_body(ps, &bc, &end);
    if (strcmp(end, "elif") == 0) {
        nd->c = mk(ps, N_BODY, peek(ps)->line);
        add_kid(ps, nd->c, parse_if(ps, peek(ps)->line, outer));
        return nd;
    }
    if (strcmp(end, "else") == 0) {
        expect_bend(ps, "else");
        static const char *const ends2[] = {"endif", NULL};
        block_ctx bc2 = {"if", line, ends2, outer->loop_depth, outer->macro_depth};
        nd->c = parse_body(ps, &bc2, &end);
    }
    expect_bend(ps, "endif");
    return nd;
}

static node *parse_stmt_inner(parser *ps, block_ctx *outer);

static node *parse_stmt(parser *ps, block_ctx *outer) {
    enter(ps, peek(ps)->line);
    node *nd = parse_stmt_inner(ps, outer);
    ps->depth--;
    return nd;
}

static node *parse_stmt_inner(parser *ps, block_ctx *outer) {
    tok *kw = next_tok(ps);
    int line = kw->line;
    if (kw->t != TK_NAME)
        fail_at(ps->fail, MM_EFORMAT, line, "expected a tag name after '{%%', got %s",
                tok_desc(ps, kw));
    if (is_name(kw, "if"))
        return parse_if(ps, line, outer);
    if (is_name(kw, "for")) {
        node *nd = mk(ps, N_FOR, line);
        bool paren = false;
        if (is_op(peek(ps), "(")) {
            next_tok(ps);
            paren = true;
        }
        add_name(ps, nd, expect_name(ps));
        while (is_op(peek(ps), ",")) {
            next_tok(ps);
            add_name(ps, nd, expect_name(ps));
        }
        if (paren)
            expect_op(ps, ")");
        tok *in = next_tok(ps);
        if (!is_name(in, "in"))
            fail_at(ps->fail, MM_EFORMAT, in->line, "expected 'in' in for loop, got %s",
                    tok_desc(ps, in));
        nd->a = parse_tuple(ps, false);
        if (is_name(peek(ps), "if")) {
            next_tok(ps);
            nd->d = parse_expr(ps, false);
        }
        if (is_name(peek(ps), "recursive"))
            fail_at(ps->fail, MM_EUNSUPP, line, "unsupported construct: recursive for loop");
        expect_bend(ps, "for");
        static const char *const ends[] = {"else", "endfor", NULL};
        block_ctx bc = {"for", line, ends, outer->loop_depth + 1, outer->macro_depth};
        const char *end;
        nd->b = parse_body(ps, &bc, &end);
        if (strcmp(end, "else") == 0) {
            expect_bend(ps, "else");
            static const char *const ends2[] = {"endfor", NULL};
            block_ctx bc2 = {"for", line, ends2, outer->loop_depth, outer->macro_depth};
            nd->c = parse_body(ps, &bc2, &end);
        }
        expect_bend(ps, "endfor");
        return nd;
    }
    if (is_name(kw, "set")) {
        node *nd = mk(ps, N_SET, line);
        const char *nm = expect_name(ps);
        if (is_op(peek(ps), ".")) {
            next_tok(ps);
            node *tgt = mk(ps, N_ATTR, line);
            tgt->s = expect_name(ps);
            tgt->a = mk(ps, N_NAME, line);
            tgt->a->s = nm;
            nd->a = tgt;
        } else {
            add_name(ps, nd, nm);
            while (is_op(peek(ps), ",")) {
                next_tok(ps);
                add_name(ps, nd, expect_name(ps));
            }
        }
        if (is_op(peek(ps), "=")) {
            next_tok(ps);
            nd->b = parse_tuple(ps, true);
            expect_bend(ps, "set");
            return nd;
        }
        if (peek(ps)->t == TK_BEND && nd->a == NULL && nd->nn == 1) {
            next_tok(ps);
            nd->k = N_SETBLOCK;
            static const char *const ends[] = {"endset", NULL};
            block_ctx bc = {"set", line, ends, 0, outer->macro_depth};
            const char *end;
            nd->b = parse_body(ps, &bc, &end);
            expect_bend(ps, "endset");
            return nd;
        }
        if (is_op(peek(ps), "|"))
            fail_at(ps->fail, MM_EUNSUPP, line, "unsupported construct: filtered set block");
        fail_at(ps->fail, MM_EFORMAT, peek(ps)->line, "expected '=' in set, got %s",
                tok_desc(ps, peek(ps)));
    }
    if (is_name(kw, "macro")) {
        node *nd = mk(ps, N_MACRO, line);
        nd->s = expect_name(ps);
        expect_op(ps, "(");
        while (!is_op(peek(ps), ")")) {
            if (nd->nn > 0)
                expect_op(ps, ",");
            add_name(ps, nd, expect_name(ps));
            node *def = NULL;
            if (is_op(peek(ps), "=")) {
                next_tok(ps);
                def = parse_expr(ps, true);
            }
            add_kid(ps, nd, def);
        }
        expect_op(ps, ")");
        expect_bend(ps, "macro");
        static const char *const ends[] = {"endmacro", NULL};
        block_ctx bc = {"macro", line, ends, 0, outer->macro_depth + 1};
        const char *end;
        nd->b = parse_body(ps, &bc, &end);
        tok *t = peek(ps);
        if (t->t == TK_NAME)  // "{% endmacro name %}" is allowed
            next_tok(ps);
        expect_bend(ps, "endmacro");
        return nd;
    }
    if (is_name(kw, "break") || is_name(kw, "continue")) {
        if (outer->loop_depth == 0)
            fail_at(ps->fail, MM_EFORMAT, line, "'%s' outside a for loop",
                    is_name(kw, "break") ? "break" : "continue");
        expect_bend(ps, "break");
        return mk(ps, is_name(kw, "break") ? N_BREAK : N_CONTINUE, line);
    }
    if (is_name(kw, "generation")) {
        // transformers' AssistantTracker marks assistant spans; rendering is unaffected.
        expect_bend(ps, "generation");
        static const char *const ends[] = {"endgeneration", NULL};
        block_ctx bc = {"generation", line, ends, outer->loop_depth, outer->macro_depth};
        const char *end;
        node *body = parse_body(ps, &bc, &end);
        expect_bend(ps, "endgeneration");
        return body;
    }
    static const char *const unsupported[] = {"extends", "include", "import", "from", "block",
                                              "call", "filter", "with", "autoescape", "do",
                                              "trans", "pluralize", NULL};
    char nm[48];
    snprintf(nm, sizeof nm, "%.*s", (int)(kw->n < 40 ? kw->n : 40), kw->p);
    if (name_in(kw, unsupported))
        fail_at(ps->fail, MM_EUNSUPP, line, "unsupported construct: {%% %s %%}", nm);
    if (is_name(kw, "raw") || is_name(kw, "endraw")) // a well-formed raw block is lexed as text
        fail_at(ps->fail, MM_EFORMAT, line, "malformed '%s' tag", nm);
    fail_at(ps->fail, MM_EFORMAT, line, "unknown tag '%s'", nm);
}

static node *parse_body(parser *ps, block_ctx *bc, const char **end_found) {
    node *body = mk(ps, N_BODY, peek(ps)->line);
    static const char *const all_ends[] = {"elif", "else", "endif", "endfor", "endset",
                                           "endmacro", "endgeneration", "endraw", "endblock",
                                           "endcall", "endfilter", "endwith", NULL};
    for (;;) {
        tok *t = next_tok(ps);
        switch (t->t) {
        case TK_EOF:
            if (bc->ends) {
                const char *want = bc->ends[0];
                for (int i = 0; bc->ends[i]; i++)
                    if (strncmp(bc->ends[i], "end", 3) == 0)
                        want = bc->ends[i];
                fail_at(ps->fail, MM_EFORMAT, bc->line,
                        "'%s' block is never closed (expected '%s' before the end of template)",
                        bc->opener, want);
            }
            *end_found = NULL;
            return body;
        case TK_TEXT: {
            node *nd = mk(ps, N_TEXT, t->line);
            nd->s = t->p;
            nd->sn = t->n;
            add_kid(ps, body, nd);
            break;
        }
        case TK_VBEGIN: {
            node *nd = mk(ps, N_OUT, t->line);
            nd->a = parse_tuple(ps, true);
            tok *e = next_tok(ps);
            if (e->t != TK_VEND)
                fail_at(ps->fail, MM_EFORMAT, e->line, "expected '}}', got %s", tok_desc(ps, e));
            add_kid(ps, body, nd);
            break;
        }
        case TK_BBEGIN: {
            tok *kw = peek(ps);
            if (name_in(kw, bc->ends)) {
                *end_found = arena_strndup(ps->ar, kw->p, kw->n);
                next_tok(ps);
                return body;
            }
            if (name_in(kw, all_ends)) {
                char nm[48];
                snprintf(nm, sizeof nm, "%.*s", (int)(kw->n < 40 ? kw->n : 40), kw->p);
                if (bc->ends)
                    fail_at(ps->fail, MM_EFORMAT, kw->line,
                            "unexpected '%s' inside '%s' block opened on line %d", nm,
                            bc->opener, bc->line);
                fail_at(ps->fail, MM_EFORMAT, kw->line, "unexpected '%s' (no open block)", nm);
            }
            add_kid(ps, body, parse_stmt(ps, bc));
            break;
        }
        default:
            fail_at(ps->fail, MM_EFORMAT, t->line, "unexpected %s", tok_desc(ps, t));
        }
    }
}

mm_err mm_jinja_new(const char *src, size_t n, const char *name, mm_jinja **out,
                    char err[MM_ERRLEN]) {
    *out = NULL;
    mm_jinja *t = calloc(1, sizeof *t);
    if (t == NULL)
        return mm_errf(err, MM_ENOMEM, "out of memory");
    snprintf(t->name, sizeof t->name, "%s", name ? name : "template");
    t->ar.limit = (size_t)1 << 30;
    t->ar.fail = &t->fail;
    // The parser lives on the heap: it changes between setjmp and a longjmp, and locals that
    // do so are indeterminate after the jump.
    parser *ps = calloc(1, sizeof *ps);
    if (ps == NULL) {
        mm_jinja_free(t);
        return mm_errf(err, MM_ENOMEM, "out of memory");
    }
    ps->t = t;
    ps->fail = &t->fail;
    ps->ar = &t->ar;
    if (setjmp(t->fail.jb)) {
        free(ps->toks);
        free(ps);
        mm_err code = t->fail.code;
        mm_errf(err, code, "%s: %s", t->name, t->fail.msg);
        if (err)
            utf8_sanitize(err);
        mm_jinja_free(t);
        return code;
    }
    // Newlines normalised to "\n" and one trailing newline dropped (keep_trailing_newline
    // is off in transformers' environment).
    char *norm = arena_alloc(&t->ar, n + 1);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (src[i] == '\r') {
            norm[m++] = '\n';
            if (i + 1 < n && src[i + 1] == '\n')
                i++;
        } else {
            norm[m++] = src[i];
        }
    }
    if (m > 0 && norm[m - 1] == '\n')
        m--;
    norm[m] = 0;
    ps->src = norm;
    ps->n = m;
    lex(ps);
    block_ctx top = {"template", 1, NULL, 0, 0};
    const char *end;
    t->root = parse_body(ps, &top, &end);
    free(ps->toks);
    free(ps);
    *out = t;
    return MM_OK;
}

static bool names_field(const node *e, const char *field) {
    if (e == NULL)
        return false;
    if (e->k == N_NAME || e->k == N_ATTR)
        return strcmp(e->s, field) == 0;
    if (e->k == N_ITEM && e->b && e->b->k == N_LIT && e->b->lit.t == VS)
        return e->b->lit.s.n == strlen(field) && memcmp(e->b->lit.s.p, field, e->b->lit.s.n) == 0;
    if (e->k == N_FILTER) // "for x in content|list"
        return names_field(e->a, field);
    return false;
}

static bool walk_iterates(const node *nd, const char *field, int depth) {
    if (nd == NULL || depth > 4 * MAX_PARSE_DEPTH)
        return false;
    if (nd->k == N_FOR && names_field(nd->a, field))
        return true;
    if (walk_iterates(nd->a, field, depth + 1) || walk_iterates(nd->b, field, depth + 1) ||
        walk_iterates(nd->c, field, depth + 1) || walk_iterates(nd->d, field, depth + 1))
        return true;
    for (size_t i = 0; i < nd->nv; i++)
        if (walk_iterates(nd->v[i], field, depth + 1))
            return true;
    return false;
}

bool mm_jinja_iterates(const mm_jinja *t, const char *field) {
    return walk_iterates(t->root, field, 0);
}

void mm_jinja_free(mm_jinja *t) {
    if (t == NULL)
        return;
    arena_fini(&t->ar);
    free(t);
}

// ---- evaluator: context, buffers, values -----------------------------------------------------

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

typedef struct frame {
    struct frame *parent;
    jdict vars;
} frame;

typedef struct ectx {
    jfail fail;
    jarena ar;
    size_t steps, max_steps, max_out, max_range;
    int depth, max_depth;
    int print_depth; // nesting of to_str/repr: a namespace can contain itself
    uintptr_t stack_base; // address of a local of mm_jinja_render
    size_t max_stack;     // bytes of C stack the evaluator may use below stack_base
    sbuf *out;
    frame *globals; // render variables
    frame *top;     // template-level assignments and macros
} ectx;

#define EFAIL(E, code, line, ...) fail_at(&(E)->fail, code, line, __VA_ARGS__)

static void *ealloc(ectx *E, size_t n) { return arena_alloc(&E->ar, n); }

static void sb_put(ectx *E, sbuf *b, const char *p, size_t n) {
    if (n == 0)
        return;
    if (b->n + n > E->max_out)
        EFAIL(E, MM_EFULL, 0, "output larger than the limit of %zu bytes", E->max_out);
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n)
            cap *= 2;
        char *np = ealloc(E, cap);
        if (b->n)
            memcpy(np, b->p, b->n);
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void sb_puts(ectx *E, sbuf *b, const char *s) { sb_put(E, b, s, strlen(s)); }
static void sb_putc(ectx *E, sbuf *b, char c) { sb_put(E, b, &c, 1); }

static jv v_undef(const char *name) { return (jv){.t = VU, .uname = name}; }
static jv v_none(void) { return (jv){.t = VN}; }
static jv v_bool(bool b) { return (jv){.t = VB, .b = b}; }
static jv v_int(long long i) { return (jv){.t = VI, .i = i}; }
static jv v_float(double f) { return (jv){.t = VF, .f = f}; }
static jv v_str(const char *p, size_t n) { return (jv){.t = VS, .s = {p, n}}; }
static jv v_cstr(const char *p) { return v_str(p, strlen(p)); }
static jv v_sb(sbuf *b) { return v_str(b->p ? b->p : "", b->n); }

static jlist *list_new(ectx *E, size_t cap) {
    jlist *l = ealloc(E, sizeof *l);
    l->n = 0;
    l->tuple = false;
    l->cap = cap ? cap : 4;
    l->v = ealloc(E, l->cap * sizeof(jv));
    return l;
}
static void list_push(ectx *E, jlist *l, jv x) {
    if (l->n == l->cap) {
        size_t cap = l->cap * 2;
        jv *nv = ealloc(E, cap * sizeof(jv));
        memcpy(nv, l->v, l->n * sizeof(jv));
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = x;
}
static jv v_list(jlist *l) { return (jv){.t = VL, .l = l}; }

static jdict *dict_new(ectx *E, size_t cap) {
    jdict *d = ealloc(E, sizeof *d);
    d->n = 0;
    d->cap = cap ? cap : 4;
    d->k = ealloc(E, d->cap * sizeof(jv));
    d->v = ealloc(E, d->cap * sizeof(jv));
    return d;
}

static bool veq(jv a, jv b);

static long dict_find(const jdict *d, jv key) {
    for (size_t i = 0; i < d->n; i++)
        if (veq(d->k[i], key))
            return (long)i;
    return -1;
}
static long dict_find_s(const jdict *d, const char *key) {
    size_t n = strlen(key);
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == VS && d->k[i].s.n == n && memcmp(d->k[i].s.p, key, n) == 0)
            return (long)i;
    return -1;
}
static void dict_set(ectx *E, jdict *d, jv key, jv val) {
    long i = dict_find(d, key);
    if (i >= 0) {
        d->v[i] = val;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap * 2;
        jv *nk = ealloc(E, cap * sizeof(jv)), *nv = ealloc(E, cap * sizeof(jv));
        memcpy(nk, d->k, d->n * sizeof(jv));
        memcpy(nv, d->v, d->n * sizeof(jv));
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = key;
    d->v[d->n] = val;
    d->n++;
}
static void dict_set_s(ectx *E, jdict *d, const char *key, jv val) {
    dict_set(E, d, v_cstr(key), val);
}

// Appends a key known to be absent (building a fresh dict): no search.
static void dict_add_new(jdict *d, const char *key, size_t key_n, jv val) {
    MM_ASSERT(d->n < d->cap);
    d->k[d->n] = v_str(key, key_n);
    d->v[d->n] = val;
    d->n++;
}
#define DICT_ADD(d, lit, val) dict_add_new((d), (lit), sizeof(lit) - 1, (val))

static const char *type_name(jv x) {
    switch (x.t) {
    case VU: return "Undefined";
    case VN: return "NoneType";
    case VB: return "bool";
    case VI: return "int";
    case VF: return "float";
    case VS: return "str";
    case VL: return "list";
    case VD: return "dict";
    case VNS: return "Namespace";
    default: return "function";
    }
}

static _Noreturn void fail_undef(ectx *E, int line, jv u, const char *what) {
    if (u.uname)
        EFAIL(E, MM_EINVAL, line, "'%s' is undefined%s%s", u.uname, what ? " " : "",
              what ? what : "");
    EFAIL(E, MM_EINVAL, line, "undefined value%s%s", what ? " " : "", what ? what : "");
}

static bool truthy(jv x) {
    switch (x.t) {
    case VU: case VN: return false;
    case VB: return x.b;
    case VI: return x.i != 0;
    case VF: return x.f != 0.0;
    case VS: return x.s.n > 0;
    case VL: return x.l->n > 0;
    case VD: return x.d->n > 0;
    default: return true;
    }
}

static bool is_num(jv x) { return x.t == VI || x.t == VF || x.t == VB; }
static double num_f(jv x) { return x.t == VF ? x.f : x.t == VI ? (double)x.i : (double)x.b; }
static long long num_i(jv x) { return x.t == VI ? x.i : (long long)x.b; }

// The render's failure target, for deep helpers that take no context (veq). Set for the
// duration of mm_jinja_render on the rendering thread.
static _Thread_local jfail *tl_fail;
#define MAX_VALUE_DEPTH 10000

static bool veq_d(jv a, jv b, int depth);

static bool veq(jv a, jv b) { return veq_d(a, b, 0); }

static bool veq_d(jv a, jv b, int depth) {
    if (depth > MAX_VALUE_DEPTH && tl_fail)
        fail_at(tl_fail, MM_EUNSUPP, 0, "values nested deeper than %d cannot be compared",
                MAX_VALUE_DEPTH);
    if (is_num(a) && is_num(b)) {
        if (a.t == VF || b.t == VF)
            return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.t != b.t)
        return false;
    switch (a.t) {
    case VU: case VN: return true;
    case VS: return a.s.n == b.s.n && memcmp(a.s.p, b.s.p, a.s.n) == 0;
    case VL:
        if (a.l->n != b.l->n)
            return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!veq_d(a.l->v[i], b.l->v[i], depth + 1))
                return false;
        return true;
    case VD:
        if (a.d->n != b.d->n)
            return false;
        for (size_t i = 0; i < a.d->n; i++) {
            long j = dict_find(b.d, a.d->k[i]);
            if (j < 0 || !veq_d(a.d->v[i], b.d->v[j], depth + 1))
                return false;
        }
        return true;
    case VNS: return a.d == b.d;
    case VFN: return a.fn == b.fn;
    default: return false;
    }
}

// Python float repr: shortest digits that round-trip, fixed notation for 1e-4 <= |x| < 1e16.
static void fmt_float(char *out, size_t cap, double x) {
    if (isnan(x)) {
        snprintf(out, cap, "nan");
        return;
    }
    if (isinf(x)) {
        snprintf(out, cap, x < 0 ? "-inf" : "inf");
        return;
    }
    char buf[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    // buf = [-]d[.ddd]e[+-]XX
    bool neg = buf[0] == '-';
    const char *p = buf + neg;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (isdigit((unsigned char)*p))
            digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char *o = out;
    size_t left = cap;
#define PUT(...) do { int w_ = snprintf(o, left, __VA_ARGS__); if (w_ < 0 || (size_t)w_ >= left) return; o += w_; left -= (size_t)w_; } while (0)
    if (neg)
        PUT("-");
    if (exp >= -5 + 1 && exp < 16) {
        if (exp >= 0) {
            for (int i = 0; i <= exp; i++)
                PUT("%c", i < nd ? digits[i] : '0');
            PUT(".");
            if (nd > exp + 1)
                PUT("%s", digits + exp + 1);
            else
                PUT("0");
        } else {
            PUT("0.");
            for (int i = 0; i < -exp - 1; i++)
                PUT("0");
            PUT("%s", digits);
        }
    } else {
        PUT("%c", digits[0]);
        if (nd > 1)
            PUT(".%s", digits + 1);
        PUT("e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
#undef PUT
}

static void to_str(ectx *E, sbuf *b, jv x);

static void repr_str(ectx *E, sbuf *b, const char *s, size_t n) {
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    sb_putc(E, b, q);
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)s + i, n - i, &cp);
        char tmp[16];
        if (cp == (uint32_t)q || cp == '\\') {
            tmp[0] = '\\';
            tmp[1] = (char)cp;
            sb_put(E, b, tmp, 2);
        } else if (cp == '\n') {
            sb_puts(E, b, "\\n");
        } else if (cp == '\r') {
            sb_puts(E, b, "\\r");
        } else if (cp == '\t') {
            sb_puts(E, b, "\\t");
        } else if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad) {
            snprintf(tmp, sizeof tmp, "\\x%02x", cp);
            sb_puts(E, b, tmp);
        } else if ((cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
                   (cp >= 0x205f && cp <= 0x206f) || cp == 0x3000 || cp == 0xfeff ||
                   cp == 0x1680) {
            snprintf(tmp, sizeof tmp, "\\u%04x", cp);
            sb_puts(E, b, tmp);
        } else {
            sb_put(E, b, s + i, k);
        }
        i += k;
    }
    sb_putc(E, b, q);
}

static void repr(ectx *E, sbuf *b, jv x) {
    if (x.t == VS)
        repr_str(E, b, x.s.p, x.s.n);
    else if (x.t == VU)
        sb_puts(E, b, "Undefined");
    else
        to_str(E, b, x);
}

static void to_str_inner(ectx *E, sbuf *b, jv x);

static void to_str(ectx *E, sbuf *b, jv x) {
    if (++E->print_depth > 500)
        EFAIL(E, MM_EUNSUPP, 0, "value nested deeper than 500 levels (self-referencing "
              "namespace?) cannot be printed");
    to_str_inner(E, b, x);
    E->print_depth--;
}

static void to_str_inner(ectx *E, sbuf *b, jv x) {
    char tmp[48];
    switch (x.t) {
    case VU: return;
    case VN: sb_puts(E, b, "None"); return;
    case VB: sb_puts(E, b, x.b ? "True" : "False"); return;
    case VI: snprintf(tmp, sizeof tmp, "%lld", x.i); sb_puts(E, b, tmp); return;
    case VF: fmt_float(tmp, sizeof tmp, x.f); sb_puts(E, b, tmp); return;
    case VS: sb_put(E, b, x.s.p, x.s.n); return;
    case VL:
        sb_putc(E, b, x.l->tuple ? '(' : '[');
        for (size_t i = 0; i < x.l->n; i++) {
            if (i)
                sb_puts(E, b, ", ");
            repr(E, b, x.l->v[i]);
        }
        if (x.l->tuple && x.l->n == 1)
            sb_putc(E, b, ',');
        sb_putc(E, b, x.l->tuple ? ')' : ']');
        return;
    case VD: case VNS:
        if (x.t == VNS)
            sb_puts(E, b, "<Namespace ");
        sb_putc(E, b, '{');
        for (size_t i = 0; i < x.d->n; i++) {
            if (i)
                sb_puts(E, b, ", ");
            repr(E, b, x.d->k[i]);
            sb_puts(E, b, ": ");
            repr(E, b, x.d->v[i]);
        }
        sb_putc(E, b, '}');
        if (x.t == VNS)
            sb_putc(E, b, '>');
        return;
    default: // Python would print an object address here: refuse rather than differ
        EFAIL(E, MM_EUNSUPP, 0, "unsupported: rendering the function object '%s' as text",
              x.fn->name ? x.fn->name : "?");
    }
}

static jv as_str(ectx *E, jv x) {
    if (x.t == VS)
        return x;
    sbuf b = {0};
    to_str(E, &b, x);
    return v_sb(&b);
}

static const char *cstr(ectx *E, jv s) { // NUL-terminated copy of a VS
    return arena_strndup(&E->ar, s.s.p, s.s.n);
}

// ---- JSON in and out -------------------------------------------------------------------------

static jv from_json(ectx *E, const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jdict *d = dict_new(E, json_object_size(j));
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)j, k, v) {
            d->k[d->n] = v_cstr(arena_strndup(&E->ar, k, strlen(k)));
            d->v[d->n] = from_json(E, v);
            d->n++;
        }
        return (jv){.t = VD, .d = d};
    }
    case JSON_ARRAY: {
        jlist *l = list_new(E, json_array_size(j));
        size_t i;
        json_t *v;
        json_array_foreach(j, i, v) list_push(E, l, from_json(E, v));
        return v_list(l);
    }
    case JSON_STRING:
        return v_str(arena_strndup(&E->ar, json_string_value(j), json_string_length(j)),
                     json_string_length(j));
    case JSON_INTEGER: return v_int((long long)json_integer_value(j));
    case JSON_REAL: return v_float(json_real_value(j));
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    default: return v_none();
    }
}

typedef struct jsonfmt {
    const char *indent; // NULL: single line
    const char *item_sep, *key_sep;
    bool sort_keys;
    int line;
} jsonfmt;

static void json_str(ectx *E, sbuf *b, const char *s, size_t n) {
    sb_putc(E, b, '"');
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(tmp, sizeof tmp, "\\u%04x", c);
                esc = tmp;
            }
        }
        if (esc) {
            sb_put(E, b, s + run, i - run);
            sb_puts(E, b, esc);
            run = i + 1;
        }
    }
    sb_put(E, b, s + run, n - run);
    sb_putc(E, b, '"');
}

static void json_nl(ectx *E, sbuf *b, const jsonfmt *f, int level) {
    sb_putc(E, b, '\n');
    for (int i = 0; i < level; i++)
        sb_puts(E, b, f->indent);
}

static int cmp_str_keys(jv a, jv b) {
    size_t n = a.s.n < b.s.n ? a.s.n : b.s.n;
    int c = memcmp(a.s.p, b.s.p, n);
    return c ? c : (a.s.n < b.s.n ? -1 : a.s.n > b.s.n);
}

static void to_json(ectx *E, sbuf *b, jv x, const jsonfmt *f, int level) {
    if (level > 1000)
        EFAIL(E, MM_EFULL, f->line, "tojson: nesting deeper than 1000");
    char tmp[48];
    switch (x.t) {
    case VN: sb_puts(E, b, "null"); return;
    case VB: sb_puts(E, b, x.b ? "true" : "false"); return;
    case VI: snprintf(tmp, sizeof tmp, "%lld", x.i); sb_puts(E, b, tmp); return;
    case VF:
        if (isnan(x.f))
            sb_puts(E, b, "NaN");
        else if (isinf(x.f))
            sb_puts(E, b, x.f < 0 ? "-Infinity" : "Infinity");
        else {
            fmt_float(tmp, sizeof tmp, x.f);
            sb_puts(E, b, tmp);
        }
        return;
    case VS: json_str(E, b, x.s.p, x.s.n); return;
    case VL:
        if (x.l->n == 0) {
            sb_puts(E, b, "[]");
            return;
        }
        sb_putc(E, b, '[');
        for (size_t i = 0; i < x.l->n; i++) {
            if (i)
                sb_puts(E, b, f->item_sep);
            if (f->indent)
                json_nl(E, b, f, level + 1);
            to_json(E, b, x.l->v[i], f, level + 1);
        }
        if (f->indent)
            json_nl(E, b, f, level);
        sb_putc(E, b, ']');
        return;
    case VD: {
        if (x.d->n == 0) {
            sb_puts(E, b, "{}");
            return;
        }
        size_t n = x.d->n;
        size_t *ord = ealloc(E, n * sizeof(size_t));
        for (size_t i = 0; i < n; i++)
            ord[i] = i;
        if (f->sort_keys) {
            for (size_t i = 0; i < n; i++)
                if (x.d->k[i].t != VS)
                    EFAIL(E, MM_EUNSUPP, f->line, "tojson: sort_keys with non-string keys");
            for (size_t i = 1; i < n; i++) // insertion sort: stable, small n
                for (size_t j = i; j > 0 && cmp_str_keys(x.d->k[ord[j - 1]], x.d->k[ord[j]]) > 0; j--) {
                    size_t t = ord[j];
                    ord[j] = ord[j - 1];
                    ord[j - 1] = t;
                }
        }
        sb_putc(E, b, '{');
        for (size_t ii = 0; ii < n; ii++) {
            size_t i = ord[ii];
            if (ii)
                sb_puts(E, b, f->item_sep);
            if (f->indent)
                json_nl(E, b, f, level + 1);
            jv k = x.d->k[i];
            if (k.t == VS) {
                json_str(E, b, k.s.p, k.s.n);
            } else if (k.t == VN) {
                sb_puts(E, b, "\"null\"");
            } else if (k.t == VB) {
                sb_puts(E, b, k.b ? "\"true\"" : "\"false\"");
            } else if (k.t == VI || k.t == VF) {
                sbuf kb = {0};
                to_json(E, &kb, k, f, level + 1);
                json_str(E, b, kb.p, kb.n);
            } else {
                EFAIL(E, MM_EINVAL, f->line, "tojson: keys must be str, int, float, bool or None, not %s",
                      type_name(k));
            }
            sb_puts(E, b, f->key_sep);
            to_json(E, b, x.d->v[i], f, level + 1);
        }
        if (f->indent)
            json_nl(E, b, f, level);
        sb_putc(E, b, '}');
        return;
    }
    default:
        EFAIL(E, MM_EINVAL, f->line, "tojson: Object of type %s is not JSON serializable",
              type_name(x));
    }
}

// ---- evaluator: strings ----------------------------------------------------------------------

static size_t utf8_len(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

// Byte offsets of each code point of s (n_cp + 1 entries).
static size_t *utf8_offsets(ectx *E, const char *s, size_t n, size_t *n_cp) {
    size_t cnt = utf8_len(s, n);
    size_t *off = ealloc(E, (cnt + 1) * sizeof(size_t));
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80)
            off[k++] = i;
    off[k] = n;
    *n_cp = cnt;
    return off;
}

static bool cp_in(uint32_t cp, jv chars) {
    for (size_t i = 0; i < chars.s.n;) {
        uint32_t c;
        i += utf8_decode((const unsigned char *)chars.s.p + i, chars.s.n - i, &c);
        if (c == cp)
            return true;
    }
    return false;
}

// Python str.strip/lstrip/rstrip; chars NULL-type (VU/VN) strips whitespace.
static jv str_strip(jv s, jv chars, bool left, bool right) {
    const char *p = s.s.p;
    size_t n = s.s.n;
    bool ws = chars.t != VS;
    if (left) {
        while (n > 0) {
            uint32_t cp;
            size_t k = utf8_decode((const unsigned char *)p, n, &cp);
            if (ws ? !py_space(cp) : !cp_in(cp, chars))
                break;
            p += k;
            n -= k;
        }
    }
    if (right) {
        while (n > 0) {
            size_t k = 1;
            while (k < n && k < 4 && ((unsigned char)p[n - k] & 0xC0) == 0x80)
                k++;
            uint32_t cp;
            utf8_decode((const unsigned char *)p + n - k, k, &cp);
            if (ws ? !py_space(cp) : !cp_in(cp, chars))
                break;
            n -= k;
        }
    }
    return v_str(p, n);
}

static const char *memmem_r(const char *h, size_t hn, const char *nd, size_t nn) {
    if (nn > hn)
        return NULL;
    for (size_t i = hn - nn + 1; i-- > 0;)
        if (memcmp(h + i, nd, nn) == 0)
            return h + i;
    return NULL;
}

static jv str_split(ectx *E, jv s, jv sep, long long maxsplit, bool from_right, int line) {
    jlist *l = list_new(E, 4);
    const char *p = s.s.p;
    size_t n = s.s.n;
    if (sep.t != VS) { // whitespace runs
        if (from_right && maxsplit >= 0) {
            // rsplit with a limit: split from the right
            jlist *rev = list_new(E, 4);
            size_t end = n;
            while (end > 0) {
                jv t = str_strip(v_str(p, end), v_none(), false, true);
                end = t.s.n;
                if (end == 0)
                    break;
                if (maxsplit >= 0 && (long long)rev->n == maxsplit) {
                    list_push(E, rev, v_str(p, end));
                    end = 0;
                    break;
                }
                size_t st = end;
                while (st > 0) {
                    size_t k = 1;
                    while (k < st && k < 4 && ((unsigned char)p[st - k] & 0xC0) == 0x80)
                        k++;
                    uint32_t cp;
                    utf8_decode((const unsigned char *)p + st - k, k, &cp);
                    if (py_space(cp))
                        break;
                    st -= k;
                }
                list_push(E, rev, v_str(p + st, end - st));
                end = st;
            }
            for (size_t i = rev->n; i-- > 0;)
                list_push(E, l, rev->v[i]);
            return v_list(l);
        }
        size_t i = 0;
        for (;;) {
            i += lstrip_off(p + i, n - i);
            if (i >= n)
                break;
            if (maxsplit >= 0 && (long long)l->n == maxsplit) {
                jv rest = str_strip(v_str(p + i, n - i), v_none(), false, true);
                list_push(E, l, rest);
                break;
            }
            size_t j = i;
            while (j < n) {
                uint32_t cp;
                size_t k = utf8_decode((const unsigned char *)p + j, n - j, &cp);
                if (py_space(cp))
                    break;
                j += k;
            }
            list_push(E, l, v_str(p + i, j - i));
            i = j;
        }
        return v_list(l);
    }
    if (sep.s.n == 0)
        EFAIL(E, MM_EINVAL, line, "split: empty separator");
    if (!from_right) {
        size_t i = 0;
        for (;;) {
            const char *hit = (maxsplit < 0 || (long long)l->n < maxsplit)
                                  ? memmem(p + i, n - i, sep.s.p, sep.s.n)
                                  : NULL;
            if (!hit) {
                list_push(E, l, v_str(p + i, n - i));
                break;
            }
            list_push(E, l, v_str(p + i, (size_t)(hit - (p + i))));
            i = (size_t)(hit - p) + sep.s.n;
        }
        return v_list(l);
    }
    jlist *rev = list_new(E, 4);
    size_t end = n;
    for (;;) {
        const char *hit = (maxsplit < 0 || (long long)rev->n < maxsplit)
                              ? memmem_r(p, end, sep.s.p, sep.s.n)
                              : NULL;
        if (!hit) {
            list_push(E, rev, v_str(p, end));
            break;
        }
        size_t st = (size_t)(hit - p) + sep.s.n;
        list_push(E, rev, v_str(p + st, end - st));
        end = (size_t)(hit - p);
    }
    for (size_t i = rev->n; i-- > 0;)
        list_push(E, l, rev->v[i]);
    return v_list(l);
}

static jv str_replace(ectx *E, jv s, jv old, jv nw, long long count) {
    sbuf b = {0};
    const char *p = s.s.p;
    size_t n = s.s.n, i = 0;
    long long done = 0;
    if (old.s.n == 0) { // Python inserts nw between every character
        size_t ncp;
        size_t *off = utf8_offsets(E, p, n, &ncp);
        for (size_t k = 0; k <= ncp; k++) {
            if (count < 0 || done < count) {
                sb_put(E, &b, nw.s.p, nw.s.n);
                done++;
            }
            if (k < ncp)
                sb_put(E, &b, p + off[k], off[k + 1] - off[k]);
        }
        return v_sb(&b);
    }
    for (;;) {
        const char *hit = (count < 0 || done < count) ? memmem(p + i, n - i, old.s.p, old.s.n) : NULL;
        if (!hit) {
            sb_put(E, &b, p + i, n - i);
            break;
        }
        sb_put(E, &b, p + i, (size_t)(hit - (p + i)));
        sb_put(E, &b, nw.s.p, nw.s.n);
        i = (size_t)(hit - p) + old.s.n;
        done++;
    }
    return v_sb(&b);
}

static locale_t utf8_locale(void) {
    static locale_t loc;
    locale_t l = __atomic_load_n(&loc, __ATOMIC_ACQUIRE);
    if (l == 0) {
        l = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0);
        locale_t expected = 0;
        if (l && !__atomic_compare_exchange_n(&loc, &expected, l, false, __ATOMIC_ACQ_REL,
                                              __ATOMIC_ACQUIRE)) {
            freelocale(l);
            l = expected;
        }
    }
    return l;
}

// mode: 0 lower, 1 upper, 2 capitalize, 3 title
static jv str_case(ectx *E, jv s, int mode) {
    locale_t loc = utf8_locale();
    sbuf b = {0};
    bool prev_cased = false, first = true;
    for (size_t i = 0; i < s.s.n;) {
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)s.s.p + i, s.s.n - i, &cp);
        uint32_t o = cp;
        bool up;
        if (mode == 0)
            up = false;
        else if (mode == 1)
            up = true;
        else if (mode == 2)
            up = first;
        else
            up = !prev_cased;
        if (loc)
            o = up ? (uint32_t)towupper_l((wint_t)cp, loc) : (uint32_t)towlower_l((wint_t)cp, loc);
        else if (cp < 128)
            o = up ? (uint32_t)toupper((int)cp) : (uint32_t)tolower((int)cp);
        bool alpha = loc ? iswalpha_l((wint_t)cp, loc) : (cp < 128 && isalpha((int)cp));
        prev_cased = alpha;
        first = false;
        char tmp[4];
        sb_put(E, &b, tmp, utf8_encode(o, tmp));
        i += k;
    }
    return v_sb(&b);
}

static bool str_has_prefix(jv s, jv p) {
    return p.s.n <= s.s.n && memcmp(s.s.p, p.s.p, p.s.n) == 0;
}
static bool str_has_suffix(jv s, jv p) {
    return p.s.n <= s.s.n && memcmp(s.s.p + s.s.n - p.s.n, p.s.p, p.s.n) == 0;
}

// ---- evaluator: lookups ----------------------------------------------------------------------

typedef struct args {
    size_t n;
    jv *v;
    const char **kw; // NULL entries are positional
    int line;
    const char *what; // "filter 'join'", for messages
} args;

// arg fetches the positional argument pos or keyword name; returns false if absent.
static bool arg(const args *a, int pos, const char *name, jv *out) {
    int p = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw[i] == NULL) {
            if (p == pos) {
                *out = a->v[i];
                return true;
            }
            p++;
        } else if (name && strcmp(a->kw[i], name) == 0) {
            *out = a->v[i];
            return true;
        }
    }
    return false;
}

static size_t n_pos(const args *a) {
    size_t c = 0;
    for (size_t i = 0; i < a->n; i++)
        c += a->kw[i] == NULL;
    return c;
}

static void check_args(ectx *E, const args *a, size_t max_pos, const char *const *kws) {
    if (n_pos(a) > max_pos)
        EFAIL(E, MM_EINVAL, a->line, "%s takes at most %zu positional arguments (%zu given)",
              a->what, max_pos, n_pos(a));
    for (size_t i = 0; i < a->n; i++) {
        if (!a->kw[i])
            continue;
        bool ok = false;
        for (int k = 0; kws && kws[k]; k++)
            if (strcmp(kws[k], a->kw[i]) == 0)
                ok = true;
        if (!ok)
            EFAIL(E, MM_EUNSUPP, a->line, "%s: unsupported keyword argument '%s'", a->what,
                  a->kw[i]);
    }
}

static jv need_str(ectx *E, jv x, int line, const char *what) {
    if (x.t == VU)
        fail_undef(E, line, x, what);
    if (x.t != VS)
        EFAIL(E, MM_EINVAL, line, "%s: expected a string, got %s", what, type_name(x));
    return x;
}

static long long need_int(ectx *E, jv x, int line, const char *what) {
    if (x.t == VI || x.t == VB)
        return num_i(x);
    if (x.t == VU)
        fail_undef(E, line, x, what);
    EFAIL(E, MM_EINVAL, line, "%s: expected an integer, got %s", what, type_name(x));
}

static jv mk_fn(ectx *E, int kind, const char *name, jv self, const node *mac) {
    jfn *f = ealloc(E, sizeof *f);
    f->kind = kind;
    f->name = name;
    f->self = self;
    f->mac = mac;
    f->scope = NULL;
    return (jv){.t = VFN, .fn = f};
}

static const char *const STR_METHODS[] = {
    "startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit", "replace", "upper",
    "lower", "title", "capitalize", "find", "rfind", "count", "join", "splitlines", "isdigit",
    "isalpha", "isalnum", "isspace", "isupper", "islower", "format", "index", "encode", NULL};
static const char *const DICT_METHODS[] = {"items", "keys", "values", "get", NULL};
static const char *const LIST_METHODS[] = {"index", "count", NULL};
// Methods that mutate: transformers renders in an ImmutableSandboxedEnvironment, where they
// read as undefined and calling them is a SecurityError.
static const char *const UNSAFE_METHODS[] = {"append", "extend", "insert", "pop", "remove",
                                             "clear", "sort", "reverse", "update", "setdefault",
                                             "popitem", NULL};

static const char *in_list(const char *name, const char *const *list) {
    for (int i = 0; list[i]; i++)
        if (strcmp(list[i], name) == 0)
            return list[i];
    return NULL;
}

static jv get_attr(ectx *E, jv obj, const char *name, int line) {
    const char *m;
    switch (obj.t) {
    case VU: {
        char what[96];
        snprintf(what, sizeof what, "(reading attribute '%s')", name);
        fail_undef(E, line, obj, what);
    }
    case VD: {
        if ((m = in_list(name, DICT_METHODS)))
            return mk_fn(E, FN_METHOD, m, obj, NULL);
        long i = dict_find_s(obj.d, name);
        return i >= 0 ? obj.d->v[i] : v_undef(name);
    }
    case VNS: {
        long i = dict_find_s(obj.d, name);
        return i >= 0 ? obj.d->v[i] : v_undef(name);
    }
    case VS:
        if ((m = in_list(name, STR_METHODS)))
            return mk_fn(E, FN_METHOD, m, obj, NULL);
        return v_undef(name);
    case VL:
        if ((m = in_list(name, LIST_METHODS)))
            return mk_fn(E, FN_METHOD, m, obj, NULL);
        return v_undef(name);
    default:
        return v_undef(name);
    }
}

static bool norm_index(long long *i, size_t n) {
    if (*i < 0)
        *i += (long long)n;
    return *i >= 0 && *i < (long long)n;
}

static jv get_item(ectx *E, jv obj, jv key, int line) {
    switch (obj.t) {
    case VU:
        fail_undef(E, line, obj, "(subscripted)");
    case VL:
        if (key.t == VI || key.t == VB) {
            long long i = num_i(key);
            return norm_index(&i, obj.l->n) ? obj.l->v[i] : v_undef("list index");
        }
        break;
    case VS:
        if (key.t == VI || key.t == VB) {
            long long i = num_i(key);
            size_t ncp;
            size_t *off = utf8_offsets(E, obj.s.p, obj.s.n, &ncp);
            if (!norm_index(&i, ncp))
                return v_undef("string index");
            return v_str(obj.s.p + off[i], off[i + 1] - off[i]);
        }
        break;
    case VD: case VNS: {
        long i = dict_find(obj.d, key);
        if (i >= 0)
            return obj.d->v[i];
        break;
    }
    default:
        break;
    }
    if (key.t == VS && obj.t != VNS)
        return get_attr(E, obj, cstr(E, key), line);
    if (key.t == VS)
        return v_undef(cstr(E, key));
    return v_undef("item");
}

// Python slice.indices(); returns count.
static size_t slice_indices(ectx *E, jv jstart, jv jstop, jv jstep, size_t len, long long *start,
                            long long *step, int line) {
    long long n = (long long)len;
    long long st = 1;
    if (jstep.t != VN && jstep.t != VU)
        st = need_int(E, jstep, line, "slice step");
    if (st == 0)
        EFAIL(E, MM_EINVAL, line, "slice step cannot be zero");
    long long lo, hi;
    if (jstart.t == VN || jstart.t == VU) {
        lo = st < 0 ? n - 1 : 0;
    } else {
        lo = need_int(E, jstart, line, "slice start");
        if (lo < 0) {
            lo += n;
            if (lo < 0)
                lo = st < 0 ? -1 : 0;
        } else if (lo >= n) {
            lo = st < 0 ? n - 1 : n;
        }
    }
    if (jstop.t == VN || jstop.t == VU) {
        hi = st < 0 ? -1 : n;
    } else {
        hi = need_int(E, jstop, line, "slice stop");
        if (hi < 0) {
            hi += n;
            if (hi < 0)
                hi = st < 0 ? -1 : 0;
        } else if (hi >= n) {
            hi = st < 0 ? n - 1 : n;
        }
    }
    *start = lo;
    *step = st;
    if (st > 0)
        return lo < hi ? (size_t)((hi - lo - 1) / st + 1) : 0;
    return hi < lo ? (size_t)((lo - hi - 1) / (-st) + 1) : 0;
}

static jv do_slice(ectx *E, jv obj, jv a, jv b, jv c, int line) {
    long long start, step;
    if (obj.t == VL) {
        size_t cnt = slice_indices(E, a, b, c, obj.l->n, &start, &step, line);
        jlist *l = list_new(E, cnt);
        for (size_t i = 0; i < cnt; i++)
            list_push(E, l, obj.l->v[start + (long long)i * step]);
        return v_list(l);
    }
    if (obj.t == VS) {
        size_t ncp;
        size_t *off = utf8_offsets(E, obj.s.p, obj.s.n, &ncp);
        size_t cnt = slice_indices(E, a, b, c, ncp, &start, &step, line);
        if (step == 1)
            return v_str(obj.s.p + off[start], off[start + (long long)cnt] - off[start]);
        sbuf sb = {0};
        for (size_t i = 0; i < cnt; i++) {
            long long k = start + (long long)i * step;
            sb_put(E, &sb, obj.s.p + off[k], off[k + 1] - off[k]);
        }
        return v_sb(&sb);
    }
    if (obj.t == VU)
        fail_undef(E, line, obj, "(sliced)");
    EFAIL(E, MM_EINVAL, line, "'%s' object is not subscriptable", type_name(obj));
}

// Iteration as Python does it: lists, dict keys, string characters; Undefined is empty.
static jlist *iter_list(ectx *E, jv x, int line) {
    switch (x.t) {
    case VL: return x.l;
    case VU: return list_new(E, 1);
    case VD: case VNS: {
        jlist *l = list_new(E, x.d->n);
        for (size_t i = 0; i < x.d->n; i++)
            list_push(E, l, x.d->k[i]);
        return l;
    }
    case VS: {
        size_t ncp;
        size_t *off = utf8_offsets(E, x.s.p, x.s.n, &ncp);
        jlist *l = list_new(E, ncp);
        for (size_t i = 0; i < ncp; i++)
            list_push(E, l, v_str(x.s.p + off[i], off[i + 1] - off[i]));
        return l;
    }
    default:
        EFAIL(E, MM_EINVAL, line, "'%s' object is not iterable", type_name(x));
    }
}

static jv frame_lookup(ectx *E, frame *f, const char *name);

// ---- evaluator: operators --------------------------------------------------------------------

static int vcmp_inner(ectx *E, jv a, jv b, const char *op, int line);

static int vcmp(ectx *E, jv a, jv b, const char *op, int line) {
    if (++E->print_depth > MAX_VALUE_DEPTH)
        EFAIL(E, MM_EUNSUPP, line, "values nested deeper than %d cannot be compared",
              MAX_VALUE_DEPTH);
    int r = vcmp_inner(E, a, b, op, line);
    E->print_depth--;
    return r;
}

static int vcmp_inner(ectx *E, jv a, jv b, const char *op, int line) {
    if (is_num(a) && is_num(b)) {
        if (a.t == VF || b.t == VF) {
            double x = num_f(a), y = num_f(b);
            return x < y ? -1 : x > y;
        }
        long long x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y;
    }
    if (a.t == VS && b.t == VS)
        return cmp_str_keys(a, b);
    if (a.t == VL && b.t == VL) {
        size_t n = a.l->n < b.l->n ? a.l->n : b.l->n;
        for (size_t i = 0; i < n; i++) {
            if (veq(a.l->v[i], b.l->v[i]))
                continue;
            return vcmp(E, a.l->v[i], b.l->v[i], op, line);
        }
        return a.l->n < b.l->n ? -1 : a.l->n > b.l->n;
    }
    if (a.t == VU)
        fail_undef(E, line, a, "(compared)");
    if (b.t == VU)
        fail_undef(E, line, b, "(compared)");
    EFAIL(E, MM_EINVAL, line, "'%s' not supported between instances of '%s' and '%s'", op,
          type_name(a), type_name(b));
}

static bool contains(ectx *E, jv hay, jv needle, int line) {
    switch (hay.t) {
    case VS:
        if (needle.t != VS) {
            if (needle.t == VU)
                fail_undef(E, line, needle, "(left operand of 'in')");
            EFAIL(E, MM_EINVAL, line, "'in <string>' requires string as left operand, not %s",
                  type_name(needle));
        }
        return needle.s.n == 0 || memmem(hay.s.p, hay.s.n, needle.s.p, needle.s.n) != NULL;
    case VL:
        for (size_t i = 0; i < hay.l->n; i++)
            if (veq(hay.l->v[i], needle))
                return true;
        return false;
    case VD: case VNS: return dict_find(hay.d, needle) >= 0;
    case VU: return false;
    default:
        EFAIL(E, MM_EINVAL, line, "argument of type '%s' is not iterable", type_name(hay));
    }
}

static long long checked(ectx *E, bool overflow, const long long *r, int line) {
    if (overflow)
        EFAIL(E, MM_EUNSUPP, line, "integer overflow (Python big integers are not supported)");
    return *r;
}

static jv binop(ectx *E, const char *op, jv a, jv b, int line) {
    if (op[0] == '~') {
        sbuf sb = {0};
        to_str(E, &sb, a);
        to_str(E, &sb, b);
        return v_sb(&sb);
    }
    if (a.t == VU)
        fail_undef(E, line, a, "(operand of an arithmetic operator)");
    if (b.t == VU)
        fail_undef(E, line, b, "(operand of an arithmetic operator)");
    bool ints = (a.t == VI || a.t == VB) && (b.t == VI || b.t == VB);
    long long r;
    switch (op[0]) {
    case '+':
        if (a.t == VS && b.t == VS) {
            if (a.s.n + b.s.n > E->max_out)
                EFAIL(E, MM_EFULL, line, "string longer than the limit of %zu bytes", E->max_out);
            char *p = ealloc(E, a.s.n + b.s.n + 1);
            memcpy(p, a.s.p, a.s.n);
            memcpy(p + a.s.n, b.s.p, b.s.n);
            return v_str(p, a.s.n + b.s.n);
        }
        if (a.t == VL && b.t == VL) {
            jlist *l = list_new(E, a.l->n + b.l->n);
            for (size_t i = 0; i < a.l->n; i++)
                list_push(E, l, a.l->v[i]);
            for (size_t i = 0; i < b.l->n; i++)
                list_push(E, l, b.l->v[i]);
            return v_list(l);
        }
        if (ints)
            return v_int(checked(E, __builtin_add_overflow(num_i(a), num_i(b), &r), &r, line));
        if (is_num(a) && is_num(b))
            return v_float(num_f(a) + num_f(b));
        break;
    case '-':
        if (ints)
            return v_int(checked(E, __builtin_sub_overflow(num_i(a), num_i(b), &r), &r, line));
        if (is_num(a) && is_num(b))
            return v_float(num_f(a) - num_f(b));
        break;
    case '*':
        if (op[1] == '*') {
            if (ints && num_i(b) >= 0) {
                long long base = num_i(a), e = num_i(b), acc = 1;
                while (e-- > 0)
                    acc = checked(E, __builtin_mul_overflow(acc, base, &r), &r, line);
                return v_int(acc);
            }
            if (is_num(a) && is_num(b))
                return v_float(pow(num_f(a), num_f(b)));
            break;
        }
        if (ints)
            return v_int(checked(E, __builtin_mul_overflow(num_i(a), num_i(b), &r), &r, line));
        if (is_num(a) && is_num(b))
            return v_float(num_f(a) * num_f(b));
        if ((a.t == VS && (b.t == VI || b.t == VB)) || (b.t == VS && (a.t == VI || a.t == VB))) {
            jv s = a.t == VS ? a : b;
            long long k = a.t == VS ? num_i(b) : num_i(a);
            if (k <= 0 || s.s.n == 0)
                return v_str("", 0);
            if ((unsigned long long)k > E->max_out / s.s.n)
                EFAIL(E, MM_EFULL, line, "string longer than the limit of %zu bytes", E->max_out);
            char *p = ealloc(E, s.s.n * (size_t)k + 1);
            for (long long i = 0; i < k; i++)
                memcpy(p + (size_t)i * s.s.n, s.s.p, s.s.n);
            return v_str(p, s.s.n * (size_t)k);
        }
        break;
    case '/':
        if (!is_num(a) || !is_num(b))
            break;
        if (op[1] == '/') {
            if (ints) {
                long long x = num_i(a), y = num_i(b);
                if (y == 0)
                    EFAIL(E, MM_EINVAL, line, "integer division or modulo by zero");
                long long q = x / y;
                if ((x % y != 0) && ((x < 0) != (y < 0)))
                    q--;
                return v_int(q);
            }
            if (num_f(b) == 0.0)
                EFAIL(E, MM_EINVAL, line, "float floor division by zero");
            return v_float(floor(num_f(a) / num_f(b)));
        }
        if (num_f(b) == 0.0)
            EFAIL(E, MM_EINVAL, line, "division by zero");
        return v_float(num_f(a) / num_f(b));
    case '%':
        if (a.t == VS)
            EFAIL(E, MM_EUNSUPP, line, "unsupported construct: printf-style string formatting with '%%'");
        if (ints) {
            long long x = num_i(a), y = num_i(b);
            if (y == 0)
                EFAIL(E, MM_EINVAL, line, "integer division or modulo by zero");
            long long m = x % y;
            if (m != 0 && ((m < 0) != (y < 0)))
                m += y;
            return v_int(m);
        }
        if (is_num(a) && is_num(b)) {
            double y = num_f(b);
            if (y == 0.0)
                EFAIL(E, MM_EINVAL, line, "float modulo by zero");
            double m = fmod(num_f(a), y);
            if (m != 0 && ((m < 0) != (y < 0)))
                m += y;
            return v_float(m);
        }
        break;
    }
    EFAIL(E, MM_EINVAL, line, "unsupported operand types for %s: '%s' and '%s'", op,
          type_name(a), type_name(b));
}

// ---- evaluator: tests ------------------------------------------------------------------------

static const char *const NOARG_TESTS[] = {
    "defined", "undefined", "none", "string", "mapping", "sequence", "iterable", "number",
    "integer", "float", "boolean", "true", "false", "callable", "odd", "even", "lower", "upper",
    NULL};

static bool run_test(ectx *E, const char *name, jv x, const args *a, int line) {
    jv y = v_undef(NULL);
    bool has = arg(a, 0, NULL, &y);
    if (a->n > 0 && in_list(name, NOARG_TESTS))
        EFAIL(E, MM_EINVAL, line, "test '%s' takes no argument", name);
    if (a->n > 1)
        EFAIL(E, MM_EINVAL, line, "test '%s' takes one argument, %zu given", name, a->n);
    if (!strcmp(name, "defined")) return x.t != VU;
    if (!strcmp(name, "undefined")) return x.t == VU;
    if (!strcmp(name, "none")) return x.t == VN;
    if (!strcmp(name, "string")) return x.t == VS;
    if (!strcmp(name, "mapping")) return x.t == VD;
    if (!strcmp(name, "sequence")) return x.t == VS || x.t == VL || x.t == VD;
    if (!strcmp(name, "iterable")) return x.t == VS || x.t == VL || x.t == VD || x.t == VU;
    if (!strcmp(name, "number")) return is_num(x);
    if (!strcmp(name, "integer")) return x.t == VI;
    if (!strcmp(name, "float")) return x.t == VF;
    if (!strcmp(name, "boolean")) return x.t == VB;
    if (!strcmp(name, "true")) return x.t == VB && x.b;
    if (!strcmp(name, "false")) return x.t == VB && !x.b;
    if (!strcmp(name, "callable")) return x.t == VFN;
    if (!strcmp(name, "odd")) return need_int(E, x, line, "test 'odd'") % 2 != 0;
    if (!strcmp(name, "even")) return need_int(E, x, line, "test 'even'") % 2 == 0;
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (x.t != VS)
            return false;
        jv c = str_case(E, x, !strcmp(name, "upper"));
        return veq(c, x);
    }
    if (!has && (!strcmp(name, "equalto") || !strcmp(name, "eq") || !strcmp(name, "==") ||
                 !strcmp(name, "ne") || !strcmp(name, "!=") || !strcmp(name, "sameas") ||
                 !strcmp(name, "in") || !strcmp(name, "divisibleby") || !strcmp(name, "lt") ||
                 !strcmp(name, "gt") || !strcmp(name, "le") || !strcmp(name, "ge")))
        EFAIL(E, MM_EINVAL, line, "test '%s' needs an argument", name);
    if (!strcmp(name, "equalto") || !strcmp(name, "eq") || !strcmp(name, "==")) return veq(x, y);
    if (!strcmp(name, "ne") || !strcmp(name, "!=")) return !veq(x, y);
    if (!strcmp(name, "sameas")) // identity; small ints are cached objects in CPython
        return (x.t == y.t && (x.t == VN || (x.t == VB && x.b == y.b))) ||
               (x.t == VI && y.t == VI && x.i == y.i && x.i >= -5 && x.i <= 256) ||
               (x.t == y.t && (x.t == VL || x.t == VD || x.t == VNS) && x.l == y.l);
    if (!strcmp(name, "in")) return contains(E, y, x, line);
    if (!strcmp(name, "lt") || !strcmp(name, "<") || !strcmp(name, "lessthan"))
        return vcmp(E, x, y, "<", line) < 0;
    if (!strcmp(name, "le") || !strcmp(name, "<=")) return vcmp(E, x, y, "<=", line) <= 0;
    if (!strcmp(name, "gt") || !strcmp(name, ">") || !strcmp(name, "greaterthan"))
        return vcmp(E, x, y, ">", line) > 0;
    if (!strcmp(name, "ge") || !strcmp(name, ">=")) return vcmp(E, x, y, ">=", line) >= 0;
    if (!strcmp(name, "divisibleby")) {
        long long d = need_int(E, y, line, "test 'divisibleby'");
        if (d == 0)
            EFAIL(E, MM_EINVAL, line, "divisibleby: division by zero");
        return need_int(E, x, line, "test 'divisibleby'") % d == 0;
    }
    EFAIL(E, MM_EUNSUPP, line, "unsupported test '%s'", name);
}

// ---- evaluator: filters ----------------------------------------------------------------------

static jv apply_filter(ectx *E, const char *name, jv x, const args *a, int line);

static jv filter_tojson(ectx *E, jv x, const args *a, int line) {
    static const char *const kws[] = {"indent", "ensure_ascii", "separators", "sort_keys", NULL};
    check_args(E, a, 4, kws);
    jsonfmt f = {.indent = NULL, .item_sep = ", ", .key_sep = ": ", .line = line};
    jv v;
    if (arg(a, 0, "indent", &v) && v.t != VN) {
        if (v.t == VS) {
            f.indent = cstr(E, v);
        } else {
            long long k = need_int(E, v, line, "tojson indent");
            if (k > 64)
                EFAIL(E, MM_EUNSUPP, line, "tojson: indent %lld is too large", k);
            char *sp = ealloc(E, (size_t)(k > 0 ? k : 0) + 1);
            memset(sp, ' ', (size_t)(k > 0 ? k : 0));
            sp[k > 0 ? k : 0] = 0;
            f.indent = sp;
        }
        f.item_sep = ",";
    }
    if (arg(a, 1, "ensure_ascii", &v) && truthy(v))
        EFAIL(E, MM_EUNSUPP, line, "tojson: ensure_ascii=True is not supported");
    if (arg(a, 2, "separators", &v) && v.t != VN) {
        if (v.t != VL || v.l->n != 2 || v.l->v[0].t != VS || v.l->v[1].t != VS)
            EFAIL(E, MM_EINVAL, line, "tojson: separators must be a pair of strings");
        f.item_sep = cstr(E, v.l->v[0]);
        f.key_sep = cstr(E, v.l->v[1]);
    }
    if (arg(a, 3, "sort_keys", &v))
        f.sort_keys = truthy(v);
    sbuf b = {0};
    to_json(E, &b, x, &f, 0);
    return v_sb(&b);
}

// Attribute path "a.b" or integer index for map/selectattr/sort/join (Jinja make_attrgetter).
static jv attr_path(ectx *E, jv x, jv path, int line) {
    if (path.t == VI)
        return get_item(E, x, path, line);
    path = need_str(E, path, line, "attribute");
    const char *p = path.s.p, *end = p + path.s.n;
    while (p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        jv key = v_str(p, n);
        bool digits = n > 0;
        for (size_t i = 0; i < n; i++)
            digits = digits && isdigit((unsigned char)p[i]);
        if (digits)
            key = v_int(atoll(cstr(E, key)));
        if (x.t == VU)
            fail_undef(E, line, x, "(attribute lookup)");
        x = get_item(E, x, key, line);
        if (!dot)
            break;
        p = dot + 1;
    }
    return x;
}

static jv filter_select(ectx *E, jv x, const args *a, int line, bool by_attr, bool keep) {
    jlist *in = iter_list(E, x, line);
    jlist *out = list_new(E, in->n);
    size_t first_test = by_attr ? 1 : 0;
    jv attr = v_none(), tname = v_none();
    if (by_attr && !arg(a, 0, NULL, &attr))
        EFAIL(E, MM_EINVAL, line, "%s needs an attribute name", a->what);
    bool has_test = arg(a, (int)first_test, NULL, &tname);
    if (has_test)
        need_str(E, tname, line, "test name");
    args targs = {.line = line, .what = a->what};
    size_t np = 0;
    for (size_t i = 0; i < a->n; i++)
        if (!a->kw[i] && np++ > first_test) {
            targs.v = a->v + i;
            targs.kw = a->kw + i;
            targs.n = a->n - i;
            break;
        }
    for (size_t i = 0; i < in->n; i++) {
        jv item = in->v[i];
        jv val = by_attr ? attr_path(E, item, attr, line) : item;
        bool r = has_test ? run_test(E, cstr(E, tname), val, &targs, line) : truthy(val);
        if (r == keep)
            list_push(E, out, item);
    }
    return v_list(out);
}

static jv filter_map(ectx *E, jv x, const args *a, int line) {
    jlist *in = iter_list(E, x, line);
    jlist *out = list_new(E, in->n);
    jv attr, def, fname;
    if (arg(a, -1, "attribute", &attr)) {
        bool has_def = arg(a, -1, "default", &def);
        for (size_t i = 0; i < in->n; i++) {
            jv v = attr_path(E, in->v[i], attr, line);
            if (v.t == VU && has_def)
                v = def;
            list_push(E, out, v);
        }
        return v_list(out);
    }
    if (!arg(a, 0, NULL, &fname))
        EFAIL(E, MM_EINVAL, line, "map needs a filter name or attribute=");
    need_str(E, fname, line, "map filter name");
    args fa = {.line = line, .what = "filter (via map)"};
    for (size_t i = 0; i < a->n; i++)
        if (!a->kw[i]) {
            fa.v = a->v + i + 1;
            fa.kw = a->kw + i + 1;
            fa.n = a->n - i - 1;
            break;
        }
    const char *fn = cstr(E, fname);
    for (size_t i = 0; i < in->n; i++)
        list_push(E, out, apply_filter(E, fn, in->v[i], &fa, line));
    return v_list(out);
}

static jv filter_sort(ectx *E, jv x, const args *a, int line) {
    static const char *const kws[] = {"reverse", "case_sensitive", "attribute", NULL};
    check_args(E, a, 3, kws);
    jlist *in = iter_list(E, x, line);
    jv rev = v_bool(false), cs = v_bool(false), attr = v_none();
    arg(a, 0, "reverse", &rev);
    arg(a, 1, "case_sensitive", &cs);
    bool has_attr = arg(a, 2, "attribute", &attr) && attr.t != VN;
    size_t n = in->n;
    jlist *out = list_new(E, n);
    jv *keys = ealloc(E, (n ? n : 1) * sizeof(jv));
    for (size_t i = 0; i < n; i++) {
        list_push(E, out, in->v[i]);
        jv k = has_attr ? attr_path(E, in->v[i], attr, line) : in->v[i];
        if (k.t == VS && !truthy(cs))
            k = str_case(E, k, 0);
        keys[i] = k;
    }
    bool r = truthy(rev);
    for (size_t i = 1; i < n; i++) // stable insertion sort, as Python's sort is stable
        for (size_t j = i; j > 0; j--) {
            int c = vcmp(E, keys[j - 1], keys[j], "<", line);
            if (r ? c >= 0 : c <= 0)
                break;
            jv t = keys[j]; keys[j] = keys[j - 1]; keys[j - 1] = t;
            t = out->v[j]; out->v[j] = out->v[j - 1]; out->v[j - 1] = t;
        }
    return v_list(out);
}

static jv apply_filter(ectx *E, const char *name, jv x, const args *a, int line) {
    jv v;
    if (!strcmp(name, "tojson"))
        return filter_tojson(E, x, a, line);
    if (!strcmp(name, "safe") || !strcmp(name, "string")) {
        if (!strcmp(name, "string"))
            return as_str(E, x);
        return x;
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        switch (x.t) {
        case VS: return v_int((long long)utf8_len(x.s.p, x.s.n));
        case VL: return v_int((long long)x.l->n);
        case VD: case VNS: return v_int((long long)x.d->n);
        case VU: return v_int(0);
        default: EFAIL(E, MM_EINVAL, line, "object of type '%s' has no len()", type_name(x));
        }
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        jv def = v_str("", 0), boolean = v_bool(false);
        arg(a, 0, "default_value", &def);
        arg(a, 1, "boolean", &boolean);
        if (x.t == VU || (truthy(boolean) && !truthy(x)))
            return def;
        return x;
    }
    if (!strcmp(name, "trim")) {
        jv chars = v_none();
        arg(a, 0, "chars", &chars);
        return str_strip(as_str(E, x), chars, true, true);
    }
    if (!strcmp(name, "lower")) return str_case(E, as_str(E, x), 0);
    if (!strcmp(name, "upper")) return str_case(E, as_str(E, x), 1);
    if (!strcmp(name, "capitalize")) return str_case(E, str_case(E, as_str(E, x), 0), 2);
    if (!strcmp(name, "title")) return str_case(E, as_str(E, x), 3);
    if (!strcmp(name, "replace")) {
        jv old, nw, cnt = v_none();
        if (!arg(a, 0, "old", &old) || !arg(a, 1, "new", &nw))
            EFAIL(E, MM_EINVAL, line, "replace needs old and new");
        arg(a, 2, "count", &cnt);
        return str_replace(E, as_str(E, x), as_str(E, old), as_str(E, nw),
                           cnt.t == VN ? -1 : need_int(E, cnt, line, "replace count"));
    }
    if (!strcmp(name, "join")) {
        jv sep = v_str("", 0), attr = v_none();
        arg(a, 0, "d", &sep);
        arg(a, 1, "attribute", &attr);
        sep = as_str(E, sep);
        jlist *l = iter_list(E, x, line);
        sbuf b = {0};
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                sb_put(E, &b, sep.s.p, sep.s.n);
            to_str(E, &b, attr.t == VN ? l->v[i] : attr_path(E, l->v[i], attr, line));
        }
        return v_sb(&b);
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jlist *l = iter_list(E, x, line);
        if (l->n == 0)
            return v_undef(name);
        return name[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (!strcmp(name, "list")) {
        jlist *l = iter_list(E, x, line);
        jlist *c = list_new(E, l->n);
        for (size_t i = 0; i < l->n; i++)
            list_push(E, c, l->v[i]);
        return v_list(c);
    }
    if (!strcmp(name, "items")) {
        if (x.t == VU)
            return v_list(list_new(E, 1));
        if (x.t != VD && x.t != VNS)
            EFAIL(E, MM_EINVAL, line, "items: expected a mapping, got %s", type_name(x));
        jlist *l = list_new(E, x.d->n);
        for (size_t i = 0; i < x.d->n; i++) {
            jlist *p = list_new(E, 2);
            p->tuple = true;
            list_push(E, p, x.d->k[i]);
            list_push(E, p, x.d->v[i]);
            list_push(E, l, v_list(p));
        }
        return v_list(l);
    }
    if (!strcmp(name, "reverse")) {
        if (x.t == VS) {
            jv none = v_none();
            return do_slice(E, x, none, none, v_int(-1), line);
        }
        jlist *l = iter_list(E, x, line);
        jlist *c = list_new(E, l->n);
        for (size_t i = l->n; i-- > 0;)
            list_push(E, c, l->v[i]);
        return v_list(c);
    }
    if (!strcmp(name, "unique")) {
        jlist *l = iter_list(E, x, line);
        jlist *c = list_new(E, l->n);
        for (size_t i = 0; i < l->n; i++) {
            bool dup = false;
            for (size_t j = 0; j < c->n && !dup; j++)
                dup = veq(c->v[j], l->v[i]);
            if (!dup)
                list_push(E, c, l->v[i]);
        }
        return v_list(c);
    }
    if (!strcmp(name, "selectattr")) return filter_select(E, x, a, line, true, true);
    if (!strcmp(name, "rejectattr")) return filter_select(E, x, a, line, true, false);
    if (!strcmp(name, "select")) return filter_select(E, x, a, line, false, true);
    if (!strcmp(name, "reject")) return filter_select(E, x, a, line, false, false);
    if (!strcmp(name, "map")) return filter_map(E, x, a, line);
    if (!strcmp(name, "sort")) return filter_sort(E, x, a, line);
    if (!strcmp(name, "int")) {
        jv def = v_int(0);
        arg(a, 0, "default", &def);
        if (x.t == VI || x.t == VB) return v_int(num_i(x));
        if (x.t == VF) return isfinite(x.f) ? v_int((long long)x.f) : def;
        if (x.t == VS) {
            const char *s = cstr(E, str_strip(x, v_none(), true, true));
            char *e;
            long long r = strtoll(s, &e, 10);
            if (*s && !*e) return v_int(r);
            double d = strtod(s, &e);
            if (*s && !*e && isfinite(d)) return v_int((long long)d);
        }
        return def;
    }
    if (!strcmp(name, "float")) {
        jv def = v_float(0.0);
        arg(a, 0, "default", &def);
        if (is_num(x)) return v_float(num_f(x));
        if (x.t == VS) {
            const char *s = cstr(E, str_strip(x, v_none(), true, true));
            char *e;
            double d = strtod(s, &e);
            if (*s && !*e) return v_float(d);
        }
        return def;
    }
    if (!strcmp(name, "abs")) {
        if (x.t == VI || x.t == VB) {
            long long i = num_i(x);
            if (i == LLONG_MIN)
                EFAIL(E, MM_EUNSUPP, line, "integer overflow");
            return v_int(i < 0 ? -i : i);
        }
        if (x.t == VF) return v_float(fabs(x.f));
        EFAIL(E, MM_EINVAL, line, "bad operand type for abs(): '%s'", type_name(x));
    }
    if (!strcmp(name, "indent")) {
        jv width = v_int(4), first = v_bool(false), blank = v_bool(false);
        arg(a, 0, "width", &width);
        arg(a, 1, "first", &first);
        arg(a, 2, "blank", &blank);
        jv pad;
        if (width.t == VS) {
            pad = width;
        } else {
            long long w = need_int(E, width, line, "indent width");
            if (w < 0 || w > 1024)
                EFAIL(E, MM_EUNSUPP, line, "indent: width %lld out of range", w);
            char *p = ealloc(E, (size_t)w + 1);
            memset(p, ' ', (size_t)w);
            pad = v_str(p, (size_t)w);
        }
        jv s = as_str(E, x);
        sbuf b = {0};
        size_t i = 0;
        bool first_line = true;
        while (i <= s.s.n) {
            const char *nl = memchr(s.s.p + i, '\n', s.s.n - i);
            size_t n = nl ? (size_t)(nl - (s.s.p + i)) : s.s.n - i;
            bool is_blank = str_strip(v_str(s.s.p + i, n), v_none(), true, true).s.n == 0;
            if ((first_line ? truthy(first) : true) && (truthy(blank) || !is_blank))
                sb_put(E, &b, pad.s.p, pad.s.n);
            sb_put(E, &b, s.s.p + i, n);
            if (!nl)
                break;
            sb_putc(E, &b, '\n');
            i += n + 1;
            first_line = false;
        }
        return v_sb(&b);
    }
    if (!strcmp(name, "center") || !strcmp(name, "escape") || !strcmp(name, "e") ||
        !strcmp(name, "dictsort") || !strcmp(name, "format") || !strcmp(name, "wordwrap") ||
        !strcmp(name, "truncate") || !strcmp(name, "urlize") || !strcmp(name, "xmlattr") ||
        !strcmp(name, "batch") || !strcmp(name, "slice") || !strcmp(name, "groupby") ||
        !strcmp(name, "sum") || !strcmp(name, "min") || !strcmp(name, "max") ||
        !strcmp(name, "round") || !strcmp(name, "pprint") || !strcmp(name, "wordcount") ||
        !strcmp(name, "striptags") || !strcmp(name, "attr") || !strcmp(name, "random") ||
        !strcmp(name, "filesizeformat") || !strcmp(name, "forceescape") ||
        !strcmp(name, "urlencode") || !strcmp(name, "tojson_pretty"))
        EFAIL(E, MM_EUNSUPP, line, "unsupported filter '%s'", name);
    (void)v;
    EFAIL(E, MM_EUNSUPP, line, "unsupported filter '%s' (not a filter this interpreter knows)", name);
}

// ---- evaluator: methods and globals ----------------------------------------------------------

static bool affix_match(ectx *E, jv s, jv p, bool prefix, int line) {
    if (p.t == VL) {
        for (size_t i = 0; i < p.l->n; i++)
            if (affix_match(E, s, p.l->v[i], prefix, line))
                return true;
        return false;
    }
    p = need_str(E, p, line, prefix ? "startswith" : "endswith");
    return prefix ? str_has_prefix(s, p) : str_has_suffix(s, p);
}

static jv call_str_method(ectx *E, jv s, const char *m, const args *a, int line) {
    jv x = v_none(), y = v_none(), z = v_none();
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        if (!arg(a, 0, NULL, &x))
            EFAIL(E, MM_EINVAL, line, "%s() takes at least 1 argument", m);
        if (n_pos(a) > 1)
            EFAIL(E, MM_EUNSUPP, line, "%s(): start/end arguments are not supported", m);
        return v_bool(affix_match(E, s, x, m[0] == 's', line));
    }
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
        arg(a, 0, NULL, &x);
        if (x.t != VN)
            need_str(E, x, line, m);
        return str_strip(s, x, m[0] != 'r', m[0] != 'l');
    }
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        arg(a, 0, "sep", &x);
        arg(a, 1, "maxsplit", &y);
        if (x.t != VN)
            need_str(E, x, line, m);
        return str_split(E, s, x, y.t == VN ? -1 : need_int(E, y, line, "maxsplit"), m[0] == 'r',
                         line);
    }
    if (!strcmp(m, "replace")) {
        if (!arg(a, 0, NULL, &x) || !arg(a, 1, NULL, &y))
            EFAIL(E, MM_EINVAL, line, "replace() takes at least 2 arguments");
        arg(a, 2, "count", &z);
        return str_replace(E, s, need_str(E, x, line, m), need_str(E, y, line, m),
                           z.t == VN ? -1 : need_int(E, z, line, "count"));
    }
    if (!strcmp(m, "upper")) return str_case(E, s, 1);
    if (!strcmp(m, "lower")) return str_case(E, s, 0);
    if (!strcmp(m, "title")) return str_case(E, s, 3);
    if (!strcmp(m, "capitalize")) return str_case(E, str_case(E, s, 0), 2);
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "count")) {
        if (!arg(a, 0, NULL, &x))
            EFAIL(E, MM_EINVAL, line, "%s() takes at least 1 argument", m);
        if (n_pos(a) > 1)
            EFAIL(E, MM_EUNSUPP, line, "%s(): start/end arguments are not supported", m);
        need_str(E, x, line, m);
        if (!strcmp(m, "count")) {
            if (x.s.n == 0)
                return v_int((long long)utf8_len(s.s.p, s.s.n) + 1);
            long long c = 0;
            const char *p = s.s.p, *end = s.s.p + s.s.n;
            while ((p = memmem(p, (size_t)(end - p), x.s.p, x.s.n))) {
                c++;
                p += x.s.n;
            }
            return v_int(c);
        }
        const char *hit = m[0] == 'r' ? memmem_r(s.s.p, s.s.n, x.s.p, x.s.n)
                                      : (x.s.n == 0 ? s.s.p : memmem(s.s.p, s.s.n, x.s.p, x.s.n));
        if (!hit) {
            if (m[0] == 'i')
                EFAIL(E, MM_EINVAL, line, "substring not found");
            return v_int(-1);
        }
        return v_int((long long)utf8_len(s.s.p, (size_t)(hit - s.s.p)));
    }
    if (!strcmp(m, "join")) {
        if (!arg(a, 0, NULL, &x))
            EFAIL(E, MM_EINVAL, line, "join() takes exactly one argument");
        jlist *l = iter_list(E, x, line);
        sbuf b = {0};
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                sb_put(E, &b, s.s.p, s.s.n);
            jv it = l->v[i];
            if (it.t != VS)
                EFAIL(E, MM_EINVAL, line, "sequence item %zu: expected str instance, %s found", i,
                      type_name(it));
            sb_put(E, &b, it.s.p, it.s.n);
        }
        return v_sb(&b);
    }
    if (!strcmp(m, "splitlines")) {
        jlist *l = list_new(E, 4);
        size_t i = 0;
        while (i < s.s.n) {
            size_t j = i;
            while (j < s.s.n && s.s.p[j] != '\n' && s.s.p[j] != '\r')
                j++;
            list_push(E, l, v_str(s.s.p + i, j - i));
            if (j < s.s.n && s.s.p[j] == '\r' && j + 1 < s.s.n && s.s.p[j + 1] == '\n')
                j++;
            i = j + 1;
        }
        return v_list(l);
    }
    if (!strcmp(m, "isdigit") || !strcmp(m, "isalpha") || !strcmp(m, "isalnum") ||
        !strcmp(m, "isspace")) {
        if (s.s.n == 0)
            return v_bool(false);
        for (size_t i = 0; i < s.s.n; i++) {
            unsigned char c = (unsigned char)s.s.p[i];
            if (c >= 0x80)
                EFAIL(E, MM_EUNSUPP, line, "%s() on non-ASCII text is not supported", m);
            bool ok = m[2] == 'd' ? isdigit(c) : m[3] == 'l' && m[4] == 'p' ? isalpha(c)
                    : m[2] == 'a' ? isalnum(c) : isspace(c);
            if (!ok)
                return v_bool(false);
        }
        return v_bool(true);
    }
    EFAIL(E, MM_EUNSUPP, line, "unsupported string method '%s'", m);
}

static jv call_method(ectx *E, jv self, const char *m, const args *a, int line) {
    if (self.t == VS)
        return call_str_method(E, self, m, a, line);
    if (self.t == VD) {
        if (!strcmp(m, "items")) {
            args none = {.line = line, .what = "items"};
            return apply_filter(E, "items", self, &none, line);
        }
        if (!strcmp(m, "keys") || !strcmp(m, "values")) {
            jlist *l = list_new(E, self.d->n);
            for (size_t i = 0; i < self.d->n; i++)
                list_push(E, l, m[0] == 'k' ? self.d->k[i] : self.d->v[i]);
            return v_list(l);
        }
        if (!strcmp(m, "get")) {
            jv k, def = v_none();
            if (!arg(a, 0, NULL, &k))
                EFAIL(E, MM_EINVAL, line, "get() takes at least 1 argument");
            arg(a, 1, NULL, &def);
            long i = dict_find(self.d, k);
            return i >= 0 ? self.d->v[i] : def;
        }
    }
    if (self.t == VL && (!strcmp(m, "index") || !strcmp(m, "count"))) {
        jv x;
        if (!arg(a, 0, NULL, &x))
            EFAIL(E, MM_EINVAL, line, "%s() takes exactly one argument", m);
        long long c = 0;
        for (size_t i = 0; i < self.l->n; i++)
            if (veq(self.l->v[i], x)) {
                if (m[0] == 'i')
                    return v_int((long long)i);
                c++;
            }
        if (m[0] == 'i')
            EFAIL(E, MM_EINVAL, line, "list.index(x): x not in list");
        return v_int(c);
    }
    // Mutating methods: transformers renders in an ImmutableSandboxedEnvironment.
    EFAIL(E, MM_EINVAL, line, "access to attribute '%s' of '%s' object is unsafe", m,
          type_name(self));
}

static jv call_global(ectx *E, const char *name, const args *a, int line) {
    jv x;
    if (!strcmp(name, "raise_exception")) {
        jv msg = v_str("", 0);
        arg(a, 0, NULL, &msg);
        msg = as_str(E, msg);
        EFAIL(E, MM_EINVAL, line, "template raised an exception: %.*s", (int)(msg.s.n > 200 ? 200 : msg.s.n),
              msg.s.p);
    }
    if (!strcmp(name, "range")) {
        long long lo = 0, hi, st = 1;
        size_t np = n_pos(a);
        if (np == 0 || np > 3)
            EFAIL(E, MM_EINVAL, line, "range expected 1 to 3 arguments, got %zu", np);
        arg(a, 0, NULL, &x);
        if (np == 1) {
            hi = need_int(E, x, line, "range");
        } else {
            lo = need_int(E, x, line, "range");
            arg(a, 1, NULL, &x);
            hi = need_int(E, x, line, "range");
            if (np == 3) {
                arg(a, 2, NULL, &x);
                st = need_int(E, x, line, "range");
            }
        }
        if (st == 0)
            EFAIL(E, MM_EINVAL, line, "range() arg 3 must not be zero");
        long double cntf = st > 0 ? (hi > lo ? ((long double)hi - lo - 1) / st + 1 : 0)
                                  : (lo > hi ? ((long double)lo - hi - 1) / (-(long double)st) + 1 : 0);
        if (cntf > (long double)E->max_range)
            EFAIL(E, MM_EFULL, line, "range() of %.0Lf elements exceeds the limit of %zu", cntf,
                  E->max_range);
        size_t cnt = (size_t)cntf;
        jlist *l = list_new(E, cnt);
        for (size_t i = 0; i < cnt; i++)
            list_push(E, l, v_int(lo + (long long)i * st));
        return v_list(l);
    }
    if (!strcmp(name, "namespace") || !strcmp(name, "dict")) {
        jdict *d = dict_new(E, a->n);
        for (size_t i = 0; i < a->n; i++) {
            if (a->kw[i]) {
                dict_set_s(E, d, a->kw[i], a->v[i]);
            } else if (a->v[i].t == VD || a->v[i].t == VNS) {
                for (size_t k = 0; k < a->v[i].d->n; k++)
                    dict_set(E, d, a->v[i].d->k[k], a->v[i].d->v[k]);
            } else {
                EFAIL(E, MM_EINVAL, line, "%s() positional argument must be a mapping", name);
            }
        }
        return (jv){.t = name[0] == 'n' ? VNS : VD, .d = d};
    }
    if (!strcmp(name, "strftime_now")) {
        if (!arg(a, 0, NULL, &x))
            EFAIL(E, MM_EINVAL, line, "strftime_now() takes a format argument");
        need_str(E, x, line, "strftime_now");
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        char buf[256];
        size_t n = strftime(buf, sizeof buf, cstr(E, x), &tmv);
        return v_str(arena_strndup(&E->ar, buf, n), n);
    }
    EFAIL(E, MM_EUNSUPP, line, "unsupported global function '%s'", name);
}

static const char *const GLOBALS[] = {"range", "namespace", "dict", "raise_exception",
                                      "strftime_now", NULL};
static const char *const UNSUPPORTED_GLOBALS[] = {"lipsum", "cycler", "joiner", "caller",
                                                  "varargs", "kwargs", "self", NULL};

// ---- evaluator: expressions ------------------------------------------------------------------

static jv eval(ectx *E, const node *nd, frame *f);
static int exec_body(ectx *E, const node *body, frame *f);

// Every evaluated node passes here: the step budget bounds loops, and the measured C stack
// depth bounds recursion (macro calls inside deeply nested blocks), whatever the frame sizes
// of this build (sanitizers make them several times larger).
static void step(ectx *E, int line) {
    if (++E->steps > E->max_steps)
        EFAIL(E, MM_EFULL, line, "template exceeded the step limit of %zu (runaway loop?)",
              E->max_steps);
    volatile char here = 0;
    uintptr_t sp = (uintptr_t)&here;
    size_t used = sp < E->stack_base ? E->stack_base - sp : sp - E->stack_base;
    if (used > E->max_stack)
        EFAIL(E, MM_EFULL, line, "template recursion used more than %zu bytes of stack",
              E->max_stack);
}

static jv frame_lookup(ectx *E, frame *f, const char *name) {
    for (; f; f = f->parent) {
        long i = dict_find_s(&f->vars, name);
        if (i >= 0)
            return f->vars.v[i];
    }
    const char *g = in_list(name, GLOBALS);
    if (g)
        return mk_fn(E, FN_GLOBAL, g, v_none(), NULL);
    return v_undef(name);
}

static void frame_set(ectx *E, frame *f, const char *name, jv val) {
    dict_set_s(E, &f->vars, name, val);
}

static args eval_args(ectx *E, const node *nd, frame *f, const char *what) {
    args a = {.n = nd->nv, .line = nd->line, .what = what};
    a.v = ealloc(E, (nd->nv ? nd->nv : 1) * sizeof(jv));
    a.kw = ealloc(E, (nd->nv ? nd->nv : 1) * sizeof(char *));
    for (size_t i = 0; i < nd->nv; i++) {
        a.v[i] = eval(E, nd->v[i], f);
        a.kw[i] = i < nd->nn ? nd->names[i] : NULL;
    }
    return a;
}

static jv call_macro(ectx *E, const node *mac, frame *scope, const args *a, int line) {
    if (E->depth >= E->max_depth)
        EFAIL(E, MM_EFULL, line, "macro calls nested deeper than %d (runaway recursion?)",
              E->max_depth);
    frame *mf = ealloc(E, sizeof *mf);
    mf->parent = scope ? scope : E->top;
    mf->vars = *dict_new(E, mac->nn + 1);
    size_t np = n_pos(a);
    if (np > mac->nn)
        EFAIL(E, MM_EINVAL, line, "macro '%s' takes not more than %zu argument(s)", mac->s, mac->nn);
    for (size_t i = 0; i < a->n; i++) {
        if (!a->kw[i])
            continue;
        bool ok = false;
        for (size_t p = 0; p < mac->nn; p++)
            ok = ok || strcmp(mac->names[p], a->kw[i]) == 0;
        if (!ok)
            EFAIL(E, MM_EINVAL, line, "macro '%s' takes no keyword argument '%s'", mac->s, a->kw[i]);
    }
    for (size_t p = 0; p < mac->nn; p++) {
        jv v;
        if (!arg(a, (int)p, mac->names[p], &v))
            v = mac->v[p] ? eval(E, mac->v[p], mf) : v_undef(mac->names[p]);
        frame_set(E, mf, mac->names[p], v);
    }
    sbuf *saved = E->out;
    sbuf buf = {0};
    E->out = &buf;
    E->depth++;
    exec_body(E, mac->b, mf);
    E->depth--;
    E->out = saved;
    return v_sb(&buf);
}

static jv call_value(ectx *E, jv callee, const args *a, int line, const char *name) {
    if (callee.t == VFN) {
        switch (callee.fn->kind) {
        case FN_GLOBAL: return call_global(E, callee.fn->name, a, line);
        case FN_METHOD: return call_method(E, callee.fn->self, callee.fn->name, a, line);
        case FN_MACRO: return call_macro(E, callee.fn->mac, callee.fn->scope, a, line);
        }
    }
    if (callee.t == VU) {
        if (callee.uname && in_list(callee.uname, UNSUPPORTED_GLOBALS))
            EFAIL(E, MM_EUNSUPP, line, "unsupported global '%s'", callee.uname);
        fail_undef(E, line, callee, "(called as a function)");
    }
    EFAIL(E, MM_EINVAL, line, "'%s' object%s%s is not callable", type_name(callee),
          name ? " " : "", name ? name : "");
}

static jv eval(ectx *E, const node *nd, frame *f) {
    step(E, nd->line);
    switch (nd->k) {
    case N_LIT: return nd->lit;
    case N_NAME: {
        jv v = frame_lookup(E, f, nd->s);
        if (v.t == VU && in_list(nd->s, UNSUPPORTED_GLOBALS))
            EFAIL(E, MM_EUNSUPP, nd->line, "unsupported global '%s'", nd->s);
        return v;
    }
    case N_LIST: {
        jlist *l = list_new(E, nd->nv);
        for (size_t i = 0; i < nd->nv; i++)
            list_push(E, l, eval(E, nd->v[i], f));
        l->tuple = nd->neg;
        return v_list(l);
    }
    case N_DICT: {
        jdict *d = dict_new(E, nd->nv / 2);
        for (size_t i = 0; i + 1 < nd->nv; i += 2) {
            jv k = eval(E, nd->v[i], f);
            if (k.t == VL || k.t == VD || k.t == VNS || k.t == VU)
                EFAIL(E, MM_EINVAL, nd->line, "unhashable dict key of type '%s'", type_name(k));
            dict_set(E, d, k, eval(E, nd->v[i + 1], f));
        }
        return (jv){.t = VD, .d = d};
    }
    case N_ATTR: return get_attr(E, eval(E, nd->a, f), nd->s, nd->line);
    case N_ITEM: {
        jv obj = eval(E, nd->a, f);
        return get_item(E, obj, eval(E, nd->b, f), nd->line);
    }
    case N_SLICE: {
        jv obj = eval(E, nd->a, f);
        jv none = v_none();
        jv lo = nd->b ? eval(E, nd->b, f) : none;
        jv hi = nd->c ? eval(E, nd->c, f) : none;
        jv st = nd->d ? eval(E, nd->d, f) : none;
        return do_slice(E, obj, lo, hi, st, nd->line);
    }
    case N_CALL: {
        if (nd->a->k == N_ATTR) {
            jv obj = eval(E, nd->a->a, f);
            jv callee = get_attr(E, obj, nd->a->s, nd->line);
            if (callee.t == VU && obj.t == VD && (!strcmp(nd->a->s, "cycle") || !strcmp(nd->a->s, "changed")))
                EFAIL(E, MM_EUNSUPP, nd->line, "unsupported: loop.%s()", nd->a->s);
            if (callee.t == VU && (obj.t == VL || obj.t == VD) && in_list(nd->a->s, UNSAFE_METHODS))
                EFAIL(E, MM_EINVAL, nd->line, "access to attribute '%s' of '%s' object is unsafe",
                      nd->a->s, type_name(obj));
            if (callee.t == VU && obj.t == VS) // Python str has more methods than we implement
                EFAIL(E, MM_EUNSUPP, nd->line, "unsupported string method '%s'", nd->a->s);
            if (callee.t == VU && obj.t == VU)
                fail_undef(E, nd->line, obj, "(method call)");
            if (callee.t == VU)
                EFAIL(E, MM_EINVAL, nd->line, "'%s' object has no attribute '%s' to call",
                      type_name(obj), nd->a->s);
            args a = eval_args(E, nd, f, nd->a->s);
            return call_value(E, callee, &a, nd->line, nd->a->s);
        }
        jv callee = eval(E, nd->a, f);
        args a = eval_args(E, nd, f, nd->a->k == N_NAME ? nd->a->s : "call");
        return call_value(E, callee, &a, nd->line, nd->a->k == N_NAME ? nd->a->s : NULL);
    }
    case N_FILTER: {
        jv x = eval(E, nd->a, f);
        char what[64];
        snprintf(what, sizeof what, "filter '%s'", nd->s);
        args a = eval_args(E, nd, f, arena_strndup(&E->ar, what, strlen(what)));
        return apply_filter(E, nd->s, x, &a, nd->line);
    }
    case N_TEST: {
        jv x = eval(E, nd->a, f);
        args a = eval_args(E, nd, f, "test");
        bool r = run_test(E, nd->s, x, &a, nd->line);
        return v_bool(nd->neg ? !r : r);
    }
    case N_BIN: {
        jv a = eval(E, nd->a, f);
        jv b = eval(E, nd->b, f);
        return binop(E, nd->s, a, b, nd->line);
    }
    case N_NEG: case N_POS: {
        jv a = eval(E, nd->a, f);
        if (a.t == VF)
            return v_float(nd->k == N_NEG ? -a.f : a.f);
        if (a.t == VI || a.t == VB) {
            long long i = num_i(a);
            if (nd->k == N_NEG && i == LLONG_MIN)
                EFAIL(E, MM_EUNSUPP, nd->line, "integer overflow");
            return v_int(nd->k == N_NEG ? -i : i);
        }
        if (a.t == VU)
            fail_undef(E, nd->line, a, "(unary operand)");
        EFAIL(E, MM_EINVAL, nd->line, "bad operand type for unary %c: '%s'",
              nd->k == N_NEG ? '-' : '+', type_name(a));
    }
    case N_AND: {
        jv a = eval(E, nd->a, f);
        return truthy(a) ? eval(E, nd->b, f) : a;
    }
    case N_OR: {
        jv a = eval(E, nd->a, f);
        return truthy(a) ? a : eval(E, nd->b, f);
    }
    case N_NOT: return v_bool(!truthy(eval(E, nd->a, f)));
    case N_CMP: {
        jv l = eval(E, nd->a, f);
        for (size_t i = 0; i < nd->nv; i++) {
            jv r = eval(E, nd->v[i], f);
            const char *op = nd->names[i];
            bool ok;
            if (!strcmp(op, "==")) ok = veq(l, r);
            else if (!strcmp(op, "!=")) ok = !veq(l, r);
            else if (!strcmp(op, "in")) ok = contains(E, r, l, nd->line);
            else if (!strcmp(op, "not in")) ok = !contains(E, r, l, nd->line);
            else {
                int c = vcmp(E, l, r, op, nd->line);
                ok = !strcmp(op, "<") ? c < 0 : !strcmp(op, "<=") ? c <= 0
                   : !strcmp(op, ">") ? c > 0 : c >= 0;
            }
            if (!ok)
                return v_bool(false);
            l = r;
        }
        return v_bool(true);
    }
    case N_COND:
        if (truthy(eval(E, nd->b, f)))
            return eval(E, nd->a, f);
        return nd->c ? eval(E, nd->c, f) : v_undef("conditional expression without else");
    default:
        EFAIL(E, MM_EUNSUPP, nd->line, "internal: node kind %d is not an expression", nd->k);
    }
}

// ---- evaluator: statements -------------------------------------------------------------------

enum { FLOW_NEXT = 0, FLOW_BREAK = 1, FLOW_CONTINUE = 2 };

static void assign_targets(ectx *E, frame *f, const node *nd, jv val) {
    if (nd->nn == 1) {
        frame_set(E, f, nd->names[0], val);
        return;
    }
    jlist *l = (val.t == VL) ? val.l : iter_list(E, val, nd->line);
    if (l->n != nd->nn)
        EFAIL(E, MM_EINVAL, nd->line, "cannot unpack %zu values into %zu names", l->n, nd->nn);
    for (size_t i = 0; i < nd->nn; i++)
        frame_set(E, f, nd->names[i], l->v[i]);
}

static int exec_for(ectx *E, const node *nd, frame *f) {
    jlist *items = iter_list(E, eval(E, nd->a, f), nd->line);
    if (nd->d) { // loop filter: "for x in xs if cond"
        jlist *kept = list_new(E, items->n);
        for (size_t i = 0; i < items->n; i++) {
            frame *tf = ealloc(E, sizeof *tf);
            tf->parent = f;
            tf->vars = *dict_new(E, nd->nn + 1);
            assign_targets(E, tf, nd, items->v[i]);
            if (truthy(eval(E, nd->d, tf)))
                list_push(E, kept, items->v[i]);
        }
        items = kept;
    }
    size_t n = items->n;
    if (n == 0 && nd->c)
        return exec_body(E, nd->c, f);
    for (size_t i = 0; i < n; i++) {
        step(E, nd->line);
        frame *lf = ealloc(E, sizeof *lf); // arena: a macro defined in the body keeps it
        lf->parent = f;
        lf->vars = *dict_new(E, nd->nn + 2);
        jdict *loop = dict_new(E, 12);
        DICT_ADD(loop, "index", v_int((long long)i + 1));
        DICT_ADD(loop, "index0", v_int((long long)i));
        DICT_ADD(loop, "revindex", v_int((long long)(n - i)));
        DICT_ADD(loop, "revindex0", v_int((long long)(n - i - 1)));
        DICT_ADD(loop, "first", v_bool(i == 0));
        DICT_ADD(loop, "last", v_bool(i + 1 == n));
        DICT_ADD(loop, "length", v_int((long long)n));
        DICT_ADD(loop, "depth", v_int(1));
        DICT_ADD(loop, "depth0", v_int(0));
        if (i > 0)
            DICT_ADD(loop, "previtem", items->v[i - 1]);
        if (i + 1 < n)
            DICT_ADD(loop, "nextitem", items->v[i + 1]);
        frame_set(E, lf, "loop", (jv){.t = VD, .d = loop});
        assign_targets(E, lf, nd, items->v[i]);
        int r = exec_body(E, nd->b, lf);
        if (r == FLOW_BREAK)
            break;
    }
    return FLOW_NEXT;
}

static int exec_stmt(ectx *E, const node *nd, frame *f) {
    step(E, nd->line);
    switch (nd->k) {
    case N_TEXT:
        sb_put(E, E->out, nd->s, nd->sn);
        return FLOW_NEXT;
    case N_OUT:
        to_str(E, E->out, eval(E, nd->a, f));
        return FLOW_NEXT;
    case N_IF:
        if (truthy(eval(E, nd->a, f)))
            return exec_body(E, nd->b, f);
        return nd->c ? exec_body(E, nd->c, f) : FLOW_NEXT;
    case N_FOR:
        return exec_for(E, nd, f);
    case N_SET: {
        jv val = eval(E, nd->b, f);
        if (nd->a) { // ns.attr = value
            jv ns = frame_lookup(E, f, nd->a->a->s);
            if (ns.t != VNS)
                EFAIL(E, MM_EINVAL, nd->line,
                      "cannot assign attribute '%s' on '%s': it is not a namespace()",
                      nd->a->s, nd->a->a->s);
            dict_set_s(E, ns.d, nd->a->s, val);
        } else {
            assign_targets(E, f, nd, val);
        }
        return FLOW_NEXT;
    }
    case N_SETBLOCK: {
        sbuf *saved = E->out;
        sbuf buf = {0};
        E->out = &buf;
        exec_body(E, nd->b, f);
        E->out = saved;
        frame_set(E, f, nd->names[0], v_sb(&buf));
        return FLOW_NEXT;
    }
    case N_MACRO: {
        jv m = mk_fn(E, FN_MACRO, nd->s, v_none(), nd);
        m.fn->scope = f;
        frame_set(E, f, nd->s, m);
        return FLOW_NEXT;
    }
    case N_BREAK: return FLOW_BREAK;
    case N_CONTINUE: return FLOW_CONTINUE;
    case N_BODY: return exec_body(E, nd, f);
    default:
        EFAIL(E, MM_EUNSUPP, nd->line, "internal: node kind %d is not a statement", nd->k);
    }
}

static int exec_body(ectx *E, const node *body, frame *f) {
    for (size_t i = 0; i < body->nv; i++) {
        int r = exec_stmt(E, body->v[i], f);
        if (r != FLOW_NEXT)
            return r;
    }
    return FLOW_NEXT;
}

mm_err mm_jinja_render(const mm_jinja *t, const json_t *ctx, const mm_jinja_limits *limits,
                       char **out, size_t *out_len, char err[MM_ERRLEN]) {
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (ctx && !json_is_object(ctx))
        return mm_errf(err, MM_EINVAL, "%s: render variables must be a JSON object", t->name);
    ectx *E = calloc(1, sizeof *E);
    if (E == NULL)
        return mm_errf(err, MM_ENOMEM, "out of memory");
    mm_jinja_limits lim = limits ? *limits : (mm_jinja_limits){0};
    E->max_steps = lim.max_steps ? lim.max_steps : 20000000;
    E->max_out = lim.max_output_bytes ? lim.max_output_bytes : (size_t)64 << 20;
    E->max_depth = lim.max_call_depth ? lim.max_call_depth : 64;
    E->max_range = lim.max_range ? lim.max_range : 1000000;
    E->max_stack = lim.max_stack_bytes ? lim.max_stack_bytes : (size_t)1 << 20;
    volatile char base = 0;
    E->stack_base = (uintptr_t)&base;
    E->ar.limit = lim.max_memory_bytes ? lim.max_memory_bytes : (size_t)512 << 20;
    E->ar.fail = &E->fail;
    E->ar.cached = true;
    jfail *saved_fail = tl_fail; // renders do not nest, but keep the outer value if they did
    tl_fail = &E->fail;
    if (setjmp(E->fail.jb)) {
        tl_fail = saved_fail;
        mm_err code = E->fail.code;
        mm_errf(err, code, "%s: %s", t->name, E->fail.msg);
        if (err)
            utf8_sanitize(err);
        arena_fini(&E->ar);
        free(E);
        return code;
    }
    frame *globals = ealloc(E, sizeof *globals);
    globals->parent = NULL;
    globals->vars = *dict_new(E, 16);
    if (ctx) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)ctx, k, v)
            frame_set(E, globals, arena_strndup(&E->ar, k, strlen(k)), from_json(E, v));
    }
    frame *top = ealloc(E, sizeof *top);
    top->parent = globals;
    top->vars = *dict_new(E, 16);
    E->globals = globals;
    E->top = top;
    sbuf res = {0};
    E->out = &res;
    exec_body(E, t->root, top);
    tl_fail = saved_fail;
    char *s = malloc(res.n + 1);
    if (s == NULL) {
        arena_fini(&E->ar);
        free(E);
        return mm_errf(err, MM_ENOMEM, "out of memory");
    }
    if (res.n)
        memcpy(s, res.p, res.n);
    s[res.n] = 0;
    *out = s;
    if (out_len)
        *out_len = res.n;
    arena_fini(&E->ar);
    free(E);
    return MM_OK;
}
