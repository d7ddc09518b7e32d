// See cudla_engine.hpp.
#include "cudla_engine.hpp"

#include "clock.hpp"

#include <pthread.h>

#include <algorithm>
#include <stdexcept>

namespace dlad::plane {
namespace {

constexpr int32_t kNvSciSyncFence = 1;  // CUDLA_NVSCISYNC_FENCE
constexpr int kNvSciTimeout = 0x200;  // NvSciError_Timeout

}  // namespace

std::string cudla_status_name(int status) {
    switch (status) {
        case 0: return "cudlaSuccess";
        case 1: return "cudlaErrorInvalidParam";
        case 2: return "cudlaErrorOutOfResources";
        case 3: return "cudlaErrorCreationFailed";
        case 4: return "cudlaErrorInvalidAddress";
        case 5: return "cudlaErrorOs";
        case 6: return "cudlaErrorCuda";
        case 7: return "cudlaErrorUmd";
        case 8: return "cudlaErrorInvalidDevice";
        case 9: return "cudlaErrorInvalidAttribute";
        case 10: return "cudlaErrorIncompatibleDlaSWVersion";
        case 11: return "cudlaErrorMemoryRegistered";
        case 12: return "cudlaErrorInvalidModule";
        case 13: return "cudlaErrorUnsupportedOperation";
        case 14: return "cudlaErrorNvSci";
        case 15: return "cudlaErrorDriverNotFound";
        case 0x40000001: return "cudlaErrorDlaErrInvalidInput";
        case 0x40000002: return "cudlaErrorDlaErrInvalidPreAction";
        case 0x40000003: return "cudlaErrorDlaErrNoMem";
        case 0x40000004: return "cudlaErrorDlaErrProcessorBusy";
        case 0x40000005: return "cudlaErrorDlaErrTaskStatusMismatch";
        case 0x40000006: return "cudlaErrorDlaErrEngineTimeout";
        case 0x40000007: return "cudlaErrorDlaErrDataMismatch";
        default: return "cudlaErrorUnknown";
    }
}

CudlaEngine::CudlaEngine(std::string name, const CudlaApi& api, const CudlaSpec& spec,
                         OnFinished on_done)
    : name_(std::move(name)), api_(api), spec_(spec), on_done_(std::move(on_done)) {
    if (!api_.complete()) throw std::invalid_argument("device " + name_ + ": no cuDLA functions");
    if (spec_.device == nullptr || spec_.module == nullptr || spec_.wait_context == nullptr ||
        spec_.slots.empty() || spec_.timeout_us < 1) {
        throw std::invalid_argument("device " + name_ +
                                    ": a cuDLA core needs its handle, module, wait context, "
                                    "a timeout and its slots");
    }
    for (const CudlaSlotSpec& s : spec_.slots) {
        const auto null = [](const uint64_t* p) { return p == nullptr; };
        if (s.inputs.empty() || s.outputs.empty() || s.signal == nullptr ||
            std::any_of(s.inputs.begin(), s.inputs.end(), null) ||
            std::any_of(s.outputs.begin(), s.outputs.end(), null)) {
            throw std::invalid_argument("device " + name_ +
                                        ": a cuDLA slot needs its buffers and semaphore");
        }
    }
    records_.resize(spec_.slots.size());
    thread_ = std::thread([this] { run(); });
}

CudlaEngine::~CudlaEngine() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

void CudlaEngine::start(std::vector<Work> batch) {
    if (std::string error = submit(batch.front().job); !error.empty()) {
        on_done_(refused(batch, Failure::device, std::move(error)));
    }
}

std::string CudlaEngine::submit(int64_t job, int64_t slot, bool wait) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (slot < 0) {
            const auto free = std::find_if(records_.begin(), records_.end(),
                                           [](const Record& r) { return !r.busy; });
            if (free == records_.end()) return "every slot is in use";
            slot = free - records_.begin();
        }
        if (records_.at(static_cast<size_t>(slot)).busy) return "its slot is in use";
        records_[static_cast<size_t>(slot)].busy = true;
    }
    Record& r = records_[static_cast<size_t>(slot)];
    CudlaSlotSpec& s = spec_.slots[static_cast<size_t>(slot)];
    // Everything the task points at lives in the record and the spec until the task ends.
    r.pre_ref = {&r.pre, kNvSciSyncFence};
    r.waits = {&r.pre_ref, 1};
    r.eof_ref = {&r.eof, kNvSciSyncFence};
    r.signal = {&s.signal, &r.eof_ref, 1};
    r.task = {spec_.module,
              s.outputs.data(),
              static_cast<uint32_t>(s.outputs.size()),
              static_cast<uint32_t>(s.inputs.size()),
              s.inputs.data(),
              wait ? &r.waits : nullptr,
              &r.signal};
    const int64_t submitted = now_ns();
    {
        // Submitted and queued for the completion thread as one step: a task that fails the
        // moment it is submitted sets the handle's error, and the thread reading the task
        // before it must then see it queued (run(): the failure may be either's)
        std::lock_guard<std::mutex> lock(mu_);
        // the plane's thread is the handle's one submitter: CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE holds
        if (int status = api_.submit_task(spec_.device, &r.task, 1, nullptr, spec_.flags)) {
            api_.fence_clear(&r.eof);
            if (wait) api_.fence_clear(&r.pre);
            r.busy = false;
            return "cudlaSubmitTask: " + cudla_status_name(status) + " (" +
                   std::to_string(status) + ")";
        }
        tasks_.push_back({job, slot, submitted});
    }
    cv_.notify_all();
    return "";
}

void CudlaEngine::run() {
    const std::string thread_name = ("cudla-" + name_).substr(0, 15);  // Linux's limit
    pthread_setname_np(pthread_self(), thread_name.c_str());
    int64_t last_end = 0;
    int carried = 0;  // a failure that may have been the next task's (see below)
    while (true) {
        Task task{};
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
            if (tasks_.empty()) return;  // stopped, and every task has ended
            task = tasks_.front();
        }
        Record& r = records_[static_cast<size_t>(task.slot)];
        // CudlaDlaCore._await: the EOF fence, then the core's sticky error
        int status = api_.fence_wait(&r.eof, spec_.wait_context, spec_.timeout_us);
        if (status == kNvSciTimeout) {
            status = kCudlaEngineTimeout;
        } else if (status != 0) {
            status = kCudlaUnknown;  // the wait itself failed: the task's end is unknown
        } else {
            status = api_.get_last_error(spec_.device);
        }
        if (status == 0) status = carried;
        carried = 0;
        // cuDLA's error is the handle's, not a task's: where the next task had also ended when
        // this one's was read, the failure may be either's, and both are failed (a failed
        // frame must not be answered OK)
        if (status != 0) {
            std::unique_lock<std::mutex> lock(mu_);
            if (tasks_.size() > 1) {
                const NvSciSyncFence* next = &records_[static_cast<size_t>(tasks_[1].slot)].eof;
                lock.unlock();  // its record stays until this thread has reported it
                if (api_.fence_wait(next, spec_.wait_context, 0) == 0) carried = status;
            }
        }
        const int64_t end = now_ns();
        // cuDLA reports no start: the task began once submitted and its predecessor ended
        const int64_t start = std::min(end, std::max(task.submitted_ns, last_end));
        last_end = end;
        api_.fence_clear(&r.eof);
        api_.fence_clear(&r.pre);
        {
            std::lock_guard<std::mutex> lock(mu_);
            tasks_.pop_front();
            r.busy = false;
        }
        Finished f;
        f.jobs = {task.job};
        f.start_ns = start;
        f.end_ns = end;
        if (status != 0) {
            f.failure = status == kCudlaEngineTimeout ? Failure::hung : Failure::device;
            f.message = "task failed: " + cudla_status_name(status);
        }
        on_done_(std::move(f));
    }
}

}  // namespace dlad::plane
