// Tests for fork() in a process that uses grace::hash_map: the child uses a map its parent
// filled (find, insert, erase, clear, destroy) with correct results, including when another
// thread of the parent was updating the map at the moment of the fork.
//
// Conventions (as in tests/reclaim/fork_test.cc):
//   - The child never returns into GoogleTest: it runs a function whose int result is its
//     exit code (0 = passed; each failure prints a line on stderr and has its own code), and
//     ends with _exit(). alarm() turns a hang in the child into SIGALRM; a watchdog covers
//     the parent.
//   - Under AddressSanitizer (GCC 12's libasan takes no lock around fork()), a child whose
//     parent had another thread inside malloc at the fork can deadlock in its own malloc.
//     The map updated across forks therefore takes its pool's and its domain's memory from
//     mmap() (gt::mapping_allocator) and never resizes, so its updater never calls malloc, and
//     the updater is running (a starting thread allocates) before the first fork.
#include "grace/map/hash_map.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <latch>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "grace/reclaim/domain.h"
#include "tests/map/map_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace gm = grace::testing::map;

// Under ThreadSanitizer the child of a fork() here starts threads (its domains' engines)
// although its parent had several: GCC 12's libtsan does not support that (the child dies on
// a reused thread id) and checks nothing in such a child anyway. Those tests are compiled
// only without TSan (the debug and asan presets run them); the death tests run everywhere.

using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 120s;  // watchdog budget for the parent

// --- a map filled by the parent ------------------------------------------------------------

using string_map = grace::hash_map<std::uint64_t, std::string>;

// Long enough to live on the heap: the values have real destructors.
std::string value_of(std::uint64_t key, int version = 0) {
  return "value-" + std::to_string(key) + "-version-" + std::to_string(version) +
         "-padding-beyond-the-small-string-buffer";
}

// What the parent left before the fork: keys [0, n), every third erased, every fifth (of
// those left) assigned version 1.
std::optional<std::string> expected_before_fork(std::uint64_t key) {
  if (key % 3 == 0) return std::nullopt;
  return value_of(key, key % 5 == 0 ? 1 : 0);
}

// Checks find() of every key in [0, n) against expected_before_fork(); 0 or an exit code.
// Serves only tests compiled without TSan (hence [[maybe_unused]]).
[[maybe_unused]] int check_parent_contents(const string_map& map, std::uint64_t n) {
  for (std::uint64_t key = 0; key < n; ++key) {
    if (map.find(key) != expected_before_fork(key)) {
      return gt::child_failure(10, "find() disagrees with what the parent left", key);
    }
  }
  return 0;
}

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(HashMapFork, TheChildFindsInsertsErasesClearsAndDestroysAMapItsParentFilled) {
  const std::uint64_t n = gt::iterations(20'000, 4'000);
  auto map = std::make_unique<string_map>();
  for (std::uint64_t key = 0; key < n; ++key) ASSERT_TRUE(map->insert(key, value_of(key)));
  // Leave erased and replaced elements waiting for their grace period at the fork.
  for (std::uint64_t key = 0; key < n; key += 3) ASSERT_TRUE(map->erase(key));
  for (std::uint64_t key = 0; key < n; key += 5) {
    if (key % 3 != 0) {
      ASSERT_TRUE(map->assign(key, value_of(key, 1)));
    }
  }

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "the child of a process with a filled map");
    status = gt::run_in_child([&] {
      if (int code = check_parent_contents(*map, n)) return code;
      // Inserts: new keys, and keys the parent erased.
      for (std::uint64_t key = 0; key < 2 * n; ++key) {
        const bool absent = key >= n || key % 3 == 0;
        if (map->insert(key, value_of(key, 2)) != absent) {
          return gt::child_failure(11, "insert() of a key did not report what the parent left",
                                   key);
        }
      }
      for (std::uint64_t key = 0; key < 2 * n; ++key) {
        const bool absent_before = key >= n || key % 3 == 0;
        const std::string want = absent_before ? value_of(key, 2) : *expected_before_fork(key);
        if (map->find(key) != want) return gt::child_failure(12, "find() after insert()", key);
      }
      // Erases: every other key.
      for (std::uint64_t key = 0; key < 2 * n; key += 2) {
        if (!map->erase(key)) return gt::child_failure(13, "erase() of a present key failed", key);
      }
      for (std::uint64_t key = 0; key < 2 * n; ++key) {
        if (map->contains(key) != (key % 2 == 1)) {
          return gt::child_failure(14, "contains() after erase()", key);
        }
      }
      if (map->size() != n) return gt::child_failure(15, "size() after erase()", map->size());
      map->clear();
      for (std::uint64_t key = 0; key < 2 * n; ++key) {
        if (map->contains(key)) return gt::child_failure(16, "a key survived clear()", key);
      }
      if (!map->empty()) return gt::child_failure(17, "not empty after clear()", map->size());
      for (std::uint64_t key = 0; key < 100; ++key) {
        if (!map->insert(key, value_of(key, 3))) {
          return gt::child_failure(18, "insert() after clear()", key);
        }
      }
      map.reset();  // releases every element and waits for the domain's barrier()
      grace::domain::global().synchronize();
      grace::domain::global().barrier();
      return 0;
    });
  }
  EXPECT_TRUE(gt::exited_cleanly(status));

  // The parent's map is untouched by the child's work.
  for (std::uint64_t key = 0; key < n; ++key) {
    ASSERT_EQ(map->find(key), expected_before_fork(key)) << "key " << key;
  }
  for (std::uint64_t key = n; key < n + 100; ++key) ASSERT_TRUE(map->insert(key, value_of(key)));
  map->clear();
  EXPECT_TRUE(map->empty());
  map.reset();
}
#endif

// --- a map another thread of the parent updates across forks ---------------------------------

using u64_map = grace::hash_map<std::uint64_t, std::uint64_t>;

constexpr std::uint64_t kUpdaterKeys = 512;          // the parent's thread: [0, 512)
constexpr std::uint64_t kChildKeys = 1'000'000;      // the child's: [kChildKeys, + n)
// Values the updater writes: the key in the low bits, a round number above.
constexpr std::uint64_t updater_value(std::uint64_t key, std::uint64_t round) {
  return round << 20 | key;
}

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(HashMapFork, TheChildUsesAMapThatAnotherThreadOfTheParentWasUpdatingAtTheFork) {
  grace::domain d({.allocator = gt::mapping_allocator});
  grace::hash_map_options options;
  options.reclamation = &d;
  // One fixed size: a resize allocates its bucket level with malloc (see the file comment).
  options.initial_buckets = options.min_buckets = options.max_buckets = 4096;
  options.pool.allocator = gt::mapping_allocator;
  u64_map map(options);
  for (std::uint64_t key = 0; key < kUpdaterKeys; ++key) map.insert(key, updater_value(key, 0));

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> rounds{0};
  std::latch updater_in(1);  // running (not starting) at the first fork: see the file comment
  std::thread updater([&] {
    updater_in.count_down();
    // Relaxed: a stop flag.
    for (std::uint64_t round = 1; !stop.load(std::memory_order_relaxed); ++round) {
      for (std::uint64_t key = 0; key < kUpdaterKeys; ++key) {
        switch ((key + round) % 4) {
          case 0: map.insert_or_assign(key, updater_value(key, round)); break;
          case 1: map.erase(key); break;
          case 2: map.insert(key, updater_value(key, round)); break;
          default: (void)map.find(key); break;
        }
      }
      rounds.store(round, std::memory_order_relaxed);  // Relaxed: progress, read for a check.
    }
  });

  updater_in.wait();
  const int forks = static_cast<int>(gt::iterations(40, 20));
  const std::uint64_t child_keys = gt::iterations(4'000, 1'000);
  {
    gt::watchdog dog(kNoDeadlock, "forks while another thread updates the map");
    for (int i = 0; i < forks; ++i) {
      const int status = gt::run_in_child([&] {
        // The updater's keys: absent, or a value it wrote for that key.
        for (std::uint64_t key = 0; key < kUpdaterKeys; ++key) {
          const std::optional<std::uint64_t> v = map.find(key);
          if (v && (*v & ((std::uint64_t{1} << 20) - 1)) != key) {
            return gt::child_failure(20, "an updater key maps to another key's value", key);
          }
        }
        for (std::uint64_t key = kChildKeys; key < kChildKeys + child_keys; ++key) {
          if (!map.insert(key, key * 3)) return gt::child_failure(21, "insert() of a new key", key);
        }
        for (std::uint64_t key = kChildKeys; key < kChildKeys + child_keys; ++key) {
          if (map.find(key) != key * 3) return gt::child_failure(22, "find() after insert()", key);
          if (key % 2 == 0 && !map.erase(key)) return gt::child_failure(23, "erase()", key);
        }
        for (std::uint64_t key = kChildKeys; key < kChildKeys + child_keys; ++key) {
          if (map.contains(key) != (key % 2 == 1)) {
            return gt::child_failure(24, "contains() after erase()", key);
          }
        }
        // The updater thread does not exist here; it may have been inside a read section,
        // holding a pool cache, or between two steps of an update at the fork.
        d.synchronize();
        d.barrier();
        map.clear();
        for (std::uint64_t key = 0; key < kUpdaterKeys; ++key) {
          if (map.contains(key)) return gt::child_failure(25, "a key survived clear()", key);
        }
        for (std::uint64_t key = kChildKeys; key < kChildKeys + child_keys; ++key) {
          if (map.contains(key)) return gt::child_failure(25, "a key survived clear()", key);
        }
        if (!map.insert(7, 7) || map.find(7) != 7u) {
          return gt::child_failure(26, "insert() after clear()", 7);
        }
        d.barrier();
        // Not destroyed: with GRACE_CHECK_MISUSE, ~hash_map() counts an operation the
        // updater had in flight at the fork as still running (see reclaim/README.md).
        return 0;
      });
      ASSERT_TRUE(gt::exited_cleanly(status)) << "fork " << i << " of " << forks;
    }
  }
  stop.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
  updater.join();
  EXPECT_GT(rounds.load(std::memory_order_relaxed), 0u);  // Relaxed: after the join.

  // The parent's map is consistent: every key absent or holding one of its own values.
  for (std::uint64_t key = 0; key < kUpdaterKeys; ++key) {
    const std::optional<std::uint64_t> v = map.find(key);
    if (v) {
      ASSERT_EQ(*v & ((std::uint64_t{1} << 20) - 1), key);
    }
  }
  for (std::uint64_t key = kChildKeys; key < kChildKeys + child_keys; ++key) {
    ASSERT_FALSE(map.contains(key)) << "a key the child inserted appeared in the parent";
  }
  map.clear();
  d.barrier();
}
#endif

// --- a resize another thread was running at the fork ------------------------------------------

// One thread resizes a map at a time. One that another thread of the parent was running at
// the fork held that turn for ever in the child: the map never resized again there (its
// chains grew without bound) and reserve() waited for ever. The child now takes the turn
// over and rolls back the half-linked or half-unlinked level first (split_list.h, L8).

using counter_map = grace::hash_map<std::uint64_t, std::uint64_t>;
constexpr std::uint64_t kGrowParentKeys = 200;  // keys the parent inserts in the grow tests
constexpr std::uint64_t kChurnRange = 2000;     // keys per thread in the churn test

// In the child: the map holds exactly the keys in [0, present_below) among [0, span), it
// grows, shrinks and reserves; 0 or an exit code. size() may be off by `size_slack`: an
// update a thread of the parent had linked but not yet counted at the fork is never counted.
[[maybe_unused]] int check_resizes_after_fork(counter_map& map, std::uint64_t present_below,
                                              std::uint64_t span, std::uint64_t size_slack = 0) {
  for (std::uint64_t key = 0; key < span; ++key) {
    if (map.contains(key) != (key < present_below)) {
      return gt::child_failure(20, "contains() disagrees with the parent's updates", key);
    }
  }
  // Two threads update keys of their own while this one's inserts make the first resize,
  // which rolls the abandoned level back: as in any shrink, updates run on meanwhile.
  std::atomic<std::uint64_t> worker_mismatches{0};  // Relaxed (both): read after the joins
  std::atomic<bool> workers_stop{false};
  std::thread workers[2];
  for (std::uint64_t w = 0; w < 2; ++w) {
    workers[w] = std::thread([&, base = 1'000'000 + w * 100'000] {
      for (int round = 0; round < 3 || !workers_stop.load(std::memory_order_relaxed); ++round) {
        for (std::uint64_t k = base; k < base + 3000; ++k) {
          if (!map.insert(k, k)) worker_mismatches.fetch_add(1, std::memory_order_relaxed);
        }
        for (std::uint64_t k = base; k < base + 3000; ++k) {
          if (map.find(k) != k) worker_mismatches.fetch_add(1, std::memory_order_relaxed);
        }
        for (std::uint64_t k = base; k < base + 3000; ++k) {
          if (!map.erase(k)) worker_mismatches.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  constexpr std::uint64_t kMany = 20'000;
  int inserted = 0;
  for (std::uint64_t key = present_below; key < kMany && inserted == 0; ++key) {
    if (!map.insert(key, key)) inserted = gt::child_failure(21, "insert() of an absent key", key);
  }
  workers_stop.store(true, std::memory_order_relaxed);
  for (std::thread& worker : workers) worker.join();
  if (inserted != 0) return inserted;
  if (const std::uint64_t bad = worker_mismatches.load(std::memory_order_relaxed); bad != 0) {
    return gt::child_failure(29, "updates of other threads went wrong during the roll-back", bad);
  }
  if (map.stats().buckets < kMany / 2) {
    return gt::child_failure(22, "the map did not grow in the child", map.stats().buckets);
  }
  // A level left half-linked and linked again would hold two dummies per bucket, and a lookup
  // stops at the second: keys of those buckets would go missing.
  for (std::uint64_t key = 0; key < kMany; ++key) {
    if (!map.contains(key)) return gt::child_failure(28, "a key went missing after the grow", key);
  }
  for (std::uint64_t key = 100; key < kMany; ++key) {
    if (!map.erase(key)) return gt::child_failure(23, "erase() of a present key", key);
  }
  // 100 keys left; one test's reserve(1000) keeps 1000 / grow_load_factor (0.5) of the
  // 2^16 buckets that kMany keys grew the table to.
  if (map.stats().buckets > 2048) {
    return gt::child_failure(24, "the map did not shrink in the child", map.stats().buckets);
  }
  map.reserve(100'000);  // waited for ever for the parent's resizer
  if (map.stats().buckets < 100'000) {
    return gt::child_failure(25, "reserve() did not grow the map", map.stats().buckets);
  }
  for (std::uint64_t key = 0; key < kMany; ++key) {
    if (map.find(key) != (key < 100 ? std::optional<std::uint64_t>(key) : std::nullopt)) {
      return gt::child_failure(26, "find() after the resizes", key);
    }
  }
  if (map.size() + size_slack < 100 || map.size() > 100 + size_slack) {
    return gt::child_failure(27, "size() after the resizes", map.size());
  }
  return 0;
}

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
// Forks while another thread grows `map` from 64 to 128 buckets, half-way through linking
// the new level; the child runs `child` after checking nothing else. Then lets the grow end
// and checks the parent's map. Returns the child's wait status.
template <class Child>
int fork_during_grow(counter_map& map, Child child) {
  constexpr std::uint64_t kBefore = 30;  // below the first grow (64 buckets, load factor 0.5)
  for (std::uint64_t key = 0; key < kBefore; ++key) EXPECT_TRUE(map.insert(key, key));
  gm::arm_resizer_pause();
  std::atomic<std::uint64_t> inserting{0};  // Relaxed: ordered by resizer_paused, the join
  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while another thread grows a map");
    std::thread resizer([&] {
      for (std::uint64_t key = kBefore; key < kGrowParentKeys; ++key) {
        inserting.store(key, std::memory_order_relaxed);
        map.insert(key, key);  // one of these grows the map, and pauses half-way
      }
    });
    gm::wait_until_resizer_paused();
    // The paused insert has linked its key: the child sees [0, inserting].
    const std::uint64_t present_below = inserting.load(std::memory_order_relaxed) + 1;
    status = gt::run_in_child([&] { return child(present_below); });
    gm::let_resizer_go();
    resizer.join();
  }
  gm::disarm_resizer_pause();
  for (std::uint64_t key = 0; key < kGrowParentKeys; ++key) {
    EXPECT_TRUE(map.contains(key)) << key;
  }
  EXPECT_GE(map.stats().buckets, 256u);
  return status;
}

TEST(HashMapFork, AGrowAnotherThreadWasRunningAtTheForkIsRolledBackAndTheChildResizes) {
  counter_map map(grace::hash_map_options{.initial_buckets = 64, .min_buckets = 64});
  const int status = fork_during_grow(map, [&](std::uint64_t present_below) {
    return check_resizes_after_fork(map, present_below, kGrowParentKeys);
  });
  EXPECT_TRUE(gt::exited_cleanly(status));
}

// The child's first resize takes the turn over inside a read section, where it cannot roll
// the level back (that waits for grace periods): it must leave it, and no later resize may
// grow over it.
TEST(HashMapFork, AResizeTurnTakenOverInsideAReadSectionLeavesTheRollBackToTheNextResize) {
  counter_map map(grace::hash_map_options{.initial_buckets = 64, .min_buckets = 64});
  const int status = fork_during_grow(map, [&](std::uint64_t present_below) {
    {
      auto guard = grace::pin();
      map.reserve(1000);  // takes the turn over; cannot roll back here
    }
    return check_resizes_after_fork(map, present_below, kGrowParentKeys);
  });
  EXPECT_TRUE(gt::exited_cleanly(status));
}

TEST(HashMapFork, AShrinkAnotherThreadWasRunningAtTheForkIsRolledBackAndTheChildResizes) {
  counter_map map(grace::hash_map_options{.initial_buckets = 64, .min_buckets = 64});
  constexpr std::uint64_t kBefore = 2000;  // 4096 buckets at the default load factors
  for (std::uint64_t key = 0; key < kBefore; ++key) ASSERT_TRUE(map.insert(key, key));
  ASSERT_GE(map.stats().buckets, 2048u);
  gm::arm_resizer_pause();
  std::atomic<std::uint64_t> erasing{kBefore};  // Relaxed: ordered by resizer_paused, the join
  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while another thread shrinks a map");
    std::thread resizer([&] {
      for (std::uint64_t key = kBefore; key-- > 0;) {
        erasing.store(key, std::memory_order_relaxed);
        map.erase(key);  // one of these shrinks the map (4096 -> 1024), and pauses half-way
      }
    });
    gm::wait_until_resizer_paused();
    // The paused erase has unlinked its key: the child sees [0, erasing).
    const std::uint64_t present_below = erasing.load(std::memory_order_relaxed);
    status = gt::run_in_child(
        [&] { return check_resizes_after_fork(map, present_below, kBefore); });
    gm::let_resizer_go();
    resizer.join();
  }
  gm::disarm_resizer_pause();
  EXPECT_TRUE(gt::exited_cleanly(status));
  EXPECT_TRUE(map.empty());
  EXPECT_GE(map.stats().shrinks, 2u);  // the paused shrink went on, and later ones followed
}
#endif

// --- forks while other threads grow and shrink a map ------------------------------------------

// Keys a churner (below) has present after `done` operations on its range of kChurnRange
// keys: round after round it inserts them all in order, then erases them all in order.
[[maybe_unused]] bool churned_present(std::uint64_t done, std::uint64_t key) {
  const std::uint64_t pos = done % (2 * kChurnRange);
  return pos < kChurnRange ? key < pos : key >= pos - kChurnRange;
}
// The key of a churner's operation number `op` (counted from 0).
[[maybe_unused]] std::uint64_t churned_key(std::uint64_t op) {
  const std::uint64_t pos = op % (2 * kChurnRange);
  return pos < kChurnRange ? pos : pos - kChurnRange;
}

#if !GRACE_TESTING_TSAN && !GRACE_TESTING_ASAN  // the child starts threads; resizes allocate
                                                // with malloc while the fork copies
// Two threads of the parent grow and shrink a map over and over (64 to 8192 buckets and
// back) while the main thread forks at random moments: in the middle of resizes, of pool
// refills and trims, of retires. Each child checks the keys against what the threads had
// done (only the operation each had in flight may have gone either way), then uses, grows,
// shrinks and reserves the map alone.
TEST(HashMapFork, ChildrenForkedWhileOtherThreadsGrowAndShrinkTheMapSeeItsKeysAndResizeIt) {
  counter_map map(grace::hash_map_options{.initial_buckets = 64, .min_buckets = 64});
  std::atomic<bool> stop{false};
  // Operations each churner has completed. Release/Acquire: its updates before the count.
  std::atomic<std::uint64_t> done[2]{0, 0};
  auto churn = [&](unsigned t) {
    const std::uint64_t base = (t + 1) * 1'000'000;
    // Relaxed: a stop flag.
    for (std::uint64_t op = 0; !stop.load(std::memory_order_relaxed); ++op) {
      const std::uint64_t key = base + churned_key(op);
      if (op % (2 * kChurnRange) < kChurnRange) {
        map.insert(key, key);
      } else {
        map.erase(key);
      }
      done[t].store(op + 1, std::memory_order_release);  // see above
    }
  };
  std::latch churning(2);  // running (not starting) at the first fork
  std::thread churners[2];
  for (unsigned t = 0; t < 2; ++t) {
    churners[t] = std::thread([&, t] {
      churning.count_down();
      churn(t);
    });
  }
  churning.wait();
  gt::fork_at_random_moments(
      static_cast<int>(gt::iterations(12, 6)), std::chrono::microseconds(3000),
      /*alarm_seconds=*/60, kNoDeadlock, "forks while other threads grow and shrink a map", [&] {
        for (unsigned t = 0; t < 2; ++t) {
          const std::uint64_t base = (t + 1) * 1'000'000;
          // Acquire: see done.
          const std::uint64_t completed = done[t].load(std::memory_order_acquire);
          const std::uint64_t in_flight = churned_key(completed);
          for (std::uint64_t key = 0; key < kChurnRange; ++key) {
            if (key != in_flight && map.contains(base + key) != churned_present(completed, key)) {
              return gt::child_failure(30, "a churned key disagrees with its thread's progress",
                                   base + key);
            }
          }
        }
        std::uint64_t visited = 0;
        map.for_each([&](std::uint64_t key, std::uint64_t value) {
          if (key == value && map.contains(key)) ++visited;
        });
        std::uint64_t present = 0;
        for (unsigned t = 0; t < 2; ++t) {
          for (std::uint64_t key = 0; key < kChurnRange; ++key) {
            present += map.contains((t + 1) * 1'000'000 + key) ? 1 : 0;
          }
        }
        if (visited != present) return gt::child_failure(31, "for_each() visits", visited);
        for (unsigned t = 0; t < 2; ++t) {
          for (std::uint64_t key = 0; key < kChurnRange; ++key) {
            (void)map.erase((t + 1) * 1'000'000 + key);
          }
        }
        // The child alone: it grows, shrinks and reserves as any process would. Each
        // churner's update in flight may never be counted.
        return check_resizes_after_fork(map, 0, 0, /*size_slack=*/2);
      });
  stop.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
  for (std::thread& churner : churners) churner.join();
  for (unsigned t = 0; t < 2; ++t) {
    const std::uint64_t base = (t + 1) * 1'000'000;
    const std::uint64_t completed = done[t].load(std::memory_order_relaxed);  // after the join
    EXPECT_GT(completed, 2 * kChurnRange) << "the churner never went round";
    for (std::uint64_t key = 0; key < kChurnRange; ++key) {
      ASSERT_EQ(map.contains(base + key), churned_present(completed, key)) << base + key;
    }
  }
}
#endif

}  // namespace
