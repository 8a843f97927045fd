// What `grace-bench map` stores: uint64_t keys and 64-byte values that encode their key, so
// every read can check that it saw a complete value of the key it asked for (a torn, stale
// or recycled element shows up as a mismatch). The values are a trivially copyable struct
// (value64), or the same 64 bytes in a std::string (`--value string`: on the heap, so an
// element has a destructor and grace retires it instead of handing it straight back to the
// pool).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace grace::bench {

struct value64 {
  std::uint64_t word[8];
};
static_assert(sizeof(value64) == 64);

inline constexpr std::uint64_t kValueStride = 0x9e3779b97f4a7c15ULL;

inline value64 make_value(std::uint64_t key) noexcept {
  value64 v;
  for (unsigned i = 0; i < 8; ++i) v.word[i] = key + kValueStride * i;
  return v;
}

// All eight words, without early exit (the compiler vectorizes it).
inline bool value_matches(const value64& v, std::uint64_t key) noexcept {
  std::uint64_t diff = 0;
  for (unsigned i = 0; i < 8; ++i) diff |= v.word[i] ^ (key + kValueStride * i);
  return diff == 0;
}

inline std::string make_string_value(std::uint64_t key) {
  const value64 v = make_value(key);
  return std::string(reinterpret_cast<const char*>(v.word), sizeof v.word);
}

inline bool value_matches(const std::string& v, std::uint64_t key) noexcept {
  const value64 expected = make_value(key);
  return v.size() == sizeof expected.word &&
         std::memcmp(v.data(), expected.word, sizeof expected.word) == 0;
}

// The value of `key` as a Value (value64 or std::string).
template <class Value>
Value value_for(std::uint64_t key) {
  if constexpr (std::is_same_v<Value, value64>) {
    return make_value(key);
  } else {
    static_assert(std::is_same_v<Value, std::string>);
    return make_string_value(key);
  }
}

// The i-th key of the lookup, mixed, footprint and destroy key sets: a bijection of i
// (splitmix64's finalizer), so keys are distinct, spread over 64 bits, and maps whose
// default hash is the identity (oneTBB, libcuckoo) see no artificial regularity. The
// htab-mem use cases use raw small keys (t, t + p, ...), as htab-mem does.
inline std::uint64_t key_of(std::uint64_t i) noexcept {
  std::uint64_t z = i + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A small per-thread generator (wyrand): one multiply per draw.
class fast_rng {
 public:
  explicit fast_rng(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t next() noexcept {
    state_ += 0xa0761d6478bd642fULL;
    const unsigned __int128 product =
        static_cast<unsigned __int128>(state_) * (state_ ^ 0xe7037ed1a0b428dbULL);
    return static_cast<std::uint64_t>(product >> 64) ^ static_cast<std::uint64_t>(product);
  }
  // Uniform in [0, n) for n < 2^32, from the low 32 bits of `draw`.
  static std::uint64_t below(std::uint64_t draw, std::uint64_t n) noexcept {
    return ((draw & 0xffffffffULL) * n) >> 32;
  }

 private:
  std::uint64_t state_;
};

}  // namespace grace::bench
