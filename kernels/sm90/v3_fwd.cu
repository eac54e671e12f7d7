/* v3_fwd.cu -- version 3: Hopper (sm_90a) forward, the FlashAttention-3 structure.  The kernel, what it adds over
 * v2 and how fast it is: v3_fwd_kernel.cuh.  Here, its host side: the kernels compiled ahead of time as a table,
 * their shared-memory limits, and the launcher (tensor maps, the kernel for the plan's config and schedule, the
 * launch).  The planner is v3_plan.c. */
#include <cuda.h> /* CUtensorMap and its enums: types only, the driver is reached through the runtime */

#include <string.h>

#include "../../csrc/variants.h"
#include "v3_addr.h"
#include "v3_configs.h"
#include "v3_fwd_kernel.cuh"
#include "v3_tma.h"

/* ---- the kernels compiled ahead of time and the launcher ---------------------------------------------------- */

typedef struct {
    const void *kern[2][2]; /* [mods][fp16, bf16]; NULL where not compiled */
    size_t smem;
} v3_entry;

#define V3_PAIR(DP, BC, STAGES, CWG, PP, MD, SQ, DY, PG)                                                         \
    {(const void *)v3_fwd<__half, DP, BC, STAGES, CWG, PP, MD, SQ, DY, PG>,                                     \
     (const void *)v3_fwd<__nv_bfloat16, DP, BC, STAGES, CWG, PP, MD, SQ, DY, PG>}
/* V3_TABLE's kernels, with MODS for the defaults; the SEQ kernels of V3_SEQ_CONFIGS (with MODS), by bucket, with
 * the static schedule and with the dynamic one, each for contiguous and for paged K/V */
#define V3_ENTRY_MODS(DP, BC, STAGES, CWG, PP)                                                                  \
    {{V3_PAIR(DP, BC, STAGES, CWG, PP, false, false, false, false),                                              \
      V3_PAIR(DP, BC, STAGES, CWG, PP, true, false, false, false)},                                              \
     V3_SMEM(DP, BC, STAGES, CWG)},
#define V3_ENTRY(DP, BC, STAGES, CWG, PP)                                                                       \
    {{V3_PAIR(DP, BC, STAGES, CWG, PP, false, false, false, false), {NULL, NULL}}, V3_SMEM(DP, BC, STAGES, CWG)},
#define V3_SEQ_ROW(DY, PG, DP, BC, STAGES, CWG, PP)                                                              \
    {{V3_PAIR(DP, BC, STAGES, CWG, PP, false, true, DY, PG), V3_PAIR(DP, BC, STAGES, CWG, PP, true, true, DY, PG)}, \
     V3_SMEM(DP, BC, STAGES, CWG)},
#define V3_SEQ_STATIC(...) V3_SEQ_ROW(false, false, __VA_ARGS__)
#define V3_SEQ_DYN(...) V3_SEQ_ROW(true, false, __VA_ARGS__)
#define V3_SEQ_PAGED_STATIC(...) V3_SEQ_ROW(false, true, __VA_ARGS__)
#define V3_SEQ_PAGED_DYN(...) V3_SEQ_ROW(true, true, __VA_ARGS__)
static const v3_entry v3_kernels[V3_NCONFIGS] = {V3_DEFAULT_CONFIGS(V3_ENTRY_MODS) V3_SWEEP_CONFIGS(V3_ENTRY)};
/* by [paged][schedule: 0 static, 1 dynamic][bucket] */
static const v3_entry v3_seq_kernels[2][2][V3_NDEFAULTS] = {
    {{V3_SEQ_CONFIGS(V3_SEQ_STATIC)}, {V3_SEQ_CONFIGS(V3_SEQ_DYN)}},
    {{V3_SEQ_CONFIGS(V3_SEQ_PAGED_STATIC)}, {V3_SEQ_CONFIGS(V3_SEQ_PAGED_DYN)}}};
#undef V3_SEQ_PAGED_DYN
#undef V3_SEQ_PAGED_STATIC
#undef V3_SEQ_DYN
#undef V3_SEQ_STATIC
#undef V3_SEQ_ROW
#undef V3_ENTRY
#undef V3_ENTRY_MODS
#undef V3_PAIR

/* Every v3 kernel may use the shared memory its config needs (on the current device, which the dispatch set). */
extern "C" fattn_status fattn_prepare_v3(int device) {
    (void)device;
    const v3_entry *seq = &v3_seq_kernels[0][0][0]; /* the SEQ kernels' entries, one after another */
    const int nseq = (int)(sizeof v3_seq_kernels / sizeof *seq);
    for (int i = 0; i < V3_NCONFIGS + nseq; i++) {
        const v3_entry *e = i < V3_NCONFIGS ? &v3_kernels[i] : seq + (i - V3_NCONFIGS);
        for (int k = 0; k < 4; k++)
            if (e->kern[k >> 1][k & 1])
                FATTN_CUDA_CHECK(cudaFuncSetAttribute(e->kern[k >> 1][k & 1],
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)e->smem));
    }
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v3(const attn_params *p, const fattn_plan *plan, void *stream) {
    static const v3_config cfgs[V3_NCONFIGS] = {
#define CFG(dp, bc, st, cwg, pp) {dp, bc, st, cwg, pp},
        V3_TABLE(CFG)
#undef CFG
    };
    const v3_config *c = &cfgs[plan->config];
    fattn_status st = v3_tma_ready();
    if (st) return st;
    /* Broadcast K/V dimensions (stride 0) become size 1: every query head reads kv head 0 (h_per_kv = h), every
     * batch kv batch 0.  With Sk = 0 no key block is loaded, but the map still needs a non-empty shape. */
    attn_params pk = *p;
    const int64_t kv_heads = p->k_stride_h == 0 && p->h_kv > 1 ? 1 : p->h_kv;
    const int64_t kv_batch = p->k_stride_b == 0 && p->b > 1 ? 1 : p->b, sk = p->sk > 0 ? p->sk : 1;
    if (kv_heads == 1) pk.h_per_kv = p->h;
    const int kv_batch_step = kv_batch == 1 ? 0 : 1, head_group = (int)plan->head_group;
    /* Packed batches: one batch of all the rows (total_q / total_k), sequences found by their first row. */
    const int64_t rows_q = p->cu_seqlens_q ? p->total_q : p->sq, batch_q = p->cu_seqlens_q ? 1 : p->b;
    /* A paged cache: maps over the pools, (rows of a page, heads, pages), in boxes of v3_page_rows rows; the
     * producer finds each piece's page in the block table. */
    const int paged = p->block_table != NULL;
    const int64_t rows_k = paged ? p->page_size : p->cu_seqlens_k ? (p->total_k > 0 ? p->total_k : 1) : sk;
    const int64_t kv_outer = paged ? p->num_pages : kv_batch;
    const int kv_box = paged ? v3_page_rows(p->page_size, c->bc) : c->bc;
    CUtensorMap tq, tk, tv, to;
    if ((st = v3_map(&tq, p->q, p->dtype, p->d, rows_q, p->h, batch_q, p->q_stride_s, p->q_stride_h, p->q_stride_b,
                     64 * c->consumers, "q")) ||
        (st = v3_map(&tk, p->k, p->dtype, p->d, rows_k, kv_heads, kv_outer, p->k_stride_s, p->k_stride_h,
                     p->k_stride_b, kv_box, "k")) ||
        (st = v3_map(&tv, p->v, p->dtype, p->d, rows_k, kv_heads, kv_outer, p->v_stride_s, p->v_stride_h,
                     p->v_stride_b, kv_box, "v")) ||
        (st = v3_map(&to, p->o, p->dtype, p->d, rows_q, p->h, batch_q, p->o_stride_s, p->o_stride_h, p->o_stride_b,
                     64, "out")))
        return st;
    unsigned *ctr = plan->counters; /* per-sequence calls: the dynamic schedule's kernel where there is one */
    int split_tail = plan->splits > 1; /* v3_plan.c: the heads' last query blocks split over the consumers */
    void *args[] = {&tq, &tk, &tv, &to, &pk, (void *)&kv_batch_step, (void *)&head_group, (void *)&split_tail,
                    (void *)&ctr};
    /* per-sequence lengths: the bucket's V3_SEQ_CONFIGS kernel, whose table index the planner chose */
    const int seq = p->cu_seqlens_q || p->seqused_k;
    if (paged && !p->seqused_k) /* (the planner refuses it: only SEQ kernels read the block table) */
        return FATTN_FAIL(FATTN_ERR_INVALID, "v3: a paged cache needs its sequences' lengths");
    if (seq && plan->config != fattn_v3_seq_config(c->dp))
        return FATTN_FAIL(FATTN_ERR_INVALID, "v3: config %d has no kernel for per-sequence lengths", plan->config);
    const void *kernel = (seq ? &v3_seq_kernels[paged][ctr != NULL][v3_bucket(c->dp)] : &v3_kernels[plan->config])
                             ->kern[fattn_score_mods(p)][p->dtype - FATTN_F16];
    if (!kernel) return FATTN_FAIL(FATTN_ERR_INVALID, "v3: config %d has no softcap / ALiBi kernel", plan->config);
    /* as the stream's previous kernel's programmatic dependent: the kernel waits for it (griddep_wait) */
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cc = {};
    cc.gridDim = dim3(plan->grid_x);
    cc.blockDim = dim3(plan->threads);
    cc.dynamicSmemBytes = plan->smem;
    cc.stream = (cudaStream_t)stream;
    cc.attrs = &overlap;
    cc.numAttrs = 1;
    FATTN_CUDA_CHECK(cudaLaunchKernelExC(&cc, kernel, args));
    return FATTN_OK;
}
