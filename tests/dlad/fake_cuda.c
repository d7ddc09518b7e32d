// A fake of the CUDA driver calls the native plane's GPU chain makes (dlad/native/gpu_chain.hpp's
// CudaApi), with their ABI, for tests on machines without a GPU (tests/dlad/test_native_gpu.py).
//
// "Device" addresses are host addresses. A stream is a thread that runs its operations in order,
// as a CUDA stream does:
//   - fake_memcpy_htod_async copies the source at once into a staging copy (the driver's own
//     staging of pageable memory), and into the destination when the stream reaches it;
//   - fake_launch_kernel takes the kernel's one by-value argument (the PRE_BYTES-byte PreParams) at the
//     call, as the driver does, and when run logs it with the sum of the source's bytes (which
//     says whether the pixels were in place when the kernel ran) and the time;
//   - write/wait value: the 32-bit word written, or waited for (wrap-safe >=), with the times;
//   - fake_graph_launch runs a fake post graph (fake_graph_create): the "copy" one first copies
//     the settings from pinned to device memory; both then write a result record computed from
//     the device's copy, so a frame run on the wrong graph shows stale settings;
//   - an inference graph (fake_infer_graph_create: a GPU engine's model for a batch of n) only
//     logs that it ran;
//   - fake_launch_host_func calls the function on the stream's thread;
//   - fake_trace: what every stream ran, in order, a letter an operation (C copy, K kernel,
//     W write, V wait, P post graph, 1-9 an inference graph of that batch, H host function,
//     S/X external semaphore signal/wait);
//   - external semaphores (a cuDLA core's chain, recipe A) are NvSciSync objects of the fake
//     cuDLA library (tests/dlad/cudla/fake_cudla.c), whose functions fake_set_nvsci hands in:
//     fake_signal_external fills the caller's fence at the call, as CUDA does (the object's
//     next value), and signals the object when the stream reaches it; fake_wait_external
//     copies the fence at the call and waits for it when the stream reaches it.
// Controls: fake_fail_next makes a call return an error code once; fake_stream_hold makes a
// stream stop before its next operation until released.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define API __attribute__((visibility("default")))
#define PRE_BYTES 96  // sizeof(PreParams), kernels.cu

enum { OP_COPY, OP_KERNEL, OP_WRITE, OP_WAIT, OP_GRAPH, OP_HOST, OP_SIGNAL_EXT, OP_WAIT_EXT };

typedef struct Op {
    int kind;
    struct Op* next;
    uint64_t address;
    void* staged;
    size_t bytes;
    uint32_t value;
    unsigned char params[PRE_BYTES];
    void* graph;
    void (*fn)(void*);
    void* data;
    void* semaphore;
    uint64_t fence[6];  // an NvSciSyncFence
} Op;

typedef struct Stream {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Op *head, *tail;
    int stop, held, idle;
} Stream;

typedef struct Graph {
    int batch;  // an inference graph's (0: a post graph)
    int copy;
    unsigned char* frame_host;
    unsigned char* frame_device;
    float* out;
    int launches;
} Graph;

typedef struct Launch {
    unsigned char params[PRE_BYTES];
    uint64_t checksum;
    int64_t ran_ns;
} Launch;

#define MAX_LOG 4096
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static Launch g_launches[MAX_LOG];
static int g_nlaunches;
static int64_t g_written_ns[MAX_LOG], g_posted_ns[MAX_LOG];
static uint32_t g_written_value[MAX_LOG];
static int g_nwritten, g_nposted;
static char g_fail_call[64];
static int g_fail_code;
static int g_host_calls;
static void* g_context;
static int64_t g_signalled_ns[MAX_LOG];
static int g_nsignalled;
// the fake cuDLA library's NvSciSync functions and a CPU wait context (fake_set_nvsci)
static int (*g_generate)(void* obj, void* fence);
static int (*g_signal)(void* obj);
static int (*g_dup)(const void* src, void* dst);
static int (*g_wait)(const void* fence, void* ctx, int64_t timeout_us);
static void (*g_clear)(void* fence);
static void* g_wait_ctx;
static char g_trace[MAX_LOG];
static int g_ntrace;

static void trace(char what) {
    pthread_mutex_lock(&g_mu);
    if (g_ntrace < MAX_LOG - 1) g_trace[g_ntrace++] = what;
    pthread_mutex_unlock(&g_mu);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int failing(const char* call) {
    pthread_mutex_lock(&g_mu);
    int code = 0;
    if (g_fail_code != 0 && strcmp(g_fail_call, call) == 0) {
        code = g_fail_code;
        g_fail_code = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return code;
}

static int reached(uint32_t word, uint32_t value) { return (uint32_t)(word - value) < 0x80000000u; }

static void run_graph(Graph* g) {
    if (g->batch > 0) {
        trace((char)('0' + (g->batch < 9 ? g->batch : 9)));
        __atomic_add_fetch(&g->launches, 1, __ATOMIC_SEQ_CST);
        return;
    }
    trace('P');
    // struct FrameParams {float conf, obj_cut, iou; int max_det, ...}; struct Geometry {double
    // scale; int pad_x, pad_y, src_w, src_h}
    if (g->copy) memcpy(g->frame_device, g->frame_host, 56);
    float conf, iou;
    int max_det, pad[4];
    double scale;
    memcpy(&conf, g->frame_device, 4);
    memcpy(&iou, g->frame_device + 8, 4);
    memcpy(&max_det, g->frame_device + 12, 4);
    memcpy(&scale, g->frame_device + 32, 8);
    memcpy(pad, g->frame_device + 40, 16);
    int n = max_det < 2 ? max_det : 2;
    float* rec = g->out;
    rec[0] = (float)n, rec[1] = (float)n, rec[2] = 0.0f, rec[3] = (float)n;
    for (int i = 0; i < n; ++i) {
        float* row = rec + 4 + 6 * i;
        row[0] = (float)pad[0], row[1] = (float)pad[1], row[2] = (float)pad[2];
        row[3] = (float)pad[3], row[4] = conf, row[5] = iou + (float)i;
    }
    __atomic_add_fetch(&g->launches, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&g_mu);
    if (g_nposted < MAX_LOG) g_posted_ns[g_nposted++] = now_ns();
    pthread_mutex_unlock(&g_mu);
}

static void run_op(Op* op) {
    static const char letters[] = "CKWV?HSX";  // the graph's letter is run_graph's
    if (op->kind != OP_GRAPH) trace(letters[op->kind]);
    switch (op->kind) {
        case OP_COPY:
            memcpy((void*)(uintptr_t)op->address, op->staged, op->bytes);
            free(op->staged);
            break;
        case OP_KERNEL: {
            const unsigned char* src;
            int src_h, src_pitch, src_fmt;
            memcpy(&src, op->params, sizeof src);
            memcpy(&src_h, op->params + 20, 4);
            memcpy(&src_pitch, op->params + 24, 4);
            memcpy(&src_fmt, op->params + 28, 4);
            // the whole frame: an NV12 frame's chroma rows follow its luma rows
            const long rows = src_fmt == 3 ? (long)src_h * 3 / 2 : (long)src_h;
            uint64_t sum = 0;
            for (long i = 0; i < rows * src_pitch; ++i) sum += src[i];
            pthread_mutex_lock(&g_mu);
            if (g_nlaunches < MAX_LOG) {
                Launch* l = &g_launches[g_nlaunches++];
                memcpy(l->params, op->params, PRE_BYTES);
                l->checksum = sum;
                l->ran_ns = now_ns();
            }
            pthread_mutex_unlock(&g_mu);
            break;
        }
        case OP_WRITE:
            // The time is taken before the word is written: whoever the word wakes records
            // later, whichever thread the scheduler runs first
            pthread_mutex_lock(&g_mu);
            if (g_nwritten < MAX_LOG) {
                g_written_value[g_nwritten] = op->value;
                g_written_ns[g_nwritten++] = now_ns();
            }
            pthread_mutex_unlock(&g_mu);
            __atomic_store_n((uint32_t*)(uintptr_t)op->address, op->value, __ATOMIC_RELEASE);
            break;
        case OP_WAIT: {
            const struct timespec pause = {0, 20000};
            while (!reached(__atomic_load_n((uint32_t*)(uintptr_t)op->address, __ATOMIC_ACQUIRE),
                            op->value)) {
                nanosleep(&pause, NULL);
            }
            break;
        }
        case OP_GRAPH:
            run_graph((Graph*)op->graph);
            break;
        case OP_HOST:  // counted before the function runs: whoever it wakes sees the count
            __atomic_add_fetch(&g_host_calls, 1, __ATOMIC_SEQ_CST);
            op->fn(op->data);
            break;
        case OP_SIGNAL_EXT:  // timed before the signal, as OP_WRITE is
            pthread_mutex_lock(&g_mu);
            if (g_nsignalled < MAX_LOG) g_signalled_ns[g_nsignalled++] = now_ns();
            pthread_mutex_unlock(&g_mu);
            g_signal(op->semaphore);
            break;
        case OP_WAIT_EXT:
            g_wait(op->fence, g_wait_ctx, -1);
            g_clear(op->fence);
            break;
    }
}

static void* stream_main(void* arg) {
    Stream* s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        s->idle = s->head == NULL;
        pthread_cond_broadcast(&s->cv);
        while (!s->stop && (s->head == NULL || s->held)) pthread_cond_wait(&s->cv, &s->mu);
        if (s->head == NULL) break;  // stopped with nothing left
        Op* op = s->head;
        s->head = op->next;
        if (s->head == NULL) s->tail = NULL;
        s->idle = 0;
        pthread_mutex_unlock(&s->mu);
        run_op(op);
        free(op);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void push(Stream* s, Op* op) {
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    s->idle = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static Op* new_op(int kind) {
    Op* op = calloc(1, sizeof *op);
    op->kind = kind;
    return op;
}

// ------------------------------------------------------------------ the driver calls

API int fake_ctx_set_current(void* ctx) {
    int r = failing("cuCtxSetCurrent");
    if (r == 0) g_context = ctx;
    return r;
}

API int fake_memcpy_htod_async(uint64_t dst, const void* src, size_t bytes, void* stream) {
    int r = failing("cuMemcpyHtoDAsync");
    if (r) return r;
    Op* op = new_op(OP_COPY);
    op->address = dst;
    op->bytes = bytes;
    op->staged = malloc(bytes ? bytes : 1);
    memcpy(op->staged, src, bytes);
    push(stream, op);
    return 0;
}

API int fake_launch_kernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                           unsigned by, unsigned bz, unsigned smem, void* stream, void** params,
                           void** extra) {
    (void)fn, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)smem;
    (void)extra;
    int r = failing("cuLaunchKernel");
    if (r) return r;
    Op* op = new_op(OP_KERNEL);
    memcpy(op->params, params[0], PRE_BYTES);
    push(stream, op);
    return 0;
}

API int fake_write_value32(void* stream, uint64_t address, uint32_t value, unsigned flags) {
    (void)flags;
    int r = failing("cuStreamWriteValue32");
    if (r) return r;
    Op* op = new_op(OP_WRITE);
    op->address = address;
    op->value = value;
    push(stream, op);
    return 0;
}

API int fake_wait_value32(void* stream, uint64_t address, uint32_t value, unsigned flags) {
    if (flags != 0) return 1;  // CU_STREAM_WAIT_VALUE_GEQ is 0: anything else is a bug
    int r = failing("cuStreamWaitValue32");
    if (r) return r;
    Op* op = new_op(OP_WAIT);
    op->address = address;
    op->value = value;
    push(stream, op);
    return 0;
}

API int fake_graph_launch(void* graph, void* stream) {
    int r = failing("cuGraphLaunch");
    if (r) return r;
    Op* op = new_op(OP_GRAPH);
    op->graph = graph;
    push(stream, op);
    return 0;
}

API int fake_launch_host_func(void* stream, void (*fn)(void*), void* data) {
    int r = failing("cuLaunchHostFunc");
    if (r) return r;
    Op* op = new_op(OP_HOST);
    op->fn = fn;
    op->data = data;
    push(stream, op);
    return 0;
}

// CUDA_EXTERNAL_SEMAPHORE_{SIGNAL,WAIT}_PARAMS: the NvSciSyncFence* at 8, flags at 72.
static int semaphore_params(const unsigned char* params, unsigned count, void** fence) {
    unsigned flags;
    memcpy(fence, params + 8, sizeof *fence);
    memcpy(&flags, params + 72, sizeof flags);
    return count == 1 && flags == 0 && *fence != NULL && g_generate != NULL;
}

API int fake_signal_external(void* const* semaphores, const unsigned char* params,
                             unsigned count, void* stream) {
    void* fence;
    if (!semaphore_params(params, count, &fence)) return 1;  // CUDA_ERROR_INVALID_VALUE
    int r = failing("cuSignalExternalSemaphoresAsync");
    if (r) return r;
    if (g_generate(semaphores[0], fence) != 0) return 1;  // filled at the call, as CUDA does
    Op* op = new_op(OP_SIGNAL_EXT);
    op->semaphore = semaphores[0];
    push(stream, op);
    return 0;
}

API int fake_wait_external(void* const* semaphores, const unsigned char* params, unsigned count,
                           void* stream) {
    void* fence;
    if (!semaphore_params(params, count, &fence)) return 1;
    int r = failing("cuWaitExternalSemaphoresAsync");
    if (r) return r;
    Op* op = new_op(OP_WAIT_EXT);
    op->semaphore = semaphores[0];
    if (g_dup(fence, op->fence) != 0) {  // read at the call, as CUDA does
        free(op);
        return 1;
    }
    push(stream, op);
    return 0;
}

// ------------------------------------------------------------------ test controls

API void fake_set_nvsci(void* generate, void* signal, void* dup, void* wait, void* clear,
                        void* ctx) {
    g_generate = (int (*)(void*, void*))generate;
    g_signal = (int (*)(void*))signal;
    g_dup = (int (*)(const void*, void*))dup;
    g_wait = (int (*)(const void*, void*, int64_t))wait;
    g_clear = (void (*)(void*))clear;
    g_wait_ctx = ctx;
}

// Copy out a log of times (``logged``: its length, read under the lock).
static int copy_times(const int64_t* log, const int* logged, int64_t* at, int most) {
    pthread_mutex_lock(&g_mu);
    int n = *logged < most ? *logged : most;
    memcpy(at, log, sizeof *at * (size_t)n);
    pthread_mutex_unlock(&g_mu);
    return n;
}

// When each external semaphore signal ran.
API int fake_signals(int64_t* at, int most) { return copy_times(g_signalled_ns, &g_nsignalled, at, most); }

API void* fake_stream_create(void) {
    Stream* s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->thread, NULL, stream_main, s);
    return s;
}

// Run what is queued, then end the thread and free the stream.
API void fake_stream_destroy(void* stream) {
    Stream* s = stream;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    s->held = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    free(s);
}

API void fake_stream_hold(void* stream, int held) {
    Stream* s = stream;
    pthread_mutex_lock(&s->mu);
    s->held = held;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

// Block until the stream has run everything queued (cuStreamSynchronize).
API void fake_stream_sync(void* stream) {
    Stream* s = stream;
    pthread_mutex_lock(&s->mu);
    while (!s->idle) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

API void* fake_graph_create(int copy, void* frame_host, void* frame_device, void* out) {
    Graph* g = calloc(1, sizeof *g);
    g->copy = copy;
    g->frame_host = frame_host;
    g->frame_device = frame_device;
    g->out = out;
    return g;
}

// A GPU engine's model for a batch of ``batch`` (1-9).
API void* fake_infer_graph_create(int batch) {
    Graph* g = calloc(1, sizeof *g);
    g->batch = batch;
    return g;
}

// What the streams ran so far, a letter an operation (see the top), NUL-terminated.
API int fake_trace(char* out, int most) {
    pthread_mutex_lock(&g_mu);
    int n = g_ntrace < most - 1 ? g_ntrace : most - 1;
    memcpy(out, g_trace, (size_t)n);
    out[n] = 0;
    pthread_mutex_unlock(&g_mu);
    return n;
}

API int fake_graph_launches(void* graph) {
    return __atomic_load_n(&((Graph*)graph)->launches, __ATOMIC_SEQ_CST);
}

API void fake_graph_destroy(void* graph) { free(graph); }

API void fake_fail_next(const char* call, int code) {
    pthread_mutex_lock(&g_mu);
    strncpy(g_fail_call, call, sizeof g_fail_call - 1);
    g_fail_code = code;
    pthread_mutex_unlock(&g_mu);
}

// The kernel launches run so far: copies ``params`` (PRE_BYTES bytes each) and checksums out.
API int fake_launches(unsigned char* params, uint64_t* checksums, int64_t* ran_ns, int most) {
    pthread_mutex_lock(&g_mu);
    int n = g_nlaunches < most ? g_nlaunches : most;
    for (int i = 0; i < n; ++i) {
        memcpy(params + PRE_BYTES * i, g_launches[i].params, PRE_BYTES);
        checksums[i] = g_launches[i].checksum;
        ran_ns[i] = g_launches[i].ran_ns;
    }
    pthread_mutex_unlock(&g_mu);
    return n;
}

// The ready words written and the post graphs run, with their times.
API int fake_writes(uint32_t* values, int64_t* at, int most) {
    pthread_mutex_lock(&g_mu);
    int n = g_nwritten < most ? g_nwritten : most;
    memcpy(values, g_written_value, sizeof *values * (size_t)n);
    memcpy(at, g_written_ns, sizeof *at * (size_t)n);
    pthread_mutex_unlock(&g_mu);
    return n;
}

API int fake_posts(int64_t* at, int most) { return copy_times(g_posted_ns, &g_nposted, at, most); }

API int fake_host_calls(void) { return __atomic_load_n(&g_host_calls, __ATOMIC_SEQ_CST); }

API void* fake_context(void) { return g_context; }

API void fake_reset(void) {
    pthread_mutex_lock(&g_mu);
    g_nlaunches = g_nwritten = g_nposted = g_nsignalled = g_ntrace = 0;
    g_fail_code = 0;
    pthread_mutex_unlock(&g_mu);
    __atomic_store_n(&g_host_calls, 0, __ATOMIC_SEQ_CST);
    g_context = NULL;
}
