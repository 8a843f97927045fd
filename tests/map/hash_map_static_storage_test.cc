// Tests for maps with static storage duration: a namespace-scope map and a function-local
// static one, filled and churned by threads, must destroy every element they still hold or
// have erased when the process exits, after main() returns, and without a crash or a leak.
//
// How a failure shows: the checks run in the destructor of `exit_check`, defined before the
// maps, so that it runs after theirs; a count that is not zero there prints what is left and
// ends the process with status 1, which fails the CTest case (each TEST runs in a process
// of its own, gtest_discover_tests). Under ASan, LeakSanitizer also checks at exit that the
// maps gave back every chunk, magazine and value buffer.
#include "grace/map/hash_map.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "grace/reclaim/domain.h"
#include "tests/map/map_testing.h"

namespace {

namespace gm = grace::testing::map;

// Values alive now, counting copies: every construction adds one, every destruction takes one.
constinit std::atomic<std::int64_t> live_values{0};
// Whether a test filled the maps: a process that only lists the tests checks nothing.
constinit std::atomic<bool> maps_filled{false};

// A value that owns heap memory (a string past the small-string buffer) and counts itself.
class counted_value {
 public:
  explicit counted_value(std::uint64_t key)
      : text_(gm::checked_string(std::to_string(key), 0)) {
    count(+1);
  }
  counted_value(const counted_value& other) : text_(other.text_) { count(+1); }
  counted_value& operator=(const counted_value&) = delete;
  ~counted_value() { count(-1); }

  const std::string& text() const noexcept { return text_; }

 private:
  // Relaxed: a count read only after the threads that change it were joined, or at exit,
  // after the maps' destructors returned (they wait for the reclaim worker's destructions).
  static void count(std::int64_t delta) noexcept {
    live_values.fetch_add(delta, std::memory_order_relaxed);
  }

  std::string text_;
};

struct exit_check {
  // Builds the global domain first, so that its exit-time barrier() (an atexit() function
  // registered while it is built, before this object is complete) runs after this check:
  // otherwise that barrier would destroy what the maps' destructors left pending, and hide it.
  exit_check() { (void)grace::domain::global(); }
  exit_check(const exit_check&) = delete;
  exit_check& operator=(const exit_check&) = delete;
  ~exit_check() {
    // Relaxed: see counted_value::count().
    const std::int64_t left = live_values.load(std::memory_order_relaxed);
    if (maps_filled.load(std::memory_order_relaxed) && left != 0) {
      std::fprintf(stderr, "static maps destroyed at exit left %lld values undestroyed\n",
                   static_cast<long long>(left));
      std::fflush(stderr);
      ::_exit(1);
    }
  }
};

// Defined before the maps: destroyed after them.
exit_check check_at_exit;

using counted_map = grace::hash_map<std::uint64_t, counted_value>;

counted_map destroyed_on_reclaim_worker;
counted_map destroyed_by_updaters(
    grace::hash_map_options{.destruction = grace::element_destruction::by_updaters});

// Built by the first thread that asks, not by main().
counted_map& function_local_map() {
  static counted_map map;
  return map;
}

constexpr unsigned kThreads = 4;
constexpr std::uint64_t kKeys = 3000;
constexpr std::uint64_t kOperationsPerThread = 30000;

// Each thread replaces and erases keys of all three maps, so that at exit each holds live
// elements, erased ones still waiting for their grace period, and pool magazines on every
// CPU the threads ran on.
void churn(unsigned thread) {
  for (std::uint64_t i = 0; i < kOperationsPerThread; ++i) {
    const std::uint64_t key = (i * kThreads + thread) % kKeys;
    destroyed_on_reclaim_worker.insert_or_assign(key, counted_value(key));
    destroyed_by_updaters.insert_or_assign(key, counted_value(key));
    function_local_map().insert_or_assign(key, counted_value(key));
    if (i % 3 == 0) {
      destroyed_on_reclaim_worker.erase(key);
      destroyed_by_updaters.erase(key);
      function_local_map().erase(key);
    }
  }
}

TEST(HashMapStaticStorage, MapsWithStaticStorageDestroyEveryElementWhenTheProcessExits) {
  maps_filled.store(true, std::memory_order_relaxed);  // Relaxed: read at exit, one thread.
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; ++t) threads.emplace_back(churn, t);
  for (std::thread& thread : threads) thread.join();

  for (counted_map* map :
       {&destroyed_on_reclaim_worker, &destroyed_by_updaters, &function_local_map()}) {
    EXPECT_GT(map->size(), 0u);
    map->for_each([](std::uint64_t key, const counted_value& value) {
      EXPECT_TRUE(gm::checked_string_valid_for(value.text(), std::to_string(key))) << key;
    });
  }
  // The maps hold values past this test: exit_check finds out whether their destructors,
  // which run after main() returns, destroy them all.
  EXPECT_GT(live_values.load(std::memory_order_relaxed), 0);  // Relaxed: threads joined.
}

}  // namespace
