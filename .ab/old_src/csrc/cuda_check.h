/* cuda_check.h -- the one CUDA error check, for the C glue and the kernel files alike: on failure, clear the
 * error (so it never stays pending for the caller's next call) and return a FATTN_ERR_CUDA status naming the call. */
#ifndef FATTN_CUDA_CHECK_H
#define FATTN_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "fattn.h"

#define FATTN_CUDA_CHECK(expr)                                                                                  \
    do {                                                                                                       \
        cudaError_t err_ = (expr);                                                                             \
        if (err_ != cudaSuccess) {                                                                             \
            cudaGetLastError();                                                                                \
            return FATTN_FAIL(FATTN_ERR_CUDA, "%s: %s (%s)", #expr, cudaGetErrorString(err_),                  \
                              cudaGetErrorName(err_));                                                         \
        }                                                                                                      \
    } while (0)

#endif
