// Helpers shared by hash_map_test.cc and hash_map_stress_test.cc (test-only).
//
//   namespace gm = grace::testing::map;
//   grace::hash_map<std::uint64_t, gm::checked_value, gm::mod7_hash> map;
//   map.insert(k, gm::checked_value::make(k, 0));
//   map.visit(k, [&](const gm::checked_value& v) { EXPECT_TRUE(v.valid_for(k)); });
//
// What is here:
//   - checked_value: a 64-byte value carrying its key, ~key, a version and a checksum of
//     (key, version), so a torn value, or another key's value (a recycled element), fails
//     valid_for(key).
//   - mod7_hash: every key in seven buckets (long chains of equal hashes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace grace::testing::map {

// A 64-byte value that carries its key and a checksum: a torn or recycled value fails
// valid_for().
struct checked_value {
  std::uint64_t key = 0;
  std::uint64_t not_key = 0;
  std::uint64_t version = 0;
  std::uint64_t check[5] = {};

  static std::uint64_t mix(std::uint64_t x) noexcept {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
  }
  static checked_value make(std::uint64_t key, std::uint64_t version) noexcept {
    checked_value v;
    v.key = key;
    v.not_key = ~key;
    v.version = version;
    for (std::uint64_t i = 0; i < 5; ++i) v.check[i] = mix(key * 8 + i) ^ version;
    return v;
  }
  bool valid_for(std::uint64_t expected_key) const noexcept {
    if (key != expected_key || not_key != ~expected_key) return false;
    for (std::uint64_t i = 0; i < 5; ++i) {
      if (check[i] != (mix(expected_key * 8 + i) ^ version)) return false;
    }
    return true;
  }
  // The same key, one version later.
  checked_value next() const noexcept { return make(key, version + 1); }
  friend bool operator==(const checked_value&, const checked_value&) = default;
};
static_assert(sizeof(checked_value) == 64);
static_assert(std::is_trivially_destructible_v<checked_value>);

// Every key in seven buckets: long chains of equal hashes.
struct mod7_hash {
  std::size_t operator()(std::uint64_t key) const noexcept { return key % 7; }
};

}  // namespace grace::testing::map
