/* v2_mma.cu -- version 2: tensor cores through mma.sync (sm_80+), the FlashAttention-2 structure.
 *
 * A block of V2_WARPS warps owns Br = 16 * V2_WARPS query rows of one (b, h); warp w owns rows 16w..16w+15, so
 * the online softmax never leaves the warp.  Per key block K_j, V_j (Bc = 64 keys):
 *   S = Q K_j^T         mma.m16n8k16, Q fragments kept in registers (D <= 128) or re-read by ldmatrix (D = 256),
 *                       K fragments by ldmatrix from XOR-swizzled (bank-conflict-free) shared memory
 *   S2 = S * scale_log2, masked -> -inf (only in the diagonal / last blocks: unmasked blocks skip the test)
 *   m' = max(m, rowmax S2) (quad shuffles),  P = exp2(S2 - m'),  l = alpha * l + rowsum P
 *   O = alpha * O + P V_j   P re-packed from the S accumulators into A fragments (no shared memory),
 *                       V fragments by ldmatrix.trans
 * K and V stream through cp.async, interleaved: V_j lands while S_j is computed, K_{j+1} while P V_j is.
 * Keys past the block's last visible key are zero-filled, never read (no reads past a sequence's end).
 * Head dims are bucketed at compile time (DP = 64 / 128 / 256, columns past d zero-filled); fp16 and bf16.
 * Needs 16-byte aligned q/k/v with strides a multiple of 8 elements (fattn falls back to v1 otherwise).
 * Speed: see evidence/bench (H100, fa3 grid).
 */
#include "mma.cuh"

#define V2_WARPS 4
#define V2_BR (16 * V2_WARPS)
#define V2_BC 64
#define V2_THREADS (32 * V2_WARPS)

/* Element offset of 16-byte chunk c of row r in a [rows][DP] tile, XOR-swizzled by the row's low 3 bits. */
template <int DP> DEV int swz(int r, int c) { return r * DP + ((c ^ (r & 7)) << 3); }

/* Rows [0, ROWS) of a ROWS x DP tile from global memory (row stride `stride` elements) into swizzled shared
 * memory; rows >= valid and columns >= d are zero-filled without reading. */
template <typename T, int DP, int ROWS>
DEV void load_tile(T *smem, const T *g, int64_t stride, int64_t valid, int d, int tid) {
    constexpr int CHUNKS = DP / 8;
#pragma unroll
    for (int idx = tid; idx < ROWS * CHUNKS; idx += V2_THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const bool in = r < valid && c * 8 < d;
        cp_async_16(smem + swz<DP>(r, c), in ? g + r * stride + c * 8 : g, in ? 16 : 0);
    }
}

template <typename T, int DP>
__global__ void __launch_bounds__(V2_THREADS) v2_fwd(const attn_params p) {
    constexpr int KSTEPS = DP / 16; /* k-steps of S = Q K^T */
    constexpr int NT = V2_BC / 8;   /* n8 tiles of S */
    constexpr int DT = DP / 8;      /* n8 tiles of O */
    constexpr bool Q_IN_REGS = DP <= 128;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw, *sK = sQ + V2_BR * DP, *sV = sK + V2_BC * DP;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7; /* ldmatrix: which 8x8 matrix this lane addresses, and its row */
    const int64_t nqb = (p.sq + V2_BR - 1) / V2_BR, nbh = p.b * p.h;
    const int64_t bh = blockIdx.x % nbh, i0 = (nqb - 1 - blockIdx.x / nbh) * V2_BR;
    const int64_t b = bh / p.h, h = bh % p.h;
    HEAD_OFFSETS(p, b, h);
    const T *q = (const T *)p.q + q_off + i0 * p.q_stride_s;
    const T *k = (const T *)p.k + k_off, *v = (const T *)p.v + v_off;
    const int d = (int)p.d;

    const int64_t i_last = (i0 + V2_BR < p.sq ? i0 + V2_BR : p.sq) - 1;
    const int64_t kend = fattn_row_kend(&p, i_last);   /* no row of the block sees key kend or later */
    const int64_t kfull = fattn_row_kend(&p, i0);      /* every row of the block sees keys [0, kfull) */
    const int nblocks = (int)((kend + V2_BC - 1) / V2_BC), nfull = (int)(kfull / V2_BC);
    const int64_t row0 = i0 + warp * 16 + g;           /* this thread's rows: row0 and row0 + 8 */
    const int64_t kend_r[2] = {fattn_row_kend(&p, row0), fattn_row_kend(&p, row0 + 8)};

    load_tile<T, DP, V2_BR>(sQ, q, p.q_stride_s, p.sq - i0, d, tid);
    if (nblocks > 0) load_tile<T, DP, V2_BC>(sK, k, p.k_stride_s, kend, d, tid);
    cp_async_commit();

    float o[DT][4], m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    unsigned qf[Q_IN_REGS ? KSTEPS : 1][4];

    for (int jb = 0; jb < nblocks; jb++) {
        const int64_t j0 = (int64_t)jb * V2_BC;
        cp_async_wait<0>();
        __syncthreads(); /* K_j (and Q) have landed; every warp is done with V_{j-1} */
        load_tile<T, DP, V2_BC>(sV, v + j0 * p.v_stride_s, p.v_stride_s, kend - j0, d, tid);
        cp_async_commit();
        if (Q_IN_REGS && jb == 0) {
#pragma unroll
            for (int ks = 0; ks < (Q_IN_REGS ? KSTEPS : 0); ks++)
                ldmatrix_x4(qf[ks], sQ + swz<DP>(warp * 16 + r8 + (mi & 1) * 8, ks * 2 + (mi >> 1)));
        }

        /* S = Q K_j^T */
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            unsigned a[4];
            if (Q_IN_REGS) {
                a[0] = qf[Q_IN_REGS ? ks : 0][0]; a[1] = qf[Q_IN_REGS ? ks : 0][1];
                a[2] = qf[Q_IN_REGS ? ks : 0][2]; a[3] = qf[Q_IN_REGS ? ks : 0][3];
            } else {
                ldmatrix_x4(a, sQ + swz<DP>(warp * 16 + r8 + (mi & 1) * 8, ks * 2 + (mi >> 1)));
            }
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                unsigned kb[4];
                ldmatrix_x4(kb, sK + swz<DP>(np * 16 + r8 + (mi >> 1) * 8, ks * 2 + (mi & 1)));
                const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
                mma_16816(s[2 * np], a, b0, T());
                mma_16816(s[2 * np + 1], a, b1, T());
            }
        }

        /* S2 = S * scale_log2; mask keys a row cannot see (diagonal and tail blocks only) */
        const bool masked = jb >= nfull;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nt][e] *= p.scale_log2;
                if (masked && j0 + nt * 8 + 2 * t + (e & 1) >= kend_r[e >> 1]) s[nt][e] = -INFINITY;
            }

        /* online softmax on this thread's two rows */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            const float m_new = fmaxf(m_i[r], quad_max(mx));
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = fast_exp2(m_i[r] - m_use);
            m_i[r] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                s[nt][2 * r] = fast_exp2(s[nt][2 * r] - m_use);
                s[nt][2 * r + 1] = fast_exp2(s[nt][2 * r + 1] - m_use);
                rs += s[nt][2 * r] + s[nt][2 * r + 1];
            }
            l_i[r] = l_i[r] * alpha + rs;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                o[dt][2 * r] *= alpha;
                o[dt][2 * r + 1] *= alpha;
            }
        }

        cp_async_wait<0>();
        __syncthreads(); /* V_j has landed; every warp is done with K_j */
        if (jb + 1 < nblocks)
            load_tile<T, DP, V2_BC>(sK, k + (j0 + V2_BC) * p.k_stride_s, p.k_stride_s, kend - j0 - V2_BC, d, tid);
        cp_async_commit();

        /* O += P V_j */
#pragma unroll
        for (int kk = 0; kk < V2_BC / 16; kk++) {
            const unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1], T()), pack2(s[2 * kk][2], s[2 * kk][3], T()),
                                   pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T()),
                                   pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T())};
#pragma unroll
            for (int dp = 0; dp < DT / 2; dp++) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, sV + swz<DP>(kk * 16 + r8 + (mi & 1) * 8, dp * 2 + (mi >> 1)));
                const unsigned b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
                mma_16816(o[2 * dp], a, b0, T());
                mma_16816(o[2 * dp + 1], a, b1, T());
            }
        }
    }
    cp_async_wait<0>(); /* nothing may stay in flight into a block that exits */

    /* O = acc / l, LSE = (m + log2 l) ln 2 */
    T *out = (T *)p.o + o_off;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = row0 + 8 * r;
        const float l = quad_sum(l_i[r]);
        if (i >= p.sq) continue;
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            const int col = dt * 8 + 2 * t;
            if (col < d)
                *(unsigned *)(out + i * p.o_stride_s + col) = pack2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv, T());
        }
        if (p.lse && t == 0) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i] = lse_from(m_i[r], l);
    }
}

typedef void (*v2_kernel)(const attn_params);
#define V2_ROW(T) {v2_fwd<T, 64>, v2_fwd<T, 128>, v2_fwd<T, 256>}
static const v2_kernel v2_kernels[2][3] = {V2_ROW(__half), V2_ROW(__nv_bfloat16)}; /* [dtype - 1][dp] */
static const int v2_dp[3] = {64, 128, 256};
static unsigned long long v2_smem_set[2][3]; /* bit per device: opt-in to > 48 KB of shared memory done */

static bool aligned(const void *ptr, int64_t bytes) { return (uintptr_t)ptr % (uintptr_t)bytes == 0; }

extern "C" fattn_status fattn_check_v2(const attn_params *p) {
    if (p->dtype != FATTN_F16 && p->dtype != FATTN_BF16)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 runs float16 and bfloat16 only");
    const bool ok = aligned(p->q, 16) && aligned(p->k, 16) && aligned(p->v, 16) && aligned(p->o, 4) &&
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

extern "C" fattn_status fattn_launch_v2(const attn_params *p, void *stream) {
    fattn_status st = fattn_check_v2(p);
    if (st) return st;
    const int64_t nqb = (p->sq + V2_BR - 1) / V2_BR, blocks = nqb * p->b * p->h;
    if (blocks == 0) return FATTN_OK;
    if (blocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2: grid of %lld blocks is too large", (long long)blocks);
    const int di = p->d <= 64 ? 0 : p->d <= 128 ? 1 : 2, ti = p->dtype - FATTN_F16;
    const v2_kernel kern = v2_kernels[ti][di];
    const size_t smem = (size_t)(V2_BR + 2 * V2_BC) * v2_dp[di] * 2;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (smem > 48 * 1024 && !(v2_smem_set[ti][di] >> dev & 1)) {
        CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        v2_smem_set[ti][di] |= 1ull << dev;
    }
    void *args[] = {(void *)p};
    CUDA_CHECK(cudaLaunchKernel((const void *)kern, dim3((unsigned)blocks), dim3(V2_THREADS), args, smem,
                                (cudaStream_t)stream));
    return FATTN_OK;
}
