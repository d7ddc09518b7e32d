// The native data plane's engine for a real DLA core: cuDLA standalone tasks (docs/daemon.md,
// "The native data plane"; docs/reference/cudla.md §4).
//
// Python opens the core as the DLA executor does (dlad/devices/cudla/backend.py,
// CudlaDlaCore): the device handle, the module, each slot's NvSciBuf buffers and the
// NvSciSync object its tasks signal, all imported into cuDLA, and the CPU wait context. The
// plane gets their handles and registered pointers, and the functions by address in the
// libraries Python loaded (CudlaApi), so nothing here links against cuDLA or NvSci: the plane
// builds and is tested where neither exists (tests/dlad/cudla/fake_cudla.c has their ABI).
//
// submit() calls cudlaSubmitTask on the caller's thread (the plane's): it returns at once,
// with the task's EOF fence filled, which a CUDA stream can then wait on (the GPU chain,
// recipe A of cudla.md §4.7). A thread of the engine's waits for each task's EOF fence in
// order (NvSciSyncFenceWait), reads cudlaGetLastError and reports the task, as
// CudlaDlaCore's completion thread does. Syncpoint fences only: a core whose fences are
// deterministic semaphores serves as a Python engine (dlad/plane_cores.py).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.hpp"
#include "gpu_chain.hpp"

namespace dlad::plane {

// cudla.h / nvscisync.h, field for field (dlad/devices/cudla/abi.py has the same).
struct CudlaFenceRef {  // CudlaFence
    void* fence;        // an NvSciSyncFence*
    int32_t type;       // cudlaFenceType: 1 = CUDLA_NVSCISYNC_FENCE
};
struct CudlaWaitEvents {
    const CudlaFenceRef* pre_fences;
    uint32_t count;
};
struct CudlaSignalEvents {
    uint64_t** dev_ptrs;  // the registered semaphores the task signals
    CudlaFenceRef* eof_fences;  // the fences cuDLA fills, one per semaphore
    uint32_t count;
};
struct CudlaTask {  // cudlaTask: outputs before inputs
    void* module;
    uint64_t** outputs;
    uint32_t n_outputs;
    uint32_t n_inputs;
    uint64_t** inputs;
    const CudlaWaitEvents* wait;
    CudlaSignalEvents* signal;
};
static_assert(sizeof(NvSciSyncFence) == 48 && sizeof(CudlaTask) == 48, "cuDLA's structs");

// The functions the engine calls (status 0 is cudlaSuccess / NvSciError_Success).
struct CudlaApi {
    int (*submit_task)(void* dev, const CudlaTask* tasks, uint32_t n, void* stream,
                       uint32_t flags);                                      // cudlaSubmitTask
    int (*get_last_error)(void* dev);                                        // cudlaGetLastError
    int (*fence_wait)(const NvSciSyncFence* fence, void* ctx, int64_t timeout_us);
    void (*fence_clear)(NvSciSyncFence* fence);                              // NvSciSyncFenceClear

    bool complete() const { return submit_task && get_last_error && fence_wait && fence_clear; }
};

// One slot's buffers and the semaphore its tasks signal, as cuDLA registered them.
struct CudlaSlotSpec {
    std::vector<uint64_t*> inputs;   // in the module's order
    std::vector<uint64_t*> outputs;
    uint64_t* signal = nullptr;      // a DLA-signalled NvSciSync object of this core
};

struct CudlaSpec {
    void* device = nullptr;        // the cudlaDevHandle (CUDLA_STANDALONE)
    void* module = nullptr;        // its loaded module
    void* wait_context = nullptr;  // an NvSciSyncCpuWaitContext of the core's NvSciSync module
    uint32_t flags = 0;            // cudlaSubmitTask's (CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE: the plane
                                   // is the handle's one submitter)
    int64_t timeout_us = 0;        // how long the thread waits for an EOF fence (the task
                                   // timeout and a grace) before it fails the task itself
    std::vector<CudlaSlotSpec> slots;
};

// cudlaStatus's C name ("cudlaErrorDlaErrEngineTimeout"), as CudlaStatus.c_name spells it.
std::string cudla_status_name(int status);
constexpr int kCudlaEngineTimeout = 0x40000006;  // cudlaErrorDlaErrEngineTimeout
constexpr int kCudlaUnknown = 0x7FFFFFFF;        // cudlaErrorUnknown

class CudlaEngine : public Engine {
  public:
    // ``on_done`` gets each task on the engine's thread, in submission order: its span, and
    // for a failed one the failure (``hung`` for cudlaErrorDlaErrEngineTimeout) with
    // "task failed: <cudlaStatus>".
    CudlaEngine(std::string name, const CudlaApi& api, const CudlaSpec& spec, OnFinished on_done);
    // Waits for the tasks in flight (a DLA task cannot be aborted; each wait is bounded by
    // the spec's timeout), then ends the thread. Python releases the core afterwards.
    ~CudlaEngine() override;

    int64_t slots() const override { return static_cast<int64_t>(records_.size()); }
    // The job's task on a free slot's buffers (pre/post off: its inputs are what they are).
    void start(std::vector<Work> batch) override;
    // Submit ``job``'s task on ``slot``'s buffers (-1: a free slot's), first waiting for
    // ``pre_fence(slot)`` where ``wait`` (a fence CUDA filled when it queued its signal).
    // Returns "" or the failure in words; a slot in use is the caller's error. After it,
    // eof(slot) is the task's EOF fence until its Finished is reported.
    std::string submit(int64_t job, int64_t slot = -1, bool wait = false);
    NvSciSyncFence* pre_fence(int64_t slot) { return &records_.at(static_cast<size_t>(slot)).pre; }
    NvSciSyncFence* eof(int64_t slot) { return &records_.at(static_cast<size_t>(slot)).eof; }

  private:
    // A slot's task and everything it points at, kept until the task has ended (cuDLA may
    // read them until it runs, as CudlaDlaCore keeps its ctypes arrays)
    struct Record {
        NvSciSyncFence pre{};
        NvSciSyncFence eof{};
        CudlaFenceRef pre_ref{};
        CudlaFenceRef eof_ref{};
        CudlaWaitEvents waits{};
        CudlaSignalEvents signal{};
        CudlaTask task{};
        bool busy = false;
    };
    struct Task {
        int64_t job;
        int64_t slot;
        int64_t submitted_ns;
    };
    void run();

    std::string name_;
    CudlaApi api_;
    CudlaSpec spec_;
    OnFinished on_done_;
    std::vector<Record> records_;  // one per slot
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Task> tasks_;  // submitted, in order
    bool stop_ = false;
    std::thread thread_;
};

}  // namespace dlad::plane
