// The wire's pixel formats, written once: which numpy shapes a frame of each format has, and its
// bytes. The daemon (its decoder, the plane and the GPU chain, through dlad/native/frame_rules.hpp)
// and the SDK (dlad_wire._rules, behind dlad_wire.protocol.frame_shape / frame_size) both use it.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace dlad::rules {

// A frame's pixel formats (protocol.PIXEL_FORMATS, in this order): packed RGB, BGR and GRAY;
// NV12 (a W x H luma plane, then W/2 x H/2 interleaved U,V pairs: W and H even) and YUYV
// (4:2:2, Y0 U Y1 V per two pixels: W even), rows tightly packed.
enum PixelFormat : int { kRgb = 0, kBgr = 1, kGray = 2, kNv12 = 3, kYuyv = 4 };
constexpr std::array<std::string_view, 5> kPixelFormats = {"RGB", "BGR", "GRAY", "NV12", "YUYV"};

inline bool is_yuv(int format) { return format == kNv12 || format == kYuyv; }

// The bytes of a width x height frame in `format`.
inline uint64_t frame_bytes(int format, int64_t height, int64_t width) {
    const auto px = static_cast<uint64_t>(height) * static_cast<uint64_t>(width);
    switch (format) {
        case kGray: return px;
        case kNv12: return px + px / 2;
        case kYuyv: return 2 * px;
        default: return 3 * px;
    }
}

// The bytes between two rows of a frame (a NV12 frame's luma rows; its chroma rows are as long).
inline int64_t row_bytes(int format, int64_t width) {
    switch (format) {
        case kGray:
        case kNv12: return width;
        case kYuyv: return 2 * width;
        default: return 3 * width;
    }
}

// The array shape of a width x height frame in `format`: H x W x 3 (RGB, BGR), H x W x 1
// (GRAY), 3H/2 x W (NV12, as FFmpeg and OpenCV lay it out) or H x W x 2 (YUYV).
inline std::vector<int64_t> frame_shape(int format, int64_t height, int64_t width) {
    switch (format) {
        case kNv12: return {height + height / 2, width};
        case kYuyv: return {height, width, 2};
        case kGray: return {height, width, 1};
        default: return {height, width, 3};
    }
}

// What a frame of array `shape` in `format` is: its (height, width), or why it is none.
enum class ShapeProblem : int { kNone = 0, kShape = 1, kOddSides = 2 };
struct FrameSize {
    int64_t height = 0, width = 0;
    ShapeProblem problem = ShapeProblem::kNone;
};
inline FrameSize frame_size(int format, std::vector<int64_t> shape) {
    FrameSize out;
    if (format == kGray && shape.size() == 2) shape.push_back(1);  // a gray frame may be H x W
    const bool planar = format == kNv12 && shape.size() == 2;
    out.height = shape.empty() ? 0 : planar ? shape[0] * 2 / 3 : shape[0];
    out.width = shape.size() > 1 ? shape[1] : 0;
    if (out.height < 1 || out.width < 1 || shape != frame_shape(format, out.height, out.width)) {
        out.problem = ShapeProblem::kShape;
    } else if (is_yuv(format) && (out.width % 2 || (format == kNv12 && out.height % 2))) {
        out.problem = ShapeProblem::kOddSides;
    }
    return out;
}

}  // namespace dlad::rules
