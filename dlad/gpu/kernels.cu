// dlad's GPU pre- and post-processing kernels, compiled at daemon start with NVRTC
// (dlad/gpu/compile.py) and cached on disk by source hash.
//
// The numpy reference in dlad/imaging/pre.py, dlad/imaging/post.py and each model family's
// module (dlad/families) is the specification: every float32 step below is the one named there, done with explicit round-to-nearest
// intrinsics (__fadd_rn, __fmul_rn, ...) so that the compiler cannot fuse a multiply-add and
// change a rounding. Where the GPU cannot be bit-exact (expf vs numpy's exp, 1-2 ulp) the
// tolerance is stated in the parity tests.
//
// No headers: NVRTC compiles this without an include path (fp16 conversions are PTX cvt), as
// one program with every family's decode kernels (dlad/families/*.cu) appended.
// Struct layouts are mirrored by ctypes.Structure classes in dlad/gpu/prepost.py: 8-byte
// fields first, then 4-byte fields, no implicit padding.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define DLAD_MAX_LEVELS 4
#define DLAD_MAX_ANCHORS 4
#define DLAD_SORT_CAPACITY 8192  // candidates entering NMS at most (power of two)
#define DLAD_MASK_WORDS (DLAD_SORT_CAPACITY / 64)
#define DLAD_SHARED_ROWS 1024  // up to this many NMS candidates, NMS runs in shared memory
#define DLAD_SHARED_COLS (DLAD_SHARED_ROWS / 32)

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 float_to_half_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// --------------------------------------------------------------------------------- pre

// Pixel formats (dlad/native/frame_rules.hpp: rules::PixelFormat)
enum { FMT_RGB = 0, FMT_BGR = 1, FMT_GRAY = 2, FMT_NV12 = 3, FMT_YUYV = 4 };

struct PreParams {
    const u8* src;        // the frame, rows `src_pitch` bytes apart (NV12: its chroma rows follow)
    void* dst;            // DLA_HWC4 int8 [H][dst_pitch_px][4] or CHW16 fp16 [G][H][W][16]
    int src_w, src_h, src_pitch, src_fmt;  // src_fmt: FMT_*
    int y_offset;         // YUV: 16 (limited range) or 0 (full)
    int dst_w, dst_h, dst_pitch_px;      // dst_pitch_px: W_padded of DLA_HWC4 (= dst_w for CHW16)
    int new_w, new_h, pad_x, pad_y;      // letterbox geometry (dlad.imaging.pre.Letterbox)
    float scale;          // (float)Letterbox.scale
    float input_scale;    // int8 input scale (HWC4 only)
    int pad_value;        // 0..255
    float ky, rv, gu, gv, bu;  // YUV -> RGB (rules::yuv_coefficients)
};

// rules::yuv_coefficients' conversion of one sample, float32 without FMA, rounded half away
// from zero and clamped (dlad.imaging.pre.yuv_to_rgb).
__device__ __forceinline__ u8 clamp_u8(float v) {
    return (u8)fminf(fmaxf(roundf(v), 0.0f), 255.0f);
}

__device__ __forceinline__ void yuv_rgb(const PreParams& p, int Y, int U, int V, float out[3]) {
    float y = __fmul_rn((float)(Y - p.y_offset), p.ky);
    float u = (float)(U - 128), v = (float)(V - 128);
    out[0] = (float)clamp_u8(__fadd_rn(y, __fmul_rn(p.rv, v)));
    out[1] = (float)clamp_u8(__fsub_rn(__fsub_rn(y, __fmul_rn(p.gu, u)), __fmul_rn(p.gv, v)));
    out[2] = (float)clamp_u8(__fadd_rn(y, __fmul_rn(p.bu, u)));
}

// The RGB of source pixel (x, y), each channel as the float of its uint8.
__device__ __forceinline__ void source_rgb(const PreParams& p, int x, int y, float out[3]) {
    const u8* row = p.src + (long long)y * p.src_pitch;
    switch (p.src_fmt) {
        case FMT_NV12: {
            const u8* uv = p.src + (long long)p.src_h * p.src_pitch +
                           (long long)(y >> 1) * p.src_pitch + (x & ~1);
            yuv_rgb(p, row[x], uv[0], uv[1], out);
            return;
        }
        case FMT_YUYV: {
            const u8* pair = row + (x & ~1) * 2;  // Y0 U Y1 V
            yuv_rgb(p, pair[(x & 1) * 2], pair[1], pair[3], out);
            return;
        }
        case FMT_GRAY:
            out[0] = out[1] = out[2] = (float)row[x];
            return;
        case FMT_BGR:
            out[0] = (float)row[x * 3 + 2], out[1] = (float)row[x * 3 + 1], out[2] = (float)row[x * 3];
            return;
        default:
            out[0] = (float)row[x * 3], out[1] = (float)row[x * 3 + 1], out[2] = (float)row[x * 3 + 2];
    }
}

// One letterboxed RGB pixel at canvas (x, y), as dlad.imaging.pre.letterbox computes it on the
// frame's RGB (dlad.imaging.pre.to_rgb): pad_value outside the resized image, else bilinear
// with half-pixel centres, no FMA. A YUV frame is converted tap by tap, in the same pass.
__device__ __forceinline__ void letterbox_pixel(const PreParams& p, int x, int y, u8 rgb[3]) {
    int xd = x - p.pad_x, yd = y - p.pad_y;
    if (xd < 0 || yd < 0 || xd >= p.new_w || yd >= p.new_h) {
        rgb[0] = rgb[1] = rgb[2] = (u8)p.pad_value;
        return;
    }
    float xs = __fsub_rn(__fdiv_rn(__fadd_rn((float)xd, 0.5f), p.scale), 0.5f);
    xs = fminf(fmaxf(xs, 0.0f), (float)(p.src_w - 1));
    int x0 = (int)floorf(xs);
    int x1 = min(x0 + 1, p.src_w - 1);
    float fx = __fsub_rn(xs, (float)x0), gx = __fsub_rn(1.0f, fx);
    float ys = __fsub_rn(__fdiv_rn(__fadd_rn((float)yd, 0.5f), p.scale), 0.5f);
    ys = fminf(fmaxf(ys, 0.0f), (float)(p.src_h - 1));
    int y0 = (int)floorf(ys);
    int y1 = min(y0 + 1, p.src_h - 1);
    float fy = __fsub_rn(ys, (float)y0), gy = __fsub_rn(1.0f, fy);
    float p00[3], p01[3], p10[3], p11[3];
    source_rgb(p, x0, y0, p00);
    source_rgb(p, x1, y0, p01);
    source_rgb(p, x0, y1, p10);
    source_rgb(p, x1, y1, p11);
    for (int c = 0; c < 3; ++c) {
        float top = __fadd_rn(__fmul_rn(gx, p00[c]), __fmul_rn(fx, p01[c]));
        float bot = __fadd_rn(__fmul_rn(gx, p10[c]), __fmul_rn(fx, p11[c]));
        float v = __fadd_rn(__fmul_rn(gy, top), __fmul_rn(fy, bot));
        rgb[c] = (u8)fminf(roundf(v), 255.0f);
    }
}

// dlad.imaging.pre.quantize_hwc4: roundf((p / 255) / s), ties away from zero, saturated.
__device__ __forceinline__ int quantize(u8 v, float s) {
    float q = roundf(__fdiv_rn(__fdiv_rn((float)v, 255.0f), s));
    return (int)fminf(fmaxf(q, -128.0f), 127.0f);
}

// uint8 image -> letterbox -> int8 DLA_HWC4, one thread per canvas pixel (padding columns
// included, written as zero), one 32-bit store each. Grid: (ceil(pitch/32), dst_h), block 32x8.
extern "C" __global__ void pre_hwc4_i8(const PreParams p) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= p.dst_pitch_px || y >= p.dst_h) return;
    u32 word = 0;  // channel 3 and the row padding stay zero
    if (x < p.dst_w) {
        u8 rgb[3];
        letterbox_pixel(p, x, y, rgb);
        word = (u32)(u8)quantize(rgb[0], p.input_scale) |
               ((u32)(u8)quantize(rgb[1], p.input_scale) << 8) |
               ((u32)(u8)quantize(rgb[2], p.input_scale) << 16);
    }
    reinterpret_cast<u32*>(p.dst)[(long long)y * p.dst_pitch_px + x] = word;
}

// uint8 image -> letterbox -> fp16 CHW16 (p / 255, round to nearest even), lanes 3..15 zero.
// dlad.imaging.pre.normalize_chw16. One thread per pixel, two 16-byte stores.
extern "C" __global__ void pre_chw16_f16(const PreParams p) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= p.dst_w || y >= p.dst_h) return;
    u8 rgb[3];
    letterbox_pixel(p, x, y, rgb);
    u32 lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    lanes[0] = (u32)float_to_half_rn(__fdiv_rn((float)rgb[0], 255.0f)) |
               ((u32)float_to_half_rn(__fdiv_rn((float)rgb[1], 255.0f)) << 16);
    lanes[1] = (u32)float_to_half_rn(__fdiv_rn((float)rgb[2], 255.0f));
    uint4* out = reinterpret_cast<uint4*>(reinterpret_cast<u16*>(p.dst) +
                                          ((long long)y * p.dst_w + x) * 16);
    out[0] = make_uint4(lanes[0], lanes[1], lanes[2], lanes[3]);
    out[1] = make_uint4(lanes[4], lanes[5], lanes[6], lanes[7]);
}

// --------------------------------------------------------------------------------- layout

// Between the layouts dlad's kernels speak (int8 DLA_HWC4 in, fp16 CHW16 heads out) and a
// TensorRT GPU engine's linear NCHW tensors (dlad/devices/tensorrt_gpu.py captures both
// around the engine in one CUDA graph per batch size).
struct LayoutParams {
    const void* src;
    void* dst;
    int n, c, h, w;    // frames, channels, rows, columns of the linear NCHW side
    int pitch_px;      // DLA_HWC4 row pitch in pixels (W padded; layout_hwc4_nchw only)
    int half;          // 1: the linear side is fp16, 0: fp32
    float scale;       // the int8 input's scale (layout_hwc4_nchw only)
};

// int8 DLA_HWC4 [n][h][pitch_px][4] -> linear NCHW [n][c][h][w], q * scale as float32, stored
// as fp32 or rounded to fp16 (nearest even): numpy's `q * np.float32(scale)` then astype.
// One thread per pixel; grid (ceil(w/32), h, n), block 32x1.
extern "C" __global__ void layout_hwc4_nchw(const LayoutParams p) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y, b = blockIdx.z;
    if (x >= p.w) return;
    u32 word = reinterpret_cast<const u32*>(p.src)[((long long)b * p.h + y) * p.pitch_px + x];
    long long plane = (long long)p.h * p.w, at = (long long)b * p.c * plane + (long long)y * p.w + x;
    for (int c = 0; c < p.c; ++c) {
        float v = __fmul_rn((float)(i8)((word >> (8 * c)) & 0xff), p.scale);
        if (p.half) reinterpret_cast<u16*>(p.dst)[at + c * plane] = float_to_half_rn(v);
        else reinterpret_cast<float*>(p.dst)[at + c * plane] = v;
    }
}

// linear NCHW [n][c][h][w] (fp32 or fp16) -> fp16 CHW16 [n][ceil(c/16)][h][w][16], rounded to
// nearest even, the padding lanes of the last group written as zero. One thread per
// (pixel, group of 16 channels), two 16-byte stores; grid (ceil(w/32), h, n * ceil(c/16)).
extern "C" __global__ void layout_nchw_chw16(const LayoutParams p) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y, groups = (p.c + 15) / 16;
    int b = blockIdx.z / groups, g = blockIdx.z % groups;
    if (x >= p.w) return;
    long long plane = (long long)p.h * p.w;
    long long at = ((long long)b * p.c + g * 16) * plane + (long long)y * p.w + x;
    u32 lanes[8];
#pragma unroll
    for (int l = 0; l < 16; l += 2) {
        u16 pair[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            int c = g * 16 + l + k;
            long long i = at + (long long)(l + k) * plane;
            pair[k] = c >= p.c ? (u16)0
                      : p.half ? reinterpret_cast<const u16*>(p.src)[i]
                               : float_to_half_rn(reinterpret_cast<const float*>(p.src)[i]);
        }
        lanes[l / 2] = (u32)pair[0] | ((u32)pair[1] << 16);
    }
    uint4* out = reinterpret_cast<uint4*>(reinterpret_cast<u16*>(p.dst) +
                                          ((((long long)b * groups + g) * p.h + y) * p.w + x) * 16);
    out[0] = make_uint4(lanes[0], lanes[1], lanes[2], lanes[3]);
    out[1] = make_uint4(lanes[4], lanes[5], lanes[6], lanes[7]);
}

// --------------------------------------------------------------------------------- post

struct Candidate {
    float x1, y1, x2, y2, score;
    int cls;
};

struct Geometry {  // dlad.imaging.pre.Letterbox, per image
    double scale;
    int pad_x, pad_y, src_w, src_h;
};

struct FrameParams {  // what changes from frame to frame; copied to the GPU in the frame's graph
    float conf;            // score > conf passes
    float obj_cut;         // (float)(logit(conf) - 1e-3): rows whose objectness cannot pass
    float iou;             // IoU >= iou suppresses
    int max_det;
    int multi_label;
    int max_candidates;    // <= DLAD_SORT_CAPACITY
    int nms_rounds;        // fixed-point rounds before post_scan walks instead
    int reserved;
};

struct PostParams {
    const void* heads[DLAD_MAX_LEVELS];  // head buffers of image 0; image b at + b * head_image_bytes
    long long head_image_bytes[DLAD_MAX_LEVELS];
    Candidate* cands;      // [batch][cand_capacity]
    u64* keys;             // [batch][cand_capacity]: (~score bits) << 32 | reference order index
    u32* counts;           // [batch]: candidates found (may exceed the capacity: overflow)
    Candidate* sorted;     // [batch][DLAD_SORT_CAPACITY]
    u64* mask;             // [batch][DLAD_SORT_CAPACITY][DLAD_MASK_WORDS]
    u32* kept_m;           // [batch]: candidates entering NMS
    float* out;            // [batch][4 + 6 * max_det]: n, found, overflow, m, then detections
    const Geometry* geoms; // [batch], device memory
    const FrameParams* frame;  // device memory
    float head_scale[DLAD_MAX_LEVELS];   // CHW32 int8 dequantisation scale; 0 for CHW16 fp16
    int head_h[DLAD_MAX_LEVELS], head_w[DLAD_MAX_LEVELS], head_stride[DLAD_MAX_LEVELS];
    int level_cells[DLAD_MAX_LEVELS + 1];  // prefix sums of na * H * W
    float anchors[DLAD_MAX_LEVELS][DLAD_MAX_ANCHORS][2];  // anchor-based families
    int nl, na, nc;        // levels, decode threads per cell (anchors), classes
    int cand_capacity;
    int bins;              // distribution bins per box side (DFL families), else 0
    int end2end;           // a one-to-one head: every class a candidate, no NMS (top max_det)
};

__device__ __forceinline__ float sigmoidf(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

__device__ __forceinline__ float head_value(const PostParams& p, int level, const void* base, int c,
                                            int iy, int ix) {
    int w = p.head_w[level], h = p.head_h[level];
    if (p.head_scale[level] > 0.0f) {  // CHW32 int8
        const i8* d = reinterpret_cast<const i8*>(base);
        long long off = (((long long)(c >> 5) * h + iy) * w + ix) * 32 + (c & 31);
        return __fmul_rn((float)d[off], p.head_scale[level]);
    }
    const u16* d = reinterpret_cast<const u16*>(base);
    long long off = (((long long)(c >> 4) * h + iy) * w + ix) * 16 + (c & 15);
    return half_to_float(d[off]);
}

__device__ __forceinline__ void emit(const PostParams& p, int b, float x1, float y1, float x2,
                                     float y2, float score, int cls, u32 order) {
    u32 slot = atomicAdd(&p.counts[b], 1u);
    if (slot >= (u32)p.cand_capacity) return;  // overflow: counted, reported, not stored
    long long at = (long long)b * p.cand_capacity + slot;
    Candidate c = {x1, y1, x2, y2, score, cls};
    p.cands[at] = c;
    p.keys[at] = ((u64)(0xFFFFFFFFu - __float_as_uint(score)) << 32) | order;
}

// The 32 bytes of channel group g at one cell (16 fp16 lanes of CHW16, 32 int8 lanes of CHW32),
// as eight words; two 16-byte loads when the block is 16-byte aligned.
__device__ __forceinline__ void group_words(const PostParams& p, int level, const void* base,
                                            int g, int iy, int ix, u32 w[8]) {
    long long off = (((long long)g * p.head_h[level] + iy) * p.head_w[level] + ix) * 32;
    const char* at = reinterpret_cast<const char*>(base) + off;
    if ((reinterpret_cast<unsigned long long>(at) & 15) == 0) {
        uint4 lo = reinterpret_cast<const uint4*>(at)[0], hi = reinterpret_cast<const uint4*>(at)[1];
        w[0] = lo.x; w[1] = lo.y; w[2] = lo.z; w[3] = lo.w;
        w[4] = hi.x; w[5] = hi.y; w[6] = hi.z; w[7] = hi.w;
    } else {
        const u32* v = reinterpret_cast<const u32*>(at);  // heads are at least 4-byte aligned
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = v[i];
    }
}

// Lane l of a group's words, as head_value computes it: LANES 32 is CHW32 int8, 16 CHW16 fp16.
template <int LANES>
__device__ __forceinline__ float lane_value(const PostParams& p, int level, const u32 w[8], int l) {
    if (LANES == 32) {
        i8 q = (i8)((w[l >> 2] >> ((l & 3) * 8)) & 0xFF);
        return __fmul_rn((float)q, p.head_scale[level]);
    }
    return half_to_float((u16)((w[l >> 1] >> ((l & 1) * 16)) & 0xFFFF));
}

// fn(k, value) for the class logits k = 0 .. nc - 1 of the channels from c0, in class order,
// read a channel group (32 bytes) at a time, four groups' loads in flight together. Every
// index into the words is a constant after unrolling: they stay in registers.
template <int LANES, typename F>
__device__ __forceinline__ void classes_by_group(const PostParams& p, int level, const void* base,
                                                 int c0, int iy, int ix, F& fn) {
    const int g_last = (c0 + p.nc - 1) / LANES;
    for (int g0 = c0 / LANES; g0 <= g_last; g0 += 4) {
        u32 w[4][8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (g0 + q <= g_last) group_words(p, level, base, g0 + q, iy, ix, w[q]);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (g0 + q > g_last) break;
            int k0 = (g0 + q) * LANES - c0;  // the class of lane 0
#pragma unroll
            for (int l = 0; l < LANES; ++l) {
                int k = k0 + l;
                if (k >= 0 && k < p.nc) fn(k, lane_value<LANES>(p, level, w[q], l));
            }
        }
    }
}

template <typename F>
__device__ __forceinline__ void for_each_class(const PostParams& p, int level, const void* base,
                                               int c0, int iy, int ix, F fn) {
    if (p.head_scale[level] > 0.0f) classes_by_group<32>(p, level, base, c0, iy, ix, fn);
    else classes_by_group<16>(p, level, base, c0, iy, ix, fn);
}

// What the families' decode kernels share (dlad/families/*.cu): one thread per slot, a slot
// being (level, anchor, cell) over all levels (level_cells); grid.y = image.
struct DecodeSlot {
    int t;             // over all levels: the candidates' reference order
    int level;
    int r;             // within the level: anchor * H * W + cell
    int iy, ix;        // the cell
    const void* base;  // the level's head of this image
};

// This thread's slot; false past the last one.
__device__ __forceinline__ bool decode_slot(const PostParams& p, DecodeSlot& s) {
    s.t = blockIdx.x * blockDim.x + threadIdx.x;
    if (s.t >= p.level_cells[p.nl]) return false;
    s.level = 0;
    while (s.t >= p.level_cells[s.level + 1]) ++s.level;
    s.r = s.t - p.level_cells[s.level];
    int cell = s.r % (p.head_h[s.level] * p.head_w[s.level]);
    s.iy = cell / p.head_w[s.level];
    s.ix = cell - s.iy * p.head_w[s.level];
    s.base = reinterpret_cast<const char*>(p.heads[s.level]) + blockIdx.y * p.head_image_bytes[s.level];
    return true;
}

// The best class logit of the slot's class channels from c0 (the first maximum) and its class.
__device__ __forceinline__ float best_class(const PostParams& p, const DecodeSlot& s, int c0,
                                            int& best) {
    float best_logit = 0.0f;  // set by class 0
    best = 0;
    for_each_class(p, s.level, s.base, c0, s.iy, s.ix, [&](int k, float v) {
        if (k == 0 || v > best_logit) { best_logit = v; best = k; }  // first maximum wins
    });
    return best_logit;
}

// The candidates of one box (canvas corners) whose class logits start at channel c0, scored
// obj * S(logit) (obj 1 for a family without objectness: x * 1 is exact): every class that
// passes (all), or the best class alone (best >= 0: already found, with its logit).
__device__ __forceinline__ void emit_classes(const PostParams& p, const FrameParams& f,
                                             const DecodeSlot& s, int c0, float x1, float y1,
                                             float x2, float y2, float obj, bool all, int best,
                                             float best_logit) {
    int b = blockIdx.y;
    if (all) {
        u32 order0 = (u32)s.t * (u32)p.nc;
        for_each_class(p, s.level, s.base, c0, s.iy, s.ix, [&](int k, float v) {
            float conf = __fmul_rn(obj, sigmoidf(v));
            if (conf > f.conf) emit(p, b, x1, y1, x2, y2, conf, k, order0 + k);
        });
        return;
    }
    if (best < 0) best_logit = best_class(p, s, c0, best);
    float conf = __fmul_rn(obj, sigmoidf(best_logit));
    if (conf > f.conf) emit(p, b, x1, y1, x2, y2, conf, best, (u32)s.t);
}

// The `max_candidates` best candidates (score descending, reference order on ties), sorted,
// into `sorted`; the candidate counter is reset for the next frame. One block of 1024 threads
// per image (grid.x = image); dynamic shared memory: DLAD_SORT_CAPACITY * 12 bytes.
extern "C" __global__ void post_select_sort(const PostParams p) {
    const FrameParams f = *p.frame;
    extern __shared__ u64 smem[];
    u64* skey = smem;                                            // [DLAD_SORT_CAPACITY]
    u32* spos = reinterpret_cast<u32*>(smem + DLAD_SORT_CAPACITY);  // [DLAD_SORT_CAPACITY]
    __shared__ u32 hist[256];
    __shared__ u64 prefix, prefix_mask;
    __shared__ u32 remaining, m;
    __shared__ u32 found;
    int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const u64* keys = p.keys + (long long)b * p.cand_capacity;
    if (tid == 0) {
        found = p.counts[b];
        prefix = 0;
        prefix_mask = 0;
        remaining = (u32)f.max_candidates;
        m = 0;
    }
    __syncthreads();
    u32 n = min(found, (u32)p.cand_capacity);
    u64 cut = ~0ull;  // keys <= cut are selected
    if (n > (u32)f.max_candidates) {
        // Radix select of the max_candidates-th smallest key (keys are unique), 8 bits a pass.
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            u64 pf = prefix, pm = prefix_mask;
            for (u32 i = tid; i < n; i += nt) {
                u64 k = keys[i];
                if ((k & pm) == pf) atomicAdd(&hist[(k >> shift) & 255], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 need = remaining, acc = 0;
                int d = 0;
                while (acc + hist[d] < need) acc += hist[d++];
                remaining = need - acc;
                prefix = pf | ((u64)d << shift);
                prefix_mask = pm | (255ull << shift);
            }
            __syncthreads();
        }
        cut = prefix;
    }
    for (u32 i = tid; i < n; i += nt) {
        u64 k = keys[i];
        if (k <= cut) {
            u32 at = atomicAdd(&m, 1u);
            skey[at] = k;
            spos[at] = i;
        }
    }
    __syncthreads();
    u32 count = m;
    const Candidate* cands = p.cands + (long long)b * p.cand_capacity;
    Candidate* sorted = p.sorted + (long long)b * DLAD_SORT_CAPACITY;
    if (count <= 2 * (u32)nt) {
        // Few candidates (the usual case): each one's rank is the number of smaller keys (keys
        // are unique), one pass over shared memory, no barrier rounds.
        for (u32 i = tid; i < count; i += nt) {
            u64 key = skey[i];
            u32 rank = 0;
            for (u32 j = 0; j < count; ++j) rank += skey[j] < key;
            sorted[rank] = cands[spos[i]];
        }
        if (tid == 0) {
            p.kept_m[b] = count;
            p.counts[b] = 0;  // ready for the next frame on this stream
            float* out = p.out + (long long)b * (4 + 6 * f.max_det);
            out[1] = (float)found;
            out[2] = found > (u32)p.cand_capacity ? 1.0f : 0.0f;
            out[3] = (float)count;
        }
        return;
    }
    u32 size = 1;
    while (size < count) size <<= 1;
    for (u32 i = count + tid; i < size; i += nt) { skey[i] = ~0ull; spos[i] = 0; }
    __syncthreads();
    // Bitonic sort of (key, position), ascending key.
    for (u32 k = 2; k <= size; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = tid; i < size; i += nt) {
                u32 l = i ^ j;
                if (l > i) {
                    bool up = (i & k) == 0;
                    u64 ki = skey[i], kl = skey[l];
                    if ((ki > kl) == up) {
                        skey[i] = kl; skey[l] = ki;
                        u32 t = spos[i]; spos[i] = spos[l]; spos[l] = t;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (u32 i = tid; i < count; i += nt) sorted[i] = cands[spos[i]];
    if (tid == 0) {
        p.kept_m[b] = count;
        p.counts[b] = 0;  // ready for the next frame on this stream
        float* out = p.out + (long long)b * (4 + 6 * f.max_det);
        out[1] = (float)found;
        out[2] = found > (u32)p.cand_capacity ? 1.0f : 0.0f;
        out[3] = (float)count;
    }
}

// dlad.imaging.post.nms's IoU, in double on edge coordinates.
__device__ __forceinline__ bool suppresses(const Candidate& a, const Candidate& c, double thr) {
    double iw = fmax(fmin((double)a.x2, (double)c.x2) - fmax((double)a.x1, (double)c.x1), 0.0);
    double ih = fmax(fmin((double)a.y2, (double)c.y2) - fmax((double)a.y1, (double)c.y1), 0.0);
    double inter = iw * ih;
    double area_a = fmax((double)a.x2 - (double)a.x1, 0.0) * fmax((double)a.y2 - (double)a.y1, 0.0);
    double area_c = fmax((double)c.x2 - (double)c.x1, 0.0) * fmax((double)c.y2 - (double)c.y1, 0.0);
    double uni = area_a + area_c - inter;
    double iou = uni > 0.0 ? inter / uni : 0.0;
    return iou >= thr;
}

// Suppression bitmask: bit j of word w of row i is set when sorted candidate i (higher
// score) of the same class overlaps candidate j = 64 w + bit, j > i, with IoU >= iou.
// Only words w >= i / 64 are written (the scan reads no others). Any grid; grid.y = image.
extern "C" __global__ void post_mask(const PostParams p) {
    const FrameParams f = *p.frame;
    int b = blockIdx.y;
    u32 m = p.kept_m[b];
    const Candidate* s = p.sorted + (long long)b * DLAD_SORT_CAPACITY;
    u64* mask = p.mask + (long long)b * DLAD_SORT_CAPACITY * DLAD_MASK_WORDS;
    double thr = p.end2end ? 2.0 : (double)f.iou;  // no IoU reaches 2: nothing is suppressed
    if (m <= DLAD_SHARED_ROWS) {
        // Column mask for post_scan: word v of column j holds bit i - 32 v for every i < j
        // (same class) that suppresses j. Only words v <= j / 32 are written and read.
        // One warp per word: lane l tests i = 32 v + l, and the ballot is the word.
        u32* col = reinterpret_cast<u32*>(mask);
        u32 cols = (m + 31) >> 5;
        u32 items = m * cols, lane = threadIdx.x & 31;
        u32 warps = gridDim.x * (blockDim.x >> 5);
        for (u32 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
            u32 j = it / cols, v = it - j * cols;
            if (v > (j >> 5)) continue;  // warp-uniform
            u32 i = (v << 5) + lane;
            bool hit = false;
            if (i < j) {
                Candidate a = s[i], c = s[j];
                hit = a.cls == c.cls && suppresses(a, c, thr);
            }
            u32 bits = __ballot_sync(0xFFFFFFFFu, hit);
            if (lane == 0) col[j * DLAD_SHARED_COLS + v] = bits;
        }
        return;
    }
    u32 words = (m + 63) >> 6;
    u64 items = (u64)m * words;
    for (u64 it = (u64)blockIdx.x * blockDim.x + threadIdx.x; it < items;
         it += (u64)gridDim.x * blockDim.x) {
        u32 i = (u32)(it / words), w = (u32)(it % words);
        if (w < (i >> 6)) continue;
        Candidate a = s[i];
        u64 bits = 0;
        u32 j0 = w << 6, j1 = min(j0 + 64, m);
        for (u32 j = max(j0, i + 1); j < j1; ++j) {
            Candidate c = s[j];
            if (c.cls == a.cls && suppresses(a, c, thr)) bits |= 1ull << (j - j0);
        }
        mask[(u64)i * DLAD_MASK_WORDS + w] = bits;
    }
}

// Greedy NMS resolution, one block per image (grid.x = image, 1024 threads), recording the
// kept indices, then every thread maps kept boxes back to the source image
// (Letterbox.to_original, in double, clipped to the edges) and writes the output record.
//   m <= DLAD_SHARED_ROWS: post_mask's *column* mask (bit i of column j: candidate i < j, same
//     class, suppresses j) is staged in shared memory and the greedy result found as a fixed
//     point in a few parallel rounds (a one-warp walk over j when it does not converge).
//   larger m: post_mask's row mask in global memory, resolved word by word by one warp.
// Dynamic shared memory: DLAD_SHARED_ROWS * DLAD_SHARED_COLS * 4 + max_det * 4 bytes.
extern "C" __global__ void post_scan(const PostParams p) {
    const FrameParams f = *p.frame;
    extern __shared__ u32 scol[];  // [DLAD_SHARED_ROWS][DLAD_SHARED_COLS]
    u32* keep = scol + DLAD_SHARED_ROWS * DLAD_SHARED_COLS;  // [max_det]
    __shared__ int s_kept;
    int b = blockIdx.x, tid = threadIdx.x;
    u32 m = p.kept_m[b];
    u32 words = (m + 63) >> 6;
    const Candidate* s = p.sorted + (long long)b * DLAD_SORT_CAPACITY;
    const u64* gmask = p.mask + (long long)b * DLAD_SORT_CAPACITY * DLAD_MASK_WORDS;
    float* out = p.out + (long long)b * (4 + 6 * f.max_det);
    if (m <= DLAD_SHARED_ROWS) {
        __shared__ u32 kw[DLAD_SHARED_COLS], nkw[DLAD_SHARED_COLS];
        __shared__ int converged;
        u32 cols = (m + 31) >> 5;
        const u32* gcol = reinterpret_cast<const u32*>(gmask);
        for (u32 it = tid; it < m * cols; it += blockDim.x) {
            u32 j = it / cols, v = it - j * cols;
            if (v <= (j >> 5)) scol[j * DLAD_SHARED_COLS + v] = gcol[j * DLAD_SHARED_COLS + v];
        }
        if (tid < DLAD_SHARED_COLS) {
            u32 v = tid;
            kw[v] = (v << 5) >= m ? 0u : ((v + 1) << 5) <= m ? ~0u : (1u << (m - (v << 5))) - 1u;
        }
        if (tid == 0) converged = 0;
        __syncthreads();
        // Fixed point of keep[j] = no kept i < j suppresses j, from "all kept": its unique
        // fixed point is the greedy result, and after round t the first t candidates are final,
        // so a round without change ends it. Long suppression chains fall back to the walk.
        for (int round = 0; round < f.nms_rounds; ++round) {
            if (tid < DLAD_SHARED_COLS) nkw[tid] = 0u;
            __syncthreads();
            for (u32 j = tid; j < m; j += blockDim.x) {
                u32 hit = 0;
                for (u32 v = 0; v <= (j >> 5); ++v) hit |= scol[j * DLAD_SHARED_COLS + v] & kw[v];
                if (!hit) atomicOr(&nkw[j >> 5], 1u << (j & 31));
            }
            __syncthreads();
            int diff = tid < DLAD_SHARED_COLS && nkw[tid] != kw[tid];
            int any = __syncthreads_or(diff);
            if (tid < DLAD_SHARED_COLS) kw[tid] = nkw[tid];
            __syncthreads();
            if (!any) { if (tid == 0) converged = 1; break; }
        }
        __syncthreads();
        if (tid < 32) {
            u32 lane = tid;
            if (converged) {
                // The kept indices in order, the first max_det of them: a warp prefix sum.
                u32 word = kw[lane], count = __popc(word), before = count;
                for (int d = 1; d < 32; d <<= 1) {
                    u32 up = __shfl_up_sync(0xFFFFFFFFu, before, d);
                    if (lane >= (u32)d) before += up;
                }
                before -= count;
                for (u32 bits = word, k = before; bits; bits &= bits - 1, ++k) {
                    if (k < (u32)f.max_det) keep[k] = (lane << 5) + (__ffs(bits) - 1);
                }
                u32 total = __shfl_sync(0xFFFFFFFFu, before + count, 31);
                if (lane == 0) s_kept = (int)min(total, (u32)f.max_det);
            } else {
                // The walk: j in score order is kept iff no kept i < j suppresses it.
                u32 kept_word = 0;
                int kept = 0;
                for (u32 j = 0; j < m && kept < f.max_det; ++j) {
                    u32 hit = lane <= (j >> 5) ? (scol[j * DLAD_SHARED_COLS + lane] & kept_word) : 0u;
                    if (!__any_sync(0xFFFFFFFFu, hit != 0u)) {
                        if (lane == (j >> 5)) kept_word |= 1u << (j & 31);
                        if (lane == 0) keep[kept] = j;
                        ++kept;
                    }
                }
                if (lane == 0) s_kept = kept;
            }
        }
    } else if (tid < 32) {
        const u64* rows = gmask;
        const u32 pitch = DLAD_MASK_WORDS;
        u32 lane = tid;
        // Lane l owns words l, l + 32, l + 64, l + 96 of the "removed" bitset, in registers.
        u64 r[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            u32 w = lane + 32 * q;
            r[q] = w >= words ? ~0ull : (((w + 1) << 6) > m ? ~0ull << (m - (w << 6)) : 0ull);
        }
        // Word by word: every lane resolves the word's 64 candidates in the same order (the
        // same loads, broadcast), so the serial chain is one load per kept box; then
        // each lane ORs the kept boxes' rows into the later words it owns (independent loads).
        int kept = 0;
        for (u32 w = 0; w < words && kept < f.max_det; ++w) {
            u32 q = w >> 5;
            u64 mine = q == 0 ? r[0] : q == 1 ? r[1] : q == 2 ? r[2] : r[3];
            u64 alive = ~__shfl_sync(0xFFFFFFFFu, mine, w & 31);
            u64 kept_bits = 0;
            while (alive && kept < f.max_det) {
                int j = __ffsll((long long)alive) - 1;
                u32 i = (w << 6) + j;
                kept_bits |= 1ull << j;
                if (lane == 0) keep[kept] = i;
                ++kept;
                alive &= ~(1ull << j);
                alive &= ~rows[(u64)i * pitch + w];
            }
            for (u64 kb = kept_bits; kb; kb &= kb - 1) {
                const u64* row = rows + (u64)((w << 6) + (__ffsll((long long)kb) - 1)) * pitch;
#pragma unroll
                for (int q2 = 0; q2 < 4; ++q2) {
                    u32 w2 = lane + 32 * q2;
                    if (w2 > w && w2 < words) r[q2] |= row[w2];
                }
            }
        }
        if (lane == 0) s_kept = kept;
    }
    __syncthreads();
    int kept = s_kept;
    Geometry g = p.geoms[b];
    for (int k = tid; k < kept; k += blockDim.x) {
        Candidate c = s[keep[k]];
        float* d = out + 4 + 6 * k;
        double x1 = ((double)c.x1 - g.pad_x) / g.scale, x2 = ((double)c.x2 - g.pad_x) / g.scale;
        double y1 = ((double)c.y1 - g.pad_y) / g.scale, y2 = ((double)c.y2 - g.pad_y) / g.scale;
        d[0] = (float)fmin(fmax(x1, 0.0), (double)g.src_w);
        d[1] = (float)fmin(fmax(y1, 0.0), (double)g.src_h);
        d[2] = (float)fmin(fmax(x2, 0.0), (double)g.src_w);
        d[3] = (float)fmin(fmax(y2, 0.0), (double)g.src_h);
        d[4] = c.score;
        d[5] = (float)c.cls;
    }
    if (tid == 0) out[0] = (float)kept;
}
