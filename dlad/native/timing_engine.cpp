// See timing_engine.hpp.
#include "timing_engine.hpp"

#include "clock.hpp"

#include <pthread.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <optional>
#include <stdexcept>

namespace dlad::plane {

TimingEngine::TimingEngine(std::string name, double latency_us, int64_t slots,
                           OnFinished on_done, SharedDram* dram,
                           std::vector<std::string> patterns)
    : name_(std::move(name)),
      curve_ns_{static_cast<int64_t>(std::llround(latency_us * 1e3))},
      slots_(slots),
      on_done_(std::move(on_done)),
      dram_(dram),
      patterns_(std::move(patterns)),
      thread_([this] { run(); }) {}

namespace {
std::vector<int64_t> curve_of(const std::string& name, const std::vector<double>& curve_us) {
    if (curve_us.empty()) throw std::invalid_argument("device " + name + ": an empty batch curve");
    std::vector<int64_t> out;
    for (double us : curve_us) {
        if (!(us > 0)) throw std::invalid_argument("device " + name + ": a batch curve's times "
                                                   "must be positive");
        out.push_back(static_cast<int64_t>(std::llround(us * 1e3)));
    }
    return out;
}
}  // namespace

TimingEngine::TimingEngine(std::string name, std::vector<double> curve_us, int64_t slots,
                           OnFinished on_done, SharedDram* dram)
    : name_(std::move(name)),
      curve_ns_(curve_of(name_, curve_us)),
      kind_(EngineKind::gpu),
      slots_(slots),
      on_done_(std::move(on_done)),
      dram_(dram),
      thread_([this] { run(); }) {}

void TimingEngine::start(std::vector<Work> batch) {
    if (batch.empty() || batch.size() > curve_ns_.size()) {
        on_done_(refused(batch, Failure::internal,
                         "a batch of " + std::to_string(batch.size()) + " on " + name_));
        return;
    }
    const int64_t now = now_ns();
    Task task{{}, now, {}, {}, nullptr};
    for (const Work& w : batch) task.jobs.push_back(w.job);
    {
        std::lock_guard<std::mutex> lock(mu_);
        tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
}

TimingEngine::~TimingEngine() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    stopping_.store(true);
    cv_.notify_one();
    if (dram_ != nullptr) dram_->wake();  // a task waiting out its shared time sees the stop
    thread_.join();
}

void TimingEngine::submit(int64_t job, Fence wait, Fence signal,
                          const std::vector<uint8_t*>* outputs) {
    const int64_t now = now_ns();
    {
        std::lock_guard<std::mutex> lock(mu_);
        tasks_.push_back({{job}, now, wait, signal, outputs});
    }
    cv_.notify_one();
}

bool TimingEngine::wait_for(const Fence& wait, int64_t* reached_ns) {
    // The GPU writes the word into pinned host memory: polled every 10 µs (the thread's timer
    // slack is 1 µs), the stand-in for a DLA's semaphore wait in hardware
    const timespec pause{0, 10'000};
    while (!word_reached(__atomic_load_n(wait.word, __ATOMIC_ACQUIRE), wait.value)) {
        if (stopping_.load(std::memory_order_relaxed)) return false;
        nanosleep(&pause, nullptr);
    }
    *reached_ns = now_ns();
    return true;
}

void TimingEngine::run() {
    const std::string thread_name = (name_ + "-emulated").substr(0, 15);  // Linux's limit
    pthread_setname_np(pthread_self(), thread_name.c_str());
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    int64_t free_at = 0;  // when the core finishes its current task
    while (true) {
        Task task{};
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
            if (stop_) return;
            task = std::move(tasks_.front());
            tasks_.pop_front();
        }
        // Back to back, as a DLA runs: a task submitted while the one before ran starts the
        // moment that one ends (not when this thread has woken and come back for it), or
        // when its fence is reached, if later.
        int64_t ready = task.submitted_ns;
        if (task.wait.word != nullptr && !wait_for(task.wait, &ready)) return;
        const int64_t now = now_ns();
        const int64_t start = std::min(now, std::max({task.submitted_ns, free_at, ready}));
        const int64_t service_ns = curve_ns_[task.jobs.size() - 1];
        int64_t end = start + service_ns;
        if (dram_ != nullptr) {
            // The service time is the task's work alone; sharing the DRAM stretches it
            // (EmulatedDlaCore._execute): the work done before this thread got here is not
            // waited for again
            const int64_t transfer =
                dram_->begin(kind_, static_cast<double>(service_ns - (now - start)));
            const std::optional<int64_t> done = dram_->wait(transfer, stopping_);
            dram_->finish(transfer);
            if (!done) return;
            end = std::min(now_ns(), std::max(*done, start));
        } else {
            const timespec until{static_cast<time_t>(end / 1'000'000'000),
                                 static_cast<long>(end % 1'000'000'000)};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, nullptr) == EINTR) {
            }
        }
        free_at = end;
        if (task.outputs != nullptr) {  // EmulatedDlaCore's timing mode: the fixed pattern
            for (size_t i = 0; i < patterns_.size() && i < task.outputs->size(); ++i) {
                std::memcpy((*task.outputs)[i], patterns_[i].data(), patterns_[i].size());
            }
        }
        // the task's own span, not this thread's wake-up
        Finished f;
        f.jobs = task.jobs;
        f.start_ns = start;
        f.end_ns = end;
        on_done_(std::move(f));
        if (task.signal.word != nullptr) {  // after the span is reported: the chain's end reads it
            __atomic_store_n(task.signal.word, task.signal.value, __ATOMIC_RELEASE);
        }
    }
}

}  // namespace dlad::plane
