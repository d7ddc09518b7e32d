// The shared-memory guard (shm_guard.hpp).
#include "shm_guard.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace dlad::shm_guard {
namespace {

struct Entry {
    std::atomic<uintptr_t> base{0};  // 0: free
    std::atomic<size_t> size{0};
    std::atomic<bool> broken{false};
};

Entry table[kMaxWatched];
std::atomic<int64_t> absorbed{0};
struct sigaction previous;
std::once_flag installed;
bool install_ok = false;

void pass_on(int sig, siginfo_t* info, void* context) {
    if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
        previous.sa_sigaction(sig, info, context);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    // The default action: restore it and return; the faulting access runs again and ends the
    // process as it would have without the guard.
    signal(sig, SIG_DFL);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
    const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
    for (Entry& e : table) {
        const uintptr_t base = e.base.load(std::memory_order_acquire);
        const size_t size = e.size.load(std::memory_order_acquire);
        if (base == 0 || address < base || address - base >= size) continue;
        // Zero pages over the whole range, at the same address: every later read of this
        // mapping reads zeros until the control plane unmaps it.
        void* got = mmap(reinterpret_cast<void*>(base), size, PROT_READ,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (got == MAP_FAILED) break;
        e.broken.store(true, std::memory_order_relaxed);
        absorbed.fetch_add(1, std::memory_order_release);  // publishes the flag with it
        return;
    }
    pass_on(sig, info, context);
}

size_t page_rounded(size_t size) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (size + page - 1) / page * page;
}

}  // namespace

bool install() {
    std::call_once(installed, [] {
        struct sigaction action {};
        action.sa_sigaction = on_sigbus;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        install_ok = sigaction(SIGBUS, &action, &previous) == 0;
    });
    return install_ok;
}

bool watch(uintptr_t base, size_t size) {
    if (base == 0 || size == 0) return false;
    for (Entry& e : table) {
        uintptr_t expected = 0;
        // A free entry has size 0 (forget clears it first): the handler skips a half-published
        // one until its size is stored.
        if (e.base.compare_exchange_strong(expected, base, std::memory_order_acq_rel)) {
            e.broken.store(false, std::memory_order_relaxed);
            e.size.store(page_rounded(size), std::memory_order_release);
            return true;
        }
    }
    return false;
}

void forget(uintptr_t base) {
    for (Entry& e : table) {
        if (e.base.load(std::memory_order_acquire) == base) {
            e.size.store(0, std::memory_order_release);
            e.base.store(0, std::memory_order_release);
            return;
        }
    }
}

bool broken(uintptr_t base) {
    // No fault yet (the common case): one load, no scan of the table.
    if (base == 0 || absorbed.load(std::memory_order_acquire) == 0) return false;
    for (const Entry& e : table) {
        if (e.base.load(std::memory_order_acquire) == base) {
            return e.broken.load(std::memory_order_acquire);
        }
    }
    return false;
}

int64_t faults() { return absorbed.load(std::memory_order_relaxed); }

}  // namespace dlad::shm_guard
