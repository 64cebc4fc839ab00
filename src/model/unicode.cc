#include "unicode.h"

#include <unicode/uchar.h>

#include <array>

namespace combs::unicode {

std::vector<Char> split_utf8(std::string_view s) {
  std::vector<Char> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    if (b0 < 0x80) {  // ASCII: most text
      out.push_back({b0, static_cast<uint32_t>(i), 1, true});
      ++i;
      continue;
    }
    int len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xe ? 3 : (b0 >> 3) == 0x1e ? 4 : 0;
    uint32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1f) : len == 3 ? (b0 & 0x0f) : (b0 & 0x07);
    bool valid = len > 0 && i + len <= s.size();
    for (int k = 1; valid && k < len; ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if ((b & 0xc0) != 0x80) valid = false;
      cp = (cp << 6) | (b & 0x3f);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid too.
    if (valid && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
                  (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)) {
      valid = false;
    }
    if (!valid) {
      out.push_back({b0, static_cast<uint32_t>(i), 1, false});
      ++i;
    } else {
      out.push_back({cp, static_cast<uint32_t>(i), static_cast<uint8_t>(len), true});
      i += len;
    }
  }
  return out;
}

bool is_letter_slow(const Char& c) {
  if (!c.valid) return false;
  const int8_t t = u_charType(static_cast<UChar32>(c.cp));
  return t == U_UPPERCASE_LETTER || t == U_LOWERCASE_LETTER || t == U_TITLECASE_LETTER ||
         t == U_MODIFIER_LETTER || t == U_OTHER_LETTER;
}

bool is_number_slow(const Char& c) {
  if (!c.valid) return false;
  const int8_t t = u_charType(static_cast<UChar32>(c.cp));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool is_space_slow(const Char& c) {
  if (!c.valid) return false;
  return u_isUWhiteSpace(static_cast<UChar32>(c.cp));
}

namespace {
struct ByteMap {
  std::array<uint32_t, 256> to_symbol{};
  std::array<int, 324> to_byte{};
  ByteMap() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      to_symbol[b] = printable ? static_cast<uint32_t>(b) : next++;
      to_byte[to_symbol[b]] = b;
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}
}  // namespace

uint32_t byte_to_symbol(uint8_t b) { return byte_map().to_symbol[b]; }
int symbol_to_byte(uint32_t cp) { return cp < 324 ? byte_map().to_byte[cp] : -1; }

size_t complete_prefix(std::string_view s) {
  // Look at most 3 bytes back for the start of an unfinished multi-byte character.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<uint8_t>(s[n - back]);
    if ((b & 0xc0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const int len = (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 1;
    return static_cast<size_t>(len) > back ? n - back : n;
  }
  return n;
}

}  // namespace combs::unicode
