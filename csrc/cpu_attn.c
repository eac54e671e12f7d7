/* cpu_attn.c -- the CPU backend: tiled FlashAttention forward with online softmax, in C.
 *
 * Work is split over (batch, kv head, query chunk) tasks run by OpenMP threads.  A task converts the visible keys
 * of its kv head to float32 once -- K^T in blocks of Bc columns, V row-major -- and then serves every query head
 * of the GQA group and every query block Q_i (Br x d, scaled by scale*log2e) of its chunk.  Per query block it
 * keeps the running row max m_i, row sum l_i and the accumulator acc in float32, and walks the key blocks:
 *
 *   S   = Q_i K_j^T                       (Br x Bc)   masked entries -> -inf
 *   m'  = max(m_i, rowmax(S))
 *   P   = exp2(S - m')                    alpha = exp2(m_i - m')
 *   l_i = alpha * l_i + rowsum(P)
 *   acc = alpha * acc + P V_j
 *
 * and finally writes O_i = acc / l_i and LSE_i = (m_i + log2(l_i)) * ln 2.  A softcap c maps S to c tanh(S / c) first
 * (in log2 units: c log2 e), then ALiBi adds its bias (fattn_alibi_bias2).  Each task works on one sequence
 * (fattn_seq_params): dense batches, packed variable-length batches and partly filled caches alike.  Both products
 * go through one register-blocked micro-kernel (gemm_rows: 6 x 16 tiles, 12 vector accumulators) whose right-hand
 * operand is read row by row.  Query chunks split a head only when there are too few heads to keep every thread busy.
 */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_attn.h"
#include "cpu_kernel.h"
#include "tuned.h"

fattn_cpu_config fattn_cpu_default_config(void) {
    fattn_cpu_config c = {.br = 96, .bc = 128, .threads = 0}; /* from a (br, bc) sweep on 2 AVX2 cores */
    return c;
}

fattn_status fattn_cpu_check_config(const fattn_cpu_config *c) {
    if (c->br < 1 || c->br > 1024 || c->bc < NR || c->bc > 1024 || c->bc % NR || c->threads < 0)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "cpu config: need 1 <= br <= 1024, bc a multiple of %d in [%d, 1024] "
                          "and threads >= 0", NR, NR);
    return FATTN_OK;
}

void fattn_cpu_plan(const attn_params *p, const fattn_tuned *tuned, const fattn_overrides *ov, fattn_plan *plan) {
    const fattn_tuned_entry *t = fattn_tuned_find(tuned, FATTN_TUNED_CPU, 0, p);
    plan->variant = NULL;
    plan->config = -1;
    plan->splits = 1;
    plan->cpu = ov && ov->cpu.br ? ov->cpu : t ? t->cpu : fattn_cpu_default_config();
}

typedef struct {
    float *q;     /* Br x dp, scaled by scale_log2 */
    float *kt;    /* K^T of the task's keys in blocks of Bc columns: [block][dp][Bc] */
    float *v;     /* V of the task's keys in blocks of Bc rows: [block][Bc][dp] */
    float *s;     /* Br x Bc: S, then P */
    float *acc;   /* Br x dp */
    float *m, *l; /* Br */
    float slope2; /* ALiBi's slope of the head in hand, log2 units */
    int64_t keys; /* the keys kt and v have room for: a sequence's are clamped to it (its lengths are the caller's
                     memory, which another thread may change while the call runs) */
} scratch;

/* K^T and V of keys [k0, k1) of kv head (b, hk) (k0 a multiple of bc), converted to float32, per key block of bc keys
 * (block 0 holds keys [k0, k0 + bc)) in the micro-kernel's strips: K^T as dp x bc, V as bc x dp.  Padding keys and
 * columns are zero. */
static void pack_kv(const attn_params *p, int64_t bc, int64_t b, int64_t hk, int64_t k0, int64_t k1, scratch *w) {
    pack_rows(p, p->k, b * p->k_stride_b + hk * p->k_stride_h, p->k_stride_b, p->k_stride_s, k0, k1 - k0, bc, w->kt,
              NULL);
    pack_rows(p, p->v, b * p->v_stride_b + hk * p->v_stride_h, p->v_stride_b, p->v_stride_s, k0, k1 - k0, bc, NULL,
              w->v);
}

/* S = Q_i K_j^T of one key block, masked -> softmax update -> acc += P V_j, for query rows [i0, i0 + br); the
 * block holds keys [j0, j0 + n) and every row sees all of them when `full`. */
static void block_step(const attn_params *p, const fattn_cpu_config *cfg, scratch *w, int br, int64_t i0, int64_t j0,
                       int64_t n, const float *kt, const float *vb, int full) {
    const int64_t dp = round_up(p->d, NR), bc = cfg->bc, np = round_up(n, NR);
    /* S = Q_i K_j^T (already in log2 units) */
    gemm_rows(w->q, dp, kt, dp * NR, w->s, bc, br, (int)np, (int)p->d, 0);
    if (p->softcap > 0.f) softcap_rows(w->s, bc, br, np, p->softcap * FATTN_LOG2E, NULL);
    if (p->alibi_slopes) alibi_rows(w->s, bc, br, n, w->slope2, i0 + p->sk - p->sq, j0);
    for (int r = 0; r < br; r++) {
        float *s = w->s + r * bc;
        int64_t lo = 0, hi = n; /* keys [lo, hi) of this block the row sees */
        if (!full) {
            fattn_row_keys(&p->mask, p->sq, p->sk, i0 + r, &lo, &hi);
            lo = lo - j0 < 0 ? 0 : lo - j0 > n ? n : lo - j0;
            hi = hi - j0 < lo ? lo : hi - j0 > n ? n : hi - j0;
        }
        for (int64_t c = 0; c < lo; c++) s[c] = -INFINITY;
        for (int64_t c = hi; c < np; c++) s[c] = -INFINITY;
        const float mx = row_max(s, np, w->m[r]);
        if (mx == -INFINITY) { /* nothing visible yet in this row */
            memset(s, 0, sizeof(float) * np);
            continue;
        }
        const float alpha = exp2f(w->m[r] - mx);
        v8f sum = {0};
        for (int64_t c = 0; c < np; c += 8) {
            v8f e = exp2_v8(loadv(s + c) - mx);
            storev(s + c, e);
            sum += e;
        }
        float rs = 0.f;
        for (int i = 0; i < 8; i++) rs += sum[i];
        w->l[r] = w->l[r] * alpha + rs;
        w->m[r] = mx;
        if (alpha != 1.f) {
            float *a = w->acc + r * dp;
            for (int64_t e = 0; e < dp; e++) a[e] *= alpha;
        }
    }
    /* acc += P V_j */
    gemm_rows(w->s, bc, vb, bc * NR, w->acc, dp, br, (int)dp, (int)np, 1);
}

/* Query rows [i0, i0 + Br) of head (b, h) against the packed keys of its kv head (packed from key k0 on). */
static void attn_block(const attn_params *p, const fattn_cpu_config *cfg, scratch *w, int64_t b, int64_t h,
                       int64_t i0, int64_t k0) {
    const int64_t d = p->d, dp = round_up(d, NR), bc = cfg->bc;
    const int br = (int)(p->sq - i0 < cfg->br ? p->sq - i0 : cfg->br);
    const int64_t q_off = b * p->q_stride_b + h * p->q_stride_h;

    for (int r = 0; r < br; r++) {
        float *qr = w->q + r * dp;
        for (int64_t c = 0; c < d; c++)
            qr[c] = load_elem(p->q, q_off + (i0 + r) * p->q_stride_s + c, p->dtype) * p->scale_log2;
        for (int64_t c = d; c < dp; c++) qr[c] = 0.f;
        memset(w->acc + r * dp, 0, sizeof(float) * dp);
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    w->slope2 = fattn_alibi_slope2(p, b, h);
    const fattn_span sp = fattn_key_span(&p->mask, p->sq, p->sk, i0, br, bc);
    for (int64_t n = sp.n_min; n < sp.n_max; n++) { /* keys past k_end, which no row sees, are not computed */
        const int64_t j0 = n * bc, rel = j0 - k0, len = sp.k_end - j0 < bc ? sp.k_end - j0 : bc;
        block_step(p, cfg, w, br, i0, j0, len, w->kt + (rel / bc) * dp * bc, w->v + (rel / bc) * dp * bc,
                   n >= sp.n_full_min && n < sp.n_full_max);
    }

    for (int r = 0; r < br; r++) {
        const int64_t i = i0 + r;
        const float l = w->l[r], inv = l > 0.f ? 1.f / l : 0.f;
        const int64_t o_off = b * p->o_stride_b + h * p->o_stride_h + i * p->o_stride_s;
        for (int64_t e = 0; e < d; e++) store_elem(p->o, o_off + e, w->acc[r * dp + e] * inv, p->dtype);
        if (p->lse)
            p->lse[b * p->lse_stride_b + h * p->lse_stride_h + i] =
                l > 0.f ? (w->m[r] + log2f(l)) * FATTN_LN2 : -INFINITY;
    }
}

/* Query blocks [qb0, qb1) of every query head that reads kv head (b, hk), clipped to the sequence's query blocks.
 * The keys any of them sees are packed once. */
static void task_blocks(const attn_params *p, const fattn_cpu_config *cfg, scratch *w, int64_t b, int64_t hk,
                        int64_t qb0, int64_t qb1) {
    const int64_t nqb = (p->sq + cfg->br - 1) / cfg->br;
    qb1 = qb1 < nqb ? qb1 : nqb;
    if (qb0 >= qb1) return;
    const int64_t i0 = qb0 * cfg->br, rows = (qb1 - qb0) * cfg->br;
    const fattn_span sp = fattn_key_span(&p->mask, p->sq, p->sk, i0, rows, cfg->bc);
    const int64_t k0 = sp.n_min * cfg->bc, k1 = sp.n_max * cfg->bc < p->sk ? sp.n_max * cfg->bc : p->sk;
    pack_kv(p, cfg->bc, b, hk, k0, k1 > k0 ? k1 : k0, w);
    for (int64_t g = 0; g < p->h_per_kv; g++)
        for (int64_t qb = qb1 - 1; qb >= qb0; qb--) attn_block(p, cfg, w, b, hk * p->h_per_kv + g, qb * cfg->br, k0);
}

/* One task.  A dense call works on batch b of the caller's params; a packed or partly filled one on a copy for
 * sequence b alone (fattn_seq_params).  Kept apart: hot loops reading the params through a local copy ran 10-35%
 * slower on 2 AVX2 cores (gcc -O3), so dense calls never see one. */
static void attn_task(const attn_params *p, const fattn_cpu_config *cfg, scratch *w, int64_t b, int64_t hk,
                      int64_t qb0, int64_t qb1) {
    if (!p->cu_seqlens_q && !p->seqused_k && !p->block_table) {
        task_blocks(p, cfg, w, b, hk, qb0, qb1);
        return;
    }
    attn_params seq;
    fattn_seq_params(p, b, &seq);
    if (seq.sk > w->keys) seq.sk = w->keys;
    task_blocks(&seq, cfg, w, 0, hk, qb0, qb1);
}

/* The longest key range any sequence of p uses: a KV cache's filled length (seqused_k, host memory here, plus the
 * call's new keys) where given, else Sk -- a head's packed keys need no more room than that. */
static int64_t keys_used(const attn_params *p) {
    if (!p->seqused_k) return p->sk;
    int64_t most = 0;
    for (int64_t b = 0; b < p->b; b++) {
        const int64_t n = p->seqused_k[b] + p->seqused_k_plus;
        if (n > most) most = n;
    }
    return most < p->sk ? most : p->sk;
}

struct fattn_cpu_work {
    int nthreads;
    int64_t chunks, per_chunk, ntask, nqb;
    scratch s[]; /* one per thread */
};

static void scratch_free(scratch *w) {
    free(w->q); free(w->kt); free(w->v); free(w->s); free(w->acc); free(w->m); free(w->l);
}

void fattn_cpu_work_free(fattn_cpu_work *w) {
    if (!w) return;
    for (int i = 0; i < w->nthreads; i++) scratch_free(&w->s[i]);
    free(w);
}

fattn_status fattn_cpu_work_alloc(const attn_params *p, const fattn_cpu_config *cfg, fattn_cpu_work **out) {
    *out = NULL;
    const fattn_cpu_config c = *cfg;
    fattn_status st = fattn_cpu_check_config(&c);
    if (st) return st;
    const int64_t nqb = (p->sq + c.br - 1) / c.br, heads = p->b * p->h_kv;
    int nthreads = 1;
#ifdef _OPENMP
    nthreads = c.threads > 0 ? c.threads : omp_get_max_threads();
#endif
    /* Split a head's query blocks into chunks only when there are fewer than ~2 tasks per thread. */
    int64_t chunks = heads ? (2 * nthreads + heads - 1) / heads : 0;
    if (chunks > nqb) chunks = nqb;
    const int64_t per_chunk = chunks ? (nqb + chunks - 1) / chunks : 0, ntask = heads * chunks;
    if (nthreads > ntask) nthreads = ntask > 0 ? (int)ntask : 0;
    fattn_cpu_work *w = calloc(1, sizeof *w + (size_t)nthreads * sizeof(scratch));
    if (!w) return FATTN_FAIL(FATTN_ERR_NOMEM, "cpu backend: out of memory for scratch buffers");
    *w = (fattn_cpu_work){nthreads, chunks, per_chunk, ntask, nqb};
    const int64_t keys = keys_used(p), dp = round_up(p->d, NR), kpad = round_up(keys, c.bc);
    int failed = 0;
    for (int i = 0; i < nthreads && !failed; i++) {
        scratch *x = &w->s[i];
        *x = (scratch){alloc_floats2(c.br, dp), alloc_floats2(kpad, dp), alloc_floats2(kpad, dp),
                       alloc_floats2(c.br, c.bc), alloc_floats2(c.br, dp), alloc_floats2(c.br, 1),
                       alloc_floats2(c.br, 1), 0.f, keys};
        failed = !x->q || !x->kt || !x->v || !x->s || !x->acc || !x->m || !x->l;
    }
    if (failed) {
        fattn_cpu_work_free(w);
        return FATTN_FAIL(FATTN_ERR_NOMEM, "cpu backend: out of memory for scratch buffers (%lld keys of head dim %lld "
                          "per thread)", (long long)kpad, (long long)p->d);
    }
    *out = w;
    return FATTN_OK;
}

fattn_status fattn_cpu_forward(const attn_params *p, const fattn_cpu_config *cfg, fattn_cpu_work *w) {
    if (w->ntask == 0) return FATTN_OK;
    const fattn_cpu_config c = *cfg;
    const int64_t chunks = w->chunks, per_chunk = w->per_chunk, ntask = w->ntask, nqb = w->nqb, heads = p->b * p->h_kv;
#ifdef _OPENMP
#pragma omp parallel num_threads(w->nthreads)
#endif
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < ntask; t++) {
            /* last chunks first: under a causal mask they are the longest */
            const int64_t ch = chunks - 1 - t / heads, bh = t % heads;
            const int64_t qb0 = ch * per_chunk, qb1 = qb0 + per_chunk < nqb ? qb0 + per_chunk : nqb;
            if (qb0 < qb1) attn_task(p, &c, &w->s[me], bh / p->h_kv, bh % p->h_kv, qb0, qb1);
        }
    }
    return FATTN_OK;
}
