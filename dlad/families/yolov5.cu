// The YOLOv5 family's decode kernel (dlad/families/yolov5.py is its specification), compiled
// after dlad/gpu/kernels.cu, whose PostParams, FrameParams and head readers it uses; the
// selection, NMS and back-projection kernels there follow it.

// dlad.families.yolov5.decode: one thread per (level, anchor, cell); grid.y = image.
extern "C" __global__ void post_decode_yolov5(const PostParams p) {
    const FrameParams f = *p.frame;
    DecodeSlot s;
    if (!decode_slot(p, s)) return;
    int a = s.r / (p.head_h[s.level] * p.head_w[s.level]);
    int ch = a * (5 + p.nc);
    float obj_logit = head_value(p, s.level, s.base, ch + 4, s.iy, s.ix);
    if (!(obj_logit > f.obj_cut)) return;
    float sx = sigmoidf(head_value(p, s.level, s.base, ch + 0, s.iy, s.ix));
    float sy = sigmoidf(head_value(p, s.level, s.base, ch + 1, s.iy, s.ix));
    float sw = sigmoidf(head_value(p, s.level, s.base, ch + 2, s.iy, s.ix));
    float sh = sigmoidf(head_value(p, s.level, s.base, ch + 3, s.iy, s.ix));
    float obj = sigmoidf(obj_logit);
    float stride = (float)p.head_stride[s.level];
    float cx = __fmul_rn(__fadd_rn(__fsub_rn(__fmul_rn(sx, 2.0f), 0.5f), (float)s.ix), stride);
    float cy = __fmul_rn(__fadd_rn(__fsub_rn(__fmul_rn(sy, 2.0f), 0.5f), (float)s.iy), stride);
    float tw = __fmul_rn(sw, 2.0f), th = __fmul_rn(sh, 2.0f);
    float bw = __fmul_rn(__fmul_rn(tw, tw), p.anchors[s.level][a][0]);
    float bh = __fmul_rn(__fmul_rn(th, th), p.anchors[s.level][a][1]);
    float hw_ = __fmul_rn(bw, 0.5f), hh = __fmul_rn(bh, 0.5f);
    float x1 = __fsub_rn(cx, hw_), y1 = __fsub_rn(cy, hh);
    float x2 = __fadd_rn(cx, hw_), y2 = __fadd_rn(cy, hh);
    if (!(isfinite(x1) && isfinite(y1) && isfinite(x2) && isfinite(y2))) return;
    emit_classes(p, f, s, ch + 5, x1, y1, x2, y2, obj, f.multi_label, -1, 0.0f);
}
