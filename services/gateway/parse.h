// SPDX-License-Identifier: MIT
// Splitting a chat model's output text (parse.c): reasoning inside <think>...</think>, tool
// calls in Qwen3's (Hermes) <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks or
// GLM-4.5/4.6's <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
// blocks, or DeepSeek-V3/V3.1's <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> blocks (the
// <｜tool▁calls▁begin｜>/<｜tool▁calls▁end｜> around them dropped), and the rest as content.
// Incremental: text arrives in pieces (streaming) and a tag prefix at the end of what is known
// is held back until the next piece or the end says what it is.
// Depends only on jansson and libc, so tests include parse.c directly.
#ifndef MM_GATEWAY_PARSE_H
#define MM_GATEWAY_PARSE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

// DeepSeek-V3 / V3.1's tool call tags (their chat templates write an assistant's calls so): the
// calls between GW_DS_CALLS_OPEN and GW_DS_CALLS_CLOSE, each GW_DS_OPEN BODY GW_DS_CLOSE, BODY
// "function<sep>NAME\n```json\nARGS\n```" (V3) or "NAME<sep>ARGS" (V3.1), <sep> GW_DS_SEP.
#define GW_DS_CALLS_OPEN "<｜tool▁calls▁begin｜>"
#define GW_DS_CALLS_CLOSE "<｜tool▁calls▁end｜>"
#define GW_DS_OPEN "<｜tool▁call▁begin｜>"
#define GW_DS_CLOSE "<｜tool▁call▁end｜>"
#define GW_DS_SEP "<｜tool▁sep｜>"

typedef struct gw_buf { // growable byte buffer, NUL-terminated when non-empty
    char *p;
    size_t len, cap;
} gw_buf;

bool gw_buf_reserve(gw_buf *b, size_t more);
void gw_buf_add(gw_buf *b, const char *s, size_t n); // drops the bytes when out of memory
void gw_buf_adds(gw_buf *b, const char *s);

enum { GW_PARSE_CONTENT, GW_PARSE_THINK, GW_PARSE_TOOL };

typedef struct gw_chat_parse {
    int mode;
    size_t parsed;        // bytes of the text consumed
    bool tools;           // parse <tool_call> blocks (the request offered tools)
    bool skip_nl;         // drop newlines that open a block (they may arrive later)
    bool ds;              // GW_PARSE_TOOL: the block is DeepSeek's (DS_OPEN ... DS_CLOSE)
    gw_buf reasoning, content;
    json_t *tool_calls;   // owned array of {"id", "type": "function", "function": {...}}
    char id_prefix[64];   // tool call ids: <prefix>_<n>
    char *forced;         // owned: the start of a tool call the prompt already wrote (after
                          // its <tool_call>), read as the first block's head; NULL: none
} gw_chat_parse;

// gw_chat_parse_init: think_open when the prompt itself opened a <think> block.
void gw_chat_parse_init(gw_chat_parse *p, bool think_open, bool tools, const char *id_prefix);
// gw_chat_parse_force_tool: the prompt ended inside a tool call it opened (tool_choice: the
// gateway wrote "<tool_call>" and `head`, e.g. "\n{\"name\": \"f\", \"arguments\": ", or with
// ds DeepSeek's calls' and call's opening tags and `head`, e.g. "function<｜tool▁sep｜>f\n"):
// the output starts in that block, and head is read in front of it. Returns false out of
// memory.
bool gw_chat_parse_force_tool(gw_chat_parse *p, const char *head, bool ds);
// gw_chat_parse_feed consumes text[p->parsed, limit) (text: the whole output so far). final:
// no more text will come, so held-back tag prefixes and an unterminated block are text.
void gw_chat_parse_feed(gw_chat_parse *p, const char *text, size_t limit, bool final);
void gw_chat_parse_fini(gw_chat_parse *p);
// gw_tool_name_len: how many bytes from s (of n) a GLM block's function name takes (letters,
// digits, '_', '-', '.'); a name is read only where that is all of it.
size_t gw_tool_name_len(const char *s, size_t n);

#endif
