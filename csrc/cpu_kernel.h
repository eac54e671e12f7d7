/* cpu_kernel.h -- the CPU backend's building blocks, shared by its forward (cpu_attn.c) and backward (cpu_bwd.c):
 * element conversion, 8-lane float vectors (GCC vector extensions, AVX2 with -march=native), a vector exp2, and
 * one register-blocked GEMM micro-kernel (MR x NR tiles, 12 vector accumulators) whose right-hand operand is read
 * row by row, packed in strips of NR columns (or row-major), and whose left-hand operand may be row-major or
 * transposed.  Static inline: each including file gets
 * its own copy, specialised by the compiler. */
#ifndef FATTN_CPU_KERNEL_H
#define FATTN_CPU_KERNEL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fattn.h"
#include "half.h"

typedef float v8f __attribute__((vector_size(32), aligned(32)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(32)));

#define MR 6  /* micro-tile rows */
#define NR 16 /* micro-tile columns: two v8f */

static inline float load_elem(const void *base, int64_t i, fattn_dtype dt) {
    switch (dt) {
    case FATTN_F16: return fattn_f16_to_f32(((const uint16_t *)base)[i]);
    case FATTN_BF16: return fattn_bf16_to_f32(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

static inline void store_elem(void *base, int64_t i, float x, fattn_dtype dt) {
    switch (dt) {
    case FATTN_F16: ((uint16_t *)base)[i] = fattn_f32_to_f16(x); break;
    case FATTN_BF16: ((uint16_t *)base)[i] = fattn_f32_to_bf16(x); break;
    default: ((float *)base)[i] = x;
    }
}

/* exp2 of 8 lanes: 2^floor(x) * poly(frac) (degree-6 fit, relative error ~1e-7); exactly 0 below -126 (and
 * for -inf); NaN stays NaN. */
static inline v8f exp2_v8(v8f x) {
    v8i under = x < -126.f;                  /* lanes -> 0 */
    v8f xc = x;
    v8i clamp_lo = xc < -126.f, clamp_hi = xc > 127.f;
    xc = (v8f)((clamp_lo & (v8i)((v8f){0} - 126.f)) | (~clamp_lo & (v8i)xc));
    xc = (v8f)((clamp_hi & (v8i)((v8f){0} + 127.f)) | (~clamp_hi & (v8i)xc));
    v8i t = __builtin_convertvector(xc, v8i); /* truncation toward zero */
    v8f fl = __builtin_convertvector(t, v8f);
    v8i neg = fl > xc;                        /* negative non-integers: floor = trunc - 1 */
    t += neg;                                 /* neg lanes are -1 */
    fl = __builtin_convertvector(t, v8f);
    v8f f = xc - fl; /* [0, 1) */
    v8f p = f * 2.168343130e-04f + 1.243794637e-03f;
    p = p * f + 9.679985256e-03f;
    p = p * f + 5.548215028e-02f;
    p = p * f + 2.402303083e-01f;
    p = p * f + 6.931469140e-01f;
    p = p * f + 1.000000004e+00f;
    v8i e = (t + 127) << 23;
    v8f r = p * (v8f)e;
    r = (v8f)(~under & (v8i)r);
    v8i nan = x != x; /* NaN stays NaN */
    return (v8f)((nan & (v8i)x) | (~nan & (v8i)r));
}

static inline v8f loadv(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static inline void storev(float *p, v8f v) { memcpy(p, &v, 32); }

/* tanh of 8 lanes, relative error ~2e-7 everywhere: below |x| = 0.5 its odd Taylor series through x^13 (the next
 * term is < 5e-8 of tanh there), else 1 - 2 / (e^2x + 1) (absolute error ~1e-7, +-1 for large |x|), whose absolute
 * error alone would be a large relative one near 0 -- a softcap c scales it to c * 1e-7 in the scores. */
static inline v8f tanh_v8(v8f x) {
    const v8f x2 = x * x;
    v8f p = x2 * (21844.f / 6081075.f) - 1382.f / 155925.f;
    p = p * x2 + 62.f / 2835.f;
    p = p * x2 - 17.f / 315.f;
    p = p * x2 + 2.f / 15.f;
    p = p * x2 - 1.f / 3.f;
    p = x + x * x2 * p;
    const v8f e = 1.f - 2.f / (exp2_v8(x * (2.f * FATTN_LOG2E)) + 1.f);
    const v8i small = x2 < 0.25f;
    return (v8f)((small & (v8i)p) | (~small & (v8i)e));
}

/* The softcap on rows [0, rows) of an ld-strided score tile (n columns, a multiple of 8), in the tile's units: s ->
 * cap tanh(s / cap).  t (NULL: not kept): the tanh values, same layout, for the backward's chain rule. */
static __attribute__((unused, noinline)) void softcap_rows(float *s, int64_t ld, int rows, int64_t n, float cap,
                                                         float *t) {
    const float inv = 1.f / cap;
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c += 8) {
            const v8f th = tanh_v8(loadv(s + r * ld + c) * inv);
            storev(s + r * ld + c, th * cap);
            if (t) storev(t + r * ld + c, th);
        }
}

/* ALiBi on rows [0, rows) of an ld-strided score tile (n columns) in log2 units: row r, at position pos0 + r, and
 * column c, key j0 + c, gain fattn_alibi_bias2(slope2, pos0 + r, j0 + c). */
static __attribute__((unused, noinline)) void alibi_rows(float *s, int64_t ld, int rows, int64_t n, float slope2,
                                                       int64_t pos0, int64_t j0) {
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) s[r * ld + c] += fattn_alibi_bias2(slope2, pos0 + r, j0 + c);
}

/* max(m, s[0:n]) for n a multiple of 8; -inf entries (masked) never win, a NaN entry makes the result NaN. */
static inline float row_max(const float *s, int64_t n, float m) {
    v8f mx = (v8f){0} + m;
    v8i nan = {0};
    for (int64_t c = 0; c < n; c += 8) {
        const v8f x = loadv(s + c);
        nan |= x != x;
        mx = (v8f)(((v8i)(x > mx) & (v8i)x) | (~(v8i)(x > mx) & (v8i)mx));
    }
    float r = m;
    int any_nan = 0;
    for (int i = 0; i < 8; i++) {
        r = mx[i] > r ? mx[i] : r;
        any_nan |= nan[i];
    }
    return any_nan ? NAN : r;
}

/* The right-hand operand B of the micro-kernel: element (k, j) at B[(j / NR) * strip + k * ld + j % NR].  Row-major
 * is ld = row length, strip = NR; packed in strips of NR columns (each strip's kdim x NR block contiguous, read
 * linearly by the kernel) is ld = NR, strip = kdim * NR. */

/* C[r][0:n] (+)= sum_k A(r, k) * B(k, 0:n) for r < R, with A(r, k) = A[r * a_rs + k * a_ks]: R x NR register tiles.
 * R and A's strides are constants after inlining, so each remainder height and each A layout (row-major: a_ks = 1;
 * transposed: a_rs = 1) gets its own fully unrolled kernel. */
static inline __attribute__((always_inline)) void gemm_tile(const float *A, int64_t a_rs, int64_t a_ks, const float *B,
                                                            int64_t ldb, int64_t bstrip, float *C, int64_t ldc, int R,
                                                            int n, int kdim, int accumulate) {
    for (int j = 0; j < n; j += NR) {
        const float *b = B + (j / NR) * bstrip;
        v8f c[MR][2];
        for (int r = 0; r < R; r++) {
            c[r][0] = accumulate ? loadv(C + r * ldc + j) : (v8f){0};
            c[r][1] = accumulate ? loadv(C + r * ldc + j + 8) : (v8f){0};
        }
        for (int k = 0; k < kdim; k++) {
            const v8f b0 = loadv(b + k * ldb), b1 = loadv(b + k * ldb + 8);
            for (int r = 0; r < R; r++) {
                const float a = A[r * a_rs + k * a_ks];
                c[r][0] += a * b0;
                c[r][1] += a * b1;
            }
        }
        for (int r = 0; r < R; r++) {
            storev(C + r * ldc + j, c[r][0]);
            storev(C + r * ldc + j + 8, c[r][1]);
        }
    }
}

/* Every row of C in tiles of MR, then one remainder tile of constant height. */
static inline __attribute__((always_inline)) void gemm_all_rows(const float *A, int64_t a_rs, int64_t a_ks,
                                                                const float *B, int64_t ldb, int64_t bstrip, float *C,
                                                                int64_t ldc, int rows, int n, int kdim, int accumulate) {
    int m = 0;
    for (; m + MR <= rows; m += MR)
        gemm_tile(A + m * a_rs, a_rs, a_ks, B, ldb, bstrip, C + m * ldc, ldc, MR, n, kdim, accumulate);
    const float *a = A + m * a_rs;
    float *c = C + m * ldc;
    switch (rows - m) {
    case 5: gemm_tile(a, a_rs, a_ks, B, ldb, bstrip, c, ldc, 5, n, kdim, accumulate); break;
    case 4: gemm_tile(a, a_rs, a_ks, B, ldb, bstrip, c, ldc, 4, n, kdim, accumulate); break;
    case 3: gemm_tile(a, a_rs, a_ks, B, ldb, bstrip, c, ldc, 3, n, kdim, accumulate); break;
    case 2: gemm_tile(a, a_rs, a_ks, B, ldb, bstrip, c, ldc, 2, n, kdim, accumulate); break;
    case 1: gemm_tile(a, a_rs, a_ks, B, ldb, bstrip, c, ldc, 1, n, kdim, accumulate); break;
    default: break;
    }
}

/* C[m][0:n] (+)= sum_k A[m][k] * B(k, 0:n) for m < rows: A row-major (lda), B packed in strips (kdim x NR each,
 * strips bstrip floats apart); n a multiple of NR; C row-major.  Never inlined: inlined into its callers' loops the
 * micro-kernel lost a third of its speed (the CPU forward ran 0.6x on 2 AVX2 cores, gcc -O3). */
static __attribute__((unused, noinline)) void gemm_rows(const float *A, int64_t lda, const float *B, int64_t bstrip, float *C,
                                              int64_t ldc, int rows, int n, int kdim, int accumulate) {
    gemm_all_rows(A, lda, 1, B, NR, bstrip, C, ldc, rows, n, kdim, accumulate);
}

/* C[m][0:n] (+)= sum_k At[k][m] * B[k][0:n]: A transposed (At row-major, row stride ldat), B row-major (ldb). */
static __attribute__((unused, noinline)) void gemm_rows_t(const float *At, int64_t ldat, const float *B, int64_t ldb, float *C,
                                                int64_t ldc, int rows, int n, int kdim, int accumulate) {
    gemm_all_rows(At, 1, ldat, B, ldb, NR, C, ldc, rows, n, kdim, accumulate);
}

/* Packed-strip offset of element (k, j) of a kdim-row operand. */
static inline int64_t strip_at(int64_t k, int64_t j, int64_t kdim) { return (j / NR) * kdim * NR + k * NR + j % NR; }

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* n floats, 64-byte aligned (NULL when out of memory, or when n floats would not fit a size_t); free() releases
 * them. */
static inline void *alloc_floats(int64_t n) {
    if (n > (int64_t)((SIZE_MAX - 128) / 4) || n > (INT64_MAX - 128) / 4) return NULL;
    return aligned_alloc(64, (size_t)round_up(n > 0 ? n * 4 : 4, 64));
}

/* rows x cols floats, as alloc_floats (NULL where the product overflows). */
static inline void *alloc_floats2(int64_t rows, int64_t cols) {
    if (rows < 0 || cols < 0 || (cols && rows > INT64_MAX / cols)) return NULL;
    return alloc_floats(rows * cols);
}

/* Key rows [j0, j0 + n) of one head of K or V (`src`, the head's offset `base`, its batch / page and row strides;
 * rows found by fattn_key_offset, so through the block table of a paged cache), s->d columns, converted to float32
 * in blocks of bc rows (block 0: rows [j0, j0 + bc)), each block in the micro-kernel's strips:
 *   t (NULL: not made): the block transposed, dp x bc (a right-hand operand over the head dim: S = Q K^T)
 *   r (NULL: not made): the block as it is, bc x dp (a right-hand operand over the rows: P V, dS K)
 * Padding rows and columns are zero. */
static inline void pack_rows(const attn_params *s, const void *src, int64_t base, int64_t stride_b, int64_t stride_s,
                             int64_t j0, int64_t n, int64_t bc, float *t, float *r) {
    const int64_t d = s->d, dp = round_up(d, NR), nkb = (n + bc - 1) / bc;
    if (t) memset(t, 0, sizeof(float) * nkb * dp * bc);
    if (r) memset(r, 0, sizeof(float) * nkb * bc * dp);
    for (int64_t j = 0; j < n; j++) {
        const int64_t blk = (j / bc) * dp * bc, c = j % bc, o = base + fattn_key_offset(s, j0 + j, stride_b, stride_s);
        for (int64_t e = 0; e < d; e++) {
            const float x = load_elem(src, o + e, s->dtype);
            if (t) t[blk + strip_at(e, c, dp)] = x;
            if (r) r[blk + strip_at(c, e, bc)] = x;
        }
    }
}

#endif
