/* v3_bwd.cu -- version 3's backward: Hopper (sm_90a).  Its dK/dV kernel, what it adds and how fast it is:
 * v3_bwd_kernel.cuh (head dim 256: v3_bwd_wide.cu); the prep and convert passes around it: bwd_common.cuh,
 * v3_bwd_convert.cuh.  Here, the host side: the kernels compiled ahead of time as a table, their shared-memory
 * limits, and the launcher (tensor maps, prep, the dK/dV kernel of the plan's config, convert).  The planner is
 * v3_bwd_plan.c. */
#include <string.h>

#include "../../csrc/variants.h"
#include "v3_bwd_kernel.cuh"
#include "v3_tma.h"

/* Zero-ahead's rule (its kernels: v3_bwd_kernel.cuh, V3B_ZERO_AHEAD; the fill: v3_bwd_ring.cuh, v3b_zero).  Calls
 * with Sk up to V3B_ZERO_AHEAD_SK_MAX -- 2048, and 4096 at head dim 256, whose kernel ran no slower with it (4k on
 * an H100: 1.021 / 1.023x, non-causal / causal; D=128 at 4k read 0.96-0.99x) -- where a block's share of the fill is
 * at most V3B_ZERO_SHARE_MAX bytes (the fa3 grid's: 68-80 KB; a block's 64 threads fill far slower than bwd_prep's
 * whole grid, so a large share -- many query rows or heads per key block -- would hold up the adds that wait for
 * it).  V3B_ZERO_LEAD: the lead, in blocks of the grid, of a group's zeroers over its own first block; on an H100
 * (32,16,512,128 .. 4,16,4096,128, kernel times) 16, 32 and 64 blocks ran within 0.7% of each other, and a lead of a
 * whole wave (132 blocks) 0.2-1.7% slower than 32 (evidence/backward/h100_v3_bwd_zero_ahead_*.md). */
#define V3B_ZERO_AHEAD_SK_MAX(dp) ((dp) == 256 ? 4096 : 2048)
#define V3B_ZERO_SHARE_MAX (256 << 10)
#define V3B_ZERO_LEAD 32

/* The kinds of dK/dV kernel a config has: plain, with score mods (a softcap, ALiBi: MODS), for packed batches (SEQ),
 * both: kind = 2 seq + mods. */
enum { V3B_PLAIN, V3B_MODS, V3B_SEQ, V3B_SEQ_MODS, V3B_KINDS };

typedef struct {
    /* dkdv[kind][deterministic][fp16, bf16] (NULL: not compiled; the wide row's come from v3_bwd_wide.cu);
     * dkdv_za[fp16, bf16]: default mode's plain kernels with zero-ahead (V3B_ZERO_AHEAD's head dims, else NULL);
     * dkdv_out[deterministic][fp16, bf16]: the plain kernels adding dQ straight into dQ (V3_BWD_DQ_OUT's configs,
     * else NULL; the wide row's come from v3_bwd_wide.cu);
     * convert[seq][fp16, bf16] */
    const void *dkdv[V3B_KINDS][2][2], *dkdv_za[2], *dkdv_out[2][2], *prep[2], *convert[2][2];
    int dp, br, bc, stages;
    size_t smem;
} v3_bwd_row;

/* The zero-ahead kernel of a row (NULL where V3B_ZERO_AHEAD does not build one) */
template <typename T, int DP, int BR, int BC, int ST> static const void *v3b_za_kernel() {
    if constexpr (V3B_ZERO_AHEAD(DP)) return (const void *)v3_bwd_dkdv<T, DP, BR, BC, ST, false, false, false, true>;
    else return NULL;
}
/* A dQ-out kernel of a row (NULL where V3_BWD_DQ_OUT does not build one) */
template <typename T, int DP, int BR, int BC, int ST, bool DET> static const void *v3b_out_kernel() {
    if constexpr (V3_BWD_DQ_OUT(DP, BR))
        return (const void *)v3_bwd_dkdv<T, DP, BR, BC, ST, DET, false, false, false, true>;
    else return NULL;
}
#define V3B_OUT_PAIR(dp, br, bc, st, det)                                                                         \
    {v3b_out_kernel<__half, dp, br, bc, st, det>(), v3b_out_kernel<__nv_bfloat16, dp, br, bc, st, det>()}
#define V3B_ZA_PAIR(dp, br, bc, st)                                                                               \
    {v3b_za_kernel<__half, dp, br, bc, st>(), v3b_za_kernel<__nv_bfloat16, dp, br, bc, st>()}
#define V3B_PAIR(kernel, ...)                                                                                    \
    {(const void *)kernel<__half, __VA_ARGS__>, (const void *)kernel<__nv_bfloat16, __VA_ARGS__>}
#define V3B_MODS_PAIR(mods, dp, br, bc, st, det, seq)                                                             \
    {(const void *)(mods ? v3_bwd_dkdv<__half, dp, br, bc, st, det, mods, seq> : NULL),                          \
     (const void *)(mods ? v3_bwd_dkdv<__nv_bfloat16, dp, br, bc, st, det, mods, seq> : NULL)}
#define V3B_KIND(dp, br, bc, st, mods, seq)                                                                       \
    {V3B_PAIR(v3_bwd_dkdv, dp, br, bc, st, false, mods, seq), V3B_PAIR(v3_bwd_dkdv, dp, br, bc, st, true, mods, seq)}
#define V3B_CONVERTS(dp) {V3B_PAIR(v3_bwd_convert, dp, false), V3B_PAIR(v3_bwd_convert, dp, true)}
#define V3B_ROW(dp, br, bc, st, mods)                                                                             \
    {{V3B_KIND(dp, br, bc, st, false, false),                                                                     \
      {V3B_MODS_PAIR(mods, dp, br, bc, st, false, false), V3B_MODS_PAIR(mods, dp, br, bc, st, true, false)},       \
      V3B_KIND(dp, br, bc, st, false, true),                                                                      \
      {V3B_MODS_PAIR(mods, dp, br, bc, st, false, true), V3B_MODS_PAIR(mods, dp, br, bc, st, true, true)}},         \
     V3B_ZA_PAIR(dp, br, bc, st), {V3B_OUT_PAIR(dp, br, bc, st, false), V3B_OUT_PAIR(dp, br, bc, st, true)},     \
     V3B_PAIR(bwd_prep, dp), V3B_CONVERTS(dp), dp, br, bc, st, V3_BWD_SMEM(dp, br, bc, st)},
#define V3B_WIDE_ROW(dp, br, bc, st, mods)                                                                        \
    {{{{NULL, NULL}, {NULL, NULL}}}, {NULL, NULL}, {{NULL, NULL}, {NULL, NULL}}, V3B_PAIR(bwd_prep, dp),            \
     V3B_CONVERTS(dp), dp, br, bc, st, V3_BWD_SMEM(dp, br, bc, st)},
/* V3_BWD_PLAIN_CONFIGS: the plain kernels (default and deterministic mode) and the dQ^T convert only */
#define V3B_PLAIN_ROW(dp, br, bc, st, mods)                                                                       \
    {{V3B_KIND(dp, br, bc, st, false, false)}, V3B_ZA_PAIR(dp, br, bc, st), {{NULL, NULL}, {NULL, NULL}},         \
     V3B_PAIR(bwd_prep, dp), {V3B_PAIR(v3_bwd_convert_t, br), {NULL, NULL}}, dp, br, bc, st,                    \
     V3_BWD_SMEM(dp, br, bc, st)},
static const v3_bwd_row v3_bwd_rows[V3_BWD_NCONFIGS] = {
    V3_BWD_NARROW_CONFIGS(V3B_ROW) V3_BWD_WIDE_CONFIGS(V3B_WIDE_ROW) V3_BWD_PLAIN_CONFIGS(V3B_PLAIN_ROW)};
#undef V3B_PLAIN_ROW
#undef V3B_WIDE_ROW
#undef V3B_ROW
#undef V3B_CONVERTS
#undef V3B_KIND
#undef V3B_MODS_PAIR
#undef V3B_PAIR
#undef V3B_ZA_PAIR
#undef V3B_OUT_PAIR

/* v3_bwd_wide.cu: kind as above; its zero-ahead and dQ-out kernels */
extern "C" const void *fattn_v3_bwd_wide_kernel(int br, int bc, int stages, int kind, int det, int bf16);
extern "C" const void *fattn_v3_bwd_wide_za_kernel(int br, int bc, int stages, int bf16);
extern "C" const void *fattn_v3_bwd_wide_out_kernel(int br, int bc, int stages, int det, int bf16);

/* Row r's dK/dV kernel of a kind, deterministic or not, fp16 (ti 0) or bf16 (1). */
static const void *v3_bwd_dkdv_kernel(const v3_bwd_row *r, int kind, int det, int ti) {
    return r->dp == 256 ? fattn_v3_bwd_wide_kernel(r->br, r->bc, r->stages, kind, det, ti) : r->dkdv[kind][det][ti];
}
/* Row r's zero-ahead kernel, or NULL. */
static const void *v3_bwd_za_kernel(const v3_bwd_row *r, int ti) {
    return r->dp == 256 ? fattn_v3_bwd_wide_za_kernel(r->br, r->bc, r->stages, ti) : r->dkdv_za[ti];
}
/* Row r's dQ-out kernel, deterministic or not, or NULL. */
static const void *v3_bwd_out_kernel(const v3_bwd_row *r, int det, int ti) {
    return r->dp == 256 ? fattn_v3_bwd_wide_out_kernel(r->br, r->bc, r->stages, det, ti) : r->dkdv_out[det][ti];
}

extern "C" fattn_status fattn_prepare_bwd_v3(int device) {
    (void)device;
    for (int i = 0; i < V3_BWD_NCONFIGS; i++)
        for (int t = 0; t < 2; t++)
            for (int k = 0; k <= 2 * V3B_KINDS + 2; k++) { /* kind, deterministic; zero-ahead; dQ out, each mode */
                const void *kern = k < 2 * V3B_KINDS    ? v3_bwd_dkdv_kernel(&v3_bwd_rows[i], k >> 1, k & 1, t)
                                   : k == 2 * V3B_KINDS ? v3_bwd_za_kernel(&v3_bwd_rows[i], t)
                                                        : v3_bwd_out_kernel(&v3_bwd_rows[i], k - 2 * V3B_KINDS - 1, t);
                if (kern)
                    FATTN_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                          (int)v3_bwd_rows[i].smem));
            }
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_bwd_v3(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    if (plan->config < 0 || plan->config >= V3_BWD_NCONFIGS)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v3 backward: no config %d", plan->config);
    const v3_bwd_row *r = &v3_bwd_rows[plan->config];
    const attn_params *f = &p->fwd;
    if (p->ws_cols != r->dp || p->ws_rows < f->sq || p->ws_rows % 128 || !p->dq_accum || !p->dpsum || !p->lse2 ||
        !p->dq_sem)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v3 backward: the workspace is not laid out for config %d", plan->config);
    fattn_status st = v3_tma_ready();
    if (st) return st;
    /* Sq, Sk > 0 (the planner's rule: an empty side may have no address for a tensor map), so every grid is
     * non-empty */
    /* A packed batch (cu_seqlens): one batch of all the rows (total_q / total_k), a sequence found by its first row */
    const int seq = f->cu_seqlens_q != NULL;
    const int64_t rq = seq ? f->total_q : f->sq, rk = seq ? f->total_k : f->sk, nb = seq ? 1 : f->b;
    CUtensorMap tq, tk, tv, tdo, tdq;
    memset(&tdq, 0, sizeof tdq); /* a kernel argument even where no kernel reads it */
    if ((st = v3_map(&tq, f->q, f->dtype, f->d, rq, f->h, nb, f->q_stride_s, f->q_stride_h, f->q_stride_b, r->br,
                     "q")) ||
        (st = v3_map(&tdo, p->dout, f->dtype, f->d, rq, f->h, nb, p->do_stride_s, p->do_stride_h, p->do_stride_b,
                     r->br, "dout")) ||
        (st = v3_map(&tk, f->k, f->dtype, f->d, rk, f->h_kv, nb, f->k_stride_s, f->k_stride_h, f->k_stride_b, r->bc,
                     "k")) ||
        (st = v3_map(&tv, f->v, f->dtype, f->d, rk, f->h_kv, nb, f->v_stride_s, f->v_stride_h, f->v_stride_b, r->bc,
                     "v")))
        return st;
    const int ti = f->dtype - FATTN_F16, rpb = 256 / (r->dp / 8); /* rows per block of prep / convert */
    const cudaStream_t s = (cudaStream_t)stream;
    const int64_t prep_blocks = (f->b * f->h * p->ws_rows + rpb - 1) / rpb;
    const int64_t dq_rows = V3_BWD_DQ_ROWS(r->br); /* a convert block's rows */
    const int64_t conv_blocks = f->b * f->h * ((f->sq + dq_rows - 1) / dq_rows) * (r->dp / 64);
    if (prep_blocks > 0x7fffffff || conv_blocks > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 backward: too many rows for one grid");
    const int kind = 2 * seq + fattn_score_mods(f);
    const void *dkdv = v3_bwd_dkdv_kernel(r, kind, p->deterministic != 0, ti);
    if (!dkdv) /* (the planner sends such calls to v2) */
        return FATTN_FAIL(FATTN_ERR_INVALID, "v3 backward: config %d has no kernel for this call", plan->config);
    /* dQ out (v3_bwd_configs.h: V3_BWD_DQ_OUT, the planner's rule): bwd_prep zeroes dQ, the kernel adds into it,
     * no convert */
    const int64_t nkb = (f->sk + r->bc - 1) / r->bc, groups = f->b * f->h_kv;
    const void *out_kernel = v3_bwd_out_kernel(r, p->deterministic != 0, ti);
    const int dq_out = fattn_v3_bwd_dq_out(p, plan->config) && out_kernel;
    if (dq_out && r->dp != 256 && /* (the wide kernel adds from registers) */
        (st = v3_map(&tdq, p->dq, f->dtype, f->d, rq, f->h, nb, p->dq_stride_s, p->dq_stride_h, p->dq_stride_b, 64,
                     "dq")))
        return st;
    /* deterministic: each tile's first add is a store, dq_accum not zeroed; dQ out: dQ zeroed, both modes */
    int prep_flags = (dq_out ? BWD_PREP_ZERO_DQ_OUT : p->deterministic ? 0 : BWD_PREP_ZERO_DQ) |
                     (V3_BWD_LSE_V3_ORDER(r->dp, r->br) ? BWD_PREP_V3_ORDER : 0) |
                     (V3_BWD_DQ_ROWS(r->br) == FATTN_BWD_STEP_ROWS ? BWD_PREP_STEP_ROWS : 0);
    /* Zero-ahead (default mode's plain calls on dense batches, V3B_ZERO_AHEAD's head dims, Sk up to
     * V3B_ZERO_AHEAD_SK_MAX(dp), a block's share up to V3B_ZERO_SHARE_MAX): groups (b, kv head) from `ahead` on are
     * zeroed by the dK/dV kernel, those below by prep.  ahead: the groups of V3B_ZERO_LEAD blocks, plus one. */
    int zero_ahead = 0;
    const void *za = v3_bwd_za_kernel(r, ti);
    if (!dq_out && !p->deterministic && kind == V3B_PLAIN && za && f->sk <= V3B_ZERO_AHEAD_SK_MAX(r->dp) &&
        p->ws_rows * r->dp / 4 < INT32_MAX && f->h_per_kv * p->ws_rows * r->dp * 4 / nkb <= V3B_ZERO_SHARE_MAX) {
        const int64_t ahead = (V3B_ZERO_LEAD + nkb - 1) / nkb + 1;
        zero_ahead = ahead < groups ? (int)ahead : 0;
    }
    if (zero_ahead) dkdv = za;
    if (dq_out) dkdv = out_kernel;
    const int64_t zero_heads = (zero_ahead ? zero_ahead : groups) * f->h_per_kv;
    void *pargs[] = {(void *)p, (void *)&prep_flags, (void *)&zero_heads};
    FATTN_CUDA_CHECK(cudaLaunchKernel(r->prep[ti], dim3((unsigned)prep_blocks), dim3(256), pargs, 0, s));
    /* Deterministic mode without a mask, a dense batch (v3_bwd_ring.cuh: V3B_STAGGER_*): whole heads staggered
     * (v3b_stagger_turn) where a head's key blocks fit in half the multiprocessors, so that they can all run at once
     * beside work on other streams, in the kernels of V3B_STAGGERS -- on an H100 1.07-1.17x faster at D = 64 (S =
     * 512 .. 8k, 88a1dbe), 1.06-1.10x at 256 (1k .. 4k, 7c1aabb), at 128 0.95-1.03x (1eb5bb2, so not there) but
     * with dQ out 1.046x (evidence/backward/h100_v3_bwd_stagger_88a1dbe.md, h100_v3_bwd_dq_out_causal_*.md); else
     * the wide kernel's chunks where a chunk fits so. */
    const int64_t room = plan->dev.sm_count / 2;
    int stagger = V3B_STAGGER_NONE;
    if (p->deterministic && !seq && f->mask.left < 0 && f->mask.right < 0)
        stagger = V3B_STAGGERS(r->dp, r->br, dq_out) && nkb <= room ? V3B_STAGGER_HEADS
                  : r->dp == 256 && V3B_DET_CHUNK <= room ? V3B_STAGGER_CHUNKS
                                                          : V3B_STAGGER_NONE;
    /* (the wide kernels take the first seven: no tm_dq) */
    void *args[] = {&tq, &tk, &tv, &tdo, (void *)p, &stagger, &zero_ahead, &tdq};
    FATTN_CUDA_CHECK(cudaLaunchKernel(dkdv, dim3(plan->grid_x), dim3(plan->threads), args, plan->smem, s));
    /* convert: where the dK/dV kernel counts its blocks done (V3B_COUNTS_DONE), launched as its programmatic
     * dependent -- it starts on the multiprocessors the dK/dV kernel's last wave leaves idle, each block once its
     * group is done -- else behind it in stream order */
    if (dq_out) return FATTN_OK;
    int wait_blocks = V3B_COUNTS_DONE(r->dp, p->deterministic != 0, seq, dq_out) ? (int)nkb : 0;
    void *cargs[] = {(void *)p, (void *)&wait_blocks};
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cc = {};
    cc.gridDim = dim3((unsigned)conv_blocks);
    cc.blockDim = dim3(128);
    cc.stream = s;
    cc.attrs = &overlap;
    cc.numAttrs = wait_blocks ? 1 : 0;
    FATTN_CUDA_CHECK(cudaLaunchKernelExC(&cc, r->convert[seq][ti], cargs));
    return FATTN_OK;
}

#ifdef FATTN_BWD_PROBE
/* The diagnostic build's probe rows (v3_bwd_kernel.cuh: FATTN_BWD_PROBE), for bench/bwd_probe.py through ctypes:
 * reset != 0 zeroes them, else the first `bytes` are copied to dst.  Returns the CUDA error code. */
extern "C" int fattn_v3_bwd_probe(void *dst, size_t bytes, int reset) {
    if (reset) {
        void *buf = NULL;
        cudaError_t e = cudaGetSymbolAddress(&buf, v3b_probe_buf);
        return (int)(e ? e : cudaMemset(buf, 0, sizeof v3b_probe_buf));
    }
    return (int)cudaMemcpyFromSymbol(dst, v3b_probe_buf, bytes);
}
#endif
