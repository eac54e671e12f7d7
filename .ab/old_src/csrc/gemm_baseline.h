/* gemm_baseline.h -- attention's two products as unfused cuBLAS GEMMs (the production-GEMM baseline). */
#ifndef FATTN_GEMM_BASELINE_H
#define FATTN_GEMM_BASELINE_H

#include "fattn.h"

/* S = Q K^T into s_buf (B*H x Sq x Sk, the input type), then O = S V into p->o; q, k, v, o contiguous
 * (B, H, S, D) with h_kv == h, fp16 or bf16.  Loads cuBLAS from `cublas_path` on first use. */
fattn_status fattn_gemm_baseline(const char *cublas_path, const attn_params *p, void *s_buf, void *stream);

#endif
