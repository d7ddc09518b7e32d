// The Orin's shared DRAM for the native plane's engines: dlad/devices/dram.py's SharedDram in C++
// (its docstring has the model and its calibration). Each running task has work (its time
// alone) and progresses at 1 / slowdown, where
//     slowdown(victim) = 1 + contention * sum(K[victim kind, other kind] for each other task),
// re-rated whenever a task begins or ends; a waiting engine thread is woken to re-project its end.
// tests/dlad/test_native_dram.py holds it to the Python model on generated sequences.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace dlad::plane {

enum class EngineKind { dla = 0, gpu = 1 };

class SharedDram {
  public:
    // k[victim][aggressor] at contention 1 (dram.py's ORIN_DRAM_K); ``clock``: monotonic ns,
    // the engines' own (CLOCK_MONOTONIC by default). Throws std::invalid_argument for a
    // contention outside [0, 10].
    using Coefficients = std::array<std::array<double, 2>, 2>;
    SharedDram(double contention, const Coefficients& k, std::function<int64_t()> clock = {});

    // Start a task of ``kind`` that takes ``work_ns`` alone; the others slow down. Its id.
    int64_t begin(EngineKind kind, double work_ns);
    // End it (done or abandoned); the others speed up. Idempotent.
    void finish(int64_t id);
    // When it ends if the running set stays as it is.
    int64_t end_ns(int64_t id);
    // Sleep until its work is done (when it was done, as projected), or ``stop`` is true
    // (checked whenever wake() is called: nullopt). The real clock only.
    std::optional<int64_t> wait(int64_t id, const std::atomic<bool>& stop);
    void wake();
    // The slowdown the task runs at now.
    double slowdown(int64_t id);

  private:
    struct Transfer {
        EngineKind kind;
        double left_ns;
        double slowdown = 1.0;
    };
    void advance();  // charge every running task the work it did since the last change
    void rerate();   // new slowdowns for the running set; wakes the waiters

    double contention_;
    Coefficients k_;
    std::function<int64_t()> clock_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::unordered_map<int64_t, Transfer> running_;
    int64_t next_ = 0;
    int64_t last_ns_ = 0;
};

}  // namespace dlad::plane
