// SPDX-License-Identifier: MIT
// Element types of tensors (weights on disk, activations, wire payloads) and the scalar
// conversions every backend agrees on. bf16 -> f32 is exact (a shift); f32 -> bf16 rounds to
// nearest even, as torch does.
#ifndef MM_DTYPE_H
#define MM_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum mm_dtype {
    MM_DTYPE_F32 = 0,
    MM_DTYPE_F16,
    MM_DTYPE_BF16,
    MM_DTYPE_F8_E4M3, // read as data only: no op computes with it yet
    MM_DTYPE_F8_E5M2,
    MM_DTYPE_F64,
    MM_DTYPE_I64,
    MM_DTYPE_I32,
    MM_DTYPE_I16,
    MM_DTYPE_I8,
    MM_DTYPE_U8,
    MM_DTYPE_BOOL,
    MM_DTYPE_COUNT
};

// mm_dtype_size returns the bytes of one element (0 for an out-of-range value).
size_t mm_dtype_size(enum mm_dtype t);
// mm_dtype_name returns the safetensors spelling ("BF16"); "?" for an out-of-range value.
const char *mm_dtype_name(enum mm_dtype t);
// mm_dtype_parse maps a safetensors dtype string to *out; returns 0 on success, -1 if unknown.
int mm_dtype_parse(const char *s, enum mm_dtype *out);

static inline float mm_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t mm_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) // NaN: keep it a NaN
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float mm_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { // subnormal: normalise
            exp = 127 - 15 + 1;
            while ((man & 0x400u) == 0) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ffu;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp - 15 + 127) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
