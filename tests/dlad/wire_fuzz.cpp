// A driver for the native plane's INFER reader (dlad/native/wire.cpp) under AddressSanitizer and
// UndefinedBehaviorSanitizer: bench/fuzz_wire.py builds it with both and feeds it messages on
// stdin, one record each: u32 header bytes, the header, u8 frames, u64 payload bytes, u8 shm
// (little-endian). Every header is read into a buffer of exactly its size, so a read past its
// end is a sanitizer report. What the reader takes must keep the protocol's promises (checked
// here; a broken one aborts); each taken INFER's reply is written too. At the end it prints
// "read N taken T" and exits 0.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "../../dlad/native/wire.hpp"

namespace {

bool read_exact(void* into, size_t n) { return std::fread(into, 1, n, stdin) == n; }

void require(bool ok, const char* what) {
    if (ok) return;
    std::fprintf(stderr, "wire_fuzz: the reader broke a promise: %s\n", what);
    std::abort();
}

void check(const dlad::wire::Infer& in, size_t frames, uint64_t payload, bool shm,
           const dlad::wire::Limits& limits) {
    namespace w = dlad::wire;
    const int64_t channels = in.format == "GRAY" ? 1 : 3;
    require(in.format == "RGB" || in.format == "BGR" || in.format == "GRAY", "format");
    require(in.channels == channels, "channels");
    require(in.height >= 1 && in.height <= limits.max_height, "height");
    require(in.width >= 1 && in.width <= limits.max_width, "width");
    require(in.height * in.width <= limits.max_image_pixels, "pixels");
    require(!in.model.empty() && in.model.size() <= w::kMaxNameChars, "model");
    require(!in.stream || (!in.stream->empty() && in.stream->size() <= w::kMaxNameChars),
            "stream");
    require(in.priority >= 0 && in.priority <= w::kPriorityMax, "priority");
    require(!in.deadline_ms || (*in.deadline_ms >= 1 && *in.deadline_ms <= w::kMaxDeadlineMs),
            "deadline_ms");
    require(!in.max_det || (*in.max_det >= 1 && *in.max_det <= w::kMaxDet), "max_det");
    require(!in.conf || (*in.conf >= 0.0 && *in.conf < 1.0), "conf");  // protocol: [0, 1)
    require(!in.iou || (*in.iou > 0.0 && *in.iou <= 1.0), "iou");       // protocol: (0, 1]
    if (frames == 2) {
        require(!in.shm && payload == in.image_bytes(), "payload");
    } else {
        require(frames == 1 && shm && in.shm, "shm frame");
        require(!in.shm->name.empty() && in.shm->name.size() <= w::kMaxShmName, "shm name");
        require(in.shm->size <= w::kMaxShmBytes, "shm size");
    }
}

}  // namespace

int main() {
    dlad::wire::Limits limits;
    limits.max_message_bytes = 1 << 20;
    limits.max_header_bytes = 1 << 16;
    limits.max_width = 1024;
    limits.max_height = 1024;
    limits.max_image_pixels = 512 * 512;
    uint64_t read = 0;
    uint64_t taken = 0;
    for (;;) {
        uint32_t n = 0;
        if (!read_exact(&n, sizeof n)) break;
        std::unique_ptr<uint8_t[]> header(new uint8_t[n == 0 ? 1 : n]);
        uint8_t frames = 0;
        uint64_t payload = 0;
        uint8_t shm = 0;
        if (!read_exact(header.get(), n) || !read_exact(&frames, 1) ||
            !read_exact(&payload, sizeof payload) || !read_exact(&shm, 1)) {
            std::fprintf(stderr, "wire_fuzz: a truncated record\n");
            return 2;
        }
        ++read;
        const auto in =
            dlad::wire::read_infer(header.get(), n, frames, payload, limits, shm != 0);
        if (!in) continue;
        ++taken;
        check(*in, frames, payload, shm != 0, limits);
        dlad::wire::Timing timing;
        timing.total_us = static_cast<uint64_t>(in->height);
        const std::string ok = dlad::wire::write_infer_reply(in->id, 0, "", in->model, timing, 0);
        const std::string refused = dlad::wire::write_infer_reply(
            in->id, 3, in->stream.value_or(in->model), std::nullopt, timing, 0);
        require(!ok.empty() && !refused.empty(), "reply");
    }
    std::printf("read %llu taken %llu\n", static_cast<unsigned long long>(read),
                static_cast<unsigned long long>(taken));
    return 0;
}
