/* half.h -- IEEE half and bfloat16 <-> float conversion on the CPU, round to nearest even. */
#ifndef FATTN_HALF_H
#define FATTN_HALF_H

#include <stdint.h>
#include <string.h>

static inline float fattn_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fattn_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float fattn_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return fattn_bits_to_f32(sign | 0x7f800000u | (man << 13));      /* inf, nan */
    if (exp != 0) return fattn_bits_to_f32(sign | ((exp + 112) << 23) | (man << 13)); /* normal */
    /* zero or subnormal: man * 2^-24 */
    float f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
}

static inline uint16_t fattn_f32_to_f16(float f) {
    uint32_t u = fattn_f32_to_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0)); /* inf, nan */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);                /* rounds past 65504: inf */
    if (a < 0x38800000u) {                                                 /* below 2^-14: subnormal */
        float s = fattn_bits_to_f32(a) * 16777216.0f;                      /* units of 2^-24 */
        uint32_t m = (uint32_t)s;
        float rem = s - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1); /* round to nearest even on the 13 dropped bits */
    return (uint16_t)(sign | (((r >> 13) - (112u << 10)) & 0x7fff));
}

static inline float fattn_bf16_to_f32(uint16_t h) { return fattn_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t fattn_f32_to_bf16(float f) {
    uint32_t u = fattn_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet nan */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

#endif
