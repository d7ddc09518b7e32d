// The daemon's hot messages in C++: an INFER's header read, an INFER_REPLY's header written.
//
// This is the wire half of the native data plane (docs/daemon.md, "The native data plane"):
// the path an INFER takes from the ROUTER to the scheduler core and back without the
// interpreter. dlad/protocol.py stays the reference and the full decoder.
//
// The reader is dlad/protocol.py's _fast_infer again: it takes the daemon's common message, an
// INFER whose every field is well formed, and answers "not mine" (std::nullopt) for anything
// else. A caller hands such a message to the full decoder, which decodes it or refuses it naming
// the field; so the reader needs no error messages, and it never takes what Python refuses.
// It is narrower than _fast_infer in one way only: names (model, stream) must be printable ASCII
// (Python's str.isprintable over all of Unicode is not repeated here). A name outside ASCII goes
// the full decoder's way, as every message this reader does not take does.
// tests/dlad/test_native_wire.py holds the two to that on generated and mutated messages.
//
// The writer gives an INFER_REPLY's header the bytes msgpack-python's packb gives the same map,
// byte for byte (the same smallest encodings, the same key order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dlad::wire {

constexpr int64_t kProtocolVersion = 1;   // protocol.PROTOCOL_VERSION
constexpr int64_t kInfer = 0x01;          // protocol.Kind.INFER
constexpr int64_t kInferReply = 0x81;     // protocol.Kind.INFER_REPLY
constexpr int64_t kPriorityMax = 7;       // protocol.PRIORITY_MAX
constexpr int64_t kMaxDeadlineMs = 3'600'000;
constexpr int64_t kMaxDet = 1000;
constexpr size_t kMaxNameChars = 128;
constexpr uint64_t kMaxShmBytes = uint64_t{1} << 40;  // protocol.MAX_SHM_BYTES
constexpr size_t kMaxShmName = 200;

// protocol.Limits: the daemon's bounds on a message (from [frontend] in its config).
struct Limits {
    uint64_t max_message_bytes = 64ull << 20;
    uint64_t max_header_bytes = 64ull << 10;
    int64_t max_width = 8192;
    int64_t max_height = 8192;
    int64_t max_image_pixels = 4096ll * 4096;
};

struct ShmRef {  // protocol.ShmRef
    std::string name;
    uint64_t offset = 0;
    uint64_t size = 0;
};

// An INFER's fields as protocol.InferRequest holds them after decoding (``None`` is nullopt).
struct Infer {
    uint64_t id = 0;
    std::string model;
    std::optional<std::string> stream;
    int64_t priority = 0;
    std::optional<int64_t> deadline_ms;
    std::optional<double> conf;
    std::optional<double> iou;
    std::optional<int64_t> max_det;
    std::string format;  // RGB, BGR or GRAY
    int64_t height = 0;
    int64_t width = 0;
    int64_t channels = 0;
    std::optional<ShmRef> shm;  // the image lies there (the message had no payload frame)

    uint64_t image_bytes() const {
        return static_cast<uint64_t>(height) * static_cast<uint64_t>(width) *
               static_cast<uint64_t>(channels);
    }
};

// An INFER's header read, or nullopt where the full decoder must look (see the top of this
// file). ``frames``: how many frames the message had (its header included; no routing id),
// ``payload_bytes`` the size of the second one (ignored with one frame). ``shm``: whether this
// daemon takes shared-memory frames from this connection at all. A shared-memory frame is
// returned with its reference only: finding the segment, and checking that the image lies
// inside it, is the caller's (protocol.ShmResolver's) part. With a payload frame, the payload
// is the image's size when this returns.
std::optional<Infer> read_infer(const uint8_t* header, size_t header_bytes, size_t frames,
                                uint64_t payload_bytes, const Limits& limits, bool shm);

// A STATUS or CANCEL request whose header holds only ``v``, ``kind``, ``id`` (and STATUS's
// ``load``, nil or a bool), in one frame: what the plane's per-client rate limit needs. Anything
// else, nullopt: the control plane decodes it (or refuses it, naming the field).
constexpr int64_t kCancel = 0x02;  // protocol.Kind.CANCEL
constexpr int64_t kStatus = 0x03;  // protocol.Kind.STATUS
struct Cheap {
    int64_t kind = 0;
    uint64_t id = 0;
};
std::optional<Cheap> read_cheap(const uint8_t* header, size_t header_bytes, size_t frames);
// The one-frame reply refusing it: a STATUS_REPLY (its report nil) or a CANCEL_REPLY.
std::string write_cheap_reply(const Cheap& request, int64_t status, std::string_view message);

// The field names the reader takes, for the test that holds them to dlad/protocol.py's one
// declaration: the header's required and optional fields, the image map's, the shm map's.
struct InferKeys {
    std::vector<std::string> required, optional, image, shm;
};
InferKeys infer_keys();

// An INFER_REPLY's ``timing`` map (protocol.timing_fields): µs, and the task's stamps or none.
struct Timing {
    uint64_t queue_us = 0;
    uint64_t pre_us = 0;
    uint64_t device_us = 0;
    uint64_t post_us = 0;
    uint64_t total_us = 0;
    std::optional<uint64_t> start_ns;
    std::optional<uint64_t> end_ns;
};

// The header frame of an INFER_REPLY: what protocol.encode_infer_ok packs (status 0, message
// ""), or an error reply's (any status, its message, the device or none). ``count``: the
// detections that follow in the second frame, N x 6 little-endian float32.
std::string write_infer_reply(uint64_t id, int64_t status, std::string_view message,
                              std::optional<std::string_view> device, const Timing& timing,
                              uint64_t count);

}  // namespace dlad::wire
