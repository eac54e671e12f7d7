/* varlen_rows.cu -- zero gradients in the rows of a packed batch that no sequence covers, on the GPU
 * (csrc/varlen_rows.h).  A small grid strides over the uncovered elements of dq, then of dk and dv: none where the
 * sequences fill the arrays (the usual case: one launch that reads two offsets per side). */
#include "../common.cuh"

#include "../../csrc/varlen_rows.h"
#include "cuda_check.h"

#define ROWS_THREADS 256
#define ROWS_BLOCKS 64

/* The uncovered rows' elements of a (total, h, d) array, strided over the grid; E: an element-sized word. */
template <typename E>
__device__ void zero_side(E *x, int64_t ss, int64_t sh, int64_t h, int64_t d, const int32_t *cu, int64_t batch,
                          int64_t total) {
    int64_t first, last;
    fattn_uncovered_rows(cu, batch, total, &first, &last);
    const int64_t row_elems = h * d, n = (first + total - last) * row_elems;
    for (int64_t e = (int64_t)blockIdx.x * ROWS_THREADS + threadIdx.x; e < n; e += (int64_t)gridDim.x * ROWS_THREADS) {
        const int64_t i = e / row_elems, r = i < first ? i : last + (i - first), c = e % row_elems;
        x[r * ss + c / d * sh + c % d] = 0;
    }
}

template <typename E> __global__ void __launch_bounds__(ROWS_THREADS) zero_uncovered(const attn_bwd_params p) {
    const attn_params &f = p.fwd;
    zero_side((E *)p.dq, p.dq_stride_s, p.dq_stride_h, f.h, f.d, f.cu_seqlens_q, f.b, f.total_q);
    zero_side((E *)p.dk, p.dk_stride_s, p.dk_stride_h, f.h_kv, f.d, f.cu_seqlens_k, f.b, f.total_k);
    zero_side((E *)p.dv, p.dv_stride_s, p.dv_stride_h, f.h_kv, f.d, f.cu_seqlens_k, f.b, f.total_k);
}

extern "C" fattn_status fattn_launch_zero_uncovered(const attn_bwd_params *p, void *stream) {
    if (p->fwd.dtype == FATTN_F32)
        zero_uncovered<unsigned int><<<ROWS_BLOCKS, ROWS_THREADS, 0, (cudaStream_t)stream>>>(*p);
    else
        zero_uncovered<unsigned short><<<ROWS_BLOCKS, ROWS_THREADS, 0, (cudaStream_t)stream>>>(*p);
    FATTN_CUDA_CHECK(cudaGetLastError());
    return FATTN_OK;
}
