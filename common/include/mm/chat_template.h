// SPDX-License-Identifier: MIT
// Chat templates of Hugging Face checkpoints: loads the template (tokenizer_config.json's
// chat_template, a string or a list of named templates, or chat_template.jinja) with the
// special tokens, and renders OpenAI-style messages into the prompt text exactly as
// transformers' tokenizer.apply_chat_template(..., tokenize=False) does.
#ifndef MM_CHAT_TEMPLATE_H
#define MM_CHAT_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "mm/err.h"
#include "mm/jinja.h"

typedef struct mm_chat_template mm_chat_template;

typedef struct mm_chat_render_opts {
    const json_t *tools;        // borrowed JSON array of tools, or NULL (the template sees None)
    bool add_generation_prompt; // append the assistant header
    int enable_thinking;        // -1: not passed (undefined in the template), 0: false, 1: true
    const json_t *extra;        // borrowed JSON object of further template kwargs, or NULL
    const char *template_name;  // named template to use, or NULL: "tool_use" when tools are
                                // given and it exists, else "default"
    const mm_jinja_limits *limits; // NULL: mm_jinja defaults
} mm_chat_render_opts;

// mm_chat_template_open loads dir/chat_template.jinja if present (it wins, as in
// transformers), else the chat_template of dir/tokenizer_config.json, compiles it (all named
// templates of a list), and records the special tokens of tokenizer_config.json (bos_token,
// eos_token, unk_token, pad_token, sep_token, cls_token, mask_token as strings or
// {"content": ...}, additional_special_tokens). Returns owned *out; release with
// mm_chat_template_close. Errors: MM_ENOENT (no template in dir), MM_EFORMAT (bad JSON or a
// template syntax error, naming the line), MM_EUNSUPP (a construct outside the supported
// subset), MM_ENOMEM. Blocks on file reads; thread-safe.
mm_err mm_chat_template_open(const char *dir, mm_chat_template **out, char err[MM_ERRLEN]);

// mm_chat_template_open_file: as mm_chat_template_open, with the template read from the file
// path instead of dir's (as vLLM's --chat-template); dir's special tokens are kept. Errors name
// the file: MM_ENOENT (it cannot be opened), MM_EFORMAT / MM_EUNSUPP (its syntax, with the
// line), MM_EINVAL (no path).
mm_err mm_chat_template_open_file(const char *dir, const char *path, mm_chat_template **out,
                                  char err[MM_ERRLEN]);

// mm_chat_template_open_source compiles one template from text. special_tokens (borrowed,
// may be NULL) is a JSON object of name -> string passed to the template (e.g.
// {"bos_token": "<s>", "eos_token": "</s>"}). Same errors as mm_chat_template_open.
mm_err mm_chat_template_open_source(const char *src, const json_t *special_tokens,
                                    mm_chat_template **out, char err[MM_ERRLEN]);

// mm_chat_template_close releases ct; accepts NULL.
void mm_chat_template_close(mm_chat_template *ct);

// mm_chat_template_render renders messages (borrowed JSON array of {"role", "content", ...}:
// content a string, null, or a list of parts). A template that iterates message content itself
// (a {% for %} over content) gets the parts unchanged, as transformers passes them; for one
// that treats content as a string, a list of {"type": "text", "text": ...} parts is joined
// with "\n" (as vLLM does; transformers would fail there). tool_calls pass through unchanged,
// so function.arguments stays a JSON string as the OpenAI API carries it (Qwen3's template
// accepts a string or a mapping; DeepSeek's needs the string). opts may be NULL. On MM_OK *out is an owned
// NUL-terminated string (free()) of *out_len bytes. Errors: MM_EINVAL (bad messages, or the
// template raised an error, with its message and line), MM_EUNSUPP (content part types other
// than text; unsupported template features met at render time), MM_EFULL (a render limit),
// MM_ENOENT (template_name not found), MM_ENOMEM. Thread-safe on a shared ct.
mm_err mm_chat_template_render(const mm_chat_template *ct, const json_t *messages,
                               const mm_chat_render_opts *opts, char **out, size_t *out_len,
                               char err[MM_ERRLEN]);

// mm_chat_template_hermes_tools: whether ct's tools prompt asks for Qwen3's (Hermes) tool call
// blocks, <tool_call>\n{"name": ...}: found in a probe render with one tool and one plain user
// message (no request's text decides it; GLM's <tool_call>NAME\n<arg_key> blocks and templates
// that ignore tools do not match). False when the probe does not render.
bool mm_chat_template_hermes_tools(const mm_chat_template *ct);
// mm_chat_template_glm_tools: whether ct's tools prompt asks for GLM-4.5/4.6's blocks,
// <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...</tool_call> (the same probe
// render holds "<tool_call>" and "<arg_key>"). False when the probe does not render.
bool mm_chat_template_glm_tools(const mm_chat_template *ct);
// mm_chat_template_deepseek_tools: whether ct's tools prompt asks for DeepSeek's blocks: 1
// V3's, <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
// (the probe render holds "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"); 2 V3.1's,
// <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜> (it holds both tags, not V3's
// form); 0 neither (as DeepSeek's shipped V3 template, which renders no tool list), or when the
// probe does not render.
int mm_chat_template_deepseek_tools(const mm_chat_template *ct);

#endif
