// Tests of grace::object_pool's restartable-sequence fast paths (pool_options::
// restartable_sequences; invariants (P8), (P9) and (A8) in grace/alloc/detail/magazine.h):
// whether a pool uses them; that a hold taken from another CPU stops that CPU's sequences
// for as long as it lasts (the fence); and that objects, the grace-period guarantee and the
// counts stay right while more threads than CPUs run them (so that the kernel restarts
// sequences) and another thread takes every cache from outside (stats()); and that the
// per-CPU add (rseq_add) adds exactly once or reports its restart.
//
// Conventions: as in object_pool_test.cc. Internals (the two kinds of hold) are reached
// through grace::object_pool_test_access.
#include <gtest/gtest.h>
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/rseq.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "grace/alloc/detail/rseq_fast_path.h"
#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "tests/alloc/object_pool_testing.h"
#include "tests/testing/testing.h"

namespace grace {

// A hold of a cache as every holder starts it (take_fast(); a slow path's take_cache() adds
// the settling of counts to it), and what a sequence commits.
struct object_pool_test_access {
  static bool hold(object_pool& pool, unsigned cache) {
    return pool.take_fast(pool.caches_[cache], cache);
  }
  static void release(object_pool& pool, unsigned cache) {
    pool.end_fast_hold(pool.caches_[cache]);
  }
  // What deallocate() does after finding cache `home` held.
  static void deallocate_after_contention(object_pool& pool, unsigned home, void* object) {
    pool.deallocate_contended_slow(home, object);
  }
  // The words a sequence on this cache commits to (its magazines' count and pushed), and
  // the magazines themselves; read by the cache's holder.
  static std::array<std::uint64_t, 4> committed(object_pool& pool, unsigned cache) {
    const detail::pool_cache& c = pool.caches_[cache];
    auto words = [](detail::magazine* m) -> std::uint64_t {
      if (m == nullptr) return 0;
      // Relaxed: a change here is what the test looks for (a sequence racing the hold).
      return std::uint64_t{std::atomic_ref<std::uint32_t>(m->count).load(
                 std::memory_order_relaxed)} |
             std::uint64_t{std::atomic_ref<std::uint32_t>(m->pushed).load(
                 std::memory_order_relaxed)}
                 << 32;
    };
    return {reinterpret_cast<std::uintptr_t>(c.loaded), words(c.loaded),
            reinterpret_cast<std::uintptr_t>(c.freed), words(c.freed)};
  }
};

}  // namespace grace

namespace {

namespace ga = grace::testing::alloc;
namespace gt = grace::testing;

// Whether the kernel runs this thread's rseq area, read from what it writes there: once the
// area is registered, the kernel keeps the thread's CPU in cpu_id; glibc leaves
// RSEQ_CPU_ID_REGISTRATION_FAILED (-2) there when it registered none (its tunable
// glibc.pthread.rseq=0, or a kernel without rseq). Not __rseq_size, which the code under
// test reads.
bool kernel_runs_this_threads_rseq_area() {
  const auto* area = reinterpret_cast<const volatile struct rseq*>(
      static_cast<const char*>(__builtin_thread_pointer()) + __rseq_offset);
  return static_cast<std::int32_t>(area->cpu_id) >= 0;
}

// Whether this process runs with glibc's rseq registration turned off (CTest's
// glibc_rseq_off.* cases).
bool glibc_told_not_to_register_rseq() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr &&
         std::string_view(tunables).find("glibc.pthread.rseq=0") != std::string_view::npos;
}

// Whether the kernel has the rseq system call: a call with no area fails with EINVAL there
// (ENOSYS where it has none), and registers nothing.
bool kernel_has_rseq() {
  return syscall(__NR_rseq, nullptr, 0, 0, 0) == -1 && errno == EINVAL;
}

// The oracle the tests below use must tell the two CTest runs of this file apart, or the
// glibc_rseq_off.* run would silently repeat the other.
TEST(ObjectPoolRseq, TheKernelRunsAnRseqAreaExactlyWhenGlibcMayRegisterOne) {
  EXPECT_EQ(kernel_runs_this_threads_rseq_area(),
            kernel_has_rseq() && !glibc_told_not_to_register_rseq());
}

// What rseq_add() needs, asked of the machine directly: no membarrier fence.
bool machine_offers_per_cpu_adds() {
  return GRACE_POOL_RSEQ && kernel_runs_this_threads_rseq_area();
}

// What the pool should decide, asked of the machine directly.
bool machine_offers_restartable_sequences() {
  if (!machine_offers_per_cpu_adds()) return false;
  const long commands = syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  return commands > 0 && (commands & MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ) != 0 &&
         syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0) == 0;
}

TEST(ObjectPoolRseq, APoolUsesRestartableSequencesExactlyWhereTheMachineOffersThem) {
  grace::domain d(ga::quiet());
  grace::object_pool pool(64, {}, d);
  EXPECT_EQ(pool.uses_restartable_sequences(), machine_offers_restartable_sequences());
  grace::pool_options off;
  off.restartable_sequences = false;
  grace::object_pool without(64, off, d);
  EXPECT_FALSE(without.uses_restartable_sequences());
}

// The adders of the test below. Restarts come from signals and preemptions that land inside
// a sequence, and an unoptimized or AddressSanitizer build spends so little of its time
// there (a few restarts a second here, where -O2 sees hundreds; ASan took 20-26 s for 200,
// near the deadline, with both CPUs busy all the while) that it settles for fewer.
constexpr int kAddShift = 6;
#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__)
constexpr std::uint64_t kWantedRestarts = 200;
#else
constexpr std::uint64_t kWantedRestarts = 20;
#endif
struct alignas(64) adder_totals {
  std::int64_t attempted = 0;  // every delta passed to rseq_add()
  std::int64_t restarted = 0;  // the deltas of the calls that returned false
  std::uint64_t calls = 0;
  std::atomic<std::uint64_t> restarts{0};  // Relaxed: a progress count, and read after join
};
void add_until(const std::atomic<bool>& stop, std::int64_t* first_word, unsigned slots,
               adder_totals& mine) {
  // Relaxed: a stop request; the results are read after join().
  for (std::int64_t i = 1; !stop.load(std::memory_order_relaxed); ++i) {
    // Both signs, many magnitudes; bounded, so that no total can overflow.
    const std::int64_t delta = (i % 3 == 0 ? -1 : 1) * (i % 1021 + 1);
    mine.attempted += delta;
    ++mine.calls;
    if (!grace::detail::rseq_add<kAddShift>(first_word, slots, delta)) {
      mine.restarted += delta;
      mine.restarts.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

// rseq_add(), the per-CPU add the map counts its elements with: threads that do nothing but
// add, moved between CPUs and signalled by this thread all the time, so that the kernel
// restarts sequences, until kWantedRestarts were restarted. Each thread adds what a
// restarted sequence did not add to a total of its own (as the map does, with an atomic
// add): the per-CPU words and those totals must sum to every add made. A sequence that
// committed in part, or reported a restart after its add, would break the sum. Where the
// build or glibc offers no restartable sequences, every add reports that it did nothing.
TEST(ObjectPoolRseq, APerCpuAddTheKernelRestartsAddsNothingAndSaysSo) {
  const bool offered = machine_offers_per_cpu_adds();
  EXPECT_EQ(grace::detail::per_cpu_adds_available(), offered);
  struct alignas(64) word {
    std::int64_t value = 0;
  };
  static_assert(sizeof(word) == std::size_t{1} << kAddShift);
  const unsigned slots = grace::detail::cpu_shard_count();
  std::vector<word> words(slots);
  constexpr unsigned kThreads = 3;
  gt::cpu_disturber disturber;
  std::array<adder_totals, kThreads> totals;
  std::atomic<bool> stop{false};
  std::vector<std::thread> adders;
  for (unsigned t = 0; t < kThreads; ++t) {
    adders.emplace_back([&, t] { add_until(stop, &words[0].value, slots, totals[t]); });
  }
  auto restarts_so_far = [&] {
    std::uint64_t sum = 0;
    for (const adder_totals& each : totals) sum += each.restarts.load(std::memory_order_relaxed);
    return sum;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (restarts_so_far() < kWantedRestarts && std::chrono::steady_clock::now() < deadline) {
    disturber.disturb(adders);
    std::this_thread::yield();
  }
  stop.store(true, std::memory_order_relaxed);
  for (std::thread& adder : adders) adder.join();
  std::int64_t in_words = 0;
  for (const word& w : words) in_words += w.value;
  std::int64_t attempted = 0;
  std::int64_t restarted = 0;
  std::uint64_t calls = 0;
  for (const adder_totals& each : totals) {
    attempted += each.attempted;
    restarted += each.restarted;
    calls += each.calls;
  }
  const std::uint64_t restarts = restarts_so_far();
  EXPECT_GE(restarts, kWantedRestarts) << "too few restarts within 30 s to prove anything";
  if (offered) {
    EXPECT_LT(restarts, calls) << "no sequence committed";
  } else {
    EXPECT_EQ(restarts, calls);
  }
  EXPECT_EQ(in_words + restarted, attempted)
      << restarts << " restarts of " << calls << " adds; per-CPU words " << in_words
      << ", restarted adds " << restarted;
}

// A thread pinned to one CPU allocates and deallocates without pause (without
// reuse_after_gp, so that every operation is a sequence on that CPU's cache), while this
// thread, pinned to another CPU, holds that cache again and again, each time reading the
// words a sequence commits, spinning, and reading them again. A sequence that got past its
// check of `held` before the hold and committed during it would change them; the fence
// (A8) restarts it instead.
// With the fence removed, every run of three failed.
TEST(ObjectPoolRseq, NoFastPathOnTheCachesCpuCommitsWhileAnotherCpuHoldsIt) {
  const gt::saved_affinity restore;
  const std::array<int, 2> two = gt::two_cpus_with_their_own_shards();
  // Where there is only one CPU, the same one for both: a weaker check.
  const int only = std::max(sched_getcpu(), 0);
  const int victim = two[0] >= 0 ? two[0] : only;
  const int holder = two[0] >= 0 ? two[1] : only;
  grace::domain d(ga::quiet());
  grace::pool_options options;
  options.reuse_after_gp = false;
  grace::object_pool pool(64, options, d);
  std::atomic<bool> started{false};
  std::atomic<bool> stop{false};
  std::uint64_t churned = 0;
  std::thread churner([&] {
    EXPECT_TRUE(gt::pin_to_cpu(victim));
    started.store(true, std::memory_order_relaxed);
    while (!stop.load(std::memory_order_relaxed)) {
      void* a = pool.allocate();
      void* b = pool.allocate();
      pool.deallocate(b);
      pool.deallocate(a);
      churned += 4;
    }
  });
  ASSERT_TRUE(gt::pin_to_cpu(holder));
  while (!started.load(std::memory_order_relaxed)) std::this_thread::yield();
  using access = grace::object_pool_test_access;
  const unsigned cache = static_cast<unsigned>(victim) & (grace::detail::cpu_shard_count() - 1);
  // Holds, not attempts, are what can catch a sequence: a hold fails while the churner's
  // own fallback holds the cache.
  const std::size_t holds = gt::iterations(10'000);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::size_t taken = 0;
  std::size_t changed = 0;
  while (taken < holds && std::chrono::steady_clock::now() < deadline) {
    if (!access::hold(pool, cache)) continue;
    ++taken;
    const auto before = access::committed(pool, cache);
    for (int spin = 0; spin < 2000; ++spin) __builtin_ia32_pause();
    if (access::committed(pool, cache) != before) ++changed;
    access::release(pool, cache);
    for (int spin = 0; spin < 2000; ++spin) __builtin_ia32_pause();
  }
  stop.store(true, std::memory_order_relaxed);
  churner.join();
  EXPECT_EQ(taken, holds) << "the churner kept the cache for a minute";
  EXPECT_GT(churned, 0u);
  EXPECT_EQ(changed, 0u) << "of " << taken << " holds of CPU " << victim << "'s cache from CPU "
                         << holder << ", while its thread ran " << churned << " operations";
}

// A free that found its CPU's cache held yields to the holder, and then, once the hold is
// over, takes that cache again even when the push needs the slow path (its `freed` magazine
// full): it seals the magazine there. Going on to another CPU's cache instead would cost that
// CPU a fence and leave the object in a magazine that is not the freeing CPU's. Without
// restartable sequences the free goes to another cache at once (the held path's contract:
// its CPU's cache was just found held), or to retire() where there is no other cache.
// With the home cache skipped after the yield, the first version failed: the object went
// into the next cache's magazine.
TEST(ObjectPoolRseq, AFreeThatFoundItsCpusCacheHeldSealsItsFullMagazineThereOnceFree) {
  const gt::saved_affinity restore;
  const std::array<int, 2> two = gt::two_cpus_with_their_own_shards();
  const int home_cpu = two[0] >= 0 ? two[0] : std::max(sched_getcpu(), 0);
  ASSERT_TRUE(gt::pin_to_cpu(home_cpu));
  const unsigned caches = grace::detail::cpu_shard_count();
  const unsigned home = static_cast<unsigned>(home_cpu) & (caches - 1);
  using access = grace::object_pool_test_access;
  // A cache's freed magazine and its count, read under a hold (the domain's trim pass may
  // hold it too; committed() is {loaded, its words, freed, its words}).
  auto freed_of = [](grace::object_pool& pool, unsigned cache) {
    while (!access::hold(pool, cache)) std::this_thread::yield();
    const auto words = access::committed(pool, cache);
    access::release(pool, cache);
    return std::pair{words[2], words[3] & 0xffffffff};
  };
  grace::domain d(ga::quiet());
  for (const bool restartable : {true, false}) {
    grace::pool_options options = ga::small_magazines();
    options.restartable_sequences = restartable;
    grace::object_pool pool(64, options, d);
    std::array<void*, 8> filled{};  // small_magazines(): a magazine holds 8
    for (void*& object : filled) object = pool.allocate();
    void* extra = pool.allocate();
    for (void* object : filled) pool.deallocate(object);
    const auto [full_magazine, full_count] = freed_of(pool, home);
    ASSERT_EQ(full_count, 8u) << "home's freed magazine is full";

    access::deallocate_after_contention(pool, home, extra);

    const auto [home_magazine, home_count] = freed_of(pool, home);
    if (pool.uses_restartable_sequences()) {
      EXPECT_NE(home_magazine, full_magazine) << "the full magazine was sealed";
      EXPECT_EQ(home_count, 1u) << "the free went to a new magazine at home";
      for (unsigned other = 0; other < caches; ++other) {
        if (other == home) continue;
        EXPECT_EQ(freed_of(pool, other).first, 0u) << "cache " << other << " got the object";
      }
    } else {
      EXPECT_EQ(home_magazine, full_magazine) << "the held path looks elsewhere at once";
      EXPECT_EQ(home_count, 8u);
      if (caches > 1) {
        EXPECT_EQ(freed_of(pool, (home + 1) & (caches - 1)).second, 1u)
            << "the next cache took the object";
      }
    }
    pool.destroy_deallocated();
  }
}

// Threads that churn the pool (checked by the reuse oracle) while one more thread calls
// stats() in a loop: each call takes every cache nobody holds, from whatever CPU it runs on.
class ObjectPoolRseqChurn : public ::testing::TestWithParam<bool> {};

TEST_P(ObjectPoolRseqChurn, ObjectsAndCountsStayExactWhileAnotherThreadTakesEveryCache) {
  grace::domain d(ga::quiet());
  grace::pool_options options = ga::small_magazines();
  options.restartable_sequences = GetParam();
  grace::object_pool pool(64, options, d);
  ga::reuse_oracle oracle(d);
  std::atomic<bool> stop{false};
  std::uint64_t looks = 0;
  std::thread outsider([&] {
    // Paced: each look may cost an IPI per CPU, which would otherwise be all the test does.
    for (; !stop.load(std::memory_order_relaxed); ++looks) {
      (void)pool.stats();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  const ga::churn_totals totals =
      ga::churn(pool, oracle,
                {.threads = 4, .operations = gt::iterations(600'000),
                 .guards = ga::guards::odd_threads});
  stop.store(true, std::memory_order_relaxed);
  outsider.join();
  EXPECT_GT(looks, 0u);
  EXPECT_TRUE(ga::churn_accounted(pool, oracle, totals));
}

INSTANTIATE_TEST_SUITE_P(BothFastPaths, ObjectPoolRseqChurn, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "restartable" : "held";
                         });

}  // namespace
