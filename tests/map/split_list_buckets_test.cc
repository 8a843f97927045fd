// The buckets of the split-ordered list (map/include/grace/map/detail/split_list.h, L1, L5):
// at 2^k buckets an element starts from the dummy of its so_key's top k bits, and the list
// holds exactly the dummies of that size, in so_key order, through grows and shrinks.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "grace/map/detail/split_list.h"
#include "grace/map/hash_map.h"
#include "grace/reclaim/domain.h"

namespace {

using grace::detail::dummy_position_of;
using grace::detail::dummy_so_key;
using grace::detail::element_ops;
using grace::detail::element_so_key;
using grace::detail::hash_map_config;
using grace::detail::is_dummy_link;
using grace::detail::is_marked;
using grace::detail::list_node;
using grace::detail::kMaxLevels;
using grace::detail::node_of;
using grace::detail::prefix_of;
using grace::detail::split_list;

// A list of no elements: nothing is ever reclaimed through these ops.
element_ops no_elements() {
  return {[](void*, list_node*) noexcept { ADD_FAILURE() << "a list of dummies reclaimed"; },
          nullptr};
}

hash_map_config sized(std::size_t initial, std::size_t min, std::size_t max) {
  return {.initial_buckets = initial,
          .min_buckets = min,
          .max_buckets = max,
          .grow_load_factor = 1.0,
          .shrink_load_factor = 0.25,
          .restartable_sequences = true};
}

// The so_key of the dummy an element with `so_key` starts from at 2^size_log2 buckets: the
// key's top size_log2 bits, followed by zeros.
std::uint64_t expected_dummy_key(std::uint64_t so_key, unsigned size_log2) {
  if (size_log2 == 0) return 0;
  return so_key >> (64 - size_log2) << (64 - size_log2);
}

// The dummies along the list and their so_keys (split_list::so_key_at()), checking that no
// element or marked link is on it.
struct dummy_seen {
  const list_node* dummy;
  std::uint64_t so_key;
};
std::vector<dummy_seen> dummies_in_list_order(const split_list& list) {
  std::vector<dummy_seen> seen;
  grace::read_guard guard;
  const list_node* node = list.head();
  seen.push_back({node, 0});  // the head is level 0's dummy, so_key 0
  for (std::uintptr_t link = node->next.load(std::memory_order_acquire); link != 0;
       link = node->next.load(std::memory_order_acquire)) {
    EXPECT_FALSE(is_marked(link)) << "a deleted dummy still linked";
    EXPECT_TRUE(is_dummy_link(link)) << "an element in a list of dummies";
    node = node_of(link);
    seen.push_back({node, list.so_key_at(link)});
  }
  return seen;
}

// Exactly the 2^size_log2 dummies of that size, increasing: prefix p's is p << (64 - size_log2).
void expect_the_dummies_of(const split_list& list, unsigned size_log2) {
  ASSERT_EQ(list.bucket_count(), std::size_t{1} << size_log2);
  const std::vector<dummy_seen> dummies = dummies_in_list_order(list);
  ASSERT_EQ(dummies.size(), std::size_t{1} << size_log2);
  for (std::uint64_t prefix = 0; prefix < dummies.size(); ++prefix) {
    const std::uint64_t expected = size_log2 == 0 ? 0 : prefix << (64 - size_log2);
    EXPECT_EQ(dummies[prefix].so_key, expected) << "dummy " << prefix << " at size 2^" << size_log2;
  }
}

TEST(SplitListBuckets, EveryPrefixOfEverySizeMapsToTheLevelEntryHoldingItsDummy) {
  std::mt19937_64 random(48);
  for (unsigned bits = 0; bits < kMaxLevels; ++bits) {
    const std::uint64_t buckets = std::uint64_t{1} << bits;
    std::vector<std::uint64_t> prefixes = {0, buckets - 1, buckets / 2, buckets / 2 + 1,
                                           buckets / 2 - 1};
    for (int i = 0; i < 1000; ++i) prefixes.push_back(random() & (buckets - 1));
    for (const std::uint64_t prefix : prefixes) {
      if (prefix >= buckets) continue;  // buckets / 2 + 1 at size 1
      const auto at = dummy_position_of(prefix, bits);
      ASSERT_LE(at.level, bits) << "prefix " << prefix << " of " << bits << " bits";
      ASSERT_LT(at.index, at.level == 0 ? 1 : std::uint64_t{1} << (at.level - 1))
          << "prefix " << prefix << " of " << bits << " bits: past its level's end";
      ASSERT_EQ(dummy_so_key(at.level, at.index), bits == 0 ? 0 : prefix << (64 - bits))
          << "prefix " << prefix << " of " << bits << " bits";
    }
    for (int i = 0; i < 1000; ++i) {
      const std::uint64_t so_key = random() | 1;
      ASSERT_EQ(prefix_of(so_key, bits), bits == 0 ? 0 : so_key >> (64 - bits));
    }
  }
}

TEST(SplitListBuckets, AnElementStartsFromTheDummyOfItsSoKeysTopBitsAtEverySize) {
  std::mt19937_64 random(20261201);
  for (const unsigned size_log2 : {0u, 1u, 2u, 3u, 5u, 8u, 13u}) {
    const std::size_t buckets = std::size_t{1} << size_log2;
    split_list list(sized(buckets, buckets, buckets), grace::domain::global(), no_elements());
    std::vector<std::uint64_t> so_keys = {element_so_key(0, false), element_so_key(1, false), 1,
                                          ~std::uint64_t{0}};
    for (int i = 0; i < 10'000; ++i) so_keys.push_back(element_so_key(random(), true));
    // Each dummy's so_key, as the list's links give it.
    std::unordered_map<const list_node*, std::uint64_t> dummy_keys;
    for (const dummy_seen& seen : dummies_in_list_order(list)) dummy_keys[seen.dummy] = seen.so_key;
    grace::read_guard guard;
    for (const std::uint64_t so_key : so_keys) {
      unsigned seen_log2 = 99;
      const list_node* start = list.bucket_of(so_key, seen_log2);
      ASSERT_EQ(seen_log2, size_log2);
      ASSERT_TRUE(dummy_keys.contains(start)) << "a start that is no dummy on the list";
      ASSERT_EQ(dummy_keys[start], expected_dummy_key(so_key, size_log2))
          << "so_key " << std::hex << so_key << " at size 2^" << std::dec << size_log2;
    }
  }
}

TEST(SplitListBuckets, TheListHoldsExactlyTheDummiesOfItsSizeThroughGrowsAndShrinks) {
  split_list list(sized(1, 1, std::size_t{1} << 12), grace::domain::global(), no_elements());
  expect_the_dummies_of(list, 0);
  list.reserve(5);  // grows to 8 buckets
  expect_the_dummies_of(list, 3);
  list.reserve(4096);
  expect_the_dummies_of(list, 12);
  // Empty, and nothing reserved any more: the look shrinks it back to one bucket.
  list.drop_reservation();
  list.resize_if_due();
  expect_the_dummies_of(list, 0);
  EXPECT_EQ(list.grows(), 12u);  // one per level
  EXPECT_EQ(list.shrinks(), 12u);
}

TEST(SplitListBuckets, EveryBucketGetsElementsWhenTheHashVariesOnlyInItsLowBits) {
  // std::hash of an integer is the identity: the so_key's multiply must carry small hashes
  // into every bucket taken from the top bits.
  constexpr unsigned kSizeLog2 = 10;
  std::vector<unsigned> per_bucket(std::size_t{1} << kSizeLog2);
  for (std::uint64_t hash = 0; hash < (std::uint64_t{1} << kSizeLog2) * 4; ++hash) {
    ++per_bucket[element_so_key(hash, /*avalanching=*/false) >> (64 - kSizeLog2)];
  }
  for (std::size_t bucket = 0; bucket < per_bucket.size(); ++bucket) {
    EXPECT_GE(per_bucket[bucket], 1u) << "bucket " << bucket << " empty";
    EXPECT_LE(per_bucket[bucket], 8u) << "bucket " << bucket << " holds too many";
  }
}

// A Hash declares that it avalanches as Boost.Unordered reads it; absl::Hash is taken as one.
struct declares_avalanching {
  using is_avalanching = std::true_type;
  std::size_t operator()(std::uint64_t key) const noexcept { return key; }
};
struct declares_not_avalanching {
  using is_avalanching = std::false_type;
  std::size_t operator()(std::uint64_t key) const noexcept { return key; }
};
static_assert(grace::detail::avalanching_v<absl::Hash<std::uint64_t>>);
static_assert(grace::detail::avalanching_v<declares_avalanching>);
static_assert(!grace::detail::avalanching_v<declares_not_avalanching>);
static_assert(!grace::detail::avalanching_v<std::hash<std::uint64_t>>);
struct declares_void_avalanching {
  using is_avalanching = void;
  std::size_t operator()(std::uint64_t key) const noexcept { return key; }
};
static_assert(grace::detail::avalanching_v<declares_void_avalanching>);
// An avalanching hash narrower than the so_key would leave its top bits zero: multiplied.
struct declares_avalanching_32_bits {
  using is_avalanching = std::true_type;
  std::uint32_t operator()(std::uint64_t key) const noexcept {
    return static_cast<std::uint32_t>(key);
  }
};
static_assert(grace::detail::hash_taken_as_it_is_v<declares_avalanching, std::uint64_t>);
static_assert(!grace::detail::hash_taken_as_it_is_v<declares_avalanching_32_bits, std::uint64_t>);
static_assert(!grace::detail::hash_taken_as_it_is_v<std::hash<std::uint64_t>, std::uint64_t>);

}  // namespace
