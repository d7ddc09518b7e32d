// An emulated DLA core in timing mode, or the emulated Orin GPU in timing mode, as an engine of
// the plane (engine.hpp).
//
// Tasks run back to back, each ``latency_us`` long (the GPU's batches: the batch curve's time for
// their size, dlad/devices/emulated_gpu.py's), on a thread of its own named
// "<device>-emulated" (work a DLA does in silicon, which benchmarks leave out of the daemon's own
// CPU). A task may wait on a fence before it starts (the core polls the word, as a DLA's
// hardware waits on its semaphore), write the core's timing-mode ``patterns`` into its output
// buffers, and signal a fence when it ends (the GPU chain around it, chain_engine.hpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dram.hpp"
#include "engine.hpp"

namespace dlad::plane {

// A fence of an engine's task: a 32-bit word reaching a value (wrap-safe), the emulated form of
// the NvSciSync semaphore a DLA task waits on or signals.
struct Fence {
    uint32_t* word = nullptr;
    uint32_t value = 0;
};

class TimingEngine : public Engine {
  public:
    // ``dram``: the DRAM it shares with the other cores (their tasks running at once slow each
    // other), or null; it must outlive the engine. ``on_done`` gets each task's span on the
    // engine's thread, in order.
    TimingEngine(std::string name, double latency_us, int64_t slots, OnFinished on_done,
                 SharedDram* dram = nullptr, std::vector<std::string> patterns = {});
    // The emulated GPU: batches of 1 to ``curve_us.size()`` jobs, a batch of n taking
    // ``curve_us[n - 1]`` alone, sharing ``dram`` as a GPU. Throws std::invalid_argument for an
    // empty or non-positive curve.
    TimingEngine(std::string name, std::vector<double> curve_us, int64_t slots,
                 OnFinished on_done, SharedDram* dram);
    // Stops at once: a task still waiting or running is never reported.
    ~TimingEngine() override;

    int64_t slots() const override { return slots_; }
    int64_t max_batch() const override { return static_cast<int64_t>(curve_ns_.size()); }
    void start(std::vector<Work> batch) override;
    // ``outputs``: where the task writes the patterns (null: nowhere); it must outlive the
    // task. Its Finished is reported before ``signal`` is written.
    void submit(int64_t job, Fence wait = {}, Fence signal = {},
                const std::vector<uint8_t*>* outputs = nullptr);

  private:
    struct Task {
        std::vector<int64_t> jobs;
        int64_t submitted_ns;
        Fence wait, signal;
        const std::vector<uint8_t*>* outputs;
    };
    void run();
    // Sleep until ``wait`` is reached; its time (false: stopped meanwhile).
    bool wait_for(const Fence& wait, int64_t* reached_ns);

    std::string name_;
    std::vector<int64_t> curve_ns_;  // a task of n jobs: curve_ns_[n - 1]
    EngineKind kind_ = EngineKind::dla;  // what it is to the DRAM
    int64_t slots_;
    OnFinished on_done_;
    SharedDram* dram_;
    std::vector<std::string> patterns_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Task> tasks_;
    bool stop_ = false;
    std::atomic<bool> stopping_{false};
    std::thread thread_;
};

}  // namespace dlad::plane
