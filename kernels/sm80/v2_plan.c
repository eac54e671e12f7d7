/* v2_plan.c -- v2's host side in plain C: which tile config a call runs, its grid, key splits and block order, and
 * the rules a config must meet (the tuner asks them here instead of restating them). */
#include <string.h>

#include "../../csrc/rtc.h"
#include "../../csrc/tuned.h"
#include "../../csrc/variants.h"
#include "v2_configs.h"

#define F16_ONLY (1 << FATTN_F16)
#define HALF_TYPES (1 << FATTN_F16 | 1 << FATTN_BF16)

typedef struct {
    v2_config cfg;
    int dtypes;
} v2_row;

#define ROW_BOTH(dp, w, mt, bc, st) {{dp, w, mt, bc, st}, HALF_TYPES},
#define ROW_F16(dp, w, mt, bc, st) {{dp, w, mt, bc, st}, F16_ONLY},
#define ROW_RULE(dp, w, mt, bc, st, causal, sk_min, sk_max) ROW_BOTH(dp, w, mt, bc, st)
static const v2_row v2_rows[V2_NAOT] = {V2_TABLE(ROW_BOTH, ROW_BOTH, ROW_F16, ROW_RULE)};
#undef ROW_BOTH
#undef ROW_F16
#undef ROW_RULE

typedef struct {
    int dp, causal;
    int64_t sk_min, sk_max;
} v2_rule;
#define RULE(dp, w, mt, bc, st, causal, sk_min, sk_max) {dp, causal, sk_min, sk_max},
static const v2_rule v2_rules[V2_NRULES + 1] = {V2_RULES(RULE){0, -1, 0, 0}}; /* + 1: no empty arrays */
#undef RULE

static int bucket_of(int64_t d) { return d <= 64 ? 0 : d <= 128 ? 1 : 2; }

/* Config `index` for `dtype`: an ahead-of-time row or a run-time compiled entry of v2 (else `err` with why). */
static fattn_status v2_lookup(int index, int dtype, v2_config *cfg, fattn_status err) {
    if (index >= 0 && index < V2_NAOT) {
        if (!(v2_rows[index].dtypes >> dtype & 1))
            return FATTN_FAIL(err, "v2 config %d is not compiled for this dtype", index);
        *cfg = v2_rows[index].cfg;
        return FATTN_OK;
    }
    const fattn_rtc_entry *e = fattn_rtc_entry_at(index - V2_NAOT);
    if (!e || strcmp(e->variant, "v2")) return FATTN_FAIL(err, "v2 has no config %d", index);
    if (e->dtype != dtype) return FATTN_FAIL(err, "v2 config %d is compiled for another dtype", index);
    const v2_config c = {(int)e->cfg[0], (int)e->cfg[1], (int)e->cfg[2], (int)e->cfg[3], (int)e->cfg[4]};
    *cfg = c;
    return FATTN_OK;
}

int fattn_configs_v2(int i, fattn_config_info *out) {
    static const char *names[] = {"dp", "warps", "mt", "bc", "stages"};
    v2_config c;
    memset(out, 0, sizeof *out);
    if (i < V2_NAOT) {
        c = v2_rows[i].cfg;
        out->dtypes = v2_rows[i].dtypes;
        out->role = i < V2_FIRST_SMALL_GRID ? "default" : i < V2_FIRST_RULE ? "small_grid"
                  : i < V2_FIRST_RULE + V2_NRULES ? "rule" : "sweep";
    } else {
        const fattn_rtc_entry *e = fattn_rtc_entry_at(i - V2_NAOT);
        if (!e) return 0;
        if (strcmp(e->variant, "v2")) { /* another variant's run-time kernel: listed as nothing v2 can run */
            out->role = "other";
            return 1;
        }
        const v2_config r = {(int)e->cfg[0], (int)e->cfg[1], (int)e->cfg[2], (int)e->cfg[3], (int)e->cfg[4]};
        c = r;
        out->dtypes = 1 << e->dtype;
        out->role = "runtime";
    }
    const int64_t values[] = {c.dp, c.warps, c.mt, c.bc, c.stages};
    out->n = 5;
    for (int k = 0; k < 5; k++) {
        out->names[k] = names[k];
        out->values[k] = values[k];
    }
    out->smem = V2_SMEM_BYTES(c.dp, c.warps, c.mt, c.bc, c.stages);
    return 1;
}

fattn_status fattn_check_config_v2(const int64_t *v, int n, int d, int dtype, size_t smem_limit) {
    if (n != 5) return FATTN_FAIL(FATTN_ERR_INVALID, "a v2 config has 5 fields (dp, warps, mt, bc, stages)");
    const int dp = (int)v[0], warps = (int)v[1], mt = (int)v[2], bc = (int)v[3], stages = (int)v[4];
    if (dtype != FATTN_F16 && dtype != FATTN_BF16) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 runs fp16 and bf16 only");
    if (dp != fattn_head_dim_bucket(d))
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "dp %d is not head dim %d's bucket (%d)", dp, d, fattn_head_dim_bucket(d));
    if (warps < 1 || warps > 16 || mt < 1 || mt > 8 || (stages != 1 && stages != 2) || bc < 16 || bc > 256)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "warps 1-16, mt 1-8, stages 1 or 2, bc 16-256");
    if (bc % 16) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "bc must be a multiple of 16");
    const int threads = 32 * warps, chunks = dp / 8, br = 16 * mt * warps, rstep = threads / chunks;
    if (threads % chunks || (br * chunks) % threads || (bc * chunks) % threads || (8 % rstep && rstep % 8))
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "tile rows do not split evenly over the threads");
    const size_t smem = V2_SMEM_BYTES(dp, warps, mt, bc, stages);
    if (smem > smem_limit) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "shared memory %zu B > %zu B", smem, smem_limit);
    if (V2_ACC_REGS(dp, mt, bc, 1) > V2_ACC_LIMIT)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "%d accumulator registers per thread would spill (> %d)",
                          V2_ACC_REGS(dp, mt, bc, 1), V2_ACC_LIMIT);
    return FATTN_OK;
}

static int aligned(const void *ptr, int64_t bytes) { return (uintptr_t)ptr % (uintptr_t)bytes == 0; }

/* v2 reads q, k, v with 16-byte cp.async copies and writes out two elements at a time. */
static fattn_status v2_check_tensors(const attn_params *p) {
    const int ok = aligned(p->q, 16) && aligned(p->k, 16) && aligned(p->v, 16) && aligned(p->o, 4) &&
                   p->q_stride_b % 8 == 0 && p->q_stride_h % 8 == 0 && p->q_stride_s % 8 == 0 &&
                   p->k_stride_b % 8 == 0 && p->k_stride_h % 8 == 0 && p->k_stride_s % 8 == 0 &&
                   p->v_stride_b % 8 == 0 && p->v_stride_h % 8 == 0 && p->v_stride_s % 8 == 0 &&
                   p->o_stride_b % 2 == 0 && p->o_stride_h % 2 == 0 && p->o_stride_s % 2 == 0;
    if (!ok)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED,
                          "v2 needs q, k, v 16-byte aligned with strides a multiple of 8 elements (and out 4-byte "
                          "aligned with even strides)");
    return FATTN_OK;
}

/* The config a call runs: an explicit override (checked), else the tuned config registered for this problem, else
 * its bucket's default -- or the small-grid config when the default's grid would idle multiprocessors or Sq fits
 * 64 rows, or the first matching V2_RULES entry. */
static fattn_status v2_choose(const attn_params *p, const fattn_tuned *tuned, const fattn_overrides *ov,
                              const fattn_plan *plan, int *index, v2_config *cfg) {
    const int mods = fattn_score_mods(p); /* a softcap or ALiBi: kernels for the first V2_FIRST_RULE configs only */
    if (ov->config >= 0) { /* a config the caller named but v2 cannot run is an error, not a reason to fall back */
        fattn_status st = v2_lookup(ov->config, p->dtype, cfg, FATTN_ERR_INVALID);
        if (st) return st;
        if (mods && ov->config >= V2_FIRST_RULE)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d has no softcap / ALiBi kernel (configs 0-%d do)",
                              ov->config, V2_FIRST_RULE - 1);
        if (cfg->dp < p->d) return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d is for head dims <= %d", ov->config, cfg->dp);
        *index = ov->config;
        return FATTN_OK;
    }
    const fattn_tuned_entry *t = fattn_tuned_find(tuned, (int)(plan->variant - fattn_gpu_variants), plan->dev.id, p);
    if (t && !(mods && t->config >= V2_FIRST_RULE) &&
        !v2_lookup(t->config, p->dtype, cfg, FATTN_ERR_UNSUPPORTED)) {
        *index = t->config;
        return FATTN_OK;
    }
    const int bucket = bucket_of(p->d);
    const v2_config *c = &v2_rows[bucket].cfg;
    const int64_t br = 16 * c->mt * c->warps;
    int idx = bucket;
    if ((p->sq + br - 1) / br * p->b * p->h < plan->dev.sm_count || p->sq <= 64) {
        idx = V2_FIRST_SMALL_GRID + bucket;
    } else if (!mods) {
        for (int r = 0; r < V2_NRULES; r++)
            if (v2_rules[r].dp == c->dp && v2_rules[r].causal == (p->mask.causal != 0) && p->sk >= v2_rules[r].sk_min &&
                p->sk <= v2_rules[r].sk_max) {
                idx = V2_FIRST_RULE + r;
                break;
            }
    }
    *index = idx;
    *cfg = v2_rows[idx].cfg;
    return FATTN_OK;
}

/* Heads fastest for causal calls with >= 2k keys: every head's longest block first evens out blocks of very unequal
 * length, and the blocks of one head running at once still share its K/V.  Shorter causal calls and every
 * non-causal call: head by head, or each block re-reads its head's K/V from DRAM.  Measured on the H100, same kernel,
 * only the order changed (evidence/bench/h100_v2_ab_orders_1abef9c.json), fa3 grid, head by head / heads fastest in
 * TFLOP/s: causal D=128 S=512 194 / 184, 2k 292 / 317, 16k 348 / 380; D=256 S=512 194 / 133, 2k 275 / 297;
 * non-causal D=256 S=512 265 / 164. */
static int v2_order(const attn_params *p) {
    return p->mask.causal && p->sk >= 2048 ? FATTN_ORDER_BLOCKS : FATTN_ORDER_HEADS;
}

/* Split-KV only when the grid has fewer blocks than multiprocessors (decode: Sq = 1 and a small batch; paged calls:
 * below): enough splits to give each multiprocessor SPLIT_CTAS_PER_SM blocks, each split at least
 * SPLIT_MIN_KEY_BLOCKS key blocks long.  Measured on the H100 and H200 (evidence/bench/h1?0_split_sweep_*.json):
 * about 2 blocks per SM is best at B*H = 8, 32 (D = 128), and at B*H = 32 nine splits (288 blocks) lose to eight
 * (256) by 14%; at B*H = 256 any split is slower than none.
 * Paged calls whose pages are smaller than a key block (each row's page found through the table) run better with
 * more blocks in flight: up to `paged_per_sm` blocks per SM (the small-grid kernels' V2_SMALL_GRID_MIN_BLOCKS), as
 * long as each split keeps SPLIT_MIN_KEY_BLOCKS_PAGED key blocks -- where that is more splits than the rule above.
 * On an H100 (H=32, H_kv=8, D=128, pages of 16; evidence/serving/README.md): B=8 at Sk = 8k / 32k, 8 splits for 4,
 * 1.016-1.025x; B=1 at 8k, 64 splits of 4 key blocks for 32, 0.99x (hence the floor). */
#define SPLIT_CTAS_PER_SM 2
#define SPLIT_MIN_KEY_BLOCKS 4
#define SPLIT_MIN_KEY_BLOCKS_PAGED 32
#define SPLIT_MAX 128
static int v2_splits(const fattn_overrides *ov, int sm_count, int64_t blocks, int64_t nkb, int paged_per_sm) {
    int64_t n = ov->splits;
    if (n == 0) {
        /* rounded down: a partial extra wave costs more than it gives */
        n = blocks >= sm_count ? 1 : sm_count * SPLIT_CTAS_PER_SM / blocks;
        if (n > nkb / SPLIT_MIN_KEY_BLOCKS) n = nkb / SPLIT_MIN_KEY_BLOCKS;
        int64_t np = sm_count * paged_per_sm / blocks;
        if (np > nkb / SPLIT_MIN_KEY_BLOCKS_PAGED) np = nkb / SPLIT_MIN_KEY_BLOCKS_PAGED;
        if (np > n) n = np;
    }
    if (n > nkb) n = nkb;
    if (n > SPLIT_MAX) n = SPLIT_MAX;
    return n < 1 ? 1 : (int)n;
}

fattn_status fattn_plan_v2(const attn_params *call, const fattn_tuned *tuned, const fattn_overrides *ov,
                           fattn_plan *plan) {
    attn_params packed; /* decode with GQA: the group's query heads as rows (one K/V read per group) */
    const int pack = fattn_pack_gqa(call, &packed);
    const attn_params *p = pack ? &packed : call;
    plan->head_group = pack ? call->h_per_kv : 1;
    const char *missing = fattn_missing_feature(p, FATTN_TAKES_VARLEN | FATTN_TAKES_SEQUSED | FATTN_TAKES_PAGED |
                                                       FATTN_TAKES_SOFTCAP | FATTN_TAKES_ALIBI);
    if (missing) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 does not take %s yet", missing);
    /* its online softmax scales (m_old - m_new) by |scale log2 e|: -inf * 0 would be NaN on a row's first block */
    if (p->scale == 0.f) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 needs a non-zero scale (scale 0 runs v1)");
    fattn_status st = v2_check_tensors(p);
    v2_config c;
    int idx = 0;
    if (st || (st = v2_choose(p, tuned, ov, plan, &idx, &c))) return st;
    if (p->block_table && idx >= V2_NAOT) /* a tuned run-time config: paged kernels are compiled ahead only */
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 reads a paged cache with its compiled configs only");
    const int64_t br = 16 * c.mt * c.warps, nqb = (p->sq + br - 1) / br, blocks = nqb * p->b * p->h;
    if (blocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2: grid of %lld blocks is too large", (long long)blocks);
    /* the most key blocks a query block visits: the first or the last one's (spans are monotone in the row) */
    const fattn_span first = fattn_key_span(&p->mask, p->sq, p->sk, 0, br, c.bc);
    const fattn_span last = fattn_key_span(&p->mask, p->sq, p->sk, (nqb - 1) * br, br, c.bc);
    int64_t nkb = first.n_max - first.n_min > last.n_max - last.n_min ? first.n_max - first.n_min
                                                                     : last.n_max - last.n_min;
    /* sequences of their own lengths: any may visit every key block of the longest (the splits must cover it) */
    if (p->cu_seqlens_q || p->seqused_k || p->block_table) nkb = (p->sk + c.bc - 1) / c.bc;
    plan->config = idx;
    plan->grid_x = (unsigned)blocks;
    plan->threads = (unsigned)(32 * c.warps);
    plan->smem = V2_SMEM_BYTES(c.dp, c.warps, c.mt, c.bc, c.stages);
    plan->order = ov->order ? ov->order : v2_order(p);
    const int paged_per_sm = p->block_table && p->page_size < c.bc && idx >= V2_FIRST_SMALL_GRID &&
                                     idx < V2_FIRST_RULE ? V2_SMALL_GRID_MIN_BLOCKS(c.dp) : 0;
    plan->splits = v2_splits(ov, plan->dev.sm_count, blocks, nkb, paged_per_sm);
    plan->split_blocks = plan->splits > 1 ? (nkb + plan->splits - 1) / plan->splits : nkb;
    if (plan->splits > 1) plan->splits = (int)((nkb + plan->split_blocks - 1) / plan->split_blocks); /* none empty */
    plan->grid_y = (unsigned)plan->splits;
    plan->use_counters = plan->splits > 1 && plan->splits <= V2_MERGE_SPLITS && p->sq <= V2_MERGE_ROWS &&
                         blocks <= FATTN_ARRIVALS;
    plan->workspace_bytes = plan->splits > 1 ? (size_t)plan->splits * (size_t)(p->b * p->h * p->sq) *
                                                   (size_t)(p->d + 1) * sizeof(float) : 0;
    /* sinks: split calls join them in the merge of the splits (v2_combine.cuh), unsplit calls of the decode kernels
     * as the key that starts each row's softmax (V2_SINKS_AT_START); other calls leave them to the sinks pass */
    const int starts = idx >= V2_FIRST_SMALL_GRID && idx < V2_FIRST_RULE && !fattn_score_mods(p) &&
                       V2_SINKS_AT_START(V2_SMALL_GRID_MIN_BLOCKS(c.dp));
    plan->sinks_fused = p->sinks != NULL && (plan->splits > 1 || starts);
    return FATTN_OK;
}
