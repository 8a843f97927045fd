// Misuse of grace::hash_map that the library diagnoses instead of corrupting memory quietly:
// the map's domain destroyed before the map (every build); a map destroyed while another
// thread still uses it, a map updated from inside its own update() or erase_if() callback,
// and a transparent Hash that hashes a lookup key otherwise than the Key it stands for
// (builds with GRACE_CHECK_MISUSE, the default without NDEBUG);
// and a pointer from a pinned view read after the view ended (AddressSanitizer builds,
// through the element pool's poisoning).
//
// Each check only exists in the builds that can make it, so every registered test runs.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <latch>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "grace/map/hash_map.h"
#include "grace/reclaim/domain.h"
#include "tests/testing/testing.h"


namespace {

using u64_map = grace::hash_map<std::uint64_t, std::uint64_t>;

// Every build: a map's pool counts itself on its domain (ObjectPool tests the pool alone).
TEST(HashMapMisuse, DestroyingTheDomainBeforeAMapBuiltOnItAbortsSayingSo) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto d = std::make_unique<grace::domain>();
        u64_map map(grace::hash_map_options{.reclamation = d.get()});
        for (std::uint64_t key = 0; key < 1000; ++key) map.insert_or_assign(key % 10, key);
        d.reset();
      },
      "destroyed while 1 object pool\\(s\\) built on it still exist \\(each grace::hash_map "
      "has one\\); destroy them first");
}

#if GRACE_CHECK_MISUSE

TEST(HashMapMisuse, DestroyingAMapWhileAnotherThreadIsInsideAnOperationAbortsNamingTheMap) {
  // threadsafe: the child runs the statement in a freshly started process, without the
  // parent's domain threads.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto* map = new u64_map();
        map->insert(1, 10);
        std::latch inside(1);
        std::latch never(1);
        // The reader stays inside visit() for good; the process ends with the abort.
        std::thread reader([&] {
          map->visit(1, [&](const std::uint64_t&) {
            inside.count_down();
            never.wait();
          });
        });
        reader.detach();
        inside.wait();
        delete map;
      },
      "grace::hash_map at 0x[0-9a-f]+ destroyed while 1 operation\\(s\\) or pinned view\\(s\\)");
}

TEST(HashMapMisuse, DestroyingAMapWhileAPinnedViewOfItIsAliveAbortsNamingTheMap) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto* map = new u64_map();
        map->insert(7, 70);
        auto view = map->pin();
        (void)view.find(7);
        delete map;
      },
      "destroyed while 1 operation\\(s\\) or pinned view\\(s\\) on it are still in flight");
}

TEST(HashMapMisuse, DestroyingAMapInsideAReadSectionAbortsNamingTheMap) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        u64_map other;
        auto* map = new u64_map();
        map->insert(1, 10);
        auto view = other.pin();  // another map's view: this map counts nothing in flight
        delete map;
      },
      "grace::hash_map at 0x[0-9a-f]+ destroyed inside a read section");
}

TEST(HashMapMisuse, AMapWhoseUsersAllFinishedIsDestroyedWithoutComplaint) {
  auto* map = new u64_map();
  std::thread user([&] {
    for (std::uint64_t k = 0; k < 1000; ++k) map->insert(k, k);
    auto view = map->pin();
    EXPECT_NE(view.find(5), nullptr);
  });
  user.join();
  delete map;  // aborts if an operation or view were still counted
}

// Hashes whatever it is given as it is: a const char* by its address, not its characters.
struct as_given_hash {
  using is_transparent = void;
  template <class T>
  std::size_t operator()(const T& value) const {
    return std::hash<T>{}(value);
  }
};

TEST(HashMapMisuse, ATransparentHashThatHashesALookupKeyOtherwiseThanItsKeyIsReported) {
  grace::hash_map<std::string, int, as_given_hash, std::equal_to<>> map;
  ASSERT_TRUE(map.insert("key", 1));
  const char* key = "key";
  // Unchecked, both would miss the key that is present.
  EXPECT_THROW(map.find(key), std::logic_error);
  EXPECT_THROW(map.erase(key), std::logic_error);
  EXPECT_EQ(map.find(std::string("key")), 1);
  EXPECT_EQ(map.size(), 1u);
}

TEST(HashMapMisuse, UpdatingTheMapFromInsideUpdatesCallbackThrowsAndChangesNothing) {
  u64_map map;
  ASSERT_TRUE(map.insert(1, 10));
  ASSERT_TRUE(map.insert(2, 20));
  // Unchecked, the outer update would retry for ever: each run of f replaces key 1 again.
  EXPECT_THROW(map.update(1,
                          [&](std::uint64_t v) {
                            map.assign(1, v + 100);
                            return v + 1;
                          }),
               std::logic_error);
  EXPECT_THROW(map.update(1,
                          [&](std::uint64_t v) {
                            map.insert(3, 30);
                            return v + 1;
                          }),
               std::logic_error);
  // Reads from inside the callback are fine.
  EXPECT_TRUE(map.update(1, [&](std::uint64_t v) { return v + map.find(2).value_or(0); }));
  EXPECT_EQ(map.find(1), 30u);
  EXPECT_EQ(map.find(2), 20u);
  EXPECT_FALSE(map.contains(3));
  EXPECT_EQ(map.size(), 2u);
  // The mark is gone once the callback has thrown or returned.
  EXPECT_TRUE(map.insert(3, 30));
}

TEST(HashMapMisuse, UpdatingTheMapFromAnotherMapsCallbackInsideItsOwnThrows) {
  u64_map a;
  u64_map b;
  ASSERT_TRUE(a.insert(1, 10));
  ASSERT_TRUE(b.insert(1, 100));
  // a's f runs b's f, which replaces a's key 1: unchecked, a's update would retry for ever.
  EXPECT_THROW(a.update(1,
                        [&](std::uint64_t v) {
                          b.update(1, [&](std::uint64_t w) {
                            a.assign(1, 0);
                            return w + 1;
                          });
                          return v + 1;
                        }),
               std::logic_error);
  EXPECT_EQ(a.find(1), 10u);
  EXPECT_EQ(b.find(1), 100u);
}

TEST(HashMapMisuse, UpdatingTheMapFromInsideErasePredicateThrowsAndChangesNothing) {
  u64_map map;
  ASSERT_TRUE(map.insert(1, 10));
  // "Erase if stale, else touch": the touch replaces the element pred is looking at.
  EXPECT_THROW(map.erase_if(1,
                            [&](std::uint64_t v) {
                              map.assign(1, v + 1);
                              return false;
                            }),
               std::logic_error);
  EXPECT_THROW(map.erase_if(1,
                            [&](std::uint64_t) {
                              map.erase(1);
                              return true;
                            }),
               std::logic_error);
  EXPECT_EQ(map.find(1), 10u);
  // Another map may be updated from inside the predicate.
  u64_map other;
  EXPECT_TRUE(map.erase_if(1, [&](std::uint64_t v) { return other.insert(1, v); }));
  EXPECT_EQ(other.find(1), 10u);
  EXPECT_TRUE(map.empty());
}

// Hashes std::string_view otherwise than std::string, whose conversion from it is explicit.
struct view_salting_hash {
  using is_transparent = void;
  std::size_t operator()(const std::string& key) const { return std::hash<std::string>{}(key); }
  std::size_t operator()(std::string_view key) const {
    return std::hash<std::string_view>{}(key) ^ 0x5a5a;
  }
};

TEST(HashMapMisuse, ATransparentHashThatHashesAStringViewOtherwiseThanItsStringIsReported) {
  grace::hash_map<std::string, int, view_salting_hash, std::equal_to<>> map;
  ASSERT_TRUE(map.insert("key", 1));
  const std::string_view key = "key";
  // Unchecked, these would miss the key that is present.
  EXPECT_THROW(map.find(key), std::logic_error);
  EXPECT_THROW(map.contains(key), std::logic_error);
  EXPECT_THROW(map.erase(key), std::logic_error);
  EXPECT_EQ(map.size(), 1u);
}

#endif  // GRACE_CHECK_MISUSE

#if GRACE_TESTING_ASAN

// Once a grace period has passed since an element was erased, the pool poisons it (or has
// given its memory back to the system), so a read through a pointer kept past its pinned
// view is an AddressSanitizer report, not a silent read of memory that may already hold
// another key's element. (Before that grace period the read would still be safe for a
// reader inside its read section, so nothing is poisoned earlier.)
TEST(HashMapMisuse, APointerKeptPastItsPinnedViewIsCaughtByAddressSanitizerOnceErased) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        u64_map map;
        constexpr std::uint64_t kKeys = 8192;
        for (std::uint64_t k = 0; k < kKeys; ++k) map.insert(k, k);
        const std::uint64_t* kept = nullptr;
        {
          auto view = map.pin();
          kept = view.find(3);
        }
        // Erasing (no inserts, so nothing is reused) fills the pool's magazines; a grace
        // period later the next erases find them elapsed and poison their elements.
        for (std::uint64_t k = 0; k < kKeys / 2; ++k) map.erase(k);
        grace::domain::global().synchronize();
        for (std::uint64_t k = kKeys / 2; k < kKeys; ++k) map.erase(k);
        const volatile std::uint64_t* read = kept;  // a read the compiler cannot drop
        std::printf("read %llu\n", static_cast<unsigned long long>(*read));
      },
      "AddressSanitizer: (use-after-poison|SEGV)");
}

#endif  // GRACE_TESTING_ASAN

}  // namespace
