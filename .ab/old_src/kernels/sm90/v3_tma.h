/* v3_tma.h -- host side of the sm90 kernels' TMA: the 4-D tensor maps (d, s, heads, batch) their loads and stores
 * go through, encoded by the driver's cuTensorMapEncodeTiled (looked up once through the runtime; fattn links no
 * driver library).  Included by each sm90 launcher file (v3_fwd.cu, v3_bwd.cu); host code only. */
#ifndef FATTN_V3_TMA_H
#define FATTN_V3_TMA_H

#include <cuda.h> /* CUtensorMap and its enums: types only */
#include <pthread.h>

#include "../../csrc/fattn.h"

/* cuTensorMapEncodeTiled, reached through the runtime (fattn links no driver library); looked up once. */
typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static encode_tiled_fn v3_encode;
static pthread_once_t v3_encode_once = PTHREAD_ONCE_INIT;
static inline void v3_find_encode(void) {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        v3_encode = (encode_tiled_fn)fn;
    cudaGetLastError();
}

/* A tensor's 4-D map (d, s, heads, batch): boxes of 64 columns x `box_rows` rows, 128-byte swizzled, zeros out of
 * bounds.  Strides are in elements; a dimension of size 1 gets a harmless stride (TMA wants multiples of 16 bytes
 * even where the coordinate is always 0). */
static inline fattn_status v3_map(CUtensorMap *map, const void *base, fattn_dtype dt, int64_t d, int64_t s, int64_t heads,
                           int64_t batch, int64_t ss, int64_t sh, int64_t sb, int box_rows, const char *name) {
    cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)s, (cuuint64_t)heads, (cuuint64_t)batch};
    int64_t st[3] = {ss, sh, sb};
    for (int i = 0; i < 3; i++) /* size 1: the extent of the dimension inside it, rounded up to 8 elements */
        if (dims[i + 1] == 1) st[i] = ((i ? st[i - 1] : 1) * (int64_t)dims[i] + 7) / 8 * 8;
    cuuint64_t strides[3] = {(cuuint64_t)st[0] * 2, (cuuint64_t)st[1] * 2, (cuuint64_t)st[2] * 2};
    cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1}, estr[4] = {1, 1, 1, 1};
    CUresult r = v3_encode(map, dt == FATTN_F16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                           (void *)base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return FATTN_FAIL(FATTN_ERR_CUDA, "v3: cuTensorMapEncodeTiled(%s) failed (CUresult %d)", name, (int)r);
    return FATTN_OK;
}

/* The encoder, or an error when the driver has none. */
static inline fattn_status v3_tma_ready(void) {
    pthread_once(&v3_encode_once, v3_find_encode);
    if (!v3_encode) return FATTN_FAIL(FATTN_ERR_CUDA, "v3: the driver has no cuTensorMapEncodeTiled (CUDA 12+ needed)");
    return FATTN_OK;
}

#endif
