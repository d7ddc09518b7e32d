// The YOLOv5 family's decode kernel (dlad/families/yolov5.py is its specification), compiled
// after dlad/gpu/kernels.cu, whose PostParams, FrameParams and head readers it uses; the
// selection, NMS and back-projection kernels there follow it.

// dlad.families.yolov5.decode: one thread per (level, anchor, cell); grid.y = image.
extern "C" __global__ void post_decode_yolov5(const PostParams p) {
    const FrameParams f = *p.frame;
    int b = blockIdx.y;
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.level_cells[p.nl]) return;
    int level = 0;
    while (t >= p.level_cells[level + 1]) ++level;
    int r = t - p.level_cells[level];
    int hw = p.head_h[level] * p.head_w[level];
    int a = r / hw, cell = r - a * hw;
    int iy = cell / p.head_w[level], ix = cell - iy * p.head_w[level];
    const void* base = reinterpret_cast<const char*>(p.heads[level]) + b * p.head_image_bytes[level];
    int ch = a * (5 + p.nc);
    float obj_logit = head_value(p, level, base, ch + 4, iy, ix);
    if (!(obj_logit > f.obj_cut)) return;
    float sx = sigmoidf(head_value(p, level, base, ch + 0, iy, ix));
    float sy = sigmoidf(head_value(p, level, base, ch + 1, iy, ix));
    float sw = sigmoidf(head_value(p, level, base, ch + 2, iy, ix));
    float sh = sigmoidf(head_value(p, level, base, ch + 3, iy, ix));
    float obj = sigmoidf(obj_logit);
    float stride = (float)p.head_stride[level];
    float cx = __fmul_rn(__fadd_rn(__fsub_rn(__fmul_rn(sx, 2.0f), 0.5f), (float)ix), stride);
    float cy = __fmul_rn(__fadd_rn(__fsub_rn(__fmul_rn(sy, 2.0f), 0.5f), (float)iy), stride);
    float tw = __fmul_rn(sw, 2.0f), th = __fmul_rn(sh, 2.0f);
    float bw = __fmul_rn(__fmul_rn(tw, tw), p.anchors[level][a][0]);
    float bh = __fmul_rn(__fmul_rn(th, th), p.anchors[level][a][1]);
    float hw_ = __fmul_rn(bw, 0.5f), hh = __fmul_rn(bh, 0.5f);
    float x1 = __fsub_rn(cx, hw_), y1 = __fsub_rn(cy, hh);
    float x2 = __fadd_rn(cx, hw_), y2 = __fadd_rn(cy, hh);
    if (!(isfinite(x1) && isfinite(y1) && isfinite(x2) && isfinite(y2))) return;
    if (f.multi_label) {
        u32 order0 = (u32)(t) * (u32)p.nc;
        for_each_class(p, level, base, ch + 5, iy, ix, [&](int k, float v) {
            float conf = __fmul_rn(obj, sigmoidf(v));
            if (conf > f.conf) emit(p, b, x1, y1, x2, y2, conf, k, order0 + k);
        });
    } else {
        int best = 0;
        float best_logit = 0.0f;  // set by class 0
        for_each_class(p, level, base, ch + 5, iy, ix, [&](int k, float v) {
            if (k == 0 || v > best_logit) { best_logit = v; best = k; }  // first maximum wins
        });
        float conf = __fmul_rn(obj, sigmoidf(best_logit));
        if (conf > f.conf) emit(p, b, x1, y1, x2, y2, conf, best, (u32)t);
    }
}
