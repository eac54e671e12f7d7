/* fattn.h -- the plain C interface shared by the extension, the CPU backend, the planners and the CUDA kernels.
 *
 * One attn_params describes one attention call.  Tensors are addressed by raw pointers and int64 strides in
 * elements (last dimension contiguous), so any view of a (B, H, S, D) or (B, S, H, D) buffer is read in place.
 *
 *   q: (b, h, sq, d)      k, v: (b, h_kv, sk, d)      o: (b, h, sq, d)      lse: (b, h, sq) float32, or NULL
 *
 * The math (paper names, Dao et al.):  S = Q K^T * scale;  P = softmax(S) row-wise;  O = P V;
 * LSE_i = log(sum_j exp(S_ij)).  Kernels work in base 2: S2 = Q K^T * scale_log2, P = exp2(S2 - m_i).
 * Which keys a query sees is the mask block (mask.h).  A query row with no visible key gets O = 0, LSE = -inf.
 *
 * The backward's params extend the forward's (attn_bwd_params begins with an attn_params), as flash-attention's
 * Flash_bwd_params extends Flash_fwd_params.
 */
#ifndef FATTN_H
#define FATTN_H

#ifdef __CUDACC_RTC__ /* NVRTC (run-time compilation): no system headers */
typedef long long int64_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#else
#include <stdint.h>
#endif

#ifdef __CUDACC__
#define FATTN_HD static __host__ __device__ __forceinline__
#else
#define FATTN_HD static inline
#endif

#include "mask.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FATTN_LOG2E 1.4426950408889634f
#define FATTN_LN2 0.6931471805599453f
#define FATTN_MAX_HEADDIM 256

typedef enum { FATTN_F32 = 0, FATTN_F16 = 1, FATTN_BF16 = 2 } fattn_dtype;

typedef struct attn_params {
    const void *q, *k, *v;
    void *o;
    float *lse;                       /* NULL: not written */
    /* strides in elements; the last dimension has stride 1 */
    int64_t q_stride_b, q_stride_h, q_stride_s;
    int64_t k_stride_b, k_stride_h, k_stride_s;
    int64_t v_stride_b, v_stride_h, v_stride_s;
    int64_t o_stride_b, o_stride_h, o_stride_s;
    int64_t lse_stride_b, lse_stride_h; /* lse row stride is 1 */
    int64_t b, h, h_kv, sq, sk, d;
    int64_t h_per_kv;                 /* h / h_kv: query head i reads kv head i / h_per_kv */
    fattn_dtype dtype;
    float scale, scale_log2;          /* softmax scale, and scale * log2(e) */
    fattn_mask mask;                  /* which keys each query sees */
    float softcap;                    /* c > 0: each score s = scale q.k becomes c tanh(s / c) before the softmax */
    /* Variable-length batches (NULL: dense).  Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
     * of q and o (and entries of lse's rows), its keys rows cu_seqlens_k[b] .. of k and v; b counts the sequences,
     * sq and sk are the longest, batch strides are 0.  seqused_k[b] (also for dense calls): sequence b uses only
     * its first seqused_k[b] keys (a KV cache's filled length).  Device pointers on the GPU. */
    const int32_t *cu_seqlens_q, *cu_seqlens_k, *seqused_k;
    int64_t total_q, total_k;         /* packed batches: the rows of q / o and of k / v (TMA maps need the extents) */
    int64_t seqused_k_plus;           /* added to every seqused_k entry (a cache's new keys, appended by this call) */
    /* A paged KV cache (NULL: contiguous).  k and v are pools of pages (num_pages, page_size, h_kv, d); key j of
     * sequence b is row j % page_size of page block_table[b * block_table_stride + j / page_size]; k_stride_b and
     * v_stride_b are the pools' page strides, sk the longest sequence's capacity.  Dense q only (no cu_seqlens). */
    const int32_t *block_table;
    int64_t block_table_stride, page_size, num_pages;
    /* ALiBi (Press et al.; NULL: none): the score of query i and key j gains -slope |pos(i) - j| after the softcap,
     * pos(i) = i + sk - sq of its sequence (bottom-right, whatever the mask's alignment: flash-attention's rule).
     * Query head h of sequence b has slope alibi_slopes[b * alibi_stride_b + h] (stride 0: one slope per head);
     * float32, on the call's device. */
    const float *alibi_slopes;
    int64_t alibi_stride_b;
    /* Attention sinks (gpt-oss; NULL: none): float32 (h,) logits, natural-log units, each joining its head's rows'
     * softmax denominator (csrc/sinks.h).  Read by forward kernels whose planner sets fattn_plan.sinks_fused, which
     * apply them where they scale O (v3's epilogue, v2's split merge; out and lse leave the kernel sink-adjusted) --
     * for any other kernel the forward call runs the sinks pass over out and lse after it -- and by the backward's
     * dsinks (attn_bwd_params.dsinks). */
    const float *sinks;
    int sinks_by_row;                 /* 1: row i of head h takes sinks[h * sq + i] (fattn_pack_gqa's rows are heads) */
} attn_params;

FATTN_HD int64_t fattn_elem_bytes(fattn_dtype t) { return t == FATTN_F32 ? 4 : 2; }

/* What differs between sequence (batch) b and the call: where its q, k, v, o and lse start, its block-table row and
 * its own lengths.  Kernels that keep reading strides and the mask from the call's params (in the kernel's parameter
 * space) take just this. */
typedef struct {
    const void *q, *k, *v;
    void *o;
    float *lse;
    const int32_t *block_table;       /* this sequence's row (paged caches), else NULL */
    int64_t sq, sk;
} fattn_seq;

/* Sequence b's extent: its first query and key rows in the packed arrays (0 for dense batches) and its lengths. */
typedef struct {
    int64_t q0, k0, sq, sk;
} fattn_extent;

/* A dense batch's extent (every sequence the call's lengths, from row 0). */
FATTN_HD fattn_extent fattn_dense_extent(const attn_params *p) {
    fattn_extent x = {0, 0, p->sq, p->sk};
    return x;
}

FATTN_HD fattn_extent fattn_extent_of(const attn_params *p, int64_t b) {
    fattn_extent x = fattn_dense_extent(p);
    if (p->cu_seqlens_q) {
        x.q0 = p->cu_seqlens_q[b];
        x.k0 = p->cu_seqlens_k[b];
        x.sq = p->cu_seqlens_q[b + 1] - x.q0;
        x.sk = p->cu_seqlens_k[b + 1] - x.k0;
    }
    if (p->seqused_k && p->seqused_k[b] + p->seqused_k_plus < x.sk) x.sk = p->seqused_k[b] + p->seqused_k_plus;
    return x;
}

FATTN_HD fattn_seq fattn_seq_of(const attn_params *p, int64_t b) {
    fattn_seq s;
    const fattn_extent x = fattn_extent_of(p, b);
    const int64_t q0 = x.q0, k0 = x.k0;
    s.sq = x.sq;
    s.sk = x.sk;
    const int64_t e = fattn_elem_bytes(p->dtype);
    s.q = (const char *)p->q + (b * p->q_stride_b + q0 * p->q_stride_s) * e;
    s.block_table = p->block_table ? p->block_table + b * p->block_table_stride : 0;
    if (p->block_table) { /* k and v stay the pools */
        s.k = p->k;
        s.v = p->v;
    } else {
        s.k = (const char *)p->k + (b * p->k_stride_b + k0 * p->k_stride_s) * e;
        s.v = (const char *)p->v + (b * p->v_stride_b + k0 * p->v_stride_s) * e;
    }
    s.o = (char *)p->o + (b * p->o_stride_b + q0 * p->o_stride_s) * e;
    s.lse = p->lse ? p->lse + b * p->lse_stride_b + q0 : 0;
    return s;
}

/* The params of sequence (batch) b alone, as a batch of one: q, k, v, o and lse moved to its first query and key,
 * sq and sk its own lengths.  Every kernel and the CPU backend start here (or at fattn_seq_of) and then work on
 * batch 0, so a dense batch, a packed variable-length batch and a partly filled or paged cache are one code path. */
FATTN_HD void fattn_seq_params(const attn_params *p, int64_t b, attn_params *s) {
    const fattn_seq x = fattn_seq_of(p, b);
    *s = *p;
    s->q = x.q; s->k = x.k; s->v = x.v; s->o = x.o; s->lse = x.lse;
    s->block_table = x.block_table;
    if (p->alibi_slopes) s->alibi_slopes = p->alibi_slopes + b * p->alibi_stride_b;
    s->sq = x.sq;
    s->sk = x.sk;
    s->b = 1;
    s->cu_seqlens_q = s->cu_seqlens_k = s->seqused_k = 0;
}

/* ALiBi's slope of query head h of batch b in log2 units (0 without ALiBi), and the bias it gives the score of the
 * key j for a query at bottom-right position pos = i + sk - sq: kernels add it to S2 after the softcap. */
FATTN_HD float fattn_alibi_slope2(const attn_params *p, int64_t b, int64_t h) {
    return p->alibi_slopes ? p->alibi_slopes[b * p->alibi_stride_b + h] * FATTN_LOG2E : 0.f;
}
FATTN_HD float fattn_alibi_bias2(float slope2, int64_t pos, int64_t j) {
    return -slope2 * (float)(pos > j ? pos - j : j - pos);
}

/* 1 when the call changes the scores before the softmax (a softcap or ALiBi): kernels that compile that work apart
 * pick their score-modifying build with it. */
FATTN_HD int fattn_score_mods(const attn_params *p) { return p->softcap > 0.f || p->alibi_slopes != 0; }

/* Decode with grouped-query attention, GQA packing: with one query per sequence (Sq = 1) every query head of a kv
 * head's group sees the same keys, so the group's G heads can be the G query rows of one head -- one read of K and V
 * per group instead of G.  Fills *out with that view (sq = G, h = h_kv, no copy: the rows of a head are the group's
 * heads, q/o row stride = their head stride) and returns 1 when p qualifies: dense q, Sq = 1, G > 1, every key
 * visible to the row (no mask but bottom-right causal, no window), no ALiBi (its slopes differ per query head), lse
 * absent or with head stride 1. */
FATTN_HD int fattn_pack_gqa(const attn_params *p, attn_params *out) {
    const int64_t g = p->h_per_kv;
    /* the row's position is sk - 1 when bottom-right aligned: any right bound then reaches every key */
    const int all_keys = p->mask.left < 0 && (p->mask.right < 0 || p->mask.bottom_right);
    if (p->sq != 1 || g <= 1 || p->cu_seqlens_q || !all_keys || p->alibi_slopes || (p->lse && p->lse_stride_h != 1))
        return 0;
    *out = *p;
    out->sq = g;
    out->h = p->h_kv;
    out->h_per_kv = 1;
    out->q_stride_s = p->q_stride_h;
    out->q_stride_h = g * p->q_stride_h;
    out->o_stride_s = p->o_stride_h;
    out->o_stride_h = g * p->o_stride_h;
    out->lse_stride_h = g;
    out->mask.causal = 0;
    out->mask.bottom_right = 0;
    out->mask.left = out->mask.right = -1;
    out->sinks_by_row = 1;
    return 1;
}

/* Where in attn_params.sinks the sink logit (natural log) of row i of head h is: after fattn_pack_gqa a head's rows
 * are the query heads of its group, each with its own (row i of head h at h * sq + i, the rows' step 1), else entry
 * h for every row (step 0). */
FATTN_HD int64_t fattn_sink_index(const attn_params *p, int64_t h, int64_t i) {
    return p->sinks_by_row ? h * p->sq + i : h;
}
FATTN_HD float fattn_sink_of(const attn_params *p, int64_t h, int64_t i) { return p->sinks[fattn_sink_index(p, h, i)]; }

/* Row j of a paged cache's sequence: the element offset of its page's row in the pool (head excluded). */
FATTN_HD int64_t fattn_page_offset(const int32_t *table, int64_t page_size, int64_t j, int64_t stride_b,
                                   int64_t stride_s) {
    return (int64_t)table[j / page_size] * stride_b + (j % page_size) * stride_s;
}

/* Where key j of the sequence in hand (after fattn_seq_params) starts in k (or v: pass v's strides), in elements
 * from k's pointer plus the head's offset: row j, or through the block table its page and row. */
FATTN_HD int64_t fattn_key_offset(const attn_params *s, int64_t j, int64_t stride_b, int64_t stride_s) {
    return s->block_table ? fattn_page_offset(s->block_table, s->page_size, j, stride_b, stride_s) : j * stride_s;
}

/* The backward pass (FlashAttention-2's, Dao 2023): dQ, dK, dV from dO, the forward's inputs, its output O and its LSE
 * (fwd.lse, required, natural log).  With P recomputed from Q, K and the LSE:
 *
 *   D_i = rowsum(dO_i * O_i)      dV = P^T dO      dP = dO V^T      dS = P * (dP - D)
 *   dQ  = scale * dS K            dK = scale * dS^T Q
 *
 * GQA: dK and dV of a kv head are summed over its group's query heads.  Rows that see no key (LSE = -inf) have
 * P = 0: zero gradients.  dq, dk, dv have q's and k's shapes and strides of their own (last dimension contiguous).
 *
 * GPU kernels keep float32 arrays in the plan's workspace (fattn_bwd_workspace_bytes): dpsum, D_i per row, lse2, the
 * row's LSE in base 2, and dq_accum, dQ accumulated across key blocks before it is scaled and converted; all laid out
 * per (b, h) with ws_rows rows (sq rounded up), dq_accum's of ws_cols columns (the head-dim bucket). */
typedef struct attn_bwd_params {
    attn_params fwd;                  /* q, k, v, o, lse (read), mask, scale */
    const void *dout;
    void *dq, *dk, *dv;
    int64_t do_stride_b, do_stride_h, do_stride_s;
    int64_t dq_stride_b, dq_stride_h, dq_stride_s;
    int64_t dk_stride_b, dk_stride_h, dk_stride_s;
    int64_t dv_stride_b, dv_stride_h, dv_stride_s;
    float *dpsum;                     /* [(b * h + h) * ws_rows + i]: D_i */
    float *lse2;                      /* [(b * h + h) * ws_rows + i]: LSE_i log2 e, +inf past Sq or for a row that saw
                                         no key (so that P = 0 there) */
    float *dq_accum;                  /* [((b * h + h) * ws_rows + i) * ws_cols + e] (v3: in 64 x 64 tiles, each in
                                         dq_copies copies side by side) */
    int *dq_sem;                      /* [(b * h + h) * ws_rows + k]: v3's deterministic mode, the adds each dQ tile
                                         (copy) has had (fattn_bwd_workspace_set) */
    int64_t ws_rows, ws_cols;
    int dq_copies;                    /* copies of dq_accum in the workspace (fattn_bwd_dq_copies) */
    int deterministic;                /* 1: no order-dependent atomics (bitwise repeatable gradients) */
    float *dsinks;                    /* (h,), with fwd.sinks (NULL: none): written with csrc/sinks.h's dsinks -- from
                                         the workspace's D and LSE2 where the planner sets fattn_plan.sinks_fused (v2,
                                         v3), else by the sinks pass after the backward */
} attn_bwd_params;

/* The backward's params of sequence b alone (fattn_seq_params, with dO and the gradients moved alike and the
 * workspace rows of batch b). */
FATTN_HD void fattn_seq_bwd_params(const attn_bwd_params *p, int64_t b, attn_bwd_params *s) {
    *s = *p;
    fattn_seq_params(&p->fwd, b, &s->fwd);
    const fattn_extent x = fattn_extent_of(&p->fwd, b);
    const int64_t q0 = x.q0, k0 = x.k0;
    const int64_t e = fattn_elem_bytes(p->fwd.dtype);
    s->dout = (const char *)p->dout + (b * p->do_stride_b + q0 * p->do_stride_s) * e;
    s->dq = (char *)p->dq + (b * p->dq_stride_b + q0 * p->dq_stride_s) * e;
    s->dk = (char *)p->dk + (b * p->dk_stride_b + k0 * p->dk_stride_s) * e;
    s->dv = (char *)p->dv + (b * p->dv_stride_b + k0 * p->dv_stride_s) * e;
    if (p->dpsum) s->dpsum = p->dpsum + b * p->fwd.h * p->ws_rows;
    if (p->lse2) s->lse2 = p->lse2 + b * p->fwd.h * p->ws_rows;
    if (p->dq_accum) s->dq_accum = p->dq_accum + b * p->fwd.h * p->ws_rows * p->ws_cols;
    if (p->dq_sem) s->dq_sem = p->dq_sem + b * p->fwd.h * p->ws_rows;
}

/* The GPU backward's workspace: ws_rows = sq rounded up to FATTN_BWD_STEP_ROWS (the steps of v3's br = 80 backward
 * end there), then to 128; ws_cols = the head-dim bucket; dq_accum first (fattn_bwd_dq_copies copies), then
 * dpsum and lse2 (a float per row each; v3 at head dim 64 orders them inside each 64-row block as its threads read
 * them: kernels/bwd_common.cuh, bwd_v3_row_pos), then dq_sem (an int per row).  One rule for every GPU variant (the
 * Python side sizes a framework-allocated workspace with it). */
#define FATTN_BWD_ROW_ALIGN 128
#define FATTN_BWD_STEP_ROWS 80 /* the query rows of a step of v3's backward that are not a multiple of 64 */
FATTN_HD int64_t fattn_bwd_ws_rows(int64_t sq) {
    const int64_t steps = (sq + FATTN_BWD_STEP_ROWS - 1) / FATTN_BWD_STEP_ROWS * FATTN_BWD_STEP_ROWS;
    return (steps + FATTN_BWD_ROW_ALIGN - 1) / FATTN_BWD_ROW_ALIGN * FATTN_BWD_ROW_ALIGN;
}
/* The head-dim bucket kernels are compiled for: 64, 128 or 256 (columns past d are zero-filled). */
FATTN_HD int fattn_head_dim_bucket(int64_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

/* Copies of dq_accum: two in deterministic mode at head dim 256, where v3's wide kernel adds each dQ tile's turns
 * alternately into two copies (a turn waits for the add two turns before it, not one) and the convert pass sums them
 * in copy order (kernels/sm90/v3_bwd_wide.cu); else one. */
#define FATTN_BWD_DQ_COPIES 2
FATTN_HD int fattn_bwd_dq_copies(int64_t d, int deterministic) {
    return deterministic && fattn_head_dim_bucket(d) == 256 ? FATTN_BWD_DQ_COPIES : 1;
}

FATTN_HD int64_t fattn_bwd_workspace_bytes(int64_t b, int64_t h, int64_t sq, int64_t d, int deterministic) {
    const int64_t n =
        4 * b * h * fattn_bwd_ws_rows(sq) * (fattn_head_dim_bucket(d) * fattn_bwd_dq_copies(d, deterministic) + 3);
    return n > 0 ? n : 16; /* never empty: with no query rows the dK / dV kernel still runs (dK = dV = 0), and a
                              zero-byte allocation may have no address to give it */
}
/* p's workspace pointers into `ws` (at least fattn_bwd_workspace_bytes for p's deterministic), laid out as above. */
FATTN_HD void fattn_bwd_workspace_set(attn_bwd_params *p, float *ws) {
    const int64_t rows = p->fwd.b * p->fwd.h * fattn_bwd_ws_rows(p->fwd.sq);
    p->dq_copies = fattn_bwd_dq_copies(p->fwd.d, p->deterministic);
    p->dq_accum = ws;
    p->dpsum = ws + rows * fattn_head_dim_bucket(p->fwd.d) * p->dq_copies;
    p->lse2 = p->dpsum + rows;
    p->dq_sem = (int *)(p->lse2 + rows);
}

/* Status codes; a non-zero status comes with a message from fattn_last_error(). */
typedef enum {
    FATTN_OK = 0,
    FATTN_ERR_INVALID = 1,   /* bad argument reaching C: a bug in the caller */
    FATTN_ERR_UNSUPPORTED = 2,
    FATTN_ERR_CUDA = 3,
    FATTN_ERR_NOMEM = 4,
} fattn_status;

#ifndef __CUDACC_RTC__ /* host only */
/* Records "file:line: message" in a thread-local buffer and returns `status`. */
fattn_status fattn_set_error(fattn_status status, const char *file, int line, const char *fmt, ...);
const char *fattn_last_error(void);
#endif

#define FATTN_FAIL(status, ...) fattn_set_error((status), __FILE__, __LINE__, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
