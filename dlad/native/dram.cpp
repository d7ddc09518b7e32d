// See dram.hpp.
#include "dram.hpp"

#include "clock.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <stdexcept>
#include <string>

namespace dlad::plane {
SharedDram::SharedDram(double contention, const Coefficients& k, std::function<int64_t()> clock)
    : contention_(contention), k_(k), clock_(clock ? std::move(clock) : now_ns) {
    if (!(contention >= 0.0 && contention <= 10.0)) {
        throw std::invalid_argument("contention must be in [0, 10], got " +
                                    std::to_string(contention));
    }
    last_ns_ = clock_();
}

int64_t SharedDram::begin(EngineKind kind, double work_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    advance();
    const int64_t id = next_++;
    running_.emplace(id, Transfer{kind, std::max(work_ns, 0.0)});
    rerate();
    return id;
}

void SharedDram::finish(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_.erase(id) == 0) return;
    advance();
    rerate();
}

int64_t SharedDram::end_ns(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    const Transfer& t = running_.at(id);
    const int64_t now = clock_();
    const double left = t.left_ns - static_cast<double>(now - last_ns_) / t.slowdown;
    return now + std::max<int64_t>(std::llround(left * t.slowdown), 0);
}

int64_t SharedDram::done_ns(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    const Transfer& t = running_.at(id);
    const int64_t now = clock_();
    const double left = t.left_ns - static_cast<double>(now - last_ns_) / t.slowdown;
    return std::llround(static_cast<double>(now) + left * t.slowdown);
}

uint64_t SharedDram::wakes() {
    std::lock_guard<std::mutex> lock(mu_);
    return wakes_;
}

SharedDram::Waited SharedDram::wait_for(int64_t id, std::optional<int64_t> deadline_ns,
                                        uint64_t since, int64_t* done_at) {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
        if (wakes_ != since) return Waited::woken;
        const int64_t now = clock_();
        const auto it = running_.find(id);
        if (it == running_.end()) {
            *done_at = now;
            return Waited::done;
        }
        const Transfer& t = it->second;
        const double left = t.left_ns - static_cast<double>(now - last_ns_) / t.slowdown;
        const double done = static_cast<double>(now) + left * t.slowdown;
        if (static_cast<double>(now) >= done) {  // the work ran out (a sleeper wakes late): when
            *done_at = std::llround(done);
            return Waited::done;
        }
        if (deadline_ns && now >= *deadline_ns) return Waited::expired;
        const double until = deadline_ns ? std::min(done, static_cast<double>(*deadline_ns)) : done;
        cv_.wait_for(lock, std::chrono::nanoseconds(
                               static_cast<int64_t>(std::ceil(until - static_cast<double>(now)))));
    }
}

double SharedDram::slowdown(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return running_.at(id).slowdown;
}

std::optional<int64_t> SharedDram::wait(int64_t id, const std::atomic<bool>& stop) {
    while (true) {
        const uint64_t since = wakes();  // read first: a wake() after it ends the wait below
        if (stop.load()) return std::nullopt;
        int64_t done_at = 0;
        if (wait_for(id, std::nullopt, since, &done_at) == Waited::done) return done_at;
    }
}

void SharedDram::wake() {
    std::lock_guard<std::mutex> lock(mu_);
    ++wakes_;
    cv_.notify_all();
}

void SharedDram::advance() {
    const int64_t now = clock_();
    const auto elapsed = static_cast<double>(now - last_ns_);
    for (auto& [id, t] : running_) t.left_ns = std::max(t.left_ns - elapsed / t.slowdown, 0.0);
    last_ns_ = now;
}

void SharedDram::rerate() {
    std::array<int, 2> kinds{0, 0};
    for (const auto& [id, t] : running_) ++kinds[static_cast<size_t>(t.kind)];
    for (auto& [id, t] : running_) {
        const auto v = static_cast<size_t>(t.kind);
        double sum = 0.0;
        for (size_t other = 0; other < 2; ++other) {
            const int n = kinds[other] - (other == v ? 1 : 0);  // the others, not itself
            sum += k_[v][other] * n;
        }
        t.slowdown = 1.0 + contention_ * sum;
    }
    cv_.notify_all();
}

}  // namespace dlad::plane
