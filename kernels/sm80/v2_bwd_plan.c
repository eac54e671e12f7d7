/* v2_bwd_plan.c -- v2's backward planner in plain C: which tile config (v2_bwd_configs.h) a call runs, its grid and
 * block order, and its workspace; refuses (FATTN_ERR_UNSUPPORTED, with the reason) what the kernels cannot run, so
 * that the dispatcher falls back to the scalar backward. */
#include "../../csrc/variants.h"
#include "v2_bwd_configs.h"

static const v2_bwd_config v2_bwd_table[V2_BWD_NCONFIGS] = {
#define ROW(dp, br, bc, w, ws, wkv, wq, st, dqf, dqbc) {dp, br, bc, w, ws, wkv, wq, st, dqf, dqbc},
    V2_BWD_CONFIGS(ROW)
#undef ROW
};

static size_t dkdv_smem(const v2_bwd_config *c) { return V2_BWD_SMEM(c->dp, c->br, c->bc, c->stages); }
static size_t dq_smem(const v2_bwd_config *c) { return V2_BWD_DQ_SMEM(c->dp, c->dq_bc); }

/* Opt-in shared memory per block by compute capability (cudaDevAttrMaxSharedMemoryPerBlockOptin), kept as data
 * so that planning needs no CUDA call: A100 / Orin 163 KiB, H100 / B200 227 KiB, the rest (sm_86, sm_89, sm_120,
 * and anything unknown) 99 KiB. */
static size_t smem_limit(int sm) {
    if (sm == 80 || sm == 87) return 163 * 1024;
    if (sm == 90 || sm == 100 || sm == 103) return 227 * 1024;
    return 99 * 1024;
}

static int aligned16(const void *ptr) { return (uintptr_t)ptr % 16 == 0; }
static int strides8(int64_t sb, int64_t sh, int64_t ss) { return sb % 8 == 0 && sh % 8 == 0 && ss % 8 == 0; }

/* Every tensor is read or written 16 bytes at a time (cp.async, the preprocess and convert kernels) or 4 bytes at
 * a time at even columns: 16-byte aligned, b / h / s strides a multiple of 8 elements. */
static fattn_status check_tensors(const attn_bwd_params *p) {
    const attn_params *f = &p->fwd;
    const int ok = aligned16(f->q) && aligned16(f->k) && aligned16(f->v) && aligned16(f->o) && aligned16(p->dout) &&
                   aligned16(p->dq) && aligned16(p->dk) && aligned16(p->dv) &&
                   strides8(f->q_stride_b, f->q_stride_h, f->q_stride_s) &&
                   strides8(f->k_stride_b, f->k_stride_h, f->k_stride_s) &&
                   strides8(f->v_stride_b, f->v_stride_h, f->v_stride_s) &&
                   strides8(f->o_stride_b, f->o_stride_h, f->o_stride_s) &&
                   strides8(p->do_stride_b, p->do_stride_h, p->do_stride_s) &&
                   strides8(p->dq_stride_b, p->dq_stride_h, p->dq_stride_s) &&
                   strides8(p->dk_stride_b, p->dk_stride_h, p->dk_stride_s) &&
                   strides8(p->dv_stride_b, p->dv_stride_h, p->dv_stride_s);
    if (!ok)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward needs q, k, v, out, dout, dq, dk, dv 16-byte aligned with "
                                                 "b / h / s strides a multiple of 8 elements");
    return FATTN_OK;
}

/* The config of a call: an explicit override (checked), else the first row of the head-dim bucket whose kernels'
 * shared memory fits the device. */
static fattn_status choose(const attn_bwd_params *p, const fattn_overrides *ov, const fattn_plan *plan, int *index) {
    const int bucket = fattn_head_dim_bucket(p->fwd.d);
    const size_t limit = smem_limit(plan->dev.sm);
    if (ov && ov->config >= 0) { /* a config the caller named but cannot run here is an error, not a fallback */
        if (ov->config >= V2_BWD_NCONFIGS)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v2 backward has no config %d (%d configs)", ov->config,
                              (int)V2_BWD_NCONFIGS);
        const v2_bwd_config *c = &v2_bwd_table[ov->config];
        if (c->dp != bucket)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v2 backward config %d is for head dim bucket %d, not %d", ov->config,
                              c->dp, bucket);
        if (dkdv_smem(c) > limit || (p->deterministic && dq_smem(c) > limit))
            return FATTN_FAIL(FATTN_ERR_INVALID, "v2 backward config %d needs %zu B of shared memory (sm_%d has %zu)",
                              ov->config, dkdv_smem(c) > dq_smem(c) ? dkdv_smem(c) : dq_smem(c), plan->dev.sm, limit);
        *index = ov->config;
        return FATTN_OK;
    }
    for (int i = 0; i < V2_BWD_NCONFIGS; i++) {
        const v2_bwd_config *c = &v2_bwd_table[i];
        if (c->dp == bucket && dkdv_smem(c) <= limit && (!p->deterministic || dq_smem(c) <= limit)) {
            *index = i;
            return FATTN_OK;
        }
    }
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward: no config for head dim %lld fits sm_%d's %zu B of shared memory",
                      (long long)p->fwd.d, plan->dev.sm, limit);
}

fattn_status fattn_plan_bwd_v2(const attn_bwd_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                               fattn_plan *plan) {
    (void)tuned; /* no tuned backward configs yet */
    const attn_params *f = &p->fwd;
    const char *missing = fattn_missing_feature(f, FATTN_TAKES_SOFTCAP | FATTN_TAKES_ALIBI | FATTN_TAKES_VARLEN);
    if (missing) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "the v2 backward does not take %s yet", missing);
    if (f->dtype != FATTN_F16 && f->dtype != FATTN_BF16)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward runs fp16 and bf16 only");
    /* (with no query rows the LSE is empty and may have no address: nothing reads it) */
    if (!f->lse && f->sq > 0) return FATTN_FAIL(FATTN_ERR_INVALID, "the backward needs the forward's LSE");
    if (f->d < 8 || f->d > FATTN_MAX_HEADDIM || f->d % 8)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward needs a head dim that is a multiple of 8 in [8, %d], not %lld",
                          FATTN_MAX_HEADDIM, (long long)f->d);
    if (f->h_kv < 1 || f->h_per_kv < 1 || f->h != f->h_kv * f->h_per_kv)
        return FATTN_FAIL(FATTN_ERR_INVALID, "heads %lld are not kv heads %lld x %lld", (long long)f->h,
                          (long long)f->h_kv, (long long)f->h_per_kv);
    /* rows and keys are ints in the kernels (and mask.h's block offsets stay below 2^30) */
    if (f->sq >= (1 << 30) || f->sk >= (1 << 30))
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward: sequences of 2^30 or more");
    fattn_status st = check_tensors(p);
    int idx = 0;
    if (st || (st = choose(p, ov, plan, &idx))) return st;
    const v2_bwd_config *c = &v2_bwd_table[idx];
    const int64_t nkb = (f->sk + c->bc - 1) / c->bc, blocks = nkb * f->b * f->h_kv;
    if (blocks > 0x7fffffff || f->b * f->h * fattn_bwd_ws_rows(f->sq) / 8 > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward: grid too large");
    plan->config = idx;
    plan->grid_x = (unsigned)blocks;
    plan->grid_y = 1;
    plan->threads = (unsigned)(32 * c->warps);
    plan->smem = dkdv_smem(c);
    /* Head by head: a head's key blocks run side by side, sharing its Q, dO in L2 and spreading their dQ atomics
     * over one head's rows; with causal masking each head's key block 0 (the longest) starts first. */
    plan->order = ov && ov->order ? ov->order : FATTN_ORDER_HEADS;
    plan->splits = 1;
    plan->split_blocks = nkb;
    plan->workspace_bytes = (size_t)fattn_bwd_workspace_bytes(f->b, f->h, f->sq, f->d, p->deterministic);
    plan->sinks_fused = p->dsinks != NULL; /* dsinks from bwd_prep's D and LSE2 (fattn_launch_bwd_dsinks) */
    return FATTN_OK;
}
