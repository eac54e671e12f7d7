/* rtc.c -- NVRTC and the CUDA driver API through dlopen (see rtc.h).  Only the few entry points fattn needs are
 * declared here, with their documented C signatures, so no NVRTC or driver header is needed at build time. */
#include "rtc.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifdef FATTN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* A library entry point and the function pointer it goes into. */
typedef struct {
    void **slot;
    const char *name;
} rtc_sym;

/* dlsym every entry point of syms into its slot; 1 if all of them resolved. */
static int bind_symbols(void *lib, const rtc_sym *syms, size_t n) {
    int all = 1;
    for (size_t i = 0; i < n; i++) all &= (*syms[i].slot = dlsym(lib, syms[i].name)) != NULL;
    return all;
}

/* ---- NVRTC ----------------------------------------------------------------------------------------------- */

typedef void *nvrtc_program;
static struct {
    void *lib;
    int (*create)(nvrtc_program *, const char *, const char *, int, const char *const *, const char *const *);
    int (*compile)(nvrtc_program, int, const char *const *);
    int (*log_size)(nvrtc_program, size_t *);
    int (*log)(nvrtc_program, char *);
    int (*cubin_size)(nvrtc_program, size_t *);
    int (*cubin)(nvrtc_program, char *);
    int (*destroy)(nvrtc_program *);
    int (*version)(int *, int *);
    const char *(*error_string)(int);
} nvrtc;
static pthread_mutex_t rtc_lock = PTHREAD_MUTEX_INITIALIZER;

static fattn_status open_nvrtc(const char *path) {
    fattn_status st = FATTN_OK;
    pthread_mutex_lock(&rtc_lock);
    if (!nvrtc.lib) {
        const char *names[] = {path && *path ? path : NULL, "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
        void *lib = NULL;
        for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
            if (names[i]) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "NVRTC not found (%s); set FATTN_NVRTC to libnvrtc.so's path or "
                            "pip install nvidia-cuda-nvrtc", path && *path ? path : "libnvrtc.so.13/.12");
        } else {
#define SYM(field, name) {(void **)&nvrtc.field, name}
            const rtc_sym syms[] = {SYM(create, "nvrtcCreateProgram"), SYM(compile, "nvrtcCompileProgram"),
                                    SYM(log_size, "nvrtcGetProgramLogSize"), SYM(log, "nvrtcGetProgramLog"),
                                    SYM(cubin_size, "nvrtcGetCUBINSize"), SYM(cubin, "nvrtcGetCUBIN"),
                                    SYM(destroy, "nvrtcDestroyProgram"), SYM(version, "nvrtcVersion"),
                                    SYM(error_string, "nvrtcGetErrorString")};
#undef SYM
            if (!bind_symbols(lib, syms, sizeof syms / sizeof syms[0])) {
                dlclose(lib);
                memset(&nvrtc, 0, sizeof nvrtc);
                st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "the NVRTC library found lacks the entry points fattn needs");
            } else {
                nvrtc.lib = lib;
            }
        }
    }
    pthread_mutex_unlock(&rtc_lock);
    return st;
}

fattn_status fattn_rtc_version(const char *nvrtc_path, int *major, int *minor) {
    fattn_status st = open_nvrtc(nvrtc_path);
    if (st) return st;
    int r = nvrtc.version(major, minor);
    return r ? FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "nvrtcVersion: %s", nvrtc.error_string(r)) : FATTN_OK;
}

fattn_status fattn_rtc_compile(const char *nvrtc_path, const char *source, const char *name, const char *const *opts,
                               int nopts, char **image, size_t *image_size, char **log) {
    *image = NULL;
    *image_size = 0;
    *log = NULL;
    fattn_status st = open_nvrtc(nvrtc_path);
    if (st) return st;
    nvrtc_program prog = NULL;
    int r = nvrtc.create(&prog, source, name, 0, NULL, NULL);
    if (r) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "nvrtcCreateProgram(%s): %s", name, nvrtc.error_string(r));
    const int rc = nvrtc.compile(prog, nopts, opts);
    size_t n = 0;
    if (!nvrtc.log_size(prog, &n) && (*log = (char *)malloc(n + 1))) {
        (*log)[0] = 0;
        if (n) nvrtc.log(prog, *log);
        (*log)[n] = 0;
    }
    if (rc) {
        st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "NVRTC could not compile %s: %s", name, nvrtc.error_string(rc));
    } else if ((r = nvrtc.cubin_size(prog, image_size)) || !*image_size) {
        st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "nvrtcGetCUBINSize(%s): %s (compile for a real sm_XY, not compute_XY)",
                        name, r ? nvrtc.error_string(r) : "empty");
    } else if (!(*image = (char *)malloc(*image_size))) {
        st = FATTN_FAIL(FATTN_ERR_NOMEM, "out of memory for a %zu-byte cubin", *image_size);
    } else if ((r = nvrtc.cubin(prog, *image))) {
        st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "nvrtcGetCUBIN(%s): %s", name, nvrtc.error_string(r));
    }
    if (st) {
        free(*image);
        *image = NULL;
        *image_size = 0;
    }
    nvrtc.destroy(&prog);
    return st;
}

/* ---- the driver API -------------------------------------------------------------------------------------- */

#define RTC_MAX_DEVICES 64
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8

struct fattn_rtc_kernel {
    void *image;
    size_t size;
    char func[64];
    void *module[RTC_MAX_DEVICES];   /* CUmodule per device, loaded on first launch there */
    void *function[RTC_MAX_DEVICES]; /* CUfunction */
    unsigned smem_set[RTC_MAX_DEVICES];
};

#ifdef FATTN_WITH_CUDA
static struct {
    void *lib;
    int (*module_load_data)(void **, const void *);
    int (*module_get_function)(void **, void *, const char *);
    int (*func_set_attribute)(void *, int, int);
    int (*launch_kernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                         void **);
    int (*get_error_string)(int, const char **);
} cu;

static fattn_status open_driver(void) {
    fattn_status st = FATTN_OK;
    pthread_mutex_lock(&rtc_lock);
    if (!cu.lib) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            st = FATTN_FAIL(FATTN_ERR_CUDA, "the CUDA driver (libcuda.so.1) could not be opened: %s", dlerror());
        } else {
#define SYM(field, name) {(void **)&cu.field, name}
            const rtc_sym syms[] = {SYM(module_load_data, "cuModuleLoadData"),
                                    SYM(module_get_function, "cuModuleGetFunction"),
                                    SYM(func_set_attribute, "cuFuncSetAttribute"), SYM(launch_kernel, "cuLaunchKernel"),
                                    SYM(get_error_string, "cuGetErrorString")};
#undef SYM
            if (!bind_symbols(lib, syms, sizeof syms / sizeof syms[0])) {
                dlclose(lib);
                memset(&cu, 0, sizeof cu);
                st = FATTN_FAIL(FATTN_ERR_CUDA, "the CUDA driver lacks the entry points fattn needs");
            } else {
                cu.lib = lib;
            }
        }
    }
    pthread_mutex_unlock(&rtc_lock);
    return st;
}

static const char *cu_error(int r) {
    const char *s = NULL;
    return cu.get_error_string && !cu.get_error_string(r, &s) && s ? s : "unknown CUDA driver error";
}
#endif

fattn_rtc_kernel *fattn_rtc_kernel_new(const void *image, size_t size, const char *func) {
    fattn_rtc_kernel *k = (fattn_rtc_kernel *)calloc(1, sizeof *k);
    if (!k || strlen(func) >= sizeof k->func || !(k->image = malloc(size))) {
        free(k);
        return NULL;
    }
    memcpy(k->image, image, size);
    k->size = size;
    strcpy(k->func, func);
    return k;
}

fattn_status fattn_rtc_launch(fattn_rtc_kernel *k, unsigned gx, unsigned gy, unsigned block, unsigned smem,
                              void *stream, void **args) {
#ifdef FATTN_WITH_CUDA
    fattn_status st = open_driver();
    if (st) return st;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return FATTN_FAIL(FATTN_ERR_CUDA, "cudaGetDevice: %s", cudaGetErrorString(e));
    if (dev < 0 || dev >= RTC_MAX_DEVICES) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "device %d out of range", dev);
    int r = 0;
    pthread_mutex_lock(&rtc_lock);
    if (!k->function[dev]) { /* the runtime made the device's primary context current: load the image into it */
        void *mod = NULL, *fn = NULL;
        if ((r = cu.module_load_data(&mod, k->image)) == 0 && (r = cu.module_get_function(&fn, mod, k->func)) == 0) {
            k->module[dev] = mod;
            k->function[dev] = fn;
        }
    }
    if (!r && smem > 48 * 1024 && k->smem_set[dev] < smem) {
        if ((r = cu.func_set_attribute(k->function[dev], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem)) == 0)
            k->smem_set[dev] = smem;
    }
    pthread_mutex_unlock(&rtc_lock);
    if (r) return FATTN_FAIL(FATTN_ERR_CUDA, "loading run-time compiled kernel %s: %s", k->func, cu_error(r));
    r = cu.launch_kernel(k->function[dev], gx, gy, 1, block, 1, 1, smem, stream, args, NULL);
    if (r) return FATTN_FAIL(FATTN_ERR_CUDA, "cuLaunchKernel(%s): %s", k->func, cu_error(r));
    return FATTN_OK;
#else
    (void)k; (void)gx; (void)gy; (void)block; (void)smem; (void)stream; (void)args;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "fattn was built without CUDA support");
#endif
}

/* ---- the registry ----------------------------------------------------------------------------------------------- */

#define RTC_MAX_ENTRIES 512
static fattn_rtc_entry rtc_entries[RTC_MAX_ENTRIES];
static int rtc_nentries;

fattn_status fattn_rtc_register(const char *variant, const int64_t *cfg, int n, int dtype, fattn_rtc_kernel *k,
                                int *index) {
    if (n > FATTN_RTC_FIELDS || strlen(variant) >= sizeof rtc_entries[0].variant)
        return FATTN_FAIL(FATTN_ERR_INVALID, "run-time kernel registry: config of %d fields for '%s'", n, variant);
    fattn_status st = FATTN_OK;
    pthread_mutex_lock(&rtc_lock);
    if (rtc_nentries >= RTC_MAX_ENTRIES) {
        st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "at most %d run-time compiled kernels per process", RTC_MAX_ENTRIES);
    } else {
        fattn_rtc_entry *e = &rtc_entries[rtc_nentries];
        memset(e, 0, sizeof *e);
        strcpy(e->variant, variant);
        memcpy(e->cfg, cfg, sizeof(int64_t) * (size_t)n);
        e->dtype = dtype;
        e->kernel = k;
        *index = rtc_nentries++;
    }
    pthread_mutex_unlock(&rtc_lock);
    return st;
}

const fattn_rtc_entry *fattn_rtc_entry_at(int i) {
    pthread_mutex_lock(&rtc_lock);
    const fattn_rtc_entry *e = i >= 0 && i < rtc_nentries ? &rtc_entries[i] : NULL;
    pthread_mutex_unlock(&rtc_lock);
    return e;
}
