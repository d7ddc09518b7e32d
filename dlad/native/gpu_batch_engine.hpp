// The GPU's inference as one engine of the plane (engine.hpp): dynamic batches, each frame
// pre-processed by the GPU chain's kernel into the model's static input, the model's CUDA
// graph for the batch's size, and each frame's post graph on its slice of the static heads,
// all queued by the plane's thread on one CUDA stream, with no interpreter anywhere
// (docs/daemon.md, "Engines").
//
// Python captures everything at start (dlad/gpu/service.py, GpuService.plane_batches): the
// torch engine's graphs, one per batch size, which read frame b of the input at ``input + b *
// frame bytes`` and write image b of each CHW16 head at ``head + b * image bytes``
// (dlad/devices/torch_gpu.py, its device-side I/O); and, per engine slot and frame of a
// batch, a GpuSlotSpec: the frame's image buffer, the input slice its pre kernel writes, the
// post graphs that read its head slices, its pinned settings and result record. Every
// GpuSlotSpec names the engine's one stream, so that CUDA's order on it is the only order:
// a batch's pre kernels, then the graph, then the post graphs, then the next batch's pre kernels
// (which overwrite the input only after the graph before them has read it).
//
//   slot s, frame b  (GpuSlotSpec s * max_batch + b)
//   pre kernel b ─▶ ... ─▶ graph[n] ─▶ post graph b ─▶ ... ─▶ host function (slot s ended)
//
// A batch's span is the stream's: from when it was queued or the batch before it ended,
// whichever is later, to its host function. A frame the GPU cannot take (pixels elsewhere,
// max_det above the GPU's) fails alone; a driver call that fails fails the batch, whose slot is
// free once what was queued has run.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.hpp"
#include "gpu_chain.hpp"

namespace dlad::plane {

class GpuBatchEngine : public Engine {
  public:
    // ``graphs[n - 1]``: the inference graph (a CUgraphExec) for a batch of n; ``gpu``: the
    // pre/post-processing, ``slots * graphs.size()`` GpuSlotSpecs (slot-major), all on one
    // stream. Throws std::invalid_argument for a spec that lacks any of it.
    GpuBatchEngine(std::string name, const CudaApi& cuda, const GpuSpec& gpu,
                   std::vector<void*> graphs, int64_t slots, OnFinished on_done);
    // Waits for the host functions of the batches queued (at most 10 s): after it, nothing of
    // the engine runs and the GPU's memory may be freed.
    ~GpuBatchEngine() override;

    int64_t slots() const override { return static_cast<int64_t>(slots_.size()); }
    int64_t max_batch() const override { return static_cast<int64_t>(graphs_.size()); }
    void start(std::vector<Work> batch) override;

  private:
    struct Tag {  // what CUDA's host function gets: the engine (null once gone), the slot
        GpuBatchEngine* engine = nullptr;
        int64_t slot = 0;
    };
    struct Member {  // a frame of the slot's batch
        int64_t job = -1;
        int max_det = 0;
        size_t image = 0;  // its GpuSlot among the slot's (frames the GPU refused have none)
        std::string refused;
    };
    struct Slot {
        std::vector<GpuSlot> images;  // max_batch() of them
        std::vector<Member> members;
        std::vector<std::shared_ptr<const void>> keep;  // the pixels, until the slot is free
        std::string failed;  // a driver call failed: every frame fails with it
        int64_t queued_ns = 0;
        bool busy = false;
        std::unique_ptr<Tag> tag;
    };

    static void ended(void* tag);  // CUDA's host-function thread
    // Under mu_: the batch's report (its slot not yet free), and the slot freed.
    Finished report(Slot& s, int64_t start_ns, int64_t end_ns);
    void release(Slot& s);

    std::string name_;
    CudaApi cuda_;
    GpuSpec gpu_;
    std::vector<void*> graphs_;
    OnFinished on_done_;
    void* stream_ = nullptr;

    std::mutex mu_;
    std::vector<Slot> slots_;
    std::vector<int64_t> free_;  // the first slot last
    int64_t last_end_ns_ = 0;    // when the stream's last batch ended
    int64_t running_ = 0;        // batches whose host function has not run
    std::condition_variable running_cv_;
};

}  // namespace dlad::plane
