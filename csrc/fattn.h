/* fattn.h -- the plain C interface shared by the extension, the CPU backend and the CUDA kernels.
 *
 * One attn_params describes one attention call.  Tensors are addressed by raw pointers and int64 strides in
 * elements (last dimension contiguous), so any view of a (B, H, S, D) or (B, S, H, D) buffer is read in place.
 *
 *   q: (b, h, sq, d)      k, v: (b, h_kv, sk, d)      o: (b, h, sq, d)      lse: (b, h, sq) float32, or NULL
 *
 * The math (paper names, Dao et al.):  S = Q K^T * scale;  P = softmax(S) row-wise;  O = P V;
 * LSE_i = log(sum_j exp(S_ij)).  Kernels work in base 2: S2 = Q K^T * scale_log2, P = exp2(S2 - m_i).
 *
 * Causal masking: key j is visible from query i iff j <= i + causal_offset, where
 *   top-left     (torch SDPA's is_causal):  causal_offset = 0
 *   bottom-right (flash-attention's):       causal_offset = sk - sq
 * A query row with no visible key gets O = 0 and LSE = -inf.
 */
#ifndef FATTN_H
#define FATTN_H

#ifdef __CUDACC_RTC__ /* NVRTC (run-time compilation): no system headers */
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#else
#include <stdint.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FATTN_LOG2E 1.4426950408889634f
#define FATTN_LN2 0.6931471805599453f
#define FATTN_MAX_HEADDIM 256

typedef enum { FATTN_F32 = 0, FATTN_F16 = 1, FATTN_BF16 = 2 } fattn_dtype;

typedef enum { FATTN_CAUSAL_NONE = 0, FATTN_CAUSAL_TOP_LEFT = 1, FATTN_CAUSAL_BOTTOM_RIGHT = 2 } fattn_causal;

typedef struct attn_params {
    const void *q, *k, *v;
    void *o;
    float *lse;                       /* NULL: not written */
    /* strides in elements; the last dimension has stride 1 */
    int64_t q_stride_b, q_stride_h, q_stride_s;
    int64_t k_stride_b, k_stride_h, k_stride_s;
    int64_t v_stride_b, v_stride_h, v_stride_s;
    int64_t o_stride_b, o_stride_h, o_stride_s;
    int64_t lse_stride_b, lse_stride_h; /* lse row stride is 1 */
    int64_t b, h, h_kv, sq, sk, d;
    int64_t h_per_kv;                 /* h / h_kv: query head i reads kv head i / h_per_kv */
    fattn_dtype dtype;
    float scale, scale_log2;          /* softmax scale, and scale * log2(e) */
    int causal;                       /* fattn_causal */
    int64_t causal_offset;            /* 0 (top-left) or sk - sq (bottom-right) */
    int64_t sm_count;                 /* filled by the launcher's caller: multiprocessors on the device */
    int config;                       /* variant-specific config index; -1: the tuned config if one is
                                         registered for this problem, else the variant's default */
} attn_params;

/* Status codes; a non-zero status comes with a message from fattn_last_error(). */
typedef enum {
    FATTN_OK = 0,
    FATTN_ERR_INVALID = 1,   /* bad argument reaching C: a bug in the caller */
    FATTN_ERR_UNSUPPORTED = 2,
    FATTN_ERR_CUDA = 3,
    FATTN_ERR_NOMEM = 4,
} fattn_status;

#ifndef __CUDACC_RTC__ /* host only */
/* Records "file:line: message" in a thread-local buffer and returns `status`. */
fattn_status fattn_set_error(fattn_status status, const char *file, int line, const char *fmt, ...);
const char *fattn_last_error(void);
#endif

#define FATTN_FAIL(status, ...) fattn_set_error((status), __FILE__, __LINE__, __VA_ARGS__)

#ifdef __CUDACC__
#define FATTN_HD static __host__ __device__ __forceinline__
#else
#define FATTN_HD static inline
#endif

/* Visible key range for query row i: keys [0, fattn_row_kend(p, i)).  Returns 0 for a fully masked row. */
FATTN_HD int64_t fattn_row_kend(const attn_params *p, int64_t i) {
    if (!p->causal) return p->sk;
    int64_t e = i + p->causal_offset + 1;
    return e < 0 ? 0 : (e > p->sk ? p->sk : e);
}

/* The sequence-length bucket of the tuned-config cache: FATTN_SEQ_BUCKETS buckets of Sk (<= 512, <= 1k, ...,
 * <= 32k, more), doubled by whether the queries fit one 64-row tile (decode-like calls tune differently). */
#define FATTN_SEQ_BUCKETS 16
FATTN_HD int fattn_seq_bucket(int64_t sq, int64_t sk) {
    int b = 0;
    while (b < 7 && sk > ((int64_t)512 << b)) b++;
    return b + (sq <= 64 ? 8 : 0);
}

#ifdef __cplusplus
}
#endif
#endif
