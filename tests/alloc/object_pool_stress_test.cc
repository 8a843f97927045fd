// Stress tests for grace::object_pool (CTest label `stress`): long mixed churn checked by
// the reuse oracle, allocation failures switched on and off under concurrency,
// producer-consumer memory flatness over tens of seconds, and chunks emptied by two threads
// at once.
//
// Conventions: as in object_pool_test.cc. Each test runs for a bounded time (the whole file
// stays under ~40 s in the plain build on two cores); iteration budgets are smaller under
// sanitizers; sleeps only pace the failure toggler and the samplers.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
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
  // deallocation, on three object sizes and watermark sets.
  struct config {
    std::size_t object_size;
    grace::pool_options options;
  };
  grace::pool_options small;
  small.low_watermark = 2;
  small.high_watermark = 8;
  small.batch = 4;
  small.magazine_capacity = 4;
  small.caller_gp_threshold = 256;
  // Refills of 4 into magazines that deallocate() fills to 12: magazines of every count
  // move between the caches and the depot.
  grace::pool_options uneven = small;
  uneven.magazine_capacity = 12;
  for (const config& c : {config{64, {}}, config{200, small}, config{96, uneven}}) {
    SCOPED_TRACE("object_size " + std::to_string(c.object_size));
    grace::domain d;
    grace::object_pool pool(c.object_size, c.options, d);
    ga::reuse_oracle oracle(d);
    gt::watchdog dog(200s, "mixed churn");
    const ga::churn_totals totals =
        ga::churn(pool, oracle,
                  {.threads = 6, .operations = stress_iterations(500'000),
                   .guards = ga::guards::odd_threads, .max_held = 2000});
    EXPECT_TRUE(ga::churn_accounted(pool, oracle, totals));
  }
}

// The chunk lock's holder dawdles (a yield on every 7th hold, 200 us on every 101st, through
// the detail::chunk_lock_held_hook test seam): other threads' releases are deferred to it
// (P6), holders drain several passes, and the idle trim takes what is left. Objects whose
// slots were freed are handed out again from the bitmaps: the oracle fails any object handed
// out twice or before its grace period, churn() any object whose bytes changed while held,
// and once everything is deallocated the chunks must go back (nothing stranded).
std::atomic<std::uint64_t> dawdling_holds{0};

void dawdle_while_holding_the_chunk_lock() {
  // Relaxed: a tally.
  const std::uint64_t n = dawdling_holds.fetch_add(1, std::memory_order_relaxed);
  if (n % 7 == 0) std::this_thread::yield();
  if (n % 101 == 0) std::this_thread::sleep_for(200us);
}

TEST(ObjectPoolStress, ReleasesDeferredToASlowChunkLockHolderAreNeitherLostNorHandedOutTwice) {
  grace::pool_options tiny;  // every few frees reach the chunks
  tiny.low_watermark = 0;
  tiny.high_watermark = 4;
  tiny.batch = 4;
  tiny.magazine_capacity = 4;
  tiny.caller_gp_threshold = 0;
  // Relaxed: set before the pools' threads start.
  grace::detail::chunk_lock_held_hook.store(&dawdle_while_holding_the_chunk_lock,
                                            std::memory_order_relaxed);
  struct unhook {
    ~unhook() { grace::detail::chunk_lock_held_hook.store(nullptr, std::memory_order_relaxed); }
  } unhooked_at_exit;
  // 8 bytes: the deferral link fills the slot; 24: slots straddle ASan granules; 1024: 63 a
  // chunk, so chunks empty and go back often.
  for (const std::size_t object_size : {std::size_t{8}, std::size_t{24}, std::size_t{1024}}) {
    SCOPED_TRACE("object_size " + std::to_string(object_size));
    grace::pool_options options = tiny;
    options.alignment = 8;
    grace::domain d;
    grace::object_pool pool(object_size, options, d);
    ga::reuse_oracle oracle(d);
    gt::watchdog dog(200s, "churn with a slow chunk lock holder");
    const std::uint64_t holds_before = dawdling_holds.load(std::memory_order_relaxed);
    const ga::churn_totals totals =
        ga::churn(pool, oracle,
                  {.threads = 6, .operations = stress_iterations(150'000),
                   .guards = ga::guards::odd_threads, .max_held = 300});
    // Not churn_accounted(): with these watermarks most objects go back to their chunks, and
    // whole chunks back to the system, so few allocations meet an address again.
    EXPECT_TRUE(oracle.clean());
    EXPECT_EQ(totals.corrupted, 0u);
    EXPECT_EQ(totals.allocated, totals.deallocated);
    grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, totals.allocated) << describe(s);
    EXPECT_EQ(s.deallocated, totals.deallocated) << describe(s);
    EXPECT_GT(dawdling_holds.load(std::memory_order_relaxed), holds_before + 1000)
        << "the chunk lock was hardly taken";
    EXPECT_GT(s.reused_from_chunks, 0u) << describe(s);
    // With every object deallocated, the idle trim sheds the caches and empties the depot,
    // and every chunk goes back but the few the caches' watermarks keep and the ones being
    // cut: none may stay pinned by releases left on a deferred stack.
    const std::size_t bound = 3 * grace::detail::cpu_shard_count();
    EXPECT_TRUE(gt::eventually(
        [&] {
          s = pool.stats();
          return s.chunks <= bound;
        },
        10s))
        << "chunks stayed held (bound " << bound << "): " << describe(s);
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
    options.magazine_capacity = 8;
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
// Flatness bound: no sample after warm-up exceeds 2 x the warm-up sample + 8 MiB, and the
// last RSS sample is at most the warm-up RSS + 32 MiB (plain builds only: ASan's quarantine
// keeps freed memory resident). A leak at the producers' pace (~1M objects/s) would add
// tens of MiB per second. (1.5 x + 4 MiB was crossed by momentary spikes of chunks held by
// fragmentation on a loaded CI machine, 8.5 vs 8.4 MiB, with the end below warm-up + 1 MiB.)
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
      ga::produce_until(stop, pool, queues[index], static_cast<unsigned char>(index * 100));
    } else if (index < 4) {  // consumers
      const ga::consumed c = ga::consume_until(stop, pool, queues[index - 2]);
      // Relaxed (both): tallies, read after the join.
      corrupted.fetch_add(c.corrupted, std::memory_order_relaxed);
      moved.fetch_add(c.objects, std::memory_order_relaxed);
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
      // Release: ends the producers' and consumers' loops; pairs with the Acquire loads in
      // produce_until() and consume_until().
      stop.store(true, std::memory_order_release);
    }
  });
  for (auto& queue : queues) ga::deallocate_rest(pool, queue);
  // Relaxed: joined.
  EXPECT_EQ(corrupted.load(std::memory_order_relaxed), 0u);
  EXPECT_GT(moved.load(std::memory_order_relaxed), 100'000u);
  const std::uint64_t bound = warm.held_bytes * 2 + (std::uint64_t{8} << 20);
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


// ---------------------------------------------------------------------------------------------
// Chunks emptied by two threads at once.

constexpr std::size_t kChunkBytes = std::size_t{64} << 10;      // object_pool.h: 64 KiB chunks
constexpr std::size_t kLargestObject = grace::object_pool::max_object_size;  // 3 a chunk

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsanBuild = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kTsanBuild = true;
#else
constexpr bool kTsanBuild = false;
#endif
#else
constexpr bool kTsanBuild = false;
#endif

// A grace::system_allocator under which touching a chunk after the pool gave it back is
// caught, not silently read. Chunks (the 64 KiB-aligned requests) are mappings of their own;
// one given back is replaced at once by an inaccessible reservation and stays so while the
// next kQuarantine chunks are given back, so a late access faults (plain and asan builds).
// Under ThreadSanitizer chunks come from aligned_alloc() and go back through free(), with no
// lock of ours in between: TSan then reports any access to a chunk that is not ordered
// before the free() that gives it back, however the threads happened to interleave.
// Everything else (magazines, records) comes from malloc.
class quarantine_allocator {
 public:
  quarantine_allocator() = default;
  quarantine_allocator(const quarantine_allocator&) = delete;
  quarantine_allocator& operator=(const quarantine_allocator&) = delete;
  ~quarantine_allocator() {
    for (void* chunk : quarantine_) ::munmap(chunk, kChunkBytes);
  }

  grace::system_allocator get() noexcept { return {&allocate, &deallocate, this}; }
  // Relaxed: a tally, read after the threads that gave chunks back were joined.
  std::uint64_t chunks_given_back() const noexcept {
    return given_back_.load(std::memory_order_relaxed);
  }

 private:
  static constexpr std::size_t kQuarantine = 4096;

  static bool is_chunk(std::size_t bytes, std::size_t alignment) noexcept {
    return bytes == kChunkBytes && alignment == kChunkBytes;
  }

  static void* allocate(std::size_t bytes, std::size_t alignment, void*) noexcept {
    if (!is_chunk(bytes, alignment)) {
      return grace::system_allocator::malloc_allocate(bytes, alignment, nullptr);
    }
    if (kTsanBuild) return std::aligned_alloc(alignment, bytes);
    void* mapped = ::mmap(nullptr, 2 * kChunkBytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return nullptr;
    const auto start = reinterpret_cast<std::uintptr_t>(mapped);
    const std::uintptr_t chunk = (start + kChunkBytes - 1) & ~std::uintptr_t{kChunkBytes - 1};
    if (chunk != start) ::munmap(mapped, chunk - start);
    if (chunk != start + kChunkBytes) {
      ::munmap(reinterpret_cast<void*>(chunk + kChunkBytes), start + kChunkBytes - chunk);
    }
    return reinterpret_cast<void*>(chunk);
  }

  static void deallocate(void* memory, std::size_t bytes, void* context) noexcept {
    auto* self = static_cast<quarantine_allocator*>(context);
    if (!is_chunk(bytes, kChunkBytes)) {
      grace::system_allocator::malloc_deallocate(memory, bytes, nullptr);
      return;
    }
    // Relaxed: a tally, read after the join (and no order between the threads, which would
    // hide the race from TSan).
    self->given_back_.fetch_add(1, std::memory_order_relaxed);
    if (kTsanBuild) {
      std::free(memory);
      return;
    }
    // The pages go; the addresses stay reserved and inaccessible.
    ::mmap(memory, kChunkBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
           -1, 0);
    std::lock_guard lock(self->mutex_);
    self->quarantine_.push_back(memory);
    if (self->quarantine_.size() > kQuarantine) {
      ::munmap(self->quarantine_.front(), kChunkBytes);
      self->quarantine_.pop_front();
    }
  }

  std::mutex mutex_;
  std::deque<void*> quarantine_;
  std::atomic<std::uint64_t> given_back_{0};
};

TEST(ObjectPoolStress, AThreadReleasingToAChunkNeverTouchesItAfterAnotherThreadFreedIt) {
  // Two threads on two CPUs (two caches) deallocate alternate objects of the same 4-object
  // chunks at once, in address order. The pool keeps nothing (reuse_after_gp off, watermarks
  // of 1, the depot full after the first few), so each deallocate() releases an object to its
  // chunk on the spot, and a chunk's last two releases come from the two threads at nearly
  // the same time. The one that releases last frees the chunk at once; the other must not
  // touch the chunk after its own release (no read of the chunk's header), or it reads
  // memory that is gone: a fault here (plain, asan), or a race report under TSan. In plain
  // and asan builds this is probabilistic (the non-last releaser must be preempted between
  // its release and such a read); under TSan every such read is reported.
  const std::array<int, 2> cpus = gt::two_cpus_with_their_own_shards();
  if (cpus[0] < 0) GTEST_SKIP() << "needs two CPUs with different pool caches";
  quarantine_allocator memory;
  std::uint64_t rounds = 0;
  {
    grace::domain_options quiet;
    quiet.drain_interval = 10s;  // no timed flush: the pool's trim pass never runs
    grace::domain d(quiet);
    grace::pool_options options;
    options.low_watermark = 1;
    options.high_watermark = 1;
    options.batch = 1;
    options.magazine_capacity = 1;
    options.reuse_after_gp = false;  // released at deallocate(): the race is in the release
    options.gp_request_threshold = 1;
    options.caller_gp_threshold = 0;
    options.allocator = memory.get();
    grace::object_pool pool(kLargestObject, options, d);
    std::vector<void*> objects(2048);  // 512 chunks a round
    std::array<std::vector<void*>, 2> halves;
    const auto end = std::chrono::steady_clock::now() + (gt::kSanitized ? 2s : 4s);
    do {
      pool.allocate_bulk(objects.data(), objects.size());
      // Neighbours in address order share a chunk; alternate ones go to the two threads.
      std::sort(objects.begin(), objects.end());
      halves[0].clear();
      halves[1].clear();
      for (std::size_t i = 0; i < objects.size(); ++i) halves[i % 2].push_back(objects[i]);
      gt::run_threads(2, [&](unsigned index) {
        // Each thread on its own CPU, so each takes its own cache: nothing but the chunk's
        // counter orders their releases.
        EXPECT_TRUE(gt::pin_to_cpu(cpus[index]));
        for (void* object : halves[index]) pool.deallocate(object);
      });
      ++rounds;
    } while (std::chrono::steady_clock::now() < end);
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
  }
  // Each round empties most of its 512 chunks while both threads release: the test ran what
  // it is about.
  EXPECT_GT(memory.chunks_given_back(), rounds * 256) << rounds << " rounds";
}

}  // namespace
