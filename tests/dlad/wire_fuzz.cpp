// A driver for the daemon's request decoder (dlad/native/wire.cpp) under AddressSanitizer and
// UndefinedBehaviorSanitizer: bench/fuzz_wire.py builds it with both and feeds it messages on
// stdin, one record each: u32 header bytes, the header, u8 frames, u64 the first payload's
// bytes (any other payload is empty), u8 shm (little-endian). Every header is read into a buffer
// of exactly its size, so a read past its end is a sanitizer report. What the decoder takes
// must keep the protocol's promises, and a refusal must name its field (checked here; a broken
// promise aborts); each INFER's reply, or its refusal's, is written too. At the end it prints
// "read N taken T" (T: INFERs taken) and exits 0.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../../dlad/native/wire.hpp"

namespace {

bool read_exact(void* into, size_t n) { return std::fread(into, 1, n, stdin) == n; }

void require(bool ok, const char* what) {
    if (ok) return;
    std::fprintf(stderr, "wire_fuzz: the reader broke a promise: %s\n", what);
    std::abort();
}

void check(const dlad::wire::Request& in, size_t frames, uint64_t payload, bool shm,
           const dlad::wire::Limits& limits) {
    namespace w = dlad::wire;
    require(in.images.size() == 1, "one image");
    const w::Image& img = in.images.front();
    namespace r = dlad::rules;
    require(img.format >= r::kRgb && img.format <= r::kYuyv, "format");
    require(r::is_yuv(img.format) || img.colour == 0, "a colour only on YUV frames");
    require(img.colour >= 0 && img.colour <= (r::kBt709 | r::kFullRange), "colour");
    require(img.height >= 1 && img.height <= limits.max_height, "height");
    require(img.width >= 1 && img.width <= limits.max_width, "width");
    require(!r::is_yuv(img.format) || img.width % 2 == 0, "a YUV frame's even width");
    require(img.format != r::kNv12 || img.height % 2 == 0, "an NV12 frame's even height");
    require(img.height * img.width <= limits.max_image_pixels, "pixels");
    // 1 to 128 characters, each 1 to 4 bytes of UTF-8
    require(!in.model.empty() && in.model.size() <= 4 * w::kMaxNameChars, "model");
    require(!img.stream || (!img.stream->empty() && img.stream->size() <= 4 * w::kMaxNameChars),
            "stream");
    require(in.priority >= 0 && in.priority <= w::kPriorityMax, "priority");
    require(!in.deadline_ms || (*in.deadline_ms >= 1 && *in.deadline_ms <= w::kMaxDeadlineMs),
            "deadline_ms");
    require(!in.max_det || (*in.max_det >= 1 && *in.max_det <= w::kMaxDet), "max_det");
    require(!in.conf || (*in.conf >= 0.0 && *in.conf < 1.0), "conf");  // protocol: [0, 1)
    require(!in.iou || (*in.iou > 0.0 && *in.iou <= 1.0), "iou");       // protocol: (0, 1]
    if (frames == 2) {
        require(!img.shm && img.frame == 1 && payload == img.bytes(), "payload");
    } else {
        require(frames == 1 && shm && img.shm, "shm frame");
        require(!img.shm->name.empty() && img.shm->name.size() <= w::kMaxShmName, "shm name");
        require(img.shm->size <= w::kMaxShmBytes, "shm size");
        require(img.shm->offset >= w::kShmHeaderBytes &&
                    img.shm->token.size() == w::kShmTokenBytes, "shm header and token");
        require(img.shm->offset < img.shm->size &&
                    img.bytes() <= img.shm->size - img.shm->offset, "shm frame inside");
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
        std::vector<uint64_t> payloads(frames > 1 ? frames - 1 : 0, 0);
        if (!payloads.empty()) payloads[0] = payload;
        dlad::wire::Timing timing;
        auto decoded = dlad::wire::decode_request(header.get(), n, payloads.data(),
                                                  payloads.size(), limits, shm != 0);
        if (!decoded.request) {
            const auto& r = decoded.refusal;
            require(!r.field.empty() && r.message.rfind(r.field + ": ", 0) == 0, "refusal");
            const std::string reply =
                dlad::wire::write_infer_reply(r.id.value_or(0), 3, r.message, std::nullopt,
                                              timing, 0);
            require(!reply.empty(), "refusal's reply");
            continue;
        }
        const dlad::wire::Request& in = *decoded.request;
        if (in.kind != dlad::wire::kInfer) continue;
        ++taken;
        check(in, frames, payload, shm != 0, limits);
        const dlad::wire::Image& img = in.images.front();
        timing.total_us = static_cast<uint64_t>(img.height);
        const std::string ok = dlad::wire::write_infer_reply(in.id, 0, "", in.model, timing, 0);
        const std::string refused = dlad::wire::write_infer_reply(
            in.id, 3, img.stream.value_or(in.model), std::nullopt, timing, 0);
        require(!ok.empty() && !refused.empty(), "reply");
    }
    std::printf("read %llu taken %llu\n", static_cast<unsigned long long>(read),
                static_cast<unsigned long long>(taken));
    return 0;
}
