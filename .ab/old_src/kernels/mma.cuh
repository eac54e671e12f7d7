/* mma.cuh -- sm_80+ building blocks in inline PTX: cp.async, ldmatrix, mma.sync m16n8k16, fast exp2 (and on it the
 * sinks' rule for an epilogue).
 *
 * Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4), used by every tensor-core kernel:
 *   A 16x16 (row-major), 4 x b32:  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
 *   B 16x8  (k x n),     2 x b32:  b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
 *   C 16x8  float,       4 x f32:  c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1)
 * Two C tiles side by side (columns 0-7 and 8-15) hold exactly one A fragment's elements, which is how
 * P = exp2(S - m) feeds O += P V without leaving registers.
 */
#ifndef FATTN_MMA_CUH
#define FATTN_MMA_CUH

#include "common.cuh"

/* 16-byte global -> shared copy; src_bytes = 0 fills the 16 bytes with zeros and reads nothing. */
DEV void cp_async_16(void *smem, const void *gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8 (a shared-space byte address). */
DEV unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
DEV void ldmatrix_x4(unsigned r[4], unsigned s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
DEV void ldmatrix_x4_trans(unsigned r[4], unsigned s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
DEV void ldmatrix_x4(unsigned r[4], const void *smem) { ldmatrix_x4(r, smem_u32(smem)); }
DEV void ldmatrix_x4_trans(unsigned r[4], const void *smem) { ldmatrix_x4_trans(r, smem_u32(smem)); }

/* c += a * b, 16x8x16, float accumulators; element type chosen by overload. */
DEV void mma_16816(float c[4], const unsigned a[4], const unsigned b[2], __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
DEV void mma_16816(float c[4], const unsigned a[4], const unsigned b[2], __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Two floats -> one b32 of two 16-bit elements (low half = x). */
DEV unsigned pack2(float x, float y, __half) {
    __half2 h = __floats2half2_rn(x, y);
    return *(unsigned *)&h;
}
DEV unsigned pack2(float x, float y, __nv_bfloat16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *(unsigned *)&h;
}

/* 2^x on the special-function unit; exp2(-inf) = 0. */
DEV float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Attention sinks in an epilogue: a row's LSE and O's factor 1 / l, given the sink's logit, all in log2 units,
 * become csrc/sinks.h's LSE' = log(e^LSE + e^s) and 1 / l * e^(LSE - LSE') (a row that saw no key: LSE' = s, O' = 0)
 * -- the rule the sinks pass applies after other kernels, here on the special-function unit (three operations).  The
 * order is chosen by a comparison, as the pass's is, not by fmaxf / fminf, which would drop a NaN sink or LSE. */
DEV void sink_join2(float sink2, float *lse2, float *inv) {
    const bool none = *lse2 == -INFINITY, lse_wins = *lse2 > sink2;
    const float hi = lse_wins ? *lse2 : sink2, lo = lse_wins ? sink2 : *lse2;
    const float joined = none ? sink2 : hi + __log2f(1.f + fast_exp2(lo - hi));
    *inv = none ? 0.f : *inv * fast_exp2(*lse2 - joined);
    *lse2 = joined;
}

/* tanh(x) on the special-function unit (tanh.approx.f32, sm_75+: relative error below 2^-10.98, fp16's own
 * rounding).  The softcap's cost: in an interleaved A/B on the H100 (evidence/serving/h100_score_mods_1c7ea64.md)
 * it ran v2's softcap forward at 1.20-1.32x the plain call's time, against 1.76-2.50x for 1 - 2 / (2^(2x log2 e) + 1)
 * (two MUFU operations), with the same tests passing. */
DEV float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* max / sum over the 4 lanes of a quad (the lanes holding one accumulator row) */
DEV float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
DEV float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

#endif
