// Tests for grace::object_pool's destroy hook (pool_options::destroy): deallocate() takes an
// object that is still constructed, and the pool runs destroy(object) once, after the
// object's grace period, outside any cache hold, and before the memory is handed out again
// or released. Also deallocate_unconstructed(), destroy_deallocated() and
// pool_stats::destroyed.
//
// Order: options; the guarantee, deterministically (a reader pinned before the deallocate);
// destroy before reuse; deallocate_unconstructed(); destroy_deallocated(); destroy that uses
// its own pool, and destroy racing a fork(); the idle trim; destruction; concurrency.
//
// Conventions:
//   - The objects are gt::tracked: a canary written by the constructor and poisoned by the
//     destructor, which also counts the destruction per id in a gt::instance_tracker. The
//     hook runs ~tracked(), so "destroy ran exactly once" is each_destroyed_once(), and
//     memory whose canary still says alive holds an object destroy has not run on.
//   - The hook gets no context: what it counts beyond the tracker lives in globals that the
//     fixture resets. A tracker is declared before the domain and the pool, so it outlives
//     every thread that may still run destroy (the domain's worker, in a trim pass).
//   - A "quiet" domain (10 s drain interval, the maximum) never flushes retired work on a
//     timer: the pool's idle trim pass (which runs from a retire() callback) then never runs,
//     and destroy runs only inside the test's own pool calls.
//   - Sleeps only widen race windows or poll with a timeout; correctness assertions rest on
//     joins, flags, synchronize() and destroy_deallocated().
#include "grace/alloc/object_pool.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/alloc/object_pool_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace ga = grace::testing::alloc;
using namespace std::chrono_literals;
using ga::describe;
using ga::kHold;
using ga::kNoDeadlock;
using ga::quiet;
using ga::rejects;
using ga::small_magazines;

constexpr std::size_t kObjectSize = sizeof(gt::tracked);

// ---------------------------------------------------------------------------------------------
// The hooks.

// Calls of a hook on memory that held no live object: destroy run twice on one object, or
// on memory deallocated unconstructed. Relaxed (every counter of the hooks): tallies, read
// after the API under test (a join, destroy_deallocated(), the pool's destructor) ordered
// the hooks' calls before the read; that ordering is what the tests check.
std::atomic<std::uint64_t> destroyed_unbuilt{0};

// True iff `memory` holds a gt::tracked that has not been destroyed (its canary says alive).
bool holds_live_object(const void* memory) noexcept {
  return static_cast<const gt::tracked*>(memory)->intact();
}

gt::tracked* build(void* memory, gt::instance_tracker& tracker, std::size_t id) {
  return new (memory) gt::tracked(tracker, id);
}

// The pool's destroy hook for gt::tracked objects.
void destroy_tracked(void* object) noexcept {
  auto* t = static_cast<gt::tracked*>(object);
  if (!t->intact()) {
    destroyed_unbuilt.fetch_add(1, std::memory_order_relaxed);  // Relaxed: see above.
    return;
  }
  t->~tracked();
}

grace::pool_options destroying(grace::pool_options options = {}) {
  options.destroy = &destroy_tracked;
  return options;
}

class ObjectPoolDestroy : public ::testing::Test {
 protected:
  void SetUp() override {
    destroyed_unbuilt.store(0, std::memory_order_relaxed);  // Relaxed: no thread runs yet.
  }
  static std::uint64_t unbuilt() {
    return destroyed_unbuilt.load(std::memory_order_relaxed);  // Relaxed: see above.
  }
};

// ---------------------------------------------------------------------------------------------
// Options.

TEST_F(ObjectPoolDestroy, ADestroyHookWithoutReuseAfterAGracePeriodIsRejectedNamingDestroy) {
  grace::pool_options options = destroying();
  options.reuse_after_gp = false;
  EXPECT_TRUE(rejects(kObjectSize, options, "destroy"));
  // With reuse after a grace period (the default) the same hook is accepted.
  options.reuse_after_gp = true;
  grace::domain d(quiet());
  grace::object_pool pool(kObjectSize, options, d);
  EXPECT_EQ(pool.options().destroy, &destroy_tracked);
  EXPECT_EQ(pool.stats().destroyed, 0u);
}

// ---------------------------------------------------------------------------------------------
// The guarantee, deterministically: while a reader that pinned before the deallocate() is
// inside, no grace period can end, so destroy runs on nothing deallocated after it pinned.

TEST_F(ObjectPoolDestroy, DestroyWaitsForEveryReaderThatPinnedBeforeTheDeallocate) {
  // Pinned: every call meets the same CPU cache, whose slow paths would run destroy on any
  // object whose grace period had ended.
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  constexpr std::size_t kObjects = 2000;
  constexpr std::size_t kLater = 4 * kObjects;  // allocated and deallocated meanwhile
  gt::instance_tracker tracker(kObjects + kLater);
  grace::domain d(quiet());
  grace::pool_options options = destroying(small_magazines());
  options.caller_gp_threshold = 0;  // the test thread must never wait for the reader
  grace::object_pool pool(kObjectSize, options, d);
  std::vector<gt::tracked*> first(kObjects);
  for (std::size_t i = 0; i < kObjects; ++i) first[i] = build(pool.allocate(), tracker, i);

  // The reader pins, then, when asked, checks every object of `first` once more.
  enum stage : int { kStarting, kInside, kCheck, kChecked, kLeave };
  std::atomic<int> reader_stage{kStarting};
  std::atomic<std::uint64_t> seen_destroyed{0};
  auto wait_for = [&](int wanted) {
    // Acquire: what the other thread did before it moved the stage; pairs with the Release
    // stores below.
    while (reader_stage.load(std::memory_order_acquire) != wanted) {
      std::this_thread::sleep_for(1ms);
    }
  };
  std::thread reader([&] {
    auto g = grace::pin();
    // Release: the reader is inside; pairs with the Acquire load in wait_for().
    reader_stage.store(kInside, std::memory_order_release);
    wait_for(kCheck);
    std::uint64_t destroyed = 0;
    for (const gt::tracked* t : first) destroyed += !t->intact();
    seen_destroyed.store(destroyed, std::memory_order_relaxed);  // Relaxed: published below.
    // Release: seen_destroyed; pairs with the Acquire load in wait_for().
    reader_stage.store(kChecked, std::memory_order_release);
    wait_for(kLeave);
  });
  wait_for(kInside);

  for (gt::tracked* t : first) pool.deallocate(t);
  d.request_gp();  // a grace period may start, but cannot end while the reader is inside
  // Slow paths that would run destroy on every object whose grace period had ended.
  const std::unordered_set<void*> first_set(first.begin(), first.end());
  std::size_t early = 0;
  std::size_t alive_on_allocate = 0;
  std::vector<gt::tracked*> later;
  for (std::size_t i = 0; i < kLater; ++i) {
    void* p = pool.allocate();
    early += first_set.count(p);
    alive_on_allocate += holds_live_object(p);
    later.push_back(build(p, tracker, kObjects + i));
  }
  for (gt::tracked* t : later) pool.deallocate(t);
  std::this_thread::sleep_for(kHold);
  EXPECT_EQ(early, 0u) << "allocate() handed out an object deallocated after the reader pinned";
  EXPECT_EQ(alive_on_allocate, 0u);
  EXPECT_TRUE(tracker.none_destroyed(0, kObjects + kLater))
      << "destroy ran while a reader that pinned before the deallocate() was inside";
  EXPECT_EQ(pool.stats().destroyed, 0u) << describe(pool.stats());

  // destroy_deallocated(), on another thread, waits for the reader too.
  std::atomic<bool> destroy_returned{false};
  std::thread destroyer([&] {
    pool.destroy_deallocated();
    // Release: the destructions it waited for; pairs with the Acquire loads below.
    destroy_returned.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(kHold);
  // Acquire: pairs with the destroyer's Release store.
  EXPECT_FALSE(destroy_returned.load(std::memory_order_acquire))
      << "destroy_deallocated() returned while a reader from before the deallocates was inside";
  EXPECT_TRUE(tracker.none_destroyed(0, kObjects + kLater));

  // Release: pairs with the reader's Acquire load in wait_for().
  reader_stage.store(kCheck, std::memory_order_release);
  wait_for(kChecked);
  EXPECT_EQ(seen_destroyed.load(std::memory_order_relaxed), 0u)  // Relaxed: after kChecked.
      << "the reader saw objects destroyed inside its read section";
  // Release: pairs with the reader's Acquire load in wait_for().
  reader_stage.store(kLeave, std::memory_order_release);
  reader.join();
  {
    gt::watchdog dog(kNoDeadlock, "destroy_deallocated() after the reader left");
    destroyer.join();
  }
  EXPECT_TRUE(destroy_returned.load(std::memory_order_acquire));  // Acquire: as above.
  EXPECT_TRUE(tracker.each_destroyed_once(0, kObjects + kLater));
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_EQ(unbuilt(), 0u);
  EXPECT_EQ(pool.stats().destroyed, kObjects + kLater) << describe(pool.stats());
}

// ---------------------------------------------------------------------------------------------
// Destroy before reuse.

TEST_F(ObjectPoolDestroy, ObjectsComeBackFromAllocateAndAllocateBulkOnlyAfterDestroyRanOnThem) {
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  constexpr std::size_t kRounds = 40;
  constexpr std::size_t kPerRound = 300;
  gt::instance_tracker tracker(kRounds * kPerRound);
  grace::domain d(quiet());
  grace::pool_options options = destroying(small_magazines());
  options.caller_gp_threshold = 0;
  grace::object_pool pool(kObjectSize, options, d);
  std::unordered_set<void*> seen;
  std::size_t reuses = 0;
  std::size_t alive_on_allocate = 0;
  std::size_t id = 0;
  std::vector<void*> objects(kPerRound);
  for (std::size_t round = 0; round < kRounds; ++round) {
    const bool bulk = round % 2 == 1;  // single calls and bulk calls, in turn
    if (bulk) {
      pool.allocate_bulk(objects.data(), objects.size());
    } else {
      for (void*& p : objects) p = pool.allocate();
    }
    for (void* p : objects) {
      alive_on_allocate += holds_live_object(p);
      reuses += !seen.insert(p).second;
      build(p, tracker, id++);
    }
    if (bulk) {
      pool.deallocate_bulk(objects.data(), objects.size());
    } else {
      for (void* p : objects) pool.deallocate(p);
    }
    d.synchronize();  // the sealed magazines' grace periods end
  }
  EXPECT_EQ(alive_on_allocate, 0u)
      << "allocate() handed out memory that still held an object destroy had not run on";
  EXPECT_GT(reuses, 0u) << "nothing was reused, so the test proved nothing: "
                        << describe(pool.stats());
  EXPECT_GT(pool.stats().reused_after_gp, 0u);
  EXPECT_EQ(pool.stats().destroyed, tracker.destroyed()) << describe(pool.stats());
  EXPECT_EQ(tracker.corrupt_destructions(), 0u) << "destroy ran twice on an object";

  pool.destroy_deallocated();
  EXPECT_TRUE(tracker.each_destroyed_once(0, id));
  EXPECT_EQ(pool.stats().destroyed, id) << describe(pool.stats());
  EXPECT_EQ(unbuilt(), 0u);
}

// ---------------------------------------------------------------------------------------------
// deallocate_unconstructed().

TEST_F(ObjectPoolDestroy, DeallocateUnconstructedRunsNoDestroyAndHandsTheMemoryOutWithoutWaiting) {
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  grace::domain d(quiet());
  grace::pool_options options = destroying(small_magazines());
  options.caller_gp_threshold = 0;  // the test thread must never wait for the reader
  grace::object_pool pool(kObjectSize, options, d);
  {
    // No grace period can end while the reader is inside: memory that comes back meanwhile
    // came back without one.
    gt::guard_holder reader;
    reader.start();
    void* p = pool.allocate();
    std::memset(p, 0, kObjectSize);  // what a constructor that threw left behind
    pool.deallocate_unconstructed(p);
    std::vector<void*> taken;
    bool came_back = false;
    for (int i = 0; i < 1000 && !came_back; ++i) {
      taken.push_back(pool.allocate());
      came_back = taken.back() == p;
    }
    EXPECT_TRUE(came_back) << "memory deallocated unconstructed was not handed out again in "
                           << taken.size() << " allocations while a reader was inside";
    for (void* q : taken) pool.deallocate_unconstructed(q);  // they hold nothing either
    reader.release();
  }

  // Constructions that throw now and then, among ones that succeed.
  constexpr std::size_t kObjects = 3000;
  gt::instance_tracker tracker(kObjects);
  std::size_t built = 0;
  for (std::size_t i = 0; i < kObjects; ++i) {
    void* p = pool.allocate();
    if (i % 3 == 0) {
      std::memset(p, 0xa5, kObjectSize);
      pool.deallocate_unconstructed(p);
    } else {
      pool.deallocate(build(p, tracker, i));
      ++built;
    }
    if (i % 500 == 499) d.synchronize();
  }
  pool.destroy_deallocated();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < kObjects; ++i) {
    wrong += tracker.destroyed_count(i) != (i % 3 == 0 ? 0u : 1u);
  }
  EXPECT_EQ(wrong, 0u) << "objects not destroyed exactly once";
  EXPECT_EQ(unbuilt(), 0u) << "destroy ran on memory deallocated unconstructed";
  EXPECT_EQ(pool.stats().destroyed, built) << describe(pool.stats());
}

// ---------------------------------------------------------------------------------------------
// destroy_deallocated().

TEST_F(ObjectPoolDestroy, DestroyDeallocatedWithoutAHookWaitsForAGracePeriod) {
  grace::domain d(quiet());
  grace::object_pool pool(kObjectSize, {}, d);
  void* p = pool.allocate();
  ga::fill_object(p, kObjectSize, 0x5c);
  gt::guard_holder reader;
  reader.start();
  const std::uint64_t cookie = d.gp_cookie();
  pool.deallocate(p);
  std::atomic<bool> returned{false};
  std::thread caller([&] {
    pool.destroy_deallocated();
    // Release: pairs with the Acquire loads below.
    returned.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(kHold);
  // Acquire: pairs with the caller's Release store.
  EXPECT_FALSE(returned.load(std::memory_order_acquire))
      << "destroy_deallocated() returned while a reader from before the call was inside";
  reader.release();
  {
    gt::watchdog dog(kNoDeadlock, "destroy_deallocated() without a hook");
    caller.join();
  }
  EXPECT_TRUE(d.gp_elapsed(cookie));
  EXPECT_EQ(pool.stats().destroyed, 0u);
}

TEST_F(ObjectPoolDestroy, DestroyDeallocatedReturnsOnceEveryObjectItsThreadDeallocatedIsDestroyed) {
  // Four threads (the odd ones deallocate inside read guards) each deallocate a round of
  // objects and call destroy_deallocated(): every object of the round must be destroyed when
  // it returns, while the other threads keep deallocating.
  constexpr unsigned kThreads = 4;
  const std::size_t rounds = gt::iterations(100, 20);
  constexpr std::size_t kPerRound = 500;
  const std::size_t total = kThreads * rounds * kPerRound;
  gt::instance_tracker tracker(total);
  grace::domain d;
  grace::object_pool pool(kObjectSize, destroying(small_magazines()), d);
  std::atomic<std::uint64_t> not_yet_destroyed{0};
  std::atomic<std::uint64_t> rounds_with_misses{0};
  std::atomic<std::uint64_t> alive_on_allocate{0};
  gt::watchdog dog(kNoDeadlock, "threads calling destroy_deallocated()");
  gt::run_threads(kThreads, [&](unsigned index) {
    std::vector<void*> mine(kPerRound);
    std::uint64_t missed = 0;
    std::uint64_t missed_rounds = 0;
    std::uint64_t alive = 0;
    for (std::size_t round = 0; round < rounds; ++round) {
      const std::size_t base = (index * rounds + round) * kPerRound;
      for (std::size_t i = 0; i < kPerRound; ++i) {
        mine[i] = pool.allocate();
        alive += holds_live_object(mine[i]);
        build(mine[i], tracker, base + i);
      }
      if (index % 2 == 1) {
        auto g = grace::pin();
        for (void* p : mine) pool.deallocate(p);
      } else {
        for (void* p : mine) pool.deallocate(p);
      }
      pool.destroy_deallocated();
      std::uint64_t missed_now = 0;
      for (std::size_t i = 0; i < kPerRound; ++i) {
        missed_now += tracker.destroyed_count(base + i) == 0;
      }
      missed += missed_now;
      missed_rounds += missed_now != 0;
    }
    // Relaxed (both): tallies, read after run_threads() joined the threads.
    not_yet_destroyed.fetch_add(missed, std::memory_order_relaxed);
    rounds_with_misses.fetch_add(missed_rounds, std::memory_order_relaxed);
    alive_on_allocate.fetch_add(alive, std::memory_order_relaxed);
  });
  // Relaxed (both): joined.
  EXPECT_EQ(not_yet_destroyed.load(std::memory_order_relaxed), 0u)
      << "destroy_deallocated() returned before destroy ran on objects its thread deallocated, "
      << "in " << rounds_with_misses.load(std::memory_order_relaxed) << " of "
      << kThreads * rounds << " calls";
  EXPECT_EQ(alive_on_allocate.load(std::memory_order_relaxed), 0u);
  EXPECT_TRUE(tracker.each_destroyed_once(0, total));
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_EQ(unbuilt(), 0u);
  EXPECT_EQ(pool.stats().destroyed, total) << describe(pool.stats());
}

// ---------------------------------------------------------------------------------------------
// A destroy that uses its own pool.

// A list link whose destroy deallocates the next link (still constructed), after an
// allocation of its own that it gives back unconstructed.
struct chain_link {
  chain_link(gt::instance_tracker& tracker, std::size_t id, chain_link* next_link,
             grace::object_pool& owner) noexcept
      : tracked(tracker, id), next(next_link), pool(&owner) {}
  gt::tracked tracked;  // first: holds_live_object() reads its canary
  chain_link* next;
  grace::object_pool* pool;
};

void destroy_chain_link(void* object) noexcept {
  auto* link = static_cast<chain_link*>(object);
  if (!link->tracked.intact()) {
    destroyed_unbuilt.fetch_add(1, std::memory_order_relaxed);  // Relaxed: see above.
    return;
  }
  chain_link* next = link->next;
  grace::object_pool& pool = *link->pool;
  link->~chain_link();
  void* scratch = pool.allocate();
  pool.deallocate_unconstructed(scratch);
  pool.deallocate(next);  // nullptr at the end of the chain: ignored
}

TEST_F(ObjectPoolDestroy, ADestroyThatAllocatesAndDeallocatesFromItsOwnPoolRunsOnceOnEveryLink) {
  constexpr std::size_t kChains = 50;
  constexpr std::size_t kLinks = 40;
  constexpr std::size_t kTotal = kChains * kLinks;
  gt::instance_tracker tracker(kTotal);
  grace::domain d;
  grace::pool_options options = small_magazines();
  options.destroy = &destroy_chain_link;
  grace::object_pool pool(sizeof(chain_link), options, d);
  std::vector<chain_link*> heads;
  for (std::size_t c = 0; c < kChains; ++c) {
    chain_link* next = nullptr;
    for (std::size_t i = kLinks; i-- > 0;) {
      next = new (pool.allocate()) chain_link(tracker, c * kLinks + i, next, pool);
    }
    heads.push_back(next);
  }
  for (chain_link* head : heads) pool.deallocate(head);
  {
    // Each call destroys the links deallocated before it; their destroys deallocate the next
    // links, which a later call destroys.
    gt::watchdog dog(kNoDeadlock, "destroy_deallocated() with a destroy that uses the pool");
    for (std::size_t round = 0; round <= kLinks && tracker.destroyed() < kTotal; ++round) {
      pool.destroy_deallocated();
    }
  }
  EXPECT_TRUE(tracker.each_destroyed_once(0, kTotal));
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_EQ(unbuilt(), 0u);
  EXPECT_EQ(pool.stats().destroyed, kTotal) << describe(pool.stats());
}

// ---------------------------------------------------------------------------------------------
// destroy runs outside any cache hold: fork() holds every cache itself (waiting for the
// threads that hold one) in its prepare handler, so a destroy that waits for another
// thread's fork() to return would wait for ever under a cache hold. Here it waits at most
// kForkWait and records the timeout, so a destroy run under a hold fails the test instead of
// hanging it. The forking thread's child only _exit()s.
//
// The destroy hook waits only on the test thread (a thread_local flag), which holds no read
// section: a fork waits for a grace period in flight, which would wait for that section.
// Every byte of the pool and domain comes from gt::mapping_allocator (no malloc at the
// fork: see testing.h).
#if !GRACE_TESTING_TSAN  // the child starts threads (grace's fork handler restarts its domains'
                         // engines), which TSan kills
constexpr auto kForkWait = 5s;
std::atomic<int> fork_budget{0};         // forks the test thread's destroys may still wait for
std::atomic<int> forks_requested{0};
std::atomic<int> forks_returned{0};
std::atomic<int> forks_awaited{0};       // destroys that waited for a fork, timed out or not
std::atomic<int> fork_waits_timed_out{0};
thread_local bool waits_for_forks = false;

void destroy_waiting_for_a_fork(void* object) noexcept {
  // Relaxed: only the test thread (waits_for_forks) spends or sets the budget.
  if (waits_for_forks && fork_budget.load(std::memory_order_relaxed) > 0) {
    fork_budget.fetch_sub(1, std::memory_order_relaxed);
    // Relaxed: a ticket; the forker polls the count.
    const int ticket = forks_requested.fetch_add(1, std::memory_order_relaxed) + 1;
    const auto deadline = std::chrono::steady_clock::now() + kForkWait;
    // Acquire: the fork has returned; pairs with the forker's Release store.
    while (forks_returned.load(std::memory_order_acquire) < ticket) {
      if (std::chrono::steady_clock::now() >= deadline) {
        fork_waits_timed_out.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally.
        break;
      }
      std::this_thread::sleep_for(100us);
    }
    forks_awaited.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally, this thread's.
  }
  destroy_tracked(object);
}

TEST_F(ObjectPoolDestroy, ADestroyThatWaitsForAnotherThreadsForkIsNeverRunUnderACacheHold) {
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  constexpr std::size_t kPerRound = 200;
  constexpr std::size_t kRounds = 20;
  gt::instance_tracker tracker(kRounds * kPerRound + kPerRound);
  grace::domain_options domain_options = quiet();
  domain_options.allocator = gt::mapping_allocator;
  grace::domain d(domain_options);
  grace::pool_options options = small_magazines();
  options.destroy = &destroy_waiting_for_a_fork;
  options.allocator = gt::mapping_allocator;
  options.caller_gp_threshold = 0;
  grace::object_pool pool(kObjectSize, options, d);
  auto objects = std::make_unique<void*[]>(kPerRound);  // before the forker: no malloc after

  // Relaxed (all): no other thread runs yet.
  fork_budget.store(0, std::memory_order_relaxed);
  forks_requested.store(0, std::memory_order_relaxed);
  forks_returned.store(0, std::memory_order_relaxed);
  forks_awaited.store(0, std::memory_order_relaxed);
  fork_waits_timed_out.store(0, std::memory_order_relaxed);
  std::atomic<bool> stop{false};
  std::atomic<int> failed_children{0};
  std::thread forker([&] {
    int served = 0;
    // Relaxed (both): polled flags; the fork's own waits order what the test checks.
    while (!stop.load(std::memory_order_relaxed)) {
      if (forks_requested.load(std::memory_order_relaxed) > served) {
        const int status = gt::run_in_child([] { return 0; }, /*alarm_seconds=*/20);
        if (!gt::exited_cleanly(status)) {
          failed_children.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally.
        }
        // Release: the fork has returned; pairs with the hook's Acquire load.
        forks_returned.store(++served, std::memory_order_release);
      } else {
        std::this_thread::sleep_for(100us);
      }
    }
  });

  waits_for_forks = true;
  gt::watchdog dog(kNoDeadlock, "destroy waiting for another thread's fork()");
  std::size_t id = 0;
  auto allocate_round = [&] {
    for (std::size_t i = 0; i < kPerRound; ++i) {
      objects[i] = pool.allocate();
      build(objects[i], tracker, id++);
    }
  };
  // Destroys run by the slow paths of allocate() and deallocate(), once grace periods ended.
  fork_budget.store(3, std::memory_order_relaxed);  // Relaxed: this thread's own.
  for (std::size_t round = 0;
       round < kRounds && forks_awaited.load(std::memory_order_relaxed) < 3; ++round) {
    allocate_round();
    for (std::size_t i = 0; i < kPerRound; ++i) pool.deallocate(objects[i]);
    d.synchronize();
  }
  const int in_pool_calls = forks_awaited.load(std::memory_order_relaxed);  // Relaxed: ours.
  // Destroys run by destroy_deallocated().
  fork_budget.store(2, std::memory_order_relaxed);  // Relaxed: this thread's own.
  allocate_round();
  for (std::size_t i = 0; i < kPerRound; ++i) pool.deallocate(objects[i]);
  pool.destroy_deallocated();
  // Relaxed: this thread's own.
  const int in_destroy_deallocated = forks_awaited.load(std::memory_order_relaxed) - in_pool_calls;
  fork_budget.store(0, std::memory_order_relaxed);  // Relaxed: this thread's own.
  waits_for_forks = false;
  stop.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
  forker.join();

  // Relaxed (all): after the join.
  EXPECT_EQ(fork_waits_timed_out.load(std::memory_order_relaxed), 0)
      << "destroy waited " << kForkWait.count() << " s for a fork() that could not finish: "
      << "destroy ran while a cache of the pool was held";
  EXPECT_EQ(failed_children.load(std::memory_order_relaxed), 0);
  EXPECT_GT(in_pool_calls, 0) << "no destroy ran inside allocate() or deallocate()";
  EXPECT_GT(in_destroy_deallocated, 0) << "no destroy ran inside destroy_deallocated()";
  EXPECT_TRUE(tracker.each_destroyed_once(0, id));
  EXPECT_EQ(unbuilt(), 0u);
}
#endif

// ---------------------------------------------------------------------------------------------
// The idle trim.

TEST_F(ObjectPoolDestroy, ObjectsLeftWaitingInAnIdlePoolAreDestroyedWithoutFurtherCalls) {
  constexpr std::size_t kObjects = 5000;
  gt::instance_tracker tracker(kObjects);  // outlives the pool, whose trim pass counts in it
  grace::domain d;  // the default drain interval: the idle trim runs
  grace::object_pool pool(kObjectSize, destroying(), d);
  std::vector<void*> objects(kObjects);
  pool.allocate_bulk(objects.data(), objects.size());
  for (std::size_t i = 0; i < kObjects; ++i) build(objects[i], tracker, i);
  for (void* p : objects) pool.deallocate(p);
  // No pool call from here on: only the domain's worker (the idle trim) can run destroy.
  EXPECT_TRUE(gt::eventually([&] { return tracker.destroyed() == kObjects; }, 20s))
      << tracker.destroyed() << " of " << kObjects << " destroyed: " << describe(pool.stats());
  EXPECT_TRUE(tracker.each_destroyed_once(0, kObjects));
  EXPECT_EQ(pool.stats().destroyed, kObjects) << describe(pool.stats());
}

// ---------------------------------------------------------------------------------------------
// Destruction.

TEST_F(ObjectPoolDestroy, DestroyingThePoolDestroysExactlyTheObjectsDeallocatedAndNotYetDestroyed) {
  // Objects in every stage when the pool is destroyed: destroyed already, ready, waiting,
  // unsealed, retired by the magazine-less fallback, and still allocated (forgotten).
  gt::failing_allocator memory;
  constexpr std::size_t kObjects = 6000;
  constexpr std::size_t kDeallocated = 4000;  // ids [0, 4000); the rest stay allocated
  gt::instance_tracker tracker(kObjects);
  grace::domain d(quiet());
  {
    grace::pool_options options = destroying(small_magazines());
    options.allocator = memory.get();
    grace::object_pool pool(kObjectSize, options, d);
    std::vector<void*> objects(kObjects);
    pool.allocate_bulk(objects.data(), objects.size());
    for (std::size_t i = 0; i < kObjects; ++i) build(objects[i], tracker, i);
    for (std::size_t i = 0; i < 1000; ++i) pool.deallocate(objects[i]);
    pool.destroy_deallocated();
    EXPECT_TRUE(tracker.each_destroyed_once(0, 1000));
    for (std::size_t i = 1000; i < 3000; ++i) {
      pool.deallocate(objects[i]);
      if (i % 500 == 499) d.synchronize();
    }
    memory.fail_all(true);  // no magazines: the fallback takes these
    for (std::size_t i = 3000; i < 3900; ++i) pool.deallocate(objects[i]);
    memory.fail_all(false);
    for (std::size_t i = 3900; i < kDeallocated; ++i) pool.deallocate(objects[i]);
    EXPECT_LT(tracker.destroyed(), kDeallocated) << "nothing was left for the destructor";
    pool.forget_allocated();  // ids [4000, 6000): released with the pool, never destroyed
  }
  EXPECT_TRUE(tracker.each_destroyed_once(0, kDeallocated));
  EXPECT_TRUE(tracker.none_destroyed(kDeallocated, kObjects))
      << "the destructor ran destroy on objects still allocated";
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_EQ(unbuilt(), 0u);
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

TEST_F(ObjectPoolDestroy, DestroyingThePoolWaitsForAReaderBeforeDestroyingTheObjectItHolds) {
  // A reader that pinned before the deallocate() still reads the object while the pool is
  // destroyed: the destructor must run destroy only after the reader has left.
  gt::instance_tracker tracker(1);
  grace::domain d;
  auto pool = std::make_unique<grace::object_pool>(kObjectSize, destroying(), d);
  gt::tracked* object = build(pool->allocate(), tracker, 0);
  std::atomic<bool> reading{false};
  std::atomic<bool> reader_left{false};
  std::atomic<std::uint64_t> destroyed_while_read{0};
  std::thread reader([&] {
    {
      auto g = grace::pin();
      // Release: tells the main thread the reader is inside; pairs with its Acquire load.
      reading.store(true, std::memory_order_release);
      const auto until = std::chrono::steady_clock::now() + 4 * kHold;
      while (std::chrono::steady_clock::now() < until) {
        // Relaxed: a tally, read after the join.
        if (!object->intact()) destroyed_while_read.fetch_add(1, std::memory_order_relaxed);
      }
      // Release: set before the guard ends; pairs with the Acquire load after destruction.
      reader_left.store(true, std::memory_order_release);
    }
  });
  // Acquire: pairs with the reader's Release store.
  while (!reading.load(std::memory_order_acquire)) std::this_thread::yield();
  pool->deallocate(object);
  {
    gt::watchdog dog(kNoDeadlock, "destroying a pool while a reader is inside");
    pool.reset();
  }
  // Acquire: pairs with the reader's Release store before its guard ended.
  EXPECT_TRUE(reader_left.load(std::memory_order_acquire))
      << "the pool was destroyed while a reader of one of its objects was still inside";
  reader.join();
  EXPECT_EQ(destroyed_while_read.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
  EXPECT_TRUE(tracker.each_destroyed_once(0, 1));
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

TEST_F(ObjectPoolDestroy, ThreadsChurningInsideAndOutsideGuardsGetOnlyDestroyedObjectsOnce) {
  // Three churners (the odd one inside read guards) allocate, construct, publish, bulk- and
  // single-deallocate; churner 0 calls destroy_deallocated() now and then; a reader checks
  // published objects inside its read sections. Every allocate goes through a reuse_oracle
  // and must return memory destroy ran on; every object must be destroyed exactly once.
  constexpr unsigned kChurners = 3;
  constexpr std::size_t kSlots = 16;
  constexpr std::size_t kMaxHeld = 300;
  const std::size_t operations = gt::iterations(500'000);
  gt::instance_tracker tracker(kChurners * operations);  // at most one allocate per step
  grace::domain d;
  grace::pool_options options = destroying(small_magazines());
  options.caller_gp_threshold = 256;  // churners run grace periods themselves, often
  grace::object_pool pool(kObjectSize, options, d);
  ga::reuse_oracle oracle(d);
  std::atomic<std::size_t> next_id{0};
  std::array<std::atomic<gt::tracked*>, kSlots> published{};
  std::atomic<unsigned> churners_left{kChurners};
  std::atomic<std::uint64_t> alive_on_allocate{0};
  std::atomic<std::uint64_t> destroyed_while_held{0};
  std::atomic<std::uint64_t> destroyed_while_read{0};
  std::atomic<std::uint64_t> read_sections{0};

  gt::watchdog dog(kNoDeadlock, "churn with a destroy hook");
  gt::run_threads(kChurners + 1, [&](unsigned index) {
    if (index == kChurners) {  // the reader
      std::array<const gt::tracked*, kSlots> seen{};
      std::uint64_t bad = 0;
      std::uint64_t sections = 0;
      // Acquire: pairs with the churners' Release decrements (ends the loop after them).
      while (churners_left.load(std::memory_order_acquire) != 0) {
        auto g = grace::pin();
        for (std::size_t s = 0; s < kSlots; ++s) {
          // Acquire: the object's construction; pairs with the AcqRel exchange that
          // published it.
          seen[s] = published[s].load(std::memory_order_acquire);
        }
        for (int pass = 0; pass < 16; ++pass) {
          for (const gt::tracked* t : seen) bad += t != nullptr && !t->intact();
        }
        ++sections;
      }
      // Relaxed (both): tallies, read after the join.
      destroyed_while_read.fetch_add(bad, std::memory_order_relaxed);
      read_sections.fetch_add(sections, std::memory_order_relaxed);
      return;
    }
    ga::random_source random(index + 1);
    std::vector<gt::tracked*> held;
    held.reserve(kMaxHeld + 8);
    std::uint64_t alive = 0;
    std::uint64_t destroyed = 0;
    bool growing = true;
    auto take_out = [&](std::size_t i) {
      gt::tracked* t = held[i];
      held[i] = held.back();
      held.pop_back();
      destroyed += !t->intact();
      return t;
    };
    auto give_back = [&](gt::tracked* t) {
      oracle.on_deallocate(t);
      pool.deallocate(t);
    };
    auto step = [&](std::size_t done) {
      if (held.size() >= kMaxHeld) growing = false;
      if (held.empty()) growing = true;
      const std::size_t roll = random.below(64);
      if (roll == 0 && !held.empty()) {  // publish; readers may hold the one it replaces
        gt::tracked* mine = take_out(random.below(held.size()));
        // AcqRel: Release publishes the object's construction to readers (pairs with their
        // Acquire load); Acquire takes the previous occupant with its writes.
        gt::tracked* old =
            published[random.below(kSlots)].exchange(mine, std::memory_order_acq_rel);
        if (old != nullptr) {
          destroyed += !old->intact();
          give_back(old);
        }
        return;
      }
      if (roll == 1 && held.size() >= 8) {  // a bulk deallocation
        std::array<void*, 8> batch;
        for (void*& p : batch) {
          p = take_out(random.below(held.size()));
          oracle.on_deallocate(p);
        }
        pool.deallocate_bulk(batch.data(), batch.size());
        return;
      }
      if (index == 0 && done % 4096 == 4095) {  // churner 0 never holds a guard
        pool.destroy_deallocated();
        return;
      }
      const bool allocate_now = held.empty() || (growing ? roll < 48 : roll < 16);
      if (allocate_now) {
        void* p = pool.allocate();
        oracle.on_allocate(p);
        alive += holds_live_object(p);
        // Relaxed: a unique id; nothing is published through it.
        held.push_back(build(p, tracker, next_id.fetch_add(1, std::memory_order_relaxed)));
      } else {
        give_back(take_out(random.below(held.size())));
      }
    };
    const bool inside_guards = index % 2 == 1;
    for (std::size_t done = 0; done < operations;) {
      if (inside_guards) {
        auto g = grace::pin();
        for (int i = 0; i < 32 && done < operations; ++i, ++done) step(done);
      } else {
        step(done++);
      }
    }
    while (!held.empty()) give_back(take_out(held.size() - 1));
    // Relaxed (both): tallies, read after the join.
    alive_on_allocate.fetch_add(alive, std::memory_order_relaxed);
    destroyed_while_held.fetch_add(destroyed, std::memory_order_relaxed);
    // Release: this churner is done; pairs with the reader's Acquire load.
    churners_left.fetch_sub(1, std::memory_order_release);
  });
  for (std::atomic<gt::tracked*>& slot : published) {
    // Relaxed: every thread was joined.
    if (gt::tracked* t = slot.exchange(nullptr, std::memory_order_relaxed)) {
      oracle.on_deallocate(t);
      pool.deallocate(t);
    }
  }
  pool.destroy_deallocated();

  // Relaxed (all): every thread was joined.
  const std::size_t ids = next_id.load(std::memory_order_relaxed);
  EXPECT_TRUE(oracle.clean());
  EXPECT_EQ(alive_on_allocate.load(std::memory_order_relaxed), 0u)
      << "allocate() returned memory that still held an object destroy had not run on";
  EXPECT_EQ(destroyed_while_held.load(std::memory_order_relaxed), 0u)
      << "destroy ran on objects their thread still held";
  EXPECT_EQ(destroyed_while_read.load(std::memory_order_relaxed), 0u)
      << "a reader saw a published object destroyed inside its read section";
  EXPECT_GT(read_sections.load(std::memory_order_relaxed), 0u);
  EXPECT_GT(oracle.reuses(), ids / 4) << "too little reuse to prove anything";
  EXPECT_TRUE(tracker.each_destroyed_once(0, ids));
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_EQ(unbuilt(), 0u);
  const grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.destroyed, ids) << describe(s);
  EXPECT_EQ(s.allocated, ids) << describe(s);
  EXPECT_EQ(s.deallocated, ids) << describe(s);
}

}  // namespace
