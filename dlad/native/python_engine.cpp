// See python_engine.hpp.
#include "python_engine.hpp"

#include "clock.hpp"

#include <pthread.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <utility>

namespace py = pybind11;

namespace dlad::plane {
namespace {

// One job's result tuple (python_engine.hpp); throws std::invalid_argument naming what is wrong.
JobResult result_of(const py::handle& item) {
    const auto t = py::reinterpret_borrow<py::tuple>(item);
    if (t.size() != 5) {
        throw std::invalid_argument("a result is 5 items, got " + std::to_string(t.size()));
    }
    JobResult r;
    const int failure = t[0].cast<int>();
    switch (failure) {
        case 0: r.failure = Failure::none; break;
        case 1: r.failure = Failure::device; break;
        case 3: r.failure = Failure::hung; break;
        case 4: r.failure = Failure::internal; break;
        default: throw std::invalid_argument("no failure " + std::to_string(failure));
    }
    r.message = t[1].cast<std::string>();
    if (!t[2].is_none()) {
        const py::buffer_info b = py::reinterpret_borrow<py::buffer>(t[2]).request();
        const bool rows = b.ndim == 2 && b.itemsize == 4 && b.format == "f" && b.shape[1] == 6 &&
                          b.strides[1] == 4 && (b.shape[0] <= 1 || b.strides[0] == 24);
        if (!rows) throw std::invalid_argument("detections are C-contiguous N x 6 float32 rows");
        r.detections.assign(static_cast<const char*>(b.ptr), static_cast<size_t>(b.shape[0]) * 24);
    }
    if (!t[3].is_none()) r.pre_us = t[3].cast<uint64_t>();
    if (!t[4].is_none()) r.post_us = t[4].cast<uint64_t>();
    return r;
}

}  // namespace

PythonEngine::PythonEngine(std::string name, int64_t slots, int64_t max_batch, py::object run,
                           OnFinished on_done)
    : name_(std::move(name)),
      max_batch_(max_batch),
      run_(std::move(run)),
      on_done_(std::move(on_done)) {
    if (slots < 1 || max_batch < 1) {
        throw std::invalid_argument("device " + name_ + ": slots and max_batch must be positive");
    }
    for (int64_t i = 0; i < slots; ++i) threads_.emplace_back([this, i] { loop(i); });
}

PythonEngine::~PythonEngine() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        batches_.clear();
    }
    cv_.notify_all();
    const auto join = [this] {
        for (std::thread& t : threads_) t.join();
    };
    if (PyGILState_Check() != 0) {
        py::gil_scoped_release release;  // a call running needs it to return
        join();
    } else {
        join();
    }
    py::gil_scoped_acquire gil;
    run_ = py::object();
}

void PythonEngine::start(std::vector<Work> batch) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        batches_.push_back(std::move(batch));
    }
    cv_.notify_one();
}

void PythonEngine::loop(int64_t index) {
    const std::string thread_name = (name_ + "-py" + std::to_string(index)).substr(0, 15);
    pthread_setname_np(pthread_self(), thread_name.c_str());
    while (true) {
        std::vector<Work> batch;
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !batches_.empty(); });
            if (stop_) return;
            batch = std::move(batches_.front());
            batches_.pop_front();
        }
        const int64_t cpu = thread_cpu_ns();
        Finished f = call(batch);
        f.host_ns = thread_cpu_ns() - cpu;  // the interpreter's share of the host, mostly
        batch.clear();  // the frames' pixels may go now
        on_done_(std::move(f));
    }
}

Finished PythonEngine::call(const std::vector<Work>& batch) {
    Finished f;
    for (const Work& w : batch) f.jobs.push_back(w.job);
    py::gil_scoped_acquire gil;
    try {
        py::list jobs;
        for (const Work& w : batch) {
            const Image& im = w.image;
            py::object pixels = py::none();
            if (w.host != nullptr) {
                const auto bytes =
                    static_cast<py::ssize_t>(rules::frame_bytes(im.format, im.height, im.width));
                // read-only: the frame is the client's message
                pixels = py::memoryview::from_memory(static_cast<const void*>(w.host), bytes);
            }
            jobs.append(py::make_tuple(
                w.job, pixels,
                py::make_tuple(im.height, im.width, im.format, im.colour, im.conf, im.iou,
                               im.max_det)));
        }
        const py::object out = run_(jobs);
        const auto t = out.cast<py::tuple>();
        if (t.size() != 3) throw std::invalid_argument("it returns (start_ns, end_ns, results)");
        f.start_ns = t[0].cast<int64_t>();
        f.end_ns = t[1].cast<int64_t>();
        const auto results = t[2].cast<py::sequence>();
        if (results.size() != batch.size()) {
            throw std::invalid_argument("one result per job: " + std::to_string(batch.size()) +
                                        " jobs, " + std::to_string(results.size()) + " results");
        }
        for (const py::handle item : results) f.results.push_back(result_of(item));
    } catch (const py::error_already_set& e) {
        f.results.clear();
        f.failure = Failure::internal;
        f.message = std::string("the engine raised ") + e.what();
    } catch (const std::exception& e) {  // a cast that failed, a malformed result
        f.results.clear();
        f.failure = Failure::internal;
        f.message = std::string("the engine returned a malformed result: ") + e.what();
    }
    return f;
}

}  // namespace dlad::plane
