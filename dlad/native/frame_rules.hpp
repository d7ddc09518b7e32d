// The per-frame rules every path shares, written once: a frame's pixel formats and their bytes
// (frames.hpp, the wire's, which the SDK shares), the YUV -> RGB coefficients, the letterbox
// geometry a frame is drawn on and the decode's logit cut. The GPU chain uses them here; Python reads them through
// dlad._native (dlad.imaging.pre.letterbox_geometry, dlad.imaging.post.logit_cut), so the CPU
// reference, the Python engines and the C++ plane compute the same numbers.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

#include "frames.hpp"  // the wire's pixel formats (clients/dlad_wire/native)

namespace dlad::rules {

// A YUV frame's colour: its matrix (BT.601 or BT.709) and range (limited: Y 16..235 and
// chroma 16..240; full: 0..255), as protocol.Colour codes it: bit 0 BT.709, bit 1 full range.
constexpr int kBt709 = 1, kFullRange = 2;

// The YUV -> RGB conversion of one sample, float32 with every step rounded (no FMA):
//   y = (float)(Y - y_offset) * ky;  u = (float)(U - 128);  v = (float)(V - 128)
//   R = y + rv * v;  G = (y - gu * u) - gv * v;  B = y + bu * u
// then each rounded half away from zero and clamped to 0..255. The coefficients come from the
// matrix's Kr and Kb (Kg = 1 - Kr - Kb) in double, scaled by 255/219 (luma) and 255/224
// (chroma) for the limited range, and rounded to float once.
struct YuvCoefficients {
    float ky = 1, rv = 0, gu = 0, gv = 0, bu = 0;
    int y_offset = 0;
};

inline YuvCoefficients yuv_coefficients(int colour) {
    const double kr = (colour & kBt709) ? 0.2126 : 0.299;
    const double kb = (colour & kBt709) ? 0.0722 : 0.114;
    const double kg = 1.0 - kr - kb;
    const bool full = (colour & kFullRange) != 0;
    const double luma = full ? 1.0 : 255.0 / 219.0, chroma = full ? 1.0 : 255.0 / 224.0;
    YuvCoefficients c;
    c.ky = static_cast<float>(luma);
    c.rv = static_cast<float>(2.0 * (1.0 - kr) * chroma);
    c.gu = static_cast<float>(2.0 * kb * (1.0 - kb) / kg * chroma);
    c.gv = static_cast<float>(2.0 * kr * (1.0 - kr) / kg * chroma);
    c.bu = static_cast<float>(2.0 * (1.0 - kb) * chroma);
    c.y_offset = full ? 0 : 16;
    return c;
}

// The resized image's extent on the canvas: half-up rounding, clamped to [1, dst], so a
// 1-pixel-wide source never vanishes and float error in min(dst/src) never pushes the image
// past the canvas edge.
inline int scaled_extent(int src, double scale, int dst) {
    return std::min(dst, std::max(1, static_cast<int>(std::floor(src * scale + 0.5))));
}

// One letterbox: a src_w x src_h image scaled by `scale` to new_w x new_h and centred (pad_x,
// pad_y) on a dst_w x dst_h canvas.
struct Letterbox {
    double scale = 0;
    int pad_x = 0, pad_y = 0, src_w = 0, src_h = 0, dst_w = 0, dst_h = 0, new_w = 0, new_h = 0;
};

inline Letterbox letterbox_geometry(int src_w, int src_h, int dst_w, int dst_h) {
    Letterbox g;
    g.scale = std::min(static_cast<double>(dst_w) / src_w, static_cast<double>(dst_h) / src_h);
    g.new_w = scaled_extent(src_w, g.scale, dst_w);
    g.new_h = scaled_extent(src_h, g.scale, dst_h);
    g.pad_x = (dst_w - g.new_w) / 2;
    g.pad_y = (dst_h - g.new_h) / 2;
    g.src_w = src_w;
    g.src_h = src_h;
    g.dst_w = dst_w;
    g.dst_h = dst_h;
    return g;
}

// The logit below which no sigmoid passes `conf`, less a margin, in float32 (the decode kernels'
// FrameParams.obj_cut): S(x) > conf <=> x > logit(conf), and the margin keeps float rounding near
// the boundary from dropping a row the exact score test would keep (that test is authoritative).
inline float logit_cut(double conf) {
    if (conf == 0) return -std::numeric_limits<float>::infinity();
    return static_cast<float>(std::log(conf / (1 - conf)) - 1e-3);
}

}  // namespace dlad::rules
