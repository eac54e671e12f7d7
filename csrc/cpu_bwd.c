/* cpu_bwd.c -- the CPU backend's backward pass: FlashAttention-2's, in C (fattn.h has the formulas).
 *
 * Work is split over (batch, kv head, key chunk) tasks run by OpenMP threads.  A task converts the keys of its chunk
 * to float32 once -- K^T and V^T in blocks of Bc columns, K row-major -- and keeps float32 accumulators dK and dV for
 * them.  It then serves every query head of the GQA group and every query block Q_i (Br rows) that sees one of its
 * keys: Q_i (scaled by scale_log2) and dO_i are converted, D_i = rowsum(dO_i * O_i) computed, and per key block
 *
 *   S  = Q_i K_j^T               P  = exp2(S - LSE2_i), 0 where masked
 *   dP = dO_i V_j^T              dS = P * (dP - D_i)
 *   dV_j += P^T dO_i             dK_j += dS^T Q_i              dQ_i += dS K_j
 *
 * five products through the forward's micro-kernel (cpu_kernel.h; the two with a transposed left operand read P and
 * dS in place).  dQ_i is complete when the task's last key block is done: written directly when one task covers all
 * keys of a head, else to a float32 partial per chunk that a last pass sums in chunk order.  Chunks split a head's
 * keys only when there are too few heads to keep every thread busy.  No atomics and a fixed order of every sum: the
 * gradients are bitwise repeatable for a given thread count and config.  Under a softcap c the scores are c tanh(S / c)
 * and dS picks up the derivative 1 - tanh^2.  Each task works on one sequence (fattn_seq_bwd_params).
 */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_attn.h"
#include "cpu_kernel.h"

fattn_cpu_config fattn_cpu_default_bwd_config(void) {
    fattn_cpu_config c = {.br = 96, .bc = 64, .threads = 0}; /* an interleaved (br, bc) sweep on 2 AVX2 cores */
    return c;
}

void fattn_cpu_plan_bwd(const attn_bwd_params *p, const fattn_overrides *ov, fattn_plan *plan) {
    (void)p;
    plan->variant = NULL;
    plan->bwd = NULL;
    plan->config = -1;
    plan->splits = 1;
    plan->cpu = ov && ov->cpu.br ? ov->cpu : fattn_cpu_default_bwd_config();
}

typedef struct {
    float *kt, *vt; /* K^T, V^T of the chunk's keys in blocks of Bc columns: [block][dp][Bc] */
    float *kr;      /* K of the chunk's keys in blocks of Bc rows: [block][Bc][dp] */
    float *dk, *dv; /* [key][dp] accumulators */
    float *q, *dout, *dq; /* Br x dp: Q_i * scale_log2, dO_i, dQ_i */
    float *s, *ds;        /* Br x Bc: S then P, dP then dS */
    float *t;             /* Br x Bc: tanh(S / c) under a softcap c (dS picks up 1 - t^2) */
    float *lse2, *dsum;   /* Br: LSE_i in base 2 (+inf for a row that sees nothing), D_i */
    float slope2;         /* ALiBi's slope of the head in hand, log2 units */
} scratch;

/* K^T, V^T and K of keys [k0, k1) of kv head (b, hk) (k0 a multiple of bc), converted to float32, per key block of bc
 * keys in the micro-kernel's strips: K^T and V^T as dp x bc, K as bc x dp.  Padding keys and columns are zero. */
static void pack_keys(const attn_params *p, int64_t bc, int64_t b, int64_t hk, int64_t k0, int64_t k1, scratch *w) {
    pack_rows(p, p->k, b * p->k_stride_b + hk * p->k_stride_h, p->k_stride_b, p->k_stride_s, k0, k1 - k0, bc, w->kt,
              w->kr);
    pack_rows(p, p->v, b * p->v_stride_b + hk * p->v_stride_h, p->v_stride_b, p->v_stride_s, k0, k1 - k0, bc, w->vt,
              NULL);
}

/* Q_i (scaled), dO_i, LSE2 and D of query rows [i0, i0 + br) of head (b, h); dQ_i zeroed. */
static void load_rows(const attn_bwd_params *bp, scratch *w, int64_t b, int64_t h, int64_t i0, int br) {
    const attn_params *p = &bp->fwd;
    const int64_t d = p->d, dp = round_up(d, NR);
    for (int r = 0; r < br; r++) {
        const int64_t i = i0 + r;
        const int64_t qo = b * p->q_stride_b + h * p->q_stride_h + i * p->q_stride_s;
        const int64_t oo = b * p->o_stride_b + h * p->o_stride_h + i * p->o_stride_s;
        const int64_t go = b * bp->do_stride_b + h * bp->do_stride_h + i * bp->do_stride_s;
        float *qr = w->q + r * dp, *gr = w->dout + r * dp;
        float dsum = 0.f;
        for (int64_t e = 0; e < d; e++) {
            qr[e] = load_elem(p->q, qo + e, p->dtype) * p->scale_log2;
            gr[e] = load_elem(bp->dout, go + e, p->dtype);
            dsum += gr[e] * load_elem(p->o, oo + e, p->dtype);
        }
        for (int64_t e = d; e < dp; e++) qr[e] = gr[e] = 0.f;
        memset(w->dq + r * dp, 0, sizeof(float) * dp);
        const float lse = p->lse[b * p->lse_stride_b + h * p->lse_stride_h + i];
        w->lse2[r] = lse == -INFINITY ? INFINITY : lse * FATTN_LOG2E;
        w->dsum[r] = dsum;
    }
}

/* One key block (keys [j0, j0 + n), every row seeing all of them when `full`) against query rows [i0, i0 + br):
 * P, dS, and the three accumulations.  kt, vt: the block's packed K^T / V^T; kr, dk, dv: its first key's rows. */
static void block_step(const attn_params *p, int64_t bc, scratch *w, int br, int64_t i0, int64_t j0, int64_t n,
                       const float *kt, const float *vt, const float *kr, float *dk, float *dv, int full) {
    const int64_t dp = round_up(p->d, NR), np = round_up(n, NR);
    gemm_rows(w->q, dp, kt, dp * NR, w->s, bc, br, (int)np, (int)p->d, 0);     /* S = Q_i K_j^T (log2 units) */
    gemm_rows(w->dout, dp, vt, dp * NR, w->ds, bc, br, (int)np, (int)p->d, 0); /* dP = dO_i V_j^T */
    const int capped = p->softcap > 0.f;
    if (capped) softcap_rows(w->s, bc, br, np, p->softcap * FATTN_LOG2E, w->t);
    if (p->alibi_slopes) alibi_rows(w->s, bc, br, n, w->slope2, i0 + p->sk - p->sq, j0);
    for (int r = 0; r < br; r++) {
        float *s = w->s + r * bc, *ds = w->ds + r * bc, *t = w->t + r * bc;
        int64_t lo = 0, hi = n; /* keys [lo, hi) of this block the row sees */
        if (!full) {
            fattn_row_keys(&p->mask, p->sq, p->sk, i0 + r, &lo, &hi);
            lo = lo - j0 < 0 ? 0 : lo - j0 > n ? n : lo - j0;
            hi = hi - j0 < lo ? lo : hi - j0 > n ? n : hi - j0;
        }
        const v8f lse2 = (v8f){0} + w->lse2[r], dsum = (v8f){0} + w->dsum[r];
        for (int64_t c = 0; c < np; c += 8) {
            const v8f pr = exp2_v8(loadv(s + c) - lse2);
            v8f g = pr * (loadv(ds + c) - dsum);
            if (capped) g *= 1.f - loadv(t + c) * loadv(t + c); /* d(c tanh(s / c)) / ds */
            storev(s + c, pr);
            storev(ds + c, g);
        }
        for (int64_t c = 0; c < lo; c++) s[c] = ds[c] = 0.f;
        for (int64_t c = hi; c < np; c++) s[c] = ds[c] = 0.f;
    }
    gemm_rows_t(w->s, bc, w->dout, dp, dv, dp, (int)n, (int)dp, br, 1); /* dV_j += P^T dO_i */
    gemm_rows_t(w->ds, bc, w->q, dp, dk, dp, (int)n, (int)dp, br, 1);   /* dK_j += dS^T Q_i (scaled by scale_log2) */
    gemm_rows(w->ds, bc, kr, bc * NR, w->dq, dp, br, (int)dp, (int)n, 1);      /* dQ_i += dS K_j */
}

/* Writes rows [0, rows) of a float32 [rows][dp] array times `mul` to a strided (b, h) slice of `dst`. */
static void store_rows(void *dst, int64_t off, int64_t stride, const float *src, int64_t dp, int64_t rows, int64_t d,
                       float mul, fattn_dtype dt) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t e = 0; e < d; e++) store_elem(dst, off + r * stride + e, src[r * dp + e] * mul, dt);
}

/* Zeros into dq rows [0, rows) of head (b, h) (rows that see no key). */
static void zero_rows(const attn_bwd_params *p, int64_t b, int64_t h, int64_t rows) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t e = 0; e < p->fwd.d; e++)
            store_elem(p->dq, b * p->dq_stride_b + h * p->dq_stride_h + i * p->dq_stride_s + e, 0.f, p->fwd.dtype);
}

/* Keys of key blocks [cb0, cb1) of kv head (sb, hk) of params bp, against every query head of its group.  part:
 * NULL (the task covers every key: dQ written directly) or this chunk's float32 dQ partial [b][h][sq][dp] (sq the
 * longest sequence's), at batch b of the whole call. */
static void task_keys(const attn_bwd_params *bp, int64_t sq_all, const fattn_cpu_config *cfg, scratch *w, int64_t sb,
                      int64_t b, int64_t hk, int64_t cb0, int64_t cb1, float *part) {
    const attn_params *p = &bp->fwd;
    const int64_t d = p->d, dp = round_up(d, NR), bc = cfg->bc, br = cfg->br;
    const int64_t nkb = (p->sk + bc - 1) / bc;
    cb1 = cb1 < nkb ? cb1 : nkb;
    if (cb0 >= cb1) { /* no keys of this sequence in the chunk: its partial stays zero, or dq is zero */
        if (!part && cb0 == 0)
            for (int64_t g = 0; g < p->h_per_kv; g++) zero_rows(bp, sb, hk * p->h_per_kv + g, p->sq);
        return;
    }
    const int64_t k0 = cb0 * bc, k1 = cb1 * bc < p->sk ? cb1 * bc : p->sk;
    pack_keys(p, bc, sb, hk, k0, k1, w);
    memset(w->dk, 0, sizeof(float) * (cb1 - cb0) * bc * dp);
    memset(w->dv, 0, sizeof(float) * (cb1 - cb0) * bc * dp);
    const int64_t nqb = (p->sq + br - 1) / br;
    for (int64_t g = 0; g < p->h_per_kv; g++) {
        const int64_t h = hk * p->h_per_kv + g;
        w->slope2 = fattn_alibi_slope2(p, sb, h);
        for (int64_t qb = 0; qb < nqb; qb++) {
            const int64_t i0 = qb * br;
            const int rows = (int)(p->sq - i0 < br ? p->sq - i0 : br);
            const fattn_span sp = fattn_key_span(&p->mask, p->sq, p->sk, i0, rows, bc);
            const int64_t n0 = sp.n_min > cb0 ? sp.n_min : cb0, n1 = sp.n_max < cb1 ? sp.n_max : cb1;
            if (n0 >= n1 && part) continue; /* the partial stays zero */
            load_rows(bp, w, sb, h, i0, rows);
            for (int64_t n = n0; n < n1; n++) {
                const int64_t j0 = n * bc, rel = j0 - k0, len = sp.k_end - j0 < bc ? sp.k_end - j0 : bc;
                block_step(p, bc, w, rows, i0, j0, len, w->kt + (rel / bc) * dp * bc, w->vt + (rel / bc) * dp * bc,
                           w->kr + (rel / bc) * dp * bc, w->dk + rel * dp, w->dv + rel * dp,
                           n >= sp.n_full_min && n < sp.n_full_max);
            }
            if (part)
                memcpy(part + ((b * p->h + h) * sq_all + i0) * dp, w->dq, sizeof(float) * rows * dp);
            else
                store_rows(bp->dq, sb * bp->dq_stride_b + h * bp->dq_stride_h + i0 * bp->dq_stride_s, bp->dq_stride_s,
                           w->dq, dp, rows, d, p->scale, p->dtype);
        }
    }
    /* dK = scale * dS^T Q = ln 2 * dS^T (Q * scale_log2) */
    store_rows(bp->dk, sb * bp->dk_stride_b + hk * bp->dk_stride_h + k0 * bp->dk_stride_s, bp->dk_stride_s, w->dk, dp,
               k1 - k0, d, FATTN_LN2, p->dtype);
    store_rows(bp->dv, sb * bp->dv_stride_b + hk * bp->dv_stride_h + k0 * bp->dv_stride_s, bp->dv_stride_s, w->dv, dp,
               k1 - k0, d, 1.f, p->dtype);
}

/* One task: keys of key blocks [cb0, cb1) of kv head (b, hk).  A dense call works on batch b of the caller's
 * params, a packed one on a copy for sequence b (fattn_seq_bwd_params): the CPU forward's hot loops ran 10-35%
 * slower reading params through a local copy, so dense calls never see one. */
static void bwd_task(const attn_bwd_params *all, const fattn_cpu_config *cfg, scratch *w, int64_t b, int64_t hk,
                     int64_t cb0, int64_t cb1, float *part) {
    if (!all->fwd.cu_seqlens_q && !all->fwd.seqused_k) {
        task_keys(all, all->fwd.sq, cfg, w, b, b, hk, cb0, cb1, part);
        return;
    }
    attn_bwd_params seq;
    fattn_seq_bwd_params(all, b, &seq);
    task_keys(&seq, all->fwd.sq, cfg, w, 0, b, hk, cb0, cb1, part);
}

/* dQ = scale * sum of the chunks' partials, in chunk order, for every sequence's rows. */
static void sum_partials(const attn_bwd_params *bp, const float *part, int64_t chunks) {
    const attn_params *p = &bp->fwd;
    const int64_t dp = round_up(p->d, NR), stride = p->b * p->h * p->sq * dp;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t bh = 0; bh < p->b * p->h; bh++) {
        attn_bwd_params seq;
        fattn_seq_bwd_params(bp, bh / p->h, &seq);
        const int64_t h = bh % p->h;
        for (int64_t i = 0; i < seq.fwd.sq; i++)
            for (int64_t e = 0; e < p->d; e++) {
                float acc = 0.f;
                for (int64_t c = 0; c < chunks; c++) acc += part[c * stride + (bh * p->sq + i) * dp + e];
                store_elem(seq.dq, h * seq.dq_stride_h + i * seq.dq_stride_s + e, acc * p->scale, p->dtype);
            }
    }
}

fattn_status fattn_cpu_backward(const attn_bwd_params *bp, const fattn_cpu_config *cfg) {
    const attn_params *p = &bp->fwd;
    const fattn_cpu_config c = *cfg;
    fattn_status st = fattn_cpu_check_config(&c);
    if (st) return st;
    if (p->b * p->h * p->sq == 0 && p->b * p->h_kv * p->sk == 0) return FATTN_OK;
    const int64_t nkb = p->sk > 0 ? (p->sk + c.bc - 1) / c.bc : 1, heads = p->b * p->h_kv; /* sk = 0: dq = 0 */
    int nthreads = 1;
#ifdef _OPENMP
    nthreads = c.threads > 0 ? c.threads : omp_get_max_threads();
#endif
    int64_t chunks = (2 * nthreads + heads - 1) / heads;
    if (chunks > nkb) chunks = nkb;
    const int64_t per_chunk = (nkb + chunks - 1) / chunks, ntask = heads * chunks;
    chunks = (nkb + per_chunk - 1) / per_chunk; /* none empty */
    if (nthreads > ntask) nthreads = (int)ntask;
    const int64_t dp = round_up(p->d, NR), ckeys = per_chunk * c.bc;
    /* every buffer allocated before anything is written: a call refused for memory leaves dq, dk, dv untouched */
    scratch *ws = calloc((size_t)nthreads, sizeof *ws);
    int failed = !ws;
    for (int i = 0; i < nthreads && !failed; i++) {
        scratch *w = &ws[i];
        *w = (scratch){alloc_floats2(ckeys, dp), alloc_floats2(ckeys, dp), alloc_floats2(ckeys, dp),
                       alloc_floats2(ckeys, dp), alloc_floats2(ckeys, dp), alloc_floats2(c.br, dp),
                       alloc_floats2(c.br, dp), alloc_floats2(c.br, dp), alloc_floats2(c.br, c.bc),
                       alloc_floats2(c.br, c.bc), alloc_floats2(c.br, c.bc), alloc_floats2(c.br, 1),
                       alloc_floats2(c.br, 1), 0.f};
        failed = !w->kt || !w->vt || !w->kr || !w->dk || !w->dv || !w->q || !w->dout || !w->dq || !w->s || !w->ds ||
                 !w->t || !w->lse2 || !w->dsum;
    }
    float *part = NULL;
    const int64_t part_rows = p->b * p->h * p->sq; /* dQ partials: chunks x rows x dp floats, zeroed */
    if (!failed && chunks > 1) {
        failed = !(part = alloc_floats2(chunks * part_rows, dp));
        if (!failed) memset(part, 0, (size_t)(chunks * part_rows * dp) * sizeof(float));
    }
    if (!failed) {
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
#endif
        {
            int me = 0;
#ifdef _OPENMP
            me = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t t = 0; t < ntask; t++) {
                const int64_t ch = t / heads, bh = t % heads; /* first chunks first: with causal masking the longest */
                const int64_t cb0 = ch * per_chunk, cb1 = cb0 + per_chunk < nkb ? cb0 + per_chunk : nkb;
                bwd_task(bp, &c, &ws[me], bh / p->h_kv, bh % p->h_kv, cb0, cb1,
                         part ? part + ch * part_rows * dp : NULL);
            }
        }
        if (part) sum_partials(bp, part, chunks);
    }
    for (int i = 0; ws && i < nthreads; i++) {
        scratch *w = &ws[i];
        free(w->kt); free(w->vt); free(w->kr); free(w->dk); free(w->dv); free(w->q); free(w->dout); free(w->dq);
        free(w->s); free(w->ds); free(w->t); free(w->lse2); free(w->dsum);
    }
    free(ws);
    free(part);
    if (failed) return FATTN_FAIL(FATTN_ERR_NOMEM, "cpu backward: out of memory for scratch buffers");
    return FATTN_OK;
}
