// dlad_wire._rules: the wire's rules for the SDK, from the headers the daemon compiles too
// (names.hpp, frames.hpp): one statement of each rule, two bindings.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string_view>
#include <tuple>
#include <vector>

#include "frames.hpp"
#include "names.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_rules, m) {
    m.doc() = "The wire's rules (names, pixel formats), shared with the daemon's C++ decoder.";
    m.attr("MAX_NAME_CHARS") = dlad::names::kMaxNameChars;
    m.attr("PIXEL_FORMATS") = py::make_tuple("RGB", "BGR", "GRAY", "NV12", "YUYV");
    m.def(
        "is_name",
        [](const py::str& name) {
            Py_ssize_t n = 0;
            const char* utf8 = PyUnicode_AsUTF8AndSize(name.ptr(), &n);
            if (utf8 == nullptr) {  // a lone surrogate: not valid UTF-8, so no name
                PyErr_Clear();
                return false;
            }
            return dlad::names::is_name(std::string_view(utf8, static_cast<size_t>(n)));
        },
        py::arg("name"), "Whether a str is a name: 1 to 128 printable characters (names.hpp).");
    m.def("printable", [](uint32_t c) { return dlad::names::printable(static_cast<char32_t>(c)); },
          py::arg("code_point"), "Whether a name may hold this character (names.hpp).");
    m.def("frame_shape", [](int format, int64_t height, int64_t width) {
              const auto s = dlad::rules::frame_shape(format, height, width);
              py::tuple out(s.size());
              for (size_t i = 0; i < s.size(); ++i) out[i] = s[i];
              return out;
          },
          py::arg("format"), py::arg("height"), py::arg("width"),
          "The array shape of a frame in a pixel format's code (frames.hpp).");
    m.def("frame_size", [](int format, const std::vector<int64_t>& shape) {
              const auto f = dlad::rules::frame_size(format, shape);
              return std::make_tuple(f.height, f.width, static_cast<int>(f.problem));
          },
          py::arg("format"), py::arg("shape"),
          "(height, width, problem) of a frame of an array shape: problem 0 none, 1 not a shape "
          "of the format, 2 odd sides where the format needs even ones (frames.hpp).");
}
