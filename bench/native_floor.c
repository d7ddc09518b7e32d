/*
 * The floor of a daemon of dlad's shape whose data plane has no Python in it (BENCHMARKS §9.16):
 * the Python floor server of bench/daemon_throughput.py (FLOOR_SERVER) written again in C, so that
 * the one difference between the two is the interpreter and its event loop.
 *
 *   native_floor ENDPOINT LATENCY_US VERSION REPLY_KIND OK_STATUS [gpu]
 *
 * One thread polls a ROUTER bound to ENDPOINT and an eventfd. Each request ([identity, msgpack
 * header, frame], or [identity, header] for a frame in a shared-memory slot) goes to the less busy
 * of two engine threads in timing mode (tasks back to back, LATENCY_US each, two in flight per
 * engine, the rest queued in arrival order). An engine hands each finished task back through a
 * list and the eventfd, and the polling thread answers it with a valid INFER_REPLY (a msgpack
 * header with the request's id and the task's timing, an empty detections frame) and gives the
 * engine its next task. No checks, no scheduler, no metrics, no limits, as in the Python floor.
 *
 * With "gpu", each frame is copied to the GPU on receipt with cuMemcpyHtoDAsync (from the
 * message's pageable memory; from a shared-memory segment registered with the GPU when it is first
 * mapped), as dlad's upload does it. libcuda is opened at run time, so the build needs no CUDA.
 *
 * A message of one frame, "stop", ends it. Built by bench/daemon_throughput.py with plain cc
 * against the libzmq that pyzmq loads: libzmq's C API is declared below, since pyzmq's wheels
 * carry the library but not zmq.h. The engine threads are named "nfl<N>-emulated", so the
 * benchmark leaves them out of the server's own CPU, as it does the Python floor's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* libzmq 4.x, the part of its stable C API used here (zmq.h) */
typedef struct {
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
} zmq_msg_t;
typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} zmq_pollitem_t;
void *zmq_ctx_new(void);
void *zmq_socket(void *context, int type);
int zmq_setsockopt(void *socket, int option, const void *value, size_t size);
int zmq_bind(void *socket, const char *endpoint);
int zmq_msg_init(zmq_msg_t *msg);
int zmq_msg_recv(zmq_msg_t *msg, void *socket, int flags);
int zmq_msg_close(zmq_msg_t *msg);
void *zmq_msg_data(zmq_msg_t *msg);
size_t zmq_msg_size(const zmq_msg_t *msg);
int zmq_msg_more(const zmq_msg_t *msg);
int zmq_send(void *socket, const void *buf, size_t len, int flags);
int zmq_poll(zmq_pollitem_t *items, int nitems, long timeout);
int zmq_errno(void);
const char *zmq_strerror(int errnum);
enum { ZMQ_ROUTER = 6, ZMQ_SNDHWM = 23, ZMQ_RCVHWM = 24 };
enum { ZMQ_DONTWAIT = 1, ZMQ_SNDMORE = 2, ZMQ_POLLIN = 1 };

enum { SLOTS = 2, ENGINES = 2, PARTS = 4, SEGMENTS = 64 };

static void die(const char *what, const char *why) {
    fprintf(stderr, "native_floor: %s: %s\n", what, why);
    exit(1);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the GPU copy (libcuda's driver API, opened at run time) ---- */

static struct {
    int on;
    void *stream;
    unsigned long long device_image;
    int (*memcpy_htod_async)(unsigned long long, const void *, size_t, void *);
    int (*host_register)(void *, size_t, unsigned int);
} gpu;

static void *cu_symbol(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    if (fn == NULL) die("libcuda has no symbol", name);
    return fn;
}

static void cu_check(int status, const char *call) {
    if (status != 0) {
        char code[32];
        snprintf(code, sizeof code, "CUresult %d", status);
        die(call, code);
    }
}

static void gpu_open(size_t frame_bytes) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) die("dlopen libcuda.so.1", dlerror());
    int device = 0;
    void *context = NULL;
    cu_check(((int (*)(unsigned))cu_symbol(lib, "cuInit"))(0), "cuInit");
    cu_check(((int (*)(int *, int))cu_symbol(lib, "cuDeviceGet"))(&device, 0), "cuDeviceGet");
    cu_check(((int (*)(void **, int))cu_symbol(lib, "cuDevicePrimaryCtxRetain"))(&context, device),
             "cuDevicePrimaryCtxRetain");
    cu_check(((int (*)(void *))cu_symbol(lib, "cuCtxSetCurrent"))(context), "cuCtxSetCurrent");
    /* CU_STREAM_NON_BLOCKING */
    cu_check(((int (*)(void **, unsigned))cu_symbol(lib, "cuStreamCreate"))(&gpu.stream, 1),
             "cuStreamCreate");
    cu_check(((int (*)(unsigned long long *, size_t))cu_symbol(lib, "cuMemAlloc_v2"))(
                 &gpu.device_image, frame_bytes),
             "cuMemAlloc");
    gpu.memcpy_htod_async = cu_symbol(lib, "cuMemcpyHtoDAsync_v2");
    gpu.host_register = cu_symbol(lib, "cuMemHostRegister_v2");
    gpu.on = 1;
}

/* ---- the request header: the few msgpack fields the floor reads ---- */

typedef struct {
    const uint8_t *p, *end;
    int bad;
} reader;

static int take(reader *r, size_t n) {
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = 1;
        return 0;
    }
    return 1;
}

static uint64_t big_endian(reader *r, int n) {
    uint64_t v = 0;
    if (!take(r, (size_t)n)) return 0;
    for (int i = 0; i < n; i++) v = v << 8 | r->p[i];
    r->p += n;
    return v;
}

/* The length that follows a str/bin/array/map tag of 1, 2 or 4 bytes. */
static uint64_t length(reader *r, uint8_t tag, uint8_t first) {
    return big_endian(r, 1 << (tag - first));
}

static void skip(reader *r, int depth);

static void skip_n(reader *r, uint64_t items, int depth) {
    for (uint64_t i = 0; i < items && !r->bad; i++) skip(r, depth);
}

/* Skip one msgpack value of any type (nesting bounded, as dlad's decoder bounds it). */
static void skip(reader *r, int depth) {
    if (depth > 8 || !take(r, 1)) {
        r->bad = 1;
        return;
    }
    uint8_t t = *r->p++;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return;
    uint64_t n, items = 0;
    if ((t & 0xf0) == 0x80) items = 2 * (uint64_t)(t & 0x0f);
    else if ((t & 0xf0) == 0x90) items = t & 0x0f;
    else if (t == 0xdc || t == 0xdd) items = length(r, t, 0xdb);      /* array 16/32 */
    else if (t == 0xde || t == 0xdf) items = 2 * length(r, t, 0xdd);  /* map 16/32 */
    if ((t & 0xe0) == 0x80 || (t >= 0xdc && t <= 0xdf)) {
        skip_n(r, items, depth + 1);
        return;
    }
    if ((t & 0xe0) == 0xa0) n = t & 0x1f;
    else if (t >= 0xc4 && t <= 0xc6) n = length(r, t, 0xc4);                 /* bin 8/16/32 */
    else if (t >= 0xd9 && t <= 0xdb) n = length(r, t, 0xd9);                 /* str 8/16/32 */
    else if (t >= 0xc7 && t <= 0xc9) n = length(r, t, 0xc7) + 1;             /* ext 8/16/32 */
    else if (t >= 0xd4 && t <= 0xd8) n = 1 + ((uint64_t)1 << (t - 0xd4));    /* fixext */
    else if (t == 0xca || t == 0xcb) n = t == 0xca ? 4 : 8;                  /* float */
    else if (t >= 0xcc && t <= 0xcf) n = (uint64_t)1 << (t - 0xcc);          /* uint */
    else if (t >= 0xd0 && t <= 0xd3) n = (uint64_t)1 << (t - 0xd0);          /* int */
    else {
        r->bad = 1;
        return;
    }
    if (take(r, n)) r->p += n;
}

static uint64_t read_uint(reader *r) {
    if (!take(r, 1)) return 0;
    uint8_t t = *r->p++;
    if (t <= 0x7f) return t;
    if (t >= 0xcc && t <= 0xcf) return big_endian(r, 1 << (t - 0xcc));
    r->bad = 1;
    return 0;
}

/* A str value: its bytes and length; 0 if the value is not a str. */
static int read_str(reader *r, const char **s, uint64_t *n) {
    if (!take(r, 1)) return 0;
    uint8_t t = *r->p++;
    if ((t & 0xe0) == 0xa0) *n = t & 0x1f;
    else if (t >= 0xd9 && t <= 0xdb) *n = length(r, t, 0xd9);
    else {
        r->bad = 1;
        return 0;
    }
    if (!take(r, *n)) return 0;
    *s = (const char *)r->p;
    r->p += *n;
    return 1;
}

static uint64_t read_map(reader *r) {
    if (!take(r, 1)) return 0;
    uint8_t t = *r->p++;
    if ((t & 0xf0) == 0x80) return t & 0x0f;
    if (t == 0xde || t == 0xdf) return length(r, t, 0xdd);
    r->bad = 1;
    return 0;
}

static int key_is(const char *s, uint64_t n, const char *key) {
    return n == strlen(key) && memcmp(s, key, n) == 0;
}

typedef struct {
    uint64_t id, offset, height, width;
    int shm;
    char name[256];
} header;

/* The header's id, and for a frame in a slot its segment, offset and geometry; 0 if unreadable. */
static int parse_header(const uint8_t *data, size_t size, header *h) {
    reader r = {data, data + size, 0};
    memset(h, 0, sizeof *h);
    for (uint64_t i = read_map(&r); i > 0 && !r.bad; i--) {
        const char *key, *s;
        uint64_t n, len;
        if (!read_str(&r, &key, &n)) break;
        if (key_is(key, n, "id")) {
            h->id = read_uint(&r);
        } else if (key_is(key, n, "shm") || key_is(key, n, "image")) {
            int shm = key_is(key, n, "shm");
            h->shm |= shm;
            for (uint64_t j = read_map(&r); j > 0 && !r.bad; j--) {
                if (!read_str(&r, &s, &len)) break;
                if (shm && key_is(s, len, "name")) {
                    const char *name;
                    uint64_t name_len;
                    if (read_str(&r, &name, &name_len) && name_len < sizeof h->name)
                        memcpy(h->name, name, name_len);
                } else if (shm && key_is(s, len, "offset")) {
                    h->offset = read_uint(&r);
                } else if (!shm && key_is(s, len, "height")) {
                    h->height = read_uint(&r);
                } else if (!shm && key_is(s, len, "width")) {
                    h->width = read_uint(&r);
                } else {
                    skip(&r, 1);
                }
            }
        } else {
            skip(&r, 0);
        }
    }
    return !r.bad;
}

/* ---- the reply header, msgpack written directly ---- */

typedef struct {
    uint8_t b[512];
    size_t n;
} writer;

static void put(writer *w, const void *p, size_t n) {
    memcpy(w->b + w->n, p, n);
    w->n += n;
}

static void put_str(writer *w, const char *s) {
    size_t n = strlen(s); /* every string here is under 32 bytes: a fixstr */
    uint8_t tag = (uint8_t)(0xa0 | n);
    put(w, &tag, 1);
    put(w, s, n);
}

static void put_uint(writer *w, uint64_t v) {
    if (v <= 0x7f) {
        uint8_t b = (uint8_t)v;
        put(w, &b, 1);
        return;
    }
    uint8_t b[9] = {0xcf};
    for (int i = 0; i < 8; i++) b[1 + i] = (uint8_t)(v >> (56 - 8 * i));
    put(w, b, sizeof b);
}

static void put_map(writer *w, unsigned items) {
    uint8_t tag = (uint8_t)(0x80 | items);
    put(w, &tag, 1);
}

/* ---- tasks and engines ---- */

typedef struct task {
    zmq_msg_t part[PARTS];
    int parts;
    uint64_t id;
    int64_t came, start, end;
    struct engine *engine;
    struct task *next;
} task;

typedef struct {
    task *head, *tail;
} fifo;

static void push(fifo *q, task *t) {
    t->next = NULL;
    if (q->tail) q->tail->next = t;
    else q->head = t;
    q->tail = t;
}

static task *pop(fifo *q) {
    task *t = q->head;
    if (t) {
        q->head = t->next;
        if (!q->head) q->tail = NULL;
    }
    return t;
}

typedef struct engine {
    pthread_t thread;
    char name[16];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    fifo tasks;
    int busy; /* read and written by the polling thread only */
    int64_t free_at;
} engine;

static int64_t latency_ns;
static int done_fd;
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;
static fifo done;

static void *engine_run(void *arg) {
    engine *e = arg;
    pthread_setname_np(pthread_self(), e->name);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->tasks.head) pthread_cond_wait(&e->cv, &e->mu);
        task *t = pop(&e->tasks);
        pthread_mutex_unlock(&e->mu);
        int64_t now = now_ns();
        t->start = now > e->free_at ? now : e->free_at;
        t->end = e->free_at = t->start + latency_ns;
        struct timespec until = {(time_t)(t->end / 1000000000), (long)(t->end % 1000000000)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
        }
        pthread_mutex_lock(&done_mu);
        push(&done, t);
        pthread_mutex_unlock(&done_mu);
        uint64_t one = 1;
        if (write(done_fd, &one, sizeof one) != sizeof one) die("write", "eventfd");
    }
    return NULL;
}

static void submit(engine *e, task *t) {
    e->busy++;
    t->engine = e;
    pthread_mutex_lock(&e->mu);
    push(&e->tasks, t);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* ---- shared-memory segments, mapped on first use and kept ---- */

static struct {
    char key[512]; /* the client's identity, a NUL, the segment's name */
    size_t key_len;
    const uint8_t *base;
    size_t size;
} segments[SEGMENTS];
static int n_segments;

static const uint8_t *segment(const void *ident, size_t ident_len, const char *name, size_t *size) {
    char key[512];
    size_t name_len = strlen(name);
    if (ident_len + 1 + name_len > sizeof key) return NULL;
    memcpy(key, ident, ident_len);
    key[ident_len] = 0;
    memcpy(key + ident_len + 1, name, name_len);
    size_t key_len = ident_len + 1 + name_len;
    for (int i = 0; i < n_segments; i++)
        if (segments[i].key_len == key_len && memcmp(segments[i].key, key, key_len) == 0) {
            *size = segments[i].size;
            return segments[i].base;
        }
    if (n_segments == SEGMENTS) return NULL;
    char path[300];
    snprintf(path, sizeof path, "/dev/shm/%s", name);
    int fd = open(path, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) return NULL;
    struct stat st;
    void *base = fstat(fd, &st) == 0 && st.st_size > 0
                     ? mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0)
                     : MAP_FAILED;
    close(fd);
    if (base == MAP_FAILED) return NULL;
    if (gpu.on) /* DEVICEMAP | READ_ONLY | PORTABLE */
        cu_check(gpu.host_register(base, (size_t)st.st_size, 0x2 | 0x8 | 0x1), "cuMemHostRegister");
    memcpy(segments[n_segments].key, key, key_len);
    segments[n_segments].key_len = key_len;
    segments[n_segments].base = base;
    segments[n_segments].size = *size = (size_t)st.st_size;
    return segments[n_segments++].base;
}

/* ---- the polling thread ---- */

static void *router;
static engine engines[ENGINES];
static fifo queued;
static unsigned version, reply_kind, ok_status;

static void release(task *t) {
    for (int i = 0; i < t->parts; i++) zmq_msg_close(&t->part[i]);
    free(t);
}

static void reply(task *t) {
    static const char *const zero[] = {"queue_us", "pre_us", "post_us"};
    writer w = {.n = 0};
    int64_t now = now_ns();
    put_map(&w, 8);
    put_str(&w, "v"), put_uint(&w, version);
    put_str(&w, "kind"), put_uint(&w, reply_kind);
    put_str(&w, "id"), put_uint(&w, t->id);
    put_str(&w, "status"), put_uint(&w, ok_status);
    put_str(&w, "message"), put_str(&w, "");
    char device[5] = {0}; /* the engine's name to its first four characters, "nfl0" */
    memcpy(device, t->engine->name, 4);
    put_str(&w, "device"), put_str(&w, device);
    put_str(&w, "timing"), put_map(&w, 7);
    for (int i = 0; i < 3; i++) put_str(&w, zero[i]), put_uint(&w, 0);
    put_str(&w, "device_us"), put_uint(&w, (uint64_t)(t->end - t->start) / 1000);
    put_str(&w, "total_us"), put_uint(&w, (uint64_t)(now - t->came) / 1000);
    put_str(&w, "start_ns"), put_uint(&w, (uint64_t)t->start);
    put_str(&w, "end_ns"), put_uint(&w, (uint64_t)t->end);
    put_str(&w, "count"), put_uint(&w, 0);
    /* ROUTER drops what it cannot route, and a full pipe drops too (as the Python floor's
     * NOBLOCK sends would raise): the client's in-flight count keeps this from happening. */
    zmq_send(router, zmq_msg_data(&t->part[0]), zmq_msg_size(&t->part[0]),
             ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(router, w.b, w.n, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(router, "", 0, ZMQ_DONTWAIT);
}

static void dispatch(task *t) {
    engine *e = &engines[0];
    for (int i = 1; i < ENGINES; i++)
        if (engines[i].busy < e->busy) e = &engines[i];
    if (e->busy < SLOTS) submit(e, t);
    else push(&queued, t);
}

/* Every whole message waiting on the socket; 0 once "stop" came. */
static int receive(void) {
    for (;;) {
        task *t = calloc(1, sizeof *t);
        zmq_msg_t extra;
        int more = 1;
        if (t == NULL) die("calloc", "out of memory");
        while (more) {
            zmq_msg_t *m = t->parts < PARTS ? &t->part[t->parts] : &extra;
            zmq_msg_init(m);
            if (zmq_msg_recv(m, router, ZMQ_DONTWAIT) < 0) {
                int err = zmq_errno();
                zmq_msg_close(m);
                release(t);
                if (err == EAGAIN) return 1;
                die("zmq_msg_recv", zmq_strerror(err));
            }
            more = zmq_msg_more(m);
            if (m == &extra) zmq_msg_close(m);
            else t->parts++;
        }
        if (t->parts < 2) {
            release(t);
            continue;
        }
        const uint8_t *head = zmq_msg_data(&t->part[1]);
        size_t head_size = zmq_msg_size(&t->part[1]);
        if (t->parts == 2 && head_size == 4 && memcmp(head, "stop", 4) == 0) {
            release(t);
            return 0;
        }
        header h;
        if (!parse_header(head, head_size, &h)) {
            release(t);
            continue;
        }
        const void *image = zmq_msg_data(&t->part[t->parts - 1]);
        size_t nbytes = zmq_msg_size(&t->part[t->parts - 1]);
        if (h.shm) {
            size_t size = 0;
            const uint8_t *base = segment(zmq_msg_data(&t->part[0]), zmq_msg_size(&t->part[0]),
                                          h.name, &size);
            nbytes = h.height * h.width * 3;
            image = base != NULL && h.offset + nbytes <= size ? base + h.offset : NULL;
        }
        if (gpu.on && image != NULL)
            cu_check(gpu.memcpy_htod_async(gpu.device_image, image, nbytes, gpu.stream),
                     "cuMemcpyHtoDAsync");
        t->id = h.id;
        t->came = now_ns();
        dispatch(t);
    }
}

static void complete(void) {
    uint64_t count;
    if (read(done_fd, &count, sizeof count) != sizeof count) die("read", "eventfd");
    pthread_mutex_lock(&done_mu);
    fifo finished = done;
    done.head = done.tail = NULL;
    pthread_mutex_unlock(&done_mu);
    for (task *t = pop(&finished); t != NULL; t = pop(&finished)) {
        engine *e = t->engine;
        reply(t);
        release(t);
        e->busy--;
        task *next = pop(&queued);
        if (next) submit(e, next);
    }
}

int main(int argc, char **argv) {
    if (argc < 6 || argc > 7 || (argc == 7 && strcmp(argv[6], "gpu") != 0)) {
        fprintf(stderr, "usage: native_floor ENDPOINT LATENCY_US VERSION REPLY_KIND OK_STATUS [gpu]\n");
        return 2;
    }
    latency_ns = (int64_t)(atof(argv[2]) * 1e3);
    version = (unsigned)atoi(argv[3]);
    reply_kind = (unsigned)atoi(argv[4]);
    ok_status = (unsigned)atoi(argv[5]);
    if (argc == 7) gpu_open(672 * 672 * 3);
    void *ctx = zmq_ctx_new();
    router = zmq_socket(ctx, ZMQ_ROUTER);
    int hwm = 1000;
    zmq_setsockopt(router, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(router, ZMQ_RCVHWM, &hwm, sizeof hwm);
    if (zmq_bind(router, argv[1]) != 0) die("zmq_bind", zmq_strerror(zmq_errno()));
    done_fd = eventfd(0, EFD_CLOEXEC);
    if (done_fd < 0) die("eventfd", strerror(errno));
    for (int i = 0; i < ENGINES; i++) {
        engine *e = &engines[i];
        snprintf(e->name, sizeof e->name, "nfl%d-emulated", i);
        pthread_mutex_init(&e->mu, NULL);
        pthread_cond_init(&e->cv, NULL);
        if (pthread_create(&e->thread, NULL, engine_run, e) != 0) die("pthread_create", "engine");
    }
    printf("ready\n");
    fflush(stdout);
    zmq_pollitem_t items[2] = {{router, 0, ZMQ_POLLIN, 0}, {NULL, done_fd, ZMQ_POLLIN, 0}};
    for (;;) {
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR) continue;
            die("zmq_poll", zmq_strerror(zmq_errno()));
        }
        if (items[1].revents & ZMQ_POLLIN) complete();
        if ((items[0].revents & ZMQ_POLLIN) && !receive()) break;
    }
    _exit(0); /* the engines sleep in their tasks; nothing of theirs needs to outlive this */
}
