// The one interface between the plane and the engines that run its frames (docs/daemon.md,
// "Engines").
//
// The plane takes a batch of jobs (one for an engine that does not batch) off the scheduler
// while the engine has a free slot, and starts it; the engine reports what happened as one or
// more Finished, on any thread, through the callback it was built with. The plane answers every
// job a Finished names (its detections, or the failure), and counts a slot free when a Finished
// says so. An engine never answers a client and holds no job's place: it only runs frames.
//
// Implementations: TimingEngine (an emulated DLA core in timing mode, plane.hpp), CudlaEngine (a
// real DLA core, cudla_engine.hpp), ChainEngine (either core with GPU pre/post around each task,
// chain_engine.hpp) and PythonEngine (a Python callable on the engine's own threads, module.cpp:
// the numeric INT8 emulation, the emulated and torch GPUs, numpy pre/post).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpu_chain.hpp"

namespace dlad::plane {

// The shape and settings of a frame (none: the model's defaults).
struct Image {
    int64_t height = 0, width = 0;
    int format = 0;  // a rules::PixelFormat
    int colour = 0;  // a YUV frame's (rules::kBt709, rules::kFullRange)
    std::optional<double> conf, iou;
    std::optional<int64_t> max_det;
};

// One job of a batch, as an engine reads it (its image's settings resolved: the model's where
// the INFER set none): its pixels where the CPU reads them (``host``;
// null where the plane has none, for an engine that reads no pixels) and, for a frame in a
// shared-memory segment registered with the GPU, where the GPU does (``device``, else 0); and
// what keeps those pixels alive until the engine is done with them (a job may be answered, at
// the drain's end, while its task still runs).
struct Work {
    int64_t job = 0;
    Image image;
    const uint8_t* host = nullptr;
    uint64_t device = 0;
    std::shared_ptr<const void> keep;
};

// Why a job failed, for the plane's counters and words.
enum class Failure {
    none = 0,
    device,  // the engine's task failed or was refused (DEVICE_FAILED; counts for its health)
    gpu,     // its GPU chain could not be queued: the message names the call that failed
             // (DEVICE_FAILED; and the plane's gpu_errors)
    hung,    // the task did not end within the engine's timeout (DEVICE_FAILED; a hang)
    internal,  // a fault of the daemon's, not the device's (INTERNAL)
};

// One job's result from an engine that makes detections (pre/post on).
struct JobResult {
    Failure failure = Failure::none;
    std::string message;     // the failure's words
    std::string detections;  // N x 6 float32 rows (x1, y1, x2, y2, score, class)
    std::optional<uint64_t> pre_us, post_us;  // the frame's pre- and post-processing, if timed
};

// What an engine reports. ``jobs`` may be empty (a slot freed after its jobs were answered).
struct Finished {
    std::vector<int64_t> jobs;
    int64_t start_ns = 0, end_ns = 0;  // the device's span of the batch (0, 0: it never ran)
    Failure failure = Failure::none;    // the whole batch's, with ``message``
    std::string message;
    // per job, in ``jobs``' order (empty: the engine makes no detections; a job's own failure
    // is its result's)
    std::vector<JobResult> results;
    bool frees = true;  // the batch's slot is free again
    // CPU the engine's own threads spent on the batch (a Python engine's call: the
    // interpreter's time); 0 for an engine whose host work is the plane's thread's
    int64_t host_ns = 0;
};

using OnFinished = std::function<void(Finished)>;

class Engine {
  public:
    virtual ~Engine() = default;  // stops the engine; each implementation says what it waits for
    Engine() = default;
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // How many batches may be in flight at once.
    virtual int64_t slots() const = 0;
    // The most jobs a batch holds (1: it does not batch).
    virtual int64_t max_batch() const { return 1; }
    // Start ``batch`` (1 to max_batch() jobs; the plane keeps fewer than slots() in flight).
    // Called on the plane's thread; returns at once. Every outcome, a refusal included, comes
    // as a Finished, possibly before start() returns.
    virtual void start(std::vector<Work> batch) = 0;
};

// ``work`` as a GPU chain reads it: its shape, pixels and settings (gpu_chain.cpp).
Frame frame_of(const Work& work);
// Why the GPU cannot pre-process ``frame`` (its pixels are not where the CPU reads them, it
// asks for more detections than the GPU stores, its settings are unresolved), or "".
std::string refusal(const GpuSpec& spec, const Frame& frame);

// A batch that could not start: its jobs fail with ``why``, and its slot is free.
inline Finished refused(const std::vector<Work>& batch, Failure failure, std::string why) {
    Finished f;
    for (const Work& w : batch) f.jobs.push_back(w.job);
    f.failure = failure;
    f.message = std::move(why);
    return f;
}

}  // namespace dlad::plane
