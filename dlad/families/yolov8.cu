// The DFL families' decode kernel (YOLOv8, YOLO11, YOLO26; dlad/families/yolov8.py is its
// specification), compiled after dlad/gpu/kernels.cu, whose PostParams, FrameParams and head
// readers it uses; the selection, NMS and back-projection kernels there follow it.

// The distance of one box side (grid units): sum_k k * softmax(x)_k over the side's p.bins
// channels from c0, the sums in bin order; with one bin, the value itself.
__device__ __forceinline__ float dfl_side(const PostParams& p, int level, const void* base, int c0,
                                          int iy, int ix) {
    if (p.bins == 1) return head_value(p, level, base, c0, iy, ix);
    float m = head_value(p, level, base, c0, iy, ix);
    for (int k = 1; k < p.bins; ++k) m = fmaxf(m, head_value(p, level, base, c0 + k, iy, ix));
    float total = 0.0f;
    for (int k = 0; k < p.bins; ++k) {
        float e = expf(__fsub_rn(head_value(p, level, base, c0 + k, iy, ix), m));
        total = k == 0 ? e : __fadd_rn(total, e);
    }
    float d = 0.0f;
    for (int k = 1; k < p.bins; ++k) {
        float e = expf(__fsub_rn(head_value(p, level, base, c0 + k, iy, ix), m));
        d = __fadd_rn(d, __fmul_rn(__fdiv_rn(e, total), (float)k));
    }
    return d;
}

// dlad.families.yolov8.decode: one thread per (level, cell); grid.y = image.
extern "C" __global__ void post_decode_dfl(const PostParams p) {
    const FrameParams f = *p.frame;
    DecodeSlot s;
    if (!decode_slot(p, s)) return;
    const int c_cls = 4 * p.bins;
    int best;
    float best_logit = best_class(p, s, c_cls, best);
    if (!(best_logit > f.obj_cut)) return;  // no class can pass
    float l = dfl_side(p, s.level, s.base, 0, s.iy, s.ix);
    float tp = dfl_side(p, s.level, s.base, p.bins, s.iy, s.ix);
    float r = dfl_side(p, s.level, s.base, 2 * p.bins, s.iy, s.ix);
    float bt = dfl_side(p, s.level, s.base, 3 * p.bins, s.iy, s.ix);
    float stride = (float)p.head_stride[s.level];
    float ax = __fadd_rn((float)s.ix, 0.5f), ay = __fadd_rn((float)s.iy, 0.5f);
    float x1 = __fsub_rn(ax, l), y1 = __fsub_rn(ay, tp);
    float x2 = __fadd_rn(ax, r), y2 = __fadd_rn(ay, bt);
    float bx1, by1, bx2, by2;
    if (p.end2end) {  // corners times the stride, as the one-to-one head's dist2bbox(xyxy)
        bx1 = __fmul_rn(x1, stride); by1 = __fmul_rn(y1, stride);
        bx2 = __fmul_rn(x2, stride); by2 = __fmul_rn(y2, stride);
    } else {  // centre and size times the stride, then corners, as dist2bbox(xywh)
        float cx = __fmul_rn(__fdiv_rn(__fadd_rn(x1, x2), 2.0f), stride);
        float cy = __fmul_rn(__fdiv_rn(__fadd_rn(y1, y2), 2.0f), stride);
        float hw = __fdiv_rn(__fmul_rn(__fsub_rn(x2, x1), stride), 2.0f);
        float hh = __fdiv_rn(__fmul_rn(__fsub_rn(y2, y1), stride), 2.0f);
        bx1 = __fsub_rn(cx, hw); by1 = __fsub_rn(cy, hh);
        bx2 = __fadd_rn(cx, hw); by2 = __fadd_rn(cy, hh);
    }
    if (!(isfinite(bx1) && isfinite(by1) && isfinite(bx2) && isfinite(by2))) return;
    emit_classes(p, f, s, c_cls, bx1, by1, bx2, by2, 1.0f, f.multi_label || p.end2end, best,
                 best_logit);
}
