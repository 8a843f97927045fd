// The links of the split-ordered list (map/include/grace/map/detail/split_list.h, L7): each
// `next` tells a lookup whether its successor is the dummy of a bucket that ends the walk.
#include <gtest/gtest.h>

#include <cstdint>

#include "grace/map/detail/split_list.h"

namespace {

using grace::detail::dummy_link;
using grace::detail::element_link;
using grace::detail::element_so_key;
using grace::detail::ends_bucket;
using grace::detail::is_dummy_link;
using grace::detail::keyed_node;
using grace::detail::kMarked;
using grace::detail::kMaxLevels;
using grace::detail::list_node;
using grace::detail::node_of;

TEST(SplitListLinks, ALinkToADummyEndsExactlyTheWalksOfTablesAtLeastAsLargeAsItsLevel) {
  for (unsigned level = 0; level < kMaxLevels; ++level) {
    list_node dummy;
    const std::uintptr_t link = dummy_link(&dummy, level);
    for (unsigned size_log2 = 0; size_log2 < kMaxLevels; ++size_log2) {
      // A table of 2^size_log2 buckets holds levels 0..size_log2.
      EXPECT_EQ(ends_bucket(link, size_log2), grace::detail::kLinkTags && level <= size_log2)
          << "a dummy of level " << level << ", size 2^" << size_log2;
    }
    EXPECT_EQ(node_of(link), &dummy);
    EXPECT_EQ(node_of(link | kMarked), &dummy) << "the mark hid the pointer";
    EXPECT_EQ(ends_bucket(link | kMarked, level), grace::detail::kLinkTags)
        << "the mark changed the tag";
    if constexpr (grace::detail::kLinkTags) {
      EXPECT_TRUE(is_dummy_link(link)) << "level " << level;
      EXPECT_TRUE(is_dummy_link(link | kMarked)) << "level " << level;
    }
  }
}

TEST(SplitListLinks, ALinkToAnElementOrToNothingNeverEndsAWalk) {
  keyed_node element;
  element.so_key = element_so_key(0x1234'5678'9abc'def0ull, /*avalanching=*/false);
  for (unsigned size_log2 = 0; size_log2 < kMaxLevels; ++size_log2) {
    EXPECT_FALSE(ends_bucket(element_link(&element), size_log2));
    EXPECT_FALSE(ends_bucket(element_link(&element) | kMarked, size_log2));
    EXPECT_FALSE(ends_bucket(0, size_log2));
  }
  EXPECT_EQ(node_of(element_link(&element)), &element);
  EXPECT_FALSE(is_dummy_link(element_link(&element)));
  EXPECT_FALSE(is_dummy_link(element_link(&element) | kMarked));
  EXPECT_EQ(element_link(nullptr), 0u) << "the end of the list must stay the null link";
}

}  // namespace
