// Tests for fork() in a process that uses grace::domain: the child keeps using its domains,
// and every object retired before the fork is reclaimed exactly once in the child (its copy)
// and exactly once in the parent.
//
// Order: retired objects across the fork (the global domain, with work in every pipeline
// stage); a reader thread inside a read section at the fork (also holding a postponed
// emergency reclamation); a batch held for another thread's grace period at the fork;
// another thread retiring at the fork; domains created and destroyed
// around the fork; a fork in the child; a fork while another thread builds the global domain;
// misuse (fork() inside a read section or a deleter).
//
// Conventions:
//   - The child never returns into GoogleTest: it runs a function whose int result is its
//     exit code (0 = passed; each failure prints a line on stderr and has its own code), and
//     ends with _exit(). alarm() turns a hang in the child into SIGALRM, which the parent
//     reports; a watchdog covers the parent's fork() and waitpid().
//   - Under AddressSanitizer (GCC 12's libasan takes no lock around fork()), a child whose
//     parent had another thread inside malloc at the fork can deadlock in its own malloc.
//     Threads of these tests therefore do not allocate while the main thread forks: the
//     engine threads are parked at the fork, the test threads are running (not starting:
//     a starting thread allocates) and either wait on flags or take memory from mmap().
#include "grace/reclaim/domain.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <latch>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "grace/reclaim/read_guard.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;

// Under ThreadSanitizer the child of a fork() here starts threads (its domains' engines)
// although its parent had several: GCC 12's libtsan does not support that (the child dies on
// a reused thread id) and checks nothing in such a child anyway. Those tests are compiled
// only without TSan (the debug and asan presets run them); the death tests run everywhere.

using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 60s;         // watchdog budget for the parent's fork and wait
constexpr std::size_t kCapacity = grace::detail::kRetireBlockCapacity;

// The two helpers below serve only tests compiled without TSan (hence [[maybe_unused]]).

// In the child: reports a failed check and returns its exit code (or 0 if it passed).
[[maybe_unused]] int check(const ::testing::AssertionResult& result, int code, const char* what) {
  if (result) return 0;
  std::fprintf(stderr, "child: %s: %s\n", what, result.message());
  return code;
}

[[maybe_unused]] void retire_range(grace::domain& d, gt::instance_tracker& tracker,
                                   std::size_t first, std::size_t last) {
  for (std::size_t id = first; id < last; ++id) d.retire(new gt::tracked(tracker, id));
}

// --- retired objects across the fork -------------------------------------------------------

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, ChildAndParentEachReclaimEveryObjectRetiredBeforeTheForkExactlyOnce) {
  grace::domain& d = grace::domain::global();
  // Ids: [0, before) retired before the fork (half by another thread); [before, child_end)
  // retired in the child only; [child_end, parent_end) in the parent after the fork.
  const std::size_t before = gt::iterations(24 * kCapacity, 6 * kCapacity);
  const std::size_t child_end = before + gt::iterations(8 * kCapacity, 2 * kCapacity);
  const std::size_t parent_end = child_end + gt::iterations(8 * kCapacity, 2 * kCapacity);
  gt::instance_tracker tracker(parent_end);

  // A reader holds back grace periods while the objects are retired, so that at the fork
  // blocks wait in every stage: open in shards, submitted, in the GP thread's batch, in the
  // worker's queue. It leaves shortly after fork() begins (fork() waits for the grace period
  // it holds back, then for the engine threads to park).
  std::latch reader_in(1);
  std::atomic<bool> leave{false};
  std::thread reader([&] {
    auto guard = grace::pin();
    reader_in.count_down();
    // Relaxed: a flag polled until set; nothing is published through it.
    while (!leave.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
  });
  reader_in.wait();
  // Lets the reader go 20 ms after the fork begins. Started (and running) before the fork:
  // see the file comment.
  std::latch releaser_in(1);
  std::atomic<bool> forking{false};
  std::thread releaser([&] {
    releaser_in.count_down();
    // Relaxed: a flag polled until set; nothing is published through it.
    while (!forking.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(20ms);
    leave.store(true, std::memory_order_relaxed);  // Relaxed: as above.
  });
  releaser_in.wait();
  std::thread other([&] { retire_range(d, tracker, 0, before / 2); });
  retire_range(d, tracker, before / 2, before);
  other.join();
  forking.store(true, std::memory_order_relaxed);  // Relaxed: as above.

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() and the child of a process using the global domain");
    status = gt::run_in_child([&] {
      if (int code = check(tracker.none_destroyed(before, parent_end), 1,
                           "objects retired only later were already destroyed")) {
        return code;
      }
      retire_range(d, tracker, before, child_end);
      d.synchronize();
      d.barrier();
      if (int code = check(tracker.each_destroyed_once(0, child_end), 2,
                           "after synchronize() + barrier() in the child")) {
        return code;
      }
      if (tracker.corrupt_destructions() != 0) {
        std::fprintf(stderr, "child: %llu object(s) destroyed twice\n",
                     static_cast<unsigned long long>(tracker.corrupt_destructions()));
        return 3;
      }
      // A thread started in the child registers, pins and retires like any other.
      const std::uint64_t destroyed = tracker.destroyed();
      std::thread late([&] {
        auto guard = d.pin();
        d.retire(new gt::tracked(tracker, parent_end));  // an id past the tracked range
      });
      late.join();
      d.barrier();
      if (tracker.destroyed() != destroyed + 1) {
        std::fprintf(stderr, "child: an object retired by a thread of the child was not "
                             "reclaimed by barrier()\n");
        return 4;
      }
      return 0;
    });
  }
  releaser.join();
  reader.join();
  EXPECT_TRUE(gt::exited_cleanly(status));

  retire_range(d, tracker, child_end, parent_end);
  d.synchronize();
  d.barrier();
  EXPECT_TRUE(tracker.each_destroyed_once(0, before));
  EXPECT_TRUE(tracker.none_destroyed(before, child_end));  // only the child retired them
  EXPECT_TRUE(tracker.each_destroyed_once(child_end, parent_end));
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
  EXPECT_EQ(tracker.live(), 0);
}
#endif

// --- a reader inside a read section at the fork --------------------------------------------

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, AThreadInsideAReadSectionAtTheForkDoesNotHoldUpTheChildsGracePeriods) {
  // No drain timer: the objects stay in open blocks, so no grace period is in flight at the
  // fork and fork() need not wait for the reader.
  grace::domain d({.drain_interval = 10s});
  grace::domain::global().barrier();  // the global domain (if earlier tests used it) idles too
  const std::size_t ids = kCapacity / 2;
  gt::instance_tracker tracker(ids);
  retire_range(d, tracker, 0, ids);

  std::latch reader_in(1);
  std::atomic<bool> forked{false};
  std::thread reader([&] {
    auto guard = grace::pin();
    reader_in.count_down();
    // Until the parent has forked (or 5 s, should a grace period be in flight after all:
    // then fork() waits for this section and the test covers less, but passes).
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    // Relaxed: a flag polled until set; nothing is published through it.
    while (!forked.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
  });
  reader_in.wait();

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while another thread is inside a read section");
    status = gt::run_in_child([&] {
      // The reader thread does not exist here, but liburcu's registry still listed it
      // inside its read section: without grace's fork handling this waits for ever.
      d.synchronize();
      d.barrier();
      return check(tracker.each_destroyed_once(0, ids), 1, "after barrier() in the child");
    });
  }
  forked.store(true, std::memory_order_relaxed);  // Relaxed: as above.
  reader.join();
  EXPECT_TRUE(gt::exited_cleanly(status));
  EXPECT_TRUE(tracker.none_destroyed(0, ids));  // the parent has not run barrier() yet
  d.barrier();
  EXPECT_TRUE(tracker.each_destroyed_once(0, ids));
}
#endif

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, TheChildReclaimsWhatAThreadPostponedToTheEndOfItsReadSection) {
  // No memory for a retire block: a thread that retires inside a read section postpones the
  // reclamation to the end of its section (the emergency path). That thread does not exist in
  // the child, whose barrier() must neither wait for it nor lose the object.
  gt::failing_allocator memory;
  grace::domain d({.drain_interval = 10s, .allocator = memory.get()});
  grace::domain::global().barrier();  // idle: no grace period in flight at the fork
  gt::instance_tracker tracker(1);
  memory.fail_all(true);

  std::latch retired(1);
  std::atomic<bool> forked{false};
  std::thread reader([&] {
    auto guard = grace::pin();
    d.retire(new gt::tracked(tracker, 0));  // postponed: no block, inside a read section
    retired.count_down();
    // As in the test above: until the parent has forked, at most 5 s.
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    // Relaxed: a flag polled until set; nothing is published through it.
    while (!forked.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
  });
  retired.wait();

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while a thread holds a postponed reclamation");
    status = gt::run_in_child([&] {
      d.barrier();
      return check(tracker.each_destroyed_once(0, 1), 1, "the postponed object in the child");
    });
  }
  forked.store(true, std::memory_order_relaxed);  // Relaxed: as above.
  reader.join();  // its guard's end reclaims the object in the parent
  EXPECT_TRUE(gt::exited_cleanly(status));
  d.barrier();
  memory.fail_all(false);
  EXPECT_TRUE(tracker.each_destroyed_once(0, 1));
  EXPECT_GE(d.stats().emergency_frees, 1u);
}
#endif

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, ABatchHeldForAnotherThreadsGracePeriodAtTheForkIsFreedInTheChildAtOnce) {
  // The parent's GP thread holds the batch for up to 10 s, for a grace period another of its
  // threads may run. The child has no such thread: its GP thread must run its own grace period
  // for the batch, not wait out the parent's hold.
  gt::instance_tracker tracker(1);
  grace::domain d({.drain_interval = 1ms, .requested_gp_delay = 10s});
  grace::domain::global().barrier();  // idle: no grace period in flight at the fork
  std::thread([&] { d.synchronize(); }).join();  // a grace period run elsewhere, just now
  d.retire(new gt::tracked(tracker, 0));
  ASSERT_TRUE(gt::eventually([&] { return d.stats().blocks == 1; }, 3s));
  std::this_thread::sleep_for(50ms);
  ASSERT_EQ(tracker.destroyed_count(0), 0u) << "not held: the test would show nothing";

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while the GP thread holds a batch");
    status = gt::run_in_child([&] {
      if (!gt::eventually([&] { return tracker.destroyed_count(0) == 1; }, 5s)) {
        std::fprintf(stderr, "child: the held batch was not freed within 5 s (the hold: 10 s)\n");
        return 1;
      }
      d.barrier();
      return check(tracker.each_destroyed_once(0, 1), 2, "the held object in the child");
    });
  }
  EXPECT_TRUE(gt::exited_cleanly(status));
  d.barrier();
  EXPECT_TRUE(tracker.each_destroyed_once(0, 1));
}
#endif

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
// A deleter that runs until the test lets it return: the parent forks while a thread is in it.
std::atomic<bool> held_deleter_running{false};
std::atomic<bool> held_deleter_may_return{false};
void held_deleter(void*) noexcept {
  // Release/Acquire (both flags): only sequence the test's steps.
  held_deleter_running.store(true, std::memory_order_release);
  while (!held_deleter_may_return.load(std::memory_order_acquire)) {
    std::this_thread::sleep_for(1ms);
  }
}
void ignore_object(void*) noexcept {}

TEST(DomainFork, AChildsBackPressureWaitEndsThoughAnObjectWasBeingReclaimedAtTheFork) {
  // No memory for a retire block: retire() outside a read section runs a grace period and
  // then the deleter on its own thread (the emergency path). A thread is inside that deleter
  // at the fork: in the child its object stays retired and is never reclaimed, and its bytes
  // are over the soft limit. A back-pressure wait in the child waits for the backlog to fall
  // under the soft limit: it must not wait for that object.
  constexpr std::size_t kSoftBytes = 100;
  constexpr std::size_t kHardBytes = std::size_t{1} << 20;
  gt::failing_allocator memory;
  grace::domain d({.drain_interval = 10s, .soft_limit_bytes = kSoftBytes,
                   .hard_limit_bytes = kHardBytes, .allocator = memory.get()});
  grace::domain::global().barrier();  // idle: no grace period in flight at the fork
  static std::uint8_t in_flight;
  memory.fail_all(true);
  std::thread reclaimer([&] { d.retire(&in_flight, &held_deleter, 10 * kSoftBytes); });
  while (!held_deleter_running.load(std::memory_order_acquire)) std::this_thread::sleep_for(1ms);
  memory.fail_all(false);

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while a thread runs an emergency deleter");
    status = gt::run_in_child(
        [&] {
          static std::uint8_t past_the_hard_limit;
          // Crosses the hard limit: returns once the child's worker has reclaimed it and
          // the backlog is under the soft limit.
          d.retire(&past_the_hard_limit, &ignore_object, 2 * kHardBytes);
          return check(d.stats().backpressure_waits >= 1
                           ? ::testing::AssertionSuccess()
                           : ::testing::AssertionFailure() << "retire() did not wait",
                       1, "back-pressure in the child");
        },
        /*alarm_seconds=*/20);
  }
  held_deleter_may_return.store(true, std::memory_order_release);
  reclaimer.join();
  EXPECT_TRUE(gt::exited_cleanly(status)) << "SIGALRM: the child's wait never ended";
  d.barrier();
  EXPECT_EQ(d.stats().pending_bytes, 0u);
}
#endif

// --- another thread retiring at the fork ----------------------------------------------------

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
// Every request mapped on its own: the retiring thread below must not call malloc (see the
// file comment).
void* map_pages(std::size_t bytes, std::size_t, void*) noexcept {
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return memory == MAP_FAILED ? nullptr : memory;
}
void unmap_pages(void* memory, std::size_t bytes, void*) noexcept { ::munmap(memory, bytes); }

// Objects are the bytes of one array: a deleter counts the reclamations of its byte, and
// retire() needs no allocation.
void count_reclaim(void* object) noexcept {
  std::atomic_ref<std::uint8_t>(*static_cast<std::uint8_t*>(object))
      .fetch_add(1, std::memory_order_relaxed);  // Relaxed: read after barrier().
}

TEST(DomainFork, TheChildReclaimsExactlyOnceWhatAnotherThreadRetiredBeforeTheFork) {
  grace::domain d({.allocator = {&map_pages, &unmap_pages, nullptr}});
  const std::size_t objects = gt::iterations(std::size_t{1} << 23, std::size_t{1} << 21);
  std::vector<std::uint8_t> reclaimed(objects, 0);
  // How many retire() calls have returned. Release: the retire() happened before; pairs
  // with the Acquire load in the child (the copy happens at one instant of the parent).
  std::atomic<std::size_t> retired{0};
  std::atomic<bool> stop{false};
  std::latch retirer_in(1);  // running before the first fork: see the file comment
  std::thread retirer([&] {
    retirer_in.count_down();
    // Relaxed: a stop flag.
    for (std::size_t i = 0; i < objects && !stop.load(std::memory_order_relaxed); ++i) {
      d.retire(&reclaimed[i], &count_reclaim);
      // Release: see above.
      retired.store(i + 1, std::memory_order_release);
    }
  });

  retirer_in.wait();
  const int forks = static_cast<int>(gt::iterations(30, 10));
  {
    gt::watchdog dog(kNoDeadlock, "forks while another thread retires");
    for (int f = 0; f < forks; ++f) {
      const int status = gt::run_in_child([&] {
        // Acquire: see above.
        const std::size_t done = retired.load(std::memory_order_acquire);
        // The retirer does not exist here; it may have held its CPU's shard at the fork.
        d.barrier();
        for (std::size_t i = 0; i < done; ++i) {
          if (reclaimed[i] != 1) {
            std::fprintf(stderr, "child: object %zu of %zu retired before the fork was "
                                 "reclaimed %u times\n", i, done, unsigned{reclaimed[i]});
            return 1;
          }
        }
        // The one in flight at the fork (its retire() had not returned) may be lost here;
        // nothing after it was retired in this copy.
        for (std::size_t i = done + 1; i < objects; ++i) {
          if (reclaimed[i] != 0) {
            std::fprintf(stderr, "child: object %zu, never retired, was reclaimed\n", i);
            return 2;
          }
        }
        return 0;
      });
      ASSERT_TRUE(gt::exited_cleanly(status)) << "fork " << f << " of " << forks;
    }
  }
  stop.store(true, std::memory_order_relaxed);  // Relaxed: a stop flag.
  retirer.join();
  d.barrier();
  // Relaxed: after the join.
  const std::size_t done = retired.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < objects; ++i) {
    ASSERT_EQ(reclaimed[i], i < done ? 1 : 0) << "object " << i << " of " << done;
  }
}
#endif

// --- domains created and destroyed around the fork -----------------------------------------

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, ADomainCreatedBeforeTheForkCanBeDestroyedInTheChildAndANewOneCreated) {
  auto d = std::make_unique<grace::domain>();
  const std::size_t ids = 3 * kCapacity;
  gt::instance_tracker tracker(2 * ids);
  retire_range(*d, tracker, 0, ids);

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "destroying and creating domains in the child");
    status = gt::run_in_child([&] {
      d.reset();  // barrier(), then joins the threads restarted in the child
      if (int code = check(tracker.each_destroyed_once(0, ids), 1, "after ~domain()")) {
        return code;
      }
      grace::domain fresh;
      retire_range(fresh, tracker, ids, 2 * ids);
      fresh.barrier();
      return check(tracker.each_destroyed_once(ids, 2 * ids), 2, "a domain created in the child");
    });
  }
  EXPECT_TRUE(gt::exited_cleanly(status));
  d.reset();
  EXPECT_TRUE(tracker.each_destroyed_once(0, ids));
  EXPECT_TRUE(tracker.none_destroyed(ids, 2 * ids));
}
#endif

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, TheChildsRestartedReclaimWorkerKeepsItsDomainsNiceValue) {
  grace::domain background({.worker_nice = 19});
  grace::domain normal;
  int status;
  {
    gt::watchdog dog(kNoDeadlock, "looking at the child's engine threads");
    status = gt::run_in_child([&] {
      // The child's only threads are the forking one and the engines' restarted ones, which
      // name themselves as they start: one worker at 19 (this domain's), and the rest
      // (the other domain's, the global one's if it exists) at the forking thread's 0.
      std::map<pid_t, int> workers;
      const bool started = gt::eventually(
          [&] {
            workers = gt::threads_named("grace-reclaim");
            return workers.size() >= 2;
          },
          kNoDeadlock);
      if (!started) return gt::child_failure(1, "reclaim workers restarted", workers.size());
      const auto at_19 = std::count_if(workers.begin(), workers.end(),
                                       [](const auto& worker) { return worker.second == 19; });
      if (at_19 != 1) return gt::child_failure(2, "reclaim workers at nice 19", at_19);
      return 0;
    });
  }
  EXPECT_TRUE(gt::exited_cleanly(status));
}
#endif

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
TEST(DomainFork, AChildCanForkAgain) {
  grace::domain& d = grace::domain::global();
  const std::size_t ids = 2 * kCapacity;
  gt::instance_tracker tracker(3 * ids);
  retire_range(d, tracker, 0, ids);

  int status;
  {
    gt::watchdog dog(kNoDeadlock, "a fork in the child of a fork");
    status = gt::run_in_child([&] {
      retire_range(d, tracker, ids, 2 * ids);
      const int grandchild = gt::run_in_child([&] {
        retire_range(d, tracker, 2 * ids, 3 * ids);
        d.barrier();
        return check(tracker.each_destroyed_once(0, 3 * ids), 1, "in the grandchild");
      });
      if (!(WIFEXITED(grandchild) && WEXITSTATUS(grandchild) == 0)) {
        std::fprintf(stderr, "child: the grandchild failed (wait status %d)\n", grandchild);
        return 2;
      }
      d.barrier();
      return check(tracker.each_destroyed_once(0, 2 * ids), 3, "in the child");
    });
  }
  EXPECT_TRUE(gt::exited_cleanly(status));
  d.barrier();
  EXPECT_TRUE(tracker.each_destroyed_once(0, ids));
}
#endif

// --- one-time initialization across the fork ------------------------------------------------

#if !GRACE_TESTING_TSAN && !GRACE_TESTING_ASAN  // the child starts threads; under ASan threads
                                                // start and exit (allocating) at the fork
// The global domain is built by the first thread that asks for it. A fork() while another
// thread builds it used to copy a half-built function-local static: the child's first
// domain::global() waited for ever on the static's guard (81 of 200 children hung). Each
// trial forks a child of this process, which must not have built the global domain itself:
// run the test in a process of its own (ctest does; or --gtest_filter). The trial's child
// starts the build and forks after a different delay each time, so that some trials fork
// during the build.
TEST(DomainFork, AChildForkedWhileAnotherThreadBuildsTheGlobalDomainCanUseIt) {
  constexpr int kTrials = 100;
  constexpr unsigned kChildAlarmSeconds = 10;
  gt::watchdog dog(kNoDeadlock, "fork() while the global domain is being built");
  for (int trial = 0; trial < kTrials; ++trial) {
    const int status = gt::run_in_child([trial] {
      std::thread builder([] { (void)grace::domain::global(); });
      std::this_thread::sleep_for(std::chrono::microseconds(trial));
      const int grandchild = gt::run_in_child(
          [] {
            grace::domain& d = grace::domain::global();
            d.synchronize();
            d.retire(new int(0));
            d.barrier();
            return 0;
          },
          kChildAlarmSeconds);
      builder.join();
      if (!(WIFEXITED(grandchild) && WEXITSTATUS(grandchild) == 0)) {
        std::fprintf(stderr, "child: forked after %d us, the grandchild failed (wait status %d)\n",
                     trial, grandchild);
        return 1;
      }
      return 0;
    });
    ASSERT_TRUE(gt::exited_cleanly(status)) << "trial " << trial;
  }
}
#endif

// --- misuse ----------------------------------------------------------------------------------

#if !GRACE_TESTING_TSAN  // see above: the child starts threads
// A reader waits inside its section for a thread whose first pin() comes only once fork()
// began, while a synchronize() in flight waits for that reader. With one gate for grace
// periods and thread registration, the fork waited for the grace period and held the
// registration back: nobody could finish.
TEST(DomainFork, AThreadsFirstPinDuringTheForkDoesNotDeadlockAgainstAGracePeriodInFlight) {
  grace::domain& d = grace::domain::global();
  { auto g = grace::pin(); }  // this thread is registered
  std::atomic<bool> forking{false};
  std::atomic<bool> late_pinned{false};
  std::atomic<bool> reader_inside{false};
  // Relaxed, all three: polled flags that only pace the threads; the fork's own waits order
  // everything the test checks.
  std::thread reader([&] {
    auto g = grace::pin();
    reader_inside.store(true, std::memory_order_relaxed);
    while (!late_pinned.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
  });
  while (!reader_inside.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
  std::thread syncer([&] { d.synchronize(); });  // waits for the reader
  std::thread late([&] {
    while (!forking.load(std::memory_order_relaxed)) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(50ms);  // well inside fork()'s prepare handler
    { auto g = grace::pin(); }          // this thread's first pin: it registers
    late_pinned.store(true, std::memory_order_relaxed);
  });
  std::this_thread::sleep_for(50ms);  // the synchronize() is in flight
  int status = -1;
  {
    gt::watchdog dog(kNoDeadlock, "fork() while a first pin() and a grace period wait");
    forking.store(true, std::memory_order_relaxed);
    status = gt::run_in_child([] { return 0; });
    syncer.join();
    reader.join();
    late.join();
  }
  EXPECT_TRUE(gt::exited_cleanly(status));
}
#endif

TEST(DomainForkDeathTest, ForkInsideAReadSectionAbortsNamingTheFix) {
  // threadsafe: the statement runs in a freshly started process (clone and exec, which run
  // no fork handlers), where its own fork() is the one under test.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto guard = grace::pin();
        (void)::fork();
      },
      "fork\\(\\) called inside a read section.*Destroy every read_guard");
}

void fork_from_deleter(void*) { (void)::fork(); }

TEST(DomainForkDeathTest, ForkFromADeleterAbortsNamingTheFix) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        grace::domain d;
        d.retire(&d, &fork_from_deleter);
        d.barrier();
      },
      "fork\\(\\) called from a deleter");
}

}  // namespace
