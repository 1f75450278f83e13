// SPDX-License-Identifier: MIT
// Data-plane frame header helpers (mm/wire.h): the single payload-size rule, header
// construction for senders and validation for receivers.
#include <string.h>

#include "mm/wire.h"

mm_err mm_wire_payload_bytes(enum mm_wire_format format, uint32_t n_rows, uint32_t row_dim,
                             uint64_t *out) {
    uint64_t per_row;
    switch (format) {
    case MM_WIRE_BYTES: per_row = row_dim; break;
    case MM_WIRE_F32: per_row = 4ull * row_dim; break;
    case MM_WIRE_BF16: per_row = 2ull * row_dim; break;
    case MM_WIRE_I32: per_row = 4ull * row_dim; break;
    case MM_WIRE_Q8_32:
        if (row_dim % 32 != 0)
            return MM_EINVAL;
        per_row = (uint64_t)(row_dim / 32) * 36ull; // f32 scale + 32 x int8 per block
        break;
    default: return MM_EINVAL;
    }
    uint64_t total = per_row * (uint64_t)n_rows; // < 2^32 * 2^34: no overflow in 64 bits
    if (total > MM_WIRE_MAX_PAYLOAD)
        return MM_EINVAL;
    *out = total;
    return MM_OK;
}

mm_err mm_wire_hdr_init(mm_wire_hdr *hdr, enum mm_wire_kind kind, enum mm_wire_format format,
                        uint64_t step_id, uint32_t layer, uint32_t n_rows, uint32_t row_dim) {
    memset(hdr, 0, sizeof(*hdr));
    if (kind < MM_WIRE_ROWS || kind > MM_WIRE_KIND_USER_MAX)
        return MM_EINVAL;
    uint64_t bytes = 0;
    MM_TRY(mm_wire_payload_bytes(format, n_rows, row_dim, &bytes));
    hdr->kind = (uint16_t)kind;
    hdr->format = (uint16_t)format;
    hdr->step_id = step_id;
    hdr->layer = layer;
    hdr->n_rows = n_rows;
    hdr->row_dim = row_dim;
    hdr->payload_bytes = bytes;
    return MM_OK;
}

uint32_t mm__wire_hdr_sum(const mm_wire_hdr *hdr) {
    const unsigned char *p = (const unsigned char *)hdr;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < offsetof(mm_wire_hdr, hdr_check); i++) {
        h ^= p[i];
        h *= 16777619u;
    }
    return h;
}

void mm__wire_hdr_seal(mm_wire_hdr *hdr, uint64_t conn_seq) {
    hdr->magic = MM_WIRE_MAGIC;
    hdr->version = MM_WIRE_V1;
    hdr->conn_seq = conn_seq;
    hdr->hdr_check = mm__wire_hdr_sum(hdr);
}

static int kind_known(uint32_t kind) {
    return (kind >= MM_WIRE_ROWS && kind <= MM_WIRE_CTRL) || kind == MM_WIRE_HELLO ||
           kind == MM_WIRE_BYE;
}

mm_err mm_wire_hdr_check(const mm_wire_hdr *hdr, char err[MM_ERRLEN]) {
    if (hdr->magic != MM_WIRE_MAGIC)
        return mm_errf(err, MM_EPROTO, "frame magic 0x%08x, expected 0x%08x (not a moemesh "
                       "data-plane frame)", hdr->magic, MM_WIRE_MAGIC);
    if (hdr->version != MM_WIRE_V1)
        return mm_errf(err, MM_EPROTO, "frame wire version %u, this build speaks %u",
                       hdr->version, MM_WIRE_V1);
    uint32_t sum = mm__wire_hdr_sum(hdr);
    if (hdr->hdr_check != sum)
        return mm_errf(err, MM_EPROTO, "frame header checksum 0x%08x, computed 0x%08x",
                       hdr->hdr_check, sum);
    if (!kind_known(hdr->kind))
        return mm_errf(err, MM_EPROTO, "frame kind %u unknown", hdr->kind);
    uint64_t bytes = 0;
    if (mm_wire_payload_bytes((enum mm_wire_format)hdr->format, hdr->n_rows, hdr->row_dim,
                              &bytes) != MM_OK)
        return mm_errf(err, MM_EPROTO, "frame format %u with %u rows x %u is invalid",
                       hdr->format, hdr->n_rows, hdr->row_dim);
    if (bytes != hdr->payload_bytes)
        return mm_errf(err, MM_EPROTO, "frame payload_bytes %llu, but %s %u x %u needs %llu",
                       (unsigned long long)hdr->payload_bytes, mm_wire_format_name(hdr->format),
                       hdr->n_rows, hdr->row_dim, (unsigned long long)bytes);
    return MM_OK;
}

const char *mm_wire_kind_name(uint32_t kind) {
    switch (kind) {
    case MM_WIRE_ROWS: return "rows";
    case MM_WIRE_REPLY: return "reply";
    case MM_WIRE_PING: return "ping";
    case MM_WIRE_PONG: return "pong";
    case MM_WIRE_ERROR: return "error";
    case MM_WIRE_CTRL: return "ctrl";
    case MM_WIRE_HELLO: return "hello";
    case MM_WIRE_BYE: return "bye";
    default: return "?";
    }
}

const char *mm_wire_format_name(uint32_t format) {
    switch (format) {
    case MM_WIRE_BYTES: return "bytes";
    case MM_WIRE_F32: return "f32";
    case MM_WIRE_BF16: return "bf16";
    case MM_WIRE_Q8_32: return "q8_32";
    case MM_WIRE_I32: return "i32";
    default: return "?";
    }
}
