// Stress tests for grace::domain (CTest label `stress`): safety under concurrent readers and
// writers, exactly-once reclamation under contention, and the pending-memory bound during a
// retire flood. Iteration budgets shrink under sanitizers (grace::testing::iterations).
//
// Safety harness: readers pin, load a node from a shared slot and re-read its canary and id
// many times; writers swap a fresh node into a slot, take d.gp_cookie() right after the
// unlink and retire the old node. The deleter checks that the cookie has elapsed, and the
// node's destructor checks and then poisons the canary. A reader that finds a poisoned canary
// (or a changed id, or, under ASan, freed memory) has seen an object reclaimed while it held
// the guard under which it loaded it.
#include "grace/reclaim/domain.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "grace/reclaim/read_guard.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
using namespace std::chrono_literals;

constexpr std::size_t kCapacity = grace::detail::kRetireBlockCapacity;
constexpr auto kNoDeadlock = 120s;

// ---------------------------------------------------------------------------------------------
// Safety harness.

struct node {
  node(gt::instance_tracker& tracker, std::size_t id, grace::domain& d)
      : payload(tracker, id), domain(&d) {}
  gt::tracked payload;
  grace::domain* domain;
  std::uint64_t cookie = 0;  // d.gp_cookie() right after the unlink; only the unlinker writes it
};

std::atomic<std::uint64_t> g_reclaimed_before_cookie{0};

void reclaim_node(void* p) {
  auto* n = static_cast<node*>(p);
  if (!n->domain->gp_elapsed(n->cookie)) {
    g_reclaimed_before_cookie.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a tally.
  }
  delete n;  // ~tracked checks, then poisons, the canary and counts the id
}

constexpr std::size_t kSlots = 16;
constexpr int kCanaryReads = 32;
constexpr std::size_t kReadsPerWrite = 4;  // for mixed threads

struct safety_config {
  unsigned readers = 0;   // threads that only read
  unsigned writers = 0;   // threads that only replace and retire
  unsigned mixed = 0;     // threads that replace once, then read kReadsPerWrite times, in a loop
  std::size_t reads = 0;  // read sections per reader
  std::size_t writes = 0; // replacements per writer or mixed thread
  grace::domain_options options;
  // If set, a separate thread flips it between failing every allocation and not.
  gt::failing_allocator* toggled_allocator = nullptr;
};

// Runs the harness and checks it; returns the domain's final stats.
grace::domain_stats run_safety(const safety_config& config) {
  g_reclaimed_before_cookie.store(0, std::memory_order_relaxed);  // Relaxed: no threads yet.
  const unsigned writing_threads = config.writers + config.mixed;
  const std::size_t ids = kSlots + writing_threads * config.writes;
  gt::instance_tracker tracker(ids);
  grace::domain d(config.options);
  std::array<std::atomic<node*>, kSlots> slots;
  for (std::size_t i = 0; i < kSlots; ++i) {
    // Relaxed: the threads that read the slots are created afterwards (thread start orders it).
    slots[i].store(new node(tracker, i, d), std::memory_order_relaxed);
  }
  std::atomic<std::uint64_t> bad_reads{0};

  const auto read_once = [&](std::size_t i) {
    auto g = d.pin();
    // Acquire: the node's fields were written before a writer published it; pairs with the
    // AcqRel exchange in replace_once().
    const node* n = slots[i % kSlots].load(std::memory_order_acquire);
    const std::size_t id = n->payload.id();
    for (int k = 0; k < kCanaryReads; ++k) {
      if (!n->payload.intact() || n->payload.id() != id) {
        bad_reads.fetch_add(1, std::memory_order_relaxed);  // Relaxed: read after the joins.
        return;
      }
    }
    if (i % 64 == 0) {
      std::this_thread::yield();  // be preempted while pinned: the widest window
      if (!n->payload.intact() || n->payload.id() != id) {
        bad_reads.fetch_add(1, std::memory_order_relaxed);  // Relaxed: as above.
      }
    }
  };
  const auto replace_once = [&](unsigned writer, std::size_t j) {
    node* fresh = new node(tracker, kSlots + writer * config.writes + j, d);
    // AcqRel: Release publishes fresh's fields to readers (pairs with the Acquire load in
    // read_once()); Acquire sees the old node's construction by another writer before this
    // thread writes its cookie and retires it.
    node* old = slots[(writer * 7 + j) % kSlots].exchange(fresh, std::memory_order_acq_rel);
    old->cookie = d.gp_cookie();
    d.retire(old, &reclaim_node, sizeof(node));
  };

  std::atomic<bool> stop_toggler{false};
  std::thread toggler;
  if (config.toggled_allocator != nullptr) {
    toggler = std::thread([&] {
      bool failing = false;
      // Relaxed: a stop flag; the joins order everything else.
      while (!stop_toggler.load(std::memory_order_relaxed)) {
        failing = !failing;
        config.toggled_allocator->fail_all(failing);
        std::this_thread::sleep_for(200us);
      }
      config.toggled_allocator->fail_all(false);
    });
  }

  {
    gt::watchdog dog(kNoDeadlock, "safety harness threads");
    const unsigned threads = config.readers + config.writers + config.mixed;
    gt::run_threads(threads, [&](unsigned t) {
      if (t < config.readers) {
        for (std::size_t i = 0; i < config.reads; ++i) read_once(t + 5 * i);
      } else if (t < config.readers + config.writers) {
        for (std::size_t j = 0; j < config.writes; ++j) replace_once(t - config.readers, j);
      } else {
        for (std::size_t j = 0; j < config.writes; ++j) {
          replace_once(t - config.readers, j);
          for (std::size_t r = 0; r < kReadsPerWrite; ++r) read_once(t + 3 * j + r);
        }
      }
    });
  }
  if (toggler.joinable()) {
    stop_toggler.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
    toggler.join();
  }
  for (std::atomic<node*>& slot : slots) {
    // Relaxed: every other thread has been joined.
    node* last = slot.exchange(nullptr, std::memory_order_relaxed);
    last->cookie = d.gp_cookie();
    d.retire(last, &reclaim_node, sizeof(node));
  }
  d.barrier();

  EXPECT_EQ(bad_reads.load(std::memory_order_relaxed), 0u)  // Relaxed: after the joins.
      << "a reader saw an object reclaimed while it held the guard it loaded it under";
  // Relaxed: read after barrier(), which ordered every deleter before it.
  EXPECT_EQ(g_reclaimed_before_cookie.load(std::memory_order_relaxed), 0u)
      << "a deleter ran before the cookie taken right after the unlink had elapsed";
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_TRUE(tracker.each_destroyed_once(0, ids));
  const grace::domain_stats s = d.stats();
  EXPECT_EQ(s.reclaimed, ids);
  EXPECT_EQ(s.pending_objects, 0u);
  EXPECT_LE(s.peak_pending_objects, s.retired) << "more objects pending than were ever retired";
  return s;
}

TEST(DomainStress, ReadersNeverSeeAReclaimedObject) {
  safety_config config;
  config.readers = 4;
  config.writers = 2;
  config.reads = gt::iterations(800'000, 400'000);
  config.writes = gt::iterations(400'000, 200'000);
  // A small soft limit: grace periods start all the time, so reclamation overlaps reading.
  config.options = {.drain_interval = 1ms, .soft_limit_objects = 4096};
  run_safety(config);
}

TEST(DomainStress, EightThreadsOnTwoCoresReadAndRetireWithoutFailures) {
  safety_config config;
  config.mixed = 8;
  config.writes = gt::iterations(60'000, 30'000);
  config.options = {.drain_interval = 1ms, .soft_limit_objects = 4096};
  run_safety(config);
}

TEST(DomainStress, ReadersNeverSeeAReclaimedObjectWithPerObjectBatching) {
  safety_config config;
  config.readers = 2;
  config.writers = 2;
  config.reads = gt::iterations(300'000, 150'000);
  config.writes = gt::iterations(20'000, 10'000);
  config.options = {.drain_interval = 1ms, .batching = grace::batching::per_object};
  run_safety(config);
}

TEST(DomainStress, ReadersNeverSeeAnObjectReclaimedOnTheEmergencyPath) {
  gt::failing_allocator allocator;
  allocator.fail_all(true);
  safety_config config;
  config.readers = 2;
  config.writers = 2;
  config.reads = gt::iterations(200'000, 100'000);
  config.writes = gt::iterations(5'000, 2'500);
  config.options = {.drain_interval = 1ms, .allocator = allocator.get()};
  const grace::domain_stats s = run_safety(config);
  EXPECT_EQ(s.emergency_frees, kSlots + 2 * config.writes)
      << "with no block memory every object takes the emergency path";
}

TEST(DomainStress, ReadersNeverSeeAReclaimedObjectWhileBlockAllocationsFailOnAndOff) {
  gt::failing_allocator allocator;
  safety_config config;
  config.readers = 2;
  config.writers = 2;
  config.reads = gt::iterations(800'000, 400'000);
  config.writes = gt::iterations(200'000, 100'000);
  config.options = {.drain_interval = 1ms, .soft_limit_objects = 4096,
                    .allocator = allocator.get()};
  config.toggled_allocator = &allocator;
  run_safety(config);
  EXPECT_EQ(allocator.live_allocations(), 0);
}

// ---------------------------------------------------------------------------------------------
// Exactly once under contention.

void delete_tracked(void* p) { delete static_cast<gt::tracked*>(p); }

TEST(DomainStress, EveryObjectRetiredUnderContentionIsReclaimedExactlyOnce) {
  // Limits low enough that retirers cross both, inside and outside read sections.
  constexpr unsigned kRetirers = 4;
  constexpr std::size_t kChunk = 4096;
  const std::size_t per_thread =
      std::max(kChunk, gt::iterations(600'000, 300'000) / kChunk * kChunk);
  const std::size_t total = kRetirers * per_thread;
  gt::instance_tracker tracker(total);
  grace::domain d({.drain_interval = 1ms, .soft_limit_objects = 8192,
                   .hard_limit_objects = 32768});
  std::atomic<unsigned> retirers_done{0};
  std::atomic<std::uint64_t> chunks_not_reclaimed_by_barrier{0};

  gt::watchdog dog(kNoDeadlock, "retirers and barrier() callers");
  gt::run_threads(kRetirers + 1, [&](unsigned t) {
    if (t == kRetirers) {
      // A reader that keeps entering short read sections, so grace periods have to wait.
      std::atomic<std::uint64_t> sink{0};
      // Relaxed: a stop flag; the joins order everything else.
      while (retirers_done.load(std::memory_order_relaxed) != kRetirers) {
        auto g = grace::pin();
        // Relaxed: busy work inside the section.
        for (int i = 0; i < 256; ++i) sink.fetch_add(1, std::memory_order_relaxed);
      }
      return;
    }
    const std::size_t first_id = t * per_thread;
    for (std::size_t chunk = first_id; chunk < first_id + per_thread; chunk += kChunk) {
      for (std::size_t id = chunk; id < chunk + kChunk; ++id) {
        switch (id % 4) {
          case 0: {
            auto g = d.pin();
            d.retire(new gt::tracked(tracker, id));
            break;
          }
          case 1:
            d.retire(new gt::tracked(tracker, id), &delete_tracked, sizeof(gt::tracked));
            break;
          case 2: {
            auto g = grace::pin();
            d.retire(new gt::tracked(tracker, id), &delete_tracked, sizeof(gt::tracked));
            break;
          }
          default:
            d.retire(new gt::tracked(tracker, id));
            break;
        }
      }
      // Every other chunk, this thread's own barrier must cover what it just retired.
      if ((chunk / kChunk) % 2 == t % 2) {
        d.barrier();
        if (!tracker.each_destroyed_once(chunk, chunk + kChunk)) {
          // Relaxed: a tally read after the joins.
          chunks_not_reclaimed_by_barrier.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    retirers_done.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a stop flag.
  });
  d.barrier();
  // Relaxed: after the joins.
  EXPECT_EQ(chunks_not_reclaimed_by_barrier.load(std::memory_order_relaxed), 0u)
      << "barrier() returned before the objects its caller retired were reclaimed";
  EXPECT_TRUE(tracker.each_destroyed_once(0, total));
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  const grace::domain_stats s = d.stats();
  EXPECT_EQ(s.retired, total);
  EXPECT_EQ(s.reclaimed, total);
  EXPECT_EQ(s.pending_objects, 0u);
  EXPECT_LE(s.peak_pending_objects, s.retired) << "more objects pending than were ever retired";
  EXPECT_GE(s.forced_drains, 1u);
}

TEST(DomainStress, PeakPendingNeverExceedsWhatWasRetired) {
  // Many small hand-ins (per-object batching: every retire() hands a block to the engine)
  // from more threads than cores, while the worker reclaims: peak_pending_objects is raised
  // from counters that other threads move meanwhile, and must still never exceed retired.
  constexpr unsigned kThreads = 8;
  const std::size_t per_thread = gt::iterations(80'000, 40'000);
  gt::instance_tracker tracker(kThreads * per_thread);
  grace::domain d({.drain_interval = 1ms, .batching = grace::batching::per_object});
  gt::run_threads(kThreads, [&](unsigned t) {
    for (std::size_t i = 0; i < per_thread; ++i) {
      d.retire(new gt::tracked(tracker, t * per_thread + i));
    }
  });
  d.barrier();
  const grace::domain_stats s = d.stats();
  EXPECT_EQ(s.retired, kThreads * per_thread);
  EXPECT_LE(s.peak_pending_objects, s.retired) << "more objects pending than were ever retired";
  EXPECT_LE(s.peak_pending_bytes, kThreads * per_thread * sizeof(gt::tracked));
  EXPECT_TRUE(tracker.each_destroyed_once(0, kThreads * per_thread));
}

// ---------------------------------------------------------------------------------------------
// The pending bound.

struct flood_object {
  flood_object(gt::instance_tracker& tracker, std::size_t id) : payload(tracker, id) {}
  gt::tracked payload;
  std::array<std::byte, 96> ballast{};  // makes an unbounded backlog show in RSS
};

TEST(DomainStress, PendingObjectsStayUnderTheHardLimitDuringAFlood) {
  constexpr std::size_t kSoft = 16 * 1024;
  constexpr std::size_t kHard = 64 * 1024;
  constexpr unsigned kFlooders = 4;
  const std::uint64_t shards = grace::detail::cpu_shard_count();
  // How far over the hard limit a correct domain may still be seen (documented bound):
  //   + kFlooders blocks: each flooder may submit one block after the last limit check it
  //     passed, before its own submission is counted (checks and submissions race);
  //   + 4 blocks per shard (the "small factor"): a forced drain or a barrier submits every
  //     shard's open block at once, and a lost put-back race submits a block early;
  //   + one in-flight batch adds nothing further: blocks the GP thread or the worker holds
  //     are still counted in pending_objects until their deleters ran, so they are inside
  //     the hard limit already.
  const std::uint64_t slack = (kFlooders + 4 * shards) * kCapacity;
  const std::uint64_t bound = kHard + slack;
  const std::size_t per_flooder = gt::iterations(1'000'000, 500'000);
  const std::size_t total = kFlooders * per_flooder;

  gt::instance_tracker tracker(total);
  grace::domain d({.drain_interval = 1ms, .soft_limit_objects = kSoft,
                   .hard_limit_objects = kHard});
  const std::size_t rss_before = gt::current_rss_bytes();

  std::atomic<unsigned> flooders_done{0};
  std::uint64_t max_sampled_pending = 0;
  std::size_t max_rss = rss_before;
  int stalls_that_met_back_pressure = 0;

  gt::watchdog dog(kNoDeadlock, "retire flood against a hard limit");
  gt::run_threads(kFlooders + 2, [&](unsigned t) {
    // Relaxed (flooders_done, all uses): a stop flag; the joins order everything else.
    if (t == kFlooders) {
      // Monitor: samples the backlog (and RSS) until the flood is over.
      // stats() reads two counters; if this thread is preempted between the two reads, one
      // sample can overstate the backlog by whatever was reclaimed meanwhile. The smaller of
      // two back-to-back samples filters out such a single interrupted read.
      const auto sample_pending = [&] {
        const std::uint64_t first = d.stats().pending_objects;
        return std::min(first, d.stats().pending_objects);
      };
      for (std::uint64_t sample = 0;
           flooders_done.load(std::memory_order_relaxed) != kFlooders; ++sample) {
        max_sampled_pending = std::max(max_sampled_pending, sample_pending());
        if (sample % 64 == 0) max_rss = std::max(max_rss, gt::current_rss_bytes());
        std::this_thread::sleep_for(50us);
      }
      max_sampled_pending = std::max(max_sampled_pending, sample_pending());
      return;
    }
    if (t == kFlooders + 1) {
      // Staller: holds a read section (so no grace period can end) until the flooders run
      // into back-pressure, three times. They must then wait rather than keep retiring. A
      // stall that begins while flooders still wait from the last one (waiting down to the
      // soft limit, which a grace period that ended meanwhile may not have reached) finds
      // the others joining them above the soft limit: the backlog then stops between the
      // two limits, and that is back-pressure too.
      for (int stall = 0; stall < 3; ++stall) {
        bool reached = false;
        {
          auto g = grace::pin();
          const std::uint64_t waits_before = d.stats().backpressure_waits;
          const auto deadline = std::chrono::steady_clock::now() + 5s;
          while (flooders_done.load(std::memory_order_relaxed) != kFlooders &&
                 std::chrono::steady_clock::now() < deadline) {
            const grace::domain_stats now = d.stats();
            if (now.pending_objects >= kHard ||
                (now.pending_objects >= kSoft && now.backpressure_waits > waits_before)) {
              reached = true;
              std::this_thread::sleep_for(5ms);  // let every flooder run into the limit
              break;
            }
            std::this_thread::sleep_for(100us);
          }
        }
        stalls_that_met_back_pressure += reached ? 1 : 0;
        std::this_thread::sleep_for(5ms);
      }
      return;
    }
    for (std::size_t i = 0; i < per_flooder; ++i) {
      d.retire(new flood_object(tracker, t * per_flooder + i));
    }
    flooders_done.fetch_add(1, std::memory_order_relaxed);
  });
  d.barrier();

  const grace::domain_stats s = d.stats();
  EXPECT_GE(stalls_that_met_back_pressure, 1) << "the flood never ran into back-pressure";
  EXPECT_LE(max_sampled_pending, bound)
      << "hard limit " << kHard << ", slack " << slack << " (" << shards << " shards)";
  EXPECT_LE(s.peak_pending_objects, bound)
      << "hard limit " << kHard << ", slack " << slack << " (" << shards << " shards)";
  EXPECT_GE(s.peak_pending_objects, kHard);
  EXPECT_GE(s.forced_drains, 1u);
  EXPECT_GE(s.backpressure_waits, 1u);
  EXPECT_EQ(s.retired, total);
  EXPECT_EQ(s.reclaimed, total);
  EXPECT_TRUE(tracker.each_destroyed_once(0, total));
  if (!gt::kSanitized) {
    // An unbounded backlog would hold total x 128-byte chunks (about 500 MiB); the bound
    // holds about 9 MiB of objects, but glibc's per-thread arenas keep freed chunks, and
    // growth of 25-70 MiB was measured with a correct domain. Sanitizers keep freed memory in
    // quarantine, so RSS says nothing there.
    constexpr std::size_t kMaxGrowth = std::size_t{128} << 20;
    EXPECT_LT(max_rss - rss_before, kMaxGrowth)
        << "RSS grew by " << ((max_rss - rss_before) >> 20) << " MiB during the flood";
  }
}

}  // namespace
