// SPDX-License-Identifier: MIT
// Fixed-layout data-plane frame header: every frame on every data-plane transport (shm://,
// tcp://, later rdma:// and GPU peer copies) is one struct mm_wire_hdr followed by exactly
// hdr.payload_bytes of payload. The layout is wire ABI: little-endian, asserted below.
//
// Design notes:
// - Exchanges are keyed by (step_id, layer, row_base) carried in the frame itself, never by
//   "the k-th frame on this connection" (LESSONS.md: counters drift after one-sided failures).
//   conn_seq exists only as a transport integrity check (lost/duplicated frames -> MM_EPROTO)
//   and restarts at 0 on every new connection.
// - The header says the payload's format. mm_wire_payload_bytes() is the one function that
//   maps (format, n_rows, row_dim) to a byte count; senders fill payload_bytes with it
//   (through mm_wire_hdr_init) and receivers check frames against it (mm_wire_hdr_check),
//   so the two ends can never disagree on a row's size.
// - magic, version and hdr_check are owned by the transport: it stamps them on send
//   (mm__wire_hdr_seal) and verifies them on receive. A frame failing any check is MM_EPROTO
//   and breaks the connection (a byte stream cannot be resynchronised).
#ifndef MM_WIRE_H
#define MM_WIRE_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#include "mm/err.h"

#define MM_WIRE_MAGIC 0x31574d4du // "MMW1" as little-endian bytes
#define MM_WIRE_V1 1u
#define MM_WIRE_NO_LAYER 0xffffffffu // layer value for frames that belong to no layer
// Largest payload one frame may carry (guards against garbage sizes): 1 GiB.
#define MM_WIRE_MAX_PAYLOAD (1ull << 30)

// What a frame is. Kinds below MM_WIRE_KIND_USER_MAX may be sent by callers; the others are
// reserved to transports (mm_conn_send rejects them with MM_EINVAL; mm_conn_recv never
// returns them).
enum mm_wire_kind {
    MM_WIRE_ROWS = 1,   // request rows: router -> expert owner / attention shard
    MM_WIRE_REPLY = 2,  // result rows for a ROWS frame with the same step_id/layer/row_base
    MM_WIRE_PING = 3,   // latency probe; the peer answers PONG with the same payload
    MM_WIRE_PONG = 4,
    MM_WIRE_ERROR = 5,  // aux = mm_err code of a failed request; payload = message (BYTES)
    MM_WIRE_CTRL = 6,   // small application message carried beside rows (format BYTES)
    MM_WIRE_KIND_USER_MAX = 63,
    MM_WIRE_HELLO = 64, // transport handshake (reserved)
    MM_WIRE_BYE = 65,   // orderly close (reserved): the receiver's recv returns MM_ECLOSED
};

// Payload element encoding. Rows are row-major, n_rows rows of row_dim elements each.
enum mm_wire_format {
    MM_WIRE_BYTES = 0, // opaque bytes: row_dim bytes per row
    MM_WIRE_F32 = 1,   // IEEE float32, 4 bytes per element
    MM_WIRE_BF16 = 2,  // bfloat16 (upper half of float32), 2 bytes per element
    MM_WIRE_Q8_32 = 3, // blocks of 32 elements: float32 scale then 32 int8 (36 bytes);
                       // row_dim must be a multiple of 32
    MM_WIRE_I32 = 4,   // int32 (token ids, expert ids, positions), 4 bytes per element
    MM_WIRE_FORMAT_COUNT
};

// The frame header, 64 bytes. Offsets in the comments are wire ABI.
typedef struct mm_wire_hdr {
    uint32_t magic;         // 0  MM_WIRE_MAGIC; stamped by the transport
    uint16_t version;       // 4  MM_WIRE_V1; stamped by the transport
    uint16_t kind;          // 6  enum mm_wire_kind
    uint16_t format;        // 8  enum mm_wire_format of the payload
    uint16_t flags;         // 10 kind-specific bits; 0 unless a kind defines them
    uint32_t layer;         // 12 model layer index, or MM_WIRE_NO_LAYER
    uint64_t step_id;       // 16 step this frame belongs to (router-assigned, never reused)
    uint32_t row_base;      // 24 index of the first row within the step's canonical row order
    uint32_t n_rows;        // 28 rows in this frame
    uint32_t row_dim;       // 32 elements per row (d_model for hidden rows)
    uint32_t src;           // 36 sender's node id as agreed at join (control plane)
    uint64_t payload_bytes; // 40 == mm_wire_payload_bytes(format, n_rows, row_dim)
    uint64_t conn_seq;      // 48 frame number on this connection from 0; stamped by transport
    uint32_t aux;           // 56 kind-specific: expert id for ROWS/REPLY, mm_err for ERROR
    uint32_t hdr_check;     // 60 FNV-1a of bytes 0..59; stamped by the transport
} mm_wire_hdr;

static_assert(sizeof(mm_wire_hdr) == 64, "mm_wire_hdr is wire ABI");
static_assert(offsetof(mm_wire_hdr, step_id) == 16, "mm_wire_hdr is wire ABI");
static_assert(offsetof(mm_wire_hdr, payload_bytes) == 40, "mm_wire_hdr is wire ABI");
static_assert(offsetof(mm_wire_hdr, hdr_check) == 60, "mm_wire_hdr is wire ABI");

// mm_wire_payload_bytes is THE function deciding a frame's payload size: it writes the byte
// count of n_rows rows of row_dim elements in format to *out. Pure, thread-safe.
// Errors: MM_EINVAL for an unknown format, a Q8_32 row_dim not a multiple of 32, or a size
// above MM_WIRE_MAX_PAYLOAD.
mm_err mm_wire_payload_bytes(enum mm_wire_format format, uint32_t n_rows, uint32_t row_dim,
                             uint64_t *out);

// mm_wire_hdr_init zeroes *hdr and fills kind, format, step_id, layer, n_rows, row_dim and
// payload_bytes (through mm_wire_payload_bytes); the caller may then set row_base, src, aux
// and flags. Writes into caller's storage; thread-safe. Errors: those of
// mm_wire_payload_bytes, MM_EINVAL for a kind not sendable by callers.
mm_err mm_wire_hdr_init(mm_wire_hdr *hdr, enum mm_wire_kind kind, enum mm_wire_format format,
                        uint64_t step_id, uint32_t layer, uint32_t n_rows, uint32_t row_dim);

// mm_wire_hdr_check validates a received header: magic, version, hdr_check, known kind and
// format, and payload_bytes equal to mm_wire_payload_bytes(format, n_rows, row_dim) (for
// format BYTES, n_rows * row_dim). Errors: MM_EPROTO with the offending field in err.
mm_err mm_wire_hdr_check(const mm_wire_hdr *hdr, char err[MM_ERRLEN]);

// Names for logs: never NULL ("?" for unknown values).
const char *mm_wire_kind_name(uint32_t kind);
const char *mm_wire_format_name(uint32_t format);

// Transport-internal (mm__): stamps magic, version, conn_seq and hdr_check into *hdr.
void mm__wire_hdr_seal(mm_wire_hdr *hdr, uint64_t conn_seq);
// Transport-internal: the FNV-1a checksum over bytes 0..59 of hdr.
uint32_t mm__wire_hdr_sum(const mm_wire_hdr *hdr);

#endif
