// The per-frame rules every path shares, written once: the letterbox geometry a frame is drawn
// on and the decode's logit cut. The GPU chain uses them here; Python reads them through
// dlad._native (dlad.imaging.pre.letterbox_geometry, dlad.imaging.post.logit_cut), so the CPU
// reference, the Python engines and the C++ plane compute the same numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

namespace dlad::rules {

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
