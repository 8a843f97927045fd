// Stress tests for grace::object_pool (CTest label `stress`): long mixed churn checked by
// the reuse oracle, allocation failures switched on and off under concurrency, and
// producer-consumer memory flatness over tens of seconds.
//
// Conventions: as in object_pool_test.cc. Each test runs for a bounded time (the whole file
// stays under ~40 s in the plain build on two cores); iteration budgets are smaller under
// sanitizers; sleeps only pace the failure toggler and the samplers.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/alloc/object_pool_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace ga = grace::testing::alloc;
using namespace std::chrono_literals;
using ga::describe;

// This file has time to spare under sanitizers: half the plain budget rather than
// gt::iterations()'s eighth (the asan preset's -O2 build runs this code about as fast as the
// -O0 debug build, so its runs stay as long and as meaningful).
std::size_t stress_iterations(std::size_t plain) {
  return gt::kSanitized ? plain / 2 : plain;
}

TEST(ObjectPoolStress, ManyThreadsNeverReuseBeforeAGracePeriodUnderMixedLoad) {
  // Six threads, half of them inside read guards, single and bulk calls and cross-thread
  // deallocation, on two object sizes and watermark sets.
  struct config {
    std::size_t object_size;
    grace::pool_options options;
  };
  grace::pool_options small;
  small.low_watermark = 2;
  small.high_watermark = 8;
  small.batch = 4;
  small.caller_gp_threshold = 256;
  for (const config& c : {config{64, {}}, config{200, small}}) {
    SCOPED_TRACE("object_size " + std::to_string(c.object_size));
    grace::domain d;
    grace::object_pool pool(c.object_size, c.options, d);
    ga::reuse_oracle oracle(d);
    gt::watchdog dog(200s, "mixed churn");
    const ga::churn_totals totals =
        ga::churn(pool, oracle,
                  {.threads = 6, .operations = stress_iterations(500'000),
                   .guards = ga::guards::odd_threads, .max_held = 2000});
    EXPECT_TRUE(oracle.clean());
    EXPECT_EQ(totals.corrupted, 0u);
    EXPECT_EQ(totals.allocated, totals.deallocated);
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, totals.allocated) << describe(s);
    EXPECT_EQ(s.deallocated, totals.deallocated) << describe(s);
    EXPECT_GT(oracle.reuses(), totals.allocated / 4) << describe(s);
  }
}

TEST(ObjectPoolStress, AllocationFailuresSwitchedOnAndOffUnderConcurrencyLoseNothing) {
  // Four threads churn while a fifth switches every system allocation's failure on and off;
  // allocate() throws std::bad_alloc at times, deallocate() falls back to retiring objects.
  // At the end: no early reuse, every object accounted for, every byte returned.
  gt::failing_allocator memory;
  std::uint64_t bad_allocs_total = 0;
  {
    grace::domain d;
    grace::pool_options options;
    options.low_watermark = 4;
    options.high_watermark = 16;
    options.batch = 8;
    options.allocator = memory.get();
    grace::object_pool pool(96, options, d);
    ga::reuse_oracle oracle(d);
    const std::size_t operations = stress_iterations(400'000);
    std::atomic<unsigned> running{4};
    std::atomic<std::uint64_t> bad_allocs{0};
    std::atomic<std::uint64_t> corrupted{0};
    gt::run_threads(5, [&](unsigned index) {
      if (index == 4) {  // the toggler
        // Acquire: pairs with the Release decrement of each worker as it finishes.
        for (int i = 0; running.load(std::memory_order_acquire) != 0; ++i) {
          memory.fail_all(i % 4 == 0);  // failing a quarter of the time
          std::this_thread::sleep_for(1ms);
        }
        memory.fail_all(false);
        return;
      }
      ga::random_source random(index + 101);
      std::vector<void*> held;
      std::vector<void*> bulk(40);
      std::uint64_t failures = 0;
      std::uint64_t bad = 0;
      auto take = [&](void* p) {
        oracle.on_allocate(p);
        ga::fill_object(p, 96, static_cast<unsigned char>(held.size()));
        held.push_back(p);
      };
      auto give_back = [&](std::size_t at) {
        void* p = held[at];
        held[at] = held.back();
        held.pop_back();
        bad += !ga::object_intact(p, 96);
        oracle.on_deallocate(p);
        pool.deallocate(p);
      };
      for (std::size_t n = 0; n < operations; ++n) {
        auto guard = index % 2 == 1 ? std::make_unique<grace::read_guard>() : nullptr;
        const std::size_t roll = random.below(16);
        try {
          if (roll == 0) {
            const std::size_t k = random.below(bulk.size());
            pool.allocate_bulk(bulk.data(), k);
            for (std::size_t i = 0; i < k; ++i) take(bulk[i]);
          } else if (roll < 8 || held.empty()) {
            if (held.size() < 3000) take(pool.allocate());
          } else {
            give_back(random.below(held.size()));
          }
        } catch (const std::bad_alloc&) {
          ++failures;
        }
      }
      while (!held.empty()) give_back(held.size() - 1);
      // Relaxed (both): tallies, read after the join.
      bad_allocs.fetch_add(failures, std::memory_order_relaxed);
      corrupted.fetch_add(bad, std::memory_order_relaxed);
      // Release: this worker is done with the allocator; pairs with the toggler's Acquire.
      running.fetch_sub(1, std::memory_order_release);
    });
    EXPECT_TRUE(oracle.clean());
    // Relaxed: joined.
    EXPECT_EQ(corrupted.load(std::memory_order_relaxed), 0u);
    bad_allocs_total = bad_allocs.load(std::memory_order_relaxed);
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
    EXPECT_GT(memory.failures(), 0u);
  }
  EXPECT_GT(bad_allocs_total, 0u) << "no failure surfaced: the test did not test anything";
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

// Two producers allocate and fill objects, two consumers check and deallocate them, for
// ~15 s. held_bytes is sampled after 2 s (warm-up), then every second.
// Flatness bound: no sample after warm-up exceeds 1.5 x the warm-up sample + 4 MiB, and the
// last RSS sample is at most the warm-up RSS + 32 MiB (plain builds only: ASan's quarantine
// keeps freed memory resident). A leak at the producers' pace (~1M objects/s) would add
// tens of MiB per second.
TEST(ObjectPoolStress, ProducersAndConsumersKeepMemoryFlatForFifteenSeconds) {
  constexpr std::size_t kBytes = 96;
  const auto run = 15s;
  grace::domain d;
  grace::object_pool pool(kBytes, {}, d);
  ga::spsc_ring<4096> queues[2];
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> corrupted{0};
  std::atomic<std::uint64_t> moved{0};
  grace::pool_stats warm;
  std::size_t rss_warm = 0;
  std::size_t rss_end = 0;
  std::vector<grace::pool_stats> samples;
  gt::run_threads(5, [&](unsigned index) {
    if (index < 2) {  // producers
      ga::spsc_ring<4096>& queue = queues[index];
      unsigned char value = static_cast<unsigned char>(index * 100);
      // Acquire: pairs with the Release store of `stop` by the sampler.
      while (!stop.load(std::memory_order_acquire)) {
        void* p = pool.allocate();
        ga::fill_object(p, kBytes, ++value);
        while (!queue.push(p)) {
          // Acquire: as above.
          if (stop.load(std::memory_order_acquire)) {
            pool.deallocate(p);
            return;
          }
          std::this_thread::yield();
        }
      }
    } else if (index < 4) {  // consumers
      ga::spsc_ring<4096>& queue = queues[index - 2];
      std::uint64_t n = 0;
      std::uint64_t bad = 0;
      void* p = nullptr;
      // Acquire: pairs with the Release store of `stop` by the sampler.
      while (!stop.load(std::memory_order_acquire)) {
        if (!queue.pop(p)) {
          std::this_thread::yield();
          continue;
        }
        bad += !ga::object_intact(p, kBytes);
        pool.deallocate(p);
        ++n;
      }
      // Relaxed (both): tallies, read after the join.
      corrupted.fetch_add(bad, std::memory_order_relaxed);
      moved.fetch_add(n, std::memory_order_relaxed);
    } else {  // sampler
      std::this_thread::sleep_for(2s);
      warm = pool.stats();
      rss_warm = gt::current_rss_bytes();
      const auto end = std::chrono::steady_clock::now() + (run - 2s);
      while (std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(1s);
        samples.push_back(pool.stats());
      }
      rss_end = gt::current_rss_bytes();
      // Release: ends the producers' and consumers' loops; pairs with their Acquire loads.
      stop.store(true, std::memory_order_release);
    }
  });
  void* p = nullptr;
  for (auto& queue : queues) {
    while (queue.pop(p)) pool.deallocate(p);
  }
  // Relaxed: joined.
  EXPECT_EQ(corrupted.load(std::memory_order_relaxed), 0u);
  EXPECT_GT(moved.load(std::memory_order_relaxed), 100'000u);
  const std::uint64_t bound = warm.held_bytes * 3 / 2 + (std::uint64_t{4} << 20);
  for (std::size_t i = 0; i < samples.size(); ++i) {
    EXPECT_LE(samples[i].held_bytes, bound)
        << "second " << i + 3 << ": " << describe(samples[i]) << "\nwarm-up: " << describe(warm);
  }
  if (!gt::kSanitized) {
    EXPECT_LE(rss_end, rss_warm + (std::size_t{32} << 20))
        << "RSS after warm-up " << rss_warm << ", at the end " << rss_end;
  }
  const grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
  // Relaxed (below): joined.
  std::printf("producer-consumer: moved %llu objects; held after warm-up %llu, at the end %llu "
              "bytes; peak %llu; RSS %zu -> %zu\n",
              static_cast<unsigned long long>(moved.load(std::memory_order_relaxed)),
              static_cast<unsigned long long>(warm.held_bytes),
              static_cast<unsigned long long>(samples.empty() ? 0 : samples.back().held_bytes),
              static_cast<unsigned long long>(s.peak_held_bytes), rss_warm, rss_end);
}

}  // namespace
