// grace::object_pool over minutes: one thread allocates, another deallocates, and the memory
// the pool holds stays flat. Registered only in the plain debug preset (tests/alloc/
// CMakeLists.txt), like the map's 2-minute soak: it takes two minutes, and under a sanitizer
// the process's memory is the sanitizer's.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "tests/alloc/object_pool_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace ga = grace::testing::alloc;
namespace gt = grace::testing;
using namespace std::chrono_literals;

constexpr auto kRun = 120s;
constexpr auto kWarmUp = 10s;
constexpr auto kSampleEvery = 1s;
constexpr std::size_t kMiB = std::size_t{1} << 20;

struct sample {
  std::size_t held_bytes;
  std::size_t rss_bytes;
};

double mean_held(const std::vector<sample>& samples, std::size_t begin, std::size_t end) {
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) sum += static_cast<double>(samples[i].held_bytes);
  return sum / static_cast<double>(end - begin);
}
double mean_rss(const std::vector<sample>& samples, std::size_t begin, std::size_t end) {
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) sum += static_cast<double>(samples[i].rss_bytes);
  return sum / static_cast<double>(end - begin);
}

TEST(ObjectPoolMinutes, MemoryStaysFlatForTwoMinutesWhileOneThreadAllocatesAndAnotherFrees) {
  grace::domain d;
  grace::object_pool pool(64, {}, d);
  ga::spsc_ring<4096> queue;
  std::atomic<bool> stop{false};
  ga::consumed totals;
  std::vector<sample> samples;  // one per second after the warm-up
  grace::pool_stats after_warmup;
  gt::run_threads(3, [&](unsigned index) {
    if (index == 0) {
      ga::produce_until(stop, pool, queue, 0);
    } else if (index == 1) {
      totals = ga::consume_until(stop, pool, queue);
    } else {
      std::this_thread::sleep_for(kWarmUp);
      after_warmup = pool.stats();
      const auto end = std::chrono::steady_clock::now() + (kRun - kWarmUp);
      while (std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(kSampleEvery);
        samples.push_back({pool.stats().held_bytes, gt::current_rss_bytes()});
      }
      // Release: ends the producer's and consumer's loops; pairs with the Acquire loads in
      // produce_until() and consume_until().
      stop.store(true, std::memory_order_release);
    }
  });
  ga::deallocate_rest(pool, queue);

  EXPECT_EQ(totals.corrupted, 0u) << "an object changed while it was handed over";
  EXPECT_GT(totals.objects, 1'000'000u) << "two minutes moved almost nothing";
  const grace::pool_stats end_stats = pool.stats();
  EXPECT_GT(end_stats.reused_after_gp, after_warmup.reused_after_gp)
      << "the consumer's objects never came back to the producer";
  ASSERT_GE(samples.size(), 40u) << "the sampler fell behind";

  // A trend, not a ceiling: a leak grows the last quarter's average over the first's, while
  // spikes from a late grace period come and go.
  const std::size_t quarter = samples.size() / 4;
  const double first_held = mean_held(samples, 0, quarter);
  const double last_held = mean_held(samples, samples.size() - quarter, samples.size());
  EXPECT_LE(last_held, first_held * 1.25 + 2.0 * kMiB)
      << "the pool's memory grew: first quarter " << first_held / kMiB << " MiB, last "
      << last_held / kMiB << " MiB";
  const double first_rss = mean_rss(samples, 0, quarter);
  const double last_rss = mean_rss(samples, samples.size() - quarter, samples.size());
  EXPECT_LE(last_rss, first_rss + 16.0 * kMiB)
      << "RSS grew: first quarter " << first_rss / kMiB << " MiB, last " << last_rss / kMiB
      << " MiB";
  // Spikes stay bounded too: no sample far above what the first quarter needed.
  std::size_t first_peak = 0;
  for (std::size_t i = 0; i < quarter; ++i) {
    first_peak = std::max(first_peak, samples[i].held_bytes);
  }
  std::size_t peak = 0;
  for (const sample& s : samples) peak = std::max(peak, s.held_bytes);
  EXPECT_LE(peak, 4 * first_peak + 16 * kMiB)
      << "a spike: " << peak / kMiB << " MiB against a first-quarter peak of "
      << first_peak / kMiB << " MiB";
  std::printf("moved %llu objects; held: first quarter %.1f MiB, last %.1f MiB, peak %.1f MiB; "
              "RSS %.1f -> %.1f MiB\n",
              static_cast<unsigned long long>(totals.objects), first_held / kMiB,
              last_held / kMiB, static_cast<double>(peak) / kMiB, first_rss / kMiB,
              last_rss / kMiB);
}

}  // namespace
