// An engine of the plane whose work is a Python callable (Triton's Python backend): what only
// Python does, the numeric INT8 emulation (onnxruntime), the emulated Orin GPU's batches, a
// torch GPU's, numpy pre/post-processing on hosts without a GPU (dlad/engines/).
//
// The engine runs ``slots`` threads of its own; each takes a batch the plane started and calls
//
//     run(batch) -> (start_ns, end_ns, results)
//
// holding the interpreter only for the call, where ``batch`` is a list of
// (job, pixels, (height, width, format, colour, conf, iou, max_det)) with ``pixels`` a read-only
// memoryview of the frame (valid during the call only; None where the plane holds none) and the
// settings None where the request left them to the model; ``results`` is one
// (failure, message, detections, pre_us, post_us) per job, in order: failure 0 (ok), 1 (the
// device failed), 3 (it hung) or 4 (a fault of the daemon's); detections a C-contiguous
// buffer of N x 6 float32 rows, or None; the times None where not measured. A call that
// raises, or returns anything else, fails its batch as a fault of the daemon's, naming what it
// raised.
#pragma once

#include <pybind11/pybind11.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.hpp"

namespace dlad::plane {

class PythonEngine : public Engine {
  public:
    PythonEngine(std::string name, int64_t slots, int64_t max_batch, pybind11::object run,
                 OnFinished on_done);
    // Takes no more batches, waits for the calls running to return (the interpreter is
    // released meanwhile, where the caller held it), and drops the batches not yet called
    // (never reported: the plane has answered their jobs, or is gone).
    ~PythonEngine() override;

    int64_t slots() const override { return static_cast<int64_t>(threads_.size()); }
    int64_t max_batch() const override { return max_batch_; }
    void start(std::vector<Work> batch) override;

  private:
    void loop(int64_t index);
    Finished call(const std::vector<Work>& batch);  // holding the interpreter

    std::string name_;
    int64_t max_batch_;
    pybind11::object run_;
    OnFinished on_done_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::vector<Work>> batches_;
    bool stop_ = false;
    std::vector<std::thread> threads_;
};

}  // namespace dlad::plane
