// See chain_engine.hpp.
#include "chain_engine.hpp"

#include "clock.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <stdexcept>

namespace dlad::plane {
namespace {


uint64_t micros(int64_t ns) { return static_cast<uint64_t>(std::max<int64_t>(ns, 0) / 1000); }

}  // namespace

ChainEngine::ChainEngine(std::string name, const CudaApi& cuda, const GpuSpec& gpu,
                         double latency_us, SharedDram* dram, const CudlaApi& cudla_api,
                         const std::optional<CudlaSpec>& cudla, OnFinished on_done)
    : name_(std::move(name)), cuda_(cuda), gpu_(gpu), on_done_(std::move(on_done)) {
    const std::string where = "device " + name_ + ": ";
    if (!cuda_.complete()) throw std::invalid_argument(where + "no CUDA driver functions");
    if (gpu_.context == nullptr || gpu_.pre_kernel == nullptr || gpu_.canvas_h < 1 ||
        gpu_.canvas_w < 1 || gpu_.max_det < 1 || gpu_.slots.empty()) {
        throw std::invalid_argument(where + "a GPU spec needs its context, kernel, canvas, "
                                            "max_det and one slot per core slot");
    }
    // an emulated core's chain signals words, a cuDLA core's its NvSciSync semaphores
    const bool semaphores = cudla.has_value();
    if (semaphores && !cuda_.semaphores()) {
        throw std::invalid_argument(where + "no CUDA external semaphore functions");
    }
    if (semaphores && cudla->slots.size() != gpu_.slots.size()) {
        throw std::invalid_argument(where + "one cuDLA slot per core slot");
    }
    slots_.resize(gpu_.slots.size());
    for (size_t i = 0; i < gpu_.slots.size(); ++i) {
        const GpuSlotSpec& s = gpu_.slots[i];
        const bool fences = semaphores ? s.ready_semaphore != nullptr && s.done_semaphore != nullptr
                                       : s.ready != nullptr && s.done != nullptr &&
                                             s.ready_semaphore == nullptr &&
                                             s.done_semaphore == nullptr;
        const bool outputs =  // an emulated core writes its pattern into each, a DLA itself
            semaphores ? s.outputs.empty()
                       : s.outputs.size() == gpu_.patterns.size() &&
                             std::none_of(s.outputs.begin(), s.outputs.end(),
                                          [](const uint8_t* p) { return p == nullptr; });
        if (s.stream == nullptr || s.input == 0 || !fences || !outputs || s.post_copy == nullptr ||
            s.post_reuse == nullptr || s.frame == nullptr || s.out == nullptr ||
            (s.image == 0 && s.staging == nullptr)) {
            throw std::invalid_argument(
                where + "a GPU slot lacks a stream, buffer, fence, graph or its outputs");
        }
        Slot& slot = slots_[i];
        slot.state.spec = &s;  // gpu_ is the engine's: its slots stay put
        if (!semaphores) {
            // the words may hold values already (a GpuPipeline used before): go on from them
            slot.state.ready = __atomic_load_n(s.ready, __ATOMIC_ACQUIRE);
            slot.state.done = __atomic_load_n(s.done, __ATOMIC_ACQUIRE);
        }
        slot.tag = std::make_unique<Tag>(Tag{this, static_cast<int64_t>(i)});
    }
    for (size_t i = slots_.size(); i-- > 0;) free_.push_back(static_cast<int64_t>(i));
    auto task_done = [this](Finished f) { this->task_done(std::move(f)); };
    if (semaphores) {
        // real silicon shares real DRAM: the emulated model is not applied to it
        cudla_ = std::make_unique<CudlaEngine>(name_, cudla_api, *cudla, task_done);
    } else {
        timing_ = std::make_unique<TimingEngine>(name_, latency_us, slots(), task_done, dram,
                                                 gpu_.patterns);
    }
}

ChainEngine::~ChainEngine() {
    // The core first: no task ends after this (a cuDLA core's all ended and signalled their
    // fences; an emulated core stopped before its task ended never wrote its word, which the
    // CPU writes below, so that the stream runs on to its host function)
    timing_.reset();
    cudla_.reset();
    bool settled = false;
    {
        std::unique_lock<std::mutex> lock(mu_);
        for (const Slot& s : slots_) {
            if (s.job >= 0 && s.state.waits && s.state.spec->done != nullptr) {
                __atomic_store_n(s.state.spec->done, s.state.done, __ATOMIC_RELEASE);
            }
        }
        settled = chains_cv_.wait_for(lock, std::chrono::seconds(10),
                                      [this] { return chains_running_ == 0; });
    }
    detach_tags(slots_, settled);
}

void ChainEngine::start(std::vector<Work> batch) {
    Work& work = batch.front();
    int64_t index = -1;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (free_.empty()) {
            on_done_(refused(batch, Failure::internal, "every slot of " + name_ + " is in use"));
            return;
        }
        index = free_.back();
        free_.pop_back();
        Slot& c = slots_[static_cast<size_t>(index)];
        c.job = work.job;
        c.started_ns = now_ns();
        c.keep = work.keep;
        c.task.reset();
        c.chain_ended = false;
        c.answered = false;
    }
    // Only this thread touches the slot's chain state (GpuSlot) while the slot is in use.
    Slot& c = slots_[static_cast<size_t>(index)];
    const Frame f = frame_of(work);
    c.max_det = f.max_det;
    std::string error = refusal(gpu_, f);
    if (error.empty()) error = make_current(cuda_, gpu_.context);
    const int64_t local = index;  // a cuDLA core's slot is the chain's
    if (error.empty()) {
        error = enqueue_pre(cuda_, gpu_, c.state, f, cudla_ ? cudla_->pre_fence(local) : nullptr);
    }
    Failure failure = Failure::gpu;
    if (error.empty() && cudla_) {
        error = cudla_->submit(work.job, local, true);
        if (!error.empty()) failure = Failure::device;  // the core's, not the GPU's
    }
    if (!error.empty()) {  // nothing was submitted: the slot is free again
        {
            std::lock_guard<std::mutex> lock(mu_);
            release(index);
        }
        on_done_(refused(batch, failure, error));
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        ++chains_running_;  // before the host function can run
    }
    if (timing_) {
        ++c.state.done;  // the value its task writes, and the stream waits for
        timing_->submit(work.job, {c.state.spec->ready, c.state.ready},
                        {c.state.spec->done, c.state.done}, &c.state.spec->outputs);
    }
    error = enqueue_post(cuda_, c.state, f, cudla_ ? cudla_->eof(local) : nullptr,
                         &ChainEngine::chain_ended, c.tag.get());
    if (error.empty()) return;
    // The core's task runs on: the slot is free once it has ended (the stream, where it waits
    // for the task, is released by it).
    std::optional<Finished> last;
    bool report = false;  // not where the task has failed (and been reported) already
    {
        std::lock_guard<std::mutex> lock(mu_);
        --chains_running_;  // its host function was not queued
        c.chain_ended = true;
        c.chain_end_ns = now_ns();
        report = !c.answered;
        c.answered = true;
        if (c.task) last = finish(index);
    }
    if (report) {
        Finished failed = refused(batch, Failure::gpu, error);
        failed.frees = false;
        on_done_(std::move(failed));
    }
    if (last) on_done_(std::move(*last));
    chains_cv_.notify_all();
}

void ChainEngine::task_done(Finished task) {
    std::vector<Finished> out;
    {
        std::lock_guard<std::mutex> lock(mu_);
        const int64_t index = slot_of(task.jobs.front());
        if (index < 0) return;
        Slot& c = slots_[static_cast<size_t>(index)];
        if (task.failure != Failure::none && !c.answered) {  // its chain may never end
            Finished failed = task;
            failed.frees = false;
            out.push_back(std::move(failed));
            c.answered = true;
        }
        c.task = std::move(task);
        if (c.chain_ended) out.push_back(finish(index));
    }
    for (Finished& f : out) on_done_(std::move(f));
}

void ChainEngine::chain_ended(void* tag) {
    const auto* t = static_cast<const Tag*>(tag);
    std::lock_guard<std::mutex> guard(host_tags_mu());
    ChainEngine* engine = t->engine;
    if (engine == nullptr) return;  // the engine has gone (it gave up waiting for this one)
    std::optional<Finished> out;
    {
        std::lock_guard<std::mutex> lock(engine->mu_);
        Slot& c = engine->slots_[static_cast<size_t>(t->slot)];
        --engine->chains_running_;
        c.chain_ended = true;
        c.chain_end_ns = now_ns();
        if (c.task) out = engine->finish(t->slot);
    }
    engine->chains_cv_.notify_all();
    if (out) engine->on_done_(std::move(*out));
}

Finished ChainEngine::finish(int64_t index) {
    Slot& c = slots_[static_cast<size_t>(index)];
    Finished f;
    if (!c.answered) {
        f = *c.task;
        JobResult r;
        r.pre_us = micros(f.start_ns - c.started_ns);
        r.post_us = micros(c.chain_end_ns - f.end_ns);
        // the slot's record stays until its next chain, which can start only once the slot
        // is released below
        const Detections d = read_detections(c.state, c.max_det);
        if (!d.valid || d.overflow) {
            // an overflow needs more candidates than the model's cells (GpuService.plane_slots
            // checks that none can): a record like this is a fault
            r.failure = Failure::internal;
            r.message = d.overflow ? "the GPU stored only part of the frame's candidates"
                                   : "the GPU's result record is malformed";
        } else {
            r.detections.assign(reinterpret_cast<const char*>(d.rows),
                                static_cast<size_t>(d.count) * 6 * sizeof(float));
        }
        f.results = {std::move(r)};
    }
    f.frees = true;
    release(index);
    return f;
}

int64_t ChainEngine::slot_of(int64_t job) const {
    for (size_t i = 0; i < slots_.size(); ++i) {
        if (slots_[i].job == job) return static_cast<int64_t>(i);
    }
    return -1;
}

void ChainEngine::release(int64_t index) {
    Slot& c = slots_[static_cast<size_t>(index)];
    c.job = -1;
    c.task.reset();
    c.keep.reset();
    free_.push_back(index);
}

}  // namespace dlad::plane
