/* simt_plan.c -- the scalar family's planners (v0, v1): one grid shape each, every dtype, alignment and stride. */
#include "../../csrc/variants.h"
#include "simt.h"

static fattn_status grid_of(int64_t blocks, const char *name, fattn_plan *plan) {
    if (blocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "%s: grid of %lld blocks is too large", name, (long long)blocks);
    plan->grid_x = (unsigned)blocks;
    plan->grid_y = 1;
    return FATTN_OK;
}

fattn_status fattn_plan_v0(const attn_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                           fattn_plan *plan) {
    (void)tuned; (void)ov;
    plan->threads = V0_THREADS;
    return grid_of((p->b * p->h * p->sq + V0_THREADS - 1) / V0_THREADS, "v0", plan);
}

fattn_status fattn_plan_v1(const attn_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                           fattn_plan *plan) {
    (void)tuned; (void)ov;
    plan->threads = 32 * V1_WARPS;
    plan->smem = V1_SMEM_BYTES(fattn_head_dim_bucket(p->d));
    return grid_of((p->sq + V1_BR - 1) / V1_BR * p->b * p->h, "v1", plan);
}

/* No configurations to choose from. */
int fattn_configs_v0(int i, fattn_config_info *out) { (void)i; (void)out; return 0; }
int fattn_configs_v1(int i, fattn_config_info *out) { (void)i; (void)out; return 0; }

fattn_status fattn_check_config_v0(const int64_t *values, int n, int d, int dtype, size_t smem_limit) {
    (void)values; (void)n; (void)d; (void)dtype; (void)smem_limit;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v0 has no configurations");
}
fattn_status fattn_check_config_v1(const int64_t *values, int n, int d, int dtype, size_t smem_limit) {
    (void)values; (void)n; (void)d; (void)dtype; (void)smem_limit;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v1 has no configurations");
}

/* The scalar backward (v1_bwd.cu): three grids of its own, sized by the launcher; every dtype, alignment and stride.
 * Its rows of the workspace hold D_i (dpsum); dq_accum goes unused. */
fattn_status fattn_plan_bwd_v1(const attn_bwd_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                               fattn_plan *plan) {
    (void)tuned;
    const attn_params *f = &p->fwd;
    if (ov->config >= 0) return FATTN_FAIL(FATTN_ERR_INVALID, "the v1 backward has no configurations");
    const int64_t rows = f->b * f->h * f->sq;
    const int64_t blocks = (rows + V1B_WARPS - 1) / V1B_WARPS;
    const int64_t ktiles = (f->sk + V1B_T - 1) / V1B_T * f->b * f->h_kv;
    if (blocks > 0x7fffffff || ktiles > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v1 backward: grid of %lld blocks is too large",
                          (long long)(blocks > ktiles ? blocks : ktiles));
    plan->threads = 32 * V1B_WARPS;
    plan->smem = V1B_SMEM_BYTES(fattn_head_dim_bucket(f->d));
    plan->grid_x = (unsigned)((f->sq + V1B_T - 1) / V1B_T * f->b * f->h);
    plan->grid_y = 1;
    plan->workspace_bytes = (size_t)fattn_bwd_workspace_bytes(f->b, f->h, f->sq, f->d, p->deterministic);
    return FATTN_OK;
}
