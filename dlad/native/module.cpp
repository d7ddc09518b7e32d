// dlad._native: the native data plane (plane.hpp), its scheduler (scheduler.hpp) and the hot
// messages' codec (wire.hpp) for Python. dlad/native_plane.py starts the plane on a pyzmq
// socket; the scheduler and the codec are bound for the tests that hold them to their promises
// and to dlad/protocol.py (tests/dlad/test_scheduler.py, tests/dlad/test_native_wire.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "frame_rules.hpp"
#include "plane.hpp"
#include "python_engine.hpp"
#include "scheduler.hpp"
#include "shm_guard.hpp"
#include "wire.hpp"

namespace py = pybind11;
using dlad::Scheduler;

namespace {

dlad::Policy policy_of(const std::string& name) {
    if (name == "throughput") return dlad::Policy::throughput;
    if (name == "latency") return dlad::Policy::latency;
    if (name == "static") return dlad::Policy::statik;
    throw std::invalid_argument("unknown policy " + name);
}

const char* policy_name(dlad::Policy p) {
    switch (p) {
        case dlad::Policy::throughput: return "throughput";
        case dlad::Policy::latency: return "latency";
        case dlad::Policy::statik: return "static";
    }
    return "";
}

dlad::JobSpec spec(int64_t id, std::string model, int64_t deadline_ns, int64_t priority,
                   std::optional<std::string> stream, std::string owner) {
    return {id, std::move(model), deadline_ns, priority, std::move(stream), std::move(owner)};
}

py::tuple placed(const dlad::Placed& p) {
    return py::make_tuple(p.device, p.admitted_ns, p.estimate_ns, p.seq);
}

// protocol.Limits' five bounds, in its field order
dlad::wire::Limits limits_of(const std::tuple<uint64_t, uint64_t, int64_t, int64_t, int64_t>& t) {
    const auto& [message, header, width, height, pixels] = t;
    return {message, header, width, height, pixels};
}

// wire::decode_request for protocol.decode_request: (False, field, message, id, kind) for a
// refusal, else (True, kind, id, model, priority, deadline_ms, conf, iou, max_det, load,
// images), each image (format, height, width, colour, stream, shm (name, offset, size, token) or
// None, its payload's frame or 0)
py::tuple decode_request(const py::buffer& header, const std::vector<uint64_t>& payloads,
                         const std::tuple<uint64_t, uint64_t, int64_t, int64_t, int64_t>& limits,
                         bool shm) {
    const py::buffer_info info = header.request();
    if (info.ndim != 1 || info.itemsize != 1 || (info.ndim == 1 && info.strides[0] != 1)) {
        throw std::invalid_argument("the header must be a contiguous bytes-like buffer");
    }
    dlad::wire::Decoded d = dlad::wire::decode_request(
        static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size), payloads.data(),
        payloads.size(), limits_of(limits), shm);
    if (!d.request) {
        const auto& r = d.refusal;
        return py::make_tuple(false, r.field, r.message, r.id, r.kind);
    }
    const auto& r = *d.request;
    py::list images;
    for (const auto& img : r.images) {
        py::object ref = py::none();
        if (img.shm) {
            ref = py::make_tuple(img.shm->name, img.shm->offset, img.shm->size,
                                 py::bytes(img.shm->token));
        }
        images.append(py::make_tuple(dlad::rules::kPixelFormats[img.format], img.height, img.width,
                                     img.colour, img.stream, ref, img.frame));
    }
    return py::make_tuple(true, r.kind, r.id, r.model, r.priority, r.deadline_ms, r.conf, r.iou,
                          r.max_det, r.load, images);
}

py::bytes write_infer_reply(uint64_t id, int64_t status, std::string_view message,
                            std::optional<std::string_view> device,
                            const std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                                             std::optional<uint64_t>, std::optional<uint64_t>>& t,
                            uint64_t count) {
    const auto& [queue, pre, dev, post, total, start, end] = t;
    return py::bytes(dlad::wire::write_infer_reply(id, status, message, device,
                                                   {queue, pre, dev, post, total, start, end},
                                                   count));
}

// A GPU slot's handles and addresses, in GpuSlotSpec's order: stream, image, staging,
// staging_device, image_bytes, input, ready, ready_device, done, done_device, ready_semaphore,
// done_semaphore, post_copy, post_reuse, frame, out, outputs.
using GpuSlotTuple =
    std::tuple<uintptr_t, uint64_t, uintptr_t, uint64_t, uint64_t, uint64_t, uintptr_t, uint64_t,
               uintptr_t, uint64_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
               uintptr_t, std::vector<uintptr_t>>;
// context, pre_kernel, int8, input_scale, canvas_h, canvas_w, max_det, slots, patterns: a
// device's GpuSpec
using GpuTuple = std::tuple<uintptr_t, uintptr_t, bool, float, int, int, int,
                            std::vector<GpuSlotTuple>, std::vector<std::string>>;
// a cuDLA slot's registered pointers: inputs, outputs, the semaphore its tasks signal
using CudlaSlotTuple = std::tuple<std::vector<uintptr_t>, std::vector<uintptr_t>, uintptr_t>;
// device handle, module, CPU wait context, submit flags, timeout_us, slots: a CudlaSpec
using CudlaTuple =
    std::tuple<uintptr_t, uintptr_t, uintptr_t, uint32_t, int64_t, std::vector<CudlaSlotTuple>>;
// name, latency_us, slots, capacity, gpu, cudla, kind, max_batch, max_queue_delay_us,
// curve_us, tier, run (a Python engine's callable, or None), graphs (the GPU's inference
// graphs by batch size)
using PlaneDevice = std::tuple<std::string, double, int64_t, int64_t, std::optional<GpuTuple>,
                               std::optional<CudlaTuple>, std::string, int64_t, double,
                               std::map<int64_t, double>, int64_t, py::object,
                               std::vector<uintptr_t>>;
// the CUDA driver's functions (CudaApi's order), CU_STREAM_WAIT_VALUE_GEQ, and the external
// semaphore functions (0: none)
using CudaTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                             uintptr_t, unsigned, uintptr_t, uintptr_t>;
// cudlaSubmitTask, cudlaGetLastError, NvSciSyncFenceWait, NvSciSyncFenceClear
using CudlaApiTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t>;
// height, width, format, colour, conf, iou, max_det: an image's shape and settings
using ImageTuple = std::tuple<int64_t, int64_t, int, int, std::optional<double>,
                              std::optional<double>, std::optional<int64_t>>;
// model, stream, priority, deadline_ms, size, segment, offset in it, image, pixels: an image
// for Plane::submit
using PlaneItem = std::tuple<std::string, std::optional<std::string>, int64_t,
                             std::optional<int64_t>, uint64_t, std::optional<std::string>,
                             uint64_t, ImageTuple, py::bytes>;

// dram.py's ORIN_DRAM_K: {(victim kind, aggressor kind): slowdown per aggressor}
dlad::plane::EngineKind engine_kind(const std::string& name) {
    if (name == "dla") return dlad::plane::EngineKind::dla;
    if (name == "gpu") return dlad::plane::EngineKind::gpu;
    throw std::invalid_argument("an engine kind is 'dla' or 'gpu', got " + name);
}

dlad::plane::SharedDram::Coefficients coefficients(
    const std::map<std::pair<std::string, std::string>, double>& k) {
    const auto index = [](const std::string& name) {
        return static_cast<size_t>(engine_kind(name));
    };
    dlad::plane::SharedDram::Coefficients out{};
    for (const auto& [pair, value] : k) out[index(pair.first)][index(pair.second)] = value;
    return out;
}

template <typename T>
T* ptr(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

dlad::plane::GpuSpec gpu_of(const GpuTuple& t) {
    const auto& [context, kernel, int8, input_scale, canvas_h, canvas_w, max_det, slots,
                 patterns] = t;
    dlad::plane::GpuSpec g;
    g.context = ptr<void>(context);
    g.pre_kernel = ptr<void>(kernel);
    g.int8 = int8;
    g.input_scale = input_scale;
    g.canvas_h = canvas_h;
    g.canvas_w = canvas_w;
    g.max_det = max_det;
    for (const auto& [stream, image, staging, staging_device, image_bytes, input, ready,
                      ready_device, done, done_device, ready_semaphore, done_semaphore, post_copy,
                      post_reuse, frame, out, outputs] : slots) {
        std::vector<uint8_t*> hosts;
        for (uintptr_t a : outputs) hosts.push_back(ptr<uint8_t>(a));
        g.slots.push_back({ptr<void>(stream), image, ptr<uint8_t>(staging), staging_device,
                           image_bytes, input, ptr<uint32_t>(ready), ready_device,
                           ptr<uint32_t>(done), done_device, ptr<void>(ready_semaphore),
                           ptr<void>(done_semaphore), ptr<void>(post_copy),
                           ptr<void>(post_reuse), ptr<uint8_t>(frame), ptr<const float>(out),
                           std::move(hosts)});
    }
    g.patterns = patterns;
    return g;
}

dlad::plane::CudlaSpec cudla_of(const CudlaTuple& t) {
    const auto& [device, module, wait_context, flags, timeout_us, slots] = t;
    dlad::plane::CudlaSpec c;
    c.device = ptr<void>(device);
    c.module = ptr<void>(module);
    c.wait_context = ptr<void>(wait_context);
    c.flags = flags;
    c.timeout_us = timeout_us;
    const auto registered = [](const std::vector<uintptr_t>& addresses) {
        std::vector<uint64_t*> out;
        for (uintptr_t a : addresses) out.push_back(ptr<uint64_t>(a));
        return out;
    };
    for (const auto& [inputs, outputs, signal] : slots) {
        c.slots.push_back({registered(inputs), registered(outputs), ptr<uint64_t>(signal)});
    }
    return c;
}

dlad::plane::CudlaApi cudla_api_of(const CudlaApiTuple& t) {
    const auto& [submit, last_error, wait, clear] = t;
    dlad::plane::CudlaApi c;
    c.submit_task = reinterpret_cast<decltype(c.submit_task)>(submit);
    c.get_last_error = reinterpret_cast<decltype(c.get_last_error)>(last_error);
    c.fence_wait = reinterpret_cast<decltype(c.fence_wait)>(wait);
    c.fence_clear = reinterpret_cast<decltype(c.fence_clear)>(clear);
    return c;
}

dlad::plane::CudaApi cuda_of(const CudaTuple& t) {
    const auto& [set_current, memcpy, launch, write, wait, graph, host, geq, signal_ext,
                 wait_ext] = t;
    dlad::plane::CudaApi c;
    c.ctx_set_current = reinterpret_cast<decltype(c.ctx_set_current)>(set_current);
    c.memcpy_htod_async = reinterpret_cast<decltype(c.memcpy_htod_async)>(memcpy);
    c.launch_kernel = reinterpret_cast<decltype(c.launch_kernel)>(launch);
    c.write_value32 = reinterpret_cast<decltype(c.write_value32)>(write);
    c.wait_value32 = reinterpret_cast<decltype(c.wait_value32)>(wait);
    c.graph_launch = reinterpret_cast<decltype(c.graph_launch)>(graph);
    c.launch_host_func = reinterpret_cast<decltype(c.launch_host_func)>(host);
    c.wait_geq = geq;
    c.signal_external = reinterpret_cast<decltype(c.signal_external)>(signal_ext);
    c.wait_external = reinterpret_cast<decltype(c.wait_external)>(wait_ext);
    return c;
}

std::unique_ptr<dlad::plane::Plane> make_plane(
    const std::string& libzmq, uintptr_t router, uintptr_t forward,
    const std::tuple<uint64_t, uint64_t, int64_t, int64_t, int64_t>& limits,
    const std::vector<PlaneDevice>& devices,
    std::map<std::string, std::vector<std::string>> models,
    const std::map<std::string, std::tuple<double, double, int64_t>>& settings,
    double default_deadline_ms,
    double max_deadline_ms, int64_t max_in_flight_per_client, uint64_t max_buffered_bytes,
    const std::string& policy, double alpha,
    std::unordered_map<std::string, std::string> pins, bool shm, bool curve,
    const std::optional<CudaTuple>& cuda, const std::optional<CudlaApiTuple>& cudla,
    std::shared_ptr<dlad::plane::SharedDram> dram,
    const std::tuple<int64_t, bool, double, double>& health, double cheap_requests_per_s) {
    dlad::plane::Config c;
    c.cheap_requests_per_s = cheap_requests_per_s;
    c.limits = limits_of(limits);
    const auto& [quarantine_after, retry, probe_after_s, probe_max_s] = health;
    c.health = {quarantine_after, retry, probe_after_s, probe_max_s};
    for (const auto& [name, latency_us, slots, capacity, gpu, core, kind, max_batch, delay_us,
                      curve_us, tier, run, graphs] : devices) {
        dlad::plane::DeviceSpec d;
        d.name = name;
        d.latency_us = latency_us;
        d.slots = slots;
        d.capacity = capacity;
        d.kind = kind;
        d.max_batch = max_batch;
        d.max_queue_delay_us = delay_us;
        d.curve_us = curve_us;
        d.tier = tier;
        if (gpu) d.gpu = gpu_of(*gpu);
        if (core) d.cudla = cudla_of(*core);
        for (uintptr_t g : graphs) d.graphs.push_back(ptr<void>(g));
        if (!run.is_none()) {
            d.make = [name = name, slots = slots, max_batch = max_batch,
                      run = run](dlad::plane::OnFinished on_done) {
                return std::make_unique<dlad::plane::PythonEngine>(name, slots, max_batch, run,
                                                                   std::move(on_done));
            };
        }
        c.devices.push_back(std::move(d));
    }
    if (cuda) c.cuda = cuda_of(*cuda);
    if (cudla) c.cudla = cudla_api_of(*cudla);
    c.dram = std::move(dram);
    c.models = std::move(models);
    for (const auto& [model, t] : settings) {
        const auto& [conf, iou, max_det] = t;
        c.settings[model] = {conf, iou, max_det};
    }
    c.default_deadline_ms = default_deadline_ms;
    c.max_deadline_ms = max_deadline_ms;
    c.max_in_flight_per_client = max_in_flight_per_client;
    c.max_buffered_bytes = max_buffered_bytes;
    c.policy = policy_of(policy);
    c.alpha = alpha;
    c.pins = std::move(pins);
    c.shm = shm;
    c.curve = curve;
    return std::make_unique<dlad::plane::Plane>(
        dlad::plane::ZmqApi::load(libzmq), reinterpret_cast<void*>(router),
        reinterpret_cast<void*>(forward), std::move(c));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "dlad's C++ core (dlad/native/): the native data plane, its scheduler and the "
              "INFER codec; used through dlad.native_plane.";
    m.def("logit_cut", [](double conf) { return static_cast<double>(dlad::rules::logit_cut(conf)); },
          py::arg("conf"), "The decode's logit cut for a confidence threshold (frame_rules.hpp).");
    m.def(
        "letterbox_geometry",
        [](int src_w, int src_h, int dst_w, int dst_h) {
            const auto g = dlad::rules::letterbox_geometry(src_w, src_h, dst_w, dst_h);
            return py::make_tuple(g.scale, g.pad_x, g.pad_y, g.new_w, g.new_h);
        },
        py::arg("src_w"), py::arg("src_h"), py::arg("dst_w"), py::arg("dst_h"),
        "(scale, pad_x, pad_y, new_w, new_h) of a letterbox (frame_rules.hpp).");
    m.def("scaled_extent", &dlad::rules::scaled_extent, py::arg("src"), py::arg("scale"),
          py::arg("dst"), "A resized extent on the canvas (frame_rules.hpp).");
    m.def(
        "yuv_coefficients",
        [](int colour) {
            const auto c = dlad::rules::yuv_coefficients(colour);
            return py::make_tuple(c.ky, c.rv, c.gu, c.gv, c.bu, c.y_offset);
        },
        py::arg("colour"),
        "(ky, rv, gu, gv, bu, y_offset) of a YUV frame's colour code (frame_rules.hpp).");
    m.def("row_bytes", &dlad::rules::row_bytes, py::arg("format"), py::arg("width"),
          "The bytes between a frame's rows in a pixel format's code (frame_rules.hpp).");
    m.def("wire_constants", [] {
        namespace w = dlad::wire;
        const w::Limits limits;
        py::dict d;
        d["protocol_version"] = w::kProtocolVersion;
        d["infer"] = w::kInfer;
        d["infer_reply"] = w::kInferReply;
        d["priority_max"] = w::kPriorityMax;
        d["max_deadline_ms"] = w::kMaxDeadlineMs;
        d["max_det"] = w::kMaxDet;
        d["max_name_chars"] = w::kMaxNameChars;
        d["max_shm_bytes"] = w::kMaxShmBytes;
        d["max_shm_name"] = w::kMaxShmName;
        d["shm_header_bytes"] = w::kShmHeaderBytes;
        d["shm_token_bytes"] = w::kShmTokenBytes;
        d["limits"] = py::make_tuple(limits.max_message_bytes, limits.max_header_bytes,
                                     limits.max_width, limits.max_height, limits.max_image_pixels);
        py::dict kinds;
        for (const auto& [kind, keys] : w::header_keys()) {
            kinds[py::int_(kind)] = py::make_tuple(keys.required, keys.optional);
        }
        d["header"] = kinds;
        d["image"] = w::image_keys();
        d["image_optional"] = w::image_optional_keys();
        d["shm"] = w::shm_keys();
        d["max_batch_images"] = w::kMaxBatchImages;
        d["max_request_depth"] = w::kMaxRequestDepth;
        return d;
    });
    m.def("decode_request", &decode_request, py::arg("header"), py::arg("payloads"),
          py::arg("limits"), py::arg("shm"),
          "The daemon's request decoder (dlad/native/wire.hpp), for protocol.decode_request.");
    m.def("write_infer_reply", &write_infer_reply, py::arg("id"), py::arg("status"),
          py::arg("message"), py::arg("device"), py::arg("timing"), py::arg("count"));
    m.def("shm_guard_install", &dlad::shm_guard::install,
          "Install the SIGBUS guard of mapped client segments (shm_guard.hpp); idempotent.");
    m.def("shm_watch", [](uintptr_t base, size_t size) { return dlad::shm_guard::watch(base, size); },
          py::arg("base"), py::arg("size"),
          "Guard the mapping at base; False where the table is full.");
    m.def("shm_forget", [](uintptr_t base) { dlad::shm_guard::forget(base); }, py::arg("base"));
    m.def("shm_broken", [](uintptr_t base) { return dlad::shm_guard::broken(base); },
          py::arg("base"), "Whether a SIGBUS hit the guarded mapping at base.");
    m.def("shm_faults", &dlad::shm_guard::faults, "SIGBUS faults the guard absorbed.");
    m.def(
        "write_refusal_reply",
        [](std::optional<uint64_t> id, std::optional<int64_t> kind, int64_t status,
           const std::string& message) {
            bool payload_frame = false;
            dlad::wire::Refusal r{"", message, id, kind};
            std::string header = dlad::wire::write_refusal_reply(r, status, message, &payload_frame);
            return py::make_tuple(py::bytes(header), payload_frame);
        },
        py::arg("id"), py::arg("kind"), py::arg("status"), py::arg("message"),
        "The plane's reply to a refused request: (header, whether an empty payload follows).");
    m.def("cudla_status_name", &dlad::plane::cudla_status_name, py::arg("status"),
          "The C name of a cudlaStatus, as the plane's replies spell it.");
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const dlad::UnknownDevice& e) {
            PyErr_SetString(PyExc_KeyError, e.what());
        }
    });
    py::class_<dlad::plane::Plane>(m, "Plane")
        .def(py::init(&make_plane), py::arg("libzmq"), py::arg("router"), py::arg("forward"),
             py::arg("limits"), py::arg("devices"), py::arg("models"), py::arg("settings"),
             py::arg("default_deadline_ms"), py::arg("max_deadline_ms"),
             py::arg("max_in_flight_per_client"), py::arg("max_buffered_bytes"),
             py::arg("policy"), py::arg("alpha"), py::arg("pins"), py::arg("shm"),
             py::arg("curve"), py::arg("cuda"), py::arg("cudla"), py::arg("dram"),
             py::arg("health"), py::arg("cheap_requests_per_s"))
        .def("start", &dlad::plane::Plane::start)
        .def("close", &dlad::plane::Plane::close, py::call_guard<py::gil_scoped_release>())
        .def("drain", &dlad::plane::Plane::drain, py::arg("timeout_ms"),
             py::call_guard<py::gil_scoped_release>())
        .def("send",
             [](dlad::plane::Plane& p, std::string client, std::vector<std::string> frames,
                const py::bytes& conn) {
                 p.send(std::move(client), std::move(frames), std::string(conn));
             })
        .def(
            "cancel",
            [](dlad::plane::Plane& p, const std::string& client, uint64_t request_id) {
                return static_cast<int>(p.cancel(client, request_id));
            },
            py::arg("client"), py::arg("request_id"), py::call_guard<py::gil_scoped_release>())
        .def(
            "submit",
            [](dlad::plane::Plane& p, const std::string& client, const std::string& owner,
               uint64_t request_id, std::optional<int64_t> tag,
               const std::vector<PlaneItem>& items, const py::bytes& conn) {
                const auto connection = static_cast<std::string>(conn);
                std::vector<dlad::plane::Item> out;
                out.reserve(items.size());
                for (const auto& [model, stream, priority, deadline_ms, size, shm, offset, image,
                                  pixels] : items) {
                    const auto& [h, w, format, colour, conf, iou, max_det] = image;
                    auto bytes = static_cast<std::string>(pixels);
                    out.push_back({model, stream, priority, deadline_ms, size, shm, offset,
                                   {h, w, format, colour, conf, iou, max_det},
                                   bytes.empty() ? nullptr
                                                 : std::make_shared<const std::string>(
                                                       std::move(bytes))});
                }
                py::gil_scoped_release release;
                return p.submit(client, owner, request_id, tag, std::move(out), connection);
            },
            py::arg("client"), py::arg("owner"), py::arg("request_id"), py::arg("tag"),
            py::arg("items"), py::arg("conn"))
        .def("state",
             [](dlad::plane::Plane& p) {
                 dlad::plane::State s;
                 {
                     py::gil_scoped_release release;
                     s = p.state();
                 }
                 py::list devices;
                 for (const auto& d : s.devices) {
                     const auto busy = s.busy_ns.find(d.name);
                     const auto failed = s.failed.find(d.name);
                     const auto failing = s.failing.find(d.name);
                     const auto why = s.last_failure.find(d.name);
                     const auto out = s.quarantined.find(d.name);
                     const auto times = s.quarantines.find(d.name);
                     devices.append(py::make_tuple(
                         d.name, d.queue_depth, d.capacity, d.in_flight, d.service_time_us,
                         d.completed, busy == s.busy_ns.end() ? int64_t{0} : busy->second,
                         failed == s.failed.end() ? int64_t{0} : failed->second,
                         failing == s.failing.end() ? int64_t{0} : failing->second,
                         why == s.last_failure.end() ? std::string() : why->second,
                         out == s.quarantined.end() ? py::object(py::none())
                                                    : py::object(py::str(out->second)),
                         times == s.quarantines.end() ? int64_t{0} : times->second,
                         d.max_batch, py::tuple(py::cast(d.batches)), d.host_us));
                 }
                 return py::make_tuple(devices, s.queued, s.streams_waiting);
             })
        .def(
            "add_segment",
            [](dlad::plane::Plane& p, const std::string& owner, const std::string& name,
               uint64_t size, const py::bytes& token, uintptr_t host, uint64_t device) {
                return p.add_segment(owner, name, size, std::string(token),
                                     ptr<const uint8_t>(host), device);
            },
            py::arg("owner"), py::arg("name"), py::arg("size"), py::arg("token"), py::arg("host"),
            py::arg("device"), py::call_guard<py::gil_scoped_release>())
        .def("drop_segment", &dlad::plane::Plane::drop_segment, py::arg("owner"),
             py::arg("name"), py::call_guard<py::gil_scoped_release>())
        .def("idle_segments", &dlad::plane::Plane::idle_segments, py::arg("idle_ms"),
             py::call_guard<py::gil_scoped_release>())
        .def("take_observations",
             [](dlad::plane::Plane& p) {
                 const auto obs = p.take_observations();
                 py::list out;
                 for (const auto& o : obs) {
                     out.append(py::make_tuple(o.model, o.device, o.status, o.queue_us,
                                               o.device_us, o.total_us));
                 }
                 return out;
             })
        .def("quarantine", &dlad::plane::Plane::quarantine, py::arg("device"), py::arg("reason"),
             py::call_guard<py::gil_scoped_release>())
        .def("warm_up", &dlad::plane::Plane::warm_up, py::arg("devices"),
             py::call_guard<py::gil_scoped_release>())
        .def("probe_now", &dlad::plane::Plane::probe_now, py::arg("device"),
             py::call_guard<py::gil_scoped_release>())
        .def("take_events",
             [](dlad::plane::Plane& p) {
                 py::list out;
                 for (const auto& e : p.take_events()) {
                     out.append(py::make_tuple(static_cast<int>(e.kind), e.device, e.reason,
                                               e.seconds, py::bytes(e.client), e.request_id,
                                               e.to));
                 }
                 return out;
             })
        .def_property_readonly("pending", &dlad::plane::Plane::pending)
        .def("spoke", &dlad::plane::Plane::spoke, py::arg("fd"))
        .def("connection_opened", &dlad::plane::Plane::connection_opened, py::arg("fd"))
        .def("connection_closed", &dlad::plane::Plane::connection_closed, py::arg("fd"),
             py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("buffered_bytes", &dlad::plane::Plane::buffered_bytes)
        .def_property_readonly("draining", &dlad::plane::Plane::draining)
        .def("counters", [](const dlad::plane::Plane& p) {
            const auto c = p.counters();
            py::dict out;
            out["received"] = c.received;
            out["forwarded"] = c.forwarded;
            out["refused_over_rate"] = c.refused_over_rate;
            out["refused_busy"] = c.refused_busy;
            out["dropped_over_rate"] = c.dropped_over_rate;
            out["cut"] = c.cut;
            out["orphaned"] = c.orphaned;
            out["cancelled_on_close"] = c.cancelled_on_close;
            out["replied"] = c.replied;
            out["dropped"] = c.dropped;
            out["forward_lost"] = c.forward_lost;
            out["observations_lost"] = c.observations_lost;
            out["shm_frames"] = c.shm_frames;
            out["gpu_errors"] = c.gpu_errors;
            out["last_gpu_error"] = c.last_gpu_error;
            out["by_status"] = c.by_status;
            return out;
        });
    // The emulated DRAM (dlad/devices/dram.py's SharedDram wraps it): one per daemon, shared by
    // the plane's timing cores and the Python engines' emulated devices. Every call releases
    // the GIL before it takes the model's lock; a Python clock (tests) takes the GIL back for
    // each reading.
    using Dram = dlad::plane::SharedDram;
    using release = py::call_guard<py::gil_scoped_release>;
    py::class_<Dram, std::shared_ptr<Dram>>(m, "SharedDram")
        .def(py::init([](double contention,
                         const std::map<std::pair<std::string, std::string>, double>& k,
                         std::optional<py::function> clock) {
                 std::function<int64_t()> read;
                 if (clock) {
                     // released wherever the model goes, with the GIL taken for it
                     std::shared_ptr<py::function> held(
                         new py::function(std::move(*clock)), [](py::function* f) {
                             py::gil_scoped_acquire gil;
                             delete f;
                         });
                     read = [clock = std::move(held)] {
                         py::gil_scoped_acquire gil;
                         return (*clock)().cast<int64_t>();
                     };
                 }
                 return std::make_shared<Dram>(contention, coefficients(k), std::move(read));
             }),
             py::arg("contention"), py::arg("k"), py::arg("clock") = py::none())
        .def_property_readonly("contention", &Dram::contention)
        .def(
            "begin",
            [](Dram& d, const std::string& kind, double work_ns) {
                const auto k = engine_kind(kind);  // throws before the GIL goes
                py::gil_scoped_release gil;
                return d.begin(k, work_ns);
            },
            py::arg("kind"), py::arg("work_ns"))
        .def("finish", &Dram::finish, release())
        .def("end_ns", &Dram::end_ns, release())
        .def("done_ns", &Dram::done_ns, release())
        .def("slowdown", &Dram::slowdown, release())
        .def("wake", &Dram::wake, release())
        .def(
            "wait_for",
            [](Dram& d, int64_t id, std::optional<int64_t> deadline_ns, uint64_t since) {
                int64_t done_at = 0;
                Dram::Waited w = Dram::Waited::woken;
                {
                    py::gil_scoped_release gil;
                    w = d.wait_for(id, deadline_ns, since, &done_at);
                }
                const char* words = w == Dram::Waited::done      ? "done"
                                    : w == Dram::Waited::expired ? "expired"
                                                                 : "woken";
                return py::make_tuple(words, done_at);
            },
            py::arg("id"), py::arg("deadline_ns"), py::arg("since"))
        .def("wakes", &Dram::wakes, release());
    py::class_<Scheduler>(m, "Scheduler")
        .def(py::init([](double alpha, const std::string& policy,
                         std::vector<std::tuple<std::string, std::string, double>> interference,
                         std::unordered_map<std::string, std::string> pins) {
            return new Scheduler(alpha, policy_of(policy), std::move(interference),
                                 std::move(pins));
        }))
        .def_property(
            "policy", [](const Scheduler& s) { return policy_name(s.policy); },
            [](Scheduler& s, const std::string& p) { s.policy = policy_of(p); })
        .def("add_device", &Scheduler::add_device)
        .def("models", &Scheduler::models)
        .def("admit",
             [](Scheduler& s, int64_t id, std::string model, int64_t deadline_ns,
                int64_t priority, std::optional<std::string> stream, std::string owner,
                const std::vector<std::string>& avoid, int64_t now) -> py::tuple {
                 auto r = s.admit(spec(id, std::move(model), deadline_ns, priority,
                                       std::move(stream), std::move(owner)),
                                  avoid, now);
                 if (r.refusal != dlad::Refusal::none) {
                     py::list full;
                     for (const auto& q : r.full) full.append(py::make_tuple(q.name, q.depth, q.capacity));
                     return py::make_tuple(static_cast<int>(r.refusal), py::none(),
                                           py::cast(r.unhealthy), full);
                 }
                 return py::make_tuple(0, placed(r.placed), py::cast(r.superseded), py::none());
             })
        .def("displace_for",
             [](Scheduler& s, int64_t id, std::string model, int64_t deadline_ns,
                int64_t priority, std::optional<std::string> stream, std::string owner) {
                 return s.displace_for(spec(id, std::move(model), deadline_ns, priority,
                                            std::move(stream), std::move(owner)));
             })
        .def("pinned", &Scheduler::pinned)
        .def("next_job", &Scheduler::next_job)
        .def("next_batch",
             [](Scheduler& s, const std::string& device, std::optional<int64_t> max_batch,
                double delay_us, int64_t now) {
                 auto b = s.next_batch(device, max_batch, delay_us, now);
                 return py::make_tuple(b.jobs, b.expired, b.wait_until_ns);
             })
        .def("finished", &Scheduler::finished)
        .def("finished_batch", &Scheduler::finished_batch)
        .def("set_resource", &Scheduler::set_resource)
        .def("host", &Scheduler::host)
        .def("set_load", &Scheduler::set_load)
        .def("load", &Scheduler::load)
        .def("set_available", &Scheduler::set_available)
        .def("available", &Scheduler::available)
        .def("admit_probe",
             [](Scheduler& s, const std::string& device, int64_t id, std::string model,
                int64_t deadline_ns, int64_t priority, std::string owner,
                int64_t now) -> py::object {
                 dlad::Placed p;
                 if (!s.admit_probe(device,
                                    spec(id, std::move(model), deadline_ns, priority,
                                         std::nullopt, std::move(owner)),
                                    now, &p)) {
                     return py::none();
                 }
                 return placed(p);
             })
        .def("expire", &Scheduler::expire)
        .def("earliest_deadline", &Scheduler::earliest_deadline)
        .def("cancel", &Scheduler::cancel)
        .def("drain", &Scheduler::drain)
        .def("queued", [](const Scheduler& s, std::optional<std::string> device) {
            return device ? s.queued(*device) : s.queued();
        })
        .def("has_queued", &Scheduler::has_queued)
        .def("streams_waiting", &Scheduler::streams_waiting)
        .def("in_flight", &Scheduler::in_flight)
        .def("service_us", &Scheduler::service_us)
        .def("snapshot", [](const Scheduler& s) {
            py::list out;
            for (const auto& d : s.snapshot()) {
                out.append(py::make_tuple(d.name, d.queue_depth, d.capacity, d.in_flight,
                                          d.service_time_us, d.completed, d.max_batch,
                                          py::tuple(py::cast(d.batches)), d.available,
                                          d.host_us, d.resource));
            }
            return out;
        });
}
