// See gpu_batch_engine.hpp.
#include "gpu_batch_engine.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "clock.hpp"

namespace dlad::plane {

GpuBatchEngine::GpuBatchEngine(std::string name, const CudaApi& cuda, const GpuSpec& gpu,
                               std::vector<void*> graphs, int64_t slots, OnFinished on_done)
    : name_(std::move(name)),
      cuda_(cuda),
      gpu_(gpu),
      graphs_(std::move(graphs)),
      on_done_(std::move(on_done)) {
    const std::string where = "device " + name_ + ": ";
    if (!cuda_.complete()) throw std::invalid_argument(where + "no CUDA driver functions");
    if (graphs_.empty() ||
        std::any_of(graphs_.begin(), graphs_.end(), [](void* g) { return g == nullptr; })) {
        throw std::invalid_argument(where + "a GPU engine needs one graph per batch size");
    }
    const auto per_slot = graphs_.size();
    if (slots < 1 || gpu_.slots.size() != static_cast<size_t>(slots) * per_slot) {
        throw std::invalid_argument(where + "a GPU engine needs one GPU slot per frame of each "
                                            "of its slots' batches");
    }
    if (gpu_.context == nullptr || gpu_.pre_kernel == nullptr || gpu_.canvas_h < 1 ||
        gpu_.canvas_w < 1 || gpu_.max_det < 1) {
        throw std::invalid_argument(where + "a GPU spec needs its context, kernel, canvas and "
                                            "max_det");
    }
    stream_ = gpu_.slots.front().stream;
    for (const GpuSlotSpec& s : gpu_.slots) {
        if (s.stream == nullptr || s.stream != stream_ || s.input == 0 || s.post_copy == nullptr ||
            s.post_reuse == nullptr || s.frame == nullptr || s.out == nullptr ||
            (s.image == 0 && s.staging == nullptr)) {
            throw std::invalid_argument(where + "a GPU slot lacks a buffer or graph, or is not "
                                                "on the engine's one stream");
        }
    }
    slots_.resize(static_cast<size_t>(slots));
    for (size_t i = 0; i < slots_.size(); ++i) {
        Slot& slot = slots_[i];
        for (size_t b = 0; b < per_slot; ++b) {
            GpuSlot image;
            image.spec = &gpu_.slots[i * per_slot + b];  // gpu_ is the engine's: it stays put
            slot.images.push_back(image);
        }
        slot.tag = std::make_unique<Tag>(Tag{this, static_cast<int64_t>(i)});
    }
    for (size_t i = slots_.size(); i-- > 0;) free_.push_back(static_cast<int64_t>(i));
}

GpuBatchEngine::~GpuBatchEngine() {
    bool settled = false;
    {
        std::unique_lock<std::mutex> lock(mu_);
        settled = running_cv_.wait_for(lock, std::chrono::seconds(10),
                                       [this] { return running_ == 0; });
    }
    detach_tags(slots_, settled);
}

void GpuBatchEngine::start(std::vector<Work> batch) {
    if (batch.empty() || batch.size() > graphs_.size()) {
        on_done_(refused(batch, Failure::internal,
                         "a batch of " + std::to_string(batch.size()) + " on " + name_ +
                             ", which takes 1 to " + std::to_string(graphs_.size())));
        return;
    }
    int64_t index = -1;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (free_.empty()) {
            on_done_(refused(batch, Failure::internal, "every slot of " + name_ + " is in use"));
            return;
        }
        index = free_.back();
        free_.pop_back();
        slots_[static_cast<size_t>(index)].busy = true;
    }
    // Only this thread touches the slot while it is busy (its host function only once queued).
    Slot& s = slots_[static_cast<size_t>(index)];
    s.members.clear();
    s.keep.clear();
    s.failed.clear();
    s.queued_ns = now_ns();
    std::string error = make_current(cuda_, gpu_.context);
    size_t n = 0;  // the frames queued
    std::vector<Frame> frames;
    for (const Work& w : batch) {
        Member m;
        m.job = w.job;
        const Frame f = frame_of(w);
        m.max_det = f.max_det;
        m.refused = refusal(gpu_, f);
        if (m.refused.empty() && error.empty()) {
            m.image = n;
            error = enqueue_pre_kernel(cuda_, gpu_, s.images[n], f);
            frames.push_back(f);
            ++n;
        }
        s.members.push_back(std::move(m));
        s.keep.push_back(w.keep);
    }
    if (error.empty() && n > 0) {
        if (int r = cuda_.graph_launch(graphs_[n - 1], stream_)) {
            error = call_failed("cuGraphLaunch", r);
        }
    }
    for (size_t b = 0; error.empty() && b < n; ++b) {
        error = enqueue_post_graph(cuda_, s.images[b], frames[b]);
    }
    s.failed = error;
    {
        std::lock_guard<std::mutex> lock(mu_);
        ++running_;  // before the host function can run
    }
    if (n > 0) {
        // What was queued runs on: the slot is free once the stream has passed it.
        if (int r = cuda_.launch_host_func(stream_, &GpuBatchEngine::ended, s.tag.get())) {
            Finished f;
            {
                std::lock_guard<std::mutex> lock(mu_);
                --running_;
                if (s.failed.empty()) s.failed = call_failed("cuLaunchHostFunc", r);
                // the slot is lost: what was queued may still read its buffers and pixels
                f = report(s, 0, 0);
            }
            running_cv_.notify_all();
            on_done_(std::move(f));
        }
        return;
    }
    // nothing queued (every frame refused, or no context): answered at once, the slot free
    Finished f;
    {
        std::lock_guard<std::mutex> lock(mu_);
        --running_;
        f = report(s, 0, 0);
        f.frees = true;
        release(s);
    }
    running_cv_.notify_all();
    on_done_(std::move(f));
}

void GpuBatchEngine::ended(void* tag) {
    const auto* t = static_cast<const Tag*>(tag);
    std::lock_guard<std::mutex> guard(host_tags_mu());
    GpuBatchEngine* engine = t->engine;
    if (engine == nullptr) return;  // the engine has gone (it gave up waiting for this one)
    Finished f;
    {
        std::lock_guard<std::mutex> lock(engine->mu_);
        Slot& s = engine->slots_[static_cast<size_t>(t->slot)];
        const int64_t end = now_ns();
        // the stream ran this batch from when it was queued or the one before ended
        const int64_t start = std::max(s.queued_ns, engine->last_end_ns_);
        engine->last_end_ns_ = end;
        f = engine->report(s, start, end);
        f.frees = true;
        engine->release(s);
        --engine->running_;
    }
    engine->running_cv_.notify_all();
    engine->on_done_(std::move(f));
}

Finished GpuBatchEngine::report(Slot& s, int64_t start_ns, int64_t end_ns) {
    Finished f;
    f.start_ns = start_ns;
    f.end_ns = end_ns;
    if (!s.failed.empty()) {
        f.failure = Failure::gpu;
        f.message = s.failed;
    }
    for (const Member& m : s.members) {
        f.jobs.push_back(m.job);
        JobResult r;
        if (!m.refused.empty()) {
            r.failure = Failure::gpu;
            r.message = m.refused;
        } else if (s.failed.empty()) {
            const Detections d = read_detections(s.images[m.image], m.max_det);
            if (!d.valid || d.overflow) {
                // GpuService.plane_batches checks that no frame can overflow: this is a fault
                r.failure = Failure::internal;
                r.message = d.overflow ? "the GPU stored only part of the frame's candidates"
                                       : "the GPU's result record is malformed";
            } else {
                r.detections.assign(reinterpret_cast<const char*>(d.rows),
                                    static_cast<size_t>(d.count) * 6 * sizeof(float));
            }
        }
        f.results.push_back(std::move(r));
    }
    if (!s.failed.empty()) f.results.clear();  // the batch's failure is every frame's
    s.members.clear();
    f.frees = false;
    return f;
}

void GpuBatchEngine::release(Slot& s) {
    s.keep.clear();
    s.busy = false;
    free_.push_back(static_cast<int64_t>(&s - slots_.data()));
}

}  // namespace dlad::plane
