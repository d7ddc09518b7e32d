// The wire's rule of a name (model, stream, device), written once: the daemon's request decoder
// (dlad/native/wire.cpp) and the SDK (dlad_wire._rules, behind dlad_wire.protocol) both use it.
#pragma once
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <utility>

namespace dlad::names {

constexpr size_t kMaxNameChars = 128;  // protocol.MAX_NAME_CHARS

// The next code point of valid UTF-8 at ``p`` (advanced), as Python's strict decoder takes it:
// no overlong forms, no surrogates, nothing above U+10FFFF. False if not valid.
inline bool next_code_point(const uint8_t*& p, const uint8_t* end, char32_t& c) {
    const uint8_t b = *p;
    size_t n = 0;
    char32_t min = 0;
    if (b < 0x80) {
        c = b;
        ++p;
        return true;
    }
    if ((b & 0xe0) == 0xc0) {
        n = 1, c = b & 0x1f, min = 0x80;
    } else if ((b & 0xf0) == 0xe0) {
        n = 2, c = b & 0x0f, min = 0x800;
    } else if ((b & 0xf8) == 0xf0) {
        n = 3, c = b & 0x07, min = 0x10000;
    } else {
        return false;
    }
    if (static_cast<size_t>(end - p) <= n) return false;
    for (size_t k = 1; k <= n; ++k) {
        if ((p[k] & 0xc0) != 0x80) return false;
        c = (c << 6) | (p[k] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return false;
    p += n + 1;
    return true;
}

// Whether a name's character is printable: not a control, format, separator other than the
// space, surrogate or private-use character.
inline bool printable(char32_t c) {
    // Python's str.isprintable on every assigned character: the controls (Cc), format (Cf),
    // separators other than the space (Zs, Zl, Zp), surrogates (Cs) and private use (Co)
    // are not printable. Unassigned characters are taken (Unicode assigns more each year).
    static constexpr std::array<std::pair<char32_t, char32_t>, 28> kNot = {{
        {0x0, 0x1f},         {0x7f, 0xa0},       {0xad, 0xad},       {0x600, 0x605},
        {0x61c, 0x61c},      {0x6dd, 0x6dd},     {0x70f, 0x70f},     {0x890, 0x891},
        {0x8e2, 0x8e2},      {0x1680, 0x1680},   {0x180e, 0x180e},   {0x2000, 0x200f},
        {0x2028, 0x202f},    {0x205f, 0x2064},   {0x2066, 0x206f},   {0x3000, 0x3000},
        {0xd800, 0xf8ff},    {0xfeff, 0xfeff},   {0xfff9, 0xfffb},   {0x110bd, 0x110bd},
        {0x110cd, 0x110cd},  {0x13430, 0x1343f}, {0x1bca0, 0x1bca3}, {0x1d173, 0x1d17a},
        {0xe0001, 0xe0001},  {0xe0020, 0xe007f}, {0xf0000, 0xffffd}, {0x100000, 0x10fffd},
    }};
    if (c >= 0x20 && c < 0x7f) return true;
    const auto after = std::upper_bound(kNot.begin(), kNot.end(), c,
                                        [](char32_t x, const auto& r) { return x < r.first; });
    return after == kNot.begin() || c > std::prev(after)->second;
}

// Whether ``utf8`` (valid UTF-8) is a name: 1 to 128 characters, each printable.
inline bool is_name(std::string_view utf8) {
    auto p = reinterpret_cast<const uint8_t*>(utf8.data());
    const auto end = p + utf8.size();
    size_t n = 0;
    char32_t c = 0;
    while (p < end && next_code_point(p, end, c)) {
        if (++n > kMaxNameChars || !printable(c)) return false;
    }
    return n > 0;
}

}  // namespace dlad::names
