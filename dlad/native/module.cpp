// dlad._native: the C++ scheduler core (scheduler.hpp) for Python. dlad/native_scheduler.py
// wraps it in dlad.scheduler.Scheduler's interface; nothing else imports this module.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "scheduler.hpp"

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

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "dlad's scheduler core in C++ (dlad/native/); use dlad.native_scheduler.";
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const dlad::UnknownDevice& e) {
            PyErr_SetString(PyExc_KeyError, e.what());
        }
    });
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
                                          py::tuple(py::cast(d.batches)), d.available));
            }
            return out;
        });
}
