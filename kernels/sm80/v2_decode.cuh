/* v2_decode.cuh -- v2's decode kernel (flash-decoding): few query rows against many keys, where the time is the read
 * of K and V and the work per key is small.  Included by v2_fwd.cu after its tile helpers (swz, load_tile, ...); the
 * planner (v2_plan.c) sends it the calls V2_DECODE_CONFIGS describes: at most 16 query rows per head after GQA
 * packing (fattn_pack_gqa: a kv head's group of query heads as its rows, one K/V read for the group), every row
 * seeing every key of its sequence (lengths from cache_seqlens / seqused_k; contiguous or paged), no softcap / ALiBi.
 *
 * A block of 4 warps owns one head's rows (a 16-row tile, rows past Sq zero) and a span of its keys (split-KV:
 * blockIdx.y, partials merged by v2_combine).  The span is walked in tiles of 64 keys; warp w owns keys 16 w .. 16 w
 * + 15 of every tile and streams them through its own ring of STAGES slots (16 K rows + 16 V rows each, cp.async,
 * one commit group per tile), so STAGES - 1 of its tiles are in flight while it computes one, and no barrier joins
 * the warps until the end.  Per warp tile: S = Q K^T (mma m16n8k16, Q fragments in registers up to DP = 128),
 * S2 = S scale log2 e, keys past the sequence -> -inf, the online softmax on S2, O += P V.  At the end the four
 * warps' (m, l, O) meet in shared memory (the ring's space): O = sum_w 2^(m_w - M) O_w / L, LSE = M + log2 L.
 * A row that sees no key gets O = 0 and LSE = -inf.
 * Bytes in flight per multiprocessor, D = 128 (STAGES 3, two blocks): 2 blocks x 4 warps x 2 tiles x 8 KB = 128 KB. */
#ifndef FATTN_V2_DECODE_CUH
#define FATTN_V2_DECODE_CUH

template <typename T, int DP, int STAGES, int BLOCKS_PER_SM, bool PAGED>
__global__ void __launch_bounds__(128, BLOCKS_PER_SM) v2_decode(const attn_params all, const v2_split sp) {
    constexpr int WARPS = 4, KW = 16, BC = WARPS * KW; /* keys per warp per tile, keys per tile */
    constexpr int KSTEPS = DP / 16, DT = DP / 8, SLOT = KW * DP;
    constexpr bool Q_IN_REGS = DP <= 128;
    static_assert(STAGES >= 2, "a ring of at least two slots per warp");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw, *ring = sQ + 16 * DP; /* ring: [warp][stage][K, V][KW x DP], swizzled */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7;
    const int64_t bh = blockIdx.x, h = bh % all.h;
    const fattn_seq seq = fattn_seq_of(&all, bh / all.h);
    const attn_params &p = all;
    HEAD_OFFSETS(p, 0, h);
    const int sq = (int)seq.sq, d = (int)p.d;
    const int64_t sk = seq.sk;
    const int n_tiles = (int)((sk + BC - 1) / BC);
    const int t_begin = sp.o_part ? (int)blockIdx.y * sp.blocks_per_split : 0;
    const int t_end = sp.o_part ? min(n_tiles, t_begin + sp.blocks_per_split) : n_tiles;
    const T *k = (const T *)seq.k + k_off, *v = (const T *)seq.v + v_off;
    const int64_t k_org = load_origin<DP>(p.k_stride_s, lane), v_org = load_origin<DP>(p.v_stride_s, lane);
    T *my_ring = ring + warp * STAGES * 2 * SLOT;

    /* the warp's 16 keys of tile `tile` into slot `slot` (rows past the sequence zero-filled, never read) */
    auto load_warp_tile = [&](int tile, int slot) {
        const int64_t j0 = (int64_t)tile * BC + warp * KW;
        if (j0 >= sk) return;
        T *dk = my_ring + slot * 2 * SLOT;
        int64_t kr = j0 * p.k_stride_s, vr = j0 * p.v_stride_s;
        if constexpr (PAGED) { /* page sizes are multiples of 16: the warp's 16 rows lie in one page */
            const int64_t page = __ldg(seq.block_table + j0 / p.page_size), r = j0 % p.page_size;
            kr = page * p.k_stride_b + r * p.k_stride_s;
            vr = page * p.v_stride_b + r * p.v_stride_s;
        }
        load_tile<T, DP, KW, 32>(dk, k + kr + k_org, p.k_stride_s, sk - j0, d, lane);
        load_tile<T, DP, KW, 32>(dk + SLOT, v + vr + v_org, p.v_stride_s, sk - j0, d, lane);
    };

    /* Q: the head's rows (GQA packed: the group's heads), rows past Sq zero-filled */
    load_tile<T, DP, 16, 128>(sQ, (const T *)seq.q + q_off + load_origin<DP>(p.q_stride_s, tid), p.q_stride_s, sq,
              d, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (t_begin + s < t_end) load_warp_tile(t_begin + s, s);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>(); /* Q's group (the oldest) has landed */
    __syncthreads();

    const unsigned qa = swz_addr<DP>(smem_u32(sQ), r8 + (mi & 1) * 8, mi >> 1);
    const unsigned ka = swz_addr<DP>(smem_u32(my_ring), r8 + (mi >> 1) * 8, mi & 1);
    const unsigned va = swz_addr<DP>(smem_u32(my_ring + SLOT), r8 + (mi & 1) * 8, mi >> 1);
    unsigned qf[Q_IN_REGS ? KSTEPS : 1][4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) ldmatrix_x4(qf[ks], swz_step(qa, ks));
    }
    const float sl = p.scale_log2;
    float o[DT][4], m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;

    for (int tile = t_begin, n = 0; tile < t_end; tile++, n++) {
        cp_async_wait<STAGES - 2>(); /* this tile's group has landed (this thread's copies) */
        __syncwarp();                /* ... and every lane's; every lane is done with the slot refilled next */
        if (tile + STAGES - 1 < t_end) load_warp_tile(tile + STAGES - 1, (n + STAGES - 1) % STAGES);
        cp_async_commit();
        const int64_t j0 = (int64_t)tile * BC + warp * KW;
        if (j0 >= sk) continue; /* the warp's keys of the sequence's last tile lie past its end */
        const unsigned slot = (unsigned)((n % STAGES) * 2 * SLOT * sizeof(T));

        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}}; /* S = Q K^T: 16 rows x 16 keys */
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            unsigned a[4], kb[4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
                for (int x = 0; x < 4; x++) a[x] = qf[Q_IN_REGS ? ks : 0][x];
            } else {
                ldmatrix_x4(a, swz_step(qa, ks));
            }
            ldmatrix_x4(kb, swz_step(ka + slot, ks));
            const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
            mma_16816(s[0], a, b0, T());
            mma_16816(s[1], a, b1, T());
        }
        const int kc = sk - j0 < KW ? (int)(sk - j0) : KW; /* keys of the warp's 16 that exist */
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int c = nt * 8 + 2 * t + (x & 1);
                s[nt][x] = c < kc ? s[nt][x] * sl : -INFINITY;
            }
        /* online softmax on rows g (r = 0) and g + 8 (r = 1), in log2 units */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float mx = quad_max(fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1])));
            const float m_new = fmaxf(m_i[r], mx);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = fast_exp2(m_i[r] - m_use);
            m_i[r] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                s[nt][2 * r] = fast_exp2(s[nt][2 * r] - m_use);
                s[nt][2 * r + 1] = fast_exp2(s[nt][2 * r + 1] - m_use);
                rs += s[nt][2 * r] + s[nt][2 * r + 1];
            }
            l_i[r] = l_i[r] * alpha + rs;
            if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    o[dt][2 * r] *= alpha;
                    o[dt][2 * r + 1] *= alpha;
                }
            }
        }
        /* O += P V: P's 16 x 16 tile is one k-step's A fragments */
        const unsigned a[4] = {pack2(s[0][0], s[0][1], T()), pack2(s[0][2], s[0][3], T()), pack2(s[1][0], s[1][1], T()),
                               pack2(s[1][2], s[1][3], T())};
#pragma unroll
        for (int dp = 0; dp < DT / 2; dp++) {
            unsigned vb[4];
            ldmatrix_x4_trans(vb, swz_step(va + slot, dp));
            const unsigned b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
            mma_16816(o[2 * dp], a, b0, T());
            mma_16816(o[2 * dp + 1], a, b1, T());
        }
    }
    cp_async_wait<0>(); /* nothing in flight into the space reused below, nor into a block that exits */
    __syncthreads();    /* every warp is done with its ring */

    /* the warps' partial results meet in the ring's space: O_w (unnormalised, 16 x DP floats each), m_w, l_w */
    float *sO = (float *)ring, *sM = sO + WARPS * 16 * DP, *sL = sM + WARPS * 16, *sF = sL + WARPS * 16;
    float *sLse = sF + WARPS * 16;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = g + 8 * r;
        const float l = quad_sum(l_i[r]);
        if (t == 0) {
            sM[warp * 16 + row] = m_i[r];
            sL[warp * 16 + row] = l;
        }
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            *(float2 *)(sO + (warp * 16 + row) * DP + dt * 8 + 2 * t) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
    }
    __syncthreads();
    if (tid < 16) { /* row tid: M = max_w m_w, L = sum_w 2^(m_w - M) l_w; each warp's factor 2^(m_w - M) / L */
        float mx = -INFINITY, l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, sM[w * 16 + tid]);
        const float m_use = mx == -INFINITY ? 0.f : mx;
#pragma unroll
        for (int w = 0; w < WARPS; w++) l += sL[w * 16 + tid] * fast_exp2(sM[w * 16 + tid] - m_use);
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) sF[w * 16 + tid] = fast_exp2(sM[w * 16 + tid] - m_use) * inv;
        sLse[tid] = lse_from(mx, l);
    }
    __syncthreads();
    T *out = (T *)seq.o + o_off;
    const int64_t nbh = all.b * all.h;
    for (int e = tid; e < 16 * DP; e += 128) { /* element (row, col): consecutive threads, consecutive columns */
        const int row = e / DP, col = e % DP;
        if (row >= sq || col >= d) continue;
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) x += sO[(w * 16 + row) * DP + col] * sF[w * 16 + row];
        if (sp.o_part) /* a split: its normalised partial O in fp32 (and its LSE below), merged by v2_combine */
            sp.o_part[(((int64_t)blockIdx.y * nbh + bh) * all.sq + row) * d + col] = x;
        else
            from_f32(out + row * p.o_stride_s + col, x);
    }
    if (tid < sq) {
        if (sp.o_part)
            sp.lse_part[((int64_t)blockIdx.y * nbh + bh) * all.sq + tid] = sLse[tid];
        else if (seq.lse)
            seq.lse[h * p.lse_stride_h + tid] = sLse[tid];
    }
}

#endif
