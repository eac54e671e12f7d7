/* v3_bwd_plan.c -- v3's backward planner in plain C: whether the Hopper backward (v3_bwd.cu) takes a call, which
 * config (v3_bwd_configs.h) runs it, its grid and workspace.  What it refuses (FATTN_ERR_UNSUPPORTED, with the
 * reason) runs v2's backward: the dispatcher tries the variants from the highest down, and a call forced to v3
 * falls back to v2 (variants.h). */
#include "../../csrc/variants.h"
#include "v3_addr.h"
#include "v3_bwd_configs.h"

static const v3_bwd_config v3_bwd_table[V3_BWD_NCONFIGS] = {
#define ROW(dp, br, bc, st, mods) {dp, br, bc, st, mods},
    V3_BWD_CONFIGS(ROW)
#undef ROW
};

/* Every tensor TMA reads (q, k, v, dout; o through the preprocess kernel's 16-byte loads) and every gradient (4-byte
 * stores at even columns; dQ by 16-byte stores from the convert kernel): 16-byte aligned, strides a multiple of 8
 * elements, positive where the dimension has more than one element (no broadcast K / V: its gradient would need a
 * reduction over the broadcast dimension). */
static int tensors_ok(const attn_bwd_params *p) {
    const attn_params *f = &p->fwd;
    /* a packed batch: one batch of total_q / total_k rows (the tensor maps' shape) */
    const int packed = f->cu_seqlens_q != NULL;
    const int64_t sq = packed ? f->total_q : f->sq, sk = packed ? f->total_k : f->sk, h = f->h, hk = f->h_kv;
    const int64_t b = packed ? 1 : f->b;
    return aligned16(f->q) && aligned16(f->k) && aligned16(f->v) && aligned16(f->o) && aligned16(p->dout) &&
           aligned16(p->dq) && aligned16(p->dk) && aligned16(p->dv) && stride_ok(f->q_stride_s, sq) &&
           stride_ok(f->q_stride_h, h) && stride_ok(f->q_stride_b, b) && stride_ok(f->k_stride_s, sk) &&
           stride_ok(f->k_stride_h, hk) && stride_ok(f->k_stride_b, b) && stride_ok(f->v_stride_s, sk) &&
           stride_ok(f->v_stride_h, hk) && stride_ok(f->v_stride_b, b) && stride_ok(f->o_stride_s, sq) &&
           stride_ok(f->o_stride_h, h) && stride_ok(f->o_stride_b, b) && stride_ok(p->do_stride_s, sq) &&
           stride_ok(p->do_stride_h, h) && stride_ok(p->do_stride_b, b) && stride_ok(p->dq_stride_s, sq) &&
           stride_ok(p->dq_stride_h, h) && stride_ok(p->dq_stride_b, b) && stride_ok(p->dk_stride_s, sk) &&
           stride_ok(p->dk_stride_h, hk) && stride_ok(p->dk_stride_b, b) && stride_ok(p->dv_stride_s, sk) &&
           stride_ok(p->dv_stride_h, hk) && stride_ok(p->dv_stride_b, b) && h <= 0x7fffffff && f->b <= 0x7fffffff &&
           sq < (1 << 30) && sk < (1 << 30);
}

/* Whether steps of br rows pad sq by at most 5% more rows than steps of br0 do.  A plain row's br = 80 against
 * the default's 64 at D=128 (evidence/backward/h100_v3_bwd_br80_777e632.md): non-causal S=512 (560 rows against 512)
 * ran 0.953x, S=1k (1040 against 1024) 1.04x, 2k-16k 1.06-1.20x; causal 1k-16k 1.02-1.12x. */
static int v3_bwd_pads_little(int64_t sq, int br, int br0) {
    return (sq + br - 1) / br * br * 20 <= (sq + br0 - 1) / br0 * br0 * 21;
}

/* The adds the 64-row dQ tiles of a call take, all together: for each key block of bc keys, the tiles holding a
 * row that sees it (fattn_rows_seeing). */
static int64_t dq_tile_adds(const attn_params *f, int bc) {
    int64_t adds = 0;
    for (int64_t j0 = 0; j0 < f->sk; j0 += bc) {
        int64_t lo, hi;
        fattn_rows_seeing(&f->mask, f->sq, f->sk, j0, (j0 + bc < f->sk ? j0 + bc : f->sk) - 1, &lo, &hi);
        if (hi > lo) adds += (hi - 1) / 64 - lo / 64 + 1;
    }
    return adds;
}

/* V3_BWD_DQ_OUT's rule (v3_bwd_configs.h): no softcap / ALiBi, not packed, a config of whole 64-row steps, at most
 * V3_BWD_DQ_OUT_KB_MAX key blocks and V3_BWD_DQ_OUT_ADDS2 / 2 adds a dQ tile on average (fp16 and bf16: the only
 * dtypes v3's backward takes). */
int fattn_v3_bwd_dq_out(const attn_bwd_params *p, int config) {
    const attn_params *f = &p->fwd;
    if (config < 0 || config >= V3_BWD_NCONFIGS) return 0;
    const v3_bwd_config *c = &v3_bwd_table[config];
    if (fattn_score_mods(f) || f->cu_seqlens_q || !V3_BWD_DQ_OUT(c->dp, c->br) ||
        (f->sk + c->bc - 1) / c->bc > V3_BWD_DQ_OUT_KB_MAX)
        return 0;
    return 2 * dq_tile_adds(f, c->bc) <= V3_BWD_DQ_OUT_ADDS2 * ((f->sq + 63) / 64);
}

/* The reason v3's backward cannot run p, or NULL. */
static const char *refusal(const attn_bwd_params *p) {
    const attn_params *f = &p->fwd;
    if (f->dtype != FATTN_F16 && f->dtype != FATTN_BF16) return "the v3 backward runs fp16 and bf16 only";
    if (f->d < 8 || f->d > 256 || f->d % 8) return "the v3 backward needs a head dim that is a multiple of 8 up to 256";
    if (!(f->scale > 0.f)) return "the v3 backward needs a positive scale";
    if (f->h_kv < 1 || f->h_per_kv < 1 || f->h != f->h_kv * f->h_per_kv) return "heads are not kv heads x group";
    if (f->sq >= (1 << 30) || f->sk >= (1 << 30)) return "the v3 backward: sequences of 2^30 or more";
    /* an empty side has nothing for TMA to address (its pointer may be NULL); v2 writes the zero gradients */
    if (f->sq == 0 || f->sk == 0) return "the v3 backward needs queries and keys (v2's writes the zero gradients)";
    if (!f->lse) return "the backward needs the forward's LSE";
    if (!tensors_ok(p))
        return "the v3 backward needs q, k, v, out, dout, dq, dk, dv 16-byte aligned with strides a multiple of 8 "
               "elements (no broadcast k / v)";
    return NULL;
}

fattn_status fattn_plan_bwd_v3(const attn_bwd_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                               fattn_plan *plan) {
    (void)tuned;
    const attn_params *f = &p->fwd;
    const char *missing = fattn_missing_feature(f, FATTN_TAKES_SOFTCAP | FATTN_TAKES_ALIBI | FATTN_TAKES_VARLEN),
               *why = refusal(p);
    if (missing) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "the v3 backward does not take %s yet", missing);
    if (why) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "%s", why);
    const int bucket = fattn_head_dim_bucket(f->d);
    /* plain: what V3_BWD_PLAIN_CONFIGS' kernels take -- no softcap / ALiBi, not packed */
    const int plain = !fattn_score_mods(f) && !f->cu_seqlens_q;
    int idx = -1;
    /* the bucket's first row; a plain row where the call is plain, unless the first row takes dQ out */
    for (int i = 0; i < V3_BWD_NCONFIGS; i++)
        if (v3_bwd_table[i].dp == bucket &&
            (idx < 0 || (plain && i >= V3_BWD_FIRST_PLAIN && v3_bwd_pads_little(f->sq, v3_bwd_table[i].br, 64) &&
                         !fattn_v3_bwd_dq_out(p, idx))))
            idx = i;
    if (ov && ov->config >= 0) {
        if (ov->config >= V3_BWD_NCONFIGS || v3_bwd_table[ov->config].dp != bucket)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 backward config %d does not exist for head dim bucket %d",
                              ov->config, bucket);
        if (ov->config >= V3_BWD_FIRST_PLAIN && !plain)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 backward config %d runs only calls without a softcap, ALiBi or "
                              "packed batch", ov->config);
        idx = ov->config;
    }
    if (idx < 0) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 backward: no config for head dim bucket %d", bucket);
    const v3_bwd_config *c = &v3_bwd_table[idx];
    if (fattn_score_mods(f) && !c->mods)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "the v3 backward takes a softcap / ALiBi at head dims above 64 only");
    const int64_t nkb = (f->sk + c->bc - 1) / c->bc, blocks = nkb * f->b * f->h_kv;
    if (blocks > 0x7fffffff || f->b * f->h * fattn_bwd_ws_rows(f->sq) / 8 > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 backward: grid too large");
    plan->config = idx;
    plan->grid_x = (unsigned)blocks;
    plan->grid_y = 1;
    plan->threads = 384; /* a producer warpgroup and two consumers */
    plan->smem = V3_BWD_SMEM(c->dp, c->br, c->bc, c->stages);
    /* Head by head (the kernels' block order, v3_bwd_ring.cuh: v3b_place; the wide kernel's deterministic mode goes
     * in chunks of 16 key blocks of every head; either way a block's lower key blocks come first, which
     * deterministic mode relies on): a kv head's key blocks side by side, sharing its Q and dO in L2.  (Heads
     * fastest, every head's key block 0 first, ran causal calls at S <= 2k 1.2-1.46x slower on the H100, the blocks
     * in flight reading 132 heads' Q and dO, more than L2 holds: evidence/backward/h100_v3_bwd_61e560a.md against
     * ..._first_14d0171.md.) */
    plan->order = FATTN_ORDER_HEADS;
    plan->splits = 1;
    plan->split_blocks = nkb;
    plan->workspace_bytes = (size_t)fattn_bwd_workspace_bytes(f->b, f->h, f->sq, f->d, p->deterministic);
    plan->sinks_fused = p->dsinks != NULL; /* dsinks from bwd_prep's D and LSE2 (fattn_launch_bwd_dsinks) */
    return FATTN_OK;
}
