/* compressed-tensors pack-quantized INT4 in C: the nibble layout and the fp32 / bf16 bit operations around it.
   Included by both C extensions: kvq/compress/_int4.c packs, kvq/runtime/kernels/cpu/_linear.c unpacks.
   The Python side of the same format is kvq/formats/pack_quantized.py. Needs only the C standard library.

   Layout: q in [-8, 7] is stored as the nibble q + 8; two nibbles to a byte, the low nibble first, so
   nibble j of a little-endian int32 word of weight_packed is element 8 * word + j. */

#ifndef KVQ_PACK_QUANTIZED_H
#define KVQ_PACK_QUANTIZED_H

#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Round a finite fp32 (as bits) to the nearest bfloat16, ties to even, as the upper 16 bits of an fp32. */
static inline uint32_t bf16_round_bits(uint32_t u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u; }

/* One byte of weight_packed from two nibbles (q + 8 each, 0..15): `low` is the earlier element. */
static inline uint8_t int4_pack_byte(uint32_t low, uint32_t high) { return (uint8_t)(low | (high << 4)); }

/* q (-8..7) of nibble j (0..7) of a weight_packed word. */
static inline int int4_unpack(uint32_t word, int j) { return (int)((word >> (4 * j)) & 15u) - 8; }

#endif
