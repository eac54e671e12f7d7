/* v2_bwd.cu -- version 2's backward: tensor cores through mma.sync (sm_80+), the FlashAttention-2 structure.
 *
 * Per (b, h), in base 2 as the forward: P = exp2(Q K^T * scale_log2 - LSE_i log2 e) is recomputed from the forward's
 * LSE (no max, no sum), then  D_i = rowsum(dO_i * O_i),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D_i),
 * dK = scale * dS^T Q,  dQ = scale * dS K.  Three kernels run on the stream, a fourth in deterministic mode:
 *
 *   bwd_prep        D_i for every row of the workspace (0 past Sq) into dpsum; zeroes dq_accum (atomic mode only)
 *   v2_bwd_dkdv     a block per (key block j, b, kv head): K_j and V_j stay in shared memory, dK_j and dV_j in
 *                   registers, while the block walks the query blocks that see key block j (mask.h's rule: the rows
 *                   seeing a key form one range, found by bisection, as are the blocks that need no mask) over the kv
 *                   head's h_per_kv query heads (GQA: dK and dV summed without expanding K and V), each block of a
 *                   head starting at a different query block so that their dQ atomics do not meet on the same rows.
 *                   Per query block Q_i, dO_i and the rows' LSE and D (cp.async, XOR-swizzled, double-buffered when
 *                   shared memory allows, the next pair's copies issued mid-step between the products):
 *                     S = Q_i K_j^T, dP = dO_i V_j^T   mma.m16n8k16, both with one warp layout so that dS = P (dP - D)
 *                                                      is element-wise in registers; masked only on edge blocks
 *                     P, dS -> shared memory (fp16 / bf16): their transposes feed the next two products, whose
 *                                                      warps own key rows, not query rows
 *                     dV += P^T dO, dK += dS^T Q       A = P^T / dS^T and B = dO / Q by ldmatrix.trans
 *                     dQ_i += dS K_j                   A = dS by ldmatrix, B = K by ldmatrix.trans, added to the fp32
 *                                                      dq_accum by atomics (sm_90: one 8-byte red per pair), a few
 *                                                      between each k-step of dV / dK (a burst stalls the warp)
 *                   then writes dV and scale * dK.  Two barriers per step (three single-buffered): P and dS are
 *                   written after the step's first barrier, which every warp passes only once done with the last
 *                   step's reads of them and of the buffer about to be refilled.
 *   bwd_convert     dQ = scale * dq_accum in the dtype (atomic mode)
 *   v2_bwd_dq       deterministic mode (no order-dependent atomics anywhere): dkdv skips dQ, and a block per query
 *                   block walks its key blocks in order (as the forward: K_j, V_j double-buffered), recomputes S, P, dP
 *                   and dS in registers and accumulates dQ = dS K there (dS repacked into A fragments, no shared
 *                   memory), writing scale * dQ: bitwise repeatable, 7 products instead of 5 (about 1.4x the MMAs).
 * MODS (kernels of their own, fattn_score_mods): a softcap c maps the score S2 to c2 tanh(S2 / c2) and ALiBi adds
 * -slope2 |pos - j| before P, as the forward; dS = P (dP - D) (1 - tanh^2).  dK/dV stores P and applies the mask at
 * the exponentials (its registers then carry P (1 - tanh^2), not the tanh).
 *
 * Tiles (v2_bwd_configs.h, FlashAttention-2's sm80 choices; 8 warps, one block per multiprocessor): D=64 Br = Bc = 128
 * (162 KiB), D=128 Br = 64, Bc = 128 (161 KiB), D=256 Br = Bc = 64 (209 KiB with Q/dO double-buffered on the H100,
 * 144.5 KiB single-buffered on the A100), and 80 KiB ones for 99 KiB parts.  What bounds them: the dK and dV
 * accumulators (Bc x D x 2 floats per block) and S, dP beside them in 255 registers, and shared-memory bandwidth --
 * every product's operands come through ldmatrix, so the warp tiles are the largest the registers allow (a warp
 * tile of a x b m16n8 MMAs costs a + b / 2 ldmatrix.x4 per k-step).
 * Rows past Sq and keys past Sk are zero-filled on load (never read) and never written; a row past Sq or with LSE =
 * -inf gets P = 0, so it contributes nothing.  Head dims are bucketed (DP = 64 / 128 / 256, columns past d
 * zero-filled and never written).  Needs 16-byte aligned q, k, v, o, dout, dq, dk, dv with b / h / s strides a
 * multiple of 8 elements (v2_bwd_plan.c refuses the rest; fattn then runs the scalar backward).
 * Speed (H100 80GB HBM3, fa3 grid, against torch 2.11's FlashAttention-2 backward, fp16 / bf16 alike; measured with
 * a standalone harness before integration): D=64 0.92-1.12x, D=128 0.96-1.18x, D=256 0.91-1.15x -- ahead at S <= 2k
 * and causal, 2-9% behind on long non-causal calls.  Not yet measured through fattn.bench.
 */
#include "../mma.cuh"
#include "v2_bwd_configs.h"

#ifndef __CUDACC_RTC__
#include "../../csrc/variants.h"
#endif

/* ---- swizzled tiles ---------------------------------------------------------------------------------------------
 * A tile is [rows][ROW] fp16 / bf16 elements (ROW a multiple of 64: rows of whole 128-byte lines), its 16-byte chunk
 * c of row r stored at chunk c ^ (r & 7): the 8 rows an ldmatrix phase reads, and the 8 rows a quad-row store of a C
 * fragment writes, land on 8 different 16-byte bank groups. */
template <int ROW> DEV int sw_off(int r, int c) { return r * ROW + ((c ^ (r & 7)) << 3); }

/* The shared-space byte address of chunk `chunk` of row `row`.  With chunk = 2 s1 + half (half 0 or 1), chunk
 * 2 (s1 + s) + half is sw_step(address, s) as long as s1 and s share no set bit (a warp's base s1 is a multiple of
 * the power-of-two range of s): an XOR of address bits 5-6 by s % 4 and 128 bytes per 4 steps, so the k-step and
 * n-pair loops address with immediates.  Rows are added as immediates in multiples of 8 (the swizzle period). */
template <int ROW> DEV unsigned sw_addr(unsigned tile, int row, int chunk) {
    return tile + row * ROW * 2 + ((chunk ^ (row & 7)) << 4);
}
DEV unsigned sw_step(unsigned a, int step) { return (a ^ ((step & 3) << 5)) + (step >> 2) * 128; }

/* The first element thread tid copies of a [rows][DP] tile in global memory with row stride `stride`. */
template <int DP> DEV int64_t load_origin(int64_t stride, int tid) {
    return (int64_t)(tid / (DP / 8)) * stride + tid % (DP / 8) * 8;
}

/* Rows [0, ROWS) of a ROWS x DP tile into swizzled shared memory by cp.async; rows >= valid and columns >= d are
 * zero-filled without reading.  `src` is this thread's first element (tile + load_origin).  Thread tid copies chunk
 * tid % CHUNKS of rows r0 + RSTEP * it; that row has the swizzle of row r0 + RSTEP * (it % PER), PER * RSTEP being a
 * multiple of 8.  A whole tile copies without bounds tests unless ALWAYS_PRED (one straight-line path, no branch). */
template <typename T, int DP, int ROWS, int THREADS, bool ALWAYS_PRED = false>
DEV void load_tile(T *smem, const T *src, int64_t stride, int64_t valid, int d, int tid) {
    constexpr int CHUNKS = DP / 8, RSTEP = THREADS / CHUNKS, ITERS = ROWS * CHUNKS / THREADS;
    constexpr int PER = RSTEP % 8 == 0 ? 1 : 8 / RSTEP;
    static_assert(THREADS % CHUNKS == 0 && (ROWS * CHUNKS) % THREADS == 0, "tile must split evenly over threads");
    static_assert(8 % RSTEP == 0 || RSTEP % 8 == 0, "row step must divide or be a multiple of the swizzle period");
    const int c = tid % CHUNKS, r0 = tid / CHUNKS;
    int soff[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) soff[k] = sw_off<DP>(r0 + k * RSTEP, c);
    auto dst = [&](int it) { return smem + soff[it % PER] + (it / PER) * PER * RSTEP * DP; };
    const bool col_in = c * 8 < d;
    if (!ALWAYS_PRED && valid >= ROWS && col_in) { /* every tile but a sequence's last: no bounds test */
#pragma unroll
        for (int it = 0; it < ITERS; it++) cp_async_16(dst(it), src + (int64_t)it * RSTEP * stride, 16);
    } else {
        const int rows = valid <= 0 ? 0 : (int)valid;
#pragma unroll
        for (int it = 0; it < ITERS; it++) {
            const bool in = col_in && r0 + it * RSTEP < rows;
            cp_async_16(dst(it), in ? src + (int64_t)it * RSTEP * stride : src, in ? 16 : 0);
        }
    }
}

/* ---- small pieces ----------------------------------------------------------------------------------------------- */

template <bool B> struct bool_tag { static constexpr bool value = B; }; /* a compile-time flag passed to a lambda */

/* 4-byte global -> shared copy (through L1); src_bytes = 0 writes a zero and reads nothing. */
DEV void cp_async_4(void *smem, const void *gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}

#include "../bwd_common.cuh"

/* ---- dK, dV (and dQ by atomics): a block per key block ------------------------------------------------------------
 * ATOMIC_DQ: dQ too (the default mode); deterministic mode compiles it out (a template flag, not a run-time test, so
 * that the three products after the barrier are one basic block the scheduler can interleave).
 * Warp layouts (v2_bwd_configs.h): S and dP in WM_S x WN_S warps of MS m16 x NS n8 tiles; dV and dK in WM_KV x WN_KV
 * warps of MKV x NKV (rows are keys); dQ in WM_Q x WN_Q warps of MQ x NQ.  Fragment layouts: kernels/mma.cuh. */
template <typename T, int DP, int BR, int BC, int WARPS, int WM_S, int WM_KV, int WM_Q, int STAGES, bool DQ_FIRST,
          bool ATOMIC_DQ, bool MODS, bool SEQ>
__global__ void __launch_bounds__(WARPS * 32, 1) v2_bwd_dkdv(const attn_bwd_params all, const int heads_fastest) {
    constexpr int THREADS = WARPS * 32;
    constexpr int WN_S = WARPS / WM_S, MS = BR / (16 * WM_S), NS = BC / (8 * WN_S);
    constexpr int WN_KV = WARPS / WM_KV, MKV = BC / (16 * WM_KV), NKV = DP / (8 * WN_KV);
    constexpr int WN_Q = WARPS / WM_Q, MQ = BR / (16 * WM_Q), NQ = DP / (8 * WN_Q);
    static_assert(WARPS % WM_S == 0 && WARPS % WM_KV == 0 && WARPS % WM_Q == 0, "warp grids must tile the block");
    static_assert(MS * 16 * WM_S == BR && NS * 8 * WN_S == BC && NS % 2 == 0, "S / dP warp tiles");
    static_assert(MKV * 16 * WM_KV == BC && NKV * 8 * WN_KV == DP && NKV % 2 == 0, "dK / dV warp tiles");
    static_assert(MQ * 16 * WM_Q == BR && NQ * 8 * WN_Q == DP && NQ % 2 == 0, "dQ warp tiles");
    static_assert((MKV & (MKV - 1)) == 0 && (NKV & (NKV - 1)) == 0 && (NQ & (NQ - 1)) == 0,
                  "per-warp step ranges must be powers of two (sw_step from a warp's base)");
    static_assert(BC % 64 == 0 && DP % 64 == 0 && BR % 16 == 0 && (STAGES == 1 || STAGES == 2), "tile shapes");
    constexpr unsigned DO_OFF = STAGES * BR * DP * 2; /* bytes from sQ to sdO */
    constexpr unsigned V_OFF = BC * DP * 2;           /* from sK to sV */
    constexpr unsigned DS_OFF = BR * BC * 2;          /* from sP to sdS */
    constexpr unsigned QSTAGE = BR * DP * 2;          /* one stage of sQ / sdO */
    /* dQ's accumulators beside dK's and dV's: above ~176 registers (D = 256) dQ is done in two column passes, which
     * re-read dS's fragments once more instead of spilling */
    constexpr int DQ_PASSES = MKV * NKV * 8 + MQ * NQ * 4 > 176 && NQ % 4 == 0 ? 2 : 1;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw;         /* [STAGES][BR][DP] */
    T *sdO = sQ + STAGES * BR * DP; /* [STAGES][BR][DP] */
    T *sK = sdO + STAGES * BR * DP; /* [BC][DP] */
    T *sV = sK + BC * DP;           /* [BC][DP] */
    T *sP = sV + BC * DP;           /* [BR][BC] */
    T *sdS = sP + BR * BC;          /* [BR][BC] */
    float *sLse = (float *)(sdS + BR * BC); /* [STAGES][BR]: the rows' LSE (natural log, as stored) */
    float *sD = sLse + STAGES * BR;         /* [STAGES][BR]: the rows' D */
    static_assert(2 * BR <= THREADS, "a thread per row copies LSE and D");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7; /* ldmatrix: the 8x8 matrix this lane addresses, and its row there */
    const int64_t nkb = (all.fwd.sk + BC - 1) / BC, nbh = all.fwd.b * all.fwd.h_kv;
    /* Head by head (key block fastest) or heads fastest; key block 0 first either way: with causal masking the
     * earliest keys are seen by the most query rows, so the longest blocks start first. */
    const int64_t bhk = heads_fastest ? blockIdx.x % nbh : blockIdx.x / nkb;
    const int64_t kb = heads_fastest ? blockIdx.x / nbh : blockIdx.x % nkb;
    const int64_t hk = bhk % all.fwd.h_kv;
    /* SEQ (a packed batch): sequence bhk / h_kv's params alone, as a batch of one */
    attn_bwd_params seq_p;
    if (SEQ) fattn_seq_bwd_params(&all, bhk / all.fwd.h_kv, &seq_p);
    const attn_bwd_params &p = SEQ ? seq_p : all;
    const attn_params &f = p.fwd;
    const int64_t b = SEQ ? 0 : bhk / f.h_kv;
    const int j0 = (int)kb * BC, d = (int)f.d; /* the planner keeps Sq, Sk below 2^30: rows and keys fit an int */
    if (SEQ && j0 >= f.sk) return; /* past this sequence's keys: no rows of dK, dV here */

    /* the nm query blocks of rows [i_begin, i_end) hold the rows that see key block kb; the steps run over them for
     * each query head of the kv head's group: step (gi, i0) is query head hk * h_per_kv + gi, rows i0 + [0, BR) */
    int64_t i_lo, i_hi;
    fattn_rows_seeing(&f.mask, f.sq, f.sk, j0, (j0 + BC < f.sk ? j0 + BC : f.sk) - 1, &i_lo, &i_hi);
    const int i_begin = (int)(i_lo / BR) * BR, i_end = i_lo < i_hi ? (int)((i_hi + BR - 1) / BR) * BR : i_begin;
    const int nm = (i_end - i_begin) / BR, n_it = nm * (int)f.h_per_kv;
    const int64_t h0 = hk * f.h_per_kv; /* the group's first query head */
    /* The query blocks whose pair with key block kb needs no mask: kb in [n_full_min, n_full_max) of the block's
     * span.  Both ends grow with the block, so they are one range [i_full_a, i_full_b), found once by bisection
     * rather than asking the span every step. */
    int i_full_a, i_full_b;
    {
        int a = 0, z = nm;
        while (a < z) { /* first block with kb < n_full_max */
            const int mid = (a + z) >> 1;
            if (kb < fattn_key_span(&f.mask, f.sq, f.sk, i_begin + (int64_t)mid * BR, BR, BC).n_full_max) z = mid;
            else a = mid + 1;
        }
        i_full_a = i_begin + a * BR;
        z = nm;
        while (a < z) { /* from there, the first block with n_full_min > kb */
            const int mid = (a + z) >> 1;
            if (fattn_key_span(&f.mask, f.sq, f.sk, i_begin + (int64_t)mid * BR, BR, BC).n_full_min > kb) z = mid;
            else a = mid + 1;
        }
        i_full_b = i_begin + a * BR;
    }

    const int wm_s = warp % WM_S, wn_s = warp / WM_S, wm_kv = warp % WM_KV, wn_kv = warp / WM_KV;
    const int wm_q = warp % WM_Q, wn_q = warp / WM_Q;
    const int srow = wm_s * 16 * MS, scol = wn_s * 8 * NS; /* the warp's S tile: rows srow + [0, 16 MS), keys scol + */
    /* ldmatrix addresses (step 0).  S, dP: A = Q, dO (rows: queries) and B = K, V (rows: keys), both non-transposed.
     * dV, dK: A = P^T, dS^T read transposed from [BR][BC] (rows: queries = k), B = dO, Q transposed (rows: k).
     * dQ: A = dS (rows: queries), B = K transposed (rows: keys = k). */
    const unsigned aQ = sw_addr<DP>(smem_u32(sQ), srow + r8 + (mi & 1) * 8, mi >> 1);
    const unsigned aK = sw_addr<DP>(smem_u32(sK), scol + r8 + (mi >> 1) * 8, mi & 1);
    const unsigned aPt = sw_addr<BC>(smem_u32(sP), r8 + (mi >> 1) * 8, 2 * wm_kv * MKV + (mi & 1));
    const unsigned adOt = sw_addr<DP>(smem_u32(sdO), r8 + (mi & 1) * 8, wn_kv * NKV + (mi >> 1));
    const unsigned adS = sw_addr<BC>(smem_u32(sdS), wm_q * 16 * MQ + r8 + (mi & 1) * 8, mi >> 1);
    const unsigned aKt = sw_addr<DP>(smem_u32(sK), r8 + (mi & 1) * 8, wn_q * NQ + (mi >> 1));

    const int64_t q_org = load_origin<DP>(f.q_stride_s, tid), do_org = load_origin<DP>(p.do_stride_s, tid);
    /* Q_i, and dO_i with its rows' LSE and D.  Inside the loop they are issued at different points of a step and
     * without branches (ALWAYS_PRED: every copy predicated), so the copies interleave with the MMAs around them. */
    auto load_q = [&](int gi, int i0, int stage) {
        const T *q = (const T *)f.q + b * f.q_stride_b + (h0 + gi) * f.q_stride_h + i0 * f.q_stride_s + q_org;
        load_tile<T, DP, BR, THREADS, true>(sQ + stage * BR * DP, q, f.q_stride_s, f.sq - i0, d, tid);
    };
    auto load_do = [&](int gi, int i0, int stage) {
        const T *dO = (const T *)p.dout + b * p.do_stride_b + (h0 + gi) * p.do_stride_h + i0 * p.do_stride_s + do_org;
        load_tile<T, DP, BR, THREADS, true>(sdO + stage * BR * DP, dO, p.do_stride_s, f.sq - i0, d, tid);
        /* LSE and D of the block's rows travel with it (in the same group), so no global load sits on the path of
         * a step: D of rows past Sq is 0 in the workspace, LSE there is zero-filled (and not used) */
        const int row = tid < BR ? tid : tid - BR;
        const int64_t i = i0 + row;
        const bool lse_in = tid < BR && i < f.sq;
        const float *src = tid < BR ? f.lse + b * f.lse_stride_b + (h0 + gi) * f.lse_stride_h + (lse_in ? i : 0)
                                    : p.dpsum + (b * f.h + h0 + gi) * p.ws_rows + i;
        if (tid < 2 * BR) cp_async_4((tid < BR ? sLse : sD) + stage * BR + row, src, tid >= BR || lse_in ? 4 : 0);
    };
    auto load_qdo = [&](int gi, int i0, int stage) {
        load_q(gi, i0, stage);
        load_do(gi, i0, stage);
    };
    {
        const T *k = (const T *)f.k + b * f.k_stride_b + hk * f.k_stride_h + j0 * f.k_stride_s;
        const T *v = (const T *)f.v + b * f.v_stride_b + hk * f.v_stride_h + j0 * f.v_stride_s;
        load_tile<T, DP, BC, THREADS>(sK, k + load_origin<DP>(f.k_stride_s, tid), f.k_stride_s, f.sk - j0, d, tid);
        load_tile<T, DP, BC, THREADS>(sV, v + load_origin<DP>(f.v_stride_s, tid), f.v_stride_s, f.sk - j0, d, tid);
    }
    /* Each block starts its walk at a different query block (kb's share of the range, wrapping around): the blocks
     * of a head run side by side, and starting together they would add into the same rows of dq_accum at the same
     * moment, serialising their atomics on the same addresses in L2. */
    const int i_first = nm > 0 ? i_begin + (int)(kb * nm / nkb % nm) * BR : i_begin;
    if (n_it > 0) load_qdo(0, i_first, 0);
    cp_async_commit();

    float dv[MKV][NKV][4], dk[MKV][NKV][4];
#pragma unroll
    for (int mk = 0; mk < MKV; mk++)
#pragma unroll
        for (int nk = 0; nk < NKV; nk++)
#pragma unroll
            for (int x = 0; x < 4; x++) dv[mk][nk][x] = dk[mk][nk][x] = 0.f;
    const float sl = f.scale_log2, cap2 = f.softcap * FATTN_LOG2E, inv_cap2 = cap2 > 0.f ? 1.f / cap2 : 0.f;

    for (int it = 0, gi = 0, i0 = i_first; it < n_it; it++) {
        const int stage = STAGES == 2 ? it & 1 : 0;
        /* the next step's block and head (the last step refetches its own block into the idle stage: harmless, and
         * it keeps the copies free of branches) */
        const bool last = it + 1 == n_it;
        const int i0_wrap = i0 + BR < i_end ? i0 + BR : i_begin; /* the next block, wrapping */
        const int gi_next = last || i0_wrap != i_first ? gi : gi + 1, i0_next = last ? i0 : i0_wrap;
        const int64_t bh = b * f.h + h0 + gi;
        const bool masked = i0 < i_full_a || i0 >= i_full_b; /* an edge pair: the mask applies */
        cp_async_wait<0>();
        __syncthreads(); /* Q_i, dO_i (and K, V) landed; every warp is done with the last step's P, dS and stage */
        const unsigned aQs = aQ + stage * QSTAGE, adOts = adOt + stage * QSTAGE;

        /* S = Q_i K_j^T */
        float s[MS][NS][4];
#pragma unroll
        for (int ms = 0; ms < MS; ms++)
#pragma unroll
            for (int ns = 0; ns < NS; ns++) s[ms][ns][0] = s[ms][ns][1] = s[ms][ns][2] = s[ms][ns][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DP / 16; ks++) {
            unsigned a[MS][4];
#pragma unroll
            for (int ms = 0; ms < MS; ms++) ldmatrix_x4(a[ms], sw_step(aQs, ks) + ms * 16 * DP * 2);
#pragma unroll
            for (int np = 0; np < NS / 2; np++) {
                unsigned kf[4];
                ldmatrix_x4(kf, sw_step(aK, ks) + np * 16 * DP * 2);
                const unsigned b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
#pragma unroll
                for (int ms = 0; ms < MS; ms++) {
                    mma_16816(s[ms][2 * np], a[ms], b0, T());
                    mma_16816(s[ms][2 * np + 1], a[ms], b1, T());
                }
            }
        }
        /* P = exp2(S * scale_log2 - lse2): one FFMA, exact product, so no cancellation however large S.  This
         * thread's S rows are srow + 16 ms + 8 r + g; lse2 = +inf past Sq and where LSE = -inf (no key seen): P = 0
         * whatever the sign of the scale.  MODS: the softcap and ALiBi first (as the forward), the mask here, P to
         * shared memory now, and s = P (1 - tanh^2) from here on (dS's chain rule): no registers for the tanh. */
        const float slope2 = MODS ? fattn_alibi_slope2(&f, b, h0 + gi) : 0.f;
#pragma unroll
        for (int ms = 0; ms < MS; ms++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int row = srow + 16 * ms + 8 * r + g;
                const float l = sLse[stage * BR + row];
                const float lse2 = i0 + row >= f.sq || l == -INFINITY ? INFINITY : l * FATTN_LOG2E;
                if constexpr (MODS) {
                    /* ALiBi's distance from the pair's first key, in float from one conversion */
                    const float pos = (float)(i0 + row + (int)(f.sk - f.sq) - j0 - scol - 2 * t);
                    int lo = 0, hi = BC;
                    if (masked) {
                        const fattn_block_mask bm = fattn_block_mask_of(&f.mask, f.sq, f.sk, i0 + srow + g, j0);
                        fattn_block_cols(&bm, 16 * ms + 8 * r, BC, &lo, &hi);
                    }
#pragma unroll
                    for (int ns = 0; ns < NS; ns++) {
                        float pr[2], dcap[2] = {1.f, 1.f};
#pragma unroll
                        for (int y = 0; y < 2; y++) {
                            float e = s[ms][ns][2 * r + y] * sl;
                            if (cap2 > 0.f) {
                                const float th = fast_tanh(e * inv_cap2);
                                e = cap2 * th;
                                dcap[y] = 1.f - th * th;
                            }
                            e = fmaf(-slope2, fabsf(pos - (float)(8 * ns + y)), e);
                            const int c = scol + 8 * ns + 2 * t + y;
                            pr[y] = c >= lo && c < hi ? fast_exp2(e - lse2) : 0.f;
                            s[ms][ns][2 * r + y] = pr[y] * dcap[y];
                        }
                        *(unsigned *)(sP + row * BC + (((wn_s * NS + ns) ^ g) << 3) + 2 * t) = pack2(pr[0], pr[1], T());
                    }
                } else {
#pragma unroll
                    for (int ns = 0; ns < NS; ns++)
#pragma unroll
                        for (int x = 2 * r; x < 2 * r + 2; x++)
                            s[ms][ns][x] = fast_exp2(fmaf(s[ms][ns][x], sl, -lse2));
                }
            }
        if (STAGES == 2) load_q(gi_next, i0_next, stage ^ 1); /* the idle stage: every warp left it last step */
        /* dP = dO_i V_j^T */
        float ds[MS][NS][4];
#pragma unroll
        for (int ms = 0; ms < MS; ms++)
#pragma unroll
            for (int ns = 0; ns < NS; ns++) ds[ms][ns][0] = ds[ms][ns][1] = ds[ms][ns][2] = ds[ms][ns][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DP / 16; ks++) {
            unsigned a[MS][4];
#pragma unroll
            for (int ms = 0; ms < MS; ms++) ldmatrix_x4(a[ms], sw_step(aQs + DO_OFF, ks) + ms * 16 * DP * 2);
#pragma unroll
            for (int np = 0; np < NS / 2; np++) {
                unsigned vf[4];
                ldmatrix_x4(vf, sw_step(aK + V_OFF, ks) + np * 16 * DP * 2);
                const unsigned b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
#pragma unroll
                for (int ms = 0; ms < MS; ms++) {
                    mma_16816(ds[ms][2 * np], a[ms], b0, T());
                    mma_16816(ds[ms][2 * np + 1], a[ms], b1, T());
                }
            }
        }
        /* masked keys: P = 0 (after the exponent: -inf * a negative scale would be +inf), edge blocks only.
         * Applied after dP: S, exp2 and dP stay one basic block, so the exponentials interleave with dP's MMAs */
        if (masked && !MODS) {
            const fattn_block_mask bm = fattn_block_mask_of(&f.mask, f.sq, f.sk, i0 + srow + g, j0);
#pragma unroll
            for (int ms = 0; ms < MS; ms++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    int lo, hi;
                    fattn_block_cols(&bm, 16 * ms + 8 * r, BC, &lo, &hi);
#pragma unroll
                    for (int ns = 0; ns < NS; ns++) {
                        const int c = scol + 8 * ns + 2 * t;
                        if (c < lo || c >= hi) s[ms][ns][2 * r] = 0.f;
                        if (c + 1 < lo || c + 1 >= hi) s[ms][ns][2 * r + 1] = 0.f;
                    }
                }
        }

        /* P and dS = P (dP - D) to shared memory: this thread's (row, 2 t..2 t+1) pairs, rows srow + g + 16 ms + 8 r
         * (row & 7 = g), keys scol + 8 ns + 2 t (chunk wn_s NS + ns) */
        T *const ps = sP + (srow + g) * BC + 2 * t;
        if (!MODS) /* (MODS stored P above) */
#pragma unroll
            for (int ms = 0; ms < MS; ms++)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int ns = 0; ns < NS; ns++)
                        *(unsigned *)(ps + (16 * ms + 8 * r) * BC + (((wn_s * NS + ns) ^ g) << 3)) =
                            pack2(s[ms][ns][2 * r], s[ms][ns][2 * r + 1], T());

#pragma unroll
        for (int ms = 0; ms < MS; ms++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float D = sD[stage * BR + srow + 16 * ms + 8 * r + g];
#pragma unroll
                for (int ns = 0; ns < NS; ns++)
                    *(unsigned *)(ps + BR * BC + (16 * ms + 8 * r) * BC + (((wn_s * NS + ns) ^ g) << 3)) =
                        pack2(s[ms][ns][2 * r] * (ds[ms][ns][2 * r] - D), s[ms][ns][2 * r + 1] * (ds[ms][ns][2 * r + 1] - D),
                              T());
            }
        __syncthreads(); /* P and dS complete */
        if (STAGES == 2) {
            load_do(gi_next, i0_next, stage ^ 1);
            cp_async_commit();
        }

        /* dV += P^T dO_i, dK += dS^T Q_i and dQ_i += dS K_j (atomics).  The atomics cost: without them a step took
         * 0.80x (D=128) and 0.69x (D=256) of its time on the H100.  Issued as a burst they fill the SM's global-memory
         * queue and stall the warp in front of MMAs that do not need them, so they go out a few at a time between the
         * k-steps of the product that follows dQ (dq_first, v2_bwd_configs.h: which one).  Single-buffered, dQ runs
         * last instead, so that Q_i and dO_i are refilled under it.  (Tried and dropped: sm_90 bulk reductions,
         * cp.reduce.async.bulk, of a shared-memory dQ tile, a row per lane of one warp: 0.62-0.91x of this.) */
        constexpr int NQP = NQ / DQ_PASSES; /* n8 tiles of dQ per pass */
        constexpr int NRED = MQ * 2 * NQP;  /* 8-byte atomics per thread per pass */
        constexpr int KK = BR / 16;         /* dV's and dK's k-steps */
        float dq[MQ][NQP][4] = {}; /* each pass zeroes it; initialised here for the front end (use before set) */
        float *const acc = p.dq_accum + (bh * p.ws_rows + i0 + wm_q * 16 * MQ + g) * DP + wn_q * 8 * NQ + 2 * t;
        /* atomic j (0 <= j < NRED) of pass `pass`: tile (mq, nq), row half r; rows past Sq add zeros into the
         * workspace's padding rows (ws_rows covers every block's end): no test */
        auto red_one = [&](int pass, int j) {
            const int mq = j / (2 * NQP), r = j / NQP % 2, nq = j % NQP;
            red_add2(acc + (16 * mq + 8 * r) * DP + 8 * (pass * NQP + nq), dq[mq][nq][2 * r], dq[mq][nq][2 * r + 1]);
        };
        auto dq_pass = [&](int pass) { /* dq = dS K_j, columns of this pass: k-steps over the BC keys */
#pragma unroll
            for (int mq = 0; mq < MQ; mq++)
#pragma unroll
                for (int nq = 0; nq < NQP; nq++) dq[mq][nq][0] = dq[mq][nq][1] = dq[mq][nq][2] = dq[mq][nq][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                unsigned a[MQ][4];
#pragma unroll
                for (int mq = 0; mq < MQ; mq++) ldmatrix_x4(a[mq], sw_step(adS, kk) + mq * 16 * BC * 2);
#pragma unroll
                for (int np = 0; np < NQP / 2; np++) {
                    unsigned bf[4];
                    ldmatrix_x4_trans(bf, sw_step(aKt, pass * NQP / 2 + np) + kk * 16 * DP * 2);
                    const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
                    for (int mq = 0; mq < MQ; mq++) {
                        mma_16816(dq[mq][2 * np], a[mq], b0, T());
                        mma_16816(dq[mq][2 * np + 1], a[mq], b1, T());
                    }
                }
            }
        };
        /* dV += P^T dO_i (DK false) or dK += dS^T Q_i (DK true): k-steps over the BR query rows.  Atomics
         * [j0, j1) of dQ pass `pass` go out between the k-steps, a share after each, behind a __syncwarp that keeps
         * the scheduler from hoisting them back into one burst. */
        auto kv_step = [&](auto is_dk, int pass, int j0, int j1) {
            constexpr bool DK = decltype(is_dk)::value;
            float(&acc_kv)[MKV][NKV][4] = DK ? dk : dv;
            const unsigned a_base = DK ? aPt + DS_OFF : aPt, b_base = DK ? adOts - DO_OFF : adOts;
#pragma unroll
            for (int kk = 0; kk < KK; kk++) {
                unsigned a[MKV][4];
#pragma unroll
                for (int mk = 0; mk < MKV; mk++) ldmatrix_x4_trans(a[mk], sw_step(a_base, mk) + kk * 16 * BC * 2);
#pragma unroll
                for (int np = 0; np < NKV / 2; np++) {
                    unsigned bf[4];
                    ldmatrix_x4_trans(bf, sw_step(b_base, np) + kk * 16 * DP * 2);
                    const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
                    for (int mk = 0; mk < MKV; mk++) {
                        mma_16816(acc_kv[mk][2 * np], a[mk], b0, T());
                        mma_16816(acc_kv[mk][2 * np + 1], a[mk], b1, T());
                    }
                }
                if (j0 < j1) {
                    __syncwarp();
                    const int per = (j1 - j0 + KK - 1) / KK;
#pragma unroll
                    for (int j = j0 + kk * per; j < j0 + (kk + 1) * per && j < j1; j++) red_one(pass, j);
                }
            }
        };
        using dv_t = bool_tag<false>;
        using dk_t = bool_tag<true>;
        if (STAGES == 1) {
            kv_step(dv_t(), 0, 0, 0);
            kv_step(dk_t(), 0, 0, 0);
            __syncthreads(); /* every warp is done with Q_i and dO_i: fetch the next pair while dQ runs */
            load_qdo(gi_next, i0_next, 0);
            cp_async_commit();
            if (ATOMIC_DQ) {
#pragma unroll
                for (int pass = 0; pass < DQ_PASSES; pass++) {
                    dq_pass(pass);
#pragma unroll
                    for (int j = 0; j < NRED; j++) red_one(pass, j);
                }
            }
        } else if (ATOMIC_DQ && DQ_PASSES == 1) { /* dQ's atomics spread over dV and dK, or over dK */
            if (DQ_FIRST) {
                dq_pass(0);
                kv_step(dv_t(), 0, 0, NRED / 2);
                kv_step(dk_t(), 0, NRED / 2, NRED);
            } else {
                kv_step(dv_t(), 0, 0, 0);
                dq_pass(0);
                kv_step(dk_t(), 0, 0, NRED);
            }
        } else if (ATOMIC_DQ) { /* two passes: each one's atomics spread over the product that follows it */
            dq_pass(0);
            kv_step(dv_t(), 0, 0, NRED);
            dq_pass(1);
            kv_step(dk_t(), 1, 0, NRED);
        } else {
            kv_step(dv_t(), 0, 0, 0);
            kv_step(dk_t(), 0, 0, 0);
        }
        gi = gi_next;
        i0 = i0_next;
    }
    cp_async_wait<0>(); /* nothing may stay in flight into a block that exits */

    /* dV and scale * dK, rows < Sk, columns < d */
    T *dvp = (T *)p.dv + b * p.dv_stride_b + hk * p.dv_stride_h;
    T *dkp = (T *)p.dk + b * p.dk_stride_b + hk * p.dk_stride_h;
    const float scale = f.scale;
#pragma unroll
    for (int mk = 0; mk < MKV; mk++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int j = j0 + wm_kv * 16 * MKV + 16 * mk + 8 * r + g;
            if (j >= f.sk) continue;
#pragma unroll
            for (int nk = 0; nk < NKV; nk++) {
                const int col = wn_kv * 8 * NKV + 8 * nk + 2 * t;
                if (col >= d) continue;
                *(unsigned *)(dvp + (int64_t)j * p.dv_stride_s + col) = pack2(dv[mk][nk][2 * r], dv[mk][nk][2 * r + 1], T());
                *(unsigned *)(dkp + (int64_t)j * p.dk_stride_s + col) =
                    pack2(dk[mk][nk][2 * r] * scale, dk[mk][nk][2 * r + 1] * scale, T());
            }
        }
}

/* ---- deterministic dQ: a block per query block, as the forward ----------------------------------------------------
 * 4 warps of 16 query rows; per key block (in order): S = Q K^T and dP = dO V^T in registers, dS = P (dP - D)
 * repacked into A fragments (the C layout of two n8 tiles is the A layout of one k16 step), dQ += dS K with K read
 * transposed.  No atomics, a fixed order: bitwise repeatable. */
template <typename T, int DP, int BC, bool MODS, bool SEQ>
__global__ void __launch_bounds__(V2_BWD_DQ_WARPS * 32) v2_bwd_dq(const attn_bwd_params all, const int heads_fastest) {
    constexpr int WARPS = V2_BWD_DQ_WARPS, THREADS = WARPS * 32, BR = V2_BWD_DQ_BR;
    constexpr int NT = BC / 8, DT = DP / 8;
    static_assert(BC % 16 == 0 && DP % 64 == 0, "tile shapes");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw, *sdO = sQ + BR * DP, *sK = sdO + BR * DP, *sV = sK + 2 * BC * DP; /* K, V: 2 stages */
    constexpr unsigned DO_OFF = BR * DP * 2, V_OFF = 2 * BC * DP * 2, KSTAGE = BC * DP * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7;
    const int64_t nqb = (all.fwd.sq + BR - 1) / BR, nbh_all = all.fwd.b * all.fwd.h;
    /* the last query block first: with causal masking it sees the most keys */
    const int64_t bh_all = heads_fastest ? blockIdx.x % nbh_all : blockIdx.x / nqb;
    const int64_t i0 = (nqb - 1 - (heads_fastest ? blockIdx.x / nbh_all : blockIdx.x % nqb)) * BR;
    /* SEQ (a packed batch): sequence bh / h's params alone, as a batch of one */
    attn_bwd_params seq_p;
    if (SEQ) fattn_seq_bwd_params(&all, bh_all / all.fwd.h, &seq_p);
    const attn_bwd_params &p = SEQ ? seq_p : all;
    const attn_params &f = p.fwd;
    const int64_t h = bh_all % f.h, b = SEQ ? 0 : bh_all / f.h, bh = SEQ ? h : bh_all, hk = h / f.h_per_kv;
    const int d = (int)f.d;
    if (SEQ && i0 >= f.sq) return; /* past this sequence's queries */

    const fattn_span span = fattn_key_span(&f.mask, f.sq, f.sk, i0, BR, BC);
    const int jb_begin = (int)span.n_min, jb_end = (int)span.n_max;
    const T *k = (const T *)f.k + b * f.k_stride_b + hk * f.k_stride_h + load_origin<DP>(f.k_stride_s, tid);
    const T *v = (const T *)f.v + b * f.v_stride_b + hk * f.v_stride_h + load_origin<DP>(f.v_stride_s, tid);
    auto load_kv = [&](int jb, int stage) {
        const int64_t j = (int64_t)jb * BC;
        load_tile<T, DP, BC, THREADS>(sK + stage * BC * DP, k + j * f.k_stride_s, f.k_stride_s, f.sk - j, d, tid);
        load_tile<T, DP, BC, THREADS>(sV + stage * BC * DP, v + j * f.v_stride_s, f.v_stride_s, f.sk - j, d, tid);
    };
    load_tile<T, DP, BR, THREADS>(sQ, (const T *)f.q + b * f.q_stride_b + h * f.q_stride_h + i0 * f.q_stride_s +
                                          load_origin<DP>(f.q_stride_s, tid), f.q_stride_s, f.sq - i0, d, tid);
    load_tile<T, DP, BR, THREADS>(sdO, (const T *)p.dout + b * p.do_stride_b + h * p.do_stride_h + i0 * p.do_stride_s +
                                           load_origin<DP>(p.do_stride_s, tid), p.do_stride_s, f.sq - i0, d, tid);
    if (jb_begin < jb_end) load_kv(jb_begin, 0);
    cp_async_commit();

    const int wrow = warp * 16;
    float lse2[2], dsum[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = i0 + wrow + 8 * r + g;
        lse2[r] = lse2_of(f.lse + b * f.lse_stride_b + h * f.lse_stride_h, i, f.sq);
        dsum[r] = p.dpsum[bh * p.ws_rows + i];
    }
    const unsigned aQ = sw_addr<DP>(smem_u32(sQ), wrow + r8 + (mi & 1) * 8, mi >> 1);
    const unsigned aK = sw_addr<DP>(smem_u32(sK), r8 + (mi >> 1) * 8, mi & 1);
    const unsigned aKt = sw_addr<DP>(smem_u32(sK), r8 + (mi & 1) * 8, mi >> 1);
    const float sl = f.scale_log2, cap2 = f.softcap * FATTN_LOG2E, inv_cap2 = cap2 > 0.f ? 1.f / cap2 : 0.f;
    const float slope2 = MODS ? fattn_alibi_slope2(&f, b, h) : 0.f;

    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;

    for (int jb = jb_begin; jb < jb_end; jb++) {
        const int stage = (jb - jb_begin) & 1;
        const int64_t j0 = (int64_t)jb * BC;
        cp_async_wait<0>();
        __syncthreads(); /* K_j, V_j (and Q, dO) landed; every warp is done with the other stage */
        if (jb + 1 < jb_end) load_kv(jb + 1, stage ^ 1);
        cp_async_commit();
        const unsigned aKs = aK + stage * KSTAGE, aKts = aKt + stage * KSTAGE;

        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) s[nt][x] = dp[nt][x] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DP / 16; ks++) { /* S = Q K_j^T and dP = dO V_j^T */
            unsigned aq[4], ado[4];
            ldmatrix_x4(aq, sw_step(aQ, ks));
            ldmatrix_x4(ado, sw_step(aQ + DO_OFF, ks));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                unsigned kf[4], vf[4];
                ldmatrix_x4(kf, sw_step(aKs, ks) + np * 16 * DP * 2);
                ldmatrix_x4(vf, sw_step(aKs + V_OFF, ks) + np * 16 * DP * 2);
                const unsigned k0[2] = {kf[0], kf[1]}, k1[2] = {kf[2], kf[3]};
                const unsigned v0[2] = {vf[0], vf[1]}, v1[2] = {vf[2], vf[3]};
                mma_16816(s[2 * np], aq, k0, T());
                mma_16816(s[2 * np + 1], aq, k1, T());
                mma_16816(dp[2 * np], ado, v0, T());
                mma_16816(dp[2 * np + 1], ado, v1, T());
            }
        }
        if constexpr (MODS) { /* the softcap and ALiBi as the forward; s = P (1 - tanh^2) (dS's chain rule) */
            const float pos = (float)((int)(i0 + wrow + g + f.sk - f.sq - j0) - 2 * t); /* ALiBi's distance, float */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    float e = s[nt][x] * sl, dcap = 1.f;
                    if (cap2 > 0.f) {
                        const float th = fast_tanh(e * inv_cap2);
                        e = cap2 * th;
                        dcap = 1.f - th * th;
                    }
                    e = fmaf(-slope2, fabsf(pos + (float)(8 * (x >> 1) - 8 * nt - (x & 1))), e);
                    s[nt][x] = fast_exp2(e - lse2[x >> 1]) * dcap;
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int x = 0; x < 4; x++) s[nt][x] = fast_exp2(fmaf(s[nt][x], sl, -lse2[x >> 1]));
        }
        if (jb < span.n_full_min || jb >= span.n_full_max) {
            const fattn_block_mask bm = fattn_block_mask_of(&f.mask, f.sq, f.sk, i0 + wrow + g, j0);
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int lo, hi;
                fattn_block_cols(&bm, 8 * r, BC, &lo, &hi);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const int c = nt * 8 + 2 * t;
                    if (c < lo || c >= hi) s[nt][2 * r] = 0.f;
                    if (c + 1 < lo || c + 1 >= hi) s[nt][2 * r + 1] = 0.f;
                }
            }
        }
        /* dQ += dS K_j, dS = P (dP - D) packed straight into A fragments */
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            unsigned a[4];
            a[0] = pack2(s[2 * kk][0] * (dp[2 * kk][0] - dsum[0]), s[2 * kk][1] * (dp[2 * kk][1] - dsum[0]), T());
            a[1] = pack2(s[2 * kk][2] * (dp[2 * kk][2] - dsum[1]), s[2 * kk][3] * (dp[2 * kk][3] - dsum[1]), T());
            a[2] = pack2(s[2 * kk + 1][0] * (dp[2 * kk + 1][0] - dsum[0]),
                         s[2 * kk + 1][1] * (dp[2 * kk + 1][1] - dsum[0]), T());
            a[3] = pack2(s[2 * kk + 1][2] * (dp[2 * kk + 1][2] - dsum[1]),
                         s[2 * kk + 1][3] * (dp[2 * kk + 1][3] - dsum[1]), T());
#pragma unroll
            for (int np = 0; np < DT / 2; np++) {
                unsigned bf[4];
                ldmatrix_x4_trans(bf, sw_step(aKts, np) + kk * 16 * DP * 2);
                const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                mma_16816(dq[2 * np], a, b0, T());
                mma_16816(dq[2 * np + 1], a, b1, T());
            }
        }
    }
    cp_async_wait<0>();

    T *out = (T *)p.dq + b * p.dq_stride_b + h * p.dq_stride_h;
    const float scale = f.scale;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = i0 + wrow + 8 * r + g;
        if (i >= f.sq) continue;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            const int col = dt * 8 + 2 * t;
            if (col < d)
                *(unsigned *)(out + i * p.dq_stride_s + col) = pack2(dq[dt][2 * r] * scale, dq[dt][2 * r + 1] * scale, T());
        }
    }
}

#ifndef __CUDACC_RTC__ /* host code: the kernels compiled ahead of time, and the launcher */

/* v2_bwd_configs.h's table, kernel by kernel, [fp16, bf16]; [seq]: packed batches' kernels (SEQ), [mods]: the
 * softcap / ALiBi kernels (MODS). */
typedef struct {
    const void *dkdv[2][2][2][2], *dq[2][2][2]; /* dkdv[seq][mods][deterministic][dtype], dq[seq][mods][dtype] */
    const void *prep[2], *convert[2];
    int dp, br, bc, warps;
    size_t smem, dq_smem;
} v2_bwd_row;

#define V2B_PAIR(kernel, ...) {(const void *)kernel<__half, __VA_ARGS__>, (const void *)kernel<__nv_bfloat16, __VA_ARGS__>}
#define V2B_DKDV(md, sq, dp, br, bc, w, ws, wkv, wq, st, dqf)                                                       \
    {V2B_PAIR(v2_bwd_dkdv, dp, br, bc, w, ws, wkv, wq, st, dqf, true, md, sq),                                    \
     V2B_PAIR(v2_bwd_dkdv, dp, br, bc, w, ws, wkv, wq, st, dqf, false, md, sq)}
#define V2B_ROW(dp, br, bc, w, ws, wkv, wq, st, dqf, dqbc)                                                       \
    {{{V2B_DKDV(false, false, dp, br, bc, w, ws, wkv, wq, st, dqf),                                                \
       V2B_DKDV(true, false, dp, br, bc, w, ws, wkv, wq, st, dqf)},                                                \
      {V2B_DKDV(false, true, dp, br, bc, w, ws, wkv, wq, st, dqf),                                                 \
       V2B_DKDV(true, true, dp, br, bc, w, ws, wkv, wq, st, dqf)}},                                                \
     {{V2B_PAIR(v2_bwd_dq, dp, dqbc, false, false), V2B_PAIR(v2_bwd_dq, dp, dqbc, true, false)},                  \
      {V2B_PAIR(v2_bwd_dq, dp, dqbc, false, true), V2B_PAIR(v2_bwd_dq, dp, dqbc, true, true)}},                   \
     V2B_PAIR(bwd_prep, dp), V2B_PAIR(bwd_convert, dp), dp, br, bc, w, V2_BWD_SMEM(dp, br, bc, st),          \
     V2_BWD_DQ_SMEM(dp, dqbc)},
static const v2_bwd_row v2_bwd_rows[V2_BWD_NCONFIGS] = {V2_BWD_CONFIGS(V2B_ROW)};
#undef V2B_ROW
#undef V2B_DKDV
#undef V2B_PAIR

/* Every kernel whose shared memory fits this device may use it (larger configs are never planned here). */
extern "C" fattn_status fattn_prepare_bwd_v2(int device) {
    int limit = 0;
    FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    for (int i = 0; i < V2_BWD_NCONFIGS; i++)
        for (int t = 0; t < 2; t++) {
            const v2_bwd_row *r = &v2_bwd_rows[i];
            for (int k = 0; k < 4; k++) { /* (seq, mods) */
                const int sq = k >> 1, md = k & 1;
                if (r->smem > 48 * 1024 && r->smem <= (size_t)limit)
                    for (int det = 0; det < 2; det++)
                        FATTN_CUDA_CHECK(cudaFuncSetAttribute(
                            r->dkdv[sq][md][det][t], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)r->smem));
                if (r->dq_smem > 48 * 1024 && r->dq_smem <= (size_t)limit)
                    FATTN_CUDA_CHECK(cudaFuncSetAttribute(r->dq[sq][md][t],
                                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                          (int)r->dq_smem));
            }
        }
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_bwd_v2(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    if (plan->config < 0 || plan->config >= V2_BWD_NCONFIGS)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 backward: no config %d", plan->config);
    if (p->fwd.dtype != FATTN_F16 && p->fwd.dtype != FATTN_BF16)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 backward: fp16 and bf16 only");
    const v2_bwd_row *r = &v2_bwd_rows[plan->config];
    if (p->ws_cols != r->dp || p->ws_rows < p->fwd.sq || p->ws_rows % r->br || !p->dq_accum || !p->dpsum)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 backward: the workspace is not laid out for config %d", plan->config);
    const int ti = p->fwd.dtype - FATTN_F16, md = fattn_score_mods(&p->fwd), sq = p->fwd.cu_seqlens_q != NULL;
    const cudaStream_t s = (cudaStream_t)stream;
    int zero_dq = !p->deterministic, heads_fastest = plan->order == FATTN_ORDER_BLOCKS;
    const int rpb = 256 / (r->dp / 8); /* rows per block of prep / convert */

    const int64_t prep_blocks = (p->fwd.b * p->fwd.h * p->ws_rows + rpb - 1) / rpb;
    const int64_t conv_blocks = (p->fwd.b * p->fwd.h * p->fwd.sq + rpb - 1) / rpb;
    const int64_t dq_blocks = (p->fwd.sq + V2_BWD_DQ_BR - 1) / V2_BWD_DQ_BR * p->fwd.b * p->fwd.h;
    if (prep_blocks > 0x7fffffff || dq_blocks > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 backward: too many rows for one grid");
    /* empty grids are skipped, not launched: Sk = 0 still needs dQ = 0, Sq = 0 still needs dK = dV = 0 */
    const int64_t all_heads = p->fwd.b * p->fwd.h;
    void *pargs[] = {(void *)p, (void *)&zero_dq, (void *)&all_heads};
    if (prep_blocks > 0)
        FATTN_CUDA_CHECK(cudaLaunchKernel(r->prep[ti], dim3((unsigned)prep_blocks), dim3(256), pargs, 0, s));
    void *args[] = {(void *)p, (void *)&heads_fastest};
    if (plan->grid_x > 0)
        FATTN_CUDA_CHECK(cudaLaunchKernel(r->dkdv[sq][md][p->deterministic != 0][ti],
                                          dim3(plan->grid_x, plan->grid_y ? plan->grid_y : 1), dim3(plan->threads),
                                          args, plan->smem, s));
    if (p->deterministic) {
        if (dq_blocks > 0)
            FATTN_CUDA_CHECK(cudaLaunchKernel(r->dq[sq][md][ti], dim3((unsigned)dq_blocks), dim3(V2_BWD_DQ_WARPS * 32),
                                              args, r->dq_smem, s));
    } else if (conv_blocks > 0) {
        void *cargs[] = {(void *)p};
        FATTN_CUDA_CHECK(cudaLaunchKernel(r->convert[ti], dim3((unsigned)conv_blocks), dim3(256), cargs, 0, s));
    }
    return FATTN_OK;
}
#endif /* __CUDACC_RTC__ */
