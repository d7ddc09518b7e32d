// See wire.hpp. Only the msgpack this needs is read: a header the daemon takes is a map of
// strings, ints, floats, nil and two small maps, so any other type where a field is read is
// "not mine" (the full decoder then decodes or refuses it). Nothing here allocates per field
// read but the request's own strings.
#include "wire.hpp"

#include <array>
#include <cmath>
#include <cstring>

namespace dlad::wire {
namespace {

// A msgpack integer: msgpack-python gives the same Python int for every width it comes in.
struct Int {
    bool negative = false;
    uint64_t value = 0;  // the value, when not negative

    bool in(uint64_t lo, uint64_t hi) const { return !negative && lo <= value && value <= hi; }
};

class Reader {
  public:
    Reader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}

    bool done() const { return p_ == end_; }

    bool nil() {  // consumes a nil, if one is next
        if (p_ == end_ || *p_ != 0xc0) return false;
        ++p_;
        return true;
    }

    bool boolean() {  // consumes a bool, if one is next
        if (p_ == end_ || (*p_ != 0xc2 && *p_ != 0xc3)) return false;
        ++p_;
        return true;
    }

    bool map(uint32_t& n) {
        if (p_ == end_) return false;
        const uint8_t t = *p_;
        if ((t & 0xf0) == 0x80) {
            n = t & 0x0f;
            ++p_;
            return true;
        }
        if (t == 0xde || t == 0xdf) return length(t == 0xde ? 2 : 4, n);
        return false;
    }

    bool str(std::string_view& s) {
        if (p_ == end_) return false;
        const uint8_t t = *p_;
        uint32_t n = 0;
        if ((t & 0xe0) == 0xa0) {
            n = t & 0x1f;
            ++p_;
        } else if (t == 0xd9 || t == 0xda || t == 0xdb) {
            if (!length(t == 0xd9 ? 1 : t == 0xda ? 2 : 4, n)) return false;
        } else {
            return false;
        }
        const uint8_t* at = nullptr;
        if (!take(n, at)) return false;
        s = std::string_view(reinterpret_cast<const char*>(at), n);
        return true;
    }

    bool integer(Int& v) {
        if (p_ == end_) return false;
        const uint8_t t = *p_;
        if (t <= 0x7f) {  // positive fixint
            v = {false, t};
            ++p_;
            return true;
        }
        if (t >= 0xe0) {  // negative fixint
            v = {true, 0};
            ++p_;
            return true;
        }
        if (t >= 0xcc && t <= 0xcf) {  // uint 8 to 64
            const uint8_t* at = nullptr;
            const size_t n = size_t{1} << (t - 0xcc);
            ++p_;
            if (!take(n, at)) return false;
            v = {false, big_endian(at, n)};
            return true;
        }
        if (t >= 0xd0 && t <= 0xd3) {  // int 8 to 64: non-negative values are plain ints too
            const uint8_t* at = nullptr;
            const size_t n = size_t{1} << (t - 0xd0);
            ++p_;
            if (!take(n, at)) return false;
            const uint64_t raw = big_endian(at, n);
            const bool negative = (raw >> (8 * n - 1)) & 1;
            v = {negative, negative ? 0 : raw};
            return true;
        }
        return false;  // bool, float, anything else: not an int to Python's ``type(x) is int``
    }

    // An int or a float, as Python's float() of it (protocol._float).
    bool number(double& x) {
        if (p_ == end_) return false;
        const uint8_t t = *p_;
        if (t == 0xca || t == 0xcb) {
            const size_t n = t == 0xca ? 4 : 8;
            const uint8_t* at = nullptr;
            ++p_;
            if (!take(n, at)) return false;
            const uint64_t bits = big_endian(at, n);
            if (n == 4) {
                const auto b32 = static_cast<uint32_t>(bits);
                float f = 0;
                std::memcpy(&f, &b32, sizeof f);
                x = f;  // widening is exact, as msgpack-python's
            } else {
                std::memcpy(&x, &bits, sizeof x);
            }
            return true;
        }
        const uint8_t* mark = p_;
        if (t >= 0xd0 && t <= 0xd3) {  // keep a negative int's value: ranges are checked on x
            const size_t n = size_t{1} << (t - 0xd0);
            const uint8_t* at = nullptr;
            ++p_;
            if (!take(n, at)) return false;
            const uint64_t raw = big_endian(at, n);
            const int shift = static_cast<int>(64 - 8 * n);
            // sign-extend the n-byte two's complement value
            x = static_cast<double>(static_cast<int64_t>(raw << shift) >> shift);
            return true;
        }
        Int v;
        if (!integer(v)) {
            p_ = mark;
            return false;
        }
        x = v.negative ? -1.0 : static_cast<double>(v.value);  // negative fixint: below every range
        return true;
    }

  private:
    bool take(size_t n, const uint8_t*& at) {
        if (static_cast<size_t>(end_ - p_) < n) return false;
        at = p_;
        p_ += n;
        return true;
    }

    bool length(size_t width, uint32_t& n) {
        const uint8_t* at = nullptr;
        ++p_;
        if (!take(width, at)) return false;
        n = static_cast<uint32_t>(big_endian(at, width));
        return true;
    }

    static uint64_t big_endian(const uint8_t* at, size_t n) {
        uint64_t v = 0;
        for (size_t i = 0; i < n; ++i) v = (v << 8) | at[i];
        return v;
    }

    const uint8_t* p_;
    const uint8_t* end_;
};

// protocol._name, on printable ASCII (see wire.hpp: other names go the full decoder's way)
bool is_name(std::string_view s) {
    if (s.empty() || s.size() > kMaxNameChars) return false;
    for (const char c : s) {
        if (c < 0x20 || c > 0x7e) return false;
    }
    return true;
}

bool is_alnum(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
}

// protocol._SHM_NAME: [A-Za-z0-9_-][A-Za-z0-9._-]{0,199}
bool is_segment_name(std::string_view s) {
    if (s.empty() || s.size() > kMaxShmName) return false;
    for (size_t i = 0; i < s.size(); ++i) {
        const char c = s[i];
        if (!(is_alnum(c) || c == '_' || c == '-' || (i > 0 && c == '.'))) return false;
    }
    return true;
}

// An optional int field: nil, or an int in [lo, hi].
bool opt_int(Reader& r, uint64_t lo, uint64_t hi, std::optional<int64_t>& out) {
    if (r.nil()) {
        out.reset();
        return true;
    }
    Int v;
    if (!r.integer(v) || !v.in(lo, hi)) return false;
    out = static_cast<int64_t>(v.value);
    return true;
}

// Keys of a map read once each; ``found`` gets one bit a key. False for a key that is not a
// string, not in ``keys``, or repeated (msgpack-python's hook refuses a repeated key).
template <size_t N, typename Value>
bool read_map(Reader& r, const std::array<std::string_view, N>& keys, uint32_t& found,
              Value&& value) {
    uint32_t n = 0;
    if (!r.map(n)) return false;
    found = 0;
    for (uint32_t i = 0; i < n; ++i) {
        std::string_view key;
        if (!r.str(key)) return false;
        size_t k = 0;
        while (k < N && keys[k] != key) ++k;
        if (k == N || (found >> k) & 1) return false;
        found |= uint32_t{1} << k;
        if (!value(k)) return false;
    }
    return true;
}

constexpr std::array<std::string_view, 12> kHeaderKeys = {
    "v", "kind", "id", "model", "image",  // required
    "stream", "priority", "deadline_ms", "conf", "iou", "max_det", "shm",
};
constexpr uint32_t kRequired = 0b11111;
enum HeaderKey { V, KIND, ID, MODEL, IMAGE, STREAM, PRIORITY, DEADLINE, CONF, IOU, MAX_DET, SHM };
constexpr std::array<std::string_view, 4> kImageKeys = {"height", "width", "format", "dtype"};
constexpr std::array<std::string_view, 3> kShmKeys = {"name", "offset", "size"};

bool read_image(Reader& r, Infer& out) {
    uint32_t found = 0;
    Int height, width;
    const bool read = read_map(r, kImageKeys, found, [&](size_t k) {
        std::string_view s;
        switch (k) {
            case 0: return r.integer(height);
            case 1: return r.integer(width);
            case 2:
                if (!r.str(s)) return false;
                if (s == "RGB" || s == "BGR") {
                    out.channels = 3;
                } else if (s == "GRAY") {
                    out.channels = 1;
                } else {
                    return false;
                }
                out.format = s;
                return true;
            default: return r.str(s) && s == "uint8";
        }
    });
    if (!read || found != 0b1111) return false;  // exactly the four keys
    if (height.negative || width.negative) return false;
    out.height = static_cast<int64_t>(std::min<uint64_t>(height.value, INT64_MAX));
    out.width = static_cast<int64_t>(std::min<uint64_t>(width.value, INT64_MAX));
    return true;
}

bool read_shm(Reader& r, ShmRef& out) {
    uint32_t found = 0;
    Int offset, size;
    const bool read = read_map(r, kShmKeys, found, [&](size_t k) {
        if (k == 0) {
            std::string_view s;
            if (!r.str(s) || !is_segment_name(s)) return false;
            out.name = s;
            return true;
        }
        return r.integer(k == 1 ? offset : size);
    });
    if (!read || found != 0b111) return false;
    if (!size.in(1, kMaxShmBytes) || !offset.in(0, size.value - 1)) return false;
    out.offset = offset.value;
    out.size = size.value;
    return true;
}

}  // namespace

std::optional<Cheap> read_cheap(const uint8_t* header, size_t header_bytes, size_t frames) {
    if (frames != 1) return std::nullopt;
    Reader r(header, header_bytes);
    uint32_t n = 0;
    if (!r.map(n) || n < 3 || n > 4) return std::nullopt;
    Cheap c;
    uint32_t found = 0;  // v, kind, id, load
    for (uint32_t i = 0; i < n; ++i) {
        std::string_view key;
        if (!r.str(key)) return std::nullopt;
        Int v;
        if (key == "v" && !(found & 1) && r.integer(v) && v.in(1, 1)) {
            found |= 1;
        } else if (key == "kind" && !(found & 2) && r.integer(v) &&
                   (v.in(kCancel, kCancel) || v.in(kStatus, kStatus))) {
            found |= 2;
            c.kind = static_cast<int64_t>(v.value);
        } else if (key == "id" && !(found & 4) && r.integer(v) && !v.negative) {
            found |= 4;
            c.id = v.value;
        } else if (key == "load" && !(found & 8) && (r.nil() || r.boolean())) {
            found |= 8;
        } else {
            return std::nullopt;
        }
    }
    if ((found & 7) != 7 || !r.done() || ((found & 8) && c.kind != kStatus)) return std::nullopt;
    return c;
}

InferKeys infer_keys() {
    InferKeys k;
    for (size_t i = 0; i < kHeaderKeys.size(); ++i) {
        ((kRequired >> i) & 1 ? k.required : k.optional).emplace_back(kHeaderKeys[i]);
    }
    k.image.assign(kImageKeys.begin(), kImageKeys.end());
    k.shm.assign(kShmKeys.begin(), kShmKeys.end());
    return k;
}

std::optional<Infer> read_infer(const uint8_t* header, size_t header_bytes, size_t frames,
                                uint64_t payload_bytes, const Limits& limits, bool shm) {
    if (frames != 1 && frames != 2) return std::nullopt;
    const uint64_t payload = frames == 2 ? payload_bytes : 0;
    if (header_bytes > limits.max_header_bytes ||
        payload > limits.max_message_bytes - std::min<uint64_t>(header_bytes,
                                                                 limits.max_message_bytes)) {
        return std::nullopt;
    }
    Reader r(header, header_bytes);
    Infer out;
    uint32_t found = 0;
    const bool read = read_map(r, kHeaderKeys, found, [&](size_t k) {
        Int v;
        std::string_view s;
        std::optional<int64_t> opt;
        switch (k) {
            case V: return r.integer(v) && v.in(kProtocolVersion, kProtocolVersion);
            case KIND: return r.integer(v) && v.in(kInfer, kInfer);
            case ID:
                if (!r.integer(v) || v.negative) return false;
                out.id = v.value;
                return true;
            case MODEL:
                if (!r.str(s) || !is_name(s)) return false;
                out.model = s;
                return true;
            case IMAGE: return read_image(r, out);
            case STREAM:
                if (r.nil()) return true;
                if (!r.str(s) || !is_name(s)) return false;
                out.stream = std::string(s);
                return true;
            case PRIORITY:
                if (!opt_int(r, 0, kPriorityMax, opt)) return false;
                out.priority = opt.value_or(0);  // nil means the default, like absence
                return true;
            case DEADLINE: return opt_int(r, 1, kMaxDeadlineMs, out.deadline_ms);
            case CONF:
            case IOU: {
                if (r.nil()) return true;
                double x = NAN;
                if (!r.number(x)) return false;
                // protocol._float: conf in [0, 1), iou in (0, 1]; NaN fails both
                const bool ok = k == CONF ? (0.0 <= x && x < 1.0) : (0.0 < x && x <= 1.0);
                if (!ok) return false;
                (k == CONF ? out.conf : out.iou) = x;
                return true;
            }
            case MAX_DET: return opt_int(r, 1, kMaxDet, out.max_det);
            default: {  // SHM
                if (frames != 1 || !shm) return false;
                ShmRef ref;
                if (!read_shm(r, ref)) return false;
                out.shm = std::move(ref);
                return true;
            }
        }
    });
    if (!read || !r.done() || (found & kRequired) != kRequired) return std::nullopt;
    if ((frames == 1) != out.shm.has_value()) return std::nullopt;  // a frame, or a segment
    if (out.height < 1 || out.height > limits.max_height || out.width < 1 ||
        out.width > limits.max_width || out.height * out.width > limits.max_image_pixels) {
        return std::nullopt;
    }
    if (frames == 2 && payload != out.image_bytes()) return std::nullopt;
    return out;
}

// ------------------------------------------------------------------------------ the writer
namespace {

// msgpack-python's Packer: the smallest encoding of each value, str8 for 32 to 255 bytes.
class Writer {
  public:
    void map(uint32_t n) {
        if (n < 16) {
            byte(static_cast<uint8_t>(0x80 | n));
        } else {
            byte(0xde);
            big_endian(n, 2);
        }
    }
    void str(std::string_view s) {
        const size_t n = s.size();
        if (n < 32) {
            byte(0xa0 | static_cast<uint8_t>(n));
        } else if (n < 256) {
            byte(0xd9);
            big_endian(n, 1);
        } else if (n < 65536) {
            byte(0xda);
            big_endian(n, 2);
        } else {
            byte(0xdb);
            big_endian(n, 4);
        }
        out_.append(s);
    }
    void uint(uint64_t v) {
        if (v < 128) {
            byte(static_cast<uint8_t>(v));
        } else if (v < 256) {
            byte(0xcc);
            big_endian(v, 1);
        } else if (v < 65536) {
            byte(0xcd);
            big_endian(v, 2);
        } else if (v < (uint64_t{1} << 32)) {
            byte(0xce);
            big_endian(v, 4);
        } else {
            byte(0xcf);
            big_endian(v, 8);
        }
    }
    void sint(int64_t v) {
        if (v >= 0) {
            uint(static_cast<uint64_t>(v));
        } else if (v >= -32) {
            byte(static_cast<uint8_t>(v));
        } else if (v >= -128) {
            byte(0xd0);
            big_endian(static_cast<uint64_t>(v), 1);
        } else if (v >= -32768) {
            byte(0xd1);
            big_endian(static_cast<uint64_t>(v), 2);
        } else if (v >= INT32_MIN) {
            byte(0xd2);
            big_endian(static_cast<uint64_t>(v), 4);
        } else {
            byte(0xd3);
            big_endian(static_cast<uint64_t>(v), 8);
        }
    }
    void nil() { byte(0xc0); }
    void opt_uint(const std::optional<uint64_t>& v) { v ? uint(*v) : nil(); }
    void field(std::string_view key, uint64_t v) {
        str(key);
        uint(v);
    }

    std::string take() { return std::move(out_); }

  private:
    void byte(uint8_t b) { out_.push_back(static_cast<char>(b)); }
    void big_endian(uint64_t v, size_t n) {
        for (size_t i = n; i-- > 0;) byte(static_cast<uint8_t>(v >> (8 * i)));
    }

    std::string out_;
};

}  // namespace

std::string write_cheap_reply(const Cheap& request, int64_t status, std::string_view message) {
    Writer w;
    // protocol.encode's map: v kind id status message, and a STATUS_REPLY's report
    const bool status_reply = request.kind == kStatus;
    w.map(status_reply ? 6 : 5);
    w.field("v", kProtocolVersion);
    w.field("kind", static_cast<uint64_t>(request.kind | 0x80));
    w.field("id", request.id);
    w.str("status");
    w.sint(status);
    w.str("message");
    w.str(message);
    if (status_reply) {
        w.str("report");
        w.nil();
    }
    return w.take();
}

std::string write_infer_reply(uint64_t id, int64_t status, std::string_view message,
                              std::optional<std::string_view> device, const Timing& timing,
                              uint64_t count) {
    Writer w;
    // protocol.encode_infer_ok's map, in its order: v kind id status message device timing count
    w.map(8);
    w.field("v", kProtocolVersion);
    w.field("kind", kInferReply);
    w.field("id", id);
    w.str("status");
    w.sint(status);
    w.str("message");
    w.str(message);
    w.str("device");
    if (device) {
        w.str(*device);
    } else {
        w.nil();
    }
    w.str("timing");
    w.map(7);
    w.field("queue_us", timing.queue_us);
    w.field("pre_us", timing.pre_us);
    w.field("device_us", timing.device_us);
    w.field("post_us", timing.post_us);
    w.field("total_us", timing.total_us);
    w.str("start_ns");
    w.opt_uint(timing.start_ns);
    w.str("end_ns");
    w.opt_uint(timing.end_ns);
    w.field("count", count);
    return w.take();
}

}  // namespace dlad::wire
