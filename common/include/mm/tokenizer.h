// SPDX-License-Identifier: MIT
// Text <-> token ids, read from a checkpoint's Hugging Face tokenizer.json: byte-level BPE with
// merges by rank, Split/ByteLevel/Digits pre-tokenizers (PCRE2, UTF + UCP, JIT), NFC/NFD/
// NFKC/NFKD normalizers (utf8proc), added and special tokens matched before BPE, the
// ByteLevel decoder, and a streaming decoder that never emits half a UTF-8 character.
//
// Threading: an mm_tokenizer is immutable after mm_tokenizer_open except for its word cache,
// which is lock-free; every function taking a const mm_tokenizer * may run on any number of
// threads at once. An mm_detok_stream belongs to one sequence and one thread at a time.
#ifndef MM_TOKENIZER_H
#define MM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mm/err.h"

typedef struct mm_tokenizer mm_tokenizer;

// mm_tokenizer_open reads path, either a tokenizer.json file or a checkpoint directory holding
// one, and builds the tokenizer (returns owned in *out: release with mm_tokenizer_close).
// Blocks on file I/O (about 1 s for Qwen3's 11 MB file).
// Errors: MM_ENOENT (no such file), MM_EFORMAT (bad JSON, missing model/vocab/merges, a merge
// naming a token not in the vocab, a regex PCRE2 rejects), MM_EUNSUPP (a model, normalizer,
// pre-tokenizer, decoder or post-processor type this module does not implement: the message
// names it), MM_ENOMEM. err, when not NULL, names the file and what is wrong.
mm_err mm_tokenizer_open(mm_tokenizer **out, const char *path, char err[MM_ERRLEN]);

// mm_tokenizer_close frees tk; accepts NULL.
void mm_tokenizer_close(mm_tokenizer *tk);

// mm_tokenizer_encode turns n_bytes of UTF-8 text into ids, as Hugging Face tokenizers'
// encode(text, add_special_tokens=add_special) does. add_special applies the post-processor's
// template (a BOS for Llama/DeepSeek-style files; nothing for Qwen3). Writes at most cap ids
// and sets *n_ids to the number the text needs, so a caller can size and retry.
// Errors: MM_EINVAL (tk or text NULL, text not valid UTF-8: err says at which byte),
// MM_EFULL (more than cap ids; *n_ids holds the count needed), MM_ENOMEM.
// Allocates per call (scratch proportional to the text), never per token. Thread-safe.
mm_err mm_tokenizer_encode(const mm_tokenizer *tk, const char *text, size_t n_bytes,
                           bool add_special, int32_t *ids, size_t cap, size_t *n_ids,
                           char err[MM_ERRLEN]);

// mm_tokenizer_decode writes the text of ids into out (not NUL-terminated unless room is
// left: *n_bytes excludes the NUL), as tokenizers' decode(ids, skip_special_tokens) does:
// token bytes are concatenated and invalid UTF-8 is replaced by U+FFFD per maximal subpart
// (Rust's String::from_utf8_lossy). skip_special drops added tokens marked special.
// Errors: MM_EINVAL (an id outside the vocabulary: err names it), MM_EFULL (*n_bytes holds
// the size needed). Thread-safe.
mm_err mm_tokenizer_decode(const mm_tokenizer *tk, const int32_t *ids, size_t n_ids,
                           bool skip_special, char *out, size_t cap, size_t *n_bytes,
                           char err[MM_ERRLEN]);

// mm_tokenizer_token_id looks up a token by its tokenizer.json spelling ("<|im_end|>",
// "Ġthe"). Errors: MM_ENOENT when absent.
mm_err mm_tokenizer_token_id(const mm_tokenizer *tk, const char *token, int32_t *id);

// mm_tokenizer_token_bytes gives the bytes id decodes to (borrowed from tk; not
// NUL-terminated; may be a partial UTF-8 character). Errors: MM_EINVAL for an unknown id.
mm_err mm_tokenizer_token_bytes(const mm_tokenizer *tk, int32_t id, const char **bytes,
                                size_t *n_bytes);

// mm_tokenizer_vocab_size is one more than the largest id (vocabulary and added tokens), the
// size of an embedding table that covers every id; 151669 for Qwen3.
size_t mm_tokenizer_vocab_size(const mm_tokenizer *tk);

// mm_tokenizer_is_special: id is an added token marked special (skipped by skip_special).
bool mm_tokenizer_is_special(const mm_tokenizer *tk, int32_t id);

// mm_tokenizer_max_token_bytes: the longest byte string any single id decodes to.
size_t mm_tokenizer_max_token_bytes(const mm_tokenizer *tk);

// ---- streaming decode ------------------------------------------------------------------------
// One mm_detok_stream per generated sequence, in the caller's storage. Each feed emits the
// text that is complete so far; bytes of an unfinished UTF-8 character (at most 3) are held
// until the character completes. The concatenation of every feed's output and the final
// flush equals mm_tokenizer_decode of the same ids. No allocation after init.
typedef struct mm_detok_stream {
    const mm_tokenizer *tk; // borrowed; must outlive the stream
    bool skip_special;
    uint8_t n_pending;      // bytes of an unfinished character held back (0..3)
    uint8_t pending[4];
} mm_detok_stream;

// mm_detok_stream_out_max: an output capacity large enough for any single feed or flush.
size_t mm_detok_stream_out_max(const mm_tokenizer *tk);

// mm_detok_stream_init prepares st for tk. Errors: MM_EINVAL (NULL argument).
mm_err mm_detok_stream_init(mm_detok_stream *st, const mm_tokenizer *tk, bool skip_special);

// mm_detok_stream_feed appends id and writes the newly complete text to out (*n_bytes may be
// 0). Errors: MM_EINVAL (unknown id; the stream is unchanged), MM_EFULL (cap below what
// this id needs, *n_bytes holds it; the stream is unchanged).
mm_err mm_detok_stream_feed(mm_detok_stream *st, int32_t id, char *out, size_t cap,
                            size_t *n_bytes);

// mm_detok_stream_flush ends the sequence: held bytes of an unfinished character become one
// U+FFFD, as the full decode renders them. Errors: MM_EFULL (cap < 3).
mm_err mm_detok_stream_flush(mm_detok_stream *st, char *out, size_t cap, size_t *n_bytes);

// mm_detok_stream_fini forgets any held bytes; accepts a zeroed stream.
void mm_detok_stream_fini(mm_detok_stream *st);

#endif
