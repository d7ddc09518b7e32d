// The shared-memory guard: a client may shrink (ftruncate) a segment the daemon has mapped,
// and reading a page the file no longer has raises SIGBUS, which would kill the daemon with
// every frame in it. The guard watches each mapped segment's address range; a SIGBUS inside
// one maps zero pages over the whole range (the read that faulted goes on, reading zeros) and
// marks the segment broken. Whoever answers a frame of a broken segment refuses it instead
// (the plane, Plane::answer), and the control plane drops the mapping
// (dlad/shm.py). libwayland-server guards its clients' wl_shm pools the same way.
//
// A SIGBUS outside every watched range goes to the handler that was there before (Python's
// faulthandler, or the default action: the process ends, as it would have).
//
// Async-signal safety: the table is a fixed array of atomics; the handler only reads it, calls
// mmap(2) (a system call) and stores a flag.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dlad::shm_guard {

inline constexpr size_t kMaxWatched = 4096;

// Install the SIGBUS handler (once; later calls do nothing). Returns false where sigaction
// failed.
bool install();
// Watch [base, base + size) (base: a mapping's start, page-aligned). False: the table is full.
bool watch(uintptr_t base, size_t size);
// Stop watching the mapping at base (before its range is reused).
void forget(uintptr_t base);
// Whether a SIGBUS hit the watched mapping at base (false: not watched, or not hit).
bool broken(uintptr_t base);
// SIGBUS faults the guard has absorbed since start.
int64_t faults();

}  // namespace dlad::shm_guard
