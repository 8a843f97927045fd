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
//   - checked_string_key() / checked_string() / checked_string_valid_for(): std::string keys
//     and values long enough to live on the heap, a value carrying its key, a version and a
//     checksum of both, so a torn, freed or another key's string fails the check.
//   - lifetime_registry and lifetime_object: a key or value with a non-trivial destructor;
//     every instance (copies included) gets a serial number and its destructions are counted
//     per serial, so "destroyed exactly once" needs no unique ids.
//   - rejects(): whether a map's constructor throws std::invalid_argument naming an option.
//   - mod7_hash: every key in seven buckets (long chains of equal hashes).
//   - arm_resizer_pause(): the next resize pauses half-way until let_resizer_go().
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "grace/map/detail/split_list.h"
#include "grace/map/hash_map.h"
#include "tests/testing/testing.h"

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

// std::string keys and values that the small-string buffer cannot hold (each lives on the
// heap, so a string destroyed too early is a use-after-free under ASan and garbage
// otherwise). The value reads "<key>|<version, 16 hex digits>|<checksum, 16 hex digits>".
inline std::string checked_string_key(std::uint64_t k) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "key-%020llu", static_cast<unsigned long long>(k));
  return buffer;
}

inline std::uint64_t string_checksum(std::string_view key, std::uint64_t version) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, then checked_value's mix
  for (const char c : key) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return checked_value::mix(h ^ (version * 0x9e3779b97f4a7c15ULL));
}

inline std::string checked_string(std::string_view key, std::uint64_t version) {
  char tail[40];
  std::snprintf(tail, sizeof tail, "|%016llx|%016llx", static_cast<unsigned long long>(version),
                static_cast<unsigned long long>(string_checksum(key, version)));
  std::string value(key);
  value += tail;
  return value;
}

// The version a valid value carries; call only on values that are checked_string_valid_for.
inline std::uint64_t checked_string_version(std::string_view value) noexcept {
  const std::string_view digits = value.substr(value.size() - 33, 16);
  std::uint64_t version = 0;
  for (const char c : digits) {
    version = version * 16 + static_cast<std::uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  }
  return version;
}

inline bool checked_string_valid_for(std::string_view value, std::string_view key) noexcept {
  if (value.size() != key.size() + 34 || value.substr(0, key.size()) != key) return false;
  if (value[key.size()] != '|' || value[key.size() + 17] != '|') return false;
  for (std::size_t i = key.size() + 1; i < value.size(); ++i) {
    const char c = value[i];
    if (i == key.size() + 17) continue;
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  const std::uint64_t version = checked_string_version(value);
  std::uint64_t checksum = 0;
  for (const char c : value.substr(key.size() + 18)) {
    checksum = checksum * 16 + static_cast<std::uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  }
  return checksum == string_checksum(key, version);
}

// ---------------------------------------------------------------------------------------------
// Instance accounting.

// Hands out serial numbers to lifetime_object instances and counts destructions per serial.
// Serials past `capacity` are counted in the totals only (and reported by each_destroyed_once).
class lifetime_registry {
 public:
  explicit lifetime_registry(std::size_t capacity)
      : capacity_(capacity), destroyed_(new std::atomic<std::uint8_t>[capacity]()) {}
  lifetime_registry(const lifetime_registry&) = delete;
  lifetime_registry& operator=(const lifetime_registry&) = delete;

  // Relaxed (every counter here): tallies; the tests read them after a join, clear() or
  // barrier(), which is the ordering under test.
  std::uint64_t on_construct() noexcept {
    return constructed_.fetch_add(1, std::memory_order_relaxed);
  }
  void on_destroy(std::uint64_t serial, bool intact) noexcept {
    if (!intact) corrupt_.fetch_add(1, std::memory_order_relaxed);
    if (serial < capacity_) {
      std::uint8_t count = destroyed_[serial].load(std::memory_order_relaxed);
      // Relaxed: a saturating per-serial tally (255 means "many").
      while (count < 255 && !destroyed_[serial].compare_exchange_weak(count, count + 1,
                                                                      std::memory_order_relaxed)) {
      }
    }
    destroyed_total_.fetch_add(1, std::memory_order_relaxed);
  }

  std::uint64_t constructed() const noexcept {
    return constructed_.load(std::memory_order_relaxed);
  }
  std::uint64_t destroyed() const noexcept {
    return destroyed_total_.load(std::memory_order_relaxed);
  }
  std::int64_t live() const noexcept {
    return static_cast<std::int64_t>(constructed()) - static_cast<std::int64_t>(destroyed());
  }
  std::uint64_t corrupt() const noexcept { return corrupt_.load(std::memory_order_relaxed); }

  // Every instance ever constructed was destroyed exactly once, each with its canary intact.
  ::testing::AssertionResult each_destroyed_once() const {
    const std::uint64_t made = constructed();
    if (made > capacity_) {
      return ::testing::AssertionFailure()
             << made << " instances exceed the registry's capacity of " << capacity_;
    }
    std::uint64_t wrong = 0;
    std::uint64_t first_wrong = 0;
    unsigned first_count = 0;
    for (std::uint64_t serial = 0; serial < made; ++serial) {
      const unsigned count = destroyed_[serial].load(std::memory_order_relaxed);
      if (count != 1 && wrong++ == 0) {
        first_wrong = serial;
        first_count = count;
      }
    }
    if (wrong == 0 && corrupt() == 0 && destroyed() == made) {
      return ::testing::AssertionSuccess();
    }
    auto failure = ::testing::AssertionFailure();
    failure << made << " instances constructed, " << destroyed() << " destructions, " << corrupt()
            << " with a poisoned canary";
    if (wrong != 0) {
      failure << "; " << wrong << " not destroyed exactly once, the first is serial " << first_wrong
              << " (destroyed " << first_count << " times)";
    }
    return failure;
  }

 private:
  const std::size_t capacity_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> destroyed_;
  std::atomic<std::uint64_t> constructed_{0};
  std::atomic<std::uint64_t> destroyed_total_{0};
  std::atomic<std::uint64_t> corrupt_{0};
};

// A key or value with a non-trivial destructor. Every constructor (copy and move included)
// registers a new instance; the destructor checks, then poisons, the canary. Equality and
// hashing look at the payload only.
class lifetime_object {
 public:
  static constexpr std::uint64_t kAlive = 0x11fe11fe11fe11feULL;
  static constexpr std::uint64_t kPoison = 0xdeaddeaddeaddeadULL;

  lifetime_object(lifetime_registry& registry, std::uint64_t payload) noexcept
      : registry_(&registry), serial_(registry.on_construct()), payload_(payload) {}
  lifetime_object(const lifetime_object& other) noexcept
      : registry_(other.registry_), serial_(registry_->on_construct()), payload_(other.payload_) {}
  lifetime_object& operator=(const lifetime_object& other) noexcept {
    payload_ = other.payload_;
    return *this;
  }
  ~lifetime_object() {
    const bool was_intact = intact();
    // Relaxed: poison for a reader that (wrongly) still holds the instance; see intact().
    canary_.store(kPoison, std::memory_order_relaxed);
    registry_->on_destroy(serial_, was_intact);
  }

  std::uint64_t payload() const noexcept { return payload_; }
  // True while the instance has not been destroyed; readers call it concurrently.
  bool intact() const noexcept {
    // Relaxed: compared by value only; an early destruction is what the tests detect.
    return canary_.load(std::memory_order_relaxed) == kAlive;
  }

  friend bool operator==(const lifetime_object& a, const lifetime_object& b) noexcept {
    return a.payload_ == b.payload_;
  }
  template <class H>
  friend H AbslHashValue(H h, const lifetime_object& object) {
    return H::combine(std::move(h), object.payload_);
  }

 private:
  lifetime_registry* registry_;
  std::uint64_t serial_;
  std::uint64_t payload_;
  std::atomic<std::uint64_t> canary_{kAlive};
};

// Success iff constructing a Map with `options` throws std::invalid_argument whose message
// names `option`.
template <class Map = grace::hash_map<std::uint64_t, std::uint64_t>>
::testing::AssertionResult rejects(const grace::hash_map_options& options,
                                   std::string_view option) {
  return grace::testing::rejects_options([&] { Map map(options); }, option, "the map");
}

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
