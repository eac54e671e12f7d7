/* kvcache.h -- appending a call's new keys and values to a KV cache (attention_with_kvcache's k_new, v_new).
 *
 * The cache is the call's k and v (attn_params: contiguous (B, S_max, H_kv, D), or paged through the block table);
 * sequence b's new rows t = 0 .. s_new - 1 go to its key positions seqused_k[b] + t (cache_seqlens: the lengths
 * before the call), through fattn_key_offset like every read.  The attention that follows sees them through
 * seqused_k_plus = s_new.  Runs only after every check and the plan passed: a refused call writes nothing. */
#ifndef FATTN_KVCACHE_H
#define FATTN_KVCACHE_H

#include "fattn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const void *k_new, *v_new;        /* (B, s_new, h_kv, d), the cache's dtype */
    int64_t kn_stride_b, kn_stride_h, kn_stride_s;
    int64_t vn_stride_b, vn_stride_h, vn_stride_s;
    int64_t s_new;                    /* 0: nothing to append */
} fattn_append;

/* On the CPU. */
void fattn_cpu_append_kv(const attn_params *p, const fattn_append *a);

/* On the GPU (csrc/gpu.c; kernels/simt/append_kv.cu), on `stream` of `device`. */
fattn_status fattn_gpu_append_kv(const attn_params *p, const fattn_append *a, int device, void *stream);
#ifdef FATTN_WITH_CUDA
fattn_status fattn_launch_append_kv(const attn_params *p, const fattn_append *a, void *stream);
#endif

#ifdef __cplusplus
}
#endif
#endif
