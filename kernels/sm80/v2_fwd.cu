/* v2_fwd.cu -- version 2: tensor cores through mma.sync (sm_80+), the FlashAttention-2 structure.
 *
 * A block of WARPS warps owns Br = 16 * MT * WARPS query rows of one (b, h); each warp owns MT row tiles of 16,
 * so the online softmax never leaves the warp and every K/V fragment read from shared memory feeds MT MMAs.
 * Per key block K_j, V_j (Bc keys):
 *   S = Q K_j^T         mma.m16n8k16; Q fragments in registers when they fit beside S and O (and the kernel is built
 *                       for one block per SM), else re-read by ldmatrix; K fragments by ldmatrix from XOR-swizzled
 *                       (bank-conflict-free) shared memory, addressed as one base per operand XOR a compile-time step
 *                       (swz_addr / swz_step; the tile helpers are v2_tiles.cuh)
 *   MODS (a kernel of its own): S2 = S * scale log2 e, then the softcap c: S2 -> c2 tanh(S2 / c2) (c2 = c log2 e),
 *                       then ALiBi's -slope2 |pos - j| (fattn_alibi_bias2); the softmax then runs on S2 (c = 1)
 *   masked -> -inf (only in diagonal / tail blocks: unmasked blocks skip the test)
 *   m' = max(m, rowmax S) (quad shuffles),  P = exp2((S - m') * c) with c = |scale| log2 e (a negative scale
 *                       flips Q's sign bits instead, exact),  l = alpha * l + rowsum P
 *   O = alpha * O + P V_j   P re-packed from the S accumulators into A fragments (no shared memory),
 *                       V fragments by ldmatrix.trans
 * K and V stream through cp.async: STAGES = 1 interleaves them in one buffer each (V_j lands while S_j is
 * computed, K_{j+1} while P V_j is); STAGES = 2 double-buffers both, a whole block ahead.
 * Each query block visits the key blocks its rows see (mask.h: fattn_key_span); keys past the last one any row sees
 * are zero-filled, never read (no reads past a sequence's end).
 * Head dims are bucketed at compile time (DP = 64 / 128 / 256, columns past d zero-filled); fp16 and bf16.
 * Needs 16-byte aligned q/k/v with strides a multiple of 8 elements (fattn falls back to v1 otherwise).
 * The (WARPS, MT, Bc, STAGES) configurations compiled in are the table in v2_configs.h; bench/ab.py times them; any
 * other configuration is compiled at run time by NVRTC (fattn/_rtc.py: this file with FATTN_V2_RTC and the
 * configuration as macros) for fattn.tune and the tuned-config cache.  v2_plan.c chooses the config, the grid, the
 * key splits and the block order of a call; this file holds the kernels and their launcher.
 * Split-KV (flash-decoding): when the grid has fewer blocks than SMs (decode with a small batch), blockIdx.y splits
 * each query block's key blocks, each split writes an fp32 partial O and its LSE, and the last split of the query
 * block to finish merges them (decode calls of few splits) or v2_combine does (v2_combine.cuh; the rule:
 * v2_plan.c); at (B, H) = (1, 32), Sk = 8k, D = 128: 1.97 TB/s with 8 splits vs 0.71 without
 * (evidence/bench/h100_split_sweep_fd91998.json).  On Hopper v2_combine is the split kernel's programmatic dependent
 * (scheduled while the splits run, it waits for them): B=1 GQA decode at 8k / 32k 1.012-1.036x
 * (evidence/serving/README.md, 2b50abc).
 * Blocks go head by head (K/V shared in L2 by the blocks in flight) or heads fastest (longest first over all heads),
 * as the plan says.
 * Speed (H100 80GB HBM3, evidence/bench/h100_v2_ratios_ad311e5.md): fa3 grid fp16 176-371 TFLOP/s, 0.94-1.33x torch's
 * FlashAttention-2 (>= 1.0 at 29 of 36 points; bf16 0.95-1.26x) and 0.47-0.72x torch cudnn; decode 2.60-3.11 TB/s of
 * K+V, 1.00-1.01x cudnn (h100_v2_decode_ad311e5.json; 0.99-1.01x at 5504930, evidence/serving/README.md).  Before the
 * address and order work (e64432d): 0.79-1.07x.
 * Run: python -m fattn.bench --grid fa3.
 */
#include "../mma.cuh"
#include "v2_configs.h"

#ifndef __CUDACC_RTC__
#include "../../csrc/rtc.h"
#include "../../csrc/variants.h"
#endif

#include "v2_tiles.cuh"

/* Split-KV (flash-decoding): with o_part set, split y = blockIdx.y covers the query block's key blocks n_min + [y bps,
 * (y + 1) bps) (bps = blocks_per_split) and writes its normalised partial output (fp32) and its LSE instead of O;
 * with arrivals set, the query block's last split to finish merges them (v2_merge_rows), else v2_combine does.
 * o_part NULL: one split, O written directly. */
typedef struct {
    float *o_part;        /* [splits][b * h][sq][d] */
    float *lse_part;      /* [splits][b * h][sq], natural log, -inf for a split that saw no key */
    int blocks_per_split; /* key blocks of BC keys per split (from the plan) */
    int heads_fastest;    /* block order: 1 = every head's last query block, then every head's next
                             (FATTN_ORDER_BLOCKS); 0 = one head's query blocks after another, the last first */
    unsigned *arrivals;   /* NULL, or a zeroed count per query block (blockIdx.x) of the splits done: the last one
                             merges and zeroes it again */
} v2_split;

#include "v2_combine.cuh"

/* The forward pass of one block; v2_fwd (compiled ahead of time) and fattn_v2_rtc (compiled at run time by NVRTC
 * with the configuration as macros) are both this body. */
template <typename T, int DP, int WARPS, int MT, int BC, int STAGES, bool PAGED, bool MODS, int MINB>
DEV void v2_body(const attn_params all, const v2_split sp) {
    constexpr int THREADS = WARPS * 32, BR = 16 * MT * WARPS;
    constexpr int KSTEPS = DP / 16; /* k-steps of S = Q K^T */
    constexpr int NT = BC / 8;      /* n8 tiles of S */
    constexpr int DT = DP / 8;      /* n8 tiles of O */
    /* Q's fragments stay in registers when they and the S and O accumulators fit (else ldmatrix per k-step) */
    constexpr bool Q_IN_REGS = V2_Q_IN_REGS(DP, MT, BC, V2_ARCH_MIN_BLOCKS(MINB));
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw, *sK = sQ + BR * DP, *sV = sK + STAGES * BC * DP;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7; /* ldmatrix: which 8x8 matrix this lane addresses, and its row */
    const int64_t nqb = (all.sq + BR - 1) / BR, nbh = all.b * all.h;
    /* Block order (the hardware hands blocks out in order; the plan chooses): head by head, the blocks running
     * at once share a few heads' K and V in L2; heads fastest, every head's last (with causal masking, longest)
     * query block runs first and the grid ends on short blocks.  Either way a head's last query block comes first. */
    const int64_t bh = sp.heads_fastest ? blockIdx.x % nbh : blockIdx.x / nqb;
    const int64_t i0 = (nqb - 1 - (sp.heads_fastest ? blockIdx.x / nbh : blockIdx.x % nqb)) * BR;
    const int64_t b = 0, h = bh % all.h;
    /* sequence bh / h's pointers and lengths (dense, packed varlen, a cache's used keys, paged); the rest from all */
    const fattn_seq seq = fattn_seq_of(&all, bh / all.h);
    const attn_params &p = all;
    if (i0 >= seq.sq) return; /* a shorter sequence of a varlen batch: nothing issued yet */
    HEAD_OFFSETS(p, b, h);
    const T *q = (const T *)seq.q + q_off + i0 * p.q_stride_s;
    const T *k = (const T *)seq.k + k_off, *v = (const T *)seq.v + v_off;
    const int d = (int)p.d;

    /* the key blocks this query block visits; blocks [n_full_min, n_full_max) need no mask */
    const fattn_span span = fattn_key_span(&p.mask, seq.sq, seq.sk, i0, BR, BC);
    int64_t lo_last, kend; /* no row of the block sees key kend or later */
    fattn_row_keys(&p.mask, seq.sq, seq.sk, (i0 + BR < seq.sq ? i0 + BR : seq.sq) - 1, &lo_last, &kend);
    (void)lo_last;
    const int nfull_min = (int)span.n_full_min, nfull_max = (int)span.n_full_max;
    const int jb_begin = (int)span.n_min + (sp.o_part ? (int)blockIdx.y * sp.blocks_per_split : 0);
    const int jb_end = sp.o_part ? min((int)span.n_max, jb_begin + sp.blocks_per_split) : (int)span.n_max;
    const int wrow = warp * 16 * MT;                 /* the warp's first row in the block; this thread's rows
                                                        are wrow + 16 mt + g (+ 8) */
    /* ldmatrix addresses of step 0 (swz_addr): Q and P V's V by k-step / d-step, K by k-step */
    const unsigned qa = swz_addr<DP>(smem_u32(sQ), wrow + r8 + (mi & 1) * 8, mi >> 1);
    const unsigned ka = swz_addr<DP>(smem_u32(sK), r8 + (mi >> 1) * 8, mi & 1);
    const unsigned va = swz_addr<DP>(smem_u32(sV), r8 + (mi & 1) * 8, mi >> 1);

    const T *kthr = k + load_origin<DP>(p.k_stride_s, tid), *vthr = v + load_origin<DP>(p.v_stride_s, tid);
    /* One key tile of K or V.  Paged: a tile inside one page (page_size a multiple of BC) is the contiguous copy from
     * that page's row (one table read per tile); a tile of whole pages (BC a multiple of page_size) addresses its rows
     * by shifts; other page sizes take the row-by-row copy with divisions. */
    const bool whole_pages = PAGED && p.page_size < BC && BC % (int)p.page_size == 0; /* then a power of 2 */
    const int page_shift = whole_pages ? __ffs((int)p.page_size) - 1 : 0;
    /* PAGED, page_size a multiple of BC: the page holding key tile j0 and the tile's first row in it (keys < 2^31),
     * and the tile's copy from there */
    auto page_of = [&](int64_t j0, int64_t *row) {
        const int j = (int)j0, ps = (int)p.page_size;
        *row = j % ps;
        return (int64_t)__ldg(seq.block_table + j / ps);
    };
    auto load_in_page = [&](T *dst, const T *thr, int64_t stride_b, int64_t stride_s, int64_t page, int64_t row,
                            int64_t j0) {
        load_tile<T, DP, BC, THREADS>(dst, thr + page * stride_b + row * stride_s, stride_s, kend - j0, d, tid);
    };
    auto load_one = [&](T *dst, const T *head, const T *thr, int64_t stride_b, int64_t stride_s, int64_t j0) {
        if constexpr (PAGED) {
            if (p.page_size % BC == 0) {
                int64_t row;
                const int64_t page = page_of(j0, &row);
                load_in_page(dst, thr, stride_b, stride_s, page, row, j0);
            } else if (whole_pages) {
                load_tile_pages<T, DP, BC, THREADS>(dst, head, stride_b, stride_s, nullptr, head, 0, 0,
                                                    seq.block_table, page_shift, (int)j0,
                                                    (int)min(kend - j0, (int64_t)BC), d, tid);
            } else {
                load_tile_paged<T, DP, BC, THREADS>(dst, head, seq.block_table, (int)p.page_size, stride_b, stride_s,
                                                    (int)j0, (int)min(kend - j0, (int64_t)BC), d, tid);
            }
        } else {
            load_tile<T, DP, BC, THREADS>(dst, thr + j0 * stride_s, stride_s, kend - j0, d, tid);
        }
    };
    auto load_v = [&](int jb, int stage) {
        load_one(sV + stage * BC * DP, v, vthr, p.v_stride_b, p.v_stride_s, (int64_t)jb * BC);
    };
    /* K's tile (and V's): paged, both from one table read where the page size is a multiple of BC or a power of 2
     * below it (the row-by-row copy reads it twice) */
    auto load_kv = [&](int jb, int stage, bool with_v) {
        T *dk = sK + stage * BC * DP, *dv = sV + stage * BC * DP;
        const int64_t j0 = (int64_t)jb * BC;
        if constexpr (PAGED) {
            if (with_v && p.page_size % BC == 0) {
                int64_t row;
                const int64_t page = page_of(j0, &row);
                load_in_page(dk, kthr, p.k_stride_b, p.k_stride_s, page, row, j0);
                load_in_page(dv, vthr, p.v_stride_b, p.v_stride_s, page, row, j0);
                return;
            }
            if (with_v && whole_pages) {
                load_tile_pages<T, DP, BC, THREADS>(dk, k, p.k_stride_b, p.k_stride_s, dv, v, p.v_stride_b,
                                                    p.v_stride_s, seq.block_table, page_shift, (int)j0,
                                                    (int)min(kend - j0, (int64_t)BC), d, tid);
                return;
            }
        }
        load_one(dk, k, kthr, p.k_stride_b, p.k_stride_s, j0);
        if (with_v) load_v(jb, stage);
    };
    load_tile<T, DP, BR, THREADS>(sQ, q + load_origin<DP>(p.q_stride_s, tid), p.q_stride_s, seq.sq - i0, d, tid);
    if (jb_begin < jb_end) load_kv(jb_begin, 0, STAGES == 2);
    cp_async_commit();
    if (STAGES == 2) {
        if (jb_begin + 1 < jb_end) load_kv(jb_begin + 1, 1, true);
        cp_async_commit();
    }

    float o[MT][DT][4], m_i[MT][2], l_i[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        m_i[mt][0] = m_i[mt][1] = -INFINITY;
        l_i[mt][0] = l_i[mt][1] = 0.f;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
    }
    unsigned qf[Q_IN_REGS ? MT : 1][Q_IN_REGS ? KSTEPS : 1][4]; /* Q fragments of each row tile */
    /* S is computed as (sign * Q) K^T with sign = sign(scale), so that S * |scale_log2| keeps the order of S: the
     * row max is taken on raw S.  A negative scale flips Q's sign bits once in shared memory (exact for fp16/bf16),
     * so the k-step loop reads Q as it is. */
    const bool flip_q = p.scale_log2 < 0.f;
    const float sl_in = fabsf(p.scale_log2), sl = MODS ? 1.f : sl_in; /* MODS: S is in log2 units before the softmax */
    const float cap2 = p.softcap * FATTN_LOG2E, inv_cap2 = MODS && cap2 > 0.f ? 1.f / cap2 : 0.f;
    const float slope2 = MODS ? fattn_alibi_slope2(&all, bh / all.h, h) : 0.f;
    /* Attention sinks (csrc/sinks.h) in an unsplit call of a decode kernel (V2_SINKS_AT_START; a split's merge joins
     * them, and other kernels leave them to the sinks pass): the sink starts each row's softmax as one more key whose
     * value is 0 -- m at its logit (raw S units: s log2 e / sl), l = 1 on one lane of the quad (l is summed over the
     * quad at the end).  A sink of -inf is no sink; a NaN one makes l NaN, so LSE is NaN and O too on the rows that
     * see a key (the epilogue); +inf is taken as 2^100 in log2 units (O = 0, LSE huge but finite, where the pass
     * gives +inf). */
    constexpr bool SINK_START = V2_SINKS_AT_START(MINB);
    if (SINK_START && p.sinks && !sp.o_part) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int64_t i = i0 + wrow + 16 * mt + g + 8 * r;
                const float s = i < seq.sq ? fattn_sink_of(&all, h, i) : -INFINITY;
                if (s != s) {
                    if (t == 0) l_i[mt][r] = s;
                } else if (s > -INFINITY) {
                    m_i[mt][r] = fminf(s * FATTN_LOG2E, 0x1p100f) / sl;
                    if (t == 0) l_i[mt][r] = 1.f;
                }
            }
    }
    /* A warp whose rows all lie past Sq (decode: Sq = 1 uses one warp of the block) only helps load K and V. */
    const bool warp_live = i0 + wrow < seq.sq;

    for (int jb = jb_begin; jb < jb_end; jb++) {
        const int64_t j0 = (int64_t)jb * BC;
        const int stage = STAGES == 2 ? (jb - jb_begin) & 1 : 0;
        const unsigned kaj = ka + stage * BC * DP * 2, vaj = va + stage * BC * DP * 2;
        if (STAGES == 2) cp_async_wait<1>(); /* block j's group is complete; j+1's may be in flight */
        else cp_async_wait<0>();
        __syncthreads(); /* K_j (and Q) have landed; every warp is done with the buffers about to be refilled */
        if (STAGES == 1) {
            load_v(jb, 0);
            cp_async_commit();
        }
        if (flip_q && jb == jb_begin) { /* Q has landed (waited and synchronised above) */
            flip_sign_bits<DP, BR, THREADS>(sQ, tid);
            __syncthreads();
        }
        if (Q_IN_REGS && jb == jb_begin && warp_live) {
#pragma unroll
            for (int mt = 0; mt < (Q_IN_REGS ? MT : 0); mt++)
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ks++)
                    ldmatrix_x4(qf[mt][ks], swz_step(qa, ks) + 16 * mt * DP * 2);
        }

        float s[MT][NT][4];
        if (warp_live) { /* S = Q K_j^T */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if (Q_IN_REGS) {
#pragma unroll
                        for (int x = 0; x < 4; x++) a[mt][x] = qf[Q_IN_REGS ? mt : 0][Q_IN_REGS ? ks : 0][x];
                    } else {
                        ldmatrix_x4(a[mt], swz_step(qa, ks) + 16 * mt * DP * 2);
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    unsigned kb[4];
                    ldmatrix_x4(kb, swz_step(kaj, ks) + np * 16 * DP * 2);
                    const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_16816(s[mt][2 * np], a[mt], b0, T());
                        mma_16816(s[mt][2 * np + 1], a[mt], b1, T());
                    }
                }
            }

            if constexpr (MODS) { /* softcap, then ALiBi: the distance pos(row) - key in float from one conversion
                                     (row wrow + g's position minus key j0 + 2 t; the rest compile-time steps) */
                const float dist0 = (float)(int)(i0 + wrow + g + seq.sk - seq.sq - j0 - 2 * t);
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int x = 0; x < 4; x++) {
                            float e = s[mt][nt][x] * sl_in;
                            if (cap2 > 0.f) e = cap2 * fast_tanh(e * inv_cap2);
                            const float dist = dist0 + (float)(16 * mt + 8 * (x >> 1) - nt * 8 - (x & 1));
                            s[mt][nt][x] = fmaf(-slope2, fabsf(dist), e);
                        }
            }

            /* mask keys a row cannot see (diagonal and tail blocks only), in 32-bit offsets from j0 */
            if (jb < nfull_min || jb >= nfull_max) {
                /* the keys each row sees, recomputed here: keeping them costs registers the unmasked blocks need */
                const fattn_block_mask bm = fattn_block_mask_of(&p.mask, seq.sq, seq.sk, i0 + wrow + g, j0);
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        int lo, hi;
                        fattn_block_cols(&bm, 16 * mt + 8 * r, BC, &lo, &hi);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) {
                            const int c = nt * 8 + 2 * t;
                            if (c < lo || c >= hi) s[mt][nt][2 * r] = -INFINITY;
                            if (c + 1 < lo || c + 1 >= hi) s[mt][nt][2 * r + 1] = -INFINITY;
                        }
                    }
            }

            /* online softmax on this thread's 2 * MT rows: m on raw S, P = exp2((S - m) * sl).  (The one-FFMA form
             * S * sl - m * sl cancels catastrophically once |m * sl| nears 2^24: inputs of magnitude 1e5 do that.) */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    const float m_new = fmaxf(m_i[mt][r], quad_max(mx));
                    const float m_use = m_new == -INFINITY ? 0.f : m_new;
                    const float alpha = fast_exp2((m_i[mt][r] - m_use) * sl);
                    m_i[mt][r] = m_new;
                    float rs = 0.f;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        s[mt][nt][2 * r] = fast_exp2((s[mt][nt][2 * r] - m_use) * sl);
                        s[mt][nt][2 * r + 1] = fast_exp2((s[mt][nt][2 * r + 1] - m_use) * sl);
                        rs += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
                    }
                    l_i[mt][r] = l_i[mt][r] * alpha + rs;
                    /* O *= alpha, skipped when no row max of the warp moved (the common case once a row has seen
                     * its largest scores): one vote instead of DT * 2 multiplies */
                    if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
                        for (int dt = 0; dt < DT; dt++) {
                            o[mt][dt][2 * r] *= alpha;
                            o[mt][dt][2 * r + 1] *= alpha;
                        }
                    }
                }
        }

        if (STAGES == 1) {
            cp_async_wait<0>();
            __syncthreads(); /* V_j has landed; every warp is done with K_j */
            if (jb + 1 < jb_end) load_kv(jb + 1, 0, false);
            cp_async_commit();
        }

        if (warp_live) { /* O += P V_j */
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    a[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1], T());
                    a[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3], T());
                    a[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1], T());
                    a[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3], T());
                }
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    unsigned vb[4];
                    ldmatrix_x4_trans(vb, swz_step(vaj, dp) + kk * 16 * DP * 2);
                    const unsigned b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_16816(o[mt][2 * dp], a[mt], b0, T());
                        mma_16816(o[mt][2 * dp + 1], a[mt], b1, T());
                    }
                }
            }
        }

        if (STAGES == 2) {
            __syncthreads(); /* every warp is done with stage `stage`: refill it with block j + 2 */
            if (jb + 2 < jb_end) load_kv(jb + 2, stage, true);
            cp_async_commit();
        }
    }
    cp_async_wait<0>(); /* nothing may stay in flight into a block that exits */

    /* O = acc / l, LSE = (m + log2 l) ln 2 */
    T *out = (T *)seq.o + o_off;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int64_t i = i0 + wrow + 16 * mt + g + 8 * r;
            const float l = quad_sum(l_i[mt][r]);
            if (i >= seq.sq) continue;
            /* (l NaN: a NaN sink -- O NaN on a row that saw a key, 0 on one that saw none) */
            const float inv = l > 0.f ? 1.f / l : !SINK_START || m_i[mt][r] == -INFINITY ? 0.f : l;
            if (sp.o_part) { /* a split: partial O in fp32 and its LSE, merged (the sinks joined there) */
                const int64_t row = ((int64_t)blockIdx.y * nbh + bh) * all.sq + i;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    const int col = dt * 8 + 2 * t;
                    if (col < d)
                        *(float2 *)(sp.o_part + row * d + col) =
                            make_float2(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
                }
                if (t == 0) sp.lse_part[row] = lse_from(m_i[mt][r] * sl, l);
                continue;
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                const int col = dt * 8 + 2 * t;
                if (col < d)
                    *(unsigned *)(out + i * p.o_stride_s + col) =
                        pack2(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv, T());
            }
            if (seq.lse && t == 0)
                seq.lse[b * p.lse_stride_b + h * p.lse_stride_h + i] =
                    !SINK_START || l == l ? lse_from(m_i[mt][r] * sl, l) : l;
        }
    if (V2_KERNEL_MERGES(MINB) && sp.arrivals) { /* merged by the last split to finish: write, fence, count */
        __threadfence();
        __syncthreads();
        unsigned *count = sp.arrivals + blockIdx.x;
        const int last = __syncthreads_or(tid == 0 && atomicAdd(count, 1u) == gridDim.y - 1);
        if (!last) return;
        if (tid == 0) *count = 0; /* every split has counted: zero for the stream's next launch */
        __threadfence();
        v2_merge_rows<T, DP, WARPS>(sp, (int)gridDim.y, nbh * all.sq, bh * all.sq, i0, min(i0 + (int64_t)BR, seq.sq),
                                    d, (T *)seq.o + o_off, p.o_stride_s,
                                    seq.lse ? seq.lse + b * p.lse_stride_b + h * p.lse_stride_h : NULL,
                                    p.sinks ? p.sinks + fattn_sink_index(&p, h, 0) : NULL, p.sinks_by_row);
    }
}

/* PAGED: K and V read through a paged cache's block table (a kernel of its own: the per-row addressing costs the
 * contiguous loads' registers when both are compiled into one).  MODS: a softcap or ALiBi (fattn_score_mods), also
 * a kernel of its own, compiled for the default and small-grid configs only.  MINB: the blocks per multiprocessor
 * it is built for (V2_SMALL_GRID_MIN_BLOCKS; 1 elsewhere). */
template <typename T, int DP, int WARPS, int MT, int BC, int STAGES, bool PAGED, bool MODS, int MINB = 1>
__global__ void __launch_bounds__(WARPS * 32, V2_ARCH_MIN_BLOCKS(MINB)) v2_fwd(const attn_params p, const v2_split sp) {
#if __CUDA_ARCH__ >= 900
    /* Hopper: the merge kernel after split calls (a programmatic dependent, fattn_launch_v2) may be scheduled once
     * every block has started; it waits for this grid to finish (griddepcontrol.wait) */
    if (sp.o_part && !sp.arrivals) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    v2_body<T, DP, WARPS, MT, BC, STAGES, PAGED, MODS, MINB>(p, sp);
}

#ifdef FATTN_V2_RTC /* one configuration compiled by NVRTC (fattn/_rtc.py): V2_T, V2_DP, ... given as macros */
extern "C" __global__ void __launch_bounds__(V2_WARPS * 32) fattn_v2_rtc(const attn_params p, const v2_split sp) {
    v2_body<V2_T, V2_DP, V2_WARPS, V2_MT, V2_BC, V2_STAGES, false, false, 1>(p, sp);
}
#endif

#ifndef __CUDACC_RTC__ /* host code: the kernels compiled ahead of time, and the launcher */

typedef void (*v2_kernel)(const attn_params, const v2_split);

/* v2_configs.h's table, kernel by kernel: [paged][index][fp16, bf16] (NULL: not compiled for that dtype); the
 * score-modifying kernels (MODS) of its first V2_FIRST_RULE rows likewise. */
#define KERN_BOTH(dp, w, mt, bc, st)                                                                              \
    {v2_fwd<__half, dp, w, mt, bc, st, PG, MD>, v2_fwd<__nv_bfloat16, dp, w, mt, bc, st, PG, MD>},
#define KERN_F16(dp, w, mt, bc, st) {v2_fwd<__half, dp, w, mt, bc, st, PG, MD>, NULL},
#define KERN_SMALL(dp, w, mt, bc, st)                                                                            \
    {v2_fwd<__half, dp, w, mt, bc, st, PG, MD, V2_SMALL_GRID_MIN_BLOCKS(dp)>,                                     \
     v2_fwd<__nv_bfloat16, dp, w, mt, bc, st, PG, MD, V2_SMALL_GRID_MIN_BLOCKS(dp)>},
#define KERN_RULE(dp, w, mt, bc, st, causal, sk_min, sk_max) KERN_BOTH(dp, w, mt, bc, st)
#define KERN_MODS V2_DEFAULT_CONFIGS(KERN_BOTH) V2_SMALL_GRID_CONFIGS(KERN_BOTH)
#define MD false
#define PG false
static const v2_kernel v2_kernels_contiguous[V2_NAOT][2] = {V2_TABLE(KERN_BOTH, KERN_SMALL, KERN_F16, KERN_RULE)};
#undef PG
#define PG true
static const v2_kernel v2_kernels_paged[V2_NAOT][2] = {V2_TABLE(KERN_BOTH, KERN_SMALL, KERN_F16, KERN_RULE)};
#undef PG
#undef MD
#define MD true
#define PG false
static const v2_kernel v2_mods_contiguous[V2_FIRST_RULE][2] = {KERN_MODS};
#undef PG
#define PG true
static const v2_kernel v2_mods_paged[V2_FIRST_RULE][2] = {KERN_MODS};
#undef PG
#undef MD
/* Whether config i's kernels merge their own splits (V2_KERNEL_MERGES; not the MODS ones, built for one block per
 * multiprocessor) */
#define MERGES_NO(dp, w, mt, bc, st) 0,
#define MERGES_SMALL(dp, w, mt, bc, st) V2_KERNEL_MERGES(V2_SMALL_GRID_MIN_BLOCKS(dp)),
#define MERGES_RULE(dp, w, mt, bc, st, causal, sk_min, sk_max) 0,
static const unsigned char v2_merges[V2_NAOT] = {V2_TABLE(MERGES_NO, MERGES_SMALL, MERGES_NO, MERGES_RULE)};
#undef MERGES_NO
#undef MERGES_SMALL
#undef MERGES_RULE
static const v2_kernel (*const v2_kernels[2])[2] = {v2_kernels_contiguous, v2_kernels_paged};
static const v2_kernel (*const v2_mods_kernels[2])[2] = {v2_mods_contiguous, v2_mods_paged};
static const size_t v2_smem[V2_NAOT] = {
#define SMEM_ROW(dp, w, mt, bc, st) V2_SMEM_BYTES(dp, w, mt, bc, st),
#define SMEM_RULE(dp, w, mt, bc, st, causal, sk_min, sk_max) SMEM_ROW(dp, w, mt, bc, st)
    V2_TABLE(SMEM_ROW, SMEM_ROW, SMEM_ROW, SMEM_RULE)};
static const void *v2_combine_kernel[2] = {(const void *)v2_combine<__half>, (const void *)v2_combine<__nv_bfloat16>};

/* Every kernel compiled ahead of time may use the shared memory its config needs. */
extern "C" fattn_status fattn_prepare_v2(int device) {
    (void)device; /* the runtime applies the attribute on the current device, which the dispatch set */
    for (int pg = 0; pg < 2; pg++)
        for (int i = 0; i < V2_NAOT; i++)
            for (int t = 0; t < 2; t++)
                for (int md = 0; md < 1 + (i < V2_FIRST_RULE); md++) {
                    const v2_kernel kern = md ? v2_mods_kernels[pg][i][t] : v2_kernels[pg][i][t];
                    if (kern && v2_smem[i] > 48 * 1024)
                        FATTN_CUDA_CHECK(cudaFuncSetAttribute((const void *)kern,
                                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                              (int)v2_smem[i]));
                }
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v2(const attn_params *call, const fattn_plan *plan, void *stream) {
    attn_params packed; /* the planner's GQA packing (head_group > 1), made the same way */
    const attn_params *p = plan->head_group > 1 && fattn_pack_gqa(call, &packed) ? &packed : call;
    const int ti = p->dtype - FATTN_F16, mods = fattn_score_mods(p);
    v2_split sp = {NULL, NULL, (int)plan->split_blocks, plan->order == FATTN_ORDER_BLOCKS, NULL};
    if (plan->splits > 1) {
        sp.o_part = (float *)plan->workspace;
        sp.lse_part = sp.o_part + (size_t)plan->splits * (size_t)(p->b * p->h * p->sq) * (size_t)p->d;
        /* merged in the kernel where the planner asked for the stream's counters, they came and the kernel merges */
        if (plan->use_counters && plan->counters && plan->grid_x <= FATTN_ARRIVALS && !mods &&
            plan->config < V2_NAOT && v2_merges[plan->config])
            sp.arrivals = plan->counters + FATTN_TILE_WORDS;
    }
    void *args[] = {(void *)p, (void *)&sp};
    const int64_t rows = p->b * p->h * p->sq; /* the combine's blocks: checked before anything is launched */
    if (plan->splits > 1 && rows > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2: %lld rows are too many to split", (long long)rows);
    if (mods && plan->config >= V2_FIRST_RULE) /* the planner never picks one */
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2: config %d has no softcap / ALiBi kernel", plan->config);
    if (plan->config < V2_NAOT) {
        const int pg = p->block_table != NULL;
        const void *kernel = (const void *)(mods ? v2_mods_kernels[pg] : v2_kernels[pg])[plan->config][ti];
        FATTN_CUDA_CHECK(cudaLaunchKernel(kernel, dim3(plan->grid_x, plan->grid_y),
                                          dim3(plan->threads), args, plan->smem, (cudaStream_t)stream));
    } else {
        if (p->block_table) return FATTN_FAIL(FATTN_ERR_INVALID, "v2: run-time configs read no paged cache");
        const fattn_rtc_entry *e = fattn_rtc_entry_at(plan->config - V2_NAOT);
        if (!e) return FATTN_FAIL(FATTN_ERR_INVALID, "v2: no run-time config %d", plan->config);
        fattn_status st = fattn_rtc_launch(e->kernel, plan->grid_x, plan->grid_y, plan->threads, (unsigned)plan->smem,
                                           stream, args);
        if (st) return st;
    }
    if (plan->splits > 1 && !sp.arrivals) {
        int nsplit = plan->splits;
        void *cargs[] = {(void *)p, (void *)&sp, (void *)&nsplit};
        /* on Hopper as the split kernel's programmatic dependent: scheduled while it runs, so the merge starts as
         * soon as it ends (v2_combine waits for it), without the gap of a launch behind it */
        cudaLaunchAttribute overlap;
        overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        overlap.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cc = {};
        cc.gridDim = dim3((unsigned)rows);
        cc.blockDim = dim3(COMBINE_WARPS * 32);
        cc.stream = (cudaStream_t)stream;
        cc.attrs = &overlap;
        cc.numAttrs = plan->dev.sm >= 90 ? 1 : 0;
        FATTN_CUDA_CHECK(cudaLaunchKernelExC(&cc, v2_combine_kernel[ti], cargs));
    }
    return FATTN_OK;
}
#endif /* __CUDACC_RTC__ */
