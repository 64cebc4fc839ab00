// UTF-8 and Unicode-category helpers for the tokenizer. Internal to model/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "combs/base/utf8.h"

namespace combs::unicode {

// One character of a UTF-8 string. An invalid byte is a character of its own with valid = false.
struct Char {
  uint32_t cp;      // code point (the raw byte for an invalid one)
  uint32_t offset;  // byte offset in the string
  uint8_t len;      // bytes
  bool valid;
};
std::vector<Char> split_utf8(std::string_view s);

// Unicode general categories L*, N* and the White_Space property (invalid bytes are none).
// ASCII inline (most text); the rest asks ICU.
bool is_letter_slow(const Char& c);
bool is_number_slow(const Char& c);
bool is_space_slow(const Char& c);
inline bool is_letter(const Char& c) {
  if (c.cp < 0x80 && c.valid) return (c.cp | 0x20) >= 'a' && (c.cp | 0x20) <= 'z';
  return is_letter_slow(c);
}
inline bool is_number(const Char& c) {
  if (c.cp < 0x80 && c.valid) return c.cp >= '0' && c.cp <= '9';
  return is_number_slow(c);
}
inline bool is_space(const Char& c) {
  if (c.cp < 0x80 && c.valid) return c.cp == ' ' || (c.cp >= 0x09 && c.cp <= 0x0d);
  return is_space_slow(c);
}

// GPT-2's byte-level alphabet: byte -> a printable code point, and back (-1 when not a symbol).
uint32_t byte_to_symbol(uint8_t b);
int symbol_to_byte(uint32_t cp);

// Length of the longest prefix of s that does not end inside a UTF-8 character that could still
// be completed by more bytes (invalid bytes count as complete).
size_t complete_prefix(std::string_view s);

}  // namespace combs::unicode
