// The Orin's shared DRAM: the one model of how the emulated engines slow each other (the plane's
// timing cores and, through the binding, the Python engines' emulated devices: one instance per
// daemon; dlad/devices/dram.py has the calibration and the Python side). Each running task has
// work (its time alone) and progresses at 1 / slowdown, where
//     slowdown(victim) = 1 + contention * sum(K[victim kind, other kind] for each other task),
// re-rated whenever a task begins or ends; a waiting engine thread is woken to re-project its end.
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
    // When it ends if the running set stays as it is (now, where its work is done).
    int64_t end_ns(int64_t id);
    // When its work runs out if the running set stays as it is (in the past where it has).
    int64_t done_ns(int64_t id);
    // Sleep until its work is done (``*done_at``: when, as projected), the clock passes
    // ``deadline_ns``, or wake() has been called since wakes() read ``since`` (the caller reads
    // it before it checks what wake() announces). A task no longer running is done now.
    enum class Waited { done, expired, woken };
    Waited wait_for(int64_t id, std::optional<int64_t> deadline_ns, uint64_t since,
                    int64_t* done_at);
    uint64_t wakes();
    // Sleep until its work is done (when it was done, as projected), or ``stop`` is true
    // (checked whenever wake() is called: nullopt). The real clock only.
    std::optional<int64_t> wait(int64_t id, const std::atomic<bool>& stop);
    void wake();
    // The slowdown the task runs at now.
    double slowdown(int64_t id);
    double contention() const { return contention_; }
    const Coefficients& k() const { return k_; }

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
    uint64_t wakes_ = 0;  // wake() calls so far
};

}  // namespace dlad::plane
