/*
 * A fake of libcudla + libnvscibuf + libnvscisync for dlad's tests: the same symbols with the
 * same C ABI (reference/cudla.md §4.2-4.6) and the documented semantics, in one shared object
 * built by the test suite with plain gcc (libc + pthreads, no CUDA, no NvSci headers).
 *
 * What it models:
 *   - device handles in standalone mode, one module per handle, loadables in a format of the
 *     fake's own ("FAKECDLA", version, core, counts, then raw 168-byte tensor descriptors);
 *   - NvSciBuf raw buffers (aligned host memory) imported into a handle;
 *   - NvSciSync objects as counters: a syncpoint-like object's value only grows; a fence is
 *     (object, id, value) and is reached when the object's value >= value; CPU-signalled objects
 *     advance by one per NvSciSyncObjSignal, DLA-signalled ones by one per task;
 *   - one execution thread per handle: tasks run in submission order, wait for their pre-fences,
 *     run (a deterministic byte computation or a callback into the test), signal their EOF
 *     fence; a task timeout (cudlaSetTaskTimeoutInMs, default 30 s) ends a stuck task with
 *     cudlaErrorDlaErrEngineTimeout; cudlaGetLastError is sticky until read and a pending error
 *     is also returned by cudlaSubmitTask, as cuDLA may;
 *   - error injection per call name (fake_fail_next) and per task (fake_task_fault);
 *   - a log of every call with its arguments, and counts of live objects (fake_live).
 *
 * With -DFAKE_OLD_RELEASE the symbols that only newer releases have are left out
 * (cudlaGetVersion, cudlaDeviceGetCount, cudlaSetTaskTimeoutInMs, NvSciSyncFenceExtractFence,
 * NvSciSyncFenceUpdateFence), so the backend's symbol probing can be tested.
 *
 * The fake's own choices where the documentation is silent are marked "fake:".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ cuDLA types (§4.3, §4.4) */
typedef int cudlaStatus;
enum {
    cudlaSuccess = 0, cudlaErrorInvalidParam = 1, cudlaErrorOutOfResources = 2,
    cudlaErrorCreationFailed = 3, cudlaErrorInvalidAddress = 4, cudlaErrorInvalidDevice = 8,
    cudlaErrorInvalidAttribute = 9, cudlaErrorIncompatibleDlaSWVersion = 10,
    cudlaErrorMemoryRegistered = 11, cudlaErrorInvalidModule = 12,
    cudlaErrorUnsupportedOperation = 13, cudlaErrorNvSci = 14,
    cudlaErrorDlaErrInvalidPreAction = 0x40000002, cudlaErrorDlaErrProcessorBusy = 0x40000004,
    cudlaErrorDlaErrEngineTimeout = 0x40000006,
};
enum { CUDLA_CUDA_DLA = 0, CUDLA_STANDALONE = 1 };
enum { CUDLA_NVSCISYNC_ATTR_WAIT = 1, CUDLA_NVSCISYNC_ATTR_SIGNAL = 2 };
enum { CUDLA_NVSCISYNC_FENCE = 1, CUDLA_NVSCISYNC_FENCE_SOF = 2 };
enum { CUDLA_SUBMIT_NOOP = 1, CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE = 2, CUDLA_SUBMIT_DIAGNOSTICS_TASK = 4 };
enum {
    CUDLA_NUM_INPUT_TENSORS = 0, CUDLA_NUM_OUTPUT_TENSORS = 1, CUDLA_INPUT_TENSOR_DESCRIPTORS = 2,
    CUDLA_OUTPUT_TENSOR_DESCRIPTORS = 3, CUDLA_NUM_OUTPUT_TASK_STATISTICS = 4,
};
enum { CUDLA_UNIFIED_ADDRESSING = 0, CUDLA_DEVICE_VERSION = 1 };

typedef struct {
    char name[80 + 1];
    uint64_t size, n, c, h, w;
    uint8_t dataFormat, dataType, dataCategory, pixelFormat, pixelMapping;
    uint32_t stride[8];
} cudlaModuleTensorDescriptor;
_Static_assert(sizeof(cudlaModuleTensorDescriptor) == 168, "descriptor size");
_Static_assert(offsetof(cudlaModuleTensorDescriptor, size) == 88, "descriptor.size");
_Static_assert(offsetof(cudlaModuleTensorDescriptor, stride) == 136, "descriptor.stride");

typedef union {
    uint32_t numInputTensors;
    uint32_t numOutputTensors;
    cudlaModuleTensorDescriptor *inputTensorDesc;
    cudlaModuleTensorDescriptor *outputTensorDesc;
} cudlaModuleAttribute;
typedef union { uint8_t unifiedAddressingSupported; uint32_t deviceVersion; } cudlaDevAttribute;
typedef struct { const void *extBufObject; unsigned long long size; } cudlaExternalMemoryHandleDesc;
typedef struct { const void *extSyncObject; } cudlaExternalSemaphoreHandleDesc;
typedef struct { void *fence; int type; } CudlaFence;
typedef struct { const CudlaFence *preFences; uint32_t numEvents; } cudlaWaitEvents;
typedef struct { uint64_t *const *devPtrs; CudlaFence *eofFences; uint32_t numEvents; } cudlaSignalEvents;
typedef struct {
    void *moduleHandle;
    uint64_t *const *outputTensor;
    uint32_t numOutputTensors;
    uint32_t numInputTensors;
    const uint64_t *const *inputTensor;
    const cudlaWaitEvents *waitEvents;
    cudlaSignalEvents *signalEvents;
} cudlaTask;
_Static_assert(sizeof(cudlaTask) == 48, "cudlaTask size");
_Static_assert(offsetof(cudlaTask, inputTensor) == 24, "cudlaTask.inputTensor");

/* ------------------------------------------------------------------ NvSci types (§4.6) */
typedef int NvSciError;
enum {
    NvSciError_Success = 0, NvSciError_InsufficientMemory = 0x30, NvSciError_BadParameter = 0x100,
    NvSciError_Timeout = 0x200,
};
typedef struct { uint32_t key; const void *value; size_t len; } KeyValuePair; /* both Buf and Sync */
typedef struct { uint64_t payload[6]; } NvSciSyncFence;
enum { BufType_RawBuffer = 1 };
enum {
    BufKey_Types = 1, BufKey_NeedCpuAccess = 2, BufKey_RequiredPerm = 3, BufKey_GpuId = 5,
    BufKey_RawSize = 0x10000, BufKey_RawAlign = 0x10001,
};
enum {
    SyncKey_NeedCpuAccess = 1, SyncKey_RequiredPerm = 2, SyncKey_WaiterRequireTimestamps = 5,
    SyncKey_RequireDeterministicFences = 6,
};
enum { Perm_WaitOnly = 1, Perm_SignalOnly = 2, Perm_WaitSignal = 3 };

/* ------------------------------------------------------------------ state */
enum { K_DEVICE, K_MODULE, K_MEM_REG, K_SEM_REG, K_BUF_MODULE, K_BUF_ATTR_LIST, K_BUF_OBJ,
       K_SYNC_MODULE, K_SYNC_ATTR_LIST, K_SYNC_OBJ, K_CPU_WAIT_CTX, K_FENCE, K_COUNT };
static const char *const KIND_NAMES[K_COUNT] = {
    "device", "module", "mem_reg", "sem_reg", "buf_module", "buf_attr_list", "buf_obj",
    "sync_module", "sync_attr_list", "sync_obj", "cpu_wait_ctx", "fence",
};
enum { MAGIC_DEV = 0x44455631, MAGIC_MOD, MAGIC_REG, MAGIC_BUFMOD, MAGIC_BUFLIST, MAGIC_BUFOBJ,
       MAGIC_SYNCMOD, MAGIC_SYNCLIST, MAGIC_SYNCOBJ, MAGIC_CPUCTX };
#define FENCE_MAGIC 0xFE11CEFE11CEULL

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* broadcast on every counter or queue change (CLOCK_MONOTONIC) */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static long g_live[K_COUNT];
static uint64_t g_next_sync_id = 1;

/* options (fake_set_option) */
static int64_t opt_devices = 2, opt_version = 1004000, opt_dla_version = 0x20000;
static int64_t opt_deterministic_only = 0, opt_misalign = 0, opt_task_delay_us = 0;
static int64_t opt_hold_tasks = 0; /* while set, no task ends (a test orders submissions first) */

typedef int (*fake_task_fn)(int dev, uint32_t n_in, void *const *ins, const uint64_t *in_sizes,
                            uint32_t n_out, void *const *outs, const uint64_t *out_sizes);
static fake_task_fn g_callback;

static void init_once(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cv, &attr);
}
#define LOCK() do { pthread_once(&g_once, init_once); pthread_mutex_lock(&g_mu); } while (0)
#define UNLOCK() pthread_mutex_unlock(&g_mu)

/* ---- the call log */
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
static char **g_log;
static size_t g_log_n, g_log_cap;

static void logf_(const char *fmt, ...) {
    char *line = NULL;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&line, fmt, ap) < 0) line = NULL;
    va_end(ap);
    if (!line) return;
    pthread_mutex_lock(&g_log_mu);
    if (g_log_n == g_log_cap) {
        size_t cap = g_log_cap ? 2 * g_log_cap : 256;
        char **grown = realloc(g_log, cap * sizeof *grown);
        if (!grown) { pthread_mutex_unlock(&g_log_mu); free(line); return; }
        g_log = grown;
        g_log_cap = cap;
    }
    g_log[g_log_n++] = line;
    pthread_mutex_unlock(&g_log_mu);
}

/* ---- injected call failures */
typedef struct { char name[64]; int status; int count; } Injection;
static Injection g_inject[32];

static int injected(const char *name) {
    int status = 0;
    LOCK();
    for (size_t i = 0; i < sizeof g_inject / sizeof *g_inject; i++) {
        if (g_inject[i].count > 0 && strcmp(g_inject[i].name, name) == 0) {
            status = g_inject[i].status;
            g_inject[i].count--;
            break;
        }
    }
    UNLOCK();
    if (status) logf_("%s -> injected %#x", name, status);
    return status;
}
#define INJECT(name) do { int s_ = injected(name); if (s_) return s_; } while (0)

/* ---- objects */
typedef struct { uint32_t magic; } BufModule;
typedef struct {
    uint32_t magic;
    bool reconciled, has_types, raw, need_cpu, has_size;
    uint32_t perm;
    uint64_t size, align;
} BufList;
typedef struct { uint32_t magic; uint64_t size; void *mem; void *ptr; bool cpu; } BufObj;
typedef struct { uint32_t magic; } SyncModule;
typedef struct {
    uint32_t magic;
    bool reconciled, need_cpu, deterministic, cudla_filled;
    uint64_t perm; /* what the list's owner does: 1 wait, 2 signal, 3 both */
    uint32_t cudla_flags;
    /* reconciled lists only */
    int signaler; /* 1 CPU, 2 DLA */
    bool cpu_waits, dla_waits, dla_signals;
} SyncList;
typedef struct {
    uint32_t magic;
    uint64_t id, value, next; /* value: reached; next: highest value promised to a task */
    int signaler;
    bool cpu_waits, dla_waits, dla_signals, deterministic;
} SyncObj;
typedef struct { uint32_t magic; } CpuCtx;

typedef struct Device Device;
typedef struct {
    uint32_t magic;
    Device *dev;
    uint32_t n_in, n_out;
    cudlaModuleTensorDescriptor *desc; /* inputs then outputs */
} Module;
typedef struct { uint32_t magic; Device *dev; int kind; BufObj *buf; SyncObj *sync; uint64_t size; } Reg;

enum { FAULT_NONE, FAULT_ERROR, FAULT_HANG };
typedef struct Task {
    struct Task *next;
    uint64_t id;
    Module *module;
    uint32_t n_in, n_out, n_wait, n_signal;
    Reg *ins[64], *outs[64];
    NvSciSyncFence waits[29];
    SyncObj *signal_obj[1];
    uint64_t signal_value[1];
    int fault, fault_status;
    /* kept-alive check: what the caller passed, and a copy of it */
    const void *caller_wait; size_t caller_wait_len; unsigned char wait_copy[29 * sizeof(CudlaFence)];
    const void *caller_in; const void *caller_out;
    unsigned char in_copy[64 * sizeof(void *)], out_copy[64 * sizeof(void *)];
} Task;

struct Device {
    uint32_t magic;
    uint64_t index;
    Module *module;
    cudlaStatus last_error;
    uint32_t timeout_ms;
    Task *head, *tail;
    uint64_t queued, tasks;
    bool stopping;
    int in_submit;
    pthread_t thread;
    int fault_kind, fault_status, fault_count;
};
static Device *g_devices[64];

static bool valid(const void *p, uint32_t magic) { return p && *(const uint32_t *)p == magic; }
static void *new_obj(size_t size, uint32_t magic, int kind) {
    uint32_t *p = calloc(1, size);
    if (!p) return NULL;
    *p = magic;
    g_live[kind]++;
    return p;
}
static void free_obj(void *p, int kind) {
    *(uint32_t *)p = 0xDEADDEAD;
    g_live[kind]--;
    free(p);
}

/* ------------------------------------------------------------------ test controls (fake_*) */
API long fake_live(const char *kind) {
    long n = -1;
    LOCK();
    for (int i = 0; i < K_COUNT; i++)
        if (strcmp(KIND_NAMES[i], kind) == 0) n = g_live[i];
    UNLOCK();
    return n;
}
API size_t fake_log_count(void) {
    pthread_mutex_lock(&g_log_mu);
    size_t n = g_log_n;
    pthread_mutex_unlock(&g_log_mu);
    return n;
}
API const char *fake_log_entry(size_t i) {
    pthread_mutex_lock(&g_log_mu);
    const char *s = i < g_log_n ? g_log[i] : NULL;
    pthread_mutex_unlock(&g_log_mu);
    return s;
}
API void fake_log_clear(void) {
    pthread_mutex_lock(&g_log_mu);
    for (size_t i = 0; i < g_log_n; i++) free(g_log[i]);
    g_log_n = 0;
    pthread_mutex_unlock(&g_log_mu);
}
API int fake_set_option(const char *name, int64_t value) {
    int ok = 1;
    LOCK();
    if (strcmp(name, "devices") == 0) opt_devices = value;
    else if (strcmp(name, "version") == 0) opt_version = value;
    else if (strcmp(name, "dla_version") == 0) opt_dla_version = value;
    else if (strcmp(name, "deterministic_only") == 0) opt_deterministic_only = value;
    else if (strcmp(name, "misalign") == 0) opt_misalign = value;
    else if (strcmp(name, "task_delay_us") == 0) opt_task_delay_us = value;
    else if (strcmp(name, "hold_tasks") == 0) opt_hold_tasks = value;
    else ok = 0;
    pthread_cond_broadcast(&g_cv);
    UNLOCK();
    return ok;
}
API void fake_fail_next(const char *call, int status, int count) {
    LOCK();
    for (size_t i = 0; i < sizeof g_inject / sizeof *g_inject; i++) {
        if (g_inject[i].count <= 0) {
            snprintf(g_inject[i].name, sizeof g_inject[i].name, "%s", call);
            g_inject[i].status = status;
            g_inject[i].count = count;
            break;
        }
    }
    UNLOCK();
}
/* The next `count` tasks submitted to handles of DLA `index` fail with `status` (kind 1) or
 * hang until their timeout (kind 2). */
API void fake_task_fault(uint64_t index, int kind, int status, int count) {
    LOCK();
    for (size_t i = 0; i < 64; i++) {
        Device *d = g_devices[i];
        if (d && d->index == index) { d->fault_kind = kind; d->fault_status = status; d->fault_count = count; }
    }
    UNLOCK();
}
API void fake_set_task_callback(fake_task_fn fn) { LOCK(); g_callback = fn; UNLOCK(); }
API void fake_reset(void) {
    LOCK();
    memset(g_inject, 0, sizeof g_inject);
    opt_devices = 2; opt_version = 1004000; opt_dla_version = 0x20000;
    opt_deterministic_only = 0; opt_misalign = 0; opt_task_delay_us = 0; opt_hold_tasks = 0;
    g_callback = NULL;
    UNLOCK();
    fake_log_clear();
}

/* ------------------------------------------------------------------ helpers */
static void deadline_after_ms(struct timespec *ts, uint64_t ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += (time_t)(ms / 1000);
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}
static bool fence_set(const NvSciSyncFence *f) { return f->payload[3] == FENCE_MAGIC; }
static SyncObj *fence_obj(const NvSciSyncFence *f) { return (SyncObj *)(uintptr_t)f->payload[0]; }
static void fence_fill(NvSciSyncFence *f, SyncObj *o, uint64_t value) { /* caller holds g_mu */
    if (fence_set(f)) g_live[K_FENCE]--;
    memset(f, 0, sizeof *f);
    f->payload[0] = (uint64_t)(uintptr_t)o;
    f->payload[1] = o->id;
    f->payload[2] = value;
    f->payload[3] = FENCE_MAGIC;
    g_live[K_FENCE]++;
}
static bool fence_reached(const NvSciSyncFence *f) {
    if (!fence_set(f)) return true;
    SyncObj *o = fence_obj(f);
    return !valid(o, MAGIC_SYNCOBJ) || o->value >= f->payload[2];
}

/* ------------------------------------------------------------------ cuDLA */
#ifndef FAKE_OLD_RELEASE
API cudlaStatus cudlaGetVersion(uint64_t *const version) {
    INJECT("cudlaGetVersion");
    logf_("cudlaGetVersion");
    if (!version) return cudlaErrorInvalidParam;
    *version = (uint64_t)opt_version;
    return cudlaSuccess;
}
API cudlaStatus cudlaDeviceGetCount(uint64_t *const pNumDevices) {
    INJECT("cudlaDeviceGetCount");
    logf_("cudlaDeviceGetCount");
    if (!pNumDevices) return cudlaErrorInvalidParam;
    *pNumDevices = (uint64_t)opt_devices;
    return cudlaSuccess;
}
#endif

static void *device_thread(void *arg);

API cudlaStatus cudlaCreateDevice(uint64_t const device, void **const devHandle, uint32_t const flags) {
    INJECT("cudlaCreateDevice");
    logf_("cudlaCreateDevice device=%" PRIu64 " flags=%u", device, flags);
    if (!devHandle) return cudlaErrorInvalidParam;
    if (flags == CUDLA_CUDA_DLA) return cudlaErrorUnsupportedOperation; /* fake: no CUDA here */
    if (flags != CUDLA_STANDALONE) return cudlaErrorInvalidParam;
    LOCK();
    if ((int64_t)device >= opt_devices) { UNLOCK(); return cudlaErrorInvalidDevice; }
    size_t slot = 64;
    int same = 0;
    for (size_t i = 0; i < 64; i++) {
        if (!g_devices[i]) { if (slot == 64) slot = i; }
        else if (g_devices[i]->index == device) same++;
    }
    if (slot == 64 || same >= 16) { UNLOCK(); return cudlaErrorOutOfResources; } /* 16 per DLA */
    Device *d = new_obj(sizeof *d, MAGIC_DEV, K_DEVICE);
    if (!d) { UNLOCK(); return cudlaErrorOutOfResources; }
    d->index = device;
    d->timeout_ms = 30000;
    if (pthread_create(&d->thread, NULL, device_thread, d) != 0) {
        free_obj(d, K_DEVICE);
        UNLOCK();
        return cudlaErrorCreationFailed;
    }
    g_devices[slot] = d;
    UNLOCK();
    *devHandle = d;
    return cudlaSuccess;
}

API cudlaStatus cudlaDestroyDevice(void *const devHandle) {
    INJECT("cudlaDestroyDevice");
    logf_("cudlaDestroyDevice dev=%p", devHandle);
    LOCK();
    Device *d = devHandle;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (d->queued) { UNLOCK(); return cudlaErrorDlaErrProcessorBusy; } /* fake: tasks still running */
    d->stopping = true;
    pthread_cond_broadcast(&g_cv);
    UNLOCK();
    pthread_join(d->thread, NULL);
    LOCK();
    for (size_t i = 0; i < 64; i++)
        if (g_devices[i] == d) g_devices[i] = NULL;
    /* fake: a module or registrations left behind stay counted as live: they are leaks. */
    free_obj(d, K_DEVICE);
    UNLOCK();
    return cudlaSuccess;
}

API cudlaStatus cudlaDeviceGetAttribute(void *const devHandle, int const attrib, cudlaDevAttribute *const out) {
    INJECT("cudlaDeviceGetAttribute");
    logf_("cudlaDeviceGetAttribute dev=%p attrib=%d", devHandle, attrib);
    if (!valid(devHandle, MAGIC_DEV)) return cudlaErrorInvalidDevice;
    if (!out) return cudlaErrorInvalidParam;
    if (attrib == CUDLA_UNIFIED_ADDRESSING) out->unifiedAddressingSupported = 0;
    else if (attrib == CUDLA_DEVICE_VERSION) out->deviceVersion = (uint32_t)opt_dla_version;
    else return cudlaErrorInvalidAttribute;
    return cudlaSuccess;
}

#ifndef FAKE_OLD_RELEASE
API cudlaStatus cudlaSetTaskTimeoutInMs(void *const devHandle, uint32_t const timeout) {
    INJECT("cudlaSetTaskTimeoutInMs");
    logf_("cudlaSetTaskTimeoutInMs dev=%p timeout=%u", devHandle, timeout);
    LOCK();
    Device *d = devHandle;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (timeout == 0 || timeout > 1000000) { UNLOCK(); return cudlaErrorInvalidParam; }
    d->timeout_ms = timeout;
    UNLOCK();
    return cudlaSuccess;
}
#endif

API cudlaStatus cudlaGetLastError(void *const devHandle) {
    logf_("cudlaGetLastError dev=%p", devHandle);
    LOCK();
    Device *d = devHandle;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    cudlaStatus s = d->last_error;
    d->last_error = cudlaSuccess;
    UNLOCK();
    return s;
}

#define LOADABLE_MAGIC "FAKECDLA"
API cudlaStatus cudlaModuleLoadFromMemory(void *const devHandle, const uint8_t *const pModule,
                                          size_t const moduleSize, void **const hModule, uint32_t const flags) {
    INJECT("cudlaModuleLoadFromMemory");
    logf_("cudlaModuleLoadFromMemory dev=%p size=%zu flags=%u", devHandle, moduleSize, flags);
    if (!pModule || !hModule || flags > 1) return cudlaErrorInvalidParam;
    LOCK();
    Device *d = devHandle;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (d->module) { UNLOCK(); return cudlaErrorUnsupportedOperation; } /* one per handle */
    uint32_t hdr[4];
    if (moduleSize < 8 + sizeof hdr || memcmp(pModule, LOADABLE_MAGIC, 8) != 0) {
        UNLOCK();
        return cudlaErrorInvalidModule;
    }
    memcpy(hdr, pModule + 8, sizeof hdr);
    if (hdr[0] != 1) { UNLOCK(); return cudlaErrorIncompatibleDlaSWVersion; }
    size_t n = (size_t)hdr[2] + hdr[3];
    if (hdr[1] != d->index || hdr[2] == 0 || hdr[2] > 64 || hdr[3] == 0 || hdr[3] > 64 ||
        moduleSize != 8 + sizeof hdr + n * sizeof(cudlaModuleTensorDescriptor)) {
        UNLOCK();
        return cudlaErrorInvalidModule;
    }
    Module *m = new_obj(sizeof *m, MAGIC_MOD, K_MODULE);
    m->desc = malloc(n * sizeof *m->desc);
    memcpy(m->desc, pModule + 8 + sizeof hdr, n * sizeof *m->desc);
    m->dev = d;
    m->n_in = hdr[2];
    m->n_out = hdr[3];
    d->module = m;
    UNLOCK();
    *hModule = m;
    return cudlaSuccess;
}

API cudlaStatus cudlaModuleGetAttributes(void *const hModule, int const attrType, cudlaModuleAttribute *const attribute) {
    INJECT("cudlaModuleGetAttributes");
    logf_("cudlaModuleGetAttributes module=%p attr=%d", hModule, attrType);
    Module *m = hModule;
    if (!valid(m, MAGIC_MOD)) return cudlaErrorInvalidModule;
    if (!attribute) return cudlaErrorInvalidParam;
    switch (attrType) {
    case CUDLA_NUM_INPUT_TENSORS: attribute->numInputTensors = m->n_in; break;
    case CUDLA_NUM_OUTPUT_TENSORS: attribute->numOutputTensors = m->n_out; break;
    case CUDLA_NUM_OUTPUT_TASK_STATISTICS: attribute->numOutputTensors = 0; break;
    case CUDLA_INPUT_TENSOR_DESCRIPTORS:
        if (!attribute->inputTensorDesc) return cudlaErrorInvalidParam;
        memcpy(attribute->inputTensorDesc, m->desc, m->n_in * sizeof *m->desc);
        break;
    case CUDLA_OUTPUT_TENSOR_DESCRIPTORS:
        if (!attribute->outputTensorDesc) return cudlaErrorInvalidParam;
        memcpy(attribute->outputTensorDesc, m->desc + m->n_in, m->n_out * sizeof *m->desc);
        break;
    default: return cudlaErrorInvalidAttribute;
    }
    return cudlaSuccess;
}

API cudlaStatus cudlaModuleUnload(void *const hModule, uint32_t const flags) {
    INJECT("cudlaModuleUnload");
    logf_("cudlaModuleUnload module=%p flags=%u", hModule, flags);
    LOCK();
    Module *m = hModule;
    if (!valid(m, MAGIC_MOD)) { UNLOCK(); return cudlaErrorInvalidModule; }
    if (flags != 0) { UNLOCK(); return cudlaErrorInvalidParam; }
    if (m->dev->queued) { UNLOCK(); return cudlaErrorDlaErrProcessorBusy; } /* fake */
    m->dev->module = NULL;
    free(m->desc);
    free_obj(m, K_MODULE);
    UNLOCK();
    return cudlaSuccess;
}

API cudlaStatus cudlaMemRegister(void *const devHandle, const uint64_t *const ptr, size_t const size,
                                 uint64_t **const devPtr, uint32_t const flags) {
    logf_("cudlaMemRegister dev=%p ptr=%p size=%zu flags=%u", devHandle, (const void *)ptr, size, flags);
    (void)devPtr;
    return cudlaErrorUnsupportedOperation; /* hybrid mode only */
}

API cudlaStatus cudlaImportExternalMemory(void *const devHandle, const cudlaExternalMemoryHandleDesc *const desc,
                                          uint64_t **const devPtr, uint32_t const flags) {
    INJECT("cudlaImportExternalMemory");
    logf_("cudlaImportExternalMemory dev=%p obj=%p size=%llu flags=%u", devHandle,
          desc ? desc->extBufObject : NULL, desc ? desc->size : 0ULL, flags);
    if (!desc || !devPtr || flags > 2) return cudlaErrorInvalidParam;
    LOCK();
    Device *d = devHandle;
    BufObj *b = (BufObj *)desc->extBufObject;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (!valid(b, MAGIC_BUFOBJ) || desc->size == 0 || desc->size > b->size) { UNLOCK(); return cudlaErrorInvalidParam; }
    if ((uintptr_t)b->ptr % 32) { UNLOCK(); return cudlaErrorInvalidAddress; } /* 32-byte aligned */
    Reg *r = new_obj(sizeof *r, MAGIC_REG, K_MEM_REG);
    r->dev = d; r->kind = 1; r->buf = b; r->size = desc->size;
    UNLOCK();
    *devPtr = (uint64_t *)r;
    return cudlaSuccess;
}

API cudlaStatus cudlaGetNvSciSyncAttributes(uint64_t *attrList, uint32_t const flags) {
    INJECT("cudlaGetNvSciSyncAttributes");
    logf_("cudlaGetNvSciSyncAttributes list=%p flags=%u", (void *)attrList, flags);
    SyncList *l = (SyncList *)attrList;
    if (!valid(l, MAGIC_SYNCLIST) || l->reconciled || flags < 1 || flags > 3) return cudlaErrorInvalidParam;
    if (l->perm) return cudlaErrorInvalidParam; /* the app must not set RequiredPerm on this list */
    l->cudla_filled = true;
    l->cudla_flags = flags;
    l->perm = (flags & CUDLA_NVSCISYNC_ATTR_WAIT ? Perm_WaitOnly : 0) |
              (flags & CUDLA_NVSCISYNC_ATTR_SIGNAL ? Perm_SignalOnly : 0);
    return cudlaSuccess;
}

API cudlaStatus cudlaImportExternalSemaphore(void *const devHandle, const cudlaExternalSemaphoreHandleDesc *const desc,
                                             uint64_t **const devPtr, uint32_t const flags) {
    INJECT("cudlaImportExternalSemaphore");
    logf_("cudlaImportExternalSemaphore dev=%p obj=%p flags=%u", devHandle, desc ? desc->extSyncObject : NULL, flags);
    if (!desc || !devPtr || flags != 0) return cudlaErrorInvalidParam;
    LOCK();
    Device *d = devHandle;
    SyncObj *o = (SyncObj *)desc->extSyncObject;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (!valid(o, MAGIC_SYNCOBJ) || !(o->dla_waits || o->dla_signals)) { UNLOCK(); return cudlaErrorInvalidParam; }
    /* older JetPack/DriveOS: only deterministic semaphores import (cuDLA-samples #5) */
    if (opt_deterministic_only && !o->deterministic) { UNLOCK(); return cudlaErrorUnsupportedOperation; }
    Reg *r = new_obj(sizeof *r, MAGIC_REG, K_SEM_REG);
    r->dev = d; r->kind = 2; r->sync = o;
    UNLOCK();
    *devPtr = (uint64_t *)r;
    return cudlaSuccess;
}

API cudlaStatus cudlaMemUnregister(void *const devHandle, const uint64_t *const devPtr) {
    INJECT("cudlaMemUnregister");
    logf_("cudlaMemUnregister dev=%p ptr=%p", devHandle, (const void *)devPtr);
    LOCK();
    Reg *r = (Reg *)devPtr;
    if (!valid(devHandle, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (!valid(r, MAGIC_REG) || r->dev != devHandle) { UNLOCK(); return cudlaErrorInvalidAddress; }
    free_obj(r, r->kind == 1 ? K_MEM_REG : K_SEM_REG);
    UNLOCK();
    return cudlaSuccess;
}

static cudlaStatus check_tensor(Device *d, const uint64_t *ptr, const cudlaModuleTensorDescriptor *desc, Reg **out) {
    Reg *r = (Reg *)ptr;
    if (!valid(r, MAGIC_REG) || r->dev != d || r->kind != 1) return cudlaErrorInvalidAddress;
    if (r->size < desc->size) return cudlaErrorInvalidParam;
    *out = r;
    return cudlaSuccess;
}

API cudlaStatus cudlaSubmitTask(void *const devHandle, const cudlaTask *const tasks, uint32_t const numTasks,
                                void *const stream, uint32_t const flags) {
    INJECT("cudlaSubmitTask");
    logf_("cudlaSubmitTask dev=%p tasks=%u stream=%p flags=%u", devHandle, numTasks, stream, flags);
    if (!tasks || numTasks == 0 || stream != NULL) return cudlaErrorInvalidParam; /* NULL stream */
    if (flags & ~(uint32_t)(CUDLA_SUBMIT_NOOP | CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE | CUDLA_SUBMIT_DIAGNOSTICS_TASK))
        return cudlaErrorInvalidParam;
    LOCK();
    Device *d = devHandle;
    if (!valid(d, MAGIC_DEV)) { UNLOCK(); return cudlaErrorInvalidDevice; }
    if (d->last_error) { cudlaStatus s = d->last_error; UNLOCK(); return s; } /* pending async error */
    if (d->in_submit) { UNLOCK(); return cudlaErrorInvalidParam; } /* fake: two threads in one handle */
    d->in_submit = 1;
    cudlaStatus status = cudlaSuccess;
    Task *built[16] = {0};
    if (numTasks > 16) status = cudlaErrorInvalidParam;
    for (uint32_t t = 0; t < numTasks && status == cudlaSuccess; t++) {
        const cudlaTask *in = &tasks[t];
        Module *m = in->moduleHandle;
        if (!valid(m, MAGIC_MOD) || m->dev != d) { status = cudlaErrorInvalidModule; break; }
        if (in->numInputTensors != m->n_in || in->numOutputTensors != m->n_out ||
            !in->inputTensor || !in->outputTensor) { status = cudlaErrorInvalidParam; break; }
        Task *k = calloc(1, sizeof *k);
        built[t] = k;
        k->module = m; k->n_in = m->n_in; k->n_out = m->n_out;
        for (uint32_t i = 0; i < m->n_in && !status; i++) status = check_tensor(d, in->inputTensor[i], &m->desc[i], &k->ins[i]);
        for (uint32_t i = 0; i < m->n_out && !status; i++) status = check_tensor(d, in->outputTensor[i], &m->desc[m->n_in + i], &k->outs[i]);
        if (status) break;
        k->caller_in = in->inputTensor; memcpy(k->in_copy, in->inputTensor, m->n_in * sizeof(void *));
        k->caller_out = in->outputTensor; memcpy(k->out_copy, in->outputTensor, m->n_out * sizeof(void *));
        if (in->waitEvents) {
            const cudlaWaitEvents *w = in->waitEvents;
            if (w->numEvents > 29 || (w->numEvents && !w->preFences)) { status = cudlaErrorInvalidParam; break; }
            for (uint32_t i = 0; i < w->numEvents; i++) {
                const CudlaFence *cf = &w->preFences[i];
                const NvSciSyncFence *f = cf->fence;
                if (cf->type != CUDLA_NVSCISYNC_FENCE || !f) { status = cudlaErrorInvalidParam; break; }
                if (fence_set(f)) {
                    SyncObj *o = fence_obj(f);
                    if (!valid(o, MAGIC_SYNCOBJ) || !o->dla_waits) { status = cudlaErrorInvalidParam; break; }
                }
                k->waits[k->n_wait++] = *f;
            }
            if (status) break;
            k->caller_wait = w->preFences;
            k->caller_wait_len = w->numEvents * sizeof(CudlaFence);
            memcpy(k->wait_copy, w->preFences, k->caller_wait_len);
        }
        if (in->signalEvents) {
            cudlaSignalEvents *s = in->signalEvents;
            if (s->numEvents > 1 || (s->numEvents && (!s->devPtrs || !s->eofFences))) {
                status = cudlaErrorInvalidParam; /* at most one syncpoint per task */
                break;
            }
            for (uint32_t i = 0; i < s->numEvents; i++) {
                Reg *r = (Reg *)s->devPtrs[i];
                if (!valid(r, MAGIC_REG) || r->dev != d || r->kind != 2 || !r->sync->dla_signals ||
                    s->eofFences[i].type != CUDLA_NVSCISYNC_FENCE ||
                    (!s->eofFences[i].fence && !r->sync->deterministic)) {
                    status = cudlaErrorInvalidParam;
                    break;
                }
                k->signal_obj[k->n_signal++] = r->sync;
            }
            if (status) break;
        }
    }
    if (status == cudlaSuccess) {
        for (uint32_t t = 0; t < numTasks; t++) {
            Task *k = built[t];
            cudlaSignalEvents *s = tasks[t].signalEvents;
            for (uint32_t i = 0; i < k->n_signal; i++) {
                SyncObj *o = k->signal_obj[i];
                k->signal_value[i] = ++o->next;
                if (s->eofFences[i].fence) fence_fill(s->eofFences[i].fence, o, k->signal_value[i]);
            }
            for (uint32_t i = 0; i < k->n_wait; i++) if (fence_set(&k->waits[i])) g_live[K_FENCE]++;
            k->id = ++d->tasks;
            if (d->fault_count > 0) { k->fault = d->fault_kind; k->fault_status = d->fault_status; d->fault_count--; }
            if (d->tail) d->tail->next = k; else d->head = k;
            d->tail = k;
            d->queued++;
            logf_("task dev=%p id=%" PRIu64 " in=%u out=%u waits=%u signals=%u", (void *)d, k->id, k->n_in, k->n_out, k->n_wait, k->n_signal);
        }
        pthread_cond_broadcast(&g_cv);
    } else {
        for (uint32_t t = 0; t < numTasks && t < 16; t++) free(built[t]);
    }
    d->in_submit = 0;
    UNLOCK();
    return status;
}

static void run_default(Task *k) {
    /* out_j[b] = in_0[b % size_0] + 31 * j + 7 (mod 256): deterministic, checkable, input-bound */
    const uint8_t *in = k->n_in ? k->ins[0]->buf->ptr : NULL;
    uint64_t in_size = k->n_in ? k->module->desc[0].size : 0;
    for (uint32_t j = 0; j < k->n_out; j++) {
        uint8_t *out = k->outs[j]->buf->ptr;
        uint64_t size = k->module->desc[k->n_in + j].size;
        for (uint64_t b = 0; b < size; b++)
            out[b] = (uint8_t)((in ? in[b % in_size] : 0) + 31 * j + 7);
    }
}

static void *device_thread(void *arg) {
    Device *d = arg;
    LOCK();
    for (;;) {
        while (!d->head && !d->stopping) pthread_cond_wait(&g_cv, &g_mu);
        if (!d->head) break;
        Task *k = d->head;
        struct timespec deadline;
        deadline_after_ms(&deadline, d->timeout_ms); /* from the head of the queue */
        cudlaStatus status = cudlaSuccess;
        int rc = 0;
        for (;;) {
            bool ready = true;
            for (uint32_t i = 0; i < k->n_wait; i++) ready = ready && fence_reached(&k->waits[i]);
            if (ready && k->fault != FAULT_HANG) break;
            rc = pthread_cond_timedwait(&g_cv, &g_mu, &deadline);
            if (rc == ETIMEDOUT) break;
        }
        if (rc == ETIMEDOUT) status = cudlaErrorDlaErrEngineTimeout;
        else if (k->fault == FAULT_ERROR) status = k->fault_status;
        else if ((k->caller_wait && memcmp(k->caller_wait, k->wait_copy, k->caller_wait_len)) ||
                 memcmp(k->caller_in, k->in_copy, k->n_in * sizeof(void *)) ||
                 memcmp(k->caller_out, k->out_copy, k->n_out * sizeof(void *))) {
            /* the submitter freed or reused what it passed before the task ran */
            logf_("task dev=%p id=%" PRIu64 " submitted arrays changed before it ran", (void *)d, k->id);
            status = cudlaErrorDlaErrInvalidPreAction;
        } else {
            fake_task_fn cb = g_callback;
            int64_t delay = opt_task_delay_us;
            UNLOCK();
            if (cb) {
                void *ins[64], *outs[64];
                uint64_t in_sizes[64], out_sizes[64];
                for (uint32_t i = 0; i < k->n_in; i++) { ins[i] = k->ins[i]->buf->ptr; in_sizes[i] = k->module->desc[i].size; }
                for (uint32_t i = 0; i < k->n_out; i++) { outs[i] = k->outs[i]->buf->ptr; out_sizes[i] = k->module->desc[k->n_in + i].size; }
                status = cb((int)d->index, k->n_in, ins, in_sizes, k->n_out, outs, out_sizes);
            } else {
                run_default(k);
            }
            if (delay > 0) {
                struct timespec ts = {(time_t)(delay / 1000000), (long)(delay % 1000000) * 1000L};
                nanosleep(&ts, NULL);
            }
            LOCK();
        }
        while (opt_hold_tasks) pthread_cond_wait(&g_cv, &g_mu);
        if (status) d->last_error = status;
        for (uint32_t i = 0; i < k->n_signal; i++)
            if (k->signal_obj[i]->value < k->signal_value[i]) k->signal_obj[i]->value = k->signal_value[i];
        for (uint32_t i = 0; i < k->n_wait; i++) if (fence_set(&k->waits[i])) g_live[K_FENCE]--;
        logf_("done dev=%p id=%" PRIu64 " status=%#x", (void *)d, k->id, status);
        d->head = k->next;
        if (!d->head) d->tail = NULL;
        d->queued--;
        free(k);
        pthread_cond_broadcast(&g_cv);
    }
    UNLOCK();
    return NULL;
}

/* ------------------------------------------------------------------ NvSciBuf */
API NvSciError NvSciBufModuleOpen(void **module) {
    INJECT("NvSciBufModuleOpen");
    logf_("NvSciBufModuleOpen");
    if (!module) return NvSciError_BadParameter;
    LOCK(); *module = new_obj(sizeof(BufModule), MAGIC_BUFMOD, K_BUF_MODULE); UNLOCK();
    return NvSciError_Success;
}
API void NvSciBufModuleClose(void *module) {
    logf_("NvSciBufModuleClose module=%p", module);
    LOCK(); if (valid(module, MAGIC_BUFMOD)) free_obj(module, K_BUF_MODULE); UNLOCK();
}
API NvSciError NvSciBufAttrListCreate(void *module, void **list) {
    INJECT("NvSciBufAttrListCreate");
    logf_("NvSciBufAttrListCreate module=%p", module);
    if (!valid(module, MAGIC_BUFMOD) || !list) return NvSciError_BadParameter;
    LOCK(); *list = new_obj(sizeof(BufList), MAGIC_BUFLIST, K_BUF_ATTR_LIST); UNLOCK();
    return NvSciError_Success;
}
API void NvSciBufAttrListFree(void *list) {
    logf_("NvSciBufAttrListFree list=%p", list);
    LOCK(); if (valid(list, MAGIC_BUFLIST)) free_obj(list, K_BUF_ATTR_LIST); UNLOCK();
}
API NvSciError NvSciBufAttrListSetAttrs(void *list, const KeyValuePair *pairs, size_t count) {
    INJECT("NvSciBufAttrListSetAttrs");
    BufList *l = list;
    if (!valid(l, MAGIC_BUFLIST) || l->reconciled || !pairs || !count) return NvSciError_BadParameter;
    for (size_t i = 0; i < count; i++) {
        const KeyValuePair *p = &pairs[i];
        logf_("NvSciBufAttrListSetAttrs list=%p key=%#x len=%zu", list, p->key, p->len);
        if (!p->value) return NvSciError_BadParameter;
        switch (p->key) {
        case BufKey_Types:
            if (p->len % 4 || !p->len) return NvSciError_BadParameter;
            l->has_types = true;
            for (size_t j = 0; j < p->len / 4; j++) l->raw |= ((const uint32_t *)p->value)[j] == BufType_RawBuffer;
            break;
        case BufKey_NeedCpuAccess: if (p->len != 1) return NvSciError_BadParameter; l->need_cpu = *(const uint8_t *)p->value; break;
        case BufKey_RequiredPerm: if (p->len != 4) return NvSciError_BadParameter; l->perm = *(const uint32_t *)p->value; break;
        case BufKey_GpuId: if (p->len != 16) return NvSciError_BadParameter; break;
        case BufKey_RawSize: if (p->len != 8) return NvSciError_BadParameter; l->size = *(const uint64_t *)p->value; l->has_size = true; break;
        case BufKey_RawAlign: {
            if (p->len != 8) return NvSciError_BadParameter;
            uint64_t a = *(const uint64_t *)p->value;
            if (!a || (a & (a - 1))) return NvSciError_BadParameter;
            l->align = a;
            break;
        }
        default: return NvSciError_BadParameter;
        }
    }
    return NvSciError_Success;
}
API NvSciError NvSciBufAttrListReconcile(const void *const lists[], size_t n, void **reconciled, void **conflict) {
    INJECT("NvSciBufAttrListReconcile");
    logf_("NvSciBufAttrListReconcile n=%zu", n);
    if (!lists || !n || !reconciled || !conflict) return NvSciError_BadParameter;
    BufList out = {.magic = MAGIC_BUFLIST, .reconciled = true};
    for (size_t i = 0; i < n; i++) {
        const BufList *l = lists[i];
        if (!valid(l, MAGIC_BUFLIST) || l->reconciled) return NvSciError_BadParameter;
        out.raw |= l->raw; out.has_types |= l->has_types; out.need_cpu |= l->need_cpu;
        out.perm |= l->perm;
        if (l->has_size) { out.size = l->size > out.size ? l->size : out.size; out.has_size = true; }
        if (l->align > out.align) out.align = l->align;
    }
    *conflict = NULL;
    if (!out.raw || !out.has_size || !out.size) return NvSciError_BadParameter;
    LOCK();
    BufList *r = new_obj(sizeof *r, MAGIC_BUFLIST, K_BUF_ATTR_LIST);
    *r = out;
    UNLOCK();
    *reconciled = r;
    return NvSciError_Success;
}
API NvSciError NvSciBufObjAlloc(void *reconciled, void **obj) {
    INJECT("NvSciBufObjAlloc");
    logf_("NvSciBufObjAlloc list=%p", reconciled);
    BufList *l = reconciled;
    if (!valid(l, MAGIC_BUFLIST) || !l->reconciled || !obj) return NvSciError_BadParameter;
    uint64_t align = l->align > 64 ? l->align : 64;
    void *mem = NULL;
    if (posix_memalign(&mem, align, l->size + align)) return NvSciError_InsufficientMemory;
    memset(mem, 0, l->size + align);
    LOCK();
    BufObj *b = new_obj(sizeof *b, MAGIC_BUFOBJ, K_BUF_OBJ);
    b->size = l->size; b->mem = mem; b->cpu = l->need_cpu;
    b->ptr = (char *)mem + (opt_misalign ? 8 : 0);
    UNLOCK();
    *obj = b;
    return NvSciError_Success;
}
API NvSciError NvSciBufObjGetCpuPtr(void *obj, void **ptr) {
    INJECT("NvSciBufObjGetCpuPtr");
    logf_("NvSciBufObjGetCpuPtr obj=%p", obj);
    BufObj *b = obj;
    if (!valid(b, MAGIC_BUFOBJ) || !ptr || !b->cpu) return NvSciError_BadParameter;
    *ptr = b->ptr;
    return NvSciError_Success;
}
API void NvSciBufObjFree(void *obj) {
    logf_("NvSciBufObjFree obj=%p", obj);
    LOCK();
    BufObj *b = obj;
    if (valid(b, MAGIC_BUFOBJ)) { free(b->mem); free_obj(b, K_BUF_OBJ); }
    UNLOCK();
}

/* ------------------------------------------------------------------ NvSciSync */
API NvSciError NvSciSyncModuleOpen(void **module) {
    INJECT("NvSciSyncModuleOpen");
    logf_("NvSciSyncModuleOpen");
    if (!module) return NvSciError_BadParameter;
    LOCK(); *module = new_obj(sizeof(SyncModule), MAGIC_SYNCMOD, K_SYNC_MODULE); UNLOCK();
    return NvSciError_Success;
}
API void NvSciSyncModuleClose(void *module) {
    logf_("NvSciSyncModuleClose module=%p", module);
    LOCK(); if (valid(module, MAGIC_SYNCMOD)) free_obj(module, K_SYNC_MODULE); UNLOCK();
}
API NvSciError NvSciSyncCpuWaitContextAlloc(void *module, void **ctx) {
    INJECT("NvSciSyncCpuWaitContextAlloc");
    logf_("NvSciSyncCpuWaitContextAlloc module=%p", module);
    if (!valid(module, MAGIC_SYNCMOD) || !ctx) return NvSciError_BadParameter;
    LOCK(); *ctx = new_obj(sizeof(CpuCtx), MAGIC_CPUCTX, K_CPU_WAIT_CTX); UNLOCK();
    return NvSciError_Success;
}
API void NvSciSyncCpuWaitContextFree(void *ctx) {
    logf_("NvSciSyncCpuWaitContextFree ctx=%p", ctx);
    LOCK(); if (valid(ctx, MAGIC_CPUCTX)) free_obj(ctx, K_CPU_WAIT_CTX); UNLOCK();
}
API NvSciError NvSciSyncAttrListCreate(void *module, void **list) {
    INJECT("NvSciSyncAttrListCreate");
    logf_("NvSciSyncAttrListCreate module=%p", module);
    if (!valid(module, MAGIC_SYNCMOD) || !list) return NvSciError_BadParameter;
    LOCK(); *list = new_obj(sizeof(SyncList), MAGIC_SYNCLIST, K_SYNC_ATTR_LIST); UNLOCK();
    return NvSciError_Success;
}
API void NvSciSyncAttrListFree(void *list) {
    logf_("NvSciSyncAttrListFree list=%p", list);
    LOCK(); if (valid(list, MAGIC_SYNCLIST)) free_obj(list, K_SYNC_ATTR_LIST); UNLOCK();
}
API NvSciError NvSciSyncAttrListSetAttrs(void *list, const KeyValuePair *pairs, size_t count) {
    INJECT("NvSciSyncAttrListSetAttrs");
    SyncList *l = list;
    if (!valid(l, MAGIC_SYNCLIST) || l->reconciled || !pairs || !count) return NvSciError_BadParameter;
    for (size_t i = 0; i < count; i++) {
        const KeyValuePair *p = &pairs[i];
        logf_("NvSciSyncAttrListSetAttrs list=%p key=%u len=%zu", list, p->key, p->len);
        if (!p->value) return NvSciError_BadParameter;
        switch (p->key) {
        case SyncKey_NeedCpuAccess: if (p->len != 1) return NvSciError_BadParameter; l->need_cpu = *(const uint8_t *)p->value; break;
        case SyncKey_RequiredPerm:
            /* NvSciSyncAccessPerm is a uint64_t; cuDLA sets it on its own lists */
            if (p->len != 8 || l->cudla_filled) return NvSciError_BadParameter;
            l->perm = *(const uint64_t *)p->value;
            if (l->perm < 1 || l->perm > 3) return NvSciError_BadParameter;
            break;
        case SyncKey_WaiterRequireTimestamps: if (p->len != 1) return NvSciError_BadParameter; break;
        case SyncKey_RequireDeterministicFences: if (p->len != 1) return NvSciError_BadParameter; l->deterministic = *(const uint8_t *)p->value; break;
        default: return NvSciError_BadParameter;
        }
    }
    return NvSciError_Success;
}
API NvSciError NvSciSyncAttrListReconcile(const void *const lists[], size_t n, void **reconciled, void **conflict) {
    INJECT("NvSciSyncAttrListReconcile");
    logf_("NvSciSyncAttrListReconcile n=%zu", n);
    if (!lists || !n || !reconciled || !conflict) return NvSciError_BadParameter;
    SyncList out = {.magic = MAGIC_SYNCLIST, .reconciled = true};
    int signalers = 0;
    for (size_t i = 0; i < n; i++) {
        const SyncList *l = lists[i];
        if (!valid(l, MAGIC_SYNCLIST) || l->reconciled || !l->perm) return NvSciError_BadParameter;
        out.deterministic |= l->deterministic;
        if (l->perm & Perm_SignalOnly) {
            signalers++;
            out.signaler = l->cudla_filled ? 2 : 1;
            out.dla_signals |= l->cudla_filled;
        }
        if (l->perm & Perm_WaitOnly) {
            if (l->cudla_filled) out.dla_waits = true;
            if (l->need_cpu) out.cpu_waits = true;
        }
    }
    *conflict = NULL;
    if (signalers != 1) return NvSciError_BadParameter; /* fake: exactly one signaller */
    LOCK();
    SyncList *r = new_obj(sizeof *r, MAGIC_SYNCLIST, K_SYNC_ATTR_LIST);
    *r = out;
    UNLOCK();
    *reconciled = r;
    return NvSciError_Success;
}
API NvSciError NvSciSyncObjAlloc(void *reconciled, void **obj) {
    INJECT("NvSciSyncObjAlloc");
    logf_("NvSciSyncObjAlloc list=%p", reconciled);
    SyncList *l = reconciled;
    if (!valid(l, MAGIC_SYNCLIST) || !l->reconciled || !obj) return NvSciError_BadParameter;
    LOCK();
    SyncObj *o = new_obj(sizeof *o, MAGIC_SYNCOBJ, K_SYNC_OBJ);
    o->id = g_next_sync_id++;
    o->signaler = l->signaler; o->cpu_waits = l->cpu_waits; o->dla_waits = l->dla_waits;
    o->dla_signals = l->dla_signals; o->deterministic = l->deterministic;
    UNLOCK();
    *obj = o;
    return NvSciError_Success;
}
API void NvSciSyncObjFree(void *obj) {
    logf_("NvSciSyncObjFree obj=%p", obj);
    LOCK(); if (valid(obj, MAGIC_SYNCOBJ)) free_obj(obj, K_SYNC_OBJ); UNLOCK();
}
API NvSciError NvSciSyncObjGenerateFence(void *obj, NvSciSyncFence *fence) {
    INJECT("NvSciSyncObjGenerateFence");
    logf_("NvSciSyncObjGenerateFence obj=%p", obj);
    SyncObj *o = obj;
    if (!valid(o, MAGIC_SYNCOBJ) || !fence || o->signaler != 1) return NvSciError_BadParameter;
    LOCK(); fence_fill(fence, o, o->value + 1); UNLOCK(); /* expires on the next signal */
    return NvSciError_Success;
}
API NvSciError NvSciSyncObjSignal(void *obj) {
    INJECT("NvSciSyncObjSignal");
    logf_("NvSciSyncObjSignal obj=%p", obj);
    SyncObj *o = obj;
    if (!valid(o, MAGIC_SYNCOBJ) || o->signaler != 1) return NvSciError_BadParameter;
    LOCK(); o->value++; o->next = o->value; pthread_cond_broadcast(&g_cv); UNLOCK();
    return NvSciError_Success;
}
API NvSciError NvSciSyncFenceWait(const NvSciSyncFence *fence, void *ctx, int64_t timeoutUs) {
    INJECT("NvSciSyncFenceWait");
    logf_("NvSciSyncFenceWait id=%" PRIu64 " value=%" PRIu64 " timeout_us=%" PRId64,
          fence ? fence->payload[1] : 0, fence ? fence->payload[2] : 0, timeoutUs);
    if (!fence || !valid(ctx, MAGIC_CPUCTX) || timeoutUs < -1) return NvSciError_BadParameter;
    LOCK();
    if (fence_set(fence)) {
        SyncObj *o = fence_obj(fence);
        if (!valid(o, MAGIC_SYNCOBJ) || !o->cpu_waits) { UNLOCK(); return NvSciError_BadParameter; }
    }
    struct timespec deadline;
    if (timeoutUs >= 0) deadline_after_ms(&deadline, 0), deadline.tv_sec += timeoutUs / 1000000,
        deadline.tv_nsec += (timeoutUs % 1000000) * 1000L,
        deadline.tv_sec += deadline.tv_nsec / 1000000000L, deadline.tv_nsec %= 1000000000L;
    NvSciError err = NvSciError_Success;
    while (!fence_reached(fence)) {
        if (timeoutUs < 0) pthread_cond_wait(&g_cv, &g_mu);
        else if (pthread_cond_timedwait(&g_cv, &g_mu, &deadline) == ETIMEDOUT) {
            if (!fence_reached(fence)) err = NvSciError_Timeout;
            break;
        }
    }
    UNLOCK();
    return err;
}
API void NvSciSyncFenceClear(NvSciSyncFence *fence) {
    logf_("NvSciSyncFenceClear");
    if (!fence) return;
    LOCK();
    if (fence_set(fence)) g_live[K_FENCE]--;
    memset(fence, 0, sizeof *fence);
    UNLOCK();
}
API NvSciError NvSciSyncFenceDup(const NvSciSyncFence *src, NvSciSyncFence *dst) {
    INJECT("NvSciSyncFenceDup");
    logf_("NvSciSyncFenceDup");
    if (!src || !dst || src == dst) return NvSciError_BadParameter;
    LOCK();
    if (fence_set(dst)) g_live[K_FENCE]--;
    *dst = *src;
    if (fence_set(dst)) g_live[K_FENCE]++;
    UNLOCK();
    return NvSciError_Success;
}
#ifndef FAKE_OLD_RELEASE
API NvSciError NvSciSyncFenceExtractFence(const NvSciSyncFence *fence, uint64_t *id, uint64_t *value) {
    INJECT("NvSciSyncFenceExtractFence");
    logf_("NvSciSyncFenceExtractFence");
    if (!fence || !id || !value || !fence_set(fence)) return NvSciError_BadParameter;
    *id = fence->payload[1];
    *value = fence->payload[2];
    return NvSciError_Success;
}
API NvSciError NvSciSyncFenceUpdateFence(void *obj, uint64_t id, uint64_t value, NvSciSyncFence *fence) {
    INJECT("NvSciSyncFenceUpdateFence");
    logf_("NvSciSyncFenceUpdateFence obj=%p id=%" PRIu64 " value=%" PRIu64, obj, id, value);
    SyncObj *o = obj;
    /* fake: a deterministic semaphore's fences are primed from (id 0, value 0) (§4.7 step 7) */
    if (!valid(o, MAGIC_SYNCOBJ) || !fence || (id != o->id && !(o->deterministic && id == 0)))
        return NvSciError_BadParameter;
    LOCK(); fence_fill(fence, o, value); UNLOCK();
    return NvSciError_Success;
}
#endif
