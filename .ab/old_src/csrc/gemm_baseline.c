/* gemm_baseline.c -- the production-GEMM baseline: attention's two products as unfused batched cuBLAS GEMMs.
 *
 *   S = Q K^T   (per batch-head: Sq x D times D x Sk, fp16/bf16 in, fp32 accumulate, S stored in the input type)
 *   O = S V     (Sq x Sk times Sk x D)
 * with no softmax in between: the ceiling a fused kernel of the same FLOPs is measured against.  cuBLAS is opened
 * with dlopen on first use (fattn neither links nor needs it otherwise); the caller names the library file.
 * Row-major X (m x n) is column-major X^T, so S^T = K Q^T is gemm(T, N, Sk, Sq, D) and O^T = V^T S^T is
 * gemm(N, N, D, Sq, Sk), each strided-batched over (b, h).
 */
#include <dlfcn.h>
#include <stdio.h>

#include "gemm_baseline.h"

#ifdef FATTN_WITH_CUDA
#include <cuda_runtime_api.h>

/* The handful of cuBLAS declarations used, from its C API (values are the library's ABI). */
typedef void *cublas_handle;
enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14, CUBLAS_COMPUTE_32F = 68,
       CUBLAS_GEMM_DEFAULT = -1 };
typedef int (*create_fn)(cublas_handle *);
typedef int (*set_stream_fn)(cublas_handle, void *);
typedef int (*gemm_fn)(cublas_handle handle, int transa, int transb, int m, int n, int k, const void *alpha,
                       const void *A, int Atype, int lda, long long strideA,
                       const void *B, int Btype, int ldb, long long strideB, const void *beta,
                       void *C, int Ctype, int ldc, long long strideC, int batchCount, int computeType, int algo);

static struct {
    void *lib;
    create_fn create;
    set_stream_fn set_stream;
    gemm_fn gemm;
    cublas_handle handle[64];
} cublas;

static fattn_status load(const char *path) {
    if (cublas.lib) return FATTN_OK;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "cannot open cuBLAS (%s): %s", path, dlerror());
    cublas.create = (create_fn)dlsym(lib, "cublasCreate_v2");
    cublas.set_stream = (set_stream_fn)dlsym(lib, "cublasSetStream_v2");
    cublas.gemm = (gemm_fn)dlsym(lib, "cublasGemmStridedBatchedEx");
    if (!cublas.create || !cublas.set_stream || !cublas.gemm) {
        dlclose(lib);
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "%s lacks cublasCreate_v2 / cublasSetStream_v2 / cublasGemmStridedBatchedEx", path);
    }
    cublas.lib = lib;
    return FATTN_OK;
}

fattn_status fattn_gemm_baseline(const char *cublas_path, const attn_params *p, void *s_buf, void *stream) {
    fattn_status st = load(cublas_path);
    if (st) return st;
    if (p->h_kv != p->h) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "gemm baseline: needs as many kv heads as heads");
    if (p->sq > 0x7fffffff || p->sk > 0x7fffffff || p->b * p->h > 0x7fffffff)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "gemm baseline: sizes exceed cuBLAS's int dimensions");
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return FATTN_FAIL(FATTN_ERR_CUDA, "gemm baseline: no current CUDA device");
    if (!cublas.handle[dev] && cublas.create(&cublas.handle[dev]) != 0)
        return FATTN_FAIL(FATTN_ERR_CUDA, "cublasCreate failed on device %d", dev);
    cublas_handle h = cublas.handle[dev];
    if (cublas.set_stream(h, stream) != 0) return FATTN_FAIL(FATTN_ERR_CUDA, "cublasSetStream failed");
    const int t = p->dtype == FATTN_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    const int sq = (int)p->sq, sk = (int)p->sk, d = (int)p->d, batch = (int)(p->b * p->h);
    const float one = 1.f, zero = 0.f;
    /* q, k, v, o contiguous (B, H, S, D): head stride S * D, row stride D (checked by the caller) */
    int rc = cublas.gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, sk, sq, d, &one, p->k, t, d, (long long)sk * d, p->q, t, d,
                         (long long)sq * d, &zero, s_buf, t, sk, (long long)sq * sk, batch, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
    if (rc) return FATTN_FAIL(FATTN_ERR_CUDA, "cublasGemmStridedBatchedEx (S = Q K^T) returned %d", rc);
    rc = cublas.gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, d, sq, sk, &one, p->v, t, d, (long long)sk * d, s_buf, t, sk,
                     (long long)sq * sk, &zero, p->o, t, d, (long long)sq * d, batch, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
    if (rc) return FATTN_FAIL(FATTN_ERR_CUDA, "cublasGemmStridedBatchedEx (O = S V) returned %d", rc);
    return FATTN_OK;
}

#else

fattn_status fattn_gemm_baseline(const char *cublas_path, const attn_params *p, void *s_buf, void *stream) {
    (void)cublas_path; (void)p; (void)s_buf; (void)stream;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "fattn was built without CUDA support");
}

#endif
