// See gpu_chain.hpp.
#include "gpu_chain.hpp"

#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace dlad::plane {
namespace {

constexpr int kSortCapacity = 8192;  // prepost.SORT_CAPACITY: GpuPipeline.post's default
constexpr int kNmsRounds = 24;       // GpuPipeline.post's default
constexpr int kPadValue = 114;       // GpuPipeline.pre's default
constexpr int kRowAlignBytes = 64;   // dlad.imaging.pre.HWC4_ROW_ALIGN_BYTES

}  // namespace

std::string call_failed(const char* call, int code) {
    return std::string(call) + " failed (" + std::to_string(code) + ")";
}

std::mutex& host_tags_mu() {
    static std::mutex mu;
    return mu;
}

std::string make_current(const CudaApi& cuda, void* context) {
    // the plane's thread, or a caller's once it has ended: the device's context current there
    static thread_local void* current = nullptr;
    if (current == context) return "";
    if (int r = cuda.ctx_set_current(context)) return call_failed("cuCtxSetCurrent", r);
    current = context;
    return "";
}

Frame frame_of(const Work& work) {
    const Image& image = work.image;
    Frame f;
    f.height = static_cast<int>(image.height);
    f.width = static_cast<int>(image.width);
    f.format = image.format;
    f.colour = image.colour;
    // the plane resolved the model's settings where the INFER set none (Plane::work_of)
    f.conf = image.conf.value_or(-1);
    f.iou = image.iou.value_or(-1);
    f.max_det = static_cast<int>(image.max_det.value_or(-1));
    f.host = work.host;
    f.device = work.device;
    return f;
}

std::string refusal(const GpuSpec& spec, const Frame& frame) {
    if (frame.conf < 0 || frame.iou < 0 || frame.max_det < 0) {
        return "the frame's settings were not resolved";
    }
    if (frame.host == nullptr) return "the frame's pixels are not where the GPU can read them";
    if (frame.max_det > spec.max_det) {
        return "max_det " + std::to_string(frame.max_det) + " is above the GPU's " +
               std::to_string(spec.max_det);
    }
    return "";
}

std::string enqueue_pre(const CudaApi& cuda, const GpuSpec& spec, GpuSlot& slot,
                        const Frame& frame, NvSciSyncFence* pre_fence) {
    std::string error = enqueue_pre_kernel(cuda, spec, slot, frame);
    if (!error.empty()) return error;
    const GpuSlotSpec& s = *slot.spec;
    // The ready signal (GpuSlot.chain_task): the word, or the semaphore (CudlaFenceLink)
    if (s.ready_semaphore != nullptr) {
        ExternalSemaphoreParams params;
        params.nvsci_fence = pre_fence;
        if (int r = cuda.signal_external(&s.ready_semaphore, &params, 1, s.stream)) {
            return call_failed("cuSignalExternalSemaphoresAsync", r);
        }
        return "";
    }
    const uint32_t ready = slot.ready + 1;
    if (int r = cuda.write_value32(s.stream, s.ready_device, ready, 0)) {
        return call_failed("cuStreamWriteValue32", r);
    }
    slot.ready = ready;
    return "";
}

std::string enqueue_pre_kernel(const CudaApi& cuda, const GpuSpec& spec, GpuSlot& slot,
                               const Frame& frame) {
    const GpuSlotSpec& s = *slot.spec;
    slot.waits = slot.hosted = false;
    const uint64_t bytes = rules::frame_bytes(frame.format, frame.height, frame.width);
    // The frame where the pre kernel reads it (GpuPipeline.stage / upload, or in place)
    uint64_t src = frame.device;
    if (src == 0) {
        if (bytes > s.image_bytes) {
            return "a frame of " + std::to_string(bytes) + " B exceeds the GPU's " +
                   std::to_string(s.image_bytes) + " B image buffer";
        }
        if (s.staging != nullptr) {
            std::memcpy(s.staging, frame.host, bytes);  // the previous frame is pre-processed
            src = s.staging_device;
        } else {
            if (int r = cuda.memcpy_htod_async(s.image, frame.host, bytes, s.stream)) {
                return call_failed("cuMemcpyHtoDAsync", r);
            }
            src = s.image;
        }
    }
    // GpuPipeline.pre
    const Letterbox g =
        rules::letterbox_geometry(frame.width, frame.height, spec.canvas_w, spec.canvas_h);
    slot.geometry = g;
    PreParams p{};
    p.src = reinterpret_cast<const void*>(src);
    p.dst = s.input;
    p.src_w = frame.width;
    p.src_h = frame.height;
    p.src_pitch = static_cast<int>(rules::row_bytes(frame.format, frame.width));
    p.src_fmt = frame.format;
    const rules::YuvCoefficients yuv = rules::yuv_coefficients(frame.colour);
    p.y_offset = yuv.y_offset;
    p.ky = yuv.ky;
    p.rv = yuv.rv;
    p.gu = yuv.gu;
    p.gv = yuv.gv;
    p.bu = yuv.bu;
    p.dst_w = g.dst_w;
    p.dst_h = g.dst_h;
    p.new_w = g.new_w;
    p.new_h = g.new_h;
    p.pad_x = g.pad_x;
    p.pad_y = g.pad_y;
    p.scale = static_cast<float>(g.scale);
    p.pad_value = kPadValue;
    int width = 0;
    if (spec.int8) {
        p.input_scale = spec.input_scale;
        const int align_px = kRowAlignBytes / 4;  // hwc4_layout(3, h, w, 1): C' = 4, int8
        p.dst_pitch_px = (g.dst_w + align_px - 1) / align_px * align_px;
        width = p.dst_pitch_px;
    } else {
        p.input_scale = 1.0f;
        p.dst_pitch_px = g.dst_w;
        width = g.dst_w;
    }
    void* args[] = {&p};
    const auto gx = static_cast<unsigned>((width + 31) / 32);
    const auto gy = static_cast<unsigned>((g.dst_h + 7) / 8);
    if (int r = cuda.launch_kernel(spec.pre_kernel, gx, gy, 1, 32, 8, 1, 0, s.stream, args,
                                   nullptr)) {
        return call_failed("cuLaunchKernel(pre)", r);
    }
    return "";
}

std::string enqueue_post(const CudaApi& cuda, GpuSlot& slot, const Frame& frame,
                         const NvSciSyncFence* eof, void (*fn)(void*), void* data) {
    const GpuSlotSpec& s = *slot.spec;
    if (s.done_semaphore != nullptr) {
        ExternalSemaphoreParams params;
        params.nvsci_fence = const_cast<NvSciSyncFence*>(eof);  // CUDA reads it at the call
        if (int r = cuda.wait_external(&s.done_semaphore, &params, 1, s.stream)) {
            return call_failed("cuWaitExternalSemaphoresAsync", r);
        }
    } else {
        if (int r = cuda.wait_value32(s.stream, s.done_device, slot.done, cuda.wait_geq)) {
            return call_failed("cuStreamWaitValue32", r);
        }
        slot.waits = true;
    }
    std::string error = enqueue_post_graph(cuda, slot, frame);
    if (!error.empty()) return error;
    if (int r = cuda.launch_host_func(s.stream, fn, data)) return call_failed("cuLaunchHostFunc", r);
    slot.hosted = true;
    return "";
}

std::string enqueue_post_graph(const CudaApi& cuda, GpuSlot& slot, const Frame& frame) {
    const GpuSlotSpec& s = *slot.spec;
    // GpuPipeline.post: the settings are copied only when they differ from the last frame's
    const Letterbox& g = slot.geometry;
    FrameParams f{};
    f.conf = static_cast<float>(frame.conf);
    f.obj_cut = rules::logit_cut(frame.conf);
    f.iou = static_cast<float>(frame.iou);
    f.max_det = frame.max_det;
    f.multi_label = 0;
    f.max_candidates = kSortCapacity;
    f.nms_rounds = kNmsRounds;
    const Geometry geo{g.scale, g.pad_x, g.pad_y, g.src_w, g.src_h};
    unsigned char settings[sizeof(FrameParams) + sizeof(Geometry)];
    std::memcpy(settings, &f, sizeof f);
    std::memcpy(settings + sizeof f, &geo, sizeof geo);
    const bool copy = !slot.copied || std::memcmp(settings, slot.settings, sizeof settings) != 0;
    if (copy) {
        std::memcpy(s.frame, settings, sizeof settings);  // the slot's last frame is done
        slot.copied = false;  // until the launch that copies them is queued
    }
    if (int r = cuda.graph_launch(copy ? s.post_copy : s.post_reuse, s.stream)) {
        return call_failed("cuGraphLaunch", r);
    }
    if (copy) {
        std::memcpy(slot.settings, settings, sizeof settings);
        slot.copied = true;
    }
    return "";
}

Detections read_detections(const GpuSlot& slot, int max_det) {
    const float* rec = slot.spec->out;
    Detections d;
    d.overflow = rec[2] != 0.0f;
    const float kept = rec[0];
    d.valid = kept >= 0 && kept <= static_cast<float>(max_det) && std::floor(kept) == kept;
    d.count = d.valid ? static_cast<int64_t>(kept) : 0;
    d.rows = rec + 4;
    return d;
}

}  // namespace dlad::plane
