/* gpu.c -- the GPU side in C: the variant table, device queries, and the dispatch step (plan, prepare the device,
 * workspace, launch).  Built with -DFATTN_WITH_CUDA when nvcc is present; otherwise every entry point reports that
 * CUDA support was not compiled in.  The CUDA runtime is linked statically: it loads the driver on first use, so
 * importing fattn on a machine without a GPU or driver works and the first GPU call returns a clear error. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kvcache.h"
#include "sinks.h"
#include "varlen_rows.h"
#include "tuned.h"
#include "variants.h"

/* The table.  Planners are plain C and always built (the tuner's keep() asks them even on a machine without
 * CUDA); launchers and prepare hooks exist only in CUDA builds. */
#ifdef FATTN_WITH_CUDA
#define LAUNCH(name) fattn_launch_##name
#define PREPARE(name) fattn_prepare_##name
#define LAUNCH_BWD(name) fattn_launch_bwd_##name
#define PREPARE_BWD(name) fattn_prepare_bwd_##name
#else
#define LAUNCH(name) NULL
#define PREPARE(name) NULL
#define LAUNCH_BWD(name) NULL
#define PREPARE_BWD(name) NULL
#endif
#define FATTN_VARIANT_ROW(name, family, file, summary, min_sm, max_sm, dtypes, fallback, prefer, bwd)           \
    {#name, #family, file, summary, min_sm, max_sm, dtypes, fallback, fattn_plan_##name, LAUNCH(name),           \
     PREPARE(name), fattn_configs_##name, fattn_check_config_##name, prefer, #bwd},
const fattn_variant fattn_gpu_variants[] = {FATTN_GPU_VARIANTS(FATTN_VARIANT_ROW){0}};
#undef FATTN_VARIANT_ROW
#define NVARIANTS ((int)(sizeof fattn_gpu_variants / sizeof fattn_gpu_variants[0]) - 1)

#define FATTN_BWD_VARIANT_ROW(name, family, file, summary, min_sm, max_sm, dtypes, fallback)                     \
    {#name, #family, file, summary, min_sm, max_sm, dtypes, fallback, fattn_plan_bwd_##name, LAUNCH_BWD(name),   \
     PREPARE_BWD(name)},
const fattn_bwd_variant fattn_gpu_bwd_variants[] = {FATTN_GPU_BWD_VARIANTS(FATTN_BWD_VARIANT_ROW){0}};
#undef FATTN_BWD_VARIANT_ROW
#define NBWD ((int)(sizeof fattn_gpu_bwd_variants / sizeof fattn_gpu_bwd_variants[0]) - 1)

const fattn_variant *fattn_find_variant(const char *name) {
    for (const fattn_variant *v = fattn_gpu_variants; v->name; v++)
        if (!strcmp(v->name, name)) return v;
    return NULL;
}

/* The backward variant called `name` (its own name, not a forward's). */
static const fattn_bwd_variant *bwd_variant_named(const char *name) {
    for (const fattn_bwd_variant *v = fattn_gpu_bwd_variants; name && v->name; v++)
        if (!strcmp(v->name, name)) return v;
    return NULL;
}

const fattn_bwd_variant *fattn_find_bwd_variant(const char *name) {
    const fattn_variant *f = fattn_find_variant(name);
    return f ? bwd_variant_named(f->bwd) : NULL;
}

#ifdef FATTN_WITH_CUDA
#include "cuda_check.h"

int fattn_gpu_compiled(void) { return 1; }

fattn_status fattn_gpu_device_count(int *count) {
    *count = 0;
    const cudaError_t e = cudaGetDeviceCount(count);
    if (e == cudaSuccess) return FATTN_OK;
    cudaGetLastError();
    if (e == cudaErrorNoDevice)
        return FATTN_FAIL(FATTN_ERR_CUDA, "no CUDA GPU found (the driver reports no device)");
    if (e == cudaErrorInsufficientDriver)
        return FATTN_FAIL(FATTN_ERR_CUDA, "no usable NVIDIA driver: this machine has no GPU driver, or one older than "
                                          "the CUDA %d.%d runtime fattn was built with",
                          CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    return FATTN_FAIL(FATTN_ERR_CUDA, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Makes `device` current; *prev is the device that was. */
static fattn_status enter_device(int device, int *prev) {
    *prev = -1;
    FATTN_CUDA_CHECK(cudaGetDevice(prev));
    if (*prev != device) FATTN_CUDA_CHECK(cudaSetDevice(device));
    return FATTN_OK;
}

/* After work on `device` that ended with st: clears any CUDA error it left (never pending for the caller's next
 * call) and makes `prev` current again; st, or the switch's failure. */
static fattn_status leave_device(int prev, int device, fattn_status st) {
    if (st) cudaGetLastError();
    if (prev != device) {
        const cudaError_t e = cudaSetDevice(prev);
        if (!st && e != cudaSuccess)
            st = FATTN_FAIL(FATTN_ERR_CUDA, "cudaSetDevice(%d): %s", prev, cudaGetErrorString(e));
    }
    return st;
}

/* ---- CUDA graph capture: on this stream, and in other threads ------------------------------------------------ */

/* 1 if the stream is being captured into a CUDA graph (or capture status cannot be had). */
static int capturing(void *stream) {
    enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing((cudaStream_t)stream, &cap) != cudaSuccess) {
        cudaGetLastError(); /* the legacy stream while another stream captures: treat as capturing */
        return 1;
    }
    return cap != cudaStreamCaptureStatusNone;
}

int fattn_gpu_stream_capturing(void *stream) { return capturing(stream); }

/* While another thread captures a CUDA graph in cudaStreamCaptureModeGlobal (torch.cuda.graph's default), CUDA
 * refuses this thread's cudaMalloc, cudaFree and cudaHostAlloc -- and invalidates that thread's capture.  The memory
 * allocated and freed here never belongs to a stream being captured (its callers check the stream first), so those
 * calls cannot reach that graph: they are made with this thread's mode set to relaxed (relax_capture_mode), and the
 * mode it had is put back after (restore_capture_mode).  -1: the mode could not be changed (nothing to restore). */
static int relax_capture_mode(void) {
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return (int)mode;
}

static void restore_capture_mode(int mode) {
    enum cudaStreamCaptureMode m = (enum cudaStreamCaptureMode)mode;
    if (mode >= 0 && cudaThreadExchangeStreamCaptureMode(&m) != cudaSuccess) cudaGetLastError();
}

/* Reads land in one page-locked buffer, kept and grown as calls need (a pageable destination makes each copy a
 * staged one); the lock keeps two threads' reads apart.  Where no page-locked memory can be had, the copies go
 * straight to the destinations. */
static pthread_mutex_t read_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *read_buf;
static size_t read_cap;

#define READ_ALIGN(n) (((n) + 15) & ~(size_t)15)

/* The page-locked buffer of at least `bytes` (read_lock held), or NULL. */
static unsigned char *read_buffer(size_t bytes) {
    if (bytes <= read_cap) return read_buf;
    size_t cap = read_cap ? read_cap : 4096;
    while (cap < bytes) cap *= 2;
    void *buf = NULL;
    if (cudaHostAlloc(&buf, cap, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    if (read_buf) cudaFreeHost(read_buf);
    read_buf = (unsigned char *)buf;
    read_cap = cap;
    return read_buf;
}

fattn_status fattn_gpu_read_many(int n, void *const *dst, const void *const *src, const size_t *bytes, int device,
                                 void *stream) {
    int prev;
    fattn_status st = enter_device(device, &prev);
    if (st) return st;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += READ_ALIGN(bytes[i]);
    pthread_mutex_lock(&read_lock);
    const int mode = relax_capture_mode(); /* the buffer's allocation, the copies and the wait: not captured */
    unsigned char *buf = read_buffer(total);
    cudaError_t e = cudaSuccess;
    size_t off = 0;
    for (int i = 0; i < n && e == cudaSuccess; off += READ_ALIGN(bytes[i]), i++)
        e = cudaMemcpyAsync(buf ? buf + off : dst[i], src[i], bytes[i], cudaMemcpyDeviceToHost, (cudaStream_t)stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)stream);
    off = 0;
    for (int i = 0; i < n && e == cudaSuccess && buf; off += READ_ALIGN(bytes[i]), i++)
        memcpy(dst[i], buf + off, bytes[i]);
    restore_capture_mode(mode);
    pthread_mutex_unlock(&read_lock);
    if (e != cudaSuccess)
        st = FATTN_FAIL(FATTN_ERR_CUDA, "reading %zu bytes from cuda:%d: %s", total, device, cudaGetErrorString(e));
    return leave_device(prev, device, st);
}

fattn_status fattn_gpu_append_kv(const attn_params *p, const fattn_append *a, int device, void *stream) {
    int prev;
    fattn_status st = enter_device(device, &prev);
    if (st) return st;
    return leave_device(prev, device, fattn_launch_append_kv(p, a, stream));
}

fattn_status fattn_gpu_zero_uncovered(const attn_bwd_params *p, int device, void *stream) {
    int prev;
    fattn_status st = enter_device(device, &prev);
    if (st) return st;
    return leave_device(prev, device, fattn_launch_zero_uncovered(p, stream));
}

fattn_status fattn_gpu_sinks(const fattn_sink_params *p, int backward, int device, void *stream) {
    int prev;
    fattn_status st = enter_device(device, &prev);
    if (st) return st;
    return leave_device(prev, device, fattn_launch_sinks(p, backward, stream));
}

/* ---- device queries: compute capability and multiprocessors, read once per device --------------------------- */

#define MAX_DEVICES 64
static fattn_device dev_cache[MAX_DEVICES];
static unsigned char prepared[MAX_DEVICES][NVARIANTS]; /* [device][variant]: its prepare hook ran there */
static unsigned char prepared_bwd[MAX_DEVICES][NBWD];
static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER;

fattn_status fattn_gpu_device(int device, fattn_device *dev, char *name, int name_len) {
    if (device < 0 || device >= MAX_DEVICES) return FATTN_FAIL(FATTN_ERR_INVALID, "device %d out of range", device);
    if (!dev_cache[device].sm || name) {
        int n = 0;
        fattn_status st = fattn_gpu_device_count(&n);
        if (st) return st;
        if (device >= n) return FATTN_FAIL(FATTN_ERR_INVALID, "cuda:%d does not exist (%d CUDA device%s)", device, n,
                                           n == 1 ? "" : "s");
        int major = 0, minor = 0, count = 0;
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        FATTN_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
        if (name && name_len > 0) {
            struct cudaDeviceProp prop;
            FATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
            snprintf(name, (size_t)name_len, "%s", prop.name);
        }
        const fattn_device d = {device, major * 10 + minor, count};
        dev_cache[device] = d;
    }
    *dev = dev_cache[device];
    return FATTN_OK;
}

/* ---- planning ------------------------------------------------------------------------------------------------ */

/* FATTN_OK if compute capabilities [min_sm, max_sm] (max 0: no limit) include dev's, else why not; `what` names the
 * kernel ("v2", "backward v2"). */
static fattn_status sm_in_range(const char *what, int min_sm, int max_sm, const fattn_device *dev) {
    if (dev->sm >= min_sm && (!max_sm || dev->sm <= max_sm)) return FATTN_OK;
    if (max_sm)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "%s needs compute capability %d.%d to %d.%d; cuda:%d has %d.%d", what,
                          min_sm / 10, min_sm % 10, max_sm / 10, max_sm % 10, dev->id, dev->sm / 10, dev->sm % 10);
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "%s needs compute capability %d.%d; cuda:%d has %d.%d", what, min_sm / 10,
                      min_sm % 10, dev->id, dev->sm / 10, dev->sm % 10);
}

static fattn_status runs_on(const fattn_variant *v, const fattn_device *dev) {
    return sm_in_range(v->name, v->min_sm, v->max_sm, dev);
}

/* A cleared plan on dev with the defaults every planner starts from. */
static void plan_start(fattn_plan *plan, const fattn_device *dev) {
    memset(plan, 0, sizeof *plan);
    plan->dev = *dev;
    plan->config = -1;
    plan->splits = 1;
    plan->head_group = 1;
}

static fattn_status plan_one(const fattn_variant *v, const attn_params *p, const fattn_device *dev,
                             const fattn_tuned *tuned, const fattn_overrides *ov, fattn_plan *plan) {
    plan_start(plan, dev);
    plan->variant = v;
    return v->plan(p, tuned, ov, plan);
}

fattn_status fattn_plan_gpu(const attn_params *p, const fattn_device *dev, const fattn_tuned *tuned, const char *forced,
                            const fattn_overrides *ov, fattn_plan *plan) {
    if (forced) {
        const fattn_variant *v = fattn_find_variant(forced);
        if (!v) return FATTN_FAIL(FATTN_ERR_INVALID, "unknown GPU variant '%s'", forced);
        fattn_status st = runs_on(v, dev);
        if (st) return st;
        st = plan_one(v, p, dev, tuned, ov, plan);
        if (st == FATTN_ERR_UNSUPPORTED && v->fallback) {
            const fattn_variant *f = fattn_find_variant(v->fallback);
            if (f && !runs_on(f, dev)) {
                fattn_overrides fo = *ov;
                fo.config = -1; /* the forced variant's config index means nothing to its fallback */
                st = plan_one(f, p, dev, tuned, &fo, plan);
            }
        }
        return st;
    }
    const fattn_variant *best = NULL;
    for (int i = NVARIANTS - 1; i >= 0 && !best; i--) {
        const fattn_variant *v = &fattn_gpu_variants[i];
        if (fattn_variant_runs_on(v, dev->sm) && (v->dtypes >> p->dtype & 1) && (!v->prefer || v->prefer(p)) &&
            plan_one(v, p, dev, tuned, ov, plan) == FATTN_OK)
            best = v;
    }
    if (!best) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "no GPU variant runs these arguments on cuda:%d", dev->id);
    return FATTN_OK;
}

/* ---- workspace: one per (device, stream) ------------------------------------------------------------------- */

/* Grown when a call needs more and never shared between streams (so calls on different streams cannot race on it);
 * allocated on the first call that needs one, not per call.  Under CUDA graph capture nothing is allocated: a
 * captured graph must not hold a buffer a later call might free.  Beside it, the stream's counters (FATTN_COUNTERS
 * words, plan.h: zeroed on the stream when allocated; a kernel that counts on them leaves them zero).  The table
 * holds WORKSPACES streams; a program that uses more (or creates and drops streams) has its least recently used
 * entry's memory freed to make room.  The Python entry points hold the GIL from taking a buffer to launching on it,
 * so no other call frees it in between.  Allocations and frees here may happen while another thread captures a
 * graph (relax_capture_mode). */
typedef struct {
    int device;
    unsigned long long stream; /* cudaStreamGetId's: never reused, unlike a handle (a stream destroyed while its work
                                * still runs may hand its handle to the next stream created) */
    void *buf;
    size_t bytes;
    unsigned *counters;
    unsigned long long used; /* ws_tick at its last use: the entry freed first is the one with the smallest */
} workspace;
#define WORKSPACES 32
static workspace ws_table[WORKSPACES];
static int ws_count;
static unsigned long long ws_tick;

/* Frees an entry's memory on its own device and clears it.  cudaFree synchronises the device, so no queued kernel
 * still uses the memory; never reached under capture (workspace_entry's callers return first). */
static void workspace_release(workspace *w) {
    if (w->buf || w->counters) {
        int cur = w->device;
        cudaGetDevice(&cur);
        if (cur != w->device) cudaSetDevice(w->device);
        const int mode = relax_capture_mode();
        if (w->buf) cudaFree(w->buf);
        if (w->counters) cudaFree(w->counters);
        restore_capture_mode(mode);
        if (cur != w->device) cudaSetDevice(cur);
        cudaGetLastError(); /* a failed free leaves nothing pending */
    }
    memset(w, 0, sizeof *w);
}

/* The entry used longest ago. */
static workspace *workspace_least_recent(void) {
    workspace *w = &ws_table[0];
    for (int i = 1; i < ws_count; i++)
        if (ws_table[i].used < w->used) w = &ws_table[i];
    return w;
}

/* (device, stream)'s entry, made on first use; when the table is full, made in place of the least recently used
 * entry, whose memory is freed (a program cycling through more than WORKSPACES streams pays a device
 * synchronisation per new entry, and stays correct).  NULL when the stream has no id (not a valid stream).  Call
 * with dev_lock held. */
static workspace *workspace_entry(int device, void *handle) {
    unsigned long long stream = 0;
    if (cudaStreamGetId((cudaStream_t)handle, &stream) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    for (int i = 0; i < ws_count; i++)
        if (ws_table[i].device == device && ws_table[i].stream == stream) {
            ws_table[i].used = ++ws_tick;
            return &ws_table[i];
        }
    workspace *w = ws_count < WORKSPACES ? &ws_table[ws_count++] : workspace_least_recent();
    workspace_release(w);
    w->device = device;
    w->stream = stream;
    w->used = ++ws_tick;
    return w;
}

/* The counters of (device, stream), or NULL when none can be had without risk (capture, out of memory, not a
 * stream). */
static unsigned *counters_get(int device, void *stream) {
    if (capturing(stream)) return NULL;
    pthread_mutex_lock(&dev_lock);
    workspace *w = workspace_entry(device, stream);
    if (w && !w->counters) {
        void *c = NULL;
        const int mode = relax_capture_mode();
        if (cudaMalloc(&c, FATTN_COUNTERS * sizeof(unsigned)) != cudaSuccess) {
            cudaGetLastError();
        } else if (cudaMemsetAsync(c, 0, FATTN_COUNTERS * sizeof(unsigned), (cudaStream_t)stream) != cudaSuccess) {
            cudaGetLastError();
            cudaFree(c);
        } else {
            w->counters = (unsigned *)c;
        }
        restore_capture_mode(mode);
    }
    unsigned *out = w ? w->counters : NULL;
    pthread_mutex_unlock(&dev_lock);
    return out;
}

/* A workspace of >= bytes for (device, stream), or NULL when none can be had without risk (capture, out of
 * memory, not a stream). */
static void *workspace_get(int device, void *stream, size_t bytes) {
    if (capturing(stream)) return NULL;
    void *out = NULL;
    pthread_mutex_lock(&dev_lock);
    workspace *w = workspace_entry(device, stream);
    if (w && w->bytes < bytes) {
        const size_t grow = bytes > 2 * w->bytes ? bytes : 2 * w->bytes;
        void *nb = NULL;
        const int mode = relax_capture_mode();
        if (cudaMalloc(&nb, grow) != cudaSuccess) {
            cudaGetLastError();
        } else {
            if (w->buf) cudaFree(w->buf); /* synchronises the device: no queued kernel still uses the old one */
            w->buf = nb;
            w->bytes = grow;
        }
        restore_capture_mode(mode);
    }
    if (w && w->bytes >= bytes) out = w->buf;
    pthread_mutex_unlock(&dev_lock);
    return out;
}

/* ---- running a plan -------------------------------------------------------------------------------------------- */

static fattn_status prepare_flag(unsigned char *flag, fattn_prepare_fn prepare, int device) {
    fattn_status st = FATTN_OK;
    if (*flag) return FATTN_OK; /* set once, under the lock, never cleared */
    pthread_mutex_lock(&dev_lock);
    if (!*flag && !(st = prepare(device))) *flag = 1;
    pthread_mutex_unlock(&dev_lock);
    return st;
}

static fattn_status prepare_once(const fattn_plan *plan) {
    const int d = plan->dev.id;
    if (plan->bwd) return prepare_flag(&prepared_bwd[d][plan->bwd - fattn_gpu_bwd_variants], plan->bwd->prepare, d);
    return prepare_flag(&prepared[d][plan->variant - fattn_gpu_variants], plan->variant->prepare, d);
}

static fattn_status ready_on_device(const attn_params *p, const fattn_tuned *tuned, const char *forced,
                                    const fattn_overrides *ov, fattn_plan *plan, void *stream) {
    fattn_status st = prepare_once(plan);
    if (st) return st;
    if (plan->workspace_bytes) {
        plan->workspace = workspace_get(plan->dev.id, stream, plan->workspace_bytes);
        if (!plan->workspace) { /* capture, or no memory: the same call without key splits needs none */
            fattn_overrides unsplit = *ov;
            unsplit.splits = 1;
            const fattn_device dev = plan->dev; /* planning starts from a cleared plan */
            if ((st = fattn_plan_gpu(p, &dev, tuned, forced ? forced : plan->variant->name, &unsplit, plan)))
                return st;
            if (plan->workspace_bytes) return FATTN_FAIL(FATTN_ERR_NOMEM, "no workspace for %s", plan->variant->name);
            if ((st = prepare_once(plan))) return st;
        }
    }
    if (plan->use_counters) plan->counters = counters_get(plan->dev.id, stream);
    return FATTN_OK;
}

fattn_status fattn_ready_gpu(const attn_params *p, const fattn_tuned *tuned, const char *forced,
                             const fattn_overrides *ov, fattn_plan *plan, void *stream) {
    int prev;
    fattn_status st = enter_device(plan->dev.id, &prev);
    if (st) return st;
    return leave_device(prev, plan->dev.id, ready_on_device(p, tuned, forced, ov, plan, stream));
}

fattn_status fattn_launch_gpu(const attn_params *p, const fattn_plan *plan, void *stream) {
    int prev;
    fattn_status st = enter_device(plan->dev.id, &prev);
    if (st) return st;
    return leave_device(prev, plan->dev.id, plan->variant->launch(p, plan, stream));
}

/* ---- the backward ------------------------------------------------------------------------------------------ */

static fattn_status plan_bwd_one(const fattn_bwd_variant *v, const attn_bwd_params *p, const fattn_device *dev,
                                 const fattn_tuned *tuned, const fattn_overrides *ov, fattn_plan *plan) {
    plan_start(plan, dev);
    plan->bwd = v;
    char what[64];
    snprintf(what, sizeof what, "backward %s", v->name);
    fattn_status st = sm_in_range(what, v->min_sm, v->max_sm, dev);
    if (!st && !(v->dtypes >> p->fwd.dtype & 1))
        st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "backward %s does not take this dtype", v->name);
    return st ? st : v->plan(p, tuned, ov, plan);
}

fattn_status fattn_plan_gpu_bwd(const attn_bwd_params *p, const fattn_device *dev, const fattn_tuned *tuned,
                                const char *forced, const fattn_overrides *ov, fattn_plan *plan) {
    if (forced) {
        const fattn_bwd_variant *v = fattn_find_bwd_variant(forced);
        if (!v) return FATTN_FAIL(FATTN_ERR_INVALID, "unknown GPU variant '%s'", forced);
        fattn_status st = plan_bwd_one(v, p, dev, tuned, ov, plan);
        const fattn_bwd_variant *f = st == FATTN_ERR_UNSUPPORTED ? bwd_variant_named(v->fallback) : NULL;
        if (f) {
            fattn_overrides fo = *ov;
            fo.config = -1; /* the forced variant's config index means nothing to its fallback */
            st = plan_bwd_one(f, p, dev, tuned, &fo, plan);
        }
        return st;
    }
    for (int i = NBWD - 1; i >= 0; i--)
        if (plan_bwd_one(&fattn_gpu_bwd_variants[i], p, dev, tuned, ov, plan) == FATTN_OK) return FATTN_OK;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "no GPU backward variant runs these arguments on cuda:%d", dev->id);
}

static fattn_status run_bwd_on_device(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    fattn_status st = prepare_once(plan);
    if (st) return st;
    attn_bwd_params q = *p;
    q.ws_rows = fattn_bwd_ws_rows(p->fwd.sq);
    q.ws_cols = fattn_head_dim_bucket(p->fwd.d);
    if (!q.dq_accum) {
        float *ws = workspace_get(plan->dev.id, stream, plan->workspace_bytes);
        if (!ws)
            return FATTN_FAIL(FATTN_ERR_NOMEM, "no workspace for the backward (%zu bytes): under CUDA graph capture, or "
                              "out of memory; pass one (fattn.attention_backward does)", plan->workspace_bytes);
        fattn_bwd_workspace_set(&q, ws);
    }
    st = plan->bwd->launch(&q, plan, stream);
    if (!st && q.dsinks && plan->sinks_fused) st = fattn_launch_bwd_dsinks(&q, stream);
    return st;
}

fattn_status fattn_run_gpu_bwd(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    int prev;
    fattn_status st = enter_device(plan->dev.id, &prev);
    if (st) return st;
    return leave_device(prev, plan->dev.id, run_bwd_on_device(p, plan, stream));
}

#else /* built without CUDA */

int fattn_gpu_compiled(void) { return 0; }
int fattn_gpu_stream_capturing(void *stream) {
    (void)stream;
    return 0;
}

static fattn_status not_built(void) {
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "fattn was built without CUDA support (nvcc was not found at build time)");
}
fattn_status fattn_gpu_device_count(int *count) {
    *count = 0;
    return not_built();
}
fattn_status fattn_gpu_device(int device, fattn_device *dev, char *name, int name_len) {
    (void)device; (void)dev; (void)name; (void)name_len;
    return not_built();
}
fattn_status fattn_plan_gpu(const attn_params *p, const fattn_device *dev, const fattn_tuned *tuned, const char *forced,
                            const fattn_overrides *ov, fattn_plan *plan) {
    (void)p; (void)dev; (void)tuned; (void)forced; (void)ov; (void)plan;
    return not_built();
}
fattn_status fattn_ready_gpu(const attn_params *p, const fattn_tuned *tuned, const char *forced,
                             const fattn_overrides *ov, fattn_plan *plan, void *stream) {
    (void)p; (void)tuned; (void)forced; (void)ov; (void)plan; (void)stream;
    return not_built();
}
fattn_status fattn_launch_gpu(const attn_params *p, const fattn_plan *plan, void *stream) {
    (void)p; (void)plan; (void)stream;
    return not_built();
}

fattn_status fattn_plan_gpu_bwd(const attn_bwd_params *p, const fattn_device *dev, const fattn_tuned *tuned,
                                const char *forced, const fattn_overrides *ov, fattn_plan *plan) {
    (void)p; (void)dev; (void)tuned; (void)forced; (void)ov; (void)plan;
    return not_built();
}
fattn_status fattn_gpu_read_many(int n, void *const *dst, const void *const *src, const size_t *bytes, int device,
                                 void *stream) {
    (void)n; (void)dst; (void)src; (void)bytes; (void)device; (void)stream;
    return not_built();
}
fattn_status fattn_run_gpu_bwd(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    (void)p; (void)plan; (void)stream;
    return not_built();
}
fattn_status fattn_gpu_append_kv(const attn_params *p, const fattn_append *a, int device, void *stream) {
    (void)p; (void)a; (void)device; (void)stream;
    return not_built();
}
fattn_status fattn_gpu_zero_uncovered(const attn_bwd_params *p, int device, void *stream) {
    (void)p; (void)device; (void)stream;
    return not_built();
}
fattn_status fattn_gpu_sinks(const fattn_sink_params *p, int backward, int device, void *stream) {
    (void)p; (void)backward; (void)device; (void)stream;
    return not_built();
}
#endif
