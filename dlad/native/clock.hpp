// The plane's one clock: CLOCK_MONOTONIC in nanoseconds, the clock of Python's
// time.monotonic_ns, so that the plane's times and the daemon's compare.
#pragma once

#include <cstdint>
#include <ctime>

namespace dlad::plane {

inline int64_t now_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// CPU time the calling thread has used (CLOCK_THREAD_CPUTIME_ID): what a frame costs the host.
inline int64_t thread_cpu_ns() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace dlad::plane
