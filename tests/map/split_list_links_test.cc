// The links of the split-ordered list (map/include/grace/map/detail/split_list.h, L7): each
// `next` tells a lookup whether its successor is the dummy of a bucket that ends the walk.
#include <gtest/gtest.h>

#include <cstdint>

#include "grace/map/detail/split_list.h"

namespace {

using grace::detail::dummy_so_key;
using grace::detail::element_so_key;
using grace::detail::ends_bucket;
using grace::detail::kMarked;
using grace::detail::kMaxLevels;
using grace::detail::link_to;
using grace::detail::list_node;
using grace::detail::node_of;

TEST(SplitListLinks, ALinkToADummyEndsExactlyTheWalksOfTablesAtLeastAsLargeAsItsLevel) {
  for (unsigned level = 0; level < kMaxLevels; ++level) {
    // The first and last entry of the level.
    const std::uint64_t last = level == 0 ? 0 : (std::uint64_t{1} << (level - 1)) - 1;
    for (const std::uint64_t index : {std::uint64_t{0}, last}) {
      list_node dummy;
      dummy.so_key = dummy_so_key(level, index);
      const std::uintptr_t link = link_to(&dummy);
      for (unsigned size_log2 = 0; size_log2 < kMaxLevels; ++size_log2) {
        // A table of 2^size_log2 buckets holds levels 0..size_log2.
        EXPECT_EQ(ends_bucket(link, size_log2), grace::detail::kLinkTags && level <= size_log2)
            << "entry " << index << " of level " << level << ", size 2^" << size_log2;
      }
      EXPECT_EQ(node_of(link), &dummy);
      EXPECT_EQ(node_of(link | kMarked), &dummy) << "the mark hid the pointer";
      EXPECT_EQ(ends_bucket(link | kMarked, level), grace::detail::kLinkTags)
          << "the mark changed the tag";
    }
  }
}

TEST(SplitListLinks, ALinkToAnElementOrToNothingNeverEndsAWalk) {
  list_node element;
  element.so_key = element_so_key(0x1234'5678'9abc'def0ull, /*avalanching=*/false);
  for (unsigned size_log2 = 0; size_log2 < kMaxLevels; ++size_log2) {
    EXPECT_FALSE(ends_bucket(link_to(&element), size_log2));
    EXPECT_FALSE(ends_bucket(link_to(&element) | kMarked, size_log2));
    EXPECT_FALSE(ends_bucket(link_to(nullptr), size_log2));
  }
  EXPECT_EQ(node_of(link_to(&element)), &element);
  EXPECT_EQ(link_to(nullptr), 0u) << "the end of the list must stay the null link";
}

}  // namespace
