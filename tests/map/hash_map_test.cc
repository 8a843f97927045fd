// Tests for grace::hash_map: the semantics of every member, options and resizing, a
// model-based randomized comparison with std::unordered_map, lifetime accounting (every key
// and value instance destroyed exactly once), allocation failure and throwing user types,
// and races on a single key. Heavier concurrency lives in hash_map_stress_test.cc.
//
// Order: single-threaded semantics; options and resizing; the model; lifetime accounting;
// allocation failure and exceptions; concurrency.
//
// Conventions:
//   - lifetime_object gives every instance (copies and moves included) a serial number and
//     counts destructions per serial, so "destroyed exactly once" needs no unique ids.
//   - The model test takes its random seed from GRACE_MAP_SEED when set (to replay a failure);
//     every failure message names the seed.
//   - Sleeps only widen race windows; correctness rests on joins, flags, barrier() and
//     watchdogs.
#include "grace/map/hash_map.h"

#include <absl/hash/hash.h>
#include <sys/resource.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <bit>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grace/reclaim/detail/cpu.h"
#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/map/map_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace gm = grace::testing::map;
using gm::checked_value;
using gm::lifetime_object;
using gm::lifetime_registry;
using gm::mod7_hash;
using gm::rejects;
using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 60s;  // watchdog budget for scopes that must finish

using u64_map = grace::hash_map<std::uint64_t, std::uint64_t>;

// Every key in one bucket: one long chain of equal hashes.
struct constant_hash {
  std::size_t operator()(std::uint64_t) const noexcept { return 42; }
};

// The map with small, power-of-two resize bounds used by the resize tests; it shrinks below
// an eighth of the grow load factor.
grace::hash_map_options resize_options(std::size_t min_buckets, std::size_t max_buckets,
                                       double grow_load_factor = 1.0) {
  grace::hash_map_options options;
  options.initial_buckets = min_buckets;
  options.min_buckets = min_buckets;
  options.max_buckets = max_buckets;
  options.grow_load_factor = grow_load_factor;
  options.shrink_load_factor = grow_load_factor / 8;
  return options;
}

using lifetime_map = grace::hash_map<lifetime_object, lifetime_object>;

// Counts how a value was made, to prove try_emplace builds in place and only on success.
struct build_counts {
  int from_args = 0;
  int copies = 0;
  int moves = 0;
};
class counted_build {
 public:
  counted_build(build_counts& counts, int value) : counts_(&counts), value_(value) {
    ++counts_->from_args;
  }
  counted_build(const counted_build& other) : counts_(other.counts_), value_(other.value_) {
    ++counts_->copies;
  }
  counted_build(counted_build&& other) noexcept : counts_(other.counts_), value_(other.value_) {
    ++counts_->moves;
  }
  int value() const noexcept { return value_; }

 private:
  build_counts* counts_;
  int value_;
};


// Every key in `expected` maps to its value through find(), and for_each() visits exactly
// these keys, each once, with these values; size() agrees.
template <class Map, class Expected>
::testing::AssertionResult holds_exactly(const Map& map, const Expected& expected) {
  for (const auto& [key, value] : expected) {
    const auto found = map.find(key);
    if (!found.has_value()) return ::testing::AssertionFailure() << "find(" << key << ") missed";
    if (!(*found == value)) {
      return ::testing::AssertionFailure() << "find(" << key << ") returned another value";
    }
  }
  std::size_t visited = 0;
  std::size_t unexpected = 0;
  map.for_each([&](const auto& key, const auto& value) {
    ++visited;
    const auto it = expected.find(key);
    if (it == expected.end() || !(it->second == value)) ++unexpected;
  });
  if (visited != expected.size() || unexpected != 0) {
    return ::testing::AssertionFailure()
           << "for_each visited " << visited << " elements (" << unexpected
           << " unexpected); expected " << expected.size();
  }
  if (map.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size() is " << map.size() << ", expected " << expected.size();
  }
  return ::testing::AssertionSuccess();
}

// =============================================================================================
// Single-threaded semantics.

TEST(HashMap, AnEmptyMapFindsNothing) {
  u64_map map;
  EXPECT_FALSE(map.find(1).has_value());
  EXPECT_FALSE(map.contains(1));
  bool called = false;
  EXPECT_FALSE(map.visit(1, [&](const std::uint64_t&) { called = true; }));
  EXPECT_FALSE(called);
  {
    auto view = map.pin();
    EXPECT_EQ(view.find(1), nullptr);
    EXPECT_FALSE(view.contains(1));
  }
  EXPECT_EQ(map.size(), 0u);
  EXPECT_TRUE(map.empty());
  std::size_t visited = 0;
  map.for_each([&](const std::uint64_t&, const std::uint64_t&) { ++visited; });
  EXPECT_EQ(visited, 0u);
}

TEST(HashMap, InsertAddsOnlyAbsentKeys) {
  u64_map map;
  EXPECT_TRUE(map.insert(1, 10));
  EXPECT_FALSE(map.insert(1, 20));
  EXPECT_EQ(map.find(1), 10u);
  EXPECT_TRUE(map.insert(2, 20));
  EXPECT_EQ(map.size(), 2u);
  EXPECT_FALSE(map.empty());
  EXPECT_TRUE(map.contains(1));
  EXPECT_TRUE(map.contains(2));
  EXPECT_FALSE(map.contains(3));
}

TEST(HashMap, TryEmplaceBuildsTheValueInPlaceOnlyWhenItInserts) {
  build_counts counts;
  grace::hash_map<int, counted_build> map;
  EXPECT_TRUE(map.try_emplace(1, counts, 10));
  EXPECT_EQ(counts.from_args, 1);
  EXPECT_EQ(counts.copies, 0);
  EXPECT_EQ(counts.moves, 0);
  // Present: nothing is built, the value stays.
  EXPECT_FALSE(map.try_emplace(1, counts, 20));
  EXPECT_EQ(counts.from_args, 1);
  EXPECT_EQ(counts.copies, 0);
  EXPECT_EQ(counts.moves, 0);
  EXPECT_TRUE(map.visit(1, [](const counted_build& v) { EXPECT_EQ(v.value(), 10); }));
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMap, InsertOrAssignReturnsTrueOnlyWhenItInserts) {
  u64_map map;
  EXPECT_TRUE(map.insert_or_assign(1, 10));
  EXPECT_EQ(map.find(1), 10u);
  EXPECT_FALSE(map.insert_or_assign(1, 11));
  EXPECT_EQ(map.find(1), 11u);
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMap, AssignReplacesOnlyPresentKeys) {
  u64_map map;
  EXPECT_FALSE(map.assign(1, 10));
  EXPECT_FALSE(map.contains(1));
  EXPECT_EQ(map.size(), 0u);
  ASSERT_TRUE(map.insert(1, 10));
  EXPECT_TRUE(map.assign(1, 11));
  EXPECT_EQ(map.find(1), 11u);
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMap, UpdateReplacesTheValueWithFOfTheOldOneAndIgnoresAbsentKeys) {
  u64_map map;
  int calls = 0;
  EXPECT_FALSE(map.update(1, [&](const std::uint64_t& old) {
    ++calls;
    return old + 1;
  }));
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(map.contains(1));
  ASSERT_TRUE(map.insert(1, 10));
  EXPECT_TRUE(map.update(1, [&](const std::uint64_t& old) {
    ++calls;
    EXPECT_EQ(old, 10u);
    return old * 3;
  }));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(map.find(1), 30u);
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMap, EraseRemovesOnlyPresentKeys) {
  u64_map map;
  EXPECT_FALSE(map.erase(1));
  ASSERT_TRUE(map.insert(1, 10));
  ASSERT_TRUE(map.insert(2, 20));
  EXPECT_TRUE(map.erase(1));
  EXPECT_FALSE(map.erase(1));
  EXPECT_FALSE(map.contains(1));
  EXPECT_EQ(map.find(2), 20u);
  EXPECT_EQ(map.size(), 1u);
  // An erased key can come back.
  EXPECT_TRUE(map.insert(1, 11));
  EXPECT_EQ(map.find(1), 11u);
}

TEST(HashMap, EraseIfErasesOnlyWhenThePredicateHoldsForTheCurrentValue) {
  u64_map map;
  int calls = 0;
  EXPECT_FALSE(map.erase_if(1, [&](const std::uint64_t&) {
    ++calls;
    return true;
  }));
  EXPECT_EQ(calls, 0);
  ASSERT_TRUE(map.insert(1, 10));
  EXPECT_FALSE(map.erase_if(1, [&](const std::uint64_t& v) {
    ++calls;
    EXPECT_EQ(v, 10u);
    return false;
  }));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(map.find(1), 10u);
  EXPECT_TRUE(map.erase_if(1, [&](const std::uint64_t& v) { return v == 10; }));
  EXPECT_FALSE(map.contains(1));
  EXPECT_EQ(map.size(), 0u);
}

TEST(HashMap, VisitSeesTheStoredValueWithoutCopyingIt) {
  build_counts counts;
  grace::hash_map<int, counted_build> map;
  ASSERT_TRUE(map.try_emplace(7, counts, 70));
  const counted_build* first = nullptr;
  const counted_build* second = nullptr;
  EXPECT_TRUE(map.visit(7, [&](const counted_build& v) {
    first = &v;
    EXPECT_EQ(v.value(), 70);
  }));
  EXPECT_TRUE(map.visit(7, [&](const counted_build& v) { second = &v; }));
  EXPECT_EQ(first, second);
  EXPECT_EQ(counts.copies, 0);
  EXPECT_EQ(counts.moves, 0);
}

TEST(HashMap, PinnedViewFindsWhatFindFindsAndKeepsItsAddressStable) {
  u64_map map;
  for (std::uint64_t k = 0; k < 100; ++k) ASSERT_TRUE(map.insert(k, k * 10));
  auto view = map.pin();
  EXPECT_TRUE(grace::in_read_section());
  for (std::uint64_t k = 0; k < 100; ++k) {
    const std::uint64_t* p = view.find(k);
    ASSERT_NE(p, nullptr) << k;
    EXPECT_EQ(*p, k * 10);
    EXPECT_EQ(view.find(k), p);
    EXPECT_TRUE(view.contains(k));
  }
  EXPECT_EQ(view.find(100), nullptr);
  EXPECT_FALSE(view.contains(100));
}

TEST(HashMap, PinnedViewEndsItsReadSectionWhenDestroyed) {
  u64_map map;
  ASSERT_TRUE(map.insert(1, 1));
  {
    auto view = map.pin();
    EXPECT_TRUE(grace::in_read_section());
  }
  EXPECT_FALSE(grace::in_read_section());
  // A grace period can complete: the view did not leak its guard.
  gt::watchdog dog(kNoDeadlock, "synchronize() after a pinned view ended");
  map.reclamation_domain().synchronize();
}

TEST(HashMap, ForEachVisitsEveryElementExactlyOnce) {
  u64_map map(resize_options(4, 1 << 12));
  constexpr std::uint64_t kCount = 3000;
  std::unordered_map<std::uint64_t, std::uint64_t> expected;
  for (std::uint64_t k = 0; k < kCount; ++k) {
    ASSERT_TRUE(map.insert(k, k + 1));
    expected[k] = k + 1;
  }
  for (std::uint64_t k = 0; k < kCount; k += 3) {
    ASSERT_TRUE(map.erase(k));
    expected.erase(k);
  }
  for (std::uint64_t k = 1; k < kCount; k += 3) {
    ASSERT_FALSE(map.insert_or_assign(k, k + 2));
    expected[k] = k + 2;
  }
  EXPECT_TRUE(holds_exactly(map, expected));
}

TEST(HashMap, ForEachRunsInsideOneReadSection) {
  u64_map map;
  ASSERT_TRUE(map.insert(1, 1));
  ASSERT_TRUE(map.insert(2, 2));
  map.for_each(
      [](const std::uint64_t&, const std::uint64_t&) { EXPECT_TRUE(grace::in_read_section()); });
  EXPECT_FALSE(grace::in_read_section());
}

TEST(HashMap, ForEachStopsWhenItsFunctionReturnsFalse) {
  u64_map map;
  for (std::uint64_t k = 0; k < 100; ++k) ASSERT_TRUE(map.insert(k, k));
  int calls = 0;
  map.for_each([&](std::uint64_t, std::uint64_t) { return ++calls < 10; });
  EXPECT_EQ(calls, 10);
  calls = 0;
  map.for_each([&](std::uint64_t, std::uint64_t) { ++calls; });  // void: every element
  EXPECT_EQ(calls, 100);
}

TEST(HashMap, InsertOrUpdateCountsEveryCallExactlyOnceAcrossThreads) {
  constexpr std::uint64_t kKeys = 64;
  const std::size_t calls = gt::iterations(20'000);
  u64_map map;
  gt::run_threads(2, [&](unsigned t) {
    for (std::size_t i = 0; i < calls; ++i) {
      const std::uint64_t key = (i * 7 + t) % kKeys;
      map.insert_or_update(key, 1, [](std::uint64_t n) { return n + 1; });
      // An erase now and then makes the key absent again, so inserts race with updates.
      if (i % 97 == 0 && t == 0) {
        if (auto taken = map.extract(key)) map.insert_or_update(key, *taken, [&](std::uint64_t n) {
          return n + *taken;
        });
      }
    }
  });
  std::uint64_t total = 0;
  map.for_each([&](std::uint64_t, std::uint64_t count) { total += count; });
  EXPECT_EQ(total, 2 * calls);
  EXPECT_TRUE(map.insert_or_update(kKeys + 1, 5, [](std::uint64_t n) { return n + 1; }));
  EXPECT_FALSE(map.insert_or_update(kKeys + 1, 5, [](std::uint64_t n) { return n + 1; }));
  EXPECT_EQ(map.find(kKeys + 1), 6u);
}

TEST(HashMap, EraseIfWithAPredicateAloneErasesEveryMatchingElementAndCountsThem) {
  u64_map map;
  for (std::uint64_t k = 0; k < 1000; ++k) ASSERT_TRUE(map.insert(k, k * 2));
  EXPECT_EQ(map.erase_if([](std::uint64_t key, std::uint64_t value) {
    return key % 3 == 0 && value == key * 2;
  }),
            334u);
  EXPECT_EQ(map.size(), 666u);
  for (std::uint64_t k = 0; k < 1000; ++k) EXPECT_EQ(map.contains(k), k % 3 != 0) << k;
  EXPECT_EQ(map.erase_if([](std::uint64_t, std::uint64_t) { return false; }), 0u);
  EXPECT_EQ(map.erase_if([](std::uint64_t, std::uint64_t) { return true; }), 666u);
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, ExtractErasesTheKeyAndReturnsItsValue) {
  grace::hash_map<std::string, std::string> map;
  ASSERT_TRUE(map.insert("a", "alpha"));
  ASSERT_TRUE(map.insert("b", "beta"));
  EXPECT_EQ(map.extract("a"), "alpha");
  EXPECT_EQ(map.extract("a"), std::nullopt);
  EXPECT_FALSE(map.contains("a"));
  EXPECT_EQ(map.size(), 1u);
  EXPECT_EQ(map.find("b"), "beta");
}

// Two threads extract the same keys while a third replaces their values: each key is
// extracted exactly once, with a value it really had.
TEST(HashMap, ConcurrentExtractsTakeEachKeyOnceWithAValueItHad) {
  constexpr std::uint64_t kKeys = 20'000;
  u64_map map;
  for (std::uint64_t k = 0; k < kKeys; ++k) ASSERT_TRUE(map.insert(k, k * 10));
  std::array<std::vector<std::pair<std::uint64_t, std::uint64_t>>, 2> taken;
  gt::run_threads(3, [&](unsigned t) {
    if (t == 2) {
      for (std::uint64_t k = 0; k < kKeys; ++k) map.assign(k, k * 10 + 1);
      return;
    }
    for (std::uint64_t k = 0; k < kKeys; ++k) {
      if (auto value = map.extract(k)) taken[t].emplace_back(k, *value);
    }
  });
  std::vector<int> times(kKeys, 0);
  for (const auto& list : taken) {
    for (const auto& [key, value] : list) {
      ++times[key];
      EXPECT_TRUE(value == key * 10 || value == key * 10 + 1) << key << " -> " << value;
    }
  }
  EXPECT_EQ(std::count(times.begin(), times.end(), 1), static_cast<long>(kKeys));
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, ClearErasesEverythingAndLeavesTheMapUsable) {
  u64_map map;
  map.clear();
  EXPECT_TRUE(map.empty());
  for (std::uint64_t k = 0; k < 500; ++k) ASSERT_TRUE(map.insert(k, k));
  map.clear();
  EXPECT_EQ(map.size(), 0u);
  EXPECT_TRUE(map.empty());
  for (std::uint64_t k = 0; k < 500; ++k) EXPECT_FALSE(map.contains(k)) << k;
  std::size_t visited = 0;
  map.for_each([&](const std::uint64_t&, const std::uint64_t&) { ++visited; });
  EXPECT_EQ(visited, 0u);
  EXPECT_TRUE(map.insert(3, 33));
  EXPECT_EQ(map.find(3), 33u);
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMap, ClearInsideAReadSectionErasesWithoutWaiting) {
  u64_map map;
  for (std::uint64_t k = 0; k < 100; ++k) ASSERT_TRUE(map.insert(k, k));
  {
    gt::watchdog dog(kNoDeadlock, "clear() inside a read section");
    auto guard = grace::pin();
    map.clear();  // must not wait for a grace period (it would wait for itself)
    EXPECT_EQ(map.size(), 0u);
  }
  EXPECT_FALSE(map.contains(5));
}

TEST(HashMap, SizeAndEmptyFollowInsertsAndErases) {
  u64_map map;
  std::size_t expected = 0;
  for (std::uint64_t k = 0; k < 200; ++k) {
    ASSERT_TRUE(map.insert(k, k));
    ++expected;
    ASSERT_EQ(map.size(), expected);
    ASSERT_EQ(map.stats().size, expected);
  }
  for (std::uint64_t k = 0; k < 200; k += 2) {
    ASSERT_TRUE(map.erase(k));
    --expected;
    ASSERT_EQ(map.size(), expected);
  }
  for (std::uint64_t k = 1; k < 200; k += 2) ASSERT_FALSE(map.insert_or_assign(k, 0));
  EXPECT_EQ(map.size(), expected);  // replacing does not count
  for (std::uint64_t k = 1; k < 200; k += 2) ASSERT_TRUE(map.erase(k));
  EXPECT_EQ(map.size(), 0u);
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, CollidingHashesKeepKeysApart) {
  grace::hash_map<std::uint64_t, std::uint64_t, mod7_hash> seven(resize_options(1, 1024));
  grace::hash_map<std::uint64_t, std::uint64_t, constant_hash> one(resize_options(1, 1024));
  std::unordered_map<std::uint64_t, std::uint64_t> expected;
  for (std::uint64_t k = 0; k < 300; ++k) {
    ASSERT_TRUE(seven.insert(k, k * 2));
    ASSERT_TRUE(one.insert(k, k * 2));
    expected[k] = k * 2;
  }
  for (std::uint64_t k = 0; k < 300; k += 5) {
    ASSERT_TRUE(seven.erase(k));
    ASSERT_TRUE(one.erase(k));
    expected.erase(k);
  }
  for (std::uint64_t k = 1; k < 300; k += 5) {
    ASSERT_TRUE(seven.update(k, [](const std::uint64_t& v) { return v + 1; }));
    ASSERT_TRUE(one.update(k, [](const std::uint64_t& v) { return v + 1; }));
    ++expected[k];
  }
  EXPECT_TRUE(holds_exactly(seven, expected));
  EXPECT_TRUE(holds_exactly(one, expected));
  for (std::uint64_t k = 0; k < 300; k += 5) {
    EXPECT_FALSE(seven.contains(k));
    EXPECT_FALSE(one.contains(k));
  }
}

// Keys that compare equal ignoring case, with a hash to match.
struct case_insensitive_hash {
  std::size_t operator()(const std::string& s) const {
    std::string lower(s);
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return absl::Hash<std::string>()(lower);
  }
};
struct case_insensitive_equal {
  bool operator()(const std::string& a, const std::string& b) const {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
             return std::tolower(static_cast<unsigned char>(x)) ==
                    std::tolower(static_cast<unsigned char>(y));
           });
  }
};

TEST(HashMap, KeyEqualDecidesWhichKeysAreTheSame) {
  grace::hash_map<std::string, int, case_insensitive_hash, case_insensitive_equal> map;
  EXPECT_TRUE(map.insert("Grace-Period", 1));
  EXPECT_FALSE(map.insert("GRACE-PERIOD", 2));
  EXPECT_EQ(map.find("grace-period"), 1);
  EXPECT_FALSE(map.insert_or_assign("grace-PERIOD", 3));
  EXPECT_EQ(map.find("Grace-Period"), 3);
  int visits = 0;
  map.for_each([&](const std::string&, const int&) { ++visits; });
  EXPECT_EQ(visits, 1);
  EXPECT_TRUE(map.erase("GRACE-period"));
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, ValuesAsLargeAsThePoolTakesAreStoredFoundAndErased) {
  // key 8 + links 16 + value: the largest element the pool takes (a larger one is a
  // static_assert naming object_pool::max_object_size).
  using large_value = std::array<std::uint64_t, (grace::object_pool::max_object_size - 24) / 8>;
  grace::hash_map<std::uint64_t, large_value> map;
  auto value_of = [](std::uint64_t key) {
    large_value value;
    for (std::size_t i = 0; i < value.size(); ++i) value[i] = key * value.size() + i;
    return value;
  };
  constexpr std::uint64_t kKeys = 200;
  for (std::uint64_t key = 0; key < kKeys; ++key) ASSERT_TRUE(map.insert(key, value_of(key)));
  for (std::uint64_t key = 0; key < kKeys; ++key) {
    ASSERT_TRUE(map.visit(key, [&](const large_value& value) {
      EXPECT_EQ(value, value_of(key)) << "key " << key;
    }));
  }
  for (std::uint64_t key = 0; key < kKeys; key += 2) ASSERT_TRUE(map.erase(key));
  EXPECT_EQ(map.size(), kKeys / 2);
  EXPECT_FALSE(map.contains(0));
  EXPECT_TRUE(map.contains(1));
}

TEST(HashMap, StringKeysAndValuesRoundTrip) {
  grace::hash_map<std::string, std::string> map;
  std::unordered_map<std::string, std::string> expected;
  for (int i = 0; i < 500; ++i) {
    std::string key = "a key long enough to live on the heap #" + std::to_string(i);
    std::string value = std::string(100, static_cast<char>('a' + i % 26)) + std::to_string(i);
    ASSERT_TRUE(map.insert(key, value));
    expected[key] = value;
  }
  for (int i = 0; i < 500; i += 4) {
    const std::string key = "a key long enough to live on the heap #" + std::to_string(i);
    ASSERT_TRUE(map.update(key, [](const std::string& v) { return v + "!"; }));
    expected[key] += "!";
  }
  for (int i = 1; i < 500; i += 4) {
    const std::string key = "a key long enough to live on the heap #" + std::to_string(i);
    ASSERT_TRUE(map.erase(key));
    expected.erase(key);
  }
  EXPECT_TRUE(holds_exactly(map, expected));
}

// Transparent hash and equality for std::string keys, over std::string_view.
struct string_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return absl::Hash<std::string_view>{}(s); }
};
struct string_equal {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};
using transparent_string_map = grace::hash_map<std::string, int, string_hash, string_equal>;
using plain_string_map = grace::hash_map<std::string, int>;

// Without transparent Hash and KeyEqual only a Key (or what converts to one) is taken.
template <class Map, class K>
concept finds_by = requires(const Map& m, const K& k) { m.find(k); };
template <class Map, class K>
concept erases_by = requires(Map& m, const K& k) { m.erase(k); };
static_assert(finds_by<transparent_string_map, std::string_view>);
static_assert(erases_by<transparent_string_map, std::string_view>);
static_assert(!finds_by<plain_string_map, std::string_view>);
static_assert(!erases_by<plain_string_map, std::string_view>);
static_assert(finds_by<plain_string_map, const char*>);  // converts to a Key

// A key that counts how many times one is built, and a transparent hash and equality that
// also take its id alone.
struct counted_key {
  static inline std::atomic<int> built{0};
  explicit counted_key(std::uint64_t key_id) : id(key_id) { built.fetch_add(1); }
  counted_key(const counted_key& other) : id(other.id) { built.fetch_add(1); }
  counted_key& operator=(const counted_key&) = delete;
  std::uint64_t id;
};
std::uint64_t id_of(const counted_key& k) { return k.id; }
std::uint64_t id_of(std::uint64_t id) { return id; }

// Transparent hashing and equality of keys by what `Projection` maps them to.
template <class Projection>
struct projected_hash {
  using is_transparent = void;
  template <class K>
  std::size_t operator()(const K& k) const {
    const auto projected = Projection{}(k);
    return absl::Hash<decltype(projected)>{}(projected);
  }
};
template <class Projection>
struct projected_equal {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    return Projection{}(a) == Projection{}(b);
  }
};
struct id_projection {
  template <class K>
  std::uint64_t operator()(const K& k) const {
    return id_of(k);
  }
};
using id_hash = projected_hash<id_projection>;
using id_equal = projected_equal<id_projection>;

TEST(HashMap, ReadsAndErasesByATransparentKeyBuildNoKey) {
  grace::hash_map<counted_key, std::uint64_t, id_hash, id_equal> map;
  for (std::uint64_t id = 0; id < 200; ++id) ASSERT_TRUE(map.insert(counted_key(id), id * 3));
  const int built = counted_key::built.load();
  for (std::uint64_t id = 0; id < 400; ++id) {
    const bool present = id < 200;
    EXPECT_EQ(map.contains(id), present) << id;
    EXPECT_EQ(map.find(id), present ? std::optional<std::uint64_t>(id * 3) : std::nullopt) << id;
    std::uint64_t seen = 0;
    EXPECT_EQ(map.visit(id, [&](std::uint64_t v) { seen = v; }), present) << id;
    EXPECT_EQ(seen, present ? id * 3 : 0) << id;
    auto view = map.pin();
    EXPECT_EQ(view.contains(id), present) << id;
    const std::uint64_t* pinned = view.find(id);
    EXPECT_EQ(pinned != nullptr && *pinned == id * 3, present) << id;
  }
  for (std::uint64_t id = 0; id < 200; id += 2) {
    EXPECT_FALSE(map.erase_if(id, [](std::uint64_t v) { return v % 2 == 1; })) << id;
    EXPECT_TRUE(map.erase(id)) << id;
    EXPECT_FALSE(map.erase(id)) << id;
  }
  EXPECT_EQ(counted_key::built.load(), built);
  EXPECT_EQ(map.size(), 100u);
  for (std::uint64_t id = 0; id < 200; ++id) EXPECT_EQ(map.contains(id), id % 2 == 1) << id;
}

TEST(HashMap, StringKeysAreFoundAndErasedByStringViewsAndLiterals) {
  transparent_string_map map;
  const std::string prefix = "a key long enough to live on the heap #";
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(map.insert(prefix + std::to_string(i), i));
  ASSERT_TRUE(map.insert("short", -1));
  for (int i = 0; i < 100; ++i) {
    const std::string key = prefix + std::to_string(i);
    EXPECT_EQ(map.find(std::string_view(key)), i);
  }
  EXPECT_EQ(map.find("short"), -1);
  EXPECT_FALSE(map.contains(std::string_view("absent")));
  EXPECT_TRUE(map.erase(std::string_view("short")));
  EXPECT_FALSE(map.contains("short"));
  EXPECT_TRUE(map.erase_if(prefix + "7", [](int v) { return v == 7; }));
  EXPECT_EQ(map.size(), 99u);
}

// A key that can only be moved, found by its id too (transparent hash and equality).
struct move_only_key {
  explicit move_only_key(std::uint64_t key_id) : id(key_id) {}
  move_only_key(move_only_key&&) = default;
  move_only_key& operator=(move_only_key&&) = default;
  move_only_key(const move_only_key&) = delete;
  std::uint64_t id;
};
std::uint64_t id_of(const move_only_key& k) { return k.id; }
using move_only_key_map = grace::hash_map<move_only_key, std::uint64_t, id_hash, id_equal>;
using move_only_value_map = grace::hash_map<std::uint64_t, std::unique_ptr<std::uint64_t>>;

template <class Map, class K, class V>
concept assigns = requires(Map& m, const K& k, V v) { m.assign(k, std::move(v)); };
template <class Map, class K>
concept updates = requires(Map& m, const K& k) { m.update(k, [](const auto& v) { return v; }); };
// A replacement needs a copy of the key; find() returns a copy of the value.
static_assert(!assigns<move_only_key_map, move_only_key, std::uint64_t>);
static_assert(!updates<move_only_key_map, move_only_key>);
static_assert(!finds_by<move_only_value_map, std::uint64_t>);

TEST(HashMap, MoveOnlyKeysAreMovedInAndFoundByTheirTransparentId) {
  move_only_key_map map;
  for (std::uint64_t id = 0; id < 300; id += 3) {
    ASSERT_TRUE(map.insert(move_only_key(id), id));
    ASSERT_TRUE(map.try_emplace(move_only_key(id + 1), id + 1));
    ASSERT_TRUE(map.insert_or_assign(move_only_key(id + 2), id + 2));
  }
  EXPECT_FALSE(map.insert_or_assign(move_only_key(7), 70));  // replaces
  EXPECT_EQ(map.size(), 300u);
  for (std::uint64_t id = 0; id < 300; ++id) {
    EXPECT_EQ(map.find(id), id == 7 ? 70 : id) << id;
  }
  move_only_key present(5);
  EXPECT_FALSE(map.insert(std::move(present), 0));
  EXPECT_EQ(present.id, 5u) << "a key that was not inserted is the caller's still";
  EXPECT_TRUE(map.erase(std::uint64_t{5}));
  EXPECT_FALSE(map.contains(std::uint64_t{5}));
}

// Transparent hashing and equality of std::unique_ptr<int> keys by their raw pointer.
const int* raw_of(const int* p) { return p; }
const int* raw_of(const std::unique_ptr<int>& p) { return p.get(); }
struct raw_pointer_projection {
  template <class P>
  const int* operator()(const P& p) const {
    return raw_of(p);
  }
};
using pointer_hash = projected_hash<raw_pointer_projection>;
using pointer_equal = projected_equal<raw_pointer_projection>;

// A std::unique_ptr can be built from a raw pointer (explicitly), and would then own it: no
// lookup, checked or not, may build one.
TEST(HashMap, UniquePtrKeysAreFoundByTheirRawPointerWithoutTakingOwnership) {
  grace::hash_map<std::unique_ptr<int>, int, pointer_hash, pointer_equal> map;
  std::vector<const int*> raw;
  for (int i = 0; i < 100; ++i) {
    auto owned = std::make_unique<int>(i);
    raw.push_back(owned.get());
    ASSERT_TRUE(map.insert(std::move(owned), i));
  }
  for (int i = 0; i < 100; ++i) {
    EXPECT_TRUE(map.contains(raw[i]));
    EXPECT_EQ(map.find(raw[i]), i);
    EXPECT_EQ(*raw[i], i) << "the element's object is intact";
  }
  for (int i = 0; i < 100; i += 2) EXPECT_TRUE(map.erase(raw[i]));
  EXPECT_EQ(map.size(), 50u);
}

TEST(HashMap, MoveOnlyValuesAreStoredAndReadInPlace) {
  move_only_value_map map;
  for (std::uint64_t key = 0; key < 100; ++key) {
    ASSERT_TRUE(map.insert(key, std::make_unique<std::uint64_t>(key * 2)));
  }
  EXPECT_FALSE(map.insert_or_assign(4, std::make_unique<std::uint64_t>(400)));
  EXPECT_TRUE(map.update(6, [](const std::unique_ptr<std::uint64_t>& v) {
    return std::make_unique<std::uint64_t>(*v + 1);
  }));
  auto view = map.pin();
  for (std::uint64_t key = 0; key < 100; ++key) {
    const std::unique_ptr<std::uint64_t>* value = view.find(key);
    ASSERT_NE(value, nullptr);
    EXPECT_EQ(**value, key == 4 ? 400 : key == 6 ? 13 : key * 2) << key;
  }
}

// An insert that loses the race for its key after it built its element (the key already
// moved in) gives the caller the key back: the Value's constructor holds both racers there
// until both have seen the key absent.
TEST(HashMap, AnRvalueKeyThatLosesTheInsertRaceIsGivenBack) {
  struct rendezvous_value {
    explicit rendezvous_value(std::barrier<>& both_built) { both_built.arrive_and_wait(); }
  };
  const std::string long_key(100, 'k');
  for (int round = 0; round < 50; ++round) {
    grace::hash_map<std::string, rendezvous_value> map;
    std::barrier<> both_built(2);
    std::array<std::string, 2> keys{long_key, long_key};
    std::array<bool, 2> inserted{};
    gt::run_threads(2, [&](unsigned t) {
      inserted[t] = map.try_emplace(std::move(keys[t]), both_built);
    });
    ASSERT_NE(inserted[0], inserted[1]) << "round " << round;
    const unsigned loser = inserted[0] ? 1 : 0;
    EXPECT_EQ(keys[loser], long_key) << "round " << round;
    EXPECT_EQ(map.size(), 1u);
  }
}

// The whole-map erase_if walks while another thread inserts keys it does not match, and
// grows the table under it: every matching element present for the whole call goes, and
// nothing else does.
TEST(HashMap, EraseIfWithAPredicateAloneErasesExactlyTheMatchesWhileTheTableGrows) {
  const std::uint64_t keys = gt::iterations(20'000);
  u64_map map(resize_options(16, 1 << 20));
  for (std::uint64_t k = 0; k < keys; ++k) ASSERT_TRUE(map.insert(k, k));
  std::size_t erased = 0;
  gt::run_threads(2, [&](unsigned t) {
    if (t == 0) {
      erased = map.erase_if(
          [&](std::uint64_t key, std::uint64_t value) { return key < keys && value % 2 == 0; });
    } else {
      for (std::uint64_t k = keys; k < 4 * keys; ++k) ASSERT_TRUE(map.insert(k, k));
    }
  });
  EXPECT_EQ(erased, (keys + 1) / 2);
  for (std::uint64_t k = 0; k < 4 * keys; ++k) {
    ASSERT_EQ(map.contains(k), k >= keys || k % 2 == 1) << k;
  }
  EXPECT_GT(map.stats().grows, 0u);
}

TEST(HashMap, StandardAccessorsDescribeTheTableAndItsFunctions) {
  const grace::hash_map_options options = resize_options(16, 1 << 12, 2.0);
  transparent_string_map map(options);
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(map.insert("key" + std::to_string(i), i));
  EXPECT_EQ(map.count("key3"), 1u);
  EXPECT_EQ(map.count(std::string_view("absent")), 0u);
  EXPECT_EQ(map.bucket_count(), 16u);
  EXPECT_FLOAT_EQ(map.load_factor(), 24.0f / 16.0f);
  EXPECT_FLOAT_EQ(map.max_load_factor(), 2.0f);
  EXPECT_EQ(map.hash_function()("key3"), string_hash{}(std::string("key3")));
  EXPECT_TRUE(map.key_eq()(std::string("a"), std::string_view("a")));
}

TEST(HashMap, StatsReportSizeBucketsAndTheComponentsBelow) {
  grace::hash_map_options options = resize_options(8, 1024);
  u64_map map(options);
  grace::hash_map_stats before = map.stats();
  EXPECT_EQ(before.size, 0u);
  EXPECT_EQ(before.buckets, 8u);
  EXPECT_EQ(before.grows, 0u);  // construction is not a resize
  EXPECT_EQ(before.shrinks, 0u);
  for (std::uint64_t k = 0; k < 100; ++k) ASSERT_TRUE(map.insert(k, k));
  const grace::hash_map_stats after = map.stats();
  EXPECT_EQ(after.size, 100u);
  EXPECT_GE(after.buckets, 100u);
  EXPECT_GT(after.grows, 0u);
  EXPECT_GE(after.pool.allocated - before.pool.allocated, 100u);
  EXPECT_GT(after.pool.held_bytes, 0u);
}

TEST(HashMap, ACustomDomainReclaimsTheMapsElements) {
  lifetime_registry registry(1 << 12);
  {
    grace::domain d;
    grace::hash_map_options options;
    options.reclamation = &d;
    {
      grace::hash_map<std::uint64_t, lifetime_object> map(options);
      EXPECT_EQ(&map.reclamation_domain(), &d);
      for (std::uint64_t k = 0; k < 100; ++k) {
        ASSERT_TRUE(map.insert(k, lifetime_object(registry, k)));
      }
      for (std::uint64_t k = 0; k < 100; ++k) ASSERT_TRUE(map.erase(k));
      d.barrier();
      EXPECT_EQ(registry.live(), 0);
      EXPECT_GE(d.stats().reclaimed, 100u);
      EXPECT_GE(map.stats().reclamation.reclaimed, 100u);
    }
  }
  EXPECT_TRUE(registry.each_destroyed_once());
}

// =============================================================================================
// Options and resizing.

TEST(HashMap, ZeroMinBucketsIsRejectedByName) {
  grace::hash_map_options options;
  options.min_buckets = 0;
  EXPECT_TRUE(rejects(options, "min_buckets"));
}

TEST(HashMap, MaxBucketsBelowMinBucketsIsRejectedByName) {
  grace::hash_map_options options;
  options.min_buckets = 128;
  options.max_buckets = 64;
  EXPECT_TRUE(rejects(options, "max_buckets"));
  options.min_buckets = 1;
  options.max_buckets = std::size_t{1} << 60;
  EXPECT_TRUE(rejects(options, "max_buckets"));
}

TEST(HashMap, NonPositiveOrNotANumberGrowLoadFactorIsRejectedByName) {
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity(), -0.0}) {
    grace::hash_map_options options;
    options.grow_load_factor = bad;
    options.shrink_load_factor = 0.0;
    EXPECT_TRUE(rejects(options, "grow_load_factor")) << bad;
  }
}

TEST(HashMap, ShrinkLoadFactorAtOrAboveHalfTheGrowLoadFactorIsRejectedByName) {
  for (double bad : {0.5, 0.75, 2.0, -0.1, std::numeric_limits<double>::quiet_NaN()}) {
    grace::hash_map_options options;
    options.grow_load_factor = 1.0;
    options.shrink_load_factor = bad;
    EXPECT_TRUE(rejects(options, "shrink_load_factor")) << bad;
  }
}

// A shrink aims at half the grow load factor, so it lands between a quarter and a half of it;
// at an eighth, the shrink threshold stays at least a factor 2 below where a shrink lands.
TEST(HashMap, TheDefaultShrinkLoadFactorIsAnEighthOfTheDefaultGrowLoadFactor) {
  const grace::hash_map_options defaults;
  EXPECT_EQ(defaults.grow_load_factor, grace::detail::kLinkTags ? 0.5 : 1.0);
  EXPECT_EQ(defaults.shrink_load_factor, defaults.grow_load_factor / 8);
  u64_map map(defaults);  // and the pair is valid
}

// Only shrink_load_factor set: the message says which grow load factor it is measured against
// (the default differs between builds with and without link tags).
TEST(HashMap, AShrinkLoadFactorAboveHalfTheDefaultGrowLoadFactorIsRejectedWithTheBoundInEffect) {
  grace::hash_map_options options;
  options.shrink_load_factor = options.grow_load_factor / 2;
  try {
    u64_map map(options);
    FAIL() << "shrink_load_factor " << options.shrink_load_factor << " was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("shrink_load_factor"), std::string::npos) << message;
    EXPECT_NE(message.find("= [0, " + std::to_string(options.grow_load_factor / 2) + ")"),
              std::string::npos)
        << message;
  }
}

TEST(HashMap, ZeroInitialBucketsIsRejectedByName) {
  grace::hash_map_options options;
  options.initial_buckets = 0;
  EXPECT_TRUE(rejects(options, "initial_buckets"));
}

TEST(HashMap, InvalidPoolOptionsAreRejectedByName) {
  grace::hash_map_options options;
  options.pool.batch = 64;
  options.pool.high_watermark = 8;
  EXPECT_TRUE(rejects(options, "high_watermark"));
}

TEST(HashMap, APoolThatReusesElementsBeforeAGracePeriodIsRejectedByName) {
  grace::hash_map_options options;
  options.pool.reuse_after_gp = false;
  EXPECT_TRUE(rejects(options, "reuse_after_gp"));
}

TEST(HashMap, ValuesKeepTheirAlignmentWhateverAlignmentThePoolOptionsAsk) {
  struct alignas(64) line_value {
    std::uint64_t word;
  };
  for (const std::size_t asked : {std::size_t{8}, std::size_t{16}, std::size_t{256}}) {
    grace::hash_map_options options;
    options.pool.alignment = asked;
    grace::hash_map<std::uint64_t, line_value> map(options);
    for (std::uint64_t key = 0; key < 300; ++key) ASSERT_TRUE(map.insert(key, {key}));
    auto view = map.pin();
    for (std::uint64_t key = 0; key < 300; ++key) {
      const line_value* value = view.find(key);
      ASSERT_NE(value, nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(value) % alignof(line_value), 0u)
          << "key " << key << " with pool.alignment " << asked;
      EXPECT_EQ(value->word, key);
    }
  }
}

TEST(HashMap, OptionsAtTheEdgesOfTheirRangesAreAccepted) {
  grace::hash_map_options options;
  options.min_buckets = 1;
  options.max_buckets = 1;
  options.initial_buckets = 1;
  options.grow_load_factor = 1024.0;
  options.shrink_load_factor = 511.999;
  EXPECT_NO_THROW({
    u64_map map(options);
    for (std::uint64_t k = 0; k < 100; ++k) ASSERT_TRUE(map.insert(k, k));
    EXPECT_EQ(map.stats().buckets, 1u);
  });
  options = {};
  options.shrink_load_factor = 0.0;
  EXPECT_NO_THROW(u64_map map(options));
}

TEST(HashMap, InitialBucketsAreRoundedUpToAPowerOfTwoAndClampedToMinAndMax) {
  auto buckets_for = [](std::size_t initial, std::size_t min, std::size_t max) {
    grace::hash_map_options options;
    options.initial_buckets = initial;
    options.min_buckets = min;
    options.max_buckets = max;
    return u64_map(options).stats().buckets;
  };
  EXPECT_EQ(buckets_for(3, 1, 1024), 4u);
  EXPECT_EQ(buckets_for(64, 1, 1024), 64u);
  EXPECT_EQ(buckets_for(65, 1, 1024), 128u);
  EXPECT_EQ(buckets_for(2, 64, 1024), 64u);
  EXPECT_EQ(buckets_for(5000, 1, 1024), 1024u);
  EXPECT_EQ(buckets_for(1, 1, 1), 1u);
}

TEST(HashMap, TableGrowsSoTheLoadFactorStaysAtOrBelowTheGrowLoadFactor) {
  const grace::hash_map_options options = resize_options(1, 256, 2.0);
  u64_map map(options);
  std::uint64_t last_grows = 0;
  for (std::uint64_t k = 0; k < 512; ++k) {
    ASSERT_TRUE(map.insert(k, k));
    const grace::hash_map_stats s = map.stats();
    ASSERT_LE(static_cast<double>(s.size), 2.0 * static_cast<double>(s.buckets)) << k;
    ASSERT_LE(s.buckets, 256u);
    ASSERT_GE(s.grows, last_grows);
    last_grows = s.grows;
  }
  EXPECT_EQ(map.stats().buckets, 256u);
  EXPECT_GE(map.stats().grows, 1u);
}

// Each CPU counts the changes it makes and looks at the load factor after its share of the
// distance to the nearest threshold (at least 64 changes once the table is past 256 buckets).
// Spreading one thread's updates over two CPUs whose counters differ catches a schedule that
// forgets the other CPUs' share: the table would then pass a threshold by the whole distance.
TEST(HashMap, UpdatesSpreadOverCpusResizeLargeTablesWithinAFewUpdatesOfEachThreshold) {
  const gt::saved_affinity restore_at_exit;
  const std::array<int, 2> cpus = gt::two_cpus_with_their_own_shards();
  u64_map map(resize_options(512, 1 << 16));
  // Per CPU counter in use (two, or one if no two CPUs have counters of their own), at most
  // 64 changes pass unlooked-at near a threshold.
  const double slack = 64.0 * 2;
  const auto on_cpu_of = [&](std::uint64_t k) {
    if (cpus[0] >= 0) {
      ASSERT_TRUE(gt::pin_to_cpu(cpus[k % 2]));
    }
  };
  for (std::uint64_t k = 0; k < 40'000; ++k) {
    ASSERT_NO_FATAL_FAILURE(on_cpu_of(k));
    ASSERT_TRUE(map.insert(k, k));
    const grace::hash_map_stats s = map.stats();
    ASSERT_LE(static_cast<double>(s.size), static_cast<double>(s.buckets) + slack)
        << "size " << s.size << ", buckets " << s.buckets;
  }
  ASSERT_GE(map.stats().grows, 1u);
  for (std::uint64_t k = 0; k < 40'000; ++k) {
    ASSERT_NO_FATAL_FAILURE(on_cpu_of(k));
    ASSERT_TRUE(map.erase(k));
    const grace::hash_map_stats s = map.stats();
    ASSERT_TRUE(s.buckets == 512 ||
                static_cast<double>(s.size) + slack >= 0.125 * static_cast<double>(s.buckets))
        << "size " << s.size << ", buckets " << s.buckets;
  }
  EXPECT_EQ(map.stats().buckets, 512u);
}

// A look that comes due while another thread holds the resizer's turn (here a reserve()
// paused half-way) cannot resize: the table must grow soon after the turn is free again, not
// a whole far-from-threshold interval later.
TEST(HashMap, ATableThatPassedItsThresholdDuringAnotherResizeGrowsSoonAfterIt) {
  u64_map map(resize_options(1 << 12, 1 << 22));
  ASSERT_TRUE(map.insert(0, 0));  // the first look: far below the threshold
  gm::arm_resizer_pause();
  std::thread reserver([&] { map.reserve(std::size_t{1} << 13); });
  gm::wait_until_resizer_paused();
  std::uint64_t key = 1;
  for (; key < 40'000; ++key) ASSERT_TRUE(map.insert(key, key));  // every look: turn taken
  gm::let_resizer_go();
  reserver.join();
  gm::disarm_resizer_pause();
  const grace::hash_map_stats reserved = map.stats();
  ASSERT_EQ(reserved.buckets, std::size_t{1} << 13);
  const std::uint64_t first_key_after = key;
  while (map.stats().grows == reserved.grows && key < first_key_after + 100'000) {
    ASSERT_TRUE(map.insert(key, key));
    ++key;
  }
  // Per CPU, at most 64 changes pass unlooked-at once a resize is due.
  EXPECT_LE(key - first_key_after, 64 * grace::detail::cpu_shard_count() + 1);
  EXPECT_GT(map.stats().buckets, reserved.buckets);
}

TEST(HashMap, TableShrinksWithHysteresisDownToMinBuckets) {
  u64_map map(resize_options(4, 1024));
  for (std::uint64_t k = 0; k < 256; ++k) ASSERT_TRUE(map.insert(k, k));
  ASSERT_EQ(map.stats().buckets, 256u);
  std::uint64_t shrinks = map.stats().shrinks;
  for (std::uint64_t k = 0; k < 256; ++k) {
    ASSERT_TRUE(map.erase(k));
    const grace::hash_map_stats s = map.stats();
    // Never below the shrink load factor (unless at min_buckets).
    ASSERT_TRUE(s.buckets == 4 ||
                static_cast<double>(s.size) >= 0.125 * static_cast<double>(s.buckets))
        << "size " << s.size << ", buckets " << s.buckets;
    if (s.shrinks != shrinks) {
      // Hysteresis: a shrink aims at half the grow load factor, so the table is not at the
      // edge of growing again.
      ASSERT_LE(static_cast<double>(s.size), 0.5 * static_cast<double>(s.buckets))
          << "size " << s.size << ", buckets " << s.buckets;
      shrinks = s.shrinks;
      const std::uint64_t grows = s.grows;
      ASSERT_TRUE(map.insert(1'000'000 + k, 0));
      EXPECT_EQ(map.stats().grows, grows) << "one insert after a shrink grew the table";
      ASSERT_TRUE(map.erase(1'000'000 + k));
      shrinks = map.stats().shrinks;
    }
  }
  EXPECT_EQ(map.stats().buckets, 4u);
  EXPECT_GT(map.stats().shrinks, 0u);
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, AlternatingInsertAndEraseAtTheGrowThresholdResizesAtMostOnce) {
  u64_map map(resize_options(16, 1024));
  for (std::uint64_t k = 0; k < 16; ++k) ASSERT_TRUE(map.insert(k, k));
  const grace::hash_map_stats start = map.stats();
  ASSERT_EQ(start.buckets, 16u);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(map.insert(16, 16));
    ASSERT_TRUE(map.erase(16));
  }
  const grace::hash_map_stats end = map.stats();
  EXPECT_LE(end.grows - start.grows, 1u);
  EXPECT_EQ(end.shrinks, start.shrinks);
}

TEST(HashMap, TheTableNeverShrinksInsideAReadSection) {
  u64_map map(resize_options(1, 1024));
  for (std::uint64_t k = 0; k < 256; ++k) ASSERT_TRUE(map.insert(k, k));
  const std::uint64_t buckets = map.stats().buckets;
  {
    gt::watchdog dog(kNoDeadlock, "erase() inside a read section");
    auto guard = grace::pin();
    for (std::uint64_t k = 0; k < 256; ++k) ASSERT_TRUE(map.erase(k));
    EXPECT_EQ(map.stats().shrinks, 0u);
    EXPECT_EQ(map.stats().buckets, buckets);
  }
  // The next update outside a read section shrinks it.
  ASSERT_TRUE(map.insert(0, 0));
  ASSERT_TRUE(map.erase(0));
  EXPECT_GT(map.stats().shrinks, 0u);
  EXPECT_LT(map.stats().buckets, buckets);
}

TEST(HashMap, TheTableNeverExceedsMaxBuckets) {
  u64_map map(resize_options(1, 16));
  for (std::uint64_t k = 0; k < 1000; ++k) ASSERT_TRUE(map.insert(k, k));
  EXPECT_EQ(map.stats().buckets, 16u);
  for (std::uint64_t k = 0; k < 1000; ++k) ASSERT_EQ(map.find(k), k);
  map.reserve(1 << 20);
  EXPECT_EQ(map.stats().buckets, 16u);
}

TEST(HashMap, ClearShrinksTheTableBackToMinBuckets) {
  u64_map map(resize_options(8, 1 << 12));
  for (std::uint64_t k = 0; k < 2000; ++k) ASSERT_TRUE(map.insert(k, k));
  ASSERT_GE(map.stats().buckets, 1024u);
  map.clear();
  EXPECT_EQ(map.stats().buckets, 8u);
}

TEST(HashMap, EraseIfOverTheWholeMapShrinksTheTableItEmptied) {
  u64_map map(resize_options(8, 1 << 12));
  for (std::uint64_t k = 0; k < 2000; ++k) ASSERT_TRUE(map.insert(k, k));
  ASSERT_GE(map.stats().buckets, 1024u);
  EXPECT_EQ(map.erase_if([](std::uint64_t, std::uint64_t) { return true; }), 2000u);
  EXPECT_EQ(map.stats().buckets, 8u);
}

TEST(HashMap, ReserveGrowsTheTableSoNElementsFitUnderTheGrowLoadFactor) {
  const grace::hash_map_options options = resize_options(4, 1 << 16, 2.0);
  u64_map map(options);
  map.reserve(1000);
  EXPECT_GE(static_cast<double>(map.stats().buckets) * 2.0, 1000.0);
  EXPECT_EQ(map.stats().buckets, 512u);
  map.reserve(10);  // never shrinks
  EXPECT_EQ(map.stats().buckets, 512u);
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, ReservingMoreThanTheLargestTableHoldsGrowsItToMaxBuckets) {
  for (const std::size_t elements :
       {std::size_t{1} << 20, std::numeric_limits<std::size_t>::max() / 2,
        std::numeric_limits<std::size_t>::max()}) {
    u64_map map(resize_options(4, 1024));
    map.reserve(elements);
    EXPECT_EQ(map.stats().buckets, 1024u) << "reserve(" << elements << ")";
    for (std::uint64_t k = 0; k < 3000; ++k) ASSERT_TRUE(map.insert(k, k));
    EXPECT_EQ(map.size(), 3000u);
    EXPECT_EQ(map.stats().buckets, 1024u);
  }
}

#if !GRACE_TESTING_SANITIZED  // the sanitizers' shadow memory does not fit an address limit
// A reserve() that runs out of memory part way throws and keeps the levels it did build, but
// not the reservation: the table shrinks back once it is found too large.
TEST(HashMap, AReserveThatRunsOutOfMemoryLeavesNoReservationBehind) {
  const int status = gt::run_in_child([] {
    u64_map map(resize_options(4, std::size_t{1} << 30));
    // Room for a few MiB of bucket levels, not for the 16 GiB that 2^30 buckets take.
    const rlimit limit{.rlim_cur = gt::current_address_space_bytes() + (std::size_t{64} << 20),
                       .rlim_max = RLIM_INFINITY};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) return gt::child_failure(1, "setrlimit", errno);
    try {
      map.reserve(std::size_t{1} << 30);
      return gt::child_failure(2, "reserve() of 2^30 buckets returned", map.stats().buckets);
    } catch (const std::bad_alloc&) {
    }
    const std::size_t grown = map.stats().buckets;
    if (grown <= 4) return gt::child_failure(3, "buckets grown before the failure", grown);
    for (std::uint64_t k = 0; k < 10'000 && map.stats().buckets == grown; ++k) {
      map.insert(k, k);
      map.erase(k);
    }
    if (map.stats().buckets >= grown) {
      return gt::child_failure(4, "buckets after 10,000 updates of an empty map", grown);
    }
    return 0;
  });
  EXPECT_TRUE(gt::exited_cleanly(status));
}
#endif

// reserve(n) exists so that n inserts do not resize; a table that shrinks back on the first
// insert after reserve() defeats it.
TEST(HashMap, InsertingTheReservedNumberOfElementsNeverResizes) {
  u64_map map(resize_options(4, 1 << 16));
  map.reserve(4096);
  const grace::hash_map_stats reserved = map.stats();
  ASSERT_EQ(reserved.buckets, 4096u);
  for (std::uint64_t k = 0; k < 4096; ++k) ASSERT_TRUE(map.insert(k, k));
  const grace::hash_map_stats filled = map.stats();
  EXPECT_EQ(filled.grows, reserved.grows);
  EXPECT_EQ(filled.shrinks, reserved.shrinks);
  EXPECT_EQ(filled.buckets, 4096u);
}

// A workload that swings between empty and the reserved size (the htab-mem batch cases) must
// not pay a grow and a shrink per swing.
TEST(HashMap, SwingingBetweenEmptyAndTheReservedSizeNeverResizes) {
  u64_map map(resize_options(1, 1 << 16));
  map.reserve(1024);
  const grace::hash_map_stats reserved = map.stats();
  ASSERT_EQ(reserved.buckets, 1024u);
  for (int swing = 0; swing < 20; ++swing) {
    for (std::uint64_t k = 0; k < 1024; ++k) ASSERT_TRUE(map.insert(k, k));
    for (std::uint64_t k = 0; k < 1024; ++k) ASSERT_TRUE(map.erase(k));
  }
  const grace::hash_map_stats swung = map.stats();
  EXPECT_EQ(swung.grows, reserved.grows);
  EXPECT_EQ(swung.shrinks, reserved.shrinks);
  EXPECT_EQ(swung.buckets, 1024u);
  // clear() forgets the reservation: the next erases shrink the table again.
  for (std::uint64_t k = 0; k < 1024; ++k) ASSERT_TRUE(map.insert(k, k));
  map.clear();
  EXPECT_EQ(map.stats().buckets, 1u);
}

// =============================================================================================
// The model: randomized operations against std::unordered_map.

// Each model type says how to make the i-th key and a value, and how update() changes one.
struct u64_model {
  static constexpr const char* kName = "U64Keys";
  using key_type = std::uint64_t;
  using value_type = std::uint64_t;
  using hasher = absl::Hash<std::uint64_t>;
  static constexpr std::size_t kKeys = 1024;
  static key_type key(std::size_t i) { return i; }
  static std::size_t index(const key_type& key) { return key; }
  static value_type value(std::size_t i, std::uint64_t salt) { return (i << 32) ^ salt; }
  static value_type bump(const value_type& v) { return v * 31 + 7; }
};

// hash = key % 7: seven chains of equal hashes, each ~40 long.
struct collision_model {
  static constexpr const char* kName = "KeysModSevenHash";
  using key_type = std::uint64_t;
  using value_type = checked_value;
  using hasher = mod7_hash;
  static constexpr std::size_t kKeys = 280;
  static key_type key(std::size_t i) { return i; }
  static std::size_t index(const key_type& key) { return key; }
  static value_type value(std::size_t i, std::uint64_t salt) {
    return checked_value::make(i, salt);
  }
  static value_type bump(const value_type& v) { return v.next(); }
};

// Heap-allocated keys and values.
struct string_model {
  static constexpr const char* kName = "StringKeysAndValues";
  using key_type = std::string;
  using value_type = std::string;
  using hasher = absl::Hash<std::string>;
  static constexpr std::size_t kKeys = 512;
  static key_type key(std::size_t i) {
    return "string key long enough for the heap, number " + std::to_string(i);
  }
  static std::size_t index(const key_type& key) {
    return std::stoul(key.substr(key.rfind(' ') + 1));
  }
  static value_type value(std::size_t i, std::uint64_t salt) {
    return "value of " + std::to_string(i) + " salted " + std::to_string(salt) +
           std::string(24, 'v');
  }
  static value_type bump(const value_type& v) { return v.substr(1) + v.front(); }
};

// Non-trivially destructible keys and values, every instance accounted for.
lifetime_registry* g_model_registry = nullptr;
struct lifetime_model {
  static constexpr const char* kName = "NonTrivialKeysAndValues";
  using key_type = lifetime_object;
  using value_type = lifetime_object;
  using hasher = absl::Hash<lifetime_object>;
  static constexpr std::size_t kKeys = 768;
  static key_type key(std::size_t i) { return lifetime_object(*g_model_registry, i); }
  static std::size_t index(const key_type& key) { return key.payload(); }
  static value_type value(std::size_t i, std::uint64_t salt) {
    return lifetime_object(*g_model_registry, (i << 32) ^ salt);
  }
  static value_type bump(const value_type& v) {
    return lifetime_object(*g_model_registry, v.payload() * 31 + 7);
  }
};

std::uint64_t random_seed() {
  if (const char* env = std::getenv("GRACE_MAP_SEED")) return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (std::uint64_t{device()} << 32) | device();
}

enum class model_op {
  find,
  contains,
  visit,
  pin_find,
  insert,
  try_emplace,
  insert_or_assign,
  assign,
  update,
  erase,
  erase_if,
  insert_moved_key,
  insert_or_update,
  extract,
  kCount
};

// Operation weights while the population grows (filling) and while it shrinks.
constexpr int kFillWeights[] = {6, 3, 3, 3, 12, 6, 10, 4, 6, 3, 2, 6, 4, 2};
constexpr int kDrainWeights[] = {6, 3, 3, 3, 2, 2, 3, 4, 6, 14, 10, 2, 2, 8};
static_assert(std::size(kFillWeights) == static_cast<std::size_t>(model_op::kCount));
static_assert(std::size(kDrainWeights) == static_cast<std::size_t>(model_op::kCount));

model_op pick(std::mt19937_64& rng, const int (&weights)[static_cast<int>(model_op::kCount)]) {
  int total = 0;
  for (int w : weights) total += w;
  int r = static_cast<int>(rng() % static_cast<std::uint64_t>(total));
  for (int i = 0;; ++i) {
    if (r < weights[i]) return static_cast<model_op>(i);
    r -= weights[i];
  }
}

// Runs `ops` random operations on a hash_map and on a std::unordered_map (keyed by the key's
// index) and checks every return value, every value seen, size() after every operation, the
// load factor after resizing operations, and the whole content with for_each() now and then.
template <class M>
void run_model(std::uint64_t seed, std::size_t ops) {
  using key_type = typename M::key_type;
  using value_type = typename M::value_type;
  using map_type = grace::hash_map<key_type, value_type, typename M::hasher>;
  constexpr std::size_t kMaxBuckets = 1 << 12;
  map_type map(resize_options(1, kMaxBuckets));
  std::unordered_map<std::size_t, value_type> model;
  std::mt19937_64 rng(seed);
  bool filling = true;
  std::size_t phase_end = 0;
  std::uint64_t salt = 0;

  auto check_content = [&](std::size_t op) {
    std::vector<int> seen(M::kKeys, 0);
    std::size_t visited = 0;
    map.for_each([&](const key_type& key, const value_type& value) {
      ++visited;
      const std::size_t i = M::index(key);
      if (i >= M::kKeys || !(M::key(i) == key)) {
        ADD_FAILURE() << "op " << op << ": for_each visited a key that was never inserted";
        return;
      }
      ++seen[i];
      const auto it = model.find(i);
      EXPECT_TRUE(it != model.end() && it->second == value)
          << "op " << op << ": for_each visited key " << i << " with a wrong value";
    });
    ASSERT_EQ(visited, model.size()) << "op " << op;
    for (std::size_t i = 0; i < M::kKeys; ++i) {
      ASSERT_EQ(seen[i], model.count(i) ? 1 : 0) << "op " << op << ": key " << i;
    }
  };

  std::size_t reserved = 0;  // mirrors the map's reservation (see reserve())
  // The table size a reservation keeps (the grow load factor is 1).
  const auto reserved_buckets = [&](std::size_t elements) {
    return std::clamp<std::size_t>(std::bit_ceil(elements), 1, kMaxBuckets);
  };
  for (std::size_t op = 0; op < ops; ++op) {
    if (op == phase_end) {
      filling = !filling;
      phase_end = op + 500 + rng() % 4000;
    }
    const std::size_t i = rng() % M::kKeys;
    const key_type key = M::key(i);
    const auto it = model.find(i);
    const bool present = it != model.end();
    const std::uint64_t buckets_before = map.stats().buckets;
    bool counted_change = false;  // the operation inserted or erased

    switch (pick(rng, filling ? kFillWeights : kDrainWeights)) {
      case model_op::find: {
        const std::optional<value_type> found = map.find(key);
        ASSERT_EQ(found.has_value(), present) << "op " << op << ": find(" << i << ")";
        if (present) {
          ASSERT_TRUE(*found == it->second) << "op " << op << ": find(" << i << ")";
        }
        break;
      }
      case model_op::contains:
        ASSERT_EQ(map.contains(key), present) << "op " << op << ": contains(" << i << ")";
        break;
      case model_op::visit: {
        int calls = 0;
        bool same = false;
        const bool visited = map.visit(key, [&](const value_type& v) {
          ++calls;
          same = present && v == it->second;
        });
        ASSERT_EQ(visited, present) << "op " << op << ": visit(" << i << ")";
        ASSERT_EQ(calls, present ? 1 : 0) << "op " << op << ": visit(" << i << ")";
        if (present) {
          ASSERT_TRUE(same) << "op " << op << ": visit(" << i << ")";
        }
        break;
      }
      case model_op::pin_find: {
        auto view = map.pin();
        const value_type* p = view.find(key);
        ASSERT_EQ(p != nullptr, present) << "op " << op << ": pin().find(" << i << ")";
        if (present) {
          ASSERT_TRUE(*p == it->second) << "op " << op << ": pin().find(" << i << ")";
        }
        ASSERT_EQ(view.contains(key), present) << "op " << op;
        break;
      }
      case model_op::insert: {
        value_type v = M::value(i, ++salt);
        ASSERT_EQ(map.insert(key, v), !present) << "op " << op << ": insert(" << i << ")";
        if (!present) model.emplace(i, std::move(v));
        counted_change = !present;
        break;
      }
      case model_op::try_emplace: {
        const value_type v = M::value(i, ++salt);
        ASSERT_EQ(map.try_emplace(key, v), !present) << "op " << op << ": try_emplace(" << i << ")";
        if (!present) model.emplace(i, v);
        counted_change = !present;
        break;
      }
      case model_op::insert_or_assign: {
        const value_type v = M::value(i, ++salt);
        ASSERT_EQ(map.insert_or_assign(key, v), !present)
            << "op " << op << ": insert_or_assign(" << i << ")";
        model.insert_or_assign(i, v);
        counted_change = !present;
        break;
      }
      case model_op::assign: {
        const value_type v = M::value(i, ++salt);
        ASSERT_EQ(map.assign(key, v), present) << "op " << op << ": assign(" << i << ")";
        if (present) it->second = v;
        break;
      }
      case model_op::update: {
        int calls = 0;
        bool saw_current = false;
        const bool updated = map.update(key, [&](const value_type& old) {
          ++calls;
          saw_current = present && old == it->second;
          return M::bump(old);
        });
        ASSERT_EQ(updated, present) << "op " << op << ": update(" << i << ")";
        ASSERT_EQ(calls, present ? 1 : 0) << "op " << op << ": update(" << i << ")";
        if (present) {
          ASSERT_TRUE(saw_current) << "op " << op << ": update(" << i << ") saw a stale value";
          it->second = M::bump(it->second);
        }
        break;
      }
      case model_op::erase:
        ASSERT_EQ(map.erase(key), present) << "op " << op << ": erase(" << i << ")";
        if (present) model.erase(it);
        counted_change = present;
        break;
      case model_op::erase_if: {
        const bool want = (rng() & 1) != 0;
        int calls = 0;
        bool saw_current = false;
        const bool erased = map.erase_if(key, [&](const value_type& v) {
          ++calls;
          saw_current = present && v == it->second;
          return want;
        });
        ASSERT_EQ(erased, present && want) << "op " << op << ": erase_if(" << i << ")";
        ASSERT_EQ(calls, present ? 1 : 0) << "op " << op << ": erase_if(" << i << ")";
        if (present) {
          ASSERT_TRUE(saw_current) << "op " << op << ": erase_if(" << i << ")";
        }
        if (present && want) model.erase(it);
        counted_change = present && want;
        break;
      }
      case model_op::insert_moved_key: {
        key_type moved = key;
        value_type v = M::value(i, ++salt);
        ASSERT_EQ(map.insert(std::move(moved), v), !present)
            << "op " << op << ": insert(std::move(" << i << "))";
        if (present) {
          ASSERT_TRUE(moved == key) << "op " << op << ": a key not inserted was not given back";
        } else {
          model.emplace(i, std::move(v));
        }
        counted_change = !present;
        break;
      }
      case model_op::insert_or_update: {
        const value_type v = M::value(i, ++salt);
        int calls = 0;
        const bool inserted = map.insert_or_update(key, v, [&](const value_type& old) {
          ++calls;
          return M::bump(old);
        });
        ASSERT_EQ(inserted, !present) << "op " << op << ": insert_or_update(" << i << ")";
        ASSERT_EQ(calls, present ? 1 : 0) << "op " << op << ": insert_or_update(" << i << ")";
        if (present) {
          it->second = M::bump(it->second);
        } else {
          model.emplace(i, v);
        }
        counted_change = !present;
        break;
      }
      case model_op::extract: {
        const std::optional<value_type> taken = map.extract(key);
        ASSERT_EQ(taken.has_value(), present) << "op " << op << ": extract(" << i << ")";
        if (present) {
          ASSERT_TRUE(*taken == it->second) << "op " << op << ": extract(" << i << ")";
          model.erase(it);
        }
        counted_change = present;
        break;
      }
      case model_op::kCount:
        break;
    }
    ASSERT_EQ(map.size(), model.size()) << "op " << op;

    // Single-threaded, the load factor is in bounds after every counted change on a table
    // of at most 256 buckets (larger tables check a hash-chosen sample of updates).
    const grace::hash_map_stats s = map.stats();
    ASSERT_GE(s.buckets, 1u);
    ASSERT_LE(s.buckets, kMaxBuckets);
    // A reservation keeps the table from shrinking below its size until clear().
    if (counted_change && buckets_before <= 256) {
      ASSERT_LE(static_cast<double>(s.size), static_cast<double>(s.buckets))
          << "op " << op << ": the table did not grow";
      ASSERT_TRUE(s.buckets <= reserved_buckets(reserved) ||
                  static_cast<double>(s.size) >= 0.125 * s.buckets)
          << "op " << op << ": the table did not shrink (size " << s.size << ", buckets "
          << s.buckets << ")";
    }

    // The rare whole-map operations.
    const std::uint64_t rare = rng() % 65536;
    if (rare < 16) {
      const std::size_t wanted = rng() % (2 * M::kKeys);
      map.reserve(wanted);
      reserved = std::max(reserved, wanted);
    } else if (rare == 16) {
      map.clear();
      model.clear();
      reserved = 0;
      ASSERT_TRUE(map.empty()) << "op " << op << ": clear()";
    } else if (rare == 17) {
      const std::size_t modulus = 2 + rng() % 5;
      const std::size_t erased = map.erase_if([&](const key_type& k, const value_type&) {
        return M::index(k) % modulus == 0;
      });
      const std::size_t expected =
          std::erase_if(model, [&](const auto& entry) { return entry.first % modulus == 0; });
      ASSERT_EQ(erased, expected) << "op " << op << ": erase_if(pred)";
    }
    if (op % 20000 == 19999) {
      check_content(op);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  check_content(ops);
  if (::testing::Test::HasFatalFailure()) return;
  // Whether the random walk ever fell below the shrink threshold depends on the seed, and a
  // reservation may hold the table up, so the run ends by erasing everything: the table
  // shrinks back to what the reservation keeps, and clear() drops that too.
  for (std::size_t i = 0; i < M::kKeys; ++i) {
    ASSERT_EQ(map.erase(M::key(i)), model.erase(i) == 1) << "final drain: erase(" << i << ")";
    ASSERT_EQ(map.size(), model.size()) << "final drain: erase(" << i << ")";
  }
  const std::uint64_t drained_buckets = map.stats().buckets;
  EXPECT_LE(drained_buckets, std::max<std::size_t>(8, reserved_buckets(reserved)))
      << "the drained table kept " << drained_buckets << " buckets";
  map.clear();
  const grace::hash_map_stats s = map.stats();
  EXPECT_EQ(s.buckets, 1u) << "clear() of an empty map kept the reserved size";
  EXPECT_GT(s.grows, 0u) << "the run never grew the table";
  EXPECT_GT(s.shrinks, 0u) << "the run never shrank the table";
}

template <class M>
class HashMapModel : public ::testing::Test {
 protected:
  // The model's operation budget per seed; a few million operations over the whole suite.
  static std::size_t budget() { return gt::iterations(800'000); }

  void run(std::uint64_t seed) {
    SCOPED_TRACE(::testing::Message()
                 << "seed " << seed << " (replay with GRACE_MAP_SEED=" << seed << ")");
    std::unique_ptr<lifetime_registry> registry;
    if constexpr (std::is_same_v<M, lifetime_model>) {
      registry = std::make_unique<lifetime_registry>(std::size_t{16} << 20);
      g_model_registry = registry.get();
    }
    run_model<M>(seed, budget());
    if constexpr (std::is_same_v<M, lifetime_model>) {
      // The map and the model are gone (run_model's scope): every instance ever made is
      // destroyed exactly once.
      EXPECT_TRUE(registry->each_destroyed_once());
      g_model_registry = nullptr;
    }
  }
};

struct model_names {
  template <class M>
  static std::string GetName(int) {
    return M::kName;
  }
};

using model_types = ::testing::Types<u64_model, collision_model, string_model, lifetime_model>;
TYPED_TEST_SUITE(HashMapModel, model_types, model_names);

TYPED_TEST(HashMapModel, MatchesStdUnorderedMapWithFixedSeeds) {
  for (std::uint64_t seed : {0x5eed0001ULL, 0xdecafbadULL}) {
    this->run(seed);
    if (this->HasFailure()) return;
  }
}

TYPED_TEST(HashMapModel, MatchesStdUnorderedMapWithARandomSeed) {
  const std::uint64_t seed = random_seed();
  this->RecordProperty("seed", std::to_string(seed));
  this->run(seed);
}

// =============================================================================================
// Lifetime accounting.

// Erased, replaced and cleared elements destroyed exactly once, in both
// element_destruction modes: hash_map_destruction_test.cc.

TEST(HashMap, ALosingTryEmplaceOrInsertBuildsNothingThatOutlivesIt) {
  lifetime_registry registry(1 << 12);
  {
    lifetime_map map;
    ASSERT_TRUE(map.insert(lifetime_object(registry, 1), lifetime_object(registry, 10)));
    const std::int64_t live = registry.live();
    EXPECT_FALSE(map.try_emplace(lifetime_object(registry, 1), registry, 11));
    EXPECT_FALSE(map.insert(lifetime_object(registry, 1), lifetime_object(registry, 12)));
    EXPECT_FALSE(map.assign(lifetime_object(registry, 2), lifetime_object(registry, 13)));
    EXPECT_FALSE(map.update(lifetime_object(registry, 2),
                            [&](const lifetime_object&) { return lifetime_object(registry, 0); }));
    EXPECT_EQ(registry.live(), live);
  }
  EXPECT_TRUE(registry.each_destroyed_once());
}

// =============================================================================================
// Allocation failure and exceptions from user types.

// A map whose pool takes its memory from `allocator`, with small caches so that the pool
// soon needs fresh memory.
template <class Map>
std::unique_ptr<Map> map_on(gt::failing_allocator& allocator) {
  grace::hash_map_options options;
  options.pool.allocator = allocator.get();
  options.pool.low_watermark = 1;
  options.pool.high_watermark = 2;
  options.pool.batch = 1;
  return std::make_unique<Map>(options);
}

TEST(HashMap, InsertIntoAMapWithoutMemoryThrowsBadAllocAndChangesNothing) {
  gt::failing_allocator allocator;
  {
    auto map = map_on<u64_map>(allocator);
    allocator.fail_all(true);
    EXPECT_THROW(map->insert(1, 10), std::bad_alloc);
    EXPECT_THROW(map->insert_or_assign(1, 10), std::bad_alloc);
    EXPECT_THROW(map->try_emplace(1, 10), std::bad_alloc);
    EXPECT_FALSE(grace::in_read_section());
    EXPECT_TRUE(map->empty());
    EXPECT_FALSE(map->contains(1));
    allocator.fail_all(false);
    EXPECT_TRUE(map->insert(1, 10));
    EXPECT_EQ(map->find(1), 10u);
  }
  EXPECT_EQ(allocator.live_allocations(), 0);
  EXPECT_EQ(allocator.live_bytes(), 0);
}

// Inserts fresh keys while every system allocation fails, until the pool's cached objects
// run out and an insert throws; checks that insert and the map after it. Returns the key
// whose insert threw.
template <class Map, class MakeValue>
std::uint64_t insert_until_bad_alloc(
    Map& map, std::unordered_map<std::uint64_t, typename Map::mapped_type>& model,
    std::uint64_t first_key, MakeValue make_value) {
  for (std::uint64_t key = first_key; key < first_key + 100'000; ++key) {
    try {
      EXPECT_TRUE(map.insert(key, make_value(key)));
      model.emplace(key, make_value(key));
    } catch (const std::bad_alloc&) {
      EXPECT_FALSE(grace::in_read_section());
      EXPECT_FALSE(map.contains(key));
      EXPECT_TRUE(holds_exactly(map, model));
      return key;
    }
  }
  ADD_FAILURE() << "no insert failed in 100000 tries while every allocation failed";
  return 0;
}

TEST(HashMap, InsertThatNeedsFreshPoolMemoryThrowsBadAllocAndLeavesTheMapUnchanged) {
  gt::failing_allocator allocator;
  {
    auto map = map_on<u64_map>(allocator);
    std::unordered_map<std::uint64_t, std::uint64_t> model;
    for (std::uint64_t k = 0; k < 100; ++k) {
      ASSERT_TRUE(map->insert(k, k * 10));
      model.emplace(k, k * 10);
    }
    allocator.fail_all(true);
    const std::uint64_t failed =
        insert_until_bad_alloc(*map, model, 1000, [](std::uint64_t k) { return k * 10; });
    ASSERT_FALSE(::testing::Test::HasFailure());
    EXPECT_GT(allocator.failures(), 0u);
    // Without memory an insert of a present key still just says "present".
    EXPECT_FALSE(map->insert(5, 0));
    EXPECT_EQ(map->find(5), 50u);
    // Erasing needs no memory.
    EXPECT_TRUE(map->erase(5));
    model.erase(5);
    EXPECT_TRUE(holds_exactly(*map, model));
    allocator.fail_all(false);
    EXPECT_TRUE(map->insert(failed, 1));
    model.emplace(failed, 1);
    EXPECT_TRUE(holds_exactly(*map, model));
  }
  EXPECT_EQ(allocator.live_allocations(), 0);
}

TEST(HashMap, ReplacingUpdatesThatCannotAllocateThrowBadAllocAndKeepTheOldValue) {
  gt::failing_allocator allocator;
  lifetime_registry registry(1 << 20);
  {
    using map_type = grace::hash_map<std::uint64_t, lifetime_object>;
    auto map = map_on<map_type>(allocator);
    std::unordered_map<std::uint64_t, lifetime_object> model;
    for (std::uint64_t k = 0; k < 100; ++k) {
      ASSERT_TRUE(map->insert(k, lifetime_object(registry, k)));
      model.emplace(k, lifetime_object(registry, k));
    }
    allocator.fail_all(true);
    insert_until_bad_alloc(*map, model, 1000,
                           [&](std::uint64_t k) { return lifetime_object(registry, k); });
    ASSERT_FALSE(::testing::Test::HasFailure());
    // Each replacing update either succeeds (the pool still had a recycled object) or throws
    // and leaves the old value; keep trying until each has thrown once.
    for (int which = 0; which < 3; ++which) {
      bool threw = false;
      for (int attempt = 0; attempt < 100'000 && !threw; ++attempt) {
        const std::uint64_t key = static_cast<std::uint64_t>(attempt % 100);
        const std::uint64_t fresh = 1'000'000 + static_cast<std::uint64_t>(attempt);
        try {
          if (which == 0) {
            EXPECT_FALSE(map->insert_or_assign(key, lifetime_object(registry, fresh)));
          } else if (which == 1) {
            EXPECT_TRUE(map->assign(key, lifetime_object(registry, fresh)));
          } else {
            EXPECT_TRUE(map->update(
                key, [&](const lifetime_object&) { return lifetime_object(registry, fresh); }));
          }
          model.insert_or_assign(key, lifetime_object(registry, fresh));
        } catch (const std::bad_alloc&) {
          threw = true;
          EXPECT_FALSE(grace::in_read_section());
          EXPECT_TRUE(holds_exactly(*map, model)) << "operation " << which;
        }
      }
      EXPECT_TRUE(threw) << "operation " << which << " never failed";
    }
    allocator.fail_all(false);
    map->clear();
    model.clear();
    EXPECT_EQ(registry.live(), 0);
  }
  EXPECT_TRUE(registry.each_destroyed_once());
  EXPECT_EQ(allocator.live_allocations(), 0);
}

// Countdowns for the throwing user types: the n-th call from arming throws, once.
// Single-threaded tests only.
struct countdown {
  long remaining = 0;
  void arm(long n) { remaining = n; }
  void disarm() { remaining = 0; }
  bool fire() { return remaining > 0 && --remaining == 0; }
};
countdown g_hash_countdown;
countdown g_equal_countdown;
countdown g_copy_countdown;

struct hash_error : std::runtime_error {
  hash_error() : std::runtime_error("hash") {}
};
struct equal_error : std::runtime_error {
  equal_error() : std::runtime_error("equal") {}
};
struct copy_error : std::runtime_error {
  copy_error() : std::runtime_error("copy") {}
};

// Three hashes only, so KeyEqual runs on every lookup.
struct throwing_hash {
  std::size_t operator()(const lifetime_object& key) const {
    if (g_hash_countdown.fire()) throw hash_error();
    return key.payload() % 3;
  }
};
struct throwing_equal {
  bool operator()(const lifetime_object& a, const lifetime_object& b) const {
    if (g_equal_countdown.fire()) throw equal_error();
    return a == b;
  }
};
// A value whose copies (there is no move constructor) throw when the countdown fires.
class fragile_value {
 public:
  fragile_value(lifetime_registry& registry, std::uint64_t payload) : inner_(registry, payload) {}
  fragile_value(const fragile_value& other) : inner_(copy_checked(other.inner_)) {}
  fragile_value& operator=(const fragile_value&) = default;
  std::uint64_t payload() const { return inner_.payload(); }
  friend bool operator==(const fragile_value& a, const fragile_value& b) {
    return a.inner_ == b.inner_;
  }

 private:
  static const lifetime_object& copy_checked(const lifetime_object& from) {
    if (g_copy_countdown.fire()) throw copy_error();
    return from;
  }
  lifetime_object inner_;
};

using fragile_map = grace::hash_map<lifetime_object, fragile_value, throwing_hash, throwing_equal>;

// Runs every operation of the map with the countdown `c` armed at 1, 2, ..., until the
// operation completes without throwing; after every exception the map must be unchanged,
// outside any read section, and usable. At the end every instance is accounted for.
template <class Exception>
void check_throwing(countdown& c) {
  lifetime_registry registry(1 << 20);
  {
    fragile_map map(resize_options(1, 64));
    std::unordered_map<std::uint64_t, std::uint64_t> model;  // key payload -> value payload
    auto key = [&](std::uint64_t k) { return lifetime_object(registry, k); };
    auto check = [&](const char* what, long n) {
      EXPECT_FALSE(grace::in_read_section()) << what << ", countdown " << n;
      EXPECT_EQ(map.size(), model.size()) << what << ", countdown " << n;
      // Once reclamation caught up, the only instances alive are the elements' keys and
      // values: whatever the operation built and threw away is gone.
      map.reclamation_domain().barrier();
      EXPECT_EQ(registry.live(), 2 * static_cast<std::int64_t>(model.size()))
          << what << ", countdown " << n << ": instances leaked";
      std::size_t visited = 0;
      map.for_each([&](const lifetime_object& k, const fragile_value& v) {
        ++visited;
        const auto it = model.find(k.payload());
        EXPECT_TRUE(it != model.end() && it->second == v.payload())
            << what << ", countdown " << n << ": key " << k.payload();
      });
      EXPECT_EQ(visited, model.size()) << what << ", countdown " << n;
    };
    for (std::uint64_t k = 0; k < 12; ++k) {
      ASSERT_TRUE(map.insert(key(k), fragile_value(registry, k)));
      model[k] = k;
    }
    std::uint64_t next = 100;
    // Each entry: a name, and the operation (which applies itself to the model on success).
    const std::vector<std::pair<const char*, std::function<void()>>> operations = {
        {"insert",
         [&] {
           if (map.insert(key(next), fragile_value(registry, next))) model[next] = next;
           ++next;
         }},
        {"try_emplace",
         [&] {
           if (map.try_emplace(key(next), registry, next)) model[next] = next;
           ++next;
         }},
        {"insert_or_assign (new)",
         [&] {
           map.insert_or_assign(key(next), fragile_value(registry, next));
           model[next] = next;
           ++next;
         }},
        {"insert_or_assign (present)",
         [&] {
           map.insert_or_assign(key(4), fragile_value(registry, next));
           model[4] = next;
           ++next;
         }},
        {"assign",
         [&] {
           if (map.assign(key(5), fragile_value(registry, next))) model[5] = next;
           ++next;
         }},
        {"update",
         [&] {
           if (map.update(key(6),
                          [&](const fragile_value&) { return fragile_value(registry, next); }))
             model[6] = next;
           ++next;
         }},
        {"find",
         [&] {
           const auto v = map.find(key(7));
           EXPECT_TRUE(v.has_value());
         }},
        {"contains", [&] { EXPECT_TRUE(map.contains(key(8))); }},
        {"visit", [&] { EXPECT_TRUE(map.visit(key(8), [](const fragile_value&) {})); }},
        {"pin().find",
         [&] {
           auto view = map.pin();
           EXPECT_NE(view.find(key(8)), nullptr);
         }},
        {"erase",
         [&] {
           if (map.erase(key(9))) model.erase(9);
         }},
        {"erase_if",
         [&] {
           if (map.erase_if(key(10), [](const fragile_value&) { return true; })) model.erase(10);
         }},
        {"clear",
         [&] {
           map.clear();
           model.clear();
         }},
    };
    for (const auto& [what, operation] : operations) {
      for (long n = 1; n < 100; ++n) {
        c.arm(n);
        try {
          operation();
          c.disarm();
          break;  // completed before the countdown fired
        } catch (const Exception&) {
          c.disarm();
          if (std::string_view(what) == "clear") {
            // A clear() that throws may have erased some elements: what is left must be a
            // subset of what was there, and size() must count exactly that.
            std::unordered_map<std::uint64_t, std::uint64_t> left;
            map.for_each([&](const lifetime_object& k, const fragile_value& v) {
              EXPECT_TRUE(model.count(k.payload()) == 1 && model[k.payload()] == v.payload());
              left[k.payload()] = v.payload();
            });
            model = std::move(left);
          }
          check(what, n);
        }
        if (::testing::Test::HasFailure()) break;
      }
      c.disarm();
      check(what, 0);
      if (::testing::Test::HasFailure()) break;
      // Put back what erase/clear took, for the next operations.
      for (std::uint64_t k = 0; k < 12; ++k) {
        if (map.insert(key(k), fragile_value(registry, k))) model[k] = k;
      }
    }
    map.clear();
    model.clear();
    // Every instance the operations made, used or thrown away, is gone.
    EXPECT_EQ(registry.live(), 0) << "instances leaked by an operation that threw";
  }
  EXPECT_TRUE(registry.each_destroyed_once());
}

TEST(HashMap, AThrowingHashReachesTheCallerAndLeavesTheMapConsistent) {
  check_throwing<hash_error>(g_hash_countdown);
}

TEST(HashMap, AThrowingKeyEqualReachesTheCallerAndLeavesTheMapConsistent) {
  check_throwing<equal_error>(g_equal_countdown);
}

TEST(HashMap, AThrowingValueCopyReachesTheCallerAndLeavesTheMapConsistent) {
  check_throwing<copy_error>(g_copy_countdown);
}

// Every key in one bucket, and a KeyEqual whose n-th call throws.
struct one_bucket_hash {
  std::size_t operator()(const std::string&) const { return 7; }
};
struct countdown_string_equal {
  bool operator()(const std::string& a, const std::string& b) const {
    if (g_equal_countdown.fire()) throw equal_error();
    return a == b;
  }
};

// try_emplace compares the key with the one present first (before the key moves into the
// element), then again while linking the element (after): whichever call throws, the caller
// keeps its key.
TEST(HashMap, AnRvalueKeyIsGivenBackWhenKeyEqualThrowsWhileTheElementIsLinked) {
  grace::hash_map<std::string, int, one_bucket_hash, countdown_string_equal> map;
  const std::string present(100, 'a');
  const std::string absent(100, 'b');
  ASSERT_TRUE(map.insert(present, 1));
  for (long call = 1; call <= 3; ++call) {
    std::string key = absent;
    g_equal_countdown.arm(call);
    bool inserted = false;
    try {
      inserted = map.try_emplace(std::move(key), 2);
    } catch (const equal_error&) {
      EXPECT_EQ(key, absent) << "KeyEqual threw at call " << call;
    }
    g_equal_countdown.disarm();
    if (inserted) {
      ASSERT_TRUE(map.erase(absent));
    } else {
      EXPECT_FALSE(map.contains(absent));
    }
    EXPECT_EQ(map.size(), 1u);
  }
}

TEST(HashMap, AnExceptionFromAUserFunctionEndsTheReadSection) {
  u64_map map;
  ASSERT_TRUE(map.insert(1, 10));
  EXPECT_THROW(map.visit(1, [](const std::uint64_t&) { throw std::runtime_error("visit"); }),
               std::runtime_error);
  EXPECT_FALSE(grace::in_read_section());
  EXPECT_THROW(
      map.update(1,
                 [](const std::uint64_t&) -> std::uint64_t { throw std::runtime_error("update"); }),
      std::runtime_error);
  EXPECT_FALSE(grace::in_read_section());
  EXPECT_THROW(
      map.erase_if(1, [](const std::uint64_t&) -> bool { throw std::runtime_error("erase_if"); }),
      std::runtime_error);
  EXPECT_FALSE(grace::in_read_section());
  EXPECT_THROW(map.for_each([](const std::uint64_t&, const std::uint64_t&) {
    throw std::runtime_error("for_each");
  }),
               std::runtime_error);
  EXPECT_FALSE(grace::in_read_section());
  EXPECT_EQ(map.find(1), 10u);
  EXPECT_EQ(map.size(), 1u);
  gt::watchdog dog(kNoDeadlock, "synchronize() after exceptions from user functions");
  map.reclamation_domain().synchronize();
}

// =============================================================================================
// Concurrency: races on one key.

constexpr unsigned kRacers = 4;

// Runs `rounds` rounds; in each, every one of kRacers threads calls race(thread, round) at
// about the same instant (a std::barrier per round), then check(round) runs on one thread
// while the others wait.
template <class Race, class Check>
void race_rounds(std::size_t rounds, Race race, Check check) {
  std::barrier sync(kRacers);
  gt::run_threads(kRacers, [&](unsigned thread) {
    for (std::size_t round = 0; round < rounds; ++round) {
      race(thread, round);
      sync.arrive_and_wait();
      if (thread == 0) check(round);
      sync.arrive_and_wait();
    }
  });
}

TEST(HashMap, RacingInsertsOfOneKeyHaveExactlyOneWinner) {
  u64_map map(resize_options(1, 1 << 16));
  std::atomic<unsigned> winners{0};
  std::atomic<unsigned> winner{0};
  const std::size_t rounds = gt::iterations(4000);
  race_rounds(
      rounds,
      [&](unsigned thread, std::size_t round) {
        if (map.insert(round, thread)) {
          // Relaxed (both): read by the checker after the round's barrier, which orders them.
          winners.fetch_add(1, std::memory_order_relaxed);
          winner.store(thread, std::memory_order_relaxed);
        }
      },
      [&](std::size_t round) {
        // Relaxed (all): ordered by the round's barrier.
        ASSERT_EQ(winners.exchange(0, std::memory_order_relaxed), 1u) << "round " << round;
        EXPECT_EQ(map.find(round), winner.load(std::memory_order_relaxed)) << "round " << round;
      });
  EXPECT_EQ(map.size(), rounds);
}

TEST(HashMap, RacingTryEmplacesHaveOneWinnerAndDestroyEveryLosersValue) {
  lifetime_registry registry(std::size_t{1} << 22);
  {
    grace::hash_map<std::uint64_t, lifetime_object> map(resize_options(1, 1 << 16));
    std::atomic<unsigned> winners{0};
    const std::size_t rounds = gt::iterations(4000);
    race_rounds(
        rounds,
        [&](unsigned thread, std::size_t round) {
          if (map.try_emplace(round, registry, round * kRacers + thread)) {
            // Relaxed: read after the round's barrier.
            winners.fetch_add(1, std::memory_order_relaxed);
          }
        },
        [&](std::size_t round) {
          // Relaxed: ordered by the round's barrier.
          ASSERT_EQ(winners.exchange(0, std::memory_order_relaxed), 1u) << "round " << round;
        });
    map.reclamation_domain().barrier();
    // One value per key is left; every loser's value (if it built one) is gone.
    EXPECT_EQ(registry.live(), static_cast<std::int64_t>(rounds));
  }
  EXPECT_TRUE(registry.each_destroyed_once());
}

TEST(HashMap, RacingErasesOfOneKeyHaveExactlyOneWinner) {
  u64_map map(resize_options(1, 1 << 16));
  std::atomic<unsigned> winners{0};
  const std::size_t rounds = gt::iterations(4000);
  for (std::size_t k = 0; k < rounds; ++k) ASSERT_TRUE(map.insert(k, k));
  race_rounds(
      rounds,
      [&](unsigned, std::size_t round) {
        // Relaxed: read after the round's barrier.
        if (map.erase(round)) winners.fetch_add(1, std::memory_order_relaxed);
      },
      [&](std::size_t round) {
        // Relaxed: ordered by the round's barrier.
        ASSERT_EQ(winners.exchange(0, std::memory_order_relaxed), 1u) << "round " << round;
        EXPECT_FALSE(map.contains(round));
      });
  EXPECT_TRUE(map.empty());
}

TEST(HashMap, RacingInsertOrAssignsInsertOnceAndKeepOneOfTheWrittenValues) {
  u64_map map(resize_options(1, 1 << 16));
  std::atomic<unsigned> inserted{0};
  const std::size_t rounds = gt::iterations(4000);
  race_rounds(
      rounds,
      [&](unsigned thread, std::size_t round) {
        for (unsigned i = 0; i < 3; ++i) {
          // Relaxed: read after the round's barrier.
          if (map.insert_or_assign(round, thread * 10 + i)) {
            inserted.fetch_add(1, std::memory_order_relaxed);
          }
        }
      },
      [&](std::size_t round) {
        // Relaxed: ordered by the round's barrier.
        ASSERT_EQ(inserted.exchange(0, std::memory_order_relaxed), 1u) << "round " << round;
        const std::optional<std::uint64_t> v = map.find(round);
        ASSERT_TRUE(v.has_value());
        // The last write of some thread.
        EXPECT_EQ(*v % 10, 2u) << "round " << round;
        EXPECT_LT(*v / 10, kRacers) << "round " << round;
        std::size_t visits = 0;
        map.for_each([&](const std::uint64_t& key, const std::uint64_t&) {
          if (key == round) ++visits;
        });
        EXPECT_EQ(visits, 1u) << "round " << round;
      });
  EXPECT_EQ(map.size(), rounds);
}

TEST(HashMap, UpdateAppliesEveryIncrementExactlyOnce) {
  u64_map map;
  ASSERT_TRUE(map.insert(7, 0));
  const std::size_t per_thread = gt::iterations(40'000);
  std::atomic<std::uint64_t> calls{0};
  gt::run_threads(kRacers, [&](unsigned) {
    for (std::size_t i = 0; i < per_thread; ++i) {
      ASSERT_TRUE(map.update(7, [&](const std::uint64_t& old) {
        calls.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally read after join.
        return old + 1;
      }));
    }
  });
  EXPECT_EQ(map.find(7), kRacers * per_thread);
  EXPECT_GE(calls.load(std::memory_order_relaxed), kRacers * per_thread);  // Relaxed: joined.
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMap, RacingInsertsAndErasesOfOneKeyKeepTheCountExact) {
  u64_map map;
  std::atomic<std::int64_t> net{0};
  const std::size_t per_thread = gt::iterations(40'000);
  gt::run_threads(kRacers, [&](unsigned thread) {
    for (std::size_t i = 0; i < per_thread; ++i) {
      bool changed = false;
      std::int64_t delta = 0;
      switch ((i + thread) % 4) {
        case 0:
          changed = map.insert(1, i);
          delta = 1;
          break;
        case 1:
          changed = map.insert_or_assign(1, i);
          delta = 1;
          break;
        case 2:
          changed = map.erase(1);
          delta = -1;
          break;
        case 3:
          changed = map.erase_if(1, [](const std::uint64_t& v) { return v % 2 == 0; });
          delta = -1;
          break;
      }
      // Relaxed: a tally read after join.
      if (changed) net.fetch_add(delta, std::memory_order_relaxed);
    }
  });
  const std::int64_t present = map.contains(1) ? 1 : 0;
  EXPECT_EQ(net.load(std::memory_order_relaxed), present);  // Relaxed: joined.
  EXPECT_EQ(map.size(), static_cast<std::size_t>(present));
}

// A reader's pinned view keeps its pointers valid and their values unchanged while another
// thread erases and replaces those keys, then waits for a grace period (which must not end
// while the view lives) and reclamation, then churns the pool with fresh elements that would
// reuse any element released early.
template <class Value, class Make, class Intact>
void check_pinned_view_survives_writers(Make make, Intact intact) {
  constexpr std::uint64_t kKeys = 256;
  grace::hash_map_options options = resize_options(1024, 1024);  // no resizes
  // The reader waits inside its view for the writer's updates: the writer must not wait for
  // a grace period meanwhile. By default a deallocating thread answers an overdue
  // grace-period request itself (pool_options::caller_gp_threshold), which under TSan's
  // slowness it did here, and both waited until the reader's 30 s ran out.
  options.pool.caller_gp_threshold = 0;
  grace::hash_map<std::uint64_t, Value> map(options);
  for (std::uint64_t k = 0; k < kKeys; ++k) ASSERT_TRUE(map.insert(k, make(k, 0)));
  std::atomic<int> stage{0};
  gt::watchdog dog(kNoDeadlock, "pinned view against erasing and replacing writers");
  std::thread reader([&] {
    auto view = map.pin();
    std::vector<const Value*> held(kKeys);
    for (std::uint64_t k = 0; k < kKeys; ++k) held[k] = view.find(k);
    // Release: the writer starts only once every pointer was taken; pairs with its Acquire.
    stage.store(1, std::memory_order_release);
    // Acquire: the writer's erases and replacements happened before; pairs with its Release.
    EXPECT_TRUE(gt::eventually([&] { return stage.load(std::memory_order_acquire) >= 2; }, 30s));
    // The writer is in synchronize() now. Give it time to (wrongly) return, reclaim and reuse.
    // Acquire: pairs with the writer's last Release.
    const bool grace_period_ended =
        gt::eventually([&] { return stage.load(std::memory_order_acquire) == 3; }, 100ms);
    EXPECT_FALSE(grace_period_ended) << "a grace period ended while a pinned view lived";
    for (std::uint64_t k = 0; k < kKeys; ++k) {
      ASSERT_NE(held[k], nullptr) << k;
      EXPECT_TRUE(intact(*held[k], k, 0)) << "key " << k << " changed under a pinned view";
    }
    for (std::uint64_t k = 0; k < kKeys; ++k) {
      const Value* now = view.find(k);
      if (k % 2 == 0) {
        EXPECT_EQ(now, nullptr) << k;
      } else {
        ASSERT_NE(now, nullptr) << k;
        EXPECT_TRUE(intact(*now, k, 1)) << k;
      }
    }
  });
  std::thread writer([&] {
    // Acquire: pairs with the reader's first Release.
    ASSERT_TRUE(gt::eventually([&] { return stage.load(std::memory_order_acquire) == 1; }, 30s));
    for (std::uint64_t k = 0; k < kKeys; ++k) {
      if (k % 2 == 0) {
        EXPECT_TRUE(map.erase(k));
      } else {
        EXPECT_FALSE(map.insert_or_assign(k, make(k, 1)));
      }
    }
    // Release: publishes the writes above to the reader; pairs with its Acquire.
    stage.store(2, std::memory_order_release);
    map.reclamation_domain().synchronize();  // returns once the reader's view has ended
    map.reclamation_domain().barrier();
    // Fresh elements: they reuse the erased and replaced elements' memory.
    for (std::uint64_t round = 0; round < 4; ++round) {
      for (std::uint64_t k = 1000; k < 1200; ++k) EXPECT_TRUE(map.insert(k, make(k, 5)));
      for (std::uint64_t k = 1000; k < 1200; ++k) EXPECT_TRUE(map.erase(k));
    }
    // Release: pairs with the reader's Acquire (it must not see this while pinned).
    stage.store(3, std::memory_order_release);
  });
  writer.join();
  reader.join();
}

TEST(HashMap, PinnedViewPointersStayValidWhileOtherThreadsEraseAndReplace) {
  check_pinned_view_survives_writers<checked_value>(
      [](std::uint64_t k, std::uint64_t version) { return checked_value::make(k, version); },
      [](const checked_value& v, std::uint64_t k, std::uint64_t version) {
        return v.valid_for(k) && v.version == version;
      });
}

TEST(HashMap, PinnedViewKeepsNonTrivialValuesAliveWhileOtherThreadsEraseAndReplace) {
  lifetime_registry registry(1 << 16);
  check_pinned_view_survives_writers<lifetime_object>(
      [&](std::uint64_t k, std::uint64_t version) {
        return lifetime_object(registry, k * 10 + version);
      },
      [](const lifetime_object& v, std::uint64_t k, std::uint64_t version) {
        return v.intact() && v.payload() == k * 10 + version;
      });
  grace::domain::global().barrier();
  EXPECT_TRUE(registry.each_destroyed_once());
}

}  // namespace
