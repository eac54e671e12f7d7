/* append_kv.cu -- attention_with_kvcache's append: k_new / v_new rows copied into the cache (csrc/kvcache.h).
 *
 * One block per (new row t, kv head, sequence b); its threads copy the row's elements of K and of V.  The slot is
 * found as every kernel finds a key (fattn_seq_params, fattn_key_offset): contiguous or through the block table. */
#include "../common.cuh"

#include "../../csrc/kvcache.h"
#include "cuda_check.h"

#define APPEND_THREADS 128

template <typename E> /* an element-sized word: the copy is bitwise */
__global__ void __launch_bounds__(APPEND_THREADS) append_kv(const attn_params all, const fattn_append a) {
    const int64_t t = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    attn_params s;
    fattn_seq_params(&all, b, &s);
    const int64_t slot = all.seqused_k[b] + t;
    E *k = (E *)s.k + fattn_key_offset(&s, slot, all.k_stride_b, all.k_stride_s) + hk * all.k_stride_h;
    E *v = (E *)s.v + fattn_key_offset(&s, slot, all.v_stride_b, all.v_stride_s) + hk * all.v_stride_h;
    const E *kn = (const E *)a.k_new + b * a.kn_stride_b + hk * a.kn_stride_h + t * a.kn_stride_s;
    const E *vn = (const E *)a.v_new + b * a.vn_stride_b + hk * a.vn_stride_h + t * a.vn_stride_s;
    for (int64_t e = threadIdx.x; e < all.d; e += APPEND_THREADS) {
        k[e] = kn[e];
        v[e] = vn[e];
    }
}

extern "C" fattn_status fattn_launch_append_kv(const attn_params *p, const fattn_append *a, void *stream) {
    if (a->s_new == 0 || p->b == 0 || p->h_kv == 0) return FATTN_OK;
    const dim3 grid((unsigned)a->s_new, (unsigned)p->h_kv, (unsigned)p->b);
    if (p->dtype == FATTN_F32)
        append_kv<unsigned int><<<grid, APPEND_THREADS, 0, (cudaStream_t)stream>>>(*p, *a);
    else
        append_kv<unsigned short><<<grid, APPEND_THREADS, 0, (cudaStream_t)stream>>>(*p, *a);
    FATTN_CUDA_CHECK(cudaGetLastError());
    return FATTN_OK;
}
