// See wire.hpp. A header is read into a flat tree of nodes (preorder; a container's children
// follow it, a map's as key, value pairs), checked as msgpack on the way, then decoded. Nothing
// recurses: a header nests at most as deep as its bytes allow, and a deep one is refused after
// it is read, naming the depth.
#include "wire.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>

namespace dlad::wire {
namespace {

constexpr uint64_t kU64Max = UINT64_MAX;

enum class Type : uint8_t { nil, boolean, integer, real, str, bin, array, map, ext };

struct Node {
    Type type = Type::nil;
    bool negative = false;  // an integer below zero: its value is ``i``
    uint64_t u = 0;         // a non-negative integer; a bool; a container's items (a map's pairs)
    int64_t i = 0;          // a negative integer; an ext's type
    double f = 0;           // a float (a float32 widened, as msgpack-python's)
    std::string_view s;     // a str's bytes (valid UTF-8), a bin's, an ext's
    uint32_t end = 0;       // the index after this node's subtree
};

uint64_t big_endian(const uint8_t* at, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v = (v << 8) | at[i];
    return v;
}

using names::next_code_point;

bool valid_utf8(std::string_view s) {
    auto p = reinterpret_cast<const uint8_t*>(s.data());
    const auto end = p + s.size();
    char32_t c = 0;
    while (p < end) {
        if (!next_code_point(p, end, c)) return false;
    }
    return true;
}

std::u32string code_points(std::string_view s) {  // of valid UTF-8
    std::u32string out;
    auto p = reinterpret_cast<const uint8_t*>(s.data());
    const auto end = p + s.size();
    char32_t c = 0;
    while (p < end && next_code_point(p, end, c)) out.push_back(c);
    return out;
}

void append_utf8(std::string& out, char32_t c) {
    if (c < 0x80) {
        out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
        out.push_back(static_cast<char>(0xc0 | (c >> 6)));
        out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    } else if (c < 0x10000) {
        out.push_back(static_cast<char>(0xe0 | (c >> 12)));
        out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
        out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    } else {
        out.push_back(static_cast<char>(0xf0 | (c >> 18)));
        out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
        out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
        out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    }
}

// Reads a whole header into nodes, or says why it is not one msgpack document.
class Parser {
  public:
    Parser(const uint8_t* p, size_t n, std::vector<Node>& nodes)
        : p_(p), end_(p + n), nodes_(nodes) {}

    // "" when the bytes are one msgpack document, else why not; ``depth``: how deeply its
    // containers nest (a scalar 0)
    const char* parse(int& depth) {
        struct Open {
            uint32_t node;
            uint64_t left;  // children still to read (a map's keys and values)
        };
        thread_local std::vector<Open> open;  // kept between headers: no allocation per header
        open.clear();
        depth = 0;
        do {
            if (p_ == end_) return "truncated";
            if (!open.empty()) --open.back().left;  // this node is its child
            const auto at = static_cast<uint32_t>(nodes_.size());
            nodes_.emplace_back();
            if (const char* why = scalar_or_open(nodes_.back())) return why;
            Node& node = nodes_.back();
            if (node.type == Type::array || node.type == Type::map) {
                const uint64_t children = node.type == Type::map ? 2 * node.u : node.u;
                // every child takes a byte at least: a count past the bytes left is a lie
                if (children > static_cast<uint64_t>(end_ - p_)) return "truncated";
                depth = std::max(depth, static_cast<int>(open.size()) + 1);  // [] is 1 deep
                if (children > 0) {
                    open.push_back({at, children});
                    continue;
                }
            }
            node.end = at + 1;
            while (!open.empty() && open.back().left == 0) {
                nodes_[open.back().node].end = static_cast<uint32_t>(nodes_.size());
                open.pop_back();
            }
        } while (!open.empty());
        if (p_ != end_) return "trailing data";
        return "";
    }

  private:
    const char* scalar_or_open(Node& n) {
        const uint8_t t = *p_++;
        const uint8_t* at = nullptr;
        if (t <= 0x7f) return integer(n, t);
        if (t >= 0xe0) return negative(n, static_cast<int8_t>(t));
        if ((t & 0xf0) == 0x80) return container(n, Type::map, t & 0x0f);
        if ((t & 0xf0) == 0x90) return container(n, Type::array, t & 0x0f);
        if ((t & 0xe0) == 0xa0) return str(n, t & 0x1f);
        switch (t) {
            case 0xc0: n.type = Type::nil; return nullptr;
            case 0xc2:
            case 0xc3:
                n.type = Type::boolean;
                n.u = t & 1;
                return nullptr;
            case 0xc4:
            case 0xc5:
            case 0xc6: {
                uint64_t len = 0;
                if (!length(size_t{1} << (t - 0xc4), len) || !take(len, at)) return "truncated";
                n.type = Type::bin;
                n.s = view(at, len);
                return nullptr;
            }
            case 0xc7:
            case 0xc8:
            case 0xc9: {
                uint64_t len = 0;
                if (!length(size_t{1} << (t - 0xc7), len)) return "truncated";
                return ext(n, len);
            }
            case 0xca:
            case 0xcb: {
                const size_t len = t == 0xca ? 4 : 8;
                if (!take(len, at)) return "truncated";
                const uint64_t bits = big_endian(at, len);
                n.type = Type::real;
                if (len == 4) {
                    const auto b32 = static_cast<uint32_t>(bits);
                    float f = 0;
                    std::memcpy(&f, &b32, sizeof f);
                    n.f = f;
                } else {
                    std::memcpy(&n.f, &bits, sizeof n.f);
                }
                return nullptr;
            }
            case 0xcc:
            case 0xcd:
            case 0xce:
            case 0xcf: {
                const size_t len = size_t{1} << (t - 0xcc);
                if (!take(len, at)) return "truncated";
                return integer(n, big_endian(at, len));
            }
            case 0xd0:
            case 0xd1:
            case 0xd2:
            case 0xd3: {
                const size_t len = size_t{1} << (t - 0xd0);
                if (!take(len, at)) return "truncated";
                const uint64_t raw = big_endian(at, len);
                const int shift = static_cast<int>(64 - 8 * len);
                const int64_t v = static_cast<int64_t>(raw << shift) >> shift;
                return v < 0 ? negative(n, v) : integer(n, static_cast<uint64_t>(v));
            }
            case 0xd4:
            case 0xd5:
            case 0xd6:
            case 0xd7:
            case 0xd8: return ext(n, uint64_t{1} << (t - 0xd4));
            case 0xd9:
            case 0xda:
            case 0xdb: {
                uint64_t len = 0;
                if (!length(size_t{1} << (t - 0xd9), len)) return "truncated";
                return str(n, len);
            }
            case 0xdc:
            case 0xdd: {
                uint64_t len = 0;
                if (!length(t == 0xdc ? 2 : 4, len)) return "truncated";
                return container(n, Type::array, len);
            }
            case 0xde:
            case 0xdf: {
                uint64_t len = 0;
                if (!length(t == 0xde ? 2 : 4, len)) return "truncated";
                return container(n, Type::map, len);
            }
            default: return "reserved byte 0xc1";
        }
    }

    static const char* integer(Node& n, uint64_t v) {
        n.type = Type::integer;
        n.u = v;
        return nullptr;
    }
    static const char* negative(Node& n, int64_t v) {
        n.type = Type::integer;
        n.negative = true;
        n.i = v;
        return nullptr;
    }
    static const char* container(Node& n, Type type, uint64_t items) {
        n.type = type;
        n.u = items;
        return nullptr;
    }
    const char* str(Node& n, uint64_t len) {
        const uint8_t* at = nullptr;
        if (!take(len, at)) return "truncated";
        n.type = Type::str;
        n.s = view(at, len);
        return valid_utf8(n.s) ? nullptr : "a string is not UTF-8";
    }
    const char* ext(Node& n, uint64_t len) {
        const uint8_t* at = nullptr;
        if (!take(1, at)) return "truncated";
        n.i = static_cast<int8_t>(*at);
        if (!take(len, at)) return "truncated";
        n.type = Type::ext;
        n.s = view(at, len);
        // ext -1 is msgpack's timestamp: 4, 8 or 12 bytes
        if (n.i == -1 && len != 4 && len != 8 && len != 12) return "a bad timestamp";
        return nullptr;
    }
    bool take(uint64_t n, const uint8_t*& at) {
        if (static_cast<uint64_t>(end_ - p_) < n) return false;
        at = p_;
        p_ += n;
        return true;
    }
    bool length(size_t width, uint64_t& n) {
        const uint8_t* at = nullptr;
        if (!take(width, at)) return false;
        n = big_endian(at, width);
        return true;
    }
    static std::string_view view(const uint8_t* at, uint64_t n) {
        return {reinterpret_cast<const char*>(at), static_cast<size_t>(n)};
    }

    const uint8_t* p_;
    const uint8_t* end_;
    std::vector<Node>& nodes_;
};

// ------------------------------------------------------------------------------ showing values
// A value in a refusal, as Python's repr shows it (protocol._show's words: two levels, four
// items, strings cut in the middle at 36 characters, the whole at 40).

std::string py_string(const std::u32string& s) {
    const bool single = s.find(U'\'') != std::u32string::npos;
    const bool dbl = s.find(U'"') != std::u32string::npos;
    const char32_t quote = single && !dbl ? U'"' : U'\'';
    std::string out(1, static_cast<char>(quote));
    char hex[16];
    for (const char32_t c : s) {
        if (c == quote || c == U'\\') {
            out.push_back('\\');
            out.push_back(static_cast<char>(c));
        } else if (c == U'\t') {
            out += "\\t";
        } else if (c == U'\n') {
            out += "\\n";
        } else if (c == U'\r') {
            out += "\\r";
        } else if (c == U' ' || printable(c)) {
            append_utf8(out, c);
        } else {
            const auto v = static_cast<unsigned>(c);
            std::snprintf(hex, sizeof hex, c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x",
                          v);
            out += hex;
        }
    }
    out.push_back(static_cast<char>(quote));
    return out;
}

std::string show_str(std::string_view utf8) {
    constexpr size_t kMax = 36;  // reprlib's maxstring
    const std::u32string s = code_points(utf8);
    std::string r = py_string(s.substr(0, kMax));
    if (code_points(r).size() <= kMax) return r;
    const size_t i = (kMax - 3) / 2;
    const size_t j = kMax - 3 - i;
    const std::u32string cut =
        s.size() > i + j ? s.substr(0, i) + s.substr(s.size() - j) : s;
    const std::u32string whole = code_points(py_string(cut));
    std::string out;
    for (size_t k = 0; k < i && k < whole.size(); ++k) append_utf8(out, whole[k]);
    out += "...";
    for (size_t k = whole.size() > j ? whole.size() - j : 0; k < whole.size(); ++k) {
        append_utf8(out, whole[k]);
    }
    return out;
}

// Python's repr of a float: the shortest digits that read back, fixed notation for exponents
// -4 to 15, else d.ddde+XX.
std::string py_float(double x) {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
    const std::string sci(buf, r.ptr);
    const size_t e = sci.find('e');
    std::string mantissa = sci.substr(0, e);
    const int exp = std::stoi(sci.substr(e + 1));
    const bool minus = mantissa[0] == '-';
    if (minus) mantissa.erase(0, 1);
    std::string digits;
    for (const char c : mantissa) {
        if (c != '.') digits.push_back(c);
    }
    std::string out = minus ? "-" : "";
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
        } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
            out += digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
        } else {
            out += digits.substr(0, static_cast<size_t>(exp) + 1) + "." +
                   digits.substr(static_cast<size_t>(exp) + 1);
        }
        return out;
    }
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char tail[16];
    std::snprintf(tail, sizeof tail, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return out + tail;
}

std::string py_bytes(std::string_view b) {
    const bool single = b.find('\'') != std::string_view::npos;
    const char quote = single && b.find('"') == std::string_view::npos ? '"' : '\'';
    std::string out = "b";
    out.push_back(quote);
    char hex[8];
    for (const char ch : b) {
        const auto c = static_cast<uint8_t>(ch);
        if (c == quote || c == '\\') {
            out.push_back('\\');
            out.push_back(static_cast<char>(c));
        } else if (c == '\t') {
            out += "\\t";
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c >= 0x20 && c < 0x7f) {
            out.push_back(static_cast<char>(c));
        } else {
            std::snprintf(hex, sizeof hex, "\\x%02x", c);
            out += hex;
        }
    }
    out.push_back(quote);
    return out;
}

std::string show_at(const std::vector<Node>& d, uint32_t at, int level);

std::string show_items(const std::vector<Node>& d, uint32_t at, int level) {
    constexpr uint64_t kItems = 4;  // reprlib's maxlist, maxdict
    const Node& n = d[at];
    const bool map = n.type == Type::map;
    const char* open = map ? "{" : "[";
    const char* close = map ? "}" : "]";
    if (n.u == 0) return std::string(open) + close;
    if (level <= 0) return std::string(open) + "..." + close;
    std::string out = open;
    uint32_t child = at + 1;
    for (uint64_t k = 0; k < std::min(n.u, kItems); ++k) {
        if (k > 0) out += ", ";
        out += show_at(d, child, level - 1);
        child = d[child].end;
        if (map) {
            out += ": " + show_at(d, child, level - 1);
            child = d[child].end;
        }
    }
    if (n.u > kItems) out += ", ...";
    return out + close;
}

std::string show_at(const std::vector<Node>& d, uint32_t at, int level) {
    const Node& n = d[at];
    switch (n.type) {
        case Type::nil: return "None";
        case Type::boolean: return n.u ? "True" : "False";
        case Type::integer: return n.negative ? std::to_string(n.i) : std::to_string(n.u);
        case Type::real: return py_float(n.f);
        case Type::str: return show_str(n.s);
        case Type::bin: return py_bytes(n.s);
        case Type::ext: return "ExtType(code=" + std::to_string(n.i) + ", data=" + py_bytes(n.s) + ")";
        default: return show_items(d, at, level);
    }
}

std::string show(const std::vector<Node>& d, uint32_t at) {  // protocol._show
    std::string text = show_at(d, at, 2);
    const std::u32string cps = code_points(text);
    if (cps.size() <= 40) return text;
    std::string out;
    for (size_t k = 0; k < 37; ++k) append_utf8(out, cps[k]);
    return out + "...";
}

const char* type_name(Type t) {  // Python's name of what msgpack-python gives
    switch (t) {
        case Type::nil: return "NoneType";
        case Type::boolean: return "bool";
        case Type::integer: return "int";
        case Type::real: return "float";
        case Type::str: return "str";
        case Type::bin: return "bytes";
        case Type::array: return "list";
        case Type::map: return "dict";
        default: return "ExtType";
    }
}

// ------------------------------------------------------------------------------ the decoder

struct Refused {};  // thrown by Decoder::fail, caught in decode_request: the refusal is set

constexpr std::array<std::string_view, 4> kImageKeys = {"height", "width", "format", "dtype"};
constexpr std::array<std::string_view, 4> kShmKeys = {"name", "offset", "size", "token"};
// a YUV frame's colour (protocol.COLORSPACES, COLOR_RANGES; the first of each is the default)
constexpr std::array<std::string_view, 2> kImageOptionalKeys = {"colorspace", "color_range"};
constexpr std::array<std::string_view, 4> kBatchImageKeys = {"colorspace", "color_range",
                                                             "stream", "shm"};
constexpr std::array<std::string_view, 2> kColorspaces = {"bt601", "bt709"};
constexpr std::array<std::string_view, 2> kColorRanges = {"limited", "full"};

struct KindKeys {
    int64_t kind;
    std::vector<std::string_view> required, optional;
};
// protocol._HEADER_FIELDS for the request kinds, in its order
const std::array<KindKeys, 4>& kind_keys() {
    static const std::array<KindKeys, 4> keys = {{
        {kInfer, {"v", "kind", "id", "model", "image"},
         {"stream", "priority", "deadline_ms", "conf", "iou", "max_det", "shm"}},
        {kCancel, {"v", "kind", "id"}, {}},
        {kStatus, {"v", "kind", "id"}, {"load"}},
        {kInferBatch, {"v", "kind", "id", "model", "images"},
         {"priority", "deadline_ms", "conf", "iou", "max_det"}},
    }};
    return keys;
}

const char* kind_name(int64_t kind) {
    switch (kind) {
        case kInfer: return "INFER";
        case kCancel: return "CANCEL";
        case kStatus: return "STATUS";
        default: return "INFER_BATCH";
    }
}


// A field's dotted path, joined only when a refusal names it: ``prefix`` ("", "images[2].")
// and the field's name.
struct Path {
    Path(const char* field) : name(field) {}  // NOLINT: a field of the header, by its name
    Path(std::string_view in, std::string_view field) : prefix(in), name(field) {}
    std::string str() const { return std::string(prefix).append(name); }

    std::string_view prefix;
    std::string_view name;
};

class Decoder {
  public:
    Decoder(std::vector<Node>& d, Refusal& refusal) : d_(d), refusal_(refusal) {}

    [[noreturn]] void fail(const Path& path, const std::string& reason) {
        refusal_.field = path.str();
        refusal_.message = refusal_.field + ": " + reason;
        throw Refused{};
    }

    // the value of ``key`` in the map at ``map`` (0: none)
    uint32_t get(uint32_t map, std::string_view key) const {
        uint32_t child = map + 1;
        for (uint64_t k = 0; k < d_[map].u; ++k) {
            if (d_[child].s == key && d_[child].type == Type::str) return d_[child].end;
            child = d_[d_[child].end].end;
        }
        return 0;
    }
    bool is_nil(uint32_t at) const { return at == 0 || d_[at].type == Type::nil; }

    uint64_t integer(uint32_t at, const Path& path, uint64_t lo, uint64_t hi) {
        const Node& n = d_[at];
        if (n.type != Type::integer || n.negative || n.u < lo || n.u > hi) {
            fail(path, "must be an int in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                           "], got " + show(d_, at));
        }
        return n.u;
    }
    std::optional<int64_t> opt_int(uint32_t at, const Path& path, uint64_t lo,
                                   uint64_t hi) {
        if (is_nil(at)) return std::nullopt;
        return static_cast<int64_t>(integer(at, path, lo, hi));
    }
    // protocol._float: conf in [0, 1), iou in (0, 1]; NaN and infinities fail both
    std::optional<double> number(uint32_t at, const Path& path, bool lo_open,
                                 bool hi_open) {
        if (is_nil(at)) return std::nullopt;
        const Node& n = d_[at];
        double x = NAN;
        if (n.type == Type::real) x = n.f;
        if (n.type == Type::integer) x = n.negative ? static_cast<double>(n.i) : static_cast<double>(n.u);
        const bool ok = (lo_open ? 0.0 < x : 0.0 <= x) && (hi_open ? x < 1.0 : x <= 1.0);
        if (!ok) {
            fail(path, std::string("must be a finite number in ") + (lo_open ? "(" : "[") +
                           "0.0, 1.0" + (hi_open ? ")" : "]") + ", got " + show(d_, at));
        }
        return x;
    }
    std::string name(uint32_t at, const Path& path) {
        const Node& n = d_[at];
        if (!(n.type == Type::str && is_name(n.s))) {
            fail(path, "must be 1 to " + std::to_string(kMaxNameChars) +
                           " printable characters, got " + show(d_, at));
        }
        return std::string(n.s);
    }
    void map(uint32_t at, const Path& path) {
        if (d_[at].type != Type::map) {
            fail(path, std::string("must be a msgpack map, got ") + type_name(d_[at].type));
        }
    }
    // protocol._keys: every key known, every required one there (keys are strings: parsed so)
    template <typename Required, typename Optional>
    void keys(uint32_t at, const Path& prefix, const Required& required,
              const Optional& optional) {
        uint32_t child = at + 1;
        for (uint64_t k = 0; k < d_[at].u; ++k) {
            const std::string_view key = d_[child].s;
            const auto known = [&](const auto& list) {
                return std::find(list.begin(), list.end(), key) != list.end();
            };
            if (!known(required) && !known(optional)) {
                const std::string in = prefix.str();
                if (is_name(key)) fail(Path{in, key}, "unknown field");
                // a key that would make a poor path (empty, long, unprintable): named in words
                const std::string map = in.empty() ? "header" : in.substr(0, in.size() - 1);
                fail(Path{map, ""}, "unknown field " + show(d_, child));
            }
            child = d_[d_[child].end].end;
        }
        for (const std::string_view key : required) {
            if (get(at, key) == 0) fail(Path{prefix.str(), key}, "missing required field");
        }
    }

    std::vector<Node>& d_;  // the header's nodes
    Refusal& refusal_;
};

// The field names of a map are strings, each once (msgpack-python's hook refuses the rest
// before any field is looked at).
void check_keys(Decoder& dec, const std::vector<Node>& d) {
    thread_local std::vector<uint32_t> keys;  // a map's keys' nodes, in order
    thread_local std::vector<std::string_view> sorted;
    for (uint32_t at = 0; at < d.size(); ++at) {
        if (d[at].type != Type::map) continue;
        keys.clear();
        uint32_t child = at + 1;
        for (uint64_t k = 0; k < d[at].u; ++k) {
            if (d[child].type != Type::str) {
                dec.fail("header", "field names must be strings, got " + show(d, child));
            }
            keys.push_back(child);
            child = d[d[child].end].end;
        }
        const auto first_repeated = [&] {  // the first key seen again, in the map's order
            for (size_t j = 1; j < keys.size(); ++j) {
                for (size_t i = 0; i < j; ++i) {
                    if (d[keys[i]].s == d[keys[j]].s) {
                        dec.fail("header", "duplicate field " + show(d, keys[j]));
                    }
                }
            }
        };
        if (keys.size() <= 16) {  // a header's maps: a few keys, compared pairwise
            first_repeated();
            continue;
        }
        sorted.clear();
        for (const uint32_t key : keys) sorted.push_back(d[key].s);
        std::sort(sorted.begin(), sorted.end());
        if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) first_repeated();
    }
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

// protocol._image: an image map's fields (``path``: "" or "images[i]."), its payload frame
// (``frame``; the next is ``frame`` + 1 when the image has one) or its shared-memory slot
Image image(Decoder& dec, uint32_t img, uint32_t raw_shm, const uint64_t* payloads,
            size_t& frame, const Limits& limits, bool shm, std::string_view path) {
    const auto& d = dec.d_;
    Image out;
    const uint32_t fmt = dec.get(img, "format");
    const auto* known = d[fmt].type == Type::str ? std::find(rules::kPixelFormats.begin(),
                                                             rules::kPixelFormats.end(), d[fmt].s)
                                                 : rules::kPixelFormats.end();
    if (known == rules::kPixelFormats.end()) {
        dec.fail(Path{path, "image.format"},
                 "must be one of ['BGR', 'GRAY', 'NV12', 'RGB', 'YUYV'], got " + show(d, fmt));
    }
    out.format = static_cast<int>(known - rules::kPixelFormats.begin());
    // a YUV frame's colour: one of each list, the first where absent; none for RGB, BGR, GRAY
    const auto colour = [&](std::string_view key, const auto& names, int bit) {
        const uint32_t at = dec.get(img, key);
        if (at == 0) return;
        if (!rules::is_yuv(out.format)) {
            dec.fail(Path{path, std::string("image.") + std::string(key)},
                     "is for NV12 and YUYV frames only");
        }
        if (d[at].type == Type::str && d[at].s == names[1]) {
            out.colour |= bit;
        } else if (!(d[at].type == Type::str && d[at].s == names[0])) {
            dec.fail(Path{path, std::string("image.") + std::string(key)},
                     "must be one of ['" + std::string(names[0]) + "', '" +
                         std::string(names[1]) + "'], got " + show(d, at));
        }
    };
    colour("colorspace", kColorspaces, rules::kBt709);
    colour("color_range", kColorRanges, rules::kFullRange);
    const uint32_t dtype = dec.get(img, "dtype");
    if (!(d[dtype].type == Type::str && d[dtype].s == "uint8")) {
        dec.fail(Path{path, "image.dtype"}, "only 'uint8' is supported, got " + show(d, dtype));
    }
    out.height = static_cast<int64_t>(dec.integer(dec.get(img, "height"), Path{path, "image.height"}, 1,
                                                  static_cast<uint64_t>(limits.max_height)));
    out.width = static_cast<int64_t>(dec.integer(dec.get(img, "width"), Path{path, "image.width"}, 1,
                                                 static_cast<uint64_t>(limits.max_width)));
    if (out.format == rules::kNv12 && out.height % 2 != 0) {
        dec.fail(Path{path, "image.height"}, "an NV12 frame's height is even, got " +
                                                 std::to_string(out.height));
    }
    if (rules::is_yuv(out.format) && out.width % 2 != 0) {
        dec.fail(Path{path, "image.width"}, "an NV12 or YUYV frame's width is even, got " +
                                                std::to_string(out.width));
    }
    if (out.height * out.width > limits.max_image_pixels) {
        dec.fail(Path{path, "image"}, std::to_string(out.width) + "x" + std::to_string(out.height) +
                                     " is over the limit of " +
                                     std::to_string(limits.max_image_pixels) + " pixels");
    }
    if (raw_shm != 0) {  // a shared-memory frame
        if (!shm) {
            dec.fail(Path{path, "shm"},
                     "this daemon takes no shared-memory frames ([shm] enabled = false), or not "
                     "from this connection (ipc:// and loopback tcp only)");
        }
        dec.map(raw_shm, Path{path, "shm"});
        dec.keys(raw_shm, Path{path, "shm."}, kShmKeys, std::array<std::string_view, 0>{});
        const uint32_t name = dec.get(raw_shm, "name");
        if (!(d[name].type == Type::str && is_segment_name(d[name].s))) {
            dec.fail(Path{path, "shm.name"}, "must be a segment name ([A-Za-z0-9._-], 1 to 200, no leading "
                                 "dot), got " + show(d, name));
        }
        ShmRef ref;
        ref.name = std::string(d[name].s);
        ref.size = dec.integer(dec.get(raw_shm, "size"), Path{path, "shm.size"}, kShmHeaderBytes + 1,
                               kMaxShmBytes);
        ref.offset = dec.integer(dec.get(raw_shm, "offset"), Path{path, "shm.offset"},
                                 kShmHeaderBytes, ref.size - 1);
        const uint32_t token = dec.get(raw_shm, "token");
        if (!(d[token].type == Type::bin && d[token].s.size() == kShmTokenBytes)) {
            dec.fail(Path{path, "shm.token"}, "must be " + std::to_string(kShmTokenBytes) +
                                                  " bytes, got " + show(d, token));
        }
        ref.token = std::string(d[token].s);
        if (out.bytes() > ref.size - ref.offset) {
            dec.fail(Path{path, "shm"}, "a " + std::to_string(out.bytes()) + "-byte frame at offset " +
                                       std::to_string(ref.offset) + " ends past the segment's " +
                                       std::to_string(ref.size) + " bytes");
        }
        out.shm = std::move(ref);
        return out;
    }
    const uint64_t got = payloads[frame - 1];
    if (got != out.bytes()) {
        const std::string at = "frames[" + std::to_string(frame) + "]";
        dec.fail(Path{at, ""}, "image payload is " + std::to_string(got) + " bytes, the header says " +
                     std::to_string(out.bytes()));
    }
    out.frame = frame++;
    return out;
}

// protocol._scalars: the fields every image of a message shares, checked with an image's
// ``stream`` (at ``stream_at``; an INFER's is the header's)
void scalars(Decoder& dec, uint32_t h, uint32_t stream_at, const Path& stream_path,
             Request& out) {
    out.id = dec.integer(dec.get(h, "id"), "id", 0, kU64Max);
    out.model = dec.name(dec.get(h, "model"), "model");
    std::optional<std::string> stream;
    if (!dec.is_nil(stream_at)) stream = dec.name(stream_at, stream_path);
    const uint32_t priority = dec.get(h, "priority");  // nil means the default, like absence
    out.priority = dec.is_nil(priority)
                       ? 0
                       : static_cast<int64_t>(dec.integer(priority, "priority", 0, kPriorityMax));
    out.deadline_ms = dec.opt_int(dec.get(h, "deadline_ms"), "deadline_ms", 1, kMaxDeadlineMs);
    out.conf = dec.number(dec.get(h, "conf"), "conf", false, true);
    out.iou = dec.number(dec.get(h, "iou"), "iou", true, false);
    out.max_det = dec.opt_int(dec.get(h, "max_det"), "max_det", 1, kMaxDet);
    out.images.back().stream = std::move(stream);
}

Request decode(Decoder& dec, const uint8_t* header, size_t header_bytes, const uint64_t* payloads,
               size_t payload_count, const Limits& limits, bool shm) {
    const size_t frames = 1 + payload_count;
    if (frames > 1 + kMaxBatchImages) {
        dec.fail("frames", "a v1 message has 1 to " + std::to_string(1 + kMaxBatchImages) +
                               " frames, got " + std::to_string(frames));
    }
    uint64_t total = header_bytes;
    for (size_t i = 0; i < payload_count; ++i) total += payloads[i];
    if (total > limits.max_message_bytes) {
        dec.fail("frames", "message of " + std::to_string(total) + " bytes is over the limit of " +
                               std::to_string(limits.max_message_bytes));
    }
    if (header_bytes > limits.max_header_bytes) {
        dec.fail("header", std::to_string(header_bytes) + " bytes is over the limit of " +
                               std::to_string(limits.max_header_bytes));
    }
    auto& d = dec.d_;
    int depth = 0;
    const char* why = Parser(header, header_bytes, d).parse(depth);
    if (*why != '\0') dec.fail("header", std::string("not a valid msgpack document (") + why + ")");
    check_keys(dec, d);
    dec.map(0, "header");
    // what the header yields to address a refusal from here on (protocol._attach)
    const uint32_t rid = dec.get(0, "id");
    const uint32_t raw_kind = dec.get(0, "kind");
    if (rid != 0 && d[rid].type == Type::integer && !d[rid].negative) dec.refusal_.id = d[rid].u;
    if (raw_kind != 0 && d[raw_kind].type == Type::integer) {
        const Node& k = d[raw_kind];
        if (k.negative) {
            dec.refusal_.kind = k.i;
        } else if (k.u <= static_cast<uint64_t>(INT64_MAX)) {
            dec.refusal_.kind = static_cast<int64_t>(k.u);
        }
    }
    if (depth > kMaxRequestDepth) {
        dec.fail("header", "nests deeper than the " + std::to_string(kMaxRequestDepth) +
                               " levels a message has");
    }
    const uint32_t v = dec.get(0, "v");
    if (v == 0) dec.fail("v", "missing required field");
    if (!(d[v].type == Type::integer && !d[v].negative && d[v].u == kProtocolVersion)) {
        dec.fail("v", "version " + show(d, v) + " is not supported (supported: " +
                          std::to_string(kProtocolVersion) + ")");
    }
    if (raw_kind == 0) dec.fail("kind", "missing required field");
    const auto kind = static_cast<int64_t>(dec.integer(raw_kind, "kind", 0, 255));
    const auto& all = kind_keys();
    const auto keys = std::find_if(all.begin(), all.end(),
                                   [&](const KindKeys& k) { return k.kind == kind; });
    if (keys == all.end()) dec.fail("kind", std::to_string(kind) + " is not a request kind");
    if (kind != kInferBatch) {
        const size_t want = kind == kInfer && dec.get(0, "shm") == 0 ? 2 : 1;
        if (frames != want) {
            dec.fail("frames", std::string(kind_name(kind)) + " has " + std::to_string(want) +
                                   " frame(s), got " + std::to_string(frames));
        }
    }
    dec.keys(0, "", keys->required, keys->optional);
    Request out;
    out.kind = kind;
    if (kind == kCancel || kind == kStatus) {
        out.id = dec.integer(rid, "id", 0, kU64Max);
        const uint32_t load = dec.get(0, "load");  // nil means the default, like absence
        if (!dec.is_nil(load)) {
            if (d[load].type != Type::boolean) dec.fail("load", "must be a bool, got " + show(d, load));
            out.load = d[load].u != 0;
        }
        return out;
    }
    size_t frame = 1;
    if (kind == kInfer) {
        const uint32_t img = dec.get(0, "image");
        dec.map(img, "image");
        dec.keys(img, "image.", kImageKeys, kImageOptionalKeys);
        out.images.push_back(image(dec, img, dec.get(0, "shm"), payloads, frame, limits, shm, ""));
        scalars(dec, 0, dec.get(0, "stream"), "stream", out);
        return out;
    }
    const uint32_t images = dec.get(0, "images");
    if (d[images].type != Type::array || d[images].u < 1 || d[images].u > kMaxBatchImages) {
        dec.fail("images", "must be an array of 1 to " + std::to_string(kMaxBatchImages) +
                               " image maps");
    }
    size_t inline_images = 0;
    for (uint32_t item = images + 1; item < d[images].end; item = d[item].end) {
        inline_images += !(d[item].type == Type::map && dec.get(item, "shm") != 0);
    }
    if (payload_count != inline_images) {
        dec.fail("frames", "INFER_BATCH has " + std::to_string(1 + inline_images) +
                               " frame(s) (one per image not in shared memory), got " +
                               std::to_string(frames));
    }
    size_t i = 0;
    for (uint32_t item = images + 1; item < d[images].end; item = d[item].end, ++i) {
        const std::string item_path = "images[" + std::to_string(i) + "]";
        const std::string path = item_path + ".";
        dec.map(item, Path{item_path, ""});
        dec.keys(item, Path{path, ""}, kImageKeys, kBatchImageKeys);
        out.images.push_back(
            image(dec, item, dec.get(item, "shm"), payloads, frame, limits, shm, path));
        scalars(dec, 0, dec.get(item, "stream"), Path{path, "stream"}, out);
    }
    return out;
}

}  // namespace

std::string py_repr(std::string_view utf8) { return py_string(code_points(utf8)); }

Decoded decode_request(const uint8_t* header, size_t header_bytes, const uint64_t* payloads,
                       size_t payload_count, const Limits& limits, bool shm) {
    thread_local std::vector<Node> nodes;
    nodes.clear();
    Decoded out;
    Decoder dec(nodes, out.refusal);
    try {
        out.request = decode(dec, header, header_bytes, payloads, payload_count, limits, shm);
    } catch (const Refused&) {
        out.request.reset();
    }
    if (nodes.capacity() > 4096) std::vector<Node>().swap(nodes);  // a big header's, let go
    return out;
}

std::optional<Cheap> as_cheap(const Request& r) {
    if (r.kind != kCancel && r.kind != kStatus) return std::nullopt;
    return Cheap{r.kind, r.id};
}

std::vector<std::pair<int64_t, Keys>> header_keys() {
    std::vector<std::pair<int64_t, Keys>> out;
    for (const KindKeys& k : kind_keys()) {
        out.push_back({k.kind, {{k.required.begin(), k.required.end()},
                                {k.optional.begin(), k.optional.end()}}});
    }
    return out;
}
std::vector<std::string> image_keys() { return {kImageKeys.begin(), kImageKeys.end()}; }
std::vector<std::string> image_optional_keys() {
    return {kImageOptionalKeys.begin(), kImageOptionalKeys.end()};
}
std::vector<std::string> shm_keys() { return {kShmKeys.begin(), kShmKeys.end()}; }

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
    void array(uint32_t n) {  // a msgpack array of n items (n < 16 here)
        byte(static_cast<uint8_t>(0x90 | n));
    }
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

std::string write_refusal_reply(const Refusal& refusal, int64_t status, std::string_view message,
                                bool* payload_frame) {
    *payload_frame = false;
    const int64_t kind = refusal.kind.value_or(0);
    const bool known = refusal.id && (kind == kInfer || kind == kCancel || kind == kStatus ||
                                      kind == kInferBatch);
    if (known && kind == kInfer) {
        *payload_frame = true;
        return write_infer_reply(*refusal.id, status, message, std::nullopt, Timing{}, 0);
    }
    if (known && kind != kInferBatch) return write_cheap_reply({kind, *refusal.id}, status, message);
    Writer w;
    // protocol.encode's map: v kind id status message (and an INFER_BATCH_REPLY's results)
    w.map(known ? 6 : 5);
    w.field("v", kProtocolVersion);
    w.field("kind", known ? static_cast<uint64_t>(kInferBatch | 0x80) : 0x80);
    w.str("id");
    w.opt_uint(refusal.id);
    w.str("status");
    w.sint(status);
    w.str("message");
    w.str(message);
    if (known) {
        w.str("results");
        w.array(0);
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
