// The GPU half of the native data plane: one frame's chain of CUDA work around a DLA task,
// queued from the plane's thread with the driver calls dlad/executors/dla.py makes
// (docs/daemon.md, "The native data plane"):
//
//     image (staged, uploaded, or read in place) ─▶ pre kernel ─▶ signal ready
//         ─▶ (the DLA task: waits for ready, runs, signals done) ─▶ wait for done
//         ─▶ post graph (decode, select, NMS, results into pinned host memory) ─▶ host function
//
// The fences are 32-bit words for an emulated core (cuStreamWriteValue32 / WaitValue32), and
// NvSciSync objects imported into CUDA as external semaphores for a cuDLA core (recipe A of
// docs/reference/cudla.md §4.7: CUDA fills the task's pre-fence when it queues the signal, and
// the stream waits on the task's EOF fence, which exists once the task is submitted). So the
// chain is queued in two halves, enqueue_pre before the task's submission and enqueue_post
// after it.
//
// Python builds everything the chain uses (dlad/gpu/service.py, GpuService.plane_slots): the
// context, the kernels, one CUDA stream per DLA slot with its pinned buffers, the fence words
// and the two post graphs (with and without the copy of the frame's settings). The plane gets
// their handles and the driver's functions by address (CudaApi), from the libcuda that Python
// loaded. Nothing here links against CUDA, so the plane builds and is tested on machines without
// it (tests/dlad/cuda/fake_cuda.c has the same ABI).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "frame_rules.hpp"

namespace dlad::plane {

// nvscisync.h's fence: 48 opaque bytes, all zero when cleared (NvSciSyncFenceInitializer).
struct NvSciSyncFence {
    uint64_t payload[6];
};

// cuda.h's CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS and _WAIT_PARAMS as the chain fills them (an
// NvSciSync semaphore: the fence pointer, flags 0; the rest zero). Both are 144 bytes, the
// fence pointer at 8.
struct ExternalSemaphoreParams {
    uint64_t fence_value = 0;
    void* nvsci_fence = nullptr;  // NvSciSyncFence*
    uint64_t keyed_mutex[2] = {};
    uint32_t reserved[10] = {};
    uint32_t flags = 0;
    uint32_t reserved2[16] = {};
    uint32_t pad = 0;
};
static_assert(sizeof(ExternalSemaphoreParams) == 144 &&
                  offsetof(ExternalSemaphoreParams, nvsci_fence) == 8 &&
                  offsetof(ExternalSemaphoreParams, flags) == 72,
              "cuda.h's external semaphore parameters");

// The CUDA driver API the chain calls (cuda.h's signatures, handles as void*, CUresult as int;
// 0 is CUDA_SUCCESS). All are required where a device has GPU pre/post.
struct CudaApi {
    int (*ctx_set_current)(void* ctx);                                        // cuCtxSetCurrent
    int (*memcpy_htod_async)(uint64_t dst, const void* src, size_t bytes, void* stream);
    int (*launch_kernel)(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned smem, void* stream, void** params,
                         void** extra);                                       // cuLaunchKernel
    int (*write_value32)(void* stream, uint64_t address, uint32_t value, unsigned flags);
    int (*wait_value32)(void* stream, uint64_t address, uint32_t value, unsigned flags);
    int (*graph_launch)(void* exec, void* stream);                            // cuGraphLaunch
    int (*launch_host_func)(void* stream, void (*fn)(void*), void* data);    // cuLaunchHostFunc
    unsigned wait_geq = 0;  // CU_STREAM_WAIT_VALUE_GEQ
    // cuSignalExternalSemaphoresAsync / cuWaitExternalSemaphoresAsync: a cuDLA core's chain
    int (*signal_external)(void* const* semaphores, const ExternalSemaphoreParams* params,
                           unsigned count, void* stream) = nullptr;
    int (*wait_external)(void* const* semaphores, const ExternalSemaphoreParams* params,
                         unsigned count, void* stream) = nullptr;

    bool complete() const {
        return ctx_set_current && memcpy_htod_async && launch_kernel && write_value32 &&
               wait_value32 && graph_launch && launch_host_func;
    }
    bool semaphores() const { return signal_external && wait_external; }
};

// One DLA slot's CUDA side (a GpuPipeline and the slot's fences; addresses as the GPU and the
// CPU see them: the same on an integrated GPU). The fences are the words (an emulated core's)
// or the two semaphores (a cuDLA core's).
struct GpuSlotSpec {
    void* stream = nullptr;
    uint64_t image = 0;           // device buffer of ``image_bytes`` for uploads (0: none)
    uint8_t* staging = nullptr;   // or pinned, device-mapped host memory the pre kernel reads
    uint64_t staging_device = 0;  // its device address
    uint64_t image_bytes = 0;     // the largest frame either takes
    uint64_t input = 0;           // the DLA input buffer the pre kernel writes
    uint32_t* ready = nullptr;    // the word the stream writes after pre (the DLA task waits)
    uint64_t ready_device = 0;
    uint32_t* done = nullptr;     // the word the DLA task writes (the stream waits)
    uint64_t done_device = 0;
    void* ready_semaphore = nullptr;  // CUDA's import of the NvSciSync object the stream signals
    void* done_semaphore = nullptr;   // and of the one the DLA task signals
    void* post_copy = nullptr;    // the post graph that first copies the frame's settings
    void* post_reuse = nullptr;   // the same graph without the copy
    uint8_t* frame = nullptr;     // pinned: FrameParams, then one Geometry (the settings)
    const float* out = nullptr;   // pinned: the result record (n, found, overflow, m, n x 6)
    // An emulated core's output buffers where the CPU writes them (its timing-mode pattern
    // goes there at each task's end; none for a cuDLA core, whose DLA writes them)
    std::vector<uint8_t*> outputs;
};

// A device's GPU pre/post: the model's kernel, canvas and defaults, and its slots.
struct GpuSpec {
    void* context = nullptr;
    void* pre_kernel = nullptr;  // pre_hwc4_i8 (int8 input) or pre_chw16_f16
    bool int8 = true;
    float input_scale = 1.0f;    // the int8 input's scale
    int canvas_h = 0;
    int canvas_w = 0;
    int max_det = 0;             // the pipelines' largest
    std::vector<GpuSlotSpec> slots;
    // What an emulated core in timing mode writes into each output (EmulatedDlaCore's
    // patterns: real-looking head logits), in the slots' ``outputs`` order
    std::vector<std::string> patterns;
};

using rules::Letterbox;

// kernels.cu's structs, field for field.
struct PreParams {
    const void* src;
    uint64_t dst;
    int src_w, src_h, src_pitch, src_fmt, y_offset, dst_w, dst_h, dst_pitch_px, new_w, new_h,
        pad_x, pad_y;
    float scale, input_scale;
    int pad_value;
    float ky, rv, gu, gv, bu;
};
struct FrameParams {
    float conf, obj_cut, iou;
    int max_det, multi_label, max_candidates, nms_rounds, reserved;
};
struct Geometry {
    double scale;
    int pad_x, pad_y, src_w, src_h;
};
static_assert(sizeof(PreParams) == 96 && sizeof(FrameParams) == 32 && sizeof(Geometry) == 24,
              "the kernels' structs");

// One frame for the chain: its pixels where the CPU reads them (``host``) and, for a frame in
// a segment registered with the GPU, where the GPU does (``device``, else 0).
struct Frame {
    const uint8_t* host = nullptr;
    uint64_t device = 0;
    int height = 0, width = 0;
    int format = 0;  // a rules::PixelFormat
    int colour = 0;  // a YUV frame's (rules::kBt709, rules::kFullRange)
    double conf = 0.25, iou = 0.45;
    int max_det = 300;
};

// A slot's chain state (the plane's thread alone touches it, one frame at a time).
struct GpuSlot {
    const GpuSlotSpec* spec = nullptr;
    uint32_t ready = 0;  // the last values written / waited for (the words)
    uint32_t done = 0;
    bool copied = false;  // the device holds ``settings``
    unsigned char settings[sizeof(FrameParams) + sizeof(Geometry)] = {};
    Letterbox geometry;   // the frame's, from enqueue_pre for enqueue_post
    bool waits = false;   // the stream waits on the ``done`` word (released by the DLA task)
    bool hosted = false;  // the host function is queued (the chain reports its end)
};

// Queue the first half of ``frame``'s chain on ``slot`` (the context current): the pixels
// where the pre kernel reads them, the kernel, and the ready signal: the word, the task then
// to wait for ``ready >= slot.ready``; or the ready semaphore, CUDA filling ``pre_fence`` with
// the fence the task is to wait on. Returns "" or the failed call with its result code.
std::string enqueue_pre(const CudaApi& cuda, const GpuSpec& spec, GpuSlot& slot,
                        const Frame& frame, NvSciSyncFence* pre_fence = nullptr);
// The first half without its signal: the pixels where the pre kernel reads them and the kernel,
// which writes ``slot.spec->input`` (a GPU engine's batch, whose stream orders the rest).
std::string enqueue_pre_kernel(const CudaApi& cuda, const GpuSpec& spec, GpuSlot& slot,
                               const Frame& frame);
// The second half, once the DLA task is submitted: the wait for it (the word ``done`` reaching
// ``slot.done``, the value the task writes; or ``eof``, its EOF fence), the post graph with the frame's
// settings, and ``fn(data)`` on CUDA's host-function thread. Returns "" or the failed call;
// ``slot.waits`` and ``slot.hosted`` then say how far it got.
std::string enqueue_post(const CudaApi& cuda, GpuSlot& slot, const Frame& frame,
                         const NvSciSyncFence* eof, void (*fn)(void*), void* data);

// The frame's post graph alone (its settings copied first where they differ from the slot's
// last frame's), on the slot's stream. Returns "" or the failed call.
std::string enqueue_post_graph(const CudaApi& cuda, GpuSlot& slot, const Frame& frame);
// "<call> failed (<code>)": a failed driver call in the chains' words.
std::string call_failed(const char* call, int code);

// The tags CUDA's host functions get name their engine (null once it has gone): this guards
// that pointer between CUDA's host-function thread and an engine going away.
std::mutex& host_tags_mu();
// An engine going away, after waiting for its host functions (``settled``: all ran): each
// slot's tag forgets the engine, and where a host function may still run, its tag is left to
// it (it outlives the engine).
template <typename Slots>
void detach_tags(Slots& slots, bool settled) {
    std::lock_guard<std::mutex> guard(host_tags_mu());
    for (auto& s : slots) {
        s.tag->engine = nullptr;
        if (!settled) static_cast<void>(s.tag.release());
    }
}

// Make ``context`` current on the calling thread (once per thread and context). Returns "" or
// the failed call.
std::string make_current(const CudaApi& cuda, void* context);

// The result record a finished chain left.
struct Detections {
    int64_t count = 0;
    const float* rows = nullptr;  // count x 6: x1, y1, x2, y2, score, class
    bool overflow = false;  // more candidates than the GPU stores: incomplete
    bool valid = false;     // the count is a whole number within the frame's max_det
};
Detections read_detections(const GpuSlot& slot, int max_det);

// Whether a 32-bit fence word has reached ``value`` (wrap-safe, as CU_STREAM_WAIT_VALUE_GEQ).
inline bool word_reached(uint32_t word, uint32_t value) {
    return static_cast<uint32_t>(word - value) < 0x80000000u;
}

}  // namespace dlad::plane
