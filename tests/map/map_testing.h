// Helpers shared by the map's tests (test-only).
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
//   - arm_resizer_pause(): the next resize pauses half-way until let_resizer_go().
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <type_traits>

#include "grace/map/detail/split_list.h"

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

// The resizer pauses in the middle of its first level, between two of its read sections,
// until the test lets it go. resizer_paused: Release/Acquire, so a thread that sees it set
// sees what the resizer's thread did before it paused; the other two are Relaxed: polled
// flags that only pace the threads.
inline std::atomic<bool> resizer_paused{false};
inline std::atomic<bool> resizer_may_go{false};
inline std::atomic<bool> resizer_paused_once{false};

inline void pause_resizer_once() {
  if (resizer_paused_once.exchange(true, std::memory_order_relaxed)) return;
  resizer_paused.store(true, std::memory_order_release);  // see above
  while (!resizer_may_go.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Arms pause_resizer_once() for the next resize (detail::resize_half_way_hook).
inline void arm_resizer_pause() {
  resizer_paused.store(false, std::memory_order_relaxed);
  resizer_may_go.store(false, std::memory_order_relaxed);
  resizer_paused_once.store(false, std::memory_order_relaxed);
  grace::detail::resize_half_way_hook.store(&pause_resizer_once, std::memory_order_relaxed);
}

// Waits until the armed resize has paused; what its thread did before is then visible.
inline void wait_until_resizer_paused() {
  // Acquire: see resizer_paused.
  while (!resizer_paused.load(std::memory_order_acquire)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Lets the paused resize go on.
inline void let_resizer_go() { resizer_may_go.store(true, std::memory_order_relaxed); }

// No later resize pauses. Call it once the paused resizer's thread is joined.
inline void disarm_resizer_pause() {
  grace::detail::resize_half_way_hook.store(nullptr, std::memory_order_relaxed);
}

}  // namespace grace::testing::map
