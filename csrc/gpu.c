/* gpu.c -- CUDA runtime glue in C: device queries, the variant table, device switching around a launch.
 * Built with -DFATTN_WITH_CUDA when nvcc is present; otherwise every entry point reports that CUDA support was
 * not compiled in.  The CUDA runtime is linked statically: it loads the driver on first use, so importing fattn
 * on a machine without a GPU or driver works, and the first GPU call returns a clear error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

#ifdef FATTN_WITH_CUDA
#include "cuda_check.h"

#define FATTN_VARIANT_ROW(name, summary, min_sm, max_sm, dtypes, prefer) \
    {#name, summary, min_sm, max_sm, dtypes, fattn_launch_##name, fattn_check_##name, prefer},
const fattn_variant fattn_gpu_variants[] = {FATTN_GPU_VARIANTS(FATTN_VARIANT_ROW){0}};
#undef FATTN_VARIANT_ROW

int fattn_gpu_compiled(void) { return 1; }

fattn_status fattn_gpu_device_count(int *count) {
    *count = 0;
    FATTN_CUDA_CHECK(cudaGetDeviceCount(count));
    return FATTN_OK;
}

#define MAX_DEVICES 64
static int sm_cache[MAX_DEVICES], sm_count_cache[MAX_DEVICES];

fattn_status fattn_gpu_device_info(int device, int *sm, int *sm_count, char *name, int name_len) {
    if (device < 0 || device >= MAX_DEVICES) return FATTN_FAIL(FATTN_ERR_INVALID, "device %d out of range", device);
    if (!sm_cache[device] || name) {
        int major = 0, minor = 0, count = 0;
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
        sm_count_cache[device] = count;
        sm_cache[device] = major * 10 + minor;
        if (name && name_len > 0) {
            struct cudaDeviceProp prop;
            FATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
            snprintf(name, (size_t)name_len, "%s", prop.name);
        }
    }
    *sm = sm_cache[device];
    *sm_count = sm_count_cache[device];
    return FATTN_OK;
}

const fattn_variant *fattn_gpu_default(int device, const attn_params *p) {
    int sm, sm_count;
    if (fattn_gpu_device_info(device, &sm, &sm_count, NULL, 0)) return NULL;
    const fattn_variant *best = NULL;
    for (const fattn_variant *v = fattn_gpu_variants; v->name; v++)
        if (fattn_variant_runs_on(v, sm) && (v->dtypes >> p->dtype & 1) && v->check(p) == FATTN_OK &&
            (!v->prefer || v->prefer(p)))
            best = v;
    if (!best) FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "no GPU variant runs these arguments on device %d", device);
    return best;
}

static fattn_status check_runs_on(const fattn_variant *variant, int device, int sm) {
    if (fattn_variant_runs_on(variant, sm)) return FATTN_OK;
    if (variant->max_sm)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "variant %s needs compute capability %d.%d to %d.%d, device %d has %d.%d",
                          variant->name, variant->min_sm / 10, variant->min_sm % 10, variant->max_sm / 10,
                          variant->max_sm % 10, device, sm / 10, sm % 10);
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "variant %s needs compute capability %d.%d, device %d has %d.%d",
                      variant->name, variant->min_sm / 10, variant->min_sm % 10, device, sm / 10, sm % 10);
}

fattn_status fattn_gpu_forward(const fattn_variant *variant, int device, attn_params *p, void *stream) {
    int sm, sm_count, current = -1;
    fattn_status st = fattn_gpu_device_info(device, &sm, &sm_count, NULL, 0);
    if (st) return st;
    if ((st = check_runs_on(variant, device, sm))) return st;
    p->sm_count = sm_count;
    FATTN_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) FATTN_CUDA_CHECK(cudaSetDevice(device));
    st = variant->launch(p, stream);
    if (st) cudaGetLastError();
    if (current != device) {
        cudaError_t err = cudaSetDevice(current);
        if (!st && err != cudaSuccess) st = FATTN_FAIL(FATTN_ERR_CUDA, "cudaSetDevice(%d): %s", current,
                                                       cudaGetErrorString(err));
    }
    return st;
}

/* L2 flush buffer per device: twice the L2, allocated on the first timing call there. */
static void *flush_buf[MAX_DEVICES];
static size_t flush_bytes[MAX_DEVICES];

static fattn_status time_one(const fattn_variant *variant, attn_params *p, void *stream, int device, int reps,
                             int warmup, int flush, float *us) {
    fattn_status st = FATTN_OK;
    if (flush && !flush_buf[device]) {
        int l2 = 0;
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
        const size_t bytes = 2 * (size_t)(l2 > 0 ? l2 : 64 << 20);
        FATTN_CUDA_CHECK(cudaMalloc(&flush_buf[device], bytes));
        flush_bytes[device] = bytes;
    }
    for (int i = 0; i < warmup && !st; i++) st = variant->launch(p, stream);
    cudaEvent_t *ev = (cudaEvent_t *)calloc(2 * (size_t)reps, sizeof(cudaEvent_t));
    if (!ev) return FATTN_FAIL(FATTN_ERR_NOMEM, "out of memory for %d timing events", 2 * reps);
    int made = 0;
    for (; made < 2 * reps && !st; made++)
        if (cudaEventCreate(&ev[made]) != cudaSuccess) st = FATTN_FAIL(FATTN_ERR_CUDA, "cudaEventCreate failed");
    for (int i = 0; i < reps && !st; i++) {
        cudaError_t e = flush ? cudaMemsetAsync(flush_buf[device], i & 0xff, flush_bytes[device], (cudaStream_t)stream)
                              : cudaSuccess;
        if (e == cudaSuccess) e = cudaEventRecord(ev[2 * i], (cudaStream_t)stream);
        if (e != cudaSuccess) { st = FATTN_FAIL(FATTN_ERR_CUDA, "timing: %s", cudaGetErrorString(e)); break; }
        if ((st = variant->launch(p, stream))) break;
        if ((e = cudaEventRecord(ev[2 * i + 1], (cudaStream_t)stream)) != cudaSuccess)
            st = FATTN_FAIL(FATTN_ERR_CUDA, "timing: %s", cudaGetErrorString(e));
    }
    if (!st) {
        cudaError_t e = cudaEventSynchronize(ev[2 * reps - 1]);
        for (int i = 0; i < reps && e == cudaSuccess; i++) e = cudaEventElapsedTime(&us[i], ev[2 * i], ev[2 * i + 1]);
        if (e != cudaSuccess) st = FATTN_FAIL(FATTN_ERR_CUDA, "timing: %s", cudaGetErrorString(e));
        for (int i = 0; i < reps; i++) us[i] *= 1000.f;
    }
    for (int i = 0; i < made; i++) cudaEventDestroy(ev[i]);
    free(ev);
    return st;
}

fattn_status fattn_gpu_time(const fattn_variant *variant, int device, attn_params *p, void *stream, int reps,
                            int warmup, int flush, float *us) {
    int sm, sm_count, current = -1;
    if (reps < 1 || reps > FATTN_TIME_MAX_REPS || warmup < 0)
        return FATTN_FAIL(FATTN_ERR_INVALID, "reps must be in [1, %d] and warmup >= 0", FATTN_TIME_MAX_REPS);
    fattn_status st = fattn_gpu_device_info(device, &sm, &sm_count, NULL, 0);
    if (st || (st = check_runs_on(variant, device, sm))) return st;
    p->sm_count = sm_count;
    FATTN_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) FATTN_CUDA_CHECK(cudaSetDevice(device));
    st = time_one(variant, p, stream, device, reps, warmup, flush, us);
    if (st) cudaGetLastError();
    if (current != device) cudaSetDevice(current);
    return st;
}

#else /* built without CUDA */

const fattn_variant fattn_gpu_variants[] = {{0}};

int fattn_gpu_compiled(void) { return 0; }

static fattn_status not_built(void) {
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "fattn was built without CUDA support (nvcc was not found at build time)");
}
fattn_status fattn_gpu_device_count(int *count) { *count = 0; return not_built(); }
fattn_status fattn_gpu_device_info(int device, int *sm, int *sm_count, char *name, int name_len) {
    (void)device; (void)sm; (void)sm_count; (void)name; (void)name_len;
    return not_built();
}
fattn_status fattn_gpu_forward(const fattn_variant *variant, int device, attn_params *p, void *stream) {
    (void)variant; (void)device; (void)p; (void)stream;
    return not_built();
}
fattn_status fattn_gpu_time(const fattn_variant *variant, int device, attn_params *p, void *stream, int reps,
                            int warmup, int flush, float *us) {
    (void)variant; (void)device; (void)p; (void)stream; (void)reps; (void)warmup; (void)flush; (void)us;
    return not_built();
}
const fattn_variant *fattn_gpu_default(int device, const attn_params *p) {
    (void)device; (void)p;
    not_built();
    return NULL;
}
#endif
