// grace::object_pool across fork(): a cache that a thread of the parent held at the copy must
// not stay held in the child (alloc/src/object_pool.cc, "fork()").
//
// Fork conventions as in tests/map/hash_map_fork_test.cc: the child runs a function whose
// int result is its exit code (0 = passed; each failure prints a line and has its own code)
// and ends with _exit(); alarm() turns a hang in the child into SIGALRM. The threads that
// run at the forks take every byte from gt::mapping_allocator (no malloc: see testing.h) and
// are running, not starting, at the first fork.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <latch>
#include <memory>
#include <thread>

#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 120s;  // watchdog budget for the parent
constexpr std::size_t kObjectSize = 64;

#if !GRACE_TESTING_TSAN  // the child starts threads (its domain's engine), which TSan kills
// Two threads of the parent allocate and deallocate all the time (one in rounds of its own,
// one freeing what the other hands it), so that at most forks one or both hold a cache.
// Before fork() took every cache itself, a cache held at the copy stayed held in the child:
// with both held, each allocate() and deallocate() of the child took the all-caches-held
// fallback (a yield, a chunk or a grace period per object) and 6 of 60 children ran for more
// than 20 s. Each child now allocates, checks and frees 400,000 objects, in single calls and
// in bulk, in a fraction of a second, well inside its alarm.
TEST(ObjectPoolFork, ChildrenForkedWhileOtherThreadsHoldCachesUseThePoolAtFullSpeed) {
  grace::domain d({.allocator = gt::mapping_allocator});
  grace::pool_options options;
  options.allocator = gt::mapping_allocator;
  grace::object_pool pool(kObjectSize, options, d);

  constexpr std::size_t kRing = 4096;  // producer -> consumer, single-producer single-consumer
  auto ring = std::make_unique<std::atomic<void*>[]>(kRing);
  std::atomic<std::uint64_t> produced{0};
  std::atomic<std::uint64_t> consumed{0};
  std::atomic<bool> stop{false};
  std::latch running(2);
  std::thread producer([&] {
    constexpr std::size_t kRound = 3000;
    auto mine = std::make_unique<void*[]>(kRound);  // before the first fork: no malloc after
    running.count_down();
    // Relaxed: a stop flag.
    while (!stop.load(std::memory_order_relaxed)) {
      for (std::size_t i = 0; i < kRound; ++i) {
        mine[i] = pool.allocate();
        std::memset(mine[i], 0xA5, kObjectSize);
      }
      for (std::size_t i = 0; i < kRound; ++i) pool.deallocate(mine[i]);
      for (int i = 0; i < 1000; ++i) {
        // Relaxed: this thread's own counter; Acquire: the consumer has taken the slot.
        const std::uint64_t p = produced.load(std::memory_order_relaxed);
        if (p - consumed.load(std::memory_order_acquire) == kRing) break;
        void* object = pool.allocate();
        std::memset(object, 0x5A, kObjectSize);
        ring[p % kRing].store(object, std::memory_order_relaxed);  // published below
        // Release: the slot's object before the count that hands it over.
        produced.store(p + 1, std::memory_order_release);
      }
    }
  });
  std::thread consumer([&] {
    running.count_down();
    // Relaxed: a stop flag and this thread's own counter.
    while (!stop.load(std::memory_order_relaxed)) {
      const std::uint64_t c = consumed.load(std::memory_order_relaxed);
      // Acquire: the producer's slot; pairs with its Release store.
      if (c == produced.load(std::memory_order_acquire)) {
        std::this_thread::yield();
        continue;
      }
      void* object = ring[c % kRing].load(std::memory_order_relaxed);
      // Release: the slot is free again; pairs with the producer's Acquire load.
      consumed.store(c + 1, std::memory_order_release);
      pool.deallocate(object);
    }
  });
  running.wait();

  gt::fork_at_random_moments(
      static_cast<int>(gt::iterations(20, 6)), std::chrono::microseconds(5000),
      /*alarm_seconds=*/20, kNoDeadlock, "forks while two threads use a pool", [&] {
        constexpr std::size_t kBatch = 20'000;
        auto objects = std::make_unique<void*[]>(kBatch);
        for (int round = 0; round < 20; ++round) {
          // Each object carries its index: one handed out twice would carry another's.
          for (std::size_t k = 0; k < kBatch; ++k) {
            objects[k] = pool.allocate();
            std::memcpy(objects[k], &k, sizeof k);
          }
          for (std::size_t k = 0; k < kBatch; ++k) {
            std::size_t seen;
            std::memcpy(&seen, objects[k], sizeof seen);
            if (seen != k) return gt::child_failure(40, "an object was handed out twice", k);
            pool.deallocate(objects[k]);
          }
          pool.allocate_bulk(objects.get(), 512);
          pool.deallocate_bulk(objects.get(), 512);
        }
        // The parent's threads had objects out at the copy: not a usage error here.
        pool.forget_allocated();
        return 0;
      });
  stop.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
  producer.join();
  consumer.join();
  // Relaxed (both): after the joins.
  for (std::uint64_t c = consumed.load(std::memory_order_relaxed);
       c != produced.load(std::memory_order_relaxed); ++c) {
    pool.deallocate(ring[c % kRing].load(std::memory_order_relaxed));
  }
}
#endif

#if !GRACE_TESTING_TSAN  // the child starts threads (its domain's engine), which TSan kills
// Every cache of the pool is held at the fork, by threads parked inside the pool's
// system_allocator (which the pool calls under the hold, to cut a magazine): without the
// fork's own holds, the copy kept them all held and every deallocate() of the child went to
// the domain as a retire(). A parked thread waits until the child says it exists, or 1 s: a
// fork that waits for the holds gets them then. poll() on a pipe: no malloc at the fork.
std::atomic<int> park_budget{0};  // Relaxed (all): a counter the threads race for
std::atomic<int> parked{0};
unsigned park_caches = 0;  // set before the threads start
int child_exists_pipe[2];

thread_local bool parked_here = false;  // a thread parks once, then runs on

void* map_pages_parking(std::size_t bytes, std::size_t alignment, void* context) noexcept {
  if (parked_here) return gt::mapping_allocator.allocate(bytes, alignment, context);
  int budget = park_budget.load(std::memory_order_relaxed);
  while (budget > 0 && !park_budget.compare_exchange_weak(budget, budget - 1,
                                                          std::memory_order_relaxed)) {
  }
  if (budget > 0) {
    parked_here = true;
    parked.fetch_add(1, std::memory_order_relaxed);
    // The 1 s counts from the last park: until then every cache must stay held.
    while (parked.load(std::memory_order_relaxed) < static_cast<int>(park_caches)) {
      std::this_thread::sleep_for(1ms);
    }
    pollfd child_exists{child_exists_pipe[0], POLLIN, 0};
    (void)::poll(&child_exists, 1, 1000);
  }
  return gt::mapping_allocator.allocate(bytes, alignment, context);
}

TEST(ObjectPoolFork, TheChildFindsNoCacheHeldWhenEveryCacheWasHeldAtTheFork) {
  ASSERT_EQ(::pipe(child_exists_pipe), 0);
  grace::domain d({.allocator = gt::mapping_allocator});
  grace::pool_options options;
  options.allocator = {&map_pages_parking, gt::mapping_allocator.deallocate, nullptr};
  grace::object_pool pool(kObjectSize, options, d);
  const unsigned caches = grace::detail::cpu_shard_count();
  park_caches = caches;
  park_budget.store(static_cast<int>(caches), std::memory_order_relaxed);
  std::atomic<bool> stop{false};
  auto holders = std::make_unique<std::thread[]>(caches);
  {
    gt::watchdog dog(kNoDeadlock, "threads parking in the pool's allocator");
    for (unsigned k = 0; k < caches; ++k) {
      // Each takes a cache no parked thread holds (its own, or another through the
      // contended path) and parks in its first allocator call.
      holders[k] = std::thread([&] {
        void* object = pool.allocate();
        // Relaxed: a stop flag.
        while (!stop.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
        pool.deallocate(object);
      });
      // Relaxed: polled.
      while (parked.load(std::memory_order_relaxed) < static_cast<int>(k + 1)) {
        std::this_thread::sleep_for(1ms);
      }
    }
  }
  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while every cache is held");
    status = gt::run_in_child([&] {
      (void)!::write(child_exists_pipe[1], "x", 1);
      d.barrier();
      const std::uint64_t reclaimed_before = d.stats().reclaimed;
      constexpr std::size_t kPairs = 10'000;
      auto objects = std::make_unique<void*[]>(kPairs);
      for (std::size_t k = 0; k < kPairs; ++k) objects[k] = pool.allocate();
      for (std::size_t k = 0; k < kPairs; ++k) pool.deallocate(objects[k]);
      d.barrier();
      // Through the caches, the objects wait in magazines; with every cache held, each
      // deallocate() is a retire() of its own.
      const std::uint64_t retired = d.stats().reclaimed - reclaimed_before;
      if (retired > kPairs / 4) {
        return gt::child_failure(41, "deallocate() found every cache held", retired);
      }
      pool.forget_allocated();  // the parked threads' objects
      return 0;
    });
  }
  stop.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
  for (unsigned k = 0; k < caches; ++k) holders[k].join();
  ::close(child_exists_pipe[0]);
  ::close(child_exists_pipe[1]);
  EXPECT_TRUE(gt::exited_cleanly(status));
}

// A pool constructed inside a read section while another thread forks: the fork waits for
// that read section (a grace period in flight waits for it), so the constructor must never
// wait for the fork. It did, for a version that registered pools under a mutex the fork
// held.
TEST(ObjectPoolFork, APoolConstructedInsideAReadSectionDuringAForkDoesNotDeadlockIt) {
  grace::domain d({.allocator = gt::mapping_allocator});
  { auto g = d.pin(); }  // this thread is registered
  // A pool exists before the fork, so the fork has pools to hold.
  grace::object_pool first_pool(kObjectSize, grace::pool_options{}, d);
  std::atomic<bool> forking{false};
  std::atomic<bool> forked{false};
  std::atomic<bool> constructed{false};
  std::atomic<bool> reader_inside{false};
  std::unique_ptr<grace::object_pool> late_pool;
  // Relaxed, all four: polled flags that only pace the threads; the fork's own waits and
  // the joins order everything the test checks. Neither thread ends (and frees its state)
  // before the fork is over: under ASan no thread may be inside malloc at the copy.
  auto wait_for_the_fork = [&] {
    while (!forked.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
  };
  std::thread reader([&] {
    {
      auto g = d.pin();
      reader_inside.store(true, std::memory_order_relaxed);
      while (!forking.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(50ms);  // well inside fork()'s prepare handler
      late_pool = std::make_unique<grace::object_pool>(kObjectSize, grace::pool_options{}, d);
      constructed.store(true, std::memory_order_relaxed);
    }
    wait_for_the_fork();
  });
  while (!reader_inside.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
  std::thread syncer([&] {
    d.synchronize();  // waits for the reader
    wait_for_the_fork();
  });
  std::this_thread::sleep_for(50ms);  // the synchronize() is in flight
  int status = -1;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while a reader constructs a pool");
    forking.store(true, std::memory_order_relaxed);
    status = gt::run_in_child([] { return 0; });
    forked.store(true, std::memory_order_relaxed);
    syncer.join();
    reader.join();
  }
  EXPECT_TRUE(gt::exited_cleanly(status));
  EXPECT_TRUE(constructed.load(std::memory_order_relaxed));
  void* object = late_pool->allocate();
  late_pool->deallocate(object);
  late_pool.reset();
}
#endif

#if !GRACE_TESTING_TSAN  // the child restarts the domain's engine threads, as above
// A pool of the parent's still counts on its domain in the child, where no thread may own it
// any more: destroying the domain there aborts, and the message names the fork case. The
// death test's process forks; its child destroys the domain, and the parent aborts too once
// the child has died, so that the message the child printed decides the test.
TEST(ObjectPoolFork, DestroyingTheDomainInAChildWhileAPoolOfTheParentExistsAbortsSayingSo) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto d = std::make_unique<grace::domain>();
        grace::object_pool pool(kObjectSize, grace::pool_options{}, *d);
        pool.deallocate(pool.allocate());
        (void)gt::run_in_child([&] {
          d.reset();
          return 0;
        });
        std::abort();
      },
      "destroyed while 1 object pool\\(s\\) built on it still exist .*in a fork\\(\\) child, "
      "pools of the parent's threads count too");
}
#endif

}  // namespace
