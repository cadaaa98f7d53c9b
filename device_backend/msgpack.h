// msgpack.h: the few msgpack encodings the fast path writes, as msgpack-python writes them.
//
// Same choices as msgpack-python's packer (use_bin_type=True): the smallest int
// form (unsigned forms for non-negative values), floats as float64, str8 for
// strings, so a message packed here decodes to what the Python side would send.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace rgpu {

class Packer {
 public:
  std::string out;

  void nil() { out.push_back('\xc0'); }
  void boolean(bool v) { out.push_back(v ? '\xc3' : '\xc2'); }

  void integer(int64_t v) {
    if (v >= 0) {
      auto u = static_cast<uint64_t>(v);
      if (u < 0x80) return byte(u);
      if (u <= 0xff) return head(0xcc, u, 1);
      if (u <= 0xffff) return head(0xcd, u, 2);
      if (u <= 0xffffffffULL) return head(0xce, u, 4);
      return head(0xcf, u, 8);
    }
    if (v >= -32) return byte(static_cast<uint8_t>(v));
    if (v >= -128) return head(0xd0, static_cast<uint64_t>(v), 1);
    if (v >= -32768) return head(0xd1, static_cast<uint64_t>(v), 2);
    if (v >= INT32_MIN) return head(0xd2, static_cast<uint64_t>(v), 4);
    head(0xd3, static_cast<uint64_t>(v), 8);
  }

  void real(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    head(0xcb, bits, 8);
  }

  void str(const std::string& s) {
    size_t n = s.size();
    if (n < 32) byte(0xa0 | n);
    else if (n <= 0xff) head(0xd9, n, 1);
    else if (n <= 0xffff) head(0xda, n, 2);
    else head(0xdb, n, 4);
    out.append(s);
  }

  void array(size_t n) { n < 16 ? byte(0x90 | n) : n <= 0xffff ? head(0xdc, n, 2) : head(0xdd, n, 4); }
  void map(size_t n) { n < 16 ? byte(0x80 | n) : n <= 0xffff ? head(0xde, n, 2) : head(0xdf, n, 4); }

 private:
  void byte(uint64_t b) { out.push_back(static_cast<char>(b & 0xff)); }
  void head(uint8_t tag, uint64_t v, int width) {  // tag, then v big-endian in `width` bytes
    out.push_back(static_cast<char>(tag));
    for (int shift = 8 * (width - 1); shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
  }
};

}  // namespace rgpu
