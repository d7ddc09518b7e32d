// A DLA core with GPU pre/post-processing around each task, as one engine of the plane
// (engine.hpp; the chain itself is gpu_chain.hpp's).
//
// Per frame, on a free slot, start() queues the chain's first half on the slot's stream (the
// upload, the pre kernel, the ready signal), submits the core's task waiting on it, and queues
// the second half (the wait for the task, the post graph, a host function). The core is an
// emulated one in timing mode (its fences are 32-bit words the stream writes and waits on) or a
// real one through cuDLA (its fences are NvSciSync objects CUDA signals and waits on: recipe A).
//
// A slot is free once both its task has ended (on the core's thread) and its chain has (CUDA's
// host-function thread), which on a real DLA may come in either order; then the frame is
// reported with the detections its post graph left in the slot's pinned record. A failure is
// reported at once (a task that failed, a chain that could not be queued), the slot staying in
// use until what was queued has ended.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cudla_engine.hpp"
#include "dram.hpp"
#include "engine.hpp"
#include "gpu_chain.hpp"
#include "timing_engine.hpp"

namespace dlad::plane {

class ChainEngine : public Engine {
  public:
    // An emulated core of ``latency_us`` a task (sharing ``dram``, or null), or, where
    // ``cudla`` is set, a real one (``cudla_api`` its functions). Throws std::invalid_argument
    // for a spec that lacks what the chain needs.
    ChainEngine(std::string name, const CudaApi& cuda, const GpuSpec& gpu, double latency_us,
                SharedDram* dram, const CudlaApi& cudla_api, const std::optional<CudlaSpec>& cudla,
                OnFinished on_done);
    // Stops the core (a cuDLA core waits for its tasks), releases the streams of chains whose
    // emulated task never ended, and waits for their host functions (at most 10 s): after it,
    // nothing of the engine runs and the GPU's memory may be freed.
    ~ChainEngine() override;

    int64_t slots() const override { return static_cast<int64_t>(slots_.size()); }
    void start(std::vector<Work> batch) override;

  private:
    // What CUDA's host function gets: the engine (null once it has gone) and the slot
    struct Tag {
        ChainEngine* engine = nullptr;
        int64_t slot = 0;
    };
    struct Slot {
        GpuSlot state;
        int64_t job = -1;  // its frame (-1: free)
        int64_t started_ns = 0;
        int max_det = 0;
        std::shared_ptr<const void> keep;  // the frame's pixels, until the slot is free
        std::optional<Finished> task;      // the core's report of its task
        bool chain_ended = false;
        int64_t chain_end_ns = 0;
        bool answered = false;  // a failure was reported before the slot was free
        std::unique_ptr<Tag> tag;
    };

    void task_done(Finished task);  // the core's thread
    static void chain_ended(void* tag);  // CUDA's host-function thread
    // Under mu_, once a slot's task and chain have both ended: the frame's report (its
    // detections, unless answered already); the slot is free.
    Finished finish(int64_t index);
    int64_t slot_of(int64_t job) const;  // under mu_
    void release(int64_t index);  // under mu_: the slot is free

    std::string name_;
    CudaApi cuda_;
    GpuSpec gpu_;
    OnFinished on_done_;
    std::unique_ptr<TimingEngine> timing_;
    std::unique_ptr<CudlaEngine> cudla_;

    mutable std::mutex mu_;
    std::vector<Slot> slots_;
    std::vector<int64_t> free_;  // the first slot last: a lone frame always takes the same one
    int64_t chains_running_ = 0;  // chains queued whose host function has not run
    std::condition_variable chains_cv_;
};

}  // namespace dlad::plane
