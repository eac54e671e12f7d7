/* v2_combine.cuh -- the merge of v2's split-KV partial results (v2_split, defined by v2_fwd.cu before it includes
 * this file): by the last split of a query block to finish, inside v2_fwd (v2_merge_rows, where the plan fuses it),
 * else by one kernel, v2_combine, launched by fattn_launch_v2 after v2_fwd. */
#ifndef FATTN_V2_COMBINE_CUH
#define FATTN_V2_COMBINE_CUH

/* A warp's running merge of splits s = first, first + stride, ... < splits of partial row `row` (of nrows) into (m, l,
 * acc): acc = sum_s e^(LSE_s - m) O_s over columns lane + 32 c, l the same sum of weights.  It loads the LSEs and
 * partial outputs of CHUNK of its splits at once (through L2: another block may have written them in this kernel),
 * then folds them in split order, so a row costs one round trip to memory per CHUNK splits (COMBINE_CHUNK in the
 * merge kernel, V2_MERGE_SPLITS in v2_fwd's).  Splits that saw no key (LSE_s = -inf) weigh 0. */
#define COMBINE_CHUNK 8
template <int NC, int CHUNK = COMBINE_CHUNK>
DEV void v2_merge_fold(const v2_split &sp, int64_t nrows, int64_t row, int d, int lane, int first, int stride,
                       int splits, float &m, float &l, float (&acc)[NC]) {
    for (int s0 = first; s0 < splits; s0 += stride * CHUNK) {
        float ls[CHUNK], x[CHUNK][NC];
#pragma unroll
        for (int u = 0; u < CHUNK; u++) {
            const int64_t s = s0 + stride * u, at = (s * nrows + row) * d;
            ls[u] = s < splits ? __ldcg(sp.lse_part + s * nrows + row) : -INFINITY;
#pragma unroll
            for (int c = 0; c < NC; c++)
                x[u][c] = s < splits && lane + 32 * c < d ? __ldcg(sp.o_part + at + lane + 32 * c) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < CHUNK; u++) {
            if (ls[u] == -INFINITY) continue;
            const float m_new = fmaxf(m, ls[u]), a = __expf(m - m_new), w = __expf(ls[u] - m_new);
            l = l * a + w;
#pragma unroll
            for (int c = 0; c < NC; c++) acc[c] = acc[c] * a + w * x[u][c];
            m = m_new;
        }
    }
}

/* The merged row's O = acc / l and LSE = m + log l (natural log) -- with a sink s (natural log; NULL: none) joined
 * into the denominator (csrc/sinks.h's rule, sink_join2): the factor for acc, and the LSE.  A row no split saw:
 * factor 0, LSE -inf (or s). */
DEV float v2_merged_row(float m, float l, const float *sink, float *lse) {
    float inv = l > 0.f ? 1.f / l : 0.f;
    if (!sink) {
        *lse = l > 0.f ? m + __logf(l) : -INFINITY;
        return inv;
    }
    float lse2 = l > 0.f ? (m + __logf(l)) * FATTN_LOG2E : -INFINITY;
    sink_join2(*sink * FATTN_LOG2E, &lse2, &inv);
    *lse = lse2 * FATTN_LN2;
    return inv;
}

/* Rows [i0, i_end) of the splits' partial rows (row i of them at row0 + i, of nrows) merged by the block (WARPS
 * warps, a warp per row, the splits in order: bitwise repeatable whichever split finishes last): O = acc / l into
 * out (row stride o_stride_s), LSE = m + log l into lse (NULL: none); a row no split saw gets O = 0, LSE = -inf
 * (with a sink s: LSE = s).  sinks (NULL: none): row i's sink is sinks[i * sink_step] (v2_merged_row).  Out of
 * line, with scalar arguments: inlined into v2_fwd, its code made ptxas spill in the kernel's main loop. */
template <typename T, int DP, int WARPS>
__device__ __noinline__ void v2_merge_rows(const v2_split sp, int splits, int64_t nrows, int64_t row0, int64_t i0,
                                           int64_t i_end, int d, T *out, int64_t o_stride_s, float *lse,
                                           const float *sinks, int sink_step) {
    constexpr int NC = (DP + 31) / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t i = i0 + warp; i < i_end; i += WARPS) {
        float m = -INFINITY, l = 0.f, acc[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) acc[c] = 0.f;
        v2_merge_fold<NC, V2_MERGE_SPLITS>(sp, nrows, row0 + i, d, lane, 0, 1, splits, m, l, acc);
        float lse_i;
        const float inv = v2_merged_row(m, l, sinks ? sinks + i * sink_step : NULL, &lse_i);
#pragma unroll
        for (int c = 0; c < NC; c++)
            if (lane + 32 * c < d) from_f32(out + i * o_stride_s + lane + 32 * c, acc[c] * inv);
        if (lse && lane == 0) lse[i] = lse_i;
    }
}

/* Merges the splits of v2_fwd where the plan does not fuse it: a block of 128 threads per query row, warp w taking
 * the splits w, w + 4, ... (v2_merge_fold); the four warps' results are merged in warp order: a fixed order, bitwise
 * repeatable.  LSE = m + log l over the splits; a row no split saw gets O = 0, LSE = -inf (with a sink s: LSE = s). */
#define COMBINE_WARPS 4 /* the block: 128 threads */
template <typename T>
__global__ void __launch_bounds__(COMBINE_WARPS * 32) v2_combine(const attn_params all, const v2_split sp, int splits) {
    constexpr int NC = FATTN_MAX_HEADDIM / 32; /* columns per lane */
    static_assert(32 * NC >= FATTN_MAX_HEADDIM, "every column has a lane");
    __shared__ float part[COMBINE_WARPS][FATTN_MAX_HEADDIM], wm[COMBINE_WARPS], wl[COMBINE_WARPS];
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory"); /* launched as v2_fwd's programmatic dependent on Hopper */
#endif
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t nrows = all.b * all.h * all.sq, row = blockIdx.x;
    const int64_t bh = row / all.sq, i = row % all.sq, h = bh % all.h;
    const fattn_seq seq = fattn_seq_of(&all, bh / all.h); /* the row's sequence */
    if (i >= seq.sq) return;
    const int d = (int)all.d;
    float m = -INFINITY, l = 0.f, acc[NC];
#pragma unroll
    for (int c = 0; c < NC; c++) acc[c] = 0.f;
    v2_merge_fold<NC>(sp, nrows, row, d, lane, warp, COMBINE_WARPS, splits, m, l, acc);
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < NC; c++)
        if (lane + 32 * c < d) part[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    static_assert(COMBINE_WARPS == 4, "the merge below is written out for four warps (a fixed order)");
    const float mx = fmaxf(fmaxf(wm[0], wm[1]), fmaxf(wm[2], wm[3])), m_use = mx == -INFINITY ? 0.f : mx;
    float f[COMBINE_WARPS], sum = 0.f;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; w++) {
        f[w] = __expf(wm[w] - m_use);
        sum += wl[w] * f[w];
    }
    float lse;
    const float sink = all.sinks ? fattn_sink_of(&all, h, i) : 0.f;
    const float inv = v2_merged_row(mx, sum, all.sinks ? &sink : NULL, &lse);
    T *out = (T *)seq.o + h * all.o_stride_h + i * all.o_stride_s;
    for (int col = tid; col < d; col += COMBINE_WARPS * 32)
        from_f32(out + col, ((part[0][col] * f[0] + part[1][col] * f[1]) + (part[2][col] * f[2] + part[3][col] * f[3])) * inv);
    if (seq.lse && tid == 0) seq.lse[h * all.lse_stride_h + i] = lse;
}
#undef COMBINE_CHUNK

#endif
