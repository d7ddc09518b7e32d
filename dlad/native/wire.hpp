// The daemon's requests in C++: every request's header decoded, or refused naming the field;
// an INFER_REPLY's header written.
//
// This is the daemon's one request decoder (docs/daemon.md, "The native data plane"). The
// plane's thread decodes each message it receives here and serves an INFER, or rate-limits a
// STATUS or CANCEL, without the interpreter; anything else (a refusal included) it forwards to
// the control plane, whose protocol.decode_request calls this same decoder (through
// dlad._native.decode_request) for the refusal's words, or for an INFER_BATCH's images, or to
// map an INFER's shared-memory segment the plane does not know yet. dlad/protocol.py declares
// the protocol's constants and field names; tests/dlad/test_native_wire.py holds this file's to
// them.
//
// The header is read whole first, as msgpack (every string valid UTF-8, every map's keys
// strings and distinct, no bytes after it), then its envelope (v, kind, the frames the kind
// has, the kind's field names), then each field. The writer gives an INFER_REPLY's header the
// bytes msgpack-python's packb gives the same map, byte for byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "frame_rules.hpp"
#include "names.hpp"  // the wire's rule of a name (clients/dlad_wire/native)

namespace dlad::wire {

constexpr int64_t kProtocolVersion = 1;   // protocol.PROTOCOL_VERSION
constexpr int64_t kInfer = 0x01;          // protocol.Kind.INFER
constexpr int64_t kCancel = 0x02;         // protocol.Kind.CANCEL
constexpr int64_t kStatus = 0x03;         // protocol.Kind.STATUS
constexpr int64_t kInferBatch = 0x04;     // protocol.Kind.INFER_BATCH
constexpr int64_t kInferReply = 0x81;     // protocol.Kind.INFER_REPLY
constexpr int64_t kPriorityMax = 7;       // protocol.PRIORITY_MAX
constexpr int64_t kMaxDeadlineMs = 3'600'000;
constexpr int64_t kMaxDet = 1000;
constexpr size_t kMaxNameChars = names::kMaxNameChars;  // protocol.MAX_NAME_CHARS
constexpr size_t kMaxBatchImages = 16;     // protocol.MAX_BATCH_IMAGES
constexpr int kMaxRequestDepth = 4;        // protocol.MAX_REQUEST_DEPTH
constexpr uint64_t kMaxShmBytes = uint64_t{1} << 40;  // protocol.MAX_SHM_BYTES
constexpr size_t kMaxShmName = 200;
constexpr uint64_t kShmHeaderBytes = 64;  // protocol.SHM_HEADER_BYTES
constexpr size_t kShmTokenBytes = 16;     // protocol.SHM_TOKEN_BYTES

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
    std::string token;  // protocol.SHM_TOKEN_BYTES bytes
};

// A decoded request: its kind's fields (protocol.InferRequest, InferBatchRequest,
// CancelRequest, StatusRequest). An INFER has one image, an INFER_BATCH 1 to 16; the shared
// fields are the message's. ``None`` is nullopt, as in protocol.InferRequest.
struct Image {
    int format = 0;  // a rules::PixelFormat
    int colour = 0;  // a YUV frame's matrix and range (rules::kBt709, rules::kFullRange)
    int64_t height = 0;
    int64_t width = 0;
    std::optional<std::string> stream;
    std::optional<ShmRef> shm;  // the image lies there (it has no payload frame)
    size_t frame = 0;           // its payload's frame (1 is the first after the header), or 0

    uint64_t bytes() const { return rules::frame_bytes(format, height, width); }
};

struct Request {
    int64_t kind = 0;
    uint64_t id = 0;
    std::string model;  // INFER, INFER_BATCH
    int64_t priority = 0;
    std::optional<int64_t> deadline_ms;
    std::optional<double> conf;
    std::optional<double> iou;
    std::optional<int64_t> max_det;
    bool load = false;  // STATUS
    std::vector<Image> images;
};

// Why a message is refused: ``field`` is the dotted path (``image.height``, ``frames``,
// ``header``), ``message`` starts with it (a protocol.ProtocolError's). ``id`` and ``kind``: what
// the header yielded, to address the refusal, if anything.
struct Refusal {
    std::string field;
    std::string message;
    std::optional<uint64_t> id;
    std::optional<int64_t> kind;
};

struct Decoded {
    std::optional<Request> request;  // nullopt: refused
    Refusal refusal;
};

// Decode a request (its frames without the routing id): ``header`` its first frame,
// ``payloads[i]`` the size of frame i + 1. ``shm``: whether this daemon takes shared-memory
// frames from this connection at all. An image in shared memory comes with its reference only:
// finding the segment, and checking that the image lies inside it, is the caller's part (the
// plane's registered segments, or protocol.ShmResolver); an image in a frame has that frame's
// size when this returns.
Decoded decode_request(const uint8_t* header, size_t header_bytes, const uint64_t* payloads,
                       size_t payload_count, const Limits& limits, bool shm);

// A STATUS or CANCEL (what the plane's per-client rate limit counts) and the one-frame reply
// refusing it: a STATUS_REPLY (its report nil) or a CANCEL_REPLY.
struct Cheap {
    int64_t kind = 0;
    uint64_t id = 0;
};
std::optional<Cheap> as_cheap(const Request& request);
std::string write_cheap_reply(const Cheap& request, int64_t status, std::string_view message);

// The reply to a request that failed (a refusal, or an error the control plane found): the
// kind's own reply where the refusal yielded the request's id and a known kind, else an
// ERROR_REPLY (id nil where it yielded none). An INFER_REPLY is followed by an empty payload
// frame (``payload_frame``). ``message`` is UTF-8. The control plane answers with it too
// (protocol.encode_error_reply): the one writer of error replies.
std::string write_refusal_reply(const Refusal& refusal, int64_t status, std::string_view message,
                                bool* payload_frame);

// Python's repr() of a str (valid UTF-8), for words that name a value as the control plane does.
std::string py_repr(std::string_view utf8);

// Whether ``utf8`` (valid UTF-8) is a name (model, stream, device), and whether a name's
// character is printable: the wire's rule (names.hpp), which the SDK checks its names with too.
using names::is_name;
using names::printable;

// The field names the decoder takes, for the test that holds them to dlad/protocol.py's one
// declaration: each request kind's required and optional fields; the image map's (an
// INFER_BATCH's image map also takes stream and shm) and the shm map's.
struct Keys {
    std::vector<std::string> required, optional;
};
std::vector<std::pair<int64_t, Keys>> header_keys();
std::vector<std::string> image_keys();
std::vector<std::string> image_optional_keys();  // a YUV frame's colour
std::vector<std::string> shm_keys();

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
